"""The process-wide facts every part of the runtime reads: options, the switch, the ledger, the lookups.

One object, :data:`state`, so that the modules of the torch layer (leases in
``runtime``, records in ``records``, the stale-use path in ``stale_use``, the
per-op interception in ``interception``) share facts without importing each
other. It holds data, not behaviour: who may change what is said field by field.

The two dicts keyed by storage address are the only state the per-op path
reads, without a lock (a dict lookup is atomic).
"""
from __future__ import annotations

import threading
from typing import Dict

from sanitizer.core import forking
from sanitizer.core import options as _opts
from sanitizer.core.ledger import Lease, Ledger


class RuntimeState:
    """What the sanitizer knows right now (one instance per process)."""

    def __init__(self) -> None:
        # Replaced (never mutated: Options is frozen) only by runtime.arm/override and activation.
        self.options: _opts.Options = _opts.resolve({})
        self.enabled = False  # set only by runtime.arm / runtime.disarm
        self.ledger = Ledger()
        # Alive leases are filed in the ledger under their storage's address (``ledger.lease(key)``).
        # Written only by runtime (a reuse, a death, a rescue); read lock-free by the per-op path.
        self.stale: Dict[int, Lease] = {}  # storage address -> alive *stale* lease
        self.lock = threading.RLock()  # guards the writes above that are not single dict operations
        # `with sanitizer.sanitize(...)` blocks open now (written only by activation.sanitize): a block's
        # findings are its caller's to read (sanitizer.errors()), not the process's to print at the user
        self.scopes = 0


state = RuntimeState()


@forking.in_child
def _after_fork() -> None:
    state.lock = threading.RLock()
    state.ledger.after_fork_in_child()

__all__ = ["RuntimeState", "state"]
