"""Leases for any loader's iterator: track its own memory, or emulate a borrowing loader.

:func:`borrowed_iterator` wraps a loader that yields ``(name, tensor)`` pairs
whose tensors are valid only until the iterator advances (``lifetime=1``), or
for N advances, or until it is closed. Nothing is copied: each yielded tensor's
storage is adopted as a staging *window* (a region over the loader's own
bytes, which the sanitizer never allocated) and the consumer gets a lease over
exactly the tensor's bytes, with the tensor's shape, dtype and strides. Each
advance retires the leases whose lifetime ended *before* the loader runs again
(the loader may overwrite or free the bytes in that call), so checksum
verification and rescue run while the bytes are still the loader's. Poison
never writes a window: its bytes are the loader's (a state_dict may live on),
and only memory the sanitizer allocated is ever poisoned.

:func:`emulate_borrowed` is for loaders that copy (safetensors, ``torch.load``,
a dict): it copies each tensor into a :class:`~sanitizer.torch_layer.ring.StagingRing` and
yields the ring's lent views, so a consumer meets real borrowed views and real
reuse on CPU with the loaders it already uses.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Any, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from cuda_hooks import devices
from sanitizer.torch_layer import own_ops, runtime
from sanitizer.torch_layer.aliasing import byte_extent, device_key
from sanitizer.core.ledger import Lease
from sanitizer.core.spans import subtract
from sanitizer.torch_layer.ring import StagingRing
from sanitizer.torch_layer.staging import BORROWED_MARKER, StagingBuffer
from sanitizer.torch_layer.state import state

_TRACKED_DEVICES = ("cpu", "cuda")
_warned_devices: set = set()


def _check_count(value: Any, what: str, allow_none: bool = False) -> Optional[int]:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an int >= 1{' or None' if allow_none else ''}, got {value!r}")
    return value


def _pair(item: Any, label: str) -> Tuple[Any, torch.Tensor]:
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
        what = f"a tuple of {len(item)}" if isinstance(item, tuple) else type(item).__name__
        raise TypeError(f"{label}: expected the loader to yield (name, tensor) pairs, got {what}: {item!r:.120}")
    return item


class _Window:
    """A loader's storage adopted as a region: open while one of its leases is within its lifetime,
    and while idle until a yield falls outside it."""

    __slots__ = ("buffer", "device", "base", "end", "pending")

    def __init__(self, buffer: StagingBuffer, device: str, base: int):
        self.buffer = buffer
        self.device = device
        self.base = base
        self.end = base + buffer.nbytes
        self.pending = 0  # leases lent here whose lifetime has not ended yet


class _Entry:
    """A lease waiting for its lifetime to end (``expire_at``, in advances).

    Where its bytes live is one of two things, kept apart: ``window``, the adopted loader buffer an
    adopting iterator lent it from (None for another lender's lease), or ``segment``, the index of the
    ring segment a ring iterator copied it into."""

    __slots__ = ("lease", "window", "segment", "start", "end", "expire_at")

    def __init__(self, lease: Lease, start: int, end: int, expire_at: int,
                 window: Optional["_Window"] = None, segment: Optional[int] = None):
        self.lease, self.start, self.end, self.expire_at = lease, start, end, expire_at
        self.window, self.segment = window, segment


class _LeasingIterator:
    """Shared plumbing: count advances, retire expired leases first, then ask the loader."""

    def __init__(self, iterable: Iterable, label: str):
        self._it: Iterator = iter(iterable)
        self.name = label
        self._calls = 0  # yields asked for so far; a yield's index is the call that produced it
        self._entries: Deque[_Entry] = deque()
        self._done = False

    def __iter__(self) -> "_LeasingIterator":
        return self

    def __next__(self) -> Tuple[Any, torch.Tensor]:
        if self._done:
            raise StopIteration
        if self._calls:
            self._expire(self._calls)
        index = self._calls
        self._calls += 1
        try:
            item = next(self._it)
        except StopIteration:
            self._finish(loader_ended=True)
            raise
        except BaseException:
            self._finish(loader_ended=True)  # a loader that raised may have freed its buffers
            raise
        name, tensor = _pair(item, self.name)
        return name, self._lend(name, tensor, index)

    def _expire(self, call: int) -> None:
        entries = self._entries
        while entries and entries[0].expire_at <= call:
            self._retire(entries.popleft())

    def close(self) -> None:
        """End every lease now (verified, rescued, poisoned as the options say), then close the loader."""
        if self._done:
            return
        try:
            while self._entries:
                self._retire(self._entries.popleft())
        finally:
            self._finish(loader_ended=False)
            close = getattr(self._it, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> "_LeasingIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._done:
                if getattr(self._it, "gi_frame", True) is None:  # a finished generator: its memory may be gone
                    self._finish(loader_ended=True)
                else:
                    self.close()
        except Exception:  # never raise from a finalizer (interpreter shutdown included)
            pass

    # -- subclass API --------------------------------------------------------------
    def _lend(self, name: Any, tensor: torch.Tensor, index: int) -> torch.Tensor:
        raise NotImplementedError

    def _retire(self, entry: _Entry) -> None:
        raise NotImplementedError

    def _finish(self, loader_ended: bool) -> None:
        raise NotImplementedError


class _Windows:
    """A loader's storages adopted as regions (windows), and the leases lent over them.

    One window per storage the loader hands out: a loader that lends many tensors from one buffer (a
    batch, a pool) costs one window, one that makes a storage per tensor (DLPack exports) one each.
    Windows are found by their storage's base address, so a file buffer of 10,000 tensors costs a
    dict lookup per lend, not a scan.
    """

    def __init__(self, label: str):
        self.label = label
        self.by_base: Dict[Tuple[str, int], _Window] = {}  # the newest window of each storage base
        self.open: List[_Window] = []
        self.spans: List[_Window] = []  # windows over a loader's whole buffer (few), found by containment

    def adopt_span(self, raw: torch.Tensor) -> None:
        """Track ``raw`` (uint8 bytes of a loader's buffer) as one window: tensors inside it lend from it."""
        w = _Window(StagingBuffer.adopt(raw, name=f"{self.label}@{raw.data_ptr():#x}"), device_key(raw.device),
                    raw.data_ptr())
        w.pending = 1  # never idle: it ends with the loader's close
        self.spans.append(w)
        self.open.append(w)

    def window_for(self, tensor: torch.Tensor, device: str, address: int, span: int,
                   close_idle: bool) -> _Window:
        for w in self.spans:
            if w.buffer is not None and w.device == device and w.base <= address and address + span <= w.end:
                return w
        storage = tensor.untyped_storage()
        base = storage.data_ptr()
        w = self.by_base.get((device, base))
        if w is not None and w.buffer is not None and address + span <= w.end:
            return w
        if close_idle:
            # Idle windows stay open until a yield falls outside them, so a loader that lends many
            # tensors from one buffer costs one window, not one per tensor.
            for idle in [w for w in self.open if w.pending == 0]:
                self.close_window(idle, run_hooks=False)  # no fresh lease left (see _retire): nothing to check
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))
        w = _Window(StagingBuffer.adopt(raw, name=f"{self.label}@{base:#x}"), device, base)
        self.by_base[(device, base)] = w  # a storage that grew under the same base: the old window stays open
        self.open.append(w)
        return w

    def lend(self, name: Any, tensor: torch.Tensor, close_idle: bool) -> Tuple[torch.Tensor, Optional[_Window], int, int]:
        """``(view, window, start, end)``: a lease over ``tensor``'s own bytes with its layout, or
        ``(tensor, None, 0, 0)`` for what cannot or need not be tracked (a subclass, meta, no bytes)."""
        kind = type(tensor)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            return tensor, None, 0, 0  # a tensor subclass (DTensor, a wrapper): not plain memory we can alias
        if tensor.device.type not in _TRACKED_DEVICES:
            if tensor.device.type != "meta" and tensor.device.type not in _warned_devices:
                _warned_devices.add(tensor.device.type)
                warnings.warn(f"{self.label}: tensors on '{tensor.device.type}' are not tracked "
                              f"(staging leases support {_TRACKED_DEVICES})", RuntimeWarning, stacklevel=4)
            return tensor, None, 0, 0
        address, span = byte_extent(tensor)
        if span == 0 or address == 0:
            return tensor, None, 0, 0  # no bytes: nothing can go stale
        window = self.window_for(tensor, device_key(tensor.device), address, span, close_idle)
        offset = address - window.base
        lease_name = name if isinstance(name, str) else str(name)
        dtype, itemsize = tensor.dtype, tensor.element_size()
        aligned = (address % itemsize) == 0
        if tensor.is_contiguous() and aligned:
            view = window.buffer.lend(offset, tuple(tensor.shape), dtype, lease_name)
        else:  # strided or unaligned: lend the covering bytes, then take the yield's own layout
            if aligned:
                flat = window.buffer.lend(offset, (span // itemsize,), dtype, lease_name)
            else:
                flat = window.buffer.lend(offset, (span,), torch.uint8, lease_name).view(dtype)
            view = flat.as_strided(tuple(tensor.shape), tuple(tensor.stride()), 0)
            setattr(view, BORROWED_MARKER, True)
        if kind is torch.nn.Parameter:
            view = torch.nn.Parameter(view, requires_grad=tensor.requires_grad)
            setattr(view, BORROWED_MARKER, True)
        elif tensor.requires_grad:
            view.requires_grad_(True)
        window.pending += 1
        return view, window, offset, offset + span

    def close_window(self, window: _Window, run_hooks: bool) -> None:
        if window.buffer is None:
            return
        self.open.remove(window)
        if self.by_base.get((window.device, window.base)) is window:
            del self.by_base[(window.device, window.base)]
        self._close(window, run_hooks)

    def close_all(self, run_hooks: bool) -> None:
        windows, self.open, self.by_base, self.spans = self.open, [], {}, []  # one pass: 10,000 may be open
        for window in windows:
            self._close(window, run_hooks)

    @staticmethod
    def _close(window: _Window, run_hooks: bool) -> None:
        buf, window.buffer = window.buffer, None
        if buf is not None and not buf.closed:
            runtime.close_region(buf._region, run_hooks=run_hooks)
        # Dropping ``buf`` drops our reference to the loader's storage: the loader's memory lives
        # exactly as long as the loader and any consumer that still holds a view keep it.


class _DeviceBytes:
    """``nbytes`` of device memory at ``ptr`` through the CUDA array interface; owns nothing."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def raw_bytes(device: torch.device, address: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of a loader's memory at ``address`` that does not keep it alive (the
    loader frees it; whoever adopts it must stop using it first, as ``BorrowedLoans.close`` does)."""
    if isinstance(address, bool) or not isinstance(address, int) or address <= 0 or nbytes <= 0:
        raise ValueError(f"a buffer needs an address > 0 and nbytes > 0, got {address!r}, {nbytes!r}")
    if device.type == "cpu":
        import ctypes

        import numpy as np

        return own_ops.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)))
    if device.type == "cuda":
        return devices.from_interface(_DeviceBytes(address, nbytes), device)
    raise ValueError(f"buffers on '{device}' are not tracked (staging leases support {_TRACKED_DEVICES})")


def _retire_span(region_id: int, lease: Optional[Lease], start: int, end: int, retire: Any) -> None:
    """End ``lease`` (``[start, end)`` of region ``region_id``) unless it is dead, stale or rescued; bytes
    that another alive lease still covers stay valid (an aliasing yield: retiring them would turn that
    one stale too early, and poison would change it)."""
    if lease is None or not lease.alive or lease.stale_by is not None or lease.rescued:
        return
    others = [(l.start, l.end) for l in state.ledger.overlapping(region_id, start, end) if l is not lease]
    for s, e in subtract([(start, end)], others):
        retire(s, e - s)


def _retire_in_region(lease: Lease, by: str) -> Any:
    """A retire callback for a lease that another lender made (its region is not one of ours)."""
    region = state.ledger.region(lease.region_id)

    def retire(start: int, nbytes: int) -> None:
        if not region.closed:
            runtime.retire(region, start, start + nbytes, by)

    return retire


class BorrowedIterator(_LeasingIterator):
    """Wraps a borrowing loader's ``(name, tensor)`` iterator; see :func:`borrowed_iterator`."""

    def __init__(self, iterable: Iterable, lifetime: int = 1, name: Optional[str] = None):
        self.lifetime = _check_count(lifetime, "lifetime")
        super().__init__(iterable, name or "borrowed_iterator")
        self._loans = _Windows(self.name)

    def _lend(self, name: Any, tensor: torch.Tensor, index: int) -> torch.Tensor:
        lease = runtime.lease_of(tensor) if isinstance(tensor, torch.Tensor) else None
        if lease is not None:
            # Already a lease (an adapter on the loader's low-level calls lent it, until its buffer is
            # closed): adopting it again would track the same bytes twice, and our window would keep the
            # inner lease alive. Shorten its life instead: it ends at this iterator's expiry too.
            if lease.alive and lease.stale_by is None and not lease.rescued:
                self._entries.append(_Entry(lease, lease.start, lease.end, index + self.lifetime))
            return tensor
        view, window, start, end = self._loans.lend(name, tensor, close_idle=True)
        if window is not None:
            self._entries.append(_Entry(runtime.lease_of(view), start, end, index + self.lifetime, window=window))
        return view

    def _retire(self, entry: _Entry) -> None:
        window, lease = entry.window, entry.lease
        if window is None:  # another lender's lease (see _lend)
            if lease is not None and lease.alive:
                _retire_span(lease.region_id, lease, entry.start, entry.end,
                             _retire_in_region(lease, f"{self.name}: lifetime {self.lifetime} ended"))
            return
        if window.buffer is not None and lease is not None:
            _retire_span(lease.region_id, lease, entry.start, entry.end, window.buffer.retire)
        window.pending -= 1
        if window.pending == 0 and window.buffer is not None and state.ledger.overlapping(
                window.buffer._region.region_id, 0, window.buffer.nbytes):
            # An expired lease kept fresh because a later aliasing yield covered its bytes, and that
            # one died unretired: end it now, while the loader has not run again (its bytes are valid).
            window.buffer.retire(0, window.buffer.nbytes)

    def _finish(self, loader_ended: bool) -> None:
        """Leases still within their lifetime go stale; when the loader ended, without touching bytes."""
        self._done = True
        self._entries.clear()
        self._loans.close_all(run_hooks=not loader_ended)


class BorrowedLoans:
    """Leases over a loader's own memory that end when the loader frees it, not at an advance.

    For low-level loader calls that hand out views of a buffer until an explicit free
    (fastsafetensors' ``FilesBufferOnDevice.get_tensor`` ... ``close()``): :meth:`lend` returns a
    lease over the tensor's own bytes (same shape, dtype and strides, nothing copied); :meth:`close`,
    called right before the loader frees its memory, ends every lease with every check (checksum
    verification, rescue, the guard's tombstone, triage) while the bytes are still the loader's;
    :meth:`abandon` ends them without touching bytes, for memory the loader already freed. A tensor
    that is already a lease (of another lender) is returned as it is.
    """

    def __init__(self, name: str):
        self.name = name
        self._windows = _Windows(name)
        self.closed = False

    def adopt(self, device: Any, address: int, nbytes: int) -> None:
        """Track the loader's buffer ``[address, address + nbytes)`` on ``device`` as one region, so that the
        tensors it hands out from there lend from it (one region per buffer, not one per tensor)."""
        if self.closed:
            raise ValueError(f"{self.name}: closed; cannot adopt a buffer")
        self._windows.adopt_span(raw_bytes(torch.device(device), address, nbytes))

    def lend(self, name: Any, tensor: torch.Tensor) -> torch.Tensor:
        if self.closed:
            raise ValueError(f"{self.name}: closed; cannot lend '{name}' from it")
        if not isinstance(tensor, torch.Tensor) or runtime.lease_of(tensor) is not None:
            return tensor
        return self._windows.lend(name, tensor, close_idle=False)[0]

    def close(self) -> None:
        """End every lease now, with every check (the loader's memory must still be there)."""
        if not self.closed:
            self.closed = True
            self._windows.close_all(run_hooks=True)

    def abandon(self) -> None:
        """End every lease without verification, rescue or poison (the loader's memory may be gone)."""
        if not self.closed:
            self.closed = True
            self._windows.close_all(run_hooks=False)


class EmulatedBorrowing(_LeasingIterator):
    """Copies a loader's tensors into a staging ring; see :func:`emulate_borrowed`."""

    def __init__(self, iterable: Iterable, ring_bytes: int, lifetime: Optional[int] = None,
                 device: Any = None, name: Optional[str] = None, alignment: int = 64):
        if isinstance(ring_bytes, bool) or not isinstance(ring_bytes, int) or ring_bytes <= 0:
            raise ValueError(f"ring_bytes must be an int > 0, got {ring_bytes!r}")
        self.ring_bytes = ring_bytes
        self.lifetime = _check_count(lifetime, "lifetime", allow_none=True)
        super().__init__(iterable, name or "emulated")
        self._device = device
        self._alignment = alignment
        self.ring: Optional[StagingRing] = None

    def _lend(self, name: Any, tensor: torch.Tensor, index: int) -> torch.Tensor:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.ring_bytes:
            raise ValueError(f"{self.name}: tensor '{name}' ({nbytes} bytes, {str(tensor.dtype)[6:]}"
                             f"{list(tensor.shape)}) does not fit the emulation ring of {self.ring_bytes} bytes; "
                             f"pass ring_bytes >= the largest tensor")
        if self.ring is None:
            self.ring = StagingRing(self.ring_bytes, device=self._device or tensor.device, name=self.name,
                                    alignment=self._alignment)
        source = tensor.detach()
        if source.device != self.ring.buffer.device:
            source = source.to(self.ring.buffer.device)
        view = self.ring.put(name if isinstance(name, str) else str(name), source)
        if self.lifetime is not None:
            lease = runtime.lease_of(view)
            self._entries.append(_Entry(lease, 0, 0, index + self.lifetime, segment=self.ring.segment))
        return view

    def _retire(self, entry: _Entry) -> None:
        lease, ring = entry.lease, self.ring
        if ring is None or lease is None or not lease.alive or lease.stale_by is not None or lease.rescued:
            return  # dropped, or the ring already reused its bytes
        segment = ring.segments[entry.segment]
        if not segment.closed:
            segment.retire(lease.start, lease.end - lease.start)

    def _finish(self, loader_ended: bool) -> None:
        """The ring is ours: close it with every check, whatever happened to the loader."""
        self._done = True
        self._entries.clear()
        if self.ring is not None:
            self.ring.close()


def borrowed_iterator(iterable: Iterable, lifetime: int = 1, *, name: Optional[str] = None) -> BorrowedIterator:
    """Track a borrowing loader's yields as leases over its own memory, without copying.

    ``iterable`` yields ``(name, tensor)``; each tensor is valid until the
    iterator advances ``lifetime`` times, or until it is closed or exhausted.
    The consumer gets, for each yield, a tensor with the same shape, dtype and
    strides over the same bytes, whose storage is a lease: using it after its
    lifetime is a :class:`~sanitizer.StaleBorrowError` while the sanitizer is
    enabled. Leases still within their lifetime when the loader itself ends (or
    raises) go stale without verification, rescue or poison, since the loader
    may have freed their bytes; ``close()`` (or ``with``) ends them with every
    check. ``name`` labels the windows in reports.
    """
    return BorrowedIterator(iterable, lifetime, name)


def emulate_borrowed(iterable: Iterable, ring_bytes: int, *, lifetime: Optional[int] = None,
                     device: Any = None, name: Optional[str] = None) -> EmulatedBorrowing:
    """Give a copying loader borrowed semantics: each tensor is copied into a ``StagingRing``.

    The consumer gets the ring's lent views, reused as the ring comes round
    (``ring_bytes`` from the largest tensor, strictest, up to the whole
    checkpoint); ``lifetime=N`` also ends each view N advances later, the strict
    contract whatever the ring size. Exhausting or closing the iterator closes
    the ring. ``device`` defaults to the first tensor's device.
    """
    return EmulatedBorrowing(iterable, ring_bytes, lifetime, device, name)


__all__ = ["borrowed_iterator", "emulate_borrowed", "BorrowedIterator", "BorrowedLoans", "EmulatedBorrowing"]
