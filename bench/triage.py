"""Cost of naming retentions: 100 retained views, each retention named (triage=1), per holder shape.

A staging ring of 16 slots lends 116 tensors; the consumer keeps the first 100
past the reuse of their bytes, the way a deferring weight loader does, in one
of four shapes:

* ``list``: a module-level list (``KEPT[i]``);
* ``layers``: one ``LayerReloadingInfo`` per layer of 10 weights, each keeping
  ``inspect.BoundArguments`` (vLLM's layerwise reload: a new root per layer);
* ``dict``: one object's dict keyed by weight name (``DeferredLayer.pending[name]``);
* ``frame``: a list local to the consumer's own function.

The heap holds ``--ballast`` other objects (a real program's), since a heap
walk costs in proportion to it. Printed per shape: the loop with the
sanitizer off, with ``triage=1``, the retentions recorded, the heap walks they
took, and the milliseconds per retention beyond the plain loop. Target: 100
named in <= 0.5 s.

    python bench/triage.py [--ballast 300000] [--shapes list,layers,dict,frame]
"""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import sanitizer  # noqa: E402

N, SLOTS, WIDTH = 100, 16, 1024
KEPT: List[torch.Tensor] = []


@dataclass
class LayerReloadingInfo:
    loaded_weights: list = field(default_factory=list)


@dataclass
class DeferredLayer:
    pending: Dict[str, torch.Tensor] = field(default_factory=dict)


def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.copy_(loaded_weight)


def consume(shape: str, ring: "sanitizer.StagingRing") -> object:
    """Lend N + SLOTS tensors; keep the first N in ``shape``; return what keeps them."""
    sig = inspect.signature(weight_loader)
    infos = [LayerReloadingInfo() for _ in range(N // 10)]
    layer = DeferredLayer()
    kept: List[torch.Tensor] = []
    for i in range(N + SLOTS):
        name = f"model.layers.{i // 10}.w{i % 10}"
        w = ring.put(name, torch.full((WIDTH,), float(i)))
        if i >= N:
            continue
        if shape == "list":
            KEPT.append(w)
        elif shape == "layers":
            infos[i // 10].loaded_weights.append((name, sig.bind(torch.empty(WIDTH), w)))
        elif shape == "dict":
            layer.pending[name] = w
        else:
            kept.append(w)
    return (infos, layer, kept)


def run(shape: str, sanitized: bool) -> Dict[str, float]:
    from sanitizer.features import holders, triage

    KEPT.clear()
    triage.reset(records_too=True)
    if hasattr(holders, "forget_patterns"):
        holders.forget_patterns()
    walks = [0]
    real = holders._run

    def counting(walk):
        walks[0] += 1
        return real(walk)

    holders._run = counting
    ring = sanitizer.StagingRing(SLOTS * WIDTH * 4, name=f"bench-{shape}")
    try:
        if sanitized:
            sanitizer.enable(triage=1)
        start = time.perf_counter()
        keep = consume(shape, ring)
        rep = sanitizer.report(final=True) if sanitized else None
        seconds = time.perf_counter() - start
        del keep
    finally:
        sanitizer.disable()
        holders._run = real
        ring.close()
        KEPT.clear()
    found = rep["summary"]["retentions"] if rep else 0
    sanitizer.clear_errors()
    triage.reset(records_too=True)
    return {"seconds": seconds, "retentions": found, "walks": walks[0]}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ballast", type=int, default=300_000, help="other objects on the heap")
    parser.add_argument("--shapes", default="list,layers,dict,frame")
    args = parser.parse_args(argv)
    ballast = [{"i": i} if i % 3 else [i] for i in range(args.ballast)]
    ballast += [torch.zeros(1) for _ in range(2000)]
    gc.collect()
    __import__("importlib").import_module("torch._dynamo")  # its first import would land in a timed run

    run("list", True)  # warm-up: first dispatch-mode use, first walk
    print(f"{N} retained views of {WIDTH * 4} B through a {SLOTS}-slot ring; heap: {len(gc.get_objects())} objects; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'holder shape':10s} {'off (s)':>9s} {'triage=1 (s)':>13s} {'retentions':>11s} {'heap walks':>11s} "
          f"{'ms / retention':>15s}")
    for shape in [s.strip() for s in args.shapes.split(",") if s.strip()]:
        off = min(run(shape, False)["seconds"] for _ in range(3))
        on = run(shape, True)
        per = (on["seconds"] - off) * 1000.0 / max(1, on["retentions"])
        print(f"{shape:10s} {off:9.3f} {on['seconds']:13.3f} {on['retentions']:11d} {on['walks']:11d} {per:15.2f}")
    print("target: 100 retentions named in <= 0.5 s")
    del ballast
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
