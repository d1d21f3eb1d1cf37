"""The flow's call rules: what a call does with a tainted argument, and what it returns.

Views and conversions keep the tensor (``t.view()``, ``.to()``: conditionally), copies end it; a
materialiser holds the whole iterator at once (OWN103); a producer opens a source or yields weights; a
container method stores (see :mod:`.stores`); a call into a helper is handed to the resolver (the
module's summaries, :mod:`.summaries`); an unknown call returns nothing borrowed, except a wrapper around
the weights iterator, which still yields them. A mixin of :class:`~sanitizer.audit.flow.Flow`.
"""
from __future__ import annotations

import ast
import re
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.findings import Link
from sanitizer.audit.index import LOADER_PACKAGES, dotted, param_default as _param_default, param_defaults
from sanitizer.audit.targets import _CAMEL, attribute_classes, constructed_locals, constructed_when, root_of
from sanitizer.audit.values import (BUILT, ELEM_FIELD_PAIRS, ELEM_FIELDS, ELEM_NESTED, ELEM_NESTED_PAIRS, ELEM_ENUM_PAIR, ELEM_ENUM_TENSOR, ELEM_HANDLE_PAIRS, ELEM_DICT, ELEM_PAIR, ELEM_TENSOR, HOLDER,
                                    ITER, PAIR, SOURCE, TENSOR, UNRESOLVED, Val, element_of, handle_of, is_handles)

_MAPPING_COPIES = frozenset({"dict", "OrderedDict", "defaultdict"})  # of a dict: its tensors, by name
_MAPPERS = V.MAPPERS  # (see vocabulary.MAPPERS: also the pre-check of inference.hands_a_producer_over)
_SUBMITTERS = V.SUBMITTERS
_NOT_HOLDERS = frozenset({"Parameter", "Tensor", "Size", "Path", "PurePath", "Event", "Thread", "Lock"})


# `load_state_dict`, or a module's own variant of it asked to assign (`load_xlabs_state_dict(sd, assign=True)`)
_ASSIGNING_LOADER = re.compile(r"^load_(\w+_)?state_dict$")
# Adapter loaders that assign the given state dict's tensors into the model when asked to load with low memory
# (the adapter's weights made on the meta device first, then `load_state_dict(..., assign=True)`):
# transformers' `PreTrainedModel.load_adapter(adapter_state_dict=sd, low_cpu_mem_usage=True)` and peft's
# `set_peft_model_state_dict(model, sd, low_cpu_mem_usage=True)` ("Create empty adapter weights on meta
# device before loading the saved weights"): the state dict argument, by keyword or position.
_ADAPTER_LOADERS = {"load_adapter": ("adapter_state_dict", None),
                    # diffusers' `PeftAdapterMixin.load_lora_adapter(pretrained_model_name_or_path_or_dict, ...,
                    # low_cpu_mem_usage=...)`, which hands it to peft's `set_peft_model_state_dict` (OmniGen2)
                    "load_lora_adapter": ("pretrained_model_name_or_path_or_dict", 0)}

# Methods that make their argument a part of the object they are called on, with the index of that argument
# (and of the name it is kept under: None for a fixed name). torch.nn.Module.add_module: "Add a child module to
# the current module. The module can be accessed as an attribute using the given name" (register_module is
# its alias; set_submodule "Set the submodule given by target if it exists"). transformers'
# PreTrainedModel.set_input_embeddings / set_output_embeddings / set_decoder set the model's module of that
# role (unsloth's `model.set_output_embeddings(new_lm_head)` around an mmap-loaded weight).
_MODULE_SETTERS = {"add_module": (1, 0), "register_module": (1, 0), "set_submodule": (1, 0),
                   "set_input_embeddings": (0, None), "set_output_embeddings": (0, None), "set_decoder": (0, None)}
# Modules built around the tensor they are given, sharing its memory: torch.nn.Embedding.from_pretrained
# "embeddings (Tensor) - FloatTensor containing weights for the Embedding" (it becomes `Parameter(embeddings)`,
# the same storage); the same for EmbeddingBag.
_MODULE_OF_TENSOR = frozenset({"Embedding.from_pretrained", "EmbeddingBag.from_pretrained"})
_ADAPTER_SETTERS = {"set_peft_model_state_dict": ("peft_model_state_dict", 1),
                    "peft.set_peft_model_state_dict": ("peft_model_state_dict", 1),
                    "peft.utils.set_peft_model_state_dict": ("peft_model_state_dict", 1)}


def _keyword_is(node: ast.Call, name: str, value: bool) -> bool:
    """``name=True`` (or ``False``) among the call's keywords, as a literal (a variable may be either)."""
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value for k in node.keywords)


def _dtype_guards(fn: ast.AST) -> Dict[int, set]:
    """For each call inside the body of an ``if x.dtype != y`` (or ``and``-ed with it) of ``fn``: the set of
    ``(x, dump(y))`` its tests promise. Read once per function, and only where a ``.to`` needs it."""
    out: Dict[int, set] = {}
    for sub in ast.walk(fn):
        if not isinstance(sub, ast.If):
            continue
        tests = sub.test.values if isinstance(sub.test, ast.BoolOp) and isinstance(sub.test.op, ast.And) else [sub.test]
        promised = set()
        for t in tests:
            if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.NotEq):
                left, right = t.left, t.comparators[0]
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, ast.Attribute) and a.attr == "dtype" and isinstance(a.value, ast.Name):
                        promised.add((a.value.id, ast.dump(b)))
        if not promised:
            continue
        for stmt in sub.body:
            for inner in ast.walk(stmt):
                if isinstance(inner, ast.Call):
                    out.setdefault(id(inner), set()).update(promised)
    return out


def meth_is_load_from_state_dict(node: ast.Call) -> bool:
    return isinstance(node.func, ast.Attribute) and node.func.attr == "_load_from_state_dict"


def _mentions(fn: ast.AST, word: str) -> bool:
    """Does the function's text name ``word`` anywhere (a name, attribute, keyword or string key)?"""
    for sub in ast.walk(fn):
        text = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else \
            sub.value if isinstance(sub, ast.Constant) and isinstance(sub.value, str) else \
            sub.arg if isinstance(sub, (ast.keyword, ast.arg)) and sub.arg else ""
        if word in text:
            return True
    return False




class CallRules:
    """Calls: on a tainted value (a method), of a function or class, of a producer, of a helper."""

    def call(self, node: ast.Call) -> Optional[Val]:
        func = node.func
        if isinstance(func, ast.Name):
            alts = self.info.function_aliases.get(func.id)
            if alts:
                return self._call_of_choice(node, alts)
        name = dotted(func)
        base: Optional[Val] = None
        meth = ""
        if isinstance(func, ast.Attribute):
            meth = func.attr
            base = self.ev(func.value)
        elif not isinstance(func, ast.Name):
            self.ev(func)
        args = [self.ev(a) for a in node.args]
        kwargs = {k.arg: self.ev(k.value) for k in node.keywords}
        out = kwargs.get("out")
        if out is not None and out.kind == TENSOR:
            self.inplace(node, out, "out= argument", f"`{self.snip(node, 50)}` writes into it")

        if base is not None and meth == "result" and base.kind in (TENSOR, HOLDER) and not node.args:
            return base  # `future.result()` of a submitted loader call (see function_call: `submit`)
        if base is not None:
            handled, result = self.method_on_tainted(node, base, meth, args)
            if handled:
                return result
        elif self._onloaded and meth:
            got = self.onloaded_read(node, meth)
            if got is not None:
                return got
        if meth == "enter_context" and args and args[0] is not None and args[0].kind == SOURCE:
            # contextlib.ExitStack.enter_context(cm): "returns the result of the __enter__() method" (a
            # safetensors handle's is the handle): the handle, open until the stack closes
            return args[0]
        if meth in ("register_buffer", "register_parameter") and len(args) >= 2 and args[1] is not None:
            assert isinstance(func, ast.Attribute)
            target = ast.Attribute(value=func.value, attr=self.snip(node.args[0], 30).strip("'\""), ctx=ast.Store())
            self.attribute_store(ast.copy_location(target, node), args[1], node)
            return None
        if meth == "set_" and isinstance(func, ast.Attribute) and len(args) == 1 and args[0] is not None \
                and args[0].kind == TENSOR and len(node.args) == 1 and not node.keywords:
            # torch.Tensor.set_(source): "Sets the underlying storage, size, and strides. If source is a tensor,
            # self tensor will share the same storage": the receiver (a module's parameter) now holds the view
            # (sd3.5's `load_into`, `obj.set_(ckpt.get_tensor(key))`)
            target = ast.Attribute(value=func.value, attr="<storage: set_()>", ctx=ast.Store(), lineno=node.lineno)
            self.attribute_store(target, args[0], node)
            return None
        if meth in _MODULE_SETTERS and isinstance(func, ast.Attribute):
            value, key = _MODULE_SETTERS[meth]
            if len(args) > value and args[value] is not None and args[value].holds_tensor:
                attr = self.snip(node.args[key], 30).strip("'\"") if key is not None and len(node.args) > key \
                    else meth[len("set_"):]
                target = ast.Attribute(value=func.value, attr=attr, ctx=ast.Store())
                self.attribute_store(ast.copy_location(target, node), args[value], node)
                return None
        if _ASSIGNING_LOADER.match(meth) and args and args[0] is not None and args[0].holds_tensor \
                and self._assign_asked(node):
            # (a module's own `load_xlabs_state_dict(sd, assign=True)` passes `assign` on to it: InvokeAI)
            # torch.nn.Module.load_state_dict: "assign (bool, optional) - When set to False, the properties
            # of the tensors in the current module are preserved whereas setting it to True preserves
            # properties of the Tensors in the state dict": the module's parameters become those tensors
            assert isinstance(func, ast.Attribute)
            target = ast.Attribute(value=func.value, attr="<parameters: load_state_dict(assign=True)>",
                                   ctx=ast.Store(), lineno=node.lineno)  # no columns: named by ast.unparse
            self.attribute_store(target, args[0], node, for_life=self._new_module(func.value))
            return None
        if isinstance(func, ast.Name) and _ASSIGNING_LOADER.match(func.id) and len(args) >= 2 \
                and args[1] is not None and args[1].holds_tensor and self._assign_asked(node) \
                and (self.resolve_call is None or self.resolve_call(self, node) is UNRESOLVED):
            # `load_fp8_state_dict(model, sd, assign=True)`, a function the audit was not given that takes the
            # module first and passes `assign` on to its `load_state_dict` (SimpleTuner's FP8 loader): the
            # module's parameters become the dict's tensors, as for the method
            target = ast.Attribute(value=node.args[0], attr="<parameters: load_state_dict(assign=True)>",
                                   ctx=ast.Store(), lineno=node.lineno)
            self.attribute_store(target, args[1], node, for_life=self._new_module(node.args[0]))
            return None
        if meth == "load_state_dict" and args and args[0] is not None and args[0].holds_tensor \
                and self._torch_optimizer(func):
            # torch.optim.Optimizer.load_state_dict: `_process_value_according_to_param_policy` returns the
            # `step` entry as loaded (unless capturable or fused) and `value.to(dtype=param.dtype,
            # device=param.device)` for the others (the tensor itself when already in place); the results go
            # into `self.state`. A loaded optimizer file's tensors are kept for the optimizer's life.
            assert isinstance(func, ast.Attribute)
            target = ast.Attribute(value=func.value, attr="state", ctx=ast.Load(), lineno=node.lineno)
            self.store_into(target, args[0], node, "update")
            return None
        if meth in _ADAPTER_LOADERS and isinstance(func, ast.Attribute) or name in _ADAPTER_SETTERS:
            if self._adapter_assigned(node, name, meth, args, kwargs):
                return None
        if meth in V.STORE_METHODS and not self._is_module(func) and not self._global_instance_method(node):
            if meth in ("append", "add", "appendleft") and len(node.args) == 1 and args[0] is None \
                    and isinstance(func, ast.Attribute):
                self.published(func.value, node.args[0], node)  # `loaded_networks.append(net)`, filled after
            self.container_method(node, meth, args, kwargs)
            if meth != "setdefault":
                return None
            if len(args) >= 2 and args[1] is not None and args[1].kind == SOURCE:
                return args[1]  # `opened.setdefault(shard, safe_open(path))`: a handle (the one kept there)
        if meth in V.BIND_METHODS:
            got = self._first_holding(args, kwargs)
            if got is not None:
                return got.then(HOLDER, Link(node.lineno, self.fn, f"bound by `{self.snip(node, 40)}`"),
                                capture="inspect.BoundArguments")
        return self.function_call(node, name, args, kwargs)

    def _call_of_choice(self, node: ast.Call, alts: Sequence[ast.expr]) -> Optional[Val]:
        """``load_func(path)`` with ``load_func = load_safetensor_shard if st else load_torch_shard``: a call of
        each function it may be; the result is the first that carries weights (a stream before a tensor)."""
        got: List[Val] = []
        for alt in alts:
            val = self.call(ast.copy_location(ast.Call(func=alt, args=node.args, keywords=node.keywords), node))
            if val is not None:
                got.append(val)
        return next((v for v in got if v.kind == ITER), got[0] if got else None)

    def _torch_optimizer(self, func: ast.AST) -> bool:
        """Is ``func``'s receiver annotated as a torch optimizer (``optimizer: Optimizer``,
        ``torch.optim.AdamW``)? A wrapper of the project's own (``OptimizerWrapper``, ColossalAI's
        LowLevelZero optimizer that deep-copies) is not: its ``load_state_dict`` is its own."""
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            return False
        ann = self.annotations.get(func.value.id, "").replace(" ", "")
        ann = ann[9:-1] if ann.startswith("Optional[") and ann.endswith("]") else ann
        return ann in ("Optimizer", "torch.optim.Optimizer", "optim.Optimizer", "torch.optim.optimizer.Optimizer") \
            or re.fullmatch(r"(torch\.)?optim\.[A-Z]\w*", ann) is not None

    def _new_module(self, expr: ast.AST) -> bool:
        """Is ``expr`` a local this function binds to a new object (``model = Transformer(args)``, in a ``with
        torch.device("meta")`` or not), whose ``load_state_dict(sd, assign=True)`` is being judged? Only a
        ``torch.nn.Module``'s ``load_state_dict`` takes ``assign``, so the object is a module, and a module
        keeps its parameters for its own life, which is the model's, whatever the function then does with it
        (mistral-inference's ``from_folder`` returns it): what it is made to keep is kept, as a module's
        constructor's stores are (see ``ModuleAnalysis.is_module_class``). So is a module held by such a new
        object (``pipe = Text2ImagePipeline(...)``, ``pipe.dit.load_state_dict(sd, assign=True)``, then ``return
        pipe``: cosmos-predict2's pipelines): the module keeps the file, not a container the object dies with."""
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return False
        memo = getattr(self, "_new_objects", None)
        if memo is None:
            memo = self._new_objects = constructed_locals(self.info.node)
        # bound once to a new object, or (rebound later: `model = cast(model)`) still so when the call is made
        return expr.id in memo or constructed_when(self.info.node, expr.id, getattr(expr, "lineno", 0)) is not None

    def inferred_producers(self):  # type: ignore[no-untyped-def]
        """The project's inferred producers (:class:`~.producers.InferredProducers`) the walk was given, through
        the settings whose ``producer_kind`` it holds, or None."""
        return getattr(getattr(self.producer_kind, "__self__", None), "inferred", None)

    def _condition_arg(self, node: ast.Call, found) -> Optional[ast.AST]:  # type: ignore[no-untyped-def]
        """The argument a call passes for an inferred producer's condition parameter (``found.when``), or None."""
        for kw in node.keywords:
            if kw.arg == found.when:
                return kw.value
        if 0 <= found.when_position < len(node.args) and not any(isinstance(a, ast.Starred) for a in node.args):
            return node.args[found.when_position]
        return None

    def _condition_holds(self, node: ast.Call, found) -> bool:  # type: ignore[no-untyped-def]
        """Does this call of a producer that borrows only when a parameter is true pass it true (or leave a true
        default, or pass something the audit cannot know)?"""
        arg = self._condition_arg(node, found)
        if arg is None:
            return found.when_default or any(kw.arg is None for kw in node.keywords)  # (`**kwargs` may set it)
        return not isinstance(arg, ast.Constant) or bool(arg.value)

    def _borrowed_when(self, node: ast.Call, name: str, builtin: str, found) -> str:  # type: ignore[no-untyped-def]
        """The parameter of this function a borrowing call depends on: ``torch.load(path, mmap=mmap)`` with
        ``mmap`` a parameter, or a producer's condition passed on as one (``read(path, mmap=use_mmap)``)."""
        if builtin == "dict" and name == "torch.load":
            arg = next((kw.value for kw in node.keywords if kw.arg == "mmap"), None)
        elif found is not None and found.when:
            arg = self._condition_arg(node, found)
        else:
            return ""
        params = {a.arg for a in self.info.params}
        return arg.id if isinstance(arg, ast.Name) and arg.id in params else ""

    def _is_module(self, func: ast.AST) -> bool:
        """``torch.add(...)``, ``np.put(...)``: a module's function, not a container's method."""
        root = root_of(func.value) if isinstance(func, ast.Attribute) else None  # type: ignore[attr-defined]
        return bool(root and root.name and root.name in self.module_aliases and root.name not in self.state.slots)

    def _first_holding(self, args: Sequence[Optional[Val]], kwargs: Dict[Optional[str], Optional[Val]],
                       skip: int = 0) -> Optional[Val]:
        for v in list(args[skip:]) + list(kwargs.values()):
            if v is not None and v.holds_tensor:
                return v
        return None

    def method_on_tainted(self, node: ast.Call, base: Val, meth: str,
                          args: Sequence[Optional[Val]]) -> Tuple[bool, Optional[Val]]:
        link = Link(node.lineno, self.fn, f"`.{meth}()`")
        if base.kind == TENSOR:
            if meth in V.SPLIT_METHODS:
                return True, base.then(HOLDER, link, elem=ELEM_TENSOR)
            if meth.endswith("_") and not meth.endswith("__") and meth not in V.METADATA_INPLACE:
                self.inplace(node, base, f"in-place `.{meth}()`", f"`{self.snip(node, 50)}`")
                return True, base.then(TENSOR, link)
            if meth == "to" and self._dtype_differs(node):
                return True, None  # `if v.dtype != dt: out[k] = v.to(dt)`: under that test the `.to` always copies
            if meth == "to" and any(k.arg == "copy" and isinstance(k.value, ast.Constant) and k.value.value is True
                                    for k in node.keywords):
                return True, None  # torch.Tensor.to: "When copy is set, a new Tensor is created even when the
                # Tensor already matches the desired conversion" (a blind user's round 41 case)
            if meth in V.CONVERSION_METHODS and not base.convert:
                # named by the conversion itself (`.to(weights.dtype)`), not by its whole receiver expression
                args = ", ".join([self.snip(a, 30) for a in node.args] +
                                 [f"{k.arg}={self.snip(k.value, 20)}" if k.arg else f"**{self.snip(k.value, 20)}"
                                  for k in node.keywords])
                return True, base.then(TENSOR, link, convert=f".{meth}({args})")
            if meth in V.ALIAS_METHODS:
                return True, base.then(TENSOR, link)
            return True, None
        if base.kind == HOLDER:
            if base.field and base.elem != ELEM_FIELDS:
                return True, None  # an object holding tensors in an attribute: its methods are its own
            if meth in ("items",):
                return True, base.then(HOLDER, elem={ELEM_FIELDS: ELEM_FIELD_PAIRS, ELEM_NESTED: ELEM_NESTED_PAIRS}.get(
                    base.elem, ELEM_PAIR), mapping=False)
            if meth in ("values", "copy", "__iter__"):
                return True, base.then(HOLDER, mapping=False)
            if meth == "keys" and base.mapping:
                return True, None
            if meth in ("pop", "get", "popitem", "popleft", "__getitem__"):
                key = node.args[0] if node.args else None
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and V.COUNTER_KEY.match(key.value):
                    return True, None  # `ckpt.get("step", 0)`: a training counter, not a weight
                if base.mapping and isinstance(key, ast.Constant) and isinstance(key.value, str) \
                        and V.NESTED_STATE_KEY.match(key.value):
                    # `ckpt.get("state_dict", ckpt)`: the nested dict of the model's weights (Flow.subscript_value)
                    return True, base.then(HOLDER, link, mapping=True)
                return True, element_of(base, link)
            if meth in V.STORE_METHODS:
                return False, None
            return True, None
        if base.kind == ITER:
            if meth in ("items", "__iter__"):
                return True, base
            return True, None
        if is_handles(base):  # a list or dict of handles: its lookups and items are handles, its keys names
            if meth in ("items",):
                return True, base.then(SOURCE, elem=ELEM_HANDLE_PAIRS)
            if meth in ("values", "copy", "__iter__"):
                return True, base
            if meth in ("pop", "get", "setdefault", "__getitem__", "popitem"):
                return True, handle_of(base, link)
            return (False, None) if meth in V.STORE_METHODS else (True, None)
        if base.kind == SOURCE and base.mapping:  # a mapping of weights: `.get(name)` is a lookup
            if meth in ("get", "__getitem__", "pop"):
                step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
                return True, Val(TENSOR, step, base.chain + (link,), self.fn, label=f"`{self.snip(node, 40)}`",
                                 seed=base.seed)
            return True, None
        if base.kind == SOURCE:
            if meth in V.SOURCE_TENSOR_METHODS:
                # the innermost statement loop's step: `{k: f.get_tensor(k) for k in f.keys()}` builds the
                # step's dict of one file's tensors, which lives as long as that file's step
                step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
                return True, Val(TENSOR, step, base.chain + (link,), self.fn, label=f"`{self.snip(node, 40)}`",
                                 seed=base.seed)  # (a helper's, from the handle it was handed: see _apply)
            if meth in V.SOURCE_ITER_METHODS:
                return True, base.then(ITER, link, elem=ELEM_PAIR)
            if meth in V.SOURCE_SOURCE_METHODS or meth in V.HANDLE_LOOKUPS:
                return True, base.then(SOURCE, link)
            if meth in V.SOURCE_DICT_METHODS:  # fastsafetensors' `fb.as_dict(names)`: the tensors by name
                step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
                return True, Val(HOLDER, step, base.chain + (link,), self.fn, label=f"`{self.snip(node, 40)}`",
                                 mapping=True)
            return False, None  # a getter object's own method: a producer by name, or nothing (function_call)
        return True, None  # a PAIR has no methods that matter

    def function_call(self, node: ast.Call, name: str, args: Sequence[Optional[Val]],
                      kwargs: Dict[Optional[str], Optional[Val]]) -> Optional[Val]:
        first = args[0] if args else None
        link = Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`")
        last = name.rpartition(".")[2]
        if name in V.PARTIALS:
            got = self._first_holding(args, kwargs, skip=1)
            return got.then(HOLDER, link, capture="functools.partial") if got is not None else None
        if name in V.MATERIALISERS and first is not None:
            if first.kind == ITER:
                return self.materialise(node, first, f"`{name}({self.snip(node.args[0], 30)})`")
            if first.kind == HOLDER:
                if first.mapping and last not in _MAPPING_COPIES:
                    return None  # `list(weights)`, `sorted(weights)`: a dict iterates its names, not its tensors
                return first
            if first.kind == TENSOR:
                if name in ("numpy.array", "np.array") and not _keyword_is(node, "copy", False):
                    return None  # numpy.array(t): "copy: bool, default True": a copy (np.asarray shares it)
                return first.then(HOLDER, link, elem=ELEM_TENSOR)
            return None
        if name in V.TEE and first is not None and first.kind == ITER:
            held = self.materialise(node, first, f"`{name}({self.snip(node.args[0], 30)})`")
            return held.then(ITER, reported=True)
        if name in V.LAZY_WRAPPERS:
            got = next((v for v in list(args) + list(kwargs.values()) if v is not None and v.kind != SOURCE), None)
            if got is None:
                # `tqdm(iterators)`, `list(handles)`: a container of handles or streams, wrapped
                held = args[0] if args and is_handles(args[0]) else None
                return held if held is not None and last not in ("enumerate", "zip", "zip_longest") else None
            if last == "enumerate":
                elem = ELEM_ENUM_PAIR if got.elem == ELEM_PAIR or got.kind == PAIR else ELEM_ENUM_TENSOR
                return got.then(got.kind if got.kind in (ITER, HOLDER) else HOLDER, elem=elem)
            if last in ("zip", "zip_longest"):
                return got.then(got.kind if got.kind in (ITER, HOLDER) else HOLDER, elem=ELEM_PAIR)
            return got if got.kind in (ITER, HOLDER) else got.then(HOLDER)
        if name == "next" and first is not None:
            if first.kind == ITER:
                item = element_of(first, link)
                return replace(item, step=self.loops[-1]) if not first.reported else item
            if first.kind == HOLDER:
                return element_of(first, link)
            return None
        if (name in V.ALIAS_FUNCTIONS or last in ("Parameter", "from_numpy", "as_tensor", "asarray")
                or ".".join(name.split(".")[-2:]) in _MODULE_OF_TENSOR) \
                and first is not None and first.holds_tensor:
            return first.then(TENSOR, link, parameter=first.parameter or "Parameter" in name)
        if name in V.SPLIT_FUNCTIONS and first is not None and first.kind == TENSOR:
            return first.then(HOLDER, link, elem=ELEM_TENSOR)
        if last == "distribute_tensor" and first is not None and first.kind == TENSOR:
            # torch.distributed.tensor.distribute_tensor: a Replicate placement, or a shard that is a
            # contiguous chunk, keeps the given tensor's storage as the DTensor's local tensor
            return first.then(TENSOR, link, convert=first.convert or "distribute_tensor(...)")
        if last == "set_module_tensor_to_device":
            value = kwargs.get("value") if "value" in kwargs else (args[3] if len(args) > 3 else None)
            if value is not None and value.holds_tensor and node.args:
                # accelerate.utils.set_module_tensor_to_device(module, tensor_name, device, value=...):
                # "value: The value of the tensor (useful when going from the meta device to any other
                # device)"; it installs `value.to(device)` (the tensor itself when already there)
                kept = value if value.convert else value.then(TENSOR, link, convert="value.to(device)")
                name_arg = node.args[1] if len(node.args) > 1 else None
                attr = f"<{self.snip(name_arg, 30) if name_arg is not None else 'tensor_name'}>"
                target = ast.Attribute(value=node.args[0], attr=attr, ctx=ast.Store(), lineno=node.lineno)
                # (accelerate takes a `torch.nn.Module`: a new one keeps its parameters for its own life, as
                # with `load_state_dict(assign=True)`, whatever the function then does with it; see _new_module)
                self.attribute_store(target, kept, node, for_life=self._new_module(node.args[0]), module_keep=True)
            if self.resolve_call is not None:
                self.resolve_call(self, node)  # accelerate's own definition, audited: its stores are found too
            return None
        if last in V.LIBRARY_HOLDER_NAMES:
            held_at = V.LIBRARY_HOLDERS.get(self._import_path(node, name))
            if held_at is not None and len(args) > held_at and args[held_at] is not None and args[held_at].holds_tensor:
                return args[held_at].then(HOLDER, link, mapping=False)  # (`comfy.lora.load_lora(lora, key_map)`)
        if last in V.LIBRARY_KEEPING_METHODS and isinstance(node.func, ast.Attribute) and not self._is_module(node.func):
            at, library_class = V.LIBRARY_KEEPING_METHODS[last]
            handed = args[at] if len(args) > at else None
            project = getattr(self._summaries(), "project", None)
            if handed is not None and handed.holds_tensor and (project is None or not project.defines_method(last)
                                                                or not (self._receiver_stated(node.func, library_class) or
                                                                        self._vendored(library_class, last))):
                # `new_modelpatcher.add_patches(loaded, strength)` on ComfyUI's ModelPatcher (not audited); or
                # `self.patcher.add_patches(...)` in a wrapper that defines its own `add_patches` and hands the
                # patches to the library's patcher it holds (ComfyUI_ExtraModels' text encoders)
                target = ast.Attribute(value=node.func.value, attr=f"<kept by {last}()>", ctx=ast.Store(),
                                       lineno=node.lineno)
                self.attribute_store(target, handed, node)
                return None
        keeper = self._library_keeper(node, name)
        if keeper is not None:
            # (see vocabulary.LIBRARY_KEEPERS: the library makes the module keep the tensors it is handed)
            module_at, tensors_at, keyword, applies = keeper
            held = kwargs.get(keyword) if keyword in kwargs else (args[tensors_at] if len(args) > tensors_at else None)
            if held is not None and held.holds_tensor and len(node.args) > module_at:
                kept = held.then(held.kind, link, convert=held.convert or applies) if applies else held
                target = ast.Attribute(value=node.args[module_at], attr=f"<kept by {last}()>", ctx=ast.Store(),
                                       lineno=node.lineno)
                self.attribute_store(target, kept, node, for_life=self._new_module(node.args[module_at]),
                                     module_keep=True)
                return None
        if last == "swap_tensors" and len(args) >= 2 and len(node.args) >= 2:
            # torch.utils.swap_tensors(t1, t2): "This function swaps the content of the two Tensor objects"
            # (their storages too): the other object, kept wherever it lives, now holds the borrowed bytes
            for mine, other in ((1, 0), (0, 1)):
                if args[mine] is not None and args[mine].holds_tensor:
                    target = ast.Attribute(value=node.args[other], attr="<swapped in>", ctx=ast.Store(),
                                           lineno=node.lineno)
                    self.attribute_store(target, args[mine], node)
            return None
        from_state_dict = meth_is_load_from_state_dict(node)
        if from_state_dict and self._first_holding(args, kwargs) is None:
            starred = next((self.ev(a.value) for a in node.args if isinstance(a, ast.Starred)), None)
            if starred is not None and starred.holds_tensor:
                args = [starred]
        if from_state_dict and args and args[0] is not None and args[0].holds_tensor:
            # torch.nn.Module._load_from_state_dict(state_dict, prefix, local_metadata, ...), the per-module
            # step of load_state_dict that engines call by hand: with `assign_to_params_buffers` in its
            # metadata (load_state_dict(assign=True)'s), the module's parameters become the dict's tensors;
            # a caller that does not ask for assignment never sets that key
            if _mentions(self.info.node, "assign"):
                assert isinstance(node.func, ast.Attribute)
                target = ast.Attribute(value=node.func.value, attr="<parameters: _load_from_state_dict>",
                                       ctx=ast.Store(), lineno=node.lineno)
                self.attribute_store(target, args[0], node)
            return None
        if name == "setattr" and len(args) >= 3 and args[2] is not None:
            self.setattr_store(node, args[2])
            return None
        if last in ("heappush", "insort", "insort_left", "insort_right") and len(args) >= 2 and args[1] is not None:
            self.store_into(node.args[0], args[1], node, "append")
            return None
        if last.endswith("_") and not last.endswith("__") and first is not None and first.kind == TENSOR \
                and name.startswith(("torch.", "nn.", "init.")):
            self.inplace(node, first, f"in-place `{name}()`", f"`{self.snip(node, 50)}`")
            return None
        if V.SOURCE_FACTORIES.search(name):
            return Val(SOURCE, 0, (Link(node.lineno, self.fn, f"opened by `{self.snip(node, 40)}`"),), self.fn)
        builtin = V.loader_call_kind(name, node)
        if builtin and (self._own_method(node) or self._method_of_a_value(node) or self._defined_here(node)):
            builtin = ""  # `self.load_file(fn)`: the class's own method of that name, not safetensors'
        library_method = not builtin and self._library_method(node)
        if library_method:
            builtin = "dict"  # `pipe.lora_state_dict(path)` of a diffusers pipeline the audit was not given
        configured = builtin or (self.producer_kind(name) if self.producer_kind is not None else None)
        if configured is not None and self._function_called_as_a_method(node, configured):
            configured = None
        if configured is not None and not builtin and (self._stated_class_answers(node, configured)
                                                        or self._mostly_no_producer(node, configured)):
            configured = None  # (its own class's method, no producer, answers: _typed_receiver_producer may)
        if configured is None:
            configured = self._typed_receiver_producer(node)
        if configured is None and isinstance(node.func, (ast.Name, ast.Attribute)):
            configured = self._defined_producer(node)
        found = getattr(configured, "found", None)
        if found is not None and found.when and not self._condition_holds(node, found):
            return None  # `read(path)` of `def read(path, mmap=False)`: this call borrows nothing
        if configured in ("tensor", "dict", "holder"):
            # a getter (`weights.get_tensor(n)`, `load_file(path)`, a helper inferred to return one): borrowed,
            # valid for the step that fetched it, as a source's `f.get_tensor(k)` is (the innermost statement
            # loop's iteration, else the call); a conversion the getter applies is kept for OWN107
            step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
            if configured in ("dict", "holder") and self._parked and not _keyword_is(node, "mmap", False):
                self.next_file_fetched(node)  # (`mmap=False` asks for a copy in memory: not the next borrowed file)
            origin = getattr(configured, "origin", "")
            text = f"returned by `{self.snip(node, 40)}`" + (f" (a producer: {origin})" if origin else "")
            made = Val(TENSOR if configured == "tensor" else HOLDER, step, (Link(node.lineno, self.fn, text),),
                       self.fn, label=f"`{self.snip(node, 40)}`", convert=getattr(configured, "convert", ""),
                       mapping=configured == "dict")
            when = self._borrowed_when(node, name, builtin, found)
            if when:
                made = made.then(when=when)
            parts = getattr(configured, "parts", ())
            if builtin == "dict" and (name in V.LIBRARY_DICT_LOADERS and _keyword_is(node, "return_metadata", True)
                                      or library_method):
                # `sd, metadata = load_torch_file(p, return_metadata=True)`, `sd, alphas = pipe.lora_state_dict(p)`:
                # unpacked, the dict comes first and the rest holds no tensor; whole, it is the dict
                return made.then(parts=(made,))
            if configured in ("dict", "holder") and parts:  # `model, sd, meta = cls._build_model(path)`: `sd` only
                made = made.then(mapping=False, parts=tuple(
                    None if not k else made.then(TENSOR if k == "tensor" else HOLDER, mapping=k == "dict")
                    for k in parts))
            return made
        if configured == "source":  # a helper inferred to return a loader's handle (`self._get_handle(f)`)
            origin = getattr(configured, "origin", "")
            return Val(SOURCE, 0, (Link(node.lineno, self.fn, f"opened by `{self.snip(node, 40)}`"
                                        + (f" (a producer: {origin})" if origin else "")),), self.fn)
        if V.ITERATOR_FACTORY.search(name) or configured is not None:
            origin = getattr(configured, "origin", "")
            return Val(ITER, 0, (Link(node.lineno, self.fn, f"yielded by `{self.snip(node, 40)}`"
                                      + (f" (a producer: {origin})" if origin else "")),), self.fn,
                       elem=ELEM_DICT if configured == "dicts" else ELEM_PAIR, label=f"`{self.snip(node, 40)}`")
        if last == "submit" and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)) \
                and not any(v is not None for v in args) and not any(v is not None for v in kwargs.values()):
            # `executor.submit(load_shard, path)`: the future holds what the call returns once it has run, a
            # producer's dict or tensor fetched now, while the caller goes on (and fetches more): `.result()`
            # hands it out. A future kept past the step keeps it (a prefetching generator's `futures` list).
            done = self.call(ast.copy_location(ast.Call(func=node.args[0], args=node.args[1:],
                                                        keywords=node.keywords), node))
            if done is not None and done.kind in (TENSOR, HOLDER):
                return done.then(done.kind, Link(node.lineno, self.fn, f"a future of `{self.snip(node, 40)}`"))
        if name in V.PURE_BUILTINS or V.NON_TENSOR_CALLS.search(name):
            return None
        if isinstance(node.func, ast.Name) and self.summary_param is None and not getattr(self, "infer", False):
            self._closure_called(node, node.func.id)
        if self.resolve_call is not None and len(node.args) >= 2 and last in _MAPPERS | _SUBMITTERS \
                and isinstance(node.args[0], (ast.Name, ast.Attribute)) and args[1] is not None:
            self._call_handed_over(node, last, args[1])
        if self.resolve_call is not None and (any(v is not None for v in args) or
                                              any(v is not None for v in kwargs.values())):
            handled = self.resolve_call(self, node)
            if handled is not UNRESOLVED:
                return handled  # type: ignore[return-value]
        if self._into_unread_base(node, args, kwargs):
            return None
        passed_through = self._maybe_returned(node, name, last, args)
        if passed_through is not None:
            return passed_through
        built = self._unknown_object(node, name, last, args, kwargs)
        if built is not None:
            return built
        stream = next((v for v in list(args) + list(kwargs.values()) if v is not None and v.kind == ITER), None)
        if stream is not None and not V.NAME_RETURNING.search(name):
            return stream.then(link=link)  # a wrapper around the iterator (a mapper, tqdm): still a stream
        if args and is_handles(args[0]) and not V.NAME_RETURNING.search(name):
            return args[0]  # `tqdm(state_dict_iterators)`: a wrapper around a container of handles or streams
        return None

    def _adapter_assigned(self, node: ast.Call, name: str, meth: str, args: Sequence[Optional[Val]],
                          kwargs: Dict[Optional[str], Optional[Val]]) -> bool:
        """``text_encoder.load_adapter(adapter_state_dict=sd, **peft_kwargs)``, ``set_peft_model_state_dict(
        model, sd, low_cpu_mem_usage=True)``: with ``low_cpu_mem_usage`` asked for (a literal ``True``, or
        ``**kwargs`` in a function that names the option: diffusers sets it in ``peft_kwargs`` from its own
        argument), the adapter's parameters become the dict's tensors (see :data:`_ADAPTER_LOADERS`). When
        the audit reads the function's own definition, that is followed instead (what it keeps is reported
        where it keeps it)."""
        keyword, position = _ADAPTER_LOADERS.get(meth) if meth in _ADAPTER_LOADERS else _ADAPTER_SETTERS[name]
        sd = kwargs.get(keyword)
        if sd is None and position is not None and len(args) > position:
            sd = args[position]
        if sd is None or not sd.holds_tensor:
            return False
        if self.resolve_call is not None and self.resolve_call(self, node) is not UNRESOLVED:
            return True  # its definition is audited (peft's own `set_peft_model_state_dict`): followed there
        if isinstance(node.func, ast.Name) and not self._imported_from_library(node.func.id):
            return False  # the project's own function of that name (peft itself, imported relatively)
        asked = _keyword_is(node, "low_cpu_mem_usage", True) or (
            any(k.arg is None for k in node.keywords) and _mentions(self.info.node, "low_cpu_mem_usage")) or (
            any(k.arg == "low_cpu_mem_usage" and not isinstance(k.value, ast.Constant) for k in node.keywords))
        if not asked:
            return False
        owner = node.func.value if meth in _ADAPTER_LOADERS else (node.args[0] if node.args else None)  # type: ignore
        if owner is None:
            return False
        target = ast.Attribute(value=owner, attr=f"<adapter parameters: {meth or name.rpartition('.')[2]}"
                                                 f"(low_cpu_mem_usage)>", ctx=ast.Store(), lineno=node.lineno)
        self.attribute_store(target, sd, node)
        return True

    def _dtype_differs(self, node: ast.Call) -> bool:
        """Is ``node`` (``value.to(dt)``, ``value.to(dtype=dt)``) inside an ``if`` whose test says
        ``value.dtype != dt`` (alone or among ``and``-ed tests)? Then the conversion never returns ``value``
        itself: "If the self Tensor already has the correct torch.dtype and torch.device, then self is
        returned. Otherwise, the returned tensor is a copy of self" (``torch.Tensor.to``). KJNodes' LoRA resize."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            return False
        target = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "dtype"), None)
        if target is None:
            return False
        guards = getattr(self, "_dtype_guards", None)
        if guards is None:
            guards = self._dtype_guards = _dtype_guards(self.info.node)
        return (func.value.id, ast.dump(target)) in guards.get(id(node), ())

    def _library_keeper(self, node: ast.Call, name: str) -> Optional[Tuple[int, int, str, str]]:
        """``requantize(model, sd, qmap)`` imported from optimum-quanto, ``comfy.sd.load_lora_for_models(...)``
        called through its module: a library function the audit was not given that makes a module hold the
        tensors it is handed (:data:`~.vocabulary.LIBRARY_KEEPERS`), by the callee's full import path."""
        if name.rpartition(".")[2] not in V.LIBRARY_KEEPER_NAMES:
            return None  # (most calls: no need to look for the import)
        full = self._import_path(node, name)
        return V.LIBRARY_KEEPERS.get(full) if full else None

    def _import_path(self, node: ast.Call, name: str) -> str:
        """The full import path of the function a call names, when it is a library's: ``from m import f`` (at
        module level or in this function) then ``f(...)``, or ``import m`` then ``m.f(...)``; else ``""``."""
        func = node.func
        index = getattr(self._summaries(), "index", None)
        if isinstance(func, ast.Name):
            return self._name_import_path(func.id)
        if isinstance(func, ast.Attribute) and "." in name:
            head, _, rest = name.partition(".")
            if index is not None and head in index.module_paths:
                return f"{index.module_paths[head]}.{rest}"  # `import comfy.sd as sd` then `sd.load_lora...`
            if index is not None and head in index.module_aliases:
                return name
        return ""

    def _imported_as(self, name: str) -> Optional[Tuple[str, int, str]]:
        """(module, level, original) of a name the module imports at module level (``from X import a as b``)."""
        index = getattr(self._summaries(), "index", None)
        return index.imports.get(name) if index is not None else None

    def _name_import_path(self, name: str) -> str:
        """``module.original`` of a name imported absolutely, at module level or inside this function, or ``""``
        (a relative import is the project's own)."""
        imported = self._imported_as(name)
        if imported is not None:
            return f"{imported[0]}.{imported[2]}" if imported[1] == 0 else ""
        for stmt in ast.walk(self.info.node):  # type: ignore[attr-defined]
            if isinstance(stmt, ast.ImportFrom) and not stmt.level and stmt.module:
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        return f"{stmt.module}.{alias.name}"
        return ""

    def _library_method(self, node: ast.Call) -> bool:
        """``self.lora_state_dict(path)``, ``pipe.lora_state_dict(path)``: a library's loader method
        (:data:`~.vocabulary.LIBRARY_DICT_METHODS`) that no audited class defines (diffusers' LoRA mixins,
        inherited by the engine's pipeline), so it returns the file's dict as the library's does."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr in V.LIBRARY_DICT_METHODS) or self._own_method(node):
            return False
        project = getattr(self._summaries(), "project", None)
        return project is None or not project.defines_method(func.attr)

    def _method_of_a_value(self, node: ast.Call) -> bool:
        """``media_io.load_file(path)`` on a parameter or local (lmdeploy's media readers): a method of that
        object, not safetensors' ``load_file`` (reached as an imported name or through a module alias)."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            return False
        name = func.value.id
        if name in self.module_aliases:
            return False
        return self._local_or_param(name)

    def _assign_asked(self, node: ast.Call) -> bool:
        """``assign=True``, or a value the audit cannot know (``assign=assign`` with the function's own parameter
        defaulting to true, Step1X-Edit's ``load_state_dict(model, path, assign=True)`` helpers; ``assign=cfg.x``):
        the module keeps the dict's tensors whenever it is true, as ``torch.load(mmap=<var>)`` borrows. A
        parameter defaulting to false, or a constant false, asks for a copy."""
        for kw in node.keywords:
            if kw.arg != "assign":
                continue
            value = kw.value
            if isinstance(value, ast.Constant):
                return bool(value.value)
            if isinstance(value, ast.Name) and any(a.arg == value.id for a in self.info.params):
                default = param_defaults(self.info).get(value.id)
                return default is None or not isinstance(default, ast.Constant) or bool(default.value)
            return True
        return False

    def _summaries(self):  # type: ignore[no-untyped-def]
        """The module's summaries (:class:`~.summaries.ModuleAnalysis`) the walk resolves calls through, or None."""
        return getattr(self.resolve_call, "__self__", None)

    def _local_or_param(self, name: str) -> bool:
        """Is ``name`` a local this function binds or one of its parameters (a value, not a module's name)?"""
        return name in self.state.slots or any(a.arg == name for a in self.info.params)

    def _defined_producer(self, node: ast.Call):  # type: ignore[no-untyped-def]
        """``load(path)`` resolving to a module-level ``def load`` inferred a producer under that generic name
        (:attr:`~.producers.InferredProducers.by_definition`), or None."""
        table = self.inferred_producers()
        if table is None:
            return None
        summaries = self._summaries()
        if isinstance(node.func, ast.Name) and self._local_or_param(node.func.id):
            # `def s3(self, p, load): load(p)`: the parameter, not the module's function; a producer where this
            # module's callers pass one as it (`_merge_checkpoint_shards(dir, names, _load_safetensors_file)`)
            if any(a.arg == node.func.id for a in self.info.params):
                return table.passed_kind(self.path, self.info.qualname, node.func.id)
            return None
        if isinstance(node.func, ast.Name) and summaries is not None:
            imported = summaries.index.imports.get(node.func.id)
            if imported is not None and imported[2] != node.func.id and self.producer_kind is not None:
                got = self.producer_kind(imported[2])  # `from .helpers import read_shard as rs`: `rs(p)`
                if got is not None:
                    return got
        if not table.by_definition:
            return None
        if isinstance(node.func, ast.Attribute) and not (isinstance(node.func.value, ast.Name) and (
                node.func.value.id in self.module_aliases or summaries is not None
                and node.func.value.id in summaries.index.imports)):
            return None  # only `helpers.load(p)` through a module, never `obj.load(p)`
        callee = summaries.callee(self, node) if summaries is not None else None
        if callee is None or callee.constructor or callee.info.cls is not None:
            return None
        path = callee.analysis.path if callee.analysis is not None else self.path
        return table.kind_of_definition(path, callee.info.node.lineno)  # type: ignore[attr-defined]

    def _function_called_as_a_method(self, node: ast.Call, configured: object) -> bool:
        """``model.load_state_dict(sd)`` where the producer inferred under that name is a plain function (DiffSynth's
        ``load_state_dict(path)`` loader): a method of the value ``model``, not that function. A call through a
        module (``utils.load_state_dict(p)``) still is; so is any name a method was inferred under."""
        found = getattr(configured, "found", None)
        if found is None or not isinstance(node.func, ast.Attribute):
            return False
        qualname = found.qualname
        if "." in qualname and qualname.rsplit(".", 2)[-2] != "<locals>":
            return False  # a method's: matched by its name on any receiver (a getter object's)
        root = root_of(node.func.value)
        if root.name is None:
            return not isinstance(node.func.value, ast.Call)  # `self.x.load(...)`, `a[0].load(...)`
        return root.name == self.self_name() or self._local_or_param(root.name)

    def _defined_here(self, node: ast.Call) -> bool:
        """``load_file(path)`` that names a function of the audited tree (coqui TTS's ``managers.load_file``, a
        json / ``torch.load`` reader defined beside its callers): the engine's own, judged by its body (an
        inferred producer when that body calls safetensors), not taken for safetensors' by its name. A name
        imported from safetensors resolves to nothing audited, so it stays the loader's API."""
        if not isinstance(node.func, ast.Name):
            return False
        if self._renamed_import(node.func.id):
            return True
        callee = getattr(self._summaries(), "callee", None)
        return callee is not None and callee(self, node) is not None

    def _vendored(self, cls: str, meth: str) -> bool:
        """Does an audited class named as the library's (``ModelPatcher``) define ``meth``: a vendored copy of the
        library (Fooocus's ``ldm_patched``), whose own method a receiver of unknown class most likely runs?"""
        summaries = self._summaries()
        project = getattr(summaries, "project", None)
        if project is None:
            return False
        for path in dict.fromkeys(project.method_files(meth)):
            other = summaries._analysis_of(path)  # type: ignore[union-attr]
            if other is not None and any(c.qualname.rpartition(".")[2] == cls and meth in c.methods
                                         for c in other.index.all_classes):
                return True
        return False

    def _receiver_stated(self, func: ast.Attribute, library_class: str) -> bool:
        """Is the method called on ``self``/``cls`` or on a receiver whose class the function states (an
        annotation, a local bound to a new object) as another than the library's: that class's own method?"""
        if isinstance(func.value, ast.Name) and func.value.id in (self.self_name(), "cls"):
            return True
        return any(c != library_class for c in self._stated_classes(func))

    def _renamed_import(self, name: str) -> bool:
        """``from ..fileio import load as load_file`` (mmcv's json/yaml reader, vendored by comfyui_controlnet_aux):
        the name is another function renamed, imported from no loader's package, so a call to it is that
        function, whatever the alias says. (A loader's API renamed, ``from safetensors.torch import load_file as
        st_load``, was renamed back to the API in the tree before the walk: see index._canonical_loader_calls.)"""
        imported = self._imported_as(name)
        if imported is None:
            return False
        module, level, original = imported
        return original != name and (level > 0 or module.split(".")[0] not in LOADER_PACKAGES)

    def _own_method(self, node: ast.Call) -> bool:
        """``self.load_file(...)`` / ``cls.load_file(...)`` where the enclosing class defines that method."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id in (self.self_name(), "cls")):
            return False
        cls = self.info.enclosing_class
        return cls is not None and func.attr in cls.methods

    def _imported_from_library(self, name: str) -> bool:
        """Is ``name`` imported absolutely (``from peft import set_peft_model_state_dict``), not relatively
        as the project's own (``from .utils import ...``, peft itself) nor defined in this module?"""
        # (an import inside the function counts: `from peft import set_peft_model_state_dict`, SimpleTuner)
        return bool(self._name_import_path(name))

    def _closure_called(self, node: ast.Call, name: str) -> None:
        """``load(model)`` where ``load`` is a closure this function defines over its weights (diffusers'
        ``_load_state_dict_into_model``: a nested ``load(module, prefix)`` that recurses into the children
        and calls ``module._load_from_state_dict(state_dict, ...)`` on the enclosing ``state_dict``): the
        closure's body runs on them now, so what it keeps is kept by this call too (reported here, as well
        as at the closure's own statement). Only a closure defined in this function and called directly;
        one stored or returned is judged where it is kept (OWN104)."""
        held = self.state.env.get(name)
        nested = self.info.nested.get(name)
        if held is None or held.capture != "closure" or nested is None or self._depth > 8:
            return
        own = {a.arg for a in nested.params} | {a.arg for a in (nested.vararg, nested.kwarg) if a is not None}
        seeds: Dict[str, Val] = {}
        for sub in ast.walk(nested.node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in own \
                    and sub.id not in seeds:
                val = self.state.env.get(sub.id)
                if val is not None and val.holds_tensor and not val.reported:
                    seeds[sub.id] = val
        if not seeds:
            return
        make = type(self)  # a Flow: these rules are its mixin
        inner = make(self.path, nested, seeds, self.globals, self.snip, self.resolve_call,  # type: ignore[call-arg]
                     module_aliases=tuple(self.module_aliases), producer_kind=self.producer_kind,
                     depth=self._depth + 1)
        inner.attribute_source = self.attribute_source
        try:
            found = inner.run().findings
        except RecursionError:
            return
        for f in found:
            val = next(iter(seeds.values()))
            self.report(f.code, node, val, f"kept by closure `{name}` (called here)",
                        f"{self._what(val)} is kept by the closure `{name}` this function defines and calls "
                        f"(line {f.line}: {f.message})", f"`{self.snip(node, 40)}` runs `{name}` on it")

    def _call_handed_over(self, node: ast.Call, last: str, handed: Val) -> None:
        """``parallel(load_one, iter(weights.items()), model=model)``, ``pool.map(load_one, items)``,
        ``executor.submit(load_one, w)``: the function handed over is called with each item (a mapper) or
        with the argument (a submitter), so its summary is applied as for a direct call, the call's other
        keywords passed on (fastcore's ``parallel`` and ``functools``-style ``**kwargs``)."""
        if last in _MAPPERS:
            if handed.kind not in (ITER, HOLDER):
                return
            item = element_of(handed, Link(node.lineno, self.fn, f"each item of `{self.snip(node.args[1], 30)}`"))
        else:
            item = handed
        temp = "__ownsan_handed__"
        self.state.env[temp] = item
        try:
            call = ast.copy_location(ast.Call(func=node.args[0], args=[ast.Name(id=temp, ctx=ast.Load())],
                                              keywords=list(node.keywords)), node)
            self.resolve_call(self, call)  # type: ignore[misc]
        finally:
            self.state.env.pop(temp, None)

    def _typed_receiver_producer(self, node: ast.Call) -> Optional[str]:
        """``checkpoint_loader.load(key)`` with ``checkpoint_loader: HFCheckpointLoader`` annotated: the
        annotation names the class, so its method inferred a producer answers, whatever its name (``load``
        is too common a name to be matched by name alone)."""
        func = node.func
        if not isinstance(func, ast.Attribute):
            return None
        inferred = self.inferred_producers()
        if inferred is None or not inferred.by_method:
            return None
        cls = self.info.enclosing_class
        value = func.value
        if isinstance(value, ast.Attribute):
            # `self._safetensors_loader.load(file)` with `__init__(self, safetensors_loader: SafetensorsLoader)`
            # storing it there (fairseq2's loaders, handed in by a container): the class it is typed with
            return self._method_of_classes(inferred, self._stated_classes(func, built=False), func.attr)
        if not isinstance(value, ast.Name):
            return None
        if cls is not None and func.value.id == self.self_name():
            # `self.get("emb")`: the class's own method inferred a producer, whatever its name (a method
            # named `get` is never matched by name alone), or a base's of this module
            for owner in [cls.qualname.rpartition(".")[2]] + [b.rpartition(".")[2] for b in cls.bases]:
                got = inferred.kind_of_method(owner, func.attr)
                if got is not None:
                    return got
            return None
        classes = self._stated_classes(func, built=False)
        return self._method_of_classes(inferred, classes, func.attr) if classes else None

    def _stated_classes(self, func: ast.Attribute, built: bool = True) -> List[str]:
        """The classes a receiver is stated to be: a parameter's annotation, ``self.<attr>`` stored from an
        annotated parameter (:func:`~.targets.attribute_classes`), or (``built``) a local bound once to a new
        object."""
        value = func.value
        cls = self.info.enclosing_class
        if isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and cls is not None \
                and value.value.id == self.self_name():
            return attribute_classes(cls, value.attr)
        if not isinstance(value, ast.Name):
            return []
        ann = self.annotations.get(value.id)
        if ann:
            return [c.rpartition(".")[2] for c in V.ANNOTATED_CLASS.findall(ann)]
        if not built:
            return []
        memo = getattr(self, "_new_objects", None)
        if memo is None:
            memo = self._new_objects = constructed_locals(self.info.node)
        return [memo[value.id]] if value.id in memo else []

    def _global_instance_method(self, node: ast.Call) -> bool:
        """``state_dict_cache.put(path, sd)`` on a module-level instance of an audited class that defines ``put``:
        the class's method, followed through its summary, not a container's ``put`` judged by its argument."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)) \
                or self._local_or_param(func.value.id):
            return False
        summaries = self._summaries()
        callee = summaries.callee(self, node) if summaries is not None else None
        return callee is not None and callee.info.cls is not None

    def _stated_class_answers(self, node: ast.Call, configured: object) -> bool:
        """``self.node.loadmodel(path)`` with ``node: ModelLoaderNode``, where the producer inferred under the name
        ``loadmodel`` is another class's (every ComfyUI node has one): the receiver's stated class, audited and
        defining that method, answers, not the name. A blind user's probe (a node's ``loadmodel`` returning
        ``(box,)`` taken for a checkpoint loader's)."""
        found = getattr(configured, "found", None)
        func = node.func
        if found is None or not isinstance(func, ast.Attribute):
            return False
        summaries = self._summaries()
        if summaries is None:
            return False
        # (a module-level function inferred under the name, `load_model(path)` of another file, is never the
        # method a class's call names: `VisionModel.load_model(folder)`, SD.Next's JoyTag model)
        producer_class = found.qualname.rsplit(".", 2)[-2] if "." in found.qualname else None
        stated = self._stated_classes(func)
        if not stated and isinstance(func.value, ast.Name) and not self._local_or_param(func.value.id) \
                and func.value.id[:1].isupper() and summaries.constructed_class(self, func.value.id) is not None:
            stated = [func.value.id]  # `VisionModel.load_model(folder)`: called on the audited class itself
        for name in stated:
            if name == producer_class:
                return False
            got = summaries.constructed_class(self, name)
            if got is not None and got[0].find_method(got[1], func.attr, set()) is not None:
                return True
        return False

    def _mostly_no_producer(self, node: ast.Call, configured: object) -> bool:
        """``cls().doit(model, clip, ...)`` on a receiver of no stated class, where ``doit`` is the method every
        node of the pack defines (ComfyUI-Impact-Pack: a hundred of them) and one class's (``LatentReceiver``'s,
        reading a latent file) was inferred a producer, a class the project never builds: most definitions of
        the name hand out no tensor, and no object of the producer's class is made here, so the name alone does
        not make this call that one. A name the audited classes define mostly as producers (TGI's
        ``weights.get_tensor``, a getter object's one method), or a producer's class the project builds, is
        still matched by the name."""
        found = getattr(configured, "found", None)
        func = node.func
        if found is None or not isinstance(func, ast.Attribute) or "." not in found.qualname \
                or self._receiver_stated(func, ""):
            return False
        project = getattr(self._summaries(), "project", None)
        table = self.inferred_producers()
        if project is None or table is None:
            return False
        defined = len(project.method_files(func.attr))
        producing = [key.rpartition(".")[0] for key in table.by_method if key.rpartition(".")[2] == func.attr]
        # (mergekit's `task.execute()` runs `LoadTensor` tasks among others: a class the project builds, so the
        # object may be one; the pack's `LatentReceiver` node is built only by ComfyUI's graph)
        return defined > 2 * max(len(producing), 1) and not any(project.constructed(c) for c in producing)

    def _method_of_classes(self, inferred, classes: Sequence[str], meth: str) -> Optional[str]:  # type: ignore[no-untyped-def]
        """The producer that ``meth`` of one of ``classes`` was inferred to be; failing that, of an audited
        subclass of one (an abstract ``SafetensorsLoader.load`` whose implementation, ``_HFSafetensorsLoader``,
        reads the file: the object the annotation promises is one of them)."""
        for name in classes:
            got = inferred.kind_of_method(name, meth)
            if got is not None:
                return got
        project = getattr(self._summaries(), "project", None)
        if project is None:
            return None
        for name in classes:
            for _, sub in project.subclasses(name):
                got = inferred.kind_of_method(sub, meth)
                if got is not None:
                    return got
        return None

    def _maybe_returned(self, node: ast.Call, name: str, last: str,
                        args: Sequence[Optional[Val]]) -> Optional[Val]:
        """A call the audit cannot read that returns its tensor unchanged when there is nothing to do, so
        what it returns may be the borrowed tensor itself (a conversion that copies unless it is a no-op,
        as ``.to(dtype)`` is: a store of it is conditional, OWN107):

        * ``maybe_cast(t, dtype)``, ``maybe_dequantize(t)``: a ``maybe_`` helper (by the convention its name
          states) returns its input when the condition does not hold;
        * ``convert(fqn, t)`` through a parameter whose default names a function the audit was not given
          (``convert: Convert = to_default``, ``transform=identity``): a hook the caller may pass as the
          identity, and whose default leaves most tensors unchanged.

        The tensor is the first argument that is one (``convert(fqn, value)``)."""
        if not (last.startswith("maybe_") and last != "maybe_") and not (
                isinstance(node.func, ast.Name) and _param_default(self.info, node.func.id) is not None):
            return None
        got = next((v for v in args if v is not None and v.kind == TENSOR and not v.reported), None)
        if got is None:
            return None
        link = Link(node.lineno, self.fn, f"`{self.snip(node, 40)}` (may return it unchanged)")
        return got.then(TENSOR, link, convert=got.convert or f"{self.snip(node.func, 20)}(...)")

    def _into_unread_base(self, node: ast.Call, args: Sequence[Optional[Val]],
                          kwargs: Dict[Optional[str], Optional[Val]]) -> bool:
        """``super().__init__(qtype, axis, size, stride, data, scale)`` in an ``__init__`` whose base the audit
        cannot read (its summaries did not resolve the call): the base keeps what it is built around, as an
        attribute of the object under construction (a store on ``self``, judged as one)."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and func.attr == "__init__" and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name) and func.value.func.id == "super"
                and self.info.name == "__init__" and self.info.params):
            return False
        got = self._first_holding(args, kwargs)
        if got is None or got.kind != TENSOR:
            return False
        me = ast.Name(id=self.info.params[0].arg, ctx=ast.Load(), lineno=node.lineno)
        target = ast.Attribute(value=me, attr="<kept by super().__init__>", ctx=ast.Store(), lineno=node.lineno)
        self.attribute_store(target, got, node)
        return True

    def _unknown_object(self, node: ast.Call, name: str, last: str, args: Sequence[Optional[Val]],
                        kwargs: Dict[Optional[str], Optional[Val]]) -> Optional[Val]:
        """``TensorSource(name=n, source=tensor)`` of a class the audit cannot read: an object built around
        a borrowed tensor holds it (what else would it be given it for?). Torch's own constructors, and
        exceptions and warnings (a message), are not such objects."""
        if not _CAMEL.match(last) or last.endswith(("Error", "Exception", "Warning")) \
                or name.startswith(("torch.", "nn.", "np.", "numpy.")) or last in _NOT_HOLDERS:
            return None
        got = next((v for v in list(args) + list(kwargs.values())
                    if v is not None and v.kind == TENSOR and not v.reported), None)
        if got is None:
            return None
        return got.then(HOLDER, Link(node.lineno, self.fn, f"{BUILT}{last}` (a class the audit does not "
                                                           f"read)"), elem=ELEM_TENSOR)

    def materialise(self, node: ast.AST, it: Val, how: str) -> Val:
        """The whole iterator held at once: the finding, and a holder whose items are already covered."""
        if not it.reported:
            self.report("OWN103", node, it, how, f"{how} materialises {self._what(it)}: every tensor it yields is "
                        f"kept while the loader moves on", f"`{self.snip(node, 60)}`")
        return it.then(HOLDER, reported=True)


__all__ = ["CallRules"]
