"""What holds a retained view: one root a person recognises, and the path from it down to the tensor.

The holder walk (:mod:`sanitizer.features.holders`) finds these, the naming
rules (:mod:`sanitizer.features.holder_paths`) build them, triage ranks them and
files them in its records as plain dicts (:meth:`Holder.to_dict`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

_NUMBER = re.compile(r"\d+")
_MODULE_DICTS = ("_parameters", "_buffers")  # where torch.nn.Module keeps what reads as module.name
_CLOSURE_VARIABLE = re.compile(r"\(variable '([A-Za-z_]\w*)'\)")
_CLOSURE_FACTORY = re.compile(r"^closure of ([\w.]+?)\.<locals>\.")  # closure of make_loader.<locals>.replay
_FIRST_ATTR = re.compile(r"^[\w.<>]*?\.([A-Za-z_]\w*)(?:\[|\.|$)")  # Type.attr[...] -> attr (a path not followable)


@dataclass
class Holder:
    """One root that holds a lease's memory, with the path from it down to the tensor."""

    kind: str  # global | class | object | frame | generator | closure | partial | unknown
    path: str
    site: Optional[Dict[str, Any]] = None  # {"file", "line", "function"} where the holder lives
    transient: bool = False  # a plain local of a frame on the reusing thread's stack (a loop variable?)
    frame_id: Optional[int] = None  # id() of that frame, to re-check the local later
    local: Optional[str] = None
    pattern: Optional[tuple] = None  # (weakref to the root, steps below it): to look again, cheaply
    detour: int = 0  # objects of the sanitizer's own classes the path runs through (a DeferralScope...)
    counted: bool = False  # named from its sites' earlier retentions, not seen holding this very view
    # What it held of the view when triage last followed its path (``same``, ``slice``...: see
    # store_site.held_shape), so a record built right after need not follow the path again.
    held: Optional[str] = field(default=None, compare=False, repr=False)
    # Found holding the view at its reuse, while the code that stored it still ran: the consumer to fix,
    # named before whatever holds it later (the caller a function returned its local dict to).
    at_reuse: bool = field(default=False, compare=False, repr=False)
    # Found at the reuse by looking in the running code's containers, a consumer not seen before: its view
    # may have other holders that only a heap walk finds (walked once, for this first retention).
    fresh: bool = field(default=False, compare=False, repr=False)
    _consumer: Optional[str] = field(default=None, init=False, compare=False, repr=False)

    @property
    def consumer(self) -> str:
        """Its grouping key (:func:`consumer_key` of its path), computed once: ranking and the record ask."""
        if self._consumer is None:
            self._consumer = consumer_key(self.path)
        return self._consumer

    @property
    def rank(self) -> int:
        """0: a root a person recognises; 1: a frame, an unknown or a path through our objects; 2: transient."""
        if self.transient:
            return 2
        return 1 if self.kind in ("frame", "unknown") or self.detour else 0

    @property
    def pattern_steps(self) -> bool:
        """Whether the path goes below its root (a container entry, an attribute), not a bare name."""
        return bool(self.pattern and any(seg[0] not in ("al", "x") for seg in self.pattern[1])) or "[" in self.path \
            or "." in self.path.split(")", 1)[-1]

    def to_dict(self, lease_name: Optional[str] = None) -> Dict[str, Any]:
        """Its record; ``lease_name``: the lease it holds, whose name as a key is wildcarded too."""
        consumer = consumer_key(self.path, lease_name) if lease_name else self.consumer
        out = {"kind": self.kind, "path": self.path, "site": self.site, "consumer": consumer}
        if self.counted:
            out["counted"] = True
        return out

    def closure_binding(self) -> Optional[Tuple[str, str, bool]]:
        """A closure's variable, as a name bound in the function that made it (when its factory is the
        function that lent the view: no call of the factory stored it)."""
        found = _CLOSURE_VARIABLE.search(self.path) if self.kind == "closure" else None
        return ("name", found.group(1), self.path.rstrip(")").endswith("]")) if found else None

    def store_target(self) -> Optional[Tuple[str, str, bool]]:
        """What the storing statement writes into (see :mod:`sanitizer.features.store_site`): the first
        attribute or name of the path, or the function a partial wraps, and whether the view sits in a
        container below it (then the store is an ``append`` or an item assignment, not the binding of the
        name); None when the path says neither."""
        steps = tuple(seg for seg in (self.pattern[1] if self.pattern else ()) if seg[0] not in ("al", "x"))
        if self.kind in ("frame", "generator") and self.local:
            return ("local", self.local, bool(steps))  # bound by a statement of its own function
        for i, seg in enumerate(steps):
            if (seg[0] == "a" and seg[1] in _MODULE_DICTS and i + 1 < len(steps) and steps[i + 1][0] == "k"
                    and isinstance(steps[i + 1][1], str)):
                return ("param", steps[i + 1][1], i + 2 < len(steps))  # module._parameters['weight']: module.weight
            if seg[0] in ("a", "ca"):
                return ("attr", seg[1], i + 1 < len(steps))
            if seg[0] in ("g", "l"):
                return ("name", seg[1], i + 1 < len(steps))
            if seg[0] in ("pa", "pk", "cl", "df"):
                break
        if self.kind == "partial" and self.path.startswith("partial(") and ")" in self.path:
            return ("partial", self.path[len("partial("):self.path.index(")")].rsplit(".", 1)[-1], False)
        if self.kind == "closure":
            factory = _CLOSURE_FACTORY.match(self.path)
            if factory:  # the closure was made by a call of its factory: that call stored the view in it
                return ("call", factory.group(1), False)
            return self.closure_binding()
        if self.kind in ("object", "class", "global"):
            found = _FIRST_ATTR.match(self.path)
            if found:
                rest = self.path[found.end(1):]
                return ("attr" if self.kind != "global" else "name", found.group(1), rest.startswith(("[", ".")))
        return None


_NAME_KEY = re.compile(r"\[(?:'[^'\]]*[.*][^'\]]*'|\"[^\"\]]*[.*][^\"\]]*\")\]")  # ['layers.*.q_proj.weight']


def consumer_key(path: str, name: Optional[str] = None) -> str:
    """The grouping key: list indices and tensor-name keys wildcarded, so one consumer holding its 3rd and
    4th weight (or ``['layers.3.q_proj.weight']`` and ``['layers.4.k_proj.weight']``) is one group
    (``[*]``), while a key that names a role, not a tensor (``['loaded_weight']``), stays. A key that is
    the lease's own ``name`` is a tensor name whatever it looks like (``sd['a']``, ``sd['b']``: one
    ``sd[*]``). Which statement stored the view splits a container's groups further (the report groups
    by that too)."""
    if name and isinstance(name, str):
        path = path.replace(f"[{name!r}]", "[*]")
    return _NAME_KEY.sub("[*]", _NUMBER.sub("*", path))


_SUBSCRIPT = re.compile(r"\[[^\[\]]*\]")


def container_key(path: str) -> str:
    """The container a holder path ends in, its subscripts dropped: ``our['tensor1.int64']`` and
    ``our['tensor1.bfloat16']`` are two entries of one dict (``our``), which ``consumer_key`` keeps apart
    (they differ by more than digits). Entries of one container hold different tensors: one entry's
    holding a view says nothing about another's."""
    return _SUBSCRIPT.sub("", path)


__all__ = ["Holder", "consumer_key", "container_key"]
