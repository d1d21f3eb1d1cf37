"""Producers inferred, not declared: a function (or method) whose result flows from a loader's API is a
producer itself, of the kind of what it hands back.

Engines rarely call the loader's API where they keep the tensor: TGI's layers call ``weights.get_tensor(n)``
on a ``Weights`` object that keeps one ``safe_open`` handle per file (``self._handles[f] = safe_open(f)``,
handed out by ``_get_handle``), a loader class returns ``self.st.get_tensor(key).half()``, a helper returns
``load_file(path)``. Declaring each such getter in ``[tool.ownsan] producers`` is what the audit asked
before; this module finds them itself, by running the flow over every function of the modules that reach a
loader API, with no parameter seeded: what it returns (or yields) that came from a producer makes it one.

* **Kinds.** A tensor (``"tensor"``, with the conversion it applies, ``.half()``, kept for OWN107), a dict
  of tensors by name (``"dict"``), a tuple, list or object holding some (``"holder"``), a ``(name, tensor)``
  iterator (``"iterator"``: a generator that yields them, or a function returning such a stream), or a
  loader's handle (``"source"``: ``_get_handle`` returning ``self._handles[f]``).
* **Getter objects on self.** ``self.<attr>`` bound in any method of the class to a handle (``self.f =
  safe_open(...)``, ``self._handles[f] = h`` with ``h`` a handle, or an inferred ``"source"`` helper's
  result) is a handle in every method of that class (:class:`SelfSources`).
* **Fixed point.** Round after round, the functions that call a producer (built in, configured, or
  inferred the round before) are walked again, until no kind changes (at most :data:`MAX_ROUNDS`): a getter
  calling a getter calling ``safe_open`` is found in three rounds.
* **Calls.** An inferred producer is matched at a call by its name, as a configured one is by its last
  dotted part: ``weights.get_tensor(n)`` on a parameter whose class the audit cannot know is TGI's getter
  because an audited class defines a ``get_tensor`` that is a producer. Names that every container or
  tensor has (``get``, ``items``, ``to``...) are never matched by name (:data:`GENERIC_NAMES`).

Only modules whose text mentions a loader API (:data:`~sanitizer.audit.vocabulary.LOADER_API_HINT`), or a
producer inferred so far, are parsed for it: a 300,000-line tree of model files pays for the few that load.
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.findings import Link
from sanitizer.audit.index import ClassInfo, FunctionInfo, ModuleIndex, annotation_text, dotted, param_defaults
from sanitizer.audit.values import HOLDER, ITER, PAIR, SOURCE, TENSOR, Val

MAX_ROUNDS = 8
# Names that containers, tensors and modules all have: never taken for a producer at a call by name alone.
GENERIC_NAMES = frozenset({
    "get", "pop", "items", "values", "keys", "copy", "setdefault", "update", "__getitem__", "__call__",
    "__init__", "__enter__", "__iter__", "__next__", "forward", "load", "open", "read", "run", "main", "apply",
    "clone", "next", "send", "result", "wait", "state_dict", "parameters", "named_parameters", "buffers",
}) | V.ALIAS_METHODS | V.CONVERSION_METHODS | V.STORE_METHODS | V.SPLIT_METHODS


class Produced(str):
    """A producer's kind (``"tensor"``, ``"dict"``, ``"holder"``, ``"iterator"``, ``"source"``), as the flow
    compares it, with what an inferred one adds: the conversion it applies (``.half()``, for OWN107) and
    where it was inferred from (its definition and the loader API it reaches)."""

    convert: str
    origin: str
    parts: Tuple[str, ...]  # a returned tuple's elements' kinds ("" for one that holds no tensor)
    found: Optional["Inferred"]  # the inferred producer itself (its `when`: borrowed only if a parameter is true)

    def __new__(cls, kind: str, convert: str = "", origin: str = "", parts: Tuple[str, ...] = (),
                found: Optional["Inferred"] = None) -> "Produced":
        made = super().__new__(cls, kind)
        made.convert = convert
        made.origin = origin
        made.parts = parts
        made.found = found
        return made


@dataclass(frozen=True)
class Inferred:
    """One inferred producer: what ``--show-settings`` lists."""

    name: str  # the call's last part it is matched by
    qualname: str
    path: str
    line: int
    kind: str
    convert: str
    api: str  # the loader API it reaches (and where), through its helpers
    # what each element of the tuple it returns is (`return model, state_dict, metadata`: ("", "dict", "")):
    # unpacked, only those elements are borrowed (nunchaku's `transformer, sd, meta = cls._build_model(path)`)
    parts: Tuple[str, ...] = ()
    # borrowed only when this parameter is true (`def read(path, mmap=False): return torch.load(path, mmap=mmap)`):
    # its name, its position among the call's arguments (-1: keyword only) and whether its default is true
    when: str = ""
    when_position: int = -1
    when_default: bool = True
    # a method's class's bases (``SafetensorsLoader`` of ``_HFSafetensorsLoader``): a receiver annotated with
    # one of them may be an object of this class (an abstract loader, its implementation injected)
    bases: Tuple[str, ...] = ()

    def describe(self) -> str:
        conv = f", applies `{self.convert}`" if self.convert else ""
        cond = f", when `{self.when}` is true" if self.when else ""
        return (f"{self.name}={self.kind} ({self.path}:{self.line} `{self.qualname}`{conv}{cond}; "
                f"reaches {self.api})")


@dataclass
class InferredProducers:
    """The producers inferred over a project, by name (several definitions of one name: the first found,
    a tensor getter before a holder)."""

    by_name: Dict[str, Inferred] = field(default_factory=dict)
    # classes whose ``__getitem__`` hands out a loader's tensor (accelerate's ``OffloadedWeightsLoader``, a
    # ``Mapping`` that reads each weight with ``safe_open(...).get_tensor``), by class name
    mappings: Dict[str, Inferred] = field(default_factory=dict)
    # every method inferred a producer, by ``Class.method`` (generic names too: ``HFCheckpointLoader.load``),
    # for a call on a receiver whose class an annotation names (``checkpoint_loader: HFCheckpointLoader``)
    by_method: Dict[str, Inferred] = field(default_factory=dict)
    # module-level functions whose names every module and object has (`def load(path)`): never matched by
    # name, only a call that resolves to that very definition, by (path, line) (mistral-finetune's `load`)
    by_definition: Dict[Tuple[str, int], Inferred] = field(default_factory=dict)
    # a function's parameters that its callers pass a producer as a callable (``shard_loader`` of
    # ``_merge_checkpoint_shards(dir, names, _load_safetensors_file, ...)``), by (path, qualname), then
    # parameter: a call of such a parameter is a call of that producer (:mod:`.passed`)
    passed: Dict[Tuple[str, str], Dict[str, Produced]] = field(default_factory=dict)
    # ComfyUI node types whose output is a loader's tensors (``LBW_MODEL`` of Inspire-Pack's ``MakeLBW.doit``),
    # with the kind of that output: every node method taking an input of that type is handed them (:mod:`.graph`)
    graph_outputs: Dict[str, Tuple[str, Inferred]] = field(default_factory=dict)
    _mention: Optional["re.Pattern[str]"] = None
    _generic_mention: Optional["re.Pattern[str]"] = None

    def passed_into(self, path: str, qualname: str) -> bool:
        """Is a producer passed into this function as one of its parameters?"""
        return (path, qualname) in self.passed

    def passed_kind(self, path: str, qualname: str, param: str) -> Optional[Produced]:
        """What a call of ``param`` in that function returns, when its callers pass a producer as it."""
        return self.passed.get((path, qualname), {}).get(param)

    def kind_of(self, call_name: str) -> Optional[Produced]:
        last = call_name.rpartition(".")[2]
        found = self.by_name.get(last)
        if found is None:
            return None
        return Produced(found.kind, found.convert, f"`{found.qualname}` ({found.path}:{found.line}), "
                                                     f"reaching {found.api}", found.parts, found)

    def kind_of_definition(self, path: str, line: int) -> Optional[Produced]:
        found = self.by_definition.get((path, line))
        if found is None:
            return None
        return Produced(found.kind, found.convert, f"`{found.qualname}` ({found.path}:{found.line}), "
                                                     f"reaching {found.api}", found.parts, found)

    def kind_of_method(self, cls: str, meth: str) -> Optional[Produced]:
        found = self.by_method.get(f"{cls}.{meth}")
        if found is None:
            return None
        return Produced(found.kind, found.convert, f"`{found.qualname}` ({found.path}:{found.line}), "
                                                     f"reaching {found.api}", found.parts, found)

    def mentioned_in(self, text: str) -> bool:
        """Does the module's text name any inferred producer (a cheap pre-check before its functions are
        looked at as callers of one)?"""
        if self.mappings and (_MAPPING_WORD.search(text) or any(name in text for name in self.mappings)):
            return True  # a class of its may keep a mapping of weights (:class:`SelfSources`)
        if self.by_method and any(key.partition(".")[0] in text or any(b in text for b in p.bases)
                                  for key, p in self.by_method.items()):
            return True  # it names a class with a producer method, or a base of one (a parameter annotated with it)
        if self.by_definition:
            if self._generic_mention is None:  # imported by name, or called through its module's name
                names = "|".join(sorted({re.escape(p.name) for p in self.by_definition.values()}))
                stems = "|".join(sorted({re.escape(os.path.splitext(os.path.basename(p.path))[0])
                                         for p in self.by_definition.values()}))
                self._generic_mention = re.compile(rf"\bimport\b[^\n]*\b({names})\b|\b({stems})\.({names})\s*\(")
            if self._generic_mention.search(text):
                return True
        if not self.by_name:
            return False
        if self._mention is None:
            self._mention = re.compile(r"\b(" + "|".join(map(re.escape, sorted(self.by_name))) + r")\s*\(")
        return bool(self._mention.search(text))

    def describe(self) -> List[str]:
        listed = {(p.path, p.line) for p in self.by_name.values()}
        return [p.describe() for _, p in sorted(self.by_name.items())] + [
            f"{key}: {p.describe()}; matched only on a receiver of that class (or a base it implements: a generic "
            f"name)" for key, p in sorted(self.by_method.items()) if (p.path, p.line) not in listed] + [
            f"{p.describe()}; matched only where a call resolves to it (a generic name)"
            for _, p in sorted(self.by_definition.items())] + [
            f"{name}[...]=tensor ({p.path}:{p.line} `{p.qualname}`; a mapping of weights, reaches {p.api})"
            for name, p in sorted(self.mappings.items())]


class SelfSources:
    """Which attributes of each class of one module hold a loader's handle (``self.f = safe_open(...)`` in
    ``__init__``; ``self._handles[name] = f`` with ``f = safe_open(...)``; the result of a helper inferred
    to return a handle), so that ``self.f.get_tensor(n)`` in any method is a producer's tensor."""

    def __init__(self, index: ModuleIndex, is_source: Callable[[str], bool],
                 mappings: Optional[Dict[str, "Inferred"]] = None):
        self._by_class: Dict[str, Dict[str, Tuple[int, str]]] = {}
        self._mapping_api = ""
        for cls in index.all_classes:
            found = _handle_attributes(cls, is_source)
            if mappings:
                for attr, line in _mapping_attributes(cls, mappings).items():
                    some = next(iter(mappings.values()))
                    found.setdefault(attr, (line, f"{MAPPING_API} (e.g. `{some.qualname}`, {some.path}:{some.line})"))
            if found:
                self._by_class[cls.qualname] = found
        by_name = {cls.qualname.rpartition(".")[2]: cls for cls in index.all_classes}
        for cls in index.all_classes:  # a subclass's methods read what its same-module bases bound
            inherited = self._inherited(cls, by_name, 0)
            if inherited:
                self._by_class[cls.qualname] = {**inherited, **self._by_class.get(cls.qualname, {})}

    def _inherited(self, cls: ClassInfo, by_name: Dict[str, ClassInfo], depth: int) -> Dict[str, Tuple[int, str]]:
        """The handle attributes ``cls``'s bases of this module bind (``AutoWrappedNonRecurseModule`` reads the
        ``self.disk_map`` its base ``AutoWrappedModule.__init__`` stored), nearest base first."""
        out: Dict[str, Tuple[int, str]] = {}
        if depth > 6:
            return out
        for base in cls.bases:
            other = by_name.get(base.rpartition(".")[2])
            if other is None or other is cls:
                continue
            for attr, got in {**self._inherited(other, by_name, depth + 1),
                              **self._by_class.get(other.qualname, {})}.items():
                out.setdefault(attr, got)
        return out

    def __bool__(self) -> bool:
        return bool(self._by_class)

    def of(self, info: FunctionInfo) -> Dict[str, Tuple[int, str]]:
        cls = info.enclosing_class
        return self._by_class.get(cls.qualname, {}) if cls is not None else {}

    def value(self, flow: "object", node: ast.Attribute) -> Optional[Val]:
        """The flow's hook for ``self.<attr>``: a handle when the class binds that attribute to one."""
        got = self.of(flow.info).get(node.attr)  # type: ignore[attr-defined]
        if got is None:
            return None
        line, api = got
        fn = flow.fn  # type: ignore[attr-defined]
        if api.startswith(MAPPING_API):
            return Val(SOURCE, 0, (Link(node.lineno, fn, f"`self.{node.attr}` (bound at line {line}: "
                                                         f"{api})"),), fn, mapping=True)
        return Val(SOURCE, 0, (Link(node.lineno, fn, f"`self.{node.attr}` (a handle `{api}(...)` opened at "
                                                     f"line {line})"),), fn)

    def reads(self, info: FunctionInfo) -> bool:
        """Does ``info`` call a method of one of its class's handles (``self.f.get_tensor(n)``)?"""
        attrs = self.of(info)
        if not attrs:
            return False
        if any(c.split(".")[1] in attrs for c in info.calls if c.count(".") >= 2):
            return True
        if info.name == "__getitem__" and any(  # `self.files[i].get_tensor(n)`: a lazy mapping over a list of
                isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)  # handles (DiffSynth's DiskMap)
                and isinstance(sub.func.value, ast.Subscript) and isinstance(sub.func.value.value, ast.Attribute)
                and sub.func.value.value.attr in attrs for sub in ast.walk(info.node)):
            return True  # (only there: a getter method so read, LightX2V's `DiskTensorReader.get_tensor`, would be
            # inferred by its bare name `get_tensor`, and every handle's `get_tensor` of the project matched as it)
        looked_up = {a for a, (_, api) in attrs.items() if api.startswith(MAPPING_API)}
        return bool(looked_up) and any(  # `self.weights_map[name]`: a lookup in a mapping of weights
            isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute) and sub.value.attr in looked_up
            for sub in ast.walk(info.node))


_MAPPING_WORD = re.compile(r"\bMapping\b")
_WORD = re.compile(r"\w+")
MAPPING_API = "a Mapping that may be one whose `__getitem__` reads a loader"
_MAPPING_TYPE = re.compile(r"^(Optional\[)?\s*(typing\.|collections\.abc\.)?(Mapping|MutableMapping)\b")


def _mapping_attributes(cls: ClassInfo, classes: Collection[str] = ()) -> Dict[str, int]:
    """``attr -> line`` for ``self.attr = param`` in ``__init__`` where ``param`` is annotated a ``Mapping``
    (``weights_map: Optional[Mapping] = None``) or one of ``classes``, the project's classes whose
    ``__getitem__`` reads a loader (DiffSynth's ``disk_map: DiskMap = None``): with such a class in the
    project, a lookup in it (``self.weights_map[name]``) hands out a loader's tensor."""
    init = cls.methods.get("__init__")
    if init is None:
        return {}
    typed = {a.arg for a in init.params if a.annotation is not None
             and (_MAPPING_TYPE.match(annotation_text(a.annotation))
                  or any(w in classes for w in _WORD.findall(annotation_text(a.annotation))))}
    if not typed:
        return {}
    me = init.params[0].arg if init.params else "self"
    out: Dict[str, int] = {}
    for sub in ast.walk(init.node):
        if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Name) and sub.value.id in typed:
            for target in sub.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
                    out.setdefault(target.attr, sub.lineno)
    return out


def _handle_attributes(cls: ClassInfo, is_source: Callable[[str], bool]) -> Dict[str, Tuple[int, str]]:
    """``attr -> (line, api)`` for every ``self.attr`` (or ``self.attr[...]``) a method binds to a handle."""
    out: Dict[str, Tuple[int, str]] = {}
    for method in cls.methods.values():
        node = method.node
        me = method.params[0].arg if method.params else "self"
        handles: Dict[str, str] = {}  # local name -> the call that opened it
        for sub in ast.walk(node):
            if isinstance(sub, ast.withitem) and isinstance(sub.context_expr, ast.Call) \
                    and isinstance(sub.optional_vars, ast.Name):
                name = dotted(sub.context_expr.func)
                if is_source(name):
                    handles[sub.optional_vars.id] = name
            elif isinstance(sub, ast.Assign):
                value = sub.value
                api = dotted(value.func) if isinstance(value, ast.Call) else ""
                if isinstance(value, ast.Name):
                    api = handles.get(value.id, "")
                elif api and not is_source(api):
                    api = ""
                if not api:
                    continue
                for target in sub.targets:
                    if isinstance(target, ast.Name):
                        handles[target.id] = api
                    base = target.value if isinstance(target, ast.Subscript) else target
                    if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == me:
                        out.setdefault(base.attr, (sub.lineno, api))
            elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _FILLS \
                    and len(sub.args) == 1 and isinstance(sub.func.value, ast.Attribute) \
                    and isinstance(sub.func.value.value, ast.Name) and sub.func.value.value.id == me:
                # `self.files.append(safe_open(path, ...))` (DiffSynth's DiskMap, in a method of its own): a
                # list of handles, each read as `self.files[i].get_tensor(name)`
                arg = sub.args[0]
                api = dotted(arg.func) if isinstance(arg, ast.Call) else handles.get(getattr(arg, "id", ""), "")
                if api and is_source(api):
                    out.setdefault(sub.func.value.attr, (sub.lineno, api))
    return out


_FILLS = frozenset({"append", "insert", "add"})


def kind_of_value(val: Val, generator: bool) -> Optional[str]:
    """The producer kind a returned (or yielded) value makes of its function."""
    if generator:
        if val.kind == HOLDER and val.capture is None and not val.obj and val.parts is None \
                and val.elem != "pair":
            return "dicts"  # a generator of whole dicts, a file's each (`yield load_file(path)`); not a
            # `yield name, holder` tuple, whose items are (name, value) pairs
        return "iterator" if val.kind in (PAIR, TENSOR) else None
    if val.kind == TENSOR:
        return "tensor"
    if val.kind == ITER:
        return "iterator"
    if val.kind == SOURCE:
        return "source"
    if val.kind == HOLDER and val.capture is None and not val.obj and not val.built_at:  # (an object built around a fetched
        # tensor and returned is how a loader keeps it: reported at that return, never handed on)
        if val.parts is not None and all(p is None or p.obj for p in val.parts):
            return None  # `return (clip_model,)`: a tuple of objects built around the tensors (a ComfyUI node's)
        return "dict" if val.mapping or val.elem == "pair" else "holder"
    if val.kind == PAIR:
        return "holder"
    return None


_KEPT_HANDLE = re.compile(r"a handle `(.+?)` opened at line (\d+)")


def api_of(val: Val, path: str) -> str:
    """The loader API a producer's value came from, as its chain's first link says it (an inferred
    producer's link names the API it reached itself)."""
    first = val.chain[0] if val.chain else None
    if first is None:
        return "a loader API"
    text = first.text
    where = first.path or path
    kept = _KEPT_HANDLE.search(text)
    if kept:
        return f"`{kept.group(1)}` ({where}:{kept.group(2)})"
    marker = "(a producer: "
    if marker in text:
        inner = text[text.index(marker) + len(marker):-1]
        reach = inner.rpartition("reaching ")[2]
        return reach or inner
    return f"{text.replace('opened by ', '').replace('returned by ', '').replace('yielded by ', '')} " \
           f"({where}:{first.line})"


def candidate(info: FunctionInfo, is_producer_call: Callable[[str], bool], self_sources: SelfSources) -> bool:
    """Is ``info`` worth walking for inference: does it call a producer, or a handle kept on ``self``?"""
    return any(is_producer_call(c) for c in info.calls) or self_sources.reads(info)


def record_mapping(found: Dict[str, Inferred], info: FunctionInfo, path: str, val: Val) -> bool:
    """A class's ``__getitem__`` that returns a loader's tensor makes the class a mapping of weights."""
    cls = info.cls
    if cls is None or kind_of_value(val, False) != "tensor":
        return False
    name = cls.qualname.rpartition(".")[2]
    if name in found:
        return False
    found[name] = Inferred(name, info.qualname, path, info.node.lineno, "tensor",  # type: ignore[attr-defined]
                           val.convert, api_of(val, path))
    return True


def record_iterable(found: Dict[str, Inferred], info: FunctionInfo, path: str, val: Val) -> bool:
    """A class whose ``__iter__`` is a generator yielding a loader's tensors (verl's ``StateDictIterator``:
    ``with safe_open(self.filepath) as f: for k in f.keys(): yield k, f.get_tensor(k)``) makes each of its
    objects a weights stream: ``Cls(path)`` is matched as a producer of kind ``"iterator"``, so a loop over
    it (or over a list of them) yields tensors valid for that iteration, as a generator function's call
    does. Only ``__iter__`` itself: the object is iterated by ``for``, nothing else is called on it."""
    cls = info.cls
    if cls is None or kind_of_value(val, True) != "iterator":
        return False
    name = cls.qualname.rpartition(".")[2]
    if name in found or name in GENERIC_NAMES:
        return False
    found[name] = Inferred(name, info.qualname, path, info.node.lineno, "iterator",  # type: ignore[attr-defined]
                           "", api_of(val, path))
    return True


def record_method(found: Dict[str, Inferred], info: FunctionInfo, path: str, val: Val, generator: bool) -> bool:
    """A method inferred a producer, by ``Class.method`` whatever its name (True when new)."""
    kind = kind_of_value(val, generator)
    cls = info.cls
    if kind is None or cls is None or _dunder(info.name):
        return False
    key = f"{cls.qualname.rpartition('.')[2]}.{info.name}"
    if key in found:
        return False
    bases = tuple(b for b in (b.rpartition(".")[2] for b in cls.bases) if b not in _PLAIN_BASES)
    found[key] = Inferred(info.name, info.qualname, path, info.node.lineno, kind,  # type: ignore[attr-defined]
                          val.convert if kind == "tensor" else "", api_of(val, path), parts_of(val, generator),
                          *condition_of(info, val), bases=bases)
    return True


# bases every kind of class has: naming one says nothing about a loader
_PLAIN_BASES = frozenset({"object", "ABC", "Protocol", "Generic", "Module", "NamedTuple", "Enum", "Exception", "dict",
                          "Mapping", "MutableMapping", "Iterable", "Iterator", "Dataset", "IterableDataset"})


def parts_of(val: Val, generator: bool) -> Tuple[str, ...]:
    """The kinds of a returned tuple's elements (``return model, state_dict``: ("", "dict")), or (). A pair
    (``return text_model, logit_scale``, read as a ``(name, tensor)`` item) has them too: unpacked, only its
    second element is the file's (kohya's ``load_models_from_sdxl_checkpoint``)."""
    if generator or val.kind not in (HOLDER, PAIR) or val.parts is None:
        return ()
    return tuple((kind_of_value(p, False) or "") if p is not None else "" for p in val.parts)


def condition_of(info: FunctionInfo, val: Val) -> Tuple[str, int, bool]:
    """(name, position among a call's arguments, default) of the parameter ``val`` is borrowed under
    (``Val.when``), or ("", -1, True): a call that passes it false, or leaves a false default, gets no borrowed
    tensor (``def read(path, mmap=False): return torch.load(path, mmap=mmap)``; a blind user's false alarm)."""
    if not val.when:
        return "", -1, True
    default = param_defaults(info).get(val.when)
    truthy = not isinstance(default, ast.Constant) or bool(default.value)
    args = info.node.args  # type: ignore[attr-defined]
    names = [a.arg for a in list(args.posonlyargs) + list(args.args)]
    position = names.index(val.when) if val.when in names else -1
    if position >= 0 and info.is_method:
        position -= 1  # `self`/`cls` is not among a call's arguments
    return val.when, position, truthy


def _dunder(name: str) -> bool:
    """A special method (``__getitem__``, ``__call__``: the protocols above), not a class-private one
    (``__load_embedding``, called as ``self.__load_embedding(...)`` in its class: OneTrainer's loader mixins)."""
    return name.startswith("__") and name.endswith("__")


def record_definition(found: Dict[Tuple[str, int], Inferred], info: FunctionInfo, path: str, val: Val,
                      generator: bool) -> bool:
    """A module-level function with a generic name (``def load(filename)``: ``load_file`` or ``torch.load``)
    inferred a producer by its definition (True when new or changed): matched only by calls that resolve to it."""
    kind = kind_of_value(val, generator)
    if kind is None or info.cls is not None or info.parent is not None or info.name not in GENERIC_NAMES \
            or _dunder(info.name):
        return False
    mine = Inferred(info.name, info.qualname, path, info.node.lineno, kind,  # type: ignore[attr-defined]
                    val.convert if kind == "tensor" else "", api_of(val, path), parts_of(val, generator),
                    *condition_of(info, val))
    key = (path, info.node.lineno)  # type: ignore[attr-defined]
    if found.get(key) == mine:
        return False
    found[key] = mine
    return True


def record(found: Dict[str, Inferred], info: FunctionInfo, path: str, val: Val, generator: bool) -> bool:
    """Add ``info`` as a producer of ``val``'s kind (True when that is new or changed)."""
    kind = kind_of_value(val, generator)
    name = info.name
    if kind is None or name in GENERIC_NAMES or _dunder(name):
        return False
    mine = Inferred(name, info.qualname, path, info.node.lineno, kind,  # type: ignore[attr-defined]
                    val.convert if kind == "tensor" else "", api_of(val, path), parts_of(val, generator),
                    *condition_of(info, val))
    old = found.get(name)
    if old is not None and (old.path, old.line) != (mine.path, mine.line):
        rank = ("tensor", "dict", "iterator", "dicts", "holder", "source")
        if rank.index(old.kind) <= rank.index(kind):
            return False  # two definitions of one name: the one that hands out tensors is kept
    if old == mine:
        return False
    found[name] = mine
    return True


__all__ = ["Produced", "Inferred", "InferredProducers", "SelfSources", "GENERIC_NAMES", "MAX_ROUNDS",
           "kind_of_value", "api_of", "candidate", "record", "record_definition", "record_mapping", "record_iterable",
           "record_method", "MAPPING_API"]
