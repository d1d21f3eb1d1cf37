"""Did-you-mean for every name a user types: options, subcommands, long flags, consumer functions.

One mechanism (:func:`difflib.get_close_matches`) for all of them, so a near miss gets the same kind
of hint wherever it is made. Torch-free, and cheap to import (argparse and difflib only when used).
"""
from __future__ import annotations

import argparse
from typing import Any, Iterable, List, NoReturn, Optional, Sequence

CUTOFF = 0.6  # difflib's own default: "audti" -> "audit", "--reprot" -> "--report"


def close_to(word: str, names: Iterable[str], cutoff: float = CUTOFF) -> Optional[str]:
    """The name closest to ``word`` (a mistyped one), or None when none is close."""
    import difflib

    found = difflib.get_close_matches(word, list(dict.fromkeys(names)), n=1, cutoff=cutoff)
    return found[0] if found else None


def hint(word: str, names: Iterable[str], cutoff: float = CUTOFF) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``names``, or ``""``."""
    found = close_to(word, names, cutoff)
    return f" (did you mean '{found}'?)" if found else ""


class HintingParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors name the bad value and its closest valid one:
    ``invalid choice: 'audti' (did you mean 'audit'?)``, ``unrecognized argument '--reprot' (did you
    mean '--report'?)``. Its subparsers are of the same class. Exit status 2, as argparse's."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices and isinstance(value, str):
            names = [str(c) for c in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint(value, names)} "
                                                 f"(choose from {', '.join(map(repr, names))})")
        super()._check_value(action, value)

    def option_strings(self) -> List[str]:
        return [s for action in self._actions for s in action.option_strings]

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        """Fail on arguments this parser does not know (from ``parse_known_args``): the first unknown
        flag named, with the closest of this parser's own flags."""
        flags = [a for a in extras if a.startswith("-") and a != "--"]
        if not flags:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        bad = flags[0].split("=", 1)[0]
        known = [s for s in self.option_strings() if s.startswith("--") == bad.startswith("--")]
        more = f" (and {len(flags) - 1} more)" if len(flags) > 1 else ""
        self.error(f"unrecognized argument {bad!r}{hint(bad, known)}{more}")

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return parsed


__all__ = ["CUTOFF", "close_to", "hint", "HintingParser"]
