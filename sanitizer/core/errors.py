"""Error types and the ASan-style report text.

The first line is one sentence that says what was used, what reused it and in
which op; three short stacks follow (lent at, reused at, used at). Programs get
the same facts as attributes and as a JSON-ready ``record``.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional

from sanitizer.core.ledger import Lease, ReuseEvent
from sanitizer.core.sites import Site, format_site, to_records


def _record(kind: str, summary: str, **fields: Any) -> Dict[str, Any]:
    """The JSON-ready report entry every error carries: its kind, summary and own fields, then
    the thread and process that raised it."""
    return {"kind": kind, "summary": summary, **fields,
            "thread": threading.current_thread().name, "pid": os.getpid()}


def _event_lines(event: ReuseEvent) -> List[str]:
    """The "reused at" (or "closed at") header and stack of a report."""
    return [f"  {'closed' if event.kind == 'close' else 'reused'} at (thread {event.thread or '?'}):",
            format_site(event.site)]


class OwnershipError(RuntimeError):
    """Base of the sanitizer's errors about borrowed memory."""


class StaleBorrowError(OwnershipError):
    """A borrowed view was read or written after its staging bytes were reused or freed.

    Attributes: ``lease`` (the :class:`~sanitizer.core.ledger.Lease`), ``event``
    (the :class:`~sanitizer.core.ledger.ReuseEvent` that made it stale), ``op``
    (the aten op, as text), ``used_at`` (the captured stack) and ``record``
    (the JSON-ready report entry).
    """

    def __init__(self, lease: Lease, event: ReuseEvent, op: str, used_at: Site, used_as: Optional[dict] = None):
        self.lease = lease
        self.event = event
        self.op = op
        self.used_at = used_at
        self.used_as = used_as
        self.summary = stale_summary(lease, event, op)
        self.record = _record(
            "stale_use", self.summary, op=op, lease=lease.to_dict(), event=event.to_dict(),
            used_as=used_as, used_at=to_records(used_at),
        )
        super().__init__(self.render())

    def render(self) -> str:
        lease, event = self.lease, self.event
        via = ""
        if self.used_as and (tuple(self.used_as["shape"]) != lease.shape or self.used_as["dtype"] != lease.dtype):
            via = f" (through a derived view {self.used_as['dtype']}{list(self.used_as['shape'])})"
        return "\n".join([
            self.summary + via,
            f"  lent at (generation {lease.generation}, bytes [{lease.start:#x}, {lease.end:#x}) "
            f"of '{lease.region_name}'):",
            format_site(lease.site),
            *_event_lines(event),
            f"  used at (thread {threading.current_thread().name}):",
            format_site(self.used_at),
        ])


class BorrowCorruptedError(OwnershipError):
    """A lease's bytes changed behind the buffer API (checksum mismatch), e.g. a write through
    ``data_ptr``, DMA, numpy or another library's kernel into a view that was still lent.

    Attributes: ``lease``, ``expected`` and ``found`` (64-bit hashes; ``found`` is None when
    only a device-side flag said "differs"), ``where`` ("reuse", "verify", "synchronize"),
    ``event`` (the reuse that triggered the check, if any), ``verified_at`` and ``record``.
    """

    def __init__(self, lease: Lease, expected: Optional[int], found: Optional[int], where: str,
                 verified_at: Site, event: Optional[ReuseEvent] = None):
        self.lease, self.expected, self.found, self.where = lease, expected, found, where
        self.event, self.verified_at = event, verified_at
        found_text = f"{found:#018x}" if found is not None else "a different value (device flag)"
        expected_text = f"{expected:#018x}" if expected is not None else "?"
        self.summary = (
            f"borrowed view {lease.describe()} in staging buffer '{lease.region_name}' bytes "
            f"[{lease.start:#x}, {lease.end:#x}) changed behind the buffer API while lent "
            f"(checksum expected {expected_text}, found {found_text}; checked at {where})"
        )
        self.record = _record(
            "checksum_mismatch", self.summary, where=where, expected=expected, found=found,
            lease=lease.to_dict(), event=event.to_dict() if event is not None else None,
            verified_at=to_records(verified_at),
        )
        super().__init__(self.render())

    def render(self) -> str:
        lines = [
            self.summary,
            f"  lent at (generation {self.lease.generation}):",
            format_site(self.lease.site),
        ]
        if self.event is not None:
            lines += _event_lines(self.event)
        lines += [f"  verified at (thread {threading.current_thread().name}):", format_site(self.verified_at)]
        return "\n".join(lines)


def stale_summary(lease: Lease, event: ReuseEvent, op: str) -> str:
    """``borrowed view 'w' bfloat16[256, 128] used after staging buffer 'ring0' reused ... in aten.sum.default``."""
    return f"borrowed view {lease.describe()} used after {event.describe()} in {op}"


__all__ = ["OwnershipError", "StaleBorrowError", "BorrowCorruptedError", "stale_summary"]
