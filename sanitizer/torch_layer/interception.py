"""Where checking happens: the dispatch mode in each thread and the reader hooks, and when they are on.

Main-thread interception runs from the first stale lease until none is stale
*and* no lease is alive. The hysteresis matters for a consumer that holds each
tensor until the next one arrives (a loop variable): every reuse makes the
previous lease stale and its death a moment later clears it; toggling the mode
and the reader hooks per tensor would cost more than keeping them for the rest
of the load. A correct program never pays at all.

On Python 3.11+ other threads follow the main thread's rule (re-armed in every
running thread at the first stale lease); on 3.10, they get the mode when they
start while the sanitizer is enabled, or when they lend, and keep it (see
:class:`~sanitizer.torch_layer.mode.ModeController`).

Exports of a fresh lease's memory (``numpy()``, ``__array__``, DLPack) are told
to the export hooks while the sanitizer is enabled, from a lease's lend until no
lease is alive and no staging buffer is left (a ring load lends again at once):
an alias made then points at the staging bytes themselves, where neither the
mode nor the guard can follow it.
"""
from __future__ import annotations

import threading
from typing import Any

from sanitizer.core import forking, thread_reach
from sanitizer.torch_layer import readers
from sanitizer.torch_layer.aliasing import storage_key
from sanitizer.torch_layer.hooks import HOOKS
from sanitizer.torch_layer.mode import ModeController
from sanitizer.torch_layer.stale_use import check_not_stale, check_storage_not_stale, report_stale_use
from sanitizer.torch_layer.state import state

MODES = ModeController(state.stale, report_stale_use)


class _Interception:
    """Whether the main thread and the reader hooks are intercepting now (written under ``_lock``)."""

    def __init__(self) -> None:
        self.on = False
        self.exports = False  # the exporters tell the export hooks
        self.lock = threading.RLock()


_now = _Interception()


def intercepting() -> bool:
    return _now.on


def _wanted() -> bool:
    return state.enabled and (bool(state.stale) or (_now.on and state.ledger.live_count > 0))


def sync() -> None:
    """Install or remove main-thread interception (and the reader hooks) as :func:`_wanted` says.

    Called after every change of what it reads; cheap when nothing flips."""
    if _wanted() == _now.on:
        return
    with _now.lock:
        want = _wanted()
        if want == _now.on:
            return
        _now.on = want
        readers.set_hooks(want, check_not_stale, check_storage_not_stale)
    MODES.sync_main(_wanted)
    MODES.sync_workers(_wanted)


def stale_marked() -> None:
    """New leases went stale: intercept, and wrap the writers imported since the last stale lease.

    The thread that marked them gets its mode now, whatever the others do: it is the likeliest to read
    them next (a loader that reuses and then reads what it kept), and when interception was already on
    it would otherwise count on the thread that turned it on, which may not have reached this thread
    yet (Python 3.12+ arms running threads at their next call; the main thread's install may be queued).
    That race missed 1 stale read in 3,000 on 3.12 (tests/torch_layer/test_processes.py)."""
    sync()
    if _now.on:
        readers.set_hooks(True, check_not_stale, check_storage_not_stale)
        if not MODES.installed_here():
            MODES.install_here()


def lease_died_or_disowned() -> None:
    """A lease stopped being borrowed: the hysteresis may end (no stale lease and none alive)."""
    if state.ledger.live_count == 0:
        if _now.on:
            sync()
        if _now.exports:
            sync_exports()


def _exports_wanted() -> bool:
    """While a lease is alive; and, once on, while a staging buffer is registered. Without that hysteresis
    a ring load whose consumer copies each tensor out (no lease alive between two puts) wrapped and
    restored every exporter at every tensor, which cost more than its checksums. A wrapped exporter costs
    one dict look-up per ``numpy()``/DLPack call."""
    if not (state.enabled and HOOKS.export):
        return False
    ledger = state.ledger
    return ledger.live_count > 0 or (_now.exports and ledger.region_count > 0)


def regions_changed() -> None:
    """A staging buffer was closed or forgotten: the exporters' hysteresis may end. While disabled, a wrapper
    a user's patch covered when we let go (and the user's restore put back on top) goes now."""
    if _now.exports and state.ledger.live_count == 0:
        sync_exports()
    elif not state.enabled:
        readers.sweep()


def sync_exports() -> None:
    """Tell the export hooks of exports (or stop) as :func:`_exports_wanted` says."""
    with _now.lock:
        want = _exports_wanted()
        if want != _now.exports:
            _now.exports = want
            readers.set_export_notes(want, _on_export)


def _on_export(tensor: Any, where: str, result: Any) -> None:
    """An exporter ran: a fresh lease's memory now has an alias the sanitizer cannot follow."""
    try:
        lease = state.ledger.lease(storage_key(tensor))
    except (RuntimeError, NotImplementedError):
        return
    if lease is None or lease.stale_by is not None:
        return  # not borrowed; or stale (the stale check reported the export itself)
    for hook in HOOKS.export:
        hook(lease, where, result)


def on_lend() -> None:
    """A lend while enabled: a lending thread other than main keeps a mode until it ends (its consumers
    may read there after the reuse); the main thread follows the stale set instead."""
    if not _now.exports and HOOKS.export:
        sync_exports()
    MODES.retry_leave()
    if not MODES.lazy_workers and not MODES.installed_here() \
            and threading.current_thread() is not threading.main_thread():
        MODES.install_here()


def arm(on: bool) -> None:
    """Enable or disable checking in every thread (modes of other threads go inert when off)."""
    MODES.arm(on)
    if on:
        if not MODES.hook_threads_done():
            MODES.lazy_workers = thread_reach.AVAILABLE
        MODES.hook_threads(lambda: state.enabled and (not MODES.lazy_workers or _now.on))
    else:
        MODES.unhook_threads()
    sync()
    sync_exports()
    readers.sweep()  # a wrapper a user's patch covered when we let go, and the user's restore put back on top
    if not on:
        MODES.sync_main(_wanted)
        MODES.sync_workers(_wanted)  # (3.12+: other threads drop theirs too)


retry_leave = MODES.retry_leave


@forking.in_child
def _after_fork() -> None:
    _now.lock = threading.RLock()
    MODES.after_fork_in_child()

__all__ = ["MODES", "intercepting", "sync", "stale_marked", "lease_died_or_disowned", "on_lend", "arm",
           "retry_leave"]
