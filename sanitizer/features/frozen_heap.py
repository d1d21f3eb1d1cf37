"""The objects ``gc.freeze()`` moved out of the collector's sight, for the holder walk.

Engines freeze their heap once it is built: vLLM's ``compile_or_warm_up_model`` ends with ``gc.freeze()``
(``freeze_gc_heap``), SGLang has ``freeze_gc``, forking servers do it to keep pages shared. CPython's
``gc.get_objects()`` and ``gc.get_referrers()`` scan only the three collected generations, never the
permanent one, so after a freeze every object built before it (the model, its modules' ``__dict__``s, a
loader's caches: exactly where a retaining consumer keeps a view) is invisible to a referrer walk: a view
kept in ``model.cache['w']`` was reported "held where Python cannot see", and a view lent before the
freeze was not found at all.

There is no API that lists the permanent generation, and ``gc.unfreeze()`` then ``gc.freeze()`` would
also freeze everything the program made since (its later cyclic garbage would never be collected): the
walk must not change the program's collector. So the frozen objects are found by reachability: from the
modules, from every collected object and from running functions' locals (a model built in ``main()``
before the freeze is reachable only from ``main``'s frame), through ``gc.get_referents``, the tracked objects that are in no
collected generation. This costs one pass over the reachable heap (~0.8 s for a torch process of 650,000
objects), paid only by a walk that runs after a freeze, once per walk, and only when the collected
generations did not already name every holder. The list lives for that walk alone: holding frozen
objects past it would keep alive what the program drops.
"""
from __future__ import annotations

import gc
import sys
from typing import Any, Dict, List, Optional, Set


# What the interpreter froze itself before the program ran: CPython 3.12+ starts with a few hundred objects of
# its own in the permanent generation (375 here), none of them a holder. Only a freeze beyond that is the
# program's; without this every walk on 3.12 paid the pass (~0.8 s) for nothing.
_BASELINE = gc.get_freeze_count()


class FrozenHeap:
    """The permanent generation's reachable objects, found once, on first use, for one walk."""

    def __init__(self) -> None:
        self._objects: Optional[List[Any]] = None
        # running functions' locals: a frozen object only a running frame refers to (a model built in
        # main() before the freeze) is reachable from no module and no collected object
        self._roots: List[Any] = []

    def add_roots(self, objs: List[Any]) -> None:
        self._roots.extend(objs)

    @staticmethod
    def present() -> bool:
        """Whether the program froze anything (``gc.freeze``); without it there is nothing to find."""
        return gc.get_freeze_count() > _BASELINE

    def objects(self) -> List[Any]:
        """The frozen objects reachable from the modules or from a collected object."""
        if self._objects is None:
            self._objects = _enumerate(self._roots)
        return self._objects

    def ids(self) -> Set[int]:
        """The ids of this walk's own containers (the walk must never take them for a holder)."""
        return {id(self._objects), id(self._roots)} if self._objects is not None else {id(self._roots)}

    def referring_to(self, by_id: Dict[int, Any]) -> List[Any]:
        """The frozen objects that refer directly to one of ``by_id``'s objects (what
        ``gc.get_referrers`` would have returned from the permanent generation)."""
        out = []
        referents = gc.get_referents
        for r in self.objects():
            for c in referents(r):
                if id(c) in by_id:
                    out.append(r)
                    break
        return out

    def clear(self) -> None:
        self._objects = None
        self._roots.clear()


def _enumerate(roots: List[Any]) -> List[Any]:
    young = gc.get_objects()  # the collected generations (a list: made before the containers below)
    seen: Set[int] = {id(o) for o in young}
    frozen: List[Any] = []
    todo: List[Any] = list(young)
    todo.extend(m for m in list(sys.modules.values()) if m is not None)
    mine = {id(young), id(seen), id(frozen), id(todo), id(roots)}
    seen.update(mine)
    for obj in roots:  # (a frozen root itself is one of them)
        if id(obj) not in seen and gc.is_tracked(obj):
            seen.add(id(obj))
            frozen.append(obj)
            todo.append(obj)
    referents = gc.get_referents
    is_tracked = gc.is_tracked
    while todo:
        obj = todo.pop()
        for child in referents(obj):
            i = id(child)
            if i in seen or not is_tracked(child):
                continue
            seen.add(i)
            frozen.append(child)
            todo.append(child)
    del young, todo
    return frozen


__all__ = ["FrozenHeap"]
