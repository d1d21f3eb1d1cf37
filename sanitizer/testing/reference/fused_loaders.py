"""A small decoder model with vLLM's parameter layout and weight-loader signatures.

Why it exists: the bug this project catches lives in how real serving code
loads weights. vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` (each checkpoint tensor lands in a shard of one parameter via
``weight_loader(param, loaded_weight, loaded_shard_id)``), stacks MoE experts
into ``w13_weight``/``w2_weight`` (``weight_loader(param, loaded_weight,
weight_name, shard_id, expert_id, return_success)``), and maps checkpoint
names to parameters in ``load_weights``. A fused parameter is complete only
when all its shards arrived, which is what makes a layerwise loader defer.
This module reproduces those semantics on CPU without tensor parallelism.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import nn

from sanitizer.testing.reference.quantize import Int8RowwiseOnlineMethod


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """vLLM's default: copy the whole tensor (shapes must match)."""
    if param.size() != loaded_weight.size():
        raise ValueError(f"Attempted to load weight ({tuple(loaded_weight.size())}) into parameter "
                         f"({tuple(param.size())})")
    param.data.copy_(loaded_weight)


def _param(module: nn.Module, name: str, shape: Tuple[int, ...], dtype: torch.dtype, loader) -> None:
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    module.register_parameter(name, p)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        _param(self, "weight", (hidden,), dtype, default_weight_loader)


class ReplicatedLinear(nn.Module):
    """Also stands for RowParallelLinear at tp=1 (o_proj, down_proj) and the MoE router."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, quantize: bool = True):
        super().__init__()
        _param(self, "weight", (out_features, in_features), dtype, self.weight_loader)
        self.quant_method = Int8RowwiseOnlineMethod() if quantize else None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden: int, head_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype):
        super().__init__()
        self.head_size, self.num_heads, self.num_kv_heads = head_size, num_heads, num_kv_heads
        out = (num_heads + 2 * num_kv_heads) * head_size
        _param(self, "weight", (out, hidden), dtype, self.weight_loader)
        self.quant_method = Int8RowwiseOnlineMethod()

    def shard(self, shard_id: str) -> Tuple[int, int]:
        """``(offset, size)`` in output rows of shard ``q``, ``k`` or ``v``."""
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        table = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        if shard_id not in table:
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return table[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: Optional[str] = None) -> None:
        if loaded_shard_id is None:  # an already fused checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        offset, size = self.shard(loaded_shard_id)
        param.data.narrow(0, offset, size).copy_(loaded_weight)


class MergedColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, output_sizes: List[int], dtype: torch.dtype):
        super().__init__()
        self.output_sizes = list(output_sizes)
        _param(self, "weight", (sum(output_sizes), in_features), dtype, self.weight_loader)
        self.quant_method = Int8RowwiseOnlineMethod()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: Optional[int] = None) -> None:
        if loaded_shard_id is None:
            default_weight_loader(param, loaded_weight)
            return
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {loaded_shard_id!r} out of range for output sizes {self.output_sizes}")
        offset = sum(self.output_sizes[:loaded_shard_id])
        param.data.narrow(0, offset, self.output_sizes[loaded_shard_id]).copy_(loaded_weight)


class FusedMoE(nn.Module):
    """Experts stacked as ``w13_weight`` [E, 2I, H] (gate rows, then up rows) and ``w2_weight`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        _param(self, "w13_weight", (num_experts, 2 * intermediate, hidden), dtype, self.weight_loader)
        _param(self, "w2_weight", (num_experts, hidden, intermediate), dtype, self.weight_loader)
        self.quant_method = Int8RowwiseOnlineMethod()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str,
                      shard_id: str, expert_id: int, return_success: bool = False) -> Optional[bool]:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range for {self.num_experts} experts ({weight_name})")
        expert_data = param.data[expert_id]
        if shard_id in ("w1", "w3"):
            size = expert_data.shape[0] // 2
            expert_data = expert_data.narrow(0, 0 if shard_id == "w1" else size, size)
        elif shard_id != "w2":
            raise ValueError(f"shard_id must be 'w1', 'w2' or 'w3', got {shard_id!r} ({weight_name})")
        expert_data.copy_(loaded_weight)
        return True if return_success else None


@dataclass(frozen=True)
class TinyConfig:
    """Sizes of the model; the defaults make a ~7 MB bf16 checkpoint that loads in well under a second."""

    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 512
    dense_layers: int = 3
    moe_layers: int = 1
    experts: int = 4
    moe_intermediate: int = 256
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "dtype" and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if "layers" in f.name else 1)):
                raise ValueError(f"TinyConfig.{f.name} must be a positive int, got {v!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must divide by heads {self.heads}, heads by kv_heads {self.kv_heads}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"TinyConfig.dtype must name a torch dtype, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def num_layers(self) -> int:
        return self.dense_layers + self.moe_layers

    def to_metadata(self) -> Dict[str, str]:
        return {f"tiny.{k}": str(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: Dict[str, str]) -> "TinyConfig":
        kw = {f.name: (meta[f"tiny.{f.name}"] if f.name == "dtype" else int(meta[f"tiny.{f.name}"]))
              for f in dataclasses.fields(cls) if f"tiny.{f.name}" in meta}
        return cls(**kw)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyConfig, moe: bool):
        super().__init__()
        dt, h = cfg.torch_dtype, cfg.hidden
        self.input_layernorm = RMSNorm(h, dt)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(h, h // cfg.heads, cfg.heads, cfg.kv_heads, dt)
        self.self_attn.o_proj = ReplicatedLinear(h, h, dt)
        self.post_attention_layernorm = RMSNorm(h, dt)
        self.mlp = nn.Module()
        if moe:
            self.mlp.gate = ReplicatedLinear(h, cfg.experts, dt, quantize=False)
            self.mlp.experts = FusedMoE(cfg.experts, h, cfg.moe_intermediate, dt)
        else:
            self.mlp.gate_up_proj = MergedColumnParallelLinear(h, [cfg.intermediate] * 2, dt)
            self.mlp.down_proj = ReplicatedLinear(cfg.intermediate, h, dt)


class TinyForCausalLM(nn.Module):
    """``model.layers.N...``: dense layers first, then MoE layers. Build it under ``torch.device("meta")``."""

    stacked_params_mapping = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                              ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, moe=i >= cfg.dense_layers) for i in range(cfg.num_layers))

    def expert_params_mapping(self) -> List[Tuple[str, str, int, str]]:
        return [("experts.w13_" if name in ("gate_proj", "up_proj") else "experts.w2_",
                 f"experts.{e}.{name}.", e, shard)
                for e in range(self.config.experts)
                for shard, name in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> Set[str]:
        """vLLM's name mapping: each checkpoint tensor goes to its parameter's ``weight_loader``."""
        params = dict(self.named_parameters())
        experts = self.expert_params_mapping()
        loaded: Set[str] = set()
        for name, w in weights:
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name or "mlp.experts" in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = _lookup(params, name)
                param.weight_loader(param, w, shard_id)
                break
            else:
                for param_name, weight_name, expert_id, shard_id in experts:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    param = _lookup(params, name)
                    param.weight_loader(param, w, name, shard_id=shard_id, expert_id=expert_id)
                    break
                else:
                    param = _lookup(params, name)
                    getattr(param, "weight_loader", default_weight_loader)(param, w)
            loaded.add(name)
        return loaded


def _lookup(params: Dict[str, nn.Parameter], name: str) -> nn.Parameter:
    try:
        return params[name]
    except KeyError:
        raise KeyError(f"checkpoint tensor maps to '{name}', which the model has no parameter for") from None


def checkpoint_layout(cfg: TinyConfig) -> List[Tuple[str, Tuple[int, ...], str, Optional[int], int, int]]:
    """Every checkpoint tensor in natural (layer-grouped) order, with where it lands:

    ``(name, shape, parameter, expert id or None, first row, end row)``; rows
    index the parameter's (expert's) first dim, which the per-row quantizer keeps.
    """
    h, hs = cfg.hidden, cfg.hidden // cfg.heads
    q, kv, inter, mi = cfg.heads * hs, cfg.kv_heads * hs, cfg.intermediate, cfg.moe_intermediate
    out: List[Tuple[str, Tuple[int, ...], str, Optional[int], int, int]] = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", (h,), f"{p}.input_layernorm.weight", None, 0, h))
        for shard, off, size in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
            out.append((f"{p}.self_attn.{shard}_proj.weight", (size, h), f"{p}.self_attn.qkv_proj.weight", None,
                        off, off + size))
        out.append((f"{p}.self_attn.o_proj.weight", (h, q), f"{p}.self_attn.o_proj.weight", None, 0, h))
        out.append((f"{p}.post_attention_layernorm.weight", (h,), f"{p}.post_attention_layernorm.weight", None, 0, h))
        if i < cfg.dense_layers:
            out.append((f"{p}.mlp.gate_proj.weight", (inter, h), f"{p}.mlp.gate_up_proj.weight", None, 0, inter))
            out.append((f"{p}.mlp.up_proj.weight", (inter, h), f"{p}.mlp.gate_up_proj.weight", None, inter, 2 * inter))
            out.append((f"{p}.mlp.down_proj.weight", (h, inter), f"{p}.mlp.down_proj.weight", None, 0, h))
        else:
            out.append((f"{p}.mlp.gate.weight", (cfg.experts, h), f"{p}.mlp.gate.weight", None, 0, cfg.experts))
            for e in range(cfg.experts):
                x = f"{p}.mlp.experts.{e}"
                out.append((f"{x}.gate_proj.weight", (mi, h), f"{p}.mlp.experts.w13_weight", e, 0, mi))
                out.append((f"{x}.up_proj.weight", (mi, h), f"{p}.mlp.experts.w13_weight", e, mi, 2 * mi))
                out.append((f"{x}.down_proj.weight", (h, mi), f"{p}.mlp.experts.w2_weight", e, 0, h))
    return out


__all__ = ["TinyConfig", "TinyForCausalLM", "QKVParallelLinear", "MergedColumnParallelLinear", "FusedMoE",
           "ReplicatedLinear", "RMSNorm", "default_weight_loader", "checkpoint_layout"]
