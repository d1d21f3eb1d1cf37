"""trap=poison|fault on CUDA: each lease on a virtual alias of its own (the driver's virtual memory
management), retired in place; run on the fake device, whose VMM driver maps memfd pages with CUDA's
rules (granularity, whole ranges, no access until set). ``bench/device_check.sh`` runs the real one."""
from __future__ import annotations

import ctypes
import gc
import math
import textwrap
import warnings

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from sanitizer.core import pages
from sanitizer.torch_layer.ring import StagingRing

from tests.conftest import run_python
from tests.fake_cuda import FakeCuda
from tests.fake_cuda import fake_cuda as _fake_cuda_fixture

fake = _fake_cuda_fixture  # the harness's fixture (two fake devices, settled and reset after), short-named

pytestmark = pytest.mark.skipif(not pages.AVAILABLE, reason=str(pages.UNAVAILABLE_REASON))

FIRST = torch.arange(8, dtype=torch.float32)
NEXT = torch.full((8,), 7.0)


def _floats(ptr: int, n: int = 8) -> list:
    return list((ctypes.c_float * n).from_address(ptr))


def _aliases(w: torch.Tensor) -> dict:
    """Aliases made while the lease is fresh: a raw pointer (a C extension's), DLPack, and a
    ``__cuda_array_interface__`` consumer's (CuPy's) view of the same bytes."""
    class Iface:
        __cuda_array_interface__ = {"shape": (8,), "typestr": "<f4", "data": (w.data_ptr(), False), "version": 2}

    return {"ptr": w.data_ptr(), "from_dlpack": torch.from_dlpack(w),
            "cai": np.ctypeslib.as_array((ctypes.c_float * 8).from_address(Iface.__cuda_array_interface__["data"][0]))}


def test_every_alias_reads_poison_after_reuse_and_the_producer_is_untouched(fake):
    from sanitizer.torch_layer import trap

    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 20, device="cuda", name="ctrap")
    assert type(buf) is trap.TrapStagingBuffer
    w = buf.write(0, fake.tensor(FIRST), "w")
    a = _aliases(w)
    fake.settle()
    assert _floats(a["ptr"]) == FIRST.tolist() and a["cai"].tolist() == FIRST.tolist()
    nxt = buf.write(0, fake.tensor(NEXT), "next")
    fake.settle()
    assert nxt.tolist() == NEXT.tolist()  # the loader writes through its own range, untouched
    assert all(math.isnan(x) for x in _floats(a["ptr"]))  # a raw pointer reads poison, not the next tensor
    assert all(math.isnan(x) for x in a["cai"].tolist())
    with pytest.raises(StaleBorrowError, match="'w'"):  # a torch alias the mode sees: looked up by address
        a["from_dlpack"] + 1
    with pytest.raises(StaleBorrowError, match="'w'"):
        w + 1
    assert trap.stats()["trapped"] >= 1


def test_a_lease_across_a_granule_boundary_and_leases_sharing_one(fake):
    sanitizer.enable(trap="poison")
    g = fake.vmm.granule
    buf = StagingBuffer(4 * g, device="cuda")
    near_end = g - 16  # 32 bytes: 16 in the first granule, 16 in the second
    a = buf.write(near_end, fake.tensor(FIRST), "a")
    b = buf.write(near_end - 64, fake.tensor(NEXT), "b")  # shares the first granule with a
    fake.settle()
    assert a.data_ptr() != b.data_ptr() and abs(a.data_ptr() - b.data_ptr()) != 64  # an alias each
    assert _floats(a.data_ptr()) == FIRST.tolist() and _floats(b.data_ptr()) == NEXT.tolist()
    assert buf._memory.window(sanitizer.lease_of(a)).length == 2 * g
    buf.reuse(near_end, 32, by="c")  # retires a only: b's alias of the same granule stays fresh
    fake.settle()
    assert all(math.isnan(x) for x in _floats(a.data_ptr()))
    assert _floats(b.data_ptr()) == NEXT.tolist()


def test_work_queued_before_the_reuse_reads_the_right_bytes(fake):
    """A correct consumer's kernel, still queued when the loader reuses the buffer, must read the lease, not
    poison: the retire waits for the device before it unmaps anything."""
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 16, device="cuda")
    w = buf.write(0, fake.tensor(FIRST), "w")
    out = fake.alloc(32).view(torch.float32)
    stream = torch.cuda.current_stream()
    fake.settle()
    fake.pause(stream)
    out.copy_(w)  # queued behind the pause
    buf.write(0, fake.tensor(NEXT), "next")
    fake.resume(stream)
    fake.settle()
    assert out.tolist() == FIRST.tolist()
    assert sanitizer.errors() == []


def test_rescue_keeps_every_alias_on_the_rescued_bytes(fake):
    sanitizer.enable(trap="poison", rescue=True)
    buf = StagingBuffer(1 << 16, device="cuda")
    w = buf.write(0, fake.tensor(FIRST), "w")
    a = _aliases(w)
    fake.settle()
    nxt = buf.write(0, fake.tensor(NEXT), "next")
    fake.settle()
    assert nxt.tolist() == NEXT.tolist()
    assert w.tolist() == FIRST.tolist() and _floats(a["ptr"]) == FIRST.tolist()
    assert a["from_dlpack"].tolist() == FIRST.tolist() and a["cai"].tolist() == FIRST.tolist()
    record = sanitizer.rescues()[-1]
    assert record["in_place"] and "aliases_not_rescued" not in record
    assert sanitizer.errors() == []


def _ring_load(fake: FakeCuda, trap: str) -> list:
    sanitizer.enable(trap=trap)
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(5 + i, 7, generator=g) for i in range(12)]
    out = []
    with StagingRing(3 * 12 * 7 * 4, device="cuda", name="r") as ring:
        for i, t in enumerate(weights):
            view = ring.put(f"w{i}", fake.tensor(t))
            kept = fake.alloc(view.numel() * 4).view(torch.float32).view(view.shape)
            kept.copy_(view)  # a correct consumer: copies before the next put
            out.append(kept)
    fake.settle()
    result = [t.clone() for t in out]
    sanitizer.disable()
    return result


def test_a_correct_program_is_bit_identical_with_trap_on(fake):
    plain = _ring_load(fake, "0")
    trapped = _ring_load(fake, "poison")
    assert len(plain) == 12 and all(torch.equal(a, b) for a, b in zip(plain, trapped))
    assert sanitizer.errors() == []


def test_dead_aliases_are_unmapped_after_a_device_wait_and_the_buffer_goes_whole(fake):
    from sanitizer.torch_layer import trap, trap_cuda

    sanitizer.enable(trap="poison")
    gc.collect()
    trap_cuda.GRAVEYARD.collect()
    reserved = len(fake.vmm._reserved)
    before = trap.stats()["windows"]
    buf = StagingBuffer(1 << 18, device="cuda")
    views = [buf.lend(i * 64, (16,), torch.float32, f"v{i}") for i in range(20)]
    assert trap.stats()["windows"] == before + 20 and len(fake.vmm._reserved) == reserved + 21
    del views
    gc.collect()
    assert trap.stats()["windows"] == before
    assert len(trap_cuda.GRAVEYARD) == 20  # dead, but a kernel queued before may still read them
    x = buf.write(0, fake.tensor(FIRST), "x")
    buf.reuse(0, 32, by="y")  # a retire that traps x waits for the device: the dead aliases go
    assert len(trap_cuda.GRAVEYARD) == 0
    buf.close()
    del buf, x
    gc.collect()
    trap_cuda.GRAVEYARD.collect()
    assert len(fake.vmm._reserved) == reserved  # the buffer's own range too
    assert len(fake.vmm._handles) == 1  # the buffer's allocations were released at close; the poison granule stays
    assert fake.vmm.physical_bytes(0) == fake.vmm.granule  # and their memory went with the last mapping


def test_a_device_without_virtual_memory_management_falls_back_with_one_warning(fake, monkeypatch):
    from sanitizer.torch_layer import trap_memory

    monkeypatch.setattr(fake.vmm, "why_not", "device 0 does not support virtual memory management")
    monkeypatch.setattr(trap_memory, "_warned_keys", set())
    sanitizer.enable(trap="poison")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buf = StagingBuffer(1 << 16, device="cuda:0")
        StagingBuffer(1 << 16, device="cuda:0")
    messages = [str(w.message) for w in caught]
    assert type(buf) is StagingBuffer
    assert len(messages) == 1 and "cannot be trapped on cuda:0" in messages[0] and "virtual memory" in messages[0]
    w = buf.write(0, fake.tensor(FIRST), "w")
    buf.write(0, fake.tensor(NEXT), "next")
    with pytest.raises(StaleBorrowError):  # the guard still covers the tensor itself
        w + 1


def test_the_fake_driver_keeps_cudas_rules(fake):
    from cuda_hooks import vmm

    drv, g = fake.vmm, fake.vmm.granule
    h = drv.create(2 * g, 0)
    at = drv.reserve(2 * g, g, 0)
    assert at % g == 0
    with pytest.raises(vmm.VmmError, match="granularity"):
        drv.map(at, g + 4096, h, 0)
    drv.map(at, 2 * g, h, 0)
    with pytest.raises(vmm.VmmError, match="already mapped"):
        drv.map(at, g, h, 0)
    with pytest.raises(vmm.VmmError, match="still mapped"):
        drv.free(at, 2 * g)
    with pytest.raises(vmm.VmmError, match="not a whole mapped range"):
        drv.unmap(at, g)
    drv.unmap(at, 2 * g)
    drv.free(at, 2 * g)
    drv.release(h)


def test_the_real_driver_says_why_it_is_unavailable_without_failing():
    from cuda_hooks import vmm

    why = vmm.CudaDriver().unavailable(0)
    assert why is None or isinstance(why, str) and why  # None only where a CUDA driver with VMM exists
    if why is not None:
        with pytest.raises(vmm.VmmError):
            vmm.CudaDriver().granularity(0)


FAULT_PROGRAM = textwrap.dedent("""
    import ctypes, torch, pytest, sanitizer
    from sanitizer import StagingBuffer
    from tests.fake_cuda import FakeCuda
    fake = FakeCuda(1).install(pytest.MonkeyPatch())
    sanitizer.enable(trap="fault")
    buf = StagingBuffer(1 << 16, device="cuda", name="cudafault")
    w = buf.write(0, fake.tensor(torch.arange(4, dtype=torch.float32)), "layer0.weight")
    ptr = w.data_ptr()
    fake.settle()
    assert ctypes.string_at(ptr, 4) == bytes(4)
    buf.write(0, fake.tensor(torch.full((4,), 7.0)), "layer1.weight")
    fake.settle()
    print("fresh reads were fine", flush=True)
    def consumer():
        return ctypes.string_at(ptr, 16)
    consumer()
    print("NOT REACHED", flush=True)
""")


@pytest.mark.slow
def test_fault_mode_leaves_the_alias_unmapped_and_a_host_read_gets_the_report():
    proc = run_python(FAULT_PROGRAM)
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    assert "fresh reads were fine" in proc.stdout and "NOT REACHED" not in proc.stdout
    err = proc.stderr
    assert err.count("==ownsan== ERROR") == 1
    assert "lease 'layer0.weight'" in err and "'cudafault'" in err and "for 'layer1.weight'" in err
    assert "in consumer" in err
