"""Which tensors are CUDA tensors, and where fresh device memory comes from: in one place.

Why a module for five one-liners: the sanitizer's CUDA paths (device hash
slots, tombstones, rescued copies, owned copies) must be exercised on
machines without a GPU, and torch cannot make a CPU tensor report
``device.type == "cuda"``. Every CUDA decision and every device allocation of
``cuda_hooks`` and of the sanitizer goes through these functions (called as
``devices.is_cuda(t)``, so a test harness can stand in for them: see
``tests/fake_cuda.py``, which treats chosen CPU memory as device memory).
Streams, events and capture state are torch's own ``torch.cuda`` calls, which
such a harness replaces where torch defines them.

In production these are exactly the torch calls they name: device memory is
ordinary caching-allocator memory allocated on the current stream, so
``record_stream``, CUDA IPC and ``resize_`` work on it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_cuda", "device_of", "storage_device", "empty", "zeros", "empty_like", "from_interface"]


def is_cuda(t: torch.Tensor) -> bool:
    """Does ``t`` live in CUDA device memory?"""
    return t.is_cuda


def device_of(t: torch.Tensor) -> torch.device:
    """``t``'s device; a CUDA device always carries its index (``cuda:N``)."""
    return t.device


def storage_device(storage: torch.UntypedStorage) -> torch.device:
    """The device of ``storage``'s memory (``cuda:N`` with its index, or ``cpu``)."""
    return storage.device


def empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` uninitialised bytes (uint8) on ``device``, from the caching allocator (current stream)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` zeros of ``dtype`` on ``device`` (the memset is queued on the current stream)."""
    return torch.zeros(n, dtype=dtype, device=device)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """Contiguous uninitialised memory of ``t``'s shape, dtype and device, from its device's allocator."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def from_interface(region: Any, device: torch.device) -> torch.Tensor:
    """A tensor over the device memory ``region`` exposes through ``__cuda_array_interface__`` (no copy):
    a storage of its own, whose deleter keeps ``region`` (torch's ``as_tensor``). How a CUDA lease
    aliases its staging buffer's bytes."""
    return torch.as_tensor(region, device=device)
