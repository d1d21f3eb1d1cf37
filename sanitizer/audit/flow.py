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
import re
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.calls import CallRules
from sanitizer.audit.findings import Finding, Link
from sanitizer.audit.index import FunctionInfo, annotation_text, dotted
from sanitizer.audit.snippets import Snippets
from sanitizer.audit.stores import StoreRules, two_files
from sanitizer.audit.targets import (binding_kind, is_empty_container, is_fresh_container, rebound_before_leaving,
                                     root_of)
from sanitizer.audit.values import (ELEM_FIELDS, ELEM_ENUM_PAIR, ELEM_ENUM_TENSOR, ELEM_PAIR, ELEM_TENSOR, HOLDER,
                                    ITER, PAIR, SOURCE, TENSOR, UNRESOLVED, IntoParam, Outcome, Slot, State, Val,
                                    built_class, element_of, handle_of, handles_holding, is_handles)

_ACCESSORS = (ast.Attribute, ast.Subscript, ast.Call)  # values that may alias a container of a parameter/self
_MATERIALISING_COMPS = {ast.ListComp: "list comprehension", ast.SetComp: "set comprehension",
                        ast.DictComp: "dict comprehension"}


Resolver = Callable[["Flow", ast.Call], Optional[Val]]

# Expression handlers one walk nests (its helpers' walks included) before it evaluates the rest of an
# expression iteratively (:meth:`Flow._ev_flat`). Each level costs two or three Python frames; a
# generated 900-term sum is a BinOp chain 900 levels deep, which Python compiles (up to about 3,000) but
# which overflowed the recursion limit (1,000 frames) of a recursive walk.
FLAT_DEPTH = 48
# Expressions with a scope or an order of their own (a lambda's body is not evaluated, a comprehension
# binds its targets before its element): evaluated by their handler, never taken apart by _ev_flat.
_OWN_ORDER = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_MISSING = object()
# An unknown function named for turning one dict of weights into another (its keys renamed or filtered):
# ``_remap_adapter_state_dict_for_load``, ``convert_peft_adapter_state_dict``, ``rename_keys``
_REMAPPER = re.compile(r"_?(remap|convert|rename|translate|map|fix|filter|prepare|preprocess|adapt)\w*")
# A call spelt as a class (`Patch(...)`, `patches.ModelPatchRaw(...)`): an object built around its arguments
_CLASS_CALL = re.compile(r"^(\w+\.)*_?[A-Z]\w*$")


def _handed_names(expr: ast.AST) -> List[str]:
    """The names whose objects ``return expr`` hands out: the expression itself, the elements of a tuple, list
    or dict it builds, a call's arguments (``Patch(layers=layers)``), not what is only read from (``w.weight.shape``:
    the object itself is not returned)."""
    out: List[str] = []
    stack = [expr]
    while stack:
        node = stack.pop()
        if type(node) is ast.Name:
            out.append(node.id)  # type: ignore[attr-defined]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            stack.extend(node.elts)
        elif isinstance(node, ast.Dict):
            stack.extend(v for v in node.values if v is not None)
        elif isinstance(node, ast.Call) and _CLASS_CALL.match(dotted(node.func) or ""):
            stack.extend(node.args)  # an object built around them (`len(layers)` returns no object of theirs)
            stack.extend(kw.value for kw in node.keywords)
        elif isinstance(node, ast.Starred):
            stack.append(node.value)
    return out


class Flow(StoreRules, CallRules):
    """One walk of one function: the driver, the statements, branches and loops, and expressions; the
    store rules (OWN101-OWN106, OWN120) are :class:`~sanitizer.audit.stores.StoreRules`, the call rules
    (helpers, producers, views, OWN103) :class:`~sanitizer.audit.calls.CallRules`. ``resolve_call`` handles calls into same-module functions (summaries);
    ``summary_param`` is the index of the seeded parameter in summary mode (None: root mode)."""

    # Producer inference (:mod:`.producers`): record what the function returns or yields from a producer
    infer: bool = False
    # ``self.<attr>`` that holds a loader handle (``self.f = safe_open(...)`` in ``__init__``): its Val, or None
    attribute_source: Optional[Callable[["Flow", ast.Attribute], Optional[Val]]] = None

    def __init__(self, path: str, info: FunctionInfo, seeds: Dict[str, Val], module_globals: Sequence[str],
                 snippets: Snippets, resolve_call: Optional[Resolver] = None, summary_param: Optional[int] = None,
                 module_aliases: Sequence[str] = ("torch", "np", "numpy"),
                 producer_kind: Optional[Callable[[str], Optional[str]]] = None, hands_on: bool = False,
                 depth: int = 0):
        self.path = path
        self._depth = depth  # expression handlers nested now, counting the caller's walk (a helper's summary)
        self._memo: Dict[int, Optional[Val]] = {}  # values of the parts _ev_flat evaluated first
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
        self._stream_steps: set = set()  # loops over a weights iterator: it is resumed once more at their end
        self._aliases: Dict[str, Tuple[ast.expr, ...]] = {}  # loop targets that name one of a literal's containers
        self._attrs = False  # some attribute was given a borrowed tensor (kept in the env as `self.weight`)
        self._comp_steps: set = set()  # the steps that are comprehensions' (not statement loops)
        self._rebinds: dict = {}  # the function's statements by block (stores.rebound_before_leaving), built once
        self._open_handles: List[int] = []  # lines of the `with <loader handle>` blocks the walk is inside
        # Whole-file dicts kept in a step-local container (`state_dict["model"] = load(path)`): the store,
        # by container; once a later whole-file fetch in the step ends their validity, stale until rebound
        self._parked: Dict[str, Tuple[ast.AST, Val]] = {}
        self._stale: Dict[str, Tuple[ast.AST, Val, ast.AST]] = {}
        # of those, the names bound to a file's dict or tensor itself (`base = load_file(a)`), not containers
        # it was stored in; their reads past the next file are reported at the end, unless the function
        # already reports those tensors (a merge of the two files, a container they were stored in)
        self._named: set = set()
        self._named_reads: List[Tuple[ast.AST, Val, ast.AST, ast.Name]] = []
        self._onloaded: Dict[str, ast.AST] = {}  # modules onloaded by the `with align_module_device(m)` the walk is in
        self._inside_handle: Dict[str, ast.AST] = {}  # containers bound inside a `with <handle>`: where
        self._kept_containers: Dict[str, Val] = {}  # local containers a reported store filled (see store_into)
        self._fresh_fields_cache: Dict[int, set] = {}  # attributes the function gives a new container (Stores._fresh_field)
        # new objects of this call stored, still holding nothing borrowed, where they outlive the step: by name,
        # (where, line, place) (Stores.published)
        self._published: Dict[str, Tuple[str, int, str]] = {}
        # objects of the project's classes built around a borrowed tensor in this walk: by class, how to report
        # the constructor's own stores of it (summaries.ModuleAnalysis._apply; used when the object is returned)
        self.built_stores: Dict[str, List[Callable[[], None]]] = {}
        self.built_in: Dict[str, set] = {}  # local containers such objects were stored in: their classes
        self._nested_filled: set = set()  # locals filled as `x[a][b] = tensor`: their items are containers
        self._returning = False  # evaluating a `return`'s value (Flow._read_after_next_file)
        self._infer_kept_names: set = set()  # inference only: such containers in the environment (_infer_kept)
        self.state = State()
        self.out = Outcome()
        self.seen: Dict[Tuple[int, int, str], Finding] = {}
        self._kept: Dict[Tuple[str, int], Tuple[ast.AST, Val, int]] = {}
        self.annotations: Dict[str, str] = {}
        params = info.params + [a for a in (info.vararg, info.kwarg) if a is not None]
        for i, arg in enumerate(params):
            self.state.slots[arg.arg] = Slot(False, (), "unknown", i)
            if arg.annotation is not None:
                self.annotations[arg.arg] = annotation_text(arg.annotation)
        for name, val in seeds.items():
            self.state.env[name] = val
        self._lazy_mapping_params()

    # -- driving ---------------------------------------------------------------------------------------------
    def run(self) -> Outcome:
        self.block(self.info.node.body)  # type: ignore[attr-defined]
        self._kept_variables()
        self._named_read_late()
        return self.out

    def _named_read_late(self) -> None:
        """``base = load_file(a)``, then ``lora = load_file(b)``, then ``merge(base, lora)``: ``base`` is read
        past its step (valid until the next file), reported once, unless a finding of the function already
        names those tensors (``{**base, **lora}``: the merge; ``kept[k] = base[k]``: the store)."""
        for stmt, val, ended, node in self._named_reads:
            origin = val.chain[0] if val.chain else None
            if any(f.chain and f.chain[0] == origin and f.function == self.fn for f in self.out.findings):
                continue
            what = "a file's tensor" if val.kind == TENSOR else "whole-file dict"
            self.report("OWN101", stmt, val, f"{what} kept past the next file's fetch",
                        f"{self._what(val)} is bound to `{node.id}` while `{self.snip(ended, 40)}` (line "
                        f"{getattr(ended, 'lineno', 0)}) fetches the next file, and read after it (line "
                        f"{node.lineno})", f"`{self.snip(stmt, 60)}`")

    def block(self, stmts: Sequence[ast.stmt]) -> None:
        for stmt in stmts:
            self.stmt(stmt)



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
        if val is None and type(node.value) is ast.Call and len(node.targets) == 1 \
                and type(node.targets[0]) is ast.Name:
            val = self._remapped(node.targets[0].id, node.value)  # type: ignore[arg-type]
        for target in node.targets:
            self.assign(target, val, node.value, node)

    def _st_annassign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            val = self.ev(node.value)
            if val is None and isinstance(node.target, ast.Name):
                val = self._lazy_mapping(node)
            self.assign(node.target, val, node.value, node)

    def _lazy_mapping(self, node: ast.AnnAssign) -> Optional[Val]:
        """``hf_state_dict: Mapping[str, torch.Tensor] = hf_pretrained.state`` (Megatron-Bridge) bound from
        something the audit cannot read, in a project where a class's ``__getitem__`` reads a loader (a lazy
        ``Mapping`` of weights, :func:`~sanitizer.audit.producers.record_mapping`): a mapping of weights,
        each lookup a tensor valid for the step that made it, as for a ``Mapping``-annotated attribute."""
        inferred = self.inferred_producers()
        if inferred is None or not inferred.mappings or not V.LAZY_MAPPING_TYPE.match(annotation_text(node.annotation)):
            return None
        some = next(iter(inferred.mappings.values()))
        return Val(SOURCE, 0, (Link(node.lineno, self.fn, f"`{self.snip(node.target)}` annotated a Mapping (a "
                                                          f"class's `__getitem__` may read a loader: `{some.qualname}`, "
                                                          f"{some.path}:{some.line})"),), self.fn, mapping=True)

    def _lazy_mapping_params(self) -> None:
        """``def materialize(model, disk_map: DiskMap)`` (DiffSynth): a parameter annotated with a class of the
        project whose ``__getitem__`` reads a loader is a mapping of weights, each lookup a tensor valid for
        the step that made it, as the same class kept on ``self`` is (:class:`~.producers.SelfSources`)."""
        inferred = self.inferred_producers()
        if inferred is None or not inferred.mappings:
            return
        for arg in self.info.params:
            if arg.arg in self.state.env or arg.annotation is None:
                continue
            cls = V.lazy_mapping_class(annotation_text(arg.annotation), inferred.mappings)
            if not cls:
                continue
            got = inferred.mappings[cls]
            self.state.env[arg.arg] = Val(SOURCE, 0, (Link(arg.lineno, self.fn, f"`{arg.arg}: {cls}` (a class whose "
                                                                                 f"`__getitem__` reads a loader: "
                                                                                 f"`{got.qualname}`, {got.path}:"
                                                                                 f"{got.line})"),), self.fn,
                                          mapping=True)

    def _st_for(self, node: ast.AST) -> None:
        self.loop(node, self.ev(node.iter))  # type: ignore[attr-defined]

    def _st_while(self, node: ast.While) -> None:
        self.ev(node.test)
        self.loop(node, None)

    def _st_if(self, node: ast.If) -> None:
        self.ev(node.test)
        self.branches([node.body, node.orelse])

    def _st_with(self, node: ast.AST) -> None:
        opened = 0
        onloaded: List[str] = []
        for item in node.items:  # type: ignore[attr-defined]
            val = self.ev(item.context_expr)
            module = self._onloads(item.context_expr)
            if module and module not in self._onloaded:
                self._onloaded[module] = item.context_expr  # type: ignore[assignment]
                onloaded.append(module)
            if item.optional_vars is not None:
                self.assign(item.optional_vars, val, item.context_expr, node)
            if val is not None and val.kind == SOURCE and val.chain:
                self._open_handles.append(val.chain[0].line)  # closed (its bytes freed) at the block's end
                opened += 1
        try:
            self.block(node.body)  # type: ignore[attr-defined]
        finally:
            closing = self._open_handles[len(self._open_handles) - opened:]
            del self._open_handles[len(self._open_handles) - opened:]
            for module in onloaded:
                del self._onloaded[module]
        if closing and self._inside_handle:
            self._handles_closed(node, set(closing))

    @staticmethod
    def _onloads(expr: ast.AST) -> str:
        """``align_module_device(module, "cpu")``: the module it onloads for its block (its dotted text), or
        "" (see :data:`~sanitizer.audit.vocabulary.ONLOADING_CONTEXTS`)."""
        if not (isinstance(expr, ast.Call) and expr.args
                and dotted(expr.func).rpartition(".")[2] in V.ONLOADING_CONTEXTS):
            return ""
        name = dotted(expr.args[0])
        return "" if not name or name.startswith("?") else name

    def onloaded_read(self, node: ast.Call, meth: str) -> Optional[Val]:
        """``module.state_dict()`` (``named_parameters()``...) inside ``with align_module_device(module)``:
        the offload loader's tensors, valid for the step the block runs in (the innermost statement loop's
        iteration, else the call); a dict of them by name, or an iterable of them (pairs for ``named_*``)."""
        func = node.func
        if not isinstance(func, ast.Attribute) or meth not in V.ONLOADED_READS:
            return None
        ctx = self._onloaded.get(dotted(func.value))
        if ctx is None:
            return None
        step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
        link = Link(node.lineno, self.fn, f"`{self.snip(node, 40)}` of a module onloaded by "
                                          f"`{self.snip(ctx, 40)}` (line {getattr(ctx, 'lineno', 0)})")
        return Val(HOLDER, step, (link,), self.fn, label=f"`{self.snip(node, 40)}`", mapping=meth == "state_dict",
                   elem=ELEM_PAIR if meth.startswith("named_") else ELEM_TENSOR)

    def _handles_closed(self, node: ast.AST, lines: set) -> None:
        """The ``with`` closed its handles: a container of their tensors bound inside it (``tensors = {n:
        f.get_tensor(n) for n in names}``, one file's dict while the handle is open) is stale from here;
        a read after the block keeps them past the close."""
        for name, stmt in list(self._inside_handle.items()):
            held = self.state.env.get(name)
            first = held.chain[0] if held is not None and held.chain else None
            if held is not None and held.kind == HOLDER and first is not None and first.line in lines \
                    and not first.path and first.text.startswith("opened by") and not held.reported:
                self._stale[name] = (stmt, held, node)
                del self._inside_handle[name]

    def _remapped(self, name: str, call: ast.Call) -> Optional[Val]:
        """``sd = remap_keys(sd, prefix)``, ``sd = tuner._remap_adapter_state_dict_for_load(sd, name)``: a dict
        of weights rebound to what an unknown function makes of it is taken to be the same tensors under
        new names (the key remappers every engine has), not a new dict of nothing borrowed."""
        fname = dotted(call.func)
        remapper = bool(_REMAPPER.match(fname.rpartition(".")[2]))
        if fname in V.PURE_BUILTINS or V.NON_TENSOR_CALLS.search(fname) or (
                V.NAME_RETURNING.search(fname) and not remapper):
            return None
        summaries = self._summaries()
        if summaries is not None and summaries.callee(self, call) is not None:
            # an audited function: its summary said what it returns (SimpleTuner's `convert_ltx2_audio_vae(sd)`
            # returns the module it installed `sd` into, with assign=True, reported there), not a guess by name
            return None
        for arg in list(call.args) + [k.value for k in call.keywords]:
            if type(arg) is not ast.Name or (arg.id != name and not remapper):  # type: ignore[attr-defined]
                continue
            held = self.state.env.get(arg.id)  # type: ignore[attr-defined]
            if held is not None and held.kind == HOLDER and held.mapping:
                return held.then(HOLDER, Link(call.lineno, self.fn, f"remapped by `{self.snip(call, 40)}`"),
                                 mapping=True)
        return None

    def next_file_fetched(self, call: ast.AST) -> None:
        """A whole-file dict was just fetched (``load_file(path)``, ``torch.load(mmap=True)``, a helper
        inferred to return one): the dicts fetched earlier in the step and parked in a step-local container
        are past their step now ("valid until the next file"); a later read of that container keeps them."""
        for name, (stmt, val) in list(self._parked.items()):
            held = self.state.env.get(name)
            if held is not None and held.kind in (HOLDER, TENSOR):
                self._stale[name] = (stmt, val, call)
        self._parked.clear()

    def _read_after_next_file(self, node: ast.Name) -> None:
        stmt, val, ended = self._stale.pop(node.id)
        if self._returning and val.obj and self.built_stores.get(val.obj):
            return  # an object built around the tensors, returned: its constructor's store is the finding (once)
        if node.id in self._named:
            self._named_reads.append((stmt, val, ended, node))
            return
        if isinstance(ended, (ast.With, ast.AsyncWith)):
            self.report("OWN101", stmt, val, "container of a handle's tensors read past its close",
                        f"{self._what(val)} is kept in `{node.id}` past the close of its handle (the `with` at "
                        f"line {ended.lineno}), and read after it (line {node.lineno})", f"`{self.snip(stmt, 60)}`")
            return
        self.report("OWN101", stmt, val, "a file's tensors kept past the next file's fetch",
                    f"{self._what(val)} is kept in `{node.id}` while `{self.snip(ended, 40)}` (line "
                    f"{getattr(ended, 'lineno', 0)}) fetches the next file, and read after it (line {node.lineno})",
                    f"`{self.snip(stmt, 60)}`")

    def _returned_past_close(self, node: ast.Return, val: Val) -> None:
        """``with safe_open(p) as f: return {k: f.get_tensor(k) for k in f.keys()}``: a dict of the handle's
        tensors is one file's dict while the handle is open (each kept while the next is fetched, used in
        that block); returned from inside the block, it is handed out as the ``with`` closes the handle
        (a ring's bytes freed), having kept each tensor past the next fetch: a retention. One tensor
        returned is handed on, as anywhere."""
        first = val.chain[0] if val.chain else None
        if first is None or first.path or first.line not in self._open_handles \
                or not first.text.startswith("opened by"):
            return
        self.report("OWN101", node, val, "container of a handle's tensors returned past its close",
                    f"{self._what(val)} is returned in a container from inside the `with` that closes its handle: "
                    f"each was kept while the next was fetched, and the caller gets them after the close",
                    f"`{self.snip(node, 60)}`")

    def _st_try(self, node: ast.AST) -> None:
        """The body, then its ``else`` or one of its handlers: alternatives, joined as an ``if``'s arms are (a
        handler's ``sd = None`` does not undo what the body bound on the path that raised nothing: SD.Next's
        ``read_state_dict`` returns the file's dict, or None when loading failed)."""
        self.block(node.body)  # type: ignore[attr-defined]
        handlers = [handler.body for handler in node.handlers]  # type: ignore[attr-defined]
        if handlers:
            self.branches([node.orelse] + handlers)  # type: ignore[attr-defined]
        else:
            self.block(node.orelse)  # type: ignore[attr-defined]
        self.block(node.finalbody)  # type: ignore[attr-defined]

    def _st_match(self, node: ast.AST) -> None:
        self.ev(node.subject)  # type: ignore[attr-defined]
        self.branches([case.body for case in node.cases] + [[]])  # type: ignore[attr-defined]

    def _st_return(self, node: ast.Return) -> None:
        if node.value is not None:
            self._returning = True
            try:
                val = self.ev(node.value)
            finally:
                self._returning = False
            if val is None and self._kept_containers and type(node.value) is ast.Name:
                val = self._kept_containers.get(node.value.id)  # type: ignore[attr-defined]
            if self.infer and val is not None and val.seed is None and self.out.produced is None \
                    and self._produces(node.value, val):
                self.out.produced = val  # (before the report below: what it hands on is what it produces)
            if val is not None and val.kind == HOLDER and self._open_handles and val.seed is None:
                self._returned_past_close(node, val)
            if val is not None and self.summary_param is not None and val.seed is not None:
                self.out.returns = self.out.returns or val
            elif val is not None and self.summary_param is None and val.built_at and not val.obj \
                    and not self.hands_on and not val.reported:
                # an object a helper built around this call's tensors (`model = supported_type.try_build_from_
                # state_dict(sd, path)`), returned: as below, its constructor's store keeps the view (Forge)
                self.report_built(val)
            elif val is not None and self.summary_param is None and val.obj and val.step == self.func_step \
                    and not self.hands_on and self.built_stores.get(val.obj):
                # `return cls(up=values["up"], ...)` of a class whose `__init__` stores it (`self.up = up`): the
                # object only passes through here; the line that keeps the view is the constructor's store
                # (InvokeAI's LoRA layers' `from_state_dict_values`, counted at each layer's `__init__`)
                for emit in self.built_stores.pop(val.obj):
                    emit()
            elif val is not None and self.summary_param is None and val.obj and val.step == self.func_step \
                    and not self.hands_on and not self._built_inside(val):
                # `return KVScales(k, v)` around a tensor this call fetched (its step): a bare tensor returned
                # is handed on, but an object built around it is how a loader keeps it (TGI's get_kv_scales)
                self.report("OWN101", node, val, f"kept by a new `{val.obj}` the call returns",
                            f"{self._what(val)} is kept by the `{val.obj}` that `{self.info.name}` builds and "
                            f"returns, which outlives the loader's step", f"`{self.snip(node, 60)}`")
            if self.built_stores and self.summary_param is None and not self.hands_on:
                self._returned_built(node.value, val)
            if val is not None and val.holds_tensor and not val.reported and self.summary_param is None \
                    and not getattr(self, "infer", False):
                self._returned_into_cache(node, val)

    def _returned_into_cache(self, node: ast.Return, val: Val) -> None:
        """``@functools.lru_cache(maxsize=1) def get_tensor(self, name): ... return f.get_tensor(name)``: the
        cache the decorator keeps (on the function, for the process's life: "Decorator to wrap a function with
        a memoizing callable that saves up to the maxsize most recent calls") holds what the function returns,
        past the step that fetched it, and hands it out again on the next call with the same arguments (slime's
        ``SafetensorReader.get_tensor``). ``functools.cached_property`` keeps it on the object the same way."""
        for deco in getattr(self.info.node, "decorator_list", ()):
            name = dotted(deco.func if isinstance(deco, ast.Call) else deco)
            last = name.rpartition(".")[2]
            if last in ("lru_cache", "cache") and name in (last, f"functools.{last}"):
                where = "the function's `@lru_cache`" if last == "lru_cache" else "the function's `@cache`"
                self.report("OWN106", node, val, f"kept by {where}",
                            f"{self._what(val)} is returned into {where}, which keeps it past the loader's step "
                            f"and hands it out again", f"`{self.snip(node, 60)}`")
                return
            if last == "cached_property" and name in (last, "functools.cached_property"):
                self.report("OWN102", node, val, "kept by `@cached_property` on the object",
                            f"{self._what(val)} is returned into the object's `@cached_property`, which keeps "
                            f"it past the loader's step", f"`{self.snip(node, 60)}`")
                return

    def _built_inside(self, val: Val) -> bool:
        """Is ``val`` (an object) built around objects of the project's classes already built around the tensor
        (``Patch(layers={k: SetParameter(...)})``)? Their constructors keep it (Flow._returned_built)."""
        return any(built_class(link.text) not in ("", val.obj) for link in val.chain)

    def _returned_built(self, returned: ast.AST, val: Optional[Val]) -> None:
        """``layers[key] = SetParameterLayer("scale", sd["scale"])`` ... ``return Patch(layers=layers)``: objects of
        the project's classes built around this call's tensors and returned inside a container (or an object the
        audit does not follow) are kept too, by each constructor's own store (InvokeAI's LoRA converters)."""
        names = _handed_names(returned)
        for name in names:
            for cls in sorted(self.built_in.get(name, ())):
                for emit in self.built_stores.pop(cls, ()):
                    emit()
        held = [val] + [self.state.env.get(name) for name in names]
        for v in held:
            if v is None or v.step != self.func_step:
                continue
            for link in v.chain:
                if link.function == self.fn and built_class(link.text):
                    for emit in self.built_stores.pop(built_class(link.text), ()):
                        emit()

    def _produces(self, returned: ast.AST, val: Val) -> bool:
        """Does returning ``val`` make the function a producer? Always, but for a value read out of a container
        whose stores were already reported (``_infer_kept``): only that container itself, returned by name."""
        if not (val.reported and self._infer_kept_names):
            return True
        if type(returned) is ast.Subscript:  # `return cache[shard][name]`: a lookup in such a container
            root = root_of(returned)
            return root.name in self._infer_kept_names and not root.through_attribute
        return type(returned) is ast.Name and returned.id in self._infer_kept_names  # type: ignore[attr-defined]

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
        # what a file's fetch left parked, or past its step, on any one path is so after the join: the `else`
        # that binds the name otherwise (`emb = load_file(a)["emb"]` if cached, else encoded) clears it only
        # on its own path
        parked, stale = dict(self._parked), dict(self._stale)
        parked_ends: Dict[str, Tuple[ast.AST, Val]] = {}
        stale_ends: Dict[str, Tuple[ast.AST, Val, ast.AST]] = {}
        for body in blocks:
            self.state = start.copy()
            if parked or stale or self._parked or self._stale:  # (empty on nearly every branch: no copies then)
                self._parked, self._stale = dict(parked), dict(stale)
            self.block(body)
            ends.append(self.state)
            if body and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break)):
                continue  # (`return self.load_weights(file)` fetched the next file on a path that ends there)
            for name, entry in self._parked.items():
                parked_ends.setdefault(name, entry)
            for name, gone in self._stale.items():
                stale_ends.setdefault(name, gone)
        merged = ends[0]
        for other in ends[1:]:
            merged.join(other)
        self.state = merged
        self._parked, self._stale = parked_ends, stale_ends

    def loop(self, node: ast.AST, it: Optional[Val]) -> None:
        step_id = id(node)
        self._push_loop(step_id)
        self.loop_nodes[step_id] = node
        if isinstance(node, ast.While) or (it is not None and it.kind == ITER):  # (a while: `next(it)`)
            self._stream_steps.add(step_id)
        before = self.state.copy()
        target = getattr(node, "target", None)
        for _ in range(2):
            if target is not None:
                item = self.item_of(it, step_id, node)
                self.assign(target, item, None, node, loop_target=True)
                self._alias_loop_target(target, getattr(node, "iter", None))
            self.block(node.body)  # type: ignore[attr-defined]
        self._pop_loop()
        self.state.join(before)
        self.block(getattr(node, "orelse", []))

    def _alias_loop_target(self, target: ast.AST, it: Optional[ast.AST]) -> None:
        """``for proj, dst in (("gate", gate_rows), ("up", up_rows)):`` -- ``dst`` is one of the literal's
        containers each iteration: a store through it (``dst[i] = w``) is a store into each of them,
        judged by their own lifetimes and kinds (a list bound before the loop, a parameter tensor)."""
        if not isinstance(it, (ast.Tuple, ast.List)) or not it.elts:
            return
        if isinstance(target, ast.Name):
            names: List[ast.AST] = [target]
            rows = [[e] for e in it.elts]
        elif isinstance(target, ast.Tuple) and all(isinstance(e, (ast.Tuple, ast.List)) and
                                                   len(e.elts) == len(target.elts) for e in it.elts):
            names, rows = list(target.elts), [e.elts for e in it.elts]  # type: ignore[attr-defined]
        else:
            return
        for j, name in enumerate(names):
            column = tuple(row[j] for row in rows)
            if isinstance(name, ast.Name) and all(
                    (isinstance(c, ast.Name) and c.id in self.state.slots) or
                    (isinstance(c, ast.Attribute) and dotted(c) and not dotted(c).startswith("?")) for c in column):
                self._aliases[name.id] = column

    def item_of(self, it: Optional[Val], step_id: int, node: ast.AST) -> Optional[Val]:
        """One item of what a loop iterates, stamped with the loop's step when it is a fresh iteration."""
        if is_handles(it):  # `for handle in handles:`, `for key, handle in key_to_handle.items():`
            return handle_of(it)  # type: ignore[arg-type]
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
            if self._parked:
                self._parked.pop(target.id, None)
            if self._stale:
                self._stale.pop(target.id, None)
            self._named.discard(target.id)
            if self._open_handles and val is not None and val.kind == HOLDER:
                self._inside_handle[target.id] = stmt
            elif self._inside_handle:
                self._inside_handle.pop(target.id, None)
            self.bind_name(target.id, val, value, stmt, loop_target)
            if (val is not None and val.kind in (TENSOR, HOLDER) and not val.reported and not loop_target
                    and val.chain and val.chain[0].text.startswith("returned by") and val.step == self.func_step
                    and target.id in self.state.env):
                # `emb = load_file(a)["emb"]`, `base = load_file(a)`: one file's tensor or dict, valid until
                # the next file is fetched; read after `lat = load_file(b)["lat"]` (CogVideo's datasets return
                # both; mistral-finetune's LoRA merge reads the base), it is read past its step
                self._parked.setdefault(target.id, (stmt, val))
                self._named.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = self.unpack(val, len(target.elts))
            # `gate_rows, up_rows = [], []`: each name is bound to its own element (a fresh container)
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) \
                and not any(isinstance(e, ast.Starred) for e in value.elts) else [None] * len(target.elts)
            for elt, part, sub in zip(target.elts, parts, values):
                if isinstance(elt, ast.Starred):
                    self.assign(elt.value, val.then(HOLDER) if val is not None and part is not None else None,
                                None, stmt, loop_target)
                else:
                    self.assign(elt, part, sub, stmt, loop_target)
        elif isinstance(target, ast.Attribute):
            base = self.ev(target.value)
            # replaced by a later store of the same step (judged itself): not what the object keeps, but
            # read back until then as the tensor it is (`self.other = self.weight` in between is a store)
            replaced = val is not None and isinstance(stmt, (ast.Assign, ast.AnnAssign)) \
                and rebound_before_leaving(self.info.node, self._rebinds, stmt, target)
            if val is not None and (base is None or base.kind != TENSOR) and not replaced:
                self.attribute_store(target, val, stmt)
            elif val is None:
                self.published(target, value, stmt)
            self._remember_attribute(target, val, stmt, reported=not replaced)
        elif isinstance(target, ast.Subscript):
            if val is None:
                self.published(target, value, stmt)
                self.filled_untainted(target.value)
            self.subscript_store(target, val, stmt)
        elif isinstance(target, ast.Starred):
            self.assign(target.value, val, value, stmt, loop_target)

    def filled_untainted(self, container: ast.AST) -> None:
        """Something not of the file went into ``container`` (``new_sd[k] = torch.zeros(...)``): a path on
        which it is not tainted no longer leaves it empty (see :meth:`State.join`)."""
        if type(container) is ast.Name:
            slot = self.state.slots.get(container.id)
            if slot is not None and slot.empty:
                self.state.slots[container.id] = replace(slot, empty=False)

    def _remember_attribute(self, target: ast.Attribute, val: Optional[Val], stmt: ast.AST,
                            reported: bool = True) -> None:
        """``self.weight = w`` makes ``self.weight`` read as ``w`` for the rest of the walk, so that an
        in-place write through the attribute (``self.weight += bias``, ``self.weight.data.mul_(s)``) is
        found. The store itself is reported where it is made: the value read back is marked reported,
        so it is judged again only for in-place writes. Kept in the env under the dotted name (no local
        has a dot), so that branches and loops join it as they join names."""
        key = dotted(target)
        if not key or key.startswith("?"):
            return
        if val is not None and val.kind == TENSOR and not val.capture:
            self.state.env[key] = val.then(link=Link(getattr(stmt, "lineno", 0), self.fn, f"stored in `{key}`"),
                                           reported=reported or val.reported, label=f"`{key}`")
            self._attrs = True
        elif self._attrs:
            self.state.env.pop(key, None)
        if self._attrs:
            self.state.slots[key] = Slot(False, self._loops_t, "tensor" if val is not None else "unknown")

    def unpack(self, val: Optional[Val], n: int) -> List[Optional[Val]]:
        if val is None:
            return [None] * n
        if val.parts is not None and len(val.parts) == n:
            return list(val.parts)
        if val.parts is not None and len(val.parts) == 1 and n > 1:
            return [val.parts[0]] + [None] * (n - 1)  # a library loader's dict, then what is no tensor (alphas)
        if val.parts is not None and n > 1 and any(p is None for p in val.parts) \
                and any(link.text.startswith("returned by") and "(a producer:" in link.text for link in val.chain[:1]):
            # a producer matched by its name returns a tuple of another length than this call's is unpacked to
            # (FluxTrainer's `train_util.load_target_model`, 4 values, taken for `sdxl_train_util`'s, 7): not that
            # function, whose tensor elements are not these
            return [None] * n
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
        if self._infer_kept_names and val is not None and val.reported and type(value) is ast.Subscript \
                and not loop_target:
            root = root_of(value)  # `weight = loaded_files[f][name]`, then `return weight` (Flow._produces)
            if root.name in self._infer_kept_names and not root.through_attribute:
                self._infer_kept_names.add(name)
        if self._aliases:
            self._aliases.pop(name, None)
        if self._published:
            self._published.pop(name, None)
        if self._attrs:
            for key in [k for k in self.state.env if k.startswith(name + ".")]:
                del self.state.env[key]
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
        fresh, loops = param is None and is_fresh_container(value), self._loops_t
        inner = self._fresh_inner(value, name) if param is None and not fresh else None
        inside = None
        if inner is not None:  # `stash = buf.setdefault(key, {})`: a container inside a fresh local one
            fresh, loops, inside = True, inner[1].loops, inner[1].inside or inner[0]
            if type(value) is not ast.Name:  # walked into an inner dict: none of the outer one's tensors
                self.state.env.pop(name, None)
        self.state.slots[name] = Slot(fresh, loops, "tainted" if val is not None else binding_kind(value), param,
                                      accessor and self._alias_self(value), inside,
                                      fresh and inner is None and is_empty_container(value))
        if (val is not None and not loop_target and val.holds_tensor and val.step in self.loop_nodes
                and val.step in self.loops and not val.reported):
            self._kept.setdefault((name, val.step), (stmt, val, getattr(stmt, "lineno", 0)))

    def _nesting_names(self) -> frozenset:
        """Names this function stores new containers into (``node[part] = {}``): nested dicts it builds, so
        ``node = node[part]`` walks into one of those containers, not to an element that is a tensor."""
        try:
            return self._nesting_cached
        except AttributeError:
            assigns = [n for n in ast.walk(self.info.node) if isinstance(n, ast.Assign)]  # type: ignore[union-attr]
            made = {t.id for n in assigns if is_fresh_container(n.value) for t in n.targets if type(t) is ast.Name}
            # `node[part] = {}`, or `child = {}` then `node[part] = child` (OLMo's unflatten_dict)
            self._nesting_cached: frozenset = frozenset(
                t.value.id for n in assigns
                if is_fresh_container(n.value) or (type(n.value) is ast.Name and n.value.id in made)
                for t in n.targets if isinstance(t, ast.Subscript) and type(t.value) is ast.Name)
            return self._nesting_cached

    def _fresh_inner(self, value: Optional[ast.AST], name: str) -> Optional[Tuple[str, Slot]]:
        """``stash = buf.setdefault(key, {})`` with ``buf`` a fresh local container: ``stash`` is a new container
        kept inside ``buf``, so it lives as long as ``buf`` does (the name and slot of ``buf``), and what is
        stored in it dies with ``buf``'s step, as what is stored in ``buf`` does (timm's BEiT-3 converter gathers
        q/k/v so). The same for ``node = out`` and ``node = node[part]``, the walk into a nested fresh dict that
        ``unflatten_dict`` helpers make (lerobot's): ``node[leaf] = v`` stores into ``out``."""
        if type(value) is ast.Name:  # `node = out`: the same fresh container under a second name
            base: Optional[ast.AST] = value
        elif type(value) is ast.Subscript and type(value.value) is ast.Name \
                and value.value.id in self._nesting_names():
            # `node = node[part]` walking a nested fresh dict (`unflatten_dict`): an inner container of it
            base = value.value
        elif (type(value) is ast.Call and isinstance(value.func, ast.Attribute) and value.func.attr == "get"
              and type(value.func.value) is ast.Name and value.func.value.id in self._nesting_names()):
            base = value.func.value  # `child = node.get(part)` (then `if child is None: child = {}`)
        elif (type(value) is ast.Call and isinstance(value.func, ast.Attribute) and value.func.attr == "get"
              and len(value.args) == 2 and is_fresh_container(value.args[1]) and type(value.func.value) is ast.Name):
            # `emb_dict = bundle_embeddings.get(emb_name, {})` (then `bundle_embeddings[emb_name] = emb_dict`): a
            # container of the fresh one, or a new one (A1111's bundled embeddings, gathered from one LoRA file)
            base = value.func.value
        elif (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
              and value.func.attr == "setdefault" and len(value.args) == 2
              and is_fresh_container(value.args[1]) and type(value.func.value) is ast.Name):
            base = value.func.value
        else:
            return None
        slot = self.state.slots.get(base.id)  # type: ignore[attr-defined]
        return (base.id, slot) if slot is not None and slot.fresh and slot.param is None else None  # type: ignore[attr-defined]

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
            if root.name is not None and root.name != self.self_name():
                slot = self.state.slots.get(root.name)
                if slot is not None and slot.param is not None and root.name not in self.state.env:
                    if isinstance(value, ast.Call) and not (isinstance(value.func, ast.Attribute) and
                                                            value.func.attr in ("setdefault", "get", "__getitem__")):
                        return None
                    return slot.param
        return None

    def _is_param_container(self, name: str) -> bool:
        return name not in self.state.env and name != self.self_name()

    def _alias_self(self, value: Optional[ast.AST]) -> bool:
        if value is None or not isinstance(value, (ast.Attribute, ast.Subscript, ast.Call)):
            return False
        root = root_of(value)
        if isinstance(value, ast.Call) and not (isinstance(value.func, ast.Attribute)
                                                and value.func.attr in ("setdefault", "get", "__getitem__")):
            return False
        return root.name is not None and root.name == self.self_name() and root.through_attribute

    def self_name(self) -> Optional[str]:
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
            if self._stale and node.id in self._stale and type(node.ctx) is ast.Load:  # type: ignore[attr-defined]
                self._read_after_next_file(node)  # type: ignore[arg-type]
            return self.state.env.get(node.id) if type(node.ctx) is ast.Load else None  # type: ignore[attr-defined]
        if kind is ast.Constant:
            return None
        depth = self._depth + 1
        if depth > FLAT_DEPTH:
            return self._ev_flat(node)
        self._depth = depth  # not restored on an exception: any exception ends the walk
        val = _EV.get(kind, Flow._ev_effects)(self, node)
        self._depth = depth - 1
        return val

    def _ev_effects(self, node: ast.AST) -> Optional[Val]:
        """Compare, UnaryOp, JoinedStr, Slice...: no value that matters, only their parts' effects."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr) and type(child) is not ast.Name and type(child) is not ast.Constant:
                self.ev(child)
        return None

    def _ev_flat(self, top: ast.AST) -> Optional[Val]:
        """``top``, evaluated without nesting any deeper: its parts first, children before parents and left
        to right (the order the handlers evaluate them in), each by its own handler with the values of its
        children already known (:meth:`_ev_known`), so the handlers run as they always do, one level deep.
        The names are read at their place in that order. A lambda or comprehension is left whole to its
        parent's handler (its own order: its targets are bound before its element), and that handler
        evaluates its parts here again if they are deep."""
        if isinstance(top, _OWN_ORDER):
            return _EV[type(top)](self, top)
        order: List[ast.AST] = []
        stack = [top]
        while stack:
            node = stack.pop()
            order.append(node)
            if type(node) is ast.Name:
                continue
            for child in ast.iter_child_nodes(node):
                if type(child) is ast.keyword:
                    child = child.value  # type: ignore[attr-defined]
                kind = type(child)
                if kind is ast.Constant or isinstance(child, _OWN_ORDER) or not isinstance(child, ast.expr):
                    continue
                if kind is ast.Name and type(child.ctx) is not ast.Load:  # type: ignore[attr-defined]
                    continue
                stack.append(child)
        memo = self._memo
        outermost = "ev" not in self.__dict__  # (a comprehension's deep part, met inside, is evaluated here too)
        if outermost:
            self.ev = self._ev_known  # type: ignore[method-assign]
        try:
            for node in reversed(order):
                kind = type(node)
                if kind is ast.Name and self._stale and node.id in self._stale:  # type: ignore[attr-defined]
                    self._read_after_next_file(node)  # type: ignore[arg-type]  (as `ev` does)
                memo[id(node)] = (self.state.env.get(node.id) if kind is ast.Name  # type: ignore[attr-defined]
                                  else _EV.get(kind, Flow._ev_effects)(self, node))
            return memo[id(top)]
        finally:
            for node in order:
                memo.pop(id(node), None)
            if outermost:
                del self.ev  # the class's again (and no cycle through a bound method left behind)

    def _ev_known(self, node: Optional[ast.AST]) -> Optional[Val]:
        """:meth:`ev` while :meth:`_ev_flat` runs: a part it already evaluated is not evaluated again."""
        if node is not None:
            got = self._memo.get(id(node), _MISSING)
            if got is not _MISSING:
                return got  # type: ignore[return-value]
        return Flow.ev(self, node)

    def _ev_attribute(self, node: ast.Attribute) -> Optional[Val]:
        base = self.ev(node.value)
        if base is None:
            got = self.state.env.get(dotted(node)) if self._attrs else None  # `self.weight`, given `w` above
            if got is None and self.attribute_source is not None and type(node.value) is ast.Name \
                    and node.value.id == self.self_name():  # type: ignore[attr-defined]
                return self.attribute_source(self, node)  # a loader handle kept on self (a getter object)
            return got
        if base.kind == SOURCE:
            return None  # a handle's attributes (metadata, names)
        if base.kind == TENSOR and node.attr in V.ALIAS_ATTRIBUTES:
            return base.then(TENSOR, Link(node.lineno, self.fn, f"`.{node.attr}`"))
        if base.kind == HOLDER and base.field:
            if node.attr == base.field and base.elem != ELEM_FIELDS:  # `weights.w`: the object's dict of tensors
                return base.then(HOLDER, Link(node.lineno, self.fn, f"`.{node.attr}`"), field="",
                                 mapping=base.field_mapping, field_mapping=False, label=f"`{self.snip(node, 40)}`")
            return None  # its other attributes (`weights.sd_module`, `weights.network_key`)
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
        got: List[Optional[Val]] = []
        made = self.literal(node, node.values, got)
        spread = [v for k, v in zip(node.keys, got) if k is None and v is not None and v.kind == HOLDER and v.mapping]
        for first, second in zip(spread, spread[1:]):  # `{**load_file(a), **load_file(b)}`
            if two_files(first, second):
                self.files_merged(node, first, second, "the dict built here")
                break
        return made

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
        if self.infer and val is not None and val.seed is None and self.out.produced_yield is None \
                and not (val.reported and self._infer_kept_names):
            self.out.produced_yield = val
        if val is not None and self.summary_param is not None and val.seed is not None:
            self.out.yields = self.out.yields or val
        return None

    def subscript_value(self, node: ast.Subscript, base: Optional[Val]) -> Optional[Val]:
        if base is None:
            return None
        index = node.slice
        if base.kind in (TENSOR, HOLDER) and isinstance(index, ast.Constant) and isinstance(index.value, str) \
                and V.COUNTER_KEY.match(index.value):
            return None  # `checkpoint["step"]`: a checkpoint's training counter, not a weight (no tensor has string keys)
        if base.kind == TENSOR:
            return base.then(TENSOR, Link(node.lineno, self.fn, f"sliced `{self.snip(node, 40)}`"))
        if base.kind == PAIR:
            if isinstance(index, ast.Constant) and index.value == 0:
                return None
            if isinstance(index, ast.Slice):  # item[:2]: still the (name, tensor) item
                return base
            return base.then(TENSOR, Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`"), elem=ELEM_TENSOR)
        if base.kind == HOLDER and base.field:  # a container of objects holding tensors: one object; an object: no item
            return element_of(base) if base.elem == ELEM_FIELDS else None
        if base.kind == HOLDER:
            if base.parts is not None and isinstance(index, ast.Constant) and isinstance(index.value, int):
                i = index.value
                if -len(base.parts) <= i < len(base.parts):
                    return base.parts[i]
            if base.mapping and isinstance(index, ast.Constant) and isinstance(index.value, str) \
                    and V.NESTED_STATE_KEY.match(index.value):
                # `ckpt["model"]`, `ckpt["state_dict"]`: a checkpoint's nested dict of the model's weights (the
                # file's tensors, by name), not one tensor (torchchat's `_load_model_default`)
                return base.then(HOLDER, Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`"), mapping=True)
            if base.mapping:  # `weights["lm_head.weight"]`: name the tensor, not the dict
                return replace(element_of(base, Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`")),
                               label=f"`{self.snip(node, 40)}`")
            return element_of(base)
        if base.kind == ITER and base.reported:
            return element_of(base)
        if base.kind == SOURCE and base.mapping:  # a mapping of weights (``self.weights_map[name]``): a tensor
            step = next((x for x in reversed(self.loops) if x not in self._comp_steps), self.func_step)
            return Val(TENSOR, step, base.chain + (Link(node.lineno, self.fn, f"`{self.snip(node, 40)}`"),), self.fn,
                       label=f"`{self.snip(node, 40)}`", seed=base.seed)  # (a helper's: what it was handed)
        if is_handles(base):  # `key_to_handle[key]`, `handles[0]`: one handle of a local container of them
            return handle_of(base)
        if base.kind == SOURCE:
            return base  # a dict or list of handles (``self._handles[filename]``): one handle
        return None

    def literal(self, node: ast.AST, elts: Sequence[Optional[ast.AST]],
                got: Optional[List[Optional[Val]]] = None) -> Optional[Val]:
        vals: List[Optional[Val]] = [] if got is None else got  # (`got`: the caller's, to see each element)
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
            handles = [v for v in vals if v is not None and not v.mapping]
            if handles and isinstance(node, (ast.List, ast.Set)):  # `[safe_open(a), safe_open(b)]`
                return handles_holding(handles[0])
            return None
        first = tainted[0]
        pair = isinstance(node, ast.Tuple) and len(vals) == 2 and vals[0] is None and vals[1] is not None \
            and vals[1].kind == TENSOR
        if pair:  # (name, tensor): one item, as a weights iterator yields it
            return first.then(PAIR, elem=ELEM_PAIR, parts=tuple(vals), reported=first.reported)
        return first.then(HOLDER, elem=ELEM_TENSOR, parts=tuple(vals), reported=all(v.reported for v in tainted))

    def _made_in(self, val: Val, node: ast.AST) -> bool:
        """Did ``val``'s chain pass through ``node``'s own text (made by each iteration, not a name bound
        before the comprehension)?"""
        lo, hi = node.lineno, getattr(node, "end_lineno", None) or node.lineno
        return any(link.path is None and link.function == self.fn and lo <= link.line <= hi for link in val.chain)

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
                if is_handles(it):
                    item = handle_of(it)  # type: ignore[arg-type]
                elif it is not None and it.kind != SOURCE and it.kind != PAIR:
                    item = element_of(it, Link(node.lineno, self.fn, f"`{self.snip(gen.target)}` from "
                                                                     f"`{self.snip(gen.iter, 30)}`"))
                    if it.kind == ITER and not it.reported:
                        item = replace(item, step=step_id)
                self.assign(gen.target, item, None, node, loop_target=True)
                for cond in gen.ifs:
                    self.ev(cond)
            if isinstance(node, ast.DictComp):
                key = self.ev(node.key)
                elt = self.ev(node.value)
                if (elt is None or not elt.holds_tensor) and key is not None and key.kind == HOLDER and key.mapping:
                    elt = key  # `{executor.submit(load_shard, p): p for p in paths}`: futures of whole files as keys
            else:
                elt = self.ev(node.elt)  # type: ignore[attr-defined]
        finally:
            self._pop_loop()
            self.state = saved
        if elt is not None and not isinstance(node, ast.GeneratorExp) and not iterates_stream and (
                (elt.kind == SOURCE and not elt.mapping) or (elt.kind == ITER and not elt.reported and elt.step == 0)):
            # `[stack.enter_context(safe_open(p)) for p in paths]`, `{p: safe_open(p) for p in paths}`: a
            # container of handles, each handing out tensors when looked up, iterated or looped over;
            # `[StateDictIterator(f) for f in files]`: of streams, each read when it is looped over
            return handles_holding(elt, Link(node.lineno, self.fn, "kept by the comprehension"))
        if elt is None or not elt.holds_tensor:
            return None
        if elt.kind == HOLDER and elt.mapping and not elt.reported and not isinstance(node, ast.GeneratorExp) \
                and self._made_in(elt, node):
            # `[load_file(f) for f in files]`, `[torch.load(p, mmap=True) for p in shards]`: a whole file's
            # dict is valid until the next file is loaded, and this keeps every file's dict while it loads the
            # next (a per-tensor getter's `[h.get_tensor(n) for n in names]` is one step: not this)
            how = _MATERIALISING_COMPS[type(node)]
            self.report("OWN101", node, elt, f"{how} of whole-file loads",
                        f"the {how} keeps each file's tensors while it loads the next file",
                        f"`{self.snip(node, 60)}`")
            return elt.then(HOLDER, reported=True, mapping=False)
        if isinstance(node, ast.GeneratorExp):
            if iterates_stream and stream is not None:  # a lazy transform: still one item per step
                pair = isinstance(node.elt, ast.Tuple) and len(node.elt.elts) == 2  # type: ignore[attr-defined]
                return stream.then(ITER, elem=ELEM_PAIR if pair else ELEM_TENSOR)
            return elt.then(HOLDER)
        if iterates_stream and stream is not None:
            return self.materialise(node, stream.then(link=Link(node.lineno, self.fn, "kept by the comprehension")),
                                    _MATERIALISING_COMPS[type(node)])
        return elt.then(HOLDER, elem=ELEM_TENSOR, mapping=isinstance(node, ast.DictComp))  # a dict: tensors by name


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

__all__ = ["Flow", "Resolver", "Outcome", "IntoParam", "Slot", "State", "UNRESOLVED"]
