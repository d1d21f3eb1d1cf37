"""One path for a stale use: what happens when a stale lease is about to be read or written.

The dispatch mode (per aten op) and the reader hooks (``tolist``, ``numpy``,
``verify``...) call :func:`report_stale_use`. It captures the user's stack once,
asks the stale-use hooks (triage confirms the retention, notes the stale read
and names who holds the view), builds the error with that holder as a plain
value, and hands it to :func:`~sanitizer.torch_layer.records.raise_or_record`.
The fact "lease L was read stale at X, held by H" is computed here, once.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, Optional

import torch

from sanitizer.core.errors import StaleBorrowError
from sanitizer.core.ledger import Lease
from sanitizer.core.sites import capture_excluding, torch_dir
from sanitizer.torch_layer import mode as _mode
from sanitizer.torch_layer.aliasing import storage_key
from sanitizer.torch_layer.hooks import HOOKS, StaleUse
from sanitizer.torch_layer.records import raise_or_record
from sanitizer.torch_layer.state import state


def report_stale_use(lease: Lease, func: Any, tensor: Optional[torch.Tensor],
                     used_as: Optional[Dict[str, Any]] = None) -> None:
    """``tensor`` (a view of the stale ``lease``; None for its storage, described by ``used_as``) is about
    to be used by ``func``: report it."""
    event = lease.stale_by
    assert event is not None
    if tensor is not None:
        used_as = {"dtype": str(tensor.dtype).replace("torch.", ""), "shape": list(tensor.shape)}
    use = StaleUse(op=str(func), used_at=capture_excluding(state.options.stack_depth, (torch_dir(),)),
                   used_as=used_as, thread=threading.current_thread().name)
    holder = _holder(lease, use)
    raise_or_record(StaleBorrowError(lease, event, use.op, use.used_at, use.used_as, holder=holder,
                                     lent_note=_lent_cut_note(lease)), lease)


def _lent_cut_note(lease: Lease) -> str:
    """``(1 frame: ...)`` when the lend's stack was cut to its call site because the sanitizer was off then
    (a lend before ``sanitize()``, the README's own pattern): one frame inside a function, whose caller a
    capture while on would have kept (stack_depth > 1). A lend at module level has no caller to keep."""
    depth = state.options.stack_depth
    if depth <= 1 or len(lease.site) != 1:
        return ""
    code = lease.site[0][0]
    if code.co_name == "<module>":
        return ""
    return (f"(1 frame: the lend happened while the sanitizer was off, which keeps only the call site; "
            f"lends while on keep stack_depth={depth})")


def _holder(lease: Lease, use: StaleUse) -> Optional[Dict[str, Any]]:
    """The first holder a stale-use hook names (every hook runs: each may record the use)."""
    holder = None
    for hook in HOOKS.stale_use:
        try:
            found = hook(lease, use)
        except Exception:  # a diagnostic must never replace the error it annotates
            continue
        if holder is None and found:
            holder = found
    return holder


def check_not_stale(tensor: torch.Tensor, where: str) -> bool:
    """The one stale check for reads the dispatch mode cannot see (``tolist``, ``numpy``, ``verify``...).

    Reports through :func:`report_stale_use` when ``tensor``'s lease is stale and returns True
    (when the error was recorded, not raised); False when it is not stale. The mode's per-op path
    does the same lookup inline, for speed.
    """
    if not state.stale or not state.enabled:
        return False
    try:
        lease = state.stale.get(storage_key(tensor))
    except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less subclasses
        return False
    if lease is None and _mode._address_lookups:
        lease = _mode.lease_by_address(tensor)  # an alias of a trapped lease (trap mode)
    if lease is None:
        return False
    report_stale_use(lease, where, tensor)
    return True


def check_storage_not_stale(storage: Any, where: str) -> bool:
    """:func:`check_not_stale` for a lease's storage used through the storage API (``storage[0:16]``,
    ``pickle.dumps(storage)``, ``torch.save(storage)``)."""
    if not state.stale or not state.enabled:
        return False
    try:
        lease = state.stale.get(storage._cdata)
    except (AttributeError, RuntimeError):
        return False
    if lease is None:
        return False
    report_stale_use(lease, where, None, {"dtype": "storage", "shape": [lease.nbytes]})
    return True


__all__ = ["report_stale_use", "check_not_stale", "check_storage_not_stale"]
