"""A local variable that keeps a yielded tensor past its step (OWN105): read after the loop, or by a
later iteration (a tensor parked in a variable until its partner arrives)."""
from typing import Iterable

import torch
from torch import nn
from safetensors import safe_open


class KeepVariables(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        embed = None
        for name, w in weights:
            if name == "embed_tokens.weight":
                embed = w  # expect: OWN105
            self.get_parameter(name).data.copy_(w)
        if self.config.tie_word_embeddings and embed is not None:
            self.lm_head.weight.data.copy_(embed)

    def load_pairs(self, weights: Iterable[tuple[str, torch.Tensor]]):
        gate = None
        for name, w in weights:
            if name.endswith("gate_proj.weight"):
                gate = w.t()  # expect: OWN105
                continue
            if name.endswith("up_proj.weight") and gate is not None:
                self.get_parameter(name.replace("up_proj", "gate_up_proj")).data.copy_(torch.cat([gate, w.t()]))
                gate = None

    def load_previous(self, weights: Iterable[tuple[str, torch.Tensor]]):
        previous = None
        for name, w in weights:
            if previous is not None and name.endswith(".bias"):
                self.fuse(previous, w)
            previous = w  # expect: OWN105


# -- safe look-alikes ---------------------------------------------------------------------------------
class SafeVariables(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        embed = None
        for name, w in weights:
            if name.endswith("norm.weight"):
                w = w.float()  # the loop variable itself: every step rebinds it
            if name == "embed_tokens.weight":
                embed = w.clone()  # owned
            t = w.t() if name.endswith("proj.weight") else w  # bound on every path, read in the step
            self.get_parameter(name).data.copy_(t)
        if embed is not None:
            self.lm_head.weight.data.copy_(embed)

    def load_branches(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, w in weights:
            if name.endswith("a"):
                shard = w.narrow(0, 0, 2)
            elif name.endswith("b"):
                shard = w.narrow(0, 2, 2)
            else:
                continue
            self.get_parameter(name).data.copy_(shard)

    def load_shape_after(self, weights: Iterable[tuple[str, torch.Tensor]]):
        last_shape = None
        for name, w in weights:
            last_shape = w.shape  # metadata
            self.get_parameter(name).data.copy_(w)
        return last_shape


def safe_walrus_read_in_the_same_step(weights: Iterable[tuple[str, torch.Tensor]], params):
    for name, w in weights:
        if (t := w.t()) is not None:
            params[name].copy_(t)
        if (u := w[0]) is not None and u.sum() > 0:
            params[name].copy_(u)


def keep_walrus_bound_on_some_steps(weights: Iterable[tuple[str, torch.Tensor]], params):
    for name, w in weights:
        if name.endswith("b") and (t := w) is not None:  # expect: OWN105
            pass
        params[name].copy_(t)


def safe_last_fetch_returned(path, keys):
    """A getter fetched once per key, the last one's entry returned straight after the loop: nothing
    fetches between the loop's end and the `return`, so the last tensor is still the loader's current one
    (issue 50, false-alarm class a)."""
    f = safe_open(path, framework="pt")
    for key in keys:
        tensor = f.get_tensor(key)
        res = {"name": key, "tensor": tensor}
    return res


def keep_last_fetch_then_fetch_again(path, keys):
    """The same, but a fetch happens between the loop and the `return`: the kept entry is stale."""
    f = safe_open(path, framework="pt")
    for key in keys:
        tensor = f.get_tensor(key)
        res = {"name": key, "tensor": tensor}  # expect: OWN105
    extra = f.get_tensor("lm_head.weight")
    return res, extra


def keep_last_of_stream_returned(weights: Iterable[tuple[str, torch.Tensor]]):
    """A weights iterator is resumed once more to find its end: its last item is stale after the loop."""
    for name, w in weights:
        last = w  # expect: OWN105
    return last
