"""Recover mode speaks (issue 51 item 1): with ``halt_on_error=0`` each error is printed as it is found, once
per distinct use site, a summary line ends the run, and ``exitcode=`` sets the exit status when an error was
recorded, as ASan's recover mode and its ``exitcode`` option do. Before, the run printed nothing and exited 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent('''
    import torch, sanitizer
    buf = sanitizer.StagingBuffer(1024)
    kept = []
    for i in range(3):
        buf.write(0, torch.full((16,), float(i)))
        kept.append(buf.lend(0, (16,), torch.float32, name=f"w{i}"))
    for k in kept:
        print(float(k.sum()))          # two stale views read at this line
    for k in kept:
        print(float(k.sum()))          # and again at this one
''')


def _run(tmp_path, options: str):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, OWNERSHIP_SANITIZE="1", OWNERSHIP_SANITIZE_OPTIONS=options)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=str(tmp_path))


def test_recover_mode_prints_each_distinct_site_once_and_a_summary(tmp_path):
    out = _run(tmp_path, "halt_on_error=0")
    assert out.returncode == 0, out.stderr  # no exitcode asked: the program's own status
    reports = [line for line in out.stderr.splitlines() if line.startswith("ownership-sanitizer: borrowed view")]
    assert len(reports) == 2, out.stderr  # 4 stale reads at 2 sites: each site once
    assert "used at" in out.stderr and "prog.py:9" in out.stderr and "prog.py:11" in out.stderr
    summary = [line for line in out.stderr.splitlines() if "recover mode" in line]
    assert len(summary) == 1 and "recorded 4 errors at 2 sites" in summary[0], out.stderr
    assert out.stdout.split() == ["nan", "nan", "32.0"] * 2  # the program went on, reading the guard's NaN


def test_exitcode_sets_the_status_after_the_report_is_written(tmp_path):
    report = tmp_path / "r.json"
    out = _run(tmp_path, f"halt_on_error=0:exitcode=23:report={report}")
    assert out.returncode == 23, out.stderr
    assert "exit status 23" in out.stderr
    rep = json.loads(report.read_text())  # written before the status was forced
    assert rep["error_count"] == 4


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_print_errors_0_is_silent_and_a_clean_run_says_nothing(tmp_path):
    out = _run(tmp_path, "halt_on_error=0:print_errors=0")
    assert out.returncode == 0 and "ownership-sanitizer" not in out.stderr, out.stderr
    script = tmp_path / "clean.py"
    script.write_text("import torch, sanitizer\nb = sanitizer.StagingBuffer(64)\n"
                      "print(float(b.lend(0, (4,), torch.float32).sum()))\n")
    env = dict(os.environ, OWNERSHIP_SANITIZE="1", OWNERSHIP_SANITIZE_OPTIONS="halt_on_error=0:exitcode=9")
    clean = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert clean.returncode == 0 and "ownership-sanitizer" not in clean.stderr, clean.stderr


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
@pytest.mark.parametrize("value", ["-1", "256", "x"])
def test_a_bad_exitcode_is_one_line_naming_it(tmp_path, value):
    out = _run(tmp_path, f"halt_on_error=0:exitcode={value}")
    assert out.returncode != 0
    assert "exitcode" in out.stderr and value in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_a_sanitize_blocks_errors_are_its_callers_not_printed(tmp_path):
    """`with sanitizer.sanitize(halt_on_error=0):` in a test reads its errors with sanitizer.errors(): the
    process's recover mode neither prints nor counts them (the project's own suite printed 32 reports)."""
    script = tmp_path / "scoped.py"
    script.write_text(textwrap.dedent('''
        import torch, sanitizer
        with sanitizer.sanitize(halt_on_error=0):
            buf = sanitizer.StagingBuffer(256)
            buf.write(0, torch.ones(4))
            a = buf.lend(0, (4,), torch.float32)
            buf.write(0, torch.zeros(4))
            float(a.sum())
            print(len(sanitizer.errors()))
    '''))
    env = dict(os.environ, OWNERSHIP_SANITIZE="1", OWNERSHIP_SANITIZE_OPTIONS="halt_on_error=0:exitcode=5")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "1", out.stderr
    assert "ownership-sanitizer" not in out.stderr, out.stderr


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_the_summary_names_the_report_as_written_and_ownsan_runs_mode(tmp_path):
    """Found by a user writing from the docs alone: the summary printed `report=...{pid}...` unexpanded, and
    under ownsan run named the run's temporary file and said halt_on_error=0 where triage=1 was in force."""
    out = _run(tmp_path, f"halt_on_error=0:report={tmp_path}/p-{{pid}}.json")
    line = [x for x in out.stderr.splitlines() if "recover mode" in x][0]
    assert "{pid}" not in line and "report: " + str(tmp_path) + "/p-" in line, line
    script = tmp_path / "prog.py"
    run = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-q", "--report", str(tmp_path / "m.json"), "--",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert run.returncode == 1
    line = [x for x in run.stderr.splitlines() if "recover mode" in x][0]
    assert "recover mode (triage=1)" in line and "report:" not in line, line
