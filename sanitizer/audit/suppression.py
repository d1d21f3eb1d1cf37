"""Suppression comments: the audit's own ``# ownsan: ignore[OWN101]`` (bare: every code), and ``# noqa``
as flake8 and ruff read it (``# noqa: OWN106, OWN107``; bare ``# noqa``: every code on the line), so a code
base that already marks lines for its linters marks them once for ``ownsan audit`` too.

``# ownsan: ignore`` suppresses the findings of the statement it ends (on the finding's first or last line),
its codes compared in any case. ``# noqa`` follows ruff's specification: a case-insensitive ``#noqa`` (space
allowed after ``#``) that ends the comment, or is followed by ``#`` or by whitespace and anything but ``:``,
is a blanket noqa; followed by ``:``, it names the codes that follow (upper-case letters then digits,
separated by commas or whitespace; the list ends at the last valid code), compared case-sensitively, so
``# noqa: own106`` names no code and suppresses nothing, as in ruff. It applies to the line the finding is
reported on. Comments are read with :mod:`tokenize`, so the same text inside a string literal suppresses
nothing.
"""
from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional

from sanitizer.audit.findings import Finding

_IGNORE = re.compile(r"#\s*ownsan:\s*ignore(?:\[(?P<codes>[A-Za-z0-9_,\s]*)\])?", re.IGNORECASE)
_NOQA = re.compile(r"#\s*noqa", re.IGNORECASE)
_NOQA_CODE = re.compile(r"[\s,]*([A-Z]+[0-9]+)")
ALL: FrozenSet[str] = frozenset({"*"})


@dataclass
class Directives:
    """One module's suppression comments: line -> the codes suppressed there (``{"*"}``: every code)."""

    ownsan: Dict[int, FrozenSet[str]] = field(default_factory=dict)  # the statement's first or last line
    noqa: Dict[int, FrozenSet[str]] = field(default_factory=dict)  # the finding's own line


def noqa_codes(comment: str) -> Optional[FrozenSet[str]]:
    """The codes a comment's ``# noqa`` suppresses (``ALL`` for a blanket one); None when it has no valid
    directive (no ``noqa``, ``# noqa-x``, or ``# noqa:`` followed by no code)."""
    for m in _NOQA.finditer(comment):
        rest = comment[m.end():]
        if rest.lstrip().startswith(":"):
            after, codes, pos = rest.lstrip()[1:], [], 0
            while True:
                code = _NOQA_CODE.match(after, pos)
                if code is None:
                    break
                codes.append(code.group(1))
                pos = code.end()
            if codes:
                return frozenset(codes)
            continue  # `# noqa:` naming no code (`# noqa: own106`): ruff warns and suppresses nothing
        if not rest.strip() or rest.startswith("#") or rest[0].isspace():
            return ALL
    return None


def directives(source: str) -> Directives:
    """Every suppression comment of a module's source."""
    out = Directives()
    if "ownsan" not in source and "noqa" not in source.lower():
        return out
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return out
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        m = _IGNORE.search(tok.string)
        if m is not None:
            named = frozenset(c.strip().upper() for c in (m.group("codes") or "").split(",") if c.strip())
            out.ownsan[line] = out.ownsan.get(line, frozenset()) | (named or ALL)
        codes = noqa_codes(tok.string)
        if codes is not None:
            out.noqa[line] = out.noqa.get(line, frozenset()) | codes
    return out


def suppressions(source: str) -> Dict[int, FrozenSet[str]]:
    """line -> the codes ``# ownsan: ignore`` suppresses there (``{"*"}``: every code)."""
    return directives(source).ownsan


def _names(codes: Optional[FrozenSet[str]], code: str) -> bool:
    return bool(codes) and ("*" in codes or code in codes)  # type: ignore[operator]


def is_suppressed(finding: Finding, table: Directives, noqa: bool = True) -> bool:
    """``noqa=False``: only the audit's own comments (flake8 applies ``# noqa`` itself, and its
    ``--disable-noqa`` must still show every finding)."""
    if any(_names(table.ownsan.get(line), finding.code) for line in {finding.line, finding.end_line}):
        return True
    return noqa and _names(table.noqa.get(finding.line), finding.code)


def apply(findings: Iterable[Finding], source_of: Dict[str, str], noqa: bool = True) -> List[Finding]:
    """The findings no comment suppresses (each module's comments read once)."""
    tables: Dict[str, Directives] = {}
    kept: List[Finding] = []
    for f in findings:
        table = tables.get(f.path)
        if table is None:
            table = tables[f.path] = directives(source_of.get(f.path, ""))
        if not is_suppressed(f, table, noqa):
            kept.append(f)
    return kept


__all__ = ["Directives", "directives", "noqa_codes", "suppressions", "is_suppressed", "apply", "ALL"]
