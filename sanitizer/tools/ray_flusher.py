"""A Ray worker's report flusher: its report rewritten whenever its findings change, and written as at exit
when the worker idles or when :func:`sanitizer.tools.ray_env.collect` asks (Ray ends its workers with
SIGKILL: no exit handler of theirs runs).

The worker side of :mod:`sanitizer.tools.ray_env`, in a module of its own because both the worker hook
there and the zero-code start-up hook (a worker whose runtime_env was given per task or actor: Ray runs no
hook there) start it, and the start-up hook must not import the driver side that arms it. It imports no
torch: it looks at the sanitizer through ``sys.modules`` until the worker's own code has turned it on.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from typing import Optional

ENV_FLUSH = "OWNSAN_RAY_FLUSH_S"  # the flush interval, seconds (runtime_env's flush_interval_s)
#: ``collect()``'s request to settle, in the report directory: a token, replaced atomically.
SETTLE_REQUEST = ".ownsan-settle"
#: A worker's answer, beside its report (``report-<pid>.json.settled``): the last token it settled, its host.
SETTLE_ACK = ".settled"


def _sanitizer_on() -> bool:
    """Has the sanitizer turned on in this process (its code imported torch)? Read from ``sys.modules``
    only: the flusher never imports torch itself (see the module's docstring)."""
    module = sys.modules.get("sanitizer.torch_layer.state")
    state = getattr(module, "state", None)
    # (enabled only once compose() imported triage and the report: they are in by then)
    return bool(state is not None and state.enabled)


class _Flusher(threading.Thread):
    """Rewrites this worker's report whenever its findings change (Ray kills workers: no exit handler runs).

    A retired view still held is *pending* until its consumer has had its turn (see features/triage.py);
    once the worker has been idle for ``IDLE_TICKS`` intervals with such views pending, the report is
    written as at exit (``final=True``): a worker between tasks that still holds a retired view retains it.
    Idle means that nothing lent either: a correct loop changes no finding, and a final write in the middle
    of it decided the view its loop variable was about to drop as a retention (issue 49).

    ``ray_env.collect()`` cannot wait for ``IDLE_TICKS`` on its own (run right after the last ``ray.get``,
    an actor's last retention was still pending, and not counted): it leaves a token in the report directory
    (:data:`SETTLE_REQUEST`), and the first tick that sees a new token with nothing lent since the previous
    tick writes the report as at exit and answers with the token beside it (:data:`SETTLE_ACK`). A worker
    still lending waits for a tick that lends nothing, for the same reason as the idle write.
    """

    IDLE_TICKS = 4

    def __init__(self, interval: float):
        super().__init__(name="ownsan-report-flusher", daemon=True)
        self.interval = interval
        self._findings: Optional[tuple] = None
        self._lends = -1
        self._idle = 0
        self._answered: Optional[str] = None  # the last settle token answered
        self._announced = False  # its host written beside the report (collect() tells a remote pid by it)

    def run(self) -> None:
        while True:
            time.sleep(self.interval)
            self.tick()

    def tick(self) -> Optional[str]:
        """One look: ``"settled"`` (collect() asked, nothing lent since the last tick: written as at exit,
        and answered), ``"write"`` (the findings changed), ``"final"`` (idle with views pending) or None
        (nothing written: unchanged, the sanitizer not on yet, no report path, or a failure)."""
        if not _sanitizer_on():
            return None
        try:
            from sanitizer.features import triage
            from sanitizer.reporting import report as rep
            from sanitizer.torch_layer import records
            from sanitizer.torch_layer.state import state

            path = state.options.report
            if not path:
                return None
            lends = triage.lend_count()
            findings = (tuple(sorted(records.record_counts().items())), state.ledger.live_count)
            moved, self._lends = lends != self._lends, lends
            token = _settle_token(os.path.dirname(rep.expand_path(path)))
            if token is not None and token != self._answered and not moved:
                self._findings, self._idle = None, 0  # (compared afresh at the next tick, as after "final")
                _answer(rep.write_report(path, final=True), token)
                self._answered, self._announced = token, True
                return "settled"
            if findings != self._findings:
                # Noted before the write: a finding filed while the report is built (a stale use's error
                # right after its retention) differs from this at the next tick, and is written then.
                self._findings, self._idle = findings, 0
                target = rep.write_report(path)
                if not self._announced:
                    _answer(target, None)
                    self._announced = True
                return "write"
            if moved or not triage.pending_count():
                self._idle = 0
                return None
            self._idle += 1
            if self._idle < self.IDLE_TICKS:
                return None
            self._idle = 0
            rep.write_report(path, final=True)
            self._findings = None  # (what the final write decided is a finding of its own: compared afresh)
            return "final"
        except Exception:  # never harm the worker; the next tick tries again
            return None


def _settle_token(directory: str) -> Optional[str]:
    """The token of :func:`~sanitizer.tools.ray_env.collect`'s request in ``directory``, or None (none asked)."""
    try:
        with open(os.path.join(directory, SETTLE_REQUEST), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _answer(report_path: str, token: Optional[str]) -> None:
    """Write beside ``report_path`` the token settled (None: none yet) and this host, atomically."""
    ack = report_path + SETTLE_ACK
    tmp = f"{ack}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"token": token, "host": socket.gethostname(), "pid": os.getpid()}, fh)
    os.replace(tmp, ack)


_started = False
_lock = threading.Lock()


def start_flusher() -> None:
    """Start this worker's report flusher, once per process (the worker hook, or the start-up hook of a
    worker Ray ran no hook in)."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    _Flusher(float(os.environ.get(ENV_FLUSH, "0.5"))).start()


__all__ = ["start_flusher", "ENV_FLUSH", "SETTLE_REQUEST", "SETTLE_ACK"]
