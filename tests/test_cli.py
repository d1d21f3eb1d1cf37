"""``ownsan``: run a program that never imports the sanitizer, triage its report, show options."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from sanitizer.tools import cli
from sanitizer.core import options as option_table
from sanitizer.tools import startup
from conftest import ROOT

# A consumer that defers every weight it is given (never imports sanitizer). Under ownsan run,
# safetensors_ring makes safe_open serve views of a small reused ring, as a borrowing loader does.
SCRIPT = '''
import sys
from dataclasses import dataclass, field
import torch
from safetensors import safe_open
from safetensors.torch import save_file

@dataclass
class DeferredLayer:
    pending: dict = field(default_factory=dict)

path, mode = sys.argv[1], sys.argv[2]
names = [f"layers.{i}.weight" for i in range(6)]
save_file({n: torch.full((32, 32), float(i)) for i, n in enumerate(names)}, path)
layer = DeferredLayer()
with safe_open(path, framework="pt") as f:
    for n in names:
        t = f.get_tensor(n)
        layer.pending[n] = t.clone() if mode == "clone" else t
    total = sum(float(t.sum()) for t in layer.pending.values())
print("total", total)
'''


def _ownsan(*args: str, cwd: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    return subprocess.run([sys.executable, "-m", "sanitizer", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def retaining_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ownsan")
    (tmp / "consumer.py").write_text(SCRIPT)
    out = _ownsan("run", "-o", "safetensors_ring=8192", "--report", "rep.json", "--",
                  sys.executable, "consumer.py", str(tmp / "ckpt.safetensors"), "keep", cwd=str(tmp))
    return tmp, out


def test_run_fails_on_a_retaining_consumer_and_names_it(retaining_run):
    tmp, out = retaining_run
    assert out.returncode == 1, out.stderr
    assert "total" in out.stdout  # triage=1: the program ran to the end
    assert "ownership-sanitizer: " in out.stderr and "stale_use" in out.stderr
    assert "DeferredLayer.pending['layers.*.weight']" in out.stderr  # the triage table's consumer row
    assert "holder lives at " in out.stderr and "consumer.py:" in out.stderr
    rep = json.loads((tmp / "rep.json").read_text())
    assert rep["error_count"] > 0 and rep["summary"]["retaining_consumers"][0]["kind"] == "object"


def test_triage_prints_the_table_sorted_by_bytes(retaining_run, capsys):
    tmp, _ = retaining_run
    assert cli.main(["triage", str(tmp / "rep.json")]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "bytes" in line and "holder" in line)
    assert header.split()[:6] == ["#", "bytes", "count", "stale", "kind", "holder"]
    row = text.splitlines()[text.splitlines().index(header) + 1]
    assert row.split()[0] == "1" and row.rstrip().endswith("DeferredLayer.pending['layers.*.weight']")
    assert "lent at" in text and "reused at" in text and "errors (first of each kind):" in text


def test_run_passes_a_correct_consumer(tmp_path):
    (tmp_path / "consumer.py").write_text(SCRIPT)
    out = _ownsan("run", "-q", "-o", "safetensors_ring=8192", "--report", "rep.json", "--",
                  sys.executable, "consumer.py", str(tmp_path / "ckpt.safetensors"), "clone", cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "total 15360.0" in out.stdout  # the right values
    assert out.stderr.strip().splitlines()[-1] == "ownership-sanitizer: 0 errors; no retentions"


def test_run_passes_the_program_exit_status_through(tmp_path):
    out = _ownsan("run", "--report", "rep.json", "--", sys.executable, "-c", "import torch, sys; sys.exit(7)",
                  cwd=str(tmp_path))
    assert out.returncode == 7, out.stderr


@pytest.mark.parametrize("argv, message", [
    (["run", "-o", "bogus=1", "--", "python", "x.py"], "unknown option 'bogus'"),
    (["run", "-o", "stack_depth=-1", "--", "python", "x.py"], "option 'stack_depth'"),
    (["run", "-o", "report=x.json", "--", "python", "x.py"], "use --report"),
    (["run"], "give the program to run after --"),
    (["triage"], "the following arguments are required: report"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    ([], "the following arguments are required: COMMAND"),
    (["triage", "r.json", "--top", "0"], "--top must be >= 1"),
])
def test_argument_errors_print_usage_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: ownsan" in err and message in err


def test_triage_of_a_missing_or_foreign_file_is_a_clear_error(tmp_path, capsys):
    assert cli.main(["triage", str(tmp_path / "none.json")]) == 2
    assert "cannot read report" in capsys.readouterr().err
    (tmp_path / "x.json").write_text("[]")
    assert cli.main(["triage", str(tmp_path / "x.json")]) == 2
    assert "not an ownership-sanitizer report" in capsys.readouterr().err


def test_options_lists_every_option_with_type_and_default(capsys):
    assert cli.main(["options"]) == 0
    out = capsys.readouterr().out
    for name, typ, _, _ in option_table.table_rows():
        assert any(line.split()[:2] == [name, typ] for line in out.splitlines()), name


def test_python_dash_m_sanitizer_is_ownsan(tmp_path):
    out = _ownsan("options", cwd=str(tmp_path))
    assert out.returncode == 0 and "triage_budget_ms" in out.stdout


def test_demo_dispatches_to_the_end_to_end_demo(capsys):
    assert cli.main(["demo", "--help"]) == 0
    assert "usage:" in capsys.readouterr().out


def test_demo_falls_back_to_the_core_scenario(monkeypatch, capsys):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sanitizer.testing.demo" else real(name, *a))
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "sanitized: the same read raises at once" in out and "StaleBorrowError" not in out.split("\n")[0]


def test_fuzz_dispatches_or_says_it_is_missing(capsys):
    code = cli.main(["fuzz", "--help"])
    if cli.importlib.util.find_spec("sanitizer.testing.fuzz") is None:
        assert code == 2 and "not part of this installation" in capsys.readouterr().err
    else:
        assert code == 0


def test_progress_shows_on_a_terminal_only():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = cli._Progress("python train.py", stream)
        p.tick(2)
        p.done()
    assert "ownsan: running python train.py" in tty.getvalue() and "2 process reports" in tty.getvalue()
    assert pipe.getvalue() == ""


def test_install_and_uninstall_hook(tmp_path, capsys):
    assert cli.main(["install-hook", "--dir", str(tmp_path)]) == 0
    pth = tmp_path / startup.PTH_NAME
    assert pth.read_text() == startup.PTH_LINE
    assert cli.main(["uninstall-hook", "--dir", str(tmp_path)]) == 0
    assert not pth.exists()
    assert cli.main(["uninstall-hook", "--dir", str(tmp_path)]) == 0
    assert "no ownership_sanitizer.pth" in capsys.readouterr().out


def test_fuzz_flags_pass_straight_to_the_campaign(capsys):
    from sanitizer.tools import cli

    assert cli.main(["fuzz", "--examples", "2", "--seed", "5", "-j", "1"]) == 0
    out = capsys.readouterr().out
    assert "cases: 2 (seed 5, 1 job(s)" in out and "false alarms: 0" in out
