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


@pytest.mark.slow
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


@pytest.mark.slow
def test_zero_sets_nothing(site_dir):
    out = _python("import torch\nprint('sanitizer' in sys.modules)", site_dir, {"OWNERSHIP_SANITIZE": "0"})
    assert out.stdout.split() == ["False"] and out.stderr == ""


@pytest.mark.slow
def test_a_bad_switch_value_stops_a_torch_program_once_and_leaves_others_alone(site_dir):
    out = _python(f"site.addsitedir({site_dir!r})  # processed twice, as a venv's lib64 link does\nprint('ran')",
                  site_dir, {"OWNERSHIP_SANITIZE": "maybe"})
    assert out.returncode == 0 and "ran" in out.stdout and out.stderr == ""  # pip, build scripts: untouched
    out = _python(f"site.addsitedir({site_dir!r})\nimport torch\nprint('ran unsanitized')", site_dir,
                  {"OWNERSHIP_SANITIZE": "maybe"})
    assert out.returncode == 2 and "ran unsanitized" not in out.stdout
    assert out.stderr.count("OWNERSHIP_SANITIZE='maybe' is not understood") == 1, out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("options,named", [
    ("stack_dept=4", "unknown option 'stack_dept' (did you mean 'stack_depth'?)"),
    ("halt_on_eror=0:checksum=1", "unknown option 'halt_on_eror' (did you mean 'halt_on_error'?)"),
    ("stack_depth=deep", "option 'stack_depth': bad value 'deep'"),
])
def test_a_bad_option_stops_the_program_naming_it(site_dir, options, named):
    """As `import sanitizer` raises: a typo never runs the program unsanitized with exit status 0."""
    out = _python("import torch\nprint('ran unsanitized')", site_dir,
                  {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": options})
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert "ran unsanitized" not in out.stdout
    assert named in out.stderr and "stopping rather than running the program unsanitized" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_bad_option_stops_the_program_from_a_thread_too(site_dir):
    code = ("import threading\n"
            "t = threading.Thread(target=lambda: __import__('torch'))\n"
            "t.start(); t.join()\n"
            "print('ran unsanitized')\n")
    out = _python(code, site_dir, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "stack_dept=4"})
    assert out.returncode == 2 and "ran unsanitized" not in out.stdout
    assert "did you mean 'stack_depth'?" in out.stderr


@pytest.mark.slow
def test_a_loader_package_import_with_a_bad_option_stops_too(site_dir):
    out = _python("import safetensors\nprint('ran unsanitized')", site_dir,
                  {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "rescue=perhaps"})
    assert out.returncode == 2 and "ran unsanitized" not in out.stdout
    assert "option 'rescue': bad value 'perhaps'" in out.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_wheel_and_editable_wheel_put_the_pth_at_the_top(tmp_path):
    """setup.py's build steps: `pip install .` and `pip install -e .` both install the hook."""
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates 77 (license-files); the test extra installs it")
    code = (
        "import os, shutil, sys, tempfile\n"
        "src = tempfile.mkdtemp(dir=sys.argv[1])\n"
        "for name in ('pyproject.toml', 'setup.py', 'README.md', 'LICENSE', 'MANIFEST.in', 'ownership_sanitizer.pth'):\n"
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


@pytest.mark.slow
def test_a_bad_option_when_torch_is_imported_during_start_up_exits_cleanly(tmp_path):
    """Another .pth imported torch before ours ran: the refusal happens inside site, and must still be a plain
    exit status 2 with our message, not a 'Fatal Python error' from the interpreter's start-up."""
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    python = str(tmp_path / "venv" / "bin" / "python")
    site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site_dir, "0_borrow.pth"), "w") as fh:  # torch, and this checkout's sanitizer
        fh.write(sysconfig.get_paths()["purelib"] + "\n" + ROOT + "\n")
    with open(os.path.join(site_dir, "a_imports_torch.pth"), "w") as fh:
        fh.write("import torch\n")
    startup.install_pth(site_dir)  # sorts after both
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE") and k != "PYTHONPATH"}
    env.update(OWNERSHIP_SANITIZE="1", OWNERSHIP_SANITIZE_OPTIONS="stack_dept=4")
    out = subprocess.run([python, "-c", "print('ran unsanitized')"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(tmp_path))
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "did you mean 'stack_depth'?" in out.stderr and "Fatal Python error" not in out.stderr
    assert "ran unsanitized" not in out.stdout
    env["OWNERSHIP_SANITIZE_OPTIONS"] = "stack_depth=4"  # and a good setting enables it there and then
    out = subprocess.run([python, "-c", "import sys; print(sys.modules['sanitizer'].enabled())"], env=env,
                         capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-2000:]


def test_a_hook_left_behind_by_a_moved_install_says_the_program_runs_unsanitized(tmp_path):
    """The hook runs, the package is gone (an editable install whose checkout moved: a blind user found CI's
    3.12 venv so): OWNERSHIP_SANITIZE=1 ran the program unsanitized without a word. Now one line says so; with
    the switch off nothing is printed."""
    startup.install_pth(str(tmp_path))
    prelude = f"import site\nsite.addsitedir({str(tmp_path)!r})\nprint('ran')\n"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OWNERSHIP_SANITIZE", "OWNSAN_"))}
    env["PYTHONPATH"] = ""
    outside = str(tmp_path / "elsewhere")
    os.makedirs(outside)
    for value, said in (("1", True), ("0", False)):
        proc = subprocess.run([sys.executable, "-S", "-c", prelude], env={**env, "OWNERSHIP_SANITIZE": value},
                              capture_output=True, text=True, timeout=60, cwd=outside)
        assert proc.returncode == 0 and proc.stdout.strip() == "ran", proc.stderr
        assert ("cannot import the package" in proc.stderr) is said, proc.stderr
        assert proc.stderr.count("\n") == (1 if said else 0), proc.stderr
