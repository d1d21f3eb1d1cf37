"""Precision and recall of ``ownsan audit`` over its corpus (tests/audit_corpus: every retention
pattern with a retaining example and a safe look-alike, expected findings marked ``# expect: OWN1xx``).

The corpus is parsed, never imported. Figures are printed (``pytest -s``) and must be 1.0/1.0.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, Set, Tuple

import pytest

from sanitizer.audit import audit_paths
from sanitizer.audit.codes import CODES


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """Overrides conftest's: the audit never touches the sanitizer's runtime (and must not import torch),
    so there is nothing to reset between these tests."""
    yield


CORPUS = Path(__file__).resolve().parent.parent / "audit_corpus"
_EXPECT = re.compile(r"#\s*expect:\s*([A-Z0-9, ]+)")


def _expected() -> Set[Tuple[str, int, str]]:
    out = set()
    for path in sorted(CORPUS.glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            m = _EXPECT.search(line)
            if m:
                out.update((path.name, number, code) for code in m.group(1).replace(" ", "").split(",") if code)
    return out


def _functions_by_line() -> Dict[Tuple[str, int], str]:
    """(file, line) -> the qualified name of the innermost function holding that line."""
    out: Dict[Tuple[str, int], str] = {}
    for path in sorted(CORPUS.glob("*.py")):
        def visit(node: ast.AST, prefix: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = prefix + child.name
                    for line in range(child.lineno, child.end_lineno + 1):
                        out[(path.name, line)] = name
                    visit(child, name + ".<locals>.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, prefix + child.name + ".")
                else:
                    visit(child, prefix)
        visit(ast.parse(path.read_text()), "")
    return out


@pytest.fixture(scope="module")
def audited():
    return audit_paths([str(CORPUS)])


def _ratio(a: int, b: int) -> float:
    return a / b if b else 1.0


def test_statement_level_precision_and_recall_are_one(audited):
    expected = _expected()
    got = {(Path(f.path).name, f.line, f.code) for f in audited.findings}
    tp = got & expected
    precision, recall = _ratio(len(tp), len(got)), _ratio(len(tp), len(expected))
    print(f"\naudit corpus, statements: {len(expected)} expected, {len(got)} reported, precision {precision:.3f}, "
          f"recall {recall:.3f}")
    assert not got - expected, f"false positives: {sorted(got - expected)}"
    assert not expected - got, f"missed: {sorted(expected - got)}"
    assert precision == 1.0 and recall == 1.0


def test_function_level_precision_and_recall_are_one(audited):
    where = _functions_by_line()
    expected = {where[(name, line)] for name, line, _ in _expected()}
    got = {f.function for f in audited.findings}
    tp = got & expected
    precision, recall = _ratio(len(tp), len(got)), _ratio(len(tp), len(expected))
    safe = {f for f in set(where.values()) if f.split(".")[0].lower().startswith("safe")}
    print(f"audit corpus, functions: {len(expected)} retaining, {len(safe)} safe look-alike functions, "
          f"precision {precision:.3f}, recall {recall:.3f}")
    assert got == expected
    assert not got & safe


def test_every_code_has_a_corpus_example_and_every_file_a_safe_look_alike():
    codes = {code for _, _, code in _expected()}
    assert codes == set(CODES), f"codes without a retaining example: {set(CODES) - codes}"
    for path in sorted(CORPUS.glob("*.py")):
        text = path.read_text()
        if "# expect:" in text and path.name != "helpers_shared.py":
            assert re.search(r"^(def|class) [Ss]afe", text, re.M), f"{path.name} has no safe look-alike"


def test_the_consumers_it_looked_at_include_every_weight_consuming_function(audited):
    names = {c.function for c in audited.consumers}
    for expected in ("KeepList.load_weights", "SafeNames.load_weights", "KeepLoaders.weight_loader",
                     "make_deferring_loader.<locals>.online_process_loader", "keep_from_safe_open",
                     "sharded_weight_loader.<locals>.loader"):
        assert expected in names
