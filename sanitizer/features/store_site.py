"""Where a retained view was stored: the statement a fix must change, not where its holder is defined.

A holder names *who* keeps a view (``Model.weights[3]``, ``partial(apply).args[1]``,
``LayerReloadingInfo.loaded_weights[*][*].arguments['loaded_weight']``) and where that holder
lives (the ``class Model:`` line, ``def apply``). The fix belongs on the line that stored the view
there: ``self.weights.append(w)``, the call that built the partial, ``info.loaded_weights.append(...)``.

Found statically, from what the runtime already has: the holder's first step (the attribute, the
name, the partial's function) and the stack the lease was lent from (its code objects). The
storing statements are the ones that write into that attribute or name (``.append``, ``.extend``,
``.insert``, ``.add``, ``.update``, ``.setdefault``, an item or attribute assignment) or that build a
``partial`` of that function; the one chosen is in the innermost function on the lend stack that has
one (the consumer's loop body: the store follows the lend), the first after the line that was running
there; else the first one in the files of that stack and of the holder's class. Sources are parsed
once (``ast``), by file and modification time. Torch-free.
"""
from __future__ import annotations

import ast
import linecache
import os
import threading
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from sanitizer.core.sites import Site, is_internal_file, line_of, torch_dir

Target = Tuple[str, str]  # ("attr", name) | ("name", name) | ("partial", function name) | ("call", factory name)
# (a holder also asks for ("local", name): a running function's local, bound by a statement of that function;
# and ("param", name): a module's parameter or buffer, an attribute set by name as often as not)
Wanted = Tuple[str, str, bool]  # a target, and whether the view sits in a container below it
_MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "appendleft", "extendleft",
                       "put", "put_nowait", "__setitem__"})
_MAX_FILES = 256


class _Index:
    """The storing statements of one source file: (line, col, target, into a container?, function span,
    the shapes the stored value may take).

    "Into a container" is a mutation (``x.append(v)``, ``x[k] = v``) as opposed to binding the name
    itself (``x = v``, ``self.x = v``): a view kept in ``Model.weights[3]`` was stored by the former."""

    def __init__(self, tree: ast.AST):
        self.stores: List[Tuple[int, int, Target, bool, Tuple[int, int], FrozenSet[str]]] = []
        self._visit(tree, (0, 1 << 30))

    def _visit(self, node: ast.AST, span: Tuple[int, int]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                first = min([child.lineno] + [d.lineno for d in getattr(child, "decorator_list", ())])
                self._visit(child, (first, getattr(child, "end_lineno", None) or child.lineno))
                continue
            for target, into in _targets_of(child):
                self.stores.append((child.lineno, child.col_offset, target, into, span, _stored_shapes(child)))
            self._visit(child, span)


# -- what the stored expression does to the view ---------------------------------------
# Two statements that store into one container (``params[name] = w`` and ``params[name] = w[:8]``) are
# told apart by what the held tensor looks like against the lent view: the same view, a slice of it, its
# transpose, a reshape. The run knows the held tensor; the source says what each statement stores.
_TRANSPOSES = frozenset({"t", "transpose", "permute", "swapaxes", "swapdims", "movedim", "T", "mT", "H", "mH"})
_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "unsqueeze", "squeeze",
                       "expand", "expand_as"})
_SLICES = frozenset({"narrow", "select", "chunk", "split", "unbind", "tensor_split", "diagonal", "unfold"})
_SAME = frozenset({"detach", "detach_", "requires_grad_", "contiguous", "to", "cpu", "cuda", "float", "half",
                   "bfloat16", "data"})


def _shape_of(node: ast.AST) -> str:
    """``name`` (a variable: it may hold anything, most likely the view as lent), ``slice``, ``transpose``,
    ``reshape``, ``same`` (a call that returns the view itself when nothing is to be done) or ``unknown``."""
    if isinstance(node, ast.Starred):
        node = node.value
    if isinstance(node, ast.Name):
        return "name"
    if isinstance(node, ast.Subscript):
        sl = node.slice
        full = isinstance(sl, ast.Slice) and sl.lower is None and sl.upper is None and sl.step is None
        return "same" if full or (isinstance(sl, ast.Constant) and sl.value is Ellipsis) else "slice"
    attr = None
    if isinstance(node, ast.Attribute):
        attr = node.attr
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr = node.func.attr
    if attr is None:
        return "unknown"
    for kind, names in (("transpose", _TRANSPOSES), ("reshape", _RESHAPES), ("slice", _SLICES), ("same", _SAME)):
        if attr in names:
            return kind
    return "unknown"


def _stored_shapes(node: ast.AST) -> FrozenSet[str]:
    """The shapes of what ``node`` stores (every element of a tuple or list literal it stores)."""
    value: Optional[ast.AST] = None
    if isinstance(node, ast.Call):
        if node.args:
            value = node.args[-1]
        elif node.keywords:
            value = node.keywords[-1].value
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        value = node.value
    if value is None:
        return frozenset({"unknown"})
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)) and value.elts:
        return frozenset(_shape_of(e) for e in value.elts)
    if isinstance(value, ast.Dict) and value.values:
        return frozenset(_shape_of(v) for v in value.values)
    return frozenset({_shape_of(value)})


_SCORES = {  # (what the statement stores, what the holder holds) -> how well they agree
    ("name", "same"): 2, ("same", "same"): 2, ("slice", "slice"): 2, ("transpose", "transpose"): 2,
    ("reshape", "reshape"): 2,
    ("slice", "same"): 1, ("transpose", "same"): 1, ("reshape", "same"): 1,  # a full slice, a 1-D .t()
}


def _score(shapes: FrozenSet[str], held: Optional[str]) -> int:
    if held is None:
        return 1
    return max((1 if s in ("name", "unknown") else 0) if (s, held) not in _SCORES else _SCORES[(s, held)]
               for s in shapes)


def _base(node: ast.AST) -> Optional[Target]:
    """What ``node`` (the object written into) names: ``self.weights`` -> ("attr", "weights"), ``cache`` ->
    ("name", "cache"); through subscripts (``self.pending[name]`` stores into ``pending``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return ("attr", node.attr)
    if isinstance(node, ast.Name):
        return ("name", node.id)
    return None


_FACTORIES = frozenset({"ones", "zeros", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye",
                        "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "tensor"})
_WRAPPERS = frozenset({"Parameter", "Buffer", "UninitializedParameter"})


def _fresh_tensor(value: ast.AST) -> bool:
    """``torch.ones(n)``, ``nn.Parameter(torch.empty(...))``: a new tensor (a module's initialiser), which
    can hold no lent view."""
    if not isinstance(value, ast.Call):
        return False
    func = value.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name in _FACTORIES:
        return True
    return name in _WRAPPERS and bool(value.args) and _fresh_tensor(value.args[0])


def _holds_nothing(value: Optional[ast.AST]) -> bool:
    """A constant, an empty literal or a fresh tensor (what initialising an attribute looks like, never a
    kept view)."""
    if value is None or isinstance(value, ast.Constant) or _fresh_tensor(value):
        return True
    if isinstance(value, (ast.List, ast.Tuple, ast.Set)):
        return not value.elts
    if isinstance(value, ast.Dict):
        return not value.keys
    return False


def _targets_of(node: ast.AST) -> List[Tuple[Target, bool]]:
    out: List[Tuple[Target, bool]] = []
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
            base = _base(func.value)
            if base is not None:
                out.append((base, True))
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "setattr" and isinstance(func, ast.Name) and len(node.args) >= 3:
            attr = node.args[1]  # setattr(module, name, param): a parameter set by name
            out.append((("attr", attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str)
                         else "*"), False))
        if name == "load_state_dict" and any(k.arg == "assign" and isinstance(k.value, ast.Constant)
                                             and k.value.value is True for k in node.keywords):
            out.append((("attr", "*"), False))  # module.load_state_dict(sd, assign=True): parameters set by name
        if name in ("register_parameter", "register_buffer") and len(node.args) >= 2:
            attr = node.args[0]
            out.append((("attr", attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str)
                         else "*"), False))
        if name and (node.args or node.keywords):  # a call that may build a closure over its arguments
            out.append((("call", name), False))
        if name == "partial" and node.args:
            fn = node.args[0]
            fn_name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
            if fn_name:
                out.append((("partial", fn_name), False))
    elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        if isinstance(node, ast.AnnAssign) and node.value is None:
            return out  # a bare annotation stores nothing
        if _holds_nothing(node.value):
            return out  # ``self.x = None``, ``self.items = []``: a container made, no view stored
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for leaf in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                base = _base(leaf)
                if base is not None:
                    out.append((base, isinstance(leaf, ast.Subscript) or isinstance(node, ast.AugAssign)))
    return out


_lock = threading.Lock()
_cache: Dict[str, Tuple[float, Optional[_Index]]] = {}


def _index(path: str) -> Optional[_Index]:
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        mtime = -1.0
    with _lock:
        hit = _cache.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
    source = "".join(linecache.getlines(path))
    try:
        index: Optional[_Index] = _Index(ast.parse(source, path)) if source else None
    except (SyntaxError, ValueError, RecursionError):
        index = None
    with _lock:
        if len(_cache) >= _MAX_FILES:
            _cache.clear()
        _cache[path] = (mtime, index)
    return index


def _frame(path: str, line: int, function: str) -> dict:
    return {"file": path, "line": line, "function": function}


def stored_at(wanted: Optional[Wanted], lent_from: Site, holder_site: Optional[dict] = None,
              held: Optional[str] = None) -> Optional[dict]:
    """The frame record (``{"file", "line", "function"}``) of the statement that stored the view into
    ``wanted``'s target, or None when no such statement is found.

    ``held`` says what the holder holds against the view as lent (``same``, ``slice``, ``transpose``,
    ``reshape``: see :func:`held_shape`): of several statements that store into one container, the ones
    whose stored expression agrees with it. When more than one still fits, the record lists them all
    (``candidates``) and the first is only the likeliest, never a fact."""
    if wanted is None:
        return None
    key = (wanted, lent_from, (holder_site or {}).get("file"), held)
    try:
        hit = _found.get(key, _MISSING)
    except TypeError:  # an unhashable site: look it up each time
        hit, key = _MISSING, None
    if hit is _MISSING:
        hit = _stored_at(wanted, lent_from, holder_site, held)
        if key is not None:
            with _lock:
                if len(_found) >= 4096:
                    _found.clear()
                _found[key] = hit
    if hit is None:
        return None
    out = dict(hit)
    if "candidates" in out:
        out["candidates"] = [dict(c) for c in out["candidates"]]
    return out


_MISSING = object()
_found: Dict[tuple, Optional[dict]] = {}  # (wanted, lend site, holder file) -> its statement: a ring load asks the same


def _stored_at(wanted: Wanted, lent_from: Site, holder_site: Optional[dict], held: Optional[str]) -> Optional[dict]:
    target, into = (wanted[0], wanted[1]), wanted[2]
    within: Optional[Tuple[str, int]] = None
    if target[0] == "call":  # a closure, made by a call of its factory (given by its qualified name)
        if any(getattr(code, "co_qualname", code.co_name) == target[1] for code, _ in lent_from or ()):
            return None  # made inside the lending code itself: no call of it stored the view
        target = ("call", target[1].rsplit(".", 1)[-1])
    param = target[0] == "param"  # a module's parameter or buffer: set by name as often as by attribute
    if param:
        target = ("attr", target[1])
    elif target[0] == "local":  # a running function's local: only that function's statements bind it
        target = ("name", target[1])
        if holder_site and holder_site.get("file") and holder_site.get("line"):
            within = (holder_site["file"], int(holder_site["line"]))
    # The kind of store the path implies first (an append for a view inside a container, the binding for
    # one held by the name itself), then the other (a container literal bound with the view in it); an
    # attribute set by a name only known at run time (``setattr(module, name, param)``) last.
    kinds = [(True, False), (False, False)] + ([(False, True)] if target[0] == "attr" else [])
    frames = [(code, line_of(code, lasti)) for code, lasti in lent_from or () if not _plumbing(code.co_filename)]
    first = None
    for strict, by_name in kinds:  # the functions of the lending stack, innermost first
        found = _on_stack(("attr", "*") if by_name else target, into, strict, frames, held, within)
        if found is None:
            continue
        if not found.pop("_before", False):
            if found.get("candidates") and target[0] == "attr" and not by_name:  # not known which: the
                more = _on_stack(("attr", "*"), into, False, frames, held, within)  # by-name ones too
                if more is not None and not more.pop("_before", False):
                    seen = {c["line"] for c in found["candidates"]}
                    found["candidates"] += [c for c in more.get("candidates") or [dict(more)] if c["line"] not in seen]
            return found
        # Every such statement of the lending function comes before the lend: the view was stored by
        # another kind of statement after it, if there is one (load_state_dict(..., assign=True) after
        # setattr lines of other parameters).
        first = first or found
    if first is not None:
        return first
    # Else the files of that stack and the holder's, innermost first. A parameter: every kind of statement
    # in each file before the next (the loader's own ``setattr(module, name, param)`` before an unrelated
    # ``old.weight = new.weight`` in a file further out); any other attribute: its own name in every file
    # first (``info.loaded_weights.append(...)``), a store by a name known only at run time last.
    files = [within[0]] if within else _unique([code.co_filename for code, _ in frames]
                                               + [(holder_site or {}).get("file")])
    order = ([(path, kind) for path in files for kind in kinds] if param else
             [(path, kind) for kind in kinds for path in files])
    for path, (strict, by_name) in order:
        found = _in_file(path, ("attr", "*") if by_name else target, into, strict, within)
        if found is not None:
            return found
    return None


def _plumbing(path: str) -> bool:
    """Our files and torch's: a parameter is set by the caller's code, never by ``torch/nn/modules``."""
    tdir = torch_dir()
    return is_internal_file(path) or bool(tdir and path.startswith(tdir))


def _matches(target: Target, into: bool, strict: bool, t: Target, kind: bool) -> bool:
    return t == target and (not strict or kind == into or target[0] in ("partial", "call"))


def _inside(span: Tuple[int, int], within: Optional[Tuple[str, int]]) -> bool:
    """Is a statement of the function ``span`` a statement of the function holding ``within``'s line?"""
    return within is None or (span[0] != 0 and span[0] <= within[1] <= span[1])


def _on_stack(target: Target, into: bool, strict: bool, frames: List[Tuple[Any, int]], held: Optional[str],
              within: Optional[Tuple[str, int]]) -> Optional[dict]:
    """The innermost function on the lend stack that stores into the target, and which of its statements."""
    for code, line in frames:
        if within is not None and code.co_filename != within[0]:
            continue
        index = _index(code.co_filename)
        if index is None:
            continue
        first = 0 if code.co_name == "<module>" else code.co_firstlineno  # (module level: span 0)
        inside = [(ln, col, shapes) for ln, col, t, kind, span, shapes in index.stores
                  if _matches(target, into, strict, t, kind) and span[0] == first and _inside(span, within)]
        if inside:
            return _choose(inside, line, held, code.co_filename, getattr(code, "co_qualname", code.co_name))
    return None


def _in_file(path: Optional[str], target: Target, into: bool, strict: bool,
             within: Optional[Tuple[str, int]]) -> Optional[dict]:
    """The statements of one file that store into the target (of the holder's function, ``within``):
    a guess from the source alone, so more than one is always a list of candidates."""
    index = _index(path) if path else None
    hits = sorted((ln, col, span) for ln, col, t, kind, span, _ in (index.stores if index else ())
                  if _matches(target, into, strict, t, kind) and _inside(span, within))
    if not hits:
        return None
    out = _frame(path, hits[0][0], _function_at(path, hits[0][2]))
    if len(hits) > 1:
        out["candidates"] = [_frame(path, ln, _function_at(path, span)) for ln, _, span in hits[:8]]
    return out


def _choose(inside: List[Tuple[int, int, FrozenSet[str]]], line: int, held: Optional[str], path: str,
            function: str) -> dict:
    """Of the statements of the lending function that store into the target, the ones whose stored
    expression fits what is held best: the lend's own statement when it is one of them (the lend ran
    inside the store), else the first after the lend line (the store follows the lend in a loop body).
    Several fit as well and none is the lend's own: all are listed as candidates."""
    best = max(_score(shapes, held) for _, _, shapes in inside)
    fit = sorted({ln for ln, _, shapes in inside if _score(shapes, held) == best})
    if line in fit:  # the lend ran inside a statement that stores into the target (cache[k] = ring.put(...))
        return _frame(path, line, function)
    after = [ln for ln in fit if ln >= line]
    out = _frame(path, min(after) if after else max(fit), function)
    if not after:
        out["_before"] = True  # (a loop's earlier line, or another kind of statement after the lend)
    among = after or fit  # a statement after the lend stored it, if any does
    if len(among) > 1:
        out["candidates"] = [_frame(path, ln, function) for ln in among[:8]]
    return out


def held_shape(shape: Sequence[int], stride: Sequence[int], offset: int, nbytes: int,
               lent_shape: Sequence[int], lent_nbytes: int) -> str:
    """What a held tensor is of the view as lent: ``same`` (its shape, contiguous, from its first byte),
    ``transpose`` (its elements, dimensions permuted), ``reshape`` (its bytes in another shape or dtype),
    or ``slice`` (part of it). Plain numbers in: torch-free."""
    shape, lent_shape = tuple(shape), tuple(lent_shape)
    contiguous, expect = True, 1
    for size, st in zip(reversed(shape), reversed(tuple(stride))):
        if size != 1 and st != expect:
            contiguous = False
            break
        expect *= size
    if offset == 0 and nbytes == lent_nbytes and contiguous:
        return "same" if shape == lent_shape else "reshape"
    if nbytes == lent_nbytes and offset == 0 and sorted(shape) == sorted(lent_shape):
        return "transpose"
    return "slice"


def _function_at(path: str, span: Tuple[int, int]) -> str:
    """The name of the function whose lines are ``span`` (``<module>`` for module level)."""
    if span[0] == 0:
        return "<module>"
    for ln in range(span[0], min(span[1], span[0] + 20) + 1):  # past its decorators
        text = linecache.getline(path, ln).strip()
        if text.startswith(("def ", "async def ")):
            return text.split("def ", 1)[1].split("(", 1)[0]
    return "<lambda>"


def _unique(paths: Iterable[Optional[str]]) -> Sequence[str]:
    out: List[str] = []
    for p in paths:
        if p and p not in out and not _plumbing(p):
            out.append(p)
    return out


def forget() -> None:
    """Drop the parsed sources (tests)."""
    with _lock:
        _cache.clear()
        _found.clear()


__all__ = ["Target", "stored_at", "held_shape", "forget"]
