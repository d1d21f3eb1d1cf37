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


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
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


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
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


class _Ticking:
    """A flusher ticked every ``interval`` on a thread of its own until the ``with`` block ends (a real one is a
    daemon thread that never stops: it would tick on into the next tests)."""

    def __init__(self, flusher: _Flusher, interval: float):
        self.flusher, self.interval, self.ticks = flusher, interval, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ownsan-report-flusher")

    def _run(self):
        while not self._stop.wait(self.interval):
            self.ticks.append(self.flusher.tick())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@pytest.fixture
def live_pid():
    """The pid of a live process other than this one: a worker's report is named by its own pid, and collect()
    waits only for live workers (this process's own report is never waited for)."""
    import subprocess

    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_collect_right_after_the_last_task_gets_an_idle_actors_last_retention(tmp_path, live_pid, capsys,
                                                                              monkeypatch, fresh_triage):
    """collect() read the reports after settle_s (1 s) while the actor's kept view was still *pending*: its
    flusher writes as at exit only after 4 idle intervals (2 s), so the retention was never counted ("no
    retentions, 1 still pending" and ownsan run exit 0). collect() now asks the live workers to settle."""
    monkeypatch.delenv("OWNSAN_RUN_REPORT_DIR", raising=False)
    sanitizer.enable(triage=1, halt_on_error=0, report=str(tmp_path / f"report-{live_pid}.json"))
    buf = sanitizer.StagingBuffer(NBYTES, name="staging")
    kept = {"w0": buf.lend(0, (16, 16), torch.float32, name="w0")}  # an actor's attribute, never read again
    buf.reuse(0, NBYTES, by="w1")  # the task's last reuse; the driver's ray.get returns
    flusher = _Flusher(0.3)
    assert _tick_elsewhere(flusher) == "write"  # what the worker wrote before collect() came
    with _Ticking(flusher, 0.3) as ticking:
        merged = ray_env.collect(str(tmp_path), settle_s=0.1)
    assert [e["lease"]["name"] for e in merged["events"] if e["kind"] == "retention"] == ["w0"]
    assert "settled" in ticking.ticks and "final" not in ticking.ticks, ticking.ticks
    assert "did not answer" not in capsys.readouterr().err
    assert not (tmp_path / ray_env.SETTLE_REQUEST).exists()  # (no later worker settles on a stale request)
    del kept
    buf.close()


def test_a_settle_request_waits_for_a_tick_with_nothing_lent_since_the_last(tmp_path, fresh_triage):
    """A worker still running a loop when collect() asks must not write as at exit mid-loop (the view its
    loop variable was about to drop would be decided a retention): it answers at its first quiet tick."""
    path = tmp_path / "report-7.json"
    sanitizer.enable(triage=1, halt_on_error=0, report=str(path))
    buf = sanitizer.StagingBuffer(NBYTES, name="staging")
    flusher = _Flusher(0.5)
    (tmp_path / ray_env.SETTLE_REQUEST).write_text("token-1")
    v = buf.lend(0, (16, 16), torch.float32, name="w0")
    written = []
    for i in range(1, 8):
        buf.reuse(0, NBYTES, by=f"w{i}")
        nxt = buf.lend(0, (16, 16), torch.float32, name=f"w{i}")
        written.append(_tick_elsewhere(flusher))
        v = nxt
    del v, nxt
    assert "settled" not in written, written
    assert _tick_elsewhere(flusher) == "settled"  # nothing lent since the previous tick
    ack = json.loads((tmp_path / ("report-7.json" + ray_env.SETTLE_ACK)).read_text())
    assert ack["token"] == "token-1" and ack["host"]
    assert _tick_elsewhere(flusher) != "settled"  # one answer per token
    assert triage.retentions() == []
    buf.close()


def test_collect_waits_for_live_workers_within_a_bound_and_not_for_gone_ones(tmp_path, live_pid, capsys,
                                                                             monkeypatch, fresh_triage):
    """A live worker that never answers (no flusher) is waited for answer_s at most and named in one line; a
    report left by a worker that is gone is merged without a wait."""
    import subprocess
    import time

    monkeypatch.delenv("OWNSAN_RUN_REPORT_DIR", raising=False)
    sanitizer.enable(triage=1, halt_on_error=0)
    report = rep.report(final=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / f"report-{gone.pid}.json").write_text(json.dumps(dict(report, pid=gone.pid)))
    start = time.monotonic()
    ray_env.collect(str(tmp_path), settle_s=0, answer_s=5.0)
    assert time.monotonic() - start < 2.0  # not waited for
    assert "did not answer" not in capsys.readouterr().err
    (tmp_path / f"report-{live_pid}.json").write_text(json.dumps(dict(report, pid=live_pid)))
    start = time.monotonic()
    merged = ray_env.collect(str(tmp_path), settle_s=0, answer_s=0.5)
    assert 0.5 <= time.monotonic() - start < 3.0
    assert sorted(p["pid"] for p in merged["processes"]) == sorted([gone.pid, live_pid])
    lines = [line for line in capsys.readouterr().err.splitlines() if "did not answer" in line]
    assert len(lines) == 1 and f"pid {live_pid}" in lines[0] and f"pid {gone.pid}" not in lines[0], lines


def test_collect_on_a_directory_that_does_not_exist_says_so_and_blames_no_killed_process(tmp_path, capsys):
    missing = tmp_path / "ownsan-reprots"
    with pytest.raises(ValueError) as info:
        ray_env.collect(str(missing), settle_s=0)
    assert "no such directory" in str(info.value) and str(missing) in str(info.value)
    err = capsys.readouterr().err
    assert "cannot be read" not in err and "killed" not in err, err
