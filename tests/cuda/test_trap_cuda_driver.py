"""Issue 48, trap mode on a real CUDA driver: the rules the driver documents, kept by the fake (each one a
test that the fake refuses what the driver refuses), and the trap paths that broke them: leases past the
first granule, graph capture, per-device graveyards, out of memory, peers, read-only refusal, hygiene."""
from __future__ import annotations

import ctypes
import gc
import math
import warnings

import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from sanitizer.core import pages
from sanitizer.torch_layer.ring import StagingRing

from tests.fake_cuda import fake_cuda as _fake_cuda_fixture

fake = _fake_cuda_fixture

pytestmark = pytest.mark.skipif(not pages.AVAILABLE, reason=str(pages.UNAVAILABLE_REASON))

FIRST = torch.arange(8, dtype=torch.float32)
NEXT = torch.full((8,), 7.0)


def _floats(ptr: int, n: int = 8) -> list:
    return list((ctypes.c_float * n).from_address(ptr))


def _vmm():
    from cuda_hooks import vmm

    return vmm


# -- the fake keeps the driver's rules ------------------------------------------------------------------------
def test_fake_cumemmap_refuses_a_non_zero_offset(fake):
    drv, g = fake.vmm, fake.vmm.granule
    h = drv.create(2 * g, 0)
    at = drv.reserve(g, g, 0)
    with pytest.raises(_vmm().VmmError, match="offset must be zero") as info:
        drv.map(at, g, h, g)
    assert info.value.code == _vmm().CUDA_ERROR_INVALID_VALUE
    drv.free(at, g)
    drv.release(h)


def test_fake_sizes_addresses_and_offsets_are_granule_multiples(fake):
    drv, g = fake.vmm, fake.vmm.granule
    with pytest.raises(_vmm().VmmError, match="granularity"):
        drv.create(g + pages.PAGE, 0)
    h = drv.create(g, 0)
    at = drv.reserve(2 * g, g, 0)
    with pytest.raises(_vmm().VmmError, match="granularity"):
        drv.map(at + pages.PAGE, g, h, 0)
    with pytest.raises(_vmm().VmmError, match="granularity"):
        drv.map(at, pages.PAGE, h, 0)
    with pytest.raises(_vmm().VmmError, match="out of range"):
        drv.map(at, 2 * g, h, 0)  # past the allocation's size
    drv.free(at, 2 * g)
    drv.release(h)


def test_fake_reserve_alignment_is_a_power_of_two_and_free_matches_the_reservation(fake):
    drv, g = fake.vmm, fake.vmm.granule
    with pytest.raises(_vmm().VmmError):
        drv.reserve(g, 3 * pages.PAGE, 0)
    with pytest.raises(_vmm().VmmError):
        drv.reserve(pages.PAGE + 1, g, 0)
    at = drv.reserve(2 * g, 0, 0)
    assert at % g == 0
    with pytest.raises(_vmm().VmmError, match="not a reservation of that size"):
        drv.free(at, g)
    h = drv.create(g, 0)
    drv.map(at, g, h, 0)
    with pytest.raises(_vmm().VmmError, match="still mapped"):
        drv.free(at, 2 * g)
    with pytest.raises(_vmm().VmmError, match="already mapped"):
        drv.map(at, g, h, 0)
    drv.unmap(at, g)
    drv.free(at, 2 * g)
    drv.release(h)


def test_fake_mappings_start_with_no_access_and_access_is_per_device_and_per_mapping(fake):
    drv, g = fake.vmm, fake.vmm.granule
    a, b = drv.create(g, 0), drv.create(g, 0)
    at = drv.reserve(2 * g, g, 0)
    drv.map(at, g, a, 0)
    assert drv.access_of(at, 0) == ""  # "calling cuMemMap does not make the address accessible"
    with pytest.raises(_vmm().VmmError, match="not a fully mapped range"):
        drv.set_access(at, 2 * g, [0], True)  # the second granule is not mapped yet
    drv.map(at + g, g, b, 0)
    drv.set_access(at, g, [0], True)
    assert (drv.access_of(at, 0), drv.access_of(at + g, 0), drv.access_of(at, 1)) == ("rw", "", "")
    drv.set_access(at, 2 * g, [0, 1], False)  # one call over two mappings, two devices
    assert (drv.access_of(at + g, 0), drv.access_of(at + g, 1)) == ("r", "r")
    drv.unmap(at, g)
    drv.map(at, g, a, 0)
    assert drv.access_of(at, 0) == ""  # "all mappings start with no accessibility setup"
    for x in (at, at + g):
        drv.unmap(x, g)
    drv.free(at, 2 * g)
    drv.release(a)
    drv.release(b)


def test_fake_unmap_takes_whole_mappings_only_and_never_under_queued_work(fake):
    drv, g = fake.vmm, fake.vmm.granule
    h = drv.create(2 * g, 0)
    at = drv.reserve(2 * g, g, 0)
    drv.map(at, 2 * g, h, 0)
    drv.set_access(at, 2 * g, [0], True)
    with pytest.raises(_vmm().VmmError, match="not a whole mapped range"):
        drv.unmap(at, g)
    region = fake.from_interface(_Region(at, 32), torch.device("cuda", 0))
    out = fake.alloc(32)
    stream = torch.cuda.current_stream()
    fake.pause(stream)
    out.copy_(region)  # still queued
    with pytest.raises(_vmm().ContextLost):
        drv.unmap(at, 2 * g)
    assert any("under queued work" in h for h in fake.hazards)
    fake.hazards.clear()
    fake.resume(stream)
    drv.unmap(at, 2 * g)
    drv.free(at, 2 * g)
    drv.release(h)


class _Region:
    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


def _one_granule(drv, writable: bool):
    """``(handle, address)``: one granule of device 0 created, reserved, mapped and given access."""
    g = drv.granule
    h = drv.create(g, 0)
    at = drv.reserve(g, g, 0)
    drv.map(at, g, h, 0)
    drv.set_access(at, g, [0], writable)
    return h, at


def test_fake_release_of_a_mapped_handle_keeps_the_memory_until_unmapped(fake):
    drv, g = fake.vmm, fake.vmm.granule
    h, at = _one_granule(drv, writable=True)
    ctypes.memset(at, 0x11, 16)
    drv.release(h)
    assert drv.physical_bytes(0) == g and ctypes.string_at(at, 16) == b"\x11" * 16
    with pytest.raises(_vmm().VmmError, match="not a live allocation"):
        drv.map(at, g, h, 0)  # the handle is gone, the memory is not
    drv.unmap(at, g)
    assert drv.physical_bytes(0) == 0
    drv.free(at, g)


def test_fake_read_only_mappings_and_a_device_that_refuses_them(fake):
    drv, g = fake.vmm, fake.vmm.granule
    h, at = _one_granule(drv, writable=False)
    assert drv.access_of(at, 0) == "r"
    drv.read_only_supported = False
    with pytest.raises(_vmm().VmmError) as info:
        drv.set_access(at, g, [0], False)
    assert info.value.code == _vmm().CUDA_ERROR_NOT_SUPPORTED
    drv.unmap(at, g)
    drv.free(at, g)
    drv.release(h)


def test_fake_cumemcreate_runs_out_of_memory(fake):
    drv, g = fake.vmm, fake.vmm.granule
    drv.capacity[0] = 3 * g
    drv.torch_cache[0] = 2 * g
    a = drv.create(g, 0)
    with pytest.raises(_vmm().OutOfMemory):
        drv.create(g, 0)
    torch.cuda.empty_cache()
    b = drv.create(2 * g, 0)
    drv.release(a)
    drv.release(b)


# -- 5: leases past the first granule ---------------------------------------------------------------------------
def test_a_ring_over_several_granules_lends_past_the_first_granule(fake):
    sanitizer.enable(trap="poison")
    g = fake.vmm.granule
    buf = StagingBuffer(5 * g, device="cuda", name="big")
    leases = {}
    for off in (2 * g + 64, 3 * g - 16, 4 * g):  # past 2 granules; across a boundary; at one
        leases[off] = buf.write(off, fake.tensor(FIRST), f"w{off}")
    fake.settle()
    for off, w in leases.items():
        assert _floats(w.data_ptr()) == FIRST.tolist()
    ptrs = {off: w.data_ptr() for off, w in leases.items()}
    buf.write(3 * g - 16, fake.tensor(NEXT), "next")
    fake.settle()
    assert all(math.isnan(x) for x in _floats(ptrs[3 * g - 16]))
    assert _floats(ptrs[4 * g]) == FIRST.tolist()
    assert fake.hazards == []


def test_a_ring_load_bigger_than_two_granules_is_bit_identical_with_trap(fake):
    g = fake.vmm.granule
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(g // 64 + 3 * i, 16, generator=gen) for i in range(10)]  # ~1 granule each

    def load(mode: str) -> list:
        sanitizer.enable(trap=mode)
        out = []
        with StagingRing(3 * g + g // 2, device="cuda", name="r") as ring:
            for i, t in enumerate(weights):
                view = ring.put(f"w{i}", fake.tensor(t))
                kept = fake.alloc(view.numel() * 4).view(torch.float32).view(view.shape)
                kept.copy_(view)
                out.append(kept)
        fake.settle()
        result = [t.clone() for t in out]
        sanitizer.disable()
        return result

    plain, trapped = load("0"), load("poison")
    assert all(torch.equal(a, b) for a, b in zip(plain, trapped))
    assert sanitizer.errors() == [] and fake.hazards == []


# -- 6: graph capture -----------------------------------------------------------------------------------------
def test_a_reuse_during_a_graph_capture_defers_the_trap_and_keeps_the_capture(fake):
    from sanitizer.torch_layer import trap_cuda

    sanitizer.enable(trap="poison")
    g = fake.vmm.granule
    buf = StagingBuffer(4 * g, device="cuda")
    w = buf.write(2 * g, fake.tensor(FIRST), "w")
    ptr = w.data_ptr()
    fake.settle()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fake.capture():
            buf.reuse(2 * g, 32, by="captured")  # no synchronize, no unmap: the capture survives
            inside = buf.lend(0, (8,), torch.float32, "lent-in-capture")  # a plain view (no driver call)
            assert trap_cuda._DEFERRED and _floats(ptr) == FIRST.tolist()
    assert fake.hazards == []
    assert inside is not None
    assert trap_cuda.flush_deferred() == 1  # the first trap-mode call after the capture does it
    assert all(math.isnan(x) for x in _floats(ptr))
    with pytest.raises(StaleBorrowError):
        w + 1


def test_dead_aliases_in_a_capture_are_never_waited_for_from_del(fake):
    from sanitizer.torch_layer import trap_cuda

    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 18, device="cuda")
    views = [buf.lend(i * 64, (16,), torch.float32, f"v{i}") for i in range(trap_cuda.MAX_GRAVEYARD + 2)]
    with fake.capture():
        del views
        gc.collect()  # the windows die during the capture: buried, no device call
    assert fake.hazards == [] and len(trap_cuda.GRAVEYARD) >= trap_cuda.MAX_GRAVEYARD
    after = buf.lend(0, (16,), torch.float32, "after")  # outside: the full graveyard waits and goes
    assert len(trap_cuda.GRAVEYARD) == 0 and after is not None


# -- 7: per-device graveyard, out of memory, peers, read-only --------------------------------------------------
def test_a_wait_on_one_device_leaves_another_devices_dead_aliases_mapped(fake):
    from sanitizer.torch_layer import trap_cuda

    sanitizer.enable(trap="poison")
    fake.peer_access = False  # (so cuda:1's alias is reachable from cuda:1 only)
    buf1 = StagingBuffer(1 << 16, device="cuda:1")
    w1 = buf1.write(0, fake.tensor(FIRST, device=1), "w1")
    out = fake.alloc(32, device=1).view(torch.float32)
    fake.settle()
    s1 = torch.cuda.current_stream(1)
    fake.pause(s1)
    out.copy_(w1)  # a read of the alias, queued on cuda:1
    del w1
    gc.collect()  # the lease is dropped: its alias is buried, the read still queued
    buf0 = StagingBuffer(1 << 16, device="cuda:0")
    x = buf0.write(0, fake.tensor(FIRST), "x")
    buried = len(trap_cuda.GRAVEYARD)
    buf0.write(0, fake.tensor(NEXT), "y")  # a retire on cuda:0 traps x, waits for cuda:0 only
    assert buried >= 1 and len(trap_cuda.GRAVEYARD) >= 1 and fake.hazards == []
    assert all(math.isnan(v) for v in _floats(x.data_ptr()))
    fake.resume(s1)
    assert out.tolist() == FIRST.tolist()


def test_out_of_memory_empties_torchs_cache_and_retries_once(fake):
    from sanitizer.torch_layer import trap

    sanitizer.enable(trap="poison")
    g = fake.vmm.granule
    fake.vmm.capacity[0] = 8 * g
    fake.vmm.torch_cache[0] = 6 * g
    buf = StagingBuffer(5 * g, device="cuda")
    assert type(buf) is trap.TrapStagingBuffer and fake.vmm.empty_cache_calls == 1
    w = buf.write(3 * g, fake.tensor(FIRST), "w")
    assert buf._memory.window(sanitizer.lease_of(w)) is not None


def test_out_of_memory_after_the_retry_falls_back_to_the_guard_with_one_warning(fake, monkeypatch):
    from sanitizer.torch_layer import trap_memory

    monkeypatch.setattr(trap_memory, "_warned_keys", set())
    sanitizer.enable(trap="poison")
    g = fake.vmm.granule
    fake.vmm.capacity[0] = 2 * g
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = StagingBuffer(5 * g, device="cuda")
        StagingBuffer(5 * g, device="cuda")
    messages = [str(m.message) for m in caught if "out of memory" in str(m.message)]
    assert len(messages) == 1 and fake.vmm.empty_cache_calls == 2
    w = buf.write(3 * g, fake.tensor(FIRST), "w")
    buf.write(3 * g, fake.tensor(NEXT), "next")
    with pytest.raises(StaleBorrowError):
        w + 1
    assert fake.vmm.physical_bytes(0) == 0  # nothing kept from the failed tries


def test_a_peer_device_reads_a_lease_and_its_poison(fake):
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 16, device="cuda:0")
    w = buf.write(0, fake.tensor(FIRST), "w")
    out = fake.alloc(32, device=1).view(torch.float32)
    out.copy_(w)  # a copy on cuda:1 reads cuda:0's alias: peer access was granted
    fake.settle()
    assert out.tolist() == FIRST.tolist() and fake.hazards == []
    ptr = w.data_ptr()
    buf.write(0, fake.tensor(NEXT), "next")
    assert fake.vmm.access_of(ptr, 1) == "r" and fake.vmm.access_of(buf.tensor.data_ptr(), 1) == "rw"


def test_a_device_refusing_read_only_mappings_gets_read_write_poison(fake):
    from sanitizer.torch_layer import trap_cuda

    fake.vmm.read_only_supported = False
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 16, device="cuda")
    w = buf.write(0, fake.tensor(FIRST), "w")
    ptr = w.data_ptr()
    buf.write(0, fake.tensor(NEXT), "next")
    fake.settle()
    assert all(math.isnan(x) for x in _floats(ptr))  # never an alias left without access
    assert fake.vmm.access_of(ptr, 0) == "rw" and trap_cuda.POISON.read_only[0] is False


# -- 8: hygiene ------------------------------------------------------------------------------------------------
def test_a_failed_map_leaks_no_reservation_or_handle(fake):
    sanitizer.enable(trap="poison")
    g = fake.vmm.granule
    reserved, handles = len(fake.vmm._reserved), len(fake.vmm._handles)
    fake.vmm.fail_next("map", 1, after=2)  # the writer's third granule
    with pytest.raises(_vmm().VmmError):
        StagingBuffer(4 * g, device="cuda")
    gc.collect()
    assert (len(fake.vmm._reserved), len(fake.vmm._handles)) == (reserved, handles)
    buf = StagingBuffer(4 * g, device="cuda")
    reserved = len(fake.vmm._reserved)
    fake.vmm.fail_next("map", 1, after=1)  # a lease's second granule
    with pytest.raises(_vmm().VmmError):
        buf.lend(g - 16, (8,), torch.float32, "across")
    assert len(fake.vmm._reserved) == reserved and not fake.vmm._mappings_in(0, 1 << 62).keys() - _writer_maps(fake)
    w = buf.write(0, fake.tensor(FIRST), "w")
    fake.vmm.fail_next("set_access", 1)  # the poison granule's fill mapping
    handles = len(fake.vmm._handles)
    with pytest.raises(_vmm().VmmError):
        buf.write(0, fake.tensor(NEXT), "next")
    assert len(fake.vmm._handles) == handles  # the poison handle went back


def _writer_maps(fake) -> set:
    return set(fake.vmm._mapped)


def test_a_lost_context_is_raised_not_swallowed(fake):
    from sanitizer.torch_layer import trap_cuda

    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 16, device="cuda")
    views = [buf.lend(i * 64, (16,), torch.float32, f"v{i}") for i in range(3)]
    del views
    gc.collect()
    fake.vmm.fail_next("unmap", _vmm().CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(_vmm().ContextLost):
        trap_cuda.GRAVEYARD.collect()


class _Lib:
    """A stand-in ``libcuda``: ``cuInit`` fails ``init_failures`` times; device handles are not ordinals."""

    def __init__(self, init_failures: int = 0):
        self.init_failures, self.inits = init_failures, 0

    def cuInit(self, flags):
        self.inits += 1
        if self.inits <= self.init_failures:
            return 3  # CUDA_ERROR_NOT_INITIALIZED
        return 0

    def cuGetErrorName(self, rc, out):
        return 1

    def cuDeviceGet(self, out, ordinal):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 1000 + ordinal
        return 0

    def cuDeviceGetAttribute(self, out, attribute, dev):
        if dev != 1000:
            return 101  # CUDA_ERROR_INVALID_DEVICE: an ordinal was passed
        ctypes.cast(out, ctypes.POINTER(ctypes.c_int))[0] = 1
        return 0


def test_the_real_driver_loads_libcuda_so_1_first(monkeypatch):
    vmm = _vmm()
    tried = []

    def cdll(name, *a, **k):
        tried.append(name)
        raise OSError(f"{name}: not here")

    monkeypatch.setattr(vmm.ctypes, "CDLL", cdll)
    monkeypatch.setattr(vmm.ctypes.util, "find_library", lambda name: "libcuda.so")
    why = vmm.CudaDriver().unavailable(0)
    assert tried[0] == "libcuda.so.1" and "could not be loaded" in why


def test_the_real_driver_retries_a_failed_cuinit_and_uses_cudeviceget_handles(monkeypatch):
    vmm = _vmm()
    lib = _Lib(init_failures=1)
    monkeypatch.setattr(vmm, "_load_library", lambda: (lib, None))
    drv = vmm.CudaDriver()
    first = drv.unavailable(0)
    assert first is not None and "cuInit" in first
    assert drv.unavailable(0) is None and lib.inits == 2  # retried, and the handle 1000 was passed


def test_the_device_probe_skips_without_cuda_and_its_offset_probe_reads_the_fake(fake, monkeypatch, capsys):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "bench" / "device_trap.py"
    spec = importlib.util.spec_from_file_location("device_trap_probe", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._probe_offset(fake.vmm, fake.vmm.granule).startswith("refused")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.probe() == 2 and "PROBE skipped: no CUDA" in capsys.readouterr().out
