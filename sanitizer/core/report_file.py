"""Reading a report file: the format's name and version, and the one loader every reader uses.

Torch-free: ``ownsan triage`` (through :mod:`sanitizer.reporting.report`) and the static auditor's
``--report`` cross-check (which never imports torch) read reports the same way, with the same errors.
"""
from __future__ import annotations

import json
from typing import Any, Dict

from sanitizer.core import journal

FORMAT = "ownership-sanitizer-report"
VERSION = 2
MAX_DEPTH = 100  # a report nests about 8 levels; every reader (schema check, triage, audit) recurses on it


class ReportFileError(ValueError):
    """A file that cannot be read, is not JSON, or is not an ownership-sanitizer report of this version."""


def load(path: str) -> Dict[str, Any]:
    """The report in ``path``, with a clear error naming the path when it is not one. A journal (the
    findings of a process that ended before writing its report: :mod:`sanitizer.core.journal`) reads
    as the report it stands for, without a summary."""
    if str(path).endswith(journal.SUFFIX):
        try:
            return journal.load_journal(path)
        except ValueError as exc:
            raise ReportFileError(str(exc)) from None
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
    if _deeper_than(data, MAX_DEPTH):  # parsed, but the readers would hit the recursion limit
        raise ReportFileError(f"{path!r} is not a valid report: JSON nested too deeply (more than {MAX_DEPTH} "
                              f"levels; a report nests about 8)")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ReportFileError(f"{path!r} is not an ownership-sanitizer report (format field is "
                              f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                              f"expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ReportFileError(f"{path!r} is report version {data.get('version')!r}; this ownsan reads version "
                              f"{VERSION}")
    return data


def _deeper_than(data: Any, limit: int) -> bool:
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


__all__ = ["FORMAT", "VERSION", "MAX_DEPTH", "ReportFileError", "load"]
