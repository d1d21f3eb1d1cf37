"""docs/loaders.md's tables are the adapters' contract tables and the engine table, rendered now; each
adapter's docstring carries its own table (the README's option table is kept true the same way)."""
from __future__ import annotations

import os

import pytest

from sanitizer.adapters import contracts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "loaders.md")


def test_docs_loaders_md_is_in_sync_with_the_adapters():
    with open(DOC, encoding="utf-8") as fh:
        text = fh.read()
    assert contracts.sync_text(text, contracts.doc_sections(contracts.all_contracts())) == text, (
        "docs/loaders.md is out of date: run `python -m sanitizer.adapters.contracts --sync docs/loaders.md`")


@pytest.mark.parametrize("name", ["fastsafetensors_adapter", "runai_adapter", "instanttensor_adapter",
                                  "safetensors_adapter"])
def test_each_adapter_states_its_table_in_its_docstring(name):
    import importlib

    adapter = importlib.import_module(f"sanitizer.adapters.{name}")
    assert contracts.render_contracts(adapter.CONTRACTS) in adapter.__doc__


def test_a_missing_section_is_named():
    with pytest.raises(ValueError, match="no section 'engine-table'"):
        contracts.sync_text("no markers here", {"engine-table": "x"})


@pytest.mark.parametrize("text,parsed", [("0.15.7", (0, 15, 7)), ("0.3", (0, 3, 0)), ("0.5.0rc1", (0, 5, 0)),
                                         ("v1.2.3", (1, 2, 3)), ("unknown", None), (None, None)])
def test_versions_parse(text, parsed):
    assert contracts.parse_version(text) == parsed


def test_known_ranges_and_the_warning_line():
    from sanitizer.adapters import fastsafetensors_adapter as fst

    c = fst.CONTRACTS
    assert c.knows("0.2.0") and c.knows("0.5.9") and not c.knows("0.6.0") and not c.knows("0.1.15")
    assert c.known == "0.2.0 to 0.5.x" and c.warning("0.5.0") is None
    line = c.warning("0.6.1")
    assert line.startswith("ownership-sanitizer: fastsafetensors 0.6.1 is outside") and "assuming the 0.5" in line
    assert "version unknown" in c.warning(None)


def test_the_readme_engine_table_is_in_sync_with_the_adapters():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    assert contracts.sync_text(text, contracts.readme_sections()) == text, (
        "README.md's engine table is out of date: run `python -m sanitizer.adapters.contracts --sync README.md`")
