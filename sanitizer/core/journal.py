"""Each finding on disk as it is made: a process killed before it writes its report loses none of them.

The report is written at exit (``atexit``, ``os._exit``). A process that never gets there loses what it
found: a pool worker that ``Pool.terminate()`` kills while it writes its report, a rank its launcher
kills, an abort. A handler for SIGTERM is no answer: a Python handler runs only in the main thread, and
a main thread blocked in a lock while the signal lands on another thread (torch's) never runs it, so the
process hangs where SIGTERM would have ended it. So while a report path is set, every error and event
the process keeps is also appended as one JSON line to a *journal* beside the report (``PATH.journal``):
one descriptor per process, opened at its first record, ``O_APPEND`` so each line lands whole. Once the
report is written, complete, the journal beside it is removed (this process's, or one an earlier, killed
process left at the same path: a journal never outlives a later whole report). Readers (``ownsan run``'s
merge, ``ownsan triage``, ``ownsan audit --report``) read a journal whose report is missing as that
process's report; given a report's path, they read its journal in its place also when the report is an
earlier process's, older than the journal (a later process at that path was killed before it wrote its
own): :func:`instead_of`. A journal is checked record by record before anything reads it
(``check``: the reporting layer passes the report schema's), so a crafted line is one clear error.

Torch-free (the auditor reads journals too): lines, a header and :func:`load_journal`.
"""
from __future__ import annotations

import json
import os
import stat
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

from sanitizer.core.report_skeleton import HEADER_KEYS, skeleton

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
        self._finished = False  # the report is written: a record made after it (a finalizer at exit) would
        # start a new journal, newer than the report, that readers then took for a killed run's

    def append(self, path: str, header: Callable[[], Dict[str, Any]], kind: str, record: Dict[str, Any]) -> None:
        """Append ``record`` (an ``error`` or an ``event``) to the journal at ``path`` (``header()`` is its
        first line when it is new)."""
        if self._failed or self._finished:
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

    def finish(self, report_path: Optional[str] = None) -> None:
        """The report was written, complete: the journal goes, and so does any journal beside
        ``report_path`` (the report just written): one an earlier process at that path left when it was
        killed is older than this report, and read in its place it would show that process's findings."""
        with self._lock:
            path, self._path = self._path, None
            self._close()
            self._finished = True
        for stale in {path, journal_path(os.path.abspath(report_path)) if report_path else None} - {None}:
            try:
                os.unlink(stale)
            except OSError:
                pass

    def after_fork_in_child(self) -> None:
        """A forked child writes its own journal (under its own pid), never its parent's."""
        self._lock = threading.RLock()
        self._finished = False
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd = self._path = None


def instead_of(report_path: str) -> Optional[str]:
    """The journal that may stand for the report at ``report_path``, or None: the journal beside it (a
    symlink's: beside its target, where the writer puts it) when the report is missing (the process was
    killed before it wrote it) or older than that journal. Older, it stands for the report only when it is
    another process's (a later run at the same path was killed: the report is an earlier run's), which
    :func:`sanitizer.core.report_file.load` checks; a live process's report (ray's workers rewrite theirs)
    stays its own."""
    candidates = [journal_path(report_path)]
    if os.path.islink(report_path):
        candidates.insert(0, journal_path(os.path.realpath(report_path)))
    try:
        written: Optional[int] = os.stat(report_path).st_mtime_ns
    except (OSError, ValueError):  # missing (a dangling link too), or a name no file can have
        written = None
    for candidate in candidates:
        try:
            made = os.stat(candidate)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(made.st_mode) and (written is None or made.st_mtime_ns > written):
            return candidate
    return None


def reports_or_journals(pattern: str) -> List[str]:
    """The report files ``pattern`` (a glob) matches, then the journal of each process that ended before
    writing its report (a pool worker killed by ``terminate()``, a rank its launcher killed)."""
    import glob

    files = sorted(glob.glob(pattern))
    written = set(files)
    return files + [j for j in sorted(glob.glob(pattern + SUFFIX)) if j[: -len(SUFFIX)] not in written]


def header_of(path: str) -> Optional[Dict[str, Any]]:
    """The header (first line) of the journal at ``path``, or None when it is not one or cannot be read."""
    try:
        with open(path, "rb") as fh:
            header = json.loads(fh.readline())
    except (OSError, ValueError, RecursionError):
        return None
    return header if isinstance(header, dict) and header.get("kind") == KIND else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


#: ``check(what, value)``: the problem with a journal's ``header`` or one of its ``error`` / ``event``
#: records, or None when it is fine (the reporting layer's is the report schema's, record by record).
Check = Callable[[str, Dict[str, Any]], Optional[str]]
_WHAT = {"header": "the header", "error": "an error", "event": "an event"}


def load_journal(path: str, check: Optional[Check] = None, max_depth: Optional[int] = None) -> Dict[str, Any]:
    """The report a journal stands for: its header's process facts and every whole line's record (a line
    cut short by the kill is left out). No summary (the reporting layer adds it). Raises ValueError naming
    the path (and the line) when it is not a journal, or when ``check`` finds a problem with its header
    or a record: a crafted line is one clear error, never a traceback in whatever reads it next.
    ``max_depth``: how deep the report it stands for may nest (a record sits two levels down in it)."""
    errors: List[dict] = []
    events: List[dict] = []
    cut = 0
    try:
        with open(path, "rb") as fh:
            first = fh.readline()
            try:
                header = json.loads(first)
            except (ValueError, RecursionError):
                header = None
            if not isinstance(header, dict) or header.get("kind") != KIND:
                raise ValueError(f"{path!r} is not an ownership-sanitizer journal")
            _check(path, 1, "header", header, check, max_depth)
            for number, raw in enumerate(fh, 2):
                try:
                    line = json.loads(raw)
                    kind, record = line["k"], line["r"]
                except (ValueError, KeyError, TypeError, IndexError, RecursionError):
                    cut += 1
                    continue
                if kind not in ("error", "event", "update"):
                    raise ValueError(f"{path!r} is not a valid journal: line {number}: \"k\" is {_short(kind)}, "
                                     f"expected 'error', 'event' or 'update'")
                if not isinstance(record, dict):
                    raise ValueError(f"{path!r} is not a valid journal: line {number}: the record (\"r\") is "
                                     f"{_short(record)}, expected an object")
                if kind == "update":
                    _apply_update(path, number, record, events, check, max_depth)
                    continue
                _check(path, number, kind, record, check, max_depth)
                (errors if kind == "error" else events).append(record)
    except OSError as exc:
        raise ValueError(f"cannot read journal {path!r}: {exc.strerror or exc}") from None
    rep = skeleton(**{key: header[key] for key in HEADER_KEYS if header.get(key) is not None},
                   error_count=len(errors), errors=errors, events=events)
    rep["ended_before_report"] = {"journal": path, "lines_cut": cut}
    return rep


def _apply_update(path: str, number: int, update: Dict[str, Any], events: List[dict], check: Optional[Check],
                  max_depth: Optional[int]) -> None:
    """An ``update`` line: facts added to an event already journaled (a retention read stale after it was
    confirmed), the latest event of its kind and lease. The event is checked again as updated."""
    kind, lease_id, fields = update.get("kind"), update.get("lease_id"), update.get("fields")
    if not isinstance(kind, str) or isinstance(lease_id, bool) or not isinstance(lease_id, int) \
            or not isinstance(fields, dict):
        raise ValueError(f"{path!r} is not a valid journal: line {number}: an update needs a \"kind\" string, "
                         f"a \"lease_id\" int and \"fields\", an object; got {_short(update)}")
    for event in reversed(events):
        lease = event.get("lease")
        if event.get("kind") == kind and isinstance(lease, dict) and lease.get("lease_id") == lease_id:
            updated = dict(event, **fields)
            _check(path, number, "event", updated, check, max_depth)
            event.update(fields)
            return


def _check(path: str, number: int, what: str, value: Dict[str, Any], check: Optional[Check],
           max_depth: Optional[int]) -> None:
    if max_depth is not None and deeper_than(value, max_depth - 2):  # before anything recurses on it
        problem: Optional[str] = (f"JSON nested too deeply (more than {max_depth} levels in the report it "
                                  f"stands for)")
    else:
        problem = check(what, value) if check is not None else None
    if problem:
        raise ValueError(f"{path!r} is not a valid journal: line {number} ({_WHAT[what]}): {problem}")


def deeper_than(data: Any, limit: int) -> bool:
    """Does ``data`` nest lists and dicts more than ``limit`` levels deep? Iterative: it must not recurse
    itself on the very input it guards against."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return False


def _short(value: Any) -> str:
    """A value of a crafted line, short, for one line of error."""
    try:
        text = repr(value) if isinstance(value, str) else f"{type(value).__name__} {json.dumps(value, default=str)}"
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["Journal", "journal_path", "load_journal", "instead_of", "header_of", "reports_or_journals",
           "deeper_than", "SUFFIX", "KIND", "Check"]
