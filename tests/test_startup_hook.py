"""Zero-code activation: the .pth start-up hook, off (free) and on (enables at torch import)."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from sanitizer.tools import startup
from conftest import ROOT

PTH_FILE = os.path.join(ROOT, startup.PTH_NAME)


def _python(code: str, site_dir: str, env_extra: dict | None = None, timeout: float = 120):
    """Run ``code`` after processing ``site_dir`` as a site directory (it holds the .pth)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT
    env.update(env_extra or {})
    prelude = f"import site, sys\nbefore = set(sys.modules)\nsite.addsitedir({site_dir!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + code], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def site_dir(tmp_path):
    startup.install_pth(str(tmp_path))
    return str(tmp_path)


def test_shipped_pth_is_the_hook_line():
    with open(PTH_FILE, encoding="utf-8") as fh:
        assert fh.read() == startup.PTH_LINE
    assert startup.PTH_LINE.startswith("import os; ") and startup.PTH_LINE.count("\n") == 1


def test_unset_imports_nothing(site_dir):
    out = _python("print(sorted(set(sys.modules) - before))", site_dir)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # not even importlib.util: the line is one environ lookup


def test_set_enables_a_program_that_never_imports_sanitizer(site_dir):
    code = ("assert 'torch' not in sys.modules and 'sanitizer' not in sys.modules\n"
            "import torch\n"
            "s = sys.modules.get('sanitizer')\n"
            "print(s is not None and s.enabled(), 'sanitizer.adapters' in sys.modules, 'numba' in sys.modules)\n")
    out = _python(code, site_dir, {"OWNERSHIP_SANITIZE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


def test_set_without_torch_costs_only_the_finder(site_dir):
    out = _python("import json\nprint('torch' in sys.modules, 'sanitizer' in sys.modules)", site_dir,
                  {"OWNERSHIP_SANITIZE": "1"})
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_zero_sets_nothing_and_a_bad_value_says_so_once(site_dir):
    out = _python("import torch\nprint('sanitizer' in sys.modules)", site_dir, {"OWNERSHIP_SANITIZE": "0"})
    assert out.stdout.split() == ["False"] and out.stderr == ""
    out = _python(f"site.addsitedir({site_dir!r})  # processed twice, as a venv's lib64 link does\nprint('ran')",
                  site_dir, {"OWNERSHIP_SANITIZE": "maybe"})
    assert "ran" in out.stdout
    assert out.stderr.count("OWNERSHIP_SANITIZE='maybe' is not understood") == 1


def test_a_loader_package_import_activates_before_the_loader_runs(site_dir):
    """safetensors imported first: the adapters' finder must still see that very import."""
    code = ("import safetensors\n"
            "import sanitizer.adapters as a\n"
            "print(sys.modules['sanitizer'].enabled(), 'safetensors' in a.patched())\n")
    out = _python(code, site_dir, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "safetensors_ring=4096"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


def test_loader_packages_cover_the_adapters_targets():
    from sanitizer.adapters import TARGETS

    assert {name.split(".")[0] for name in TARGETS} <= startup.LOADER_PACKAGES


def test_wheel_and_editable_wheel_put_the_pth_at_the_top(tmp_path):
    """setup.py's build steps: `pip install .` and `pip install -e .` both install the hook."""
    code = (
        "import os, shutil, sys, tempfile\n"
        "src = tempfile.mkdtemp(dir=sys.argv[1])\n"
        "for name in ('pyproject.toml', 'setup.py', 'README.md', 'ownership_sanitizer.pth'):\n"
        "    shutil.copy(os.path.join(sys.argv[2], name), src)\n"
        "for pkg in ('sanitizer', 'cuda_hooks'):\n"
        "    shutil.copytree(os.path.join(sys.argv[2], pkg), os.path.join(src, pkg),\n"
        "                    ignore=shutil.ignore_patterns('__pycache__'))\n"
        "os.chdir(src)\n"
        "from setuptools import build_meta as b\n"
        "print('BUILT', getattr(b, sys.argv[3])(sys.argv[1]))\n"
    )
    built = []
    for hook in ("build_wheel", "build_editable"):  # one process each: setuptools keeps state per build
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path), ROOT, hook], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        built.append(next(line for line in out.stdout.splitlines() if line.startswith("BUILT ")).split()[1])
    wheel, editable = built
    for name in (wheel, editable):
        with zipfile.ZipFile(tmp_path / name) as zf:
            names = zf.namelist()
            assert startup.PTH_NAME in names, names
            assert zf.read(startup.PTH_NAME).decode() == startup.PTH_LINE
    with zipfile.ZipFile(tmp_path / wheel) as zf:
        assert "sanitizer/reporting/report_schema.json" in zf.namelist()
        assert "sanitizer/adapters/__init__.py" in zf.namelist()
        entry_points = next(n for n in zf.namelist() if n.endswith("entry_points.txt"))
        text = zf.read(entry_points).decode()
    assert "ownsan = sanitizer.tools.cli:main" in text and "ownership_sanitizer = sanitizer.tools.pytest_plugin" in text
