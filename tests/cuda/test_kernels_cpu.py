"""CPU hash kernel tested directly: spec conformance, determinism, corruption detection.

The kernels sum blocks of ``cpu.BLOCK_WORDS`` words with a prefetch
``cpu.PREFETCH_WORDS`` ahead, split into parallel chunks; the property tests
draw sizes, ranges and offsets around those boundaries and compare every
split with a plain word-by-word reference.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _support import ref_hash, ref_hash_np, ref_mix, run_python
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_hooks import cpu, hashdef
from cuda_hooks.kernel_choice import KernelChoice


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_first_hash_keeps_the_programs_torch_thread_count() -> None:
    """Starting numba's OpenMP pool used to reset torch.set_num_threads(1) to numba's thread count."""
    code = (
        "import numpy as np, torch\n"
        "torch.set_num_threads(1)\n"
        "torch.zeros(1 << 20).sum()  # torch's OpenMP runtime has run work: then numba's start reached it\n"
        "from cuda_hooks import cpu\n"
        "cpu.hash_bytes(np.zeros(64, dtype=np.uint8))\n"
        "cpu.hash_bytes(np.zeros(cpu.PARALLEL_MIN_BYTES, dtype=np.uint8))\n"
        "print(torch.get_num_threads())\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "1", proc.stdout + proc.stderr


def test_compile_seconds_reports_both_kernels() -> None:
    cpu.hash_bytes(np.zeros(1, dtype=np.uint8))
    times = cpu.compile_seconds()
    # (and the one-time store of the serial hash as machine code, when this warm-up wrote it)
    assert {"cpu_hash_serial", "cpu_hash_parallel"} <= set(times) <= {"cpu_hash_serial", "cpu_hash_parallel",
                                                                    "cpu_hash_machine_code_store"}
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


# -- the blocked, prefetching kernel against a straightforward reference -----------------------


def _ref_partial(words: np.ndarray, lo: int, hi: int) -> int:
    """``sum(mix(words[i], i) for i in [lo, hi)) mod 2**64``, one word at a time with Python ints."""
    return sum(ref_mix(int(words[i]), i) for i in range(lo, hi)) % (1 << 64)


# word counts that cross the block, prefetch-distance and chunk boundaries (and stay small)
_SPAN = 3 * (cpu.PREFETCH_WORDS + cpu.BLOCK_WORDS) + 17


@settings(max_examples=150, deadline=None)
@given(st.integers(0, _SPAN), st.data())
def test_property_block_sum_of_any_range_matches_a_plain_loop(nwords: int, draw: st.DataObject) -> None:
    """``_sum_words`` over any ``[lo, hi)``: full blocks, prefetched or not, and the word-by-word rest."""
    words = np.random.default_rng(nwords).integers(0, 2**64, nwords, dtype=np.uint64)
    lo = draw.draw(st.integers(0, nwords))
    hi = draw.draw(st.integers(lo, nwords))
    got = int(cpu._sum_words(words, np.uint64(lo), np.uint64(hi)))
    assert got == _ref_partial(words, lo, hi), (nwords, lo, hi)


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 8 * _SPAN + 7), st.integers(0, 7), st.integers(1, 2 * _SPAN), st.integers(0, 2**32))
def test_property_both_kernels_match_the_oracle_at_any_size_offset_and_chunking(
    n: int, offset: int, chunk: int, seed: int
) -> None:
    """Serial, parallel (any chunk size: many uneven chunks or one) and the dispatcher agree with the spec,
    for a buffer starting ``offset`` bytes past an aligned address (unaligned word loads)."""
    buf = _buf(n, seed=seed, offset=offset)
    words, tail = cpu._split(buf)
    want = ref_hash_np(buf)
    assert int(cpu._hash_serial(words, tail, buf.size)) == want
    assert int(cpu._hash_parallel(words, tail, buf.size, chunk)) == want
    assert cpu.hash_bytes(buf) == want


# -- which kernel runs ---------------------------------------------------------------------------


class _Spy:
    """Records which kernel ``hash_bytes`` called, then runs it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        serial, parallel = cpu._hash_serial, cpu._hash_parallel
        cpu.hash_bytes(np.zeros(1, dtype=np.uint8))  # warm up with the real kernels first
        monkeypatch.setattr(cpu, "_hash_serial", lambda *a: (self.calls.append("serial"), serial(*a))[1])
        monkeypatch.setattr(cpu, "_hash_parallel", lambda *a: (self.calls.append("parallel"), parallel(*a))[1])
        monkeypatch.setattr(cpu, "_choice", KernelChoice())  # no timings from earlier tests


def test_serial_below_the_threshold_measured_choice_from_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below PARALLEL_MIN_BYTES always serial; from it each kernel is timed (which then runs: test_kernel_choice)."""
    spy = _Spy(monkeypatch)
    buf = np.zeros(cpu.PARALLEL_MIN_BYTES, dtype=np.uint8)
    want = ref_hash_np(buf[:-1]), ref_hash_np(buf)
    assert cpu.hash_bytes(buf[:-1]) == want[0]
    assert spy.calls == ["serial"]
    assert cpu.kernel_runs() == {"serial": 0, "parallel": 0}
    for _ in range(4):
        assert cpu.hash_bytes(buf) == want[1]
    assert spy.calls[1:3] == ["parallel", "serial"]
    assert cpu.kernel_runs()["serial"] + cpu.kernel_runs()["parallel"] == 4
    assert cpu._choice.estimate("serial") < float("inf") and cpu._choice.estimate("parallel") < float("inf")


def test_forked_child_uses_only_the_serial_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(cpu, "_forked", True)
    buf = np.zeros(cpu.PARALLEL_MIN_BYTES + 8, dtype=np.uint8)
    assert cpu.hash_bytes(buf) == ref_hash_np(buf)
    assert spy.calls == ["serial"]


def test_parallel_chunks_are_large_and_few_per_thread() -> None:
    """At least MIN_CHUNK_WORDS per chunk; CHUNKS_PER_THREAD chunks per numba thread once inputs are big."""
    import numba

    threads = numba.get_num_threads()
    assert cpu._chunk_words(10) == cpu.MIN_CHUNK_WORDS
    big = 64 * cpu.MIN_CHUNK_WORDS * threads
    assert -(-big // cpu._chunk_words(big)) == cpu.CHUNKS_PER_THREAD * threads


def test_checksum_host_is_checksum_of_the_same_bytes() -> None:
    """The lend hook's entry point (a numpy byte array) gives the hash of the tensor path."""
    import torch

    import cuda_hooks

    t = torch.arange(1000, dtype=torch.float32)
    raw = t.view(torch.uint8).numpy()
    assert cuda_hooks.checksum_host(raw) == cuda_hooks.checksum(t) == ref_hash_np(raw)
    assert cuda_hooks.checksum_host(raw[3:101]) == cuda_hooks.checksum(t.view(torch.uint8)[3:101])
    with pytest.raises(ValueError, match="uint8"):
        cuda_hooks.checksum_host(t.numpy())


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_while_another_thread_loads_the_kernels_leaves_a_child_that_can_hash() -> None:
    """A fork copies the locks other threads hold: forked while a worker thread took the first checksum (numba's
    import, a compile), the child hung forever at its own first hash (a user's fuzz: 4 loader threads, a fork,
    ``checksum=1``: every child hung). The load runs under cuda_hooks.loading's lock, which a fork waits for.
    Here the fork is made once the worker is seen inside the load (the lock held), so the child must find the
    kernels loaded and hash; before the lock, it hung in the import (the subprocess' timeout)."""
    code = (
        "import os, sys, threading, time, warnings, numpy as np\n"
        "warnings.filterwarnings('ignore', '.*multi-threaded.*fork', DeprecationWarning)  # 3.12+\n"
        "from cuda_hooks import bridge, loading\n"
        "buf = np.arange(4096, dtype=np.uint8)\n"
        "t = threading.Thread(target=bridge.checksum_host, args=(buf,))\n"
        "t.start()\n"
        "deadline = time.monotonic() + 30\n"
        "while time.monotonic() < deadline:  # until the worker holds the load's lock (inside the import)\n"
        "    if not loading._lock.acquire(blocking=False):\n"
        "        break\n"
        "    loading._lock.release()\n"
        "    time.sleep(0.001)\n"
        "else:\n"
        "    print('never saw the load'); sys.exit(5)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if bridge.checksum_host(buf) == bridge.checksum_host(buf.copy()) else 3)\n"
        "t.join()\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(status))\n"
    )
    proc = run_python(code, timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "0", proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_damaged_cache_entry_is_compiled_again_not_raised(tmp_path) -> None:
    """A truncated numba cache file raised out of every later first hash (a blind user's test); now the
    kernel's cache starts afresh and the hash is the same."""
    code = (
        "import numpy as np\n"
        "from cuda_hooks import cpu\n"
        "print(cpu.hash_bytes(np.arange(4096, dtype=np.uint8)))\n"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    first = run_python(code, env)
    assert first.returncode == 0, first.stderr
    damaged = list(tmp_path.rglob("*.nbc")) + list(tmp_path.rglob("*.nbi"))[:1]  # data, and one kernel's index
    assert len(damaged) >= 3
    for f in damaged:
        f.write_bytes(f.read_bytes()[:100])
    for _ in range(2):  # the second run loads the entry the first one saved again
        again = run_python(code, env)
        assert again.returncode == 0, again.stderr
        assert again.stdout == first.stdout
