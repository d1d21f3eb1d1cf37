"""The dispatch mode that refuses stale borrowed storages, and where it is installed.

Per op, the mode does one dict test (are any leases stale at all?) and, only
then, one storage-address lookup per tensor argument. No pytree, no stack
capture: those cost 20 µs and more per op (see docs/domain notes).

Dispatch modes live on a per-thread stack; :class:`ModeController` decides
where ours sits. The main thread carries it only while a stale lease exists (a
program whose leases are all fresh pays nothing per op there), following every
change at once or, when another thread made it, at its next eval-breaker check
(a call into Python code, a loop's jump back) through CPython's pending-call queue
(``Py_AddPendingCall``). On Python 3.11+
other threads follow the same rule: at the first stale lease every running
thread is made to install the mode at its next Python call (a visit through its
profile function that keeps any profiler it has, see core/thread_reach.py), and
when interception ends each removes it again, so a worker pays nothing per op
while nothing is stale. A removal never happens while an op is under way in the
thread (:func:`stack_change_safe`): it waits for the thread's next Python event
outside any op. Where running threads cannot be reached (3.10, an odd build) a
running thread cannot be given the mode later:
other threads get it when they start while the sanitizer is enabled, or when
they lend, and keep it until they end, taking the cheap path while nothing is
stale; threads started before ``enable()`` that never lend are not checked
there (enable first: ``OWNERSHIP_SANITIZE=1`` does). The guard's tombstones
cover their reads either way.
"""
from __future__ import annotations

import atexit
import ctypes
import re
import sys
import threading
import weakref
from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sanitizer.core import thread_reach
from sanitizer.torch_layer import op_lookup
from sanitizer.torch_layer.hooks import HOOKS

_aten = torch.ops.aten

# Which arguments of an op touch tensor *data* is read from the op's schema, as PyTorch's
# stream sanitizer (torch.cuda._sanitizer) does: an argument aliased by the output and not
# written (a view's input: view, narrow, t, detach, alias...) is metadata only; so are the
# inputs of factories that copy only metadata (new_*, *_like); an op returning only
# non-tensor values (bool, int, sizes) that writes nothing and is not tagged
# data_dependent_output (is_pinned, sym_size, is_same_size...) reads metadata only.
# Everything else (reads, and writes through Tensor(a!) arguments) is checked. A stale view
# may thus still be viewed and asked its shape, as with JAX's deleted arrays.
_FACTORY = re.compile(r"(new_.*|.*_like)$")
_DATA_DEPENDENT = getattr(torch.Tag, "data_dependent_output", None)
_TO_COPY = _aten._to_copy.default  # .to("meta") copies nothing: decided per call

CheckPlan = Union[bool, Tuple[Tuple[int, str], ...]]
"""True: every tensor argument; False: none; else (position, name) of the arguments to check."""
_PLANS: Dict[int, Tuple[Any, CheckPlan]] = {}
"""id(op) -> (op, its plan). Keyed by id because an OpOverload's ``__hash__`` is Python code (~60 ns a
look-up, on every op while a lease is stale); the op is kept beside its plan, so the id cannot be reused
by another op while the entry exists, and an entry whose op is not ``func`` is simply rebuilt."""
_Tensor = torch.Tensor


def _holds_tensors(arg: Any) -> bool:
    return "Tensor" in str(arg.type)


def _plan(func: Any) -> CheckPlan:
    """Which arguments of ``func`` read or write tensor data, from its schema (cached per op)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    tensor_args = [(i, a) for i, a in enumerate(schema.arguments) if _holds_tensors(a)]
    if _FACTORY.match(schema.name.split("::")[-1]):
        # A metadata factory reads no data of its inputs, but its out= variant writes its out tensor.
        out = tuple((i, a.name) for i, a in tensor_args if a.alias_info is not None and a.alias_info.is_write)
        return out or False
    written = [a for _, a in tensor_args if a.alias_info is not None and a.alias_info.is_write]
    if (schema.returns and not written and not any(_holds_tensors(r) for r in schema.returns)
            and not (_DATA_DEPENDENT is not None and _DATA_DEPENDENT in getattr(func, "tags", ()))):
        return False  # a metadata query
    checked = [(i, a.name) for i, a in tensor_args if a.alias_info is None or a.alias_info.is_write]
    if not checked:
        return False
    return True if len(checked) == len(tensor_args) else tuple(checked)


# The dispatch-mode stack is manipulated through torch's private stack API (present since
# torch 2.1; this package needs 2.4): ours goes beneath the user's modes and leaves from
# wherever it is. Infra modes (fake, proxy, functional) live in slots of their own.
_INFRA_KEYS = tuple(torch._C._TorchDispatchModeKey.__members__.values())

_excluded = getattr(torch._C, "_dispatch_tls_is_dispatch_key_excluded", None)
_INSIDE_DISPATCH_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in ("PythonTLSSnapshot", "Python")
                              if hasattr(torch._C.DispatchKey, name))


def stack_change_safe() -> bool:
    """May this thread's dispatch-mode stack lose a mode now? Not while a Python-dispatched op is under way
    in it: torch's Python fallback chose the top mode before it builds the op's Python arguments, and pops it
    after; a mode removed in between (by a lease that died in a garbage collection those allocations ran) left
    it nothing to pop: ``INTERNAL ASSERT FAILED ... dispatch_on_subclass called with NO overloaded args``, in an
    op that touched no borrowed view (issue 46). The fallback excludes the PythonTLSSnapshot key for its whole
    run (and ``_DisableTorchDispatch`` the Python key): either one excluded means "wait"."""
    if _excluded is None:
        return True
    for key in _INSIDE_DISPATCH_KEYS:
        if _excluded(key):
            return False
    return True



StaleHandler = Callable[[Any, Any, torch.Tensor], None]  # (lease, func, tensor)

_address_lookups: Tuple[Callable[[torch.Tensor], Any], ...] = ()
"""Registered through :func:`add_address_lookup` (trap mode): each answers the stale lease whose memory
holds a tensor whose storage the stale set does not know (``from_dlpack``/``from_numpy``/``frombuffer``
of a lease), or None. Read on the hot path only when one is registered."""


def add_address_lookup(lookup: Callable[[torch.Tensor], Any]) -> None:
    """Declare a look-up of stale leases by address (idempotent)."""
    global _address_lookups
    if lookup not in _address_lookups:
        _address_lookups = _address_lookups + (lookup,)


def lease_by_address(t: torch.Tensor) -> Any:
    """The stale lease a registered look-up finds for ``t`` by its address, or None."""
    for lookup in _address_lookups:
        lease = lookup(t)
        if lease is not None:
            return lease
    return None


class BorrowCheckMode(TorchDispatchMode):
    """Raises (through ``on_stale``) before any op touches a stale lease's storage.

    Placed on the stack by :class:`ModeController` directly (not with ``with``),
    so it never sets torch's process-wide "inside a mode" flags.
    """

    def __init__(self, stale: Mapping[int, Any], on_stale: StaleHandler):
        super().__init__()
        self.stale = stale
        self._on_stale = on_stale
        self.leave_requested = False  # a removal had to wait (see ModeController.uninstall_here)
        self.on_leave_waiting: Optional[Callable[[], None]] = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No dynamo-disable shim around ``__torch_dispatch__`` (torch adds one by default): its two
        extra frames cost ~2.5 µs per op, and in a kept error's traceback they hold the op's
        arguments, so a caught-and-kept StaleBorrowError kept the stale view alive; and its first
        call imports torch._dynamo (seconds). Compilation never traces into the mode anyway (see
        :meth:`ignore_compile_internals`). Dropping it once seemed to crash threaded programs
        (issue 17); the crash was torch's op look-up race, which that import only happened to hide
        for some ops: op_lookup closes it for every op."""
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile keeps compiling while a lease is alive; compiled kernels run unchecked
        (the guard's tombstones still keep them off the next tensor's bytes)."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.stale:
            entry = _PLANS.get(id(func))
            if entry is None or entry[0] is not func:
                entry = _PLANS[id(func)] = (func, _plan(func))
            plan = entry[1]
            if plan and not (func is _TO_COPY and kwargs and _is_meta(kwargs.get("device"))):
                try:
                    if plan is True:
                        self._scan(func, args)
                        if kwargs:
                            self._scan(func, kwargs.values())
                    else:
                        self._scan_some(func, plan, args, kwargs)
                except Exception as err:
                    # The traceback starts here, at the op the user called (our plumbing below is
                    # nobody's business), and a caught error must not keep the stale view alive: the
                    # finished frames go with their traceback, and this frame drops its references.
                    __tracebackhide__ = True  # noqa: F841  (pytest)
                    err.__traceback__ = None
                    args = kwargs = None  # noqa: F841
                    raise err
        elif self.leave_requested and self.on_leave_waiting is not None:
            self.on_leave_waiting()  # (a removal waits for a safe point: make sure something will retry it)
        try:
            if kwargs:
                return func(*args, **kwargs)
            return func(*args)
        except Exception as exc:  # free when nothing raises (zero-cost try)
            for hook in HOOKS.op_error:  # (script_calls keeps the text for TorchScript)
                hook(exc)
            raise

    def _scan(self, func: Any, values) -> None:
        # The common argument, a plain dense tensor, is looked up inline (no call per tensor: this
        # runs for every tensor argument of every op while a lease is stale); subclasses, and the
        # layouts without a storage of their own (their storage access raises), go to _test.
        stale = self.stale
        for a in values:
            if type(a) is _Tensor:
                try:
                    lease = stale.get(a.untyped_storage()._cdata)
                except (RuntimeError, NotImplementedError):  # sparse, mkldnn: no storage of their own
                    self._test(func, a, stale)
                    continue
                if lease is not None:
                    self._on_stale(lease, func, a)
                elif _address_lookups:
                    lease = lease_by_address(a)
                    if lease is not None:
                        self._on_stale(lease, func, a)
            elif isinstance(a, _Tensor):
                self._test(func, a, stale)
            elif isinstance(a, (list, tuple)):  # a Tensor[] argument: one call per list, not per tensor
                self._scan(func, a)

    def _scan_some(self, func: Any, plan: Tuple[Tuple[int, str], ...], args: tuple, kwargs: Optional[dict]) -> None:
        picked = [args[i] if i < len(args) else (kwargs or {}).get(name) for i, name in plan]
        self._scan(func, picked)

    def _test(self, func: Any, t: torch.Tensor, stale: Mapping[int, Any], depth: int = 0) -> None:
        if type(t) is not torch.Tensor:
            if hasattr(t, "__tensor_flatten__"):
                # A wrapper subclass (TwoTensor-style) holds its data in inner tensors, which its own
                # __torch_dispatch__ computes on below us, where we no longer see: look inside now.
                for inner in _inner_tensors(t):
                    self._test(func, inner, stale, depth + 1)
                return
            if depth < _MAX_WRAPPER_DEPTH and getattr(t, "__dict__", None) and _is_wrapper(t):
                # A wrapper without __tensor_flatten__ (an older or hand-written one: no data of its own)
                # keeps its inner tensor in an attribute: it read the tombstone's NaN instead of raising.
                # Only a wrapper: a subclass with data of its own (a Parameter) computes on that data,
                # and what its attributes hold is not read by this op.
                for inner in _wrapped_tensors(t):
                    self._test(func, inner, stale, depth + 1)
        if t.layout is not torch.strided:
            # A sparse tensor built over a lease keeps the lease's storage as its values (or indices):
            # it has no storage of its own to look up.
            for part in _sparse_parts(t):
                self._test(func, part, stale)
            return
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # nested, storage-less subclasses
            return
        lease = stale.get(key)
        if lease is None and _address_lookups:
            lease = lease_by_address(t)
        if lease is not None:
            self._on_stale(lease, func, t)


def _sparse_parts(t: torch.Tensor) -> List[torch.Tensor]:
    """The dense tensors a sparse tensor is made of (values and indices), [] for other layouts."""
    layout = t.layout
    try:
        if layout is torch.sparse_coo:
            return [t._values(), t._indices()]
        if layout in (torch.sparse_csr, torch.sparse_bsr):
            return [t.values(), t.crow_indices(), t.col_indices()]
        if layout in (torch.sparse_csc, torch.sparse_bsc):
            return [t.values(), t.ccol_indices(), t.row_indices()]
    except (RuntimeError, NotImplementedError):
        return []
    return []


def _inner_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    try:
        names = t.__tensor_flatten__()[0]
    except Exception:  # not a traceable wrapper after all
        return []
    inner = (getattr(t, n, None) for n in names)
    return [x for x in inner if isinstance(x, torch.Tensor)]


_MAX_WRAPPER_DEPTH = 32  # wrappers of wrappers followed this deep (attributes may form a cycle)


def _is_wrapper(t: torch.Tensor) -> bool:
    """A subclass made with ``_make_wrapper_subclass``: its storage has no data (reading it raises)."""
    try:
        return t.untyped_storage().data_ptr() == 0 and t.numel() > 0
    except (RuntimeError, NotImplementedError):
        return True


def _wrapped_tensors(t: torch.Tensor, limit: int = 64) -> List[torch.Tensor]:
    """The tensors under a wrapper's attributes, through wrappers of wrappers (each looked at once:
    attributes may form cycles), at most ``limit``; the wrappers themselves are left out."""
    out: List[torch.Tensor] = []
    seen = {id(t)}
    todo = [t]
    while todo and len(seen) <= limit:
        for inner in _attribute_tensors(todo.pop()):
            if id(inner) in seen:
                continue
            seen.add(id(inner))
            if type(inner) is not torch.Tensor and not hasattr(inner, "__tensor_flatten__") and _is_wrapper(inner):
                todo.append(inner)
            else:
                out.append(inner)
    return out


def _attribute_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The tensors a subclass instance keeps in its attributes (directly or in a list or tuple)."""
    d = getattr(t, "__dict__", None)
    if not d:
        return []
    out: List[torch.Tensor] = []
    for v in d.values():
        if isinstance(v, torch.Tensor):
            if v is not t:
                out.append(v)
        elif type(v) in (list, tuple):
            out.extend(x for x in v if isinstance(x, torch.Tensor) and x is not t)
    return out


def _is_meta(device: Any) -> bool:
    """``.to("meta")`` (``_to_copy(..., device=meta)``) copies no data: not a read."""
    return device is not None and torch.device(device).type == "meta"


class ModeController:
    """Places :class:`BorrowCheckMode` in threads, and takes it out again, by these rules.

    * **Beneath the user's modes.** Ours is inserted at the bottom of a thread's
      (non-infra) dispatch-mode stack, so a user mode entered before or after is
      always above it and its ``__exit__`` pops its own mode, never ours.
    * **Gone before its thread ends.** A thread ending with a Python mode object in
      its C++ thread-local stack releases it after its Python state is gone; if the
      interpreter is finalizing then, the process aborts ("terminate called without
      an active exception"). So threads remove ours on their way out
      (``Thread._delete``), and the main thread at exit (``atexit``).
    * **Never dropped while it may be needed.** A thread other than main keeps its
      mode until it ends (a mode cannot be pushed into another thread later);
      :meth:`arm` makes all of them inert on ``disable()`` and live again on ``enable()``.
      Only the main thread follows ``wants()`` both ways, through
      ``Py_AddPendingCall`` when another thread changes the state.
    """

    def __init__(self, stale: Dict[int, Any], on_stale: StaleHandler):
        self._stale = stale
        self._on_stale = on_stale
        self._armed = True
        self._tls = threading.local()
        # Re-entrant: a lease that dies in a garbage collection run by an allocation made under it reaches
        # uninstall_here on the same thread.
        self._lock = threading.RLock()
        self._modes: "weakref.WeakSet[BorrowCheckMode]" = weakref.WeakSet()
        self._installed = 0  # threads whose stack holds one of ours
        self._orig_bootstrap: Optional[Callable] = None
        # 3.11+: other threads carry the mode only while the main thread's interception is on, re-armed in
        # every running thread at the first stale lease (thread_reach); False: each keeps it for its life
        self.lazy_workers = False
        self._warned_unreachable = False
        self._orig_delete: Optional[Callable] = None
        self._atexit = False
        self._main_wants: Callable[[], bool] = lambda: False
        self._worker_wants: Callable[[], bool] = lambda: True  # (lazy workers: what the last sync asked)
        self._pending = _PendingCall(self._sync_main) if _PendingCall.available() else None
        # Visits a third party took away before they ran (a profiler resetting every thread's profile function):
        # the threads are visited again, from the main thread at its next eval-breaker check.
        self._pending_reach = _PendingCall(self._reach_again) if _PendingCall.available() else None
        if self._pending_reach is not None:
            thread_reach.on_lost = self._pending_reach.schedule

    def after_fork_in_child(self) -> None:
        """In a forked child only the forking thread exists: a fresh lock, the count of threads carrying
        a mode is this one's, and no pending call is queued any more."""
        self._lock = threading.RLock()
        self._installed = 1 if self.installed_here() else 0
        if self._pending is not None:
            self._pending._scheduled = False
        if self._pending_reach is not None:
            self._pending_reach._scheduled = False

    # -- this thread -------------------------------------------------------------
    def installed_here(self) -> bool:
        return getattr(self._tls, "mode", None) is not None

    def install_here(self) -> None:
        """Insert a mode beneath this thread's user modes (no-op when one is there)."""
        mode = getattr(self._tls, "mode", None)
        if mode is not None:
            mode.leave_requested = False  # (wanted again: a removal that waited is off)
            return
        # A Python mode makes libtorch_python look up and cache each op's Python object; two
        # threads doing that first look-up at once could free the cached one (see op_lookup).
        op_lookup.serialize_op_lookups()
        mode = BorrowCheckMode(self._stale if self._armed else _NOTHING_STALE, self._on_stale)
        mode.on_leave_waiting = self._leave_waiting
        _insert_at_bottom(mode)
        self._tls.mode = mode
        with self._lock:
            self._modes.add(mode)
            self._installed += 1
            self._watch_thread_ends()

    def uninstall_here(self, force: bool = False) -> bool:
        """Take this thread's mode off its stack, wherever it sits; False if it must wait.

        It waits while a Python-dispatched op is under way in this thread (:func:`stack_change_safe`: our
        own ``__torch_dispatch__``, a user mode's, or the moment torch's fallback has chosen a mode and not
        yet popped it, when a lease's death in a garbage collection gets here): the mode stays, passing
        everything through, and the removal is retried at this thread's next Python call or return outside
        any op (a visit: :func:`sanitizer.core.thread_reach.run_here_when`), or at the next lend or reuse.
        ``force``: a thread's end and interpreter exit, where no op runs and nothing may stay.
        """
        mode = getattr(self._tls, "mode", None)
        if mode is None:
            return True
        if not force and not stack_change_safe():
            mode.leave_requested = True
            self._leave_waiting()
            return False
        if not _remove_from_stack(mode):
            mode.leave_requested = True
            self._leave_waiting()
            return False
        mode.leave_requested = False
        self._tls.mode = None
        with self._lock:
            self._installed -= 1
        return True

    def _leave_waiting(self) -> None:
        """A removal waits: have this thread retry it at its next Python event outside any op (no-op when a
        visit already waits here, or where visits are not possible: the next lend or reuse retries then)."""
        thread_reach.run_here_when(stack_change_safe, self._retry_here)

    def _retry_here(self) -> None:
        """A waiting removal's retry, in its thread: follow what this thread's rule wants now."""
        mode = getattr(self._tls, "mode", None)
        if mode is None or not mode.leave_requested:
            return
        if threading.current_thread() is threading.main_thread():
            self._sync_main()
        elif not self._armed or (self.lazy_workers and not self._worker_wants()):
            self.uninstall_here()
        else:
            mode.leave_requested = False  # (an eager worker keeps its mode; it was only inert)

    # -- every thread ------------------------------------------------------------
    def arm(self, on: bool) -> None:
        """Make every mode of ours check (``on``) or pass everything through (disabled)."""
        with self._lock:
            self._armed = on
            for mode in list(self._modes):
                mode.stale = self._stale if on else _NOTHING_STALE

    # -- the main thread ---------------------------------------------------------
    def sync_main(self, wants: Callable[[], bool]) -> None:
        """Make the main thread install or remove its mode as ``wants()`` says, soon.

        From the main thread this happens now; from another thread it is queued
        to run in the main thread at its next eval-breaker check (a call into Python code, a loop's jump back).
        """
        self._main_wants = wants
        if threading.current_thread() is threading.main_thread():
            self._sync_main()
        elif self._pending is not None:
            self._pending.schedule()

    def retry_leave(self) -> None:
        """Retry a removal that had to wait (the last stale lease died inside an op: one of our own
        dispatches, e.g. ``set_``, or a garbage collection under torch's fallback): called at the next lend
        and reuse, outside any op."""
        mode = getattr(self._tls, "mode", None)
        if mode is not None and mode.leave_requested:
            self._retry_here()

    def _sync_main(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self._main_wants():
            self.install_here()
        else:
            self.uninstall_here()

    # -- other threads, lazily (Python 3.11+) ----------------------------------------
    def sync_workers(self, wants: Callable[[], bool]) -> None:
        """Make every other running thread install or remove its mode as ``wants()`` says, at its next
        Python call or return (a visit: :func:`sanitizer.core.thread_reach.run_in_running_threads`, which
        keeps each thread's own profiler), and this thread now when it is not main.

        Only with :attr:`lazy_workers`. When the threads cannot be reached after all (an audit hook refused
        ``sys.setprofile``), threads stay as they are and the controller falls back to the eager rule (a
        thread keeps a mode for its life from its start or its first lend), with one warning: the threads
        that have none now are then checked by the guard's tombstones only."""
        if not self.lazy_workers:
            return
        controller = self
        self._worker_wants = wants

        def _apply() -> None:
            if threading.current_thread() is threading.main_thread():
                return  # the main thread follows sync_main
            if wants():
                controller.install_here()
            else:
                controller.uninstall_here()

        if threading.current_thread() is not threading.main_thread():
            _apply()
        try:
            reached = thread_reach.run_in_running_threads(_apply)
        except Exception:  # an audit hook refused sys.setprofile: the threads not visited yet stay as they are
            reached = False
        if not reached:
            self.lazy_workers = False
            if wants() and not self._warned_unreachable:
                self._warned_unreachable = True
                import warnings

                warnings.warn("ownership-sanitizer: running threads could not be given the dispatch mode at the "
                              "first stale lease; threads started from now on carry it for their life, and the "
                              "others are covered by the guard's tombstones only", RuntimeWarning, stacklevel=3)

    def _reach_again(self) -> None:
        """(Main thread.) Visit again the threads whose visit was taken away before it ran (each thread with a
        visit of ours still waiting is left as it is)."""
        if self.lazy_workers and self._armed:
            self.sync_workers(self._worker_wants)

    # -- thread starts and ends ----------------------------------------------------
    def hook_threads(self, should_install: Callable[[], bool]) -> None:
        """Make threads started from now on install the mode when ``should_install()``."""
        if self._orig_bootstrap is not None:
            return
        orig = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
        controller = self

        def _bootstrap_inner(thread: threading.Thread) -> None:
            if should_install():
                controller.install_here()
            try:
                orig(thread)
            finally:  # also done in Thread._delete; this covers Pythons without it
                controller.uninstall_here(force=True)

        self._orig_bootstrap = orig
        threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]

        def _reached() -> None:  # in a thread started before enable (Python 3.11+)
            if threading.current_thread() is not threading.main_thread() and should_install():
                controller.install_here()

        if not self.lazy_workers:  # (lazily, they are reached at the first stale lease instead: sync_workers)
            thread_reach.run_in_running_threads(_reached)

    def hook_threads_done(self) -> bool:
        return self._orig_bootstrap is not None

    def unhook_threads(self) -> None:
        if self._orig_bootstrap is not None:
            threading.Thread._bootstrap_inner = self._orig_bootstrap  # type: ignore[attr-defined]
            self._orig_bootstrap = None

    def _watch_thread_ends(self) -> None:
        """(Under the lock.) Remove ours from any thread as it ends, and from main at exit."""
        if not self._atexit:
            atexit.register(self._at_exit)
            self._atexit = True
        orig = getattr(threading.Thread, "_delete", None)
        if self._orig_delete is not None or orig is None:
            return
        controller = self

        def _delete(thread: threading.Thread) -> None:
            try:
                controller.uninstall_here(force=True)
            except Exception:  # never keep a thread from ending
                pass
            orig(thread)

        self._orig_delete = orig
        threading.Thread._delete = _delete  # type: ignore[attr-defined]

    def _at_exit(self) -> None:
        """Interpreter shutdown: nothing of ours may stay on the main thread's stack."""
        self.arm(False)
        if threading.current_thread() is threading.main_thread():
            self.uninstall_here(force=True)


_NOTHING_STALE: Mapping[int, Any] = MappingProxyType({})


def _user_mode_count() -> int:
    """Modes on this thread's stack that are not infra modes (fake, proxy, functional)."""
    infra = sum(1 for key in _INFRA_KEYS if torch._C._get_dispatch_mode(key) is not None)
    return torch._C._len_torch_dispatch_stack() - infra


def _insert_at_bottom(mode: "BorrowCheckMode") -> None:
    """Push ``mode`` beneath every user mode of this thread (infra modes have slots of their own)."""
    above = [torch._C._pop_torch_dispatch_stack(None) for _ in range(_user_mode_count())]
    try:
        torch._C._push_on_torch_dispatch_stack(mode)
    finally:
        for other in reversed(above):
            torch._C._push_on_torch_dispatch_stack(other)


def _remove_from_stack(mode: "BorrowCheckMode") -> bool:
    """Take ``mode`` out of this thread's user modes, keeping the others in order; False if absent."""
    above: List[Any] = []
    found = False
    try:
        for _ in range(_user_mode_count()):
            top = torch._C._pop_torch_dispatch_stack(None)
            if top is mode:
                found = True
                break
            above.append(top)
    finally:
        for other in reversed(above):
            torch._C._push_on_torch_dispatch_stack(other)
    return found


_ADD_PENDING_CALL = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
    ("Py_AddPendingCall", ctypes.pythonapi)) if hasattr(ctypes.pythonapi, "Py_AddPendingCall") else None
"""Our own foreign function object (``ctypes.pythonapi.Py_AddPendingCall`` is shared: a user may set its
``argtypes``)."""


class _PendingCall:
    """Run a Python callable in the main thread via ``Py_AddPendingCall`` (CPython only)."""

    _PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn
        self._scheduled = False
        self._cfunc = self._PROTO(self._run)  # kept alive as long as the controller

    @staticmethod
    def available() -> bool:
        return sys.implementation.name == "cpython" and hasattr(ctypes.pythonapi, "Py_AddPendingCall")

    def schedule(self) -> None:
        if not self._scheduled:  # one queued call is enough: it reads the state when it runs
            self._scheduled = True
            if _ADD_PENDING_CALL(self._cfunc, None) != 0:
                self._scheduled = False

    def _run(self, _arg: Any) -> int:
        self._scheduled = False
        try:
            self._fn()
        except Exception:  # never raise into an arbitrary bytecode of the main thread
            pass
        return 0


__all__ = ["BorrowCheckMode", "ModeController"]
