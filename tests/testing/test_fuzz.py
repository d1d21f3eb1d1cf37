"""The bounded fuzz campaign (``pytest -m fuzz``): no miss, no false alarm, exact when owned or rescued.

Derandomized hypothesis over generated checkpoints, stream orders, ring sizes,
lifetimes, debug options and consumers (see sanitizer/fuzz.py). A failure
prints the minimal case hypothesis found and the ``ownsan fuzz --replay`` line
that reruns it. The long campaign is ``ownsan fuzz --examples N --seed S -j J``.
"""
from __future__ import annotations

import dataclasses
import gc
import os

import pytest

pytest.importorskip("safetensors")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from sanitizer.testing import fuzz  # noqa: E402

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("OWNSAN_FUZZ_EXAMPLES", "200"))  # about 10 ms a case (gc frozen per case)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, print_blob=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=fuzz.case_strategy())
def test_no_miss_no_false_alarm_bit_exact_when_owned_or_rescued(case):
    out = fuzz.run_case(case)
    bad = fuzz.violations(case, out)
    assert not bad, "\n".join(bad + [f"outcome: {out}", f"replay: ownsan fuzz --replay '{case.to_json()}'"])


def _case(consumer: str, **kw) -> fuzz.Case:
    """Two layers of four tensors streamed name-sorted through the smallest ring: a layer never fits."""
    layers = tuple(tuple((f"w{j}", (8, 8), dt) for j, dt in enumerate(("fp32", "bf16", "int8", "fp32")))
                   for _ in range(2))
    base = dict(layers=layers, files=2, order="sorted", ring_fraction=0.0, lifetime=None, consumer=consumer,
                debug="generations", seed=3)
    base.update(kw)
    return fuzz.Case(**base)


@pytest.mark.parametrize("stream", fuzz.STREAMS)
@pytest.mark.parametrize("consumer", fuzz.RETAINING)
def test_every_retaining_consumer_corrupts_unsanitized_and_is_detected(consumer, stream):
    case = _case(consumer, stream=stream)
    out = fuzz.run_case(case)
    assert out.corrupted, "the oracle must see the corruption this case is built to cause"
    assert out.errors > 0 and out.rescue_exact is True
    assert fuzz.violations(case, out) == []


@pytest.mark.parametrize("stream", fuzz.STREAMS)
@pytest.mark.parametrize("consumer", fuzz.CORRECT)
@pytest.mark.parametrize("debug", fuzz.DEBUG)
def test_every_correct_consumer_is_clean_and_exact(consumer, debug, stream):
    case = _case(consumer, debug=debug, lifetime=1, stream=stream)
    out = fuzz.run_case(case)
    assert (out.corrupted, out.errors, out.sanitized_exact) == (False, 0, True)


def test_violations_name_each_property():
    case = _case("list")
    assert "(a) miss" in fuzz.violations(case, fuzz.Outcome(True, 0, False, True))[0]
    assert "(c) rescue" in fuzz.violations(case, fuzz.Outcome(True, 3, False, False))[0]
    assert "(b) false alarm" in fuzz.violations(_case("copy"), fuzz.Outcome(False, 1, True, None))[0]
    assert fuzz.violations(case, fuzz.Outcome(True, 2, False, True)) == []


def test_shrink_finds_a_minimal_failing_case(monkeypatch):
    # a stand-in failure: any case with an fp32 tensor "misses"
    def fake_run(case):
        has_fp32 = any(dt == "fp32" for layer in case.layers for _, _, dt in layer)
        return fuzz.Outcome(has_fp32, 0, not has_fp32, None)

    monkeypatch.setattr(fuzz, "run_case", fake_run)
    small = fuzz.shrink(_case("copy", lifetime=2, debug="checksum+poison", stream="borrowed"))
    assert len(small.layers) == 1 and len(small.layers[0]) == 1 and small.layers[0][0][1:] == ((1,), "fp32")
    assert (small.files, small.lifetime, small.debug, small.order, small.stream) == (
        1, None, "generations", "grouped", "emulated")


def test_cli_prints_counts_and_replays(capsys):
    assert fuzz.main(["--examples", "3", "--seed", "11"]) == 0
    text = capsys.readouterr().out
    for label in ("cases: 3", "unguarded corruptions seen:", "detected:", "false alarms: 0", "misses: 0"):
        assert label in text
    case = fuzz.case_for(11, 0)
    assert fuzz.main(["--replay", case.to_json()]) == 0
    assert '"violations": []' in capsys.readouterr().out
    assert fuzz.Case.from_json(case.to_json()) == case


@pytest.mark.slow
def test_campaign_runs_over_processes_with_the_same_cases():
    one = fuzz.campaign(2, seed=5, jobs=1)
    two = fuzz.campaign(2, seed=5, jobs=2)
    strip = lambda c: {k: v for k, v in c.items() if k != "failures"}  # noqa: E731
    assert strip(one) == strip(two) and one["cases"] == 2 and two["failures"] == []


def test_random_cases_cover_the_space():
    cases = [fuzz.case_for(0, i) for i in range(300)]
    assert {c.consumer for c in cases} == set(fuzz.CONSUMERS)
    assert {c.order for c in cases} == set(fuzz.ORDERS)
    assert {dt for c in cases for layer in c.layers for _, _, dt in layer} == set(fuzz.DTYPES)
    assert {c.files for c in cases} == {1, 2, 3} and {c.lifetime for c in cases} == {None, 1, 2, 3}
    assert {c.stream for c in cases} == set(fuzz.STREAMS)
    assert dataclasses.replace(cases[0]) == cases[0]


def test_run_case_freezes_the_heap_only_for_its_own_duration():
    case = _case("list")
    assert gc.get_freeze_count() == 0
    fuzz.run_case(case)
    assert gc.get_freeze_count() == 0  # unfrozen again: the caller's heap is collected as before
    gc.freeze()
    try:
        assert fuzz.run_case(case).errors > 0
        assert gc.get_freeze_count() > 0  # a caller's own freeze is left alone
    finally:
        gc.unfreeze()


def test_cases_stay_independent_of_the_records_cap_and_leave_no_records():
    import sanitizer
    from sanitizer.torch_layer import records

    before = len(records.events())
    options = {"max_records": 2} if "max_records" in sanitizer.options() else {}
    case = _case("dict")
    with sanitizer.sanitize(**options):
        sanitizer.disable()
        outs = [fuzz.run_case(case) for _ in range(3)]
    assert all(o.errors > 2 for o in outs)  # every error counted, not only the records kept
    assert len({o.errors for o in outs}) == 1  # the same case, the same count: nothing carried over
    assert len(records.events()) - before <= 1  # at most the one aggregated clone record
