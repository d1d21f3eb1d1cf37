"""``ownsan audit`` follows the conventions its users' linters set (issue 50, item 3), as ruff spells them:
``# noqa``, ``select``/``ignore``/``extend-select``/``exclude``/``extend-exclude``/``per-file-ignores`` in
``[tool.ownsan]`` and on the command line, PATH defaulting to ``.``, whole SARIF rule titles (the SARIF
validated against the official 2.1.0 schema), and no ``-o`` that means something else than in ``ownsan run``."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from sanitizer.audit import audit_paths, suppression
from sanitizer.audit.cli import main
from sanitizer.audit.codes import CODES, CodeSelectionError
from sanitizer.audit.formats import to_sarif
from sanitizer.audit.selection import RuleSelection, parse_selectors, resolve
from sanitizer.audit.settings import resolve as resolve_settings
from sanitizer.reporting.schema import validate

SARIF_SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sarif-schema-2.1.0.json")


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """The audit never touches the sanitizer's runtime (and must not import torch)."""
    yield


# Four findings, one per line: OWN101 (line 8), OWN102 (9), OWN106 (10), OWN103 (11).
FOUR = textwrap.dedent('''\
    CACHE = {}


    class M:
        def load_weights(self, weights):
            side = []
            for name, w in weights:
                side.append(w)<c8>
                self.last = w<c9>
                CACHE[name] = w<c10>
            return side, list(weights)<c11>
''')


def _module(tmp_path, name="m.py", **comments):
    text = FOUR
    for n in (8, 9, 10, 11):
        text = text.replace(f"<c{n}>", comments.get(f"c{n}", ""))
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _codes(capsys, *argv):
    code = main(["--format", "concise", *argv])
    out = capsys.readouterr().out
    return code, [line.split()[1] for line in out.splitlines() if ": OWN" in line]


# -- # noqa ----------------------------------------------------------------------------------------------
def test_noqa_with_codes_suppresses_those_codes_on_the_findings_line(tmp_path, capsys):
    path = _module(tmp_path, c8="  # noqa: OWN101", c9="  # noqa: OWN101, OWN106", c10="  # noqa:OWN106,OWN107",
                   c11="  # NOQA : OWN103 reason")
    assert _codes(capsys, str(path)) == (1, ["OWN102"])  # line 9's noqa names other codes than its finding's


def test_bare_noqa_suppresses_every_code_and_other_linters_codes_suppress_nothing(tmp_path, capsys):
    path = _module(tmp_path, c8="  # noqa", c9="  # noqa: E501", c10="  #noqa # and a remark", c11="  # noqa-ish")
    assert _codes(capsys, str(path)) == (1, ["OWN102", "OWN103"])


def test_noqa_codes_are_case_sensitive_as_in_ruff(tmp_path, capsys):
    path = _module(tmp_path, c8="  # noqa: own101", c9="  # noqa: Own102")
    assert _codes(capsys, str(path)) == (1, ["OWN101", "OWN102", "OWN106", "OWN103"])


def test_noqa_applies_to_its_own_line_and_never_inside_a_string(tmp_path, capsys):
    src = textwrap.dedent('''\
        def load_weights(weights):
            side = []
            s = "# noqa"
            for name, w in weights:  # noqa
                side.append(w); s.join("# noqa")
            return side
    ''')
    (tmp_path / "m.py").write_text(src)
    assert _codes(capsys, str(tmp_path / "m.py")) == (1, ["OWN101"])


def test_noqa_is_counted_as_suppressed_and_read_by_the_directive_parser():
    assert suppression.noqa_codes("# noqa") == suppression.ALL
    assert suppression.noqa_codes("# type: ignore  # noqa: OWN106 OWN107 because") == {"OWN106", "OWN107"}
    assert suppression.noqa_codes("# noqa:") is None and suppression.noqa_codes("# noqa: own106") is None
    assert suppression.noqa_codes("# noqasomething") is None


def test_the_flake8_plugin_leaves_noqa_to_flake8(tmp_path):
    """flake8 reads ``# noqa`` itself (and --disable-noqa must show every finding): the plugin reports the
    line; ``# ownsan: ignore`` stays the plugin's."""
    import ast

    from sanitizer.audit.flake8_plugin import OwnsanAuditChecker

    path = _module(tmp_path, c8="  # noqa: OWN101", c9="  # ownsan: ignore[OWN102]")
    text = path.read_text()
    got = [msg.split()[0] for _, _, msg, _ in OwnsanAuditChecker(ast.parse(text), str(path), text.splitlines(True)).run()]
    assert got == ["OWN101", "OWN106", "OWN103"]


# -- select / ignore / extend-select, as ruff resolves them --------------------------------------------------
def test_selection_resolves_as_ruff_documents():
    """ruff's docs: given select = ["E", "F"], ignore = ["F401"], "Running `ruff check --select F401` would
    result in Ruff enforcing F401, and no other rules"; "--extend-select B" adds B, still without F401."""
    config = RuleSelection(("OWN10",), (), ("OWN101",))
    assert resolve([config]) == ("OWN102", "OWN103", "OWN104", "OWN105", "OWN106", "OWN107")
    assert resolve([config, RuleSelection(("OWN101",))]) == ("OWN101",)
    assert resolve([config, RuleSelection(None, ("OWN120",))])[-1] == "OWN120"
    assert "OWN101" not in resolve([config, RuleSelection(None, ("OWN120",))])
    # the more specific selector wins; at the same specificity, ignore wins
    assert resolve([RuleSelection(("ALL",), (), ("OWN107",))]) == tuple(c for c in CODES if c != "OWN107")
    assert resolve([RuleSelection(("OWN107",), (), ("ALL",))]) == ("OWN107",)
    assert resolve([RuleSelection(("OWN1",), (), ("OWN1",))]) == ()
    # a source that only ignores, with an empty select, carries its ignores over (ruff's carry-over)
    assert resolve([RuleSelection(("OWN1",)), RuleSelection((), (), ("OWN106",)), RuleSelection(("OWN10",))]) == \
        ("OWN101", "OWN102", "OWN103", "OWN104", "OWN105", "OWN107")
    assert resolve([]) == tuple(CODES)


def test_selectors_are_codes_prefixes_or_all_and_case_sensitive():
    assert parse_selectors(["OWN101,OWN12", "ALL"], "--select") == ("OWN101", "OWN12", "ALL")
    with pytest.raises(CodeSelectionError, match=r"--select 'own1': no such code \(codes are upper case: OWN1\)"):
        parse_selectors(["own1"], "--select")
    with pytest.raises(CodeSelectionError, match="--ignore 'E501'"):
        parse_selectors(["E501"], "--ignore")


SETTINGS = textwrap.dedent('''\
    [tool.ownsan]
    select = ["OWN10"]
    ignore = ["OWN101"]
''')


def test_select_and_ignore_in_settings_and_the_command_line_over_them(tmp_path, capsys, monkeypatch):
    path = _module(tmp_path)
    (tmp_path / "pyproject.toml").write_text(SETTINGS)
    monkeypatch.chdir(tmp_path)
    assert _codes(capsys, "m.py") == (1, ["OWN102", "OWN106", "OWN103"])
    assert _codes(capsys, "--select", "OWN101", "m.py") == (1, ["OWN101"])  # the file's ignore goes too
    assert _codes(capsys, "--ignore", "OWN102", "m.py") == (1, ["OWN106", "OWN103"])
    assert _codes(capsys, "--extend-ignore", "OWN106,OWN102", "m.py") == (1, ["OWN103"])
    assert _codes(capsys, "--extend-select", "OWN101", "m.py")[1] == ["OWN101", "OWN102", "OWN106", "OWN103"]
    assert _codes(capsys, "--select", "ALL", "--ignore", "OWN10", "m.py") == (0, [])
    (tmp_path / "pyproject.toml").write_text("[tool.ownsan]\nextend-select = ['OWN120']\nignore = ['OWN1']\n")
    assert _codes(capsys, "m.py") == (0, [])  # OWN120 is more specific than OWN1: only OWN120 is reported
    (tmp_path / "pyproject.toml").write_text("[tool.ownsan]\nselect = []\n")
    assert _codes(capsys, str(path)) == (0, [])  # an empty select reports nothing, as in ruff


@pytest.mark.parametrize("table, needle", [
    ('select = ["own101"]', "select 'own101': no such code (codes are upper case: OWN101)"),
    ('ignore = ["OWN999"]', "ignore 'OWN999': no such code"),
    ('extend-select = "OWN1"\nexclude = [1]', "exclude must be a list of non-empty strings, got [1]"),
    ('[tool.ownsan.per-file-ignores]\n"a/*" = ["own1"]', "per-file-ignores 'a/*' 'own1'"),
])
def test_bad_selection_settings_are_one_named_line_and_exit_2(tmp_path, capsys, table, needle):
    _module(tmp_path)
    (tmp_path / "pyproject.toml").write_text(f"[tool.ownsan]\n{table}\n")
    assert main([str(tmp_path / "m.py")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--select", "own1"], "--select 'own1': no such code (codes are upper case: OWN1)"),
    (["--extend-select", "X1"], "--extend-select 'X1'"),
    (["--per-file-ignores", "tests/*"], "--per-file-ignores 'tests/*': expected GLOB:CODE"),
    (["--extend-per-file-ignores", "tests/*:OWN9"], "--extend-per-file-ignores 'OWN9'"),
])
def test_bad_selection_flags_are_one_named_line_and_exit_2(tmp_path, capsys, argv, needle):
    _module(tmp_path)
    assert main([*argv, str(tmp_path / "m.py")]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


# -- per-file-ignores, exclude, extend-exclude -----------------------------------------------------------------
def test_per_file_ignores_as_ruff_names_it_with_negation_and_the_older_name_still_read(tmp_path, capsys, monkeypatch):
    _module(tmp_path, "src/m.py")
    _module(tmp_path, "tests/test_m.py")
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent('''\
        [tool.ownsan.per-file-ignores]
        "tests/*" = ["OWN1"]
        "!src/*" = ["OWN102"]
        [tool.ownsan.per-path-ignores]
        "m.py" = ["OWN106"]
    '''))
    monkeypatch.chdir(tmp_path)
    assert _codes(capsys, ".") == (1, ["OWN101", "OWN102", "OWN103"])  # only src/m.py; OWN106 by its name
    replaced = _codes(capsys, "--per-file-ignores", "src/*:OWN101,src/*:OWN103", ".")  # the file's are dropped
    assert replaced == (1, ["OWN102", "OWN106", "OWN101", "OWN102", "OWN106", "OWN103"])
    assert _codes(capsys, "--extend-per-file-ignores", "src/*:OWN101", ".") == (1, ["OWN102", "OWN103"])
    main(["--show-settings"])
    out = capsys.readouterr().out
    assert "per-file-ignores:\n  tests/*: OWN101, OWN102" in out and "  !src/*: OWN102" in out


def test_exclude_and_extend_exclude_in_settings_and_on_the_command_line(tmp_path, capsys, monkeypatch):
    for name in ("src/m.py", "src/gen/m_pb2.py", "vendored/m.py", "build/m.py"):
        _module(tmp_path, name)
    (tmp_path / "pyproject.toml").write_text('[tool.ownsan]\nextend-exclude = ["vendored", "*_pb2.py"]\n'
                                             'select = ["OWN101"]\n')
    monkeypatch.chdir(tmp_path)

    def files(*argv):
        main(["--format", "concise", *argv])
        return sorted({line.split(":")[0] for line in capsys.readouterr().out.splitlines()})

    assert files() == ["./src/m.py"]  # build/ is in the default list; vendored and *_pb2.py extend it
    assert files("--extend-exclude", "src/m.py") == []
    assert files("--exclude", "vendored") == ["./build/m.py", "./src/m.py"]  # the default list replaced
    assert files("src/gen/m_pb2.py") == ["src/gen/m_pb2.py"]  # a file named on the command line is audited
    (tmp_path / "pyproject.toml").write_text('[tool.ownsan]\nexclude = ["src/gen/*"]\nselect = ["OWN101"]\n')
    assert files() == ["./build/m.py", "./src/m.py", "./vendored/m.py"]  # relative to the project root
    settings = resolve_settings([str(tmp_path / "src")])
    assert [os.path.basename(f.path) for f in audit_paths([str(tmp_path / "src")], settings=settings).findings] == \
        ["m.py"]


# -- PATH defaults to . -----------------------------------------------------------------------------------
def test_no_path_audits_the_current_directory_as_ruff_does(tmp_path, capsys, monkeypatch):
    _module(tmp_path, "pkg/m.py")
    monkeypatch.chdir(tmp_path)
    code = main(["--format", "concise"])
    out = capsys.readouterr().out
    assert code == 1 and out.splitlines()[0].startswith("./pkg/m.py:8:")
    assert main(["--format", "concise", "."]) == 1 and capsys.readouterr().out == out
    (tmp_path / "pkg" / "m.py").write_text("x = 1\n")
    assert main([]) == 0


# -- SARIF -------------------------------------------------------------------------------------------------
def _sarif(tmp_path, capsys):
    path = _module(tmp_path, "weird name é.py")
    assert main(["--format", "sarif", "--output", str(tmp_path / "out.sarif"), str(path)]) == 1
    capsys.readouterr()
    return json.loads((tmp_path / "out.sarif").read_text(encoding="utf-8"))


def _official_schema():
    with open(SARIF_SCHEMA, encoding="utf-8") as fh:
        return json.load(fh)


def test_sarif_validates_against_the_official_2_1_0_schema(tmp_path, capsys):
    schema = _official_schema()
    assert schema["id"].endswith("/sarif-schema-2.1.0.json") and "2.1.0" in schema["title"]
    doc = _sarif(tmp_path, capsys)
    assert validate(doc, schema) == []
    assert len(doc["runs"][0]["results"]) == 4
    broken = json.loads(json.dumps(doc))  # what the schema refuses, the check refuses
    broken["runs"][0]["tool"]["driver"]["rules"].append(dict(broken["runs"][0]["tool"]["driver"]["rules"][0]))
    broken["runs"][0]["results"][0]["level"] = "fatal"
    broken["runs"][0]["tool"]["driver"]["informationUri"] = "docs/audit.md"
    problems = validate(broken, schema)
    assert any("uniqueItems" in p for p in problems) and any("'fatal'" in p for p in problems)
    assert any("informationUri" in p and "not a valid uri" in p for p in problems)


def test_sarif_validation_agrees_with_jsonschema(tmp_path, capsys):
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (the test extra) cross-checks the validator")
    schema = _official_schema()
    jsonschema.Draft4Validator.check_schema(schema)
    checker = jsonschema.Draft4Validator(schema, format_checker=jsonschema.Draft4Validator.FORMAT_CHECKER)
    doc = _sarif(tmp_path, capsys)
    assert list(checker.iter_errors(doc)) == []
    broken = json.loads(json.dumps(doc))
    del broken["runs"][0]["tool"]["driver"]["name"]
    assert list(checker.iter_errors(broken)) and validate(broken, schema)


def test_sarif_rule_titles_are_whole_and_distinct():
    """A title cut at the meaning's first parenthesis or colon made OWN101 and OWN102 both "a yielded tensor"."""
    rules = to_sarif(audit_paths([]))["runs"][0]["tool"]["driver"]["rules"]
    titles = [r["shortDescription"]["text"] for r in rules]
    assert len(set(titles)) == len(titles) == len(CODES)
    for rule, title in zip(rules, titles):
        assert title == CODES[rule["id"]].title and title[0].isupper() and title.endswith(".")
        assert title.count("(") == title.count(")") and title.count("`") % 2 == 0
        assert len(title.split()) >= 8, title  # a sentence, not a fragment
        assert rule["fullDescription"]["text"] == CODES[rule["id"]].meaning


# -- -o ----------------------------------------------------------------------------------------------------
def test_short_o_is_not_the_audits_output_flag(tmp_path, capsys):
    path = _module(tmp_path)
    for argv in (["-o", str(tmp_path / "x.json")], [f"-o{tmp_path / 'x.json'}"]):
        assert main(["--format", "json", *argv, str(path)]) == 2
        err = capsys.readouterr().err
        assert "-o is not a flag of ownsan audit" in err and "--output FILE" in err and err.count("\n") == 1
    assert not (tmp_path / "x.json").exists()
    assert main(["--format", "json", "--output", str(tmp_path / "x.json"), str(path)]) == 1
    assert json.loads((tmp_path / "x.json").read_text())["summary"]["findings"] == 4
