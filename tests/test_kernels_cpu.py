"""CPU hash kernel tested directly: spec conformance, determinism, corruption detection."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _support import ref_hash, ref_hash_np, run_python
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_hooks import cpu, hashdef


def _buf(n: int, seed: int = 0, offset: int = 0) -> np.ndarray:
    """Random n-byte uint8 array starting ``offset`` bytes past an aligned base."""
    base = np.random.default_rng(seed).integers(0, 256, n + offset, dtype=np.uint8)
    return base[offset:]


def _kernels(buf: np.ndarray) -> tuple[int, int]:
    """(serial, parallel) kernel results, bypassing hash_bytes' size dispatch."""
    cpu.hash_bytes(buf)  # warm-up + known-answer check
    words, tail = cpu._split(buf)
    par = int(cpu._hash_parallel(words, tail, buf.size, cpu._chunk_words(words.size)))
    tiny_chunks = int(cpu._hash_parallel(words, tail, buf.size, 3))  # many chunks, uneven last one
    assert par == tiny_chunks
    return int(cpu._hash_serial(words, tail, buf.size)), par


def test_golden_values_match_the_oracle_and_the_kernel() -> None:
    for n, want in hashdef.GOLDEN.items():
        data = hashdef.golden_input(n)
        assert ref_hash(data) == want, n
        assert cpu.hash_bytes(np.frombuffer(data, dtype=np.uint8).copy()) == want, n


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_every_length_0_to_70_matches_the_oracle(offset: int) -> None:
    for n in range(71):
        buf = _buf(n, seed=n, offset=offset)
        want = ref_hash(buf.tobytes())
        assert _kernels(buf) == (want, want), (n, offset)


@pytest.mark.parametrize("n", [4096, 65_537, (1 << 20) + 3, 9 * (1 << 20) + 5])
def test_large_lengths_match_the_oracle(n: int) -> None:
    buf = _buf(n, seed=n)
    want = ref_hash_np(buf)
    assert _kernels(buf) == (want, want)
    assert cpu.hash_bytes(buf) == want


def test_several_parallel_chunks_with_unaligned_start() -> None:
    n = 5 * cpu.MIN_CHUNK_WORDS * 8 + 11
    buf = _buf(n, seed=5, offset=5)
    assert not buf.flags.aligned or buf.ctypes.data % 8
    assert cpu.hash_bytes(buf) == ref_hash_np(buf)


def test_deterministic_and_independent_of_address() -> None:
    buf = _buf(100_003, seed=1)
    h = cpu.hash_bytes(buf)
    assert cpu.hash_bytes(buf) == h
    assert cpu.hash_bytes(buf.copy()) == h
    moved = np.zeros(buf.size + 3, dtype=np.uint8)[3:]
    moved[:] = buf
    assert cpu.hash_bytes(moved) == h
    assert 0 <= h < 1 << 64


def test_rejects_non_uint8_or_strided_arrays() -> None:
    with pytest.raises(ValueError, match="uint8"):
        cpu.hash_bytes(np.zeros(4, dtype=np.uint16))
    with pytest.raises(ValueError, match="contiguous"):
        cpu.hash_bytes(np.zeros(8, dtype=np.uint8)[::2])


def test_trailing_zero_bytes_change_the_hash() -> None:
    data = b"abc"
    hashes = {cpu.hash_bytes(np.frombuffer(data + b"\0" * k, dtype=np.uint8).copy()) for k in range(17)}
    assert len(hashes) == 17


def test_single_bit_flips_are_always_detected() -> None:
    rng = np.random.default_rng(7)
    buf = _buf(64 * 1024 + 5, seed=7)
    h = cpu.hash_bytes(buf)
    for _ in range(300):
        pos, bit = int(rng.integers(buf.size)), int(rng.integers(8))
        buf[pos] ^= np.uint8(1 << bit)
        assert cpu.hash_bytes(buf) != h, (pos, bit)
        buf[pos] ^= np.uint8(1 << bit)
    assert cpu.hash_bytes(buf) == h


def test_swapping_two_different_words_is_detected() -> None:
    rng = np.random.default_rng(8)
    buf = _buf(64 * 1024, seed=8)
    words = buf.view(np.uint64)
    h = cpu.hash_bytes(buf)
    for _ in range(300):
        i, j = (int(v) for v in rng.choice(words.size, 2, replace=False))
        if words[i] == words[j]:
            continue
        words[[i, j]] = words[[j, i]]
        assert cpu.hash_bytes(buf) != h, (i, j)
        words[[i, j]] = words[[j, i]]
    # adjacent swap and the swap of a word with zero, the weakest cases for a sum
    words[0], words[1] = np.uint64(0), np.uint64(1)
    h0 = cpu.hash_bytes(buf)
    words[0], words[1] = np.uint64(1), np.uint64(0)
    assert cpu.hash_bytes(buf) != h0


@pytest.mark.parametrize("diff", [1 << 63, (1 << 63) | (1 << 31), 1])
def test_swapping_words_that_differ_in_one_or_two_bits_is_detected(diff: int) -> None:
    """The weakest swaps for a sum of multiplies (the top bit cannot carry)."""
    rng = np.random.default_rng(diff % 1000)
    buf = _buf(64 * 1024, seed=10)
    words = buf.view(np.uint64)
    for _ in range(200):
        i, j = (int(v) for v in rng.choice(words.size, 2, replace=False))
        words[j] = words[i] ^ np.uint64(diff)
        h = cpu.hash_bytes(buf)
        words[[i, j]] = words[[j, i]]
        assert cpu.hash_bytes(buf) != h, (i, j)


def test_zeroing_a_4k_page_is_detected() -> None:
    buf = _buf(1 << 20, seed=9)
    h = cpu.hash_bytes(buf)
    for page in range(0, buf.size, 64 * 4096):
        saved = buf[page : page + 4096].copy()
        buf[page : page + 4096] = 0
        assert cpu.hash_bytes(buf) != h, page
        buf[page : page + 4096] = saved
    assert cpu.hash_bytes(buf) == h


def test_cache_key_tracks_the_hash_definition() -> None:
    """numba keys its disk cache on a kernel's closure, which holds hashdef's digest."""
    for kernel in (cpu._hash_serial, cpu._hash_parallel):
        cells = [c.cell_contents for c in kernel.py_func.__closure__ or ()]
        assert hashdef.definition_digest() in cells


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_hashes_after_the_parent_used_the_parallel_kernel() -> None:
    """numba's OpenMP pool aborts a forked child that uses it; the child must fall back."""
    code = (
        "import os, warnings, numpy as np\n"
        "warnings.filterwarnings('ignore', '.*multi-threaded.*fork', DeprecationWarning)  # 3.12+\n"
        "from cuda_hooks import cpu\n"
        "buf = np.arange(8 << 20, dtype=np.uint64).view(np.uint8)\n"
        "h = cpu.hash_bytes(buf)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if cpu.hash_bytes(buf) == h else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0", proc.stdout + proc.stderr


def test_compile_seconds_reports_both_kernels() -> None:
    cpu.hash_bytes(np.zeros(1, dtype=np.uint8))
    times = cpu.compile_seconds()
    assert set(times) == {"cpu_hash_serial", "cpu_hash_parallel"}
    assert all(v >= 0 for v in times.values())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_property_matches_the_oracle(data: bytes) -> None:
    assert cpu.hash_bytes(np.frombuffer(data, dtype=np.uint8).copy()) == ref_hash(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300), st.data())
def test_property_any_single_byte_change_is_detected(data: bytes, draw: st.DataObject) -> None:
    pos = draw.draw(st.integers(0, len(data) - 1))
    delta = draw.draw(st.integers(1, 255))
    buf = np.frombuffer(data, dtype=np.uint8).copy()
    h = cpu.hash_bytes(buf)
    buf[pos] ^= np.uint8(delta)
    assert cpu.hash_bytes(buf) != h
