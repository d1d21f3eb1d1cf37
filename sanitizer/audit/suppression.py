"""``# ownsan: ignore[OWN101]`` and bare ``# ownsan: ignore`` comments.

A comment suppresses the findings of the statement it ends (on the finding's first or last line), for
the codes it names (all codes when it names none). Comments are read with :mod:`tokenize`, so the same
text inside a string literal suppresses nothing.
"""
from __future__ import annotations

import io
import re
import tokenize
from typing import Dict, FrozenSet, Iterable, List

from sanitizer.audit.findings import Finding

_IGNORE = re.compile(r"#\s*ownsan:\s*ignore(?:\[(?P<codes>[A-Za-z0-9_,\s]*)\])?", re.IGNORECASE)
ALL: FrozenSet[str] = frozenset({"*"})


def suppressions(source: str) -> Dict[int, FrozenSet[str]]:
    """line -> the codes suppressed there (``{"*"}``: every code)."""
    if "ownsan" not in source:
        return {}
    out: Dict[int, FrozenSet[str]] = {}
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        m = _IGNORE.search(tok.string)
        if m is None:
            continue
        codes = m.group("codes")
        named = frozenset(c.strip().upper() for c in (codes or "").split(",") if c.strip())
        out[tok.start[0]] = out.get(tok.start[0], frozenset()) | (named or ALL)
    return out


def is_suppressed(finding: Finding, table: Dict[int, FrozenSet[str]]) -> bool:
    for line in {finding.line, finding.end_line}:
        codes = table.get(line)
        if codes and ("*" in codes or finding.code in codes):
            return True
    return False


def apply(findings: Iterable[Finding], source_of: Dict[str, str]) -> List[Finding]:
    tables: Dict[str, Dict[int, FrozenSet[str]]] = {}
    kept: List[Finding] = []
    for f in findings:
        table = tables.get(f.path)
        if table is None:
            table = tables[f.path] = suppressions(source_of.get(f.path, ""))
        if not is_suppressed(f, table):
            kept.append(f)
    return kept


__all__ = ["suppressions", "is_suppressed", "apply"]
