"""``rescue=1``: move a retained lease onto owned memory before its bytes are reused.

Detection tells you a consumer kept a view too long; rescue keeps that
consumer correct meanwhile. At each reuse (or close) the retire hook looks at
the leases about to be overwritten that are still alive, i.e. still held by
someone (a tensor or storage referencing the lease's storage). For each, it
copies the bytes into fresh memory of the same size and swaps the storage's
data pointer, so the lent tensor *and every view derived from it* now read the
copy; then the lease is disowned (no longer a borrow: never stale, not counted
live). On CUDA the copy is ordinary caching-allocator memory, queued on the
current stream (see ``storage_handles.repoint``), and the host waits for that
stream once per reuse that copied: the view reads its new memory at once, from a
stream nobody here knows. A view nobody retained is
already dead and costs nothing, so the copy is paid only for views that really
were retained.

Needs private storage APIs (weak storage handles, ``_swap_data_ptr_``,
``_storage_Use_Count``); without them every would-be rescue is reported
(``"rescued": False``) and the lease goes stale as usual.
"""
from __future__ import annotations

import os
import threading
from typing import List, Optional

import torch

from cuda_hooks import devices
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.options import Options
from sanitizer.features import aliases
from sanitizer.torch_layer import graph_capture, records, runtime, storage_handles
from sanitizer.torch_layer.hooks import RetireOrder, add_enable_hook, add_retire_hook
from sanitizer.torch_layer.staging import buffer_bytes
from sanitizer.torch_layer.state import state

ORDER = RetireOrder.RESCUE  # after checksum verification, before triage and poison

AVAILABLE: bool = storage_handles.AVAILABLE
UNAVAILABLE_REASON: Optional[str] = (None if AVAILABLE
                                     else f"{storage_handles.UNAVAILABLE_REASON}: rescue reports only")

# Rescue records live only among the record store's events (records.record_event, bounded by its cap):
# no second list here that would keep every rescue forever.
_installed = False


def install() -> None:
    """Arm rescue (idempotent): ``enable(rescue=1)`` then installs the retire hook.
    Called by the package's composition root; with rescue off no hook is ever installed."""
    add_enable_hook(_on_enable)


def _on_enable(options: Options) -> None:
    if options.rescue:
        install_hooks()


def install_hooks() -> None:
    """Register the retire hook (idempotent)."""
    global _installed
    if not _installed:
        add_retire_hook(_on_retire, ORDER)
        _installed = True


def _wanted() -> bool:
    return state.enabled and bool(state.options.rescue)


def _on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    if not _wanted():
        return
    copied_on: set = set()  # CUDA device indices whose current stream has a rescue copy queued
    for lease in victims:
        if not lease.alive or lease.rescued:
            continue
        if not AVAILABLE:
            _remember({"kind": "rescue", "rescued": False, "reason": UNAVAILABLE_REASON,
                       "lease": lease.to_dict(), "event": event.to_dict()})
            continue
        storage = runtime.storage_of(lease)  # None: already dead
        if storage is not None and not _capturing(storage, lease):
            device = _rescue(lease, storage, event)
            if device is not None:
                copied_on.add(device.index or 0)
    # A CUDA copy is queued on the retiring stream, but the view reads the new memory at once: a
    # consumer on another stream (or the host) could read it before the copy lands, and which streams
    # will read it is not known here. So the host waits for the copies, once per reuse, not per view
    # (only a view that really was retained is copied: the cost is paid for retentions only).
    # Never while a graph captures (on this thread's current device or a device copied on): a synchronize
    # there is illegal and ends the user's capture; each copy was skipped under capture anyway.
    if copied_on and not _capturing_any(copied_on):
        for index in copied_on:
            torch.cuda.current_stream(index).synchronize()


def _capturing_any(indices: set) -> bool:
    if graph_capture.capturing():
        return True
    return any(graph_capture.capturing(torch.device("cuda", index)) for index in indices)


def _capturing(storage: torch.UntypedStorage, lease: Lease) -> bool:
    """A CUDA graph capture on the lease's device: the copy would run only at replay; it stays stale."""
    device = devices.storage_device(storage)
    if device.type == "cuda" and (graph_capture.capturing() or graph_capture.capturing(device)):
        graph_capture.skipped(f"rescuing '{lease.name}'")
        return True
    return False


def _rescue(lease: Lease, storage: torch.UntypedStorage, event: ReuseEvent) -> Optional[torch.device]:
    """Move ``lease`` onto a copy; returns the CUDA device whose current stream the copy was queued on
    (None: nothing queued, a host copy or an in-place one)."""
    holders = storage_handles.holders(storage)
    if holders <= 0:
        return None  # nobody holds it: it dies now, nothing to keep correct
    # the lease's storage (and its views) now own a copy; on CUDA the copy is queued on the current stream,
    # which the staging memory records, so that freeing the buffer meanwhile cannot hand its bytes to another
    in_place = _trap_rescue(lease, event)  # trap mode: the lease's own pages become the copy, aliases and all
    if not in_place:
        previous, keeper = storage_handles.repoint(storage, source=buffer_bytes(lease.region_id))
    runtime.disown(lease)  # before `previous` (now holding the staging alias) dies
    nbytes = storage.nbytes()
    if not in_place:  # (the storage object is the same: its death, now the copy's, still ends the lease)
        del previous
        from sanitizer.features.ownership import account_copy

        account_copy("rescue", nbytes, keeper)
    record = {"kind": "rescue", "rescued": True, "nbytes": nbytes, "holders": holders,
              "lease": lease.to_dict(), "event": event.to_dict(),
              "thread": threading.current_thread().name, "pid": os.getpid()}
    if in_place:
        record["in_place"] = True  # (trap mode: every alias reads the copy too)
    exported = aliases.records_of(lease.lease_id)
    if exported and not in_place:  # they point at the staging bytes, not at the storage: the copy misses them
        record["aliases_not_rescued"] = exported
    _remember(record)
    device = devices.storage_device(storage)
    return device if device.type == "cuda" and not in_place else None


def _trap_rescue(lease: Lease, event: ReuseEvent) -> bool:
    """Rescue at page level when the lease's buffer can (trap mode: its own window), else False."""
    buffer = runtime.buffer_of(lease.region_id)
    return buffer is not None and buffer.rescue_pages(lease, event)  # (CUDA: the device waits once per reuse)


def _remember(record: dict) -> None:
    records.record_event("rescue", record)


def rescues() -> List[dict]:
    """The rescues recorded so far (JSON-ready): the lease (with its lend site), the reuse that triggered it,
    holders. They are runtime events, so the records cap bounds them like every other record."""
    return records.events("rescue")


def clear() -> None:
    """Forget the rescue records."""
    records.forget_events("rescue")


__all__ = ["install", "install_hooks", "rescues", "clear", "AVAILABLE", "ORDER"]
