"""The timeline: the report's lend/retire section, the HTML page drawn from it (checked in headless
Chromium when installed), the Chrome trace export, and ``ownsan triage --html/--trace``."""
from __future__ import annotations

import html
import json
import os
import random
import re
import shutil
import struct
import subprocess
import zlib
from html.parser import HTMLParser

import pytest
import torch

import sanitizer
from sanitizer.features import triage
from sanitizer.reporting import report as R
from sanitizer.reporting import label_layout, timeline, trace
from sanitizer.tools import cli

_KEPT: dict = {}


@pytest.fixture(autouse=True)
def _fresh(fresh_triage):
    _KEPT.clear()
    yield
    _KEPT.clear()


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory) -> dict:
    """The report of the demo's unsafe load (small), the run its timeline page is drawn from."""
    from sanitizer.testing import demo
    from sanitizer.testing.reference.checkpoint import write_checkpoint
    from sanitizer.testing.reference.fused_loaders import TinyConfig

    cfg = TinyConfig(hidden=64, intermediate=128, moe_intermediate=64, dense_layers=2, experts=2)
    where = tmp_path_factory.mktemp("demo")
    info = write_checkpoint(str(where / "tiny.safetensors"), cfg)
    return demo.write_timeline(str(where / "tiny.safetensors"), 2 * info["largest"], str(where / "demo.html"))


def _scenario(**options) -> dict:
    """Two rings: 'weights' (a consumer keeps every 5th view, reads one stale, drops one) and 'side' (clean)."""
    ring = sanitizer.StagingRing(8 * 1024, name="weights")
    side = sanitizer.StagingRing(4 * 1024, name="side")
    with sanitizer.sanitize(triage=1, **options):
        acc = torch.zeros(256)
        for i in range(24):
            w = ring.put(f"layers.{i}.weight", torch.full((256,), float(i)))
            if i % 5 == 0:
                _KEPT[f"layers.{i}.weight"] = w
            acc += w
            s = side.put(f"side.{i}", torch.ones(128))
        del w, s
        float(_KEPT["layers.5.weight"].sum())  # a stale read (recorded: triage=1)
        _KEPT.pop("layers.10.weight")  # a retained view dropped
        for i in range(24, 30):
            ring.put(f"layers.{i}.weight", torch.full((256,), float(i)))
        return sanitizer.report(final=True)


def test_the_report_keeps_each_buffers_lends_reuses_and_retained_leases():
    rep = _scenario()
    assert R.validate(rep) == [], R.validate(rep)[:3]
    tl = rep["timeline"]
    assert sorted(b["name"] for b in tl["buffers"]) == ["side", "weights"]
    weights = next(b for b in tl["buffers"] if b["name"] == "weights")
    leases = {l["name"]: l for l in tl["leases"] if l["buffer"] == weights["id"]}
    assert len(leases) == 30 and tl["dropped"] == 0
    retained = {name: l["retained"] for name, l in leases.items() if l["retained"]}
    assert sorted(retained) == [f"layers.{i}.weight" for i in (0, 10, 15, 20, 5)]
    read = retained["layers.5.weight"]
    assert read["until"] == "stale_read" and read["read_at"]["file"] == __file__
    assert read["holder"] == f"{__name__}._KEPT['layers.5.weight']"
    assert retained["layers.10.weight"]["until"] == "death"
    assert retained["layers.0.weight"]["until"] == "alive"
    # the stale read happened after the 24th put and before the 25th: generation 25 of 'weights'
    assert read["generation"] == 25
    # dropped right after that read, before the 25th put: its death mark is exact (the release hook)
    dropped = retained["layers.10.weight"]
    assert dropped["generation"] == dropped["died_generation"] == 25 and dropped["t"] >= read["t"]
    # every reuse of the buffers has its time, whether or not it retired a live lease
    assert tl["events"] and all(e["t"] is not None for e in tl["events"])
    # each retained lease was retired by a reuse the section lists, labelled with the tensor that took its bytes
    events = {e["event_id"]: e for e in tl["events"]}
    by = events[leases["layers.5.weight"]["retired_by"]]["by"]
    assert by == "layers.13.weight"  # an 8 KiB ring of 1 KiB tensors: the 8th put after it reuses its bytes


def test_the_timeline_is_capped_to_the_most_recent_lends_plus_every_retention():
    rep = _scenario(timeline_events=6)
    tl = rep["timeline"]
    assert tl["cap"] == 6 and tl["dropped"] == 30 + 24 - 6
    names = [l["name"] for l in tl["leases"]]
    assert [n for n in names if n.startswith("layers.2") and not n.endswith(".20.weight")] == [
        f"layers.{i}.weight" for i in range(24, 30)]
    assert {l["name"] for l in tl["leases"] if l["retained"]} >= {"layers.0.weight", "layers.5.weight"}
    assert R.validate(rep) == []
    # the reuses are capped alike: the 6 most recent, plus those that retired a retained lease (with their time)
    retiring = {l["retired_by"] for l in tl["leases"] if l["retained"]}
    recent = [e for e in tl["events"] if e["event_id"] not in retiring]
    assert 0 < len(recent) <= 6 and all(e["t"] is not None for e in tl["events"])
    rep = _scenario(timeline_events=0)
    assert rep["timeline"]["leases"] and all(l["retained"] for l in rep["timeline"]["leases"])
    assert {e["event_id"] for e in rep["timeline"]["events"]} == {l["retired_by"] for l in rep["timeline"]["leases"]}


def test_a_death_mark_lands_at_the_generation_and_time_of_the_death():
    """The release hook notes a retained lease's death as it happens, not at a later lend or report: with
    40 retentions watched, a look at 16 of them per lend noted it lends late, and pure reuses never."""
    buf = sanitizer.StagingBuffer(40 * 1024, name="slots")
    with sanitizer.sanitize(triage=1):
        for i in range(40):
            _KEPT[f"w{i}"] = buf.write(i * 1024, torch.full((256,), float(i)), name=f"w{i}")
        buf.reuse(0, 40 * 1024, by="everything")  # retires all 40 while the dict holds them
        buf.write(0, torch.zeros(256), name="x")  # a lend: the consumer has had its turn
        triage.settle()
        assert len(sanitizer.retentions()) == 40
        at = buf.generation
        del _KEPT["w17"]  # dies now, at generation `at`
        for k in range(3):  # reuses that retire nothing alive, and no lend
            buf.reuse(2048 + 1024 * k, 1024, by=f"r{k}")
        rep = sanitizer.report(final=True)
    tl = rep["timeline"]
    (w17,) = [l for l in tl["leases"] if l["name"] == "w17"]
    r = w17["retained"]
    assert r["until"] == "death" and r["generation"] == r["died_generation"] == at, (r, at)
    assert all(l["retained"]["until"] == "alive" for l in tl["leases"] if l["retained"] and l["name"] != "w17")
    by_gen = {e["generation_before"]: e for e in tl["events"]}
    assert by_gen[at - 1]["t"] <= r["t"] <= by_gen[at]["t"]  # between the reuse before it and the one after


def test_a_reuse_that_retired_nothing_is_in_the_timeline_with_its_time():
    buf = sanitizer.StagingBuffer(4096, name="quiet")
    with sanitizer.sanitize(triage=1):
        w = buf.write(0, torch.ones(256), name="a")
        del w  # dies before its bytes are reused: the reuse below retires nothing
        quiet = buf.reuse(0, 1024, by="nothing-live")
        keep = buf.write(1024, torch.ones(256), name="b")
        del keep
        buf.close()  # a close that retires nothing either
        rep = sanitizer.report(final=True)
    tl = rep["timeline"]
    events = {e["event_id"]: e for e in tl["events"]}
    leases = {l["name"]: l for l in tl["leases"]}
    e = events[quiet.event_id]
    assert e["by"] == "nothing-live" and e["kind"] == "reuse" and e["t"] is not None
    (closed,) = [ev for ev in tl["events"] if ev["kind"] == "close"]
    assert leases["a"]["t"] < e["t"] < leases["b"]["t"] < closed["t"]
    assert all(ev["t"] is not None for ev in tl["events"])
    doc = trace.chrome_trace(rep)  # the trace places it at its own time, not after its predecessor
    (tick,) = [x for x in doc["traceEvents"] if x.get("cat") == "reuse" and x["name"] == "reuse for nothing-live"]
    assert tick["ts"] == round(e["t"] * 1e6, 3)


def _page(tmp_path) -> tuple:
    rep = _scenario()
    path = tmp_path / "timeline.html"
    timeline.write_html(rep, str(path))
    return rep, path.read_text(encoding="utf-8"), path


def test_the_page_is_one_self_contained_file_with_a_panel_per_buffer(tmp_path):
    rep, page, _ = _page(tmp_path)
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 2
    assert "http" not in page and "<script" not in page and "<link" not in page and "src=" not in page
    assert 'data-buffer="weights"' in page and 'data-buffer="side"' in page
    assert page.index('data-buffer="weights"') < page.index('data-buffer="side"')  # retentions first
    assert page.count('<g class="retained"') == 5 and page.count('<g class="stale-read"') == 1
    # the stale-read cross is drawn after every box of its panel: no later box hides it
    weights = page[page.index('data-buffer="weights"'):page.index('data-buffer="side"')]
    assert weights.index('<g class="stale-read"') > max(weights.rindex('<g class="retained"'),
                                                         weights.rindex('<g class="lease"'))
    assert "\u2193 13.weight" in page  # the reuse that retired layers.5.weight, named without the common prefix
    assert "tensor names shown as <code>layers.&#8230;</code>" in page
    assert "<title>#2 RETAINED layers.5.weight\nheld by" in page  # details on hover
    # the side list: every retained lease, numbered as in the chart, with its whole holder and its end
    rows = re.findall(r'<tr data-lease="\d+"><td class="num">#(\d+)</td><td><code>([^<]*)</code></td>'
                      r'<td><code>([^<]*)</code>', page)
    assert [(n, name) for n, name, _ in rows] == [(str(i + 1), f"layers.{k}.weight") for i, k in
                                                  enumerate((0, 5, 10, 15, 20))]
    assert all(holder == html.escape(f"{__name__}._KEPT['{name}']", quote=True) for _, name, holder in rows)
    assert "read stale at generation 25, at test_timeline.py:" in page and "dropped at generation 25" in page
    assert "held by __main__" not in page
    assert "Retaining consumers" in page and "own the tensor where" in page


def _titles(page: str) -> list:
    return [html.unescape(t) for t in re.findall(r"<title>(.*?)</title>", page, re.S)]


def test_no_tooltip_or_label_says_none_even_when_the_report_lacks_a_generation(tmp_path):
    rep, page, _ = _page(tmp_path)
    assert not [t for t in _titles(page) if "None" in t]
    for lease in rep["timeline"]["leases"]:  # a report that lost the generations of what ended retentions
        if lease["retained"]:
            lease["retained"].update(generation=None, read_at=None)
    for ev in rep["timeline"]["events"]:
        ev["generation_after"] = None if ev["kind"] == "close" else ev["generation_after"]
    page = timeline.render_html(rep)
    titles = _titles(page)
    assert not [t for t in titles if "None" in t] and "None" not in re.sub(r"<title>.*?</title>", "", page, flags=re.S)
    assert any(t.endswith("read stale") for t in titles) and any(t.endswith("; dropped") for t in titles)
    for lease in rep["timeline"]["leases"]:  # and lends without a name: named by their id, never 'None'
        lease["name"] = None
    names = [e["name"] for e in trace.chrome_trace(rep)["traceEvents"]]
    read = next(l for l in rep["timeline"]["leases"] if (l["retained"] or {}).get("until") == "stale_read")
    assert not [n for n in names if "None" in n] and f"stale read of lease {read['lease_id']}" in names
    page = timeline.render_html(rep)
    assert not [t for t in _titles(page) if "None" in t] and "None" not in re.sub(r"<title>.*?</title>", "", page,
                                                                                  flags=re.S)


def _dense_report(n: int = 240, every: int = 3, slots: int = 16, slot: int = 4096) -> dict:
    """A synthetic timeline section: ``n`` lends round-robin over ``slots`` slots of one buffer, every
    ``every``-th retained (read stale, dropped or still held): far more labels than fit."""
    rnd = random.Random(0)
    leases, events = [], []
    for i in range(n):
        lo = (i % slots) * slot
        name = f"model.layers.{i // 7}.mlp.experts.{i % 7}.gate_proj.weight"
        events.append({"event_id": 2 * i, "buffer": 1, "pid": 1, "kind": "reuse", "byte_range": [lo, lo + slot],
                       "generation_before": i, "generation_after": i + 1, "by": name, "t": i * 1e-3})
        retired = 2 * (i + slots) if i + slots < n else None
        retained = None
        if i % every == 0 and retired is not None:
            until = rnd.choice(["stale_read", "death", "alive"])
            retained = {"holder": f"Model.cache[{i}]", "consumer": "Model.cache[*]", "kind": "object",
                        "until": until, "generation": None if until == "alive" else i + slots + rnd.randint(0, 20),
                        "t": None, "read_at": {"file": "/x/model.py", "line": 3, "function": "forward"}
                        if until == "stale_read" else None, "died_generation": None, "counted": False}
        leases.append({"lease_id": 2 * i + 1, "buffer": 1, "name": name, "dtype": "bfloat16", "shape": [32, 64],
                       "byte_range": [lo, lo + slot], "generation": i + 1, "pid": 1, "t": i * 1e-3,
                       "retired_by": retired, "alive": False, "rescued": False, "retained": retained})
    return {"pid": 1, "summary": {"line": "synthetic"},
            "timeline": {"cap": n, "dropped": 0, "leases": leases, "events": events,
                         "buffers": [{"id": 1, "pid": 1, "name": "dense", "device": "cpu", "nbytes": slots * slot,
                                      "generation": n, "closed": False}]}}


def _label_boxes(page: str) -> dict:
    """Each panel's viewBox and the box of every text in it, from the attributes the page writes (every text
    has its textLength, so its box is known without a browser)."""
    out = {}
    for sid, vb, body in re.findall(r'<svg id="([^"]+)"[^>]*viewBox="([^"]+)"[^>]*>(.*?)</svg>', page, re.S):
        x0, y0, w, h = map(float, vb.split())
        boxes = []
        for attrs, text in re.findall(r"<text([^>]*)>([^<]*)</text>", body):
            a = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
            assert "textLength" in a, attrs  # a text whose width the layout cannot know
            x, y, size = float(a["x"]), float(a["y"]), float(a["font-size"])
            b = label_layout.text_box(html.unescape(text), x, y, size, a.get("text-anchor", "start"))
            assert abs(b.width - float(a["textLength"])) < 0.2, (text, a)
            if "transform" in a:  # rotate(-90 x y): the box turned about the anchor point
                b = label_layout.Box(x - (y - b.y0), y - (b.x1 - x), x + (b.y1 - y), y + (x - b.x0))
            boxes.append((html.unescape(text), b))
        out[sid] = (label_layout.Box(x0, y0, x0 + w, y0 + h), boxes)
    return out


def _collisions(panels: dict) -> list:
    bad = []
    for sid, (frame, boxes) in panels.items():
        for i, (text, b) in enumerate(boxes):
            if not b.inside(frame):
                bad.append((sid, "clipped", text))
            bad += [(sid, "overlap", text, other) for other, c in boxes[:i] if b.overlaps(c)]
    return bad


@pytest.mark.slow
def test_by_construction_no_two_labels_overlap_and_none_leaves_its_panel(tmp_path, demo_report):
    _, page, _ = _page(tmp_path)
    for rep in (_scenario(), _dense_report(), _dense_report(3000, 5), demo_report):
        page = timeline.render_html(rep)
        panels = _label_boxes(page)
        assert panels and _collisions(panels) == []
        assert sum(len(boxes) for _, boxes in panels.values()) > 20
    dense = _label_boxes(timeline.render_html(_dense_report()))
    labels = [t for _, boxes in dense.values() for t, _ in boxes if t.startswith("#")]
    assert len(labels) > 30  # most retained leases still get their number in a crowded chart


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_names_are_cut_where_they_agree_not_where_they_differ(demo_report):
    page = timeline.render_html(demo_report)
    texts = [t for _, boxes in _label_boxes(page).values() for t, _ in boxes]
    assert "tensor names shown as <code>model.layers.&#8230;.weight</code>" in page
    assert not [t for t in texts if "self_attn.q_\u2026" in t or "LayerReloa\u2026" in t]
    markers = [t for t in texts if t.startswith("#")]
    assert markers and all(not t.endswith("\u2026") or t.count("\u2026") == 1 for t in markers)
    # a label that shortens a name keeps its layer (first component) and what it is (last component)
    names = [t.split(" ", 1)[1] for t in markers if " " in t]
    assert names and all(n.split(".")[0].isdigit() and ("proj" in n or n.endswith("\u2026")) for n in names)
    # holders are not cut at all: each is whole in the list under the chart
    listed = re.findall(r'<tr data-lease="\d+">.*?</tr>', page)
    assert len(listed) == demo_report["summary"]["retentions"]
    assert all("<code>LayerReloadingInfo." in row and "\u2026" not in row for row in listed)


def test_overlapping_retained_boxes_share_their_bytes_in_strips():
    same = [label_layout.Box(10 * i, 0, 10 * i + 25, 30) for i in range(4)]  # each covers the next
    strips = timeline._strips(same)
    assert all(not a.overlaps(b) for i, a in enumerate(strips) for b in strips[:i])
    assert all(s.y0 >= 0 and s.y1 <= 30 and s.height > 0 for s in strips)
    apart = [label_layout.Box(0, 0, 5, 5), label_layout.Box(10, 0, 15, 5)]
    assert timeline._strips(apart) == apart


def test_an_empty_report_still_renders():
    page = timeline.render_html({"summary": {"line": "ownership-sanitizer: 0 errors; no retentions"}})
    assert "no timeline" in page and "<svg" not in page


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _png_pixels(data: bytes):
    """Decode an 8-bit RGB/RGBA, non-interlaced PNG (what Chromium writes) into rows of bytes, with zlib only."""
    import numpy as np

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, (depth, ctype, interlace)
        elif kind == b"IDAT":
            idat += body
    bpp = 3 if ctype == 2 else 4
    stride = w * bpp
    raw = zlib.decompress(idat)
    out = np.zeros((h, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(h):
        kind, line = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).copy()
        if kind == 1:  # Sub
            line = np.cumsum(line.reshape(w, bpp), axis=0, dtype=np.uint8).reshape(stride)
        elif kind == 2:  # Up
            line = line + prev
        elif kind in (3, 4):  # Average, Paeth: a pixel depends on the one before it
            cur, up = bytearray(line.tobytes()), prev.tobytes()
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = up[i]
                if kind == 3:
                    cur[i] = (cur[i] + ((a + b) >> 1)) & 255
                else:
                    c = up[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                    cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
            line = np.frombuffer(bytes(cur), np.uint8)
        out[y] = line
        prev = line
    return out.reshape(h, w, bpp)[:, :, :3]


@pytest.mark.slow
def test_headless_chromium_shows_the_buffers_and_the_red_retained_leases(tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless Chromium (apt-get install chromium; .ci/run installs it when it can)")
    _, page, path = _page(tmp_path)
    png = tmp_path / "timeline.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={png}", "--window-size=1400,900", path.as_uri()],
                          capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                          env={**os.environ, "HOME": str(tmp_path)})
    assert png.exists(), proc.stderr[-2000:]
    px = _png_pixels(png.read_bytes()).astype(int)
    r, g, b = px[:, :, 0], px[:, :, 1], px[:, :, 2]
    red = (r > 180) & (g < 90) & (b < 90)  # the retained boxes (#d62728)
    blue = (b > 120) & (r < 140) & (b - r > 40)  # the leases (#4e79a7, #a9c1dc)
    rows = red.any(axis=1).nonzero()[0]
    assert red[150:].sum() > 3000, red.sum()  # below the legend: the red boxes of the first panel
    assert blue[150:].sum() > 20000, blue.sum()
    # the red is drawn where the 'weights' panel is (the first one): rows below its heading, above 'side'
    assert rows.min() < 200 < rows.max() < 900


_MEASURE = """
(function () {
  const out = {width: window.innerWidth, height: window.innerHeight, svgs: []};
  for (const svg of document.querySelectorAll('svg')) {
    const s = svg.getBoundingClientRect(), plot = svg.querySelector('rect.plot').getBoundingClientRect();
    const texts = [];
    for (const t of svg.querySelectorAll('text')) {
      const r = t.getBoundingClientRect();
      texts.push({box: [r.left, r.top, r.right, r.bottom], text: t.textContent});
    }
    out.svgs.push({id: svg.id, box: [s.left, s.top, s.right, s.bottom],
                   plot: [plot.left, plot.top, plot.right, plot.bottom], texts: texts});
  }
  const pre = document.createElement('pre');
  pre.id = 'measured';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
"""


def _measure_in_chromium(browser: str, tmp_path, page: str, width: int, height: int = 1000) -> dict:
    """Every SVG text's box as Chromium lays the page out (``getBoundingClientRect``: what is on the screen,
    after the viewBox scaling and the rotation), with each panel's and its plot's box. A copy of the page
    gets a script for this (the page itself has none); ``--dump-dom`` prints the DOM once the page has
    loaded and the script has written its findings into it: no DevTools connection, no port, no race."""
    work = tmp_path / f"measure-{width}"
    work.mkdir(exist_ok=True)
    probe = work / "page.html"
    probe.write_text(page.replace("</body>", f"<script>{_MEASURE}</script></body>"), encoding="utf-8")
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={work / 'profile'}", "--hide-scrollbars",
                           f"--window-size={width},{height}", "--dump-dom", probe.as_uri()],
                          capture_output=True, text=True, timeout=120, cwd=str(work),
                          env={**os.environ, "HOME": str(work)})
    found = re.search(r'<pre id="measured">(.*?)</pre>', proc.stdout, re.S)
    assert found, (proc.returncode, proc.stderr[-2000:])
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.slow
@pytest.mark.parametrize("which", ["scenario", "demo", "dense"])
def test_in_chromium_no_two_labels_overlap_none_is_clipped_and_the_chart_uses_the_window(tmp_path, which,
                                                                                      demo_report):
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless Chromium (apt-get install chromium; .ci/run installs it when it can)")
    rep = {"scenario": _scenario, "demo": lambda: demo_report, "dense": _dense_report}[which]()
    page = timeline.render_html(rep)
    for width in (1000, 1400):
        got = _measure_in_chromium(browser, tmp_path, page, width)
        assert got["width"] == width and got["svgs"]
        for svg in got["svgs"]:
            sx0, sy0, sx1, sy1 = svg["box"]
            texts = svg["texts"]
            assert len(texts) > 10
            eps = 0.5  # px: rounding of the rendered boxes
            clipped = [t["text"] for t in texts if t["box"][0] < sx0 - eps or t["box"][1] < sy0 - eps
                       or t["box"][2] > sx1 + eps or t["box"][3] > sy1 + eps]
            assert clipped == [], (width, svg["id"], clipped)
            overlaps = [(a["text"], b["text"]) for i, a in enumerate(texts) for b in texts[:i]
                        if a["box"][0] < b["box"][2] - eps and b["box"][0] < a["box"][2] - eps
                        and a["box"][1] < b["box"][3] - eps and b["box"][1] < a["box"][3] - eps]
            assert overlaps == [], (width, svg["id"], overlaps[:5])
            # the chart takes the window's width (less the page's margins) and a good part of its height
            assert sx1 - sx0 >= 0.9 * (width - 48), (width, svg["box"])
            assert svg["plot"][3] - svg["plot"][1] >= 0.3 * got["height"], (width, svg["plot"])


def test_the_trace_opens_as_chrome_trace_events(tmp_path):
    rep = _scenario()
    doc = trace.chrome_trace(rep)
    events = doc["traceEvents"]
    assert doc["displayTimeUnit"] == "ms" and {e["ph"] for e in events} == {"M", "X", "i"}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any("weights" in n for n in names) and any("side" in n for n in names)
    retained = [e for e in events if e.get("cat") == "retention"]
    assert len(retained) == 5 and all(e["name"].startswith(f"retained by {__name__}._KEPT[") for e in retained)
    assert len([e for e in events if e.get("cat") == "stale_read"]) == 1
    lanes: dict = {}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():  # slices of one lane never overlap (Perfetto would nest them)
        spans.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))
    path = trace.write_trace(rep, str(tmp_path / "t.json"))
    assert json.loads(open(path, encoding="utf-8").read())["traceEvents"] == json.loads(json.dumps(events))


def test_ownsan_triage_writes_the_page_and_the_trace(tmp_path, capsys):
    rep = _scenario()
    src = tmp_path / "rep.json"
    src.write_text(json.dumps(rep, default=str))
    html, tr = tmp_path / "out" / "t.html", tmp_path / "out" / "t.json"
    assert cli.main(["triage", str(src), "--html", str(html), "--trace", str(tr), "--exit-zero"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {html}" in out and f"wrote {tr}" in out
    assert "<svg" in html.read_text() and json.loads(tr.read_text())["traceEvents"]
    assert cli.main(["triage", str(src), "--html", str(tmp_path / "no" / "such" / "\0bad.html")]) == 2


def test_the_demo_writes_the_page_of_its_unsafe_load(demo_report):
    rep = demo_report
    consumer = "LayerReloadingInfo.loaded_weights[*][*].arguments['loaded_weight']"
    assert rep["summary"]["retaining_consumers"][0]["consumer"] == consumer  # as in the real vLLM fork
    text = timeline.render_html(rep)
    assert 'data-buffer="demo-ring"' in text and text.count('<g class="retained"') == rep["summary"]["retentions"] > 0
    listed = re.findall(r'<tr data-lease="\d+">.*?</tr>', text)  # the side list: one row per retained view
    assert len(listed) == rep["summary"]["retentions"]
    assert all("<td><code>LayerReloadingInfo." in row for row in listed)  # whole holders, never cut
    assert any("<td><code>LayerReloadingInfo.loaded_weights[" in row for row in listed)
    assert "http" not in text


# -- the page as a new user read it (issue 32): the demo's and the quickstart's real reports ------------------
@pytest.fixture(scope="module")
def quickstart_report(tmp_path_factory) -> dict:
    """The report ``ownsan run`` writes for ``examples/quickstart.py`` (a 1 MiB buffer of which 64 KiB are lent)."""
    import sys

    where = tmp_path_factory.mktemp("quickstart")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = where / "q.json"
    proc = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(out), "-q", "--",
                           sys.executable, os.path.join(root, "examples", "quickstart.py")],
                          capture_output=True, text=True, timeout=300, cwd=str(where))
    assert out.exists(), (proc.returncode, proc.stderr[-2000:])
    return json.loads(out.read_text(encoding="utf-8"))


def _panels(rep: dict) -> list:
    return [timeline._Panel(buf, i) for i, buf in enumerate(timeline.buffers_of(rep))]


def _own_box(lay, pl):
    """The box a label is drawn in (its own red box or lease box), or None for a label beside its box."""
    kind, item = pl.request.key
    if pl.at.within is None:
        return None
    if kind == "marker":
        return next(b for lease, _, b in lay.reds if lease is item)
    return next(b for lease, _, _, b in lay.boxes if lease is item)


def _layout_faults(panel) -> list:
    """What a panel's layout draws over something else: a label over a label, a guide, a cross or a box not
    its own; a cross over a cross."""
    lay = panel.layout()
    shapes = [b for _, _, _, b in lay.boxes] + [b for _, _, b in lay.reds]
    marks = [b for _, b in lay.marks]
    bad = [("cross over cross", i, j) for i, a in enumerate(marks) for j, b in enumerate(marks[:i]) if a.overlaps(b)]
    for i, pl in enumerate(lay.placed):
        bad += [("label over label", pl.text, o.text) for o in lay.placed[:i] if pl.box.overlaps(o.box)]
        bad += [("label over guide", pl.text, o.text) for o in lay.placed
                if o.at.guide is not None and o is not pl and pl.box.overlaps(o.at.guide)]
        bad += [("label over cross", pl.text) for m in marks if pl.box.overlaps(m)]
        own = _own_box(lay, pl)
        # a label in its red box is over the later leases of the same bytes only where its red box covers them
        others = [b for _, _, b in lay.reds] if pl.request.key[0] == "marker" and own is not None else shapes
        bad += [("label over another box", pl.text, b) for b in others if b is not own and pl.box.overlaps(b)]
        if own is not None and not pl.box.inside(own):
            bad.append(("label leaves its box", pl.text))
        if not pl.box.inside(pl.request.within):
            bad.append(("label leaves the panel", pl.text))
    reuse = [pl for pl in lay.placed if pl.request.key[0] == "reuse"]
    gaps = [(a.text, b.text) for i, a in enumerate(reuse) for b in reuse[:i]
            if a.box.y0 == b.box.y0 and a.box.x0 - timeline.LABEL_GAP < b.box.x1 and b.box.x0 - timeline.LABEL_GAP
            < a.box.x1]
    return bad + [("reuse labels touch", g) for g in gaps]


@pytest.mark.slow
def test_no_label_or_cross_is_drawn_over_another_or_over_a_box_not_its_own(demo_report, quickstart_report):
    for rep in (demo_report, quickstart_report):
        panels = _panels(rep)
        assert panels
        for panel in panels:
            assert _layout_faults(panel) == []
    (demo,) = _panels(demo_report)
    lay = demo.layout()
    numbered = {pl.request.key[1]["lease_id"] for pl in lay.placed if pl.request.key[0] == "marker"}
    assert numbered == set(lay.numbers)  # and every retained lease still gets its number in the chart
    assert len(lay.marks) == len([l for l, _, _ in lay.reds if l["retained"]["until"] == "stale_read"]) > 0
    # the reads at the last generation: their labels beside their box, in the room kept right of the boxes
    assert demo.gutter > 0 and any(pl.at.x > demo.x(demo.g1) for pl in lay.placed)


@pytest.mark.slow
def test_the_byte_axis_is_zoomed_to_the_bytes_lent_and_says_so(quickstart_report, demo_report):
    (panel,) = _panels(quickstart_report)
    assert panel.nbytes == 1 << 20 and (panel.b0, panel.b1) == (0, 0x10000) and panel.zoomed
    assert panel.offsets == [0, 0x4000, 0x8000, 0xC000, 0x10000]
    assert panel.y(0x10000) == panel.plot.y1 and panel.y(1 << 20) == panel.plot.y1  # a close stays in the plot
    page = timeline.render_html(quickstart_report)
    assert "byte offset: 0x0-0x10000 of 1.0 MiB (the rest never lent)" in page
    assert "byte axis zoomed to the bytes lent, 0x0-0x10000 (64.0 KiB of 1.0 MiB: the rest was never lent)" in page
    (demo,) = _panels(demo_report)  # the demo's ring is used whole: drawn whole, nothing said
    assert (demo.b0, demo.b1) == (0, demo.nbytes) and not demo.zoomed and "zoomed" not in timeline.render_html(
        demo_report)
    assert timeline.byte_range([(0, 64)], 1 << 20) == (0, 64, [0, 16, 32, 48, 64])
    assert timeline.byte_range([(0x30000, 0x38000)], 1 << 20)[:2] == (0x30000, 0x38000)
    assert timeline.byte_range([(0, 600)], 1000) == (0, 1000, [0, 250, 500, 750, 1000])
    assert timeline.byte_range([], 1000)[:2] == (0, 1000)


def test_the_sanitizers_own_objects_are_never_a_consumer_on_the_page(demo_report):
    # the demo's loader keeps every deferred call in a DeferralScope (ours) as well as in the layer's info
    page = timeline.render_html(demo_report)
    consumers = page[page.index("<h2>Retaining consumers</h2>"):]
    rows = re.findall(r'<tr><td><code>([^<]*)</code></td><td class="num">(\d+)', consumers)
    counted = [holder for holder, count in rows if int(count)]
    assert counted == [html.escape("LayerReloadingInfo.loaded_weights[*][*].arguments['loaded_weight']", quote=True)]
    # a holder seen only beside it (the replay loop's variable) is said to be one, not counted as a second
    assert all("counted above, beside their holder" in row for row in re.findall(r"<tr><td>.*?</tr>", consumers, re.S)
               if '<td class="num">0' in row)
    assert "DeferralScope" not in page.replace("DeferralScope.defer", "") and "_retained" not in page
    held = re.findall(r'<tr data-lease="\d+">.*?</tr>', page)
    assert held and all("DeferralScope" not in row and "LayerReloadingInfo" in row for row in held)


@pytest.mark.slow
def test_every_short_name_is_explained_on_the_page(demo_report, quickstart_report):
    page = timeline.render_html(demo_report)
    (panel,) = _panels(demo_report)
    lay = panel.layout()
    key = re.search(r'<p class="names">(.*?)</p>', page, re.S).group(1)
    assert "<code>model.layers.</code> and <code>.weight</code>" in key and "Hover a label for its whole name" in key
    initials = {pair for pl in lay.placed
                for pair in label_layout.abbreviations(panel.names(panel.full_name(pl)), panel.shown_name(pl))}
    assert initials  # 3.m.e.0.gate_proj: each initial said, with what it stands for
    assert all(f"<code>{k}</code> = <code>" in key and part in key for k, part in initials)
    left_out = [pl for pl in lay.placed if "\u2026" in panel.shown_name(pl)]
    assert ("<code>\u2026</code>" in key) == bool(left_out)
    # each label's tooltip is the whole name it stands for
    tips = re.findall(r'<g class="label-of"><title>([^<]*)</title><text[^>]*>([^<]*)</text></g>', page)
    assert len(tips) == len(lay.placed)
    whole = {l["name"] for l in demo_report["timeline"]["leases"]} | {e.get("by") for e in
                                                                     demo_report["timeline"]["events"]}
    for tip, _ in tips:
        name = html.unescape(tip).split(" ", 1)[1] if tip.startswith(("#", "reused for ")) else html.unescape(tip)
        name = name[len("for "):] if name.startswith("for ") else name
        assert name in whole, tip
    assert "<p class=\"names\">" in timeline.render_html(quickstart_report)


def test_a_counted_holder_is_said_in_words(tmp_path):
    rep, _, _ = _page(tmp_path)
    for lease in rep["timeline"]["leases"]:
        if lease["retained"]:
            lease["retained"]["counted"] = True
    page = timeline.render_html(rep)
    assert "counted" not in page.replace('"counted"', "") and "walked" not in page
    assert html.escape(timeline.COUNTED, quote=True) in page
    assert "not seen holding this view: named after what held the earlier views" in page


def _png_size(path) -> tuple:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
@pytest.mark.parametrize("width", [900, 1400, 2800])
def test_in_chromium_at_900_1400_and_2800_px_the_text_keeps_its_size(tmp_path, width, demo_report,
                                                                       quickstart_report):
    browser = _chromium()
    if browser is None:
        pytest.skip("no headless Chromium (chromium, chromium-browser or google-chrome on PATH): the page is not "
                    "rendered, its layout is still checked by the tests above")
    for name, rep in (("demo", demo_report), ("quickstart", quickstart_report)):
        page = timeline.render_html(rep)
        path = tmp_path / f"{name}.html"
        path.write_text(page, encoding="utf-8")
        png = tmp_path / f"{name}-{width}.png"  # kept under tmp_path, to look at
        proc = subprocess.run([browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={width},1200",
                               f"--screenshot={png}", path.as_uri()],
                              capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                              env={**os.environ, "HOME": str(tmp_path)})
        assert png.exists(), proc.stderr[-2000:]
        assert _png_size(png) == (width, 1200)
        px = _png_pixels(png.read_bytes()).astype(int)
        red = (px[:, :, 0] > 180) & (px[:, :, 1] < 90) & (px[:, :, 2] < 90)
        assert red.sum() > 300, (name, width)  # the retained boxes are on screen
        got = _measure_in_chromium(browser, tmp_path, page, width, 1200)
        (svg,) = got["svgs"]
        drawn = svg["box"][2] - svg["box"][0]
        # never scaled below its viewBox (labels 12 px, axes 11 px): a narrow window scrolls it instead
        assert timeline.WIDTH - 1 <= drawn <= timeline.MAX_WIDTH + 1, (name, width, drawn)
        if width >= timeline.WIDTH + 100:
            assert drawn >= min(timeline.MAX_WIDTH, 0.9 * (width - 48)) - 1  # a wide window: the chart widens
        heights = [t["box"][3] - t["box"][1] for t in svg["texts"] if "transform" not in t.get("text", "")]
        assert min(heights) >= 11 * 0.95, (name, width, min(heights))
        eps = 0.5
        texts = svg["texts"]
        overlaps = [(a["text"], b["text"]) for i, a in enumerate(texts) for b in texts[:i]
                    if a["box"][0] < b["box"][2] - eps and b["box"][0] < a["box"][2] - eps
                    and a["box"][1] < b["box"][3] - eps and b["box"][1] < a["box"][3] - eps]
        assert overlaps == [], (name, width, overlaps[:5])


_INJECT = '<b>x</b><zz onload=1>"\'&'  # an element, an attribute, both quotes and an ampersand


class _Parsed(HTMLParser):
    """What a browser's parser makes of a page: every element, every attribute, every text (decoded)."""

    def __init__(self, page: str):
        super().__init__(convert_charrefs=True)
        self.tags: list = []
        self.attrs: list = []
        self.texts: list = []
        self._open: list = []
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self._open.append(tag)
        self.attrs += [(tag, name, value) for name, value in attrs]

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += [(tag, name, value) for name, value in attrs]

    def handle_endtag(self, tag):
        if tag in self._open:
            del self._open[len(self._open) - 1 - self._open[::-1].index(tag):]

    def handle_data(self, data):
        self.texts.append((self._open[-1] if self._open else None, data))

    def injected(self) -> list:
        """What the payload made of the page beyond text: a ``zz`` element, an ``onload`` attribute, a ``b``
        element around its ``x``, or an attribute name with a quote in it."""
        return ([t for t in self.tags if t == "zz"]
                + [a for a in self.attrs if a[1] == "onload" or set(a[1]) & set("\"'&")]
                + [t for t in self.texts if t == ("b", "x")])

    def shown(self) -> str:
        """Every text and attribute value, decoded, one per line."""
        return "\n".join([d for _, d in self.texts] + [v or "" for _, _, v in self.attrs])


def _with_payloads(value, marks: dict, path=()):
    """``value`` with every free-text string (not the enums the schema fixes) ending in its own payload,
    ``<b>x</b>...&`` plus a number; ``marks``: each number's path."""
    if isinstance(value, dict):
        return {k: v if k in ("format", "kind", "until", "when", "dtype") else _with_payloads(v, marks, path + (k,))
                for k, v in value.items()}
    if isinstance(value, list):
        return [_with_payloads(v, marks, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, str):
        marks[len(marks)] = path
        return f"{value}{_INJECT}{len(marks) - 1}#"
    return value


def test_every_free_text_field_of_a_report_is_text_on_the_page_never_markup(tmp_path, capsys):
    """Names a program controls (buffer, tensor, holder key, the file, directory and function of a frame,
    the thread) and every other string of a crafted report that still matches the schema: each is written
    escaped, in every text and attribute context of the page, and shows as the text it is."""
    ring = sanitizer.StagingRing(8 * 1024, name=f"ring{_INJECT}")
    code = compile("def keep(w, key):\n    _KEPT[key] = w\n\ndef read(key):\n    return float(_KEPT[key].sum())\n",
                   f"/tmp/dir{_INJECT}/mod{_INJECT}.py", "exec")
    scope = {"_KEPT": _KEPT}
    exec(code, scope)
    keep, read = scope["keep"], scope["read"]
    for f in (keep, read):
        f.__code__ = f.__code__.replace(co_name=f"{f.__name__}{_INJECT}")
    with sanitizer.sanitize(triage=1):
        for i in range(24):
            w = ring.put(f"layers.{i}.{_INJECT}", torch.full((256,), float(i)))
            if i % 5 == 0:
                keep(w, f"key{_INJECT}{i}")
        del w
        import threading

        reader = threading.Thread(target=read, args=(f"key{_INJECT}5",), name=f"thread{_INJECT}")
        reader.start()
        reader.join()
        rep = sanitizer.report(final=True)
    rep = json.loads(json.dumps(rep, default=str))
    assert R.validate(rep) == []
    page = timeline.render_html(rep)
    parsed = _Parsed(page)
    assert parsed.injected() == []
    holders = [l["retained"]["holder"] for l in rep["timeline"]["leases"] if l["retained"]]
    assert holders and all("key<b>x</b><zz onload=1>" in h for h in holders), holders  # (the key's repr)
    for name in (f"ring{_INJECT}", f"layers.5.{_INJECT}", f"layers.6.{_INJECT}", f"mod{_INJECT}.py", *holders):
        assert name in parsed.shown(), name  # shown as the text it is
    # Every string of the report with a payload of its own, through `ownsan triage --html`, which reads
    # only what matches the schema.
    marks: dict = {}
    crafted = _with_payloads(rep, marks)
    assert R.validate(crafted) == []
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(crafted), encoding="utf-8")
    assert cli.main(["triage", str(path), "--html", str(tmp_path / "page.html"), "--exit-zero"]) == 0
    capsys.readouterr()
    parsed = _Parsed((tmp_path / "page.html").read_text(encoding="utf-8"))
    assert parsed.injected() == []
    shown = parsed.shown()
    drawn = {marks[n][-1] if isinstance(marks[n][-1], str) else marks[n][-2] for n in marks
             if f"{_INJECT}{n}#" in shown}
    # the fields the page draws, each seen whole, as text
    assert {"name", "device", "by", "holder", "line", "consumer", "site", "fix", "read_stale_at"} <= drawn, \
        sorted(drawn)


def test_numbers_a_report_did_not_check_are_escaped_too():
    """render_html is public: a report that never met the schema (ids, counts and pids as strings) is
    still drawn as text, never markup."""
    rep = _dense_report(n=40)
    for lease in rep["timeline"]["leases"]:
        lease.update(lease_id=f"{_INJECT}{lease['lease_id']}", pid=_INJECT)
        if lease["retired_by"] is not None:
            lease["retired_by"] = f"{_INJECT}{lease['retired_by']}"
    for ev in rep["timeline"]["events"]:
        ev.update(event_id=f"{_INJECT}{ev['event_id']}", pid=_INJECT)
    rep["timeline"]["buffers"][0]["pid"] = _INJECT
    rep["timeline"].update(dropped=_INJECT, cap=_INJECT)
    rep["processes"] = [{"pid": _INJECT}]
    rep["summary"]["retaining_consumers"] = [
        {"consumer": "a", "count": _INJECT, "bytes": 1, "site": "s", "fix": "f"},
        {"consumer": "b", "count": 0, "also_held": _INJECT, "bytes": 0, "site": "s", "fix": "f"}]
    parsed = _Parsed(timeline.render_html(rep))
    assert parsed.injected() == []
    assert parsed.shown().count(_INJECT) > 40
