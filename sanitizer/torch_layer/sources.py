"""What a producer may write into a staging buffer: a tensor, bytes, or a readable file.

Every path here writes through the buffer's own storage (numpy, ``readinto``,
``copy_``), none of which torch's ``_version`` counter sees. That is why the
sanitizer's generations come from the buffer API, which callers go through
before any of these writes.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch

Source = Any  # torch.Tensor | bytes | bytearray | memoryview | a binary file object with readinto/read


def layout(source: Source, shape: Optional[Sequence[int]], dtype: Optional[torch.dtype]) -> Tuple[Tuple[int, ...], torch.dtype, int]:
    """``(shape, dtype, nbytes)`` of what will be written; bytes default to uint8[len]."""
    if isinstance(source, torch.Tensor):
        if dtype is not None and dtype != source.dtype:
            raise ValueError(f"source tensor has dtype {source.dtype}, but dtype={dtype} was given")
        shp = tuple(source.shape) if shape is None else check_shape(shape)
        if math.prod(shp) != source.numel():
            raise ValueError(f"shape {list(shp)} does not hold the source tensor's {source.numel()} elements")
        return shp, source.dtype, source.numel() * source.element_size()
    dt = torch.uint8 if dtype is None else dtype
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dt!r}")
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


def check_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    try:
        shp = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise TypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(s < 0 for s in shp):
        raise ValueError(f"negative size in shape {list(shp)}")
    return shp


def copy_into(dst: torch.Tensor, host: Optional[np.ndarray], offset: int, source: Source, nbytes: int) -> None:
    """Write ``nbytes`` of ``source`` into ``dst[offset:offset+nbytes]`` (dst: the buffer's uint8 bytes)."""
    if nbytes == 0:
        return
    if isinstance(source, torch.Tensor):
        flat = source.detach().contiguous().reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        dst[offset:offset + nbytes].copy_(flat)
        return
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = np.frombuffer(source, dtype=np.uint8, count=nbytes)
        if host is not None:
            host[offset:offset + nbytes] = data
        else:
            dst[offset:offset + nbytes].copy_(torch.from_numpy(data.copy()))
        return
    # A file: read straight into the buffer's memory (CPU), as fast loaders do.
    target = host[offset:offset + nbytes] if host is not None else np.empty(nbytes, dtype=np.uint8)
    view = memoryview(target).cast("B")
    got = 0
    while got < nbytes:
        if hasattr(source, "readinto"):
            n = source.readinto(view[got:])
        else:
            chunk = source.read(nbytes - got)
            n = len(chunk)
            view[got:got + n] = chunk
        if not n:
            raise ValueError(f"file ended after {got} of {nbytes} bytes")
        got += n
    if host is None:
        dst[offset:offset + nbytes].copy_(torch.from_numpy(target))


__all__ = ["Source", "layout", "check_shape", "copy_into"]
