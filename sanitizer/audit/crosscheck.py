"""Static meets dynamic: a sanitized run's report against the audit's findings, so each side checks
the other.

A run (``ownsan run``, ``report=path``) records every *retention*: a lent view something still held
when the loader reused its bytes, with the holders that kept it (``holder``/``holders``: a kind, a path
from a root a person recognises, and the ``site`` where the holder lives: a frame's function, an
object's class, a module). Newer reports also name ``stored_at``, the statement that stored the view.

A finding is *confirmed* when a retention's holder matches it, best evidence first:

* ``stored_at``: the storing statement lies within the finding's statement (same file);
* ``holder site``: a frame, generator or closure holder lives in the finding's function (same file);
* ``holder class``: an object holder's class is the finding's class, or the attribute the holder path
  names is the one the finding stores into (same file).

A retention that matches no finding, in a file the audit read, is listed as *missed*: the audit's
blind spot, for a person to read (or a pattern to teach the audit). Only the report's JSON is read; the
sanitizer itself is not imported.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from sanitizer.audit.engine import AuditResult
from sanitizer.core import report_file
from sanitizer.audit.findings import Finding

_FRAME_KINDS = ("frame", "generator", "closure", "partial")
_ATTR = re.compile(r"\.([A-Za-z_]\w*)")


class ReportError(ValueError):
    """A --report file that cannot be read or is not a sanitizer report."""


def load_report(path: str) -> Dict[str, Any]:
    """The report of a sanitized run (read as ``ownsan triage`` reads it), errors prefixed ``--report``."""
    try:
        return report_file.load(path)
    except report_file.ReportFileError as exc:
        raise ReportError(f"--report: {exc}") from None


def _lease_id(rec: Dict[str, Any]) -> Any:
    lease = rec.get("lease")
    return lease.get("lease_id") if isinstance(lease, dict) else None


def _records(report: Dict[str, Any]) -> Iterable[Dict[str, Any]]:
    """Every retained lease of the report, once: its retention event, or else an error (a stale use)
    that names its holder."""
    seen = set()
    for ev in report.get("events") or ():
        if isinstance(ev, dict) and ev.get("kind") == "retention":
            lease = _lease_id(ev)
            if lease is not None:
                if lease in seen:
                    continue
                seen.add(lease)
            yield ev
    for err in report.get("errors") or ():
        if isinstance(err, dict) and (err.get("holder") or err.get("holders")):
            lease = _lease_id(err)
            if lease is not None and lease in seen:
                continue
            seen.add(lease)
            yield err


def _site(value: Any) -> Optional[Dict[str, Any]]:
    return value if isinstance(value, dict) and value.get("file") else None


def retentions(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One entry per distinct (holder, site, stored_at), with how many retentions it covers."""
    groups: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for rec in _records(report):
        holders = [h for h in (rec.get("holders") or []) if isinstance(h, dict)]
        if not holders and isinstance(rec.get("holder"), dict):
            holders = [rec["holder"]]
        for h in holders[:1] or [{}]:  # the first holder is the one triage names; the rest are aliases
            site, stored = _site(h.get("site")), _site(h.get("stored_at"))
            consumer = h.get("consumer") or h.get("path") or "<unnamed holder>"
            key = (consumer, h.get("kind"), _key(site), _key(stored))
            g = groups.get(key)
            if g is None:
                g = groups[key] = {"holder": consumer, "kind": h.get("kind") or "unknown", "count": 0,
                                   "match": "none", "site": site, "stored_at": stored,
                                   "lent_at": _site(rec.get("lent_at")), "reused_at": _site(rec.get("reused_at"))}
            g["count"] += 1
    return list(groups.values())


def _key(site: Optional[Dict[str, Any]]) -> Tuple[Any, ...]:
    return (site.get("file"), site.get("line"), site.get("function")) if site else ()


def same_file(report_file: Optional[str], path: str) -> bool:
    if not report_file:
        return False
    a = os.path.normpath(report_file)
    b = os.path.normpath(path)
    if a == b:
        return True
    try:
        if os.path.realpath(a) == os.path.realpath(b):
            return True
    except (OSError, ValueError):
        pass
    return not os.path.isabs(b) and a.endswith(os.sep + b)


def _match(r: Dict[str, Any], f: Finding) -> Optional[str]:
    stored = r.get("stored_at")
    if stored is not None:
        line = stored.get("line")
        if same_file(stored.get("file"), f.path) and isinstance(line, int) and f.line <= line <= f.end_line:
            return "stored_at"
        if same_file(stored.get("file"), f.path):
            return None  # the run names another statement of this file: not this one
    site = r.get("site")
    if site is None or not same_file(site.get("file"), f.path):
        return None
    function = site.get("function") or ""
    if r["kind"] in _FRAME_KINDS:
        if function in (f.function, f.consumer):
            return "holder site"
        return None
    if r["kind"] in ("object", "class"):
        owner = f.function.rpartition(".")[0].replace(".<locals>", "")
        if function and (owner == function or owner.endswith("." + function)):
            return "holder class"
        attrs = _ATTR.findall(r["holder"])
        stored_text = f.chain[-1].text if f.chain else ""
        if attrs and re.search(r"\b" + re.escape(attrs[0]) + r"\b", stored_text):
            return "holder class"
    if r["kind"] == "global":
        name = r["holder"].rpartition(".")[2].split("[")[0]
        if name and re.search(r"\b" + re.escape(name) + r"\b", f.chain[-1].text if f.chain else ""):
            return "holder class"
    return None


def crosscheck(result: AuditResult, report: Dict[str, Any], report_path: str,
               audited: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Mark ``result.findings`` confirmed or not (in place) and list the retentions no finding covers."""
    groups = retentions(report)
    for f in result.findings:
        f.confirmed, f.confirmed_by = False, []
    files = list(audited) if audited is not None else sorted({f.path for f in result.findings})
    missed: List[Dict[str, Any]] = []
    outside = 0
    for g in groups:
        hits = [(f, m) for f in result.findings for m in [_match(g, f)] if m is not None]
        if hits:
            best = min(m for _, m in hits)  # "holder class" < "holder site" < "stored_at": any is a match
            for f, m in hits:
                f.confirmed = True
                f.confirmed_by.append(dict(g, match=m))
            g["match"] = best
            continue
        where = g.get("stored_at") or g.get("site")
        if where is not None and any(same_file(where.get("file"), p) for p in files):
            missed.append(g)
        else:
            outside += 1
    return {"report": report_path, "retentions": sum(g["count"] for g in groups),
            "confirmed": sum(1 for f in result.findings if f.confirmed), "missed": missed,
            "outside": outside}


__all__ = ["ReportError", "load_report", "retentions", "crosscheck", "same_file"]
