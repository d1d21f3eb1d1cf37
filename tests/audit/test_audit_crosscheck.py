"""Static meets dynamic: ``ownsan audit --report`` marks the findings a sanitized run confirmed and lists
the retentions the run saw that the audit missed. The report comes from a real ``ownsan run`` of a small
retaining program (safe_open served from a small reused ring, as a borrowing loader does)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sanitizer.audit import audit_paths
from sanitizer.audit.crosscheck import crosscheck, load_report, ReportError
from sanitizer.tools import cli
from conftest import ROOT


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """Overrides conftest's: this module runs the sanitizer only in a child process."""
    yield


# Model.load_weights keeps even layers in self.pending (the audit sees it); odd layers go through
# self.keeper.keep(), a call through an attribute the audit does not resolve (so it misses that one).
PROGRAM = textwrap.dedent('''
    import sys

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file


    class Keeper:
        def __init__(self):
            self.items = []

        def keep(self, name, w):
            self.items.append(w)


    class Model:
        def __init__(self):
            self.pending = {}
            self.keeper = Keeper()

        def load_weights(self, weights):
            for name, w in weights:
                if name.endswith(("0.weight", "2.weight", "4.weight")):
                    self.pending[name] = w
                else:
                    self.keeper.keep(name, w)
            total = sum(float(t.sum()) for t in self.pending.values())
            return total + sum(float(t.sum()) for t in self.keeper.items)


    def weights_from(path, names):
        with safe_open(path, framework="pt") as f:
            for n in names:
                yield n, f.get_tensor(n)


    path = sys.argv[1]
    names = [f"layers.{i}.weight" for i in range(6)]
    save_file({n: torch.full((32, 32), float(i)) for i, n in enumerate(names)}, path)
    print("total", Model().load_weights(weights_from(path, names)))
''')
STORE_LINE = next(i for i, line in enumerate(PROGRAM.splitlines(), 1) if "self.pending[name] = w" in line)


@pytest.fixture(scope="module")
def run_report(tmp_path_factory):
    pytest.importorskip("safetensors", reason="the retaining program loads a real .safetensors file")
    tmp = tmp_path_factory.mktemp("audit-run")
    (tmp / "consumer.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-q", "-o", "safetensors_ring=8192:safetensors_strict=1",
                          "--report", "ownsan-report.json", "--", sys.executable, "consumer.py", "ckpt.safetensors"],
                         cwd=str(tmp), env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stderr  # the run itself saw the retentions
    return tmp


@pytest.mark.slow
def test_the_run_confirms_the_finding_and_names_what_the_audit_missed(run_report, capsys, monkeypatch):
    monkeypatch.chdir(run_report)
    code = cli.main(["audit", "--format", "json", "--report", "ownsan-report.json", "consumer.py"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    (finding,) = doc["findings"]
    assert (finding["line"], finding["function"]) == (STORE_LINE, "Model.load_weights")
    assert finding["confirmed"] is True
    assert finding["confirmed_by"][0]["holder"] == "Model.pending[*]"
    assert finding["confirmed_by"][0]["match"] in ("stored_at", "holder class")
    cc = doc["crosscheck"]
    assert cc["retentions"] == 6 and cc["confirmed"] == 1
    (missed,) = cc["missed"]
    assert missed["holder"] == "Keeper.items[*]" and missed["count"] == 3 and missed["kind"] == "object"
    assert missed["site"]["file"].endswith("consumer.py") and missed["site"]["function"] == "Keeper"
    jsonschema = pytest.importorskip("jsonschema")
    from sanitizer.audit.formats import SCHEMA_FILE

    with open(SCHEMA_FILE, encoding="utf-8") as fh:
        jsonschema.validate(doc, json.load(fh))


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_text_output_says_confirmed_and_missed(run_report, capsys, monkeypatch):
    monkeypatch.chdir(run_report)
    cli.main(["audit", "--report", "ownsan-report.json", "consumer.py"])
    out = capsys.readouterr().out
    assert "run: CONFIRMED" in out and "missed: Keeper.items[*] (object, 3x)" in out


def _report(holder: dict) -> dict:
    return {"format": "ownership-sanitizer-report", "version": 2, "errors": [],
            "events": [{"kind": "retention", "lease": {"lease_id": 1}, "holder": holder, "holders": [holder],
                        "lent_at": None, "reused_at": None}]}


def test_stored_at_names_the_statement_exactly(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def load_weights(weights):\n    a, b = [], []\n    for n, w in weights:\n"
                   "        a.append(w)\n        b.append(w)\n    return a, b\n")
    result = audit_paths([str(src)])
    assert [f.line for f in result.findings] == [4, 5]
    holder = {"kind": "frame", "path": "local 'b' of load_weights()", "consumer": "local 'b' of load_weights()",
              "site": {"file": str(src), "line": 6, "function": "load_weights"},
              "stored_at": {"file": str(src), "line": 5, "function": "load_weights"}}
    cc = crosscheck(result, _report(holder), "r.json", result.paths)
    assert [f.confirmed for f in result.findings] == [False, True] and cc["missed"] == []
    # without stored_at, the holder's site (the frame's function) confirms the function's findings
    del holder["stored_at"]
    cc = crosscheck(result, _report(holder), "r.json", result.paths)
    assert [f.confirmed for f in result.findings] == [True, True]
    assert {m["match"] for f in result.findings for m in f.confirmed_by} == {"holder site"}
    # a holder in a function the audit reported nothing for is a miss
    holder["site"]["function"] = "elsewhere"
    cc = crosscheck(result, _report(holder), "r.json", result.paths)
    assert not any(f.confirmed for f in result.findings) and len(cc["missed"]) == 1


def test_a_report_that_is_not_one_is_a_usage_error(tmp_path, capsys):
    (tmp_path / "r.json").write_text('{"format": "something-else"}')
    (tmp_path / "m.py").write_text("x = 1\n")
    with pytest.raises(ReportError, match="not an ownership-sanitizer report"):
        load_report(str(tmp_path / "r.json"))
    assert cli.main(["audit", "--report", str(tmp_path / "r.json"), str(tmp_path / "m.py")]) == 2
    assert cli.main(["audit", "--report", str(tmp_path / "none.json"), str(tmp_path / "m.py")]) == 2
    assert "cannot read report" in capsys.readouterr().err
