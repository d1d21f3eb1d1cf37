"""The JSON report: every recorded error plus the leases still retained, ready for tools.

``report()`` returns it in-process; ``report=path`` writes it at exit, with
``{pid}`` and ``{rank}`` expanded so that every rank of a distributed job
writes its own file.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict

from . import runtime

FORMAT = "ownership-sanitizer-report"
VERSION = 1


def _rank_info() -> Dict[str, Any]:
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return {"rank": dist.get_rank(), "world_size": dist.get_world_size()}
    except Exception:  # a half-torn-down process group at exit must not lose the report
        pass
    rank = os.environ.get("RANK")
    world = os.environ.get("WORLD_SIZE")
    return {"rank": int(rank) if rank and rank.isdigit() else None,
            "world_size": int(world) if world and world.isdigit() else None}


def report() -> Dict[str, Any]:
    """The whole report as a JSON-ready dict."""
    state = runtime.state
    errors = runtime.errors()
    retained = [lease.to_dict() | {"stale_by": lease.stale_by.to_dict()} for lease in state.ledger.stale_alive()
                if lease.stale_by is not None]
    return {
        "format": FORMAT,
        "version": VERSION,
        "pid": os.getpid(),
        **_rank_info(),
        "enabled": state.enabled,
        "options": runtime.options(),
        "error_count": sum(state.error_counts.values()) or len(errors),
        "errors": errors,
        "retained_stale_leases": retained,
        "buffers": [
            {"name": r.name, "device": r.device, "nbytes": r.nbytes, "generation": r.generation, "closed": r.closed}
            for r in state.ledger.regions()
        ],
    }


def expand_path(path: str) -> str:
    rank = _rank_info()["rank"]
    return path.replace("{pid}", str(os.getpid())).replace("{rank}", "0" if rank is None else str(rank))


def write_report(path: str) -> str:
    """Write the report to ``path`` ({pid}, {rank} expanded); return the path written."""
    target = expand_path(path)
    directory = os.path.dirname(target)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(target, "w", encoding="utf-8") as fh:
        json.dump(report(), fh, indent=2)
        fh.write("\n")
    return target


__all__ = ["report", "write_report", "FORMAT", "VERSION"]
