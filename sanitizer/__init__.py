"""ownership-sanitizer: catch reads of borrowed tensors after their staging bytes were reused.

Import cost when off: torch (which you have already) and nothing else; no
dispatch mode, no numba. ``OWNERSHIP_SANITIZE=1`` turns debug mode on at import.
"""
from __future__ import annotations

from sanitizer.features import checksums as _checksums
from sanitizer.features.checksums import synchronize, verify
from sanitizer.core.errors import BorrowCorruptedError, OwnershipError, StaleBorrowError
from sanitizer.torch_layer.iterators import borrowed_iterator, emulate_borrowed
from sanitizer.core.ledger import Lease, LedgerError, ReuseEvent
from sanitizer.core.options import OptionError, format_table as options_table
from sanitizer.features.ownership import DeferralScope, add_borrowed_marker, own, own_arguments, reset_stats, stats
from sanitizer.reporting.report import report, write_report
from sanitizer.features.rescue import rescues
from sanitizer.torch_layer.ring import StagingRing
from sanitizer.torch_layer.runtime import (
    activate_from_environment as _activate_from_environment,
    clear_errors,
    disable,
    enable,
    enabled,
    errors,
    is_borrowed,
    lease_of,
    options,
    sanitize,
)
from sanitizer.torch_layer.staging import BORROWED_MARKER, StagingBuffer
from sanitizer.features import triage as _triage
from sanitizer.features.triage import retentions

__version__ = "0.1.0"

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

_checksums.install()
_triage.install()
_activate_from_environment()
