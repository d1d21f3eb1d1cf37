"""The record store: every error and event the sanitizer keeps, within its caps, and the one path errors take.

Errors (stale uses, checksum mismatches) and events (retentions, rescues,
clones by policy) are JSON-ready dicts. They share one cap (option
``max_records``): past it a record is counted, not kept, so a long run's memory
stays bounded; with ``halt_on_error=0`` one lease keeps at most
``max_errors_per_lease`` stale-use records. :func:`raise_or_record` is how every
sanitizer error leaves: raised, or recorded and let go, as the options (or the
caller's ``halt``) say. The store has its own lock; nobody else touches its lists.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Set

from sanitizer.core import forking
from sanitizer.core import suppressions as _suppressions
from sanitizer.core.errors import OwnershipError, rebuild
from sanitizer.core.ledger import Lease
from sanitizer.torch_layer.hooks import HOOKS
from sanitizer.torch_layer.state import state


class RecordStore:
    """Errors and events, with the counts of what the caps dropped."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._errors: List[dict] = []
        self._events: List[dict] = []
        self.error_total = 0  # errors seen, kept or not
        self.dropped = 0  # errors and events not kept: the max_records cap was reached
        self.dropped_errors = 0  # the errors among them
        self.over_per_lease = 0  # errors not kept: their lease had max_errors_per_lease records already
        self._per_lease: Dict[int, int] = {}  # lease id -> stale uses seen
        self._tallies: Dict[tuple, dict] = {}  # (kind, key) -> its one aggregated event, while kept
        self.dropped_events: Dict[str, int] = {}  # kind -> events not kept (the summary counts them all)

    def _keep(self, records: List[dict], record: dict, cap: int) -> bool:
        """(Under the lock.) Keep ``record`` unless the total cap is reached."""
        if len(self._errors) + len(self._events) < cap:
            records.append(record)
            return True
        self.dropped += 1
        return False

    def add_error(self, record: dict, lease_id: Optional[int], cap: int, per_lease: Optional[int]) -> None:
        """File an error record; ``per_lease`` (None: no bound) bounds the records kept for one lease."""
        with self._lock:
            self.error_total += 1
            if per_lease is not None and lease_id is not None:
                n = self._per_lease.get(lease_id, 0) + 1
                self._per_lease[lease_id] = n
                if len(self._per_lease) > 4 * max(1, cap):
                    self._per_lease.clear()  # a bound, not a record: keep it bounded too
                if n > per_lease:
                    self.over_per_lease += 1
                    return
                record["occurrence"] = n
            kept = self._keep(self._errors, record, cap)
            if not kept:
                self.dropped_errors += 1
        if kept:
            for hook in HOOKS.record:  # (outside the lock: a journal writes a line)
                hook("error", record)

    def add_event(self, kind: str, record: dict, cap: int) -> dict:
        record["kind"] = kind
        with self._lock:
            kept = self._keep(self._events, record, cap)
            if not kept:
                self.dropped_events[kind] = self.dropped_events.get(kind, 0) + 1
        if kept:
            for hook in HOOKS.record:
                hook("event", record)
        return record

    def tally(self, kind: str, key: str, first: Dict[str, Any], cap: int, **add: int) -> dict:
        """Count into the one aggregated event of (``kind``, ``key``), made from ``first`` when there is
        none kept: a count of things (loads left unchecked), not a record each. A store emptied since (a
        reset, a fork) starts a new one, so a count is never added to a record no report will show."""
        made = None
        with self._lock:
            rec = self._tallies.get((kind, key))
            if rec is None:
                rec = dict(first, kind=kind, **{k: 0 for k in add})
                if self._keep(self._events, rec, cap):
                    self._tallies[(kind, key)] = made = rec
            for k, v in add.items():
                rec[k] = rec.get(k, 0) + v
        if made is not None:
            for hook in HOOKS.record:
                hook("event", made)
        return rec

    def update_event(self, record: dict, **fields: Any) -> None:
        """Add facts to a kept event (a retention read stale after it was confirmed), under the lock. The
        journal is told too (an ``update`` line naming the event by kind and lease): a process killed
        before its report keeps them (its consumer read "stale 0" beside the very stale use)."""
        with self._lock:
            record.update(fields)
        lease = record.get("lease")
        lease_id = lease.get("lease_id") if isinstance(lease, dict) else None
        if lease_id is not None:
            for hook in HOOKS.record:
                hook("update", {"kind": record.get("kind"), "lease_id": lease_id, "fields": dict(fields)})

    def errors(self) -> List[dict]:
        with self._lock:
            return list(self._errors)

    def events(self, kind: Optional[str] = None) -> List[dict]:
        with self._lock:
            return [e for e in self._events if kind is None or e.get("kind") == kind]

    def forget_events(self, kind: Optional[str] = None, record: Optional[dict] = None) -> None:
        """Drop the events of ``kind`` (all when None), or only ``record`` (by identity) when given."""
        with self._lock:
            if record is not None:
                self._events[:] = [e for e in self._events if e is not record]
            else:
                self._events[:] = [e for e in self._events if kind is not None and e.get("kind") != kind]
                if kind is None:
                    self.dropped_events.clear()
                else:
                    self.dropped_events.pop(kind, None)
            kept = {id(e) for e in self._events}
            self._tallies = {k: r for k, r in self._tallies.items() if id(r) in kept}

    def clear_errors(self) -> None:
        with self._lock:
            self._errors.clear()
            self._per_lease.clear()
            self.error_total = 0
            self.dropped = 0
            self.dropped_errors = 0
            self.over_per_lease = 0

    def record_ids(self) -> Set[int]:
        """Identities of every record kept now (to leave them out of a later report: a test's own)."""
        with self._lock:
            return {id(e) for e in self._errors} | {id(e) for e in self._events}

    def counts(self) -> Dict[str, int]:
        with self._lock:
            return {"errors_seen": self.error_total, "errors_kept": len(self._errors),
                    "events_kept": len(self._events), "dropped": self.dropped,
                    "errors_dropped": self.dropped_errors, "errors_over_per_lease": self.over_per_lease,
                    "events_dropped": dict(self.dropped_events)}


STORE = RecordStore()


@forking.in_child
def _after_fork() -> None:
    """A forked child reports its own findings: the parent's records stay the parent's (and its report's)."""
    STORE._lock = threading.RLock()
    STORE.clear_errors()
    STORE.forget_events()

# -- the one exit of every sanitizer error -------------------------------------------
_last = threading.local()  # per thread: how many errors it raised, and a copy-able state of the last one


def raise_or_record(err: OwnershipError, lease: Optional[Lease], halt: Optional[bool] = None) -> None:
    """Raise ``err`` (``halt``, by default the options' ``halts``) or record it and let the program go on.

    A raised error is filed too (the report lists it). ``halt=False`` is for callers with nobody to
    raise to (exit handlers); nobody swaps the options for that."""
    opts = state.options
    if halt is None:
        halt = opts.halts
    lease_id = lease.lease_id if lease is not None else None
    if halt and opts.suppressions and _suppressions.suppressed_by_file(opts.suppressions, err.record):
        # Named in the suppressions file (as LSan's and ASan's suppressions let a known report through in
        # any mode): recorded, listed as suppressed, and the program goes on as in recover mode.
        halt = False
    if halt:
        STORE.add_error(err.record, lease_id, opts["max_records"], None)
        _last.seq = getattr(_last, "seq", 0) + 1
        _last.error = (type(err), err.__dict__)
        try:
            raise err
        finally:
            del err  # no frame -> traceback -> error cycle: a caught error is freed at once
    STORE.add_error(err.record, lease_id, opts["max_records"], opts["max_errors_per_lease"])
    for hook in HOOKS.recovered:  # recover mode speaks (reporting.recover): never lets an error out
        try:
            hook(err)
        except Exception:
            pass


def error_mark() -> int:
    """A mark for :func:`raised_since`: how many sanitizer errors this thread has raised so far."""
    return getattr(_last, "seq", 0)


def raised_since(mark: int) -> Optional[OwnershipError]:
    """A copy of the last sanitizer error this thread raised after ``mark`` (None if none).

    For boundaries that turn a Python exception into text and lose it on the way (TorchScript's
    interpreter reports an exception raised by a dispatch mode as an empty ``RuntimeError:``): the
    caller re-raises this copy. Only the error's own facts are kept here (no tensor, no frame)."""
    if getattr(_last, "seq", 0) <= mark:
        return None
    cls, fields = _last.error
    return rebuild(cls, None, dict(fields))


def record_event(kind: str, record: dict) -> dict:
    """File ``record`` (its ``kind`` set to ``kind``) among the events, within the cap; returns it."""
    return STORE.add_event(kind, record, state.options.max_records)


def tally_event(kind: str, key: str, first: Dict[str, Any], **add: int) -> dict:
    """Count into the aggregated event of (``kind``, ``key``) (see :meth:`RecordStore.tally`)."""
    return STORE.tally(kind, key, first, state.options.max_records, **add)


events = STORE.events
errors = STORE.errors
forget_events = STORE.forget_events
update_event = STORE.update_event
clear_errors = STORE.clear_errors
record_counts = STORE.counts

__all__ = ["RecordStore", "STORE", "raise_or_record", "error_mark", "raised_since", "record_event", "tally_event",
           "events",
           "errors", "forget_events", "update_event", "clear_errors", "record_counts"]
