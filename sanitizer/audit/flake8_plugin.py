"""The audit as a flake8 plugin: the same OWN1xx codes, reported by ``flake8`` (entry point
``flake8.extension``: ``OWN = sanitizer.audit.flake8_plugin:OwnsanAuditChecker``).

flake8 hands the plugin the parsed tree, so nothing is parsed twice; flake8's ``--select``/
``--extend-ignore``/``# noqa`` apply as for any plugin (flake8 reads ``# noqa`` itself, so that its
``--disable-noqa`` still shows every finding), and ``# ownsan: ignore[...]`` still works.
flake8 is not a dependency: the class only follows its plugin protocol.
"""
from __future__ import annotations

import ast
from typing import Iterator, Optional, Sequence, Tuple, Type

from sanitizer.core.version import __version__


class OwnsanAuditChecker:
    name = "ownsan-audit"
    version = __version__

    def __init__(self, tree: ast.Module, filename: str = "<unknown>", lines: Optional[Sequence[str]] = None):
        self.tree = tree
        self.filename = filename
        self.lines = lines

    def _text(self) -> str:
        if self.lines is not None:
            return "".join(self.lines)
        from sanitizer.audit.sources import AuditInputError, decode

        try:  # decoded as Python decodes it (a coding cookie, a BOM), as flake8 itself reads it
            with open(self.filename, "rb") as fh:
                return decode(self.filename, fh.read())
        except (OSError, AuditInputError):
            return ""

    def run(self) -> Iterator[Tuple[int, int, str, Type["OwnsanAuditChecker"]]]:
        from sanitizer.audit import suppression
        from sanitizer.audit.engine import analyse
        from sanitizer.audit.sources import Source

        text = self._text()
        findings, _ = analyse(Source(self.filename, text, self.tree))
        for f in suppression.apply(findings, {self.filename: text}, noqa=False):
            if f.path != self.filename:
                continue
            yield f.line, f.col - 1, f"{f.code} {f.message} (fix: {f.fix})", type(self)


__all__ = ["OwnsanAuditChecker"]
