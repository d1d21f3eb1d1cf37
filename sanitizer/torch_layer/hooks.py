"""The runtime's hook slots: where a feature plugs into a lend, a reuse, a retirement, a death, a stale use.

The runtime calls these and knows nothing of who listens (checksums, rescue,
triage, the guard, the timeline). Each slot is a list that registration
*replaces* (copy on write), so a hot path iterates a list that no other thread
mutates under it, without a lock. Registration is idempotent.

Kinds, in the order a lease meets them:

* **enable** ``(options)``: :func:`sanitizer.enable` resolved its options (a feature arms itself);
* **lend** ``(lease, view)``: after a lend while enabled (take its checksum);
* **reuse** ``(region, event)``: every reuse, retire and close, whether or not it retired a live lease;
* **retire** ``(region, event, victims)``: a reuse or close retires alive leases, before the producer
  writes; run in :class:`RetireOrder`; a hook may rescue a victim, the rest become stale;
* **stale use** ``(lease, use)``: a stale lease is about to be read or written (``use`` says where and
  how), *before* the error is built; a hook may return the holder of the lease (a plain dict),
  which goes into the error as a value;
* **export** ``(lease, where, result)``: a fresh lease's memory was handed to another library
  (``numpy()``, ``__array__``, DLPack); ``result`` is what the export returned (an ndarray, a capsule);
* **record** ``(kind, record)``: an error or an event was kept (``kind`` is ``"error"`` or ``"event"``);
  a journal writes it as it happens. Never raises;
* **recovered** ``(error)``: an error was recorded and let go (``halt_on_error=0``, ``triage=1``): the
  program goes on; the error object itself, rendered as a raised one would be. Never raises;
* **release** ``(lease)``: the lease's storage died (every view of it gone), rescued leases too. It
  runs wherever the last reference went, possibly inside the GC: keep it cheap and lock-free.
"""
from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from sanitizer.core import forking
from sanitizer.core.ledger import Lease, Region, ReuseEvent
from sanitizer.core.options import Options
from sanitizer.core.sites import Site


class RetireOrder(enum.IntEnum):
    """Where each feature's retire hook runs (ascending), declared once."""

    VERIFY = 100  # checksums: verify the borrowed bytes before anything else
    RESCUE = 200  # rescue: copy victims out before the producer writes
    TRIAGE = 300  # triage: record who still holds the victims
    TRAP = 340  # trap mode: remap what is still alive in place (poison or no access)
    GUARD = 350  # guard: re-point what is still held to a poison tombstone
    POISON = 400  # checksums: poison what is left stale


@dataclass(frozen=True)
class StaleUse:
    """A use of a stale lease, as the stale-use hooks see it (before the error exists)."""

    op: str  # the aten op or the reader (``aten.sum.default``, ``Tensor.tolist``)
    used_at: Site  # the user's stack at the use
    used_as: Optional[Dict[str, Any]]  # {"dtype", "shape"} of the view that was used
    thread: str


EnableHook = Callable[[Options], None]  # the options in force (typed: options.rescue)
LendHook = Callable[[Lease, Any], None]
ReuseHook = Callable[[Region, ReuseEvent], None]
RetireHook = Callable[[Region, ReuseEvent, List[Lease]], None]
StaleUseHook = Callable[[Lease, StaleUse], Optional[Dict[str, Any]]]
ExportHook = Callable[[Lease, str, Any], None]
ReleaseHook = Callable[[Lease], None]
RecordHook = Callable[[str, Dict[str, Any]], None]
OpErrorHook = Callable[[BaseException], None]
RecoveredHook = Callable[[BaseException], None]


class HookSlots:
    """The registries. Read the lists directly on hot paths; register through the ``add_*`` methods."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.enable: List[EnableHook] = []
        self.lend: List[LendHook] = []
        self.reuse: List[ReuseHook] = []
        self.retire: List[Tuple[int, RetireHook]] = []  # (order, hook), ascending
        self.stale_use: List[StaleUseHook] = []
        self.export: List[ExportHook] = []
        self.release: List[ReleaseHook] = []
        self.record: List[RecordHook] = []
        self.op_error: List[OpErrorHook] = []  # an op raised under the dispatch mode (its own error, not ours)
        self.recovered: List[RecoveredHook] = []  # an error recorded and let go (halt_on_error=0)

    def _add(self, slot: str, hook: Any) -> None:
        with self._lock:
            current = getattr(self, slot)
            if hook not in current:
                setattr(self, slot, current + [hook])

    def add_enable(self, hook: EnableHook) -> None:
        """``hook(resolved_options)`` at each enable, in registration order."""
        self._add("enable", hook)

    def add_lend(self, hook: LendHook) -> None:
        self._add("lend", hook)

    def add_reuse(self, hook: ReuseHook) -> None:
        self._add("reuse", hook)

    def add_retire(self, hook: RetireHook, order: RetireOrder) -> None:
        with self._lock:
            if all(h is not hook for _, h in self.retire):
                self.retire = sorted(self.retire + [(int(order), hook)], key=lambda pair: pair[0])

    def add_stale_use(self, hook: StaleUseHook) -> None:
        self._add("stale_use", hook)

    def add_export(self, hook: ExportHook) -> None:
        self._add("export", hook)

    def add_release(self, hook: ReleaseHook) -> None:
        self._add("release", hook)

    def add_record(self, hook: RecordHook) -> None:
        self._add("record", hook)

    def add_op_error(self, hook: OpErrorHook) -> None:
        """``hook(exc)`` for each exception an op raises under the dispatch mode (TorchScript drops the
        text of an exception raised from Python inside a scripted call: script_calls keeps it)."""
        self._add("op_error", hook)

    def add_recovered(self, hook: "RecoveredHook") -> None:
        """``hook(error)`` for each error recorded and let go (not raised): recover mode speaks through it."""
        self._add("recovered", hook)

    def discard(self, hook: Any) -> None:
        """Take ``hook`` out of every slot (a benchmark measuring the runtime without one feature)."""
        with self._lock:
            for slot in ("enable", "lend", "reuse", "stale_use", "export", "release", "record", "op_error",
                         "recovered"):
                setattr(self, slot, [h for h in getattr(self, slot) if h is not hook])
            self.retire = [pair for pair in self.retire if pair[1] is not hook]


HOOKS = HookSlots()


@forking.in_child
def _after_fork() -> None:
    HOOKS._lock = threading.Lock()

add_enable_hook = HOOKS.add_enable
add_lend_hook = HOOKS.add_lend
add_reuse_hook = HOOKS.add_reuse
add_retire_hook = HOOKS.add_retire
add_stale_use_hook = HOOKS.add_stale_use
add_export_hook = HOOKS.add_export
add_release_hook = HOOKS.add_release
add_record_hook = HOOKS.add_record
add_op_error_hook = HOOKS.add_op_error
add_recovered_hook = HOOKS.add_recovered

__all__ = ["RetireOrder", "StaleUse", "HookSlots", "HOOKS", "add_enable_hook", "add_lend_hook", "add_reuse_hook",
           "add_retire_hook", "add_stale_use_hook", "add_export_hook", "add_release_hook", "add_record_hook",
           "add_op_error_hook", "add_recovered_hook"]
