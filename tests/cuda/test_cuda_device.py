"""The sanitizer's CUDA paths end to end: on a GPU when there is one, else on the fake devices.

``bench/device_check.sh`` runs this file on a GPU machine with
``OWNSAN_REQUIRE_CUDA=1`` (no fake then: without a GPU every test fails). Elsewhere
the same scenarios run on the fake CUDA devices of ``tests/fake_cuda.py``, so the
scenarios themselves are checked on every machine. Where the GPU and the fake
differ, :class:`RealGpu` and :class:`FakeGpuEnv` say how: a slow stream is a
``torch.cuda._sleep`` on a GPU and a paused stream on the fake; a use of freed
memory is a wrong value on a GPU and a recorded hazard on the fake.

On a GPU nothing here may skip, except the multi-GPU case on a one-GPU machine.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import warnings
from typing import Any, Iterator, List

import numpy as np
import pytest
import torch

import cuda_hooks
import sanitizer
from sanitizer import BorrowCorruptedError, StagingBuffer, StaleBorrowError
from sanitizer.features import checksums, guard
from sanitizer.torch_layer import graph_capture  # noqa: F401  (its once-per-process warning is reset per test)

REAL = torch.cuda.is_available()
MIB = 1 << 20


class RealGpu:
    """The GPU."""

    real = True
    big = 4 << 30  # the bit-exactness case: 4 GiB + 13 bytes

    def __init__(self) -> None:
        self.device_count = torch.cuda.device_count()

    def delay(self, stream: Any) -> None:
        """Keep ``stream`` busy for ~50 ms before its next work (a slow stream)."""
        with torch.cuda.stream(stream):
            torch.cuda._sleep(100_000_000)

    def hazards(self) -> List[str]:
        return []  # on a GPU a use of freed memory shows as a wrong value, which the tests check

    def memory_allocated(self, device: int = 0) -> int:
        return torch.cuda.memory_allocated(device)

    def peek(self, t: torch.Tensor, nbytes: int) -> np.ndarray:
        """``nbytes`` at ``t``'s address, read without any op on ``t`` (a new storage over its memory)."""
        holder = _Interface(t.data_ptr(), nbytes)
        return torch.as_tensor(holder, device=t.device).cpu().numpy()

    @contextlib.contextmanager
    def graph(self) -> Iterator[Any]:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            yield g

    def replay(self, g: Any) -> None:
        g.replay()
        torch.cuda.synchronize()

    def random_bytes(self, n: int, device: int = 0) -> torch.Tensor:
        gen = torch.Generator(device=f"cuda:{device}").manual_seed(n)
        return torch.randint(0, 256, (n,), dtype=torch.uint8, device=f"cuda:{device}", generator=gen)


class _Interface:
    """``__cuda_array_interface__`` over raw device memory (no stream key: no synchronisation)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class FakeGpuEnv:
    """The fake devices (no GPU): slow streams are paused ones, freed memory in use is a hazard."""

    real = False
    big = 1 << 20  # the simulator-free twin hashes on the CPU: keep the big case small

    def __init__(self, fake: Any):
        self.fake = fake
        self.device_count = fake.n

    def delay(self, stream: Any) -> None:
        self.fake.pause(stream)

    def hazards(self) -> List[str]:
        return list(self.fake.hazards)

    def memory_allocated(self, device: int = 0) -> int:
        return sum(a.nbytes for a in self.fake._allocs if a.device.index == device)

    def peek(self, t: torch.Tensor, nbytes: int) -> np.ndarray:
        return np.frombuffer((ctypes.c_char * nbytes).from_address(t.data_ptr()), dtype=np.uint8).copy()

    @contextlib.contextmanager
    def graph(self) -> Iterator[Any]:
        with self.fake.capture() as g:
            yield g

    def replay(self, g: Any) -> None:
        pass  # the fake records a graph; it does not replay one

    def random_bytes(self, n: int, device: int = 0) -> torch.Tensor:
        gen = torch.Generator().manual_seed(n)
        return self.fake.tensor(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen), device)


@pytest.fixture
def gpu(monkeypatch) -> Iterator[Any]:
    from tests.fake_cuda import FakeCuda, reset_device_state

    if REAL:
        reset_device_state()  # fresh slot tables and poison blocks, the capture warning not yet given
        yield RealGpu()
        torch.cuda.synchronize()
        sanitizer.disable()
        gc.collect()
        return
    if os.environ.get("OWNSAN_REQUIRE_CUDA") == "1":
        pytest.fail("OWNSAN_REQUIRE_CUDA is set but torch sees no CUDA device")

    fake = FakeCuda(2).install(monkeypatch)
    yield FakeGpuEnv(fake)
    fake.settle()
    sanitizer.disable()
    gc.collect()
    fake.uninstall()


def _mismatches() -> list:
    return [e["lease"]["name"] for e in sanitizer.errors() if e["kind"] == "checksum_mismatch"]


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu() if REAL else t.detach().clone()


# -- bit-exactness -----------------------------------------------------------------------------------------
def test_device_hash_equals_the_cpu_hash_at_4_gib_plus_13_bytes_at_offsets_0_to_4(gpu):
    n = gpu.big + 13
    dev = gpu.random_bytes(n + 4)
    host = _host(dev)
    out = (torch.zeros(5, dtype=torch.int64, device="cuda") if REAL
           else gpu.fake.zeros(5, torch.int64, torch.device("cuda", 0)))
    for offset in range(5):
        cuda_hooks.checksum_into(dev[offset:offset + n], out, offset)
    got = [cuda_hooks.to_unsigned(int(v)) for v in _host(out).tolist()]
    want = [cuda_hooks.checksum(host[offset:offset + n]) for offset in range(5)]
    assert got == want
    del dev, host


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_odd_length_leases_at_every_offset_hash_as_on_the_cpu(gpu, dtype):
    buf = StagingBuffer(1 << 17, device="cuda", name="odd")
    itemsize = torch.empty(0, dtype=dtype).element_size()
    with sanitizer.sanitize(checksum=1):
        for k, n in enumerate([1, 3, 1001, 4097, 7777]):  # odd lengths, k elements past an 8-byte boundary
            src = gpu.random_bytes(n * itemsize).view(dtype)
            w = buf.write((16 << 10) * k + k * itemsize, src, name=f"t{k}")
            assert checksums.expected_hash(sanitizer.lease_of(w)) == cuda_hooks.checksum(_host(src))
        sanitizer.synchronize()
    assert sanitizer.errors() == []


# -- checksum=1 and poison=1 on a CUDA StagingBuffer ---------------------------------------------------------
@pytest.mark.parametrize("side", [False, True], ids=["default-stream", "side-stream"])
def test_checksum_and_poison_on_a_cuda_buffer_are_exact_and_silent_and_name_a_corruption(gpu, side):
    stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
    ring = sanitizer.StagingRing(3 * MIB, device="cuda", name="ring")
    with torch.cuda.stream(stream), sanitizer.sanitize(checksum=1, poison=1):
        out = []
        srcs = [gpu.random_bytes(2 * (1000 + 37 * i)).view(torch.bfloat16) for i in range(24)]
        for i, src in enumerate(srcs):
            out.append(ring.put(f"w{i}", src).clone())
        sanitizer.synchronize()
        assert sanitizer.errors() == []
        assert all(torch.equal(_host(a).view(torch.int16), _host(b).view(torch.int16)) for a, b in zip(out, srcs))
        w = ring.put("victim", srcs[0])
        lease = sanitizer.lease_of(w)
        ring.buffer.tensor[lease.start + 3] ^= 1  # a write behind the API into the lent bytes
        sanitizer.verify(w)  # queued on the device
        with pytest.raises(BorrowCorruptedError, match="'victim'"):
            sanitizer.synchronize()
    del w


def test_a_dead_corrupted_lease_is_named_after_its_slot_was_reused(gpu):
    buf = StagingBuffer(1 << 16, device="cuda", name="ring")
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        a = buf.write(0, gpu.random_bytes(256), name="A")
        buf.tensor[3] ^= 1
        buf.reuse(0, 256, by="B")
        del a
        gc.collect()
        kept = [buf.write(1024 + 256 * i, gpu.random_bytes(256), name=f"L{i}") for i in range(64)]
        sanitizer.synchronize()
    assert _mismatches() == ["A"]
    del kept


def test_checks_queued_on_a_slow_side_stream_are_read_by_synchronize_and_survive_table_growth(gpu):
    buf = StagingBuffer(1 << 16, device="cuda", name="ring")
    side = torch.cuda.Stream()
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        kept = [buf.write(256 * i, gpu.random_bytes(256), name=f"L{i}") for i in range(64)]
        buf.tensor[5] ^= 1  # L0 changed
        side.wait_stream(torch.cuda.current_stream())
        gpu.delay(side)
        with torch.cuda.stream(side):
            sanitizer.verify(kept[0])  # queued behind the delay
        kept.append(buf.write(256 * 64, gpu.random_bytes(256), name="L64"))  # the tables double meanwhile
        sanitizer.synchronize()
    assert _mismatches() == ["L0"] and gpu.hazards() == []
    del kept


# -- guard, rescue, own() with the staging buffer freed on another stream -------------------------------------
@pytest.mark.slow
def test_retained_stale_cuda_views_share_one_poison_block_and_read_poison(gpu):
    n = 16 * MIB
    buf = StagingBuffer(n, device="cuda", name="layer")
    with sanitizer.sanitize():
        before = gpu.memory_allocated()
        kept = []
        for i in range(8):  # a consumer keeping a layer's eight weights
            kept.append(buf.write(0, gpu.random_bytes(n), name=f"w{i}"))
        buf.write(0, gpu.random_bytes(n), name="next")
        grew = gpu.memory_allocated() - before
        assert grew <= 2 * n + 4 * MIB, f"tombstones took {grew >> 20} MiB for 8 x {n >> 20} MiB views"
        assert guard.stats()["device_poison_bytes"] == n
        for k in kept:
            head, tail = gpu.peek(k, 64), gpu.peek(k[-64:], 64)
            assert (head == 0xFF).all() and (tail == 0xFF).all()
        with pytest.raises(StaleBorrowError):
            kept[0].sum()
    del kept


def _freed_under_a_slow_stream(gpu, action, n: int = 64 * MIB):
    """Run ``action(buf, w)`` on a side stream kept busy, then drop the lease (unless ``action`` returned it)
    and free the staging buffer, and let the default stream allocate and fill ``n`` bytes at once (the freed
    block, if nothing held it); returns ``(what action returned, w's original bytes, the filled tensor)``
    once everything ran."""
    buf = StagingBuffer(n, device="cuda", name="staging")
    src = gpu.random_bytes(n)
    w = buf.write(0, src, name="w")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    gpu.delay(side)
    with torch.cuda.stream(side):
        result = action(buf, w)
    del w
    buf.close()
    del buf
    gc.collect()
    junk = torch.full((n,), 0x55, dtype=torch.uint8, device="cuda") if REAL else gpu.fake.alloc(n).fill_(0x55)
    torch.cuda.synchronize()
    return result, src, junk


@pytest.mark.slow
def test_rescue_on_a_slow_stream_copies_the_bytes_even_when_the_buffer_is_freed_meanwhile(gpu):
    with sanitizer.sanitize(rescue=1, guard=0):
        def retire(buf, w):
            buf.reuse(0, buf.nbytes, by="next")  # rescue's copy is queued on the slow side stream
            return w

        w, src, junk = _freed_under_a_slow_stream(gpu, retire)
        assert torch.equal(_host(w), _host(src)), "the rescue copy read reused memory"
        assert (_host(junk) == 0x55).all() and gpu.hazards() == []
        assert not sanitizer.is_borrowed(w)


@pytest.mark.slow
def test_own_on_a_slow_stream_copies_the_bytes_even_when_the_buffer_is_freed_meanwhile(gpu):
    with sanitizer.sanitize():
        def own(buf, w):
            return sanitizer.own(w)

        copy, src, junk = _freed_under_a_slow_stream(gpu, own)
        assert torch.equal(_host(copy), _host(src)), "own()'s copy read reused memory"
        assert (_host(junk) == 0x55).all() and gpu.hazards() == []


@pytest.mark.slow
def test_poison_and_verify_on_a_slow_stream_never_touch_memory_reused_meanwhile(gpu):
    with sanitizer.sanitize(checksum=1, poison=1, guard=0, halt_on_error=0):
        def retire(buf, w):
            buf.reuse(0, 1024, by="next")  # verify, then poison of w's bytes past 1024, queued on the slow stream
            return None

        _, _, junk = _freed_under_a_slow_stream(gpu, retire)
        sanitizer.synchronize()
        assert (_host(junk) == 0x55).all(), "a poison fill landed in memory reused meanwhile"
        assert sanitizer.errors() == [] and gpu.hazards() == []



# -- stream order across the sanitizer's own work (issue 31, defects 1-3) -----------------------------------------
def test_a_verify_on_the_consumers_stream_runs_after_the_lends_hash(gpu):
    """Defect 1: the loader writes on its stream, records "ready" and lends (the hash queued behind a slow
    stretch); the consumer waits for "ready" only, and a reuse on its stream queues the verify. The
    verify must still run after the hash, or a correct program gets a false BorrowCorruptedError."""
    buf = StagingBuffer(1 << 16, device="cuda", name="ring")
    src = gpu.random_bytes(4096)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    with sanitizer.sanitize(checksum=1, halt_on_error=0):
        with torch.cuda.stream(producer):
            buf.tensor[:4096].copy_(src)
            ready = torch.cuda.Event()
            ready.record()
            gpu.delay(producer)  # the hash, queued next, runs late
            w = buf.lend(0, (4096,), torch.uint8, name="w")
        consumer.wait_event(ready)
        with torch.cuda.stream(consumer):
            buf.reuse(0, 4096, by="next")  # the verify of w, on the consumer's stream
        sanitizer.synchronize()
    assert _mismatches() == [] and gpu.hazards() == []
    del w


def test_record_stream_on_a_lease_keeps_the_staging_memory_for_that_stream(gpu):
    """Defect 2: a consumer reading a lease on its own stream and calling ``record_stream`` is correct
    unsanitized; the lease is an alias the allocator ignores, so the record must reach the buffer's
    memory, or the freed buffer's block is handed out while the read is still queued."""
    def read_and_record(buf, w):
        out = torch.empty_like(w)
        out.copy_(w)  # read on the slow stream (the current one here)
        w.record_stream(torch.cuda.current_stream())
        return out

    with sanitizer.sanitize():
        out, src, junk = _freed_under_a_slow_stream(gpu, read_and_record, 16 * MIB)
    assert torch.equal(_host(out), _host(src)), "the read on the recorded stream saw memory reused meanwhile"
    assert (_host(junk) == 0x55).all() and gpu.hazards() == []


def test_a_rescued_view_read_on_another_stream_reads_the_rescued_bytes(gpu):
    """Defect 3: the rescue copy is queued on the retiring (loader's, slow) stream while the view points at
    the new memory at once; a consumer reading it on another stream must see the copy, not its
    destination before the copy landed."""
    buf = StagingBuffer(4 * MIB, device="cuda", name="ring")
    src = gpu.random_bytes(4 * MIB)
    loader, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with sanitizer.sanitize(rescue=1, guard=0):
        w = buf.write(0, src, name="w")
        loader.wait_stream(torch.cuda.current_stream())
        gpu.delay(loader)
        with torch.cuda.stream(loader):
            buf.write(0, gpu.random_bytes(4 * MIB + 1)[1:], name="next")  # the rescue copy, behind the delay
        with torch.cuda.stream(consumer):
            got = torch.empty_like(w)
            got.copy_(w)
        torch.cuda.synchronize()
        assert not sanitizer.is_borrowed(w)
    assert torch.equal(_host(got), _host(src)), "a rescued view read on another stream saw the copy's destination"
    assert gpu.hazards() == []
    del w


def test_poison_fills_the_retired_bytes_on_the_device(gpu):
    """``poison=1``: the bytes of a retired lease that the reuse does not overwrite read as the poison byte
    on the device (the fill is a kernel on the current stream)."""
    buf = StagingBuffer(1 << 16, device="cuda", name="ring")
    with sanitizer.sanitize(poison=1, guard=0):
        w = buf.write(0, gpu.random_bytes(8192), name="w")
        buf.reuse(0, 1024, by="next")  # w's bytes past 1024 are poisoned
        torch.cuda.synchronize()
        poisoned = gpu.peek(buf.tensor[1024:], 8192 - 1024)
        assert (poisoned == 0xFF).all(), f"{int((poisoned != 0xFF).sum())} retired bytes are not poison"
    del w


# -- graph capture ---------------------------------------------------------------------------------------------
def test_a_graph_captured_with_the_sanitizer_on_works_and_is_warned_about_once(gpu):
    buf = StagingBuffer(MIB, device="cuda", name="graph")
    src = gpu.random_bytes(4096).view(torch.float32)
    with sanitizer.sanitize(checksum=1, poison=1, rescue=1):
        w0 = buf.write(0, src, name="before")
        kept = w0[:4]
        del w0
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's capture guide says
            (buf.lend(0, (1024,), torch.float32, name="warm") * 2).sum()
        torch.cuda.current_stream().wait_stream(side)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gpu.graph() as g:
                w = buf.write(0, src, name="during")  # retires "before" and lends "during" inside the capture
                y = w * 2
                sanitizer.synchronize()
        ours = [c for c in caught if "graph is being captured" in str(c.message)]
        assert len(ours) == 1, [str(c.message) for c in caught]
        gpu.replay(g)
        if gpu.real:
            assert torch.equal(y, src * 2)
        with pytest.raises(StaleBorrowError):
            kept.sum()
        sanitizer.synchronize()
    assert gpu.hazards() == []
    del w, y


# -- several GPUs ------------------------------------------------------------------------------------------------
def test_a_buffer_on_the_second_gpu_is_checked_there(gpu):
    if gpu.device_count < 2:
        pytest.skip("needs 2 CUDA devices")
    buf = StagingBuffer(1 << 16, device="cuda:1", name="gpu1")
    assert torch.cuda.current_device() == 0
    with sanitizer.sanitize(checksum=1, poison=1):
        w = buf.write(0, gpu.random_bytes(4096, device=1), name="on1")
        o = sanitizer.own(w)
        buf.tensor[7] ^= 1
        buf.write(0, gpu.random_bytes(4096, device=1), name="next")
        with pytest.raises(BorrowCorruptedError, match="'on1'"):
            sanitizer.synchronize()
        assert cuda_hooks.devices.device_of(o) == torch.device("cuda", 1)
        assert torch.cuda.current_device() == 0
    del w, o


# -- what the device check prints ---------------------------------------------------------------------------------
def test_kernel_compile_time_and_registers_are_reported(gpu):
    cuda_hooks.warm()
    info = cuda_hooks.kernel_info()
    print("KERNEL_INFO", info)
    assert info["implementation"]
    if gpu.real:
        assert set(info["registers"]) == {"checksum", "verify", "poison"} and min(info["registers"].values()) > 0
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert all(v >= sms for v in info["resident_blocks"].values())
        assert {"cuda_checksum", "cuda_verify", "cuda_poison"} <= set(info["compile_seconds"])
