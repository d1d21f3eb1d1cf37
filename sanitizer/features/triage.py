"""Retentions: a reuse retired a lease that something still held; name that something.

A retire hook (order 300, after checksums and rescue, before poison) sees every
lease that a reuse or close retires while it is alive, and walks the heap from
its tensors to the holder (see :mod:`sanitizer.features.holders`).

Not every alive victim is a retaining consumer: in ``for name, w in loader:``
the loop variable still holds the previous view while the loader fetches the
next one, and drops it a moment later. So a retention is recorded *pending* at
the reuse and **confirmed** only if the lease is still held at the next
check point after a new lend (a later reuse, the report, the end of a test or
of the process), or was used stale meanwhile. Transients are dropped, and a
reuse site whose victims keep turning out transient stops being walked at
reuse time (they are walked only if one is confirmed), so a correct loader loop
does not pay a heap walk per tensor.

The walk runs whenever the sanitizer is enabled (debug mode). ``triage=1``
additionally makes every error recorded, never raised, so the program runs to
the end and the report lists every retaining consumer.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from sanitizer.torch_layer import runtime
from sanitizer.features.holders import Holder, find_holders, still_holding
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.sites import to_records

ORDER = runtime.RetireOrder.TRIAGE
TRANSIENT_STREAK = 2  # after this many transient victims in a row, a site is walked only on confirmation

_lock = threading.RLock()
_lends = 0


@dataclass
class _Pending:
    lease: Lease
    event: ReuseEvent
    lends: int  # the lend counter when it was retired
    site_key: Tuple[Any, ...]
    thread: str
    holders: Optional[List[Holder]] = None  # None: not walked at reuse time
    walk: Dict[str, Any] = field(default_factory=dict)
    refs: List[Any] = field(default_factory=list)  # weakrefs to the tensors the walk found
    site_transient: bool = False  # not walked: this site's victims kept turning out transient


_pending: Dict[int, _Pending] = {}  # lease id -> pending retention
_streak: Dict[Tuple[Any, ...], int] = {}  # (lend site, reuse site) -> transient victims in a row


def _site_key(lease: Lease, event: ReuseEvent) -> Tuple[Any, ...]:
    return (lease.site[:1], event.site[:1])


def on_lend(lease: Lease, view: Any) -> None:
    global _lends
    _lends += 1


def on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    """Record a pending retention for every victim still alive; walk to its holder if worth it."""
    state = runtime.state
    if not state.enabled:
        return
    settle()
    alive = [lease for lease in victims if lease.alive and lease.handle is not None]
    if not alive:
        return
    opts = state.options
    budget = opts.get("triage_budget_ms", 1000)
    walk_now = [lease for lease in alive
                if budget > 0 and _streak.get(_site_key(lease, event), 0) < TRANSIENT_STREAK]
    result = None
    if walk_now:
        result = find_holders({lease.handle for lease in walk_now}, depth=opts.get("triage_depth", 8),
                              budget_ms=budget)
    thread = threading.current_thread().name
    with _lock:
        for lease in alive:
            p = _Pending(lease, event, _lends, _site_key(lease, event), thread)
            p.site_transient = _streak.get(p.site_key, 0) >= TRANSIENT_STREAK
            if result is not None and lease in walk_now:
                p.holders = result.holders.get(lease.handle, [])
                p.refs = result.refs.get(lease.handle, [])
                p.walk = {"when": "reuse", "ms": round(result.ms, 3), "tensors": result.tensors,
                          "truncated": result.truncated}
            _pending[lease.lease_id] = p


def _leases_with_errors(kind: Optional[str] = None) -> Set[int]:
    """Lease ids named by recorded errors (of ``kind``; any kind, counted ones included, if None)."""
    with runtime.state.lock:
        ids = {e["lease"].get("lease_id") for e in runtime.state.errors
               if isinstance(e.get("lease"), dict) and (kind is None or e.get("kind") == kind)}
        if kind is None:
            ids.update(runtime.state.error_counts)
    return ids


def _still_held(p: _Pending) -> bool:
    """Is the lease's memory still reachable? A rescued lease stays 'alive' in the ledger, so ask its tensors."""
    if p.lease.rescued:
        return any(ref() is not None for ref in p.refs) if p.refs else True
    return p.lease.alive


def _all_transient(p: _Pending) -> bool:
    if p.holders is None:
        return p.site_transient  # not walked because its site's victims kept turning out transient
    return bool(p.holders) and all(h.transient for h in p.holders)


def settle(final: bool = False) -> None:
    """Confirm or drop pending retentions.

    A pending one is decided once a lend happened after it (the consumer had
    its turn), or at once when ``final`` (end of a test, of the process).
    """
    with _lock:
        if not _pending:
            return
        used = _leases_with_errors()
        for lease_id, p in list(_pending.items()):
            if not final and p.lends == _lends and lease_id not in used:
                continue
            del _pending[lease_id]
            if lease_id not in used and p.lends == _lends and _all_transient(p):
                # Decided without a lend since (end of test or process): nothing tells a loop variable
                # from a retention, and the view was never used stale. Not reported.
                continue
            if lease_id in used or _still_held(p):
                _confirm(p, lease_id in _leases_with_errors("stale_use"))
            else:
                _streak[p.site_key] = _streak.get(p.site_key, 0) + 1


def _confirm(p: _Pending, used_stale: bool) -> None:
    _streak[p.site_key] = 0
    lease = p.lease
    state = runtime.state
    if p.holders is None and lease.alive and state.options["triage_budget_ms"] > 0:
        result = find_holders({lease.handle}, depth=state.options["triage_depth"],
                              budget_ms=state.options["triage_budget_ms"])
        p.holders = result.holders.get(lease.handle, [])
        p.walk = {"when": "confirm", "ms": round(result.ms, 3), "tensors": result.tensors,
                  "truncated": result.truncated}
    holders = list(p.holders or [])
    # A plain local of the reusing thread's frame that still holds the view after a lend
    # is a real holder (not a loop variable); one that no longer does was transient.
    keys = {lease.handle}
    kept = [h if not h.transient or not still_holding(h, keys) else _promote(h) for h in holders]
    holders = [h for h in kept if not h.transient] or kept
    holders.sort(key=lambda h: h.rank)
    best = holders[0] if holders else None
    where = best.path if best else "something the walk could not name (walk skipped or out of budget)"
    record = {
        "kind": "retention",
        "summary": f"borrowed view {lease.describe()} was still held by {where} when {p.event.describe()}",
        "lease": lease.to_dict(),
        "event": p.event.to_dict(),
        "holder": best.to_dict() if best else None,
        "holders": [h.to_dict() for h in holders],
        "lent_at": (to_records(lease.site[:1]) or [None])[0],
        "reused_at": (to_records(p.event.site[:1]) or [None])[0],
        "used_stale": used_stale,
        "rescued": lease.rescued,
        "walk": p.walk or {"when": "skipped", "ms": 0.0, "tensors": 0, "truncated": False},
        "thread": p.thread,
        "pid": os.getpid(),
    }
    runtime.record_event("retention", record)


def _promote(h: Holder) -> Holder:
    return Holder(h.kind, h.path, h.site, False, h.frame_id, h.local)


def retentions() -> List[dict]:
    """Confirmed retention records so far (pending ones whose consumer had its turn are decided first)."""
    settle()
    return runtime.events("retention")


def holder_of(lease_id: int) -> Optional[dict]:
    """The holder recorded for a lease (confirmed or pending), for annotating its stale uses."""
    with _lock:
        p = _pending.get(lease_id)
        if p is not None and p.holders:
            return p.holders[0].to_dict()
    for e in runtime.events("retention"):
        if e["lease"].get("lease_id") == lease_id:
            return e.get("holder")
    return None


def pending_count() -> int:
    """Retentions recorded at a reuse whose consumer has not had its turn yet (decided later)."""
    with _lock:
        return len(_pending)


def reset() -> None:
    """Forget pending retentions and site statistics (tests, a new pytest test)."""
    with _lock:
        _pending.clear()
        _streak.clear()


def clear() -> None:
    """Forget pending retentions, site statistics and the retention records (tests)."""
    reset()
    runtime.forget_events("retention")


def install() -> None:
    runtime.add_lend_hook(on_lend)
    runtime.add_retire_hook(on_retire, ORDER)


__all__ = ["install", "settle", "retentions", "holder_of", "pending_count", "reset", "clear", "on_retire", "on_lend", "ORDER"]
