"""One parsed module, indexed for the flow: every function with its qualified name (the same
``__qualname__`` Python gives it, so a finding names the function a runtime report names), its
parameters and local names, the classes with their methods and same-module bases, and the module's
global names. Nothing here evaluates code."""
from __future__ import annotations

import ast
import re
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

FunctionNode = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(eq=False)
class FunctionInfo:
    node: ast.AST  # FunctionDef / AsyncFunctionDef
    qualname: str
    cls_ref: Optional["weakref.ref"]  # the class it is a method of (directly)
    parent_ref: Optional["weakref.ref"]  # the function it is nested in
    params: List[ast.arg]
    vararg: Optional[ast.arg]
    kwarg: Optional[ast.arg]
    nested: Dict[str, "FunctionInfo"] = field(default_factory=dict)
    is_static: bool = False
    _scan: Optional["_Scan"] = None

    # What the body binds, declares and calls: scanned on first use, since most functions of a large
    # tree are never looked at (the audit's time goes to parsing, not to functions it skips).
    @property
    def locals(self) -> Set[str]:
        return self.scan.locals

    _declared: Optional[Tuple[Set[str], Set[str]]] = None

    @property
    def declared_global(self) -> Set[str]:
        return self.declared[0]

    @property
    def declared_nonlocal(self) -> Set[str]:
        return self.declared[1]

    @property
    def declared(self) -> Tuple[Set[str], Set[str]]:
        """(global, nonlocal) names: statements only, so much cheaper than the full scan."""
        if self._declared is None:
            g: Set[str] = set()
            n: Set[str] = set()
            for stmt in _statements(self.node.body):  # type: ignore[attr-defined]
                if isinstance(stmt, ast.Global):
                    g.update(stmt.names)
                elif isinstance(stmt, ast.Nonlocal):
                    n.update(stmt.names)
            self._declared = (g, n)
        return self._declared

    @property
    def is_generator(self) -> bool:
        return self.scan.is_generator

    @property
    def calls(self) -> Set[str]:
        """Dotted names of every call in its own body (discovery of producers)."""
        return self.scan.calls

    @property
    def function_aliases(self) -> Dict[str, List[ast.expr]]:
        """Locals bound, once, to a function named in the body or to a conditional choice of such names
        (``load_func = load_safetensor_shard if st else load_torch_shard``) and then called: MLC LLM picks its
        shard reader so. ``load_func(path)`` calls one of them; the audit follows each. Statements only (as
        :attr:`declared`), so asking costs no full scan of a function the flow would not scan."""
        if self._aliases is None:
            self._aliases = _function_aliases(self.node.body)  # type: ignore[attr-defined]
        return self._aliases

    _aliases: Optional[Dict[str, List[ast.expr]]] = None

    @property
    def scan(self) -> "_Scan":
        if self._scan is None:
            self._scan = _scan_function(self.node)
        return self._scan

    # Weak links upward, so that an index (and the tree it points into) is freed by reference counting
    # alone as soon as its file is done: the audit runs with the cyclic collector paused.
    @property
    def cls(self) -> Optional["ClassInfo"]:
        return self.cls_ref() if self.cls_ref is not None else None

    @property
    def parent(self) -> Optional["FunctionInfo"]:
        return self.parent_ref() if self.parent_ref is not None else None

    @property
    def enclosing_class(self) -> Optional["ClassInfo"]:
        """The class this function is a method of, or the nearest one around the functions it is nested in
        (a closure in a method sees ``self`` of that class)."""
        cur: Optional[FunctionInfo] = self
        while cur is not None:
            if cur.cls is not None:
                return cur.cls
            cur = cur.parent
        return None

    @property
    def name(self) -> str:
        return self.node.name  # type: ignore[attr-defined]

    @property
    def is_method(self) -> bool:
        return self.cls is not None and not self.is_static


@dataclass(eq=False)
class ClassInfo:
    node: ast.ClassDef
    qualname: str
    methods: Dict[str, FunctionInfo] = field(default_factory=dict)
    bases: List[str] = field(default_factory=list)
    attributes: Set[str] = field(default_factory=set)  # names bound in the class body


@dataclass(eq=False)
class ModuleIndex:
    path: str
    tree: ast.Module
    functions: List[FunctionInfo] = field(default_factory=list)
    top_functions: Dict[str, FunctionInfo] = field(default_factory=dict)
    classes: Dict[str, ClassInfo] = field(default_factory=dict)
    globals: Set[str] = field(default_factory=set)
    by_node: Dict[int, FunctionInfo] = field(default_factory=dict)
    # ``from X import a as b`` at module level: b -> (X, level, a), for calls into other audited modules
    imports: Dict[str, Tuple[str, int, str]] = field(default_factory=dict)
    star_imports: List[Tuple[str, int]] = field(default_factory=list)  # `from m import *`: (module, level)
    module_aliases: Set[str] = field(default_factory=set)  # ``import torch``, ``import numpy as np``
    module_paths: Dict[str, str] = field(default_factory=dict)  # ``import pkg.mod as m``: m -> pkg.mod
    all_classes: List[ClassInfo] = field(default_factory=list)  # nested and local ones too

    def method(self, cls: ClassInfo, name: str, _seen: Optional[Set[str]] = None) -> Optional[FunctionInfo]:
        """``cls.name`` resolved through the class and its same-module bases (first match, MRO-ish)."""
        if name in cls.methods:
            return cls.methods[name]
        seen = _seen if _seen is not None else set()
        seen.add(cls.qualname)
        for base in cls.bases:
            other = self.classes.get(base.rpartition(".")[2])
            if other is not None and other.qualname not in seen:
                found = self.method(other, name, seen)
                if found is not None:
                    return found
        return None


def dotted(node: ast.AST) -> str:
    """``a.b.c`` for a Name/Attribute chain; ``a.b(...).c`` keeps only the last attribute ('' if none)."""
    parts: List[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    elif parts:
        parts.append("?")
    return ".".join(reversed(parts))


def annotation_text(node: Optional[ast.AST]) -> str:
    """``Iterable[tuple[str, torch.Tensor]]`` for an annotation node: the common shapes by hand, since
    ``ast.unparse`` costs more than the rest of discovery (every parameter of every function has one).
    Written out with a stack, not by recursion: a generated ``a | b | ...`` of thousands of terms (which
    Python compiles) is as deep as it is long."""
    out: List[str] = []
    stack: List[object] = [node]
    while stack:
        item = stack.pop()
        if item is None:
            continue
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, ast.Name):
            out.append(item.id)
        elif isinstance(item, ast.Attribute):
            stack += ["." + item.attr, item.value]
        elif isinstance(item, ast.Subscript):
            stack += ["]", item.slice, "[", item.value]
        elif isinstance(item, (ast.Tuple, ast.List)):
            parts: List[object] = ["["] if isinstance(item, ast.List) else []
            for i, elt in enumerate(item.elts):
                parts += [", ", elt] if i else [elt]
            parts += ["]"] if isinstance(item, ast.List) else []
            stack += reversed(parts)
        elif isinstance(item, ast.Constant):
            out.append(item.value if isinstance(item.value, str) else repr(item.value))
        elif isinstance(item, ast.BinOp) and isinstance(item.op, ast.BitOr):
            stack += [item.right, " | ", item.left]
        else:
            out.append(_unparsed(item))  # type: ignore[arg-type]
    return "".join(out)


def _unparsed(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except RecursionError:  # an odd deep annotation (a call chain) reads as no known type, never a crash
        return type(node).__name__


def _bound_names(target: ast.AST) -> Iterator[str]:
    for node in ast.walk(target):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            yield node.id


def _own_scope(body: List[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of a function body that belongs to its own scope (not nested functions/classes/lambdas,
    nor comprehensions, whose targets are their own)."""
    stack: List[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, FunctionNode + (ast.ClassDef, ast.Lambda)):
            continue
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            children = [g.iter for g in node.generators]  # the first iterable is evaluated outside
        stack.extend(reversed(children))


@dataclass(eq=False)
class _Scan:
    locals: Set[str] = field(default_factory=set)  # names bound in its own scope
    declared_global: Set[str] = field(default_factory=set)
    declared_nonlocal: Set[str] = field(default_factory=set)
    is_generator: bool = False
    calls: Set[str] = field(default_factory=set)


def _scan_function(node: ast.AST) -> _Scan:
    info = _Scan()
    args = node.args  # type: ignore[attr-defined]
    for a in args.posonlyargs + args.args + args.kwonlyargs + [x for x in (args.vararg, args.kwarg) if x]:
        info.locals.add(a.arg)
    for sub in _own_scope(node.body):  # type: ignore[attr-defined]
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            info.locals.add(sub.id)
        elif isinstance(sub, FunctionNode + (ast.ClassDef,)):
            info.locals.add(sub.name)  # type: ignore[attr-defined]
        elif isinstance(sub, (ast.Import, ast.ImportFrom)):
            for alias in sub.names:
                info.locals.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(sub, ast.Global):
            info.declared_global.update(sub.names)
        elif isinstance(sub, ast.Nonlocal):
            info.declared_nonlocal.update(sub.names)
        elif isinstance(sub, (ast.Yield, ast.YieldFrom)):
            info.is_generator = True
        elif isinstance(sub, ast.Call):
            name = dotted(sub.func)
            if name:
                info.calls.add(name)
        elif isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name):
            info.locals.add(sub.target.id)
        if isinstance(sub, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            # the calls a comprehension makes run in this function's walk too (`[stack.enter_context(
            # safe_open(p)) for p in paths]`): called here, though its names are its own
            inner = [sub.key, sub.value] if isinstance(sub, ast.DictComp) else [sub.elt]
            inner += [g.iter for g in sub.generators[1:]] + [c for g in sub.generators for c in g.ifs]
            for part in inner:
                for call in ast.walk(part):
                    if isinstance(call, ast.Call):
                        name = dotted(call.func)
                        if name:
                            info.calls.add(name)
    info.locals -= info.declared_global | info.declared_nonlocal
    for n, alts in _function_aliases(node.body).items():  # type: ignore[attr-defined]
        if n in info.calls:  # `load_func(path)`: a call of each function it may be, for discovery too
            info.calls.update(dotted(a) for a in alts)
    return info


def _function_aliases(body: List[ast.stmt]) -> Dict[str, List[ast.expr]]:
    """Names bound once in the function's own statements, to a function's name or a conditional choice of
    names (``load_func = a if c else b``): what a call of the name may call. A name bound again (by another
    assignment, a loop, a ``with``, ``+=``) is none."""
    choices: Dict[str, List[ast.expr]] = {}
    binds: Dict[str, int] = {}
    for stmt in _statements(body):
        if isinstance(stmt, ast.Assign):
            targets: List[ast.AST] = list(stmt.targets)
            if len(targets) == 1 and type(targets[0]) is ast.Name:
                alts = _function_choices(stmt.value)
                if alts:
                    choices[targets[0].id] = alts  # type: ignore[attr-defined]
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
            targets = [stmt.target]
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            targets = [i.optional_vars for i in stmt.items if i.optional_vars is not None]
        elif isinstance(stmt, FunctionNode + (ast.ClassDef,)):
            binds[stmt.name] = binds.get(stmt.name, 0) + 2  # type: ignore[attr-defined]
            continue
        else:
            continue
        for t in targets:
            for n in _bound_names(t):
                binds[n] = binds.get(n, 0) + 1
    return {n: alts for n, alts in choices.items() if binds.get(n) == 1}


def _function_choices(value: ast.expr) -> List[ast.expr]:
    """``a if c else b`` (nested), of names or dotted names: the functions it chooses between ([] otherwise)."""
    if isinstance(value, ast.IfExp):
        body, orelse = _function_choices(value.body), _function_choices(value.orelse)
        return body + orelse if body and orelse else []
    if isinstance(value, (ast.Name, ast.Attribute)) and dotted(value) and not (
            isinstance(value, ast.Name) and value.id in ("None", "True", "False")):
        return [value]
    return []


def build_index(path: str, tree: ast.Module, text: Optional[str] = None) -> ModuleIndex:
    """The module's functions, classes and imports (``text``, its source, spares a walk: see
    :func:`_canonical_loader_calls`)."""
    index = ModuleIndex(path, tree)
    for stmt in tree.body:
        if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                index.globals.update(_bound_names(t))
        elif isinstance(stmt, FunctionNode + (ast.ClassDef,)):
            index.globals.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            for alias in stmt.names:
                index.globals.add((alias.asname or alias.name).split(".")[0])
                if isinstance(stmt, ast.Import):
                    index.module_aliases.add((alias.asname or alias.name).split(".")[0])
                    if alias.asname:
                        index.module_paths[alias.asname] = alias.name
                if isinstance(stmt, ast.ImportFrom) and alias.name != "*":
                    index.imports[alias.asname or alias.name] = (stmt.module or "", stmt.level, alias.name)
                elif isinstance(stmt, ast.ImportFrom):
                    index.star_imports.append((stmt.module or "", stmt.level))

    _canonical_loader_calls(index, tree, text)
    _visit(index, tree.body, "", None, None)
    return index


LOADER_PACKAGES = ("safetensors", "fastsafetensors", "runai_model_streamer", "instanttensor", "torch")
_LOADER_PACKAGES = LOADER_PACKAGES
# packages whose loaders (vocabulary.LIBRARY_DICT_LOADERS) an engine may import inside a function
_LIBRARY_PACKAGES = ("comfy", "peft", "diffusers", "transformers", "accelerate", "huggingface_hub", "timm",
                     "modules", "backend")  # (AUTOMATIC1111's web UI, Forge's: what their extensions import)


# an import from a loader's package indented under a `def` (or a class, an `if`): the only text that asks for
# the walk over functions below
_LOCAL_LOADER_IMPORT = re.compile(r"^[ \t]+from[ \t]+(" + "|".join(_LOADER_PACKAGES + _LIBRARY_PACKAGES) + r")\b",
                                  re.M)


# `self._safe_open = safe_open`: a loader's API kept on the object, called later as `self._safe_open(path)`
_ATTR_LOADER = re.compile(r"^[ \t]+self\.\w+[ \t]*=[ \t]*[\w.]*(safe_open|load_file|SafeTensorsFileLoader)[ \t]*$", re.M)


def _loader_attributes(tree: ast.Module, is_api: "Callable[[str], bool]") -> None:
    """``self._safe_open = safe_open`` in a method (onnxruntime-genai's ModeloptModel keeps the function it
    imported inside ``__init__``), then ``self._safe_open(path)`` in another: each such call of the class is
    renamed to the API it holds, as an import alias is (below)."""
    classes = [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    held_by: Dict[str, Dict[str, str]] = {}
    for cls in classes:
        held: Dict[str, str] = {}
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, (ast.Name, ast.Attribute)):
                target = node.targets[0]
                api = dotted(node.value)
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self" and api and is_api(api):
                    held[target.attr] = api
        held_by[cls.name] = held
    for _ in range(len(classes)):  # what a base of this module keeps on `self`, its subclasses' `self` has too
        grew = False
        for cls in classes:
            for base in cls.bases:
                for attr, api in held_by.get(dotted(base).rpartition(".")[2], {}).items():
                    if attr not in held_by[cls.name]:
                        held_by[cls.name][attr] = api
                        grew = True
        if not grew:
            break
    for cls in classes:
        held = held_by[cls.name]
        if not held:
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in held \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
                node.func = ast.copy_location(ast.Name(id=held[node.func.attr], ctx=ast.Load()), node.func)


def _canonical_loader_calls(index: ModuleIndex, tree: ast.Module, text: Optional[str] = None) -> None:
    """``from safetensors.torch import load_file as load_safetensors`` (LitGPT): a call to the alias is
    the loader's API, so it is renamed to it in the tree (the call's function only; snippets read the
    source text, so a finding still shows what was written). One walk, only for a module with such an
    alias; and one more for a module that imports from a loader's package inside a function."""
    from sanitizer.audit import vocabulary as V  # the words only; it imports nothing of the audit's

    def loader_api(module: str, level: int, original: str) -> str:
        full = f"{module}.{original}"
        if not level and V.library_loader(full):
            return full  # `from comfy.utils import load_torch_file`: a library's loader, by its full path
        if level or not module.split(".")[0] in _LOADER_PACKAGES:
            return ""
        hit = V.SOURCE_FACTORIES.search(full) or V.ITERATOR_FACTORY.search(full) or V.loader_call_kind(full, None)
        return full if hit else ""

    def loader_api_name(name: str) -> bool:
        return bool(V.SOURCE_FACTORIES.search(name) or V.loader_call_kind(name, None))

    renamed = {}
    for alias, (module, level, original) in index.imports.items():
        if (alias != original or V.library_loader(f"{module}.{original}")) and loader_api(module, level, original):
            renamed[alias] = f"{module}.{original}"
    for stmt in tree.body:  # `load_layer_model_state_dict = load_torch_file` at module level (ComfyUI-layerdiffuse)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and isinstance(stmt.value, ast.Name) and stmt.value.id in index.imports:
            module, level, original = index.imports[stmt.value.id]
            full = loader_api(module, level, original)
            if full:
                renamed[stmt.targets[0].id] = full
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and isinstance(stmt.value, ast.Attribute) and dotted(stmt.value).split(".")[0] in index.module_aliases:
            # `read_any = stt.load_file` after `import safetensors.torch as stt`
            head, _, rest = dotted(stmt.value).partition(".")
            module, _, original = f"{index.module_paths.get(head, head)}.{rest}".rpartition(".")
            full = loader_api(module, 0, original)
            if full:
                renamed[stmt.targets[0].id] = full
    # `from modules import sd_models` (an A1111 extension), then `sd_models.read_state_dict(path)`: a library's
    # loader called through its module imported by name
    through_module = {alias: f"{module}.{original}" for alias, (module, level, original) in index.imports.items()
                      if not level and module.split(".")[0] in _LIBRARY_PACKAGES}
    through_module.update((alias, path) for alias, path in index.module_paths.items()
                          if path.split(".")[0] in _LIBRARY_PACKAGES)
    if renamed or through_module:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in renamed:
                node.func.id = renamed[node.func.id]
            elif through_module and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and type(node.func.value) is ast.Name and node.func.value.id in through_module \
                    and V.library_loader(f"{through_module[node.func.value.id]}.{node.func.attr}"):
                node.func = ast.copy_location(ast.Name(id=f"{through_module[node.func.value.id]}.{node.func.attr}",
                                                       ctx=ast.Load()), node.func)
    if text is None or _ATTR_LOADER.search(text):
        _loader_attributes(tree, loader_api_name)
    # the same import made inside a function (`from safetensors.torch import load as st_load` in FastVideo's
    # `_safetensors_bytes_to_tensor`; a bare `load` there is safetensors', not json's): renamed in that function
    if text is not None and not _LOCAL_LOADER_IMPORT.search(text):
        return
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        local = {}
        for stmt in ast.walk(function):
            if isinstance(stmt, ast.ImportFrom) and stmt.module:
                for alias in stmt.names:
                    full = loader_api(stmt.module, stmt.level, alias.name)
                    if full:
                        local[alias.asname or alias.name] = full
        if local:
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in local:
                    node.func.id = local[node.func.id]


def _visit(index: ModuleIndex, body: List[ast.stmt], prefix: str, cls: Optional[ClassInfo],
           parent: Optional[FunctionInfo]) -> None:
    """Index the functions and classes of one block (a module-level function, not a closure: a recursive
    closure is a reference cycle, and the audit runs with the cyclic collector paused)."""
    for stmt in _statements(body):
        if isinstance(stmt, FunctionNode):
            args = stmt.args
            decorators = {dotted(d) for d in stmt.decorator_list}
            info = FunctionInfo(stmt, prefix + stmt.name, weakref.ref(cls) if cls is not None else None,
                                weakref.ref(parent) if parent is not None else None,
                                params=args.posonlyargs + args.args + args.kwonlyargs,
                                vararg=args.vararg, kwarg=args.kwarg,
                                is_static="staticmethod" in decorators)
            index.functions.append(info)
            index.by_node[id(stmt)] = info
            if cls is not None and parent is None:
                cls.methods.setdefault(stmt.name, info)
            elif parent is not None:
                parent.nested[stmt.name] = info
            elif cls is None:
                index.top_functions[stmt.name] = info
            _visit(index, stmt.body, info.qualname + ".<locals>.", None, info)
        elif isinstance(stmt, ast.ClassDef):
            c = ClassInfo(stmt, prefix + stmt.name, bases=[dotted(b) for b in stmt.bases])
            index.all_classes.append(c)  # the strong reference (methods point to their class weakly)
            for sub in stmt.body:
                if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                    for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                        c.attributes.update(_bound_names(t))
            if parent is None and cls is None:
                index.classes.setdefault(stmt.name, c)
            _visit(index, stmt.body, c.qualname + ".", c, None)


def _statements(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a block, looking inside if/try/with/for/while (a def under ``if TYPE_CHECKING``
    or in a try is still a definition of this scope), but not inside nested defs or classes."""
    stack = list(reversed(body))
    while stack:
        stmt = stack.pop()
        yield stmt
        if isinstance(stmt, FunctionNode + (ast.ClassDef,)):
            continue
        inner: List[ast.stmt] = []
        for name in ("body", "orelse", "finalbody"):
            inner.extend(getattr(stmt, name, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            inner.extend(handler.body)
        for case in getattr(stmt, "cases", []) or []:
            inner.extend(case.body)
        stack.extend(reversed(inner))


def param_defaults(info: "FunctionInfo") -> Dict[str, ast.expr]:
    """Every parameter of ``info`` that has a default, by name, with its default expression."""
    args = getattr(info.node, "args", None)
    if args is None:
        return {}
    positional = list(args.posonlyargs) + list(args.args)
    out = {a.arg: d for a, d in zip(positional[len(positional) - len(args.defaults):], args.defaults)}
    out.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    return out


def param_default(info: "FunctionInfo", name: str) -> Optional[ast.expr]:
    """The default of parameter ``name`` of ``info`` when it names a function (``convert=to_default``):
    what a call through the parameter runs unless the caller passes another (None otherwise)."""
    default = param_defaults(info).get(name)
    if isinstance(default, (ast.Name, ast.Attribute)) and not (
            isinstance(default, ast.Name) and default.id in ("None", "True", "False")):
        return default
    return None


__all__ = ["FunctionInfo", "ClassInfo", "ModuleIndex", "build_index", "dotted", "annotation_text", "FunctionNode",
           "param_default"]
