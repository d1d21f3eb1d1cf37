"""Exports of live borrowed memory: aliases the sanitizer cannot check, seen as they are made.

``t.numpy()``, ``np.asarray(t)``, ``torch.from_numpy(t.numpy())``, ``torch.from_dlpack(t)``,
``np.from_dlpack(t)``, ``memoryview``/``torch.frombuffer`` over such an array: each gives
another library (or a new tensor with a storage of its own) the *staging bytes* themselves.
Reads through it never reach aten, and they do not follow the lease's storage: when the
guard re-points a retained lease to a tombstone, or rescue moves it onto a copy, the alias
still reads the staging bytes, that is, the next tensor. So the sanitizer watches the exporters
(while enabled, from the first lend until no lease nor buffer is left: the runtime's export hook) and keeps, per lease, each alias
with where it was made. Triage then names such an alias among the holders of a retention (the
walk starts from the alias too: ``kept[0] (a numpy alias of the view)``), its record lists every
alias still alive and where it was made, a stale use of the lease says so, and a rescue record
says which aliases it could not rescue.

An alias is alive while its object is (an ndarray takes a weak reference); a DLPack capsule
cannot, but its consumer keeps the lease's storage alive through the capsule's manager, so it
counts as alive while the lease is. Records are bounded: a few aliases per lease, dropped with
the lease.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from sanitizer.core import forking
from sanitizer.core.ledger import Lease
from sanitizer.core.sites import capture_excluding, to_records, torch_dir
from sanitizer.torch_layer.hooks import add_export_hook, add_release_hook
from sanitizer.torch_layer.state import state

PER_LEASE = 4  # aliases kept per lease (the first ones: where the export pattern starts)
_KINDS = {"Tensor.numpy": "numpy", "Tensor.__array__": "numpy", "Tensor.__dlpack__": "dlpack",
          "torch.utils.dlpack.to_dlpack": "dlpack", "torch.to_dlpack": "dlpack",
          # what makes a new object over an export's memory: that object is the alias
          "torch.from_dlpack": "dlpack", "torch.utils.dlpack.from_dlpack": "dlpack", "torch.from_numpy": "numpy",
          "numpy.from_dlpack": "dlpack"}


@dataclass
class Alias:
    """One export of a fresh lease's memory."""

    kind: str  # "numpy" or "dlpack"
    where: str  # the exporter that made it
    made_at: List[dict]  # the user's stack at the export (frame records)
    ref: Optional[Callable[[], Any]]  # a weak reference to the alias object (None: a capsule)

    def alive(self) -> bool:
        return self.ref is None or self.ref() is not None

    def obj(self) -> Any:
        return None if self.ref is None else self.ref()

    def to_dict(self) -> Dict[str, Any]:
        return {"kind": self.kind, "made_by": self.where, "made_at": (self.made_at or [None])[0],
                "stack": self.made_at}


class AliasLog:
    """The aliases of each alive lease (own lock; the release hook only pops a dict entry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_lease: Dict[int, List[Alias]] = {}

    def on_export(self, lease: Lease, where: str, result: Any) -> None:
        try:
            ref: Optional[Callable[[], Any]] = weakref.ref(result)
        except TypeError:  # a DLPack capsule: no weak reference (alive while the lease is)
            ref = None
        made_at = to_records(capture_excluding(state.options.stack_depth, (torch_dir(),)))
        alias = Alias(_KINDS.get(where, where), where, made_at, ref)
        with self._lock:
            kept = self._by_lease.setdefault(lease.lease_id, [])
            kept[:] = [a for a in kept if a.alive()]
            if len(kept) < PER_LEASE:
                kept.append(alias)

    def on_release(self, lease: Lease) -> None:
        self._by_lease.pop(lease.lease_id, None)  # (a dict pop: safe inside the GC)

    def live(self, lease_id: int) -> List[Alias]:
        """The aliases of a lease that are still alive."""
        with self._lock:
            return [a for a in self._by_lease.get(lease_id, ()) if a.alive()]


LOG = AliasLog()


def live(lease_id: int) -> List[Alias]:
    return LOG.live(lease_id)


def records_of(lease_id: int) -> List[Dict[str, Any]]:
    """JSON-ready records of a lease's live aliases (for retention and rescue records)."""
    return [a.to_dict() for a in LOG.live(lease_id)]


def _on_export(lease: Lease, where: str, result: Any) -> None:
    LOG.on_export(lease, where, result)


def _on_release(lease: Lease) -> None:
    LOG.on_release(lease)


def install() -> None:
    """Watch exports of fresh leases (idempotent). Called by :func:`sanitizer.activation.compose`."""
    add_export_hook(_on_export)
    add_release_hook(_on_release)


@forking.in_child
def _after_fork() -> None:
    LOG._lock = threading.Lock()


__all__ = ["Alias", "AliasLog", "LOG", "live", "records_of", "install", "PER_LEASE"]
