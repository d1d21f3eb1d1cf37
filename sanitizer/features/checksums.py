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

On CUDA the hashes and a mismatch flag live in device memory (one slot a
lease, :class:`DeviceChecks`) and every kernel runs on torch's current stream
of the lease's device; the host looks at the flags only at a synchronisation
point (:func:`synchronize`, the end of a deferral scope, a slot table that is
full, process exit), which first waits for every stream a check ran on since
the last one. While the current stream captures a CUDA graph, the device
work skips (``torch_layer.graph_capture``, one warning). On CPU the same
checks run at once. The kernels live in
``cuda_hooks`` and are imported on first use only: with these options off,
numba is never imported.
"""
from __future__ import annotations

import atexit
import sys
import threading
import warnings
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from sanitizer.core import forking
from sanitizer.core.options import Options
from sanitizer.torch_layer import graph_capture, records, runtime
from sanitizer.torch_layer.hooks import RetireOrder, add_enable_hook, add_lend_hook, add_retire_hook
from sanitizer.torch_layer.stale_use import check_not_stale
from sanitizer.torch_layer.state import state
from sanitizer.core.errors import BorrowCorruptedError
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.sites import capture
from sanitizer.core.spans import merge, subtract
from sanitizer.torch_layer.staging import lease_bytes, poisonable_bytes


def _kernels():
    import cuda_hooks  # imported here so that numba loads only when a check or poison runs

    return cuda_hooks


#: A device mismatch found at a synchronisation: (lease, expected hash, where, event, site).
Report = Tuple[Lease, int, str, Optional[ReuseEvent], Any]


def _device_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that every stream may use at once: the memset is queued on the current stream, which is
    then waited for (tables are allocated once and at each doubling, never on a hot path)."""
    t = _kernels().devices.zeros(n, dtype, device)
    torch.cuda.current_stream(device.index).synchronize()
    return t


class _SlotTable:
    """Expected hashes and mismatch flags of one CUDA device's leases: one slot a lease.

    A slot is handed out again only after its flag was read (at a synchronisation): a lease that
    died or was retired keeps its slot until then, so a raised flag is reported under the lease it
    was raised for, never under the next holder of the slot. When no slot is free the table first
    synchronises (which frees the slots of finished leases), then doubles while it is small or
    few slots came free; both happen after every stream a check ran on was waited for, so no kernel
    still reads or writes the tables being replaced.
    """

    INITIAL = 64
    GROW_BELOW = 4096  # smaller tables double rather than synchronise again soon (48 KiB at this size)

    def __init__(self, device: torch.device):
        self.device = device
        self.expected = _device_zeros(self.INITIAL, torch.int64, device)
        self.flags = _device_zeros(self.INITIAL, torch.int32, device)
        self.leases: Dict[int, Lease] = {}  # slot -> the lease it was taken for (dead ones too, until read)
        self.free: List[int] = list(range(self.INITIAL - 1, -1, -1))

    @property
    def size(self) -> int:
        return self.expected.numel()

    def recycle(self) -> None:
        """(After the flags were read.) The slots of leases that died or were retired are free again."""
        for slot, lease in list(self.leases.items()):
            if not lease.alive or lease.checksum is None:
                del self.leases[slot]
                self.free.append(slot)

    def grow(self) -> None:
        """(After a synchronisation.) Double the tables; the copy is waited for like the first zeros."""
        n = self.size
        expected = _device_zeros(2 * n, torch.int64, self.device)
        flags = _device_zeros(2 * n, torch.int32, self.device)
        expected[:n].copy_(self.expected)
        flags[:n].copy_(self.flags)
        torch.cuda.current_stream(self.device.index).synchronize()
        self.expected, self.flags = expected, flags
        self.free.extend(range(2 * n - 1, n - 1, -1))


class DeviceChecks:
    """The CUDA half of ``checksum=1`` and ``poison=1``: per device a slot table, the streams checks ran
    on since the last synchronisation, and what each queued verify was for.

    One lock: a launch, a table's growth and a flags read never interleave, so no kernel is queued
    with a table being replaced, and no verify is queued between the wait for the streams and the
    reading and clearing of the flags.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tables: Dict[torch.device, _SlotTable] = {}
        self.streams: Dict[Tuple[int, int], Any] = {}  # (device index, handle) -> torch stream used since the last sync
        self.pending: Dict[Tuple[torch.device, int], Tuple[str, Optional[ReuseEvent], Any]] = {}
        self.kept: set = set()  # (region id, device index, stream handle) already recorded on the staging memory
        self.loaded: set = set()  # device indices whose kernels are compiled and loaded
        self.off: Optional[str] = None  # why CUDA checksums are off (the kernels cannot be built here)
        self._canonical: Dict[Tuple[int, int], Any] = {}  # (device index, handle) -> one stream object for all

    def canonical(self, stream: Any) -> Any:
        """(Under the lock.) One object per stream for the leases to keep (``current_stream()`` makes a new
        one per call: a lease each would cost 100,000 of them at a real checkpoint's scale)."""
        key = (stream.device.index, stream.cuda_stream)
        known = self._canonical.get(key)
        if known is None:
            if len(self._canonical) >= 4096:  # a bound: a process making streams without end
                self._canonical.clear()
            known = self._canonical[key] = stream
        return known

    def ready(self, device: torch.device) -> bool:
        """Are the kernels loaded on ``device``? Loads them the first time; if that fails (no libNVVM, no
        driver, a compile error), CUDA checksums turn off for the process with one warning saying what
        to install, instead of an exception from inside a loader's lend."""
        if self.off is not None:
            return False
        if device.index in self.loaded:
            return True
        try:
            _kernels().warm(device)
        except Exception as exc:  # KernelsUnavailable, or numba's CudaSupportError from the driver itself
            self.turn_off(exc)
            return False
        self.loaded.add(device.index)
        return True

    def turn_off(self, exc: BaseException) -> None:
        """CUDA checksums off for the process, with one warning that says why: the kernels, the driver or
        a launch failed. Host checksums and the rest of the sanitizer go on."""
        try:
            known = isinstance(exc, _kernels().KernelsUnavailable)
        except Exception:  # cuda_hooks itself cannot load (numba missing or broken)
            known = False
        why = str(exc) if known else f"{type(exc).__name__}: {exc}"
        with self.lock:
            first = self.off is None
            if first:
                self.off = why
        if first:
            warnings.warn(f"ownership-sanitizer: checksums of CUDA tensors are off for this process: {why}",
                          RuntimeWarning, stacklevel=5)

    def table(self, device: torch.device) -> _SlotTable:
        """(Under the lock.) ``device``'s slot table, made at its first lease."""
        table = self.tables.get(device)
        if table is None:
            _read_flags_at_exit()
            table = self.tables[device] = _SlotTable(device)
        return table

    def used(self, stream: Any, region_id: int, data: torch.Tensor) -> None:
        """(Under the lock.) Work was queued on ``stream`` over the staging bytes ``data`` (a view of the
        buffer's own memory): wait for that stream at the next synchronisation, and tell the caching
        allocator once that the stream uses the buffer, so freeing the buffer (a close, on any
        stream) cannot hand its bytes to another allocation while the work is pending."""
        index = stream.device.index
        self.streams[(index, stream.cuda_stream)] = stream
        key = (region_id, index, stream.cuda_stream)
        if key not in self.kept:
            data.record_stream(stream)
            if len(self.kept) > 65536:
                self.kept.clear()  # a bound; recording a stream twice is harmless
            self.kept.add(key)

    def take(self, lease: Lease, device: torch.device) -> Tuple[int, List[Report]]:
        """(Under the lock.) A slot for ``lease``, and the mismatches a synchronisation found on the way."""
        table = self.table(device)
        reports: List[Report] = []
        if not table.free:
            reports = self.drain(device)
            if table.size < table.GROW_BELOW or len(table.free) < table.size // 4:
                table.grow()
        slot = table.free.pop()
        table.leases[slot] = lease
        return slot, reports

    def drain(self, only: Optional[torch.device] = None) -> List[Report]:
        """(Under the lock.) Wait for every stream used since the last call (on ``only``'s device, or all),
        read the flags, clear those that were raised and free the slots of finished leases."""
        reports: List[Report] = []
        for device, table in list(self.tables.items()):
            if only is not None and device != only:
                continue
            for key in [k for k in self.streams if k[0] == device.index]:
                self.streams.pop(key).synchronize()
            hits = torch.nonzero(table.flags).flatten().tolist()  # the streams that wrote them are done
            if hits:
                hashes = table.expected[hits].tolist()
                table.flags.zero_()
                torch.cuda.current_stream(device.index).synchronize()  # cleared before any later verify runs
                to_unsigned = _kernels().to_unsigned
                for slot, value in zip(hits, hashes):
                    lease = table.leases.get(slot)
                    where, event, site = self.pending.pop((device, slot), ("synchronize", None, ()))
                    if lease is not None:
                        reports.append((lease, to_unsigned(int(value)), where, event, site))
            for key in [k for k in self.pending if k[0] == device]:
                del self.pending[key]  # every verify queued before now has been read
            table.recycle()
        return reports

    def expected(self, device: torch.device, slot: int) -> int:
        with self.lock:
            return _kernels().to_unsigned(int(self.tables[device].expected[slot]))


DEVICE_CHECKS = DeviceChecks()


def _report(reports: List[Report], halt: Optional[bool] = None) -> None:
    """File every mismatch; raise the first (``halt`` as in ``raise_or_record``) once the rest are recorded."""
    errors = [(BorrowCorruptedError(lease, expected, None, where, site, event), lease)
              for lease, expected, where, event, site in reports]
    for err, lease in errors[1:]:
        records.raise_or_record(err, lease, False)
    if errors:
        records.raise_or_record(errors[0][0], errors[0][1], halt)


# -- hooks -------------------------------------------------------------------
def on_lend(lease: Lease, view: torch.Tensor) -> None:
    """Take the lease's hash (lend hook): the producer has written its bytes by now."""
    if not state.options.checksum:
        return
    raw = lease_bytes(lease)
    if raw is None:
        return
    hooks = _kernels()
    if not hooks.devices.is_cuda(raw):
        lease.checksum = hooks.checksum_host_tensor(raw)  # no tensor checks: ~4 of the ~7 us around the kernel
        return
    if raw.numel() == 0:
        return  # no byte to change: no device slot, no launch
    checks = DEVICE_CHECKS
    if checks.off is not None:
        return
    reports: List[Report] = []
    try:  # the device-id query, the kernels' load and the launch all talk to the driver
        device = hooks.devices.device_of(raw)
        if graph_capture.capturing(device):
            graph_capture.skipped(f"the checksum of '{lease.name}'")
            return
        if not checks.ready(device):
            return
        with checks.lock:
            slot, reports = checks.take(lease, device)
            table = checks.tables[device]
            try:
                stream = hooks.checksum_into(raw, table.expected, slot)
                checks.used(stream, lease.region_id, raw)
                hashed_on = checks.canonical(stream)  # the hash's stream: a verify elsewhere orders after it
            except BaseException:
                table.leases.pop(slot, None)  # no hash of it will land: the slot is not this lease's
                table.free.append(slot)
                raise
        lease.checksum = (device, slot, hashed_on)
    except Exception as exc:  # never out of a loader's lend: the checks go off, the load goes on
        checks.turn_off(exc)
    _report(reports)


def _check(lease: Lease, where: str, event: Optional[ReuseEvent]) -> bool:
    """Re-hash the lease's bytes; report a mismatch (CPU now, CUDA at the next synchronisation).
    True when a device check was queued."""
    expected = lease.checksum
    if expected is None:
        return False
    raw = lease_bytes(lease)
    if raw is None:
        return False
    hooks = _kernels()
    site = capture(state.options.stack_depth)
    if isinstance(expected, int):
        found = hooks.checksum_host_tensor(raw)
        if found != expected:
            records.raise_or_record(BorrowCorruptedError(lease, expected, found, where, site, event), lease)
        return False
    device, slot, hashed_on = expected
    if graph_capture.capturing(device):
        graph_capture.skipped(f"the {where} check of '{lease.name}'")
        return False
    checks = DEVICE_CHECKS
    if checks.off is not None:
        return False  # the checks went off after this lease was hashed: its verify would need the driver too
    try:
        with checks.lock:  # the tables are never replaced under a launch
            table = checks.tables[device]
            _after_hash(device, hashed_on)
            stream = hooks.verify_into(raw, table.expected, slot, table.flags)
            checks.used(stream, lease.region_id, raw)
            checks.pending[(device, slot)] = (where, event, site)
    except Exception as exc:  # a failed launch: never out of a reuse or a read
        checks.turn_off(exc)
        return False
    return True


def _after_hash(device: torch.device, hashed_on: Any) -> None:
    """Order the work queued next on ``device``'s current stream after the lease's hash, queued on
    ``hashed_on`` at the lend. A consumer's stream that waited only for the producer's "ready" event is
    not ordered after a hash queued on the producer's stream after that event: a verify there could read
    the slot before the hash lands (a false mismatch against zero, or against a recycled slot's old
    hash). A wait between streams, no host synchronisation; nothing when both are one stream."""
    current = torch.cuda.current_stream(device.index)
    if hashed_on is not None and current != hashed_on:
        current.wait_stream(hashed_on)


def on_retire(region: Region, event: ReuseEvent, victims: List[Lease]) -> None:
    """Verify every alive lease a reuse retires (retire hook, order 100)."""
    if not state.options.checksum:
        return
    for lease in victims:
        if lease.checksum is not None:
            _check(lease, "reuse", event)
            lease.checksum = None  # retired: its bytes may now legally change (a device slot frees at the next read)


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
    spans = merge([(l.start, l.end) for l in victims  # (a victim of another buffer over these bytes: not ours)
                   if not l.rescued and l.alive and l.region_id == region.region_id])
    if not spans:
        return
    lo, hi = spans[0][0], spans[-1][1]
    keep = [(l.start, l.end) for l in state.ledger.overlapping(region.region_id, lo, hi)]
    if event.kind == "reuse":
        keep.append((event.start, event.end))
    keep = merge(keep)
    hooks = _kernels()
    if hooks.devices.is_cuda(data) and graph_capture.capturing(hooks.devices.device_of(data)):
        graph_capture.skipped(f"poisoning '{region.name}'")
        return
    for start, end in subtract(spans, keep):
        stream = hooks.poison(data[start:end], opts["poison_byte"])
        if stream is not None:  # a fill queued on a CUDA stream: the buffer must outlive it
            with DEVICE_CHECKS.lock:
                DEVICE_CHECKS.used(stream, region.region_id, data)


# -- public API ----------------------------------------------------------------
def verify(*tensors: torch.Tensor, wait: bool = False) -> None:
    """Check now that the leases behind ``tensors`` still hold the bytes they were lent with.

    A stale lease is a stale use (``StaleBorrowError``); changed bytes are a
    ``BorrowCorruptedError``. On CUDA the comparison is queued on the device and
    reported at the next :func:`synchronize`; ``wait=True`` synchronises once
    at the end when a device check was queued, so a change raises here as on
    CPU. Tensors that are not leases are skipped. Needs ``checksum=1`` for the
    byte check; the staleness check always runs.
    """
    if verify_queued(tensors) and wait:
        synchronize()


def verify_queued(tensors: Iterable[torch.Tensor]) -> bool:
    """:func:`verify` without waiting: True when a device check was queued (read at the next
    :func:`synchronize`); host checks have raised or recorded by the time it returns."""
    queued = False
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"verify expects tensors, got {type(t).__name__}")
        if check_not_stale(t, "sanitizer.verify"):
            continue
        lease = runtime.lease_of(t)
        if lease is None or lease.stale_by is not None:
            continue
        queued = _check(lease, "verify", None) or queued
    return queued


def synchronize(halt: Optional[bool] = None) -> None:
    """Wait for the device checks queued since the last call, on every stream they ran on, read the
    mismatch flags (a host synchronisation) and report what they say (every mismatch is filed; the
    first raises, ``halt`` as in :func:`~sanitizer.torch_layer.records.raise_or_record`)."""
    checks = DEVICE_CHECKS
    if not checks.tables:
        return
    if any(graph_capture.capturing(device) for device in list(checks.tables)):
        graph_capture.skipped("reading the device checksum flags")  # a synchronisation would invalidate it
        return
    with checks.lock:
        reports = checks.drain()
    _report(reports, halt)


def expected_hash(lease: Lease) -> Optional[int]:
    """The hash taken of ``lease``'s bytes when it was lent (None: not checksummed, or retired). Reading
    a device slot is a host synchronisation: for tests and tools, not hot paths."""
    taken = lease.checksum
    if taken is None or isinstance(taken, int):
        return taken
    device, slot, hashed_on = taken
    if hashed_on is not None:
        hashed_on.synchronize()  # the hash may still be queued on its own stream, not the current one
    return DEVICE_CHECKS.expected(device, slot)


_exit_hook = threading.Lock()
_exit_hooked: List[bool] = []


def _read_flags_at_exit() -> None:
    """Device flags are read at exit at the latest (registered with the first slot table)."""
    with _exit_hook:
        if not _exit_hooked:
            atexit.register(_synchronize_at_exit)
            _exit_hooked.append(True)


def _synchronize_at_exit() -> None:
    if not DEVICE_CHECKS.tables:
        return
    try:
        synchronize(halt=False)  # at exit, record: no caller to raise to
    except Exception as exc:  # a torn-down CUDA context must not turn exit into a traceback
        print(f"ownership-sanitizer: device checksum flags unreadable at exit: {exc}", file=sys.stderr)


def _on_enable(options: Options) -> None:
    """``enable(checksum=1)`` in a process already using CUDA: load the kernels on the current device now,
    so the first lend does not pay for it and no graph captured later can see a module load; on CPU, load the
    hash numba stored as machine code (``cuda_hooks.machine_code``: ~0.03 s, never numba itself). And import the
    kernels' package (a few ms, no numba) here, in the enabling thread: a worker thread's first lend then only
    loads numba, under cuda_hooks' loading lock, which a fork waits for (a fork during an import of the package
    itself would leave the child its module lock, held forever)."""
    if options.checksum or options.poison:
        hooks = _kernels()
        if options.checksum:
            hooks.warm_host()  # the stored CPU hash (~0.03 s, never numba): not inside the first lend
    if not options.checksum or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return  # (a process not using CUDA yet is left alone: initialising CUDA here would break a later fork)
    device = torch.device("cuda", torch.cuda.current_device())
    if not graph_capture.capturing(device):
        DEVICE_CHECKS.ready(device)


def install() -> None:
    """Plug the checks into lending and retirement (idempotent; cheap while the options are off)."""
    add_enable_hook(_on_enable)
    add_lend_hook(on_lend)
    add_retire_hook(on_retire, RetireOrder.VERIFY)
    add_retire_hook(on_poison, RetireOrder.POISON)


def reset_device_state() -> None:
    """Forget the slot tables, the streams checks ran on, the pending verifies and why checks went off:
    the state a new process starts with. For a test harness between tests, or after the devices were
    reset (the tables are device memory of the old context)."""
    DEVICE_CHECKS.__init__()


@forking.in_child
def _after_fork() -> None:
    """A forked child starts with fresh locks and no device state: the slot tables are the parent's CUDA
    memory, which a forked child cannot use (nor read at its exit)."""
    global _exit_hook
    _exit_hook = threading.Lock()
    DEVICE_CHECKS.__init__()


__all__ = ["verify", "verify_queued", "synchronize", "expected_hash", "install", "on_lend", "on_retire", "on_poison",
           "DeviceChecks", "DEVICE_CHECKS", "reset_device_state"]
