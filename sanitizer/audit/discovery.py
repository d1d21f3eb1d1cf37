"""Which functions consume weights, and which of their parameters carry them.

Three ways in, as engines write them:

* a parameter that receives a **weights iterator**: annotated ``Iterable[tuple[str, torch.Tensor]]``
  (``Iterator``, ``Generator``...), or named as engines name it (``weights``, ``weights_iter``,
  ``all_weights``...) and used as an iterator in the body (looped over, materialised, ``next``-ed);
* a **per-tensor loader**'s weight argument: ``weight_loader(param, loaded_weight, ...)``, any parameter
  called ``loaded_weight``, or a ``*args`` of a function named like a loader (a wrapper that forwards
  them, as a deferring loader does);
* the results of **known producers** called in the body (``safe_open(...).get_tensor``,
  ``*_weights_iterator(...)``, fastsafetensors, runai, InstantTensor): the flow recognises those calls
  itself, so such a function needs no seed, only to be looked at.

A name alone is not enough for an iterator: a ``weights`` parameter of a ``forward`` is a tensor of
router weights, and it is never looped over.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Set

from sanitizer.audit import vocabulary as V
from sanitizer.audit.findings import Link
from sanitizer.audit.settings import Settings
from sanitizer.audit.index import FunctionInfo, _own_scope, annotation_text, dotted
from sanitizer.audit.values import ELEM_NESTED, ELEM_PAIR, HOLDER, ITER, PAIR, TENSOR, Val

MAPPING, PAIRS = "mapping", "pairs"  # seed kinds: a per-step dict of weights; a list of pairs held for the call
NESTED = "nested"  # a dict whose items hold the file's tensors at any depth (a ComfyUI node's output: .graph)
_DICT_METHODS = frozenset({"items", "keys", "values", "get", "pop", "copy"})
_ITER_USERS = V.MATERIALISERS | V.TEE | V.LAZY_WRAPPERS | {"next"}


@dataclass(frozen=True)
class Seed:
    param: str
    kind: str  # ITER or TENSOR or HOLDER (*args of a forwarding loader)
    why: str
    consumer: str = ""  # the function the weights come from, when not this one (an enclosing function's)


# An annotation that names plain numbers among its alternatives (and no tensor type): loss or adapter
# weights (`float | list[float] | None`), never a loader's tensors
_SCALARS = re.compile(r"(^|[\[|,(]\s*)(float|int|bool|Number)\s*($|[\]|,)])")


def _annotation(arg: ast.arg) -> str:
    return annotation_text(arg.annotation)


def _iterated_names(info: FunctionInfo) -> Dict[str, str]:
    """Names used as iterators in the function's body (nested functions included), with how."""
    used: Dict[str, str] = {}
    for node in ast.walk(info.node):  # nested closures count: a generator over the outer `weights`
        if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.iter, ast.Name):
            used.setdefault(node.iter.id, "looped over")
        elif isinstance(node, ast.comprehension) and isinstance(node.iter, ast.Name):
            used.setdefault(node.iter.id, "looped over")
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            for gen in node.generators:
                if isinstance(gen.iter, ast.Name):
                    used.setdefault(gen.iter.id, "looped over")
        elif isinstance(node, ast.Call) and dotted(node.func) in _ITER_USERS:
            for a in node.args:
                if isinstance(a, ast.Name):
                    used.setdefault(a.id, f"passed to {dotted(node.func)}()")
        elif isinstance(node, ast.YieldFrom) and isinstance(node.value, ast.Name):
            used.setdefault(node.value.id, "yielded from")
        elif isinstance(node, ast.Starred) and isinstance(node.value, ast.Name):
            used.setdefault(node.value.id, "unpacked")
    return used


def _indexed_names(info: FunctionInfo) -> Set[str]:
    """Names read by index in the body (``outputs[0]``, ``xs[i]``): whatever the annotation says
    (``Iterable[Dict[str, Tensor]]``, a trainer's micro-batch outputs, nanotron's ``train_step_logs``), such
    a value is a sequence the caller built, not a loader's stream (a generator cannot be indexed): a caller
    that materialised a loader's stream into it is where the retention is, and is found there."""
    return {node.value.id for node in ast.walk(info.node)
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and isinstance(node.ctx, ast.Load)}


_DESTINATIONS = frozenset({"param", "p", "parameter", "layer_param", "expert_data", "param_data", "dst", "target",
                           "dest", "tensor_param"})


def _is_destination(arg: ast.arg) -> bool:
    """The first argument of ``weight_loader(param, loaded_weight)``: where the weight goes."""
    ann = _annotation(arg)
    return arg.arg in _DESTINATIONS or bool(ann and V.TENSOR_ANNOTATION.search(ann))


def _indexed_names(info: FunctionInfo) -> set:
    """Names subscripted or measured with ``len()``: a sequence of tensors, not a weights stream."""
    out = set()
    for node in _own_scope(info.node.body):  # type: ignore[attr-defined]
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            out.add(node.value.id)
        elif isinstance(node, ast.Call) and dotted(node.func) == "len" and node.args and isinstance(node.args[0],
                                                                                                   ast.Name):
            out.add(node.args[0].id)
    return out


def _key_like(index: ast.AST) -> bool:
    """A key a dict of weights is read by: a string, an f-string, a name's attribute (``self.weight_name``),
    an element of a list of names, a variable called like a name or key."""
    if isinstance(index, ast.Constant):
        return isinstance(index.value, str)
    if isinstance(index, (ast.JoinedStr, ast.Attribute, ast.Subscript, ast.BinOp)):
        return not isinstance(index, ast.Subscript) or not isinstance(index.slice, ast.Slice)
    if isinstance(index, ast.Name):
        low = index.id.lower()
        return "name" in low or "key" in low or low in ("k", "n", "w1", "w2", "w3", "o", "q", "wk", "wv", "wq")
    return False


def _mapping_names(info: FunctionInfo) -> Dict[str, str]:
    """Names used as a dict of tensors by name in the body: ``k in X``, ``X.items()``, ``X["a.weight"]``."""
    used: Dict[str, str] = {}
    for node in ast.walk(info.node):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            for comp in node.comparators:
                if isinstance(comp, ast.Name):
                    used.setdefault(comp.id, "tested with `in`")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in _DICT_METHODS and isinstance(node.func.value, ast.Name):
            used.setdefault(node.func.value.id, f"`.{node.func.attr}()`")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and _key_like(node.slice):
            used.setdefault(node.value.id, "read by key")
    return used


# Words that name tensors a program owns and keeps by name, not a checkpoint's: KV caches, buffers,
# gradients, optimizer state, activations (`kv_caches`, `register_kv_caches`, a trainer's `buffers`).
# `meta_args` (ColossalAI's tracer): tensors on the meta device, which hold no bytes to borrow.
# `pinned_state_dict` (Open-Sora's checkpoint gathering): page-locked host buffers the program allocated to
# gather into before a save, written with `.copy_()`, never a loader's.
_OTHER_STATE = re.compile(r"(^|_)(kv|caches?|buffers?|bufs|grads?|gradients?|optim\w*|activations?|meta|pinned)(_|$)")
# Words that name a model's inputs and outputs, not its weights: a policy's `batch: dict[str, Tensor]` of
# observations (lerobot's `predict_action_chunk(self, batch)`), `inputs`, `outputs`, `labels`. Read from the
# parameter's name only (a function named for its inputs may still be handed a checkpoint's weights).
_DATA = re.compile(r"^(\w+_)?(batch|batches|obs|observations?|inputs?|outputs?|targets?|labels?|logits|"
                   r"hidden_states|features?|samples?|controls?)$")  # the last word (`input_weights` is weights)
# (`control: dict[str, list[Tensor]]`: a ControlNet's outputs by block, Advanced-ControlNet's `control_merge_inject`;
# `input_dict: dict[str, list[Tensor]]` is transformers 5's loaded tensors, collected per key for a conversion)
# A union that mixes tensors with plain settings (`dict[str, torch.Tensor | int | torch.dtype | torch.device]`,
# GPTQModel's test cases): a bundle of arguments, not a checkpoint's tensors by name (LitGPT's
# `dict[str, torch.Tensor | NotYetLoadedTensor]` mixes tensors with a lazy tensor only).
_SETTINGS_IN_UNION = re.compile(r"\b(int|float|bool|str|bytes|(torch\.)?dtype|(torch\.)?device)\b")


# Words that name a function writing the model's tensors out (Megatron-Bridge's `_accumulate_grouped_export`
# of a `converted_weights_dict`): what it is handed was made by the program, not lent by a loader.
_OWN_PARAMETERS = re.compile(r"(named_)?(param|params|parameters)(_or_groups|_groups)?$")
"""A parameter named for a module's own parameters (nanotron's optimizer helpers take
``named_parameters: Iterable[Tuple[str, torch.Tensor]]`` and ``named_params_or_groups``): what it carries is
``model.named_parameters()``, which optimizer groups keep for the run, and no loader's stream, whatever the
annotation says of its element type."""
_OUTPUT_PATH = re.compile(r"(^|_)(export|exports|exporting|save|saving|serialize|dump)(_|$)")


def _holds_other_state(param: str, function: str) -> bool:
    """Is a ``dict[str, Tensor]`` parameter named, or handed to a function named, for state the program
    owns (aphrodite's kv-transfer connectors' ``register_kv_caches(kv_caches)``, a LoRA trainer's
    ``set_buffers(buffers)``)? Such a dict is read by name as a dict of weights is, but its tensors are
    no loader's: they are not borrowed. The function's name counts only when it does not also say it
    loads something (``load_kv_cache_scales(weights)`` reads a checkpoint)."""
    if _OTHER_STATE.search(param.lower()) or _DATA.search(param.lower()):
        return True
    low = function.lower()
    if _OUTPUT_PATH.search(low) and "load" not in low and "import" not in low:
        return True  # an export or save path: the model's own tensors on their way out, no loader's
    return bool(_OTHER_STATE.search(low)) and "load" not in low and "weight" not in low


_DICT_OF_WEIGHTS_NAMES = frozenset({"weight_dict", "weights_dict"})


_STATE_DICT_NAMES = frozenset({"state_dict", "sd", "weights_dict", "weight_dict", "tensor_dict"})


def _names_weights(param: str) -> bool:
    """A parameter whose own name says it is a dict of weights (``weight_dict``): one whatever its function is
    called (LightX2V's ops take a LoRA file's dict in ``register_diff(weight_dict)`` and ``register_lora``).
    The vaguer names still need a function named for loading: ``weights`` is as often a getter object (TGI's
    ``Weights``, whose ``get_tensor`` is a producer of its own) or a stream, ``sd``/``tensors``/``checkpoint``
    anything."""
    return param in _DICT_OF_WEIGHTS_NAMES


def _passed_to_a_call(info: FunctionInfo, name: str) -> bool:
    """Is the parameter ``name`` handed whole to a call (``helper(attrs, weight_dict)``) in the body?"""
    for node in _own_scope(info.node.body):  # type: ignore[attr-defined]
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == name for a in node.args):
            return True
    return False


def _looks_like_loader(name: str) -> bool:
    return bool(V.LOADER_FUNCTION.search(name)) or "weight_loader" in name


_CONFIGURED_KIND = {"tensor": TENSOR, "iterator": ITER, "dict": MAPPING, "pairs": PAIRS}


def seeds_of(info: FunctionInfo, settings: Optional[Settings] = None) -> List[Seed]:
    """The weight-carrying parameters of ``info`` (empty: not a weight consumer by its signature); a
    consumer entry point of the project's settings (``[tool.ownsan] consumers``) comes first."""
    seeds: List[Seed] = []
    if settings is not None and settings.consumers:
        names = {a.arg for a in info.params} | {a.arg for a in (info.vararg, info.kwarg) if a is not None}
        for c in settings.consumer_params(info.qualname):
            if c.param in names:
                seeds.append(Seed(c.param, _CONFIGURED_KIND[c.kind], f"a configured consumer ({c.qualname}:{c.param})"))
        if seeds:
            return seeds
    used: Optional[Dict[str, str]] = None
    mapping: Optional[Dict[str, str]] = None
    params = info.params[1:] if info.is_method else info.params
    loader = _looks_like_loader(info.name)
    for i, arg in enumerate(params):
        ann = _annotation(arg)
        name = arg.arg
        if ann and V.ITER_ANNOTATION.search(ann) and V.TENSOR_ANNOTATION.search(ann) and not V.MAPPING_ANNOTATION.match(ann):
            if ("Parameter" in ann and not re.search(r"\bTensor\b", ann)) or _OWN_PARAMETERS.match(name):
                continue  # (name, nn.Parameter) pairs: a module's own `named_parameters()`, not a loader's stream
            if name in _indexed_names(info):
                continue  # `outputs[0]`: a generator cannot be indexed, so this is a sequence its caller built
            seeds.append(Seed(name, ITER, f"annotated {ann}"))
            continue
        if ann and (V.MAPPING_OF_TENSORS.match(ann) or V.MAPPING_OF_TENSOR_UNION.match(ann)
                    or (V.MAPPING_OF_ANY.match(ann) and V.STATE_DICT_PARAM.match(name)
                        and V.MAPPING_FUNCTION.search(info.name.lower()))):
            # the annotation says what it holds, the body says whether it is a dict of weights: one whose
            # tensors are read out by name (`weights[n]`, `.items()`, `n in weights`); a dict only kept
            # or passed on whole (a cache view's `self._caches = caches`) is no weight source
            if mapping is None:
                mapping = _mapping_names(info)
            bundle = not V.MAPPING_OF_TENSORS.match(ann) and bool(_SETTINGS_IN_UNION.search(ann.split(",", 1)[-1])) \
                and not V.STATE_DICT_PARAM.match(name)
            if name in mapping and not bundle and not _holds_other_state(name, info.name):
                seeds.append(Seed(name, MAPPING, f"a dict of weights by name, annotated {ann}"))
            continue
        if ann and V.LIST_OF_PAIRS.match(ann):
            seeds.append(Seed(name, PAIRS, f"(name, tensor) pairs the caller holds for the call, annotated {ann}"))
            continue
        if not ann and name in V.MAPPING_PARAM_NAMES and (
                V.MAPPING_FUNCTION.search(info.name.lower()) or _names_weights(name)
                or (info.name == "__init__" and name in _STATE_DICT_NAMES)):
            # (a constructor handed a `state_dict` it reads by name: `To_KV(state_dict)` building its layers
            # around the dict's tensors, IPAdapter_plus; a module built from a state dict is a loader)
            if mapping is None:
                mapping = _mapping_names(info)
            if used is None:
                used = _iterated_names(info)
            if name in mapping and name not in used:
                seeds.append(Seed(name, MAPPING, f"a dict of weights by name ({name}, {mapping[name]})"))
                continue
            if _names_weights(name) and name not in used and _passed_to_a_call(info, name):
                # (`device_tensors = create_default_tensors(self.base_attrs, weight_dict)`: the helper reads it,
                # and what it returns is followed through its summary)
                seeds.append(Seed(name, MAPPING, f"a dict of weights by name ({name}, passed to a helper)"))
                continue
        if name in V.TENSOR_PARAM_NAMES:
            seeds.append(Seed(name, TENSOR, f"a per-tensor weight ({name})"))
            continue
        if ann and V.PAIR_ANNOTATION.match(ann):
            seeds.append(Seed(name, PAIR, f"a (name, tensor) item, annotated {ann}"))
            continue
        if loader and i == 1 and _is_destination(params[0]) and "Parameter" not in ann and (
                V.TENSOR_ANNOTATION.search(ann) if ann else V.TENSOR_ARG_NAME.match(name)):
            seeds.append(Seed(name, TENSOR, f"the weight argument of loader {info.name}()"))
            continue
        if (name in V.ITER_PARAM_NAMES or V.ITER_PARAM_PATTERN.match(name)) and not (
                ann and (V.MAPPING_ANNOTATION.match(ann) or (V.TENSOR_ANNOTATION.search(ann)
                                                             and not V.ITER_ANNOTATION.search(ann))
                         or (_SCALARS.search(ann) and not V.TENSOR_ANNOTATION.search(ann)))):
            # (`adapter_weights: float | list[float] | None`: a LoRA scale's weights, numbers, not tensors)
            if used is None:
                used = _iterated_names(info)
            if name in used and (ann or name not in _indexed_names(info)):
                seeds.append(Seed(name, ITER, f"a weights iterator ({name}, {used[name]})"))
    if loader and info.vararg is not None and not seeds:
        seeds.append(Seed(info.vararg.arg, HOLDER, f"the forwarded arguments of loader {info.name}()"))
    return seeds


def uses_producer(info: FunctionInfo, settings: Optional[Settings] = None) -> bool:
    """Does the body call a known producer of borrowed tensors (so the flow must look at it)?"""
    return any(V.SOURCE_FACTORIES.search(c) or V.ITERATOR_FACTORY.search(c) or V.loader_call_kind(c, None)
               or c == "torch.load" or (settings is not None and settings.is_producer(c))
               or c.rpartition(".")[2] in V.ONLOADING_CONTEXTS
               or ("." in c and c.rpartition(".")[2] in V.LIBRARY_DICT_METHODS) for c in info.calls)


def seed_value(info: FunctionInfo, seed: Seed) -> Val:
    """The abstract value a seeded parameter starts with: its step is the call for a per-tensor weight
    (the loader's step ends when it returns); an iterator's items get their step from the loop."""
    node = info.node
    link = Link(node.lineno, info.qualname, f"`{seed.param}` is {seed.why}")  # type: ignore[attr-defined]
    consumer = seed.consumer or info.qualname
    if seed.kind == ITER:
        return Val(ITER, 0, (link,), consumer, elem=ELEM_PAIR, label=f"`{seed.param}`")
    if seed.kind == HOLDER:
        return Val(HOLDER, id(node), (link,), consumer, label=f"`*{seed.param}`")
    if seed.kind == MAPPING:  # valid for the call (one file's dict): its step is the call
        return Val(HOLDER, id(node), (link,), consumer, label=f"`{seed.param}`", mapping=True)
    if seed.kind == NESTED:
        return Val(HOLDER, id(node), (link,), consumer, label=f"`{seed.param}`", mapping=True, elem=ELEM_NESTED)
    if seed.kind == PAIRS:
        return Val(HOLDER, id(node), (link,), consumer, elem=ELEM_PAIR, label=f"`{seed.param}`")
    if seed.kind == PAIR:
        return Val(PAIR, id(node), (link,), consumer, elem=ELEM_PAIR, label=f"`{seed.param}`")
    return Val(TENSOR, id(node), (link,), consumer, label=f"`{seed.param}`")


__all__ = ["MAPPING", "NESTED", "PAIRS", "Seed", "seeds_of", "seed_value", "uses_producer"]
