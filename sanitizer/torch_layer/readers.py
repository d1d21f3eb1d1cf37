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
import threading
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


_EXPORTERS = {"Tensor.numpy", "Tensor.__array__", "Tensor.__dlpack__", "torch.utils.dlpack.to_dlpack",
              "torch.to_dlpack"}  # hand the tensor's memory itself to another library


def _makers() -> List[Tuple[Any, str, str]]:
    """Functions that make a new object over an export's memory (a tensor or an array with a storage of
    its own, which nothing on the Python side links back to the lease): their result is noted as the
    alias, so triage can name what holds it (issue 29, point 5). numpy's only when numpy is imported."""
    out = [(torch, "from_dlpack", "torch.from_dlpack"), (torch.utils.dlpack, "from_dlpack",
                                                           "torch.utils.dlpack.from_dlpack"),
           (torch, "from_numpy", "torch.from_numpy")]
    np = sys.modules.get("numpy")
    if np is not None:
        out.append((np, "from_dlpack", "numpy.from_dlpack"))
    return [(owner, name, where) for owner, name, where in out if callable(getattr(owner, name, None))]


_MAKERS = {"torch.from_dlpack", "torch.utils.dlpack.from_dlpack", "torch.from_numpy", "numpy.from_dlpack"}
_EXPORTERS |= _MAKERS


def _exported_tensor(obj: Any) -> Optional[torch.Tensor]:
    """The tensor whose memory ``obj`` (what a maker was given) exports: the tensor itself, or the one at
    the end of an array's ``.base`` chain (``t.numpy()`` is based on ``t``)."""
    for _ in range(8):
        if isinstance(obj, torch.Tensor):
            return obj
        obj = getattr(obj, "base", None)
        if obj is None:
            return None
    return None


class _Switches:
    """What the wrappers do now: stale checks (while a stale lease is reachable) and export notes (while a
    lease is alive). A wrapper reads these at each call; it is installed while either is on."""

    def __init__(self) -> None:
        self.check: Optional[Check] = None
        self.check_storage: Optional[Check] = None
        self.note: Optional[Note] = None


Note = Callable[[torch.Tensor, str, Any], None]  # (tensor, where, what the export returned)
_now = _Switches()
_exporting = threading.local()  # per thread: exporters running (one export is told once)
_saved: Dict[Tuple[int, str], Tuple[Any, Any, bool]] = {}  # (id(owner), name) -> (owner, original, was own attr)
_wrappers: Dict[Tuple[int, str], Any] = {}


def _wrap(original: Any, where: str, kind: type) -> Any:
    storage = kind is not torch.Tensor
    exporter = where in _EXPORTERS

    @functools.wraps(original)
    def checked(*args, **kwargs):
        __tracebackhide__ = True  # pytest: the user's line is where the read happened
        check = _now.check_storage if storage else _now.check
        if check is not None:
            try:
                if args and isinstance(args[0], kind):
                    check(args[0], where)
                if where in _TWO_OPERANDS and len(args) > 1 and isinstance(args[1], kind):
                    check(args[1], where)  # it reads (map2_) or copies from (copy_) its other operand too
            except Exception as err:  # raised by the check: its traceback starts here, not in our plumbing
                err.__traceback__ = None
                raise err
        if not exporter:
            return original(*args, **kwargs)
        depth = getattr(_exporting, "depth", 0)
        _exporting.depth = depth + 1
        try:
            result = original(*args, **kwargs)
        finally:
            _exporting.depth = depth
        note = _now.note
        if note is not None and not depth and args:
            source = _exported_tensor(args[0]) if where in _MAKERS else args[0]
            if isinstance(source, torch.Tensor):
                note(source, where, result)  # the outermost export only (``__array__`` calls ``numpy()``)
        return result

    return checked


_TWO_OPERANDS = ("Tensor.map2_", "UntypedStorage.copy_")


def _targets() -> List[Tuple[Any, str, str, type]]:
    storage = torch.UntypedStorage
    out = [(torch.Tensor, name, f"Tensor.{name}", torch.Tensor) for name in _METHODS if hasattr(torch.Tensor, name)]
    out += [(owner, name, f"{owner.__name__}.{name}", torch.Tensor) for owner, name in _FUNCTIONS + _loaded_writers()]
    out += [(storage, name, f"UntypedStorage.{name}", storage) for name in _STORAGE_METHODS if hasattr(storage, name)]
    out += [(owner, name, where, storage) for owner, name, where in _STORAGE_FUNCTIONS if hasattr(owner, name)]
    out += [(owner, name, where, torch.Tensor) for owner, name, where in _makers()]
    return out


def set_hooks(on: bool, check: Optional[Check] = None, check_storage: Optional[Check] = None) -> None:
    """Check (``on``, with ``check(tensor, where)`` and ``check_storage(storage, where)``) the unseen readers,
    or stop checking them. Idempotent."""
    if on:
        assert check is not None and check_storage is not None
    _now.check, _now.check_storage = (check, check_storage) if on else (None, None)
    _sync()


def set_export_notes(on: bool, note: Optional[Note] = None) -> None:
    """Tell ``note(tensor, where, result)`` of every export of a tensor's memory (numpy, DLPack), or stop."""
    _now.note = note if on else None
    _sync()


_synced_for: Optional[Tuple[bool, bool, int]] = None


def _sync() -> None:
    """Install the wrappers the switches need (every reader while checking; the exporters while noting),
    restore the others."""
    global _synced_for
    checking, noting = _now.check is not None, _now.note is not None
    # What the wanted set depends on: the two switches and which third-party writers are imported. A stale
    # mark calls this at every reuse (for writers imported since the last one): skip the rebuild then.
    signature = (checking, noting, id(sys.modules.get("safetensors.torch")), id(sys.modules.get("numpy")))
    if signature == _synced_for:
        return
    wanted = {(id(owner), name): (owner, name, where, kind) for owner, name, where, kind in _targets()
              if checking or (noting and where in _EXPORTERS)}
    for key, (owner, original, own) in list(_saved.items()):
        if key in wanted:
            continue
        del _saved[key]
        name = key[1]
        if vars(owner).get(name) is _wrappers.pop(key):  # someone else's patch on top: leave it
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
    for key, (owner, name, where, kind) in wanted.items():
        if key in _saved:
            continue
        own = name in vars(owner)
        original = vars(owner)[name] if own else getattr(owner, name)
        _saved[key] = (owner, original, own)
        _wrappers[key] = wrapper = _wrap(original, where, kind)
        setattr(owner, name, wrapper)
    _synced_for = signature


def hooked() -> bool:
    """Are the stale checks of the unseen readers on?"""
    return _now.check is not None and bool(_saved)


def noting() -> bool:
    return _now.note is not None


__all__ = ["set_hooks", "set_export_notes", "hooked", "noting"]
