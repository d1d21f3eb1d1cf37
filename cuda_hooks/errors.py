"""The one error ``cuda_hooks`` raises for a missing CUDA tool chain (importable without numba)."""

from __future__ import annotations

__all__ = ["KernelsUnavailable"]


class KernelsUnavailable(RuntimeError):
    """numba's CUDA target cannot be imported, or the kernels cannot be compiled or loaded here
    (no driver, no libNVVM, a compile error): the message says what to install."""
