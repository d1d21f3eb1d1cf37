"""What a producer may write into a staging buffer: a tensor, bytes, or a readable file.

Every path here writes through the buffer's own storage (numpy, ``readinto``,
``copy_``), none of which torch's ``_version`` counter sees. That is why the
sanitizer's generations come from the buffer API, which callers go through
before any of these writes.

A write is validated in full before the buffer API declares anything
(:func:`prepare`): a source that cannot be written (a sparse tensor, a lazily
conjugated or negated view, a file too short or one whose ``read`` returns more
than asked) is refused while every lease is still as it was.
"""
from __future__ import annotations

import ctypes
import io
import math
import operator
from typing import Any, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from sanitizer.torch_layer import own_ops

Source = Any  # torch.Tensor | bytes | bytearray | memoryview | a binary file object with readinto/read


class Prepared(NamedTuple):
    """A validated write: what will be lent (``shape``, ``dtype``, ``nbytes``) and the bytes to copy
    (``payload``: a contiguous tensor, a bytes-like object, or a file known to hold ``nbytes`` more)."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    payload: Any


def check_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` itself when it is a ``torch.dtype``; a TypeError naming the value otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    hint = ""
    try:
        np_dtype = np.dtype(dtype) if dtype is not None else None
    except (TypeError, ValueError):
        np_dtype = None
    if np_dtype is not None and not isinstance(dtype, str):
        name = getattr(torch, np_dtype.name, None)
        hint = f" (a numpy dtype: use torch.{np_dtype.name})" if isinstance(name, torch.dtype) else " (a numpy dtype)"
    elif isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        hint = f" (a string: use torch.{dtype})"
    raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}{hint}")


def check_source_tensor(source: torch.Tensor, what: str = "write") -> None:
    """Refuse tensors whose memory is not plain strided bytes equal to their values."""
    if source.layout is not torch.strided:
        raise ValueError(f"cannot {what} a {str(source.layout).replace('torch.', '')} tensor "
                         f"(shape {list(source.shape)}): staging buffers hold dense bytes; pass source.to_dense()")
    if source.is_conj():
        raise ValueError(f"cannot {what} a conjugate view (is_conj() is True, {source.dtype}{list(source.shape)}): "
                         f"its bytes are not its values; pass source.resolve_conj()")
    if source.is_neg():
        raise ValueError(f"cannot {what} a negative view (is_neg() is True, {source.dtype}{list(source.shape)}): "
                         f"its bytes are not its values; pass source.resolve_neg()")
    if source.is_quantized:
        raise ValueError(f"cannot {what} a quantized tensor ({source.dtype}{list(source.shape)}): "
                         f"pass source.int_repr() and its scale and zero point separately")
    if source.device.type == "meta":
        raise ValueError(f"cannot {what} a meta tensor ({source.dtype}{list(source.shape)}): it holds no bytes")


def layout(source: Source, shape: Optional[Sequence[int]], dtype: Optional[torch.dtype]) -> Tuple[Tuple[int, ...], torch.dtype, int]:
    """``(shape, dtype, nbytes)`` of what will be written; bytes default to uint8[len]."""
    if isinstance(source, torch.Tensor):
        check_source_tensor(source)
        if dtype is not None and check_dtype(dtype) != source.dtype:
            raise ValueError(f"source tensor has dtype {source.dtype}, but dtype={dtype} was given")
        shp = tuple(source.shape) if shape is None else check_shape(shape)
        if math.prod(shp) != source.numel():
            raise ValueError(f"shape {list(shp)} does not hold the source tensor's {source.numel()} elements")
        return shp, source.dtype, source.numel() * source.element_size()
    dt = torch.uint8 if dtype is None else check_dtype(dtype)
    if isinstance(source, (bytes, bytearray, memoryview)):
        nbytes = memoryview(source).nbytes
        if shape is None:
            if nbytes % dt.itemsize:
                raise ValueError(f"{nbytes} source bytes are not a whole number of {dt} elements")
            shp: Tuple[int, ...] = (nbytes // dt.itemsize,)
        else:
            shp = check_shape(shape)
            if math.prod(shp) * dt.itemsize != nbytes:
                raise ValueError(f"shape {list(shp)} of {dt} needs {math.prod(shp) * dt.itemsize} bytes, "
                                 f"the source has {nbytes}")
        return shp, dt, nbytes
    if hasattr(source, "readinto") or hasattr(source, "read"):
        if shape is None:
            raise ValueError("reading from a file needs shape= (and dtype=, default uint8)")
        shp = check_shape(shape)
        return shp, dt, math.prod(shp) * dt.itemsize
    raise TypeError(f"cannot write a {type(source).__name__}: expected a tensor, bytes or a readable binary file")


def flat_bytes(source: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``source``'s bytes as one flat, contiguous uint8 tensor (a view when it already is contiguous)."""
    flat = source.detach().contiguous().reshape(-1)
    if flat.dtype != torch.uint8 and nbytes:
        if flat.stride(0) != 1:
            # One element: torch calls it contiguous whatever its stride (`get_slice(k)[::2]` of a 1-element
            # slice has stride 2), and a dtype view needs stride 1: the same element, read with stride 1.
            flat = flat.as_strided((flat.numel(),), (1,))
        flat = flat.view(torch.uint8)
    return flat


def _copy(dst: torch.Tensor, offset: int, nbytes: int, flat: torch.Tensor) -> None:
    dst[offset:offset + nbytes].copy_(flat)


def prepare(source: Source, shape: Optional[Sequence[int]], dtype: Optional[torch.dtype]) -> Prepared:
    """Validate a write completely, before any lease is touched.

    A tensor becomes its contiguous bytes; a file is checked to hold enough bytes (seekable files:
    by their size, without reading) or read now into memory (files that cannot tell their size,
    and ``read``-only objects, whose every chunk is checked not to exceed what was asked).
    """
    shp, dt, nbytes = layout(source, shape, dtype)
    if isinstance(source, torch.Tensor):
        if own_ops.plain(source) and source.is_contiguous():
            # Views only, no read (the write checks the source before it copies): out of the mode's sight.
            return Prepared(shp, dt, nbytes, own_ops.call(flat_bytes, source, nbytes))
        return Prepared(shp, dt, nbytes, flat_bytes(source, nbytes))  # a copy (a read) or a subclass's own ops
    if isinstance(source, (bytes, bytearray, memoryview)) or nbytes == 0:
        return Prepared(shp, dt, nbytes, source if nbytes else b"")
    remaining = _remaining(source)
    if remaining is not None:
        if remaining < nbytes:
            raise ValueError(f"file ended after {remaining} of {nbytes} bytes: {_file_name(source)} holds "
                             f"{remaining} more bytes, {str(dt).replace('torch.', '')}{list(shp)} needs {nbytes} "
                             f"(nothing was written)")
        if hasattr(source, "readinto"):
            return Prepared(shp, dt, nbytes, source)  # read straight into the buffer, as fast loaders do
    data = np.empty(nbytes, dtype=np.uint8)
    _read_exactly(source, memoryview(data).cast("B"), nbytes)
    return Prepared(shp, dt, nbytes, data)


def _file_name(source: Any) -> str:
    name = getattr(source, "name", None)
    return repr(name) if isinstance(name, (str, bytes, int)) else f"<{type(source).__name__}>"


def _remaining(source: Any) -> Optional[int]:
    """Bytes left from the file's position to its end, when it can tell without reading (else None)."""
    try:
        if not (callable(getattr(source, "seekable", None)) and source.seekable()):
            return None
        pos = source.tell()
        end = source.seek(0, io.SEEK_END)
        source.seek(pos, io.SEEK_SET)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    if not isinstance(pos, int) or not isinstance(end, int):
        return None
    return max(0, end - pos)


def _read_exactly(source: Any, view: memoryview, nbytes: int) -> None:
    """Fill ``view[:nbytes]`` from ``source`` (``readinto`` or ``read``); refuse short and over-long reads."""
    got = 0
    readinto = getattr(source, "readinto", None)
    while got < nbytes:
        asked = nbytes - got
        if readinto is not None:
            n = readinto(view[got:nbytes])
            if n is None:
                raise ValueError(f"file {_file_name(source)}: readinto returned None (non-blocking, no data yet) "
                                 f"after {got} of {nbytes} bytes")
            if not isinstance(n, int) or n < 0 or n > asked:
                raise ValueError(f"file {_file_name(source)}: readinto returned {n!r} for a buffer of {asked} bytes")
        else:
            chunk = source.read(asked)
            if not isinstance(chunk, (bytes, bytearray, memoryview)):
                raise TypeError(f"file {_file_name(source)}: read({asked}) returned a {type(chunk).__name__}, "
                                f"expected bytes (open the file in binary mode)")
            n = memoryview(chunk).nbytes
            if n > asked:
                raise ValueError(f"file {_file_name(source)}: read({asked}) returned {n} bytes, more than asked")
            view[got:got + n] = memoryview(chunk).cast("B")
        if not n:
            raise ValueError(f"file {_file_name(source)} ended after {got} of {nbytes} bytes")
        got += n


def check_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    """A tuple of non-negative ints; bools, floats and non-sequences are refused with the value."""
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}")
    items = tuple(shape)
    for s in items:
        if isinstance(s, bool):
            raise TypeError(f"shape must be a sequence of ints, got {shape!r} ({s!r} is a bool, not a dimension)")
    try:
        shp = tuple(operator.index(s) for s in items)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shp):
        raise ValueError(f"negative size in shape {list(shp)}")
    return shp


_MEMMOVE_MAX = 128 << 10  # bytes: below it one memmove beats torch's copy (2 cores: 1.9 vs 3.9 us at 64 KiB,
# even at 256 KiB, 2x slower at 1 MiB, where torch's copy runs on every core)


def copy_into(dst: torch.Tensor, host: Optional[np.ndarray], offset: int, source: Source, nbytes: int) -> None:
    """Write ``nbytes`` of ``source`` into ``dst[offset:offset+nbytes]`` (dst: the buffer's uint8 bytes).

    ``source`` is a :class:`Prepared` (validated) or, for callers that validated themselves, a tensor,
    bytes or a file."""
    if nbytes == 0:
        return
    if isinstance(source, Prepared):
        source = source.payload
        if isinstance(source, torch.Tensor):  # prepare() already made it flat, contiguous uint8
            if nbytes <= _MEMMOVE_MAX and host is not None and own_ops.plain(source) and source.is_cpu:
                # Host memory to host memory (checked by the write before its reuse), small: one memmove, with
                # no dispatch at all (the slice and copy_ cost 2-3 us a put of a ring load). Larger copies stay
                # torch's, which splits them over the cores (a 16 MiB copy: 0.63 ms against memmove's 1.15).
                ctypes.memmove(dst.data_ptr() + offset, source.data_ptr(), nbytes)
            elif own_ops.plain(source):  # our copy into our buffer, out of the mode's sight
                own_ops.call(_copy, dst, offset, nbytes, source)
            else:
                _copy(dst, offset, nbytes, source)
            return
    if isinstance(source, torch.Tensor):
        _copy(dst, offset, nbytes, flat_bytes(source, nbytes))
        return
    if isinstance(source, np.ndarray):
        source = memoryview(source).cast("B")
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = np.frombuffer(source, dtype=np.uint8, count=nbytes)
        if host is not None:
            host[offset:offset + nbytes] = data
        else:
            dst[offset:offset + nbytes].copy_(own_ops.from_numpy(data.copy()))
        return
    # A file: read straight into the buffer's memory (CPU), as fast loaders do.
    target = host[offset:offset + nbytes] if host is not None else np.empty(nbytes, dtype=np.uint8)
    _read_exactly(source, memoryview(target).cast("B"), nbytes)
    if host is None:
        dst[offset:offset + nbytes].copy_(own_ops.from_numpy(target))


__all__ = ["Source", "Prepared", "layout", "prepare", "check_shape", "check_dtype", "check_source_tensor", "copy_into", "flat_bytes"]
