"""A canary for the main thread's profile events, around every test in this folder.

Why: CI's Python 3.12 phase once failed 8 tests of test_user_tooling.py at once (stop 59), every one of them
needing a profile event on the main thread (a visit of thread_reach, or the test's own ``sys.setprofile``
function), while a worker's profiler in the same process got its events; it did not happen again in five runs
here. So the main thread's profile calls were off from that file's first test on, and some earlier test left
them so. This check names that test the next time: before and after each test it sets a profile function on
the main thread, makes one Python call, and looks for the event; when none came it prints one line (at once,
and again in the run's summary) with the thread's ``tracing`` counter (above 0, CPython skips every profile
callback) and profile fields. It never fails a test by itself: a broken state fails the tests that need it.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import List

import pytest

_broken: List[str] = []


def _a_python_call() -> int:
    return 1


def _events_arrive() -> bool:
    """Does a profile function set on this (the main) thread get the next call's events?"""
    seen: List[str] = []
    old = sys.getprofile()

    def probe(frame, event, arg):  # type: ignore[no-untyped-def]
        seen.append(event)

    sys.setprofile(probe)
    try:
        _a_python_call()
    finally:
        sys.setprofile(old)
    return bool(seen)


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
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = _events_arrive()
    yield
    after = _events_arrive()
    if before and after:
        return
    when = "before" if not before else "after"
    line = (f"profile-events canary: the main thread got no profile event {when} {item.nodeid} "
            f"({threading.active_count()} threads; {_thread_state()})")
    _broken.append(line)
    sys.__stderr__.write("\n" + line + "\n")


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    for line in _broken[:20]:
        terminalreporter.write_line(line)
