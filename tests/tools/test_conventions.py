"""The conventions a user's tools expect (issue 51 item 7): PEP 561's ``py.typed``, one repository URL in the
package metadata, the SARIF rules and the docs, ASan's ``help=1``, ``ownsan demo --help`` naming itself, and no
tool output tracked in git."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11+")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def test_the_package_is_typed_for_a_users_type_checker():
    assert os.path.isfile(os.path.join(ROOT, "sanitizer", "py.typed"))
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["sanitizer"]


def test_one_repository_url_in_the_metadata_the_sarif_and_the_docs():
    from sanitizer.audit.formats import INFO_URI

    home = _pyproject()["project"]["urls"]["Homepage"]
    assert INFO_URI.startswith(home + "/")
    for page in ("README.md", os.path.join("docs", "audit.md"), os.path.join("docs", "ci.md")):
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for url in re.findall(r"https://github\.com/[\w<>.-]+/ownership-sanitizer", text):
            assert url == home, f"{page}: {url} is not {home}"


def test_help_1_prints_the_option_table_and_goes_on(tmp_path):
    env = dict(os.environ, OWNERSHIP_SANITIZE="1", OWNERSHIP_SANITIZE_OPTIONS="help=1")
    out = subprocess.run([sys.executable, "-c", "import torch, sanitizer; print('ran')"], capture_output=True,
                         text=True, env=env, timeout=240, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr
    assert out.stderr.startswith("option ") and "halt_on_error" in out.stderr and "exitcode" in out.stderr


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_ownsan_demo_help_names_ownsan_demo():
    out = subprocess.run([sys.executable, "-m", "sanitizer", "demo", "--help"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0 and out.stdout.startswith("usage: ownsan demo"), out.stdout[:200]


def test_no_tool_output_is_tracked():
    if shutil.which("git") is None or not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    assert not [f for f in tracked if os.path.basename(f) in (".coverage", "ownsan-report.json")
                or f.endswith((".pyc", ".journal"))]


def test_every_relative_link_in_the_readme_and_docs_resolves():
    """docs/layout.md linked docs/fuzzing.md from inside docs/ (issue 51 item 3): a link that 404s on GitHub."""
    pages = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if f.endswith(".md")]
    broken = []
    for page in pages:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))):
                broken.append(f"{page}: {target}")
    assert not broken, broken


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_json_for_options_doctor_and_triage_and_a_description_for_every_subcommand(tmp_path):
    import json

    from sanitizer.tools import cli

    def ownsan(*argv):
        return subprocess.run([sys.executable, "-m", "sanitizer", *argv], capture_output=True, text=True, timeout=240)

    table = json.loads(ownsan("options", "--json").stdout)
    assert {"halt_on_error", "exitcode", "suppressions"} <= {o["name"] for o in table}
    doctor = ownsan("doctor", "--json")
    assert isinstance(json.loads(doctor.stdout)["checks"], list)
    report = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "sanitizer", "run", "-q", "--report", str(report), "--", sys.executable,
                    "-c", "import torch"], capture_output=True, text=True, timeout=240)
    summary = json.loads(ownsan("triage", "--json", str(report)).stdout)
    assert summary["line"].startswith("ownership-sanitizer: 0 errors") and summary["retentions"] == 0
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert all(p.description for p in subs.choices.values()), [n for n, p in subs.choices.items() if not p.description]
    assert "--sync-readme" not in ownsan("options", "--help").stdout  # a maintainer's flag


def test_docs_layout_names_every_module():
    """Issue 51 item 8: about sixty modules (the journal, the trap helpers, the audit's) were named nowhere
    on the page the next engineer reads first."""
    page = open(os.path.join(ROOT, "docs", "layout.md"), encoding="utf-8").read()
    missing = []
    for top in ("sanitizer", "cuda_hooks"):
        for folder, _dirs, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py") and name != "__init__.py":
                    path = os.path.relpath(os.path.join(folder, name), ROOT)
                    if path not in page and f"`{name}`" not in page and name not in page:
                        missing.append(path)
    assert not missing, f"docs/layout.md names none of: {missing}"
