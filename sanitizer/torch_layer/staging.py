"""``StagingBuffer``: the debug allocator that lends leases over one byte buffer.

A loader writes a tensor's bytes into the buffer and lends a view of them; when
it is about to overwrite bytes it calls :meth:`StagingBuffer.reuse`, which makes
every overlapping lease stale. The buffer may be allocated here or adopted from
a loader (:meth:`StagingBuffer.adopt`).
"""
from __future__ import annotations

import math
import operator
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch

from sanitizer.torch_layer import interception, runtime
from sanitizer.torch_layer.aliasing import alias_view, check_device, device_key, dtype_name, host_array
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.sites import Site, capture
from sanitizer.torch_layer.sources import Prepared, Source, check_dtype, check_shape, copy_into, prepare
from sanitizer.torch_layer.stale_use import check_not_stale
from sanitizer.torch_layer.state import state

BORROWED_MARKER = "_vllm_instanttensor_borrowed"


def _is_lent_view(t: torch.Tensor) -> bool:
    """Is ``t`` the very tensor object a :meth:`StagingBuffer.lend` returned (its lease still borrowed)?"""
    lease = runtime.lease_of(t)
    if lease is None:
        return False
    return lease.lent == id(t)  # (a later object of that id viewing the same lease reads as lent: it is one)


class _BorrowedMarker:
    """``getattr(t, BORROWED_MARKER, False) is True`` for a lent view, without a ``__dict__`` on it.

    The contract some loaders and consumers follow (InstantTensor's marker attribute) used to be
    met by setting the attribute on every lent view: that made a ``__dict__`` per view, 336 bytes
    of Python heap per lease (a plain view costs 88). Instead this one object sits on
    ``torch.Tensor`` (installed with the first staging buffer, so an import installs nothing) and
    answers for the tensor it is read from: True for the exact object a lend returned, as long as
    its lease is borrowed; AttributeError otherwise, so ``hasattr`` and ``getattr(t, name, False)``
    read as if the attribute were absent.

    Semantics kept from the attribute: a view derived from a lent tensor (``narrow``, slicing,
    ``view``, ``detach``, ``t()``) does not carry it, though it shares the lease's storage: that is
    the blind spot of ``policy="marked"``, and a consumer that trusts the marker must see under the
    sanitizer what it sees with the real loader. One change: a view that ``rescue=1`` moved onto
    owned memory no longer reads as borrowed (it is not).

    It is a *non-data* descriptor (no ``__set__`` on the class), so ``setattr(t, BORROWED_MARKER, v)``
    still works and an instance's own attribute wins over this answer. ``torch.overrides`` indexes
    the ``__get__`` and ``__set__`` of every non-callable ``Tensor`` attribute, so the instance
    carries a ``__set__`` too (an instance attribute: no type slot, the descriptor stays non-data).
    """

    def __init__(self, name: str):
        self._name = name
        self.__set__ = self._set_on_instance

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        try:
            lent = _is_lent_view(obj)
        except Exception:  # a subclass whose storage cannot be read: not a lend, and never an error here
            lent = False
        if lent:
            return True
        raise AttributeError(f"'{type(obj).__name__}' object has no attribute '{self._name}'")

    def _set_on_instance(self, obj: Any, value: Any) -> None:
        obj.__dict__[self._name] = value

    def __repr__(self) -> str:
        return f"<ownership-sanitizer borrowed marker '{self._name}'>"


_MARKER_ON_CLASS: Optional[bool] = None  # None: not decided yet; False: someone else owns the name


def _install_marker() -> bool:
    """Put the marker on ``torch.Tensor`` (once); False when the name is taken by another object."""
    global _MARKER_ON_CLASS
    if _MARKER_ON_CLASS is None:
        present = torch.Tensor.__dict__.get(BORROWED_MARKER)
        if present is None:
            setattr(torch.Tensor, BORROWED_MARKER, _BorrowedMarker(BORROWED_MARKER))
            _MARKER_ON_CLASS = True
        else:
            _MARKER_ON_CLASS = isinstance(present, _BorrowedMarker)
    return _MARKER_ON_CLASS

BufferFactory = Callable[[tuple, dict], Optional[type]]
_factories: tuple = ()
"""Declared through :func:`add_buffer_factory` (trap mode, at an enable that asks for it): each may name
the class ``StagingBuffer(*args, **kwargs)`` makes for memory the sanitizer allocates (None: not its
kind). None registered: the plain class, its lend path untouched."""


def add_buffer_factory(factory: BufferFactory) -> None:
    """Declare a factory of staging buffer classes (idempotent)."""
    global _factories
    if factory not in _factories:
        _factories = _factories + (factory,)


def buffer_bytes(region_id: int) -> Optional[torch.Tensor]:
    """The uint8 bytes of the open buffer registered as ``region_id`` (None once closed or gone)."""
    buf = runtime.buffer_of(region_id)
    return None if buf is None else buf._data


def lease_bytes(lease: Lease) -> Optional[torch.Tensor]:
    """The uint8 bytes ``lease``'s views read (what a checksum hashes): its range of its buffer's bytes, or
    what the buffer's kind says (:meth:`StagingBuffer.bytes_of`); None once the buffer is closed or gone."""
    buf = runtime.buffer_of(lease.region_id)
    return None if buf is None or buf._data is None else buf.bytes_of(lease)


def poisonable_bytes(region_id: int) -> Optional[torch.Tensor]:
    """The uint8 bytes of ``region_id`` that poison may overwrite: only an open buffer this sanitizer
    allocated itself. An adopted buffer (a loader's memory, a ``borrowed_iterator`` window over a
    state_dict that lives on) is never written: None."""
    buf = runtime.buffer_of(region_id)
    return None if buf is None or not buf.owns_memory else buf._data


def _index(value: Any, what: str) -> int:
    """An int-like offset or size (bools and floats are refused, with the value)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


def refuse_stale_source(src: Prepared) -> None:
    """A write whose source tensor is a stale lease reads someone else's bytes: report it before the write
    changes anything (raised, every lease as it was; or recorded, with ``halt_on_error=0``)."""
    if isinstance(src.payload, torch.Tensor):
        check_not_stale(src.payload, "StagingBuffer.write")


def _forget_region_at_gc(region: Region) -> None:
    """The buffer object was collected. Its views (if any) keep its memory alive and nobody can reuse
    those bytes any more, so no lease goes stale: the region is forgotten with its last lease."""
    if not region.closed:
        state.ledger.orphan(region.region_id)
        interception.regions_changed()


class StagingBuffer:
    """One contiguous byte buffer on a device whose lent views are tracked as leases."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "StagingBuffer":
        """A declared buffer factory may make memory allocated here a buffer of its kind (trap mode)."""
        if cls is StagingBuffer and _factories and state.enabled:
            for factory in _factories:
                cls = factory(args, kwargs) or cls
                if cls is not StagingBuffer:
                    break
        return object.__new__(cls)

    def __init__(self, nbytes: int, device: Any = "cpu", name: Optional[str] = None, *, pin_memory: bool = False):
        nbytes = _index(nbytes, "nbytes")
        if nbytes < 0:
            raise ValueError(f"staging buffer size must be >= 0, got {nbytes}")
        dev = torch.device(device)
        check_device(dev)
        data = torch.empty(nbytes, dtype=torch.uint8, device=dev, pin_memory=pin_memory and dev.type == "cpu")
        self._setup(data, name, owns_memory=True)

    @classmethod
    def plain(cls, nbytes: int, device: Any = "cpu", name: Optional[str] = None) -> "StagingBuffer":
        """A buffer of the plain kind whatever the declared factories say (trap mode): for memory whose
        held views are kept, never retired, which a trap buffer's mappings would only make dearer."""
        self = object.__new__(StagingBuffer)
        StagingBuffer.__init__(self, nbytes, device, name)
        return self

    @classmethod
    def adopt(cls, tensor: torch.Tensor, name: Optional[str] = None) -> "StagingBuffer":
        """Track a loader's own buffer (any dtype, contiguous) without copying it."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"adopt expects a torch.Tensor, got {type(tensor).__name__}")
        if tensor.layout is not torch.strided:
            raise ValueError(f"cannot adopt a {str(tensor.layout).replace('torch.', '')} tensor "
                             f"(shape {list(tensor.shape)}): a staging buffer is dense memory")
        if tensor.is_conj() or tensor.is_neg():
            raise ValueError(f"cannot adopt a {'conjugate' if tensor.is_conj() else 'negative'} view "
                             f"({tensor.dtype}{list(tensor.shape)}): adopt the tensor it is a view of")
        if not tensor.is_contiguous():
            raise ValueError(f"cannot adopt a non-contiguous tensor (shape {list(tensor.shape)}, "
                             f"stride {list(tensor.stride())})")
        check_device(tensor.device)
        data = tensor.detach().reshape(-1)
        if data.dtype != torch.uint8:
            data = data.view(torch.uint8)
        self = cls.__new__(cls)
        self._setup(data, name, owns_memory=False)
        return self

    def _setup(self, data: torch.Tensor, name: Optional[str], owns_memory: bool) -> None:
        self.owns_memory = owns_memory  # allocated here (poison may write it) or adopted (never written)
        self._data: Optional[torch.Tensor] = data
        self._host = host_array(data)
        self.nbytes = data.numel()
        self._base = data.data_ptr()  # for the alignment check of each lend
        self.device = data.device
        self._region = state.ledger.add_region(
            name or f"staging@{data.data_ptr():#x}", device_key(data.device), data.data_ptr(), self.nbytes)
        self.name = self._region.name
        runtime.register_buffer(self._region.region_id, self)
        _install_marker()
        self._finalizer = weakref.finalize(self, _forget_region_at_gc, self._region)
        # Not at exit: the user's own atexit handlers (registered before the first buffer) may still
        # put into it; the process's memory goes with the process anyway.
        self._finalizer.atexit = False

    # -- state -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._region.closed

    @property
    def generation(self) -> int:
        return self._region.generation

    @property
    def tensor(self) -> torch.Tensor:
        """The raw uint8 bytes, for producers that write directly (call :meth:`reuse` first)."""
        return self._live("read the raw bytes of")

    def _live(self, action: str) -> torch.Tensor:
        if self._data is None:
            raise ValueError(f"staging buffer '{self.name}' is closed: cannot {action} it")
        return self._data

    def leases(self) -> List[Lease]:
        """Alive leases of this buffer (fresh and stale), in lend order."""
        return state.ledger.leases_of(self._region.region_id)

    # -- the lending API ---------------------------------------------------
    def lend(self, offset: int, shape: Sequence[int], dtype: torch.dtype, name: Optional[str] = None) -> torch.Tensor:
        """A view of ``shape``/``dtype`` at byte ``offset``, registered as a lease.

        This is on every loader's hot path (target: 1.5x a plain slice and ``view``). One path: a
        predicate recognises the common case (:meth:`_fast_nbytes`), :meth:`_check_lend` decides every
        other one (and says what is wrong), and one tail makes, tracks and marks the view.
        """
        data = self._data
        if data is None:
            raise ValueError(f"staging buffer '{self.name}' is closed: cannot lend '{name}' from it")
        nbytes = self._fast_nbytes(offset, shape, dtype)
        if nbytes < 0:
            offset, shape, dtype, nbytes = self._check_lend(offset, shape, dtype, name, "lend")
        return self._lend_checked(data, offset, nbytes, shape, dtype, name)

    def _fast_nbytes(self, offset: Any, shape: Any, dtype: Any) -> int:
        """The lend's size in bytes when it is the common case (an int offset, a tuple of non-negative
        ints, a torch dtype, in bounds and aligned), else -1. A predicate only: it never raises and
        refuses nothing itself; whatever it does not recognise goes to :meth:`_check_lend`, which
        accepts or refuses it by the same rules, and says why. (:meth:`lend` runs these lines inline;
        tests/torch_layer/test_staging.py pins the two to each other and to :meth:`_check_lend`.)"""
        if type(offset) is not int or type(shape) is not tuple or type(dtype) is not torch.dtype:
            return -1
        count = 1
        for dim in shape:  # a plain loop: cheaper than map/min on this hot path
            if type(dim) is not int or dim < 0:
                return -1
            count *= dim
        itemsize = dtype.itemsize
        nbytes = count * itemsize
        if offset < 0 or offset + nbytes > self.nbytes or (self._base + offset) % itemsize:
            return -1
        return nbytes

    def _lend_checked(self, data: torch.Tensor, offset: int, nbytes: int, shape: tuple, dtype: torch.dtype,
                      name: Optional[str], site: Optional[Site] = None) -> torch.Tensor:
        """The one tail of every lend (checked already): the view over its own storage, its lease, its mark."""
        view, memory = self._lend_view(data, offset, nbytes, shape, dtype)
        lease = runtime.track_lease(self._region, offset, nbytes, view, name, dtype, shape, site)
        if memory is not None:
            self._attach(lease, memory)
        if not _MARKER_ON_CLASS:
            setattr(view, BORROWED_MARKER, True)  # the name is taken on torch.Tensor: mark the view itself
        return view

    # -- what a kind of buffer decides (trap mode's buffer overrides these) -----------
    def _lend_view(self, data: torch.Tensor, offset: int, nbytes: int, shape: tuple, dtype: torch.dtype):
        """``(view, memory)``: the lease's view over a storage of its own (what is watched), and the memory
        it lives on when that is the buffer kind's own (None: the buffer's bytes)."""
        view, _ = alias_view(data, self._host, offset, nbytes, shape, dtype)
        return view, None

    def bytes_of(self, lease: Lease) -> Optional[torch.Tensor]:
        """The bytes ``lease``'s views read: its range of this buffer (an in-place buffer's leases read
        their own storage, see in_place.py)."""
        return self._data[lease.start:lease.end]

    def _attach(self, lease: Lease, memory: Any) -> None:
        """Remember which memory of its own a lease lives on (see :meth:`_lend_view`)."""

    def lends_own_mapping(self, lease: Lease) -> bool:
        """Does ``lease`` live on a mapping of its own, at another address than the buffer's bytes?"""
        return False

    def retire_pages(self, lease: Lease, event: ReuseEvent) -> bool:
        """Replace ``lease``'s pages in place at its retire (every alias with them); False: not done."""
        return False

    def pages_replaced(self, lease: Lease) -> bool:
        """Were ``lease``'s pages replaced in place (retired or rescued: the guard then leaves it alone)?"""
        return False

    def rescue_pages(self, lease: Lease, event: Optional[ReuseEvent] = None) -> bool:
        """Make ``lease``'s own pages a private copy, in place (every alias keeps the bytes); False: not
        possible here (a rescue then moves the storage instead)."""
        return False

    def _check_lend(self, offset: Any, shape: Any, dtype: Any, name: Optional[str], what: str):
        """``(offset, shape, dtype, nbytes)`` of a valid lend; a clear error naming the value otherwise."""
        if type(offset) is not int:
            offset = _index(offset, "offset")
        if type(shape) is tuple:
            for dim in shape:  # a plain loop: 3x cheaper than map/min on this hot path
                if type(dim) is not int or dim < 0:
                    shape = check_shape(shape)  # bools are not dimensions, negative sizes are refused
                    break
        else:
            shape = check_shape(shape)
        if type(dtype) is not torch.dtype:
            dtype = check_dtype(dtype)
        itemsize = dtype.itemsize
        nbytes = math.prod(shape) * itemsize
        if type(nbytes) is not int:  # a float or other non-int size slipped into the tuple
            shape = check_shape(shape)
            nbytes = math.prod(shape) * itemsize
        if offset < 0 or offset + nbytes > self.nbytes:
            layout = f" {dtype_name(dtype)}{list(shape)}" if what == "lend" else ""
            raise ValueError(f"{what} of '{name}'{layout} ({nbytes} bytes) at offset {offset} "
                             f"is out of bounds of staging buffer '{self.name}' ({self.nbytes} bytes)")
        if (self._base + offset) % itemsize:
            raise ValueError(f"{what} of '{name}' at offset {offset} is not aligned to {dtype_name(dtype)} "
                             f"({itemsize}-byte elements)")
        return offset, shape, dtype, nbytes

    def _range(self, offset: Any, nbytes: Any, by: Optional[str], what: str):
        """``(start, end)`` of a valid range; a ValueError naming the values (as lend's) otherwise."""
        start, n = _index(offset, "offset"), _index(nbytes, "nbytes")
        named = f" for '{by}'" if by else ""
        if n < 0:
            raise ValueError(f"{what} of {n} bytes at offset {start}{named} in staging buffer '{self.name}': "
                             f"nbytes must be >= 0, got {nbytes!r}")
        if start < 0 or start + n > self.nbytes:
            raise ValueError(f"{what} of bytes [{start}, {start + n}){named} is out of bounds of staging buffer "
                             f"'{self.name}' ({self.nbytes} bytes)")
        return start, start + n

    def reuse(self, offset: int, nbytes: int, by: Optional[str] = None) -> ReuseEvent:
        """Declare bytes ``[offset, offset+nbytes)`` about to be overwritten: overlapping leases go stale.
        A zero-byte reuse overlaps no lease."""
        self._live(f"reuse bytes for '{by}' in")
        start, end = self._range(offset, nbytes, by, "reuse")
        return runtime.reuse(self._region, start, end, by)

    def retire(self, offset: int, nbytes: int, by: Optional[str] = None) -> ReuseEvent:
        """Declare that the leases over ``[offset, offset+nbytes)`` reached the end of their lifetime,
        though the bytes are not overwritten yet (a ring's quarantine keeps them poisoned a while)."""
        self._live(f"retire bytes for '{by}' in")
        start, end = self._range(offset, nbytes, by, "retire")
        return runtime.retire(self._region, start, end, by)

    def write(self, offset: int, source: Source, name: Optional[str] = None, *,
              shape: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Reuse, copy ``source`` in and lend it, in one call; returns the lent view.

        Everything is checked before the reuse (the source, the layout, the bounds, the alignment; a
        file's length), so a write that fails leaves every lease as it was."""
        self._live(f"write '{name}' into")
        return self.write_prepared(offset, prepare(source, shape, dtype), name)

    def write_prepared(self, offset: int, src: Prepared, name: Optional[str] = None, *,
                       source_checked: bool = False) -> torch.Tensor:
        """:meth:`write` of a source already validated by :func:`~sanitizer.torch_layer.sources.prepare`
        (``source_checked``: the caller already refused a stale source, see :func:`refuse_stale_source`)."""
        data = self._live(f"write '{name}' into")
        offset, shape, dtype, nbytes = self._check_lend(offset, src.shape, src.dtype, name, "write")
        if not source_checked:
            refuse_stale_source(src)
        payload = self._payload(offset, src, nbytes)
        # One stack for the reuse and the lend (the same frames: every one between them is ours), taken
        # here while enabled; off, a lend keeps one frame only (see runtime.track_lease), so each takes its own.
        depth = state.options.stack_depth
        site = (capture(depth, 2) if depth else ()) if state.enabled else None
        runtime.reuse(self._region, offset, offset + nbytes, name, site)  # (bounds checked above)
        if payload is not None:
            copy_into(data, self._host, offset, payload, nbytes)
        return self._lend_checked(data, offset, nbytes, shape, dtype, name, site)  # (checked above, once)

    def _payload(self, offset: int, src: Prepared, nbytes: int) -> Any:
        """What :meth:`write_prepared` copies after its reuse, decided before it: a source that overlaps
        the bytes about to be reused (a lease of this very buffer written back) is copied out first, or
        not at all when it already is those bytes (re-lending in place: the copy would be a no-op).
        None: nothing to copy."""
        payload = src.payload
        if not isinstance(payload, torch.Tensor) or not nbytes:
            return src
        data = self._data
        if payload.device != data.device:
            return src
        start, end = data.data_ptr() + offset, data.data_ptr() + offset + nbytes
        first, last = payload.data_ptr(), payload.data_ptr() + nbytes
        if first == start:
            return None  # the source is these very bytes
        if first < end and start < last:
            return src._replace(payload=payload.clone())  # read it before the reuse declares it overwritten
        return src

    def close(self) -> None:
        """Free the buffer. Every lease goes stale; using one then is a use-after-free report.

        The memory itself is released only once no lease can reach it, so a
        stale read never touches unmapped memory (no segfault), even unsanitized.
        """
        if self._data is None:
            return
        runtime.close_region(self._region)
        self._finalizer.detach()
        self._data = None
        self._host = None

    def __enter__(self) -> "StagingBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"generation {self.generation}"
        return f"StagingBuffer('{self.name}', {self.nbytes} bytes on {self.device}, {state})"


__all__ = ["StagingBuffer", "BORROWED_MARKER"]
