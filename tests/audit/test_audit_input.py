"""Bad or unusual input to ``ownsan audit`` (issues 29 and 46): valid Python the audit must read as Python
does (coding cookies, a BOM, form feeds and other characters ``str.splitlines`` splits on), expressions
nested as deep as Python compiles (followed), files Python cannot compile and functions too deep to
follow (named, the rest audited, exit status 2), file names that are not UTF-8, the same file named three
ways, and ``ownsan options --sync-readme`` on a file it cannot use. Each gets one clear line, never a
traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sanitizer.audit import audit_paths, audit_text
from sanitizer.audit.formats import SCHEMA_FILE
from sanitizer.tools import cli
from conftest import ROOT


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """Overrides conftest's: the audit never touches the sanitizer's runtime."""
    yield


RETAINING = b"def load_weights(weights):\n    return list(weights)\n"
SIDE = textwrap.dedent('''
    def load_weights(weights):
        name = "x"{odd}
        side = []
        for key, w in weights:
            side.append(w)
        return side
''')


def _run(capsys, *argv):
    code = cli.main(["audit", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


# 6: the source encoding, as Python reads it -------------------------------------------------------

def test_a_latin_1_coding_cookie_is_read_as_python_reads_it(tmp_path, capsys):
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\nCAFE = 'caf\xe9'\n" + RETAINING)
    result = audit_paths([str(path)])
    assert result.errors == [] and [f.code for f in result.findings] == ["OWN103"]
    code, out, _ = _run(capsys, "--format", "concise", str(path))
    assert code == 1 and "latin.py:4:" in out


def test_a_utf_8_bom_is_read_as_python_reads_it(tmp_path, capsys):
    path = tmp_path / "bom.py"
    path.write_bytes(b"\xef\xbb\xbf" + RETAINING)
    result = audit_paths([str(path)])
    assert result.errors == [] and [(f.code, f.line) for f in result.findings] == [("OWN103", 2)]


def test_an_unknown_coding_or_bytes_that_do_not_decode_are_one_named_line(tmp_path, capsys):
    (tmp_path / "unknown.py").write_bytes(b"# coding: no-such-codec\n" + RETAINING)
    (tmp_path / "wrong.py").write_bytes(b"# coding: utf-8\nX = '\xff'\n" + RETAINING)
    (tmp_path / "good.py").write_bytes(RETAINING)
    code, out, _ = _run(capsys, "--format", "concise", str(tmp_path))
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 2 and "good.py:2:" in out
    assert "unknown.py" in errors[0] and "no-such-codec" in errors[0]
    assert "wrong.py" in errors[1] and "utf-8" in errors[1]


# 7: lines split as Python's tokenizer splits them -------------------------------------------------

@pytest.mark.parametrize("odd", ["  \f", "  # a\u2028b", "  # a\x1cb", "  # a\x85b", "  # a\vb"],
                         ids=["form-feed", "U+2028", "x1c", "NEL", "vtab"])
def test_characters_splitlines_splits_on_do_not_shift_the_quoted_code(odd):
    (f,) = audit_text(SIDE.format(odd=odd), "m.py").findings
    assert f.line == 6 and "`side`" in f.message and "`name`" not in f.message, f.message
    assert f.chain[-1].text.startswith("`side.append(w)`"), f.chain[-1].text


# issue 46 (10): an expression Python compiles is followed however deep it nests -------------------------

# tests/audit_corpus/containers.py's KeepDictByName (OWN101 at the store), with a parameter annotation, a
# statement beside the store, the store's key and its value, any of which may nest deep
DICT_BY_NAME = textwrap.dedent('''
    from typing import Iterable

    import torch
    from torch import nn


    class KeepDictByName(nn.Module):
        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], bias: {annotation} = None):
            draft_weights = {{}}
            for name, loaded_weight in weights:
                scale = {aside}
                draft_weights[{key}] = {value}
            self.model.load_weights(draft_weights.items())
''')
SHALLOW = dict(annotation="int", aside="1", key='"model." + name', value="loaded_weight")
STORE_LINE = 13


def _sum(term: str, n: int) -> str:
    return " + ".join([term] * n)


DEEP = {  # each: one part of DICT_BY_NAME nested n levels deep, in one of the shapes generated code has
    "sum-aside": lambda n: dict(aside=_sum("1", n)),
    "sum-in-key": lambda n: dict(key='"model." + ' + _sum("name", n)),
    "sum-in-index": lambda n: dict(value=f"loaded_weight[{_sum('0', n)}]"),
    "power-in-index": lambda n: dict(value="loaded_weight[" + "0 ** " * n + "0]"),  # right-deep
    "attribute-chain": lambda n: dict(value="loaded_weight" + ".T" * n),
    "method-chain": lambda n: dict(value="loaded_weight" + ".view(-1)" * (n // 2)),
    "subscript-chain": lambda n: dict(value="loaded_weight" + "[0]" * n),
    "conditional-chain": lambda n: dict(value="loaded_weight if scale else " * n + "loaded_weight"),
    "unary-in-index": lambda n: dict(value="loaded_weight[" + "-" * n + "0]"),
    "list-concatenation": lambda n: dict(value=_sum("[loaded_weight]", n)),
    "product-aside": lambda n: dict(aside="[0]" + " * 2" * n),
    "union-annotation": lambda n: dict(annotation=" | ".join(["int"] * n)),
}


def _dict_by_name(**deep: str) -> str:
    return DICT_BY_NAME.format(**{**SHALLOW, **deep})


def _found(result):
    return [(f.code, f.line, f.function) for f in result.findings]


def test_the_shallow_consumer_is_found():
    assert _found(audit_text(_dict_by_name(), "m.py")) == [("OWN101", STORE_LINE, "KeepDictByName.load_weights")]


@pytest.mark.parametrize("shape", sorted(DEEP))
@pytest.mark.parametrize("levels", [900, 2000])
def test_a_deep_expression_that_python_compiles_keeps_its_finding(shape, levels):
    """A 900-term sum (which Python compiles, up to about 3,000) overflowed the flow's recursive walk, and
    the file was skipped with its finding; so did any other shape nested as deep, anywhere in the
    function. Each is followed now, and the function's finding is the shallow one's."""
    src = _dict_by_name(**DEEP[shape](levels))
    compile(src, "m.py", "exec")  # Python compiles it: the audit must follow it
    result = audit_text(src, "m.py")
    assert result.skipped == [] and result.errors == []
    assert _found(result) == [("OWN101", STORE_LINE, "KeepDictByName.load_weights")]


def test_a_900_term_sum_is_reported_with_exit_status_1(tmp_path, capsys):
    (tmp_path / "m.py").write_text(_dict_by_name(**DEEP["sum-aside"](900)))
    code, out, err = _run(capsys, "--format", "concise", str(tmp_path))
    assert code == 1 and f"m.py:{STORE_LINE}:" in out and "OWN101" in out and "skipped" not in out + err


@pytest.mark.parametrize("aside", [
    "self.scales.T" + "[0]" * 40,
    "[y for y in [" + _sum("0", 1000) + "]] + " + _sum("1", 1000),
], ids=["subscripts-of-a-tensor-attribute", "deep-sum-led-by-a-comprehension-over-a-deep-list"])
def test_deep_shapes_that_once_took_exponential_time_are_quick(aside):
    """``x = w.T[0][0]...``: asking twice a level whether the base is a tensor cost 2**n calls (22 levels:
    11 s, 40 levels: days). A deep sum whose first part is a comprehension over a deep list: the inner
    iterative evaluation must not end the outer one (which then evaluated each part again, at every
    level). Run apart, with a timeout, so that a regression fails, not hangs."""
    src = _dict_by_name(aside=aside)
    code = ("import sys; from sanitizer.audit import audit_text; "
            "print([(f.code, f.line) for f in audit_text(sys.stdin.read(), 'm.py').findings])")
    done = subprocess.run([sys.executable, "-c", code], input=src, capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0 and done.stdout.strip() == f"[('OWN101', {STORE_LINE})]", done.stderr


# issue 46 (10): a file Python cannot compile is named and the rest audited, exit status 2 ---------------

UNCOMPILABLE = {  # the bytes of a file, and what its error line says
    "syntax-error": (b"def f(:\n", "does not parse"),
    "null-byte": (b"x = 1\x00\n", "does not parse"),
    "undecodable-bytes": (b"x = '\xff'\n", "not valid utf-8 text"),
    "sum-of-5000-terms": (f"x = {_sum('1', 5000)}\n".encode(), "does not parse"),
    "sum-of-20000-terms": (f"x = {_sum('1', 20000)}\n".encode(), "does not parse"),
    "power-of-3000-terms": (b"x = " + b"0 ** " * 3000 + b"0\n", "does not parse"),  # right-nested
}


@pytest.mark.parametrize("kind", sorted(UNCOMPILABLE))
def test_a_file_python_cannot_compile_is_named_and_the_rest_audited(tmp_path, capsys, kind):
    """Too deep for Python's parser (5,000 or 20,000 terms), like a syntax error, a NUL byte or bytes that
    do not decode, is a file that does not parse: one error line naming it and why, the other files
    audited and reported (a deep one with its finding), and exit status 2 (the audit is incomplete),
    even with --exit-zero. A too-deep file was 'skipped' and the exit status followed the others'
    findings: 0 when they had none."""
    raw, needle = UNCOMPILABLE[kind]
    with pytest.raises((SyntaxError, ValueError, RecursionError, MemoryError)):
        compile(raw, "a_bad.py", "exec")  # Python cannot compile it either
    (tmp_path / "a_bad.py").write_bytes(raw)
    (tmp_path / "b_deep.py").write_text(_dict_by_name(**DEEP["sum-aside"](900)))
    (tmp_path / "c_good.py").write_bytes(RETAINING)
    result = audit_paths([str(tmp_path)])
    (error,) = result.errors
    assert error.startswith(str(tmp_path / "a_bad.py")) and needle in error and result.skipped == []
    assert sorted(os.path.basename(f.path) for f in result.findings) == ["b_deep.py", "c_good.py"]
    for fmt in ("text", "concise"):
        code, out, _ = _run(capsys, "--format", fmt, str(tmp_path))
        errors = [line for line in out.splitlines() if line.startswith("error: ")]
        assert code == 2 and len(errors) == 1 and "a_bad.py" in errors[0] and needle in errors[0], out
        assert f"b_deep.py:{STORE_LINE}:" in out and "c_good.py:2:" in out and "skipped" not in out
    (tmp_path / "b_deep.py").unlink()
    (tmp_path / "c_good.py").write_text("X = 1\n")
    code, out, _ = _run(capsys, "--exit-zero", str(tmp_path))
    assert code == 2 and "a_bad.py" in out


def test_what_python_compiles_at_the_top_parses_however_deep_the_audit_is_called():
    """Python 3.11's parser allows nesting in proportion to the recursion limit left: ``ast.parse`` called
    hundreds of frames deep (a test, a plugin) refused a 2,960-term sum that ``python m.py`` compiles."""
    src = f"x = {_sum('1', 2960)}\n" + RETAINING.decode()
    top = subprocess.run([sys.executable, "-c", "import sys; compile(sys.stdin.read(), 'm.py', 'exec')"],
                         input=src, text=True, capture_output=True)
    if top.returncode:
        pytest.skip("this Python does not compile a 2,960-term sum at the top either")
    limit = sys.getrecursionlimit()

    def called_deep(frames: int):
        return audit_text(src, "m.py") if frames == 0 else called_deep(frames - 1)

    result = called_deep(400)
    assert result.errors == [] and [(f.code, f.line) for f in result.findings] == [("OWN103", 3)]
    assert sys.getrecursionlimit() == limit


def _nested_ifs(levels: int, indent: int, inner: str) -> str:
    lines = ["    " * (indent + i) + f"if c{i}:" for i in range(levels)]
    return "\n".join(lines + ["    " * (indent + levels) + inner]) + "\n"


def _helpers_nested_deep(levels: int) -> str:
    """A loop that hands each weight down three helpers, every call under ``levels`` nested ifs (Python
    takes 100 levels of indentation): each walk nests its statements, and the four walks together pass
    Python's recursion limit. Then a consumer apart, found as usual."""
    return ("KEEP = []\n\n\ndef h2(t):\n" + _nested_ifs(levels, 1, "KEEP.append(t)")
            + "\n\ndef h1(t):\n" + _nested_ifs(levels, 1, "h2(t)")
            + "\n\ndef h0(t):\n" + _nested_ifs(levels, 1, "h1(t)")
            + "\n\ndef load_weights(weights):\n    for name, w in weights:\n" + _nested_ifs(levels, 2, "h0(w)")
            + "\n\ndef other(weights):\n    return list(weights)\n")


def test_a_function_too_deep_to_follow_is_named_and_the_rest_of_its_file_audited(tmp_path, capsys):
    """The flow walks nested statements recursively (Python allows 100 levels of them); a walk that still
    passes the recursion limit loses that function's findings, never the file's: the function is named
    as skipped, with its line, and the exit status is 2 (the audit is incomplete). The whole file was
    skipped, `other`'s finding with it, and the exit status was 0."""
    src = _helpers_nested_deep(90)
    compile(src, "m.py", "exec")  # Python compiles it
    lines = src.splitlines()
    where = {name: lines.index(f"def {name}(weights):") + 1 for name in ("load_weights", "other")}
    result = audit_text(src, "m.py")
    assert _found(result) == [("OWN103", where["other"] + 1, "other")] and result.errors == []
    (skip,) = result.skipped
    assert (skip.path, skip.line, skip.function) == ("m.py", where["load_weights"], "load_weights")
    assert "too deeply" in skip.reason
    (tmp_path / "m.py").write_text(src)
    code, out, _ = _run(capsys, str(tmp_path / "m.py"))
    skipped = [line for line in out.splitlines() if line.startswith("skipped: ")]
    assert code == 2 and len(skipped) == 1, out
    assert f"m.py:{where['load_weights']}: `load_weights`" in skipped[0] and "findings are missing" in skipped[0]
    assert f"m.py:{where['other'] + 1}:" in out and "1 function skipped" in out.splitlines()[-1]
    code, out, _ = _run(capsys, "--exit-zero", "--format", "concise", str(tmp_path / "m.py"))
    assert code == 2 and "skipped: " in out


def test_files_not_read_and_functions_not_followed_are_in_every_format(tmp_path, capsys):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the test extra) validates the schema")
    (tmp_path / "a_bad.py").write_bytes(UNCOMPILABLE["sum-of-5000-terms"][0])
    (tmp_path / "b_nested.py").write_text(_helpers_nested_deep(90))
    (tmp_path / "c_good.py").write_bytes(RETAINING)
    code, out, err = _run(capsys, "--format", "json", str(tmp_path))
    doc = json.loads(out)
    with open(SCHEMA_FILE, encoding="utf-8") as fh:
        jsonschema.validate(doc, json.load(fh))
    assert code == 2 and doc["summary"]["errors"] == 1 and doc["summary"]["skipped"] == 1
    (error,) = doc["errors"]
    assert "a_bad.py" in error and "does not parse" in error
    (skip,) = doc["skipped"]
    assert skip["path"] == str(tmp_path / "b_nested.py") and skip["function"] == "load_weights"
    assert skip["line"] > 1 and "too deeply" in skip["reason"]
    assert sorted((os.path.basename(f["path"]), f["function"]) for f in doc["findings"]) == [
        ("b_nested.py", "other"), ("c_good.py", "load_weights")]
    assert "a_bad.py" in err and "b_nested.py" in err  # named on stderr too, since stdout is a document
    code, out, _ = _run(capsys, "--format", "sarif", str(tmp_path))
    (inv,) = json.loads(out)["runs"][0]["invocations"]
    assert code == 2 and inv["executionSuccessful"] is False
    bad, nested = inv["toolExecutionNotifications"]
    assert bad["level"] == "error" and "a_bad.py" in bad["message"]["text"]
    assert nested["level"] == "error" and "load_weights" in nested["message"]["text"]
    (location,) = nested["locations"]
    assert location["physicalLocation"]["region"]["startLine"] == skip["line"]
    assert location["logicalLocations"] == [{"fullyQualifiedName": "load_weights", "kind": "function"}]


# 9: file names that are not UTF-8 ---------------------------------------------------------------

@pytest.fixture
def odd_name(tmp_path):
    if sys.platform == "darwin" or os.name == "nt":
        pytest.skip("the file system must accept a non-UTF-8 byte in a name")
    path = os.fsencode(str(tmp_path)) + b"/caf\xe9.py"
    try:
        with open(path, "wb") as fh:
            fh.write(RETAINING)
    except OSError:
        pytest.skip("this file system refuses a non-UTF-8 byte in a name")
    return tmp_path


@pytest.mark.parametrize("fmt", ["text", "concise", "json", "sarif"])
def test_a_non_utf_8_file_name_is_written_whole_in_every_format(odd_name, capsys, fmt):
    out_file = odd_name / "out.txt"
    code, out, _ = _run(capsys, "--output", str(out_file), "--format", fmt, str(odd_name))
    assert code == 1 and out == ""
    data = out_file.read_bytes()
    if fmt in ("json", "sarif"):
        doc = json.loads(data.decode("utf-8"))  # strict: valid UTF-8
        text = json.dumps(doc, ensure_ascii=False)
        text.encode("utf-8")  # no lone surrogate inside any string
        assert "caf" in text and (doc["summary"]["findings"] if fmt == "json" else len(doc["runs"][0]["results"])) == 1
    else:
        assert b"caf\xe9.py:2:" in data  # the name's own bytes, as ls and the shell name it
        assert fmt == "concise" or data.rstrip().splitlines()[-1].startswith(b"ownsan audit: 1 finding")
    assert sorted(os.listdir(str(odd_name))) == sorted([os.fsdecode(b"caf\xe9.py"), "out.txt"])  # no temp file


def test_a_non_utf_8_file_name_on_a_strict_stdout_is_no_traceback(odd_name):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")},
           "PYTHONPATH": ROOT, "PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"}
    proc = subprocess.run([sys.executable, "-m", "sanitizer.audit", "--format", "concise", str(odd_name)],
                          capture_output=True, timeout=120, env=env)
    assert proc.returncode == 1 and b"Traceback" not in proc.stderr, proc.stderr
    assert b"caf\xe9.py:2:" in proc.stdout


def test_a_failed_write_leaves_the_old_output_whole_and_no_temp_file(tmp_path, capsys, monkeypatch):
    (tmp_path / "m.py").write_bytes(RETAINING)
    out_file = tmp_path / "out.json"
    out_file.write_text("the previous output\n")

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    code, _, err = _run(capsys, "--output", str(out_file), "--format", "json", str(tmp_path / "m.py"))
    assert code == 2 and str(out_file) in err and "Permission denied" in err and len(err.splitlines()) == 1
    assert out_file.read_text() == "the previous output\n"
    assert sorted(os.listdir(str(tmp_path))) == ["m.py", "out.json"]


def test_the_output_file_keeps_its_permissions(tmp_path, capsys):
    (tmp_path / "m.py").write_bytes(RETAINING)
    out_file = tmp_path / "out.txt"
    out_file.write_text("old\n")
    os.chmod(str(out_file), 0o644)
    _run(capsys, "--output", str(out_file), str(tmp_path / "m.py"))
    assert os.stat(str(out_file)).st_mode & 0o777 == 0o644 and "OWN103" in out_file.read_text()
    new = tmp_path / "new.txt"
    _run(capsys, "--output", str(new), str(tmp_path / "m.py"))
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(str(new)).st_mode & 0o777 == 0o666 & ~umask


# 13: one file named three ways; --sync-readme on a file it cannot use ---------------------------

def test_one_file_named_three_ways_is_audited_once(tmp_path, capsys, monkeypatch):
    (tmp_path / "x.py").write_bytes(RETAINING)
    monkeypatch.chdir(tmp_path)
    result = audit_paths(["x.py", "./x.py", str(tmp_path / "x.py"), "."])
    assert result.files == 1 and result.paths == ["x.py"] and len(result.findings) == 1
    code, out, _ = _run(capsys, "--format", "concise", "x.py", "./x.py", str(tmp_path / "x.py"))
    assert code == 1 and out.splitlines() == [out.splitlines()[0]] and out.startswith("x.py:2:")


def test_a_symlink_to_an_audited_file_is_audited_once(tmp_path):
    (tmp_path / "x.py").write_bytes(RETAINING)
    try:
        os.symlink(str(tmp_path / "x.py"), str(tmp_path / "y.py"))
    except (OSError, NotImplementedError):
        pytest.skip("no symlinks here")
    result = audit_paths([str(tmp_path)])
    assert result.files == 1 and len(result.findings) == 1


def _options(capsys, *argv):
    code = cli.main(["options", *argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out.out, out.err


def test_sync_readme_on_a_missing_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.md"
    code, out, err = _options(capsys, "--sync-readme", str(missing))
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert str(missing) in err and "No such file or directory" in err


def test_sync_readme_on_a_file_without_its_markers_is_one_line_and_the_file_is_untouched(tmp_path, capsys):
    from sanitizer.core import options as opts

    page = tmp_path / "page.md"
    page.write_text("# Options\n\nno table here\n")
    code, _, err = _options(capsys, "--sync-readme", str(page))
    assert code == 2 and len(err.splitlines()) == 1 and str(page) in err and "<!-- options-table" in err
    page.write_text(f"# Options\n\n{opts.README_BEGIN}\nold\n")
    code, _, err = _options(capsys, "--sync-readme", str(page))
    assert code == 2 and len(err.splitlines()) == 1 and opts.README_END in err
    page.write_text(f"{opts.README_END}\n{opts.README_BEGIN}\n")
    code, _, err = _options(capsys, "--sync-readme", str(page))
    assert code == 2 and "before" in err
    assert page.read_text() == f"{opts.README_END}\n{opts.README_BEGIN}\n"
    page.write_text(f"# Options\n\n{opts.README_BEGIN}\nold\n{opts.README_END}\n")
    code, out, _ = _options(capsys, "--sync-readme", str(page))
    assert code == 0 and "updated" in out and opts.markdown_table() in page.read_text()


def test_the_compilers_warnings_about_the_audited_code_are_not_printed(tmp_path):
    """An invalid escape in the audited code (``"\\."``: a SyntaxWarning on 3.12+, printed by default) is the
    project's business: ``ownsan audit`` printed one per such file (seen on ColossalAI, Petals, xtuner)."""
    (tmp_path / "esc.py").write_text('import re\nPAT = re.compile("a\\.b")\n\n' + RETAINING.decode())
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-W", "default", "-m", "sanitizer.audit", str(tmp_path / "esc.py")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the retention is still found
    assert "Warning" not in proc.stderr, proc.stderr


def test_a_failure_of_the_audit_itself_on_one_function_is_named_and_the_rest_audited(tmp_path, capsys, monkeypatch):
    """A bug of the audit's own, met on code it did not expect, is no traceback: the function it failed on is
    named as skipped with the error and where it happened (to report), the other functions are audited, and
    the exit status is 2 (the audit is incomplete)."""
    from sanitizer.audit import flow as flow_module

    run = flow_module.Flow.run

    def failing(self):  # type: ignore[no-untyped-def]
        if self.info.name == "broken" and not getattr(self, "infer", False):
            raise KeyError("an unexpected shape")
        return run(self)

    monkeypatch.setattr(flow_module.Flow, "run", failing)
    path = tmp_path / "two.py"
    path.write_text("def load_weights(weights):\n    return list(weights)\n\n\n"
                    "def broken(weights):\n    return list(weights)\n")
    code, out, err = _run(capsys, str(path))
    assert code == 2
    assert "Traceback" not in out + err
    assert "two.py:2:" in out and "load_weights" in out  # the other function still audited
    line = [ln for ln in (out + err).splitlines() if "broken" in ln and "KeyError" in ln]
    assert len(line) == 1 and "a bug of ownsan audit" in line[0]
