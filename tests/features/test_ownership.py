"""The production rule: own() / own_arguments() / DeferralScope / stats()."""
from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch

import sanitizer
from sanitizer.features import ownership
from sanitizer.torch_layer import records


@pytest.fixture(autouse=True)
def _fresh_stats():
    sanitizer.reset_stats()  # conftest collected the previous test's garbage
    yield


def _ring_view(ring: sanitizer.StagingRing, name: str = "w", n: int = 16) -> torch.Tensor:
    return ring.put(name, torch.arange(n, dtype=torch.float32).reshape(4, n // 4))


def _make(kind: str, ring: sanitizer.StagingRing) -> torch.Tensor:
    if kind == "owned":
        return torch.arange(16, dtype=torch.float32).reshape(4, 4)
    if kind == "borrowed":
        return _ring_view(ring)
    if kind == "derived":
        return _ring_view(ring).t()[:, 1:3]  # a view: the marker attribute is gone, the storage is the lease's
    if kind == "meta":
        return torch.empty(4, 4, device="meta")
    raise AssertionError(kind)


# (policy, kind) -> is a copy expected?
CASES = {
    ("registered", "owned"): False, ("registered", "borrowed"): True, ("registered", "derived"): True,
    ("registered", "meta"): False,
    ("marked", "owned"): False, ("marked", "borrowed"): True, ("marked", "derived"): False,  # the marker's blind spot
    ("marked", "meta"): False,
    ("accelerator", "owned"): False, ("accelerator", "borrowed"): False,  # CPU staging: the vLLM fork's blind spot
    ("accelerator", "derived"): False, ("accelerator", "meta"): False,
    ("all", "owned"): True, ("all", "borrowed"): True, ("all", "derived"): True, ("all", "meta"): False,
}


@pytest.mark.parametrize("policy,kind", sorted(CASES))
def test_policy_matrix(policy, kind):
    ring = sanitizer.StagingRing(4096)
    t = _make(kind, ring)
    before = sanitizer.stats()["copies"]
    out = sanitizer.own(t, policy)
    copied = out is not t
    assert copied == CASES[(policy, kind)]
    assert sanitizer.stats()["copies"] - before == int(copied)
    if kind != "meta":
        assert torch.equal(out, t)
    if copied:
        assert out.shape == t.shape and out.dtype == t.dtype
        assert not sanitizer.is_borrowed(out)
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        snapshot = out.clone()
        for i in range(200):  # the ring comes round and overwrites the original bytes
            ring.put(f"next{i}", torch.full((16,), -1.0))
        assert torch.equal(out, snapshot)


def test_owning_an_owned_tensor_allocates_nothing():
    t = torch.ones(1000)
    for policy in ("registered", "marked", "accelerator"):
        assert sanitizer.own(t, policy) is t
    st = sanitizer.stats()
    assert st["copies"] == 0 and st["owned_bytes"] == 0 and st["peak_owned_bytes"] == 0
    assert st["copy_everything_bytes"] == 3 * 4000


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'sometimes'.*registered"):
        sanitizer.own(torch.ones(2), "sometimes")
    with pytest.raises(TypeError, match="list"):
        sanitizer.own([1, 2])
    with pytest.raises(TypeError, match="BoundArguments.*dict"):
        sanitizer.own_arguments({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="'not a name'"):
        sanitizer.add_borrowed_marker("not a name")


def test_added_marker_is_honoured():
    t = torch.ones(8)
    t._sglang_runai_streamer_tensor = True
    assert sanitizer.own(t, "marked") is t
    sanitizer.add_borrowed_marker("_sglang_runai_streamer_tensor")
    assert "_sglang_runai_streamer_tensor" in ownership.borrowed_markers()
    out = sanitizer.own(t, "marked")
    assert out is not t and torch.equal(out, t)
    assert not hasattr(out, "_sglang_runai_streamer_tensor")  # the copy is owned: no marker


def _loader(param, loaded_weight, loaded_shard_id=None, *extra):
    pass


@pytest.mark.parametrize("policy", ["registered", "all"])
def test_own_arguments_leaves_param_alone(policy):
    ring = sanitizer.StagingRing(4096)
    param = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)  # a CPU parameter: "all" would copy it
    w = _ring_view(ring)
    extra = _ring_view(ring, "extra")
    bound = inspect.signature(_loader).bind(param, w, "q", extra)
    bound.apply_defaults()
    out = sanitizer.own_arguments(bound, policy=policy)
    assert out is bound
    assert bound.arguments["param"] is param
    assert bound.arguments["loaded_weight"] is not w and torch.equal(bound.arguments["loaded_weight"], w)
    assert bound.arguments["loaded_shard_id"] == "q"
    (owned_extra,) = bound.arguments["extra"]
    assert owned_extra is not extra and not sanitizer.is_borrowed(owned_extra)
    assert bound.args[0] is param  # args/kwargs follow the arguments dict


def test_scope_releases_its_copies():
    ring = sanitizer.StagingRing(1 << 16)
    scope = sanitizer.DeferralScope("model.layers.0.self_attn.qkv_proj")
    refs = []
    for name in ("q", "k"):
        w = ring.put(name, torch.randn(8, 16))
        bound = inspect.signature(_loader).bind(torch.empty(8, 16, device="meta"), w, name)
        kept = scope.defer(bound)
        refs.append(weakref.ref(kept.arguments["loaded_weight"]))
        del w, bound, kept
    assert [b.arguments["loaded_shard_id"] for b in scope.replay()] == ["q", "k"]
    st = sanitizer.stats()
    assert st["owned_bytes"] == 2 * 8 * 16 * 4 == scope.owned_bytes
    assert st["open_scopes"] >= 1
    scope.close()
    gc.collect()
    assert all(r() is None for r in refs)
    st = sanitizer.stats()
    assert st["owned_bytes"] == 0
    assert st["scope_peaks"]["model.layers.0.self_attn.qkv_proj"] == 2 * 8 * 16 * 4
    assert st["peak_owned_bytes"] == 2 * 8 * 16 * 4
    with pytest.raises(ValueError, match="closed"):
        scope.defer(inspect.signature(_loader).bind(None, torch.ones(1)))


def test_scope_copies_made_with_scope_own_live_until_close():
    ring = sanitizer.StagingRing(4096)
    with sanitizer.DeferralScope("L") as scope:
        ref = weakref.ref(scope.own(_ring_view(ring)))
        gc.collect()
        assert ref() is not None  # the scope holds it for its deferred unit
    gc.collect()
    assert ref() is None and sanitizer.stats()["owned_bytes"] == 0


def test_copy_kept_alive_by_a_dtype_view_is_still_counted():
    ring = sanitizer.StagingRing(4096)
    out = sanitizer.own(_ring_view(ring))
    as_int = out.view(torch.int32)  # does not keep the Python tensor `out` alive, only its storage
    del out
    gc.collect()
    assert sanitizer.stats()["owned_bytes"] == 64
    del as_int
    gc.collect()
    assert sanitizer.stats()["owned_bytes"] == 0


def test_stats_and_clone_events_aggregate_by_policy():
    ring = sanitizer.StagingRing(4096)
    kept = [sanitizer.own(_ring_view(ring, f"w{i}")) for i in range(3)] + [sanitizer.own(torch.ones(4), "all")]
    st = sanitizer.stats()
    assert st["copies_by_policy"] == {"registered": 3, "all": 1}
    assert st["bytes_by_policy"] == {"registered": 3 * 64, "all": 16}
    clones = records.events("clone")
    assert sorted((e["policy"], e["count"], e["bytes"]) for e in clones) == [("all", 1, 16), ("registered", 3, 192)]
    sanitizer.reset_stats()
    assert not records.events("clone")
    assert sanitizer.stats()["owned_bytes"] == 3 * 64 + 16 == sanitizer.stats()["peak_owned_bytes"]
    del kept


def test_own_is_too_late_once_the_bytes_were_reused():
    ring = sanitizer.StagingBuffer(4096, name="r")
    w = ring.write(0, torch.ones(16), name="w")
    ring.reuse(0, 64, by="next")
    with sanitizer.sanitize():
        with pytest.raises(sanitizer.StaleBorrowError):
            sanitizer.own(w)


def test_scope_verifies_checksums_when_it_defers():
    ring = sanitizer.StagingRing(4096)
    with sanitizer.sanitize(checksum=1):
        w = ring.put("w", torch.arange(16, dtype=torch.float32))
        ring.buffer.tensor[0:4].numpy()[:] = 7  # a write behind the buffer API while lent
        scope = sanitizer.DeferralScope("L")
        with pytest.raises(sanitizer.BorrowCorruptedError, match="'w'"):
            scope.defer(inspect.signature(_loader).bind(None, w))
        scope.close()


def test_scope_verifies_before_replay_when_retaining_unowned():
    ring = sanitizer.StagingBuffer(4096, name="r")
    with sanitizer.sanitize(checksum=1):
        scope = sanitizer.DeferralScope("L", policy=None)  # ownership off: retain as is
        scope.defer(inspect.signature(_loader).bind(None, ring.write(0, torch.ones(16), name="w")))
        ring.write(0, torch.zeros(16), name="next")
        with pytest.raises(sanitizer.StaleBorrowError, match="sanitizer.verify"):
            scope.replay()
        scope.close()
