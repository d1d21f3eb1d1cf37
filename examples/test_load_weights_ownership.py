"""A retaining ``load_weights`` caught by ``check_consumer``, and its owned fix passing.

Run ``pytest examples/test_load_weights_ownership.py``: the first test FAILS ON PURPOSE, to show what a
retention looks like (who holds the borrowed view, where, the fix, the minimal case and the line that
replays it); the other two pass. ``tests/tools/test_check_consumer_cli.py`` checks exactly that.

The loader is a common shape: the checkpoint stores ``q_proj``, ``k_proj`` and ``v_proj`` apart, the model
fuses them into one ``qkv_proj``, so the loader parks each part until its partners arrive. Over a borrowing
loader (InstantTensor, fastsafetensors, runai-model-streamer) a parked view is overwritten by the next
tensor's bytes before the ``torch.cat``: the fused weight is silently wrong. Owning what it parks
(``sanitizer.own(t)``: a copy only when ``t`` is borrowed) fixes it.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from torch import nn

import sanitizer
from sanitizer.testing import check_consumer
from sanitizer.testing.strategies import borrowed_streams

HIDDEN = 128


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm = nn.LayerNorm(HIDDEN)


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


# `ownsan audit` finds nothing here, and cannot: what is parked is park(tensor), a call of a parameter, and a
# call to an unknown function is taken not to return a view of its argument (lambda t: t does, sanitizer.own
# does not, and only the caller knows which it passed); check_consumer, running it, tells (docs/audit.md).
def _load(weights, park):
    model = TinyModel()
    params = dict(model.named_parameters())
    parked = {}  # layer -> {"q_proj": tensor, ...}: the parts waiting for their partners
    with torch.no_grad():
        for name, tensor in weights:
            layer, part, _ = name.rsplit(".", 2)
            if part in ("q_proj", "k_proj", "v_proj"):
                parts = parked.setdefault(layer, {})
                parts[part] = park(tensor)
                if len(parts) == 3:
                    fused = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]])
                    params[f"{layer}.qkv_proj.weight"].copy_(fused)
                    del parked[layer]
            else:
                params[name].copy_(tensor)
    return model


def load_weights_retaining(weights):
    """Parks the borrowed view itself: wrong as soon as the loader reuses its bytes."""
    return _load(weights, park=lambda t: t)


def load_weights_owning(weights):
    """Parks an owned copy of a borrowed view (and the tensor itself when it is already owned)."""
    return _load(weights, park=sanitizer.own)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 2-layer checkpoint of about 0.5 MiB with q/k/v stored apart, as a real .safetensors file."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(2):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"layers.{i}.{part}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g)
        tensors[f"layers.{i}.norm.weight"] = torch.ones(HIDDEN)
        tensors[f"layers.{i}.norm.bias"] = torch.zeros(HIDDEN)
    path = tmp_path_factory.mktemp("checkpoint") / "model.safetensors"
    save_file(tensors, str(path))
    return str(path)


def test_retaining_load_weights_is_caught(checkpoint):
    """Fails on purpose: the failure names the holder (the local 'parts'), the fix and the replay line."""
    check_consumer(load_weights_retaining, checkpoint)


def test_owning_load_weights_passes(checkpoint):
    result = check_consumer(load_weights_owning, checkpoint)
    assert result.examples == 100  # every example bit-exact against the owned oracle, no error, no retention


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=borrowed_streams(streams=("emulated",)))
def test_a_property_of_your_own(borrowed_weights, checkpoint, case):
    """The pieces check_consumer is made of, for a property of your own: a stream case from the strategy,
    a borrowed iterator over the weights from the fixture (closed after the test)."""
    with sanitizer.sanitize(halt_on_error=0, **case.sanitizer_options()):
        model = load_weights_owning(borrowed_weights(checkpoint, case))
        assert sanitizer.errors() == []
    assert not any(sanitizer.is_borrowed(p) for p in model.parameters())
