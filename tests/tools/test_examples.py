"""The shipped examples say what is true: run plainly and under ``ownsan run``, their output agrees with
itself, with the run's report and with what the README says of them (issue 32)."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return {**env, **extra}


def _steps(stdout: str) -> dict:
    """Each numbered step's text: its heading line and what follows up to the next step."""
    parts = re.split(r"^(?=\d\. )", stdout, flags=re.M)
    return {p[0]: p.strip() for p in parts if re.match(r"\d\. ", p)}


def test_the_quickstart_is_the_one_file_program_the_readme_names():
    text = open(QUICKSTART, encoding="utf-8").read()
    tree = ast.parse(text)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not [m for m in imported if m.startswith("sanitizer.")], imported  # nothing of it lives elsewhere
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    said = re.search(r"examples/quickstart\.py` is the (\d+)-line\s+version", readme)
    assert said, "the README says how long the quick start is"
    assert int(said.group(1)) == len(text.splitlines())


@pytest.mark.slow
def test_the_quickstart_run_plainly_shows_each_step():
    out = subprocess.run([sys.executable, QUICKSTART], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=_env())
    assert out.returncode == 0, out.stderr
    steps = _steps(out.stdout)
    assert sorted(steps) == ["1", "2", "3", "4"]
    assert "reads 2.0" in steps["1"] and "silently" in steps["1"]  # the next tensor's bytes, unsanitized
    for raised in ("2", "4"):
        assert "raises at once" in steps[raised] and "StaleBorrowError" not in steps[raised]
        assert "held by frame local 'kept' of main()" in steps[raised]  # the error's own text, printed
    assert "recorded, not raised" in steps["3"] and "silently" not in out.stdout.replace(steps["1"], "")


@pytest.mark.slow
def test_the_quickstart_under_ownsan_run_says_so_and_agrees_with_the_report(tmp_path):
    report = tmp_path / "r.json"
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(report), "--", sys.executable,
                          QUICKSTART], capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=_env())
    assert out.returncode == 1, out.stdout + out.stderr  # it retains views on purpose: the run fails
    assert "the sanitizer is on from the start (triage=1)" in out.stdout
    assert "silently" not in out.stdout and "1. unsanitized" not in out.stdout  # no read below is unsanitized
    steps = _steps(out.stdout)
    assert sorted(steps) == ["0", "1", "2", "3", "4"]
    for n in "1234":  # each step says what its read did, none is a heading with nothing under it
        assert "recorded, not raised: borrowed view" in steps[n], steps[n]
    rep = json.loads(report.read_text())
    consumers = rep["summary"]["retaining_consumers"]
    # the header's error count is the table's stale reads, and the program's own count of them
    assert rep["error_count"] == sum(g["used_stale"] for g in consumers) == 4
    assert f"sanitizer.report()['error_count'] = {rep['error_count']}" in out.stdout
    # (the program's own recover mode prints each error as found above the run's summary: find the summary)
    assert any(re.match(rf"ownership-sanitizer: {rep['error_count']} errors", line)
               for line in out.stderr.splitlines()), out.stderr
    for line in out.stderr.splitlines():  # a lease name once per row
        if line.strip().startswith("leases:"):
            names = re.findall(r"'[^']*'", line)
            assert len(names) == len(set(names)), line


def _audited_lines(*paths: str, settings=None) -> list:
    from sanitizer.audit import audit_paths

    return sorted((os.path.basename(f.path), f.line, f.code) for f in audit_paths(list(paths), settings=settings).findings)


def _lines_with(path: str, text: str) -> list:
    """The lines of code (not comments) of ``path`` that hold ``text``."""
    return [i for i, line in enumerate(open(path, encoding="utf-8"), 1)
            if text in line and not line.lstrip().startswith("#")]


def test_each_example_the_audit_misses_says_why_and_the_audit_page_names_it():
    page = open(os.path.join(ROOT, "docs", "audit.md"), encoding="utf-8").read()
    examples = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py"))
    for name in examples:  # every example consumer retains on purpose: found, or it says why not
        path = os.path.join(ROOT, "examples", name)
        if not _audited_lines(path):
            assert re.search(r"ownsan audit[` a-z/.]*finds (nothing|this retention only)", open(path).read()), name
            assert f"examples/{name}" in page or f"`{name}`" in page or "test_*_ownership.py" in page, name


def test_the_audit_finds_what_the_examples_say_it_finds(tmp_path):
    from sanitizer.audit import settings as audit_settings

    holders = os.path.join(ROOT, "examples", "several_holders.py")
    assert [line for _, line, _ in _audited_lines(holders)] == _lines_with(holders, "# STORE-")
    reference = os.path.join(ROOT, "sanitizer", "testing", "reference")
    loader = os.path.join(reference, "deferred_loader.py")
    assert ("deferred_loader.py", _lines_with(loader, "info.loaded_weights.append((param_name, bound))")[0],
            "OWN104") in _audited_lines(reference)
    deferred = os.path.join(ROOT, "examples", "test_deferred_loader_ownership.py")
    config = tmp_path / "pyproject.toml"
    config.write_text('[tool.ownsan]\nconsumers = ["LayerwiseLoader.load:tensor"]\n')
    assert _audited_lines(deferred, settings=audit_settings.load(str(config))) == [
        ("test_deferred_loader_ownership.py", _lines_with(deferred, "calls.append(bound)")[0], "OWN104")]
