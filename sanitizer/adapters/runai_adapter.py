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

from sanitizer.adapters import lease_iterators, replace

NAME = "runai-model-streamer"


def wanted() -> bool:
    return True


def patch(module: Any) -> None:
    cls = module.SafetensorsStreamer
    stream_files = cls.stream_files
    signature = inspect.signature(stream_files)

    @functools.wraps(stream_files)
    def patched_stream_files(self, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        self._ownsan_borrowed = not bound.arguments.get("owned", True)
        return stream_files(self, *args, **kwargs)

    replace(cls, "stream_files", patched_stream_files)
    lease_iterators(cls, "get_tensors", lambda self: getattr(self, "_ownsan_borrowed", False), NAME)
