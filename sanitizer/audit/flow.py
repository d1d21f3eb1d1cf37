"""The taint/alias flow through one function: which names hold (views of) a yielded tensor, and which
statements keep one past its step.

The walk is an abstract interpretation over the function's statements in order, with one environment
of tainted names (:class:`~sanitizer.audit.values.Val`) and one record per local of how it was bound
(:class:`Slot`: a fresh container? bound inside which loops? an alias of a parameter's container?).
Branches are walked on copies and joined (a name is tainted after an ``if`` when either arm taints it);
loop bodies are walked twice so that what one iteration leaves behind reaches the next.

A statement that stores a tainted value somewhere is judged by the lifetime of the place:

* a fresh container bound inside the same step dies with the step: it becomes a holder, and only
  where *it* goes matters (collect the slices of one item, ``cat`` them: nothing to report);
* anything else (a container bound before the loop, an attribute, a parameter's container, a global,
  an enclosing scope's name) outlives the step: a finding.

In *summary* mode the function is a helper called with one tainted argument; stores into containers
that the caller passed in are recorded for the caller to judge (its container may be step-local), the
rest become finding templates the caller instantiates with its own chain (see :mod:`.summaries`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.codes import CODES
from sanitizer.audit.findings import Finding, Link
from sanitizer.audit.index import FunctionInfo, annotation_text, dotted
from sanitizer.audit.lifetimes import LoopLifetimes
from sanitizer.audit.snippets import Snippets
from sanitizer.audit.targets import (binding_kind, is_fresh_container, method_base_is_tensor, root_of,
                                     subscript_is_tensor)
from sanitizer.audit.values import (ELEM_ENUM_PAIR, ELEM_ENUM_TENSOR, ELEM_PAIR, ELEM_TENSOR, HOLDER, ITER, PAIR,
                                    SOURCE, TENSOR, Val, element_of)

_ACCESSORS = (ast.Attribute, ast.Subscript, ast.Call)  # values that may alias a container of a parameter/self
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_MAPPING_COPIES = frozenset({"dict", "OrderedDict", "defaultdict"})  # of a dict: its tensors, by name
_MATERIALISING_COMPS = {ast.ListComp: "list comprehension", ast.SetComp: "set comprehension",
                        ast.DictComp: "dict comprehension"}
_CONDITIONAL = frozenset({"OWN101", "OWN102", "OWN106"})  # stores that a no-op conversion makes retentions
_VALUE_ARG = {"append": 0, "add": 0, "appendleft": 0, "put": 0, "put_nowait": 0, "push": 0, "extend": 0,
              "extendleft": 0, "update": 0, "insert": 1, "setdefault": 1, "__setitem__": 1}


@dataclass(frozen=True)
class Slot:
    """How a local name was last bound (untainted or tainted alike)."""

    fresh: bool  # a new container/object: nothing else refers to it yet
    loops: Tuple[int, ...]  # the steps (loops, and the call itself) enclosing the binding
    kind: str = "unknown"  # 'container', 'tensor' or 'unknown' (for subscript stores)
    param: Optional[int] = None  # a parameter, or an alias of a parameter's container: its index
    self_alias: bool = False  # bound from an attribute of self


@dataclass
class State:
    env: Dict[str, Val] = field(default_factory=dict)
    slots: Dict[str, Slot] = field(default_factory=dict)

    def copy(self) -> "State":
        return State(dict(self.env), dict(self.slots))

    def join(self, other: "State") -> None:
        for name, val in other.env.items():
            if name not in self.env:
                self.env[name] = replace(val, maybe=True) if name in self.slots else val
        for name, val in list(self.env.items()):
            if name not in other.env and name in other.slots and not val.maybe:
                self.env[name] = replace(val, maybe=True)
        for name, slot in other.slots.items():
            mine = self.slots.get(name)
            if mine is None:
                self.slots[name] = slot
            elif mine != slot:
                self.slots[name] = Slot(mine.fresh and slot.fresh, tuple(x for x in mine.loops if x in slot.loops),
                                        mine.kind if mine.kind == slot.kind else "unknown",
                                        mine.param if mine.param is not None else slot.param,
                                        mine.self_alias or slot.self_alias)


@dataclass
class IntoParam:
    """Summary fact: the seeded argument was stored into the container passed as parameter ``index``."""

    index: int
    template: Finding


@dataclass
class Outcome:
    """What one flow found: findings (root mode) or templates (summary mode), and summary facts."""

    findings: List[Finding] = field(default_factory=list)
    into_param: List[IntoParam] = field(default_factory=list)
    returns: Optional[Val] = None
    yields: Optional[Val] = None  # a generator helper yields (views of) its argument


Resolver = Callable[["Flow", ast.Call], Optional[Val]]


class Flow:
    """One walk of one function. ``resolve_call`` handles calls into same-module functions (summaries);
    ``summary_param`` is the index of the seeded parameter in summary mode (None: root mode)."""

    def __init__(self, path: str, info: FunctionInfo, seeds: Dict[str, Val], module_globals: Sequence[str],
                 snippets: Snippets, resolve_call: Optional[Resolver] = None, summary_param: Optional[int] = None,
                 module_aliases: Sequence[str] = ("torch", "np", "numpy"),
                 producer_kind: Optional[Callable[[str], Optional[str]]] = None, hands_on: bool = False):
        self.path = path
        self.producer_kind = producer_kind  # a configured producer's kind (settings.producer_kind)
        self.hands_on = hands_on  # the function is a configured producer: what it returns is borrowed by contract
        self.module_aliases = set(module_aliases)
        self.snip = snippets
        self.info = info
        self.fn = info.qualname
        self.globals = set(module_globals)
        self.resolve_call = resolve_call
        self.summary_param = summary_param
        self.func_step = id(info.node)
        self.loops: List[int] = [self.func_step]
        self._loops_t: Tuple[int, ...] = (self.func_step,)  # tuple(self.loops), kept for every binding's Slot
        self._declared_global, self._declared_nonlocal = info.declared
        self.loop_nodes: Dict[int, ast.AST] = {}
        self._comp_steps: set = set()  # the steps that are comprehensions' (not statement loops)
        self.state = State()
        self.out = Outcome()
        self._seen: Dict[Tuple[int, int, str], Finding] = {}
        self._kept: Dict[Tuple[str, int], Tuple[ast.AST, Val, int]] = {}
        self.annotations: Dict[str, str] = {}
        params = info.params + [a for a in (info.vararg, info.kwarg) if a is not None]
        for i, arg in enumerate(params):
            self.state.slots[arg.arg] = Slot(False, (), "unknown", i)
            if arg.annotation is not None:
                self.annotations[arg.arg] = annotation_text(arg.annotation)
        for name, val in seeds.items():
            self.state.env[name] = val

    # -- driving ---------------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        self.block(self.info.node.body)  # type: ignore[attr-defined]
        self._kept_variables()
        return self.out

    def block(self, stmts: Sequence[ast.stmt]) -> None:
        for stmt in stmts:
            self.stmt(stmt)

    # -- findings --------------------------------------------------------------------------------------------
    def report(self, code: str, node: ast.AST, val: Val, pattern: str, message: str, last: str) -> None:
        if val.reported:
            return
        if val.convert and code in _CONDITIONAL:
            code = "OWN107"
            pattern = f"conditional: {pattern}"
            message = (f"{message}, if `{val.convert}` is a no-op (the tensor is already contiguous, of that "
                       f"dtype, on that device: a GPU-resident loader's normal case); otherwise it is a copy")
        key = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0), code)
        if key in self._seen:
            return
        info = CODES[code]
        line = getattr(node, "lineno", 0)
        finding = Finding(self.path, line, getattr(node, "col_offset", 0) + 1,
                          getattr(node, "end_lineno", None) or line, self.fn, code, pattern, message,
                          val.chain + (Link(line, self.fn, last),), info.fix, consumer=val.consumer,
                          consumer_path=self.path)
        self._seen[key] = finding
        self.out.findings.append(finding)

    def _into_param(self, index: int, code: str, node: ast.AST, val: Val, pattern: str, message: str,
                    last: str) -> None:
        before = len(self.out.findings)
        self.report(code, node, val, pattern, message, last)
        if len(self.out.findings) > before:
            self.out.into_param.append(IntoParam(index, self.out.findings.pop()))

    # -- statements --------------------------------------------------------------------------------------------
    def stmt(self, node: ast.stmt) -> None:
        handler = _STMT.get(type(node))
        if handler is not None:
            handler(self, node)

    def _st_expr(self, node: ast.Expr) -> None:
        value = node.value
        if type(value) is ast.Call:
            self.call(value)  # type: ignore[arg-type]
        elif type(value) is not ast.Constant:  # docstrings
            self.ev(value)

    def _st_assign(self, node: ast.Assign) -> None:
        val = self.ev(node.value)
        for target in node.targets:
            self.assign(target, val, node.value, node)

    def _st_annassign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.assign(node.target, self.ev(node.value), node.value, node)

    def _st_for(self, node: ast.AST) -> None:
        self.loop(node, self.ev(node.iter))  # type: ignore[attr-defined]

    def _st_while(self, node: ast.While) -> None:
        self.ev(node.test)
        self.loop(node, None)

    def _st_if(self, node: ast.If) -> None:
        self.ev(node.test)
        self.branches([node.body, node.orelse])

    def _st_with(self, node: ast.AST) -> None:
        for item in node.items:  # type: ignore[attr-defined]
            val = self.ev(item.context_expr)
            if item.optional_vars is not None:
                self.assign(item.optional_vars, val, item.context_expr, node)
        self.block(node.body)  # type: ignore[attr-defined]

    def _st_try(self, node: ast.AST) -> None:
        self.block(node.body)  # type: ignore[attr-defined]
        for handler in node.handlers:  # type: ignore[attr-defined]
            self.block(handler.body)
        self.block(node.orelse)  # type: ignore[attr-defined]
        self.block(node.finalbody)  # type: ignore[attr-defined]

    def _st_match(self, node: ast.AST) -> None:
        self.ev(node.subject)  # type: ignore[attr-defined]
        self.branches([case.body for case in node.cases] + [[]])  # type: ignore[attr-defined]

    def _st_return(self, node: ast.Return) -> None:
        if node.value is not None:
            val = self.ev(node.value)
            if val is not None and self.summary_param is not None and val.seed is not None:
                self.out.returns = self.out.returns or val
            elif val is not None and self.summary_param is None and val.obj and val.step == self.func_step \
                    and not self.hands_on:
                # `return KVScales(k, v)` around a tensor this call fetched (its step): a bare tensor returned
                # is handed on, but an object built around it is how a loader keeps it (TGI's get_kv_scales)
                self.report("OWN101", node, val, f"kept by a new `{val.obj}` the call returns",
                            f"{self._what(val)} is kept by the `{val.obj}` that `{self.info.name}` builds and "
                            f"returns, which outlives the loader's step", f"`{self.snip(node, 60)}`")

    def _st_delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            if isinstance(target, ast.Name):
                self.state.env.pop(target.id, None)
            else:
                self.ev(target)

    def _st_raise(self, node: ast.Raise) -> None:
        if node.exc is not None:
            self.ev(node.exc)

    def _st_assert(self, node: ast.Assert) -> None:
        self.ev(node.test)

    def _push_loop(self, step_id: int) -> None:
        self.loops.append(step_id)
        self._loops_t = tuple(self.loops)

    def _pop_loop(self) -> None:
        self.loops.pop()
        self._loops_t = tuple(self.loops)

    def branches(self, blocks: Sequence[Sequence[ast.stmt]]) -> None:
        start = self.state
        ends: List[State] = []
        for body in blocks:
            self.state = start.copy()
            self.block(body)
            ends.append(self.state)
        merged = ends[0]
        for other in ends[1:]:
            merged.join(other)
        self.state = merged

    def loop(self, node: ast.AST, it: Optional[Val]) -> None:
        step_id = id(node)
        self._push_loop(step_id)
        self.loop_nodes[step_id] = node
        before = self.state.copy()
        target = getattr(node, "target", None)
        for _ in range(2):
            if target is not None:
                item = self.item_of(it, step_id, node)
                self.assign(target, item, None, node, loop_target=True)
            self.block(node.body)  # type: ignore[attr-defined]
        self._pop_loop()
        self.state.join(before)
        self.block(getattr(node, "orelse", []))

    def item_of(self, it: Optional[Val], step_id: int, node: ast.AST) -> Optional[Val]:
        """One item of what a loop iterates, stamped with the loop's step when it is a fresh iteration."""
        if it is None or it.kind == SOURCE or it.mapping:
            return None  # a dict of weights yields its names
        link = Link(node.lineno, self.fn, f"`{self.snip(node.target)}` yielded by `{self.snip(node.iter)}`")  # type: ignore
        if it.kind == ITER:
            item = element_of(it, link)
            return replace(item, step=step_id) if not it.reported else item
        if it.kind == PAIR:
            return None
        return element_of(it, link)  # a holder's elements, a tensor's rows

    # -- binding ---------------------------------------------------------------------------------------------
    def assign(self, target: ast.AST, val: Optional[Val], value: Optional[ast.AST], stmt: ast.AST,
               loop_target: bool = False) -> None:
        if isinstance(target, ast.Name):
            self.bind_name(target.id, val, value, stmt, loop_target)
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = self.unpack(val, len(target.elts))
            for elt, part in zip(target.elts, parts):
                if isinstance(elt, ast.Starred):
                    self.assign(elt.value, val.then(HOLDER) if val is not None and part is not None else None,
                                None, stmt, loop_target)
                else:
                    self.assign(elt, part, None, stmt, loop_target)
        elif isinstance(target, ast.Attribute):
            base = self.ev(target.value)
            if val is not None and (base is None or base.kind != TENSOR):
                self.attribute_store(target, val, stmt)
        elif isinstance(target, ast.Subscript):
            self.subscript_store(target, val, stmt)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, val, value, stmt, loop_target)

    def unpack(self, val: Optional[Val], n: int) -> List[Optional[Val]]:
        if val is None:
            return [None] * n
        if val.parts is not None and len(val.parts) == n:
            return list(val.parts)
        if val.kind == ITER:
            return [val] * n
        if val.kind == PAIR or (val.kind == HOLDER and val.elem in (ELEM_ENUM_PAIR, ELEM_ENUM_TENSOR)):
            if val.kind == HOLDER:
                inner = val.then(PAIR if val.elem == ELEM_ENUM_PAIR else TENSOR, elem=ELEM_PAIR
                                 if val.elem == ELEM_ENUM_PAIR else ELEM_TENSOR)
                return [None, inner] + [None] * (n - 2)
            return [None] + [val.then(TENSOR, elem=ELEM_TENSOR)] * (n - 1)
        elem = val.then(PAIR if val.elem == ELEM_PAIR and val.kind == HOLDER else TENSOR)
        return [elem] * n

    def bind_name(self, name: str, val: Optional[Val], value: Optional[ast.AST], stmt: ast.AST,
                  loop_target: bool) -> None:
        if val is not None and (name in self._declared_global or name in self._declared_nonlocal):
            where = "global" if name in self._declared_global else "nonlocal"
            self.report("OWN106", stmt, val, f"{where} name", f"{self._what(val)} is stored in the {where} "
                        f"name `{name}`, which outlives the loader's step", f"stored in {where} `{name}`")
            return
        if val is not None:
            if loop_target and (not val.label or val.kind == TENSOR):
                val = replace(val, label=f"`{name}`")
            if not loop_target and value is not None and not isinstance(value, ast.Name):
                val = val.then(link=Link(getattr(stmt, "lineno", 0), self.fn, f"`{name} = {self.snip(value, 40)}`"))
            self.state.env[name] = val
        else:
            self.state.env.pop(name, None)
        accessor = isinstance(value, _ACCESSORS)
        param = self._alias_param(value) if accessor or type(value) is ast.Name else None
        self.state.slots[name] = Slot(param is None and is_fresh_container(value), self._loops_t,
                                      "tainted" if val is not None else binding_kind(value), param,
                                      accessor and self._alias_self(value))
        if (val is not None and not loop_target and val.holds_tensor and val.step in self.loop_nodes
                and val.step in self.loops and not val.reported):
            self._kept.setdefault((name, val.step), (stmt, val, getattr(stmt, "lineno", 0)))

    def _alias_param(self, value: Optional[ast.AST]) -> Optional[int]:
        """``entry = buf.setdefault(k, {})``, ``lst = buf[k]``: an alias of parameter ``buf``'s container."""
        if value is None or isinstance(value, ast.Name):
            root = root_of(value) if value is not None else None
            if root is None or root.name is None:
                return None
            slot = self.state.slots.get(root.name)
            return slot.param if slot is not None and self._is_param_container(root.name) else None
        if isinstance(value, (ast.Subscript, ast.Call, ast.Attribute)):
            root = root_of(value)
            if root.name is not None and root.name != self._self_name():
                slot = self.state.slots.get(root.name)
                if slot is not None and slot.param is not None and root.name not in self.state.env:
                    if isinstance(value, ast.Call) and not (isinstance(value.func, ast.Attribute) and
                                                            value.func.attr in ("setdefault", "get", "__getitem__")):
                        return None
                    return slot.param
        return None

    def _is_param_container(self, name: str) -> bool:
        return name not in self.state.env and name != self._self_name()

    def _alias_self(self, value: Optional[ast.AST]) -> bool:
        if value is None or not isinstance(value, (ast.Attribute, ast.Subscript, ast.Call)):
            return False
        root = root_of(value)
        if isinstance(value, ast.Call) and not (isinstance(value.func, ast.Attribute)
                                                and value.func.attr in ("setdefault", "get", "__getitem__")):
            return False
        return root.name is not None and root.name == self._self_name() and root.through_attribute

    def _self_name(self) -> Optional[str]:
        """The name of ``self`` in this function (a method's first parameter, or the enclosing method's)."""
        try:
            return self._self_cached
        except AttributeError:
            self._self_cached: Optional[str] = self._find_self_name()
            return self._self_cached

    def _find_self_name(self) -> Optional[str]:
        info: Optional[FunctionInfo] = self.info
        while info is not None:
            if info.is_method and info.params:
                return info.params[0].arg
            info = info.parent
        return None

    # -- stores ------------------------------------------------------------------------------------------------
    def _what(self, val: Val) -> str:
        label = val.label or "a yielded tensor"
        if val.capture:
            return f"a {val.capture} holding {label}"
        return label

    def _place(self, root_name: Optional[str]) -> Tuple[str, Optional[int]]:
        """('local-step'|'param'|'self'|'global'|'free'|'outer', param index) for a store's root name."""
        if root_name is None:
            return "outer", None
        if root_name == self._self_name():
            return "self", 0
        if root_name in self.info.declared_global:
            return "global", None
        slot = self.state.slots.get(root_name)
        if slot is None:
            if root_name in self.info.locals:
                return "outer", None
            return ("global" if root_name in self.globals else "free"), None
        if slot.self_alias:
            return "self", 0
        if slot.param is not None:
            return "param", slot.param
        return "local", None

    def store_into(self, container: ast.AST, val: Val, stmt: ast.AST, how: str) -> None:
        """``container`` (an expression) now holds ``val``: a holder if it dies in the step, else a finding."""
        if val.reported or not val.holds_tensor:
            return
        root = root_of(container)
        held_by = self.state.env.get(root.name) if root.name and not root.through_attribute else None
        if held_by is not None and held_by.mapping and held_by.step == val.step:
            return  # `weights[q_name] = qkv[:q]`: into the step's own dict of weights, which dies with the step
        place, index = self._place(root.name)
        if place == "local":
            slot = self.state.slots[root.name]  # type: ignore[index]
            if slot.fresh and val.step in slot.loops and not root.through_attribute:
                held = self.state.env.get(root.name)  # type: ignore[arg-type]
                if held is None or held.kind != HOLDER:
                    link = Link(getattr(stmt, "lineno", 0), self.fn, f"stored in `{self.snip(root.node)}` (dies with the step)")
                    self.state.env[root.name] = val.then(HOLDER, link, elem=ELEM_PAIR if val.kind == PAIR
                                                         else ELEM_TENSOR)  # type: ignore[index]
                return
        code = "OWN104" if val.capture else ("OWN106" if place == "global" else "OWN101")
        pattern = self._store_pattern(how, root, place, val)
        where = {"self": "an attribute of the object", "global": "a module-level name",
                 "free": "an enclosing scope", "param": "a container the caller passed in"}.get(place, "")
        message = (f"{self._what(val)} is stored in `{self.snip(root.node)}`"
                   + (f" ({where})" if where else "") + ", which outlives the loader's step")
        self._store_found(code, stmt, val, pattern, message, place, index)

    def _store_found(self, code: str, stmt: ast.AST, val: Val, pattern: str, message: str, place: str,
                     index: Optional[int]) -> None:
        """Report a store, or, inside a helper being summarised, note that it stores into its caller's
        argument (a parameter, or the object ``__init__`` builds) for the caller to report."""
        last = f"`{self.snip(stmt, 60)}`"
        if self.summary_param is not None and place == "param" and index is not None and index != val.seed:
            self._into_param(index, code, stmt, val, pattern, message, last)
        elif self.summary_param is not None and place == "self" and self.info.name == "__init__":
            self._into_param(0, code, stmt, val, pattern, message, last)
        else:
            self.report(code, stmt, val, pattern, message, last)

    def _store_pattern(self, how: str, root, place: str, val: Val) -> str:
        if val.capture:
            return f"{val.capture} kept for a deferred call"
        if place == "global":
            return "module-level container"
        if how in ("append", "extend", "insert", "add", "appendleft", "extendleft", "+=", "put", "push"):
            kind = "side list" if how != "add" else "side set"
            return f"{kind} filled in the step, kept past it" + (" (on an object)" if place == "self" else "")
        if how in ("subscript", "setdefault", "update", "__setitem__"):
            return "dict by name: parked until used" + (" (on an object)" if place == "self" else "")
        return "container that outlives the step"

    def attribute_store(self, target: ast.Attribute, val: Val, stmt: ast.AST) -> None:
        if val.reported or not val.holds_tensor:
            return
        root = root_of(target.value)
        place, index = self._place(root.name)
        if place == "local" and root.name is not None:
            slot = self.state.slots[root.name]
            if slot.fresh and val.step in slot.loops:
                self.state.env[root.name] = val.then(HOLDER, Link(getattr(stmt, "lineno", 0), self.fn,
                                                                  f"stored in `{self.snip(target)}`"))
                return
        if root.name is not None and root.name in self.state.env and self.state.env[root.name].kind == TENSOR:
            return  # an attribute set on a yielded tensor itself
        code = "OWN104" if val.capture else "OWN102"
        text = self.snip(target)
        if val.capture:
            pattern = f"{val.capture} kept for a deferred call"
        elif target.attr == "data":
            pattern = "`.data` of a parameter aliased to the yielded tensor"
        elif val.parameter:
            pattern = "nn.Parameter(view) kept on an object"
        else:
            pattern = "attribute alias of a view"
        message = f"{self._what(val)} is stored in the attribute `{text}`, which outlives the loader's step"
        self._store_found(code, stmt, val, pattern, message, place, index)

    def subscript_store(self, target: ast.Subscript, val: Optional[Val], stmt: ast.AST) -> None:
        base = self.ev(target.value)
        self.ev(target.slice)
        if base is not None and base.kind == TENSOR:
            self.inplace(stmt, base, "subscript assignment", f"`{self.snip(target)} = ...` writes into it")
            return
        if val is None:
            return
        root = root_of(target.value)
        slot = self.state.slots.get(root.name) if root.name else None
        kind = slot.kind if slot is not None and not root.through_attribute else None
        if base is not None and base.kind == HOLDER:
            kind = "container"
        if subscript_is_tensor(target, kind, self.annotations.get(root.name or "", "")):
            return  # a copy into a tensor
        self.store_into(target.value, val, stmt, "subscript")

    def augassign(self, node: ast.AugAssign) -> None:
        val = self.ev(node.value)
        target = node.target
        current = self.ev(target) if not isinstance(target, ast.Name) else self.state.env.get(target.id)
        if current is not None and current.kind == TENSOR:
            self.inplace(node, current, "augmented assignment", f"`{self.snip(node, 50)}` writes into it")
            return
        if val is None:
            return
        if isinstance(target, ast.Subscript):
            self.subscript_store(target, val, node)
        elif isinstance(target, ast.Attribute):
            self.attribute_store(target, val, node) if isinstance(node.op, ast.Add) else None
        elif isinstance(target, ast.Name) and isinstance(node.op, ast.Add):
            slot = self.state.slots.get(target.id)
            if slot is not None and slot.kind in ("container", "tainted") or current is not None:
                self.store_into(target, val, node, "+=")

    def inplace(self, node: ast.AST, val: Val, how: str, last: str) -> None:
        if val.kind != TENSOR or val.maybe:
            return
        self.report("OWN120", node, replace(val, reported=False) if val.reported else val, how,
                    f"in-place write into {self._what(val)} ({how}): with a borrowing loader this writes into "
                    f"the loader's staging buffer", last)

    # -- nested definitions ------------------------------------------------------------------------------------
    def nested_def(self, node: ast.AST) -> None:
        captured = self._captured(node)
        name = node.name  # type: ignore[attr-defined]
        if captured is not None:
            self.state.env[name] = captured.then(HOLDER, Link(node.lineno, self.fn,  # type: ignore[attr-defined]
                                                              f"captured by closure `{name}`"), capture="closure")
        else:
            self.state.env.pop(name, None)
        self.state.slots[name] = Slot(True, self._loops_t, "unknown")

    def _captured(self, node: ast.AST) -> Optional[Val]:
        """The first tainted name of this scope that a nested function or lambda reads (a captured cell),
        or a tainted default argument (``lambda w=w: ...``, ``def later(t=w)``: evaluated once, when the
        function is made, and kept by it: the usual way to bind a loop variable in a deferred call);
        names it binds itself (its parameters, its own assignments) are its own, not captures."""
        if not self.state.env:
            return None
        args = node.args  # type: ignore[attr-defined]
        for default in list(args.defaults) + [d for d in args.kw_defaults if d is not None]:
            val = self.ev(default)
            if val is not None and val.holds_tensor:
                return val
        own = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
        own |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
        body = [node.body] if isinstance(node, ast.Lambda) else node.body  # type: ignore[attr-defined]
        names = [sub for part in body for sub in ast.walk(part) if isinstance(sub, ast.Name)]
        own |= {n.id for n in names if not isinstance(n.ctx, ast.Load)}
        for sub in names:
            if isinstance(sub.ctx, ast.Load) and sub.id not in own:
                val = self.state.env.get(sub.id)
                if val is not None and val.holds_tensor:
                    return val
        return None

    # -- expressions -------------------------------------------------------------------------------------------
    def ev(self, node: Optional[ast.AST]) -> Optional[Val]:
        """The abstract value of an expression (and its effects: stores, in-place writes, helper calls)."""
        if node is None:
            return None
        kind = type(node)
        if kind is ast.Name:  # the most common node by far: no dispatch
            return self.state.env.get(node.id) if type(node.ctx) is ast.Load else None  # type: ignore[attr-defined]
        if kind is ast.Constant:
            return None
        handler = _EV.get(kind)
        if handler is not None:
            return handler(self, node)
        for child in ast.iter_child_nodes(node):  # Compare, UnaryOp, JoinedStr, Slice...: effects only
            if isinstance(child, ast.expr) and type(child) is not ast.Name and type(child) is not ast.Constant:
                self.ev(child)
        return None

    def _ev_attribute(self, node: ast.Attribute) -> Optional[Val]:
        base = self.ev(node.value)
        if base is None:
            return None
        if base.kind == TENSOR and node.attr in V.ALIAS_ATTRIBUTES:
            return base.then(TENSOR, Link(node.lineno, self.fn, f"`.{node.attr}`"))
        if base.kind == HOLDER and node.attr in ("args", "kwargs", "arguments"):
            return base
        return None

    def _ev_subscript(self, node: ast.Subscript) -> Optional[Val]:
        base = self.ev(node.value)
        self.ev(node.slice)
        return self.subscript_value(node, base)

    def _ev_sequence(self, node: ast.AST) -> Optional[Val]:
        return self.literal(node, node.elts)  # type: ignore[attr-defined]

    def _ev_dict(self, node: ast.Dict) -> Optional[Val]:
        for k in node.keys:
            self.ev(k)
        return self.literal(node, node.values)

    def _ev_binop(self, node: ast.BinOp) -> Optional[Val]:
        left, right = self.ev(node.left), self.ev(node.right)
        if isinstance(node.op, (ast.Add, ast.Mult)):
            for side in (left, right):
                if side is not None and side.kind == HOLDER:
                    return side
        return None

    def _ev_boolop(self, node: ast.BoolOp) -> Optional[Val]:
        vals = [self.ev(v) for v in node.values]
        return next((v for v in vals if v is not None), None)

    def _ev_ifexp(self, node: ast.IfExp) -> Optional[Val]:
        self.ev(node.test)
        a, b = self.ev(node.body), self.ev(node.orelse)
        return a if a is not None else b

    def _ev_namedexpr(self, node: ast.NamedExpr) -> Optional[Val]:
        val = self.ev(node.value)
        self.assign(node.target, val, node.value, node)
        return val

    def _ev_lambda(self, node: ast.Lambda) -> Optional[Val]:
        captured = self._captured(node)
        if captured is not None:
            return captured.then(HOLDER, Link(node.lineno, self.fn, "captured by a lambda"), capture="lambda")
        return None

    def _ev_value(self, node: ast.AST) -> Optional[Val]:
        return self.ev(node.value)  # type: ignore[attr-defined]

    def _ev_yield(self, node: ast.AST) -> Optional[Val]:
        val = self.ev(node.value)  # type: ignore[attr-defined]
        if val is not None and self.summary_param is not None and val.seed is not None:
            self.out.yields = self.out.yields or val
        return None

    def subscript_value(self, node: ast.Subscript, base: Optional[Val]) -> Optional[Val]:
        if base is None:
            return None
        index = node.slice
        if base.kind == TENSOR:
            return base.then(TENSOR, Link(node.lineno, self.fn, f"sliced `{self.snip(node, 40)}`"))
        if base.kind == PAIR:
            if isinstance(index, ast.Constant) and index.value == 0:
                return None
            if isinstance(index, ast.Slice):  # item[:2]: still the (name, tensor) item
                return base
            return base.then(TENSOR, Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`"), elem=ELEM_TENSOR)
        if base.kind == HOLDER:
            if base.parts is not None and isinstance(index, ast.Constant) and isinstance(index.value, int):
                i = index.value
                if -len(base.parts) <= i < len(base.parts):
                    return base.parts[i]
            if base.mapping:  # `weights["lm_head.weight"]`: name the tensor, not the dict
                return replace(element_of(base, Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`")),
                               label=f"`{self.snip(node, 40)}`")
            return element_of(base)
        if base.kind == ITER and base.reported:
            return element_of(base)
        return None

    def literal(self, node: ast.AST, elts: Sequence[Optional[ast.AST]]) -> Optional[Val]:
        vals: List[Optional[Val]] = []
        for elt in elts:
            if isinstance(elt, ast.Starred):
                inner = self.ev(elt.value)
                if inner is not None and inner.kind == ITER:
                    inner = self.materialise(node, inner, f"[*{self.snip(elt.value, 30)}]")
                vals.append(inner)
            else:
                vals.append(self.ev(elt))
        tainted = [v for v in vals if v is not None and v.kind != SOURCE]
        if not tainted:
            return None
        first = tainted[0]
        pair = isinstance(node, ast.Tuple) and len(vals) == 2 and vals[0] is None and vals[1] is not None \
            and vals[1].kind == TENSOR
        if pair:  # (name, tensor): one item, as a weights iterator yields it
            return first.then(PAIR, elem=ELEM_PAIR, parts=tuple(vals), reported=first.reported)
        return first.then(HOLDER, elem=ELEM_TENSOR, parts=tuple(vals), reported=all(v.reported for v in tainted))

    def materialise(self, node: ast.AST, it: Val, how: str) -> Val:
        """The whole iterator held at once: the finding, and a holder whose items are already covered."""
        if not it.reported:
            self.report("OWN103", node, it, how, f"{how} materialises {self._what(it)}: every tensor it yields is "
                        f"kept while the loader moves on", f"`{self.snip(node, 60)}`")
        return it.then(HOLDER, reported=True)

    def comprehension(self, node: ast.AST) -> Optional[Val]:
        saved = self.state
        self.state = saved.copy()
        iterates_stream = False
        stream: Optional[Val] = None
        step_id = id(node)
        self._comp_steps.add(step_id)
        self._push_loop(step_id)
        try:
            for gen in node.generators:  # type: ignore[attr-defined]
                it = self.ev(gen.iter)
                if it is not None and it.kind == ITER and not it.reported:
                    iterates_stream, stream = True, it
                item = None
                if it is not None and it.kind != SOURCE and it.kind != PAIR:
                    item = element_of(it, Link(node.lineno, self.fn, f"`{self.snip(gen.target)}` from "
                                                                     f"`{self.snip(gen.iter, 30)}`"))
                    if it.kind == ITER and not it.reported:
                        item = replace(item, step=step_id)
                self.assign(gen.target, item, None, node, loop_target=True)
                for cond in gen.ifs:
                    self.ev(cond)
            if isinstance(node, ast.DictComp):
                self.ev(node.key)
                elt = self.ev(node.value)
            else:
                elt = self.ev(node.elt)  # type: ignore[attr-defined]
        finally:
            self._pop_loop()
            self.state = saved
        if elt is None or not elt.holds_tensor:
            return None
        if isinstance(node, ast.GeneratorExp):
            if iterates_stream and stream is not None:  # a lazy transform: still one item per step
                pair = isinstance(node.elt, ast.Tuple) and len(node.elt.elts) == 2  # type: ignore[attr-defined]
                return stream.then(ITER, elem=ELEM_PAIR if pair else ELEM_TENSOR)
            return elt.then(HOLDER)
        if iterates_stream and stream is not None:
            return self.materialise(node, stream.then(link=Link(node.lineno, self.fn, "kept by the comprehension")),
                                    _MATERIALISING_COMPS[type(node)])
        return elt.then(HOLDER, elem=ELEM_TENSOR)

    # -- calls -------------------------------------------------------------------------------------------------
    def call(self, node: ast.Call) -> Optional[Val]:
        func = node.func
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

        if base is not None:
            handled, result = self.method_on_tainted(node, base, meth, args)
            if handled:
                return result
        if meth in ("register_buffer", "register_parameter") and len(args) >= 2 and args[1] is not None:
            assert isinstance(func, ast.Attribute)
            target = ast.Attribute(value=func.value, attr=self.snip(node.args[0], 30).strip("'\""), ctx=ast.Store())
            self.attribute_store(ast.copy_location(target, node), args[1], node)
            return None
        if meth in V.STORE_METHODS and not self._is_module(func):
            self.container_method(node, meth, args, kwargs)
            if meth != "setdefault":
                return None
        if meth in V.BIND_METHODS:
            got = self._first_holding(args, kwargs)
            if got is not None:
                return got.then(HOLDER, Link(node.lineno, self.fn, f"bound by `{self.snip(node, 40)}`"),
                                capture="inspect.BoundArguments")
        return self.function_call(node, name, args, kwargs)

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
            if meth in ("items",):
                return True, base.then(HOLDER, elem=ELEM_PAIR, mapping=False)
            if meth in ("values", "copy", "__iter__"):
                return True, base.then(HOLDER, mapping=False)
            if meth == "keys" and base.mapping:
                return True, None
            if meth in ("pop", "get", "popitem", "popleft", "__getitem__"):
                return True, element_of(base, link)
            if meth in V.STORE_METHODS:
                return False, None
            return True, None
        if base.kind == ITER:
            if meth in ("items", "__iter__"):
                return True, base
            return True, None
        if base.kind == SOURCE:
            if meth in V.SOURCE_TENSOR_METHODS:
                # the innermost statement loop's step: `{k: f.get_tensor(k) for k in f.keys()}` builds the
                # step's dict of one file's tensors, which lives as long as that file's step
                step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
                return True, Val(TENSOR, step, base.chain + (link,), self.fn, label=f"`{self.snip(node, 40)}`")
            if meth in V.SOURCE_ITER_METHODS:
                return True, base.then(ITER, link, elem=ELEM_PAIR)
            if meth in V.SOURCE_SOURCE_METHODS:
                return True, base.then(SOURCE, link)
            return True, None
        return True, None  # a PAIR has no methods that matter

    def container_method(self, node: ast.Call, meth: str, args: Sequence[Optional[Val]],
                         kwargs: Dict[Optional[str], Optional[Val]]) -> None:
        index = _VALUE_ARG.get(meth, 0)
        val = args[index] if index < len(args) else None
        if val is None and meth == "update":
            val = next((v for v in kwargs.values() if v is not None), None)
        if val is None:
            return
        func = node.func
        assert isinstance(func, ast.Attribute)
        root = root_of(func.value)
        slot = self.state.slots.get(root.name) if root.name else None
        kind = slot.kind if slot is not None and not root.through_attribute else None
        held = self.state.env.get(root.name) if root.name else None
        if held is None and method_base_is_tensor(func.value, kind, self.annotations.get(root.name or "", "")):
            return  # Tensor.add / Tensor.put: arithmetic or an indexed copy, not a container
        if val.kind == ITER and meth in ("extend", "update", "extendleft"):
            self.materialise(node, val, f"`.{meth}({self.snip(node.args[0], 30)})`")
            return
        self.store_into(func.value, val, node, meth)

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
                return first.then(HOLDER, link, elem=ELEM_TENSOR)
            return None
        if name in V.TEE and first is not None and first.kind == ITER:
            held = self.materialise(node, first, f"`{name}({self.snip(node.args[0], 30)})`")
            return held.then(ITER, reported=True)
        if name in V.LAZY_WRAPPERS:
            got = next((v for v in list(args) + list(kwargs.values()) if v is not None and v.kind != SOURCE), None)
            if got is None:
                return None
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
        if (name in V.ALIAS_FUNCTIONS or last in ("Parameter", "from_numpy", "as_tensor", "asarray")) \
                and first is not None and first.holds_tensor:
            return first.then(TENSOR, link, parameter=first.parameter or "Parameter" in name)
        if name in V.SPLIT_FUNCTIONS and first is not None and first.kind == TENSOR:
            return first.then(HOLDER, link, elem=ELEM_TENSOR)
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
        configured = self.producer_kind(name) if self.producer_kind is not None else None
        if configured == "tensor":
            # a getter (`weights.get_tensor(n)`): one borrowed tensor, valid for the step that fetched it, as
            # a source's `f.get_tensor(k)` is (the innermost statement loop's iteration, else the call)
            step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
            return Val(TENSOR, step, (Link(node.lineno, self.fn, f"returned by `{self.snip(node, 40)}`"),), self.fn,
                       label=f"`{self.snip(node, 40)}`")
        if V.ITERATOR_FACTORY.search(name) or configured is not None:
            return Val(ITER, 0, (Link(node.lineno, self.fn, f"yielded by `{self.snip(node, 40)}`"),), self.fn,
                       elem=ELEM_PAIR, label=f"`{self.snip(node, 40)}`")
        if name in V.PURE_BUILTINS or V.NON_TENSOR_CALLS.search(name):
            return None
        if self.resolve_call is not None and (any(v is not None for v in args) or
                                              any(v is not None for v in kwargs.values())):
            handled = self.resolve_call(self, node)
            if handled is not _UNRESOLVED:
                return handled  # type: ignore[return-value]
        stream = next((v for v in list(args) + list(kwargs.values()) if v is not None and v.kind == ITER), None)
        if stream is not None and not V.NAME_RETURNING.search(name):
            return stream.then(link=link)  # a wrapper around the iterator (a mapper, tqdm): still a stream
        return None

    def setattr_store(self, node: ast.Call, val: Val) -> None:
        target = ast.Attribute(value=node.args[0], attr=self.snip(node.args[1], 30), ctx=ast.Store())
        ast.copy_location(target, node)
        self.attribute_store(target, val, node)

    # -- kept variables ------------------------------------------------------------------------------------------
    def _kept_variables(self) -> None:
        if not self._kept:
            return
        lifetimes = LoopLifetimes(self.info.node)
        for (name, step), (stmt, val, _) in sorted(self._kept.items(), key=lambda kv: kv[1][2]):
            loop = self.loop_nodes.get(step)
            if loop is None or isinstance(loop, _COMPREHENSIONS):
                continue
            target = getattr(loop, "target", None)
            if target is not None and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                continue  # the loop variable itself: every step rebinds it
            later = lifetimes.read_by_next_iteration(name, loop)
            after = None if later is not None else lifetimes.read_after(name, loop)
            use = later or after
            if use is None:
                continue
            when = "by a later iteration" if later is not None else "after the loop"
            self.report("OWN105", stmt, val, f"variable read {when}",
                        f"`{name}` keeps {self._what(val)} past its step: it is read {when} (line {use.lineno}), "
                        f"when the loader has moved on", f"`{name}` read {when} at line {use.lineno}")


_STMT = {
    ast.Expr: Flow._st_expr, ast.Assign: Flow._st_assign, ast.AnnAssign: Flow._st_annassign,
    ast.AugAssign: Flow.augassign, ast.For: Flow._st_for, ast.AsyncFor: Flow._st_for, ast.While: Flow._st_while,
    ast.If: Flow._st_if, ast.With: Flow._st_with, ast.AsyncWith: Flow._st_with, ast.Try: Flow._st_try,
    ast.Match: Flow._st_match, ast.Return: Flow._st_return, ast.FunctionDef: Flow.nested_def,
    ast.AsyncFunctionDef: Flow.nested_def, ast.Delete: Flow._st_delete, ast.Raise: Flow._st_raise,
    ast.Assert: Flow._st_assert,
}
if hasattr(ast, "TryStar"):
    _STMT[ast.TryStar] = Flow._st_try  # type: ignore[attr-defined]
_EV = {
    ast.Call: Flow.call, ast.Attribute: Flow._ev_attribute, ast.Subscript: Flow._ev_subscript,
    ast.Tuple: Flow._ev_sequence, ast.List: Flow._ev_sequence, ast.Set: Flow._ev_sequence, ast.Dict: Flow._ev_dict,
    ast.ListComp: Flow.comprehension, ast.SetComp: Flow.comprehension, ast.DictComp: Flow.comprehension,
    ast.GeneratorExp: Flow.comprehension, ast.BinOp: Flow._ev_binop, ast.BoolOp: Flow._ev_boolop,
    ast.IfExp: Flow._ev_ifexp, ast.NamedExpr: Flow._ev_namedexpr, ast.Lambda: Flow._ev_lambda,
    ast.Starred: Flow._ev_value, ast.Await: Flow._ev_value, ast.Yield: Flow._ev_yield, ast.YieldFrom: Flow._ev_yield,
}


class _Unresolved:
    """Marker: the resolver did not know the callee (the flow then applies its default rules)."""


_UNRESOLVED = _Unresolved()

__all__ = ["Flow", "Outcome", "IntoParam", "Slot", "State", "_UNRESOLVED"]
