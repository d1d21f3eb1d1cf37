"""Error types and the ASan-style report text.

The first line is one sentence that says what was used, what reused it and in
which op; three short stacks follow (lent at, reused at, used at). Programs get
the same facts as attributes and as a JSON-ready ``record``.

Errors travel: they pickle (a ``ProcessPoolExecutor`` or ``multiprocessing``
boundary), ``copy.copy`` and ``copy.deepcopy``. What travels is the report text
and the JSON-ready record; the live ledger objects (``lease``, ``event``, whose
stacks hold code objects) stay behind and arrive as read-only snapshots built
from the record (``err.lease.name``, ``err.event.by``... still work). An error
holds no tensor and no frame: only what its report needs.

Errors are inert values. Building, printing, copying or pickling one calls
nothing outside this module's formatting: who holds the lease is decided
before the error is built (the runtime's stale-use hooks; triage names the
holder) and passed in as a plain dict.
"""
from __future__ import annotations

import copy
import os
import threading
import types
from typing import Any, Dict, List, Mapping, Optional

from sanitizer.core.ledger import Lease, ReuseEvent
from sanitizer.core.describe import describe_event, describe_lease, fix_hint
from sanitizer.core.sites import Site, format_site, frame_text, site_text, to_records


def _record(kind: str, summary: str, **fields: Any) -> Dict[str, Any]:
    """The JSON-ready report entry every error carries: its kind, summary and own fields, then
    the thread and process that raised it."""
    return {"kind": kind, "summary": summary, **fields,
            "thread": threading.current_thread().name, "pid": os.getpid()}


def fix_site(holder: Optional[Mapping[str, Any]]) -> Optional[str]:
    """``file:line`` where an error's fix goes: where its holder stored the view (else where the holder
    lives); None when no holder is known. The one source of the line an error's ``fix:`` names."""
    holder = holder or {}
    ambiguous = _candidates(holder)
    if ambiguous:
        return "one of " + ", ".join(ambiguous)
    return site_text(holder.get("stored_at") or holder.get("site"))


def _candidates(holder: Mapping[str, Any]) -> List[str]:
    """The storing statements a holder may have been filled at, when the run could not tell which (two
    stores into one dict: the triage table says "one of"); [] when it knows the one."""
    found = [site_text(c) for c in holder.get("stored_candidates") or ()]
    found = [c for c in dict.fromkeys(found) if c]
    return found if len(found) > 1 else []


def _event_lines(event: ReuseEvent) -> List[str]:
    """The "reused at" (or "closed at") header and stack of a report."""
    return [f"  {'closed' if event.kind == 'close' else 'reused'} at (thread {event.thread or '?'}):",
            format_site(event.site)]


def _held_by(holder: Dict[str, Any], verb: str) -> str:
    ambiguous = _candidates(holder)
    stored = frame_text(holder.get("stored_at"))
    where = (f"stored at one of {', '.join(ambiguous)}: the run could not tell which" if ambiguous
             else f"stored at {stored}" if stored else frame_text(holder.get("site")))
    return f"  {verb} {holder.get('kind', 'unknown')} {holder.get('path', '?')}" + (f" ({where})" if where else "")


def _holder_lines(holder: Dict[str, Any]) -> List[str]:
    lines = [_held_by(holder, "held by")] + [_held_by(other, "also held by") for other in holder.get("also") or ()]
    if holder.get("earlier"):  # what held it when its bytes were reused, when that differs from now
        lines.append(_held_by(holder["earlier"], "held at the reuse by"))
    for alias in holder.get("aliases") or ():
        made = frame_text(alias.get("made_at"))
        lines.append(f"  exported as a {alias.get('kind')} alias while lent" + (f" at {made}" if made else "")
                     + ": reads through it are not checked and see the next tensor's bytes")
    return lines


def rebuild(cls: type, text: Optional[str], state: Dict[str, Any]) -> "OwnershipError":
    """Unpickle / copy: an instance of ``cls`` with ``args == (text,)`` and ``state``, without ``__init__``."""
    err = cls.__new__(cls)
    err.__dict__.update(state)
    if text is None:
        text = err._render() if hasattr(err, "_render") and "summary" in state else ""
    err.args = (text,)
    return err


class _Snapshot(types.SimpleNamespace):
    """A read-only stand-in for a ledger object on the far side of a pickle: its record's fields as
    attributes (``name``, ``dtype``, ``by``, ``kind``...), plus the ledger's names for them
    (``region_name``, ``start``, ``end``), and ``site = ()`` (code objects do not travel)."""

    def __init__(self, record: Optional[Dict[str, Any]] = None):
        record = dict(record or {})
        byte_range = record.get("byte_range") or [None, None]
        super().__init__(**record)
        self.region_name = record.get("buffer")
        self.start, self.end = byte_range[0], byte_range[1]
        self.site = ()
        if "shape" in record and isinstance(record["shape"], list):
            self.shape = tuple(record["shape"])

    def to_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in ("region_name", "start", "end", "site")}

    def describe(self) -> str:
        """What the ledger object's ``describe()`` said, rebuilt from the record (the same wording)."""
        v = vars(self)
        return describe_lease(v) if "dtype" in v else describe_event(v)


class OwnershipError(RuntimeError):
    """Base of the sanitizer's errors about borrowed memory.

    ``args == (report text,)``; ``record`` is the JSON-ready entry. Pickling and copying keep the
    text and the record; the live ``lease`` and ``event`` become :class:`_Snapshot` views of the record.
    """

    _LIVE = ("lease", "event")  # ledger objects: replaced by snapshots of their records when pickled
    _DROP = ("used_at", "verified_at")  # stacks of code objects: their records are in ``record``

    def render(self) -> str:
        """The report text (the same as ``str(err)``)."""
        return str(self)

    def _render(self) -> str:
        raise NotImplementedError

    def _begin(self, holder: Optional[Dict[str, Any]]) -> None:
        """What every error notes first: the thread, and who holds the lease (a plain value, when known)."""
        self.thread = threading.current_thread().name
        self.holder: Optional[Dict[str, Any]] = dict(holder) if holder else None

    def _finish(self) -> None:
        """Once the fields are set: the text as ``args``, the holder in the record."""
        if self.holder is not None:
            self.record["holder"] = self.holder
        super().__init__(self._render())

    def _portable_state(self) -> Dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in self._LIVE and k not in self._DROP}
        record = self.__dict__.get("record") if isinstance(self.__dict__.get("record"), dict) else {}
        for name in self._LIVE:
            if name in self.__dict__:
                value = self.__dict__[name]
                state[name] = None if value is None else _Snapshot(record.get(name) if isinstance(record.get(name), dict)
                                                                   else getattr(value, "to_dict", lambda: {})())
        for name in self._DROP:
            if name in self.__dict__:
                state[name] = ()
        return state

    def __reduce__(self):
        return (rebuild, (type(self), str(self), self._portable_state()))

    def __copy__(self) -> "OwnershipError":
        return rebuild(type(self), str(self), dict(self.__dict__))

    def __deepcopy__(self, memo: Dict[int, Any]) -> "OwnershipError":
        # The ledger objects are identities (the lease, the reuse that staled it): shared, not cloned.
        state = {k: (v if k in self._LIVE or k in self._DROP else copy.deepcopy(v, memo))
                 for k, v in self.__dict__.items()}
        return rebuild(type(self), str(self), state)


class StaleBorrowError(OwnershipError):
    """A borrowed view was read or written after its staging bytes were reused or freed.

    Attributes: ``lease`` (the :class:`~sanitizer.core.ledger.Lease`), ``event``
    (the :class:`~sanitizer.core.ledger.ReuseEvent` that made it stale), ``op``
    (the aten op, as text), ``used_at`` (the captured stack), ``holder`` (who still
    holds the view, when triage knows; else None) and ``record`` (the JSON-ready report entry).
    """

    def __init__(self, lease: Lease, event: ReuseEvent, op: str, used_at: Site, used_as: Optional[dict] = None,
                 holder: Optional[Dict[str, Any]] = None, lent_note: str = ""):
        self.lease = lease
        self.lent_note = lent_note  # why the lent-at stack is short, when it was cut (the caller knows)
        self.event = event
        self.op = op
        self.used_at = used_at
        self.used_as = used_as
        self._begin(holder)
        self.summary = stale_summary(lease, event, op)
        self.record = _record(
            "stale_use", self.summary, op=op, lease=lease.to_dict(), event=event.to_dict(),
            used_as=used_as, used_at=to_records(used_at),
        )
        self._used_lines = format_site(used_at)
        holder = self.holder or {}
        # (one view: its own holder path, not the consumer's wildcarded group, which names
        # test_S*_MOCK()['tensor*.int*'] where the code says test_S3_MOCK()['tensor1.int64'])
        self.fix = fix_hint(holder.get("kind"), holder.get("path") or holder.get("consumer") or "", fix_site(holder))
        self.record["fix"] = self.fix
        self._finish()

    def _render(self) -> str:
        lease, event = self.lease, self.event
        via = ""
        if self.used_as and (tuple(self.used_as["shape"]) != tuple(lease.shape) or self.used_as["dtype"] != lease.dtype):
            via = f" (through a derived view {self.used_as['dtype']}{list(self.used_as['shape'])})"
        return "\n".join([
            self.summary + via,
            *(_holder_lines(self.holder) if self.holder else []),
            *([f"  fix: {self.fix}"] if getattr(self, "fix", None) else []),
            f"  lent at (generation {lease.generation}, bytes [{lease.start:#x}, {lease.end:#x}) "
            f"of '{lease.region_name}'):",
            format_site(lease.site),
            *([f"    {self.lent_note}"] if getattr(self, "lent_note", "") else []),
            *_event_lines(event),
            f"  used at (thread {self.thread}):",
            self._used_lines,
        ])


class BorrowCorruptedError(OwnershipError):
    """A lease's bytes changed behind the buffer API (checksum mismatch), e.g. a write through
    ``data_ptr``, DMA, numpy or another library's kernel into a view that was still lent.

    Attributes: ``lease``, ``expected`` and ``found`` (64-bit hashes; ``found`` is None when
    only a device-side flag said "differs"), ``where`` ("reuse", "verify", "synchronize"),
    ``event`` (the reuse that triggered the check, if any), ``verified_at``, ``holder`` and ``record``.
    """

    def __init__(self, lease: Lease, expected: Optional[int], found: Optional[int], where: str,
                 verified_at: Site, event: Optional[ReuseEvent] = None, holder: Optional[Dict[str, Any]] = None):
        self.lease, self.expected, self.found, self.where = lease, expected, found, where
        self.event, self.verified_at = event, verified_at
        self._begin(holder)
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
        self._lines = [f"  lent at (generation {lease.generation}):", format_site(lease.site)]
        if event is not None:
            self._lines += _event_lines(event)
        self._lines += [f"  verified at (thread {self.thread}):", format_site(verified_at)]
        self._finish()

    def _render(self) -> str:
        return "\n".join([self.summary, *(_holder_lines(self.holder) if self.holder else []), *self._lines])


def stale_summary(lease: Lease, event: ReuseEvent, op: str) -> str:
    """``borrowed view 'w' bfloat16[256, 128] used after staging buffer 'ring0' reused ... in aten.sum.default``."""
    return f"borrowed view {lease.describe()} used after {event.describe()} in {op}"


__all__ = ["OwnershipError", "StaleBorrowError", "BorrowCorruptedError", "stale_summary", "rebuild", "fix_site"]
