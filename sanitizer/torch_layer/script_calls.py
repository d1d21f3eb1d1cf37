"""TorchScript keeps a sanitizer error's text: re-raise it at the scripted call's boundary.

When a dispatch mode raises inside an op that TorchScript's interpreter runs, torch turns the
Python exception into a C++ ``python_error`` without fetching it, and the interpreter reports
it as ``RuntimeError: `` with an empty message (torch 2.x; the exception's ``args`` are not the
cause: they are set). So while the sanitizer is enabled, the Python entry points of scripted
code (``torch._C.ScriptFunction`` and ``torch._C.ScriptMethod``, which ``torch.jit.script`` and
``torch.jit.trace`` functions and modules go through) are wrapped: when a call fails with a
RuntimeError after the sanitizer raised an error in this thread during it, the wrapper raises a
copy of that error (same class, text and record), chained from TorchScript's error, whose text
says where in the script it happened.

The same loss hits any error an op raises while the sanitizer's mode is installed (the mode calls
the op from Python): the mode passes such exceptions to :func:`note`, and the wrapper re-raises the
op's own exception when TorchScript's report of it came out empty.

:func:`install` (called by :func:`sanitizer.activation.compose`) registers an enable hook that wraps
the entry points; the wrapper removes itself at the first scripted call after the sanitizer is disabled.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict

import torch

from sanitizer.core import forking
from sanitizer.core import errors
from sanitizer.core.options import Options
from sanitizer.torch_layer import records
from sanitizer.torch_layer.hooks import add_enable_hook, add_op_error_hook
from sanitizer.torch_layer.state import state

_CLASSES = tuple(c for c in (getattr(torch._C, "ScriptFunction", None), getattr(torch._C, "ScriptMethod", None))
                 if c is not None)
_lock = threading.Lock()
_originals: Dict[type, Callable[..., Any]] = {}


_tls = threading.local()  # per thread: scripted calls in progress, and the exception the mode saw pass


def note(exc: BaseException) -> None:
    """Called by the dispatch mode when an op it ran raised ``exc``: inside a scripted call, TorchScript
    is about to drop that exception's text, so keep it for the call's boundary. Outside one: nothing."""
    if getattr(_tls, "depth", 0):
        _tls.noted = exc


def _lost_text(exc: RuntimeError) -> bool:
    """TorchScript's report of a Python exception it did not fetch ends with an empty ``RuntimeError:``."""
    return str(exc).rstrip().endswith("RuntimeError:")


def _wrapper(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not state.enabled:
            hook(False)
            return orig(self, *args, **kwargs)
        mark = records.error_mark()
        depth, noted = getattr(_tls, "depth", 0), getattr(_tls, "noted", None)
        _tls.depth, _tls.noted = depth + 1, None
        try:
            return orig(self, *args, **kwargs)
        except errors.OwnershipError:
            raise
        except RuntimeError as exc:
            err = records.raised_since(mark) if state.options.halts else None
            if err is None and _lost_text(exc):  # an op's own error whose text TorchScript dropped
                err = _tls.noted
            if err is None or err is exc:  # not ours (with halt_on_error=0 the sanitizer never raises)
                raise
            try:
                raise err from exc
            finally:  # the traceback keeps this frame: drop the caller's tensors and the error from it
                del err, args, kwargs
        finally:
            _tls.depth, _tls.noted = depth, noted

    __call__.__wrapped__ = orig  # type: ignore[attr-defined]
    __call__._ownsan_script_call = True  # type: ignore[attr-defined]
    return __call__


def hook(on: bool) -> None:
    """Wrap (``on``) or restore the Python entry points of scripted functions and methods (idempotent)."""
    with _lock:
        for cls in _CLASSES:
            current = cls.__dict__.get("__call__")
            wrapped = getattr(current, "_ownsan_script_call", False)
            if on and not wrapped and current is not None:
                _originals[cls] = current
                cls.__call__ = _wrapper(current)
            elif not on and wrapped and cls in _originals:
                cls.__call__ = _originals.pop(cls)


def hooked() -> bool:
    return any(getattr(c.__dict__.get("__call__"), "_ownsan_script_call", False) for c in _CLASSES)


def _on_enable(options: Options) -> None:
    hook(True)


def install() -> None:
    """Wrap scripted calls at every enable, and have the dispatch mode tell us of an op's own exception."""
    add_enable_hook(_on_enable)
    add_op_error_hook(note)
    if state.enabled:  # composed after enable(): arm now
        hook(True)



@forking.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


__all__ = ["install", "hook", "hooked", "note"]
