"""The CUDA extras exist, the errors that recommend them name them right, and the device check scripts parse."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent.parent


def _extras() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_cuda_extras_pull_numba_cuda_with_the_nvvm_of_their_cuda_major():
    extras = _extras()
    for extra, cu in (("cuda12", "cu12"), ("cuda13", "cu13")):
        (req,) = extras[extra]
        assert req.startswith(f"numba-cuda[{cu}]"), req


def test_the_messages_recommending_an_extra_name_existing_ones():
    extras = set(_extras())
    for source in ("cuda_hooks/gpu.py", "cuda_hooks/bridge.py"):
        named = set(re.findall(r"ownership-sanitizer\[(\w+)\]", (ROOT / source).read_text()))
        named |= set(re.findall(r"or \[(cuda\d+)\]", (ROOT / source).read_text()))
        assert named and named <= extras, (source, named - extras)


@pytest.mark.slow
def test_the_device_check_scripts_parse_and_never_pass_without_a_gpu(tmp_path):
    import shutil
    import subprocess

    import torch

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    for script in ("bench/device_check.sh", "bench/device_prepare.sh"):
        proc = subprocess.run([bash, "-n", str(ROOT / script)], capture_output=True, text=True)
        assert proc.returncode == 0, (script, proc.stderr)
    if torch.cuda.is_available():
        return
    # the interpreter running this test (its torch), not the script's default (.venv/bin/python or python3,
    # which from a clone installed elsewhere may have no torch, and the script would fail for that reason)
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))  # (never the files of a check running this)
    proc = subprocess.run([bash, str(ROOT / "bench/device_check.sh")], capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 2 and "nothing can be checked on a GPU" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # a check that checked nothing writes no verdicts


def test_the_device_seam_is_torch_itself_outside_a_harness():
    """cuda_hooks.devices is where a harness stands in for CUDA; in production each call is the torch call
    it names (checked here on CPU tensors, where the answers are known)."""
    import torch

    from cuda_hooks import devices

    t = torch.arange(6, dtype=torch.float32).view(2, 3).t()
    assert not devices.is_cuda(t) and devices.device_of(t) == torch.device("cpu")
    assert devices.storage_device(t.untyped_storage()) == torch.device("cpu")
    e = devices.empty(10, torch.device("cpu"))
    assert e.dtype == torch.uint8 and e.shape == (10,)
    z = devices.zeros(3, torch.int64, torch.device("cpu"))
    assert z.tolist() == [0, 0, 0]
    like = devices.empty_like(t)
    assert like.shape == t.shape and like.is_contiguous() and not t.is_contiguous()


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
@pytest.mark.parametrize("env, named", [({"DEVICE_CHECK_BUDGET": "6min"}, "'6min'"),
                                        ({"OUT": "/proc/no-such-dir"}, "'/proc/no-such-dir'")])
def test_the_device_check_names_a_bad_budget_or_output_directory(env, named, tmp_path):
    import shutil
    import subprocess

    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    full = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), **env}
    proc = subprocess.run([bash, str(ROOT / "bench/device_check.sh"), "--cpu-ok"], capture_output=True, text=True,
                          timeout=120, env=full)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr
