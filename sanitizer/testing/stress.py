"""Stress programs for mode placement: exits with threads, workers, and the user's own modes.

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


__all__ = ["POOL_PROGRAM", "run_pool_exits", "worker_drops_last_lease_then_reads_stale",
           "lends_inside_and_outside_user_modes", "compile_with_lease_alive", "foreign_stack"]
