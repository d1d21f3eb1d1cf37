"""Each trapped lease's window, by lease: shared by the CPU trap (``trap.py``) and the CUDA one
(``trap_cuda.py``), whose memories differ in how a window is made and replaced, not in how it is found."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List

from sanitizer.core.ledger import Lease


class WindowsByLease:
    """Each lease's window, weakly (a window lives as long as its lease's tensor and aliases do)."""

    def __init__(self) -> None:
        self._windows: Dict[int, "weakref.ref[Any]"] = {}  # lease id -> its window

    def attach(self, lease: Lease, window: Any) -> None:
        self._windows[lease.lease_id] = weakref.ref(window)

    def window(self, lease: Lease) -> Any:
        ref = self._windows.get(lease.lease_id)
        window = None if ref is None else ref()
        if window is None:
            self._windows.pop(lease.lease_id, None)
        return window

    def _live_windows(self) -> List[Any]:
        return [w for w in (ref() for ref in list(self._windows.values())) if w is not None]


__all__ = ["WindowsByLease"]
