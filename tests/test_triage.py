"""Retentions: a reuse retires a view that something still holds, and the report names the holder."""
from __future__ import annotations

import functools
import gc
import inspect
from dataclasses import dataclass, field

import pytest
import torch

import sanitizer
from sanitizer.features import holders
from sanitizer.features import triage

THIS_FILE = __file__.rstrip("c")
_KEPT: list = []
_REGISTRY: dict = {}
_PENDING: list = []


@pytest.fixture(autouse=True)
def _fresh_triage():
    triage.clear()
    holders.forget_patterns()
    for container in (_KEPT, _PENDING):
        container.clear()
    _REGISTRY.clear()
    yield
    triage.clear()
    for container in (_KEPT, _PENDING):
        container.clear()
    _REGISTRY.clear()


def _lend(buf: sanitizer.StagingBuffer, name: str) -> torch.Tensor:
    return buf.write(0, torch.full((16, 16), 3.0), name=name)


def _next(buf: sanitizer.StagingBuffer, name: str = "next") -> None:
    buf.write(0, torch.full((16, 16), -1.0), name=name)  # reuses the same bytes


def _only_retention() -> dict:
    sanitizer.report(final=True)  # a check point: decides pending retentions
    found = sanitizer.retentions()
    assert len(found) == 1, [r["summary"] for r in found]
    return found[0]


def _line_of(text: str) -> int:
    for i, line in enumerate(open(THIS_FILE, encoding="utf-8"), 1):
        if text in line:
            return i
    raise AssertionError(text)


def test_module_global_is_named():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _KEPT.append(_lend(buf, "layers.0.w"))
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["kind"] == "global"
    assert rec["holder"]["path"] == f"{__name__}._KEPT[0]"
    assert rec["holder"]["site"]["file"] == THIS_FILE and rec["holder"]["site"]["line"] == _line_of("_KEPT: list")
    assert rec["lease"]["name"] == "layers.0.w" and rec["event"]["by"] == "next"
    assert rec["lent_at"]["function"] == "_lend" and rec["reused_at"]["function"] == "_next"


@dataclass
class LayerReloadingInfo:
    loaded_weights: list = field(default_factory=list)


def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.copy_(loaded_weight)


def test_attribute_path_through_a_dataclass_and_bound_arguments_is_named():
    """The seed bug: vLLM's layerwise reload kept BoundArguments of deferred weight_loader calls."""
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    info = LayerReloadingInfo()
    sig = inspect.signature(weight_loader)
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for i in range(4):  # three owned placeholders first: the retained one is at index 3
            info.loaded_weights.append((f"p{i}", sig.bind(torch.zeros(1), torch.zeros(1))))
        info.loaded_weights.append(("w", sig.bind(torch.empty(16, 16), _lend(buf, "layers.0.q_proj.weight"))))
        info.loaded_weights[:] = info.loaded_weights[1:]  # now at index 3, as in the issue
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["kind"] == "object"
    assert rec["holder"]["path"] == "LayerReloadingInfo.loaded_weights[3][1].arguments['loaded_weight']"
    assert rec["holder"]["site"]["line"] == _line_of("class LayerReloadingInfo")
    assert rec["holder"]["consumer"] == "LayerReloadingInfo.loaded_weights[*][*].arguments['loaded_weight']"


def test_list_inside_a_dict_is_named():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _REGISTRY["layer0"] = [torch.zeros(1), _lend(buf, "w")]
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["path"] == f"{__name__}._REGISTRY['layer0'][1]"
    assert rec["holder"]["kind"] == "global"


def test_functools_partial_is_named():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _PENDING.append(functools.partial(weight_loader, torch.empty(16, 16), _lend(buf, "w")))
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["kind"] == "partial"
    assert rec["holder"]["path"] == "partial(weight_loader).args[1]"
    assert rec["holder"]["site"]["line"] == _line_of("def weight_loader(")


def _make_replay(w: torch.Tensor):
    def replay() -> float:
        return float(w.sum())

    return replay


def test_closure_is_named():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _PENDING.append(_make_replay(_lend(buf, "w")))
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["kind"] == "closure"
    assert rec["holder"]["path"] == "closure of _make_replay.<locals>.replay (variable 'w')"
    assert rec["holder"]["site"]["line"] == _line_of("def replay() -> float:")


def _keeper():
    kept = None
    while True:
        w = yield
        if kept is None:
            kept = w
        w = None


def test_generator_frame_is_named():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    gen = _keeper()
    next(gen)
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        gen.send(_lend(buf, "w"))
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["kind"] == "generator"
    assert rec["holder"]["path"] == "local 'kept' of generator _keeper()"
    assert rec["holder"]["site"]["file"] == THIS_FILE
    gen.close()


def _consumer_keeping_the_first(buf: sanitizer.StagingBuffer) -> dict:
    first = _lend(buf, "first")
    for i in range(3):  # the loader moves on; this frame still holds `first`
        _next(buf, f"next{i}")
    rec = _only_retention()
    del first
    return rec


def test_frame_local_is_named():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        rec = _consumer_keeping_the_first(buf)
    assert rec["holder"]["kind"] == "frame"
    assert rec["holder"]["path"] == "local 'first' of _consumer_keeping_the_first()"
    assert rec["holder"]["site"]["function"] == "_consumer_keeping_the_first"
    assert rec["lease"]["name"] == "first"


def test_loop_variable_of_a_correct_consumer_is_not_a_retention():
    """``for w in loader`` holds the previous view while the loader fetches the next: not a bug."""
    buf = sanitizer.StagingBuffer(4096, name="one-slot")

    def loader(n):
        for i in range(n):
            yield f"w{i}", _lend(buf, f"w{i}")

    acc = torch.zeros(16, 16)
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for _, w in loader(12):
            acc += w
        del w
        rep = sanitizer.report(final=True)
    assert rep["summary"]["retentions"] == 0 and rep["error_count"] == 0
    assert float(acc[0, 0]) == 36.0


def test_stale_use_error_names_the_holder_and_triage_does_not_raise():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _KEPT.append(_lend(buf, "w"))
        _next(buf)
        _KEPT[0].sum()  # recorded, not raised: triage=1
        rep = sanitizer.report(final=True)
    assert rep["error_count"] == 1
    assert rep["errors"][0]["holder"]["path"] == f"{__name__}._KEPT[0]"
    assert rep["events"][0]["used_stale"] is True
    assert rep["summary"]["retaining_consumers"][0]["used_stale"] == 1


def test_debug_mode_walks_too_and_still_raises():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize():
        _KEPT.append(_lend(buf, "w"))
        _next(buf)
        with pytest.raises(sanitizer.StaleBorrowError):
            _KEPT[0].sum()
        rec = _only_retention()
    assert rec["holder"]["path"] == f"{__name__}._KEPT[0]" and rec["used_stale"] is True


def test_budget_zero_records_the_retention_without_walking():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=0):
        _KEPT.append(_lend(buf, "w"))
        _next(buf)
        rec = _only_retention()
    assert rec["holder"] is None and rec["walk"]["when"] == "skipped"
    assert "could not name" in rec["summary"]


def test_off_records_nothing():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    _KEPT.append(_lend(buf, "w"))
    _next(buf)
    assert sanitizer.retentions() == [] and triage.pending_count() == 0


def test_the_walk_does_not_keep_a_rebound_local_alive():
    """Reading frame locals must not leave a snapshot that keeps the previous view alive."""
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        w = _lend(buf, "w")
        lease = sanitizer.lease_of(w)
        _next(buf)  # walks the stack while this frame holds `w`
        assert lease.alive
        w = None
        gc.collect()
        assert not lease.alive


def test_repeated_retentions_by_one_consumer_follow_the_known_path():
    """The second and later retentions of one consumer replay its path instead of walking the heap."""
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for i in range(6):
            _KEPT.append(_lend(buf, f"w{i}"))
        _next(buf)
        rep = sanitizer.report(final=True)
    paths = [e["holder"]["path"] for e in rep["events"]]
    assert paths == [f"{__name__}._KEPT[{i}]" for i in range(6)]
    group = rep["summary"]["retaining_consumers"]
    assert len(group) == 1 and group[0]["count"] == 6 and group[0]["bytes"] == 6 * 16 * 16 * 4
    assert group[0]["consumer"] == f"{__name__}._KEPT[*]"
    walked = holders.find_holders({sanitizer.lease_of(_KEPT[5]).handle})
    assert walked.replayed == 1 and walked.holders[sanitizer.lease_of(_KEPT[5]).handle][0].path.endswith("_KEPT[5]")


def test_the_walk_leaves_a_programs_own_locals_dict_alone():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        w = _lend(buf, "w")
        mine = locals()  # the program holds its frame's locals snapshot
        _next(buf)  # a walk reads this frame's locals
        assert mine["w"] is w and "buf" in mine
