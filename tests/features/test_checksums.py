"""checksum=1, poison=1 and quarantine: what generation counters cannot see."""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import BorrowCorruptedError, StagingBuffer, StagingRing, StaleBorrowError
from tests.conftest import run_python


def test_a_write_that_bypasses_the_api_into_a_live_lease_is_caught_at_reuse():
    buf = StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.ones(16), name="layers.3.w")
        ctypes.memset(buf.tensor.data_ptr() + 8, 0, 4)  # a C extension writing through data_ptr
        with pytest.raises(BorrowCorruptedError) as err:
            buf.reuse(0, 64, by="layers.4.w")
    e = err.value
    assert e.lease.name == "layers.3.w" and e.where == "reuse" and e.expected != e.found
    assert "staging buffer 'ring0' bytes [0x0, 0x40) changed behind the buffer API" in str(e)
    assert "lent at" in str(e) and "reused at" in str(e) and "verified at" in str(e)
    assert e.record["kind"] == "checksum_mismatch" and e.record["lease"]["dtype"] == "float32"
    with sanitizer.sanitize():  # the retirement still happened: the lease is stale
        with pytest.raises(StaleBorrowError):
            w.sum()


def test_mismatch_is_recorded_with_halt_on_error_0():
    buf = StagingBuffer(4096, name="r")
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        a = buf.write(0, torch.arange(8.0), name="a")  # still held by the consumer
        buf.tensor.numpy()[0] ^= 1  # numpy write into the lent bytes, one bit
        buf.reuse(0, 32, by="b")
    kinds = [e["kind"] for e in sanitizer.errors()]
    assert kinds == ["checksum_mismatch"]
    del a


def test_verify_checks_bytes_staleness_and_types():
    buf = StagingBuffer(4096, name="r")
    with sanitizer.sanitize(checksum=1):
        a = buf.write(0, torch.arange(8.0), name="a")
        b = buf.write(64, torch.arange(8.0), name="b")
        sanitizer.verify(a, b[2:], torch.zeros(3))  # unchanged leases and an owned tensor: fine
        buf.tensor.numpy()[64 + 4] = 7
        with pytest.raises(BorrowCorruptedError, match="'b' float32\\[8\\].*checked at verify"):
            sanitizer.verify(b)
        buf.reuse(0, 8, by="c")
        with pytest.raises(StaleBorrowError, match="in sanitizer.verify"):
            sanitizer.verify(a)
        with pytest.raises(TypeError, match="verify expects tensors"):
            sanitizer.verify([a])


def test_correct_ring_workload_is_bit_identical_and_silent_with_checksum_and_poison():
    def load() -> list:
        torch.manual_seed(1)
        ring = StagingRing(3000, name="ring")
        out = []
        for i in range(40):
            src = torch.randn(7 + i % 5, 13, dtype=torch.bfloat16)
            out.append(ring.put(f"w{i}", src).clone())
        return out

    plain = load()
    with sanitizer.sanitize(checksum=1, poison=1, quarantine=2):
        checked = load()
    assert sanitizer.errors() == []
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(plain, checked))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_poison_makes_stale_reads_through_numpy_read_nan(dtype):
    buf = StagingBuffer(4096, name="r")
    with sanitizer.sanitize(poison=1):
        w = buf.write(0, torch.ones(64, dtype=dtype), name="w")
        raw = buf.tensor.numpy()  # a path the dispatch mode cannot see
        buf.reuse(0, 16, by="next")  # overlaps the first 16 bytes only
        tail = torch.from_numpy(raw[16:64 * dtype.itemsize].copy()).view(dtype)
    assert torch.isnan(tail.float()).all()
    del w


def test_poison_never_touches_bytes_a_fresh_lease_still_covers():
    buf = StagingBuffer(4096, name="r")
    with sanitizer.sanitize(poison=1, poison_byte=0xAB):
        whole = buf.write(0, torch.arange(24, dtype=torch.float32), name="whole")  # [0, 96)
        head = buf.lend(0, (8,), torch.float32, name="head")  # [0, 32), lent later: fresh
        buf.reuse(32, 32, by="next")  # retires `whole` only; the producer will write [32, 64)
        assert torch.equal(head, torch.arange(8, dtype=torch.float32))  # untouched, readable
    raw = buf.tensor.numpy()
    assert (raw[64:96] == 0xAB).all()  # the rest of the retired lease: poison
    assert np.array_equal(raw[32:64].view(np.float32), np.arange(8, 16, dtype=np.float32))  # left to the producer
    del whole


def test_bad_poison_byte_is_refused_by_name():
    with pytest.raises(sanitizer.OptionError, match="poison_byte.*256"):
        sanitizer.enable(poison_byte=256)


def test_quarantine_retires_at_the_next_put_and_keeps_regions_out_of_reuse():
    with sanitizer.sanitize(poison=1):
        ring = StagingRing(1024, name="q", quarantine=2)
        a = ring.put("a", torch.ones(64))  # 256 bytes at 0
        assert not sanitizer.lease_of(a).stale
        b = ring.put("b", torch.ones(64))  # retires a
        event = sanitizer.lease_of(a).stale_by
        assert event.kind == "retire" and "retired bytes [0x0, 0x100) when 'b' was put" in event.describe()
        c = ring.put("c", torch.ones(64))  # retires b
        d = ring.put("d", torch.ones(64))  # retires c; a leaves quarantine (N=2)
        offsets = [sanitizer.lease_of(t).start for t in (a, b, c, d)]
        assert offsets == [0, 256, 512, 768]
        e = ring.put("e", torch.ones(64))  # wraps: a's bytes (out of quarantine) are reused, not b's or c's
        assert sanitizer.lease_of(e).start == 0
        raw = ring.buffer.tensor.numpy()
        assert np.isnan(raw[256:768].view(np.float32)).all()  # b and c: quarantined and poisoned
        with pytest.raises(StaleBorrowError, match="'b' float32\\[64\\] used after staging buffer 'q' retired"):
            b.sum()


def test_quarantine_grows_the_ring_rather_than_reuse_quarantined_bytes():
    ring = StagingRing(512, name="g", quarantine=4)
    views = [ring.put(f"t{i}", torch.full((64,), float(i))) for i in range(4)]  # 4 x 256 bytes
    assert len(ring.segments) >= 2 and ring.nbytes >= 1024
    spans = {(sanitizer.lease_of(v).region_name, sanitizer.lease_of(v).start) for v in views}
    assert len(spans) == 4  # no two tensors share bytes while quarantined
    assert all(float(v[0]) == i for i, v in enumerate(views))  # never overwritten: values intact


@pytest.mark.slow
def test_numba_is_imported_only_when_a_check_runs_and_no_machine_code_is_stored(tmp_path):
    """Off: neither numba nor llvmlite. The first process with checksums (an empty cache) loads numba and
    stores the serial hash as machine code; the next one hashes with that code and never imports numba."""
    code = (
        "import sys, torch, sanitizer\n"
        "b = sanitizer.StagingBuffer(1024)\n"
        "sanitizer.enable()\n"
        "w = b.write(0, torch.arange(16.0), name='w'); b.reuse(0, 16)\n"
        "print('numba' in sys.modules, 'llvmlite' in sys.modules)\n"
        "sanitizer.enable(checksum=1)\n"
        "w = b.write(0, torch.arange(16.0), name='w')\n"
        "print('numba' in sys.modules, sanitizer.lease_of(w).checksum)\n"
    )
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    first = run_python(code, env)
    assert first.returncode == 0, first.stderr
    second = run_python(code, env)
    assert second.returncode == 0, second.stderr
    (off1, on1), (off2, on2) = ([line.split() for line in p.stdout.splitlines()] for p in (first, second))
    assert off1 == off2 == ["False", "False"]
    assert on1[0] == "True" and on2[0] == "False"
    assert on1[1] == on2[1]  # the same hash from numba's kernel and from the stored code
    assert list((tmp_path / "machine_code").glob("cpu_hash-*.json"))


def test_leases_that_die_fresh_drop_their_checksum_with_them():
    buf = StagingBuffer(4096)
    with sanitizer.sanitize(checksum=1):
        w = buf.write(0, torch.ones(4), name="w")
        lease = sanitizer.lease_of(w)
        assert isinstance(lease.checksum, int)
        del w
        gc.collect()
        assert not lease.alive
        buf.write(0, torch.zeros(4), name="next")  # no victim, nothing to verify, no false alarm
    assert sanitizer.errors() == []
