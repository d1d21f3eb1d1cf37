"""Throughput of ``ownsan audit`` on a large synthesised tree (~300,000 lines), single process.

The tree is written to a temporary directory: ``--modules`` model files in the style engines write
them (a decoder layer with its forward code, a model with ``load_weights`` loops over a weights
iterator, stacked-parameter mappings, per-tensor ``weight_loader`` methods, helpers called from the
loops, nested filter generators), a fraction of them with a retaining statement planted (a side list,
a dict by name, ``list(weights)``, a helper that parks its argument). Printed side by side, in one run:

* the physical reference: reading and ``ast.parse`` of every file alone (what any Python-source tool
  pays; the audit cannot be faster than it);
* the whole audit (parse, discovery, flow, summaries, suppression);
* lines per second of each, their ratio, and the findings (which must equal the planted ones).

Target: <= 10 s for ~300,000 lines. Each figure is the best of ``--repeat`` runs (the minimum is the
least disturbed by other processes on a shared machine; the median is printed too).

    python bench/audit.py [--modules 820] [--repeat 3] [--keep DIR]
"""
from __future__ import annotations

import argparse
import ast
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from sanitizer.audit import audit_paths  # noqa: E402  (torch-free)

HEADER = '''"""Synthesised model file {i} for bench/audit.py (never imported)."""
from typing import Iterable, Optional

import torch
from torch import nn

from .common import default_weight_loader, maybe_remap_name
'''

LAYER = '''

class DecoderLayer{i}_{j}(nn.Module):
    def __init__(self, hidden: int, heads: int, prefix: str = ""):
        super().__init__()
        self.hidden = hidden
        self.heads = heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.o_proj = nn.Linear(hidden, hidden)
        self.gate_up_proj = nn.Linear(hidden, 8 * hidden)
        self.down_proj = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.prefix = prefix

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.chunk(3, dim=-1)
        scores = torch.einsum("bhd,bgd->bhg", q, k) / (self.hidden ** 0.5)
        weights = torch.softmax(scores, dim=-1)
        attn = torch.einsum("bhg,bgd->bhd", weights, v)
        hidden_states = self.o_proj(attn) + residual
        residual = hidden_states
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        hidden_states = self.down_proj(torch.nn.functional.silu(gate) * up)
        for step in range(2):
            if step and positions.numel() > 1:
                hidden_states = hidden_states + 0.0
        return hidden_states + residual

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None):
        param_data = param.data
        if shard_id is not None:
            size = param_data.shape[0] // 3
            param_data = param_data.narrow(0, shard_id * size, size)
            loaded_weight = loaded_weight.narrow(0, 0, size)
        assert param_data.shape == loaded_weight.shape, (param_data.shape, loaded_weight.shape)
        param_data.copy_(loaded_weight)
'''

MODEL = '''

def _shard_rows_{i}(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    rows = tensor.shape[0] // size
    return tensor.narrow(0, rank * rows, rows)


def _filter_{i}(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    for name, w in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        yield maybe_remap_name(name), w


class Model{i}(nn.Module):
    def __init__(self, layers: int = 4, hidden: int = 64):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer{i}_0(hidden, 4) for _ in range(layers)])
        self.tp_rank, self.tp_size = 0, 1

    def _load_stacked(self, name: str, loaded_weight: torch.Tensor, params: dict) -> bool:
        for param_name, weight_name, shard_id in (("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1),
                                                  ("qkv_proj", "v_proj", 2), ("gate_up_proj", "gate_proj", 0),
                                                  ("gate_up_proj", "up_proj", 1)):
            if weight_name not in name:
                continue
            param = params[name.replace(weight_name, param_name)]
            param.weight_loader(param, loaded_weight, shard_id)
            return True
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
{planted_setup}
        for name, loaded_weight in _filter_{i}(weights):
            if name.endswith(".bias") and name not in params:
                continue
{planted_body}
            if self._load_stacked(name, loaded_weight, params):
                loaded.add(name)
                continue
            param = params[name]
            shard = _shard_rows_{i}(loaded_weight, self.tp_rank, self.tp_size)
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, shard)
            loaded.add(name)
        return loaded
'''

PLANTS: List[Tuple[str, str, str]] = [  # (setup, body, expected code)
    ("        side = []", "            if name.startswith('vision.'):\n                side.append((name, loaded_weight))\n"
     "                continue", "OWN101"),
    ("        pending = {}", "            if name.endswith('scale'):\n                pending[name] = loaded_weight\n"
     "                continue", "OWN101"),
    ("        weights = list(weights)", "", "OWN103"),
    ("        kept = {}", "            if name.endswith('.a'):\n                self._park(kept, name, loaded_weight)\n"
     "                continue", "OWN101"),
]

PARK = '''
    def _park(self, kept: dict, name: str, tensor: torch.Tensor) -> None:
        kept.setdefault(name.rsplit(".", 1)[0], []).append(tensor)
'''

COMMON = '''"""Shared helpers of the synthesised tree."""
import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


def maybe_remap_name(name: str) -> str:
    return name.replace("gamma", "weight").replace("beta", "bias")
'''


def synthesise(root: str, modules: int, layers_per_module: int = 8, plant_every: int = 3) -> Tuple[int, int]:
    """Write the tree; return (lines, planted retaining statements)."""
    lines = planted = 0
    with open(os.path.join(root, "common.py"), "w", encoding="utf-8") as fh:
        fh.write(COMMON)
        lines += COMMON.count("\n")
    for i in range(modules):
        parts = [HEADER.format(i=i)]
        parts += [LAYER.format(i=i, j=j) for j in range(layers_per_module)]
        setup, body = "", ""
        if i % plant_every == 0:
            setup, body, _ = PLANTS[(i // plant_every) % len(PLANTS)]
            planted += 1
        model = MODEL.format(i=i, planted_setup=setup or "        pass", planted_body=body or "            pass")
        if "self._park" in body:
            model += PARK
        parts.append(model)
        text = "".join(parts)
        with open(os.path.join(root, f"model_{i:04d}.py"), "w", encoding="utf-8") as fh:
            fh.write(text)
        lines += text.count("\n")
    return lines, planted


def parse_only(root: str) -> float:
    """The floor: read and parse every file, one at a time, with the cyclic collector paused as the
    audit pauses it (with it on, parsing alone costs ~15% more here)."""
    gc.disable()
    try:
        start = time.perf_counter()
        for name in sorted(os.listdir(root)):
            with open(os.path.join(root, name), "rb") as fh:
                ast.parse(fh.read().decode("utf-8"), filename=name)
        return time.perf_counter() - start
    finally:
        gc.enable()


def audit_once(root: str) -> Tuple[float, int, int]:
    start = time.perf_counter()
    result = audit_paths([root])
    return time.perf_counter() - start, len(result.findings), result.lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", type=int, default=820, help="model files (~370 lines each; default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement (default: %(default)s)")
    p.add_argument("--keep", metavar="DIR", default=None, help="write the tree here and keep it")
    args = p.parse_args(argv)
    root = args.keep or tempfile.mkdtemp(prefix="ownsan-audit-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        lines, planted = synthesise(root, args.modules)
        parse_times = [parse_only(root) for _ in range(args.repeat)]
        runs = [audit_once(root) for _ in range(args.repeat)]
        audit_times = [t for t, _, _ in runs]
        findings = runs[0][1]
        best_parse, best_audit = min(parse_times), min(audit_times)
        print(f"tree: {args.modules + 1} files, {lines} lines, {planted} planted retaining statements")
        print(f"{'':24}{'best s':>9}{'median s':>10}{'lines/s':>12}")
        print(f"{'read + ast.parse alone':24}{best_parse:9.2f}{statistics.median(parse_times):10.2f}"
              f"{lines / best_parse:12,.0f}")
        print(f"{'ownsan audit':24}{best_audit:9.2f}{statistics.median(audit_times):10.2f}"
              f"{lines / best_audit:12,.0f}")
        print(f"audit / parse: {best_audit / best_parse:.2f}x; findings {findings} (planted {planted}); "
              f"target <= 10 s for 300,000 lines: {'met' if best_audit * 300_000 / lines <= 10 else 'NOT met'} "
              f"({best_audit * 300_000 / lines:.2f} s scaled to 300,000 lines)")
        return 0 if findings == planted else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
