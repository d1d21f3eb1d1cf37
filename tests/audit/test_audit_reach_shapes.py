"""Shapes of reach taken from engines the audit was measured on blind (issue 50, item 4), each a keep /
safe pair written for this test (not copied from the engines): the rule finds the keeping function, and
the same shape with the tensor copied or never kept raises nothing. Run with no settings at all."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, List, Set, Tuple

from sanitizer.audit import audit_paths


def _audit(tmp_path: Path, files: Dict[str, str]) -> Set[Tuple[str, str, int]]:
    paths: List[str] = []
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        paths.append(str(path))
    result = audit_paths(paths)
    return {(f.code, f.function, f.line) for f in result.findings}


def _functions(found: Set[Tuple[str, str, int]]) -> Set[str]:
    return {fn for _, fn, _ in found}


# -- a container of handles: all shards opened at once (an ExitStack), then a dict of handles by key --------
SHARDS_OPEN_TOGETHER = '''
import contextlib
from safetensors import safe_open


def stream_all(paths):
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(p, framework="pt")) for p in paths]
        owner = {}
        for h in opened:
            for key in h.keys():
                owner[key] = h
        for key, h in owner.items():
            yield key, h.get_tensor(key)


def stream_listed(paths):
    handles = []
    for p in paths:
        handles.append(safe_open(p, framework="pt"))
    for h in handles:
        for key in h.keys():
            yield key, h.get_tensor(key)


def first_of_each(paths):
    handles = {p: safe_open(p, framework="pt") for p in paths}
    kept = []
    for p in paths:
        kept.append(handles[p].get_tensor("embed"))  # every file's tensor kept past the next fetch
    return kept


def keep_tied(paths, ties):
    later = {}
    for name, t in stream_all(paths):
        if name in ties:
            later[ties[name]] = t  # kept past later fetches
    return later


def keep_listed(paths, model):
    for name, t in stream_listed(paths):
        setattr(model, name, t)


def copy_tied(paths, ties):
    later = {}
    for name, t in stream_all(paths):
        if name in ties:
            later[ties[name]] = t.clone()
    return later


def shapes_only(paths):
    handles = [safe_open(p, framework="pt") for p in paths]
    out = {}
    for h in handles:
        for key in h.keys():
            out[key] = tuple(h.get_slice(key).get_shape())
    return out
'''


def test_a_list_and_a_dict_of_handles_hand_out_their_tensors(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"shards.py": SHARDS_OPEN_TOGETHER}))
    assert {"keep_tied", "keep_listed", "first_of_each"} <= found, found
    assert not found & {"copy_tied", "shapes_only", "stream_all", "stream_listed"}, found


def test_handles_in_a_container_are_no_retention_themselves(tmp_path: Path):
    """Keeping the handles (not their tensors) in a container that outlives a step is no finding."""
    text = '''
    from safetensors import safe_open


    class Files:
        def __init__(self, paths):
            self.handles = [safe_open(p, framework="pt") for p in paths]
            self.by_name = {}
            for h in self.handles:
                for key in h.keys():
                    self.by_name[key] = h
    '''
    assert _audit(tmp_path, {"files.py": text}) == set()


# -- a conversion that may return its argument: a `maybe_` helper, a hook parameter with a default ----------
HOOKS = '''
from safetensors import safe_open
from unread.convert import maybe_cast, to_default


def stream(path):
    with safe_open(path, framework="pt") as f:
        for key in f.keys():
            yield key, f.get_tensor(key)


def keep_converted(path, model, convert=to_default, dtype=None):
    for name, t in stream(path):
        setattr(model, name, maybe_cast(convert(name, t), dtype))


def keep_after_hook(path, model, convert=to_default):
    kept = {}
    for name, t in stream(path):
        kept[name] = convert(name, t)
    model.kept = kept


def keep_after_unknown(path, model, convert=None):
    kept = {}
    for name, t in stream(path):
        kept[name] = rebuild(name, t)  # a function the audit cannot read: taken to return a new tensor
    model.kept = kept


def keep_cloned(path, model, convert=to_default):
    for name, t in stream(path):
        setattr(model, name, convert(name, t).clone())
'''


def test_a_maybe_helper_and_a_hook_with_a_default_may_return_the_tensor(tmp_path: Path):
    found = _audit(tmp_path, {"hooks.py": HOOKS})
    functions = _functions(found)
    assert {"keep_converted", "keep_after_hook"} <= functions, found
    assert not functions & {"keep_after_unknown", "keep_cloned", "stream"}, found
    # conditional: a copy unless the conversion is a no-op
    assert {code for code, fn, _ in found if fn == "keep_after_hook"} == {"OWN107"}, found


# -- an iterable class: its `__iter__` reads a loader, its objects are streams (one per shard, in a list) ----
ITERABLE_SHARDS = '''
from dataclasses import dataclass

import torch
from safetensors import safe_open


@dataclass
class ShardReader:
    path: str

    def __iter__(self):
        with safe_open(self.path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class Unrelated:
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        for r in self.rows:
            yield r, torch.zeros(3)


def merge(paths):
    readers = [ShardReader(p) for p in paths]
    merged = {}
    for reader in readers:
        for name, t in reader:
            merged[name] = t.cpu()  # every shard's tensors kept while the next is read
    return merged


def keep_one(path, model):
    for name, t in ShardReader(path):
        if name == "embed":
            model.embed = t


def merge_copies(paths):
    merged = {}
    for reader in [ShardReader(p) for p in paths]:
        for name, t in reader:
            merged[name] = t.clone()
    return merged


def norms(paths):
    out = {}
    for p in paths:
        for name, t in ShardReader(p):
            out[name] = float(t.norm())
    return out


def keep_rows(rows):
    kept = {}
    for name, t in Unrelated(rows):
        kept[name] = t
    return kept
'''


def test_objects_of_a_class_whose_iter_reads_a_loader_are_weight_streams(tmp_path: Path):
    found = _audit(tmp_path, {"reader.py": ITERABLE_SHARDS})
    functions = _functions(found)
    assert {"merge", "keep_one"} <= functions, found
    assert not functions & {"merge_copies", "norms", "keep_rows", "ShardReader.__iter__"}, found
    assert {code for code, fn, _ in found if fn == "merge"} == {"OWN107"}, found  # `.cpu()`: a no-op on cpu


# -- a closure over the weights, defined and called by the same function ------------------------------------
CLOSURE = '''
import torch
from safetensors.torch import load_file


def load_into(model, path):
    state_dict = load_file(path)

    def assign(module, prefix=""):
        module._load_from_state_dict(state_dict, prefix, {"assign_to_params_buffers": True}, True, [], [], [])
        for name, child in module._modules.items():
            assign(child, prefix + name + ".")

    assign(model)


def copy_into(model, path):
    state_dict = load_file(path)

    def fill(module, prefix=""):
        for name, p in module.named_parameters(recurse=False):
            p.data.copy_(state_dict[prefix + name])
        for name, child in module._modules.items():
            fill(child, prefix + name + ".")

    fill(model)


def define_only(path):
    state_dict = load_file(path)

    def count():
        return len(state_dict)

    return count()
'''


def test_a_call_to_a_closure_over_the_weights_keeps_what_the_closure_keeps(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"closure.py": CLOSURE}))
    assert "load_into" in found, found  # (the closure's own statement is reported when it is seeded itself)
    assert not found & {"copy_into", "copy_into.<locals>.fill", "define_only", "define_only.<locals>.count"}, found


# -- an adapter loaded with low_cpu_mem_usage: transformers' load_adapter / peft's set_peft_model_state_dict
ADAPTERS = '''
from peft import set_peft_model_state_dict
from safetensors.torch import load_file


def lora_into_encoder(encoder, path, low_cpu_mem_usage=False):
    state_dict = load_file(path)
    extra = {}
    if low_cpu_mem_usage:
        extra["low_cpu_mem_usage"] = low_cpu_mem_usage
    state_dict = {k.removeprefix("text."): v for k, v in state_dict.items()}
    encoder.load_adapter(adapter_name="a", adapter_state_dict=state_dict, **extra)


def lora_into_peft_model(model, path):
    set_peft_model_state_dict(model, load_file(path), low_cpu_mem_usage=True)


def lora_copied(encoder, path):
    encoder.load_adapter(adapter_name="a", adapter_state_dict=load_file(path))


def lora_copied_by_peft(model, path):
    set_peft_model_state_dict(model, load_file(path))
'''


def test_adapter_loaders_with_low_cpu_mem_usage_keep_the_dict(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"adapters.py": ADAPTERS}))
    assert {"lora_into_encoder", "lora_into_peft_model"} <= found, found
    assert not found & {"lora_copied", "lora_copied_by_peft"}, found


def test_an_audited_adapter_setter_is_followed_into_its_definition(tmp_path: Path):
    """When the setter's own definition is audited, the store is reported there, not at the call."""
    setter = '''
    def set_peft_model_state_dict(model, peft_model_state_dict, low_cpu_mem_usage=False):
        model.kept = peft_model_state_dict
    '''
    caller = '''
    from safetensors.torch import load_file
    from setter import set_peft_model_state_dict


    def load_lora(model, path):
        set_peft_model_state_dict(model, load_file(path), low_cpu_mem_usage=True)
    '''
    found = _functions(_audit(tmp_path, {"setter.py": setter, "caller.py": caller}))
    assert found == {"set_peft_model_state_dict"}, found


# -- an offloaded module onloaded for a block: `with align_module_device(module, device)` ------------------
ONLOADING = '''
import torch
from accelerate.utils import align_module_device


def gather_offloaded(model):
    state_dict = {}
    for name, module in model.named_modules():
        with align_module_device(module, "cpu"):
            onloaded = module.state_dict()
        for key in onloaded:
            state_dict[f"{name}.{key}"] = onloaded[key].to("cpu")  # kept while later modules are onloaded
    return state_dict


def into_callers_dict(module, prefix, out):
    with align_module_device(module):
        for key, p in module.named_parameters():
            out[f"{prefix}.{key}"] = p


def gather_copies(model):
    state_dict = {}
    for name, module in model.named_modules():
        with align_module_device(module, "cpu"):
            for key, p in module.named_parameters(recurse=False):
                state_dict[f"{name}.{key}"] = p.detach().clone()
    return state_dict


def compress_each(model, compress):
    for name, module in model.named_modules():
        with align_module_device(module, "cpu"):
            params = {f"{name}.{n}": p for n, p in module.named_parameters(recurse=False)}
        for n, value in compress(params).items():
            value = value.to("cpu")
            setattr(module, n.rpartition(".")[2] + "_c", torch.nn.Parameter(value.clone()))


def not_onloaded(model):
    kept = {}
    for name, module in model.named_modules():
        kept[name] = module.state_dict()  # the model's own tensors: no loader's
    return kept
'''


def test_a_module_onloaded_by_align_module_device_hands_out_the_loaders_tensors(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"onload.py": ONLOADING}))
    assert {"gather_offloaded", "into_callers_dict"} <= found, found
    assert not found & {"gather_copies", "compress_each", "not_onloaded"}, found


def test_a_name_a_comprehension_or_an_inner_loop_binds_is_not_the_outer_one(tmp_path: Path):
    """OWN105 (a variable read by a later iteration): a comprehension's own ``p`` and an inner loop's
    target rebound before each read are not the value an earlier iteration left behind."""
    text = '''
    from safetensors.torch import load_file


    def per_file(paths, model):
        for path in paths:
            sd = load_file(path)
            p = None
            for name, value in sd.items():
                value = value.float()
                p = value + 1
            names = {n: p for n, p in model.named_parameters()}
            print(names)
    '''
    assert _audit(tmp_path, {"scopes.py": text}) == set()


# -- a lazy Mapping of weights (a class whose __getitem__ reads a loader) in an annotated local ----------------
LAZY_MAPPING = {
    "source.py": '''
from collections.abc import Mapping

from safetensors import safe_open


class CheckpointSource(Mapping):
    def __init__(self, path):
        self.path = path

    def __getitem__(self, key):
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self):
        with safe_open(self.path, framework="pt") as f:
            return iter(list(f.keys()))

    def __len__(self):
        return len(list(iter(self)))
''',
    "bridge.py": '''
from typing import Dict, Mapping

import torch


class Bridge:
    def fetch(self, name, weights: Mapping[str, torch.Tensor]):
        return weights[name]

    def load_all(self, pretrained, tasks):
        weights: Mapping[str, torch.Tensor] = pretrained.state
        cache: Dict[str, torch.Tensor] = {}
        for task in tasks:
            if task.grouped and task.name in cache:
                w = cache[task.name]
            else:
                w = self.fetch(task.name, weights)
                cache[task.name] = w  # kept for later tasks, past later fetches
            task.param.copy_(w)

    def load_each(self, pretrained, tasks):
        weights: Mapping[str, torch.Tensor] = pretrained.state
        for task in tasks:
            w = self.fetch(task.name, weights)
            parts = {"w": w}
            task.param.copy_(parts["w"])

    def shapes(self, pretrained, names):
        weights: Mapping[str, int] = pretrained.shapes
        kept = {}
        for n in names:
            kept[n] = weights[n]
        return kept
''',
}


def test_a_mapping_annotated_local_is_a_lazy_mapping_of_weights_when_a_class_reads_a_loader(tmp_path: Path):
    found = _functions(_audit(tmp_path, LAZY_MAPPING))
    assert "Bridge.load_all" in found, found
    assert not found & {"Bridge.load_each", "Bridge.shapes", "Bridge.fetch", "CheckpointSource.__getitem__"}, found


def test_a_mapping_annotated_local_is_nothing_without_such_a_class(tmp_path: Path):
    assert _audit(tmp_path, {"bridge.py": LAZY_MAPPING["bridge.py"]}) == set()


def test_a_class_own_method_named_like_a_loader_api_is_not_the_api(tmp_path: Path):
    """``self.load_file(fn)``, the class's own method (a memory-mapped dataset index), is not safetensors'
    ``load_file``; a comprehension's calls now count for walking a function, so this must hold there."""
    text = '''
    import numpy as np


    class TextDataset:
        def __init__(self, files):
            self.files = files
            loaded = [self.load_file(fn) for fn in files]
            self.loaded = loaded

        def load_file(self, fn):
            return np.load(fn, mmap_mode="r"), np.load(fn + ".idx")
    '''
    assert _audit(tmp_path, {"dataset.py": text}) == set()


def test_the_projects_own_adapter_setter_imported_relatively_is_no_library_keeper(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    caller = '''
    from safetensors.torch import load_file

    from .missing import set_peft_model_state_dict


    def load_adapter(model, path, low_cpu_mem_usage=False):
        set_peft_model_state_dict(model, load_file(path), low_cpu_mem_usage=low_cpu_mem_usage)
    '''
    assert _audit(pkg, {"model.py": caller}) == set()


# -- round 9 (ColossalAI, MLC LLM): a generator of whole-file dicts, merged; a prefetching generator; a torch
# optimizer's load_state_dict; numpy views through a reader chosen at run time; dicts of dicts ----------------
SHARD_DICTS = {
    "shards.py": '''
import concurrent.futures

from safetensors.torch import load_file


def read_shard(path):
    return load_file(path)


def shard_dicts(files, prefetch=2, low_mem=True):
    if low_mem:
        for f in files:
            yield read_shard(f)
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=prefetch) as pool:
            pending = []
            for f in files:
                pending.append(pool.submit(read_shard, f))  # every file fetched while earlier ones are consumed
            for fut in concurrent.futures.as_completed(pending):
                yield fut.result()


def shard_dicts_in_turn(files):
    for f in files:
        yield read_shard(f)


def shard_dict_now(pool, path):
    fut = pool.submit(read_shard, path)
    return fut.result()  # handed on within the call
''',
    "consumers.py": '''
from shards import shard_dicts, shard_dicts_in_turn


def load_all_then_assign(model, files):
    merged = {}
    for sd in shard_dicts_in_turn(files):
        merged.update(sd)  # every file's dict kept past the next file
    model.load_state_dict(merged, strict=False)


def load_each(model, files):
    for sd in shard_dicts(files):
        model.load_state_dict(sd, strict=False)  # copied in the file's step


def count_keys(files):
    names = set()
    for sd in shard_dicts_in_turn(files):
        names.update(sd.keys())  # names only
    return names
''',
}


def test_a_generator_of_file_dicts_merged_with_update_keeps_every_file(tmp_path: Path):
    """A generator yielding one file's dict a step (``yield load_file(path)``, through a helper) is a stream
    of dicts (``=dicts`` in ``--show-settings``); ``merged.update(sd)`` into a dict bound before the loop keeps
    each file's tensors past the next file (ColossalAI's FSDP ``load_sharded_model``/``_optimizer``)."""
    found = _functions(_audit(tmp_path, SHARD_DICTS))
    assert "load_all_then_assign" in found, found
    assert not found & {"load_each", "count_keys", "shard_dicts_in_turn", "shard_dict_now", "read_shard"}, found


def test_a_prefetching_generator_keeps_the_files_its_futures_hold(tmp_path: Path):
    """``pool.submit(read_shard, f)`` for every file before the first is consumed: each future holds a file's
    dict (``.result()`` hands it out), and the list of futures keeps them all (ColossalAI's
    ``load_state_dict_shards`` with ``low_cpu_mem_mode=False``). A future resolved in the same call keeps
    nothing."""
    found = _audit(tmp_path, SHARD_DICTS)
    assert {(code, fn) for code, fn, _ in found if fn == "shard_dicts"} == {("OWN101", "shard_dicts")}, found


OPTIMIZER_STATE = '''
from typing import Optional

import torch
from safetensors.torch import load_file
from torch.optim import Optimizer


def load_flat(path):
    flat = load_file(path)
    return {"state": {0: {"step": flat["state.0.step"], "exp_avg": flat["state.0.exp_avg"]}}, "param_groups": []}


def load_torch_optimizer(optimizer: Optimizer, path):
    optimizer.load_state_dict(load_flat(path))  # torch keeps `step` as loaded, `.to()` the rest


def load_adamw(optimizer: Optional[torch.optim.AdamW], path):
    state = load_flat(path)
    optimizer.load_state_dict(state)


def load_wrapped(optimizer: "OptimizerWrapper", path):
    optimizer.load_state_dict(load_flat(path))  # the project's own wrapper: its own load_state_dict


def load_model(model: torch.nn.Module, path):
    model.load_state_dict(load_file(path))  # a module's load_state_dict copies (no assign)


def slice_states(state: dict, rank: int, inplace: bool):
    state_ = state if inplace else dict(state)
    for k, v in state_.items():
        if k != "step":
            state_[k] = v.chunk(2)[rank].clone()  # a dict of one parameter's states: a store into it
    return state_


def shard_optimizer_file(path, rank):
    sd = load_flat(path)["state"]
    for idx, state in sd.items():
        for k, v in state.items():
            sd[idx][k] = v.flatten().clone()  # keyed by the state's own keys: a dict, not a tensor
    return sd


def scale_loaded(path):
    w = load_file(path)["w"]
    for i in range(2):
        w[i] = 0  # a tensor, indexed by a number: an in-place write
    return w
'''


def test_a_torch_optimizer_keeps_the_loaded_state(tmp_path: Path):
    """``optimizer.load_state_dict(sd)`` on a receiver annotated as a torch optimizer keeps ``step`` as loaded
    and the other states through a no-op ``.to()``: stored in ``optimizer.state`` (ColossalAI's
    ``GeneralCheckpointIO.load_unsharded_optimizer``). A wrapper of the project's own is not torch's, and a
    module's ``load_state_dict`` copies."""
    found = _functions(_audit(tmp_path, {"optim.py": OPTIMIZER_STATE}))
    assert {"load_torch_optimizer", "load_adamw"} <= found, found
    assert not found & {"load_wrapped", "load_model", "load_flat"}, found


def test_a_dict_of_dicts_read_by_its_own_keys_is_no_tensor(tmp_path: Path):
    """An optimizer's per-parameter state (``{"step": t, "exp_avg": t}``) read out of a loaded dict of dicts:
    a subscript store into something whose ``.items()`` the function calls, or keyed by a dict's own keys, is
    a store into a dict, not an in-place write (ColossalAI's ``shard_from_complete_optimizer_state``,
    LowLevelZero's ``load_sharded_optimizer``); a tensor indexed by a number still is."""
    found = _audit(tmp_path, {"optim.py": OPTIMIZER_STATE})
    assert not _functions(found) & {"slice_states", "shard_optimizer_file"}, found
    assert ("OWN120", "scale_loaded") in {(c, f) for c, f, _ in found}, found


NUMPY_CACHE = '''
import numpy as np
from safetensors import safe_open


def read_safetensors(path):
    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            param = f.get_tensor(name).detach().cpu()
            yield name, param.numpy()  # an ndarray sharing the tensor's memory


def read_pickle(path):
    import torch
    for name, param in torch.load(path).items():
        yield name, param.numpy()


class Loader:
    def __init__(self):
        self.cached_files = {}

    def load_file(self, path):
        reader = read_safetensors if str(path).endswith(".safetensors") else read_pickle
        result = {}
        for name, arr in reader(path):
            result[name] = arr  # every array of the file kept past its fetch
        self.cached_files[path] = result

    def load_asarray(self, path):
        out = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                out[name] = np.asarray(f.get_tensor(name))  # shares the memory too
        self.cached_files[path] = out

    def load_copied(self, path):
        reader = read_safetensors if str(path).endswith(".safetensors") else read_pickle
        result = {}
        for name, arr in reader(path):
            result[name] = arr.copy()
        self.cached_files[path] = result

    def load_np_array(self, path):
        result = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                result[name] = np.array(f.get_tensor(name))  # numpy.array copies by default
        self.cached_files[path] = result

    def load_reader_rebound(self, path):
        reader = read_safetensors
        reader = len  # rebound: not one function the audit can follow
        print(reader(path))
'''


def test_numpy_views_of_a_chosen_reader_kept_in_a_cache_on_self(tmp_path: Path):
    """``reader = read_safetensors if ... else read_pickle`` then ``reader(path)``: a call of each function it
    may be (MLC LLM's ``HuggingFaceLoader._load_file``); ``.numpy()`` and ``np.asarray`` share the tensor's
    memory, ``.copy()`` and ``np.array`` do not."""
    found = _functions(_audit(tmp_path, {"np_loader.py": NUMPY_CACHE}))
    assert {"Loader.load_file", "Loader.load_asarray"} <= found, found
    assert not found & {"Loader.load_copied", "Loader.load_np_array", "Loader.load_reader_rebound",
                        "read_safetensors", "read_pickle"}, found


def test_a_value_put_back_into_the_container_it_was_read_from_is_not_kept_anew(tmp_path: Path):
    """``out[k] = out[k].to(device)`` in a returned shallow copy of a dict of weights (ColossalAI's
    ``gather_state_dict_fast``): the container held that tensor already; a store into another container
    that outlives the call still is one."""
    text = '''
    from typing import Dict

    import torch


    def gather(state_dict: Dict[str, torch.Tensor], device):
        out = state_dict.copy()
        for k in list(out):
            out[k] = out[k].to(device)
        return out


    class Keeper:
        def keep(self, state_dict: Dict[str, torch.Tensor], device):
            for k in state_dict:
                self.kept[k] = state_dict[k].to(device)
    '''
    found = _functions(_audit(tmp_path, {"gather.py": text}))
    assert found == {"Keeper.keep"}, found



def test_show_settings_names_a_generator_of_dicts(tmp_path: Path, capsys):
    """``yield read_shard(f)`` (through a helper) makes a ``dicts`` producer, listed by ``--show-settings``."""
    from sanitizer.audit.cli import main

    paths = []
    for name, text in SHARD_DICTS.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
        paths.append(str(tmp_path / name))
    assert main(["--show-settings", *paths]) == 0
    shown = capsys.readouterr().out
    lines = {line.strip().split("=")[0]: line.strip() for line in shown.splitlines() if line.startswith("  ")}
    assert lines["shard_dicts"].startswith("shard_dicts=dicts"), lines
    assert lines["shard_dicts_in_turn"].startswith("shard_dicts_in_turn=dicts"), lines


def test_a_yielded_tuple_literal_is_no_dict_of_a_file():
    """A generator yielding a container of a producer's tensors is a ``dicts`` producer; one yielding a tuple
    literal (``yield name, value``, whatever the value holds: compressed-tensors' ``decompress`` yields
    ``(name, self.decompress_weight(...))``) is not: its items are (name, value) pairs."""
    from sanitizer.audit.producers import kind_of_value
    from sanitizer.audit.values import HOLDER, Val

    held = Val(HOLDER, 0, (), "f", mapping=True)
    assert kind_of_value(held, True) == "dicts"
    assert kind_of_value(held.then(HOLDER, parts=(None, held)), True) != "dicts"


# -- a module's own parameters, annotated as (name, Tensor) pairs (nanotron's optimizer helpers) ----------
OWN_PARAMETERS = '''
from typing import Any, Dict, Iterable, List, Tuple, Union
import torch


def get_custom_weight_decay_for_named_parameters(
    named_parameters: Iterable[Tuple[str, torch.Tensor]],
    model,
    weight_decay: float,
    exclude_named_params: List[str],
) -> List[Dict[str, Any]]:
    named_param_groups_with_custom_weight_decay = []
    for name, param in named_parameters:
        should_exclude = any(name.startswith(p) for p in exclude_named_params)
        current_weight_decay = 0.0 if should_exclude else weight_decay
        named_param_groups_with_custom_weight_decay.append(
            {"named_params": [(name, param)], "weight_decay": current_weight_decay}
        )
    print(len(named_param_groups_with_custom_weight_decay))
    return named_param_groups_with_custom_weight_decay


class NamedOptimizer:
    def __init__(self, named_params_or_groups: Iterable[Union[Tuple[str, torch.Tensor], Dict[str, Any]]]):
        self.groups = list(named_params_or_groups)


def load_weights(weights: Iterable[Tuple[str, torch.Tensor]]):
    return list(weights)
'''


def test_a_modules_own_parameters_annotated_as_name_tensor_pairs_are_no_loaders_stream(tmp_path: Path):
    """nanotron (not tuned on, first run): a parameter named for a module's own parameters
    (``named_parameters``, ``named_params_or_groups``) annotated ``Iterable[Tuple[str, torch.Tensor]]`` carries
    ``model.named_parameters()`` into optimizer groups: kept for the run, and no loader's. A loader's stream of
    the same annotation, named as loaders name it, is still kept (OWN103)."""
    found = _audit(tmp_path, {"own_parameters.py": OWN_PARAMETERS})
    assert _functions(found) == {"load_weights"}


# -- round 10: whole files' dicts gathered by a comprehension (fms's `load_state_dict`) ---------------------
FILES_GATHERED = '''
from collections import ChainMap
import torch
from safetensors.torch import load_file


def chained_checkpoints(checkpoints, device):
    sds = [torch.load(str(p), mmap=True, map_location=device) for p in checkpoints]
    return ChainMap(*sds)


def shards_by_path(files):
    return {f: load_file(f) for f in files}


def one_dict_repeated(path):
    sd = load_file(path)
    return [sd for _ in range(2)]


def one_file_at_a_time(files, model):
    for sd in (load_file(f) for f in files):
        model.load_state_dict(sd)


def step_of_one_getter(handle, names):
    return torch.cat([handle.get_tensor(n) for n in names])
'''


def test_a_comprehension_of_whole_file_loads_keeps_every_file(tmp_path: Path):
    """fms (not tuned on, first run): ``[torch.load(p, mmap=True) for p in checkpoints]`` keeps every file's
    dict while the next file is loaded (a whole file's dict is valid until then), as the loop that appends
    them does; a dict comprehension by path too. One dict repeated, a generator that hands each file on,
    and a per-tensor getter's fetches used together in one step raise nothing."""
    found = _audit(tmp_path, {"files_gathered.py": FILES_GATHERED})
    assert found == {("OWN101", "chained_checkpoints", 8), ("OWN101", "shards_by_path", 13)}


# -- round 10: a handle bound through a factory classmethod, a writer whose class the caller states (mergekit) -
FACTORY_AND_WRITER = '''
import threading
from typing import Optional
import safetensors
import torch


class ShardReader:
    def get_tensor(self, key: str) -> torch.Tensor: ...

    @classmethod
    def get(cls, path: str, device=None) -> "ShardReader":
        if path.endswith(".safetensors"):
            return safetensors.safe_open(path, framework="pt", device=device or "cpu")
        return PickleReader(path)


class PickleReader(ShardReader):
    def __init__(self, path):
        self.tensors = torch.load(path, weights_only=True)

    def get_tensor(self, key):
        return self.tensors[key]


class LazyReader:
    current: Optional[ShardReader]

    def __init__(self, paths):
        self.paths = paths
        self.current = None
        self.lock = threading.Lock()

    def fetch(self, key: str, device: str = "cpu"):
        with self.lock:
            if self.current is None:
                self.current = ShardReader.get(self.paths[key], device=device)
            return self.current.get_tensor(key).to(device)


class ShardWriter:
    def __init__(self):
        self.shard = {}
        self.copies = {}

    def save(self, name, tensor, clone=False):
        if clone:
            tensor = tensor.clone()
        self.shard[name] = tensor

    def save_copy(self, name, tensor):
        self.copies[name] = tensor.clone()


def copy_out(reader: LazyReader, writer: ShardWriter, names):
    for n in names:
        writer.save(n, reader.fetch(n))


def copy_out_owned(reader: LazyReader, names):
    writer = ShardWriter()
    for n in names:
        writer.save_copy(n, reader.fetch(n))
    return writer


def per_step_writer(reader: LazyReader, names, sink):
    for n in names:
        writer = ShardWriter()
        writer.save(n, reader.fetch(n))
        sink(writer.shard[n].sum())
'''


def test_a_factory_classmethods_handle_and_a_stated_writer_class_are_followed(tmp_path: Path):
    """mergekit (not tuned on, first run): ``self.current = ShardReader.get(path)``, a classmethod that returns
    ``safe_open(...)``, makes ``self.current`` a handle (``get`` alone is too common a name to match), so
    ``LazyReader.fetch`` is a producer; ``writer.save(n, t)`` on ``writer: ShardWriter`` is read as
    ``ShardWriter.save``, whose store into ``self`` keeps the tensor in ``writer``, which outlives the step:
    reported at that store (conditional: ``.to(device)``). A writer that clones, and one made in the step,
    raise nothing."""
    found = _audit(tmp_path, {"factory_and_writer.py": FACTORY_AND_WRITER})
    assert found == {("OWN107", "ShardWriter.save", 49)}


# -- round 11: a new module made to keep a file's tensors, and a module's `state_dict()` copy (mistral-inference) -
NEW_MODULE_ASSIGNED = '''
import torch
import torch.nn as nn
import safetensors.torch


class Net(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin = nn.Linear(n, n)

    @staticmethod
    def from_folder(path, device="cuda", dtype=None):
        with torch.device("meta"):
            model = Net(4)
        loaded = safetensors.torch.load_file(path)
        model.load_state_dict(loaded, assign=True, strict=True)
        return model.to(device=device, dtype=dtype)

    def merge_adapter(self, path, scale):
        adapter = safetensors.torch.load_file(path)
        merged = self.state_dict()
        for k, v in adapter.items():
            merged[k] = v
        self.load_state_dict(merged, strict=True)

    @staticmethod
    def copied(path):
        model = Net(4)
        model.load_state_dict(safetensors.torch.load_file(path))
        return model
'''


def test_a_new_module_made_to_keep_a_file_keeps_it_and_a_state_dict_copy_keeps_nothing(tmp_path: Path):
    """mistral-inference (not tuned on, first run): ``model.load_state_dict(loaded, assign=True)`` on a module the
    function makes keeps the file's tensors for the module's life, though the function returns the module
    (only a module's ``load_state_dict`` takes ``assign``); ``merged = self.state_dict()`` is a new dict, so the
    adapter's tensors stored in it and loaded without ``assign`` (copied) are kept by nothing."""
    found = _audit(tmp_path, {"new_module.py": NEW_MODULE_ASSIGNED})
    assert found == {("OWN102", "Net.from_folder", 17)}


# -- false findings the round 10-11 rules exposed on trees nobody classified (ColossalAI, GPTQModel, lmdeploy) --
NOT_WEIGHTS = '''
from typing import Dict
import torch
from safetensors.torch import load_file


class Tracer:
    def trace(self, root, meta_args: Dict[str, torch.Tensor]):
        self.meta_args = meta_args
        return root


def initialize_model(model, meta_args: Dict[str, torch.Tensor]):
    tracer = Tracer()
    for name in meta_args:
        print(meta_args[name].shape)
    return tracer.trace(model, meta_args=meta_args)


class QuantLinear:
    def pack(self, g_idx):
        self.g_idx = g_idx


def build_case_module(case: dict[str, torch.Tensor | int | torch.dtype | torch.device]):
    module = QuantLinear()
    module.pack(case["g_idx"])
    return module


class Frames:
    def load_file(self, path):
        return {"frames": path}


def load_from_path(path, media_io: Frames):
    return media_io.load_file(path)


def load_many(paths, media_io: Frames):
    return [load_from_path(p, media_io) for p in paths]


def keep_state_dict_bundle(state_dict: dict[str, torch.Tensor | int], holder):
    holder.weights = state_dict["w"]


def keep_files(paths):
    return [load_file(p) for p in paths]
'''


def test_meta_tensors_argument_bundles_and_a_readers_own_load_file_are_no_weights(tmp_path: Path):
    """Rounds 10-11's rules reach further (a method of an object of a stated class, a comprehension of whole
    files), which exposed three false sources on trees nobody classified: a ``meta_args`` dict of meta tensors
    (ColossalAI's tracer: no bytes to borrow), a dict of tensors mixed with settings (``dict[str, Tensor | int |
    torch.dtype]``, GPTQModel's test cases: an argument bundle), and ``media_io.load_file(path)``, a method
    of a value the function holds (lmdeploy's image and video readers), taken for safetensors' ``load_file``.
    The same union under a state-dict name, and safetensors' own ``load_file``, are still weights."""
    found = _audit(tmp_path, {"not_weights.py": NOT_WEIGHTS})
    assert _functions(found) == {"keep_state_dict_bundle", "keep_files"}


# -- round 12: a module built around a loaded tensor, handed to a model's setter (unsloth); a plain object's
# `load_state_dict(sd)` (gpt-neox's LR scheduler) --------------------------------------------------------------
MODULE_SETTERS = '''
import torch


def offload(path):
    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def keep_as_embedding(model, path):
    weight = offload(path)
    embedding = torch.nn.Embedding.from_pretrained(weight)
    model.set_input_embeddings(embedding)


def keep_as_head(model, path):
    weight = offload(path)
    head = torch.nn.Linear(1, 1, bias=None)
    del head.weight
    head.weight = weight
    model.set_output_embeddings(head)


def keep_as_child(model, path):
    model.add_module("extra", torch.nn.Embedding.from_pretrained(offload(path)))


def copy_as_embedding(model, path):
    weight = offload(path)
    embedding = torch.nn.Embedding.from_pretrained(weight.clone())
    model.set_input_embeddings(embedding)


def copy_as_head(model, path):
    head = torch.nn.Linear(1, 1, bias=None)
    head.weight.data.copy_(offload(path))
    model.set_output_embeddings(head)


class WarmupSchedule(object):
    def __init__(self, start_lr):
        self.start_lr = start_lr

    def load_state_dict(self, sd):
        self.start_lr = sd["start_lr"]
        self.num_iters = sd["num_iters"]


class Block(torch.nn.Module):
    def load_state_dict(self, sd):
        self.weight = sd["weight"]
'''


def test_a_module_built_around_a_loaded_tensor_and_set_on_a_model_keeps_it(tmp_path: Path):
    """unsloth offloads an embedding to disk and reads it back with ``torch.load(mmap=True)`` in a helper,
    then keeps the mapped tensor in the model through ``nn.Embedding.from_pretrained(w)`` (which makes
    ``Parameter(w)``: the same storage) and ``model.set_input_embeddings(...)`` / ``set_output_embeddings``
    (transformers' setters; ``add_module`` is torch's). Copied first, nothing is kept. A plain object's
    ``load_state_dict(sd)`` (a class with no base: torch's Stateful protocol, gpt-neox's LR scheduler) reads
    its settings, not weights; a module's override of it still reads weights."""
    found = _audit(tmp_path, {"setters.py": MODULE_SETTERS})
    assert _functions(found) == {"keep_as_embedding", "keep_as_head", "keep_as_child", "Block.load_state_dict"}


# -- round 12: LightX2V (a handle handed to a helper that fetches; a `weight_dict` by its name; a helper reached
# through a star import; a store replaced before the step ends) ---------------------------------------------------
OPS_UTILS = '''
def split_tensors(attrs, weight_dict):
    on_device = {}
    for name, attr in attrs:
        if name in weight_dict:
            on_device[attr] = weight_dict[name]
    return on_device


def pinned_copies(attrs, weight_dict):
    return {attr: weight_dict[name].clone() for name, attr in attrs}
'''

OPS = '''
import torch
from safetensors import safe_open
from ops_utils import *


class Op:
    def load(self, weight_dict):
        tensors = split_tensors(self.attrs, weight_dict)
        self.weight = tensors.get("weight")

    def load_copied(self, weight_dict):
        tensors = pinned_copies(self.attrs, weight_dict)
        self.weight = tensors.get("weight")

    def register_diff(self, weight_dict):
        self.weight_diff = weight_dict[self.weight_name + ".diff"]

    def register_copy(self, weight_dict):
        self.weight_diff = weight_dict[self.weight_name + ".diff"].clone()

    def load_quantized(self, weight_dict):
        self.weight = weight_dict[self.weight_name].to(torch.float32)
        self.weight, self.scale = quantize(self.weight)
        self.weight = self.weight.to(torch.float8_e4m3fn)

    def load_then_alias(self, weight_dict):
        self.weight = weight_dict[self.weight_name]
        self.original = self.weight
        self.weight = quantize(self.weight)

    def load_or_return(self, weight_dict):
        self.weight = weight_dict[self.weight_name]
        if self.keep:
            return
        self.weight = quantize(self.weight)


class Model:
    def _local_tensor(self, source, key, device):
        tensor = source.get_tensor(key)
        if torch.device(device).type != "cpu":
            tensor = tensor.to(device)
        return tensor

    def _local_copy(self, source, key):
        return source.get_tensor(key).clone()

    def load_all(self, files):
        weight_dict = {}
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as source:
                for key in source.keys():
                    weight_dict[key] = self._local_tensor(source, key, "cpu")
        return weight_dict

    def load_copies(self, files):
        weight_dict = {}
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as source:
                for key in source.keys():
                    weight_dict[key] = self._local_copy(source, key)
        return weight_dict
'''


def test_a_handle_handed_to_a_helper_a_weight_dict_by_name_a_star_import_and_a_replaced_store(tmp_path: Path):
    """LightX2V's shapes (round 12, read blind first): a helper handed the loader's handle fetches from it and
    returns the tensor, fetched at the caller's step (MiniMax-H3's ``_load_local_tensor(source, key, device)``,
    every tensor of several files kept in one dict); an op's ``register_diff(weight_dict)`` reads a LoRA file's
    dict by its parameter's name alone; ``load(weight_dict)`` hands the dict to a helper reached through
    ``from ...utils import *`` and stores what it returns. A store replaced by a later one of the same block
    before anything leaves it (a quantizing loader: ``self.weight = w.to(torch.float32)``, then the quantized
    copy) is not what the object keeps, but the tensor is read back through the attribute until then (an
    alias stored in between is kept), and a ``return`` in between keeps it. Copies keep nothing."""
    found = _audit(tmp_path, {"ops_utils.py": OPS_UTILS, "ops.py": OPS})
    assert _functions(found) == {"Op.load", "Op.register_diff", "Op.load_then_alias", "Op.load_or_return",
                                 "Model.load_all"}
    assert ("OWN102", "Op.load_then_alias", 29) in found


# -- an annotated iterable that the body indexes: a sequence its caller built (nanotron, round 13) -----------
INDEXED_OUTPUTS = '''
from typing import Dict, Iterable, Tuple, Union
import torch


class Trainer:
    def train_step_logs(self, outputs: Iterable[Dict[str, Union[torch.Tensor, int]]], loss_avg):
        first = outputs[0]["domain_weights"]
        return torch.stack([output["ce_loss"] for output in outputs]).sum(), first


def load_weights(model, weights: Iterable[Tuple[str, torch.Tensor]]):
    kept = [w for _, w in weights]
    model.kept = kept
'''


def test_an_annotated_iterable_the_body_indexes_is_no_loaders_stream(tmp_path: Path):
    """nanotron's DoReMi trainer: ``train_step_logs(outputs: Iterable[Dict[str, Union[Tensor, ...]]])`` reads
    ``outputs[0]`` and stacks one entry of each (a trainer's micro-batch outputs): taken for a weights stream by
    its annotation, an OWN103 false alarm. A generator cannot be indexed; the stream that is only looped over
    is still one."""
    found = _audit(tmp_path, {"trainer.py": INDEXED_OUTPUTS})
    assert _functions(found) == {"load_weights"}


# -- a plain object's state protocol through a base in another file (timm's schedulers, round 13) ----------
SCHEDULER_BASE = '''
from abc import ABC


class Scheduler(ABC):
    def state_dict(self):
        return {}
'''

SCHEDULERS = '''
from typing import Any, Dict

import torch
from lib_unread import Quantized
from .scheduler import Scheduler


class PlateauLRScheduler(Scheduler):
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.best = state_dict['best']
        if 'last_epoch' in state_dict:
            self.last_epoch = state_dict['last_epoch']


class Cached(Scheduler):
    def load_state_dict(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self.weight = state_dict['weight']


class QuantizedLinear(Quantized):
    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.weight = state_dict['weight']
'''


def test_a_plain_objects_state_dict_is_settings_through_a_base_in_another_file(tmp_path: Path):
    """timm's ``PlateauLRScheduler(Scheduler).load_state_dict(state_dict: Dict[str, Any])`` (``Scheduler(ABC)`` in
    another file) restores ``best`` and ``last_epoch``: two OWN102 false alarms. A plain class's dict annotated as
    tensors is still weights, and so is one on a class whose base the audit cannot read (it may be a module)."""
    (tmp_path / "__init__.py").write_text("")
    found = _audit(tmp_path, {"scheduler.py": SCHEDULER_BASE, "plateau.py": SCHEDULERS})
    assert _functions(found) == {"Cached.load_state_dict", "QuantizedLinear.load_state_dict"}


# -- a lazy mapping over a list of handles, held by wrappers typed with its class (DiffSynth, round 13) -----
DISK_MAP = '''
import torch
from safetensors import safe_open


class DiskMap:
    def __init__(self, paths, device):
        self.paths, self.device = paths, device
        self.files = []
        self.open_files()
        self.where = {name: i for i, f in enumerate(self.files) for name in f.keys()}

    def open_files(self):
        for path in self.paths:
            self.files.append(safe_open(path, framework="pt", device=str(self.device)))

    def __getitem__(self, name):
        param = self.files[self.where[name]].get_tensor(name)
        if param.device.type == "cpu":
            param = param.clone()
        return param
'''

WRAPPERS = '''
import torch
from disk_map import DiskMap


class Wrapped(torch.nn.Module):
    def __init__(self, module, names, disk_map: DiskMap = None):
        super().__init__()
        self.module, self.names = module, names
        self.disk_map = disk_map

    def load_from_disk(self, dtype, device):
        state_dict = {}
        for name in self.names:
            state_dict[name] = self.disk_map[name].to(dtype=dtype, device=device)
        self.module.load_state_dict(state_dict, assign=True)
        return self.module

    def copy_from_disk(self):
        for name, p in self.module.named_parameters():
            p.data.copy_(self.disk_map[name])


class WrappedFlat(Wrapped):
    def load_flat(self):
        state_dict = {name: self.disk_map[name] for name in self.names}
        self.module.load_state_dict(state_dict, assign=True)
'''


def test_a_lazy_mapping_over_a_list_of_handles_read_by_wrappers_typed_with_its_class(tmp_path: Path):
    """DiffSynth's ``DiskMap``: ``__getitem__`` fetches ``self.files[i].get_tensor(name)`` from handles a method
    appends (cloned on the CPU only); its wrappers take ``disk_map: DiskMap = None``, keep it on ``self``, and
    install ``self.disk_map[name]`` with ``load_state_dict(..., assign=True)``, a subclass through the base's
    attribute: 0 of 3 found (the class was no mapping of weights: the fetch read a handle through an index,
    and only a ``Mapping`` annotation marked the attribute). A copy into the parameters keeps nothing."""
    found = _audit(tmp_path, {"disk_map.py": DISK_MAP, "wrappers.py": WRAPPERS})
    assert _functions(found) == {"Wrapped.load_from_disk", "WrappedFlat.load_flat"}


# -- a loop whose only fetch binds the name returned after it (sd-scripts, round 13) -----------------------
ONLY_FETCH_BINDS = '''
from safetensors.torch import load_file


def load_for_this_rank(paths, rank):
    for i, path in enumerate(paths):
        if i == rank:
            sd = load_file(path)
        print("waited", i)
    return sd


def load_for_this_rank_and_peek(paths, rank):
    for i, path in enumerate(paths):
        if i == rank:
            sd = load_file(path)
        else:
            peek = load_file(path)
            print(len(peek))
    return sd
'''


def test_a_value_bound_by_the_loops_only_fetch_and_returned_after_it_is_fresh(tmp_path: Path):
    """sd-scripts' ``load_target_model``: ``for pi in range(n): if pi == local: (..., unet, ...) =
    _load_target_model(...)`` then ``return ..., unet, ...``: an OWN105, though every fetch of the loop binds the
    names returned, so nothing was fetched since. A loop that also fetches without binding them keeps it."""
    found = _audit(tmp_path, {"ranks.py": ONLY_FETCH_BINDS})
    assert _functions(found) == {"load_for_this_rank_and_peek"}
    assert {code for code, _, _ in found} == {"OWN105"}


# -- a lazy mapping class named by a function's parameter annotation (DiffSynth, round 13's miss) ------------
MATERIALIZE = '''
import torch
from disk_map import DiskMap


def materialize_root_params(model, disk_map: DiskMap):
    for name, param in list(model.named_parameters(recurse=False)):
        if name in disk_map:
            model.register_parameter(name, torch.nn.Parameter(disk_map[name]))
    for name, buf in list(model.named_buffers(recurse=False)):
        if name in disk_map:
            model.register_buffer(name, disk_map[name])


def copy_root_params(model, disk_map: "DiskMap"):
    for name, param in model.named_parameters(recurse=False):
        param.data.copy_(disk_map[name])


def materialize_unannotated(model, names, lookup):
    for name in names:
        model.register_buffer(name, lookup[name])
'''


def test_a_parameter_annotated_with_a_lazy_mapping_class_is_a_mapping_of_weights(tmp_path: Path):
    """DiffSynth's ``_materialize_root_params_from_disk(model, disk_map: DiskMap)`` registers ``disk_map[name]``
    as the model's parameters and buffers: missed while only an attribute (``self.disk_map``) or a local
    annotated ``Mapping[str, Tensor]`` was read as the lazy mapping. A copy into the parameters keeps nothing,
    and a parameter the annotation says nothing of is not taken for one."""
    found = _audit(tmp_path, {"disk_map.py": DISK_MAP, "materialize.py": MATERIALIZE})
    assert _functions(found) == {"materialize_root_params"}
    assert {line for _, fn, line in found if fn == "materialize_root_params"} == {9, 12}


# -- `torch.load(..., mmap=<a setting>)`: borrowed whenever the setting is true (LightX2V, round 12's miss) ---
MMAP_SETTING = '''
import torch


class Model:
    def __init__(self, config):
        self.config = config

    def load_ckpt(self, path, dtype):
        sd = torch.load(path, map_location="cpu", mmap=self.config.get("checkpoint_mmap", True))
        return {k: v.to(dtype) for k, v in sd.items()}

    def load_all(self, paths, use_mmap):
        merged = {}
        for p in paths:
            merged.update(torch.load(p, map_location="cpu", mmap=use_mmap))
        return merged

    def load_all_in_memory(self, paths):
        merged = {}
        for p in paths:
            merged.update(torch.load(p, map_location="cpu", mmap=False))
        return merged
'''


def test_torch_load_with_mmap_from_a_setting_is_a_borrowing_load(tmp_path: Path):
    """``torch.load(path, mmap=checkpoint_mmap)`` maps the file whenever the setting is true: LightX2V's
    ``_load_ckpt`` was missed because only the literal ``mmap=True`` was read as a borrowing load. Several
    files merged into one dict keep every earlier file's tensors; with ``mmap=False`` they are copies."""
    found = _audit(tmp_path, {"model.py": MMAP_SETTING})
    assert _functions(found) == {"Model.load_all"}


# -- a merged shards' dict regrouped into a new dict and returned (InvokeAI's sdnq_sd_loader, round 14) -----
SHARDS_REGROUPED = '''
import torch
from safetensors.torch import load_file


class Packed:
    def __init__(self, data, scale):
        self.data, self.scale = data, scale


def load_packed(paths):
    raw = {}
    for shard in paths:
        raw.update(load_file(shard))
    sd = {}
    for key in raw.keys():
        if key.endswith(".weight") and key[:-7] + ".scale" in raw:
            sd[key] = Packed(raw[key], raw[key[:-7] + ".scale"])
        else:
            sd[key] = raw[key]
    return sd


def load_packed_with_names(paths):
    raw = {}
    for shard in paths:
        raw.update(load_file(shard))
    tensors = [raw[k] for k in raw]
    return tensors, sorted(raw)
'''

SHARDS_USER = '''
from loaders import load_packed, load_packed_with_names


def install(model, paths):
    sd = load_packed(paths)
    model.load_state_dict(sd, assign=True)
    return model


def copy_in(model, paths):
    model.load_state_dict(load_packed(paths))
    return model


def names_only(model, paths):
    tensors, names = load_packed_with_names(paths)
    model.names = names
'''


def test_a_dict_regrouped_from_merged_shards_and_returned_makes_a_producer(tmp_path: Path):
    """InvokeAI's ``sdnq_sd_loader`` merges every shard's ``load_file`` dict into ``raw`` (reported there), then
    regroups ``raw``'s tensors into a new ``sd`` (wrapped or as they are) and returns it: it was no producer
    (the merged dict's reads were not followed once its stores were reported), so the 15 loaders that install
    its dict with ``load_state_dict(sd, assign=True)`` were missed. Its dict returned by name makes it one; a
    copying ``load_state_dict`` keeps nothing, and the names of a returned tuple are not taken for tensors."""
    found = _audit(tmp_path, {"loaders.py": SHARDS_REGROUPED, "user.py": SHARDS_USER})
    assert _functions(found) == {"load_packed", "load_packed_with_names", "install"}


# -- a factory that returns a plain object whose constructor stores the tensor (InvokeAI's LoRA layers) -----
LAYER_FACTORY = '''
from typing import Dict, Optional
import torch


class Patch:
    def __init__(self, up: torch.Tensor, down: torch.Tensor, alpha: Optional[float]):
        self.up = up
        self.down = down
        self.alpha = alpha

    @classmethod
    def from_values(cls, values: Dict[str, torch.Tensor]):
        layer = cls(up=values["lora_up.weight"], down=values["lora_down.weight"], alpha=None)
        return layer


class Scaled:
    def __init__(self, up: torch.Tensor):
        self.up = up * 2.0

    @classmethod
    def from_values(cls, values: Dict[str, torch.Tensor]):
        return cls(values["lora_up.weight"])


class Probe:
    def __init__(self, up: torch.Tensor):
        self.up = up

    def rank(self):
        return self.up.shape[0]


def rank_of(values: Dict[str, torch.Tensor]):
    return Probe(values["lora_up.weight"]).rank()
'''


def test_a_returned_object_is_credited_to_the_constructor_that_stores_the_tensor(tmp_path: Path):
    """InvokeAI's LoRA layers: ``from_state_dict_values(cls, values)`` returns ``cls(up=values[...], ...)``, and
    ``__init__`` keeps ``self.up = up``. The census (and the rule for modules) counts the constructor's store;
    the audit reported the classmethod's return (7 false alarms and 9 misses on one engine). A constructor that
    keeps a product (a copy), and an object that dies in the call, keep nothing."""
    found = _audit(tmp_path, {"layers.py": LAYER_FACTORY})
    assert {(fn, line) for _, fn, line in found} == {("Patch.__init__", 8), ("Patch.__init__", 9)}


# -- a file's tensors grouped by key stem into a dict of dicts (InvokeAI's LoRA key grouping, round 14) ------
GROUPED = '''
from typing import Dict
import torch
from safetensors.torch import load_file


def group_state(state_dict: Dict[str, torch.Tensor]):
    grouped = {}
    for key, value in state_dict.items():
        stem, leaf = key.split(".", 1)
        if stem not in grouped:
            grouped[stem] = {}
        grouped[stem][leaf] = value
    return grouped


def split_adapter(path):
    model = load_file(path)
    parts = {"proj": {}, "adapter": {}}
    for key in model.keys():
        if key.startswith("proj."):
            parts["proj"][key[5:]] = model[key]
        elif key.startswith("adapter."):
            parts["adapter"][key[8:]] = model[key]
    return parts


def zero_first_rows(state_dict: Dict[str, torch.Tensor]):
    for key, value in state_dict.items():
        value[0] = 0
'''


def test_a_dict_of_dicts_filled_by_key_stem_is_no_write_into_a_tensor(tmp_path: Path):
    """``grouped[stem][leaf] = value`` fills a dict of dicts: the walk's second pass over the loop read
    ``grouped[stem]`` as one of the file's tensors (the first pass had put one in it) and reported an in-place
    write into the loader's buffer (four false alarms on InvokeAI's LoRA converters and IP-adapter loader).
    A real write into one of the file's tensors is still found."""
    found = _audit(tmp_path, {"group.py": GROUPED})
    assert {(code, fn) for code, fn, _ in found} == {("OWN120", "zero_first_rows")}


# -- a checkpoint's nested state dict, `ckpt["model"]` (torchchat's `_load_model_default`, round 14) ---------
NESTED_MODEL_KEY = '''
import torch


def load_default(model, path):
    checkpoint = torch.load(path, mmap=True, weights_only=True)
    if "model" in checkpoint:
        checkpoint = checkpoint["model"]
    checkpoint = {"model." + k: v for k, v in checkpoint.items()}
    model.load_state_dict(checkpoint, assign=True)
    return model


def load_copied(model, path):
    checkpoint = torch.load(path, mmap=True, weights_only=True)["state_dict"]
    model.load_state_dict({k: v for k, v in checkpoint.items()})
    return model


def load_optimizer(optimizer, path):
    checkpoint = torch.load(path, mmap=True, weights_only=True)
    for idx, state in checkpoint["state"].items():
        optimizer.state[idx] = {k: v.clone() for k, v in state.items()}
'''


def test_a_checkpoints_nested_model_dict_is_a_dict_of_its_tensors(tmp_path: Path):
    """``checkpoint = checkpoint["model"]`` on one path, then ``{"model." + k: v for k, v in
    checkpoint.items()}`` installed with ``assign=True``: the lookup was taken for one tensor, whose
    ``.items()`` held nothing, and the retention was missed. A checkpoint's model-state keys name a dict of the
    file's tensors; a copying ``load_state_dict`` and an optimizer's cloned state keep nothing."""
    found = _audit(tmp_path, {"load.py": NESTED_MODEL_KEY})
    assert _functions(found) == {"load_default"}


# -- a class-private loader method and a dict merged with `|=` (OneTrainer's loader mixins, round 14) --------
MIXIN_LOADERS = '''
import torch
from safetensors.torch import load_file


class EmbeddingLoader:
    def __load_embedding(self, path):
        if path.endswith(".pt"):
            return torch.load(path, weights_only=True)
        return load_file(path)

    def load_all(self, model, names):
        for name in names:
            model.embeddings[name] = self.__load_embedding(name)

    def count_all(self, names):
        return sum(len(self.__load_embedding(name)) for name in names)


class ShardLoader:
    def load_shards(self, module, files):
        state_dict = {}
        for f in files:
            state_dict |= load_file(f)
        module.load_state_dict(state_dict)

    def load_one_at_a_time(self, module, files):
        for f in files:
            state_dict = {}
            state_dict |= load_file(f)
            module.load_state_dict(state_dict)
'''


def test_a_private_loader_method_and_a_dict_merged_with_or_equals(tmp_path: Path):
    """OneTrainer: ``self.__load_embedding(name)`` returns ``load_file``'s dict, but a name starting with two
    underscores was skipped as a special method, so storing its dicts on the model was missed; and
    ``state_dict |= load_file(f)`` merges every shard into one dict (as ``update`` does), which was not read as
    a store. Counting a file's entries, and a dict that dies with its file's step, keep nothing."""
    found = _audit(tmp_path, {"mixins.py": MIXIN_LOADERS})
    assert _functions(found) == {"EmbeddingLoader.load_all", "ShardLoader.load_shards"}


# -- a new module made to keep a file, then rebound; a module's own assigning loader (InvokeAI, round 14) -----
REBOUND_MODULE = '''
import torch
from safetensors.torch import load_file


class Vae(torch.nn.Module):
    pass


class Loader:
    def load_vae(self, path, dtype):
        sd = load_file(path)
        for k in sd.keys():
            sd[k] = sd[k].to(dtype)
        model = Vae()
        model.load_state_dict(sd, assign=True)
        model = self._cast(model, dtype)
        return model

    def load_adapter(self, path):
        sd = load_file(path)
        model = Vae()
        model.load_xlabs_state_dict(sd, assign=True)
        return model

    def load_vae_copied(self, path, dtype):
        sd = load_file(path)
        model = Vae()
        model.load_state_dict(sd)
        model = self._cast(model, dtype)
        return model

    def _cast(self, model, dtype):
        return model.to(dtype)
'''


def test_a_new_module_rebound_after_its_assigning_load_still_keeps_the_file(tmp_path: Path):
    """InvokeAI's loaders build a module, install one file's tensors with ``load_state_dict(sd, assign=True)``
    and then rebind the name (``model = self._cast(model)``): the module was taken for no new object (its name is
    bound twice), so what it was made to keep was judged as handed on. A module's own variant asked to assign
    (``load_xlabs_state_dict(sd, assign=True)``) installs them too; a copying load keeps nothing."""
    found = _audit(tmp_path, {"loaders.py": REBOUND_MODULE})
    assert _functions(found) == {"Loader.load_vae", "Loader.load_adapter"}


# -- objects built around a file's tensors, gathered in a container and returned (InvokeAI's converters) -----
LAYERS_GATHERED = '''
from typing import Dict
import torch


class SetParameter:
    def __init__(self, name: str, weight: torch.Tensor):
        self.name = name
        self.weight = weight


class Patch:
    def __init__(self, layers):
        self.layers = layers


def patch_from_state_dict(state_dict: Dict[str, torch.Tensor]):
    layers = {}
    for key, value in state_dict.items():
        layers[key] = SetParameter("scale", value)
    return Patch(layers=layers)


def count_layers(state_dict: Dict[str, torch.Tensor]):
    layers = {}
    for key, value in state_dict.items():
        layers[key] = SetParameter("scale", value)
    return len(layers)
'''


def test_objects_built_around_tensors_and_returned_in_a_container_are_credited_to_their_constructor(tmp_path: Path):
    """``layers[key] = SetParameterLayer("scale", sd["scale"])`` ... ``return ModelPatchRaw(layers=layers)``: the
    objects outlive the call inside what it returns, so their constructor's store keeps the file's tensors
    (missed: the container held them only for the step, and the wrapper was not followed). Counted and dropped,
    they keep nothing."""
    found = _audit(tmp_path, {"patches.py": LAYERS_GATHERED})
    assert {(fn, line) for _, fn, line in found} == {("SetParameter.__init__", 9)}


# -- `ckpt.get("state_dict", ckpt)` cached on self; a fresh container's setdefault inner dict (round 14) -------
CACHED_NESTED = '''
import torch
from safetensors.torch import load_file


class ModelOnDisk:
    def __init__(self):
        self._cache = {}

    def load_state_dict(self, path):
        if path in self._cache:
            return self._cache[path]
        checkpoint = load_file(path)
        state_dict = checkpoint.get("state_dict", checkpoint)
        self._cache[path] = state_dict
        return state_dict


def fuse_qkv(state_dict: dict):
    state_dict = state_dict.get("model", state_dict)
    out, buf = {}, {}
    for k, v in state_dict.items():
        stash = buf.setdefault(k.rsplit(".", 1)[0], {})
        stash[k.rsplit(".", 1)[1]] = v
        if len(stash) == 3:
            out[k] = torch.cat([stash["q"], stash["k"], stash["v"]])
    return out
'''


def test_a_nested_dict_read_with_get_and_a_setdefault_container_inside_a_fresh_one(tmp_path: Path):
    """InvokeAI's ``ModelOnDisk.load_state_dict`` caches ``checkpoint.get("state_dict", checkpoint)`` on ``self``:
    the lookup was read as one tensor, so the dict it is (one of the file's, or the file's itself) was not
    followed to the cache. Reading it so exposed timm's BEiT-3 converter: ``stash = buf.setdefault(key, {})``
    with ``buf`` a local dict that dies with the call is no container outliving the step."""
    found = _audit(tmp_path, {"disk.py": CACHED_NESTED})
    assert _functions(found) == {"ModelOnDisk.load_state_dict"}


# -- two files' dicts merged; a dict's entries converted in place of themselves; a shallow copy (round 15) -----
TWO_FILES = '''
import torch
from safetensors.torch import load_file


def merge_split(folder):
    unquantized = load_file(folder + "/unquantized_layers.safetensors")
    blocks = load_file(folder + "/transformer_blocks.safetensors")
    state_dict = unquantized
    state_dict.update(blocks)
    return state_dict


def fuse_qkv_in_place(path):
    state_dict = load_file(path)
    state_dict.update({"qkv": torch.cat([state_dict["q"], state_dict["k"], state_dict["v"]])})
    return state_dict


def strip_prefix(tensors):
    for key in [k for k in tensors if k.startswith("lora_unet_")]:
        tensors[key[len("lora_unet_"):]] = tensors.pop(key)
    return tensors


def to_bf16(path):
    tensors = strip_prefix(load_file(path))
    for k, v in tensors.items():
        if v.dtype != torch.bfloat16:
            tensors[k] = v.to(torch.bfloat16)
    return tensors


def split_linear1(lora: dict[str, torch.Tensor], block: str):
    processed = lora.copy()
    for key in list(lora):
        if key.endswith("linear2.lora_A.weight"):
            processed[block + ".proj_out.lora_A.weight"] = lora[key]
            processed.pop(key, None)
    return processed
'''


def test_two_files_merged_and_one_files_dict_rewritten(tmp_path: Path):
    """nunchaku's ``merge_safetensors``: ``state_dict = load(first); state_dict.update(load(second))`` keeps the
    first file's tensors past the second's fetch, in the dict it returns (missed: a store into the step's own
    dict of weights was taken to die with it). One file's dict with a copy added to it, its entries converted and
    put back (``tensors[k] = v.to(bf16)`` over ``tensors.items()``, nunchaku's ``to_diffusers``) or re-keyed into
    a shallow copy (``lora.copy()``, ``preprocess_single_blocks_lora``) hands one file's tensors on."""
    found = _audit(tmp_path, {"merge.py": TWO_FILES})
    assert _functions(found) == {"merge_split"}


# -- a loader returning a tuple (model, state dict, metadata), unpacked by its caller (nunchaku, round 15) ------
TUPLE_LOADER = '''
import torch
from safetensors.torch import load_file


class Loader:
    @classmethod
    def _build_model(cls, path):
        state_dict = load_file(path)
        transformer = cls()
        metadata = {"format": "pt"}
        return transformer, state_dict, metadata

    @classmethod
    def from_pretrained(cls, path):
        transformer, state_dict, metadata = cls._build_model(path)
        transformer._unquantized_part_sd = state_dict
        transformer.name = metadata["format"]
        return transformer

    @classmethod
    def from_pretrained_copied(cls, path):
        transformer, state_dict, metadata = cls._build_model(path)
        transformer.load_state_dict(state_dict)
        transformer.config = metadata
        return transformer
'''


def test_a_loader_returning_a_tuple_borrows_only_its_tensor_elements(tmp_path: Path):
    """nunchaku's ``transformer, model_state_dict, metadata = cls._build_model(path)``: the inferred producer's
    tuple was one holder, so every element unpacked from it was read as a tensor, and ``transformer._sd =
    state_dict`` as an attribute set on a tensor (nothing kept). What each element of the returned tuple is
    is now inferred too: the dict kept on the model is found, the metadata and the model are not borrowed."""
    found = _audit(tmp_path, {"loader.py": TUPLE_LOADER})
    assert _functions(found) == {"Loader.from_pretrained"}


# -- a policy's batch of observations is no dict of weights (lerobot, round 15's false alarm) ----------------
POLICY_BATCH = '''
from typing import Dict
from torch import Tensor


def _task_signature(batch):
    return tuple(sorted(batch))


class Policy:
    def predict_action_chunk(self, batch: Dict[str, Tensor]):
        self._task_key = _task_signature(batch)
        self._last_image = batch["observation.image"]
        return batch["action"]

    def load_weights(self, weights: Dict[str, Tensor]):
        self.head = weights["head.weight"]
'''


def test_a_policys_batch_of_observations_is_no_dict_of_weights(tmp_path: Path):
    """lerobot's ``predict_action_chunk(self, batch: dict[str, Tensor])``: a model's inputs, read by name as a
    dict of weights is, and flagged where it keeps them (a rollout's last observation). A parameter named for
    a model's inputs or outputs (``batch``, ``inputs``, ``observations``, ``labels``) holds no loader's tensors;
    a dict of weights by that annotation is still one."""
    found = _audit(tmp_path, {"policy.py": POLICY_BATCH})
    assert _functions(found) == {"Policy.load_weights"}


# -- pinned host buffers the program gathers into (Open-Sora, round 16's false alarm) -------------------------
PINNED = '''
import torch


def master_weights_gathering(model, pinned_state_dict: dict) -> None:
    for name, param in model.named_parameters():
        pinned_state_dict[name].copy_(param.detach())


def scale_weights(state_dict: dict, factor: float) -> None:
    for name in list(state_dict):
        state_dict[name].mul_(factor)
'''


def test_pinned_host_buffers_are_the_programs_own(tmp_path: Path):
    """Open-Sora gathers a model's parameters into ``pinned_state_dict`` (page-locked buffers it allocated for an
    async save) with ``.copy_()``: a bare ``dict`` named for a state dict, in a function named for weights, was
    read as a dict of weights and the copy as an in-place write into a loader's buffer. A state dict scaled in
    place is still one."""
    found = _audit(tmp_path, {"ckpt.py": PINNED})
    assert {(code, fn) for code, fn, _ in found} == {("OWN120", "scale_weights")}


# -- a blind user's shapes (round 16): two files merged as a user writes it; one finding per retention ------
USER_MERGES = '''
from safetensors import safe_open
from safetensors.torch import load_file


def spread_inline(p1, p2):
    return {**load_file(p1), **load_file(p2)}


def spread_names(p1, p2):
    base = load_file(p1)
    patch = load_file(p2)
    return {**base, **patch}


def copied_then_updated(p1, p2):
    base = load_file(p1)
    patch = load_file(p2)
    merged = dict(base)
    merged.update(patch)
    return merged


def one_file_extended(p1):
    sd = load_file(p1)
    return {**sd, "extra": sd["w"] * 2}


class Parts:
    def __init__(self, qweight, scales):
        self.qweight = qweight
        self.scales = scales


class Bundle:
    def __init__(self, layers):
        self.layers = layers


def read_one(path, n):
    with safe_open(path, framework="pt") as f:
        part = Parts(f.get_tensor(n + ".q"), f.get_tensor(n + ".s"))
    return Bundle({n: part})
'''


def test_a_blind_users_merges_and_one_finding_for_an_object_returned_past_its_files_close(tmp_path: Path):
    """Written from docs/audit.md alone by a user who had not read the rules: ``{**load_file(a),
    **load_file(b)}``, ``{**base, **patch}`` and ``dict(base)`` then ``.update(patch)`` were missed (only a
    merge into the first file's own dict was seen); each is now named by the file kept, the first. An object
    built inside a ``with safe_open`` and returned wrapped was reported twice (its constructor's stores and a
    read past the close): once now, at the constructor, each argument named as the parameter it is."""
    result_paths = tmp_path / "user.py"
    result_paths.write_text(textwrap.dedent(USER_MERGES))
    result = audit_paths([str(result_paths)])
    got = {(f.code, f.function, f.line) for f in result.findings}
    assert got == {("OWN101", "spread_inline", 7), ("OWN101", "spread_names", 13),
                   ("OWN101", "copied_then_updated", 20), ("OWN102", "Parts.__init__", 31),
                   ("OWN102", "Parts.__init__", 32)}
    merged = next(f for f in result.findings if f.function == "spread_names")
    assert merged.message.startswith("`load_file(p1)` is kept in")
    texts = {f.line: " ".join(link.text for link in f.chain) for f in result.findings if f.function == "Parts.__init__"}
    assert "as `qweight`" in texts[31] and "as `scales`" in texts[32]


# -- a producer that borrows only when its caller asks (a blind user's false alarm, round 16) ----------------
MMAP_PARAMETER = '''
import torch


def read_ckpt(path, mmap=False):
    return torch.load(path, mmap=mmap, weights_only=True)


def read_default_on(path, use_mmap=True):
    return read_ckpt(path, mmap=use_mmap)


class A:
    def lazy(self, p):
        self.x = read_ckpt(p, mmap=True)["x"]

    def lazy_positional(self, p):
        self.w = read_ckpt(p, True)["w"]

    def eager(self, p):
        self.y = read_ckpt(p)["y"]

    def eager_said(self, p):
        self.z = read_ckpt(p, mmap=False)["z"]

    def through_a_default_on(self, p):
        self.v = read_default_on(p)["v"]

    def through_a_default_off(self, p):
        self.u = read_default_on(p, use_mmap=False)["u"]
'''


def test_a_producer_that_borrows_only_when_a_parameter_is_true_is_judged_per_call(tmp_path: Path):
    """``def read_ckpt(path, mmap=False): return torch.load(path, mmap=mmap)`` borrows only when a call passes
    ``mmap`` true: it was one producer of a dict for every call, so ``read_ckpt(p)["y"]`` kept on ``self`` was a
    false alarm (a blind user's, from docs/audit.md). Each call is judged by what it passes (keyword or
    position), else by the default, through a wrapper that passes its own parameter on."""
    found = _audit(tmp_path, {"ckpt.py": MMAP_PARAMETER})
    assert _functions(found) == {"A.lazy", "A.lazy_positional", "A.through_a_default_on"}


# -- a base constructor in another module reached through super(); an attribute deleted before leaving -------
LAYER_BASE = '''
import torch


class LayerBase:
    def __init__(self, alpha, bias):
        self.alpha = alpha
        self.bias = bias


class Model:
    def apply_weights(self, weight_dict=None):
        if weight_dict is not None:
            self.original_weight_dict = weight_dict
        self.pre.load(self.original_weight_dict)
        del self.original_weight_dict
'''

LAYER_FULL = '''
from typing import Dict, Optional
import torch
from layer_base import LayerBase, Model


class FullLayer(LayerBase):
    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__(alpha=None, bias=bias)
        self.weight = torch.nn.Parameter(weight)

    @classmethod
    def from_values(cls, values: Dict[str, torch.Tensor]):
        return cls(weight=values["diff"], bias=values.get("diff_b", None))


class QuantModel(Model):
    def apply_weights(self, weight_dict: Dict[str, torch.Tensor] = None):
        scale = weight_dict["scale"]
        super().apply_weights(weight_dict)
        return scale.shape
'''


def test_a_base_constructor_in_another_module_and_an_attribute_deleted_before_leaving(tmp_path: Path):
    """InvokeAI's ``FullLayer.__init__`` hands ``bias`` to ``super().__init__``, whose ``self.bias = bias`` (in
    ``lora_layer_base.py``) keeps it: the base was followed only in the same module, so the store was reported
    at the ``super()`` call. LightX2V's ``_apply_weights`` keeps the dict on ``self`` under an ``if`` and deletes it
    at the end of the call: nothing outlives the call (a false alarm once the base was followed)."""
    found = _audit(tmp_path, {"layer_base.py": LAYER_BASE, "layers.py": LAYER_FULL})
    assert {(fn, line) for _, fn, line in found} == {("LayerBase.__init__", 8), ("FullLayer.__init__", 10)}


# -- a walk into a nested fresh dict: `node = out` then `node = node[part]` (lerobot's unflatten_dict) -------
NESTED_WALK = '''
from safetensors import safe_open
from safetensors.torch import load_file


def nest(flat: dict, sep: str = "/") -> dict:
    out = {}
    for key, value in flat.items():
        parts = key.split(sep)
        node = out
        for part in parts[:-1]:
            if part not in node:
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return out


def load_nested(path):
    return nest(load_file(path))


def gather_nested(path):
    out = {}
    with safe_open(path, "pt") as f:
        for key in f.keys():
            node = out
            for part in key.split(".")[:-1]:
                if part not in node:
                    node[part] = {}
                node = node[part]
            node[key.split(".")[-1]] = f.get_tensor(key)
    return out


def renamed(path, lora_path):
    base = load_file(path)
    scale = base["scale"].clone()
    lora = load_file(lora_path)
    fresh = {}
    for k, v in lora.items():
        fresh[k.replace("lora.", "")] = v
    lora = fresh
    for k in list(lora):
        lora[k] = lora[k] * scale
    return lora


def first_of_list(path):
    got = []
    with safe_open(path, "pt") as f:
        for key in f.keys():
            got.append(f.get_tensor(key))
    got = got[0]
    return got
'''


def test_a_walk_into_a_nested_fresh_dict_stores_into_that_dict(tmp_path: Path):
    """``node = out`` and ``node = node[part]`` (a name that the function also fills with new dicts) walk into
    the fresh dict ``out``: re-nesting one file's dict and returning it hands it on (lerobot's
    ``unflatten_dict`` was a false alarm: the store was taken to go into a container of unknown life), while
    the same walk storing per-tensor fetches is a gather across fetches, as a flat one is. A name bound to a
    fresh dict (``lora = fresh``) is that dict: nunchaku's LoRA converter. ``got = got[0]`` over a list of
    tensors is no walk (nothing stores new containers into ``got``): its element is still a fetched tensor."""
    found = _audit(tmp_path, {"nested.py": NESTED_WALK})
    assert _functions(found) == {"gather_nested", "first_of_list"}


# -- round 19's first runs: an engine's own `load_file`, entries of two files in one dict, a re-key in place,
# -- one file's tensor read after the next file, an import inside a function, a module's method by name -----
ROUND_19_MANAGERS = '''
import json
import torch


def load_file(path: str):
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    return torch.load(path)


class Embeddings:
    def load_from_file(self, path):
        self.embeddings = load_file(path)
'''

ROUND_19_SHAPES = '''
from typing import Any, Dict
import torch
from safetensors.torch import load_file


def load_state_dict(path):
    return load_file(path)


def merged_by_entries(high_path, low_path, high, low):
    combined = {}
    if high:
        high_sd = load_file(high_path)
        for key in high_sd:
            combined["one." + key] = high_sd[key]
    if low:
        low_sd = load_file(low_path)
        for key in low_sd:
            combined["two." + key] = low_sd[key]
    return combined


def one_file_by_entries(path):
    renamed = {}
    sd = load_file(path)
    for key in sd:
        renamed["m." + key] = sd[key]
    return renamed


def rekey(state_dict: Dict[str, Any], old: str, new: str) -> Dict[str, Any]:
    state_dict[new] = state_dict.pop(old)


def unwrap(saved: Dict[str, Any]) -> Dict[str, Any]:
    state_dict = saved
    if "module" in saved:
        state_dict = state_dict["module"]
    return state_dict


def convert(path):
    sd = unwrap(torch.load(path, map_location="cpu", mmap=True))
    for key in list(sd):
        rekey(sd, key, key.replace("model.", ""))
    return sd


class Dataset:
    def __getitem__(self, index):
        emb_path, lat_path = self.paths[index]
        if emb_path.exists():
            emb = load_file(emb_path)["emb"]
        else:
            emb = self.encode(index)
        if lat_path.exists():
            lat = load_file(lat_path)["lat"]
        else:
            lat = self.encode_video(index)
        return {"emb": emb, "lat": lat}

    def one_each(self, index):
        emb = load_file(self.paths[index][0])["emb"].clone()
        lat = load_file(self.paths[index][1])["lat"]
        return {"emb": emb, "lat": lat}


class State:
    @staticmethod
    def decode(out, raw):
        out.latents = _bytes_to_tensor(raw)

    @staticmethod
    def decode_copy(out, raw):
        out.latents = _bytes_to_tensor(raw).clone()


def _bytes_to_tensor(raw):
    from safetensors.torch import load as st_load
    return st_load(raw)["t"]


class Trainer:
    def switch(self, model, lora_path):
        lora = load_state_dict(lora_path)
        self.report = model.load_state_dict(lora, strict=False)
'''


def test_round_19_first_run_shapes(tmp_path: Path):
    """Round 19's first runs, each shape written here for the test: coqui TTS's own ``load_file`` (json or a
    plain ``torch.load``) was taken for safetensors' by its name (three false alarms); ai-toolkit's Wan LoRA
    loader copies two files' entries one by one into one dict it returns (missed: only whole dicts were
    parked until the next file); CogVideo's ``state_dict[new] = state_dict.pop(old)`` re-keys within the
    caller's dict (a false alarm); its datasets hold one file's tensor, bound under an ``if``, while the next
    file loads, then return both (missed); FastVideo imports ``safetensors.torch.load`` inside the function
    that calls it (missed); and ``model.load_state_dict(...)``, a module's method, was matched by name to a
    loader function of that name (its result taken for a borrowed dict)."""
    found = _audit(tmp_path, {"managers.py": ROUND_19_MANAGERS, "shapes.py": ROUND_19_SHAPES})
    assert _functions(found) == {"merged_by_entries", "Dataset.__getitem__", "State.decode"}


# -- a file's dict bound to a name and read after the next file, through a loader with a generic name --------
NAMED_FILE_DICTS = '''
import safetensors.torch
import torch


def load(filename: str):
    if filename.endswith(".safetensors"):
        return safetensors.torch.load_file(filename)
    return torch.load(filename)


def merge(base, lora, scale):
    for key in lora:
        base[key.replace("lora.", "")] = base[key.replace("lora.", "")] + scale * lora[key]


def merge_and_save(base_path, lora_path, out):
    base = load(base_path)
    lora = load(lora_path)
    merge(base, lora, 2.0)
    safetensors.torch.save_file(base, out)


def spread(base_path, lora_path):
    base = load(base_path)
    lora = load(lora_path)
    return {**base, **lora}


def one_at_a_time(base_path, lora_path, model):
    base = load(base_path)
    model.load_state_dict(base)
    lora = load(lora_path)
    model.load_state_dict(lora, strict=False)


def base_copied_first(base_path, lora_path):
    base = {k: v.clone() for k, v in load(base_path).items()}
    lora = load(lora_path)
    return {**base, **lora}
'''


def test_a_file_dict_read_after_the_next_file_through_a_generically_named_loader(tmp_path: Path):
    """mistral-finetune's LoRA merge: ``model_checkpoint = load(a)``, ``lora = load(b)``, then the base is read
    (merged into and saved). ``def load(filename)`` was never inferred a producer (a name every object has):
    it is now, matched only where a call resolves to that definition. A file's dict bound to a name and read
    after the next file's load is reported once (not again where a merge of the two already is); a dict read
    before the next load, or copied, keeps nothing."""
    found = _audit(tmp_path, {"merge_lora.py": NAMED_FILE_DICTS})
    assert _functions(found) == {"merge_and_save", "spread"}
    assert len([f for f in found if f[1] == "spread"]) == 1


# -- round 20: a converter that installs the dict and returns the module; assigning loaders the audit is not
# -- given (a free function taking the module first; peft's setter imported inside the function) ----------------
ROUND_20_CONVERT = '''
from typing import Any, Dict
import torch
from safetensors import safe_open


class Vocoder(torch.nn.Module):
    pass


def gather(path, prefix):
    sd = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():
            if k.startswith(prefix):
                sd[k[len(prefix):]] = f.get_tensor(k)
    return sd


def convert_vocoder(original_state_dict: Dict[str, Any]) -> Vocoder:
    vocoder = Vocoder()
    vocoder.load_state_dict(original_state_dict, strict=True, assign=True)
    return vocoder


class Model:
    def load_vocoder(self, path):
        state_dict = gather(path, "vocoder.")
        vocoder = convert_vocoder(state_dict)
        del state_dict
        self.vocoder = vocoder
'''

ROUND_20_UNSEEN_LOADERS = '''
import torch
from safetensors.torch import load_file
from .fp8 import load_fp8_state_dict


def build(config, path, device, dtype):
    state_dict = load_file(path)
    with torch.device("meta"):
        model = Transformer(config)
    load_fp8_state_dict(model, state_dict, device=device, dtype=dtype, assign=True)
    return model


def build_copied(config, path, device, dtype):
    state_dict = load_file(path)
    model = Transformer(config)
    load_fp8_state_dict(model, state_dict, device=device, dtype=dtype)
    return model


class LoraMixin:
    @classmethod
    def load_lora_into_transformer(cls, state_dict: dict[str, torch.Tensor], transformer, low_cpu_mem_usage=False):
        from peft import set_peft_model_state_dict

        peft_kwargs = {"low_cpu_mem_usage": low_cpu_mem_usage}
        set_peft_model_state_dict(transformer, state_dict, "default", **peft_kwargs)

    def load_lora_weights(self, path, low_cpu_mem_usage=False):
        self.load_lora_into_transformer(load_file(path), self.transformer, low_cpu_mem_usage=low_cpu_mem_usage)
'''


def test_round_20_first_run_shapes(tmp_path: Path):
    """SimpleTuner's LTX-2 loaders store on self the module a converter built with ``assign=True``: the call was
    taken for a key remapper by its name (``convert_...``) and the module for the dict under new names (a false
    alarm at each store); an audited function is judged by its summary, which keeps the retention at the
    converter. A free function ``load_fp8_state_dict(model, sd, assign=True)`` the audit is not given assigns
    into ``model``, as the method does (without ``assign`` it copies); peft's ``set_peft_model_state_dict``
    imported inside the function, with ``low_cpu_mem_usage`` passed on, is the library's (its adapters made on
    the meta device, then assigned)."""
    found = _audit(tmp_path, {"convert.py": ROUND_20_CONVERT})
    assert _functions(found) == {"gather", "convert_vocoder"}
    found = _audit(tmp_path, {"unseen.py": ROUND_20_UNSEEN_LOADERS})
    assert _functions(found) == {"build", "LoraMixin.load_lora_into_transformer"}


# -- a loader's API kept on the object and called through the attribute (onnxruntime-genai, round 20) --------
API_ON_SELF = '''
import os


class Exporter:
    def __init__(self, path):
        from safetensors import safe_open

        self._safe_open = safe_open
        self._path = path
        self._handles = {}
        self.embedding = Holder()
        self.embedding.weight = self._get("embed.weight")
        self.norm_shape = self._get("norm.weight").shape

    def _get(self, name):
        handle = self._handles.get(name)
        if handle is None:
            handle = self._safe_open(os.path.join(self._path, "model.safetensors"), framework="pt")
            self._handles[name] = handle
        return handle.get_tensor(name)
'''


def test_a_loader_api_kept_on_the_object_is_that_api(tmp_path: Path):
    """onnxruntime-genai's ModeloptModel imports ``safe_open`` inside ``__init__``, keeps it as
    ``self._safe_open`` and opens files with ``self._safe_open(path)`` in its getter ``_get``: a call through an
    attribute bound to a loader's API is that API, so ``_get`` is a producer and the stores of its tensors on
    the object are found (a shape of one only is no retention)."""
    found = _audit(tmp_path, {"exporter.py": API_ON_SELF})
    assert {(fn, line) for _, fn, line in found} == {("Exporter.__init__", 13)}


# -- a method of the one audited class that defines it, on an object of no known class (Fooocus, round 21) -----
ONLY_METHOD = '''
from safetensors.torch import load_file


def load_lora_for_models(model, path, strength):
    lora = load_file(path)
    patcher = model.clone()
    patcher.add_patches(lora, strength)
    return patcher


def copied_lora_for_models(model, path, strength):
    lora = {k: v.clone() for k, v in load_file(path).items()}
    patcher = model.clone()
    patcher.add_patches(lora, strength)
    return patcher


def state_of(model, path):
    sd = load_file(path)
    model.load_state_dict(sd)
    return model


class ModelPatcher:
    def __init__(self, model):
        self.model = model
        self.patches = {}

    def add_patches(self, patches, strength):
        for k in patches:
            self.patches.setdefault(k, []).append((strength, patches[k]))
        return list(patches)

    def load_state_dict(self, sd, assign=False):
        self.kept = sd
'''


def test_a_method_only_one_audited_class_defines_is_that_method(tmp_path: Path):
    """Fooocus's ``new_modelpatcher = model.clone(); new_modelpatcher.add_patches(loaded, strength)``: the
    receiver's class is not known, but one audited class alone defines ``add_patches`` (a name of the
    project's own): its store of the LoRA tensors in ``self.patches`` is found. A method every module has
    (``load_state_dict``) is never taken for the audited class's method of that name."""
    found = _audit(tmp_path, {"patcher.py": ONLY_METHOD})
    assert _functions(found) == {"ModelPatcher.add_patches"}
    assert all(line == 32 for _, fn, line in found)


# -- round 22: a nested walk through `child = node.get(k)`, a producer of a container as the next file's fetch,
# -- and a fetch on a path that returns ---------------------------------------------------------------------
ROUND_22 = '''
import torch
from safetensors.torch import load_file


def unflatten(d):
    result = {}
    for key, value in d.items():
        node = result
        for k in key.split(".")[:-1]:
            child = node.get(k)
            if child is None:
                child = {}
                node[k] = child
            node = child
        node[key.split(".")[-1]] = value
    return result


def file_to_state_dict(path):
    return unflatten(load_file(path))


def load_checkpoint(model_path, optim_path):
    model_state = file_to_state_dict(model_path)
    optim_state = file_to_state_dict(optim_path)
    return model_state, optim_state


def restore(optim: torch.optim.Optimizer, path):
    optim.load_state_dict(file_to_state_dict(path))


def load_weights(self, path, retry=False):
    sd = load_file(path)
    kept = {}
    for k, v in sd.items():
        kept[k.replace("lora.", "")] = v
    if not retry and "missing" in kept:
        return load_weights(self, path, retry=True)
    self.copy_in(kept)
    return None
'''


def test_round_22_first_run_shapes(tmp_path: Path):
    """OLMo's ``unflatten_dict`` walks its nested fresh dict through ``child = node.get(k)``, ``child = {}``,
    ``node[k] = child``, ``node = child``: it was a false alarm, and as it reported the file's tensors there,
    the optimizer's keeping downstream (``optim.load_state_dict(...)``) was missed. A producer returning such
    a container (a ``holder``) fetches the next file as a dict producer does: the first file's, bound to a name
    and returned after it, is kept. A fetch on a path that returns (``return load_weights(...)``, the retry) is
    no next file for what the other path reads."""
    found = _audit(tmp_path, {"olmo_like.py": ROUND_22})
    assert _functions(found) == {"load_checkpoint", "restore"}


# -- round 23: `assign=assign` under the function's own parameter; diffusers' `load_lora_adapter` -----------
ROUND_23 = '''
from safetensors.torch import load_file


def load_state_dict(model, ckpt_path, device="cuda", strict=False, assign=True):
    state_dict = load_file(ckpt_path, device)
    missing, unexpected = model.load_state_dict(state_dict, strict=strict, assign=assign)
    return model


def load_copied(model, ckpt_path, assign=False):
    state_dict = load_file(ckpt_path)
    model.load_state_dict(state_dict, assign=assign)
    return model


class LoraMixin:
    def load_lora_weights(self, path, low_cpu_mem_usage=False):
        state_dict = load_file(path)
        self.transformer.load_lora_adapter(state_dict, adapter_name="default", low_cpu_mem_usage=low_cpu_mem_usage)

    def load_lora_eager(self, path):
        state_dict = load_file(path)
        self.transformer.load_lora_adapter(state_dict, adapter_name="default")
'''


def test_round_23_first_run_shapes(tmp_path: Path):
    """Step1X-Edit's ``load_state_dict(model, path, ..., assign=True)`` passes ``assign=assign`` on: its own
    parameter, true by default, so the module keeps the file whenever it is (as ``torch.load(mmap=<var>)``
    borrows; a parameter false by default asks for a copy). OmniGen2 hands its LoRA dict to diffusers'
    ``load_lora_adapter(sd, low_cpu_mem_usage=...)``, which assigns it into the adapter when asked, as
    transformers' ``load_adapter`` does."""
    found = _audit(tmp_path, {"step1x_like.py": ROUND_23})
    assert _functions(found) == {"load_state_dict", "LoraMixin.load_lora_weights"}


# -- a blind user's probes (stop 69): a generic-named producer imported or called through its module, an import
# -- alias of an inferred producer, a class's own producer method named `get`, a loader kept on `self` by a base
BLIND_HELPERS = '''
from safetensors.torch import load_file


def load(filename):
    return load_file(filename)


def read_shard(filename):
    return load_file(filename)
'''

BLIND_USERS = '''
import helpers
from helpers import load
from helpers import read_shard as rs
from safetensors import safe_open


class A:
    def imported(self, p):
        self.w = load(p)

    def through_module(self, p):
        self.w = helpers.load(p)

    def aliased(self, p):
        self.w = rs(p)

    def shadowed(self, p, load):
        self.w = load(p)


class W:
    def __init__(self, path):
        self.f = safe_open(path, framework="pt")

    def get(self, name):
        return self.f.get_tensor(name)

    def setup(self):
        self.emb = self.get("emb")

    def shape(self):
        return self.get("emb").shape


def other(cfg, model):
    model.x = cfg.get("x")


class Base:
    def __init__(self, path):
        self._open = safe_open
        self.path = path


class Sub(Base):
    def read(self):
        with self._open(self.path, framework="pt") as f:
            self.x = f.get_tensor("x")
'''


def test_a_blind_users_probes_of_generic_names_aliases_and_bases(tmp_path: Path):
    """Probes a helper wrote from docs/audit.md alone: a module-level ``def load(filename)`` producer imported
    by name or called as ``helpers.load(p)`` was never matched (only in its own module); ``from helpers
    import read_shard as rs`` hid the producer behind its alias; ``self.get("emb")`` of the class's own
    producer method named ``get`` was not followed; a loader kept on ``self`` by a base's ``__init__`` was
    unknown in a subclass. A parameter named ``load`` is not the module's function, and ``cfg.get`` is not
    ``W.get``."""
    found = _audit(tmp_path, {"helpers.py": BLIND_HELPERS, "users.py": BLIND_USERS})
    assert _functions(found) == {"A.imported", "A.through_module", "A.aliased", "W.setup", "Sub.read"}


# -- round 25: a module held by a new object the function builds and returns, loaded with assign=True --------
ROUND_25 = '''
from safetensors.torch import load as st_load


def load_state_dict(file_path):
    with open(file_path, "rb") as f:
        return st_load(f.read())


class Pipeline:
    def __init__(self, device):
        self.device = device
        self.dit = None

    @staticmethod
    def from_config(config, dit_path):
        pipe = Pipeline(device="cuda")
        pipe.dit = build_dit(config)
        state_dict = load_state_dict(dit_path)
        compatible = {k.replace("net.", ""): v for k, v in state_dict.items()}
        pipe.dit.load_state_dict(compatible, strict=False, assign=True)
        return pipe

    @staticmethod
    def from_config_copied(config, dit_path):
        pipe = Pipeline(device="cuda")
        pipe.dit = build_dit(config)
        pipe.dit.load_state_dict(load_state_dict(dit_path), strict=False)
        return pipe
'''


def test_a_module_of_a_new_object_keeps_what_it_is_assigned(tmp_path: Path):
    """cosmos-predict2's pipelines build ``pipe = Text2ImagePipeline(...)``, load the DiT's file into
    ``pipe.dit`` with ``assign=True`` and return ``pipe``: the store was taken into a new object the function
    hands on (a container), so nothing was reported and ``from_config`` became an inferred producer. The module
    keeps the file for its life, as a new module assigned directly does; without ``assign`` it copies."""
    found = _audit(tmp_path, {"pipeline.py": ROUND_25})
    assert _functions(found) == {"Pipeline.from_config"}


# -- libraries' loaders, known by their import path: ComfyUI's `load_torch_file`, peft's `load_peft_weights`,
# diffusers' / transformers' `load_state_dict(path)`, diffusers' `lora_state_dict`, optimum-quanto's `requantize` --
LIBRARY_LOADERS = '''
import comfy.utils
from comfy.utils import load_torch_file
from peft.utils import load_peft_weights
from diffusers.models.model_loading_utils import load_state_dict
from optimum.quanto import requantize
import comfy.sd
from diffusers.models.model_loading_utils import load_model_dict_into_meta


class LoraNode:
    def __init__(self):
        self.loaded = {}

    def cache_file(self, path):
        sd = load_torch_file(path)
        self.loaded[path] = sd

    def keep_one(self, path):
        sd = comfy.utils.load_torch_file(path, safe_load=True)
        self.down = sd["lora_down.weight"]

    def keep_with_metadata(self, path):
        sd, metadata = load_torch_file(path, return_metadata=True)
        self.metadata = metadata
        self.sd = sd

    def keep_adapter(self, path):
        self.adapter = load_peft_weights(path)

    def assign_file(self, model, path):
        model.load_state_dict(load_state_dict(path), assign=True)
        self.model = model

    def quantized(self, model, path, qmap):
        requantize(model, load_torch_file(path), qmap, device="cpu")
        self.model = model

    def keep_lora(self, pipe, path):
        sd, alphas = pipe.lora_state_dict(path)
        self.alphas = alphas
        self.lora = sd

    def patched(self, model, clip, path):
        return comfy.sd.load_lora_for_models(model, clip, load_torch_file(path), 1.0, 1.0)

    def meta_loaded(self, path):
        unet = UNet()
        load_model_dict_into_meta(unet, load_torch_file(path))
        return unet

    def copy_file(self, model, path):
        model.load_state_dict(load_torch_file(path))

    def copy_one(self, path):
        sd = load_torch_file(path)
        self.down = sd["lora_down.weight"].clone()

    def only_alphas(self, pipe, path):
        sd, alphas = pipe.lora_state_dict(path)
        self.alphas = alphas
        pipe.load_lora_into_unet(sd, alphas, unet=pipe.unet)

    def copy_adapter(self, model, path):
        model.load_state_dict(load_peft_weights(path), strict=False)


def load_torch_file_twin(path):
    import json
    return json.load(open(path))
'''

OWN_LOADERS = '''
def load_torch_file(path):
    with open(path) as fh:
        return fh.read()


class Pipe:
    def lora_state_dict(self, path):
        return {"path": path}

    def keep_text(self, path):
        self.text = load_torch_file(path)
        self.sd = self.lora_state_dict(path)
'''


def test_library_loaders_are_producers_by_their_import_path(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"lora_node.py": LIBRARY_LOADERS}))
    assert found == {"LoraNode.cache_file", "LoraNode.keep_one", "LoraNode.keep_with_metadata", "LoraNode.keep_adapter",
                     "LoraNode.assign_file", "LoraNode.quantized", "LoraNode.keep_lora", "LoraNode.patched",
                     "LoraNode.meta_loaded"}, found


def test_a_function_of_the_tree_named_as_a_library_loader_is_its_own(tmp_path: Path):
    assert _audit(tmp_path, {"own_loaders.py": OWN_LOADERS}) == set()


# -- a loader injected by its abstract base: `self._loader.load(f)` with `__init__(self, loader: FileLoader)`, the
# producer being the subclass's `load` (fairseq2's checkpoint loaders, built by a dependency container) --------------
INJECTED_IO = '''
from abc import ABC, abstractmethod
from safetensors import safe_open


class FileLoader(ABC):
    @abstractmethod
    def load(self, path):
        ...


class _SafetensorsFileLoader(FileLoader):
    def load(self, path):
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
'''

INJECTED_USERS = '''
from injected_io import FileLoader


class ShardedLoader:
    def __init__(self, file_loader: FileLoader) -> None:
        self._file_loader = file_loader

    def lazy_load(self, files):
        checkpoint = {}
        for file in files:
            shard = self._file_loader.load(file)
            for key, value in shard.items():
                checkpoint[key] = value          # every file's tensors, held past the next file
        yield from checkpoint.items()

    def lazy_load_copied(self, files):
        for file in files:
            shard = self._file_loader.load(file)
            for key, value in shard.items():
                yield key, value                  # one file at a time


def merged(loader: FileLoader, files):
    out = {}
    for file in files:
        out.update(loader.load(file))
    return out


def merged_copies(loader: FileLoader, files):
    out = {}
    for file in files:
        out.update({k: v.clone() for k, v in loader.load(file).items()})
    return out
'''


def test_a_loader_typed_by_its_abstract_base_is_the_subclass_producer(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"injected_io.py": INJECTED_IO, "injected_users.py": INJECTED_USERS}))
    # (the subclass's own `load` gathers a file's fetches and returns them: reported where it gathers)
    assert found == {"_SafetensorsFileLoader.load", "ShardedLoader.lazy_load", "merged"}, found


# -- ComfyUI-style nodes: every node's method is `loadmodel`; a module built in the function and filled with
# `set_module_tensor_to_device` keeps the file whatever wraps it; another node's `loadmodel` is its own ------------
COMFY_NODES = '''
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from comfy.utils import load_torch_file


class Encoder:
    def __init__(self, dtype, device, state_dict):
        with init_empty_weights():
            self.model = build_encoder(dtype)
        for name, _ in self.model.named_parameters():
            set_module_tensor_to_device(self.model, name, device=device, value=state_dict[name])


class Copied:
    def __init__(self, dtype, device, state_dict):
        self.model = build_encoder(dtype)
        self.model.load_state_dict(state_dict)


class ModelLoader:
    def loadmodel(self, path, device, lora_path):
        sd = load_torch_file(path, safe_load=True)
        with init_empty_weights():
            transformer = build_transformer()
        for name, _ in transformer.named_parameters():
            set_module_tensor_to_device(transformer, name, device=device, value=sd[name])
        wrapper = Wrapper()
        wrapper.diffusion_model = transformer
        patcher = ModelPatcher(wrapper, device)
        patcher, _ = apply_lora(patcher, load_torch_file(lora_path))
        return (patcher,)


class EncoderLoader:
    def loadmodel(self, path, device):
        sd = load_torch_file(path, safe_load=True)
        encoder = Encoder(dtype=None, device=device, state_dict=sd)
        return (encoder,)


class CopiedLoader:
    def loadmodel(self, path, device):
        sd = load_torch_file(path, safe_load=True)
        return (Copied(dtype=None, device=device, state_dict=sd),)
'''


def test_a_new_module_filled_by_set_module_tensor_to_device_and_a_same_named_node_method(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"nodes.py": COMFY_NODES}))
    assert found == {"ModelLoader.loadmodel", "Encoder.__init__"}, found


# -- a memoizing decorator keeps what the function returns: `@functools.lru_cache(maxsize=1)` on a reader's
# `get_tensor` (slime's SafetensorReader), `@cached_property` on the object -------------------------------------
CACHED_GETTERS = '''
import functools
from functools import lru_cache, cached_property
from safetensors import safe_open
from safetensors.torch import load_file


class Reader:
    def __init__(self, path):
        self.path = path
        self._files = {}

    @functools.lru_cache(maxsize=1)
    def get_tensor(self, name):
        if name not in self._files:
            self._files[name] = safe_open(self.path, framework="pt")
        tensor = self._files[name].get_tensor(name)
        return tensor

    @functools.lru_cache(maxsize=1)
    def get_copy(self, name):
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name).clone()

    @cached_property
    def embed(self):
        return load_file(self.path)["embed"]

    def plain(self, name):
        with safe_open(self.path, framework="pt") as f:
            return f.get_tensor(name)


@lru_cache()
def shard(path):
    return load_file(path)


@lru_cache()
def shard_keys(path):
    return list(load_file(path).keys())
'''


def test_a_memoizing_decorator_keeps_what_the_function_returns(tmp_path: Path):
    found = _audit(tmp_path, {"cached.py": CACHED_GETTERS})
    assert {(code, fn) for code, fn, _ in found} == {("OWN106", "Reader.get_tensor"), ("OWN102", "Reader.embed"),
                                                    ("OWN106", "shard")}, found


# -- a blind user's probes (stop 70): a receiver whose class is stated answers for itself, not another class's
# producer of the same name; a function returning `pipe.lora_state_dict(...)` is an inferred producer ------------
STATED_RECEIVERS = '''
from safetensors.torch import load_file


class CheckpointLoader:
    def loadmodel(self, path):
        return load_file(path)


class Box:
    def __init__(self, sd):
        self.sd = sd


class NodeLoader:
    def loadmodel(self, path):
        return (Box(load_file(path)),)


class UsesCheckpoint:
    def __init__(self, ckpt: CheckpointLoader):
        self.ckpt = ckpt

    def run(self, path):
        self.sd = self.ckpt.loadmodel(path)


class UsesNode:
    def __init__(self, node: NodeLoader):
        self.node = node

    def run(self, path):
        self.out = self.node.loadmodel(path)


def fetch_lora(pipe, path):
    return pipe.lora_state_dict(path)


class LoraCache:
    def put(self, pipe, path):
        self.lora = fetch_lora(pipe, path)
'''


def test_a_stated_receiver_answers_for_itself_and_a_lora_state_dict_wrapper_is_a_producer(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"stated.py": STATED_RECEIVERS}))
    assert found == {"Box.__init__", "UsesCheckpoint.run", "LoraCache.put"}, found


# -- round 30: a constructor handed a `state_dict` it reads by name (IPAdapter_plus's `To_KV(state_dict)`, its
# dict reaching it through ComfyUI's node graph), and ComfyUI's `set_attr` family, a dotted setattr -----------
CONSTRUCTED_FROM_A_STATE_DICT = '''
import torch.nn as nn
import comfy.utils
from comfy.utils import set_attr_param


class ToKV(nn.Module):
    def __init__(self, state_dict, scale=1.0):
        super().__init__()
        self.to_kvs = nn.ModuleDict()
        for key, value in state_dict.items():
            self.to_kvs[key.replace(".", "_")] = nn.Linear(value.shape[1], value.shape[0], bias=False)
            self.to_kvs[key.replace(".", "_")].weight.data = value


class Copying(nn.Module):
    def __init__(self, state_dict):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.proj.load_state_dict(state_dict)


class Names:
    def __init__(self, state_dict):
        self.keys = list(state_dict.keys())


def inject(model, path):
    sd = comfy.utils.load_torch_file(path, safe_load=True)
    for key, value in sd.items():
        comfy.utils.set_attr(model, key, value)


def inject_params(model, path):
    sd = comfy.utils.load_torch_file(path, safe_load=True)
    for key, value in sd.items():
        set_attr_param(model, key, value)


def inject_copies(model, path):
    sd = comfy.utils.load_torch_file(path, safe_load=True)
    for key, value in sd.items():
        comfy.utils.copy_to_param(model, key, value)
'''


def test_a_constructor_reading_a_state_dict_and_comfy_set_attr_keep(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"constructed.py": CONSTRUCTED_FROM_A_STATE_DICT}))
    assert found == {"ToKV.__init__", "inject", "inject_params"}, found


# -- round 31: a producer handed to an executor (`{executor.submit(_load_shard, p): p ...}`, MAGI-1), ComfyUI's
# `comfy.lora.load_lora` + `ModelPatcher.add_patches` (KJNodes), and `.to(dt)` under `if v.dtype != dt` -------------
HANDED_AND_PATCHED = '''
from concurrent.futures import ThreadPoolExecutor
import comfy.lora
import comfy.utils
from safetensors.torch import load_file


def _load_shard(shard_path, names):
    weights = load_file(shard_path)
    return {name: weights[name] for name in names}


def parallel(shard_map):
    state_dict = {}
    with ThreadPoolExecutor() as executor:
        futures = {executor.submit(_load_shard, p, n): p for p, n in shard_map.items()}
        for future in futures:
            state_dict.update(future.result())
    return state_dict


def parallel_listed(shard_map):
    with ThreadPoolExecutor() as executor:
        futures = [executor.submit(_load_shard, p, n) for p, n in shard_map.items()]
        return [f.result() for f in futures]


def one_future(executor, path):
    return executor.submit(_load_shard, path, ["w"]).result()


def patch(model, path, key_map, strength):
    lora = comfy.utils.load_torch_file(path, safe_load=True)
    loaded = comfy.lora.load_lora(lora, key_map)
    patcher = model.clone()
    patcher.add_patches(loaded, strength)
    return (patcher,)


class Converted:
    def __init__(self):
        self.cache = {}

    def guarded(self, path, save_dtype):
        sd = comfy.utils.load_torch_file(path, safe_load=True)
        for key, value in sd.items():
            if value.dtype != save_dtype and key.endswith(".weight"):
                self.cache[key] = value.to(save_dtype)      # always a copy under that test

    def unguarded(self, path, save_dtype):
        sd = comfy.utils.load_torch_file(path, safe_load=True)
        for key, value in sd.items():
            self.cache[key] = value.to(save_dtype)          # the file's tensor itself when already that dtype
'''


def test_an_executor_a_comfy_patcher_and_a_dtype_guarded_conversion(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"handed.py": HANDED_AND_PATCHED}))
    assert found == {"parallel", "parallel_listed", "patch", "Converted.unguarded"}, found


# -- round 32: a getter caching whole files in a dict its caller passes in, returning one tensor of it (AngelSlim's
# `_get_source_tensor`), and a `torch.nn` module the function builds and fills (`lm_head.weight.data = t`) -------
CALLER_CACHE = '''
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file


def get_source_tensor(path, name, shard, loaded_files):
    if shard not in loaded_files:
        loaded_files[shard] = load_file(path + shard)
    weight = loaded_files[shard][name]
    return weight


def copy_layers(path, weight_map):
    state_dict = {}
    loaded_files = {}
    for name, shard in weight_map.items():
        state_dict[name] = get_source_tensor(path, name, shard, loaded_files)
    return state_dict


def copy_layers_cloned(path, weight_map):
    state_dict = {}
    loaded_files = {}
    for name, shard in weight_map.items():
        state_dict[name] = get_source_tensor(path, name, shard, loaded_files).clone()
    return state_dict


class Head(nn.Module):
    def __init__(self, lm_head):
        super().__init__()
        self.lm_head = lm_head

    @classmethod
    def from_file(cls, path, key):
        lm_head = nn.Linear(4, 4, bias=False)
        with safe_open(path, framework="pt") as f:
            tensor = f.get_slice(key)[:, :4]
        lm_head.weight.data = tensor
        return cls(lm_head)

    @classmethod
    def from_file_copied(cls, path, key):
        lm_head = nn.Linear(4, 4, bias=False)
        with safe_open(path, framework="pt") as f:
            lm_head.weight.data.copy_(f.get_slice(key)[:, :4])
        return cls(lm_head)
'''


def test_a_caller_passed_cache_getter_and_a_built_torch_module(tmp_path: Path):
    found = _functions(_audit(tmp_path, {"caller_cache.py": CALLER_CACHE}))
    assert found == {"get_source_tensor", "copy_layers", "Head.from_file"}, found


# -- a loader handed to a helper as a callable: the helper calls it under its parameter's name (round 35) ----
PASSED_LOADER = '''
import json
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def _read_safetensors(path):
    return load_file(path)


def _read_json(path):
    with open(path) as fh:
        return json.load(fh)


def merge_shards(paths, shard_loader):
    merged = {}
    for path in paths:
        merged.update(shard_loader(path))
    return merged


def sum_shards(paths, shard_loader):
    total = 0.0
    for path in paths:
        for tensor in shard_loader(path).values():
            total += float(tensor.sum())
    return total


def merge_configs(paths, reader):
    merged = {}
    for path in paths:
        merged.update(reader(path))
    return merged


def keep_first(paths, loader):
    kept = []
    for path in paths:
        kept.append(loader(path)["w"])
    return kept


class Loader:
    def _collect(self, paths, fetch):
        self.weights = [fetch(p) for p in paths]

    def load(self, paths):
        self._collect(paths, load_file)
        return keep_first(paths, torch.load)


def load_index(paths):
    state = merge_shards(paths, _read_safetensors)
    total = sum_shards(paths, _read_safetensors)
    config = merge_configs(paths, _read_json)
    return state, total, config
'''


def test_a_loader_passed_as_a_callable_is_called_under_its_parameters_name(tmp_path: Path):
    """``merge_shards(paths, _read_safetensors)``: the helper's ``shard_loader(path)`` is a call of the loader its
    caller passed, so merging every shard's dict keeps them (OWN101), and ``self._collect(paths, load_file)``
    keeps safetensors' dicts on ``self``. The same helpers passed a json reader, or ``torch.load`` without
    ``mmap=True``, keep nothing borrowed; one that sums each shard within its step keeps nothing either."""
    found = _functions(_audit(tmp_path, {"passed_loader.py": PASSED_LOADER}))
    assert found == {"merge_shards", "Loader._collect"}, found


# -- a module-level instance of an audited class: its method keeps what it is handed (round 36) -------------
MODULE_INSTANCE = '''
import safetensors.torch


class FileCache:
    _entries: dict = {}

    def put_file(self, key, value):
        self._entries[key] = value

    def count(self, key, value):
        return len(value)


file_cache = FileCache()


def read_cached(path):
    sd = safetensors.torch.load_file(path)
    file_cache.put_file(path, sd)
    return sd


def read_counted(path):
    sd = safetensors.torch.load_file(path)
    file_cache.count(path, sd)
    return sd
'''


def test_a_module_level_instance_reaches_its_class_method(tmp_path: Path):
    """``file_cache.put_file(path, sd)`` with ``file_cache = FileCache()`` bound once at module level (SD.Next's
    ``state_dict_cache.set``): the call runs ``FileCache.put_file``, whose store into the instance's dict keeps
    the file's tensors; its ``count`` only reads them."""
    found = _functions(_audit(tmp_path, {"cache.py": MODULE_INSTANCE}))
    assert found == {"FileCache.put_file"}, found


# -- an object built around a file's tensor in one helper, kept by another: its constructor's store (round 36) --
BUILT_THEN_KEPT = '''
import safetensors.torch
import torch


class Embedding:
    def __init__(self, vec, name):
        self.vec = vec
        self.name = name


def make_embedding(data, name):
    vec = next(iter(data.values())).detach()
    embedding = Embedding(vec, name)
    embedding.step = data.get("step", None)
    return embedding


class Database:
    def __init__(self):
        self.word_embeddings = {}

    def register(self, embedding, name):
        self.word_embeddings[name] = embedding
        return embedding

    def load_from_file(self, path, name):
        data = safetensors.torch.load_file(path)
        self.register(make_embedding(data, name), name)

    def shape_of_file(self, path, name):
        data = safetensors.torch.load_file(path)
        return make_embedding(data, name).vec.shape
'''


def test_an_object_built_in_one_helper_and_kept_by_another_is_its_constructors_store(tmp_path: Path):
    """``Embedding(vec, name)`` built in ``make_embedding`` and stored by ``Database.register``: the view is kept by
    the constructor's ``self.vec = vec`` (the brief's keeping statement), and the object stored again keeps
    nothing new, so the finding is ``Embedding.__init__``'s, not ``register``'s (Forge's textual inversion).
    The same object used within the step (``shape_of_file``) keeps nothing."""
    found = _audit(tmp_path, {"emb.py": BUILT_THEN_KEPT})
    assert _functions(found) == {"Embedding.__init__"}, found


# -- a static method called on its own class is that method, not another file's function of the same name --
CLASS_CALLED = {
    "vae.py": '''
from safetensors import safe_open


def load_model(path):
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}
''',
    "tagger.py": '''
import torch
from safetensors.torch import load_file

model = None


class VisionModel(torch.nn.Module):
    @staticmethod
    def load_model(path):
        instance = VisionModel()
        instance.load_state_dict(load_file(path))
        return instance


def load(folder):
    global model
    model = VisionModel.load_model(folder)
''',
}


def test_a_static_method_called_on_its_class_is_not_a_producer_of_the_same_name(tmp_path: Path):
    """``VisionModel.load_model(folder)`` runs the class's own static method (which copies the file into a new
    model), not ``vae.load_model``, the producer inferred under that name in another file: storing its result
    in a global keeps nothing borrowed (SD.Next's JoyTag captioner). ``vae.load_model`` itself is flagged (the
    dict of a handle's tensors returned from inside its `with`)."""
    found = _functions(_audit(tmp_path, CLASS_CALLED))
    assert "load" not in found, found


# -- a registry of classes: a call on a loop target over it may run each class's method (round 36) ------------
REGISTRY = {
    "patchers.py": '''
class ControlModelPatcher:
    @staticmethod
    def try_build_from_state_dict(state_dict, ckpt_path):
        return None

    def __init__(self, model_patcher=None):
        self.model_patcher = model_patcher


class InpaintPatcher(ControlModelPatcher):
    @staticmethod
    def try_build_from_state_dict(state_dict, ckpt_path):
        if "head.weight" in state_dict:
            return InpaintPatcher(state_dict, ckpt_path)
        return None

    def __init__(self, state_dict, filename):
        super().__init__()
        self.state_dict = state_dict
        self.filename = filename


class ShapePatcher(ControlModelPatcher):
    @staticmethod
    def try_build_from_state_dict(state_dict, ckpt_path):
        if "shape" in state_dict:
            return ShapePatcher(state_dict["shape"].shape)
        return None

    def __init__(self, shape):
        super().__init__()
        self.shape = shape
''',
    "registry.py": '''
from safetensors.torch import load_file

supported_control_models = []


def try_load_supported_control_model(ckpt_path):
    state_dict = load_file(ckpt_path)
    for supported_type in supported_control_models:
        model = supported_type.try_build_from_state_dict(state_dict, ckpt_path)
        if model is not None:
            return model
    return None


def probe(ckpt_path, patcher):
    state_dict = load_file(ckpt_path)
    return patcher.try_build_from_state_dict(state_dict, ckpt_path) is not None
''',
}


def test_a_call_over_a_registry_of_classes_runs_each_ones_method(tmp_path: Path):
    """``for supported_type in supported_control_models: supported_type.try_build_from_state_dict(sd, path)``
    (Forge's ControlNet patchers, registered at import): the receiver is any of the audited classes defining that
    static method, so each is followed; the one whose constructor keeps the file's dict (``self.state_dict =
    state_dict``) is credited, once, when the built object is returned. ``ShapePatcher`` keeps a shape only, and a
    parameter of no stated class (``probe``'s ``patcher``) is not guessed among several classes."""
    found = _functions(_audit(tmp_path, REGISTRY))
    assert found == {"InpaintPatcher.__init__"}, found


# -- a blind user's probes of the round 35-36 rules (stop 71) -------------------------------------------------
USER_PROBES = {
    "cache.py": '''
class StateDictCache:
    def __init__(self):
        self._entries = {}

    def put(self, path, sd):
        self._entries[path] = sd

    def size(self, sd):
        return len(sd)


state_dict_cache = StateDictCache()
''',
    "loader.py": '''
from safetensors.torch import load_file

from cache import state_dict_cache


class Patcher:
    def __init__(self, hint_weight, hint_bias):
        self.hint_weight = hint_weight
        self.hint_bias = hint_bias


class ScaleTable:
    scales = {}

    @classmethod
    def consume(cls, name, tensor):
        cls.scales[name] = tensor

    @classmethod
    def peek(cls, name, tensor):
        return tensor.shape


def _build(sd):
    return Patcher(sd["hint.weight"], sd["hint.bias"])


def load_patcher(path):
    sd = load_file(path)
    return _build(sd)


def load_cached(path):
    sd = load_file(path)
    state_dict_cache.put(path, sd)
    return state_dict_cache.size(sd)


def load_scales(path):
    sd = load_file(path)
    for name, tensor in sd.items():
        ScaleTable.consume(name, tensor)
        ScaleTable.peek(name, tensor)
''',
}


def test_a_blind_users_probes_of_constructors_instances_and_classmethods(tmp_path: Path):
    """What stop 71's blind user found: a constructor reached through a helper is credited for each argument it
    stores (``self.hint_bias`` too, not the first alone); an instance imported from the module that binds it
    (``from cache import state_dict_cache``) runs its class's method, even one named as a container's (``put``); a classmethod called on its class binds
    ``cls`` itself, so ``ScaleTable.consume(name, tensor)``'s store into ``cls.scales`` is found (its arguments
    were bound one place off before). Their reading methods keep nothing."""
    found = _audit(tmp_path, USER_PROBES)
    assert {(fn, line) for _, fn, line in found} == {
        ("Patcher.__init__", 9), ("Patcher.__init__", 10), ("StateDictCache.put", 7), ("ScaleTable.consume", 18)}, found


# -- round 41 (A1111, SD.Next): an object whose attribute dict holds one LoRA module's tensors, handed through a
# registry of module types (each in its own file, imported as a module) to constructors that keep them --------
NETWORK_BASE = '''
from collections import namedtuple

Weights = namedtuple("Weights", ["key", "w", "layer"])


class ModuleKind:
    def build_module(self, net, weights):
        return None


class AdapterModule:
    def __init__(self, net, weights):
        self.net = net
        self.layer = weights.layer
        self.bias = weights.w.get("bias")
        self.scale = weights.w["scale"].item() if "scale" in weights.w else None
'''
NETWORK_KEEP = '''
import network_base as base


class KindKeep(base.ModuleKind):
    def build_module(self, net, weights):
        if "down" in weights.w:
            return KeepModule(net, weights)
        return None


class KeepModule(base.AdapterModule):
    def __init__(self, net, weights):
        super().__init__(net, weights)
        self.down = weights.w["down"]
        self.rank = self.down.shape[0]
'''
NETWORK_COPY = '''
import torch
import network_base as base


class KindCopy(base.ModuleKind):
    def build_module(self, net, weights):
        if "a" in weights.w:
            w = weights.w.copy()
            weights.w.clear()
            weights.w.update({"up": w["a"]})
            return CopyModule(net, weights)
        return None


class CopyModule:
    def __init__(self, net, weights):
        self.up = torch.nn.Parameter(weights.w["up"].clone())
        self.layer = weights.layer
'''
NETWORK_LOADER = '''
from safetensors.torch import load_file
import network_base as base
import network_keep
import network_copy

kinds = [network_copy.KindCopy(), network_keep.KindKeep()]


def load_adapter(net, filename):
    sd = load_file(filename)
    grouped = {}
    for full_key, weight in sd.items():
        layer, _, part = full_key.partition(".")
        if layer not in grouped:
            grouped[layer] = base.Weights(key=full_key, w={}, layer=None)
        grouped[layer].w[part] = weight
    for layer, weights in grouped.items():
        module = None
        for kind in kinds:
            module = kind.build_module(net, weights)
            if module is not None:
                break
        net.modules[layer] = module
    return net


def count_parts(filename):
    sd = load_file(filename)
    grouped = {}
    for full_key, weight in sd.items():
        layer, _, part = full_key.partition(".")
        if layer not in grouped:
            grouped[layer] = base.Weights(key=full_key, w={}, layer=None)
        grouped[layer].w[part] = weight
    return {layer: len(weights.w) for layer, weights in grouped.items()}
'''


def test_an_attribute_dict_of_a_new_object_carries_its_tensors_to_the_constructors_that_keep_them(tmp_path: Path):
    """``grouped[layer].w[part] = weight`` fills the dict of a namedtuple the step builds: no keep there. The
    constructors a registry's ``build_module`` runs on it keep ``weights.w[...]`` (in the base class of another
    module too, reached through ``super().__init__`` on ``base.AdapterModule``); one that copies keeps
    nothing, and a ``build_module`` that puts the object's own tensors back into it (``weights.w.update``) keeps
    nothing new. Counting the parts keeps nothing at all."""
    found = _audit(tmp_path, {"network_base.py": NETWORK_BASE, "network_keep.py": NETWORK_KEEP,
                              "network_copy.py": NETWORK_COPY, "network_loader.py": NETWORK_LOADER})
    assert _functions(found) == {"KeepModule.__init__", "AdapterModule.__init__"}, found
    assert {(c, fn, line) for c, fn, line in found if fn == "AdapterModule.__init__"} == {
        ("OWN102", "AdapterModule.__init__", 16)}, found  # `self.bias`; not `.layer`, not `.item()`
    assert {line for _, fn, line in found if fn == "KeepModule.__init__"} == {15}, found


# -- round 41 (SD.Next): a loader whose handler binds None, and an object cached before it is filled ---------
HANDLER_AND_CACHE = '''
import safetensors.torch

cache = {}


def read_dict(path):
    try:
        sd = safetensors.torch.load_file(path)
    except Exception:
        sd = None
    return sd


class Bundle:
    def __init__(self, name):
        self.name = name
        self.extra = None


def load_bundle(name, path):
    bundle = Bundle(name)
    cache[name] = bundle
    sd = read_dict(path)
    embeddings = {}
    for key, t in sd.items():
        embeddings[key] = t
    bundle.extra = embeddings
    return bundle


def load_bundle_copied(name, path):
    bundle = Bundle(name)
    cache[name] = bundle
    sd = read_dict(path)
    bundle.extra = {k: t.clone() for k, t in sd.items()}
    return bundle


def load_bundle_uncached(name, path):
    bundle = Bundle(name)
    sd = read_dict(path)
    embeddings = {}
    for key, t in sd.items():
        embeddings[key] = t
    bundle.extra = embeddings
    return bundle
'''


def test_a_handler_binding_none_does_not_undo_the_body_and_an_object_cached_first_keeps_what_it_gets(tmp_path: Path):
    """``read_dict`` returns the file's dict on the path that raised nothing (the handler's ``sd = None`` is the
    other path): a producer. ``load_bundle`` caches the new object (``cache[name] = bundle``) before it gives it
    the tensors: that later attribute store puts them in the module-level cache. The copy keeps nothing, and an
    object returned uncached is handed on."""
    found = _audit(tmp_path, {"bundles.py": HANDLER_AND_CACHE})
    assert found == {("OWN106", "load_bundle", 28)}, found


TO_WITH_COPY = '''
import torch
from safetensors.torch import load_file


class Layer:
    def __init__(self, path):
        sd = load_file(path)
        self.up = sd["up"].to(torch.float32, copy=True)
        self.down = sd["down"].to(torch.float32)
'''


def test_to_with_copy_true_always_copies(tmp_path: Path):
    """``Tensor.to(..., copy=True)``: "a new Tensor is created even when the Tensor already matches the desired
    conversion" (torch's documentation), so it keeps no view; without it, the same `.to` is conditional."""
    found = _audit(tmp_path, {"layer.py": TO_WITH_COPY})
    assert found == {("OWN107", "Layer.__init__", 10)}, found


# -- round 41 (ComfyUI): what a constructor keeps on self, handed by a later method to a new holder ----------
TRAIN_DIFF = '''

class TrainDiff(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        blocks, scale = weights
        self.blocks = torch.nn.Parameter(blocks)
'''
KEPT_ON_SELF = '''
import torch
from safetensors.torch import load_file
''' + TRAIN_DIFF + '''        self.scale = torch.nn.Parameter(scale.clone())


class Adapter:
    def __init__(self, weights):
        self.weights = weights
        self.target = None

    def to_train(self):
        return TrainDiff(self.weights)

    def install(self):
        self.target.weight = self.weights[0]

    def refile(self):
        self.backup = self.weights
        return self.weights

    def state_dict(self, destination):
        destination["blocks"] = self.weights[0]
        return destination

    def scaled(self):
        return TrainDiff((self.weights[0].clone(), self.weights[1]))

    @classmethod
    def load(cls, path):
        sd = load_file(path)
        return cls((sd["blocks"], sd["scale"]))
'''


def test_what_a_constructor_keeps_on_self_is_kept_anew_in_another_holder(tmp_path: Path):
    """``__init__`` keeps the file's tensors on ``self.weights`` (found there, reached from ``load``). Another
    method that hands them to a new module's ``nn.Parameter`` (``to_train``: credited at the constructor's store) or
    sets them on another object held by ``self`` (``install``) keeps them anew; filing them on ``self`` again,
    returning them, or handing them to the caller's ``destination`` dict keeps nothing new, and a clone keeps
    nothing at all (``scaled``)."""
    found = _audit(tmp_path, {"adapter.py": KEPT_ON_SELF})
    assert found == {("OWN102", "Adapter.__init__", 16), ("OWN102", "TrainDiff.__init__", 10),
                     ("OWN102", "Adapter.install", 23)}, found


# -- round 42 (sd3.5, Sana): a parameter made to share a fetched tensor's storage; a checkpoint's counter -------
SET_AND_COUNTERS = '''
import torch
from safetensors import safe_open
from safetensors.torch import load_file


def load_into(path, model):
    with safe_open(path, framework="pt") as ckpt:
        for key in ckpt.keys():
            obj = model.get_parameter(key)
            obj.set_(ckpt.get_tensor(key))


def load_into_copied(path, model):
    with safe_open(path, framework="pt") as ckpt:
        for key in ckpt.keys():
            model.get_parameter(key).copy_(ckpt.get_tensor(key))


class Trainer:
    def resume(self, path):
        checkpoint = {"state_dict": load_file(path), "step": 0}
        self.step = checkpoint["step"]
        self.epoch = checkpoint.get("epoch", 0)
        self.model.load_state_dict(checkpoint["state_dict"])

    def resume_kept(self, path):
        checkpoint = {"state_dict": load_file(path), "step": 0}
        self.weights = checkpoint["state_dict"]
'''


def test_set_shares_storage_and_a_checkpoint_counter_is_no_weight(tmp_path: Path):
    """``param.set_(t)``: "self tensor will share the same storage" (torch's documentation), so the model keeps the
    fetched tensor (sd3.5's ``load_into``); ``copy_`` does not. ``checkpoint["step"]`` and ``.get("epoch")`` are
    training counters, not weights (Sana's trainers); the nested state dict kept on ``self`` still is."""
    found = _audit(tmp_path, {"loaders.py": SET_AND_COUNTERS})
    assert _functions(found) == {"load_into", "Trainer.resume_kept"}, found


APPENDED_THEN_FILLED = '''
from safetensors.torch import load_file

loaded = []


class Net:
    def __init__(self, name):
        self.name = name
        self.extra = {}


def load_net(name, path):
    net = Net(name)
    loaded.append(net)
    sd = load_file(path)
    net.extra = {k: v for k, v in sd.items() if k.startswith("emb.")}
    return net


def load_net_copied(name, path):
    net = Net(name)
    loaded.append(net)
    sd = load_file(path)
    net.extra = {k: v.clone() for k, v in sd.items()}
    return net
'''


def test_an_object_appended_to_a_global_list_then_filled_keeps_what_it_gets(tmp_path: Path):
    """As for a store by key: ``loaded.append(net)`` then ``net.extra = ...`` (a blind user's round 41 case)."""
    found = _audit(tmp_path, {"nets.py": APPENDED_THEN_FILLED})
    assert found == {("OWN106", "load_net", 17)}, found


# -- a blind user's round 41 cases: a dataclass's default_factory, an object fetched back by key, an inline registry
OBJECT_FETCHED_BACK = '''
from dataclasses import dataclass, field
from safetensors.torch import load_file


@dataclass
class Parts:
    key: str
    w: dict = field(default_factory=dict)


class Scale:
    def __init__(self, parts):
        self.scale = parts.w["scale"]
        self.key = parts.key


class ScaleCopy:
    def __init__(self, parts):
        self.scale = parts.w["scale"].clone()


class ScaleKind:
    def make_module(self, parts):
        return Scale(parts) if "scale" in parts.w else None


class CopyKind:
    def make_module(self, parts):
        return ScaleCopy(parts) if "copy" in parts.w else None


def read_adapter(path, net):
    sd = load_file(path)
    by_key = {}
    for full, t in sd.items():
        key, _, part = full.partition(".")
        entry = by_key.get(key)
        if entry is None:
            entry = Parts(key)
            by_key[key] = entry
        entry.w[part] = t
    for key, entry in by_key.items():
        for kind in (CopyKind(), ScaleKind()):
            module = kind.make_module(entry)
            if module is not None:
                net.modules[key] = module
                break
    return net
'''


def test_a_dataclass_field_object_fetched_back_by_key_and_an_inline_registry(tmp_path: Path):
    """``w: dict = field(default_factory=dict)`` gives each new ``Parts`` a new dict; ``entry = by_key.get(key)``
    (or a new one stored there) is an object of ``by_key``; ``for kind in (CopyKind(), ScaleKind()):`` is a registry:
    the constructor that keeps ``parts.w["scale"]`` is found, the one that clones it and the fill are not."""
    found = _audit(tmp_path, {"adapters.py": OBJECT_FETCHED_BACK})
    assert found == {("OWN102", "Scale.__init__", 14)}, found


# -- round 43 (ComfyUI-layerdiffuse, Advanced-ControlNet): a module-level alias of a library loader; a dict of
# dicts of lists of a file's tensors; a dict of lists of tensors is no state dict --------------------------
LAYER_PATCHES = '''
from comfy.utils import load_torch_file

load_layer_model = load_torch_file


def to_patch_dict(state_dict):
    grouped = {}
    for k, w in state_dict.items():
        key, kind, index = k.split("::")
        if key not in grouped:
            grouped[key] = {}
        if kind not in grouped[key]:
            grouped[key][kind] = [None] * 4
        grouped[key][kind][int(index)] = w
    flat = {}
    for key, kinds in grouped.items():
        for kind, weights in kinds.items():
            flat[key] = (kind, weights)
    return flat


def apply_layer(model, path, strength):
    patches = to_patch_dict(load_layer_model(path))
    patched = model.clone()
    patched.add_patches(patches, strength)
    return patched


def apply_layer_copied(model, path, strength):
    sd = {k: v.clone() for k, v in load_layer_model(path).items()}
    patched = model.clone()
    patched.add_patches(to_patch_dict(sd), strength)
    return patched


def merge_outputs(control: dict[str, list["torch.Tensor"]], scale: float):
    for key in control:
        outputs = control[key]
        for i in range(len(outputs)):
            outputs[i] *= scale
    return control
'''


def test_a_loader_alias_a_dict_of_dicts_of_lists_and_a_dict_of_activation_lists(tmp_path: Path):
    """``load_layer_model = load_torch_file`` at module level is ComfyUI's loader; ``to_patch_dict`` regroups the
    file's tensors into a dict of dicts of lists and returns their flattening, which ``add_patches`` keeps on the
    patcher; the clones are kept nothing of. A ``control: dict[str, list[Tensor]]`` parameter (a ControlNet's outputs
    by block, named for them as ``outputs`` or ``batch`` would be) is not a dict of weights: scaling its tensors in
    place writes into activations."""
    found = _audit(tmp_path, {"layers.py": LAYER_PATCHES})
    assert _functions(found) == {"apply_layer"}, found


# -- a blind user's round 42-43 cases: the store on self reached from another module; a module attribute's alias
ADAPTERS_MODULE = '''
import torch
''' + TRAIN_DIFF + '''

class Adapter:
    def __init__(self, weights):
        self.weights = weights

    def to_train(self):
        return TrainDiff(self.weights)
'''
LOADERS_MODULE = '''
import safetensors.torch as stt
from adapters import Adapter

read_any = stt.load_file


def load_adapter(path):
    sd = read_any(path)
    return Adapter((sd["blocks"], sd["scale"]))
'''


def test_a_store_on_self_reached_from_another_module_and_a_module_attribute_alias(tmp_path: Path):
    """``Adapter.__init__``'s store is reached only from ``loaders.py``'s walk, audited after ``adapters.py``: the
    methods reading ``self.weights`` are walked once every module has been (``to_train`` into ``TrainDiff``'s
    ``nn.Parameter``). ``read_any = stt.load_file`` after ``import safetensors.torch as stt`` is the loader."""
    found = _audit(tmp_path, {"adapters.py": ADAPTERS_MODULE, "loaders.py": LOADERS_MODULE})
    assert found == {("OWN102", "Adapter.__init__", 14), ("OWN102", "TrainDiff.__init__", 9)}, found


# -- round 44: an in-place write into the items of a container that was empty before the loop that filled it
DIFFERENCE_ADAPTER = '''
import torch
import safetensors.torch


def merge_difference(path, base_sd, renames):
    raw = safetensors.torch.load_file(path)
    if "format.v2" in raw:
        weights = {}
        for old, new in renames.items():
            if old in raw:
                weights[new] = raw.pop(old)
        raw = weights
    for key in raw:
        if key in base_sd:
            delta = raw[key]
            delta += base_sd[key].to(delta.dtype)
    return raw


def merge_difference_owned(path, base_sd, renames):
    raw = safetensors.torch.load_file(path)
    weights = {}
    for old, new in renames.items():
        if old in raw:
            weights[new] = raw[old].clone()
    for key in weights:
        delta = weights[key]
        delta += base_sd[key]
    return weights


def scale_with_extras(path, scale):
    raw = safetensors.torch.load_file(path)
    weights = {"bias": torch.zeros(8)}
    for name in raw:
        if name.endswith(".weight"):
            weights[name] = raw[name]
    weights["bias"] += scale
    return weights
'''


def test_an_in_place_write_into_the_items_of_a_container_filled_from_empty(tmp_path: Path):
    """``weights = {}`` filled in a loop (on some steps only) with the file's tensors and rebound over the file's
    dict on one branch: whichever path was taken, each item of ``raw`` is the file's, so ``delta += ...`` writes
    into the loader's buffer (a "difference" ControlNet made absolute, ComfyUI's and its node packs' shape). A
    container filled with copies is not; one that held its own tensor before the loop (``weights["bias"]``) is not
    certainly the file's, and an in-place write is reported only when it is certain."""
    found = _audit(tmp_path, {"adapters.py": DIFFERENCE_ADAPTER})
    assert found == {("OWN120", "merge_difference", 17)}, found


# -- round 44's first run: a json reader renamed `load_file`; a node method every class of a pack defines
PROJECT_FILEIO = '''
import json


def load(path):
    with open(path) as fh:
        return json.load(fh)
'''
RENAMED_READERS = '''
{import_line}


def model_urls(path):
    urls = load_file(path)
    extra = load_file(path + ".local")
    urls.update(extra)
    return urls
'''


def test_a_function_imported_renamed_from_the_project_is_not_the_loader_its_alias_names(tmp_path: Path):
    """``from .fileio import load as load_file`` (mmcv's json/yaml reader, vendored by comfyui_controlnet_aux)
    binds the project's ``load``, audited or not (here the module is not given): merging two of its results keeps
    no tensor. The same text with ``from safetensors.torch import load_file`` merges two files' tensors into the
    first one's dict."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    renamed = RENAMED_READERS.format(import_line="from .fileio import load as load_file")
    assert _audit(tmp_path, {"pkg/urls.py": renamed}) == set()
    assert _audit(tmp_path, {"pkg/fileio.py": PROJECT_FILEIO, "pkg/urls.py": renamed}) == set()
    loader = RENAMED_READERS.format(import_line="from safetensors.torch import load_file")
    assert _functions(_audit(tmp_path, {"pkg/urls.py": loader})) == {"model_urls"}


NODE_PACK = '''
import safetensors.torch

NODE_CLASS_MAPPINGS = {{}}


class LatentReceiver:
    def doit(self, path):
        return (safetensors.torch.load_file(path)["latent"],)


class Upscale:
    def doit(self, image, scale):
        return (image * scale,)


class Crop:
    def doit(self, image, size):
        return (image[:, :size],)


class Blend:
    def doit(self, image, other):
        return (image + other,)


def apply_named(image, steps):
    for name, arg in steps:
        cls = NODE_CLASS_MAPPINGS[name]
        image, = cls().doit(image, arg)
    return image
{extra}
'''


def test_a_method_name_most_classes_define_as_no_producer_on_a_receiver_of_no_stated_class(tmp_path: Path):
    """``cls().doit(image, arg)`` with ``cls`` taken from a node registry: four classes define ``doit``, one reads
    a latent file, and the project never builds that one (ComfyUI's graph does): the call is not taken for it, so
    ``image``, rebound each step, keeps nothing. Where the project builds the reading class itself
    (``LatentReceiver().doit(p)``), an object of it may be the receiver, and the name is matched as before."""
    assert _audit(tmp_path, {"nodes.py": NODE_PACK.format(extra="")}) == set()
    built = NODE_PACK.format(extra="\n\ndef first_latent(paths):\n    return LatentReceiver().doit(paths[0])[0]\n")
    assert _functions(_audit(tmp_path, {"nodes.py": built})) == {"apply_named"}


# -- calls through a dotted module path; a file's dict re-keyed by an audited helper is still the step's dict
PATCH_UTILS = '''
import torch
import safetensors.torch


def load_torch_file(path):
    return safetensors.torch.load_file(path)


def put_weight(obj, attr, value):
    setattr(obj, attr, torch.nn.Parameter(value, requires_grad=False))


def to_native(sd, prefix):
    out = {}
    for k in sd:
        out[prefix + k.replace("transformer.", "")] = sd[k]
    return out
'''
PATCH_NODES = '''
import comfy.utils


def install(model, path):
    sd = comfy.utils.load_torch_file(path)
    for k in sd:
        comfy.utils.put_weight(model, k, sd[k])


def install_owned(model, path):
    sd = comfy.utils.load_torch_file(path)
    for k in sd:
        comfy.utils.put_weight(model, k, sd[k].clone())


def load_native(path, build):
    sd = comfy.utils.load_torch_file(path)
    new_sd = comfy.utils.to_native(sd, "")
    for k in sd:
        new_sd[k] = sd[k]
    return build(new_sd)
'''


def test_a_call_through_a_dotted_module_path_and_a_dict_re_keyed_by_a_helper(tmp_path: Path):
    """``comfy.utils.put_weight(model, k, sd[k])`` after ``import comfy.utils`` runs the audited module's
    function, whose ``setattr`` of an ``nn.Parameter`` on the caller's model keeps the file's tensor, reported at
    that statement (a copy first keeps nothing; unresolved, the call kept nothing the audit could see). The file's
    dict re-keyed by ``comfy.utils.to_native`` into a dict of its own is still the step's dict of weights: putting
    the file's other tensors in beside them keeps nothing past the step (ComfyUI's MMDiT ControlNet loaders)."""
    (tmp_path / "comfy").mkdir()
    (tmp_path / "comfy" / "__init__.py").write_text("")
    found = _audit(tmp_path, {"comfy/utils.py": PATCH_UTILS, "comfy/nodes.py": PATCH_NODES})
    assert found == {("OWN102", "put_weight", 11)}, found


# -- round 45's first run: web UI extensions' loaders, a helper's in-place write on some paths, a (model, tensor)
# tuple, a library patcher behind a wrapper
WEBUI_EXTENSION = '''
import torch
from modules import sd_models


def forge_or_webui(filename, forge):
    if forge:
        from backend.utils import load_torch_file
        return load_torch_file(filename)
    return sd_models.read_state_dict(filename)


cache = {}


def load_cached(filename, forge):
    cache[filename] = forge_or_webui(filename, forge)
    return cache[filename]


def blend(theta, other, alpha):
    for key in theta:
        theta[key][:4] = other[key][:4] * alpha


def merge(a, theta_1, mode, alpha):
    if "tensor" in mode:
        theta_0 = {}
        for key, t in sd_models.read_state_dict(a).items():
            theta_0[key] = t.clone()
    else:
        theta_0 = sd_models.read_state_dict(a)
    if "tensor" in mode:
        blend(theta_0, theta_1, alpha)
    return {k: v.half() for k, v in theta_0.items()}
'''


def test_a_web_ui_extension_loads_through_the_web_ui_and_writes_in_place_on_some_paths(tmp_path: Path):
    """``sd_models.read_state_dict`` (AUTOMATIC1111's, after ``from modules import sd_models``) and Forge's
    ``backend.utils.load_torch_file`` load a file's dict: cached at module level, it is kept. A helper writing in
    place into a dict that is the file's on one path only (``theta_0`` of clones when ``"tensor" in mode``, which is
    also the only path that calls ``blend``) is not certain to write into the file's tensors: not reported, as the
    same write in the function itself would not be (sd-webui-supermerger's ``tensormerge``)."""
    found = _audit(tmp_path, {"merge.py": WEBUI_EXTENSION})
    assert _functions(found) == {"load_cached"}, found


TEXT_MODELS = '''
from safetensors.torch import load_file
from accelerate.utils import set_module_tensor_to_device


def load_models(path):
    state_dict = load_file(path)
    text_model = TextModel()
    for k in list(state_dict.keys()):
        if k.startswith("te."):
            set_module_tensor_to_device(text_model, k[3:], "cpu", value=state_dict.pop(k).float())
    scale = state_dict["logit_scale"]
    return text_model, scale


def extract(a, b):
    te_a, _ = load_models(a)
    te_b, _ = load_models(b)
    encoders = [te_a, te_b]
    return [e.weight - f.weight for e, f in zip(encoders, encoders[1:])]


def scales(a, b):
    _, first = load_models(a)
    _, second = load_models(b)
    return first, second
'''


TEXT_MODELS_THROUGH_A_HELPER = TEXT_MODELS.replace('''    for k in list(state_dict.keys()):
        if k.startswith("te."):
            set_module_tensor_to_device(text_model, k[3:], "cpu", value=state_dict.pop(k).float())''', '''    te_sd = {}
    for k in list(state_dict.keys()):
        if k.startswith("te."):
            te_sd[k[3:]] = state_dict.pop(k)
    _load_on_device(text_model, te_sd)''') + '''

def _load_on_device(model, state_dict):
    for k in list(state_dict.keys()):
        set_module_tensor_to_device(model, k, "cpu", value=state_dict.pop(k))
'''


def test_a_returned_pair_of_a_model_and_a_tensor_hands_out_only_the_tensor(tmp_path: Path):
    """``return text_model, scale`` (kohya's ``load_models_from_sdxl_checkpoint`` returns the models and the file's
    ``logit_scale``): unpacked, only the second element is the file's, so gathering the first elements of two calls
    keeps nothing of theirs (the model keeps what ``set_module_tensor_to_device`` put in it, reported there); the
    second elements, held past the next file's fetch, are kept."""
    found = _audit(tmp_path, {"models.py": TEXT_MODELS})
    assert _functions(found) == {"load_models", "scales"}, found
    # the same through a helper (kohya's `_load_state_dict_on_device`) filling the new model: the module keeps what
    # accelerate installs for its own life, reported in the helper, and the model returned is no holder of the step
    found = _audit(tmp_path, {"models.py": TEXT_MODELS_THROUGH_A_HELPER})
    assert _functions(found) == {"_load_on_device", "scales"}, found


PATCHER_PACK = '''
import comfy.lora
import comfy.model_patcher
from comfy import utils


class TextEncoderWrapper:
    def __init__(self, model):
        self.patcher = comfy.model_patcher.ModelPatcher(model)

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        return self.patcher.add_patches(patches, strength_patch, strength_model)


def apply_lora(model, path, strength):
    lora = utils.load_torch_file(path)
    loaded = comfy.lora.load_lora(lora, {})
    patched = model.clone()
    patched.add_patches(loaded, strength)
    return patched
'''
VENDORED_PATCHER = '''
class ModelPatcher:
    def __init__(self, model):
        self.model = model
        self.patches = {}

    def clone(self):
        return ModelPatcher(self.model)

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        for k in patches:
            self.patches.setdefault(k, []).append((strength_patch, patches[k], strength_model))
        return list(patches)
'''


def test_a_library_patchers_method_behind_a_wrapper_and_in_a_vendored_copy(tmp_path: Path):
    """``patched.add_patches(loaded, strength)`` on a clone of a ComfyUI model: the pack's own ``add_patches`` is a
    wrapper that hands the patches to ComfyUI's ``ModelPatcher`` it holds, so the call still runs ComfyUI's, which
    keeps them (ComfyUI_ExtraModels' ``load_pixart_lora``). Where the tree vendors a ``ModelPatcher`` of its own
    (Fooocus's ``ldm_patched``), the call runs that copy: its store is the finding, not the call."""
    assert _functions(_audit(tmp_path, {"nodes.py": PATCHER_PACK})) == {"apply_lora"}
    vendored = _audit(tmp_path, {"nodes.py": PATCHER_PACK, "patcher.py": VENDORED_PATCHER})
    assert "apply_lora" not in _functions(vendored), vendored


# -- a nested function filling its enclosing function's dict with what it is handed, and one caching its fetches
CLOSURE_FILLS = '''
import safetensors.torch


def save_checkpoint(path, unet_sd, te_path, save_file):
    state_dict = {}

    def update_sd(prefix, sd):
        for k, v in sd.items():
            state_dict[prefix + k] = v

    update_sd("model.", unet_sd)
    update_sd("te.", safetensors.torch.load_file(te_path))
    save_file(state_dict, path)


def convert(weight_map, names):
    loaded_files = {}

    def get_tensor(name):
        file_name = weight_map[name]
        if file_name not in loaded_files:
            loaded_files[file_name] = safetensors.torch.load_file(file_name)
        return loaded_files[file_name][name]

    return [get_tensor(n).float() for n in names]
'''


def test_a_nested_function_filling_its_enclosing_functions_dict(tmp_path: Path):
    """kohya's ``update_sd(prefix, sd)`` puts what its enclosing function hands it into that function's
    ``state_dict``, written to a file and dropped: the store is the enclosing function's into its own per-call
    dict, judged there (it dies with the call). A nested ``get_tensor`` that caches the files it loads itself in the
    enclosing function's dict keeps them across fetches (DeepSeek-V3's and ModelOpt's conversion scripts)."""
    found = _audit(tmp_path, {"convert.py": CLOSURE_FILLS})
    assert _functions(found) == {"convert.<locals>.get_tensor"}, found


# -- ComfyUI's node graph: one node's output handed to another's input of the same declared type
GRAPH_NODES = '''
import comfy.utils


class MakePatchSet:
    RETURN_TYPES = ("PATCH_SET", "STRING")
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(s):
        return {"required": {"name": ("STRING", {"default": ""})}}

    def build(self, name):
        lora = comfy.utils.load_torch_file(name)
        patch_set = {"blocks": {k: (v, 1.0) for k, v in lora.items()}, "muted": []}
        return (patch_set, name)


class MakeOwnedSet:
    RETURN_TYPES = ("OWNED_SET",)
    FUNCTION = "build"

    @classmethod
    def INPUT_TYPES(s):
        return {"required": {"name": ("STRING", {"default": ""})}}

    def build(self, name):
        lora = comfy.utils.load_torch_file(name)
        return ({"blocks": {k: (v.clone(), 1.0) for k, v in lora.items()}},)


class ApplyPatchSet:
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(s):
        return {"required": {"model": ("MODEL",), "patch_set": ("PATCH_SET",)},
                "optional": {"owned": ("OWNED_SET",)}}

    @staticmethod
    def apply(model, patch_set, owned=None):
        patched = model.clone()
        for k, v in patch_set["blocks"].items():
            weights, ratio = v
            patched.add_patches({k: weights}, ratio)
        if owned is not None:
            for k, v in owned["blocks"].items():
                patched.add_patches({k: v[0]}, v[1])
        return (patched,)
'''


def test_a_comfyui_node_input_wired_to_another_nodes_output_by_its_declared_type(tmp_path: Path):
    """``MakePatchSet.build`` returns the LoRA file's tensors as its ``PATCH_SET`` output (``RETURN_TYPES``);
    ``ApplyPatchSet`` declares an input ``patch_set`` of that type (``INPUT_TYPES``), which ComfyUI's graph hands it
    with no call between them (Inspire-Pack's ``MakeLBW`` → ``ApplyLBW``): its ``add_patches`` keeps them. The
    ``OWNED_SET`` output holds clones, so what the same method patches from it keeps nothing of the file."""
    found = _audit(tmp_path, {"nodes.py": GRAPH_NODES})
    assert found == {("OWN102", "ApplyPatchSet.apply", 46)}, found


TUPLE_KEYS = '''
from safetensors import safe_open


def gather(paths, keys):
    results = {}
    for p in paths:
        with safe_open(p, "pt") as f:
            for k in keys:
                results[(p, k)] = f.get_tensor(k)
    return results


def scatter(paths, keys, out):
    grid = out.new_zeros(len(paths), len(keys))
    for i, p in enumerate(paths):
        with safe_open(p, "pt") as f:
            for j, k in enumerate(keys):
                grid[i, j] = f.get_tensor(k).sum()
    return grid
'''


def test_a_store_under_a_tuple_key_into_a_dict(tmp_path: Path):
    """``results[(p, k)] = f.get_tensor(k)`` into ``results = {}`` (a merger's table by model and tensor name) is a
    store into a dict kept past the fetch; ``grid[i, j] = ...`` into a tensor is a copy into it (a blind user's
    case: the tuple key was taken for a multi-dimensional index)."""
    found = _audit(tmp_path, {"tables.py": TUPLE_KEYS})
    assert _functions(found) == {"gather"}, found


# -- a producer matched by its name, unpacked to another length than the tuple it returns
SDXL_UTIL = '''
from safetensors.torch import load_file


def load_target_model(path):
    sd = load_file(path)
    te1, te2, vae, unet = build(sd)
    logit_scale = sd["logit_scale"]
    return "sdxl", te1, te2, vae, unet, logit_scale, None
'''
TRAINERS = '''
import train_util
import sdxl_util


class Trainer:
    def load(self, args):
        text_encoder, vae, unet, _ = train_util.load_target_model(args)
        self.text_encoder, self.vae, self.unet = text_encoder, vae, unet


class SdxlTrainer:
    def load(self, args):
        _, te1, te2, vae, unet, logit_scale, _ = sdxl_util.load_target_model(args.path)
        self.logit_scale = logit_scale
'''


def test_a_producer_matched_by_name_unpacked_to_another_length(tmp_path: Path):
    """``train_util.load_target_model(args)`` (a module the audit was not given) unpacked to four values is not
    ``sdxl_util.load_target_model``, the producer of that name, whose seven values hold the file's ``logit_scale``
    at the sixth: its elements are not taken for tensors (FluxTrainer's ``NetworkTrainer.init_train``, a false
    alarm). Unpacked to seven, the sixth is the file's tensor, kept on ``self``."""
    found = _audit(tmp_path, {"sdxl_util.py": SDXL_UTIL, "trainers.py": TRAINERS})
    assert _functions(found) == {"SdxlTrainer.load"}, found


# -- a module whose only loader is a library's, imported in a parenthesised list or called through the web UI
PARENTHESISED_IMPORT = '''
from accelerate.utils.modeling import (
    find_tied_parameters,
    load_state_dict,
    set_module_tensor_to_device,
)


def load_checkpoint_in_model(model, checkpoint_files, device_map):
    for checkpoint_file in checkpoint_files:
        loaded = load_state_dict(checkpoint_file, device_map=device_map)
        for name, param in loaded.items():
            set_module_tensor_to_device(model, name, device_map[name], value=param)
'''
WEBUI_ONLY = '''
from modules import sd_models

vae_cache = {}


def load_vae(path):
    vae_cache[path] = sd_models.read_state_dict(path)
    return vae_cache[path]
'''


def test_a_module_whose_only_loader_is_a_library_one(tmp_path: Path):
    """accelerate's ``load_state_dict`` imported in a parenthesised list (AutoGPTQ's ``accelerate_utils``), and
    AUTOMATIC1111's ``sd_models.read_state_dict`` in a module that names no other loader (SD.Next's pipelines): the
    cheap pre-check of a module's text lets both through, so their keeps are found."""
    found = _audit(tmp_path, {"acc.py": PARENTHESISED_IMPORT, "vae.py": WEBUI_ONLY})
    assert _functions(found) == {"load_checkpoint_in_model", "load_vae"}, found
