"""Shared fixtures: every test starts with the sanitizer off, no errors, no stray leases."""
from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
import threading
from typing import List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _forget_everything() -> None:
    """Sanitizer off, and no error, event or pending retention left over from another test."""
    import sanitizer
    from sanitizer.core import options
    from sanitizer.torch_layer import records, runtime
    from sanitizer.features import triage

    sanitizer.disable()
    runtime.set_options(options.resolve({}))  # options survive disable(): one test's must not leak into the next
    sanitizer.clear_errors()
    triage.reset()
    records.forget_events()


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    _forget_everything()
    yield
    _forget_everything()
    collect_leftovers()


def collect_leftovers() -> None:
    """End the test's leftover leases and buffers (kept in a cycle) before the next test starts: the young
    generations first (a few ms, and where a test's last cycles usually are), the whole heap (~0.15 s over
    torch's) only when something of ours is still reachable after that."""
    if _ours_still_reachable():
        gc.collect(1)
        if _ours_still_reachable():
            gc.collect()


@pytest.fixture
def fresh_triage():
    """Triage's records and remembered holder paths forgotten before and after the test: what one test's
    retentions taught triage must not name the next test's holders."""
    from sanitizer.features import holders, triage

    triage.reset(records_too=True)
    holders.forget_patterns()
    yield
    triage.reset(records_too=True)
    holders.forget_patterns()


def _ours_still_reachable() -> bool:
    """Whether a lease or a staging buffer of the test outlived it (kept in a cycle: a caught error's
    traceback, a closure): then a full collection ends them here, not in the middle of the next test. A
    full collection costs ~0.25 s in this heap; paid after every test it was two thirds of the quick tests'
    time, though most tests leave nothing of ours behind once their frame is gone."""
    from sanitizer.torch_layer.state import state

    return bool(state.ledger.live_count or state.ledger.regions())


def run_python(code: str, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repo on the path (for import-time behaviour)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)


# -- a canary for the main thread's profile events ------------------------------------------------------------
# Why: CI's Python 3.12 phase once failed 8 tests of tests/torch_layer/test_user_tooling.py at once (stop 59),
# every one of them needing a profile event on the main thread (a visit of thread_reach, or the test's own
# ``sys.setprofile`` function), while a worker's profiler in the same process got its events; it did not happen
# again in four runs here. So the main thread's profile calls were off from that file's first test on, and some
# earlier test left them so. This names that test the next time: around each test of the folders below it sets
# a profile function on the main thread, makes one Python call, and looks for the event; when none came it
# prints one line (at once, and again in the run's summary) with the thread's ``tracing`` counter (above 0,
# CPython skips every profile callback) and profile fields. It never fails a test by itself: a broken state
# fails the tests that need it. (Here, not in a conftest of the folder: tests import this module as
# ``conftest``, and a second one would shadow it.)

_broken: List[str] = []
_WATCHED = ("torch_layer", "features", "robustness")  # the folders where the interpreter's threads and hooks matter


def _a_python_call() -> int:
    return 1


def _events_arrive(call=_a_python_call) -> bool:  # type: ignore[no-untyped-def]
    """Does a profile function set on this (the main) thread get the events of ``call()``?"""
    seen: List[str] = []
    old = sys.getprofile()

    def probe(frame, event, arg):  # type: ignore[no-untyped-def]
        seen.append(event)

    sys.setprofile(probe)
    try:
        call()
    finally:
        sys.setprofile(old)
    return bool(seen)


def _events_missing(item) -> List[str]:  # type: ignore[no-untyped-def]
    """Which probes got no event: a function of ours, and the test module's own ``_a_python_call`` where it has
    one (3.12 instruments each code object lazily, so a loss may be one function's, not the thread's)."""
    missing = [] if _events_arrive() else ["a function of conftest's"]
    theirs = getattr(getattr(item, "module", None), "_a_python_call", None)
    if callable(theirs) and not _events_arrive(theirs):
        missing.append("the test module's _a_python_call")
    return missing


def _thread_state() -> str:
    """The main thread's ``tracing`` counter and profile fields (3.12's PyThreadState: ``int tracing`` sits
    five ints before ``c_profilefunc``), for the line above; best effort."""
    try:
        from sanitizer.core import thread_reach

        api = thread_reach._api
        if api is None or sys.version_info[:2] != (3, 12):
            return f"profile={sys.getprofile()!r}"
        tstate = api.get_tstate()
        tracing = ctypes.c_int.from_address(tstate + api.func_off - 20).value
        func, obj = api.read(tstate)
        return f"tracing={tracing} c_profilefunc={func:#x} c_profileobj={obj:#x}"
    except Exception as err:  # a diagnostic: never the reason a run fails
        return f"(state unreadable: {type(err).__name__}: {err})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
    watched = any(part in _WATCHED for part in item.path.parts)
    if not watched or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _events_missing(item)
    yield
    after = _events_missing(item)
    if not before and not after:
        return
    when, what = ("before", before) if before else ("after", after)
    line = (f"profile-events canary: the main thread got no profile event ({', '.join(what)}) {when} "
            f"{item.nodeid} ({threading.active_count()} threads; {_thread_state()})")
    _broken.append(line)
    sys.__stderr__.write("\n" + line + "\n")


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    for line in _broken[:20]:
        terminalreporter.write_line(line)
