"""Torch adapter: the calls the sanitizer makes on borrowed tensors.

Why a separate layer: the kernels (``cpu.py``, ``gpu.py``) know only numpy
and numba device arrays; this module validates torch tensors, takes their raw
bytes without copying, picks the CPU or CUDA path and runs CUDA work on
torch's current stream of the tensor's device.  numba is imported on the first
call that needs it, so importing ``cuda_hooks`` stays cheap.

Hash slots (``out``, ``expected``) are int64 tensors holding the uint64 hash
bit patterns (torch has no general uint64 support); ``flags`` is int32.

CUDA calls return the ``torch.cuda.Stream`` their work was queued on, so a
caller can wait for exactly the streams it used.  Host cost per check: one
``as_cuda_array`` conversion (the checked bytes); the numba arrays of the
long-lived tensors (the per-stream scratch, the caller's slot tensors) are
converted once and cached.  Which tensors are CUDA tensors is asked of
:mod:`cuda_hooks.devices` (a test harness stands in for it without a GPU).
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
import time
from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from . import devices, machine_code
from .errors import KernelsUnavailable
from .kernel_choice import PARALLEL_MIN_BYTES
from .loading import loading

__all__ = ["checksum", "checksum_host", "checksum_host_tensor", "checksum_into", "verify_into", "poison", "warm", "warm_host", "kernel_info",
           "compile_seconds", "to_signed", "to_unsigned", "KernelsUnavailable"]

_U64 = 1 << 64
_modules: Dict[str, ModuleType] = {}
_import_seconds: Dict[str, float] = {}
_scratch: Dict[Tuple[int, int], torch.Tensor] = {}
_graph_scratches: List[torch.Tensor] = []  # scratches captured into CUDA graphs (see _graph_scratch)
_lock = threading.Lock()


def to_signed(h: int) -> int:
    """uint64 hash -> the int64 bit pattern stored in a hash slot tensor."""
    return h - _U64 if h >= 1 << 63 else h


def to_unsigned(v: int) -> int:
    """int64 value read from a hash slot tensor -> the uint64 hash."""
    return v % _U64


# --------------------------------------------------------------------------- lazy kernels


def _cpu() -> ModuleType:
    mod = _modules.get("cpu")
    if mod is None:
        with loading():  # (a fork waits for the import: see loading.py)
            t0 = time.perf_counter()
            from . import cpu as mod

            _import_seconds.setdefault("numba_import_cpu", time.perf_counter() - t0)
            _modules["cpu"] = mod
    return mod


_stored: List[Optional[machine_code.HostHash]] = []  # the stored serial hash, once looked for: [it or None]


def _stored_hash() -> Optional[machine_code.HostHash]:
    """The serial hash as stored machine code (no numba start, see machine_code.py), looked for once."""
    if not _stored:
        with loading():  # (a fork waits for the load: see loading.py)
            if not _stored:
                code = machine_code.load()
                if code is not None:
                    _import_seconds["cpu_hash_machine_code"] = code.seconds
                _stored.append(code)
    return _stored[0]


def warm_host() -> bool:
    """Load the stored CPU hash now (see machine_code.py), never numba: True when it is loaded.

    For ``enable(checksum=1)``: ~0.03 s there instead of inside the first lend; where no code is stored
    yet, numba still loads at the first hash (which stores it), as before."""
    return _stored_hash() is not None


def _hash_stored(address: int, nbytes: int) -> Optional[int]:
    """The stored code's hash of ``nbytes`` bytes at ``address``, or None where numba's kernels hash instead:
    no code stored, or an input of :data:`PARALLEL_MIN_BYTES` or more (the parallel kernel may pay). The code
    reads whole words, so bytes at an address that is not a multiple of 8 (a bf16 tensor after a float32 scalar
    in a safetensors file, a slice at an odd offset) are copied into an aligned buffer of ours first: below 32
    MiB that is at most a few ms, where numba's start would be ~0.45 s."""
    if nbytes >= PARALLEL_MIN_BYTES:
        return None
    code = _stored_hash()
    if code is None:
        return None
    if address % 8 == 0:
        return code.hash_at(address, nbytes)
    aligned = np.empty(nbytes, dtype=np.uint8)
    to = aligned.ctypes.data
    if to % 8:
        return None
    ctypes.memmove(to, address, nbytes)
    return code.hash_at(to, nbytes)


def _hash_host(buf: np.ndarray) -> int:
    """hashdef's hash of a host byte array: the stored serial code where it serves (:func:`_hash_stored`),
    numba's kernels otherwise (which refuse an invalid array with a ValueError naming it, and store the code
    for the next process)."""
    if buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous:
        found = _hash_stored(buf.ctypes.data, buf.size)
        if found is not None:
            return found
    return _cpu().hash_bytes(buf)


def _gpu() -> ModuleType:
    mod = _modules.get("gpu")
    if mod is None:
        with loading():  # (a fork waits for the import: see loading.py)
            t0 = time.perf_counter()
            try:
                from . import gpu as mod
            except ImportError as exc:
                raise KernelsUnavailable(
                    "cuda_hooks needs numba's CUDA target for CUDA tensors "
                    f"(import failed: {exc}); pip install 'ownership-sanitizer[cuda12]' (or [cuda13]) for numba-cuda"
                ) from exc
            _import_seconds.setdefault("numba_import_cuda", time.perf_counter() - t0)
            _modules["gpu"] = mod
    return mod


# --------------------------------------------------------------------------- validation


def _raw_bytes(t: Any, name: str = "t") -> torch.Tensor:
    """Zero-copy uint8 view of a contiguous tensor's bytes (same storage)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be a dense CPU or CUDA tensor, got layout={t.layout} device={t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got shape={tuple(t.shape)} stride={t.stride()}")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"{name} has a lazy conj/neg bit; its raw bytes are not its values")
    flat = t.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _slot_tensor(v: Any, name: str, dtype: torch.dtype, device: torch.device, slot: Any) -> int:
    """Check a slot tensor (1-D, contiguous, dtype, device) and the slot index."""
    if not isinstance(v, torch.Tensor) or v.dtype != dtype or v.dim() != 1 or not v.is_contiguous():
        desc = f"{v.dtype} shape={tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{name} must be a contiguous 1-D {dtype} tensor, got {desc}")
    where = devices.device_of(v) if devices.is_cuda(v) else v.device
    if where != device:
        raise ValueError(f"{name} is on {where} but the tensor is on {device}")
    if isinstance(slot, bool):
        raise ValueError(f"slot must be an int, got {slot!r}")
    try:
        i = operator.index(slot)
    except TypeError:
        raise ValueError(f"slot must be an int, got {slot!r}") from None
    if not 0 <= i < v.numel():
        raise ValueError(f"slot {i} out of range for {name} of length {v.numel()}")
    return i


# --------------------------------------------------------------------------- CUDA plumbing


def _device_scope(gpu: ModuleType, index: int) -> ContextManager[None]:
    """Make device ``index`` current for torch and numba (a no-op when it already is)."""
    if index == torch.cuda.current_device():
        return nullcontext()
    return _both_devices(gpu, index)


@contextmanager
def _both_devices(gpu: ModuleType, index: int) -> Iterator[None]:
    with torch.cuda.device(index), gpu.device_scope(index):
        yield


class _ArrayCache:
    """numba arrays of long-lived tensors (scratch, slot tables), converted once.

    An entry holds its tensor (the array refers to its memory), so the cache is
    bounded: the oldest entry goes first. A hit is the very same tensor object.
    """

    LIMIT = 64

    def __init__(self) -> None:
        self._entries: Dict[Tuple[int, Any], Tuple[torch.Tensor, Any]] = {}

    def get(self, gpu: ModuleType, t: torch.Tensor, dtype: Any) -> Any:
        key = (id(t), dtype)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        arr = gpu.as_array(t, dtype)
        with _lock:
            if len(self._entries) >= self.LIMIT:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = (t, arr)
        return arr

    def clear(self) -> None:
        with _lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_arrays = _ArrayCache()
_warm: set = set()  # device indices whose kernels are loaded


def _after_fork_in_child() -> None:
    """A forked child cannot use its parent's CUDA context: a fresh lock, and none of the parent's
    device arrays, scratch or loaded kernels."""
    global _lock, _arrays, _scratch, _warm, _graph_scratches
    _lock = threading.Lock()
    _arrays, _scratch, _warm, _graph_scratches = _ArrayCache(), {}, set(), []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _scratch_for(device: torch.device, stream: Any) -> torch.Tensor:
    """Per-(device, stream) 2-word accumulator, zeroed on that stream; the kernel leaves it zeroed."""
    key = (device.index or 0, stream.cuda_stream)
    s = _scratch.get(key)
    if s is None:
        with torch.cuda.stream(stream):  # the memset must precede the kernels on their own stream
            s = devices.zeros(2, torch.int64, device)
        _scratch[key] = s
    return s


def _graph_scratch(device: torch.device) -> torch.Tensor:
    """(While the current stream captures a graph.) A scratch of the graph's own, made and zeroed in the
    capture: the memset is captured, so it runs at each replay, not now. Never the stream's cached one,
    which two graphs captured on one stream would share (racing when both replay), and never cached for
    eager launches, which would run on memory whose zeroing never ran. Kept for the process's life: the
    graph reads it at every replay, and it has no way to say when the graph is gone (16 bytes, one
    allocator block, per check captured)."""
    s = devices.zeros(2, torch.int64, device)
    with _lock:
        _graph_scratches.append(s)
    return s


def _warm_locked(gpu: ModuleType, index: int) -> None:
    """(In device ``index``'s scope.) Load the kernels once; refuse while a graph capture is under way."""
    if index in _warm:
        return
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cuda_hooks kernels are not loaded on cuda:{index} and the current stream is capturing a CUDA "
            f"graph: loading a module now would invalidate the capture; call cuda_hooks.warm() before capturing")
    gpu.warm()
    _warm.add(index)


def _enqueue(raw: torch.Tensor, device: torch.device, launch: Callable[..., None]) -> Any:
    """The CUDA prologue of the hashing calls: on ``raw``'s device, hand ``launch(gpu, data, scratch,
    stream, index)`` the bytes and the stream's scratch as numba arrays; returns torch's stream used."""
    gpu = _gpu()
    index = device.index or 0
    stream = torch.cuda.current_stream(index)
    with _device_scope(gpu, index):
        _warm_locked(gpu, index)
        if torch.cuda.is_current_stream_capturing():
            scratch = gpu.as_array(_graph_scratch(device), np.uint64)
        else:
            scratch = _arrays.get(gpu, _scratch_for(device, stream), np.uint64)
        launch(gpu, gpu.as_array(raw), scratch, gpu.stream_for(stream.cuda_stream, index), index)
    return stream


# --------------------------------------------------------------------------- public API


def warm(device: Any = None) -> None:
    """Compile (or load from numba's disk cache) and load the CUDA kernels on ``device`` (default: the
    current one) now, so that no later check compiles or loads a module (e.g. during a graph capture).

    Raises :class:`KernelsUnavailable`, saying what to install, when they cannot be.
    """
    gpu = _gpu()
    index = _device_index(device)
    with _device_scope(gpu, index):
        _warm_locked(gpu, index)


def _device_index(device: Any) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    d = device if isinstance(device, torch.device) else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"warm() needs a CUDA device, got {device!r}")
    return torch.cuda.current_device() if d.index is None else d.index


def checksum(t: torch.Tensor) -> int:
    """Hash of ``t``'s raw bytes as an int in [0, 2**64), computed now.

    For a CUDA tensor this launches the device kernel and waits for it (a
    host synchronisation); use :func:`checksum_into` on hot paths.
    """
    raw = _raw_bytes(t)
    if not devices.is_cuda(raw):
        return _hash_host(raw.numpy())
    device = devices.device_of(raw)
    out = devices.zeros(1, torch.int64, device)
    # (a one-shot output: its numba array is made for this launch, not cached, or every call would
    # push a long-lived entry, a slot table's or a scratch's, out of the bounded cache)
    stream = _enqueue(raw, device, lambda gpu, data, scratch, stream, index: gpu.checksum_async(
        data, scratch, gpu.as_array(out, np.uint64), 0, stream, device=index))
    stream.synchronize()
    return to_unsigned(int(out.item()))


def reset_device_state() -> None:
    """Forget every device object this module keeps: converted arrays, scratches (the graphs' too) and
    which devices have their kernels loaded. For a test harness between tests, or after the devices
    were reset; a forked child gets the same at the fork."""
    _arrays.clear()  # (under the lock itself: not re-entrant)
    with _lock:
        _scratch.clear()
        _warm.clear()
        _graph_scratches.clear()


def use_kernels(gpu: Optional[ModuleType]) -> None:
    """Launch through ``gpu`` (a module with :mod:`cuda_hooks.gpu`'s functions) instead of the real CUDA
    kernels; None goes back to them. For a test harness that runs the CUDA paths without a GPU."""
    with _lock:
        if gpu is None:
            _modules.pop("gpu", None)
        else:
            _modules["gpu"] = gpu


def cached_arrays() -> int:
    """How many tensors' numba arrays the CUDA calls keep converted (bounded; for tests and tools)."""
    return len(_arrays)


def checksum_host(buf: np.ndarray) -> int:
    """Hash of a host byte array (C-contiguous 1-D uint8 numpy array), the same hash as :func:`checksum`.

    For callers that validated the bytes already (the sanitizer's lend hook hashes every CPU
    lease): it skips :func:`checksum`'s tensor checks and views, measured 3.7 us against 6.5 us
    around the kernel for a small lease.  A wrong array is refused with a ValueError naming
    its dtype and shape.
    """
    return _hash_host(buf)


_data_ptr = torch._C.TensorBase.data_ptr  # (a C method: no dispatch mode, no subclass's override)
_as_numpy = torch._C.TensorBase.numpy


def checksum_host_tensor(raw: torch.Tensor) -> int:
    """:func:`checksum_host` of a CPU tensor's bytes, for callers that validated it already: ``raw`` is a
    contiguous 1-D uint8 CPU tensor (the sanitizer's lend and retire hooks). Where the stored code serves, it
    hashes at the tensor's address without a numpy array (~1 us less a lease); otherwise numba's kernels
    hash its numpy view."""
    found = _hash_stored(_data_ptr(raw), raw.numel())
    return found if found is not None else _cpu().hash_bytes(_as_numpy(raw))


def checksum_into(t: torch.Tensor, out: torch.Tensor, slot: int) -> Optional[Any]:
    """``out[slot] = hash(t)`` (int64 bit pattern), same device as ``t``.

    CUDA: enqueued on torch's current stream of ``t``'s device, no host
    synchronisation; returns that stream. CPU: computed now; returns None.
    """
    raw = _raw_bytes(t)
    if not devices.is_cuda(raw):
        slot = _slot_tensor(out, "out", torch.int64, raw.device, slot)
        out[slot] = to_signed(_hash_host(raw.numpy()))
        return None
    device = devices.device_of(raw)
    slot = _slot_tensor(out, "out", torch.int64, device, slot)
    return _enqueue(raw, device, lambda gpu, data, scratch, stream, index: gpu.checksum_async(
        data, scratch, _arrays.get(gpu, out, np.uint64), slot, stream, device=index))


def verify_into(t: torch.Tensor, expected: torch.Tensor, slot: int, flags: torch.Tensor) -> Optional[Any]:
    """Set ``flags[slot] = 1`` if ``hash(t) != expected[slot]``; a match leaves it as is.

    CUDA: compared on the device on torch's current stream of ``t``'s device,
    no host synchronisation; returns that stream. CPU: compared now; returns None.
    """
    raw = _raw_bytes(t)
    device = devices.device_of(raw) if devices.is_cuda(raw) else raw.device
    slot = _slot_tensor(expected, "expected", torch.int64, device, slot)
    _slot_tensor(flags, "flags", torch.int32, device, slot)
    if device.type == "cpu":
        if to_signed(_hash_host(raw.numpy())) != int(expected[slot]):
            flags[slot] = 1
        return None
    return _enqueue(raw, device, lambda gpu, data, scratch, stream, index: gpu.verify_async(
        data, scratch, _arrays.get(gpu, expected, np.uint64), slot, _arrays.get(gpu, flags, None), stream,
        device=index))


def poison(t: torch.Tensor, byte: int) -> Optional[Any]:
    """Fill ``t``'s bytes with ``byte`` (0..255) in place, on its own storage.

    CPU: ``numpy.fill`` (a memset), measured faster than torch's ``fill_``
    and than a numba prange fill on the 2-core dev machine (see
    ``bench/checksum.py``), followed by an empty in-place torch op so ``t``'s
    version counter moves as for any in-place write (autograd then refuses
    to use a poisoned saved tensor); returns None.  CUDA: torch's ``fill_`` on
    a uint8 view, a vectorised fill enqueued on the current stream with no JIT
    compile and less launch overhead than the numba kernel
    (``gpu.poison_async``, kept for raw numba device arrays); returns that stream.
    """
    if isinstance(byte, bool) or not isinstance(byte, int) or not 0 <= byte <= 255:
        raise ValueError(f"byte must be an int in 0..255, got {byte!r}")
    raw = _raw_bytes(t)
    if not devices.is_cuda(raw):
        raw.numpy().fill(byte)
        raw[:0].fill_(byte)  # version-counter bump only
        return None
    index = devices.device_of(raw).index or 0
    raw.fill_(byte)
    return torch.cuda.current_stream(index)


def kernel_info() -> Dict[str, Any]:
    """numba's CUDA implementation, NVVM version, registers and resident blocks per kernel (after
    :func:`warm`), and first-use seconds: what a device check prints."""
    return _gpu().kernel_info()


def compile_seconds() -> Dict[str, float]:
    """First-use seconds per kernel (compile, or load from numba's disk cache).

    Keys appear once the kernel has been used: ``cpu_hash_serial``,
    ``cpu_hash_parallel``, ``cuda_checksum``, ``cuda_verify``,
    ``cuda_poison``, plus ``numba_import_*`` for the lazy import itself.
    """
    result = dict(_import_seconds)
    for name in ("cpu", "gpu"):
        mod = _modules.get(name)
        if mod is not None:
            result.update(mod.compile_seconds())
    return result
