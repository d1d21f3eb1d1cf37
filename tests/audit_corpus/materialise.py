"""Materialising the weights iterator (OWN103), and look-alikes that keep only names."""
import itertools
from typing import Iterable, Iterator

import torch
from torch import nn


class KeepList(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        all_weights = list(weights)  # expect: OWN103
        has_prefix = any(n.startswith("model.") for n, _ in all_weights)
        loaded = set()
        for name, tensor in all_weights:
            self.get_parameter(name if has_prefix else "model." + name).data.copy_(tensor)
            loaded.add(name)
        return loaded


class KeepTupleSorted(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        ordered = sorted(weights, key=lambda item: item[0])  # expect: OWN103
        for name, w in ordered:
            self.get_parameter(name).data.copy_(w)

    def load_frozen(self, weights: Iterable[tuple[str, torch.Tensor]]):
        frozen = tuple(weights)  # expect: OWN103
        return len(frozen)


def keep_dict(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    state = dict(weights)  # expect: OWN103
    model.load_state_dict(state, strict=False)


def keep_list_comprehension(weights: Iterable[tuple[str, torch.Tensor]]):
    kept = [(name, w) for name, w in weights if not name.startswith("lm_head")]  # expect: OWN103
    return kept


def keep_dict_comprehension(weights: Iterable[tuple[str, torch.Tensor]]):
    by_name = {name.removeprefix("model."): w.t() for name, w in weights}  # expect: OWN103
    return by_name


def keep_tee(all_weights: Iterable[tuple[str, torch.Tensor]]):
    first, second = itertools.tee(all_weights)  # expect: OWN103
    vision = ((n, w) for n, w in first if n.startswith("vision."))
    text = ((n, w) for n, w in second if not n.startswith("vision."))
    return vision, text


def keep_star_unpack(weights: Iterable[tuple[str, torch.Tensor]]):
    everything = [*weights]  # expect: OWN103
    return everything


def keep_extend(weights: Iterable[tuple[str, torch.Tensor]]):
    pending: list = []
    pending.extend(weights)  # expect: OWN103
    return pending


def keep_list_of_generator(weights: Iterator[tuple[str, torch.Tensor]]):
    renamed = list((n.replace("gamma", "weight"), w) for n, w in weights)  # expect: OWN103
    return renamed


# -- safe look-alikes ---------------------------------------------------------------------------------
class SafeNames(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())  # a dict of the model's own parameters, not of the weights
        seen = []
        for name, w in weights:
            params[name].data.copy_(w)
            seen.append(name)  # names only
        return set(sorted(seen))


def safe_name_comprehension(weights: Iterable[tuple[str, torch.Tensor]]):
    names = [name for name, _ in weights]  # a container of names
    return names


def safe_shapes_dict(weights: Iterable[tuple[str, torch.Tensor]]):
    shapes = {name: tuple(w.shape) for name, w in weights}  # metadata only
    return shapes


def safe_lazy_filter(weights: Iterable[tuple[str, torch.Tensor]]):
    kept = ((n, w) for n, w in weights if not n.startswith("lm_head"))  # lazy: still one item per step
    return itertools.chain(kept, iter(()))


def safe_owned_list(weights: Iterable[tuple[str, torch.Tensor]]):
    owned = [(name, w.clone()) for name, w in weights]  # every element is a copy
    return owned


def safe_cloned_dict(weights: Iterable[tuple[str, torch.Tensor]]):
    return {name: w.detach().clone() for name, w in weights}
