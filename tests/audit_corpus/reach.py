"""How weights reach the code that keeps them in engines outside the vLLM lineage (issue 50): through a
``functools.partial``, an import alias of the loader's API, a getter class's ``__getitem__``, a key
remapper, or a torch/accelerate API that keeps its argument (``load_state_dict(assign=True)``,
``set_module_tensor_to_device``, ``swap_tensors``, ``_load_from_state_dict``). Written for this corpus in
the shapes LitGPT, Petals, accelerate, torchtune, diffusers and peft use, not copied from them."""
import copy
from collections.abc import Mapping
from functools import partial
from typing import Any, Iterable, Optional

import torch
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from safetensors.torch import load_file as read_shard
from torch.distributed.tensor import distribute_tensor


# -- a copy function reached only through functools.partial (LitGPT's converter) -------------------------
def copy_into(config, pending: dict, out: dict, shard: dict, dtype=None):
    for name, tensor in shard.items():
        if name.endswith(".q"):
            pending[name] = tensor  # expect: OWN101
        else:
            out[name] = tensor  # expect: OWN101


def keep_through_partial(config, paths: list[str]) -> dict:
    pending = {}
    copy_fn = partial(copy_into, config, pending)
    out = {}
    for path in paths:
        shard = read_shard(path)  # an alias of safetensors.torch.load_file
        copy_fn(out, shard, dtype=None)
    return out


def copy_out(config, out: dict, shard: dict):
    for name, tensor in shard.items():
        out[name] = tensor.clone()


def safe_through_partial(config, paths: list[str]) -> dict:
    copy_fn = partial(copy_out, config)
    out = {}
    for path in paths:
        copy_fn(out, read_shard(path))
    return out


# -- torch and accelerate APIs that keep their argument ----------------------------------------------------
def keep_by_assign(model: torch.nn.Module, path: str):
    shard = read_shard(path)
    params = {name: torch.nn.Parameter(t) for name, t in shard.items()}
    model.load_state_dict(params, assign=True)  # expect: OWN102


def safe_by_copying_load(model: torch.nn.Module, path: str):
    model.load_state_dict(read_shard(path))  # the default copies into the module's own parameters


def keep_by_accelerate_setter(block: torch.nn.Module, path: str, dtype):
    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            set_module_tensor_to_device(block, name, "cpu", value=f.get_tensor(name).to(dtype))  # expect: OWN107


def keep_distributed(model: torch.nn.Module, mesh, placements, path: str):
    sharded = {}
    for name, full in read_shard(path).items():
        sharded[name] = torch.nn.Parameter(distribute_tensor(full, mesh, placements))
    return model.load_state_dict(sharded, assign=True)  # expect: OWN107


def keep_by_swap(model: torch.nn.Module, path: str):
    with safe_open(path, framework="pt") as f:
        for name, param in model.named_parameters():
            torch.utils.swap_tensors(param, f.get_tensor(name))  # expect: OWN102


class KeepByModuleStep:
    def load_into(self, model: torch.nn.Module, path: str, assign_to_params_buffers: bool = False):
        state_dict = read_shard(path)
        metadata = {"assign_to_params_buffers": assign_to_params_buffers}
        args = (state_dict, "", metadata, True, [], [], [])
        model._load_from_state_dict(*args)  # expect: OWN102


class SafeByModuleStep:
    def load_into(self, model: torch.nn.Module, path: str):
        state_dict = read_shard(path)
        model._load_from_state_dict(state_dict, "", {}, True, [], [], [])  # no assignment asked: it copies


# -- a handle's dict handed out past the with that closes the handle (Petals) ------------------------------
def keep_returned_past_close(path: str, prefix: str) -> dict:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}  # expect: OWN101


def safe_used_inside_with(model, path: str):
    with safe_open(path, framework="pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}  # one file's dict, used while the handle is open
        for name, t in weights.items():
            model.get_parameter(name).data.copy_(t)


# -- a merged dict returned: its function is a producer, so its caller's store is found too ----------------
def merged_shards(paths: list[str]) -> dict:
    merged = {}
    for path in paths:
        merged.update(read_shard(path))  # expect: OWN101
    return merged


def keep_from_merged(block: torch.nn.Module, paths: list[str]):
    state = merged_shards(paths)
    for name, _ in block.named_parameters():
        setattr(block, name, torch.nn.Parameter(state[name]))  # expect: OWN102
    return block


# -- a whole-file dict kept while the next file is fetched (torchtune's checkpointers) ---------------------
def keep_past_next_file(model_path: str, adapter_path: Optional[str]) -> dict:
    out = {}
    out["model"] = read_shard(model_path)  # expect: OWN101
    if adapter_path:
        out["adapter"] = read_shard(adapter_path)
    return out


def safe_next_file_not_read_after(model_path: str, other_path: str, sink):
    out = {}
    out["model"] = read_shard(model_path)
    sink(out)
    extra = read_shard(other_path)
    sink(extra)


# -- dicts of weights named by their annotation or name, not by a loader-like function name ----------------
def keep_union_annotated(out: dict, shard: dict[str, torch.Tensor | "LazyTensor"]):
    for name, t in shard.items():
        out[name] = t  # expect: OWN101


def keep_load_full_state_dict(model: torch.nn.Module, full_sd: dict[str, Any]):
    kept = {}
    for name, t in full_sd.items():
        kept[name] = torch.nn.Parameter(t)
    model.load_state_dict(kept, assign=True)  # expect: OWN102


def safe_own_parameters(state_dict: dict[str, torch.Tensor],
                        model_named_parameters: Iterable[tuple[str, torch.nn.Parameter]]):
    own = dict(model_named_parameters)  # the module's own parameters, not a loader's stream
    state_dict["head.weight"] = own["head.weight"]


def safe_scalar_weights(adapter_names: list[str], adapter_weights: float | list[float] | None = None):
    scales = dict(zip(adapter_names, adapter_weights or [1.0] * len(adapter_names)))  # numbers
    return scales


# -- a key remapper keeps the same tensors under new names (peft) -------------------------------------------
def keep_after_remap(model: torch.nn.Module, adapter_state_dict: dict[str, torch.Tensor]):
    adapter_state_dict = _remap_keys_for_load(adapter_state_dict, "base_model.")
    model.load_state_dict(adapter_state_dict, strict=False, assign=True)  # expect: OWN102


def caller_of_remap(model: torch.nn.Module, path: str):
    keep_after_remap(model, read_shard(path))


# -- a copy is a fresh object: what is set on it dies with the step ----------------------------------------
def safe_on_deepcopy(style, weights: dict[str, torch.Tensor], names: list[str]):
    for name in names:
        layer = copy.deepcopy(style)
        layer.empty_param = weights[name]
        weights[name] = layer.shard(weights[name]).clone()


# -- a Mapping whose __getitem__ reads a loader, kept on a hook (accelerate's offload) ---------------------
class ShardMap(Mapping):
    def __init__(self, index: dict):
        self.index = index

    def __getitem__(self, key: str):
        with safe_open(self.index[key], framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self):
        return iter(self.index)

    def __len__(self):
        return len(self.index)


class KeepOnloadHook:
    def __init__(self, weights_map: Optional[Mapping] = None):
        self.weights_map = weights_map

    def pre_forward(self, module: torch.nn.Module):
        for name, _ in module.named_parameters():
            set_module_tensor_to_device(module, name, "cpu", value=self.weights_map[name])  # expect: OWN107


# -- a loader's handle passed to a helper that fetches from it (GPTQModel's shard converters) --------------
def convert_shard(reader, dtype) -> dict:
    out = {}
    for key in reader.keys():
        out[key] = reader.get_tensor(key).to(dtype)  # expect: OWN107
    return out


def keep_through_handle_helper(paths: list[str], dtype, save):
    for path in paths:
        with safe_open(path, framework="pt") as reader:
            save(convert_shard(reader, dtype), path + ".out")


def sum_shard(reader) -> float:
    return sum(float(reader.get_tensor(key).sum()) for key in reader.keys())


def safe_through_handle_helper(path: str) -> float:
    with safe_open(path, framework="pt") as reader:
        return sum_shard(reader)


# -- one file's dict read after the with that closed its handle --------------------------------------------
def keep_read_past_close(model: torch.nn.Module, path: str, names: list[str]):
    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in names}  # expect: OWN101
    for name in names:
        model.get_parameter(name).data.copy_(tensors[name])


def safe_read_inside(model: torch.nn.Module, path: str, names: list[str]):
    with safe_open(path, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in names}
        for name in names:
            model.get_parameter(name).data.copy_(tensors[name])
    del tensors


# -- an object of a class the audit cannot read, built around a borrowed tensor ---------------------------
def keep_in_foreign_wrapper(state: dict, path: str):
    for name, tensor in read_shard(path).items():
        state[name] = TensorRecord(name=name, source=tensor)  # expect: OWN101


def safe_foreign_metadata(state: dict, path: str):
    for name, tensor in read_shard(path).items():
        state[name] = TensorRecord(name=name, dtype=tensor.dtype, shape=tuple(tensor.shape))
        if tensor.dim() > 2:
            raise ShapeError(f"{name}: {tensor.shape}")


# -- a tensor subclass built around a borrowed tensor: the weight object keeps it (optimum-quanto) ---------
class KeepPackedWeight(torch.Tensor):
    def __init__(self, data, bits: int):
        self._data = data  # expect: OWN102
        self._bits = bits

    @staticmethod
    def load_from(state_dict: dict[str, torch.Tensor], prefix: str):
        return KeepPackedWeight(state_dict.pop(prefix + "_data"), 4)


class KeepQuantWeight(QuantizedTensor):  # a base the audit does not read
    def __init__(self, qtype, data, scale):
        super().__init__(qtype, data, scale)  # expect: OWN102

    @staticmethod
    def load_from(state_dict: dict[str, torch.Tensor], prefix: str, qtype):
        return KeepQuantWeight(qtype, state_dict.pop(prefix + "_data"), state_dict.pop(prefix + "_scale"))


class SafeQuantWeight(QuantizedTensor):
    def __init__(self, qtype, data, scale):
        super().__init__(qtype, data.clone(), scale.clone())

    @staticmethod
    def load_from(state_dict: dict[str, torch.Tensor], prefix: str, qtype):
        return SafeQuantWeight(qtype, state_dict.pop(prefix + "_data"), state_dict.pop(prefix + "_scale"))


# -- a function handed to a mapper is called with each item (axolotl's fastcore `parallel`) ---------------
def install_one(name_value, model: torch.nn.Module, **kwargs):
    name, value = name_value
    setattr(model, name, value)  # expect: OWN102


def keep_through_mapper(model: torch.nn.Module, paths: list[str], workers: int):
    for path in paths:
        shard = read_shard(path)
        parallel(install_one, iter(shard.items()), n_workers=workers, model=model)


def total_one(name_value) -> float:
    name, value = name_value
    return float(value.sum())


def safe_through_mapper(paths: list[str]) -> float:
    total = 0.0
    for path in paths:
        total += sum(map(total_one, read_shard(path).items()))
    return total


# -- a handle kept in a dict by setdefault, fetched from in a loop (axolotl's NVFP4 experts) -------------
def keep_from_handle_cache(paths: dict, names: list[str]):
    opened = {}
    parts = []
    for name in names:
        f = opened.get(paths[name]) or opened.setdefault(paths[name], safe_open(paths[name], framework="pt"))
        parts.append(f.get_tensor(name))  # expect: OWN101
    return torch.stack(parts)


# -- a call through a parameter whose default is a function runs that default (executorch's convert=) -----
def keep_as_is(fqn: str, value):
    return value


def keep_through_default_converter(model: torch.nn.Module, path: str, convert=keep_as_is):
    kept = {}
    for name, value in read_shard(path).items():
        kept[name] = convert(name, value)  # the file's step: a dict of this call, until...
    model.extra = kept  # expect: OWN102


# -- an export path's dict of the model's own tensors is no loader's (Megatron-Bridge's export) -----------
def safe_accumulate_export(converted_weights_dict: dict[str, torch.Tensor], buffers: dict):
    for name, value in converted_weights_dict.items():
        buffers[name] = value
