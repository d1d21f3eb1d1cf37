"""Retentions: a reuse retired a lease that something still held; name that something.

**The rule.** A retire hook (order 300, after checksums and rescue, before
poison) records every lease that a reuse or close retires while it is still
reachable as *pending*. In ``for name, w in loader:`` the loop variable still
holds the previous view while the loader fetches the next one, and drops it a
moment later, so a pending lease is decided only once its consumer has had its
turn: at the next lend but one, at the next retirement or report after a lend,
at the end of a test or of the process, or at once when it is used stale.
Still held then, or used stale meanwhile: a **retention**. Gone: forgotten.

**The check is cheap and never by address.** "Still held" is the lease's
liveness (``lease.alive``: its storage's death is a weakref callback), rescued
leases included: a rescue rebinds the lease's death to its owned copy, so
``alive`` turns False when the last view of the copy goes. A storage address
is handed to the holder walk only while its lease is alive.

**Naming, only for a confirmed retention.** First the holder paths named
before are followed again from their roots (a consumer keeps its next weight
where it kept the last: a few container steps, see
:mod:`sanitizer.features.holders`); once 3 retentions of the same lend and
reuse sites were named with the same holder, the rest are counted as that
holder's without a walk; otherwise a bounded heap walk names it.

**The timeline.** The lend hook also keeps the most recent lends
(``timeline_events``); a reuse hook keeps as many of the most recent reuses,
each with its time, whether or not it retired a live lease; a release hook
notes, when it happens, the death of a pending or confirmed retention (its
buffer's generation and the time), and an error about a retained lease notes
its stale read as it is built. :func:`timeline` is the report's ``timeline``
section, which ``ownsan triage --html`` draws and ``--trace`` exports. The
release and reuse hooks are installed by the first :func:`enable` (with the
sanitizer never enabled, nothing runs at a lease's death or at a reuse); the
release hook runs wherever the last reference went, possibly inside the GC, so
it only looks up two dicts and appends to a deque (no lock): the deaths are
filed under the lock at the next check point.

The walk runs whenever the sanitizer is enabled (debug mode). ``triage=1``
additionally makes every error recorded, never raised, so the program runs to
the end and the report lists every retaining consumer.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from inspect import CO_OPTIMIZED
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Set, Tuple

from sanitizer.core import errors as _errors
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.sites import to_records
from sanitizer.features import holders as _holders
from sanitizer.features.holder_paths import consumer_key
from sanitizer.features.holders import Holder, find_holders
from sanitizer.torch_layer import runtime

ORDER = runtime.RetireOrder.TRIAGE
SAME_HOLDER = 3  # retentions named with one holder at one (lend site, reuse site); the rest are counted
_RETAINED_KEPT = 20000  # confirmed retentions whose lease the timeline keeps (the report's records are capped
# by max_records)
_RUNNING_DEPTH = 24  # frames of the retiring thread noted at a retire (a loop variable lives a few above it)
_REGIONS_KEPT = 1024  # staging buffers the timeline remembers beyond those its lends name (a borrowed_iterator
# makes one per tensor)

_lock = threading.RLock()
_lends = 0
_T0 = time.perf_counter()


@dataclass
class _Pending:
    lease: Lease
    event: ReuseEvent
    region: Region  # the lease's buffer: its generation at the lease's death is the death mark's
    t: float  # when it was retired (the reuse's time)
    lends: int  # the lend counter when it was retired
    site_key: Tuple[Any, ...]
    thread: str
    running: Tuple[frozenset, frozenset] = (frozenset(), frozenset())  # (frame ids, module dict ids) at the retire
    death: Optional[Tuple[int, float]] = None  # (generation, t) when its storage died, filed from the release hook


@dataclass
class _Site:
    """What retentions of one (lend site, reuse site) were held by, to count the rest."""

    consumer: Optional[Tuple[str, Optional[str]]] = None  # (holder path with [*], holder site)
    holder: Optional[Holder] = None
    same: int = 0  # retentions in a row named with that holder


@dataclass
class _Watched:
    """A confirmed retention whose memory is still reachable: its death is noted by the release hook."""

    lease: Lease
    region: Region


_pending: Dict[int, _Pending] = {}  # lease id -> pending retention
_sites: Dict[Tuple[Any, ...], _Site] = {}
_watch: Dict[int, _Watched] = {}  # lease id -> confirmed retention still reachable
_deaths: Deque[Tuple[int, int, float]] = deque()  # (lease id, generation, t): appended by the release hook
# (lock-free, possibly inside the GC), filed under _lock by _file_deaths; at most one per pending or watched lease
_confirmed: Dict[int, dict] = {}  # lease id -> its retention record
_lent: Deque[Tuple[float, Lease]] = deque(maxlen=10000)  # the most recent lends: (time, lease)
_lent_total = 0
_reuses: Deque[Tuple[float, ReuseEvent]] = deque(maxlen=10000)  # the most recent reuses, retires, closes: (time, event)
_last_reuse: Tuple[int, float] = (-1, 0.0)  # (event id, time) of the latest reuse: its retire hooks run next
_retained: Dict[int, Tuple[Optional[float], Lease, ReuseEvent, float]] = {}  # confirmed retentions (kept past the
# cap): (lend time, lease, the reuse that retired it, that reuse's time)
_marks: Dict[int, Dict[str, dict]] = {}  # lease id -> {"stale_read": {...}, "death": {...}}
_regions: Dict[int, Region] = {}  # region id -> region, for the timeline
_errors_seen = 0  # errors of runtime.state.errors already looked at
_used: Set[int] = set()  # lease ids named by an error (any kind)
_stale_read: Set[int] = set()  # lease ids named by a stale_use error


def _now() -> float:
    return time.perf_counter() - _T0


def _site_key(lease: Lease, event: ReuseEvent) -> Tuple[Any, ...]:
    return (lease.site[:1], event.site[:1])


# -- hooks ---------------------------------------------------------------------
def on_lend(lease: Lease, view: Any) -> None:
    """Count the lend, keep it for the timeline, and decide what waited for the consumer's turn."""
    global _lends, _lent_total
    _lends += 1
    opts = runtime.state.options
    cap = opts["timeline_events"]
    if cap:
        if cap != _lent.maxlen:
            _resize(cap)
        _lent.append((time.perf_counter() - _T0, lease))
        _lent_total += 1
        if lease.region_id not in _regions:
            _remember_region(lease.region_id)
    if _pending or _deaths:
        # A lease retired before the previous lend was held across it by its consumer's loop variable
        # at most: the consumer has had its turn since.
        _checkpoint(_lends - 1)


def _resize(cap: int) -> None:
    """(Under _lock, or from the lend hook.) Keep the ``cap`` most recent lends and reuses (0: no reuse)."""
    global _lent, _reuses
    if cap and cap != _lent.maxlen:
        _lent = deque(_lent, maxlen=cap)
    if cap != _reuses.maxlen:
        _reuses = deque(_reuses, maxlen=cap)


def _remember_region(region_id: int) -> None:
    try:
        _regions[region_id] = runtime.state.ledger.region(region_id)
    except Exception:  # a region forgotten already
        return
    if len(_regions) > _REGIONS_KEPT + 2 * (len(_lent) + len(_retained)):  # amortised: at most one per lend
        keep = {lease.region_id for _, lease in _lent} | {entry[1].region_id for entry in _retained.values()}
        for rid in [rid for rid in _regions if rid not in keep]:
            del _regions[rid]


def on_reuse(region: Region, event: ReuseEvent) -> None:
    """Every reuse, retire and close (live victims or not): keep it, with its time, for the timeline."""
    global _last_reuse
    if not runtime.state.enabled:
        return
    t = time.perf_counter() - _T0
    _last_reuse = (event.event_id, t)
    _reuses.append((t, event))  # bounded by timeline_events (maxlen 0: kept nowhere)


def on_release(lease: Lease) -> None:
    """A lease's storage died (rescued leases too): note it if it is a pending or confirmed retention.

    Runs in whatever thread dropped the last reference, possibly inside the GC: two dict lookups and a
    deque append, no lock and nothing that iterates; :func:`_file_deaths` files it under the lock."""
    lid = lease.lease_id
    w = _watch.get(lid)
    if w is None:
        w = _pending.get(lid)
        if w is None:
            return
    _deaths.append((lid, w.region.generation, time.perf_counter() - _T0))


def _file_deaths() -> None:
    """(Under _lock.) File the deaths the release hook saw: a confirmed retention's becomes its death mark
    (and it is watched no more), a pending one's waits on its record for the decision."""
    while _deaths:
        try:
            lid, generation, t = _deaths.popleft()
        except IndexError:  # (another thread filed it)
            break
        _watch.pop(lid, None)
        if lid in _confirmed:
            _marks.setdefault(lid, {}).setdefault("death", {"generation": generation, "t": t})
            continue
        p = _pending.get(lid)
        if p is not None and p.death is None:
            p.death = (generation, t)


def on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    """Record a pending retention for every victim still reachable (decided after its consumer's turn)."""
    state = runtime.state
    if not state.enabled:
        return
    _checkpoint(_lends)  # what was retired before the last lend has been decided by now
    eid, t = _last_reuse
    if eid != event.event_id:  # no reuse hook (timeline_events=0 at the first enable) or another thread's
        t = _now()
    thread = threading.current_thread().name
    running = None
    with _lock:
        for lease in victims:
            # alive: still reachable, a rescued lease included (its death is its copy's)
            if lease.handle is None or not lease.alive:
                continue
            if running is None:
                running = _running_code()
            _pending[lease.lease_id] = _Pending(lease, event, region, t, _lends, _site_key(lease, event), thread,
                                                running)


def _running_code() -> Tuple[frozenset, frozenset]:
    """The code running on this thread now (function frames, and module globals of module-level code):
    a plain local or global of it that holds a victim may be a loop variable about to move on."""
    frames, modules = set(), set()
    frame = sys._getframe(2)
    try:
        for _ in range(_RUNNING_DEPTH):  # ours included: a holder is never one of our frames anyway
            if frame is None:
                break
            if frame.f_code.co_flags & CO_OPTIMIZED:
                frames.add(id(frame))
            else:
                modules.add(id(frame.f_globals))
            frame = frame.f_back
    finally:
        del frame
    return frozenset(frames), frozenset(modules)


def _was_running(h: Holder, p: _Pending) -> bool:
    """Was ``h`` a plain local (or module global) of code running when ``p`` was retired?"""
    pattern = h.pattern
    if pattern is None:
        return h.transient
    if h.kind in ("frame", "generator") and h.frame_id is not None:
        return h.frame_id in p.running[0] and not pattern[1]
    if h.kind == "global" and len(pattern[1]) == 1:
        root = pattern[0]()
        return root is not None and id(root) in p.running[1]
    return False


# -- deciding --------------------------------------------------------------------
def _scan_errors() -> None:
    """Note the leases that errors named since the last look (and when a retained one was read stale)."""
    global _errors_seen
    state = runtime.state
    errs = state.errors
    if len(errs) < _errors_seen:  # clear_errors()
        _errors_seen = 0
    if len(errs) == _errors_seen:
        return
    with state.lock:
        new = errs[_errors_seen:]
        _errors_seen = len(errs)
    for e in new:
        lease = e.get("lease") if isinstance(e, dict) else None
        lid = lease.get("lease_id") if isinstance(lease, dict) else None
        if lid is None:
            continue
        _used.add(lid)
        if e.get("kind") == "stale_use":
            _stale_read.add(lid)
            marks = _marks.setdefault(lid, {})
            used_at = (e.get("used_at") or [None])[0]
            if "stale_read" not in marks:
                marks["stale_read"] = {"generation": _generation_now(lid), "t": _now(), "at": used_at}
            elif marks["stale_read"].get("at") is None:
                marks["stale_read"]["at"] = used_at


def _generation_now(lease_id: int) -> Optional[int]:
    """The generation of the lease's buffer now (for the timeline's x axis)."""
    lease = _lease_object(lease_id)
    region = _regions.get(lease.region_id) if lease is not None else None
    if region is None and lease is not None:
        try:
            region = runtime.state.ledger.region(lease.region_id)
        except Exception:
            region = None
    if region is not None:
        return region.generation
    return None


def _lease_object(lease_id: int) -> Optional[Lease]:
    p = _pending.get(lease_id)
    if p is not None:
        return p.lease
    w = _watch.get(lease_id)
    if w is not None:
        return w.lease
    entry = _retained.get(lease_id)
    return entry[1] if entry is not None else None


def _was_used(lease_id: int) -> bool:
    return lease_id in _used or lease_id in runtime.state.error_counts


def _held(p: _Pending) -> bool:
    """Is the lease's memory still reachable? (no heap access; a rescued lease's death is its copy's)"""
    return p.lease.alive


def _checkpoint(limit: int, final: bool = False) -> None:
    """Decide the pending retentions recorded before lend number ``limit`` (all of them when ``final``)."""
    with _lock:
        _scan_errors()
        _file_deaths()
        if _pending:
            due = [p for p in _pending.values() if final or p.lends < limit]
            for p in due:
                if _pending.pop(p.lease.lease_id, None) is None:
                    continue  # decided meanwhile (a walk can run a finalizer that reports)
                _decide(p, evidence=final and p.lends >= _lends)


def _decide(p: _Pending, evidence: bool) -> None:
    used = _was_used(p.lease.lease_id)
    if not used and not _held(p):
        return  # dropped once its consumer had its turn: a loop variable, not a retention
    _confirm(p, used_stale=p.lease.lease_id in _stale_read, evidence=evidence and not used)


def settle(final: bool = False) -> None:
    """Confirm or drop pending retentions whose consumer has had its turn.

    A pending one is decided once a lend happened after it, or at once when
    ``final`` (end of a test, of the process): then, with no lend since, only
    a holder other than a local of the running code confirms it (nothing else
    tells a loop variable from a retention).
    """
    _checkpoint(_lends, final)


def _confirm(p: _Pending, used_stale: bool, evidence: bool) -> Optional[dict]:
    """Name the holder of a confirmed retention and record it (None: no evidence, dropped)."""
    lease = p.lease
    state = runtime.state
    opts = state.options
    key = lease.handle if lease.alive else None  # (a rescued lease's storage is the same, now owning a copy)
    site = _sites.setdefault(p.site_key, _Site())
    found: List[Holder] = []
    walk: Dict[str, Any] = {"when": "skipped", "ms": 0.0, "tensors": 0, "truncated": False}
    if key is not None and opts["triage_budget_ms"] > 0:
        found, walk = _name(key, site, evidence, opts)
    if evidence:
        found = [h for h in found if not h.transient and not _was_running(h, p)]
        if not found:
            return None  # nothing but the running code's own locals: cannot tell it from a loop variable
    else:
        # The consumer has had its turn: a local that still holds the view is a real holder.
        found = [_promote(h) if h.transient else h for h in found]
    found.sort(key=lambda h: h.rank)
    best = found[0] if found else None
    if best is not None and walk["when"] != "counted":
        _holders.remember(best)
        ident = (consumer_key(best.path), _site_text(best.site))
        if site.consumer == ident:
            site.same += 1
        else:
            site.consumer, site.same = ident, 1
            site.holder = Holder(best.kind, ident[0], best.site)
    where = best.path if best else "something the walk could not name (walk skipped or out of budget)"
    summary = f"borrowed view {lease.describe()} was still held by {where} when {p.event.describe()}"
    if walk["when"] == "counted":
        summary += f" (counted: the {walk['like']} before it from the same lend and reuse sites were held there)"
    record = {
        "kind": "retention",
        "summary": summary,
        "lease": lease.to_dict(),
        "event": p.event.to_dict(),
        "holder": best.to_dict() if best else None,
        "holders": [h.to_dict() for h in found],
        "lent_at": (to_records(lease.site[:1]) or [None])[0],
        "reused_at": (to_records(p.event.site[:1]) or [None])[0],
        "used_stale": used_stale,
        "rescued": lease.rescued,
        "walk": walk,
        "thread": p.thread,
        "pid": os.getpid(),
    }
    record = runtime.record_event("retention", record)
    if len(_confirmed) >= _RETAINED_KEPT:  # a long run's memory stays bounded: forget the oldest half
        for lid in list(_confirmed)[: _RETAINED_KEPT // 2]:
            for d in (_confirmed, _retained, _marks, _watch):
                d.pop(lid, None)
    lid = lease.lease_id
    _confirmed[lid] = record
    lent_t = next((t for t, l in reversed(_lent) if l is lease), None)
    _retained[lid] = (lent_t, lease, p.event, p.t)
    if lease.region_id not in _regions:
        _remember_region(lease.region_id)
    _file_deaths()  # a death the hook saw while it was pending (or while it was being named) is exact
    if "death" in _marks.get(lid, ()):
        pass
    elif p.death is not None:
        _marks.setdefault(lid, {})["death"] = {"generation": p.death[0], "t": p.death[1]}
    elif lease.alive:
        _watch[lid] = _Watched(lease, p.region)  # from now on the release hook notes its death
        if not lease.alive:  # died just now: the hook may have looked before the line above
            _file_deaths()
            if _watch.pop(lid, None) is not None:
                _note_death(lease)
    else:
        _note_death(lease)  # died between its pop from the pending ones and now: the hook looked nowhere
    return record


def _name(key: int, site: _Site, evidence: bool, opts: Any) -> Tuple[List[Holder], Dict[str, Any]]:
    """The holders of storage ``key``: a known path, else counted as its site's holder, else a heap walk."""
    start = time.perf_counter()
    if not evidence:  # (a known path may run through a loop variable: only a walk tells a transient apart)
        found = _holders.replay({key}).holders.get(key) or []
        if found:
            return found, {"when": "known-path", "ms": _ms(start), "tensors": len(found), "truncated": False}
    if not evidence and site.same >= SAME_HOLDER and site.holder is not None:
        return [site.holder], {"when": "counted", "ms": _ms(start), "tensors": 0, "truncated": False,
                               "like": site.same}
    result = find_holders({key}, depth=opts["triage_depth"], budget_ms=opts["triage_budget_ms"], replay=False)
    return result.holders.get(key, []), {"when": "walk", "ms": _ms(start), "tensors": result.tensors,
                                         "truncated": result.truncated}


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000.0, 3)


def _site_text(site: Optional[dict]) -> Optional[str]:
    if not site or not site.get("file"):
        return None
    return f"{site['file']}:{site.get('line')}"


def _promote(h: Holder) -> Holder:
    return Holder(h.kind, h.path, h.site, False, h.frame_id, h.local, h.pattern, h.detour)


def _mark_stale_read(lease: Lease) -> None:
    """A use of a retired lease is being reported now: note the generation its buffer is at (the timeline's
    end of the red box). Errors reach :func:`holder_of` as they are built, so this is exact."""
    if lease.stale_by is None:
        return
    marks = _marks.setdefault(lease.lease_id, {})
    if "stale_read" not in marks:
        marks["stale_read"] = {"generation": _generation_now(lease.lease_id), "t": _now(), "at": None}


def _note_death(lease: Lease) -> None:
    """(Under _lock.) A death the release hook could not see (the lease was in no table then): noted now."""
    _marks.setdefault(lease.lease_id, {}).setdefault(
        "death", {"generation": _generation_now(lease.lease_id), "t": _now()})


# -- queries ---------------------------------------------------------------------
def retentions() -> List[dict]:
    """Confirmed retention records so far (pending ones whose consumer had its turn are decided first)."""
    settle()
    return runtime.events("retention")


def holder_of(lease_id: int) -> Optional[dict]:
    """The holder of a lease (for an error about it). A pending lease that is being used is confirmed
    now: a use after its reuse is a retention whatever happens next. Set as the errors' holder lookup."""
    with _lock:
        _file_deaths()
        p = _pending.pop(lease_id, None)
        if p is not None:
            _mark_stale_read(p.lease)
            record = _confirm(p, used_stale=p.lease.stale_by is not None, evidence=False)
            return record["holder"] if record else None
        record = _confirmed.get(lease_id)
        if record is not None:
            w = _watch.get(lease_id)
            if w is not None:
                _mark_stale_read(w.lease)
            return record.get("holder")
    for e in runtime.events("retention"):
        if e["lease"].get("lease_id") == lease_id:
            return e.get("holder")
    return None


def pending_count() -> int:
    """Retentions recorded at a reuse whose consumer has not had its turn yet (decided later)."""
    with _lock:
        return len(_pending)


def timeline() -> Dict[str, Any]:
    """The report's ``timeline`` section: each staging buffer's recent lends, reuses and retained leases.

    ``leases``: the most recent lends (``timeline_events``) and every confirmed retention, each with
    its bytes, the generation it was lent at, the reuse that retired it, and for a retention its
    holder and what ended it (a stale read, its death, or nothing yet), each at the generation and
    time it happened. ``events``: the most recent reuses, retires and closes of those buffers
    (``timeline_events`` of them, whether or not they retired a live lease) and the reuses that
    retired the retained leases. ``t`` is seconds since the sanitizer was imported (None only for
    a reuse that retired a lease and has itself left the most recent ones: the trace places it
    between its neighbours)."""
    with _lock:
        _scan_errors()
        _file_deaths()
        on = bool(runtime.state.options["timeline_events"])
        entries: Dict[int, Tuple[Optional[float], Lease]] = {}
        for t, lease in (_lent if on else ()):
            entries[lease.lease_id] = (t, lease)
        retired: Dict[int, ReuseEvent] = {}  # lease id -> the reuse that retired a retained one
        event_t: Dict[int, float] = {}
        for lid, (t, lease, ev, ev_t) in _retained.items():
            entries.setdefault(lid, (t, lease))
            retired[lid] = ev
            event_t[ev.event_id] = ev_t
        reuses = list(_reuses) if on else []
        regions = dict(_regions)
        marks = {lid: dict(m) for lid, m in _marks.items()}
        confirmed = dict(_confirmed)
        cap, dropped = _lent.maxlen or 0, max(0, _lent_total - len(_lent))
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
        rec = confirmed.get(lid)
        retained = None
        if rec is not None:
            m = marks.get(lid, {})
            end = m.get("stale_read") or m.get("death")
            until = "stale_read" if "stale_read" in m else "death" if "death" in m else "alive"
            holder = rec.get("holder") or {}
            retained = {"holder": holder.get("path"), "consumer": holder.get("consumer"),
                        "kind": holder.get("kind"), "until": until,
                        "generation": end.get("generation") if end else None, "t": end.get("t") if end else None,
                        "read_at": (m.get("stale_read") or {}).get("at"),
                        "died_generation": (m.get("death") or {}).get("generation"),
                        "counted": rec.get("walk", {}).get("when") == "counted"}
        leases.append({
            "lease_id": lid, "buffer": lease.region_id, "name": lease.name, "dtype": lease.dtype,
            "shape": list(lease.shape), "byte_range": [lease.start, lease.end], "generation": lease.generation,
            "pid": pid, "t": None if t is None else round(t, 6), "retired_by": None if ev is None else ev.event_id,
            "alive": bool(lease.alive and not lease.rescued), "rescued": lease.rescued, "retained": retained,
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
        if r is None:
            continue
        buffers.append({"id": rid, "pid": pid, "name": r.name, "device": r.device, "nbytes": r.nbytes,
                        "generation": r.generation, "closed": r.closed})
    return {"cap": cap, "dropped": dropped, "buffers": buffers, "leases": leases, "events": out_events}


# -- lifecycle -------------------------------------------------------------------
def reset() -> None:
    """Forget pending retentions, site statistics and the timeline (tests, a new pytest test)."""
    global _errors_seen, _lent_total, _last_reuse
    with _lock:
        for d in (_pending, _watch, _sites, _confirmed, _retained, _marks, _regions):
            d.clear()
        _deaths.clear()
        _lent.clear()
        _reuses.clear()
        _lent_total = 0
        _last_reuse = (-1, 0.0)
        _used.clear()
        _stale_read.clear()
        _errors_seen = len(runtime.state.errors)


def clear() -> None:
    """Forget pending retentions, site statistics, the timeline and the retention records (tests)."""
    reset()
    runtime.forget_events("retention")


def _on_enable(options: Dict[str, Any]) -> None:
    """Arm triage: the release hook (death marks of retentions) at every enable, the reuse hook while the
    timeline is on. Never installed while the sanitizer was never enabled: a lease's death and a reuse
    then cost nothing."""
    cap = options.get("timeline_events", 0)
    with _lock:
        if not cap:
            _lent.clear()  # no timeline: the retained leases alone are kept (the report names them anyway)
        _resize(cap)
    runtime.add_release_hook(on_release)
    if cap:
        runtime.add_reuse_hook(on_reuse)


def install() -> None:
    """Register the hooks (idempotent) and name holders in the errors' text. Called by the composition root;
    the release and reuse hooks are registered by :func:`enable` (see :func:`_on_enable`)."""
    runtime.add_lend_hook(on_lend)
    runtime.add_retire_hook(on_retire, ORDER)
    runtime.on_enable(_on_enable)
    _errors.holder_lookup = holder_of


__all__ = ["install", "settle", "retentions", "holder_of", "pending_count", "timeline", "reset", "clear",
           "on_retire", "on_lend", "on_reuse", "on_release", "ORDER", "SAME_HOLDER"]
