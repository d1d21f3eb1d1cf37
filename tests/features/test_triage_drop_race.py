"""Issue 46, point 10: views dropped at once on one thread while another thread reuses their bytes.

``views.clear()`` (or ``del views``) of 5,000 lent views runs a lease-death callback per view, and
other threads run in between. A loader thread that reuses those bytes meanwhile counts its own lends as
the consumer's turn; the views not dropped yet are alive, held only by the list's detached items (no
walk sees them), and die a moment later. They used to be recorded as retentions of views nobody kept.
The views the consumer does keep (in a list that stays) must still be reported, every one of them.
"""
from __future__ import annotations

import queue
import sys
import threading
import time

import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer
from sanitizer.features import triage

KEPT: list = []  # what the consumer really keeps: each one is a retention


@pytest.fixture(autouse=True)
def _fresh(fresh_triage):
    KEPT.clear()
    yield
    KEPT.clear()


def _drop_while_reused(n: int, rounds: int, drop: str, dropper: str) -> tuple:
    """Each round: lend ``n`` views, keep every 1,000th in KEPT, then drop the list (``clear`` or ``del``)
    while another thread writes over every slot. ``dropper`` "main": the main thread drops, a thread
    reuses and ends; "thread": a thread drops and stays (blocked) to the end, the main thread reuses, so
    only a quiet spell tells the drop is over. Returns (names retained, names kept, pending after a
    settle that is not the final one, made once the threads were quiet)."""
    buf = StagingBuffer(n * 64, name="dropped")
    src = torch.zeros(16)
    kept_names = set()
    finish = threading.Event()
    stay = []
    for r in range(rounds):
        box = [[buf.lend(i * 64, (16,), torch.float32, name=f"v{r}.{i}") for i in range(n)]]
        for i in range(0, n, 1000):
            KEPT.append(box[0][i])
            kept_names.add(f"v{r}.{i}")
        go, dropped = threading.Event(), threading.Event()

        def drop_them() -> None:
            views = box.pop()
            go.wait()
            if drop == "clear":
                views.clear()
            else:
                del views
            dropped.set()
            if dropper == "thread":
                finish.wait(30)  # still running when the main thread settles

        def reuse_them() -> None:
            go.wait()
            for j in range(n):
                w = buf.write(j * 64, src, name=f"next{r}.{j}")
                del w

        thread = threading.Thread(target=reuse_them if dropper == "main" else drop_them)
        thread.start()
        go.set()
        if dropper == "main":
            drop_them()
            thread.join()
        else:
            stay.append(thread)
            reuse_them()
            assert dropped.wait(30)
    time.sleep(max(triage._QUIET_S, 20 * sys.getswitchinterval()) + 0.05)  # quiet now
    retained = {r["lease"]["name"] for r in sanitizer.retentions()}  # (not the final settle)
    pending = triage.pending_count()
    finish.set()
    for thread in stay:
        thread.join()
    buf.close()
    return retained, kept_names, pending


@pytest.mark.parametrize("dropper, budget", [("main", 1000), ("thread", 0)], ids=["main-walk", "thread-no-walk"])
def test_views_dropped_while_another_thread_reuses_them_are_not_retentions(dropper, budget):
    """Before: one false retention a round with the walk (the first view, which ``list.clear`` drops
    last: the walk saw it alive, held where Python cannot see), hundreds without one (the decision is
    instant, while most of the list is still being dropped, or before the dropping thread even ran)."""
    with sanitizer.sanitize(triage=1, halt_on_error=0, triage_budget_ms=budget):
        retained, kept, pending = _drop_while_reused(5000, 1, "clear", dropper)
    assert pending == 0
    assert retained == kept, sorted(retained - kept)[:5]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 1000], ids=["no-walk", "walk"])
@pytest.mark.parametrize("drop", ["clear", "del"])
@pytest.mark.parametrize("dropper", ["main", "thread"])
def test_many_rounds_of_views_dropped_while_reused_leave_only_the_kept_ones(budget, drop, dropper):
    with sanitizer.sanitize(triage=1, halt_on_error=0, triage_budget_ms=budget):
        retained, kept, pending = _drop_while_reused(5000, 6, drop, dropper)
    assert pending == 0
    assert retained == kept, sorted(retained - kept)[:5]


@pytest.mark.slow
def test_a_kept_view_is_reported_while_another_thread_keeps_dropping_views_of_its_buffer():
    """The wait for other threads' drops is bounded: a consumer thread that drops every view it is handed
    (leases of the same buffer dying without a pause) does not hide a view kept elsewhere, with no walk
    to name its holder, once it has been kept for the longest wait."""
    buf = StagingBuffer(64 * 64, name="busy")
    src = torch.zeros(16)
    handed: "queue.Queue" = queue.Queue()

    def consumer() -> None:  # drops each view it is handed: deaths in 'busy' on this thread, all the time
        while True:
            w = handed.get()
            if w is None:
                return
            del w

    with sanitizer.sanitize(triage=1, halt_on_error=0, triage_budget_ms=0):
        KEPT.append(buf.lend(0, (16,), torch.float32, name="kept"))
        thread = threading.Thread(target=consumer)
        thread.start()
        try:
            buf.write(0, src, name="over")  # reuses the kept view's bytes
            longest = triage._LONGEST_WAIT * max(triage._QUIET_S, 20 * sys.getswitchinterval())
            start = time.monotonic()
            retained: set = set()
            i = 0
            while "kept" not in retained and time.monotonic() < start + longest + 3.0:
                handed.put(buf.write((1 + i % 63) * 64, src, name=f"c{i}"))  # decided on this thread
                i += 1
                if i % 50 == 0:
                    retained = {r["lease"]["name"] for r in sanitizer.retentions()}  # (not the final settle)
                time.sleep(0.001)
            waited = time.monotonic() - start
        finally:
            handed.put(None)
            thread.join()
    assert retained == {"kept"}
    assert waited >= triage._QUIET_S  # (it did wait for the consumer's drops)
