"""The report's timeline as a Chrome trace (trace-event JSON): open it in Perfetto or chrome://tracing.

``ownsan triage report.json --trace out.json`` writes it, in the format
torch.profiler's traces use: one track group ("process") per staging buffer,
one complete event (``"ph": "X"``) per lease from its lend to the reuse that
retired it, a ``retained by ...`` slice from that reuse to the stale read or
the death of a retained lease, and instant events for reuses and stale reads.
Leases are spread over lanes ("threads") so that slices in a lane never
overlap. Times are the sanitizer's own clock (microseconds since it started).
Every reuse, retire and close is timed when it happens (whether or not it
retired a live lease); one without a time (a report from before that, or a
reuse that retired a lease but has left the most recent ``timeline_events``)
is placed right after what happened before it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

from sanitizer.core import output_file
from sanitizer.core.sites import site_text
from sanitizer.reporting.timeline import buffers_of


def _times(buf: Any) -> Tuple[Dict[int, float], Dict[int, float]]:
    """Seconds for every lease and reuse of a buffer: known ones kept, the others (rare) placed after their
    predecessor (lease and event ids come from one counter, so their order is the order things happened)."""
    items = [(l["lease_id"], "l", l.get("t")) for l in buf.leases] + [(e["event_id"], "e", e.get("t"))
                                                                        for e in buf.events]
    items.sort()
    lease_t: Dict[int, float] = {}
    event_t: Dict[int, float] = {}
    last = min((t for _, _, t in items if t is not None), default=0.0)
    for ident, kind, t in items:
        t = last + 1e-6 if t is None or t < last else t
        last = t
        (lease_t if kind == "l" else event_t)[ident] = t
    return lease_t, event_t


def chrome_trace(rep: Dict[str, Any]) -> Dict[str, Any]:
    """The trace-event document (``{"traceEvents": [...], ...}``) for a report."""
    out: List[dict] = []
    for pid, buf in enumerate(buffers_of(rep), start=1):
        info = buf.info
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                    "args": {"name": f"staging buffer {info.get('name')} (pid {info.get('pid')})"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        lease_t, event_t = _times(buf)
        end_of_trace = max(list(lease_t.values()) + list(event_t.values()) + [0.0])
        events = sorted(buf.events, key=lambda e: e["event_id"])
        by_id = {e["event_id"]: e for e in events}
        lanes: List[float] = []  # per lane: when its last slice ends
        for lease in sorted(buf.leases, key=lambda l: l["lease_id"]):
            start = lease_t[lease["lease_id"]]
            ev = by_id.get(lease.get("retired_by")) if lease.get("retired_by") is not None else None
            if ev is None:  # died before its bytes were reused, or still lent: ends at the next reuse of its bytes
                lo, hi = lease["byte_range"]
                ev = next((e for e in events if e["event_id"] > lease["lease_id"]
                           and e["byte_range"][0] < hi and lo < e["byte_range"][1]), None)
            end = event_t[ev["event_id"]] if ev is not None else end_of_trace
            r = lease.get("retained")
            red_end = None
            if r:
                red_end = r.get("t") if r.get("t") is not None else end_of_trace
                red_end = max(red_end, end + 1e-6)
            last = red_end if red_end is not None else end
            lane = next((i for i, busy in enumerate(lanes) if busy <= start), None)
            if lane is None:
                lanes.append(0.0)
                lane = len(lanes) - 1
            lanes[lane] = last
            lo, hi = lease["byte_range"]
            args = {"lease_id": lease["lease_id"], "bytes": f"[{lo:#x}, {hi:#x})", "dtype": lease.get("dtype"),
                    "shape": lease.get("shape"), "lent_at_generation": lease.get("generation"),
                    "rescued": lease.get("rescued", False)}
            name = lease.get("name") or f"lease {lease['lease_id']}"  # (a lend without a name)
            out.append({"ph": "X", "cat": "lease", "name": name,
                        "pid": pid, "tid": lane + 1, "ts": round(start * 1e6, 3),
                        "dur": round(max(end - start, 1e-6) * 1e6, 3), "args": args})
            if r:
                out.append({"ph": "X", "cat": "retention", "cname": "terrible",
                            "name": f"retained by {r.get('holder') or 'an unnamed holder'}",
                            "pid": pid, "tid": lane + 1, "ts": round(end * 1e6, 3),
                            "dur": round((red_end - end) * 1e6, 3),
                            "args": {"lease": lease.get("name"), "holder": r.get("holder"), "until": r.get("until"),
                                     "read_stale_at": site_text(r.get("read_at")), "counted": r.get("counted", False)}})
                if r.get("until") == "stale_read":
                    out.append({"ph": "i", "s": "t", "cat": "stale_read", "cname": "terrible",
                                "name": f"stale read of {name}", "pid": pid, "tid": lane + 1,
                                "ts": round(red_end * 1e6, 3), "args": {"at": site_text(r.get("read_at"))}})
        for lane in range(len(lanes)):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": lane + 1,
                        "args": {"name": f"lane {lane + 1}"}})
        for ev in events:
            lo, hi = ev["byte_range"]
            verb = {"close": "close", "retire": "retire"}.get(ev.get("kind"), "reuse")
            out.append({"ph": "i", "s": "p", "cat": "reuse", "pid": pid, "tid": 0,
                        "name": f"{verb} for {ev['by']}" if ev.get("by") else verb,
                        "ts": round(event_t[ev["event_id"]] * 1e6, 3),
                        "args": {"bytes": f"[{lo:#x}, {hi:#x})", "generation_before": ev.get("generation_before"),
                                 "generation_after": ev.get("generation_after")}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "ownership-sanitizer", "summary": (rep.get("summary") or {}).get("line", "")}}


def write_trace(rep: Dict[str, Any], path: str) -> str:
    """Write the trace to ``path``; returns the path."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    return output_file.write_text(path, json.dumps(chrome_trace(rep)) + "\n")  # never half a trace


__all__ = ["chrome_trace", "write_trace"]
