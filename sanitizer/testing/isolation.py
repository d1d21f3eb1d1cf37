"""One run of a test case, isolated: what it records is counted, then forgotten; its garbage is collected fast.

A harness that runs a consumer many times (the fuzz campaign, the consumer
check) must keep the runs independent: one run's errors and retention events
must not be counted by the next, must not fill the records cap (which would
then drop the errors a later run counts), and must not be reported by the
pytest plugin as the test's own. The records a caller had before stay.

The heap the caller had before a run is frozen out of the garbage collector
for the run (``gc.freeze``): the full collection at its end, which lets the
run's leftover leases die (a deferred loader's closures make cycles), then
scans only what the run made, a few ms instead of ~0.2 s over torch's heap.
(``gc.get_referrers`` does not see frozen objects: the holder walk then finds them by one pass over the
reachable heap, ~1 s, :mod:`sanitizer.features.frozen_heap`; a run that must name holders is run unfrozen.)
"""
from __future__ import annotations

import contextlib
import gc
import sys
from typing import Iterator, List, Optional, Set

import sanitizer
from sanitizer.torch_layer import records


class RecordScope:
    """The errors and events recorded since it was made; :meth:`forget` drops them (and triage's state)."""

    def __init__(self) -> None:
        self._errors_seen = records.record_counts()["errors_seen"]
        self._errors_before = sanitizer.errors()
        self._error_ids: Set[int] = {id(e) for e in self._errors_before}
        self._event_ids: Set[int] = {id(e) for e in records.events()}

    def errors_seen(self) -> int:
        """Errors seen since (all of them: those the records cap did not keep too)."""
        return records.record_counts()["errors_seen"] - self._errors_seen

    def errors(self) -> List[dict]:
        return [e for e in sanitizer.errors() if id(e) not in self._error_ids]

    def events(self, kind: Optional[str] = None) -> List[dict]:
        return [e for e in records.events(kind) if id(e) not in self._event_ids]

    def exclude(self) -> Set[int]:
        """Ids of the records from before (``sanitizer.report(exclude=...)`` leaves them out)."""
        return self._error_ids | self._event_ids

    def forget(self) -> None:
        """Drop what was recorded since, and triage's pending retentions, site statistics and timeline.

        Clone records stay: there is one per ownership policy, aggregated over the whole process."""
        from sanitizer.features import triage

        triage.reset()
        for e in self.events():
            if e.get("kind") != "clone":
                records.forget_events(record=e)
        if self.errors_seen() or len(sanitizer.errors()) != len(self._errors_before):
            _keep_only(self._errors_before)


def _keep_only(errors: List[dict]) -> None:
    """The error records become ``errors`` again (the caller's own, from before a run).

    The record store can forget events one by one but errors only all at once, so the caller's are
    filed again after the clear: the same dicts, in their order. (Its count of errors seen becomes the
    number kept: errors the records cap had dropped before the run are no longer counted.)"""
    sanitizer.clear_errors()
    for record in errors:  # they were within the cap before the run: no cap now
        records.STORE.add_error(record, None, sys.maxsize, None)


@contextlib.contextmanager
def isolated_run(freeze: bool = True) -> Iterator[RecordScope]:
    """Run a case: the heap frozen (``freeze``, unless the caller froze it), its records forgotten after."""
    freeze = freeze and gc.get_freeze_count() == 0  # a caller that froze itself keeps its own freeze
    if freeze:
        gc.freeze()
    scope = RecordScope()
    try:
        yield scope
    finally:
        gc.collect()  # the run's own leftovers (cycles that hold leases): only unfrozen objects are scanned
        if freeze:
            gc.unfreeze()
        scope.forget()


@contextlib.contextmanager
def unsanitized() -> Iterator[None]:
    """The sanitizer off for a block (the bare program), then on again if it was (with its options)."""
    was_enabled = sanitizer.enabled()
    sanitizer.disable()
    try:
        yield
    finally:
        if was_enabled:
            sanitizer.enable()


__all__ = ["RecordScope", "isolated_run", "unsanitized"]
