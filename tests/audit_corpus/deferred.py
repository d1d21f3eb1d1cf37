"""Tensors captured for a deferred call (OWN104): closures, lambdas, functools.partial, and the bound
arguments of a deferring weight loader (the case that started this project); generators that buffer."""
import functools
import inspect
from typing import Callable, Iterable

import torch
from torch import nn


def make_deferring_loader(layer: nn.Module, original_loader: Callable) -> Callable:
    """Layerwise online processing: every call is kept until the whole layer has arrived."""
    info = layer.reload_info
    signature = inspect.signature(original_loader)

    def online_process_loader(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        info.loaded_weights.append((layer.name, bound))  # expect: OWN104
        if len(info.loaded_weights) == info.expected:
            for _, call in info.loaded_weights:
                original_loader(*call.args, **call.kwargs)
            info.loaded_weights.clear()

    return online_process_loader


class KeepDeferredCalls(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        later = []
        params = dict(self.named_parameters())
        for name, w in weights:
            param = params[name]
            if name.endswith("weight_scale"):
                later.append(lambda: param.data.copy_(w))  # expect: OWN104
            elif name.endswith("zero_point"):
                later.append(functools.partial(param.weight_loader, param, w))  # expect: OWN104
            else:
                def finish():
                    param.data.copy_(w.t())

                self.finishers[name] = finish  # expect: OWN104
        for fn in later:
            fn()


def keep_buffering_generator(weights: Iterable[tuple[str, torch.Tensor]]):
    batch = []
    for name, w in weights:
        batch.append((name, w))  # expect: OWN101
        if len(batch) == 8:
            yield batch
            batch = []
    if batch:
        yield batch


def keep_reordering_generator(weights: Iterable[tuple[str, torch.Tensor]]):
    held_back = []
    for name, w in weights:
        if name.startswith("lm_head"):
            held_back.append((name, w))  # expect: OWN101
            continue
        yield name, w
    yield from held_back


# -- safe look-alikes ---------------------------------------------------------------------------------
def make_immediate_loader(layer: nn.Module, original_loader: Callable) -> Callable:
    signature = inspect.signature(original_loader)

    def online_process_loader(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        original_loader(*bound.args, **bound.kwargs)  # consumed within the call: nothing kept
        layer.calls += 1

    return online_process_loader


def make_owning_loader(layer: nn.Module, original_loader: Callable) -> Callable:
    info = layer.reload_info
    signature = inspect.signature(original_loader)

    def online_process_loader(param, loaded_weight, *args):
        bound = signature.bind(param, loaded_weight.clone(), *args)  # clone-on-defer: the fix
        info.loaded_weights.append((layer.name, bound))

    return online_process_loader


class SafeImmediateCalls(nn.Module):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        params = dict(self.named_parameters())
        for name, w in weights:
            param = params[name]
            copy_in = lambda: param.data.copy_(w)  # called within the step
            copy_in()
            load = functools.partial(param.weight_loader, param)  # no tensor in it
            load(w)
            self.loaders[name] = functools.partial(param.weight_loader, param)


def safe_pass_through_generator(weights: Iterable[tuple[str, torch.Tensor]]):
    for name, w in weights:
        if name.endswith("qkv.weight"):
            q, k, v = w.chunk(3)
            yield name.replace("qkv", "q"), q
            yield name.replace("qkv", "k"), k
            yield name.replace("qkv", "v"), v
        else:
            yield name, w.t()


def keep_default_argument_lambda(weights: Iterable[tuple[str, torch.Tensor]]):
    """``lambda w=w: ...`` binds the loop variable by a default argument: the lambda keeps it."""
    deferred = []
    for name, w in weights:
        deferred.append(lambda w=w: w.sum())  # expect: OWN104
    return [f() for f in deferred]


def keep_default_argument_def(weights: Iterable[tuple[str, torch.Tensor]]):
    later_calls = []
    for name, w in weights:
        def later(t=w):
            return t.sum()
        later_calls.append(later)  # expect: OWN104
    return later_calls


def safe_default_argument_called_in_step(weights: Iterable[tuple[str, torch.Tensor]]):
    total = 0
    for name, w in weights:
        f = lambda w=w: w.sum()  # noqa: E731
        total += f()
    return total
