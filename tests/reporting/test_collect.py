"""The one report pipeline (issue 49, points 3, 5 and 7): find, read (a journal in a killed process's
place), check, merge and label; the status every reader gives; the labels in the printed text; the one
report skeleton."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import sanitizer
from sanitizer.core import report_skeleton
from sanitizer.features import triage
from sanitizer.reporting import collect
from sanitizer.reporting import report as R
from sanitizer.reporting.text import format_triage
from sanitizer.tools import cli

_KEPT: list = []


@pytest.fixture(autouse=True)
def _fresh(fresh_triage):
    _KEPT.clear()
    yield
    _KEPT.clear()


def _retaining() -> dict:
    """One process's report: a kept view, read stale (an error and a retention)."""
    triage.reset(records_too=True)
    buf = sanitizer.StagingBuffer(1 << 12, name="ring")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        _KEPT.append(buf.write(0, torch.ones(16), name="w"))
        buf.write(0, torch.zeros(16), name="next")
        _KEPT[0].sum()  # a stale use, recorded
        return sanitizer.report(final=True)


def _clean() -> dict:
    """A process's report with no finding (a launcher's)."""
    rep = dict(_retaining(), error_count=0, errors=[], events=[], retained_stale_leases=[])
    rep["summary"] = R.summarize(rep)
    return rep


def _as(rep: dict, pid: int, rank=None, world_size=None, worker=None) -> dict:
    """``rep`` as another process's (its records renamed with it)."""
    out = copy.deepcopy(dict(rep, pid=pid, rank=rank, world_size=world_size, worker=worker))
    for key in ("errors", "events"):
        out[key] = [dict(e, pid=pid) for e in out[key]]
    return out


def test_the_skeleton_names_the_schemas_top_level_keys_and_every_writer_starts_from_it():
    keys = set(report_skeleton.skeleton())
    schema_keys = set(R.schema()["properties"])
    assert keys | set(report_skeleton.EXTRA_KEYS) == schema_keys | {"ended_before_report"}
    assert set(R.schema()["required"]) - {"summary"} <= keys
    rep = _retaining()
    assert list(rep)[:len(keys)] == list(report_skeleton.skeleton())  # the runtime's report: the skeleton's order
    assert rep["worker"] is None and rep["local_rank"] is None  # a plain process
    with pytest.raises(KeyError, match="'nope' is not a report key"):
        report_skeleton.skeleton(nope=1)


def test_a_report_written_before_the_labels_still_validates():
    rep = _retaining()
    for key in ("local_rank", "worker"):
        del rep[key]
    assert R.validate(rep) == []


def test_merge_labels_dataloader_and_ray_workers_and_claims_no_processs_rank():
    rep = _retaining()
    merged = R.merge([_as(_clean(), 10), _as(rep, 11, worker={"kind": "dataloader", "id": 1, "num_workers": 2}),
                      _as(rep, 12, rank=1, world_size=2, worker={"kind": "ray", "id": "0c1ca65b",
                                                                 "actor": "8be33c54", "actor_name": None})])
    assert R.validate(merged) == []
    labels = {e["pid"]: e["process"] for e in merged["errors"]}
    assert labels == {11: "DataLoader worker 1 (pid 11)", 12: "rank 1, Ray worker 0c1ca65b, actor 8be33c54 (pid 12)"}
    assert merged["rank"] is None and merged["world_size"] == 2  # not the first process's rank for all
    text = format_triage(merged, "m.json")
    header = text.splitlines()[1]
    assert "rank 1 of" not in header and "DataLoader worker 1 (pid 11)" in header and "pid 10" in header
    assert "kept in rank 1, Ray worker 0c1ca65b, actor 8be33c54 (pid 12); DataLoader worker 1 (pid 11)" in text
    assert "in rank 1, Ray worker 0c1ca65b, actor 8be33c54 (pid 12) (1); DataLoader worker 1 (pid 11) (1)" in text


def test_torchrun_header_names_each_rank_never_the_first_ones_for_all():
    rep = _retaining()
    merged = R.merge([_as(_clean(), 20), _as(_clean(), 21, rank=0, world_size=2),
                      _as(rep, 22, rank=1, world_size=2)])
    text = format_triage(merged, "m.json")
    assert "(3 processes: rank 0 (pid 21); rank 1 (pid 22); pid 20)" in text.splitlines()[1]
    assert "kept in rank 1 (pid 22)" in text and "rank 0 of 2" not in text
    single = format_triage(_as(rep, 22, rank=1, world_size=2), "one.json")
    assert "(rank 1 of 2 (pid 22))" in single.splitlines()[1]


def test_a_merged_report_merges_again_process_by_process(tmp_path):
    """A Ray driver's collected report, read by ownsan run's merge beside the driver's own."""
    rep = _retaining()
    ray = R.merge([_as(rep, 31, worker={"kind": "ray", "id": "aaaa", "actor": None}),
                   _as(rep, 32, worker={"kind": "ray", "id": "bbbb", "actor": None})])
    outer = R.merge([_as(_clean(), 30), ray])
    assert R.validate(outer) == []
    assert [p["pid"] for p in outer["processes"]] == [30, 31, 32]
    assert {e["process"] for e in outer["errors"]} == {"Ray worker aaaa, tasks (pid 31)",
                                                       "Ray worker bbbb, tasks (pid 32)"}
    assert outer["error_count"] == 2 and outer["summary"]["retentions"] == 2


def test_collect_says_an_unreadable_file_in_one_line_and_merges_the_others(tmp_path):
    rep = _retaining()
    for pid in (41, 42):
        (tmp_path / f"report-{pid}.json").write_text(json.dumps(_as(rep, pid)))
    (tmp_path / "report-43.json").write_text("{not json")
    (tmp_path / "report-44.json").write_text(json.dumps(dict(_as(rep, 44), error_count="many")))
    found = collect.collect([str(tmp_path)])
    assert sorted(p["pid"] for p in found.report["processes"]) == [41, 42]
    assert len(found.unreadable) == 2
    assert "report-43.json" in found.unreadable[0] and "is not JSON" in found.unreadable[0]
    assert "report-44.json" in found.unreadable[1] and "does not match the report schema" in found.unreadable[1]
    assert all("\n" not in line for line in found.unreadable)
    assert found.failing() and collect.failing(found.report)
    assert not collect.failing(_clean())
    assert not collect.failing(dict(_clean(), error_count=0), fail_on_retention=False)


def test_the_ray_collect_and_ownsan_run_treat_an_unreadable_file_alike(tmp_path, capsys, monkeypatch):
    """Before: ray_env.collect skipped it silently, ownsan run said it and failed."""
    from sanitizer.tools import ray_env

    rep = _retaining()
    (tmp_path / "report-51.json").write_text(json.dumps(_as(rep, 51)))
    (tmp_path / "report-52.json").write_text("")
    monkeypatch.delenv(collect.ENV_RUN_DIR, raising=False)
    merged = ray_env.collect(str(tmp_path), settle_s=0)
    assert merged["pid"] == 51
    err = capsys.readouterr().err
    assert "1 process left a file that cannot be read" in err and "report-52.json" in err


def test_ray_collect_under_ownsan_run_hands_the_workers_reports_to_the_run(tmp_path, monkeypatch):
    from sanitizer.tools import ray_env

    workers, run_dir = tmp_path / "workers", tmp_path / "run"
    workers.mkdir()
    run_dir.mkdir()
    rep = _retaining()
    for pid in (61, 62):
        (workers / f"report-{pid}.json").write_text(json.dumps(_as(rep, pid, worker={"kind": "ray", "id": str(pid)})))
    monkeypatch.setenv(collect.ENV_RUN_DIR, str(run_dir))
    ray_env.collect(str(workers), settle_s=0)
    (run_dir / "report-60.json").write_text(json.dumps(_as(_clean(), 60)))  # the driver's own, at its exit
    found = cli._process_reports(str(run_dir))  # what ownsan run merges
    assert sorted(p["pid"] for p in found.report["processes"]) == [60, 61, 62]
    assert found.report["error_count"] == 2 and found.failing()
    text = format_triage(found.report, "r.json")
    assert "kept in Ray worker 61, tasks (pid 61); Ray worker 62, tasks (pid 62)" in text


def test_triage_fails_on_findings_unless_exit_zero(tmp_path, capsys):
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_text(json.dumps(_retaining()))
    good.write_text(json.dumps(_clean()))
    assert cli.main(["triage", str(bad)]) == 1
    assert cli.main(["triage", str(bad), "--exit-zero"]) == 0
    assert cli.main(["triage", str(good)]) == 0
    lenient = dict(_retaining(), error_count=0, errors=[])
    lenient["options"] = dict(lenient["options"], fail_on_retention=False)
    lenient["summary"] = R.summarize(lenient)
    (tmp_path / "lenient.json").write_text(json.dumps(lenient))
    assert cli.main(["triage", str(tmp_path / "lenient.json")]) == 0  # made with fail_on_retention=0
    capsys.readouterr()
    (tmp_path / "broken.json").write_text("[")
    assert cli.main(["triage", str(tmp_path / "broken.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_ownsan_run_exports_its_report_directory(tmp_path):
    out = tmp_path / "env.txt"
    code = cli.main(["run", "-q", "--allow-unsanitized", "--report", str(tmp_path / "r.json"), "--", "python3", "-c",
                     f"import os; open({str(out)!r}, 'w').write(os.environ[{collect.ENV_RUN_DIR!r}])"])
    assert code == 0 and os.path.basename(out.read_text()).startswith("ownsan-")


def test_a_ray_job_that_never_collects_still_has_its_workers_reports_merged_by_ownsan_run(tmp_path, monkeypatch,
                                                                                           capsys):
    """runtime_env redirects the workers' reports away from the run's directory: without a collect() call the
    run printed "0 errors; no retentions" and passed. runtime_env leaves a pointer there; the run merges a
    pointed directory that collect() never handed over (said in one line), and only that one."""
    from sanitizer.tools import ray_env

    workers, run_dir = tmp_path / "workers", tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv(collect.ENV_RUN_DIR, str(run_dir))
    ray_env.runtime_env(str(workers))
    rep = _retaining()
    (workers / "report-71.json").write_text(json.dumps(_as(rep, 71, worker={"kind": "ray", "id": "71"})))
    (run_dir / "report-70.json").write_text(json.dumps(_as(_clean(), 70)))  # the driver's own
    found = cli._process_reports(str(run_dir))
    assert found.report is not None and found.report["error_count"] == 1 and found.failing()
    lines = [line for line in capsys.readouterr().err.splitlines() if "never collected" in line]
    assert len(lines) == 1 and str(workers) in lines[0] and "collect() before ray.shutdown()" in lines[0], lines
    ray_env.collect(str(workers), settle_s=0)  # handed over: merged once, no line
    found = cli._process_reports(str(run_dir))
    assert found.report["error_count"] == 1 and sorted(p["pid"] for p in found.report["processes"]) == [70, 71]
    assert "never collected" not in capsys.readouterr().err
