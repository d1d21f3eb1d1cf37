"""Checksums and poison: what generation counters cannot see.

Generations catch every stale read that goes through aten. They cannot see
bytes changed behind torch's back (a C extension writing through
``data_ptr``, DMA, numpy, another library's kernel), nor stale reads through
such paths. So, with ``checksum=1``, each lease's bytes are hashed at lend
(after the producer's write) and re-hashed when a reuse retires it while it
is still alive, and at :func:`verify`; a difference is a
:class:`~sanitizer.core.errors.BorrowCorruptedError` naming the lease. With
``poison=1`` the bytes of every retired lease are filled with ``poison_byte``
(0xFF reads as NaN in fp16, bf16 and fp32) before the producer writes, so a
stale read through any path reads NaN instead of plausible weights.

On CUDA the hashes and a mismatch flag live in device memory and every kernel
runs on torch's current stream; the host looks at the flags only at a
synchronisation point (:func:`synchronize`, the end of a deferral scope,
process exit). On CPU the same checks run at once. The kernels live in
``cuda_hooks`` and are imported on first use only: with these options off,
numba is never imported.
"""
from __future__ import annotations

import atexit
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from sanitizer.core import forking
from sanitizer.torch_layer import records, runtime
from sanitizer.torch_layer.hooks import RetireOrder, add_lend_hook, add_retire_hook
from sanitizer.torch_layer.stale_use import check_not_stale
from sanitizer.torch_layer.state import state
from sanitizer.core.errors import BorrowCorruptedError
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.sites import capture
from sanitizer.core.spans import merge, subtract
from sanitizer.torch_layer.staging import buffer_bytes, poisonable_bytes

_lock = threading.RLock()


def _kernels():
    import cuda_hooks  # imported here so that numba loads only when a check or poison runs

    return cuda_hooks


def _lease_bytes(lease: Lease) -> Optional[torch.Tensor]:
    data = buffer_bytes(lease.region_id)
    return None if data is None else data[lease.start:lease.end]


class _DeviceSlots:
    """Expected hashes and mismatch flags of CUDA leases, in device memory, one slot a lease."""

    def __init__(self, device: torch.device):
        self.device = device
        self.expected = torch.zeros(64, dtype=torch.int64, device=device)
        self.flags = torch.zeros(64, dtype=torch.int32, device=device)
        self.leases: Dict[int, Lease] = {}  # slot -> lease
        self.free: List[int] = list(range(63, -1, -1))

    def take(self, lease: Lease) -> int:
        if not self.free:
            self._reclaim()
        if not self.free:
            n = self.expected.numel()
            self.expected = torch.cat([self.expected, torch.zeros_like(self.expected)])
            self.flags = torch.cat([self.flags, torch.zeros_like(self.flags)])
            self.free = list(range(2 * n - 1, n - 1, -1))
        slot = self.free.pop()
        self.leases[slot] = lease
        return slot

    def _reclaim(self) -> None:
        """Slots of leases that died or were retired are free again (no sync: flags stay queued)."""
        for slot, lease in list(self.leases.items()):
            if not lease.alive or lease.checksum is None:
                del self.leases[slot]
                self.free.append(slot)


_slots: Dict[torch.device, _DeviceSlots] = {}


def _slots_for(device: torch.device) -> _DeviceSlots:
    slots = _slots.get(device)
    if slots is None:
        if not _slots:
            atexit.register(_synchronize_at_exit)  # device flags are read at exit at the latest
        slots = _slots[device] = _DeviceSlots(device)
    return slots


# -- hooks -------------------------------------------------------------------
def on_lend(lease: Lease, view: torch.Tensor) -> None:
    """Take the lease's hash (lend hook): the producer has written its bytes by now."""
    if not state.options["checksum"]:
        return
    raw = _lease_bytes(lease)
    if raw is None:
        return
    hooks = _kernels()
    if not hooks.devices.is_cuda(raw):
        lease.checksum = hooks.checksum(raw)
    else:
        device = hooks.devices.device_of(raw)
        with _lock:
            slots = _slots_for(device)
            slot = slots.take(lease)
        hooks.checksum_into(raw, slots.expected, slot)
        lease.checksum = (device, slot)


def _check(lease: Lease, where: str, event: Optional[ReuseEvent]) -> None:
    """Re-hash the lease's bytes; report a mismatch (CPU now, CUDA at the next synchronisation)."""
    expected = lease.checksum
    if expected is None:
        return
    raw = _lease_bytes(lease)
    if raw is None:
        return
    hooks = _kernels()
    if isinstance(expected, int):
        found = hooks.checksum(raw)
        if found != expected:
            err = BorrowCorruptedError(lease, expected, found, where, capture(state.options["stack_depth"]), event)
            records.raise_or_record(err, lease)
    else:
        device, slot = expected
        hooks.verify_into(raw, _slots[device].expected, slot, _slots[device].flags)
        _pending_events[(device, slot)] = (where, event, capture(state.options["stack_depth"]))


_pending_events: Dict[Tuple[torch.device, int], Tuple[str, Optional[ReuseEvent], Any]] = {}


def on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    """Verify every alive lease a reuse retires (retire hook, order 100)."""
    if not state.options["checksum"]:
        return
    for lease in victims:
        if lease.checksum is not None:
            _check(lease, "reuse", event)
            if isinstance(lease.checksum, int):
                lease.checksum = None  # retired: its bytes may now legally change


def on_poison(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    """Fill retired leases' bytes with the poison byte (retire hook, order 400).

    Only buffers the sanitizer allocated (``StagingBuffer(nbytes)``, rings) are ever poisoned; an
    adopted buffer is a loader's memory (a ``borrowed_iterator`` over a state_dict that lives on):
    its bytes are never written.

    Bytes that a still-fresh lease covers are left alone: poisoning must never
    change what a correct consumer reads. On a plain reuse the declared range
    itself is skipped too: the producer overwrites it right after this hook,
    so poison there would be replaced before anyone could read it, and
    skipping it halves the write traffic of a ring load. What a stale view
    can still read through non-aten paths (the parts of its bytes outside the
    reused range; everything, after a retire or a close) is poison.
    """
    opts = state.options
    if not opts["poison"]:
        return
    data = poisonable_bytes(region.region_id)  # only memory the sanitizer allocated: never a loader's tensors
    if data is None:
        return
    spans = merge([(l.start, l.end) for l in victims if not l.rescued and l.alive])
    if not spans:
        return
    lo, hi = spans[0][0], spans[-1][1]
    keep = [(l.start, l.end) for l in state.ledger.overlapping(region.region_id, lo, hi)]
    if event.kind == "reuse":
        keep.append((event.start, event.end))
    keep = merge(keep)
    hooks = _kernels()
    for start, end in subtract(spans, keep):
        hooks.poison(data[start:end], opts["poison_byte"])


# -- public API ----------------------------------------------------------------
def verify(*tensors: torch.Tensor) -> None:
    """Check now that the leases behind ``tensors`` still hold the bytes they were lent with.

    A stale lease is a stale use (``StaleBorrowError``); changed bytes are a
    ``BorrowCorruptedError`` (on CUDA reported at the next :func:`synchronize`).
    Tensors that are not leases are skipped. Needs ``checksum=1`` for the
    byte check; the staleness check always runs.
    """
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"verify expects tensors, got {type(t).__name__}")
        if check_not_stale(t, "sanitizer.verify"):
            continue
        lease = runtime.lease_of(t)
        if lease is None or lease.stale_by is not None:
            continue
        _check(lease, "verify", None)


def synchronize(halt: Optional[bool] = None) -> None:
    """Read the device mismatch flags (a host synchronisation) and report what they say.

    ``halt`` as in :func:`~sanitizer.torch_layer.records.raise_or_record` (None: as the options say)."""
    with _lock:
        flagged = []
        for device, slots in _slots.items():
            hits = torch.nonzero(slots.flags).flatten().tolist()  # syncs this device's stream
            if hits:
                slots.flags.zero_()
            flagged += [(device, slot, slots.leases.get(slot)) for slot in hits]
    for device, slot, lease in flagged:
        where, event, site = _pending_events.pop((device, slot), ("synchronize", None, ()))
        if lease is not None:
            expected = _kernels().to_unsigned(int(_slots[device].expected[slot]))
            records.raise_or_record(BorrowCorruptedError(lease, expected, None, where, site, event), lease, halt)


def expected_hash(lease: Lease) -> Optional[int]:
    """The hash taken of ``lease``'s bytes when it was lent (None: not checksummed). Reading a device
    slot is a host synchronisation: for tests and tools, not hot paths."""
    taken = lease.checksum
    if taken is None or isinstance(taken, int):
        return taken
    device, slot = taken
    return _kernels().to_unsigned(int(_slots[device].expected[slot]))


def _synchronize_at_exit() -> None:
    if not _slots:
        return
    try:
        synchronize(halt=False)  # at exit, record: no caller to raise to
    except Exception as exc:  # a torn-down CUDA context must not turn exit into a traceback
        print(f"ownership-sanitizer: device checksum flags unreadable at exit: {exc}", file=sys.stderr)


def install() -> None:
    """Plug the checks into lending and retirement (idempotent; cheap while the options are off)."""
    add_lend_hook(on_lend)
    add_retire_hook(on_retire, RetireOrder.VERIFY)
    add_retire_hook(on_poison, RetireOrder.POISON)



@forking.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()


__all__ = ["verify", "synchronize", "expected_hash", "install", "on_lend", "on_retire", "on_poison"]
