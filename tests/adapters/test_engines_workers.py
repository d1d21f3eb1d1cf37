"""Every worker process of an engine's load: multiprocessing (spawn) and torchrun under ``ownsan run``, Ray
through ``sanitizer.tools.ray_env`` (skips without ray). Each worker loads through a real borrowing loader
(runai-model-streamer 0.17 with ``owned=False``: the installed test extra) and keeps every tensor; the merged
report must hold every worker's findings, each naming its process and rank.
(multiprocessing *fork* workers that leave through ``os._exit`` are issue 17's.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
runai = pytest.importorskip("runai_model_streamer", reason="runai-model-streamer is not installed (test extra)")

WORKER = textwrap.dedent('''
    import os, sys
    import torch
    from safetensors.torch import save_file

    KEPT = {}

    def load(rank, directory):
        """One worker's load: its own shard through the streamer (owned=False), every tensor kept."""
        os.environ.setdefault("RANK", str(rank))
        from runai_model_streamer import SafetensorsStreamer
        path = os.path.join(directory, f"rank{rank}.safetensors")
        save_file({f"rank{rank}.layers.{i}.weight": torch.full((32, 32), float(i)) for i in range(4)}, path)
        with SafetensorsStreamer() as streamer:
            streamer.stream_files([path], device="cpu", owned=False)
            for name, tensor in streamer.get_tensors():
                KEPT[name] = tensor
        return sum(float(t.sum()) for t in KEPT.values())  # read after the loop: stale

    if __name__ == "__main__":
        mode, directory = sys.argv[1], sys.argv[2]
        if mode == "spawn":
            import multiprocessing as mp
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=load, args=(rank, directory)) for rank in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join()
            print("exit codes", [p.exitcode for p in procs])
        else:  # torchrun: RANK comes from the launcher
            print("total", load(int(os.environ["RANK"]), directory))
''')


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    env.update(RUNAI_STREAMER_MEMORY_LIMIT=str(8 << 10), RUNAI_STREAMER_LOG_LEVEL="WARNING", **extra)
    return env


def _ownsan_run(tmp_path, *command):
    (tmp_path / "worker.py").write_text(WORKER)
    report = tmp_path / "merged.json"
    proc = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-q", "--report", str(report), "--", *command],
                          cwd=str(tmp_path), env=_env(), capture_output=True, text=True, timeout=300)
    with open(report, encoding="utf-8") as fh:
        return proc, json.load(fh)


def _assert_every_rank_named(rep, ranks=(0, 1)):
    for rank in ranks:
        names = {f"rank{rank}.layers.{i}.weight" for i in range(4)}
        mine = [e for e in rep["events"] if e.get("kind") == "retention" and e["lease"]["name"] in names]
        assert {e["lease"]["name"] for e in mine} == names, (rank, [e["lease"]["name"] for e in mine])
        assert all(e["rank"] == rank and e["process"] == f"rank {rank} (pid {e['pid']})" for e in mine)
        stale = [e for e in rep["errors"] if e["kind"] == "stale_use" and e["lease"]["name"] in names]
        assert stale and all(e["rank"] == rank for e in stale)
        assert all("KEPT" in (e["holder"] or {}).get("path", "") for e in mine)
    labels = {label for g in rep["summary"]["retaining_consumers"] for label in g["processes"]}
    assert {label.split(" (")[0] for label in labels} >= {f"rank {r}" for r in ranks}


@pytest.mark.slow
def test_spawned_workers_under_ownsan_run_are_each_named(tmp_path):
    proc, rep = _ownsan_run(tmp_path, sys.executable, "worker.py", "spawn", str(tmp_path))
    assert "exit codes [0, 0]" in proc.stdout, proc.stderr[-3000:]
    assert proc.returncode == 1  # retentions and stale reads: the run fails
    assert len({p["pid"] for p in rep["processes"]}) >= 3  # the parent and both workers wrote reports
    _assert_every_rank_named(rep)


@pytest.mark.slow
def test_torchrun_ranks_under_ownsan_run_are_each_named(tmp_path):
    proc, rep = _ownsan_run(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "2", "worker.py", "torchrun", str(tmp_path))
    assert proc.stdout.count("total") == 2, proc.stderr[-3000:]
    assert sorted(p["rank"] for p in rep["processes"] if p["rank"] is not None) == [0, 1]
    _assert_every_rank_named(rep)


RAY_DRIVER = textwrap.dedent('''
    import json, os, sys
    import ray
    from sanitizer.tools.ray_env import runtime_env, collect

    directory, reports = sys.argv[1], sys.argv[2]
    sys.path.insert(0, directory)
    env = runtime_env(reports, base={"env_vars": {"RUNAI_STREAMER_MEMORY_LIMIT": str(8 << 10),
                                                  "RUNAI_STREAMER_LOG_LEVEL": "WARNING",
                                                  "PYTHONPATH": os.pathsep.join([directory, os.environ["PYTHONPATH"]])}})
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=env, log_to_driver=False)
    import worker

    @ray.remote
    def load_task(rank):
        return worker.load(rank, directory)

    @ray.remote
    class Loader:
        def load(self, rank):
            return worker.load(rank, directory)

    rank1 = runtime_env(reports, base={"env_vars": {**env["env_vars"], "RANK": "1"}})
    loader = Loader.options(runtime_env=rank1).remote()
    print("totals", ray.get([load_task.remote(0), loader.load.remote(1)]))
    merged = collect(reports, settle_s=3.0, out=os.path.join(directory, "merged.json"))  # before shutdown
    ray.shutdown()  # Ray kills its workers (SIGKILL): only the reports their flushers wrote are left
    print("processes", len(merged["processes"]))
''')


@pytest.mark.slow
def test_ray_workers_get_the_sanitizer_from_runtime_env_and_their_reports_merge(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed here (pip install ray to run this test)")
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "driver.py").write_text(RAY_DRIVER)
    env = _env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "driver.py", str(tmp_path), str(tmp_path / "reports")], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "totals" in proc.stdout, proc.stderr[-4000:]
    rep = json.loads((tmp_path / "merged.json").read_text())
    # the driver never imported torch: every report is a worker's; rank 1 is the actor's (RANK in its env)
    names0 = {f"rank0.layers.{i}.weight" for i in range(4)}
    task = [e for e in rep["events"] if e.get("kind") == "retention" and e["lease"]["name"] in names0]
    assert {e["lease"]["name"] for e in task} == names0 and all(e["process"].startswith("pid ") or
                                                                 e["process"].startswith("rank 0") for e in task)
    names1 = {f"rank1.layers.{i}.weight" for i in range(4)}
    actor = [e for e in rep["events"] if e.get("kind") == "retention" and e["lease"]["name"] in names1]
    assert {e["lease"]["name"] for e in actor} == names1 and all(e["rank"] == 1 for e in actor)
    assert {e["pid"] for e in task}.isdisjoint({e["pid"] for e in actor})
    stale = {e["lease"]["name"] for e in rep["errors"] if e["kind"] == "stale_use"}
    assert stale == names0 | names1  # every kept tensor was read stale after its worker's loop


RAY_CORRECT_DRIVER = textwrap.dedent('''
    import json, os, sys
    import ray
    from sanitizer.tools.ray_env import runtime_env, collect

    reports, lends = sys.argv[1], int(sys.argv[2])
    path = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    env = runtime_env(reports, base=path)

    def correct(n):  # lend, fill, use, reuse: nothing kept; the intra-op threads torch runs with here
        import torch, sanitizer
        buf = sanitizer.StagingBuffer(64 * 64 * 4, name="staging")
        for i in range(n):
            buf.reuse(0, 64 * 64 * 4, by=f"w{i}")
            v = buf.lend(0, (64, 64), torch.float32, name=f"w{i}")
            v.fill_(float(i % 7))
            (v @ v).clone()
        return torch.get_num_threads()

    def keeps(name):  # one view kept past its reuse and read: a retention and a stale use
        import torch, sanitizer
        buf = sanitizer.StagingBuffer(64, name="staging")
        kept = [buf.lend(0, (4,), torch.float32, name=name)]
        buf.reuse(0, 64, by="next")
        float(kept[0].sum())
        return [sanitizer.enabled(), len(sanitizer.errors())]

    @ray.remote(num_cpus=1)
    def task(n):
        return correct(n)

    @ray.remote(num_cpus=1)
    def bad_task():
        return keeps("task-kept")

    @ray.remote(num_cpus=1)
    class Actor:
        def run(self, n):
            return correct(n)

        def bad(self):
            return keeps("actor-kept")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=path)
    plain = ray.get(task.remote(10))  # without the recipe: the threads Ray gives a 1-CPU worker
    ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=env)
    actor = Actor.options(runtime_env={"env_vars": {"RANK": "1"}}).remote()
    sanitized = ray.get([task.remote(lends) for _ in range(4)] + [actor.run.remote(lends)])
    bad = ray.get([bad_task.remote(), actor.bad.remote()])
    print("result", json.dumps({"plain": plain, "sanitized": sanitized, "bad": bad}))
    collect(reports, settle_s=3.0, out=os.path.join(reports, "merged.json"))
    ray.shutdown()
''')


@pytest.mark.slow
def test_ray_recipe_keeps_each_workers_threads_and_decides_no_retention_in_a_correct_job(tmp_path):
    # (issue 49) The worker hook imported torch before Ray set OMP_NUM_THREADS: every 1-CPU worker ran the
    # node's cores' threads (21-100x slower on 2 cores). A correct job (4 tasks + an actor, 4,000 lends each)
    # reported retentions nothing held (the flusher's idle write in the middle of a loop); an actor's stale
    # use was sometimes missing beside its retention (the flusher took what was filed during a write as
    # written). tests/tools/test_ray_flusher.py has each race without Ray.
    pytest.importorskip("ray", reason="ray is not installed here (pip install ray to run this test)")
    (tmp_path / "driver.py").write_text(RAY_CORRECT_DRIVER)
    reports = tmp_path / "reports"
    env = _env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "driver.py", str(reports), "4000"], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "result" in proc.stdout, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("result", 1)[1].strip().splitlines()[0])
    assert result["sanitized"] == [result["plain"]] * 5, result  # the same threads with the recipe as without
    assert result["bad"] == [[True, 1], [True, 1]], result  # the sanitizer is on, and catches a stale use
    rep = json.loads((reports / "merged.json").read_text())
    retentions = sorted(e["lease"]["name"] for e in rep["events"] if e.get("kind") == "retention")
    assert retentions == ["actor-kept", "task-kept"], [e["summary"] for e in rep["events"]
                                                         if e.get("kind") == "retention"]
    stale = {e["lease"]["name"]: e for e in rep["errors"] if e["kind"] == "stale_use"}
    assert sorted(stale) == ["actor-kept", "task-kept"]
    assert stale["actor-kept"]["rank"] == 1


RAY_PER_TASK_DRIVER = textwrap.dedent('''
    import json, os, sys
    import ray
    from sanitizer.tools.ray_env import runtime_env, collect

    reports = sys.argv[1]
    env = runtime_env(reports, base={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})

    @ray.remote(num_cpus=1)
    def keeps():  # one view kept past its reuse and read: a retention and a stale use
        import torch, sanitizer
        buf = sanitizer.StagingBuffer(64, name="staging")
        kept = [buf.lend(0, (4,), torch.float32, name="per-task-kept")]
        buf.reuse(0, 64, by="next")
        float(kept[0].sum())
        return [sanitizer.enabled(), len(sanitizer.errors()), torch.get_num_threads()]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    print("result", json.dumps(ray.get(keeps.options(runtime_env=env).remote())))
    collect(reports, settle_s=3.0, out=os.path.join(reports, "merged.json"))
    ray.shutdown()
''')


@pytest.mark.slow
def test_ray_recipe_given_per_task_only_still_sanitizes_that_task_and_reports_it(tmp_path):
    # Ray runs a worker_process_setup_hook only from the job's runtime_env: a runtime_env given to one task
    # alone reached that worker's environment but no hook, and its request (under names of its own, so the
    # hook's import does not bring torch in early) switched nothing on. The start-up hook takes it now.
    pytest.importorskip("ray", reason="ray is not installed here (pip install ray to run this test)")
    (tmp_path / "driver.py").write_text(RAY_PER_TASK_DRIVER)
    reports = tmp_path / "reports"
    env = _env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "driver.py", str(reports)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "result" in proc.stdout, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("result", 1)[1].strip().splitlines()[0])
    assert result == [True, 1, 1], result  # on, the stale use caught, and the 1-CPU worker's one thread
    rep = json.loads((reports / "merged.json").read_text())
    assert [e["lease"]["name"] for e in rep["errors"] if e["kind"] == "stale_use"] == ["per-task-kept"]
    assert [e["lease"]["name"] for e in rep["events"] if e.get("kind") == "retention"] == ["per-task-kept"]


def test_runtime_env_refuses_bad_input_by_name(tmp_path):
    from sanitizer.core.options import OptionError
    from sanitizer.tools.ray_env import SETUP_HOOK, runtime_env

    env = runtime_env(str(tmp_path / "r"), options={"checksum": True}, base={"env_vars": {"A": "1"},
                                                                           "worker_process_setup_hook": "m.f"})
    assert env["worker_process_setup_hook"] == SETUP_HOOK and env["env_vars"]["A"] == "1"
    assert env["env_vars"]["OWNSAN_RAY_USER_SETUP_HOOK"] == "m.f"
    assert "checksum=1" in env["env_vars"]["OWNSAN_RAY_OPTIONS"]
    assert "triage=1" in env["env_vars"]["OWNSAN_RAY_OPTIONS"]
    with pytest.raises(OptionError, match="stack_dept"):
        runtime_env(str(tmp_path), options={"stack_dept": 4})
    with pytest.raises(ValueError, match="'report' is set by runtime_env"):
        runtime_env(str(tmp_path), options={"report": "x.json"})
    with pytest.raises(ValueError, match="flush_interval_s"):
        runtime_env(str(tmp_path), flush_interval_s=0)


RAY_ACTOR_KEEPS_DRIVER = textwrap.dedent('''
    import json, os, sys
    import ray
    from sanitizer.tools.ray_env import runtime_env, collect

    reports = sys.argv[1]
    env = runtime_env(reports, base={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})

    @ray.remote(num_cpus=1)
    class Actor:
        def load(self):  # keeps a view past its reuse and never reads it: a retention, no error
            import torch, sanitizer
            self.buf = sanitizer.StagingBuffer(64, name="staging")
            self.kept = self.buf.lend(0, (4,), torch.float32, name="actor-kept")
            self.buf.reuse(0, 64, by="next")
            return sanitizer.enabled()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=env)
    actor = Actor.remote()
    print("result", json.dumps(ray.get(actor.load.remote())))
    collect(reports, out=os.path.join(reports, "merged.json"))  # right after the last ray.get, as the recipe
    ray.shutdown()
''')


@pytest.mark.slow
def test_ray_collect_right_after_the_last_get_counts_an_actors_last_retention(tmp_path):
    # collect() read the reports after settle_s (1 s) while the actor's kept view was still pending: its flusher
    # writes as at exit only after 4 idle intervals (2 s). "no retentions, (1 still pending)", 3 runs of 3.
    pytest.importorskip("ray", reason="ray is not installed here (pip install ray to run this test)")
    (tmp_path / "driver.py").write_text(RAY_ACTOR_KEEPS_DRIVER)
    reports = tmp_path / "reports"
    env = _env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "driver.py", str(reports)], cwd=str(tmp_path), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "result true" in proc.stdout, proc.stderr[-4000:]
    assert "did not answer" not in proc.stderr, proc.stderr[-4000:]
    rep = json.loads((reports / "merged.json").read_text())
    assert [e["lease"]["name"] for e in rep["events"] if e.get("kind") == "retention"] == ["actor-kept"], \
        rep["summary"]
