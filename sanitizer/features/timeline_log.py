"""The flight log the timeline draws: recent lends and reuses of each staging buffer, and how retentions ended.

Triage decides retentions; this log only records, so that ``ownsan triage
--html`` can draw each staging buffer (and ``--trace`` export it): the most
recent lends (``timeline_events`` of them) and reuses, each with its time;
every confirmed retention with the reuse that retired it; and for a retention
what ended it, a stale read or its death, at the generation its buffer was at.

Triage tells the log which leases to watch (retired while still held); the
release hook then notes such a lease's death as it happens. That hook runs
wherever the last reference went, possibly inside the GC, so it only looks up a
dict and appends to a deque (no lock); the deaths are filed under the lock at
the next question. Everything else takes the log's own lock. The hooks are
installed by the first enable (with the sanitizer never enabled nothing runs
at a lend, a reuse or a death).
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Optional, Tuple

from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.torch_layer.state import state

REGIONS_KEPT = 1024  # buffers remembered beyond those the kept lends name (a borrowed_iterator makes one per tensor)
RETAINED_KEPT = 20000  # confirmed retentions whose lease the log keeps (the report's records are capped anyway)
_T0 = time.perf_counter()


def now() -> float:
    """Seconds since the sanitizer was imported: the timeline's clock."""
    return time.perf_counter() - _T0


class TimelineLog:
    """One process's flight log (``reset()`` of triage replaces it)."""

    def __init__(self, cap: int) -> None:
        self._lock = threading.RLock()
        self.cap = cap
        self._lent: Deque[Tuple[float, Lease]] = deque()  # the most recent lends, oldest first (<= cap)
        self._lend_t: Dict[int, float] = {}  # lease id -> lend time, for the lends in _lent
        self._lent_total = 0
        self._reuses: Deque[Tuple[float, ReuseEvent]] = deque(maxlen=cap)
        self._last_reuse: Tuple[int, float] = (-1, 0.0)  # the latest reuse: its retire hooks run next
        self._regions: Dict[int, Region] = {}
        self._retained: Dict[int, Tuple[Optional[float], Lease, ReuseEvent, float, dict]] = {}
        # lease id -> (lend time, lease, the reuse that retired it, that reuse's time, its retention record)
        self._marks: Dict[int, Dict[str, dict]] = {}  # lease id -> {"stale_read": {...}, "death": {...}}
        self._watched: Dict[int, Region] = {}  # leases whose death is to be noted -> their buffer
        self._early_death: Dict[int, Tuple[int, float]] = {}  # watched, not (yet) retained: (generation, t)
        self._deaths: Deque[Tuple[int, int, float]] = deque()  # appended by the release hook, filed under the lock

    def set_cap(self, cap: int) -> None:
        """Keep the ``cap`` most recent lends and reuses from now on (0: none; retentions are kept anyway)."""
        with self._lock:
            if cap == self.cap:
                return
            self.cap = cap
            while len(self._lent) > cap:
                _, old = self._lent.popleft()
                self._lend_t.pop(old.lease_id, None)
            self._reuses = deque(self._reuses, maxlen=cap)

    # -- hooks ---------------------------------------------------------------------
    def on_lend(self, lease: Lease) -> None:
        if not self.cap:
            return
        with self._lock:
            if len(self._lent) >= self.cap:
                _, old = self._lent.popleft()
                self._lend_t.pop(old.lease_id, None)
            t = now()
            self._lent.append((t, lease))
            self._lend_t[lease.lease_id] = t
            self._lent_total += 1
            if lease.region_id not in self._regions:
                self._remember_region(lease.region_id)

    def on_reuse(self, region: Region, event: ReuseEvent) -> None:
        """Every reuse, retire and close (live victims or not), with its time."""
        if not self.cap:
            return
        t = now()
        with self._lock:
            self._last_reuse = (event.event_id, t)
            self._reuses.append((t, event))

    def on_release(self, lease: Lease) -> None:
        """A lease's storage died: note it if it is watched. Lock-free (possibly inside the GC)."""
        region = self._watched.get(lease.lease_id)
        if region is not None:
            self._deaths.append((lease.lease_id, region.generation, now()))

    # -- what triage tells the log ------------------------------------------------
    def reuse_time(self, event: ReuseEvent) -> float:
        """When ``event`` happened (the latest reuse's time; now, for another thread's or an unlogged one)."""
        eid, t = self._last_reuse
        return t if eid == event.event_id else now()

    def watch(self, lease: Lease, region: Region) -> None:
        """Note ``lease``'s death from now on (triage retired it while it was held)."""
        self._watched[lease.lease_id] = region

    def unwatch(self, lease_id: int) -> None:
        """Triage dropped it (a loop variable, not a retention): forget it."""
        with self._lock:
            self._file_deaths()
            self._watched.pop(lease_id, None)
            self._early_death.pop(lease_id, None)

    def retained(self, lease: Lease, event: ReuseEvent, event_t: float, region: Region, record: dict) -> None:
        """A confirmed retention: keep it for the timeline, with what ended it (or keep watching it)."""
        lid = lease.lease_id
        with self._lock:
            if len(self._retained) >= RETAINED_KEPT:  # a long run's memory stays bounded: forget the oldest half
                for old in list(self._retained)[: RETAINED_KEPT // 2]:
                    for d in (self._retained, self._marks, self._watched, self._early_death):
                        d.pop(old, None)
            self._retained[lid] = (self._lend_t.get(lid), lease, event, event_t, record)
            if lease.region_id not in self._regions:
                self._remember_region(lease.region_id)
            self._file_deaths()  # a death the hook saw while it was pending (or being named) is exact
            early = self._early_death.pop(lid, None)
            if early is not None:
                self._marks.setdefault(lid, {}).setdefault("death", {"generation": early[0], "t": early[1]})
                self._watched.pop(lid, None)
            elif lease.alive:
                self._watched[lid] = region
                if not lease.alive:  # died just now: the hook may have looked before the line above
                    self._file_deaths()
                    if self._watched.pop(lid, None) is not None:
                        self._note_death(lease)
            else:
                self._watched.pop(lid, None)
                self._note_death(lease)  # died with nobody watching (between triage's decision and now)

    def stale_read(self, lease: Lease, at: Optional[dict]) -> None:
        """``lease`` is being used stale at ``at`` (a frame record): the end of its red box."""
        with self._lock:
            marks = self._marks.setdefault(lease.lease_id, {})
            read = marks.get("stale_read")
            if read is None:
                marks["stale_read"] = {"generation": self._generation_of(lease), "t": now(), "at": at}
            elif read.get("at") is None:
                read["at"] = at

    # -- internals ------------------------------------------------------------------
    def _remember_region(self, region_id: int) -> None:
        try:
            self._regions[region_id] = state.ledger.region(region_id)
        except Exception:  # a region forgotten already
            return
        if len(self._regions) > REGIONS_KEPT + 2 * (len(self._lent) + len(self._retained)):  # amortised
            keep = {lease.region_id for _, lease in self._lent} | {e[1].region_id for e in self._retained.values()}
            for rid in [rid for rid in self._regions if rid not in keep]:
                del self._regions[rid]

    def _file_deaths(self) -> None:
        """(Under the lock.) File the deaths the release hook saw."""
        while self._deaths:
            try:
                lid, generation, t = self._deaths.popleft()
            except IndexError:  # (another thread filed it)
                break
            if self._watched.pop(lid, None) is None:
                continue
            if lid in self._retained:
                self._marks.setdefault(lid, {}).setdefault("death", {"generation": generation, "t": t})
            else:
                self._early_death.setdefault(lid, (generation, t))

    def _generation_of(self, lease: Lease) -> Optional[int]:
        """The generation of the lease's buffer now (the timeline's x axis)."""
        region = self._regions.get(lease.region_id)
        if region is None:
            try:
                region = state.ledger.region(lease.region_id)
            except Exception:
                return None
        return region.generation

    def _note_death(self, lease: Lease) -> None:
        """(Under the lock.) A death the release hook could not see: noted now."""
        self._marks.setdefault(lease.lease_id, {}).setdefault(
            "death", {"generation": self._generation_of(lease), "t": now()})

    # -- the report section ---------------------------------------------------------
    def section(self) -> Dict[str, Any]:
        """The report's ``timeline`` section: each staging buffer's recent lends, reuses and retained leases.

        ``leases``: the most recent lends (``timeline_events``) and every confirmed retention, each with
        its bytes, the generation it was lent at, the reuse that retired it, and for a retention its
        holder and what ended it (a stale read, its death, or nothing yet), each at the generation and
        time it happened. ``events``: the most recent reuses, retires and closes of those buffers and
        the reuses that retired the retained leases. ``t`` is seconds since the sanitizer was imported
        (None only for a reuse that retired a lease and has itself left the most recent ones: the trace
        places it between its neighbours)."""
        with self._lock:
            self._file_deaths()
            entries: Dict[int, Tuple[Optional[float], Lease]] = {lease.lease_id: (t, lease) for t, lease in self._lent}
            retired: Dict[int, ReuseEvent] = {}
            records: Dict[int, dict] = {}
            event_t: Dict[int, float] = {}
            for lid, (t, lease, ev, ev_t, record) in self._retained.items():
                entries.setdefault(lid, (t, lease))
                retired[lid], records[lid] = ev, record
                event_t[ev.event_id] = ev_t
            reuses = list(self._reuses)
            regions = dict(self._regions)
            marks = {lid: dict(m) for lid, m in self._marks.items()}
            cap, dropped = self.cap, max(0, self._lent_total - len(self._lent))
        pid = os.getpid()
        wanted = {lease.region_id for _, lease in entries.values()}
        events: Dict[int, ReuseEvent] = {}
        for t, ev in reuses:
            if ev.region_id in wanted:
                events[ev.event_id] = ev
                event_t[ev.event_id] = t
        leases = []
        for lid in sorted(entries):
            t, lease = entries[lid]
            ev = retired.get(lid) or lease.stale_by  # (a rescue clears stale_by: the retention keeps its reuse)
            if ev is not None:
                events.setdefault(ev.event_id, ev)
            leases.append({
                "lease_id": lid, "buffer": lease.region_id, "name": lease.name, "dtype": lease.dtype,
                "shape": list(lease.shape), "byte_range": [lease.start, lease.end], "generation": lease.generation,
                "pid": pid, "t": None if t is None else round(t, 6), "retired_by": None if ev is None else ev.event_id,
                "alive": bool(lease.alive and not lease.rescued), "rescued": lease.rescued,
                "retained": _retained_entry(records.get(lid), marks.get(lid, {})),
            })
        out_events = []
        for eid in sorted(events):
            ev = events[eid]
            t = event_t.get(eid)
            out_events.append({"event_id": eid, "buffer": ev.region_id, "pid": pid, "kind": ev.kind,
                               "byte_range": [ev.start, ev.end],
                               "generation_before": ev.generation_before, "generation_after": ev.generation_after,
                               "by": ev.by, "t": None if t is None else round(t, 6)})
        buffers = []
        for rid in sorted(wanted):
            r = regions.get(rid)
            if r is not None:
                buffers.append({"id": rid, "pid": pid, "name": r.name, "device": r.device, "nbytes": r.nbytes,
                                "generation": r.generation, "closed": r.closed})
        return {"cap": cap, "dropped": dropped, "buffers": buffers, "leases": leases, "events": out_events}


def _retained_entry(record: Optional[dict], marks: Dict[str, dict]) -> Optional[Dict[str, Any]]:
    """A lease's ``retained`` field: who held it and what ended it (None: not a confirmed retention)."""
    if record is None:
        return None
    end = marks.get("stale_read") or marks.get("death")
    until = "stale_read" if "stale_read" in marks else "death" if "death" in marks else "alive"
    holder = record.get("holder") or {}
    return {"holder": holder.get("path"), "consumer": holder.get("consumer"), "kind": holder.get("kind"),
            "until": until, "generation": end.get("generation") if end else None, "t": end.get("t") if end else None,
            "read_at": (marks.get("stale_read") or {}).get("at"),
            "died_generation": (marks.get("death") or {}).get("generation"),
            "counted": (record.get("walk") or {}).get("when") == "counted"}


__all__ = ["TimelineLog", "now", "REGIONS_KEPT", "RETAINED_KEPT"]
