"""A reuse returns only after every overlapping retire that took its victims first has marked them stale.

Two threads reuse overlapping bytes of one buffer. The ledger hands the alive leases over those bytes to
whichever thread asks first; the other finds nothing alive and returns at once. If that second thread
then reads its own view, now stale, while the first one is still running the retire hooks (the guard's
tombstone, a checksum) and has not yet put the lease in the dispatch mode's stale table, the read is not
checked: it sees the next tensor's bytes, or the tombstone's NaN. With 8 threads lending and reusing one
buffer that was about 2% of stale reads (issue 29, point 4).

So each retire is registered, under one small lock, before it asks the ledger, and a retire waits, once its
own work is done, for the other threads' overlapping retires that were registered before its ledger call
ended (only those can have taken its victims). "Overlapping" is judged on what a retire took, not only on the
bytes it asked for: a lease wider than either of two neighbouring reuses is taken by the first, and the
second, which overlaps the lease but not the first reuse, must still wait for it (it did not: with
``rescue=1``, four threads putting through one ring kept 2-8% of their tensors with a neighbour's bytes,
the second put writing while the first still copied the lease out). So a retire widens its entry to its
victims' extent once the ledger answered, and a retire registered earlier that has not answered yet is
waited for until it has (a ledger call: no hook runs in between).

A retire waits with its own entry removed and holding no lock of ours, so two waiters never wait for each
other; a thread never waits for its own retires (a finalizer that runs inside a retire hook and reuses bytes
itself), and the wait is bounded. Torch-free: ranges, thread idents and a condition variable.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional, Tuple

WAIT_S = 10.0  # the longest a reuse waits for another thread's retire (a hook stuck on a lock we cannot see)


class RetiresInFlight:
    """The retires in flight: sequence number -> (region id, start, end, thread ident, answered), where
    ``[start, end)`` grows to cover the victims once the ledger answered."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._seq = 0
        self._flight: Dict[int, Tuple[int, int, int, int]] = {}
        self._waiters = 0  # threads inside a wait: only they need a notify (a put pays none on one thread)

    def begin(self, region_id: int, start: int, end: int) -> int:
        """Register a retire of ``[start, end)`` of ``region_id`` about to ask the ledger; its ticket."""
        with self._cond:
            self._seq += 1
            self._flight[self._seq] = (region_id, start, end, threading.get_ident(), False)
            return self._seq

    def took(self, ticket: int, start: int, end: int) -> None:
        """The ledger answered ``ticket``'s retire, whose victims span ``[start, end)`` (its own range when it
        took none): another thread's retire overlapping them waits for this one."""
        with self._cond:
            entry = self._flight.get(ticket)
            if entry is None:
                return
            region_id, a, b, thread, _ = entry
            self._flight[ticket] = (region_id, min(a, start), max(b, end), thread, True)
            if self._waiters:
                self._cond.notify_all()

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
            if self._waiters:
                self._cond.notify_all()
            if entry is None or not self._flight:
                return True
            region_id, start, end, me, _ = entry

            def pending() -> bool:
                return any(seq <= limit and r == region_id and t != me and (not done or (a < end and start < b))
                           for seq, (r, a, b, t, done) in self._flight.items())

            if not pending():
                return True
            if may_wait is not None and not may_wait():
                return False
            deadline = time.monotonic() + wait_s
            while pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._waiters += 1
                try:
                    self._cond.wait(left)
                finally:
                    self._waiters -= 1
            return True

    def retiring(self, region_id: int, start: int, end: int,
                 may_wait: Optional[Callable[[], bool]] = None) -> "_Retiring":
        """One retire, registered around its body (``with``): call what it yields once the ledger answered,
        with the extent ``(start, end)`` of the victims it took, or none (the limit of :meth:`end`, and
        :meth:`took`); on the way out it waits as :meth:`end` does, even when the body raised. A plain class,
        not a generator context manager: this runs at every put of a ring load."""
        return _Retiring(self, region_id, start, end, may_wait)

    def in_flight(self) -> int:
        return len(self._flight)

    def after_fork_in_child(self) -> None:
        """Only the forking thread lives on in a child: the others' retires never end there."""
        self._cond = threading.Condition(threading.Lock())
        self._flight = {}
        self._waiters = 0


class _Retiring:
    """What :meth:`RetiresInFlight.retiring` returns: registers the retire on entry, ends it on exit."""

    __slots__ = ("flight", "start", "end", "may_wait", "ticket", "limit")

    def __init__(self, flight: RetiresInFlight, region_id: int, start: int, end: int,
                 may_wait: Optional[Callable[[], bool]]) -> None:
        self.flight, self.start, self.end, self.may_wait = flight, start, end, may_wait
        self.ticket = self.limit = flight.begin(region_id, start, end)

    def __enter__(self) -> Callable[..., None]:
        return self.answered

    def answered(self, took_start: Optional[int] = None, took_end: Optional[int] = None) -> None:
        self.limit = self.flight.asked()
        self.flight.took(self.ticket, self.start if took_start is None else took_start,
                         self.end if took_end is None else took_end)

    def __exit__(self, *exc: object) -> None:
        self.flight.end(self.ticket, self.limit, may_wait=self.may_wait)


__all__ = ["RetiresInFlight", "WAIT_S"]
