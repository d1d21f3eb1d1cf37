"""The fuzz campaign: no miss, no false alarm, bit-exact when owning or rescuing.

A case is a generated checkpoint (layers of parameters in bf16, fp16, fp32 and
int8, in one or several safetensors files), a stream order (name-sorted,
layer-grouped, shuffled), a staging ring from the largest tensor up to the
whole checkpoint, a lifetime, debug options and a consumer. The stream is the
files read with ``safe_open`` either through
:func:`~sanitizer.torch_layer.iterators.emulate_borrowed` (a ``StagingRing``) or through a
plain ring loader that knows nothing of the sanitizer, wrapped by
:func:`~sanitizer.torch_layer.iterators.borrowed_iterator` (real borrowed views, real
reuse either way); the oracle is ``safetensors.torch.load_file``.

Each case runs unsanitized (is the result corrupted?) and sanitized with
``halt_on_error=0`` (how many errors?), and retaining consumers once more with
``rescue=1``. Properties:

(a) no miss: a result that differs from the oracle comes with at least one error;
(b) no false alarm: a correct consumer gets no error and a bit-exact result;
(c) ``own_arguments`` (the owning deferred loader) and ``rescue=1`` are bit-exact.

``ownsan fuzz --examples N --seed S [-j J]`` runs N cases over J processes and
prints the counts; ``--replay JSON`` reruns one case. The bounded campaign for
CI lives in ``tests/testing/test_fuzz.py`` (hypothesis, derandomized).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

import sanitizer
from sanitizer.core.options import OPTIONS
from sanitizer.testing import consumer_cli, isolation
from sanitizer.testing.fuzz_args import build_parser
from sanitizer.testing.pool import batches, in_processes
from sanitizer.testing.progress import ProgressLine
from sanitizer.testing.results import differences
from sanitizer.testing.streams import (DEBUG, STREAMS, check_field as _check_field, clip as _clip, open_stream,
                                       order_names, parse_object, raw_ring_loader as _raw_ring_loader)
from sanitizer.testing.streams import ring_bytes as _ring_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8}
ORDERS = ("sorted", "grouped", "shuffled")
CORRECT = ("copy", "non_blocking", "deferred_own")
RETAINING = ("list", "dict", "assign", "state_dict_copy", "deferred")
CONSUMERS = CORRECT + RETAINING
# DEBUG and STREAMS (emulate_borrowed over safe_open; borrowed_iterator over a raw ring loader) come from streams.py.

Param = Tuple[str, Tuple[int, ...], str]  # (name in its layer, shape, dtype key)


@dataclasses.dataclass(frozen=True)
class Case:
    layers: Tuple[Tuple[Param, ...], ...]
    files: int
    order: str
    ring_fraction: float  # 0: the largest tensor; 1: the whole checkpoint
    lifetime: Optional[int]  # None: the ring's reuse alone; N: each view also ends N advances later
    consumer: str
    debug: str
    seed: int
    stream: str = "emulated"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        """A case as :meth:`to_json` printed it; ValueError naming the field and the value that is wrong."""
        d = parse_object(text, dataclasses.fields(cls), "a case")
        d["layers"] = _parse_layers(d["layers"])
        _check_field("files", d["files"], isinstance(d["files"], int) and not isinstance(d["files"], bool)
                     and d["files"] >= 1, "an integer >= 1")
        _check_field("ring_fraction", d["ring_fraction"], isinstance(d["ring_fraction"], (int, float))
                     and not isinstance(d["ring_fraction"], bool) and 0 <= d["ring_fraction"] <= 1,
                     "a number from 0 to 1")
        lifetime = d["lifetime"]
        _check_field("lifetime", lifetime, lifetime is None or (isinstance(lifetime, int)
                     and not isinstance(lifetime, bool) and lifetime >= 1), "null or an integer >= 1")
        _check_field("seed", d["seed"], isinstance(d["seed"], int) and not isinstance(d["seed"], bool)
                     and d["seed"] >= 0, "an integer >= 0")
        for name, valid in (("order", ORDERS), ("consumer", CONSUMERS), ("debug", DEBUG), ("stream", STREAMS)):
            if name in d:
                _check_field(name, d[name], d[name] in valid and isinstance(d[name], str), f"one of {list(valid)}")
        return cls(**d)

    def names(self) -> List[str]:
        return [f"layers.{i}.{p[0]}" for i, layer in enumerate(self.layers) for p in layer]


def _parse_layers(raw: Any) -> Tuple[Tuple[Param, ...], ...]:
    """``[[[name, [dims...], dtype], ...], ...]`` -> the tuple form, every part checked."""
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"field 'layers': expected a non-empty list of layers, got {_clip(raw)}")
    layers = []
    for i, layer in enumerate(raw):
        where = f"field 'layers', layer {i}"
        if not isinstance(layer, list) or not layer:
            raise ValueError(f"{where}: expected a non-empty list of [name, shape, dtype], got {_clip(layer)}")
        params, seen = [], set()
        for j, param in enumerate(layer):
            if not (isinstance(param, list) and len(param) == 3):
                raise ValueError(f"{where}, parameter {j}: expected [name, shape, dtype], got {_clip(param)}")
            name, shape, dt = param
            if not isinstance(name, str) or not name.isidentifier() or name in seen:
                raise ValueError(f"{where}, parameter {j}: name {_clip(name)} is not a new Python identifier")
            if not (isinstance(shape, list) and shape and all(isinstance(n, int) and not isinstance(n, bool)
                                                               and n >= 1 for n in shape)):
                raise ValueError(f"{where}, parameter {name!r}: shape {_clip(shape)} is not a non-empty list "
                                 f"of positive integers")
            if dt not in DTYPES:
                raise ValueError(f"{where}, parameter {name!r}: dtype {_clip(dt)} is not one of {list(DTYPES)}")
            seen.add(name)
            params.append((name, tuple(shape), dt))
        layers.append(tuple(params))
    return tuple(layers)


@dataclasses.dataclass
class Outcome:
    corrupted: bool  # unsanitized result differs from the oracle
    errors: int  # errors recorded by the sanitized run
    sanitized_exact: bool
    rescue_exact: Optional[bool]  # retaining consumers only


# -- generation ------------------------------------------------------------------------
def random_case(rng: random.Random) -> Case:
    layers = tuple(
        tuple((f"w{j}", tuple(rng.randint(1, 24) for _ in range(rng.randint(1, 2))), rng.choice(list(DTYPES)))
              for j in range(rng.randint(1, 4)))
        for _ in range(rng.randint(1, 4)))
    return Case(layers, rng.randint(1, 3), rng.choice(ORDERS), rng.random(), rng.choice([None, 1, 2, 3]),
                rng.choice(CONSUMERS), rng.choice(DEBUG), rng.randrange(2**31), rng.choice(STREAMS))


def case_strategy() -> Any:
    """The same space as a hypothesis strategy (hypothesis shrinks to a minimal failing case)."""
    from hypothesis import strategies as st

    param = st.tuples(st.lists(st.integers(1, 24), min_size=1, max_size=2).map(tuple), st.sampled_from(list(DTYPES)))
    layer = st.lists(param, min_size=1, max_size=4).map(lambda ps: tuple((f"w{j}", s, d) for j, (s, d) in enumerate(ps)))
    return st.builds(Case, layers=st.lists(layer, min_size=1, max_size=4).map(tuple), files=st.integers(1, 3),
                     order=st.sampled_from(ORDERS), ring_fraction=st.floats(0, 1),
                     lifetime=st.sampled_from([None, 1, 2, 3]), consumer=st.sampled_from(CONSUMERS),
                     debug=st.sampled_from(DEBUG), seed=st.integers(0, 2**31 - 1), stream=st.sampled_from(STREAMS))


def _tensor(shape: Tuple[int, ...], dtype: str, g: torch.Generator) -> torch.Tensor:
    if dtype == "int8":
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=g)
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def stream_order(case: Case) -> List[str]:
    """``sorted`` interleaves layers (``layers.10`` before ``layers.2``), as real shards do; ``grouped`` is layer
    by layer; ``shuffled`` is seeded by the case."""
    return order_names(case.names(), case.order, case.seed)


def write_checkpoint(case: Case, directory: str) -> Tuple[List[Tuple[str, str]], Dict[str, torch.Tensor]]:
    """Write the case's files; return the stream ``[(name, path)]`` and the oracle (``load_file`` of them)."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(case.seed)
    tensors = {f"layers.{i}.{n}": _tensor(shape, dt, g) for i, layer in enumerate(case.layers) for n, shape, dt in layer}
    order = stream_order(case)
    per_file = -(-len(order) // case.files)
    where: Dict[str, str] = {}
    oracle: Dict[str, torch.Tensor] = {}
    for f in range(case.files):
        part = order[f * per_file:(f + 1) * per_file]
        if not part:
            continue
        path = os.path.join(directory, f"model-{f + 1:05d}.safetensors")
        save_file({n: tensors[n] for n in part}, path)
        where.update((n, path) for n in part)
        oracle.update(load_file(path))
    return [(n, where[n]) for n in order], oracle


def ring_bytes(case: Case, oracle: Dict[str, torch.Tensor]) -> int:
    return _ring_bytes([t.numel() * t.element_size() for t in oracle.values()], case.ring_fraction, case.stream,
                       case.lifetime)


def raw_ring_loader(plan: List[Tuple[str, str]], nbytes: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """A borrowing loader with no sanitizer inside, over the files of ``plan`` (see streams.raw_ring_loader)."""
    return _raw_ring_loader(_stream(plan), nbytes)


def _stream(plan: List[Tuple[str, str]]) -> Iterator[Tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    handles: Dict[str, Any] = {}
    try:
        for name, path in plan:
            if path not in handles:
                handles[path] = safe_open(path, framework="pt").__enter__()
            yield name, handles[path].get_tensor(name)
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)


# -- consumers -------------------------------------------------------------------------
class _Layer(nn.Module):
    def __init__(self, params: Sequence[Param]):
        super().__init__()
        for name, shape, dt in params:
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=DTYPES[dt]), requires_grad=False))


class FuzzModel(nn.Module):
    def __init__(self, case: Case):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(layer) for layer in case.layers)


def consume(case: Case, weights: Any) -> Dict[str, torch.Tensor]:
    """Run ``case.consumer`` over ``weights``; return clones of what it ends up holding."""
    model = FuzzModel(case)
    kind = case.consumer
    if kind in ("copy", "non_blocking"):
        params = dict(model.named_parameters())
        for name, t in weights:
            params[name].copy_(t, non_blocking=kind == "non_blocking")
    elif kind in ("deferred", "deferred_own"):
        from sanitizer.testing.reference.deferred_loader import load_layerwise

        load_layerwise(model, weights, ownership=kind == "deferred_own")
    elif kind == "list":
        held = list(weights)
        return {n: t.clone() for n, t in held}
    elif kind == "dict":
        acc: Dict[str, torch.Tensor] = {}
        for name, t in weights:
            acc[name] = t
        return {n: t.clone() for n, t in acc.items()}
    elif kind == "assign":
        model.load_state_dict(dict(weights), assign=True)
    elif kind == "state_dict_copy":
        model.load_state_dict(dict(weights))
    else:
        raise ValueError(f"unknown consumer {kind!r}; valid consumers: {', '.join(CONSUMERS)}")
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _exact(got: Dict[str, torch.Tensor], oracle: Dict[str, torch.Tensor]) -> bool:
    return not differences(oracle, got)


def _load(case: Case, plan: List[Tuple[str, str]], ring: int) -> Dict[str, torch.Tensor]:
    name = "fuzz-loader" if case.stream == "borrowed" else "fuzz-ring"
    return consume(case, open_stream(case, _stream(plan), ring, name))


def run_case(case: Case) -> Outcome:
    """Run one case (unsanitized, sanitized, and with ``rescue=1`` for retaining consumers).

    The objects alive before the case are frozen out of the garbage collector for its duration,
    and the records it adds are forgotten after it (see :mod:`sanitizer.testing.isolation`)."""
    with isolation.isolated_run() as scope:
        return _run_case(case, scope)


def _run_case(case: Case, scope: isolation.RecordScope) -> Outcome:
    # No heap walks (diagnostics only) and short stacks: the properties do not depend on them.
    quiet = {k: v for k, v in (("triage_budget_ms", 0), ("stack_depth", 2), ("print_errors", 0)) if k in OPTIONS}
    debug = {"checksum": 1, "poison": 1} if case.debug == "checksum+poison" else {}
    with tempfile.TemporaryDirectory(prefix="ownsan-fuzz-") as tmp:
        plan, oracle = write_checkpoint(case, tmp)
        ring = ring_bytes(case, oracle)
        with isolation.unsanitized():
            corrupted = not _exact(_load(case, plan, ring), oracle)
            with sanitizer.sanitize(halt_on_error=0, **quiet, **debug):
                sanitized = _load(case, plan, ring)
                errors = scope.errors_seen()
            rescue_exact = None
            if case.consumer in RETAINING:
                with sanitizer.sanitize(halt_on_error=0, rescue=1, **quiet, **debug):
                    rescue_exact = _exact(_load(case, plan, ring), oracle)
    return Outcome(corrupted, errors, _exact(sanitized, oracle), rescue_exact)


def violations(case: Case, out: Outcome) -> List[str]:
    """The properties this outcome breaks (empty: the case passes)."""
    bad = []
    if out.corrupted and out.errors == 0:
        bad.append("(a) miss: the unsanitized result differs from the oracle, yet no error was recorded")
    if not out.sanitized_exact and out.errors == 0:
        bad.append("(a) miss: the sanitized result differs from the oracle, yet no error was recorded")
    if case.consumer in CORRECT and (out.errors or out.corrupted or not out.sanitized_exact):
        bad.append(f"(b) false alarm or wrong result for a correct consumer: {out.errors} error(s), "
                   f"corrupted={out.corrupted}, sanitized bit-exact={out.sanitized_exact}")
    if case.consumer == "deferred_own" and out.corrupted:
        bad.append("(c) own_arguments: not bit-exact")
    if out.rescue_exact is False:
        bad.append("(c) rescue=1: not bit-exact")
    return bad


# -- shrinking, campaign, CLI ----------------------------------------------------------
def _simpler(case: Case) -> Iterator[Case]:
    r = dataclasses.replace
    if len(case.layers) > 1:
        for i in range(len(case.layers)):
            yield r(case, layers=case.layers[:i] + case.layers[i + 1:])
    for i, layer in enumerate(case.layers):
        if len(layer) > 1:
            for j in range(len(layer)):
                yield r(case, layers=case.layers[:i] + (layer[:j] + layer[j + 1:],) + case.layers[i + 1:])
        for j, (n, shape, dt) in enumerate(layer):
            if shape != (1,):
                small = layer[:j] + ((n, (1,), dt),) + layer[j + 1:]
                yield r(case, layers=case.layers[:i] + (small,) + case.layers[i + 1:])
    if case.files > 1:
        yield r(case, files=1)
    if case.debug != DEBUG[0]:
        yield r(case, debug=DEBUG[0])
    if case.lifetime is not None:
        yield r(case, lifetime=None)
    if case.order != "grouped":
        yield r(case, order="grouped")
    if case.stream != "emulated":
        yield r(case, stream="emulated")


def shrink(case: Case, budget: int = 200) -> Case:
    """Greedily simplify a failing case while it keeps failing."""
    improved = True
    while improved and budget > 0:
        improved = False
        for smaller in _simpler(case):
            budget -= 1
            if violations(smaller, run_case(smaller)):
                case, improved = smaller, True
                break
            if budget <= 0:
                break
    return case


def case_for(seed: int, index: int) -> Case:
    return random_case(random.Random(f"{seed}:{index}"))


def _zero_counts() -> Dict[str, Any]:
    return {"cases": 0, "unguarded": 0, "unguarded_corrupted": 0, "detected": 0, "correct": 0,
            "false_alarms": 0, "misses": 0, "rescue_inexact": 0, "own_inexact": 0, "failures": []}


def _work(seed: int, indices: Sequence[int]) -> Dict[str, Any]:
    counts = _zero_counts()
    for i in indices:
        case = case_for(seed, i)
        out = run_case(case)
        counts["cases"] += 1
        if case.consumer in RETAINING:
            counts["unguarded"] += 1
            if out.corrupted:
                counts["unguarded_corrupted"] += 1
                counts["detected"] += out.errors > 0
            counts["rescue_inexact"] += out.rescue_exact is False
        else:
            counts["correct"] += 1
            counts["false_alarms"] += bool(out.errors)
        counts["misses"] += (out.corrupted or not out.sanitized_exact) and out.errors == 0
        counts["own_inexact"] += case.consumer == "deferred_own" and out.corrupted
        bad = violations(case, out)
        if bad:
            counts["failures"].append({"index": i, "case": case.to_json(), "violations": bad})
    return counts


Progress = Callable[[int, int, int], None]  # (cases done, cases in all, failures so far)
_ProgressLine = ProgressLine  # its old name here (tests/tools/test_cli.py)


def campaign(examples: int, seed: int, jobs: int = 1, progress: Optional[Progress] = None) -> Dict[str, Any]:
    """Run cases 0..examples-1 of ``seed`` over ``jobs`` processes; ``progress`` is called after each batch."""
    total = _zero_counts()

    def add(part: Dict[str, Any]) -> None:
        for k, v in part.items():
            total[k] = total[k] + v
        if progress is not None:
            progress(total["cases"], examples, len(total["failures"]))

    if jobs <= 1:
        for i in range(examples):
            add(_work(seed, [i]))
    else:
        for part in in_processes(_work, [(seed, batch) for batch in batches(examples, jobs)], jobs):
            add(part)
    total["failures"].sort(key=lambda f: f["index"])
    return total


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    return run(parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``ownsan fuzz`` with its arguments parsed (by :func:`~sanitizer.testing.fuzz_args.build_parser`)."""
    if args.consumer:
        args.examples = 100 if args.examples is None else args.examples
        return consumer_cli.run(args, parser)
    for flag, value in (("--weights", args.weights), ("--deadline", args.deadline)):
        if value is not None:
            parser.error(f"{flag} goes with --consumer MODULE:FUNCTION (the project's campaign makes its own weights)")
    args.examples = 200 if args.examples is None else args.examples
    if args.replay:
        try:
            case = Case.from_json(args.replay)
        except ValueError as exc:
            parser.error(f"--replay: not a case: {exc}")
        out = run_case(case)
        print(json.dumps({"case": json.loads(case.to_json()), "outcome": dataclasses.asdict(out),
                          "violations": violations(case, out)}, indent=2))
        return 1 if violations(case, out) else 0
    if args.examples < 1 or args.jobs < 1:
        parser.error(f"--examples and -j must be >= 1, got {args.examples} and {args.jobs}")
    start = time.perf_counter()
    c = campaign(args.examples, args.seed, args.jobs, progress=None if args.quiet else ProgressLine())
    print(f"cases: {c['cases']} (seed {args.seed}, {args.jobs} job(s), {time.perf_counter() - start:.1f} s)\n"
          f"unguarded consumers: {c['unguarded']}; unguarded corruptions seen: {c['unguarded_corrupted']}; "
          f"detected: {c['detected']}\n"
          f"correct consumers: {c['correct']}; false alarms: {c['false_alarms']}\n"
          f"misses: {c['misses']}; own_arguments not bit-exact: {c['own_inexact']}; "
          f"rescue=1 not bit-exact: {c['rescue_inexact']}")
    for f in c["failures"][:5]:
        case = Case.from_json(f["case"])
        small = case if args.no_shrink else shrink(case)
        print(f"\nFAILED case {f['index']} of seed {args.seed}: " + "; ".join(f["violations"]))
        print(f"  minimal case: ownsan fuzz --replay '{small.to_json()}'")
    print("\nFAILED" if c["failures"] else "\npassed")  # the verdict, last, as the exit status says it
    return 1 if c["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
