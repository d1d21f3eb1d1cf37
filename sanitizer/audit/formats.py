"""The audit's outputs: ``text`` (each finding with its chain and fix), ``concise`` (one line each, as
flake8 prints), ``json`` (``findings_schema.json``) and ``sarif`` (SARIF 2.1.0, for GitHub code scanning).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Dict, List, Optional
from urllib.parse import quote

from sanitizer.audit.codes import CODES
from sanitizer.audit.engine import AuditResult, Skipped
from sanitizer.audit.findings import Finding
from sanitizer.core.version import __version__

FORMATS = ("text", "concise", "json", "sarif")
JSON_FORMAT = "ownsan-audit"
JSON_VERSION = 1
SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "findings_schema.json")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
INFO_URI = "https://github.com/ownership-sanitizer/ownership-sanitizer/blob/main/docs/audit.md"


def _functions(result: AuditResult) -> int:
    return len({(f.path, f.function) for f in result.findings})


def summary(result: AuditResult) -> Dict[str, Any]:
    by_code: Dict[str, int] = {}
    for f in result.findings:
        by_code[f.code] = by_code.get(f.code, 0) + 1
    return {"findings": len(result.findings), "functions": _functions(result), "by_code": by_code,
            "files": result.files, "lines": result.lines, "consumers": len(result.consumers),
            "suppressed": result.suppressed, "errors": len(result.errors), "skipped": len(result.skipped)}


def summary_line(result: AuditResult) -> str:
    s = summary(result)
    head = (f"{s['findings']} finding{'s' * (s['findings'] != 1)} in {s['functions']} function"
            f"{'s' * (s['functions'] != 1)}" if s["findings"] else "no retaining consumer found")
    tail = (f"{s['consumers']} weight-consuming function{'s' * (s['consumers'] != 1)} in {s['files']} file"
            f"{'s' * (s['files'] != 1)} ({s['lines']} lines)")
    extra = f", {s['suppressed']} suppressed" if s["suppressed"] else ""
    if s["skipped"]:
        files = sum(1 for skip in result.skipped if not skip.function)
        functions = s["skipped"] - files
        parts = [f"{n} {what}{'s' * (n != 1)}" for n, what in ((functions, "function"), (files, "file")) if n]
        extra += f"; {' and '.join(parts)} skipped (not followed: the audit is incomplete)"
    return f"ownsan audit: {head}; looked at {tail}{extra}"


def _confirmation(f: Finding) -> str:
    if f.confirmed is None:
        return ""
    if not f.confirmed:
        return "    run: not seen by the run (not exercised, or owned at runtime)"
    holder = f.confirmed_by[0] if f.confirmed_by else {}
    return f"    run: CONFIRMED: the run saw {holder.get('holder', 'a holder')} keep a borrowed view here"


def to_text(result: AuditResult, crosscheck: Optional[Dict[str, Any]] = None) -> str:
    out: List[str] = []
    for f in result.findings:
        out.append(f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}")
        via = f" (weights from `{f.consumer}`)" if f.consumer and f.consumer != f.function else ""
        out.append(f"    in `{f.function}`{via}: {f.pattern}")
        if f.also_from:
            out.append("    also reached from: " + ", ".join(f"`{fn}` ({p})" for p, fn in f.also_from))
        out.append("    chain: " + " -> ".join(link.render() for link in f.chain))
        out.append(f"    fix: {f.fix}")
        line = _confirmation(f)
        if line:
            out.append(line)
    for err in result.errors:
        out.append(f"error: {err}")
    out.extend(f"skipped: {skip}" for skip in result.skipped)
    if crosscheck is not None:
        out.extend(_crosscheck_text(crosscheck))
    out.append(summary_line(result))
    return "\n".join(out) + "\n"


def _crosscheck_text(cc: Dict[str, Any]) -> List[str]:
    lines = [f"ownsan audit: the run ({cc['report']}) saw {cc['retentions']} retention"
             f"{'s' * (cc['retentions'] != 1)}; {cc['confirmed']} finding{'s' * (cc['confirmed'] != 1)} confirmed, "
             f"{len(cc['missed'])} retaining holder{'s' * (len(cc['missed']) != 1)} the audit missed"]
    for m in cc["missed"]:
        site = m.get("stored_at") or m.get("site") or {}
        where = f"{site.get('file')}:{site.get('line')}" if site.get("file") else "an unknown site"
        lines.append(f"  missed: {m['holder']} ({m['kind']}, {m['count']}x) at {where} in "
                     f"{site.get('function') or '?'}")
    return lines


def to_concise(result: AuditResult, crosscheck: Optional[Dict[str, Any]] = None) -> str:
    out = [f"{f.path}:{f.line}:{f.col}: {f.code} {f.message}" + (" [confirmed by the run]" if f.confirmed else "")
           for f in result.findings]
    out.extend(f"error: {e}" for e in result.errors)
    out.extend(f"skipped: {skip}" for skip in result.skipped)
    if crosscheck is not None:
        out.extend(_crosscheck_text(crosscheck))
    return "\n".join(out) + ("\n" if out else "")


def to_json(result: AuditResult, crosscheck: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    doc: Dict[str, Any] = {
        "format": JSON_FORMAT, "version": JSON_VERSION,
        "tool": {"name": "ownsan audit", "version": __version__},
        "summary": summary(result),
        "findings": [f.to_json() for f in result.findings],
        "errors": list(result.errors),
        "skipped": [_skipped_json(skip) for skip in result.skipped],
    }
    if crosscheck is not None:
        doc["crosscheck"] = crosscheck
    return doc


def _skipped_json(skip: Skipped) -> Dict[str, Any]:
    out: Dict[str, Any] = {"path": skip.path, "reason": skip.reason}
    if skip.function:
        out.update(function=skip.function, line=skip.line)
    return out


def _uri(path: str) -> str:
    rel = path
    if os.path.isabs(path):
        try:
            candidate = os.path.relpath(path)
            rel = path if candidate.startswith("..") else candidate
        except ValueError:
            rel = path
    rel = rel.replace(os.sep, "/")
    # Percent-encoded from the name's own bytes: a URI (RFC 3986) has no raw space or non-ASCII letter,
    # and a name that is not UTF-8 (``caf\xe9.py``, held as a surrogate escape) becomes ``caf%E9.py``,
    # where writing it raw made the SARIF output fail half written.
    rel = quote(os.fsencode(rel) if os.name != "nt" else rel.encode("utf-8", "surrogatepass"), safe="/:")
    return ("file://" + rel) if rel.startswith("/") else rel


def _region(line: int, col: Optional[int] = None, end_line: Optional[int] = None) -> Dict[str, int]:
    region = {"startLine": max(1, line)}
    if col:
        region["startColumn"] = col
    if end_line:
        region["endLine"] = max(region["startLine"], end_line)
    return region


def _fingerprint(f: Finding) -> str:
    key = "\x00".join((f.path, f.function, f.code, f.pattern, f.chain[-1].text if f.chain else ""))
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:32]  # a non-UTF-8 file name


def to_sarif(result: AuditResult, crosscheck: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    codes = list(CODES)
    rules = [{
        "id": c.code, "name": c.name.replace("-", " ").title().replace(" ", ""),
        "shortDescription": {"text": c.title},  # a whole sentence: the rule's title in code scanning
        "fullDescription": {"text": c.meaning},
        "help": {"text": f"Fix: {c.fix}", "markdown": f"**Fix:** {c.fix}"},
        "helpUri": INFO_URI,
        "defaultConfiguration": {"level": "error" if c.code != "OWN120" else "warning"},
        "properties": {"tags": ["ownership", "borrowed-tensor", "use-after-free"]},
    } for c in CODES.values()]
    results = []
    for f in result.findings:
        uri = _uri(f.path)
        flow = [{"location": {"physicalLocation": {"artifactLocation": {"uri": _uri(link.path) if link.path else uri,
                                                                        "uriBaseId": "%SRCROOT%"},
                                                   "region": _region(link.line)},
                              "message": {"text": f"{link.text} (in {link.function})"}}} for link in f.chain]
        entry: Dict[str, Any] = {
            "ruleId": f.code, "ruleIndex": codes.index(f.code),
            "level": "error" if f.code != "OWN120" else "warning",
            "message": {"text": f"{f.message}. {f.pattern}. Fix: {f.fix}"},
            "locations": [{
                "physicalLocation": {"artifactLocation": {"uri": uri, "uriBaseId": "%SRCROOT%"},
                                     "region": _region(f.line, f.col, f.end_line)},
                "logicalLocations": [{"fullyQualifiedName": f.function, "kind": "function"}],
            }],
            "codeFlows": [{"threadFlows": [{"locations": flow}]}],
            "partialFingerprints": {"ownsanAudit/v1": _fingerprint(f)},
        }
        if f.confirmed is not None:
            entry["properties"] = {"confirmedByRun": f.confirmed}
        results.append(entry)
    run: Dict[str, Any] = {
        "tool": {"driver": {"name": "ownsan-audit", "version": __version__, "semanticVersion": __version__,
                            "informationUri": INFO_URI, "rules": rules}},
        "results": results,
    }
    # a file not read or a function not followed: the audit is incomplete (exit status 2)
    invocation: Dict[str, Any] = {"executionSuccessful": not result.errors and not result.skipped}
    notes = [{"level": "error", "message": {"text": e}} for e in result.errors]
    notes += [{"level": "error", "message": {"text": f"skipped {skip}"}, "locations": [_skipped_location(skip)]}
              for skip in result.skipped]
    if notes:
        invocation["toolExecutionNotifications"] = notes
    run["invocations"] = [invocation]
    return {"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}


def _skipped_location(skip: Skipped) -> Dict[str, Any]:
    where: Dict[str, Any] = {"artifactLocation": {"uri": _uri(skip.path), "uriBaseId": "%SRCROOT%"}}
    if skip.line:
        where["region"] = _region(skip.line)
    location: Dict[str, Any] = {"physicalLocation": where}
    if skip.function:
        location["logicalLocations"] = [{"fullyQualifiedName": skip.function, "kind": "function"}]
    return location


def unicode_text(text: str) -> str:
    r"""``text`` as valid Unicode. A file name that is not UTF-8 reaches the audit as a surrogate escape
    (``caf\udce9.py`` for the bytes ``caf\xe9.py``); JSON may not carry a lone surrogate (``json.dumps``
    writes it as ``\udce9``, which strict readers refuse), so the byte is written as ``\xe9``."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate that is no escaped byte
            return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _unicode_doc(doc: Any) -> Any:
    """A JSON-ready document with every string (keys too) made valid Unicode by :func:`unicode_text`."""
    if isinstance(doc, str):
        return unicode_text(doc)
    if isinstance(doc, dict):
        return {_unicode_doc(k): _unicode_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_unicode_doc(v) for v in doc]
    return doc


def render(result: AuditResult, fmt: str, crosscheck: Optional[Dict[str, Any]] = None) -> str:
    """The output in ``fmt``. Text and concise keep a non-UTF-8 file name as its surrogate escape (the
    CLI writes it back as the name's own bytes); JSON and SARIF are always valid UTF-8 JSON."""
    if fmt == "text":
        return to_text(result, crosscheck)
    if fmt == "concise":
        return to_concise(result, crosscheck)
    if fmt == "json":
        return json.dumps(_unicode_doc(to_json(result, crosscheck)), indent=2) + "\n"
    if fmt == "sarif":
        return json.dumps(_unicode_doc(to_sarif(result, crosscheck)), indent=2) + "\n"
    raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")


__all__ = ["FORMATS", "SCHEMA_FILE", "render", "unicode_text", "to_json", "to_sarif", "to_text", "to_concise",
           "summary", "summary_line"]
