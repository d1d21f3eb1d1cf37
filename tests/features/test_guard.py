"""guard=1: a retained stale view reads poison through paths the dispatch mode cannot see."""
from __future__ import annotations

import ctypes
import gc
import math
import threading

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from sanitizer.features import guard
from sanitizer.torch_layer.state import state


def _ctypes_floats(t: torch.Tensor) -> list:
    """Read the bytes behind ``t`` as a C extension would: no aten op, nothing dispatched."""
    return list((ctypes.c_float * t.numel()).from_address(t.data_ptr()))


def test_a_retained_view_reads_nan_not_the_next_tensor_and_is_still_reported():
    buf = StagingBuffer(256, name="ring")
    with sanitizer.sanitize():
        before = guard.stats()
        w = buf.write(0, torch.arange(8, dtype=torch.float32), name="w")
        part = w[2:6]  # a derived view shares the tombstone
        buf.write(0, torch.full((8,), 7.0), name="next")
        assert all(math.isnan(x) for x in _ctypes_floats(w)) and all(math.isnan(x) for x in _ctypes_floats(part))
        assert torch.equal(buf.lend(0, (8,), torch.float32, name="next"), torch.full((8,), 7.0))  # producer untouched
        with pytest.raises(StaleBorrowError, match="'w'"):
            part.sum()
        after = guard.stats()
        assert after["tombstones"] == before["tombstones"] + 1 and after["alive"] == before["alive"] + 1
        assert after["alive_bytes"] - before["alive_bytes"] == 32
        del w, part
        gc.collect()
        assert guard.stats()["alive"] == before["alive"]  # freed with the lease
        assert not state.stale
        if state.ledger.live_count == 0:  # (another test's lease may legitimately live on)
            assert torch._C._len_torch_dispatch_stack() == 0


def test_without_guard_the_same_read_sees_the_next_tensor():
    buf = StagingBuffer(256, name="ring")
    with sanitizer.sanitize(guard=0):
        w = buf.write(0, torch.arange(8, dtype=torch.float32), name="w")
        buf.write(0, torch.full((8,), 7.0), name="next")
        assert _ctypes_floats(w) == [7.0] * 8  # the silent corruption the guard exists for


def test_numpy_over_the_raw_pointer_reads_poison():
    buf = StagingBuffer(256, name="ring")
    with sanitizer.sanitize(halt_on_error=0):
        w = buf.write(0, torch.arange(8, dtype=torch.float32), name="w")
        buf.write(0, torch.full((8,), 7.0), name="next")
        arr = np.frombuffer((ctypes.c_char * 32).from_address(w.data_ptr()), dtype=np.float32)
        assert np.isnan(arr).all()


def test_a_thread_started_before_enable_reads_poison():
    buf = StagingBuffer(256, name="ring")
    go, done = threading.Event(), threading.Event()
    seen = []

    def old_thread():
        go.wait(10)
        seen.extend(_ctypes_floats(box[0]))
        done.set()

    box = []
    t = threading.Thread(target=old_thread)
    t.start()
    with sanitizer.sanitize():
        box.append(buf.write(0, torch.arange(4, dtype=torch.float32), name="w"))
        buf.write(0, torch.full((4,), 7.0), name="next")
        go.set()
        done.wait(10)
    t.join()
    assert len(seen) == 4 and all(math.isnan(x) for x in seen)


def test_close_entombs_held_views_too():
    buf = StagingBuffer(256, name="ring")
    with sanitizer.sanitize():
        w = buf.write(0, torch.arange(4, dtype=torch.float32), name="w")
        buf.close()
        assert all(math.isnan(x) for x in _ctypes_floats(w))


def test_rescue_takes_precedence_and_unheld_views_cost_nothing():
    buf = StagingBuffer(256, name="ring")
    with sanitizer.sanitize(rescue=1):
        made = guard.stats()["tombstones"]
        w = buf.write(0, torch.arange(4, dtype=torch.float32), name="w")
        buf.write(0, torch.full((4,), 7.0), name="next")
        assert torch.equal(w, torch.arange(4, dtype=torch.float32))  # rescued: owned copy, no error
        dropped = buf.write(64, torch.ones(4), name="dropped")
        del dropped
        buf.reuse(64, 16)
        assert guard.stats()["tombstones"] == made


def test_guard_is_listed_with_its_default_on():
    assert sanitizer.options()["guard"] is True


@pytest.mark.skipif(not __import__("sanitizer.torch_layer.storage_handles", fromlist=["x"]).PoisonFile.AVAILABLE,
                    reason="memfd tombstones need Linux")
def test_cpu_tombstones_share_one_poison_file_copy_on_write():
    from sanitizer.torch_layer import storage_handles

    mib = 1 << 20
    ring = sanitizer.StagingRing(4 * mib, name="ring")
    kept = []
    with sanitizer.sanitize():
        for i in range(40):  # every put reuses bytes some kept view still holds
            kept.append(ring.put(f"w{i}", torch.full((mib // 4,), float(i))))
        shared = storage_handles.POISON.nbytes
        assert guard.stats()["alive"] >= 36 and shared <= 2 * mib  # 36+ MiB of tombstones, <= 2 MiB real
    for t in kept[:-4]:
        assert torch.isnan(t).all()
    kept[0].fill_(1.0)  # a write lands in that tombstone's private copy only
    assert torch.isnan(kept[1]).all() and torch.equal(kept[0], torch.ones(mib // 4))
    with sanitizer.sanitize(poison_byte=0):  # another fill byte: another file
        buf = StagingBuffer(64)
        w = buf.write(0, torch.ones(4), name="w")
        buf.write(0, torch.full((4,), 7.0), name="next")
        assert _ctypes_floats(w) == [0.0] * 4
