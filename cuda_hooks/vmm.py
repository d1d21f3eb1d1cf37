"""CUDA virtual memory management (the driver's ``cuMem*`` calls), for trap mode on CUDA only.

Why this exists: trap mode gives each lease a mapping of its own of the staging buffer's bytes and,
when a reuse retires the lease, replaces that mapping in place, so that every alias of the lease
(DLPack, CuPy, ``__cuda_array_interface__``, a C extension's pointer) reads poison or faults instead
of the next tensor. On the CPU that is ``mmap`` of a memfd (:mod:`sanitizer.core.pages`); on a GPU it
is the driver's virtual memory management:

* the loader writes at a virtual range of the buffer's own;
* the buffer's memory is one physical allocation *per granule* (``cuMemCreate`` of one granule each),
  mapped side by side at offset 0, as PyTorch's expandable segments do: ``cuMemMap``'s ``offset``
  "currently must be zero" (cuda.h), so a granule past the first cannot be mapped out of one big
  allocation;
* a lease's tensor lives on a *virtual alias*: a range reserved for it (``cuMemAddressReserve``) onto
  which the granules that hold the lease are mapped one by one (``cuMemMap``, offset 0 each), so no
  byte is copied and two leases that share a granule have two aliases;
* a retire unmaps the alias and maps a shared, read-only poison allocation there (``trap=poison``), or
  leaves the range reserved with nothing mapped (``trap=fault``: any access is an illegal address);
  a rescue maps a private copy of the lease's granules there instead.

Everything is at the device's allocation granularity (``cuMemGetAllocationGranularity``, 2 MiB on
current data-centre GPUs): an alias reserves whole granules of virtual space (no physical memory), a
rescue copies whole granules. ``docs/cuda.md`` has the design and its costs.

The calls go through one :class:`Driver` object, :func:`driver`; a test harness installs another with
:func:`use_driver` (``tests/fake_cuda.py`` maps memfd pages instead), as :mod:`cuda_hooks.devices` lets
it stand in for device memory. :class:`CudaDriver` is the real one, over ``libcuda`` through ctypes
(no CUDA Python package is needed). Every call is made with the device's primary context current (the
one torch uses), pushed and popped around it. torch-free.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["Driver", "CudaDriver", "VmmError", "OutOfMemory", "ContextLost", "error", "driver", "use_driver",
           "round_up", "ranges", "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_NOT_SUPPORTED",
           "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_STUB_LIBRARY"]

# CUresult values (cuda.h) that decide what the sanitizer does; any other failure is a plain VmmError
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_STUB_LIBRARY = 34
CUDA_ERROR_ILLEGAL_ADDRESS = 700
CUDA_ERROR_NOT_SUPPORTED = 801
# errors after which the context is unusable ("the process must terminate and relaunch", cuda.h):
# illegal address, launch timeout, hardware stack error, illegal instruction, misaligned address,
# invalid address space, invalid PC, launch failed
_STICKY = frozenset({700, 702, 714, 715, 716, 717, 718, 719})


class VmmError(RuntimeError):
    """A ``cuMem*`` call failed: the call, its arguments and the driver's error name (``code``: the CUresult,
    None when no call was made)."""

    def __init__(self, message: str, code: Optional[int] = None):
        super().__init__(message)
        self.code = code


class OutOfMemory(VmmError):
    """``CUDA_ERROR_OUT_OF_MEMORY``: the caller may free memory (torch's cache) and retry, then fall back."""


class ContextLost(VmmError):
    """A sticky error (``CUDA_ERROR_ILLEGAL_ADDRESS`` and kin): the CUDA context is gone. Never a fallback:
    raise it, so the process ends saying why, as any CUDA call after it would fail anyway."""


def error(message: str, code: Optional[int]) -> VmmError:
    """The exception for a failed call: :class:`OutOfMemory`, :class:`ContextLost` or :class:`VmmError`."""
    if code == CUDA_ERROR_OUT_OF_MEMORY:
        return OutOfMemory(message, code)
    if code in _STICKY:
        return ContextLost(message, code)
    return VmmError(message, code)


def round_up(n: int, granule: int) -> int:
    """``n`` rounded up to a whole number of granules (at least one)."""
    return max(1, -(-n // granule)) * granule


class Driver:
    """The ``cuMem*`` calls trap mode makes (sizes and offsets in bytes, multiples of the granularity)."""

    def unavailable(self, device: int) -> Optional[str]:
        """None when ``device`` supports virtual memory management, else why not (one line)."""
        raise NotImplementedError

    def granularity(self, device: int) -> int:
        raise NotImplementedError

    def create(self, size: int, device: int) -> int:
        """A physical allocation of ``size`` bytes on ``device``: its handle."""
        raise NotImplementedError

    def release(self, handle: int) -> None:
        """Drop the handle; the memory lives on while a range maps it."""
        raise NotImplementedError

    def reserve(self, size: int, granule: int, device: int) -> int:
        """A virtual range of ``size`` bytes (nothing mapped, no access): its address."""
        raise NotImplementedError

    def free(self, address: int, size: int) -> None:
        raise NotImplementedError

    def map(self, address: int, size: int, handle: int, offset: int) -> None:
        """Map ``size`` bytes of allocation ``handle`` from ``offset`` at ``address`` (no access yet)."""
        raise NotImplementedError

    def unmap(self, address: int, size: int) -> None:
        """Unmap a range (it stays reserved, with no access)."""
        raise NotImplementedError

    def set_access(self, address: int, size: int, devices: Sequence[int], writable: bool) -> None:
        """Grant each of ``devices`` read-write (or read-only) access to a fully mapped range."""
        raise NotImplementedError

    def memset(self, address: int, byte: int, size: int, device: int) -> None:
        """Fill, and wait for it (poison allocations are made once)."""
        raise NotImplementedError

    def copy(self, dst: int, src: int, size: int, device: int) -> None:
        """Device to device, and wait for it (a rescue)."""
        raise NotImplementedError


# -- the real driver ---------------------------------------------------------------------------------------------
_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READ = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp (cuda.h, CUDA 11.2+)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriver(Driver):
    """``libcuda`` through ctypes. Loaded on first use; a machine without it says so in :meth:`unavailable`."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._load_error: Optional[str] = None  # the library could not be loaded (final)
        self._initialised = False
        self._init_error: Optional[str] = None  # the last cuInit failed (retried at the next call)
        self._contexts: Dict[int, ctypes.c_void_p] = {}
        self._devices: Dict[int, int] = {}  # ordinal -> cuDeviceGet's handle
        self._lock = threading.RLock()

    def _cuda(self) -> Any:
        """The library, initialised; None (``_load_error`` says why) when it cannot be loaded or initialised.
        A failed ``cuInit`` is retried at the next call (it may fail while a driver is still coming up)."""
        with self._lock:
            if self._lib is None and self._load_error is None:
                self._lib, self._load_error = _load_library()
            lib = self._lib
        if lib is None:
            return None
        if not self._initialised:
            rc = lib.cuInit(0)
            if rc != 0:
                self._init_error = f"cuInit(0) failed: {self._name(rc)}" + (
                    " (a CUDA toolkit's stub libcuda was loaded, not the driver's)" if rc == CUDA_ERROR_STUB_LIBRARY else "")
                return None
            self._initialised, self._init_error = True, None
        return lib

    def _name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        lib = self._lib
        if lib is not None and lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {rc}"

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise error(f"{call} failed: {self._name(rc)}", rc)

    def _device(self, ordinal: int) -> int:
        """``cuDeviceGet``'s handle of device ``ordinal`` (what the ``CUdevice`` arguments take)."""
        with self._lock:
            handle = self._devices.get(ordinal)
        if handle is None:
            dev = ctypes.c_int(0)
            self._check(self._lib.cuDeviceGet(ctypes.byref(dev), ordinal), f"cuDeviceGet({ordinal})")
            handle = int(dev.value)
            with self._lock:
                self._devices[ordinal] = handle
        return handle

    def _context(self, device: int) -> ctypes.c_void_p:
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                ctx = ctypes.c_void_p()
                self._check(self._lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self._device(device)),
                            f"cuDevicePrimaryCtxRetain(device {device})")
                self._contexts[device] = ctx
            return ctx

    def _call(self, device: int, fn: str, *args: Any) -> None:
        """``fn(*args)`` with ``device``'s primary context current (pushed, then popped)."""
        lib = self._cuda()
        if lib is None:
            raise VmmError(self._load_error or self._init_error or "no CUDA driver")
        self._check(lib.cuCtxPushCurrent_v2(self._context(device)), "cuCtxPushCurrent")
        try:
            self._check(getattr(lib, fn)(*args), f"{fn}{tuple(a if isinstance(a, int) else '&' for a in args)}")
        finally:
            popped = ctypes.c_void_p()
            lib.cuCtxPopCurrent_v2(ctypes.byref(popped))

    @staticmethod
    def _prop(device: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location = _Location(_CU_MEM_LOCATION_TYPE_DEVICE, device)
        return prop

    def unavailable(self, device: int) -> Optional[str]:
        lib = self._cuda()
        if lib is None:
            return self._load_error or self._init_error
        value = ctypes.c_int(0)
        try:
            self._check(lib.cuDeviceGetAttribute(ctypes.byref(value),
                                                 _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                                 self._device(device)),
                        "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)")
        except ContextLost:
            raise  # never a reason to fall back quietly: the context is gone
        except VmmError as exc:
            return str(exc)
        return None if value.value else f"device {device} does not support virtual memory management"

    def granularity(self, device: int) -> int:
        out = ctypes.c_size_t(0)
        prop = self._prop(device)
        self._call(device, "cuMemGetAllocationGranularity", ctypes.byref(out), ctypes.byref(prop),
                   _CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return int(out.value)

    def create(self, size: int, device: int) -> int:
        handle = ctypes.c_ulonglong(0)
        prop = self._prop(device)
        self._call(device, "cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        return int(handle.value)

    def release(self, handle: int) -> None:
        self._call(self._device_of_handle(), "cuMemRelease", handle)

    def _device_of_handle(self) -> int:
        return next(iter(self._contexts), 0)  # any context will do for release/free/unmap (one address space)

    def reserve(self, size: int, granule: int, device: int) -> int:
        address = ctypes.c_ulonglong(0)
        self._call(device, "cuMemAddressReserve", ctypes.byref(address), size, granule, 0, 0)
        return int(address.value)

    def free(self, address: int, size: int) -> None:
        self._call(self._device_of_handle(), "cuMemAddressFree", address, size)

    def map(self, address: int, size: int, handle: int, offset: int) -> None:
        self._call(self._device_of_handle(), "cuMemMap", address, size, offset, handle, 0)

    def unmap(self, address: int, size: int) -> None:
        self._call(self._device_of_handle(), "cuMemUnmap", address, size)

    def set_access(self, address: int, size: int, devices: Sequence[int], writable: bool) -> None:
        # CUmemLocation.id of a CU_MEM_LOCATION_TYPE_DEVICE location is the device ordinal (cuda.h)
        flags = _CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else _CU_MEM_ACCESS_FLAGS_PROT_READ
        descs = (_AccessDesc * len(devices))(*[_AccessDesc(_Location(_CU_MEM_LOCATION_TYPE_DEVICE, d), flags)
                                               for d in devices])
        self._call(devices[0], "cuMemSetAccess", address, size, descs, len(devices))

    def memset(self, address: int, byte: int, size: int, device: int) -> None:
        self._call(device, "cuMemsetD8_v2", address, byte, size)
        self._call(device, "cuCtxSynchronize")

    def copy(self, dst: int, src: int, size: int, device: int) -> None:
        self._call(device, "cuMemcpyDtoD_v2", dst, src, size)
        self._call(device, "cuCtxSynchronize")


def _declare(lib: Any) -> None:
    """Set the argument and result types of every call made (AttributeError: a driver without one)."""
    u64, size_t = ctypes.c_ulonglong, ctypes.c_size_t
    sigs = {
        "cuInit": [ctypes.c_uint],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuCtxPushCurrent_v2": [ctypes.c_void_p],
        "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
        "cuCtxSynchronize": [],
        "cuMemGetAllocationGranularity": [ctypes.POINTER(size_t), ctypes.POINTER(_AllocationProp), ctypes.c_int],
        "cuMemCreate": [ctypes.POINTER(u64), size_t, ctypes.POINTER(_AllocationProp), u64],
        "cuMemRelease": [u64],
        "cuMemAddressReserve": [ctypes.POINTER(u64), size_t, size_t, u64, u64],
        "cuMemAddressFree": [u64, size_t],
        "cuMemMap": [u64, size_t, size_t, u64, u64],
        "cuMemUnmap": [u64, size_t],
        "cuMemSetAccess": [u64, size_t, ctypes.POINTER(_AccessDesc), size_t],
        "cuMemsetD8_v2": [u64, ctypes.c_ubyte, size_t],
        "cuMemcpyDtoD_v2": [u64, u64, size_t],
    }
    for fn, args in sigs.items():
        f = getattr(lib, fn)
        f.argtypes, f.restype = args, ctypes.c_int


def _load_library() -> "tuple[Any, Optional[str]]":
    """``(lib, None)`` or ``(None, why)``. ``libcuda.so.1`` first: it is the driver's; the unversioned
    name ``find_library`` finds may be a toolkit's stub (``lib64/stubs``), whose every call returns
    ``CUDA_ERROR_STUB_LIBRARY``."""
    errors = []
    for name in ("libcuda.so.1", ctypes.util.find_library("cuda")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
            continue
        try:
            _declare(lib)
        except AttributeError as exc:
            return None, f"the CUDA driver has no virtual memory management ({exc})"
        return lib, None
    return None, f"the CUDA driver library could not be loaded ({'; '.join(errors) or 'libcuda not found'})"


_driver: Optional[Driver] = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The driver trap mode calls (the real one unless a harness installed another)."""
    global _driver
    if _driver is None:
        with _driver_lock:
            if _driver is None:
                _driver = CudaDriver()
    return _driver


def use_driver(replacement: Optional[Driver]) -> Optional[Driver]:
    """Install ``replacement`` (None: the real driver again, on next use); returns the one before."""
    global _driver
    with _driver_lock:
        before, _driver = _driver, replacement
    return before


def ranges(size: int, granule: int) -> List[int]:
    """The granule offsets of a range of ``size`` bytes (a poison allocation of one granule is mapped at each)."""
    return list(range(0, size, granule))
