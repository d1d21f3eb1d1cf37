"""``ownsan fuzz --consumer MODULE:FUNCTION --weights PATH``, the ``borrowed_weights`` fixture, and the shipped
examples (run as a user runs them: plain pytest in a subprocess)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("hypothesis")
safetensors_torch = pytest.importorskip("safetensors.torch")

import torch  # noqa: E402

from conftest import ROOT  # noqa: E402
from sanitizer.testing import fuzz  # noqa: E402
from sanitizer.tools import cli  # noqa: E402

HERE = os.path.relpath(os.path.abspath(__file__), ROOT)
pytest_plugins = ["pytester"]


def copies(weights):
    return {name: t.clone() for name, t in weights}


def keeps(weights):
    return dict(weights)


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(2)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({f"layers.{i}.w{j}": torch.randn(16, 16, generator=g) for i in range(2)
                                 for j in range(3)}, str(path))
    return str(path)


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # specs by path are relative to the working directory, as in a shell


def test_a_correct_consumer_passes_with_counts_and_progress(checkpoint, in_root, capsys):
    assert fuzz.main(["--consumer", f"{HERE}:copies", "--weights", checkpoint, "--examples", "6"]) == 0
    out, err = capsys.readouterr()
    assert f"consumer: {HERE}:copies" in out and "weights: " in out and "(6 tensors, 6.0 KiB)" in out
    assert re.search(r"examples: 6 \(seed 0, 1 job\(s\), [\d.]+ s, [\d.]+ examples/s\)", out), out
    assert "passed: every example bit-exact" in out
    assert "fuzz: 6/6 examples, 0 failures" in err and "fuzz:" not in out


@pytest.mark.slow
def test_a_retaining_consumer_fails_with_the_message_and_a_replay_line_that_reruns_it(checkpoint, in_root, capsys):
    assert cli.main(["fuzz", "--consumer", f"{HERE}:keeps", "--weights", checkpoint, "--examples", "6",
                     "-q"]) == 1
    out, err = capsys.readouterr()
    assert err == "" and "FAILED: check_consumer(keeps): keeps keeps borrowed weights past their lifetime" in out
    assert "the value keeps() returned" in out and "fix: " in out
    line = next(l for l in out.splitlines() if l.strip().startswith("or: ownsan fuzz --consumer"))
    replay = re.search(r"--replay '(.*)'$", line).group(1)
    assert f"--consumer {HERE}:keeps --weights {checkpoint}" in line
    assert fuzz.main(["--consumer", f"{HERE}:keeps", "--weights", checkpoint, "--replay", replay]) == 1
    assert "FAILED: " in capsys.readouterr().out
    assert fuzz.main(["--consumer", f"{HERE}:copies", "--weights", checkpoint, "--replay", replay]) == 0
    assert "passed: bit-exact" in capsys.readouterr().out


@pytest.mark.slow  # two spawned workers import torch: ~10 s here
def test_jobs_share_the_examples_and_stop_at_a_failure(checkpoint, in_root, capsys):
    assert fuzz.main(["--consumer", f"{HERE}:copies", "--weights", checkpoint, "--examples", "20", "-j", "2"]) == 0
    out, err = capsys.readouterr()
    assert "examples: 20 (seed 0, 2 job(s)" in out and "fuzz: 20/20 examples, 0 failures" in err
    assert fuzz.main(["--consumer", f"{HERE}:keeps", "--weights", checkpoint, "--examples", "20", "-j", "2"]) == 1
    assert "FAILED: check_consumer(keeps)" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [
    (["--consumer", "no_colon", "--weights", "{ckpt}"], "--consumer 'no_colon' is not MODULE:FUNCTION"),
    (["--consumer", "no_such_module_x:f", "--weights", "{ckpt}"], "cannot import 'no_such_module_x'"),
    (["--consumer", f"{HERE}:nothing_here", "--weights", "{ckpt}"], "has no attribute 'nothing_here'"),
    (["--consumer", f"{HERE}:HERE", "--weights", "{ckpt}"], "'HERE' is a str, not a function"),
    (["--consumer", "tests/no_such_file.py:f", "--weights", "{ckpt}"], "no file 'tests/no_such_file.py'"),
    (["--consumer", f"{HERE}:copies", "--weights", "/no/such/weights"], "--weights '/no/such/weights': no such file"),
    (["--consumer", f"{HERE}:copies"], "needs --weights DIR_OR_FILE"),
    (["--weights", "{ckpt}"], "--weights goes with --consumer"),
    (["--consumer", f"{HERE}:copies", "--weights", "{ckpt}", "--replay", '{"order": 1}'],
     "--replay: not a stream case: field 'order'"),
    (["--consumer", f"{HERE}:copies", "--weights", "{ckpt}", "--examples", "0"], "must be >= 1"),
])
def test_bad_arguments_are_usage_errors_naming_the_value(args, named, checkpoint, in_root, capsys):
    assert cli.main(["fuzz", *[a.replace("{ckpt}", checkpoint) for a in args]]) == 2
    err = capsys.readouterr().err
    assert named in err and "usage: ownsan fuzz" in err and "Traceback" not in err, err


@pytest.mark.parametrize("spec, meant", [
    (f"{HERE}:copeis", f"{HERE}:copies"),
    (f"{HERE}:zzzqqxw", None),
    ("tests/tools/test_check_consumer_clii.py:copies", "tests/tools/test_check_consumer_cli.py"),
])
def test_a_consumer_name_that_does_not_resolve_gets_the_closest_one(spec, meant, checkpoint, in_root, capsys):
    assert cli.main(["fuzz", "--consumer", spec, "--weights", checkpoint]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and repr(spec) in errors[0], errors
    if meant is None:
        assert "did you mean" not in errors[0]
    else:
        assert f"(did you mean {meant!r}?)" in errors[0], errors


def test_a_missing_module_gets_the_closest_module_and_a_function_the_closest_function(tmp_path, monkeypatch):
    from sanitizer.testing.consumer_check import load_consumer

    pkg = tmp_path / "ownsan_hint_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "loaders.py").write_text("def load_weights(w):\n    pass\nclass Loader:\n    def load(self, w):\n"
                                    "        pass\nload_wieghts_count = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {"ownsan_hint_pkg.loaderz:load_weights": "ownsan_hint_pkg.loaders",
             "ownsan_hint_pk.loaders:load_weights": "ownsan_hint_pkg",
             "ownsan_hint_pkg.loaders:load_wieghts": "ownsan_hint_pkg.loaders:load_weights",  # not the int
             "ownsan_hint_pkg.loaders:Loader.lod": "ownsan_hint_pkg.loaders:Loader.load",
             "ownsan_hint_pkg.loaders:Loadr.load": "ownsan_hint_pkg.loaders:Loader"}
    for spec, meant in cases.items():
        with pytest.raises(ValueError) as err:
            load_consumer(spec)
        assert f"(did you mean {meant!r}?)" in str(err.value), (spec, str(err.value))
    # A module that exists but fails on an import of its own is not called missing.
    (pkg / "broken.py").write_text("import ownsan_no_such_dependency\n")
    with pytest.raises(ValueError, match="ModuleNotFoundError.*ownsan_no_such_dependency") as err:
        load_consumer("ownsan_hint_pkg.broken:f")
    assert "did you mean" not in str(err.value)


def test_the_campaign_keeps_its_flags(capsys):
    assert fuzz.main(["--examples", "2", "--seed", "3", "-q"]) == 0
    assert "cases: 2 (seed 3" in capsys.readouterr().out


FIXTURE_SUITE = '''
import pytest
import sanitizer
import torch
from sanitizer.testing import StreamCase

WEIGHTS = {f"layers.{i}.w": torch.full((64,), float(i)) for i in range(4)}
KEPT = []

def test_borrowed_views_in_the_given_order(borrowed_weights):
    got = [(n, float(t[0]), sanitizer.is_borrowed(t)) for n, t in borrowed_weights(WEIGHTS, order="sorted")]
    assert got == [(f"layers.{i}.w", float(i), True) for i in range(4)]

def test_a_stream_left_open_is_closed_after_the_test(borrowed_weights):
    it = borrowed_weights(WEIGHTS, StreamCase(ring_fraction=1.0))
    KEPT.append(next(it)[1])

def test_closed_then(borrowed_weights):
    lease = sanitizer.lease_of(KEPT[0])
    assert lease is not None and lease.stale_by is not None

@pytest.mark.ownership_sanitize
def test_the_runs_options_apply(borrowed_weights):
    kept = [t for _, t in borrowed_weights(WEIGHTS)]  # the ring of one tensor reuses each: read stale below
    float(kept[0].sum())
'''


@pytest.mark.slow
def test_the_borrowed_weights_fixture_hands_out_borrowed_iterators_closed_after_the_test(pytester):
    pytester.makepyfile(test_fixture_suite=FIXTURE_SUITE)
    pytester._monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester._monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    for key in [k for k in os.environ if k.startswith("OWNERSHIP_SANITIZE")]:
        pytester._monkeypatch.delenv(key, raising=False)
    result = pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
                                           "--ownership-report-dir", str(pytester.path / "reports"))
    result.assert_outcomes(passed=3, failed=1)
    text = result.stdout.str()
    assert "test_the_runs_options_apply" in text and "stale_use" in text


def _run_example(name: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"examples/{name}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name, failing, passing, holder", [
    ("test_load_weights_ownership.py", "test_retaining_load_weights_is_caught",
     ["test_owning_load_weights_passes", "test_a_property_of_your_own"], "local 'parts' of _load()"),
    ("test_deferred_loader_ownership.py", "test_deferred_loader_without_ownership_is_caught",
     ["test_deferred_loader_with_own_arguments_passes"], "LayerwiseLoader.pending["),
])
def test_the_shipped_examples_catch_the_retaining_loader_and_pass_its_fix(name, failing, passing, holder):
    proc = _run_example(name)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr  # pytest: some tests failed
    assert f"FAILED examples/{name}::{failing}" in out
    assert f"1 failed, {len(passing)} passed" in out
    assert "RetainedBorrowError" in out and "keeps borrowed weights past their lifetime" in out
    assert holder in out and "fix: own the tensor where" in out and "replay: check_consumer(" in out
    for test in passing:
        assert f"FAILED examples/{name}::{test}" not in out


def _examples_line(out: str) -> "tuple[int, float, float]":
    m = re.search(r"^examples: (\d+) \(seed \d+, \d+ job\(s\), ([\d.]+) s, ([\d.]+) examples/s\)$", out, re.M)
    assert m, out
    return int(m.group(1)), float(m.group(2)), float(m.group(3))


@pytest.mark.slow  # two spawned workers import torch: ~10 s here
def test_a_failing_run_over_jobs_gives_one_count_and_its_rate(checkpoint, in_root, capsys):
    """Once: the progress line and the examples line gave two different counts, the failure a third
    ("example 1 of 12"), and the rate of a run that took seconds read "0 examples/s"."""
    assert fuzz.main(["--consumer", f"{HERE}:keeps", "--weights", checkpoint, "--examples", "20", "-j", "2"]) == 1
    out, err = capsys.readouterr()
    done, seconds, rate = _examples_line(out)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"fuzz: {done}/20 examples, 1 failure,"), (last, done)
    assert rate > 0 and abs(rate - done / seconds) <= 0.1 * done / seconds + 0.05, (done, seconds, rate)
    at = re.search(r"\(example (\d+) of (.*?) failed first", out)
    assert at and at.group(2).startswith("a worker's batch of") and "of 20 asked" in at.group(2), out


def test_a_failure_over_jobs_counts_every_workers_examples(monkeypatch):
    """The failing batch's result counts its examples to the failure; the ticks, the other workers'
    examples too: the run's count is the larger, the progress line ends at it (below a tenth too)."""
    import argparse
    import io

    from sanitizer.testing import consumer_cli
    from sanitizer.testing.progress import ProgressLine

    class _Results(list):
        def close(self) -> None:
            pass

    batch = []

    def failing(fn, calls, jobs, on_tick=None):
        on_tick(2)  # the failing batch's two examples ...
        on_tick(3)  # ... and three of the other worker's
        batch.append(calls[0][2])
        text = f"check_consumer(f): ... minimal case (example 2 of {batch[0]} failed first; hypothesis shrank it)"
        return _Results([{"examples": 2, "failure": text, "found_at": 2, "batch": batch[0]}])

    monkeypatch.setattr(consumer_cli, "in_processes", failing)
    args = argparse.Namespace(deadline=None, jobs=2, examples=100, consumer="m:f", weights="w", seed=0)
    err = io.StringIO()
    done, failure = consumer_cli._in_processes(args, ProgressLine(err, noun="examples"))
    assert done == 5
    assert err.getvalue().splitlines()[-1].startswith("fuzz: 5/100 examples, 1 failure")
    assert f"(example 2 of a worker's batch of {batch[0]}, of 100 asked, failed first;" in failure


@pytest.mark.parametrize("done, seconds", [(1, 7.2), (3, 11.5), (6, 2.0), (400, 3.0)])
def test_the_rate_never_reads_zero_and_says_what_it_is(done, seconds):
    from sanitizer.testing.consumer_cli import _rate

    shown = float(_rate(done, seconds))
    assert shown > 0 and abs(shown - done / seconds) <= 0.05 * done / seconds + 0.5 * (done / seconds >= 10)


def test_the_campaign_ends_with_its_verdict_as_its_exit_status(monkeypatch, capsys):
    """It ended with counts only: the last line is now passed or FAILED, as the exit status."""
    assert fuzz.main(["--examples", "2", "--seed", "5", "-q"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "passed"
    real = fuzz.campaign

    def with_a_failure(examples, seed, jobs=1, progress=None):
        counts = real(examples, seed, jobs, progress)
        counts["failures"].append({"index": 0, "case": fuzz.case_for(seed, 0).to_json(), "violations": ["(test)"]})
        return counts

    monkeypatch.setattr(fuzz, "campaign", with_a_failure)
    assert fuzz.main(["--examples", "1", "--seed", "5", "-q", "--no-shrink"]) == 1
    out = capsys.readouterr().out
    assert "FAILED case 0 of seed 5: (test)" in out and out.rstrip().splitlines()[-1] == "FAILED"


def test_progress_ends_at_the_results_count_when_the_last_ticks_are_still_on_their_way(monkeypatch):
    """With -j N the workers' ticks travel apart from their results: a run whose last ticks had not
    arrived ended its progress at 19/20 (seen in CI). The last line is the results' count."""
    import argparse
    import io

    from sanitizer.testing import consumer_cli
    from sanitizer.testing.progress import ProgressLine

    class _Results(list):
        def close(self) -> None:
            pass

    def no_ticks(fn, calls, jobs, on_tick=None):  # every result in, only one tick of 3 examples arrived
        on_tick(3)
        return _Results({"examples": call[2], "failure": None} for call in calls)

    monkeypatch.setattr(consumer_cli, "in_processes", no_ticks)
    args = argparse.Namespace(deadline=None, jobs=2, examples=20, consumer="m:f", weights="w", seed=0)
    err = io.StringIO()
    done, failure = consumer_cli._in_processes(args, ProgressLine(err, noun="examples"))
    assert (done, failure) == (20, None)
    assert err.getvalue().splitlines()[-1].startswith("fuzz: 20/20 examples, 0 failures")
