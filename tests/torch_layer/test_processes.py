"""Threads and processes: no deadlock after a fork, no lost finding in a fork worker, no miss under races."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import sanitizer
from conftest import ROOT, run_python

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.mark.slow
def test_a_child_forked_while_another_thread_holds_the_sanitizers_locks_lends_and_exits():
    """The parent's helper thread holds every lock a lend, a reuse, a stale use and a report take; the
    child (which lacks that thread) must still lend, reuse, catch a stale read and write its report."""
    code = textwrap.dedent("""
        import os, sys, threading, time, torch, sanitizer
        from sanitizer.torch_layer import records, state, hooks, interception, runtime
        from sanitizer.features import triage, holders
        sanitizer.enable(halt_on_error=0)
        buf = sanitizer.StagingBuffer(4096, name="parent")
        held = threading.Event()
        locks = [state.state.lock, state.state.ledger._lock, records.STORE._lock, hooks.HOOKS._lock,
                 interception._now.lock, triage._TRIAGE._lock, triage._TRIAGE.log._lock, holders._patterns_lock]
        def hold():
            for lock in locks:
                lock.acquire()
            held.set()
            time.sleep(30)
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            b = sanitizer.StagingBuffer(4096, name="child")
            kept = b.write(0, torch.ones(4), name="w")
            b.write(0, torch.zeros(4), name="next")
            kept.sum()
            print("child errors", len(sanitizer.errors()), flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child status", status, flush=True)
        os._exit(0)
    """)
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "child errors 1" in out.stdout and "child status 0" in out.stdout, out.stdout + out.stderr


_FORK_WORKER = textwrap.dedent("""
    import multiprocessing as mp, torch, sanitizer

    def worker():
        buf = sanitizer.StagingBuffer(4096, name="worker-ring")
        kept = [buf.write(0, torch.ones(16), name="layers.0.w")]
        buf.write(0, torch.zeros(16), name="layers.1.w")
        kept[0].sum()  # a stale read in the worker, which ends with os._exit

    if __name__ == "__main__":
        p = mp.get_context("fork").Process(target=worker)
        p.start(); p.join()
        print("worker exit", p.exitcode)
""")


@pytest.mark.slow
def test_the_findings_of_a_multiprocessing_fork_worker_reach_ownsan_run(tmp_path):
    script = tmp_path / "fork_worker.py"
    script.write_text(_FORK_WORKER)
    report = tmp_path / "merged.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(report), "--", sys.executable,
                          str(script)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stdout + out.stderr  # the worker's error fails the run
    rep = json.loads(report.read_text())
    assert rep["error_count"] >= 1
    processes = rep.get("processes", [])
    assert len(processes) == 2  # the command and its fork worker, each with its own report
    (finder,) = [p for p in processes if p["error_count"]]
    assert {e["pid"] for e in rep["errors"]} == {finder["pid"]}  # the worker's finding, under the worker's pid
    assert any(e["lease"]["name"] == "layers.0.w" for e in rep["errors"])


@pytest.mark.slow
def test_a_forked_child_reports_only_its_own_findings_and_never_over_its_parents_file(tmp_path):
    target = tmp_path / "r.json"
    code = textwrap.dedent(f"""
        import os, torch, sanitizer
        sanitizer.enable(halt_on_error=0, report={str(target)!r})
        buf = sanitizer.StagingBuffer(4096, name="b")
        kept = buf.write(0, torch.ones(4), name="parent-view")
        buf.write(0, torch.zeros(4), name="next")
        kept.sum()  # the parent's finding
        pid = os.fork()
        if pid == 0:
            os._exit(0)  # the child found nothing itself
        os.waitpid(pid, 0)
        print(pid)
    """)
    out = run_python(code, timeout=60)
    assert out.returncode == 0, out.stderr
    child = int(out.stdout.split()[-1])
    parent_rep = json.loads(target.read_text())
    child_rep = json.loads((tmp_path / f"r.{child}.json").read_text())
    assert parent_rep["error_count"] == 1 and child_rep["error_count"] == 0  # not inherited, not overwritten


@pytest.mark.slow
def test_a_lease_made_stale_by_a_concurrent_reuse_is_never_missed():
    """Lenders and reusers race on one shared buffer: every read of a lease after its reuse is caught."""
    buf = sanitizer.StagingBuffer(1 << 16, name="shared")
    misses, reads, stop = [], [0], threading.Event()

    def lender(seed: int) -> None:
        offset = (seed % 8) * 256
        while not stop.is_set():
            w = buf.lend(offset, (64,), torch.float32, name=f"w{seed}")
            buf.reuse(offset, 256, by="other")
            try:
                w.sum()
                misses.append(seed)
            except sanitizer.StaleBorrowError:
                pass
            reads[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with sanitizer.sanitize(triage_budget_ms=0, guard=0):
            threads = [threading.Thread(target=lender, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            while reads[0] < 3000:
                threading.Event().wait(0.05)
            stop.set()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old)
    assert not misses, f"{len(misses)} stale reads of {reads[0]} missed"


@pytest.mark.slow
def test_eight_threads_each_putting_into_their_own_ring_under_triage():
    """triage's lend log and pending decisions are shared by every lending thread: no 'deque mutated'."""
    failures = []

    def load(i: int) -> None:
        try:
            ring = sanitizer.StagingRing(4096, name=f"ring{i}")
            kept = []
            for j in range(300):
                view = ring.put(f"t{j}", torch.full((64,), float(j)))
                if j % 7 == 0:
                    kept.append(view)  # some retentions, so triage decides and names
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            failures.append(repr(exc))

    with sanitizer.sanitize(triage=1, triage_budget_ms=0):
        threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sanitizer.retentions()
    assert not failures, failures
