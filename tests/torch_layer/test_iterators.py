"""borrowed_iterator (any loader, no copy) and emulate_borrowed (borrowed semantics for copying loaders)."""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import sanitizer
from sanitizer import StaleBorrowError, borrowed_iterator, emulate_borrowed


def pool_loader(n=4, numel=16, log=None):
    """A borrowing loader: every tensor is written into the same pool, as runai's slot pool does."""
    pool = torch.zeros(4 * numel, dtype=torch.float32)
    try:
        for i in range(n):
            pool[:numel] = float(i + 1)
            yield f"w{i}", pool[:numel].view(4, numel // 4)
    finally:
        if log is not None:
            log.append("loader closed")


def fresh_loader(n=4, log=None):
    """Each tensor has memory of its own that the loader gives up after yielding (no aliasing)."""
    for i in range(n):
        arr = np.full(8, float(i + 1), dtype=np.float32)
        if log is not None:
            log.append(weakref.ref(arr))
        yield f"f{i}", torch.from_numpy(arr)


def test_yields_are_leases_over_the_loaders_own_bytes_without_copy():
    seen = []
    for name, t in borrowed_iterator(pool_loader()):
        lease = sanitizer.lease_of(t)
        assert lease is not None and lease.name == name
        assert getattr(t, sanitizer.BORROWED_MARKER) is True
        seen.append((name, t.data_ptr(), float(t.sum())))
    assert [s[2] for s in seen] == [16.0, 32.0, 48.0, 64.0]
    assert len({s[1] for s in seen}) == 1  # every view sits on the pool's first bytes: nothing was copied


def test_retaining_consumer_is_caught_synchronous_consumer_is_not():
    kept = []
    with sanitizer.sanitize():
        total = 0.0
        for name, t in borrowed_iterator(pool_loader()):
            total += float(t.sum())  # synchronous use: always fine
            kept.append(t)
        assert total == 160.0
        with pytest.raises(StaleBorrowError) as err:
            kept[0] + 1
    assert err.value.lease.name == "w0" and err.value.event.kind == "retire"
    assert "borrowed_iterator" in err.value.lease.region_name


def test_non_aliasing_yields_are_handled_and_loader_memory_is_not_kept_alive():
    refs = []
    kept = []
    with sanitizer.sanitize():
        it = borrowed_iterator(fresh_loader(4, refs))
        name, first = next(it)
        assert float(first.sum()) == 8.0
        kept.append(first)
        del first
        for name, t in it:
            assert float(t.sum()) == 8.0 * int(name[1:]) + 8.0
        with pytest.raises(StaleBorrowError):
            kept[0].sum()
        del t
    gc.collect()
    # the guard (default) moved the retained lease onto a poison tombstone: the loader's memory is
    # released, the retained view reads NaN through any unchecked path
    assert all(r() is None for r in refs)
    assert torch.isnan(kept[0]).all()  # sanitizer off now: an unchecked read sees the tombstone
    kept.clear()
    gc.collect()


@pytest.mark.parametrize("lifetime", [1, 2, 3])
def test_lifetime_counts_advances(lifetime):
    with sanitizer.sanitize():
        it = borrowed_iterator(fresh_loader(6), lifetime=lifetime)
        _, first = next(it)
        for _ in range(lifetime - 1):
            next(it)
            assert float(first.sum()) == 8.0  # still within its lifetime
        next(it)
        with pytest.raises(StaleBorrowError):
            first.sum()
        it.close()


def test_aliasing_yields_share_a_window_and_expire_independently():
    def fused():
        qkv = torch.arange(12, dtype=torch.float32)
        yield "qkv", qkv
        yield "q", qkv[:4]
        yield "k", qkv[4:8]
        yield "other", torch.ones(3)

    with sanitizer.sanitize():
        it = borrowed_iterator(fused(), lifetime=2)
        _, qkv = next(it)
        _, q = next(it)
        assert sanitizer.lease_of(q).region_id == sanitizer.lease_of(qkv).region_id
        _, k = next(it)  # qkv's lifetime ends; q and k (its slices) are still within theirs
        assert torch.equal(q, torch.arange(4, dtype=torch.float32))
        assert torch.equal(k, torch.arange(4, 8, dtype=torch.float32))
        with pytest.raises(StaleBorrowError):
            qkv.sum()
        next(it)  # q expires now
        with pytest.raises(StaleBorrowError):
            q.sum()
        assert float(k.sum()) == 22.0
        it.close()
        with pytest.raises(StaleBorrowError):
            k.sum()


def test_strided_yields_keep_shape_dtype_and_strides():
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    expected = {"t": base.t(), "step": base[:, ::2], "bf16": base.to(torch.bfloat16)[1:, 1:]}

    def strided():
        yield from expected.items()

    kept = {}
    with sanitizer.sanitize():
        for name, t in borrowed_iterator(strided(), lifetime=3):
            src = expected[name]
            assert t.shape == src.shape and t.dtype == src.dtype and t.stride() == src.stride()
            assert torch.equal(t, src)
            kept[name] = t
        for name, t in kept.items():
            with pytest.raises(StaleBorrowError):
                t.clone()


def test_close_ends_leases_and_closes_the_loader():
    log = []
    with sanitizer.sanitize():
        with borrowed_iterator(pool_loader(log=log), lifetime=3) as it:
            _, w0 = next(it)
            assert float(w0.sum()) == 16.0
        assert log == ["loader closed"]
        with pytest.raises(StaleBorrowError) as err:
            w0.sum()
        assert err.value.event.kind == "retire"
        assert list(it) == []


def test_exhaustion_ends_remaining_leases_without_touching_loader_bytes():
    pool = torch.full((8,), 7.0)

    def loader():
        yield "a", pool[:4]
        yield "b", pool[4:]

    with sanitizer.sanitize(poison=1):
        kept = [t for _, t in borrowed_iterator(loader(), lifetime=5)]
        with pytest.raises(StaleBorrowError) as err:
            kept[1].sum()
        assert err.value.event.kind == "close"
    # lifetime not over when the loader ended: its bytes may be gone, so no poison was written
    assert torch.equal(pool, torch.full((8,), 7.0))


def test_retire_never_poisons_the_loaders_memory():
    """The loader's tensors may live on (a state_dict): poison writes only memory the sanitizer allocated."""
    pool = torch.full((8,), 7.0)

    def loader():
        yield "a", pool[:4]
        yield "b", pool[4:]

    with sanitizer.sanitize(poison=1):
        it = borrowed_iterator(loader())
        _, a = next(it)
        next(it)
        assert sanitizer.lease_of(a).stale  # retired at the advance, as before
        assert torch.equal(pool, torch.full((8,), 7.0))  # but its bytes are the loader's: untouched
        it.close()
    assert torch.equal(pool, torch.full((8,), 7.0))


def test_rescue_keeps_a_retaining_consumer_bit_exact():
    with sanitizer.sanitize(rescue=1):
        kept = dict(borrowed_iterator(pool_loader()))
        values = {k: v.clone() for k, v in kept.items()}
    assert {k: float(v.sum()) for k, v in values.items()} == {"w0": 16.0, "w1": 32.0, "w2": 48.0, "w3": 64.0}
    assert sanitizer.errors() == []
    assert all(sanitizer.lease_of(v) is None for v in kept.values())  # disowned: no longer borrows


def test_checksum_catches_a_write_behind_the_buffer_api_at_the_advance():
    with sanitizer.sanitize(checksum=1):
        it = borrowed_iterator(fresh_loader(3))
        _, t = next(it)
        t.numpy()[0] = 123.0  # numpy write: torch and the mode see nothing (t is still held)
        with pytest.raises(sanitizer.BorrowCorruptedError) as err:
            next(it)
        assert err.value.lease.name == "f0"
        it.close()


def test_parameters_stay_parameters_and_odd_tensors_pass_through():
    p = torch.nn.Parameter(torch.ones(4))
    empty = torch.empty(0)
    meta = torch.empty(3, device="meta")
    out = dict(borrowed_iterator(iter([("p", p), ("empty", empty), ("meta", meta)]), lifetime=3))
    assert isinstance(out["p"], torch.nn.Parameter) and out["p"].requires_grad
    assert sanitizer.lease_of(out["p"]) is not None
    assert out["empty"] is empty and out["meta"] is meta


@pytest.mark.parametrize("bad,fragment", [
    (["just a string"], "str"),
    ([("a", "b", torch.ones(1))], "tuple of 3"),
    ([("a", [1, 2])], "tuple of 2"),
])
def test_bad_items_are_named(bad, fragment):
    with pytest.raises(TypeError, match=fragment) as err:
        next(borrowed_iterator(iter(bad)))
    assert "(name, tensor)" in str(err.value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_bad_lifetime_is_refused_with_the_value(value):
    with pytest.raises(ValueError, match="lifetime") as err:
        borrowed_iterator([], lifetime=value)
    assert repr(value) in str(err.value)


# -- emulate_borrowed ---------------------------------------------------------------
def checkpoint(n=6, numel=64):
    return {f"layers.{i}.w": torch.full((numel,), float(i + 1)) for i in range(n)}


@pytest.mark.slow
def test_emulation_gives_real_borrowed_views_and_real_reuse():
    ckpt = checkpoint()
    ring = 2 * 64 * 4  # two tensors
    kept = dict(emulate_borrowed(ckpt.items(), ring_bytes=ring))  # unsanitized: the bug runs
    assert all(sanitizer.is_borrowed(v) for v in kept.values())
    wrong = [k for k in ckpt if not torch.equal(kept[k], ckpt[k])]
    assert wrong  # the ring came round: retained views read later tensors' bytes
    with sanitizer.sanitize():
        kept = dict(emulate_borrowed(ckpt.items(), ring_bytes=ring))
        with pytest.raises(StaleBorrowError):
            kept["layers.0.w"].sum()


def test_emulation_correct_consumer_is_bit_exact_and_clean():
    ckpt = checkpoint()
    params = {k: torch.zeros_like(v) for k, v in ckpt.items()}
    with sanitizer.sanitize():
        for name, t in emulate_borrowed(ckpt.items(), ring_bytes=64 * 4):
            params[name].copy_(t)
    assert sanitizer.errors() == []
    assert all(torch.equal(params[k], ckpt[k]) for k in ckpt)


def test_emulation_lifetime_is_strict_even_with_a_large_ring():
    with sanitizer.sanitize():
        it = emulate_borrowed(checkpoint().items(), ring_bytes=1 << 20, lifetime=1)
        _, first = next(it)
        _, second = next(it)
        assert float(second.sum()) == 128.0
        with pytest.raises(StaleBorrowError):
            first.sum()
        it.close()
        with pytest.raises(StaleBorrowError):
            second.sum()


def test_emulation_closes_the_ring_at_the_end_and_works_from_torch_load(tmp_path):
    ckpt = checkpoint(3)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt")
    with sanitizer.sanitize():
        it = emulate_borrowed(loaded.items(), ring_bytes=1 << 16)
        out = {k: v.clone() for k, v in it}
        assert it.ring.buffer.closed
    assert all(torch.equal(out[k], ckpt[k]) for k in ckpt)


def test_emulation_refuses_a_tensor_larger_than_the_ring_by_name():
    with pytest.raises(ValueError, match=r"'big' \(4096 bytes.*ring of 100 bytes"):
        list(emulate_borrowed(iter([("big", torch.zeros(1024))]), ring_bytes=100))
    with pytest.raises(ValueError, match="ring_bytes"):
        emulate_borrowed([], ring_bytes=0)


def test_an_aliased_lease_outliving_its_dropped_alias_still_expires_before_the_loader_runs():
    pool = torch.full((8,), 3.0)
    log = []
    seen = {}

    def loader():
        yield "whole", pool
        yield "alias", pool[:8]  # covers all of whole's bytes
        yield "other", torch.ones(2)
        log.append(sanitizer.lease_of(seen["whole"]).stale)  # the loader runs again: whole must be retired by now
        pool.fill_(-1.0)
        yield "last", torch.ones(2)

    with sanitizer.sanitize(poison=1):
        it = borrowed_iterator(loader(), lifetime=2)
        _, whole = next(it)
        seen["whole"] = whole
        _, alias = next(it)
        next(it)  # whole's lifetime ends, but alias (alive, fresh) covers its bytes: nothing retired yet
        assert float(whole.sum()) == 24.0  # nothing stale, nothing poisoned
        del alias  # dies within its lifetime: its own expiry has nothing to retire
        next(it)
        with pytest.raises(StaleBorrowError):
            whole.sum()
        it.close()
    assert log == [True]


# -- BorrowedLoans: leases that end at the loader's free (fastsafetensors' file buffer) ------------------------
def test_loans_last_until_close_and_a_kept_view_is_stale_after_it():
    from sanitizer.torch_layer.iterators import BorrowedLoans

    pool = torch.arange(32, dtype=torch.float32)
    with sanitizer.sanitize():
        loans = BorrowedLoans("file-buffer")
        loans.adopt("cpu", pool.data_ptr(), pool.numel() * 4)  # one region for the whole buffer
        a = loans.lend("a", pool[:8])
        b = loans.lend("b", pool[8:16].view(2, 4))
        assert sanitizer.lease_of(a).region_id == sanitizer.lease_of(b).region_id
        assert b.shape == (2, 4) and float(a.sum()) == 28.0  # valid until the loader's close, however many lends
        assert loans.lend("again", a) is a  # already a lease: returned as it is
        loans.close()
        with pytest.raises(StaleBorrowError) as err:
            b.sum()
        assert err.value.event.kind == "close"
        with pytest.raises(ValueError, match="closed"):
            loans.lend("late", pool[:4])


def test_loans_without_an_adopted_buffer_track_each_storage_and_abandon_touches_nothing():
    from sanitizer.torch_layer.iterators import BorrowedLoans

    tensors = [torch.full((4,), float(i)) for i in range(3)]  # a storage each (DLPack exports)
    with sanitizer.sanitize(poison=1):
        loans = BorrowedLoans("per-tensor")
        views = [loans.lend(f"t{i}", t) for i, t in enumerate(tensors)]
        assert len({sanitizer.lease_of(v).region_id for v in views}) == 3
        loans.abandon()  # the loader already freed them: stale, no verify, no poison
        with pytest.raises(StaleBorrowError):
            views[0].sum()
    assert all(torch.equal(t, torch.full((4,), float(i))) for i, t in enumerate(tensors))


def test_a_borrowed_iterator_over_leases_shortens_them_instead_of_tracking_twice():
    from sanitizer.torch_layer.iterators import BorrowedLoans

    pool = torch.arange(16, dtype=torch.float32)
    with sanitizer.sanitize():
        loans = BorrowedLoans("inner")

        def loader():
            for i in range(4):
                yield f"w{i}", loans.lend(f"w{i}", pool[4 * i: 4 * i + 4])

        it = borrowed_iterator(loader(), lifetime=1)
        _, w0 = next(it)
        inner = sanitizer.lease_of(w0)
        assert inner is not None and inner.name == "w0"  # the inner lease itself, not a second one over it
        _, w1 = next(it)
        with pytest.raises(StaleBorrowError):  # its lifetime (1) ended at the advance, before the loader's close
            w0.sum()
        assert float(w1.sum()) == 22.0
        it.close()
        loans.close()
        with pytest.raises(StaleBorrowError):
            w1.sum()
