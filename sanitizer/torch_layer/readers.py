"""Reads and exports the dispatch mode cannot see, checked while a stale lease is reachable.

Some tensor methods touch memory in C++ without dispatching any aten op:
``tolist`` and ``apply_``/``map_``/``map2_`` read it; ``numpy``/``__array__``,
``__dlpack__`` and ``torch.utils.dlpack.to_dlpack`` hand it to another library;
``__reduce_ex__`` serialises it for ``pickle`` and ``torch.save``. While a stale
lease is reachable (and only then), :func:`set_hooks` wraps each so that it
checks its tensor first; afterwards the originals are put back, so a program
with no stale lease pays nothing.

Not reachable this way: calls through the C base class
(``torch._C.TensorBase.tolist(t)``) and raw pointers (``data_ptr()`` with
ctypes): the guard's tombstones make those read NaN. ``safetensors.torch.save``
copies through ctypes too; its ``_tobytes`` is wrapped when safetensors is
already imported at the moment a lease goes stale.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.utils.dlpack

Check = Callable[[torch.Tensor, str], Any]

_METHODS = ("tolist", "numpy", "__array__", "__dlpack__", "apply_", "map_", "map2_", "__reduce_ex__")
_FUNCTIONS: List[Tuple[Any, str]] = [(torch.utils.dlpack, "to_dlpack")]
if hasattr(torch, "to_dlpack"):
    _FUNCTIONS.append((torch, "to_dlpack"))

def _loaded_writers() -> List[Tuple[Any, str]]:
    """Third-party writers that read raw pointers, when already imported: safetensors' per-tensor
    helper (``_tobytes`` up to 0.5, ``_to_ndarray`` since), through which ``save``/``save_file``
    read each tensor's bytes by address."""
    st = sys.modules.get("safetensors.torch")
    if st is None:
        return []
    return [(st, name) for name in ("_tobytes", "_to_ndarray") if callable(getattr(st, name, None))]


_saved: Dict[Tuple[int, str], Tuple[Any, Any, bool]] = {}  # (id(owner), name) -> (owner, original, was own attr)
_wrappers: Dict[Tuple[int, str], Any] = {}


def _wrap(original: Any, where: str, check: Check) -> Any:
    @functools.wraps(original)
    def checked(*args, **kwargs):
        if args and isinstance(args[0], torch.Tensor):
            check(args[0], where)
        if where == "Tensor.map2_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            check(args[1], where)  # map2_ reads its other tensor too
        return original(*args, **kwargs)

    return checked


def set_hooks(on: bool, check: Optional[Check] = None) -> None:
    """Wrap (``on``, with ``check(tensor, where)``) or restore the unseen readers. Idempotent."""
    if not on:
        for key, (owner, original, own) in list(_saved.items()):
            del _saved[key]
            name = key[1]
            if vars(owner).get(name) is _wrappers.pop(key):  # someone else's patch on top: leave it
                if own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)
        return
    assert check is not None
    targets = [(torch.Tensor, name, f"Tensor.{name}") for name in _METHODS if hasattr(torch.Tensor, name)]
    targets += [(owner, name, f"{owner.__name__}.{name}") for owner, name in _FUNCTIONS + _loaded_writers()]
    for owner, name, where in targets:
        key = (id(owner), name)
        if key in _saved:
            continue
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        _saved[key] = (owner, original, own)
        _wrappers[key] = wrapper = _wrap(original, where, check)
        setattr(owner, name, wrapper)


def hooked() -> bool:
    return bool(_saved)


__all__ = ["set_hooks", "hooked"]
