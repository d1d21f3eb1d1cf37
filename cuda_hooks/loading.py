"""One lock around whatever loads a kernel (numba's import, a compile or a disk-cache load), held across a fork.

A fork copies every lock some other thread holds at that instant, and the child has no thread to release it.
A program forking while one of its worker threads took the sanitizer's first checksum (which imports numba:
the import holds ``cuda_hooks.cpu``'s module lock; the first call compiles: numba's compiler lock) left the
child stuck forever at its own first checksum (a user's fuzz, 4 loader threads and a fork under
``checksum=1``: 8 children hung in 8 runs). So every load runs under this lock, and a fork waits until no
load is under way (``os.register_at_fork``'s *before*, bounded by :data:`WAIT_S`: a load stuck elsewhere
must not hang the fork itself), then the child starts with a lock of its own.

"Python 3.7+: ``os.register_at_fork(before=...)`` callables are called before forking a child process",
in the forking thread, and ``after_in_parent`` / ``after_in_child`` after it (the os module's docs).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Iterator

WAIT_S = 30.0  # the longest a fork waits for a load under way in another thread (numba's import: ~0.2-0.5 s)

_lock = threading.RLock()
_taken = threading.local()  # (per forking thread) whether its before-fork acquired the lock


@contextmanager
def loading() -> Iterator[None]:
    """Around a kernel load (an import of numba's modules, a first call that compiles): a fork waits for it."""
    lock = _lock  # (a child replaces it: each use reads the current one)
    with lock:
        yield


def _before_fork() -> None:
    _taken.lock = _lock if _lock.acquire(timeout=WAIT_S) else None


def _after_fork_in_parent() -> None:
    lock = getattr(_taken, "lock", None)
    _taken.lock = None
    if lock is not None:
        lock.release()


def _after_fork_in_child() -> None:
    global _lock, _taken
    _lock = threading.RLock()  # the parent's is held by the thread that forked (this one) and maybe others
    _taken = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


__all__ = ["loading", "WAIT_S"]
