"""The pure ledger: staging regions, leases, generations and reuse events.

This is the sanitizer's state machine, kept apart from torch (no torch import,
tests drive it with synthetic ids and addresses) the way PyTorch's stream
sanitizer keeps its event handler apart from its dispatch plumbing.

Vocabulary:

* a **region** is a registered staging buffer: a device, a base address and a
  byte length, with a generation counter that every reuse advances;
* a **lease** is one lent view: a byte interval of a region, the generation at
  lend, what it was lent as (name, dtype, shape) and where;
* a **reuse event** says that bytes of a region are about to be overwritten
  (or, with ``kind="close"``, that the region was freed). Every lease that
  overlaps it and was lent before it becomes *stale*, and records which event
  did that.

A lease is *alive* while something can still reach its memory (the torch layer
calls :meth:`Ledger.release` when the lease's storage dies). Alive and stale is
the bug: a consumer kept a view past its lifetime.

All methods are thread-safe: loaders fill buffers from background threads.

Costs, for a real checkpoint's 100,000+ leases: a region keeps its fresh and its
stale-but-alive leases in interval indexes (:mod:`sanitizer.core.intervals`), and
each device its regions, so lending, a reuse, a close, :meth:`Ledger.overlapping`,
:meth:`Ledger.leases_of` and an address lookup cost O(log n + k) for the k leases
(or regions) they touch, not a scan of all of them.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Callable, Dict, List, Optional, Tuple

from sanitizer.core.describe import describe_event, describe_lease
from sanitizer.core.intervals import IntervalIndex
from sanitizer.core.sites import Site, to_records

FIRST_GENERATION = 1


class LedgerError(ValueError):
    """A request the ledger cannot honour (unknown id, closed region, bad interval)."""


@dataclass(eq=False, slots=True)
class ReuseEvent:
    """Bytes ``[start, end)`` of a region were declared about to be overwritten (or freed)."""

    event_id: int
    region_id: int
    region_name: str
    start: int
    end: int
    generation_before: int
    generation_after: Optional[int]  # None once the region is closed
    by: Optional[str]
    site: Site
    kind: str = "reuse"  # "reuse", "retire" (lifetime ended, bytes kept out of reuse) or "close"
    thread: str = ""

    def describe(self) -> str:
        """``staging buffer 'ring0' reused bytes [0x0, 0x1000) for 'w2' (generation 1 -> 2)``."""
        return describe_event(self._facts())

    def _facts(self) -> dict:
        """The record's fields without the stack (what a description needs; cheap)."""
        return {
            "event_id": self.event_id,
            "kind": self.kind,
            "buffer": self.region_name,
            "byte_range": [self.start, self.end],
            "generation_before": self.generation_before,
            "generation_after": self.generation_after,
            "by": self.by,
            "thread": self.thread,
        }

    def to_dict(self) -> dict:
        return {**self._facts(), "stack": to_records(self.site)}


class _Forever:
    """What a lease lent without a watched object refers to: it lives as long as this module."""


_FOREVER = _Forever()
_new_weak_reference = weakref.ref.__new__


class Lease(weakref.ref):
    """One lent view of a region's bytes ``[start, end)``.

    A lease is also a weak reference to what ends it: the torch layer lends over a storage of the
    view's own and watches that storage (calling the lease returns it while it lives, then None), and
    the reference's callback ends the lease at its death. One object per lease, not a record plus a
    token: at 100,000 leases a second object and the dict that kept it alive cost ~150 bytes and
    ~0.2 us a lend (``bench/scale.py``, ``bench/overhead.py``). The ledger alone (tests, synthetic
    ids) watches nothing: such a lease refers to an object that lives as long as this module.

    Identity is what counts: two leases are equal only when they are one (a weak reference would
    otherwise compare, and hash, by its referent). Made only by :meth:`Ledger.lend`."""

    __slots__ = ("lease_id", "region_id", "region_name", "start", "end", "generation", "name", "dtype", "shape",
                 "site", "alive", "stale_by", "handle", "rescued", "checksum", "lent")
    # handle: opaque key the torch layer files the lease under (its storage address)
    # rescued: moved onto owned memory before its bytes were reused: no longer borrowed
    # checksum: the checksum feature's record of the lent bytes (a host hash or a device slot)
    # lent: the torch layer's id() of the lent tensor object (the borrowed marker's answer)

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__

    def __init__(self, *args: Any) -> None:
        raise TypeError("a Lease is made by Ledger.lend")

    @property
    def stale(self) -> bool:
        return self.stale_by is not None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def describe(self) -> str:
        """``'name' bfloat16[256, 128]``: what a person recognises the view by."""
        return describe_lease({"name": self.name, "lease_id": self.lease_id, "dtype": self.dtype, "shape": self.shape})

    def __repr__(self) -> str:
        state = "stale" if self.stale_by is not None else "fresh"
        return (f"<Lease {self.lease_id} {self.describe()} bytes [{self.start}, {self.end}) of '{self.region_name}', "
                f"generation {self.generation}, {state}{'' if self.alive else ', dead'}{', rescued' if self.rescued else ''}>")

    def __reduce__(self) -> Any:
        raise TypeError(f"a Lease is a live ledger object and does not pickle; send lease.to_dict() "
                        f"(lease {self.lease_id}, {self.describe()})")

    def to_dict(self) -> dict:
        return {
            "lease_id": self.lease_id,
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "buffer": self.region_name,
            "byte_range": [self.start, self.end],
            "generation": self.generation,
            "alive": self.alive,
            "stale": self.stale,
            "rescued": self.rescued,
            "lent_at": to_records(self.site),
        }


@dataclass(eq=False)
class Region:
    """A registered staging buffer: device memory ``[base, base + nbytes)``."""

    region_id: int
    name: str
    device: str
    base: int
    nbytes: int
    generation: int = FIRST_GENERATION
    closed: bool = False
    fresh: IntervalIndex = field(default_factory=lambda: IntervalIndex(order=_LEND_ORDER))  # alive leases not yet stale, by bytes
    stale: IntervalIndex = field(default_factory=lambda: IntervalIndex(order=_LEND_ORDER))  # alive leases already stale (retained)
    orphaned: bool = False  # its owner is gone, its views are not: found by address until the last one dies
    # Fresh leases lent since the last look at ``fresh``, in lend order (lease id -> lease). Most leases
    # die before any reuse touches their bytes (a loader's consumer copies each tensor and drops it):
    # such a lease is lent and released through this dict alone, and never costs an index insertion
    # and removal. Everything that reads ``fresh`` calls :meth:`_fold` first (under the ledger's lock).
    pending: Dict[int, "Lease"] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.base + self.nbytes

    @property
    def alive(self) -> int:
        """Alive leases (fresh or stale): a closed region is forgotten once none is left."""
        return len(self.pending) + len(self.fresh) + len(self.stale)

    def _fold(self) -> None:
        """(Under the ledger's lock.) Move the pending fresh leases into the fresh index, in lend order.

        :meth:`Ledger.release` pops pending entries without the lock: each entry is taken by one atomic
        pop, here or there, and the snapshot (``list`` of a dict is one C call) never iterates a dict
        that another thread changes.

        Each fold starts a new dict: a dict never shrinks as entries leave it, and iterating one costs
        its peak size, so 100,000 leases lent and released once would make every later fold of one
        lease walk 100,000 empty slots (``bench/scale.py``: a reuse at 100k leases 2.7x one at 1k). A
        release that meets the new dict finds nothing there and unfiles the lease under the lock, after
        this fold has indexed it (lends and folds both hold the lock, so the old dict gains nothing)."""
        pending = self.pending
        if pending:
            self.pending = {}
            add = self.fresh.add
            take = pending.pop
            for lease in list(pending.values()):
                if take(lease.lease_id, None) is not None:
                    add(lease, lease.start, lease.end)

    def _unfile(self, lease: Lease) -> None:
        """Take an alive lease out of the index its staleness puts it in (it died or was rescued)."""
        if self.pending.pop(lease.lease_id, None) is not None:
            return
        (self.fresh if lease.stale_by is None else self.stale).remove(lease, lease.start, lease.end)


_LEND_ORDER = attrgetter("lease_id")

# Each distinct shape is kept once: a checkpoint lends thousands of tensors of a few dozen shapes (an MoE
# layer's experts all alike), and a loader builds a new tuple per tensor (``tuple(header["shape"])``),
# which the lease would otherwise keep: 56 bytes a lease. Bounded like the call sites (core/sites.py).
_SHAPES: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
_SHAPES_MAX = 4096


def _kept_shape(shape: Any) -> Tuple[int, ...]:
    """The kept copy of ``shape`` (a tuple; a list or other sequence is made one), kept now if new."""
    if type(shape) is not tuple:
        shape = tuple(shape)
        hit = _SHAPES.get(shape)
        if hit is not None:
            return hit
    if len(_SHAPES) >= _SHAPES_MAX:
        _SHAPES.clear()
    _SHAPES[shape] = shape
    return shape


def _never() -> bool:
    return False


def _in_lend_order(leases: List[Lease]) -> List[Lease]:
    """The indexes return leases grouped by size; callers (and reports) see them in lend order."""
    if len(leases) > 1:
        leases.sort(key=_LEND_ORDER)
    return leases


class Ledger:
    """Thread-safe record of regions, leases and reuse events.

    ``on_live_change(n)`` is called (outside no lock guarantees; keep it cheap)
    whenever the number of alive leases goes from 0 to 1 or from 1 to 0: the
    torch layer uses it to install interception only while borrowed memory is
    reachable.
    """

    def __init__(self, on_live_change: Optional[Callable[[int], None]] = None):
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._regions: Dict[int, Region] = {}
        self._by_device: Dict[str, IntervalIndex] = {}  # device -> its indexed regions, by address range
        self._live: Dict[Any, Lease] = {}  # alive leases by key (the caller's handle, else the lease id)
        self.on_live_change = on_live_change
        # Deaths that came while this thread was inside the ledger's own locked work: (lease, was pending),
        # finished by the next locked call that is not inside it (see :meth:`release`).
        self._later: List[Tuple[Lease, bool]] = []
        self._owned: Callable[[], bool] = getattr(self._lock, "_is_owned", _never)

    def after_fork_in_child(self) -> None:
        """A fresh lock in a forked child (the parent's may have been held by a thread the child lacks)."""
        self._lock = threading.RLock()
        self._owned = getattr(self._lock, "_is_owned", _never)

    def _finish_later(self) -> None:
        """(Under the lock, not inside other locked work of this thread.) Finish the deaths that
        :meth:`release` put off."""
        later, self._later = self._later, []
        for lease, pending in later:
            self._unfile_dead(lease, pending)

    def _unfile_dead(self, lease: Lease, pending: bool) -> None:
        """(Under the lock.) Take a dead lease out of its region's index (unless it was still pending), and
        forget a closed region that nothing reaches any more."""
        region = self._regions.get(lease.region_id)
        if region is not None:
            if not pending:
                region._unfile(lease)
            if region.closed and not region.alive and self._regions.get(region.region_id) is region:
                self._drop(region)  # (an orphan() or close() that ran after our pop may have)

    # -- regions -----------------------------------------------------------
    def add_region(self, name: str, device: str, base: int, nbytes: int) -> Region:
        if nbytes < 0:
            raise LedgerError(f"region '{name}' has negative size {nbytes}")
        with self._lock:
            region = Region(next(self._ids), name, device, base, nbytes)
            self._regions[region.region_id] = region
            index = self._by_device.get(device)
            if index is None:
                index = self._by_device[device] = IntervalIndex()
            index.add(region, base, base + nbytes)
            return region

    def region(self, region_id: int) -> Region:
        try:
            return self._regions[region_id]
        except KeyError:
            raise LedgerError(f"unknown region id {region_id}") from None

    def regions(self) -> List[Region]:
        with self._lock:
            return list(self._regions.values())

    def region_containing(self, device: str, address: int, nbytes: int = 1) -> Optional[Region]:
        """The open region whose bytes hold ``[address, address + nbytes)``, if any.

        Regions may be nested (an adopted tensor inside another): the innermost one wins (the
        greatest base; among equal bases, the latest registered)."""
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            index = self._by_device.get(device)
            if not index:
                return None
            hits = index.containing(address, address + max(nbytes, 1))
            if not hits:
                return None
            return max(hits, key=lambda hit: (hit[0], hit[1].region_id))[1]

    # -- leases ------------------------------------------------------------
    def lend(
        self,
        region_id: int,
        start: int,
        end: int,
        name: Optional[str],
        dtype: str,
        shape: Tuple[int, ...],
        site: Site = (),
        handle: Any = None,
        watch: Any = None,
        on_death: Optional[Callable[[Lease], Any]] = None,
        lent: Any = None,
    ) -> Lease:
        """A new fresh lease of ``[start, end)``, filed under ``handle`` (the caller's key: the torch layer's
        storage address, unique among alive leases) or, without one, under its id: :meth:`lease`,
        :meth:`release` and :meth:`disown` take that key. The lease weakly refers to ``watch`` and
        ``on_death(lease)`` runs at its death (see :class:`Lease`). Everything is set under the ledger's
        lock, so a concurrent reuse never sees a lease half made."""
        with self._lock:
            region = self._regions.get(region_id)
            if region is None or region.closed or not 0 <= start <= end <= region.nbytes:
                region = self._open_region(region_id, start, end, name, lending=True)  # (says why, or finds it)
            lease_id = next(self._ids)
            lease = _new_weak_reference(Lease, _FOREVER if watch is None else watch, on_death)
            lease.lease_id = lease_id
            lease.region_id = region_id
            lease.region_name = region.name
            lease.start = start
            lease.end = end
            lease.generation = region.generation
            lease.name = name
            lease.dtype = dtype
            kept = _SHAPES.get(shape) if type(shape) is tuple else None
            lease.shape = kept if kept is not None else _kept_shape(shape)
            lease.site = site
            lease.alive = True
            lease.stale_by = None
            lease.handle = handle
            lease.rescued = False
            lease.checksum = None
            lease.lent = lent
            region.pending[lease_id] = lease  # indexed only when something looks (see Region.pending)
            live = self._live
            live[lease_id if handle is None else handle] = lease
            became_live = len(live) == 1
        if became_live and self.on_live_change is not None:
            self.on_live_change(1)
        return lease

    def _open_region(self, region_id: int, start: int, end: int, who: Optional[str], lending: bool) -> Region:
        """(Under the lock.) The region, open, with ``[start, end)`` inside it; a LedgerError otherwise (its
        text is built only then: this runs at every lend)."""
        region = self._regions.get(region_id) or self.region(region_id)
        if region.closed:
            refused = f"cannot lend '{who}'" if lending else f"cannot reuse bytes for '{who}'"
            raise LedgerError(f"staging buffer '{region.name}' is closed: {refused}")
        if not (0 <= start <= end <= region.nbytes):
            outside = (f"lease '{who}' bytes [{start}, {end}) fall" if lending
                       else f"reuse of bytes [{start}, {end}) for '{who}' falls")
            raise LedgerError(f"{outside} outside staging buffer '{region.name}' of {region.nbytes} bytes")
        return region

    def release(self, key: Any, lease: Optional[Lease] = None) -> Optional[Lease]:
        """The lease filed under ``key`` is no longer reachable (its storage died). With ``lease``, only
        if that is the one filed there (a death reported late must not end a newer lease of the key).

        Runs at every death (in a weakref callback), so the common case takes no lock: a lease that
        died before anything looked at its region's fresh leases is still pending, and two atomic dict
        pops forget it. Whoever pops an entry owns it: the live entry makes this call the release, and
        a pending entry that :meth:`Region._fold` took first (under the lock) is in an index by the time
        the lock is ours, so it is removed from there. A reuse or close that runs meanwhile either folds
        the lease first (it goes stale, and is then unfiled from the stale index here) or never sees it
        (it died before its bytes were reused: not a borrow any more). The closed flag is read after
        the pop, so a close that counted the region's alive leases before the pop is seen here, and
        the region is dropped exactly once (by whoever holds the lock and still finds it registered).

        ``on_live_change(0)`` is called by each release that finds no live lease left, so two
        concurrent last releases may both call it (it must be idempotent, as it must tolerate a
        concurrent lend's ``on_live_change(1)`` arriving in either order)."""
        live = self._live
        if lease is not None and live.get(key) is not lease:
            return None
        lease = live.pop(key, None)
        if lease is None:
            return None
        lease.alive = False
        region = self._regions.get(lease.region_id)
        pending = region is not None and region.pending.pop(lease.lease_id, None) is not None
        if not pending or region.closed:
            if self._owned():
                # This thread is inside the ledger's own locked work: the GC ran this death at an allocation
                # there, maybe half-way through an index (a reuse popping its victims), which the unfile
                # would change under it (a lock held by this very thread does not keep it out). Put off:
                # the next locked call that is not inside such work finishes it; until then the lease is
                # dead (``alive`` False) in an index, as a death that races a reuse on another thread is.
                self._later.append((lease, pending))
            else:
                with self._lock:
                    if self._later:
                        self._finish_later()
                    self._unfile_dead(lease, pending)
        if not live and self.on_live_change is not None:
            self.on_live_change(0)
        return lease

    def disown(self, key: Any) -> Optional[Lease]:
        """The views of the lease filed under ``key`` now own their bytes (a rescue moved them): it is no
        longer a borrow."""
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            lease = self._live.pop(key, None)
            if lease is None:
                return None
            region = self._regions[lease.region_id]
            region._unfile(lease)
            lease.rescued = True
            lease.stale_by = None
            if region.closed and not region.alive:
                self._drop(region)
            now_idle = not self._live
        if now_idle and self.on_live_change is not None:
            self.on_live_change(0)
        return lease

    def _drop(self, region: Region) -> None:
        """Forget a closed region nothing reaches any more (an orphan also leaves the address index)."""
        self._regions.pop(region.region_id, None)
        if region.orphaned:
            self._unindex(region)

    def _unindex(self, region: Region) -> None:
        index = self._by_device.get(region.device)
        if index is not None:
            index.remove(region, region.base, region.end)
            if not index:
                del self._by_device[region.device]

    def orphan(self, region_id: int) -> None:
        """The region's owner is gone (a buffer object collected by the GC) while its views may live on.

        Nobody can reuse those bytes any more (the views keep the memory alive), so no lease goes
        stale: the region stops lending and reusing, stays findable by address while a lease is
        alive, and is forgotten with its last one. Unknown or closed regions are left alone."""
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            region = self._regions.get(region_id)
            if region is None or region.closed:
                return
            region.closed = True
            region.orphaned = True
            if not region.alive:
                self._drop(region)

    def lease(self, key: Any) -> Optional[Lease]:
        """The alive lease filed under ``key`` (its handle; its id when lent without one), or None. A dict
        lookup, no lock: the torch layer's lookup of a tensor's lease (by storage address) is this."""
        return self._live.get(key)

    @property
    def live_count(self) -> int:
        return len(self._live)

    def has_fresh(self, region_id: int) -> bool:
        """Might a reuse of ``region_id`` find a fresh lease to retire? False only when the region is open and
        no fresh lease is filed there, pending or indexed (under the lock: a fold moves leases between the
        two). What a caller may skip on False is the reuse of bytes no fresh lease covers."""
        with self._lock:
            region = self._regions.get(region_id)
            return region is None or region.closed or bool(region.pending) or bool(region.fresh)

    @property
    def region_count(self) -> int:
        """Regions registered: open ones, and closed ones whose leases still live."""
        return len(self._regions)

    def live_leases(self) -> List[Lease]:
        with self._lock:
            return list(self._live.values())

    def stale_alive(self) -> List[Lease]:
        """Leases that are stale yet still reachable: each one is a retained borrow."""
        with self._lock:  # (a snapshot first: releases pop live entries without the lock)
            return [lease for lease in list(self._live.values()) if lease.stale_by is not None]

    def overlapping(self, region_id: int, start: int, end: int, include_stale: bool = False) -> List[Lease]:
        """Alive leases of a region whose bytes intersect ``[start, end)`` (fresh ones only unless
        ``include_stale``), in lend order."""
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            region = self.region(region_id)
            region._fold()
            hits = region.fresh.overlapping(start, end)
            if include_stale:
                hits += region.stale.overlapping(start, end)
            return _in_lend_order(hits)

    def leases_of(self, region_id: int) -> List[Lease]:
        """Alive leases of a region (fresh and stale), in lend order; none once it is forgotten."""
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            region = self._regions.get(region_id)
            if region is None:
                return []
            region._fold()
            return _in_lend_order(region.fresh.items() + region.stale.items())

    def is_stale(self, key: Any) -> bool:
        lease = self._live.get(key)
        if lease is None:
            raise LedgerError(f"lease {key} is not alive")
        return lease.stale

    def stale_cause(self, key: Any) -> Optional[ReuseEvent]:
        lease = self._live.get(key)
        return None if lease is None else lease.stale_by

    # -- reuse -------------------------------------------------------------
    def reuse(
        self,
        region_id: int,
        start: int,
        end: int,
        by: Optional[str] = None,
        site: Site = (),
        thread: str = "",
        kind: str = "reuse",
    ) -> Tuple[ReuseEvent, List[Lease]]:
        """Advance the region's generation; every fresh lease overlapping ``[start, end)`` goes stale.

        Returns the event and the leases it made stale (the caller verifies,
        poisons or rescues them before the producer writes).
        """
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            region = self._open_region(region_id, start, end, by, lending=False)
            before = region.generation
            region.generation += 1
            event = ReuseEvent(next(self._ids), region_id, region.name, start, end,
                               before, region.generation, by, site, kind, thread)
            region._fold()
            victims = region.fresh.pop_overlapping(start, end)
            stale = region.stale
            for lease in victims:
                lease.stale_by = event
                stale.add(lease, lease.start, lease.end)
            if start < end:
                victims += self._stale_aliasing_regions(region, start, end, event)
            return event, _in_lend_order(victims)

    def _stale_aliasing_regions(self, region: Region, start: int, end: int, event: ReuseEvent) -> List[Lease]:
        """(Under the lock.) Fresh leases of *other* regions over the same bytes: two buffers adopted over one
        loader buffer (or one nested in another) see each other's reuses, since the bytes are the same."""
        index = self._by_device.get(region.device)
        lo, hi = region.base + start, region.base + end
        out: List[Lease] = []
        for other in (index.overlapping(lo, hi) if index is not None else ()):
            if other is region:
                continue
            other._fold()
            if not other.fresh:
                continue
            rel_start, rel_end = max(lo, other.base) - other.base, min(hi, other.end) - other.base
            hit = other.fresh.pop_overlapping(rel_start, rel_end)
            if hit:
                other.generation += 1
                for lease in hit:
                    lease.stale_by = event
                    other.stale.add(lease, lease.start, lease.end)
                out += hit
        return out

    def close(self, region_id: int, site: Site = (), thread: str = "") -> Tuple[ReuseEvent, List[Lease]]:
        """Free the region: every fresh lease goes stale (a later use is a use-after-free)."""
        outer = not self._owned()
        with self._lock:
            if outer and self._later:
                self._finish_later()
            region = self.region(region_id)
            if region.closed:
                raise LedgerError(f"staging buffer '{region.name}' is already closed")
            region.closed = True
            event = ReuseEvent(next(self._ids), region_id, region.name, 0, region.nbytes,
                               region.generation, None, None, site, "close", thread)
            region._fold()
            fresh = region.fresh.take_all()
            victims = _in_lend_order(fresh.items())
            for lease in victims:
                lease.stale_by = event
            if not region.stale:
                region.stale = fresh  # the common case (a batch closed whole): no lease moves
            else:
                for lease in victims:
                    region.stale.add(lease, lease.start, lease.end)
            self._unindex(region)
            if not region.alive:
                del self._regions[region_id]  # nothing reaches it any more: forget it
            return event, victims

__all__ = ["Ledger", "LedgerError", "Lease", "Region", "ReuseEvent", "FIRST_GENERATION"]
