"""The flow's store rules: a tainted value stored somewhere is judged by the lifetime of the place.

A fresh container bound inside the step dies with it (it becomes a holder, and only where *it* goes
matters); anything else (a container bound before the loop, an attribute, a parameter's container, a
global, an enclosing scope's name) outlives the step: OWN101 (a container), OWN102 (an attribute),
OWN104 (a closure or partial), OWN105 (a variable read after its step), OWN106 (a module-level or
class-level name), OWN107 (any of those through a conversion that may be a no-op), and OWN120 (an
in-place write into the borrowed tensor). In summary mode a store into a container the caller passed in
is recorded for the caller to judge. A mixin of :class:`~sanitizer.audit.flow.Flow`: the methods read
the walk's state (``self.state``, ``self.loops``...) and report through :meth:`report`.
"""
from __future__ import annotations

import ast
from dataclasses import replace
from typing import Dict, Optional, Sequence, Tuple

from sanitizer.audit.codes import CODES
from sanitizer.audit.findings import Finding, Link
from sanitizer.audit.index import dotted
from sanitizer.audit.lifetimes import LoopLifetimes
from sanitizer.audit.targets import is_fresh_container, method_base_is_tensor, root_of, subscript_is_tensor
from sanitizer.audit.values import (COMPREHENSIONS, already_kept, ELEM_FIELDS, ELEM_NESTED, ELEM_PAIR, ELEM_TENSOR, HOLDER, ITER, PAIR, SOURCE, TENSOR, IntoParam,
                                    Val, handles_holding)

_CONDITIONAL = frozenset({"OWN101", "OWN102", "OWN106"})  # stores that a no-op conversion makes retentions
# the argument a container method stores: `xs.append(v)`, `d.setdefault(k, v)`
_VALUE_ARG = {"append": 0, "add": 0, "appendleft": 0, "put": 0, "put_nowait": 0, "push": 0, "extend": 0,
              "extendleft": 0, "update": 0, "insert": 1, "setdefault": 1, "__setitem__": 1}

# How a store puts a value into a container by key: the container is then a dict of tensors by name.
_BY_NAME = ("subscript", "setdefault", "update", "__setitem__")


def store_target(stmt: ast.AST) -> Optional[ast.AST]:
    """The place ``stmt`` stores into: an assignment's (first) target, or the receiver of ``x.append(t)``."""
    if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute):
        return stmt.value.func.value
    return None


def attribute_depth(target: Optional[ast.AST]) -> Tuple[Optional[ast.AST], int]:
    """The root of a stored-into expression and how many attributes lie between them: 1 for ``self.w``,
    ``self.w[k]``; 2 for ``self.model.w`` (another object, held by ``self``)."""
    depth = 0
    while isinstance(target, (ast.Attribute, ast.Subscript)):
        depth += isinstance(target, ast.Attribute)
        target = target.value
    return target, depth


def _attribute_depth(stmt: ast.AST) -> int:
    """:func:`attribute_depth` of what ``stmt`` stores into (99 when it stores into nothing it can read)."""
    root, depth = attribute_depth(store_target(stmt))
    return depth if root is not None else 99


class StoreRules:
    """Where a tainted value goes, and whether that place outlives its step."""

    def report(self, code: str, node: ast.AST, val: Val, pattern: str, message: str, last: str) -> None:
        if val.reported:
            return
        if self.report_built(val):
            return
        if val.convert and code in _CONDITIONAL:
            code = "OWN107"
            pattern = f"conditional: {pattern}"
            message = (f"{message}, if `{val.convert}` is a no-op (the tensor is already contiguous, of that "
                       f"dtype, on that device: a GPU-resident loader's normal case); otherwise it is a copy")
        key = (getattr(node, "lineno", 0), getattr(node, "col_offset", 0), code)
        if key in self.seen:
            return
        info = CODES[code]
        line = getattr(node, "lineno", 0)
        finding = Finding(self.path, line, getattr(node, "col_offset", 0) + 1,
                          getattr(node, "end_lineno", None) or line, self.fn, code, pattern, message,
                          val.chain + (Link(line, self.fn, last),), info.fix, consumer=val.consumer,
                          consumer_path=self.path)
        self.seen[key] = finding
        self.out.findings.append(finding)

    def report_built(self, val: Val) -> bool:
        """An object whose constructor stored the tensor (``self.vec = vec``), kept here past the step: the
        keeping statement is that store, reported (once) in place of this one, which keeps nothing new (True
        when so). Not when the tensor was reported kept before it was wrapped (:func:`~.values.already_kept`)."""
        if not val.built_at or already_kept(val, self.out.findings):
            return False
        for made in val.built_at:
            key = (made.line, made.col - 1, made.code)  # type: ignore[attr-defined]
            if made.path != self.path:  # type: ignore[attr-defined]  # (another file's line: keyed by the file too)
                key = key + (made.path,)  # type: ignore[attr-defined,assignment]
            if key not in self.seen:
                self.seen[key] = made  # type: ignore[assignment]
                self.out.findings.append(made)  # type: ignore[arg-type]
        return True

    def _into_param(self, index: int, code: str, node: ast.AST, val: Val, pattern: str, message: str,
                    last: str, for_life: bool = False) -> None:
        before = len(self.out.findings)
        self.report(code, node, val, pattern, message, last)
        if len(self.out.findings) > before:
            self.out.into_param.append(IntoParam(index, self.out.findings.pop(), for_life))

    def _what(self, val: Val) -> str:
        label = val.label or "a yielded tensor"
        if val.capture:
            return f"a {val.capture} holding {label}"
        return label

    def place(self, root_name: Optional[str]) -> Tuple[str, Optional[int]]:
        """('local-step'|'param'|'self'|'global'|'free'|'outer', param index) for a store's root name."""
        if root_name is None:
            return "outer", None
        if root_name == self.self_name():
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
        if val.kind == SOURCE and not val.mapping:
            self._handle_stored(container, val)
            return
        if val.reported and val.holds_tensor and self.infer:  # type: ignore[attr-defined]
            self._infer_kept(container, val, stmt, how)
        if val.reported or not val.holds_tensor:
            return
        root = root_of(container)
        held_by = self.state.env.get(root.name) if root.name and not root.through_attribute else None
        if held_by is not None and two_files(held_by, val) and how == "update":
            self.files_merged(stmt, held_by, val, f"`{self.snip(root.node)}`")
            return
        if held_by is not None and held_by.mapping and held_by.step == val.step:
            return  # `weights[q_name] = qkv[:q]`: into the step's own dict of weights, which dies with the step
        place, index = self.place(root.name)
        if place == "local":
            slot = self.state.slots[root.name]  # type: ignore[index]
            if slot.fresh and val.step in slot.loops and not root.through_attribute:
                if val.obj:  # an object built around the tensor, in a container that dies with the step unless
                    self.built_in.setdefault(root.name, set()).add(val.obj)  # it is returned (Flow._returned_built)
                held = self.state.env.get(root.name)  # type: ignore[arg-type]
                if held is None or held.kind != HOLDER:
                    link = Link(getattr(stmt, "lineno", 0), self.fn, f"stored in `{self.snip(root.node)}` (dies with the step)")
                    self.state.env[root.name] = val.then(  # type: ignore[index]
                        HOLDER, link, elem=ELEM_PAIR if val.kind == PAIR else ELEM_TENSOR,
                        mapping=how in _BY_NAME)  # filled by name: a dict (a re-keyed file's dict, returned)
                outer = self.state.env.get(slot.inside) if slot.inside else None
                if slot.inside and (outer is None or outer.kind != HOLDER):  # `node[leaf] = v`, `node` inside `out`
                    self.state.env[slot.inside] = self.state.env[root.name]  # type: ignore[index]
                if val.kind in (HOLDER, TENSOR) and val.chain and val.chain[0].text.startswith("returned by") \
                        and not root.through_attribute:  # a file's dict, or its entries one by one (`c[k] = a[k]`)
                    self._parked.setdefault(root.name, (stmt, val))  # type: ignore[attr-defined]
                return
            if slot.fresh and val.step in slot.loops and root.through_attribute and not val.capture:
                field = self._fresh_field(container, root.name)
                if field is not None:  # `matched[key].w[part] = weight`: into an object the step builds
                    attr, each = field
                    held = self.state.env.get(root.name)  # type: ignore[arg-type]
                    if held is None or held.kind != HOLDER:
                        link = Link(getattr(stmt, "lineno", 0), self.fn, f"stored in `{self.snip(root.node)}` (dies with the step)")
                        self.state.env[root.name] = val.then(  # type: ignore[index]
                            HOLDER, link, elem=ELEM_FIELDS if each else ELEM_TENSOR, mapping=False, field=attr,
                            field_mapping=how in _BY_NAME, parts=None)
                    outer = self.state.env.get(slot.inside) if slot.inside and not each else None
                    if slot.inside and not each and (outer is None or outer.kind != HOLDER):
                        # `parts = by_key.get(key)` (or a new one stored there), then `parts.tensors.append(t)`:
                        # `by_key` is a container of such objects
                        self.state.env[slot.inside] = self.state.env[root.name].then(elem=ELEM_FIELDS)  # type: ignore[index]
                    return
        code = "OWN104" if val.capture else ("OWN106" if place == "global" else "OWN101")
        pattern = self._store_pattern(how, root, place, val)
        where = {"self": "an attribute of the object", "global": "a module-level name",
                 "free": "an enclosing scope", "param": "a container the caller passed in"}.get(place, "")
        message = (f"{self._what(val)} is stored in `{self.snip(root.node)}`"
                   + (f" ({where})" if where else "") + ", which outlives the loader's step")
        if place == "free" and self.summary_param is not None and val.seed is not None and root.name is not None \
                and not root.through_attribute and self.info.parent is not None \
                and root.name in self.info.parent.locals:
            # a nested function storing what it was handed into its enclosing function's local (kohya's
            # `update_sd(prefix, sd)` filling `state_dict`): where the enclosing function makes the call, that is
            # its own store into its own container (summaries._into_param)
            before = len(self.out.findings)
            self.report(code, stmt, val, pattern, message, f"`{self.snip(stmt, 60)}`")
            if len(self.out.findings) > before:
                self.out.into_param.append(IntoParam(-1, self.out.findings.pop(), free=root.name, how=how))
            return
        self._store_found(code, stmt, val, pattern, message, place, index)
        if place == "local" and root.name is not None and not root.through_attribute \
                and root.name not in self.state.env and self.summary_param is None:
            # the local container now holds borrowed tensors (reported here, once): what it is returned as
            # still hands them out (`state_dict` merged from every file and returned: its function is a
            # producer of a dict, so a caller's store of its tensors is found too). Kept aside, not in the
            # environment: the container's own elements (lists, dicts) are not tensors to judge again
            self._kept_containers.setdefault(root.name, val.then(  # type: ignore[attr-defined]
                HOLDER, Link(getattr(stmt, "lineno", 0), self.fn, f"stored in `{self.snip(root.node)}`"),
                elem=ELEM_PAIR if val.kind == PAIR else ELEM_TENSOR, reported=True,
                mapping=how in _BY_NAME))  # by name: a dict
            if self.infer:  # type: ignore[attr-defined]
                self._infer_kept(container, val, stmt, how)
        elif place == "param" and self.infer and root.name is not None and not root.through_attribute:  # type: ignore[attr-defined]
            self._infer_kept(container, val.then(reported=True), stmt, how)  # a cache the caller passes in

    def _fresh_field(self, container: ast.AST, name: str) -> Optional[Tuple[str, bool]]:
        """``nw.w`` or ``matched[key].w``, where the function gives ``w`` a new container of its own
        (``NetworkWeights(..., w={}, ...)``, ``nw.w = {}``): the attribute's name, and whether ``name`` is a
        container of such objects (``matched[key]``) rather than the object. A store into it is a store into
        an object the step builds, which dies with the step unless the object is kept (what keeps it is
        judged there: A1111's and SD.Next's LoRA module constructors, handed the ``NetworkWeights``)."""
        if not isinstance(container, ast.Attribute):
            return None
        each = isinstance(container.value, ast.Subscript)
        holder = container.value.value if each else container.value  # type: ignore[attr-defined]
        if not (type(holder) is ast.Name and holder.id == name):
            return None
        attr = container.attr
        fresh = self._fresh_fields_cache.get(id(self.info.node))  # type: ignore[attr-defined]
        if fresh is None:
            fresh = set()
            for node in ast.walk(self.info.node):  # type: ignore[attr-defined]
                if isinstance(node, ast.Call):
                    fresh.update(k.arg for k in node.keywords if k.arg and is_fresh_container(k.value))
                elif isinstance(node, ast.Assign) and is_fresh_container(node.value):
                    fresh.update(t.attr for t in node.targets if isinstance(t, ast.Attribute))
            summaries = getattr(self.resolve_call, "__self__", None)  # type: ignore[attr-defined]
            for cls in getattr(getattr(summaries, "index", None), "all_classes", ()):
                for item in cls.node.body:  # a dataclass's `w: dict = field(default_factory=dict)`: new per object
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and isinstance(item.value, ast.Call) and dotted(item.value.func).rpartition(".")[2] == "field" \
                            and any(k.arg == "default_factory" and dotted(k.value) in ("dict", "list", "OrderedDict",
                                                                                        "collections.OrderedDict")
                                    for k in item.value.keywords):
                        fresh.add(item.target.id)
            self._fresh_fields_cache[id(self.info.node)] = fresh  # type: ignore[attr-defined]
        return (attr, each) if attr in fresh else None

    def _infer_kept(self, container: ast.AST, val: Val, stmt: ast.AST, how: str) -> None:
        """Producer inference only: a local container that holds a loader's tensors already reported kept
        (``raw_sd.update(load_file(shard))`` for every shard) still hands them out, and so does what is
        built from its items (``sd[key] = SDNQTensor(raw_sd[key], ...)``, InvokeAI's ``sdnq_sd_loader``):
        returned, it makes its function a producer of a dict, so the caller that installs it with
        ``load_state_dict(sd, assign=True)`` is found. Marked reported: nothing is judged twice. Only such a
        container returned by its name makes a producer (``Flow._produces``): not one of a returned tuple's
        items, nor a generator's yield (mergekit's task results, xtuner's ``(tensors, missing_keys)``)."""
        root = root_of(container)
        if root.name is None or root.through_attribute or root.name in self.state.env:
            return
        if self.place(root.name)[0] not in ("local", "param"):
            return  # (a parameter: a cache the caller passes in, `loaded_files[shard] = load_file(...)`, then
            # `return loaded_files[shard][name]`: AngelSlim's `_get_source_tensor`, a producer of one tensor)
        self._infer_kept_names.add(root.name)  # type: ignore[attr-defined]
        self.state.env[root.name] = val.then(  # type: ignore[index]
            HOLDER, Link(getattr(stmt, "lineno", 0), self.fn, f"stored in `{self.snip(root.node)}`"),
            elem=ELEM_PAIR if val.kind == PAIR else ELEM_TENSOR, reported=True,
            mapping=how in _BY_NAME)

    def _store_found(self, code: str, stmt: ast.AST, val: Val, pattern: str, message: str, place: str,
                     index: Optional[int], for_life: bool = False) -> None:
        """Report a store, or, inside a helper being summarised, note that it stores into its caller's
        argument (a parameter, or the object ``__init__`` builds) for the caller to report."""
        last = f"`{self.snip(stmt, 60)}`"
        if place == "self" and val.self_kept and _attribute_depth(stmt) <= 1:
            return  # what another method kept on this object, put on it again: nothing new kept
        if place == "self":
            self._note_self_kept(stmt, val)
        if self.summary_param is not None and place == "param" and index is not None and index == val.seed \
                and code != "OWN104":
            return  # the argument's own tensors put back into it (`weights.w.update({"up": w["B"]})`): nothing new kept
        if self.summary_param is not None and place == "param" and index is not None and index != val.seed:
            self._into_param(index, code, stmt, val, pattern, message, last, for_life)
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

    def attribute_store(self, target: ast.Attribute, val: Val, stmt: ast.AST, for_life: bool = False,
                        module_keep: bool = False) -> None:
        """``for_life``: the object is a new module, which keeps what it is given for the model's life (no
        step of this function ends its hold). ``module_keep``: a library's keeper makes the object, a module,
        keep it (so does a caller's new object passed in as it, see summaries._into_param)."""
        if val.reported or not val.holds_tensor:
            return
        root = root_of(target.value)
        place, index = self.place(root.name)
        if place == "local" and root.name is not None and not for_life and self._module_tensor_slot(target) \
                and self._built_module(root.name):
            # `lm_head = nn.Linear(h, v); lm_head.weight.data = tensor`: a module the function builds keeps its
            # parameters for its own life (as with `load_state_dict(assign=True)`), whatever then holds it
            for_life = True
        if place == "local" and root.name is not None and not for_life:
            slot = self.state.slots[root.name]
            if slot.fresh and val.step in slot.loops:
                held = self.state.env.get(root.name)
                if held is not None and held.kind == HOLDER and held.obj and held.step == val.step:
                    return  # `embedding.step = data.get("step")` on an object just built around the step's tensors
                published = self._published.get(root.name)  # type: ignore[attr-defined]
                if published is None:
                    self.state.env[root.name] = val.then(HOLDER, Link(getattr(stmt, "lineno", 0), self.fn,
                                                                      f"stored in `{self.snip(target)}`"))
                    return
                # the new object was already stored where it outlives the step (`lora_cache[name] = net`, then
                # `net.bundle_embeddings = bundle_embeddings`): this store puts the tensor there (SD.Next)
                where, line, place = published
                message = (f"{self._what(val)} is stored in the attribute `{self.snip(target)}` of the object stored "
                           f"in `{where}` (line {line}), which outlives the loader's step")
                self._store_found("OWN106" if place == "global" else "OWN102", stmt, val,
                                  "attribute of an object already kept past the step", message, place, None)
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
        self._store_found(code, stmt, val, pattern, message, place, index, module_keep)

    def _note_self_kept(self, stmt: ast.AST, val: Val) -> None:
        """``self.weights = weights`` (or ``self.cache[k] = t``, ``self.parts.append(t)``) found keeping: the
        attribute, for the class's other methods, which read it as what it holds (:mod:`.engine`)."""
        target = store_target(stmt)
        whole = isinstance(target, ast.Attribute)
        while isinstance(target, ast.Subscript):
            target = target.value
        if not (isinstance(target, ast.Attribute) and type(target.value) is ast.Name
                and target.value.id == self.self_name()):
            return
        held = val if whole and val.kind in (TENSOR, HOLDER) else val.then(
            HOLDER, elem=ELEM_PAIR if val.kind == PAIR else ELEM_TENSOR, mapping=not whole and isinstance(stmt, ast.Assign))
        sink = getattr(getattr(self.resolve_call, "__self__", None), "self_kept", None)  # type: ignore[attr-defined]
        cls = self.info.enclosing_class  # type: ignore[attr-defined]
        if sink is not None and cls is not None:
            sink.setdefault(cls.qualname, {}).setdefault(
                target.attr, (held.then(seed=None), getattr(stmt, "lineno", 0), self.info.qualname))  # type: ignore[attr-defined]

    def published(self, target: ast.AST, value: Optional[ast.AST], stmt: ast.AST) -> None:
        """``lora_cache[name] = net``, ``self.current = net`` with ``net`` a new object of this call and nothing
        borrowed in it yet: what is stored in it later is stored where it is kept (:meth:`attribute_store`)."""
        if type(value) is not ast.Name:
            return
        slot = self.state.slots.get(value.id)
        if slot is None or not slot.fresh or value.id in self.state.env:
            return
        root = root_of(target)
        place = self.place(root.name)[0] if root.name is not None else "free"
        if place in ("global", "self"):
            self._published[value.id] = (self.snip(target), getattr(stmt, "lineno", 0), place)  # type: ignore[attr-defined]

    def _built_module(self, name: str) -> bool:
        """Is the local ``name`` bound, once, to a new ``torch.nn`` module (``nn.Linear(h, v)``), or to a new
        object of an audited class that is one (:meth:`~.summaries.ModuleAnalysis.is_module_class`)? A plain
        object given a ``weight`` attribute and returned is handed on (onnxruntime-genai's ``TensorModule``)."""
        memo = getattr(self, "_built_modules", None)
        if memo is None:
            found: Dict[str, int] = {}
            for sub in ast.walk(self.info.node):
                if isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name):
                    v = sub.value
                    func = dotted(v.func) if isinstance(v, ast.Call) else ""
                    ok = func.startswith(("nn.", "torch.nn.")) and func.rpartition(".")[2][:1].isupper()
                    if not ok and isinstance(v, ast.Call) and isinstance(v.func, ast.Name):
                        summaries = getattr(self.resolve_call, "__self__", None)  # type: ignore[attr-defined]
                        got = summaries.constructed_class(self, v.func.id) if summaries is not None else None
                        ok = got is not None and got[0].is_module_class(got[1])
                    found[sub.targets[0].id] = found.get(sub.targets[0].id, 0) + (1 if ok else 100)
            memo = self._built_modules = {n for n, c in found.items() if c == 1}
        return name in memo

    @staticmethod
    def _module_tensor_slot(target: ast.Attribute) -> bool:
        """``m.weight``, ``m.weight.data``, ``m.bias.data``: a module's parameter slot (not any attribute)."""
        attr = target.attr
        if attr == "data" and isinstance(target.value, ast.Attribute):
            attr = target.value.attr
        return attr in ("weight", "bias")

    def _handle_stored(self, container: ast.AST, val: Val) -> None:
        """``key_to_handle[key] = handle``, ``handles.append(safe_open(p))``: a local container now holds a
        loader's handle, and hands it out again (its lookups, items and loop targets are handles). A handle
        is no tensor: keeping it is no retention (its tensors are judged where they are fetched)."""
        root = root_of(container)
        if root.name is None or root.through_attribute:
            return  # `self._handles[f] = h`: a getter object's (:class:`~sanitizer.audit.producers.SelfSources`)
        held = self.state.env.get(root.name)
        if held is None:
            self.state.env[root.name] = handles_holding(val)
        elif held.kind != SOURCE:
            return  # a container of tensors too: judged as it is

    def _read_as_mapping(self, target: ast.Subscript) -> bool:
        """Does the function itself read ``target``'s base as a dict? Its ``.items()``, ``.keys()`` or
        ``.values()`` are called (``for k, v in state_.items(): ... state_[k] = v.clone()``), or the index is
        a key taken from a dict's ``.items()``/``.keys()`` (``for k, v in state.items(): sd[idx][k] = ...``):
        an optimizer's per-parameter state, ``{"step": t, "exp_avg": t}``, read out of a loaded dict of
        dicts. A tensor has no ``.items()`` and is not indexed by a dict's keys: a store into it is a
        store into that dict (its new value judged as such), not an in-place write."""
        memo = getattr(self, "_mapping_reads", None)
        if memo is None:
            receivers: set = set()
            keys: set = set()
            for sub in ast.walk(self.info.node):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and not sub.args \
                        and sub.func.attr in ("items", "keys", "values"):
                    receivers.add(ast.dump(sub.func.value))
                    continue
                if isinstance(sub, (ast.For, ast.AsyncFor, ast.comprehension)) and isinstance(sub.iter, ast.Call) \
                        and isinstance(sub.iter.func, ast.Attribute) and sub.iter.func.attr in ("items", "keys"):
                    key = sub.target.elts[0] if isinstance(sub.target, ast.Tuple) and sub.target.elts \
                        and sub.iter.func.attr == "items" else sub.target
                    if isinstance(key, ast.Name):
                        keys.add(key.id)
            memo = self._mapping_reads = (receivers, keys)
        receivers, keys = memo
        return ast.dump(target.value) in receivers or (isinstance(target.slice, ast.Name) and target.slice.id in keys)

    def subscript_store(self, target: ast.Subscript, val: Optional[Val], stmt: ast.AST) -> None:
        aliased = self._aliases.get(target.value.id) if self._aliases and type(target.value) is ast.Name else None
        if aliased:  # `dst[i] = w`, `dst` a loop target over (name, container) pairs: into each container
            for expr in aliased:
                self.subscript_store(ast.copy_location(ast.Subscript(value=expr, slice=target.slice, ctx=ast.Store()),
                                                       target), val, stmt)
            return
        base = self.ev(target.value)
        self.ev(target.slice)
        nested = root_of(target.value).name if type(target.value) is ast.Subscript else None
        if base is not None and base.kind == TENSOR and (_names_a_key(target.slice) or
                                                         self._read_as_mapping(target) or
                                                         (nested is not None and nested in self._nested_filled)):
            # `tensors["scale"] = ...`: a string indexes no tensor, so what a getter declared `=tensor` returned
            # here is a dict of them (a helper that fills one): a store into it, not an in-place write
            base = base.then(HOLDER, mapping=True)
            if type(target.value) is ast.Name and target.value.id in self.state.env:
                self.state.env[target.value.id] = base
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
        if root.name and not root.through_attribute and (_read_back_from(stmt, target, root.name)
                                                         or self._put_back_in_loop(stmt, target, root.name)):
            return  # `out[k] = out[k].to(device)`: what the container already held, put back (judged where it got in)
        if nested is not None and val.holds_tensor:
            # `grouped[stem][leaf] = value`: `grouped` holds containers by name, a tensor in each. Its items
            # are dicts, so this same store seen again (the loop's second pass) is no write into a tensor
            # (InvokeAI's LoRA key grouping, read as in-place writes into the file's tensors)
            self._nested_filled.add(nested)
        self.store_into(target.value, val, stmt, "subscript")
        held = self.state.env.get(nested) if nested is not None and val.holds_tensor else None
        if held is not None and held.kind == HOLDER and held.elem == ELEM_TENSOR and not held.field:
            self.state.env[nested] = held.then(elem=ELEM_NESTED)  # its items are containers (dicts, lists) of tensors

    def files_merged(self, node: ast.AST, first: Val, second: Val, into: str) -> None:
        """One file's whole dict merged with another's (``merged = load(a); merged.update(load(b))``,
        ``{**base, **patch}``): the first file's tensors are kept past the second file's fetch, in the merged
        dict (nunchaku's ``merge_safetensors``). Named by the file kept, not the one merged in."""
        self.report("OWN101", node, first, "whole-file dict kept past the next file's fetch",
                    f"{self._what(first)} is kept in {into} while {self._what(second)} is fetched and merged into "
                    f"it: the first file's tensors outlive the next file's fetch", f"`{self.snip(node, 60)}`")

    def _put_back_in_loop(self, stmt: ast.AST, target: ast.Subscript, name: str) -> bool:
        """``for k, v in tensors.items(): tensors[k] = v.to(torch.bfloat16)``: each entry converted and put back
        into the dict it was read from (nunchaku's ``to_diffusers``), as ``name[k] = name[k].to(...)`` is."""
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1 or stmt.targets[0] is not target:
            return False
        node = stmt.value
        while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
            node = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
                (node.value if isinstance(node, (ast.Attribute, ast.Subscript)) else None)
            if node is None:
                return False
        if type(node) is not ast.Name:
            return False
        for step in self.loops:  # type: ignore[attr-defined]  (the loops the statement is in)
            loop = self.loop_nodes.get(step)  # type: ignore[attr-defined]
            it, tgt = getattr(loop, "iter", None), getattr(loop, "target", None)
            if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "values")
                    and type(it.func.value) is ast.Name and it.func.value.id == name):
                continue
            value_target = tgt.elts[-1] if isinstance(tgt, ast.Tuple) and it.func.attr == "items" and tgt.elts else tgt
            if type(value_target) is ast.Name and value_target.id == node.id:  # type: ignore[attr-defined]
                return True
        return False

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
        elif isinstance(target, ast.Name) and isinstance(node.op, ast.BitOr) and val.kind == HOLDER:
            # `state_dict |= load_file(f)`: a dict merged in place (PEP 584), as `state_dict.update(...)`
            # (OneTrainer's sub-module loader merges every shard so)
            self.store_into(target, val, node, "update")

    def inplace(self, node: ast.AST, val: Val, how: str, last: str) -> None:
        if val.kind != TENSOR or val.maybe:
            return
        self.report("OWN120", node, replace(val, reported=False) if val.reported else val, how,
                    f"in-place write into {self._what(val)} ({how}): with a borrowing loader this writes into "
                    f"the loader's staging buffer", last)

    def setattr_store(self, node: ast.Call, val: Val) -> None:
        target = ast.Attribute(value=node.args[0], attr=self.snip(node.args[1], 30), ctx=ast.Store())
        ast.copy_location(target, node)
        self.attribute_store(target, val, node)

    def container_method(self, node: ast.Call, meth: str, args: Sequence[Optional[Val]],
                         kwargs: Dict[Optional[str], Optional[Val]]) -> None:
        index = _VALUE_ARG.get(meth, 0)
        val = args[index] if index < len(args) else None
        if val is None and meth == "update":
            val = next((v for v in kwargs.values() if v is not None), None)
        if val is None:
            assert isinstance(node.func, ast.Attribute)
            self.filled_untainted(node.func.value)
            return
        func = node.func
        assert isinstance(func, ast.Attribute)
        aliased = self._aliases.get(func.value.id) if self._aliases and type(func.value) is ast.Name else None
        if aliased:  # `dst.append(w)`, `dst` a loop target over containers: into each of them
            for expr in aliased:
                call = ast.Call(func=ast.Attribute(value=expr, attr=meth, ctx=ast.Load()), args=node.args,
                                keywords=node.keywords)
                self.container_method(ast.copy_location(call, node), meth, args, kwargs)
            return
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

    def _kept_variables(self) -> None:
        if not self._kept:
            return
        lifetimes = LoopLifetimes(self.info.node)
        for (name, step), (stmt, val, _) in sorted(self._kept.items(), key=lambda kv: kv[1][2]):
            loop = self.loop_nodes.get(step)
            if loop is None or isinstance(loop, COMPREHENSIONS):
                continue
            target = getattr(loop, "target", None)
            if target is not None and any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(target)):
                continue  # the loop variable itself: every step rebinds it
            later = lifetimes.read_by_next_iteration(name, loop)
            after = None if later is not None else lifetimes.read_after(name, loop)
            use = later or after
            if use is None or (after is not None and step not in self._stream_steps
                               and lifetimes.returned_fresh(name, loop, after, stmt)):
                continue  # the last iteration's value, returned before anything fetches again
            when = "by a later iteration" if later is not None else "after the loop"
            self.report("OWN105", stmt, val, f"variable read {when}",
                        f"`{name}` keeps {self._what(val)} past its step: it is read {when} (line {use.lineno}), "
                        f"when the loader has moved on", f"`{name}` read {when} at line {use.lineno}")


def two_files(held_by: Val, val: Val) -> bool:
    """Is ``val`` another file's whole dict merged into ``held_by``, one file's dict (``state_dict =
    load(first); state_dict.update(load(second))``, nunchaku's ``merge_safetensors``)? The first file's tensors
    are then kept past the second file's fetch, in the merged dict: not the step's own dict any more."""
    if not (val.kind == HOLDER and val.mapping and val.chain and held_by.chain):
        return False
    first, other = held_by.chain[0], val.chain[0]
    return first.text.startswith("returned by") and other.text.startswith("returned by") and \
        (first.line, first.function, first.path, first.text) != (other.line, other.function, other.path, other.text)


def _read_back_from(stmt: ast.AST, target: ast.Subscript, name: str) -> bool:
    """Is ``stmt`` ``name[k] = name[k].to(device)``: the value read out of the very container it is stored
    back into (ColossalAI's ``gather_state_dict_fast``, ``returned_state_dict[k] = returned_state_dict[k].to(device)``)?
    Or re-keyed in it, ``name[new] = name.pop(old)`` (CogVideo's ``update_state_dict_inplace``)? The container
    held that tensor already; whether it may is judged where the tensor got in."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1 or stmt.targets[0] is not target:
        return False
    node = stmt.value
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("pop", "get", "__getitem__") and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == name:
                return True
            node = node.func.value
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name:
                return True
            node = node.value
        else:
            return False


def _names_a_key(index: ast.AST) -> bool:
    """Is a subscript's index a string (``"scale"``, ``f"{prefix}.weight"``): a dict's key, never a tensor's?"""
    return isinstance(index, ast.JoinedStr) or (isinstance(index, ast.Constant) and isinstance(index.value, str))


__all__ = ["StoreRules", "two_files"]
