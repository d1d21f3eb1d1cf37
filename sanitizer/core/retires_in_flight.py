"""A reuse returns only after every overlapping retire that took its victims first has marked them stale.

Two threads reuse overlapping bytes of one buffer. The ledger hands the alive leases over those bytes to
whichever thread asks first; the other finds nothing alive and returns at once. If that second thread
then reads its own view, now stale, while the first one is still running the retire hooks (the guard's
tombstone, a checksum) and has not yet put the lease in the dispatch mode's stale table, the read is not
checked: it sees the next tensor's bytes, or the tombstone's NaN. With 8 threads lending and reusing one
buffer that was about 2% of stale reads (issue 29, point 4).

So each retire is registered, under one small lock, before it asks the ledger, and a retire waits, once its
own work is done, for the other threads' overlapping retires that were registered before its ledger call
ended (only those can have taken its victims). It waits with its own entry removed and holding no lock
of ours, so two waiters never wait for each other; a thread never waits for its own retires (a finalizer
that runs inside a retire hook and reuses bytes itself), and the wait is bounded. Torch-free: ranges,
thread idents and a condition variable.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

WAIT_S = 10.0  # the longest a reuse waits for another thread's retire (a hook stuck on a lock we cannot see)


class RetiresInFlight:
    """The retires in flight: sequence number -> (region id, start, end, thread ident)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._seq = 0
        self._flight: Dict[int, Tuple[int, int, int, int]] = {}

    def begin(self, region_id: int, start: int, end: int) -> int:
        """Register a retire of ``[start, end)`` of ``region_id`` about to ask the ledger; its ticket."""
        with self._cond:
            self._seq += 1
            self._flight[self._seq] = (region_id, start, end, threading.get_ident())
            return self._seq

    def asked(self) -> int:
        """The limit to wait up to, read once the ledger answered: a retire registered later asked it later
        too, so it cannot have taken this one's victims."""
        return self._seq

    def end(self, ticket: int, limit: int, wait_s: float = WAIT_S,
            may_wait: Optional[Callable[[], bool]] = None) -> bool:
        """Remove ``ticket``, then wait for the other threads' overlapping retires registered up to
        ``limit``. False if it did not wait for them all: the wait ran out (the caller goes on: a missed
        check is better than a hang), or ``may_wait()`` (asked only when there is something to wait for)
        said no: a reuse made from inside the sanitizer's own work (a finalizer that fired during a
        triage walk, which holds a lock the other retire's hooks need) must not wait at all."""
        with self._cond:
            entry = self._flight.pop(ticket, None)  # None: forgotten by a fork while under way
            self._cond.notify_all()
            if entry is None or not self._flight:
                return True
            region_id, start, end, me = entry

            def pending() -> bool:
                return any(seq <= limit and r == region_id and a < end and start < b and t != me
                           for seq, (r, a, b, t) in self._flight.items())

            if not pending():
                return True
            if may_wait is not None and not may_wait():
                return False
            deadline = time.monotonic() + wait_s
            while pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    @contextlib.contextmanager
    def retiring(self, region_id: int, start: int, end: int,
                 may_wait: Optional[Callable[[], bool]] = None) -> Iterator[Callable[[], None]]:
        """One retire, registered around its body: call what it yields once the ledger answered (the limit
        of :meth:`end`); on the way out it waits as :meth:`end` does, even when the body raised."""
        ticket = self.begin(region_id, start, end)
        limit: List[int] = [ticket]
        try:
            yield lambda: limit.__setitem__(0, self.asked())
        finally:
            self.end(ticket, limit[0], may_wait=may_wait)

    def in_flight(self) -> int:
        return len(self._flight)

    def after_fork_in_child(self) -> None:
        """Only the forking thread lives on in a child: the others' retires never end there."""
        self._cond = threading.Condition(threading.Lock())
        self._flight = {}


__all__ = ["RetiresInFlight", "WAIT_S"]
