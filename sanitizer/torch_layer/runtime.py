"""Leases: lend, reuse, retire, close, death, rescue; and the sanitizer's on/off switch.

The staging buffers call into here; the ledger below stays pure, and the
features plug in through the hook slots (:mod:`~sanitizer.torch_layer.hooks`).
What is recorded lives in :mod:`~sanitizer.torch_layer.records`, how a stale
use is reported in :mod:`~sanitizer.torch_layer.stale_use`, where checking
happens in :mod:`~sanitizer.torch_layer.interception`. :func:`arm` and
:func:`disarm` are the low-level switch; :func:`sanitizer.enable` (the package's
activation) composes the features first, then arms.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from sanitizer.core import forking
from sanitizer.core import options as _opts
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.retires_in_flight import RetiresInFlight
from sanitizer.core.sites import Site, capture
from sanitizer.torch_layer import interception
from sanitizer.torch_layer.aliasing import _DTYPE_NAMES, byte_extent, device_key, dtype_name, storage_key
from sanitizer.torch_layer.hooks import HOOKS
from sanitizer.torch_layer.state import state

__all__ = ["track_lease", "storage_of", "reuse", "retire", "close_region", "disown", "lease_of",
           "is_borrowed", "arm", "disarm", "override", "options", "set_options"]


# -- leases ------------------------------------------------------------------
def track_lease(region: Region, start: int, nbytes: int, view: torch.Tensor,
                name: Optional[str], dtype: torch.dtype, shape: tuple, site: Optional[Site] = None) -> Lease:
    """Record a lend whose tensor ``view`` has a storage of its own (see aliasing.py). Called only by a
    buffer's ``_lend_checked`` (see the capture below).

    This is on every loader's hot path and must stay within 1.5x a plain slice: while the sanitizer
    is off only the immediate call site is kept, and the ledger files the lease in O(1) (see
    ``Region.pending``). The lease is a weak reference to the view's storage (its death ends the
    lease, see :func:`_lease_died`), filed under the storage's address (what :func:`lease_of` looks
    up), with ``lease.lent`` (the borrowed marker's answer) set. ``site``: the lent-at stack, when the
    caller captured it already (a write takes one stack for its reuse and its lend: the same frames).
    """
    depth = state.options.stack_depth
    enabled = state.enabled
    if site is None and depth:
        # 4: past capture, this function, a buffer's _lend_checked and its caller (lend or write_prepared,
        # ours too): the walk starts at the frame that may be the user's. Python 3.11+ makes a frame
        # object for each frame the walk touches, and for a call that is about to return that costs
        # more than the rest of the capture (0.8 us of a 5 us lend when it started at lend's frame).
        site = capture(depth if enabled or depth == 1 else 1, 4)
    elif site is None:
        site = ()
    storage = view.untyped_storage()
    lease = state.ledger.lend(region.region_id, start, start + nbytes, name,
                              _DTYPE_NAMES.get(dtype) or dtype_name(dtype), shape, site, storage._cdata,
                              storage, _ENDS_LEASE, id(view))
    if enabled:
        interception.on_lend()
        for hook in HOOKS.lend:
            hook(lease, view)
    return lease


def _storage_objects_preserved() -> bool:
    """Does this torch keep a storage's Python object alive as long as the storage (PyObject
    preservation, torch 2.1+), so that a weak reference to it dies exactly with the storage?"""
    try:
        t = torch.empty(1)
        s = t.untyped_storage()
        ref = weakref.ref(s)
        del s
        return ref() is not None and t.untyped_storage() is ref()
    except TypeError:  # storages not weak-referenceable
        return False


if not _storage_objects_preserved():  # pyproject asks for torch>=2.4: only an unusual build lands here
    raise ImportError(f"ownership-sanitizer needs a torch that keeps a storage's Python object as long as the "
                      f"storage lives (torch 2.1 and later do); torch {torch.__version__} does not")


def _lease_died(lease: Lease) -> None:
    """A lease's storage is gone (its weak reference's callback, :class:`_EndsLease`): it is no longer
    alive. Runs wherever the last reference went, possibly inside the GC: dict operations only."""
    key = lease.handle
    ledger = state.ledger
    ledger.release(key, lease)
    lease.alive = False  # a rescued lease too (disowned, it is no longer in the ledger's live set)
    # After the release (which set ``alive``): a reuse in another thread may have made the lease
    # stale just before it died; _mark_stale re-reads ``alive`` after it files a victim, so one of
    # the two always takes a dead lease out of the stale set (a storage address is reused: a dead
    # lease left there would report someone else's tensor).
    stale = state.stale
    if stale and stale.get(key) is lease:
        stale.pop(key, None)
        if not stale:
            interception.sync()
    if _RESCUED:
        _RESCUED.pop(key, None)
    if not ledger.live_count:
        interception.lease_died_or_disowned()
    for hook in HOOKS.release:
        hook(lease)


class _EndsLease:
    """The callback of every lease's weak reference: ends the lease at its storage's death.

    An instance, not a function: an error keeps its lease, a lease its callback, and a function
    would reach this module's globals (every tensor the runtime knows) from the error; an instance
    with no state reaches only its class."""

    __slots__ = ()
    __call__ = staticmethod(_lease_died)  # (the function itself: no call in between)


_ENDS_LEASE = _EndsLease()

# Leases that a rescue (or ``share_memory_()``) made owned: the ledger no longer files them, and this
# keeps each one (a weak reference: its callback fires only while someone keeps it) until its storage
# dies, so that its end still sets ``alive`` and reaches the release hooks. Storage address -> lease.
_RESCUED: Dict[int, Lease] = {}


_BUFFERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
"""Each open staging buffer by its region id (registered by the buffer itself): a feature that must know
how a lease's memory is held asks the lease's buffer (:func:`buffer_of`), never a module of its kind."""


def register_buffer(region_id: int, buffer: Any) -> None:
    _BUFFERS[region_id] = buffer


def buffer_of(region_id: int) -> Any:
    """The staging buffer registered as ``region_id`` (None once it is gone)."""
    return _BUFFERS.get(region_id)


def storage_of(lease: Lease) -> Optional[torch.UntypedStorage]:
    """The storage of an alive lease (a strong reference: keep it only as long as needed), or None
    when it died. The lease itself is the weak reference to it."""
    storage = lease()
    return storage if isinstance(storage, torch.UntypedStorage) else None


@forking.in_child
def _after_fork() -> None:
    _RETIRES.after_fork_in_child()


def _unfile(lease: Lease) -> None:
    """Drop the lease from the stale set (a rescue made it owned)."""
    key = lease.handle
    if lease.stale_by is not None and state.stale.get(key) is lease:
        del state.stale[key]
        if not state.stale:
            interception.sync()


def reuse(region: Region, start: int, end: int, by: Optional[str], site: Optional[Site] = None) -> ReuseEvent:
    """Declare ``[start, end)`` of ``region`` about to be overwritten; overlapping leases go stale.
    ``site``: the reused-at stack, when the caller captured it already."""
    return _retire_range(region, start, end, by, "reuse", site)


def retire(region: Region, start: int, end: int, by: Optional[str]) -> ReuseEvent:
    """Declare the leases over ``[start, end)`` at the end of their lifetime (bytes not overwritten yet)."""
    return _retire_range(region, start, end, by, "retire")


_RETIRES = RetiresInFlight()  # a reuse returns once the overlapping retires that took its victims marked them


def _retire_range(region: Region, start: int, end: int, by: Optional[str], kind: str,
                  site: Optional[Site] = None) -> ReuseEvent:
    if site is None:
        depth = state.options.stack_depth
        site = capture(depth, 2) if depth else ()
    with _RETIRES.retiring(region.region_id, start, end, _not_inside_our_own_work) as answered:
        event, victims = state.ledger.reuse(region.region_id, start, end, by, site, threading.current_thread().name,
                                            kind)
        answered(*_extent(region, victims, start, end))
        if victims:
            victims = _still_borrowed(region, victims)
        interception.retry_leave()
        for hook in HOOKS.reuse:
            hook(region, event)
        _run_retire_hooks(region, event, victims)
    return event


def _extent(region: Region, victims: List[Lease], start: int, end: int) -> Tuple[int, int]:
    """``[start, end)`` widened to the victims of ``region`` a retire took: another thread's reuse of bytes
    only those leases share waits for this retire to have marked (rescued, checked) them."""
    for lease in victims:
        if lease.region_id == region.region_id:
            start, end = min(start, lease.start), max(end, lease.end)
    return start, end


_OWN_WORK = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), part) + os.sep
                  for part in ("features", "reporting"))  # hooks, walks, reports: never a user's entry


def _not_inside_our_own_work() -> bool:
    """May this retire wait for another thread's? Not when it runs from inside the sanitizer's own work (a
    finalizer fired during a triage walk or a retire hook, which may hold the lock the other retire's hooks
    wait for: each would wait for the other until the bound). Asked only when there is something to wait
    for, so the stack is read rarely."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OWN_WORK):
            return False
        frame = frame.f_back
    return True


def _still_borrowed(region: Region, victims: List[Lease]) -> List[Lease]:
    """The victims whose storage still spans their bytes in their buffer. ``share_memory_()`` of a lent
    CPU view copies its bytes into shared memory and swaps its storage's pointer in place: that view owns
    its bytes now, and a reuse of the staging bytes must not make it stale (it did: a false alarm at its
    next read). Such a lease is disowned, as a rescue would. Trap mode's leases are left alone: each is a
    mapping of its own over the buffer's pages, at another address by design."""
    if not victims:
        return victims
    kept = []
    for lease in victims:
        storage = storage_of(lease) if lease.alive else None
        buffer = _BUFFERS.get(lease.region_id) if storage is not None else None
        if storage is not None and not (buffer is not None and buffer.lends_own_mapping(lease)):
            try:
                ptr, size = storage.data_ptr(), storage.nbytes()
                home = region if lease.region_id == region.region_id else state.ledger.region(lease.region_id)
            except Exception:  # no data of its own to point with (meta), or its buffer is gone: keep it
                ptr = size = 0
            del storage
            if ptr and lease.end > lease.start and not ptr <= home.base + lease.start < ptr + size:
                disown(lease)
                continue
        kept.append(lease)
    return kept


def close_region(region: Region, run_hooks: bool = True) -> ReuseEvent:
    """Free ``region``: its alive leases go stale. ``run_hooks=False`` skips the retire hooks
    (checksum verify, rescue, poison), for memory a third-party loader may already have freed."""
    depth = state.options.stack_depth
    site: Site = capture(depth) if depth else ()
    # All of the region, whatever offsets its reuses give.
    with _RETIRES.retiring(region.region_id, -1, 1 << 64, _not_inside_our_own_work) as answered:
        event, victims = state.ledger.close(region.region_id, site, threading.current_thread().name)
        answered()
        for hook in HOOKS.reuse:
            hook(region, event)
        if run_hooks:
            _run_retire_hooks(region, event, victims)
        else:
            _mark_stale(victims)
    interception.regions_changed()
    return event


def _run_retire_hooks(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    try:
        if victims:
            for _, hook in HOOKS.retire:
                hook(region, event, victims)
    finally:  # a hook that raises (a checksum mismatch) must not leave the victims unchecked
        _mark_stale(victims)


def _mark_stale(victims: List[Lease]) -> None:
    """Victims still borrowed (alive, not rescued) are what the dispatch mode refuses from now on."""
    marked = False
    stale = state.stale
    for lease in victims:
        if lease.handle is not None and lease.alive and not lease.rescued:
            stale[lease.handle] = lease
            if not lease.alive and stale.get(lease.handle) is lease:
                stale.pop(lease.handle, None)  # it died meanwhile (see _lease_died)
                continue
            marked = True
    if marked:
        interception.stale_marked()
    elif state.stale:
        interception.sync()


def disown(lease: Lease) -> None:
    """Record that ``lease``'s views were moved onto owned memory: it is no longer a borrow."""
    _unfile(lease)
    if state.ledger.disown(lease.handle) is not None and lease.alive:
        _RESCUED[lease.handle] = lease
    interception.lease_died_or_disowned()


def lease_of(t: torch.Tensor) -> Optional[Lease]:
    """The lease record of a lent tensor or of any view derived from it; None otherwise."""
    try:
        return state.ledger.lease(storage_key(t))
    except (RuntimeError, NotImplementedError):
        return None


def is_borrowed(t: torch.Tensor) -> bool:
    """True when ``t``'s bytes lie in a registered staging region (or it is a lease's view).

    Answers by address range, so tensors that a third-party loader made inside
    an adopted buffer are recognised too, however they were derived.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"is_borrowed expects a torch.Tensor, got {type(t).__name__}")
    if lease_of(t) is not None:
        return True
    if t.device.type == "meta":
        return False
    try:
        address, nbytes = byte_extent(t)
    except (RuntimeError, NotImplementedError):
        return False
    if address == 0:
        return False
    return state.ledger.region_containing(device_key(t.device), address, nbytes) is not None


# -- the switch --------------------------------------------------------------
def arm(resolved: "_opts.Options") -> "_opts.Options":
    """Turn checking on with ``resolved`` options (validated by the caller: :func:`sanitizer.enable`
    resolves them once, over those in force), then run the enable hooks. Features must be composed
    first: :func:`sanitizer.enable` does both."""
    if not isinstance(resolved, _opts.Options):
        raise TypeError(f"arm expects resolved Options, got {type(resolved).__name__}")
    with state.lock:
        state.options = resolved
        state.enabled = True
        interception.arm(True)
        for hook in HOOKS.enable:  # features arm themselves (rescue, the exit report)
            hook(resolved)
    return resolved


def disarm() -> None:
    """Turn checking off: no error anywhere from now on, no mode in the main thread, no thread hook.
    Other threads' modes pass everything through until those threads end."""
    with state.lock:
        state.enabled = False
        interception.arm(False)


def set_options(options: "_opts.Options") -> None:
    """Put ``options`` (already resolved) in force, unchanged otherwise (restoring a saved state)."""
    if not isinstance(options, _opts.Options):
        raise TypeError(f"set_options expects resolved Options, got {type(options).__name__}")
    with state.lock:
        state.options = options


@contextlib.contextmanager
def override(**options: Any) -> Iterator[_opts.Options]:
    """``with runtime.override(stack_depth=0): ...``: these options for a block, then the ones before.

    Validated like any option; the switch (enabled or not) is left as it is."""
    with state.lock:
        before = state.options
        state.options = _opts.resolve(options, base=before)
    try:
        yield state.options
    finally:
        with state.lock:
            state.options = before


def options() -> Dict[str, Any]:
    """The options in force (a copy)."""
    return dict(state.options)
