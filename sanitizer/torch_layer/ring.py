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
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, List, Optional, Sequence, Tuple

import torch

from sanitizer.torch_layer.sources import Source, prepare
from sanitizer.torch_layer.staging import StagingBuffer, refuse_stale_source
from sanitizer.torch_layer.state import state

Span = Tuple[int, int, int]  # (segment index, start, end)


class StagingRing:
    """A ring of ``nbytes`` on ``device``; ``put`` returns borrowed views."""

    def __init__(self, nbytes: int, device: Any = "cpu", name: Optional[str] = None, *, alignment: int = 64,
                 quarantine: Optional[int] = None):
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        if quarantine is None:
            quarantine = state.options.quarantine if state.enabled else 0
        if isinstance(quarantine, bool) or not isinstance(quarantine, int) or quarantine < 0:
            raise ValueError(f"quarantine must be an int >= 0, got {quarantine!r}")
        self._name = name or "ring"
        self._device = device
        self.segments: List[StagingBuffer] = [StagingBuffer(nbytes, device=device, name=self._name)]
        self.alignment = alignment
        self.quarantine = quarantine
        self._held: Deque[Span] = deque()  # quarantined spans, oldest first
        self._last: Optional[Tuple[Span, str]] = None  # the previous put, retired at the next one
        self.segment = 0  # where the next tensor may start
        self.head = 0
        self.wraps = 0

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
        ring's alignment and to ``itemsize`` (the element size of what goes there)."""
        self._check_fits(nbytes)
        seg, offset = self.segment, self._align(self.head, itemsize)
        for _ in range(2 * len(self.segments) + 2 * len(self._held) + 2):
            if offset + nbytes > self.segments[seg].nbytes:
                seg, offset = (seg + 1) % len(self.segments), 0  # wrap (to the next segment, if grown)
                continue
            blocker = self._blocker(seg, offset, offset + nbytes)
            if blocker is None:
                return seg, offset
            offset = self._align(blocker, itemsize)
        self.segments.append(StagingBuffer(self.segments[0].nbytes, device=self._device,
                                           name=f"{self._name}+{len(self.segments)}"))
        return len(self.segments) - 1, 0

    def _blocker(self, seg: int, start: int, end: int) -> Optional[int]:
        """The end of a quarantined span overlapping ``[start, end)`` of segment ``seg``, if any."""
        ends = [e for s_seg, s, e in self._held if s_seg == seg and s < end and start < e]
        return max(ends) if ends else None

    def put(self, name: str, source: Source, *, shape: Optional[Sequence[int]] = None,
            dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Write ``source`` (tensor, bytes or readable file) into the ring and lend it as ``name``.

        The source is validated in full first (see :func:`~sanitizer.torch_layer.sources.prepare`), so a
        put that fails leaves every lease, and the ring's position, as they were."""
        src = prepare(source, shape, dtype)
        nbytes = src.nbytes
        self._check_fits(nbytes)
        refuse_stale_source(src)  # before the quarantine retires anything or the ring moves
        if self.quarantine and self._last is not None:
            (seg, start, end), _ = self._last
            self.segments[seg].retire(start, end - start, by=name)
            self._held.append((seg, start, end))
            while len(self._held) > self.quarantine:
                self._held.popleft()
            self._last = None
        seg, offset = self.place(nbytes, src.dtype.itemsize)
        wrapped = (seg, offset) < (self.segment, self.head) and self.head
        view = self.segments[seg].write_prepared(offset, src, name, source_checked=True)
        self.wraps += bool(wrapped)  # the ring moves only once the write went through
        self.segment, self.head = seg, offset + nbytes
        self._last = ((seg, offset, offset + nbytes), name)
        return view

    def close(self) -> None:
        for seg in self.segments:
            seg.close()

    def __enter__(self) -> "StagingRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StagingRing('{self.name}', {self.nbytes} bytes in {len(self.segments)} segment(s), "
                f"head {self.head}, wraps {self.wraps}, quarantine {self.quarantine})")


__all__ = ["StagingRing"]
