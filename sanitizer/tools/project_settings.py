"""The runtime's part of a project's ``[tool.ownsan]`` table: its suppressions file.

A team keeps its ownsan settings in one table (``pyproject.toml``'s ``[tool.ownsan]``, as ruff's and mypy's
users do); the audit reads the static keys, ``ownsan run`` and the pytest plugin read ``suppressions``, so a
known finding is let through the same way in a CI run, a test session and a hand run, with no option to
repeat. The table is found and checked by the audit's own reader (:mod:`sanitizer.audit.settings`, torch-free):
one parser, one set of error messages. An explicit ``suppressions=`` option always wins over the table.
"""
from __future__ import annotations

from typing import Mapping, Optional

from sanitizer.audit import settings as _settings


def suppressions_for(start: str) -> Optional[str]:
    """The absolute path ``[tool.ownsan] suppressions`` names in the nearest ``pyproject.toml`` with a
    ``tool.ownsan`` table at or above ``start`` (a directory or a file), or None. A table that cannot be
    used raises :class:`sanitizer.audit.settings.SettingsError`, which names the file and the value."""
    found = _settings.find([start])
    return _settings.load(found).suppressions if found else None


def with_project_suppressions(options: Mapping[str, str], start: str) -> dict:
    """``options`` with ``suppressions=`` from the project's table added when they do not set it."""
    out = dict(options)
    if "suppressions" not in out:
        path = suppressions_for(start)
        if path:
            out["suppressions"] = path
    return out


__all__ = ["suppressions_for", "with_project_suppressions"]
