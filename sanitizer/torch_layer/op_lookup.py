"""Make torch's first lookup of an op's Python object happen once, whatever the threads.

Why this exists (issue 17: safetensors' own multithreaded test segfaulted under the
sanitizer about 1 run in 10). With a Python dispatch mode on a thread's stack, every op
that thread runs is handed to Python as its ``OpOverload`` object
(``torch.ops.aten.set_.source_Storage``). libtorch_python finds that object once per op
(``torch::detail::getTorchApiFunction``: ``torch.ops.<ns>.<op>.<overload>`` by attribute)
and caches the *borrowed* pointer for the life of the process (``c10::PyHandleCache``, whose
contract is that the object lives forever). torch.ops builds those objects lazily, in the
Python ``__getattr__`` of ``_Ops`` (namespaces), ``_OpNamespace`` (packets) and
``OpOverloadPacket`` (overloads): miss, build, ``setattr``. The GIL can pass to another
thread in the middle. Two threads that miss the same attribute at once both build one, the
later ``setattr`` replaces the earlier, and the earlier is freed while the first thread's C++
cache (or its borrowed packet handle) still points to it: a later dispatch of that op reads
freed memory, typically at ``op.__qualname__`` in
``torch/_library/simple_registry.py find_torch_dispatch_rule``.

Without a Python mode nothing takes that path. torch's default dynamo-disable shim on
``__torch_dispatch__`` only hid it: its first call imports ``torch._dynamo``, which happens to
build ``set_.source_Storage`` (the one op of the safetensors pattern that ``import torch``
leaves unbuilt) in one thread under the import lock. Ops that import builds neither still race.

The fix: one re-entrant lock around those three ``__getattr__``, re-reading the instance dict
under it, so each object is built exactly once and never replaced. ``__getattr__`` runs only on
a miss (the first lookup of each namespace, op and overload in the process; a found attribute
never reaches it), so the per-op cost is nil. Installed before the first mode of ours is pushed
and never removed: the modes of threads other than main stay on their stacks after
``disable()`` (see mode.py), and the lock is correct with no mode at all. What runs under the
lock builds an op object (``torch._C`` schema look-ups, ``torch.jit``'s builtin table, built at
``import torch``) and imports nothing, so no import lock can wait on it.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, List, Tuple

import torch._ops

_lock = threading.RLock()
_MISSING = object()
_installed: List[Tuple[type, Callable[..., Any]]] = []  # (class, its original __getattr__)


_LAZY_LEVELS = ("_Ops", "_OpNamespace", "OpOverloadPacket")  # namespaces, packets, overloads


def _classes() -> Tuple[type, ...]:
    """The torch.ops levels that build their attributes lazily in their own ``__getattr__``."""
    found = (getattr(torch._ops, name, None) for name in _LAZY_LEVELS)
    return tuple(cls for cls in found if isinstance(cls, type) and "__getattr__" in cls.__dict__)


def _built_once(original: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    def __getattr__(self: Any, name: str) -> Any:
        with _lock:
            built = self.__dict__.get(name, _MISSING)  # another thread built it while we waited
            if built is not _MISSING:
                return built
            return original(self, name)

    __getattr__.__wrapped__ = original  # type: ignore[attr-defined]
    __getattr__.__doc__ = original.__doc__
    return __getattr__


def serialize_op_lookups() -> None:
    """Install the lock (idempotent; cheap to call again)."""
    if _installed:
        return
    with _lock:
        if _installed:
            return
        for cls in _classes():
            original = cls.__dict__["__getattr__"]
            cls.__getattr__ = _built_once(original)  # type: ignore[method-assign]
            _installed.append((cls, original))


def serialized() -> bool:
    """Are torch.ops' lazy look-ups behind the lock (in this process)?"""
    return bool(_installed)


def _reset_lock_in_child() -> None:
    """A child forked while another thread held the lock would wait on it forever."""
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_lock_in_child)


__all__ = ["serialize_op_lookups", "serialized"]
