"""``StagingRing``: a staging buffer used as a ring, the way fast loaders use theirs.

Each :meth:`StagingRing.put` places the next tensor right after the previous
one (aligned), wrapping to offset 0 when it would run past the end; a tensor
is never split. This is the reuse pattern of InstantTensor's device ring and
runai-model-streamer's slot pool: a view stays valid only until the ring comes
round to its bytes again.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .sources import Source, layout
from .staging import StagingBuffer


class StagingRing:
    """A ring of ``nbytes`` on ``device``; ``put`` returns borrowed views."""

    def __init__(self, nbytes: int, device: Any = "cpu", name: Optional[str] = None, *, alignment: int = 64):
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        self.buffer = StagingBuffer(nbytes, device=device, name=name or "ring")
        self.alignment = alignment
        self.head = 0  # where the next tensor may start
        self.wraps = 0

    @property
    def name(self) -> str:
        return self.buffer.name

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def place(self, nbytes: int) -> int:
        """The offset where a tensor of ``nbytes`` goes next (without writing it)."""
        if nbytes > self.buffer.nbytes:
            raise ValueError(f"a tensor of {nbytes} bytes does not fit staging ring '{self.name}' "
                             f"of {self.buffer.nbytes} bytes")
        offset = -(-self.head // self.alignment) * self.alignment
        if offset + nbytes > self.buffer.nbytes:
            offset = 0
        return offset

    def put(self, name: str, source: Source, *, shape: Optional[Sequence[int]] = None,
            dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Write ``source`` (tensor, bytes or readable file) into the ring and lend it as ``name``."""
        _, _, nbytes = layout(source, shape, dtype)
        offset = self.place(nbytes)
        if offset == 0 and self.head:
            self.wraps += 1
        view = self.buffer.write(offset, source, name, shape=shape, dtype=dtype)
        self.head = offset + nbytes
        return view

    def close(self) -> None:
        self.buffer.close()

    def __enter__(self) -> "StagingRing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StagingRing('{self.name}', {self.nbytes} bytes, head {self.head}, wraps {self.wraps})"


__all__ = ["StagingRing"]
