"""How cuda_hooks.gpu launches its kernels: grid size, launch configurations, numba's warnings.

No GPU: numba's CUDA dispatchers are replaced by stubs that behave as numba's do
where it matters here (``kernel[blocks, threads, stream]`` builds a launch
configuration, and numba warns while building one with fewer than 128 blocks;
``compile(sig)`` returns a kernel that answers the occupancy query). The data are
host arrays exposing ``__cuda_array_interface__``, as a device array does.
The first four tests reproduced defects of issue 21 (committed as strict xfails before their fix).
"""
from __future__ import annotations

import os
import types
import warnings

import numpy as np
import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM"):
    pytest.skip("these tests stub numba's real CUDA dispatchers, not the simulator's", allow_module_level=True)
gpu = pytest.importorskip("cuda_hooks.gpu", reason="numba's CUDA target is not importable here")

try:  # numba-cuda warns with its own class, numba's built-in CUDA target with numba.core's
    from numba.cuda.core.errors import NumbaPerformanceWarning
except ImportError:
    from numba.core.errors import NumbaPerformanceWarning

SMS = 132  # an H100/H200
RESIDENT = 6  # blocks of 256 threads per SM that the occupancy query allows (39 registers per thread)
LOW_OCCUPANCY = "Grid size {} will likely result in GPU under-utilization due to low occupancy."


class DeviceLike(np.ndarray):
    """A host array with the CUDA array interface (what the launch code reads of a device array)."""

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ctypes.data, False), "version": 2}


def _device_bytes(n: int, offset: int = 0) -> DeviceLike:
    base = np.zeros(n + offset + 8, dtype=np.uint8)
    start = (-base.ctypes.data) % 8 + offset
    return base[start:start + n].view(DeviceLike)


class StubKernel:
    regs_per_thread = 39

    def max_cooperative_grid_blocks(self, threads: int) -> int:
        assert threads == gpu.THREADS
        return RESIDENT * SMS


class StubDispatcher:
    """numba's CUDA dispatcher as the launch code uses it."""

    def __init__(self) -> None:
        self.configured = 0
        self.launches: list = []

    def compile(self, sig: tuple) -> StubKernel:
        return StubKernel()

    def __getitem__(self, config: tuple):
        blocks, threads, stream = config
        self.configured += 1
        if blocks < 128:  # what numba's _LaunchConfiguration.__init__ does
            warnings.warn(NumbaPerformanceWarning(LOW_OCCUPANCY.format(blocks)))
        return lambda *args: self.call(args, (blocks, 1, 1), (threads, 1, 1), stream, 0)

    def call(self, args: tuple, griddim: tuple, blockdim: tuple, stream: object, sharedmem: int) -> None:
        """What numba's launch configuration calls (in the built-in target and in numba-cuda alike)."""
        assert len(griddim) == len(blockdim) == 3 and sharedmem == 0
        self.launches.append((griddim[0], blockdim[0], stream, args))


@pytest.fixture
def stubs(monkeypatch):
    dispatchers = {name: StubDispatcher() for name in ("checksum", "verify", "poison")}
    for name, stub in dispatchers.items():
        monkeypatch.setattr(gpu, f"_{name}_kernel", stub)
        if hasattr(gpu, "_DISPATCHERS"):
            monkeypatch.setitem(gpu._DISPATCHERS, name, stub)
    device = types.SimpleNamespace(id=0, MULTIPROCESSOR_COUNT=SMS, compute_capability=(9, 0))
    monkeypatch.setattr(gpu.cuda, "get_current_device", lambda: device)
    for table in ("_caps", "_launchers", "_max_blocks", "_compile_seconds"):
        if hasattr(gpu, table):
            monkeypatch.setattr(gpu, table, type(getattr(gpu, table))())
    if hasattr(gpu, "_warm_devices"):
        monkeypatch.setattr(gpu, "_warm_devices", set())
    return dispatchers


def _hash(n: int, offset: int = 0, stream: object = "s0") -> None:
    scratch = np.zeros(2, np.uint64).view(DeviceLike)
    out = np.zeros(1, np.uint64).view(DeviceLike)
    gpu.checksum_async(_device_bytes(n, offset), scratch, out, 0, stream)


def test_small_launches_do_not_warn_even_when_warnings_are_errors(stubs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _hash(4096)  # one block is all a 4 KiB tensor needs
        _hash(100)
        # the silencing is narrow: the same warning from anyone else's launch is still an error
        with pytest.raises(NumbaPerformanceWarning):
            warnings.warn(NumbaPerformanceWarning(LOW_OCCUPANCY.format(1)))


def test_the_grid_follows_the_occupancy_query_not_a_full_occupancy_guess(stubs):
    _hash(1 << 30)
    blocks = stubs["checksum"].launches[-1][0]
    assert blocks == RESIDENT * SMS  # 6 of 256 threads per SM fit at 39 registers, not 2048 // 256 = 8


def test_launch_configurations_are_built_once_and_grids_are_few(stubs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in range(1000, 400_000, 3000):  # 133 sizes of small tensors
            _hash(n)
    assert len(stubs["checksum"].launches) == 133
    assert len(gpu._launchers) <= 8  # powers of two up to the 98 blocks of the largest
    assert len({launch[0] for launch in stubs["checksum"].launches}) <= 8


def test_launching_never_touches_the_process_warning_filters(stubs):
    """Issue 31, defect 6: the launch path swapped the process's warning filters (catch_warnings), which
    is not thread-safe: a filter another thread adds meanwhile is lost at the restore. No launch may
    read or replace ``warnings.filters`` (a list kept by identity and content here)."""
    before = warnings.filters
    snapshot = list(before)

    class Watched(list):
        touched = False

        def __iter__(self):  # catch_warnings copies the list on entry, filterwarnings inserts into it
            Watched.touched = True
            return super().__iter__()

        def insert(self, *a):
            Watched.touched = True
            return super().insert(*a)

    watched = Watched(snapshot)
    warnings.filters = watched
    try:
        for n in (100, 4096, 1 << 20):
            _hash(n)
            _hash(n, stream="s1")
        touched = Watched.touched  # (read first: the comparison below iterates the list itself)
        assert warnings.filters is watched and list(watched) == snapshot and not touched
    finally:
        warnings.filters = before
    assert len(stubs["checksum"].launches) == 6 and stubs["checksum"].configured == 0


def test_device_helpers_are_force_inlined_in_the_spelling_each_numba_takes():
    """numba's built-in CUDA target: ``inline=True``; numba-cuda: ``forceinline=True`` (its ``inline`` is
    Numba-IR inlining, and a bool there is deprecated)."""
    def builtin_jit(func_or_sig=None, device=False, inline=False, link=None, debug=None, **kws):
        pass

    def numba_cuda_jit(func_or_sig=None, device=False, inline="never", forceinline=False, link=(), **kws):
        pass

    assert gpu.force_inline(builtin_jit) == {"inline": True}
    assert gpu.force_inline(numba_cuda_jit) == {"forceinline": True}
    assert gpu.force_inline(gpu.cuda.jit) == gpu._INLINE


def test_misaligned_bytes_are_hashed_from_aligned_interior_words(stubs):
    for offset in range(8):
        _hash(1000, offset)
        words, data, head = stubs["checksum"].launches[-1][3][:3]
        assert head == (8 - offset) % 8 and words.ctypes.data % 8 == 0
        assert words.ctypes.data == data.ctypes.data + head and words.size == (1000 - head) // 8


# -- the rest of the real-device plumbing, with numba's CUDA driver calls stubbed --------------------------------
def test_a_kernel_that_cannot_be_built_says_what_to_install(stubs, monkeypatch):
    def broken(sig):
        raise OSError("libnvvm.so: cannot open shared object file")

    monkeypatch.setattr(stubs["verify"], "compile", broken)
    with pytest.raises(gpu.KernelsUnavailable, match=r"libnvvm.*OSError"):
        gpu.warm()
    assert 0 not in gpu._warm_devices  # not marked warm: the next call tries (and says) again


def test_warm_reports_registers_blocks_and_first_use_seconds(stubs):
    gpu.warm()
    gpu.warm()  # once per device
    info = gpu.kernel_info()
    assert info["registers"] == {"checksum": 39, "verify": 39, "poison": 39}
    assert info["resident_blocks"] == {f"{k}@0": RESIDENT * SMS for k in ("checksum", "verify", "poison")}
    assert set(info["compile_seconds"]) == {"cuda_checksum", "cuda_verify", "cuda_poison"}
    assert not info["simulated"] and "nvvm" in info  # a version, or why there is none


def test_external_streams_device_scopes_and_arrays_go_through_numba_once(stubs, monkeypatch):
    made, scopes, converted = [], [], []

    class Scope:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            scopes.append(self.index)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(gpu.cuda, "external_stream", lambda handle: made.append(handle) or f"stream{handle}")
    monkeypatch.setattr(gpu.cuda, "gpus", {0: Scope(0), 1: Scope(1)})
    monkeypatch.setattr(gpu.cuda, "as_cuda_array", lambda t, sync: converted.append(sync) or t.numpy().view(DeviceLike))
    assert gpu.stream_for(7, 1) == gpu.stream_for(7, 1) == "stream7" and made == [7]  # wrapped once per stream
    with gpu.device_scope(1):
        pass
    assert scopes == [1]
    import torch

    arr = gpu.as_array(torch.arange(4, dtype=torch.int64), np.uint64)
    assert converted == [False] and arr.dtype == np.uint64  # no synchronisation: the caller orders the work


def test_launchers_are_bounded_and_a_forked_child_starts_with_none(stubs, monkeypatch):
    monkeypatch.setattr(gpu, "_MAX_LAUNCHERS", 4)
    for i in range(10):
        _hash(100, stream=f"s{i}")
    assert 1 <= len(gpu._launchers) <= 4 and len(stubs["checksum"].launches) == 10
    gpu.warm()
    gpu._after_fork_in_child()
    assert not gpu._launchers and not gpu._warm_devices


def test_force_inline_of_a_jit_without_a_signature_takes_the_built_in_spelling():
    assert gpu.force_inline(dict) == {"inline": True}  # (inspect.signature raises ValueError for it)
