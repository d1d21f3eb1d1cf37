"""``ownsan audit``: exit codes, the four formats (JSON validated against the shipped schema, SARIF's
shape), suppression comments, --select/--ignore, and that it never imports torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sanitizer.audit import cli as audit_cli
from sanitizer.audit.formats import SCHEMA_FILE
from sanitizer.tools import cli
from conftest import ROOT


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """Overrides conftest's: the audit never touches the sanitizer's runtime (and must not import torch),
    so there is nothing to reset between these tests."""
    yield


RETAINING = textwrap.dedent('''
    def load_weights(weights):
        side = []
        for name, w in weights:
            side.append((name, w))
        everything = list(weights)
        return side, everything
''')
CLEAN = "def load_weights(model, weights):\n    for name, w in weights:\n        model[name].copy_(w)\n"


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "retaining.py").write_text(RETAINING)
    (tmp_path / "clean.py").write_text(CLEAN)
    return tmp_path


def _run(capsys, *argv):
    code = cli.main(["audit", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_exit_status_is_0_when_clean_1_when_found_2_on_usage_errors(tree, capsys):
    assert _run(capsys, str(tree / "clean.py"))[0] == 0
    code, out, _ = _run(capsys, str(tree))
    assert code == 1 and "OWN101" in out and "OWN103" in out
    code, _, err = _run(capsys, str(tree / "missing.py"))
    assert code == 2 and "missing.py: no such file or directory" in err
    (tree / "broken.py").write_text("def f(:\n    pass\n")
    code, out, _ = _run(capsys, str(tree))
    assert code == 2 and "broken.py:1:" in out and "does not parse" in out  # named, the rest still audited
    assert "OWN101" in out
    code, _, err = _run(capsys, "--select", "OWN999", str(tree / "clean.py"))
    assert code == 2 and "OWN999" in err
    assert _run(capsys, "--exit-zero", str(tree / "retaining.py"))[0] == 0


def test_text_output_has_location_function_pattern_chain_and_fix(tree, capsys):
    _, out, _ = _run(capsys, str(tree / "retaining.py"))
    first = out.splitlines()[0]
    assert first.startswith(f"{tree / 'retaining.py'}:5:9: OWN101 ")
    assert "    in `load_weights`: side list" in out
    assert "    chain: `weights` is a weights iterator" in out and "-> `side.append((name, w))` (line 5)" in out
    assert "    fix: own it where it is kept: `sanitizer.own(t)` or `t.clone()`" in out
    assert out.rstrip().splitlines()[-1].startswith("ownsan audit: 2 findings in 1 function")


def test_concise_is_one_line_per_finding(tree, capsys):
    _, out, _ = _run(capsys, "--format", "concise", str(tree / "retaining.py"))
    lines = out.splitlines()
    assert len(lines) == 2 and all(": OWN10" in line for line in lines)


def test_json_matches_the_shipped_schema(tree, capsys):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the test extra) validates the schema")
    _, out, _ = _run(capsys, "--format", "json", str(tree))
    doc = json.loads(out)
    with open(SCHEMA_FILE, encoding="utf-8") as fh:
        schema = json.load(fh)
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema)
    f = doc["findings"][0]
    assert {"path", "line", "col", "end_line", "function", "code", "pattern", "message", "chain", "fix"} <= set(f)
    assert doc["summary"]["findings"] == 2 and doc["summary"]["by_code"] == {"OWN101": 1, "OWN103": 1}
    broken = {**doc, "findings": [{**f, "code": "OWN999"}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_the_schema_ships_with_the_package():
    import sanitizer.audit

    assert os.path.dirname(SCHEMA_FILE) == os.path.dirname(sanitizer.audit.__file__)
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:
        text = fh.read()
    assert '"sanitizer.audit" = ["findings_schema.json"]' in text and '"sanitizer.audit"' in text


def test_sarif_is_2_1_0_with_rules_results_and_locations(tree, capsys):
    _, out, _ = _run(capsys, "--format", "sarif", "--output", str(tree / "out.sarif"), str(tree / "retaining.py"))
    assert out == ""
    doc = json.loads((tree / "out.sarif").read_text())
    assert doc["version"] == "2.1.0" and doc["$schema"].endswith("sarif-2.1.0.json")
    (run,) = doc["runs"]
    rules = run["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules][:3] == ["OWN101", "OWN102", "OWN103"]
    assert all(r["shortDescription"]["text"] and r["help"]["text"] for r in rules)
    res = run["results"]
    assert [r["ruleId"] for r in res] == ["OWN101", "OWN103"]
    for r in res:
        assert rules[r["ruleIndex"]]["id"] == r["ruleId"] and r["level"] == "error"
        loc = r["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uri"].endswith("retaining.py") and loc["region"]["startLine"] >= 1
        assert r["locations"][0]["logicalLocations"][0]["fullyQualifiedName"] == "load_weights"
        assert r["codeFlows"][0]["threadFlows"][0]["locations"] and r["partialFingerprints"]
    assert run["invocations"][0]["executionSuccessful"] is True


def test_suppression_comments(tmp_path, capsys):
    src = textwrap.dedent('''
        def load_weights(weights):
            a, b, c = [], [], []
            s = "# ownsan: ignore"
            for name, w in weights:
                a.append(w)  # ownsan: ignore[OWN101]
                b.append(w)  # ownsan: ignore
                c.append(w)  # ownsan: ignore[OWN103]
                a.append(w); s.join("# ownsan: ignore")
            return a, b, c
    ''')
    (tmp_path / "m.py").write_text(src)
    code, out, _ = _run(capsys, "--format", "concise", str(tmp_path / "m.py"))
    lines = out.splitlines()
    assert code == 1 and [line.split(":")[1] for line in lines] == ["8", "9"]
    _, out, _ = _run(capsys, str(tmp_path / "m.py"))
    assert "2 suppressed" in out


def test_select_and_ignore(tree, capsys):
    _, out, _ = _run(capsys, "--format", "concise", "--select", "OWN103", str(tree))
    assert [line.split()[1] for line in out.splitlines()] == ["OWN103"]
    _, out, _ = _run(capsys, "--format", "concise", "--ignore", "OWN103,OWN102", str(tree))
    assert [line.split()[1] for line in out.splitlines()] == ["OWN101"]
    code, out, _ = _run(capsys, "--format", "concise", "--select", "OWN10", "--ignore", "OWN101,OWN103", str(tree))
    assert code == 0 and out == ""


def test_python_m_sanitizer_audit_never_imports_torch(tree):
    corpus = os.path.join(ROOT, "tests", "audit_corpus")
    code = (f"import sys, runpy\nsys.argv = ['ownsan', 'audit', '--format', 'json', '--output', {str(tree / 'o.json')!r}, "
            f"{corpus!r}]\ntry:\n    runpy.run_module('sanitizer', run_name='__main__')\nexcept SystemExit as e:\n"
            f"    rc = e.code\nheavy = [m for m in ('torch', 'numpy', 'numba', 'sanitizer.torch_layer') "
            f"if m in sys.modules]\nprint(rc, heavy)\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code], cwd=str(tree), capture_output=True, text=True, timeout=120,
                         env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "1 []"
    assert json.loads((tree / "o.json").read_text())["summary"]["findings"] > 50


def test_audit_help_is_its_own_and_lists_the_codes(capsys):
    assert audit_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ownsan audit") and "OWN101" in out and "OWN120" in out and "--report" in out


@pytest.mark.parametrize("columns", [60, 100, 200])
def test_audit_help_gives_each_codes_whole_meaning_wrapped_to_the_terminal(columns, monkeypatch, capsys):
    """Once cut at the first parenthesis ("OWN101 container-store: a yielded tensor")."""
    from sanitizer.audit.codes import CODES

    monkeypatch.setenv("COLUMNS", str(columns))
    assert audit_cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("codes:\n"):].split("\n\n")[0].splitlines()[1:]
    entries = {}  # code -> its lines joined: a line that starts with a code opens an entry, the rest continue it
    for line in block:
        if line.strip().split()[0] in CODES and not line.startswith(" " * 8):
            current = line.split()[0]
            entries[current] = line.split(None, 1)[1]
            continue
        assert line.startswith(" " * 8), line  # a hanging indent under the code column
        entries[current] += " " + line.strip()
    assert list(entries) == list(CODES)
    for code, c in CODES.items():
        assert entries[code] == f"{c.name}: {' '.join(c.meaning.split())}", code
    assert all(len(line) < columns for line in block)


def test_the_pre_commit_hooks_run_ownsan_audit():
    path = os.path.join(ROOT, ".pre-commit-hooks.yaml")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        import yaml
    except ImportError:  # PyYAML is not a dependency: check the lines pre-commit reads
        ids = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("- id:")]
        assert ids == ["ownsan-audit", "ownsan-audit-isolated"] and text.count("entry: ownsan audit") == 2
        return
    hooks = yaml.safe_load(text)
    assert [h["id"] for h in hooks] == ["ownsan-audit", "ownsan-audit-isolated"]
    for hook in hooks:
        assert hook["entry"].startswith("ownsan audit") and hook["types"] == ["python"]
        assert {"name", "language"} <= set(hook)
