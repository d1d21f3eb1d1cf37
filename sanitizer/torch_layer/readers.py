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
originals are put back, so a program with no stale lease pays nothing. A wrapper
stands in for its function as the function would (it binds, pickles, copies,
shows the same names, signature and ``repr``), and the sanitizer knows its own
wherever a user's patch leaves it: patching and restoring one of these around a
lend (``mock.patch``, pytest's ``monkeypatch``) never stacks wrappers, and the
original is back once nothing is wanted there (see :class:`_Wrapper`).

Not reachable this way: calls through the C base class
(``torch._C.TensorBase.tolist(t)``) and raw pointers (``data_ptr()`` with
ctypes): the guard's tombstones make those read NaN. ``safetensors.torch.save``
copies through ctypes too; its ``_tobytes`` is wrapped when safetensors is
already imported at the moment a lease goes stale.
"""
from __future__ import annotations

import importlib
import inspect
import sys
import threading
import types
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
_TWO_OPERANDS = ("Tensor.map2_", "UntypedStorage.copy_")
Key = Tuple[int, str]  # (id(owner), name)


class _Wrapper:
    """What stands in ``owner.name`` while its reads are checked or its exports noted.

    It behaves as the function it wraps for what a user does with it: it binds as a method (``__get__``),
    pickles as the original does (``pool.map(torch.from_numpy, arrays)``; a function object could not: pickle
    looks a function up by name and found the wrapper, or nothing, under the copied name), copies as itself,
    shows the original's name, docstring, signature (``__wrapped__``) and ``repr``, and lends any other
    attribute from it. Only the active wrapper of its ``owner.name`` acts: one that a user's patch left under
    theirs, or that a user's restore put back after the sanitizer let go (``mock.patch`` and pytest's
    ``monkeypatch`` restore in LIFO order around a lend), passes every call through, and puts the original
    back itself at its next call when nothing is wanted there any more."""

    def __init__(self, owner: Any, name: str, original: Any, own: bool, where: str, kind: type):
        d = self.__dict__
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            d[attr] = getattr(original, attr, None)  # (None where the original has none: not this module's name)
        d["__wrapped__"] = original
        d["_owner"], d["_name"], d["_own"], d["_where"] = owner, name, own, where
        d["_key"] = (id(owner), name)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else types.MethodType(self._call, obj)

    def __getattr__(self, name: str) -> Any:
        try:
            original = self.__dict__["__wrapped__"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["__wrapped__"], name, value)  # (a mock's return_value: set on the mock)

    def __delattr__(self, name: str) -> None:
        delattr(self.__dict__["__wrapped__"], name)

    def __repr__(self) -> str:
        return repr(self.__wrapped__)

    def __reduce_ex__(self, protocol: int) -> Any:
        original = self.__wrapped__
        if isinstance(original, (types.FunctionType, type)):
            reduced = original.__qualname__  # pickled by name (pickle never asks a function to reduce itself)
        else:
            reduced = original.__reduce_ex__(protocol)
            if not isinstance(reduced, str):
                return reduced  # a builtin's (getattr, (owner, name)): the same bytes as the original's
        module = getattr(original, "__module__", None)
        if _resolve(module, reduced) is self:
            return reduced  # pickle finds this wrapper under the original's name: the same GLOBAL opcode
        return (getattr, (_ByName(module, reduced.rpartition(".")[0]), reduced.rpartition(".")[2])) \
            if "." in reduced else (getattr, (_Module(module), reduced))

    def __copy__(self) -> "_Wrapper":
        return self  # functions are copied as themselves

    def __deepcopy__(self, memo: Any) -> "_Wrapper":
        return self


def _make(owner: Any, name: str, original: Any, own: bool, where: str, kind: type) -> _Wrapper:
    """A wrapper of ``original`` for ``owner.name``. Its call is one closure (one Python frame: a method binds
    the closure itself, a module function's class calls it as its ``__call__``), each wrapper of its own class;
    a wrapper costs about a plain function wrapper's call."""
    key = (id(owner), name)
    storage = kind is not torch.Tensor
    exporter = where in _EXPORTERS
    two = where in _TWO_OPERANDS
    maker = where in _MAKERS
    me: List[_Wrapper] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # pytest: the user's line is where the read happened
        if _ACTIVE.get(key) is not me[0]:
            _heal(me[0])
            return original(*args, **kwargs)
        check = _now.check_storage if storage else _now.check
        if check is not None:
            try:
                if args and isinstance(args[0], kind):
                    check(args[0], where)
                if two and len(args) > 1 and isinstance(args[1], kind):
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
            source = _exported_tensor(args[0]) if maker else args[0]
            if isinstance(source, torch.Tensor):
                note(source, where, result)  # the outermost export only (``__array__`` calls ``numpy()``)
        return result

    cls = type("_Wrapper", (_Wrapper,), {"__call__": staticmethod(call), "_call": staticmethod(call),
                                          "__module__": __name__})
    wrapper = cls(owner, name, original, own, where, kind)
    me.append(wrapper)
    return wrapper


class _Module:
    """Pickles as ``importlib.import_module(name)``: nothing of the sanitizer is needed to load what refers to it."""

    def __init__(self, name: Optional[str]):
        self.name = name

    def __reduce__(self) -> Any:
        return (importlib.import_module, (self.name,))


class _ByName(_Module):
    """Pickles as ``module.qualname`` (a class in a module, for a method)."""

    def __init__(self, module: Optional[str], qualname: str):
        super().__init__(module)
        self.qualname = qualname

    def __reduce__(self) -> Any:
        if "." in self.qualname:
            parent, _, last = self.qualname.rpartition(".")
            return (getattr, (_ByName(self.name, parent), last))
        return (getattr, (_Module(self.name), self.qualname))


def _resolve(module: Optional[str], qualname: str) -> Any:
    obj = sys.modules.get(module or "")
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


_lock = threading.RLock()  # every swap of an attribute, from a sync or from a wrapper putting its original back
_ACTIVE: Dict[Key, _Wrapper] = {}  # the wrapper that acts for each owner.name now
_WRAPPED: Dict[Key, Dict[int, _Wrapper]] = {}  # every wrapper made, per owner.name and per id(what it wraps)
_wanted: Dict[Key, Tuple[Any, str, str, type]] = {}  # what the last sync wanted wrapped


def _current(owner: Any, name: str) -> Any:
    return vars(owner)[name] if name in vars(owner) else getattr(owner, name, None)


def _ours_in_chain(fn: Any, key: Key) -> Optional[_Wrapper]:
    """Our wrapper of ``key`` at or under ``fn`` (a user's patch that keeps what it wraps in ``__wrapped__``,
    as ``functools.wraps`` does), else None."""
    for _ in range(16):
        if isinstance(fn, _Wrapper):
            return fn if fn.__dict__["_key"] == key else None
        try:
            fn = inspect.getattr_static(fn, "__wrapped__", None)
        except Exception:
            return None
        if fn is None:
            return None
    return None


def _a_mock(fn: Any) -> bool:
    """A ``unittest.mock`` object a user put there: the real function is not called through it, so there is
    nothing to check or note, and the user's ``is`` and configuration of it must keep working."""
    mock = sys.modules.get("unittest.mock")
    return mock is not None and isinstance(fn, mock.NonCallableMock)


def _install(key: Key, owner: Any, name: str, where: str, kind: type) -> None:
    """(Under the lock.) Make ours act for ``owner.name``: the one already on top or in a user's chain over it,
    else a wrapper of what is there now (made once per function wrapped: wrapping the same function again gives
    the same wrapper, so a patch-and-restore cycle around a lend never stacks them). A user's mock in place is
    left alone."""
    top = _current(owner, name)
    if _a_mock(top):
        _ACTIVE.pop(key, None)
        return
    ours = _ours_in_chain(top, key)
    if ours is None:
        made = _WRAPPED.setdefault(key, {})
        ours = made.get(id(top))
        if ours is None or ours.__wrapped__ is not top:
            ours = made[id(top)] = _make(owner, name, top, name in vars(owner), where, kind)
        setattr(owner, name, ours)
    _ACTIVE[key] = ours


def _put_back(key: Key, owner: Any, name: str) -> None:
    """(Under the lock.) Take ours off ``owner.name`` while one of ours is on top; one a user's patch covers
    stays there, passing calls through, until it is on top again (then a sync or its own next call ends it)."""
    _ACTIVE.pop(key, None)
    for _ in range(16):
        top = vars(owner).get(name)
        if not isinstance(top, _Wrapper) or top.__dict__["_key"] != key:
            return
        d = top.__dict__
        if d["_own"]:
            setattr(owner, name, d["__wrapped__"])
        else:
            delattr(owner, name)


def _heal(wrapper: _Wrapper) -> None:
    """A wrapper that does not act was called: when nothing is wanted for its ``owner.name`` and it is on top
    (a user put it back there), the original goes back now."""
    d = wrapper.__dict__
    key = d["_key"]
    if key in _wanted or vars(d["_owner"]).get(d["_name"]) is not wrapper:
        return
    with _lock:
        if key not in _wanted:
            _put_back(key, d["_owner"], d["_name"])


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


_synced_for: Optional[Tuple[bool, bool, int, int]] = None


def _sync() -> None:
    """Make ours act on the readers the switches need (every reader while checking; the exporters while
    noting) and put the others back. Also re-checks what a user's patch kept ours under, so a wrapper a
    user's restore put back on top after the last change is taken off at the next one.

    Re-entrant: a lease that dies in a garbage collection run by an allocation in here switches the hooks
    again from inside (the lock is re-entrant); the outer pass works on snapshots and goes round once more
    when the switches changed under it, so the last state wins."""
    global _synced_for
    with _lock:
        for _ in range(8):
            checking, noting = _now.check is not None, _now.note is not None
            # What the wanted set depends on: the two switches and which third-party writers are imported. A
            # stale mark calls this at every reuse (for writers imported since the last one): skip then.
            signature = (checking, noting, id(sys.modules.get("safetensors.torch")), id(sys.modules.get("numpy")))
            if signature == _synced_for:
                return
            wanted = {(id(owner), name): (owner, name, where, kind) for owner, name, where, kind in _targets()
                      if checking or (noting and where in _EXPORTERS)}
            for key, made in list(_WRAPPED.items()):  # (every owner.name ever wrapped: a few dozen)
                if key not in wanted and made:
                    d = next(iter(list(made.values()))).__dict__
                    _put_back(key, d["_owner"], d["_name"])
            _wanted.clear()
            _wanted.update(wanted)
            for key, (owner, name, where, kind) in list(wanted.items()):
                _install(key, owner, name, where, kind)
            _synced_for = signature


def sweep() -> None:
    """Take ours off wherever nothing is wanted any more and ours is on top again (a user's patch that covered
    ours when the sanitizer let go, restored since): at every enable and disable, whatever the switches."""
    global _synced_for
    with _lock:
        _synced_for = None
    _sync()


def hooked() -> bool:
    """Are the stale checks of the unseen readers on?"""
    return _now.check is not None and bool(_ACTIVE)


def noting() -> bool:
    return _now.note is not None


__all__ = ["set_hooks", "set_export_notes", "sweep", "hooked", "noting"]
