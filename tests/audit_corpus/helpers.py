"""Retention through a helper: a function of the same module, a method of the same class, a nested
function, a helper that returns a view, a constructor that keeps its argument, a helper that stores
into a container its caller passed in."""
from typing import Iterable

import torch
from torch import nn

from .helpers_shared import stash_for_fusion, copy_into


def _park(pending: dict, name: str, tensor: torch.Tensor) -> bool:
    entry = pending.setdefault(name.rsplit(".", 1)[0], {})
    entry[name.rsplit(".", 1)[1]] = tensor  # expect: OWN101
    return len(entry) == 2


def _first_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.narrow(0, 0, n)


class _Held:
    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.tensor = tensor  # not itself a retention: the new object is kept below, or dies in the step


class KeepThroughHelpers(nn.Module):
    def _remember(self, name: str, tensor: torch.Tensor) -> None:
        self.remembered[name] = tensor  # expect: OWN101

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        pending: dict = {}
        held = []
        kept = {}
        for name, loaded_weight in weights:
            if _park(pending, name, loaded_weight):
                continue
            self._remember(name, loaded_weight)
            kept[name] = _first_rows(loaded_weight, 2)  # expect: OWN101
            held.append(_Held(name, loaded_weight))  # expect: OWN101
        return pending, held, kept


class KeepNestedHelper(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        deferred = {}

        def _defer(name, w):
            deferred[name] = w  # expect: OWN101

        for name, w in weights:
            if name.endswith(".scale"):
                _defer(name, w)
        return deferred


class KeepImportedHelper(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        buffers = {}
        for name, w in weights:
            stash_for_fusion(buffers, name, w)
        return buffers


# -- safe look-alikes ---------------------------------------------------------------------------------
def _park_per_step(pending: dict, name: str, tensor: torch.Tensor) -> None:
    pending[name] = tensor  # the caller passes a dict that dies with its step


def _copy_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.narrow(0, 0, n).clone()


class _Shape:
    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.shape = tuple(tensor.shape)


class SafeThroughHelpers(nn.Module):
    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        self.get_parameter(name).data.copy_(tensor)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        kept = {}
        shapes = []
        for name, loaded_weight in weights:
            per_step: dict = {}
            _park_per_step(per_step, name, loaded_weight)
            self._load_one(name, torch.cat(list(per_step.values())))
            kept[name] = _copy_rows(loaded_weight, 2)
            shapes.append(_Shape(name, loaded_weight))
            copy_into(self.get_parameter(name), loaded_weight)
        return kept, shapes
