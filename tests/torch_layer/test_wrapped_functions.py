"""A function the sanitizer wraps (readers, exporters) behaves as the original for what a user does with it
(issue 46, points 3 and 4): pickling, copying, ``inspect``, ``repr``, and identity once the sanitizer lets go;
a user's patch-and-restore around a lend never stacks wrappers."""
from __future__ import annotations

import copy
import functools
import gc
import inspect
import pickle
from unittest import mock

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import sanitizer
from sanitizer.torch_layer import readers


def _wrapped_targets():
    return [(owner, name) for owner, name, _where, _kind in readers._targets()]


def _pickled(obj) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def test_every_wrapped_function_behaves_as_the_original_for_introspection():
    """Pickling, copying, inspect, repr and names, for every function the readers wrap, while wrapped; and each
    is the original object again after disable()."""
    originals = {(id(o), n): (o, n, o.__dict__[n] if n in vars(o) else getattr(o, n)) for o, n in _wrapped_targets()}
    pickled = {}
    for key, (_owner, _name, original) in originals.items():  # (while nothing is wrapped)
        try:
            pickled[key] = _pickled(original)
        except Exception:  # not picklable to begin with: nothing to keep
            pass
    buf = sanitizer.StagingBuffer(256, name="intro")
    w = buf.write(0, torch.ones(4), name="w")
    buf.reuse(0, 16, by="next")  # a stale lease: every reader is wrapped
    problems = []
    with sanitizer.sanitize():
        assert readers.hooked()
        for key, (owner, name, original) in originals.items():
            now = getattr(owner, name)
            label = f"{getattr(owner, '__name__', owner)}.{name}"
            if now is original:
                problems.append(f"{label}: not wrapped")
                continue
            if key in pickled:
                try:
                    data = _pickled(now)
                except Exception as err:
                    problems.append(f"{label}: pickling raised {err!r}")
                else:
                    loaded = pickle.loads(data)  # (here: what its name finds now, maybe our wrapper of it)
                    if data != pickled[key] and inspect.unwrap(loaded) is not original:
                        problems.append(f"{label}: pickles as {loaded!r}")
            if copy.copy(now) is not now or copy.deepcopy(now) is not now:
                problems.append(f"{label}: copies as something else")
            for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
                if getattr(original, attr, None) != getattr(now, attr, None):
                    problems.append(f"{label}: {attr} differs")
            if repr(now) != repr(original):
                problems.append(f"{label}: repr differs")
            try:
                want = inspect.signature(original)
            except (TypeError, ValueError):
                want = None
            if want is not None and inspect.signature(now) != want:
                problems.append(f"{label}: signature differs")
            if inspect.unwrap(now) is not original:
                problems.append(f"{label}: __wrapped__ is not the original")
    del w
    buf.close()
    gc.collect()
    for owner, name, original in originals.values():
        current = owner.__dict__[name] if name in vars(owner) else getattr(owner, name)
        if current is not original:
            problems.append(f"{owner}.{name}: not the original after disable()")
    assert problems == []


@pytest.mark.slow  # a child process that imports torch (>= 1 s of CPU): the full run's, as pyproject's marker says
def test_pool_map_of_torch_from_numpy_works_while_a_lease_is_alive():
    import multiprocessing

    arrays = [np.full(4, float(i), dtype=np.float32) for i in range(4)]
    with sanitizer.sanitize():
        buf = sanitizer.StagingBuffer(256, name="pool")
        w = buf.write(0, torch.ones(4), name="w")  # a lease is alive: the makers are wrapped
        assert isinstance(torch.from_numpy, readers._Wrapper)
        with multiprocessing.get_context("spawn").Pool(2) as pool:
            out = pool.map(torch.from_numpy, arrays)
        del w
        buf.close()
    assert [float(t[0]) for t in out] == [0.0, 1.0, 2.0, 3.0]


def _patch_restore_cycles(n: int, patcher) -> dict:
    """``n`` cycles of: a buffer lends, the user patches ``torch.from_numpy`` (LIFO restore), the lease dies
    and the buffer closes inside the patch (the sanitizer lets go while the user's patch covers its wrapper),
    the patch is restored."""
    original = torch.from_numpy
    a = np.ones(3, dtype=np.float32)
    with sanitizer.sanitize():
        for i in range(n):
            buf = sanitizer.StagingBuffer(4096, name="cycle")
            w = buf.lend(0, (16,), torch.float32, name=f"t{i}")
            with patcher(original):
                torch.from_numpy(a)
                del w
                buf.close()
            torch.from_numpy(a)  # the user's own function again (or ours, passing through and putting it back)
        made = max((len(v) for k, v in readers._WRAPPED.items() if k[1] == "from_numpy"), default=0)
        inside = torch.from_numpy is original
    return {"wrappers_of_from_numpy": made, "original_while_enabled": inside,
            "original_after_disable": torch.from_numpy is original}


def _mock_patch(original):
    return mock.patch("torch.from_numpy", side_effect=original)


def _monkeypatch(original):
    import contextlib

    @contextlib.contextmanager
    def patched():
        mp = pytest.MonkeyPatch()
        mp.setattr(torch, "from_numpy", functools.wraps(original)(lambda *a, **k: original(*a, **k)))
        try:
            yield
        finally:
            mp.undo()

    return patched()


@pytest.mark.parametrize("patcher", [_mock_patch, _monkeypatch], ids=["mock.patch", "monkeypatch"])
def test_patch_and_restore_cycles_around_a_lend_never_stack_wrappers(patcher):
    out = _patch_restore_cycles(1_500, patcher)  # (about 1,000 cycles reached RecursionError before)
    assert out == {"wrappers_of_from_numpy": 1, "original_while_enabled": True, "original_after_disable": True}


@pytest.mark.slow
def test_ten_thousand_patch_restore_cycles_leave_torch_from_numpy_the_users():
    out = _patch_restore_cycles(10_000, _mock_patch)
    assert out == {"wrappers_of_from_numpy": 1, "original_while_enabled": True, "original_after_disable": True}


def test_a_users_wrapper_over_ours_keeps_working_and_ours_passes_through_once_we_let_go():
    original = torch.from_numpy
    a = np.ones(3, dtype=np.float32)
    with sanitizer.sanitize():
        buf = sanitizer.StagingBuffer(256, name="chain")
        w = buf.lend(0, (4,), torch.float32, name="w")
        ours = torch.from_numpy
        assert isinstance(ours, readers._Wrapper)
        calls = []

        @functools.wraps(ours)
        def users(*args, **kwargs):
            calls.append(1)
            return ours(*args, **kwargs)

        torch.from_numpy = users  # a user's patch that is never restored
        try:
            del w
            buf.close()  # the sanitizer lets go: its wrapper stays under the user's, passing through
            assert torch.from_numpy is users
            assert torch.equal(torch.from_numpy(a), torch.ones(3))
            buf2 = sanitizer.StagingBuffer(256, name="chain2")
            w2 = buf2.lend(0, (4,), torch.float32, name="w2")  # wanted again: ours, found under the user's
            assert torch.from_numpy is users and readers._ACTIVE[(id(torch), "from_numpy")] is ours
            del w2
            buf2.close()
        finally:
            torch.from_numpy = original
    assert calls and torch.from_numpy is original


def test_a_users_mock_is_left_alone_and_configurable():
    """A ``mock.patch`` in place when a lend happens: the real function is not called through it, so it is not
    wrapped; ``torch.from_numpy is m`` and ``m.return_value = ...`` keep working."""
    with mock.patch("torch.from_numpy") as m:
        with sanitizer.sanitize():
            buf = sanitizer.StagingBuffer(256, name="mocked")
            w = buf.lend(0, (4,), torch.float32, name="w")
            assert torch.from_numpy is m
            torch.from_numpy.return_value = 7
            assert torch.from_numpy(np.ones(2)) == 7 and m.call_count == 1
            del w
            buf.close()


def test_writes_to_a_wrapped_function_reach_the_function():
    """A user's own stand-in (not a mock) is wrapped while a lease is alive: an attribute set through the
    attribute lands on their function, as it would without the sanitizer."""
    def stand_in(*args, **kwargs):
        return "stand-in"

    with mock.patch("torch.from_numpy", stand_in):
        with sanitizer.sanitize():
            buf = sanitizer.StagingBuffer(256, name="stand-in")
            w = buf.lend(0, (4,), torch.float32, name="w")
            assert isinstance(torch.from_numpy, readers._Wrapper)
            torch.from_numpy.calls = 3
            assert stand_in.calls == 3
            del torch.from_numpy.calls
            assert not hasattr(stand_in, "calls")
            del w
            buf.close()


def test_the_sanitizers_own_memory_never_goes_through_the_users_patch():
    """``StagingBuffer()``, ``StagingRing()`` and a lend call torch's own ``numpy``/``from_numpy``, not the
    attributes a user may have patched (a counting spy saw the sanitizer's calls as the program's)."""
    calls = []
    real_numpy, real_from_numpy = torch.Tensor.numpy, torch.from_numpy

    def numpy_spy(self, *args, **kwargs):
        calls.append("numpy")
        return real_numpy(self, *args, **kwargs)

    def from_numpy_spy(*args, **kwargs):
        calls.append("from_numpy")
        return real_from_numpy(*args, **kwargs)

    with mock.patch.object(torch.Tensor, "numpy", numpy_spy), mock.patch("torch.from_numpy", from_numpy_spy):
        for enabled in (False, True):
            if enabled:
                sanitizer.enable()
            try:
                buf = sanitizer.StagingBuffer(1024, name="own")
                ring = sanitizer.StagingRing(1024, name="own-ring")
                w = buf.write(0, torch.ones(4), name="w")
                v = ring.put("v", torch.ones(4))
                buf.reuse(0, 16, by="next")
                del w, v
                buf.close()
                ring.close()
            finally:
                sanitizer.disable()
    assert calls == []


def test_enable_and_disable_take_off_a_wrapper_a_users_restore_put_back():
    """The user's patch spans the sanitizer letting go (ours stays under theirs, passing through); their restore
    puts ours back on top: the next enable, disable or buffer close takes it off."""
    original = torch.from_numpy
    with sanitizer.sanitize():
        buf = sanitizer.StagingBuffer(256, name="spans")
        w = buf.lend(0, (4,), torch.float32, name="w")
        patch = mock.patch("torch.from_numpy", lambda *a, **k: "user")
        patch.start()
        del w
        buf.close()
    patch.stop()
    assert isinstance(torch.from_numpy, readers._Wrapper)  # (no call, no sanitizer call since the restore)
    sanitizer.disable()
    assert torch.from_numpy is original
