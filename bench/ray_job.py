"""A correct Ray job, sanitized through ``sanitizer.tools.ray_env`` and not, side by side (issue 49).

The job: 4 tasks and 1 actor call on a local Ray of ``--cpus`` CPUs (2 by default, one CPU each), each call
``--lends`` times lend, fill, ``(v @ v).clone()``, reuse: nothing kept. Each job is a driver process of its
own (``ray.init``, the calls, then for the sanitized one ``collect()``, ``ray.shutdown()``); the two kinds of
job alternate, ``--repeat`` times each, and the best of each is compared. Printed per kind: the calls' wall
time (from submitting them to the last ``ray.get``: worker start-up and torch's import included, as a job
pays them), the slowest call's own loop time, and the intra-op threads torch ran with in the workers (a
worker hook that imported torch before Ray set ``OMP_NUM_THREADS`` ran every 1-CPU worker with all the
node's threads: 21-100x slower on 2 cores). Then ``--jobs`` sanitized jobs count the retentions their merged
reports hold (a correct job has none). The unsanitized job lends plain views of the same buffer (what a
loader hands out without the sanitizer)::

    python bench/ray_job.py                      # 3 + 3 timed jobs, then 20 counted
    python bench/ray_job.py --repeat 5 --jobs 0
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = textwrap.dedent('''
    import json, os, sys, time
    import ray

    mode, reports, lends, cpus = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    path = {"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
    if mode == "sanitized":
        from sanitizer.tools.ray_env import runtime_env, collect
        env = runtime_env(reports, base=path)
    else:
        env = path
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, runtime_env=env)

    def correct(n):
        import torch
        nbytes = 64 * 64 * 4
        if os.environ.get("OWNERSHIP_SANITIZE"):
            import sanitizer
            buf = sanitizer.StagingBuffer(nbytes, name="staging")
            reuse, lend = buf.reuse, buf.lend
        else:  # the same loop as a loader without the sanitizer runs it: plain views of one buffer
            data = torch.empty(nbytes, dtype=torch.uint8)
            reuse = lambda offset, size, by=None: None
            lend = lambda offset, shape, dtype, name=None: data[offset:offset + nbytes].view(dtype).view(shape)
        t0 = time.perf_counter()
        for i in range(n):
            reuse(0, nbytes, by=f"w{i}")
            v = lend(0, (64, 64), torch.float32, name=f"w{i}")
            v.fill_(float(i % 7))
            (v @ v).clone()
        return [time.perf_counter() - t0, torch.get_num_threads()]

    @ray.remote(num_cpus=1)
    def task(n):
        return correct(n)

    @ray.remote(num_cpus=1)
    class Actor:
        def run(self, n):
            return correct(n)

    t0 = time.perf_counter()
    actor = Actor.remote()
    calls = ray.get([task.remote(lends) for _ in range(4)] + [actor.run.remote(lends)])
    wall = time.perf_counter() - t0
    out = {"wall": wall, "loops": [c[0] for c in calls], "threads": sorted({c[1] for c in calls})}
    if mode == "sanitized":
        merged = collect(reports, settle_s=2.0)
        kept = [e for e in merged["events"] if e.get("kind") == "retention"]
        out["retentions"] = len(kept)
        out["examples"] = [e["summary"] for e in kept[:2]]
        out["errors"] = len(merged["errors"])
    ray.shutdown()
    print("RESULT " + json.dumps(out))
''')


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def run_job(mode: str, lends: int, cpus: int) -> Dict[str, Any]:
    """One job in a driver process of its own (its own ray.init), with a fresh report directory."""
    reports = tempfile.mkdtemp(prefix="ownsan-ray-bench-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env.update(PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p),
               RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    try:
        proc = subprocess.run([sys.executable, "-c", DRIVER, mode, reports, str(lends), str(cpus)], env=env,
                              capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(reports, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the {mode} job failed (status {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lends", type=int, default=4000, help="lends per call (default 4000)")
    parser.add_argument("--repeat", type=int, default=3, help="timed jobs of each kind, alternating (default 3)")
    parser.add_argument("--jobs", type=int, default=20, help="sanitized jobs whose retentions are counted "
                                                             "(default 20; the timed ones count too)")
    parser.add_argument("--cpus", type=int, default=2, help="Ray's num_cpus (default 2)")
    args = parser.parse_args()
    import ray  # (only to say which; the jobs import it in their own drivers)

    print(f"Ray {ray.__version__}, Python {sys.version.split()[0]}; {machine_load()}")
    print(f"a correct job: 4 tasks + 1 actor call, {args.lends:,} lends each, on Ray with num_cpus={args.cpus}")
    timed: Dict[str, List[Dict[str, Any]]] = {"plain": [], "sanitized": []}
    for _ in range(args.repeat):
        for mode in ("plain", "sanitized"):
            timed[mode].append(run_job(mode, args.lends, args.cpus))
    best = {mode: min(runs, key=lambda r: r["wall"]) for mode, runs in timed.items()}
    print(f"\n{'job':<11} {'calls wall s':>12} {'slowest loop s':>15} {'threads':>8}   (best of {args.repeat}, interleaved)")
    for mode in ("plain", "sanitized"):
        r = best[mode]
        print(f"{mode:<11} {r['wall']:>12.2f} {max(r['loops']):>15.2f} {','.join(map(str, r['threads'])):>8}")
    print(f"sanitized / plain: calls wall {best['sanitized']['wall'] / best['plain']['wall']:.2f}x, slowest loop "
          f"{max(best['sanitized']['loops']) / max(best['plain']['loops']):.2f}x")
    counted = list(timed["sanitized"])
    while len(counted) < args.jobs:
        counted.append(run_job("sanitized", args.lends, args.cpus))
    retentions = sum(r["retentions"] for r in counted)
    print(f"\nretentions in {len(counted)} sanitized jobs: {retentions} "
          f"(per job: {[r['retentions'] for r in counted]}); errors: {sum(r['errors'] for r in counted)}")
    for example in next((r["examples"] for r in counted if r["examples"]), []):
        print(f"  e.g. {example}")
    print(machine_load())


if __name__ == "__main__":
    main()
