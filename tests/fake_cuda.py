"""A CPU stand-in for CUDA devices: the sanitizer's CUDA paths, exercised without a GPU.

torch cannot make a CPU tensor report ``device.type == "cuda"``, so the
sanitizer asks :mod:`cuda_hooks.devices` which tensors are CUDA tensors and
where device memory comes from; this harness answers for it, and stands in
for the ``torch.cuda`` calls the sanitizer makes. What is faked, and what a
test may rely on:

* **Memory.** :meth:`FakeCuda.alloc` (and ``torch.empty/zeros(..., device="cuda")``,
  so ``StagingBuffer(n, device="cuda")`` works; ``zeros_like`` and ``cat`` of
  device tensors) hands out ordinary CPU memory
  and files it as memory of ``cuda:N``, allocated on that device's current
  stream. A tensor whose bytes lie in filed memory is a CUDA tensor: views,
  leases (storages of their own aliasing the memory), tombstones, rescued copies.
* **The caching allocator's stream rule.** Memory belongs to the storage that
  allocated it (``_swap_data_ptr_`` moves it along, as in torch).
  ``record_stream`` on a tensor of that storage is recorded; on any other
  storage aliasing the memory (a lease, a ``from_blob``) it does nothing, as in
  torch. Work on memory from a stream other than its allocation stream (the
  kernels, and ``fill_``/``copy_`` issued while that stream is current) is a
  *use*; when the memory is freed, a use on a stream that was neither recorded
  nor synchronised since is a :attr:`FakeCuda.hazards` entry.
* **Freed blocks are reused, as the caching allocator reuses them.** The fake
  holds every block's memory itself (so queued work never reads unmapped
  memory), and queued work holds no operand alive: a storage dies when its last
  Python reference goes, work still queued or not. Its block then goes back to
  the pool of its allocation stream, and the next allocation of that size on
  that stream gets it (its old bytes and all), at once, unless a stream the
  block was recorded on still has work queued from before the free: then only
  after that work ran. So a use nobody recorded reads (or writes) the next
  owner's bytes, a wrong value a test can see, as on a GPU. Fresh memory holds
  garbage (``0xA5``), never zeros.
* **Streams.** A stream per ``(device, handle)``; the default stream has handle
  0 as in torch; ``torch.cuda.stream``/``device``/``current_stream``/
  ``Stream``/``Event``/``synchronize`` behave as documented, the current device
  and streams per thread as in torch. Kernel launches
  (the checksum/verify/poison kernels, through :class:`FakeGpu`) are queued on
  their stream and run at once, unless a test paused that stream
  (:meth:`FakeCuda.pause`): then they run when the stream is synchronised, an
  event recorded on it is synchronised, or another stream waits on it.
  ``fill_`` and ``copy_`` on fake device memory (the sanitizer's poison fills
  and rescue copies) are queued the same way; every other torch op runs at
  once on the CPU, so a test pauses only streams other than the one the host
  reads results on.
* **Graph capture.** Inside :meth:`FakeCuda.capture`,
  ``torch.cuda.is_current_stream_capturing()`` is True on the capturing stream;
  any synchronisation or module load (the kernels' first launch on a device)
  raises as CUDA does and is a hazard, launches are recorded in
  :attr:`FakeCuda.graph` instead of running, and allocations are logged.
* **Kernels.** By default a CPU twin (``cuda_hooks.cpu``'s hash of the same
  bytes, slots and flags written as the device kernels write them). In a child
  started with ``NUMBA_ENABLE_CUDASIM=1``, ``FakeCuda(kernels="simulator")``
  runs the real kernels of ``cuda_hooks.gpu`` in numba's simulator over the
  same memory.

``install(monkeypatch)`` patches for one test and resets the sanitizer's
device state (slot tables, poison blocks, the bridge's caches) before and
after, so no fake tensor outlives the test.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import sys
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

_ACTIVE: Optional["FakeCuda"] = None
_REAL_EMPTY = torch.empty
_REAL_ZEROS = torch.zeros
_REAL_ZEROS_LIKE = torch.zeros_like
_REAL_CAT = torch.cat
_REAL_SWAP = torch.UntypedStorage._swap_data_ptr_
_REAL_FILL = torch.Tensor.fill_
_REAL_TENSOR_COPY = torch.Tensor.copy_


def _contiguous(x: Any) -> bool:
    return isinstance(x, torch.UntypedStorage) or x.is_contiguous()


def _address_alias(x: Any) -> torch.Tensor:
    """A tensor over the memory ``x`` has now (by address: no storage of ``x``'s, so no lease either)."""
    if isinstance(x, torch.UntypedStorage):
        nbytes, dtype, shape = x.nbytes(), torch.uint8, (x.nbytes(),)
    else:
        nbytes, dtype, shape = x.numel() * x.element_size(), x.dtype, tuple(x.shape)
    raw = np.frombuffer((ctypes.c_char * nbytes).from_address(x.data_ptr()), dtype=np.uint8) if nbytes else \
        np.empty(0, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)

CAPTURE_ERROR = "CUDA error: operation not permitted when stream is capturing"


def _fake() -> "FakeCuda":
    if _ACTIVE is None:
        raise RuntimeError("no FakeCuda installed")
    return _ACTIVE


class _Alloc:
    """One fake device allocation: ``nbytes`` at ``base`` on ``device``, allocated on ``stream``."""

    __slots__ = ("id", "base", "nbytes", "device", "stream", "recorded", "uses", "freed", "during_capture")

    def __init__(self, id: int, base: int, nbytes: int, device: torch.device, stream: "FakeStream", capture: bool):
        self.id, self.base, self.nbytes, self.device, self.stream = id, base, nbytes, device, stream
        self.recorded: set = set()
        self.uses: Dict["FakeStream", int] = {}  # stream -> tick of its last work on this memory
        self.freed = False
        self.during_capture = capture

    def __repr__(self) -> str:
        return f"<alloc {self.id} {self.nbytes} B on {self.device} stream {self.stream.cuda_stream}>"


class FakeStream:
    """A CUDA stream of the fake: a queue of launches that runs at once unless paused."""

    def __init__(self, fake: "FakeCuda", device: torch.device, handle: int):
        self._fake = fake
        self.device = device
        self.cuda_stream = handle
        self.paused = False
        self.queue: List[Tuple[str, Callable[[], None], List[_Alloc]]] = []
        self.seqs: List[int] = []  # per queued item: its place in the stream's order (1, 2, ...)
        self.issued = 0  # launches issued on this stream so far: an event records this point
        self.syncs = 0
        self.synced_at = -1  # tick of the last time the host waited for this stream

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and (other.device, other.cuda_stream) == (self.device, self.cuda_stream)

    def __hash__(self) -> int:
        return hash((self.device.index, self.cuda_stream))

    def __repr__(self) -> str:
        return f"<FakeStream cuda:{self.device.index} handle={self.cuda_stream}{' paused' if self.paused else ''}>"

    def launch(self, name: str, work: Callable[[], None], allocs: List[_Alloc]) -> None:
        fake = self._fake
        fake.launches.append((name, self.device.index, self.cuda_stream))
        tick = fake._tick()
        for alloc in allocs:
            alloc.uses[self] = tick
        if fake.capturing is self:
            fake.graph.append((name, self.device.index, self.cuda_stream))
            return
        self.issued += 1
        if self.paused:
            self.queue.append((name, work, allocs))
            self.seqs.append(self.issued)
        else:
            work()

    def flush(self, upto: Optional[int] = None) -> None:
        """Run the queued launches, all of them or those issued up to the point ``upto`` (an event's)."""
        while self.queue and (upto is None or self.seqs[0] <= upto):
            _, work, _ = self.queue[0]
            work()
            del self.queue[0], self.seqs[0]

    def pending_upto(self, point: int) -> bool:
        """Is a launch issued up to ``point`` still queued?"""
        return bool(self.seqs) and self.seqs[0] <= point

    def synchronize(self) -> None:
        self._fake._refuse_in_capture(f"synchronize {self!r}")
        self.syncs += 1
        self.flush()
        self.synced_at = self._fake._tick()

    def query(self) -> bool:
        return not self.queue

    def wait_stream(self, other: "FakeStream") -> None:
        other.flush()  # later work on self sees other's work done (ordering, approximated by running it)

    def record_event(self, event: Optional["FakeEvent"] = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def wait_event(self, event: "FakeEvent") -> None:
        event.wait(self)


class FakeEvent:
    """``torch.cuda.Event``: the point of the stream it was recorded on. As in CUDA, waiting for it (from
    the host or from another stream) orders only after the work issued on that stream before the record,
    never after work issued later (a later kernel on the recording stream may still be queued)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._stream: Optional[FakeStream] = None
        self._point = 0

    def record(self, stream: Optional[FakeStream] = None) -> None:
        self._stream = stream or _fake().current_stream()
        self._point = self._stream.issued

    def synchronize(self) -> None:
        if self._stream is not None:
            _fake()._refuse_in_capture("event synchronize")
            self._stream.flush(self._point)
            if not self._stream.queue:
                self._stream.synced_at = _fake()._tick()

    def wait(self, stream: Optional[FakeStream] = None) -> None:
        if self._stream is not None:
            self._stream.flush(self._point)

    def query(self) -> bool:
        return self._stream is None or not self._stream.pending_upto(self._point)


class TwinKernels:
    """CPU twin of :mod:`cuda_hooks.gpu`: the same results from ``cuda_hooks.cpu``'s hash, at once."""

    SIMULATED = False
    THREADS = 256
    IMPLEMENTATION = "fake (CPU twin)"

    def as_array(self, t: torch.Tensor, dtype: Any = None) -> np.ndarray:
        """The tensor's bytes by address: like numba's device array, it keeps no storage alive once the
        launch that took it is queued (the fake holds device memory itself)."""
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            arr = t.numpy()
        else:
            raw = np.frombuffer((ctypes.c_char * nbytes).from_address(t.data_ptr()), dtype=np.uint8)
            arr = raw.view(t.numpy().dtype).reshape(t.shape)  # (t.numpy() only for its dtype: not kept)
        return arr if dtype is None else arr.view(dtype)

    def warm(self) -> None:
        pass

    def checksum_async(self, data, scratch, out, slot, stream, blocks=None, device=0) -> None:
        from cuda_hooks import cpu

        out[slot] = np.uint64(cpu.hash_bytes(data))

    def verify_async(self, data, scratch, expected, slot, flags, stream, blocks=None, device=0) -> None:
        from cuda_hooks import cpu

        if np.uint64(cpu.hash_bytes(data)) != expected[slot]:
            flags[slot] = 1

    def poison_async(self, data, byte, stream, device=0) -> None:
        data[:] = byte

    def compile_seconds(self) -> Dict[str, float]:
        return {}

    def kernel_info(self) -> Dict[str, Any]:
        return {"implementation": self.IMPLEMENTATION, "simulated": False, "threads": self.THREADS}


class FakeGpu:
    """What the bridge sees as ``cuda_hooks.gpu``: launches go to the fake's streams, then to the
    twin or to the real kernels under numba's simulator."""

    def __init__(self, fake: "FakeCuda", inner: Any):
        self._fake = fake
        self.inner = inner
        self.SIMULATED = inner.SIMULATED
        self.THREADS = inner.THREADS
        self.module_loads: Dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:  # anything else the bridge reads: the inner module's
        return getattr(self.inner, name)

    def as_array(self, t: torch.Tensor, dtype: Any = None) -> Any:
        if not self._fake.is_cuda(t):
            raise ValueError(f"as_array of memory that is not device memory: {t.data_ptr():#x}")
        return self.inner.as_array(t, dtype)

    def stream_for(self, handle: int, device: int = 0) -> FakeStream:
        return self._fake._stream(device, handle)

    @contextlib.contextmanager
    def device_scope(self, index: int) -> Iterator[None]:
        if self._fake.current_device() != index:
            raise AssertionError(f"numba device {index} made current while torch's is {self._fake.current_device()}")
        yield

    def warm(self) -> None:
        fake = self._fake
        device = fake.current_device()
        fake._refuse_in_capture(f"module load on cuda:{device}")
        self.module_loads[device] = self.module_loads.get(device, 0) + 1
        self.inner.warm()

    def _allocs(self, *arrays: Any) -> List[_Alloc]:
        found = []
        for a in arrays:
            alloc = self._fake._find(int(a.ctypes.data)) if a is not None else None
            if alloc is not None:
                found.append(alloc)
        return found

    def _zero_scratch(self, name: str, scratch: Any) -> None:
        """The hashing kernels need their scratch zero when they run (they leave it zero): a scratch
        that is not, e.g. one whose zeroing was captured into a graph and never ran, gives a wrong hash
        on a device. The twin would not notice, so the harness files it as a hazard."""
        if np.asarray(scratch).any():
            self._fake.hazards.append(f"{name} ran with a non-zero scratch {np.asarray(scratch).tolist()}")

    def checksum_async(self, data, scratch, out, slot, stream, blocks=None, device=0) -> None:
        inner = self.inner

        def run() -> None:
            self._zero_scratch("checksum", scratch)
            inner.checksum_async(data, scratch, out, slot, 0, blocks, device)

        stream.launch("checksum", run, self._allocs(data, scratch, out))

    def verify_async(self, data, scratch, expected, slot, flags, stream, blocks=None, device=0) -> None:
        inner = self.inner

        def run() -> None:
            self._zero_scratch("verify", scratch)
            inner.verify_async(data, scratch, expected, slot, flags, 0, blocks, device)

        stream.launch("verify", run, self._allocs(data, scratch, expected, flags))

    def poison_async(self, data, byte, stream, device=0) -> None:
        inner = self.inner
        stream.launch("poison", lambda: inner.poison_async(data, byte, 0, device), self._allocs(data))


class _Phys:
    """One fake physical allocation: a memfd, its device, whether its handle was released, how many
    mappings use it."""

    __slots__ = ("fd", "size", "device", "released", "maps")

    def __init__(self, fd: int, size: int, device: int):
        self.fd, self.size, self.device, self.released, self.maps = fd, size, device, False, 0


class FakeVmm:
    """The driver's virtual memory management (:class:`cuda_hooks.vmm.Driver`) over host pages, with every
    rule the CUDA Driver API documents for the calls trap mode makes (each quoted beside its check, from
    the "Virtual Memory Management" section of the Driver API reference, cuda.h's comments): a physical
    allocation is a memfd (fresh bytes 0xA5); a reservation is a range mapped with no access and filed as
    memory of its device (so tensors over it are CUDA tensors here); ``map`` puts an allocation's pages at
    a reserved range with no access until ``set_access``, which is kept per mapping and per device; a host
    read of a range with no access for its own device faults (SIGSEGV), as a kernel's would be an
    illegal address, and a fake ``copy_`` on another device's stream checks that device's access.

    What is not documented but decided here, each settable by a test: ``read_only_supported`` (does
    ``cuMemSetAccess`` accept ``PROT_READ``; unverified on a real GPU), ``capacity`` (physical bytes per
    device, ``cuMemCreate`` answers ``CUDA_ERROR_OUT_OF_MEMORY`` past it) and ``torch_cache`` (bytes
    torch's caching allocator holds on a device until ``torch.cuda.empty_cache()``), ``fail_next`` (an
    injected error, e.g. a lost context)."""

    def __init__(self, fake: "FakeCuda", granule: int = 64 * 1024, unavailable: Optional[str] = None):
        from sanitizer.core import pages

        if granule % pages.PAGE:
            raise ValueError(f"granule must be a multiple of the page size {pages.PAGE}, got {granule}")
        self._fake, self._pages, self.granule, self.why_not = fake, pages, granule, unavailable
        self._handles: Dict[int, _Phys] = {}  # live handles (not released)
        self._physical: Dict[int, _Phys] = {}  # every allocation whose memory is not freed yet
        self._next = 1
        self._blank = os.memfd_create("fake-vmm-reserved", os.MFD_CLOEXEC)  # what a reservation maps (no access)
        self._blank_size = 0
        self._reserved: Dict[int, Tuple[int, int]] = {}  # address -> (size, device)
        self._mapped: Dict[int, Tuple[int, int]] = {}  # mapping address -> (size, handle)
        self._access: Dict[int, Dict[int, str]] = {}  # mapping address -> {device: "r" | "rw"}
        self.read_only_supported = True
        self.capacity: Dict[int, int] = {}  # device -> physical bytes it has (absent: unlimited)
        self.torch_cache: Dict[int, int] = {}  # device -> bytes torch's caching allocator holds there
        self.empty_cache_calls = 0
        self._fail: Dict[str, Tuple[int, int]] = {}
        self.calls: List[str] = []

    # -- what a test sets or reads --------------------------------------------------------------------------
    def fail_next(self, call: str, code: int, after: int = 0) -> None:
        """The ``after``-th next ``call`` (a :class:`cuda_hooks.vmm.Driver` method name; 0: the next one)
        fails with CUresult ``code``."""
        self._fail[call] = (code, after)

    def physical_bytes(self, device: int) -> int:
        """Bytes of physical memory allocated on ``device`` and not freed yet."""
        return sum(p.size for p in self._physical.values() if p.device == device)

    def access_of(self, address: int, device: int) -> str:
        """``""``, ``"r"`` or ``"rw"``: what ``device`` may do at ``address`` now."""
        for a, (s, _) in self._mapped.items():
            if a <= address < a + s:
                return self._access.get(a, {}).get(device, "")
        return ""

    def check_device_access(self, address: int, nbytes: int, device: int, write: bool) -> None:
        """A device touching a reserved range (a fake copy on its stream): an illegal address without the
        access it needs, as on a GPU, filed as a hazard and raised as the sticky error."""
        need = "rw" if write else "r"
        for at in range(address - address % self.granule, address + nbytes, self.granule):
            have = self.access_of(at, device)
            if not have or (need == "rw" and have != "rw"):
                self._fake.hazards.append(f"cuda:{device} {'wrote' if write else 'read'} {at:#x} without access")
                raise self._err(f"cuda:{device} accessed {at:#x} with access {have!r}",
                                vmm_module().CUDA_ERROR_ILLEGAL_ADDRESS)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: torch's cache gives its memory back."""
        self.empty_cache_calls += 1
        self.torch_cache.clear()

    # -- helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _err(message: str, code: int) -> Exception:
        v = vmm_module()
        return v.error(f"{message}: {_CU_NAMES.get(code, code)}", code)

    def _injected(self, call: str) -> None:
        if call not in self._fail:
            return
        code, after = self._fail[call]
        if after:
            self._fail[call] = (code, after - 1)
            return
        del self._fail[call]
        raise self._err(f"{call} (injected)", code)

    def _check(self, what: str, *values: int) -> None:
        for v in values:
            if v % self.granule:
                raise self._err(f"{what}: {v:#x} is not a multiple of the granularity {self.granule:#x}",
                                vmm_module().CUDA_ERROR_INVALID_VALUE)

    def _reservation_of(self, address: int, size: int) -> Optional[Tuple[int, int, int]]:
        for a, (s, d) in self._reserved.items():
            if a <= address and address + size <= a + s:
                return a, s, d
        return None

    def _mappings_in(self, address: int, size: int) -> Dict[int, Tuple[int, int]]:
        return {a: v for a, v in self._mapped.items() if address < a + v[0] and a < address + size}

    def _reprotect(self, address: int) -> None:
        """The host view of a mapping: what the device owning its reservation may do there."""
        size, _ = self._mapped[address]
        found = self._reservation_of(address, size)
        have = self._access.get(address, {}).get(found[2] if found else -1, "")
        prot = {"": 0, "r": self._pages.PROT_READ, "rw": self._pages.PROT_READ | self._pages.PROT_WRITE}[have]
        self._pages.protect(address, size, prot)

    def _free_physical(self, handle: int) -> None:
        phys = self._physical[handle]
        if phys.released and phys.maps == 0:
            del self._physical[handle]
            os.close(phys.fd)

    # -- the driver ---------------------------------------------------------------------------------------
    def unavailable(self, device: int) -> Optional[str]:
        return self.why_not

    def granularity(self, device: int) -> int:
        return self.granule

    def create(self, size: int, device: int) -> int:
        self._injected("create")
        # cuMemCreate: "The `size` of this allocation must be a multiple of the the value given via
        # cuMemGetAllocationGranularity with the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag."
        self._check("cuMemCreate size", size)
        # cuMemCreate "Returns ... CUDA_ERROR_OUT_OF_MEMORY": past the device's memory, torch's cache included
        cap = self.capacity.get(device)
        if cap is not None and self.physical_bytes(device) + self.torch_cache.get(device, 0) + size > cap:
            raise self._err(f"cuMemCreate({size}, device {device})", vmm_module().CUDA_ERROR_OUT_OF_MEMORY)
        fd = os.memfd_create("fake-vmm-physical", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        os.pwrite(fd, b"\xa5" * size, 0)  # fresh device memory holds garbage, never zeros
        handle, self._next = self._next, self._next + 1
        self._handles[handle] = self._physical[handle] = _Phys(fd, size, device)
        self.calls.append("create")
        return handle

    def release(self, handle: int) -> None:
        self._injected("release")
        phys = self._handles.pop(handle)
        # cuMemRelease: "The memory allocation will be freed when all outstanding mappings to the memory are
        # unmapped and when all outstanding references to the handle (including it's shareable counterparts)
        # are also released. The generic memory handle can be freed when there are still outstanding
        # mappings made with this handle."
        phys.released = True
        self._free_physical(handle)
        self.calls.append("release")

    def _blank_at(self, address: Optional[int], size: int) -> int:
        if self._blank_size < size:
            os.ftruncate(self._blank, size)
            self._blank_size = size
        return self._pages.map_file(self._blank, 0, size, self._pages.PROT_NONE, shared=False, at=address)

    def reserve(self, size: int, granule: int, device: int) -> int:
        self._injected("reserve")
        # cuMemAddressReserve: "The size and address parameters must be a multiple of the host page size and
        # the alignment must be a power of two or zero for default alignment."
        if size <= 0 or size % self._pages.PAGE or granule < 0 or granule & (granule - 1):
            raise self._err(f"cuMemAddressReserve(size {size}, alignment {granule})",
                            vmm_module().CUDA_ERROR_INVALID_VALUE)
        align = max(granule, self.granule)  # (default alignment: the granularity, so the range can be mapped)
        raw = self._blank_at(None, size + align)
        address = -(-raw // align) * align
        if address > raw:
            self._pages.unmap(raw, address - raw)
        tail = raw + size + align - (address + size)
        if tail:
            self._pages.unmap(address + size, tail)
        self._reserved[address] = (size, device)
        self._fake._file_range(address, size, device)
        self.calls.append("reserve")
        return address

    def free(self, address: int, size: int) -> None:
        self._injected("free")
        # cuMemAddressFree: "The size must match what was given to memAddressReserve and the ptr given must
        # match what was returned from memAddressReserve."
        if self._reserved.get(address, (None,))[0] != size:
            raise self._err(f"cuMemAddressFree({address:#x}, {size}): not a reservation of that size",
                            vmm_module().CUDA_ERROR_INVALID_VALUE)
        # Programming guide, "Reserving a Virtual Address Range": "Users must ensure that the entire VA range
        # is unmapped before calling cuMemAddressFree."
        if self._mappings_in(address, size):
            raise self._err(f"cuMemAddressFree({address:#x}): still mapped", vmm_module().CUDA_ERROR_INVALID_VALUE)
        del self._reserved[address]
        self._pages.unmap(address, size)
        self._fake._unfile_range(address)
        self.calls.append("free")

    def map(self, address: int, size: int, handle: int, offset: int) -> None:
        self._injected("map")
        invalid = vmm_module().CUDA_ERROR_INVALID_VALUE
        # cuMemMap, parameter offset: "Offset into the memory represented by handle from which to start
        # mapping - Note: currently must be zero."
        if offset != 0:
            raise self._err(f"cuMemMap({address:#x}, {size}, offset {offset:#x}): offset must be zero", invalid)
        # cuMemMap: "Both `ptr`, `size`, and `offset` must be a multiple of the value given via
        # cuMemGetAllocationGranularity with the CU_MEM_ALLOC_GRANULARITY_MINIMUM flag."
        self._check("cuMemMap", address, size, offset)
        phys = self._handles.get(handle)
        if phys is None:
            raise self._err(f"cuMemMap: handle {handle} is not a live allocation", invalid)
        # cuMemMap: "This range must be an address reservation previously reserved with cuMemAddressReserve,
        # and `offset` + `size` must be less than the size of the memory allocation." (up to its size)
        if self._reservation_of(address, size) is None or offset + size > phys.size:
            raise self._err(f"cuMemMap({address:#x}, {size}, offset {offset}): out of range", invalid)
        # cuMemMap: "cuMemMap can only create mappings on VA range reservations that are not currently mapped."
        if self._mappings_in(address, size):
            raise self._err(f"cuMemMap({address:#x}): already mapped", invalid)
        # cuMemMap: "Please note calling cuMemMap does not make the address accessible, the caller needs to
        # update accessibility of a contiguous mapped VA range by calling cuMemSetAccess."
        self._pages.map_file(phys.fd, offset, size, self._pages.PROT_NONE, at=address)
        self._mapped[address] = (size, handle)
        self._access[address] = {}
        phys.maps += 1
        self.calls.append("map")

    def unmap(self, address: int, size: int) -> None:
        self._injected("unmap")
        # cuMemUnmap: "The range must be the entire contiguous address range that was mapped to. In other
        # words, cuMemUnmap cannot unmap a sub-range of an address range mapped by cuMemCreate / cuMemMap."
        # (Strictest reading, kept here: one call, one whole mapping.)
        if self._mapped.get(address, (None,))[0] != size:
            raise self._err(f"cuMemUnmap({address:#x}, {size}): not a whole mapped range",
                            vmm_module().CUDA_ERROR_INVALID_VALUE)
        # cuMemUnmap: "This function exhibits synchronous behavior for most use cases." Unmapping under work
        # still queued over the range is what makes that work read an unmapped address: the fake files it
        # and answers with the sticky error the work would get (CUDA_ERROR_ILLEGAL_ADDRESS).
        busy = self._fake.queued_over(address, size)
        if busy:
            self._fake.hazards.append(f"cuMemUnmap({address:#x}, {size}) under queued work {busy}")
            raise self._err(f"cuMemUnmap({address:#x}, {size}) under queued work", vmm_module().CUDA_ERROR_ILLEGAL_ADDRESS)
        _, handle = self._mapped.pop(address)
        self._access.pop(address, None)
        phys = self._physical[handle]
        phys.maps -= 1
        # cuMemUnmap: "Any backing memory allocations will be freed if there are no existing mappings and
        # there are no unreleased memory handles."
        self._free_physical(handle)
        self._blank_at(address, size)
        self.calls.append("unmap")

    def set_access(self, address: int, size: int, devices: Any, writable: bool) -> None:
        self._injected("set_access")
        v = vmm_module()
        devices = [devices] if isinstance(devices, int) else list(devices)
        # cuMemSetAccess: "The range must be a fully mapped address range containing all allocations created
        # by cuMemMap / cuMemCreate."
        inner = self._mappings_in(address, size)
        if not inner or min(inner) < address or max(a + s for a, (s, _) in inner.items()) > address + size or \
                sum(s for s, _ in inner.values()) != size:
            raise self._err(f"cuMemSetAccess({address:#x}, {size}): not a fully mapped range", v.CUDA_ERROR_INVALID_VALUE)
        # cuMemSetAccess "Returns ... CUDA_ERROR_INVALID_DEVICE": a location that is no device
        if any(not 0 <= d < self._fake.n for d in devices):
            raise self._err(f"cuMemSetAccess: devices {devices}", 101)
        # CU_MEM_ACCESS_FLAGS_PROT_READ, "Make the address range read accessible": whether a device accepts it
        # for device memory is not documented (unverified on a GPU): refused here when a test says so
        if not writable and not self.read_only_supported:
            raise self._err(f"cuMemSetAccess({address:#x}, PROT_READ)", v.CUDA_ERROR_NOT_SUPPORTED)
        # "set the access flags for the target locations": per device, per mapping
        for a in inner:
            for d in devices:
                self._access[a][d] = "rw" if writable else "r"
            self._reprotect(a)
        self.calls.append("set_access" + ("" if writable else "(read)"))

    def memset(self, address: int, byte: int, size: int, device: int) -> None:
        self._injected("memset")
        self._fake.synchronize(device)
        self.check_device_access(address, size, device, True)
        ctypes.memset(address, byte, size)

    def copy(self, dst: int, src: int, size: int, device: int) -> None:
        self._injected("copy")
        self._fake.synchronize(device)
        self.check_device_access(src, size, device, False)
        self.check_device_access(dst, size, device, True)
        ctypes.memmove(dst, src, size)

    def close(self) -> None:
        os.close(self._blank)


_CU_NAMES = {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 101: "CUDA_ERROR_INVALID_DEVICE",
             700: "CUDA_ERROR_ILLEGAL_ADDRESS", 801: "CUDA_ERROR_NOT_SUPPORTED"}


def vmm_module() -> Any:
    from cuda_hooks import vmm

    return vmm


class _DeviceContext:
    """``torch.cuda.device(i)``."""

    def __init__(self, device: Any):
        self.index = _fake()._index(device)

    def __enter__(self) -> None:
        fake = _fake()
        self.before = fake._current_device
        fake._current_device = self.index

    def __exit__(self, *exc: Any) -> None:
        _fake()._current_device = self.before


class FakeCuda:
    """``n`` fake CUDA devices. Use :meth:`install` (a test's monkeypatch) or the ``fake_cuda`` fixture."""

    def __init__(self, n: int = 2, kernels: str = "twin"):
        if kernels not in ("twin", "simulator"):
            raise ValueError(f"kernels must be 'twin' or 'simulator', got {kernels!r}")
        self.n = n
        self._lock = threading.RLock()
        self._tls = threading.local()  # torch's current device and streams are per thread
        self._streams: Dict[Tuple[int, int], FakeStream] = {}
        self._next_handle = 0x1000
        self._next_alloc = 0
        self._ticks = 0
        self._bases: List[int] = []
        self._allocs: List[_Alloc] = []
        self._owners: Dict[int, _Alloc] = {}  # StorageImpl address -> the allocation it owns
        self._memory: Dict[int, np.ndarray] = {}  # base address -> the block's memory, held for the fake's life
        # (device index, allocation stream) -> freed blocks: (base, nbytes, [(recorded stream, issued at the free)])
        self._free: Dict[Tuple[int, "FakeStream"], List[Tuple[int, int, List[Tuple["FakeStream", int]]]]] = {}
        self._watched: set = set()
        self.capturing: Optional[FakeStream] = None
        self.peer_access = True  # torch.cuda.can_device_access_peer between distinct devices
        self.graph: List[Tuple[str, int, int]] = []
        self.launches: List[Tuple[str, int, int]] = []
        self.hazards: List[str] = []
        self.record_streams: List[Tuple[int, int, bool]] = []  # (alloc id or -1, stream handle, effective)
        self.allocations: List[_Alloc] = []
        for d in range(n):
            self._stream(d, 0)
        if kernels == "twin":
            inner: Any = TwinKernels()
        else:
            from cuda_hooks import gpu

            if not gpu.SIMULATED:
                raise RuntimeError("kernels='simulator' needs NUMBA_ENABLE_CUDASIM=1 before numba is imported")
            inner = gpu
        self.gpu = FakeGpu(self, inner)

    # -- memory -------------------------------------------------------------------
    @property
    def _current_device(self) -> int:
        return getattr(self._tls, "device", 0)

    @_current_device.setter
    def _current_device(self, index: int) -> None:
        self._tls.device = index

    @property
    def _current(self) -> Dict[int, FakeStream]:
        """This thread's current stream per device (the default stream unless set)."""
        current = getattr(self._tls, "streams", None)
        if current is None:
            current = self._tls.streams = {d: self._stream(d, 0) for d in range(self.n)}
        return current

    def _index(self, device: Any) -> int:
        if device is None:
            return self._current_device
        if isinstance(device, int):
            return device
        if isinstance(device, FakeStream):
            return device.device.index
        d = torch.device(device)
        return self._current_device if d.index is None else d.index

    def alloc(self, nbytes: int, device: Any = None) -> torch.Tensor:
        """``nbytes`` (uint8) of fake device memory, allocated on the device's current stream."""
        index = self._index(device)
        if not 0 <= index < self.n:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (the fake has {self.n})")
        if nbytes == 0:
            return _REAL_EMPTY(0, dtype=torch.uint8)
        stream = self._current[index]
        with self._lock:
            base = self._reusable(index, stream, nbytes)
            if base is None:
                mem = np.empty(nbytes, dtype=np.uint8)
                mem.fill(0xA5)  # fresh device memory holds whatever was there: never assume zeros
                base = mem.ctypes.data
                self._memory[base] = mem
            # a storage of its own over the block: its death frees nothing (the fake holds the memory and
            # hands the block back to the pool), and it holds the memory too, so a tensor that outlives
            # the fake (a test's leftover) never reads freed memory
            raw = (ctypes.c_char * nbytes).from_address(base)
            raw.memory = self._memory[base]
            t = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8))
            alloc = _Alloc(self._next_alloc, base, nbytes, torch.device("cuda", index), stream,
                           self.capturing is not None)
            self._next_alloc += 1
            at = bisect.bisect(self._bases, alloc.base)
            self._bases.insert(at, alloc.base)
            self._allocs.insert(at, alloc)
            self.allocations.append(alloc)
            storage = t.untyped_storage()
            self._owners[storage._cdata] = alloc
            self._watch(storage)
        return t

    def tensor(self, src: torch.Tensor, device: Any = None) -> torch.Tensor:
        """A fake device copy of CPU tensor ``src`` (same dtype and shape)."""
        src = src.contiguous()
        raw = self.alloc(src.numel() * src.element_size(), device)
        out = raw.view(src.dtype).view(src.shape)
        out.copy_(src)
        return out

    def _watch(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(storage, self._storage_died, key)

    def _storage_died(self, key: int) -> None:
        with self._lock:
            self._watched.discard(key)
            alloc = self._owners.pop(key, None)
            if alloc is None:
                return
            alloc.freed = True
            at = self._allocs.index(alloc)
            del self._allocs[at], self._bases[at]
            for stream, tick in alloc.uses.items():
                if stream != alloc.stream and stream not in alloc.recorded and stream.synced_at < tick:
                    self.hazards.append(f"{alloc!r} freed after work on {stream!r} that was neither recorded "
                                        f"(record_stream) nor waited for")
            # back to its stream's pool; a recorded stream's work queued before now holds it back
            waits = [(s, s.issued) for s in alloc.recorded if s != alloc.stream]
            self._free.setdefault((alloc.device.index, alloc.stream), []).append((alloc.base, alloc.nbytes, waits))

    def _reusable(self, index: int, stream: "FakeStream", nbytes: int) -> Optional[int]:
        """(Under the lock.) The base of a freed block of ``nbytes`` in ``stream``'s pool that no recorded
        stream still needs, taken out of the pool; None: a new block."""
        pool = self._free.get((index, stream), [])
        for i, (base, size, waits) in enumerate(pool):
            if size == nbytes and not any(s.pending_upto(point) for s, point in waits):
                del pool[i]
                return base
        return None

    def _tick(self) -> int:
        with self._lock:
            self._ticks += 1
            return self._ticks

    def _find(self, ptr: int) -> Optional[_Alloc]:
        at = bisect.bisect_right(self._bases, ptr) - 1
        if at >= 0:
            alloc = self._allocs[at]
            if ptr < alloc.base + alloc.nbytes:
                return alloc
        return None

    def _file_range(self, base: int, nbytes: int, device: int) -> None:
        """File ``[base, base+nbytes)`` as memory of ``cuda:device`` owned by no storage (a VMM range)."""
        with self._lock:
            alloc = _Alloc(self._next_alloc, base, nbytes, torch.device("cuda", device),
                           self._current[device], False)
            self._next_alloc += 1
            at = bisect.bisect(self._bases, base)
            self._bases.insert(at, base)
            self._allocs.insert(at, alloc)

    def _unfile_range(self, base: int) -> None:
        with self._lock:
            at = bisect.bisect_left(self._bases, base)
            if at < len(self._bases) and self._bases[at] == base:
                del self._bases[at], self._allocs[at]

    def _check_vmm_access(self, touched: List[Any], target: Any) -> None:
        """A copy or fill on the target's device (torch runs a copy on its destination's device): each
        operand in a VMM range needs that device's access there (read; write for the target)."""
        vmm = getattr(self, "vmm", None)
        dst = self._find(target.data_ptr()) if isinstance(target, (torch.Tensor, torch.UntypedStorage)) else None
        if vmm is None or dst is None:
            return
        for x in touched:
            ptr = x.data_ptr()
            if ptr and any(a <= ptr < a + s for a, (s, _) in vmm._reserved.items()):
                nbytes = x.nbytes() if isinstance(x, torch.UntypedStorage) else x.numel() * x.element_size()
                vmm.check_device_access(ptr, nbytes, dst.device.index, x is target)

    def alloc_of(self, t: torch.Tensor) -> Optional[_Alloc]:
        return self._find(t.data_ptr())

    def owns(self, t: torch.Tensor) -> bool:
        """Is ``t``'s storage the one that owns its memory (caching-allocator memory, not an alias)?"""
        return t.untyped_storage()._cdata in self._owners

    # -- cuda_hooks.devices --------------------------------------------------------
    @staticmethod
    def _address(t: torch.Tensor) -> int:
        """Where ``t``'s bytes are (torch says 0 for an empty tensor: then its storage's memory)."""
        return t.data_ptr() or (t.untyped_storage().data_ptr() if t.numel() == 0 else 0)

    def is_cuda(self, t: torch.Tensor) -> bool:
        return t.is_cuda or (t.device.type == "cpu" and self._find(self._address(t)) is not None)

    def device_of(self, t: torch.Tensor) -> torch.device:
        alloc = self._find(self._address(t)) if t.device.type == "cpu" else None
        return alloc.device if alloc is not None else t.device

    def storage_device(self, storage: torch.UntypedStorage) -> torch.device:
        alloc = self._find(storage.data_ptr()) if storage.device.type == "cpu" else None
        return alloc.device if alloc is not None else storage.device

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if torch.device(device).type != "cuda":
            return _REAL_EMPTY(nbytes, dtype=torch.uint8, device=device)
        return self.alloc(nbytes, device)

    def zeros(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if torch.device(device).type != "cuda":
            return _REAL_ZEROS(n, dtype=dtype, device=device)
        t = self.alloc(n * dtype.itemsize, device).view(dtype)
        t.fill_(0)  # a memset on the current stream: queued, or captured into a graph, like any work
        return t

    def from_interface(self, region: Any, device: torch.device) -> torch.Tensor:
        """``torch.as_tensor`` of a ``__cuda_array_interface__`` object over fake device memory: a storage
        of its own over those bytes whose deleter keeps ``region`` (so a lease's death is seen when its
        storage dies, as with the real alias). Memory that is not fake device memory is refused."""
        iface = region.__cuda_array_interface__
        (nbytes,), ptr = iface["shape"], iface["data"][0]
        alloc = self._find(ptr)
        if alloc is None or ptr + nbytes > alloc.base + alloc.nbytes:
            raise RuntimeError(f"as_tensor of {nbytes} bytes at {ptr:#x}: not (fake) device memory")
        if nbytes == 0:
            return _REAL_EMPTY(0, dtype=torch.uint8)
        raw = (ctypes.c_char * nbytes).from_address(ptr)
        raw.region = region  # the new storage keeps the numpy array, which keeps this, which keeps region
        return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8))

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        if not self.is_cuda(t):
            return torch.empty_like(t, memory_format=torch.contiguous_format)
        return self.alloc(t.numel() * t.element_size(), self.device_of(t)).view(t.dtype).view(t.shape)

    # -- torch.cuda ---------------------------------------------------------------
    def _stream(self, device: int, handle: int) -> FakeStream:
        key = (device, handle)
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = FakeStream(self, torch.device("cuda", device), handle)
        return s

    def new_stream(self, device: Any = None, priority: int = 0, **_: Any) -> FakeStream:
        with self._lock:
            handle = self._next_handle
            self._next_handle += 0x10
        return self._stream(self._index(device), handle)

    def current_device(self) -> int:
        return self._current_device

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current[self._index(device)]

    def default_stream(self, device: Any = None) -> FakeStream:
        return self._stream(self._index(device), 0)

    @contextlib.contextmanager
    def stream(self, s: Optional[FakeStream]) -> Iterator[None]:
        if s is None:
            yield
            return
        index = s.device.index
        before_device, before = self._current_device, self._current[index]
        self._current_device, self._current[index] = index, s
        try:
            yield
        finally:
            self._current[index], self._current_device = before, before_device

    def synchronize(self, device: Any = None) -> None:
        self._refuse_in_capture("torch.cuda.synchronize")
        index = self._index(device)
        for (d, _), s in list(self._streams.items()):
            if d == index:
                s.syncs += 1
                s.flush()
                s.synced_at = self._tick()

    def queued_over(self, address: int, size: int) -> List[str]:
        """Launches still queued (on any stream) that touch ``[address, address + size)``."""
        return [f"{name} on {s!r}" for s in list(self._streams.values()) for name, _, allocs in s.queue
                if any(a.base < address + size and address < a.base + a.nbytes for a in allocs)]

    def can_device_access_peer(self, device: Any, peer: Any) -> bool:
        """``torch.cuda.can_device_access_peer``: every pair of distinct fake devices, unless a test turned
        :attr:`peer_access` off."""
        d, p = self._index(device), self._index(peer)
        return self.peer_access and d != p and 0 <= d < self.n and 0 <= p < self.n

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the VMM driver's notion of torch's cache gives its memory back."""
        vmm = getattr(self, "vmm", None)
        if vmm is not None:
            vmm.empty_cache()

    def pause(self, stream: FakeStream) -> None:
        """Hold ``stream``'s launches back until it is synchronised (a slow stream)."""
        stream.paused = True

    def resume(self, stream: FakeStream) -> None:
        stream.paused = False
        stream.flush()

    @contextlib.contextmanager
    def capture(self, stream: Optional[FakeStream] = None) -> Iterator[List[Tuple[str, int, int]]]:
        """A graph capture on ``stream`` (default: a new side stream, made current, as ``torch.cuda.graph`` does)."""
        stream = stream or self.new_stream()
        self.graph = []
        with self.stream(stream):
            self.capturing = stream
            try:
                yield self.graph
            finally:
                self.capturing = None

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None and self.capturing is self.current_stream()

    def _refuse_in_capture(self, what: str) -> None:
        if self.capturing is not None:
            self.hazards.append(f"{what} during a graph capture")
            raise RuntimeError(f"{CAPTURE_ERROR} ({what})")

    def record_stream(self, t: torch.Tensor, stream: FakeStream) -> None:
        if not self.is_cuda(t):
            raise RuntimeError("record_stream of a tensor that is not in (fake) device memory")
        if not isinstance(stream, FakeStream):
            raise TypeError(f"record_stream expects a stream, got {type(stream).__name__}")
        alloc = self._owners.get(t.untyped_storage()._cdata)
        if alloc is not None and stream != alloc.stream:
            alloc.recorded.add(stream)
        self.record_streams.append((alloc.id if alloc is not None else -1, stream.cuda_stream, alloc is not None))

    def recorded(self, t: torch.Tensor) -> List[int]:
        """Handles of the streams recorded on ``t``'s allocation (effective record_stream calls)."""
        alloc = self._find(t.data_ptr())
        return sorted(s.cuda_stream for s in alloc.recorded) if alloc is not None else []

    # -- installation ---------------------------------------------------------------
    def install(self, monkeypatch: Any) -> "FakeCuda":
        import cuda_hooks.bridge as bridge
        from cuda_hooks import devices

        fake = self
        reset_device_state()
        for name in ("is_cuda", "device_of", "storage_device", "empty", "zeros", "empty_like", "from_interface"):
            monkeypatch.setattr(devices, name, getattr(self, name))
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: self.n)
        monkeypatch.setattr(cuda, "current_device", self.current_device)
        monkeypatch.setattr(cuda, "set_device", lambda d: setattr(self, "_current_device", self._index(d)))
        monkeypatch.setattr(cuda, "device", _DeviceContext)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "default_stream", self.default_stream)
        monkeypatch.setattr(cuda, "Stream", self.new_stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "Event", FakeEvent)
        monkeypatch.setattr(cuda, "synchronize", self.synchronize)
        monkeypatch.setattr(cuda, "is_current_stream_capturing", self.is_current_stream_capturing)
        monkeypatch.setattr(cuda, "can_device_access_peer", self.can_device_access_peer)
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: fake.record_stream(t, s), raising=False)

        def swap(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
            _REAL_SWAP(a, b)
            with fake._lock:
                ka, kb = a._cdata, b._cdata
                oa, ob = fake._owners.pop(ka, None), fake._owners.pop(kb, None)
                if ob is not None:
                    fake._owners[ka] = ob
                if oa is not None:
                    fake._owners[kb] = oa
                fake._watch(a)
                fake._watch(b)

        monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", swap)

        def queued(real: Callable[..., Any], name: str) -> Callable[..., Any]:
            """A torch op that, on fake device memory, is work on the current stream of its device.

            As a GPU does, the queued op works on the memory its operands had when it was issued: a
            later data pointer swap (rescue, the guard) or a lease going stale does not change what it
            reads or writes. So it runs on address aliases taken now (contiguous operands; others run
            at once), holding the operands meanwhile so that their memory stays allocated."""
            def op(target: Any, *args: Any, **kw: Any) -> Any:
                touched = [x for x in (target, *args) if isinstance(x, (torch.Tensor, torch.UntypedStorage))]
                allocs = [a for a in (fake._find(x.data_ptr()) for x in touched) if a is not None]
                if not allocs:
                    return real(target, *args, **kw)
                fake._check_vmm_access(touched, target)
                if not all(_contiguous(x) for x in touched):
                    real(target, *args, **kw)
                    fake.current_stream(allocs[0].device.index).launch(name, lambda: None, allocs)
                    return target
                frozen = [_address_alias(x) if isinstance(x, (torch.Tensor, torch.UntypedStorage)) else x
                          for x in (target, *args)]  # (by address: the work holds no device operand alive)
                # Host memory is another matter: a copy from pageable host memory reads it when issued, so
                # a host operand the caller drops at once (a temporary) must still be there when it runs.
                host = [x for x in touched if fake._find(x.data_ptr()) is None]

                def work() -> None:
                    host  # noqa: B018
                    _REAL_TENSOR_COPY(frozen[0], frozen[1]) if name != "fill_" else _REAL_FILL(frozen[0], *frozen[1:])

                fake.current_stream(allocs[0].device.index).launch(name, work, allocs)
                return target
            return op

        monkeypatch.setattr(torch.Tensor, "fill_", queued(torch.Tensor.fill_, "fill_"))
        monkeypatch.setattr(torch.Tensor, "copy_", queued(torch.Tensor.copy_, "copy_"))
        monkeypatch.setattr(torch.UntypedStorage, "copy_", queued(torch.UntypedStorage.copy_, "storage.copy_"))

        def on_device(device: Any) -> bool:
            return device is not None and torch.device(device).type == "cuda"

        def empty(*size: Any, dtype: Any = None, device: Any = None, **kw: Any) -> torch.Tensor:
            if not on_device(device):
                return _REAL_EMPTY(*size, dtype=dtype, device=device, **kw)
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
            dtype = dtype or torch.float32
            n = int(np.prod(shape, dtype=np.int64)) if shape else 1
            return fake.alloc(n * dtype.itemsize, device).view(dtype).view(shape)

        def zeros(*size: Any, dtype: Any = None, device: Any = None, **kw: Any) -> torch.Tensor:
            if not on_device(device):
                return _REAL_ZEROS(*size, dtype=dtype, device=device, **kw)
            return empty(*size, dtype=dtype, device=device).fill_(0)  # (queued or captured, as a memset)

        def zeros_like(t: torch.Tensor, **kw: Any) -> torch.Tensor:
            if not fake.is_cuda(t):
                return _REAL_ZEROS_LIKE(t, **kw)
            return fake.zeros(t.numel(), t.dtype, fake.device_of(t)).view(t.shape)

        def cat(tensors: Any, dim: int = 0, **kw: Any) -> torch.Tensor:
            tensors = list(tensors)
            if not tensors or not all(fake.is_cuda(t) for t in tensors):
                return _REAL_CAT(tensors, dim=dim, **kw)
            joined = _REAL_CAT(tensors, dim=dim, **kw)  # computed on the CPU at once, like every fake op
            out = fake.alloc(joined.numel() * joined.element_size(), fake.device_of(tensors[0]))
            out = out.view(joined.dtype).view(joined.shape)
            out.copy_(joined)
            return out

        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch, "zeros", zeros)
        monkeypatch.setattr(torch, "zeros_like", zeros_like)
        monkeypatch.setattr(torch, "cat", cat)
        bridge.use_kernels(self.gpu)
        from cuda_hooks import vmm

        self.vmm = FakeVmm(self)
        vmm.use_driver(self.vmm)
        monkeypatch.setattr(sys.modules[__name__], "_ACTIVE", self)
        return self

    def settle(self) -> None:
        """Run every queued launch (the end of a test)."""
        for s in list(self._streams.values()):
            s.paused = False
            s.flush()

    def uninstall(self) -> None:
        """(After :meth:`settle`, the sanitizer disabled and the test's tensors collected.) The real
        kernels again, and no device state of this test left behind; the patches go with the monkeypatch."""
        import cuda_hooks.bridge as bridge
        from cuda_hooks import vmm

        bridge.use_kernels(None)
        vmm.use_driver(None)
        reset_device_state()


def reset_device_state() -> None:
    """Give the sanitizer's device state a fresh start (before and after each test), through the public
    hooks each module that keeps some has: the bridge's caches and scratches, the checksums' slot
    tables, the poison blocks, the capture warning."""
    import cuda_hooks
    from sanitizer.features import checksums
    from sanitizer.torch_layer import graph_capture, storage_handles

    cuda_hooks.reset_device_state()
    checksums.reset_device_state()
    trap_cuda = sys.modules.get("sanitizer.torch_layer.trap_cuda")
    if trap_cuda is not None:  # (imported by a CUDA trap buffer only)
        trap_cuda.reset_device_state()
    storage_handles.reset_device_state()
    graph_capture.reset_device_state()


try:  # the fixture, for test modules that import it
    import pytest

    def _collect_before_uninstall() -> None:
        """The test's leases and buffers die while the fake device is still installed (their ends call the
        fake's kernels and driver): the young generations first, the whole heap only when one is left."""
        import gc

        from sanitizer.torch_layer.state import state

        def left() -> bool:
            return bool(state.ledger.live_count or state.ledger.regions())

        gc.collect(1)
        if left():
            gc.collect()

    @pytest.fixture
    def fake_cuda(monkeypatch: Any) -> Iterator[FakeCuda]:
        """Two fake CUDA devices for one test; queued work is run and the device state reset after it."""
        fake = FakeCuda(2).install(monkeypatch)
        try:
            yield fake
        finally:
            fake.settle()
            import sanitizer

            sanitizer.disable()
            _collect_before_uninstall()
            fake.uninstall()
except ImportError:  # pragma: no cover - the simulator child imports this module without pytest
    pass

__all__ = ["FakeCuda", "FakeVmm", "FakeStream", "FakeEvent", "FakeGpu", "TwinKernels", "CAPTURE_ERROR", "fake_cuda",
           "reset_device_state"]
