"""Retentions: a reuse retired a lease that something still held; name that something.

**The rule.** A retire hook (order 300, after checksums and rescue, before
poison) records every lease that a reuse or close retires while it is still
reachable as *pending*. In ``for name, w in loader:`` the loop variable still
holds the previous view while the loader fetches the next one, and drops it a
moment later, so a pending lease is decided only once its consumer has had its
turn: at the next lend but one, at the next retirement or report after a lend,
at the end of a test or of the process, or at once when it is used stale.
Still held then, or used stale meanwhile: a **retention**. Gone: forgotten.

**Another thread may still be dropping it.** The lend count is one thread's turn, not
every thread's: a loader thread can lend twice while the consumer's thread has not run
yet, or is in the middle of ``views.clear()`` (5,000 views, each death a callback that
lets other threads run). The reused view is then still alive, held by a list about to go
or only by its detached items (which no walk can see), and it dies a moment later:
nobody kept it (issue 46). So while other threads run, a retention whose holder nothing
names (the walk found none, or only what Python cannot see, or did not run) is decided
only once the other threads have had their turn: :func:`_quiet_s` (at least 0.1 s) after
its reuse, and later while another running thread is still dropping leases of the same
buffer (a container torn down there), up to :data:`_LONGEST_WAIT` times that. Alone in
the process, or at the final settle, it is decided at once. And every decision takes its
last look at the lease right before it records it. A named holder is evidence and is not
kept waiting. The price: a view that nothing nameable holds, kept across the reuse and
dropped within that wait (or before the next look after it), is not reported.

**The check is cheap and never by address.** "Still held" is the lease's
liveness (``lease.alive``: its storage's death is a weakref callback), rescued
leases included: a rescue rebinds the lease's death to its owned copy, so
``alive`` turns False when the last view of the copy goes. A storage address
is handed to the holder walk only while its lease is alive.

**Naming, only for a confirmed retention, and only by what holds that very view.**
On a reused ring every lease has the same bytes and the same lend and reuse sites,
so a holder is credited with a lease only where its own storage was found: first by
the holder paths named before, followed again from their roots (a consumer keeps
its next weight where it kept the last: a few container steps, see
:mod:`sanitizer.features.holders`), at the reuse while the storing code still runs
and again when the retention is decided; then from the other instances of a known
holder's class; otherwise a bounded heap walk names it.

**A stale use** reaches triage through the runtime's stale-use hook, before the
error is built: a pending lease is confirmed then and there, the stale read is
noted (in the retention record and the timeline), and the holder goes into the
error as a plain value. The timeline's flight log is a separate object
(:mod:`sanitizer.features.timeline_log`) that triage tells what it decided.

The walk runs whenever the sanitizer is enabled (debug mode). ``triage=1``
additionally makes every error recorded, never raised, so the program runs to
the end and the report lists every retaining consumer. Triage and its log each
guard their state with their own lock; :func:`reset` replaces both.
"""
from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass
from inspect import CO_OPTIMIZED
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from sanitizer.core import forking
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.describe import describe_event, describe_lease
from sanitizer.core.options import Options
from sanitizer.core.sites import in_a_loop, site_text, to_records
from sanitizer.features import aliases as _aliases
from sanitizer.features import holders as _holders
from sanitizer.features.holder import Holder
from sanitizer.features.holders import find_holders
from sanitizer.features.store_site import held_shape, stored_at
from sanitizer.features.timeline_log import TimelineLog
from sanitizer.torch_layer import records
from sanitizer.torch_layer.hooks import (HOOKS, RetireOrder, StaleUse, add_enable_hook, add_lend_hook,
                                         add_release_hook, add_retire_hook, add_reuse_hook, add_stale_use_hook)
from sanitizer.torch_layer.state import state

ORDER = RetireOrder.TRIAGE
_RUNNING_DEPTH = 24  # frames of the retiring thread noted at a retire (a loop variable lives a few above it)
_CONFIRMED_KEPT = 20000  # retention records triage remembers by lease (the store's records are capped anyway)
_REBOUND_LOCALS = ("frame", "generator")  # holder kinds a known path may not name alone (_name_cheaply)
_QUIET_S = 0.1  # at least: how long other threads get to drop a view before an unnamed retention is decided
_LONGEST_WAIT = 10  # times that, while another thread keeps dropping leases of the same buffer
_REGIONS_KEPT = 4096  # buffers whose latest lease deaths are remembered (then the table starts afresh)


@dataclass
class _Pending:
    lease: Lease
    event: ReuseEvent
    region: Region  # the lease's buffer (the timeline's death mark reads its generation)
    t: float  # when it was retired (the reuse's time)
    lends: int  # the lend counter when it was retired
    thread: str
    running: Tuple[frozenset, frozenset] = (frozenset(), frozenset())  # (frame ids, module dict ids) at the retire
    early: Optional[List[Holder]] = None  # its holders at the reuse, by a known path (the consumer's own frame alive)
    since: float = 0.0  # time.monotonic() at the retire (how long other threads have had to drop it)
    # A container of a function running the retire (on this thread) held it after its bytes were reused:
    # a retention even if it dies before its turn is decided (the function returned, dropping the list).
    kept: bool = False


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
    return _ran(h, p.running)


def _ran(h: Holder, running: Tuple[frozenset, frozenset]) -> bool:
    """Was ``h`` a plain local (or module global) of the code in ``running`` (:func:`_running_code`)?"""
    pattern = h.pattern
    if pattern is None:
        return h.transient
    if h.kind in ("frame", "generator") and h.frame_id is not None:
        return h.frame_id in running[0] and not pattern[1]
    if h.kind == "global" and len(pattern[1]) == 1:
        root = pattern[0]()
        return root is not None and id(root) in running[1]
    return False


def _kept_by_running(h: Holder, running: Tuple[frozenset, frozenset]) -> bool:
    """Was ``h`` an entry of a list, tuple or dict local to a function running on the retiring thread (the
    consumer that is lending and keeping, not another thread tearing a list down)?"""
    pattern = h.pattern
    return (h.kind in ("frame", "generator") and h.frame_id is not None and h.frame_id in running[0]
            and pattern is not None and any(seg[0] in ("i", "k") for seg in pattern[1]))


def _by_consumer(found: List[Holder]) -> List[Holder]:
    """Best first, one holder per consumer (a consumer that holds the view twice is named once). A path
    through the sanitizer's own objects (a DeferralScope's retained calls, a rescue table) is never a
    consumer beside a user's holder: only when nothing else names the view."""
    if len(found) == 1:  # the common case (a ring load: every view kept in one place), nothing to rank
        return list(found)
    found = [h for h in found if not h.detour] or found
    found = [h for h in found if not _in_transit(h)] or found
    found = _without_readers(found)
    out: Dict[str, Holder] = {}
    # Rank, then the consumer's text: the same program names the same holder first every run, whether
    # a walk or a known path found them (and in which order).
    # What held it at its reuse while the storing code ran comes first: the consumer to fix.
    for h in sorted(found, key=lambda h: (not h.at_reuse, h.rank, h.local is not None and not h.pattern_steps,
                                          h.consumer)):
        out.setdefault(h.consumer, h)
    return list(out.values())


_COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")
_STDLIB_DIR = sysconfig.get_paths().get("stdlib") or ""


def _in_transit(h: Holder) -> bool:
    """A holder nobody fixes: a running comprehension's variable (it reads what it iterates), or a local of
    the standard library's own code (``concurrent.futures``' work item carrying a result to its Future).
    Named only when nothing else holds the view; never beside a holder in the user's or a library's code."""
    if h.kind not in ("frame", "generator"):
        return False
    site = h.site or {}
    if (site.get("function") or "").rsplit(".", 1)[-1] in _COMPREHENSIONS:
        return True
    path = site.get("file") or ""
    return bool(_STDLIB_DIR) and path.startswith(_STDLIB_DIR + os.sep) and "-packages" + os.sep not in path


def _bare_name(h: Holder) -> bool:
    """Is ``h`` a name bound to the tensor itself (a local, a generator's local, a module global)?"""
    if h.pattern is None:
        return False
    steps = [seg for seg in h.pattern[1] if seg[0] not in ("al", "x")]
    return not steps or (len(steps) == 1 and steps[0][0] in ("g", "l"))


def _without_readers(found: List[Holder]) -> List[Holder]:
    """Drop a bare name (a local or a global, no container below it) bound to the very tensor another holder
    keeps in a container or an attribute: ``for old in self.cache.values(): float(old.sum())`` leaves
    ``old`` on a cached view; it reads what the cache holds, and owning the tensor where the cache stores
    it fixes both, so it is not a consumer of its own. A function's bare local is dropped beside such a
    holder whatever tensor of the view it is bound to (``param`` before ``setattr(module, name,
    Parameter(param))``: the loop variable of a loader that hands each view on); a module global only when
    it is that very tensor (module code may mean to keep it)."""
    bare = [h for h in found if _bare_name(h)]
    if not bare or len(bare) == len(found):
        return found
    found = [h for h in found if not (_bare_name(h) and h.kind in ("frame", "generator"))]
    bare = [h for h in found if _bare_name(h)]
    if not bare:
        return found
    kept_objects = set()
    for h in found:
        if h.pattern is not None and not _bare_name(h):
            obj = _holders.resolve(h.pattern)
            if obj is not None:
                kept_objects.add(id(obj))
            del obj  # (ids compared while every holder still holds its object: none is reused meanwhile)
    if not kept_objects:
        return found
    readers = set()
    for h in bare:
        obj = _holders.resolve(h.pattern)
        if obj is not None and id(obj) in kept_objects:
            readers.add(id(h))
        del obj
    return [h for h in found if id(h) not in readers]


def _holder_record(h: Holder, also: Sequence[Holder], lease: Lease, exported: Sequence[dict]) -> Dict[str, Any]:
    """A holder as the records carry it: who, where the holder lives, where it stored the view (the line a
    fix changes), the other consumers holding the same view, the aliases of it."""
    rec = h.to_dict(lease.name)
    found = stored_at(h.store_target(), lease.site, h.site, _held_shape(h, lease))
    if found is None and h.kind == "closure":  # made where it was lent: the binding of its variable
        found = stored_at(h.closure_binding(), lease.site, h.site, _held_shape(h, lease))
    candidates = found.pop("candidates", None) if found else None
    rec["stored_at"] = found
    if candidates:  # several statements store into that container alike: which one did is not known
        rec["stored_candidates"] = candidates
    if also:
        rec["also"] = [_holder_record(o, (), lease, ()) for o in also]
    if exported:
        rec["aliases"] = list(exported)
    return rec


def _with_others(each: List[Dict[str, Any]], exported: Sequence[dict]) -> Dict[str, Any]:
    """The first holder's record with the others as its ``also`` (copies: the record and ``holders`` share
    nothing) and the aliases of the view."""
    rec = dict(each[0])
    if len(each) > 1:
        rec["also"] = [dict(o) for o in each[1:]]
    if exported:
        rec["aliases"] = list(exported)
    return rec


def _reaches(h: Holder, lease: Lease) -> bool:
    """Does ``h``'s path still lead to a tensor of ``lease``'s storage?"""
    t = _holders.resolve(h.pattern)
    try:
        return t is not None and t.untyped_storage()._cdata == lease.handle
    except Exception:
        return False


def _held_shape(h: Holder, lease: Lease) -> Optional[str]:
    """What ``h`` holds of the lease's view (``same``, ``slice``, ``transpose``, ``reshape``), read from
    the tensor its path reaches now (or when :meth:`Triage._still_early` just followed it); None when
    the path no longer reaches one."""
    if h.held is not None:
        return h.held
    return _shape_of(_holders.resolve(h.pattern), lease)


def _shape_of(t: Any, lease: Lease) -> Optional[str]:
    if t is None or not hasattr(t, "storage_offset"):
        return None
    try:
        item = t.element_size()
        return held_shape(tuple(t.shape), tuple(t.stride()), t.storage_offset() * item, t.numel() * item,
                          lease.shape, lease.nbytes)
    except Exception:  # a tensor subclass without strides, a sparse layout
        return None


def _quiet_s() -> float:
    """How long other threads get to drop a view before an unnamed retention of it is decided: enough
    switch intervals for each of a few runnable threads to have its turn (and at least 0.1 s)."""
    return max(_QUIET_S, 20 * sys.getswitchinterval())


_get_ident = threading.get_ident
_monotonic = time.monotonic
_ACTIVE: Dict[int, threading.Thread] = getattr(threading, "_active", {})  # ident -> Thread, while it runs


def _python_thread(ident: int) -> Optional[threading.Thread]:
    """The ``threading.Thread`` running as ``ident`` (None: one ``threading`` does not know). A plain dict
    read: this runs at every lease death, possibly inside the GC, so no lock and nothing made (asking
    ``threading.current_thread()`` would make a dummy thread for a native one; ``sys._current_frames()``
    would make frame objects of other threads' running code, whose locals then die wherever that dict
    goes, in the GC too)."""
    return _ACTIVE.get(ident)


def _unnamed(named: Optional[Tuple[List[Holder], Dict[str, Any]]]) -> bool:
    """Did the naming find no holder with a root (none, only what Python cannot see, or anonymous
    containers the walk could not follow further)? A container being torn down on another thread looks
    like this: its items are no longer reachable from anything the gc shows."""
    return named is None or all(h.kind == "unknown" for h in named[0])


def _promote(h: Holder) -> Holder:
    """A local that still holds the view after its consumer had its turn is a real holder."""
    return Holder(h.kind, h.path, h.site, False, h.frame_id, h.local, h.pattern, h.detour)


_SKIPPED: Dict[str, Any] = {"when": "skipped", "ms": 0.0, "tensors": 0, "truncated": False}


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000.0, 3)


class Triage:
    """Decides retentions and names their holders (one per process; :func:`reset` replaces it)."""

    def __init__(self, log: TimelineLog) -> None:
        self._lock = threading.RLock()
        self.log = log
        self.lends = 0
        self._lender = 0  # the thread that made the last lend (its ident)
        self._pending: Dict[int, _Pending] = {}  # lease id -> pending retention
        self._confirmed: Dict[int, dict] = {}  # lease id -> its retention record
        self._used_stale: Set[int] = set()  # lease ids used stale (reported through the stale-use hook)
        # lease id -> the holders its retention was credited to, best first (to re-check at a stale read)
        self._best: Dict[int, List[Holder]] = {}
        self._at_read: Dict[int, Optional[dict]] = {}  # lease id -> its holder when first read stale
        # Unnamed retentions waiting for the other threads' turn (lease id -> pending), and when each thread
        # last saw a lease of each buffer die (region id -> thread ident -> [monotonic time, its Thread];
        # written without the lock).
        self._waiting: Dict[int, _Pending] = {}
        self._waiting_looked = 0.0  # when the waiting ones were last looked at (not at every lend)
        self._died: Dict[int, Dict[int, list]] = {}

    # -- hooks ---------------------------------------------------------------------
    def on_lend(self) -> None:
        """Count the lend; decide what was retired before the previous one (its consumer had its turn)."""
        with self._lock:
            self.lends += 1
            self._lender = _get_ident()
            if self._pending or self._waiting:
                self._checkpoint(self.lends - 1)

    def on_death(self, lease: Lease) -> None:
        """A lease died on this thread (the release hook at every death, possibly inside the GC: dict reads
        and a store, ~0.2 us; a thread's first death in a buffer also looks its Thread up)."""
        me = _get_ident()
        by_thread = self._died.get(lease.region_id)
        if by_thread is not None:
            seen = by_thread.get(me)
            if seen is not None:
                seen[0] = _monotonic()
                return
        else:
            died = self._died
            if len(died) >= _REGIONS_KEPT:
                died.clear()  # buffers come and go: forget them all, the live ones write again at their next death
            by_thread = died[lease.region_id] = {}
        by_thread[me] = [_monotonic(), _python_thread(me)]

    def _may_decide(self, p: _Pending, now: float, quiet: float) -> bool:
        """May an unnamed retention be decided now? Alone in the process, at once; otherwise once every
        other thread has had time to run since its reuse (``quiet``), and, up to :data:`_LONGEST_WAIT`
        times that, once no other running thread drops leases of its buffer any more. A thread that ended
        has finished whatever it was dropping; one that ``threading`` does not know (a native thread) is
        taken as running."""
        age = now - p.since
        me = _get_ident()
        by_thread = self._died.get(p.lease.region_id) or {}
        dropping = any(t != me and now - seen[0] < quiet and (seen[1] is None or seen[1].is_alive())
                       for t, seen in list(by_thread.items()))
        if len(_ACTIVE) <= 1 and not dropping:
            return True
        return age >= _LONGEST_WAIT * quiet or (age >= quiet and not dropping)

    def on_retire(self, region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
        """Record a pending retention for every victim still reachable (decided after its consumer's turn)."""
        thread = threading.current_thread().name
        t = self.log.reuse_time(event)
        with self._lock:
            self._checkpoint(self.lends)  # what was retired before the last lend has been decided by now
            running = None
            for lease in victims:
                # alive: still reachable, a rescued lease included (its death is its copy's)
                if lease.handle is None or not lease.alive:
                    continue
                if running is None:
                    running = _running_code()
                p = self._pending[lease.lease_id] = _Pending(lease, event, region, t, self.lends,
                                                             thread, running, since=time.monotonic())
                p.early = self._name_at_reuse(lease)
                p.kept = any(_kept_by_running(h, running) for h in p.early or ())
                self.log.watch(lease, region)

    @staticmethod
    def _name_at_reuse(lease: Lease) -> Optional[List[Holder]]:
        """The lease's holders while the code that stored it still runs (a ``load_state_dict`` that kept
        its views in a local dict and returns it after its loader closed is named at that dict, where the
        fix goes, not at whatever its caller binds the result to): by a known path, else in the local
        containers of the functions running on this thread. No heap walk; None when neither reaches it."""
        if state.options.triage_budget_ms <= 0:
            return None
        key = lease.handle
        names = {key: lease.name}
        found = _holders.replay({key}, names=names).holders.get(key) if _holders.has_patterns() else None
        found = [h for h in found if not h.transient] if found else None
        if not found and state.options.triage:  # (triage mode only: a correct ring load whose loop variable
            found = _holders.in_running_locals(names, sys._getframe(1)).holders.get(key)  # holds each victim pays it)
        for h in found or ():
            h.at_reuse = True
        return found or None

    def _still_early(self, p: _Pending) -> Optional[Tuple[List[Holder], Dict[str, Any]]]:
        """``p``'s holders at the reuse, if they still stand: a path that still reaches the lease's storage,
        or one whose root has gone since (a returned function's local: the view is alive, so it was kept
        from there). None: none stands (the view moved); name it afresh."""
        if not p.early:
            return None
        start = time.perf_counter()
        kept, gone = [], False
        for h in p.early:
            t = _holders.resolve(h.pattern)
            if t is not None:
                try:
                    if t.untyped_storage()._cdata == p.lease.handle:
                        h.held = _shape_of(t, p.lease)  # the record, built next, need not follow it again
                        kept.append(h)
                except Exception:
                    pass
                del t
            elif h.pattern is not None and h.pattern[0]() is None:
                kept.append(h)
                gone = True
        if not kept:
            return None
        return kept, {"when": "at-reuse" if gone else "known-path", "ms": _ms(start), "tensors": len(kept),
                      "truncated": False}

    def on_stale_use(self, lease: Lease, use: StaleUse) -> Optional[Dict[str, Any]]:
        """A retired lease is being used: a retention whatever happens next. Confirm it now (if pending),
        note the stale read, and return its holder for the error (None when triage never saw it retired)."""
        at = (to_records(use.used_at[:1]) or [None])[0]
        with self._lock:
            lid = lease.lease_id
            self._used_stale.add(lid)
            p = self._pending.pop(lid, None) or self._waiting.pop(lid, None)
            if p is not None:
                self.log.stale_read(lease, at)
                # The consumer is what stored it, named at the reuse (a deferred call's list, since popped
                # by the replay that reads it); what holds it at this read is named for the error.
                early = (p.early, {"when": "at-reuse", "ms": 0.0, "tensors": len(p.early), "truncated": False}) \
                    if p.early else None
                named = self._still_early(p)
                if named is not None and named[1]["when"] == "at-reuse":  # its function returned: the caller's
                    named = self._with_current(named, self._name_cheaply(lease, False)  # copy also holds it
                                               or self._walk([lease]).get(lid))
                record = self._confirm(p, used_stale=True, evidence=False, read_at=at, named=named or early)
                return self._holder_at_read(lease, record) if record else None
            record = self._confirmed.get(lid)
            if record is None:  # retired while triage was not looking (the sanitizer off): a retention now
                p = self._late_pending(lease)
                if p is None:
                    return None
                self.log.watch(lease, p.region)
                self.log.stale_read(lease, at)
                record = self._confirm(p, used_stale=True, evidence=False, read_at=at)
                return record["holder"] if record else None
            self.log.stale_read(lease, at)
            if not record.get("used_stale") or record.get("read_stale_at") is None:
                records.update_event(record, used_stale=True, read_stale_at=at)
            return self._holder_at_read(lease, record)

    def _holder_at_read(self, lease: Lease, record: dict) -> Optional[Dict[str, Any]]:
        """(Under the lock.) What holds the view now that it is read stale: the holder named at the
        retention when its path still reaches the view (a known path: cheap), else a new walk names it,
        with the earlier holder as history (a thread pool's future held it at the reuse, the module's
        parameter holds it at the forward). Named once per lease; later reads reuse the answer."""
        lid = lease.lease_id
        known = self._at_read.get(lid)
        if known is not None:
            return known
        holder = record.get("holder")
        credited = self._best.get(lid) or []
        still = bool(credited) and _reaches(credited[0], lease)
        if not still and lease.alive:  # another holder named at the retention (the caller's copy of a
            for other in credited[1:]:  # returned local): the read came through it, no walk needed
                if _reaches(other, lease):
                    now = _holder_record(other, (), lease, ())
                    if holder is not None:
                        now["earlier"] = {k: holder[k] for k in ("kind", "path", "consumer", "stored_at")
                                          if k in holder}
                    records.update_event(record, holder_at_read=now)
                    holder, still = now, True
                    break
        if not still and lease.alive and state.options.triage_budget_ms > 0:
            found, _ = self._walk([lease]).get(lid, ([], _SKIPPED))
            found = _by_consumer([h for h in found if not h.transient] or [_promote(h) for h in found])
            if found and (holder is None or found[0].consumer != holder.get("consumer")):
                now = _holder_record(found[0], found[1:], lease, ())
                if holder is not None:
                    now["earlier"] = {k: holder[k] for k in ("kind", "path", "consumer", "stored_at") if k in holder}
                records.update_event(record, holder_at_read=now)
                holder = now
        if len(self._at_read) >= _CONFIRMED_KEPT:
            self._at_read.clear()
        self._at_read[lid] = holder
        return holder

    def _late_pending(self, lease: Lease) -> Optional[_Pending]:
        """A pending record for a stale lease retired while triage did not see it (its reuse happened with
        the sanitizer off); None when its buffer is forgotten."""
        event = lease.stale_by
        if event is None:
            return None
        try:
            region = state.ledger.region(lease.region_id)
        except Exception:  # the buffer is gone from the ledger: nothing to draw it against
            return None
        return _Pending(lease, event, region, self.log.reuse_time(event), self.lends,
                        threading.current_thread().name)

    # -- deciding --------------------------------------------------------------------
    def settle(self, final: bool = False) -> None:
        """Confirm or drop pending retentions whose consumer has had its turn.

        A pending one is decided once a lend happened after it, or at once when ``final`` (end of a
        test, of the process): then, with no lend since, only a holder other than a local of the
        running code confirms it (nothing else tells a loop variable from a retention).

        Asked from a thread other than the one that made the last lend while that one still runs (a
        report writer's thread), the last lend says nothing of its consumer's turn: it may be between
        that lend and its loop variable's move, the reused view still bound (issue 49). Then only what
        was retired before the lend but one is decided, as a lend decides it."""
        with self._lock:
            self._waiting_looked = 0.0  # (a settle asked for: look at the waiting ones whenever last looked)
            limit = self.lends
            if not final and self._lender not in (0, _get_ident()):
                lender = _python_thread(self._lender)  # (None: ended, or never known to threading)
                if lender is not None and lender.is_alive():
                    limit -= 1
            self._checkpoint(limit, final)

    def _checkpoint(self, limit: int, final: bool = False) -> None:
        """(Under the lock.) Decide the pending retentions recorded before lend number ``limit``.

        The ones that need a heap walk to name their holder are walked together, once (a test's end or a
        report settles a whole consumer's retentions at a time: one pass over the heap, not one a view)."""
        if not self._pending and not self._waiting:
            return
        now, quiet = time.monotonic(), _quiet_s()
        if self._waiting and (final or now - self._waiting_looked >= quiet / 8):
            self._waiting_looked = now
            for p in [p for p in self._waiting.values() if final or self._may_decide(p, now, quiet)]:
                del self._waiting[p.lease.lease_id]
                p.lends = -1  # due now
                self._pending.setdefault(p.lease.lease_id, p)
        if not self._pending:
            return
        due: List[Tuple[_Pending, bool, bool]] = []
        for p in [p for p in self._pending.values() if final or p.lends < limit]:
            if self._pending.pop(p.lease.lease_id, None) is None:
                continue  # decided meanwhile (a walk can run a finalizer that reports)
            used = p.lease.lease_id in self._used_stale
            if not used and not p.lease.alive:  # dropped once its consumer had its turn: a loop variable
                if p.kept:  # ... unless a running function's list or dict held it across the reuse
                    named = (p.early, {"when": "at-reuse", "ms": 0.0, "tensors": len(p.early), "truncated": False})
                    if self._confirm(p, False, False, named=named, died=True) is not None:
                        continue
                self.log.unwatch(p.lease.lease_id)
                continue
            due.append((p, used, final and p.lends >= self.lends and not used))
        if not due:
            return
        named: Dict[int, Tuple[List[Holder], Dict[str, Any]]] = {}
        to_walk: List[Lease] = []
        returned: Dict[int, Tuple[List[Holder], Dict[str, Any]]] = {}  # named at the reuse, its function gone
        first_seen: Dict[int, Tuple[List[Holder], Dict[str, Any]]] = {}  # a new consumer: walked once too
        for p, _, evidence in due:
            cheap = self._still_early(p) if p.lease.alive else None
            if cheap is not None and cheap[1]["when"] != "at-reuse" and any(h.fresh for h in cheap[0]):
                first_seen[p.lease.lease_id] = cheap  # its other holders (a partial beside the list): the walk's
                to_walk.append(p.lease)
                continue
            if cheap is not None and cheap[1]["when"] == "at-reuse":
                returned[p.lease.lease_id] = cheap  # and what holds it now: its caller's copy, "also held by"
                now_held = self._name_cheaply(p.lease, False)
                if now_held is None:
                    to_walk.append(p.lease)
                else:
                    named[p.lease.lease_id] = now_held
                continue
            if cheap is None:
                cheap = self._name_cheaply(p.lease, evidence)
            if cheap is None:
                to_walk.append(p.lease)
            else:
                named[p.lease.lease_id] = cheap
        named.update(self._walk(to_walk))
        for lid, early in returned.items():
            named[lid] = self._with_current(early, named.get(lid))
        for lid, early in first_seen.items():
            named[lid] = self._with_current(early, named.get(lid))
        now = time.monotonic()  # (again: the walk may have run a while, other threads with it)
        for p, used, evidence in due:
            lid = p.lease.lease_id
            if not final and not used and _unnamed(named.get(lid)) and not self._may_decide(p, now, quiet):
                self._waiting[lid] = p  # another thread may be dropping it: after their turn
                continue
            if self._confirm(p, used, evidence, named=named.get(lid)) is None:
                self.log.unwatch(lid)

    def _with_current(self, early: Tuple[List[Holder], Dict[str, Any]],
                      current: Optional[Tuple[List[Holder], Dict[str, Any]]]) -> Tuple[List[Holder], Dict[str, Any]]:
        """The holders named at the reuse (first) and, as the other consumers, what holds the view now that
        their function has returned (the caller it returned them to); a walk's finds are remembered."""
        if not current or not current[0]:
            return early
        found, walk = current
        kept = [h for h in found if not h.transient]
        if kept and walk.get("when") == "walk":
            self._learn(_by_consumer(kept))
        mine = {h.consumer for h in early[0]}
        # (how its other holders were looked for: a walk, once per consumer first seen, or a known path)
        return early[0] + [h for h in kept if h.consumer not in mine], dict(early[1], others=walk.get("when"))

    def _confirm(self, p: _Pending, used_stale: bool, evidence: bool, read_at: Optional[dict] = None,
                 named: Optional[Tuple[List[Holder], Dict[str, Any]]] = None, died: bool = False) -> Optional[dict]:
        """(Under the lock.) Name the holder of a confirmed retention (unless ``named`` already) and record it
        (None: no evidence). ``died``: it is a retention though it is dead by now (``_Pending.kept``)."""
        lease = p.lease
        if named is None:
            named = self._name_cheaply(lease, evidence) or self._walk([lease]).get(lease.lease_id, ([], _SKIPPED))
        found, walk = named
        if evidence:
            found = [h for h in found if not h.transient and not _was_running(h, p)]
            if not found:
                return None  # nothing but the running code's own locals: cannot tell it from a loop variable
        else:  # a plain local still holding it after its consumer's turn is a holder when nothing else is
            # (the genexpr reading ``d.values()`` holds each view it reads: the reader, not a consumer)
            found = [h for h in found if not h.transient] or [_promote(h) for h in found]
        found = _by_consumer(found)
        best = found[0] if found else None
        built = self._record(p, found, walk, used_stale, read_at)
        if not used_stale and not lease.alive and not died:
            # It died while it was being decided (the walk runs for milliseconds, and other threads run
            # meanwhile): its consumer was dropping it, e.g. a list of views cleared while another thread
            # reused their bytes. Nobody kept it: not a retention (this is the decision's last look).
            return None
        if best is not None and walk["when"] == "walk":
            self._learn(found)
        record = records.record_event("retention", built)
        lid = lease.lease_id
        if len(self._confirmed) >= _CONFIRMED_KEPT:  # bounded: forget the oldest half
            for old in list(self._confirmed)[: _CONFIRMED_KEPT // 2]:
                del self._confirmed[old]
        self._confirmed[lid] = record
        if best is not None:
            if len(self._best) >= _CONFIRMED_KEPT:
                self._best.clear()
            self._best[lid] = found
        self.log.retained(lease, p.event, p.t, p.region, record)
        return record

    @staticmethod
    def _name_cheaply(lease: Lease, evidence: bool) -> Optional[Tuple[List[Holder], Dict[str, Any]]]:
        """The holders of a lease without a heap walk: none to name (dead, or walks off), or a known holder
        path followed again down to *this lease's own* tensor. None: only a walk can tell.

        Never credited by neighbourhood: on a reused ring every lease has the same lend and reuse sites
        and the same bytes, so a consumer seen holding an earlier lease says nothing about this one.
        A holder is named only where this lease's storage (its view, or one derived from it) was found."""
        if not lease.alive or state.options.triage_budget_ms <= 0:
            return [], dict(_SKIPPED)
        if evidence:  # (a known path may run through a loop variable: only a walk tells a transient apart)
            return None
        key = lease.handle  # (a rescued lease's storage is the same one, now owning a copy)
        start = time.perf_counter()
        names = {key: lease.name}
        found = _holders.replay({key}, names=names).holders.get(key) or []
        if found and all(h.kind in _REBOUND_LOCALS for h in found):
            # A replay stops at the first known path that reaches the view; a local's path (a loader's
            # generator keeping ``shard_data`` from an earlier load) is rebound at every step, so reaching
            # the view through it says nothing of who else keeps it now: a consumer's dict beside it would
            # go unnamed (tests/adapters/test_loader_safetensors.py). Only a walk sees both.
            return None
        if found:
            return found, {"when": "known-path", "ms": _ms(start), "tensors": len(found), "truncated": False}
        found = _holders.replay_siblings({key}, names=names).holders.get(key) or []
        if found:  # the same path from another instance of the same class (the next layer's holder object)
            return found, {"when": "sibling", "ms": _ms(start), "tensors": len(found), "truncated": False}
        return None

    @staticmethod
    def _walk(leases: List[Lease]) -> Dict[int, Tuple[List[Holder], Dict[str, Any]]]:
        """Name the holders of ``leases`` in one bounded heap walk (their aliases are walked from too)."""
        if not leases:
            return {}
        keys = {lease.handle: lease for lease in leases}
        aliases = {}
        for key, lease in keys.items():
            exported = [(a.obj(), a.kind) for a in _aliases.live(lease.lease_id) if a.obj() is not None]
            if exported:
                aliases[key] = exported
        start = time.perf_counter()
        result = find_holders(set(keys), depth=state.options.triage_depth,
                              budget_ms=state.options.triage_budget_ms, replay=False, aliases=aliases or None)
        walk = {"when": "walk", "ms": _ms(start), "tensors": result.tensors, "truncated": result.truncated,
                "together": len(keys)}
        return {lease.lease_id: (result.holders.get(key, []), dict(walk)) for key, lease in keys.items()}

    @staticmethod
    def _learn(found: List[Holder]) -> None:
        """Remember the holders' paths (to follow first next time: a consumer keeps its next view where it
        kept the last)."""
        for h in reversed(found):  # the best last: remembered paths are tried newest first
            if h.rank < 2 and h.kind != "unknown":
                _holders.remember(h)
        for h in found[:4]:  # a root made per view (a partial per weight): remember the container keeping them
            _holders.learn_container(h)

    @staticmethod
    def _record(p: _Pending, found: List[Holder], walk: Dict[str, Any], used_stale: bool,
                read_at: Optional[dict]) -> dict:
        lease = p.lease
        best = found[0] if found else None
        where = best.path if best else "something the walk could not name (walk skipped or out of budget)"
        lease_rec, event_rec = lease.to_dict(), p.event.to_dict()  # (the summary reads them: built once)
        summary = f"borrowed view {describe_lease(lease_rec)} was still held by {where} when {describe_event(event_rec)}"
        exported = _aliases.records_of(lease.lease_id)
        if exported:
            made = site_text(exported[0]["made_at"])
            summary += (f"; its memory was exported as a {exported[0]['kind']} alias{f' at {made}' if made else ''} "
                        f"while lent: reads through that alias are not checked and see the next tensor's bytes")
        each = [_holder_record(h, (), lease, ()) for h in found]  # each holder's record built once
        record = {
            "summary": summary,
            "lease": lease_rec,
            "event": event_rec,
            "holder": _with_others(each, exported) if best else None,
            "holders": each,
            "lent_at": (to_records(lease.site[:1]) or [None])[0],
            "reused_at": (to_records(p.event.site[:1]) or [None])[0],
            "used_stale": used_stale,
            "rescued": lease.rescued,
            "aliases": exported,
            "walk": walk,
            "thread": p.thread,
            "pid": os.getpid(),
        }
        if read_at is not None:
            record["read_stale_at"] = read_at
        return record

    # -- queries ---------------------------------------------------------------------
    def holder_of(self, lease_id: int) -> Optional[dict]:
        """The holder recorded for a confirmed retention (None: not one, or not named)."""
        with self._lock:
            record = self._confirmed.get(lease_id)
        return record.get("holder") if record else None

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._waiting)


# -- the process's instances, and the hooks that reach them ------------------------------
_TRIAGE = Triage(TimelineLog(state.options.timeline_events))


def _on_lend(lease: Lease, view: Any) -> None:
    t = _TRIAGE
    t.log.on_lend(lease)
    t.on_lend()


def _on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    if state.enabled:
        _TRIAGE.on_retire(region, event, victims)


def _on_reuse(region: Region, event: ReuseEvent) -> None:
    if state.enabled:
        _TRIAGE.log.on_reuse(region, event)


def _on_release(lease: Lease) -> None:
    t = _TRIAGE
    t.on_death(lease)
    t.log.on_release(lease)


def _on_stale_use(lease: Lease, use: StaleUse) -> Optional[Dict[str, Any]]:
    return _TRIAGE.on_stale_use(lease, use)


def _on_enable(options: Options) -> None:
    """Arm triage: the release hook (death marks of retentions) at every enable, the reuse hook while the
    timeline is on. Never installed while the sanitizer was never enabled: a lease's death and a reuse
    then cost nothing."""
    cap = options.timeline_events
    _TRIAGE.log.set_cap(cap)
    add_release_hook(_on_release)
    if cap:
        add_reuse_hook(_on_reuse)


def install() -> None:
    """Register the hooks (idempotent). Called by :func:`sanitizer.activation.compose`; the release and
    reuse hooks are registered by enable (see :func:`_on_enable`)."""
    add_lend_hook(_on_lend)
    add_retire_hook(_on_retire, ORDER)
    add_stale_use_hook(_on_stale_use)
    add_enable_hook(_on_enable)


def uninstall() -> None:
    """Take every triage hook off the runtime (a benchmark measuring tracking without triage);
    :func:`install` and the next enable put them back."""
    for hook in (_on_lend, _on_retire, _on_stale_use, _on_enable, _on_release, _on_reuse):
        HOOKS.discard(hook)


def installed_hooks() -> Dict[str, bool]:
    """Which of triage's hooks the runtime holds now (tests: nothing before the first enable)."""
    return {"lend": _on_lend in HOOKS.lend, "retire": any(h is _on_retire for _, h in HOOKS.retire),
            "stale_use": _on_stale_use in HOOKS.stale_use, "release": _on_release in HOOKS.release,
            "reuse": _on_reuse in HOOKS.reuse}


# -- the module's face -------------------------------------------------------------
def reset(records_too: bool = False) -> None:
    """Start afresh (a new test, a new fuzz case): a new triage and a new flight log, so nothing pending,
    no remembered holders of its own, no timeline. ``records_too`` also drops the retention records already filed."""
    global _TRIAGE
    _TRIAGE = Triage(TimelineLog(state.options.timeline_events))
    if records_too:
        records.forget_events("retention")


_SETTLERS: List[Callable[[bool], None]] = []  # an adapter's own turn-decided findings (safetensors' emulation)


def add_settler(fn: Callable[[bool], None]) -> None:
    """Have ``fn(final)`` decide its own findings whenever triage settles (a report, a test's end): an adapter
    that, like triage, decides what a view's holder did only after the consumer's turn (issue 49)."""
    if fn not in _SETTLERS:
        _SETTLERS.append(fn)


def settle(final: bool = False) -> None:
    for fn in list(_SETTLERS):
        fn(final)
    _TRIAGE.settle(final)


def retentions() -> List[dict]:
    """Confirmed retention records so far (pending ones whose consumer had its turn are decided first)."""
    settle()
    return records.events("retention")


def holder_of(lease_id: int) -> Optional[dict]:
    return _TRIAGE.holder_of(lease_id)


def name_holder(lease: Lease) -> Optional[dict]:
    """The holder of an alive lease now, as a record (path, consumer, stored_at), by a known path, a
    sibling or else a bounded walk; None when nothing nameable holds it. For an adapter that keeps its own
    account of views kept past an emulated contract: each view named by what holds *it*."""
    t = _TRIAGE
    with t._lock:
        named = t._name_cheaply(lease, False) or t._walk([lease]).get(lease.lease_id)
        found = [h for h in (named[0] if named else [])]
        kept = [h for h in found if not h.transient]  # a loop variable is only named when nothing else holds it
        found = _by_consumer(kept or [_promote(h) for h in found])
        if not found:
            return None
        if named[1].get("when") == "walk":
            t._learn(found)
        return _holder_record(found[0], (), lease, ())


def held_past_running(lease: Lease, running: Optional[Tuple[frozenset, frozenset]] = None) -> bool:
    """Is ``lease``'s view held by something other than a plain local of code running on this thread? What
    confirms a retention at a final settle with no lend since; for an adapter deciding its own findings by the
    same rule (:func:`add_settler`). Given ``running`` (:func:`running_code` at the view's retire), an adapter
    that cannot see a later read (an emulated contract: the view kept its bytes) asks instead: held by
    anything but a plain local or global of the code running then or now that a loop's body bound (the
    loop variable left on the last tensor, a module-level loop's included)?"""
    t = _TRIAGE
    with t._lock:
        named = t._walk([lease]).get(lease.lease_id)
    if not named:
        return False
    if running is None:
        return any(not h.transient for h in named[0])
    return any(not ((h.transient or _ran(h, running)) and _bound_in_a_loop(h, lease)) for h in named[0])


def _bound_in_a_loop(h: Holder, lease: Lease) -> bool:
    """Did the lend bind ``h`` (a plain local or global of the code running the close) from a loop's body:
    ``for k in f.keys(): t = f.get_tensor(k)``, ``t`` left on the last tensor? (``kept = f.get_tensor(k)``
    outside a loop, read after the file's close, is what a strict run reports as a stale use.)"""
    site = h.site or {}
    file, function = site.get("file"), str(site.get("function") or "")
    if h.kind == "global":  # (a ``-c`` script's or a notebook cell's module has no file: its module code)
        function = "<module>"
    elif not file:
        return False
    function = function.rsplit(".", 1)[-1]
    for code, lasti in lease.site or ():
        if (code.co_filename == file or not file) and code.co_name == function:
            return in_a_loop(code, lasti)
    return False


def running_code() -> Tuple[frozenset, frozenset]:
    """The code running on this thread now (frame ids, module-globals ids), for :func:`held_past_running`."""
    return _running_code()


def pending_count() -> int:
    """Retentions recorded at a reuse whose consumer has not had its turn yet (decided later)."""
    return _TRIAGE.pending_count()


def lend_count() -> int:
    """Lends seen so far (a reader on another thread, such as Ray's report flusher, tells a running loop from
    an idle process by it: a correct loop changes no finding)."""
    return _TRIAGE.lends


def timeline() -> Dict[str, Any]:
    """The report's ``timeline`` section (see :meth:`TimelineLog.section`)."""
    return _TRIAGE.log.section()



@forking.in_child
def _after_fork() -> None:
    """A forked child decides its own retentions: a fresh triage and flight log (fresh locks with them)."""
    reset()


__all__ = ["Triage", "install", "uninstall", "installed_hooks", "reset", "settle", "add_settler", "retentions",
           "holder_of", "name_holder", "held_past_running", "pending_count", "lend_count",
           "timeline", "ORDER", "find_holders"]
