"""InstantTensor: ``safe_open(..., copy=False).tensors()`` yields views of a device ring.

Its contract (``safe_open`` docstring): consume each tensor before the next
yield; the ring is freed on ``__exit__``. That is ``lifetime=1``, and exiting
first ends the leases of an iterator still open, while the ring is there.
Some tensors silently fall back to owned clones (unaligned ones); they are
held to the same contract, which is what a consumer must assume. CUDA only:
this path runs where InstantTensor runs.
"""
from __future__ import annotations

import functools
from typing import Any

from .. import runtime
from ..iterators import borrowed_iterator
from . import close_open, replace, track_open

NAME = "instanttensor"


def wanted() -> bool:
    return True


def patch(module: Any) -> None:
    cls = module.safe_open
    tensors, exit_ = cls.tensors, cls.__exit__

    @functools.wraps(tensors)
    def patched_tensors(self, *args: Any, **kwargs: Any) -> Any:
        iterator = tensors(self, *args, **kwargs)
        if getattr(self, "copy", True) is False and runtime.state.enabled:
            return track_open(self, borrowed_iterator(iterator, lifetime=1, name=NAME))
        return iterator

    @functools.wraps(exit_)
    def patched_exit(self, *exc: Any) -> Any:
        close_open(self)
        return exit_(self, *exc)

    replace(cls, "tensors", patched_tensors)
    replace(cls, "__exit__", patched_exit)
