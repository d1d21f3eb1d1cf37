"""Stress programs for mode placement: exits with threads, workers, the user's own modes, op look-ups.

Shared by ``bench/stress.py`` (hundreds of runs) and the CI tests (a few), so the
numbers in a note and the tests come from the same code. Each check returns a
plain dict of counts; the callers decide what is a failure.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Dict, List, Optional

POOL_PROGRAM = """
import concurrent.futures, torch
import sanitizer  # OWNERSHIP_SANITIZE=1 in the environment: enabled at import
assert sanitizer.enabled()
def tiny(i):
    x = torch.ones(8) * i
    return float((x + 1).sum())
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    total = sum(pool.map(tiny, range(256)))
print("ok", total)
"""
"""An 8-worker pool doing tiny ops with no lease at all; it must exit 0, every time."""


def run_pool_exits(runs: int, parallel: int = 4, root: Optional[str] = None,
                   timeout: float = 120) -> Dict[str, object]:
    """Run :data:`POOL_PROGRAM` ``runs`` times (``parallel`` at once); count abnormal exits."""
    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["OWNERSHIP_SANITIZE"] = "1"

    def one(_: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", POOL_PROGRAM], env=env, capture_output=True,
                              text=True, timeout=timeout)

    failures: List[str] = []
    with ThreadPoolExecutor(parallel) as pool:
        for fut in as_completed([pool.submit(one, i) for i in range(runs)]):
            proc = fut.result()
            if proc.returncode != 0 or "ok" not in proc.stdout:
                failures.append(f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    return {"runs": runs, "abnormal": len(failures), "failures": failures[:5]}


LOOKUP_RACE_PROGRAM = r"""
import os, sys, threading
import torch

VARIANT = sys.argv[1]  # sanitizer | bare-skip | bare-default | bare-skip-serialized | bare-default-serialized
if VARIANT == "sanitizer":
    import sanitizer  # OWNERSHIP_SANITIZE=1 in the environment: enabled at import
    assert sanitizer.enabled(), "the sanitizer did not enable"
else:
    from torch.utils._python_dispatch import TorchDispatchMode
    if VARIANT.endswith("-serialized"):
        from sanitizer.torch_layer import op_lookup
        op_lookup.serialize_op_lookups()

    class DoNothing(TorchDispatchMode):
        if VARIANT.startswith("bare-skip"):
            @classmethod
            def _should_skip_dynamo(cls):  # as BorrowCheckMode: no dynamo-disable shim
                return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

built = []  # every OpOverload object torch.ops makes: one op built twice means one was freed
_init = torch._ops.OpOverload.__init__
def _counting_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    built.append(self._name)
torch._ops.OpOverload.__init__ = _counting_init

base = torch.arange(64 * 1024, dtype=torch.float32)
storage = base.untyped_storage()
x = torch.rand(8, 8) + 0.5
pairs = torch.rand(8, 2)
# Ops a Python mode sees that ``import torch`` leaves unbuilt in torch.ops: their first dispatch
# under a mode builds their Python object (safetensors' get_tensor: asarray(storage slice) ->
# set_.source_Storage). Each thread runs them all, all threads at once.
FRESH = {
    ("set_", "source_Storage"): None,
    ("_conj_physical", "default"): lambda: torch._conj_physical(x),
    ("_standard_gamma_grad", "default"): lambda: torch._standard_gamma_grad(x, x),
    ("view_as_complex_copy", "default"): lambda: torch.view_as_complex_copy(pairs),
    ("allclose", "default"): lambda: torch.allclose(x, x),
}
fresh = sum(1 for op, ov in FRESH if ov not in getattr(torch.ops.aten.__dict__.get(op), "__dict__", {}))
expected = {key: f() for key, f in FRESH.items() if f is not None}  # no mode here: builds nothing
errors = []
threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_type.__name__}: {a.exc_value}")
barrier = threading.Barrier(4)

def same(a, b):
    return bool(torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b

def load(i):
    a = (i % 32) * 1024
    t = torch.asarray(storage[a:a + 4096], dtype=torch.float32)  # safetensors' get_tensor
    assert torch.equal(t, base[a // 4:a // 4 + 1024]), "asarray read the wrong bytes"

def worker():
    if VARIANT != "sanitizer":  # placed as ModeController places ours: raw, at the stack's bottom
        torch._C._push_on_torch_dispatch_stack(DoNothing())
    try:
        for key, f in FRESH.items():  # every thread's first call of each op, all at the same moment
            barrier.wait()
            load(0) if f is None else f()
        for i in range(100):  # then use what was cached: a freed op object is read here
            load(i)
            for key, f in FRESH.items():
                if f is not None:
                    assert same(f(), expected[key]), f"{key} changed its result"
    finally:
        if VARIANT != "sanitizer":
            torch._C._pop_torch_dispatch_stack(None)

sys.setswitchinterval(1e-6)  # as safetensors' test: a thread switch at almost every bytecode
threads = [threading.Thread(target=worker) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
twice = sorted({name for name in built if built.count(name) > 1})
tree = os.path.dirname(os.path.dirname(sys.modules["sanitizer"].__file__)) if "sanitizer" in sys.modules else "-"
print(f"tree={tree} fresh={fresh} raised={len(errors)} built_twice={len(twice)}",
      "ok" if not (errors or twice) else "FAILED")
for line in errors:
    print("  raised:", line)
if twice:
    print("  built twice (the first freed while torch's C++ cache may point to it):", twice)
sys.exit(3 if errors or twice else 0)
"""
"""Four threads make torch.ops build an op's Python object at the same moment under a Python mode
(the pattern that crashed safetensors' own multithreaded test, issue 17); prints how many of its
ops were still unbuilt at the start (``fresh=``: 0 would test nothing) and exits 0 when every
thread finished with the right results and no op's object was built twice. A second build is
the race itself, caught whether or not the freed first object was read before the process ended:
the crash is only its most visible outcome."""

LOOKUP_RACE_VARIANTS = ("sanitizer", "bare-skip", "bare-default", "bare-skip-serialized",
                        "bare-default-serialized")


def run_lookup_race(runs: int, variant: str = "sanitizer", parallel: int = 4,
                    root: Optional[str] = None, timeout: float = 180) -> Dict[str, object]:
    """Run :data:`LOOKUP_RACE_PROGRAM` ``runs`` times in fresh processes; count how they ended.

    ``variant``: ``sanitizer`` (enabled by ``OWNERSHIP_SANITIZE=1``, its own mode placed by
    ModeController), or a do-nothing mode pushed raw with (``bare-skip``) or without
    (``bare-default``) torch's dynamo-disable shim, optionally with the sanitizer's op look-up
    lock (``-serialized``). ``root``: the source tree to import ``sanitizer`` from (another
    checkout gives the figures of older code). A run whose ops were all built already
    (``fresh=0``) is counted apart: it could not race.
    """
    if variant not in LOOKUP_RACE_VARIANTS:
        raise ValueError(f"run_lookup_race: variant must be one of {LOOKUP_RACE_VARIANTS}, got {variant!r}")
    if runs < 1:
        raise ValueError(f"run_lookup_race: runs must be at least 1, got {runs!r}")
    root = os.path.realpath(root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")  # with cwd=root: before an editable install
    if variant == "sanitizer":
        env["OWNERSHIP_SANITIZE"] = "1"

    imports_ours = variant == "sanitizer" or variant.endswith("-serialized")

    def one(_: int) -> subprocess.CompletedProcess:
        try:
            return subprocess.run([sys.executable, "-X", "faulthandler", "-c", LOOKUP_RACE_PROGRAM, variant],
                                  env=env, cwd=root, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, -999, "", f"timed out after {timeout} s (a deadlock?)")

    counts = dict.fromkeys(LOOKUP_RACE_OUTCOMES, 0)
    failures: List[str] = []
    with ThreadPoolExecutor(parallel) as pool:
        for fut in as_completed([pool.submit(one, i) for i in range(runs)]):
            proc = fut.result()
            outcome = _race_outcome(proc, f"tree={root} " if imports_ours else None)
            counts[outcome] += 1
            if outcome != "ok":
                text = (proc.stdout + proc.stderr).strip()
                where = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File ")][:2]
                failures.append(f"{outcome}, exit {proc.returncode}: {text.splitlines()[0][:200] if text else ''} "
                                f"{' <- '.join(where)}")
    return {"variant": variant, "runs": runs, **counts, "failures": failures[:5]}


LOOKUP_RACE_OUTCOMES = ("ok", "crashed", "raced", "errors", "hung", "nothing_to_race")
"""How a run of :data:`LOOKUP_RACE_PROGRAM` ended: ``raced``: an op's object was built twice (no
crash, this time); ``errors``: a thread raised, or the run imported another checkout than asked."""


def _race_outcome(proc: subprocess.CompletedProcess, tree_mark: Optional[str]) -> str:
    if proc.returncode == -999:
        return "hung"
    if proc.returncode < 0 or proc.returncode == 139:
        return "crashed"
    if tree_mark is not None and tree_mark not in proc.stdout:
        return "errors"
    if proc.returncode == 0:
        return "nothing_to_race" if " fresh=0 " in proc.stdout else "ok"
    if proc.returncode == 3 and " raised=0 " in proc.stdout:
        return "raced"  # built twice, and every thread finished right
    return "errors"


def worker_drops_last_lease_then_reads_stale(rounds: int) -> Dict[str, int]:
    """A consumer thread lets the last live lease die, then reads a stale one: caught each round.

    Needs the sanitizer enabled (halt_on_error=1) by the caller.
    """
    import torch

    import sanitizer

    caught = missed = 0
    for _ in range(rounds):
        buf = sanitizer.StagingBuffer(256, name="stress-ring")
        box: Dict[str, object] = {}
        ready, go, done = threading.Event(), threading.Event(), threading.Event()

        def consumer() -> None:
            nonlocal caught, missed
            first = buf.write(0, torch.ones(4), name="first")  # lent and dropped in this thread
            del first
            ready.set()
            go.wait(10)
            try:
                float(box["kept"].sum())  # type: ignore[union-attr]
                missed += 1
            except sanitizer.StaleBorrowError:
                caught += 1
            done.set()

        t = threading.Thread(target=consumer)
        t.start()
        ready.wait(10)
        box["kept"] = buf.write(64, torch.ones(4), name="kept")
        buf.reuse(64, 16, by="next")
        go.set()
        done.wait(10)
        t.join()
    return {"rounds": rounds, "caught": caught, "missed": missed}


def _user_modes() -> Dict[str, Callable[[], object]]:
    """The user modes a lend may happen inside or outside of."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class LoggingMode(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: List[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def fake() -> object:
        from torch._subclasses.fake_tensor import FakeTensorMode
        return FakeTensorMode()

    return {"FlopCounterMode": lambda: FlopCounterMode(display=False), "LoggingMode": LoggingMode,
            "FakeTensorMode": fake}


def foreign_stack() -> list:
    """This thread's dispatch-mode stack without the sanitizer's own mode."""
    import torch

    from sanitizer.torch_layer.mode import BorrowCheckMode

    modes = [torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack())]
    return [m for m in modes if not isinstance(m, BorrowCheckMode)]


def lends_inside_and_outside_user_modes() -> Dict[str, object]:
    """Lend and reuse inside and outside each user mode; the user's stack is as before after each
    block, and a stale read after it is still caught. Needs the sanitizer enabled (halt_on_error=1)."""
    import torch

    import sanitizer

    results: Dict[str, object] = {}
    for label, make in _user_modes().items():
        for where in ("inside", "outside"):
            before = foreign_stack()
            buf = sanitizer.StagingBuffer(256, name=f"ring-{label}")
            outside = buf.write(0, torch.ones(4), name="outside") if where == "outside" else None
            fake = label == "FakeTensorMode"
            if fake and where == "inside":
                continue  # FakeTensorMode refuses real tensors: nobody lends inside it
            with make() as user_mode:
                inside = buf.write(64, torch.ones(4), name="inside") if where == "inside" else None
                if not fake:
                    buf.reuse(0, 128, by="next")  # both offsets: whichever lease exists goes stale
                torch.ones(2) + 1  # the user's mode still sees ops, above ours
            if fake:
                buf.reuse(0, 128, by="next")
            kept = inside if inside is not None else outside
            stack_ok = foreign_stack() == before
            try:
                kept.sum()  # type: ignore[union-attr]
                caught = False
            except sanitizer.StaleBorrowError:
                caught = True
            logged = getattr(user_mode, "ops", None)
            results[f"{label}/{where}"] = {"stack_unchanged": stack_ok, "stale_read_caught": caught,
                                           "user_mode_saw_ops": bool(logged) if logged is not None else None}
            del kept, inside, outside
    return results


def compile_with_lease_alive() -> Dict[str, object]:
    """``torch.compile`` (eager backend) while a stale lease is reachable: same result, same stack."""
    import torch

    import sanitizer

    buf = sanitizer.StagingBuffer(256, name="ring-compile")
    kept = buf.write(0, torch.ones(4), name="kept")
    buf.reuse(0, 16, by="next")
    before = foreign_stack()

    def f(x):
        return torch.sin(x) * 2 + 1

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    x = torch.arange(8, dtype=torch.float32)
    out = torch.compile(f, backend="eager")(x)
    compiled = counters["stats"]["unique_graphs"] > graphs  # not skipped for a mode on the stack
    same = bool(torch.equal(out, f(x)))
    try:
        kept.sum()
        caught = False
    except sanitizer.StaleBorrowError:
        caught = True
    return {"compiled": compiled, "same_result": same, "stack_unchanged": foreign_stack() == before, "stale_read_caught": caught}


SOAK_PROGRAM = r"""
import importlib.util, multiprocessing as mp, os, sys, threading, torch
import sanitizer  # under ownsan run: enabled at import, halt_on_error=0, a strict safetensors ring
LOADER = importlib.util.find_spec("safetensors") is not None
PATH = sys.argv[2]

def loader_read():
    # A real loader through the sanitizer's ring: a tensor kept past the next get_tensor, then read.
    from safetensors.torch import safe_open
    with safe_open(PATH, framework="pt") as f:
        kept = f.get_tensor("a")
        f.get_tensor("b")
        float(kept.sum())

def ring_read(tag):
    ring = sanitizer.StagingRing(4096, name=f"r{tag}")
    a = ring.put("a", torch.ones(1024))
    ring.put("b", torch.zeros(1024))
    float(a.sum())

def threads(n):
    ts = [threading.Thread(target=ring_read, args=(f"t{os.getpid()}.{k}",)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if LOADER:
        loader_read()
    return n + LOADER

def task(i):
    ring_read(f"p{i}")
    if LOADER:
        loader_read()
    return 1 + LOADER

if __name__ == "__main__":
    if LOADER and not os.path.exists(PATH):
        from safetensors.torch import save_file
        save_file({"a": torch.ones(4096), "b": torch.zeros(4096)}, PATH)  # 16 KiB each: a ring of one
    expected = threads(4)  # the main thread and 4 others
    r, w = os.pipe()
    pid = os.fork()  # a forked child with threads of its own (while the parent's pool is not started yet)
    if pid == 0:
        os.write(w, str(threads(2)).encode())
        os._exit(0)
    os.close(w)
    with mp.get_context(sys.argv[1]).Pool(2) as pool:  # ends with terminate()
        expected += sum(pool.map(task, range(4)))
    os.waitpid(pid, 0)
    expected += int(os.read(r, 16) or b"0")
    print("EXPECTED", expected)
"""
"""Threads, a fork, a pool that ends with ``terminate()`` and a real loader at once: every stale read of
every process must reach the merged report (issue 29)."""


def run_soak(runs: int, methods: List[str], directory: str, timeout: float = 300,
             root: Optional[str] = None) -> Dict[str, object]:
    """Run :data:`SOAK_PROGRAM` under ``ownsan run`` ``runs`` times per start method; per method, the runs
    whose merged report had every stale read the program made (and exit 1, the findings' status)."""
    import json
    import time

    root = root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    script = os.path.join(directory, "soak.py")
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(SOAK_PROGRAM)
    weights = os.path.join(directory, "soak.safetensors")
    out: Dict[str, object] = {}
    for method in methods:
        whole, failures, took = 0, [], []
        for i in range(runs):
            report = os.path.join(directory, f"soak-{method}-{i}.json")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-o", "halt_on_error=0", "-o",
                                       "safetensors_ring=16384", "-o", "safetensors_strict=1", "--report", report,
                                       "--", sys.executable, script, method, weights],
                                      env=env, capture_output=True, text=True, timeout=timeout, cwd=directory)
            except subprocess.TimeoutExpired:
                failures.append(f"run {i}: no end after {timeout:.0f} s (a hang)")
                continue
            took.append(time.perf_counter() - t0)
            expected = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("EXPECTED ")]
            try:
                with open(report, encoding="utf-8") as fh:
                    rep = json.load(fh)
                stale = sum(e.get("kind") == "stale_use" for e in rep["errors"])
            except (OSError, ValueError, KeyError) as exc:
                failures.append(f"run {i}: no report ({exc}); exit {proc.returncode}: {proc.stderr[-300:]}")
                continue
            if expected and stale == expected[0] and proc.returncode == 1:
                whole += 1
            else:
                failures.append(f"run {i}: {stale} stale reads reported of {expected or '?'}, exit "
                                f"{proc.returncode}: {proc.stderr[-300:]}")
        out[method] = {"runs": runs, "whole": whole, "failures": failures[:3],
                       "s_per_run": round(sum(took) / max(1, len(took)), 1)}
    return out


__all__ = ["POOL_PROGRAM", "SOAK_PROGRAM", "run_soak", "run_pool_exits", "LOOKUP_RACE_PROGRAM", "LOOKUP_RACE_VARIANTS", "LOOKUP_RACE_OUTCOMES",
           "run_lookup_race",
           "worker_drops_last_lease_then_reads_stale",
           "lends_inside_and_outside_user_modes", "compile_with_lease_alive", "foreign_stack"]
