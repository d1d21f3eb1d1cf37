"""Which files an audit reads, and reading them: never importing them (the audited code may import
torch, CUDA libraries or the engine itself; the audit imports none of it)."""
from __future__ import annotations

import ast
import io
import os
import threading
import warnings
import tokenize
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set

from sanitizer.audit.exclusion import DEFAULT as DEFAULT_EXCLUSION, SKIP_DIRS, Exclusion


class AuditInputError(Exception):
    """A path that does not exist, a file that does not decode or does not parse: a usage error (exit
    status 2)."""


TOO_DEEP_TO_FOLLOW = "nested too deeply for the audit to follow (Python's recursion limit)"


@dataclass(frozen=True)
class Source:
    path: str  # as the user named it (relative paths stay relative, as flake8 prints them)
    text: str
    tree: ast.Module


def python_files(paths: Sequence[str], exclusion: Optional[Exclusion] = None) -> List[str]:
    """Every ``.py`` file named or under a named directory (sorted; what ``exclusion`` names is left out
    of a walked directory: by default hidden, build and cache directories), each once: a file named again (``x.py ./x.py /abs/x.py``, a directory and a file in it, a symlink to
    it) is the same file by :func:`os.path.realpath`, and auditing it twice reported each of its
    statements twice. The first name given is the one findings use."""
    out: List[str] = []
    seen: Set[str] = set()

    def add(name: str) -> None:
        real = os.path.realpath(name)
        if real not in seen:
            seen.add(real)
            out.append(name)

    exclusion = exclusion or DEFAULT_EXCLUSION
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not exclusion.excludes(os.path.join(root, d)))
                for f in sorted(files):
                    if f.endswith(".py") and not exclusion.excludes(os.path.join(root, f)):
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
    except SyntaxError as exc:  # an unknown codec, a BOM with a cookie that is not utf-8, or bytes that are
        try:                    # not UTF-8 in the first two lines (said as "missing encoding declaration")
            raw.decode("utf-8")
        except UnicodeDecodeError as bad:
            if exc.msg.startswith("invalid or missing encoding declaration"):
                raise AuditInputError(f"{path}: not valid utf-8 text ({bad.reason} at byte {bad.start})") from None
        raise AuditInputError(f"{path}: cannot read it ({exc.msg})") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        raise AuditInputError(f"{path}: not valid {encoding} text ({exc.reason} at byte {exc.start})") from None


def parse(path: str, text: str) -> Source:
    """The module's tree. Whatever Python itself cannot compile (a syntax error, a NUL byte, an expression
    nested deeper than its parser takes, memory) is an :class:`AuditInputError` naming the file."""
    try:
        try:
            tree = _quietly(ast.parse, text, filename=path)
        except RecursionError:
            tree = _parse_from_the_top(text, path)
    except SyntaxError as exc:  # (3.12+: a NUL byte too, with no line)
        where = f"{path}:{exc.lineno}:{exc.offset or 0}" if exc.lineno else path
        raise AuditInputError(f"{where}: does not parse: {exc.msg}") from None
    except ValueError as exc:  # source with NUL bytes
        raise AuditInputError(f"{path}: does not parse: {exc}") from None
    except RecursionError:
        raise AuditInputError(f"{path}: does not parse: an expression nested too deeply for Python's parser "
                              f"(Python cannot compile it either)") from None
    except MemoryError:  # 3.11's parser stack (about 3,000 levels of a right-nested `a ** b ** ...`), or memory
        raise AuditInputError(f"{path}: does not parse: Python's parser ran out of memory (an expression nested "
                              f"too deeply for it, or too large a file)") from None
    return Source(path, text, tree)


def _quietly(parse, *args, **kwargs):  # type: ignore[no-untyped-def]
    """``parse`` with the compiler's warnings about the audited code silenced (an invalid escape such as
    ``"\\."`` is a DeprecationWarning on 3.11 and a SyntaxWarning, printed by default, on 3.12+): they are the
    audited project's business, printed by its own interpreter; from a linter they were noise on stderr
    (ruff and flake8 print none either)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return parse(*args, **kwargs)


def _parse_from_the_top(text: str, path: str) -> ast.Module:
    """``ast.parse`` as at the top of a program: in a thread of its own. Python's parser allows nesting in
    proportion to what is left of the caller's recursion budget (3.11: the recursion limit left; 3.12+: the
    C stack left), so called some frames deep (the audit, pytest, a flake8 run) it refused a 2,950-level sum
    that ``python file.py`` compiles. A new thread starts with the whole budget: it takes what Python
    compiles at the top and no more (a file it still refuses is one Python cannot compile)."""
    out: List[object] = []

    def run() -> None:
        try:
            out.append(_quietly(ast.parse, text, filename=path))
        except BaseException as exc:  # handed to the caller, which names the file
            out.append(exc)

    thread = threading.Thread(target=run, name="ownsan-audit-parse", daemon=True)
    thread.start()
    thread.join()
    result = out[0] if out else RecursionError("the parser's thread ended without a result")
    if isinstance(result, BaseException):
        raise result
    return result  # type: ignore[return-value]


__all__ = ["AuditInputError", "TOO_DEEP_TO_FOLLOW", "Source", "python_files", "read", "decode", "parse",
           "SKIP_DIRS"]
