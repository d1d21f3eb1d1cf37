"""The JSON report: versioned, valid against its shipped schema, summarised by retaining consumer."""
from __future__ import annotations

import copy
import importlib
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sanitizer
import sanitizer.torch_layer.records
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
    triage.reset(records_too=True)
    holders.forget_patterns()
    _KEPT.clear()
    _OTHER.clear()
    yield
    triage.reset(records_too=True)
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
        sanitizer.torch_layer.records.raise_or_record(mismatch, lease)  # triage=1: recorded, not raised
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
    assert second["consumer"] == f"{__name__}._OTHER[*]" and second["bytes"] == 32
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


@pytest.mark.slow
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


# -- the schema validator against the jsonschema package -------------------------------------------
@pytest.mark.parametrize("instance,schema,valid", [
    (3.0, {"type": "integer"}, True),  # a whole-number float is an integer in JSON Schema
    (3.5, {"type": "integer"}, False),
    (True, {"type": "integer"}, False),
    (True, {"type": "number"}, False),
    (True, {"const": 1}, False),  # Python's True == 1 is not JSON equality
    (0, {"enum": [False, "x"]}, False),
    (1.0, {"const": 1}, True),
    ([1.0, {"a": 2}], {"const": [1, {"a": 2.0}]}, True),
    ([True], {"enum": [[1]]}, False),
    ({"n": 2.0}, {"type": "object", "properties": {"n": {"type": "integer", "minimum": 2}}}, True),
    (False, {"minimum": 5}, True),  # minimum constrains numbers only
])
def test_types_and_equality_are_json_schema_not_python(instance, schema, valid):
    assert (validate(instance, schema) == []) is valid, validate(instance, schema)


def _official(schema):
    jsonschema = pytest.importorskip("jsonschema")  # the test extra (only these cross-checks need it)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_shipped_schema_and_reports_agree_with_jsonschema():
    official = _official(R.schema())
    rep = json.loads(json.dumps(_scenario(), default=str))  # as written to disk
    assert R.validate(rep) == [] and official.is_valid(rep)
    whole = copy.deepcopy(rep)
    whole["pid"] = float(whole["pid"])  # 1234.0: valid in both
    assert R.validate(whole) == [] and official.is_valid(whole)
    for mutate in (lambda r: r.__setitem__("pid", True), lambda r: r.__setitem__("pid", "12"),
                   lambda r: r["errors"][0]["lease"].pop("dtype"), lambda r: r.__setitem__("error_count", 1.5),
                   lambda r: r.__setitem__("unexpected_key", 1) if R.schema().get("additionalProperties") is False
                   else r.__setitem__("pid", None)):
        bad = copy.deepcopy(rep)
        mutate(bad)
        assert R.validate(bad) != [] and not official.is_valid(bad)


_KEYS = ("a", "b", "c")
_scalar = (st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, 1.0, -2.0, 2.5, 1e20])
           | st.sampled_from(["", "x", "a"]))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=3), max_leaves=6)


def _twins(v):
    """``v`` and values Python calls equal to it that JSON may not (True/1/1.0), in arrays and objects too."""
    if isinstance(v, bool):
        return [v, int(v), float(v)]
    if isinstance(v, int):
        return [v, float(v)] + ([bool(v)] if v in (0, 1) else [])
    if isinstance(v, float):
        return [v, int(v)] if v.is_integer() else [v]
    if isinstance(v, list):
        return [v, [_twins(x)[-1] for x in v], [v]]
    if isinstance(v, dict):
        return [v, {k: _twins(x)[-1] for k, x in v.items()}]
    return [v]


def _values_in(schema):
    """Every const and enum value (and minimum) anywhere in ``schema``."""
    if isinstance(schema, dict):
        for key, sub in schema.items():
            if key == "const" or key == "minimum":
                yield sub
            elif key == "enum":
                yield from sub
            else:
                yield from _values_in(sub)
    elif isinstance(schema, list):
        for sub in schema:
            yield from _values_in(sub)


def _schemas(depth: int = 2):
    leaf = st.one_of(
        st.builds(lambda t: {"type": t}, st.sampled_from(["object", "array", "string", "integer", "number",
                                                          "boolean", "null"])),
        st.builds(lambda ts: {"type": ts}, st.lists(st.sampled_from(["integer", "string", "null", "boolean"]),
                                                    min_size=1, max_size=2, unique=True)),
        st.builds(lambda v: {"const": v}, _json),
        st.builds(lambda vs: {"enum": vs}, st.lists(_json, min_size=1, max_size=3)),
        st.builds(lambda m: {"minimum": m}, st.sampled_from([0, 1, 1.5, -1])),
        st.builds(lambda n: {"minItems": n}, st.integers(0, 2)),
        st.builds(lambda n: {"maxItems": n}, st.integers(0, 2)),
        st.builds(lambda r: {"required": r}, st.lists(st.sampled_from(_KEYS), max_size=2, unique=True)),
    )
    if depth == 0:
        return leaf
    sub = _schemas(depth - 1)
    return st.one_of(
        leaf,
        st.builds(lambda p, extra: {"type": "object", "properties": p, "additionalProperties": extra},
                  st.dictionaries(st.sampled_from(_KEYS), sub, max_size=2), st.one_of(st.booleans(), sub)),
        st.builds(lambda i: {"items": i}, sub),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(sub, min_size=1, max_size=3)),
        st.builds(lambda n: {"not": n}, sub),
        st.builds(lambda a, b: {**a, **b}, leaf, leaf),
    )


def _root_schemas():
    """A schema, or one whose root holds $defs that a subschema reaches by a local $ref."""
    body = _schemas()
    with_ref = st.builds(lambda d, other, how: {"$defs": {"d": d}, how: [{"$ref": "#/$defs/d"}, other]}
                         if how == "anyOf" else {"$defs": {"d": d}, "items": {"$ref": "#/$defs/d"}, **other},
                         body, _schemas(0), st.sampled_from(["anyOf", "items"]))
    return st.one_of(body, with_ref)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_validator_agrees_with_jsonschema_on_generated_cases(data):
    schema = data.draw(_root_schemas(), label="schema")
    near = sorted({repr(t): t for v in _values_in(schema) for t in _twins(v)}.items())
    instance = data.draw(st.one_of(_scalar, _json, *([st.sampled_from([t for _, t in near])] if near else [])),
                         label="instance")
    assert (validate(instance, schema) == []) is _official(schema).is_valid(instance), validate(instance, schema)


def test_retentions_over_max_records_are_counted_in_the_summary_line():
    """max_records bounds the records kept, not the count a user reads: 29 retentions with 10 kept read as
    29, saying how many were kept (it read as 10, the rest only in records_dropped)."""
    kept = []
    with sanitizer.sanitize(triage=1, halt_on_error=0, report="", max_records=10):
        ring = sanitizer.StagingRing(4096, name="capped")
        for i in range(30):
            kept.append(ring.put(f"w{i}", torch.ones(1024)))
        rep = sanitizer.report(final=True)
    assert validate(rep, R.schema()) == []
    assert rep["events_not_kept"] == {"retention": 19}
    assert rep["summary"]["retentions"] == 10 and rep["summary"]["retentions_not_kept"] == 19
    assert "29 retentions (10 kept: max_records) by 1 consumer" in rep["summary"]["line"]
    merged = R.merge([rep, copy.deepcopy(dict(rep, pid=rep["pid"] + 1))])
    assert merged["events_not_kept"] == {"retention": 38} and "58 retentions (20 kept" in merged["summary"]["line"]
    kept.clear()
