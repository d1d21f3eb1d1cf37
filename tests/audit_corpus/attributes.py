"""Attribute stores that outlive the step (OWN102): ``self.x = t``, ``param.data = t``,
``nn.Parameter(t)`` on a module, ``setattr``, ``register_buffer``."""
from typing import Iterable

import torch
from torch import nn


class KeepAttributes(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "score.bias":
                self.score.bias = nn.Parameter(w.to(self.score.weight.dtype))  # expect: OWN107
            elif name == "lm_head.weight":
                self.lm_head_weight = w  # expect: OWN102
            elif name in params:
                params[name].data = w  # expect: OWN102
            elif name.startswith("buffers."):
                self.register_buffer(name.split(".")[-1], w, persistent=False)  # expect: OWN102
            else:
                setattr(self, name.replace(".", "_"), nn.Parameter(w, requires_grad=False))  # expect: OWN102


def keep_on_module(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]):
    for name, w in weights:
        module.weight = torch.nn.Parameter(w.detach())  # expect: OWN102


# -- safe look-alikes ---------------------------------------------------------------------------------
class SafeAttributes(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "score.bias":
                self.score.bias = nn.Parameter(w.to(self.score.weight.dtype).clone())
            elif name in params:
                params[name].data.copy_(w)
                params[name].shard_id = name  # an attribute on the parameter: a name, not a tensor
            else:
                self.last_loaded = name
                self.num_elements = w.numel()
                w.shard_id = 0  # an attribute set on the yielded tensor itself keeps nothing


def safe_attribute_of_view(weights: Iterable[tuple[str, torch.Tensor]]):
    for name, w in weights:
        shard = w.detach()
        shard.output_dim = 0  # metadata on a view that dies in the step
        yield name, shard
