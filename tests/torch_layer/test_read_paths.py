"""Every read path of a stale lease is caught; metadata and placement queries are not reads."""
from __future__ import annotations

import gc
import io
import pickle

import numpy as np
import pytest
import torch
import torch.utils.dlpack

import sanitizer
from sanitizer import StagingBuffer, StaleBorrowError
from sanitizer.torch_layer import mode, readers

try:  # imported before any lease goes stale, as a program's imports are
    import safetensors.torch as safetensors_torch
except ImportError:  # pragma: no cover - the test extra installs it
    safetensors_torch = None

aten = torch.ops.aten


@pytest.fixture
def stale():
    buf = StagingBuffer(1024, name="ring")
    w = buf.write(0, torch.arange(8, dtype=torch.float32), name="w")
    buf.reuse(0, 32, by="next")
    # No holder walk (a heap pass per raise, ~0.4 s of the test's 0.5): these tests are about which reads are
    # caught; who holds the view is tests/features' (the error still names the lease)
    with sanitizer.sanitize(triage_budget_ms=0):
        yield w


def _safetensors_save(t):
    if safetensors_torch is None:
        pytest.skip("safetensors is not installed")
    return safetensors_torch.save({"w": t.contiguous()})


READS = {
    "sum": lambda w: w.sum(),
    "item": lambda w: w[0].item(),
    "copy_ into it": lambda w: w.copy_(torch.ones(8)),
    "add_": lambda w: w.add_(1),
    "tolist": lambda w: w.tolist(),
    "numpy": lambda w: w.numpy(),
    "np.asarray": lambda w: np.asarray(w),
    "derived view .numpy": lambda w: w[2:].numpy(),
    "detach().numpy()": lambda w: w.detach().numpy(),
    "to_dlpack": lambda w: torch.utils.dlpack.to_dlpack(w),
    "np.from_dlpack": lambda w: np.from_dlpack(w),
    "pickle.dumps": lambda w: pickle.dumps(w),
    "torch.save": lambda w: torch.save(w, io.BytesIO()),
    "safetensors save": _safetensors_save,
    "apply_": lambda w: w.apply_(lambda x: x),
    "map_": lambda w: w.map_(torch.ones(8), lambda a, b: a),
    "map_ with it as the other": lambda w: torch.ones(8).map2_(w, torch.ones(8), lambda a, b, c: a),
    # printing turns every dispatch mode off, then reads (.item() of a 0-dim view): the next tensor's value
    "repr of a 0-dim view": lambda w: repr(w[3]),
    "str of the view": lambda w: str(w),
    "f-string of a 0-dim view": lambda w: f"{w[3]:.3f}",
    # the storage API of a lease reads its bytes without an aten op
    "storage slice": lambda w: w.untyped_storage()[0:16],
    "storage tolist": lambda w: w.untyped_storage().tolist(),
    "storage clone": lambda w: w.untyped_storage().clone(),
    "pickle.dumps(storage)": lambda w: pickle.dumps(w.untyped_storage()),
    "torch.save(storage)": lambda w: torch.save(w.untyped_storage(), io.BytesIO()),
    "copy a storage from it": lambda w: torch.UntypedStorage(32).copy_(w.untyped_storage()),
    "write into its storage": lambda w: w.untyped_storage().fill_(0),
    "assign into its storage": lambda w: w.untyped_storage().__setitem__(0, 1),
    # written through a metadata factory's out= (its inputs are metadata, its out tensor is written)
    "ones_like out= into it": lambda w: torch.ops.aten.ones_like.out(torch.ones(8), out=w),
    # a sparse tensor over the lease keeps its storage as its values
    "a sparse tensor over it": lambda w: (torch.sparse_coo_tensor(torch.tensor([[0, 3]]), w[:2], (8,),
                                                                  check_invariants=False) * 2).to_dense(),
}


@pytest.mark.parametrize("path", sorted(READS))
def test_each_read_path_raises(stale, path):
    with pytest.raises(StaleBorrowError, match="'w'"):
        READS[path](stale)


def test_a_wrapper_subclass_over_a_stale_lease_is_caught(stale):
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    tt = two_tensor.TwoTensor(stale, torch.ones(8))
    with pytest.raises(StaleBorrowError, match="'w'"):
        tt + 1


NOT_READS = {
    "shape and stride": lambda w: (w.shape, w.stride(), w.numel(), w.dtype, w.data_ptr()),
    "is_pinned": lambda w: w.is_pinned(),
    '.to("meta")': lambda w: w.to("meta"),
    "views": lambda w: w.view(2, 4).t()[1:].detach(),
    "empty_like / new_zeros": lambda w: (torch.empty_like(w), w.new_zeros(3)),
    "is_same_size": lambda w: w.is_same_size(w),
    "nn.Parameter around it": lambda w: torch.nn.Parameter(w, requires_grad=False),
}


@pytest.mark.parametrize("query", sorted(NOT_READS))
def test_metadata_and_placement_are_not_reads(stale, query):
    NOT_READS[query](stale)
    assert sanitizer.errors() == []


def test_the_read_decision_comes_from_the_schema():
    assert mode._plan(aten.view.default) is False  # output aliases the input, no write
    assert mode._plan(aten.detach.default) is False
    assert mode._plan(aten.empty_like.default) is False  # a metadata factory
    assert mode._plan(aten.is_pinned.default) is False  # returns a bool, not data dependent
    assert mode._plan(aten.add.Tensor) is True
    assert mode._plan(aten.copy_.default) is True  # self is written, src read
    assert mode._plan(aten._local_scalar_dense.default) is True  # tagged data_dependent_output
    assert mode._plan(aten.equal.default) is True


def test_the_reader_hooks_exist_only_while_a_stale_lease_is_reachable():
    buf = StagingBuffer(256)
    with sanitizer.sanitize():
        w = buf.write(0, torch.ones(4), name="w")
        assert not readers.hooked() and "tolist" not in torch.Tensor.__dict__
        assert readers.noting() and "numpy" in torch.Tensor.__dict__  # exports of a fresh lease are noted
        buf.reuse(0, 16)
        assert readers.hooked() and "tolist" in torch.Tensor.__dict__
        del w
        gc.collect()
        assert not readers.hooked() and "tolist" not in torch.Tensor.__dict__
        assert readers.noting()  # exports stay noted while the buffer can lend again
        buf.close()
        assert not readers.noting()
        assert "numpy" not in torch.Tensor.__dict__ and "tolist" not in torch.Tensor.__dict__
        assert torch.Tensor.tolist is torch._C.TensorBase.tolist
        assert torch.utils.dlpack.to_dlpack.__module__ != readers.__name__
