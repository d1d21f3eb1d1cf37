"""``StagingRing``: a staging buffer used as a ring, the way fast loaders use theirs.

Each :meth:`StagingRing.put` places the next tensor right after the previous
one (aligned), wrapping to offset 0 when it would run past the end; a tensor
is never split. This is the reuse pattern of InstantTensor's device ring and
runai-model-streamer's slot pool: a view stays valid only until the ring comes
round to its bytes again.

With ``quarantine=N`` (the option, or the argument) the ring applies the
strict contract instead, as ASan's quarantine does for freed chunks: a tensor's
lease ends when the next tensor is put (it is retired then, and poisoned when
``poison=1``), and the N most recently retired regions are kept out of reuse,
so stale reads keep hitting poison for longer. When quarantined regions leave
no room, the ring grows by another segment of its size rather than reuse them.

**Threads.** A loader lends from its ring on several threads, so a put is one step to the
others: choose the bytes, retire what they overlap, write, lend. Two puts never get the same
bytes while the ring has room for both (they did: eight threads putting through a ring that
never came round reported each other's tensors as overwritten, issue 46). The ring's lock
covers only the choice: a put *reserves* its bytes under it and writes and lends outside it,
because the write reads the caller's file and the retire runs the features' hooks, which may
end in a finalizer of the program's own that puts into this ring or waits for a thread that
does. A put whose turn comes round to bytes another thread's put is still writing waits for
that put to lend, then overwrites it as the ring does (bounded, as a reuse waits for an
overlapping retire; never for its own thread's put, never from inside the sanitizer's own
work: then it takes the next bytes no put is writing). With the quarantine, a put that
starts while the previous one is still writing leaves it to retire its own lease once lent.
:meth:`StagingRing.close` refuses every later put; one under way either lent before the close
(its view goes stale with the rest) or fails with the buffer's "closed" error.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Set, Tuple

import torch

from sanitizer.core import forking
from sanitizer.core.retires_in_flight import WAIT_S
from sanitizer.torch_layer import runtime
from sanitizer.torch_layer.in_place import InPlaceBuffer, lendable
from sanitizer.torch_layer.sources import Source, prepare
from sanitizer.torch_layer.staging import StagingBuffer, refuse_stale_source
from sanitizer.torch_layer.state import state

Span = Tuple[int, int, int]  # (segment index, start, end)
Position = Tuple[int, int, int]  # (segment, head, wraps): where the next put may start


class _Put:
    """One put from its reservation to its end: its bytes, its thread, and whether a later put (the
    quarantine's next tensor) retires it once it has lent."""

    __slots__ = ("span", "name", "thread", "done", "retire_by")

    def __init__(self, span: Span, name: str, thread: int) -> None:
        self.span = span
        self.name = name
        self.thread = thread
        self.done = False
        self.retire_by: Optional[str] = None  # set while it is still under way: it retires itself at its end


_RINGS: "weakref.WeakSet[StagingRing]" = weakref.WeakSet()


class StagingRing:
    """A ring of ``nbytes`` on ``device``; ``put`` returns borrowed views."""

    def __init__(self, nbytes: int, device: Any = "cpu", name: Optional[str] = None, *, alignment: int = 64,
                 quarantine: Optional[int] = None, plain_memory: bool = False, in_place: bool = False):
        """``plain_memory``: segments of the plain kind even in trap mode (a ring whose held views are kept,
        never retired: the ``safetensors_ring`` emulation's default contract, where a trap window per kept
        view only costs mappings and time). ``in_place``: segments that lend an exclusive source tensor
        where it is, with the ring's bookkeeping and no copy (that same contract: no held view's bytes
        ever change, so the ring's memory decides nothing; see in_place.py)."""
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        if quarantine is None:
            quarantine = state.options.quarantine if state.enabled else 0
        if isinstance(quarantine, bool) or not isinstance(quarantine, int) or quarantine < 0:
            raise ValueError(f"quarantine must be an int >= 0, got {quarantine!r}")
        self._name = name or "ring"
        self._device = device
        self._plain = plain_memory
        self._in_place = in_place
        self.segments: List[StagingBuffer] = [self._segment(nbytes, self._name)]
        self.alignment = alignment
        self.quarantine = quarantine
        self._held: Deque[Span] = deque()  # quarantined spans, oldest first
        self._last: Optional[_Put] = None  # the previous put, retired at the next one
        self.segment = 0  # where the next tensor may start
        self.head = 0
        self.wraps = 0
        self._new_lock()
        _RINGS.add(self)

    def _new_lock(self) -> None:
        """The ring's lock (reentrant: a finalizer that puts may run inside a put of its own thread), the
        condition a put waits on for bytes another put is writing, and the puts under way."""
        self._lock = threading.RLock()
        self._ended = threading.Condition(self._lock)
        self._under_way: Set[_Put] = set()
        self._waiting = 0
        self._moves = 0  # reservations made: a decision re-made if one happened while it was taken
        self._closing = False

    @property
    def buffer(self) -> StagingBuffer:
        """The first (usually only) segment."""
        return self.segments[0]

    @property
    def name(self) -> str:
        return self._name

    @property
    def nbytes(self) -> int:
        return sum(seg.nbytes for seg in self.segments)

    def _align(self, offset: int, to: int = 0) -> int:
        to = max(self.alignment, to)
        return -(-offset // to) * to

    def _check_fits(self, nbytes: int) -> None:
        size = self.segments[0].nbytes
        if nbytes > size:
            raise ValueError(f"a tensor of {nbytes} bytes does not fit staging ring '{self.name}' of {size} bytes")

    def place(self, nbytes: int, itemsize: int = 1) -> Tuple[int, int]:
        """``(segment, offset)`` where a tensor of ``nbytes`` goes next (without writing it), aligned to the
        ring's alignment and to ``itemsize`` (the element size of what goes there). (A put that finds there
        bytes another thread's put is still writing waits for that put first.)"""
        self._check_fits(nbytes)
        with self._lock:
            spot = self._find(nbytes, itemsize)
            return spot if spot is not None else self._grow()

    def _find(self, nbytes: int, itemsize: int, under_way: Any = ()) -> Optional[Tuple[int, int]]:
        """(Under the lock.) The first place from the head that no quarantined span (and no put in
        ``under_way``) overlaps; None when there is none."""
        seg, offset = self.segment, self._align(self.head, itemsize)
        if not self._held and not under_way and len(self.segments) == 1:  # the common case: nothing to skip
            return (0, offset) if offset + nbytes <= self.segments[0].nbytes else (0, 0)
        for _ in range(2 * len(self.segments) + 2 * (len(self._held) + len(under_way)) + 2):
            if offset + nbytes > self.segments[seg].nbytes:
                seg, offset = (seg + 1) % len(self.segments), 0  # wrap (to the next segment, if grown)
                continue
            blocker = self._blocker(seg, offset, offset + nbytes, under_way)
            if blocker is None:
                return seg, offset
            offset = self._align(blocker, itemsize)
        return None

    def _grow(self) -> Tuple[int, int]:
        """(Under the lock.) Quarantined spans leave no room: another segment of the ring's size."""
        self.segments.append(self._segment(self.segments[0].nbytes, f"{self._name}+{len(self.segments)}"))
        return len(self.segments) - 1, 0

    def _blocker(self, seg: int, start: int, end: int, under_way: Any = ()) -> Optional[int]:
        """The end of a quarantined span (or of a put under way) overlapping ``[start, end)`` of segment
        ``seg``, if any. (Plain loops: on a single thread both are usually empty, and this runs per put.)"""
        found = None
        for s_seg, s, e in self._held:
            if s_seg == seg and s < end and start < e and (found is None or e > found):
                found = e
        for p in under_way:
            s_seg, s, e = p.span
            if s_seg == seg and s < end and start < e and (found is None or e > found):
                found = e
        return found

    def put(self, name: str, source: Source, *, shape: Optional[Sequence[int]] = None,
            dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Write ``source`` (tensor, bytes or readable file) into the ring and lend it as ``name``.

        The source is validated in full first (see :func:`~sanitizer.torch_layer.sources.prepare`), so a
        put that fails leaves every lease, and the ring's position, as they were. Safe from several
        threads (see the module's text)."""
        if self._in_place and shape is None and dtype is None and isinstance(source, torch.Tensor):
            as_is = lendable(source, self.segments[0].device)
            if as_is is not None:
                return self._lend_as_is(name, *as_is)
        src = prepare(source, shape, dtype)
        nbytes = src.nbytes
        self._check_fits(nbytes)
        refuse_stale_source(src)  # before the quarantine retires anything or the ring moves
        mine, before, retire = self._reserve(name, nbytes, src.dtype.itemsize)
        seg, offset, _ = mine.span
        try:
            if retire is not None:  # the quarantine: the previous tensor's lease ends now
                self._retire(retire, name)
            view = self.segments[seg].write_prepared(offset, src, name, source_checked=True)
        except BaseException:
            self._end(mine, before)
            raise
        self._end(mine, None)
        return view

    def _lend_as_is(self, name: str, tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
        """:meth:`put` of a tensor an in-place ring lends where it is: the same reservation, reuse and
        lease, no copy (the tensor is no lease, so no stale source to refuse)."""
        self._check_fits(nbytes)
        mine, before, retire = self._reserve(name, nbytes, tensor.element_size())
        seg, offset, _ = mine.span
        try:
            if retire is not None:
                self._retire(retire, name)
            view = self.segments[seg].lend_as_is(offset, nbytes, tensor, name)
        except BaseException:
            self._end(mine, before)
            raise
        self._end(mine, None)
        return view

    def _reserve(self, name: str, nbytes: int, itemsize: int) -> Tuple[_Put, Position, Optional[Span]]:
        """Choose this put's bytes and keep them out of every other put's choice until :meth:`_end`: the put
        itself, the position before it (restored if it fails), and the span the quarantine retires now."""
        me = threading.get_ident()
        with self._lock:
            if self._closing:
                self._refuse_if_closed(name)
            retire = None
            last, self._last = self._last, None
            if self.quarantine and last is not None:  # the previous tensor's lease ends at this put
                self._held.append(last.span)  # (before the choice: this put must not land on it)
                while len(self._held) > self.quarantine:
                    self._held.popleft()
                if last.done:
                    retire = last.span
                else:  # still writing: it retires itself once it has lent
                    last.retire_by = name
            deadline = None
            while True:
                moves = self._moves
                spot = self._find(nbytes, itemsize)
                if spot is not None and self._under_way and self._writing(spot, nbytes):
                    # The ring came round to bytes another put is still writing: wait for it to lend (then
                    # overwrite it, as the ring does), unless this thread has a put under way itself (a
                    # finalizer inside it) or runs the sanitizer's own work (the put it would wait for
                    # may need the lock that work holds), or the wait ran out: then the next free bytes.
                    if deadline is None:
                        deadline = time.monotonic() + WAIT_S
                    left = deadline - time.monotonic()
                    if left > 0 and all(p.thread != me for p in self._under_way) \
                            and runtime._not_inside_our_own_work():
                        self._waiting += 1
                        try:
                            self._ended.wait(left)
                        finally:
                            self._waiting -= 1
                        self._refuse_if_closed(name)
                        continue
                    spot = self._find(nbytes, itemsize, self._under_way) or spot
                if spot is None:
                    spot = self._grow()
                seg, offset = spot
                mine = _Put((seg, offset, offset + nbytes), name, me)
                before = (self.segment, self.head, self.wraps)
                wrapped = self.head > 0 and (seg < self.segment or (seg == self.segment and offset < self.head))
                if self._moves != moves:  # a finalizer of this thread put meanwhile (inside this choice)
                    continue
                self._last = mine
                self._under_way.add(mine)
                self._moves += 1
                self.wraps += wrapped
                self.segment, self.head = seg, offset + nbytes
                return mine, before, retire

    def _writing(self, spot: Tuple[int, int], nbytes: int) -> bool:
        """(Under the lock.) Does a put under way overlap ``nbytes`` at ``spot``?"""
        seg, start = spot
        end = start + nbytes
        return any(p.span[0] == seg and p.span[1] < end and start < p.span[2] for p in self._under_way)

    def _refuse_if_closed(self, name: str) -> None:
        if self._closing:
            raise ValueError(f"staging buffer '{self.segments[0].name}' is closed: cannot write '{name}' into it")

    def _end(self, mine: _Put, failed_from: Optional[Position]) -> None:
        """The put is over: its bytes may be chosen again. A failed one (``failed_from``: the position before
        it) lent nothing: the ring goes back there unless another put moved it since."""
        retire = None
        with self._lock:
            self._under_way.discard(mine)
            mine.done = True
            if failed_from is not None:
                if self._last is mine:  # (no put reserved since)
                    self._last = None
                    self.segment, self.head, self.wraps = failed_from
            elif mine.retire_by is not None:
                retire = mine.span
            if self._waiting:
                self._ended.notify_all()
        if retire is not None:
            try:
                self._retire(retire, mine.retire_by)
            except ValueError:
                if not self.segments[retire[0]].closed:
                    raise  # (closed meanwhile: the close made its lease stale already)

    def _retire(self, span: Span, by: Optional[str]) -> None:
        seg, start, end = span
        self.segments[seg].retire(start, end - start, by=by)

    def _segment(self, nbytes: int, name: str) -> StagingBuffer:
        if self._in_place:
            return InPlaceBuffer(nbytes, device=self._device, name=name)
        if self._plain:
            return StagingBuffer.plain(nbytes, device=self._device, name=name)
        return StagingBuffer(nbytes, device=self._device, name=name)

    def renew(self, segment: int) -> StagingBuffer:
        """Give segment ``segment`` fresh memory of its size for the next puts, and return the buffer it
        had, still open and never written again by the ring (the caller closes it once it has decided
        what its leases are).

        Why: a view must sometimes keep its bytes where the ring comes round (an emulated owning loader,
        ``safetensors_ring``), and an alias of it (``numpy()``, a memoryview, DLPack, ``frombuffer``)
        points at those very bytes, not at the view's storage: a storage-level move leaves the alias on
        the ring. So the bytes stay and the ring moves. The old memory lives as long as a lease's storage
        does (each keeps its buffer's memory alive, see aliasing.py), not longer. The ring's position and
        quarantine are kept: only the memory changes. No put may be writing into that segment (the
        caller serializes its puts with this call)."""
        with self._lock:
            if self._closing:
                raise ValueError(f"staging ring '{self.name}' is closed: cannot renew segment {segment}")
            if any(p.span[0] == segment for p in self._under_way):
                raise RuntimeError(f"staging ring '{self.name}': cannot renew segment {segment} while a put "
                                   f"is writing into it")
            old = self.segments[segment]
            self.segments[segment] = self._segment(old.nbytes, old.name)
            return old

    def close(self) -> None:
        """Free every segment. Later puts are refused; one under way either lent before (its view goes
        stale with the rest) or fails with the buffer's "closed" error: no lease outlives the close fresh."""
        with self._lock:
            self._closing = True
            segments = list(self.segments)
        for seg in segments:
            seg.close()

    def __enter__(self) -> "StagingRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StagingRing('{self.name}', {self.nbytes} bytes in {len(self.segments)} segment(s), "
                f"head {self.head}, wraps {self.wraps}, quarantine {self.quarantine})")


@forking.in_child
def _after_fork() -> None:
    """A child forked while another thread was putting inherits that put's lock and reservation, and
    the thread that would end them does not exist there: each ring starts afresh (its position kept)."""
    for ring in list(_RINGS):
        closing, last = ring._closing, ring._last
        ring._new_lock()
        ring._closing = closing
        if last is not None and not last.done:  # its thread is not here: that put never ends in this child
            ring._last = None


__all__ = ["StagingRing"]
