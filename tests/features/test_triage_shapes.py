"""Triage's cost is linear in what is kept, whatever keeps it (issue 47, point 1).

A ring's victim is the view it lent a whole ring ago: far behind the newest entries of a list that keeps every
view, which were all a replay of a known holder path used to try. Every such retention paid a heap walk (400 s
for 5,000 views kept in a plain list). Each shape here keeps views a whole ring old; a heap walk may be paid
once per holder, never per retention, and each retention is named at the entry that holds that very view.
"""
from __future__ import annotations

import functools

import pytest
import torch

import sanitizer
from sanitizer.features import holders, triage

RING_VIEWS = 96  # views of 1 KiB in the ring: each victim is 96 puts old, past the replay's window of 64
PUTS = 240


def _load(w):
    return w


class _Keeper:
    def __init__(self) -> None:
        self.kept: list = []


MODULE_LIST: list = []
MODULE_DICT: dict = {}
NESTED: dict = {"layer": []}
DEFERRED: list = []
KEEPER = _Keeper()


def _clear() -> None:
    for container in (MODULE_LIST, NESTED["layer"], DEFERRED, KEEPER.kept):
        container.clear()
    MODULE_DICT.clear()


@pytest.fixture(autouse=True)
def _nothing_kept_after():
    """The views kept here would stay stale, and keep interception on, in the tests that follow."""
    yield
    _clear()
    holders.forget_patterns()  # (what is left of ours dies in the conftest's collection after this)


def _run(shape: str) -> dict:
    _clear()
    holders.forget_patterns()
    triage.reset(records_too=True)
    local: list = []
    expected = {}
    with sanitizer.sanitize(triage=1, halt_on_error=0, report="", max_records=PUTS + 16):
        ring = sanitizer.StagingRing(RING_VIEWS * 1024, name=f"shape-{shape}")
        for i in range(PUTS):
            name = f"layers.{i}.weight"
            t = ring.put(name, torch.full((256,), float(i)))
            if shape == "module list":
                MODULE_LIST.append(t)
                expected[name] = f"MODULE_LIST[{i}]"
            elif shape == "local list":
                local.append(t)
                expected[name] = f"local 'local' of _run()[{i}]"
            elif shape == "dict":
                MODULE_DICT[f"w{i}"] = t  # (keyed by another name than the lease's)
                expected[name] = f"MODULE_DICT['w{i}']"
            elif shape == "attribute list":
                KEEPER.kept.append(t)
                expected[name] = f"_Keeper.kept[{i}]"
            elif shape == "list in a dict":
                NESTED["layer"].append(t)
                expected[name] = f"NESTED['layer'][{i}]"
            else:
                DEFERRED.append(functools.partial(_load, t))
                expected[name] = "partial(_load).args[0]"
        del t
        events = triage.retentions()
        walks = sum(1 for e in events if "walk" in ((e.get("walk") or {}).get("when"), (e.get("walk") or {}).get("others")))
        misnamed = [(e["lease"]["name"], e["holder"]["path"]) for e in events
                    if expected[e["lease"]["name"]] not in e["holder"]["path"]]
        ring.close()
    local.clear()
    return {"retentions": len(events), "walks": walks, "misnamed": misnamed[:3]}


@pytest.mark.parametrize("shape", ["module list", "local list", "dict", "attribute list", "list in a dict",
                                   "partial per weight"])
def test_a_holder_is_walked_once_not_once_per_retention(shape):
    out = _run(shape)
    # at most one walk (the first retention of a consumer named at the reuse is walked once for its other holders)
    assert out["retentions"] == PUTS - RING_VIEWS and out["walks"] <= 1 and out["misnamed"] == [], out
