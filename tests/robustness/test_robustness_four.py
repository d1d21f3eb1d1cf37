"""Issue 29: a sanitizer never touches what is not its own and never dies on bad input.

* an output path (``report=PATH``, ``ownsan triage --html/--trace``) that is a device, a FIFO, a file
  descriptor's link or a symlink is written through (a symlink's target), never replaced; a regular
  file is replaced only once the new one is whole;
* non-UTF-8 file names (surrogate escapes) are escaped in the page and never fail a write;
* a report nested too deeply is one line and exit 2, not a RecursionError;
* every numeric option has bounds, checked before anything changes (2**70 is an option error);
* ``ownsan fuzz --weights`` on a truncated safetensors file or a git-lfs pointer says so, exit 2.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest
import torch

import sanitizer
from sanitizer.core import options as opts
from sanitizer.reporting import report as R
from sanitizer.tools import cli
from conftest import ROOT, run_python

NAME = "weights\udcff"  # a non-UTF-8 name, as os.fsdecode gives it (the byte 0xff)
needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")


def _report_json(path) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


# -- 2. report=PATH writes to the path, never replaces what is there -----------------------------------
def test_a_symlinked_report_path_writes_its_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "real" / "report.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert R.write_report(str(link)) == str(link)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert _report_json(target)["format"] == "ownership-sanitizer-report"
    dangling = tmp_path / "dangling.json"  # a link to a file not written yet: the file is made, the link kept
    dangling.symlink_to(tmp_path / "real" / "later.json")
    R.write_report(str(dangling))
    assert dangling.is_symlink() and _report_json(tmp_path / "real" / "later.json")["format"]
    assert sorted(os.listdir(tmp_path / "real")) == ["later.json", "report.json"]  # no temporary file left


@needs_fifo
def test_a_report_to_a_fifo_reaches_its_reader_and_the_fifo_stays(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    R.write_report(str(fifo))
    reader.join(timeout=10)
    assert not reader.is_alive(), "the FIFO's reader never got the report"
    assert json.loads(got[0])["format"] == "ownership-sanitizer-report"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@needs_fifo
def test_ownsan_run_checks_a_fifo_report_path_without_waiting_for_a_reader(tmp_path):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    said = []
    check = threading.Thread(target=lambda: said.append(cli._unwritable(str(fifo))), daemon=True)
    check.start()
    check.join(timeout=10)
    assert said == [None], "the check opened the FIFO and waited for a reader"


def test_a_report_to_dev_null_leaves_it_a_character_device():
    assert R.write_report("/dev/null") == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert sorted(n for n in os.listdir("/dev") if n.startswith(".null")) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_report_to_a_device_node_never_replaces_it(tmp_path):
    node = tmp_path / "null"  # a /dev/null of our own (so the test is safe to run against a broken writer)
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    R.write_report(str(node))
    assert stat.S_ISCHR(os.stat(node).st_mode)
    assert os.listdir(tmp_path) == ["null"]


@pytest.mark.slow
def test_report_to_dev_stdout_prints_it_after_what_was_printed_before():
    proc = run_python("from sanitizer.reporting import report\nprint('before')\nreport.write_report('/dev/stdout')")
    assert proc.returncode == 0, proc.stderr
    first, rest = proc.stdout.split("\n", 1)
    assert first == "before" and json.loads(rest)["format"] == "ownership-sanitizer-report"


def test_a_replaced_report_keeps_the_files_permissions(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    path.chmod(0o640)
    R.write_report(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and _report_json(path)["format"]


def test_triage_outputs_through_a_symlink_and_to_dev_null(tmp_path, capsys):
    src = tmp_path / "rep.json"
    R.write_report(str(src))
    page = tmp_path / "page.html"
    page.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(page)
    assert cli.main(["triage", str(src), "--html", str(link), "--trace", "/dev/null"]) == 0
    assert link.is_symlink() and "<html" in page.read_text(encoding="utf-8")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


# -- 9. non-UTF-8 names: escaped in the page; an output file is never left truncated ----------------
def _report_with_non_utf8_names(tmp_path) -> str:
    ring = sanitizer.StagingRing(4096, name=NAME)
    kept = []
    with sanitizer.sanitize(triage=1):
        for i in range(8):
            w = ring.put(f"layers.{i}.w\udcfe", torch.full((256,), float(i)))
            if i % 3 == 0:
                kept.append(w)
        del w
        float(kept[0].sum())
        rep = sanitizer.report(final=True)
    src = tmp_path / "rep.json"
    src.write_text(json.dumps(rep, default=str))  # ensure_ascii: the file itself is ASCII
    return str(src)


def test_triage_html_escapes_non_utf8_names_in_the_page(tmp_path, capsys):
    src = _report_with_non_utf8_names(tmp_path)
    out = tmp_path / "out.html"
    assert cli.main(["triage", src, "--html", str(out), "--trace", str(tmp_path / "t.json"), "--exit-zero"]) == 0, \
        capsys.readouterr().err
    page = out.read_bytes().decode("utf-8")  # valid UTF-8
    assert "weights\\xff" in page and "w\\xfe" in page and page.rstrip().endswith("</html>")
    assert "\udcff" not in page


@pytest.mark.slow
def test_triage_prints_non_utf8_names_on_a_strict_stdout(tmp_path):
    src = _report_with_non_utf8_names(tmp_path)
    env = dict(os.environ, PYTHONIOENCODING="utf-8:strict")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from sanitizer.tools import cli; sys.exit(cli.main(sys.argv[1:]))",
         "triage", src, "--exit-zero"], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert b"Traceback" not in proc.stderr and b"weights\\xff" in proc.stdout


def test_a_text_that_cannot_be_written_leaves_the_previous_file_whole(tmp_path):
    from sanitizer.core.output_file import write_text

    path = tmp_path / "page.html"
    path.write_text("the previous page")
    with pytest.raises(UnicodeEncodeError):
        write_text(str(path), "<html>\udcff</html>")
    assert path.read_text() == "the previous page" and os.listdir(tmp_path) == ["page.html"]


def test_a_failing_page_never_truncates_the_previous_one(tmp_path, monkeypatch, capsys):
    from sanitizer.reporting import timeline

    src = tmp_path / "rep.json"
    R.write_report(str(src))
    out = tmp_path / "out.html"
    out.write_text("the previous page")

    def broken(*args, **kwargs):
        raise ValueError("cannot draw")

    monkeypatch.setattr(timeline, "render_html", broken)
    assert cli.main(["triage", str(src), "--html", str(out)]) == 2
    assert out.read_text() == "the previous page"


# -- 10. a report nested too deeply: one line, exit 2 ------------------------------------------------
@pytest.mark.parametrize("text", [
    "[" * 100000,
    '{"format": "ownership-sanitizer-report", "version": 2, "errors": ' + "[" * 500 + "]" * 500 + "}",
])
def test_a_deeply_nested_report_is_one_line_and_exit_2(tmp_path, capsys, text):
    src = tmp_path / "deep.json"
    src.write_text(text)
    assert cli.main(["triage", str(src)]) == 2
    err = capsys.readouterr().err
    assert "not a valid report" in err and "nested too deeply" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    (tmp_path / "mod.py").write_text("x = 1\n")
    assert cli.main(["audit", str(tmp_path / "mod.py"), "--report", str(src)]) == 2
    err = capsys.readouterr().err
    assert "not a valid report" in err and "nested too deeply" in err and len(err.strip().splitlines()) == 1


def test_a_report_that_is_not_utf8_names_the_file(tmp_path, capsys):
    src = tmp_path / "bad.json"
    src.write_bytes(b'{"format": "\xff"}')
    assert cli.main(["triage", str(src)]) == 2
    err = capsys.readouterr().err
    assert str(src) in err and "UTF-8" in err and len(err.strip().splitlines()) == 1


# -- 11. numeric options have bounds, checked before anything changes -------------------------------
def test_an_option_beyond_its_bound_is_an_option_error_and_changes_nothing():
    from sanitizer.torch_layer.state import state

    before = state.options
    with pytest.raises(sanitizer.OptionError) as err:
        sanitizer.enable(timeline_events=2**70)
    text = str(err.value)
    assert "timeline_events" in text and str(2**70) in text and str(sys.maxsize) in text
    assert not sanitizer.enabled()
    assert state.options is before
    with pytest.raises(opts.OptionError, match=r"option 'stack_depth'.*-1.*>= 0"):
        opts.resolve({"stack_depth": -1})
    with pytest.raises(opts.OptionError, match=r"option 'poison_byte'.*256.*<= 255"):
        opts.resolve({"poison_byte": 256})
    with pytest.raises(opts.OptionError, match="option 'quarantine'"):
        opts.resolve(opts.parse_options_string(f"quarantine={hex(2**80)}"))


def test_every_numeric_option_has_bounds_and_enable_takes_its_upper_bound():
    for opt in opts.OPTIONS.values():
        if opt.type in (int, float):
            assert opt.bounds is not None, opt.name
            low, high = opt.bounds
            assert opt.parse(low) == low and opt.parse(high) == high
            with pytest.raises(opts.OptionError, match=f"option '{opt.name}'"):
                opt.parse(high + 1)
    for name in ("timeline_events", "stack_depth", "max_records", "max_errors_per_lease", "triage_depth",
                 "triage_budget_ms", "quarantine"):
        with sanitizer.sanitize(**{name: opts.OPTIONS[name].bounds[1]}):
            assert sanitizer.enabled()
        assert not sanitizer.enabled()


@pytest.mark.slow
def test_the_zero_code_hook_names_an_option_beyond_its_bound():
    proc = run_python("import torch\nprint('ran')", {"OWNERSHIP_SANITIZE": "1",
                                                     "OWNERSHIP_SANITIZE_OPTIONS": f"timeline_events={2**70}"})
    assert proc.returncode == 2, proc.stderr
    assert "ran" not in proc.stdout
    assert "timeline_events" in proc.stderr and str(2**70) in proc.stderr and str(sys.maxsize) in proc.stderr
    assert "too large to convert" not in proc.stderr


# -- 12. ownsan fuzz --weights on a file that is not whole safetensors: one line, exit 2 ----------------
def _fuzz(capsys, path) -> "tuple[int, str]":
    code = cli.main(["fuzz", "--consumer", "tests/robustness/test_robustness_four.py:copies", "--weights", str(path),
                     "--examples", "2", "-q"])
    return code, capsys.readouterr().err


def copies(weights):
    return {name: t.clone() for name, t in weights}


@pytest.fixture
def good_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(32, 32), "b": torch.randn(16)}, str(path))
    return path


@pytest.mark.parametrize("cut,what", [
    (lambda d: d[:-100], "truncated"),
    (lambda d: d[:5], "shorter than 8 bytes"),
    (lambda d: d[:20], "truncated"),
    (lambda d: d[:8] + b"\xff" * (len(d) - 8), "header is not JSON"),
])
def test_a_broken_safetensors_file_is_one_line_and_exit_2(tmp_path, good_file, capsys, monkeypatch, cut, what):
    monkeypatch.chdir(ROOT)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(cut(good_file.read_bytes()))
    code, err = _fuzz(capsys, bad)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(bad) in err and what in err, err


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_git_lfs_pointer_says_so_and_suggests_git_lfs_pull(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(ROOT)
    pointer = tmp_path / name
    pointer.write_text("version https://git-lfs.github.com/spec/v1\n"
                       "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
                       "size 12345\n")
    code, err = _fuzz(capsys, pointer)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "git-lfs pointer" in err and "git lfs pull" in err and str(pointer) in err, err


def test_a_whole_file_still_passes(good_file, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, err = _fuzz(capsys, good_file)
    assert code == 0, err
