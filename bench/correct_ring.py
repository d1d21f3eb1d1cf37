"""A correct ring load's cost per put, sanitizer off / on / triage=1 (issue 47: naming at the reuse).

A one-view ring, so every put retires the view the loop variable still holds (the worst case for the naming
done at a reuse), and a consumer that copies each view into one of 1,000 owned tensors kept in a local dict
beside the loop (the containers a retire looks the victim up in, under ``triage=1``). Prints microseconds per
put, the best of three loads of 20,000 puts, each mode in a fresh process::

    python bench/correct_ring.py            # this checkout
    python bench/correct_ring.py OTHER_DIR  # another checkout (a git worktree of an older commit), side by side
"""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOAD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import torch, sanitizer
mode = sys.argv[2]
if mode != "off":
    sanitizer.enable(triage=(mode == "triage"), halt_on_error=0, report="")
ring = sanitizer.StagingRing(4096, name="one")
def load(n):
    params = {f"p{i}": torch.zeros(1024) for i in range(1000)}
    order = list(params)
    src = torch.ones(1024)
    t0 = time.perf_counter()
    for i in range(n):
        w = ring.put(f"p{i % 1000}", src)
        params[order[i % 1000]].copy_(w)
    return time.perf_counter() - t0
load(2000)
print(min(load(20000) for _ in range(3)) / 20000 * 1e6)
"""


def main() -> None:
    roots = [ROOT] + sys.argv[1:]
    print("us per put of a correct one-view ring load (best of 3 x 20,000 puts, a fresh process each)")
    print(f"{'checkout':<40} {'off':>8} {'on':>8} {'triage':>8}")
    for root in roots:
        row = []
        for mode in ("off", "on", "triage"):
            out = subprocess.run([sys.executable, "-c", _LOAD, root, mode], capture_output=True, text=True, timeout=600)
            row.append(f"{float(out.stdout.strip().splitlines()[-1]):8.1f}" if out.returncode == 0 else "  failed")
        print(f"{root[-40:]:<40} {' '.join(row)}")


if __name__ == "__main__":
    main()
