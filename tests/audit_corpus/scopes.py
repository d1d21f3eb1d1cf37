"""Stores into module-level (global) and enclosing-scope (nonlocal) names (OWN106)."""
from typing import Iterable

import torch

_CACHE: dict = {}
_LAST = None
_BYTES = 0


def keep_global(weights: Iterable[tuple[str, torch.Tensor]]):
    global _LAST
    for name, w in weights:
        _CACHE[name] = w  # expect: OWN106
        _LAST = w  # expect: OWN106


def keep_nonlocal(weights: Iterable[tuple[str, torch.Tensor]]):
    last = None

    def remember(t):
        nonlocal last
        last = t  # expect: OWN106

    for _, w in weights:
        remember(w)
    return last


# -- safe look-alikes ---------------------------------------------------------------------------------
def safe_global_counter(weights: Iterable[tuple[str, torch.Tensor]]):
    global _BYTES
    for name, w in weights:
        _BYTES += w.numel() * w.element_size()
        _CACHE[name] = w.shape
