"""The end-to-end demo: unsafe corrupts, debug mode raises, the three safe strategies are bit-exact."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sanitizer.testing import demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--hidden", "64", "--intermediate", "128", "--moe-intermediate", "64", "--dense-layers", "2",
         "--experts", "2", "--repeat", "1"]


def test_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = demo.main(SMALL + ["--json", str(out), "--dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    data = json.loads(out.read_text())
    res = {r["config"]: r for r in data["results"]}
    assert list(res) == list(demo.CONFIGS)
    total = data["checkpoint"]["tensors"]

    assert res["unsafe"]["corrupted"] > 0 and res["unsafe"]["errors"] == 0
    debug = res["debug"]
    assert debug["corrupted"] is None and debug["errors"] == 1 and debug["error_kind"] == "StaleBorrowError"
    assert "used after staging buffer 'demo-ring' reused" in debug["summary"]
    for section in ("lent at", "reused at", "used at", "deferred_loader.py", "stream_through_ring"):
        assert section in debug["report"]
    for c in demo.SAFE:
        assert res[c]["corrupted"] == 0 and res[c]["total"] == total and res[c]["errors"] == 0, c

    # the benchmark's point: clone-on-defer copies only what defers, rescue only what was overwritten
    everything = res["copy-everything"]["copied_bytes"]
    assert everything == data["checkpoint"]["bytes"]
    assert 0 < res["rescue"]["copied_bytes"] <= res["clone-on-defer"]["copied_bytes"] < everything
    assert res["rescue"]["rescues"] == res["rescue"]["copies"] > 0
    assert res["unsafe"]["copied_bytes"] == 0 and res["unsafe"]["peak_extra_bytes"] == 0
    assert 0 < res["clone-on-defer"]["peak_extra_bytes"] <= res["clone-on-defer"]["copied_bytes"]

    for label in demo.LABELS.values():
        assert label in printed
    assert "debug mode stopped at the first stale replay" in printed


def test_verdict_flags_a_corrupting_safe_strategy_and_a_missed_corruption():
    ok = demo.Result("clone-on-defer", 0, 10, 0, "", 0.1, 1, 1, 1, 0)
    bad = demo.Result("rescue", 2, 10, 0, "", 0.1, 1, 1, 1, 1, summary="a, b")
    unsafe = demo.Result("unsafe", 3, 10, 0, "", 0.1, 0, 0, 0, 0)
    silent = demo.Result("debug", 3, 10, 0, "", 0.1, 0, 0, 0, 0)
    assert demo.verdict([ok]) == []
    problems = demo.verdict([ok, bad, unsafe, silent])
    assert len(problems) == 2 and "2 of 10" in problems[0] and "raised nothing" in problems[1]
    assert "| " not in demo.format_table([ok, bad])  # a plain aligned table, one row per configuration
    assert len(demo.format_table([ok, bad]).splitlines()) == 4


def test_example_wrapper_and_bad_arguments():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "layerwise_reload.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--ring-bytes" in proc.stdout and "--order" in proc.stdout
    with pytest.raises(SystemExit, match="unknown configuration"):
        demo.main(SMALL + ["--configs", "unsafe,yolo"])
    with pytest.raises(SystemExit, match="smaller than the largest tensor"):
        demo.main(SMALL + ["--configs", "unsafe", "--ring-bytes", "64"])
