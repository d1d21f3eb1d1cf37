"""The JSON report: versioned, valid against its shipped schema, summarised by retaining consumer."""
from __future__ import annotations

import copy
import importlib
import json
import os

import pytest
import torch

import sanitizer
from sanitizer.features import holders
from sanitizer.features import triage
from sanitizer.core.errors import BorrowCorruptedError
from sanitizer.reporting.schema import SchemaError, validate
from conftest import run_python

R = importlib.import_module("sanitizer.reporting.report")  # `sanitizer.reporting.report` is also the function
_KEPT: list = []
_OTHER: dict = {}


@pytest.fixture(autouse=True)
def _fresh():
    triage.clear()
    holders.forget_patterns()
    _KEPT.clear()
    _OTHER.clear()
    yield
    triage.clear()
    _KEPT.clear()
    _OTHER.clear()


def _scenario() -> dict:
    """Two retaining consumers (one of them read stale), a checksum mismatch record, a clean buffer."""
    buf = sanitizer.StagingBuffer(1 << 16, name="ring0")
    with sanitizer.sanitize(triage=1, triage_budget_ms=10000):
        for i in range(3):
            _KEPT.append(buf.write(0, torch.full((32, 32), float(i)), name=f"layers.{i}.w"))
        _OTHER["layers.9.bias"] = buf.write(0, torch.ones(8), name="layers.9.bias")
        buf.write(0, torch.zeros(4), name="next")
        _KEPT[0].sum()  # a stale use, recorded
        lease = sanitizer.lease_of(_KEPT[1])
        mismatch = BorrowCorruptedError(lease, 1, 2, "verify", ())
        sanitizer.torch_layer.runtime.raise_or_record(mismatch, lease)  # triage=1: recorded, not raised
        return sanitizer.report(final=True)


def test_report_validates_against_the_shipped_schema():
    rep = _scenario()
    assert rep["format"] == R.FORMAT and rep["version"] == R.VERSION == 2
    assert R.validate(rep) == [], R.validate(rep)
    kinds = {e["kind"] for e in rep["errors"]} | {e["kind"] for e in rep["events"]}
    assert {"stale_use", "checksum_mismatch", "retention"} <= kinds
    assert json.loads(json.dumps(rep)) == rep  # JSON-ready as it is
    with open(R.SCHEMA_PATH, encoding="utf-8") as fh:
        assert json.load(fh)["properties"]["version"]["const"] == R.VERSION


def test_rescue_and_clone_events_validate_too():
    buf = sanitizer.StagingBuffer(4096, name="ring0")
    with sanitizer.sanitize(rescue=1, triage=1):
        _KEPT.append(buf.write(0, torch.ones(16), name="kept"))
        buf.write(0, torch.zeros(16), name="next")
        rep = sanitizer.report(final=True)
    kinds = [e["kind"] for e in rep["events"]]
    assert "rescue" in kinds and "retention" in kinds
    assert R.validate(rep) == []
    assert float(_KEPT[0].sum()) == 16.0  # rescued: still its own bytes
    sanitizer.rescues  # noqa: B018 (public API present)
    from sanitizer.features import rescue

    rescue.clear()


def test_schema_catches_a_broken_report():
    rep = _scenario()
    bad = copy.deepcopy(rep)
    del bad["errors"][0]["lease"]["dtype"]
    first = next(i for i, e in enumerate(bad["events"]) if e["kind"] == "retention")
    bad["events"][first]["holder"]["kind"] = "ghost"
    bad["pid"] = "12"
    problems = R.validate(bad)
    assert any("$.pid: expected integer" in p for p in problems)
    assert any("$.errors[0]" in p for p in problems)
    assert any(f"$.events[{first}]" in p for p in problems)
    with pytest.raises(SchemaError, match="unsupported schema keywords"):
        validate({}, {"type": "object", "patternProperties": {}})


def test_summary_groups_retentions_by_consumer_biggest_first():
    rep = _scenario()
    s = rep["summary"]
    top, second = s["retaining_consumers"]
    assert top["consumer"] == f"{__name__}._KEPT[*]" and top["count"] == 3 and top["bytes"] == 3 * 32 * 32 * 4
    assert top["kind"] == "global" and top["site"].endswith(f"test_report.py:{_line('_KEPT: list')}")
    assert top["leases"] == ["layers.0.w", "layers.1.w", "layers.2.w"] and top["used_stale"] == 1
    assert second["consumer"] == f"{__name__}._OTHER['layers.*.bias']" and second["bytes"] == 32
    assert top["first"]["lease"]["name"] == "layers.0.w"
    assert s["retentions"] == 4 and s["retained_bytes"] == 3 * 4096 + 32
    assert s["errors_by_kind"] == {"stale_use": 1, "checksum_mismatch": 1}
    assert s["line"].startswith("ownership-sanitizer: 2 errors (1 checksum_mismatch, 1 stale_use); "
                                "4 retentions by 2 consumers (12.0 KiB)")
    assert f"top: {__name__}._KEPT[*]" in s["line"]


def _line(text: str) -> int:
    with open(__file__, encoding="utf-8") as fh:
        return next(i for i, line in enumerate(fh, 1) if text in line)


def test_merge_of_two_processes_validates_and_counts_both():
    rep = _scenario()
    other = copy.deepcopy(rep)
    other["pid"], other["rank"], other["world_size"] = rep["pid"] + 1, 1, 2
    rep = dict(rep, rank=0, world_size=2)
    merged = R.merge([other, rep])
    assert R.validate(merged) == []
    assert [p["rank"] for p in merged["processes"]] == [0, 1]
    assert merged["error_count"] == 2 * rep["error_count"]
    assert merged["summary"]["retaining_consumers"][0]["count"] == 6
    assert R.merge([rep]) is rep
    with pytest.raises(ValueError):
        R.merge([])


def test_load_refuses_what_is_not_a_report(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        R.load(str(p))
    p.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ValueError, match="not an ownership-sanitizer report"):
        R.load(str(p))
    p.write_text(json.dumps({"format": R.FORMAT, "version": 1}))
    with pytest.raises(ValueError, match="version 1"):
        R.load(str(p))
    with pytest.raises(ValueError, match="cannot read report"):
        R.load(str(tmp_path / "missing.json"))


def test_report_at_exit_expands_pid_and_holds_the_retention(tmp_path):
    code = """
import torch, sanitizer
KEPT = []
buf = sanitizer.StagingBuffer(4096, name="ring0")
def main():
    for i in range(4):
        KEPT.append(buf.write(0, torch.ones(16) * i, name=f"w{i}"))
main()
"""
    out = run_python(code, {"OWNERSHIP_SANITIZE": "1",
                            "OWNERSHIP_SANITIZE_OPTIONS": f"triage=1:report={tmp_path}/r-{{pid}}.json"})
    assert out.returncode == 0, out.stderr
    (path,) = list(tmp_path.glob("r-*.json"))
    rep = R.load(str(path))
    assert R.validate(rep) == []
    assert path.name == f"r-{rep['pid']}.json"
    assert rep["summary"]["retaining_consumers"][0]["consumer"] == "__main__.KEPT[*]"
    assert rep["summary"]["retentions"] == 3  # w3 was never retired
    assert os.path.basename(rep["argv"][0]) == "-c"
