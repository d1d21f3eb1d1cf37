"""Issue 11, adversarial inputs: one class per problem class.

Errors that travel (pickle, copy, a process boundary, TorchScript, no tensor kept alive); the
production path at any depth; poison that never destroys user data; staging false alarms (zero-byte
ranges, a collected buffer object); bad input refused with the value named, and failing calls that
leave every lease as it was; rescue records that stay bounded.
"""
from __future__ import annotations

import collections
import concurrent.futures
import copy
import gc
import inspect
import io
import multiprocessing
import os
import pickle
import types
from typing import Any, List

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StagingBuffer, StagingRing, StaleBorrowError
from sanitizer.features import holders as holders_mod
from sanitizer.torch_layer import hooks
from sanitizer.core.ledger import Ledger
from sanitizer.core.options import OptionError, parse_options_string, resolve
from sanitizer.features import rescue, triage
from sanitizer.torch_layer import records, script_calls
from sanitizer.torch_layer.iterators import borrowed_iterator
from sanitizer.torch_layer.state import state


def _stale_error(name: str = "w", **options: Any) -> StaleBorrowError:
    buf = StagingBuffer(1024, name="travel")
    w = buf.lend(0, (4, 4), torch.float32, name=name)
    buf.reuse(0, 16, by="next")
    with sanitizer.sanitize(**options):
        with pytest.raises(StaleBorrowError) as info:
            w.sum()
    return info.value


def _raise_stale_in_child() -> None:
    """Runs in a spawned worker: a real stale use, raised out of the process."""
    buf = StagingBuffer(1024, name="child")
    w = buf.lend(0, (4, 4), torch.float32, name="child_w")
    buf.reuse(0, 16, by="child_next")
    with sanitizer.sanitize():
        w.sum()


Point = collections.namedtuple("Point", "x y")


class TestErrorsTravel:
    def test_pickle_round_trip_keeps_the_text_and_the_record(self):
        err = _stale_error()
        text = str(err)
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is StaleBorrowError and isinstance(back, sanitizer.OwnershipError)
        assert str(back) == text and back.args == (text,)
        assert back.record == err.record and back.summary == err.summary and back.op == "aten.sum.default"
        # the live ledger objects stay behind; snapshots of their records arrive
        assert back.lease.name == "w" and back.lease.dtype == "float32" and back.lease.shape == (4, 4)
        assert back.lease.region_name == "travel" and (back.lease.start, back.lease.end) == (0, 64)
        assert back.event.by == "next" and back.event.kind == "reuse"
        assert back.lease.describe() == err.lease.describe() and back.event.describe() == err.event.describe()
        assert back.used_at == ()

    def test_copy_and_deepcopy(self):
        err = _stale_error()
        for clone in (copy.copy(err), copy.deepcopy(err)):
            assert type(clone) is StaleBorrowError and str(clone) == str(err)
            assert clone.lease is err.lease and clone.event is err.event  # ledger identities are shared
        deep = copy.deepcopy(err)
        assert deep.record == err.record and deep.record is not err.record

    def test_every_ownership_error_pickles(self):
        led = Ledger()
        region = led.add_region("r", "cpu", 0x1000, 256)
        lease = led.lend(region.region_id, 0, 16, "w", "float32", (4,))
        corrupted = sanitizer.BorrowCorruptedError(lease, 1, 2, "verify", ())
        plain = sanitizer.OwnershipError("plain text")
        for err in (corrupted, plain):
            back = pickle.loads(pickle.dumps(err))
            assert type(back) is type(err) and str(back) == str(err)
        assert pickle.loads(pickle.dumps(corrupted)).lease.name == "w"
        assert copy.deepcopy(corrupted).found == 2

    @pytest.mark.slow
    def test_survives_a_process_pool_boundary(self):
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
            future = pool.submit(_raise_stale_in_child)
            with pytest.raises(StaleBorrowError) as info:
                future.result(timeout=120)
        err = info.value
        assert str(err).startswith("borrowed view 'child_w' float32[4, 4] used after staging buffer 'child' "
                                   "reused bytes [0x0, 0x10) for 'child_next'")
        assert err.lease.name == "child_w" and err.record["kind"] == "stale_use"
        assert err.record["pid"] != os.getpid()

    @pytest.mark.filterwarnings("ignore:.*torch.jit.script.*:DeprecationWarning")
    def test_torchscript_surfaces_the_report_text(self):
        @torch.jit.script
        def scripted(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @torch.jit.script
        def reshaped(x: torch.Tensor) -> torch.Tensor:
            return x.view(3, 5)

        class Doubler(torch.nn.Module):
            def forward(self, x):
                return x * 2

        module = torch.jit.script(Doubler())
        buf = StagingBuffer(1024, name="jit")
        w = buf.lend(0, (4,), torch.float32, name="jit_w")
        buf.reuse(0, 16, by="next")
        with sanitizer.sanitize():
            for call in (scripted, module):
                with pytest.raises(StaleBorrowError) as info:
                    call(w)
                text = str(info.value)
                assert text.startswith("borrowed view 'jit_w' float32[4] used after staging buffer 'jit'")
                assert "aten.mul" in text
                assert "TorchScript" in str(info.value.__cause__)  # where in the script, chained
            assert torch.equal(scripted(torch.ones(2)), torch.full((2,), 2.0))  # fresh tensors: untouched
            with pytest.raises(RuntimeError, match="invalid for input of size 4") as other:
                reshaped(torch.ones(4))  # an error of the script's own keeps its text, never turned into ours
            assert not isinstance(other.value, sanitizer.OwnershipError)
            assert script_calls.hooked()
        scripted(torch.ones(2))  # the first scripted call after disable() takes the wrapper away
        assert not script_calls.hooked()

    @pytest.mark.filterwarnings("ignore:.*torch.jit.script.*:DeprecationWarning")
    def test_torchscript_keeps_the_text_of_an_ops_own_error_under_the_mode(self):
        @torch.jit.script
        def reshaped(x: torch.Tensor) -> torch.Tensor:
            return x.view(3, 5)

        buf = StagingBuffer(1024, name="jit2")
        w = buf.lend(0, (4,), torch.float32, name="w")
        buf.reuse(0, 16, by="next")  # a stale lease: the mode scans every op
        with sanitizer.sanitize():
            with pytest.raises(RuntimeError, match="invalid for input of size 4"):
                reshaped(torch.ones(4))
        del w

    def test_the_error_holds_no_tensor_and_no_frame(self):
        err = _stale_error()
        seen, todo, found = set(), [err.__dict__], []
        while todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, (types.CodeType, types.ModuleType, type)):
                continue
            seen.add(id(obj))
            if isinstance(obj, (torch.Tensor, torch.UntypedStorage, types.FrameType, types.TracebackType)):
                found.append(type(obj).__name__)
            todo.extend(gc.get_referents(obj))
        assert found == []

    def test_a_dropped_error_frees_the_view_without_the_cyclic_gc(self):
        gc.disable()
        try:
            buf = StagingBuffer(1024, name="cycle")
            w = buf.lend(0, (4,), torch.float32, name="w")
            lease = sanitizer.lease_of(w)
            buf.reuse(0, 16, by="next")
            with sanitizer.sanitize():
                try:
                    w.sum()
                except StaleBorrowError:
                    pass
            del w
            assert not lease.alive
        finally:
            gc.enable()

    def test_a_kept_error_does_not_keep_the_view_alive(self):
        gc.disable()
        try:
            buf = StagingBuffer(1024, name="kept")
            w = buf.lend(0, (4,), torch.float32, name="w")
            lease = sanitizer.lease_of(w)
            buf.reuse(0, 16, by="next")
            kept: List[BaseException] = []
            with sanitizer.sanitize():
                try:
                    w.sum()
                except StaleBorrowError as e:
                    kept.append(e)
            del w
            assert not lease.alive and "used after" in str(kept[0])
        finally:
            gc.enable()

    def test_names_the_holder_a_stale_use_hook_returns(self, monkeypatch):
        holder = {"kind": "global", "path": "consumer.cache['w']", "site": {"file": "c.py", "line": 3,
                                                                           "function": "<module>"}}
        seen = []

        def hook(lease, use):
            seen.append((lease.name, use.op))
            return holder

        monkeypatch.setattr(hooks.HOOKS, "stale_use", [hook])  # the slot, with only this hook in it
        buf = StagingBuffer(1024, name="held")
        w = buf.lend(0, (4,), torch.float32, name="w")
        buf.reuse(0, 16, by="next")
        with sanitizer.sanitize():
            with pytest.raises(StaleBorrowError) as info:
                w.sum()
        err = info.value
        assert seen == [("w", "aten.sum.default")]  # asked once, before the error was built
        text = str(err)
        assert text.splitlines()[1] == "  held by global consumer.cache['w'] (<module> c.py:3)"
        assert err.record["holder"] == holder and err.args == (text,)
        assert pickle.loads(pickle.dumps(err)).holder == holder

    def test_building_printing_and_pickling_an_error_walks_nothing(self, monkeypatch):
        """Errors are inert values: once built, nothing they do reaches the holder walk or triage."""
        cache = {}
        buf = StagingBuffer(1024, name="inert")
        with sanitizer.sanitize():
            cache["w"] = buf.lend(0, (4,), torch.float32, name="w")
            buf.reuse(0, 16, by="next")
            buf.lend(64, (4,), torch.float32, name="after")
            with pytest.raises(StaleBorrowError) as info:
                cache["w"].sum()
        err = info.value

        def refuse(*args, **kwargs):
            raise AssertionError("an error walked the heap")

        for target in (holders_mod, triage):
            monkeypatch.setattr(target, "find_holders", refuse)
        monkeypatch.setattr(holders_mod, "replay", refuse)
        monkeypatch.setattr(hooks.HOOKS, "stale_use", [refuse])
        text = str(err)
        again = StaleBorrowError(err.lease, err.event, err.op, err.used_at, err.used_as, holder=err.holder)
        assert str(again) == text and "held by" in text
        assert str(pickle.loads(pickle.dumps(err))) == text and str(copy.deepcopy(err)) == text

    def test_names_the_real_holder_through_triage(self):
        cache = {}
        buf = StagingBuffer(1024, name="triaged")
        with sanitizer.sanitize():
            cache["w"] = buf.lend(0, (4,), torch.float32, name="w")
            buf.reuse(0, 16, by="next")
            buf.lend(64, (4,), torch.float32, name="after")  # the consumer had its turn
            with pytest.raises(StaleBorrowError) as info:
                cache["w"].sum()
        assert "held by" in str(info.value) and "cache" in str(info.value)


class TestOwnArgumentsAtAnyDepth:
    @staticmethod
    def _loader(param, *args, **kwargs):
        pass

    def test_owns_borrowed_tensors_everywhere_and_keeps_container_types(self):
        buf = StagingBuffer(1 << 12, name="deep")
        lent = [buf.write(64 * i, torch.full((4,), float(i)), name=f"w{i}") for i in range(7)]
        plain = torch.ones(3)
        param = torch.nn.Parameter(torch.zeros(4))
        od = collections.OrderedDict(first=lent[5], second=plain)
        dd = collections.defaultdict(list, {"k": [lent[6]]})
        untouched = [plain, (plain,), {"p": plain}]
        bound = inspect.signature(self._loader).bind(
            param, [lent[0], plain], (lent[1], [lent[2], {"deep": (lent[3],)}]),
            nt=Point(lent[4], plain), od=od, dd=dd, same=untouched, again=lent[0])
        before = bound.arguments["args"]
        sanitizer.own_arguments(bound)
        args, kwargs = bound.arguments["args"], bound.arguments["kwargs"]
        assert bound.arguments["param"] is param and args is not before
        assert type(args) is tuple and type(args[0]) is list and type(args[1]) is tuple
        assert type(args[1][1]) is list and type(args[1][1][1]) is dict and type(args[1][1][1]["deep"]) is tuple
        assert type(kwargs["nt"]) is Point and type(kwargs["od"]) is collections.OrderedDict
        assert list(kwargs["od"]) == ["first", "second"] and type(kwargs["dd"]) is collections.defaultdict
        assert kwargs["dd"].default_factory is list
        owned = [args[0][0], args[1][0], args[1][1][0], args[1][1][1]["deep"][0], kwargs["nt"].x,
                 kwargs["od"]["first"], kwargs["dd"]["k"][0]]
        assert all(not sanitizer.is_borrowed(t) for t in owned)
        # tensors that are not borrowed are never copied; containers without a borrowed tensor are kept
        assert args[0][1] is plain and kwargs["nt"].y is plain and kwargs["od"]["second"] is plain
        assert kwargs["same"] is untouched
        assert kwargs["again"] is args[0][0]  # one tensor passed twice: one copy
        for i in range(7):
            buf.reuse(64 * i, 16, by="next")  # the loader reuses its bytes: owned values stay
        assert [float(t[0]) for t in owned] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert before[0][0] is lent[0]  # the caller's own containers are not mutated

    def test_a_container_holding_itself_does_not_recurse_forever(self):
        buf = StagingBuffer(256)
        w = buf.lend(0, (4,), torch.float32, name="w")
        loop: list = [w]
        loop.append(loop)
        bound = inspect.signature(self._loader).bind(None, loop)
        sanitizer.own_arguments(bound)
        out = bound.arguments["args"][0]
        assert not sanitizer.is_borrowed(out[0])

    def test_deferral_scope_verifies_and_counts_nested_tensors(self):
        buf = StagingBuffer(1024)
        w = buf.write(0, torch.ones(4), name="w")
        with sanitizer.DeferralScope("layer", policy=None) as scope:
            bound = inspect.signature(self._loader).bind(None, [{"w": w}])
            buf.reuse(0, 16, by="next")
            with sanitizer.sanitize(checksum=1):
                with pytest.raises(StaleBorrowError):
                    scope.defer(bound)


class TestPoisonTouchesOnlyOwnedMemory:
    def test_borrowed_iterator_over_a_state_dict_never_overwrites_it(self):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        state = model.state_dict()
        before = {k: v.clone() for k, v in state.items()}
        target = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        params = dict(target.named_parameters())
        with sanitizer.sanitize(poison=1, checksum=1):
            for name, t in borrowed_iterator(state.items(), lifetime=1):
                params[name].data.copy_(t)
        assert sanitizer.errors() == []
        assert all(torch.equal(state[k], before[k]) for k in state)  # no NaN in the user's weights
        assert all(torch.equal(params[k], before[k]) for k in params)

    def test_an_adopted_buffer_is_never_poisoned_an_allocated_one_is(self):
        mine = torch.full((64,), 7.0)
        adopted = StagingBuffer.adopt(mine, name="theirs")
        own = StagingBuffer(256, name="ours")
        with sanitizer.sanitize(poison=1):
            kept_a = adopted.lend(0, (16,), torch.float32, name="a")
            kept_b = own.write(0, torch.full((16,), 7.0), name="b")
            adopted.retire(0, 64)
            own.retire(0, 64)
        assert torch.equal(mine, torch.full((64,), 7.0))
        assert torch.isnan(own.tensor[:64].view(torch.float32)).all()
        del kept_a, kept_b


class TestStagingFalseAlarms:
    def test_a_zero_byte_reuse_or_write_inside_a_lease_stales_nothing(self):
        buf = StagingBuffer(256, name="zero")
        w = buf.write(0, torch.arange(16.0), name="w")
        lease = sanitizer.lease_of(w)
        buf.reuse(8, 0, by="nothing")
        buf.retire(8, 0)
        empty = buf.write(8, b"", name="empty")
        buf.write(0, torch.zeros(0), name="empty tensor")
        assert not lease.stale and empty.numel() == 0
        with sanitizer.sanitize():
            assert float(w.sum()) == 120.0
        assert sanitizer.errors() == []

    def test_the_ledger_zero_byte_ranges_overlap_nothing(self):
        led = Ledger()
        region = led.add_region("r", "cpu", 0x1000, 256)
        lease = led.lend(region.region_id, 0, 64, "w", "uint8", (64,))
        empty = led.lend(region.region_id, 32, 32, "e", "uint8", (0,))
        for start in (0, 10, 63, 64):
            _, victims = led.reuse(region.region_id, start, start, "nothing")
            assert victims == []
        _, victims = led.reuse(region.region_id, 0, 256, "all")
        assert victims == [lease] and not empty.stale  # a zero-byte lease holds no byte to overwrite
        assert led.overlapping(region.region_id, 16, 16, include_stale=True) == []

    def test_the_ledger_forgets_an_orphaned_region_with_its_last_lease(self):
        led = Ledger()
        region = led.add_region("r", "cpu", 0x1000, 256)
        lease = led.lend(region.region_id, 0, 64, "w", "uint8", (64,))
        led.orphan(region.region_id)
        assert not lease.stale and region.closed and region.orphaned
        assert led.region_containing("cpu", 0x1010) is region  # still found by address while a view lives
        with pytest.raises(ValueError, match="closed"):
            led.lend(region.region_id, 64, 128, "late", "uint8", (64,))
        led.release(lease.lease_id)
        assert led.region_containing("cpu", 0x1010) is None and led.regions() == []
        idle = led.add_region("idle", "cpu", 0x9000, 64)
        led.orphan(idle.region_id)  # no lease: forgotten at once
        assert led.regions() == [] and led.region_containing("cpu", 0x9000) is None

    def test_zero_byte_put_in_a_ring_stales_nothing(self):
        ring = StagingRing(256, name="zring")
        a = ring.put("a", torch.ones(8))
        ring.put("none", b"")
        with sanitizer.sanitize():
            assert float(a.sum()) == 8.0

    def test_a_collected_buffer_object_leaves_its_views_valid(self):
        v = StagingBuffer(64, name="dropped").lend(0, (4,), torch.float32, name="v")
        v.fill_(2.0)
        gc.collect()
        lease = sanitizer.lease_of(v)
        assert lease is not None and not lease.stale and sanitizer.is_borrowed(v)
        with sanitizer.sanitize():
            assert float(v.sum()) == 8.0
        assert sanitizer.errors() == []
        region_id = lease.region_id
        del v
        gc.collect()
        assert not lease.alive
        assert all(r.region_id != region_id for r in state.ledger.regions())  # forgotten with its last view


def _greedy_reader():
    class Greedy:
        def read(self, n):
            return b"\x01" * (n + 10)
    return Greedy()


class TestBadInputNamesTheValue:
    @pytest.mark.parametrize("call,exc,match", [
        (lambda b: b.lend(0, (4,), np.float32), TypeError, r"dtype must be a torch.dtype, got .*float32.*torch.float32"),
        (lambda b: b.lend(0, (4,), np.dtype("float16")), TypeError, r"got dtype\('float16'\).*torch.float16"),
        (lambda b: b.lend(0, (True, 4), torch.float32), TypeError, r"\(True, 4\).*True is a bool, not a dimension"),
        (lambda b: b.lend(0, [4, False], torch.float32), TypeError, r"False is a bool"),
        (lambda b: b.reuse(10, -5), ValueError, r"nbytes must be >= 0, got -5"),
        (lambda b: b.retire(10, -1), ValueError, r"nbytes must be >= 0, got -1"),
        (lambda b: b.write(0, torch.eye(3).to_sparse()), ValueError, r"sparse_coo tensor.*to_dense"),
        (lambda b: b.write(0, torch.randn(3, dtype=torch.complex64).conj()), ValueError, r"conjugate view.*resolve_conj"),
        (lambda b: b.write(0, torch.randn(3, dtype=torch.complex64).conj().imag), ValueError, r"negative view.*resolve_neg"),
        (lambda b: b.write(0, torch.empty(3, device="meta")), ValueError, r"meta tensor"),
        (lambda b: b.write(0, _greedy_reader(), shape=(4,)), ValueError, r"read\(4\) returned 14 bytes, more than asked"),
        (lambda b: b.write(0, io.BytesIO(b"12"), shape=(4,)), ValueError, r"file ended after 2 of 4 bytes"),
        (lambda b: b.write(0, b"1234", dtype=np.int8), TypeError, r"dtype must be a torch.dtype"),
        (lambda b: StagingBuffer.adopt(torch.eye(3).to_sparse()), ValueError, r"cannot adopt a sparse_coo tensor"),
    ])
    def test_buffer_calls(self, call, exc, match):
        with pytest.raises(exc, match=match):
            call(StagingBuffer(1024, name="bad"))

    @pytest.mark.parametrize("source", [torch.eye(3).to_sparse(), torch.randn(3, dtype=torch.complex64).conj()])
    def test_ring_put(self, source):
        with pytest.raises(ValueError, match="sparse|conjugate"):
            StagingRing(1024).put("x", source)

    @pytest.mark.parametrize("raw", ["", " "])
    def test_an_empty_option_value_is_refused_by_name(self, raw):
        for name in ("halt_on_error", "stack_depth", "poison_byte"):
            with pytest.raises(OptionError, match=f"option '{name}': empty value"):
                resolve({name: raw})
        with pytest.raises(OptionError, match="option 'halt_on_error': empty value"):
            resolve(parse_options_string("halt_on_error="))
        assert resolve({"report": raw})["report"] == raw  # a text option may be empty: no report file

    def test_every_failing_call_leaves_every_lease_as_it_was(self):
        buf = StagingBuffer(1024, name="keep")
        w = buf.write(0, torch.arange(64.0), name="w")  # bytes [0, 256)
        lease, generation = sanitizer.lease_of(w), buf.generation
        failing = [
            lambda: buf.write(0, io.BytesIO(b"\0" * 8), shape=(64,), dtype=torch.float32),  # file too short
            lambda: buf.write(0, _greedy_reader(), shape=(8,)),  # read returns too much
            lambda: buf.write(2, torch.ones(4)),  # misaligned float32
            lambda: buf.write(0, torch.ones(4), dtype=torch.float16),  # dtype disagrees
            lambda: buf.write(1020, torch.ones(4)),  # out of bounds
            lambda: buf.write(0, torch.eye(3).to_sparse()),
            lambda: buf.write(0, b"123", shape=(2,)),
            lambda: buf.reuse(0, -4),
            lambda: buf.lend(0, (True,), torch.float32),
        ]
        for call in failing:
            with pytest.raises((ValueError, TypeError)):
                call()
            assert not lease.stale and buf.generation == generation
        assert torch.equal(w, torch.arange(64.0))

    def test_a_failing_put_leaves_the_ring_and_its_leases_as_they_were(self):
        with sanitizer.sanitize(quarantine=1):
            ring = StagingRing(512, name="q")
            a = ring.put("a", torch.ones(16))
            position = (ring.segment, ring.head, ring.wraps, len(ring.segments))
            for bad in (lambda: ring.put("short", io.BytesIO(b"\0" * 4), shape=(16,), dtype=torch.float32),
                        lambda: ring.put("huge", torch.zeros(1000)),
                        lambda: ring.put("sparse", torch.eye(2).to_sparse()),
                        lambda: ring.put("bad", torch.ones(2), dtype=torch.int8)):
                with pytest.raises(ValueError):
                    bad()
                assert not sanitizer.lease_of(a).stale  # the quarantine did not retire 'a' for a put that failed
                assert (ring.segment, ring.head, ring.wraps, len(ring.segments)) == position
            assert float(a.sum()) == 16.0
            ring.put("b", torch.ones(4))
            assert sanitizer.lease_of(a).stale  # a put that succeeds retires it, as before

    def test_a_ring_aligns_to_the_element_size(self):
        ring = StagingRing(256, alignment=1)
        ring.put("byte", b"\x01\x02\x03")
        f = ring.put("f", torch.arange(4.0))
        assert (f.data_ptr() % 4) == 0 and torch.equal(f, torch.arange(4.0))


class TestRescueRecordsAreBounded:
    def test_rescue_keeps_no_list_of_its_own(self):
        buf = StagingBuffer(1024, name="rescued")
        kept = []
        with sanitizer.sanitize(rescue=1):
            for i in range(10):
                kept.append(buf.write(0, torch.full((4,), float(i)), name=f"w{i}"))
            assert len(sanitizer.rescues()) == 9
            assert sanitizer.rescues() == records.events("rescue")
            records.forget_events("rescue")
            assert sanitizer.rescues() == []  # nothing kept elsewhere
        assert [float(t[0]) for t in kept] == [float(i) for i in range(10)]
        assert not hasattr(rescue, "_records")

    @pytest.mark.skipif("max_records" not in sanitizer.options(), reason="no records cap option in this tree")
    def test_the_records_cap_bounds_rescues(self):
        buf = StagingBuffer(1024, name="capped")
        kept = []
        with sanitizer.sanitize(rescue=1, max_records=5):
            for i in range(20):
                kept.append(buf.write(0, torch.full((4,), float(i)), name=f"w{i}"))
            assert len(sanitizer.rescues()) <= 5
        assert [float(t[0]) for t in kept] == [float(i) for i in range(20)]
