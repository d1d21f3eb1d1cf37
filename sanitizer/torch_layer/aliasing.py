"""Storage aliasing: give each lend its own storage over the buffer's bytes.

Lease identity is storage identity. Every view derived from a lent tensor
(view, narrow, slicing, ``t``, ``detach``, ``as_strided``...) shares its
storage, and a plain Python attribute does not survive those ops. So each lend
gets a *new* storage object that aliases the region and keeps the buffer's
memory alive; the dispatch mode then recognises a lease, and everything derived
from it, by the storage's address.

The storage is made through a small Python object that torch holds in the
storage's deleter (a numpy view on CPU, a ``__cuda_array_interface__`` holder
on CUDA). A weak reference to that object tells us the moment the storage dies,
which is when the lease stops being alive: no polling, no ``id()`` reuse.
On CPU the numpy view already has the lend's shape and (where numpy knows it)
dtype, so a lend costs one ``from_numpy`` and at most one torch ``view``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch

from cuda_hooks import devices
from sanitizer.torch_layer import own_ops

_SUPPORTED = ("cpu", "cuda")

_NUMPY_SAME = {
    torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
    torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
    torch.float64: np.float64, torch.complex64: np.complex64, torch.complex128: np.complex128,
}
_NUMPY_BY_SIZE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64, 16: np.complex128}
HOST_VIEWS: Dict[torch.dtype, Tuple[np.dtype, bool]] = {}  # dtype -> (numpy dtype, needs a torch .view(dtype))


def host_view(dtype: torch.dtype) -> Tuple[np.dtype, bool]:
    """``(numpy dtype, needs a torch .view(dtype))`` of a CPU lease of ``dtype`` (cached in ``HOST_VIEWS``)."""
    hit = HOST_VIEWS.get(dtype)
    if hit is None:
        same = _NUMPY_SAME.get(dtype)
        hit = (np.dtype(same), False) if same is not None else (np.dtype(_NUMPY_BY_SIZE[dtype.itemsize]), True)
        HOST_VIEWS[dtype] = hit
    return hit


class _CudaRegion:
    """Exposes ``nbytes`` of device memory at ``ptr`` via the CUDA array interface.

    torch keeps this object referenced from the new storage's deleter, so it
    lives exactly as long as the storage; it also holds ``owner`` (the buffer
    tensor; in trap mode the lease's window), so the memory outlives every
    lease even after the buffer is closed. Made by :func:`device_region`.
    """

    __slots__ = ("__weakref__", "_owner", "__cuda_array_interface__")

    def __init__(self, owner: Any, ptr: int, nbytes: int):
        self._owner = owner
        # Version 2 without a stream key: torch then adds no synchronisation.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
        }


def device_region(owner: Any, ptr: int, nbytes: int) -> _CudaRegion:
    """``nbytes`` of device memory at ``ptr``, for ``devices.from_interface``, keeping ``owner`` alive."""
    return _CudaRegion(owner, ptr, nbytes)


def check_device(device: torch.device) -> None:
    if device.type not in _SUPPORTED:
        raise ValueError(f"staging buffers on device '{device}' are not supported; use one of {_SUPPORTED}")


def host_array(buffer_u8: torch.Tensor) -> Optional[np.ndarray]:
    """The numpy array over a CPU buffer (None on CUDA): the parent of every CPU lease."""
    return None if devices.is_cuda(buffer_u8) else own_ops.as_numpy(buffer_u8)  # (not the attribute a user patches)


def alias_view(
    buffer_u8: torch.Tensor,
    host: Optional[np.ndarray],
    offset: int,
    nbytes: int,
    shape: Tuple[int, ...],
    dtype: torch.dtype,
) -> Tuple[torch.Tensor, object]:
    """A ``dtype[shape]`` tensor over ``buffer[offset:offset+nbytes]`` with a storage of its own.

    Returns the tensor and the object torch keeps in that storage's deleter:
    a weak reference to it, with a callback, fires when the new storage (and
    so every view derived from it) is gone.
    """
    if host is not None:
        np_dtype, retype = HOST_VIEWS.get(dtype) or host_view(dtype)
        piece = np.ndarray(shape, np_dtype, host, offset)  # one call: cheaper than slice+view+reshape
        return own_ops.over_host(piece, dtype, retype), piece
    piece = device_region(buffer_u8, buffer_u8.data_ptr() + offset, nbytes)
    alias = devices.from_interface(piece, devices.device_of(buffer_u8))
    return alias.view(dtype).view(shape), piece


def storage_key(t: torch.Tensor) -> int:
    """The address of the tensor's StorageImpl: shared by all views, unique while it lives."""
    return t.untyped_storage()._cdata


def byte_extent(t: torch.Tensor) -> Tuple[int, int]:
    """``(first byte address, byte length)`` actually spanned by ``t``'s elements."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), span * t.element_size()


def device_key(device: torch.device) -> str:
    """Canonical device string for the address registry (``cuda`` becomes ``cuda:N``)."""
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


_DTYPE_NAMES: Dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16`` (cached: it is on the lend path)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


__all__ = ["alias_view", "host_view", "storage_key", "byte_extent", "device_key", "dtype_name", "host_array", "check_device"]
