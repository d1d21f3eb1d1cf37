"""What the zero-code activation hook (ownership_sanitizer.pth) costs every Python start-up.

Prints, side by side in one run:
  1. the .pth line itself, executed in-process with OWNERSHIP_SANITIZE unset and set
     (set: it loads sanitizer/tools/startup.py and puts a finder on sys.meta_path; torch is
     not imported until the program imports it);
  2. interpreter start-up (`python -c pass`) with a site directory holding the .pth vs
     the same site directory without it (median of N runs each, interleaved), unset and set.

Run: python bench/startup_hook.py [--runs 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _load_startup():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_startup", os.path.join(ROOT, "sanitizer", "tools", "startup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def line_cost(pth_line: str) -> tuple:
    code = compile(pth_line, "ownership_sanitizer.pth", "exec")
    saved = os.environ.pop("OWNERSHIP_SANITIZE", None)
    try:
        n = 200_000
        unset = timeit.timeit(lambda: exec(code, {}), number=n) / n
        os.environ["OWNERSHIP_SANITIZE"] = "1"
        sys.modules.pop("_ownership_sanitizer_startup", None)
        start = time.perf_counter()
        exec(code, {})  # first time: loads startup.py, installs the finder
        set_first = time.perf_counter() - start
    finally:
        os.environ.pop("OWNERSHIP_SANITIZE", None)
        if saved is not None:
            os.environ["OWNERSHIP_SANITIZE"] = saved
        mod = sys.modules.get("_ownership_sanitizer_startup")
        if mod is not None and mod._finder is not None:
            mod._remove_finder()
    return unset, set_first


def startup_times(site_with: str, site_without: str, runs: int, env_extra: dict) -> tuple:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    env.update(env_extra)
    with_pth, without = [], []
    for _ in range(runs):  # interleaved, so machine noise hits both alike
        for site_dir, out in ((site_with, with_pth), (site_without, without)):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", f"import site; site.addsitedir({site_dir!r})"], env=env, check=True)
            out.append(time.perf_counter() - start)
    return statistics.median(with_pth), statistics.median(without)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    startup = _load_startup()
    unset, set_first = line_cost(startup.PTH_LINE)
    print(f".pth line, OWNERSHIP_SANITIZE unset: {unset * 1e6:.2f} us per start-up")
    print(f".pth line, OWNERSHIP_SANITIZE=1 (loads startup.py, installs the finder): {set_first * 1e3:.2f} ms")
    with tempfile.TemporaryDirectory() as with_dir, tempfile.TemporaryDirectory() as without_dir:
        startup.install_pth(with_dir)
        for label, extra in (("unset", {}), ("OWNERSHIP_SANITIZE=1", {"OWNERSHIP_SANITIZE": "1"})):
            a, b = startup_times(with_dir, without_dir, args.runs, extra)
            print(f"python start-up, {label}: with the .pth {a * 1e3:.1f} ms, without {b * 1e3:.1f} ms "
                  f"(ratio {a / b:.3f}, difference {(a - b) * 1e3:+.2f} ms; median of {args.runs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
