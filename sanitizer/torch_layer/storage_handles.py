"""Reach a lease's storage at retire time, and re-point it to other memory.

Rescue (copy out) and guard (tombstone) both act on the storage of a lease that
something still holds when its bytes are retired. The lease record knows only
the storage's address, so the runtime keeps a *weak* storage handle per lease
(taken at lend, so holding it never keeps a view alive; see ``runtime.storage_of``)
and, at retire, a feature swaps the storage's data pointer (``_swap_data_ptr_``):
the lent tensor and every view derived from it then read the new memory.

Needs private storage APIs (weak handles, ``_swap_data_ptr_``,
``_storage_Use_Count``); :data:`AVAILABLE` says whether this torch has them.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Any, Optional, Tuple

import numpy as np
import torch

from sanitizer.core import forking
from sanitizer.torch_layer.aliasing import alias_view, host_array

_S = torch.UntypedStorage
_API_NAMES = ("_weak_ref", "_new_with_weak_ptr", "_expired", "_free_weak_ref", "_swap_data_ptr_")
AVAILABLE: bool = all(hasattr(_S, n) for n in _API_NAMES) and hasattr(torch._C, "_storage_Use_Count")
UNAVAILABLE_REASON: Optional[str] = None if AVAILABLE else (
    "this torch lacks UntypedStorage." + "/".join(n for n in _API_NAMES if not hasattr(_S, n))
    + ("" if hasattr(torch._C, "_storage_Use_Count") else " and torch._C._storage_Use_Count"))


def upgrade(handle: int) -> Optional[torch.UntypedStorage]:
    """A strong reference to the storage behind weak ``handle`` (taken with ``_weak_ref()``), or None
    when it died. The handle stays valid (free it once with :func:`free_weak_handle`)."""
    return None if _S._expired(handle) else _S._new_with_weak_ptr(handle)


def free_weak_handle(handle: int) -> None:
    _S._free_weak_ref(handle)


def holders(storage: torch.UntypedStorage) -> int:
    """References to ``storage`` from tensors and storages other than the caller's one."""
    return torch._C._storage_Use_Count(storage._cdata) - 1


class PoisonFile:
    """One in-memory file (Linux ``memfd``) of poison bytes that every CPU tombstone maps.

    Each tombstone is a private (copy-on-write) mapping of the file's first
    ``nbytes``: it costs one ``mmap`` call and no memory of its own until someone
    writes to it, so a thousand retained stale views cost the memory of the
    largest one. The file grows (and is filled) only when a larger tombstone is
    asked for; a different fill byte starts a new file (old mappings stay valid).
    """

    AVAILABLE: bool = hasattr(os, "memfd_create") and hasattr(mmap, "MAP_PRIVATE")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fd: Optional[int] = None
        self._fill: Optional[int] = None
        self.nbytes = 0  # the shared poison memory: the largest tombstone so far, page-rounded

    def map(self, nbytes: int, fill: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` poison bytes; unmapped when the array dies."""
        with self._lock:
            if self._fd is None or fill != self._fill:
                if self._fd is not None:
                    os.close(self._fd)
                self._fd, self._fill, self.nbytes = os.memfd_create("ownsan-poison", os.MFD_CLOEXEC), fill, 0
            if nbytes > self.nbytes:
                self._grow(max(nbytes, 2 * self.nbytes))
            fd = self._fd
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(mapped, dtype=np.uint8)

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


def repoint(storage: torch.UntypedStorage, fill: Optional[int] = None) -> Tuple[torch.UntypedStorage, Any]:
    """Give ``storage`` fresh memory of its size: a copy of its bytes, or ``fill`` in every byte.

    Returns ``(previous, keeper)``: ``previous`` is a storage that now holds the memory ``storage``
    had (drop it once the lease's bookkeeping is done: dropping it releases the staging alias), and
    ``keeper`` is the object the new memory's deleter keeps (weak-referenceable: it dies with
    ``storage``). A CPU fill maps the shared :data:`POISON` file.
    """
    nbytes = storage.nbytes()
    if fill is not None and nbytes and storage.device.type == "cpu" and PoisonFile.AVAILABLE:
        keeper = POISON.map(nbytes, fill)
        fresh = torch.from_numpy(keeper).untyped_storage()
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



@forking.in_child
def _after_fork() -> None:
    POISON._lock = threading.Lock()  # (the poison file itself is shared: every mapping is private)


__all__ = ["AVAILABLE", "UNAVAILABLE_REASON", "upgrade", "free_weak_handle", "PoisonFile", "POISON", "holders",
           "repoint"]
