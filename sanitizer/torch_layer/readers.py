"""Reads and exports the dispatch mode cannot see, checked while a stale lease is reachable.

Some tensor methods touch memory in C++ without dispatching any aten op:
``tolist`` and ``apply_``/``map_``/``map2_`` read it; ``numpy``/``__array__``,
``__dlpack__`` and ``torch.utils.dlpack.to_dlpack`` hand it to another library;
``__reduce_ex__`` serialises it for ``pickle`` and ``torch.save``; ``__repr__``
prints it with every dispatch mode turned off (torch's printing disables them,
then calls ``.item()``: a stale 0-dim view printed the next tensor's value).
A lease's storage has its own API: indexing, ``tolist``, ``clone``, ``copy_``,
``fill_``, item assignment, pickling, and ``torch.save`` of a storage (through
``torch.serialization.location_tag``, which it calls for every storage it
writes). While a stale lease is reachable (and only then), :func:`set_hooks`
wraps each so that it checks its tensor or storage first; afterwards the
originals are put back, so a program with no stale lease pays nothing.

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

Check = Callable[[Any, str], Any]  # (tensor or storage, where) -> True when it reported a stale use

_METHODS = ("tolist", "numpy", "__array__", "__dlpack__", "apply_", "map_", "map2_", "__reduce_ex__", "__repr__")
_FUNCTIONS: List[Tuple[Any, str]] = [(torch.utils.dlpack, "to_dlpack")]
if hasattr(torch, "to_dlpack"):
    _FUNCTIONS.append((torch, "to_dlpack"))
_STORAGE_METHODS = ("__getitem__", "__setitem__", "tolist", "clone", "copy_", "fill_", "__reduce__", "__iter__",
                    "__deepcopy__", "_write_file")
_STORAGE_FUNCTIONS: List[Tuple[Any, str, str]] = [(torch.serialization, "location_tag", "torch.save")]  # per storage

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


def _wrap(original: Any, where: str, check: Check, kind: type) -> Any:
    @functools.wraps(original)
    def checked(*args, **kwargs):
        if args and isinstance(args[0], kind):
            check(args[0], where)
        if where in _TWO_OPERANDS and len(args) > 1 and isinstance(args[1], kind):
            check(args[1], where)  # it reads (map2_) or copies from (copy_) its other operand too
        return original(*args, **kwargs)

    return checked


_TWO_OPERANDS = ("Tensor.map2_", "UntypedStorage.copy_")


def set_hooks(on: bool, check: Optional[Check] = None, check_storage: Optional[Check] = None) -> None:
    """Wrap (``on``, with ``check(tensor, where)`` and ``check_storage(storage, where)``) or restore the
    unseen readers. Idempotent."""
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
    assert check is not None and check_storage is not None
    storage = torch.UntypedStorage
    targets = [(torch.Tensor, name, f"Tensor.{name}", check, torch.Tensor)
               for name in _METHODS if hasattr(torch.Tensor, name)]
    targets += [(owner, name, f"{owner.__name__}.{name}", check, torch.Tensor)
                for owner, name in _FUNCTIONS + _loaded_writers()]
    targets += [(storage, name, f"UntypedStorage.{name}", check_storage, storage)
                for name in _STORAGE_METHODS if hasattr(storage, name)]
    targets += [(owner, name, where, check_storage, storage)
                for owner, name, where in _STORAGE_FUNCTIONS if hasattr(owner, name)]
    for owner, name, where, checker, kind in targets:
        key = (id(owner), name)
        if key in _saved:
            continue
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        _saved[key] = (owner, original, own)
        _wrappers[key] = wrapper = _wrap(original, where, checker, kind)
        setattr(owner, name, wrapper)


def hooked() -> bool:
    return bool(_saved)


__all__ = ["set_hooks", "hooked"]
