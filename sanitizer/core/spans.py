"""Interval arithmetic on half-open byte ranges ``[start, end)``: torch-free, shared by the
checksum poisoner and the lending iterators."""
from __future__ import annotations

from typing import Iterable, List, Tuple

Span = Tuple[int, int]


def merge(spans: Iterable[Span]) -> List[Span]:
    """``spans`` sorted, with overlapping or touching ones joined and empty ones dropped."""
    out: List[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def subtract(spans: Iterable[Span], holes: Iterable[Span]) -> List[Span]:
    """The parts of ``spans`` not covered by any of ``holes`` (half-open, in any order, may overlap)."""
    holes = sorted(holes)
    out: List[Span] = []
    for start, end in spans:
        cur = start
        for h_start, h_end in holes:
            if h_end <= cur or h_start >= end:
                continue
            if h_start > cur:
                out.append((cur, h_start))
            cur = max(cur, h_end)
        if cur < end:
            out.append((cur, end))
    return out


__all__ = ["Span", "merge", "subtract"]
