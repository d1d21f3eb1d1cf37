"""How a lease and a reuse event read in a sentence: one wording, for the ledger and the errors alike.

Both work on the *record* (the JSON-ready dict of :meth:`Lease.to_dict` and
:meth:`ReuseEvent.to_dict`, or any mapping with those keys), so a live ledger
object, an error that crossed a pickle and a report read back from disk all
describe the same lease with the same words.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional


def describe_lease(rec: Mapping[str, Any]) -> str:
    """``'name' bfloat16[256, 128]``: what a person recognises the view by."""
    shape = ", ".join(str(s) for s in rec.get("shape") or ())
    name = rec.get("name") or f"<lease {rec.get('lease_id', '?')}>"
    return f"'{name}' {rec.get('dtype', '?')}[{shape}]"


def describe_event(rec: Mapping[str, Any]) -> str:
    """``staging buffer 'ring0' reused bytes [0x0, 0x1000) for 'w2' (generation 1 -> 2)`` (or retired, closed)."""
    kind, by, buffer = rec.get("kind"), rec.get("by"), rec.get("buffer")
    before, after = rec.get("generation_before"), rec.get("generation_after")
    if kind == "close":
        return f"staging buffer '{buffer}' was closed (generation {before} -> closed)"
    start, end = (rec.get("byte_range") or (0, 0))[:2]
    verb, what = ("retired", f" when '{by}' was put") if kind == "retire" else ("reused", f" for '{by}'")
    return (f"staging buffer '{buffer}' {verb} bytes [{start or 0:#x}, {end or 0:#x}){what if by else ''} "
            f"(generation {before} -> {after})")


def fix_hint(kind: Optional[str], consumer: str, site: Optional[str]) -> str:
    """What to change for a retaining consumer: own the tensor where the holder keeps it (``site``:
    where it is kept, ``file:line``, when known)."""
    at = f" ({site})" if site else ""
    if not kind or kind in ("unknown", "none"):
        return ("own what you keep: store sanitizer.own(t) (a copy only when t is borrowed) or t.clone(), "
                "not the borrowed view")
    return (f"own the tensor where {consumer} keeps it: store sanitizer.own(t) (copies only a borrowed t) or "
            f"t.clone() there, not the borrowed view{at}")


__all__ = ["describe_lease", "describe_event", "fix_hint"]
