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
# safetensors_ring makes safe_open serve views of a small reused ring, as a borrowing loader does;
# safetensors_strict=1 holds the consumer to that borrowed contract (by default a kept view is only reported).
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
    out = _ownsan("run", "-o", "safetensors_ring=8192", "-o", "safetensors_strict=1", "--report", "rep.json", "--",
                  sys.executable, "consumer.py", str(tmp / "ckpt.safetensors"), "keep", cwd=str(tmp))
    return tmp, out


@pytest.mark.slow
def test_run_fails_on_a_retaining_consumer_and_names_it(retaining_run):
    tmp, out = retaining_run
    assert out.returncode == 1, out.stderr
    assert "total" in out.stdout  # triage=1: the program ran to the end
    assert "ownership-sanitizer: " in out.stderr and "stale_use" in out.stderr
    assert "DeferredLayer.pending[*]" in out.stderr  # the triage table's consumer row
    assert "holder lives at " in out.stderr and "consumer.py:" in out.stderr
    rep = json.loads((tmp / "rep.json").read_text())
    assert rep["error_count"] > 0 and rep["summary"]["retaining_consumers"][0]["kind"] == "object"


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_triage_prints_the_table_sorted_by_bytes(retaining_run, capsys):
    tmp, _ = retaining_run
    assert cli.main(["triage", str(tmp / "rep.json")]) == 1  # retentions: it fails, as ownsan run did
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "bytes" in line and "holder" in line)
    assert header.split()[:6] == ["#", "bytes", "count", "stale", "kind", "holder"]
    row = text.splitlines()[text.splitlines().index(header) + 1]
    assert row.split()[0] == "1" and row.rstrip().endswith("DeferredLayer.pending[*]")
    assert "lent at" in text and "reused at" in text and "errors (first of each kind):" in text


@pytest.mark.slow
def test_run_passes_a_correct_consumer(tmp_path):
    (tmp_path / "consumer.py").write_text(SCRIPT)
    out = _ownsan("run", "-q", "-o", "safetensors_ring=8192", "-o", "safetensors_strict=1", "--report", "rep.json", "--",
                  sys.executable, "consumer.py", str(tmp_path / "ckpt.safetensors"), "clone", cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "total 15360.0" in out.stdout  # the right values
    assert out.stderr.strip().splitlines()[-1] == "ownership-sanitizer: 0 errors; no retentions"


@pytest.mark.slow
def test_run_passes_the_program_exit_status_through(tmp_path):
    out = _ownsan("run", "--report", "rep.json", "--", sys.executable, "-c", "import torch, sys; sys.exit(7)",
                  cwd=str(tmp_path))
    assert out.returncode == 7, out.stderr


def test_run_of_a_command_that_never_imports_torch_fails_unless_allowed(tmp_path):
    """Issue 51 item 6: a CI gate whose command never reached torch sanitized nothing; it passed (0)."""
    out = _ownsan("run", "--report", "rep.json", "--", sys.executable, "-c", "print('hi')", cwd=str(tmp_path))
    assert out.returncode == 1 and "hi" in out.stdout, out.stderr
    assert "nothing was sanitized; exit status 1 (--allow-unsanitized" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1  # one line
    allowed = _ownsan("run", "--allow-unsanitized", "--report", "rep.json", "--", sys.executable, "-c",
                      "import sys; sys.exit(0)", cwd=str(tmp_path))
    assert allowed.returncode == 0 and "nothing was sanitized" in allowed.stderr
    failing = _ownsan("run", "--report", "rep.json", "--", sys.executable, "-c", "import sys; sys.exit(4)",
                      cwd=str(tmp_path))
    assert failing.returncode == 4  # the program's own failure is kept


@pytest.mark.parametrize("argv, message", [
    (["run", "-o", "bogus=1", "--", "python", "x.py"], "unknown option 'bogus'"),
    (["run", "-o", "stack_depth=-1", "--", "python", "x.py"], "option 'stack_depth'"),
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


def test_run_takes_a_quoted_option_value_holding_separators():
    """``-o report='/tmp/a,b.json'`` was refused ("may not contain ':' or ','") though the options string
    quotes it: the child's options string escapes it, and it reads back whole."""
    parser = cli.build_parser()
    got = cli._parse_options(["report='/runs/12:30/a,b.json'", "stack_depth=3"], parser)
    assert got == {"report": "/runs/12:30/a,b.json", "stack_depth": "3"}
    assert option_table.parse_options_string(option_table.format_options_string(got)) == got


@pytest.mark.parametrize("argv, bad, meant, usage", [
    (["audti", "."], "'audti'", "'audit'", "usage: ownsan "),
    (["trage", "r.json"], "'trage'", "'triage'", "usage: ownsan "),
    (["run", "--reprot", "x", "--", "python", "-c", "pass"], "'--reprot'", "'--report'", "usage: ownsan run"),
    (["triage", "--tpo", "3", "r.json"], "'--tpo'", "'--top'", "usage: ownsan triage"),
    (["fuzz", "--exmples", "3"], "'--exmples'", "'--examples'", "usage: ownsan fuzz"),
    (["audit", "--formt", "json", "."], "'--formt'", "'--format'", "usage: ownsan audit"),
    (["run", "-o", "stack_dept=4", "--", "python", "-c", "pass"], "'stack_dept'", "'stack_depth'",
     "usage: ownsan run"),
])
def test_a_near_miss_gets_one_line_naming_it_and_the_closest_name(argv, bad, meant, usage, capsys):
    """A mistyped subcommand, flag or option: exit 2, the usage of the command it was given to, and one
    error line with the bad value and the suggestion (a flag of run once got the top-level usage and none)."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1 and bad in errors[0] and f"(did you mean {meant}?)" in errors[0], err
    assert err.startswith(usage), err


def test_a_far_miss_gets_no_suggestion(capsys):
    assert cli.main(["zzzzqx"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'zzzzqx'" in err and "did you mean" not in err
    assert cli.main(["run", "--zzzzqx", "--", "python", "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized argument '--zzzzqx'" in err and "did you mean" not in err


@pytest.mark.slow
def test_option_report_is_taken_as_the_report_path(tmp_path):
    """``-o report=PATH`` means ``--report PATH`` (it used to be refused)."""
    out = _ownsan("run", "-q", "-o", "report=via-option.json", "--", sys.executable, "-c", "import torch",
                  cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "via-option.json").exists() and not (tmp_path / "ownsan-report.json").exists()


def test_triage_into_a_reader_that_closed_early_ends_quietly(retaining_run):
    # `ownsan triage r.json | head`: the reader is gone before the text is written. Python's "Note on SIGPIPE":
    # a BrokenPipeError traceback (and the interpreter's "Exception ignored" at its exit flush) before the fix.
    tmp, _ = retaining_run
    code = ("import os, sys\n"
            "r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
            "from sanitizer.tools.cli import main\n"
            "sys.exit(main(['triage', sys.argv[1]]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-c", code, str(tmp / "rep.json")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr[-2000:]


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


@pytest.mark.parametrize("columns", [50, 80, 120])
def test_options_wraps_to_the_terminal_with_a_hanging_indent(columns, monkeypatch, capsys):
    """Each help once came on one line of 300+ characters."""
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["options"]) == 0
    lines = capsys.readouterr().out.split("\n\n")[0].splitlines()[1:]  # the table, without its header
    assert all(len(line) < columns for line in lines), max(lines, key=len)
    helps: dict = {}
    for line in lines:
        if not line.startswith(" "):  # a row: name, type, default, then the start of its help (if it fits)
            name, typ, default, *start = line.split(None, 3)
            assert option_table.OPTIONS[name].type.__name__ == typ
            helps[name] = start
        else:  # a continuation, under one hanging indent (the help column, or four spaces when too narrow)
            helps[name].append(line.strip())
    indents = {len(line) - len(line.lstrip()) for line in lines if line.startswith(" ")}
    assert len(indents) == 1
    assert list(helps) == list(option_table.OPTIONS)
    for name, opt in option_table.OPTIONS.items():
        assert " ".join(helps[name]) == " ".join(opt.help.split()), name


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
    assert "2. sanitized: the late read raises at once" in out and "StaleBorrowError" not in out.split("\n")[0]


def test_demo_without_the_core_scenario_in_the_installation_says_so(monkeypatch, capsys, tmp_path):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sanitizer.testing.demo" else real(name, *a))
    monkeypatch.setattr(cli, "_QUICKSTART", str(tmp_path / "examples" / "quickstart.py"))  # a wheel has none
    assert cli.main(["demo"]) == 2
    assert "the core scenario (examples/quickstart.py) is not part of this installation" in capsys.readouterr().err


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


# -- first-run experience: version, start-up cost, missing extras, bad input --------------------------
def test_version_is_the_single_sourced_one(tmp_path, capsys):
    from sanitizer.core.version import __version__

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"ownsan (ownership-sanitizer) {__version__}"
    out = _ownsan("--version", cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.split()[-1] == __version__
    import sanitizer

    assert sanitizer.__version__ == __version__


_HEAVY = ("torch", "numba", "numpy", "sanitizer.torch_layer", "sanitizer.features")


def _loaded_after(code: str, tmp_path) -> list:
    out = subprocess.run([sys.executable, "-c", code + f"\nprint(sorted(m for m in {_HEAVY!r} if m in sys.modules))"],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")},
                              "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_help_and_version_import_no_torch(tmp_path):
    for argv in (["--help"], ["--version"], ["run", "--help"], ["options"]):
        code = ("import sys\nfrom sanitizer.tools.cli import main\n"
                f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n")
        assert _loaded_after(code, tmp_path) == [], argv


@pytest.mark.parametrize("argv", [["fuzz", "--help"], ["fuzz", "--exmples", "3"], ["audit", "--help"],
                                  ["triage", "missing.json"], ["run", "--help"], ["audti"],
                                  ["run", "--reprot", "x", "--", "python", "-c", "pass"]])
def test_help_and_usage_errors_answer_without_torch(argv, tmp_path):
    """Arguments are parsed first: torch (seconds to import) only for the work that needs it. ``ownsan
    fuzz --help`` and ``ownsan triage missing.json`` once imported it before saying anything."""
    code = ("import sys\nfrom sanitizer.tools.cli import main\n"
            f"try:\n    code = main({argv!r})\nexcept SystemExit as exc:\n    code = exc.code\n"
            "assert code in (0, 2), code\n")
    assert _loaded_after(code, tmp_path) == [], argv


@pytest.mark.slow
def test_the_pytest_plugin_imports_no_torch_until_a_test_asks(tmp_path):
    assert _loaded_after("import sys\nimport sanitizer.tools.pytest_plugin", tmp_path) == []
    # A whole pytest session of an unrelated project, with the plugin loaded: still no torch.
    (tmp_path / "test_unrelated.py").write_text(
        "import sys\n"
        "def test_plugin_loaded_but_nothing_heavy():\n"
        "    assert 'sanitizer.tools.pytest_plugin' in sys.modules\n"
        f"    assert [m for m in {_HEAVY!r} if m in sys.modules] == []\n")
    from importlib.metadata import entry_points

    ours = any(ep.value == "sanitizer.tools.pytest_plugin" for ep in entry_points(group="pytest11"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_unrelated.py"]
                         + ([] if ours else ["-p", "sanitizer.tools.pytest_plugin"]), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")},
                              "PYTHONPATH": ROOT})
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr


def _without_safetensors(argv: list, tmp_path) -> subprocess.CompletedProcess:
    code = ("import sys\nsys.modules['safetensors'] = None  # as if the extra were not installed\n"
            f"from sanitizer.tools.cli import main\nsys.exit(main({argv!r}))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=300, env={**{k: v for k, v in os.environ.items()
                                               if not k.startswith("OWNERSHIP_SANITIZE")}, "PYTHONPATH": ROOT})


def test_fuzz_without_its_extra_says_what_to_install(tmp_path):
    out = _without_safetensors(["fuzz", "--examples", "1"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "needs safetensors" in out.stderr and "pip install 'ownership-sanitizer[fuzz]'" in out.stderr


@pytest.mark.slow
def test_demo_without_its_extra_runs_the_core_scenario_or_says_what_to_install(tmp_path):
    out = _without_safetensors(["demo"], tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert "pip install 'ownership-sanitizer[demo]'" in out.stderr and "core scenario instead" in out.stderr
    assert "2. sanitized: the late read raises at once" in out.stdout
    out = _without_safetensors(["demo", "--order", "sorted"], tmp_path)  # the demo's own flags: no fallback
    assert out.returncode == 2 and "needs safetensors" in out.stderr and "Traceback" not in out.stderr


def test_report_path_that_cannot_be_written_fails_before_the_run(tmp_path, capsys):
    marker = tmp_path / "ran"
    program = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    for bad, why in ((tmp_path / "no" / "such" / "dir" / "r.json", "no directory"), (tmp_path, "it is a directory")):
        assert cli.main(["run", "--report", str(bad), "--", *program]) == 2
        err = capsys.readouterr().err
        assert f"--report {str(bad)!r}: cannot write the report there ({why}" in err and "nothing was run" in err
    assert not marker.exists()  # the program never started
    probe = tmp_path / "r.json"
    assert cli._unwritable(str(probe)) is None and not probe.exists()  # the check leaves no file behind


def test_a_report_that_cannot_be_written_at_the_end_goes_elsewhere(tmp_path, capsys):
    gone = tmp_path / "gone" / "r.json"  # writable at the start, its directory removed during the run
    where = cli._write_report({"format": "x", "n": 1}, str(gone))
    try:
        assert where != str(gone) and json.loads(open(where).read()) == {"format": "x", "n": 1}
        assert f"the report is in {where}" in capsys.readouterr().err
    finally:
        os.remove(where)


@pytest.mark.parametrize("replay, named", [
    ("{bad", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"layers": []}', "missing field(s)"),
    ('{"layers": [[["w0", [4], "bf16"]]], "files": 1, "order": "sorted", "ring_fraction": 0.5, "lifetime": null, '
     '"consumer": "hoard", "debug": "generations", "seed": 1}', "field 'consumer': expected one of"),
    ('{"layers": [[["w0", [0], "bf16"]]], "files": 1, "order": "sorted", "ring_fraction": 0.5, "lifetime": null, '
     '"consumer": "list", "debug": "generations", "seed": 1}', "shape [0] is not a non-empty list"),
    ('{"layers": [[["w0", [4], "f64"]]], "files": 1, "order": "sorted", "ring_fraction": 2, "lifetime": null, '
     '"consumer": "list", "debug": "generations", "seed": 1}', "dtype \"f64\" is not one of"),
    ('{"layers": [[["w0", [4], "bf16"]]], "files": 1, "order": "sorted", "ring_fraction": 2, "lifetime": null, '
     '"consumer": "list", "debug": "generations", "seed": 1, "extra": 1}', "unknown field(s) ['extra']"),
])
def test_a_bad_replay_case_is_a_usage_error_naming_the_problem(replay, named, capsys):
    assert cli.main(["fuzz", "--replay", replay]) == 2
    err = capsys.readouterr().err
    assert "--replay: not a case:" in err and named in err, err
    assert "Traceback" not in err


def test_fuzz_shows_progress_on_stderr(capsys):
    from sanitizer.testing import fuzz

    assert fuzz.main(["--examples", "2", "--seed", "5"]) == 0
    captured = capsys.readouterr()
    assert "fuzz: 1/2 cases, 0 failures" in captured.err and "fuzz: 2/2 cases, 0 failures" in captured.err
    assert "fuzz:" not in captured.out and "cases: 2 (seed 5" in captured.out
    assert fuzz.main(["--examples", "1", "--seed", "5", "-q"]) == 0
    assert capsys.readouterr().err == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    line = fuzz._ProgressLine(Tty())
    for done in (1, 2, 3):
        line(done, 3, done - 1)
    text = line.stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("fuzz: 3/3 cases, 2 failures, " + text.rsplit(", ", 1)[1])
    assert text.endswith("\n")


def _screen(raw: str) -> list:
    """What a terminal shows after ``raw``: carriage return, line feed and erase-to-end-of-line honoured."""
    lines, cur, col, i = [], [], 0, 0
    while i < len(raw):
        if raw.startswith("\x1b[K", i):
            del cur[col:]
            i += 3
            continue
        c = raw[i]
        if c == "\r":
            col = 0
        elif c == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        else:
            cur[col:col + 1] = [c]
            col += 1
        i += 1
    return lines + ["".join(cur)]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_the_progress_line_never_covers_the_programs_output(tmp_path):
    """On a terminal: the program writes a line, goes quiet (the progress line shows), writes again, and
    writes half a line, goes quiet (no progress line while its cursor is mid-line), then ends it."""
    import select

    child = ("import sys, time\nprint('line one', flush=True)\ntime.sleep(1.0)\nprint('line two', flush=True)\n"
             "sys.stdout.write('half'); sys.stdout.flush(); time.sleep(0.8); print(' and the rest')\n")
    master, slave = os.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.Popen([sys.executable, "-m", "sanitizer", "run", "-q", "--allow-unsanitized", "--report",
                             "r.json", "--", sys.executable, "-c", child], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=slave,
                            cwd=str(tmp_path), env=env)
    os.close(slave)
    raw = b""
    while select.select([master], [], [], 60)[0]:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the other side closed
            break
        if not data:
            break
        raw += data
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = raw.decode()
    assert "ownsan: running " in text  # the line was shown while the program was quiet...
    shown = [line for line in _screen(text) if line.strip()]
    assert shown[:3] == ["line one", "line two", "half and the rest"], shown  # ...and never over its output
    assert not any("ownsan: running" in line for line in shown)  # and erased at the end


def test_run_keeps_the_options_already_in_the_environment_and_o_overrides_them(tmp_path):
    """``OWNERSHIP_SANITIZE_OPTIONS=safetensors_ring=65536 ownsan run -- ...`` ran with no ring at all: the run
    wrote the variable for its processes from ``-o`` alone, and the user's setting vanished without a word."""
    show = ("import sanitizer, json; from sanitizer.torch_layer.state import state; "
            "print(json.dumps([state.options.safetensors_ring, state.options.stack_depth]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env.update(PYTHONPATH=ROOT, OWNERSHIP_SANITIZE_OPTIONS="safetensors_ring=65536:stack_depth=5")
    argv = [sys.executable, "-m", "sanitizer", "run", "-q", "--report", "rep.json"]
    out = subprocess.run(argv + ["--", sys.executable, "-c", show], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[65536, 5]", out.stderr
    out = subprocess.run(argv + ["-o", "stack_depth=3", "--", sys.executable, "-c", show], cwd=str(tmp_path),
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[65536, 3]", out.stderr
    env["OWNERSHIP_SANITIZE_OPTIONS"] = "safetensors_rign=65536"
    out = subprocess.run(argv + ["--", sys.executable, "-c", show], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 2 and "OWNERSHIP_SANITIZE_OPTIONS in the environment" in out.stderr, out.stderr
    assert "safetensors_rign" in out.stderr and not out.stdout
