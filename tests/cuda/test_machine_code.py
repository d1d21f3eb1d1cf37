"""The serial CPU hash stored as machine code (cuda_hooks.machine_code): the same hash as numba's kernels,
loaded without numba, and never run when the stored file is not what was stored."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from cuda_hooks import bridge, cpu, hashdef, machine_code
from tests.conftest import run_python


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty cache directory of our own (machine_code reads NUMBA_CACHE_DIR at each call)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def stored_dir(tmp_path_factory):
    """A cache directory where the code was stored once for this module's tests."""
    where = tmp_path_factory.mktemp("machine_code")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NUMBA_CACHE_DIR", str(where))
        written = machine_code.store()
    assert written is not None and written.exists()
    return where


@pytest.fixture()
def stored(stored_dir, monkeypatch):
    """The stored code, loaded from its file."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(stored_dir))
    code = machine_code.load()
    assert code is not None
    return code


def _aligned(data: bytes) -> np.ndarray:
    buf = np.zeros(len(data) + 8, dtype=np.uint8)  # (numpy's allocations are 16-byte aligned)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf[: len(data)]


def test_stored_code_gives_numba_kernels_hash_at_every_length(stored) -> None:
    rng = np.random.default_rng(7)
    for n in [*range(0, 70), 127, 128, 129, 1023, 1024, 1025, 4096 + 3, 65536 + 5, (1 << 20) + 7]:
        buf = _aligned(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        assert stored.hash_at(buf.ctypes.data, n) == cpu.hash_bytes(buf), n
    for n, want in hashdef.GOLDEN.items():
        buf = _aligned(hashdef.golden_input(n))
        assert stored.hash_at(buf.ctypes.data, n) == want, n


def test_stored_code_sees_a_single_flipped_bit(stored) -> None:
    buf = _aligned(bytes(range(256)) * 64)
    h = stored.hash_at(buf.ctypes.data, buf.size)
    for pos in (0, 7, 8, 4095, buf.size - 1):
        buf[pos] ^= 0x10
        assert stored.hash_at(buf.ctypes.data, buf.size) != h, pos
        buf[pos] ^= 0x10
    assert stored.hash_at(buf.ctypes.data, buf.size) == h


def _entry(cache) -> tuple:
    files = list((cache / "machine_code").glob("cpu_hash-*.json"))
    assert len(files) == 1
    return files[0], json.loads(files[0].read_text())


def test_a_damaged_file_is_never_run_and_numba_replaces_it(cache, monkeypatch) -> None:
    assert machine_code.load() is None  # nothing stored yet
    machine_code.store()
    path, entry = _entry(cache)
    obj = bytearray.fromhex(entry["object"])
    obj[len(obj) // 2] ^= 0xFF  # one byte of the code: run, it could do anything
    path.write_text(json.dumps({**entry, "object": obj.hex()}))
    engines = []
    real_engine = machine_code._engine
    monkeypatch.setattr(machine_code, "_engine", lambda *a: engines.append(a) or real_engine(*a))
    assert machine_code.load() is None
    assert engines == []  # refused by its SHA-256 before any of it was loaded, let alone run
    assert machine_code.store() == path  # numba's warm-up writes a good one again
    assert machine_code.load() is not None


@pytest.mark.parametrize("damage", ["not json", "{}", "format", "symbol", "truncated"])
def test_a_file_that_is_not_ours_means_numba_runs(cache, damage) -> None:
    machine_code.store()
    path, entry = _entry(cache)
    if damage in ("not json", "{}"):
        path.write_text(damage)
    elif damage == "format":
        path.write_text(json.dumps({**entry, "format": 99}))
    elif damage == "symbol":
        path.write_text(json.dumps({**entry, "symbol": "no_such_function"}))
    else:
        path.write_text(path.read_text()[:-1000])
    assert machine_code.load() is None


def test_the_key_follows_the_cpu_numba_compiles_for(cache, monkeypatch) -> None:
    here = machine_code.path()
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert machine_code.path() != here  # code built for another CPU is another file
    assert machine_code.path().parent == here.parent == cache / "machine_code"


def test_the_bridge_hashes_unaligned_bytes_with_the_stored_code_and_refuses_through_numba(stored, monkeypatch) -> None:
    """Bytes at any offset hash through the stored code (a blind user's bf16 tensors after a float32 scalar
    started numba, 0.35 s); a non-byte array goes to numba's kernels, which refuse it by name."""
    calls = []
    monkeypatch.setattr(bridge, "_stored", [stored])
    real = cpu.hash_bytes
    monkeypatch.setattr(cpu, "hash_bytes", lambda buf: calls.append(buf.size) or real(buf))
    data = np.arange(4096, dtype=np.uint8)
    for lo, hi in ((0, 1000), (1, 1001), (2, 9), (4, 4095), (7, 7)):
        assert bridge.checksum_host(data[lo:hi]) == real(data[lo:hi]), (lo, hi)
    assert calls == []  # (the reference hashes above call numba's kernel directly, not through the patch)
    with pytest.raises(ValueError, match="contiguous 1-D uint8 array, got uint16"):
        bridge.checksum_host(np.zeros(4, dtype=np.uint16))
    assert calls == [4]
    t = torch.arange(100, dtype=torch.float32)
    assert bridge.checksum(t) == real(t.numpy().view(np.uint8))


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_hashes_with_the_parents_loaded_code(stored_dir) -> None:
    code = (
        "import os, numpy as np, sys, cuda_hooks\n"
        "assert cuda_hooks.warm_host()\n"
        "buf = np.arange(1 << 16, dtype=np.uint64).view(np.uint8)\n"
        "h = cuda_hooks.checksum_host(buf)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if cuda_hooks.checksum_host(buf) == h and 'numba' not in sys.modules else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status), 'numba' in sys.modules)\n"
    )
    proc = run_python(code, {"NUMBA_CACHE_DIR": str(stored_dir)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "False"], proc.stdout + proc.stderr


def test_a_tensors_bytes_hash_the_same_at_its_address_as_through_numba(stored, monkeypatch) -> None:
    monkeypatch.setattr(bridge, "_stored", [stored])
    t = torch.arange(4000, dtype=torch.int64).view(torch.uint8)
    for raw in (t, t[8:], t[1:], t[3:7001], t[:0]):  # aligned, aligned, unaligned, odd length, empty
        assert bridge.checksum_host_tensor(raw) == cpu.hash_bytes(raw.numpy())
