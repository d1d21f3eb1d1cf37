"""``guard=1`` (default in debug mode): retained stale views read poison, never the next tensor.

The dispatch mode catches every aten read of a stale lease, but some reads never
reach it: ctypes and C extensions reading ``data_ptr()``, DLPack consumers, a
thread started before ``enable()``. For those the only defence is the bytes
themselves. When a reuse or close retires a lease that something still holds
(and rescue did not take it), the guard re-points that lease's storage (the data
pointer swap rescue uses) to a *tombstone*: fresh memory of the same size filled
with ``poison_byte`` (0xFF: NaN in fp16, bf16 and fp32). The staging bytes go
back to the producer untouched; the stale view, and every view derived from it,
now reads NaN. The lease stays stale, so the mode still reports any aten read.

A tombstone lives exactly as long as the lease's storage (it is that storage's
memory now) and is counted in :func:`stats`. On CPU (Linux) every tombstone is a
copy-on-write mapping of one shared poison file, so tombstones cost one ``mmap``
each and, together, the memory of the largest; on CUDA every tombstone is a view
of one shared poison block per device (``storage_handles.DEVICE_POISON``), so
together they cost the largest one's memory, in the caching allocator's block sizes, and
nothing once the last one is gone.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List

from cuda_hooks import devices
from sanitizer.core import forking
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.options import Options
from sanitizer.torch_layer import graph_capture, runtime, storage_handles
from sanitizer.torch_layer.hooks import RetireOrder, add_enable_hook, add_retire_hook
from sanitizer.torch_layer.state import state

ORDER = RetireOrder.GUARD  # after rescue (which may take the lease) and triage (which names holders)

_lock = threading.Lock()
_counts = {"tombstones": 0, "tombstone_bytes": 0, "alive": 0, "alive_bytes": 0}
_installed = False


def install() -> None:
    """Arm the guard (idempotent): each ``enable(guard=1)`` then installs its hooks. Called by the
    package's composition root; with the sanitizer off no hook is ever installed."""
    add_enable_hook(_on_enable)


def _on_enable(options: Options) -> None:
    global _installed
    if options.guard and storage_handles.AVAILABLE and not _installed:
        add_retire_hook(_on_retire, ORDER)
        _installed = True


def _on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    if not (state.enabled and state.options.guard):
        return
    fill = state.options.poison_byte
    for lease in victims:
        if not lease.alive or lease.rescued or _pages_replaced(region, lease):
            continue  # (trap mode already replaced this lease's pages in place)
        storage = runtime.storage_of(lease)  # (whenever it was lent: a lease is a weak reference to its storage)
        if storage is None or storage_handles.holders(storage) <= 0:
            continue  # nobody holds it: it dies now and nobody can read it
        device = devices.storage_device(storage)
        if device.type == "cuda" and graph_capture.capturing(device):
            graph_capture.skipped(f"the tombstone of '{lease.name}'")  # (a new poison block would allocate and wait)
            continue
        _entomb(lease, storage, fill)


def _pages_replaced(region: Region, lease: Lease) -> bool:
    """Did the lease's buffer replace its pages in place at this retire (trap mode)? The buffer says."""
    buffer = runtime.buffer_of(region.region_id)
    return buffer is not None and buffer.pages_replaced(lease)


def _entomb(lease: Lease, storage: Any, fill: int) -> None:
    previous, keeper = storage_handles.repoint(storage, fill)  # same storage object: its death still ends the lease
    del previous
    nbytes = storage.nbytes()
    with _lock:
        _counts["tombstones"] += 1
        _counts["tombstone_bytes"] += nbytes
        _counts["alive"] += 1
        _counts["alive_bytes"] += nbytes
    weakref.finalize(keeper, _buried, nbytes)


def _buried(nbytes: int) -> None:
    with _lock:
        _counts["alive"] -= 1
        _counts["alive_bytes"] -= nbytes


def stats() -> Dict[str, int]:
    """Tombstones made in all and alive now, with their bytes (as views see them), and the memory
    they really share: on CPU one poison file (the size of the largest), on CUDA one poison block
    per device (``device_poison_bytes``, all devices together)."""
    with _lock:
        counts = dict(_counts)
    return dict(counts, shared_poison_bytes=storage_handles.POISON.nbytes,
                device_poison_bytes=storage_handles.DEVICE_POISON.nbytes)



@forking.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


__all__ = ["install", "stats", "ORDER"]
