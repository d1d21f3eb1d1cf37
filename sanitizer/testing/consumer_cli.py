"""``ownsan fuzz --consumer package.module:function --weights DIR_OR_FILE``: the consumer check from a shell.

The same check as :func:`~sanitizer.testing.check_consumer` (the same
examples for the same ``--seed`` and ``-j``), with progress on stderr; the
result, or the failure's whole explanation with its replay lines, on stdout.
``-j J`` runs batches of examples in J spawned processes (each imports the
consumer by its name and reads the weights once); the first failure stops the
rest. ``--replay JSON`` runs one case, as a failure printed it. Exit status:
0 passed, 1 failed, 2 usage (a consumer that cannot be imported, weights that
do not exist: the message names the value).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from typing import Any, Dict, List, Optional

from sanitizer.testing.pool import in_processes, tick
from sanitizer.testing.progress import ProgressLine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("your own consumer (instead of the project's campaign)")
    group.add_argument("--consumer", metavar="MODULE:FUNCTION",
                       help="fuzz this function (package.module:function or path/to/file.py:function): it receives "
                       "the weights iterator and may return what it built")
    group.add_argument("--weights", metavar="DIR_OR_FILE",
                       help="the weights to stream: a safetensors (or torch.save) file, a directory of them, or "
                       "several joined by commas")
    group.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                       help="start no new example after this many seconds (a failure found is still shrunk)")


def _weights_arg(value: str) -> Any:
    parts = [p for p in value.split(",") if p]
    return parts[0] if len(parts) == 1 else parts


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The ``--consumer`` mode of ``ownsan fuzz`` (flags already parsed; usage errors through ``parser``)."""
    from sanitizer.testing.consumer_check import ConsumerCheckError, check_consumer, load_consumer
    from sanitizer.testing.streams import StreamCase
    from sanitizer.testing.weights import WeightSet

    if not args.weights:
        parser.error(f"--consumer {args.consumer!r} needs --weights DIR_OR_FILE (the weights to stream)")
    weights = _weights_arg(args.weights)
    for path in weights if isinstance(weights, list) else [weights]:
        if not os.path.exists(path):
            parser.error(f"--weights {path!r}: no such file or directory")
    try:
        consume = load_consumer(args.consumer)
    except ValueError as exc:
        parser.error(f"--consumer {exc}")
    if args.examples < 1 or args.jobs < 1:
        parser.error(f"--examples and -j must be >= 1, got {args.examples} and {args.jobs}")
    if args.deadline is not None and not args.deadline > 0:
        parser.error(f"--deadline must be a number of seconds > 0, got {args.deadline}")
    try:
        ws = WeightSet.of(weights)
    except (OSError, ValueError, TypeError) as exc:  # bad input, not bad usage: one line, no usage text, exit 2
        why = str(exc).removeprefix("check_consumer: ").removeprefix(f"{args.weights}: ")  # named once
        print(f"{parser.prog}: --weights {args.weights!r}: {why}", file=sys.stderr)
        return 2
    print(f"consumer: {args.consumer}\nweights: {ws.describe()}", flush=True)
    start = time.perf_counter()
    if args.replay:
        try:
            case = StreamCase.from_json(args.replay)
        except (ValueError, TypeError) as exc:
            parser.error(f"--replay: not a stream case: {exc}")
        try:
            check_consumer(consume, weights, replay=case)
        except ConsumerCheckError as exc:
            print(f"\nFAILED: {exc}")
            return 1
        print(f"replayed: {case.describe(ws.ring(case), ws.largest)}\npassed: bit-exact, no error, no retention")
        return 0
    progress = None if args.quiet else ProgressLine(noun="examples")
    if args.jobs <= 1:
        try:
            result = check_consumer(consume, weights, examples=args.examples, seed=args.seed,
                                    deadline=args.deadline, progress=progress)
            done, failure = result.examples, None
        except ConsumerCheckError as exc:
            done, failure = exc.found_at or 1, str(exc)
    else:
        done, failure = _in_processes(args, progress)
    elapsed = time.perf_counter() - start
    rate = f", {_rate(done, elapsed)} examples/s" if done and elapsed > 0 else ""
    print(f"examples: {done} (seed {args.seed}, {args.jobs} job(s), {elapsed:.1f} s{rate})")
    if failure is not None:
        print(f"\nFAILED: {failure}")
        return 1
    print("passed: every example bit-exact unsanitized, sanitized and against the owned oracle; "
          "no error, no retention")
    return 0


def _rate(done: int, elapsed: float) -> str:
    """Examples per second, with the digits that say something: 12, 3.4, 0.14 (never 0 for a slow run)."""
    rate = done / elapsed
    return f"{rate:.0f}" if rate >= 10 else f"{rate:.2g}"


def _batch_seed(seed: int, index: int) -> int:
    return zlib.crc32(f"{seed}:{index}".encode())


def _in_processes(args: argparse.Namespace, progress: Optional[ProgressLine]) -> "tuple[int, Optional[str]]":
    """Batches of 10 to 50 examples, each a hypothesis search of its own seed (a search of one example at a
    time would start each from the same simplest case; one search per job would keep a failure waiting for
    the other jobs' whole share). Progress comes from the workers' ticks, example by example."""
    stop_at = None if args.deadline is None else time.time() + args.deadline
    jobs = min(args.jobs, args.examples)
    size = max(10, min(50, args.examples // (jobs * 4)))
    share = [min(size, args.examples - start) for start in range(0, args.examples, size)]
    calls = [(args.consumer, args.weights, n, _batch_seed(args.seed, i), stop_at) for i, n in enumerate(share)]
    state = {"done": 0, "failures": 0}

    def ticked(n: int) -> None:
        state["done"] += n
        if progress is not None:
            progress(min(state["done"], args.examples), args.examples, state["failures"])

    done, failure = 0, None
    results = in_processes(check_batch, calls, jobs, on_tick=ticked)
    try:
        for part in results:
            done += part["examples"]
            if part["failure"] is not None:
                failure = _in_all(part, args.examples)
                state["failures"] = 1
                break  # no other batch starts; those running end their example (their ticks still count)
    finally:
        results.close()
    # One total across the workers: every example run, in every batch (the results count the batches that
    # came back; the ticks, each example as it ended, the other workers' unfinished batches too). The
    # workers' ticks travel apart from their results: the last ones can still be on their way when the
    # last result is in, so the larger count is the true one, and the progress line ends at it.
    done = max(done, state["done"])
    if progress is not None:
        state["done"] = done
        getattr(progress, "end", progress)(min(done, args.examples), args.examples, state["failures"])
    return done, failure


def _in_all(part: Dict[str, Any], asked: int) -> str:
    """A batch's failure, its example numbered within the batch said so (not read as the run's count)."""
    at, size = part.get("found_at"), part.get("batch")
    if not at or not size:
        return part["failure"]
    return part["failure"].replace(f"(example {at} of {size} failed first;",
                                   f"(example {at} of a worker's batch of {size}, of {asked} asked, failed first;", 1)


_WEIGHTS: Dict[str, Any] = {}  # in a worker: the weights, read once for all the batches it runs


def check_batch(spec: str, weights: str, examples: int, seed: int, stop_at: Optional[float]) -> Dict[str, Any]:
    """One search in a worker process: ``{"examples": run, "failure": its text or None}``."""
    from sanitizer.testing.consumer_check import ConsumerCheckError, check_consumer, load_consumer
    from sanitizer.testing.weights import WeightSet

    deadline = None if stop_at is None else stop_at - time.time()
    if deadline is not None and deadline <= 0:
        return {"examples": 0, "failure": None}
    if weights not in _WEIGHTS:
        _WEIGHTS[weights] = WeightSet.of(_weights_arg(weights))
    try:
        result = check_consumer(load_consumer(spec), _WEIGHTS[weights], examples=examples, seed=seed,
                                deadline=deadline, progress=lambda done, total, failures: tick())
    except ConsumerCheckError as exc:
        return {"examples": exc.found_at or 1, "failure": str(exc), "found_at": exc.found_at, "batch": examples}
    return {"examples": result.examples, "failure": None}


__all__: List[str] = ["add_arguments", "run", "check_batch"]
