"""The timeline: the report's lend/retire section, the HTML page drawn from it (checked in headless
Chromium when installed), the Chrome trace export, and ``ownsan triage --html/--trace``."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib

import pytest
import torch

import sanitizer
from sanitizer.features import holders
from sanitizer.features import triage
from sanitizer.reporting import report as R
from sanitizer.reporting import timeline, trace
from sanitizer.tools import cli

_KEPT: dict = {}


@pytest.fixture(autouse=True)
def _fresh():
    triage.reset(records_too=True)
    holders.forget_patterns()
    _KEPT.clear()
    yield
    triage.reset(records_too=True)
    _KEPT.clear()


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
    assert page.count('<g class="retained"') == 5 and page.count('<g class="stale-read">') == 1
    assert "held by __main__" not in page and f"held by {__name__}._KEPT[" in page
    assert "\u2193 layers.13.weight" in page  # a reuse labelled with the tensor that took the bytes
    assert "<title>RETAINED layers.5.weight\nheld by" in page  # details on hover
    assert f"read stale at generation 25, at test_timeline.py:" in page
    assert "Retaining consumers" in page and "own the tensor where" in page


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
    assert cli.main(["triage", str(src), "--html", str(html), "--trace", str(tr)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {html}" in out and f"wrote {tr}" in out
    assert "<svg" in html.read_text() and json.loads(tr.read_text())["traceEvents"]
    assert cli.main(["triage", str(src), "--html", str(tmp_path / "no" / "such" / "\0bad.html")]) == 2


def test_the_demo_writes_the_page_of_its_unsafe_load(tmp_path):
    from sanitizer.testing import demo
    from sanitizer.testing.reference.checkpoint import write_checkpoint
    from sanitizer.testing.reference.fused_loaders import TinyConfig

    cfg = TinyConfig(hidden=64, intermediate=128, moe_intermediate=64, dense_layers=2, experts=2)
    path = str(tmp_path / "tiny.safetensors")
    info = write_checkpoint(path, cfg)
    page = tmp_path / "demo.html"
    rep = demo.write_timeline(path, 2 * info["largest"], str(page))
    consumer = "LayerReloadingInfo.loaded_weights[*][*].arguments['loaded_weight']"
    assert rep["summary"]["retaining_consumers"][0]["consumer"] == consumer  # as in the real vLLM fork
    text = page.read_text(encoding="utf-8")
    assert 'data-buffer="demo-ring"' in text and text.count('<g class="retained"') == rep["summary"]["retentions"] > 0
    assert "held by LayerReloadingInfo.loaded_weights[" in text and "http" not in text
    assert sanitizer.errors() == [] and triage.pending_count() == 0  # the demo's triage run leaves nothing behind
