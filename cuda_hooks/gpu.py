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

Launch host cost is kept low: the kernels are compiled (or loaded from
numba's disk cache) once per device by :func:`warm`, which also asks the
driver how many blocks of :data:`THREADS` fit on the device at once (the
occupancy query, so the grid matches the kernel's real register use), and
each configured launch ``kernel[blocks, threads, stream]`` is built once
and reused (grid sizes are powers of two below that cap, so there are few).
A launch calls the dispatcher directly (:class:`_Launch`), not through numba's
configuration object, whose constructor emits a low-occupancy
``NumbaPerformanceWarning`` for small grids (small tensors need few blocks by
design): no warning is made, so none is silenced, and the process's warning
filters are never touched.

Importing this module imports numba; ``cuda_hooks.bridge`` imports it lazily.
Under ``NUMBA_ENABLE_CUDASIM=1`` the same kernels run in numba's simulator,
where :func:`as_array` wraps a CPU tensor's memory in place (the fake-device
test harness treats such memory as device memory).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
from typing import Any, Dict, Iterator, Tuple

import numpy as np
from numba import config, cuda, int32, int64, uint8, uint64

from . import hashdef
from .cachedir import kernel_cache
from .errors import KernelsUnavailable

__all__ = [
    "THREADS",
    "SIMULATED",
    "IMPLEMENTATION",
    "KERNEL_SIGNATURES",
    "KernelsUnavailable",
    "as_array",
    "stream_for",
    "device_scope",
    "warm",
    "grid_cap",
    "checksum_async",
    "verify_async",
    "poison_async",
    "compile_seconds",
    "kernel_info",
]

#: True when numba's CUDA simulator is active (no external streams there).
SIMULATED: bool = bool(config.ENABLE_CUDASIM)
#: Threads per block (a power of two; the shared-memory reduction is sized to
#: it).  The simulator runs each thread as a Python thread, so it gets 64.
THREADS = 64 if SIMULATED else 256
#: ``"Built-in"`` (numba's own CUDA target) or ``"NVIDIA"`` (the numba-cuda package).
IMPLEMENTATION: str = getattr(cuda, "implementation", "unknown")


def force_inline(jit: Any) -> Dict[str, Any]:
    """The keyword that inlines a device function at the NVVM IR level, in the spelling ``jit`` takes.

    numba's built-in CUDA target spells it ``inline=True``. The NVIDIA numba-cuda package renamed it
    ``forceinline=True`` and made ``inline`` a Numba-IR option (``"always"``/``"never"``), where a bool
    is deprecated and taken for ``"always"``: IR inlining, not the one these helpers were tuned with."""
    try:
        params = inspect.signature(jit).parameters
    except (TypeError, ValueError):  # a callable without a signature: the built-in spelling
        return {"inline": True}
    return {"forceinline": True} if "forceinline" in params else {"inline": True}


_INLINE = force_inline(cuda.jit)
_mix = cuda.jit(device=True, **_INLINE)(hashdef.mix)
_position_key = cuda.jit(device=True, **_INLINE)(hashdef.position_key)
_tail_word = cuda.jit(device=True, **_INLINE)(hashdef.tail_word)
_finalize = cuda.jit(device=True, **_INLINE)(hashdef.finalize)

_ZERO = np.uint64(0)
_ONE = np.uint64(1)
_TWO = np.uint64(2)
_THREE = np.uint64(3)
_FOUR = np.uint64(4)
_SEVEN = np.uint64(7)
_EIGHT = np.uint64(8)
_SIXTY_FOUR = np.uint64(64)


@cuda.jit(device=True, **_INLINE)
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
_DISPATCHERS = {"checksum": _checksum_kernel, "verify": _verify_kernel, "poison": _poison_kernel}

_TOOLKIT_HINT = (
    "numba could not compile or load the cuda_hooks kernels: it needs the CUDA driver and libNVVM "
    "from a CUDA toolkit. Point CUDA_HOME at the toolkit root (the folder holding nvvm/), or put "
    "libnvvm.so on the loader path, or install this package's CUDA extra "
    "(pip install 'ownership-sanitizer[cuda12]' or '[cuda13]', which pulls numba-cuda with its NVVM)."
)

_lock = threading.Lock()  # warm-up and the launch cache (launches themselves take no lock)
_compile_seconds: Dict[str, float] = {}
_registers: Dict[str, int] = {}
_caps: Dict[Tuple[str, int], int] = {}  # (kernel, device id) -> resident blocks of THREADS (occupancy)
_warm_devices: set = set()
_streams: Dict[Tuple[int, int], Any] = {}
_launchers: Dict[Tuple[str, int, int], Tuple[Any, Any]] = {}  # (kernel, blocks, id(stream)) -> (launcher, stream)
_MAX_LAUNCHERS = 4096



def _after_fork_in_child() -> None:
    """A fresh lock in a forked child (which cannot use its parent's CUDA context anyway)."""
    global _lock
    _lock = threading.Lock()
    _warm_devices.clear()
    _launchers.clear()
    _streams.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

class _Launch:
    """``kernel[blocks, THREADS, stream]``, without numba's launch-configuration object.

    That object's constructor is where numba warns about a grid of fewer than 128 blocks (a 4 KiB tensor
    needs one, by design); silencing it with ``warnings.catch_warnings()`` swaps the process's warning
    filters, which is not thread-safe (a filter a user's thread adds meanwhile is lost at the restore,
    and its own warnings are filtered meanwhile). The configuration object only calls the dispatcher's
    ``call(args, griddim, blockdim, stream, sharedmem)``, in numba's built-in target and in numba-cuda
    alike: that is called here, and no warning is made to silence."""

    __slots__ = ("_call", "_grid", "_block", "_stream")

    def __init__(self, dispatcher: Any, blocks: int, stream: Any):
        self._call = dispatcher.call
        self._grid, self._block, self._stream = (blocks, 1, 1), (THREADS, 1, 1), stream

    def __call__(self, *args: Any) -> Any:
        return self._call(args, self._grid, self._block, self._stream, 0)


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


def _device_id() -> int:
    return 0 if SIMULATED else int(cuda.get_current_device().id)


def warm() -> None:
    """Compile (or load from the disk cache) every kernel for the current device, load its module
    and query its occupancy, so that no later launch compiles, loads a module or sizes a grid.

    Raises :class:`KernelsUnavailable` (with what to install) when that fails.
    """
    dev = _device_id()
    if dev in _warm_devices:
        return
    with _lock:
        if dev in _warm_devices:
            return
        if not SIMULATED:
            for name, (_, sig) in KERNEL_SIGNATURES.items():
                t0 = time.perf_counter()
                try:
                    kernel = _DISPATCHERS[name].compile(sig)
                    cap = int(kernel.max_cooperative_grid_blocks(THREADS))  # loads the module: cuOccupancy*
                except Exception as exc:  # CudaSupportError, NvvmSupportError (ImportError), NvvmError, OSError...
                    raise KernelsUnavailable(f"{_TOOLKIT_HINT} ({type(exc).__name__}: {exc})") from exc
                _compile_seconds.setdefault(f"cuda_{name}", time.perf_counter() - t0)
                _registers[name] = int(getattr(kernel, "regs_per_thread", 0) or 0)
                _caps[(name, dev)] = max(1, cap)
        _warm_devices.add(dev)


def grid_cap(name: str, device: int) -> int:
    """Blocks of :data:`THREADS` of kernel ``name`` resident at once on ``device`` (the current one)."""
    if SIMULATED:
        return 2  # the simulator runs every thread as a Python thread
    cap = _caps.get((name, device))
    if cap is None:
        warm()
        cap = _caps[(name, _device_id())]
    return cap


def _grid(name: str, nitems: int, per_thread: int, device: int) -> int:
    """Blocks to launch: enough for the work (rounded up to a power of two), at most the resident cap."""
    need = -(-nitems // (THREADS * per_thread))
    cap = grid_cap(name, device)
    if need >= cap:
        return cap
    return 1 << max(0, need - 1).bit_length()  # 1, 2, 4, ...: few distinct launch configurations


def _launcher(name: str, blocks: int, stream: Any) -> Any:
    """``kernel[blocks, THREADS, stream]``, built once per grid size and stream."""
    key = (name, blocks, id(stream))
    hit = _launchers.get(key)
    if hit is not None:
        return hit[0]
    dispatcher = _DISPATCHERS[name]
    with _lock:
        # (the simulator's kernels never warn, and take only the indexing form)
        launcher = dispatcher[blocks, THREADS, stream] if SIMULATED else _Launch(dispatcher, blocks, stream)
        if len(_launchers) >= _MAX_LAUNCHERS:
            _launchers.clear()
        _launchers[key] = (launcher, stream)  # the stream is kept so that its id stays unique
    return launcher


def _launch(name: str, blocks: int, stream: Any, *args: Any) -> None:
    if SIMULATED and f"cuda_{name}" not in _compile_seconds:
        t0 = time.perf_counter()
        _launcher(name, blocks, stream)(*args)
        _compile_seconds[f"cuda_{name}"] = time.perf_counter() - t0
        return
    _launcher(name, blocks, stream)(*args)


def _address(arr: Any) -> int:
    """Device address of an array's first element (host address in the simulator)."""
    if SIMULATED:
        return int(arr.ctypes.data)  # the simulator's arrays delegate to numpy
    return int(arr.__cuda_array_interface__["data"][0])


def _split(data: Any) -> Tuple[Any, int]:
    """``(words, head)``: the 8-byte aligned interior of ``data`` as uint64 and the bytes before it."""
    nbytes = data.size
    head = min((-_address(data)) % 8, nbytes)
    nwords = (nbytes - head) // 8
    return data[head: head + 8 * nwords].view(np.uint64), head


def _launch_hash(name: str, data: Any, scratch: Any, blocks: Any, stream: Any, device: int, *rest: Any) -> None:
    """The hashing kernels' shared prologue: size the grid (unless ``blocks`` is given), split the
    bytes into head and aligned interior, and launch ``kernel(words, data, head, scratch, *rest)``."""
    words, head = _split(data)
    blocks = blocks or _grid(name, (data.size + 7) // 8, 4, device)
    _launch(name, blocks, stream, words, data, head, scratch, *rest)


def checksum_async(data: Any, scratch: Any, out: Any, slot: int, stream: Any, blocks: Any = None,
                   device: int = 0) -> None:
    """Enqueue ``out[slot] = hash(data)`` on ``stream``.

    ``data``: contiguous 1-D uint8 device array; ``scratch``: 2-element uint64
    device array, zero before the first use and left zero after each launch
    (one per stream); ``out``: uint64 device array.  ``blocks`` overrides the
    grid size (tests use it to reach every code path on small inputs);
    ``device`` is the current device's index (the caller made it current).
    """
    _launch_hash("checksum", data, scratch, blocks, stream, device, out, slot)


def verify_async(data: Any, scratch: Any, expected: Any, slot: int, flags: Any, stream: Any,
                 blocks: Any = None, device: int = 0) -> None:
    """Enqueue ``if hash(data) != expected[slot]: flags[slot] = 1`` on ``stream``.

    ``flags`` is an int32 device array; a match leaves the flag unchanged, so a
    flag once raised stays raised until the caller clears it.
    """
    _launch_hash("verify", data, scratch, blocks, stream, device, expected, slot, flags)


def poison_async(data: Any, byte: int, stream: Any, device: int = 0) -> None:
    """Enqueue ``data[:] = byte`` (uint8 device array) on ``stream``."""
    _launch("poison", _grid("poison", data.size, 4, device), stream, data, np.uint8(byte))


def compile_seconds() -> Dict[str, float]:
    """First-use (compile or disk-cache load, module load, occupancy query) seconds per CUDA kernel."""
    return dict(_compile_seconds)


def kernel_info() -> Dict[str, Any]:
    """What a device check prints: numba's CUDA implementation, the NVVM version, and per kernel its
    registers per thread and resident blocks (after :func:`warm`)."""
    info: Dict[str, Any] = {"implementation": IMPLEMENTATION, "simulated": SIMULATED, "threads": THREADS,
                            "registers": dict(_registers),
                            "resident_blocks": {f"{k}@{d}": v for (k, d), v in _caps.items()},
                            "compile_seconds": compile_seconds()}
    if not SIMULATED:
        try:
            from numba.cuda.cudadrv import nvvm

            info["nvvm"] = ".".join(map(str, nvvm.NVVM().get_version()))
        except Exception as exc:  # no libNVVM: say so, do not fail the caller
            info["nvvm"] = f"unavailable ({type(exc).__name__}: {exc})"
    return info
