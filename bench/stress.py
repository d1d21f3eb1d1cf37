"""Stress the mode placement: exits with thread pools, workers, the user's own modes.

  * ``--runs`` programs (default 200) that start an 8-worker ThreadPoolExecutor
    doing tiny ops with the sanitizer enabled and no lease: every one must exit 0
    (before the placement rules, about 1 in 6 died with SIGABRT at exit);
  * ``--rounds`` pipelines where a worker drops the last live lease, then reads a
    stale one: every read must be caught;
  * lends inside and outside FlopCounterMode, a logging mode, FakeTensorMode and
    ``torch.compile``: the user's stack unchanged after their block, stale reads caught;
  * ``--race-runs`` programs per variant (default 200) where 4 threads under a Python mode, at a
    switch interval of 1 µs, run ops whose Python object torch.ops has not built yet, all at
    once (safetensors' ``get_tensor``: ``torch.asarray(storage[a:b])``; issue 17). With the
    sanitizer every run must end well with no op object built twice; the controls (a do-nothing
    mode pushed raw, with and without torch's dynamo-disable shim, with and without the
    sanitizer's look-up lock) show what the race does without it. ``--race-against DIR`` adds
    the sanitizer row for another checkout (older code). About 2 s of CPU per run.

  * ``--soak-runs`` runs per start method (default 10; spawn, forkserver, fork) of one program that does
    everything at once under ``ownsan run``: 4 threads reading stale views, a forked child with threads
    of its own, a ``with Pool(2)`` that ends with ``terminate()``, and a real loader (safetensors through
    a strict ring, when installed); each run's merged report must hold every stale read it made.

Exit status 0 only when all hold. The CI runs a short version (tests/torch_layer/test_mode_placement.py,
tests/torch_layer/test_mode_stress.py).
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
    ap.add_argument("--race-runs", type=int, default=200, help="op look-up race programs per variant (0: none)")
    ap.add_argument("--race-variants", default=",".join(stress.LOOKUP_RACE_VARIANTS),
                    help="comma-separated, of: " + ", ".join(stress.LOOKUP_RACE_VARIANTS))
    ap.add_argument("--race-against", metavar="DIR", help="also run the sanitizer variant from this checkout")
    ap.add_argument("--only-race", action="store_true", help="run the op look-up race section alone")
    ap.add_argument("--soak-runs", type=int, default=10, help="soak runs per start method (0: none)")
    ap.add_argument("--only-soak", action="store_true", help="run the soak section alone")
    args = ap.parse_args(argv)
    ok = True
    if args.race_runs and not args.only_soak:
        ok &= lookup_race(args)
    if args.only_race:
        print("ALL HOLD" if ok else "FAILED")
        return 0 if ok else 1

    if args.soak_runs:
        ok &= soak(args)
    if args.only_soak:
        print("ALL HOLD" if ok else "FAILED")
        return 0 if ok else 1

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


def soak(args) -> bool:
    """Threads x a fork x a terminated pool x a real loader: every run's report whole, per start method."""
    import multiprocessing
    import tempfile

    methods = [m for m in ("spawn", "forkserver", "fork") if m in multiprocessing.get_all_start_methods()]
    with tempfile.TemporaryDirectory(prefix="ownsan-soak-") as tmp:
        t0 = time.perf_counter()
        result = stress.run_soak(args.soak_runs, methods, tmp)
    print(f"soak (threads x fork x Pool.terminate() x safetensors ring; {time.perf_counter() - t0:.0f} s):")
    good = True
    for method, r in result.items():
        print(f"  {method:<10} {r['whole']}/{r['runs']} runs with every stale read reported ({r['s_per_run']} s a run)")
        for f in r["failures"]:
            print("     ", f)
        good &= r["whole"] == r["runs"]
    return good


def lookup_race(args) -> bool:
    """The op look-up race section: True when every sanitized run ended well."""
    variants = [v.strip() for v in args.race_variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in stress.LOOKUP_RACE_VARIANTS]
    if unknown:
        raise SystemExit(f"--race-variants: unknown {unknown}; choose from {', '.join(stress.LOOKUP_RACE_VARIANTS)}")
    rows = [(v, None) for v in variants]
    if args.race_against:
        rows.insert(0, ("sanitizer", os.path.abspath(args.race_against)))
    ok = True
    print(f"op look-up race: {args.race_runs} runs per row, 4 threads, switch interval 1 us")
    print(f"  {'variant':<26} {'tree':<28} {'crashed':>7} {'raced':>6} {'errors':>6} {'hung':>5} {'ok':>5}  s/run")
    for variant, root in rows:
        t0 = time.perf_counter()
        r = stress.run_lookup_race(args.race_runs, variant, parallel=args.parallel, root=root)
        per_run = (time.perf_counter() - t0) / args.race_runs * args.parallel
        tree = root or "this checkout"
        print(f"  {variant:<26} {tree[-28:]:<28} {r['crashed']:>7} {r['raced']:>6} {r['errors']:>6} "
              f"{r['hung']:>5} {r['ok']:>5}  {per_run:.1f}"
              + (f"  ({r['nothing_to_race']} had nothing to race)" if r["nothing_to_race"] else ""))
        for f in r["failures"][:2]:
            print("     ", f)
        bad = r["runs"] - r["ok"]
        if variant.endswith("-serialized") or (variant == "sanitizer" and root is None):
            ok &= bad == 0  # the fix: no run may crash, race, raise, hang, or test nothing
    return ok


if __name__ == "__main__":
    sys.exit(main())
