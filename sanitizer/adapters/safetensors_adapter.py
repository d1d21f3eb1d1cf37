"""safetensors: emulated borrowing for a loader that owns its tensors.

safetensors (safetensors), read from versions 0.4.0 to below 1.0.0; outside them: the same API (`safe_open` with `get_tensor`, `get_slice`, `get_tensors`).

| versions | entry point | borrows when | valid until | checked |
| --- | --- | --- | --- | --- |
| 0.4.x-0.8.x | `safe_open(...).get_tensor`, `get_slice(name)[...]`, `get_tensors()` | never (owned views of a private file mapping); emulated with option `safetensors_ring=N` | the consumer's last reference (emulated: the ring coming round, or the file's close) | emulated: a view kept past the ring keeps its bytes (aliases included) and is reported as an `emulated_retention` (never an error); `safetensors_strict=1`: a retention and a stale use |
| 0.4.x-0.8.x | `safetensors.torch.load_file`, `safetensors.torch.load` | never | the consumer's last reference | nothing (a whole-checkpoint dict by contract, never emulated); counted: the summary says how many loads were not checked |

``safe_open`` hands out tensors that are safe to retain, so nothing is wrong
with a consumer that keeps them. To test that consumer against the borrowed
contract anyway (before pointing it at fastsafetensors, runai or InstantTensor)
its tensors are served through a :class:`~sanitizer.torch_layer.ring.StagingRing`:

* :func:`iterate` yields ``(name, view)`` for every tensor of some files;
* with ``OWNERSHIP_SANITIZE=1`` and option ``safetensors_ring=N`` (bytes), the
  import hook makes ``safe_open(...)``'s ``get_tensor``, ``get_slice(...)[...]``
  (a slice of a borrowed tensor is borrowed) and ``get_tensors()`` return ring
  views, freed when the file is closed (the ``with`` block's end, or
  ``__exit__`` called by hand as transformers does). ``safetensors.torch.load_file``
  (and ``load``) keep returning owned tensors: their contract is a whole-checkpoint dict. Each such load
  is counted (an aggregated ``unchecked_load`` event), and the summary says how many were not checked.

What a kept view means depends on whose contract is asked. Under safetensors'
own contract (the default) keeping one is correct: a view still held when the
ring is about to reuse its bytes, or when the file is closed, keeps them, and
every alias of it (``numpy()``, a memoryview, DLPack, ``frombuffer``) with them:
the ring leaves that memory to the views on it and takes fresh memory (a close
frees only what no view uses; the ring's memory is of the plain kind even in trap
mode, where a window per kept view would only cost mappings). The program stays bit-exact; each such view is reported once per file
and holder as an ``emulated_retention`` event (how many, how many bytes, who held
them, how their bytes were kept), never as an error. ``safetensors_strict=1`` asks for the borrowed
contract instead: such a view is a retention, and its later use a stale-use
error, as with a borrowing loader.

Both contracts decide a kept view at the same moment: once its consumer has had
its turn (issue 49). When the ring reuses or frees a view's bytes, the code that
asked for the next tensor may still be bound to the previous one: a loop variable
(``for name, w in weights``), or a local of a generator that hands the weights on
(vLLM's ``WeightsMapper.apply()``: its ``data`` and ``shard_data`` are rebound, or
the generator ends, before anything can read them). Such a view is not kept;
a view still held at the next lend but one, or at a settle (a report, a test's
end), is. Strict mode's triage uses that rule for its retentions; the default
mode uses it for its ``emulated_retention`` events (:class:`_Turns`), so the two
modes name the same views.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from sanitizer.core import forking
from sanitizer.core.ledger import Lease
from sanitizer.core.safetensors_header import read_header
from sanitizer.core.sites import capture as capture_site, site_text, to_records
from sanitizer.core.units import format_bytes
from sanitizer.adapters.contracts import Contract, LoaderContracts
from sanitizer.torch_layer import records, runtime, storage_handles
from sanitizer.torch_layer.iterators import EmulatedBorrowing, emulate_borrowed
from sanitizer.torch_layer.ring import StagingRing
from sanitizer.adapters import replace
from sanitizer.torch_layer.state import state

NAME = "safetensors"
CONTRACTS = LoaderContracts(
    loader="safetensors", distribution="safetensors", low="0.4.0", high="1.0.0",
    assumed="the same API (`safe_open` with `get_tensor`, `get_slice`, `get_tensors`)",
    rows=(
        Contract("0.4.x-0.8.x", "`safe_open(...).get_tensor`, `get_slice(name)[...]`, `get_tensors()`",
                 "never (owned views of a private file mapping); emulated with option `safetensors_ring=N`",
                 "the consumer's last reference (emulated: the ring coming round, or the file's close)",
                 "emulated: a view kept past the ring keeps its bytes (aliases included) and is reported as an "
                 "`emulated_retention` (never an error); `safetensors_strict=1`: a retention and a stale use"),
        Contract("0.4.x-0.8.x", "`safetensors.torch.load_file`, `safetensors.torch.load`", "never",
                 "the consumer's last reference",
                 "nothing (a whole-checkpoint dict by contract, never emulated); counted: the summary says how "
                 "many loads were not checked"),
    ),
)
_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")
_bypass = threading.local()
_original_safe_open: Any = None


def wanted() -> bool:
    return state.options.safetensors_ring > 0


def _safe_open() -> Any:
    if _original_safe_open is not None:
        return _original_safe_open
    from safetensors import safe_open

    return getattr(safe_open, "_ownsan_original", safe_open)


def header(path: str) -> dict:
    """The safetensors JSON header of ``path`` (tensor name -> dtype, shape, data_offsets)."""
    return read_header(path)[0]


def largest_tensor_bytes(paths: Sequence[str]) -> int:
    sizes = [v["data_offsets"][1] - v["data_offsets"][0] for p in paths for v in header(p).values()]
    return max(sizes, default=0)


def _tensors(paths: Sequence[str], device: str) -> Iterator[Tuple[str, torch.Tensor]]:
    safe_open = _safe_open()
    for path in paths:
        with safe_open(path, framework="pt", device=device) as f:
            keys = f.offset_keys() if hasattr(f, "offset_keys") else f.keys()
            for name in keys:
                yield name, f.get_tensor(name)


def iterate(paths: Union[str, Iterable[str]], ring_bytes: Optional[int] = None, *, device: str = "cpu",
            lifetime: Optional[int] = None) -> EmulatedBorrowing:
    """Every tensor of ``paths`` (file order), as views of a staging ring of ``ring_bytes``.

    ``ring_bytes`` defaults to the largest tensor: the strictest ring, where
    almost every advance reuses the previous tensor's bytes.
    """
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if ring_bytes is None:
        ring_bytes = max(largest_tensor_bytes(paths), 1)
    return emulate_borrowed(_tensors(paths, device), ring_bytes, lifetime=lifetime, name=NAME)


class _Kept:
    """What one consumer kept of one emulated file past the emulated contract (for its one event)."""

    __slots__ = ("count", "nbytes", "names", "holder", "record")

    def __init__(self, holder: Optional[dict]) -> None:
        self.count = 0
        self.nbytes = 0
        self.names: List[str] = []
        self.holder = holder
        self.record: Optional[dict] = None  # its event, once reported (views decided after the close join it)


def _holds(lease: Lease) -> bool:
    """Does anything but the lease's own record hold its storage (the view, a derived view, an alias)?"""
    storage = runtime.storage_of(lease)
    return storage is not None and storage_handles.holders(storage) > 0


def _held(leases: Iterable[Lease]) -> List[Lease]:
    """The borrowed leases among ``leases`` that something still holds."""
    return [lease for lease in leases
            if lease.alive and not lease.rescued and lease.stale_by is None and _holds(lease)]


class _Waiting:
    """A view still held when the ring reused or freed its bytes, waiting for its consumer's turn."""

    __slots__ = ("owner", "lease", "due", "holder", "at_close", "running", "looped", "thread")

    def __init__(self, owner: "EmulatedSafeOpen", lease: Lease, due: int, holder: Optional[dict],
                 at_close: bool, running: Optional[Tuple[frozenset, frozenset]] = None, looped: bool = False) -> None:
        self.owner, self.lease, self.due, self.holder, self.at_close = owner, lease, due, holder, at_close
        self.running = running  # at a close: the code running it, whose plain locals may be loop variables
        # Held only by such a loop variable (the file's last view, ``t`` of ``for k in f.keys(): t = ...``):
        # decided only at a close or a settle, and only by a holder beyond it, however many lends come first
        # (a later file's load does not make the loop's variable a keeper: a blind user's test, issue 52)
        self.looped = looped
        # The consumer's thread (the one whose lend or close passed it): its turn is over at that thread's next
        # lend or close, not another thread's (4 threads each looping over a file: a view another thread's lend
        # decided was still the loop's variable, before its own thread had rebound it)
        self.thread = threading.get_ident()

    def turn_over(self, me: int) -> bool:
        """May ``me``'s lend or close decide it: its own thread's, or its thread ended?"""
        return self.thread == me or threading._active.get(self.thread) is None  # type: ignore[attr-defined]


class _Turns:
    """When a view the ring passed while it was held is decided: after its consumer's turn, process-wide.

    The lend that reuses a view's bytes runs inside the consumer's ``next()``: its loop variable, or a
    local of a generator between it and the loader (vLLM's ``WeightsMapper.apply()``: ``for name, data in
    weights``), still holds the previous tensor and is rebound as that ``next()`` returns, before anything
    can read it. So a view held at lend ``n`` is decided at lend ``n + 1`` (the consumer had its turn in
    between), as triage decides a strict-mode retention; one held when its file closes (inside the
    ``next()`` that asks past the file's last tensor, which may open the next file and lend from it
    before returning) at the lend after the next one, at the next file's close, or at a settle (a report, a
    test's end: :func:`sanitizer.features.triage.settle`). Still held then: kept, an
    ``emulated_retention``, named by what held it when it was found (the code that stored it, while it
    still ran); dropped: a loop variable or a generator's local that moved on, forgotten. Process-wide
    because a load spans files: a file's last views are decided during the next file's lends."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # taken under an EmulatedSafeOpen's lock, never the other way round
        self.lends = 0
        self.lender = 0  # the thread of the last lend (a settle from another thread may be inside its turn)
        self.waiting: List[_Waiting] = []

    def reset(self) -> None:
        """A forked child starts with nothing waiting (its parent decides its own views)."""
        self.lock = threading.RLock()
        self.lends, self.lender, self.waiting = 0, 0, []

    def lend(self) -> None:
        """A lend of any emulated file begins: the previous lend's consumer has had its turn."""
        with self.lock:
            self.lends += 1
            self.lender = threading.get_ident()
            if self.waiting:
                limit, me = self.lends, self.lender
                self._decide(lambda w: w.due < limit and not w.looped and w.turn_over(me))

    def close(self) -> None:
        """A file closes: the consumer had its turn with every tensor lent before (the close runs inside the
        ``next()`` that asks past the file's last tensor, or after the ``with`` block that used them)."""
        with self.lock:
            if self.waiting:
                limit, me = self.lends, threading.get_ident()
                self._decide(lambda w: w.due <= limit and w.turn_over(me), evidence=lambda w: w.looped,
                             keep_unconfirmed=True)

    def wait(self, owner: "EmulatedSafeOpen", lease: Lease, at_close: bool, last: bool = False) -> None:
        """``lease`` (disowned: its view keeps its bytes) was held as the ring reused or freed them: decide
        it after its consumer's turn. At a close, what holds it is named now, while the code that stored
        it may still run (``load_state_dict``'s dict, before it is returned to a caller's name)."""
        holder = _name_holder(lease) if at_close else None
        running = _running_code() if at_close else None
        # ``last``: the file's latest view still held at its close, the one a loop's variable may be left on
        # (one walk per close: whether anything beyond such a variable holds it)
        looped = last and running is not None and not _held_past_running(lease, running)
        with self.lock:
            self.waiting.append(_Waiting(owner, lease, self.lends + (1 if at_close else 0), holder, at_close,
                                         running, looped))

    def settle(self, final: bool = False) -> None:
        """A report or a test's end is about to read the records: decide what has had its turn (``final``:
        everything). Asked from another thread while the last lend's thread runs, that lend's consumer may
        still be in its turn: only what waited for an earlier lend is decided (triage's own rule)."""
        with self.lock:
            if not self.waiting:
                return
            last = self.lends  # a view held at a close with no lend since: only a holder other than a local of
            # the code running then or now confirms it (the loop variable left on the last tensor, a module-level
            # loop's global included), as triage decides a strict retention
            if final:
                self._decide(lambda w: True, evidence=lambda w: w.due > last or w.looped)
                return
            limit = self.lends
            if self.lender not in (0, threading.get_ident()):
                lender = threading._active.get(self.lender)  # type: ignore[attr-defined]
                if lender is not None and lender.is_alive():
                    limit -= 1
            # (unconfirmed ones wait on, held only by a loop's variable: a later close or settle decides them)
            self._decide(lambda w: w.due < limit or (w.at_close and w.due <= limit + 1),
                         evidence=lambda w: w.due > last or w.looped, keep_unconfirmed=True)

    def _decide(self, due: Callable[[_Waiting], bool],
                evidence: Optional[Callable[[_Waiting], bool]] = None, keep_unconfirmed: bool = False) -> None:
        """(Under the lock.) Each waiting view that is due: kept if still held (where ``evidence`` says so,
        by more than a local of the code running then or now), else forgotten, or left waiting when
        ``keep_unconfirmed`` (held, but only by such a local); a closed file's kept views are reported at
        once (an open one reports at its close)."""
        now = [w for w in self.waiting if due(w)]
        if not now:
            return
        self.waiting = [w for w in self.waiting if not due(w)]
        closed: Dict[int, EmulatedSafeOpen] = {}
        for w in now:
            if not (w.lease.alive and _holds(w.lease)):
                continue
            if evidence is None or not evidence(w) or _held_past_running(w.lease, w.running):
                w.owner._record(w.lease, w.holder)
                if w.owner._closed:
                    closed[id(w.owner)] = w.owner
            elif keep_unconfirmed:
                w.looped = True  # held only by a loop's variable: decided again at a close or a settle, never a lend
                self.waiting.append(w)
        for owner in closed.values():
            owner._report_kept()


_TURNS = _Turns()
forking.in_child(_TURNS.reset)


def settle(final: bool = False) -> None:
    """Decide the views that waited for their consumer's turn (a settle hook of triage's)."""
    _TURNS.settle(final)


class EmulatedSafeOpen:
    """``safe_open`` whose tensors are lent as views of a staging ring (option ``safetensors_ring``).

    Under safetensors' own contract (not strict) a view kept past the ring keeps its bytes, and so does
    every alias of it (``numpy()``, a memoryview, DLPack, ``frombuffer``, a raw pointer): those point at
    the memory, not at the view's storage, so moving the storage onto a copy (a rescue's ``repoint``)
    would leave them reading the ring's next tensor, or unmapped memory (issue 48). So the memory stays:
    the ring leaves the segment to the views that hold it and takes fresh memory
    (:meth:`StagingRing.renew`), and a close frees only what no view uses (each view's storage keeps its
    buffer's memory alive). The ring's memory is plain even in trap mode: no held view is ever retired
    here, so a trap window per kept view would only cost mappings (40,000 kept views: the map budget).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if getattr(_bypass, "on", False):
            return _safe_open()(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        self._inner = _safe_open()(*args, **kwargs)
        framework = kwargs.get("framework", args[1] if len(args) > 1 else None)
        filename = kwargs.get("filename", args[0] if args else "?")
        self._emulate = framework in _TORCH_FRAMEWORKS
        self._label = f"{NAME}:{os.path.basename(os.fspath(filename))}"
        self._ring: Optional[StagingRing] = None
        self._closed = False
        self._kept: Dict[Tuple[Optional[str], Optional[str]], _Kept] = {}  # (consumer, stored at) -> what it kept
        self._unnamed: List[Tuple[Lease, Optional[dict]]] = []  # kept views to name again at the report
        # Views left on memory the ring moved away from before it came round to them: (segment, lease),
        # reported as kept if still held when the ring passes their bytes (or at the close), as if it had
        # not moved.
        self._pending: List[Tuple[int, Lease]] = []
        self._lock = threading.Lock()  # transformers materializes slices from a thread pool: place + put are one step

    # -- lending -----------------------------------------------------------------
    def _strict(self) -> bool:
        return bool(state.options.safetensors_strict) or not storage_handles.AVAILABLE

    def _lend(self, name: str, tensor: Any) -> Any:
        if not (self._emulate and state.enabled and isinstance(tensor, torch.Tensor)):
            return tensor
        ring_bytes = state.options.safetensors_ring
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > ring_bytes:
            # A ring smaller than a tensor is a setting's mistake, not the program's: the program gets its
            # tensor as safetensors returns it (owned), and the summary says so, with the option to raise.
            _note_oversized(self._label, name, nbytes, ring_bytes)
            return tensor
        _TURNS.lend()
        with self._lock:
            self._closed = False
            if self._ring is None or self._ring.buffer.closed:
                # Not strict: held views are kept, never retired, so trap mode has nothing to trap and a
                # window per kept view would only cost mappings (40,000 kept views: the process's map
                # budget, and 13x the load time): plain memory, whose kept bytes the ring leaves to them.
                # Not strict, the ring's memory decides nothing either (no held view's bytes ever change):
                # each tensor is lent where safetensors made it, at the ring's offsets (see in_place.py).
                self._ring = StagingRing(ring_bytes, device=tensor.device, name=self._label,
                                         plain_memory=not self._strict(), in_place=not self._strict())
                self._pending = []
            if (self._pending or state.ledger.live_count) and not self._strict():
                # (nothing pending and no lease alive anywhere: nothing can be held where the put lands, and
                # the put finds its own place: a ring load whose consumer copies each tensor out)
                segment, offset = self._ring.place(nbytes, tensor.element_size())
                self._keep_held(segment, offset, offset + nbytes)
            return self._ring.put(name, tensor)

    def _keep_held(self, segment: int, start: int, end: int) -> None:
        """(Under the lock.) The ring is about to write ``[start, end)`` of ``segment``: every view still
        held there keeps its bytes, aliases included (safetensors' contract lets it be kept)."""
        self._pass_pending(segment, start, end)
        if not state.ledger.live_count:
            return  # (no lease alive anywhere: nothing can be held there)
        region = self._ring.segments[segment]._region.region_id
        stay = _held(state.ledger.overlapping(region, start, end))
        if stay:
            self._move_ring(segment, stay)

    def _move_ring(self, segment: int, held: List[Lease]) -> None:
        """(Under the lock.) Leave ``held`` (views over the bytes about to be written) where they are and
        give the segment fresh memory. The segment's other held views are left there too: nothing writes
        that memory any more, so they are owned now, and reported only if still held when the ring comes
        round to their bytes (:meth:`_pass_pending`). Then the old buffer is closed: what no view holds
        is freed with it."""
        old = self._ring.renew(segment)
        for lease in held:
            self._wait(lease, at_close=False)
        for lease in _held(old.leases()):
            runtime.disown(lease)
            self._pending.append((segment, lease))
        old.close()

    def _pass_pending(self, segment: Optional[int], start: int, end: int, latest: int = -1) -> None:
        """(Under the lock.) The ring passes ``[start, end)`` of ``segment`` (None: the close, everything):
        a view left behind there that is still held is a kept one."""
        left = []
        for seg, lease in self._pending:
            if not lease.alive:
                continue
            if segment is None or (seg == segment and lease.start < end and start < lease.end):
                if _holds(lease):
                    _TURNS.wait(self, lease, at_close=segment is None, last=lease.lease_id == latest)
                continue
            left.append((seg, lease))
        self._pending = left

    def _wait(self, lease: Lease, at_close: bool, last: bool = False) -> None:
        """Disown ``lease`` (its view, and every alias, owns the memory it is on) and decide after its
        consumer's turn whether it was kept (:class:`_Turns`; ``last``: the file's latest view held at its
        close)."""
        runtime.disown(lease)
        _TURNS.wait(self, lease, at_close, last)

    def _record(self, lease: Lease, holder: Optional[dict] = None) -> None:
        """(Under ``_TURNS.lock``.) Count a view kept past the emulated contract, for its consumer's one
        event; ``holder``: what held it when it was found, else named now."""
        # Each view is named by what holds it (a file's views go to norms and linears alike: one
        # holder per file would label the norm weights as the linear's), grouped by consumer.
        holder = holder or _name_holder(lease)
        if _unnamed(holder) and lease.alive:
            # (held where Python cannot see yet: a dict or list a comprehension is still building, the
            # usual ``{k: f.get_tensor(k) for k in f.keys()}``; named again at the report, once it is built)
            self._unnamed.append((lease, holder))
            return
        self._count(lease, holder)

    def _count(self, lease: Lease, holder: Optional[dict]) -> None:
        """(Under ``_TURNS.lock``.) Add ``lease`` to the group of ``holder``."""
        group = (holder or {}).get("consumer"), site_text((holder or {}).get("stored_at"))
        kept = self._kept.get(group)
        if kept is None:
            kept = self._kept[group] = _Kept(holder)
        kept.count += 1
        kept.nbytes += lease.end - lease.start
        if len(kept.names) < 8:
            kept.names.append(lease.name or "?")

    def _report_kept(self) -> None:
        """One event per consumer (and place it stored the views) of this file; views decided after an
        earlier report join its event."""
        with _TURNS.lock:
            unnamed, self._unnamed = self._unnamed, []
            for lease, first in unnamed:
                holder = _name_holder(lease) if lease.alive and _holds(lease) else None
                self._count(lease, first if _unnamed(holder) else holder)
            for kept in self._kept.values():
                if not kept.count:
                    continue
                holder = (kept.holder or {}).get("path") or "something the walk could not name"
                fields = {
                    "summary": (f"{kept.count} view(s) of {self._label} ({format_bytes(kept.nbytes)}) were still "
                                f"held by {holder} after their consumer's turn, past the emulation ring's reuse or "
                                f"free of their bytes: a retention under the emulated borrowed contract, correct "
                                f"under safetensors' own (each kept its bytes, aliases included: left where they "
                                f"were, safetensors' own memory or the ring's, which the ring gave up to them; "
                                f"safetensors_strict=1 makes it a "
                                f"retention, and a read of it a stale-use error)"),
                    "count": kept.count, "nbytes": kept.nbytes, "leases": list(kept.names)}
                if kept.record is None:
                    kept.record = records.record_event("emulated_retention", {
                        "kind": "emulated_retention", "summary": fields.pop("summary"), "file": self._label,
                        **fields, "holder": kept.holder, "pid": os.getpid()})
                else:
                    records.update_event(kept.record, **fields)

    # -- safe_open's API ---------------------------------------------------------
    def get_tensor(self, name: str) -> Any:
        return self._lend(name, self._inner.get_tensor(name))

    def get_slice(self, name: str) -> Any:
        inner = self._inner.get_slice(name)
        return _EmulatedSlice(self, name, inner) if self._emulate and state.enabled else inner

    def get_tensors(self) -> Any:
        """Every tensor of the file as a dict (safetensors: ``get_tensor`` over ``offset_keys()``)."""
        if not (self._emulate and state.enabled):
            return self._inner.get_tensors()
        keys = self._inner.offset_keys() if hasattr(self._inner, "offset_keys") else self._inner.keys()
        owned = {k: self._inner.get_tensor(k) for k in keys}
        sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in owned.values()
                 if isinstance(t, torch.Tensor)]
        # Every view of the dict is live at once: lent from a ring that cannot hold them all (a wrap wastes
        # less than the largest), the emulation itself would overwrite the dict's first tensors with its
        # last, and a correct ``load_state_dict(f.get_tensors())`` would read as a retention.
        need = sum(sizes) + max(sizes, default=0)
        ring_bytes = state.options.safetensors_ring
        if need > ring_bytes:
            _note_owned(f"{NAME}.safe_open.get_tensors (a dict larger than safetensors_ring={ring_bytes})",
                        f"owned tensors as safetensors returns them, never lent from the emulation ring: "
                        f"the whole dict of {self._label} is live at once and needs {need} bytes of ring; "
                        f"raise safetensors_ring to at least that to check it", len(sizes), sum(sizes))
            return owned
        return {k: self._lend(k, t) for k, t in owned.items()}

    def close(self) -> None:
        """Free the ring: every view still held goes stale (strict) or keeps its bytes where they are (the
        default: the ring's memory is freed only once no view uses it, aliases included)."""
        with self._lock:
            ring, self._ring = self._ring, None
            if ring is not None:
                if not self._strict() and not ring.buffer.closed:
                    _TURNS.close()
                    held = [lease for segment in ring.segments for lease in _held(segment.leases())]
                    latest = max([lease.lease_id for _, lease in self._pending if lease.alive]
                                 + [lease.lease_id for lease in held], default=-1)
                    self._pass_pending(None, 0, 0, latest)
                    for lease in held:
                        self._wait(lease, at_close=True, last=lease.lease_id == latest)
                ring.close()
            self._pending = []
            self._closed = True
        self._report_kept()

    def __enter__(self) -> "EmulatedSafeOpen":
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self.close()
        return self._inner.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _EmulatedSlice:
    """``get_slice(name)``: shape and dtype as safetensors says; each ``[...]`` a ring view of the slice, laid
    out as safetensors lays it out.

    safetensors (0.4+) returns a slice as a view of the whole tensor in its file mapping: ``[:, 2:5]`` of an
    8x8 tensor has strides (8, 1) and offset 2, not contiguous (a real borrowing loader's slice is a view of its
    buffer too). So the ring holds the bytes the slice spans, and the lent view has the same shape and strides
    over them: a consumer that reads strides, calls ``view()`` (which refuses a strided slice), or
    checks ``is_contiguous()`` sees what it sees without the sanitizer (it saw a contiguous copy). The span
    lies within the tensor's own bytes, so it fits a ring sized for the largest tensor."""

    def __init__(self, owner: EmulatedSafeOpen, name: str, inner: Any):
        self._owner, self._name, self._inner = owner, name, inner

    def __getitem__(self, index: Any) -> Any:
        got = self._inner[index]
        if isinstance(got, torch.Tensor) and got.numel() == 0:  # no bytes: safetensors' shape and strides
            lent = self._owner._lend(self._name, got)
            return lent if lent is got else lent.as_strided(tuple(got.shape), tuple(got.stride()),
                                                            lent.storage_offset())
        if not isinstance(got, torch.Tensor) or got.is_contiguous() or any(st < 0 for st in got.stride()):
            return self._owner._lend(self._name, got)
        # the bytes from the slice's first element to its last (strides >= 0: the first is the lowest)
        span = 1 + sum((size - 1) * stride for size, stride in zip(got.shape, got.stride()))
        flat = got.as_strided((span,), (1,), got.storage_offset())
        lent = self._owner._lend(self._name, flat)
        if lent is flat:  # (not emulated: safetensors' own tensor)
            return got
        return lent.as_strided(tuple(got.shape), tuple(got.stride()), lent.storage_offset())

    def __getattr__(self, name: str) -> Any:  # get_shape, get_dtype
        return getattr(self._inner, name)


def _unnamed(holder: Optional[dict]) -> bool:
    """No holder a person can act on: none found, or only one Python cannot see into (a comprehension's
    dict or list under construction)."""
    return holder is None or holder.get("kind") == "unknown"


def _name_holder(lease: Lease) -> Optional[dict]:
    """Who holds ``lease``'s view (triage's naming: a known path, a sibling, else a bounded walk), or None."""
    if state.options.triage_budget_ms <= 0:
        return None
    from sanitizer.features.triage import name_holder

    return name_holder(lease)


def _held_past_running(lease: Lease, running: Optional[Tuple[frozenset, frozenset]] = None) -> bool:
    """Held by more than a plain local of the running code, or of ``running`` (the code that ran the close)
    (triage's walk; without walks, yes)?"""
    if state.options.triage_budget_ms <= 0:
        return True
    from sanitizer.features.triage import held_past_running

    return held_past_running(lease, running)


def _running_code() -> Optional[Tuple[frozenset, frozenset]]:
    """The code running the close (triage's :func:`running_code`), or None without walks."""
    if state.options.triage_budget_ms <= 0:
        return None
    from sanitizer.features.triage import running_code

    return running_code()


_ALIGN = 64  # StagingRing's default alignment: each put starts on it
_UNCHECKED_WHY = "owned tensors by safetensors' contract (a whole-checkpoint dict): never emulated"


def _note_unchecked(entry: str, out: Any) -> None:
    """Count a load the emulation leaves alone, for the summary ("2 loads not checked (...)"): a program
    that loads through ``load_file`` (peft and diffusers do) would otherwise pass as checked."""
    if not state.enabled or not isinstance(out, dict):
        return
    try:
        tensors = [t for t in out.values() if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        first = {"loader": NAME, "entry": entry, "why": _UNCHECKED_WHY,
                 "first_at": (to_records(capture_site(4)[:1]) or [None])[0]}
        records.tally_event("unchecked_load", entry, first, count=1, tensors=len(tensors), bytes=nbytes)
    except Exception:  # a count for the summary is never worth an error in the program's load
        pass


def _note_oversized(label: str, name: str, nbytes: int, ring_bytes: int) -> None:
    """Count a tensor too large for the emulation ring, handed over unlent: the summary says "N loads not
    checked (... larger than safetensors_ring=...)" with the size, so the user knows what to raise the
    option to, and the program runs on as without the sanitizer."""
    _note_owned(f"{NAME}.safe_open (tensors larger than safetensors_ring={ring_bytes})",
                f"owned tensors as safetensors returns them, never lent from the emulation ring: '{name}' of "
                f"{label} alone is {nbytes} bytes; raise safetensors_ring to at least the largest tensor", 1, nbytes)


def _note_owned(entry: str, why: str, tensors: int, nbytes: int) -> None:
    """Count a load the ring could not emulate, handed over owned (the summary's "loads not checked")."""
    try:
        first = {"loader": NAME, "entry": entry, "why": why,
                 "first_at": (to_records(capture_site(5)[:1]) or [None])[0]}
        records.tally_event("unchecked_load", entry, first, count=1, tensors=tensors, bytes=nbytes)
    except Exception:  # a count for the summary is never worth an error in the program's load
        pass


def _owned_loads(load: Any, entry: str) -> Any:
    @functools.wraps(load)
    def load_owned(*args: Any, **kwargs: Any) -> Any:
        _bypass.on = True
        try:
            out = load(*args, **kwargs)
        finally:
            _bypass.on = False
        _note_unchecked(entry, out)
        return out

    return load_owned


def patch(module: Any) -> None:
    global _original_safe_open
    from sanitizer.features import triage

    triage.add_settler(settle)  # a report decides the views that waited for their consumer's turn
    _original_safe_open = module.safe_open
    EmulatedSafeOpen._ownsan_original = module.safe_open  # type: ignore[attr-defined]
    import safetensors.torch as st_torch  # its `from safetensors import safe_open` may predate the patch

    replace(module, "safe_open", EmulatedSafeOpen)
    replace(st_torch, "safe_open", EmulatedSafeOpen)
    replace(st_torch, "load_file", _owned_loads(st_torch.load_file, "safetensors.torch.load_file"))
    if callable(getattr(st_torch, "load", None)):  # bytes in, a dict of owned tensors out: not emulated either
        replace(st_torch, "load", _owned_loads(st_torch.load, "safetensors.torch.load"))


__all__ = ["iterate", "header", "largest_tensor_bytes", "EmulatedSafeOpen", "patch", "wanted"]
