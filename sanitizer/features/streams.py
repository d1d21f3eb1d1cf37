"""``record_stream`` on a lease reaches the memory it aliases.

Unsanitized, a loader's view shares the staging buffer's caching-allocator block, and
``w.record_stream(s)`` keeps that block from being reused until ``s`` has run: the correct way to
read a view on another stream after its owner frees it. A lease is a tensor of its own over the
buffer's bytes (a ``__cuda_array_interface__`` alias), and torch ignores ``record_stream`` on memory
its allocator did not hand out: so under the sanitizer the buffer's block went back to the pool while
``s`` still read it, a use-after-free the sanitizer itself made. While enabled with CUDA in use,
``Tensor.record_stream`` also records the stream on what a lease's memory really is: the staging
buffer's bytes, or, once the guard made it a tombstone, the shared poison block. A rescued lease owns
allocator memory of its own, where torch's own call already works. Any other tensor pays one
dictionary look-up (``record_stream`` is called a few times per step, not per element).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Optional

import torch

from sanitizer.core.options import Options
from sanitizer.torch_layer import runtime, staging, storage_handles
from sanitizer.torch_layer.hooks import add_enable_hook

_lock = threading.Lock()


def install() -> None:
    """Arm the forwarding: each enable with CUDA available puts it in place (once; again if someone
    else replaced ``Tensor.record_stream`` since). With the sanitizer off nothing is installed."""
    add_enable_hook(_on_enable)


def _on_enable(options: Options) -> None:
    try:
        if not torch.cuda.is_available():
            return
    except Exception:  # a broken driver: no CUDA lease can exist either
        return
    with _lock:
        current = torch.Tensor.record_stream
        if getattr(current, "_ownsan_forwards", False):
            return
        torch.Tensor.record_stream = _forwarding(current)  # type: ignore[method-assign]


def _forwarding(original: Any) -> Any:
    @functools.wraps(original)
    def record_stream(self: torch.Tensor, stream: Any) -> None:
        original(self, stream)
        owner = memory_owner(self)
        if owner is not None:
            original(owner, stream)

    record_stream._ownsan_forwards = True  # type: ignore[attr-defined]
    return record_stream


def memory_owner(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The allocator tensor whose memory lease ``t`` (or a view of one) aliases: the poison block of a
    tombstone, the staging buffer's bytes of a lease; None for any other tensor and a rescued lease."""
    lease = runtime.lease_of(t)
    if lease is None or lease.rescued:
        return None
    try:
        block = storage_handles.DEVICE_POISON.block_at(t.untyped_storage().data_ptr())
    except RuntimeError:
        return None
    if block is not None:
        return block
    return staging.buffer_bytes(lease.region_id)


__all__ = ["install", "memory_owner"]
