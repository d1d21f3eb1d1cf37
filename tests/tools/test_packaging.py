"""The package as it is built and installed: a complete sdist, a wheel rebuilt from it, true metadata,
one version, and numba's kernel cache kept out of site-packages.

``.ci/package_check.sh`` (run by ``.ci/run``) goes further: it installs the wheel built from the sdist
into a fresh venv and checks the zero-code hook there.
"""
from __future__ import annotations

import ast
import email
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from conftest import ROOT

try:
    import tomllib
except ImportError:  # pragma: no cover  (Python 3.10)
    tomllib = None

# What a source tree of the package holds (as `git ls-files` would list it; nothing built or cached).
_TREE = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "MANIFEST.in", "ownership_sanitizer.pth")
_DIRS = ("sanitizer", "cuda_hooks", "tests", "examples", "bench")
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.nbi", "*.nbc", ".hypothesis", ".pytest_cache")


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def _new_enough_setuptools() -> None:
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates 77 (license-files); the test extra installs it")


def _backend(hook: str, source: str, out: str) -> str:
    """Run one setuptools build hook in ``source`` (its own process: setuptools keeps state per build)."""
    code = ("import sys\nfrom setuptools import build_meta as b\n"
            f"print('BUILT', getattr(b, {hook!r})(sys.argv[1]))\n")
    proc = subprocess.run([sys.executable, "-c", code, out], cwd=source, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("BUILT ")).split(" ", 1)[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The sdist of a clean copy of the tree, and the wheel built from the unpacked sdist alone."""
    _new_enough_setuptools()
    tmp = tmp_path_factory.mktemp("packaging")
    tree = tmp / "tree"
    tree.mkdir()
    for name in _TREE:
        shutil.copy(os.path.join(ROOT, name), tree)
    for name in _DIRS:
        shutil.copytree(os.path.join(ROOT, name), tree / name, ignore=_JUNK)
    dist = tmp / "dist"
    dist.mkdir()
    sdist = dist / _backend("build_sdist", str(tree), str(dist))
    with tarfile.open(sdist) as tf:
        members = tf.getnames()
        tf.extractall(tmp / "unpacked")
    (unpacked,) = (tmp / "unpacked").iterdir()
    wheel = dist / _backend("build_wheel", str(unpacked), str(dist))
    return sdist, members, wheel


@pytest.mark.slow
def test_the_sdist_holds_what_the_wheel_build_needs(built):
    sdist, members, _ = built
    top = members[0].split("/")[0]
    names = {m[len(top) + 1:] for m in members}
    for needed in ("ownership_sanitizer.pth", "LICENSE", "README.md", "setup.py", "pyproject.toml", "MANIFEST.in",
                   "sanitizer/reporting/report_schema.json", "sanitizer/core/version.py", "cuda_hooks/cachedir.py",
                   "examples/quickstart.py", "tests/conftest.py", "bench/device_check.sh"):
        assert needed in names, needed
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".nbi", ".nbc"))]


def test_the_wheel_built_from_the_sdist_installs_the_hook_and_true_metadata(built):
    from sanitizer.core.version import __version__
    from sanitizer.tools import startup

    _, _, wheel = built
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        assert zf.read(startup.PTH_NAME).decode() == startup.PTH_LINE  # at the top of site-packages
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(info))
        license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert zf.read(license_file) == open(os.path.join(ROOT, "LICENSE"), "rb").read()
        entry_points = zf.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert meta["Name"] == "ownership-sanitizer" and meta["Version"] == __version__
    assert meta["License-Expression"] == "Apache-2.0" and meta["License"] is None  # SPDX, not the old table
    assert meta["Requires-Python"] == ">=3.10"
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3.10" in classifiers and "Framework :: Pytest" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the expression says it (PEP 639)
    assert {"test", "demo", "fuzz", "fastsafetensors", "runai", "instanttensor"} <= set(meta.get_all("Provides-Extra"))
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("jsonschema") and 'extra == "test"' in r for r in requires)
    assert any(r.startswith("safetensors") and 'extra == "fuzz"' in r for r in requires)
    assert "ownsan = sanitizer.tools.cli:main" in entry_points
    assert "ownership_sanitizer = sanitizer.tools.pytest_plugin" in entry_points


def test_requires_python_is_what_the_code_needs():
    """dataclass(slots=True) and code.co_lines() are Python 3.10: the floor must say so, and no lower."""
    project = _pyproject()["project"]
    floor = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    uses_310 = []
    for base in ("sanitizer", "cuda_hooks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for name in files:
                if name.endswith(".py"):
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                    if re.search(r"slots\s*=\s*True|\.co_lines\(", text):
                        uses_310.append(name)
    assert uses_310 and floor == (3, 10), (floor, uses_310)
    assert sys.version_info >= floor


def test_license_and_version_are_declared_once():
    data = _pyproject()
    project = data["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = open(os.path.join(ROOT, "LICENSE"), encoding="utf-8").read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert "version" not in project and "version" in project["dynamic"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sanitizer.core.version.__version__"}
    assert data["build-system"]["requires"] == ["setuptools>=77"]  # SPDX license strings and license-files
    assert "setuptools>=77" in project["optional-dependencies"]["test"]  # the tests build without isolation
    # The version module is a literal that setuptools reads without importing anything.
    tree = ast.parse(open(os.path.join(ROOT, "sanitizer", "core", "version.py"), encoding="utf-8").read())
    assert [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))] == []
    import sanitizer
    from sanitizer.core import version

    assert sanitizer.__version__ is version.__version__ and re.fullmatch(r"\d+\.\d+\.\d+\S*", version.__version__)


def test_the_ci_scripts_parse():
    for script in (".ci/run", ".ci/package_check.sh", "bench/device_check.sh"):
        proc = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "device_check.sh"), "--bogus"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr


# -- numba's cache ---------------------------------------------------------------------------------
def test_cache_dir_follows_numba_cache_dir_then_xdg_then_home():
    from cuda_hooks.cachedir import cache_dir

    assert cache_dir({"NUMBA_CACHE_DIR": "/n", "XDG_CACHE_HOME": "/x"}) == "/n"
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "ownership-sanitizer", "numba")
    assert cache_dir({}) == os.path.join(os.path.expanduser("~"), ".cache", "ownership-sanitizer", "numba")


_PROBE = """
import json, os, sys
import numpy as np
import cuda_hooks
from cuda_hooks import cpu
from numba.core import config
cuda_hooks.checksum(__import__("torch").arange(64, dtype=__import__("torch").uint8))
print(json.dumps({"cache": cpu._hash_serial._cache._cache_path, "config": config.CACHE_DIR}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("user_dir", [False, True])
def test_the_kernel_cache_goes_to_the_user_cache_dir_not_site_packages(tmp_path, user_dir):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=ROOT, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    if user_dir:
        env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    got = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = tmp_path / ("mine" if user_dir else os.path.join("xdg", "ownership-sanitizer", "numba"))
    assert got["cache"].startswith(str(expected)), got
    assert any(name.endswith(".nbi") for name in os.listdir(got["cache"]))  # the index was written there
    assert got["config"] == (str(tmp_path / "mine") if user_dir else "")  # numba's setting restored for others


def test_ci_runs_the_readme_test_command_verbatim_and_the_readme_says_how_to_get_the_cpu_build():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    # the first two commands: the demo and the quick tests; then the full suite, which CI runs
    assert blocks[:3] == ["./dev demo", "./dev test", "./dev test --full"]
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().rstrip("\n").splitlines()
    # CI runs the README's full test command, verbatim (its status kept while the second interpreter runs)
    assert any(line == blocks[2] or line.startswith(blocks[2] + " || ") for line in ci)
    assert "bash .ci/package_check.sh .venv/bin/python" in ci
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme and "torch==2.13.0" in readme
    dev = open(os.path.join(ROOT, "dev"), encoding="utf-8").read()
    assert "download.pytorch.org/whl/cpu" in dev and "torch==2.13.0" in dev  # ./dev takes the CPU build itself
    assert "examples/quickstart.py" in readme and "## Limitations" in readme
    for page in re.findall(r"\(docs/([a-z_]+\.md)\)", readme):  # every page the README links exists
        assert os.path.exists(os.path.join(ROOT, "docs", page)), page