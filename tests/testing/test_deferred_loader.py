"""The faithful layerwise deferred loader: fused loaders, meta counting, and bit-exact loads."""
from __future__ import annotations

import inspect

import pytest
import torch
from safetensors.torch import load_file

import sanitizer
from sanitizer.testing.reference.checkpoint import (ORDERS, corrupted_tensors, ordered_names, read_header, reference_state,
                                  stream_through_ring, write_checkpoint)
from sanitizer.testing.reference.deferred_loader import LayerwiseLoader, get_numel_loaded
from sanitizer.testing.reference.fused_loaders import QKVParallelLinear, TinyConfig, TinyForCausalLM, checkpoint_layout
from sanitizer.core.options import OPTIONS

# Detection only: the heap walk that names holders (triage) is another feature, and slow in a big heap.
QUIET = {"triage_budget_ms": 0} if "triage_budget_ms" in OPTIONS else {}
CFG = TinyConfig(hidden=64, heads=4, kv_heads=2, intermediate=128, dense_layers=2, moe_layers=1, experts=2,
                 moe_intermediate=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One small checkpoint per file order, with its reference (load_file + the same quantizer)."""
    out = {}
    for order in ("sorted", "grouped", "shuffled", "interleaved"):
        path = str(tmp_path_factory.mktemp("ckpt") / f"{order}.safetensors")
        info = write_checkpoint(path, CFG, order, seed=3)
        out[order] = (path, info, reference_state(path))
    return out


def _rings(info):
    largest, total = info["largest"], info["bytes"]
    return [largest, 2 * largest, total // 2, total + 64 * info["tensors"]]  # up to the whole checkpoint


def _load(path, ring_bytes, ownership_on):
    with torch.device("meta"):
        model = TinyForCausalLM(CFG)
    loader = LayerwiseLoader(model, ownership=ownership_on)
    ring = sanitizer.StagingRing(ring_bytes)
    try:
        model.load_weights(stream_through_ring(path, ring))
        loader.finalize()
    finally:
        ring.close()
    return model, loader


def test_checkpoint_is_real_safetensors_in_the_asked_order(checkpoints):
    path, info, _ = checkpoints["interleaved"]
    names = [e[0] for e in read_header(path)[0]]
    assert names[:3] == ["model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight",
                         "model.layers.2.input_layernorm.weight"]
    assert sorted(load_file(path)) == sorted(names) and len(names) == info["tensors"]
    assert [e[0] for e in read_header(checkpoints["sorted"][0])[0]] == sorted(names)


def test_fused_loaders_put_each_tensor_where_the_layout_says(checkpoints):
    path = checkpoints["grouped"][0]
    tensors = load_file(path)
    model = TinyForCausalLM(CFG)
    model.load_weights(tensors.items())
    params = dict(model.named_parameters())
    for name, shape, param, expert, lo, hi in checkpoint_layout(CFG):
        dest = params[param].data if expert is None else params[param].data[expert]
        assert torch.equal(dest[lo:hi], tensors[name]), name


def test_numel_is_counted_by_a_meta_dry_run():
    with torch.device("meta"):
        qkv = QKVParallelLinear(64, 16, 4, 2, torch.bfloat16)
    bound = inspect.signature(qkv.weight_loader).bind(qkv.weight, torch.ones(32, 64, dtype=torch.bfloat16), "k")
    numel, ret = get_numel_loaded(qkv.weight_loader, bound)
    assert numel == 32 * 64 and ret is None
    assert qkv.weight.is_meta  # nothing was materialized


@pytest.mark.parametrize("order", ["sorted", "grouped", "shuffled", "interleaved"])
def test_bit_exact_with_ownership_for_every_order_and_ring(checkpoints, order):
    path, info, reference = checkpoints[order]
    for ring_bytes in _rings(info):
        with sanitizer.sanitize(**QUIET):  # and the sanitizer sees no stale use at all
            model, loader = _load(path, ring_bytes, ownership_on=True)
        assert corrupted_tensors(model, reference, CFG) == [], (order, ring_bytes)
        assert loader.finalized == [] and loader.pending_layers() == []
        assert sanitizer.errors() == []


@pytest.mark.parametrize("order", ["sorted", "grouped", "shuffled", "interleaved"])
def test_without_ownership_either_bit_exact_or_the_sanitizer_raised(checkpoints, order):
    path, info, reference = checkpoints[order]
    outcomes = []
    for ring_bytes in _rings(info):
        plain, _ = _load(path, ring_bytes, ownership_on=False)
        corrupted = corrupted_tensors(plain, reference, CFG)
        try:
            with sanitizer.sanitize(**QUIET):
                model, _ = _load(path, ring_bytes, ownership_on=False)
        except sanitizer.StaleBorrowError as err:
            assert "deferred_loader.py" in str(err)  # the used-at stack shows the replay
            outcomes.append("raised")
        else:
            assert corrupted_tensors(model, reference, CFG) == [], (order, ring_bytes)
            assert corrupted == [], f"corruption the sanitizer missed: {corrupted}"
            outcomes.append("exact")
    assert outcomes[-1] == "exact"  # a ring as large as the checkpoint is never reused
    assert outcomes[0] == "raised"  # a ring of the largest tensor is reused while the MoE layer defers


@pytest.mark.parametrize("policy,safe", [("registered", True), ("marked", True), ("all", True),
                                         ("accelerator", False)])
def test_policies_at_the_boundary(checkpoints, policy, safe):
    """The vLLM fork's later rule (accelerator tensors only) misses a CPU staging ring."""
    path, info, reference = checkpoints["interleaved"]
    with torch.device("meta"):
        model = TinyForCausalLM(CFG)
    LayerwiseLoader(model, policy=policy)
    ring = sanitizer.StagingRing(info["largest"])
    try:
        with sanitizer.sanitize(**QUIET):
            model.load_weights(stream_through_ring(path, ring))
    except sanitizer.StaleBorrowError:
        assert not safe
    else:
        assert safe and corrupted_tensors(model, reference, CFG) == []


def test_unsafe_load_really_corrupts(checkpoints):
    path, info, reference = checkpoints["interleaved"]
    model, _ = _load(path, info["largest"], ownership_on=False)
    assert len(corrupted_tensors(model, reference, CFG)) > 0


def test_clone_on_defer_copies_only_deferred_calls(checkpoints):
    path, info, _ = checkpoints["interleaved"]
    sanitizer.reset_stats()
    model, loader = _load(path, info["largest"], ownership_on=True)
    st = sanitizer.stats()
    assert st["copies"] == loader.deferred_calls > 0
    assert st["copied_bytes"] < info["bytes"] == st["copy_everything_bytes"]
    assert st["owned_bytes"] == 0 and st["open_scopes"] == 0  # every layer processed, every copy released
    assert max(st["scope_peaks"].values()) <= st["peak_owned_bytes"] < info["bytes"]


def test_finalize_processes_layers_that_never_completed(checkpoints, tmp_path):
    path = checkpoints["grouped"][0]
    tensors = {k: v for k, v in load_file(path).items() if k != "model.layers.0.self_attn.v_proj.weight"}
    with torch.device("meta"):
        model = TinyForCausalLM(CFG)
    loader = LayerwiseLoader(model)
    model.load_weights(tensors.items())
    assert loader.pending_layers() == ["model.layers.0.self_attn.qkv_proj"]
    assert loader.finalize() == ["model.layers.0.self_attn.qkv_proj"]
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert not qkv.weight.is_meta and qkv.weight.dtype == torch.int8  # materialized and quantized
    assert sanitizer.stats()["open_scopes"] == 0


def test_excess_loads_are_ignored_after_processing(checkpoints):
    path = checkpoints["grouped"][0]
    tensors = load_file(path)
    with torch.device("meta"):
        model = TinyForCausalLM(CFG)
    loader = LayerwiseLoader(model)
    norm = "model.layers.0.input_layernorm.weight"
    stale_meta = model.get_parameter(norm)  # what a params dict taken before loading still holds
    model.load_weights(tensors.items())
    before = model.get_parameter(norm).clone()
    stale_meta.weight_loader(stale_meta, torch.zeros_like(tensors[norm]))  # the wrapper of a processed layer
    assert loader.excess_calls == 1 and torch.equal(model.get_parameter(norm), before)


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="nn.Module.*dict"):
        LayerwiseLoader({})
    with pytest.raises(ValueError, match="'sometimes'"):
        LayerwiseLoader(TinyForCausalLM(CFG), policy="sometimes")
    with pytest.raises(ValueError, match="'diagonal'"):
        ordered_names(CFG, "diagonal")
    assert set(ORDERS) == {"interleaved", "grouped", "sorted", "shuffled"}
