"""CUDA kernels: checksum, verify and poison fill (numba.cuda).

Why: checksumming a borrowed CUDA tensor must not stall the host, so every
kernel writes its result into device memory (a hash slot, a mismatch flag)
on the caller's stream and nothing here synchronises.

The hash is one pass: each thread sums ``mix`` over a grid-stride set of
words (four words in flight per iteration to cover DRAM latency), blocks
reduce in shared memory and add their partial atomically into a 2-word
scratch ``[sum, blocks_done]``; the last block to finish (ticket counter,
``threadfence`` before it) takes the total, finalises it, writes the
result and resets the scratch to zero.  The scratch is therefore reusable by
the next launch on the same stream (and under CUDA graph replay) with no
memset in between.

Every word is read with aligned 8-byte loads, whatever the tensor's address:
the host splits the bytes into an unaligned head (``head`` bytes, 0..7), an
8-byte aligned interior (``words``) and a tail.  When ``head`` is 0 hash word
``i`` *is* ``words[i]``; otherwise it straddles two interior words and is
``(words[i-1] >> (64 - 8*head)) | (words[i] << 8*head)`` (the neighbour's load
hits the cache the neighbouring thread just filled).  Only the first word (the
head bytes) and the last one or two (the tail) are assembled from bytes.

Importing this module imports numba; ``cuda_hooks.bridge`` imports it lazily.
Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in numba's simulator.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, Iterator

import numpy as np
from numba import config, cuda, int32, int64, uint8, uint64

from . import hashdef
from .cachedir import kernel_cache
from .errors import KernelsUnavailable

__all__ = [
    "THREADS",
    "SIMULATED",
    "KERNEL_SIGNATURES",
    "KernelsUnavailable",
    "as_array",
    "stream_for",
    "device_scope",
    "warm",
    "kernel_info",
    "checksum_async",
    "verify_async",
    "poison_async",
    "compile_seconds",
]

#: True when numba's CUDA simulator is active (no external streams there).
SIMULATED: bool = bool(config.ENABLE_CUDASIM)
#: Threads per block (a power of two; the shared-memory reduction is sized to
#: it).  The simulator runs each thread as a Python thread, so it gets 64.
THREADS = 64 if SIMULATED else 256
#: ``"Built-in"`` (numba's own CUDA target) or ``"NVIDIA"`` (the numba-cuda package).
IMPLEMENTATION: str = getattr(cuda, "implementation", "unknown")

_mix = cuda.jit(device=True, inline=True)(hashdef.mix)
_position_key = cuda.jit(device=True, inline=True)(hashdef.position_key)
_tail_word = cuda.jit(device=True, inline=True)(hashdef.tail_word)
_finalize = cuda.jit(device=True, inline=True)(hashdef.finalize)

_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_TWO = np.uint64(2)
_THREE = np.uint64(3)
_FOUR = np.uint64(4)
_SEVEN = np.uint64(7)
_EIGHT = np.uint64(8)
_SIXTY_FOUR = np.uint64(64)


@cuda.jit(device=True, inline=True)
def _byte_word(data, i, nbytes):
    """Hash word ``i`` assembled from bytes (the head word and the tail words only)."""
    start = i * _EIGHT
    stop = start + _EIGHT
    if stop > nbytes:  # not min(): numba's vararg min() overload fails to compile for CUDA
        stop = nbytes
    return _tail_word(data, start, stop)


@cuda.jit(device=True)
def _grid_hash(words, data, head, scratch):
    """Whole-grid hash of ``data``; returns ``(True, hash)`` in exactly one thread, else ``(False, 0)``.

    ``words`` is the 8-byte aligned interior ``data[head : head + 8 * words.size]``.
    Indices are uint64 throughout: a signed index makes numba add
    negative-index wraparound code to every load, and each integer op counts
    (at HBM speed the mix alone uses a large share of the SMs' integer rate).
    """
    nb = np.uint64(data.size)
    nwords = (nb + _SEVEN) // _EIGHT
    m = np.uint64(words.size)
    h = np.uint64(head)
    stride = np.uint64(cuda.gridsize(1))
    i = np.uint64(cuda.grid(1))
    key = _position_key(i)
    kstride = _position_key(stride)  # keys step by addition, not a multiply per word
    s = _ZERO
    if h == _ZERO:  # aligned: hash word i is interior word i
        while i + _THREE * stride < m:
            k1 = key + kstride
            k2 = k1 + kstride
            k3 = k2 + kstride
            s += (_mix(words[i], key) + _mix(words[i + stride], k1)
                  + _mix(words[i + _TWO * stride], k2) + _mix(words[i + _THREE * stride], k3))
            i += _FOUR * stride
            key = k3 + kstride
        while i < m:
            s += _mix(words[i], key)
            i += stride
            key += kstride
    else:  # word i straddles interior words i-1 and i
        if i == _ZERO:  # word 0 holds the head bytes
            s += _mix(_byte_word(data, i, nb), key)
            i += stride
            key += kstride
        left = h * _EIGHT
        right = _SIXTY_FOUR - left  # 8..56: never a shift by 64
        while i + _THREE * stride < m:
            i1 = i + stride
            i2 = i1 + stride
            i3 = i2 + stride
            k1 = key + kstride
            k2 = k1 + kstride
            k3 = k2 + kstride
            s += (_mix((words[i - _ONE] >> right) | (words[i] << left), key)
                  + _mix((words[i1 - _ONE] >> right) | (words[i1] << left), k1)
                  + _mix((words[i2 - _ONE] >> right) | (words[i2] << left), k2)
                  + _mix((words[i3 - _ONE] >> right) | (words[i3] << left), k3))
            i = i3 + stride
            key = k3 + kstride
        while i < m:
            s += _mix((words[i - _ONE] >> right) | (words[i] << left), key)
            i += stride
            key += kstride
    while i < nwords:  # the tail: the last partial word, and the words past the interior
        s += _mix(_byte_word(data, i, nb), key)
        i += stride
        key += kstride

    partial = cuda.shared.array(THREADS, uint64)
    t = cuda.threadIdx.x
    partial[t] = s
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if t < step:
            partial[t] += partial[t + step]
        cuda.syncthreads()
        step //= 2

    if t == 0:
        cuda.atomic.add(scratch, 0, partial[0])
        cuda.threadfence()
        ticket = cuda.atomic.add(scratch, 1, _ONE)
        if ticket == np.uint64(cuda.gridDim.x - 1):
            total = cuda.atomic.exch(scratch, 0, _ZERO)
            cuda.atomic.exch(scratch, 1, _ZERO)
            return True, _finalize(total, nb)
    return False, _ZERO


def _build(defn: str) -> Tuple[Any, Any, Any]:
    """Create the kernels; closing over ``defn`` keys numba's cache to hashdef.py."""

    @cuda.jit(cache=True)
    def checksum_kernel(words, data, head, scratch, out, slot):
        defn  # noqa: B018  (cache key only, see hashdef.definition_digest)
        done, h = _grid_hash(words, data, head, scratch)
        if done:
            out[slot] = h

    @cuda.jit(cache=True)
    def verify_kernel(words, data, head, scratch, expected, slot, flags):
        defn  # noqa: B018
        done, h = _grid_hash(words, data, head, scratch)
        if done and h != expected[slot]:
            flags[slot] = 1

    @cuda.jit(cache=True)
    def poison_kernel(data, value):
        i = cuda.grid(1)
        stride = cuda.gridsize(1)
        while i < data.size:
            data[i] = value
            i += stride

    return checksum_kernel, verify_kernel, poison_kernel


with kernel_cache():  # the on-disk cache goes to the user cache directory, not next to this file
    _checksum_kernel, _verify_kernel, _poison_kernel = _build(hashdef.definition_digest())

_U64 = uint64[::1]
#: ``name -> (python function, argument types)``, for ahead-of-time compiles and PTX checks.
KERNEL_SIGNATURES: Dict[str, Tuple[Any, Tuple[Any, ...]]] = {
    "checksum": (_checksum_kernel.py_func, (_U64, uint8[::1], int64, _U64, _U64, int64)),
    "verify": (_verify_kernel.py_func, (_U64, uint8[::1], int64, _U64, _U64, int64, int32[::1])),
    "poison": (_poison_kernel.py_func, (uint8[::1], uint8)),
}

_compile_seconds: dict[str, float] = {}
_streams: Dict[tuple, Any] = {}
_max_blocks: dict[int, int] = {}


def as_array(t: Any, dtype: Any = None) -> Any:
    """A numba device array over a contiguous tensor's memory (no copy, no synchronisation).

    In the simulator the "device" memory is a CPU tensor's, wrapped in place.
    """
    if SIMULATED:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        arr = FakeCUDAArray(t.numpy())
    else:
        arr = cuda.as_cuda_array(t, sync=False)
    return arr if dtype is None else arr.view(dtype)


def stream_for(handle: int, device: int = 0) -> Any:
    """numba stream wrapping an external ``cudaStream_t`` (torch's current stream) of ``device``.

    The simulator has no external streams, so there it is 0 (the default stream).
    """
    if SIMULATED:
        return 0
    stream = _streams.get((device, handle))
    if stream is None:
        stream = _streams[(device, handle)] = cuda.external_stream(handle)
    return stream


@contextlib.contextmanager
def device_scope(index: int) -> Iterator[None]:
    """Make device ``index`` numba's current device (torch's is set by the caller)."""
    if SIMULATED:
        yield
        return
    with cuda.gpus[index]:
        yield


def warm() -> None:
    """Nothing yet: each kernel compiles (or loads from the disk cache) at its first launch."""


def _grid(nitems: int, per_thread: int = 1) -> int:
    """Blocks to launch: enough for the work, capped at ~2048 resident threads per SM."""
    if SIMULATED:
        cap = 2  # the simulator runs every thread as a Python thread
    else:
        dev = cuda.get_current_device()
        cap = _max_blocks.get(dev.id)
        if cap is None:
            cap = _max_blocks[dev.id] = dev.MULTIPROCESSOR_COUNT * (2048 // THREADS)
    need = -(-nitems // (THREADS * per_thread))
    return max(1, min(need, cap))


def _address(arr: Any) -> int:
    """Device address of an array's first element (host address in the simulator)."""
    if SIMULATED:
        return int(arr.ctypes.data)  # the simulator's arrays delegate to numpy
    return int(arr.__cuda_array_interface__["data"][0])


def _split(data: Any) -> tuple:
    """``(words, head)``: the 8-byte aligned interior of ``data`` as uint64 and the bytes before it."""
    nbytes = data.size
    head = min((-_address(data)) % 8, nbytes)
    nwords = (nbytes - head) // 8
    return data[head: head + 8 * nwords].view(np.uint64), head


_TOOLKIT_HINT = (
    "numba could not compile or load the cuda_hooks kernels: it needs the CUDA driver and libNVVM "
    "from a CUDA toolkit. Point CUDA_HOME at the toolkit root (the folder holding nvvm/), or put "
    "libnvvm.so on the loader path, or install numba-cuda with a CUDA extra."
)


def _launch(name: str, kernel: Any, blocks: int, stream: Any, *args: Any) -> None:
    """Launch; the first call of each kernel (its compile or cache load) is timed."""
    if name in _compile_seconds:
        kernel[blocks, THREADS, stream](*args)
        return
    t0 = time.perf_counter()
    try:
        kernel[blocks, THREADS, stream](*args)
    except ImportError as exc:  # numba's CudaSupportError and NvvmSupportError subclass it
        raise KernelsUnavailable(f"{_TOOLKIT_HINT} ({type(exc).__name__}: {exc})") from exc
    _compile_seconds[name] = time.perf_counter() - t0


def _launch_hash(name: str, kernel: Any, data: Any, scratch: Any, blocks: int | None, stream: Any,
                 *rest: Any) -> None:
    """The hashing kernels' shared prologue: size the grid (unless ``blocks`` is given), split the
    bytes into head and aligned interior, and launch ``kernel(words, data, head, scratch, *rest)``."""
    words, head = _split(data)
    blocks = blocks or _grid((data.size + 7) // 8, 4)
    _launch(name, kernel, blocks, stream, words, data, head, scratch, *rest)


def checksum_async(
    data: Any, scratch: Any, out: Any, slot: int, stream: Any, blocks: int | None = None, device: int = 0
) -> None:
    """Enqueue ``out[slot] = hash(data)`` on ``stream``.

    ``data``: contiguous 1-D uint8 device array; ``scratch``: 2-element uint64
    device array, zero before the first use and left zero after each launch
    (one per stream); ``out``: uint64 device array.  ``blocks`` overrides the
    grid size (tests use it to reach every code path on small inputs).
    """
    _launch_hash("cuda_checksum", _checksum_kernel, data, scratch, blocks, stream, out, slot)


def verify_async(
    data: Any, scratch: Any, expected: Any, slot: int, flags: Any, stream: Any, blocks: int | None = None,
    device: int = 0
) -> None:
    """Enqueue ``if hash(data) != expected[slot]: flags[slot] = 1`` on ``stream``.

    ``flags`` is an int32 device array; a match leaves the flag unchanged, so a
    flag once raised stays raised until the caller clears it.
    """
    _launch_hash("cuda_verify", _verify_kernel, data, scratch, blocks, stream, expected, slot, flags)


def poison_async(data: Any, byte: int, stream: Any, device: int = 0) -> None:
    """Enqueue ``data[:] = byte`` (uint8 device array) on ``stream``."""
    _launch("cuda_poison", _poison_kernel, _grid(data.size, 4), stream, data, np.uint8(byte))


def compile_seconds() -> dict[str, float]:
    """First-launch (compile or cache load) seconds per CUDA kernel launched so far."""
    return dict(_compile_seconds)


def kernel_info() -> Dict[str, Any]:
    """numba's CUDA implementation and the first-launch seconds so far."""
    return {"implementation": IMPLEMENTATION, "simulated": SIMULATED, "threads": THREADS,
            "compile_seconds": compile_seconds()}
