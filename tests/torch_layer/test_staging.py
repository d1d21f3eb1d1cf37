"""StagingBuffer and StagingRing: lending, reuse, sources, adoption, lookup, bad input."""
from __future__ import annotations

import ctypes
import gc
import io

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StagingRing


def test_lend_gives_a_view_of_the_written_bytes_with_its_own_storage():
    buf = StagingBuffer(4096, name="b")
    src = torch.randn(8, 16)
    w = buf.write(128, src, name="w")
    assert torch.equal(w, src) and w.dtype == torch.float32 and w.shape == (8, 16)
    assert w.data_ptr() == buf.tensor.data_ptr() + 128
    assert w.untyped_storage()._cdata != buf.tensor.untyped_storage()._cdata
    assert getattr(w, sanitizer.BORROWED_MARKER) is True
    lease = sanitizer.lease_of(w)
    assert (lease.name, lease.dtype, lease.shape, lease.start, lease.end) == ("w", "float32", (8, 16), 128, 640)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8,
                                   torch.bool, torch.int64, torch.float8_e4m3fn, torch.complex64])
def test_every_dtype_round_trips_bit_exactly(dtype):
    buf = StagingBuffer(1 << 14)
    src = torch.randint(0, 255, (3, 40), dtype=torch.uint8).view(torch.uint8)
    src = src.view(dtype) if dtype.itemsize == 1 else torch.randint(0, 255, (3, 40 * dtype.itemsize),
                                                                    dtype=torch.uint8).view(dtype)
    w = buf.write(64, src, name="x")
    assert w.dtype == dtype and w.shape == src.shape
    assert torch.equal(w.view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
def test_a_one_element_source_with_any_stride_is_written(dtype):
    """Torch calls a one-element tensor contiguous whatever its stride (safetensors' ``get_slice(k)[::2]`` of a
    one-element slice has stride 2); its bytes are still one element. A write raised (a dtype view needs stride
    1) until a user's fuzz of the ``safetensors_ring`` emulation's slices found it."""
    base = torch.arange(6).to(dtype)
    src = base[4::2]
    assert src.shape == (1,) and src.stride() == (2,) and src.is_contiguous()
    ring = StagingRing(4096)
    w = ring.put("one", src)
    assert w.shape == (1,) and torch.equal(w, src)
    empty = base[6::2]
    assert ring.put("none", empty).shape == (0,)


def test_derived_views_share_the_lease():
    buf = StagingBuffer(1 << 16)
    w = buf.lend(0, (16, 32), torch.float32, name="w")
    lease = sanitizer.lease_of(w)
    derived = [w.view(-1), w.narrow(0, 2, 3), w[1:, ::2], w.t(), w.detach(), w.as_strided((4, 4), (1, 4)),
               w.reshape(32, 16), w.unflatten(1, (4, 8)), w.contiguous(), w.to(torch.float32), w[3], w.T.flatten()[:0]]
    for d in derived[:-1]:
        assert sanitizer.lease_of(d) is lease
        assert sanitizer.is_borrowed(d)
    assert sanitizer.lease_of(w.clone()) is None and not sanitizer.is_borrowed(w.clone())
    assert not getattr(w.narrow(0, 0, 1), sanitizer.BORROWED_MARKER, False)  # why storage identity matters


def test_is_borrowed_recognises_third_party_tensors_in_an_adopted_buffer():
    loader_buffer = torch.zeros(1 << 12, dtype=torch.uint8)
    third_party = loader_buffer[256:512].view(torch.float16)  # made by the loader, not by us
    before = sanitizer.is_borrowed(third_party)
    buf = StagingBuffer.adopt(loader_buffer, name="loader")
    assert not before and sanitizer.is_borrowed(third_party)
    assert sanitizer.lease_of(third_party) is None  # not lent through us
    assert not sanitizer.is_borrowed(torch.zeros(4))
    buf.close()
    assert not sanitizer.is_borrowed(third_party)


def test_adopt_refuses_non_contiguous_and_lends_over_any_dtype():
    with pytest.raises(ValueError, match="non-contiguous"):
        StagingBuffer.adopt(torch.zeros(8, 8).t())
    buf = StagingBuffer.adopt(torch.arange(16, dtype=torch.float32), name="f32")
    assert buf.nbytes == 64
    assert torch.equal(buf.lend(8, (2,), torch.float32), torch.tensor([2.0, 3.0]))


def test_reuse_advances_the_generation_and_stales_overlaps_only():
    buf = StagingBuffer(1024, name="r")
    a = buf.lend(0, (64,), torch.float32, name="a")
    b = buf.lend(256, (64,), torch.float32, name="b")
    g = buf.generation
    event = buf.reuse(0, 200, by="c")
    assert buf.generation == g + 1 and event.by == "c"
    assert sanitizer.lease_of(a).stale and not sanitizer.lease_of(b).stale
    assert sanitizer.lease_of(a).stale_by is event


def test_writes_through_numpy_readinto_and_ctypes_count_as_reuse_via_the_api():
    """torch's _version never sees these writes: the buffer API is what makes leases stale."""
    buf = StagingBuffer(1024, name="r")
    a = buf.lend(0, (16,), torch.uint8, name="a")
    version = a._version
    buf.reuse(0, 16, by="numpy")
    buf.tensor.numpy()[:16] = 7
    assert a._version == version and sanitizer.lease_of(a).stale
    b = buf.lend(0, (16,), torch.uint8, name="b")
    buf.reuse(0, 16, by="readinto")
    io.BytesIO(b"\x05" * 16).readinto(memoryview(buf.tensor.numpy()[:16]))
    assert sanitizer.lease_of(b).stale and int(b[0]) == 5
    c = buf.lend(0, (16,), torch.uint8, name="c")
    buf.reuse(0, 16, by="ctypes")
    ctypes.memset(buf.tensor.data_ptr(), 9, 16)
    assert sanitizer.lease_of(c).stale and c._version == 0


def test_sources_tensor_bytes_and_file():
    ring = StagingRing(4096, name="ring")
    t = ring.put("t", torch.arange(10, dtype=torch.int16))
    by = ring.put("by", bytes(range(16)), dtype=torch.uint8, shape=(4, 4))
    fh = io.BytesIO(np.arange(6, dtype=np.float32).tobytes())
    f = ring.put("f", fh, shape=(2, 3), dtype=torch.float32)
    assert torch.equal(t, torch.arange(10, dtype=torch.int16))
    assert by.tolist()[1] == [4, 5, 6, 7]
    assert torch.equal(f, torch.arange(6, dtype=torch.float32).view(2, 3))
    with pytest.raises(ValueError, match="file ended after 8 of 24 bytes"):
        ring.put("short", io.BytesIO(b"\0" * 8), shape=(6,), dtype=torch.float32)
    with pytest.raises(ValueError, match="needs shape"):
        ring.put("noshape", io.BytesIO(b"\0" * 8))
    with pytest.raises(TypeError, match="cannot write a int"):
        ring.put("bad", 42)


def test_ring_places_after_previous_and_wraps_without_splitting():
    ring = StagingRing(1000, name="ring", alignment=64)
    offsets = []
    for i, n in enumerate([300, 300, 300, 200, 500]):
        w = ring.put(f"w{i}", torch.zeros(n, dtype=torch.uint8))
        offsets.append(w.data_ptr() - ring.buffer.tensor.data_ptr())
        lease = sanitizer.lease_of(w)
        assert lease.end <= 1000  # never split across the end
    # 0, 320 (aligned after 300), 640 would end at 940 -> fits; 200 at 960 does not fit -> wraps to 0
    assert offsets == [0, 320, 640, 0, 256]
    assert ring.wraps == 1
    with pytest.raises(ValueError, match="1001 bytes does not fit staging ring 'ring' of 1000 bytes"):
        ring.put("huge", torch.zeros(1001, dtype=torch.uint8))


def test_ring_reuse_makes_the_overwritten_tensor_stale():
    ring = StagingRing(512, name="ring")
    first = ring.put("first", torch.ones(64, dtype=torch.float32))  # 256 bytes at 0
    second = ring.put("second", torch.ones(64, dtype=torch.float32))  # 256 at 256
    assert not sanitizer.lease_of(first).stale
    ring.put("third", torch.full((64,), 3.0))  # wraps to 0: overwrites first
    assert sanitizer.lease_of(first).stale and not sanitizer.lease_of(second).stale
    assert sanitizer.lease_of(first).stale_by.by == "third"
    assert float(first[0]) == 3.0  # unsanitized, the retained view reads the next tensor: the bug


@pytest.mark.parametrize("call,match", [
    (lambda b: b.lend(1000, (10,), torch.float32), r"out of bounds.*1024 bytes"),
    (lambda b: b.lend(-4, (1,), torch.float32), r"at offset -4 is out of bounds"),
    (lambda b: b.lend(2, (4,), torch.float32), r"offset 2 is not aligned to float32"),
    (lambda b: b.lend(0, (-1, 4), torch.float32), r"negative size in shape \[-1, 4\]"),
    (lambda b: b.lend(0, (2,), "float32"), r"dtype must be a torch.dtype"),
    (lambda b: b.lend(1.5, (2,), torch.uint8), r"offset must be an int, got 1.5"),
    (lambda b: b.reuse(1000, 100), r"\[1000, 1100\).*1024 bytes"),
    (lambda b: b.reuse(-1, 10), r"\[-1, 9\)"),
    (lambda b: b.write(1020, torch.zeros(2)), r"write of 'None' \(8 bytes\) at offset 1020 is out of bounds"),
])
def test_bad_input_names_the_numbers(call, match):
    buf = StagingBuffer(1024, name="bad")
    with pytest.raises((ValueError, TypeError), match=match):
        call(buf)


def test_use_after_close_is_an_error_not_a_segfault():
    buf = StagingBuffer(1024, name="gone")
    w = buf.write(0, torch.arange(4.0), name="w")
    buf.close()
    buf.close()  # idempotent
    for call in (lambda: buf.lend(0, (1,), torch.uint8, name="x"), lambda: buf.reuse(0, 4, by="y"),
                 lambda: buf.write(0, torch.zeros(1)), lambda: buf.tensor):
        with pytest.raises(ValueError, match="'gone' is closed"):
            call()
    assert sanitizer.lease_of(w).stale_by.kind == "close"
    gc.collect()
    assert w.tolist() == [0.0, 1.0, 2.0, 3.0]  # memory outlives close while a lease holds it
    with sanitizer.sanitize():
        with pytest.raises(sanitizer.StaleBorrowError, match="was closed"):
            w.sum()


@pytest.mark.slow
def test_lease_dies_with_its_last_view_and_garbage_collected_buffers_close():
    buf = StagingBuffer(1024)
    w = buf.lend(0, (4,), torch.float32, name="w")
    v = w[1:]
    lease = sanitizer.lease_of(w)
    del w
    gc.collect()
    assert lease.alive  # the derived view still reaches the bytes
    del v
    gc.collect()
    assert not lease.alive and buf.leases() == []
    region = buf._region
    del buf
    gc.collect()
    assert region.closed


def test_lend_is_tracked_while_the_sanitizer_is_off_so_a_later_check_sees_it():
    """The issue's own example: lend and reuse first, turn the sanitizer on afterwards."""
    buf = StagingBuffer(1 << 20, device="cpu", name="ring0")
    w = buf.lend(0, (256, 128), torch.bfloat16, name="layers.0.mlp.gate_proj.weight")
    kept = w.t()[:, :64]
    buf.reuse(0, 4096, by="layers.0.mlp.up_proj.weight")
    with sanitizer.sanitize():
        with pytest.raises(sanitizer.StaleBorrowError) as err:
            kept.sum()
    first_line = str(err.value).splitlines()[0]
    assert first_line.startswith(
        "borrowed view 'layers.0.mlp.gate_proj.weight' bfloat16[256, 128] used after staging buffer 'ring0' "
        "reused bytes [0x0, 0x1000) for 'layers.0.mlp.up_proj.weight' (generation 1 -> 2) in aten.sum.default")


def test_writing_a_fresh_lease_back_in_place_is_no_false_alarm():
    """Re-lending in place (the source is the very bytes written): correct unsanitized, silent sanitized."""
    buf = StagingBuffer(1024, name="inplace")
    w = buf.write(0, torch.arange(8, dtype=torch.float32), name="w")
    with sanitizer.sanitize():
        again = buf.write(0, w, name="w again")
        assert again.tolist() == list(range(8))
        shifted = buf.write(16, again, name="shifted")  # overlaps its own source: read before the reuse
        assert shifted.tolist() == list(range(8))
    assert sanitizer.errors() == []


@pytest.mark.parametrize("halt", [1, 0])
def test_a_write_of_a_stale_source_changes_nothing_before_it_reports(halt):
    ring = sanitizer.StagingRing(256, name="atomic")
    a = ring.put("a", torch.ones(16))
    b = ring.put("b", torch.ones(40))
    ring.put("c", torch.ones(16))  # wraps: a is stale now
    state = (ring.wraps, ring.head, ring.segment, ring.buffer.generation)
    with sanitizer.sanitize(halt_on_error=halt):
        if halt:
            with pytest.raises(sanitizer.StaleBorrowError, match="StagingBuffer.write"):
                ring.put("d", a)
            assert (ring.wraps, ring.head, ring.segment, ring.buffer.generation) == state  # nothing moved
            assert not sanitizer.lease_of(b).stale  # the destination's valid lease is untouched
        else:
            ring.put("d", a)  # recorded (the program goes on, as with any op under halt_on_error=0)
            assert sanitizer.errors()[0]["op"] == "StagingBuffer.write"  # (then the copy's own read of it)


@pytest.mark.slow
def test_a_buffer_still_takes_puts_in_the_users_own_atexit_handlers(tmp_path):
    from conftest import run_python

    code = ("import atexit, torch, sanitizer\n"
            "def late(): print('late put', ring.put('x', torch.ones(4)).sum().item())\n"
            "atexit.register(late)  # registered before the buffer exists: runs after its finalizer's hook\n"
            "ring = sanitizer.StagingRing(1024, name='r')\n"
            "ring.put('w', torch.ones(4))\n")
    for env in ({}, {"OWNERSHIP_SANITIZE": "1"}):
        out = run_python(code, env)
        assert out.returncode == 0 and "late put 4.0" in out.stdout, out.stderr


@pytest.mark.slow
def test_two_buffers_adopted_over_the_same_memory_see_each_others_reuses():
    memory = torch.zeros(1024, dtype=torch.uint8)
    first = StagingBuffer.adopt(memory, name="first")
    second = StagingBuffer.adopt(memory[256:], name="second")  # nested: the same bytes, other offsets
    a = first.lend(256, (16,), torch.float32, name="a")  # bytes [256, 320) of the memory
    b = second.lend(0, (16,), torch.float32, name="b")  # the very same bytes
    far = second.lend(512, (16,), torch.float32, name="far")
    with sanitizer.sanitize():
        second.reuse(0, 64, by="next")  # through the second buffer
        with pytest.raises(sanitizer.StaleBorrowError, match="'a'"):
            a.sum()  # the first buffer's lease over those bytes is stale too
        with pytest.raises(sanitizer.StaleBorrowError, match="'b'"):
            b.sum()
        far.sum()  # other bytes: still fresh
        first.reuse(768, 64, by="later")  # through the first buffer, over the second's 'far'
        with pytest.raises(sanitizer.StaleBorrowError, match="'far'"):
            far.sum()


# -- one lend path: the common case's predicate and the full check agree ------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LEND_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
                torch.float64, torch.complex64, torch.bool]


def _lend_outcome(buf, offset, shape, dtype):
    """What a lend gives: the view's layout and address and its lease's fields, or the error's text."""
    try:
        v = buf.lend(offset, shape, dtype, name="p")
    except (ValueError, TypeError) as exc:
        return ("error", type(exc).__name__, str(exc))
    lease = sanitizer.lease_of(v)
    return ("view", tuple(v.shape), v.dtype, v.data_ptr(), v.stride(), lease.start, lease.end, lease.dtype,
            lease.shape, lease.name, bytes(v.reshape(-1).view(torch.uint8).numpy()) if v.numel() else b"")


@settings(max_examples=150, deadline=None)
@given(offset=st.integers(-16, 300), shape=st.lists(st.integers(-1, 9), max_size=3),
       dtype=st.sampled_from(_LEND_DTYPES))
def test_the_fast_lend_and_the_checked_lend_give_the_same_view_lease_and_error(offset, shape, dtype):
    """The common case (int offset, tuple shape, torch dtype) is recognised by a predicate; the same lend
    spelt otherwise (a list shape, a numpy offset) takes the full check. Both must agree on everything."""
    import numpy as np

    buf = StagingBuffer(256, name="paths")
    buf.tensor.copy_(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    fast = _lend_outcome(buf, offset, tuple(shape), dtype)
    checked = _lend_outcome(buf, np.int64(offset), list(shape), dtype)
    assert fast == checked
    if fast[0] == "view":
        assert buf._fast_nbytes(offset, tuple(shape), dtype) == fast[6] - fast[5]
    else:
        assert buf._fast_nbytes(offset, tuple(shape), dtype) == -1
