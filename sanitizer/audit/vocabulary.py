"""What the names in weight-loading code mean to the audit: which operations share a tensor's memory,
which copy it, which read only its metadata, which calls produce borrowed tensors, and which names
engines give to weight iterators and per-tensor weights.

Kept as plain tables so that the rules can be read (and argued with) in one place. PyTorch semantics:
a view (``view``, ``narrow``, slicing, ``t``, ``detach``, ``split`` ...) shares the storage; ``contiguous``,
``to``, ``float``, ``cpu``... return ``self`` when nothing needs converting, so they may share it too;
``clone``, arithmetic and ``cat``/``stack`` allocate.
"""
from __future__ import annotations

import ast
import re

# -- methods and attributes of a tensor ------------------------------------------------------------
ALIAS_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "t", "transpose", "permute", "squeeze", "unsqueeze",
    "flatten", "unflatten", "expand", "expand_as", "detach", "contiguous", "to", "cuda", "cpu", "type",
    "float", "half", "bfloat16", "double", "int", "long", "short", "char", "byte", "bool",
    "as_strided", "movedim", "moveaxis", "swapaxes", "swapdims", "select", "diagonal", "unfold", "numpy",
    "view_as_real", "view_as_complex", "squeeze_", "unsqueeze_", "t_", "transpose_", "requires_grad_",
    "share_memory_", "__getitem__", "mT", "align_to", "rename", "refine_names", "resolve_conj", "resolve_neg",
    "untyped_storage", "storage", "_typed_storage", "as_subclass", "real", "imag", "__array__",
})
# Conversions that return ``self`` when nothing needs converting and a copy otherwise: a store of their
# result is a retention only when the loaded tensor is already in place (a GPU-resident loader's case).
CONVERSION_METHODS = frozenset({"contiguous", "to", "cuda", "cpu", "type", "float", "half", "bfloat16", "double",
                                "int", "long", "short", "char", "byte", "bool", "type_as"})
SPLIT_METHODS = frozenset({"split", "chunk", "unbind", "tensor_split", "hsplit", "vsplit", "dsplit",
                           "split_with_sizes", "unsafe_split", "unsafe_chunk"})
ALIAS_ATTRIBUTES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# In-place methods that change only metadata (shape, strides, flags), never the bytes.
METADATA_INPLACE = frozenset({"squeeze_", "unsqueeze_", "t_", "transpose_", "requires_grad_", "share_memory_",
                              "as_strided_", "resize_as_", "rename_", "retain_grad", "detach_", "swapdims_",
                              "swapaxes_", "set_", "pin_memory"})
# torch.* functions (and numpy's) whose result may share the argument's memory.
ALIAS_FUNCTIONS = frozenset({
    "torch.nn.Parameter", "nn.Parameter", "Parameter", "torch.nn.parameter.Parameter", "ModelWeightParameter",
    "torch.from_numpy", "torch.as_tensor", "torch.asarray", "torch.frombuffer", "torch.utils.dlpack.from_dlpack",
    "torch.from_dlpack", "from_dlpack", "torch.Tensor", "numpy.asarray", "np.asarray", "memoryview",
    "torch.narrow", "torch.t", "torch.transpose", "torch.reshape", "torch.squeeze", "torch.unsqueeze",
    "torch.flatten", "torch.permute", "torch.movedim", "torch.select", "torch.detach", "torch.view_as_real",
    "torch.view_as_complex", "torch.as_strided", "torch.swapaxes", "torch.diagonal", "torch.unflatten",
    "torch.atleast_1d", "torch.atleast_2d", "torch.atleast_3d", "torch.squeeze_copy_",
    "torch.nn.Buffer", "nn.Buffer", "Buffer", "torch.Tensor.view", "torch.Tensor.narrow",
})
SPLIT_FUNCTIONS = frozenset({"torch.split", "torch.chunk", "torch.unbind", "torch.tensor_split", "torch.hsplit",
                             "torch.vsplit", "torch.dsplit"})

# -- containers ----------------------------------------------------------------------------------------
STORE_METHODS = frozenset({"append", "extend", "insert", "add", "appendleft", "extendleft", "put", "put_nowait",
                           "push", "update", "setdefault", "__setitem__"})
CONTAINER_FACTORIES = frozenset({
    "list", "dict", "set", "tuple", "frozenset", "defaultdict", "collections.defaultdict", "OrderedDict",
    "collections.OrderedDict", "deque", "collections.deque", "Counter", "collections.Counter", "queue.Queue",
    "Queue", "SimpleQueue", "queue.SimpleQueue", "ChainMap", "collections.ChainMap", "WeakValueDictionary",
    # a copy is a new object nothing else references yet (peft's per-key `tp_layer = copy.deepcopy(style)`)
    "copy.deepcopy", "deepcopy", "copy.copy",
})
# Calls that hold everything an iterator yields, at once.
MATERIALISERS = frozenset({
    "list", "tuple", "dict", "set", "frozenset", "sorted", "OrderedDict", "collections.OrderedDict", "deque",
    "collections.deque", "Counter", "numpy.array", "np.array",
})
TEE = frozenset({"itertools.tee", "tee"})
# Lazy wrappers: the result still yields one item at a time, in the same step as the wrapped iterator.
LAZY_WRAPPERS = frozenset({
    "iter", "enumerate", "zip", "filter", "map", "reversed", "itertools.chain", "chain", "itertools.islice",
    "islice", "itertools.groupby", "groupby", "itertools.starmap", "itertools.filterfalse",
    "itertools.takewhile", "itertools.dropwhile", "itertools.compress", "itertools.zip_longest",
    "itertools.chain.from_iterable", "chain.from_iterable", "tqdm", "tqdm.tqdm", "tqdm.auto.tqdm",
    "as_completed", "concurrent.futures.as_completed", "futures.as_completed",
})
# Calls that call the function they are handed with each item of their second argument (``map``, a pool's or an
# executor's ``map``, fastcore's ``parallel``, tqdm's ``thread_map``), or with it (``submit``)
MAPPERS = frozenset({"map", "imap", "imap_unordered", "parallel", "thread_map", "process_map", "parallel_map"})
SUBMITTERS = frozenset({"submit", "apply_async"})
PARTIALS = frozenset({"functools.partial", "partial", "functools.partialmethod", "partialmethod"})
BIND_METHODS = frozenset({"bind", "bind_partial"})

# -- calls that copy, or only look ------------------------------------------------------------------
PURE_BUILTINS = frozenset({
    "len", "id", "hash", "isinstance", "issubclass", "type", "str", "repr", "print", "format", "float", "int",
    "bool", "complex", "getattr", "hasattr", "callable", "any", "all", "sum", "min", "max", "abs", "round",
    "divmod", "vars", "dir", "logger.debug", "logger.info", "logger.warning", "logger.error", "logger.info_once",
    "logger.warning_once", "logger.debug_once", "weakref.ref", "weakref.finalize", "copy.deepcopy", "deepcopy",
    "assert_", "torch.equal", "torch.allclose", "torch.isnan", "torch.isinf",
})

# Calls into modules that deal in paths, text and numbers: whatever they are given, they return no
# tensor (``os.fspath(weights)`` of a path-or-iterator argument, ``sorted(os.listdir(path))``).
NON_TENSOR_CALLS = re.compile(r"^(os|os\.path|posixpath|ntpath|pathlib|shutil|glob|fnmatch|json|re|math|time|"
                              r"logging|warnings|string|textwrap|hashlib|struct)\.|^(Path|PurePath|open|fspath|"
                              r"str|repr|format|isinstance)$")

# -- where borrowed tensors come from -------------------------------------------------------------
# A call to one of these opens a source; ``source.get_tensor(k)`` and friends then yield tensors.
SOURCE_FACTORIES = re.compile(
    r"(^|\.)(safe_open|SafeTensorsFileLoader|ParallelLoader|SafetensorsStreamer|FastSafeTensorsLoader|"
    r"InstantTensor\w*|stream_files|copy_files_to_device|fastsafe_open)$")
SOURCE_TENSOR_METHODS = frozenset({"get_tensor", "get_slice", "get_sharded", "get_tensor_wrapper",
                                   "get_tensor_wrapped", "get_sharded_wrapped"})
SOURCE_DICT_METHODS = frozenset({"as_dict"})  # fastsafetensors' ``fb.as_dict(names)``: {name: tensor}
HANDLE_LOOKUPS = frozenset({"get", "pop", "setdefault", "__getitem__"})  # of a dict of handles: one handle
SOURCE_ITER_METHODS = frozenset({"tensors", "get_tensors", "iterate_weights", "items", "stream_tensors"})
SOURCE_SOURCE_METHODS = frozenset({"copy_files_to_device", "__enter__"})  # a handle that hands out tensors too
# Context managers that onload an offloaded module for their block: accelerate's
# ``align_module_device(module, device)`` runs the module's hook ``pre_forward`` (each parameter becomes the
# offload loader's tensor, ``weights_map[name]``) and ``post_forward`` at its end (offloaded again). Inside
# the block the module's ``state_dict()``, ``parameters()``, ``named_parameters()``, ``buffers()`` and
# ``named_buffers()`` hand out the loader's tensors, valid for the block's step.
ONLOADING_CONTEXTS = frozenset({"align_module_device"})
ONLOADED_READS = frozenset({"state_dict", "parameters", "named_parameters", "buffers", "named_buffers"})
# Cheap pre-check of a module's text: does it mention any producer at all?
PRODUCER_HINT = re.compile(r"safe_open|weights_iter|ParallelLoader|SafeTensorsFileLoader|SafetensorsStreamer|"
                           r"stream_files|InstantTensor|iterate_weights|get_all_weights|copy_files_to_device|"
                           r"FastSafeTensorsLoader|get_weights_iterator|align_module_device")
# A call whose name matches yields (name, tensor) pairs: vLLM's and SGLang's weight iterators and similar.
ITERATOR_FACTORY = re.compile(r"(^|\.)(\w*_weights_iterator|\w*weights_iter|iterate_weights|get_all_weights|"
                              r"_get_weights_iterator|get_weights_iterator|stream_files)$")

# -- names engines give them ---------------------------------------------------------------------------
ITER_PARAM_NAMES = frozenset({
    "weights", "weights_iter", "weights_iterator", "weight_iterator", "weight_iter", "weights_iterable",
    "all_weights", "model_weights", "hf_weights", "weight_generator", "weights_generator", "weight_items",
    "named_tensors", "tensor_iterator", "state_dict_iter",
})
ITER_PARAM_PATTERN = re.compile(r"^(\w+_)?weights?(_(iter|iterator|iterable|gen|generator|stream))?$")
TENSOR_PARAM_NAMES = frozenset({"loaded_weight", "loaded_tensor", "loaded_w", "loaded_param", "loaded_weights_tensor"})
LOADER_FUNCTION = re.compile(r"(^|_)(weight_loader|loader)$|^_?load_(\w+_)?(weight|param|tensor|bias|scale)s?$")
# Calls that consume an iterator and hand back only names (the usual ``load_weights`` contract).
NAME_RETURNING = re.compile(r"(^|\.)\w*load\w*$")

TENSOR_ANNOTATION = re.compile(r"\b(torch\.)?(Tensor|Parameter|nn\.Parameter)\b")
ITER_ANNOTATION = re.compile(r"\b(Iterable|Iterator|Generator|AsyncIterator|AsyncIterable)\s*\[.*\bstr\b")
PAIR_ANNOTATION = re.compile(r"^\s*(tuple|Tuple)\[\s*str\s*,\s*(torch\.)?(Tensor|nn\.Parameter|Parameter)\s*\]\s*$")
TENSOR_ARG_NAME = re.compile(r"^(w|weight|weights?_\w+|\w+_weight|tensor|\w+_tensor|data|value|val|t|x|loaded\w*)$")
# A dict of weights by name (one file's tensors, handed to each layer): ``Dict[str, torch.Tensor]``. Not a dict of
# ``nn.Parameter``: that is the model's own parameters (``params_dict: dict[str, nn.Parameter]``, built from
# ``named_parameters()``), the destination a loader copies into, never what it lends.
MAPPING_OF_TENSORS = re.compile(r"^\s*(dict|Dict|Mapping|MutableMapping|OrderedDict)\s*\[\s*str\s*,\s*"
                                r"(torch\.)?Tensor\s*\]\s*$")
# ... or of tensors among other things: ``dict[str, torch.Tensor | NotYetLoadedTensor]`` (LitGPT's lazy
# checkpoints), ``Dict[str, Union[Tensor, X]]``, ``Dict[str, Optional[Tensor]]``
MAPPING_OF_TENSOR_UNION = re.compile(r"^\s*(dict|Dict|Mapping|MutableMapping|OrderedDict)\s*\[\s*str\s*,\s*"
                                     r"(Union\[|Optional\[|[\w.]+\s*\|)?.*\b(torch\.)?Tensor\b.*\]\s*$")
# ... or of anything (``dict[str, Any]``, a bare ``dict``): the parameter's and the function's names decide
MAPPING_OF_ANY = re.compile(r"^\s*(dict|Dict|Mapping|MutableMapping|OrderedDict)\s*(\[\s*str\s*,\s*"
                            r"(typing\.)?Any\s*\])?\s*$")
# The class names an annotation mentions (``HFCheckpointLoader | None``): a receiver's class, for a method
# inferred a producer whatever its name
ANNOTATED_CLASS = re.compile(r"\b([A-Za-z_][\w.]*[A-Z]\w*)\b")
# The keys a checkpoint nests the model's weights under (``torch.save({"model": model.state_dict(), ...})``,
# Lightning's ``"state_dict"``, EMA copies): a lookup with one of them in a file's dict is a dict of its tensors.
# Not ``"state"``/``"param_groups"`` (an optimizer's: copied into the optimizer by its ``load_state_dict``).
NESTED_STATE_KEY = re.compile(r"^(model|module|state_dict|model_state_dict|params|params_ema|ema|model_ema|"
                              r"ema_model|net|network|generator|student)$")
# A checkpoint's entry of a training counter (``checkpoint["step"]``, ``ckpt.get("epoch")``): a number, not a
# weight (Sana's trainers' ``self.step = checkpoint["step"]``)
COUNTER_KEY = re.compile(r"^(step|steps|global_step|epoch|epochs|iteration|iterations|iter|consumed_samples|"
                         r"consumed_train_samples|num_updates|update|best_metric|best_score|loss)$")
# A parameter named for a whole state dict: ``full_sd``, ``model_state_dict``, ``converted_state_dict``
STATE_DICT_PARAM = re.compile(r"^(\w+_)?(sd|state_dict|weights|tensors|checkpoint|ckpt)$")
# A list of (name, tensor) pairs already materialised by the caller (one update bucket).
LIST_OF_PAIRS = re.compile(r"^\s*(list|List|Sequence|tuple|Tuple)\s*\[\s*(tuple|Tuple)\[\s*str\s*,\s*(torch\.)?"
                           r"(Tensor|nn\.Parameter|Parameter)\s*\]")
# Unannotated names a per-step dict of weights goes by (with dict use in the body: ``name in weights``).
MAPPING_PARAM_NAMES = frozenset({"weights", "weight_dict", "weights_dict", "state_dict", "hf_weights", "tensors",
                                 "sd", "checkpoint", "ckpt", "weight_map", "loaded_weights", "tensor_dict"})
MAPPING_FUNCTION = re.compile(r"load|weight")
# A local annotated as a read-only mapping of tensors (``Mapping[str, torch.Tensor]``): with a class of the project
# whose ``__getitem__`` reads a loader, a lazy mapping of weights (see Flow._lazy_mapping)
LAZY_MAPPING_TYPE = re.compile(r"^(Optional\[)?\s*(typing\.|collections\.abc\.)?Mapping\s*\[\s*str\s*,\s*(torch\.)?Tensor\s*\]")
_ANNOTATION_WORD = re.compile(r"[A-Za-z_]\w*")


def lazy_mapping_class(annotation: str, mappings: "Collection[str]") -> str:
    """The class of ``mappings`` (the project's classes whose ``__getitem__`` reads a loader) that a parameter's
    annotation names (``disk_map: DiskMap``, ``Optional[DiskMap]``, ``"lazy.DiskMap"``), or ``""``."""
    for word in _ANNOTATION_WORD.findall(annotation):
        if word in mappings:
            return word
    return ""


MAPPING_ANNOTATION = re.compile(r"^\s*(dict|Dict|Mapping|MutableMapping|OrderedDict|defaultdict|list|List|set|"
                                r"Set|deque)\b")

# A subscript target whose root has one of these names is a tensor (a copy into it), not a container.
TENSOR_NAME = re.compile(r"^(param|params?_data|\w*_data|data|out|output|dst|dest|\w*_param|weight|bias|"
                         r"param_slice|buf|tensor|\w*_tensor|shard|\w*_shard|loaded_weight|w)$")
TENSOR_ATTR_NAME = re.compile(r"^(weight|bias|data|\w*_weight|\w*_bias|\w*_scale|\w*_zero|qweight|scales|"
                              r"zeros|qzeros|g_idx|\w*_proj|table)$")
TENSOR_FACTORY = re.compile(r"^(torch\.)?(empty|zeros|ones|full|rand|randn|arange|empty_like|zeros_like|"
                            r"ones_like|full_like|tensor|cat|concat|concatenate|stack|empty_strided)$")


# -- loader APIs that return tensors by contract (built-in producers) ------------------------------------
# ``safetensors.torch.load_file(path)`` / ``safetensors.torch.load(data)``: a dict of one file's tensors;
# ``torch.load(path, mmap=True)``: a state dict whose tensors map the file (without ``mmap=True`` they are
# read into memory of their own: not borrowed).
_DICT_LOADERS = re.compile(r"(^|\.)(load_file|safe_load_file)$|^(safetensors\.torch|st|safetensors)\.load$")
# A module that mentions one of these may define a producer of its own (inferred, :mod:`.producers`).
LOADER_API_HINT = re.compile(r"safe_open|load_file|torch\.load|safetensors\.torch import|fastsafe_open|SafeTensorsFileLoader|"
                             r"SafetensorsStreamer|InstantTensor|instanttensor|copy_files_to_device|"
                             r"ParallelLoader|FastSafeTensorsLoader|stream_files|get_tensors|iterate_weights|"
                           r"load_torch_file|load_peft_weights|load_state_dict_from_file|lora_state_dict|"
                           r"read_state_dict|load_vae_dict")
# ... or imports a library's `load_state_dict(path)` (looked for only in a text that names `load_state_dict`: an
# alternation tried at every character of every module costs more than the rest of the pre-check)
_LIBRARY_LOADER_IMPORT = re.compile(r"^[ \t]*from[ \t]+(diffusers|transformers|accelerate|timm)[\w.]*[ \t]+import"
                                    r"([^\n(]*|[ \t]*\([^)]*)\bload_state_dict\b", re.M)  # (or a parenthesised list)


def names_loader_api(text: str) -> bool:
    """Does a module's text name a loader's API or a library's loader (:data:`LOADER_API_HINT`)?"""
    return bool(LOADER_API_HINT.search(text)) or ("load_state_dict" in text and bool(_LIBRARY_LOADER_IMPORT.search(text)))


# Libraries' functions that load a checkpoint file and return its dict, built on the loaders above (so, by
# contract, borrowed as theirs are), named by their full import path. A call is matched only through an import
# of that path (``from comfy.utils import load_torch_file``, ``comfy.utils.load_torch_file(...)``), never by
# the bare name, and never where the audited tree defines a function of that name.
LIBRARY_DICT_LOADERS = frozenset({
    # ComfyUI, comfy/utils.py: "def load_torch_file(ckpt, safe_load=False, device=None,
    # return_metadata=False)": a ``.safetensors`` file through ``safetensors.safe_open`` / ``load_file``,
    # returned as ``sd`` (or ``(sd, metadata)`` when asked). Every custom node loads through it.
    "comfy.utils.load_torch_file",
    # peft, utils/save_and_load.py: "def load_peft_weights(model_id, device=None, ...) -> dict: A helper
    # method to load the PEFT weights from the HuggingFace Hub or locally" (``safe_load_file(filename,
    # device=...)`` for a safetensors adapter)
    "peft.utils.load_peft_weights", "peft.utils.save_and_load.load_peft_weights", "peft.load_peft_weights",
    # diffusers, models/model_loading_utils.py: "def load_state_dict(checkpoint_file, ...): Reads a checkpoint
    # file, returning properly formatted errors if they arise" (``safetensors.torch.load_file(checkpoint_file,
    # device=...)``, or ``torch.load(..., mmap=True)`` for a .bin file); re-exported by modeling_utils
    "diffusers.models.model_loading_utils.load_state_dict", "diffusers.models.modeling_utils.load_state_dict",
    # transformers, modeling_utils.py: "def load_state_dict(checkpoint_file, ..., map_location="cpu",
    # weights_only=True): Reads a `safetensor` or a `.bin` checkpoint file" (``safe_open`` and ``get_tensor``
    # of every key; ``torch.load(..., mmap=True)`` for a .bin)
    "transformers.modeling_utils.load_state_dict",
    # accelerate, utils/modeling.py: "def load_state_dict(checkpoint_file, device_map=None): Load a checkpoint
    # from a given file. If the checkpoint is in the safetensors format and a device map is passed, the weights
    # can be fast-loaded directly on the GPU" (``safe_load_file`` / ``safe_open(...).get_tensor``)
    "accelerate.utils.load_state_dict", "accelerate.utils.modeling.load_state_dict",
    # huggingface_hub, serialization/_torch.py: "def load_state_dict_from_file(checkpoint_file, map_location=
    # None, weights_only=False, mmap=False): Loads a checkpoint file, handling both safetensors and pickle
    # checkpoint formats" (``safetensors.torch.load_file``)
    "huggingface_hub.load_state_dict_from_file", "huggingface_hub.serialization.load_state_dict_from_file",
    # timm, models/_helpers.py ``load_state_dict(checkpoint_path, use_ema=True, device='cpu')``:
    # ``safetensors.torch.load_file(checkpoint_path, device=device)`` for a .safetensors path, its keys
    # cleaned into a new dict of the same tensors
    "timm.models.load_state_dict", "timm.models._helpers.load_state_dict",
    # AUTOMATIC1111's web UI, modules/sd_models.py: "def read_state_dict(checkpoint_file, print_global_state=False,
    # map_location=None)": ``pl_sd = safetensors.torch.load_file(checkpoint_file, device=device)`` for a
    # .safetensors file (unless the option ``disable_mmap_load_safetensors`` is set), returned through
    # ``get_state_dict_from_checkpoint(pl_sd)`` (the same tensors, re-keyed); modules/sd_vae.py: "def
    # load_vae_dict(filename, map_location)": ``vae_ckpt = sd_models.read_state_dict(...)``, filtered by key into
    # a new dict of the same tensors. Its extensions load through them.
    "modules.sd_models.read_state_dict", "modules.sd_vae.load_vae_dict",
    # Forge, backend/utils.py: "def load_torch_file(ckpt, safe_load=False, device=None)": ``sd =
    # safetensors.torch.load_file(ckpt, device=device.type)`` for a .safetensors file, returned
    "backend.utils.load_torch_file",
})
# The same libraries' methods of that contract, matched by name on a receiver the audited tree does not
# define them for: diffusers' LoRA loader mixins, ``lora_state_dict(pretrained_model_name_or_path_or_dict,
# **kwargs)`` ("Return state dict for lora weights and the network alphas"), whose ``_fetch_state_dict`` is
# ``safetensors.torch.load_file(model_file, device="cpu")``: the dict, or ``(state_dict, network_alphas)``.
LIBRARY_DICT_METHODS = frozenset({"lora_state_dict"})


# Libraries' functions that make a module keep the tensors they are handed, by full import path: (the index of
# the module argument, of the tensors' argument, the argument's keyword name, what the library applies to them).
LIBRARY_KEEPERS = {
    # optimum-quanto, quantize.py: "def requantize(model, state_dict, quantization_map, device=None)": each
    # quantized module is rebuilt around the state dict's own `_data`/`_scale` tensors, made its parameters with
    # `.to(device)` (the tensors themselves when already there); the rest through `model.load_state_dict(...)`
    "optimum.quanto.requantize": (0, 1, "state_dict", "to(device)"),
    "optimum.quanto.quantize.requantize": (0, 1, "state_dict", "to(device)"),
    # ComfyUI, comfy/sd.py: "def load_lora_for_models(model, clip, lora, strength_model, strength_clip)":
    # `load_lora(lora, key_map)` keeps the dict's tensors as patches and `new_modelpatcher.add_patches(loaded,
    # strength_model)` stores them on the returned patcher (a clone of `model`, sharing its patch lists' owner)
    "comfy.sd.load_lora_for_models": (0, 2, "lora", ""),
    # ComfyUI, comfy/utils.py: "def set_attr(obj, attr, value): attrs = attr.split('.') ... setattr(obj,
    # attrs[-1], value)"; "def set_attr_param(obj, attr, value): return set_attr(obj, attr,
    # torch.nn.Parameter(value, requires_grad=False))" (the same storage); "def set_attr_buffer(obj, attr,
    # value): ... obj.register_buffer(name, value, ...)". Not `copy_to_param`, which copies into the parameter.
    "comfy.utils.set_attr": (0, 2, "value", ""),
    "comfy.utils.set_attr_param": (0, 2, "value", ""),
    "comfy.utils.set_attr_buffer": (0, 2, "value", ""),
    # diffusers, models/model_loading_utils.py: "def load_model_dict_into_meta(model, state_dict, dtype=None,
    # ...)": each parameter set with `set_module_tensor_to_device(model, name, device, value=param)` (after a
    # `.to(dtype)` only when a dtype is given and differs)
    "diffusers.models.model_loading_utils.load_model_dict_into_meta": (0, 1, "state_dict", "to(dtype)"),
    "diffusers.models.modeling_utils.load_model_dict_into_meta": (0, 1, "state_dict", "to(dtype)"),
}


LIBRARY_KEEPER_NAMES = frozenset(full.rpartition(".")[2] for full in LIBRARY_KEEPERS)
# Libraries' functions whose result holds the tensors of one argument (its index), by full import path: ComfyUI,
# comfy/lora.py, "def load_lora(lora, to_load, log_missing=True)": each patch is built around the dict's own
# tensors (`LoRAAdapter(loaded_keys, (mat1, mat2, alpha, mid, ...))`, `("diff", (lora[diff_name],))`).
LIBRARY_HOLDERS = {"comfy.lora.load_lora": 0}
LIBRARY_HOLDER_NAMES = frozenset(full.rpartition(".")[2] for full in LIBRARY_HOLDERS)
# Libraries' methods that keep what they are handed on their receiver, matched by name where no audited class
# defines a method of that name (the argument's index): ComfyUI's ModelPatcher, comfy/model_patcher.py,
# "def add_patches(self, patches, strength_patch=1.0, strength_model=1.0)": each patch is appended to
# `self.patches[key]` (applied to the weights at every load, for the patcher's life). With the library's class
# name: a tree that defines a class of that name with that method (a vendored copy: Fooocus, Forge) runs its own.
LIBRARY_KEEPING_METHODS = {"add_patches": (0, "ModelPatcher")}


def library_loader(full: str) -> bool:
    """Is ``full`` (``module.function``, as imported) one of :data:`LIBRARY_DICT_LOADERS`?"""
    return full in LIBRARY_DICT_LOADERS


def loader_call_kind(name: str, node: "object") -> str:
    """What a call to a known loader API returns when it is not a handle (those are ``SOURCE_FACTORIES``):
    ``"dict"`` for the dict loaders above, ``""`` for anything else."""
    if name in LIBRARY_DICT_LOADERS:
        return "dict"
    if _DICT_LOADERS.search(name):
        if name.startswith(("self.", "cls.")) and name.count(".") >= 2:
            return ""  # `self.video_loader.load_file(path)`: a method of an object the class holds, not safetensors'
        return "dict"
    if name == "torch.load":
        for kw in getattr(node, "keywords", ()):
            # `mmap=True`, or a value the audit cannot know (`mmap=checkpoint_mmap`, `mmap=args.mmap`): the
            # tensors map the file whenever it is true, so the retention is real in that configuration (a
            # constant False or None reads the file into memory of its own)
            if kw.arg == "mmap" and (not isinstance(kw.value, ast.Constant) or bool(kw.value.value)):
                return "dict"
    return ""
