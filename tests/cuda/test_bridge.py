"""Torch bridge: the sanitizer-facing API on CPU tensors (and CUDA ones when present)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _support import ref_hash, run_python

import cuda_hooks
from cuda_hooks.kernel_choice import PARALLEL_MIN_BYTES
from cuda_hooks import to_signed, to_unsigned

DTYPES = [torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16, torch.float32,
          torch.int64, torch.float64, torch.complex64]


def _raw(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
def test_import_does_not_import_numba() -> None:
    proc = run_python("import sys, cuda_hooks; assert 'numba' not in sys.modules, 'numba imported'; print('ok')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_checksum_hashes_raw_bytes_of_any_dtype(dtype: torch.dtype) -> None:
    t = torch.randn(5, 7, dtype=torch.float64).mul(50).to(dtype) if dtype != torch.bool else torch.rand(5, 7) > 0.5
    h = cuda_hooks.checksum(t)
    assert h == ref_hash(_raw(t))
    assert 0 <= h < 1 << 64


def test_checksum_of_scalar_empty_and_offset_views() -> None:
    assert cuda_hooks.checksum(torch.tensor(3.5)) == ref_hash(np.float32(3.5).tobytes())
    assert cuda_hooks.checksum(torch.empty(0)) == ref_hash(b"")
    base = torch.arange(100, dtype=torch.uint8)
    assert cuda_hooks.checksum(base[3:50]) == ref_hash(bytes(range(3, 50)))
    assert cuda_hooks.checksum(base.view(2, 50)[1]) == ref_hash(bytes(range(50, 100)))


def test_checksum_into_and_verify_into_cpu() -> None:
    t = torch.randn(1000)
    out = torch.zeros(4, dtype=torch.int64)
    flags = torch.zeros(4, dtype=torch.int32)
    cuda_hooks.checksum_into(t, out, 2)
    assert to_unsigned(int(out[2])) == cuda_hooks.checksum(t)
    assert out[[0, 1, 3]].eq(0).all()
    cuda_hooks.verify_into(t, out, 2, flags)
    assert flags.tolist() == [0, 0, 0, 0]
    t[123] += 1
    cuda_hooks.verify_into(t, out, 2, flags)
    assert flags.tolist() == [0, 0, 1, 0]
    t[123] -= 1
    cuda_hooks.verify_into(t, out, 2, flags)
    assert flags.tolist() == [0, 0, 1, 0], "a raised flag stays raised"


def test_signed_slot_round_trip() -> None:
    for h in (0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1):
        assert to_unsigned(to_signed(h)) == h
        assert -(1 << 63) <= to_signed(h) < 1 << 63


@pytest.mark.parametrize("byte", [0, 0xA5, 255])
def test_poison_fills_in_place(byte: int) -> None:
    t = torch.randn(3, 333)
    ptr, version = t.data_ptr(), t._version
    view = t[1]
    cuda_hooks.poison(view, byte)
    assert t.data_ptr() == ptr and view.data_ptr() == ptr + 333 * 4
    assert _raw(t[1]) == bytes([byte]) * 333 * 4
    assert t._version > version, "poison must count as an in-place write"
    assert _raw(t[0]) != bytes([byte]) * 333 * 4


def test_bad_input_raises_value_error_naming_the_value() -> None:
    t = torch.zeros(4, 4)
    out = torch.zeros(2, dtype=torch.int64)
    flags = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"contiguous.*stride=\(1, 4\)"):
        cuda_hooks.checksum(t.t())
    with pytest.raises(ValueError, match="contiguous"):
        cuda_hooks.poison(t[:, ::2], 1)
    for bad in (-1, 256, 3.0, True, "1"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            cuda_hooks.poison(t, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be .*torch.int64.*got torch.int32"):
        cuda_hooks.checksum_into(t, flags, 0)
    with pytest.raises(ValueError, match="flags must be .*torch.int32.*got torch.int64"):
        cuda_hooks.verify_into(t, out, 0, out)
    with pytest.raises(ValueError, match="slot 2 out of range"):
        cuda_hooks.checksum_into(t, out, 2)
    with pytest.raises(ValueError, match="slot must be an int, got 0.5"):
        cuda_hooks.checksum_into(t, out, 0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="torch.Tensor, got ndarray"):
        cuda_hooks.checksum(np.zeros(3))  # type: ignore[arg-type]


def test_compile_seconds_lists_used_kernels() -> None:
    cuda_hooks.checksum(torch.zeros(8))
    cuda_hooks.checksum(torch.zeros(PARALLEL_MIN_BYTES // 4))  # (numba's kernels hash this size, stored code or not)
    times = cuda_hooks.compile_seconds()
    assert {"cpu_hash_serial", "cpu_hash_parallel", "numba_import_cpu"} <= set(times)


cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda_only
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4099, (1 << 20) + 3])
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_matches_cpu_bit_for_bit(n: int, offset: int) -> None:
    host = torch.randint(0, 256, (n + offset,), dtype=torch.uint8)[offset:]
    dev = torch.randint(0, 256, (n + offset,), dtype=torch.uint8, device="cuda")[offset:]
    dev.copy_(host)
    out = torch.zeros(3, dtype=torch.int64, device="cuda")
    cuda_hooks.checksum_into(dev, out, 1)
    assert to_unsigned(int(out[1].item())) == cuda_hooks.checksum(host)
    assert cuda_hooks.checksum(dev) == cuda_hooks.checksum(host)


@cuda_only
def test_cuda_verify_and_poison_on_a_side_stream() -> None:
    t = torch.randn(4096, device="cuda")
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        cuda_hooks.checksum_into(t, out, 0)
        cuda_hooks.verify_into(t, out, 0, flags)
        cuda_hooks.poison(t, 0x7F)
        cuda_hooks.verify_into(t, out, 0, flags)
        cuda_hooks.checksum_into(t, out, 1)
    s.synchronize()
    assert flags.tolist() == [1, 0]
    assert t.view(torch.uint8).eq(0x7F).all()
    assert to_unsigned(int(out[1])) == cuda_hooks.checksum(t.cpu())
