"""Reading a report file: the format's name and version, and the one loader every reader uses.

Torch-free: ``ownsan triage`` (through :mod:`sanitizer.reporting.report`) and the static auditor's
``--report`` cross-check (which never imports torch) read reports the same way, with the same errors.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

from sanitizer.core import journal
from sanitizer.core.report_skeleton import FORMAT, VERSION
MAX_DEPTH = 100  # a report nests about 8 levels; every reader (schema check, triage, audit) recurses on it


class ReportFileError(ValueError):
    """A file that cannot be read, is not JSON, or is not an ownership-sanitizer report of this version."""


def load(path: str, check: Optional[journal.Check] = None) -> Dict[str, Any]:
    """The report in ``path``, with a clear error naming the path when it is not one. A journal (the
    findings of a process that ended before writing its report: :mod:`sanitizer.core.journal`) reads
    as the report it stands for, without a summary, its records checked by ``check`` first; so does a
    report's path whose report is missing, or is an earlier process's and older than the journal (the
    process that was to write it was killed): the result's ``ended_before_report.journal`` then names
    the journal read."""
    newer = None if str(path).endswith(journal.SUFFIX) else journal.instead_of(os.fspath(path))
    if str(path).endswith(journal.SUFFIX) or (newer is not None and not os.path.exists(path)):
        return _journal(newer or path, check)
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ReportFileError(f"cannot read report {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportFileError(f"{path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    except UnicodeDecodeError as exc:
        raise ReportFileError(f"{path!r} is not a valid report: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                              f"at offset {exc.start})") from None
    except RecursionError:  # '[' * 100000: the parser's own recursion limit
        raise ReportFileError(f"{path!r} is not a valid report: JSON nested too deeply (beyond Python's "
                              f"recursion limit; a report nests about 8 levels)") from None
    if journal.deeper_than(data, MAX_DEPTH):  # parsed, but the readers would hit the recursion limit
        raise ReportFileError(f"{path!r} is not a valid report: JSON nested too deeply (more than {MAX_DEPTH} "
                              f"levels; a report nests about 8)")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ReportFileError(f"{path!r} is not an ownership-sanitizer report (format field is "
                              f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                              f"expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ReportFileError(f"{path!r} is report version {data.get('version')!r}; this ownsan reads version "
                              f"{VERSION}")
    if newer is not None and (journal.header_of(newer) or {}).get("pid", data.get("pid")) != data.get("pid"):
        return _journal(newer, check)  # a later process at this path was killed: the report is an earlier one's
    return data


def _journal(path: str, check: Optional[journal.Check]) -> Dict[str, Any]:
    try:
        return journal.load_journal(path, check, MAX_DEPTH)
    except ValueError as exc:
        raise ReportFileError(str(exc)) from None


def journal_note(path: str, rep: Dict[str, Any]) -> Optional[str]:
    """What a reader says (one line) when :func:`load` read ``path``, a report's path, through its journal,
    so that nobody takes the findings for a whole report's; None when it read the report (or was given
    the journal itself)."""
    stood_in = (rep.get("ended_before_report") or {}).get("journal")
    if not stood_in or stood_in == path:
        return None
    if os.path.exists(path):
        return (f"{path!r} is older than its journal {stood_in!r} (a later process at that path ended before "
                f"writing its report: killed?); read the journal, the findings as they were made")
    return (f"no report at {path!r} (the process ended before writing it: killed?); read its journal "
            f"{stood_in!r}, the findings as they were made")


__all__ = ["FORMAT", "VERSION", "MAX_DEPTH", "ReportFileError", "load", "journal_note"]
