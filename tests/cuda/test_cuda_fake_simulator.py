"""checksum=1 on a fake CUDA StagingBuffer with the real CUDA kernels, run by numba's simulator.

tests/cuda/test_cuda_fake.py checks the sanitizer's CUDA paths with a CPU twin of the
kernels; here the same harness hands the bytes to the real kernels of
``cuda_hooks.gpu`` (numba's simulator, ``NUMBA_ENABLE_CUDASIM=1``, in a child:
it must be set before numba is imported), so the bridge's launch path (numba
arrays over the memory, the per-stream scratch, the split into head, aligned
interior and tail) runs as on a GPU. The simulator is slow, so the tensors are
small; every lend and check is compared with the CPU hash of the same bytes.
"""
from __future__ import annotations

import json
import os

import pytest
from _support import run_python

pytestmark = pytest.mark.slow  # numba's CUDA simulator in a child (~6 s): the full run's, not the quick one's (docs/ci.md)

CHILD = r"""
import json, warnings
warnings.filterwarnings("ignore", message="overflow encountered in scalar", category=RuntimeWarning)
import torch
from _pytest.monkeypatch import MonkeyPatch
import cuda_hooks, sanitizer
from cuda_hooks import gpu
from sanitizer.features import checksums
from tests.fake_cuda import FakeCuda

assert gpu.SIMULATED
mp = MonkeyPatch()
fake = FakeCuda(2, kernels="simulator").install(mp)
report = {"lends": [], "errors": []}
buf = sanitizer.StagingBuffer(1 << 14, device="cuda", name="sim")
g = torch.Generator().manual_seed(0)
with sanitizer.sanitize(checksum=1, halt_on_error=0):
    views = []
    # odd lengths of 2-byte and 1-byte dtypes at every byte offset within a word
    for i, (offset, n, dtype) in enumerate([(0, 333, torch.bfloat16), (2, 77, torch.bfloat16),
                                            (1, 101, torch.uint8), (3, 259, torch.uint8),
                                            (5, 64, torch.uint8), (6, 7, torch.int16),
                                            (1024, 513, torch.float8_e4m3fn)]):
        src = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
        w = buf.write(offset + 2048 * i, src.view(dtype), name=f"t{i}")
        got = checksums.expected_hash(sanitizer.lease_of(w))  # read back from the device slot
        report["lends"].append({"name": f"t{i}", "gpu": got, "cpu": cuda_hooks.checksum(src)})
        views.append(w)
    sanitizer.synchronize()
    report["clean"] = [e["kind"] for e in sanitizer.errors()]
    buf.tensor.numpy()[2 + 2048 * 1 + 5] ^= 0x10  # t1 changes behind the API
    sanitizer.verify(*views)
    sanitizer.synchronize()
    report["errors"] = [e["lease"]["name"] for e in sanitizer.errors() if e["kind"] == "checksum_mismatch"]
fake.settle()
mp.undo()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = run_python(CHILD, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_device_hashes_of_cuda_leases_equal_the_cpu_hash_of_the_same_bytes(report: dict) -> None:
    assert len(report["lends"]) == 7
    for lend in report["lends"]:
        assert lend["gpu"] == lend["cpu"], lend


def test_a_correct_program_is_silent_and_a_changed_lease_is_named(report: dict) -> None:
    assert report["clean"] == []
    assert report["errors"] == ["t1"]
