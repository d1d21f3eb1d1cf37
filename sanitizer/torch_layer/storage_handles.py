"""Reach a lease's storage at retire time, and re-point it to other memory.

Rescue (copy out) and guard (tombstone) both act on the storage of a lease that
something still holds when its bytes are retired. A lease is a weak reference to
its storage (taken at lend, so holding it never keeps a view alive; see
``runtime.storage_of``) and, at retire, a feature swaps the storage's data pointer
(``_swap_data_ptr_``): the lent tensor and every view derived from it then read the
new memory.

Needs private storage APIs (``_swap_data_ptr_``, ``_storage_Use_Count``);
:data:`AVAILABLE` says whether this torch has them.
"""
from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from cuda_hooks import devices
from sanitizer.core import forking
from sanitizer.core.pages import read_max_map_count
from sanitizer.torch_layer import own_ops
from sanitizer.torch_layer.aliasing import alias_view, host_array

_S = torch.UntypedStorage
_API_NAMES = ("_swap_data_ptr_",)
AVAILABLE: bool = all(hasattr(_S, n) for n in _API_NAMES) and hasattr(torch._C, "_storage_Use_Count")
UNAVAILABLE_REASON: Optional[str] = None if AVAILABLE else (
    "this torch lacks UntypedStorage." + "/".join(n for n in _API_NAMES if not hasattr(_S, n))
    + ("" if hasattr(torch._C, "_storage_Use_Count") else " and torch._C._storage_Use_Count"))


def holders(storage: torch.UntypedStorage) -> int:
    """References to ``storage`` from tensors and storages other than the caller's one."""
    return torch._C._storage_Use_Count(storage._cdata) - 1


class _Mapping:
    """One private mapping of the poison file, made with ``mmap(2)`` itself: it keeps no descriptor.

    Python's ``mmap.mmap(fd, ...)`` duplicates the descriptor for every mapping (only Python 3.13
    has ``trackfd=False``, and this project runs on older ones), so a thousand retained stale views
    used to hold a thousand open files and the program's next ``open()`` failed under
    ``ulimit -n 1024``. The kernel keeps the file alive through the mapping alone.

    numpy takes it through ``__array_interface__`` (the array's ``base`` is this object) and torch
    through that array: the storage's deleter holds the array, the array holds this, and the last
    reference gone unmaps it (``__del__``, not ``weakref.finalize``: a finalizer would run at exit
    while a view may still be read).
    """

    __slots__ = ("_address", "_length", "_owner")  # no dict, no weakref: one small GC-tracked object per tombstone

    def __init__(self, owner: "PoisonFile", address: int, length: int):
        self._owner, self._address, self._length = owner, address, length

    @property
    def __array_interface__(self) -> dict:
        """Read once, by ``np.asarray``; made on demand so that no dict lives per tombstone (the GC
        would walk it at every collection)."""
        return {"data": (self._address, False), "shape": (self._length,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        try:
            _libc_munmap(self._address, self._length)
            self._owner._unmapped()
        except Exception:  # interpreter shutdown: the process is going, and its maps with it
            pass


_libc_mmap: Any = None
_libc_munmap: Any = None
_MAP_FAILED = (1 << 64) - 1


def _bind_libc() -> bool:
    """ctypes bindings of ``mmap``/``munmap`` (64-bit Linux only: ``off_t`` is a C long there)."""
    global _libc_mmap, _libc_munmap
    if _libc_mmap is None:
        import ctypes
        import sys

        if sys.maxsize <= 2**32 or not sys.platform.startswith("linux"):
            _libc_mmap = False
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.mmap
        fn.restype = ctypes.c_void_p
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        unmap = libc.munmap
        unmap.restype = ctypes.c_int
        unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc_munmap, _libc_mmap = unmap, fn
    return bool(_libc_mmap)


class PoisonFile:
    """One in-memory file (Linux ``memfd``) of poison bytes that every CPU tombstone maps.

    Each tombstone is a private (copy-on-write) mapping of the file's first
    ``nbytes``: it costs one ``mmap`` call, no file descriptor and no memory of
    its own until someone writes to it, so a thousand retained stale views cost
    the memory of the largest one. The file grows (and is filled) only when a
    larger tombstone is asked for; a different fill byte starts a new file (old
    mappings stay valid).

    Every mapping is one of the process's ``vm.max_map_count`` memory maps (which
    ``malloc`` needs too, one per large allocation): past :attr:`max_maps` live
    mappings (a quarter of that limit), or when ``mmap`` fails, :meth:`map`
    answers None and the caller allocates the tombstone instead (:attr:`fallbacks`
    counts those).
    """

    AVAILABLE: bool = hasattr(os, "memfd_create") and hasattr(mmap, "MAP_PRIVATE")

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a mapping's __del__ may run in a GC inside map()
        self._fd: Optional[int] = None
        self._fill: Optional[int] = None
        self.nbytes = 0  # the shared poison memory: the largest tombstone so far, page-rounded
        self.live = 0  # mappings alive now
        self.fallbacks = 0  # tombstones that could not be mapped (limit reached, mmap failed)
        self.max_maps: Optional[int] = None  # read from the kernel at the first map; tests lower it

    def map(self, nbytes: int, fill: int) -> Optional[np.ndarray]:
        """A writable uint8 array of ``nbytes`` poison bytes, unmapped when the array dies; None when
        no mapping can be made now (the caller allocates the poison instead)."""
        with self._lock:
            if self.max_maps is None:
                self.max_maps = read_max_map_count() // 4
            if self.live >= self.max_maps or not _bind_libc():
                self.fallbacks += 1
                return None
            try:
                if self._fd is None or fill != self._fill:
                    if self._fd is not None:
                        os.close(self._fd)
                        self._fd = None
                    self._fd, self._fill, self.nbytes = os.memfd_create("ownsan-poison", os.MFD_CLOEXEC), fill, 0
                if nbytes > self.nbytes:
                    self._grow(max(nbytes, 2 * self.nbytes))
            except OSError:  # no descriptor left for the file (the program used them all), or no memory
                self.fallbacks += 1
                return None
            address = _libc_mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, self._fd, 0)
            if address is None or address == _MAP_FAILED:
                self.fallbacks += 1
                return None
            self.live += 1
        return np.asarray(_Mapping(self, address, nbytes))

    def _unmapped(self) -> None:
        with self._lock:
            self.live -= 1

    def _grow(self, size: int) -> None:
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        assert self._fd is not None and self._fill is not None
        os.ftruncate(self._fd, size)
        chunk = bytes([self._fill]) * min(1 << 20, size)
        at = self.nbytes
        while at < size:
            at += os.pwrite(self._fd, chunk[: size - at], at)
        self.nbytes = size


POISON = PoisonFile()


class DevicePoison:
    """One block of poison bytes per CUDA device and fill byte, that every CUDA tombstone aliases.

    A tombstone is a view of the block at offset 0 with a storage of its own, whose deleter keeps
    the block alive: a thousand retained stale views (a consumer keeping a layer's weights) cost the
    memory of the largest one, not their sum. The block is allocated and filled on the current
    stream and waited for when it is made (so a view read on any stream sees poison). It is sized
    to the caching allocator's own rounding (512 B, or 2 MiB past 1 MiB), grown by at most a
    quarter past what a tombstone needs (a run of growing tombstones reallocates a few times, and a
    2.2 GB embedding's tombstone holds ~2.2 GB, not the next power of two), and the table keeps it only
    while a tombstone of it lives (each one counted, by a finalizer on its keeper): the last one gone,
    its memory goes back to the allocator (:attr:`nbytes` says what the blocks hold now).

    Why not CUDA's virtual memory API (one physical granule mapped many times): it would cost 2 MiB
    whatever the sizes, but needs the driver API in the deleter of every tombstone, and is not
    reachable from torch; and like the block it is shared memory. In both, a write into a tombstone
    (a stale write, which the dispatch mode reports) lands in the shared bytes: other tombstones then
    read what was written, never a live tensor's bytes.
    """

    MIN_BYTES = 1 << 16
    SMALL, SMALL_ROUND, LARGE_ROUND = 1 << 20, 512, 2 << 20  # the CUDA caching allocator's block sizes

    def __init__(self) -> None:
        # Re-entrant: a tombstone that dies while a view is being made here (a collection in the
        # allocation) gives its count back from this very thread.
        self._lock = threading.RLock()
        self._blocks: Dict[Tuple[int, int], list] = {}  # (device, fill) -> [uint8 block, live tombstones]

    @property
    def nbytes(self) -> int:
        """Device memory the current blocks hold (outgrown blocks still aliased by tombstones aside)."""
        with self._lock:
            return sum(entry[0].numel() for entry in self._blocks.values())

    @classmethod
    def block_size(cls, nbytes: int, current: int = 0) -> int:
        """The size of a new block for an ``nbytes`` tombstone, the current block holding ``current``."""
        want = max(cls.MIN_BYTES, nbytes, min(2 * current, nbytes + nbytes // 4))
        step = cls.SMALL_ROUND if want <= cls.SMALL else cls.LARGE_ROUND
        return -(-want // step) * step

    def view(self, nbytes: int, fill: int, device: torch.device) -> Tuple[torch.Tensor, Any]:
        """``nbytes`` poison bytes on ``device``: a uint8 view of the block with a storage of its own,
        and the object its deleter keeps (weak-referenceable, it dies with the view's storage)."""
        key = (device.index or 0, fill)
        with self._lock:
            entry = self._blocks.get(key)
            if entry is None or entry[0].numel() < nbytes:
                size = self.block_size(nbytes, entry[0].numel() if entry is not None else 0)
                block = devices.empty(size, device)
                block.fill_(fill)
                torch.cuda.current_stream(key[0]).synchronize()  # poisoned before any stream reads a view
                entry = self._blocks[key] = [block, 0]
            view, keeper = alias_view(entry[0], host_array(entry[0]), 0, nbytes, (nbytes,), torch.uint8)
            entry[1] += 1
            weakref.finalize(keeper, self._gone, key, entry)  # (the view's memory keeps the block itself)
        return view, keeper

    def block_at(self, address: int) -> Optional[torch.Tensor]:
        """The current block that holds ``address`` (a tombstone's memory), or None."""
        with self._lock:
            for entry in self._blocks.values():
                base = entry[0].data_ptr()
                if base <= address < base + entry[0].numel():
                    return entry[0]
        return None

    def _gone(self, key: Tuple[int, int], entry: list) -> None:
        """A tombstone of ``entry``'s block died: the last one takes the block out of the table."""
        with self._lock:
            entry[1] -= 1
            if entry[1] <= 0 and self._blocks.get(key) is entry:
                del self._blocks[key]


DEVICE_POISON = DevicePoison()


def repoint(storage: torch.UntypedStorage, fill: Optional[int] = None, *,
            source: Optional[torch.Tensor] = None) -> Tuple[torch.UntypedStorage, Any]:
    """Give ``storage`` fresh memory of its size: a copy of its bytes, or ``fill`` in every byte.

    Returns ``(previous, keeper)``: ``previous`` is a storage that now holds the memory ``storage``
    had (drop it once the lease's bookkeeping is done: dropping it releases the staging alias), and
    ``keeper`` is the object the new memory's deleter keeps (weak-referenceable: it dies with
    ``storage``). A CPU fill maps the shared :data:`POISON` file (no descriptor kept), or allocates
    the poison past the map limit. CUDA memory: see :func:`_repoint_on_device`; ``source`` is the
    tensor owning the bytes being copied (the staging buffer's own memory), told about the stream the
    copy is queued on.
    """
    nbytes = storage.nbytes()
    device = devices.storage_device(storage)
    if device.type == "cuda":
        return _repoint_on_device(storage, nbytes, device, fill, source)
    keeper = None
    if fill is not None and nbytes and storage.device.type == "cpu" and PoisonFile.AVAILABLE:
        keeper = POISON.map(nbytes, fill)
    if keeper is not None:
        fresh = own_ops.over_host(keeper, torch.uint8, False).untyped_storage()  # the poison is ours
    else:
        if fill is None:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=storage.device)
        else:
            buf = torch.full((nbytes,), fill, dtype=torch.uint8, device=storage.device)
        view, keeper = alias_view(buf, host_array(buf), 0, nbytes, (nbytes,), torch.uint8)
        fresh = view.untyped_storage()
        if fill is None:
            fresh.copy_(storage)
    storage._swap_data_ptr_(fresh)  # the two swap memories: ``fresh`` now holds what ``storage`` had
    previous = fresh
    return previous, keeper


def _repoint_on_device(storage: torch.UntypedStorage, nbytes: int, device: torch.device, fill: Optional[int],
                       source: Optional[torch.Tensor]) -> Tuple[torch.UntypedStorage, Any]:
    """:func:`repoint` of CUDA memory.

    A fill is a view of the shared :data:`DEVICE_POISON` block (no memory of its own). A copy goes
    into ordinary caching-allocator memory, allocated and written on the current stream, and the
    swap hands that memory to ``storage`` itself: a rescued view is then allocator memory
    like any tensor (``record_stream``, CUDA IPC and ``resize_`` work on it), and ``storage`` is the
    keeper (torch keeps a storage's Python object as long as the storage lives). The copy reads
    the staging bytes on the current stream, so ``source`` (their owner) records that stream: the
    buffer freed meanwhile, even to another stream's pool, is not reused before the copy ran.
    """
    if fill is not None:  # a tombstone: a view of the shared poison block
        view, keeper = DEVICE_POISON.view(nbytes, fill, device)
        fresh = view.untyped_storage()
        storage._swap_data_ptr_(fresh)
        return fresh, keeper
    stream = torch.cuda.current_stream(device.index)
    fresh = devices.empty(nbytes, device).untyped_storage()
    fresh.copy_(storage)
    if source is not None:
        source.record_stream(stream)
    storage._swap_data_ptr_(fresh)  # ``storage`` owns the allocator memory now; ``fresh`` the staging alias
    return fresh, storage


def reset_device_state() -> None:
    """Forget the CUDA poison blocks (a test harness between tests, or after the devices were reset)."""
    DEVICE_POISON.__init__()


@forking.in_child
def _after_fork() -> None:
    POISON._lock = threading.RLock()  # (the poison file itself is shared: every mapping is private)
    DEVICE_POISON.__init__()  # the blocks are the parent's CUDA memory, which a forked child cannot use


__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "PoisonFile", "POISON", "DevicePoison",
           "DEVICE_POISON", "holders", "repoint", "reset_device_state"]
