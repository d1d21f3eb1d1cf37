"""The triage text: what ``ownsan run`` and ``ownsan triage`` print, and the pytest plugin's section.

Torch-free: it only reads a report dict. Per retaining consumer (most bytes
first): the holder path, where the holder lives, an example, the leases, where
they were read stale, where they were lent and reused (once, when every
consumer shares those sites, and on one line when lend and reuse are the same
place), and the fix. Then each distinct error once: the same stale read
recorded again (a later occurrence, a finalizer at exit) is not repeated.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from sanitizer.core.report_skeleton import process_label
from sanitizer.core.sites import frame_text, site_text
from sanitizer.core.units import format_bytes


def lent_reused(first: dict) -> str:
    """``lent at X; reused at Y``, or one place when both are the same line."""
    lent, reused = frame_text(first.get("lent_at")) or "?", frame_text(first.get("reused_at")) or "?"
    if lent == reused:
        return f"lent at, and reused at, {lent}"
    return f"lent at {lent}; reused at {reused}"


def distinct_errors(errors: List[dict]) -> List[Tuple[dict, int]]:
    """Each distinct error once, with how many records repeat it (same kind, lease, pid and first frame)."""
    seen: Dict[tuple, int] = {}
    order: List[dict] = []
    for e in errors:
        lease = e.get("lease") if isinstance(e.get("lease"), dict) else {}
        where = (e.get("used_at") or e.get("verified_at") or [None])[0]
        key = (e.get("kind"), lease.get("lease_id"), e.get("pid"), site_text(where) if isinstance(where, dict) else None)
        if key in seen:
            seen[key] += 1
            continue
        seen[key] = 1
        order.append(e)
    out = []
    for e in order:
        lease = e.get("lease") if isinstance(e.get("lease"), dict) else {}
        where = (e.get("used_at") or e.get("verified_at") or [None])[0]
        out.append((e, seen[(e.get("kind"), lease.get("lease_id"), e.get("pid"),
                             site_text(where) if isinstance(where, dict) else None)]))
    return out


def lease_names(names: List[str], count: int, shown: int = 4) -> str:
    """A consumer's lease names for its row: each distinct name once, in the order first seen, with how many of
    its leases bear it when more than one does (a consumer that kept the same weight from three loads is
    ``'w' (3 leases)``, not ``'w', 'w', 'w'``); ``...`` when names are left out (more than ``shown`` distinct
    ones, or more leases than the report kept names of)."""
    tally: Dict[str, int] = {}
    for name in names:
        tally[name] = tally.get(name, 0) + 1
    parts = [repr(n) + (f" ({k} leases)" if k > 1 else "") for n, k in list(tally.items())[:shown]]
    return ", ".join(parts) + (", ..." if len(tally) > shown or count > len(names) else "")


def who_wrote(rep: Dict[str, Any], shown: int = 4) -> str:
    """The report's processes for its header: its one process (``rank 1 of 2, pid 4242``), or a merged
    report's, each by its own label (never the first one's rank for all)."""
    processes = rep.get("processes")
    if not isinstance(processes, list):
        label = process_label(rep.get("pid"), rep.get("rank"), rep.get("worker"))
        if rep.get("rank") is not None and rep.get("world_size") is not None:
            label = label.replace(f"rank {rep['rank']}", f"rank {rep['rank']} of {rep['world_size']}", 1)
        return label
    labels = [p.get("label") or process_label(p.get("pid"), p.get("rank"), p.get("worker"))
              for p in processes if isinstance(p, dict)]
    more = f"; {len(labels) - shown} more" if len(labels) > shown else ""
    return f"{len(labels)} processes: {'; '.join(labels[:shown])}{more}"


def format_triage(rep: Dict[str, Any], path: Optional[str] = None, top: int = 20) -> str:
    """The human summary: one line, the retaining consumers by bytes with holder and sites, then the errors."""
    summary = rep["summary"]
    lines = [summary["line"], f"report: {path or '(in process)'} ({who_wrote(rep)})"]
    consumers = summary["retaining_consumers"]
    if consumers:
        shown = consumers[:top]
        sites = {lent_reused(g["first"]) for g in shown}
        shared = sites.pop() if len(sites) == 1 and len(shown) > 1 else None
        lines += ["", "retaining consumers, most bytes first:"]
        if shared:
            lines.append(f"  (all {shared})")
        rows = [("#", "bytes", "count", "stale", "kind", "holder")]
        rows += [(str(i), format_bytes(g["bytes"]), str(g["count"]), str(g["used_stale"]), g["kind"], g["consumer"])
                 for i, g in enumerate(shown, 1)]
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        for i, row in enumerate(rows):
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row[:5], widths)) + "  " + row[5])
            if i == 0:
                continue
            g = consumers[i - 1]
            pad = "  " + " " * (sum(widths) + 2 * 5)
            first = g["first"]
            names = lease_names(g["leases"], g["count"] or g.get("also_held") or 0)
            candidates = g.get("stored_candidates") or []
            if len(candidates) > 1:  # several statements store into that container alike
                lines.append(f"{pad}stored at one of {', '.join(candidates)} (holder lives at {g['site'] or '?'}; "
                             f"the run could not tell which)")
            elif g.get("stored_at"):
                lines.append(f"{pad}stored at {g['stored_at']} (holder lives at {g['site'] or '?'})")
            else:
                lines.append(f"{pad}holder lives at {g['site'] or '?'}")
            if g.get("also_held"):
                lines.append(f"{pad}also held {g['also_held']} view(s) counted for another consumer")
            # This consumer's own path to a view (one only seen holding views counted for another consumer
            # names its own path, not the other's), and its leases when some are counted for it.
            lines.append(f"{pad}e.g. {g.get('holder') or '?'}")
            if names:
                lines.append(f"{pad}leases: {names}")
            if g.get("processes"):  # a merged report: which rank or worker kept them
                lines.append(f"{pad}kept in {'; '.join(g['processes'])}")
            reads = g.get("read_stale_at") or []
            if reads:
                held = g["count"] + (g.get("also_held") or 0)  # the reads that came through this holder
                lines.append(f"{pad}read stale at {', '.join(reads)} ({g['used_stale']} of {held} view"
                             f"{'s' * (held != 1)})")
            if not shared:
                lines.append(f"{pad}{lent_reused(first)}")
            if g.get("fix"):
                lines.append(f"{pad}fix: {g['fix']}")
        if len(consumers) > top:
            lines.append(f"  ... {len(consumers) - top} more (ownsan triage --top N)")
    emulated = summary.get("emulated_consumers") or []
    if emulated:
        lines += ["", "emulated retentions (views kept past the emulated ring; each kept its bytes, aliases included, "
                      "safetensors_strict=1 makes them retentions, a read of one a stale-use error):"]
        for g in emulated[:top]:
            names = lease_names(g["leases"], g["count"] or g.get("also_held") or 0)
            where = f"stored at {g['stored_at']}" if g.get("stored_at") else f"holder lives at {g['site'] or '?'}"
            lines.append(f"  {format_bytes(g['bytes'])}  {g['count']}  {g['kind']}  {g['consumer']} ({where})")
            lines.append(f"      leases: {names}")
    errors = [e for e in rep.get("errors", []) if not e.get("suppressed")]  # (counted in the summary line)
    if errors:
        lines += ["", "errors (first of each kind):"]
        lines += _first_of_each_kind(errors, "  {kind}: {summary}", "    ")
    pending = summary.get("pending_retentions")
    if pending:
        lines.append(f"\n({pending} retention(s) still pending: their consumer had not had its turn when the "
                     f"report was taken)")
    return "\n".join(lines)


def _first_of_each_kind(errors: List[Dict[str, Any]], head: str, indent: str) -> List[str]:
    """The first error of each kind: ``head`` (with its kind and summary), where it was read stale,
    and who holds it."""
    lines: List[str] = []
    seen = set()
    where_by_kind: Dict[Any, Dict[str, int]] = {}  # a merged report's: each kind's processes, with counts
    for e in errors:
        if e.get("process"):
            tally = where_by_kind.setdefault(e.get("kind"), {})
            tally[e["process"]] = tally.get(e["process"], 0) + 1
    for e, _ in distinct_errors(errors):
        kind = e.get("kind")
        if kind in seen:
            continue
        seen.add(kind)
        lines.append(head.format(kind=kind, summary=e.get("summary")))
        tally = where_by_kind.get(kind) or {}
        if tally:
            lines.append(f"{indent}in " + "; ".join(f"{label} ({n})" if len(tally) > 1 else label
                                                     for label, n in tally.items()))
        where = (e.get("used_at") or [None])[0]
        if isinstance(where, dict) and where.get("file"):
            lines.append(f"{indent}read stale at {site_text(where)}")
        if e.get("holder"):
            lines.append(f"{indent}held by {e['holder'].get('path')}")
    return lines


def section_for_test(rep: Dict[str, Any], path: Optional[str]) -> str:
    """The pytest plugin's report section for one failing test: summary, holders, stale reads, report path."""
    summary = rep["summary"]
    lines = [summary["line"]]
    for g in summary["retaining_consumers"][:5]:
        counted = (f"{g['count']} lease{'s' * (g['count'] != 1)}, {format_bytes(g['bytes'])}" if g["count"] else
                   f"also held {g.get('also_held', 0)} of the views counted above")
        lines.append(f"held by: {g['consumer']} ({counted})"
                     + (f"; stored at {g['stored_at']}" if g.get("stored_at") else
                                                       f"; holder lives at {g['site']}" if g.get("site") else ""))
        if g.get("read_stale_at"):
            lines.append(f"  read stale at {', '.join(g['read_stale_at'])}")
        if g.get("fix"):
            lines.append(f"  fix: {g['fix']}")
    # a suppressed error is the team's known one: never shown as the test's first (the summary counts it)
    lines += _first_of_each_kind([e for e in rep.get("errors", []) if not e.get("suppressed")],
                                 "first {kind}: {summary}", "  ")
    if path:
        lines.append(f"report: {path} (ownsan triage {path}; --html timeline.html draws each staging buffer)")
    return "\n".join(lines)


__all__ = ["format_triage", "who_wrote", "section_for_test", "lent_reused", "distinct_errors", "lease_names"]
