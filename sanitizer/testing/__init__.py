"""Testing with borrowed weights: the consumer check, its strategies, the reference consumers, the demos.

``from sanitizer.testing import check_consumer`` is the user-facing entry point
(:mod:`sanitizer.testing.consumer_check`); hypothesis strategies are in
:mod:`sanitizer.testing.strategies`. Names load lazily: importing this package
imports nothing else (no torch, no hypothesis) until one of them is used.
"""
from __future__ import annotations

import importlib

_NAMES = {
    name: "sanitizer.testing.consumer_check"
    for name in ("check_consumer", "borrowed_stream", "BorrowedWeights", "CheckResult", "ConsumerCheckError",
                 "RetainedBorrowError", "SanitizerMissError", "NondeterministicConsumerError")
}
_NAMES["StreamCase"] = "sanitizer.testing.streams"

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'sanitizer.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
