"""ownership-sanitizer: catch reads of borrowed tensors after their staging bytes were reused.

Import cost when off: nothing but this module. ``import sanitizer`` imports no
torch (and no numba, no dispatch mode) until a torch-facing name is used; the
torch-free names (errors, ledger records, options) come from ``sanitizer.core``.
``OWNERSHIP_SANITIZE=1`` turns debug mode on at import (which loads torch).

The package is a lazy face: :func:`__getattr__` maps each public name to its
module, and :func:`_load` is the composition root that imports the torch layer
and installs the features the first time anything torch-facing is touched (a
public name, activation, or an import of ``sanitizer.torch_layer``).
"""
from __future__ import annotations

import importlib
import os
import sys
import threading

from sanitizer.core.version import __version__  # single-sourced: pyproject.toml reads it too

__all__ = [
    "StagingBuffer",
    "StagingRing",
    "borrowed_iterator",
    "emulate_borrowed",
    "BORROWED_MARKER",
    "enable",
    "disable",
    "enabled",
    "sanitize",
    "options",
    "options_table",
    "is_borrowed",
    "lease_of",
    "report",
    "write_report",
    "errors",
    "clear_errors",
    "Lease",
    "ReuseEvent",
    "verify",
    "synchronize",
    "own",
    "own_arguments",
    "DeferralScope",
    "stats",
    "reset_stats",
    "add_borrowed_marker",
    "rescues",
    "OwnershipError",
    "StaleBorrowError",
    "BorrowCorruptedError",
    "OptionError",
    "LedgerError",
    "retentions",
]

# Public names served by torch-free modules: no _load() needed.
_CORE = {
    "OwnershipError": ("sanitizer.core.errors", "OwnershipError"),
    "StaleBorrowError": ("sanitizer.core.errors", "StaleBorrowError"),
    "BorrowCorruptedError": ("sanitizer.core.errors", "BorrowCorruptedError"),
    "Lease": ("sanitizer.core.ledger", "Lease"),
    "LedgerError": ("sanitizer.core.ledger", "LedgerError"),
    "ReuseEvent": ("sanitizer.core.ledger", "ReuseEvent"),
    "OptionError": ("sanitizer.core.options", "OptionError"),
    "options_table": ("sanitizer.core.options", "format_table"),
}

# Public names of the torch layer and the features: _load() first.
_TORCH = {
    "verify": ("sanitizer.features.checksums", "verify"),
    "synchronize": ("sanitizer.features.checksums", "synchronize"),
    "borrowed_iterator": ("sanitizer.torch_layer.iterators", "borrowed_iterator"),
    "emulate_borrowed": ("sanitizer.torch_layer.iterators", "emulate_borrowed"),
    "DeferralScope": ("sanitizer.features.ownership", "DeferralScope"),
    "add_borrowed_marker": ("sanitizer.features.ownership", "add_borrowed_marker"),
    "own": ("sanitizer.features.ownership", "own"),
    "own_arguments": ("sanitizer.features.ownership", "own_arguments"),
    "reset_stats": ("sanitizer.features.ownership", "reset_stats"),
    "stats": ("sanitizer.features.ownership", "stats"),
    "report": ("sanitizer.reporting.report", "report"),
    "write_report": ("sanitizer.reporting.report", "write_report"),
    "rescues": ("sanitizer.features.rescue", "rescues"),
    "StagingRing": ("sanitizer.torch_layer.ring", "StagingRing"),
    "clear_errors": ("sanitizer.torch_layer.runtime", "clear_errors"),
    "disable": ("sanitizer.torch_layer.runtime", "disable"),
    "enable": ("sanitizer.torch_layer.runtime", "enable"),
    "enabled": ("sanitizer.torch_layer.runtime", "enabled"),
    "errors": ("sanitizer.torch_layer.runtime", "errors"),
    "is_borrowed": ("sanitizer.torch_layer.runtime", "is_borrowed"),
    "lease_of": ("sanitizer.torch_layer.runtime", "lease_of"),
    "options": ("sanitizer.torch_layer.runtime", "options"),
    "sanitize": ("sanitizer.torch_layer.runtime", "sanitize"),
    "BORROWED_MARKER": ("sanitizer.torch_layer.staging", "BORROWED_MARKER"),
    "StagingBuffer": ("sanitizer.torch_layer.staging", "StagingBuffer"),
    "retentions": ("sanitizer.features.triage", "retentions"),
}

assert set(_CORE) | set(_TORCH) == set(__all__) and not set(_CORE) & set(_TORCH)

_load_lock = threading.RLock()
_loaded = False  # the composition root ran
_loading = False  # it is running (a re-entrant call from the imports it makes returns at once)


def _load(blocking: bool = True) -> None:
    """The composition root: import the torch layer, install the features, read the environment (once).

    ``blocking=False`` (from inside an import, which holds that module's import lock) returns at once when
    another thread is already loading, rather than wait on it and risk a lock-order deadlock."""
    global _loaded, _loading
    if _loaded:
        return
    if not _load_lock.acquire(blocking):
        return
    try:
        if _loaded or _loading:
            return
        _loading = True
        try:
            from sanitizer.features import checksums as _checksums
            from sanitizer.features import guard as _guard
            from sanitizer.features import triage as _triage
            from sanitizer.features.rescue import install as _install_rescue
            from sanitizer.reporting.report import install as _install_report
            from sanitizer.torch_layer.runtime import activate_from_environment as _activate_from_environment

            _checksums.install()
            _triage.install()
            _install_rescue()  # enable(rescue=1) installs its hooks
            _guard.install()  # enable(guard=1), the default, installs its hooks
            _install_report()  # enable(report=path) writes the report at exit
            _loaded = True
        finally:
            _loading = False
        try:
            sys.meta_path.remove(_SanitizerFinder)
        except ValueError:
            pass
        _activate_from_environment()
    finally:
        _load_lock.release()


_depth = threading.local()  # per thread: how many sanitizer modules are being executed right now


class _ComposingLoader:
    """Wraps the loader of every ``sanitizer.*`` module until the composition root has run: once the
    outermost sanitizer import that brought in the torch layer finishes (by any route:
    ``import sanitizer.torch_layer.runtime``, ``sanitizer.testing.demo``...), :func:`_load` installs the
    features, as the eager package import used to do. Waiting for the outermost import keeps a module
    that imports the torch layer (``sanitizer.reporting.report``) from being needed half-initialised."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        level = getattr(_depth, "n", 0)
        _depth.n = level + 1
        try:
            self._loader.exec_module(module)
        finally:
            _depth.n = level
        if level == 0 and not _loaded and __name__ + ".torch_layer" in sys.modules:
            _load(blocking=False)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _SanitizerFinder:
    """A meta-path finder for ``sanitizer.*`` that asks the finders after it and wraps their loader;
    it leaves ``sys.meta_path`` once the composition root has run."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if _loaded:
            try:
                sys.meta_path.remove(cls)
            except ValueError:
                pass
            return None
        if not fullname.startswith(__name__ + "."):
            return None
        finders = sys.meta_path
        i = finders.index(cls) if cls in finders else -1
        for finder in finders[i + 1:]:
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ComposingLoader(spec.loader)
                return spec
        return None


if __name__ + ".torch_layer" not in sys.modules:
    sys.meta_path.insert(0, _SanitizerFinder)
else:  # pragma: no cover  (the package re-imported after its torch layer)
    _load()


def __getattr__(name: str):
    target = _CORE.get(name)
    if target is None:
        target = _TORCH.get(name)
        if target is None:
            raise AttributeError(f"module 'sanitizer' has no attribute {name!r}")
        _load()
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if os.environ.get("OWNERSHIP_SANITIZE") or os.environ.get("OWNERSHIP_SANITIZE_OPTIONS"):
    _load()  # activation asked for: enable (or reject bad options) at import, as before
