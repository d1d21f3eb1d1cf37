"""Borrowed weight streams for testing a consumer: one case of order, ring, lifetime and debug options.

A :class:`StreamCase` is the part of a fuzz case that describes *how* weights
arrive, independent of what they are: the stream order (layer-grouped,
name-sorted, round-robin across layers, shuffled), the staging ring's size
(from the largest tensor, where every put reuses the previous tensor's bytes,
up to every tensor at once), each view's lifetime (the ring's reuse alone, or
also N advances, the strict contract), the sanitized run's quarantine and
debug options (``checksum=1:poison=1``), and the kind of stream:

* ``emulated``: :func:`~sanitizer.torch_layer.iterators.emulate_borrowed`, each
  tensor copied into a :class:`~sanitizer.StagingRing` (the debug allocator);
* ``borrowed``: a plain ring loader that knows nothing of the sanitizer, its
  views wrapped by :func:`~sanitizer.torch_layer.iterators.borrowed_iterator`
  (leases over the loader's own memory, as with a real loader).

Both are real borrowed streams: the consumer gets views whose bytes are
overwritten when the ring comes round. The project's fuzz campaign
(:mod:`sanitizer.testing.fuzz`) and the consumer check
(:mod:`sanitizer.testing.consumer_check`) build their streams here, so the two
explore the same space; :func:`open_stream` is the one constructor.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

ORDERS = ("grouped", "sorted", "interleaved", "shuffled")  # simplest first: hypothesis shrinks towards it
DEBUG = ("generations", "checksum+poison")
STREAMS = ("emulated", "borrowed")
LIFETIMES = (None, 1, 2, 3)
QUARANTINES = (0, 1, 4)
ALIGN = 64  # the rings' alignment (the emulation ring's default, and the raw loader's)

_LAYER_INDEX = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def check_field(name: str, value: Any, ok: bool, wanted: str) -> None:
    """A ValueError naming the field, what it should be and the value found, unless ``ok``."""
    if not ok:
        raise ValueError(f"field {name!r}: expected {wanted}, got {clip(value)}")


def clip(value: Any, limit: int = 80, raw: bool = False) -> str:
    """``value`` as JSON (``raw``: the text as given), cut to ``limit`` characters."""
    text = value if raw else json.dumps(value, default=repr)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_object(text: str, fields: Sequence[dataclasses.Field], what: str) -> Dict[str, Any]:
    """``text`` as a JSON object with only ``fields`` (the required ones present); ValueError naming the problem."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg}, at character {exc.pos}): {clip(text, raw=True)}") from None
    names = [f.name for f in fields]
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object with the fields {', '.join(names)}; got {clip(text, raw=True)}")
    unknown = sorted(set(d) - set(names))
    missing = [f.name for f in fields if f.name not in d and f.default is dataclasses.MISSING]
    problems = ([f"unknown field(s) {unknown}"] if unknown else []) + ([f"missing field(s) {missing}"] if missing
                                                                          else [])
    if problems:
        raise ValueError(f"{'; '.join(problems)} ({what} has {', '.join(names)})")
    return d


def is_count(value: Any, low: int) -> bool:
    """An int (not a bool) >= ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclasses.dataclass(frozen=True)
class StreamCase:
    """How the weights reach the consumer in one example (the defaults are the simplest, strict case)."""

    order: str = "grouped"  # grouped | sorted | interleaved | shuffled
    ring_fraction: float = 0.0  # 0: a ring of the largest tensor; 1: every tensor fits at once
    lifetime: Optional[int] = None  # None: a view lives until the ring reuses its bytes; N: N advances at most
    quarantine: int = 0  # sanitized run: each view ends at the next put, N retired regions kept out of reuse
    debug: str = "generations"  # sanitized run: generations alone, or checksum=1:poison=1 too
    stream: str = "emulated"  # emulated (a StagingRing) | borrowed (borrowed_iterator over a plain ring loader)
    seed: int = 0  # the shuffled order's seed

    def __post_init__(self) -> None:
        check_field("order", self.order, self.order in ORDERS, f"one of {list(ORDERS)}")
        check_field("ring_fraction", self.ring_fraction, isinstance(self.ring_fraction, (int, float))
                    and not isinstance(self.ring_fraction, bool) and 0 <= self.ring_fraction <= 1,
                    "a number from 0 to 1")
        check_field("lifetime", self.lifetime, self.lifetime is None or is_count(self.lifetime, 1),
                    "null or an integer >= 1")
        check_field("quarantine", self.quarantine, is_count(self.quarantine, 0), "an integer >= 0")
        check_field("debug", self.debug, self.debug in DEBUG, f"one of {list(DEBUG)}")
        check_field("stream", self.stream, self.stream in STREAMS, f"one of {list(STREAMS)}")
        check_field("seed", self.seed, is_count(self.seed, 0), "an integer >= 0")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "StreamCase":
        """A case as :meth:`to_json` printed it; ValueError naming the field and the value that is wrong."""
        return cls(**parse_object(text, dataclasses.fields(cls), "a stream case"))

    def sanitizer_options(self) -> Dict[str, Any]:
        """The options of the sanitized run that this case sets."""
        return {**debug_options(self.debug), **({"quarantine": self.quarantine} if self.quarantine else {})}

    def describe(self, ring: Optional[int] = None, largest: Optional[int] = None) -> str:
        """One line for a person: every parameter, in words."""
        from sanitizer.core.units import format_bytes

        if ring is None:
            size = f"ring {self.ring_fraction:.3g} of the way from the largest tensor to every tensor"
        else:
            size = f"ring {format_bytes(ring)}" + (" (the largest tensor)" if ring == largest else "")
        life = "until the ring reuses its bytes" if self.lifetime is None else \
            f"at most {self.lifetime} advance{'s' * (self.lifetime != 1)}"
        order = f"shuffled (seed {self.seed})" if self.order == "shuffled" else self.order
        kind = "emulate_borrowed (a StagingRing)" if self.stream == "emulated" else \
            "borrowed_iterator over a plain ring loader"
        return (f"order {order}; {size}; each view valid {life}; quarantine {self.quarantine}; "
                f"debug {self.debug}; stream {kind}")


def debug_options(debug: str) -> Dict[str, Any]:
    """The sanitizer options a debug setting stands for."""
    return {"checksum": 1, "poison": 1} if debug == "checksum+poison" else {}


def layer_of(name: str) -> str:
    """The layer a tensor belongs to: its name up to the first numeric part (``model.layers.3``), else its
    module (the name without its last part), so that ``lm_head.weight`` and ``lm_head.bias`` group."""
    m = _LAYER_INDEX.match(name)
    if m:
        return m.group(1)
    return name.rpartition(".")[0]


def order_names(names: Sequence[str], order: str, seed: int = 0) -> List[str]:
    """``names`` in ``order``: ``grouped`` (layer by layer, in the given order within each and of first
    appearance across them), ``sorted`` (by name: ``layers.10`` before ``layers.2``, interleaving layers as
    real shards do), ``interleaved`` (round-robin across layers: the worst case for a deferring consumer)
    or ``shuffled`` (seeded)."""
    if order == "sorted":
        return sorted(names)
    if order == "shuffled":
        out = list(names)
        random.Random(seed).shuffle(out)
        return out
    groups: Dict[str, List[str]] = {}
    for n in names:
        groups.setdefault(layer_of(n), []).append(n)
    if order == "grouped":
        return [n for group in groups.values() for n in group]
    if order == "interleaved":
        lists = list(groups.values())
        return [lst[k] for k in range(max(map(len, lists), default=0)) for lst in lists if k < len(lst)]
    raise ValueError(f"unknown order {order!r}; valid orders: {', '.join(ORDERS)}")


def aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def ring_bytes(sizes: Sequence[int], fraction: float, stream: str = "emulated",
               lifetime: Optional[int] = None) -> int:
    """The ring of a case: from the largest tensor (``fraction`` 0) to every tensor, aligned (1).

    A ``borrowed`` stream's plain loader must honour its own contract (a view stays valid for
    ``lifetime`` advances), so its ring holds at least ``lifetime + 1`` of the largest tensor."""
    largest = max(sizes, default=1) or 1
    total = sum(aligned(s) for s in sizes)
    ring = max(largest, largest + int(fraction * (total - largest)))
    if stream == "borrowed":
        ring = max(ring, ((lifetime or 1) + 1) * aligned(largest))
    return ring


def raw_ring_loader(items: Iterable[Tuple[str, torch.Tensor]], nbytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """A borrowing loader with no sanitizer inside: views of one plain uint8 ring it keeps rewriting.

    Each tensor's bytes are copied to the next aligned offset, wrapping to 0 when they would run past the
    end; the view it yields is valid until the ring comes round to those bytes again."""
    pool: Optional[torch.Tensor] = None
    head = 0
    for name, t in items:
        if pool is None:
            pool = torch.empty(nbytes, dtype=torch.uint8, device=t.device)
        n = t.numel() * t.element_size()
        offset = aligned(head) if aligned(head) + n <= nbytes else 0
        pool[offset:offset + n].copy_(t.detach().reshape(-1).view(torch.uint8))
        yield name, pool[offset:offset + n].view(t.dtype).view(t.shape)
        head = offset + n


def open_stream(case: Any, items: Iterable[Tuple[str, torch.Tensor]], ring: int, name: str) -> Any:
    """The borrowed stream of ``case`` (a :class:`StreamCase`, or anything with ``stream`` and ``lifetime``)
    over ``items``, through a ring of ``ring`` bytes; ``name`` labels its buffers in reports."""
    from sanitizer.torch_layer.iterators import borrowed_iterator, emulate_borrowed

    if case.stream == "borrowed":
        return borrowed_iterator(raw_ring_loader(items, ring), case.lifetime or 1, name=name)
    return emulate_borrowed(iter(items), ring, lifetime=case.lifetime, name=name)


__all__ = ["StreamCase", "ORDERS", "DEBUG", "STREAMS", "LIFETIMES", "QUARANTINES", "order_names", "layer_of",
           "ring_bytes", "raw_ring_loader", "open_stream", "debug_options", "check_field", "clip", "parse_object"]
