"""The flake8 plugin: the same OWN1xx codes through flake8's plugin protocol. flake8 is not a
dependency: the class's interface is tested directly, and through flake8 itself only where installed."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from sanitizer.audit.flake8_plugin import OwnsanAuditChecker
from conftest import ROOT


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    """Overrides conftest's: nothing of the sanitizer's runtime to reset here."""
    yield


SRC = textwrap.dedent('''
    def load_weights(weights):
        kept = {}
        for name, w in weights:
            kept[name] = w.t()
            kept[name + "!"] = w  # ownsan: ignore[OWN101]
        return kept
''')


def test_the_checker_follows_flake8s_plugin_protocol():
    lines = SRC.splitlines(keepends=True)
    checker = OwnsanAuditChecker(ast.parse(SRC), "m.py", lines)
    assert OwnsanAuditChecker.name == "ownsan-audit" and isinstance(OwnsanAuditChecker.version, str)
    results = list(checker.run())
    assert len(results) == 1
    line, col, text, kind = results[0]
    assert (line, col) == (5, 8)  # flake8 columns are 0-based
    assert text.startswith("OWN101 ") and "sanitizer.own(t)" in text and kind is OwnsanAuditChecker


def test_the_checker_reads_the_file_when_flake8_gives_no_lines(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(SRC)
    assert [r[2][:6] for r in OwnsanAuditChecker(ast.parse(SRC), str(path)).run()] == ["OWN101"]


def test_the_entry_point_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as fh:
        text = fh.read()
    assert '[project.entry-points."flake8.extension"]' in text
    assert 'OWN = "sanitizer.audit.flake8_plugin:OwnsanAuditChecker"' in text


def test_through_flake8_when_installed(tmp_path):
    pytest.importorskip("flake8", reason="flake8 is not installed (it is not a dependency)")
    from importlib.metadata import entry_points

    if not any(ep.value.startswith("sanitizer.audit.flake8_plugin") for ep in entry_points(group="flake8.extension")):
        pytest.skip("this checkout is not installed, so flake8 cannot find the plugin's entry point")
    (tmp_path / "m.py").write_text(SRC)
    out = subprocess.run([sys.executable, "-m", "flake8", "--select", "OWN", "m.py"], cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stdout.strip().splitlines() == [out.stdout.strip().splitlines()[0]]
    assert out.stdout.startswith("m.py:5:9: OWN101 ")
