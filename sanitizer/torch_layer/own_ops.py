"""The sanitizer's own tensor ops, run out of sight of every Python dispatch mode.

While a lease is stale, :class:`~sanitizer.torch_layer.mode.BorrowCheckMode` checks every aten op, and the
sanitizer's own bookkeeping went through it too: a ring put's detach, reshape and dtype view of a source
already checked, the slice and copy into its own buffer, the lease's ``from_numpy`` and a tombstone's
``from_numpy``: eight Python dispatches a put, about a fifth of a ``triage=1`` ring load (issue 27's scale
figure), for ops whose every operand is either ours or was checked before. Under
``torch._C._DisableTorchDispatch`` they are plain aten calls, and a mode of the user's own (a logging or
counting mode) no longer sees our plumbing either, which it never asked to.

Only for tensors with no ``__torch_dispatch__`` of their own (:func:`plain`): a wrapper subclass computes in
its ``__torch_dispatch__``, which must run. And only for ops that read nothing the checks have not seen:
a view of a checked source, a copy from one, a new tensor over our own memory.

``from_numpy`` is torch's own function, not the module attribute: while a lease is stale,
:mod:`~sanitizer.torch_layer.readers` wraps ``torch.from_numpy`` to note the aliases a *program* makes of a
lease; a lease is not an alias of itself.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

import numpy as np
import torch

quiet = torch._C._DisableTorchDispatch  # a context manager (an RAII guard): ~1.4 µs, a mode dispatch ~5 µs
from_numpy = torch._C._VariableFunctions.from_numpy  # never the readers' wrapper, nor a user's patch
as_numpy = torch._C.TensorBase.numpy  # ``t.numpy()`` for our own memory: never through Tensor.numpy's attribute
_modes = torch._C._len_torch_dispatch_stack  # ~0.1 µs: no mode on this thread's stack, no guard to pay for

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_T = TypeVar("_T")


def plain(t: Any) -> bool:
    """Whether ``t`` is a tensor whose ops may run with Python dispatch off (no ``__torch_dispatch__`` of its
    own: a plain tensor or a Parameter)."""
    return type(t) in _PLAIN


def call(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with Python dispatch off while a mode is on this thread's stack (else as it is: a lend
    with the sanitizer off pays no guard)."""
    if _modes():
        with quiet():
            return fn(*args)
    return fn(*args)


def _over_host(piece: np.ndarray, dtype: torch.dtype, retype: bool) -> torch.Tensor:
    view = from_numpy(piece)
    return view.view(dtype) if retype else view


def over_host(piece: np.ndarray, dtype: torch.dtype, retype: bool) -> torch.Tensor:
    """A ``dtype`` tensor over the host array ``piece`` (our own memory; ``retype``: numpy has no such
    dtype, ``piece`` holds its bytes as another of the same size): nothing for a mode to check."""
    if _modes():
        with quiet():
            return _over_host(piece, dtype, retype)
    return _over_host(piece, dtype, retype)


__all__ = ["quiet", "from_numpy", "as_numpy", "plain", "call", "over_host"]
