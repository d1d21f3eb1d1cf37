"""The production rule: own a borrowed tensor before you retain it (clone-on-defer).

A consumer that keeps a loader's tensor past the call that handed it over
(a deferring weight loader, a cache, a queue) must hold *owned* memory. Copying
everything costs a whole checkpoint; copying nothing is the bug. ``own`` copies
exactly the tensors a policy calls borrowed and returns every other tensor
itself (no allocation), and :class:`DeferralScope` frees the copies as soon as
the deferred work is done, so the cost is bounded by what is pending.

Policies (how "borrowed" is decided):

* ``registered`` (default): its bytes lie in a registered staging region, or it
  shares a lease's storage. Survives ``view``/``narrow``/slicing/``detach``.
* ``marked``: it carries a marker attribute (``_vllm_instanttensor_borrowed``
  and any added with :func:`add_borrowed_marker`). Views drop attributes, so a
  derived view is missed: this is the rule some loaders follow today.
* ``accelerator``: every non-CPU, non-meta tensor (the vLLM fork's later rule);
  it misses CPU staging buffers.
* ``all``: every tensor that holds bytes (the copy-everything strategy).

Meta tensors hold no bytes and are never copied. Copies are ordinary allocator
memory (CUDA's caching allocator on CUDA) and are tracked by the lifetime of
their *storage* (a weak reference to the storage object, which torch keeps as
long as the storage lives), so a copy kept alive only by a ``view(dtype)`` is
still counted.
"""
from __future__ import annotations

import copy
import inspect
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from cuda_hooks import devices
from sanitizer.core import forking
from sanitizer.torch_layer import records, runtime
from sanitizer.torch_layer.staging import BORROWED_MARKER, buffer_bytes
from sanitizer.torch_layer.state import state

POLICIES: Tuple[str, ...] = ("registered", "marked", "accelerator", "all")
_MARKERS: List[str] = [BORROWED_MARKER]


def add_borrowed_marker(name: str) -> None:
    """Also treat tensors carrying attribute ``name`` (truthy) as borrowed under ``policy="marked"``."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a borrowed marker must be an attribute name, got {name!r}")
    if name not in _MARKERS:
        _MARKERS.append(name)


def borrowed_markers() -> Tuple[str, ...]:
    return tuple(_MARKERS)


def _check_policy(policy: Any) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown ownership policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    return policy


def needs_copy(t: torch.Tensor, policy: str = "registered") -> bool:
    """Does ``policy`` call ``t`` borrowed (so that retaining it needs an owned copy)?"""
    _check_policy(policy)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        return False
    if policy == "registered":
        return runtime.is_borrowed(t)
    if policy == "marked":
        return any(getattr(t, m, False) is True for m in _MARKERS)
    if policy == "accelerator":
        return t.device.type != "cpu"
    return True  # "all"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- accounting ----------------------------------------------------------------
class _Accounting:
    """Process-wide counters of owned copies; updated at copy and when a copy's storage dies."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # re-entrant: a copy's finalizer may run during a gc inside the lock
        self.owned_now = 0
        self.live_copies = 0
        self.reset()

    def reset(self) -> None:
        """Zero the totals; bytes owned now stay true (live copies are still live)."""
        self.peak = self.owned_now
        self.copies = 0
        self.copied_bytes = 0
        self.by_policy: Dict[str, List[int]] = {}
        self.seen_bytes = 0
        self.scope_peaks: Dict[str, int] = {}
        self.open_scopes = 0

    def seen(self, nbytes: int) -> None:
        with self.lock:
            self.seen_bytes += nbytes

    def add(self, policy: str, nbytes: int, piece: Any, scope: Optional["DeferralScope"]) -> None:
        with self.lock:
            self.owned_now += nbytes
            self.live_copies += 1
            self.peak = max(self.peak, self.owned_now)
            self.copies += 1
            self.copied_bytes += nbytes
            entry = self.by_policy.setdefault(policy, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
            _clone_event(policy, entry)
            if scope is not None:
                scope._add(nbytes)
        weakref.finalize(piece, self._release, nbytes, scope)

    def _release(self, nbytes: int, scope: Optional["DeferralScope"]) -> None:
        with self.lock:
            self.owned_now -= nbytes
            self.live_copies -= 1
            if scope is not None:
                scope._live_bytes -= nbytes


_acct = _Accounting()


@forking.in_child
def _after_fork() -> None:
    _acct.lock = threading.RLock()
_CLONE_EVENTS: Dict[str, dict] = {}


def _clone_event(policy: str, entry: List[int]) -> None:
    """One aggregated ``{"kind": "clone"}`` record per policy among the record store's events (not one per copy)."""
    record = _CLONE_EVENTS.get(policy)
    if record is None:
        record = _CLONE_EVENTS[policy] = {"kind": "clone", "policy": policy, "count": 0, "bytes": 0}
        records.record_event("clone", record)
    record["count"], record["bytes"] = entry[0], entry[1]


def account_copy(policy: str, nbytes: int, piece: Any, scope: Optional["DeferralScope"] = None) -> None:
    """Count an owned copy made elsewhere (rescue); ``piece`` dies with the copy's storage."""
    _acct.add(policy, nbytes, piece, scope)


def note_consumed(values: Iterable[Any]) -> None:
    """Count tensors consumed synchronously (no copy): what a copy-everything strategy would still copy."""
    for v in values:
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            _acct.seen(_nbytes(v))


def stats() -> Dict[str, Any]:
    """Bytes owned now and at peak, per-scope peaks, copies by policy, and the copy-everything cost."""
    with _acct.lock:
        by = {p: list(v) for p, v in _acct.by_policy.items()}
        return {
            "owned_bytes": _acct.owned_now,
            "peak_owned_bytes": _acct.peak,
            "live_copies": _acct.live_copies,
            "copies": _acct.copies,
            "copied_bytes": _acct.copied_bytes,
            "copies_by_policy": {p: v[0] for p, v in by.items()},
            "bytes_by_policy": {p: v[1] for p, v in by.items()},
            "scope_peaks": dict(_acct.scope_peaks),
            "open_scopes": _acct.open_scopes,
            "copy_everything_bytes": _acct.seen_bytes,
            "tombstones": _guard_stats(),
        }


def _guard_stats() -> Dict[str, int]:
    """The guard's tombstones (made in all, alive now, and their bytes): memory the sanitizer holds."""
    from sanitizer.features import guard  # a sibling feature: imported when asked, not at load

    return guard.stats()


def reset_stats() -> None:
    """Start a new measurement: totals and peaks restart from the bytes owned now."""
    with _acct.lock:
        _acct.reset()
        for record in _CLONE_EVENTS.values():
            records.forget_events(record=record)
        _CLONE_EVENTS.clear()


# -- the rule ----------------------------------------------------------------------
def owned_copy(t: torch.Tensor) -> Tuple[torch.Tensor, Any]:
    """A contiguous copy of ``t`` in ordinary allocator memory, and the object whose life is the copy's.

    Ordinary memory (``empty_like`` semantics: the CPU allocator, or CUDA's caching allocator on the
    current stream) so the copy behaves like any tensor: ``record_stream``, CUDA IPC, ``resize_``
    and ``share_memory_`` work on it. Its lifetime is its *storage*'s: torch keeps a storage's
    Python object as long as the storage lives, so a weak reference to it fires when the last view
    of the copy is gone, even a ``view(dtype)`` that outlived the tensor first returned. (Measured
    on CPU against the former numpy-backed alias, here on 2 busy cores, best of 7: 9-10 us instead
    of 21-26 us for 64 bytes, 14 us instead of 160 us for 1 MiB of bf16, the same within noise at
    4 MiB where the copy dominates.)

    On CUDA the copy reads ``t``'s bytes on the current stream: the memory they live in records
    that stream (for a lease, its staging buffer's own memory), so freeing it meanwhile, even to
    another stream's pool, cannot hand the bytes to another allocation before the copy ran.
    """
    out = devices.empty_like(t)
    out.copy_(t)
    if devices.is_cuda(t) and not torch.cuda.is_current_stream_capturing():
        stream = torch.cuda.current_stream(devices.device_of(t).index)
        t.record_stream(stream)  # the loader's own allocator memory (a no-op on a lease's alias storage)
        lease = runtime.lease_of(t)
        staging = buffer_bytes(lease.region_id) if lease is not None else None
        if staging is not None:
            staging.record_stream(stream)
    return out, out.untyped_storage()


def _copy(t: torch.Tensor, policy: str, scope: Optional["DeferralScope"]) -> torch.Tensor:
    nbytes = _nbytes(t)
    with torch.no_grad():
        if t.layout is torch.strided and t.device.type in ("cpu", "cuda") and nbytes:
            out, piece = owned_copy(t)
        else:  # sparse, other devices, empty: a plain clone (lifetime tracked by the tensor object)
            out = t.clone()
            piece = out
    _acct.add(policy, nbytes, piece, scope)
    if scope is not None:
        scope._copies.append(out)
    return out


def own(t: torch.Tensor, policy: str = "registered", *, scope: Optional["DeferralScope"] = None) -> torch.Tensor:
    """``t`` itself when ``policy`` calls it owned; otherwise an owned (detached, contiguous) copy.

    Call it where a consumer starts retaining a tensor it did not allocate.
    Owning a tensor that is not borrowed allocates nothing. With the sanitizer
    on, owning a view whose bytes were already reused raises StaleBorrowError:
    the copy would be too late.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"own expects a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "meta":
        _acct.seen(_nbytes(t))
    if not needs_copy(t, policy):
        return t
    return _copy(t, policy, scope)


class _Owner:
    """Owns the tensors inside one value, at any depth of lists, tuples (namedtuples too), dicts and sets.

    A container is rebuilt (same type, same keys, same order) only when something inside it was
    copied; otherwise the very same object is returned. A tensor met twice gets one copy, so
    aliasing inside the arguments survives; a container that holds itself is left as it is."""

    __slots__ = ("policy", "scope", "done", "active")

    def __init__(self, policy: str, scope: Optional["DeferralScope"]):
        self.policy, self.scope = policy, scope
        self.done: Dict[int, Tuple[Any, Any]] = {}  # id(value) -> (value, result): keeps ``value`` alive
        self.active: set = set()  # ids of the containers being walked (cycles)

    def __call__(self, value: Any) -> Any:
        hit = self.done.get(id(value))
        if hit is not None:
            return hit[1]
        if isinstance(value, torch.Tensor):
            out = own(value, self.policy, scope=self.scope)
        elif isinstance(value, (list, tuple, dict, set, frozenset)) and id(value) not in self.active:
            self.active.add(id(value))
            try:
                out = self._container(value)
            finally:
                self.active.discard(id(value))
        else:
            return value
        self.done[id(value)] = (value, out)
        return out

    def _container(self, value: Any) -> Any:
        if isinstance(value, dict):
            items = {k: self(v) for k, v in value.items()}
            changed = [k for k, v in items.items() if v is not value[k]]
            if not changed:
                return value
            if type(value) is dict:
                return items
            out = copy.copy(value)  # OrderedDict, defaultdict (its factory), other dict subclasses
            for k in changed:
                out[k] = items[k]
            return out
        items = [self(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        kind = type(value)
        if kind in (list, tuple, set, frozenset):
            return kind(items)
        if isinstance(value, tuple) and hasattr(value, "_make"):  # a namedtuple
            return value._make(items)
        if isinstance(value, list):
            out = copy.copy(value)
            out[:] = items
            return out
        try:
            return kind(items)
        except TypeError:
            raise TypeError(f"own_arguments: cannot rebuild a {kind.__name__} holding borrowed tensors "
                            f"(its constructor does not take an iterable of items)") from None


def _walk_tensors(value: Any, out: List[torch.Tensor], seen: set) -> None:
    """Append every tensor inside ``value`` (any depth of lists, tuples, dicts, sets) to ``out``."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple, dict, set, frozenset)) and id(value) not in seen:
        seen.add(id(value))
        for v in (value.values() if isinstance(value, dict) else value):
            _walk_tensors(v, out, seen)


def own_arguments(bound: inspect.BoundArguments, policy: str = "registered", skip: Sequence[str] = ("param",),
                  *, scope: Optional["DeferralScope"] = None) -> inspect.BoundArguments:
    """Own every tensor argument of ``bound`` (in place; returns ``bound``), except those named in ``skip``.

    This is what a deferring weight loader retains: ``skip`` leaves the
    destination parameter alone. Tensors inside ``*args``, ``**kwargs`` and any
    list, tuple (namedtuple), dict or set argument are owned at any depth; a
    container is rebuilt with its own type and keys only when it held a borrowed
    tensor, and tensors that are not borrowed are never copied.
    """
    if not isinstance(bound, inspect.BoundArguments):
        raise TypeError(f"own_arguments expects an inspect.BoundArguments, got {type(bound).__name__}")
    _check_policy(policy)
    if isinstance(skip, str):
        skip = (skip,)
    owner = _Owner(policy, scope)  # one walk for all arguments: a tensor passed twice gets one copy
    for name, value in list(bound.arguments.items()):
        if name not in skip:
            bound.arguments[name] = owner(value)
    return bound


def _tensors_of(bound: inspect.BoundArguments, skip: Sequence[str]) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    seen: set = set()
    for name, value in bound.arguments.items():
        if name not in skip:
            _walk_tensors(value, out, seen)
    return out


def _verify_leased(tensors: Iterable[torch.Tensor]) -> bool:
    """With checksums on, check that leased tensors still hold the bytes they were lent with.

    A stale lease raises StaleBorrowError here, a bytes change on the host BorrowCorruptedError.
    True when a check was queued on a CUDA device: its result is read at the next synchronisation
    (:meth:`DeferralScope.replay` makes one).
    """
    if not (state.enabled and state.options.checksum):
        return False
    leased = [t for t in tensors if runtime.lease_of(t) is not None]
    if not leased:
        return False
    from sanitizer.features.checksums import verify_queued

    return verify_queued(leased)


def _synchronize_checks() -> None:
    """Read the device checks queued so far (a host synchronisation): a mismatch raises here."""
    from sanitizer.features.checksums import synchronize

    synchronize()


class DeferralScope:
    """The owned copies and retained calls of one incomplete unit (a layer); released at :meth:`close`.

    ``policy=None`` retains without owning (the unsafe behaviour, kept for
    demonstrations and for checksum verification of what is retained).
    """

    def __init__(self, name: str, policy: Optional[str] = "registered", skip: Sequence[str] = ("param",)):
        if not isinstance(name, str) or not name:
            raise ValueError(f"a deferral scope needs a non-empty name, got {name!r}")
        if policy is not None:
            _check_policy(policy)
        self.name = name
        self.policy = policy
        self.skip = (skip,) if isinstance(skip, str) else tuple(skip)
        self._retained: List[inspect.BoundArguments] = []
        self._copies: List[torch.Tensor] = []  # held until close: a copy lives as long as its deferred unit
        self._device_checks = False  # a defer queued a CUDA check: replay reads it
        self._live_bytes = 0
        self.peak_bytes = 0
        self.closed = False
        with _acct.lock:
            _acct.open_scopes += 1

    def _add(self, nbytes: int) -> None:  # under _acct.lock
        self._live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self._live_bytes)

    def _live(self, action: str) -> None:
        if self.closed:
            raise ValueError(f"deferral scope '{self.name}' is closed: cannot {action}")

    @property
    def owned_bytes(self) -> int:
        """Bytes of this scope's copies still alive."""
        return self._live_bytes

    @property
    def retained(self) -> List[inspect.BoundArguments]:
        return list(self._retained)

    def own(self, t: torch.Tensor) -> torch.Tensor:
        self._live("own a tensor in it")
        return t if self.policy is None else own(t, self.policy, scope=self)

    def own_arguments(self, bound: inspect.BoundArguments) -> inspect.BoundArguments:
        self._live("own arguments in it")
        if self.policy is None:
            note_consumed(_tensors_of(bound, self.skip))
            return bound
        return own_arguments(bound, self.policy, self.skip, scope=self)

    def defer(self, bound: inspect.BoundArguments) -> inspect.BoundArguments:
        """Verify (checksums on), own and retain ``bound``; returns the retained arguments.

        On CPU a changed borrowed tensor raises here; on CUDA its check is queued on the device and
        read at :meth:`replay` (one host synchronisation per replay, not one per deferred tensor)."""
        self._live("defer a call in it")
        self._device_checks = _verify_leased(_tensors_of(bound, self.skip)) or self._device_checks
        bound = self.own_arguments(bound)
        self._retained.append(bound)
        return bound

    def replay(self) -> List[inspect.BoundArguments]:
        """The retained calls, in order, after verifying the leased tensors among them (checksums on).

        A change to a borrowed tensor since it was lent raises ``BorrowCorruptedError`` here on every
        device: the CUDA checks of the deferrals and of this replay are read with one synchronisation."""
        self._live("replay it")
        queued = _verify_leased(t for b in self._retained for t in _tensors_of(b, self.skip))
        if queued or self._device_checks:
            self._device_checks = False
            _synchronize_checks()
        return list(self._retained)

    def close(self) -> None:
        """Drop the retained calls and this scope's references to its copies; record its peak."""
        if self.closed:
            return
        self.closed = True
        self._retained.clear()
        self._copies.clear()
        with _acct.lock:
            _acct.open_scopes -= 1
            _acct.scope_peaks[self.name] = max(_acct.scope_peaks.get(self.name, 0), self.peak_bytes)

    def __enter__(self) -> "DeferralScope":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._retained)} retained"
        return f"DeferralScope('{self.name}', policy={self.policy!r}, {state}, {self._live_bytes} bytes owned)"


__all__ = ["POLICIES", "own", "own_arguments", "needs_copy", "DeferralScope", "stats", "reset_stats",
           "add_borrowed_marker", "borrowed_markers", "account_copy", "note_consumed", "owned_copy"]
