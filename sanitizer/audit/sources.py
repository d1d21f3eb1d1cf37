"""Which files an audit reads, and reading them: never importing them (the audited code may import
torch, CUDA libraries or the engine itself; the audit imports none of it)."""
from __future__ import annotations

import ast
import io
import os
import tokenize
from dataclasses import dataclass
from typing import List, Sequence, Set

SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox", "node_modules",
                       ".mypy_cache", ".pytest_cache", "build", "dist", ".eggs"})


class AuditInputError(Exception):
    """A path that does not exist, a file that does not decode or does not parse: a usage error (exit
    status 2)."""


class SkippedFile(AuditInputError):
    """A file the audit cannot follow: an expression nested deeper than ``ast.parse`` reaches (a generated
    4000-term sum). The file is skipped and named with the reason, and the other files are audited and
    decide the exit status."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: skipped: {reason}")
        self.path = path
        self.reason = reason


TOO_DEEP_TO_PARSE = "an expression too deeply nested for the audit to parse (Python's recursion limit)"
TOO_DEEP_TO_FOLLOW = "an expression too deeply nested for the audit to follow (Python's recursion limit)"


@dataclass(frozen=True)
class Source:
    path: str  # as the user named it (relative paths stay relative, as flake8 prints them)
    text: str
    tree: ast.Module


def python_files(paths: Sequence[str]) -> List[str]:
    """Every ``.py`` file named or under a named directory (sorted, hidden and build directories skipped),
    each once: a file named again (``x.py ./x.py /abs/x.py``, a directory and a file in it, a symlink to
    it) is the same file by :func:`os.path.realpath`, and auditing it twice reported each of its
    statements twice. The first name given is the one findings use."""
    out: List[str] = []
    seen: Set[str] = set()

    def add(name: str) -> None:
        real = os.path.realpath(name)
        if real not in seen:
            seen.add(real)
            out.append(name)

    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
                for f in sorted(files):
                    if f.endswith(".py"):
                        add(os.path.join(root, f))
        elif os.path.isfile(path):
            add(path)
        else:
            raise AuditInputError(f"{path}: no such file or directory")
    return out


def read(path: str) -> Source:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise AuditInputError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return parse(path, decode(path, raw))


def decode(path: str, raw: bytes) -> str:
    """The text of a module's bytes, decoded as Python decodes them (PEP 263 and PEP 3120): a UTF-8 BOM
    or a ``# -*- coding: latin-1 -*-`` cookie in the first two lines names the encoding, UTF-8 otherwise.
    Decoding them as UTF-8 alone refused valid modules. Newlines are kept as they are (``ast`` reads
    ``\r\n`` and ``\r`` itself), so the text is the one ``ast`` numbers lines and columns in."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as exc:  # an unknown codec, a BOM with a cookie that is not utf-8
        raise AuditInputError(f"{path}: cannot read it ({exc.msg})") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise AuditInputError(f"{path}: not valid {encoding} text ({exc.reason} at byte {exc.start})") from None


def parse(path: str, text: str) -> Source:
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        raise AuditInputError(f"{path}:{exc.lineno or 0}:{exc.offset or 0}: does not parse: {exc.msg}") from None
    except ValueError as exc:  # source with NUL bytes
        raise AuditInputError(f"{path}: does not parse: {exc}") from None
    except (RecursionError, MemoryError):  # deeper than ast builds Python objects for
        raise SkippedFile(path, TOO_DEEP_TO_PARSE) from None
    return Source(path, text, tree)


__all__ = ["AuditInputError", "SkippedFile", "TOO_DEEP_TO_PARSE", "TOO_DEEP_TO_FOLLOW", "Source", "python_files",
           "read", "decode", "parse", "SKIP_DIRS"]
