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
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from sanitizer.core.sites import Site, is_internal_file, line_of

Target = Tuple[str, str]  # ("attr", name) | ("name", name) | ("partial", function name)
Wanted = Tuple[str, str, bool]  # a target, and whether the view sits in a container below it
_MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "appendleft", "extendleft",
                       "put", "put_nowait", "__setitem__"})
_MAX_FILES = 256


class _Index:
    """The storing statements of one source file: (line, col, target, into a container?, function span).

    "Into a container" is a mutation (``x.append(v)``, ``x[k] = v``) as opposed to binding the name
    itself (``x = v``, ``self.x = v``): a view kept in ``Model.weights[3]`` was stored by the former."""

    def __init__(self, tree: ast.AST):
        self.stores: List[Tuple[int, int, Target, bool, Tuple[int, int]]] = []
        self._visit(tree, (0, 1 << 30))

    def _visit(self, node: ast.AST, span: Tuple[int, int]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                first = min([child.lineno] + [d.lineno for d in getattr(child, "decorator_list", ())])
                self._visit(child, (first, getattr(child, "end_lineno", None) or child.lineno))
                continue
            for target, into in _targets_of(child):
                self.stores.append((child.lineno, child.col_offset, target, into, span))
            self._visit(child, span)


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


def _holds_nothing(value: Optional[ast.AST]) -> bool:
    """A constant or an empty literal (what initialising an attribute looks like, never a kept view)."""
    if value is None or isinstance(value, ast.Constant):
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


def stored_at(wanted: Optional[Wanted], lent_from: Site, holder_site: Optional[dict] = None) -> Optional[dict]:
    """The frame record (``{"file", "line", "function"}``) of the statement that stored the view into
    ``wanted``'s target, or None when no such statement is found."""
    if wanted is None:
        return None
    target, into = (wanted[0], wanted[1]), wanted[2]
    # The kind of store the path implies first (an append for a view inside a container, the binding for
    # one held by the name itself), then the other (a container literal bound with the view in it).
    for strict in (True, False):
        found = _find(target, into, strict, lent_from, holder_site)
        if found is not None:
            return found
    return None


def _find(target: Target, into: bool, strict: bool, lent_from: Site, holder_site: Optional[dict]) -> Optional[dict]:
    def matches(t: Target, kind: bool) -> bool:
        return t == target and (not strict or kind == into or target[0] == "partial")

    frames = [(code, line_of(code, lasti)) for code, lasti in lent_from or () if not is_internal_file(code.co_filename)]
    for code, line in frames:  # the innermost function on the lend stack that stores into the target
        index = _index(code.co_filename)
        if index is None:
            continue
        first = code.co_firstlineno
        inside = [(ln, col) for ln, col, t, kind, span in index.stores if matches(t, kind) and span[0] == first]
        if inside:
            after = [s for s in inside if s[0] >= line]
            ln = min(after)[0] if after else max(inside)[0]
            return _frame(code.co_filename, ln, getattr(code, "co_qualname", code.co_name))
    files = _unique([code.co_filename for code, _ in frames] + [(holder_site or {}).get("file")])
    for path in files:  # else the files of that stack and of the holder's class
        index = _index(path)
        hits = sorted((ln, col, span) for ln, col, t, kind, span in (index.stores if index else ()) if matches(t, kind))
        if hits:
            return _frame(path, hits[0][0], _function_at(path, hits[0][2]))
    return None


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
        if p and p not in out and not is_internal_file(p):
            out.append(p)
    return out


def forget() -> None:
    """Drop the parsed sources (tests)."""
    with _lock:
        _cache.clear()


__all__ = ["Target", "stored_at", "forget"]
