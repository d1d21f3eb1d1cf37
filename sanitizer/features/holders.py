"""Who holds a lease: walk back from its tensors to something a person recognises.

A retained borrowed view is a bug in *some* consumer; the report must say
which. We find every tensor whose storage is the lease's (a gc scan), then walk
``gc.get_referrers`` breadth-first, one pass over the heap per level, labelling
each step (``.attr``, ``[3]``, ``['key']``), until we reach a root a person
knows: a module global, an instance of a user class, a frame's local, a
suspended generator's local, a closure, a ``functools.partial``. Executing
frames are invisible to the gc on CPython 3.11+, so the threads' stacks are
scanned directly. The walk is bounded in depth and time: it is slow by nature
(each level visits the whole heap) and runs only while triage is active.

Reading ``frame.f_locals`` on CPython < 3.13 stores a snapshot dict on the
frame that would keep every local alive after the function rebinds it; we
clear those snapshots again, so the walk never extends a lifetime.
"""
from __future__ import annotations

import gc
import itertools
from inspect import CO_OPTIMIZED
import sys
import threading
import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from sanitizer.core import forking
from sanitizer.core.sites import torch_dir
from sanitizer.features.frozen_heap import FrozenHeap
from sanitizer.features.holder import Holder, consumer_key
from sanitizer.features.holder_paths import (DETOUR, GEN_FLAGS, FrameLocal, Frames, Seg, internal,
                                             internal_class, join, label, locals_of, qualname, render, root,
                                             site_of_frame, step, without_detours)

_MAX_FRONTIER = 256
_EXTRA_LEVELS = 2  # levels walked on once every storage has a holder a person recognises: its other holders
_MAX_PATTERNS = 16  # holder paths remembered, most recent first
_REPLAY_VISITS = 20_000  # objects one replay may visit before it gives up (it stops at the first match)
_REPLAY_WINDOW = 64  # entries of one container a replay tries per wildcard step, newest first
_MORE_TURNS = 2  # tensors each other known path may still offer once a storage was found (its other holders)
_patterns: List[tuple] = []  # (root getter: weakref, strong lambda or FrameLocal; steps, kind, head, site)
_patterns_lock = threading.Lock()


@dataclass
class WalkResult:
    holders: Dict[int, List[Holder]] = field(default_factory=dict)  # storage key -> holders, best first
    tensors: int = 0
    truncated: bool = False  # the depth or time bound cut the walk short
    replayed: int = 0  # storages named by following a remembered holder path (no heap walk)


def _stacks() -> List[Tuple[types.FrameType, bool]]:
    """Every executing frame of every thread, with 'is on the calling thread'. Ours and torch's own
    are left out: the dispatch frames of a stale read hold its arguments, and are nobody's holder."""
    me = threading.get_ident()
    out: List[Tuple[types.FrameType, bool]] = []
    for tid, frame in sys._current_frames().items():
        while frame is not None:
            code = frame.f_code
            if not internal(code) and not code.co_filename.startswith(torch_dir()):
                out.append((frame, tid == me))
            frame = frame.f_back
    return out


class _Walk:
    """State of one bounded walk; every object it holds is dropped when it ends."""

    def __init__(self, keys: Set[int], depth: int, deadline: float, max_holders: int):
        self.keys = keys
        self.depth = depth
        self.deadline = deadline
        self.max_holders = max_holders
        self.result = WalkResult()
        self.found: Dict[int, List[Holder]] = {k: [] for k in keys}
        self.seen_paths: Set[Tuple[int, str]] = set()
        self.aliases: Aliases = {}
        # after the program's gc.freeze(): the objects gc's own scans skip (found once, for this walk only)
        self.frozen: Optional[FrozenHeap] = FrozenHeap() if FrozenHeap.present() else None

    def heap(self) -> List[Any]:
        """Every object the collector tracks, the frozen ones too (a new list: the caller drops it)."""
        objs = gc.get_objects()
        if self.frozen is not None:
            objs.extend(self.frozen.objects())
        return objs

    def out_of_time(self) -> bool:
        if time.thread_time() > self.deadline:
            self.result.truncated = True
            return True
        return False

    def add(self, key: int, holder: Holder) -> None:
        bucket = self.found[key]
        if (key, holder.path) in self.seen_paths or len(bucket) >= self.max_holders:
            return
        self.seen_paths.add((key, holder.path))
        bucket.append(holder)

    def done(self) -> bool:
        """Every storage has a holder a person recognises (rank 0), or as many holders as it may name."""
        return all(any(h.rank == 0 for h in b) or len(b) >= self.max_holders for b in self.found.values())

    def full(self) -> bool:
        return all(len(b) >= self.max_holders for b in self.found.values())


def _tensor_types() -> Set[type]:
    out: Set[type] = set()
    todo = [torch.Tensor]
    while todo:
        cls = todo.pop()
        if cls not in out:
            out.add(cls)
            todo.extend(cls.__subclasses__())
    return out


def _targets(keys: Set[int], walk: _Walk) -> List[Tuple[torch.Tensor, int]]:
    """Every live tensor whose storage is one of ``keys`` (a scan of the gc's objects)."""
    kinds = _tensor_types()
    objs = walk.heap()
    try:
        tensors = [o for o in objs if type(o) in kinds]  # a comprehension: ~10x a loop with checks
    finally:
        del objs
    out: List[Tuple[torch.Tensor, int]] = []
    for t in tensors:
        try:
            key = t.untyped_storage()._cdata
        except Exception:  # meta, sparse, functorch wrappers: no storage of ours
            continue
        if key in keys:
            out.append((t, key))
    del tensors
    return out


Aliases = Dict[int, List[Tuple[Any, str]]]
"""storage key -> (alias object, its kind): objects that reach a lease's memory without its storage
(a ``numpy()`` array of a view); the walk starts from them too (see :mod:`sanitizer.features.aliases`)."""


def find_holders(keys: Iterable[int], *, depth: int = 8, budget_ms: float = 200.0,
                 max_holders: int = 8, replay: bool = True, aliases: Optional[Aliases] = None) -> WalkResult:
    """Name what holds the storages ``keys`` (storage ``_cdata`` addresses), best holder first.

    The caller keeps those storages alive meanwhile (an address names a storage only while it
    lives). With ``replay`` the holder paths found before are followed again from their roots
    first (a consumer that retained one weight usually retains the next the same way): that
    costs a few container steps, not a walk of the heap. Storages not found so are walked, from
    their tensors and from their ``aliases``.
    """
    # The bound is this thread's CPU time, not the wall clock: on a loaded machine (a CI runner, other
    # processes) the same walk gets as far, and names the same holder.
    walk = _Walk(set(keys), depth, time.thread_time() + budget_ms / 1000.0, max_holders)
    walk.aliases = aliases or {}
    try:
        if replay:
            _replay(walk, _REPLAY_VISITS)
        if not walk.done():
            walk.keys = {k for k, bucket in walk.found.items() if not bucket}
            _run(walk)
    finally:
        for key, bucket in walk.found.items():
            bucket.sort(key=lambda h: h.rank)  # stable: discovery order within a rank
            walk.result.holders[key] = bucket
        _remember(walk)
    return walk.result


def replay(keys: Iterable[int], visits: int = _REPLAY_VISITS,
           names: Optional[Dict[int, Optional[str]]] = None) -> WalkResult:
    """Only follow the remembered holder paths (no heap walk): a storage of ``keys`` reached from a
    known root gets that holder; the others get none. Stops at the first match of every key.

    ``names`` (storage key -> the lease's tensor name) are tried first as dict keys (a consumer that
    keeps ``params[name]`` keeps this lease under its own name, wherever the dict has it); otherwise a
    wildcard step tries only the newest entries of a container (where a consumer puts what it keeps
    last), so a replay costs the same with 50 or 50,000 views kept. Not found so: the caller walks."""
    start = time.perf_counter()
    walk = _Walk(set(keys), 0, start, 8)
    _replay(walk, visits, names or {})
    for key, bucket in walk.found.items():
        walk.result.holders[key] = bucket
    return walk.result


def resolve(pattern: Optional[tuple]) -> Optional[Any]:
    """The object a holder path reaches now: its root, then each concrete step exactly (the index or key
    it was found at, not a wildcard); None when the root is gone or a step no longer leads anywhere."""
    if pattern is None:
        return None
    try:
        obj = pattern[0]()
    except Exception:  # a root that cannot be reached any more
        return None
    return _follow_steps(obj, pattern[1])


def _follow_steps(obj: Any, steps: Tuple[Seg, ...]) -> Optional[Any]:
    """The object concrete ``steps`` (the index or key each was found at, not a wildcard) reach from ``obj``
    now; None when a step no longer leads anywhere."""
    for seg in steps:
        if obj is None:
            return None
        tag = seg[0]
        try:
            if tag == "i" and type(obj) in (list, tuple):
                obj = obj[seg[1]]
            elif tag == "k" and isinstance(obj, dict):
                obj = obj.get(seg[1])
            elif tag in ("i", "k", "?", "al"):
                return None
            else:
                obj = next(iter(step(obj, seg)), (None, None))[1]
        except Exception:  # a changed container, an odd __getitem__
            return None
    return obj


_MAX_SIBLINGS = 4096  # instances of a known holder's class a sibling replay follows its path from


def replay_siblings(keys: Iterable[int], names: Optional[Dict[int, Optional[str]]] = None) -> WalkResult:
    """Follow the remembered paths of instance holders (``_LayerInfo.loaded_weights[*][*]...``) from the
    *other* instances of their classes: a consumer with one holder object per layer keeps the next
    layer's views in the next object, which no remembered root reaches. One pass over the heap for all
    those classes (an instance of a Python class refers to its class), no walk level by level; the
    instance found is remembered as a root. Empty when no instance holder is remembered."""
    start = time.perf_counter()
    walk = _Walk(set(keys), 0, start, 8)
    with _patterns_lock:
        patterns = list(_patterns)
    by_class: Dict[type, List[tuple]] = {}
    for pattern in patterns:
        if pattern[2] != "object" or isinstance(pattern[0], FrameLocal):
            continue
        obj = pattern[0]()
        if obj is not None:
            same = by_class.setdefault(type(obj), [])
            if all(_shape(p[1]) != _shape(pattern[1]) for p in same):  # one path of each shape per class
                same.append(pattern)
        del obj
    if not by_class:
        return walk.result
    wanted = set(walk.keys)
    for fresh in (False, True):  # the instances seen last time first (a model's modules exist before its load)
        _siblings_from(walk, by_class, wanted, names, _instances(by_class, fresh))
        if not wanted:
            break
    for key, bucket in walk.found.items():
        walk.result.holders[key] = bucket
    return walk.result


_instances_seen: Dict[type, List[Any]] = {}  # class -> weak references to its instances at the last heap pass


def _instances(by_class: Dict[type, List[tuple]], fresh: bool) -> List[Any]:
    """Instances of those classes: from the last heap pass (weakly kept), or (``fresh``) from a new one."""
    if not fresh:
        out = []
        for cls in by_class:
            out.extend(o for o in (r() for r in _instances_seen.get(cls, ())) if o is not None)
        return out
    refs = gc.get_referrers(*by_class)
    try:
        instances = [o for o in refs if type(o) in by_class]
    finally:
        del refs
    for cls in by_class:
        _instances_seen[cls] = [r for r in (_weak(o) for o in instances if type(o) is cls) if r is not None]
    if len(_instances_seen) > 64:
        for cls in list(_instances_seen)[:-64]:
            del _instances_seen[cls]
    return instances


def _siblings_from(walk: _Walk, by_class: Dict[type, List[tuple]], wanted: Set[int],
                   names: Optional[Dict[int, Optional[str]]], instances: List[Any]) -> None:
    if not instances:
        return
    hints = tuple(n for k, n in (names or {}).items() if n and k in wanted)
    budget = [_REPLAY_VISITS]
    try:
        for inst in instances[:_MAX_SIBLINGS]:
            for ref, segs, kind, head, site in by_class[type(inst)]:
                for concrete, tensor in _follow(inst, segs, 0, (), budget, hints):
                    try:
                        key = tensor.untyped_storage()._cdata
                    except Exception:
                        continue
                    if key in wanted:
                        wanted.discard(key)
                        new_ref = _weak(inst)
                        pattern = (new_ref, concrete, kind, head, site) if new_ref is not None else None
                        h = Holder(kind, head + render(concrete), site, pattern=pattern,
                                   detour=concrete.count(DETOUR))
                        walk.add(key, h)
                        remember(h)
                        walk.result.replayed += 1
                if not wanted or budget[0] <= 0:
                    break
            if not wanted or budget[0] <= 0:
                break
    finally:
        instances.clear()


def _weak(obj: Any) -> Optional[Any]:
    try:
        return weakref.ref(obj)
    except TypeError:
        return None


_CONTAINER_KINDS = ("partial", "closure")  # roots a consumer makes one of per view (a deferred call per weight)
_containers: List[tuple] = []  # (container getter, steps to it, wildcard tag, the root's own steps, kind, head, site)


def learn_container(holder: Holder) -> bool:
    """A holder whose root is made per view (a ``functools.partial`` or a closure per weight, kept in a list or
    a dict): remember the container that keeps those roots, so the next retention is found through it (its
    index) rather than by a heap walk, each named at its own root as the walk names it. Two passes over the
    heap, once per such consumer; False when no container with a path from a global, an attribute or a
    running frame's local holds the root."""
    pattern = holder.pattern
    if holder.kind not in _CONTAINER_KINDS or pattern is None or isinstance(pattern[0], FrameLocal):
        return False
    obj = pattern[0]()
    if obj is None:
        return False
    own = _shape(pattern[1])
    with _patterns_lock:
        if any(c[3] == own and c[4] == holder.kind and c[5] == pattern[3] for c in _containers):
            return True  # (known: its container is remembered already)
    found = _container_of(obj)
    del obj
    if found is None:
        return False
    getter, steps, tag = found
    with _patterns_lock:
        _containers.insert(0, (getter, steps, tag, own, holder.kind, pattern[3], pattern[4]))
        del _containers[_MAX_PATTERNS:]
    return True


def _container_of(obj: Any) -> Optional[Tuple[Any, Tuple[Seg, ...], str]]:
    """The list or dict that holds ``obj`` and how to reach it again: (a getter of its root, the exact steps
    from the root to it, its wildcard tag); None when it is not found within two levels of referrers."""
    ignore = {id(sys._getframe())}
    refs = gc.get_referrers(obj)
    try:
        containers = [r for r in refs if (type(r) is list or type(r) is dict) and id(r) not in ignore]
    finally:
        del refs
    if not containers:
        return None
    container = containers[0]
    del containers
    tag = "i" if type(container) is list else "k"
    modules = _module_dicts()
    for frame, _mine in _stacks():  # a running function's local (executing frames are no referrers)
        for name, value in locals_of(frame).items():
            if value is container:
                return FrameLocal(frame, name), (), tag
    holders = gc.get_referrers(container)
    try:
        for r in holders:
            if id(r) in ignore or r is modules:
                continue
            found = root(r, container, (), modules)
            if found is not None and found.pattern is not None and not found.transient:
                return found.pattern[0], tuple(found.pattern[1]), tag
    finally:
        del holders
    return None


def _replay_containers(walk: _Walk, wanted: Set[int], budget: List[int], also: Set[int] = frozenset()) -> None:
    """The ``wanted`` storages found under the roots a remembered container holds (see
    :func:`learn_container`), through its index; each named at its own root. Every container looks, and
    for the storages ``also`` found elsewhere in this replay too: a view kept by a closure per weight and
    a partial per weight is named at both."""
    with _patterns_lock:
        containers = list(_containers)
    if not containers:
        return
    looking = set(wanted) | set(also)
    frames = None
    seen: Dict[int, Dict[str, Any]] = {}
    for getter, steps, tag, own, kind, head, site in containers:
        if not looking or budget[0] <= 0:
            break
        if isinstance(getter, FrameLocal):
            if frames is None:
                frames = Frames(sys._getframe(2))
            base = getter.of(frames, seen)
        else:
            base = getter()
        container = _resolve_container(base, steps)
        del base
        if container is None:
            continue
        for path, tensor in _indexed(container, tag, own, looking, (), small_too=True):
            try:
                key = tensor.untyped_storage()._cdata
            except Exception:
                continue
            new_root = _resolve_container(container, path[:1], plain=False)
            ref = _weak(new_root) if new_root is not None else None
            if ref is None or key not in looking:
                continue
            wanted.discard(key)
            concrete = tuple(path[1:])
            walk.add(key, Holder(kind, head + render(concrete), site, pattern=(ref, concrete, kind, head, site),
                                 detour=concrete.count(DETOUR)))
            walk.result.replayed += 1
            budget[0] -= 1
    if frames is not None:
        frames.clear()
    seen.clear()


_RUNNING_FRAMES = 16  # user frames above a retire whose local containers :func:`in_running_locals` looks in
_RUNNING_VISITS = 2048  # container entries one look may check (most programs' locals hold a few small ones)


def in_running_locals(wanted: Dict[int, Optional[str]], start: Optional[types.FrameType]) -> WalkResult:
    """The ``wanted`` storages (storage key -> the lease's name) found in a list, tuple or dict that a
    running function on this thread's stack, from ``start`` up, keeps in a local: ``local 'tensors' of
    load_state_dict()['a']``.

    Why: a function that fills a local dict with views and returns it after its loader closes is the
    consumer to fix, but once it has returned only its caller's copy is left for a later walk to find.
    Its frame is on the stack at the close (the close runs inside it), so it is named there, before any
    heap walk, by looking where such a consumer keeps what it lends: under the lease's own name, among
    the newest entries (and one level below them, a list of pairs). A local that *is* the view (a loop
    variable) is not looked at: it is the reader, not a keeper. Bounded: a few thousand entries in all."""
    walk = _Walk(set(wanted), 0, 0.0, 8)
    budget = [_RUNNING_VISITS]
    left = set(wanted)
    frame, seen = start, 0
    try:
        while frame is not None and left and seen < _RUNNING_FRAMES and budget[0] > 0:
            code = frame.f_code
            if _user_function(code):
                seen += 1
                for name, value in locals_of(frame).items():
                    if type(value) not in (list, tuple, dict) or not value:
                        continue
                    for concrete, key in _wanted_in(value, left, budget):
                        left.discard(key)
                        gen = bool(code.co_flags & GEN_FLAGS)
                        kind = "generator" if gen else "frame"
                        head = f"local '{name}' of {'generator ' if gen else ''}{qualname(code)}()"
                        site = site_of_frame(frame)
                        h = Holder(kind, head + render(concrete), site, frame_id=id(frame), local=name,
                                   pattern=(FrameLocal(frame, name), concrete, kind, head, site))
                        walk.add(key, h)
                        h.fresh = remember(h)  # the next victims of this consumer: a replay through its index
                        walk.result.replayed += 1
                    if not left or budget[0] <= 0:
                        break
                if left and budget[0] > 0:
                    _in_named_globals(walk, frame, left, budget)
                if left and budget[0] > 0:
                    _in_named_attributes(walk, frame, left, budget)
            frame = frame.f_back
    finally:
        del frame
    for key, bucket in walk.found.items():
        walk.result.holders[key] = bucket
    return walk.result


_PLAIN = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _in_named_attributes(walk: _Walk, frame: types.FrameType, left: Set[int], budget: List[int]) -> None:
    """The ``left`` storages in the lists and dicts that a running function's code names as attributes of
    the objects it has in its locals or globals (``self.cache[name] = w``, ``OBJ.kept.append(w)``):
    ``Cache.cache['w3']``, found at the reuse without a heap walk. Only the instances' own ``__dict__``
    entries are read (never a property: reading must not run the user's code)."""
    code = frame.f_code
    attrs = code.co_names
    if not attrs:
        return
    objects = [v for v in locals_of(frame).values() if not isinstance(v, _PLAIN)]
    g = frame.f_globals
    objects += [g.get(n) for n in _GLOBAL_OBJECTS.get(code) or _global_objects(code, g)]
    for obj in objects:
        d = getattr(obj, "__dict__", None) if obj is not None else None
        if type(d) is not dict or not d:
            continue
        for attr in attrs:
            value = d.get(attr)
            if (type(value) is not list and type(value) is not dict) or not value:
                continue
            for concrete, key in _wanted_in(value, left, budget):
                h = root(obj, value, concrete, {})
                if h is None or h.pattern is None or h.kind != "object":
                    continue
                left.discard(key)
                walk.add(key, h)
                h.fresh = remember(h)
                walk.result.replayed += 1
            if not left or budget[0] <= 0:
                return


_GLOBAL_OBJECTS: Dict[Any, Tuple[str, ...]] = {}  # code object -> the globals it names that held objects


def _global_objects(code: types.CodeType, g: Dict[str, Any]) -> Tuple[str, ...]:
    if len(_GLOBAL_OBJECTS) > 4096:
        _GLOBAL_OBJECTS.clear()
    names = _GLOBAL_OBJECTS[code] = tuple(
        n for n in code.co_names
        if n in g and not isinstance(g[n], _PLAIN) and type(getattr(g[n], "__dict__", None)) is dict)
    return names


_GLOBAL_CONTAINERS: Dict[Any, Tuple[str, ...]] = {}  # code object -> the globals it names that held containers


def _in_named_globals(walk: _Walk, frame: types.FrameType, left: Set[int], budget: List[int]) -> None:
    """The ``left`` storages in the module-level lists and dicts a running function names in its code
    (``KEPT.append(w)``, ``REGISTRY[name] = w``): ``pkg.mod.KEPT[3]``, found at the reuse without a heap
    walk. Which of a code's global names are containers is remembered per code object (a function's
    other names, its modules and functions, are never looked at again)."""
    code, g = frame.f_code, frame.f_globals
    names = _GLOBAL_CONTAINERS.get(code)
    if names is None:
        if len(_GLOBAL_CONTAINERS) > 4096:
            _GLOBAL_CONTAINERS.clear()
        names = _GLOBAL_CONTAINERS[code] = tuple(
            n for n in code.co_names if type(g.get(n)) in (list, dict) and not n.startswith("__"))
    for name in names:
        value = g.get(name)
        if type(value) not in (list, dict) or not value:
            continue
        for concrete, key in _wanted_in(value, left, budget):
            # (named as a walk names it: the module's first name in sys.modules, ``__main__`` in a spawn
            # worker that runs the script as ``__mp_main__`` too)
            modules = _module_dicts()
            h = root(g, value, concrete, modules) if id(g) in modules else None
            if h is None or h.pattern is None:
                continue
            left.discard(key)
            walk.add(key, h)
            h.fresh = remember(h)
            walk.result.replayed += 1
        if not left or budget[0] <= 0:
            return


_USER_CODE: Dict[Any, bool] = {}  # code object -> a function of the user's (not ours, not torch's)


def _user_function(code: types.CodeType) -> bool:
    """Is ``code`` a function (not module code) of neither ours nor torch's? Remembered per code object:
    a retire asks it of every frame above it."""
    known = _USER_CODE.get(code)
    if known is None:
        if len(_USER_CODE) > 4096:
            _USER_CODE.clear()
        known = _USER_CODE[code] = bool(code.co_flags & CO_OPTIMIZED) and not internal(code) \
            and not code.co_filename.startswith(torch_dir())
    return known


def _wanted_in(container: Any, left: Set[int], budget: List[int]) -> Iterator[Tuple[Tuple[Seg, ...], int]]:
    """``(concrete steps, storage key)`` of the ``left`` storages a local or named container holds (one
    budget unit for the container, then :func:`_local_entries`' look-ups)."""
    budget[0] -= 1
    for concrete, tensor in _local_entries(container, left, budget):
        try:
            key = tensor.untyped_storage()._cdata
        except Exception:
            continue
        if key in left:
            yield concrete, key


def _local_entries(obj: Any, wanted: Set[int], budget: List[int]) -> List[Tuple[Tuple[Seg, ...], Any]]:
    """The ``wanted`` storages in a local container: its entries, or the items of its entries when they are
    short lists or tuples (a list of ``(name, view)`` pairs), ``(concrete steps, tensor)``. Through the
    container's index (:class:`_Index`): a retire looks at the entries added since the last look, so a
    function that keeps a dict of 1,000 owned tensors beside its loop pays for them once, not at every
    put. A container too long to index whole within the budget is left to the later walk."""
    is_list = type(obj) is not dict
    if len(obj) > budget[0]:
        return []
    rest: Tuple[Seg, ...] = ()
    if is_list:
        last = obj[-1]
        if (type(last) is tuple or type(last) is list) and len(last) <= 8:
            rest = (("i",),)
    budget[0] -= 1
    return _indexed(obj, "i" if is_list else "k", rest, wanted, (), small_too=True)


def _resolve_container(obj: Any, steps: Tuple[Seg, ...], plain: bool = True) -> Optional[Any]:
    """What exact ``steps`` reach from ``obj`` (a list or dict when ``plain``), or None."""
    obj = _follow_steps(obj, steps)
    if plain and type(obj) is not list and type(obj) is not dict:
        return None
    return obj


def has_patterns() -> bool:
    """Whether any holder path is remembered (a replay can find anything)."""
    return bool(_patterns) or bool(_containers)


def _remember(walk: _Walk) -> None:
    for bucket in walk.found.values():
        for h in bucket:
            if not h.detour:  # a path through one of our own objects is kept only when it is the best one
                remember(h)


def remember(holder: Holder) -> bool:
    """Keep ``holder``'s path (its root and steps) to try first for the next retention; True when it was
    not remembered already (a consumer seen for the first time)."""
    pattern = holder.pattern
    if pattern is None or holder.transient or holder.kind == "unknown":
        return False
    shape = _shape(pattern[1])
    with _patterns_lock:
        before = len(_patterns)
        _patterns[:] = [p for p in _patterns if not (_same_root(p[0], pattern[0]) and _shape(p[1]) == shape)]
        new = len(_patterns) == before
        _patterns.insert(0, pattern)
        del _patterns[_MAX_PATTERNS:]
    return new


def _same_root(a: Any, b: Any) -> bool:
    if isinstance(a, FrameLocal) or isinstance(b, FrameLocal):
        return a == b
    x = a()
    return x is not None and x is b()


def _shape(segs: Tuple[Seg, ...]) -> tuple:
    """A path with its list indices and dict keys as wildcards: two paths of one consumer look alike."""
    return tuple(seg[:1] if seg[0] in ("i", "k") else seg for seg in segs)


def _replay(walk: _Walk, visits: int, names: Optional[Dict[int, Optional[str]]] = None) -> None:
    """Follow remembered holder paths (indices and keys as wildcards, newest first) down to tensors of
    ``walk.keys``; stop as soon as each has a holder or the visit budget is spent."""
    with _patterns_lock:
        patterns = list(_patterns)
    if not patterns and not _containers:
        return
    budget = [visits]
    wanted = {k for k, bucket in walk.found.items() if not bucket}
    hints = tuple(n for k, n in (names or {}).items() if n and k in wanted)
    frames = Frames(sys._getframe(1))
    seen: Dict[int, Dict[str, Any]] = {}  # frame id -> its locals: one snapshot per frame, not one per path
    roots = []
    for pattern in patterns:
        root = pattern[0]
        obj = root.of(frames, seen) if isinstance(root, FrameLocal) else root()
        if obj is not None:
            roots.append((pattern, obj))
        del obj
    frames.clear()
    seen.clear()
    # First the exact look-ups of every known path (each container's index, the leases' own names as keys)
    # and of the containers of per-view roots: a load that sends views to six holders finds each where it
    # is without trying the newest entries of the five others (the mixed shape of bench/scale.py).
    # A view kept in two indexed places is named at both (``wanted`` shrinks only once every path looked).
    exact: Set[int] = set()
    for pattern, obj in roots:
        mine: Set[int] = set()
        for concrete, tensor in _candidates(obj, pattern[1], budget, hints, wanted, window=False):
            try:
                key = tensor.untyped_storage()._cdata
            except Exception:
                continue
            if key in wanted and key not in mine:
                mine.add(key)
                _credit(walk, None, pattern, concrete, tensor, key)
        exact |= mine
    wanted -= exact
    if _containers and budget[0] > 0:
        _replay_containers(walk, wanted, budget, also=exact)
    if not wanted:
        roots.clear()
        return
    # Then every known path at once, one tensor of each in turn (newest first): a container too small to
    # index, or an entry replaced in place, found in the first few entries of its own holder.
    live = [(pattern, _candidates(obj, pattern[1], budget, hints, wanted)) for pattern, obj in roots]
    roots.clear()
    # Once a storage is found, the other paths get a few more turns: a view kept in two places (a list
    # and a partial) is named in both, each only where it really is.
    after: Dict[int, int] = {}  # storage key found -> turns the other paths still get
    matched: Dict[int, Set[int]] = {}  # storage key -> the paths (ids of their entries) that hold it
    while live and (wanted or after) and budget[0] > 0:
        for entry in list(live):
            (ref, segs, kind, head, site), tensors = entry
            hit = next(tensors, None)
            if hit is None:
                live.remove(entry)
                continue
            concrete, tensor = hit
            try:
                key = tensor.untyped_storage()._cdata
            except Exception:
                continue
            first = key in wanted
            if first or (key in after and id(entry) not in matched.get(key, ())):
                if first:
                    wanted.discard(key)
                    after[key] = _MORE_TURNS
                matched.setdefault(key, set()).add(id(entry))
                _credit(walk, None, entry[0], concrete, tensor, key)
        for key in list(after):
            after[key] -= 1
            if after[key] <= 0:
                del after[key]
    live.clear()


def _credit(walk: _Walk, wanted: Optional[Set[int]], pattern: tuple, concrete: Tuple[Seg, ...], tensor: Any,
            key: Optional[int]) -> None:
    """Name ``pattern``'s root, down ``concrete``, as a holder of ``tensor``'s storage (when ``wanted`` is
    given, only if that storage is wanted, and then no longer)."""
    if key is None:
        try:
            key = tensor.untyped_storage()._cdata
        except Exception:
            return
    if wanted is not None:
        if key not in wanted:
            return
        wanted.discard(key)
    ref, _, kind, head, site = pattern
    walk.add(key, Holder(kind, head + render(concrete), site, frame_id=getattr(ref, "frame_id", None),
                         local=getattr(ref, "name", None), pattern=(ref, concrete, kind, head, site),
                         detour=concrete.count(DETOUR)))
    walk.result.replayed += 1


def _candidates(obj: Any, segs: Tuple[Seg, ...], budget: List[int], hints: Tuple[str, ...] = (),
                wanted: Optional[Set[int]] = None, window: bool = True) -> Iterator[Tuple[Tuple[Seg, ...], Any]]:
    """The tensors a remembered path offers, newest first: :func:`_follow`'s answer. The common path (exact
    steps, then at most one wildcard, last: ``lst[*]``, ``self.kept[*]``, ``params[*]``) is followed flat,
    one generator per path instead of one per step: a replay runs at every retire, and the chain of nested
    generators was most of its cost. A wildcard over a container larger than the window looks the ``wanted``
    storages up in that container's index first (:class:`_Index`)."""
    last = len(segs) - 1
    for j, seg in enumerate(segs):
        if seg[0] in ("i", "k") and j != last:
            return _follow(obj, segs, 0, (), budget, hints, wanted, window)
    return _flat(obj, segs, budget, hints, wanted, window)


class _Index:
    """Where each storage sits in one container that a remembered path crosses with a wildcard (a list a
    consumer appends its views to, a dict it keys them in): storage key -> the concrete steps from the
    container down to the tensor. A replay used to try only the newest entries (the window): a ring's victim
    is the view it lent a whole ring ago, far behind the newest in a list that keeps every view, and each such
    retention paid a heap walk (issue 47: 400 s for 5,000 views kept in a plain list). The index is extended
    with the entries added since the last look (a list's tail, a dict's newest keys), so the 50,000th view costs
    what the first did; a hit is checked against the container before it is used, and a container that
    shrank or changed its first entry is indexed afresh."""

    __slots__ = ("seen", "first", "where")

    def __init__(self) -> None:
        self.seen = 0  # entries indexed (a list's leading ones, a dict's oldest ones)
        self.first: Any = None  # id of the first entry (a list) or key (a dict) when indexed: a new container?
        self.where: Dict[int, Tuple[Seg, ...]] = {}


_INDEXES_KEPT = 256  # (the local containers of running functions have theirs too)
_INDEX_ENTRY_VISITS = 256  # objects the path below one entry may visit when the entry is indexed
_indexes: Dict[Tuple[int, Tuple[Seg, ...]], _Index] = {}  # (id(container), the steps below it) -> its index
_indexes_lock = threading.Lock()


def _indexed(obj: Any, tag: str, rest: Tuple[Seg, ...], wanted: Set[int], hints: Tuple[str, ...],
             small_too: bool = False) -> List[Tuple[Tuple[Seg, ...], Any]]:
    """The ``wanted`` storages found in ``obj`` (a list or tuple for ``i``, a dict for ``k``) through its index:
    ``(concrete steps from obj, tensor)``, each checked where it now is. A container the replay window covers
    is not indexed (the window tries all of it), unless ``small_too``."""
    is_list = tag == "i" and (type(obj) is list or type(obj) is tuple)
    if not (is_list or (tag == "k" and type(obj) is dict)) or not obj or (len(obj) <= _REPLAY_WINDOW and not small_too):
        return []
    try:
        first = id(obj[0]) if is_list else next(iter(obj))
    except (IndexError, StopIteration, RuntimeError):
        return []
    key = (id(obj), rest)
    with _indexes_lock:
        index = _indexes.pop(key, None)
        if index is None or index.seen > len(obj) or index.first != first:
            index = _Index()
            index.first = first
        _indexes[key] = index  # (most recently used last)
        while len(_indexes) > _INDEXES_KEPT:
            del _indexes[next(iter(_indexes))]
        fresh = len(obj) - index.seen
        try:
            if is_list:
                news = [(("i", i), obj[i]) for i in range(index.seen, len(obj))]
            else:
                news = [(("k", k), obj[k]) for k in itertools.islice(reversed(obj), fresh)]
        except (IndexError, KeyError, RuntimeError):  # changed under us: index it afresh next time
            index.seen, index.first = len(obj) + 1, None
            return []
        index.seen = len(obj)
        where = index.where
        for concrete, child in news:
            if rest:
                below = _follow(child, rest, 0, (), [_INDEX_ENTRY_VISITS], hints)
            else:
                below = iter([((), child)]) if isinstance(child, torch.Tensor) else iter(())
            for path, tensor in below:
                try:
                    where[tensor.untyped_storage()._cdata] = (concrete,) + path
                except Exception:  # no storage of its own
                    continue
        hits = [(k, where[k]) for k in wanted if k in where]
    out = []
    for storage, path in hits:
        tensor = _resolve_steps(obj, path)
        try:
            if tensor is not None and tensor.untyped_storage()._cdata == storage:
                out.append((path, tensor))
        except Exception:
            continue
    return out


def _resolve_steps(obj: Any, path: Tuple[Seg, ...]) -> Optional[Any]:
    """The tensor ``path`` (concrete steps) reaches from ``obj`` now, or None."""
    obj = _follow_steps(obj, path)
    return obj if isinstance(obj, torch.Tensor) else None


def _flat(obj: Any, segs: Tuple[Seg, ...], budget: List[int], hints: Tuple[str, ...],
          wanted: Optional[Set[int]] = None, window: bool = True) -> Iterator[Tuple[Tuple[Seg, ...], Any]]:
    done: Tuple[Seg, ...] = ()
    tensor = torch.Tensor
    for seg in segs:
        if budget[0] <= 0:
            return
        budget[0] -= 1
        tag = seg[0]
        if tag in ("i", "k") and wanted:
            for path, child in _indexed(obj, tag, (), wanted, hints):
                yield done + path, child
        if not window and tag in ("i", "k"):  # the exact look-ups only: the index, the leases' own names
            if tag == "k" and isinstance(obj, dict):
                for name, child in _hinted(obj, hints):
                    if isinstance(child, tensor):
                        yield done + (("k", name),), child
            return
        if tag == "i":  # the last step: the newest entries of a list or tuple
            if type(obj) is list or type(obj) is tuple:
                for i in range(len(obj) - 1, max(-1, len(obj) - 1 - _REPLAY_WINDOW), -1):
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                    try:
                        child = obj[i]
                    except IndexError:  # shrunk meanwhile
                        continue
                    if isinstance(child, tensor):
                        yield done + (("i", i),), child
            return
        if tag == "k":  # the last step: the wanted leases' own names first, then the newest keys
            if isinstance(obj, dict):
                tried = set()
                for name, child in _hinted(obj, hints):
                    tried.add(name)
                    budget[0] -= 1
                    if isinstance(child, tensor):
                        yield done + (("k", name),), child
                for concrete, child in itertools.islice(step(obj, seg), _REPLAY_WINDOW):
                    if budget[0] <= 0:
                        return
                    budget[0] -= 1
                    if concrete[1] not in tried and isinstance(child, tensor):
                        yield done + (concrete,), child
            return
        hit = next(iter(step(obj, seg)), None)  # an exact step: one child or none
        if hit is None:
            return
        done, obj = done + (hit[0],), hit[1]
    if isinstance(obj, tensor):
        yield done, obj


def _small(obj: Any) -> bool:
    """A list, tuple or dict the replay window covers whole (one :func:`_indexed` leaves unindexed)."""
    return (type(obj) is list or type(obj) is tuple or type(obj) is dict) and len(obj) <= _REPLAY_WINDOW


def _hinted(obj: dict, hints: Tuple[str, ...]) -> Iterator[Tuple[str, Any]]:
    """The entries of ``obj`` under the wanted leases' own names (a consumer keeps ``params[name]``)."""
    for name in hints:
        try:
            child = obj[name] if name in obj else None
        except Exception:  # a dict subclass with an odd __getitem__
            child = None
        if child is not None:
            yield name, child


def _follow(obj: Any, segs: Tuple[Seg, ...], i: int, done: Tuple[Seg, ...],
            budget: List[int], hints: Tuple[str, ...] = (),
            wanted: Optional[Set[int]] = None, window: bool = True) -> Iterable[Tuple[Tuple[Seg, ...], Any]]:
    if budget[0] <= 0:
        return
    budget[0] -= 1
    if i == len(segs):
        if isinstance(obj, torch.Tensor):  # (a subclass too: the same as _targets' kinds, without listing them)
            yield done, obj
        return
    seg = segs[i]
    if seg[0] in ("i", "k"):  # a wildcard: the wanted storages by the index, the wanted leases' own names, then
        if wanted:  # the newest entries
            for path, child in _indexed(obj, seg[0], segs[i + 1:], wanted, hints):
                yield done + path, child
        if seg[0] == "k" and hints and isinstance(obj, dict):
            for name, child in _hinted(obj, hints):
                yield from _follow(child, segs, i + 1, done + (("k", name),), budget, hints, wanted, window)
        if not window:  # the exact look-ups only: an indexed container's index is all of it; a small one
            if not _small(obj):  # (not indexed: ``NESTED['layer']``'s one key) is gone through, entry by entry
                return
        children = itertools.islice(step(obj, seg), _REPLAY_WINDOW)
    else:
        children = step(obj, seg)
    for concrete, child in children:
        yield from _follow(child, segs, i + 1, done + (concrete,), budget, hints, wanted, window)


def _run(walk: _Walk) -> None:
    stacks = _stacks()
    local_map: Dict[int, List[Tuple[types.FrameType, str, bool]]] = {}
    ignore: Set[int] = {id(stacks), id(local_map)}
    try:
        for entry in stacks:
            ignore.add(id(entry))
            frame, mine = entry
            frame_locals = locals_of(frame)
            if walk.frozen is not None:
                walk.frozen.add_roots(list(frame_locals.values()))
            for name, value in frame_locals.items():
                item = (frame, name, mine)
                ignore.add(id(item))
                bucket = local_map.setdefault(id(value), [])
                ignore.add(id(bucket))
                bucket.append(item)
        targets = [(t, key, ()) for t, key in _targets(walk.keys, walk)]
        walk.result.tensors = len(targets)
        targets += [(obj, key, (("al", kind),)) for key in walk.keys for obj, kind in walk.aliases.get(key, ())]
        ignore.add(id(walk.aliases))  # the caller's containers of aliases are nobody's holder
        for items in walk.aliases.values():
            ignore.add(id(items))
            ignore.update(id(item) for item in items)
        if any(not gc.is_tracked(obj) for obj, _, _ in targets):  # an array alias: its holder may be hidden too
            ignore.add(id(targets))
            targets += _untracked_holders(targets, ignore, walk)
        _bfs(walk, targets, local_map, ignore)
    finally:
        local_map.clear()
        stacks.clear()
        if walk.frozen is not None:
            walk.frozen.clear()


def _untracked_holders(targets: List[Tuple[Any, int, Tuple[Seg, ...]]], ignore: Set[int],
                       walk: _Walk) -> List[Tuple[Any, int, Tuple[Seg, ...]]]:
    """The dicts and tuples that hold a target the gc does not track (issue 29, point 5).

    A numpy array is not tracked by the gc, and neither is a dict or a tuple that holds only such arrays
    (and strings, numbers): ``gc.get_referrers`` never names it, and ``CACHE = {"w": t.numpy()}`` read as
    "held where Python cannot see". Such a container is found among the values of the heap's (tracked)
    dicts and lists, and the walk goes on from it: what holds it is tracked. One pass over the heap's
    dicts and lists, made only when a target is untracked (an array alias)."""
    want = {id(obj): (key, suffix) for obj, key, suffix in targets if not gc.is_tracked(obj)}
    out: List[Tuple[Any, int, Tuple[Seg, ...]]] = []
    looked: Set[int] = set()
    ignore.update((id(want), id(out), id(looked)))
    objs = walk.heap()
    try:
        for o in objs:
            to = type(o)
            if (to is not dict and to is not list) or id(o) in ignore:
                continue
            try:
                values = tuple(o.values()) if to is dict else tuple(o)  # (another thread may change it)
            except RuntimeError:
                continue
            for v in values:
                tv = type(v)
                if (tv is not dict and tv is not tuple) or id(v) in looked or id(v) in ignore or gc.is_tracked(v):
                    continue
                looked.add(id(v))
                for item in (v.values() if tv is dict else v):
                    hit = want.get(id(item))
                    seg = label(v, item) if hit is not None else None  # (the walk's own step labels)
                    if seg is not None:
                        out.append((v, hit[0], (seg,) + hit[1]))
    finally:
        del objs
    return out


def _module_dicts() -> Dict[int, Tuple[str, Any]]:
    """id(a module's namespace) -> (its name, the module): what :func:`root` names a global by."""
    modules: Dict[int, Tuple[str, Any]] = {}
    for name, mod in list(sys.modules.items()):
        d = getattr(mod, "__dict__", None) if isinstance(mod, types.ModuleType) else None
        if isinstance(d, dict) and id(d) not in modules:
            modules[id(d)] = (name, mod)
    return modules


def _bfs(walk: _Walk, targets: List[Tuple[Any, int, Tuple[Seg, ...]]],
         local_map: Dict[int, List[Tuple[types.FrameType, str, bool]]], ignore: Set[int]) -> None:
    modules = _module_dicts()
    # Module-level code on this thread's stack: its plain globals are what locals are to a function.
    running = {id(f.f_globals) for f, mine in _stacks() if mine and not f.f_code.co_flags & CO_OPTIMIZED}
    # The frontier's objects live in one tuple (gc.get_referrers skips its own argument
    # tuple); per object id and storage key we keep the path from it down to the tensor.
    objs: Tuple[Any, ...] = tuple({id(t): t for t, _, _ in targets}.values())
    paths: Dict[int, Dict[int, Tuple[Seg, ...]]] = {}
    for t, key, suffix in targets:
        paths.setdefault(id(t), {}).setdefault(key, suffix)
    targets.clear()
    visited: Set[int] = set(paths)
    ignore.update((id(modules), id(paths), id(visited)))
    level = 0
    named_at: Optional[int] = None  # the level at which every storage had a recognisable holder
    # A view kept in two places (Model.weights and a functools.partial) has two holders, usually at
    # similar depths: walk a few levels past the first recognisable one of each storage, to name them all.
    while objs and not walk.full() and (named_at is None or level <= named_at + _EXTRA_LEVELS):
        # Executing frames never show up as referrers: match their locals by identity.
        for obj in objs:
            for frame, name, mine in local_map.get(id(obj), ()):
                gen = bool(frame.f_code.co_flags & GEN_FLAGS)
                kind = "generator" if gen else "frame"
                head = f"local '{name}' of {'generator ' if gen else ''}{qualname(frame.f_code)}()"
                site = site_of_frame(frame)
                for key, suffix in paths[id(obj)].items():
                    steps, detour = without_detours(suffix)
                    pattern = (None if any(seg[0] in ("?", "al") for seg in steps)
                               else (FrameLocal(frame, name), suffix, kind, head, site))
                    # A plain local of running code, or an iterator it is stepping through (a genexpr's
                    # ``.0``, a ``for`` loop's ``dict_valueiterator``): the reader or a loop, not a keeper.
                    passing = mine and (not steps or steps[0][0] == "?")
                    walk.add(key, Holder(kind, head + render(steps), site, transient=passing,
                                         frame_id=id(frame), local=name, pattern=pattern, detour=detour))
        if named_at is None and walk.done():
            named_at = level
        if level == walk.depth or (level and walk.out_of_time()):
            break  # the time bound is checked between heap passes: a pass, once paid for, is used
        level += 1
        by_id = {id(o): o for o in objs}
        ignore.add(id(by_id))
        next_objs: List[Any] = []
        next_paths: Dict[int, Dict[int, Tuple[Seg, ...]]] = {}
        if walk.frozen is not None:
            ignore.update(walk.frozen.ids())  # (the walk's list of frozen objects refers to them all)
        referrers = gc.get_referrers(*objs)
        if walk.frozen is not None:  # the program froze its heap: gc.get_referrers skips what it froze
            referrers = referrers + walk.frozen.referring_to(by_id)
        try:
            for r in referrers:
                rid = id(r)
                if rid in ignore or rid in visited or rid in by_id:
                    continue
                for child in [by_id[id(c)] for c in gc.get_referents(r) if id(c) in by_id]:
                    for key, suffix in paths[id(child)].items():
                        found = root(r, child, suffix, modules)
                        if found is not None:
                            if found.kind == "global" and not suffix and rid in running:
                                found.transient = True  # a plain global of module code running now: loop variable?
                            walk.add(key, found)
                        elif type(r) is not types.FrameType:
                            seg = label(r, child)
                            below = join(("?", f"<{type(r).__name__}>") if seg is None else seg, suffix)
                            if internal_class(type(r)):
                                below = (DETOUR,) + below  # through one of ours: a worse holder than a user's
                            next_paths.setdefault(rid, {}).setdefault(key, below)
                if rid in next_paths:
                    visited.add(rid)
                    next_objs.append(r)
        finally:
            del referrers
        ignore.discard(id(by_id))
        del by_id
        if len(next_objs) > _MAX_FRONTIER:  # get_referrers is O(heap x frontier): keep it bounded
            del next_objs[_MAX_FRONTIER:]
            walk.result.truncated = True
        objs = tuple(next_objs)
        del next_objs
        paths = next_paths
    if objs and not walk.done():
        walk.result.truncated = True
        # Bounds reached: the deepest anonymous containers are still better than nothing.
        for obj in objs[: walk.max_holders]:
            for key, suffix in paths.get(id(obj), {}).items():
                if not walk.found[key]:
                    walk.add(key, Holder("unknown", f"<{type(obj).__name__}>{render(suffix)}"))
    for key, bucket in walk.found.items():
        if not bucket and walk.result.tensors and not walk.result.truncated:
            bucket.append(Holder("unknown", "<held where Python cannot see: a list a comprehension is still building, "
                                            "a view's base, autograd or a native library>"))


def forget_patterns() -> None:
    """Drop the remembered holder paths (tests; a new process starts with none)."""
    with _patterns_lock:
        _patterns.clear()
        _containers.clear()
    with _indexes_lock:
        _indexes.clear()



@forking.in_child
def _after_fork() -> None:
    global _patterns_lock, _indexes_lock
    _patterns_lock = threading.Lock()
    _indexes_lock = threading.Lock()
    _instances_seen.clear()


__all__ = ["Holder", "WalkResult", "find_holders", "replay", "replay_siblings", "resolve", "in_running_locals", "has_patterns", "remember",
           "learn_container", "consumer_key", "forget_patterns"]
