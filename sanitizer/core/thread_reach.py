"""Run a function once in each thread that is already running (Python 3.12+).

A dispatch mode can only be pushed by the thread that owns the stack, so
threads started before ``enable()`` are out of the sanitizer's reach, unless
each of them can be made to run a little code of ours. Python 3.12 added
``threading.setprofile_all_threads``: a profile function set in every running
thread. Ours runs at the thread's next Python call or return, removes itself
from that thread (``sys.setprofile(None)`` acts on the current thread only)
and calls ``fn``. A thread blocked in C reaches it when it next runs Python; a
thread that never does never pays anything.

It refuses (returns False) on older Pythons and when a profiler is already set
in the calling thread or for new threads: a per-thread profile function would
replace another tool's. Torch-free, so it is tested on Pythons without torch.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable

AVAILABLE: bool = hasattr(threading, "setprofile_all_threads")


def run_in_running_threads(fn: Callable[[], None]) -> bool:
    """Arrange for ``fn()`` to run once in every other running thread; False when not possible."""
    if not AVAILABLE or sys.getprofile() is not None or threading.getprofile() is not None:
        return False
    caller = threading.get_ident()

    def _once(frame, event, arg):  # type: ignore[no-untyped-def]
        sys.setprofile(None)  # this thread only: run once
        if threading.get_ident() != caller:
            try:
                fn()
            except Exception:  # never raise into a thread's arbitrary call
                pass

    threading.setprofile_all_threads(_once)  # type: ignore[attr-defined]
    threading.setprofile(None)  # new threads are not "running threads": the start hook handles them
    sys.setprofile(None)
    return True


__all__ = ["AVAILABLE", "run_in_running_threads"]
