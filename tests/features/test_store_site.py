"""Where a retained view was stored: the statement a fix must change (features/store_site.py)."""
from __future__ import annotations

import functools
import textwrap

import pytest
import torch

import sanitizer
from sanitizer.features import store_site, triage

SOURCE = textwrap.dedent('''
    import functools, torch

    class Info:
        def __init__(self):
            self.loaded = []          # BIND-LIST
            self.last = None

    def keep_in_list(info, w):
        info.loaded.append(w)         # STORE-APPEND

    def keep_direct(info, w):
        info.last = w                 # STORE-ATTR

    def keep_partial(todo, fn, w):
        todo.append(functools.partial(fn, w))   # STORE-PARTIAL

    def keep_in_dict(w):
        return {"w": w}               # not a store of a name

    CACHE = {}

    def keep_global(name, w):
        CACHE[name] = w               # STORE-ITEM
''')


@pytest.fixture
def module(tmp_path, monkeypatch):
    path = tmp_path / "consumer_mod.py"
    path.write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    store_site.forget()
    import importlib

    mod = importlib.import_module("consumer_mod")
    yield mod
    import sys

    sys.modules.pop("consumer_mod", None)


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(SOURCE.splitlines(), 1) if marker in text)


def _lend_site(fn):
    """A lend stack whose innermost user frame is inside ``fn`` (as a loader's consumer loop would be)."""
    code = fn.__code__
    return ((code, 0),)


@pytest.mark.parametrize("wanted, marker", [
    (("attr", "loaded", True), "STORE-APPEND"),  # a view inside Info.loaded[...]: the append, not the binding
    (("attr", "last", False), "STORE-ATTR"),     # a view held by Info.last itself: the assignment
    (("partial", "fn", False), "STORE-PARTIAL"),
    (("name", "CACHE", True), "STORE-ITEM"),
])
def test_the_storing_statement_is_found_in_the_consumers_code(module, wanted, marker):
    found = store_site.stored_at(wanted, (), {"file": module.__file__, "line": 1, "function": "Info"})
    assert found is not None and found["line"] == _line(marker) and found["file"] == module.__file__


def test_a_store_in_the_function_on_the_lend_stack_wins(module):
    found = store_site.stored_at(("attr", "loaded", True), _lend_site(module.keep_in_list))
    assert found == {"file": module.__file__, "line": _line("STORE-APPEND"), "function": "keep_in_list"}


def test_nothing_is_claimed_without_a_storing_statement(module):
    assert store_site.stored_at(("attr", "nowhere", True), (), {"file": module.__file__}) is None
    assert store_site.stored_at(None, ()) is None


_KEEP: list = []


class _Model:
    def __init__(self) -> None:
        self.weights: dict = {}

    def load(self, ring: sanitizer.StagingRing) -> None:
        for i in range(6):
            self.weights[f"w{i}"] = ring.put(f"layers.{i}.w", torch.full((64,), float(i)))  # MODEL-STORE


def test_a_retention_names_the_line_that_stored_the_view():
    triage.reset(records_too=True)
    model = _Model()
    ring = sanitizer.StagingRing(1024, name="store")
    with sanitizer.sanitize(triage=1):
        model.load(ring)
        rets = sanitizer.retentions()
    this = open(__file__, encoding="utf-8").read().splitlines()
    line = next(i for i, text in enumerate(this, 1) if "# MODEL-STORE" in text and "next(" not in text)
    assert rets and all(r["holder"]["stored_at"]["line"] == line for r in rets)
    assert rets[0]["holder"]["stored_at"]["function"] == "_Model.load"
