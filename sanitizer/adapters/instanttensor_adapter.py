"""InstantTensor: ``safe_open(..., copy=False).tensors()`` yields views of a device ring.

Its contract (``safe_open`` docstring): consume each tensor before the next
yield; the ring is freed on ``__exit__``. That is ``lifetime=1``, and exiting
first ends the leases of an iterator still open, while the ring is there.
Some tensors silently fall back to owned clones (unaligned ones); they are
held to the same contract, which is what a consumer must assume. CUDA only:
this path runs where InstantTensor runs.
"""
from __future__ import annotations

from typing import Any

from sanitizer.adapters import lease_iterators

NAME = "instanttensor"


def wanted() -> bool:
    return True


def patch(module: Any) -> None:
    lease_iterators(module.safe_open, "tensors", lambda self: getattr(self, "copy", True) is False, NAME)
