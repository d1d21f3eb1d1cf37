"""What a user feels: a whole checkpoint load, sanitized in each mode vs off (issue 52).

Each (checkpoint, mode) is one fresh Python process that imports torch and the package as a
user's program does (the mode is set in the environment before the import), builds the
model's parameters, and loads the checkpoint as transformers does: ``safe_open`` +
``get_tensor`` + ``param.copy_``. The child prints the load's seconds and a digest of every
parameter's bytes (no mode may change a result: all digests must agree). Modes run
interleaved, round by round, so machine noise hits all alike; the best of ``--reps`` rounds
is the figure, and the machine's load average is printed beside it.

Checkpoints (generated once under ``--dir``):

* ``llm``: shaped like an LLM's: 1 embedding + ``--layers`` layers of 9 tensors (norms of a
  few KB, projections of a few MB), bf16, two shards: 217 tensors, 0.59 GiB by default;
* ``big``: 2 layers of hidden 4096 (projections of 32-88 MiB, the size where the CPU hash goes
  parallel), 19 tensors, 1.0 GiB;
* ``100k``: 100,000 tensors of 256 bf16 each in one file (what per-tensor bookkeeping costs).

Modes (``OWNERSHIP_SANITIZE_OPTIONS``): ``off`` (unset), ``on`` (defaults), ``ring``
(``safetensors_ring``: every tensor lent from a reused ring), ``ring+checksum``, ``triage``
(ring + ``triage=1``), ``trap`` (ring + ``trap=poison``), ``rescue`` (ring + ``rescue=1``).
``--threads 4`` adds the load with 4 threads (``get_tensor`` + ``clone``, each thread a quarter
of the keys), sanitized with defaults vs off: the case of Python 3.11's worker threads.

Targets (2 cores): ring <= 1.3x, ring+checksum <= 1.5x, triage <= 1.5x, 100k ring <= 2.5x,
4-thread load <= 2x.

    python bench/e2e.py [--reps 3] [--only llm,100k,threads] [--modes off,ring,...]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent

MODES: Dict[str, str | None] = {
    "off": None,
    "on": "",
    "ring": "safetensors_ring={ring}",
    "ring+checksum": "safetensors_ring={ring}:checksum=1",
    "triage": "safetensors_ring={ring}:triage=1",
    "trap": "safetensors_ring={ring}:trap=poison",
    "rescue": "safetensors_ring={ring}:rescue=1",
}
#: Ring size per checkpoint: 128 MiB for the LLM shape (its largest tensor is 16 MiB), 64 KiB for
#: the 100k one (each tensor is 512 B: the ring comes round every 128 tensors).
RING = {"llm": 128 << 20, "big": 256 << 20, "100k": 65536}
TARGETS = {("llm", "ring"): 1.3, ("llm", "ring+checksum"): 1.5, ("llm", "triage"): 1.5,
           ("big", "ring"): 1.3, ("big", "ring+checksum"): 1.5,
           ("100k", "ring"): 2.5, ("threads", "on"): 2.0}


def make_llm(path: Path, layers: int, hidden: int, vocab: int) -> List[str]:
    """The LLM-shaped checkpoint of bench/loaders.py (two bf16 shards), with an embedding of ``vocab`` rows."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from loaders import make_checkpoint

    path.mkdir(parents=True, exist_ok=True)
    return make_checkpoint(str(path), layers, hidden, vocab)[0]


def make_100k(path: Path, count: int = 100_000) -> List[str]:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    base = torch.arange(256, dtype=torch.float32).to(torch.bfloat16)
    f = path / "model.safetensors"
    save_file({f"t.{i}": (base + i % 97) for i in range(count)}, str(f))
    return [str(f)]


def checkpoint(directory: Path, name: str, args: argparse.Namespace) -> List[str]:
    where = directory / name
    done = where / "done"
    if done.exists():
        return sorted(str(p) for p in where.glob("*.safetensors"))
    if name == "llm":
        files = make_llm(where, args.layers, args.hidden, 8 * args.hidden)
    elif name == "big":
        files = make_llm(where, 2, 4096, 8192)
    else:
        files = make_100k(where)
    done.write_text("ok")
    return files


# -- the child: one load, timed ----------------------------------------------------------------
def child(files: List[str], threads: int) -> None:
    t_import = time.perf_counter()
    import torch
    from safetensors import safe_open

    import sanitizer  # noqa: F401  (as a user's program: OWNERSHIP_SANITIZE activates at import)
    imported = time.perf_counter() - t_import

    # The model, built before the load as transformers' from_pretrained does under no_init_weights: its
    # parameters are torch.empty, never written, so the load's copies also take their first-touch faults.
    params: Dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                params[k] = torch.empty(s.get_shape(), dtype=torch.bfloat16)
    started = _hash_start_seconds()
    t0 = time.perf_counter()
    if threads <= 1:
        for f in files:
            with safe_open(f, "pt") as h:
                for k in h.keys():
                    params[k].copy_(h.get_tensor(k))
    else:
        import threading

        out: Dict[str, torch.Tensor] = {}

        def work(f: str, keys: List[str]) -> None:
            with safe_open(f, "pt") as h:
                for k in keys:
                    out[k] = h.get_tensor(k).clone()

        workers = []
        for f in files:
            with safe_open(f, "pt") as h:
                keys = list(h.keys())
            for i in range(threads):
                workers.append(threading.Thread(target=work, args=(f, keys[i::threads])))
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        params = out
    end = time.perf_counter()
    load, total = end - t0, end - t_import
    digest = hashlib.sha256()
    for k in sorted(params):
        digest.update(params[k].contiguous().view(torch.uint8).numpy().tobytes())
    # the hash's one-time start paid inside the load (at the first checksum): numba's import and first
    # kernel loads where no machine code is stored yet (the stored code loads at enable, before the load)
    first_use = _hash_start_seconds() - started
    print(json.dumps({"load": load, "import": imported, "total": total, "digest": digest.hexdigest()[:16],
                      "tensors": len(params), "numba_first_use": first_use}))


def _hash_start_seconds() -> float:
    """Seconds the checksum kernels took to start in this process so far (import, load, compile)."""
    if "cuda_hooks.bridge" not in sys.modules:
        return 0.0
    import cuda_hooks

    return sum(cuda_hooks.compile_seconds().values())


def run_child(files: List[str], mode: str, ring: int, threads: int, python: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_")}
    opts = MODES[mode]
    if opts is not None:
        env["OWNERSHIP_SANITIZE"] = "1"
        if opts:
            env["OWNERSHIP_SANITIZE_OPTIONS"] = opts.format(ring=ring)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, str(Path(__file__).resolve()), "--child", "--threads", str(threads), *files]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"e2e: mode {mode} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help="rounds; the best of them is the figure")
    ap.add_argument("--only", default="llm,100k,threads", help="which loads: llm, 100k, threads")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes (off always runs)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dir", default=str(Path.home() / ".cache" / "ownership-sanitizer" / "bench-e2e"))
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the children")
    args = ap.parse_args()
    if args.child:
        child(args.files, args.threads)
        return
    if args.reps < 1:
        raise SystemExit(f"e2e: --reps must be at least 1, got {args.reps}")
    directory = Path(args.dir)
    modes = ["off"] + [m for m in args.modes.split(",") if m and m != "off"]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"e2e: unknown mode {m!r} (known: {', '.join(MODES)})")
    plans = []  # (label, checkpoint, mode, threads)
    for load in args.only.split(","):
        if load in ("llm", "big", "100k"):
            plans += [(load, load, m, 1) for m in modes]
        elif load == "threads":
            plans += [("threads", "100k", m, 4) for m in ("off", "on")]
        else:
            raise SystemExit(f"e2e: unknown load {load!r} (known: llm, big, 100k, threads)")
    files = {c: checkpoint(directory, c, args) for c in {p[1] for p in plans}}
    py = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"],
                        capture_output=True, text=True).stdout.strip()
    print(f"# e2e: python {py}, {os.cpu_count()} CPUs, best of {args.reps} interleaved rounds, fresh processes")
    results: Dict[tuple, List[dict]] = {p: [] for p in plans}
    loads = []
    for r in range(args.reps):
        for p in plans:
            results[p].append(run_child(files[p[1]], p[2], RING[p[1]], p[3], args.python))
        loads.append(os.getloadavg()[0])
    print(f"# load average after each round: {', '.join(f'{x:.2f}' for x in loads)}")
    print("# load: from the first safe_open to the last copy; run: from the child's first line (import torch,")
    print("# the package, the model's construction) to the same end, as the program's own clock would say")
    print("# start s: the hash's one-time start inside that load, once per process: numba's import and first kernel")
    print("# loads where no machine code is stored yet (stored code loads at enable, before the load: in run s);")
    print("# x off w/o: the load without it, against off")
    print(f"{'load':8} {'mode':14} {'best s':>8} {'median s':>9} {'x off':>6} {'target':>10} "
          f"{'run best s':>10} {'x off':>6} {'start s':>8} {'x off w/o':>9}  digest")
    for label in dict.fromkeys(p[0] for p in plans):
        rows = [p for p in plans if p[0] == label]
        base = min(x["load"] for x in results[rows[0]])
        base_run = min(x["total"] for x in results[rows[0]])
        digests = set()
        for p in rows:
            ts = sorted(x["load"] for x in results[p])
            best, median = ts[0], ts[len(ts) // 2]
            run = min(x["total"] for x in results[p])
            first = min(results[p], key=lambda x: x["load"]).get("numba_first_use", 0.0)
            digest = {x["digest"] for x in results[p]}
            digests |= digest
            target = TARGETS.get((label, p[2]))
            mark = "" if target is None else (f"{target:.1f}x" + (" ok" if best / base <= target else " MISS"))
            print(f"{label:8} {p[2]:14} {best:8.3f} {median:9.3f} {best / base:6.2f} {mark:>10} "
                  f"{run:10.3f} {run / base_run:6.2f} {first:8.3f} {(best - first) / base:9.2f}  {','.join(digest)}")
        if len(digests) != 1:
            print(f"# {label}: RESULTS DIFFER between modes: {sorted(digests)}")
            sys.exit(1)


if __name__ == "__main__":
    main()
