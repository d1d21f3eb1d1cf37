"""An index of items keyed by half-open intervals: which overlap a range, which contain one.

The ledger keeps every region's fresh leases here, and every device's regions:
a real MoE checkpoint lends 100,000+ tensors from one buffer, and a scan of all
of them at each reuse (or at each address lookup) made a load quadratic.

How it stays O(log n + k) (k = items returned) without a balanced tree written
in Python, and cheap for the common case:

* Items are split by **length class** ``c = (end - start).bit_length()``: every
  item of class ``c`` is shorter than ``2**c`` and at least half that long. An
  item of class ``c`` overlapping ``[qs, qe)`` must start after ``qs - 2**c``,
  so one bisect per class finds the first candidate and the scan stops at the
  first start ``>= qe``. The candidates that are not hits end at or before
  ``qs``; being at least ``2**(c-1)`` long, they all hold the byte
  ``qs - 2**(c-1)``: at most one per class for disjoint items, and in general
  no more than the items piled on one byte (the overlap depth). A checkpoint's
  tensors fall into a few dozen classes at most; a ring's usually into a few.
* Each class is a **blocked sorted list** (the idea of ``sortedcontainers``:
  blocks of at most ``block`` entries and the last key of each), ordered by
  start then insertion. Inserting or deleting moves at most one block's
  pointers; the bisects are over block keys, then inside one block.
* Leases are mostly lent at increasing offsets and retired in ring order: an
  item that starts at or after the last one is appended (no bisect), and the
  first entry of a block is deleted in place.
* Two intervals overlap when they share a byte, so zero-length items overlap
  nothing and contain nothing (a zero-byte lease or reuse touches no lease);
  they are kept aside, returned only by :meth:`items`.

Not thread-safe by itself: its owner (the ledger) holds its lock around every call.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

DEFAULT_BLOCK = 512  # entries per block before it splits (tests use a tiny one to exercise the splits)


class _Run:
    """The items of one length class: a blocked list sorted by start (equal starts: insertion order).

    Parallel lists per block (starts, ends, items) rather than one tuple per
    entry: 24 bytes of pointers per item, and the ints are the caller's own.
    """

    __slots__ = ("width", "block", "lasts", "starts", "ends", "items", "size", "order")

    def __init__(self, width: int, block: int, order: Optional[Callable[[Any], int]] = None):
        self.width = width  # every item is shorter than this
        self.block = block
        self.order = order  # items of equal start are usually added in this key's order
        self.lasts: List[int] = []  # the last (largest) start of each block
        self.starts: List[List[int]] = []
        self.ends: List[List[int]] = []
        self.items: List[List[Any]] = []
        self.size = 0

    def add(self, item: Any, start: int, end: int) -> None:
        lasts = self.lasts
        if not lasts or start >= lasts[-1]:  # the common case: lent after everything else
            if not lasts:
                self._new_block(0, [start], [end], [item])
            else:
                self.starts[-1].append(start)
                self.ends[-1].append(end)
                self.items[-1].append(item)
                lasts[-1] = start
                if len(self.starts[-1]) > 2 * self.block:
                    self._split(len(lasts) - 1)
        else:
            b = bisect_right(lasts, start)  # the first block whose last start is beyond ``start``
            starts = self.starts[b]
            j = bisect_right(starts, start)
            starts.insert(j, start)
            self.ends[b].insert(j, end)
            self.items[b].insert(j, item)
            if len(starts) > 2 * self.block:
                self._split(b)
        self.size += 1

    def remove(self, item: Any, start: int) -> bool:
        lasts = self.lasts
        b = bisect_left(lasts, start)
        if b < len(lasts) and self.starts[b][0] == start and self.items[b][0] is item:
            j = 0  # retired in lend order: the block's first entry
        else:
            found = self._find_by_order(item, start, b)
            j = -1
            if found is not None:
                b, j = found
            while j < 0 and b < len(lasts):
                starts = self.starts[b]
                k = bisect_left(starts, start)
                items = self.items[b]
                while k < len(starts) and starts[k] == start:
                    if items[k] is item:
                        j = k
                        break
                    k += 1
                if j >= 0 or k < len(starts):
                    break
                b += 1  # equal starts may run on into the next block
            if j < 0:
                return False
        self._delete(b, j)
        return True

    def _find_by_order(self, item: Any, start: int, b: int) -> Optional[Tuple[int, int]]:
        """``(block, index)`` of ``item`` among items of equal ``start`` found by bisecting on its
        order key (a lease's id: leases of one start are filed in lend order), or None. A one-tensor
        ring files every lease at offset 0: a linear scan of them made each death O(n), and a
        consumer's teardown of 50,000 kept views quadratic. Verified by identity (a scan follows
        when the order was not kept)."""
        order = self.order
        if order is None:
            return None
        try:
            want = order(item)
            lasts = self.lasts
            while b < len(lasts) and lasts[b] == start and order(self.items[b][-1]) < want:
                b += 1  # whole blocks of this start filed before it
            if b == len(lasts):
                return None
            starts, items = self.starts[b], self.items[b]
            lo = bisect_left(starts, start)
            hi = bisect_right(starts, start, lo)
            k = bisect_left(items, want, lo, hi, key=order)
        except (TypeError, AttributeError):  # an item without the key
            return None
        if k < hi and items[k] is item:
            return (b, k)
        return None

    def _delete(self, b: int, j: int) -> None:
        starts = self.starts[b]
        del starts[j]
        del self.ends[b][j]
        del self.items[b][j]
        self.size -= 1
        if not starts:
            self._drop_block(b)
        elif j == len(starts):
            self.lasts[b] = starts[-1]

    def overlapping(self, qs: int, qe: int, out: List[Any]) -> None:
        """Append to ``out`` the items that share a byte with ``[qs, qe)`` (a non-empty range)."""
        lasts = self.lasts
        lo = qs - self.width + 1  # an earlier start cannot reach ``qs``
        b = bisect_left(lasts, lo)
        if b == len(lasts):
            return
        j = bisect_left(self.starts[b], lo)
        while b < len(lasts):
            starts, ends, items = self.starts[b], self.ends[b], self.items[b]
            n = len(starts)
            while j < n:
                if starts[j] >= qe:
                    return
                if ends[j] > qs:
                    out.append(items[j])
                j += 1
            b += 1
            j = 0

    def pop_overlapping(self, qs: int, qe: int, out: List[Any]) -> None:
        """:meth:`overlapping`, removing what it returns: one rebuild per block touched, not one
        deletion per item, so retiring K leases costs O(K + block)."""
        lasts = self.lasts
        lo = qs - self.width + 1
        b = bisect_left(lasts, lo)
        if b == len(lasts):
            return
        j0 = bisect_left(self.starts[b], lo)
        while b < len(lasts):
            starts, ends, items = self.starts[b], self.ends[b], self.items[b]
            n = len(starts)
            j1 = j0
            while j1 < n and starts[j1] < qe:
                j1 += 1
            hits = [p for p in range(j0, j1) if ends[p] > qs]
            if hits:
                out.extend(items[p] for p in hits)
                if len(hits) == j1 - j0:
                    del starts[j0:j1], ends[j0:j1], items[j0:j1]
                else:
                    keep = [p for p in range(j0, j1) if ends[p] <= qs]
                    starts[j0:j1] = [starts[p] for p in keep]
                    ends[j0:j1] = [ends[p] for p in keep]
                    items[j0:j1] = [items[p] for p in keep]
                self.size -= len(hits)
                if not starts:
                    self._drop_block(b)
                    if j1 < n:
                        return
                    j0 = 0
                    continue  # block ``b`` is now the next one
                lasts[b] = starts[-1]
            if j1 < n:
                return  # stopped at a start >= qe
            b += 1
            j0 = 0

    def containing(self, qs: int, qe: int) -> Tuple[int, Any]:
        """``(start, item)`` of the item holding all of ``[qs, qe)`` with the greatest start (the
        latest added among equal starts); ``(-1, None)`` when none does."""
        lasts = self.lasts
        if not lasts or qe - qs >= self.width:
            return -1, None  # every item here is too short
        lo = qe - self.width  # a start at or before this ends before ``qe``
        b = min(bisect_right(lasts, qs), len(lasts) - 1)
        j = bisect_right(self.starts[b], qs) - 1
        while b >= 0:
            starts, ends = self.starts[b], self.ends[b]
            while j >= 0:
                s = starts[j]
                if s <= lo:
                    return -1, None
                if ends[j] >= qe:
                    return s, self.items[b][j]
                j -= 1
            b -= 1
            if b >= 0:
                j = len(self.starts[b]) - 1
        return -1, None

    def __iter__(self) -> Iterator[Any]:
        for items in self.items:
            yield from items

    def _new_block(self, b: int, starts: List[int], ends: List[int], items: List[Any]) -> None:
        self.lasts.insert(b, starts[-1])
        self.starts.insert(b, starts)
        self.ends.insert(b, ends)
        self.items.insert(b, items)

    def _split(self, b: int) -> None:
        starts, ends, items = self.starts[b], self.ends[b], self.items[b]
        half = len(starts) // 2
        self._new_block(b + 1, starts[half:], ends[half:], items[half:])
        del starts[half:], ends[half:], items[half:]
        self.lasts[b] = starts[-1]

    def _drop_block(self, b: int) -> None:
        del self.lasts[b], self.starts[b], self.ends[b], self.items[b]


class IntervalIndex:
    """Items keyed by ``[start, end)``; see the module docstring for the costs.

    An item is added and removed with the interval it was added with (the
    caller keeps it: a lease's bytes, a region's address range). Items are
    compared by identity.
    """

    __slots__ = ("_runs", "_empty", "_block", "_order")

    def __init__(self, block: Optional[int] = None, order: Optional[Callable[[Any], int]] = None):
        if block is None:
            block = DEFAULT_BLOCK  # read at each construction: tests shrink it to exercise the splits
        if block < 1:
            raise ValueError(f"an interval index block holds at least 1 entry, got {block}")
        self._runs: Dict[int, _Run] = {}  # length class -> its items
        self._empty: Dict[Any, None] = {}  # zero-length items (an ordered set)
        self._block = block
        self._order = order  # an int per item, increasing in the order items of one start are added

    def add(self, item: Any, start: int, end: int) -> None:
        if end <= start:
            self._empty[item] = None
            return
        c = (end - start).bit_length()
        run = self._runs.get(c)
        if run is None:
            run = self._runs[c] = _Run(1 << c, self._block, self._order)
        lasts = run.lasts
        if lasts and start >= lasts[-1]:  # _Run.add's common case, inlined: this runs at every lend
            starts = run.starts[-1]
            if len(starts) < 2 * run.block:
                starts.append(start)
                run.ends[-1].append(end)
                run.items[-1].append(item)
                lasts[-1] = start
                run.size += 1
                return
        run.add(item, start, end)

    def remove(self, item: Any, start: int, end: int) -> bool:
        """Forget ``item`` (added with ``[start, end)``); False when it was not here."""
        if end <= start:
            return self._empty.pop(item, 0) is None
        c = (end - start).bit_length()
        run = self._runs.get(c)
        if run is None or not run.remove(item, start):
            return False
        if not run.size:
            del self._runs[c]
        return True

    def overlapping(self, start: int, end: int) -> List[Any]:
        """Items sharing a byte with ``[start, end)``: by start within a length class."""
        out: List[Any] = []
        if start < end:
            for run in self._runs.values():
                run.overlapping(start, end, out)
        return out

    def pop_overlapping(self, start: int, end: int) -> List[Any]:
        """:meth:`overlapping`, and remove them."""
        out: List[Any] = []
        if start < end:
            for c, run in list(self._runs.items()):
                run.pop_overlapping(start, end, out)
                if not run.size:
                    del self._runs[c]
        return out

    def containing(self, start: int, end: int) -> List[Tuple[int, Any]]:
        """For each length class, ``(start, item)`` of the item holding all of ``[start, end)`` with
        the greatest start; the caller picks among these few (an empty range is held by nothing)."""
        out = []
        if start < end:
            for run in self._runs.values():
                hit = run.containing(start, end)
                if hit[1] is not None:
                    out.append(hit)
        return out

    def items(self) -> List[Any]:
        """Every item, zero-length ones included (grouped by length class, then by start)."""
        out: List[Any] = list(self._empty)
        for run in self._runs.values():
            out.extend(run)
        return out

    def take_all(self) -> "IntervalIndex":
        """Move every item into a new index and leave this one empty (O(1))."""
        moved = IntervalIndex(self._block, self._order)
        moved._runs, moved._empty = self._runs, self._empty
        self._runs, self._empty = {}, {}
        return moved

    def __len__(self) -> int:
        return len(self._empty) + sum(run.size for run in self._runs.values())

    def __bool__(self) -> bool:
        return bool(self._runs) or bool(self._empty)


__all__ = ["IntervalIndex", "DEFAULT_BLOCK"]
