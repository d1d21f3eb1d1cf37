"""The serial/parallel choice for large CPU hashes: measured costs decide, probes keep them current."""

from __future__ import annotations

import threading

import pytest

from cuda_hooks.kernel_choice import MAX_PROBE_INTERVAL, MIN_PROBE_INTERVAL, PARALLEL, SERIAL, KernelChoice

FAST, SLOW, STALL = 1e-11, 2e-11, 1e-9  # seconds per byte


def _run(choice: KernelChoice, cost: dict[str, float], calls: int) -> list[str]:
    """``calls`` picks, each recorded at ``cost[kernel]``; the kernels that ran."""
    ran = []
    for _ in range(calls):
        kernel, probe = choice.pick()
        choice.record(kernel, cost[kernel], probe)
        ran.append(kernel)
    return ran


def test_each_kernel_is_measured_once_then_the_cheaper_runs() -> None:
    choice = KernelChoice()
    assert _run(choice, {PARALLEL: FAST, SERIAL: SLOW}, 2) == [PARALLEL, SERIAL]
    assert _run(choice, {PARALLEL: FAST, SERIAL: SLOW}, MIN_PROBE_INTERVAL) == [PARALLEL] * MIN_PROBE_INTERVAL
    other = KernelChoice()
    assert _run(other, {PARALLEL: STALL, SERIAL: SLOW}, 2 + MIN_PROBE_INTERVAL) == [PARALLEL] + [SERIAL] * (
        1 + MIN_PROBE_INTERVAL)


def test_one_stalled_call_does_not_flip_the_choice_but_a_lasting_slowdown_does() -> None:
    choice = KernelChoice()
    _run(choice, {PARALLEL: FAST, SERIAL: SLOW}, 2 + 2)  # parallel measured three times
    kernel, probe = choice.pick()
    assert (kernel, probe) == (PARALLEL, False)
    choice.record(PARALLEL, STALL, probe)  # one stall among three samples: the median is still fast
    assert _next_regular_pick(choice) == PARALLEL
    choice.record(PARALLEL, STALL, False)  # two of three: the machine got busy
    assert choice.estimate(PARALLEL) == STALL
    assert _next_regular_pick(choice) == SERIAL


def _next_regular_pick(choice: KernelChoice) -> str:
    """The kernel of the next pick that is not a probe (a probe due now is recorded as a stall-free call)."""
    while True:
        kernel, probe = choice.pick()
        if not probe:
            return kernel
        choice.record(kernel, choice.estimate(kernel), probe)


def test_probes_come_less_often_while_they_confirm_the_choice() -> None:
    choice = KernelChoice()
    ran = _run(choice, {PARALLEL: FAST, SERIAL: SLOW}, 2 + 400)[2:]
    probes = [i for i, kernel in enumerate(ran) if kernel == SERIAL]
    gaps = [b - a - 1 for a, b in zip([-1] + probes, probes)]
    want, interval = [], MIN_PROBE_INTERVAL
    for _ in gaps:
        want.append(interval)
        interval = min(2 * interval, MAX_PROBE_INTERVAL)
    assert gaps == want
    assert gaps[-1] == MAX_PROBE_INTERVAL


def test_a_probe_that_changes_the_choice_restarts_the_short_interval() -> None:
    choice = KernelChoice()
    _run(choice, {PARALLEL: STALL, SERIAL: SLOW}, 2 + 200)  # busy machine: serial, rare parallel probes
    assert choice.pick()[0] == SERIAL
    quiet = {PARALLEL: FAST, SERIAL: SLOW}
    ran = _run(choice, quiet, 2 * MAX_PROBE_INTERVAL + 4)
    first_fast = ran.index(PARALLEL)  # the next parallel probe sees a quiet machine; one sample does not flip
    assert ran[first_fast + 1:].count(PARALLEL) > 0
    assert ran[-MIN_PROBE_INTERVAL:] == [PARALLEL] * MIN_PROBE_INTERVAL  # back to parallel
    assert choice.estimate(PARALLEL) == FAST


def test_runs_are_counted_and_a_wrong_kernel_name_is_refused() -> None:
    choice = KernelChoice()
    _run(choice, {PARALLEL: FAST, SERIAL: SLOW}, 10)
    assert choice.runs[PARALLEL] + choice.runs[SERIAL] == 10
    with pytest.raises(ValueError, match="'gpu'"):
        choice.record("gpu", FAST, False)


def test_concurrent_hashing_threads_share_one_choice() -> None:
    choice = KernelChoice()
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            _run(choice, {PARALLEL: FAST, SERIAL: SLOW}, 500)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert choice.runs[PARALLEL] + choice.runs[SERIAL] == 2000
    assert choice.runs[PARALLEL] > 0.9 * 2000
