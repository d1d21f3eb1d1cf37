"""The dispatch mode that refuses stale borrowed storages, and where it is installed.

Per op, the mode does one dict test (are any leases stale at all?) and, only
then, one storage-address lookup per tensor argument. No pytree, no stack
capture: those cost 20 µs and more per op (see docs/domain notes).

Dispatch modes live on a per-thread stack. :class:`ModeController` installs the
mode in a thread while the sanitizer is enabled *and* a lease is alive, and
removes it as soon as no lease is alive, so a program pays per-op interception
only while borrowed memory is reachable. That holds for the thread that lends
and for the main thread, even when a loader lends from a background thread and
hands the views to the main thread: the controller asks the main thread to
follow through CPython's pending-call queue (``Py_AddPendingCall``), which runs
in the main thread at its next bytecode boundary. Other threads started while
the sanitizer is enabled get the mode at start (a mode cannot be pushed into an
arbitrary thread later); there it stays until the thread ends, taking the
cheap path while no lease is stale. Threads started before ``enable()`` that
never lend are not checked: enable first (``OWNERSHIP_SANITIZE=1`` does).
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Callable, Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

# View ops only re-describe memory, so a stale lease may still be viewed (its
# metadata stays readable, as with JAX's deleted arrays). detach and alias are
# the exception: tolist(), numpy-style readers and nn.Parameter read through them.
_READS_THROUGH = {_aten.detach.default, _aten.alias.default}
_METADATA_ONLY = {
    getattr(_aten, name).default
    for name in ("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                 "new_empty", "new_zeros", "new_ones", "new_full", "sym_size", "sym_stride",
                 "sym_numel", "sym_storage_offset", "is_same_size")
    if hasattr(_aten, name) and hasattr(getattr(_aten, name), "default")
}

_NEEDS_CHECK: Dict[Any, bool] = {}

# Private torch APIs, feature-detected (as sanitizer.features.rescue does its own): the mode may
# leave a thread's dispatch-mode stack only from the top, and these say what is on top.
_STACK_API_NAMES = ("_len_torch_dispatch_stack", "_get_dispatch_stack_at")
STACK_INTROSPECTION: bool = all(hasattr(torch._C, n) for n in _STACK_API_NAMES)
STACK_INTROSPECTION_MISSING: Optional[str] = None if STACK_INTROSPECTION else (
    "this torch lacks torch._C." + "/".join(n for n in _STACK_API_NAMES if not hasattr(torch._C, n))
    + ": the borrow-check mode, once installed in a thread, stays there (cheap while no lease is"
    " stale) instead of being removed when no lease is alive")


def _top_dispatch_mode() -> Any:
    """The mode on top of this thread's dispatch-mode stack (None when empty).

    Only call when :data:`STACK_INTROSPECTION` is true.
    """
    depth = torch._C._len_torch_dispatch_stack()
    return torch._C._get_dispatch_stack_at(depth - 1) if depth else None


StaleHandler = Callable[[Any, Any, torch.Tensor], None]  # (lease, func, tensor)


def _decide(func: Any) -> bool:
    """Does ``func`` read or write tensor data (True) or only describe it (False)?"""
    if func in _METADATA_ONLY:
        return False
    if getattr(func, "is_view", False) and func not in _READS_THROUGH:
        return False
    return True


class BorrowCheckMode(TorchDispatchMode):
    """Raises (through ``on_stale``) before any op touches a stale lease's storage."""

    def __init__(self, stale: Dict[int, Any], on_stale: StaleHandler):
        super().__init__()
        self._stale = stale
        self._on_stale = on_stale

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._stale:
            needs = _NEEDS_CHECK.get(func)
            if needs is None:
                needs = _NEEDS_CHECK[func] = _decide(func)
            if needs:
                self._scan(func, args)
                if kwargs:
                    self._scan(func, kwargs.values())
        if kwargs:
            return func(*args, **kwargs)
        return func(*args)

    def _scan(self, func: Any, values) -> None:
        stale = self._stale
        for a in values:
            if isinstance(a, torch.Tensor):
                self._test(func, a, stale)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, torch.Tensor):
                        self._test(func, x, stale)

    def _test(self, func: Any, t: torch.Tensor, stale: Dict[int, Any]) -> None:
        try:
            key = t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less subclasses
            return
        lease = stale.get(key)
        if lease is not None:
            self._on_stale(lease, func, t)


class ModeController:
    """Installs :class:`BorrowCheckMode` per thread, only while it is needed."""

    def __init__(self, stale: Dict[int, Any], on_stale: StaleHandler):
        self._stale = stale
        self._on_stale = on_stale
        self._tls = threading.local()
        self._orig_bootstrap: Optional[Callable] = None
        self._main_wants: Callable[[], bool] = lambda: False
        self._pending = _PendingCall(self._sync_main) if _PendingCall.available() else None

    def installed_here(self) -> bool:
        return getattr(self._tls, "mode", None) is not None

    def install_here(self) -> None:
        if getattr(self._tls, "mode", None) is None:
            mode = BorrowCheckMode(self._stale, self._on_stale)
            mode.__enter__()
            self._tls.mode = mode

    def uninstall_here(self) -> bool:
        """Pop this thread's mode if it is on top of the stack; False if it must wait.

        Inside an op's dispatch (or under a mode pushed later by someone else)
        the mode is not on top; it then stays until the next call here. On a torch
        without the private stack APIs (:data:`STACK_INTROSPECTION_MISSING` says
        which) the mode always stays.
        """
        mode = getattr(self._tls, "mode", None)
        if mode is None:
            return True
        # Without stack introspection we cannot tell whether the mode is on top, and popping one
        # that is not would unwind someone else's: keep it installed (correct, only slower).
        if not STACK_INTROSPECTION or _top_dispatch_mode() is not mode:
            return False
        mode.__exit__(None, None, None)
        self._tls.mode = None
        return True

    # -- the main thread ---------------------------------------------------------
    def sync_main(self, wants: Callable[[], bool]) -> None:
        """Make the main thread install or remove its mode as ``wants()`` says, soon.

        From the main thread this happens now; from another thread it is queued
        to run in the main thread at its next bytecode boundary.
        """
        self._main_wants = wants
        if threading.current_thread() is threading.main_thread():
            self._sync_main()
        elif self._pending is not None:
            self._pending.schedule()

    def _sync_main(self) -> None:
        if self._main_wants():
            self.install_here()
        else:
            self.uninstall_here()

    # -- threads started while enabled ---------------------------------------
    def hook_threads(self, should_install: Callable[[], bool]) -> None:
        """Make threads started from now on install the mode when ``should_install()``."""
        if self._orig_bootstrap is not None:
            return
        orig = threading.Thread._bootstrap_inner  # type: ignore[attr-defined]
        controller = self

        def _bootstrap_inner(thread: threading.Thread) -> None:
            if should_install():
                controller.install_here()
            orig(thread)

        self._orig_bootstrap = orig
        threading.Thread._bootstrap_inner = _bootstrap_inner  # type: ignore[attr-defined]

    def unhook_threads(self) -> None:
        if self._orig_bootstrap is not None:
            threading.Thread._bootstrap_inner = self._orig_bootstrap  # type: ignore[attr-defined]
            self._orig_bootstrap = None


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
            if ctypes.pythonapi.Py_AddPendingCall(self._cfunc, None) != 0:
                self._scheduled = False

    def _run(self, _arg: Any) -> int:
        self._scheduled = False
        try:
            self._fn()
        except Exception:  # never raise into an arbitrary bytecode of the main thread
            pass
        return 0


__all__ = ["BorrowCheckMode", "ModeController"]
