"""``rescue=1``: move a retained lease onto owned memory before its bytes are reused.

Detection tells you a consumer kept a view too long; rescue keeps that
consumer correct meanwhile. At each reuse (or close) the retire hook looks at
the leases about to be overwritten that are still alive, i.e. still held by
someone (a tensor or storage referencing the lease's storage). For each, it
copies the bytes into fresh memory of the same size and swaps the storage's
data pointer, so the lent tensor *and every view derived from it* now read the
copy; then the lease is disowned (no longer a borrow: never stale, not counted
live). A view nobody retained is already dead and costs nothing, so the copy is
paid only for views that really were retained.

Needs private storage APIs (weak storage handles, ``_swap_data_ptr_``,
``_storage_Use_Count``); without them every would-be rescue is reported
(``"rescued": False``) and the lease goes stale as usual.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from sanitizer.torch_layer import runtime
from sanitizer.torch_layer.aliasing import alias_view, host_array
from sanitizer.core.ledger import Lease, Region, ReuseEvent

ORDER = runtime.RetireOrder.RESCUE  # after checksum verification, before triage and poison

_S = torch.UntypedStorage
_API_NAMES = ("_weak_ref", "_new_with_weak_ptr", "_expired", "_free_weak_ref", "_swap_data_ptr_")
AVAILABLE: bool = all(hasattr(_S, n) for n in _API_NAMES) and hasattr(torch._C, "_storage_Use_Count")
UNAVAILABLE_REASON: Optional[str] = None if AVAILABLE else (
    "this torch lacks UntypedStorage." + "/".join(n for n in _API_NAMES if not hasattr(_S, n))
    + ("" if hasattr(torch._C, "_storage_Use_Count") else " and torch._C._storage_Use_Count")
    + ": rescue reports only")

_lock = threading.RLock()
_handles: Dict[int, Tuple[Lease, int]] = {}  # lease id -> (lease, weak storage handle)
_records: List[dict] = []
_installed = False


def install() -> None:
    """Arm rescue (idempotent): ``enable(rescue=1)`` then installs the lend and retire hooks.
    Called by the package's composition root; with rescue off no hook is ever installed."""
    runtime.on_enable(_on_enable)


def _on_enable(options: Dict[str, Any]) -> None:
    if options.get("rescue"):
        install_hooks()


def install_hooks() -> None:
    """Register the lend and retire hooks (idempotent)."""
    global _installed
    if not _installed:
        runtime.add_lend_hook(_on_lend)
        runtime.add_retire_hook(_on_retire, ORDER)
        _installed = True


def _wanted() -> bool:
    return runtime.state.enabled and bool(runtime.state.options.get("rescue"))


def _free(handle: int) -> None:
    _S._free_weak_ref(handle)


def _sweep() -> None:
    """Free the handles of leases that died unrescued (amortised: runs when the table doubles)."""
    dead = [lid for lid, (lease, _) in _handles.items() if not lease.alive or lease.rescued]
    for lid in dead:
        _free(_handles.pop(lid)[1])


def _on_lend(lease: Lease, view: torch.Tensor) -> None:
    """Keep a weak handle on the lease's storage: the retire hook needs the storage, not a tensor."""
    if not AVAILABLE or not runtime.state.options.get("rescue"):
        return
    handle = view.untyped_storage()._weak_ref()
    with _lock:
        _handles[lease.lease_id] = (lease, handle)
        if len(_handles) > 64 + 2 * runtime.state.ledger.live_count:
            _sweep()


def _on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    if not _wanted():
        return
    for lease in victims:
        if not lease.alive or lease.rescued:
            continue
        with _lock:
            entry = _handles.pop(lease.lease_id, None)
        if entry is not None:
            _rescue(lease, entry[1], event)
        elif not AVAILABLE:
            _remember({"kind": "rescue", "rescued": False, "reason": UNAVAILABLE_REASON,
                       "lease": lease.to_dict(), "event": event.to_dict()})
        # else: lent before rescue was switched on, so no handle: it goes stale and detection applies


def _rescue(lease: Lease, handle: int, event: ReuseEvent) -> None:
    try:
        if _S._expired(handle):
            return
        storage = _S._new_with_weak_ptr(handle)
    finally:
        _free(handle)
    holders = torch._C._storage_Use_Count(storage._cdata) - 1  # minus the reference we just made
    if holders <= 0:
        return
    nbytes = storage.nbytes()
    buf = torch.empty(nbytes, dtype=torch.uint8, device=storage.device)
    fresh, piece = alias_view(buf, host_array(buf), 0, nbytes, (nbytes,), torch.uint8)
    owned = fresh.untyped_storage()
    owned.copy_(storage)
    storage._swap_data_ptr_(owned)  # the lease's storage (and all its views) now own the copy
    runtime.disown(lease)  # before `owned` (now holding the staging alias) dies and releases the lease
    del owned, fresh, buf
    from sanitizer.features.ownership import account_copy

    account_copy("rescue", nbytes, piece)
    _remember({"kind": "rescue", "rescued": True, "nbytes": nbytes, "holders": holders,
               "lease": lease.to_dict(), "event": event.to_dict(),
               "thread": threading.current_thread().name, "pid": os.getpid()})


def _remember(record: dict) -> None:
    with _lock:
        _records.append(record)
    runtime.record_event("rescue", record)


def rescues() -> List[dict]:
    """Every rescue so far (JSON-ready): the lease (with its lend site), the reuse that triggered it, holders."""
    with _lock:
        return list(_records)


def clear() -> None:
    """Forget the rescue records and free every weak handle held."""
    with _lock:
        for _, handle in _handles.values():
            _free(handle)
        _handles.clear()
        _records.clear()
    runtime.forget_events("rescue")


__all__ = ["install", "install_hooks", "rescues", "clear", "AVAILABLE", "ORDER"]
