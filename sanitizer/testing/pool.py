"""Run a campaign's batches over worker processes: spawned (no fork of a process with torch's threads).

Shared by ``ownsan fuzz`` and ``ownsan fuzz --consumer``. Results come back as
batches complete; a worker may also :func:`tick` after each case, which the
parent turns into progress while the batch is still running; leaving early (a
failure found) cancels the batches not started yet.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import queue
from typing import Any, Callable, Iterator, List, Optional, Sequence

_ticks: Optional[Any] = None  # in a worker: the queue its ticks go to


def batches(count: int, jobs: int, most: int = 8) -> List[List[int]]:
    """``range(count)`` cut into batches of at most ``most``, about 8 per job (so that progress moves and no
    worker idles while another finishes a long chunk)."""
    size = max(1, min(most, count // (jobs * 8)))
    return [list(range(i, min(i + size, count))) for i in range(0, count, size)]


def tick() -> None:
    """In a worker: one more case done (a no-op outside :func:`in_processes` with ``on_tick``)."""
    if _ticks is not None:
        _ticks.put(1)


def _set_ticks(q: Any) -> None:
    global _ticks
    _ticks = q


def in_processes(fn: Callable[..., Any], calls: Sequence[tuple], jobs: int,
                 on_tick: Optional[Callable[[int], None]] = None) -> Iterator[Any]:
    """``fn(*call)`` for each call, over ``jobs`` spawned processes; results in completion order;
    ``on_tick(n)`` as workers :func:`tick`. Closing the iterator early cancels the calls not started."""
    ctx = multiprocessing.get_context("spawn")
    ticks = ctx.Queue() if on_tick is not None else None
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_set_ticks,
                                                initargs=(ticks,)) as pool:
        pending = {pool.submit(fn, *call) for call in calls}
        try:
            while pending:
                done, pending = concurrent.futures.wait(pending, timeout=0.2 if ticks else None,
                                                        return_when=concurrent.futures.FIRST_COMPLETED)
                _drain(ticks, on_tick)
                for future in done:
                    yield future.result()
        finally:
            for future in pending:
                future.cancel()
    _drain(ticks, on_tick)  # the running calls finished (shutdown waits for them): their last ticks count too


def _drain(ticks: Any, on_tick: Optional[Callable[[int], None]]) -> None:
    n = 0
    while ticks is not None:
        try:
            n += ticks.get_nowait()
        except queue.Empty:
            break
    if n and on_tick is not None:
        on_tick(n)


__all__ = ["batches", "tick", "in_processes"]
