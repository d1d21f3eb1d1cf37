"""Triage names the holder a user acts on (issue 47, point 2).

Each case is a shape a real consumer writes: accelerate's ``load_state_dict`` keeps ``get_tensor`` views in a
local dict and returns it after its loader closed; a checking loop leaves its variable on a cached view; a
view kept in two containers is read stale through one of them; a dict is filled at the line that lends.
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch

import sanitizer
from sanitizer.features import triage
from sanitizer.reporting.report import summarize
from sanitizer.reporting.text import format_triage

THIS_FILE = __file__


def _line_of(text: str) -> int:
    with open(THIS_FILE) as f:
        for i, line in enumerate(f, 1):
            if text in line and "_line_of(" not in line:
                return i
    raise AssertionError(text)


@pytest.fixture(autouse=True)
def _fresh(fresh_triage):
    yield  # (what is left of ours dies in the conftest's collection after this)


def load_state_dict(names):
    """accelerate's shape (utils/modeling.py, ``device_map`` given): views kept in a local dict, the loader
    closed, the dict returned."""
    ring = sanitizer.StagingRing(64 * 1024, name="ckpt")
    tensors = {}
    for name in names:
        tensors[name] = ring.put(name, torch.full((64,), float(len(name))))  # stores the view
    ring.close()
    return tensors


def test_a_returned_local_dict_is_named_at_its_storing_line_and_the_callers_copy_also():
    """The close comes while ``load_state_dict`` still runs: its local ``tensors`` at the storing line is the
    consumer (one, its keys wildcarded), the caller's ``sd`` is listed as also holding them, and the stale
    read, which came through ``sd``, is credited to ``sd``."""
    with sanitizer.sanitize(triage=1, halt_on_error=0, report=""):
        sd = load_state_dict(["a", "b", "c"])
        float(sd["a"].sum())
        rep = sanitizer.report(final=True)
    groups = rep["summary"]["retaining_consumers"]
    counted = [g for g in groups if g["count"]]
    assert len(counted) == 1, [g["consumer"] for g in groups]
    local = counted[0]
    assert local["consumer"] == "local 'tensors' of load_state_dict()[*]"
    assert local["count"] == 3 and local["stored_at"] == f"{THIS_FILE}:{_line_of('# stores the view')}"
    also = [g for g in groups if not g["count"]]
    assert [g["consumer"] for g in also] == [f"{__name__}.sd[*]"] or \
        [g["consumer"] for g in also] == ["local 'sd' of test_a_returned_local_dict_is_named_at_its_storing_line_and_the_callers_copy_also()[*]"]
    assert also[0]["also_held"] == 3
    assert local["used_stale"] == 0 and also[0]["used_stale"] == 1  # the read came through the caller's copy
    text = format_triage(rep, "r.json")
    assert "read stale at" in text and "(1 of 3 views)" in text
    del sd


def test_keys_that_are_the_leases_own_names_group_as_one_consumer():
    """``sd['a']``, ``sd['b']``: keys that are tensor names, short or not, are one consumer ``sd[*]``."""
    from sanitizer.features.holder import consumer_key

    assert consumer_key("__main__.sd['a']", "a") == "__main__.sd[*]"
    assert consumer_key("x.arguments['loaded_weight']", "layers.0.weight") == "x.arguments['loaded_weight']"
    assert consumer_key("__main__.sd['layers.3.weight']") == "__main__.sd[*]"


CACHE: dict = {}


def test_a_loop_variable_reading_cached_views_is_not_a_consumer():
    """Another thread's checking loop left ``old`` on the last cached view: it reads what the cache holds;
    the cache is the only consumer of that view."""
    ready, go = threading.Event(), threading.Event()

    def reader():
        for old in CACHE.values():
            float(old.sum())
        ready.set()
        go.wait(10)

    try:
        with sanitizer.sanitize(triage=1, halt_on_error=0, report=""):
            ring = sanitizer.StagingRing(4 * 1024, name="r")
            for i in range(4):
                CACHE[f"layers.{i}.weight"] = ring.put(f"layers.{i}.weight", torch.full((256,), float(i)))
            t = threading.Thread(target=reader)
            t.start()
            assert ready.wait(10)
            ring.close()
            triage.settle(final=True)
            found = {r["lease"]["name"]: [h["path"] for h in r["holders"]] for r in sanitizer.retentions()}
    finally:
        go.set()
        t.join()
        CACHE.clear()
    assert found == {f"layers.{i}.weight": [f"{__name__}.CACHE['layers.{i}.weight']"] for i in range(4)}


def _retention(name, holder, also=(), stale=False, at_read=None):
    h = {"kind": "global", "path": holder, "consumer": holder.split("[")[0] + "[*]", "site": None,
         "stored_at": None}
    if also:
        h["also"] = [{"kind": "global", "path": a, "consumer": a.split("[")[0] + "[*]", "site": None,
                      "stored_at": None} for a in also]
    e = {"kind": "retention", "lease": {"name": name, "nbytes": 4}, "holder": h, "used_stale": stale}
    if stale:
        e["read_stale_at"] = {"file": "f.py", "line": 9, "function": "g"}
    if at_read is not None:
        e["holder_at_read"] = {"kind": "global", "path": at_read, "consumer": at_read.split("[")[0] + "[*]"}
    return e


def test_each_example_path_names_a_lease_of_its_own_group():
    """A consumer first seen holding a view counted for another, then counted for its own: its example is a
    path to a view it is counted for, the one listed under it."""
    rep = {"events": [_retention("w0", "m.A[0]", also=["m.B[0]"]), _retention("w1", "m.B[1]")],
           "error_count": 0}
    groups = {g["consumer"]: g for g in summarize(rep)["retaining_consumers"]}
    assert groups["m.B[*]"]["holder"] == "m.B[1]" and groups["m.B[*]"]["leases"] == ["w1"]
    assert groups["m.A[*]"]["holder"] == "m.A[0]" and groups["m.A[*]"]["leases"] == ["w0"]


def test_a_stale_read_is_credited_to_the_holder_it_came_through():
    """Held by ``m.A`` (counted) and ``m.B`` (also), read stale through ``m.B``: ``m.B``'s read."""
    rep = {"events": [_retention("w0", "m.A[0]", also=["m.B[0]"], stale=True, at_read="m.B[0]"),
                      _retention("w1", "m.A[1]", also=["m.B[1]"], stale=True)],
           "error_count": 0}
    groups = {g["consumer"]: g for g in summarize(rep)["retaining_consumers"]}
    assert groups["m.A[*]"]["used_stale"] == 1 and groups["m.B[*]"]["used_stale"] == 1
    assert groups["m.B[*]"]["read_stale_at"] == ["f.py:9"]
    # named only at the read (a reading loop's variable): the reader; the read counts for the keeper
    rep = {"events": [_retention("w0", "m.A[0]", stale=True, at_read="m.call[0]")], "error_count": 0}
    groups = {g["consumer"]: g for g in summarize(rep)["retaining_consumers"]}
    assert list(groups) == ["m.A[*]"] and groups["m.A[*]"]["used_stale"] == 1


MODULE_CODE = """
import torch, sanitizer
sanitizer.enable(triage=1, halt_on_error=0)
ring = sanitizer.StagingRing(4 * 1024, name="r")
cache = {}
for i in range(4):
    cache[f"w.{i}"] = ring.put(f"w.{i}", torch.full((256,), float(i)))
for i in range(4, 8):
    cache[f"w.{i}"] = ring.put(f"w.{i}", torch.full((256,), float(i)))
import json
print(json.dumps([[r["holder"]["stored_at"], r["holder"].get("stored_candidates")] for r in sanitizer.retentions()]))
"""


@pytest.mark.slow
def test_module_level_store_at_the_lend_line_is_that_line(tmp_path):
    """Module-level code that lends inside the statement that stores (``cache[k] = ring.put(...)``) stored
    the view at that line, not "one of" every line storing into ``cache``."""
    import json
    import subprocess

    script = tmp_path / "load.py"
    script.write_text(MODULE_CODE)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    stored = json.loads(out.stdout.strip().splitlines()[-1])
    assert stored and all(at["line"] == 7 and not candidates for at, candidates in stored), stored


def _one_view_ring_retentions(fill, n):
    """The retention records of ``fill(ring, n)`` on a ring of one 4 KiB view, triage on, settled."""
    with sanitizer.sanitize(triage=1, halt_on_error=0, report=""):
        ring = sanitizer.StagingRing(4096, name="one")
        fill(ring, n)
        rep = sanitizer.report(final=True)
    return [e for e in rep["events"] if e["kind"] == "retention"]


def _keep_pairs(ring, n):
    pairs = []
    for i in range(n):
        w = ring.put(f"layers.{i}.weight", torch.full((1024,), float(i)))
        pairs.append((f"layers.{i}.weight", w))
    del w
    return len(pairs)  # the list dies here, before any later lend gives the last retention its turn


def test_a_view_a_running_functions_list_kept_across_the_reuse_is_a_retention_though_it_dies_first():
    """The last view put into a one-view ring is retired by the put after it while the function's local list
    still holds it; the function returns and the list dies before any later lend: held across the reuse of
    its bytes, so it is recorded (it was missing: a view that died before its turn read as a loop variable)."""
    rets = _one_view_ring_retentions(lambda ring, n: _keep_pairs(ring, n), 5)
    assert sorted(e["lease"]["name"] for e in rets) == [f"layers.{i}.weight" for i in range(4)]
    assert {e["holder"]["consumer"] for e in rets} == {"local 'pairs' of _keep_pairs()[*][*]"}


def make_replay(w):
    def replay():
        return float(w.sum())
    return replay


HOOKS: dict = {}


def _hook_each(ring, n):
    for i in range(n):
        w = ring.put(f"layers.{i}.weight", torch.full((1024,), float(i)))
        HOOKS[f"layers.{i}.weight"] = make_replay(w)  # builds the closure


def test_a_closure_per_weight_is_stored_where_its_factory_was_called():
    """A closure made by a factory keeps the view from the call that built it: the fix goes there
    (``make_replay(sanitizer.own(w))``), not at the line that lent ``w``."""
    try:
        rets = _one_view_ring_retentions(_hook_each, 4)
    finally:
        HOOKS.clear()
    assert len(rets) == 3
    closures = [h for e in rets for h in [e["holder"], *e["holder"].get("also", ())] if h["kind"] == "closure"]
    assert closures and all(h["stored_at"]["line"] == _line_of("# builds the closure") for h in closures), closures


def _set_parameters(ring, model):
    Parameter = torch.nn.Parameter
    w = ring.put("0.weight", torch.full((8, 8), 1.0))
    setattr(model[0], "weight", Parameter(w, requires_grad=False))  # SET-0
    w = ring.put("1.weight", torch.full((8, 8), 2.0))
    model[1].register_parameter("weight", Parameter(w, requires_grad=False))  # SET-1
    w = ring.put("2.weight", torch.full((8, 8), 3.0))
    model.load_state_dict({"2.weight": w}, strict=False, assign=True)  # SET-2
    ring.put("tail", torch.zeros(8, 8))


def test_a_parameter_is_stored_by_the_statement_after_its_lend_whatever_its_kind():
    """Parameters set by setattr, register_parameter and load_state_dict(assign=True) one after another:
    each view was stored by the first such statement after its lend, never by one before it; only a
    choice between statements that both follow the lend is left open."""
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8, bias=False) for _ in range(3)))
    with sanitizer.sanitize(triage=1, halt_on_error=0, report=""):
        ring = sanitizer.StagingRing(8 * 8 * 4, name="one")
        _set_parameters(ring, model)
        rep = sanitizer.report(final=True)
    stored = {e["lease"]["name"]: e["holder"] for e in rep["events"] if e["kind"] == "retention"}
    assert set(stored) == {"0.weight", "1.weight", "2.weight"}
    assert stored["1.weight"]["stored_at"]["line"] == _line_of("# SET-1") and not stored["1.weight"].get("stored_candidates")
    assert stored["2.weight"]["stored_at"]["line"] == _line_of("# SET-2") and not stored["2.weight"].get("stored_candidates")
    assert stored["0.weight"]["stored_at"]["line"] == _line_of("# SET-0")
    assert _line_of("# SET-2") in {c["line"] for c in stored["0.weight"].get("stored_candidates") or ()}
    del model


THUNKS: list = []


def _apply(w):
    return float(w.sum())


def _hook_and_defer(ring, n):
    import functools

    for i in range(n):
        w = ring.put(f"layers.{i}.weight", torch.full((1024,), float(i)))
        HOOKS[f"layers.{i}.weight"] = make_replay(w)
        THUNKS.append(functools.partial(_apply, w))


def test_a_view_kept_by_a_closure_and_a_partial_per_weight_names_both_for_every_view():
    """Each view is kept by a closure (in a dict) and a partial (in a list): both consumers are named for
    every retention, those named through a learned container as well as the walked first one."""
    try:
        rets = _one_view_ring_retentions(_hook_and_defer, 8)
    finally:
        HOOKS.clear()
        THUNKS.clear()
    assert len(rets) == 7
    for e in rets:
        kinds = sorted(h["kind"] for h in e["holders"])
        assert kinds == ["closure", "partial"], (e["lease"]["name"], [h["path"] for h in e["holders"]])


EMBEDDING = {"kind": "object", "path": "Embedding.weight", "consumer": "Embedding.weight", "site": None}


def _counted_for(holder, at_read=EMBEDDING):
    """(consumer, count, stale reads) of each group of one retention held by ``holder`` at its reuse and
    through ``at_read`` at its stale read."""
    e = {"kind": "retention", "lease": {"name": "emb", "nbytes": 4}, "holder": holder, "used_stale": True,
         "holder_at_read": at_read, "read_stale_at": {"file": "m.py", "line": 3, "function": "f"}}
    return [(g["consumer"], g["count"], g["used_stale"])
            for g in summarize({"events": [e], "error_count": 1})["retaining_consumers"]]


def test_an_unnamed_retention_read_through_a_named_holder_is_counted_for_it():
    """The retention's holder was unknown (the walk found nothing nameable); at the stale read the view
    was held by ``Embedding.weight``: the table counts it there, as the error says."""
    unknown = {"kind": "unknown", "path": "<held where Python cannot see>", "consumer": "<held where Python cannot see>"}
    assert _counted_for(unknown) == [("Embedding.weight", 1, 1)]


def test_a_comprehension_or_standard_library_local_is_not_listed_beside_a_real_holder():
    """A running list comprehension's variable and a ``concurrent.futures`` work item carrying the view to
    its Future are in transit: listed only when nothing else holds the view."""
    from sanitizer.features.holder import Holder
    import concurrent.futures.thread as cft

    keeper = Holder("global", "m.KEPT[0]", {"file": "m.py", "line": 1, "function": "<module>"})
    comp = Holder("frame", "local 'x' of f.<locals>.<listcomp>()", {"file": "m.py", "line": 4,
                                                                     "function": "f.<locals>.<listcomp>"})
    work = Holder("frame", "local 'result' of _WorkItem.run()", {"file": cft.__file__, "line": 58,
                                                                 "function": "_WorkItem.run"})
    assert triage._by_consumer([work, comp, keeper]) == [keeper]
    assert triage._by_consumer([work]) == [work]


def _fill_elsewhere():
    tensors = {}
    tensors["x"] = torch.zeros(1)  # ANOTHER FUNCTION'S STORE
    return tensors


def _collect_from(views, n, done):
    tensors = {}
    for _ in range(n):
        name, view = views.get(timeout=30)
        tensors[name] = view  # COLLECT-STORE
    done.wait(30)
    tensors.clear()


def test_a_local_lent_on_another_thread_is_stored_by_a_statement_of_its_own_function():
    """The views are lent on a loader thread and kept in a local dict of the consumer's function, which is
    not on the lend stack: the storing line is searched in that function only, not in every function of
    the file that binds a local of the same name."""
    import queue

    views, done = queue.Queue(), threading.Event()
    with sanitizer.sanitize(triage=1, halt_on_error=0, report=""):
        ring = sanitizer.StagingRing(4096, name="one")
        consumer = threading.Thread(target=_collect_from, args=(views, 4, done))
        consumer.start()
        try:
            def lend():
                for i in range(4):
                    views.put((f"w{i}", ring.put(f"w{i}", torch.full((1024,), float(i)))))
            loader = threading.Thread(target=lend)
            loader.start()
            loader.join(30)
            ring.put("tail", torch.zeros(1024))
            rep = sanitizer.report(final=True)
        finally:
            done.set()
            consumer.join(30)
    holders = [e["holder"] for e in rep["events"] if e["kind"] == "retention"]
    assert holders and all(h["consumer"] == "local 'tensors' of _collect_from()[*]" for h in holders), holders
    assert all(h["stored_at"]["line"] == _line_of("# COLLECT-STORE") and not h.get("stored_candidates")
               for h in holders), holders


def test_a_loaders_bare_local_beside_the_parameter_it_was_wrapped_into_is_not_a_consumer():
    """Another thread's function still has ``param`` bound to the view it wrapped into a module's Parameter:
    a loop variable that handed the view on; the module is the consumer, listed alone."""
    ready, go = threading.Event(), threading.Event()
    model = torch.nn.Linear(32, 32, bias=False)

    def set_param(ring):
        param = ring.put("weight", torch.full((32, 32), 1.0))
        setattr(model, "weight", torch.nn.Parameter(param, requires_grad=False))  # SET-PARAM
        ready.set()
        go.wait(30)

    with sanitizer.sanitize(triage=1, halt_on_error=0, report=""):
        ring = sanitizer.StagingRing(32 * 32 * 4, name="one")
        t = threading.Thread(target=set_param, args=(ring,))
        t.start()
        try:
            assert ready.wait(30)
            ring.put("next", torch.zeros(32, 32))
            triage.settle(final=True)
            rets = sanitizer.retentions()
        finally:
            go.set()
            t.join(30)
    assert len(rets) == 1
    assert [h["path"] for h in rets[0]["holders"]] == ["Linear.weight"], rets[0]["holders"]
    del model


def test_a_retention_carried_by_a_future_at_the_reuse_is_counted_for_what_it_was_read_through():
    """A loader's thread pool: at the reuse the view was still a Future's result (timing decides), at the
    stale read it was the module's parameter: counted for the parameter, the same every run."""
    future = {"kind": "object", "path": "Renaming.collected[0][0]._result", "consumer": "Renaming.collected[*][*]._result"}
    assert _counted_for(future) == [("Embedding.weight", 1, 1)]
    bare = {"kind": "frame", "path": "local 'param' of convert()", "consumer": "local 'param' of convert()"}
    assert _counted_for(bare) == [("Embedding.weight", 1, 1)]
    two = dict(bare, also=[{"kind": "frame", "path": "local 'v' of set_param()", "consumer": "local 'v' of set_param()"}])
    assert _counted_for(two) == [("Embedding.weight", 1, 1)]
    # a function's local list held it at the reuse, the view went on into a parameter it was read through
    local = {"kind": "frame", "path": "local 'collected' of convert()[0][0]", "consumer": "local 'collected' of convert()[*][*]"}
    assert _counted_for(local) == [("Embedding.weight", 1, 1)]
    # ... but a returned local dict read through the caller's copy of it stays the local's
    sd = {"kind": "global", "path": "m.sd['emb']", "consumer": "m.sd[*]", "site": None}
    assert [c[:2] for c in _counted_for(local, sd)] == [("local 'collected' of convert()[*][*]", 1)]
    # and a worker's local list that also held it at that moment is not listed beside the parameter
    busy = dict(local, also=[{"kind": "frame", "path": "local 'tensors' of materialize()[0]", "consumer": "local 'tensors' of materialize()[*]"}])
    assert [c[0] for c in _counted_for(busy)] == ["Embedding.weight"]


KEPT_G: list = []
REG_G: dict = {}


def _keep_in_globals(ring, n):
    for i in range(n):
        w = ring.put(f"w{i}", torch.full((1024,), float(i)))
        if i % 2:
            KEPT_G.append(w)  # KEEP-IN-LIST
        else:
            REG_G[f"w{i}"] = w  # KEEP-IN-DICT


def test_module_level_containers_the_keeping_code_names_are_found_at_the_reuse():
    """``KEPT_G.append(w)``, ``REG_G[name] = w`` in the function that lends: the module's containers it names
    are looked in at the reuse, where each view is named; a heap walk only looks, once per consumer, for the
    other holders of its first view."""
    try:
        rets = _one_view_ring_retentions(_keep_in_globals, 6)
    finally:
        KEPT_G.clear()
        REG_G.clear()
    assert len(rets) == 5 and not any(e["walk"]["when"] == "walk" for e in rets), [e["walk"] for e in rets]
    assert sum(e["walk"].get("others") == "walk" for e in rets) <= 2, [e["walk"] for e in rets]
    for e in rets:
        i = int(e["lease"]["name"][1:])
        want = (f"{__name__}.KEPT_G[{i // 2}]", "# KEEP-IN-LIST") if i % 2 else (f"{__name__}.REG_G['w{i}']", "# KEEP-IN-DICT")
        assert e["holder"]["path"] == want[0] and e["holder"]["stored_at"]["line"] == _line_of(want[1]), e["holder"]
