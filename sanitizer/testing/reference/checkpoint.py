"""Real ``.safetensors`` checkpoints in a chosen tensor order, read back through a staging ring.

Which tensors a ring overwrites before a deferring consumer replays them
depends on the *file order* (``safetensors.torch.save_file`` picks its own),
so the writer lays tensors out in the order asked for. The reader does what
fast loaders do: ``readinto`` each tensor's bytes straight into the ring and
hand out the ring's view (borrowed), or an owned copy (``copy=True``, the
``INSTANTTENSOR_COPY=1`` strategy). The reference is ``safetensors.torch.load_file``.
"""
from __future__ import annotations

import json
import random
import struct
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from sanitizer.core.safetensors_header import read_header as _read_raw_header
from sanitizer.testing.reference.fused_loaders import TinyConfig, TinyForCausalLM, checkpoint_layout
from sanitizer.features.ownership import own
from sanitizer.torch_layer.ring import StagingRing

ORDERS = ("interleaved", "grouped", "sorted", "shuffled")
_ST = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
       torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
       torch.bool: "BOOL"}
_FROM_ST = {v: k for k, v in _ST.items()}

Entry = Tuple[str, torch.dtype, Tuple[int, ...], int, int]  # name, dtype, shape, begin, end (data offsets)


def _layer_of(name: str) -> int:
    return int(name.split(".")[2])


def ordered_names(cfg: TinyConfig, order: str, seed: int = 0) -> List[str]:
    """Checkpoint tensor names in ``order``: ``interleaved`` (round-robin across layers, the worst case
    for deferral), ``grouped`` (layer by layer), ``sorted`` (by name) or ``shuffled`` (seeded)."""
    names = [entry[0] for entry in checkpoint_layout(cfg)]
    if order == "grouped":
        return names
    if order == "sorted":
        return sorted(names)
    if order == "shuffled":
        random.Random(seed).shuffle(names)
        return names
    if order == "interleaved":
        per_layer: Dict[int, List[str]] = {}
        for n in names:
            per_layer.setdefault(_layer_of(n), []).append(n)
        lists = list(per_layer.values())
        return [lst[k] for k in range(max(map(len, lists))) for lst in lists if k < len(lst)]
    raise ValueError(f"unknown checkpoint order {order!r}; valid orders: {', '.join(ORDERS)}")


def make_tensors(cfg: TinyConfig, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Deterministic weights: N(0, 0.02) matrices, norms near 1, in the config's dtype."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, *_ in checkpoint_layout(cfg):
        x = torch.randn(shape, generator=gen) * 0.02
        if len(shape) == 1:
            x += 1.0
        out[name] = x.to(cfg.torch_dtype)
    return out


def write_checkpoint(path: str, cfg: TinyConfig, order: str = "interleaved", seed: int = 0) -> Dict[str, int]:
    """Write a safetensors file whose data lies in ``order``; returns sizes (bytes, tensors, largest)."""
    tensors = make_tensors(cfg, seed)
    header: Dict[str, dict] = {"__metadata__": {**cfg.to_metadata(), "order": order, "seed": str(seed)}}
    offset, largest = 0, 0
    names = ordered_names(cfg, order, seed)
    for name in names:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        largest = max(largest, nbytes)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name in names:
            fh.write(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return {"bytes": offset, "tensors": len(names), "largest": largest}


def read_header(path: str) -> Tuple[List[Entry], int, Dict[str, str]]:
    """``(entries in file order, offset of the data section, metadata)``."""
    header, meta, data_start = _read_raw_header(path)
    entries = []
    for name, spec in header.items():
        if spec["dtype"] not in _FROM_ST:
            raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {spec['dtype']}")
        begin, end = spec["data_offsets"]
        entries.append((name, _FROM_ST[spec["dtype"]], tuple(spec["shape"]), begin, end))
    entries.sort(key=lambda e: e[3])
    return entries, data_start, meta


def stream_through_ring(path: str, ring: StagingRing, *, copy: bool = False) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` in file order, each read into ``ring`` (borrowed) or copied out (owned)."""
    entries, data_start, _ = read_header(path)
    with open(path, "rb", buffering=0) as fh:
        for name, dtype, shape, begin, _end in entries:
            fh.seek(data_start + begin)
            view = ring.put(name, fh, shape=shape, dtype=dtype)
            yield name, (own(view, "all") if copy else view)


def deferral_windows(path: str, cfg: TinyConfig) -> Dict[str, int]:
    """Bytes streamed from a fused parameter's first shard to its last (inclusive), per parameter.

    A consumer that defers until a parameter is complete keeps its first
    shard through this many bytes of ring traffic; a ring smaller than that
    has reused the shard by replay time.
    """
    entries, _, _ = read_header(path)
    where = {e[0]: (e[3], e[4]) for e in entries}
    spans: Dict[str, Tuple[int, int]] = {}
    for name, _shape, param, *_ in checkpoint_layout(cfg):
        begin, end = where[name]
        lo, hi = spans.get(param, (begin, end))
        spans[param] = (min(lo, begin), max(hi, end))
    counts: Dict[str, int] = {}
    for _name, _shape, param, *_ in checkpoint_layout(cfg):
        counts[param] = counts.get(param, 0) + 1
    return {p: hi - lo for p, (lo, hi) in spans.items() if counts[p] > 1}


def config_of(path: str) -> TinyConfig:
    return TinyConfig.from_metadata(read_header(path)[2])


def reference_state(path: str) -> Dict[str, torch.Tensor]:
    """Load with ``safetensors.torch.load_file`` (owned tensors), no deferral, then the same quantizer."""
    from safetensors.torch import load_file

    model = TinyForCausalLM(config_of(path))
    model.load_weights(sorted(load_file(path).items()))
    for layer in model.modules():
        qm = getattr(layer, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(layer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def corrupted_tensors(model: torch.nn.Module, reference: Dict[str, torch.Tensor], cfg: TinyConfig) -> List[str]:
    """Checkpoint tensors whose rows in ``model`` (quantized values and scales) differ from ``reference``."""
    state = model.state_dict()
    bad = []
    for name, _shape, param, expert, lo, hi in checkpoint_layout(cfg):
        keys = [param] + ([param + "_scale"] if param + "_scale" in reference else [])
        for key in keys:
            got: Optional[torch.Tensor] = state.get(key)
            want = reference[key]
            if got is None or got.is_meta or got.shape != want.shape:
                bad.append(name)
                break
            if expert is not None:
                got, want = got[expert], want[expert]
            if not torch.equal(got[lo:hi], want[lo:hi]):
                bad.append(name)
                break
    return bad


__all__ = ["ORDERS", "ordered_names", "make_tensors", "write_checkpoint", "read_header", "stream_through_ring",
           "deferral_windows", "config_of", "reference_state", "corrupted_tensors"]
