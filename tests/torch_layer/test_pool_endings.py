"""A worker's findings reach the merged report however the worker ends (issue 29, point 1).

``with multiprocessing.Pool(...)`` ends with ``terminate()``: spawn and forkserver pools lost every stale
read their workers saw (a forkserver's worker ends with ``os._exit`` and was enabled after its fork, so no
atexit handler and no exit wrapper ran), fork pools some. Each context, several runs, every finding.
"""
from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent('''
    import multiprocessing as mp, sys, torch
    import sanitizer
    KEPT = []
    def work(i):
        ring = sanitizer.StagingRing(4096, name=f"w{i}")
        a = ring.put("a", torch.ones(1024))
        KEPT.append(a)
        ring.put("b", torch.zeros(1024))
        float(a.sum())  # a stale read, recorded (ownsan run: triage=1)
        return i
    if __name__ == "__main__":
        with mp.get_context(sys.argv[1]).Pool(2) as pool:
            print(pool.map(work, range(4)))
''')


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_every_stale_read_of_a_terminated_pool_reaches_the_report(tmp_path, method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method on this platform")
    script = tmp_path / "pool.py"
    script.write_text(_PROGRAM)
    for run in range(3):
        report = tmp_path / f"r{run}.json"
        out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(report), "--", sys.executable,
                              str(script), method], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        rep = json.loads(report.read_text())
        stale = [e for e in rep["errors"] if e["kind"] == "stale_use"]
        assert len(stale) == 4, (run, out.stdout, out.stderr[-2000:])
        assert out.returncode == 1  # findings: the run fails, as ASan's does
        # One list, one consumer: a spawn or forkserver worker's functions keep the namespace runpy ran the
        # script in while sys.modules['__main__'] holds a copy; both reach KEPT (it once read as three).
        # (A worker killed before its report keeps its findings in its journal, but not the retentions
        # still pending then: the consumer may be missing, never named twice or wrongly.)
        consumers = [g["consumer"] for g in rep["summary"]["retaining_consumers"]]
        assert [c for c in consumers if "KEPT" in c] in ([], ["__main__.KEPT[*]"]), consumers


_SIGTERM_MID_WRITE = textwrap.dedent('''
    import os, signal, sys, torch
    import sanitizer
    from sanitizer.features import triage
    KEPT = []
    ring = sanitizer.StagingRing(4096, name="w")
    a = ring.put("a", torch.ones(1024))
    KEPT.append(a)
    ring.put("b", torch.zeros(1024))
    float(a.sum())  # a stale read
    checkpoint = triage._TRIAGE._checkpoint
    def checkpoint_then_terminated(*args, **kwargs):  # terminate()'s SIGTERM, landing mid-write
        triage._TRIAGE._checkpoint = checkpoint
        os.kill(os.getpid(), signal.SIGTERM)
        return checkpoint(*args, **kwargs)
    triage._TRIAGE._checkpoint = checkpoint_then_terminated
    sys.stdout.flush()
    os._exit(0)  # a pool worker's end: the final report is written under triage's lock
''')


@pytest.mark.slow
def test_a_sigterm_that_lands_while_the_report_is_written_loses_no_finding_and_kills_at_once(tmp_path):
    """A worker that got its sentinel is writing its report (os._exit) when terminate()'s SIGTERM lands. A
    Python handler for SIGTERM first doubled the write and lost it after 10 s, then hung a worker whose
    main thread was blocked in a lock while the signal landed on another thread. SIGTERM keeps its
    default action: the process dies at once, and every finding is in its journal, readable as its report."""
    import os
    import signal
    import time

    from sanitizer.reporting import report as R

    script = tmp_path / "mid.py"
    script.write_text(_SIGTERM_MID_WRITE)
    report = tmp_path / "r.json"
    began = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                         env={**os.environ, "OWNERSHIP_SANITIZE": "1",
                              "OWNERSHIP_SANITIZE_OPTIONS": f"report={report},triage=1"})
    took = time.monotonic() - began
    assert out.returncode == -signal.SIGTERM, (out.returncode, out.stderr[-2000:])  # it died of SIGTERM, as asked
    assert took < 9, took
    assert not report.exists()  # killed before its report was whole: the atomic write left nothing half
    rep = R.load(str(report) + ".journal")
    assert [e["kind"] for e in rep["errors"]] == ["stale_use"] and rep["error_count"] == 1
    assert rep["pid"] and rep["ended_before_report"]["lines_cut"] == 0
    assert "1 error" in rep["summary"]["line"]


@pytest.mark.slow
def test_a_journal_goes_once_the_report_is_written_and_a_cut_line_is_skipped(tmp_path):
    import os

    from sanitizer.core import journal
    from sanitizer.reporting import report as R

    report = tmp_path / "r.json"
    code = ("import torch, sanitizer\n"
            "ring = sanitizer.StagingRing(4096, name='w')\n"
            "a = ring.put('a', torch.ones(1024)); ring.put('b', torch.zeros(1024))\n"
            "float(a.sum())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                         env={**os.environ, "OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": f"report={report},halt_on_error=0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert report.exists() and not os.path.exists(str(report) + ".journal")  # whole report: no journal left
    errors = json.loads(report.read_text())["errors"]
    assert [e["kind"] for e in errors] == ["stale_use"]
    # A journal whose last line the kill cut short: the whole lines are read, the cut one is counted.
    # (Its whole line is a real record: a journal's records are checked against the schema, issue 46.)
    j = tmp_path / "k.json.journal"
    header = {"kind": journal.KIND, "format": "ownership-sanitizer-report", "version": 2, "pid": 7, "argv": []}
    j.write_text(json.dumps(header) + "\n" + json.dumps({"k": "error", "r": errors[0]}) + "\n"
                 + '{"k": "error", "r": {"ki')
    rep = R.load(str(j))
    assert len(rep["errors"]) == 1 and rep["ended_before_report"]["lines_cut"] == 1
    (tmp_path / "x.json.journal").write_text("not a journal\n")
    with pytest.raises(ValueError, match="not an ownership-sanitizer journal"):
        R.load(str(tmp_path / "x.json.journal"))


@pytest.mark.slow
def test_the_soak_reports_every_stale_read_of_threads_a_fork_a_terminated_pool_and_a_real_loader(tmp_path):
    """bench/stress.py --soak-runs, one run per start method (the bench runs ten)."""
    from sanitizer.testing import stress

    methods = [m for m in ("spawn", "forkserver", "fork") if m in multiprocessing.get_all_start_methods()]
    result = stress.run_soak(1, methods, str(tmp_path))
    assert all(r["whole"] == 1 for r in result.values()), result


@pytest.mark.slow
def test_no_journal_beside_a_device_or_a_descriptors_link_and_a_stale_journal_is_replaced(tmp_path):
    import os

    from sanitizer.core import output_file

    assert not output_file.replaced_whole("/dev/null") and not output_file.replaced_whole("/dev/stdout")
    assert not output_file.replaced_whole("/dev/fd/1") and not output_file.replaced_whole("/dev/null.123")
    assert output_file.replaced_whole(str(tmp_path / "new.json"))
    before = set(os.listdir("/dev"))
    code = ("import os, torch, sanitizer\n"
            "ring = sanitizer.StagingRing(4096, name='w')\n"
            "a = ring.put('a', torch.ones(1024)); ring.put('b', torch.zeros(1024))\n"
            "float(a.sum())\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    b = ring.put('c', torch.ones(1024)); ring.put('d', torch.zeros(1024)); float(b.sum()); os._exit(0)\n"
            "os.waitpid(pid, 0)\n")
    for report in ("/dev/null", "/dev/stdout"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OWNERSHIP_SANITIZE": "1",
                                  "OWNERSHIP_SANITIZE_OPTIONS": f"report={report},halt_on_error=0"})
        assert out.returncode == 0 and "journal" not in out.stderr, out.stderr[-2000:]
    assert set(os.listdir("/dev")) == before  # no /dev/null.journal, no /dev/null.<pid> of the child
    # A journal an earlier, killed process left at a fixed path is replaced, never appended to.
    report = tmp_path / "r.json"
    (tmp_path / "r.json.journal").write_text('{"kind": "ownership-sanitizer-journal", "pid": 1}\n{"k": "err')
    killer = code.split("pid = os.fork()")[0] + "os.kill(os.getpid(), 9)\n"
    subprocess.run([sys.executable, "-c", killer], capture_output=True, text=True, timeout=120,
                   env={**os.environ, "OWNERSHIP_SANITIZE": "1",
                        "OWNERSHIP_SANITIZE_OPTIONS": f"report={report},halt_on_error=0"})
    from sanitizer.reporting import report as R

    rep = R.load(str(report) + ".journal")
    assert rep["pid"] != 1 and len(rep["errors"]) == 1 and rep["ended_before_report"]["lines_cut"] == 0


def _a_real_stale_use() -> dict:
    """One stale use's record as a process writes it (journals are checked against the report schema)."""
    import torch

    import sanitizer

    buf = sanitizer.StagingBuffer(64, name="r")
    w = buf.write(0, torch.ones(4), name="w")
    buf.reuse(0, 16, by="next")
    with sanitizer.sanitize(halt_on_error=0):
        float(w.sum())
        record = sanitizer.report()["errors"][0]
    sanitizer.clear_errors()
    return record


def _journal(path, pid: int, records: int) -> None:
    """A whole journal of a killed process: its header and ``records`` stale uses."""
    from sanitizer.core import journal

    header = {"kind": journal.KIND, "format": "ownership-sanitizer-report", "version": 2, "pid": pid, "argv": []}
    record = _a_real_stale_use()
    lines = [json.dumps(header)] + [json.dumps({"k": "error", "r": dict(record, pid=pid)}) for _ in range(records)]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("cut", ["", '{"kind": "ownership-sanit'], ids=["empty", "header-cut"])
def test_a_journal_cut_at_its_first_line_costs_the_merge_only_its_own_process(tmp_path, capsys, cut):
    """Issue 46, point 10: a pool worker SIGKILLed while it opened its journal (at its first finding: the
    file is made, its header not yet whole) left a file that is no journal. ``ownsan run`` raised on it
    and wrote no merged report: every other worker's findings were lost with it. Now it is said and left
    out, and the run fails (that process did make a finding, which is lost)."""
    import argparse

    from sanitizer.tools import cli

    _journal(tmp_path / "report-101.json.journal", 101, 2)
    _journal(tmp_path / "report-102.json.journal", 102, 1)
    (tmp_path / "report-103.json.journal").write_text(cut)
    out = tmp_path / "merged.json"
    args = argparse.Namespace(report=str(out), quiet=True, top=5, fail_on_retention=False)
    code = cli._finish_run(args, cli._process_reports(str(tmp_path)), 0)
    merged = json.loads(out.read_text())
    assert code == 1
    assert sorted(e["pid"] for e in merged["errors"]) == [101, 101, 102]
    err = capsys.readouterr().err
    assert "1 process left a file that cannot be read" in err and "report-103.json.journal" in err


_KILLED_AT_ITS_JOURNAL = textwrap.dedent('''
    import multiprocessing as mp, os, signal, sys, time, torch
    import sanitizer
    KEPT = []
    def work(i):
        if i == 1:  # SIGKILLed the moment its journal is made, before the header is written
            from sanitizer.core import journal
            journal._write_all = lambda fd, data: os.kill(os.getpid(), signal.SIGKILL)
        ring = sanitizer.StagingRing(4096, name=f"w{i}")
        a = ring.put("a", torch.ones(1024))
        KEPT.append(a)
        ring.put("b", torch.zeros(1024))
        float(a.sum())  # a stale read, recorded (ownsan run: triage=1)
        if i == 2:  # SIGKILLed once its finding is in its journal
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.3)  # (each worker takes one task)
        return i
    if __name__ == "__main__":
        with mp.get_context("fork").Pool(4) as pool:
            results = [pool.apply_async(work, (i,)) for i in range(4)]
            for i in (0, 3):
                results[i].get(timeout=60)
            for i in (1, 2):
                results[i].wait(1)  # a killed worker's task never returns
''')


@pytest.mark.slow
def test_sigkilled_pool_workers_lose_only_their_own_findings(tmp_path):
    """Pool(4): one worker is SIGKILLed at its first finding (its journal made, not yet written), another
    right after its finding. The merged report has the two live workers' findings and the second killed
    worker's (from its journal); only the first one's is lost, and the run says so and fails."""
    script = tmp_path / "killed.py"
    script.write_text(_KILLED_AT_ITS_JOURNAL)
    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--quiet", "--report", str(report), "--",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 1, out.stderr[-2000:]
    rep = json.loads(report.read_text())
    stale = [e for e in rep["errors"] if e["kind"] == "stale_use"]
    assert sorted(e["lease"]["buffer"] for e in stale) == ["w0", "w2", "w3"], out.stderr[-2000:]
    assert len({e["pid"] for e in stale}) == 3
    assert "1 process left a file that cannot be read" in out.stderr
    # w2's worker (and any live one that terminate() ended before its report): from their journals
    assert re.search(r"ownsan run: \d+ process(es)? ended before writing a report", out.stderr), out.stderr
