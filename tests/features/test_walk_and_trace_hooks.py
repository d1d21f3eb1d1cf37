"""A holder walk never changes a program's locals, whatever trace or profile hooks its threads run.

On CPython < 3.13 reading ``frame.f_locals`` leaves a snapshot dict on the frame, which the walk clears so
that it keeps nothing alive. But a thread inside a Python ``sys.setprofile`` / ``sys.settrace`` hook is in
CPython's trampoline, which copies the fast locals into that very dict before the hook and back after it,
deleting each local the dict lacks: a walk that cleared it meanwhile left the thread's live locals unbound
(a blind user's test: ``UnboundLocalError`` on ``a = (a @ a).tanh()``, 3 runs of 16 on 3.11).
"""
from __future__ import annotations

import sys
import threading

import pytest

from sanitizer.features.holder_paths import locals_of


@pytest.mark.parametrize("how", ["setprofile", "settrace"])
def test_a_walk_while_a_thread_is_inside_its_hook_leaves_that_threads_locals_bound(how):
    inside, release, result = threading.Event(), threading.Event(), []

    def hook(frame, event, arg):
        # (blocks once, at the C call of len() in work(), with work's frame between the trampoline's two copies)
        if event in ("c_call", "line") and frame.f_code is work.__code__ and not inside.is_set():
            if event == "line" and frame.f_lineno != work.__code__.co_firstlineno + 3:
                return hook
            inside.set()
            release.wait(30)
        return hook

    def work():
        a = [1, 2, 3]
        b = "kept"
        n = len(a)
        return a, b, n

    def thread() -> None:
        (sys.setprofile if how == "setprofile" else sys.settrace)(hook)
        try:
            result.append(work())
        except BaseException as err:  # the failure this test is about
            result.append(err)
        finally:
            (sys.setprofile if how == "setprofile" else sys.settrace)(None)

    t = threading.Thread(target=thread)
    t.start()
    assert inside.wait(30)
    frame = sys._current_frames()[t.ident]
    while frame is not None and frame.f_code is not work.__code__:
        frame = frame.f_back
    assert frame is not None
    seen = locals_of(frame)  # the walk reads work's locals while the hook runs
    assert seen["a"] == [1, 2, 3] and seen["b"] == "kept"
    release.set()
    t.join(30)
    assert result == [([1, 2, 3], "kept", 3)], result


def test_the_snapshot_is_cleared_when_no_thread_is_in_a_hook_and_kept_while_one_is():
    """(What the clearing is for: the walk's snapshot keeps nothing alive; it is kept only while a hook runs.)"""
    from sanitizer.core import thread_reach

    if thread_reach._api is None or thread_reach._api.tracing_off is None:
        pytest.skip("no thread's tracing count is readable here: nothing is ever cleared")
    snapshot = {"a": 1}
    assert thread_reach.clear_unless_a_thread_traces(snapshot) and snapshot == {}
    inside, release, kept = threading.Event(), threading.Event(), []

    def hook(frame, event, arg):
        if event == "call" and not inside.is_set():
            inside.set()
            release.wait(30)

    def thread() -> None:
        sys.setprofile(hook)
        (lambda: None)()
        sys.setprofile(None)

    t = threading.Thread(target=thread)
    t.start()
    assert inside.wait(30)
    other = {"b": 2}
    kept.append(thread_reach.clear_unless_a_thread_traces(other))
    release.set()
    t.join(30)
    assert kept == [False] and other == {"b": 2}
