"""The pytest plugin, run on a small suite with pytester (in a subprocess: its own sanitizer state)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

pytest_plugins = ["pytester"]

SUITE = '''
import pytest
import torch

KEPT = []

def load(ring, n):
    for i in range(n):
        yield f"layers.{i}.weight", ring.put(f"layers.{i}.weight", torch.full((64, 64), float(i)))

@MARK
def test_retaining_consumer(staging_ring):
    for name, w in load(staging_ring, 80):
        KEPT.append(w)  # keeps borrowed views past the ring's reuse
    total = sum(float(k.sum()) for k in KEPT)

@MARK
def test_correct_consumer(staging_ring, ownership_report):
    acc = torch.zeros(64, 64)
    for name, w in load(staging_ring, 80):
        acc += w
    assert float(acc[0, 0]) == sum(range(80))
    assert ownership_report.errors == [] and ownership_report.retentions == []

@MARK
def test_report_fixture_sees_this_test_only(staging_ring, ownership_report):
    keep = [w for _, w in load(staging_ring, 80)]
    assert ownership_report.errors == []  # retained, but never read stale
    assert len(ownership_report.report(final=True)["events"]) > 0
    assert "retention" in ownership_report.line
    keep.clear()
'''


def _run(pytester, mark: str, *args: str):
    pytester.makepyfile(test_suite=SUITE.replace("@MARK", mark))
    pytester._monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester._monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # load ours by name, once
    for key in ("OWNERSHIP_SANITIZE", "OWNERSHIP_SANITIZE_OPTIONS"):
        pytester._monkeypatch.delenv(key, raising=False)
    return pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
                                         "--ownership-report-dir", str(pytester.path / "reports"), *args)


@pytest.mark.slow
def test_flag_fails_the_retaining_consumer_and_passes_the_correct_one(pytester):
    result = _run(pytester, "# (no marker)", "--ownership-sanitize")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*test_retaining_consumer*",
        "*ownership-sanitizer: * errors (* stale_use); * retentions by 1 consumer*top: test_suite.KEPT[[]*[]]*",
        "*report: */reports/test_suite.py_test_retaining_consumer.*.json*",
    ])
    (path,) = (pytester.path / "reports").glob("test_suite.py_test_retaining_consumer.*.json")  # .PID.json
    report = json.loads(path.read_text())
    assert path.name == f"test_suite.py_test_retaining_consumer.{report['pid']}.json"
    assert report["summary"]["retaining_consumers"][0]["consumer"] == "test_suite.KEPT[*]"
    triage = subprocess.run([sys.executable, "-m", "sanitizer", "triage", str(path)],
                            capture_output=True, text=True, env={"PYTHONPATH": ROOT, "PATH": ""}, timeout=120)
    assert triage.returncode == 1 and "test_suite.KEPT[*]" in triage.stdout  # its findings fail it


@pytest.mark.slow
def test_marker_alone_sanitizes_marked_tests_and_nothing_else(pytester):
    result = _run(pytester, "@pytest.mark.ownership_sanitize(stack_depth=4)")
    result.assert_outcomes(passed=2, failed=1)
    pytester.makepyfile(test_unmarked=SUITE.replace("@MARK", "# (no marker)").replace(
        "    assert ownership_report.errors == []  # retained, but never read stale\n"
        "    assert len(ownership_report.report(final=True)[\"events\"]) > 0\n"
        "    assert \"retention\" in ownership_report.line\n", ""))
    result = pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
                                           "test_unmarked.py")
    # off: the retaining consumer reads wrong bytes, silently; the report fixture refuses to pass vacuously
    result.assert_outcomes(passed=1, errors=2)
    result.stdout.fnmatch_lines(["*ERROR at setup of test_correct_consumer*",
                                 "*the ownership_report fixture needs a sanitized test: mark it "
                                 "@pytest.mark.ownership_sanitize or run pytest --ownership-sanitize*"])


@pytest.mark.slow
def test_bad_marker_option_is_a_usage_error(pytester):
    result = _run(pytester, "@pytest.mark.ownership_sanitize(bogus=1)", "-k", "correct")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*@pytest.mark.ownership_sanitize: unknown option 'bogus'; valid options:*"])
    result = _run(pytester, "# (no marker)", "--ownership-sanitize", "--ownership-sanitize-options", "bogus=1")
    assert result.ret == 4  # pytest's usage-error status
    result.stderr.fnmatch_lines(["*--ownership-sanitize-options: unknown option 'bogus'*"])


@pytest.mark.slow
def test_loading_the_plugin_enables_nothing_and_imports_no_numba():
    from conftest import run_python

    out = run_python("import sys, sanitizer.tools.pytest_plugin, sanitizer\n"
                     "import sanitizer.torch_layer.hooks as h\n"
                     "print(sanitizer.enabled(), 'numba' in sys.modules, len(h.HOOKS.retire) + len(h.HOOKS.lend))")
    assert out.returncode == 0, out.stderr
    enabled, numba, hooks = out.stdout.split()
    assert enabled == "False" and numba == "False" and hooks == "0"  # nothing composed before an enable


FAILING = '''
import pytest
import torch

KEPT = []

def load(ring, n):
    for i in range(n):
        yield f"layers.{i}.weight", ring.put(f"layers.{i}.weight", torch.full((64, 64), float(i)))

@pytest.mark.ownership_sanitize
def test_own_assertion_fails(staging_ring):
    for name, w in load(staging_ring, 80):
        KEPT.append(w)
    total = sum(float(k.sum()) for k in KEPT)
    assert total == -1.0, "the test's own assertion"

@pytest.mark.ownership_sanitize
def test_plain_failure_without_findings(staging_ring):
    acc = torch.zeros(64, 64)
    for name, w in load(staging_ring, 10):
        acc += w
    assert float(acc[0, 0]) == -1.0

@pytest.mark.ownership_sanitize(triage=0)
def test_halting_error_traceback(staging_ring):
    kept = [w for _, w in load(staging_ring, 80)]
    kept[0].sum()
'''


@pytest.mark.slow
def test_every_failing_sanitized_test_gets_a_section_without_internal_frames(pytester):
    pytester.makepyfile(test_failing=FAILING)
    pytester._monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester._monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    for key in ("OWNERSHIP_SANITIZE", "OWNERSHIP_SANITIZE_OPTIONS"):
        pytester._monkeypatch.delenv(key, raising=False)
    result = pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
                                           "--ownership-report-dir", str(pytester.path / "reports"))
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    lines = FAILING.strip("\n").splitlines()
    read_line = 1 + next(i for i, line in enumerate(lines) if "total = sum(" in line)
    use_line = 1 + next(i for i, line in enumerate(lines) if "kept[0].sum()" in line)
    own = out[out.index("_ test_own_assertion_fails _"):out.index("_ test_plain_failure_without_findings _")]
    assert "the test's own assertion" in own  # its own failure first
    assert "- ownership-sanitizer -" in own  # then the sanitizer's section
    assert "retentions by 1 consumer" in own and "held by: test_failing.KEPT[*]" in own
    assert "read stale at " in own and f"test_failing.py:{read_line}" in own
    assert "report: " in own and "test_failing.py_test_own_assertion_fails." in own
    plain = out[out.index("_ test_plain_failure_without_findings _"):out.index("_ test_halting_error_traceback _")]
    assert "- ownership-sanitizer -" in plain and "0 errors; no retentions" in plain
    halting = out[out.index("_ test_halting_error_traceback _"):]
    halting = halting[:halting.index("- ownership-sanitizer -")]
    assert f"test_failing.py:{use_line}: StaleBorrowError" in halting  # the traceback ends at the user's line
    traceback = [line for line in halting.splitlines() if not line.startswith("E ")]
    for frame in ("sanitizer/torch_layer", "torch/_compile.py", "_dynamo", "pluggy", "_pytest"):
        assert not any(frame in line for line in traceback), (frame, traceback)
    used_at = halting[halting.rindex("used at (thread"):]  # the captured use site stops at the test, not in the harness
    assert "test_halting_error_traceback" in used_at and "pluggy" not in used_at and "_pytest" not in used_at
    lent_at = halting[halting.rindex("lent at (generation"):halting.rindex("used at (thread")]
    assert "test_failing.py" in lent_at and "pluggy" not in lent_at and "_pytest" not in lent_at  # every stack alike


SHARED = '''
import pytest
import torch

KEPT = []

@pytest.mark.ownership_sanitize
def test_keeps_views(staging_ring):
    for i in range(80):
        KEPT.append(staging_ring.put(f"layers.{i}.weight", torch.full((64, 64), float(i))))
    float(KEPT[0].sum())

def test_unsanitized():
    assert True
'''


def _session(pytester, *args: str):
    pytester._monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester._monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    for key in ("OWNERSHIP_SANITIZE", "OWNERSHIP_SANITIZE_OPTIONS"):
        pytester._monkeypatch.delenv(key, raising=False)
    return pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", *args)


@pytest.mark.slow
def test_a_report_dir_that_cannot_be_made_is_one_line_and_every_test_still_runs(pytester):
    """Issue 46, item 6: it ended the session with INTERNALERROR (exit 3, no results)."""
    pytester.makepyfile(test_shared=SHARED)
    (pytester.path / "a_file").write_text("not a directory\n")
    result = _session(pytester, "--ownership-report-dir", str(pytester.path / "a_file" / "reports"))
    assert result.ret == 1  # a test failed (the sanitizer's finding); not 3
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in out and "Traceback" not in out
    said = [line for line in out.splitlines() if "--ownership-report-dir" in line]
    assert len(said) == 1 and "cannot be used (Not a directory)" in said[0], said
    assert "reports went to " in said[0]
    went = said[0].split("reports went to ", 1)[1].strip()
    (report,) = pytester.path.joinpath(went).glob("test_shared.py_test_keeps_views.*.json")  # (the cache)
    result.stdout.fnmatch_lines([f"*report: {report}*"])


@pytest.mark.slow
def test_two_sessions_sharing_a_report_dir_keep_each_others_reports(pytester):
    """Issue 46, item 9: a test's report was DIR/<test>.json, so a second session (a parallel CI job, a
    second tox environment) overwrote the first one's. Each session's name has its pid."""
    pytester.makepyfile(test_shared=SHARED)
    reports = pytester.path / "reports"
    seen = []
    for _ in range(2):
        result = _session(pytester, "-p", "no:cacheprovider", "--ownership-report-dir", str(reports))
        result.assert_outcomes(passed=1, failed=1)
        (line,) = [l for l in result.stdout.lines if "report: " in l and "test_keeps_views" in l]
        seen.append(line.split("report: ", 1)[1].split(" ", 1)[0])
    assert seen[0] != seen[1]
    assert sorted(str(p) for p in reports.glob("test_shared.py_test_keeps_views.*.json")) == sorted(seen)
    pids = [json.loads(open(path).read())["pid"] for path in seen]
    assert len(set(pids)) == 2 and all(path.endswith(f".{pid}.json") for path, pid in zip(seen, pids))


# -- pytest conventions: ini keys, one `with` per test, header and summary lines ---------------------------

def _env(pytester) -> None:
    pytester._monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester._monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    for key in ("OWNERSHIP_SANITIZE", "OWNERSHIP_SANITIZE_OPTIONS"):
        pytester._monkeypatch.delenv(key, raising=False)


@pytest.mark.slow
def test_ini_keys_sanitize_every_test_and_say_so_in_the_header_and_the_summary(pytester):
    """ownership_sanitize and ownership_sanitize_options in [tool.pytest.ini_options] do what the flags do;
    the header says every test is sanitized, with which options, and the summary counts the findings."""
    pytester.makepyprojecttoml('[tool.pytest.ini_options]\nownership_sanitize = true\n'
                               'ownership_sanitize_options = "stack_depth=4"\n'
                               'ownership_report_dir = "ini_reports"\n')
    result = _run(pytester, "# (no marker)", "--ownership-report-dir", str(pytester.path / "reports"))
    result.assert_outcomes(passed=2, failed=1)  # as --ownership-sanitize: the retaining consumer fails
    result.stdout.fnmatch_lines([
        f"ownership-sanitizer: every test sanitized (options: triage=1, stack_depth=4); reports in "
        f"{pytester.path / 'reports'}",  # the command line's directory over the ini's
        "*ownership-sanitizer: 3 tests sanitized, 1 failed on ownership findings (* errors, * retentions, "
        "0 suppressed)",
    ])
    assert list((pytester.path / "reports").glob("*.json")) and not (pytester.path / "ini_reports").exists()
    # the ini's report directory, relative to the ini file's directory, when the command line names none
    result = pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
                                           "-k", "retaining")
    result.assert_outcomes(failed=1)
    assert list((pytester.path / "ini_reports").glob("test_suite.py_test_retaining_consumer.*.json"))


@pytest.mark.slow
def test_without_the_switch_the_header_says_marked_tests_only_and_nothing_is_counted(pytester):
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    _env(pytester)
    result = pytester.runpytest_subprocess("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["ownership-sanitizer: marked tests only (--ownership-sanitize for every test)"])
    assert "tests sanitized" not in result.stdout.str()  # no sanitized test, no summary line


@pytest.mark.slow
def test_a_bad_ini_value_is_a_usage_error_naming_the_key_and_the_value(pytester):
    pytester.makeini("[pytest]\nownership_sanitize_options = bogus=1\n")
    result = _run(pytester, "# (no marker)")
    assert result.ret == 4  # pytest's usage-error status, before any test runs
    result.stderr.fnmatch_lines(["*ini ownership_sanitize_options = 'bogus=1': unknown option 'bogus'*"])
    pytester.makeini("[pytest]\nownership_sanitize = maybe\n")
    result = _run(pytester, "# (no marker)")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*ini ownership_sanitize: *'maybe'*"])


SUPPRESSIONS = """\
# the suite keeps its views on purpose (as a team would, waiting on an upstream fix)
stale_use:test_suite.KEPT*
retention:test_suite.KEPT*
"""


@pytest.mark.slow
def test_ini_suppressions_file_lets_the_known_finding_through_and_the_summary_counts_it(pytester):
    """ownership_suppressions (relative to the ini file) becomes suppressions=ABSPATH for every sanitized
    test: the retaining consumer passes, and the summary line counts what was suppressed."""
    pytester.makeini("[pytest]\nownership_sanitize = true\nownership_suppressions = ci/ownsan.supp\n")
    (pytester.path / "ci").mkdir()
    (pytester.path / "ci" / "ownsan.supp").write_text(SUPPRESSIONS)
    result = _run(pytester, "# (no marker)", "-k", "retaining")
    result.assert_outcomes(passed=1)
    supp = pytester.path / "ci" / "ownsan.supp"
    result.stdout.fnmatch_lines([
        f"ownership-sanitizer: every test sanitized (options: triage=1, suppressions={supp}); reports in *",
        "ownership-sanitizer: 1 test sanitized, 0 failed on ownership findings (0 errors, 0 retentions, "
        "* suppressed)",
    ])
    suppressed = int(result.stdout.str().split("0 retentions, ", 1)[1].split(" suppressed", 1)[0])
    assert suppressed > 0  # each stale use and each retention of KEPT, counted, never failing
    # an explicit suppressions option wins over the ini key (here: a file with no rules: nothing suppressed)
    (pytester.path / "none.supp").write_text("# nothing\n")
    result = _run(pytester, "# (no marker)", "-k", "retaining",
                  "--ownership-sanitize-options", f"suppressions={pytester.path / 'none.supp'}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*1 test sanitized, 1 failed on ownership findings (* errors, * retentions, "
                                 "0 suppressed)"])


@pytest.mark.slow
def test_the_projects_tool_ownsan_suppressions_are_read_only_by_a_session_that_sanitizes(pytester):
    """``[tool.ownsan] suppressions`` (the file ownsan run reads too) lets a marked test's known finding
    through. A broken table fails only what is sanitized: a session with nothing sanitized never reads it
    (a project's audit settings must not stop its plain pytest runs), a marked test errs with one line,
    and --ownership-sanitize is a usage error before any test runs."""
    (pytester.path / "ci").mkdir()
    (pytester.path / "ci" / "ownsan.supp").write_text("stale_use:test_shared.KEPT*\nretention:test_shared.KEPT*\n")
    pytester.makepyfile(test_shared=SHARED)
    pytester.makepyprojecttoml('[tool.ownsan]\nsuppressions = "ci/ownsan.supp"\n')
    _session(pytester, "-p", "no:cacheprovider").assert_outcomes(passed=2)
    pytester.makepyprojecttoml('[tool.ownsan]\nsuppressions = 3\n')
    _session(pytester, "-p", "no:cacheprovider", "-k", "unsanitized").assert_outcomes(passed=1, deselected=1)
    result = _session(pytester, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)  # (in the marked test's setup, as a bad marker option)
    result.stdout.fnmatch_lines(["*suppressions must be a file name (a non-empty string), got 3*"])
    result = _session(pytester, "-p", "no:cacheprovider", "--ownership-sanitize")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*suppressions must be a file name*"])


@pytest.mark.slow
def test_the_command_line_wins_over_the_ini(pytester):
    """Options merge option by option (the command line's over the ini's); the switch turned off in the
    ini is turned on by the flag."""
    pytester.makeini("[pytest]\nownership_sanitize = false\n"
                     "ownership_sanitize_options = stack_depth=4:max_records=500\n")
    result = _run(pytester, "# (no marker)", "-k", "retaining", "--ownership-sanitize",
                  "--ownership-sanitize-options", "stack_depth=6")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["ownership-sanitizer: every test sanitized (options: triage=1, stack_depth=6, "
                                 "max_records=500); reports in *"])
    (path,) = (pytester.path / "reports").glob("test_suite.py_test_retaining_consumer.*.json")
    assert str(json.loads(path.read_text())["options"]["stack_depth"]) == "6"


@pytest.mark.slow
def test_without_the_plugin_its_flag_is_an_unknown_option(pytester):
    """`-p no:NAME` switches the plugin off entirely (pytest's own rule; installed, NAME is
    ownership_sanitizer, the pytest11 entry point): its options are then unknown to pytest."""
    pytester.makepyfile(test_plain="def test_plain():\n    pass\n")
    _env(pytester)
    result = pytester.runpytest_subprocess("-p", "no:sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
                                           "--ownership-sanitize")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*unrecognized arguments: --ownership-sanitize*"])


TEARDOWN = '''
import pytest
import sanitizer
import torch

@pytest.fixture
def kept_views(staging_ring):
    kept = []
    yield kept
    assert sanitizer.enabled()  # the test's scope is still entered while its fixtures tear down
    float(kept[0].sum())  # a stale read in the teardown: under triage=0 it raises here

@pytest.mark.ownership_sanitize(triage=0)
def test_keeps_views(staging_ring, kept_views):
    for i in range(80):
        kept_views.append(staging_ring.put(f"layers.{i}.weight", torch.full((64, 64), float(i))))

@pytest.mark.ownership_sanitize
def test_stops_the_session():
    pytest.exit("stopped in the test", returncode=3)

def pytest_sessionfinish(session):
    with open("enabled_at_end.txt", "w") as fh:
        fh.write(str(sanitizer.enabled()))
'''


@pytest.mark.slow
def test_one_with_per_test_fixtures_tear_down_sanitized_and_an_exit_leaves_the_scope(pytester):
    """Setup, call and teardown run in one `with sanitizer.sanitize()`: a fixture's teardown reading a stale
    view is caught, and the scope is left even when that teardown raises, or when a test ends the session
    (pytest.exit: pytest runs no teardown). Entered and left by hand in two hooks, the teardown hook never
    ran in either case, and the sanitizer stayed on for the rest of the session."""
    pytester.makepyfile(test_teardown=TEARDOWN.replace("def pytest_sessionfinish", "def _unused"))
    pytester.makeconftest("import sanitizer\n" + TEARDOWN[TEARDOWN.index("def pytest_sessionfinish"):])
    _env(pytester)
    run = ("-p", "sanitizer.tools.pytest_plugin", "-p", "no:cacheprovider",
           "--ownership-report-dir", str(pytester.path / "reports"))
    result = pytester.runpytest_subprocess(*run, "-k", "keeps_views")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_keeps_views*",  # the assert passed; the read:
                                 ">*float(kept[[]0[]].sum())*",
                                 "E*StaleBorrowError: borrowed view 'layers.0.weight'*"])
    assert (pytester.path / "enabled_at_end.txt").read_text() == "False"
    result = pytester.runpytest_subprocess(*run, "-k", "stops_the_session")
    assert "stopped in the test" in result.stdout.str() + result.stderr.str()
    assert (pytester.path / "enabled_at_end.txt").read_text() == "False"
