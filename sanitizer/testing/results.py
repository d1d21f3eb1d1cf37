"""What a consumer built, as comparable values: every tensor (and plain value) reachable from its result.

A consumer returns a module, a dict of tensors, a list, a dataclass, or None.
:func:`reachable` flattens it into ``{path: value}``: an ``nn.Module`` gives its
state dict (parameters and persistent buffers), its non-persistent buffers and
the tensors in its public attributes that are containers (``self.cache = {}``);
mappings, lists, tuples and dataclasses are walked; tensors and plain values
(numbers, strings, None) are leaves; any other object is not compared.
Nothing here runs a tensor op, so flattening a result that holds stale views
reads nothing.

:func:`differences` compares two flattenings bit for bit: the bytes of each
tensor (NaN equals the same NaN; ``torch.equal`` would call two NaNs
different), its dtype, shape and device, and the same set of paths.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, List

import torch
from torch import nn

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reachable(value: Any, root: str = "result") -> Dict[str, Any]:
    """``{path: tensor or plain value}`` for everything comparable in ``value``, paths rooted at ``root``."""
    out: Dict[str, Any] = {}
    _walk(value, root, out, set())
    return out


def _walk(value: Any, path: str, out: Dict[str, Any], seen: set) -> None:
    if isinstance(value, torch.Tensor):
        out[path] = value
        return
    if isinstance(value, _PLAIN):
        out[path] = value
        return
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, nn.Module):
        _walk_module(value, path, out, seen)
    elif isinstance(value, Mapping):
        for k in list(value.keys()):
            _walk(value[k], f"{path}[{k!r}]", out, seen)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _walk(v, f"{path}[{i}]", out, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _walk(getattr(value, f.name), f"{path}.{f.name}", out, seen)


def _walk_module(module: nn.Module, path: str, out: Dict[str, Any], seen: set) -> None:
    """State dict (kept as they are: no detach, which is an op), non-persistent buffers, and the
    containers of tensors a module keeps in public attributes of its own and of its submodules."""
    for key, t in module.state_dict(keep_vars=True).items():
        out[f"{path}.{key}"] = t
    for key, t in module.named_buffers():
        out.setdefault(f"{path}.{key}", t)
    for prefix, sub in module.named_modules():
        for attr, v in vars(sub).items():
            if attr.startswith("_") or isinstance(v, (nn.Module, _PLAIN)) or id(v) in seen:
                continue
            if isinstance(v, (torch.Tensor, Mapping, list, tuple)) or dataclasses.is_dataclass(v):
                where = f"{path}.{prefix}.{attr}" if prefix else f"{path}.{attr}"
                _walk(v, where, out, seen)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's values as same-size integers (bit patterns), flat."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    size = flat.element_size()
    if flat.dtype.is_complex or size not in _INT_OF_SIZE or flat.dtype == torch.bool:
        return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    return flat.view(_INT_OF_SIZE[size])


def tensor_difference(want: torch.Tensor, got: torch.Tensor) -> str:
    """Why ``got`` is not bit-identical to ``want`` ("" when it is)."""
    if want.dtype != got.dtype:
        return f"dtype {str(got.dtype)[6:]}, expected {str(want.dtype)[6:]}"
    if tuple(want.shape) != tuple(got.shape):
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if want.device != got.device:
        return f"device {got.device}, expected {want.device}"
    if want.is_meta or got.is_meta or want.numel() == 0:
        return ""
    if want.layout is not torch.strided or got.layout is not torch.strided:
        return "" if torch.equal(want, got) else "values differ"
    a, b = _as_bits(want), _as_bits(got)
    if torch.equal(a, b):
        return ""
    n = int((a != b).sum())
    of = a.numel()
    return f"{n} of {of} {'bytes' if a.element_size() == 1 and want.element_size() != 1 else 'elements'} differ"


def differences(want: Dict[str, Any], got: Dict[str, Any]) -> List[str]:
    """Every way ``got`` differs from ``want`` (both from :func:`reachable`), one line each; [] when identical."""
    out = [f"{p}: missing" for p in want if p not in got]
    out += [f"{p}: not in the oracle's result" for p in got if p not in want]
    for p, w in want.items():
        if p not in got:
            continue
        g = got[p]
        if isinstance(w, torch.Tensor) or isinstance(g, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor)):
                out.append(f"{p}: {type(g).__name__}, expected {type(w).__name__}")
                continue
            why = tensor_difference(w, g)
            if why:
                out.append(f"{p}: {why}")
        elif type(w) is not type(g) or (w != g and not (w != w and g != g)):  # NaN == NaN here
            out.append(f"{p}: {g!r:.60}, expected {w!r:.60}")
    return out


__all__ = ["reachable", "differences", "tensor_difference"]
