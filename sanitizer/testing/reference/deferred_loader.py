"""A faithful, small layerwise deferred loader: the consumer that retained borrowed weights.

It follows vLLM's ``model_loader/reload/layerwise.py`` (``make_online_process_loader``,
``LayerReloadingInfo``) and ``reload/meta.py`` (``CopyCounter``, ``get_numel_loaded``):

* every module with parameters of its own is a "layer"; its parameters live on
  the meta device until the layer is complete;
* each ``weight_loader`` call is bound with ``inspect.signature(...).bind`` and
  ``apply_defaults`` and **retained** (``info.loaded_weights``);
* how many elements the call loads is found by dry-running the original loader
  against the meta parameter under a dispatch mode that counts ``copy_`` into
  meta (a fused loader writes a shard, so this is the only honest count);
* when the layer's count reaches its size: materialize the parameters, replay
  the retained calls with the real parameters, run the online quantizer
  (``quant_method.process_weights_after_loading``), release everything;
* :meth:`LayerwiseLoader.finalize` processes layers that never completed.

The retained calls are the hazard: their tensors may be views of a staging
ring that has moved on by replay time. The ownership boundary (a
:class:`~sanitizer.features.ownership.DeferralScope` per incomplete layer, calling
``own_arguments``) copies exactly the borrowed ones, and only for calls that
really defer: the call that completes a layer is replayed at once and keeps
its borrowed view. ``ownership=False`` retains them as they are (the bug).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import wraps
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sanitizer.testing.reference.fused_loaders import default_weight_loader
from sanitizer.features.ownership import DeferralScope, _check_policy as check_policy, note_consumed

_aten_copy = torch.ops.aten.copy_.default


class CopyCounter(TorchDispatchMode):
    """Counts the elements written by ``copy_`` into meta tensors (the dry run of a weight loader)."""

    def __init__(self) -> None:
        super().__init__()
        self.copied_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten_copy and args[0].is_meta:
            self.copied_numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def get_numel_loaded(weight_loader: Callable, args: inspect.BoundArguments) -> Tuple[int, Any]:
    """``(elements the call loads, its return value)``, capped at the destination's size as vLLM does."""
    with CopyCounter() as counter:
        ret = weight_loader(*args.args, **args.kwargs)
    numel = counter.copied_numel
    param = args.arguments.get("param")
    if isinstance(param, torch.Tensor):
        numel = min(numel, param.numel())
    return numel, ret


@dataclass
class LayerReloadingInfo:
    """Per-layer progress, as in vLLM: ``load_numel_total is None`` means the layer is done."""

    name: str
    restore_device: torch.device
    load_numel: int = 0
    load_numel_total: Optional[int] = None
    loaded_weights: List[Tuple[str, inspect.BoundArguments]] = field(default_factory=list)
    scope: Optional[DeferralScope] = None

    def can_load(self) -> bool:
        return self.load_numel_total is not None

    def reset(self) -> None:
        if self.scope is not None:
            self.scope.close()
        self.scope = None
        self.loaded_weights = []
        self.load_numel = 0
        self.load_numel_total = None


def _get_weight_loader(tensor: torch.Tensor) -> Callable:
    return getattr(tensor, "weight_loader", default_weight_loader)


def _get_original_loader(tensor: torch.Tensor) -> Callable:
    loader = _get_weight_loader(tensor)
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__  # type: ignore[attr-defined]
    return loader


def _to_meta(p: nn.Parameter) -> nn.Parameter:
    meta = nn.Parameter(p.data.to("meta"), requires_grad=False)
    meta.__dict__.update(p.__dict__)
    return meta


def _materialize(meta: nn.Parameter, device: torch.device) -> nn.Parameter:
    t = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device=device)
    p = nn.Parameter(t, requires_grad=False)
    p.__dict__.update(meta.__dict__)
    return p


class LayerwiseLoader:
    """Wraps every parameter's ``weight_loader`` of ``model`` with deferring, layerwise processing.

    ``ownership``: own borrowed arguments at the deferral point (the fix);
    ``policy``: how borrowed is decided (see :mod:`sanitizer.features.ownership`);
    ``device``: where layers are materialized.
    """

    def __init__(self, model: nn.Module, *, device: Any = "cpu", ownership: bool = True,
                 policy: str = "registered"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"LayerwiseLoader expects an nn.Module, got {type(model).__name__}")
        check_policy(policy)
        self.model = model
        self.device = torch.device(device)
        self.ownership = ownership
        self.policy = policy
        self.infos: Dict[nn.Module, LayerReloadingInfo] = {}
        self.processed: List[str] = []  # layer names in processing order
        self.finalized: List[str] = []  # processed by finalize (never completed while loading)
        self.deferred_calls = 0
        self.excess_calls = 0
        self.max_pending_layers = 0
        self._pending = 0
        self.initialize()

    # -- setup -------------------------------------------------------------------
    def initialize(self) -> None:
        """Put each layer's parameters on meta (if they are not yet) and wrap their loaders."""
        for name, layer in self.model.named_modules():
            params = dict(layer.named_parameters(recurse=False))
            if not params or layer in self.infos:
                continue
            for pname, p in params.items():
                if not p.is_meta:
                    setattr(layer, pname, _to_meta(p))
            self.infos[layer] = LayerReloadingInfo(name or type(layer).__name__, self.device,
                                                   load_numel_total=sum(p.numel() for p in params.values()))
            for pname, p in layer.named_parameters(recurse=False):
                if _get_weight_loader(p).__name__ != "online_process_loader":
                    p.weight_loader = self.make_online_process_loader(layer, pname)

    def make_online_process_loader(self, layer: nn.Module, param_name: str) -> Callable:
        """vLLM's wrapper: bind, count on meta, retain (owning at the boundary), process when complete."""
        info = self.infos[layer]
        original = _get_original_loader(getattr(layer, param_name))
        signature = inspect.signature(original)

        @wraps(original, assigned=("__doc__", "__annotations__"))
        def online_process_loader(*args: Any, **kwargs: Any) -> Any:
            if not info.can_load():  # the layer was processed already: excess load, ignored as in vLLM
                self.excess_calls += 1
                return None
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            num_loaded, ret = get_numel_loaded(original, bound)
            info.load_numel += num_loaded
            complete = info.load_numel >= info.load_numel_total  # type: ignore[operator]
            if complete:
                note_consumed(v for k, v in bound.arguments.items() if k != "param")
            else:  # the ownership boundary: this call outlives itself
                if info.scope is None:
                    info.scope = DeferralScope(info.name, self.policy if self.ownership else None)
                    self._pending += 1
                    self.max_pending_layers = max(self.max_pending_layers, self._pending)
                bound = info.scope.defer(bound)
                self.deferred_calls += 1
            info.loaded_weights.append((param_name, bound))
            if complete:
                self._process(layer, info)
            return ret

        return online_process_loader

    # -- processing ----------------------------------------------------------------
    def _process(self, layer: nn.Module, info: LayerReloadingInfo) -> None:
        """Materialize, replay the retained calls with the real parameters, quantize, release."""
        for pname, p in list(layer.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(layer, pname, _materialize(p, info.restore_device))
        for p in layer.parameters(recurse=False):
            p.weight_loader = _get_original_loader(p)
        if info.scope is not None:
            info.scope.replay()  # verifies what it retained (checksums on); the calls are in loaded_weights
        for pname, args in info.loaded_weights:
            param = getattr(layer, pname)
            args.arguments["param"] = param
            param.weight_loader(*args.args, **args.kwargs)
        quant_method = getattr(layer, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(layer)
        if info.scope is not None:
            self._pending -= 1
        info.reset()
        self.processed.append(info.name)

    def finalize(self) -> List[str]:
        """Process the layers that never completed (some elements never loaded); returns their names."""
        done = []
        for layer, info in self.infos.items():
            if info.can_load():
                self._process(layer, info)
                done.append(info.name)
        self.finalized.extend(done)
        return done

    def pending_layers(self) -> List[str]:
        return [info.name for info in self.infos.values() if info.can_load() and info.loaded_weights]


def load_layerwise(model: nn.Module, weights: Any, *, ownership: bool = True) -> nn.Module:
    """Stream ``(name, tensor)`` pairs into ``model`` as vLLM's reload does: each through its parameter's
    (wrapped, deferring) ``weight_loader``, then :meth:`LayerwiseLoader.finalize`; returns ``model``."""
    loader = LayerwiseLoader(model, ownership=ownership)
    t = None
    for name, t in weights:
        p = model.get_parameter(name)
        p.weight_loader(p, t)
    t = None  # the last borrowed view: not this frame's to keep through finalize
    loader.finalize()
    return model


__all__ = ["LayerwiseLoader", "LayerReloadingInfo", "CopyCounter", "get_numel_loaded", "load_layerwise"]
