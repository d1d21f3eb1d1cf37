"""Fork safety: each module gives its own locks (and per-process state) a fresh start in a forked child.

A child forked while another thread of the parent held one of the sanitizer's
locks would inherit that lock held, by a thread that does not exist in the
child: its first lend would wait forever. Acquiring every lock before the fork
is no answer here (a finalizer run by the GC can take them in any order, so a
fixed acquisition order could itself deadlock), so each module registers, at
import, a function that replaces its own locks in the child and drops what
belongs to the parent process (its records, its pending decisions). Torch-free.
"""
from __future__ import annotations

import os
from typing import Callable, List

_children: List[Callable[[], None]] = []


def _run_in_child() -> None:
    for fn in list(_children):
        try:
            fn()
        except Exception:  # a child must start even if one module could not reset itself
            pass


def in_child(fn: Callable[[], None]) -> Callable[[], None]:
    """Run ``fn()`` in every child this process forks, right after the fork (before any other code);
    usable as a decorator. Registration order is run order."""
    if not _children and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_run_in_child)
    _children.append(fn)
    return fn


__all__ = ["in_child"]
