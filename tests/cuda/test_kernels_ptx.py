"""Every CUDA kernel compiles to PTX for sm_80 and sm_90 with the local toolkit.

No GPU is needed: ``numba.cuda.compile_ptx`` only needs libNVVM and libdevice.
numba finds libNVVM under ``$CUDA_HOME/nvvm/lib64`` or via the system loader;
``tests/cuda_toolkit.py`` finds toolkits laid out otherwise (the device check
uses it too) and the child gets ``CUDA_HOME`` plus ``LD_LIBRARY_PATH``.  The
test is skipped, saying why, when no libNVVM exists on the machine.  Where
``ptxas`` is on the PATH the PTX is assembled for sm_90 too and the register
count checked: it decides how many blocks fit on an SM.

numba's built-in CUDA target compiles the device functions a kernel calls
for the *current device's* compute capability, even inside ``compile_ptx``,
which needs a driver and a GPU; the child therefore swaps in a stub device
reporting the cc being compiled for, one child per cc since compiled device
functions are memoised (a test-only shim: with a real GPU the dispatcher's
own lookup is right).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import pytest
from _support import run_python
from cuda_toolkit import find_toolkit

pytestmark = pytest.mark.slow  # compiling the kernels to PTX with the toolkit (~5 s a target): the full run's

CCS = [(8, 0), (9, 0)]


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


@pytest.mark.slow
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


def _ptxas_registers(code: str, arch: str) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(code)
        proc = subprocess.run(["ptxas", f"-arch={arch}", "-v", path, "-o", os.devnull],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(l for l in proc.stderr.splitlines() if "registers" in l)
    return int(line.split("Used ")[1].split(" registers")[0])


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on the PATH")
@pytest.mark.parametrize("name", ["checksum", "verify"])
def test_hash_kernels_fit_at_least_half_an_sm_of_threads(ptx: dict[str, str], name: str) -> None:
    regs = _ptxas_registers(ptx[f"{name}:sm_90"], "sm_90")
    print(f"{name}: {regs} registers per thread on sm_90")
    # 65536 registers per SM: at <= 64 per thread, 4 blocks of 256 (half the SM's 2048 threads) fit;
    # the occupancy query in gpu.warm() sizes the grid from the real count (40 today: 6 blocks)
    assert regs <= 64, f"{name} uses {regs} registers per thread"
