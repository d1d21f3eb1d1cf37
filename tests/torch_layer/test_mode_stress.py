"""Threads that run an op for the first time at once, under the sanitizer's mode (issue 17).

safetensors' own multithreaded test segfaulted under ``OWNERSHIP_SANITIZE=1`` about 1 run in
10: with a Python mode on the stack, libtorch_python caches a borrowed pointer to each op's
Python object, and two threads building that object at once freed one of them
(sanitizer/torch_layer/op_lookup.py says how). bench/stress.py runs hundreds of these programs;
here a bounded number, and the lock's own behaviour in-process.
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch

import sanitizer
from sanitizer.testing import stress
from sanitizer.torch_layer import op_lookup
from tests.conftest import run_python

_LIB = torch.library.Library("ownsan_lookup_test", "DEF")  # kept alive: its ops live as long as it


def _fresh_op(name: str):
    """A custom op whose overload object torch.ops has not built yet (define builds its packet)."""
    _LIB.define(f"{name}(Tensor x) -> Tensor")
    _LIB.impl(name, lambda x: x * 2, "CompositeExplicitAutograd")
    packet = getattr(torch.ops.ownsan_lookup_test, name)
    assert "default" not in packet.__dict__
    return packet


# -- in fresh processes: the safetensors pattern ------------------------------------------
@pytest.mark.slow
def test_threads_building_op_objects_at_once_under_the_sanitizer_never_crash():
    """Before the fix about half of these runs built an op twice and 1 in 4 crashed (bench/stress.py)."""
    result = stress.run_lookup_race(20, "sanitizer", parallel=2)
    assert result["ok"] == 20, result


@pytest.mark.slow
def test_the_race_program_sees_the_race_when_nothing_prevents_it():
    """The control: the same program under a bare mode without the lock races (so the test above
    can fail). If this starts passing 12 runs in a row, torch may have fixed the race upstream."""
    result = stress.run_lookup_race(12, "bare-skip", parallel=2)
    assert result["nothing_to_race"] == 0, result
    assert result["crashed"] + result["raced"] > 0, result


def test_run_lookup_race_rejects_a_bad_variant_naming_it():
    with pytest.raises(ValueError, match="'nope'"):
        stress.run_lookup_race(1, "nope")
    with pytest.raises(ValueError, match="at least 1, got 0"):
        stress.run_lookup_race(0)


# -- the lock itself -------------------------------------------------------------------------
@pytest.mark.slow
def test_the_lock_is_installed_with_the_first_mode_and_not_before():
    code = r"""
import threading, torch, sanitizer
from sanitizer.torch_layer import interception, op_lookup
print("imported", op_lookup.serialized())  # off means off: importing patches nothing in torch
sanitizer.enable()
print("enabled", op_lookup.serialized())  # no mode of ours anywhere yet
t = threading.Thread(target=lambda: torch.ones(2) + 1); t.start(); t.join()
print("thread", op_lookup.serialized(), "lazy", interception.MODES.lazy_workers)
buf = sanitizer.StagingBuffer(64, name="b")
w = buf.lend(0, (4,), torch.float32, name="w")
buf.reuse(0, 16, by="next")  # a stale lease: every thread checks now (3.11+ re-arms running ones)
t = threading.Thread(target=lambda: torch.ones(2) + 1); t.start(); t.join()
print("stale", op_lookup.serialized())
"""
    proc = run_python(code, timeout=60)
    out = proc.stdout.split()
    # On 3.10 a worker started while enabled carries a mode for its life; on 3.11+ it carries one only
    # while something is stale (issue 33): the lock comes with the first mode either way.
    lazy = "lazy" in out and out[out.index("lazy") + 1] == "True"
    assert out == ["imported", "False", "enabled", "False", "thread", str(not lazy), "lazy", str(lazy),
                   "stale", "True"], proc.stderr[-2000:]


def test_a_lookup_that_waits_for_another_returns_the_object_that_one_built():
    op_lookup.serialize_op_lookups()
    packet = _fresh_op("waits")
    got = []
    with op_lookup._lock:  # another thread is building an op object
        t = threading.Thread(target=lambda: got.append(packet.default))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got  # it waits instead of building a second object
        mine = packet.default  # the builder's own lookup (re-entrant)
    t.join(10)
    assert got == [mine] and got[0] is mine
    assert packet.default is mine  # and that is the one torch.ops keeps


def test_threads_racing_for_a_new_op_under_our_mode_all_get_the_one_torch_ops_keeps():
    """What a user mode compares with ``func is torch.ops...``: one object per op, in every thread."""
    sanitizer.enable()
    packet = _fresh_op("racing")
    seen, barrier = [], threading.Barrier(4)

    def worker():
        barrier.wait()
        assert torch.equal(packet.default(torch.ones(3)), torch.full((3,), 2.0))
        seen.append(packet.default)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker) for _ in range(4)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
    finally:
        sys.setswitchinterval(interval)
    assert len(seen) == 4 and all(s is packet.default for s in seen)


def test_lookups_behave_as_before_behind_the_lock():
    op_lookup.serialize_op_lookups()
    packet = _fresh_op("behaves")
    assert packet.default._schema.name == "ownsan_lookup_test::behaves"
    with pytest.raises(AttributeError, match="no overload name 'nope'"):
        packet.nope
    assert not hasattr(torch.ops.aten, "no_such_op_ownsan")
    assert torch.ops.aten.add.Tensor is torch.ops.aten.add.Tensor
    op_lookup.serialize_op_lookups()  # idempotent: the lock is not wrapped twice
    original = torch._ops.OpOverloadPacket.__getattr__.__wrapped__
    assert original.__module__ == "torch._ops" and not hasattr(original, "__wrapped__")


@pytest.mark.slow
def test_a_child_forked_while_a_thread_held_the_lock_can_still_look_ops_up():
    code = r"""
import os, signal, threading, torch
from sanitizer.torch_layer import op_lookup
op_lookup.serialize_op_lookups()
held, release = threading.Event(), threading.Event()
def holder():
    with op_lookup._lock:
        held.set(); release.wait(30)
t = threading.Thread(target=holder); t.start(); held.wait(30)
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a child stuck on the parent's held lock dies instead of hanging the test
    torch.ops.aten._conj_physical.default  # built behind the lock, in the child
    os._exit(0)
_, status = os.waitpid(pid, 0)
release.set(); t.join()
print("child", os.waitstatus_to_exitcode(status))
"""
    proc = run_python(code, timeout=60)
    assert proc.returncode == 0 and "child 0" in proc.stdout, proc.stderr[-2000:]
