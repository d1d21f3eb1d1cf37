"""pytest plugin (entry point ``pytest11``, name ``ownership_sanitizer``): check ownership in every test, or in
marked ones.

* ``pytest --ownership-sanitize`` turns the sanitizer on for every test
  (``--ownership-sanitize-options "checksum=1:stack_depth=4"`` adds options);
* ``@pytest.mark.ownership_sanitize(**options)`` turns it on for one test;
* ini keys (``[tool.pytest.ini_options]``, ``pytest.ini``, ``tox.ini``, ``setup.cfg``), as hypothesis and
  pytest-randomly read theirs: ``ownership_sanitize``, ``ownership_sanitize_options``,
  ``ownership_fail_on_retention``, ``ownership_report_dir`` and ``ownership_suppressions`` (a suppressions
  file, relative to the ini file's directory; else ``[tool.ownsan] suppressions`` of the nearest
  pyproject.toml). The command line wins over the ini, option by option; a bad value is a usage error
  naming the key and the value;
* each sanitized test runs, setup, call and teardown (its fixtures' too), inside one
  ``with sanitizer.sanitize(**options)`` (a ``pytest_runtest_protocol`` wrapper);
* fixtures: ``staging_ring`` (a 1 MiB :class:`~sanitizer.StagingRing`, closed
  after the test) and ``ownership_report`` (this test's errors and events; it
  refuses to run in an unsanitized test, where it would pass vacuously);
* a test in which the sanitizer recorded an error fails, and every failing
  sanitized test (its own assertion included) gets an ``ownership-sanitizer``
  report section: the one-line summary, each retaining holder with where it
  was read stale, the first error, and the path of the test's JSON report
  (``ownsan triage PATH``; ``TEST.PID.json`` in ``--ownership-report-dir`` or the pytest cache, so
  sessions sharing a directory never overwrite each other's); sanitizer and pytest frames are cut from
  its traceback. A report directory that cannot be made is said in one line at the end of the session,
  and the reports go to the cache instead;
* a header line says whether every test or only marked ones are sanitized, with the options and where
  the reports go; a line at the end of the session counts the sanitized tests and their findings
  (printed by the process that ran them: not under pytest-xdist, whose controller runs none; there the
  per-test reports are the record).

Tests run with ``triage=1``: a stale use is recorded, not raised, so the test
runs on and every retaining consumer is named; the failure comes at the end of
the test. Nothing is enabled unless asked, and nothing heavy is imported until a
test asks (the package itself imports torch, never numba).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any, Dict, Generator, Optional, Set, Tuple

import pytest

MARKER = "ownership_sanitize"
INI_SANITIZE = "ownership_sanitize"
INI_OPTIONS = "ownership_sanitize_options"
INI_FAIL_ON_RETENTION = "ownership_fail_on_retention"
INI_REPORT_DIR = "ownership_report_dir"
INI_SUPPRESSIONS = "ownership_suppressions"


class _TestState:
    """One sanitized test's: the records from before it (so its report is its own), its options, and
    (after the call) its report."""

    def __init__(self, exclude: Set[int], options: Dict[str, Any]):
        self.exclude, self.options = exclude, options
        self.report: Optional[Dict[str, Any]] = None


class _Settings:
    """The session's settings, the command line over the ini, read once in ``pytest_configure`` (so a bad
    value is a usage error before any test runs, never a failure in each)."""

    def __init__(self, every: bool, options: Dict[str, Any], fail_on_retention: bool, report_dir: Optional[str],
                 project_pending: bool = False):
        self.every, self.options = every, options
        self.fail_on_retention, self.report_dir = fail_on_retention, report_dir
        # [tool.ownsan] suppressions not read yet: a session that sanitizes only marked tests reads it at the
        # first one (a pytest run that sanitizes nothing never reads, nor fails on, the audit's table)
        self.project_pending = project_pending
        self.project_problem: Optional[str] = None  # that table could not be used: each sanitized test fails

    def project_suppressions(self, config: Any) -> Optional[str]:
        """Read ``[tool.ownsan] suppressions`` now if it was left for the first sanitized test; the reason
        it cannot be used, else None."""
        if self.project_pending:
            self.project_pending = False
            try:
                path = _project_suppressions(config)
                if path:
                    self.options["suppressions"] = _checked_suppressions(path, "[tool.ownsan] suppressions")
            except pytest.UsageError as exc:
                self.project_problem = str(exc)
        return self.project_problem


class _Counts:
    """What this process's sanitized tests found, for the line at the end of the session."""

    def __init__(self) -> None:
        self.tests = self.failed = self.errors = self.retentions = self.suppressed = 0


_SETTINGS = pytest.StashKey[_Settings]()  # config: the command line over the ini
_COUNTS = pytest.StashKey[_Counts]()  # config: this process's sanitized tests and findings
_STATE = pytest.StashKey[_TestState]()  # item: the sanitized test's state, while it runs
_PROBLEM = pytest.StashKey[str]()  # item: why its marker's options cannot be used (failed in its setup)
_REPORTS = pytest.StashKey["_ReportDir"]()  # config: where failing tests' reports go


def pytest_addoption(parser: Any) -> None:
    # The command-line defaults are None, so that "not given" lets the ini key speak.
    group = parser.getgroup("ownership-sanitizer", "ownership sanitizer (borrowed tensor views)")
    group.addoption("--ownership-sanitize", action="store_true", default=None,
                    help=f"run every test with the ownership sanitizer on; a test that records an error fails "
                    f"(ini: {INI_SANITIZE})")
    group.addoption("--ownership-sanitize-options", default=None, metavar="NAME=VALUE:...",
                    help=f"sanitizer options for every sanitized test (see `ownsan options`; over those of the "
                    f"ini's {INI_OPTIONS}, option by option)")
    group.addoption("--ownership-fail-on-retention", action="store_true", default=None,
                    help="also fail a sanitized test in which a borrowed view was retained past its reuse "
                    f"(ini: {INI_FAIL_ON_RETENTION})")
    group.addoption("--ownership-report-dir", default=None, metavar="DIR",
                    help="where failing tests' reports go, one file per test and session (TEST.PID.json; "
                    f"default: the pytest cache, d/ownership-sanitizer; ini: {INI_REPORT_DIR})")
    parser.addini(INI_SANITIZE, "run every test with the ownership sanitizer on (as --ownership-sanitize)",
                  type="bool", default=False)
    parser.addini(INI_OPTIONS, "sanitizer options for every sanitized test, NAME=VALUE:... (as "
                  "--ownership-sanitize-options, which wins option by option)", type="string", default="")
    parser.addini(INI_FAIL_ON_RETENTION, "also fail a sanitized test that retained a borrowed view (as "
                  "--ownership-fail-on-retention)", type="bool", default=False)
    parser.addini(INI_REPORT_DIR, "where failing sanitized tests' reports go (as --ownership-report-dir; "
                  "relative to the ini file's directory)", type="string", default="")
    parser.addini(INI_SUPPRESSIONS, "a suppressions file (KIND:PATTERN a line; relative to the ini file's "
                  "directory) for every sanitized test, unless the options name one", type="string", default="")


def _ini(config: Any, name: str) -> Any:
    """An ini value; a value pytest cannot read as the key's type is a usage error naming the key."""
    try:
        return config.getini(name)
    except (ValueError, pytest.UsageError) as exc:  # (pytest >= 9 raises UsageError, without the key's name)
        raise pytest.UsageError(f"ini {name}: {exc}") from None


def _ini_path(config: Any, value: str) -> str:
    """``value`` made absolute against the ini file's directory (the rootdir when there is none), as
    pytest reads its own path keys: the same file whichever directory pytest runs from."""
    value = os.path.expanduser(value)
    if os.path.isabs(value):
        return value
    base = config.inipath.parent if getattr(config, "inipath", None) else config.rootpath
    return os.path.normpath(os.path.join(str(base), value))


def _parsed(text: str, where: str) -> Dict[str, str]:
    """An options string, parsed and validated, or a usage error naming where it came from (the ini key
    and its value; the command line's value is on the command line)."""
    from sanitizer.core import options as option_table  # torch-free

    try:
        parsed = option_table.parse_options_string(text)
        option_table.resolve(parsed)
    except option_table.OptionError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
    return parsed


def _checked_suppressions(path: str, where: str) -> str:
    """A suppressions file checked now (unreadable, or a bad rule: a usage error naming where it came
    from), not in every test's setup."""
    from sanitizer.core import options as option_table  # torch-free

    try:
        option_table.resolve({"suppressions": path})
    except option_table.OptionError as exc:
        raise pytest.UsageError(f"{where}: {exc}") from None
    return path


def _project_suppressions(config: Any) -> Optional[str]:
    """``[tool.ownsan] suppressions`` of the nearest pyproject.toml, when ``sanitizer.tools.project_settings``
    exists (imported lazily: the plugin must load without it); a broken table is a usage error."""
    try:
        from sanitizer.tools.project_settings import suppressions_for
    except ImportError:
        suppressions_for = None
    if suppressions_for is None:
        return None
    from sanitizer.audit.settings import SettingsError

    try:
        return suppressions_for(str(config.rootpath))
    except SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None


def _settings(config: Any) -> _Settings:
    """The command line over the ini: the switches and the report directory when given, the options
    option by option (the ini's first, the command line's over them), the suppressions file from the
    options, else the ini key, else the project's ``[tool.ownsan]`` table."""
    every = config.getoption("--ownership-sanitize")
    if every is None:
        every = bool(_ini(config, INI_SANITIZE))
    fail = config.getoption("--ownership-fail-on-retention")
    if fail is None:
        fail = bool(_ini(config, INI_FAIL_ON_RETENTION))
    report_dir = config.getoption("--ownership-report-dir")
    if report_dir is None:
        ini_dir = str(_ini(config, INI_REPORT_DIR) or "").strip()
        report_dir = _ini_path(config, ini_dir) if ini_dir else None
    options: Dict[str, Any] = {}
    ini_options = str(_ini(config, INI_OPTIONS) or "").strip()
    if ini_options:
        options.update(_parsed(ini_options, f"ini {INI_OPTIONS} = {ini_options!r}"))
    cli_options = config.getoption("--ownership-sanitize-options")
    if cli_options:
        options.update(_parsed(cli_options, "--ownership-sanitize-options"))
    settings = _Settings(every, options, fail, report_dir)
    if "suppressions" not in options:
        ini_file = str(_ini(config, INI_SUPPRESSIONS) or "").strip()
        if ini_file:
            options["suppressions"] = _checked_suppressions(_ini_path(config, ini_file),
                                                            f"ini {INI_SUPPRESSIONS} = {ini_file!r}")
        else:
            settings.project_pending = True
            if every:  # every test sanitized: a broken table is a usage error before any test runs
                problem = settings.project_suppressions(config)
                if problem:
                    raise pytest.UsageError(problem)
    return settings


def pytest_configure(config: Any) -> None:
    from sanitizer.core.sites import add_internal_prefix  # torch-free

    for harness in ("_pytest", "pytest", "pluggy"):  # the harness below a test is nobody's holder, and no use site
        module = __import__(harness)
        add_internal_prefix(os.path.dirname(os.path.abspath(module.__file__)))
    config.addinivalue_line(
        "markers", f"{MARKER}(**options): run this test with the ownership sanitizer on (options as in "
        "`ownsan options`); a test that records an error fails")
    config.stash[_SETTINGS] = _settings(config)
    config.stash[_COUNTS] = _Counts()


def _settings_of(config: Any) -> _Settings:
    settings = config.stash.get(_SETTINGS, None)
    if settings is None:  # (pytest_configure not run: a plugin loaded late) read them now
        settings = config.stash[_SETTINGS] = _settings(config)
    return settings


def _wanted(item: Any) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The options for this test if it is to be sanitized (else None), and why its marker's options
    cannot be used (else None). Checked before the scope is entered, so a bad option enters nothing."""
    marker = item.get_closest_marker(MARKER)
    settings = _settings_of(item.config)
    if marker is None and not settings.every:
        return None, None
    if marker is not None and marker.args:
        return None, f"@pytest.mark.{MARKER} takes keyword options only, got {marker.args!r}"
    problem = settings.project_suppressions(item.config)
    if problem:
        return None, problem
    options = {"triage": 1, **settings.options, **(marker.kwargs if marker else {})}
    if marker is not None and marker.kwargs:
        from sanitizer.core import options as option_table  # torch-free

        try:
            option_table.resolve(options)
        except option_table.OptionError as exc:
            return None, f"@pytest.mark.{MARKER}: {exc}"
    return options, None


def _record_ids() -> Set[int]:
    from sanitizer.torch_layer import records

    return records.STORE.record_ids()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Generator[None, Any, None]:
    """Setup, call and teardown of a sanitized test (its fixtures' setup and teardown included) in one
    ``with sanitizer.sanitize(**options)``: the package's own save and restore of the state, which no
    hook between them can leave half done. The retentions of the test's last lends are decided after its
    fixtures' teardown, before the state goes."""
    options, problem = _wanted(item)
    if problem is not None:
        item.stash[_PROBLEM] = problem  # failed in its setup, where pytest reports a test's error
    if options is None:
        yield
        return
    import sanitizer
    from sanitizer.features import triage

    triage.reset()  # a fresh triage per test: nothing pending or remembered from the one before
    _counts(item.config).tests += 1
    with sanitizer.sanitize(**options):
        item.stash[_STATE] = _TestState(_record_ids(), options)  # the records from before the test: not its
        try:
            yield
        finally:
            del item.stash[_STATE]
            triage.settle(final=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    problem = item.stash.get(_PROBLEM, None)
    if problem is not None:
        pytest.fail(problem, pytrace=False)


def _counts(config: Any) -> _Counts:
    counts = config.stash.get(_COUNTS, None)
    if counts is None:
        counts = config.stash[_COUNTS] = _Counts()
    return counts


def _safe(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150] or "test"


class _ReportDir:
    """Where this session's failing tests' reports go: ``--ownership-report-dir``, else (or when that cannot
    be made or written: one line at the end of the session, never an INTERNALERROR that ends it) the pytest
    cache, else a temporary directory of the session's own."""

    def __init__(self, chosen: Optional[str], label: str = "--ownership-report-dir"):
        self.chosen, self.label = chosen, label  # label: where the directory was named
        self.problem: Optional[str] = None  # what went wrong with the chosen directory
        self.fallback: Optional[str] = None
        self.used: Optional[str] = None  # where the last report went

    def write(self, config: Any, name: str, text: str) -> Optional[str]:
        """Write the report ``name`` (the test's, unique to this session: two sessions sharing the
        directory never overwrite each other's) to the first directory that takes it; its path, or None."""
        from sanitizer.core import output_file

        for directory in ([self.chosen] if self.chosen and not self.problem else []) + [None]:
            try:
                if directory is None:
                    directory = self.fallback = self.fallback or _default_dir(config)
                else:
                    os.makedirs(directory, exist_ok=True)
                path = os.path.join(directory, name)
                output_file.write_text(path, text)  # never half a report
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
                if directory == self.chosen and self.chosen:
                    self.problem = (f"{self.label} {self.chosen!r} cannot be used "
                                    f"({getattr(exc, 'strerror', None) or exc})")
                continue
            self.used = directory
            return path
        return None

    def line(self) -> Optional[str]:
        """The one line that says what went wrong with the report directory, and where the reports went."""
        if not self.problem:
            return None
        went = (f"failing tests' reports went to {self.fallback}" if self.fallback and self.used == self.fallback
                else "failing tests' reports were not written")
        return f"ownership-sanitizer: {self.problem}; {went}"


def _default_dir(config: Any) -> str:
    cache = getattr(config, "cache", None)
    if cache is not None:
        try:
            return str(cache.mkdir("ownership-sanitizer"))
        except OSError:  # a read-only checkout
            pass
    return tempfile.mkdtemp(prefix="ownership-sanitizer-")


def _reports(config: Any) -> _ReportDir:
    where = config.stash.get(_REPORTS, None)
    if where is None:
        label = ("--ownership-report-dir" if config.getoption("--ownership-report-dir") is not None
                 else f"ini {INI_REPORT_DIR}")
        where = config.stash[_REPORTS] = _ReportDir(_settings_of(config).report_dir, label)
    return where


def _is_worker(config: Any) -> bool:
    """A pytest-xdist worker: its lines would be lost or doubled, and its counts are only its share."""
    return hasattr(config, "workerinput")


def _format_options(options: Dict[str, Any]) -> str:
    return ", ".join(f"{name}={value}" for name, value in options.items())


def pytest_report_header(config: Any) -> Optional[str]:
    """One line: is every test sanitized or only the marked ones, with which options, reports where."""
    if _is_worker(config):
        return None
    settings = _settings_of(config)
    if not settings.every:
        line = "ownership-sanitizer: marked tests only (--ownership-sanitize for every test)"
        return line + (f"; options: {_format_options(settings.options)}" if settings.options else "")
    where = settings.report_dir or ("the pytest cache (d/ownership-sanitizer)" if getattr(config, "cache", None)
                                    is not None else "a temporary directory")
    return (f"ownership-sanitizer: every test sanitized (options: {_format_options({'triage': 1, **settings.options})})"
            f"{'; retentions fail tests' if settings.fail_on_retention else ''}; reports in {where}")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
    if _is_worker(config):
        return
    counts = config.stash.get(_COUNTS, None)
    if counts is not None and counts.tests:
        terminalreporter.write_line(
            f"ownership-sanitizer: {counts.tests} test{'s' * (counts.tests != 1)} sanitized, {counts.failed} "
            f"failed on ownership findings ({counts.errors} error{'s' * (counts.errors != 1)}, "
            f"{counts.retentions} retention{'s' * (counts.retentions != 1)}, {counts.suppressed} suppressed)")
    where = config.stash.get(_REPORTS, None)
    line = where.line() if where is not None else None
    if line:
        terminalreporter.write_line(line)


def _prune_torch_frames(item: Any, excinfo: Any) -> None:
    """Cut torch's dispatch frames (between the user's line and the check) from a sanitizer error's
    traceback. Our own frames hide themselves (``__tracebackhide__``, where we raise), and pytest cuts its
    own and pluggy's; torch's frames cannot be marked, so this is pytest's one private hook we use, on
    pytest >= 7.4 only (``Item._traceback_filter``); older pytests show those frames."""
    try:
        from sanitizer.core.errors import OwnershipError
        from sanitizer.core.sites import torch_dir

        if not isinstance(excinfo.value, OwnershipError):
            return
        torch_frames = torch_dir()
    except Exception:  # a cosmetic step must never hide the failure itself
        return
    original = getattr(item, "_traceback_filter", None)
    if not callable(original):
        return

    def pruned(info: Any) -> Any:
        shown = original(info)
        cut = shown.filter(lambda entry: not str(entry.path).startswith(torch_frames))
        return cut if len(cut) else shown

    item._traceback_filter = pruned


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any):
    """After the test body: its report gets an ``ownership-sanitizer`` section when it fails (for any
    reason), and a test that passed but in which the sanitizer recorded an error fails with it."""
    st = item.stash.get(_STATE, None)
    if st is not None and call.when == "call" and call.excinfo is not None:
        _prune_torch_frames(item, call.excinfo)
    outcome = yield
    if st is None or call.when != "call":
        return
    from sanitizer.reporting import collect
    from sanitizer.reporting.report import report

    test_report = outcome.get_result()
    rep = report(final=True, exclude=st.exclude)  # the test's frame is gone: decide now
    st.report = rep
    # the one rule ownsan run and ownsan triage apply (retentions fail a test only when asked)
    failing = collect.failing(rep, fail_on_retention=_settings_of(item.config).fail_on_retention)
    _count(item.config, rep, failing)
    if not failing and not test_report.failed:
        return
    # One file per test and session (its pid): sessions sharing the directory never overwrite each other's.
    path = _reports(item.config).write(item.config, f"{_safe(item.nodeid)}.{os.getpid()}.json",
                                       json.dumps(rep, indent=2, default=str) + "\n")
    from sanitizer.reporting.text import section_for_test

    section = section_for_test(rep, path)
    test_report.sections.append(("ownership-sanitizer", section))
    if failing and not test_report.failed:  # the failure is the sanitizer's: its summary, no traceback of ours
        test_report.outcome = "failed"
        test_report.longrepr = (f"{rep['summary']['line']}\n(the ownership-sanitizer section below names the "
                                f"holders, where they were read stale, and the test's report)")


def _count(config: Any, rep: Dict[str, Any], failing: bool) -> None:
    """Add a sanitized test's findings to the session's counts (suppressed ones apart: never failing)."""
    counts = _counts(config)
    summary = rep.get("summary") or {}
    suppressed = summary.get("suppressed") or {}
    counts.failed += bool(failing)
    counts.errors += int(rep.get("error_count") or 0)
    counts.retentions += int(summary.get("retentions") or 0) + int(summary.get("retentions_not_kept") or 0)
    counts.suppressed += int(suppressed.get("errors") or 0) + int(suppressed.get("retentions") or 0)


class OwnershipReport:
    """This test's sanitizer findings, read live: ``errors``, ``events``, ``retentions``, ``line``, ``report()``."""

    def __init__(self, exclude: Set[int]):
        self._exclude = exclude

    def report(self, final: bool = False) -> Dict[str, Any]:
        from sanitizer.reporting.report import report

        return report(final=final, exclude=self._exclude)

    @property
    def errors(self) -> list:
        return self.report()["errors"]

    @property
    def events(self) -> list:
        return self.report()["events"]

    @property
    def retentions(self) -> list:
        return [e for e in self.events if e.get("kind") == "retention"]

    @property
    def line(self) -> str:
        return self.report()["summary"]["line"]


@pytest.fixture
def ownership_report(request: Any) -> OwnershipReport:
    """The errors and events the sanitizer recorded during this test (retentions, rescues, clones).

    Only in a sanitized test: unsanitized, it would see nothing and every assertion on it would pass."""
    st = request.node.stash.get(_STATE, None)
    if st is None:
        pytest.fail(f"the ownership_report fixture needs a sanitized test: mark it @pytest.mark.{MARKER} or run "
                    "pytest --ownership-sanitize (unsanitized, it would record nothing and pass vacuously)",
                    pytrace=False)
    return OwnershipReport(st.exclude)


@pytest.fixture
def staging_ring(request: Any):
    """A small staging ring (1 MiB on CPU) for the test, closed afterwards."""
    from sanitizer import StagingRing

    ring = StagingRing(1 << 20, device="cpu", name=f"staging_ring[{request.node.name}]")
    try:
        yield ring
    finally:
        ring.close()


@pytest.fixture
def borrowed_weights(request: Any):
    """A factory of borrowed iterators over weights you give it: ``borrowed_weights(weights, case=None,
    **params)`` streams a state dict, a safetensors file or a directory through a real staging ring
    (see :func:`sanitizer.testing.borrowed_stream`; ``case`` from ``sanitizer.testing.strategies``). The
    iterators run under this test's sanitizer options (its marker's, or --ownership-sanitize's), each
    checkpoint is read once, and every iterator handed out is closed after the test."""
    from sanitizer.testing.consumer_check import BorrowedWeights

    factory = BorrowedWeights(name=f"borrowed_weights[{request.node.name}]")
    try:
        yield factory
    finally:
        factory.close()
