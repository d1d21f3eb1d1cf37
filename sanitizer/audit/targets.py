"""What a store writes into: the root a container expression hangs from, whether a binding is a fresh
container (so it can live and die inside one step), and whether a subscript target is a tensor (a copy
into it) or a container (a retention of the value).

The distinction carries the audit's precision: ``param_data[:, :n] = w`` copies ``w`` into a parameter,
``pending[name] = w`` keeps ``w``; ``parts = []`` inside the loop dies with the step, ``parts = []``
before it does not.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.index import annotation_text, dotted

_CAMEL = re.compile(r"^_?[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")
_PEEL_METHODS = frozenset({"setdefault", "get", "__getitem__", "pop", "popleft"})


@dataclass(frozen=True)
class Root:
    """The name a stored-into expression hangs from: ``pending`` in ``pending[k].append``, ``self`` in
    ``self.cache[name]``; ``name`` is None when it hangs from a call's result or a literal."""

    name: Optional[str]
    through_attribute: bool  # an attribute lies between the root and the store (an object's container)
    node: ast.AST  # the stored-into expression (for messages)


def root_of(expr: ast.AST) -> Root:
    node = expr
    through_attr = False
    while True:
        if isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Attribute):
            through_attr = True
            node = node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in _PEEL_METHODS):
            node = node.func.value
        else:
            break
    name = node.id if isinstance(node, ast.Name) else None
    return Root(name, through_attr, expr)


def is_fresh_container(value: Optional[ast.AST]) -> bool:
    """Does ``value`` build a new container or object (that nothing else references yet)?"""
    if value is None:
        return False
    stack = [value]
    while stack:  # ``[None] * n * m``: either factor of a product (a loop: a generated product nests deep)
        value = stack.pop()
        if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
            stack += [value.right, value.left]
        elif _builds_container(value):
            return True
    return False


def is_empty_container(value: Optional[ast.AST]) -> bool:
    """Does ``value`` build a new container with nothing in it (``{}``, ``[]``, ``dict()``, ``defaultdict(list)``)?"""
    if isinstance(value, ast.Dict):
        return not value.keys
    if isinstance(value, (ast.List, ast.Set, ast.Tuple)):
        return not value.elts
    if isinstance(value, ast.Call) and not value.keywords:
        name = dotted(value.func)
        if name in ("defaultdict", "collections.defaultdict"):
            return len(value.args) <= 1  # (its one argument makes missing items, it puts none in)
        return name in V.CONTAINER_FACTORIES and not value.args and name not in ("copy.deepcopy", "deepcopy",
                                                                                "copy.copy")
    return False


def _builds_container(value: ast.AST) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.Tuple, ast.ListComp, ast.DictComp, ast.SetComp,
                          ast.Lambda)):
        return True
    if isinstance(value, ast.Call):
        name = dotted(value.func)
        if name in V.CONTAINER_FACTORIES:
            return True
        if isinstance(value.func, ast.Attribute) and value.func.attr == "state_dict" and not value.args:
            # torch.nn.Module.state_dict(): "Return a dictionary containing references to the whole state of
            # the module": a new dict each call (the module keeps none of it), so storing into it stores
            # into nothing the module holds (mistral-inference's LoRA merge, loaded back without assign)
            return True
        if isinstance(value.func, ast.Attribute) and value.func.attr == "copy" and not value.args \
                and not value.keywords:
            return True  # `processed = lora_dict.copy()`: a shallow copy is a new container, as `dict(lora_dict)` is
        last = name.rpartition(".")[2]
        return bool(_CAMEL.match(last)) and last not in ("Parameter", "Tensor")
    return False


def binding_kind(value: Optional[ast.AST]) -> str:
    """'container', 'tensor' or 'unknown': what an untainted local was bound to (for subscript stores)."""
    if value is None:
        return "unknown"
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return "container"
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult) and isinstance(value.left, ast.List):
        return "container"
    if isinstance(value, ast.Call):
        name = dotted(value.func)
        if name in V.CONTAINER_FACTORIES:
            return "container"
        if V.TENSOR_FACTORY.match(name) or name.startswith("torch.") or name in ("getattr",):
            return "tensor"
        if isinstance(value.func, ast.Attribute) and value.func.attr in V.ALIAS_METHODS | {"clone", "new_empty",
                                                                                          "new_zeros"}:
            return "tensor"
        return "unknown"
    if isinstance(value, ast.Attribute):
        return "tensor" if value.attr in V.ALIAS_ATTRIBUTES or V.TENSOR_ATTR_NAME.match(value.attr) else "unknown"
    if isinstance(value, ast.Subscript):  # ``w.T[0][1]``: a tensor's element is a tensor (once per level:
        while isinstance(value, ast.Subscript):  # asking twice a level took 2**n calls, 22 levels 11 s)
            value = value.value
        return "tensor" if binding_kind(value) == "tensor" else "unknown"
    return "unknown"


def _index_is_slicing(index: ast.AST) -> bool:
    if isinstance(index, ast.Slice) or (isinstance(index, ast.Constant) and index.value is Ellipsis):
        return True
    if isinstance(index, ast.Tuple):
        return any(_index_is_slicing(e) for e in index.elts) or len(index.elts) > 1
    return False


def _index_is_key(index: ast.AST) -> bool:
    """A string key (``d["w"]``, ``d[f"{p}.w"]``, ``d[name]``): a dict's, not a tensor's."""
    if isinstance(index, ast.Constant):
        return isinstance(index.value, str)
    if isinstance(index, ast.JoinedStr):
        return True
    if isinstance(index, ast.Name):
        return "name" in index.id or index.id in ("key", "k", "prefix")
    return False


def subscript_is_tensor(target: ast.Subscript, local_kind: Optional[str], param_annotation: str) -> bool:
    """Is ``target`` (``X[i] = v``) a write into a tensor (a copy) rather than into a container?"""
    index = target.slice
    if _index_is_slicing(index) and not (isinstance(index, ast.Tuple) and not any(
            isinstance(e, ast.Slice) or (isinstance(e, ast.Constant) and e.value is Ellipsis) for e in index.elts)):
        return True
    if isinstance(index, ast.Tuple) and local_kind != "container" and not (
            param_annotation and V.MAPPING_ANNOTATION.match(param_annotation)):
        # `w[i, j] = v`: a tensor's element unless `w` is known a container, whose key the tuple is
        # (`results[(path, name)] = t` into `results = {}`, a merger's table by model and tensor: a blind user's case)
        value = target.value
        return not (isinstance(value, ast.Name) and local_kind is None and not V.TENSOR_NAME.match(value.id)
                    or isinstance(value, ast.Attribute) and not V.TENSOR_ATTR_NAME.match(value.attr)) \
            or local_kind == "tensor"
    node: ast.AST = target.value
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute) and node.attr == "data":
            return True
        node = node.value
    if _index_is_key(target.slice):
        return False
    if local_kind in ("tensor", "container"):
        return local_kind == "tensor"
    if param_annotation:
        if V.MAPPING_ANNOTATION.match(param_annotation):
            return False
        if V.TENSOR_ANNOTATION.search(param_annotation):
            return True
    value = target.value
    if isinstance(value, ast.Name):
        return bool(V.TENSOR_NAME.match(value.id))
    if isinstance(value, ast.Attribute):
        return bool(V.TENSOR_ATTR_NAME.match(value.attr))
    return False


def method_base_is_tensor(base: ast.AST, local_kind: Optional[str], param_annotation: str) -> bool:
    """``X.add(v)`` / ``X.put(...)``: a tensor method (arithmetic, an indexed write) rather than a container's?"""
    if local_kind in ("tensor", "container"):
        return local_kind == "tensor"
    if param_annotation:
        return bool(V.TENSOR_ANNOTATION.search(param_annotation)) and not V.ITER_ANNOTATION.search(param_annotation)
    if isinstance(base, ast.Attribute) and base.attr == "data":
        return True
    if isinstance(base, ast.Name):
        return bool(V.TENSOR_NAME.match(base.id)) and base.id not in ("buf",)
    return False


def peel_target(target: ast.AST) -> Tuple[str, ast.AST]:
    """('name'|'attribute'|'subscript'|'other', node) for an assignment target."""
    if isinstance(target, ast.Name):
        return "name", target
    if isinstance(target, ast.Attribute):
        return "attribute", target
    if isinstance(target, ast.Subscript):
        return "subscript", target
    return "other", target


def constructed_locals(fn: ast.AST) -> Dict[str, str]:
    """The local names a function binds (in its own body, not its nested functions') to a new object of a
    named class, ``name = Cls(...)`` or ``with Cls(...) as name``, each bound once only (a name rebound to
    anything else is left out: its class is not known for all its uses)."""
    bound: Dict[str, Optional[str]] = {}

    def note(name: str, value: Optional[ast.AST]) -> None:
        cls = value.func.id if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
            and value.func.id[:1].isupper() else None
        bound[name] = cls if name not in bound else None

    # statements only (a binding is a statement's; the walk into expressions was a fifth of a large audit)
    stack = list(getattr(fn, "body", []))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    note(target.id, node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            note(node.target.id, getattr(node, "value", None) if isinstance(node, ast.AnnAssign) else None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if isinstance(item.optional_vars, ast.Name):
                    note(item.optional_vars.id, item.context_expr)
        elif isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name):
            note(node.target.id, None)
        for block in _BLOCKS:
            stack.extend(getattr(node, block, ()))
        for handler in getattr(node, "handlers", ()):
            stack.extend(handler.body)
        for case in getattr(node, "cases", ()):
            stack.extend(case.body)
    return {name: cls for name, cls in bound.items() if cls is not None}


_BLOCKS = ("body", "orelse", "finalbody")


def attribute_classes(cls: "object", attr: str) -> List[str]:
    """The classes ``self.<attr>`` of class ``cls`` (a :class:`~.index.ClassInfo`) is stated to hold, in any
    of its methods: ``self.attr = param`` with the parameter annotated (``loader: SafetensorsLoader``, an
    object handed in: dependency injection), ``self.attr: Cls = ...``, or ``self.attr = Cls(...)``. Read once
    per class and attribute, kept on the class's record."""
    cache = cls.__dict__.setdefault("_attribute_classes", {})  # type: ignore[attr-defined]
    got = cache.get(attr)
    if got is not None:
        return got
    found: List[str] = []
    for method in getattr(cls, "methods", {}).values():
        fn = method.node
        args = fn.args  # type: ignore[attr-defined]
        params = {a.arg: a.annotation for a in list(args.posonlyargs) + list(args.args) + list(args.kwonlyargs)}
        me = next(iter(params), "self")
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                target, value, ann = sub.targets[0], sub.value, None
            elif isinstance(sub, ast.AnnAssign):
                target, value, ann = sub.target, sub.value, sub.annotation
            else:
                continue
            if not (isinstance(target, ast.Attribute) and target.attr == attr and isinstance(target.value, ast.Name)
                    and target.value.id == me):
                continue
            text = annotation_text(ann) if ann is not None else ""
            if not text and isinstance(value, ast.Name) and params.get(value.id) is not None:
                text = annotation_text(params[value.id])
            if not text and isinstance(value, ast.Call):
                name = dotted(value.func).rpartition(".")[2]
                text = name if name[:1].isupper() else ""
            for word in V.ANNOTATED_CLASS.findall(text):
                short = word.rpartition(".")[2]
                if short not in found:
                    found.append(short)
    cache[attr] = found
    return found


def constructed_when(fn: ast.AST, name: str, line: int) -> Optional[str]:
    """The class of the new object ``name`` holds at ``line``: the last binding of ``name`` before that line in
    the function's own body is ``name = Cls(...)`` (or ``with Cls(...) as name``). A later rebinding does not
    matter to a call made before it (InvokeAI's loaders build a module, install a file's tensors in it with
    ``load_state_dict(sd, assign=True)``, then rebind it to a cast copy). Source order, not paths: a binding in
    a branch counts as the last one when it comes last."""
    last: Optional[Tuple[int, Optional[ast.AST]]] = None

    def note(at: int, value: Optional[ast.AST]) -> None:
        nonlocal last
        if at < line and (last is None or at >= last[0]):
            last = (at, value)

    stack = list(getattr(fn, "body", []))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            note(node.lineno, node.value)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name) \
                and node.target.id == name:
            note(node.lineno, getattr(node, "value", None) if isinstance(node, ast.AnnAssign) else None)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if isinstance(item.optional_vars, ast.Name) and item.optional_vars.id == name:
                    note(node.lineno, item.context_expr)
        elif isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name) and node.target.id == name:
            note(node.lineno, None)
        stack.extend(ast.iter_child_nodes(node))
    if last is None:
        return None
    value = last[1]
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id[:1].isupper():
        return value.func.id
    return None


def _blocks_of(fn: ast.AST, owners: Optional[Dict[int, ast.AST]] = None) -> Dict[int, Tuple[list, int]]:
    """Every statement of ``fn`` (nested functions and classes excluded), by id: the statement list it is in
    and its place there; and, in ``owners``, each statement list's statement (by the list's id: an ``except``
    clause's is its ``try``)."""
    where: Dict[int, Tuple[list, int]] = {}
    stack: List[Tuple[ast.AST, Optional[ast.AST]]] = [(fn, None)]
    while stack:
        node, owner = stack.pop()
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                if owners is not None:
                    owners[id(block)] = owner if owner is not None else node
                for i, stmt in enumerate(block):
                    if isinstance(stmt, ast.stmt):
                        where[id(stmt)] = (block, i)
                        if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                            stack.append((stmt, None))
        for handler in getattr(node, "handlers", ()) or ():
            stack.append((handler, node))
        for case in getattr(node, "cases", ()) or ():
            stack.append((case, node))
    return where


def _shape(node: ast.AST) -> str:
    """``node`` as text, whatever its context (a store, a load or a ``del`` of the same attribute compare equal)."""
    return ast.dump(node, annotate_fields=False, include_attributes=False).replace("Store()", "").replace(
        "Del()", "").replace("Load()", "")


_LEAVES = (ast.Return, ast.Raise, ast.Yield, ast.YieldFrom, ast.Await, ast.Break, ast.Continue)


def rebound_before_leaving(fn: ast.AST, memo: Dict[int, Dict[int, Tuple[list, int]]], stmt: ast.AST,
                           target: ast.Attribute) -> bool:
    """Is the attribute ``target`` that ``stmt`` stores into bound again (or deleted) by a later statement
    of the same block, which every path from ``stmt`` reaches (nothing between leaves the block: no
    return, raise, yield, break or continue)? Then what ``stmt`` stored is not what the object keeps: it is
    replaced before the step ends (LightX2V's quantizing loaders: ``self.weight = w.to(torch.float32)``, then
    ``self.weight, self.scale = quantize(self.weight)``), and the later store is judged on its own."""
    where = memo.get(id(fn))
    owners = memo.get(-id(fn))
    if where is None or owners is None:
        owners = {}
        where = memo[id(fn)] = _blocks_of(fn, owners)
        memo[-id(fn)] = owners  # type: ignore[assignment]
    found = where.get(id(stmt))
    key = _shape(target)
    while found is not None:
        block, index = found
        for later in block[index + 1:]:
            if isinstance(later, (ast.Assign, ast.Delete)):
                targets = list(later.targets)
            elif isinstance(later, ast.AnnAssign) and later.value is not None:
                targets = [later.target]
            else:
                targets = []  # (an augmented assignment writes into what is there: no rebinding)
            while targets:
                t = targets.pop()
                if isinstance(t, (ast.Tuple, ast.List)):
                    targets.extend(t.elts)
                elif isinstance(t, ast.Attribute) and _shape(t) == key:
                    return True
            if any(isinstance(n, _LEAVES) for n in ast.walk(later)):
                return False
        # the block ends: go on after the `if`/`with`/`try` it belongs to (LightX2V's `_apply_weights` stores
        # `self.original_weight_dict` under an `if` and deletes it at the function's end); not past a loop,
        # whose next iteration runs its earlier statements first
        owner = owners.get(id(block))  # type: ignore[union-attr]
        if not isinstance(owner, (ast.If, ast.With, ast.AsyncWith, ast.Try)):
            return False
        found = where.get(id(owner))
    return False


__all__ = ["Root", "root_of", "is_fresh_container", "constructed_locals", "constructed_when", "binding_kind", "subscript_is_tensor",
           "method_base_is_tensor", "peel_target", "rebound_before_leaving"]
