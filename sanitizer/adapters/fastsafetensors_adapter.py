"""fastsafetensors 0.5: ``ParallelLoader(..., borrowed_tensors=True)`` yields views of batch buffers.

Its contract (``iterate_weights`` docstring): complete all use of a yielded
tensor before advancing or closing the iterator; each batch's buffer is freed
once the iterator moves past its last tensor. That is ``lifetime=1``. With
``borrowed_tensors=False`` the loader yields clones, which are left alone.
"""
from __future__ import annotations

import functools
from typing import Any

from sanitizer.torch_layer import runtime
from sanitizer.torch_layer.iterators import borrowed_iterator
from sanitizer.adapters import replace

NAME = "fastsafetensors"


def wanted() -> bool:
    return True


def wrap(loader: Any, iterator: Any) -> Any:
    """``iterator`` (from ``loader.iterate_weights()``) under lease tracking when the loader borrows."""
    if getattr(loader, "borrowed_tensors", False) and runtime.state.enabled:
        return borrowed_iterator(iterator, lifetime=1, name=NAME)
    return iterator


def patch(module: Any) -> None:
    cls = module.PipelineParallel  # ParallelLoader subclasses it
    original = cls.iterate_weights

    @functools.wraps(original)
    def iterate_weights(self, *args: Any, **kwargs: Any) -> Any:
        return wrap(self, original(self, *args, **kwargs))

    replace(cls, "iterate_weights", iterate_weights)
