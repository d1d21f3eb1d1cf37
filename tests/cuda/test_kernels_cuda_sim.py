"""CUDA kernels under numba's simulator, checked bit for bit against the CPU kernel.

``NUMBA_ENABLE_CUDASIM=1`` must be set before numba is imported, so the
kernels run in a child interpreter that prints one JSON report; the tests
below read it.  The simulator runs every CUDA thread as a Python thread
(~1 MB/s), hence KB-size inputs and 64-thread blocks (``gpu.THREADS``), with
the grid size forced where needed to reach the multi-block and the
four-words-in-flight code paths, at every misalignment of the first byte.

The child runs with ``-W error`` except for numpy's "overflow encountered in
scalar ..." RuntimeWarning: the simulator evaluates the uint64 device code on
numpy scalars, which wrap correctly but warn; compiled code never does.
"""

from __future__ import annotations

import json
import os

import pytest
from _support import ref_hash, run_python

pytestmark = pytest.mark.slow  # the CUDA simulator runs each CUDA thread as a Python thread (a child of ~25 s): the full run's, not the quick one's (docs/ci.md)

CHILD = r"""
import json, warnings
warnings.filterwarnings("ignore", message="overflow encountered in scalar", category=RuntimeWarning)
import numpy as np
from numba import config, cuda
from cuda_hooks import cpu, gpu

assert config.ENABLE_CUDASIM and gpu.SIMULATED and gpu.THREADS == 64
report = {"hash": [], "verify": {}, "poison": {}}
rng = np.random.default_rng(0)

def hash_on_device(buf, offset, blocks=None, scratch=None):
    base = cuda.to_device(np.concatenate([np.zeros(offset, np.uint8), buf]))
    data = base[offset:]
    scratch = scratch if scratch is not None else cuda.to_device(np.zeros(2, np.uint64))
    out = cuda.to_device(np.zeros(3, np.uint64))
    gpu.checksum_async(data, scratch, out, 1, gpu.stream_for(0), blocks=blocks)
    o = out.copy_to_host()
    return int(o[1]), [int(o[0]), int(o[2])], scratch.copy_to_host().tolist()

cases = [(n, 0, None) for n in (0, 1, 7, 8, 9, 15, 16, 63, 100, 1021)]
cases += [(n, off, None) for n in (1, 5, 9, 15, 16, 17, 100, 1021) for off in range(1, 8)]  # misaligned heads
cases += [(1000, 0, 3), (4099, 0, 2), (4101, 0, 1), (4101, 2, 1), (4101, 5, 1), (4100, 7, 2)]  # 1 block: 4-word path
shared = cuda.to_device(np.zeros(2, np.uint64))
for n, off, blocks in cases:
    buf = rng.integers(0, 256, n, dtype=np.uint8)
    h, others, scratch = hash_on_device(buf, off, blocks, shared)
    report["hash"].append({"n": n, "offset": off, "blocks": blocks, "gpu": h,
                           "cpu": cpu.hash_bytes(buf), "bytes": buf.tobytes().hex() if n <= 100 else None,
                           "others": others, "scratch": scratch})

buf = rng.integers(0, 256, 3000, dtype=np.uint8)
data = cuda.to_device(buf)
scratch = cuda.to_device(np.zeros(2, np.uint64))
expected = cuda.to_device(np.array([0, cpu.hash_bytes(buf), 0], dtype=np.uint64))
flags = cuda.to_device(np.zeros(3, np.int32))
gpu.verify_async(data, scratch, expected, 1, flags, 0, blocks=2)
report["verify"]["match"] = flags.copy_to_host().tolist()
bad = buf.copy(); bad[1234] ^= 4
gpu.verify_async(cuda.to_device(bad), scratch, expected, 1, flags, 0, blocks=2)
report["verify"]["mismatch"] = flags.copy_to_host().tolist()
gpu.verify_async(data, scratch, expected, 1, flags, 0, blocks=2)
report["verify"]["sticky"] = flags.copy_to_host().tolist()
report["verify"]["scratch"] = scratch.copy_to_host().tolist()

orig = (np.arange(1500) % 251).astype(np.uint8)
base = cuda.to_device(orig)
gpu.poison_async(base[7:1207], 0xA5, 0)
host = base.copy_to_host()
report["poison"] = {"inside": sorted(set(host[7:1207].tolist())),
                    "outside_kept": bool((host[:7] == orig[:7]).all() and (host[1207:] == orig[1207:]).all())}
# a misaligned lease: how many words are assembled from single bytes (head and tail only, not every word)
import itertools
calls = itertools.count()
byte_word = gpu._tail_word
gpu._tail_word = lambda *a: (next(calls), byte_word(*a))[1]
buf = rng.integers(0, 256, 1021, dtype=np.uint8)
h, _, _ = hash_on_device(buf, 3, 2)
gpu._tail_word = byte_word
report["byte_words"] = {"count": next(calls), "exact": h == cpu.hash_bytes(buf)}

report["compile_seconds"] = gpu.compile_seconds()
from cuda_hooks import hashdef
report["digest_in_cache_key"] = all(
    hashdef.definition_digest() in [c.cell_contents for c in k.py_func.__closure__ or ()]
    for k in (gpu._checksum_kernel, gpu._verify_kernel))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = run_python(CHILD, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_simulated_hash_is_bit_identical_to_cpu(report: dict) -> None:
    assert len(report["hash"]) == 72
    for case in report["hash"]:
        assert case["gpu"] == case["cpu"], case
        if case["bytes"] is not None:
            assert case["gpu"] == ref_hash(bytes.fromhex(case["bytes"])), case


def test_a_misaligned_lease_assembles_only_its_head_and_tail_words_from_bytes(report: dict) -> None:
    assert report["byte_words"]["exact"] is True
    assert report["byte_words"]["count"] <= 3, report["byte_words"]  # 1021 bytes at offset 3: 128 words


def test_only_the_requested_slot_is_written_and_scratch_is_left_zero(report: dict) -> None:
    for case in report["hash"]:
        assert case["others"] == [0, 0], case
        assert case["scratch"] == [0, 0], case


def test_verify_flag_clear_on_match_set_on_mismatch_and_sticky(report: dict) -> None:
    v = report["verify"]
    assert v["match"] == [0, 0, 0]
    assert v["mismatch"] == [0, 1, 0]
    assert v["sticky"] == [0, 1, 0]
    assert v["scratch"] == [0, 0]


def test_poison_fills_exactly_the_view(report: dict) -> None:
    assert report["poison"]["inside"] == [0xA5]
    assert report["poison"]["outside_kept"] is True


def test_first_launch_times_are_reported(report: dict) -> None:
    assert set(report["compile_seconds"]) == {"cuda_checksum", "cuda_verify", "cuda_poison"}


def test_hash_kernels_cache_key_tracks_the_hash_definition(report: dict) -> None:
    assert report["digest_in_cache_key"] is True
