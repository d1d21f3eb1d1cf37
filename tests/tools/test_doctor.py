"""``ownsan doctor``: whether ``OWNERSHIP_SANITIZE=1`` would sanitize a program run by this interpreter.

The silent case it exists for: a checkout importable from ``PYTHONPATH`` without the start-up hook, where
``OWNERSHIP_SANITIZE=1 python serve.py`` runs ``serve.py`` unsanitized and nothing of ours runs to say so.
"""
from __future__ import annotations

import os
import site
import subprocess
import sys

import pytest

from sanitizer.tools import doctor, startup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    env.update(extra)
    return env


@pytest.fixture
def site_dir(tmp_path, monkeypatch):
    """This interpreter's site directories, replaced by one empty directory of the test's."""
    d = tmp_path / "site-packages"
    d.mkdir()
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(d)])
    monkeypatch.setattr(site, "ENABLE_USER_SITE", False)
    monkeypatch.setattr(startup, "site_packages", lambda: str(d))
    return d


def _row(rows, what):
    return next((verdict, detail) for verdict, name, detail in rows if name == what)


def test_switch_on_without_the_hook_is_a_failure_that_says_the_program_runs_unsanitized(site_dir):
    rows, works = doctor.check({"OWNERSHIP_SANITIZE": "1"})
    verdict, detail = _row(rows, "zero-code hook")
    assert verdict == "FAIL" and not works
    assert "UNSANITIZED" in detail and str(site_dir) in detail and "ownsan install-hook" in detail


def test_the_hook_installed_makes_the_switch_work(site_dir):
    startup.install_pth(str(site_dir))
    rows, works = doctor.check({"OWNERSHIP_SANITIZE": "1"})
    verdict, detail = _row(rows, "zero-code hook")
    assert verdict == "ok" and str(site_dir / startup.PTH_NAME) in detail
    assert works == all(v != "FAIL" for v, _, _ in rows)


def test_without_the_switch_a_missing_hook_is_only_a_warning(site_dir):
    rows, works = doctor.check({})
    assert _row(rows, "zero-code hook")[0] == "warn"
    assert _row(rows, "OWNERSHIP_SANITIZE") == ("ok", "unset (off)")


def test_bad_switch_and_bad_options_are_named_with_their_values():
    rows, works = doctor.check({"OWNERSHIP_SANITIZE": "bogus", "OWNERSHIP_SANITIZE_OPTIONS": "stack_dept=4"})
    assert not works
    assert _row(rows, "OWNERSHIP_SANITIZE")[0] == "FAIL" and "'bogus'" in _row(rows, "OWNERSHIP_SANITIZE")[1]
    verdict, detail = _row(rows, "OWNERSHIP_SANITIZE_OPTIONS")
    assert verdict == "FAIL" and "stack_dept" in detail


def test_the_command_answers_a_bad_switch_instead_of_dying_of_it_and_imports_no_torch():
    """``ownsan`` is a tool, not the program to sanitize: the switch in its own environment neither
    enables the sanitizer in it (importing torch) nor kills it with a traceback."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "sanitizer", "doctor"], capture_output=True,
                         text=True, timeout=120, env=_env(OWNERSHIP_SANITIZE="bogus"), cwd=ROOT)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  OWNERSHIP_SANITIZE" in out.stdout and "Traceback" not in out.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" not in imported and "numba" not in imported


def test_a_program_still_enables_from_the_switch():
    """Only the command line skips it: ``python -c 'import sanitizer'`` with the switch on is enabled."""
    out = subprocess.run([sys.executable, "-c", "import sanitizer; print(sanitizer.enabled())"],
                         capture_output=True, text=True, timeout=120, env=_env(OWNERSHIP_SANITIZE="1"), cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr
