"""Issue 29, point 5: holders the gc cannot show, and aliases with a storage of their own, are named.

A dict that holds only numpy arrays is not tracked by CPython's gc (nor is such a tuple), so a walk up
``gc.get_referrers`` never reaches it; a tensor from ``torch.from_dlpack(t)`` or
``torch.from_numpy(t.numpy())`` and an array from ``np.from_dlpack(t)`` have a storage of their own that
nothing on the Python side links back to the lease. Each read as "held where Python cannot see". On a
buffer whose leases cover the same bytes, each must be credited to its own lease's holder.
"""
from __future__ import annotations

import pytest
import gc

import numpy as np
import torch

import sanitizer
from sanitizer import StagingBuffer

CACHE = {}
PAIRS = []
DL = []
ARRAYS = []
FROM_NUMPY = []


def _consumer(buf: StagingBuffer) -> None:
    exports = [lambda w: CACHE.__setitem__("w", w.numpy()),  # an untracked dict of arrays
               lambda w: PAIRS.append((w.numpy(), "name")),  # an untracked tuple inside a list
               lambda w: DL.append(torch.from_dlpack(w)),
               lambda w: ARRAYS.append(np.from_dlpack(w)),
               lambda w: FROM_NUMPY.append(torch.from_numpy(w.numpy()))]
    for i, export in enumerate(exports):
        w = buf.write((i % 2) * 256, torch.full((16,), float(i)), name=f"layers.{i}.w")  # two offsets: shared bytes
        export(w)
        del w


@pytest.mark.slow
def test_each_hidden_holder_is_named_for_its_own_lease():
    buf = StagingBuffer(1024, name="ring")
    try:
        with sanitizer.sanitize(triage=1):
            _consumer(buf)
            gc.collect()  # untracks the tuple of an array and a string, as a long run's collections do
            assert not gc.is_tracked(CACHE) and not gc.is_tracked(PAIRS[0])
            buf.write(0, torch.zeros(16), name="x")
            buf.write(256, torch.zeros(16), name="y")
            named = {r["lease"]["name"]: (r.get("holder") or {}).get("path") for r in sanitizer.retentions()}
    finally:
        for kept in (PAIRS, DL, ARRAYS, FROM_NUMPY):
            kept.clear()
        CACHE.clear()
    assert named == {
        "layers.0.w": f"{__name__}.CACHE['w'] (a numpy alias of the view)",
        "layers.1.w": f"{__name__}.PAIRS[0][0] (a numpy alias of the view)",
        "layers.2.w": f"{__name__}.DL[0] (a dlpack alias of the view)",
        "layers.3.w": f"{__name__}.ARRAYS[0] (a dlpack alias of the view)",
        "layers.4.w": f"{__name__}.FROM_NUMPY[0] (a numpy alias of the view)",
    }, named


def test_a_maker_given_something_that_is_not_a_lease_is_left_alone():
    buf = StagingBuffer(1024, name="ring")
    with sanitizer.sanitize(triage=1):
        w = buf.write(0, torch.ones(16), name="w")
        plain = torch.from_numpy(np.ones(4, dtype=np.float32))  # no lease under it
        other = torch.from_dlpack(torch.arange(4.0))
        assert plain.sum().item() == 4.0 and other.sum().item() == 6.0 and w.sum().item() == 16.0
        del w
