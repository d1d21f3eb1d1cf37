"""``InPlaceBuffer``: a ring segment that keeps the ring's bookkeeping and lends each tensor where it is.

The ``safetensors_ring`` emulation under safetensors' own contract (not strict) never lets a held view's
bytes change: the ring leaves them to the views that hold them (``StagingRing.renew``) and reports a
retention. So the ring's *memory* decides nothing there; only its positions do (which views the ring
would have come round to, and when). Copying each tensor into that memory cost a whole extra pass over
the checkpoint (an LLM-shaped load: 1.7-2.0x of off, issue 52), for bytes no correct consumer could tell
from the ones safetensors handed over.

So a ring of such segments (``StagingRing(..., in_place=True)``) lends the tensor the loader produced, when
that tensor is the only view of a storage of exactly its bytes (``get_tensor``'s result: a fresh storage over
the file mapping at each call), and files its lease at the ring's offsets as a put would: reuses, retires, the
consumer's turns, the holder walk, checksums (over the lease's own bytes, :meth:`InPlaceBuffer.bytes_of`) all
run as they did. A contiguous view into a larger storage (a slice) is lent in place too, under a storage of
its own over the same bytes (:func:`lendable`); any other source (a tensor already lent, a strided one, another
device) is copied into the segment's memory as before. A reuse of bytes no fresh lease covers is skipped: it would retire
nothing, and in place it writes nothing (the usual ring load, whose consumer copied each view out and dropped
it). The memory is never poisoned (``owns_memory`` is False: what poison would write there is no view's bytes).

Never used where the bytes must change under a held view (``safetensors_strict=1``, a borrowing
loader's real ring): there the copy is the point.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from sanitizer.core.ledger import Lease
from sanitizer.core.sites import capture
from sanitizer.torch_layer import own_ops, runtime, staging
from sanitizer.torch_layer.aliasing import alias_view, host_array
from sanitizer.torch_layer.sources import flat_bytes
from sanitizer.torch_layer.staging import BORROWED_MARKER, StagingBuffer
from sanitizer.torch_layer.state import state


def lendable(tensor: torch.Tensor, device: torch.device) -> Optional[Tuple[torch.Tensor, int]]:
    """``(view, nbytes)`` to lend in place for ``tensor``, or None (the ring copies it): a plain contiguous tensor
    on ``device``, not requiring grad, with bytes, not a lease already. The view is ``tensor`` itself when it is
    the only view of a storage of exactly its bytes (``get_tensor``'s result); a view into a larger storage
    (``get_slice(k)[...]``: a view of the whole tensor's file mapping) gets the same bytes under a storage of
    their own, aliasing them and keeping the larger one alive: a write through it lands where a write through
    safetensors' own slice does (a later read of that name sees it, as without the sanitizer). (Who passes it
    gives it away: it becomes the lent view.)"""
    if type(tensor) is not torch.Tensor or tensor.requires_grad or tensor.device != device:
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes or not tensor.is_contiguous():
        return None
    storage = tensor.untyped_storage()
    if state.ledger.lease(storage._cdata) is not None:
        return None
    if storage.nbytes() == nbytes and not tensor.storage_offset():
        return tensor, nbytes
    flat = own_ops.call(flat_bytes, tensor, nbytes)
    view, _ = alias_view(flat, host_array(flat), 0, nbytes, tuple(tensor.shape), tensor.dtype)
    return view, nbytes


class InPlaceBuffer(StagingBuffer):
    """A ring segment that can lend a tensor where it is (see the module's text); a write copies, as any."""

    def __init__(self, nbytes: int, device: object = "cpu", name: Optional[str] = None):
        StagingBuffer.__init__(self, nbytes, device, name)
        self.owns_memory = False  # poison never writes it: no view's bytes are there (or only copies nobody reads)

    def lend_as_is(self, offset: int, nbytes: int, tensor: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        """Reuse ``[offset, offset + nbytes)`` as a write does and lend ``tensor`` itself as a lease there
        (``nbytes`` from :func:`lendable`): a write without its copy."""
        self._live(f"write '{name}' into")
        dtype = tensor.dtype
        if offset < 0 or offset + nbytes > self.nbytes or (self._base + offset) % dtype.itemsize:
            self._check_lend(offset, tuple(tensor.shape), dtype, name, "write")  # says what is wrong
        depth = state.options.stack_depth
        site = (capture(depth, 3) if depth else ()) if state.enabled else None
        if state.ledger.has_fresh(self._region.region_id):
            # (no fresh lease in the segment: the reuse would retire nothing, and in place it writes nothing:
            # the usual ring load, whose consumer copied each view out and dropped it)
            runtime.reuse(self._region, offset, offset + nbytes, name, site)
        runtime.track_lease(self._region, offset, nbytes, tensor, name, dtype, tuple(tensor.shape), site)
        if not staging._MARKER_ON_CLASS:
            setattr(tensor, BORROWED_MARKER, True)
        return tensor

    def bytes_of(self, lease: Lease) -> Optional[torch.Tensor]:
        """The bytes ``lease``'s views read: its own storage's (lent in place, or a copy in this memory:
        the storage covers exactly its bytes either way); None once it died."""
        storage = runtime.storage_of(lease)
        if storage is None:
            return None
        return own_ops.call(_over_storage, storage)


def _over_storage(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


__all__ = ["InPlaceBuffer", "lendable"]
