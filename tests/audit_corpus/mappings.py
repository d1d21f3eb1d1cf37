"""A dict of weights by name as the source (engines that load a file at a time and hand each layer one
``Dict[str, Tensor]``: ``load_hf_weights(self, weights)``), a list of pairs held for the call, and stores
through conversions that are no-ops when nothing needs converting (OWN107)."""
from typing import Dict, List, Tuple

import torch


class KeepPartsUntilPartner:
    """q/k/v parts parked on the object until every part has arrived (another file's dict, later)."""

    def __init__(self, names):
        self.names = names
        self.parts = [None] * len(names)
        self.weight = None

    def load_hf_weights(self, weights):
        for i, name in enumerate(self.names):
            if name in weights:
                self.parts[i] = weights[name]  # expect: OWN101
        if None not in self.parts:
            self.weight = torch.cat(self.parts, dim=0)


class KeepExperts:
    def __init__(self, n):
        self.n = n
        self.gate_projs = [None] * n
        self.bias = None

    def load_hf_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        if "router.bias" in weights:
            self.bias = weights["router.bias"]  # expect: OWN102
        for i in range(self.n):
            w1 = f"experts.{i}.w1.weight"
            if w1 in weights:
                self.gate_projs[i] = weights[w1][: 4, :]  # expect: OWN101


class KeepThroughConversion:
    """``.to(dtype).cuda()`` returns the loaded tensor itself when it is already of that dtype on that device."""

    def __init__(self, dtype):
        self.dtype = dtype

    def _cuda(self, t):
        return t.contiguous().to(self.dtype).cuda()

    def load_hf_weights(self, weights):
        if "norm.weight" in weights:
            self.norm = weights["norm.weight"].to(self.dtype).cuda()  # expect: OWN107
        if "lm_head.weight" in weights:
            self.lm_head = self._cuda(weights["lm_head.weight"])  # expect: OWN107


class KeepViaHelper:
    def _process_weight(self, weight):
        self.weight = weight.transpose(0, 1)  # expect: OWN102

    def load_hf_weights(self, weights):
        if "w" in weights:
            self._process_weight(weights["w"][1:])


class KeepInPlace:
    def load_hf_weights(self, weights):
        if "o.weight" in weights:
            weights["o.weight"] *= 0.5  # expect: OWN120


class KeepFromUpdateBucket:
    def update_weights(self, weights: List[Tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name.endswith("bias"):
                self.bias = w  # expect: OWN102


class SafeMappingUse:
    """Reads the step's dict, re-lays it out inside the dict, copies into parameters: nothing kept."""

    def __init__(self):
        self.weight = torch.empty(4, 4)
        self.scale = 1.0

    def _preprocess(self, weights):
        if "qkv.weight" in weights:
            qkv = weights["qkv.weight"].reshape(3, -1, 4)
            weights["q.weight"] = qkv[0]
            weights["k.weight"] = qkv[1]
            del weights["qkv.weight"]

    def load_hf_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        self._preprocess(weights)
        if "q.weight" in weights:
            self.weight.copy_(weights["q.weight"])
            self.scale = float(weights["q.weight"].abs().max())
        for name in weights:
            self.last_name = name
        fused = []
        for name, t in weights.items():
            fused.append(t)
        self.fused = torch.cat(fused)
        self.norm = (weights["norm.weight"] + 1).to(torch.float16)


class SafeUpdateBucket:
    """A list the caller already holds for the whole call: a side list inside the call is fine."""

    def update_weights(self, weights: List[Tuple[str, torch.Tensor]]) -> None:
        held = list(weights)
        pending = {}
        for name, w in held:
            pending[name] = w
        self.total = sum(t.sum() for t in pending.values())


def safe_router_forward(weights, topk_ids):
    """A ``weights`` tensor of a forward: not a dict of weights."""
    return weights[topk_ids].sum()


class SafeNamedCacheView:
    """A dict of tensors kept whole by a view over it (lmdeploy's KV-cache ``NamedCacheView``): nothing is
    read out of it by name, so it is no file's dict of weights, whatever its annotation says."""

    def __init__(self, caches: Dict[str, torch.Tensor], layer_maps=None):
        self._caches = caches
        self._layer_maps = layer_maps or {}


class SafeKvTransferConnector:
    """A KV-transfer connector is handed the KV caches by layer name and reads them by name: a
    `dict[str, Tensor]` of caches, not of weights (issue 50, false-alarm class b)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.kv_caches = kv_caches
        first = kv_caches[next(iter(kv_caches))]
        self.block_bytes = first[0].numel() * first.element_size()
        for layer_name, cache in kv_caches.items():
            self.by_layer[layer_name] = cache


class SafeTrainerBuffers:
    """A LoRA trainer's buffers by name, kept for the training run: they are its own tensors."""

    def set_buffers(self, buffers: Dict[str, torch.Tensor]) -> None:
        for name, buf in buffers.items():
            self.buffers[name] = buf
