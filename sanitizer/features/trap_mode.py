"""``enable(trap=poison|fault)``: trap mode's policy, and its registration through declared doors.

What it decides: at each retire (``RetireOrder.TRAP``: after rescue and triage, before the guard), every
victim still alive and not rescued has its pages replaced in place by its buffer (poison, or no access),
so every alias of it (numpy, DLPack, ``frombuffer``, ctypes) hits the tombstone, not the next tensor; a
buffer that cannot (a plain one, a lend past the map budget, a failed mapping) leaves the lease to the
guard. How pages are replaced is the buffer's (:mod:`sanitizer.torch_layer.trap`).

How it comes in: only an enable that asks for trap mode imports the torch-layer modules, and then
declares, once, a retire hook, a buffer factory (``StagingBuffer(...)`` then makes a trap buffer for
memory the sanitizer allocates) and an address look-up (the dispatch mode finds a trapped lease from an
alias whose storage it does not know). With ``trap=0`` (the default) nothing is imported or declared,
``StagingBuffer`` stays the plain class and its lend path is untouched.
"""
from __future__ import annotations

import threading
from typing import List

from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.options import Options
from sanitizer.torch_layer import runtime
from sanitizer.torch_layer.hooks import RetireOrder, add_enable_hook, add_retire_hook
from sanitizer.torch_layer.state import state

ORDER = RetireOrder.TRAP
_declared = False
_lock = threading.Lock()


def install() -> None:
    """Watch enables (idempotent). Called by :func:`sanitizer.activation.compose`."""
    add_enable_hook(_on_enable)


def _on_enable(options: Options) -> None:
    global _declared
    if options.trap == "0":
        return
    with _lock:
        if _declared:
            return
        from sanitizer.torch_layer import mode, staging, trap

        staging.add_buffer_factory(trap.buffer_class)
        mode.add_address_lookup(trap.lease_at)
        add_retire_hook(_on_retire, ORDER)
        _declared = True


def _on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    """Each victim still held has its pages replaced in place by its buffer, when the buffer can."""
    if not state.enabled or state.options.trap == "0":
        return
    buffer = runtime.buffer_of(region.region_id)
    if buffer is None:
        return
    for lease in victims:
        if lease.alive and not lease.rescued:
            buffer.retire_pages(lease, event)


__all__ = ["install", "ORDER"]
