"""Trap mode's memory on the CPU: the pages a trap buffer lends from, and what a retire maps over them.

The mechanics behind :mod:`sanitizer.torch_layer.trap` (see its docstring for the design): the buffer's
memfd and the loader's mapping of it, the *mirrors* each lease's window is a range of, the poison pages
and the private copies mapped in place, the address index of trapped windows (the dispatch mode's look-up
of an alias by address), and the accounting of all of it (windows, mirrors, fallbacks with one warning per
reason, the map budget). The CUDA counterpart (:mod:`sanitizer.torch_layer.trap_cuda`) counts its windows
and falls back through the same functions here. No policy: which lease is trapped, and when, is the
buffer's and the trap feature's to say.
"""
from __future__ import annotations

import bisect
import os
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from sanitizer.core import fault_report, forking, pages
from sanitizer.core.ledger import Lease, ReuseEvent
from sanitizer.core.sites import format_site
from sanitizer.torch_layer import own_ops
from sanitizer.torch_layer.aliasing import HOST_VIEWS, host_view
from sanitizer.torch_layer.trap_windows import WindowsByLease

MODES = ("poison", "fault")

_lock = threading.RLock()  # re-entrant: a window's __del__ may run in a GC inside a locked section
_counts = {"windows": 0, "peak": 0, "mirrors": 0, "fallbacks": 0, "trapped": 0, "rescued": 0, "rescued_bytes": 0,
           "replaced": 0}  # replaced: CPU windows alive whose range was remapped (each splits its mirror: +2 maps)
_limits: Dict[str, Optional[int]] = {"max_map_count": None, "max_windows": None}  # tests lower max_windows
_warned = False
_warned_keys: set = set()  # other reasons warned about once each (a CUDA device without VMM)

# address index of trapped windows (for the mode): start -> (end, lease); sorted starts cached
_trapped: Dict[int, Tuple[int, Lease]] = {}
_starts: List[int] = []
_starts_dirty = False


class _Writer:
    """The buffer's own mapping of the memfd (the loader writes here); unmapped when its last view dies."""

    __slots__ = ("address", "length", "file", "__weakref__")

    def __init__(self, address: int, length: int, file: Any = None):
        self.address, self.length = address, length
        self.file = file  # the memfd stays out of the pool while this maps it

    @property
    def __array_interface__(self) -> dict:
        return {"data": (self.address, False), "shape": (self.length,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        try:
            pages.unmap(self.address, self.length)
        except Exception:  # interpreter shutdown: the maps go with the process
            pass


class _File:
    """The buffer's memfd: open while the buffer lends, or its own mapping or a mirror maps it (a trapped
    or rescued range is put back on the file when its lease dies, so that the mirror can lend those pages
    again). When nothing maps it any more it goes to :data:`_FILES`, as ``free`` gives memory back to
    malloc: the next trap buffer reuses its pages instead of having the kernel allocate and zero new ones
    (a ring load makes a buffer, and fresh shared-memory pages cost more than all of trap mode's mappings)."""

    __slots__ = ("fd", "size", "pid", "__weakref__")

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.pid = os.getpid()  # the process whose memory this file is

    def __del__(self) -> None:
        try:
            if self.pid == os.getpid():
                _FILES.give(self.fd, self.size)
            else:  # the parent's file, dying in a forked child: its pages are the parent's live memory,
                os.close(self.fd)  # never the child's next buffer (MAP_SHARED would share them)
        except Exception:
            pass


class _FilePool:
    """Memfds nothing maps any more, for the next trap buffers (at most :attr:`MAX_FILES`, :attr:`MAX_BYTES`
    in all; past that a file is closed). Their old bytes are the next buffer's garbage, as recycled heap
    memory is; a forked child closes them (:meth:`clear`), so parent and child never share one."""

    MAX_FILES, MAX_BYTES = 4, 1 << 30

    def __init__(self) -> None:
        self._files: List[Tuple[int, int]] = []  # (fd, size)

    def take(self, size: int) -> Tuple[int, int]:
        """A memfd of at least ``size`` bytes: the smallest pooled one that is large enough, else a new one."""
        with _lock:
            fits = [f for f in self._files if f[1] >= size]
            if fits:
                best = min(fits, key=lambda f: f[1])
                self._files.remove(best)
                return best
        fd = os.memfd_create("ownsan-trap", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd, size

    def give(self, fd: int, size: int) -> None:  # may run inside the GC
        with _lock:
            if len(self._files) < self.MAX_FILES and sum(f[1] for f in self._files) + size <= self.MAX_BYTES:
                self._files.append((fd, size))
                return
        os.close(fd)

    def clear(self) -> None:
        files, self._files = self._files, []
        for fd, _ in files:
            try:
                os.close(fd)
            except OSError:
                pass


_FILES = _FilePool()
_CHUNK = 2 << 20
"""What a mirror for leases that share pages with live ones maps: a chunk of the buffer, not all of it."""


class _Mirror:
    """A mapping of the buffer's memfd beside the loader's: the whole file (``base`` 0), or one chunk of it
    (:data:`_CHUNK`, from ``base``). A lease's window is its pages in a mirror where no live lease holds any
    of them: leases that share no page share the whole mirror (a correct program, whose lease dies before
    the next one over its pages, lends from it with no system call at all), and a lease that shares a page
    with a live one goes to a chunk mirror where its pages are free, so that retiring one never touches the
    other's mapping. A chunk bounds what such a lend costs by the chunk, never the buffer's size (a whole
    mirror per depth of leases on a page cost 64 populated 256 MiB maps for 64 leases in one page), while
    the leases of a chunk still share its mirrors. Dead windows come back through :attr:`dead` (appended
    from ``__del__``, which may run inside the GC: no list is reordered there)."""

    __slots__ = ("address", "length", "base", "file", "_starts", "_ends", "dead", "__weakref__")

    def __init__(self, file: _File, length: int, base: int = 0, whole: bool = True):
        self.file, self.length, self.base = file, length, base
        self.address = pages.map_file(file.fd, base, length, pages.PROT_READ | pages.PROT_WRITE,
                                      populate=whole)
        self._starts: List[int] = []  # the live windows' page ranges, sorted, never overlapping
        self._ends: List[int] = []
        self.dead: List[int] = []

    def _drain(self) -> None:
        while self.dead:
            first = self.dead.pop()
            i = bisect.bisect_left(self._starts, first)
            if i < len(self._starts) and self._starts[i] == first:
                del self._starts[i], self._ends[i]

    def fits(self, first: int, end: int) -> bool:
        """(Under the lock.) Are the pages ``[first, end)`` in this mirror and free there?"""
        if first < self.base or end > self.base + self.length:
            return False
        self._drain()
        i = bisect.bisect_left(self._starts, end) - 1
        return i < 0 or self._ends[i] <= first

    def take(self, first: int, end: int) -> None:
        i = bisect.bisect_left(self._starts, first)
        self._starts.insert(i, first)
        self._ends.insert(i, end)

    def __len__(self) -> int:
        return len(self._starts) - len(self.dead)

    def __del__(self) -> None:
        try:
            pages.unmap(self.address, self.length)
            with _lock:
                _counts["mirrors"] -= 1
        except Exception:  # interpreter shutdown: the maps go with the process
            pass


class _Window:
    """One lease's pages in a mirror: its tensor and every alias made from it point here. States: fresh,
    trapped (poison or no access mapped over it), rescued (a private copy mapped over it)."""

    __slots__ = ("address", "length", "offset", "state", "mirror", "__weakref__")

    def __init__(self, mirror: _Mirror, offset: int, length: int):
        self.mirror, self.offset, self.length = mirror, offset, length  # (offset: in the file)
        self.address = mirror.address + offset - mirror.base
        self.state = "fresh"

    @property
    def __array_interface__(self) -> dict:
        return {"data": (self.address, False), "shape": (self.length,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:  # may run inside the GC: dict operations and a syscall only
        _forget(self.address)
        try:
            if self.state != "fresh":  # the buffer's pages back in the mirror (a trapped range split it)
                pages.map_file(self.mirror.file.fd, self.offset, self.length,
                               pages.PROT_READ | pages.PROT_WRITE, at=self.address)
            self.mirror.dead.append(self.offset)
        except Exception:  # the range stays taken (never lent again): never a wrong mapping
            pass
        with _lock:
            _counts["windows"] -= 1
            if self.state != "fresh":
                _counts["replaced"] -= 1


def _forget(address: int) -> None:
    global _starts_dirty
    if _trapped.pop(address, None) is not None:
        _starts_dirty = True
    fault_report.remove(address)


def index_trapped(address: int, end: int, lease: Lease) -> None:
    """(A retire.) ``[address, end)`` now traps ``lease``: what :func:`lease_at` answers for an alias there."""
    global _starts_dirty
    with _lock:
        _counts["trapped"] += 1
        _trapped[address] = (end, lease)
        _starts_dirty = True


def count_window() -> None:
    """One more window alive (each gives its count back when it dies, CPU and CUDA alike)."""
    with _lock:
        _counts["windows"] += 1
        _counts["peak"] = max(_counts["peak"], _counts["windows"])


def count_rescue(nbytes: int) -> None:
    with _lock:
        _counts["rescued"] += 1
        _counts["rescued_bytes"] += nbytes


def window_died(address: int) -> None:  # may run inside the GC: dict operations only
    """A window (CPU or CUDA) at ``address`` died: out of the index, and out of the count."""
    _forget(address)
    with _lock:
        _counts["windows"] -= 1


def lease_at(t: torch.Tensor) -> Optional[Lease]:
    """The trapped lease whose window holds ``t``'s first byte (any storage: an alias), or None."""
    global _starts, _starts_dirty
    if not _trapped:
        return None
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    if _starts_dirty:
        _starts, _starts_dirty = sorted(_trapped), False
    i = bisect.bisect_right(_starts, ptr) - 1
    if i < 0:
        return None
    hit = _trapped.get(_starts[i])
    if hit is None or ptr >= hit[0]:
        return None
    lease = hit[1]
    return lease if lease.alive and not lease.rescued and lease.stale_by is not None else None


class _PoisonPages:
    """One memfd of ``fill`` bytes per fill value that every trapped window maps read-only (private)."""

    def __init__(self) -> None:
        self._files: Dict[int, Tuple[int, int]] = {}  # fill -> (fd, size)

    def fd_for(self, length: int, fill: int) -> int:
        with _lock:
            fd, size = self._files.get(fill, (-1, 0))
            if fd < 0:
                fd = os.memfd_create("ownsan-trap-poison", os.MFD_CLOEXEC)
            if size < length:
                new = max(length, 2 * size)
                os.ftruncate(fd, new)
                chunk = bytes([fill]) * min(1 << 20, new)
                at = size
                while at < new:
                    at += os.pwrite(fd, chunk[: new - at], at)
                size = new
            self._files[fill] = (fd, size)
            return fd


_POISON = _PoisonPages()


class TrapMemory(WindowsByLease):
    """A trap buffer's memory: the memfd, the loader's mapping, and the windows lent from it."""

    def __init__(self, nbytes: int, mode: str, fill: int, name: str):
        if mode not in MODES:
            raise ValueError(f"trap mode must be one of {MODES}, got {mode!r}")
        self.mode, self.fill, self.name = mode, fill, name
        self.length = pages.round_up(max(nbytes, 1))
        fd, size = _FILES.take(self.length)
        self._file: Optional[_File] = _File(fd, size)
        address = pages.map_file(fd, 0, self.length, pages.PROT_READ | pages.PROT_WRITE, populate=True)
        writer = _Writer(address, self.length, self._file)
        self._writer = weakref.ref(writer)
        self.data = own_ops.from_numpy(np.asarray(writer))[:nbytes]
        self._fork_snapshot: Optional[Tuple[int, Dict[int, int]]] = None  # (see snapshot_for_fork)
        self._mirrors: List[_Mirror] = []  # the whole mirror (made at the first lend) first, then chunk mirrors
        self._chunks: Dict[int, List[_Mirror]] = {}  # chunk start -> its mirrors
        super().__init__()

    def close(self) -> None:
        """No more lends: the descriptor goes once no mirror maps the file any more."""
        self._file = None

    def _mirror_for(self, first: int, end: int) -> _Mirror:
        """(Under the lock.) The whole mirror when the pages ``[first, end)`` are free there, else the first
        mirror of their chunk where they are, else a new one for that chunk (it stays until the buffer goes,
        for the next leases there: at most one per depth of live leases sharing a page)."""
        assert self._file is not None
        if not self._mirrors:
            self._mirrors.append(_Mirror(self._file, self.length))
            _counts["mirrors"] += 1
        if self._mirrors[0].fits(first, end):
            return self._mirrors[0]
        base = first // _CHUNK * _CHUNK
        chunk = self._chunks.setdefault(base, [])
        for mirror in chunk:
            if mirror.fits(first, end):
                return mirror
        top = min(self.length, max(base + _CHUNK, pages.round_up(end)))
        mirror = _Mirror(self._file, top - base, base, whole=False)
        chunk.append(mirror)
        self._mirrors.append(mirror)
        _counts["mirrors"] += 1
        return mirror

    def lend_view(self, offset: int, nbytes: int, shape: tuple, dtype: torch.dtype
                  ) -> Optional[Tuple[torch.Tensor, Any, _Window]]:
        """``(tensor, piece, window)`` of a lease on a window of its own; None when the buffer is closed or a
        mapping failed (the budget is checked, and windows counted, by the buffer's lend)."""
        if self._file is None:
            return None
        # A window holds at least a page of the buffer: an empty lend at the very end (offset == the buffer's
        # size, a ring's zero-byte put at its head) takes the last page, its view at the window's end (it
        # asked a chunk mirror past the buffer for 0 bytes: "length must be > 0", a crash of the put).
        first = min(offset, self.length - 1) // pages.PAGE * pages.PAGE
        end = pages.round_up(max(offset + nbytes, first + 1))
        with _lock:
            try:
                mirror = self._mirror_for(first, end)
            except OSError as exc:
                fall_back(f"mmap failed ({exc})")
                return None
            mirror.take(first, end)
        window = _Window(mirror, first, end - first)
        np_dtype, retype = HOST_VIEWS.get(dtype) or host_view(dtype)
        piece = np.ndarray(shape, np_dtype, np.asarray(window), offset - first)
        view = own_ops.from_numpy(piece)
        return (view.view(dtype) if retype else view), piece, window

    def trap(self, lease: Lease, window: _Window, event: ReuseEvent) -> None:
        """Replace the window in place: poison (read-only) or no access."""
        if self.mode == "poison":
            fd = _POISON.fd_for(window.length, self.fill)
            pages.map_file(fd, 0, window.length, pages.PROT_READ, shared=False, at=window.address)
        else:
            fault_report.install()
            fault_report.add(window.address, window.address + window.length, describe(lease, event, self.name))
            pages.protect(window.address, window.length, pages.PROT_NONE)
        window.state = "trapped"
        _count_replaced()

    def rescue(self, lease: Lease, window: _Window, event: Optional[ReuseEvent] = None) -> None:
        """Replace the window, in place, by a private copy of its pages (read before the reuse writes)."""
        _copy_in_place(window)
        window.state = "rescued"
        _count_replaced()

    def after_fork_in_child(self) -> None:
        """A forked child must not share the parent's buffer (``MAP_SHARED`` survives ``fork``, where
        the memory of a plain buffer is copy-on-write): move the loader's mapping and every mirror onto a
        copy of the file, in place, then put each trapped window's trap and each rescued window's own
        copy back over it."""
        writer = self._writer()
        live = self._live_windows()
        snapshot, self._fork_snapshot = self._fork_snapshot, None
        if snapshot is not None:  # taken in the parent just before the fork: what the child must see
            fd, copies = snapshot
            rescued = [(w, copies[id(w)]) for w in live if w.state == "rescued" and id(w) in copies]
        else:  # (a fork the snapshot missed: copied now, racing the parent's writes)
            source = self._source()
            if source is None:
                return
            rescued = [(w, _copy_to_memfd(w.address, w.length)) for w in live if w.state == "rescued"]
            fd = _copy_to_memfd(source, self.length)
        new = _File(fd, self.length)
        if writer is not None:
            pages.map_file(fd, 0, writer.length, pages.PROT_READ | pages.PROT_WRITE, at=writer.address)
            writer.file = new
        for mirror in self._mirrors:
            pages.map_file(fd, mirror.base, mirror.length, pages.PROT_READ | pages.PROT_WRITE, at=mirror.address)
            mirror.file = new
        for window in live:
            if window.state == "trapped":
                self.retrap(window)
        for window, copy in rescued:
            try:
                pages.map_file(copy, 0, window.length, pages.PROT_READ | pages.PROT_WRITE, at=window.address)
            finally:
                os.close(copy)
        if self._file is not None:
            self._file = new

    def _source(self) -> Optional[int]:
        """The address of a whole mapping of the buffer's bytes (the loader's, else the whole mirror)."""
        writer = self._writer()
        return writer.address if writer is not None else (self._mirrors[0].address if self._mirrors else None)

    def snapshot_for_fork(self) -> None:
        """(The parent, just before a fork.) Copy the buffer's bytes and each rescued window's now: a
        ``MAP_SHARED`` mapping is shared by the child, so a copy made in the child would see the parent's
        writes made after the fork (the child must see the memory as it was at the fork, as with a plain
        buffer's copy-on-write pages). The cost is one copy of each live trap buffer per fork."""
        self.drop_fork_snapshot()
        source = self._source()
        if source is None:
            return
        copies: Dict[int, int] = {}
        try:
            for window in self._live_windows():
                if window.state == "rescued":
                    copies[id(window)] = _copy_to_memfd(window.address, window.length)
            self._fork_snapshot = (_copy_to_memfd(source, self.length), copies)
        except OSError:
            for fd in copies.values():
                os.close(fd)
            raise

    def drop_fork_snapshot(self) -> None:
        """(The parent, after the fork; or a child's leftovers.) Close the snapshot's descriptors."""
        snapshot, self._fork_snapshot = self._fork_snapshot, None
        if snapshot is not None:
            fd, copies = snapshot
            for each in (fd, *copies.values()):
                try:
                    os.close(each)
                except OSError:
                    pass

    def retrap(self, window: _Window) -> None:
        """Map the trap over a window again (after a fork moved its mirror onto a copy)."""
        if self.mode == "poison":
            fd = _POISON.fd_for(window.length, self.fill)
            pages.map_file(fd, 0, window.length, pages.PROT_READ, shared=False, at=window.address)
        else:
            pages.protect(window.address, window.length, pages.PROT_NONE)


def _copy_to_memfd(address: int, length: int) -> int:
    """A new memfd holding a copy of the ``length`` bytes mapped at ``address``."""
    fd = os.memfd_create("ownsan-trap-copy", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, length)
        data = memoryview(np.asarray(_View().set(address, length)))
        at = 0
        while at < length:
            at += os.pwrite(fd, data[at:], at)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _View:
    """A plain array interface over mapped bytes (owns nothing, unmaps nothing)."""

    __slots__ = ("address", "length")

    def set(self, address: int, length: int) -> "_View":
        self.address, self.length = address, length
        return self

    @property
    def __array_interface__(self) -> dict:
        return {"data": (self.address, False), "shape": (self.length,), "typestr": "|u1", "version": 3}


def _copy_in_place(window: _Window) -> None:
    """Replace ``window``'s pages, in place, by a private copy of their bytes (a memfd of its own)."""
    fd = _copy_to_memfd(window.address, window.length)
    try:
        pages.map_file(fd, 0, window.length, pages.PROT_READ | pages.PROT_WRITE, at=window.address)
    finally:
        os.close(fd)


def describe(lease: Lease, event: ReuseEvent, buffer: str) -> str:
    """The report text of a lease trapped with ``trap=fault``, rendered now (the handler only writes it)."""
    lines = [f"  lease '{lease.name}' ({lease.dtype}{list(lease.shape)}, {lease.nbytes} bytes) of staging buffer "
             f"'{buffer}', lent at generation {lease.generation}",
             f"  retired: {event.describe()}"]
    if lease.site:
        lines.append("  lent at:\n" + format_site(lease.site, "    "))
    holder = _holder_of(lease)
    lines.append(f"  held by: {holder}" if holder else "  held by: (not known at retire time; triage=1 names it)")
    return "\n".join(lines)


def _holder_of(lease: Lease) -> Optional[str]:
    """The holder triage named for this lease's retention at this retire, if it did (a short string)."""
    try:
        from sanitizer.torch_layer import records
        for record in reversed(records.events("retention")):
            if record.get("lease", {}).get("lease_id") == lease.lease_id:
                holder = record.get("holder") or record.get("held_by")
                return None if not holder else str(holder)[:300]
    except Exception:  # a diagnostic never fails a retire
        return None
    return None


def _count_replaced() -> None:
    with _lock:
        _counts["replaced"] += 1


def room() -> bool:
    """May one more window be mapped? Trap mode keeps its process maps under half of ``vm.max_map_count``:
    a window is one map, and a trapped or rescued one splits its mirror's mapping (two more), so that the
    program (and the guard's tombstones) keep the other half; counting windows alone let a retaining
    program reach the kernel's limit, and its own ``mmap``/``malloc`` then failed."""
    if _limits["max_windows"] is None:
        _limits["max_map_count"] = pages.read_max_map_count()
        _limits["max_windows"] = _limits["max_map_count"] // 2
    maps = _counts["windows"] + 2 * _counts["replaced"]
    if maps < _limits["max_windows"]:
        return True
    fall_back(f"{_counts['windows']} lease mappings ({maps} process maps with the splits of the retired ones) "
              f"reached the trap budget of {_limits['max_windows']} (half of vm.max_map_count="
              f"{_limits['max_map_count']})")
    return False


def fall_back(why: str, key: str = "budget") -> None:
    """Count a lend (or buffer) that falls back to the guard; warn once per kind of reason."""
    global _warned
    with _lock:
        _counts["fallbacks"] += 1
        if key == "budget":
            first = not _warned
            _warned = True
        else:
            first = key not in _warned_keys
            _warned_keys.add(key)
    if first:
        warnings.warn(f"ownership-sanitizer: trap mode: {why}; further leases fall back to the guard "
                      f"(their own tensor reads poison, aliases of them are not trapped)", RuntimeWarning,
                      stacklevel=4)


def stats() -> Dict[str, Any]:
    """Windows alive now and at peak, leases trapped and rescued, lends that fell back, the limit."""
    with _lock:
        return dict(_counts, trapped_alive=len(_trapped), **_limits)


# -- the retire hook ---------------------------------------------------------------


@forking.in_child
def _after_fork() -> None:
    """Fresh lock in a forked child, and no pooled file of the parent's (its next buffers' memory)."""
    global _lock
    _lock = threading.RLock()
    _FILES.clear()


__all__ = ["MODES", "TrapMemory", "lease_at", "index_trapped", "count_window", "count_rescue", "window_died", "room",
           "fall_back", "stats", "describe"]
