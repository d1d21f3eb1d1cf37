"""``ownsan run`` around each kind of worker (issue 49, points 3 and 5): a stale use in any DataLoader
worker, torchrun rank or Ray worker fails the run, and the printed summary names the worker or rank that
kept the views (the header never claims the first report's rank for all). Torch only: each worker keeps
the views ``emulate_borrowed`` lends it and reads them after its loop."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DATALOADER = textwrap.dedent('''
    import torch, sanitizer
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    KEPT = []
    class Shards(IterableDataset):
        def __iter__(self):
            wid = get_worker_info().id
            source = ((f"w{wid}.t{i}", torch.full((16,), float(i))) for i in range(4))
            for name, t in sanitizer.emulate_borrowed(source, 256, lifetime=1):
                if wid == 1:  # only worker 1 keeps its views
                    KEPT.append(t)
                yield float(t.sum())
            if wid == 1:
                print("stale", sum(float(k.sum()) for k in KEPT))
    if __name__ == "__main__":
        print(list(DataLoader(Shards(), num_workers=2, batch_size=None)))
''')

TORCHRUN = textwrap.dedent('''
    import torch, torch.distributed as dist, sanitizer
    dist.init_process_group("gloo")
    KEPT = []
    source = ((f"r{dist.get_rank()}.t{i}", torch.full((16,), float(i))) for i in range(4))
    for name, t in sanitizer.emulate_borrowed(source, 256, lifetime=1):
        if dist.get_rank() == 1:  # only rank 1 keeps its views
            KEPT.append(t)
    if dist.get_rank() == 1:
        print("stale", sum(float(k.sum()) for k in KEPT))
    dist.barrier()
    dist.destroy_process_group()
''')

RAY = textwrap.dedent('''
    import os, sys
    import ray
    from sanitizer.tools.ray_env import runtime_env, collect

    reports = sys.argv[1]
    env = runtime_env(reports, base={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=env, log_to_driver=False)

    def load(tag):
        import torch, sanitizer
        kept = []
        source = ((f"{tag}.t{i}", torch.full((16,), float(i))) for i in range(4))
        for name, t in sanitizer.emulate_borrowed(source, 256, lifetime=1):
            kept.append(t)
        return sum(float(k.sum()) for k in kept)  # read after the loop: stale

    @ray.remote
    def task():
        return load("task")

    @ray.remote
    class Loader:
        def load(self):
            return load("actor")

    loader = Loader.remote()
    print("totals", ray.get([task.remote(), loader.load.remote()]))
    merged = collect(reports, settle_s=3.0)  # the documented recipe: after the last ray.get, before shutdown
    ray.shutdown()
    print("collected", merged["error_count"])
''')


def _ownsan_run(tmp_path, script: str, *command: str, **env_extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "prog.py").write_text(script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OWNERSHIP_SANITIZE", "OWNSAN_"))}
    env.update(PYTHONPATH=ROOT, **env_extra)
    return subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(tmp_path / "merged.json"), "--",
                           *command], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)


def _header(err: str) -> str:
    return next(line for line in err.splitlines() if line.startswith("report: "))


@pytest.mark.slow
def test_a_dataloader_workers_stale_use_fails_the_run_and_names_the_worker(tmp_path):
    proc = _ownsan_run(tmp_path, DATALOADER, sys.executable, "prog.py")
    assert "stale" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "DataLoader worker 0 (pid" in _header(proc.stderr) and "DataLoader worker 1 (pid" in _header(proc.stderr)
    assert "kept in DataLoader worker 1 (pid" in proc.stderr and "    in DataLoader worker 1 (pid" in proc.stderr


@pytest.mark.slow
def test_a_torchrun_ranks_stale_use_names_that_rank_not_the_first(tmp_path):
    proc = _ownsan_run(tmp_path, TORCHRUN, sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node", "2", "prog.py")
    assert proc.returncode == 1, proc.stderr[-3000:]
    header = _header(proc.stderr)
    assert "3 processes: rank 0 (pid" in header and "rank 1 (pid" in header and "rank 0 of 2" not in header
    assert "kept in rank 1 (pid" in proc.stderr and "    in rank 1 (pid" in proc.stderr


@pytest.mark.slow
def test_ray_workers_findings_fail_ownsan_run_with_the_documented_recipe(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed here (pip install ray to run this test)")
    proc = _ownsan_run(tmp_path, RAY, sys.executable, "prog.py", str(tmp_path / "reports"),
                       RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    assert "totals" in proc.stdout, proc.stderr[-4000:]
    assert proc.returncode == 1, proc.stderr[-4000:]  # it exited 0, "0 errors; no retentions"
    assert "8 errors (8 stale_use)" in proc.stderr, proc.stderr[-4000:]  # each worker's 4, counted once
    assert "Ray worker" in _header(proc.stderr) and ", actor " in proc.stderr and ", tasks (pid" in proc.stderr
    kept = next(line for line in proc.stderr.splitlines() if "kept in " in line)
    assert kept.count("Ray worker") == 2, kept


@pytest.mark.slow
def test_a_ray_job_that_never_calls_collect_still_fails_ownsan_run(tmp_path):
    # The recipe redirects the workers' reports to its own directory: without collect() the run printed
    # "0 errors; no retentions" and exited 0. runtime_env leaves the run a pointer to it now.
    pytest.importorskip("ray", reason="ray is not installed here (pip install ray to run this test)")
    script = RAY.replace("merged = collect(reports, settle_s=3.0)", "import time; time.sleep(3.0)  # no collect()")
    script = script.replace('print("collected", merged["error_count"])', "")
    assert "collect(reports" not in script
    proc = _ownsan_run(tmp_path, script, sys.executable, "prog.py", str(tmp_path / "reports"),
                       RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    assert "totals" in proc.stdout, proc.stderr[-4000:]
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "8 errors (8 stale_use)" in proc.stderr, proc.stderr[-4000:]
    never = [line for line in proc.stderr.splitlines() if "were never collected" in line]
    assert len(never) == 1 and str(tmp_path / "reports") in never[0], proc.stderr[-4000:]
