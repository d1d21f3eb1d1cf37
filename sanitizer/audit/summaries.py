"""Calls into functions of the same module or class: summaries, so that a helper that keeps its
argument is found from the loop that passes it a yielded tensor.

A summary answers, for one helper parameter seeded with one kind of value (a tensor, a pair, a holder,
an iterator), three questions, by running the same flow over the helper's body:

* which statements of the helper keep it past the call (finding *templates*: the caller prefixes its
  own chain and reports them at the helper's statement, where the fix belongs);
* which containers *passed in* it is stored into (``buf`` in ``_try_load(name, tensor, buf)``): the
  caller judges those by its own container's lifetime (a fresh per-step dict is fine);
* what it returns (a view of the argument, or a container holding it), so ``w2 = self._narrow(w)``
  stays tainted.

Resolved: nested functions (by name, through enclosing functions), module-level functions, methods of
the enclosing class and its same-module bases via ``self.``/``cls.``/``super().``, ``ClassName.method``
and ``ClassName(...)`` (its ``__init__``: storing into ``self`` makes the new object a holder).
Summaries nest up to :data:`MAX_DEPTH` calls deep; recursion gets an empty summary.
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass, replace
from typing import Collection, Dict, List, Optional, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.findings import Finding, Link
from sanitizer.audit.flow import Flow
from sanitizer.audit.values import UNRESOLVED, IntoParam, Outcome
from sanitizer.audit.index import param_default as _param_default
from sanitizer.audit.index import ClassInfo, FunctionInfo, ModuleIndex, build_index, dotted
from sanitizer.audit.targets import constructed_locals
from sanitizer.audit.producers import SelfSources
from sanitizer.audit.project import Project
from sanitizer.audit.settings import Settings
from sanitizer.audit.snippets import Snippets
from sanitizer.audit.targets import root_of
from sanitizer.audit.values import BUILT, HOLDER, ITER, SOURCE, TENSOR, Val, built_class

MAX_DEPTH = 3
MAX_OVERRIDES = 16  # overrides of one method a ``self.`` call is followed into (a deep hierarchy: the nearest)


# Methods every module, tensor or container has (torch.nn.Module's, torch.Tensor's, dict's), never taken for
# the one audited class's method of that name on an object of unknown class (:meth:`ModuleAnalysis._only_method`)
_SHARED_METHODS = frozenset({
    "load_state_dict", "state_dict", "named_parameters", "named_buffers", "named_modules", "named_children",
    "register_buffer", "register_parameter", "register_module", "add_module", "get_submodule", "get_parameter",
    "set_submodule", "requires_grad_", "zero_grad", "share_memory", "type_as", "new_empty", "new_zeros",
    "new_ones", "new_full", "copy_", "add_", "mul_", "data_ptr", "untyped_storage", "from_pretrained",
    "save_pretrained", "to_empty", "set_default", "load_weights", "get_input_embeddings", "get_output_embeddings",
    "set_input_embeddings", "set_output_embeddings", "_load_from_state_dict",
})


@dataclass(frozen=True)
class Callee:
    info: FunctionInfo
    offset: int  # how many leading parameters the call binds implicitly (self)
    constructor: bool
    analysis: Optional["ModuleAnalysis"] = None  # the module that defines it, when another audited one


def _is_classmethod(m: FunctionInfo) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "classmethod" for d in getattr(m.node, "decorator_list", ()))


def _registry_loop(fn: ast.AST, name: str, module_globals: Collection[str]) -> bool:
    """Is ``name`` the target of a loop over a registry: a module-level collection or an attribute
    (``for supported_type in supported_control_models:``, ``for nettype in l.module_types:``), whose items are
    the classes (or instances) a call on ``name`` may run the method of?"""
    for node in ast.walk(fn):
        if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name) and node.target.id == name:
            it = node.iter
            if isinstance(it, ast.Name) and it.id in module_globals or isinstance(it, ast.Attribute):
                return True
            if isinstance(it, (ast.Tuple, ast.List)) and it.elts and all(
                    isinstance(e, ast.Call) and dotted(e.func).rpartition(".")[2][:1].isupper() for e in it.elts):
                return True  # `for kind in (Ia3Kind(), LoraKind()):`, a registry written in place
    return False


def _fits(m: FunctionInfo, skip: int, node: ast.Call) -> bool:
    """Can ``node``'s arguments bind to ``m``'s parameters (after the ``skip`` it is bound with): no more
    positional arguments than it takes, no keyword it lacks (unless it takes ``*args``/``**kwargs``)?"""
    names = [a.arg for a in m.params][skip:]
    if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return True
    if len(node.args) > len(names) and m.vararg is None:
        return False
    return all(k.arg in names for k in node.keywords) or m.kwarg is not None


class ModuleAnalysis:
    """The summaries of one module's functions, computed on demand and memoised."""

    def __init__(self, path: str, index: ModuleIndex, snippets: Snippets, project: Optional[Project] = None,
                 settings: Optional[Settings] = None):
        self.path = path
        self.settings = settings
        self.producer_kind = settings.producer_kind if settings is not None and (
            settings.producers or settings.inferred is not None) else None
        self.handles: Optional["SelfSources"] = None  # getter objects on self (set by the engine, :mod:`.producers`)
        self.snippets = snippets
        self.project = project
        self.index = index
        self._memo: Dict[Tuple[int, int, str, str, bool, bool, bool, str, bool], Outcome] = {}
        self._busy: set = set()
        self._partials: Dict[int, Dict[str, List[ast.Call]]] = {}  # a function's `f = partial(g, ...)` bindings
        self._constructed: Dict[int, Dict[str, str]] = {}  # a function's locals bound to a new object, by class
        self._module_built: Optional[Dict[str, str]] = None  # the module's globals bound once to a new object
        self._also: Dict[int, List[Callee]] = {}  # a call's other possible callees (_only_method), by the call's id
        # the attributes of ``self`` a method of this module's classes stores a borrowed value in: by class, then
        # attribute, (value, line, method) (Stores._note_self_kept; read by engine.analyse's second pass)
        self.self_kept: Dict[str, Dict[str, Tuple[object, int, str]]] = (
            project.self_kept.setdefault(os.path.normpath(os.path.abspath(path)), {}) if project is not None else {})
        self.depth = 0

    def close(self) -> None:
        """Break the links to the project and the memo (evicted from the project's cache)."""
        self.project = None
        self._memo.clear()
        self._partials.clear()
        self._constructed.clear()

    # -- resolution ----------------------------------------------------------------------------------------
    def callee(self, flow: Flow, node: ast.Call) -> Optional[Callee]:
        func = node.func
        index = self.index
        if isinstance(func, ast.Name):
            cur: Optional[FunctionInfo] = flow.info
            while cur is not None:
                if func.id in cur.nested:
                    return Callee(cur.nested[func.id], 0, False)
                cur = cur.parent
            if func.id in index.top_functions:
                return Callee(index.top_functions[func.id], 0, False)
            default = _param_default(flow.info, func.id)
            if default is not None:  # `convert(fqn, value)` with `convert: Convert = to_default`: its default
                return self.callee(flow, ast.copy_location(ast.Call(func=default, args=node.args,
                                                                    keywords=node.keywords), node))
            built = self.constructed_class(flow, func.id)
            if built is not None:
                where, cls = built
                found = where.find_method(cls, "__init__", set())
                if found is None:
                    return None
                init, init_where = found
                return Callee(init, 1, True, init_where if init_where is not self else None)
            return self._imported(func.id)
        if not isinstance(func, ast.Attribute):
            return None
        base = func.value
        cls = flow.info.enclosing_class
        if isinstance(base, ast.Name):
            if cls is not None and base.id in (flow.self_name(), "cls", "self"):
                found = self.find_method(cls, func.attr, set())
                if found is not None:
                    m, where = found
                    return Callee(m, 0 if m.is_static else 1, False, where if where is not self else None)
                return None
            other = index.classes.get(base.id)
            if other is not None:
                m = index.method(other, func.attr)
                if m is not None:  # (a classmethod called on its class binds `cls` itself: one parameter skipped)
                    return Callee(m, 1 if _is_classmethod(m) else 0, False)
                return None
            return self._module_function(base.id, func.attr) or self._imported_class_method(base.id, func.attr) \
                or self._typed_object_method(flow, base.id, func.attr) or self._only_method(flow, base.id, func.attr, node)
        if isinstance(base, ast.Attribute):
            return self._dotted_module_function(base, func.attr)
        if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super" and cls:
            for b in cls.bases:
                # a base of this module, or one imported from another audited module (InvokeAI's LoRA layers'
                # `super().__init__(alpha, bias)` into `LoRALayerBase.__init__`, whose `self.bias = bias` keeps it)
                owner = self.base_class(b, cls)
                found = owner[0].find_method(owner[1], func.attr, set()) if owner is not None else None
                if found is not None:
                    m, where = found
                    return Callee(m, 0 if m.is_static else 1, False, where if where is not self else None)
        return None

    def _only_method(self, flow: Flow, name: str, attr: str, node: Optional[ast.Call] = None) -> Optional[Callee]:
        """``patcher.add_patches(loaded, strength)`` on a local or parameter of no class the function states
        (``patcher = model.clone()``): the audited classes that define a method of that name, when the name is
        the project's own (two words or more, none of a module's, a tensor's or a container's own methods).
        One alone is that method (Fooocus's ``ModelPatcher.add_patches``, which keeps the LoRA patches). Several
        (a registry's classes: ``for supported_type in supported_control_models:
        supported_type.try_build_from_state_dict(sd, path)``, Forge's ControlNet patchers) are each what the call
        may run, as a class hierarchy's analysis reads a call through an unknown receiver: the first is
        returned, the others applied beside it (:meth:`resolve`), each only where the call's arguments fit it."""
        if self.project is None or attr in _SHARED_METHODS or "_" not in attr.strip("_") or attr.startswith("_") \
                or name in self.index.globals or not (name in flow.state.slots
                                                      or any(a.arg == name for a in flow.info.params)):
            return None
        files = self.project.method_files(attr)
        if not files or len(files) > MAX_OVERRIDES:
            return None
        found: List[Callee] = []
        for path in dict.fromkeys(files):
            where = self if os.path.normpath(os.path.abspath(path)) == os.path.normpath(os.path.abspath(self.path)) \
                else self._analysis_of(path)
            if where is None:
                continue
            for c in where.index.all_classes:
                m = c.methods.get(attr)
                if m is None:
                    continue
                callee = Callee(m, 0 if m.is_static else 1, False, where if where is not self else None)
                if len(files) == 1 or node is None or _fits(m, callee.offset, node):
                    found.append(callee)
        if len(files) == 1 and len(found) != 1:
            return None  # (one file, several classes of it: as before, no guess)
        if not found or (len(found) > 1 and not _registry_loop(flow.info.node, name, self.index.globals)):
            return None  # several: only over a registry of classes (a parameter of several classes stays unknown)
        if node is not None and len(found) > 1:
            self._also[id(node)] = found[1:MAX_OVERRIDES]
        return found[0]

    def _typed_object_method(self, flow: Flow, name: str, attr: str) -> Optional[Callee]:
        """``writer.save_tensor(n, t)`` on an object whose class the function states: a parameter annotated
        with it (``writer: TensorWriter``), or a local the function binds once to a new one (``writer =
        TensorWriter(...)``, ``with TensorWriter(...) as writer``): that class's method, bound to it (a store
        into ``self`` there is a store into ``writer`` here, judged by where ``writer`` lives)."""
        classes: List[str] = []
        ann = flow.annotations.get(name)
        if ann:
            classes = [c.rpartition(".")[2] for c in V.ANNOTATED_CLASS.findall(ann)]
        else:
            node = flow.info.node
            built_here = self._constructed.get(id(node))
            if built_here is None:
                built_here = self._constructed[id(node)] = constructed_locals(node)
            built = built_here.get(name)
            if built is not None:
                classes = [built]
            elif name in self.index.globals and name not in flow.state.slots \
                    and not any(a.arg == name for a in flow.info.params):
                # a module-level instance, bound once where the module is run (`state_dict_cache =
                # StateDictCache()`, SD.Next's cache of whole files): its class's method, bound to it
                built = self.module_instance_class(name)
                classes = [built] if built is not None else []
                if built is None:
                    got = self._imported_instance_method(name, attr)  # `from .cache import state_dict_cache`
                    if got is not None:
                        return got
        for cls_name in classes:
            found = self.constructed_class(flow, cls_name)
            if found is None:
                continue
            where, cls = found
            got = where.find_method(cls, attr, set())
            if got is None:
                continue
            m, m_where = got
            if m.is_static:
                return Callee(m, 0, False, m_where if m_where is not self else None)
            return Callee(m, 1, False, m_where if m_where is not self else None)
        return None

    def module_instance_class(self, name: str) -> Optional[str]:
        """The class of this module's global ``name`` when the module binds it once to a new object of a named
        class (``state_dict_cache = StateDictCache()``), else None."""
        if self._module_built is None:
            self._module_built = constructed_locals(self.index.tree)
        return self._module_built.get(name)

    def _imported_from(self, name: str) -> Tuple[Optional["ModuleAnalysis"], str]:
        """The other audited module a name is imported from by name (``from .cache import state_dict_cache``),
        and the name it has there; (None, "") when it is not one."""
        imp = self.index.imports.get(name)
        if imp is None or self.project is None:
            return None, ""
        module, level, original = imp
        path = self.project.locate(self.path, module, level)
        other = self._analysis_of(path) if path is not None and path != self.path else None
        return other, original

    def _imported_instance_method(self, name: str, attr: str) -> Optional[Callee]:
        """``state_dict_cache.set(path, sd)`` with ``from .cache import state_dict_cache``: the instance another
        audited module binds once at its level, whose class's method the call runs, bound to it."""
        other, original = self._imported_from(name)
        cls_name = other.module_instance_class(original) if other is not None else None
        cls = other.index.classes.get(cls_name) if other is not None and cls_name else None
        if cls is None:
            return None
        got = other.find_method(cls, attr, set())  # type: ignore[union-attr]
        if got is None:
            return None
        m, where = got
        return Callee(m, 0 if m.is_static else 1, False, where if where is not self else None)

    def _imported_class_method(self, name: str, attr: str) -> Optional[Callee]:
        """``WeightQBytesTensor.load_from_state_dict(sd, ...)`` with the class imported from another audited
        module (directly, or re-exported by a package's unaudited ``__init__``): its static or class method."""
        imp = self.index.imports.get(name)
        if imp is None or self.project is None:
            return None
        module, level, original = imp
        other, _ = self._imported_from(name)
        cls = other.index.classes.get(original) if other is not None else None
        if cls is None:
            path = self.project.reexported(self.path, module, level, original, kind="class")
            other = self._analysis_of(path) if path is not None and path != self.path else None
            cls = other.index.classes.get(original) if other is not None else None
        if cls is None or other is None:
            return None
        found = other.find_method(cls, attr, set())
        if found is None:
            return None
        m, where = found
        return Callee(m, 1 if _is_classmethod(m) else 0, False, where if where is not self else None)

    def _module_function(self, name: str, attr: str) -> Optional[Callee]:
        """``convert_weights.meta_to_tune(sd)`` with ``from torchtune.models import convert_weights`` (or
        ``import pkg.mod as m``): a function of another audited module, called through the module."""
        if self.project is None or name not in self.index.globals:
            return None
        imp = self.index.imports.get(name)
        if imp is not None:
            module, level, original = imp
            path = self.project.locate(self.path, f"{module}.{original}" if module else original, level)
        elif name in self.index.module_aliases:
            path = self.project.locate(self.path, self.index.module_paths.get(name, name), 0)
        else:
            return None
        if path is None or path == self.path:
            return None
        other = self._analysis_of(path)
        info = other.index.top_functions.get(attr) if other is not None else None
        return Callee(info, 0, False, other) if info is not None else None

    def _dotted_module_function(self, base: ast.Attribute, attr: str) -> Optional[Callee]:
        """``comfy.utils.set_attr_param(model, k, w)`` after ``import comfy.utils``: a function of another audited
        module, called through its full dotted path (ComfyUI's own modules call each other so)."""
        if self.project is None:
            return None
        module = dotted(base)
        if not module or module.startswith("?") or module.split(".")[0] not in self.index.module_aliases \
                or module.split(".")[0] in self.index.module_paths:
            return None
        path = self.project.locate(self.path, module, 0)
        if path is None or path == self.path:
            return None
        other = self._analysis_of(path)
        info = other.index.top_functions.get(attr) if other is not None else None
        return Callee(info, 0, False, other) if info is not None else None

    def constructed_class(self, flow: Flow, name: str) -> Optional[Tuple["ModuleAnalysis", ClassInfo]]:
        """The class that ``name(...)`` constructs: one of this module, one imported from another audited
        module, or ``cls(...)`` in a classmethod (the class it is defined in)."""
        if name == "cls" and name not in self.index.classes:
            own = flow.info.enclosing_class
            first = flow.info.params[0].arg if flow.info.params else None
            return (self, own) if own is not None and first == "cls" else None
        return self.base_class(name)

    def is_module_class(self, cls: ClassInfo, depth: int = 0) -> bool:
        """Is ``cls`` a ``torch.nn.Module`` (a base spelt ``nn.Module``, ``torch.nn.LayerNorm``, ``Module``, or
        a class of the audited code that is one)? A module keeps what its constructor stores for its own
        life, which is the model's: the retention is the constructor's store, whatever the caller does
        with the module (returns it up a chain of layer loaders, as TGI's ``FastLinear.load`` does)."""
        if depth > 6:
            return False
        for base in cls.bases:
            if base in ("Module", "nn.Module", "torch.nn.Module") or base.startswith(("nn.", "torch.nn.")):
                return True
            if base in ("Tensor", "torch.Tensor"):
                return True  # a tensor subclass (a quantized weight) keeps what it is built around as the weight
            short = base.rpartition(".")[2]
            if short.endswith("Tensor") and short not in self.index.classes and self._import_target(short) is None:
                return True  # (a base the audit cannot read, named as a tensor subclass: `QBytesTensor`)
            found = self.base_class(short, cls)
            if found is not None and found[0].is_module_class(found[1], depth + 1):
                return True
        return False

    def base_class(self, name: str, of: Optional[ClassInfo] = None) -> Optional[Tuple["ModuleAnalysis", ClassInfo]]:
        """The audited class a base (or constructor) spelt ``name`` names: one of this module (not ``of`` itself:
        ``class Linear(Linear)`` derives from an imported ``Linear``), else one imported from an audited module."""
        head, _, name = name.rpartition(".")
        local = self.index.classes.get(name)
        if local is not None and local is not of:
            return self, local
        found = self._import_target(name) if name else None
        other_cls = found[0].index.classes.get(found[1]) if found is not None else None
        if other_cls is None and head and "." not in head:
            # `class NetworkModuleHada(network.NetworkModule)` after `import network` (A1111's and SD.Next's LoRA
            # module types, each in its own file): the class of that audited module
            other = self._module_named(head)
            other_cls = other.index.classes.get(name) if other is not None else None
            found = (other, name) if other_cls is not None else None  # type: ignore[assignment]
        return (found[0], other_cls) if found is not None and other_cls is not None else None

    def _module_named(self, alias: str) -> Optional["ModuleAnalysis"]:
        """The analysis of the audited module a module-level ``import network`` (or ``import x.network as
        network``, ``from pkg import network``) binds to ``alias``."""
        if self.project is None:
            return None
        if alias in self.index.module_aliases:
            module, level = self.index.module_paths.get(alias, alias), 0
        elif alias in self.index.imports:
            pkg, level, original = self.index.imports[alias]
            module = f"{pkg}.{original}" if pkg else original
        else:
            return None
        path = self.project.locate(self.path, module, level)
        return self._analysis_of(path) if path is not None and path != self.path else None

    def is_plain_class(self, cls: ClassInfo, depth: int = 0) -> bool:
        """Is ``cls`` a plain object: every base ``object`` or ``ABC`` (or none), or a class of the audited code
        that is plain itself? False for any base the audit cannot read (it may be a module of a library)."""
        if depth > 6 or any(k.arg != "metaclass" or dotted(k.value).rpartition(".")[2] != "ABCMeta"
                            for k in cls.node.keywords):
            return False
        for base in cls.bases:
            if base in _PLAIN_BASES:
                continue
            found = self.base_class(base.rpartition(".")[2], cls)
            if found is None or not found[0].is_plain_class(found[1], depth + 1):
                return False
        return True

    def overrides(self, flow: Flow, node: ast.Call, target: Callee) -> List[Callee]:
        """For ``self.name(...)``: the overrides of ``name`` in subclasses of the calling method's class
        (same module first, then the project's other audited files), which the call reaches for an
        instance of them (``MMWeightTpl.load_hf_weights`` calls ``self._process_weight(w)``, and
        ``BMMWeightTpl._process_weight`` keeps ``w``). At most :data:`MAX_OVERRIDES`, nearest first."""
        func = node.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id in (flow.self_name(), "self", "cls")):
            return []
        cls = flow.info.enclosing_class
        if cls is None:
            return []
        caller: Optional[FunctionInfo] = flow.info
        while caller is not None and caller.cls is None:
            caller = caller.parent
        runs_here = caller.name if caller is not None else None  # the method the call is written in
        out: List[Callee] = []
        seen_nodes = {id(target.info.node)}
        todo = [(self, cls.qualname.rpartition(".")[2])]
        looked: set = set()
        while todo and len(out) < MAX_OVERRIDES:
            where, base = todo.pop(0)
            if (where.path, base) in looked or len(looked) > 4 * MAX_OVERRIDES:
                continue
            looked.add((where.path, base))
            places: List[Tuple["ModuleAnalysis", ClassInfo]] = [
                (where, c) for c in where.index.all_classes
                if any(b.rpartition(".")[2] == base for b in c.bases)]
            for path, name in (self.project.subclasses(base) if self.project is not None else ()):
                if path == where.path:
                    continue
                other = self._analysis_of(path)
                sub = other.index.classes.get(name) if other is not None else None
                if sub is not None:
                    places.append((other, sub))
            for other, sub in places:
                mine = sub.methods.get(runs_here) if runs_here else None
                if mine is not None and not _calls_super(mine.node, runs_here):
                    continue  # it overrides the calling method too: its instances never make this call
                m = sub.methods.get(func.attr)
                if m is not None and id(m.node) not in seen_nodes:
                    seen_nodes.add(id(m.node))
                    out.append(Callee(m, 0 if m.is_static else 1, False, other if other is not self else None))
                todo.append((other, sub.qualname.rpartition(".")[2]))
        return out[:MAX_OVERRIDES]

    def _analysis_of(self, path: str) -> Optional["ModuleAnalysis"]:
        if self.project is None:
            return None
        other = self.project.module(path, lambda source: ModuleAnalysis(
            source.path, build_index(source.path, source.tree, source.text), Snippets(source.text), self.project, self.settings))
        return other if isinstance(other, ModuleAnalysis) else None

    def find_method(self, cls: ClassInfo, name: str, seen: set) -> Optional[Tuple[FunctionInfo, "ModuleAnalysis"]]:
        """``cls.name`` through the class, its same-module bases, and bases imported from other audited
        modules (``class MMWeightTpl(BaseWeightTpl)`` with ``BaseWeightTpl`` from ``.base_weight``)."""
        m = self.index.method(cls, name)
        if m is not None:
            return m, self
        if cls.qualname in seen or len(seen) > 8:
            return None
        seen.add(cls.qualname)
        for base in cls.bases:
            short = base.rpartition(".")[2]
            local = self.index.classes.get(short)
            if local is not None:
                found = self.find_method(local, name, seen)
            else:
                found = None
                where, wanted = self, short
                for _ in range(3):  # through re-exports: `from .layer_weights import PreAndPostLayerWeight`
                    other = where._module_of(wanted)
                    if other is None:
                        break
                    wanted = where.index.imports[wanted][2]
                    other_cls = other.index.classes.get(wanted)
                    if other_cls is not None:
                        found = other.find_method(other_cls, name, seen)
                        break
                    where = other
            if found is not None:
                return found
        return None

    def _module_of(self, name: str) -> Optional["ModuleAnalysis"]:
        """The analysis of the audited module that ``name`` (imported at module level) comes from."""
        found = self._import_target(name)
        return found[0] if found is not None else None

    def _import_target(self, name: str) -> Optional[Tuple["ModuleAnalysis", str]]:
        """The audited module that ``name`` is imported from, with the name it has there."""
        imp = self.index.imports.get(name)
        if imp is None and self.index.star_imports and self.project is not None and name not in self.index.globals:
            return self._star_import_target(name)
        if imp is None or self.project is None:
            return None
        module, level, original = imp
        path = self.project.locate(self.path, module, level)
        if path is None:  # a package whose __init__ (not audited) re-exports it
            path = self.project.reexported(self.path, module, level, original)
        if path is None or path == self.path:
            return None
        other = self.project.module(path, lambda source: ModuleAnalysis(
            source.path, build_index(source.path, source.tree, source.text), Snippets(source.text), self.project, self.settings))
        return (other, original) if isinstance(other, ModuleAnalysis) else None

    def _star_import_target(self, name: str) -> Optional[Tuple["ModuleAnalysis", str]]:
        """``from lightx2v.common.ops.utils import *`` then ``create_default_tensors(...)``: the first star-imported
        audited module that defines ``name`` at its top level (a later star import would shadow an earlier
        one, so the last is looked at first, as Python binds them)."""
        assert self.project is not None
        for module, level in reversed(self.index.star_imports):
            path = self.project.locate(self.path, module, level)
            other = self._analysis_of(path) if path is not None and path != self.path else None
            if other is not None and (name in other.index.top_functions or name in other.index.classes):
                return other, name
        return None

    def _imported(self, name: str) -> Optional[Callee]:
        """A module-level function imported from another audited module (``from .x import f``)."""
        found = self._import_target(name)
        if found is None:
            return None
        other, original = found
        info = other.index.top_functions.get(original)
        return Callee(info, 0, False, other) if info is not None else None

    # -- summaries -------------------------------------------------------------------------------------------
    def summary(self, callee: FunctionInfo, index: int, seed: Val, depth: int = 0) -> Outcome:
        key = (id(callee.node), index, seed.kind, seed.elem, seed.capture is not None, seed.mapping, bool(seed.convert),
               seed.field, seed.field_mapping)
        done = self._memo.get(key)
        if done is not None:
            return done
        if key in self._busy:
            return Outcome()
        params = callee.params + [a for a in (callee.vararg, callee.kwarg) if a is not None]
        name = params[index].arg
        start = Val(seed.kind, 0 if seed.kind == ITER else id(callee.node),
                    (Link(callee.node.lineno, callee.qualname, f"`{name}` (parameter of `{callee.qualname}`)"),),
                    callee.qualname, elem=seed.elem, capture=seed.capture, seed=index,
                    parameter=seed.parameter, label=f"`{name}`", mapping=seed.mapping, convert=seed.convert,
                    field=seed.field, field_mapping=seed.field_mapping)
        self._busy.add(key)
        self.depth += 1
        try:
            flow = Flow(self.path, callee, {name: start}, self.index.globals, self.snippets, self.resolve,
                        summary_param=index, module_aliases=self.index.module_aliases,
                        producer_kind=self.producer_kind, depth=depth)
            if self.handles is not None:
                flow.attribute_source = self.handles.value
            out = flow.run()
        finally:
            self.depth -= 1
            self._busy.discard(key)
        self._memo[key] = out
        return out

    def resolve(self, flow: Flow, node: ast.Call):
        """The flow's hook for a call with tainted arguments: apply the callee's summaries."""
        if self.depth >= MAX_DEPTH:
            return UNRESOLVED
        target = self.callee(flow, node)
        if target is None:
            through = self._through_partials(flow, node)
            if through is not UNRESOLVED:
                return through
            return self._dataclass_result(flow, node)
        result = self._apply(flow, node, target)
        also = self._also.pop(id(node), [])  # the other classes' methods a call on an unknown receiver may run
        for other in self.overrides(flow, node, target) + also:  # what an override keeps is kept by this call too
            got = self._apply(flow, node, other)
            if result is not None and got is not None and got.built_at and result.kind == got.kind:
                # objects either class may build: each constructor's store is what keeps the tensor
                result = result.then(built_at=result.built_at + tuple(b for b in got.built_at if b not in result.built_at))
            result = result if result is not None else got
        return result

    def _through_partials(self, flow: Flow, node: ast.Call):
        """``copy_fn(sd, hf_weights)`` where the function bound ``copy_fn = partial(copy_weights_x, config,
        qkv_weights)`` (in any branch: each binding is followed, as an ``if`` joins both arms): the call
        made as the wrapped function's, the partial's arguments first (LitGPT's checkpoint converter
        reaches every copy function only so)."""
        func = node.func
        if not isinstance(func, ast.Name):
            return UNRESOLVED
        bindings = self._partials.get(id(flow.info.node))
        if bindings is None:
            bindings = self._partials[id(flow.info.node)] = _partial_bindings(flow.info.node)
        result = UNRESOLVED
        for made in bindings.get(func.id, ()):
            call = ast.copy_location(ast.Call(func=made.args[0], args=list(made.args[1:]) + list(node.args),
                                              keywords=list(made.keywords) + list(node.keywords)), node)
            target = self.callee(flow, call)
            if target is None:
                continue
            got = self._apply(flow, call, target)
            result = got if result is UNRESOLVED or result is None else result
        return result

    def _dataclass_result(self, flow: Flow, node: ast.Call):
        """``KVScales(key_scale=k, value_scale=v)`` of a ``@dataclass`` with no ``__init__`` of its own: the
        generated one keeps every argument, so the new object holds the first tainted one (there is no
        source to summarise)."""
        if not isinstance(node.func, ast.Name):
            return UNRESOLVED
        built = self.constructed_class(flow, node.func.id)
        if built is None or not _is_dataclass(built[1]) or built[0].find_method(built[1], "__init__", set()):
            return UNRESOLVED
        for expr in list(node.args) + [kw.value for kw in node.keywords]:
            val = flow.ev(expr) if not isinstance(expr, ast.Name) else flow.state.env.get(expr.id)
            if val is not None and val.holds_tensor:
                name = built[1].qualname
                return val.then(HOLDER, Link(node.lineno, flow.fn, f"{BUILT}{name}` (a dataclass)"), obj=name)
        return UNRESOLVED

    def _apply(self, flow: Flow, node: ast.Call, target: Callee) -> Optional[Val]:
        """One callee's summaries applied to the call's tainted arguments: its findings emitted at its own
        statements, the containers passed in judged here, its result returned."""
        callee = target.info
        params = callee.params
        bound: List[Tuple[int, ast.AST]] = []  # (parameter index, argument expression)
        for i, arg in enumerate(node.args):
            if isinstance(arg, ast.Starred):
                break
            p = target.offset + i
            if p < len(params):
                bound.append((p, arg))
            elif callee.vararg is not None:
                bound.append((len(params), arg))
                break
        names = {a.arg: i for i, a in enumerate(params)}
        for kw in node.keywords:
            if kw.arg in names:
                bound.append((names[kw.arg], kw.value))
            elif kw.arg is not None and callee.kwarg is not None:
                bound.append((len(params) + (callee.vararg is not None), kw.value))
        arg_of = {p: expr for p, expr in bound}
        if target.offset == 1 and not target.constructor and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            arg_of.setdefault(0, node.func.value)  # `writer.save_tensor(...)`: its `self` is `writer`
        result: Optional[Val] = None
        module = target.constructor and callee.cls is not None and (target.analysis or self).is_module_class(callee.cls)
        for p, expr in bound:
            val = flow.ev(expr) if not isinstance(expr, ast.Name) else flow.state.env.get(expr.id)
            if val is None:
                continue  # (a loader's handle passed in is followed: `convert_shard(reader)` fetches from it)
            if val.kind == SOURCE and val.mapping:
                got = self._lookup_through(flow, node, target, p, val)
                result = result if result is not None else got
                continue
            outcome = (target.analysis or self).summary(callee, p, val, flow._depth)  # one budget of nesting
            pname = (params + [a for a in (callee.vararg, callee.kwarg) if a is not None])[p].arg
            call_link = Link(node.lineno, flow.fn, f"passed to `{callee.qualname}()` as `{pname}`")
            for template in outcome.findings:
                self._emit(flow, template, val, call_link, callee)
            for fact in outcome.into_param:
                if module and fact.index == 0:
                    self._emit(flow, fact.template, val, call_link, callee)  # kept by a module: see is_module_class
                    continue
                self._into_param(flow, node, target, fact, arg_of, val, call_link, callee)
            if outcome.returns is not None and result is None and val.kind == SOURCE \
                    and outcome.returns.kind in (TENSOR, HOLDER) and not outcome.returns.capture:
                result = self._fetched_through(flow, node, callee, val, outcome.returns)
            if outcome.returns is not None and result is None:
                ret = outcome.returns
                link = Link(node.lineno, flow.fn, f"returned by `{callee.name}()`")
                parts = None
                if ret.parts is not None:  # `return name, w`: keep which element is the tensor
                    parts = tuple(val.then(p.kind, link, elem=p.elem) if p is not None else None for p in ret.parts)
                result = val.then(ret.kind, link, elem=ret.elem, capture=ret.capture or val.capture, seed=val.seed,
                                  parts=parts, reported=ret.reported or val.reported, field=ret.field,
                                  field_mapping=ret.field_mapping,
                                  convert=val.convert or ret.convert,
                                  # a file's dict re-keyed by the helper into a dict of its own and returned
                                  # (ComfyUI's `convert_diffusers_mmdit`) is still the step's dict of weights
                                  mapping=ret.mapping and val.mapping and ret.kind == HOLDER,
                                  built_at=tuple(self._finding(flow, made, val, call_link, callee)  # type: ignore[arg-type]
                                                 for made in ret.built_at))
            if target.constructor and not module and constructor_result(outcome):
                name = callee.qualname.split(".")[0]
                own = () if any(built_class(link.text) for link in val.chain) or val.reported else tuple(
                    self._finding(flow, fact.template, val, call_link, callee)
                    for fact in outcome.into_param if fact.index == 0)
                if result is None:
                    result = val.then(HOLDER, Link(node.lineno, flow.fn, f"{BUILT}{name}`"), obj=name, built_at=own)
                elif result.obj == name and own:  # (each argument's own store: `self.hint_bias = hint_bias` too)
                    result = result.then(built_at=result.built_at + own)
                # where the constructor itself stores the tensor on the new object (`self.up = up`): credited
                # there if the caller only returns the object (Flow._st_return), as a module's constructor is
                # (not for an object built around objects already built around it: `Patch(layers=layers)` of
                # `SetParameter(...)`s, whose constructors keep the tensor: one retention, at its first store)
                if not any(built_class(link.text) for link in val.chain):
                    flow.built_stores.setdefault(name, []).extend(
                        (lambda f=fact, v=val, at=call_link: self._emit(flow, f.template, v, at, callee))
                        for fact in outcome.into_param if fact.index == 0)
            if result is None and val.kind == ITER and callee.is_generator and outcome.yields is not None:
                result = val.then(ITER, Link(node.lineno, flow.fn, f"re-yielded by `{callee.name}()`"))
        return result

    def _fetched_through(self, flow: Flow, node: ast.Call, callee: FunctionInfo, val: Val, ret: Val) -> Val:
        """``self._load_local_tensor(source, key, device)``: a helper handed the loader's handle fetches from it
        (``source.get_tensor(key)``) and returns the tensor, or a view of it: fetched at this call, so valid for
        the caller's step (its innermost statement loop's iteration, else the call), as a fetch written in the
        caller would be (LightX2V's MiniMax-H3 loaders fetch every tensor so)."""
        step = next((x for x in reversed(flow.loops) if x not in flow._comp_steps), flow.func_step)
        link = Link(node.lineno, flow.fn, f"fetched from the handle by `{callee.name}()`")
        return Val(ret.kind, step, val.chain + (link,), flow.fn, elem=ret.elem, label=f"`{flow.snip(node, 40)}`",
                   convert=ret.convert)

    def _lookup_through(self, flow: Flow, node: ast.Call, target: Callee, p: int, val: Val) -> Optional[Val]:
        """``self.maybe_modify_loaded_hf_weight(param, hf_state_dict)`` with a lazy mapping of weights: a helper
        that looks tensors up in it and returns them hands out tensors fetched at this call, valid for the
        caller's step (its innermost statement loop's iteration, else the call). Only what it returns is
        taken: its own stores are judged where it is walked itself."""
        callee = target.info
        outcome = (target.analysis or self).summary(callee, p, val, flow._depth)
        ret = outcome.returns
        if ret is None or ret.kind not in (TENSOR, HOLDER) or ret.capture:
            return None
        step = next((x for x in reversed(flow.loops) if x not in flow._comp_steps), flow.func_step)
        link = Link(node.lineno, flow.fn, f"looked up in `{flow.snip(node, 40)}` by `{callee.name}()`")
        return Val(ret.kind, step, val.chain + (link,), flow.fn, elem=ret.elem, label=f"`{flow.snip(node, 40)}`",
                   convert=ret.convert, mapping=ret.mapping)

    def _emit(self, flow: Flow, template: Finding, val: Val, call_link: Link, callee: FunctionInfo) -> None:
        if val.reported:
            return
        if val.maybe and template.code == "OWN120":
            return  # the helper writes in place into what is the file's tensor on some paths only: not certain
        if flow.report_built(val):  # an object its constructor made keep the tensor: that store is the finding
            return
        key = (template.line, template.col - 1, template.code)
        if template.path != flow.path:  # (a line of another file: keyed by the file too)
            key = key + (template.path,)  # type: ignore[assignment]
        if key in flow.seen:
            return
        finding = self._finding(flow, template, val, call_link, callee)
        flow.seen[key] = finding
        flow.out.findings.append(finding)

    def _finding(self, flow: Flow, template: Finding, val: Val, call_link: Link, callee: FunctionInfo) -> Finding:
        """A callee's finding as this call reaches it: the caller's chain, the call, then the callee's own."""
        head = val.chain + (call_link,)
        if flow.path != template.path:  # the caller's links are in its own file: say which
            head = tuple(link if link.path else replace(link, path=flow.path) for link in head)
        chain = head + template.chain[1:]
        pattern = template.pattern if "through helper" in template.pattern else \
            f"{template.pattern} (through helper `{callee.name}`)"
        return replace(template, chain=chain, consumer=val.consumer, consumer_path=flow.path, pattern=pattern,
                       also_from=[])

    def _into_param(self, flow: Flow, node: ast.Call, target: Callee, fact: IntoParam, arg_of: Dict[int, ast.AST],
                    val: Val, call_link: Link, callee: FunctionInfo) -> None:
        if target.constructor and fact.index == 0:
            return  # the new object holds it: the call's result is a holder (see resolve_result)
        if fact.free:
            slot = flow.state.slots.get(fact.free) if callee.parent is flow.info else None
            if slot is not None and slot.fresh and slot.param is None and val.step in slot.loops:
                # the enclosing function's own container, new in the step the tensor belongs to: it holds it for
                # the step (judged where it goes next, as a store of the enclosing function's own would be)
                name = ast.copy_location(ast.Name(id=fact.free, ctx=ast.Load()), node)
                flow.store_into(name, val.then(link=call_link), node, fact.how)
            else:  # (kept past the step: the nested function's statement keeps it, reported there)
                self._emit(flow, fact.template, val, call_link, callee)
            return
        expr = arg_of.get(fact.index)
        if expr is None:
            self._emit(flow, fact.template, val, call_link, callee)  # a default container: outlives the call
            return
        root = root_of(expr)
        place, index = flow.place(root.name)
        if place == "local" and root.name is not None:
            slot = flow.state.slots[root.name]
            if slot.fresh and val.step in slot.loops and not root.through_attribute and not fact.for_life:
                flow.state.env[root.name] = val.then(HOLDER, Link(node.lineno, flow.fn,
                                                                  f"stored in `{flow.snip(root.node)}` by `{callee.name}()`"))
                return
        if flow.summary_param is not None and place == "param" and index is not None and index != val.seed:
            before = len(flow.out.findings)
            self._emit(flow, fact.template, val, call_link, callee)
            if len(flow.out.findings) > before:
                flow.out.into_param.append(IntoParam(index, flow.out.findings.pop()))
            return
        self._emit(flow, fact.template, val, call_link, callee)


_PARTIAL_NAMES = frozenset({"partial", "functools.partial"})
_PLAIN_BASES = frozenset({"object", "builtins.object", "ABC", "abc.ABC"})


def _partial_bindings(fn: ast.AST) -> Dict[str, List[ast.Call]]:
    """The local names a function binds to ``partial(g, ...)`` of a named ``g`` (its own body, not
    its nested functions'), each with every such call (branches bind the same name to different ``g``)."""
    out: Dict[str, List[ast.Call]] = {}
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        todo.extend(ast.iter_child_nodes(node))
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        call = node.value
        name = call.func.id if isinstance(call.func, ast.Name) else (
            f"{call.func.value.id}.{call.func.attr}" if isinstance(call.func, ast.Attribute)
            and isinstance(call.func.value, ast.Name) else "")
        if name not in _PARTIAL_NAMES or not call.args or isinstance(call.args[0], ast.Starred) \
                or any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue
        if not isinstance(call.args[0], (ast.Name, ast.Attribute)):
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                out.setdefault(target.id, []).append(call)
    return out


def _calls_super(fn: ast.AST, name: str) -> bool:
    """Does ``fn`` call ``super().name(...)`` (so the overridden method, and the calls in it, still run)?"""
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
                and isinstance(n.func.value, ast.Call) and isinstance(n.func.value.func, ast.Name)
                and n.func.value.func.id == "super"):
            return True
    return False


def _is_dataclass(cls: ClassInfo) -> bool:
    for d in cls.node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or \
                (isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def constructor_result(outcome: Outcome) -> bool:
    return any(f.index == 0 for f in outcome.into_param)


__all__ = ["ModuleAnalysis", "Callee", "MAX_DEPTH"]

