"""runai-model-streamer 0.17: ``stream_files(..., owned=False)`` yields views of a reused slot pool.

Its contract (``stream_files`` docstring): each tensor must be consumed before
the iteration advances, so ``lifetime=1``. The pool (bounded by
``RUNAI_STREAMER_MEMORY_LIMIT``) is freed when the streamer exits, so exiting
first ends the leases of any iterator still open, while the pool is there.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from .. import runtime
from ..iterators import borrowed_iterator
from . import close_open, replace, track_open

NAME = "runai-model-streamer"


def wanted() -> bool:
    return True


def patch(module: Any) -> None:
    cls = module.SafetensorsStreamer
    stream_files, get_tensors, exit_ = cls.stream_files, cls.get_tensors, cls.__exit__
    signature = inspect.signature(stream_files)

    @functools.wraps(stream_files)
    def patched_stream_files(self, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        self._ownsan_borrowed = not bound.arguments.get("owned", True)
        return stream_files(self, *args, **kwargs)

    @functools.wraps(get_tensors)
    def patched_get_tensors(self, *args: Any, **kwargs: Any) -> Any:
        iterator = get_tensors(self, *args, **kwargs)
        if getattr(self, "_ownsan_borrowed", False) and runtime.state.enabled:
            return track_open(self, borrowed_iterator(iterator, lifetime=1, name=NAME))
        return iterator

    @functools.wraps(exit_)
    def patched_exit(self, *exc: Any) -> Any:
        close_open(self)
        return exit_(self, *exc)

    replace(cls, "stream_files", patched_stream_files)
    replace(cls, "get_tensors", patched_get_tensors)
    replace(cls, "__exit__", patched_exit)
