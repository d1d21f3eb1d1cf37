"""Short source text of a node, for chains and messages.

Cut from the module's own lines (what the user wrote, and about 50x cheaper than ``ast.unparse``,
which a chain link would otherwise pay on every view of every yielded tensor); a node whose line is
not plain ASCII (``col_offset`` counts UTF-8 bytes) falls back to ``ast.unparse``.
"""
from __future__ import annotations

import ast
import re
from typing import List, Optional

_LINE_END = re.compile(r"\r\n|\r|\n")


def source_lines(text: str) -> List[str]:
    r"""The lines of a module as Python's tokenizer (and so ``ast``'s line numbers) counts them: ended by
    ``\n``, ``\r\n`` or ``\r`` only. ``str.splitlines`` also splits on a form feed, ``\v``, ``\x1c``-``\x1e``,
    ``\x85``, U+2028 and U+2029, which Python reads inside a line (a form feed in indentation, any of
    them in a comment or a string): every line below one was quoted one line off."""
    return _LINE_END.split(text)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unparsed(node: ast.AST, limit: int = 48) -> str:
    try:
        return _clip(ast.unparse(node), limit)
    except Exception:  # an odd tree is never worth a crash
        return type(node).__name__


class Snippets:
    def __init__(self, text: str):
        self._lines: Optional[List[str]] = None
        self._text = text

    def __call__(self, node: ast.AST, limit: int = 48) -> str:
        line = getattr(node, "lineno", None)
        col = getattr(node, "col_offset", None)
        if line is None or col is None:
            return unparsed(node, limit)
        if self._lines is None:
            self._lines = source_lines(self._text)
        if not 0 < line <= len(self._lines):
            return unparsed(node, limit)
        src = self._lines[line - 1]
        if not src.isascii():
            return unparsed(node, limit)
        end_line = getattr(node, "end_lineno", line) or line
        end_col = getattr(node, "end_col_offset", None)
        if end_col is None or end_line - line > 6 or end_line > len(self._lines):
            return unparsed(node, limit)
        if end_line == line:
            return _clip(src[col:end_col], limit)
        parts = [src[col:]] + [x.strip() for x in self._lines[line:end_line - 1]]
        last = self._lines[end_line - 1]
        if not all(x.isascii() for x in parts) or not last.isascii():
            return unparsed(node, limit)
        text = " ".join(parts + [last[:end_col].strip()])
        return _clip(text, limit)


__all__ = ["Snippets", "source_lines", "unparsed"]
