"""Runtime suppressions (option ``suppressions=FILE``): findings a team knows about, counted and listed as
suppressed, never failing the run, as LeakSanitizer's and ASan's suppression files do.

A team that knows one consumer keeps views on purpose (or waits on an upstream fix) could only turn
``fail_on_retention`` off for everything. The file names exactly what to let through, one rule a line,
``KIND:PATTERN`` as LSan spells ``leak:PATTERN``; ``#`` starts a comment, blank lines are skipped:

    # vLLM's weight mapper keeps the last shard until the next file (upstream #1234)
    retention:WeightsMapper.apply*
    stale_use:*/engine/warmup.py:*
    error:layers.*.router.weight

KIND is ``retention``, ``stale_use``, ``checksum_mismatch``, ``error`` (any error) or ``*`` (any finding).
PATTERN is a shell glob (``fnmatch``, case-sensitive) matched against every name the finding carries: the
lease's name, the holder's consumer and path (``Model.pending[*]``), each frame it names (the storing
statement, the holder's site, the use and the lend) as ``file:line``, as ``file`` and as its function.
One match suppresses the finding. Pure and torch-free: the report builder and the recover printer call it.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

KINDS = ("retention", "stale_use", "checksum_mismatch", "error", "*")
_ERRORS = ("stale_use", "checksum_mismatch")


class SuppressionError(ValueError):
    """A suppressions file that cannot be used: names the file, the line and the problem."""


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: str
    where: str  # FILE:LINE of the rule, for the report

    def text(self) -> str:
        return f"{self.kind}:{self.pattern}"

    def covers(self, kind: str) -> bool:
        return self.kind == "*" or self.kind == kind or (self.kind == "error" and kind in _ERRORS)


def parse(text: str, path: str = "<suppressions>") -> Tuple[Rule, ...]:
    rules: List[Rule] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        kind, sep, pattern = line.partition(":")
        kind, pattern = kind.strip(), pattern.strip()
        if not sep or kind not in KINDS:
            raise SuppressionError(f"{path}:{number}: {raw.strip()!r}: a rule is KIND:PATTERN, KIND one of "
                                   f"{', '.join(KINDS)}")
        if not pattern:
            raise SuppressionError(f"{path}:{number}: {raw.strip()!r}: the pattern is empty")
        rules.append(Rule(kind, pattern, f"{path}:{number}"))
    return tuple(rules)


_CACHE: Dict[str, Tuple[float, Tuple[Rule, ...]]] = {}


def load(path: str) -> Tuple[Rule, ...]:
    """The rules of ``path`` (read again when the file changed); :class:`SuppressionError` when unreadable."""
    try:
        stamp = os.stat(path).st_mtime
    except OSError as exc:
        raise SuppressionError(f"{path}: cannot read the suppressions file ({exc.strerror or exc})") from None
    cached = _CACHE.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise SuppressionError(f"{path}: cannot read the suppressions file ({exc})") from None
    rules = parse(text, path)
    _CACHE[path] = (stamp, rules)
    return rules


def check(path: str) -> Optional[str]:
    """For the option table: why ``path`` cannot serve as a suppressions file, or None."""
    if not path:
        return None
    try:
        load(path)
    except SuppressionError as exc:
        return str(exc)
    return None


def _frames(value: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(value, Mapping) and "file" in value:
        yield value
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and "file" in item:
                yield item


def subjects(record: Mapping[str, Any]) -> List[str]:
    """Every name a finding carries that a rule may match (see the module's docstring)."""
    out: List[str] = []
    lease = record.get("lease") or {}
    if isinstance(lease, Mapping):
        out += [str(lease.get("name"))] if lease.get("name") is not None else []
        out += [str(n) for n in record.get("leases") or () if n is not None]
    holders = [record.get("holder")] + list(record.get("holders") or ())
    for holder in holders:
        if not isinstance(holder, Mapping):
            continue
        out += [str(holder[k]) for k in ("consumer", "path") if holder.get(k)]
        ambiguous = len(holder.get("stored_candidates") or ()) > 1  # (a guess among them: matched by none)
        for key in ("site",) if ambiguous else ("stored_at", "site"):
            for frame in _frames(holder.get(key)):
                out += _frame_names(frame)
    for key in ("used_at", "verified_at", "site"):
        for frame in _frames(record.get(key)):
            out += _frame_names(frame)
    if isinstance(lease, Mapping):
        for frame in _frames(lease.get("site")):
            out += _frame_names(frame)
    return out


def _frame_names(frame: Mapping[str, Any]) -> List[str]:
    file, line, function = frame.get("file"), frame.get("line"), frame.get("function")
    names = [str(file)] if file else []
    if file and line is not None:
        names.append(f"{file}:{line}")
    if function:
        names.append(str(function))
    return names


def match(rules: Tuple[Rule, ...], record: Mapping[str, Any], kind: Optional[str] = None) -> Optional[Rule]:
    """The first rule that suppresses ``record`` (its ``kind`` unless given), or None."""
    kind = kind or str(record.get("kind", ""))
    wanted = [r for r in rules if r.covers(kind)]
    if not wanted:
        return None
    names = subjects(record)
    for rule in wanted:
        if any(fnmatch.fnmatchcase(name, rule.pattern) for name in names):
            return rule
    return None


def suppressed_by_file(path: str, record: Mapping[str, Any]) -> bool:
    """Whether the file at ``path`` suppresses ``record``: the one question the recover printer and a halting
    raise ask (a file unreadable since the option was checked suppresses nothing)."""
    try:
        return match(load(path), record) is not None
    except SuppressionError:
        return False


__all__ = ["KINDS", "Rule", "SuppressionError", "parse", "load", "check", "subjects", "match", "suppressed_by_file"]
