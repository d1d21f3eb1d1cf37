"""ownership-sanitizer: catch reads of borrowed tensors after their staging bytes were reused.

Import cost when off: nothing but this module. ``import sanitizer`` imports no
torch (and no numba, no dispatch mode) until a torch-facing name is used; the
torch-free names (errors, ledger records, options) come from ``sanitizer.core``.
``OWNERSHIP_SANITIZE=1`` turns debug mode on at import (which loads torch).

The package is a lazy face: :func:`__getattr__` maps each public name to its
module. The features are composed onto the runtime in one explicit place,
:func:`sanitizer.activation.compose`, which :func:`enable` (and the environment
activation) calls: importing a module never installs anything.
"""
from __future__ import annotations

import importlib
import os
import sys

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

# Public names of the torch layer, the features and the activation (imported on first use).
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
    "clear_errors": ("sanitizer.torch_layer.records", "clear_errors"),
    "disable": ("sanitizer.activation", "disable"),
    "enable": ("sanitizer.activation", "enable"),
    "enabled": ("sanitizer.activation", "enabled"),
    "errors": ("sanitizer.torch_layer.records", "errors"),
    "is_borrowed": ("sanitizer.torch_layer.runtime", "is_borrowed"),
    "lease_of": ("sanitizer.torch_layer.runtime", "lease_of"),
    "options": ("sanitizer.torch_layer.runtime", "options"),
    "sanitize": ("sanitizer.activation", "sanitize"),
    "BORROWED_MARKER": ("sanitizer.torch_layer.staging", "BORROWED_MARKER"),
    "StagingBuffer": ("sanitizer.torch_layer.staging", "StagingBuffer"),
    "retentions": ("sanitizer.features.triage", "retentions"),
}

assert set(_CORE) | set(_TORCH) == set(__all__) and not set(_CORE) & set(_TORCH)


def __getattr__(name: str):
    target = _CORE.get(name)
    if target is None:
        target = _TORCH.get(name)
        if target is None:
            raise AttributeError(f"module 'sanitizer' has no attribute {name!r}")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _running_the_cli() -> bool:
    """Is this process ``ownsan`` itself (the console script, or ``python -m sanitizer``)? The command
    line is a tool, not the program to sanitize: ``ownsan run`` hands the switch to its child, and
    ``ownsan doctor`` must answer about a bad switch or a missing torch rather than die of them."""
    argv = list(getattr(sys, "orig_argv", None) or ())
    if sys.argv and os.path.basename(sys.argv[0]) in ("ownsan", "ownsan.exe"):
        return True
    return any(a == "-m" and b == "sanitizer" for a, b in zip(argv, argv[1:])) or "-msanitizer" in argv


if (os.environ.get("OWNERSHIP_SANITIZE") or os.environ.get("OWNERSHIP_SANITIZE_OPTIONS")) and not _running_the_cli():
    from sanitizer.activation import activate_from_environment as _activate_from_environment

    _activate_from_environment()  # activation asked for: enable (or reject bad options) at import
