"""``trap=fault``: one ASan-style report when a read or write hits a trapped (retired) lease, then exit 1.

A retired lease's pages are made inaccessible (``PROT_NONE``; ``trap=poison`` maps them read-only), so
the first access through *any* alias faults with ``SIGSEGV``. What the report needs (the lease, its
buffer and generation, the holder when known) is rendered to text when the lease is trapped, in
ordinary Python, and kept here by address range; the signal handler only looks the fault address
up and writes that text.

Why a ctypes ``sigaction`` handler and not only :mod:`faulthandler`: faulthandler prints the Python
stack but cannot say *which* lease was hit (it does not see ``si_addr``), and a :mod:`signal` handler
runs only after the C handler returned, which for ``SIGSEGV`` re-runs the faulting instruction
forever. A ctypes callback with ``SA_SIGINFO`` gets the fault address; it takes the GIL (the
faulting thread usually holds it already: numpy and ctypes reads do), looks the address up,
writes the pre-rendered report and the Python stack (``faulthandler.dump_traceback``, which is
built for signal handlers) to stderr, and ends the process with ``os._exit(1)``, as ASan does.
Running Python in a signal handler is not async-signal-safe in general; it is acceptable here
because the process is about to end and the fault is in a read of user data, not inside the
allocator. A fault at any other address is not ours: the handler puts back the handler that was
installed before (faulthandler under pytest, or the default) and returns, so the access faults
again and that handler deals with it exactly as without the sanitizer.

No C extension: the project builds nothing, and this needs nothing beyond libc. 64-bit Linux
(x86-64, aarch64: the glibc ``struct sigaction`` layout below). torch-free.
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import threading
from typing import Dict, Optional, Tuple

from sanitizer.core import pages

SA_SIGINFO = 4
SA_ONSTACK = 0x08000000
_SI_ADDR_OFFSET = 16  # siginfo_t: si_signo, si_errno, si_code, (padding), then si_addr on 64-bit Linux


class _SigAction(ctypes.Structure):
    _fields_ = [("sa_sigaction", ctypes.c_void_p), ("sa_mask", ctypes.c_ulong * 16),
                ("sa_flags", ctypes.c_int), ("sa_restorer", ctypes.c_void_p)]


_HANDLER_T = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

_ranges: Dict[int, Tuple[int, str]] = {}  # start address -> (end address, report text)
_lock = threading.Lock()
_previous: Optional[_SigAction] = None
_callback = None  # the ctypes callback: kept referenced for the life of the process
_sigaction = None


def add(start: int, end: int, text: str) -> None:
    """Pages ``[start, end)`` are trapped: a fault there prints ``text`` (install first)."""
    with _lock:
        _ranges[start] = (end, text)


def remove(start: int) -> None:
    """The range at ``start`` is no longer trapped (rescued, unmapped). Safe inside the GC."""
    _ranges.pop(start, None)


def lookup(address: int) -> Optional[str]:
    """The report text of the trapped range holding ``address``, or None."""
    for start, (end, text) in list(_ranges.items()):
        if start <= address < end:
            return text
    return None


def _on_segv(signum: int, info: int, context: int) -> None:
    try:
        address = ctypes.c_void_p.from_address(info + _SI_ADDR_OFFSET).value or 0
        text = lookup(address)
    except BaseException:
        text, address = None, 0
    if text is None:  # not ours: the previous handler takes the refault
        if _previous is not None:
            _sigaction(signal.SIGSEGV, ctypes.byref(_previous), None)
        return
    try:
        os.write(2, (f"==ownsan== ERROR: ownership-sanitizer: stale-use of a trapped lease "
                     f"(trap=fault) at address {address:#x}\n{text}\n").encode("utf-8", "replace"))
        faulthandler.dump_traceback(file=2, all_threads=False)
        os.write(2, b"==ownsan== ABORTING (exit 1)\n")
    finally:
        os._exit(1)


def installed() -> bool:
    return _callback is not None


def install() -> None:
    """Install the SIGSEGV handler (once, from the main thread or any other; idempotent)."""
    global _previous, _callback, _sigaction
    if _callback is not None or not pages.AVAILABLE:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.sigaction
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    old = _SigAction()
    if fn(signal.SIGSEGV, None, ctypes.byref(old)):
        raise OSError(ctypes.get_errno(), "sigaction(SIGSEGV) could not be read")
    callback = _HANDLER_T(_on_segv)
    new = _SigAction()
    new.sa_sigaction = ctypes.cast(callback, ctypes.c_void_p).value
    new.sa_flags = SA_SIGINFO | SA_ONSTACK
    _previous, _callback, _sigaction = old, callback, fn
    if fn(signal.SIGSEGV, ctypes.byref(new), None):
        _callback = None
        raise OSError(ctypes.get_errno(), "sigaction(SIGSEGV) could not be set")


__all__ = ["add", "remove", "lookup", "install", "installed"]
