"""Reading a journal (the findings of a process killed before it wrote its report, issue 46 items 7-9):
through the report's own path, a symlink to it or its target, and only once every line is checked."""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import sanitizer
from sanitizer.audit import cli as audit_cli
from sanitizer.core import journal
from sanitizer.tools import cli

R = importlib.import_module("sanitizer.reporting.report")  # `sanitizer.reporting.report` is also the function
_KEPT: list = []
_HEADER = {"kind": journal.KIND, "format": R.FORMAT, "version": R.VERSION, "pid": 4242, "rank": None,
           "world_size": None, "argv": ["train.py"], "options": {"triage": True}}
# A record of every kind the summary reads, beside the run's own (a journal never holds the aggregated
# clone and unchecked_load, but a crafted one may).
_MORE_EVENTS = [
    {"kind": "clone", "policy": "own", "count": 2, "bytes": 64, "pid": 4242},
    {"kind": "unchecked_load", "entry": "load_file", "loader": "safetensors", "why": "owned", "count": 1,
     "tensors": 3, "bytes": 96, "pid": 4242},
    {"kind": "emulated_retention", "summary": "s", "file": "a.safetensors", "count": 2, "nbytes": 64,
     "leases": ["w"], "holder": {"kind": "global", "path": "m.K", "consumer": "m.K", "site": None}, "pid": 4242},
]


@pytest.fixture(autouse=True)
def _fresh(fresh_triage):
    _KEPT.clear()
    yield
    _KEPT.clear()


def _records() -> tuple:
    """A real run's errors (a stale use) and events (retentions), as a journal keeps them."""
    ring = sanitizer.StagingRing(4096, name="w")
    with sanitizer.sanitize(triage=1):
        for i in range(6):
            _KEPT.append(ring.put(f"layers.{i}.weight", torch.full((256,), float(i))))
        float(_KEPT[0].sum())  # a stale read
        rep = sanitizer.report(final=True)
    rep = json.loads(json.dumps(rep, default=str))
    events = [e for e in rep["events"] if e["kind"] not in ("clone", "unchecked_load")]
    assert rep["errors"] and any(e["kind"] == "retention" for e in events)
    return rep["errors"], events + _MORE_EVENTS


def _write_journal(path, errors, events, header=None) -> None:
    lines = [header or _HEADER] + [{"k": "error", "r": e} for e in errors] + [{"k": "event", "r": e} for e in events]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


def _triage(capsys, *args) -> tuple:
    code = cli.main(["triage", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_reports_path_reads_its_journal_when_the_report_is_missing_also_through_a_symlink(tmp_path, capsys):
    """The process was killed before it wrote r.json: `ownsan triage r.json` and `ownsan audit --report
    r.json` read r.json.journal (they said "No such file"), as does a symlink to r.json, and say so."""
    errors, events = _records()
    (tmp_path / "real").mkdir()
    _write_journal(tmp_path / "real" / "r.json.journal", errors, events)
    os.symlink(tmp_path / "real" / "r.json", tmp_path / "link.json")  # dangling: the report was never written
    (tmp_path / "consumer.py").write_text("x = 1\n")
    for path in (tmp_path / "real" / "r.json", tmp_path / "link.json"):
        code, out, err = _triage(capsys, path)
        assert code == 1, err  # its findings: triage fails as ownsan run does
        assert "1 error (1 stale_use)" in out and "_KEPT[*]" in out
        assert err.count("\n") == 1 and f"no report at {str(path)!r}" in err and "r.json.journal" in err
        code = audit_cli.main([str(tmp_path / "consumer.py"), "--report", str(path)])
        out = capsys.readouterr()
        assert code == 0 and "No such file" not in out.err, out.err
        assert "saw " in out.out and " retention" in out.out and "r.json.journal" in out.err, out
    rep = R.load(str(tmp_path / "link.json"))  # ownsan run's and ray's reader too
    assert rep["ended_before_report"]["journal"] == str(tmp_path / "real" / "r.json.journal")
    assert rep["summary"]["retentions"] >= 1
    os.unlink(tmp_path / "real" / "r.json.journal")  # no journal either: the missing report is named
    code, _, err = _triage(capsys, tmp_path / "real" / "r.json")
    assert code == 2 and "No such file" in err and err.count("\n") == 1


def test_a_journal_newer_than_the_report_beside_it_is_read_in_its_place(tmp_path, capsys):
    """An earlier run wrote r.json; a later one at the same path was killed: its journal is the newer and
    another process's, so it is what r.json now stands for (the old report would hide its findings)."""
    errors, events = _records()
    report = tmp_path / "r.json"
    old = dict(R.report(final=True), errors=[], events=[], error_count=0)  # a whole report, no finding in it
    old["summary"] = R.summarize(old)
    assert R.validate(json.loads(json.dumps(old, default=str))) == []
    report.write_text(json.dumps(old, default=str), encoding="utf-8")
    os.utime(report, (time.time() - 60, time.time() - 60))
    _write_journal(tmp_path / "r.json.journal", errors, events)
    code, out, err = _triage(capsys, report)
    assert code == 1 and "1 error (1 stale_use)" in out
    assert "is older than its journal" in err and err.count("\n") == 1
    _write_journal(tmp_path / "r.json.journal", errors, events, dict(_HEADER, pid=old["pid"]))
    code, out, err = _triage(capsys, report)  # newer, but the report's own process's (ray's workers rewrite
    assert code == 0 and "0 errors" in out and err == ""  # their reports as they run): the report is read
    _write_journal(tmp_path / "r.json.journal", errors, events)
    os.utime(tmp_path / "r.json.journal", (time.time() - 120, time.time() - 120))  # older than the report
    code, out, err = _triage(capsys, report)
    assert code == 0 and "0 errors" in out and err == ""


_BAD_VALUES = (None, "<b>x</b>", "3", -1, 1.5, True, [], ["x"], {}, {"a": 1})


def _paths(value, path=()):
    """Every place in ``value`` a crafted line could change: each key's value and each list item."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield path + (k,)
            yield from _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield path + (i,)
            yield from _paths(v, path + (i,))


def _changed(record, path, new):
    record = json.loads(json.dumps(record))
    node = record
    for step in path[:-1]:
        node = node[step]
    if new is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return record


_DELETE = object()


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_a_crafted_journal_line_is_one_clear_error_never_a_traceback(tmp_path, capsys):
    """The lines the issue named, then the rule: every field of every kind of record (and of the header)
    deleted or replaced by a value of another type, one at a time. ownsan triage reads the journal or
    says in one line what is wrong with which line (exit 2); it never raises."""
    errors, events = _records()
    path = tmp_path / "c.json.journal"
    for line, says in (({"k": "event", "r": {"kind": "retention"}}, "line 2 (an event): $: missing required key"),
                       ({"k": "event", "r": {"kind": ["x"]}}, "line 2 (an event)"),
                       ({"k": "event", "r": {"kind": "clone", "count": "3", "policy": "own", "bytes": 1, "pid": 1}},
                        "line 2 (an event): $.count: expected integer, got str '3'"),
                       ({"k": "event", "r": {"kind": "unchecked_load", "count": "3", "pid": 1}}, "$.count"),
                       ({"k": "note", "r": {}}, "line 2: \"k\" is 'note', expected 'error', 'event' or 'update'"),
                       ({"k": "error", "r": [1]}, "line 2: the record (\"r\") is list [1], expected an object")):
        path.write_text(json.dumps(_HEADER) + "\n" + json.dumps(line) + "\n", encoding="utf-8")
        code, out, err = _triage(capsys, path)
        assert code == 2 and out == "" and err.count("\n") == 1, (line, err)
        assert err.startswith(f"ownsan triage: {str(path)!r} is not a valid journal: ") and says in err, err
    records = [("error", i, e) for i, e in enumerate(errors)] + [("event", i, e) for i, e in enumerate(events)]
    tried = read = 0
    for kind, index, record in [("header", 0, _HEADER)] + records:
        for n, where in enumerate(_paths(record)):
            if kind == "header" and where[0] == "kind":
                continue  # (not a journal at all: tested below)
            new = (_DELETE,) + _BAD_VALUES
            for value in (new[n % len(new)], new[(n + 5) % len(new)]):
                mutated = _changed(record, where, value)
                errs = [mutated if (kind, index) == ("error", i) else e for i, e in enumerate(errors)]
                evs = [mutated if (kind, index) == ("event", i) else e for i, e in enumerate(events)]
                _write_journal(path, errs, evs, mutated if kind == "header" else None)
                code, out, err = _triage(capsys, path)  # a traceback fails the test here
                tried += 1
                read += code in (0, 1)  # (1: read, with findings)
                assert code in (0, 1, 2), (kind, where, value, err)
                if code == 2:
                    assert out == "" and err.count("\n") == 1 and "is not a valid journal: line " in err, err
    assert tried > 300 and 0 < read < tried  # some changes are harmless (an optional field gone), most are not
    path.write_text('{"kind": "something else"}\n', encoding="utf-8")
    code, _, err = _triage(capsys, path)
    assert code == 2 and "is not an ownership-sanitizer journal" in err and err.count("\n") == 1


def test_the_audit_reads_a_crafted_journal_without_a_traceback(tmp_path, capsys):
    """ownsan audit --report reads journals without the schema (it is torch-free and reads only what it
    needs, defensively): a crafted record never breaks it."""
    errors, events = _records()
    (tmp_path / "consumer.py").write_text("x = 1\n")
    path = tmp_path / "c.json.journal"
    for record in ({"kind": "retention"}, {"kind": "retention", "holder": [1], "holders": "x", "lease": 3},
                   {"kind": ["x"], "lease": {"lease_id": []}}, {"kind": "retention", "holders": [{"site": 5}]}):
        _write_journal(path, errors, events + [record])
        code = audit_cli.main([str(tmp_path / "consumer.py"), "--report", str(path)])
        capsys.readouterr()
        assert code in (0, 1)


_KILLED = '''
import os, torch, sanitizer
ring = sanitizer.StagingRing(4096, name="w")
KEPT = [ring.put("a", torch.ones(1024))]
ring.put("b", torch.zeros(1024))
float(KEPT[0].sum())  # a stale read, recorded (halt_on_error=0)
os.kill(os.getpid(), 9)
'''


@pytest.mark.slow
def test_a_clean_run_removes_a_killed_runs_journal_and_a_later_killed_run_is_read_through_the_link(tmp_path, capsys):
    """Item 9: an earlier killed run's journal was left beside a clean run's report, and stood for it
    later. Item 7: a later killed run's findings are read through the report's path (a symlink here, and
    its target), not the older report's."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real" / "r.json", tmp_path / "link.json")
    stale = tmp_path / "real" / "r.json.journal"
    _write_journal(stale, [], [])  # an earlier, killed run's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OWNERSHIP_SANITIZE": "1",
           "OWNERSHIP_SANITIZE_OPTIONS": f"report={tmp_path / 'link.json'},halt_on_error=0"}
    clean = subprocess.run([sys.executable, "-c", "import torch, sanitizer\nsanitizer.StagingRing(4096, name='w')\n"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert (tmp_path / "real" / "r.json").exists() and os.path.islink(tmp_path / "link.json")
    assert not stale.exists()  # the clean run's whole report removed the journal beside it
    killed = subprocess.run([sys.executable, "-c", _KILLED], env=env, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert stale.exists()  # its journal, beside the link's target, where the report goes
    for path in (tmp_path / "link.json", tmp_path / "real" / "r.json"):
        code, out, err = _triage(capsys, path)
        assert code == 1 and "1 error (1 stale_use)" in out, (out, err)
        assert "is older than its journal" in err


_KILLED_AFTER_ITS_RETENTION_WAS_READ = '''
import os, torch, sanitizer
ring = sanitizer.StagingRing(4096, name="w")
KEPT = {}
for i in range(6):
    KEPT[i] = ring.put(f"layers.{i}.weight", torch.full((256,), float(i)))
float(KEPT[0].sum())  # read stale after its retention was decided (at a later lend)
os.kill(os.getpid(), 9)
'''


def test_a_killed_process_journal_keeps_that_its_retention_was_read_stale(tmp_path):
    """A retention read stale after it was decided: the fact was added to the record in memory only, so a
    killed process's consumer row said "stale 0" beside the very stale use (found on a Ray actor)."""
    from sanitizer.reporting import collect

    report = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OWNERSHIP_SANITIZE": "1",
           "OWNERSHIP_SANITIZE_OPTIONS": f"report={report},halt_on_error=0,triage=1"}
    killed = subprocess.run([sys.executable, "-c", _KILLED_AFTER_ITS_RETENTION_WAS_READ], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    rep = collect.read(str(report) + journal.SUFFIX)
    kept = {e["lease"]["name"]: e for e in rep["events"] if e["kind"] == "retention"}
    assert kept["layers.0.weight"]["used_stale"] is True, kept["layers.0.weight"]
    assert not any(e["used_stale"] for name, e in kept.items() if name != "layers.0.weight")
    consumers = rep["summary"]["retaining_consumers"]
    assert [g["used_stale"] for g in consumers] == [1], consumers


def test_an_update_line_naming_no_journaled_event_changes_nothing_and_a_crafted_one_is_one_clear_error(tmp_path):
    errors, events = _records()
    path = tmp_path / "r.json.journal"
    _write_journal(path, errors, events)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"k": "update", "r": {"kind": "retention", "lease_id": 10 ** 9,
                                                 "fields": {"used_stale": True}}}) + "\n")
    assert journal.load_journal(str(path))["events"] == events
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"k": "update", "r": {"kind": "retention", "lease_id": "x"}}) + "\n")
    with pytest.raises(ValueError, match="an update needs"):
        journal.load_journal(str(path))

