"""The one report pipeline: find a run's reports, read each (a killed process's journal in its place),
check it against the schema, merge them, label every finding by its process, and say whether it fails.

``ownsan run`` (its processes' reports), ``ownsan triage`` (one file), ``ray_env.collect`` (a Ray job's
workers) and the pytest plugin (its failing status) all go through here, so they agree on what a file
that cannot be read means (one line naming it; the others are merged; the run fails, since its process
had made a finding), on the labels (``rank 1 (pid 4242)``, ``DataLoader worker 1 (pid 4243)``, ``Ray
worker 1a2b3c4d, actor 5e6f7a8b (pid 4244)``) and on the exit status (:func:`failing`).

``ownsan run`` exports its report directory as :data:`ENV_RUN_DIR`; a process that collects reports the
run cannot see (a Ray driver: its workers are the raylet's children, and write where ``runtime_env``
says) hands them to the run by writing the merged report there (:func:`hand_to_run`). ``runtime_env``
also leaves a pointer to its directory there (:func:`point_run_to`), which the hand-over removes: a job
that never collected still has its workers' reports merged by the run (:func:`pointed`), said in one line.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from sanitizer.core import output_file, report_file
from sanitizer.core.journal import SUFFIX as JOURNAL_SUFFIX, reports_or_journals
from sanitizer.reporting.schema import validate

# Torch-free until a journal must be summarized or several reports merged: ``ownsan triage`` of a whole
# report never imports torch (seconds); reporting.report (which does, for the runtime's own report) is
# imported where it is needed.
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report_schema.json")
_schema: Dict[str, Any] = {}

#: Set by ``ownsan run`` in its command's environment: the directory whose ``report-*.json`` it merges.
ENV_RUN_DIR = "OWNSAN_RUN_REPORT_DIR"
PATTERN = "report-*.json"


@dataclass
class Collected:
    """What :func:`collect` found: the merged report (None when no file could be read), the files read,
    one line per file that could not be, and the files that were journals (their process ended before it
    wrote its report)."""

    report: Optional[Dict[str, Any]]
    files: List[str] = field(default_factory=list)
    unreadable: List[str] = field(default_factory=list)
    from_journals: List[str] = field(default_factory=list)

    def notes(self, who: str) -> List[str]:
        """The lines a reader prints about the files themselves (``who``: ``ownsan run``, ...)."""
        lines = []
        if self.unreadable:
            n = len(self.unreadable)
            lines.append(f"{who}: {n} process{'es' * (n != 1)} left a file that cannot be read (killed while it "
                         f"recorded its first finding?): its findings are lost, the others' are merged; "
                         + "; ".join(self.unreadable))
        if self.from_journals:
            n = len(self.from_journals)
            lines.append(f"{who}: {n} process{'es' * (n != 1)} ended before writing a report (killed?): "
                         f"{'their' if n != 1 else 'its'} findings come from {'their' if n != 1 else 'its'} "
                         f"journal{'s' * (n != 1)}, as they were made")
        return lines

    def failing(self, fail_on_retention: Optional[bool] = None) -> bool:
        """Does this collection fail a run? A finding anywhere, or a file that could not be read (its
        process had begun to record a finding)."""
        return bool(self.unreadable) or (self.report is not None and failing(self.report, fail_on_retention))


def failing(rep: Dict[str, Any], fail_on_retention: Optional[bool] = None) -> bool:
    """Does ``rep`` fail a run: an error, or a confirmed retention unless ``fail_on_retention`` is off
    (None: as the report's own options say, on by default)? One rule for ``ownsan run``, ``ownsan
    triage`` and the pytest plugin."""
    if fail_on_retention is None:
        fail_on_retention = str((rep.get("options") or {}).get("fail_on_retention", True)).lower() not in (
            "0", "false", "no", "off")
    summary = rep.get("summary") or {}
    return bool(rep.get("error_count") or (fail_on_retention and summary.get("retentions")))


def find(place: str) -> List[str]:
    """The report files at ``place``: a directory's ``report-*.json`` (and each journal whose report is
    missing), a glob's matches, or a file itself."""
    place = os.fspath(place)
    if os.path.isdir(place):
        return reports_or_journals(os.path.join(place, PATTERN))
    if glob.has_magic(place):
        return reports_or_journals(place)
    return [place]


def read(path: str, check_schema: bool = True) -> Dict[str, Any]:
    """The report in ``path`` (its journal's, when its process was killed before writing it), with its
    summary; raises ValueError with one line naming the file when it cannot be read or does not match the
    report schema."""
    rep = report_file.load(path, _journal_check)
    if "summary" not in rep:  # a journal (the process was killed before it wrote its report)
        from sanitizer.reporting.report import summarize

        rep["summary"] = summarize(rep)
    if check_schema:
        if not _schema:
            with open(SCHEMA_PATH, encoding="utf-8") as fh:
                _schema.update(json.load(fh))
        problems = validate(rep, _schema)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"{path!r} does not match the report schema: {problems[0]}{more}")
    return rep


def _journal_check(what: str, value: Dict[str, Any]) -> Optional[str]:
    """A journal's records checked against the report schema before its summary is made of them."""
    from sanitizer.reporting.report import journal_check

    return journal_check(what, value)


def collect(places: Sequence[str], check_schema: bool = True) -> Collected:
    """Every report at ``places`` (see :func:`find`) read, checked and merged into one, each finding
    labelled by its process. A file that cannot be read is one line in ``unreadable``; the rest go on."""
    result = Collected(report=None)
    reports = []
    for place in places:
        for path in find(place):
            try:
                reports.append(read(path, check_schema))
            except ValueError as exc:  # (ReportFileError) one process's file: never the end of the others'
                result.unreadable.append(str(exc))
                continue
            result.files.append(path)
            if path.endswith(JOURNAL_SUFFIX) or (reports[-1].get("ended_before_report") or {}).get("journal"):
                result.from_journals.append(path)
    if len(reports) > 1:
        from sanitizer.reporting.report import merge

        result.report = merge(reports)
    elif reports:
        result.report = reports[0]
    return result


def write(rep: Dict[str, Any], path: str) -> str:
    """Write ``rep`` to ``path`` whole (atomically; a device, a FIFO or a symlink's target written
    through); returns the path written."""
    return output_file.write_text(os.fspath(path), json.dumps(rep, indent=2, default=str) + "\n")


def hand_to_run(rep: Dict[str, Any], source: str, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Under ``ownsan run`` (:data:`ENV_RUN_DIR` set), write ``rep``, the merged reports of ``source`` (a
    directory the run does not read), into the run's directory, where its merge reads it; the path written,
    or None when not under ``ownsan run`` or when ``source`` is that directory (the run reads it already)."""
    run_dir = _run_dir_besides(source, env)
    return write(rep, os.path.join(run_dir, f"report-collected-{os.getpid()}.json")) if run_dir else None


def _run_dir_besides(source: str, env: Optional[Dict[str, str]]) -> Optional[str]:
    """``ownsan run``'s report directory (:data:`ENV_RUN_DIR`), unless not under it or ``source`` is that
    directory (the run reads it already)."""
    run_dir = (env if env is not None else os.environ).get(ENV_RUN_DIR)
    if not run_dir or os.path.realpath(os.fspath(source)) == os.path.realpath(run_dir):
        return None
    return run_dir


#: A pointer left in the run's directory by ``ray_env.runtime_env``: the workers' report directory, whose
#: reports the run merges itself unless ``collect()`` handed them over (and removed the pointer).
POINTER_PATTERN = "workers-*.dir"


def _pointer(run_dir: str, source: str) -> str:
    import hashlib

    digest = hashlib.sha1(os.path.realpath(os.fspath(source)).encode("utf-8", "surrogateescape")).hexdigest()
    return os.path.join(run_dir, POINTER_PATTERN.replace("*", digest[:16]))


def point_run_to(source: str, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Under ``ownsan run``, leave in its directory a pointer to ``source`` (a Ray job's workers' report
    directory): a job that never calls ``collect()`` redirected its workers' findings away from the run,
    which then passed. The pointer's path, or None (not under ``ownsan run``, or ``source`` is its dir)."""
    run_dir = _run_dir_besides(source, env)
    if not run_dir:
        return None
    path = _pointer(run_dir, source)
    return output_file.write_text(path, os.path.abspath(os.fspath(source)) + "\n")


def unpoint_run(source: str, env: Optional[Dict[str, str]] = None) -> None:
    """``source``'s reports were handed to the run (:func:`hand_to_run`): its pointer goes, so the run does
    not count them twice."""
    run_dir = (env if env is not None else os.environ).get(ENV_RUN_DIR)
    if run_dir:
        try:
            os.remove(_pointer(run_dir, source))
        except OSError:
            pass


def pointed(run_dir: str) -> List[str]:
    """The workers' report directories pointed to in ``run_dir`` whose reports were never handed over and
    hold at least one report (or journal)."""
    places = []
    for path in sorted(glob.glob(os.path.join(run_dir, POINTER_PATTERN))):
        try:
            with open(path, encoding="utf-8") as fh:
                place = fh.read().strip()
        except OSError:
            continue
        if place and os.path.isdir(place) and find(place):
            places.append(place)
    return places


__all__ = ["Collected", "collect", "find", "read", "failing", "write", "hand_to_run", "point_run_to",
           "unpoint_run", "pointed", "ENV_RUN_DIR", "PATTERN", "POINTER_PATTERN"]
