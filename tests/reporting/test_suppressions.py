"""Runtime suppressions (issue 51 item 2): ``suppressions=FILE`` names findings a team knows about (LSan's
``leak:PATTERN`` lines); they are listed in the report as suppressed, counted apart, never printed and never
fail the run. Before, the only lever was ``fail_on_retention=0``, for everything."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sanitizer.core import options as option_table
from sanitizer.core import suppressions

PROGRAM = textwrap.dedent('''
    import torch, sanitizer
    buf = sanitizer.StagingBuffer(1024)
    router, gate = {}, []
    buf.write(0, torch.ones(16))
    router["w"] = buf.lend(0, (8,), torch.float32, name="layers.0.router.weight")
    gate.append(buf.lend(32, (8,), torch.float32, name="layers.0.gate.weight"))
    buf.write(0, torch.zeros(16))
    print(float(router["w"].sum()))
''')


def _run(tmp_path, rules: str):
    (tmp_path / "prog.py").write_text(PROGRAM)
    (tmp_path / "rules.txt").write_text(rules)
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-o", f"suppressions={tmp_path / 'rules.txt'}",
                          "--report", str(tmp_path / "r.json"), "--", sys.executable, "prog.py"],
                         capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    return out, json.loads((tmp_path / "r.json").read_text())


def test_a_suppressed_finding_is_listed_counted_apart_and_does_not_fail_the_run(tmp_path):
    out, rep = _run(tmp_path, "# the router cache: upstream fix pending\nretention:*router*\n"
                              "stale_use:layers.*.router.weight\nretention:layers.*.gate.weight\n")
    assert out.returncode == 0, out.stderr  # every finding named: the run passes
    assert rep["error_count"] == 0 and rep["summary"]["retentions"] == 0
    assert rep["summary"]["suppressed"] == {"errors": 1, "retentions": 2}
    assert [e["suppressed"].split(" (")[0] for e in rep["errors"]] == ["stale_use:layers.*.router.weight"]
    assert "1 error and 2 retentions suppressed" in out.stderr
    # the suppressed stale read is not shown as the run's first error (a blind user's case: it was)
    assert "errors (first of each kind)" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert "borrowed view 'layers.0.router.weight'" not in out.stderr.split("ownership-sanitizer: 0 errors")[0]


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_what_the_file_does_not_name_still_fails_the_run(tmp_path):
    out, rep = _run(tmp_path, "retention:*router*\n")
    assert out.returncode == 1, out.stderr  # the stale read and the gate's retention are not named
    assert rep["error_count"] == 1 and rep["summary"]["retentions"] == 1
    assert rep["summary"]["suppressed"] == {"errors": 0, "retentions": 1}


@pytest.mark.parametrize("text, says", [
    ("leak:foo\n", "KIND:PATTERN"),
    ("retention:\n", "the pattern is empty"),
    ("no colon here\n", "KIND:PATTERN"),
])
def test_a_bad_rule_is_one_line_naming_the_file_the_line_and_the_value(tmp_path, text, says):
    path = tmp_path / "rules.txt"
    path.write_text("# a comment\n\n" + text)
    with pytest.raises(option_table.OptionError) as caught:
        option_table.resolve({"suppressions": str(path)})
    assert f"{path}:3" in str(caught.value) and says in str(caught.value)
    out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-o", f"suppressions={path}", "--", sys.executable,
                          "-c", "pass"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{path}:3" in out.stderr and "Traceback" not in out.stderr


def test_a_guessed_store_site_is_matched_by_none_and_said_as_a_guess():
    """Two stores into one dict: the run cannot tell which statement stored which view. The error text said
    the first candidate as if known (blaming the wrong line for the other view); it now says "one of", and a
    rule naming one of the candidate lines does not match on that guess."""
    from sanitizer.core.errors import fix_site

    holder = {"kind": "global", "path": "__main__.kept['gate']", "consumer": "__main__.kept[*]",
              "stored_at": {"file": "p.py", "line": 5, "function": "keep_router"},
              "stored_candidates": [{"file": "p.py", "line": 5, "function": "keep_router"},
                                    {"file": "p.py", "line": 7, "function": "keep_gate"}]}
    assert fix_site(holder) == "one of p.py:5, p.py:7"
    record = {"kind": "retention", "lease": {"name": "layers.0.gate.weight"}, "holder": holder}
    rules = suppressions.parse("retention:keep_router\n")
    assert suppressions.match(rules, record) is None
    assert suppressions.match(suppressions.parse("retention:__main__.kept*\n"), record) is not None


def _run_in_project(tmp_path, table: str, rules: str = ""):
    """``ownsan run`` in a project whose pyproject.toml has ``table`` (no ``-o suppressions=``), from a
    sub-directory: the nearest table is found above the current directory, as the audit finds it."""
    (tmp_path / "pyproject.toml").write_text(table)
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "rules.txt").write_text(rules)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "prog.py").write_text(PROGRAM)
    return subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(tmp_path / "r.json"), "--",
                           sys.executable, "prog.py"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path / "src"))


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_the_projects_tool_ownsan_table_names_the_suppressions_file_for_ownsan_run(tmp_path):
    """``[tool.ownsan] suppressions`` (relative to the pyproject.toml) works as ``-o suppressions=`` does: one
    table holds a project's ownsan settings (the audit's keys beside it)."""
    out = _run_in_project(tmp_path, '[tool.ownsan]\nsuppressions = "ci/rules.txt"\nignore = ["OWN107"]\n',
                          "retention:*router*\nstale_use:layers.*.router.weight\nretention:layers.*.gate.weight\n")
    assert out.returncode == 0, out.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["summary"]["suppressed"] == {"errors": 1, "retentions": 2}


@pytest.mark.parametrize("table, rules, says", [
    ('[tool.ownsan]\nsuppressions = 3\n', "", "suppressions must be a file name"),
    ('[tool.ownsan]\nsuppressions = "ci/rules.txt"\n', "leak:foo\n", "rules.txt:1: 'leak:foo'"),
    ('[tool.ownsan]\nsuppressions = "ci/none.txt"\n', "", "none.txt"),
])
def test_a_bad_project_suppressions_entry_is_one_line_before_anything_runs(tmp_path, table, rules, says):
    out = _run_in_project(tmp_path, table, rules)
    assert out.returncode == 2 and not (tmp_path / "r.json").exists(), out.stderr
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "pyproject.toml" in out.stderr, out.stderr  # one line, naming the table


def test_an_explicit_option_beats_the_projects_table(tmp_path):
    (tmp_path / "mine.txt").write_text("*:*\n")
    (tmp_path / "pyproject.toml").write_text('[tool.ownsan]\nsuppressions = "missing.txt"\n')
    from sanitizer.tools.project_settings import suppressions_for, with_project_suppressions

    assert suppressions_for(str(tmp_path)) == str(tmp_path / "missing.txt")
    mine = str(tmp_path / "mine.txt")
    assert with_project_suppressions({"suppressions": mine}, str(tmp_path)) == {"suppressions": mine}


def test_a_suppressed_stale_use_does_not_halt_the_default_mode(tmp_path):
    """halt_on_error=1 (the default) raised the stale read the file names, though the option says a
    suppressed finding never fails the run (a blind user's case): now it is recorded, listed as
    suppressed, and the program goes on, as ASan's suppressions let a known report through."""
    (tmp_path / "prog.py").write_text(PROGRAM + "\nimport json; print(json.dumps(sanitizer.report(final=True)"
                                                "['summary']['suppressed']))\n")
    (tmp_path / "rules.txt").write_text("stale_use:layers.*.router.weight\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env.update(OWNERSHIP_SANITIZE="1", OWNERSHIP_SANITIZE_OPTIONS=f"suppressions={tmp_path / 'rules.txt'}")
    out = subprocess.run([sys.executable, "prog.py"], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path), env=env)
    assert out.returncode == 0 and "StaleBorrowError" not in out.stderr, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["errors"] == 1, out.stdout
    (tmp_path / "rules.txt").write_text("stale_use:layers.*.gate.weight\n")  # not the one read: it halts
    out = subprocess.run([sys.executable, "prog.py"], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path), env=env)
    assert out.returncode != 0 and "StaleBorrowError" in out.stderr, out.stderr
