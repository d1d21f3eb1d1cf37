"""What the per-op stale check costs by itself, at 1, 2, 4 and 16 tensor arguments.

While a lease is stale and retained, the dispatch mode looks every tensor argument's storage up in
the stale set. This prints, side by side in one run (best of interleaved repeats, one torch thread):
  * the op with no mode at all (the physical reference);
  * the op under the project's mode with nothing stale: the floor any Python dispatch mode pays;
  * the op under the same mode with one stale lease (not among the arguments): the check;
and the ratio check / floor (issue 23's target: <= 1.03 at every argument count).
"""
from __future__ import annotations

import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from sanitizer.torch_layer.mode import BorrowCheckMode  # noqa: E402


def _never(*_args) -> None:
    raise AssertionError("no argument of these ops is stale")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    xs = [torch.randn(64) for _ in range(16)]
    kept = torch.empty(1)
    floor = BorrowCheckMode({}, _never)
    check = BorrowCheckMode({kept.untyped_storage()._cdata: object()}, _never)  # a stale lease elsewhere
    ops = {1: lambda: xs[0].neg(), 2: lambda: xs[0] + xs[1], 4: lambda: torch.cat(xs[:4]),
           16: lambda: torch.cat(xs)}
    best: dict = {}
    for _ in range(args.repeat):
        for n, op in ops.items():
            for name, mode in (("none", None), ("floor", floor), ("check", check)):
                if mode is None:
                    seconds = timeit.timeit(op, number=args.number)
                else:
                    with mode:
                        seconds = timeit.timeit(op, number=args.number)
                best[n, name] = min(best.get((n, name), float("inf")), seconds / args.number * 1e6)
    print(f"torch {torch.__version__}, 1 thread; best of {args.repeat} interleaved runs of {args.number}")
    print(f"{'tensor args':>11} {'no mode':>9} {'mode, none stale':>17} {'mode, a stale lease':>20} {'check/floor':>12}")
    worst = 0.0
    for n in ops:
        none, fl, ch = best[n, "none"], best[n, "floor"], best[n, "check"]
        worst = max(worst, ch / fl)
        print(f"{n:>11} {none:7.2f}us {fl:8.2f}us {fl / none:5.2f}x {ch:10.2f}us {ch / none:5.2f}x {ch / fl:11.3f}x")
    per_arg = ((best[16, "check"] - best[16, "floor"]) - (best[1, "check"] - best[1, "floor"])) / 15
    print(f"per extra tensor argument: {per_arg * 1e3:.0f} ns")
    print(f"TARGET check/floor <= 1.03 at every count: worst {worst:.3f}x: {'ok' if worst <= 1.03 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
