"""``enable(trap=poison|fault)`` arms trap mode (see :mod:`sanitizer.torch_layer.trap`).

Only an enable that asks for trap mode imports it: with ``trap=0`` (the default) nothing is
imported and ``StagingBuffer`` stays the plain class, its lend path untouched.
"""
from __future__ import annotations

from sanitizer.core.options import Options
from sanitizer.torch_layer.hooks import add_enable_hook


def install() -> None:
    """Watch enables (idempotent). Called by :func:`sanitizer.activation.compose`."""
    add_enable_hook(_on_enable)


def _on_enable(options: Options) -> None:
    if options.trap != "0":
        from sanitizer.torch_layer import trap

        trap.arm()


__all__ = ["install"]
