"""Producers inferred, not declared (:mod:`sanitizer.audit.producers`): a getter whose result flows from a
loader's API (``safe_open(...).get_tensor``, ``load_file``, ``torch.load(mmap=True)``) through helpers,
conversions, dict returns and handles kept on ``self`` is a producer, found with no ``[tool.ownsan]``
settings at all. Shapes written after real engines' (TGI's ``Weights``, a loader class, a per-file dict
loader), not copied from them."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

from sanitizer.audit import audit_paths
from sanitizer.audit.cli import main

# TGI-like: a `Weights` object keeps one safe_open handle per file and hands out one tensor at a time,
# converted to the model's dtype (a no-op when it already is); layers in another module keep it.
TGI_WEIGHTS = '''
from safetensors import safe_open


class Weights:
    def __init__(self, filenames, device, dtype):
        self.routing = {}
        for filename in filenames:
            with safe_open(filename, framework="pytorch") as f:
                for k in f.keys():
                    self.routing[k] = filename
        self._handles = {}
        self.device = device
        self.dtype = dtype

    def _get_handle(self, filename):
        if filename not in self._handles:
            f = safe_open(filename, framework="pytorch")
            self._handles[filename] = f
        return self._handles[filename]

    def get_filename(self, tensor_name):
        return str(self.routing[tensor_name]), tensor_name

    def get_tensor(self, tensor_name, to_dtype=True):
        filename, tensor_name = self.get_filename(tensor_name)
        f = self._get_handle(filename)
        tensor = f.get_tensor(tensor_name)
        if to_dtype:
            tensor = tensor.to(dtype=self.dtype)
        return tensor
'''
TGI_LAYERS = '''
import torch


class FastLinear(torch.nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    @classmethod
    def load(cls, prefix, weights):
        weight = weights.get_tensor(f"{prefix}.weight")
        return cls(weight, None)


class RMSNorm(torch.nn.Module):
    def __init__(self, prefix, weights, eps=1e-6):
        super().__init__()
        self.weight = weights.get_tensor(f"{prefix}.weight")
        self.eps = eps


def load_scale(prefix, weights):
    scale = weights.get_tensor(f"{prefix}.scale")
    return float(scale.item())
'''

# A loader class: one safe_open handle kept on self in __init__, `load_tensor(key)` returning a half view.
LOADER_CLASS = '''
from safetensors import safe_open


class CheckpointFile:
    def __init__(self, path):
        self.st = safe_open(path, framework="pt", device="cuda")

    def load_tensor(self, key):
        return self.st.get_tensor(key).half()


class Model:
    def __init__(self, path, names):
        self.loader = CheckpointFile(path)
        self.params = {}
        for name in names:
            self.params[name] = self.loader.load_tensor(name)
'''

# A getter that returns a dict of tensors (one file at a time), and a consumer that parks some of them.
DICT_GETTER = '''
from safetensors.torch import load_file


def read_shard(path):
    state = load_file(path)
    return state


class Layer:
    def load_from(self, path):
        tensors = read_shard(path)
        self.weight = tensors["weight"]
        for name, t in tensors.items():
            print(name, t.shape)
'''

# Not producers: what they return is a copy or a fresh tensor.
NEGATIVE = '''
import torch
from safetensors import safe_open


class Owned:
    def __init__(self, path):
        self.f = safe_open(path, framework="pt")

    def copied(self, key):
        return self.f.get_tensor(key).clone()

    def fresh(self, key):
        shape = self.f.get_slice(key).get_shape()
        return torch.empty(shape)


class Keeper:
    def __init__(self, owned, names):
        self.kept = {}
        for name in names:
            self.kept[name] = owned.copied(name)
            self.kept[name + ".buf"] = owned.fresh(name)
'''


def _write(tmp_path: Path, files: Dict[str, str]) -> List[str]:
    out = []
    for name, text in files.items():
        p = tmp_path / name
        p.write_text(textwrap.dedent(text))
        out.append(str(p))
    return out


def _found(tmp_path: Path, files: Dict[str, str]) -> List[Tuple[str, str, str]]:
    paths = _write(tmp_path, files)
    result = audit_paths(paths)  # no settings
    return sorted((Path(f.path).name, f.function, f.code) for f in result.findings)


def test_tgi_like_weights_getter_found_without_settings(tmp_path: Path):
    found = _found(tmp_path, {"weights.py": TGI_WEIGHTS, "layers.py": TGI_LAYERS})
    functions = {(name, fn) for name, fn, _ in found}
    assert ("layers.py", "FastLinear.__init__") in functions  # a module built around the fetched tensor
    assert ("layers.py", "RMSNorm.__init__") in functions
    assert not any(fn == "load_scale" for _, fn, _ in found)  # `.item()`: nothing kept
    # the getter's `.to(dtype=self.dtype)` is a no-op when the tensor is already of that dtype: OWN107
    assert {code for name, fn, code in found if fn == "RMSNorm.__init__"} == {"OWN107"}
    assert not any(name == "weights.py" for name, _, _ in found)  # the getter hands on, keeps nothing


def test_loader_class_with_handle_on_self_found_without_settings(tmp_path: Path):
    found = _found(tmp_path, {"ckpt.py": LOADER_CLASS})
    assert ("ckpt.py", "Model.__init__", "OWN107") in found  # `.half()` inside load_tensor: conditional


def test_dict_getter_found_without_settings(tmp_path: Path):
    found = _found(tmp_path, {"shard.py": DICT_GETTER})
    assert found == [("shard.py", "Layer.load_from", "OWN102")]


def test_copies_and_fresh_tensors_are_not_producers(tmp_path: Path, capsys):
    found = _found(tmp_path, {"neg.py": NEGATIVE})
    assert found == []
    paths = _write(tmp_path, {"neg.py": NEGATIVE})
    assert main(["--show-settings", *paths]) == 0
    shown = capsys.readouterr().out
    assert "copied=" not in shown and "fresh=" not in shown


def test_show_settings_lists_inferred_producers_and_where_from(tmp_path: Path, capsys):
    paths = _write(tmp_path, {"weights.py": TGI_WEIGHTS, "ckpt.py": LOADER_CLASS, "shard.py": DICT_GETTER})
    assert main(["--show-settings", *paths]) == 0
    shown = capsys.readouterr().out
    lines = {line.strip().split("=")[0]: line for line in shown.splitlines() if line.startswith("  ")}
    assert "tensor" in lines["get_tensor"] and "weights.py:" in lines["get_tensor"]
    assert "`.to(dtype=self.dtype)`" in lines["get_tensor"] and "`safe_open(...)`" in lines["get_tensor"]
    assert "_get_handle=source" in lines["_get_handle"]
    assert "load_tensor=tensor" in lines["load_tensor"] and "`.half()`" in lines["load_tensor"]
    assert "read_shard=dict" in lines["read_shard"] and "load_file" in lines["read_shard"]


REKEYED = '''
from safetensors.torch import load_file


def load_renamed(path):
    sd = load_file(path)
    out = {}
    for k, v in sd.items():
        out["model." + k] = v
    return out


def load_listed(path):
    sd = load_file(path)
    out = []
    for v in sd.values():
        out.append(v)
    return out


class Holder:
    def take(self, path):
        self.weights = load_renamed(path)
'''


def test_a_dict_filled_by_name_is_shown_as_a_dict_and_a_list_as_a_holder(tmp_path: Path, capsys):
    """A loader returning one file's tensors re-keyed into a dict it fills in a loop (``out["model." + k] = v``)
    hands out tensors by name, as ``read_shard`` does: ``--show-settings`` says ``dict``, not ``holder`` (the
    word for a tuple or list, as ``load_listed``'s), and a caller keeping its result is found."""
    paths = _write(tmp_path, {"rekey.py": REKEYED})
    assert main(["--show-settings", *paths]) == 0
    lines = {line.strip().split("=")[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "load_renamed=dict" in lines["load_renamed"]
    assert "load_listed=holder" in lines["load_listed"]
    assert ("rekey.py", "Holder.take", "OWN102") in _found(tmp_path, {"rekey.py": REKEYED})


def test_mmap_torch_load_is_a_dict_producer_and_plain_torch_load_is_not(tmp_path: Path):
    code = '''
    import torch


    def mapped(path):
        return torch.load(path, mmap=True)


    def plain(path):
        return torch.load(path)


    class M:
        def a(self, path):
            self.w = mapped(path)["w"]

        def b(self, path):
            self.w = plain(path)["w"]
    '''
    found = _found(tmp_path, {"tl.py": code})
    assert found == [("tl.py", "M.a", "OWN102")]


def _tree(tmp_path: Path, files: Dict[str, str]) -> List[Tuple[str, str, str]]:
    """Files in packages (``pkg/utils/io.py``): audited as a directory, as a user runs ``ownsan audit src``."""
    for name, text in files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    result = audit_paths([str(tmp_path)])
    return sorted((Path(f.path).name, f.function, f.code) for f in result.findings)


def test_a_function_called_through_its_module_is_followed(tmp_path: Path):
    """torchtune's shape: ``from pkg import convert; state["model"] = convert.rekey(sd)``, then the next
    file fetched while the model's dict is still kept (issue 50)."""
    found = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/convert.py": '''
            def rekey(sd):
                return {k.replace("model.", ""): v for k, v in sd.items()}
        ''',
        "pkg/ckpt.py": '''
            import torch
            from pkg import convert

            def load_checkpoint(path, adapter):
                sd = torch.load(path, mmap=True)
                state = {}
                state["model"] = convert.rekey(sd)
                if adapter:
                    state["adapter"] = torch.load(adapter, mmap=True)
                return state
        ''',
    })
    assert ("ckpt.py", "load_checkpoint", "OWN101") in found


def test_a_helper_reexported_by_an_unaudited_init_is_followed(tmp_path: Path):
    """peft's shape: ``from .utils import set_state`` where ``utils/__init__.py`` only re-exports (and is
    not among the audited files): the one audited module under ``utils/`` that defines it is its source."""
    found = _tree(tmp_path, {
        "pkg/utils/io.py": '''
            from safetensors.torch import load_file as safe_load_file

            def load_adapter_weights(path):
                return safe_load_file(path)

            def set_state(model, adapter_state_dict, low_cpu_mem_usage=False):
                if low_cpu_mem_usage:
                    model.load_state_dict(adapter_state_dict, strict=False, assign=True)
                else:
                    model.load_state_dict(adapter_state_dict, strict=False)
        ''',
        "pkg/model.py": '''
            from .utils import load_adapter_weights, set_state

            class Wrapper:
                def load_adapter(self, path):
                    weights = load_adapter_weights(path)
                    set_state(self, weights, low_cpu_mem_usage=True)
        ''',
    })
    assert ("io.py", "set_state", "OWN102") in found


def test_a_mapping_class_reading_a_loader_is_listed_and_its_lookups_are_tensors(tmp_path: Path, capsys):
    code = '''
        from collections.abc import Mapping
        from typing import Optional
        from safetensors import safe_open

        class Offloaded(Mapping):
            def __init__(self, index):
                self.index = index
            def __getitem__(self, key):
                with safe_open(self.index[key], framework="pt") as f:
                    return f.get_tensor(key)
            def __iter__(self):
                return iter(self.index)
            def __len__(self):
                return len(self.index)

        class Hook:
            def __init__(self, weights_map: Optional[Mapping] = None, names=()):
                self.weights_map = weights_map
                self.names = names
                self.kept = {}
            def onload(self):
                for name in self.names:
                    self.kept[name] = self.weights_map[name]
            def sizes(self):
                return {name: self.weights_map[name].numel() for name in self.names}
    '''
    paths = _write(tmp_path, {"offload.py": code})
    found = sorted((f.function, f.code) for f in audit_paths(paths).findings)
    assert found == [("Hook.onload", "OWN101")]  # `sizes` reads a number of each, keeps nothing
    assert main(["--show-settings", *paths]) == 0
    assert "Offloaded[...]=tensor" in capsys.readouterr().out


def test_a_static_method_of_a_class_imported_through_a_package_is_followed(tmp_path: Path):
    """optimum-quanto's shape: a module's ``_load_from_state_dict`` calls ``WeightTensor.load_from_state_dict``
    of a class re-exported by ``tensor/__init__.py`` (not audited), which builds the weight object around
    tensors popped from the dict: the retention is the weight class's constructor's store."""
    found = _tree(tmp_path, {
        "pkg/tensor/weights.py": '''
            import torch

            class WeightTensor(torch.Tensor):
                def __init__(self, data, scale):
                    self._data = data
                    self._scale = scale

                @classmethod
                def load_from_state_dict(cls, state_dict, prefix):
                    return cls.build(state_dict.pop(prefix + "_data"), state_dict.pop(prefix + "_scale"))

                @staticmethod
                def build(data, scale):
                    return WeightTensor(data, scale)
        ''',
        "pkg/nn/module.py": '''
            import torch
            from ..tensor import WeightTensor

            class QLinear(torch.nn.Module):
                def _load_from_state_dict(self, state_dict, prefix, *args):
                    weight = WeightTensor.load_from_state_dict(state_dict, prefix + "weight.")
                    self.weight = torch.nn.Parameter(weight)
        ''',
    })
    assert ("weights.py", "WeightTensor.__init__", "OWN102") in found


def test_a_getter_with_a_common_name_is_found_through_its_receivers_annotation(tmp_path: Path):
    """xtuner's shape: ``HFCheckpointLoader.load(key)`` reads ``safe_open(...).get_tensor``; ``load`` is too
    common a name to match a call by, but ``checkpoint_loader: HFCheckpointLoader`` names the class."""
    found = _tree(tmp_path, {
        "pkg/loader.py": '''
            from safetensors import safe_open

            class CheckpointReader:
                def __init__(self, files):
                    self.files = files
                    self._open = {}

                def load(self, key):
                    path = self.files[key]
                    if path not in self._open:
                        self._open[path] = safe_open(path, framework="pt")
                    return self._open[path].get_tensor(key)
        ''',
        "pkg/model.py": '''
            from pkg.loader import CheckpointReader

            class Model:
                def read_all(self, keys, reader: CheckpointReader, device):
                    out = []
                    for key in keys:
                        out.append(reader.load(key).to(device))
                    return out

                def read_other(self, keys, loader):
                    return [loader.load(key).shape for key in keys]   # no annotation: not matched by `load`
        ''',
    })
    assert found == [("model.py", "Model.read_all", "OWN107")]
