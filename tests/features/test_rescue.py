"""rescue=1: a retained lease is moved onto owned memory before its bytes are reused."""
from __future__ import annotations

import gc

import pytest
import torch

import sanitizer
from sanitizer.features import rescue
from sanitizer.torch_layer import records, runtime
from sanitizer.torch_layer.state import state
from conftest import run_python


@pytest.fixture(autouse=True)
def _fresh():
    rescue.clear()
    sanitizer.reset_stats()  # conftest collected the previous test's garbage
    yield
    rescue.clear()


def _overwrite(buf: sanitizer.StagingBuffer, offset: int = 0, n: int = 64) -> None:
    buf.write(offset, torch.full((n,), -7.0), name="the next tensor")


def test_retained_derived_view_keeps_its_data_after_reuse():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(rescue=1):
        w = buf.write(0, torch.arange(64, dtype=torch.float32).reshape(8, 8), name="layers.0.q_proj.weight")
        kept = w.t()[2:5]  # a derived view: it must follow the lease onto the copy
        expected = kept.clone()
        del w
        _overwrite(buf)
        assert torch.equal(buf.tensor[:256].view(torch.float32), torch.full((64,), -7.0))  # the bytes were reused
        assert torch.equal(kept, expected)  # ... yet the retained view still reads its weights
        assert kept.sum().item() == expected.sum().item()  # no StaleBorrowError: it is owned now
    assert sanitizer.lease_of(kept) is None and not sanitizer.is_borrowed(kept)
    assert sanitizer.errors() == []
    (rec,) = sanitizer.rescues()
    assert rec["kind"] == "rescue" and rec["rescued"] is True
    assert rec["lease"]["name"] == "layers.0.q_proj.weight" and rec["lease"]["rescued"] is True
    assert rec["lease"]["lent_at"] and rec["lease"]["lent_at"][0]["file"].endswith("test_rescue.py")
    assert rec["event"]["by"] == "the next tensor"
    assert rec["holders"] >= 1 and rec["nbytes"] == 256
    assert rec in records.events()
    st = sanitizer.stats()
    assert st["copies_by_policy"] == {"rescue": 1} and st["owned_bytes"] == 256
    del kept, expected
    gc.collect()
    assert sanitizer.stats()["owned_bytes"] == 0  # the copy dies with the last retained view


def test_only_retained_views_are_copied():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(rescue=1):
        kept = buf.write(0, torch.ones(64), name="kept")
        buf.write(1024, torch.ones(64), name="dropped")  # nobody keeps it
        _overwrite(buf, 0)
        _overwrite(buf, 1024)
    assert [r["lease"]["name"] for r in sanitizer.rescues()] == ["kept"]
    assert torch.equal(kept, torch.ones(64))


def test_rescue_on_close():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(rescue=1):
        kept = buf.write(0, torch.arange(16, dtype=torch.float32), name="last")[4:]
        buf.close()
        assert torch.equal(kept, torch.arange(4, 16, dtype=torch.float32))
    (rec,) = sanitizer.rescues()
    assert rec["event"]["kind"] == "close"


def test_without_rescue_the_same_program_is_a_stale_use():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize():
        kept = buf.write(0, torch.ones(64), name="w")
        _overwrite(buf)
        with pytest.raises(sanitizer.StaleBorrowError):
            kept.sum()
    assert sanitizer.rescues() == []


def test_fallback_reports_only_when_private_apis_are_missing(monkeypatch):
    monkeypatch.setattr(rescue, "AVAILABLE", False)
    monkeypatch.setattr(rescue, "UNAVAILABLE_REASON", "simulated: no _swap_data_ptr_")
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(rescue=1):
        kept = buf.write(0, torch.ones(64), name="w")
        _overwrite(buf)
        (rec,) = sanitizer.rescues()
        assert rec["rescued"] is False and "simulated" in rec["reason"] and rec["lease"]["name"] == "w"
        with pytest.raises(sanitizer.StaleBorrowError):  # not rescued: detection still applies
            kept.sum()


def test_dead_leases_leave_no_trace_in_the_lookups():
    """Each lease is filed once (under its storage's address) and leaves with its death, rescued or not."""
    buf = sanitizer.StagingBuffer(1 << 16, name="ring0")
    with sanitizer.sanitize(rescue=1):
        leases = []
        kept = buf.write(0, torch.ones(16), name="kept")
        for i in range(300):
            v = buf.write((i % 8) * 1024, torch.ones(16), name=f"t{i}")
            leases.append(sanitizer.lease_of(v))
            del v  # each view dies at once
        assert not any(lease.alive for lease in leases) and state.ledger.live_count == 0
        assert [r["lease"]["name"] for r in sanitizer.rescues()] == ["kept"]  # rescued at the first reuse of its bytes
        assert sanitizer.lease_of(kept) is None  # owned now: no longer a borrow
        (lease,) = runtime._RESCUED.values()
        assert lease.rescued and lease.alive
        del kept
        assert not lease.alive and not runtime._RESCUED  # its end still reached, then forgotten


def test_a_lease_lent_before_enable_is_rescued_and_guarded_when_retired_after():
    """The runtime keeps a weak handle on every lease's storage, lent while the sanitizer was off too."""
    buf = sanitizer.StagingBuffer(4096, name="early")
    kept = buf.write(0, torch.arange(16, dtype=torch.float32), name="w")  # lent while off
    with sanitizer.sanitize(rescue=1):
        _overwrite(buf)
        assert torch.equal(kept, torch.arange(16, dtype=torch.float32))  # rescued: still its own bytes
    guarded = buf.write(1024, torch.arange(16, dtype=torch.float32), name="g")  # lent while off
    with sanitizer.sanitize():
        _overwrite(buf, 1024)
    assert torch.isnan(torch.from_numpy(guarded.numpy())).all()  # tombstoned: poison, never the next tensor's -7.0


@pytest.mark.slow
def test_off_means_no_rescue_hook():
    code = ("import sanitizer, sanitizer.torch_layer.hooks as h, sanitizer.features.rescue as s\n"
            "print(any(f is s._on_retire for _, f in h.HOOKS.retire))\n"
            "sanitizer.enable()\n"
            "print(any(f is s._on_retire for _, f in h.HOOKS.retire))\n"
            "sanitizer.enable(rescue=1)\n"
            "print(any(f is s._on_retire for _, f in h.HOOKS.retire))\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False", "True"]


@pytest.mark.slow
def test_rescue_from_the_environment():
    code = ("import torch, sanitizer\n"
            "buf = sanitizer.StagingBuffer(4096)\n"
            "kept = buf.write(0, torch.ones(8), name='w')\n"
            "buf.write(0, torch.zeros(8), name='next')\n"
            "print(kept.sum().item(), len(sanitizer.rescues()))\n")
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "rescue=1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["8.0", "1"]
