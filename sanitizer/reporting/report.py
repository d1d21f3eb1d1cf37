"""The JSON report: every error and event, the leases still retained, and a summary for people.

``report()`` returns it in-process; ``report=path`` writes it at exit, with
``{pid}`` and ``{rank}`` expanded so that every rank of a distributed job
writes its own file; ``ownsan run`` merges the files of all its processes.
The format is versioned and described by ``report_schema.json`` (JSON Schema,
shipped with the package); :func:`validate` checks a report against it.

The summary groups retentions by *retaining consumer*: the holder path with
list indices wildcarded (``LayerInfo.loaded_weights[*][1]``) plus the code site
where that holder lives, with a count, the bytes and a first example, biggest
first: the consumer to fix first is at the top.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Set

from sanitizer.core import suppressions
from sanitizer.core.errors import fix_site
from sanitizer.core import forking, journal, output_file
from sanitizer.core import report_file
from sanitizer.core.options import Options
from sanitizer.core.report_file import FORMAT, VERSION
from sanitizer.core.report_skeleton import ERROR_CAPS, HEADER_KEYS, process_label, skeleton
from sanitizer.core.describe import fix_hint
from sanitizer.core.sites import frame_text, site_text
from sanitizer.core.units import format_bytes
from sanitizer.torch_layer import records, runtime
from sanitizer.torch_layer.hooks import add_enable_hook, add_record_hook
from sanitizer.torch_layer.state import state

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_schema.json")


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


def _process_info() -> Dict[str, Any]:
    """Who this process is in its job, recorded in its report and journal at write time so that every
    finding can be named by it after a merge: rank and world size (torch.distributed, else ``RANK`` and
    ``WORLD_SIZE``), ``LOCAL_RANK`` (torchrun), and the worker it is (:func:`_worker_info`)."""
    local = os.environ.get("LOCAL_RANK")
    return {**_rank_info(), "local_rank": int(local) if local and local.isdigit() else None,
            "worker": _worker_info()}


def _worker_info() -> Optional[Dict[str, Any]]:
    """A DataLoader worker's id (``torch.utils.data.get_worker_info()``), or a Ray worker's (its worker id,
    short, and its actor's when it runs one); None in any other process. Read only from modules the program
    already imported (never imports torch.utils.data or ray itself); never raises."""
    data = sys.modules.get("torch.utils.data")
    try:
        info = data.get_worker_info() if data is not None else None
        if info is not None:
            return {"kind": "dataloader", "id": int(info.id), "num_workers": int(info.num_workers)}
    except Exception:
        pass
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            context = ray.get_runtime_context()
            private = sys.modules.get("ray._private.worker")
            if getattr(context.worker, "mode", None) != getattr(private, "WORKER_MODE", 1):
                return None  # the driver: its rank, if any, names it
            actor = context.get_actor_id()
            return {"kind": "ray", "id": context.get_worker_id()[:8], "actor": actor[:8] if actor else None,
                    "actor_name": context.get_actor_name() if actor else None}
    except Exception:  # a worker between tasks, or a Ray that changed its context: unnamed, never lost
        pass
    return None


def report(final: bool = False, exclude: Optional[Set[int]] = None) -> Dict[str, Any]:
    """The whole report as a JSON-ready dict.

    ``final=True`` (at exit, at the end of a test) also decides retentions whose
    consumer has not had its turn yet; otherwise those are only counted as pending.
    ``exclude``: ids of error and event records to leave out (those from before a test).
    """
    from sanitizer.features import triage

    triage.settle(final)
    counts = records.record_counts()
    pid = os.getpid()
    errors = records.errors()
    events = records.events()
    if exclude:
        errors = [e for e in errors if id(e) not in exclude]
        events = [e for e in events if id(e) not in exclude]
    events = [e if "pid" in e else dict(e, pid=pid) for e in events]
    retained = [lease.to_dict() | {"stale_by": lease.stale_by.to_dict()} for lease in state.ledger.stale_alive()
                if lease.stale_by is not None]
    errors, events, suppressed_errors = _suppress(errors, events)
    rep = skeleton(
        pid=pid,
        **_process_info(),
        argv=[str(a) for a in sys.argv],
        enabled=state.enabled,
        options=runtime.options(),
        error_count=(len(errors) if exclude else max(counts["errors_seen"], len(errors))) - suppressed_errors,
        records_dropped=counts["dropped"],
        errors_not_kept={"max_records": counts["errors_dropped"],
                         "max_errors_per_lease": counts["errors_over_per_lease"]},
        events_not_kept={} if exclude else dict(counts.get("events_dropped") or {}),
        errors=errors,
        events=events,
        retained_stale_leases=retained,
        buffers=[
            {"name": r.name, "device": r.device, "nbytes": r.nbytes, "generation": r.generation, "closed": r.closed}
            for r in state.ledger.regions()
        ],
    )
    rep["timeline"] = triage.timeline()
    rep["summary"] = summarize(rep, pending=triage.pending_count())
    return rep


def _suppress(errors: List[Dict[str, Any]], events: List[Dict[str, Any]]):
    """Mark the findings the ``suppressions`` file names (``"suppressed": "KIND:PATTERN (FILE:LINE)"``, on a
    copy of the record): they stay in the report, listed, and leave the counts that fail a run. Returns the
    marked lists and how many errors were suppressed."""
    path = state.options.suppressions
    if not path:
        return errors, events, 0
    try:
        rules = suppressions.load(path)
    except suppressions.SuppressionError:
        return errors, events, 0  # (checked when the option was set; a file removed since: nothing suppressed)

    def mark(record: Dict[str, Any]) -> Dict[str, Any]:
        if record.get("kind") not in ("retention", "stale_use", "checksum_mismatch"):
            return record
        rule = suppressions.match(rules, record)
        return dict(record, suppressed=f"{rule.text()} ({rule.where})") if rule is not None else record

    errors = [mark(e) for e in errors]
    events = [mark(e) for e in events]
    return errors, events, sum(1 for e in errors if e.get("suppressed"))


def _kept_text(total: int, by_kind: Dict[str, int], not_kept: Optional[Dict[str, int]]) -> str:
    """`` (4 stale_use)``, or when not every error was kept ``(4 kept: 4 stale_use; 9 not kept: 9 by
    max_records)``: the total counts every error, the breakdown only the records kept."""
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items()))
    kept = sum(by_kind.values())
    if kept >= total:
        return f" ({kinds})" if kinds else ""
    why = [f"{n} by {cap}" for cap, n in sorted((not_kept or {}).items()) if n]
    head = f"{kept} kept" + (f": {kinds}" if kinds else "")
    return f" ({head}; {total - kept} not kept" + (f": {', '.join(why)}" if why else "") + ")"


def _every_holder(retention: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The retention's holder and every other consumer that held the same view (at least one entry). A
    holder the retention could not name (``unknown``: a comprehension building its list, a view's base)
    gives way to what held the view when it was read stale, when that was named (``Embedding.weight``):
    the table and the error then name the same consumer."""
    holder = retention.get("holder") or {}
    at_read = retention.get("holder_at_read")
    # A function's local held it at the reuse; the view went on into an object's attribute (a module's
    # parameter, no container: not the caller's copy of a returned dict) and was read stale through it.
    moved_on = (holder.get("kind") in ("frame", "generator") and at_read is not None
                and at_read.get("kind") == "object" and "[" not in str(at_read.get("path") or "")
                and all(h.get("consumer") != at_read.get("consumer") for h in (holder, *(holder.get("also") or ()))))
    if (_in_flight(holder) or moved_on) and at_read and not _in_flight(at_read):
        return [at_read, *(h for h in holder.get("also") or () if not _in_flight(h) and h.get("kind") not in
                           ("frame", "generator") and h.get("consumer") != at_read.get("consumer"))]
    return [holder, *(holder.get("also") or ())]


def _in_flight(holder: Dict[str, Any]) -> bool:
    """A holder that only carried the view at its reuse: none named, a Future's result on its way to the
    consumer, or a function's bare local (``param`` before ``setattr(module, name, Parameter(param))``).
    With a loader's thread pool which of them holds a view at the reuse is a matter of timing; what it was
    read stale through is not."""
    path = str(holder.get("path") or "")
    return (holder.get("kind") in (None, "unknown") or path.endswith("._result")
            or (holder.get("kind") in ("frame", "generator") and path.endswith("()")))


def _read_through(retention: Dict[str, Any], holders: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The holder a stale read of the retained view came through: the one of its holders that still held it
    at the read, when that was named apart (``holder_at_read``: the caller's copy of a returned local);
    else the first holder. Something named only at the read (the reading loop's own variable over deferred
    calls popped from their list) is the reader, not a consumer: the read counts for the consumer that
    kept the view. None when it was not read stale."""
    if not retention.get("used_stale"):
        return None
    at_read = retention.get("holder_at_read")
    if at_read and at_read.get("consumer"):
        for h in holders:
            if h.get("consumer") == at_read["consumer"]:
                return h
    return holders[0]


def _add_to_group(groups: Dict[tuple, Dict[str, Any]], e: Dict[str, Any], holder: Dict[str, Any],
                  also: bool = False, stale: bool = False) -> None:
    """Count retention ``e`` for the consumer of ``holder`` (grouped by consumer and where it stores views);
    ``also``: ``holder`` held the view beside the one it is counted for (noted, not counted); ``stale``:
    the view was read stale through this holder (credited here, whichever consumer it is counted for)."""
    site = site_text(holder.get("site"))
    stored = site_text(holder.get("stored_at"))
    consumer = holder.get("consumer") or "<unnamed holder>"
    g = groups.get((consumer, stored or site))
    if g is None:
        g = groups[(consumer, stored or site)] = {
            "consumer": consumer, "holder": holder.get("path") or consumer, "kind": holder.get("kind", "none"),
            "site": site, "stored_at": stored, "count": 0, "bytes": 0, "leases": [], "used_stale": 0, "first": e,
            "read_stale_at": [], "lent_at": frame_text(e.get("lent_at")),
            "reused_at": frame_text(e.get("reused_at")),
            "fix": fix_hint(holder.get("kind"), consumer, fix_site(holder)), "_also": 0, "_also_leases": []}
        if holder.get("stored_candidates"):
            g["stored_candidates"] = [site_text(c) for c in holder["stored_candidates"]]
    if stale:
        g["used_stale"] += 1
        read = site_text(e.get("read_stale_at"))
        if read and read not in g["read_stale_at"] and len(g["read_stale_at"]) < 4:
            g["read_stale_at"].append(read)
    if also:
        g["_also"] += 1
        if len(g["_also_leases"]) < 8:
            g["_also_leases"].append(e["lease"].get("name"))
        return
    if g["count"] == 0:  # its example is its own first counted view (the path under the leases listed)
        g["first"] = e
        g["holder"] = holder.get("path") or consumer
    g["count"] += 1
    g["bytes"] += int(e["lease"].get("nbytes") or 0)
    if len(g["leases"]) < 8:
        g["leases"].append(e["lease"].get("name"))


def summarize(rep: Dict[str, Any], pending: int = 0) -> Dict[str, Any]:
    """Counts by kind, retentions grouped by retaining consumer (biggest first), and a one-line summary."""
    errors_by_kind: Dict[str, int] = {}
    suppressed = {"errors": 0, "retentions": 0}
    for e in rep.get("errors", ()):
        if e.get("suppressed"):
            suppressed["errors"] += 1
            continue
        errors_by_kind[e.get("kind", "?")] = errors_by_kind.get(e.get("kind", "?"), 0) + 1
    events_by_kind: Dict[str, int] = {}
    groups: Dict[tuple, Dict[str, Any]] = {}
    retained_bytes = 0  # each retained lease once, whatever number of consumers held it
    for e in rep.get("events", ()):
        kind = e.get("kind", "?")
        if e.get("suppressed"):
            suppressed["retentions" if kind == "retention" else "errors"] += 1
            continue
        events_by_kind[kind] = events_by_kind.get(kind, 0) + (e.get("count", 1) if kind in _AGGREGATES else 1)
        if kind != "retention":
            continue
        retained_bytes += int(e["lease"].get("nbytes") or 0)
        holders = _every_holder(e)
        through = _read_through(e, holders)
        # each retention counts once, for the holder named first; a stale read, for the holder it came through
        _add_to_group(groups, e, holders[0], stale=through is holders[0])
        for other in holders[1:]:  # the other consumers holding the same view: listed, not counted again
            _add_to_group(groups, e, other, also=True, stale=through is other)
    # Counted consumers first, biggest first; then those only seen holding views another consumer is
    # counted for (a view kept in two places: both need the fix, the retention counts once).
    consumers = sorted(groups.values(), key=lambda g: (not g["count"], -g["bytes"], -g["count"], -g["_also"],
                                                       g["consumer"]))
    for g in consumers:
        g["also_held"] = g.pop("_also")
        also_leases = g.pop("_also_leases")
        if not g["count"]:  # only seen beside another consumer: the views its example path holds
            g["leases"] = also_leases
    counted = sum(1 for g in consumers if g["count"])
    also_only = len(consumers) - counted
    n_ret = events_by_kind.get("retention", 0)
    ret_dropped = int((rep.get("events_not_kept") or {}).get("retention", 0) or 0)  # over max_records
    n_err = rep.get("error_count", 0)
    parts = [f"{n_err} error{'s' * (n_err != 1)}" + _kept_text(n_err, errors_by_kind, rep.get("errors_not_kept"))]
    if n_ret:
        total = n_ret + ret_dropped
        kept_note = f" ({n_ret} kept: max_records)" if ret_dropped else ""
        parts.append(f"{total} retention{'s' * (total != 1)}{kept_note} by {counted} consumer"
                     f"{'s' * (counted != 1)} ({format_bytes(retained_bytes)}{' kept' if ret_dropped else ''})"
                     + (f", {also_only} more holding the same views" if also_only else ""))
        top = consumers[0]
        ambiguous = len(set(top.get("stored_candidates") or ())) > 1
        where = ("one of " + ", ".join(dict.fromkeys(top["stored_candidates"])) if ambiguous
                 else top["stored_at"] or top["site"])
        parts.append(f"top: {top['consumer']}" + (f" at {where}" if where else "")
                     + f" ({top['count']}, {format_bytes(top['bytes'])})")
    else:
        parts.append("no retentions")
    emulated = _emulated_consumers(rep.get("events", ()))
    if emulated:
        views = sum(g["count"] for g in emulated)
        parts.append(f"{views} emulated retention{'s' * (views != 1)} by {len(emulated)} consumer"
                     f"{'s' * (len(emulated) != 1)} ({format_bytes(sum(g['bytes'] for g in emulated))}; "
                     f"correct under the loader's own contract, safetensors_strict=1 makes them retentions, "
                     f"a read of one a stale-use error)")
    if suppressed["errors"] or suppressed["retentions"]:
        parts.append(" and ".join(f"{n} {what}{'s' * (n != 1)}" for what, n in
                                  (("error", suppressed["errors"]), ("retention", suppressed["retentions"])) if n)
                     + " suppressed (suppressions file: listed in the report, not counted)")
    unchecked = _unchecked_loads(rep.get("events", ()))
    for g in unchecked:
        parts.append(f"{g['count']} load{'s' * (g['count'] != 1)} not checked ({g['entry']}: {g['tensors']} "
                     f"tensor{'s' * (g['tensors'] != 1)}, {format_bytes(g['bytes'])}; {g['why']})")
    return {
        "line": "ownership-sanitizer: " + "; ".join(parts),
        "errors_by_kind": errors_by_kind,
        "events_by_kind": events_by_kind,
        "retentions": n_ret,
        "retentions_not_kept": ret_dropped,
        "retained_bytes": retained_bytes,
        "pending_retentions": pending,
        "retaining_consumers": consumers,
        "emulated_retentions": sum(g["count"] for g in emulated),
        "emulated_consumers": emulated,
        "unchecked_loads": unchecked,
        "suppressed": suppressed,
    }


def _unchecked_loads(events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Loads the sanitizer left alone (``safetensors.torch.load_file`` under the ring emulation), summed by
    entry point across the processes of a merged report: a run that checked nothing of them says so."""
    groups: Dict[str, Dict[str, Any]] = {}
    for e in events:
        if e.get("kind") != "unchecked_load":
            continue
        g = groups.setdefault(str(e.get("entry")), {"entry": str(e.get("entry")), "loader": e.get("loader"),
                                                     "why": e.get("why"), "first_at": e.get("first_at"),
                                                     "count": 0, "tensors": 0, "bytes": 0})
        for k in ("count", "tensors", "bytes"):
            g[k] += int(e.get(k) or 0)
    return sorted(groups.values(), key=lambda g: g["entry"])


def _emulated_consumers(events: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The consumers that kept views past an *emulated* borrowed contract (``safetensors_ring`` without
    strict: each view kept its bytes, aliases included, nothing was wrong), grouped like retentions: a user
    who asked for the emulation wants to see them, marked as such, not "no retentions"."""
    groups: Dict[tuple, Dict[str, Any]] = {}
    for e in events:
        if e.get("kind") != "emulated_retention":
            continue
        holder = e.get("holder") or {}
        consumer = holder.get("consumer") or "<unnamed holder>"
        site = site_text(holder.get("site"))
        stored = site_text(holder.get("stored_at"))
        g = groups.get((consumer, stored or site))
        if g is None:
            g = groups[(consumer, stored or site)] = {"consumer": consumer, "kind": holder.get("kind", "none"),
                                                      "site": site, "stored_at": stored, "count": 0, "bytes": 0,
                                                      "leases": [], "files": []}
        g["count"] += int(e.get("count") or len(e.get("leases") or ()) or 1)
        g["bytes"] += int(e.get("nbytes") or 0)
        for name in e.get("leases") or ():
            if len(g["leases"]) < 8:
                g["leases"].append(name)
        if e.get("file") and e["file"] not in g["files"] and len(g["files"]) < 4:
            g["files"].append(e["file"])
    return sorted(groups.values(), key=lambda g: (-g["bytes"], -g["count"], g["consumer"]))


def _processes(rep: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The processes a report stands for, each labelled: its own, or a merged report's (a Ray job's merged
    report read by ``ownsan run``'s merge keeps every worker's)."""
    if isinstance(rep.get("processes"), list):
        return [dict(p, label=p.get("label") or process_label(p.get("pid"), p.get("rank"), p.get("worker")))
                for p in rep["processes"] if isinstance(p, dict)]
    return [{"pid": rep["pid"], "rank": rep.get("rank"), "world_size": rep.get("world_size"),
             "local_rank": rep.get("local_rank"), "worker": rep.get("worker"),
             "error_count": rep.get("error_count", 0), "argv": rep.get("argv", []),
             "label": process_label(rep["pid"], rep.get("rank"), rep.get("worker"))}]


def _one(values: Iterable[Any]) -> Any:
    """The value every process shares (the job's world size), else None: a merge claims no process's own."""
    known = {v for v in values if v is not None}
    return known.pop() if len(known) == 1 else None


def merge(reports: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """One report from the reports of several processes (ranks, workers); a single one is returned as is.

    Every error, event and retained lease names the process it came from (``pid``, ``rank`` and a
    ``process`` label such as ``rank 1 (pid 4242)`` or ``DataLoader worker 1 (pid 4243)``), and each
    retaining consumer of the summary lists the processes whose retentions it groups: in a multi-worker
    load, which worker kept what. A merged report among them (a Ray job's) is merged process by process.
    The merged report's own ``rank`` and ``world_size`` are the ones all its processes share, else null.
    """
    reports = sorted(reports, key=lambda r: (r.get("rank") is None, r.get("rank") or 0,
                                             str((r.get("worker") or {}).get("id", "")), r.get("pid", 0)))
    if not reports:
        raise ValueError("no report to merge")
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    processes = [p for r in reports for p in _processes(r)]
    out = skeleton(**{k: first[k] for k in ("format", "version", "pid", "argv", "enabled", "options")},
                   rank=processes[0].get("rank") if len({p.get("rank") for p in processes}) == 1 else None,
                   world_size=_one(p.get("world_size") for p in processes))
    out["error_count"] = sum(r.get("error_count", 0) for r in reports)
    out["records_dropped"] = sum(r.get("records_dropped", 0) for r in reports)
    out["errors_not_kept"] = {cap: sum((r.get("errors_not_kept") or {}).get(cap, 0) for r in reports)
                              for cap in ERROR_CAPS}
    for r in reports:
        for kind, n in (r.get("events_not_kept") or {}).items():
            out["events_not_kept"][kind] = out["events_not_kept"].get(kind, 0) + n
    for key in ("errors", "events", "retained_stale_leases", "buffers"):
        out[key] = [_from_process(item, r) for r in reports for item in r.get(key, ())]
    out["processes"] = processes
    timelines = [r["timeline"] for r in reports if isinstance(r.get("timeline"), dict)]
    if timelines:  # buffers, leases and reuses carry their pid: ids are per process
        out["timeline"] = {"cap": max(t.get("cap", 0) for t in timelines),
                           "dropped": sum(t.get("dropped", 0) for t in timelines),
                           **{key: [item for t in timelines for item in t.get(key, ())]
                              for key in ("buffers", "leases", "events")}}
    out["summary"] = summarize(out, pending=sum(r.get("summary", {}).get("pending_retentions", 0) for r in reports))
    by_consumer: Dict[tuple, List[str]] = {}
    for e in out["events"]:
        if e.get("kind") == "retention":
            holder = e.get("holder") or {}
            labels = by_consumer.setdefault((holder.get("consumer") or "<unnamed holder>",
                                             site_text(holder.get("site"))), [])
            if e["process"] not in labels:
                labels.append(e["process"])
    for group in out["summary"]["retaining_consumers"]:
        group["processes"] = by_consumer.get((group["consumer"], group["site"]), [])
    return out


def _from_process(item: Any, rep: Dict[str, Any]) -> Any:
    """``item`` of ``rep`` with the process it came from (its own pid wins: a forked child's records; an
    item of a merged report keeps the label it was given there)."""
    if not isinstance(item, dict):
        return item
    pid = item.get("pid", rep.get("pid"))
    rank = item["rank"] if "rank" in item else rep.get("rank")
    if isinstance(item.get("process"), str):
        return dict(item, pid=pid, rank=rank)
    worker = rep.get("worker") if pid == rep.get("pid") else None
    return dict(item, pid=pid, rank=rank, process=process_label(pid, rank, worker))


def load(path: str) -> Dict[str, Any]:
    """The report in ``path`` (see :func:`sanitizer.core.report_file.load`); a journal's records are
    checked (:func:`journal_check`) before its summary is made from them."""
    rep = report_file.load(path, journal_check)
    if "summary" not in rep:
        rep["summary"] = summarize(rep)
    return rep


# What summarize() reads of the event kinds the schema leaves open (other_event): a crafted journal must
# not reach it with a count that is not a number.
_COUNT = {"type": "integer", "minimum": 0}
_SITE = {"anyOf": [{"$ref": "#/$defs/frame"}, {"type": "null"}]}
_SUMMARY_READS = {
    "emulated_retention": {"type": "object", "properties": {
        "count": _COUNT, "nbytes": _COUNT, "leases": {"type": "array"}, "file": {"type": ["string", "null"]},
        "holder": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "consumer": {"type": ["string", "null"]}, "kind": {"type": ["string", "null"]}, "site": _SITE,
            "stored_at": _SITE}}]}}},
    "unchecked_load": {"type": "object", "properties": {"count": _COUNT, "tensors": _COUNT, "bytes": _COUNT}},
}
_KINDS = {"error": ("stale_use", "checksum_mismatch"), "event": ("retention", "rescue", "clone")}  # (their $defs)
_journal_schemas: Dict[str, Dict[str, Any]] = {}


def journal_check(what: str, value: Dict[str, Any]) -> Optional[str]:
    """The first problem (and how many more) of a journal's ``header``, or of one of its ``error`` or
    ``event`` records, against the report schema (each record as the report's ``errors[]`` or ``events[]``
    item it becomes, the header as the report's process fields); None when it is fine. The journal is read
    only once every line passed, so a crafted line is one clear error naming it, never a traceback in the
    summary made from it (:func:`sanitizer.core.journal.load_journal` calls this)."""
    from sanitizer.reporting.schema import validate as _validate

    if not _journal_schemas:
        root = schema()
        defs = {"$defs": root["$defs"]}
        _journal_schemas.update(
            header={"type": "object", "required": ["format", "version", "pid", "argv"],
                    "properties": {k: root["properties"][k] for k in HEADER_KEYS}, **defs},
            error={"$ref": "#/$defs/error", **defs}, event={"$ref": "#/$defs/event", **defs},
            **{kind: {"$ref": f"#/$defs/{kind}", **defs} for kinds in _KINDS.values() for kind in kinds},
            **{kind: dict(sub, **defs) for kind, sub in _SUMMARY_READS.items()})
    kind = value.get("kind")
    if isinstance(kind, str) and kind in _KINDS.get(what, ()):  # the one alternative its kind names: the
        problems = _validate(value, _journal_schemas[kind])  # problem said is that one's, not the closest's
    else:
        problems = _validate(value, _journal_schemas[what])
    if not problems and what == "event" and kind in _SUMMARY_READS:
        problems = _validate(value, _journal_schemas[kind])
    if not problems:
        return None
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def expand_path(path: str) -> str:
    """``{pid}`` and ``{rank}`` expanded. In a forked child a path without ``{pid}`` gets ``.<pid>`` before
    its extension: the child writes its own report, never over its parent's."""
    rank = _rank_info()["rank"]
    if _forked and "{pid}" not in path and output_file.replaced_whole(path):  # (/dev/null stays /dev/null)
        root, ext = os.path.splitext(path)
        path = f"{root}.{{pid}}{ext}"
    return path.replace("{pid}", str(os.getpid())).replace("{rank}", "0" if rank is None else str(rank))


def write_report(path: str, final: bool = False) -> str:
    """Write the report to ``path`` ({pid}, {rank} expanded); return the path written."""
    target = expand_path(path)
    directory = os.path.dirname(target)
    if directory:
        os.makedirs(directory, exist_ok=True)
    data = report(final=final)
    # Atomic for a regular file (a reader never sees half a report); written through for /dev/null, a FIFO,
    # /dev/stdout, and at a symlink's target: never replaced, so the path stays what it was.
    return output_file.write_text(target, json.dumps(data, indent=2, default=str) + "\n")


def schema() -> Dict[str, Any]:
    with open(SCHEMA_PATH, encoding="utf-8") as fh:
        return json.load(fh)


def validate(rep: Dict[str, Any]) -> List[str]:
    """Violations of the report schema ([] when ``rep`` is a valid report)."""
    from sanitizer.reporting.schema import validate as _validate

    return _validate(rep, schema())


_exit_writer_armed = False
_forked = False  # this process is a forked child (of a process that had the sanitizer loaded)
_os_exit = os._exit
_JOURNAL = journal.Journal()
_AGGREGATES = ("clone", "unchecked_load")  # events updated in place after they were filed (counts): the report has them whole


def _on_enable(options: Options) -> None:
    """Arm the exit writer and the journal (once) when enabled with a ``report`` path."""
    global _exit_writer_armed
    if options.report and not _exit_writer_armed:
        atexit.register(_write_report_at_exit)
        add_record_hook(_journal_record)
        _exit_writer_armed = True
        if os._exit is _os_exit:  # a process that ends with os._exit (a forkserver's worker) writes it first
            os._exit = _exit_after_writing_the_report


def _journal_record(kind: str, record: Dict[str, Any]) -> None:
    """Each kept error and event, on disk as it is made (see :mod:`sanitizer.core.journal`): a process
    killed before its report is written (``Pool.terminate()``'s SIGTERM, SIGKILL) keeps its findings.
    Left at SIGTERM's default action on purpose: a Python handler for it hung a worker whose main thread
    was blocked in a lock when the signal landed on another thread."""
    path = state.options.report
    if not path or record.get("kind") in _AGGREGATES:
        return
    try:
        key = (os.getpid(), path)
        target = _journal_targets.get(key)
        if target is None:  # once per process and path: where its journal goes, if anywhere
            where = os.path.abspath(expand_path(path))  # (the program may chdir: finish() removes this one)
            # Beside the file the report will be (a symlink's target), where a reader of either looks.
            target = _journal_targets[key] = (journal.journal_path(output_file.written_at(where))
                                              if output_file.replaced_whole(where) else "")
        if target:
            _JOURNAL.append(target, _journal_header, kind, record)
    except Exception:  # never into the program: the report at exit still has the record
        pass


_journal_targets: Dict[tuple, str] = {}  # (pid, report option) -> the journal's path ("" for none)


def _journal_header() -> Dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "pid": os.getpid(), **_process_info(),
            "argv": [str(a) for a in sys.argv], "options": runtime.options()}


def _write_report_at_exit() -> None:
    path = state.options.report
    if not path:
        return
    try:
        written = write_report(path, final=True)
    except Exception as exc:  # one line, never a second traceback after the program's own
        print(f"ownership-sanitizer: could not write the report to {path!r}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return
    # The report is whole: its journal goes, and so does one an earlier, killed process left beside it.
    _JOURNAL.finish(output_file.written_at(written) if output_file.replaced_whole(written) else None)


def _exit_after_writing_the_report(code: int) -> None:
    """``os._exit`` with the report written first. multiprocessing's fork workers, a forkserver's workers
    (enabled after their fork, so this is put in place at their enable) and ProcessPoolExecutor's end with
    ``os._exit``, which runs no atexit handler."""
    try:
        _write_report_at_exit()
    finally:
        _os_exit(code)


@forking.in_child
def _after_fork() -> None:
    global _forked
    _forked = True
    _JOURNAL.after_fork_in_child()
    if _exit_writer_armed and os._exit is _os_exit:
        os._exit = _exit_after_writing_the_report


def install() -> None:
    """Make ``enable(report=path)`` write the report at exit (idempotent); called by the composition root."""
    add_enable_hook(_on_enable)


__all__ = ["install", "report", "write_report", "summarize", "merge", "process_label", "load", "validate", "schema",
           "journal_check", "expand_path", "FORMAT", "VERSION", "SCHEMA_PATH"]
