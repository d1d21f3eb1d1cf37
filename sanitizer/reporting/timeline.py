"""A picture of each staging buffer: one self-contained HTML page with inline SVG (no script, no network).

``ownsan triage report.json --html out.html`` draws the report's ``timeline``
section (see :func:`sanitizer.features.triage.timeline`). One panel per staging
buffer: x is the buffer's generation (each reuse advances it), y the byte
offset. Each lease is a box from its lend to the reuse that retired it; a
lease retained past that reuse continues in red to its stale read (a black
cross, drawn over every box) or its death. Each retained lease is numbered
(``#1``) in the chart and listed under it with its holder, the tensor that
took its bytes and what ended it. Each reuse is a tick over the bytes it took;
the reuses that retired a retained lease are labelled, above the chart, with
the tensor that took the bytes. Every shape has a tooltip (SVG ``<title>``).

Labels are placed once, when the page is written (it has no script), by the
collision-avoiding layout of :mod:`sanitizer.reporting.label_layout`: none
overlaps another or a stale-read cross, none leaves its panel, and names are
shown without the prefix and suffix all the panel's names share (said once in
the panel's heading), shortened in the middle so the part that differs shows.
The SVG is drawn at the page's width (its ``viewBox`` scales, text included),
so the layout holds at any window size.
"""
from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from itertools import islice
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from sanitizer.core import output_file
from sanitizer.core.sites import site_text
from sanitizer.core.units import format_bytes
from sanitizer.reporting.label_layout import (ASCENT, CHAR_WIDTH, DESCENT, ELLIPSIS, Anchor, Box, LabelRequest, Placed,
                                              abbreviations,
                                              baseline_centred, common_prefix, common_suffix, label_height,
                                              nice_step, place_labels, short_name, text_width, variants)

WIDTH = 1100  # the viewBox width; the SVG is drawn at the page's width but never narrower (CSS min-width:
MAX_WIDTH = 1600  # a narrower window scrolls the chart sideways, its text never shrinks) nor wider than this
PLOT_HEIGHT = 400
RIGHT = 16
LABEL = 12.0  # font size of the labels in the chart (viewBox units)
AXIS = 11.0  # font size of the axes
PITCH = 1.45 * LABEL  # label rows in the band above the plot
BAND_ROWS = 4  # rows of reuse labels at most
MAX_BUFFERS = 12  # panels drawn (buffers with retentions first, then the busiest)
MAX_LEASES = 3000  # boxes per panel (the most recent)
MAX_LABELS = 400  # label requests per panel, in priority order (more would not fit; the rest: tooltips only)
MAX_LISTED = 200  # retained leases listed under a panel
MARK = 6.0  # half the size of a stale-read cross
GUTTER = 220.0  # at most this much of the plot's right end is kept for labels beside the last boxes
LABEL_GAP = CHAR_WIDTH * LABEL  # room between two reuse labels on one row: a character

LEASE = "#4e79a7"  # a lease from lend to retire
DEAD = "#a9c1dc"  # a lease that died before its bytes were reused (box ends at that reuse)
RETAINED = "#d62728"  # held past the reuse of its bytes
REUSE = "#444444"
COUNTED = ("not seen holding this view: named after what held the earlier views lent and reused at the same "
           "lines")
_MONO = "'DejaVu Sans Mono', Menlo, Consolas, 'Liberation Mono', ui-monospace, monospace"

_CSS = f"""
body {{ font: 14px/1.4 -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 16px 24px; color: #222; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }} h2 {{ font-size: 16px; margin: 18px 0 4px; }}
h2 small {{ font-weight: normal; color: #666; font-size: 13px; }}
h3 {{ font-size: 14px; margin: 10px 0 2px; }}
.summary {{ font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 13px; margin: 4px 0 8px; }}
.legend span {{ display: inline-block; margin-right: 18px; font-size: 13px; }}
.legend i {{ display: inline-block; width: 22px; height: 11px; margin-right: 5px; vertical-align: -1px; }}
div.chart {{ overflow-x: auto; max-width: {MAX_WIDTH}px; }}
svg.timeline {{ display: block; width: 100%; height: auto; min-width: {WIDTH}px; max-width: {MAX_WIDTH}px;
               background: #fbfbfb; border: 1px solid #e3e3e3; box-sizing: border-box; }}
p.names {{ font-size: 13px; color: #444; margin: 4px 0 6px; }}
svg text {{ font-family: {_MONO}; fill: #333; }}
svg .axis text {{ fill: #666; }}
svg text.out {{ paint-order: stroke; stroke: #fbfbfb; stroke-width: 3px; stroke-linejoin: round; }}
svg text.in-red, svg text.in-lease {{ fill: #fff; }}
svg text.in-dead {{ fill: #1f3a5f; }}
svg text.marker {{ font-weight: 600; }} svg text.marker.out {{ fill: #8b0000; }}
svg text.reuse-label {{ fill: #555; }}
svg g.lease:hover rect, svg g.retained:hover rect {{ stroke: #000; stroke-width: 1.5; }}
svg g.reuse:hover line {{ stroke: #000; stroke-width: 2.5; }}
table {{ border-collapse: collapse; margin-top: 6px; font-size: 13px; width: 100%; table-layout: fixed; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 3px 10px 3px 0; text-align: left; vertical-align: top;
         overflow-wrap: anywhere; }}
th {{ font-weight: 600; }} td.num {{ text-align: right; }}
code {{ font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12px; }}
.note {{ color: #666; font-size: 12px; }}
"""


def _esc(text: Any) -> str:
    """``text`` (any value: a number of a report that never met the schema too) as HTML text or a quoted
    attribute's value. Every value of a report goes through it: a name is whatever a program or a crafted
    report made it."""
    return html.escape(output_file.printable("" if text is None else str(text)), quote=True)


def _printable_tree(value: Any) -> Any:
    """``value`` (a report, or a part of one) with every string :func:`~sanitizer.core.output_file.printable`
    (a report read back from JSON holds a non-UTF-8 name as lone surrogates, which no page can encode)."""
    if isinstance(value, str):
        return output_file.printable(value)
    if isinstance(value, dict):
        return {_printable_tree(k): _printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_tree(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_printable_tree(v) for v in value)
    return value


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


def _after(ev: dict) -> float:
    """The generation a reuse leads to (a close has none: the one after)."""
    after = ev.get("generation_after")
    return after if after is not None else ev["generation_before"] + 1


def _end_of(lease: dict, events_by_id: Dict[int, dict], events: List[dict], now: int) -> Tuple[float, str]:
    """The generation where a lease's box ends, and how: 'retired', 'reused' (died before) or 'alive'."""
    ev = events_by_id.get(lease.get("retired_by")) if lease.get("retired_by") is not None else None
    if ev is not None:
        return _after(ev), "retired"
    start, end = lease["byte_range"]
    for ev in events:  # sorted by event id: the first later reuse of any of its bytes
        if ev["generation_before"] >= lease["generation"] and ev["byte_range"][0] < end and start < ev["byte_range"][1]:
            return _after(ev), "reused"
    return (now + 1 if lease.get("alive") else lease["generation"] + 1), ("alive" if lease.get("alive") else "gone")


def _name(lease: dict) -> str:
    """A lease's name, or what stands for it when the lend had none."""
    return lease.get("name") or f"<lease {lease['lease_id']}>"


def _at_generation(g: Any) -> str:
    """`` at generation g``, or nothing when the report does not know it."""
    return f" at generation {g:g}" if isinstance(g, (int, float)) else ""


def _lease_title(lease: dict, how: str, end: float) -> str:
    shape = ", ".join(str(s) for s in lease.get("shape", ()))
    lo, hi = lease["byte_range"]
    lines = [f"{_name(lease)} {lease.get('dtype', '')}[{shape}]",
             f"bytes [{lo:#x}, {hi:#x}) ({format_bytes(hi - lo)})",
             f"lent{_at_generation(lease.get('generation'))}"]
    if how == "retired":
        lines.append(f"retired{_at_generation(end)}")
    elif how == "reused":
        lines.append(f"died before generation {end:g}, when its bytes were reused")
    elif how == "alive":
        lines.append("still lent")
    if lease.get("rescued"):
        lines.append("rescued: moved onto an owned copy")
    return "\n".join(lines)


def _ended(r: dict) -> str:
    """What ended a retention, in words (never a missing value)."""
    until = r.get("until")
    if until == "stale_read":
        where = site_text(r.get("read_at"), basename=True)
        return f"read stale{_at_generation(r.get('generation'))}" + (f", at {where}" if where else "")
    if until == "death":
        return f"dropped{_at_generation(r.get('generation'))}"
    return "still held at the end of the report"


class _Names:
    """How a panel writes tensor names: without the prefix and suffix they all share (the suffix kept where
    it would leave a name almost nothing: ``0.weight``, not ``0``)."""

    SHORTEST = 4

    def __init__(self, names: Sequence[Optional[str]]):
        self.prefix = common_prefix(names)
        self.suffix = common_suffix(names, self.prefix)
        if self.suffix and min((len(self(n)) for n in names if n), default=self.SHORTEST) < self.SHORTEST:
            self.suffix = ""

    def __call__(self, name: Optional[str]) -> str:
        return short_name(name, self.prefix, self.suffix)

    def note(self) -> str:
        """The heading's explanation, as HTML ('' when names are shown whole)."""
        if not self.prefix and not self.suffix:
            return ""
        return f", tensor names shown as <code>{_esc(self.prefix)}&#8230;{_esc(self.suffix)}</code>"

    def key(self, shown: Sequence[Tuple[str, str]]) -> str:
        """The paragraph under a chart that says how its labels shorten names, as HTML: what every name
        shares (left out), the initials the labels use with what each stands for, the ellipsis; where to
        find a whole name. ``shown``: each label's (whole short name, text shown). '' when every label
        shows its whole name."""
        initials: Dict[str, List[str]] = {}
        cut = False
        for whole, text in shown:
            if not text or text == whole:
                continue
            pairs = abbreviations(whole, text)
            cut = cut or not pairs
            for short, part in pairs:
                if part not in initials.setdefault(short, []):
                    initials[short].append(part)
        if not self.prefix and not self.suffix and not initials and not cut:
            return ""
        out = ['<p class="names"><b>Short names in the chart.</b> ']
        if self.prefix or self.suffix:
            shared = " and ".join(f"<code>{_esc(x)}</code>" for x in (self.prefix, self.suffix) if x)
            example = next((w for w, _ in shown if w), "")
            out.append(f"Every name here shares {shared}: the labels leave it out" + (
                f" (<code>{_esc(self.prefix + example + self.suffix)}</code> is shown as <code>{_esc(example)}</code>)"
                if example else "") + ". ")
        if initials or cut:
            out.append("Where a label has no room for the rest, it keeps the first and the last parts of the "
                       "name and shortens the parts between them: ")
            if initials:
                out.append("each to its initial (" + ", ".join(
                    f"<code>{_esc(k)}</code> = <code>{_esc(' or '.join(v))}</code>"
                    for k, v in sorted(initials.items())) + ")" + (", or " if cut else ". "))
            if cut:
                out.append(f"left out, as <code>{ELLIPSIS}</code>. ")
        out.append("Hover a label for its whole name; the list under the chart gives them whole.</p>")
        return "".join(out)


class _Panel:
    """One buffer's SVG and its list of retained leases: geometry, shapes, then the labels laid out."""

    def __init__(self, buf: _Buffer, index: int):
        self.buf = buf
        self.index = index
        info = buf.info
        self.nbytes = max(1, int(info.get("nbytes") or 1))
        self.now = int(info.get("generation") or 0)
        leases = sorted(buf.leases, key=lambda l: l["lease_id"])
        if len(leases) > MAX_LEASES:
            kept = {l["lease_id"] for l in leases[-MAX_LEASES:]} | {l["lease_id"] for l in buf.retained}
            leases = [l for l in leases if l["lease_id"] in kept]
        self.events = sorted(buf.events, key=lambda e: e["event_id"])
        by_id = {e["event_id"]: e for e in self.events}
        self.spans: List[Tuple[dict, float, str, Optional[float]]] = []
        for lease in leases:
            end, how = _end_of(lease, by_id, self.events, self.now)
            red_end = None
            r = lease.get("retained")
            if r:
                g = r.get("generation")
                red_end = float(g if isinstance(g, (int, float)) else self.now + 1)
                red_end = max(red_end, end + 0.35)  # a read in the very generation of its reuse still shows
            self.spans.append((lease, end, how, red_end))
        self.names = _Names([l.get("name") for l in leases] + [e.get("by") for e in self.events])
        first = min(l["generation"] for l in leases)
        self.g0 = min([first] + [e["generation_before"] for e in self.events if e["generation_before"] >= first])
        self.g1 = max([s[1] for s in self.spans] + [s[3] for s in self.spans if s[3] is not None] + [self.g0 + 1])
        retiring = {l.get("retired_by") for l, _, _, r in self.spans if r is not None}
        self.hurting = [e for e in self.events if e["event_id"] in retiring and e.get("by")]
        # geometry: offset labels on the left, a band of reuse labels above the plot, generations below
        self.b0, self.b1, self.offsets = byte_range(
            [l["byte_range"] for l in leases] + [e["byte_range"] for e in self.events if e.get("kind") != "close"],
            self.nbytes)  # a close retires the whole buffer: it says nothing of the bytes used
        widest = max(text_width(f"{int(o):#x}", AXIS) for o in self.offsets)
        self.left = 6 + label_height(AXIS) + 8 + widest + 6
        self.band_rows = min(BAND_ROWS, max(1, len(self.hurting)))
        self.band = Box(2, 4, WIDTH - 2, 4 + self.band_rows * PITCH)
        top = self.band.y1 + 8
        self.plot = Box(self.left, top, WIDTH - RIGHT, top + PLOT_HEIGHT)
        self.gutter = self._gutter()
        self.tick_y = self.plot.y1 + 6 + ASCENT * AXIS
        self.title_y = self.tick_y + 1.6 * AXIS
        self.height = self.title_y + DESCENT * AXIS + 6

    @property
    def zoomed(self) -> bool:
        """Whether the byte axis shows less than the whole buffer (only the bytes lent)."""
        return (self.b0, self.b1) != (0, self.nbytes)

    def zoom_note(self) -> str:
        """The heading's word on a zoomed byte axis ('' when the whole buffer is drawn)."""
        if not self.zoomed:
            return ""
        return (f"; byte axis zoomed to the bytes lent, {self.b0:#x}-{self.b1:#x} ({format_bytes(self.b1 - self.b0)}"
                f" of {format_bytes(self.nbytes)}: the rest was never lent)")

    def _gutter(self) -> float:
        """Room kept free of boxes at the plot's right end for the labels of the retained leases that end
        near it (a read in the last generations, later leases after it): beside their box, over no other."""
        at_end = [lease for lease, _, _, red_end in self.spans
                  if red_end is not None and red_end >= self.g1 - 0.15 * (self.g1 - self.g0)]
        if not at_end:
            return 0.0
        n = len([s for s in self.spans if s[3] is not None])
        widest = max(len(self.names(_name(l))) for l in at_end)
        return min(GUTTER, text_width(f"#{n} ", LABEL) + widest * CHAR_WIDTH * LABEL + 2 * MARK + 8)

    def x(self, g: float) -> float:
        return self.plot.x0 + (g - self.g0) / (self.g1 - self.g0) * (self.plot.width - self.gutter)

    def y(self, offset: float) -> float:
        offset = min(max(offset, self.b0), self.b1)
        return self.plot.y0 + (offset - self.b0) / (self.b1 - self.b0) * self.plot.height

    # -- shapes ------------------------------------------------------------------------
    def _lease_boxes(self) -> List[Tuple[dict, str, float, Box]]:
        out = []
        for lease, end, how, _ in self.spans:
            lo, hi = lease["byte_range"]
            x0, x1 = self.x(lease["generation"]), self.x(end)
            y0 = self.y(lo)
            out.append((lease, how, end, Box(x0, y0, x0 + max(1.0, x1 - x0 - 1), y0 + max(1.5, self.y(hi) - y0))))
        return out

    def _red_boxes(self) -> List[Tuple[dict, float, Box]]:
        """The red boxes; those that cover one another (leases retained one after the other in the same
        bytes) share the height of their bytes in strips, so that each stays visible."""
        out = []
        for lease, end, _, red_end in self.spans:
            if red_end is None:
                continue
            lo, hi = lease["byte_range"]
            x0, x1 = self.x(end), self.x(red_end)
            y0 = self.y(lo)
            out.append((lease, end, Box(x0, y0, x0 + max(3.0, x1 - x0), y0 + max(3.0, self.y(hi) - y0))))
        return [(lease, end, box) for (lease, end, _), box in zip(out, _strips([b for _, _, b in out]))]

    def _marks(self, reds: List[Tuple[dict, float, Box]]) -> List[Tuple[dict, Box]]:
        """A cross at the end of each red box that ended in a stale read, at the middle of its height; two
        that would overlap (reads at the same time in the same bytes) are moved apart along the box's end,
        else back along the box: each cross is seen."""
        out: List[Tuple[dict, Box]] = []
        for lease, _, box in reds:
            if lease["retained"].get("until") != "stale_read":
                continue
            cx, cy = box.x1, (box.y0 + box.y1) / 2
            cx = min(cx, self.plot.x1 + RIGHT - MARK - 1)  # a read at the very end stays in the panel
            step = 2 * MARK + 1
            tries = [(cx, cy)] + [(cx, cy + k * d * step) for k in range(1, 6) for d in (1, -1)
                                  if box.y0 <= cy + k * d * step <= box.y1]
            tries += [(cx - k * step, cy) for k in range(1, 6) if cx - k * step >= box.x0]
            for x, y in tries:
                mark = Box(x - MARK, y - MARK, x + MARK, y + MARK)
                if not any(mark.overlaps(m) for _, m in out):
                    break
            else:
                mark = Box(cx - MARK, cy - MARK, cx + MARK, cy + MARK)
            out.append((lease, mark))
        return out

    def _tick_x(self, ev: dict) -> float:
        return self.x(_after(ev))

    # -- labels ----------------------------------------------------------------------------
    def _requests(self, boxes: List[Tuple[dict, str, float, Box]], reds: List[Tuple[dict, float, Box]],
                  numbers: Dict[int, int]) -> Iterator[LabelRequest]:
        """The labels to place, most important first (made lazily: the layout takes the first MAX_LABELS)."""
        pitch = PITCH
        # 1. every retained lease: its number and name, inside its red box, else beside it
        for lease, _, box in reds:
            n = numbers[lease["lease_id"]]
            mid = (box.y0 + box.y1) / 2
            inside = Box(box.x0 + 1, box.y0, box.x1 - 1, box.y1)
            # inside it, clear of the crosses of the reads drawn over it (a neighbour's read at its start)
            anchors = [Anchor(x, baseline_centred(mid + dy, LABEL), "start", "in-red", within=inside)
                       for x in (box.x0 + 3, box.x0 + 2 * MARK + 5) for dy in (0, -pitch, pitch)]
            for dy in (0, -pitch, pitch, -2 * pitch, 2 * pitch):  # beside it: clear of every box
                yb = baseline_centred(mid + dy, LABEL)
                anchors += [Anchor(box.x1 + MARK + 3, yb, "start", "out", free=True),
                            Anchor(box.x0 - 3, yb, "end", "out", free=True)]
            if self.gutter:  # at its height in the room kept right of the last boxes
                x_end = self.x(self.g1) + MARK + 3
                anchors += [Anchor(x_end, baseline_centred(mid + dy, LABEL), "start", "out", free=True)
                            for dy in (0, -pitch, pitch, -2 * pitch, 2 * pitch)]
            anchors += [Anchor(box.x0, box.y0 - DESCENT * LABEL - 2, "start", "out", free=True),
                        Anchor(box.x0, box.y1 + ASCENT * LABEL + 2, "start", "out", free=True)]
            options = [f"#{n} {s}" for s in variants(self.names(_name(lease)))] + [f"#{n}"]
            yield LabelRequest(options, anchors, LABEL, self.plot, key=("marker", lease), place_first=True)
        # 2. the reuses that retired a retained lease, in the band above: the tensor that took the bytes
        rows = [self.band.y0 + ASCENT * LABEL + r * pitch for r in range(self.band_rows)]
        half = CHAR_WIDTH * LABEL / 2  # the arrow's middle is over the tick
        for ev in self.hurting:
            xr = self._tick_x(ev)
            anchors = []
            for yb in rows:  # the guide from the label down to the plot crosses no label of a lower row
                guide = Box(xr - 1, yb + DESCENT * LABEL, xr + 1, self.band.y1)
                anchors += [Anchor(xr - half, yb, "start", "out", "\u2193 {}", guide=guide),
                            Anchor(xr + half, yb, "end", "out", "{} \u2193", guide=guide)]
            yield LabelRequest(variants(self.names(ev["by"])), anchors, LABEL, self.band, key=("reuse", ev),
                               gap=LABEL_GAP)
        # 3. lease names inside their boxes, where no red box covers them
        for lease, how, _, box in boxes:
            if box.height < label_height(LABEL) + 2 or box.width < text_width("xxxx", LABEL) + 6:
                continue
            inside = Box(box.x0 + 1, box.y0, box.x1 - 1, box.y1)
            yb = baseline_centred((box.y0 + box.y1) / 2, LABEL)
            style = "in-lease" if how in ("retired", "alive") else "in-dead"
            starts = [box.x0 + 3] + sorted(r.x1 + MARK + 3 for _, _, r in reds
                                           if r.overlaps(box) and box.x0 < r.x1 + MARK + 3 < box.x1)
            yield LabelRequest(variants(self.names(_name(lease))),
                               [Anchor(x, yb, "start", style, within=inside) for x in starts],
                               LABEL, self.plot, solid=True, key=("name", lease))

    def layout(self) -> "Layout":
        """Every shape of the panel and every label placed among them (what the page draws; tests read it)."""
        boxes = self._lease_boxes()
        reds = self._red_boxes()
        marks = self._marks(reds)
        numbers = {lease["lease_id"]: i + 1 for i, (lease, _, _) in enumerate(reds)}
        requests = islice(self._requests(boxes, reds, numbers), MAX_LABELS)
        placed = [pl for pl in place_labels(requests, obstacles=[b for _, b in marks], solids=[b for _, _, b in reds],
                                            shapes=[b for _, _, _, b in boxes])
                  if pl is not None]
        return Layout(boxes, reds, marks, numbers, placed)

    def svg(self, lay: Optional["Layout"] = None) -> Tuple[str, List[Tuple[int, dict, Optional[dict]]]]:
        """The panel's SVG, and its retained leases in number order (number, lease, the reuse that retired it)."""
        info = self.buf.info
        lay = lay or self.layout()
        boxes, reds, marks, numbers, placed = lay.boxes, lay.reds, lay.marks, lay.numbers, lay.placed
        by_id = {e["event_id"]: e for e in self.events}
        p = self.plot
        out = [f'<svg id="timeline-{self.index}" class="timeline" viewBox="0 0 {WIDTH} {self.height:.0f}" '
               f'preserveAspectRatio="xMinYMin meet" role="img" '
               f'aria-label="timeline of staging buffer {_esc(info.get("name"))}">']
        out.append(f'<rect class="plot" x="{p.x0:.1f}" y="{p.y0:.1f}" width="{p.width:.1f}" height="{p.height:.1f}" '
                   f'fill="#fff"/>')
        out.append(self._axes())
        for lease, how, end, b in boxes:
            fill = DEAD if how in ("reused", "gone") else LEASE
            out.append(f'<g class="lease" data-lease="{_esc(lease["lease_id"])}"><rect x="{b.x0:.1f}" y="{b.y0:.1f}" '
                       f'width="{b.width:.1f}" height="{b.height:.1f}" fill="{fill}" fill-opacity="0.75"/>'
                       f'<title>{_esc(_lease_title(lease, how, end))}</title></g>')
        for ev in self.events:  # reuses: over the leases, under the retained boxes
            if ev["generation_before"] < self.g0:
                continue
            lo, hi = ev["byte_range"]
            xr = self._tick_x(ev)
            verb = {"close": "closed", "retire": "retired"}.get(ev.get("kind"), "reused")
            what = f" for {ev['by']}" if ev.get("by") else ""
            after = ev.get("generation_after")
            title = (f"{verb} bytes [{lo:#x}, {hi:#x}){what}\ngeneration {ev['generation_before']} -> "
                     f"{after if after is not None else 'closed'}")
            out.append(f'<g class="reuse" data-event="{_esc(ev["event_id"])}"><line x1="{xr:.1f}" x2="{xr:.1f}" '
                       f'y1="{self.y(lo):.1f}" y2="{self.y(hi):.1f}" stroke="{REUSE}" stroke-width="1.5"/>'
                       f'<title>{_esc(title)}</title></g>')
        for lease, end, b in reds:
            r = lease["retained"]
            ev = by_id.get(lease.get("retired_by"))
            took = f" for {ev['by']}" if ev is not None and ev.get("by") else ""
            title = (f"#{numbers[lease['lease_id']]} RETAINED {_name(lease)}\n"
                     f"held by {r.get('holder') or 'an unnamed holder'}\n"
                     f"its bytes were reused{took}{_at_generation(end)}; {_ended(r)}"
                     + (f"\n({COUNTED})" if r.get("counted") else ""))
            out.append(f'<g class="retained" data-lease="{_esc(lease["lease_id"])}">'
                       f'<rect x="{b.x0:.1f}" y="{b.y0:.1f}" '
                       f'width="{b.width:.1f}" height="{b.height:.1f}" fill="{RETAINED}" stroke="#fff" '
                       f'stroke-width="0.75"/>'
                       f'<title>{_esc(title)}</title></g>')
        for lease, b in marks:  # over every box: a later box never hides a stale read
            out.append(f'<g class="stale-read" data-lease="{_esc(lease["lease_id"])}"><path d="M{b.x0 + 1:.1f},'
                       f'{b.y0 + 1:.1f} L{b.x1 - 1:.1f},{b.y1 - 1:.1f} M{b.x1 - 1:.1f},{b.y0 + 1:.1f} L{b.x0 + 1:.1f},'
                       f'{b.y1 - 1:.1f}" stroke="#fff" stroke-width="5"/><path d="M{b.x0 + 1:.1f},{b.y0 + 1:.1f} '
                       f'L{b.x1 - 1:.1f},{b.y1 - 1:.1f} M{b.x1 - 1:.1f},{b.y0 + 1:.1f} L{b.x0 + 1:.1f},{b.y1 - 1:.1f}" '
                       f'stroke="#000" stroke-width="2.5"/><title>#{numbers[lease["lease_id"]]} '
                       f'{_esc(_name(lease))}: {_esc(_ended(lease["retained"]))}</title></g>')
        for pl in placed:  # a reuse label's guide down to its tick
            kind, item = pl.request.key
            if kind == "reuse":
                xr = self._tick_x(item)
                out.append(f'<line class="guide" x1="{xr:.1f}" x2="{xr:.1f}" y1="{pl.box.y1:.1f}" '
                           f'y2="{self.plot.y0:.1f}" stroke="#777" stroke-width="1" '
                           f'stroke-dasharray="2,2"/>')
        out.extend(self._text(pl) for pl in placed)
        out.append("</svg>")
        listed = [(numbers[lease["lease_id"]], lease, by_id.get(lease.get("retired_by"))) for lease, _, _ in reds]
        return "\n".join(out), listed

    def full_name(self, pl: Placed) -> str:
        """The whole name a label stands for (the tensor's, or the one a reuse was for)."""
        kind, item = pl.request.key
        return str(item.get("by") or "") if kind == "reuse" else _name(item)

    @staticmethod
    def shown_name(pl: Placed) -> str:
        """The part of a label that is the name (a retained lease's label starts with its number: ``#3 ``)."""
        if pl.request.key[0] == "marker":
            return pl.option.split(" ", 1)[1] if " " in pl.option else ""
        return pl.option

    def _text(self, pl: Placed) -> str:
        """A label, with the whole name it stands for as its tooltip (a label may show a short form)."""
        kind, item = pl.request.key
        cls = {"marker": "marker", "reuse": "reuse-label", "name": "lease-label"}[kind]
        full = self.full_name(pl)
        tip = (pl.text.split(" ", 1)[0] + " " if kind == "marker" else "reused for " if kind == "reuse"
               else "") + full
        return (f'<g class="label-of"><title>{_esc(tip)}</title>'
                f'<text class="label {cls} {pl.at.style}" x="{pl.at.x:.1f}" y="{pl.at.y:.1f}" '
                f'font-size="{pl.request.size:g}" text-anchor="{pl.at.anchor}" '
                f'textLength="{text_width(pl.text, pl.request.size):.1f}" lengthAdjust="spacingAndGlyphs">'
                f'{_esc(pl.text)}</text></g>')

    def _axes(self) -> str:
        """Byte offsets on the left, generations below: each in a margin of its own, spaced not to touch."""
        p = self.plot
        out = ['<g class="axis">']
        for off in self.offsets:
            yy = self.y(off)
            out.append(f'<line x1="{p.x0 - 4:.1f}" x2="{p.x1:.1f}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#eee"/>')
            text = f"{int(off):#x}"
            ty = min(max(baseline_centred(yy, AXIS), p.y0 - 2 + ASCENT * AXIS), p.y1 + 2 - DESCENT * AXIS)
            out.append(_axis_text(text, p.x0 - 6, ty, "end"))
        cx = 6 + ASCENT * AXIS
        cy = (p.y0 + p.y1) / 2
        title = "byte offset"
        if self.zoomed:
            for title in (f"byte offset: {self.b0:#x}-{self.b1:#x} of {format_bytes(self.nbytes)} (the rest never "
                          "lent)", f"byte offset: {self.b0:#x}-{self.b1:#x} of {format_bytes(self.nbytes)}",
                          f"bytes {self.b0:#x}-{self.b1:#x}"):
                if text_width(title, AXIS) <= p.height:
                    break
        out.append(f'<text class="byte-axis" x="{cx:.1f}" y="{cy:.1f}" transform="rotate(-90 {cx:.1f} {cy:.1f})" '
                   f'font-size="{AXIS:g}" text-anchor="middle" textLength="{text_width(title, AXIS):.1f}" '
                   f'lengthAdjust="spacingAndGlyphs">{_esc(title)}</text>')
        per_generation = p.width / (self.g1 - self.g0)
        widest = text_width(str(int(self.g1)), AXIS) + 2 * text_width("x", AXIS)
        step = nice_step(widest / per_generation)
        g = -(-int(self.g0) // step) * step
        while g <= self.g1:
            xx = self.x(g)
            text = str(g)
            half = text_width(text, AXIS) / 2
            tx = min(max(xx, half + 2), WIDTH - half - 2)
            out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{p.y1:.1f}" y2="{p.y1 + 4:.1f}" stroke="#999"/>')
            out.append(_axis_text(text, tx, self.tick_y, "middle"))
            g += step
        title = f"generation of {self.buf.info.get('name')} (each reuse advances it) \u2192"
        out.append(_axis_text(title, WIDTH - RIGHT, self.title_y, "end"))
        out.append("</g>")
        return "\n".join(out)


@dataclass
class Layout:
    """A panel's shapes and labels, in viewBox units: each lease's box (lease, how it ended, its end, box),
    each retained lease's red box (lease, its retire, box), each stale read's cross (lease, box), the
    retained leases' numbers (by lease id), and the labels placed."""

    boxes: List[Tuple[dict, str, float, Box]]
    reds: List[Tuple[dict, float, Box]]
    marks: List[Tuple[dict, Box]]
    numbers: Dict[int, int]
    placed: List[Placed]


def byte_range(ranges: Sequence[Sequence[int]], nbytes: int) -> Tuple[int, int, List[int]]:
    """The byte offsets a panel draws, ``(lo, hi, ticks)``: the whole buffer, or, when its lends and reuses
    used less than half of it, the used bytes rounded out to ticks a power of two apart (a 1 MiB buffer
    of which 64 KiB were lent is drawn 0x0-0x10000, not as one thin line)."""
    whole = (0, nbytes, [nbytes * i // 4 for i in range(5)])
    used = [(int(a), int(b)) for a, b in ranges if b > a]
    if not used:
        return whole
    lo, hi = min(a for a, _ in used), min(nbytes, max(b for _, b in used))
    if hi - lo >= nbytes / 2:
        return whole
    step = 1 << max(0, math.ceil(math.log2(max(1, hi - lo) / 4)))
    lo, hi = lo // step * step, min(nbytes, -(-hi // step) * step)
    if hi - lo >= nbytes / 2:
        return whole
    return lo, hi, list(range(lo, hi + 1, step))


def _strips(boxes: List[Box], limit: int = 400) -> List[Box]:
    """``boxes`` with each group of mutually covering ones (overlapping in x and y) cut into horizontal
    strips, one per box, in the order given (interval colouring: a box takes the lowest strip no box it
    overlaps took). More than ``limit`` boxes: left as they are (the tooltips still tell them apart)."""
    n = len(boxes)
    if n < 2 or n > limit:
        return list(boxes)
    lane = [0] * n
    group = list(range(n))  # union-find over overlaps

    def find(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for i in range(n):
        taken = set()
        for j in range(i):
            if boxes[i].overlaps(boxes[j]):
                taken.add(lane[j])
                group[find(i)] = find(j)
        lane[i] = next(k for k in range(n) if k not in taken)
    lanes: Dict[int, int] = {}
    for i in range(n):
        root = find(i)
        lanes[root] = max(lanes.get(root, 0), lane[i] + 1)
    out = []
    for i, b in enumerate(boxes):
        count = lanes[find(i)]
        if count == 1:
            out.append(b)
            continue
        h = b.height / count
        out.append(Box(b.x0, b.y0 + lane[i] * h, b.x1, b.y0 + (lane[i] + 1) * h))
    return out


def _axis_text(text: str, x: float, y: float, anchor: str) -> str:
    return (f'<text x="{x:.1f}" y="{y:.1f}" font-size="{AXIS:g}" text-anchor="{anchor}" '
            f'textLength="{text_width(text, AXIS):.1f}" lengthAdjust="spacingAndGlyphs">{_esc(text)}</text>')


def _retained_list(name: Any, listed: List[Tuple[int, dict, Optional[dict]]]) -> str:
    """The side list: each numbered retained lease with its holder, the reuse that took its bytes, its end."""
    if not listed:
        return ""
    rows = [f'<h3>Retained views of {_esc(name)}</h3><table class="retained-list"><colgroup>'
            '<col style="width:4%"><col style="width:30%"><col style="width:30%"><col style="width:20%">'
            '<col style="width:16%"></colgroup><tr><th>#</th><th>view</th><th>held by</th>'
            '<th>its bytes reused for</th><th>then</th></tr>']
    for n, lease, ev in listed[:MAX_LISTED]:
        r = lease["retained"]
        took = "-"
        if ev is not None:
            took = f"{_esc(ev.get('by') or ev.get('kind'))}{_esc(_at_generation(_after(ev)))}"
        rows.append(f'<tr data-lease="{_esc(lease["lease_id"])}"><td class="num">#{n}</td>'
                    f'<td><code>{_esc(_name(lease))}'
                    f'</code></td><td><code>{_esc(r.get("holder") or "an unnamed holder")}</code>'
                    f'{f" ({COUNTED})" if r.get("counted") else ""}</td><td>{took}</td>'
                    f"<td>{_esc(_ended(r))}</td></tr>")
    rows.append("</table>")
    if len(listed) > MAX_LISTED:
        rows.append(f'<p class="note">{len(listed) - MAX_LISTED} more retained view(s): see the report.</p>')
    return "\n".join(rows)


def render_html(rep: Dict[str, Any], title: Optional[str] = None, intro: Optional[str] = None) -> str:
    """The page for a report (a dict as :func:`sanitizer.reporting.report.report` returns or ``load`` reads).
    ``intro``: plain text said before the chart, e.g. what the run simulated (each line a paragraph).
    Names that are not UTF-8 (a file or buffer name in surrogate escapes) are shown escaped (``\\xff``):
    escaped before the layout measures them, so the page is valid UTF-8 and its labels still fit."""
    rep = _printable_tree(rep)
    title, intro = _printable_tree(title), _printable_tree(intro)
    bufs = buffers_of(rep)
    tl = rep.get("timeline") or {}
    summary = (rep.get("summary") or {}).get("line", "")
    title = title or "ownership-sanitizer: staging buffer timeline"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{_esc(title)}</title>", f"<style>{_CSS}</style></head><body>",
             f"<h1>{_esc(title)}</h1>"]
    for paragraph in (intro or "").split("\n"):
        if paragraph.strip():
            parts.append(f'<p class="intro">{_esc(paragraph)}</p>')
    parts += [f'<p class="summary">{_esc(summary)}</p>',
              '<p class="legend">'
              f'<span><i style="background:{LEASE}"></i>lease: lent &#8594; retired by a reuse</span>'
              f'<span><i style="background:{DEAD}"></i>died before its bytes were reused</span>'
              f'<span><i style="background:{RETAINED}"></i>retained past the reuse of its bytes (#n: listed under '
              "the chart with its holder; &#10005; = read stale)</span>"
              f'<span><i style="background:{REUSE};height:2px;vertical-align:3px"></i>reuse (&#8595; above the chart: '
              "the tensor that took a retained view's bytes)</span> "
              '<span class="note">hover any shape for details</span></p>']
    if not bufs:
        parts.append('<p class="note">This report has no timeline: no lend was recorded while the sanitizer was '
                     "enabled (or timeline_events=0).</p>")
    for i, buf in enumerate(bufs[:MAX_BUFFERS]):
        info = buf.info
        panel = _Panel(buf, i)
        lay = panel.layout()
        svg, listed = panel.svg(lay)
        extra = f", pid {_esc(info.get('pid'))}" if rep.get("processes") else ""
        parts.append(f'<section class="buffer" data-buffer="{_esc(info.get("name"))}">'
                     f"<h2>{_esc(info.get('name'))} <small>{format_bytes(int(info.get('nbytes') or 0))} on "
                     f"{_esc(info.get('device', '?'))}, generation {_esc(info.get('generation'))}, "
                     f"{len(buf.leases)} lease{'s' * (len(buf.leases) != 1)} drawn, "
                     f"{len(buf.retained)} retained{extra}{panel.names.note()}{panel.zoom_note()}</small></h2>")
        parts.append(f'<div class="chart">{svg}</div>')
        parts.append(panel.names.key([(panel.names(panel.full_name(pl)), panel.shown_name(pl)) for pl in lay.placed]))
        parts.append(_retained_list(info.get("name"), listed))
        parts.append("</section>")
    if len(bufs) > MAX_BUFFERS:
        parts.append(f'<p class="note">{len(bufs) - MAX_BUFFERS} more buffer(s) not drawn (fewer retentions and '
                     "lends).</p>")
    if tl.get("dropped"):
        parts.append(f'<p class="note">{_esc(tl["dropped"])} older lend(s) are not in the report (timeline_events='
                     f'{_esc(tl.get("cap"))}): only the most recent and every retained one are drawn.</p>')
    consumers = (rep.get("summary") or {}).get("retaining_consumers", [])
    if consumers:
        parts.append("<h2>Retaining consumers</h2><table><colgroup><col style=\"width:24%\"><col style=\"width:5%\">"
                     "<col style=\"width:7%\"><col style=\"width:20%\"><col style=\"width:17%\">"
                     "<col style=\"width:27%\"></colgroup><tr><th>holder</th><th>count</th><th>bytes</th>"
                     "<th>read stale at</th><th>holder lives at</th><th>fix</th></tr>")
        for g in consumers:
            also = (f' <span class="note">(holds {_esc(g.get("also_held"))} view(s) counted above, beside their holder)'
                    "</span>" if not g.get("count") and g.get("also_held") else "")
            parts.append(f"<tr><td><code>{_esc(g.get('consumer'))}</code>{also}</td>"
                         f"<td class=\"num\">{_esc(g.get('count'))}</td>"
                         f"<td class=\"num\">{format_bytes(int(g.get('bytes') or 0))}</td>"
                         f"<td>{_esc(', '.join(g.get('read_stale_at') or []) or '-')}</td>"
                         f"<td>{_esc(g.get('site') or '?')}</td><td>{_esc(g.get('fix') or '')}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(rep: Dict[str, Any], path: str, title: Optional[str] = None, intro: Optional[str] = None) -> str:
    """Write the page to ``path``; returns the path."""
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    return output_file.write_text(path, render_html(rep, title, intro))  # never half a page, never /dev/null replaced


__all__ = ["render_html", "write_html", "buffers_of", "RETAINED", "LEASE"]
