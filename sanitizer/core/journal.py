"""Each finding on disk as it is made: a process killed before it writes its report loses none of them.

The report is written at exit (``atexit``, ``os._exit``). A process that never gets there loses what it
found: a pool worker that ``Pool.terminate()`` kills while it writes its report, a rank its launcher
kills, an abort. A handler for SIGTERM is no answer: a Python handler runs only in the main thread, and
a main thread blocked in a lock while the signal lands on another thread (torch's) never runs it, so the
process hangs where SIGTERM would have ended it. So while a report path is set, every error and event
the process keeps is also appended as one JSON line to a *journal* beside the report (``PATH.journal``):
one descriptor per process, opened at its first record, ``O_APPEND`` so each line lands whole. Once the
report is written, complete, the journal is removed. Readers (``ownsan run``'s merge, ``ownsan triage``,
``ownsan audit --report``) take a journal whose report is missing as that process's report.

Torch-free (the auditor reads journals too): lines, a header and :func:`load_journal`.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

SUFFIX = ".journal"
KIND = "ownership-sanitizer-journal"


def journal_path(report_path: str) -> str:
    return report_path + SUFFIX


class Journal:
    """One process's journal (own lock). Never raises into the program: a journal that cannot be written
    is given up with one line on stderr, the report at exit is still written."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # (a finalizer the write's allocation runs may record, in this thread)
        self._fd: Optional[int] = None
        self._path: Optional[str] = None
        self._failed = False

    def append(self, path: str, header: Callable[[], Dict[str, Any]], kind: str, record: Dict[str, Any]) -> None:
        """Append ``record`` (an ``error`` or an ``event``) to the journal at ``path`` (``header()`` is its
        first line when it is new)."""
        if self._failed:
            return
        try:
            line = (json.dumps({"k": kind, "r": record}, default=str) + "\n").encode("utf-8", "surrogateescape")
        except (TypeError, ValueError, RecursionError):
            return  # a record that cannot be a line: the report at exit still has it
        with self._lock:
            try:
                if self._fd is None or self._path != path:
                    self._open(path, header)
                _write_all(self._fd, line)
            except OSError as exc:
                self._failed = True
                print(f"ownership-sanitizer: cannot write the journal {path!r} ({exc.strerror or exc}); findings "
                      f"reach the report at exit only", file=sys.stderr)

    def _open(self, path: str, header: Callable[[], Dict[str, Any]]) -> None:
        self._close()
        directory = os.path.dirname(path)
        if directory:
            os.makedirs(directory, exist_ok=True)  # as the report's writer does at exit
        # Truncated: a journal left at this path by an earlier process (killed, as a journal's are) is that
        # process's; this one's starts whole, with its own header, as its report will replace the old one.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o666)
        self._fd, self._path = fd, path
        _write_all(fd, (json.dumps(dict(header(), kind=KIND), default=str) + "\n").encode("utf-8", "surrogateescape"))

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = None

    def finish(self) -> None:
        """The report was written, complete: the journal goes."""
        with self._lock:
            path, self._path = self._path, None
            self._close()
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass

    def after_fork_in_child(self) -> None:
        """A forked child writes its own journal (under its own pid), never its parent's."""
        self._lock = threading.RLock()
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = self._path = None


def reports_or_journals(pattern: str) -> List[str]:
    """The report files ``pattern`` (a glob) matches, then the journal of each process that ended before
    writing its report (a pool worker killed by ``terminate()``, a rank its launcher killed)."""
    import glob

    files = sorted(glob.glob(pattern))
    written = set(files)
    return files + [j for j in sorted(glob.glob(pattern + SUFFIX)) if j[: -len(SUFFIX)] not in written]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def load_journal(path: str) -> Dict[str, Any]:
    """The report a journal stands for: its header's process facts and every whole line's record (a line
    cut short by the kill is left out). No summary (the reporting layer adds it). Raises ValueError naming
    the path when it is not a journal."""
    errors: List[dict] = []
    events: List[dict] = []
    cut = 0
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
            try:
                header = json.loads(first)
            except ValueError:
                header = None
            if not isinstance(header, dict) or header.get("kind") != KIND:
                raise ValueError(f"{path!r} is not an ownership-sanitizer journal")
            for raw in fh:
                try:
                    line = json.loads(raw)
                    kind, record = line["k"], line["r"]
                except (ValueError, KeyError, TypeError, RecursionError):
                    cut += 1
                    continue
                if isinstance(record, dict):
                    (errors if kind == "error" else events).append(record)
    except OSError as exc:
        raise ValueError(f"cannot read journal {path!r}: {exc.strerror or exc}") from None
    rep = {key: header.get(key) for key in ("format", "version", "pid", "rank", "world_size", "argv")}
    rep.update(enabled=True, options=header.get("options") or {}, error_count=len(errors), records_dropped=0,
               errors_not_kept={"max_records": 0, "max_errors_per_lease": 0}, errors=errors, events=events,
               retained_stale_leases=[], buffers=[],
               ended_before_report={"journal": path, "lines_cut": cut})
    return rep


__all__ = ["Journal", "journal_path", "load_journal", "reports_or_journals", "SUFFIX",
           "KIND"]
