"""Does a local variable outlive the step it was given a yielded tensor in?

A name bound inside the loop that yields weights keeps its value when the loop moves on. That is a
retention when the value is read again *after* the loader has advanced: after the loop, or in a later
iteration (``prev = w`` read at the top of the next one: a tensor parked until its partner arrives).
A read in the same iteration, after a binding that happens on every path to it, is not.

The dominance used here is structural and cheap: a binding dominates a read when it is an earlier
statement of a block that encloses the read (a binding in both arms of an ``if``, or an arm that leaves
the iteration with ``continue``/``break``/``return``/``raise``, counts as one).
"""
from __future__ import annotations

import ast
from typing import Dict, List, Optional, Tuple

_BLOCK_FIELDS = ("body", "orelse", "finalbody", "handlers")


def _position(node: ast.AST) -> Tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def _end(node: ast.AST) -> Tuple[int, int]:
    return (getattr(node, "end_lineno", 0) or 0, getattr(node, "end_col_offset", 0) or 0)


def _binds(stmt: ast.stmt, name: str) -> bool:
    """Does ``stmt`` bind ``name`` (or leave the iteration) on every path through it?"""
    if isinstance(stmt, (ast.Continue, ast.Break, ast.Return, ast.Raise)):
        return True
    if isinstance(stmt, ast.Assign):
        return any(_target_binds(t, name) for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return stmt.value is not None and _target_binds(stmt.target, name)
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return any(i.optional_vars is not None and _target_binds(i.optional_vars, name) for i in stmt.items) or \
            _block_binds(stmt.body, name)
    if isinstance(stmt, ast.If):
        return bool(stmt.orelse) and _block_binds(stmt.body, name) and _block_binds(stmt.orelse, name)
    if isinstance(stmt, (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())):
        return _block_binds(stmt.body, name) and all(_block_binds(h.body, name) for h in stmt.handlers)
    if isinstance(stmt, ast.Delete):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    return _walrus_before(stmt, name, _AFTER)


class _After(ast.AST):
    """A position after every statement (for "does this earlier statement bind the name with ``:=``")."""

    lineno = 1 << 30
    col_offset = 0


_AFTER = _After()


_HEADER_FIELDS = ("test", "iter", "value", "subject", "items", "targets", "target", "context_expr", "exc", "msg")
_DEFERRED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.BoolOp, ast.IfExp)


def _walrus_before(stmt: ast.AST, name: str, use: ast.AST) -> bool:
    """Does ``stmt``'s own header (an ``if``'s test, an assignment's value...) bind ``name`` with ``:=``
    on every path, before ``use`` (a read later in the same expression, or in the statement's body)?
    A walrus under ``and``/``or``, a conditional expression or a comprehension may not run: not counted
    (except as the first operand of ``and``/``or``, which always runs)."""
    stack: list = []
    for field in _HEADER_FIELDS:
        value = getattr(stmt, field, None)
        if isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, ast.AST))
        elif isinstance(value, ast.AST):
            stack.append(value)
    where = _position(use)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name) and node.target.id == name:
            if _end(node) <= where:
                return True
        if isinstance(node, (ast.stmt, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.BoolOp):
            stack.append(node.values[0])
            continue
        if isinstance(node, ast.IfExp):
            stack.append(node.test)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return False


def _target_binds(target: ast.AST, name: str) -> bool:
    if isinstance(target, ast.Name):
        return target.id == name
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_target_binds(e, name) for e in target.elts)
    if isinstance(target, ast.Starred):
        return _target_binds(target.value, name)
    return False


def _block_binds(block: List[ast.stmt], name: str) -> bool:
    return any(_binds(s, name) for s in block)


# What may move a loader on between two points: a call, a loop (``__next__``), ``await``, ``yield``.
_FETCHES = (ast.Call, ast.For, ast.AsyncFor, ast.While, ast.comprehension, ast.Await, ast.Yield, ast.YieldFrom)


def _only_fetch_binds(loop: ast.AST, name: str, bound_by: Optional[ast.AST]) -> bool:
    """Is ``bound_by`` an assignment of ``name`` from a call (``x = f(...)``, or ``a, x = f(...)``) such that
    every call to ``f`` in ``loop`` is the value of a statement that binds ``name``?"""
    if not isinstance(bound_by, ast.Assign) or not isinstance(bound_by.value, ast.Call) \
            or not any(_target_binds(t, name) for t in bound_by.targets):
        return False
    fetch = ast.dump(bound_by.value.func)
    bound_values = {id(stmt.value) for stmt in ast.walk(loop)
                    if isinstance(stmt, ast.Assign) and any(_target_binds(t, name) for t in stmt.targets)}
    return all(id(node) in bound_values for node in ast.walk(loop)
               if isinstance(node, ast.Call) and ast.dump(node.func) == fetch)


class LoopLifetimes:
    """Answers "is this name read past its step?" for the loops of one function (parents built once)."""

    def __init__(self, function: ast.AST):
        self.function = function
        self.parent: Dict[int, Tuple[ast.AST, Optional[List[ast.stmt]]]] = {}
        self.names: Dict[str, List[ast.Name]] = {}
        stack: List[ast.AST] = [function]
        while stack:
            node = stack.pop()
            for field, value in ast.iter_fields(node):
                if isinstance(value, list):
                    block = value if field in _BLOCK_FIELDS and value and isinstance(value[0], ast.stmt) else None
                    for child in value:
                        if isinstance(child, ast.AST):
                            self.parent[id(child)] = (node, block)
                            stack.append(child)
                elif isinstance(value, ast.AST):
                    self.parent[id(value)] = (node, None)
                    stack.append(value)
            if isinstance(node, ast.Name):
                self.names.setdefault(node.id, []).append(node)
        own = _comprehension_names(function)
        for name, uses in self.names.items():
            if own:
                uses[:] = [u for u in uses if id(u) not in own]
            uses.sort(key=_position)

    def read_after(self, name: str, loop: ast.AST) -> Optional[ast.Name]:
        """The first use of ``name`` after ``loop`` ends, if it is a read (None if it is rebound first)."""
        end = _end(loop)
        for use in self.names.get(name, ()):
            if _position(use) > end:
                return use if isinstance(use.ctx, ast.Load) and not self._inside(use, loop) else None
        return None

    def returned_fresh(self, name: str, loop: ast.AST, use: ast.Name, bound_by: Optional[ast.AST] = None) -> bool:
        """Is ``use`` (a read after ``loop``) the value of a ``return`` reached with nothing fetched since
        the last iteration, which rebinds ``name`` on every path? Then it holds the last iteration's value
        while it is still the loader's current one (``for key in keys: res = {...}`` then ``return res``):
        no call, loop, ``await`` or ``yield`` between the loop's end and the read, and no ``with`` around
        the loop that closes before it (its exit is a call). For a loop over a getter's keys only: a loop
        over the weights iterator resumes it once more to find its end (the caller checks that).
        A binding on some paths only counts when ``bound_by`` (the statement that bound the fetched value)
        is the only way the loop fetches: every call in the loop to the function it called binds ``name``
        (sd-scripts: ``for pi in range(n): if pi == local: unet = _load_target_model(...)``, returned after
        the loop), so nothing was fetched since the value it holds."""
        parent = self.parent.get(id(use), (None, None))[0]
        while parent is not None and not isinstance(parent, ast.stmt):
            parent = self.parent.get(id(parent), (None, None))[0]
        if not isinstance(parent, ast.Return) or not (_block_binds(getattr(loop, "body", []), name)
                                                      or _only_fetch_binds(loop, name, bound_by)):
            return False
        start, stop = _end(loop), _position(use)
        for node in ast.walk(self.function):
            if isinstance(node, _FETCHES) and start < _position(node) < stop:
                return False
        cur = self.parent.get(id(loop), (None, None))[0]
        while cur is not None and cur is not self.function:
            if isinstance(cur, (ast.With, ast.AsyncWith)) and not self._inside(use, cur):
                return False
            cur = self.parent.get(id(cur), (None, None))[0]
        return True

    def read_by_next_iteration(self, name: str, loop: ast.AST) -> Optional[ast.Name]:
        """A read of ``name`` in ``loop``'s body that no binding earlier in the same iteration dominates."""
        for use in self.names.get(name, ()):
            if not isinstance(use.ctx, ast.Load) or not self._inside(use, loop):
                continue
            if not self._dominated(use, name, loop):
                return use
        return None

    def _inside(self, node: ast.AST, loop: ast.AST) -> bool:
        cur: Optional[ast.AST] = node
        while cur is not None and cur is not self.function:
            if cur is loop:
                return True
            cur = self.parent.get(id(cur), (None, None))[0]
        return False

    def _dominated(self, use: ast.AST, name: str, loop: ast.AST) -> bool:
        cur: ast.AST = use
        while cur is not loop:
            parent, block = self.parent.get(id(cur), (None, None))
            if parent is None:
                return False
            if parent is not loop and isinstance(parent, ast.stmt) and _walrus_before(parent, name, use):
                return True  # `if (t := w.t()) is not None: use(t)`: bound in the same step, before the read
            if isinstance(parent, (ast.For, ast.AsyncFor)) and parent is not loop and block is parent.body \
                    and _target_binds(parent.target, name):
                return True  # an inner loop's body: its target rebinds the name first in each of its steps
            if block is not None and cur is not None:
                if parent is loop and block is not getattr(loop, "body", None):
                    return True  # the loop's else: runs once, after the last step (a read after the loop)
                for prev in block[: _index(block, cur)]:
                    if _binds(prev, name):
                        return True
            cur = parent
        return False


def _comprehension_names(function: ast.AST) -> set:
    """The ids of the names a comprehension binds for itself, wherever it reads or binds them
    (``{n: p for n, p in m.named_parameters()}``: its ``p`` is not the function's ``p``); the first
    iterable is evaluated in the enclosing scope, so its names are the function's."""
    out: set = set()
    for node in ast.walk(function):
        if not isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        bound = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        if not bound:
            continue
        parts: List[ast.AST] = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for i, g in enumerate(node.generators):
            parts.append(g.target)
            parts.extend(g.ifs)
            if i:
                parts.append(g.iter)
        for part in parts:
            for sub in ast.walk(part):
                if isinstance(sub, ast.Name) and sub.id in bound:
                    out.add(id(sub))
    return out


def _index(block: List[ast.stmt], node: ast.AST) -> int:
    for i, stmt in enumerate(block):
        if stmt is node:
            return i
    return len(block)


__all__ = ["LoopLifetimes"]
