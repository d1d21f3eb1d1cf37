"""Stress the mode placement: exits with thread pools, workers, the user's own modes.

  * ``--runs`` programs (default 200) that start an 8-worker ThreadPoolExecutor
    doing tiny ops with the sanitizer enabled and no lease: every one must exit 0
    (before the placement rules, about 1 in 6 died with SIGABRT at exit);
  * ``--rounds`` pipelines where a worker drops the last live lease, then reads a
    stale one: every read must be caught;
  * lends inside and outside FlopCounterMode, a logging mode, FakeTensorMode and
    ``torch.compile``: the user's stack unchanged after their block, stale reads caught.

Exit status 0 only when all hold. The CI runs a short version (tests/test_mode_placement.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sanitizer  # noqa: E402
from sanitizer.testing import stress  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200, help="thread-pool programs to run to exit")
    ap.add_argument("--parallel", type=int, default=max(1, (os.cpu_count() or 2)), help="programs at once")
    ap.add_argument("--rounds", type=int, default=200, help="worker pipelines")
    args = ap.parse_args(argv)
    ok = True

    t0 = time.perf_counter()
    exits = stress.run_pool_exits(args.runs, parallel=args.parallel)
    print(f"pool programs: {exits['runs']} runs, {exits['abnormal']} abnormal exits "
          f"({time.perf_counter() - t0:.1f} s)")
    for f in exits["failures"]:
        print("   ", f)
    ok &= exits["abnormal"] == 0

    sanitizer.enable(halt_on_error=1)
    t0 = time.perf_counter()
    pipes = stress.worker_drops_last_lease_then_reads_stale(args.rounds)
    print(f"worker pipelines: {pipes['rounds']} rounds, {pipes['caught']} caught, {pipes['missed']} missed "
          f"({time.perf_counter() - t0:.1f} s)")
    ok &= pipes["missed"] == 0 and pipes["caught"] == pipes["rounds"]

    modes = stress.lends_inside_and_outside_user_modes()
    modes["torch.compile"] = stress.compile_with_lease_alive()
    print("user modes:", json.dumps(modes, indent=1))
    ok &= all(r.get("stack_unchanged") and r.get("stale_read_caught") and r.get("compiled", True)
              for r in modes.values())
    print("ALL HOLD" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
