"""Exports of live borrowed memory (numpy, DLPack) are seen as they are made, and named when they outlive it."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from sanitizer.torch_layer import readers

_KEPT: list = []


@pytest.fixture(autouse=True)
def _forget_kept():
    yield
    _KEPT.clear()  # (the leftovers die in the conftest's collection, which runs when something of ours is left)


def _load(buf: StagingBuffer, export, n: int = 4) -> None:
    """A consumer that keeps an alias of each weight, not the weight: what the mode and the guard cannot see."""
    for i in range(n):
        w = buf.write((i % 2) * 256, torch.full((16,), float(i)), name=f"layers.{i}.w")
        _KEPT.append(export(w))
        del w


EXPORTS = {
    "t.numpy()": lambda w: w.numpy(),
    "np.asarray(t)": lambda w: np.asarray(w),
    "torch.from_numpy(t.numpy())": lambda w: torch.from_numpy(w.numpy()),
    "torch.from_dlpack(t)": lambda w: torch.from_dlpack(w),
    "np.from_dlpack(t)": lambda w: np.from_dlpack(w),
    "memoryview(t.numpy())": lambda w: memoryview(w.numpy()),
    "torch.frombuffer(t.numpy())": lambda w: torch.frombuffer(w.numpy(), dtype=torch.float32),
}


@pytest.mark.parametrize("export", sorted(EXPORTS))
def test_an_alias_that_outlives_its_lease_is_a_retention_named_with_where_it_was_made(export):
    buf = StagingBuffer(1024, name="ring")
    with sanitizer.sanitize(triage=1):
        _load(buf, EXPORTS[export])
        assert float(torch.as_tensor(np.asarray(_KEPT[0]))[0]) == 2.0  # unsanitized truth: the next tensor's bytes
        rets = sanitizer.retentions()
    assert rets, "an alias of reused staging bytes went unreported"
    first = rets[0]
    assert first["aliases"] and first["aliases"][0]["made_at"]["file"] == __file__
    assert "exported as a" in first["summary"] and "not checked" in first["summary"]


def test_the_walk_names_the_holder_of_a_numpy_alias():
    buf = StagingBuffer(1024, name="ring")
    with sanitizer.sanitize(triage=1):
        _load(buf, lambda w: w.numpy())
        (held, *_) = sanitizer.retentions()
    assert held["holder"]["path"].startswith(f"{__name__}._KEPT[") and "numpy alias" in held["holder"]["path"]


def test_a_stale_use_of_an_exported_lease_says_the_alias_is_unchecked():
    buf = StagingBuffer(1024, name="ring")
    cache = {}
    with sanitizer.sanitize():
        cache["w"] = buf.write(0, torch.ones(16), name="w")
        cache["a"] = cache["w"].numpy()
        buf.write(0, torch.zeros(16), name="next")
        buf.write(512, torch.zeros(16), name="after")  # the consumer had its turn
        with pytest.raises(StaleBorrowError) as info:
            cache["w"].sum()
    assert "exported as a numpy alias while lent at" in str(info.value)


def test_rescue_says_which_aliases_it_could_not_rescue():
    buf = StagingBuffer(1024, name="ring")
    with sanitizer.sanitize(rescue=1):
        w = buf.write(0, torch.ones(16), name="w")
        alias = w.numpy()
        buf.write(0, torch.zeros(16), name="next")
        assert float(w[0]) == 1.0 and alias[0] == 0.0  # the view was rescued, the alias reads the next tensor
        (rec,) = sanitizer.rescues()
    assert [a["kind"] for a in rec["aliases_not_rescued"]] == ["numpy"]


def test_an_alias_used_within_its_step_is_no_retention():
    buf = StagingBuffer(1024, name="ring")
    sums = []
    with sanitizer.sanitize(triage=1):
        for i in range(6):
            w = buf.write((i % 2) * 256, torch.full((16,), float(i)), name=f"layers.{i}.w")
            a = w.numpy()  # a loop variable: held until the next turn, then dropped
            sums.append(float(a.sum()))
            kept = np.asarray(w).copy()  # an owned copy: fine to keep
            _KEPT.append(kept)
        assert sanitizer.retentions() == [] and sanitizer.errors() == []
    assert sums == [16.0 * i for i in range(6)]


def test_exports_are_watched_only_while_enabled_from_the_first_lease_until_no_buffer_is_left():
    buf = StagingBuffer(1024, name="ring")
    assert not readers.noting()
    with sanitizer.sanitize():
        assert not readers.noting()  # no lease alive yet: nothing watched
        w = buf.write(0, torch.ones(4), name="w")
        assert readers.noting()
        del w
        gc.collect()
        assert readers.noting()  # the buffer lends again soon: kept (not rewrapped at every tensor)
        buf.close()
        assert not readers.noting()  # no buffer, no lease: the exporters are torch's own again
        other = StagingBuffer(64, name="other")
        v = other.write(0, torch.ones(4), name="v")
        assert readers.noting()
        del v, other
        gc.collect()  # a buffer forgotten (collected) ends it too
        assert not readers.noting()
    assert "numpy" not in torch.Tensor.__dict__
