"""Process-wide sanitizer state: options, the ledger, lease lookup, activation, errors.

The torch-facing modules (staging buffers, the dispatch mode) call into here;
the ledger below stays pure. The two dicts keyed by storage address are the
only state the per-op path reads, without a lock (a dict lookup is atomic).
"""
from __future__ import annotations

import contextlib
import enum
import os
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from sanitizer.core import options as _opts
from sanitizer.torch_layer.aliasing import _DTYPE_NAMES, byte_extent, device_key, dtype_name, storage_key
from sanitizer.core.errors import OwnershipError, StaleBorrowError
from sanitizer.core.ledger import Lease, Ledger, Region, ReuseEvent
from sanitizer.torch_layer import readers
from sanitizer.torch_layer.mode import ModeController
from sanitizer.core.sites import Site, capture, capture_excluding

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep

LendHook = Callable[[Lease, torch.Tensor], None]
"""Called after a lend while enabled: ``(lease, lent view)`` (e.g. take its checksum)."""
RetireHook = Callable[[Region, ReuseEvent, List[Lease]], None]
"""Called when a reuse or close retires alive leases, before the producer writes:
``(region, event, victims)``. A hook may rescue a victim (see :func:`disown`);
victims still borrowed afterwards become stale. Orders: see :class:`RetireOrder`."""
ReleaseHook = Callable[[Lease], None]
"""Called when a lease's storage dies (every view of it gone), rescued leases included: ``(lease)``."""
ReuseHook = Callable[[Region, ReuseEvent], None]
"""Called at every reuse, retire and close, whether or not it retired a live lease: ``(region, event)``."""
EnableHook = Callable[[Dict[str, Any]], None]
"""Called by :func:`enable` with the resolved options (a feature arms itself when asked)."""


class RetireOrder(enum.IntEnum):
    """Where each feature's retire hook runs (ascending), declared once."""

    VERIFY = 100  # checksums: verify the borrowed bytes before anything else
    RESCUE = 200  # rescue: copy victims out before the producer writes
    TRIAGE = 300  # triage: record who still holds the victims
    GUARD = 350  # guard: re-point what is still held to a poison tombstone
    POISON = 400  # checksums: poison what is left stale


class _State:
    def __init__(self) -> None:
        self.options: _opts.Options = _opts.resolve({})
        self.enabled = False
        self.by_storage: Dict[int, Lease] = {}  # storage address -> alive lease
        self.stale: Dict[int, Lease] = {}  # storage address -> alive *stale* lease
        self.tokens: Dict[int, tuple] = {}  # id(weakref) -> (weakref whose callback releases, lease)
        self.errors: List[dict] = []
        self.error_total = 0  # errors seen, kept or not
        self.dropped_records = 0  # errors and events not kept: the max_records cap was reached
        self.error_counts: Dict[int, int] = {}  # lease id -> stale uses seen
        self.lock = threading.RLock()
        self.ledger = Ledger(on_live_change=_on_live_change)
        self.intercepting = False  # tolist hook set and the main thread asked to carry the mode
        self.lend_hooks: List[LendHook] = []
        self.retire_hooks: List[Tuple[int, RetireHook]] = []  # (order, hook), run in ascending order
        self.enable_hooks: List[EnableHook] = []  # run by enable() with the resolved options
        self.release_hooks: List[ReleaseHook] = []
        self.reuse_hooks: List[ReuseHook] = []
        self.events: List[dict] = []  # non-error records: rescues, retentions, clones by policy
        self.modes = ModeController(self.stale, _on_stale_use)


def _wants_interception() -> bool:
    """Main-thread interception runs from the first stale lease until none is stale *and* no
    lease is alive. The hysteresis matters for a consumer that holds each tensor until the next
    one arrives (a loop variable): every reuse makes the previous lease stale and its death a
    moment later clears it; toggling the mode and the reader hooks per tensor would cost more
    than keeping them for the rest of the load. A correct program never pays at all."""
    return state.enabled and (bool(state.stale) or (state.intercepting and state.ledger.live_count > 0))


def _on_live_change(alive: int) -> None:
    if alive == 0 and state.intercepting:
        _sync_interception()


def _sync_interception() -> None:
    """Per-op interception in the main thread (and the reader hooks) exists only while
    :func:`_wants_interception`; called after every change of what it reads. Cheap when
    nothing flips: it runs when the stale set empties and when the last lease dies."""
    if _wants_interception() == state.intercepting:
        return
    with state.lock:
        want = _wants_interception()
        if want == state.intercepting:
            return
        state.intercepting = want
        _tensor_hooks(want)
    state.modes.sync_main(_wants_interception)


def check_not_stale(tensor: torch.Tensor, where: str) -> bool:
    """The one stale check for reads the dispatch mode cannot see (``tolist``, ``numpy``, ``verify``...).

    Reports through :func:`raise_or_record` when ``tensor``'s lease is stale and
    returns True (when the error was recorded, not raised); False when it is not stale.
    The mode's per-op path does the same lookup inline, for speed.
    """
    if not state.stale or not state.enabled:
        return False
    try:
        lease = state.stale.get(storage_key(tensor))
    except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less subclasses
        return False
    if lease is None:
        return False
    _on_stale_use(lease, where, tensor)
    return True


def _tensor_hooks(on: bool) -> None:
    """The readers the mode cannot see (tolist, numpy, dlpack, pickle...): see readers.py."""
    readers.set_hooks(on, check_not_stale)


def _on_stale_use(lease: Lease, func: Any, tensor: torch.Tensor) -> None:
    """Called by the mode, before ``func`` runs, for a tensor whose lease is stale."""
    used_at = capture_excluding(state.options["stack_depth"], (_TORCH_DIR,))
    used_as = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape)}
    event = lease.stale_by
    assert event is not None
    raise_or_record(StaleBorrowError(lease, event, str(func), used_at, used_as), lease)


def raise_or_record(err: "OwnershipError", lease: Lease) -> None:
    """Every sanitizer error goes through here: raised (halt_on_error=1) or recorded and let go."""
    if state.options.halts:
        with state.lock:
            state.error_total += 1
            _keep(state.errors, err.record)
        try:
            raise err
        finally:
            del err  # no frame -> traceback -> error cycle: a caught error is freed at once
    _record(lease, err.record)


def _keep(records: List[dict], record: dict) -> None:
    """(Under the lock.) Keep ``record`` unless the total cap (option ``max_records``) is reached."""
    if len(state.errors) + len(state.events) < state.options["max_records"]:
        records.append(record)
    else:
        state.dropped_records += 1


def _record(lease: Lease, record: dict) -> None:
    with state.lock:
        state.error_total += 1
        n = state.error_counts.get(lease.lease_id, 0) + 1
        state.error_counts[lease.lease_id] = n
        if n <= state.options["max_errors_per_lease"]:
            record["occurrence"] = n
            _keep(state.errors, record)
        if len(state.error_counts) > 4 * max(1, state.options["max_records"]):
            state.error_counts.clear()  # per-lease counts are a bound, not a record: keep them bounded too


state = _State()


# -- leases ------------------------------------------------------------------
def track_lease(region: Region, start: int, nbytes: int, view: torch.Tensor, piece: Any,
                name: Optional[str], dtype: torch.dtype, shape: tuple) -> Lease:
    """Record a lend whose tensor ``view`` has a storage of its own (see aliasing.py).

    While the sanitizer is off only the immediate call site is kept: lending
    is on every loader's hot path and must stay within 2x a plain slice.
    """
    depth = state.options["stack_depth"]
    if not state.enabled and depth > 1:
        depth = 1
    site = capture(depth, skip=3) if depth else ()  # 3: past capture, track_lease and lend
    lease = state.ledger.lend(region.region_id, start, start + nbytes, name,
                              _DTYPE_NAMES.get(dtype) or dtype_name(dtype), shape, site)
    key = view.untyped_storage()._cdata
    lease.handle = key
    state.by_storage[key] = lease
    ref = weakref.ref(piece, _lease_died)
    state.tokens[id(ref)] = (ref, lease)
    if state.enabled:
        state.modes.retry_leave()
        # A lending thread other than main keeps a mode until it ends: its consumers may
        # read here after the reuse. The main thread follows the stale set instead.
        if not state.modes.installed_here() and threading.current_thread() is not threading.main_thread():
            state.modes.install_here()
        for hook in state.lend_hooks:
            hook(lease, view)
    return lease


def _lease_died(ref: Any) -> None:
    """The lease's storage is gone (weakref callback): it is no longer alive."""
    entry = state.tokens.pop(id(ref), None)
    if entry is None:
        return
    lease = entry[1]
    _unfile(lease)
    state.ledger.release(lease.lease_id)
    lease.alive = False  # a rescued lease too (disowned, it is no longer in the ledger's live set)
    for hook in state.release_hooks:
        hook(lease)


def rebind_lease(lease: Lease, piece: Any) -> None:
    """``lease``'s storage now holds other memory, whose deleter keeps ``piece``: from now on its
    death is what ends the lease (the guard's tombstones). Call before the old memory is dropped."""
    with state.lock:
        for key, (_, held) in list(state.tokens.items()):
            if held is lease:
                del state.tokens[key]
        ref = weakref.ref(piece, _lease_died)
        state.tokens[id(ref)] = (ref, lease)


def _unfile(lease: Lease) -> None:
    """Drop the lease from the storage-keyed lookups (it died, or a rescue made it owned)."""
    key = lease.handle
    if state.by_storage.get(key) is lease:
        del state.by_storage[key]
    if lease.stale_by is not None and state.stale.get(key) is lease:
        del state.stale[key]
        if not state.stale:
            _sync_interception()


def retire(region: Region, start: int, end: int, by: Optional[str], kind: str = "reuse") -> ReuseEvent:
    """Declare ``[start, end)`` of ``region`` about to be overwritten (or its lifetime over, ``kind="retire"``);
    overlapping leases go stale."""
    depth = state.options["stack_depth"]
    site: Site = capture(depth) if depth else ()
    event, victims = state.ledger.reuse(region.region_id, start, end, by, site, threading.current_thread().name, kind)
    state.modes.retry_leave()
    for hook in state.reuse_hooks:
        hook(region, event)
    _run_retire_hooks(region, event, victims)
    return event


def close_region(region: Region, run_hooks: bool = True) -> ReuseEvent:
    """Free ``region``: its alive leases go stale. ``run_hooks=False`` skips the retire hooks
    (checksum verify, rescue, poison), for memory a third-party loader may already have freed."""
    depth = state.options["stack_depth"]
    site: Site = capture(depth) if depth else ()
    event, victims = state.ledger.close(region.region_id, site, threading.current_thread().name)
    for hook in state.reuse_hooks:
        hook(region, event)
    if run_hooks:
        _run_retire_hooks(region, event, victims)
    else:
        _mark_stale(victims)
    return event


def _run_retire_hooks(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    try:
        if victims and state.retire_hooks:
            for _, hook in state.retire_hooks:
                hook(region, event, victims)
    finally:  # a hook that raises (a checksum mismatch) must not leave the victims unchecked
        _mark_stale(victims)


def _mark_stale(victims: List[Lease]) -> None:
    """Victims still borrowed (alive, not rescued) are what the dispatch mode refuses from now on."""
    marked = False
    for lease in victims:
        if lease.handle is not None and lease.alive and not lease.rescued:
            state.stale[lease.handle] = lease
            marked = True
    if state.stale:
        _sync_interception()
        if marked and state.intercepting:  # writers imported since the last stale lease get wrapped too
            readers.set_hooks(True, check_not_stale)


def add_lend_hook(hook: LendHook) -> None:
    if hook not in state.lend_hooks:
        state.lend_hooks.append(hook)


def add_release_hook(hook: ReleaseHook) -> None:
    """Register ``hook(lease)`` to run when a lease's storage dies (idempotent). It runs in whatever
    thread dropped the last reference, possibly inside the GC: keep it cheap and lock-free."""
    if hook not in state.release_hooks:
        state.release_hooks.append(hook)


def add_reuse_hook(hook: ReuseHook) -> None:
    """Register ``hook(region, event)`` to run at every reuse, retire and close (idempotent)."""
    if hook not in state.reuse_hooks:
        state.reuse_hooks.append(hook)


def add_retire_hook(hook: RetireHook, order: RetireOrder) -> None:
    """Register ``hook`` to run at each retirement (idempotent), ordered by ``order``."""
    if all(h is not hook for _, h in state.retire_hooks):
        state.retire_hooks.append((int(order), hook))
        state.retire_hooks.sort(key=lambda pair: pair[0])


def on_enable(hook: EnableHook) -> None:
    """Register ``hook(resolved_options)`` to run at each :func:`enable` (idempotent), in registration order."""
    with state.lock:
        if hook not in state.enable_hooks:
            state.enable_hooks.append(hook)


# -- events (non-error records: rescues, retentions, clones by policy) ------
def record_event(kind: str, record: dict) -> dict:
    """File ``record`` (its ``kind`` set to ``kind``) among the events; returns it."""
    record["kind"] = kind
    with state.lock:
        _keep(state.events, record)
    return record


def events(kind: Optional[str] = None) -> List[dict]:
    """The events so far (a copy), only those of ``kind`` when given."""
    with state.lock:
        return [e for e in state.events if kind is None or e.get("kind") == kind]


def forget_events(kind: Optional[str] = None, record: Optional[dict] = None) -> None:
    """Drop the events of ``kind`` (all when None), or only ``record`` (by identity) when given."""
    with state.lock:
        if record is not None:
            state.events[:] = [e for e in state.events if e is not record]
        else:
            state.events[:] = [e for e in state.events if kind is not None and e.get("kind") != kind]


def disown(lease: Lease) -> None:
    """Record that ``lease``'s views were moved onto owned memory: it is no longer a borrow."""
    _unfile(lease)
    state.ledger.disown(lease.lease_id)


def lease_of(t: torch.Tensor) -> Optional[Lease]:
    """The lease record of a lent tensor or of any view derived from it; None otherwise."""
    try:
        return state.by_storage.get(storage_key(t))
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


# -- activation --------------------------------------------------------------
def enable(**options: Any) -> None:
    """Turn debug mode on (options as in the table; unknown ones raise OptionError)."""
    resolved = _opts.resolve(options, base=state.options)
    with state.lock:
        state.options = resolved
        state.enabled = True
        state.modes.arm(True)
        state.modes.hook_threads(lambda: state.enabled)
        _sync_interception()
        for hook in list(state.enable_hooks):  # features arm themselves (rescue, the exit report)
            hook(resolved)


def disable() -> None:
    """Turn debug mode off: no error anywhere from now on, no mode in the main thread, no
    thread hook. Other threads' modes pass everything through until those threads end."""
    with state.lock:
        state.enabled = False
        state.modes.arm(False)
        state.modes.unhook_threads()
        _sync_interception()
        state.modes.sync_main(_wants_interception)


def enabled() -> bool:
    return state.enabled


@contextlib.contextmanager
def sanitize(**options: Any) -> Iterator[None]:
    """``with sanitizer.sanitize(halt_on_error=0): ...``: debug mode for a block, then the previous state."""
    before_enabled, before_options = state.enabled, state.options
    enable(**options)
    try:
        yield
    finally:
        if before_enabled:  # even when the block called disable()
            state.options = before_options
            enable()
        else:
            disable()
            state.options = before_options


def options() -> Dict[str, Any]:
    """The options in force (a copy)."""
    return dict(state.options)


def errors() -> List[dict]:
    with state.lock:
        return list(state.errors)


def clear_errors() -> None:
    with state.lock:
        state.errors.clear()
        state.error_counts.clear()
        state.error_total = 0
        state.dropped_records = 0


def record_counts() -> Dict[str, int]:
    """Errors seen in all, records kept (errors, events) and records dropped by the ``max_records`` cap."""
    with state.lock:
        return {"errors_seen": state.error_total, "errors_kept": len(state.errors),
                "events_kept": len(state.events), "dropped": state.dropped_records}


def activate_from_environment(environ: Optional[Dict[str, str]] = None) -> bool:
    """Read ``OWNERSHIP_SANITIZE`` and ``OWNERSHIP_SANITIZE_OPTIONS``; enable when asked. Returns enabled()."""
    env = os.environ if environ is None else environ
    raw = env.get(_opts.ENV_OPTIONS, "")
    parsed = _opts.parse_options_string(raw) if raw else {}
    if parsed:
        state.options = _opts.resolve(parsed, base=state.options)
    if _opts.switch_from_env(env):
        enable()
    return state.enabled
