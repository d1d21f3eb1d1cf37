"""Per-tensor weight loaders (``weight_loader(param, loaded_weight, shard_id)``): the step is the call."""
from typing import Optional

import torch
from torch import nn


class KeepLoaders(nn.Module):
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None):
        if shard_id is None:
            param.data = loaded_weight  # expect: OWN102
            return
        self.shards.setdefault(param, []).append(loaded_weight.narrow(0, 0, 8))  # expect: OWN101
        if len(self.shards[param]) == self.num_shards:
            param.data.copy_(torch.cat(self.shards.pop(param)))


def sharded_weight_loader(shard_axis: int, pending: list):
    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        pending.append(loaded_weight.narrow(shard_axis, 0, param.shape[shard_axis]))  # expect: OWN101

    return loader


def keep_expert_loader(expert_data: torch.Tensor, w: torch.Tensor, cache: dict, expert_id: int):
    cache[expert_id] = w  # expect: OWN101


# -- safe look-alikes ---------------------------------------------------------------------------------
class SafeLoaders(nn.Module):
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None):
        param_data = param.data
        if shard_id is not None:
            size = param_data.shape[0] // self.num_shards
            param_data = param_data.narrow(0, shard_id * size, size)
            loaded_weight = loaded_weight.narrow(0, self.tp_rank * size, size)
        param_data.copy_(loaded_weight)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.numel() == 1 and loaded_weight.numel() == 1:
        param.data.fill_(loaded_weight.item())
    else:
        param.data.copy_(loaded_weight)
