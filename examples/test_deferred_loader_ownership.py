"""A layerwise deferred loader (the bug that started this project), caught, and fixed with ``own_arguments``.

Run ``pytest examples/test_deferred_loader_ownership.py``: the first test FAILS ON PURPOSE, to show the
retention; the second passes. ``tests/tools/test_check_consumer_cli.py`` checks exactly that.

The loader has the shape of vLLM's layerwise online quantization: each parameter's ``weight_loader``
call is bound with ``inspect.signature(...).bind(...)`` and *deferred* until every parameter of its
layer has arrived; then the calls are replayed and the layer is quantized (int8, one scale per row).
Over a borrowing loader the deferred calls keep borrowed views, which the loader overwrites before the
replay. ``sanitizer.own_arguments(bound)`` at the deferral point copies exactly the borrowed tensors of
the calls that really defer (the call that completes a layer replays at once, with its view).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

import sanitizer
from sanitizer.testing import check_consumer

HIDDEN = 96


def weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(2 * HIDDEN, HIDDEN), requires_grad=False)
        self.up = nn.Parameter(torch.empty(2 * HIDDEN, HIDDEN), requires_grad=False)
        self.down = nn.Parameter(torch.empty(HIDDEN, 2 * HIDDEN), requires_grad=False)

    def quantize(self) -> None:
        """The online processing that needs the whole layer: int8 rows and their scales."""
        for name in ("gate", "up", "down"):
            w = getattr(self, name)
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127
            setattr(self, name, nn.Parameter((w / scale).round().to(torch.int8), requires_grad=False))
            self.register_buffer(f"{name}_scale", scale)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))


class LayerwiseLoader:
    """Defers each weight_loader call (bound arguments) until its layer is complete, then replays and
    quantizes. ``own=True`` owns the deferred calls' borrowed arguments: the fix."""

    def __init__(self, model: Model, own: bool) -> None:
        self.model, self.own = model, own
        self.pending = {}  # layer -> [bound calls]
        self.signature = inspect.signature(weight_loader)

    # `ownsan audit` finds this retention only when told where the weights come in: the tensor reaches here
    # through another object's method (loader.load(name, tensor)), which it does not follow; with
    # [tool.ownsan] consumers = ["LayerwiseLoader.load:tensor"] it reports calls.append(bound) (OWN104).
    def load(self, name: str, tensor: torch.Tensor) -> None:
        layer_name, param_name = name.rsplit(".", 1)
        layer = self.model.get_submodule(layer_name)
        bound = self.signature.bind(getattr(layer, param_name), tensor)
        bound.apply_defaults()
        calls = self.pending.setdefault(layer_name, [])
        if len(calls) < 2 and self.own:  # this call outlives itself: own what it keeps
            sanitizer.own_arguments(bound)  # copies only borrowed tensors; the param is skipped
        calls.append(bound)
        if len(calls) == 3:  # the layer is complete: replay, then the online processing
            for call in self.pending.pop(layer_name):
                weight_loader(*call.args, **call.kwargs)
            layer.quantize()


def load_deferred(weights, own=False):
    model = Model()
    loader = LayerwiseLoader(model, own)
    for name, tensor in weights:
        loader.load(name, tensor)
    return model


def load_deferred_owning(weights):
    return load_deferred(weights, own=True)


SHAPES = {"gate": (2 * HIDDEN, HIDDEN), "up": (2 * HIDDEN, HIDDEN), "down": (HIDDEN, 2 * HIDDEN)}


def _checkpoint():
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.{p}": torch.randn(shape, generator=g) * 0.02 for i in range(2) for p, shape in SHAPES.items()}


STATE_DICT = _checkpoint()  # about 0.4 MiB; a state dict needs no file


def test_deferred_loader_without_ownership_is_caught():
    """Fails on purpose: the deferred calls hold borrowed views (LayerwiseLoader.pending) past their reuse."""
    check_consumer(load_deferred, STATE_DICT)


def test_deferred_loader_with_own_arguments_passes():
    check_consumer(load_deferred_owning, STATE_DICT)
