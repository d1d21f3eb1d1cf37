"""The abstract values of the taint/alias flow: what a name may hold, as far as borrowed memory goes.

An untainted name holds nothing borrowed (a string, a copy, a shape) and has no :class:`Val`.
A tainted one holds one of:

* ``ITER``   an iterator that yields weights (``elem`` says what each item is);
* ``PAIR``   one ``(name, tensor)`` item: element 0 is the name, the rest share the tensor's memory;
* ``TENSOR`` a tensor that shares memory with a yielded tensor (the tensor itself or a view of it);
* ``HOLDER`` a container, closure, ``functools.partial`` or ``BoundArguments`` that holds such a tensor;
* ``SOURCE`` a checkpoint handle (``safe_open(...)``, a fastsafetensors loader) that hands out tensors.

``step`` names the loader step the tensor belongs to: the loop whose iteration yielded it, or the call
(for a per-tensor loader's argument). A tensor may be used freely within its step; keeping it in
anything that outlives the step is a retention.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

from sanitizer.audit.findings import Finding, Link

ITER, PAIR, TENSOR, HOLDER, SOURCE = "iter", "pair", "tensor", "holder", "source"

# How a chain says an object was built around the value (`kept by the new `Cls``): the constructor rules read
# it back (the class, and whether the value is already inside such an object).
BUILT = "kept by the new `"


def built_class(text: str) -> str:
    """The class a ``BUILT`` link names (``""`` for any other link)."""
    return text[len(BUILT):].partition("`")[0] if text.startswith(BUILT) else ""

# What one item of an ITER (or one element of a HOLDER) is.
ELEM_PAIR, ELEM_TENSOR, ELEM_ENUM_PAIR, ELEM_ENUM_TENSOR = "pair", "tensor", "enum-pair", "enum-tensor"
# A SOURCE whose ``elem`` is one of these is a container of handles, not a handle: a list or dict of them
# (``[stack.enter_context(safe_open(p)) for p in paths]``, ``key_to_handle[key] = handle``), or such a
# dict's ``.items()`` ((name, handle) items). Its items, lookups and loop targets are handles.
ELEM_HANDLES, ELEM_HANDLE_PAIRS = "handles", "handle-pairs"
# A SOURCE whose ``elem`` is this is a container of weight streams, each read lazily when it is iterated
# (``[StateDictIterator(f) for f in files]``, objects of a class whose ``__iter__`` yields a loader's tensors):
# its items are the stream (``stream``), each iterated in a step of its own.
ELEM_STREAMS = "streams"
# An ITER whose ``elem`` is this yields whole dicts of tensors, one file's each (ColossalAI's
# ``load_state_dict_shards``: a generator yielding each shard's ``load_file`` dict): an item is that file's dict,
# valid for the iteration that yielded it.
ELEM_DICT = "dict"
# A HOLDER whose ``elem`` is this is a container of objects that each hold tensors in their attribute ``field``
# (A1111's and SD.Next's ``matched_networks[key].w[part] = weight``, a dict of ``NetworkWeights`` namedtuples):
# an item is one such object; ``(key, object)`` pairs are its ``.items()`` (ELEM_FIELD_PAIRS).
ELEM_FIELDS, ELEM_FIELD_PAIRS = "fields", "field-pairs"
# A HOLDER whose ``elem`` is this holds containers that hold tensors (``patch_dict[key][kind][i] = w``: a dict of
# dicts of lists): an item is such a container, ``(key, container)`` pairs are its ``.items()`` (ELEM_NESTED_PAIRS).
ELEM_NESTED, ELEM_NESTED_PAIRS = "nested", "nested-pairs"


@dataclass(frozen=True)
class Val:
    kind: str
    step: int  # id() of the loop or function node whose step the tensor belongs to; 0 when not yet known
    chain: Tuple[Link, ...]
    consumer: str  # qualified name of the function where the tensor entered (for the report)
    elem: str = ELEM_TENSOR
    reported: bool = False  # a retention that already covers this value was reported (list(weights)'s items)
    capture: Optional[str] = None  # HOLDER only: "closure", "lambda", "functools.partial", "inspect.BoundArguments"
    seed: Optional[int] = None  # summaries: index of the helper parameter this value came from
    parts: Optional[Tuple[Optional["Val"], ...]] = None  # a tuple/list literal's elements, for unpacking
    parameter: bool = False  # its chain passed through nn.Parameter (for the finding's pattern)
    label: str = ""  # how a message names it: "`loaded_weight`"
    maybe: bool = False  # tainted on some paths only (an in-place write is reported only when it is certain)
    mapping: bool = False  # HOLDER only: the step's own dict of weights (a file's ``Dict[str, Tensor]``)
    convert: str = ""  # the chain passed a conversion that copies unless it is a no-op (``.to(dtype)``)
    obj: str = ""  # HOLDER only: the class of the object just built around the tensor (``KVScales(k, v)``)
    stream: Optional["Val"] = None  # a container of streams (ELEM_STREAMS) only: one of its streams
    # borrowed only when the function's parameter of this name is true (`torch.load(path, mmap=mmap)`): what a
    # producer inferred from it hands out depends on what each call passes (producers.Inferred.when)
    when: str = ""
    # HOLDER with ``obj`` only: the findings of its constructor's own stores of the tensor (``self.state_dict =
    # state_dict``), ready to be reported where the object is first kept past the step: the brief credits the
    # store that keeps the view, and an object stored again keeps nothing new (Forge's ``Embedding.__init__``)
    built_at: Tuple[object, ...] = ()
    # HOLDER only: the tensors are held in this attribute of the object (``weights.w``), not in the object itself
    # (or, with ``elem`` ELEM_FIELDS, in that attribute of each of the container's objects); ``field_mapping``:
    # that attribute is a dict filled by name
    field: str = ""
    field_mapping: bool = False
    # read from an attribute of ``self`` that another method of the class was found keeping it in (``self.weights``
    # after ``__init__``'s ``self.weights = weights``): put again on the same object, it keeps nothing new
    self_kept: bool = False

    def then(self, kind: Optional[str] = None, link: Optional[Link] = None, **changes) -> "Val":
        """This value after one more step of the chain (a view, a store, a call). A copy of the fields,
        not ``dataclasses.replace`` (which re-runs ``__init__``: the flow makes one of these per view)."""
        new = object.__new__(Val)
        fields = new.__dict__
        fields.update(self.__dict__)
        fields["kind"] = kind or self.kind
        if link is not None:
            fields["chain"] = self.chain + (link,)
        fields["parts"] = changes.pop("parts", None)
        # the object built is this value (and its rebindings), not what is made of it
        fields["obj"] = changes.pop("obj", self.obj if kind is None else "")
        fields["built_at"] = changes.pop("built_at", self.built_at if kind is None else ())
        fields["field"] = changes.pop("field", self.field if kind is None or kind == self.kind else "")
        fields.update(changes)
        return new

    @property
    def holds_tensor(self) -> bool:
        return self.kind in (TENSOR, PAIR, HOLDER)


def element_of(val: Val, link: Optional[Link] = None) -> Val:
    """One item of an iterator or holder: a pair when the items are pairs, else a tensor."""
    kind = PAIR if val.elem in (ELEM_PAIR,) else TENSOR
    if val.elem == ELEM_FIELDS and val.kind == HOLDER:  # one object of a container of them
        return val.then(HOLDER, link, elem=ELEM_TENSOR, field=val.field, mapping=False)
    if val.elem == ELEM_FIELD_PAIRS and val.kind == HOLDER:  # a `(key, object)` item
        return val.then(HOLDER, link, parts=(None, val.then(HOLDER, elem=ELEM_TENSOR, field=val.field, mapping=False)))
    if val.elem == ELEM_NESTED and val.kind == HOLDER:  # one inner container
        return val.then(HOLDER, link, elem=ELEM_TENSOR, mapping=False)
    if val.elem == ELEM_NESTED_PAIRS and val.kind == HOLDER:  # a `(key, inner container)` item
        return val.then(HOLDER, link, parts=(None, val.then(HOLDER, elem=ELEM_TENSOR, mapping=False)))
    if val.elem == ELEM_DICT and val.kind == ITER:
        return val.then(HOLDER, link, elem=ELEM_TENSOR, mapping=True)
    if val.elem in (ELEM_ENUM_PAIR, ELEM_ENUM_TENSOR):
        kind = HOLDER  # (index, item): unpacked by the loop target
    return val.then(kind, link, elem=val.elem, mapping=False)


def is_handles(val: Optional[Val]) -> bool:
    """A container of loader handles (see :data:`ELEM_HANDLES`)."""
    return val is not None and val.kind == SOURCE and val.elem in (ELEM_HANDLES, ELEM_HANDLE_PAIRS, ELEM_STREAMS)


def handle_of(val: Val, link: Optional[Link] = None) -> Val:
    """One handle of a container of handles: a ``(name, handle)`` item of its ``.items()``, else a handle
    (of a container of streams: one stream, not yet iterated)."""
    if val.elem == ELEM_STREAMS and val.stream is not None:
        return val.stream
    handle = val.then(SOURCE, link, elem=ELEM_TENSOR, mapping=False)
    if val.elem == ELEM_HANDLE_PAIRS:
        return handle.then(SOURCE, parts=(None, handle))
    return handle


def handles_holding(val: Val, link: Optional[Link] = None) -> Val:
    """A container of handles that holds ``val`` (a handle, or a container of them); of a weights stream
    (an ITER not yet iterated), a container of such streams."""
    if val.kind == ITER:
        return val.then(SOURCE, link, elem=ELEM_STREAMS, mapping=False, stream=val)
    return val.then(SOURCE, link, elem=ELEM_HANDLES, mapping=False)


COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


# -- the flow's state: what each local holds and how it was bound -------------------------------------------
@dataclass(frozen=True)
class Slot:
    """How a local name was last bound (untainted or tainted alike)."""

    fresh: bool  # a new container/object: nothing else refers to it yet
    loops: Tuple[int, ...]  # the steps (loops, and the call itself) enclosing the binding
    kind: str = "unknown"  # 'container', 'tensor' or 'unknown' (for subscript stores)
    param: Optional[int] = None  # a parameter, or an alias of a parameter's container: its index
    self_alias: bool = False  # bound from an attribute of self
    # the fresh local container this one is, or is kept inside (`node = out`, `node = node[part]`,
    # `stash = buf.setdefault(k, {})`): what is stored here is held by that one too
    inside: Optional[str] = None
    # bound to an empty new container (`new_sd = {}`, `rows = []`): before anything is stored into it, it holds
    # nothing at all, so a loop that may run no step leaves no item of it that is not what the loop stored
    empty: bool = False


def _untainted_there(name: str, val: Val, slots: Dict[str, Slot]) -> bool:
    """Is ``name``, tainted on one path, bound to something else on the path whose ``slots`` these are?"""
    if "." in name:
        return True
    slot = slots.get(name)
    return slot is not None and not (slot.empty and val.kind == HOLDER)


@dataclass
class State:
    env: Dict[str, Val] = field(default_factory=dict)
    slots: Dict[str, Slot] = field(default_factory=dict)

    def copy(self) -> "State":
        return State(dict(self.env), dict(self.slots))

    def join(self, other: "State") -> None:
        # an attribute's value (``self.weight``, see Flow._remember_attribute) set on one path only is a maybe;
        # but a container still empty on the other path (a loop of no step, a branch that stored nothing into
        # `new_sd = {}`) holds nothing there: each item it has is the file's, certainly (ComfyUI's re-keyed
        # difference ControlNet, `cd = new_sd[x]; cd += ...`, an in-place write into the file's tensor)
        for name, val in other.env.items():
            if name not in self.env:
                self.env[name] = replace(val, maybe=True) if _untainted_there(name, val, self.slots) else val
        for name, val in list(self.env.items()):
            if name not in other.env and _untainted_there(name, val, other.slots) and not val.maybe:
                self.env[name] = replace(val, maybe=True)
        for name, slot in other.slots.items():
            mine = self.slots.get(name)
            if mine is None:
                self.slots[name] = slot
            elif mine != slot:
                self.slots[name] = Slot(mine.fresh and slot.fresh, tuple(x for x in mine.loops if x in slot.loops),
                                        mine.kind if mine.kind == slot.kind else "unknown",
                                        mine.param if mine.param is not None else slot.param,
                                        mine.self_alias or slot.self_alias, mine.inside or slot.inside,
                                        mine.empty and slot.empty)


@dataclass
class IntoParam:
    """Summary fact: the seeded argument was stored into the container passed as parameter ``index``."""

    index: int
    template: Finding
    # a library's keeper made the parameter, a module, keep it (``set_module_tensor_to_device(model, ...)``): the
    # module keeps it for its own life, so a caller's new object handed in is no holder that dies with the step
    for_life: bool = False
    # a nested function's store into a name of the function it is nested in (``state_dict[key] = v`` in kohya's
    # ``update_sd``): the name and how it was stored (``index`` is -1); called from that function, the store is
    # its own into its own local (judged there), from anywhere else the template stands
    free: str = ""
    how: str = ""


@dataclass
class Outcome:
    """What one flow found: findings (root mode) or templates (summary mode), and summary facts."""

    findings: List[Finding] = field(default_factory=list)
    into_param: List[IntoParam] = field(default_factory=list)
    returns: Optional[Val] = None
    yields: Optional[Val] = None  # a generator helper yields (views of) its argument
    # producer inference (:mod:`.producers`): what the function returns / yields that came from a producer
    # it called itself (not from a parameter): it is then a producer too
    produced: Optional[Val] = None
    produced_yield: Optional[Val] = None


class Unresolved:
    """Marker: a call's resolver did not know the callee (the flow then applies its default rules)."""


UNRESOLVED = Unresolved()


def already_kept(val: Val, findings: Sequence[object]) -> bool:
    """Was the tensor ``val`` came from reported kept already, in this walk (a fetch held past the next one,
    then wrapped: ``_LinearWeight(lm_head_weight)``)? Then the object built around it adds no keeping
    statement of its own: the keeper's store stays the finding, beside the first (onnxruntime-genai's MTP head)."""
    first = val.chain[0] if val.chain else None
    if first is None:
        return False
    own = {(getattr(m, "path", ""), getattr(m, "line", 0), getattr(m, "code", "")) for m in val.built_at}
    return any(getattr(f, "chain", None) and f.chain[0] == first  # type: ignore[attr-defined]
               and (getattr(f, "path", ""), getattr(f, "line", 0), getattr(f, "code", "")) not in own
               for f in findings)

__all__ = ["BUILT", "already_kept", "built_class", "Val", "element_of", "Slot", "State", "IntoParam", "Outcome", "UNRESOLVED", "COMPREHENSIONS", "ITER", "PAIR", "TENSOR", "HOLDER", "SOURCE",
           "ELEM_PAIR", "ELEM_TENSOR", "ELEM_ENUM_PAIR", "ELEM_ENUM_TENSOR", "ELEM_HANDLES", "ELEM_HANDLE_PAIRS", "ELEM_STREAMS", "ELEM_DICT",
           "ELEM_FIELDS", "ELEM_FIELD_PAIRS", "ELEM_NESTED", "ELEM_NESTED_PAIRS",
           "is_handles", "handle_of", "handles_holding"]
