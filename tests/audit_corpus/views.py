"""Everything that shares the yielded tensor's memory is followed (views, slicing, narrow, .t(),
reshape, detach, .data, split/chunk/unbind, contiguous/to that may return self, from_numpy/numpy);
copies, arithmetic, cat/stack and metadata are not."""
from typing import Iterable

import numpy as np
import torch


def keep_views(weights: Iterable[tuple[str, torch.Tensor]]):
    kept = []
    for name, w in weights:
        if name.endswith(".a"):
            kept.append(w.narrow(0, 0, 4))  # expect: OWN101
        elif name.endswith(".b"):
            kept.append(w.t())  # expect: OWN101
        elif name.endswith(".c"):
            kept.append(w.reshape(-1))  # expect: OWN101
        elif name.endswith(".d"):
            kept.append(w.detach())  # expect: OWN101
        elif name.endswith(".e"):
            kept.append(w.data)  # expect: OWN101
        elif name.endswith(".f"):
            kept.append(w[1:, ::2])  # expect: OWN101
        elif name.endswith(".g"):
            kept.append(w.view(torch.int8))  # expect: OWN101
        elif name.endswith(".h"):
            kept.append(w.contiguous())  # expect: OWN107
        elif name.endswith(".i"):
            kept.append(w.to(torch.bfloat16))  # expect: OWN107
        elif name.endswith(".j"):
            kept.append(w.T.unsqueeze(0).squeeze(0))  # expect: OWN101
        elif name.endswith(".k"):
            kept.append(w.permute(1, 0).flatten())  # expect: OWN101
    return kept


def keep_split_parts(weights: Iterable[tuple[str, torch.Tensor]]):
    gates, ups, rows = [], [], {}
    for name, w in weights:
        gate, up = w.chunk(2, dim=0)
        gates.append(gate)  # expect: OWN101
        q, k, v = torch.split(w, [4, 2, 2])
        ups.append(k)  # expect: OWN101
        for i, row in enumerate(w.unbind(0)):
            rows[f"{name}.{i}"] = row  # expect: OWN101
    return gates, ups, rows


def keep_numpy_round_trip(weights: Iterable[tuple[str, torch.Tensor]]):
    arrays = {}
    tensors = {}
    for name, w in weights:
        a = w.numpy()
        arrays[name] = a  # expect: OWN101
        tensors[name] = torch.from_numpy(np.asarray(a))  # expect: OWN101
    return arrays, tensors


def keep_item_unpacked(weights: Iterable[tuple[str, torch.Tensor]]):
    side = []
    for item in weights:
        side.append(item[1])  # expect: OWN101
    return side


def keep_enumerated(weights: Iterable[tuple[str, torch.Tensor]]):
    side = {}
    for i, (name, w) in enumerate(weights):
        side[i] = w  # expect: OWN101
    return side


def keep_zipped(weights: Iterable[tuple[str, torch.Tensor]], names: list):
    side = []
    for short, (name, w) in zip(names, weights):
        side.append((short, w))  # expect: OWN101
    return side


# -- safe look-alikes ---------------------------------------------------------------------------------
def safe_copies(weights: Iterable[tuple[str, torch.Tensor]]):
    kept = []
    for name, w in weights:
        kept.append(w.clone())
        kept.append(w.narrow(0, 0, 4).clone())
        kept.append(w.t().contiguous().clone())
        kept.append(w * 0.5)
        kept.append(w + 1)
        kept.append(-w)
        kept.append(torch.cat([w, w]))
        kept.append(torch.stack([w[0], w[1]]))
        kept.append(w.float() @ w.float().t())
        kept.append(w.sum(0))
    return kept


def safe_copy_into_own(weights: Iterable[tuple[str, torch.Tensor]]):
    kept = {}
    for name, w in weights:
        buf = torch.empty_like(w)
        buf.copy_(w)  # buf is ours: the copy goes into it
        kept[name] = buf
    return kept


def safe_metadata(weights: Iterable[tuple[str, torch.Tensor]]):
    info = {}
    for name, w in weights:
        info[name] = (w.shape, w.dtype, w.device, w.numel(), w.stride())
        info[name + ".first"] = w[0, 0].item()
        info[name + ".rows"] = w.tolist()
        info[name + ".size"] = w.size(0)
    return info
