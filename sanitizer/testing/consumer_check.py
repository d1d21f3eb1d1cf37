"""Fuzz your own consumer: one call proves a ``load_weights`` owns what it keeps.

:func:`check_consumer` gives ``consume`` (any function that takes a weights
iterator of ``(name, tensor)`` and may return what it built) the weights
through a *real* borrowed stream, many times over, each time with another
:class:`~sanitizer.testing.streams.StreamCase` drawn by hypothesis: stream
order, ring size from the largest tensor up, lifetime (the ring's reuse alone,
or the strict contract), quarantine, debug options (generations, or
``checksum=1:poison=1``) and stream kind. Each example runs the consumer three
times:

1. the *oracle*: over owned copies of the weights, in the same order;
2. *unsanitized*: over the borrowed stream with the sanitizer off (the bare
   program: a retained view silently reads the ring's later bytes);
3. *sanitized*: over the same stream with the sanitizer on
   (``halt_on_error=0``), which records every stale read and every view still
   held after its bytes were reused or its stream ended.

What it built (every tensor reachable from its result: see
:mod:`sanitizer.testing.results`) must be bit-identical in the three runs, and
the sanitized run must record nothing. Otherwise the check fails with an
:class:`AssertionError` subclass whose text names the retention (the holder,
where it lives, the fix, from the sanitizer's report), the minimal stream case
after hypothesis shrank it, and a line that replays it:

* :class:`RetainedBorrowError`: the consumer kept borrowed views (or read them
  stale): the sanitizer caught it;
* :class:`SanitizerMissError`: a result differs from the oracle and the
  sanitizer recorded nothing: a miss, never a pass (the consumer reads borrowed
  bytes through a path the sanitizer cannot see, or a sanitizer bug);
* :class:`NondeterministicConsumerError`: two runs over owned copies differ,
  so nothing can be compared (torch's and ``random``'s generators are seeded
  the same before each run; anything else is the consumer's).

A failing example is first found with cheap settings (no heap walk, short
stacks, the caller's heap frozen out of the garbage collector); its minimal
case is then run once more with full triage, which names the holders.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import importlib
import importlib.util
import os
import random
import shlex
import sys
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import sanitizer
from sanitizer.core.suggest import close_to
from sanitizer.testing import isolation
from sanitizer.testing.results import differences, reachable
from sanitizer.testing.streams import StreamCase, is_count, open_stream
from sanitizer.testing.weights import WeightSet, describe_source

# Finding a failure: the properties do not depend on holder names or long stacks.
QUICK = {"triage_budget_ms": 0, "stack_depth": 2, "timeline_events": 0}
# Explaining it: the sanitizer's defaults (8 frames, a 1 s holder walk), in triage mode.
DIAGNOSE = {"triage": 1}
_ORACLES_KEPT = 4  # oracle results cached by stream order (grouped, sorted, interleaved, and one shuffle)
_HERE = os.path.dirname(os.path.abspath(__file__))
_HARNESS = {os.path.join(_HERE, f) for f in ("consumer_check.py", "isolation.py", "streams.py", "results.py",
                                            "weights.py", "consumer_cli.py")}

Progress = Callable[[int, int, int], None]  # (examples done, examples asked for, failures so far)


class ConsumerCheckError(AssertionError):
    """A consumer check failed; ``str()`` is the whole explanation.

    ``case``: the minimal :class:`StreamCase`; ``replay``: its JSON (``check_consumer(..., replay=...)``);
    ``report``: the sanitized run's report (``sanitizer.report()`` form) when one was taken;
    ``outcome``: the :class:`Outcome` of that run; ``found_at``: which example failed first."""

    def __init__(self, message: str, outcome: "Outcome", found_at: Optional[int] = None):
        super().__init__(message)
        self.outcome = outcome
        self.found_at = found_at  # the example (1-based) that failed first, before shrinking; None for a replay
        self.case = outcome.case
        self.replay = outcome.case.to_json()
        self.report = outcome.report


class RetainedBorrowError(ConsumerCheckError):
    """The consumer kept borrowed views past their lifetime, or read them stale."""


class SanitizerMissError(ConsumerCheckError):
    """A result differs from the owned oracle and the sanitizer recorded nothing: a miss."""


class NondeterministicConsumerError(ConsumerCheckError):
    """Two runs of the consumer over owned copies of the same weights built different results."""


@dataclasses.dataclass
class Outcome:
    """One example: how each run went, what the sanitized run recorded, and how the results compare."""

    case: StreamCase
    ring: int
    largest: int
    errors_seen: int = 0  # errors the sanitized run recorded (stale reads, checksum mismatches)
    retentions: int = 0  # retention events the sanitized run recorded
    retained: List[str] = dataclasses.field(default_factory=list)  # leases still held after the run
    returned: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # (path in the result, lease name)
    unsanitized_error: Optional[str] = None  # what consume raised over the unsanitized stream
    sanitized_error: Optional[str] = None
    unsanitized_diff: List[str] = dataclasses.field(default_factory=list)
    sanitized_diff: List[str] = dataclasses.field(default_factory=list)
    nondeterministic: List[str] = dataclasses.field(default_factory=list)  # oracle vs oracle, on a suspected miss
    values: int = 0  # values compared
    report: Optional[Dict[str, Any]] = None  # the sanitized run's report (diagnosis runs)

    @property
    def detected(self) -> bool:
        return bool(self.errors_seen or self.retentions or self.retained or self.returned)

    @property
    def exact(self) -> bool:
        return not (self.unsanitized_diff or self.sanitized_diff or self.unsanitized_error or self.sanitized_error)

    @property
    def verdict(self) -> str:
        """``pass``, ``retention`` (caught), ``miss`` (wrong and uncaught) or ``nondeterministic``."""
        if self.detected:
            return "retention"
        if self.exact:
            return "pass"
        return "nondeterministic" if self.nondeterministic else "miss"


@dataclasses.dataclass
class CheckResult:
    """What a passing check ran."""

    examples: int
    seconds: float
    weights: str

    def __str__(self) -> str:
        rate = self.examples / self.seconds if self.seconds > 0 else float("inf")
        return (f"{self.examples} example(s) over {self.weights} in {self.seconds:.2f} s ({rate:.0f}/s): "
                f"bit-exact unsanitized, sanitized and against the owned oracle; no error, no retention")


@contextlib.contextmanager
def _same_randomness() -> Iterator[None]:
    """torch's CPU generator and ``random`` seeded alike for each run, the caller's states restored after.

    torch's intra-op thread count is restored too: the first checksum kernel (numba's OpenMP layer) sets
    the process's OpenMP thread count, which torch reads, to numba's; a caller that chose one thread
    (a CI job, the benchmark on one core) must keep it."""
    py_state = random.getstate()
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)  # (torch.manual_seed also queues a CUDA call with its stack)
        random.seed(0)
        try:
            yield
        finally:
            random.setstate(py_state)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


def _failure_text(exc: BaseException) -> str:
    """``Type: message (at file:line)`` of an exception, the innermost frame outside the harness."""
    where = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if os.path.abspath(frame.filename) not in _HARNESS:
            where = f" (at {frame.filename}:{frame.lineno})"
            break
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}"


class _Checker:
    """Runs examples of one consumer over one set of weights."""

    def __init__(self, consume: Callable[[Iterator[Tuple[str, torch.Tensor]]], Any], weights: Any):
        if not callable(consume):
            raise TypeError(f"check_consumer: consume must be callable (it receives the weights iterator), "
                            f"got {type(consume).__name__}: {consume!r:.80}")
        self.consume = consume
        self.source = weights
        self.weights = WeightSet.of(weights)
        self.label = getattr(consume, "__qualname__", None) or repr(consume)
        self._oracles: "OrderedDict[Tuple[str, ...], Dict[str, Any]]" = OrderedDict()
        self._runs = 0
        # Buffer names unique in the process: an earlier check's buffers (a view its consumer left in a
        # class attribute) must never pass for this one's (``_ours``), or a correct consumer is blamed.
        checker = next(_CHECKERS)
        self._tag = "check_consumer" if checker == 1 else f"check_consumer-{checker}"

    # -- one example -------------------------------------------------------------------
    def oracle(self, names: Sequence[str], fresh: bool = False) -> Dict[str, Any]:
        """What ``consume`` builds from owned copies of the weights streamed in ``names``' order."""
        key = tuple(names)
        if not fresh and key in self._oracles:
            self._oracles.move_to_end(key)
            return self._oracles[key]
        with isolation.unsanitized(), _same_randomness():
            try:
                built = self.consume(iter(self.weights.owned_copies(names)))
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"check_consumer: {self.label} raised while reading owned copies of the weights "
                                 f"(no borrowed stream involved): fix that first")
                raise
        values = reachable(built)
        if not fresh:
            self._oracles[key] = values
            while len(self._oracles) > _ORACLES_KEPT:
                self._oracles.popitem(last=False)
        return values

    def _call(self, stream: Any) -> Tuple[Any, Optional[str]]:
        with _same_randomness():
            try:
                return self.consume(stream), None
            except Exception as exc:  # the frames go with exc: nothing of the consumer's stays alive
                return None, _failure_text(exc)

    def run(self, case: StreamCase, diagnose: bool = False) -> Outcome:
        """Run one example: the oracle, the unsanitized and the sanitized run; compare; forget its records."""
        names = self.weights.order(case)
        items = self.weights.items(names)
        ring = self.weights.ring(case)
        self._runs += 1
        tag = f"{self._tag}#{self._runs}"
        out = Outcome(case, ring, self.weights.largest)
        with isolation.isolated_run(freeze=not diagnose) as scope:
            oracle = self.oracle(names)
            out.values = sum(isinstance(v, torch.Tensor) for v in oracle.values())
            with isolation.unsanitized():
                stream = open_stream(case, items, ring, f"{tag}-unsanitized")
                built, out.unsanitized_error = self._call(stream)
                stream.close()
                del stream
                if out.unsanitized_error is None:
                    out.unsanitized_diff = differences(oracle, reachable(built))
                del built
            # rescue=0 whatever the caller's options: the sanitized result shows what retained views read (the
            # guard's poison), not the copies rescue would hand them
            options = {"halt_on_error": 0, "rescue": 0, "print_errors": 0,  # (its findings are its result's)
                       **case.sanitizer_options(), **(DIAGNOSE if diagnose else QUICK)}
            with sanitizer.sanitize(**options):
                built = self._sanitized_run(case, items, ring, tag, scope, out, diagnose)
            if out.sanitized_error is None:
                out.sanitized_diff = differences(oracle, reachable(built))
            del built
            if not out.detected and not out.exact:  # a miss, unless the consumer itself is not deterministic
                out.nondeterministic = differences(oracle, self.oracle(names, fresh=True))
        return out

    def _sanitized_run(self, case: StreamCase, items: List[Tuple[str, torch.Tensor]], ring: int, tag: str,
                       scope: isolation.RecordScope, out: Outcome, diagnose: bool) -> Any:
        stream = open_stream(case, items, ring, tag)
        built, out.sanitized_error = self._call(stream)
        stream.close()  # a consumer that stopped early: the rest of its leases end now, with every check
        del stream
        gc.collect()  # what is garbage lets its leases die; what is still held is retained
        rep = sanitizer.report(final=diagnose, exclude=scope.exclude())
        out.errors_seen = scope.errors_seen()
        # Only this run's own leases: a view an earlier check's consumer left in a class attribute is that
        # consumer's retention, decided (or read) while this one runs; never this consumer's.
        out.retentions = sum(1 for e in rep["events"]
                             if e.get("kind") == "retention" and _ours((e.get("lease") or {}).get("buffer"), tag))
        out.retained = [lease["name"] for lease in rep["retained_stale_leases"] if _ours(lease.get("buffer"), tag)]
        for path, value in reachable(built).items():
            lease = sanitizer.lease_of(value) if isinstance(value, torch.Tensor) else None
            if lease is not None:
                out.returned.append((path, lease.name or "?"))
        if diagnose:
            out.report = rep
        return built

    # -- the search ---------------------------------------------------------------------
    def search(self, strategy: Any, examples: int, seed: Optional[int], deadline: Optional[float],
               progress: Optional[Progress]) -> Tuple[Optional[Outcome], int, int]:
        """Run up to ``examples`` examples; ``(the minimal failing outcome or None, examples run, index of the
        first failing example)``. Hypothesis shrinks a failure to its simplest case."""
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as fixed_seed

        state = {"ran": 0, "failing": 0}
        start = time.monotonic()

        def example(case: StreamCase) -> None:
            if not state["failing"] and deadline is not None and state["ran"] and time.monotonic() - start > deadline:
                return  # out of time: the remaining draws are skipped (never while shrinking a failure)
            out = self.run(case)
            if not state["failing"]:
                state["ran"] += 1
                if out.verdict != "pass":
                    state["failing"] = state["ran"]
                if progress is not None:
                    progress(state["ran"], examples, int(bool(state["failing"])))
            if out.verdict != "pass":
                raise _ExampleFailed(out)

        test = settings(max_examples=examples, derandomize=seed is None, database=None, deadline=None,
                        suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
                        phases=(Phase.explicit, Phase.generate, Phase.shrink), verbosity=Verbosity.quiet)(
            given(strategy)(example))
        if seed is not None:
            test = fixed_seed(seed)(test)
        try:
            test()
        except BaseException as exc:  # noqa: B036 - hypothesis may wrap ours in an exception group (flaky)
            failed = _find_failed(exc)
            if failed is None:
                raise
            return failed.outcome, state["ran"], state["failing"]
        return None, state["ran"], 0

    # -- the failure --------------------------------------------------------------------
    def failure(self, out: Outcome, found_at: Optional[int], examples: Optional[int]) -> ConsumerCheckError:
        cls = {"retention": RetainedBorrowError, "miss": SanitizerMissError,
               "nondeterministic": NondeterministicConsumerError}[out.verdict]
        return cls(self.message(out, found_at, examples), out, found_at)

    def message(self, out: Outcome, found_at: Optional[int], examples: Optional[int]) -> str:
        name = self.label
        if out.verdict == "retention":
            what = []
            if out.retained or out.retentions:
                n = max(len(out.retained), out.retentions)
                what.append(f"{n} borrowed view{'s' * (n != 1)} held after {'its' if n == 1 else 'their'} "
                            f"bytes were reused or the stream ended")
            if out.errors_seen:
                what.append(f"{out.errors_seen} sanitizer error{'s' * (out.errors_seen != 1)} (stale reads)")
            head = f"check_consumer({name}): {name} keeps borrowed weights past their lifetime: " + "; ".join(what)
        elif out.verdict == "miss":
            head = (f"check_consumer({name}): SANITIZER MISS: what {name} built over a borrowed stream differs from "
                    f"what it builds over owned copies, and the sanitizer recorded no error and no retention. Either "
                    f"{name} reads borrowed bytes through a path the sanitizer cannot see (a raw data_ptr, ctypes, "
                    f"a C extension), or this is an ownership-sanitizer bug: please report it with the replay line")
        else:
            head = (f"check_consumer({name}): {name} is not deterministic: two runs over owned copies of the same "
                    f"weights in the same order built different results, so the borrowed runs cannot be compared")
        lines = [head + "."]
        if out.report is not None and out.verdict == "retention":
            lines += ["", *_holder_lines(out.report, out.returned, f"the value {name}() returned", self.consume)]
        if out.returned:
            shown = ", ".join(f"{p} (lease '{n}')" for p, n in out.returned[:4])
            more = f", and {len(out.returned) - 4} more" if len(out.returned) > 4 else ""
            lines.append(f"returned still borrowed: {shown}{more}")
            if out.report is None:
                lines.append(f"  fix: return owned tensors: sanitizer.own(t) (copies only a borrowed t) or t.clone(), "
                             f"where {name} keeps them ({_site_of(self.consume)})")
        elif out.retained and out.report is None:
            lines.append(f"held: {', '.join(repr(n) for n in out.retained[:6])}"
                         + (f", and {len(out.retained) - 6} more" if len(out.retained) > 6 else ""))
        if out.values:
            lines += ["", f"results ({out.values} tensor{'s' * (out.values != 1)} compared with the owned oracle):"]
            lines.append("  unsanitized: " + _run_text(out.unsanitized_error, out.unsanitized_diff, out.values))
            lines.append("  sanitized:   " + _run_text(out.sanitized_error, out.sanitized_diff, out.values)
                         + (" (the guard points retained views at poison)" if out.sanitized_diff and out.detected
                            else ""))
        else:
            lines += ["", f"results: {name} returned no tensor to compare"
                      + "".join(f"; {k} run raised {e}" for k, e in (("unsanitized", out.unsanitized_error),
                                                                    ("sanitized", out.sanitized_error)) if e)]
        if out.nondeterministic:
            lines.append("  oracle run twice: " + "; ".join(out.nondeterministic[:3]))
        where = ""
        if found_at:
            where = (f" (example {found_at}" + (f" of {examples}" if examples else "")
                     + " failed first; hypothesis shrank it to this one)")
        lines += ["", f"minimal case{where}: {out.case.describe(out.ring, out.largest)}"]
        replays = self.replay_lines(out.case)
        lines += [f"replay: {replays[0]}"] + [f"    or: {line}" for line in replays[1:]]
        return "\n".join(lines)

    def replay_lines(self, case: StreamCase) -> List[str]:
        j = case.to_json()
        src = describe_source(self.source)
        lines = [f"check_consumer({self.label}, {repr(src) if src else 'weights'}, replay='{j}')"]
        spec = consumer_spec(self.consume)
        if spec is not None and src is not None:
            lines.append(f"ownsan fuzz --consumer {shlex.quote(spec)} --weights {shlex.quote(src)} --replay '{j}'")
        return lines


class _ExampleFailed(Exception):
    """Raised inside the hypothesis test: carries the outcome of the failing example out of it."""

    def __init__(self, outcome: Outcome):
        super().__init__(outcome.verdict)
        self.outcome = outcome


def _find_failed(exc: BaseException) -> Optional[_ExampleFailed]:
    if isinstance(exc, _ExampleFailed):
        return exc
    for inner in getattr(exc, "exceptions", ()) or ():
        found = _find_failed(inner)
        if found is not None:
            return found
    return None


_CHECKERS = itertools.count(1)  # checkers made in this process (their buffers' names)


def _ours(buffer: Any, tag: str) -> bool:
    """Is ``buffer`` one of the run's (its ring ``tag``, grown segments ``tag+N``, loader windows ``tag@0x..``)?"""
    return isinstance(buffer, str) and (buffer == tag or buffer.startswith((tag + "+", tag + "@")))


def _run_text(error: Optional[str], diff: List[str], values: int) -> str:
    if error is not None:
        return f"raised {error}"
    if not diff:
        return "bit-exact"
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    return f"{len(diff)} of {values} differ: {shown}"


def _holder_lines(rep: Dict[str, Any], returned: List[Tuple[str, str]], returned_label: str,
                  consume: Any) -> List[str]:
    """The sanitizer's own account (the pytest plugin's section: the summary line, each holder with where it
    lives, its stale reads and the fix, the first error of each kind), then where the first holder's views
    were lent and reused. A view whose holder is this harness's frame (it holds what ``consume`` returned)
    or one Python cannot see (a comprehension still building the returned dict) is said to be held by
    ``returned_label``, when the returned value does hold it."""
    from sanitizer.reporting.report import summarize
    from sanitizer.reporting.text import lent_reused, section_for_test

    in_result = {lease for _, lease in returned}
    code = getattr(consume, "__code__", None)
    site = {"file": code.co_filename, "line": code.co_firstlineno} if code is not None else None
    events = []
    for e in rep["events"]:
        if e.get("kind") == "retention" and e.get("lease", {}).get("name") in in_result:
            holder = e.get("holder") or {}
            where = (holder.get("site") or {}).get("file")
            if not holder or holder.get("kind") == "unknown" or (where and os.path.abspath(where) in _HARNESS):
                e = dict(e, holder={"kind": "returned", "path": returned_label, "consumer": returned_label,
                                    "site": site})
        events.append(e)
    rep = dict(rep, events=events)
    rep["summary"] = summarize(rep)
    lines = section_for_test(rep, None).splitlines()
    consumers = rep["summary"]["retaining_consumers"]
    if consumers:
        lines.append(lent_reused(consumers[0]["first"]))
    return lines


def _site_of(fn: Any) -> str:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else "?"


def consumer_spec(fn: Any) -> Optional[str]:
    """``module:qualname`` (or ``path.py:qualname`` for a file outside any package on the path) naming ``fn``
    for ``ownsan fuzz --consumer``; None when it has no importable name (a lambda, a local function)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:
        return None
    mod = sys.modules.get(module)
    path = os.path.abspath(getattr(mod, "__file__", "") or "")
    cwd = os.getcwd()
    if path and path.startswith(cwd + os.sep):
        as_module = os.path.join(cwd, *module.split("."))
        if module != "__main__" and path in (as_module + ".py", os.path.join(as_module, "__init__.py")):
            return f"{module}:{qualname}"
        return f"{os.path.relpath(path, cwd)}:{qualname}"
    return None if module == "__main__" else f"{module}:{qualname}"


def _module_hint(missing: str) -> str:
    """`` (did you mean 'pkg.loader'?)`` for a module name that does not exist: the closest module beside
    it (in its package, or on sys.path for a top-level name), or ``""``."""
    import pkgutil

    parent, _, leaf = missing.rpartition(".")
    try:
        where = importlib.import_module(parent).__path__ if parent else None  # type: ignore[attr-defined]
    except (ImportError, AttributeError):
        return ""
    near = close_to(leaf, (m.name for m in pkgutil.iter_modules(where)))
    return f" (did you mean '{parent + '.' if parent else ''}{near}'?)" if near else ""


def load_consumer(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names: ``package.module:function`` (``Class.method`` works), or ``path/file.py:function``.
    ValueError naming the spec and what is wrong."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"{spec!r} is not MODULE:FUNCTION (e.g. mypkg.loader:load_weights or tests/test_x.py:load)")
    try:
        if module_part.endswith(".py") or os.sep in module_part:
            path = os.path.abspath(module_part)
            if not os.path.isfile(path):
                folder = os.path.dirname(path)
                files = sorted(f for f in os.listdir(folder) if f.endswith(".py")) if os.path.isdir(folder) else []
                near = close_to(os.path.basename(path), files)
                hint = f" (did you mean {os.path.join(os.path.dirname(module_part), near)!r}?)" if near else ""
                raise ValueError(f"{spec!r}: no file {module_part!r}{hint}")
            name = "_ownsan_consumer_" + "".join(c if c.isalnum() else "_" for c in os.path.splitext(module_part)[0])
            module = sys.modules.get(name)
            if module is None:
                file_spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(file_spec)  # type: ignore[arg-type]
                sys.modules[name] = module
                if os.path.dirname(path) not in sys.path:
                    sys.path.insert(0, os.path.dirname(path))  # as `python file.py` would: its siblings import
                file_spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would
            module = importlib.import_module(module_part)
    except ValueError:
        raise
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_part == missing or module_part.startswith(missing + ".")):  # not a dependency's
            raise ValueError(f"{spec!r}: cannot import {module_part!r}: no module named {missing!r}"
                             f"{_module_hint(missing)}") from None
        raise ValueError(f"{spec!r}: cannot import {module_part!r}: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        raise ValueError(f"{spec!r}: cannot import {module_part!r}: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    where, reached = module_part, []  # what is found so far: the module, then Class, Class.method
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("__") and callable(getattr(obj, n, None))]
            near = close_to(part, names)
            hint = f" (did you mean '{module_part}:{'.'.join(reached + [near])}'?)" if near else ""
            raise ValueError(f"{spec!r}: {where!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
        reached.append(part)
        where = f"{module_part}:{'.'.join(reached)}"
    if not callable(obj):
        raise ValueError(f"{spec!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def check_consumer(consume: Callable[[Iterator[Tuple[str, torch.Tensor]]], Any], weights: Any, *,
                   examples: int = 100, seed: Optional[int] = None, deadline: Optional[float] = None,
                   replay: Any = None, streams: Any = None, progress: Optional[Progress] = None) -> CheckResult:
    """Prove that ``consume`` owns what it keeps: fuzz it over borrowed streams of ``weights``.

    ``consume(weights_iterator)`` reads ``(name, tensor)`` pairs and may return what it built (a module, a
    dict, a list of tensors, a dataclass, None). ``weights``: a state dict, ``(name, tensor)`` pairs, a
    safetensors (or ``torch.save``) file, a list of files, or a directory of them; read once.

    ``examples``: how many stream cases to try (hypothesis draws them; :func:`borrowed_streams` by default,
    or the strategy given as ``streams``); ``seed``: None for the same cases every run (derandomized), an
    int for another fixed set; ``deadline``: seconds after which no new example starts (a failure found
    is still shrunk); ``replay``: a case's JSON (from a failure's replay line) to run just that one;
    ``progress(done, asked, failures)`` after each example.

    Returns a :class:`CheckResult` when every example passed: bit-identical results unsanitized,
    sanitized and against the owned oracle, and no sanitizer error or retention. Raises a
    :class:`ConsumerCheckError` (an ``AssertionError``) otherwise."""
    __tracebackhide__ = True  # pytest: the failure is the message, shown at the test's own line
    if not is_count(examples, 1):
        raise ValueError(f"check_consumer: examples must be an integer >= 1, got {examples!r}")
    if seed is not None and not is_count(seed, 0):
        raise ValueError(f"check_consumer: seed must be None or an integer >= 0, got {seed!r}")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                 or not deadline > 0):
        raise ValueError(f"check_consumer: deadline must be a number of seconds > 0, got {deadline!r}")
    checker = _Checker(consume, weights)
    with _one_intra_op_thread():
        return _check(checker, examples, seed, deadline, replay, streams, progress)


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """torch single-threaded for the check, the caller's count restored after: a check's tensors are small,
    and one intra-op thread is faster and far steadier on a shared CI machine (two OpenMP threads on two
    busy cores wait for each other on every op: 2 ms an example became 120 ms here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check(checker: "_Checker", examples: int, seed: Optional[int], deadline: Optional[float], replay: Any,
           streams: Any, progress: Optional[Progress]) -> CheckResult:
    __tracebackhide__ = True
    start = time.perf_counter()
    if replay is not None:
        case = replay if isinstance(replay, StreamCase) else StreamCase.from_json(replay)
        out = checker.run(case, diagnose=True)
        if out.verdict != "pass":
            raise checker.failure(out, None, None)
        return CheckResult(1, time.perf_counter() - start, checker.weights.describe())
    if streams is None:
        from sanitizer.testing.strategies import borrowed_streams

        streams = borrowed_streams()
    found, ran, at = checker.search(streams, examples, seed, deadline, progress)
    if found is not None:
        final = checker.run(found.case, diagnose=True)  # the minimal case again, with the holders named
        raise checker.failure(final if final.verdict != "pass" else found, at, examples)
    return CheckResult(ran, time.perf_counter() - start, checker.weights.describe())


def borrowed_stream(weights: Any, case: Optional[StreamCase] = None, *, name: str = "borrowed_stream",
                    **params: Any) -> Any:
    """A borrowed iterator over ``weights`` for a property of your own: ``case`` (or the
    :class:`StreamCase` fields as keywords; by default the strictest: layer-grouped through a ring of the
    largest tensor) says how. Use it in ``with`` (or close it) to end its leases with every check.

    The case's debug and quarantine settings are options of the sanitized run, not of the stream: run
    your property ``with sanitizer.sanitize(**case.sanitizer_options()):`` to apply them."""
    if case is None:
        case = StreamCase(**params)
    elif params:
        case = dataclasses.replace(case, **params)
    ws = WeightSet.of(weights)
    names = ws.order(case)
    return open_stream(case, ws.items(names), ws.ring(case), name)


class BorrowedWeights:
    """The ``borrowed_weights`` fixture: ``borrowed_weights(weights, case=None, **params)`` returns a borrowed
    iterator (see :func:`borrowed_stream`); the weights are read once per object or path; every iterator
    it handed out is closed at the end of the test."""

    def __init__(self, name: str = "borrowed_weights"):
        self.name = name
        self._sets: Dict[Any, Tuple[Any, WeightSet]] = {}
        self._open: List[Any] = []

    def __call__(self, weights: Any, case: Optional[StreamCase] = None, **params: Any) -> Any:
        key = os.fspath(weights) if isinstance(weights, (str, os.PathLike)) else id(weights)
        if key not in self._sets:
            self._sets[key] = (weights, WeightSet.of(weights))  # the object too: its id stays its own
        stream = borrowed_stream(self._sets[key][1], case, name=f"{self.name}#{len(self._open) + 1}", **params)
        self._open.append(stream)
        return stream

    def close(self) -> None:
        while self._open:
            self._open.pop().close()


__all__ = ["check_consumer", "borrowed_stream", "BorrowedWeights", "CheckResult", "Outcome", "ConsumerCheckError",
           "RetainedBorrowError", "SanitizerMissError", "NondeterministicConsumerError", "consumer_spec",
           "load_consumer"]
