"""The sanitizer's own tensor ops stay out of every dispatch mode's sight (sanitizer/torch_layer/own_ops.py):
a ring put pays no Python dispatch while a lease is stale, and a mode of the user's own sees the same ops
from a put with the sanitizer on as with it off."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sanitizer
from sanitizer.torch_layer import mode as mode_module


class _Counting(TorchDispatchMode):
    """The user's own mode: records every op it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_ring_put_runs_no_op_through_the_sanitizers_mode_while_a_lease_is_stale(monkeypatch):
    seen = []
    real = mode_module.BorrowCheckMode.__torch_dispatch__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(str(func))
        return real(self, func, types, args, kwargs)

    monkeypatch.setattr(mode_module.BorrowCheckMode, "__torch_dispatch__", counting)
    ring = StagingRingOfOne()
    with sanitizer.sanitize():
        kept = [ring.put(f"w{i}", torch.full((64,), float(i))) for i in range(3)]  # each put retires the last
        assert sanitizer.lease_of(kept[0]).stale
        sources = [torch.full((64,), float(i)) for i in range(3, 8)]
        seen.clear()
        for i, src in zip(range(3, 8), sources):
            kept.append(ring.put(f"w{i}", src))
        assert seen == []  # detach/view/slice/copy_/from_numpy of our own bytes: ~8 Python dispatches a put before
        assert kept[-1].tolist() == [7.0] * 64  # and the put still wrote what it was given
        with pytest.raises(sanitizer.StaleBorrowError):
            kept[0].sum()  # the user's own ops are still checked
    ring.close()


def StagingRingOfOne() -> sanitizer.StagingRing:
    return sanitizer.StagingRing(256, name="one")  # one 64-float tensor at a time: every put reuses the last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_users_own_mode_sees_the_same_ops_from_a_put_with_the_sanitizer_on_as_off(dtype):
    def ops_of_puts(on: bool) -> list:
        ring = StagingRingOfOne()
        user = _Counting()
        src = torch.arange(64).to(dtype)
        try:
            if on:
                sanitizer.enable()
            with user:
                a = ring.put("a", src)
                b = ring.put("b", src)  # retires a: the guard's tombstone, the triage hooks, the ledger
                total = b.float().sum().item()
            assert total == float(src.float().sum())
        finally:
            if on:
                sanitizer.disable()
            ring.close()
        del a
        return user.ops

    assert ops_of_puts(on=True) == ops_of_puts(on=False)


def test_a_stale_source_is_still_refused_before_the_write_when_it_is_not_contiguous():
    ring = sanitizer.StagingRing(1024, name="src")
    a = ring.put("a", torch.ones(16, 4))
    stale = a.t()  # not contiguous: preparing it copies (a read), which the mode must see
    for i in range(8):  # the ring wraps over a
        ring.put(f"fill{i}", torch.zeros(32))
    assert sanitizer.lease_of(a).stale
    other = sanitizer.StagingRing(1024, name="dst")
    with sanitizer.sanitize():
        with pytest.raises(sanitizer.StaleBorrowError):
            other.put("copy", stale)
    ring.close()
    other.close()
