"""The end-to-end demo: unsafe corrupts, debug mode raises, the three safe strategies are bit-exact."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from sanitizer.testing import demo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--hidden", "64", "--intermediate", "128", "--moe-intermediate", "64", "--dense-layers", "2",
         "--experts", "2", "--repeat", "1"]


@pytest.mark.slow
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


def test_the_demo_says_what_it_simulates_what_corrupted_means_and_the_fix(tmp_path, capsys):
    rc = demo.main(SMALL + ["--dir", str(tmp_path), "--configs", "unsafe,clone-on-defer", "--html", "",
                            "--report", ""])
    printed = capsys.readouterr().out
    assert rc == 0
    assert printed.startswith("What this simulates: vLLM's layerwise weight reload")
    assert "'corrupted' counts checkpoint tensors whose loaded (quantized) values differ, bit for bit" in printed
    # no sanitized load ran (no debug row, no report run): the fix is named, but no line the demo did not see
    flat = " ".join(printed.split())
    assert "online_process_loader (deferred_loader.py, where it stores the call; the debug row's report names " \
           "the line)" in flat and "bound = sanitizer.own_arguments(bound)" in printed
    assert not re.search(r"deferred_loader\.py:\d+", printed)
    assert "the unsafe load once more" not in printed  # --html '' --report '': no report run


@pytest.mark.slow
def test_the_demo_names_the_fix_at_the_line_its_report_names(tmp_path, capsys):
    rc = demo.main(SMALL + ["--dir", str(tmp_path), "--configs", "unsafe,debug", "--html", "", "--report", ""])
    printed = capsys.readouterr().out
    assert rc == 0
    prose = " ".join(printed[printed.index("The fix (the clone-on-defer row)"):printed.index("debug mode stopped")]
                     .split())
    said = re.search(r"online_process_loader \((\S+?):(\d+)[,)]", prose)
    report = printed[printed.index("debug mode stopped"):]
    fixed = re.search(r"^  fix: .*\((\S+):(\d+)\)$", report, re.M)
    assert said and fixed, printed
    assert os.path.realpath(said.group(1)) == os.path.realpath(fixed.group(1)) and said.group(2) == fixed.group(2)
    guide = " ".join(report.split())
    assert f"kept them at {said.group(1)}:{said.group(2)} (online_process_loader), where the fix goes" in guide
    line = open(fixed.group(1), encoding="utf-8").read().splitlines()[int(fixed.group(2)) - 1]
    assert "info.loaded_weights.append((param_name, bound))" in line  # what the prose's comment says it precedes


@pytest.mark.slow
def test_the_debug_report_shows_the_consumer_and_says_whose_frames_are_whose(tmp_path):
    from sanitizer.testing.reference.checkpoint import write_checkpoint
    from sanitizer.testing.reference.fused_loaders import TinyConfig

    cfg = TinyConfig(hidden=64, intermediate=128, moe_intermediate=64, dense_layers=2, experts=2)
    path = str(tmp_path / "tiny.safetensors")
    info = write_checkpoint(path, cfg)
    r = demo.run_debug_subprocess(path, 2 * info["largest"])
    assert r.error_kind == "StaleBorrowError"
    used = r.report[r.report.index("  used at"):]
    lent = r.report[r.report.index("  lent at"):r.report.index("  reused at")]
    # the consumer's frames: the replay of a deferred call, in the reference loader, under the model's loader
    assert "_process " in used and "online_process_loader " in used and "weight_loader " in used
    # under them one frame of the demo's own driver, then the command line: no runpy, no argument handling
    for stack in (used, lent):
        frames = re.findall(r"#\d+ (\S+) (\S+):\d+", stack)
        driver = [function for function, where in frames if where.endswith("demo.py")]
        assert driver == ["load", "_child_debug", "child_main"], stack
        assert not [f for f, where in frames if "runpy" in where or f in ("main", "_main", "_run_code")], stack
    guide = " ".join(r.guide.split())
    assert "stream_through_ring checkpoint.py:" in guide and "the consumer, LayerwiseLoader" in guide
    assert f"kept them at {demo._shown_path(r.fix_site)} (online_process_loader), where the fix goes" in guide
    assert r.report.rstrip().count(f"({r.fix_site})") >= 1  # the site the error's own fix: line names


def test_the_demo_writes_its_report_for_ownsan_triage_and_explains_the_nans(tmp_path, capsys):
    import sanitizer
    from sanitizer.features import triage
    from sanitizer.reporting import report as R
    from sanitizer.tools import cli

    out = tmp_path / "results.json"
    rc = demo.main(SMALL + ["--dir", str(tmp_path), "--configs", "unsafe", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert sanitizer.errors() == [] and triage.pending_count() == 0  # the report run leaves nothing behind
    run = json.loads(out.read_text())["report_run"]
    report = tmp_path / "layerwise_reload_report.json"
    assert run["report"] == str(report) and run["html"] == str(tmp_path / "layerwise_reload_timeline.html")
    rep = R.load(str(report))
    assert R.validate(rep) == [] and rep["summary"]["retentions"] > 0 and rep["timeline"]["leases"]
    flat = " ".join(printed.split())
    assert f"report: {report} read it with: ownsan triage {report} --html PAGE --trace TRACE" in flat
    # with the guard on, what the consumer loaded from its retained views is NaN, and the demo says why, there
    assert run["nan_parameters"] and run["corrupted"]
    assert (f"{run['nan_parameters'][0]} reads NaN: the guard re-pointed the retained view it was loaded from "
            "to poison") in flat and "see the report" in flat
    trace_path, page = tmp_path / "t.json", tmp_path / "t.html"
    assert cli.main(["triage", str(report), "--trace", str(trace_path), "--html", str(page)]) == 1  # (findings)
    capsys.readouterr()
    events = json.loads(trace_path.read_text())["traceEvents"]
    retained = [e for e in events if e.get("cat") == "retention"]
    assert len(retained) == rep["summary"]["retentions"]
    assert all(e["name"].startswith("retained by ") for e in retained)
    assert any(e["name"].startswith("retained by LayerReloadingInfo.") for e in retained)  # (which of its two
    # holders, loaded_weights or scope._retained, a retention is named by is triage's choice)
    assert "<svg" in page.read_text(encoding="utf-8")


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


@pytest.mark.slow
def test_example_wrapper_and_bad_arguments():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "layerwise_reload.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--ring-bytes" in proc.stdout and "--order" in proc.stdout
    with pytest.raises(SystemExit, match="unknown configuration"):
        demo.main(SMALL + ["--configs", "unsafe,yolo"])
    with pytest.raises(SystemExit, match="smaller than the largest tensor"):
        demo.main(SMALL + ["--configs", "unsafe", "--ring-bytes", "64"])


def test_the_demo_says_what_it_is_doing_while_it_runs(tmp_path, capsys):
    """The table comes when every run is done: meanwhile stderr says what runs and each round as it ends."""
    rc = demo.main(SMALL + ["--dir", str(tmp_path / "made"), "--configs", "unsafe,clone-on-defer", "--html", "",
                            "--report", "", "--repeat", "2"])
    err = capsys.readouterr().err
    assert rc == 0 and (tmp_path / "made").is_dir()  # an output directory that is missing is made
    lines = err.splitlines()
    assert lines[0].startswith("running 2 configurations (unsafe borrowed, clone-on-defer (own_arguments)): "
                               "a warm-up, then 2 rounds"), err
    assert [ln.split(" (")[0].strip() for ln in lines[1:3]] == ["round 1 of 2 done", "round 2 of 2 done"], err
