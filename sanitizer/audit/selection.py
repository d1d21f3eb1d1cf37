"""Which codes are reported: ruff's rule selection, spelt as ruff spells it, so a team's habits carry over.

A selector is a whole code (``OWN106``), a prefix of codes (``OWN1``, ``OWN``) or ``ALL``, compared
case-sensitively (``own106`` is an error, as in ruff). A :class:`RuleSelection` is one source's
``select`` / ``extend-select`` / ``ignore`` (``[tool.ownsan]``, then the command line, which has the higher
priority). As ruff resolves them (its docs, "Rule selection"): "Ruff uses the 'highest-priority' select as
the basis for the rule set, and then applies extend-select and ignore adjustments. CLI options are given
higher priority than pyproject.toml options". Within one source, a more specific selector wins over a less
specific one (ruff's ``lint.select``: "When breaking ties between enabled and disabled rules (via select and
ignore, respectively), more specific prefixes override less specific prefixes. ignore takes precedence over
select if the same prefix appears in both."): ``--select ALL --ignore OWN107`` reports all but OWN107,
``--ignore ALL --select OWN107`` only OWN107. A source whose ``select`` is empty and that only ignores
carries its ignores over to the next source, as ruff's does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Sequence, Tuple

from sanitizer.audit.codes import CODES, CodeSelectionError

ALL = "ALL"


@dataclass(frozen=True)
class RuleSelection:
    """One source's selectors; ``select=None``: this source does not set the basis."""

    select: Optional[Tuple[str, ...]] = None
    extend_select: Tuple[str, ...] = ()
    ignore: Tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return self.select is not None or bool(self.extend_select) or bool(self.ignore)


def parse_selectors(items: Iterable[str], option: str) -> Tuple[str, ...]:
    """``["OWN101,OWN12", "ALL"]`` -> the selectors, each checked: one that selects no code is a
    :class:`CodeSelectionError` naming ``option`` and the value (a lower-case code says so)."""
    out = []
    for raw in items:
        for item in (p.strip() for p in raw.split(",")):
            if not item:
                continue
            if item != ALL and not any(c.startswith(item) for c in CODES):
                hint = (f" (codes are upper case: {item.upper()})"
                        if item.upper() == ALL or any(c.startswith(item.upper()) for c in CODES) else "")
                raise CodeSelectionError(f"{option} {item!r}: no such code{hint} (known: ALL, {', '.join(CODES)})")
            out.append(item)
    return tuple(out)


def codes_of(selector: str) -> Tuple[str, ...]:
    return tuple(CODES) if selector == ALL else tuple(c for c in CODES if c.startswith(selector))


def _specificity(selector: str) -> int:
    return 0 if selector == ALL else len(selector)


def resolve(selections: Sequence[RuleSelection]) -> Tuple[str, ...]:
    """The codes reported after ``selections``, lowest priority first (every code when none selects)."""
    chosen = set(CODES)
    carried: Tuple[str, ...] = ()
    for selection in selections:
        ignores, carried = selection.ignore + carried, ()
        updates: Dict[str, bool] = {}
        enabling = (selection.select or ()) + selection.extend_select
        for spec in sorted({_specificity(s) for s in enabling + ignores}):
            for selector in enabling:
                if _specificity(selector) == spec:
                    updates.update(dict.fromkeys(codes_of(selector), True))
            for selector in ignores:
                if _specificity(selector) == spec:
                    updates.update(dict.fromkeys(codes_of(selector), False))
        if selection.select is not None:
            chosen = {code for code, on in updates.items() if on}
            if not selection.select and not selection.extend_select and selection.ignore:
                carried = selection.ignore
        else:
            chosen |= {code for code, on in updates.items() if on}
            chosen -= {code for code, on in updates.items() if not on}
    return tuple(c for c in CODES if c in chosen)


__all__ = ["ALL", "RuleSelection", "parse_selectors", "codes_of", "resolve"]
