"""The online quantizer of the reference consumer: per-row int8 absmax.

Small on purpose: what matters to the demo is that it runs once per layer,
after every deferred weight of that layer was replayed (so a weight corrupted
in the staging ring corrupts its rows), and that it is deterministic, so two
loads of the same checkpoint compare bit for bit.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

QUANTIZED_PARAMS = ("weight", "w13_weight", "w2_weight")


def quantize_rowwise_int8(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 values and float32 scales over the last dim, ``w ~= q * scale[..., None]``."""
    x = w.detach().float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.squeeze(-1)


class Int8RowwiseOnlineMethod:
    """A ``quant_method`` in vLLM's shape: ``process_weights_after_loading(layer)`` replaces weights."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in QUANTIZED_PARAMS:
            param = layer._parameters.get(name)
            if param is None:
                continue
            if param.is_meta:
                raise ValueError(f"{type(layer).__name__}.{name} is still on the meta device: nothing was loaded")
            q, scale = quantize_rowwise_int8(param.data)
            layer.register_parameter(name, nn.Parameter(q, requires_grad=False))
            layer.register_parameter(f"{name}_scale", nn.Parameter(scale, requires_grad=False))


__all__ = ["quantize_rowwise_int8", "Int8RowwiseOnlineMethod", "QUANTIZED_PARAMS"]
