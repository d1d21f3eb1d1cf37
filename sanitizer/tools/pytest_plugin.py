"""pytest plugin (entry point ``pytest11``): check ownership in every test, or in marked ones.

* ``pytest --ownership-sanitize`` turns the sanitizer on for every test
  (``--ownership-sanitize-options "checksum=1:stack_depth=4"`` adds options);
* ``@pytest.mark.ownership_sanitize(**options)`` turns it on for one test;
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
  and the reports go to the cache instead.

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
from typing import Any, Dict, Optional, Set

import pytest

MARKER = "ownership_sanitize"


class _TestState:
    """One sanitized test's: the ``sanitize()`` scope it runs in, the records from before it, its options,
    and (after the call) its report."""

    def __init__(self, scope: Any, exclude: Set[int], options: Dict[str, Any]):
        self.scope, self.exclude, self.options = scope, exclude, options
        self.report: Optional[Dict[str, Any]] = None


_OPTIONS = pytest.StashKey[Dict[str, Any]]()  # config: --ownership-sanitize-options, parsed
_STATE = pytest.StashKey[_TestState]()  # item: the sanitized test's state
_REPORTS = pytest.StashKey["_ReportDir"]()  # config: where failing tests' reports go


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("ownership-sanitizer", "ownership sanitizer (borrowed tensor views)")
    group.addoption("--ownership-sanitize", action="store_true", default=False,
                    help="run every test with the ownership sanitizer on; a test that records an error fails")
    group.addoption("--ownership-sanitize-options", default="", metavar="NAME=VALUE:...",
                    help="sanitizer options for every sanitized test (see `ownsan options`)")
    group.addoption("--ownership-fail-on-retention", action="store_true", default=False,
                    help="also fail a sanitized test in which a borrowed view was retained past its reuse")
    group.addoption("--ownership-report-dir", default=None, metavar="DIR",
                    help="where failing tests' reports go, one file per test and session (TEST.PID.json; "
                    "default: the pytest cache, d/ownership-sanitizer)")


def pytest_configure(config: Any) -> None:
    from sanitizer.core.sites import add_internal_prefix  # torch-free

    for harness in ("_pytest", "pytest", "pluggy"):  # the harness below a test is nobody's holder, and no use site
        module = __import__(harness)
        add_internal_prefix(os.path.dirname(os.path.abspath(module.__file__)))
    config.addinivalue_line(
        "markers", f"{MARKER}(**options): run this test with the ownership sanitizer on (options as in "
        "`ownsan options`); a test that records an error fails")
    raw = config.getoption("--ownership-sanitize-options")
    if raw:
        from sanitizer.core import options as option_table

        try:
            parsed = option_table.parse_options_string(raw)
            option_table.resolve(parsed)
        except option_table.OptionError as exc:
            raise pytest.UsageError(f"--ownership-sanitize-options: {exc}") from None
        config.stash[_OPTIONS] = parsed
    else:
        config.stash[_OPTIONS] = {}


def _wanted(item: Any) -> Optional[Dict[str, Any]]:
    """The options for this test if it is to be sanitized, else None."""
    marker = item.get_closest_marker(MARKER)
    if marker is None and not item.config.getoption("--ownership-sanitize"):
        return None
    if marker is not None and marker.args:
        pytest.fail(f"@pytest.mark.{MARKER} takes keyword options only, got {marker.args!r}", pytrace=False)
    return {"triage": 1, **item.config.stash.get(_OPTIONS, {}), **(marker.kwargs if marker else {})}


def _record_ids() -> Set[int]:
    from sanitizer.torch_layer import records

    return records.STORE.record_ids()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    options = _wanted(item)
    if options is None:
        return
    import sanitizer
    from sanitizer.features import triage

    triage.reset()  # a fresh triage per test: nothing pending or remembered from the one before
    scope = sanitizer.sanitize(**options)  # the package's own save and restore of the state around a block
    try:
        scope.__enter__()
    except sanitizer.OptionError as exc:
        pytest.fail(f"@pytest.mark.{MARKER}: {exc}", pytrace=False)
    item.stash[_STATE] = _TestState(scope, _record_ids(), options)


def _safe(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150] or "test"


class _ReportDir:
    """Where this session's failing tests' reports go: ``--ownership-report-dir``, else (or when that cannot
    be made or written: one line at the end of the session, never an INTERNALERROR that ends it) the pytest
    cache, else a temporary directory of the session's own."""

    def __init__(self, chosen: Optional[str]):
        self.chosen = chosen
        self.problem: Optional[str] = None  # what went wrong with --ownership-report-dir
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
                    self.problem = (f"--ownership-report-dir {self.chosen!r} cannot be used "
                                    f"({getattr(exc, 'strerror', None) or exc})")
                continue
            self.used = directory
            return path
        return None

    def line(self) -> Optional[str]:
        """The one line that says what went wrong with --ownership-report-dir, and where the reports went."""
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
        where = config.stash[_REPORTS] = _ReportDir(config.getoption("--ownership-report-dir"))
    return where


def pytest_terminal_summary(terminalreporter: Any, exitstatus: Any, config: Any) -> None:
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
    failing = collect.failing(rep, fail_on_retention=item.config.getoption("--ownership-fail-on-retention"))
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


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: Any) -> None:
    st = item.stash.get(_STATE, None)
    if st is None:
        return
    del item.stash[_STATE]
    from sanitizer.features import triage

    triage.settle(final=True)  # (the retentions of the test's last lends are decided before the state goes)
    st.scope.__exit__(None, None, None)


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
