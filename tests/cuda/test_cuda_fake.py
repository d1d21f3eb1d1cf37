"""The sanitizer's CUDA paths on fake CUDA devices (tests/fake_cuda.py): no GPU needed.

Each test names the behaviour a user relies on. The tests under "defects" reproduce
the defects a close read of the CUDA paths found (issue 21): each was committed as a
strict xfail, failing for its reason, before the commit that fixed it removed the marker.
"""
from __future__ import annotations

import ctypes
import gc
import inspect
import math

import numpy as np
import pytest
import torch

import cuda_hooks
import sanitizer
from cuda_hooks import devices, to_unsigned
from sanitizer import BorrowCorruptedError, StagingBuffer, StaleBorrowError
from sanitizer.features import checksums, guard
from sanitizer.torch_layer import storage_handles
from tests.fake_cuda import CAPTURE_ERROR, FakeStream, fake_cuda  # noqa: F401  (the fixture)



def _cpu_bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _mismatches() -> list:
    return [e["lease"]["name"] for e in sanitizer.errors() if e["kind"] == "checksum_mismatch"]


def _loader(param, loaded_weight):  # a deferred weight loader's signature
    return None


# -- the harness itself ------------------------------------------------------------------------------
def test_fake_device_memory_is_cuda_to_the_sanitizer_and_views_follow(fake_cuda):
    t = fake_cuda.alloc(4096, device=1)
    assert devices.is_cuda(t) and devices.is_cuda(t[100:200].view(torch.int32))
    assert devices.device_of(t[8:]) == torch.device("cuda", 1)
    assert devices.storage_device(t.untyped_storage()) == torch.device("cuda", 1)
    assert not devices.is_cuda(torch.zeros(16))
    s = torch.cuda.Stream()
    assert isinstance(s, FakeStream) and s != torch.cuda.current_stream()
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s
    assert torch.cuda.current_stream().cuda_stream == 0


def test_a_cuda_lease_is_made_by_the_real_cuda_lend_a_storage_of_its_own_over_the_buffer(fake_cuda, monkeypatch):
    """The CUDA branch of the lend (a ``__cuda_array_interface__`` region and its alias), not the host
    one: the fake's memory is CPU memory, and the harness used to send its leases down the numpy path."""
    made = []

    def spy(region, device):
        made.append((type(region).__name__, device))
        return fake_cuda.from_interface(region, device)

    monkeypatch.setattr(devices, "from_interface", spy)
    buf = StagingBuffer(4096, device="cuda:1", name="r")
    with sanitizer.sanitize():
        w = buf.write(256, torch.arange(16.0), name="w")
        assert made == [("_CudaRegion", torch.device("cuda", 1))]
        assert devices.is_cuda(w) and devices.device_of(w) == torch.device("cuda", 1)
        assert w.untyped_storage()._cdata != buf.tensor.untyped_storage()._cdata  # the lease's own storage
        assert w.data_ptr() == buf.tensor.data_ptr() + 256 and w.tolist() == list(range(16))
        lease = sanitizer.lease_of(w)
        del w
        gc.collect()
        assert not lease.alive  # its storage died with the view: the region's weak reference saw it


def test_fake_record_stream_counts_only_on_the_storage_that_owns_the_memory(fake_cuda):
    t = fake_cuda.alloc(256)
    side = torch.cuda.Stream()
    alias = torch.from_numpy(t.numpy()[:64])  # another storage over the same memory (a from_blob)
    alias.record_stream(side)
    assert fake_cuda.recorded(t) == []  # torch ignores record_stream on memory its allocator does not own
    t[:64].record_stream(side)
    assert fake_cuda.recorded(t) == [side.cuda_stream]


def test_fake_paused_stream_runs_its_launches_at_synchronize(fake_cuda):
    t = fake_cuda.tensor(torch.arange(100, dtype=torch.uint8))
    out = fake_cuda.zeros(1, torch.int64, torch.device("cuda", 0))
    side = torch.cuda.Stream()
    fake_cuda.pause(side)
    with torch.cuda.stream(side):
        cuda_hooks.checksum_into(t, out, 0)
    assert int(out[0]) == 0  # still queued
    side.synchronize()
    assert to_unsigned(int(out[0])) == cuda_hooks.checksum(torch.arange(100, dtype=torch.uint8))


# -- cuda_hooks.bridge on a fake device --------------------------------------------------------------
@pytest.mark.parametrize("device", [0, 1])
@pytest.mark.parametrize("offset", [0, 3])
def test_bridge_hashes_device_bytes_like_the_cpu_on_any_device_and_stream(fake_cuda, device, offset):
    host = torch.randint(0, 256, (1000 + offset,), dtype=torch.uint8)
    dev = fake_cuda.tensor(host, device=device)[offset:]
    want = cuda_hooks.checksum(host[offset:])
    out = fake_cuda.zeros(3, torch.int64, torch.device("cuda", device))
    flags = fake_cuda.zeros(3, torch.int32, torch.device("cuda", device))
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        used = cuda_hooks.checksum_into(dev, out, 1)
    assert used == side  # the work went to the current stream of the tensor's device
    assert to_unsigned(int(out[1])) == want and int(out[0]) == int(out[2]) == 0
    assert cuda_hooks.checksum(dev) == want
    assert cuda_hooks.verify_into(dev, out, 1, flags) == torch.cuda.current_stream(device)
    assert flags.tolist() == [0, 0, 0]
    dev[7] ^= 1
    cuda_hooks.verify_into(dev, out, 1, flags)
    assert flags.tolist() == [0, 1, 0]
    assert torch.cuda.current_device() == 0  # the device scope was left


def test_bridge_poisons_device_bytes_on_the_current_stream(fake_cuda):
    t = fake_cuda.tensor(torch.arange(64, dtype=torch.uint8))
    assert cuda_hooks.poison(t[8:16], 0xA5) == torch.cuda.current_stream()
    assert set(t[8:16].tolist()) == {0xA5} and t[:8].tolist() == list(range(8))


def test_bridge_refuses_slot_tensors_on_another_device(fake_cuda):
    t = fake_cuda.alloc(64, device=1)
    out = fake_cuda.zeros(2, torch.int64, torch.device("cuda", 0))
    with pytest.raises(ValueError, match="out is on cuda:0 but the tensor is on cuda:1"):
        cuda_hooks.checksum_into(t, out, 0)
    with pytest.raises(ValueError, match="out is on cpu but the tensor is on cuda:1"):
        cuda_hooks.checksum_into(t, torch.zeros(2, dtype=torch.int64), 0)


# -- checksum=1 and poison=1 on a CUDA StagingBuffer ---------------------------------------------------
def test_correct_cuda_workload_is_bit_identical_and_silent_with_checksum_and_poison(fake_cuda):
    def load() -> list:
        torch.manual_seed(1)
        ring = sanitizer.StagingRing(3000, device="cuda", name="ring")
        out = []
        for i in range(40):
            src = torch.randn(7 + i % 5, 13, dtype=torch.bfloat16)
            out.append(_cpu_bytes(ring.put(f"w{i}", src).clone()))
        return out

    plain = load()
    with sanitizer.sanitize(checksum=1, poison=1):
        checked = load()
        sanitizer.synchronize()
    assert sanitizer.errors() == [] and plain == checked


def test_a_write_behind_the_api_into_a_cuda_lease_is_reported_at_synchronize(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="ring0")
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.ones(16), name="layers.3.w")
        buf.tensor.numpy()[9] ^= 1  # a C extension or DMA writing into the lent bytes
        buf.reuse(0, 64, by="layers.4.w")  # the device verify is queued, nothing raises yet
        with pytest.raises(BorrowCorruptedError, match="'layers.3.w'") as err:
            sanitizer.synchronize()
    assert err.value.where == "reuse"
    del w


def test_poison_makes_retired_cuda_bytes_read_nan(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(poison=1):
        w = buf.write(0, torch.ones(64, dtype=torch.bfloat16), name="w")
        buf.reuse(0, 16, by="next")
        tail = buf.tensor[16:128].view(torch.bfloat16)
        assert torch.isnan(tail.float()).all()
    del w


# -- defects: device hash slots --------------------------------------------------------------------------
def test_a_dead_corrupted_lease_is_reported_under_its_own_name_when_its_slot_is_reused(fake_cuda):
    buf = StagingBuffer(1 << 16, device="cuda", name="ring")
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        a = buf.write(0, torch.arange(64.0), name="A")
        buf.tensor.numpy()[3] ^= 1  # A's bytes change behind the API
        buf.reuse(0, 256, by="B")  # its verify is queued: A's device flag goes up
        del a
        gc.collect()  # A dies
        kept = [buf.write(1024 + 256 * i, torch.full((64,), float(i)), name=f"L{i}") for i in range(64)]
        sanitizer.synchronize()
    assert _mismatches() == ["A"]
    del kept


def test_slot_growth_keeps_a_flag_raised_by_a_verify_still_queued_on_another_stream(fake_cuda):
    buf = StagingBuffer(1 << 16, device="cuda", name="ring")
    side = torch.cuda.Stream()
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        kept = [buf.write(256 * i, torch.full((64,), float(i)), name=f"L{i}") for i in range(64)]  # 64 slots taken
        buf.tensor.numpy()[5] ^= 1  # L0 corrupted
        fake_cuda.pause(side)  # a slow stream
        with torch.cuda.stream(side):
            sanitizer.verify(kept[0])  # queued on the side stream
        kept.append(buf.write(256 * 64, torch.ones(64), name="L64"))  # the 65th slot: the tables grow
        sanitizer.synchronize()
    assert _mismatches() == ["L0"]
    assert fake_cuda.hazards == []  # the old tables were not freed under the pending verify
    del kept


def test_synchronize_waits_for_checks_queued_on_every_stream(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    side = torch.cuda.Stream()
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        a = buf.write(0, torch.arange(16.0), name="a")
        b = buf.write(1024, torch.arange(16.0), name="b")
        buf.tensor.numpy()[5] ^= 1
        buf.tensor.numpy()[1024 + 5] ^= 1
        sanitizer.verify(a)  # on the default stream: done at once
        fake_cuda.pause(side)
        with torch.cuda.stream(side):
            sanitizer.verify(b)  # still queued on a slow side stream
        sanitizer.synchronize()  # from the default stream: must wait for the side stream too
        assert sorted(_mismatches()) == ["a", "b"]
    del a, b


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_deferral_scope_raises_a_corruption_at_replay_on_every_device(fake_cuda, device):
    buf = StagingBuffer(4096, device=device, name="r")
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.arange(16.0), name="w")
        scope = sanitizer.DeferralScope("layer", policy=None)  # retains the borrowed view as it is
        scope.defer(inspect.signature(_loader).bind(None, w))
        buf.tensor.numpy()[5] ^= 1
        with pytest.raises(BorrowCorruptedError, match="'w'"):
            scope.replay()
        scope.close()
    del w


def test_a_cuda_deferral_reads_its_checks_once_at_replay(fake_cuda):
    buf = StagingBuffer(1 << 14, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1):
        scope = sanitizer.DeferralScope("layer")  # owns (copies) what it defers
        for i in range(8):
            scope.defer(inspect.signature(_loader).bind(None, buf.write(1024 * i, torch.arange(16.0), name=f"w{i}")))
        buf.tensor.numpy()[1024 * 3 + 1] ^= 1  # w3 changed after its deferral: its copy is already made
        syncs = torch.cuda.current_stream().syncs
        assert len(scope.replay()) == 8  # the copies are fine, and no check was queued after them
        assert torch.cuda.current_stream().syncs == syncs + 1  # one synchronisation for the eight deferrals
        scope.close()
    assert sanitizer.errors() == []


def test_a_cuda_deferral_of_changed_bytes_raises_at_replay(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.arange(16.0), name="w")
        buf.tensor.numpy()[5] ^= 1  # changed before the deferral copies it
        scope = sanitizer.DeferralScope("layer")
        scope.defer(inspect.signature(_loader).bind(None, w))  # queued on the device, not read yet
        with pytest.raises(BorrowCorruptedError, match="'w'.*checked at verify"):
            scope.replay()
        scope.close()
    del w


# -- rescue, guard, own() on a CUDA buffer ---------------------------------------------------------------
def test_rescue_keeps_a_retained_cuda_view_correct(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="ring0")
    with sanitizer.sanitize(rescue=1):
        w = buf.write(0, torch.arange(64, dtype=torch.float32), name="w")
        kept = w[8:16]
        del w
        buf.write(0, torch.full((64,), -7.0), name="next")
        assert kept.tolist() == [float(i) for i in range(8, 16)] and devices.is_cuda(kept)
        assert not sanitizer.is_borrowed(kept)
    assert sanitizer.errors() == []


def test_a_rescued_cuda_view_read_from_another_stream_reads_the_copy(fake_cuda):
    """Issue 31, defect 3: the rescue copy is queued on the retiring (loader's) stream while the view
    points at the new memory at once; a consumer reading it from another stream, or from the host, must
    see the copied bytes, never the copy's destination before the copy landed."""
    buf = StagingBuffer(4096, device="cuda", name="ring0")
    loader, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with sanitizer.sanitize(rescue=1, guard=0):
        w = buf.write(0, torch.arange(64, dtype=torch.float32), name="w")
        kept = w[8:16]
        del w
        fake_cuda.pause(loader)  # a busy loader stream
        with torch.cuda.stream(loader):
            buf.write(0, torch.full((64,), -7.0), name="next")  # retire: the rescue copy, then the new bytes
        with torch.cuda.stream(consumer):
            assert kept.tolist() == [float(i) for i in range(8, 16)]
        assert not sanitizer.is_borrowed(kept)
    assert sanitizer.errors() == []


def test_guard_makes_a_retained_cuda_view_read_poison_and_still_reports(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="ring0")
    with sanitizer.sanitize():
        w = buf.write(0, torch.arange(64, dtype=torch.float32), name="w")
        buf.write(0, torch.full((64,), 7.0), name="next")
        raw = np.frombuffer((ctypes.c_char * 256).from_address(w.data_ptr()), dtype=np.float32)  # no aten op
        assert np.isnan(raw).all() and devices.is_cuda(w)  # device memory filled with 0xFF
        with pytest.raises(StaleBorrowError, match="'w'"):
            w.sum()
        assert buf.lend(0, (64,), torch.float32, name="next").tolist() == [7.0] * 64


def test_own_copies_a_cuda_lease_into_device_memory(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize():
        w = buf.write(0, torch.arange(16.0), name="w")
        o = sanitizer.own(w)
        assert o is not w and devices.is_cuda(o) and not sanitizer.is_borrowed(o)
        assert o.tolist() == [float(i) for i in range(16)]
        buf.write(0, torch.zeros(16), name="next")
        assert o.tolist() == [float(i) for i in range(16)]


def test_own_returns_ordinary_memory_on_cpu_too():
    buf = StagingBuffer(4096, name="host")
    w = buf.write(0, torch.arange(16.0), name="w")
    o = sanitizer.own(w)
    assert o.untyped_storage().resizable()  # not a numpy-backed alias: resize_ and share_memory_ work
    o.share_memory_()
    assert o.tolist() == [float(i) for i in range(16)] and sanitizer.stats()["owned_bytes"] >= 64


# -- defects: streams and the caching allocator ----------------------------------------------------------
def test_rescue_on_a_side_stream_records_that_stream_on_the_staging_memory(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="ring0")
    side = torch.cuda.Stream()
    with sanitizer.sanitize(rescue=1, guard=0):
        w = buf.write(0, torch.arange(64, dtype=torch.float32), name="w")
        with torch.cuda.stream(side):
            buf.write(0, torch.zeros(64), name="next")  # the rescue copy is queued on the side stream
        assert side.cuda_stream in fake_cuda.recorded(buf.tensor)
        fake_cuda.record_streams.clear()
        w.record_stream(side)  # a rescued view is ordinary allocator memory: this is not a no-op
        assert fake_cuda.record_streams[-1][2] is True


def test_own_returns_allocator_memory_on_cuda(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    side = torch.cuda.Stream()
    with sanitizer.sanitize():
        w = buf.write(0, torch.arange(16.0), name="w")
        with torch.cuda.stream(side):
            o = sanitizer.own(w)
        assert fake_cuda.owns(o)  # allocator memory, not an alias: record_stream, IPC and resize_ work on a device
        assert side.cuda_stream in fake_cuda.recorded(buf.tensor)  # the copy read the staging bytes on `side`


def test_checks_and_poison_on_a_side_stream_keep_the_staging_memory_for_that_stream(fake_cuda):
    side = torch.cuda.Stream()
    with sanitizer.sanitize(checksum=1, poison=1, guard=0):
        buf = StagingBuffer(4096, device="cuda", name="r")
        w = buf.write(0, torch.arange(16.0), name="w")
        with torch.cuda.stream(side):
            buf.close()  # verify and poison queued on the side stream
        recorded = fake_cuda.recorded(w)
        del w, buf
        gc.collect()  # the staging memory is freed (to the default stream's pool) before anyone waited for `side`
        assert fake_cuda.hazards == []
        assert recorded == [side.cuda_stream]
        sanitizer.synchronize()
    assert sanitizer.errors() == []


def test_cuda_tombstones_share_one_poison_allocation(fake_cuda):
    buf = StagingBuffer(1 << 20, device="cuda", name="ring0")
    with sanitizer.sanitize(halt_on_error=0):
        before = len(fake_cuda.allocations)
        kept = []
        for i in range(4):
            w = buf.write(0, torch.ones(1 << 18), name=f"w{i}")  # 1 MiB each, retained
            kept.append(w)
        buf.write(0, torch.ones(1 << 18), name="last")
        made = fake_cuda.allocations[before:]
        poison = [a for a in made if a.nbytes >= 1 << 20]
        assert len(poison) == 1, f"one shared poison block, got {[a.nbytes for a in poison]}"
        assert all(math.isnan(float(k[0])) and math.isnan(float(k[-1])) for k in kept)
        assert guard.stats()["device_poison_bytes"] == poison[0].nbytes
    del kept


def test_a_larger_cuda_tombstone_grows_the_block_and_older_ones_still_read_poison(fake_cuda):
    buf = StagingBuffer(4 << 20, device="cuda", name="ring0")
    with sanitizer.sanitize(halt_on_error=0):
        small = buf.write(0, torch.ones(1 << 10), name="small")  # 4 KiB
        buf.write(0, torch.ones(1 << 10), name="next")
        first = guard.stats()["device_poison_bytes"]
        syncs = torch.cuda.current_stream().syncs
        big = buf.write(1 << 20, torch.ones(3 << 18), name="big")  # 3 MiB
        buf.write(1 << 20, torch.ones(3 << 18), name="next2")
        assert guard.stats()["device_poison_bytes"] == 4 << 20 > first  # the next power of two
        assert torch.cuda.current_stream().syncs == syncs + 1  # the new block's fill was waited for, once
        for t in (small, big):
            raw = np.frombuffer((ctypes.c_char * (t.numel() * 4)).from_address(t.data_ptr()), dtype=np.uint8)
            assert (raw == 0xFF).all()
    del small, big


def test_the_poison_block_goes_with_its_last_tombstone_and_fits_the_allocators_rounding(fake_cuda):
    """It held a power of two for the process's life: a 2.2 GB embedding's tombstone pinned 4 GiB, kept
    after every tombstone had died (issue 31, defect 5)."""
    from sanitizer.torch_layer.storage_handles import DevicePoison

    assert DevicePoison.block_size(2_200_000_000) == -(-2_200_000_000 // (2 << 20)) * (2 << 20) < 2_300_000_000
    assert DevicePoison.block_size(3 << 18) == 3 << 18 and DevicePoison.block_size(100) == 1 << 16
    assert DevicePoison.block_size(3 << 20, current=2 << 20) == 4 << 20  # small steps grow a little ahead
    buf = StagingBuffer(4 << 20, device="cuda", name="ring0")
    with sanitizer.sanitize(halt_on_error=0):
        kept = [buf.write(0, torch.ones(3 << 18), name="w")]  # 3 MiB
        buf.write(0, torch.ones(16), name="next")
        assert guard.stats()["device_poison_bytes"] == 4 << 20  # 3 MiB, in the allocator's 2 MiB steps
        assert math.isnan(float(kept[0][0]))
        del kept
        gc.collect()
        assert guard.stats()["device_poison_bytes"] == 0  # no tombstone left: nothing held
        again = buf.write(0, torch.ones(16), name="w2")
        buf.write(0, torch.ones(16), name="next2")
        assert math.isnan(float(again[0])) and guard.stats()["device_poison_bytes"] == 1 << 16
    del again


# -- defects: graph capture, missing tool chain -----------------------------------------------------------
def test_graph_capture_skips_device_work_with_one_warning(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1, poison=1, rescue=1):
        w0 = buf.write(0, torch.arange(16.0), name="before")  # kernels loaded outside the capture
        kept = w0[:4]
        del w0
        with pytest.warns(RuntimeWarning, match="graph") as warned:
            with fake_cuda.capture() as graph:
                w = buf.write(0, torch.ones(16), name="during")  # retires "before", lends "during"
                sanitizer.synchronize()
                buf.write(0, torch.zeros(16), name="again")
        assert len([x for x in warned if "graph" in str(x.message)]) == 1
        assert [name for name, _, _ in graph] == ["copy_", "copy_"]  # the producer's two writes, nothing of ours
        assert fake_cuda.hazards == []
        assert not [a for a in fake_cuda.allocations if a.during_capture]
        with pytest.raises(StaleBorrowError):  # not rescued during the capture: a stale use, reported
            kept.sum()
        sanitizer.synchronize()  # after the capture: fine
        after = buf.write(1024, torch.ones(16), name="after")  # checks resume once the capture ended
        buf.tensor.numpy()[1024] ^= 1
        sanitizer.verify(after)
        with pytest.raises(BorrowCorruptedError, match="'after'"):
            sanitizer.synchronize()
    del w, after


def test_a_missing_cuda_tool_chain_turns_device_checksums_off_with_one_warning(fake_cuda, monkeypatch):
    def no_nvvm() -> None:
        raise cuda_hooks.KernelsUnavailable("libNVVM cannot be found (fake)")

    monkeypatch.setattr(fake_cuda.gpu.inner, "warm", no_nvvm)
    buf = StagingBuffer(4096, device="cuda", name="r")
    cpu = StagingBuffer(4096, name="host")
    with pytest.warns(RuntimeWarning, match="checksums of CUDA tensors are off.*libNVVM") as warned:
        with sanitizer.sanitize(checksum=1):  # (the kernels load at enable: CUDA is in use)
            w = buf.write(0, torch.ones(16), name="w")
            w2 = buf.write(1024, torch.ones(16), name="w2")
            assert sanitizer.lease_of(w).checksum is None
            h = cpu.write(0, torch.ones(16), name="h")
            cpu.tensor.numpy()[0] ^= 1
            with pytest.raises(BorrowCorruptedError):  # host checksums still run
                sanitizer.verify(h)
            buf.reuse(0, 4096, by="next")  # and nothing else breaks
            sanitizer.synchronize()
    assert len(warned) == 1
    del w, w2


@pytest.mark.parametrize("where", ["warm", "checksum_into", "verify_into"])
def test_a_driver_failure_in_a_lend_turns_device_checksums_off_never_raises(fake_cuda, monkeypatch, where):
    """numba's CudaSupportError (no driver, a device-id query that fails) or a launch that fails, from inside
    a loader's lend: CUDA checksums go off with one warning; the lend, and everything after, goes on."""
    class CudaSupportError(RuntimeError):  # what numba.cuda raises, by name
        pass

    def broken(*args, **kwargs):
        raise CudaSupportError("Error at driver init: CUDA driver library cannot be found (fake)")

    monkeypatch.setattr(fake_cuda.gpu.inner if where == "warm" else cuda_hooks, where, broken)
    buf = StagingBuffer(4096, device="cuda", name="r")
    with pytest.warns(RuntimeWarning, match="checksums of CUDA tensors are off.*CudaSupportError") as warned:
        with sanitizer.sanitize(checksum=1):
            w = buf.write(0, torch.ones(16), name="w")
            w2 = buf.write(1024, torch.ones(16), name="w2")
            if where != "verify_into":  # (a verify's failure comes at the reuse below)
                assert sanitizer.lease_of(w).checksum is None and sanitizer.lease_of(w2).checksum is None
            buf.reuse(0, 4096, by="next")
            sanitizer.synchronize()
            with pytest.raises(StaleBorrowError):  # the rest of the sanitizer still works
                w.sum()
    assert len([x for x in warned if "checksums of CUDA" in str(x.message)]) == 1
    del w, w2


def test_the_kernels_load_at_enable_when_the_process_uses_cuda(fake_cuda):
    with sanitizer.sanitize(checksum=1):
        assert fake_cuda.gpu.module_loads == {0: 1}  # before any lend
        buf = StagingBuffer(4096, device="cuda", name="r")
        w = buf.write(0, torch.ones(16), name="w")
        buf2 = StagingBuffer(4096, device="cuda:1", name="r1")
        w1 = buf2.write(0, torch.ones(16), name="w1")
        assert fake_cuda.gpu.module_loads == {0: 1, 1: 1}  # once per device
    del w, w1




@pytest.mark.parametrize("recorded", [False, True])
def test_fake_a_freed_block_goes_to_the_next_allocation_unless_a_recorded_stream_still_needs_it(fake_cuda, recorded):
    """The harness as the caching allocator: queued work holds nothing alive, a freed block is handed to the
    next allocation of its size on its stream at once, so a read queued on another stream sees the next
    owner's bytes, unless ``record_stream`` told the allocator about that stream."""
    side = torch.cuda.Stream()
    a = fake_cuda.tensor(torch.arange(256, dtype=torch.uint8))  # allocated on the default stream
    out = fake_cuda.alloc(256)
    fake_cuda.pause(side)
    with torch.cuda.stream(side):
        out.copy_(a)  # a read of a, queued on a slow stream
    if recorded:
        a.record_stream(side)
    del a
    gc.collect()
    junk = fake_cuda.alloc(256).fill_(0x55)  # the next allocation of that size on the default stream
    side.synchronize()
    assert out.tolist() == (list(range(256)) if recorded else [0x55] * 256)
    assert (fake_cuda.hazards == []) == recorded
    del junk


def test_fake_event_orders_after_its_recorded_point_only(fake_cuda):
    """The harness as CUDA: a wait on an event runs what was issued before the record, not what came after."""
    side = torch.cuda.Stream()
    out = devices.zeros(2, torch.int64, devices.device_of(fake_cuda.alloc(8)))
    fake_cuda.pause(side)
    with torch.cuda.stream(side):
        out[:1].fill_(1)
        ev = torch.cuda.Event()
        ev.record()
        out[1:].fill_(2)  # after the record
    assert not ev.query()
    torch.cuda.current_stream().wait_event(ev)
    assert ev.query() and out.tolist() == [1, 0]  # the later fill is still queued on the paused stream
    side.synchronize()
    assert out.tolist() == [1, 2]


def test_a_verify_on_the_consumers_stream_waits_for_the_lends_hash_not_only_for_the_ready_event(fake_cuda):
    """Issue 31, defect 1: the loader writes on its stream, records "ready", lends (the hash is queued
    after the event); the consumer waits for "ready" only, and a reuse on its stream queues the verify.
    The verify must still run after the hash, or it compares against an empty (or recycled) slot and a
    correct program gets a false BorrowCorruptedError."""
    buf = StagingBuffer(4096, device="cuda", name="ring")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        fake_cuda.pause(producer)  # a busy loader stream: its work runs when something waits for it
        with torch.cuda.stream(producer):
            buf.tensor[:64].copy_(torch.arange(16.0).view(torch.uint8))
            ready = torch.cuda.Event()
            ready.record()
            w = buf.lend(0, (16,), torch.float32, name="w")  # its hash: queued after "ready"
        with torch.cuda.stream(consumer):
            consumer.wait_event(ready)
            assert w.tolist() == list(range(16))  # (the consumer reads the bytes: the copy ran)
            buf.reuse(0, 64, by="next")  # the verify of w, queued on the consumer's stream
        sanitizer.synchronize()
        assert _mismatches() == []
    del w


def test_leases_hashed_on_one_stream_share_one_stream_object(fake_cuda):
    """A lease keeps the stream its hash went to; torch's ``current_stream()`` makes a new object per call
    (the fake's does not), and a real checkpoint lends 100,000+ leases: they share one per stream."""
    import types

    def torch_like(handle, index=0):  # what torch.cuda.current_stream() returns: a new object each call
        return types.SimpleNamespace(device=torch.device("cuda", index), cuda_stream=handle)

    checks = checksums.DeviceChecks()
    first = checks.canonical(torch_like(7))
    assert checks.canonical(torch_like(7)) is first
    assert checks.canonical(torch_like(8)) is not first and checks.canonical(torch_like(7, 1)) is not first
    buf = StagingBuffer(1 << 16, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1):
        kept = [buf.write(256 * i, torch.ones(16), name=f"w{i}") for i in range(8)]
        assert len({id(sanitizer.lease_of(w).checksum[2]) for w in kept}) == 1
    del kept


def test_the_expected_hash_of_a_lease_hashed_on_a_slow_stream_is_read_after_the_hash(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    side = torch.cuda.Stream()
    with sanitizer.sanitize(checksum=1):
        fake_cuda.pause(side)
        with torch.cuda.stream(side):
            w = buf.write(0, torch.arange(16.0), name="w")
        assert checksums.expected_hash(sanitizer.lease_of(w)) == cuda_hooks.checksum(torch.arange(16.0))
    del w


# -- the rest of the CUDA surface -----------------------------------------------------------------------
def test_verify_wait_raises_a_cuda_corruption_at_once(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.arange(16.0), name="w")
        assert checksums.expected_hash(sanitizer.lease_of(w)) == cuda_hooks.checksum(torch.arange(16.0))
        sanitizer.verify(w, wait=True)  # unchanged: silent
        buf.tensor.numpy()[5] ^= 1
        with pytest.raises(BorrowCorruptedError, match="'w'.*checked at verify"):
            sanitizer.verify(w, wait=True)
    del w


def test_flags_still_up_at_exit_are_recorded_not_raised(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.arange(16.0), name="w")
        buf.tensor.numpy()[5] ^= 1
        sanitizer.verify(w)
        checksums._synchronize_at_exit()  # what atexit runs
        assert _mismatches() == ["w"]
    del w


def test_lends_and_checks_from_threads_on_their_own_streams_are_exact(fake_cuda):
    import threading

    bufs = [StagingBuffer(1 << 16, device="cuda", name=f"r{k}") for k in range(2)]
    failures: list = []

    def load(k: int) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                kept = []
                for i in range(100):  # enough lends to make the slot table grow and reclaim
                    w = bufs[k].write(512 * (i % 100), torch.full((64,), float(i)), name=f"t{k}.{i}")
                    sanitizer.verify(w)
                    kept.append(w) if i % 3 == 0 else None
        except Exception as exc:  # reported to the main thread
            failures.append(exc)

    with sanitizer.sanitize(checksum=1, poison=1, guard=0):
        threads = [threading.Thread(target=load, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sanitizer.synchronize()
    assert failures == [] and sanitizer.errors() == [] and fake_cuda.hazards == []


def test_bridge_caches_the_numba_arrays_of_long_lived_tensors_only_by_identity(fake_cuda):
    import cuda_hooks.bridge as bridge

    out = fake_cuda.zeros(4, torch.int64, torch.device("cuda", 0))
    t = fake_cuda.tensor(torch.arange(64, dtype=torch.uint8))
    cuda_hooks.checksum_into(t, out, 0)
    a = bridge._arrays.get(fake_cuda.gpu, out, np.uint64)
    assert bridge._arrays.get(fake_cuda.gpu, out, np.uint64) is a
    assert bridge._arrays.get(fake_cuda.gpu, out[:], np.uint64) is not a  # another tensor object: converted anew
    for _ in range(bridge._ArrayCache.LIMIT + 1):
        bridge._arrays.get(fake_cuda.gpu, fake_cuda.zeros(1, torch.int64, torch.device("cuda", 0)), None)
    assert bridge.cached_arrays() <= bridge._ArrayCache.LIMIT  # bounded: the oldest go first


def test_one_shot_checksums_leave_the_bridges_array_cache_to_long_lived_tensors(fake_cuda):
    """Issue 31, defect 6: ``cuda_hooks.checksum(t)`` made a new output per call and cached its numba
    array, so every call pushed a long-lived entry (a slot table's, a scratch's) out of the bounded cache
    and kept up to its bound of dead outputs alive."""
    from cuda_hooks import bridge

    dev = fake_cuda.tensor(torch.arange(256, dtype=torch.uint8))
    want = cuda_hooks.checksum(torch.arange(256, dtype=torch.uint8))
    assert cuda_hooks.checksum(dev) == want
    cached = bridge.cached_arrays()  # the stream's scratch
    for _ in range(100):
        assert cuda_hooks.checksum(dev) == want
    assert bridge.cached_arrays() == cached


def test_bridge_refuses_to_load_kernels_inside_a_capture_and_warm_takes_any_cuda_device(fake_cuda):
    t = fake_cuda.tensor(torch.arange(64, dtype=torch.uint8))
    out = fake_cuda.zeros(1, torch.int64, torch.device("cuda", 0))
    with fake_cuda.capture(torch.cuda.current_stream()):
        with pytest.raises(RuntimeError, match="capturing a CUDA graph.*warm"):
            cuda_hooks.checksum_into(t, out, 0)
    cuda_hooks.warm()
    cuda_hooks.warm(1)
    cuda_hooks.warm("cuda:1")
    assert fake_cuda.gpu.module_loads == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="needs a CUDA device, got 'cpu'"):
        cuda_hooks.warm("cpu")
    with fake_cuda.capture(torch.cuda.current_stream()) as graph:
        cuda_hooks.checksum_into(t, out, 0)  # loaded: the launch is captured into the graph, as any kernel
    assert [name for name, _, _ in graph] == ["fill_", "checksum"]  # (the graph's own scratch, zeroed in it)


def test_a_capture_on_a_new_stream_gives_the_graph_its_own_scratch(fake_cuda):
    """Issue 31, defect 6: the scratch of a stream first used inside a capture was made there, its
    zeroing captured only (run at replay, never now), and cached: an eager hash on that stream afterwards
    ran on memory never zeroed (a wrong hash on a device), and two graphs captured on one stream shared it."""
    from cuda_hooks import bridge

    t = fake_cuda.tensor(torch.arange(64, dtype=torch.uint8))
    out = fake_cuda.zeros(3, torch.int64, torch.device("cuda", 0))
    cuda_hooks.warm()
    side = torch.cuda.Stream()  # never used for a hash before
    captured = []
    for slot in (0, 1):  # two graphs on one stream
        before = len(fake_cuda.allocations)
        with fake_cuda.capture(side) as graph:
            cuda_hooks.checksum_into(t, out, slot)
        assert [name for name, _, _ in graph] == ["fill_", "checksum"]
        captured += [a for a in fake_cuda.allocations[before:] if a.during_capture]
    assert len(captured) == 2 and captured[0].base != captured[1].base  # one scratch per graph
    with torch.cuda.stream(side):
        cuda_hooks.checksum_into(t, out, 2)  # eager, on the stream the graphs were captured on
    side.synchronize()
    assert to_unsigned(int(out[2])) == cuda_hooks.checksum(torch.arange(64, dtype=torch.uint8))
    assert fake_cuda.hazards == []
    assert bridge.cached_arrays() <= 4  # the eager scratch and out; the graphs' scratches are not cached


def test_empty_cuda_leases_take_no_device_slot(fake_cuda):
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(checksum=1, poison=1):
        e = buf.lend(64, (0, 7), torch.bfloat16, name="empty")
        assert sanitizer.lease_of(e).checksum is None and not checksums.DEVICE_CHECKS.tables
        w = buf.write(0, torch.ones(16), name="w")
        assert checksums.DEVICE_CHECKS.tables  # a lease with bytes does
        buf.reuse(0, 4096, by="all of it")
        sanitizer.synchronize()
    assert sanitizer.errors() == []
    del e, w


def _device_state_in_use() -> torch.Tensor:
    """(checksum=1 on.) A CUDA lease retained past a reuse: a slot table, a tombstone's poison block and
    the bridge's arrays now exist; returns the retained view."""
    import cuda_hooks.bridge as bridge
    from sanitizer.torch_layer import storage_handles

    buf = StagingBuffer(4096, device="cuda", name="r")
    w = buf.write(0, torch.ones(16), name="w")
    buf.write(0, torch.ones(16), name="next")  # w retained: a tombstone, a poison block
    assert checksums.DEVICE_CHECKS.tables and storage_handles.DEVICE_POISON.nbytes and bridge.cached_arrays()
    return w


def test_reset_device_state_forgets_every_device_object_through_public_hooks(fake_cuda):
    """What a harness calls between tests (issue 31: the fake reached into private module state)."""
    import cuda_hooks.bridge as bridge
    from sanitizer.torch_layer import storage_handles
    from tests.fake_cuda import reset_device_state

    with sanitizer.sanitize(checksum=1):
        w = _device_state_in_use()
    del w
    gc.collect()
    reset_device_state()
    assert not checksums.DEVICE_CHECKS.tables and storage_handles.DEVICE_POISON.nbytes == 0
    assert bridge.cached_arrays() == 0


def test_a_forked_child_starts_with_no_device_state_and_fresh_locks(fake_cuda):
    import os

    import cuda_hooks.bridge as bridge
    from sanitizer.torch_layer import storage_handles

    with sanitizer.sanitize(checksum=1):
        w = _device_state_in_use()
        checksums.DEVICE_CHECKS.lock.acquire()  # held at the fork, as by another thread
        try:
            pid = os.fork()
            if pid == 0:  # the child: the parent's CUDA state is not usable here, and no lock is held
                ok = (not checksums.DEVICE_CHECKS.tables and storage_handles.DEVICE_POISON.nbytes == 0
                      and not bridge.cached_arrays() and checksums.DEVICE_CHECKS.lock.acquire(timeout=5))
                os._exit(0 if ok else 1)
        finally:
            checksums.DEVICE_CHECKS.lock.release()
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
    del w


def test_record_stream_forwarding_is_put_in_place_once_and_never_with_a_broken_driver(fake_cuda, monkeypatch):
    from sanitizer.features import streams

    with sanitizer.sanitize():
        installed = torch.Tensor.record_stream
        assert getattr(installed, "_ownsan_forwards", False)
        streams._on_enable({})  # a second enable: the same wrapper, never a wrapper of a wrapper
        assert torch.Tensor.record_stream is installed

    def broken() -> bool:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.Tensor, "record_stream", installed.__wrapped__)
    monkeypatch.setattr(torch.cuda, "is_available", broken)
    streams._on_enable({})  # no CUDA lease can exist: nothing to forward, and no error out of enable
    assert not getattr(torch.Tensor.record_stream, "_ownsan_forwards", False)


def test_memory_owner_of_a_lease_whose_storage_cannot_be_read_is_none(fake_cuda, monkeypatch):
    from sanitizer.features import streams

    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize():
        w = buf.write(0, torch.ones(16), name="w")
        assert streams.memory_owner(w) is not None  # the buffer's bytes

        def unreadable(*a):
            raise RuntimeError("storage of a tensor subclass without storage")

        monkeypatch.setattr(storage_handles.DEVICE_POISON, "block_at", unreadable)
        assert streams.memory_owner(w) is None
        assert streams.memory_owner(torch.ones(2)) is None  # not a lease
    del w


def test_record_stream_on_a_lease_holds_the_staging_memory_it_aliases(fake_cuda):
    """A consumer that reads a view on its own stream and calls ``w.record_stream(s)`` is correct
    unsanitized (the view shares the buffer's block). A lease is an alias torch's allocator ignores:
    the record must reach the buffer's block, and a tombstone's must reach the poison block (issue 31,
    defect 2)."""
    side = torch.cuda.Stream()
    buf = StagingBuffer(4096, device="cuda", name="r")
    with sanitizer.sanitize(halt_on_error=0):
        w = buf.write(0, torch.ones(16), name="w")
        w[:8].record_stream(side)  # a view of the lease, as a consumer would
        assert side.cuda_stream in fake_cuda.recorded(buf._data)
        buf.write(0, torch.ones(16), name="next")  # w is kept: the guard makes it a tombstone
        other = torch.cuda.Stream()
        w.record_stream(other)
        block = storage_handles.DEVICE_POISON.block_at(w.untyped_storage().data_ptr())
        assert block is not None and other.cuda_stream in fake_cuda.recorded(block)
        plain = fake_cuda.alloc(64)
        plain.record_stream(other)  # any other tensor: torch's own call, nothing more
        assert fake_cuda.recorded(plain) == [other.cuda_stream]
    del w
