"""Reading a report file: the format's name and version, and the one loader every reader uses.

Torch-free: ``ownsan triage`` (through :mod:`sanitizer.reporting.report`) and the static auditor's
``--report`` cross-check (which never imports torch) read reports the same way, with the same errors.
"""
from __future__ import annotations

import json
from typing import Any, Dict

FORMAT = "ownership-sanitizer-report"
VERSION = 2


class ReportFileError(ValueError):
    """A file that cannot be read, is not JSON, or is not an ownership-sanitizer report of this version."""


def load(path: str) -> Dict[str, Any]:
    """The report in ``path``, with a clear error naming the path when it is not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ReportFileError(f"cannot read report {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ReportFileError(f"{path!r} is not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ReportFileError(f"{path!r} is not an ownership-sanitizer report (format field is "
                              f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                              f"expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ReportFileError(f"{path!r} is report version {data.get('version')!r}; this ownsan reads version "
                              f"{VERSION}")
    return data


__all__ = ["FORMAT", "VERSION", "ReportFileError", "load"]
