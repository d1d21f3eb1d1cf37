"""Torch adapter: the calls the sanitizer makes on borrowed tensors.

Why a separate layer: the kernels (``cpu.py``, ``gpu.py``) know only numpy
and numba device arrays; this module validates torch tensors, takes their raw
bytes without copying, picks the CPU or CUDA path and runs CUDA work on
torch's current stream.  numba is imported on the first call that needs it,
so importing ``cuda_hooks`` stays cheap.

Hash slots (``out``, ``expected``) are int64 tensors holding the uint64 hash
bit patterns (torch has no general uint64 support); ``flags`` is int32.
"""

from __future__ import annotations

import operator
import time
from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any, Iterator

import numpy as np
import torch

__all__ = ["checksum", "checksum_into", "verify_into", "poison", "compile_seconds", "to_signed", "to_unsigned"]

_U64 = 1 << 64
_modules: dict[str, ModuleType] = {}
_import_seconds: dict[str, float] = {}
_scratch: dict[tuple[int, int], torch.Tensor] = {}


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
        t0 = time.perf_counter()
        from . import cpu as mod

        _import_seconds["numba_import_cpu"] = time.perf_counter() - t0
        _modules["cpu"] = mod
    return mod


def _gpu() -> ModuleType:
    mod = _modules.get("gpu")
    if mod is None:
        t0 = time.perf_counter()
        try:
            from . import gpu as mod
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "cuda_hooks needs numba's CUDA target for CUDA tensors "
                f"(import failed: {exc}); with a numba that no longer bundles it, pip install numba-cuda"
            ) from exc
        _import_seconds["numba_import_cuda"] = time.perf_counter() - t0
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
    if v.device != device:
        raise ValueError(f"{name} is on {v.device} but the tensor is on {device}")
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


def _on_device(t: torch.Tensor) -> tuple[Any, ModuleType, int]:
    """(context selecting t's device for torch and numba, gpu module, current stream handle)."""
    gpu = _gpu()
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    handle = torch.cuda.current_stream(idx).cuda_stream
    if idx == torch.cuda.current_device():
        return nullcontext(), gpu, handle
    return _device_scope(gpu, idx), gpu, handle


@contextmanager
def _device_scope(gpu: ModuleType, idx: int) -> Iterator[None]:
    """Make device ``idx`` current for torch and numba (tensor not on the current device)."""
    with torch.cuda.device(idx), gpu.cuda.gpus[idx]:
        yield


def _scratch_for(device: torch.device, handle: int) -> torch.Tensor:
    """Per-(device, stream) 2-word accumulator; the kernel leaves it zeroed."""
    key = (device.index or 0, handle)
    s = _scratch.get(key)
    if s is None:
        s = _scratch[key] = torch.zeros(2, dtype=torch.int64, device=device)  # memset on this stream
    return s


def _as_numba(gpu: ModuleType, t: torch.Tensor, dtype: Any = None) -> Any:
    arr = gpu.cuda.as_cuda_array(t, sync=False)
    return arr if dtype is None else arr.view(dtype)


# --------------------------------------------------------------------------- public API


def checksum(t: torch.Tensor) -> int:
    """Hash of ``t``'s raw bytes as an int in [0, 2**64), computed now.

    For a CUDA tensor this launches the device kernel and then reads the result,
    which synchronises; use :func:`checksum_into` on hot paths.
    """
    raw = _raw_bytes(t)
    if raw.device.type == "cpu":
        return _cpu().hash_bytes(raw.numpy())
    out = torch.zeros(1, dtype=torch.int64, device=raw.device)
    checksum_into(t, out, 0)
    return to_unsigned(int(out.item()))


def _enqueue_hash(raw: torch.Tensor, launch: Any) -> None:
    """The CUDA prologue of the hashing calls: on ``raw``'s device, hand ``launch(gpu, data,
    scratch, stream)`` the bytes and this stream's scratch as numba arrays, and torch's current
    stream."""
    ctx, gpu, handle = _on_device(raw)
    with ctx:
        launch(gpu, _as_numba(gpu, raw), _as_numba(gpu, _scratch_for(raw.device, handle), np.uint64),
               gpu.stream_for(handle))


def checksum_into(t: torch.Tensor, out: torch.Tensor, slot: int) -> None:
    """``out[slot] = hash(t)`` (int64 bit pattern), same device as ``t``.

    CUDA: enqueued on torch's current stream, no host synchronisation.
    CPU: computed now.
    """
    raw = _raw_bytes(t)
    slot = _slot_tensor(out, "out", torch.int64, raw.device, slot)
    if raw.device.type == "cpu":
        out[slot] = to_signed(_cpu().hash_bytes(raw.numpy()))
        return
    _enqueue_hash(raw, lambda gpu, data, scratch, stream: gpu.checksum_async(
        data, scratch, _as_numba(gpu, out, np.uint64), slot, stream))


def verify_into(t: torch.Tensor, expected: torch.Tensor, slot: int, flags: torch.Tensor) -> None:
    """Set ``flags[slot] = 1`` if ``hash(t) != expected[slot]``; a match leaves it as is.

    CUDA: compared on the device on torch's current stream, no host
    synchronisation.  CPU: compared now.
    """
    raw = _raw_bytes(t)
    slot = _slot_tensor(expected, "expected", torch.int64, raw.device, slot)
    _slot_tensor(flags, "flags", torch.int32, raw.device, slot)
    if raw.device.type == "cpu":
        if to_signed(_cpu().hash_bytes(raw.numpy())) != int(expected[slot]):
            flags[slot] = 1
        return
    _enqueue_hash(raw, lambda gpu, data, scratch, stream: gpu.verify_async(
        data, scratch, _as_numba(gpu, expected, np.uint64), slot, _as_numba(gpu, flags), stream))


def poison(t: torch.Tensor, byte: int) -> None:
    """Fill ``t``'s bytes with ``byte`` (0..255) in place, on its own storage.

    CPU: ``numpy.fill`` (a memset), measured faster than torch's ``fill_``
    and than a numba prange fill on the 2-core dev machine (see
    ``bench/checksum.py``), followed by an empty in-place torch op so ``t``'s
    version counter moves as for any in-place write (autograd then refuses
    to use a poisoned saved tensor).  CUDA: torch's ``fill_`` on a uint8 view,
    a vectorised fill enqueued on the current stream with no JIT compile and
    less launch overhead than the numba kernel (``gpu.poison_async``, kept for
    raw numba device arrays).
    """
    if isinstance(byte, bool) or not isinstance(byte, int) or not 0 <= byte <= 255:
        raise ValueError(f"byte must be an int in 0..255, got {byte!r}")
    raw = _raw_bytes(t)
    if raw.device.type == "cpu":
        raw.numpy().fill(byte)
        raw[:0].fill_(byte)  # version-counter bump only
    else:
        raw.fill_(byte)


def compile_seconds() -> dict[str, float]:
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
