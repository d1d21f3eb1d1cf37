"""Recover mode speaks: with ``halt_on_error=0`` (or ``triage=1``) each error is printed as it is found,
once per distinct use site, a summary line closes the run, and ``exitcode=`` may set the exit status.

ASan's recover mode (``halt_on_error=0``) prints every report and goes on, suppressing duplicates of one
program location, and ``exitcode=`` overrides the exit status of a run that found errors. Before, the
sanitizer's recover mode was silent: stale reads returned the guard's NaN, nothing was printed and the
process exited 0 unless ``report=`` was set and read.

* **Whose**: the process's sanitizer (``OWNERSHIP_SANITIZE=1``, ``ownsan run``, ``sanitizer.enable()``).
  An error inside a ``with sanitizer.sanitize(halt_on_error=0):`` block is that block's caller's to read
  (``sanitizer.errors()``, a test's assertion, the harness's result): neither printed nor counted here.
* **As found** (``print_errors=1``, the default): an error recorded and let go reaches this module
  through the ``recovered`` hook slot and is printed to stderr, whole, as a raised one would read,
  the first time its kind meets its use site (the innermost frame of the use; the lease's buffer and
  name when no stack was captured). A repeat is counted, not printed.
* **At exit**: one line, ``ownership-sanitizer: recover mode recorded N errors at K sites ...``, when
  any was recorded and not forgotten since (``sanitizer.clear_errors()``).
* **Exit status** (``exitcode=N``, N > 0): the interpreter has already chosen its status when exit
  handlers run, so the only way to set it is ``os._exit``. The handler is registered when the
  features are composed, before the report writer arms, so it runs after it (exit handlers run in
  reverse order): the report is on disk first. It then shuts logging down and flushes the standard
  streams, as a normal exit would; handlers registered before the sanitizer was composed do not run
  (in a program that imports torch first: torch's own). Without ``exitcode`` nothing is forced.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Dict, Optional, Tuple

from sanitizer.core import forking, suppressions
from sanitizer.core.options import Options
from sanitizer.reporting.collect import ENV_RUN_DIR
from sanitizer.torch_layer import records
from sanitizer.torch_layer.hooks import add_enable_hook, add_recovered_hook
from sanitizer.torch_layer.state import state

PREFIX = "ownership-sanitizer"

_lock = threading.Lock()
_seen: Dict[Tuple[str, str], int] = {}  # (kind, site) -> times recovered there
_totals = {"recovered": 0, "printed": 0, "for_exitcode": 0}
_first: Optional[str] = None  # the first site, for the summary
_armed = False


def install() -> None:
    """Compose recover mode onto the runtime (the package's composition root calls this once). The exit
    handler is registered here, before any enable arms the report writer, so that it runs after it."""
    global _armed
    add_enable_hook(_on_enable)
    if not _armed:
        atexit.register(_at_exit)
        _armed = True


def _on_enable(options: Options) -> None:
    if not options.halts:
        add_recovered_hook(_on_recovered)


def _site_of(err: BaseException) -> str:
    record = getattr(err, "record", None) or {}
    frames = record.get("used_at") or record.get("verified_at") or []
    if frames:
        top = frames[0]
        return f"{top.get('file')}:{top.get('line')}"
    lease = record.get("lease") or {}
    return f"{lease.get('buffer')}:{lease.get('name')}"  # stack_depth=0: no frames to tell sites apart


def _on_recovered(err: BaseException) -> None:
    """One error let go: printed the first time its kind meets its site, counted always."""
    global _first
    options = state.options
    if options.halts or state.scopes or not (options.print_errors or options.exitcode):
        return  # (a halting scope entered since, or a `sanitize()` block: its findings are its caller's)
    record = getattr(err, "record", None) or {}
    if options.suppressions and suppressions.suppressed_by_file(options.suppressions, record):
        return  # named in the suppressions file: listed in the report as suppressed, never printed or failing
    key = (str(record.get("kind", type(err).__name__)), _site_of(err))
    with _lock:
        _totals["recovered"] += 1
        if options.exitcode:
            _totals["for_exitcode"] += 1
        n = _seen.get(key, 0)
        _seen[key] = n + 1
        first_here = n == 0
        if first_here and _first is None:
            _first = key[1]
        speak = first_here and options.print_errors
        if speak:
            _totals["printed"] += 1
    if speak:
        try:
            sys.stderr.write(f"{PREFIX}: {err}\n  (recovered: {_mode(options)} goes on; further errors at this "
                             f"site are counted, not printed)\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr never turns a recorded error into a crash
            pass


def _mode(options: Options) -> str:
    """What made the sanitizer go on, as the user set it: ``triage=1`` (ownsan run sets it) wins."""
    return "triage=1" if options.triage else "halt_on_error=0"


def _report_words() -> str:
    """Where the report goes, as the user would find it: its expanded path; nothing under ``ownsan run``,
    whose own summary names the merged report (the process's own file is the run's temporary one)."""
    if os.environ.get(ENV_RUN_DIR):
        return ""
    report = state.options.report
    if not report:
        return "; set report=PATH for the JSON report"
    from sanitizer.reporting.report import expand_path  # (the report module imports this one's layer peers)

    return f"; report: {expand_path(report)}"


def summary_line() -> Optional[str]:
    """The exit line, or None when recover mode recorded nothing."""
    with _lock:
        total, printed, sites, first = _totals["recovered"], _totals["printed"], len(_seen), _first
    total = min(total, records.STORE.error_total)  # sanitizer.clear_errors() since: those are forgotten
    if not total:
        return None
    shown = f", {printed} printed above" if printed else " (print_errors=0)"
    return (f"{PREFIX}: recover mode ({_mode(state.options)}) recorded {total} error{'s' if total != 1 else ''} at "
            f"{sites} site{'s' if sites != 1 else ''}{shown}, the first at {first}{_report_words()}")


def _at_exit() -> None:
    line = summary_line()
    if line is None:
        return
    try:
        if state.options.print_errors:
            sys.stderr.write(line + "\n")
        code = state.options.exitcode
        with _lock:
            forced = min(_totals["for_exitcode"], records.STORE.error_total)
        if not (code and forced):
            return
        sys.stderr.write(f"{PREFIX}: exit status {code} (exitcode={code}: errors were recorded)\n")
        logging.shutdown()  # what the interpreter's own exit would still do for the program's logs
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    except Exception:
        return
    os._exit(code)


def reset() -> None:
    """Forget what was recovered (tests; a forked child starts with nothing of its parent's)."""
    global _first
    with _lock:
        _seen.clear()
        for k in _totals:
            _totals[k] = 0
        _first = None


@forking.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()
    reset()


__all__ = ["install", "summary_line", "reset", "PREFIX"]
