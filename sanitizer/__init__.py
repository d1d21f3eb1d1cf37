"""ownership-sanitizer: catch reads of borrowed tensors after their staging bytes were reused.

Import cost when off: torch (which you have already) and nothing else; no
dispatch mode, no numba. ``OWNERSHIP_SANITIZE=1`` turns debug mode on at import.
"""
from __future__ import annotations

from . import checksums as _checksums
from .checksums import synchronize, verify
from .errors import BorrowCorruptedError, OwnershipError, StaleBorrowError
from .iterators import borrowed_iterator, emulate_borrowed
from .ledger import Lease, LedgerError, ReuseEvent
from .option_table import OptionError, format_table as options_table
from .ownership import DeferralScope, add_borrowed_marker, own, own_arguments, reset_stats, stats
from .report import report, write_report
from .rescue import rescues
from .ring import StagingRing
from .runtime import (
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
from .staging import BORROWED_MARKER, StagingBuffer
from . import triage as _triage
from .triage import retentions

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
