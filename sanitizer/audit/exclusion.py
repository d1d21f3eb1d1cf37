"""Which files under an audited directory are left out: ruff's ``exclude`` / ``extend-exclude``.

As ruff's ``exclude`` (its settings docs): "Exclusions are based on globs, and can be either: Single-path
patterns, like .mypy_cache (to exclude any directory named .mypy_cache in the tree), foo.py (to exclude any
file named foo.py), or foo_*.py (to exclude any file matching foo_*.py). Relative patterns, like
directory/foo.py (to exclude that specific file) or directory/*.py (to exclude any Python files in
directory). Note that these paths are relative to the project root (e.g., the directory containing your
pyproject.toml)." So a pattern is matched against each file's and directory's own name, and against its
path relative to the project root (``*`` crosses ``/`` there, as in ruff's globs); an excluded directory is
not walked. ``exclude`` replaces the default list (build, cache and virtual-environment directories, and
hidden ones), ``extend-exclude`` adds to it. A file or directory named on the command line is audited
whatever the patterns say, as ruff lints it (without ``--force-exclude``).
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox", ".nox", "node_modules",
                       ".mypy_cache", ".pytest_cache", "build", "dist", ".eggs"})
DEFAULT_EXCLUDE: Tuple[str, ...] = tuple(sorted(SKIP_DIRS)) + (".*",)  # ".*": any hidden directory or file


@dataclass(frozen=True)
class Exclusion:
    patterns: Tuple[str, ...] = DEFAULT_EXCLUDE
    root: Optional[str] = None  # the project root relative patterns are read from (None: the current directory)

    @classmethod
    def of(cls, exclude: Optional[Sequence[str]], extend: Sequence[str] = (), root: Optional[str] = None) -> "Exclusion":
        """``exclude`` (None: the default list) plus ``extend``."""
        base = DEFAULT_EXCLUDE if exclude is None else tuple(exclude)
        return cls(tuple(_normal(p) for p in base + tuple(extend)), root)

    def excludes(self, path: str) -> bool:
        """Is ``path`` (a file or directory met while walking an audited directory) left out?"""
        name = os.path.basename(os.path.normpath(path))
        absolute = os.path.abspath(path)
        rel = os.path.relpath(absolute, os.path.abspath(self.root or os.curdir)).replace(os.sep, "/")
        for pattern in self.patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return True
            if os.path.isabs(pattern):
                if fnmatch.fnmatchcase(absolute.replace(os.sep, "/"), pattern.replace(os.sep, "/")):
                    return True
            elif not rel.startswith("../") and fnmatch.fnmatchcase(rel, pattern):
                return True
        return False


def _normal(pattern: str) -> str:
    pattern = pattern.replace(os.sep, "/")
    while pattern.startswith("./"):
        pattern = pattern[2:]
    return pattern.rstrip("/") or pattern


DEFAULT = Exclusion()

__all__ = ["Exclusion", "DEFAULT", "DEFAULT_EXCLUDE", "SKIP_DIRS"]
