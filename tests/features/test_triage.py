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
    triage.reset(records_too=True)
    holders.forget_patterns()
    for container in (_KEPT, _PENDING):
        container.clear()
    _REGISTRY.clear()
    yield
    triage.reset(records_too=True)
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


# -- issue 12: right (nothing missed, nothing invented), cheap, readable ----------------------------
def _ring_of_four(name: str = "ring4") -> sanitizer.StagingRing:
    return sanitizer.StagingRing(4096, name=name)  # 1 KiB tensors: each put reuses the bytes of the 4th before


def _keep_every_eighth(ring: sanitizer.StagingRing, n: int = 40) -> None:
    keep = None
    for i in range(n):
        w = ring.put(f"w{i}", torch.full((256,), float(i)))
        if i % 8 == 0:
            keep = w  # held across the reuse of its bytes (4 puts later) for 3 more turns, then dropped unread
    del keep


@pytest.mark.parametrize("rescue", [0, 1])
def test_a_view_held_three_turns_past_its_reuse_then_dropped_is_recorded(rescue):
    ring = _ring_of_four()
    with sanitizer.sanitize(triage=1, rescue=rescue, triage_budget_ms=10000):
        _keep_every_eighth(ring)
        rep = sanitizer.report(final=True)
    found = [e for e in rep["events"] if e["kind"] == "retention"]
    assert sorted(e["lease"]["name"] for e in found) == ["w0", "w16", "w24", "w32", "w8"], \
        [e["summary"] for e in found]
    assert {e["holder"]["path"] for e in found} == {"local 'keep' of _keep_every_eighth()"}
    assert all(e["used_stale"] is False and e["rescued"] is bool(rescue) for e in found)
    assert [e["walk"]["when"] for e in sorted(found, key=lambda e: e["lease"]["lease_id"])][:2] == [
        "walk", "known-path"]  # one heap walk; the frame's local is looked at directly after that


_OWNED = None


def _own_each(ring: sanitizer.StagingRing, n: int = 24) -> float:
    total = 0.0
    for i in range(n):
        w = ring.put(f"w{i}", torch.full((256,), float(i)))
        owned = w.float()  # a correct consumer: its own copy of every tensor
        total += float(owned[0])
    return total


def _own_each_into_a_global(ring: sanitizer.StagingRing, n: int = 24) -> None:
    global _OWNED
    for i in range(n):
        w = ring.put(f"w{i}", torch.full((256,), float(i)))
        _OWNED = w.float()


@pytest.mark.parametrize("consumer", [_own_each, _own_each_into_a_global])
def test_rescue_invents_no_retention_for_a_consumer_that_owns_each_tensor(consumer):
    from sanitizer.features import rescue

    rescue.clear()
    ring = _ring_of_four()
    with sanitizer.sanitize(triage=1, rescue=1, triage_budget_ms=10000):
        consumer(ring)
        rep = sanitizer.report(final=True)
    assert rep["summary"]["retentions"] == 0, [e["summary"] for e in rep["events"] if e["kind"] == "retention"]
    assert rep["error_count"] == 0
    rescue.clear()
    global _OWNED
    _OWNED = None  # float() of a float32 lease is the lease itself: do not keep it past the test


def test_a_rescued_lease_counts_as_held_only_while_something_holds_it():
    from sanitizer.features import rescue

    rescue.clear()
    ring = _ring_of_four()
    with sanitizer.sanitize(triage=1, rescue=1, triage_budget_ms=10000):
        _KEPT.append(ring.put("kept", torch.ones(256)))
        for i in range(8):
            w = ring.put(f"w{i}", torch.full((256,), float(i)))
        del w
        rep = sanitizer.report(final=True)
    (rec,) = [e for e in rep["events"] if e["kind"] == "retention"]
    assert rec["lease"]["name"] == "kept" and rec["rescued"] is True
    assert rec["holder"]["path"] == f"{__name__}._KEPT[0]"
    assert float(_KEPT[0].sum()) == 256.0  # rescued: its own bytes
    rescue.clear()


def test_a_rescued_retention_is_watched_by_its_liveness_and_its_death_mark_is_exact():
    """A rescue rebinds the lease's death to its owned copy: ``alive`` tells whether anyone still holds it,
    and the release hook notes its death at the generation it happened (no weak storage reference)."""
    from sanitizer.features import rescue

    rescue.clear()
    ring = _ring_of_four()
    with sanitizer.sanitize(triage=1, rescue=1, triage_budget_ms=10000):
        _KEPT.append(ring.put("kept", torch.ones(256)))
        for i in range(6):
            w = ring.put(f"w{i}", torch.full((256,), float(i)))
        del w
        (rec,) = sanitizer.retentions()
        assert rec["rescued"] is True and rec["holder"]["path"] == f"{__name__}._KEPT[0]"
        at = ring.buffer.generation
        _KEPT.clear()  # the copy's last view goes: the lease dies now
        for i in range(6, 9):
            ring.put(f"w{i}", torch.full((256,), float(i)))
        rep = sanitizer.report(final=True)
    (kept,) = [l for l in rep["timeline"]["leases"] if l["name"] == "kept"]
    assert kept["rescued"] is True and kept["retained"]["until"] == "death"
    assert kept["retained"]["generation"] == kept["retained"]["died_generation"] == at
    assert kept["retired_by"] == rec["event"]["event_id"]  # (the rescue cleared stale_by; the retention kept it)
    assert rep["summary"]["retentions"] == 1
    rescue.clear()


_HOOKS_SCRIPT = '''
import torch, sanitizer
from sanitizer.torch_layer import runtime
buf = sanitizer.StagingBuffer(4096, name="b")
w = buf.write(0, torch.ones(16), name="w")
buf.reuse(0, 64, by="x")
del w
from sanitizer.features import triage
assert not any(triage.installed_hooks().values())
sanitizer.enable(timeline_events=0)
hooks = triage.installed_hooks()
assert hooks["release"] and hooks["lend"] and hooks["stale_use"] and not hooks["reuse"]
sanitizer.enable(timeline_events=100)
assert triage.installed_hooks()["reuse"]
print("ok")
'''


@pytest.mark.slow
def test_the_release_and_reuse_hooks_are_installed_by_enable_and_not_before(tmp_path):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-c", _HOOKS_SCRIPT], cwd=str(tmp_path), env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@dataclass
class _LayerInfo:
    loaded_weights: list = field(default_factory=list)


def test_a_hundred_retentions_are_named_with_three_heap_walks_at_most(monkeypatch):
    """One LayerReloadingInfo per layer (a new root each time), as in vLLM: the first is walked, the rest of
    its layer follow the known path, each next layer's holder object is found as a sibling of the first (the
    same path from another instance of its class), and none is guessed from a neighbour."""
    walks = []
    real = triage.find_holders

    def counting(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triage, "find_holders", counting)
    sig = inspect.signature(weight_loader)
    infos = [_LayerInfo() for _ in range(10)]
    ring = sanitizer.StagingRing(16 * 4096, name="ring16")
    import time

    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        start = time.perf_counter()
        for i in range(116):
            w = ring.put(f"layers.{i // 10}.w{i % 10}", torch.full((1024,), float(i)))
            if i < 100:
                infos[i // 10].loaded_weights.append((f"w{i % 10}", sig.bind(torch.empty(1024), w)))
        del w
        rep = sanitizer.report(final=True)
        seconds = time.perf_counter() - start
    found = [e for e in rep["events"] if e["kind"] == "retention"]
    assert len(found) == 100
    assert {e["holder"]["consumer"] for e in found} == {"_LayerInfo.loaded_weights[*][*].arguments['loaded_weight']"}
    whens = [e["walk"]["when"] for e in found]
    assert len(walks) <= 3 and whens.count("walk") == len(walks), whens
    assert whens.count("known-path") >= 80 and whens.count("sibling") <= 9 and "counted" not in whens
    assert all(e["holder"]["path"].startswith("_LayerInfo.loaded_weights[") for e in found)
    assert found[1]["holder"]["path"] == "_LayerInfo.loaded_weights[1][1].arguments['loaded_weight']"
    assert seconds < 5.0, seconds  # 0.2-0.3 s on a 2-core machine: a walk is 50-150 ms, a known path ~0.1 ms


def test_the_error_text_names_the_holder_at_once():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage_budget_ms=10000):
        _KEPT.append(_lend(buf, "w"))
        _next(buf)
        with pytest.raises(sanitizer.StaleBorrowError) as info:
            _KEPT[0].sum()  # used before its consumer had another turn: confirmed by the use itself
    assert info.value.holder["path"] == f"{__name__}._KEPT[0]"
    assert f"held by global {__name__}._KEPT[0]" in str(info.value)


def test_triage_text_reads_stale_at_each_consumer_shows_the_sites_once_and_the_fix():
    from sanitizer.reporting.text import format_triage

    buf = sanitizer.StagingBuffer(4096, name="ring0")

    def lend_at(offset: int, name: str) -> torch.Tensor:
        return buf.write(offset, torch.full((16, 16), 3.0), name=name)

    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _KEPT.append(lend_at(0, "a"))
        _REGISTRY["b"] = lend_at(2048, "b")
        buf.write(0, torch.zeros(1024), name="next")  # reuses both
        for _ in range(3):
            _KEPT[0].sum()  # the same stale read, three records
        rep = sanitizer.report(final=True)
    text = format_triage(rep, "r.json")
    assert text.count("lent at lend_at") == 1 and "(all lent at lend_at" in text  # shared by both consumers: once
    assert f"read stale at {THIS_FILE}:{_line_of('for _ in range(3):') + 1} (1 of 1 view)" in text
    assert f"fix: own the tensor where {__name__}._KEPT[*] keeps it" in text
    assert text.count("stale_use: borrowed view 'a'") == 1  # each distinct error once


def test_triage_text_names_a_lease_name_that_repeats_in_one_row_once_with_its_count():
    from sanitizer.reporting.text import format_triage

    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for name in ["layers.0.w"] * 3 + ["other"]:  # one weight loaded three times, then another: all kept
            _KEPT.append(_lend(buf, name))
            _next(buf)
        rep = sanitizer.report(final=True)
    (row,) = [g for g in rep["summary"]["retaining_consumers"] if g["count"] == 4]
    assert sorted(row["leases"]) == ["layers.0.w"] * 3 + ["other"]  # the report keeps every lease's name
    rows = [line.strip() for line in format_triage(rep, "r.json").splitlines() if line.strip().startswith("leases:")]
    assert rows == ["leases: 'layers.0.w' (3 leases), 'other'"], rows


_RETAINING_SCRIPT = '''
import torch, sanitizer
KEPT = []
ring = sanitizer.StagingRing(4096, name="ring")
for i in range(12):
    w = ring.put(f"w{i}", torch.full((256,), float(i)))
    if i % 4 == 0:
        KEPT.append(w)  # retained past the reuse of its bytes, never read: a retention, no error
print("done")
'''


@pytest.mark.slow
def test_ownsan_run_fails_on_retentions_alone_unless_told_not_to(tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "keep.py").write_text(_RETAINING_SCRIPT)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "sanitizer", "run", "-q", *extra, "--", sys.executable,
                               "keep.py"], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180)

    out = run()
    assert out.returncode == 1, out.stderr
    assert "0 errors; 2 retentions by 1 consumer" in out.stderr and "done" in out.stdout
    out = run("-o", "fail_on_retention=0", "-o", "report=kept.json")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "kept.json").exists()


class _TwoPlaces:
    """Keeps each weight in a list and in a deferred call: two consumers hold one view."""

    def __init__(self) -> None:
        self.weights: list = []
        self.todo: list = []

    def apply(self, w: torch.Tensor) -> torch.Tensor:
        return w.sum()

    def load(self, ring: sanitizer.StagingRing, n: int) -> None:
        for i in range(n):
            w = ring.put(f"layers.{i}.w", torch.full((64,), float(i)))
            self.weights.append(w)  # STORE-IN-LIST
            self.todo.append(functools.partial(self.apply, w))  # STORE-IN-PARTIAL


def _line_of(marker: str) -> int:
    with open(THIS_FILE, encoding="utf-8") as fh:
        return next(i for i, text in enumerate(fh, 1) if marker in text and "def _line_of" not in text
                    and "_line_of(" not in text)


def test_every_holder_of_a_view_is_named_at_the_line_that_stored_it():
    model = _TwoPlaces()
    ring = sanitizer.StagingRing(1024, name="two")
    with sanitizer.sanitize(triage=1):
        model.load(ring, 8)
        rep = sanitizer.report(final=True)
    groups = {g["consumer"]: g for g in rep["summary"]["retaining_consumers"]}
    assert set(groups) == {"_TwoPlaces.weights[*]", "partial(_TwoPlaces.apply).args[*]"}
    # Each retention counts once (the counts add up to the retentions), for the same holder every time;
    # the other consumer holding the same views is listed beside it, with what it was seen holding (a
    # new partial per view is a new root, which only a heap walk finds: the first view's walk found it).
    assert groups["_TwoPlaces.weights[*]"]["count"] == 4 and groups["_TwoPlaces.weights[*]"]["also_held"] == 0
    assert groups["partial(_TwoPlaces.apply).args[*]"]["count"] == 0
    assert groups["partial(_TwoPlaces.apply).args[*]"]["also_held"] >= 1
    assert sum(g["count"] for g in groups.values()) == rep["summary"]["retentions"] == 4
    assert "4 retentions by 1 consumer" in rep["summary"]["line"] and "1 more holding the same views" in rep["summary"]["line"]
    list_line, partial_line = _line_of("# STORE-IN-LIST"), _line_of("# STORE-IN-PARTIAL")
    assert groups["_TwoPlaces.weights[*]"]["stored_at"] == f"{THIS_FILE}:{list_line}"
    assert groups["partial(_TwoPlaces.apply).args[*]"]["stored_at"] == f"{THIS_FILE}:{partial_line}"
    assert f":{list_line})" in groups["_TwoPlaces.weights[*]"]["fix"]  # the fix points at the storing line
    assert rep["summary"]["retained_bytes"] == 4 * 256  # each view once, however many consumers hold it
    with sanitizer.sanitize():
        with pytest.raises(sanitizer.StaleBorrowError) as info:
            model.weights[0].sum()
    text = str(info.value)
    assert "also held by" in text and f"stored at _TwoPlaces.load {THIS_FILE}:" in text
    assert f"fix: own the tensor where" in text


def _keep(t):
    """Keep ``t`` in _KEPT, which the lending loop's code does not name: found by a walk, not at the reuse."""
    _KEPT.append(t)


def test_a_settle_names_a_whole_consumers_retentions_in_one_walk(monkeypatch):
    walks = []
    real = triage.find_holders

    def counting(keys, **kwargs):
        walks.append(len(keys))
        return real(keys, **kwargs)

    monkeypatch.setattr(triage, "find_holders", counting)
    buf = sanitizer.StagingBuffer(1 << 16, name="batch")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for i in range(40):
            _keep(buf.write(0, torch.full((16,), float(i)), name=f"t{i}"))  # each reuse retires the last
        triage.settle(final=True)
        rets = sanitizer.retentions()
    assert len(rets) == 39
    assert sum(walks) >= 1 and len(walks) <= 4  # the first few walked one by one at most, the rest together
    assert all(r["holder"]["consumer"] == f"{__name__}._KEPT[*]" for r in rets)


def test_other_entries_of_the_same_dict_are_not_named_as_also_holding_a_view():
    """runai's own suite: ``our[name] = tensor`` for names that differ by more than digits
    ('tensor1.bfloat16', 'tensor1.int64'): each view is held by its own entry, and the report must not
    say it is "also held by" the entries of the others (they hold other tensors)."""
    buf = sanitizer.StagingBuffer(4096, name="ring-dtypes")
    our = {}
    names = ["tensor1.bfloat16", "tensor1.int64", "tensor2.float32", "tensor3.bfloat16", "tensor3.int64",
             "tensor4.float32"]
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for name in names:
            our[name] = _lend(buf, name)
            _next(buf, f"after {name}")
        rep = sanitizer.report(final=True)
    retained = [e for e in rep["events"] if e.get("kind") == "retention"]
    assert len(retained) == len(names)
    for event, name in zip(retained, names):
        assert f"'{name}'" in event["summary"]
        holder = event["holder"]
        assert holder["path"].endswith(f"[{name!r}]"), (name, holder["path"])
        assert [o["path"] for o in holder.get("also", [])] == [], name  # nothing else holds this view
    del our


@pytest.fixture
def frozen_heap():
    """The heap frozen as an engine freezes it after warm-up (vLLM's ``freeze_gc_heap``, SGLang's
    ``freeze_gc``): everything alive now moves to gc's permanent generation, which ``gc.get_referrers``
    never scans. Unfrozen after the test (the session's objects go back to the oldest generation; on 3.12+
    the interpreter's own startup freeze with them: harmless in a test session)."""
    _REGISTRY["made before the freeze"] = [torch.zeros(1)]  # the dict is tracked, hence frozen with the rest
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def test_the_interpreters_own_startup_freeze_is_not_the_programs():
    """CPython 3.12+ starts with a few hundred objects of its own frozen: taken for the program's freeze,
    every walk paid the pass over the heap (~0.8 s) for nothing (the 3.12 CI run crawled)."""
    from sanitizer.features.frozen_heap import FrozenHeap

    assert not FrozenHeap.present(), gc.get_freeze_count()


def test_a_holder_built_before_the_programs_gc_freeze_is_still_named(frozen_heap):
    """A view kept in a container the program built before it froze its heap: the walk climbed only
    what gc.get_referrers sees and said "held where Python cannot see"; the frozen objects are found by
    reachability, and the walk leaves the collector as the program set it."""
    from sanitizer.features.frozen_heap import FrozenHeap

    assert FrozenHeap.present()  # (beyond the interpreter's own startup freeze, 3.12+)
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    young = [object()]  # made after the freeze: it stays in a collected generation
    frozen_before = gc.get_freeze_count()
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _REGISTRY["layer0"] = [torch.zeros(1), _lend(buf, "w")]
        _next(buf)
        rec = _only_retention()
    assert rec["holder"]["path"] == f"{__name__}._REGISTRY['layer0'][1]", rec["holder"]
    assert rec["holder"]["kind"] == "global"
    assert 0 < gc.get_freeze_count() <= frozen_before  # nothing frozen or unfrozen by the walk (some died)
    assert any(o is young for o in gc.get_objects())



class _Runner:
    def __init__(self):
        self.model = torch.nn.Linear(4, 4)  # (tracked: the object and its dict are frozen with the rest)
        self.extra = {}


def test_a_holder_only_a_running_function_reaches_after_the_freeze_is_named_once(frozen_heap):
    """The model built in ``main()`` before the freeze: a running frame's local is its only referrer, no
    module and no collected object reaches it. The walk named the holder through the young dict, and said
    "held where Python cannot see" beside it for the path it could not climb (a blind user's case)."""
    gc.unfreeze()
    runner = _Runner()
    gc.freeze()
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        runner.extra["w"] = _lend(buf, "w")
        _next(buf)
        rec = _only_retention()
        rep = sanitizer.report(final=True)
    assert rec["holder"]["path"] == "_Runner.extra['w']", rec["holder"]
    kinds = [g["kind"] for g in rep["summary"]["retaining_consumers"]]
    assert kinds == ["object"], rep["summary"]["retaining_consumers"]
