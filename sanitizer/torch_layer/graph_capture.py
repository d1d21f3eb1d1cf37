"""CUDA graph capture: is one under way on the current stream, and the one warning when device work is skipped.

While a stream captures a CUDA graph, work queued on it is recorded into the
user's graph instead of running (a checksum kernel or a rescue copy would run
only at each replay, a poison fill would poison the replayed graph's buffers),
a host synchronisation or a module load invalidates the capture, and
allocations come from the graph's private pool. So on CUDA memory, while the
current stream of its device captures, the sanitizer's device work skips:
checksums are neither taken nor verified, poison is not written, rescue and
the guard leave the lease stale as without them, and :func:`synchronize`
leaves the flags for its next call. The dispatch mode still reports every
stale use (it runs on the host, outside the graph). One ``RuntimeWarning``
says so, once per process.

Why skip rather than refuse: raising from a lend or a reuse inside a capture
breaks a correct program's capture, and "never harm the program" comes first;
the skipped checks are named in the warning, so nothing stops silently.

Limits: the query is torch's ``is_current_stream_capturing()``, about the
current stream of a device. A capture in ``global`` mode on *another* thread
also forbids this thread's synchronisations; the sanitizer cannot see that
one (torch does not expose it), so a ``synchronize()`` from another thread
during it fails as any synchronisation would.
"""
from __future__ import annotations

import threading
import warnings
from typing import Optional

import torch

from sanitizer.core import forking

__all__ = ["capturing", "skipped", "reset_device_state"]

_lock = threading.Lock()
_warned = False


def capturing(device: Optional[torch.device] = None) -> bool:
    """Is the current stream of ``device`` (default: the current device) capturing a graph?

    Ask only about CUDA memory: on a torch built without CUDA the query itself raises."""
    if device is None or device.index is None or device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device.index):
        return torch.cuda.is_current_stream_capturing()


def skipped(what: str) -> None:
    """Warn, once per process, that device work was skipped because of a capture (``what`` names it)."""
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"ownership-sanitizer: a CUDA graph is being captured on the current stream, so {what} and the "
                  "rest of the sanitizer's device work (checksum, poison, rescue, guard, reading device flags) "
                  "skip the CUDA leases lent and retired during captures; stale uses are still reported "
                  "(said once)", RuntimeWarning, stacklevel=3)


def reset_device_state() -> None:
    """Say the capture warning again at the next skip (it is once per process: a test harness resets it
    between tests)."""
    global _warned
    with _lock:
        _warned = False


@forking.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()
