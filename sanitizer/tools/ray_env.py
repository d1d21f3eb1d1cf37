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

``runtime_env`` asks for the sanitizer and its options (``triage=1`` as ``ownsan run`` does,
``report=<dir>/report-{pid}.json``) in each worker's environment and names
:func:`worker_setup` as Ray's ``worker_process_setup_hook``: it arms the sanitizer to turn on when the
worker's code imports torch (or a loader, which the adapters then wrap), as the zero-code start-up hook
does, and starts a small daemon thread that rewrites the worker's report whenever its findings change.
Neither imports torch: Ray sets ``OMP_NUM_THREADS`` to the worker's CPUs only at its first task, so a
torch imported by the set-up hook would run every 1-CPU worker with all the node's intra-op threads
(issue 49). The request travels as ``OWNSAN_RAY_SANITIZE``/``OWNSAN_RAY_OPTIONS`` (the switch and
the options under their own names are set empty, an inherited ``ownsan run`` switch included) and becomes
``OWNERSHIP_SANITIZE``/``_OPTIONS`` in the hook: under those names Ray's import of this module (the
package's first import) would have turned the sanitizer on there and then, torch with it. Ray runs a
setup hook only from the job's ``runtime_env``; a worker given ``env`` per task or actor alone is armed
by the zero-code start-up hook (the ``.pth`` line reads the request too), which also starts its flusher
(:mod:`sanitizer.tools.ray_flusher`) once torch is in.

The flusher thread is what makes the reports survive: Ray ends its workers with SIGKILL at
``ray.shutdown()``, so no exit handler of theirs ever runs. Each worker needs ownership-sanitizer
installed (``pip install ownership-sanitizer`` in the cluster's image, or ``"pip"`` in the runtime_env);
the report directory must be reachable from every node. :func:`collect` asks the live workers to write
their reports as at exit (a request file the flusher answers at its first tick with nothing lent: an actor's
last kept view, still *pending* until its idle write, was not counted when collect() came right after the
last ``ray.get``), waits until each has answered or is gone (a bound then), merges the reports
(``sanitizer.reporting.collect``, the pipeline ``ownsan run`` uses), each finding naming its process, rank and Ray worker, and returns the merged report (``ownsan triage`` reads it
once written with ``out=``); under ``ownsan run`` it also hands it to the run, whose status then fails on
any worker's finding (``runtime_env`` leaves the run a pointer to the directory, so a job that never
calls collect() still has its workers' reports merged by the run, said in one line). Call it before
``ray.shutdown()``: findings made in a worker's last flush interval die with it.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from typing import Any, Dict, List, Mapping, Optional

from sanitizer.core import options as _opts
from sanitizer.tools import startup as _startup
from sanitizer.tools.ray_flusher import ENV_FLUSH, SETTLE_ACK, SETTLE_REQUEST, start_flusher
from sanitizer.tools.ray_flusher import _Flusher  # noqa: F401  (the worker side: tests drive its ticks)

ENV_SWITCH = _opts.ENV_SWITCH
ENV_OPTIONS = _opts.ENV_OPTIONS
ENV_REQUEST = _startup.ENV_RAY_REQUEST  # the switch, until worker_setup arms it (see the module's docstring)
ENV_REQUEST_OPTIONS = _startup.ENV_RAY_OPTIONS  # the options, likewise
ENV_USER_HOOK = "OWNSAN_RAY_USER_SETUP_HOOK"
SETUP_HOOK = "sanitizer.tools.ray_env.worker_setup"
REPORT_NAME = "report-{pid}.json"
_REPORT_PID = re.compile(r"report-(\d+)\.json(?:\.journal)?$")


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
    env_vars[ENV_REQUEST] = "1"
    env_vars[ENV_SWITCH] = env_vars[ENV_OPTIONS] = ""  # not at Ray's import of the hook: in it (docstring)
    env_vars[ENV_REQUEST_OPTIONS] = ":".join([f"{k}={v}" for k, v in values.items()]
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
    try:  # under ownsan run: the run merges this directory itself if collect() is never called
        from sanitizer.reporting import collect as pipeline

        pipeline.point_run_to(directory)
    except OSError:
        pass  # (the run's directory gone or read-only: collect() still hands the reports over)
    return env


def _arm(environ: Any) -> bool:
    """Turn this worker's request (``OWNSAN_RAY_SANITIZE``/``_OPTIONS``) into the switch and the options,
    and arm the start-up hook: the sanitizer turns on when the worker's code imports torch (at once if it
    has). Children of the worker inherit the switch. Returns whether the sanitizer was asked for."""
    if not _startup.take_ray_request(environ):
        return bool(environ.get(ENV_SWITCH))  # (a worker with the switch itself: on already, or never)
    # The start-up hook's own module, as its .pth line loads it (one finder per process, whoever arms it).
    exec(_startup.BOOTSTRAP, {"__name__": "ownsan_ray_bootstrap"})
    return True


def worker_setup() -> None:
    """Ray's ``worker_process_setup_hook``: the sanitizer armed for the worker's import of torch, the report
    flusher started, then the job's own hook. Imports no torch (see the module's docstring)."""
    if _arm(os.environ):
        start_flusher()
    user_hook = os.environ.get(ENV_USER_HOOK)
    if user_hook:
        import importlib

        module, _, function = user_hook.rpartition(".")
        getattr(importlib.import_module(module), function)()


def _alive(pid: int, host: Optional[str]) -> bool:
    """Could the worker ``pid`` still answer? False only when it is known gone: on this host (or a host
    unknown: it never wrote beside its report), no such process, or a zombie (Ray's SIGKILL, not reaped)."""
    if host and host != socket.gethostname():
        return True  # another node's pid: nothing to ask here, so wait for its answer
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # (someone else's process: alive)
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _unanswered(directory: str, token: str) -> List[str]:
    """The workers of ``directory`` (a report, or a journal) that neither answered ``token`` nor are gone."""
    from sanitizer.reporting import collect as pipeline

    waiting = []
    for path in pipeline.find(directory):
        match = _REPORT_PID.search(os.path.basename(path))
        if match is None or int(match.group(1)) == os.getpid():
            continue  # (not a worker's: report-collected-*, or this process's own)
        pid = int(match.group(1))
        report = path[: -len(".journal")] if path.endswith(".journal") else path
        try:
            with open(report + SETTLE_ACK, encoding="utf-8") as fh:
                ack = json.load(fh)
        except (OSError, ValueError):
            ack = {}
        if not isinstance(ack, dict):
            ack = {}
        if ack.get("token") != token and _alive(pid, ack.get("host")):
            waiting.append(f"pid {pid}" + (f" on {ack['host']}" if ack.get("host") else ""))
    return waiting


def _settle(directory: str, settle_s: float, answer_s: float) -> None:
    """Ask the live workers of ``directory`` to write their reports as at exit, and wait ``settle_s`` at least,
    and then until each has answered or is gone, ``answer_s`` more at most (then say in one line who did not
    answer)."""
    start = time.monotonic()
    token = f"{os.getpid()}-{time.time_ns()}"
    request = os.path.join(directory, SETTLE_REQUEST)
    tmp = f"{request}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(token)
        os.replace(tmp, request)
    except OSError as exc:
        print(f"ownsan ray_env.collect: cannot ask the workers to settle ({request}: {exc.strerror or exc}); "
              f"their last retentions may still be pending", file=sys.stderr)
        time.sleep(max(0.0, settle_s))
        return
    try:
        while True:
            elapsed = time.monotonic() - start
            if elapsed < settle_s:  # (settle_s: a minimum wait, as before the workers could answer)
                time.sleep(min(0.05, settle_s - elapsed))
                continue
            waiting = _unanswered(directory, token)
            if not waiting:
                return
            if elapsed >= settle_s + answer_s:
                print(f"ownsan ray_env.collect: {len(waiting)} worker{'s' * (len(waiting) != 1)} did not "
                      f"answer within {settle_s + answer_s:g} s ({', '.join(waiting)}): merged as last written, "
                      f"their last retentions may still be pending", file=sys.stderr)
                return
            time.sleep(0.05)
    finally:
        try:  # never left for a worker started later: it would write as at exit at its first quiet tick
            os.remove(request)
        except OSError:
            pass


def collect(report_dir: str, settle_s: float = 1.0, out: Optional[str] = None,
            answer_s: float = 5.0) -> Dict[str, Any]:
    """The workers' reports in ``report_dir`` merged into one (each finding names its process: rank, Ray
    worker and actor, pid).

    Call it after the job's last ``ray.get`` and before ``ray.shutdown()``. It asks every live worker to
    write its report as at exit (a view still kept after its bytes were reused is decided a retention then:
    waiting for the workers' own idle write missed an actor's last one), and waits ``settle_s`` at least,
    then until every worker has answered or is gone, ``answer_s`` more at most (then one line names those
    that did not answer, and what they last wrote is merged). ``out``: also write the merged report there.
    Under ``ownsan run`` the merged report is also written into the run's own report directory, so the run's
    merged report, its printed summary and its exit status include every worker's findings. A file that
    cannot be read is said in one line naming it, and the others are merged. Raises ValueError when
    ``report_dir`` is no directory, or holds no worker's report.
    """
    from sanitizer.reporting import collect as pipeline

    directory = os.fspath(report_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"no such directory {directory!r} (the report_dir given to runtime_env()): "
                         f"no worker report to collect")
    _settle(directory, settle_s, answer_s)
    found = pipeline.collect([directory])
    run_dir = os.environ.get(pipeline.ENV_RUN_DIR)
    handed = found.report is not None  # the workers wrote into report_dir: the run needs them handed over
    if found.report is None and not found.unreadable and run_dir:
        # Under ownsan run the workers (the raylet's children, so the run's too) wrote where the run told
        # them: its merge has them. Say so, and return what is there now.
        print(f"ownsan ray_env.collect: no worker report in {directory!r}; the workers wrote "
              f"theirs where ownsan run reads them ({run_dir}): its merged report and exit status have them",
              file=sys.stderr)
        found = pipeline.collect([run_dir])
    for line in found.notes("ownsan ray_env.collect"):
        print(line, file=sys.stderr)
    if found.report is None:
        raise ValueError(f"no worker report in {directory!r}: did the workers get "
                         f"runtime_env({directory!r}), and import torch?")
    merged = found.report
    if handed and pipeline.hand_to_run(merged, directory):
        pipeline.unpoint_run(directory)  # handed over: ownsan run must not merge the directory again
    if out:  # atomically, or through a device, a FIFO or a symlink's target (never replacing them)
        pipeline.write(merged, os.fspath(out))
    return merged


__all__ = ["runtime_env", "worker_setup", "collect", "SETUP_HOOK"]
