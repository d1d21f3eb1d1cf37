"""A picture of each staging buffer: one self-contained HTML page with inline SVG (no script, no network).

``ownsan triage report.json --html out.html`` draws the report's ``timeline``
section (see :func:`sanitizer.features.triage.timeline`). One panel per staging
buffer: x is the buffer's generation (each reuse advances it), y the byte
offset. Each lease is a box from its lend to the reuse that retired it; a
lease retained past that reuse continues in red to its stale read (a black
mark) or its death, labelled with its holder. Each reuse is a tick over the
bytes it took, labelled with the tensor that took them. Every shape has a
tooltip (SVG ``<title>``) with the details: hover to read them.
"""
from __future__ import annotations

import html
import os
from typing import Any, Dict, List, Optional, Tuple

from sanitizer.core.sites import site_text
from sanitizer.core.units import format_bytes

WIDTH = 1320  # px: fits a 1400 px window
LEFT, RIGHT, TOP, BOTTOM = 92, 24, 22, 34
PLOT_HEIGHT = 230
MAX_BUFFERS = 12  # panels drawn (buffers with retentions first, then the busiest)
MAX_LEASES = 3000  # boxes per panel (the most recent)

LEASE = "#4e79a7"  # a lease from lend to retire
DEAD = "#a9c1dc"  # a lease that died before its bytes were reused (box ends at that reuse)
RETAINED = "#d62728"  # held past the reuse of its bytes
REUSE = "#444444"

_CSS = """
body { font: 14px/1.4 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 18px 0 4px; }
h2 small { font-weight: normal; color: #666; font-size: 13px; }
.summary { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; margin: 4px 0 8px; }
.legend span { display: inline-block; margin-right: 18px; font-size: 13px; }
.legend i { display: inline-block; width: 22px; height: 11px; margin-right: 5px; vertical-align: -1px; }
svg { display: block; background: #fbfbfb; border: 1px solid #e3e3e3; }
svg text { font: 11px -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; fill: #333; }
svg .axis text { fill: #777; font-size: 10px; }
svg g.lease:hover rect, svg g.retained:hover rect { stroke: #000; stroke-width: 1.5; }
svg g.reuse:hover line { stroke: #000; stroke-width: 2.5; }
svg .holder { fill: #8b0000; font-weight: 600; }
table { border-collapse: collapse; margin-top: 6px; font-size: 13px; width: 100%; max-width: 1320px;
        table-layout: fixed; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 10px 3px 0; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }
th { font-weight: 600; } td.num { text-align: right; }
code { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }
.note { color: #666; font-size: 12px; }
"""


def _esc(text: Any) -> str:
    return html.escape("" if text is None else str(text), quote=True)


class _Labels:
    """Text labels already placed in a panel: a new one that would overlap them is left out (the
    tooltips still carry everything)."""

    def __init__(self) -> None:
        self.boxes: List[Tuple[float, float, float, float]] = []

    def free(self, x: float, y: float, text: str, size: float = 11.0) -> bool:
        box = (x - 1, y - size, x + 0.58 * size * len(text) + 1, y + 2)
        for b in self.boxes:
            if box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]:
                return False
        self.boxes.append(box)
        return True


class _Buffer:
    """One panel's data: the buffer, its leases and reuses, and the generation range drawn."""

    def __init__(self, info: dict):
        self.info = info
        self.leases: List[dict] = []
        self.events: List[dict] = []

    @property
    def retained(self) -> List[dict]:
        return [l for l in self.leases if l.get("retained")]


def _key(item: dict, default_pid: Any) -> Tuple[Any, Any]:
    return (item.get("pid", default_pid), item.get("buffer", item.get("id")))


def buffers_of(rep: Dict[str, Any]) -> List[_Buffer]:
    """The buffers to draw, most interesting first: retentions, then the busiest."""
    tl = rep.get("timeline") or {}
    pid = rep.get("pid")
    by_key: Dict[Tuple[Any, Any], _Buffer] = {}
    for b in tl.get("buffers", ()):
        by_key[(b.get("pid", pid), b.get("id"))] = _Buffer(b)
    for lease in tl.get("leases", ()):
        buf = by_key.get(_key(lease, pid))
        if buf is not None:
            buf.leases.append(lease)
    for ev in tl.get("events", ()):
        buf = by_key.get(_key(ev, pid))
        if buf is not None:
            buf.events.append(ev)
    bufs = [b for b in by_key.values() if b.leases]
    bufs.sort(key=lambda b: (-len(b.retained), -len(b.leases), str(b.info.get("name"))))
    return bufs


def _end_of(lease: dict, events_by_id: Dict[int, dict], events: List[dict], now: int) -> Tuple[float, str]:
    """The generation where a lease's box ends, and how: 'retired', 'reused' (died before) or 'alive'."""
    ev = events_by_id.get(lease.get("retired_by")) if lease.get("retired_by") is not None else None
    if ev is not None:
        after = ev.get("generation_after")
        return (after if after is not None else ev["generation_before"] + 1), "retired"
    start, end = lease["byte_range"]
    for ev in events:  # sorted by event id: the first later reuse of any of its bytes
        if ev["generation_before"] >= lease["generation"] and ev["byte_range"][0] < end and start < ev["byte_range"][1]:
            after = ev.get("generation_after")
            return (after if after is not None else ev["generation_before"] + 1), "reused"
    return (now + 1 if lease.get("alive") else lease["generation"] + 1), ("alive" if lease.get("alive") else "gone")


def _lease_title(lease: dict, how: str, end: float) -> str:
    shape = ", ".join(str(s) for s in lease.get("shape", ()))
    lo, hi = lease["byte_range"]
    lines = [f"{lease.get('name') or '<lease ' + str(lease['lease_id']) + '>'} {lease.get('dtype', '')}[{shape}]",
             f"bytes [{lo:#x}, {hi:#x}) ({format_bytes(hi - lo)})",
             f"lent at generation {lease['generation']}"]
    if how == "retired":
        lines.append(f"retired at generation {end:g}")
    elif how == "reused":
        lines.append(f"died before generation {end:g}, when its bytes were reused")
    elif how == "alive":
        lines.append("still lent")
    if lease.get("rescued"):
        lines.append("rescued: moved onto an owned copy")
    return "\n".join(lines)


def _panel(buf: _Buffer, index: int) -> str:
    info = buf.info
    nbytes = max(1, int(info.get("nbytes") or 1))
    now = int(info.get("generation") or 0)
    leases = sorted(buf.leases, key=lambda l: l["lease_id"])
    if len(leases) > MAX_LEASES:
        kept = {l["lease_id"] for l in leases[-MAX_LEASES:]} | {l["lease_id"] for l in buf.retained}
        leases = [l for l in leases if l["lease_id"] in kept]
    events = sorted(buf.events, key=lambda e: e["event_id"])
    by_id = {e["event_id"]: e for e in events}
    spans = []
    for lease in leases:
        end, how = _end_of(lease, by_id, events, now)
        red_end = None
        r = lease.get("retained")
        if r:
            g = r.get("generation")
            red_end = float(g if g is not None else now + 1)
            red_end = max(red_end, end + 0.35)  # a read in the very generation of its reuse still shows
        spans.append((lease, end, how, red_end))
    g0 = min([l["generation"] for l in leases] + [e["generation_before"] for e in events
                                                   if e["generation_before"] >= min(l["generation"] for l in leases)])
    g1 = max([s[1] for s in spans] + [s[3] for s in spans if s[3] is not None] + [g0 + 1])
    plot_w = WIDTH - LEFT - RIGHT
    height = TOP + PLOT_HEIGHT + BOTTOM

    def x(g: float) -> float:
        return LEFT + (g - g0) / (g1 - g0) * plot_w

    def y(offset: float) -> float:
        return TOP + offset / nbytes * PLOT_HEIGHT

    out = [f'<svg id="timeline-{index}" class="timeline" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" role="img" '
           f'aria-label="timeline of staging buffer {_esc(info.get("name"))}">']
    out.append(f'<text x="{LEFT}" y="{TOP + PLOT_HEIGHT + 29}" class="bufname" font-weight="600">'
               f'{_esc(info.get("name"))}</text>')
    # label candidates by priority (holders, then the reuses that hurt, other reuses, lease names): placed
    # after the shapes, each only where it overlaps no label already placed
    holder_labels: List[Tuple[float, float, str, float, str]] = []
    reuse_labels: List[Tuple[float, float, str, float, str]] = []
    name_labels: List[Tuple[float, float, str, float, str]] = []
    # axes: byte offsets on the left, generations below
    out.append('<g class="axis">')
    for i in range(5):
        off = nbytes * i / 4
        out.append(f'<line x1="{LEFT - 4}" x2="{WIDTH - RIGHT}" y1="{y(off):.1f}" y2="{y(off):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y(off) + 3:.1f}" text-anchor="end">{int(off):#x}</text>')
    step = max(1, round((g1 - g0) / 12))
    g = int(g0)
    while g <= g1:
        out.append(f'<line x1="{x(g):.1f}" x2="{x(g):.1f}" y1="{TOP + PLOT_HEIGHT}" y2="{TOP + PLOT_HEIGHT + 4}" '
                   f'stroke="#999"/><text x="{x(g):.1f}" y="{TOP + PLOT_HEIGHT + 15}" text-anchor="middle">{g}</text>')
        g += step
    out.append(f'<text x="{WIDTH - RIGHT}" y="{TOP + PLOT_HEIGHT + 29}" text-anchor="end">generation of '
               f'{_esc(info.get("name"))} (each reuse advances it) &#8594;</text>')
    out.append(f'<text x="12" y="{TOP + PLOT_HEIGHT / 2:.0f}" transform="rotate(-90 12 {TOP + PLOT_HEIGHT / 2:.0f})" '
               f'text-anchor="middle">byte offset</text>')
    out.append("</g>")
    # leases
    for lease, end, how, red_end in spans:
        lo, hi = lease["byte_range"]
        x0, x1 = x(lease["generation"]), x(end)
        y0, h = y(lo), max(1.5, y(hi) - y(lo))
        fill = DEAD if how in ("reused", "gone") else LEASE
        title = _lease_title(lease, how, end)
        out.append(f'<g class="lease" data-lease="{lease["lease_id"]}"><rect x="{x0:.1f}" y="{y0:.1f}" '
                   f'width="{max(1.0, x1 - x0 - 1):.1f}" height="{h:.1f}" fill="{fill}" fill-opacity="0.75"/>'
                   f'<title>{_esc(title)}</title></g>')
        name = str(lease.get("name") or "")
        if x1 - x0 > 7 * len(name) and h >= 12:
            name_labels.append((x0 + 3, y0 + min(h / 2 + 4, 13), name, 11, ' class="lease-label" style="fill:#fff"'))
    # reuses (drawn over the leases, under the retained boxes)
    retiring = {l.get("retired_by") for l, _, _, r in spans if r is not None}
    for ev in sorted(events, key=lambda e: e["event_id"] not in retiring):  # the reuses that hurt first
        if ev["generation_before"] < g0 or not ev.get("by"):
            continue
        xr = x(ev["generation_after"] if ev.get("generation_after") is not None else ev["generation_before"] + 1)
        reuse_labels.append((xr + 2, max(y(ev["byte_range"][0]) - 2, 10), "\u2193 " + _short(ev["by"], 28), 9,
                             ' class="reuse-label" font-size="9" fill="#555"'))
    for ev in events:
        if ev["generation_before"] < g0:
            continue
        lo, hi = ev["byte_range"]
        xr = x(ev["generation_after"] if ev.get("generation_after") is not None else ev["generation_before"] + 1)
        verb = {"close": "closed", "retire": "retired"}.get(ev.get("kind"), "reused")
        what = f" for {ev['by']}" if ev.get("by") else ""
        title = (f"{verb} bytes [{lo:#x}, {hi:#x}){what}\ngeneration {ev['generation_before']} -> "
                 f"{ev.get('generation_after') if ev.get('generation_after') is not None else 'closed'}")
        out.append(f'<g class="reuse" data-event="{ev["event_id"]}"><line x1="{xr:.1f}" x2="{xr:.1f}" '
                   f'y1="{y(lo):.1f}" y2="{y(hi):.1f}" stroke="{REUSE}" stroke-width="1.5"/>'
                   f'<title>{_esc(title)}</title></g>')
    # retained leases: red from the reuse to the stale read or the death, labelled with the holder
    for lease, end, how, red_end in spans:
        if red_end is None:
            continue
        r = lease["retained"]
        lo, hi = lease["byte_range"]
        x0, x1 = x(end), x(red_end)
        y0, h = y(lo), max(3.0, y(hi) - y(lo))
        until = r.get("until")
        ended = {"stale_read": f"read stale at generation {r.get('generation')}"
                               + (f", at {site_text(r.get('read_at'), basename=True)}" if r.get("read_at") else ""),
                 "death": f"dropped at generation {r.get('generation')}",
                 }.get(until, "still held at the end of the report")
        title = (f"RETAINED {lease.get('name')}\nheld by {r.get('holder') or 'an unnamed holder'}\n"
                 f"its bytes were reused at generation {end:g}; {ended}"
                 + ("\n(holder counted, not walked: the same sites' last holder)" if r.get("counted") else ""))
        out.append(f'<g class="retained" data-lease="{lease["lease_id"]}"><rect x="{x0:.1f}" y="{y0:.1f}" '
                   f'width="{max(3.0, x1 - x0):.1f}" height="{h:.1f}" fill="{RETAINED}"/>'
                   f'<title>{_esc(title)}</title></g>')
        if until == "stale_read":
            cy = y0 + h / 2
            out.append(f'<g class="stale-read"><path d="M{x1 - 5:.1f},{cy - 5:.1f} l10,10 m0,-10 l-10,10" '
                       f'stroke="#000" stroke-width="2.5"/><title>{_esc(ended)}</title></g>')
        label = "held by " + (r.get("holder") or "an unnamed holder")
        room = int((x1 - x0 - 8) / 6.3)  # characters that fit inside the red box
        ty = y0 + min(h / 2 + 4, 13)
        if h >= 11 and room >= 12:
            holder_labels.append((x0 + 3, ty, _short(label, room), 11,
                                  ' class="holder-in" font-weight="600" style="fill:#fff"'))
        else:
            holder_labels.append((x0 + 3, min(y0 + h + 11, TOP + PLOT_HEIGHT - 2), _short(label, 70), 11,
                                  ' class="holder"'))
    labels = _Labels()
    for tx, ty, text, size, attrs in holder_labels + reuse_labels + name_labels:
        if labels.free(tx, ty, text, size):
            out.append(f'<text x="{tx:.1f}" y="{ty:.1f}"{attrs}>{_esc(text)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _short(text: Any, n: int) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n - 1] + "\u2026"


def render_html(rep: Dict[str, Any], title: Optional[str] = None) -> str:
    """The page for a report (a dict as :func:`sanitizer.reporting.report.report` returns or ``load`` reads)."""
    bufs = buffers_of(rep)
    tl = rep.get("timeline") or {}
    summary = (rep.get("summary") or {}).get("line", "")
    title = title or "ownership-sanitizer: staging buffer timeline"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{_esc(title)}</title>", f"<style>{_CSS}</style></head><body>",
             f"<h1>{_esc(title)}</h1>", f'<p class="summary">{_esc(summary)}</p>',
             '<p class="legend">'
             f'<span><i style="background:{LEASE}"></i>lease: lent &#8594; retired by a reuse</span>'
             f'<span><i style="background:{DEAD}"></i>died before its bytes were reused</span>'
             f'<span><i style="background:{RETAINED}"></i>retained past the reuse of its bytes, '
             "labelled with its holder (&#10005; = read stale)</span>"
             f'<span><i style="background:{REUSE};height:2px;vertical-align:3px"></i>reuse, labelled with the tensor '
             "that took the bytes</span> <span class=\"note\">hover any shape for details</span></p>"]
    if not bufs:
        parts.append('<p class="note">This report has no timeline: no lend was recorded while the sanitizer was '
                     "enabled (or timeline_events=0).</p>")
    for i, buf in enumerate(bufs[:MAX_BUFFERS]):
        info = buf.info
        extra = f", pid {info.get('pid')}" if rep.get("processes") else ""
        parts.append(f'<section class="buffer" data-buffer="{_esc(info.get("name"))}">'
                     f"<h2>{_esc(info.get('name'))} <small>{format_bytes(int(info.get('nbytes') or 0))} on "
                     f"{_esc(info.get('device', '?'))}, generation {info.get('generation')}, "
                     f"{len(buf.leases)} lease{'s' * (len(buf.leases) != 1)} drawn, "
                     f"{len(buf.retained)} retained{extra}</small></h2>")
        parts.append(_panel(buf, i))
        parts.append("</section>")
    if len(bufs) > MAX_BUFFERS:
        parts.append(f'<p class="note">{len(bufs) - MAX_BUFFERS} more buffer(s) not drawn (fewer retentions and '
                     "lends).</p>")
    if tl.get("dropped"):
        parts.append(f'<p class="note">{tl["dropped"]} older lend(s) are not in the report (timeline_events='
                     f'{tl.get("cap")}): only the most recent and every retained one are drawn.</p>')
    consumers = (rep.get("summary") or {}).get("retaining_consumers", [])
    if consumers:
        parts.append("<h2>Retaining consumers</h2><table><colgroup><col style=\"width:24%\"><col style=\"width:5%\">"
                     "<col style=\"width:7%\"><col style=\"width:20%\"><col style=\"width:17%\">"
                     "<col style=\"width:27%\"></colgroup><tr><th>holder</th><th>count</th><th>bytes</th>"
                     "<th>read stale at</th><th>holder lives at</th><th>fix</th></tr>")
        for g in consumers:
            parts.append(f"<tr><td><code>{_esc(g.get('consumer'))}</code></td><td class=\"num\">{g.get('count')}</td>"
                         f"<td class=\"num\">{format_bytes(int(g.get('bytes') or 0))}</td>"
                         f"<td>{_esc(', '.join(g.get('read_stale_at') or []) or '-')}</td>"
                         f"<td>{_esc(g.get('site') or '?')}</td><td>{_esc(g.get('fix') or '')}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(rep: Dict[str, Any], path: str, title: Optional[str] = None) -> str:
    """Write the page to ``path``; returns the path."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(render_html(rep, title))
    return path


__all__ = ["render_html", "write_html", "buffers_of", "RETAINED", "LEASE"]
