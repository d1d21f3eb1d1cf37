"""Ray's worker hook and report flusher (``sanitizer/tools/ray_env.py``), without Ray (issue 49).

The flusher is ticked by hand here, at the moments a real one (a daemon thread) can land on: in the middle of
a correct loop, and while a report is being built. The Ray runs themselves are in
``tests/adapters/test_engines_workers.py``.
"""
from __future__ import annotations

import json
import textwrap
import threading

import pytest
import torch

import sanitizer
from sanitizer.features import triage
from sanitizer.reporting import report as rep
from sanitizer.tools import ray_env
from sanitizer.tools.ray_env import _Flusher
from tests.conftest import run_python

NBYTES = 16 * 16 * 4


def _tick_elsewhere(flusher: _Flusher):
    """One tick on a thread of its own, as the flusher's daemon thread ticks, while this one waits where it is."""
    out = []
    thread = threading.Thread(target=lambda: out.append(flusher.tick()), name="ownsan-report-flusher")
    thread.start()
    thread.join()
    return out[0]


def test_a_flusher_ticking_in_the_middle_of_a_correct_loop_decides_no_retention(tmp_path, fresh_triage):
    """A correct loop files no finding, so the flusher once took it for an idle worker and wrote the report as
    at exit (``final=True``) between a lend and the loop variable's move: the view it still held for a moment
    was decided a retention ("still held by something the walk could not name" in a Ray worker). Its plain
    writes, from its own thread, decided it too (the last lend taken for the consumer's turn): "held by local
    'v'"."""
    sanitizer.enable(triage=1, halt_on_error=0, report=str(tmp_path / "report.json"))
    buf = sanitizer.StagingBuffer(NBYTES, name="staging")
    flusher = _Flusher(0.5)  # not started: ticked below, where a real one may tick
    v = buf.lend(0, (16, 16), torch.float32, name="w0")
    written = []
    for i in range(1, 4 * _Flusher.IDLE_TICKS):
        buf.reuse(0, NBYTES, by=f"w{i}")
        nxt = buf.lend(0, (16, 16), torch.float32, name=f"w{i}")
        written.append(_tick_elsewhere(flusher))  # `v` still holds the reused view: its turn is still to come
        v = nxt
        v.fill_(float(i))
        (v @ v).clone()
    del v, nxt
    assert "final" not in written, written  # the worker was lending all along: never idle
    assert triage.retentions() == []
    triage.settle(final=True)
    assert triage.retentions() == []
    buf.close()


def test_an_idle_worker_still_holding_a_reused_view_is_reported_as_retaining_it(tmp_path, fresh_triage):
    """The idle write stays: a worker between tasks that keeps a reused view (an actor's attribute) retains it."""
    path = tmp_path / "report.json"
    sanitizer.enable(triage=1, halt_on_error=0, report=str(path))
    buf = sanitizer.StagingBuffer(NBYTES, name="staging")
    flusher = _Flusher(0.5)
    kept = {"w0": buf.lend(0, (16, 16), torch.float32, name="w0")}
    buf.reuse(0, NBYTES, by="w1")  # the last reuse of the task: no lend after it, the worker goes idle
    ticks = [_tick_elsewhere(flusher) for _ in range(_Flusher.IDLE_TICKS + 2)]
    assert "final" in ticks, ticks
    on_disk = json.loads(path.read_text())
    retentions = [e for e in on_disk["events"] if e["kind"] == "retention"]
    assert [e["lease"]["name"] for e in retentions] == ["w0"]
    assert "kept" in retentions[0]["holder"]["path"]
    del kept
    buf.close()


def test_a_stale_use_filed_while_the_flusher_writes_is_written_at_its_next_tick(tmp_path, monkeypatch,
                                                                                 fresh_triage):
    """The flusher noted what it had written only after writing: a stale use filed while the report was being
    built (right after its retention, as a read of a kept view files both) was taken as written, and never
    was (an actor's merged report had the retention and no stale use)."""
    path = tmp_path / "report.json"
    sanitizer.enable(triage=1, halt_on_error=0, report=str(path))
    buf = sanitizer.StagingBuffer(NBYTES, name="staging")
    kept = [buf.lend(0, (16, 16), torch.float32, name="w0")]
    buf.reuse(0, NBYTES, by="w1")
    buf.lend(0, (16, 16), torch.float32, name="w1")
    triage.settle(final=True)  # the retention is filed: the flusher's next tick writes it
    write = rep.write_report

    def write_then_read_stale(target, final=False):
        out = write(target, final=final)  # the report is built...
        float(kept[0].sum())  # ...and the program, on its own thread, reads the kept view stale right after
        return out

    monkeypatch.setattr(rep, "write_report", write_then_read_stale)
    flusher = _Flusher(0.5)
    assert _tick_elsewhere(flusher) == "write"
    monkeypatch.setattr(rep, "write_report", write)
    assert len(sanitizer.errors()) == 1
    assert _tick_elsewhere(flusher) == "write"  # the stale use is new since what was written
    on_disk = json.loads(path.read_text())
    assert [e["kind"] for e in on_disk["errors"]] == ["stale_use"]
    assert [e["lease"]["name"] for e in on_disk["events"] if e["kind"] == "retention"] == ["w0"]
    del kept
    buf.close()


def test_worker_setup_imports_no_torch_and_arms_the_sanitizer_for_the_workers_import(tmp_path):
    """The hook runs before Ray sets the worker's OMP_NUM_THREADS (at its first task): a torch it imported
    would size its thread pool by the node's cores. It arms; the worker's own ``import torch`` turns it on. The
    flusher it starts imports nothing of torch's either while it waits (ticking every 10 ms here)."""
    env = ray_env.runtime_env(str(tmp_path / "reports"), options={"checksum": 1}, flush_interval_s=0.01)
    code = textwrap.dedent('''
        import os, sys, time
        from sanitizer.tools.ray_env import worker_setup   # as Ray imports the hook, before the first task
        worker_setup()
        time.sleep(0.3)
        print("torch after the hook:", "torch" in sys.modules, os.environ["OWNERSHIP_SANITIZE"])
        os.environ["OMP_NUM_THREADS"] = "1"                # what Ray does at the first task
        import torch, sanitizer
        print("threads", torch.get_num_threads(), "enabled", sanitizer.enabled(),
              "checksum", sanitizer.options()["checksum"])
        buf = sanitizer.StagingBuffer(64, name="staging")
        v = buf.lend(0, (4,), torch.float32, name="w0")
        buf.reuse(0, 64, by="w1")
        try:
            float(v.sum())
        except sanitizer.StaleBorrowError:
            print("stale use caught")
        print("recorded", len(sanitizer.errors()))
    ''')
    proc = run_python(code, env_extra=env["env_vars"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch after the hook: False 1" in proc.stdout, proc.stdout
    # (empty over an inherited switch, ownsan run's: under these names Ray's import of the hook turned it on)
    assert env["env_vars"]["OWNERSHIP_SANITIZE"] == env["env_vars"]["OWNERSHIP_SANITIZE_OPTIONS"] == ""
    assert "threads 1 enabled True checksum True" in proc.stdout, proc.stdout
    assert "recorded 1" in proc.stdout, proc.stdout  # triage=1 (runtime_env's default): recorded, not raised


def test_worker_setup_after_torch_turns_the_sanitizer_on_at_once(tmp_path):
    """A worker whose code imported torch before the hook ran, with a request the start-up hook never saw
    (set in the environment after start-up), is sanitized from the hook on."""
    env = ray_env.runtime_env(str(tmp_path / "reports"))
    code = textwrap.dedent('''
        import json, os, sys
        import torch
        from sanitizer.tools.ray_env import worker_setup
        import sanitizer
        assert not sanitizer.enabled()
        os.environ.update(json.loads(os.environ["REQUEST_AFTER_START_UP"]))
        worker_setup()
        print("enabled", sanitizer.enabled())
    ''')
    proc = run_python(code, env_extra={"REQUEST_AFTER_START_UP": json.dumps(env["env_vars"])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "enabled True" in proc.stdout, proc.stdout


def test_a_worker_given_the_request_at_start_up_is_sanitized_at_its_torch_import_with_its_flusher(tmp_path):
    """No hook at all (Ray runs none for a runtime_env given per task or actor): the start-up hook takes the
    request, the sanitizer turns on at the worker's import of torch, and the flusher runs."""
    env = ray_env.runtime_env(str(tmp_path / "reports"))
    code = textwrap.dedent('''
        import sys, threading
        assert "torch" not in sys.modules
        import torch
        import sanitizer
        print("enabled", sanitizer.enabled(), [t.name for t in threading.enumerate() if "flusher" in t.name])
    ''')
    proc = run_python(code, env_extra=env["env_vars"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "enabled True ['ownsan-report-flusher']" in proc.stdout, proc.stdout
