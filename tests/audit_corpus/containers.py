"""Stores into containers that outlive the step (OWN101): side lists, dicts by name, tensors parked
until a partner arrives; and per-step containers that die with the step."""
import heapq
import queue
from collections import defaultdict
from typing import Iterable

import torch
from torch import nn


class KeepSideList(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        vision_weights = []
        text_weights: list[tuple[str, torch.Tensor]] = []
        loaded = set()
        for name, loaded_weight in weights:
            if name.startswith("vision_tower."):
                vision_weights.append((name[len("vision_tower."):], loaded_weight))  # expect: OWN101
            elif name.startswith("lm."):
                text_weights.append((name, loaded_weight))  # expect: OWN101
            else:
                self.get_parameter(name).data.copy_(loaded_weight)
                loaded.add(name)
        self.vision.load_weights(vision_weights)
        self.lm.load_weights(text_weights)
        return loaded


class KeepDictByName(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        draft_weights = {}
        for name, loaded_weight in weights:
            if "t2d" in name:
                continue
            draft_weights["model." + name] = loaded_weight  # expect: OWN101
        self.model.load_weights(draft_weights.items())


class KeepPartner(nn.Module):
    """A fused projection needs both halves: the first waits in a dict for the second."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in weights:
            if name.endswith(("q_a_proj.weight", "kv_a_proj.weight")):
                prefix, part = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
                entry = pending.setdefault(prefix, {})
                entry[part] = w  # expect: OWN101
                if len(entry) < 2:
                    continue
                fused = torch.cat([entry["q_a_proj"], entry["kv_a_proj"]], dim=0)
                del pending[prefix]
                self.get_parameter(prefix + ".fused_a_proj.weight").data.copy_(fused)


class KeepNestedDict(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        qkv = defaultdict(lambda: [None, None, None])
        for name, w in weights:
            for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                if part in name:
                    qkv[name.replace(part, "qkv_proj")][i] = w  # expect: OWN101
        for fused_name, parts in qkv.items():
            self.get_parameter(fused_name).data.copy_(torch.cat(parts))


class KeepOnObject(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, w in weights:
            if name.endswith("scale"):
                self.deferred_scales[name] = w  # expect: OWN101
                continue
            self.cache.append(w.narrow(0, 0, 1))  # expect: OWN101


class KeepClassLevel(nn.Module):
    shared: dict = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, w in weights:
            KeepClassLevel.shared[name] = w  # expect: OWN106


def keep_heap(weights: Iterable[tuple[str, torch.Tensor]]):
    heap = []
    for name, w in weights:
        heapq.heappush(heap, (w.numel(), name, w))  # expect: OWN101
    return heap


def keep_queue(weights: Iterable[tuple[str, torch.Tensor]], out: "queue.Queue"):
    for name, w in weights:
        out.put((name, w))  # expect: OWN101


def keep_update(weights: Iterable[tuple[str, torch.Tensor]]):
    merged = {}
    for name, w in weights:
        merged.update({name: w})  # expect: OWN101
    return merged


def keep_set(weights: Iterable[tuple[str, torch.Tensor]]):
    seen_tensors = set()
    for _, w in weights:
        seen_tensors.add(w)  # expect: OWN101
    return seen_tensors


def keep_augmented_list(weights: Iterable[tuple[str, torch.Tensor]]):
    rest = []
    for name, w in weights:
        rest += [(name, w)]  # expect: OWN101
    return rest


# -- safe look-alikes ---------------------------------------------------------------------------------
class SafeSliceThenCat(nn.Module):
    """Collect the slices of one item and cat them within the step: the list dies with the step."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, w in weights:
            parts = []
            for i in range(4):
                parts.append(w[i::4])
            self.get_parameter(name).data.copy_(torch.cat(parts, dim=0))


class SafePartnerCloned(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        pending: dict[str, torch.Tensor] = {}
        for name, w in weights:
            if name.endswith("q_a_proj.weight"):
                pending[name] = w.clone()  # owned: the loader may reuse the view's bytes
                continue
            partner = pending.pop(name.replace("kv_a_proj", "q_a_proj"), None)
            if partner is not None:
                self.get_parameter(name).data.copy_(torch.cat([partner, w]))


class SafeNamesOnly(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        loaded: set[str] = set()
        shapes = {}
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)  # a copy into the parameter
            loaded.add(name)
            shapes[name] = w.shape
        return loaded


class SafeCopyInto(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        for name, w in weights:
            param_data = params[name].data
            param_data[:, : w.shape[1]] = w  # a copy into a tensor, not a container
            params[name + ".scale"][0] = w.abs().max()


def safe_sum(weights: Iterable[tuple[str, torch.Tensor]]):
    norms = []
    for _, w in weights:
        norms.append(w.float().norm().item())  # a Python float
        norms.append(w * 2)  # arithmetic allocates a new tensor
    return norms


def safe_fresh_entry(weights: Iterable[tuple[str, torch.Tensor]]):
    for name, w in weights:
        entry = {"weight": w, "name": name}  # a per-step dict, consumed in the step
        yield entry["name"], torch.stack([entry["weight"]])


class KeepThroughLoopTarget(nn.Module):
    """An expert loader that picks its destination list with a loop over (projection, list) pairs: the
    list is reached through the loop target `dst`, not by its own name (issue 50, pattern 2)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        gate_rows = [None] * 8
        up_rows = [None] * 8
        for name, loaded in weights:
            expert = int(name.split(".")[3])
            for proj, dst in (("gate_proj", gate_rows), ("up_proj", up_rows)):
                if proj in name:
                    dst[expert] = loaded  # expect: OWN101
        self.w13 = torch.cat([torch.stack(gate_rows), torch.stack(up_rows)])


class SafeThroughLoopTargetPerStep(nn.Module):
    """The same choice of destination, into lists made in the step and copied before it ends."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, loaded in weights:
            gate_rows, up_rows = [], []
            for proj, dst in (("gate_proj", gate_rows), ("up_proj", up_rows)):
                if proj in name:
                    dst.append(loaded)
            self.w13[name] = torch.cat(gate_rows + up_rows)
