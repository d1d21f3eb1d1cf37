"""Ray: turn the sanitizer on in every Ray worker of a job, and collect the workers' reports into one.

``ownsan run`` reaches every process its command starts; Ray's workers are started by the raylet
(and, on a cluster, on other machines), so they are not its children. A Ray job asks for the
sanitizer in its ``runtime_env`` instead::

    import ray
    from sanitizer.tools.ray_env import runtime_env, collect

    env = runtime_env("/shared/ownsan-reports")        # a directory every worker can write (a shared mount)
    ray.init(runtime_env=env)                           # or per task/actor: f.options(runtime_env=env)
    ...                                                 # the engine loads as it always does: no code change
    merged = collect("/shared/ownsan-reports")          # after the last ray.get, before ray.shutdown()
    ray.shutdown()

``runtime_env`` sets ``OWNERSHIP_SANITIZE=1`` and the options (``triage=1`` as ``ownsan run`` does,
``report=<dir>/report-{pid}.json``) in each worker's environment and names
:func:`worker_setup` as Ray's ``worker_process_setup_hook``: it turns the sanitizer on as the worker
starts (so the adapters wrap the loaders as the worker imports them) and starts a small daemon
thread that rewrites the worker's report whenever its findings change. That thread is what makes
the reports survive: Ray ends its workers with SIGKILL at ``ray.shutdown()``, so no exit handler of
theirs ever runs. Each worker needs ownership-sanitizer installed (``pip install ownership-sanitizer``
in the cluster's image, or ``"pip"`` in the runtime_env); the report directory must be reachable from
every node. :func:`collect` waits a moment (a worker writes its report within a flush interval of a
finding), merges the reports (``report.merge``), each finding naming its process and rank, and returns
the merged report (``ownsan triage`` reads it once written with ``out=``). Call it before
``ray.shutdown()``: findings made in a worker's last flush interval die with it.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

from sanitizer.core import options as _opts
from sanitizer.core import output_file
from sanitizer.core.journal import reports_or_journals

ENV_SWITCH = _opts.ENV_SWITCH
ENV_OPTIONS = _opts.ENV_OPTIONS
ENV_FLUSH = "OWNSAN_RAY_FLUSH_S"
ENV_USER_HOOK = "OWNSAN_RAY_USER_SETUP_HOOK"
SETUP_HOOK = "sanitizer.tools.ray_env.worker_setup"
REPORT_NAME = "report-{pid}.json"


def runtime_env(report_dir: str, options: Optional[Mapping[str, Any]] = None,
                base: Optional[Mapping[str, Any]] = None, flush_interval_s: float = 0.5) -> Dict[str, Any]:
    """A Ray ``runtime_env`` that sanitizes every worker and has each write its report into ``report_dir``.

    ``options`` are the sanitizer's (as for ``ownsan run -o``; ``triage=1`` unless given); ``base`` is a
    runtime_env of your own to extend (its ``env_vars`` are kept; its ``worker_process_setup_hook``, if
    any, still runs, after ours). ``flush_interval_s``: how often a worker looks for new findings.
    """
    if not isinstance(report_dir, (str, os.PathLike)) or not os.fspath(report_dir):
        raise ValueError(f"report_dir must be a directory path, got {report_dir!r}")
    if isinstance(flush_interval_s, bool) or not isinstance(flush_interval_s, (int, float)) or flush_interval_s <= 0:
        raise ValueError(f"flush_interval_s must be a number of seconds > 0, got {flush_interval_s!r}")
    values = {"triage": "1", **{k: (str(int(v)) if isinstance(v, bool) else str(v)) for k, v in (options or {}).items()}}
    if "report" in values:
        raise ValueError("options: 'report' is set by runtime_env (one file per worker in report_dir); "
                         "leave it out")
    _opts.resolve(values)  # a bad option is refused here, naming it, not in every worker
    directory = os.path.abspath(os.fspath(report_dir))
    os.makedirs(directory, exist_ok=True)
    env = dict(base or {})
    env_vars = dict(env.get("env_vars") or {})
    env_vars[ENV_SWITCH] = "1"
    env_vars[ENV_OPTIONS] = ":".join([f"{k}={v}" for k, v in values.items()]
                                     + [f"report={os.path.join(directory, REPORT_NAME)}"])
    env_vars[ENV_FLUSH] = repr(float(flush_interval_s))
    user_hook = env.get("worker_process_setup_hook")
    if user_hook is not None and user_hook != SETUP_HOOK:
        if not isinstance(user_hook, str):
            raise ValueError("base['worker_process_setup_hook'] must be given as a 'module.function' string to be "
                             f"chained after the sanitizer's, got {type(user_hook).__name__}")
        env_vars[ENV_USER_HOOK] = user_hook
    env["env_vars"] = env_vars
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env


class _Flusher(threading.Thread):
    """Rewrites this worker's report whenever its findings change (Ray kills workers: no exit handler runs).

    A retired view still held is *pending* until its consumer has had its turn (see features/triage.py);
    once the worker has been idle for ``IDLE_TICKS`` intervals with such views pending, the report is
    written as at exit (``final=True``): a worker between tasks that still holds a retired view retains it.
    """

    IDLE_TICKS = 4

    def __init__(self, interval: float):
        super().__init__(name="ownsan-report-flusher", daemon=True)
        self.interval = interval
        self._last: Optional[tuple] = None
        self._idle = 0

    def run(self) -> None:
        from sanitizer.features import triage
        from sanitizer.reporting import report as rep
        from sanitizer.torch_layer import records
        from sanitizer.torch_layer.state import state

        while True:
            time.sleep(self.interval)
            try:
                path = state.options.report
                counts = (tuple(sorted(records.record_counts().items())), state.ledger.live_count)
                if not path:
                    continue
                if counts != self._last:
                    self._idle = 0
                    rep.write_report(path)
                elif triage.pending_count():
                    self._idle += 1
                    if self._idle >= self.IDLE_TICKS:
                        rep.write_report(path, final=True)
                        self._idle = 0
                self._last = (tuple(sorted(records.record_counts().items())), state.ledger.live_count)
            except Exception:  # never harm the worker; the next tick tries again
                pass


_started = False
_lock = threading.Lock()


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: sanitizer on, report flusher started, then the job's own hook."""
    global _started
    # the one activation path: the package activates itself from OWNERSHIP_SANITIZE / _OPTIONS at its first
    # import (enable, then the adapters' import hooks)
    import sanitizer  # noqa: F401

    if os.environ.get(ENV_SWITCH):
        with _lock:
            if not _started:
                _started = True
                _Flusher(float(os.environ.get(ENV_FLUSH, "0.5"))).start()
    user_hook = os.environ.get(ENV_USER_HOOK)
    if user_hook:
        import importlib

        module, _, function = user_hook.rpartition(".")
        getattr(importlib.import_module(module), function)()


def collect(report_dir: str, settle_s: float = 1.0, out: Optional[str] = None) -> Dict[str, Any]:
    """The workers' reports in ``report_dir`` merged into one (each finding names its process and rank).

    Waits ``settle_s`` first (a worker rewrites its report within its flush interval of a finding), so
    call it after the job's last ``ray.get`` and before ``ray.shutdown()``. ``out``: also write the merged
    report there.
    """
    from sanitizer.reporting import report as rep

    time.sleep(max(0.0, settle_s))
    # A worker killed before it wrote its report (ray kills idle workers) left its journal: its findings.
    files = reports_or_journals(os.path.join(os.fspath(report_dir), REPORT_NAME.replace("{pid}", "*")))
    if not files:
        raise ValueError(f"no worker report in {os.fspath(report_dir)!r}: did the workers get "
                         f"runtime_env({os.fspath(report_dir)!r}), and import torch?")
    reports: List[Dict[str, Any]] = []
    for path in files:
        try:
            reports.append(rep.load(path))
        except ValueError:  # a worker killed while it wrote: the previous version was replaced atomically
            continue
    merged = rep.merge(reports)
    if out:  # atomically, or through a device, a FIFO or a symlink's target (never replacing them)
        output_file.write_text(os.fspath(out), json.dumps(merged, indent=2, default=str) + "\n")
    return merged


__all__ = ["runtime_env", "worker_setup", "collect", "SETUP_HOOK"]
