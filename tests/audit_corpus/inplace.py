"""In-place writes into a yielded tensor (OWN120): with a borrowing loader they write into the loader's
staging buffer, and a later tensor, or another consumer of the same bytes, sees them."""
from typing import Iterable

import torch
from torch import nn


class KeepInplace(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, loaded_weight in weights:
            if "norm.weight" in name:
                loaded_weight += 1.0  # expect: OWN120
            if name.endswith(".bias") and self.tp_rank != 0:
                loaded_weight.zero_()  # expect: OWN120
            if name.endswith("scale"):
                loaded_weight.narrow(0, 0, 1).mul_(self.scale)  # expect: OWN120
            if name.endswith("mask"):
                loaded_weight[loaded_weight < 0] = 0  # expect: OWN120
            if name.endswith("sum"):
                torch.add(loaded_weight, 1, out=loaded_weight)  # expect: OWN120
            self.get_parameter(name).data.copy_(loaded_weight)


def keep_inplace_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    loaded_weight.div_(loaded_weight.abs().max())  # expect: OWN120
    param.data.copy_(loaded_weight)


# -- safe look-alikes ---------------------------------------------------------------------------------
class SafeInplace(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, loaded_weight in weights:
            param = self.get_parameter(name)
            if "norm.weight" in name:
                loaded_weight = loaded_weight + 1.0  # a new tensor
            if name.endswith(".bias"):
                owned = loaded_weight.clone()
                owned.zero_()  # writes into our own copy
                loaded_weight = owned
            param.data.copy_(loaded_weight)
            param.data.mul_(2)  # writes into the parameter
            param.requires_grad_(False)
            loaded_weight.requires_grad_(False)  # metadata only


def safe_inplace_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)
    param.data.div_(param.data.abs().max())


class KeepInPlaceThroughAttribute(nn.Module):
    """A bias folded in after the weight is stored on the module: the write goes through the attribute
    the borrowed view was stored in (issue 50, pattern 3)."""

    def weight_loader(self, param, loaded_weight):
        self.weight = loaded_weight  # expect: OWN102
        self.weight += self.bias_fold  # expect: OWN120
        self.weight.data.mul_(self.scale)  # expect: OWN120


class SafeInPlaceAfterReplacingAttribute(nn.Module):
    """The attribute is given an owned copy before the write."""

    def weight_loader(self, param, loaded_weight):
        self.weight = loaded_weight.clone()
        self.weight += self.bias_fold
