"""Every CUDA kernel compiles to PTX for sm_80 and sm_90 with the local toolkit.

No GPU is needed: ``numba.cuda.compile_ptx`` only needs libNVVM and libdevice.
numba finds libNVVM under ``$CUDA_HOME/nvvm/lib64`` or via the system loader;
toolkits laid out otherwise (e.g. pip-style ``<root>/lib/libnvvm.so``) are
found here by probing the usual roots, then passed to the child as
``CUDA_HOME`` (for libdevice) plus ``LD_LIBRARY_PATH`` (for libNVVM).  The
test is skipped, saying why, when no libNVVM exists on the machine.

numba's built-in CUDA target compiles the device functions a kernel calls
for the *current device's* compute capability, even inside ``compile_ptx``,
which needs a driver and a GPU; the child therefore swaps in a stub device
reporting the cc being compiled for, one child per cc since compiled device
functions are memoised (a test-only shim: with a real GPU the dispatcher's
own lookup is right).
"""

from __future__ import annotations

import ctypes.util
import glob
import json
import os
import shutil
from pathlib import Path

import pytest
from _support import run_python

CCS = [(8, 0), (9, 0)]


def _toolkit_roots() -> list[Path]:
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    roots += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True), "/opt/cuda", "/usr"]
    return [Path(r) for r in dict.fromkeys(filter(None, roots))]


def find_toolkit() -> tuple[dict[str, str], str] | None:
    """(extra child env, description) for a toolkit with libNVVM and libdevice, or None."""
    for root in _toolkit_roots():
        libdevice = root / "nvvm" / "libdevice" / "libdevice.10.bc"
        if not libdevice.is_file():
            continue
        for libdir in (root / "nvvm" / "lib64", root / "nvvm" / "lib", root / "lib64", root / "lib"):
            if any(libdir.glob("libnvvm.so*")):
                env = {"CUDA_HOME": str(root)}
                if libdir != root / "nvvm" / "lib64":
                    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libdir), os.environ.get("LD_LIBRARY_PATH")]))
                return env, f"libnvvm in {libdir}, libdevice in {libdevice.parent}"
    if ctypes.util.find_library("nvvm"):  # on the loader path but no toolkit root found: let numba search
        return {}, f"libnvvm via the system loader ({ctypes.util.find_library('nvvm')})"
    return None


TOOLKIT = find_toolkit()

CHILD = r"""
import json, sys, types
from numba import cuda
import numba.cuda.dispatcher as dispatcher
from numba.cuda.cudadrv import nvvm
try:
    version = nvvm.NVVM().get_version()
except Exception as exc:
    print(json.dumps({"unavailable": f"{type(exc).__name__}: {exc}"}))
    sys.exit(0)
from cuda_hooks import gpu
result = {"nvvm": list(version), "ptx": {}}
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=CC)
for name, (pyfunc, sig) in gpu.KERNEL_SIGNATURES.items():
    ptx, _ = cuda.compile_ptx(pyfunc, sig, cc=CC)
    result["ptx"][f"{name}:sm_{CC[0]}{CC[1]}"] = ptx
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    if TOOLKIT is None:
        pytest.skip("no libNVVM found (CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda*, loader path)")
    extra_env, where = TOOLKIT
    env = dict(os.environ, **extra_env)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    ptx: dict[str, str] = {}
    for cc in CCS:
        proc = run_python(f"CC = {cc!r}\n" + CHILD, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if "unavailable" in result:
            pytest.skip(f"libNVVM found ({where}) but unusable: {result['unavailable']}")
        ptx.update(result["ptx"])
    return ptx


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name", ["checksum", "verify", "poison"])
def test_kernel_compiles_to_ptx(ptx: dict[str, str], name: str, cc: tuple[int, int]) -> None:
    code = ptx[f"{name}:sm_{cc[0]}{cc[1]}"]
    assert f".target sm_{cc[0]}{cc[1]}" in code
    assert ".visible .entry" in code


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"sm_{cc[0]}{cc[1]}")
@pytest.mark.parametrize("name", ["checksum", "verify"])
def test_hash_kernels_stay_in_uint64_integer_arithmetic(ptx: dict[str, str], name: str, cc: tuple[int, int]) -> None:
    code = ptx[f"{name}:sm_{cc[0]}{cc[1]}"]
    assert "atom.global.add.u64" in code, "block partials must be added atomically as uint64"
    assert ".f64" not in code and ".f32" not in code, "a signed/unsigned mix promoted to float"
    assert "mul.lo.s64" in code or "mul.lo.u64" in code
