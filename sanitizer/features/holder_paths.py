"""How a holder is named: path segments, roots a person recognises, and where they live in code.

The walk in :mod:`sanitizer.features.holders` climbs from a tensor to its referrers;
this module says how each step reads (``.attr``, ``[3]``, ``['key']``) and
when a referrer is a root worth stopping at: a module global, a class
attribute, an instance of a class outside the standard library, a frame's or a
suspended generator's local, a closure, a ``functools.partial``. Standard
library containers (lists, dicts, ``inspect.BoundArguments``...) are walked
through, so a path reads like the seed bug's
``LayerReloadingInfo.loaded_weights[3][1].arguments['loaded_weight']``.
"""
from __future__ import annotations

import gc
import inspect
import keyword
import os
import re
import sys
import types
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from sanitizer.core import thread_reach
from sanitizer.core.sites import is_internal_file, torch_dir
from sanitizer.features.holder import Holder

_CO_OPTIMIZED = inspect.CO_OPTIMIZED
GEN_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)  # PEP 667: 3.13 gives a write-through proxy instead
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"builtins", "__builtin__"}
_PLAIN_KEYS = (str, int, float, bool, type(None), bytes)  # repr() of a tensor key would read its bytes


def internal(code: types.CodeType) -> bool:
    """Our own frame? The same rule as stack capture: :func:`sanitizer.core.sites.is_internal_file`."""
    return is_internal_file(code.co_filename)


def qualname(code: types.CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)


def site_of_frame(frame: types.FrameType) -> Dict[str, Any]:
    return {"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": qualname(frame.f_code)}


def _site_of_code(code: types.CodeType) -> Dict[str, Any]:
    return {"file": code.co_filename, "line": code.co_firstlineno, "function": qualname(code)}


_CLASS_SITES: Dict[type, Optional[Dict[str, Any]]] = {}


def _site_of_class(cls: type) -> Optional[Dict[str, Any]]:
    """Where ``cls`` is defined (cached: ``inspect.findsource`` parses the module once)."""
    if cls not in _CLASS_SITES:
        site = None
        try:
            lines, line = inspect.findsource(cls)
            while line + 1 < len(lines) and lines[line].lstrip().startswith("@"):
                line += 1  # findsource points at the first decorator; people look for `class`
            site = {"file": inspect.getsourcefile(cls), "line": line + 1, "function": cls.__qualname__}
        except (OSError, TypeError, IndexError):
            file = _file_of(sys.modules.get(getattr(cls, "__module__", ""), None), vars(cls))
            site = {"file": file, "line": _class_line(file, cls.__name__), "function": cls.__qualname__} \
                if file else None
        _CLASS_SITES[cls] = site
    return _CLASS_SITES[cls]


_MODULE_FILES: Dict[str, str] = {}  # module name -> its file, as first seen (``__main__`` loses it)


def _file_of(module: Optional[types.ModuleType], names: Optional[Dict[str, Any]] = None) -> Optional[str]:
    """The file ``module`` was run from. CPython deletes ``__main__.__file__`` when the script returns,
    so a holder named at exit (the report's final settle) would live at "?": fall back to the file seen
    before, then to the code of a function defined in it (or in ``names``, a class's own dict)."""
    if module is None:
        return None
    name = getattr(module, "__name__", None)
    file = getattr(module, "__file__", None)
    if file:
        if isinstance(name, str):
            _MODULE_FILES[name] = file
        return file
    if name in _MODULE_FILES:
        return _MODULE_FILES[name]
    for value in list((names if names is not None else vars(module)).values()):
        fn = getattr(value, "__func__", value)
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType) and getattr(fn, "__module__", None) == name:
            return code.co_filename
    return None


def _class_line(file: str, name: str) -> Optional[int]:
    """The line of ``class name`` in ``file`` (the first one at any indent), or None."""
    import linecache

    pattern = re.compile(rf"^\s*class\s+{re.escape(name)}\b")
    for i, text in enumerate(linecache.getlines(file), 1):
        if pattern.match(text):
            return i
    return None


_BINDS = re.compile(r"^\(?\s*([\w\s,*]+?)\s*\)?\s*(?::[^=]*)?=(?!=)")


def _module_site(module: types.ModuleType, name: str) -> Optional[Dict[str, Any]]:
    """The module's file and the first top-level statement that binds ``name`` (best effort: ``name =``,
    ``name: T =``, ``a, name = ...`` and a statement after ``;`` on one line)."""
    file = _file_of(module)
    if not file:
        return None
    line = None
    try:
        import linecache

        for i, text in enumerate(linecache.getlines(file), 1):
            if not text[:1].isidentifier() and text[:1] != "(":
                continue  # top level only: a function's local of the same name is not the global
            for part in text.split(";"):
                m = _BINDS.match(part.strip())
                words = m.group(1).replace(",", " ").replace("*", " ").split() if m else ()
                if words and not keyword.iskeyword(words[0]) and name in words:
                    line = i
                    break
            if line is not None:
                break
    except Exception:  # a source we cannot read only costs the line number
        pass
    return {"file": file, "line": line, "function": "<module>"}


def _fn_name(fn: Any) -> str:
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _fn_site(fn: Any) -> Optional[Dict[str, Any]]:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return _site_of_code(code) if code is not None else None


def locals_of(frame: types.FrameType) -> Dict[str, Any]:
    """The frame's locals, without leaving a snapshot behind that would keep them alive."""
    code = frame.f_code
    if not code.co_flags & _CO_OPTIMIZED:
        return {}  # module and class bodies: their names are found as globals / class attributes
    loc = frame.f_locals
    out = dict(loc)
    if _SNAPSHOT_LOCALS and type(loc) is dict and sys.getrefcount(loc) <= 3:
        # Only the frame and we hold the snapshot (no `d = locals()` in the program): a cache, unless the
        # frame's thread is inside a Python trace or profile hook, whose trampoline writes this dict back
        # into the fast locals when the hook returns (a cleared one would unbind them): cleared only while no
        # thread is in one. 3 = the frame, `loc`, getrefcount's argument.
        thread_reach.clear_unless_a_thread_traces(loc)
    return out



Seg = Tuple[Any, ...]
"""A path step, from a referrer down to its referent: ("i", n) list/tuple index, ("k", key) dict value,
("a", name) attribute, ("c",) cell contents, ("?", text) a step we can print but not follow again;
and the first steps below a root: ("g", name) module global, ("ca", name) class attribute,
("l", name) generator local, ("cl", i) closure cell, ("df",) defaults, ("pa",) / ("pk",) partial args /
keywords; ("al", kind) marks a path that ends at an alias of the view (a numpy array), not the view. Structured, so that a found path can be followed again for the next lease (see holders.py)."""

_TEXT = {"a": ".{}", "g": ".{}", "ca": ".{}", "i": "[{}]", "pa": ".args", "pk": ".keywords"}


def render(segs: Tuple[Seg, ...]) -> str:
    out = []
    module_dict: Optional[str] = None
    for seg in segs:
        tag = seg[0]
        if tag == "a" and seg[1] in ("_parameters", "_buffers"):
            module_dict = seg[1]  # module._parameters['weight'] reads as module.weight (how the model names it)
            continue
        if module_dict is not None:
            attr, module_dict = module_dict, None
            if tag == "k" and isinstance(seg[1], str) and seg[1].isidentifier():
                out.append(f".{seg[1]}")
                continue
            out.append(f".{attr}")
        if tag == "k":
            out.append(f"[{seg[1]!r}]")
        elif tag == "?":
            out.append(seg[1])
        elif tag == "al":
            out.append(f" (a {seg[1]} alias of the view)")
        elif tag in _TEXT:
            out.append(_TEXT[tag].format(*seg[1:]))
    if module_dict is not None:
        out.append(f".{module_dict}")
    return "".join(out)


def label(parent: Any, child: Any) -> Optional[Seg]:
    """How ``parent`` refers to ``child``, as a path step; None if we cannot tell."""
    tp = type(parent)
    if tp is list or tp is tuple:
        for i, x in enumerate(parent):
            if x is child:
                return ("i", i)
        return None
    if isinstance(parent, dict):
        for k, v in parent.items():
            if v is child:
                return ("k", k) if type(k) in _PLAIN_KEYS else ("?", f"[<{type(k).__name__}>]")
            if k is child:
                return ("?", f"<key {type(k).__name__}>")
        return None
    if isinstance(parent, (set, frozenset)):
        return ("?", "{…}")
    if tp is types.CellType:
        return ("c",)
    if tp is types.MethodType:
        return ("?", ".__self__" if parent.__self__ is child else ".__func__")
    d = getattr(parent, "__dict__", None) if not isinstance(parent, type) else None
    if isinstance(d, dict):
        if d is child:
            return ("d",)
        for k, v in d.items():
            if v is child:
                return ("a", k)
    for klass in tp.__mro__:
        slots = klass.__dict__.get("__slots__") or ()
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot in ("__dict__", "__weakref__"):
                continue
            try:
                if getattr(parent, _mangled(klass, slot)) is child:
                    return ("a", slot)
            except AttributeError:
                continue
    return None


def _mangled(klass: type, slot: str) -> str:
    return f"_{klass.__name__.lstrip('_')}{slot}" if slot.startswith("__") and not slot.endswith("__") else slot


def join(seg: Seg, below: Tuple[Seg, ...]) -> Tuple[Seg, ...]:
    """Prepend a step; an instance ``__dict__`` followed by its ``['k']`` reads as ``.k``."""
    if seg == ("d",):
        if below and below[0][0] == "k" and isinstance(below[0][1], str):
            return (("a", below[0][1]),) + below[1:]
        return below
    return (seg,) + below


def _ref(obj: Any) -> Optional[Callable[[], Any]]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


def _head(segs: Tuple[Seg, ...], tag: str) -> Optional[Any]:
    return segs[0][1] if segs and segs[0][0] == tag else None


def _make(kind: str, obj: Any, head: str, segs: Tuple[Seg, ...], site: Optional[Dict[str, Any]],
          strong: bool = False) -> Holder:
    """A holder named ``head`` + steps; remembers how to follow the same steps again from ``obj``."""
    ref = (lambda o=obj: o) if strong else _ref(obj)
    steps, detour = without_detours(segs)
    # The pattern keeps the detour marks: a replay of it is a path through our objects too (never rank 0).
    pattern = None if ref is None or any(seg[0] in ("?", "al") for seg in steps) else (ref, segs, kind, head, site)
    return Holder(kind, head + render(steps), site, pattern=pattern, detour=detour)


DETOUR: Seg = ("x",)
"""Marks a step through an object of the sanitizer's own classes (renders as nothing, followed by nothing)."""


def without_detours(segs: Tuple[Seg, ...]) -> Tuple[Tuple[Seg, ...], int]:
    steps = tuple(seg for seg in segs if seg != DETOUR)
    return steps, len(segs) - len(steps)


_INTERNAL_CLASSES: Dict[type, bool] = {}


def internal_class(tp: type) -> bool:
    """Is ``tp`` defined by the sanitizer itself (a DeferralScope, a staging buffer)? Never a consumer."""
    known = _INTERNAL_CLASSES.get(tp)
    if known is None:
        module = sys.modules.get(getattr(tp, "__module__", "") or "")
        file = getattr(module, "__file__", None)
        known = _INTERNAL_CLASSES[tp] = bool(file) and is_internal_file(os.path.abspath(file))
    return known


def root(r: Any, child: Any, below: Tuple[Seg, ...], modules: Dict[int, Tuple[str, Any]]) -> Optional[Holder]:
    """If ``r`` is something a person recognises, the holder it names; else None (walk on)."""
    tp = type(r)
    if id(r) in modules:
        name, mod = modules[id(r)]
        for k, v in r.items():
            if v is child and isinstance(k, str):
                return _make("global", r, name, (("g", k),) + below, _module_site(mod, k), strong=True)
        return None
    if tp is dict and "__builtins__" in r and type(r.get("__name__")) is str:
        found = _namespace_root(r, child, below, modules)
        if found is not None:
            return found
    if tp is types.FrameType:
        if internal(r.f_code) or r.f_code.co_filename.startswith(torch_dir()):
            return None  # our own frames, torch's dispatch frames: they hold a read's arguments, nobody's holder
        for k, v in locals_of(r).items():
            if v is child:
                gen = bool(r.f_code.co_flags & GEN_FLAGS)
                return Holder("generator" if gen else "frame",
                              f"local '{k}' of {'generator ' if gen else ''}{qualname(r.f_code)}(){render(below)}",
                              site_of_frame(r), frame_id=id(r), local=k)
        return None
    if tp in (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType):
        frame = getattr(r, "gi_frame", None) or getattr(r, "cr_frame", None) or getattr(r, "ag_frame", None)
        if frame is None or internal(frame.f_code):
            return None
        for k, v in locals_of(frame).items():
            if v is child:
                return _make("generator", r, f"local '{k}' of generator {qualname(frame.f_code)}()",
                             (("l", k),) + below, site_of_frame(frame))
        return None
    if tp is types.FunctionType:
        idx = _head(below, "i")
        if r.__closure__ is child and idx is not None and below[1:2] == (("c",),):
            return _make("closure", r, f"closure of {r.__qualname__} (variable '{r.__code__.co_freevars[idx]}')",
                         (("cl", idx),) + below[2:], _site_of_code(r.__code__))
        if r.__defaults__ is child:
            return _make("closure", r, f"defaults of {r.__qualname__}", (("df",),) + below, _site_of_code(r.__code__))
        return None
    if isinstance(r, partial):
        tag = "pa" if r.args is child else "pk" if r.keywords is child else None
        if tag is None:
            return None
        return _make("partial", r, f"partial({_fn_name(r.func)})", ((tag,),) + below, _fn_site(r.func))
    if isinstance(r, type):
        name = _head(below, "k")
        if isinstance(name, str) and any(child is d for d in gc.get_referents(r)):
            return _make("class", r, f"{r.__module__}.{r.__qualname__}", (("ca", name),) + below[1:],
                         _site_of_class(r))
        return None
    if tp.__module__.split(".")[0] in _STDLIB or isinstance(r, torch.Tensor) or internal_class(tp):
        return None  # stdlib containers (BoundArguments, deque...), tensor subclasses, ours: walk through them
    seg = label(r, child)
    if seg is None:
        return None
    return _make("object", r, tp.__qualname__, join(seg, below), _site_of_class(tp))


def _namespace_root(r: Dict[str, Any], child: Any, below: Tuple[Seg, ...],
                    modules: Dict[int, Tuple[str, Any]]) -> Optional[Holder]:
    """A module's namespace that ``sys.modules`` does not hold, named as its module: multiprocessing's spawn
    and forkserver workers run the main script with ``runpy.run_path``, whose functions keep the namespace
    they ran in while ``sys.modules['__main__']`` holds a copy of it. Both reach the same list: without this
    one global read as a second consumer (``__main__.work<function>['KEPT']`` beside ``__main__.KEPT``)."""
    mod = sys.modules.get(r["__name__"])
    if not isinstance(mod, types.ModuleType):
        return None
    named = modules.get(id(getattr(mod, "__dict__", None)))
    for k, v in r.items():
        if v is child and isinstance(k, str):
            return _make("global", r, named[0] if named else r["__name__"], (("g", k),) + below,
                         _module_site(mod, k), strong=True)
    return None


def step(obj: Any, seg: Seg) -> Iterator[Tuple[Seg, Any]]:
    """Follow one step down from ``obj``: ``(concrete step, child)`` pairs.

    List indices and dict keys are wildcards (a consumer that kept ``pending['layers.3.weight']``
    keeps ``pending['layers.4.weight']`` the same way), tried newest first: the exact key, then
    the other keys and the list items from the end, where a consumer appends what it keeps.
    Module globals (``g``) stay exact: the name is the holder."""
    tag = seg[0]
    try:
        if tag == "x":  # a detour mark (through one of our objects): no step
            yield seg, obj
        elif tag == "i":
            if type(obj) is list or type(obj) is tuple:
                for i in range(len(obj) - 1, -1, -1):
                    yield ("i", i), obj[i]
        elif tag == "k":
            if isinstance(obj, dict):
                key = seg[1]
                if key in obj:
                    yield seg, obj[key]
                for k in reversed(obj):  # lazily: a replay stops after the newest few
                    if k != key and type(k) in _PLAIN_KEYS:
                        yield ("k", k), obj[k]
        elif tag == "g":
            if isinstance(obj, dict) and seg[1] in obj:
                yield seg, obj[seg[1]]
        elif tag == "a":
            d = getattr(obj, "__dict__", None)
            if isinstance(d, dict) and seg[1] in d:
                yield seg, d[seg[1]]
            else:
                for klass in type(obj).__mro__:
                    slots = klass.__dict__.get("__slots__") or ()
                    if seg[1] in ((slots,) if isinstance(slots, str) else slots):
                        yield seg, getattr(obj, _mangled(klass, seg[1]))
                        break
        elif tag == "ca":
            if isinstance(obj, type) and seg[1] in obj.__dict__:
                yield seg, obj.__dict__[seg[1]]
        elif tag == "c":
            yield seg, obj.cell_contents
        elif tag == "cl":
            yield seg, obj.__closure__[seg[1]].cell_contents
        elif tag == "df":
            yield seg, obj.__defaults__
        elif tag == "pa":
            yield seg, obj.args
        elif tag == "pk":
            yield seg, obj.keywords
        elif tag == "l":
            frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
            loc = locals_of(frame) if frame is not None else {}
            if seg[1] in loc:
                yield seg, loc[seg[1]]
    except (AttributeError, IndexError, ValueError, TypeError, KeyError, RuntimeError):  # an empty cell, a changed object
        return


class Frames:
    """Executing frames by id, found lazily: this thread's stack first, from ``start`` up, and only as far
    as a look-up needs (a consumer's frame is a few frames above the put that retires its view), then
    every thread's stacks once, when this one's misses. A replay runs at every retire: mapping every
    frame of every thread first cost more than the rest of a short replay. :meth:`clear` drops the
    references (a frame's locals hold the lent view)."""

    __slots__ = ("_map", "_next", "_all")

    def __init__(self, start: Optional[types.FrameType]) -> None:
        self._map: Dict[int, types.FrameType] = {}
        self._next = start
        self._all = False

    def get(self, frame_id: int) -> Optional[types.FrameType]:
        found = self._map.get(frame_id)
        if found is not None:
            return found
        frame = self._next
        while frame is not None:
            self._map[id(frame)] = frame
            if id(frame) == frame_id:
                self._next = frame.f_back
                return frame
            frame = frame.f_back
        self._next = None
        if not self._all:
            self._all = True
            for frame in list(sys._current_frames().values()):
                while frame is not None:
                    self._map.setdefault(id(frame), frame)
                    frame = frame.f_back
            return self._map.get(frame_id)
        return None

    def clear(self) -> None:
        self._map.clear()
        self._next = None


class FrameLocal:
    """The root of a holder path that starts at an executing frame's local: found again by the frame's
    identity (id and code object; frames take no weak references, and we must not keep one alive).
    Calling it returns the local's current value, or None once the frame is gone."""

    __slots__ = ("frame_id", "code", "name")

    def __init__(self, frame: types.FrameType, name: str):
        self.frame_id, self.code, self.name = id(frame), frame.f_code, name

    def __call__(self) -> Any:
        frames = Frames(sys._getframe(1))
        try:
            return self.of(frames, {})
        finally:  # this very frame may be among them: a reference to it from its own locals is a cycle that
            frames.clear()  # would keep every caller's locals (the lent view) alive until the next gc

    def of(self, frames: "Frames", seen: Dict[int, Dict[str, Any]]) -> Any:
        """The local's value, its frame looked up in ``frames`` (made by the caller once for many
        roots); None once the frame is gone. ``seen`` (frame id -> locals, the
        caller's, cleared when it is done) shares one snapshot of a frame's locals among its roots."""
        frame = frames.get(self.frame_id)
        if frame is None or frame.f_code is not self.code:
            return None
        loc = seen.get(self.frame_id)
        if loc is None:
            loc = seen[self.frame_id] = locals_of(frame)
        return loc.get(self.name)

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, FrameLocal) and other.frame_id == self.frame_id and other.code is self.code
                and other.name == self.name)

    def __hash__(self) -> int:
        return hash((self.frame_id, self.name))


__all__ = ["Seg", "FrameLocal", "Frames", "DETOUR", "without_detours", "internal_class", "label", "join", "root", "render", "step", "locals_of", "internal",
           "qualname", "site_of_frame", "GEN_FLAGS"]
