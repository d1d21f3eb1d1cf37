"""Text labels for the timeline page: shortened where names differ, placed where they collide with nothing.

The page (:mod:`sanitizer.reporting.timeline`) has no script, so every label
is placed once, when the page is written, and must hold in any browser and
any font. Two things make that possible:

* every label is drawn in a monospace font with its ``textLength`` set from
  :data:`CHAR_WIDTH`, so its width is what :func:`text_box` says whatever font
  the browser picks, and its height is bounded by :data:`ASCENT` and
  :data:`DESCENT` (generous for the common monospace fonts: DejaVu Sans Mono,
  Menlo and Liberation Mono measure 0.93/0.31, Consolas 0.74/0.26);
* :func:`place_labels` is a greedy layout: requests in priority order, each
  tried in its text variants (longest first) at each of its anchor positions,
  and placed at the first one whose box lies inside its bounds and overlaps no
  label already placed and no obstacle. A label that fits nowhere is left out
  (the shapes' tooltips still carry every detail), never drawn over another.

Names are shortened for the space they get, keeping the part that tells them
apart: :func:`common_prefix` finds what every name of a panel shares (the page
says it once), :func:`shorten` drops the middle components of what is left,
so ``3.mlp.experts.0.gate_proj.weight`` becomes ``3.mlp.…gate_proj.weight``,
not ``3.mlp.experts.0.g…``. Pure Python, no torch: the layout is tested on its own.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

CHAR_WIDTH = 0.6  # a label's advance per character, in font sizes (the monospace fonts' own: 0.60-0.61)
ASCENT = 0.95  # room kept above a label's baseline, in font sizes
DESCENT = 0.32  # and below it
ELLIPSIS = "\u2026"

_BOUNDARY = re.compile(r"[./:]|(?=\[)")  # where a dotted name, a path or a holder path may be cut


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle, ``x0 <= x1`` and ``y0 <= y1`` (y grows downwards, as in SVG)."""

    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, other: "Box") -> bool:
        """Whether the interiors intersect (boxes that only touch do not overlap)."""
        return self.x0 < other.x1 and other.x0 < self.x1 and self.y0 < other.y1 and other.y0 < self.y1

    def inside(self, other: "Box") -> bool:
        return other.x0 <= self.x0 and self.x1 <= other.x1 and other.y0 <= self.y0 and self.y1 <= other.y1

    @property
    def width(self) -> float:
        return self.x1 - self.x0

    @property
    def height(self) -> float:
        return self.y1 - self.y0


def text_width(text: str, size: float) -> float:
    """The width a label is drawn at (its ``textLength``)."""
    return len(text) * CHAR_WIDTH * size


def text_box(text: str, x: float, y: float, size: float, anchor: str = "start") -> Box:
    """The box a label occupies when drawn at ``(x, y)`` (``y`` its baseline) with ``text-anchor`` ``anchor``."""
    w = text_width(text, size)
    if anchor == "start":
        x0 = x
    elif anchor == "end":
        x0 = x - w
    elif anchor == "middle":
        x0 = x - w / 2
    else:
        raise ValueError(f"text anchor must be 'start', 'middle' or 'end', got {anchor!r}")
    return Box(x0, y - ASCENT * size, x0 + w, y + DESCENT * size)


def baseline_centred(y_middle: float, size: float) -> float:
    """The baseline that centres a label's box on ``y_middle``."""
    return y_middle + (ASCENT - DESCENT) / 2 * size


def label_height(size: float) -> float:
    return (ASCENT + DESCENT) * size


# -- names -----------------------------------------------------------------------
def common_prefix(names: Iterable[Optional[str]]) -> str:
    """The longest prefix every name shares that ends at a component boundary (after a ``.``, ``/`` or
    ``:``, or before a ``[``) and leaves every name something of its own. '' for fewer than two distinct
    names: a lone name is shown whole."""
    distinct = sorted({n for n in names if n})
    if len(distinct) < 2:
        return ""
    first, last = distinct[0], distinct[-1]  # the common prefix of a sorted list is that of its ends
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    shortest = min(len(name) for name in distinct)
    best = 0
    for m in _BOUNDARY.finditer(first[:n]):
        if m.end() < shortest:  # every name keeps at least a character of its own
            best = m.end()
    return first[:best]


def common_suffix(names: Iterable[Optional[str]], prefix: str = "") -> str:
    """The longest suffix every name shares that starts at a component boundary (a ``.`` or ``[``) and leaves
    every name, once ``prefix`` is also removed, something of its own (``.weight`` for a model's weights).
    '' for fewer than two distinct names."""
    distinct = sorted({n for n in names if n})
    if len(distinct) < 2:
        return ""
    rev = sorted(n[::-1] for n in distinct)
    first, last = rev[0], rev[-1]
    n = 0
    while n < min(len(first), len(last)) and first[n] == last[n]:
        n += 1
    shared = first[:n][::-1]
    room = min(len(name) for name in distinct) - len(prefix)  # what the shortest keeps after the prefix
    for i, ch in enumerate(shared):
        if ch in ".[" and len(shared) - i < room:
            return shared[i:]
    return ""


def short_name(name: Optional[str], prefix: str = "", suffix: str = "") -> str:
    """``name`` without ``prefix`` and ``suffix`` (each removed only where the name has it and keeps something of
    its own): what tells the names of one panel apart."""
    name = name or ""
    if prefix and name.startswith(prefix) and len(name) > len(prefix):
        name = name[len(prefix):]
    if suffix and name.endswith(suffix) and len(name) > len(suffix):
        name = name[: len(name) - len(suffix)]
    return name


def _components(text: str) -> List[str]:
    """``text`` cut after each ``.``/``/``/``:`` and before each ``[``: the pieces join back to ``text``."""
    out, start = [], 0
    for m in _BOUNDARY.finditer(text):
        cut = m.end()
        if cut > start:
            out.append(text[start:cut])
            start = cut
    if start < len(text):
        out.append(text[start:])
    return out


def shorten(text: Any, n: int) -> str:
    """``text`` in at most ``n`` characters, keeping its first component and as many of its last ones as fit,
    the middle replaced by an ellipsis (``3.mlp.…gate_proj.weight``); a text without components that fit is
    cut in the middle of its characters instead. ``n`` below 1 is an error."""
    text = "" if text is None else str(text)
    if n < 1:
        raise ValueError(f"a shortened label needs at least 1 character, got n={n!r}")
    if len(text) <= n:
        return text
    if n == 1:
        return ELLIPSIS
    parts = _components(text)
    if len(parts) >= 3:
        head = parts[0]
        for k in range(len(parts) - 2, 0, -1):  # keep the most tail components that fit
            candidate = head + ELLIPSIS + "".join(parts[-k:])
            if len(candidate) <= n:
                return candidate
    keep = n - 1  # the characters around the ellipsis: more of the end, where names differ most often
    left = keep // 3
    return text[:left] + ELLIPSIS + text[len(text) - (keep - left):]


def _initial(part: str) -> str:
    """A middle component cut to its initial (``mlp.`` -> ``m.``); indices and short ones are kept."""
    body = part.rstrip("./:")
    if len(body) <= 1 or not body[0].isalpha():
        return part
    return body[0] + part[len(body):]


def variants(text: str, shortest: int = 8) -> List[str]:
    """``text`` and its shortenings, longest first, each once: the middle components cut to their initials
    one after the other (``3.m.e.0.gate_proj``), the middle left out (``3.…0.gate_proj``, ``3.…gate_proj``),
    then the shortest of those cut to ``shortest`` characters. What a layout tries, in order, until one
    fits: every form keeps the first and the last component, where names differ most."""
    out = [text]
    parts = _components(text)
    if len(parts) >= 3:
        abbreviated = list(parts)
        for i in range(1, len(parts) - 1):
            abbreviated[i] = _initial(parts[i])
            out.append("".join(abbreviated))
        for k in range(len(parts) - 2, 0, -1):
            out.append(parts[0] + ELLIPSIS + "".join(parts[-k:]))
    tightest = min(out, key=len)
    out.append(tightest if len(tightest) <= shortest else tightest[: shortest - 1] + ELLIPSIS)
    seen, ordered = set(), []
    for v in sorted(out, key=len, reverse=True):
        if v not in seen:
            seen.add(v)
            ordered.append(v)
    return ordered


def abbreviations(full: str, shown: str) -> List[Tuple[str, str]]:
    """The components ``shown`` (one of :func:`variants` of ``full``) cut to their initials, as
    ``(initial, component)`` pairs (``("s", "self_attn")`` for ``0.s.q_proj`` of ``0.self_attn.q_proj``): what
    a page's key of short names says. None for a form that leaves components out instead, or for ``full``."""
    a, b = _components(shown), _components(full)
    if len(a) != len(b):
        return []
    out = []
    for short, whole in zip(a, b):
        if short != whole:
            out.append((short.rstrip("./:"), whole.rstrip("./:")))
    return out


# -- the layout ----------------------------------------------------------------------
@dataclass(frozen=True)
class Anchor:
    """One place a label may go: its ``(x, baseline y)`` and text anchor; ``form``, how the text is written
    there (``"\u2193 {}"``: an arrow before it); ``within``, a box the label must also lie inside here (a
    label inside a shape); ``style``, a tag for the caller (a label inside a box is drawn differently);
    ``free``: here the label must lie clear of every shape (a label beside its box is never drawn over
    another box); ``guide``: the box of a line drawn from the label (a reuse label's guide to its tick),
    which must cross no other label and which no later label may cross."""

    x: float
    y: float
    anchor: str = "start"
    style: str = ""
    form: str = "{}"
    within: Optional[Box] = None
    free: bool = False  # here the label must also cover none of the ``shapes`` (a label beside a box, not in one)
    guide: Optional[Box] = None  # a line drawn with the label here (down to its tick): it must cross no label


@dataclass
class LabelRequest:
    """A label to place: its text ``options`` (longest first), the ``anchors`` to try (in order), its font
    ``size``, the box it must lie ``within``, whether it must also avoid the solid shapes (``solid``), and
    ``key``, passed through to the result. ``place_first``: try every text at the first anchor before the
    next anchor (a short label where it belongs beats a long one further away); by default every anchor
    is tried with the longest text first. ``gap``: the room kept, left and right, from every other label
    (labels on one row that touch read as one)."""

    options: Sequence[str]
    anchors: Sequence[Anchor]
    size: float
    within: Box
    solid: bool = False
    key: Any = None
    place_first: bool = False
    gap: float = 0.0

    def tries(self) -> Iterator[Tuple[str, Anchor]]:
        """The (text option, anchor) pairs in the order they are tried."""
        if self.place_first:
            return ((o, a) for a in self.anchors for o in self.options)
        return ((o, a) for o in self.options for a in self.anchors)


@dataclass(frozen=True)
class Placed:
    """Where a request went: its text, its anchor, the box it occupies, and the option it shows."""

    request: LabelRequest
    text: str
    at: Anchor
    box: Box
    option: str = ""  # the text option chosen (``text`` is it in the anchor's form)


class _Grid:
    """Boxes bucketed by cell, so that a check looks only at its neighbours (pages have thousands)."""

    def __init__(self, cell: float = 64.0) -> None:
        self.cell = cell
        self.cells: Dict[Tuple[int, int], List[Box]] = {}

    def _cells(self, b: Box) -> Iterator[Tuple[int, int]]:
        c = self.cell
        for i in range(math.floor(b.x0 / c), math.floor(b.x1 / c) + 1):
            for j in range(math.floor(b.y0 / c), math.floor(b.y1 / c) + 1):
                yield i, j

    def add(self, b: Box) -> None:
        for key in self._cells(b):
            self.cells.setdefault(key, []).append(b)

    def hits(self, b: Box) -> bool:
        return any(o.overlaps(b) for key in self._cells(b) for o in self.cells.get(key, ()))


def place_labels(requests: Iterable[LabelRequest], obstacles: Iterable[Box] = (),
                 solids: Iterable[Box] = (), shapes: Iterable[Box] = ()) -> List[Optional[Placed]]:
    """Place ``requests`` in order (the first has the first pick): each at its first (text option, anchor)
    whose box lies inside its ``within`` (and the anchor's), overlaps no label placed before it (nor comes
    within the request's ``gap`` of one, left or right), no guide of one and no ``obstacles`` box (and, for
    a ``solid`` request, no ``solids`` box; at a ``free`` anchor, no ``shapes`` or ``solids`` box), and
    whose anchor's guide crosses no placed label. One result per request, None where it fitted nowhere. By
    construction no two placed labels overlap, no label crosses a guide, and none leaves its bounds."""
    placed = _Grid()
    guides = _Grid()
    blocked = _Grid()
    for b in obstacles:
        blocked.add(b)
    solid = _Grid()
    for b in solids:
        solid.add(b)
    shape = _Grid()
    for b in shapes:
        shape.add(b)
    out: List[Optional[Placed]] = []
    for req in requests:
        got: Optional[Placed] = None
        for option, at in req.tries():
            if not option or text_width(option, req.size) > req.within.width:
                continue
            text = at.form.format(option)
            box = text_box(text, at.x, at.y, req.size, at.anchor)
            if not box.inside(req.within) or (at.within is not None and not box.inside(at.within)):
                continue
            spaced = Box(box.x0 - req.gap, box.y0, box.x1 + req.gap, box.y1) if req.gap else box
            if placed.hits(spaced) or guides.hits(box) or blocked.hits(box):
                continue
            if (req.solid or at.free) and solid.hits(box) or at.free and shape.hits(box):
                continue
            if at.guide is not None and placed.hits(at.guide):
                continue
            got = Placed(req, text, at, box, option)
            break
        if got is not None:
            placed.add(got.box)
            if got.at.guide is not None:
                guides.add(got.at.guide)
        out.append(got)
    return out


def nice_step(minimum: float) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that is at least ``minimum`` (axis tick spacing)."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= minimum:
                return m * step
        step *= 10


__all__ = ["abbreviations",
           "Box", "Anchor", "LabelRequest", "Placed", "place_labels", "text_box", "text_width", "common_prefix",
           "common_suffix", "short_name", "shorten", "variants", "baseline_centred", "label_height", "nice_step",
           "CHAR_WIDTH", "ASCENT", "DESCENT"]
