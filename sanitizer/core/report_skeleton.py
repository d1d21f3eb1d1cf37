"""The report's top-level keys, in one place: what a process writes, what a journal stands in for, what a
merge fills.

Three writers build a report: the process itself (``reporting.report.report``), a journal read in place
of a killed process's report (:func:`sanitizer.core.journal.load_journal`) and the merge of several
(``reporting.collect``). Each starts from :func:`skeleton`, so a key added to the report is added here
once and no writer leaves it out. The JSON Schema (``reporting/report_schema.json``) says what each key
holds; ``tests/reporting/test_report.py`` checks that the two name the same keys.

Torch-free (the journal reader and the auditor use it).
"""
from __future__ import annotations

from typing import Any, Dict

FORMAT = "ownership-sanitizer-report"
VERSION = 2

#: Who wrote a report: its process and where that process sits in the job (the labels of its findings).
#: ``worker`` is set in a DataLoader worker (``{"kind": "dataloader", "id": 1, ...}``) and in a Ray worker
#: (``{"kind": "ray", "id": "<worker id, short>", "actor": ...}``); None elsewhere.
PROCESS_KEYS = ("pid", "rank", "world_size", "local_rank", "worker")

#: What a journal's first line carries (the process facts a report begins with).
HEADER_KEYS = ("format", "version", *PROCESS_KEYS, "argv", "options")

#: The caps' names in ``errors_not_kept``.
ERROR_CAPS = ("max_records", "max_errors_per_lease")


def skeleton(**values: Any) -> Dict[str, Any]:
    """A report with every top-level key, each empty (no finding), in the order a report is written;
    ``values`` fill some in (an unknown key is a bug in the caller: KeyError names it)."""
    rep: Dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "pid": 0, "rank": None, "world_size": None, "local_rank": None,
        "worker": None, "argv": [], "enabled": True, "options": {}, "error_count": 0, "records_dropped": 0,
        "errors_not_kept": {cap: 0 for cap in ERROR_CAPS}, "events_not_kept": {}, "errors": [], "events": [],
        "retained_stale_leases": [], "buffers": [],
    }
    for key, value in values.items():
        if key not in rep:
            raise KeyError(f"{key!r} is not a report key (see sanitizer.core.report_skeleton)")
        rep[key] = value
    return rep


#: Keys a report may add beside the skeleton's: the summary (made of the rest), the timeline, the processes
#: of a merged report, and a journal's note that it stands for a report never written.
EXTRA_KEYS = ("summary", "timeline", "processes", "ended_before_report")


def process_label(pid: Any, rank: Any, worker: Any = None) -> str:
    """How a finding's process is named wherever a person reads it (the merged report's ``process``
    field, ``ownsan run``'s and ``ownsan triage``'s text): ``rank 1 (pid 4242)``, ``DataLoader worker 1
    (pid 4243)``, ``Ray worker 1a2b3c4d, actor 5e6f7a8b (pid 4244)``, ``pid 4245``."""
    parts = [f"rank {rank}"] if rank is not None else []
    if isinstance(worker, dict) and worker.get("kind") == "dataloader":
        parts.append(f"DataLoader worker {worker.get('id')}")
    elif isinstance(worker, dict) and worker.get("kind") == "ray":
        actor = worker.get("actor_name") or worker.get("actor")
        parts.append(f"Ray worker {worker.get('id')}" + (f", actor {actor}" if actor else ", tasks"))
    return f"{', '.join(parts)} (pid {pid})" if parts else f"pid {pid}"


__all__ = ["FORMAT", "VERSION", "PROCESS_KEYS", "HEADER_KEYS", "ERROR_CAPS", "EXTRA_KEYS", "skeleton",
           "process_label"]
