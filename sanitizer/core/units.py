"""Byte sizes for people: torch-free, shared by the report and the command line."""
from __future__ import annotations


def format_bytes(n: int) -> str:
    """``n`` bytes as ``"1.5 MiB"``: the largest binary unit it reaches, one decimal; ``"12 B"`` below 1 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


__all__ = ["format_bytes"]
