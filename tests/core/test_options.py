"""The options table, the ASan-style option string and the OWNERSHIP_SANITIZE switch."""
from __future__ import annotations

import pytest

import sanitizer
from sanitizer.core import options as opts
from sanitizer.core.options import OptionError
from tests.conftest import run_python


def test_option_string_parses_every_type():
    raw = opts.parse_options_string("halt_on_error=0:stack_depth=3,report=/tmp/r-{pid}.json")
    resolved = opts.resolve(raw)
    assert resolved["halt_on_error"] is False
    assert resolved["stack_depth"] == 3
    assert resolved["report"] == "/tmp/r-{pid}.json"


def test_unknown_option_names_it_and_lists_the_valid_ones():
    with pytest.raises(opts.OptionError) as err:
        opts.parse_options_string("halt_on_eror=0")
    assert "halt_on_eror" in str(err.value)
    for name in opts.OPTIONS:
        assert name in str(err.value)
    with pytest.raises(opts.OptionError, match="nonsense"):
        sanitizer.enable(nonsense=1)
    assert not sanitizer.enabled()


@pytest.mark.parametrize("text,fragment", [
    ("stack_depth=many", "stack_depth"),
    ("stack_depth=-1", ">= 0"),
    ("halt_on_error=maybe", "halt_on_error"),
    ("halt_on_error", "name=value"),
])
def test_bad_values_name_option_and_value(text, fragment):
    with pytest.raises(opts.OptionError, match=fragment):
        opts.resolve(opts.parse_options_string(text))


def test_python_values_are_type_checked():
    assert opts.resolve({"stack_depth": 4})["stack_depth"] == 4
    with pytest.raises(opts.OptionError, match="stack_depth"):
        opts.resolve({"stack_depth": True})
    with pytest.raises(opts.OptionError, match="halt_on_error"):
        opts.resolve({"halt_on_error": "sometimes"})


def test_table_lists_every_option_with_type_default_and_help():
    table = sanitizer.options_table()
    for name, opt in opts.OPTIONS.items():
        assert name in table and opt.help.split()[0] in table


@pytest.mark.parametrize("value,expect", [("1", True), ("true", True), ("on", True), ("0", False),
                                          ("false", False), ("off", False), ("", False)])
def test_switch_values(value, expect):
    assert opts.switch_from_env({"OWNERSHIP_SANITIZE": value}) is expect


def test_bad_switch_value_fails_import_with_a_clear_error():
    proc = run_python("import sanitizer", {"OWNERSHIP_SANITIZE": "please"})
    assert proc.returncode != 0
    assert "OWNERSHIP_SANITIZE='please'" in proc.stderr


@pytest.mark.slow
def test_environment_enables_with_options_at_import():
    proc = run_python(
        "import sanitizer; print(sanitizer.enabled(), sanitizer.options()['halt_on_error'], "
        "sanitizer.options()['stack_depth'])",
        {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "halt_on_error=0:stack_depth=5"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "False", "5"]


def test_bad_options_string_fails_import_naming_it():
    proc = run_python("import sanitizer", {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "colour=red"})
    assert proc.returncode != 0 and "colour" in proc.stderr and "halt_on_error" in proc.stderr


def test_the_options_page_table_is_generated_from_the_table():
    """The docs read the one table too: docs/options.md's block must equal the generated one."""
    import os

    page = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs", "options.md")).read()
    block = page.split(opts.README_BEGIN)[1].split(opts.README_END)[0].strip()
    assert block == opts.markdown_table(), "run: ownsan options --sync-readme docs/options.md"


def test_resolved_options_are_frozen_typed_and_hold_the_cross_option_rule():
    o = opts.resolve({"stack_depth": "4", "halt_on_error": "1"})
    assert o["stack_depth"] == 4 and o.stack_depth == 4 and isinstance(o["halt_on_error"], bool)
    with pytest.raises(TypeError):
        o["stack_depth"] = 5  # type: ignore[index]
    with pytest.raises(AttributeError, match="frozen"):
        o.stack_depth = 5
    assert o.halts and not o.replace(triage=True).halts  # triage overrides halt_on_error
    assert o.replace(stack_depth=2)["stack_depth"] == 2 and o["stack_depth"] == 4
    with pytest.raises(opts.OptionError, match="unknown option 'stack_dept'"):
        o.replace(stack_dept=2)
    assert dict(o) == dict(opts.resolve(dict(o)))
    import pickle
    assert dict(pickle.loads(pickle.dumps(o))) == dict(o)


@pytest.mark.parametrize("text, report", [
    ("report='/runs/12:30,x/r.json':stack_depth=4", "/runs/12:30,x/r.json"),
    ('report="/runs/12:30/r.json",stack_depth=4', "/runs/12:30/r.json"),
    (r"report=/runs/12\:30\,x/r.json:stack_depth=4", "/runs/12:30,x/r.json"),
])
def test_a_report_path_with_separators_can_be_given_quoted_or_escaped(text, report):
    assert opts.parse_options_string(text) == {"report": report, "stack_depth": "4"}


@pytest.mark.parametrize("report, sep", [("/tmp/a,b.json", ","), ("/runs/12:30/r.json", ":")])
def test_a_value_cut_at_a_separator_says_how_to_write_it(report, sep):
    """Once only "'b.json' is not of the form name=value"."""
    cut = report.split(sep, 1)[1]
    with pytest.raises(OptionError) as err:
        opts.parse_options_string(f"report={report}:stack_depth=4")
    text = str(err.value)
    assert f"'{cut}' is not of the form name=value" in text
    assert "':' and ',' separate options" in text and "quoted" in text and "backslash" in text
    suggested = text.split("(did you mean ", 1)[1].split("?)", 1)[0]
    assert opts.parse_options_string(suggested) == {"report": report}  # the suggestion is the value, written right
    for example in ("report='/runs/12:30/r.json'", r"report=/runs/12\:30/r.json"):  # the ways it names work
        assert example in text and opts.parse_options_string(example) == {"report": "/runs/12:30/r.json"}


def test_a_bad_item_after_a_number_gets_no_quoting_guess():
    with pytest.raises(OptionError) as err:
        opts.parse_options_string("stack_depth=4:bogus")
    assert "'bogus' is not of the form name=value" in str(err.value) and "did you mean" not in str(err.value)


def test_an_options_string_built_from_values_reads_back_the_same():
    values = {"report": "/a:b,c'd\"e\\f/r-{pid}.json", "halt_on_error": False, "stack_depth": 3}
    assert opts.parse_options_string(opts.format_options_string(values)) == {
        "report": values["report"], "halt_on_error": "0", "stack_depth": "3"}


def test_an_unterminated_quote_is_named():
    with pytest.raises(OptionError, match="unterminated ' quote"):
        opts.parse_options_string("report='/runs/x")


def test_the_typed_attributes_are_the_table():
    """Issue 51 item 8: ``opts.exitcode`` is what a type checker reads of an option; the annotations on
    Options are one per option of the table, in its order, of its type (a new option must add its line)."""
    declared = {name: (t if isinstance(t, str) else t.__name__) for name, t in opts.Options.__annotations__.items()}
    assert list(declared) == list(opts.OPTIONS)
    assert declared == {name: o.type.__name__ for name, o in opts.OPTIONS.items()}
    resolved = opts.resolve({})
    assert all(getattr(resolved, name) == resolved[name] for name in opts.OPTIONS)
