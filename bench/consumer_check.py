"""What ``check_consumer`` costs: 100 examples on a 2-layer model of about 1 MiB, on one core. Target: <= 10 s.

Each example runs the consumer three times (over owned copies: the oracle; over a
borrowed stream unsanitized; and sanitized) and compares what it built, bit for
bit. Printed side by side, in one run:

* the check: examples/s and the total for ``--examples`` examples, the first check in
  the process (cold: numba's import and cached kernels, the first time a dispatch mode
  runs) and the best and median of ``--repeats`` more (warm);
* the plain load it is made of: the same consumer over a dict of owned tensors, no
  sanitizer (ratio: one example costs that many plain loads);
* the physical reference: copying the checkpoint's bytes once (``torch.clone`` of every
  tensor), which an example does about five times (the oracle's copies, two rings, the
  consumer's own copies).

Consumers: ``load_weights`` (copy each tensor into an ``nn.Module``'s parameter) and
``deferred`` (the reference layerwise deferred loader with ``own_arguments``). The
process is pinned to one CPU (``--no-pin`` to leave it) and torch runs one intra-op
thread. On a shared machine take the best of the repeats.

    python bench/consumer_check.py [--examples 100] [--repeats 3] [--consumers load_weights,deferred]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from sanitizer.testing import check_consumer  # noqa: E402

HIDDEN, INTERMEDIATE = 128, 256


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in (("q_proj", (HIDDEN, HIDDEN)), ("k_proj", (HIDDEN, HIDDEN)), ("v_proj", (HIDDEN, HIDDEN)),
                            ("o_proj", (HIDDEN, HIDDEN)), ("up_proj", (INTERMEDIATE, HIDDEN)),
                            ("down_proj", (HIDDEN, INTERMEDIATE)), ("norm", (HIDDEN,))):
            self.register_parameter(name, nn.Parameter(torch.zeros(shape), requires_grad=False))


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


def checkpoint() -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(v.shape, generator=g) for k, v in TwoLayers().state_dict().items()}


def load_weights(weights) -> nn.Module:
    model = TwoLayers()
    params = dict(model.named_parameters())
    for name, t in weights:
        params[name].copy_(t)
    return model


def deferred(weights) -> nn.Module:
    from sanitizer.testing.reference.deferred_loader import load_layerwise

    return load_layerwise(TwoLayers(), weights, ownership=True)


CONSUMERS: Dict[str, Callable] = {"load_weights": load_weights, "deferred": deferred}


def best_of(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3, help="warm checks after the first (best and median shown)")
    p.add_argument("--consumers", default=",".join(CONSUMERS))
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one CPU")
    args = p.parse_args(argv)
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    sd = checkpoint()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    copy_s = best_of(lambda: [t.clone() for t in sd.values()], 50)
    print(f"checkpoint: 2 layers, {len(sd)} tensors, {nbytes / 2**20:.2f} MiB; one core "
          f"({'pinned to cpu ' + str(min(os.sched_getaffinity(0))) if not args.no_pin else 'not pinned'}), "
          f"torch threads {torch.get_num_threads()}")
    print(f"physical reference: copying the checkpoint once takes {copy_s * 1e6:.0f} us "
          f"({nbytes / copy_s / 1e9:.1f} GB/s)\n")
    rows = [("consumer", "first check (cold)", "warm best", "warm median", "examples/s", "per example",
             "plain load", "example / plain load", "example / checkpoint copy")]
    worst = 0.0
    for name in args.consumers.split(","):
        consume = CONSUMERS[name]
        plain = best_of(lambda: consume(iter([(k, v.clone()) for k, v in sd.items()])), 20)
        t0 = time.perf_counter()
        ran = check_consumer(consume, sd, examples=args.examples).examples
        cold = time.perf_counter() - t0
        warm = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            check_consumer(consume, sd, examples=args.examples)
            warm.append(time.perf_counter() - t0)
        best, median = min(warm), statistics.median(warm)
        per = best / ran
        worst = max(worst, cold)
        rows.append((name, f"{cold:.2f} s", f"{best:.2f} s", f"{median:.2f} s", f"{ran / best:.0f}",
                     f"{per * 1e3:.1f} ms", f"{plain * 1e3:.2f} ms", f"{per / plain:.1f}x", f"{per / copy_s:.0f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    verdict = "meets" if worst <= 10 else "MISSES"
    print(f"\n{args.examples} examples per check; the slowest first check took {worst:.2f} s: {verdict} the "
          f"target (<= 10 s on one core)")
    return 0 if worst <= 10 else 1


if __name__ == "__main__":
    sys.exit(main())
