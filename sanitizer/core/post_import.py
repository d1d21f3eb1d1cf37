"""Run code right after a module executes: one loader wrapper and one finder walk, for both finders.

Two ``sys.meta_path`` finders act on imports: the start-up hook's (``tools/startup.py``: turn the
sanitizer on right after torch executes) and the adapters' (``adapters/__init__.py``: patch a loader
right after its module executes). Neither finds anything itself. Each asks the other finders for the
module's spec (:func:`spec_from_others`, with a per-thread guard so that it does not ask itself again)
and wraps the loader that comes back (:class:`RunAfter`), which executes the module, then calls back.

Standard library only, and little of it, with nothing imported from the ``sanitizer`` package: the
start-up hook loads this file by path at interpreter start-up (importing the package would import
torch), while the adapters import it as ``sanitizer.core.post_import``.
"""
from __future__ import annotations

import sys

if False:  # for the annotations only (never evaluated: `from __future__ import annotations`)
    from typing import Any, Callable


class RunAfter:
    """A module's loader that calls ``after(module)`` once the real loader executed it."""

    def __init__(self, loader: "Any", after: "Callable[[Any], None]"):
        self._loader = loader
        self._after = after

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:  # type: ignore[no-untyped-def]
        self._loader.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> "Any":  # get_source, is_package, resource readers...
        return getattr(self._loader, name)


def asking(busy: "Any", fullname: str) -> bool:
    """Is this thread already asking the other finders for ``fullname`` (so ``find_spec`` answers None)?"""
    return getattr(busy, "name", None) == fullname


def spec_from_others(me: "Any", busy: "Any", fullname: str, path: "Any", target: "Any") -> "Any":
    """The spec the finders other than ``me`` give for ``fullname`` (None when none does). ``busy`` is a
    thread-local object of ``me``'s: while it names ``fullname`` (:func:`asking`), ``me.find_spec`` must
    answer None for it (another finder of the same kind may ask ``me`` back)."""
    before = getattr(busy, "name", None)
    busy.name = fullname
    try:
        for finder in list(sys.meta_path):
            if finder is me or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None
    finally:
        busy.name = before


def wrap(spec: "Any", after: "Callable[[Any], None]") -> "Any":
    """``spec`` with its loader wrapped in :class:`RunAfter` (unchanged when it has no loader to wrap)."""
    if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
        spec.loader = RunAfter(spec.loader, after)
    return spec


def remove(finder: "Any") -> None:
    """Take ``finder`` off ``sys.meta_path`` (nothing when it is not there)."""
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


__all__ = ["RunAfter", "asking", "spec_from_others", "wrap", "remove"]
