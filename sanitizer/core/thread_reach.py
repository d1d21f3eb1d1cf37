"""Run a function in threads at their next Python call or return, without replacing anyone's profiler.

A dispatch mode can only be pushed by the thread that owns the stack, so
threads started before ``enable()`` are out of the sanitizer's reach unless
each of them can be made to run a little code of ours; and a change of the
stack must sometimes wait for a moment when no op is under way in a thread
(see ``ModeController``). CPython gives one per-thread door for both: the
profile function (``Py_tracefunc``), which a thread calls at its next Python
call or return. It gives no way to *add* one beside a user's (cProfile, yappi,
viztracer, pyinstrument): ``threading.setprofile_all_threads`` and
``sys.setprofile`` replace it. So this module chains instead:

* A **visit** saves the thread's own profile function and object, puts ours
  in their place, and at the thread's next profile event puts them back,
  exactly (the same C function and the same object, so ``sys.getprofile()``
  and a C profiler's state are as they were), runs our function, and passes
  that event on to the thread's own profiler, which so misses nothing.
* **Other threads** are visited in one C-level pass over the interpreter's
  thread states (``itertools`` driving ``PyThreadState_Next``, the reads and
  writes through ctypes functions that keep the GIL), with no Python code in
  between: the GIL is not released during the pass, so no thread state can be
  freed under it, and no thread can change its profiler between the read and
  ours. The pass writes the two profile fields itself instead of calling
  ``_PyEval_SetProfile`` per thread: that call first runs the audit hooks
  (``sys.setprofile``), a Python hook (filelock installs one on 3.12+) may
  let the GIL go, and a thread that ends meanwhile leaves a freed state under
  the walk: a segfault (CPython's own ``PyEval_SetProfileAllThreads`` had the
  same crash, gh-137400, fixed in 3.14 by auditing once before its loop). So
  here too the audit runs before the pass, on this thread, and afterwards the
  interpreter's count of profiled threads (which turns the monitoring events
  for profilers on and off) is raised by the threads that had none, through
  ``_PyEval_SetProfile`` on this thread's own state (:func:`_shift_count`).

Where a thread's profile fields sit in ``PyThreadState`` is not public: it is
found once, at run time, in a thread of our own (``sys.setprofile`` of a marker
and a scan for its address), and checked both ways; if anything is off, the
door is closed (``AVAILABLE`` False) and callers keep their older rule.
Visiting other threads needs Python 3.11+ (CPython 3.12 added the all-threads
setter this mirrors; on 3.11 the pass also sets each thread's frame flag, see
:func:`_find_cframe_field`; 3.10 keeps the mode for a thread's life) and the
GIL (a free-threaded build stops the world instead). Torch-free, so it is
tested on Pythons without torch.
"""
from __future__ import annotations

import _thread
import ctypes
import functools
import gc
import itertools
import operator
import sys
import threading
from collections import deque
from typing import Callable, List, Optional, Tuple, TypeVar

T = TypeVar("T")

from sanitizer.core import forking

_WORD = ctypes.sizeof(ctypes.c_void_p)
_SCAN_WORDS = 96  # PyThreadState's leading fields; the profile fields sit within the first 16 words (3.11-3.13)
_TRACEFUNC = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
"""``Py_tracefunc``: ``int (*)(PyObject *obj, PyFrameObject *frame, int what, PyObject *arg)``. PYFUNCTYPE: the
GIL stays held, as a profile function is called with it and calls the thread's own one with it."""


class _Api:
    """The C entry points and ``PyThreadState``'s field offsets this module needs (None when not found)."""

    def __init__(self) -> None:
        vp = ctypes.c_void_p
        self.get_tstate = _c_function("PyThreadState_Get", vp)
        self.interp = _c_function("PyInterpreterState_Get", vp)
        self.head = _c_function("PyInterpreterState_ThreadHead", vp, vp)
        # PyThreadState_Next(tstate), called as a two-argument step by itertools.accumulate (the extra argument
        # is ignored by the callee: the platform calling conventions CPython supports pass it in a register).
        self.next2 = _c_function("PyThreadState_Next", vp, vp, vp)
        self.get_id = _c_function("PyThreadState_GetID", ctypes.c_uint64, vp)
        self.set_profile = _c_function("_PyEval_SetProfile", ctypes.c_int, vp, vp, vp)
        self.incref = _c_function("Py_IncRef", None, vp)
        self.decref = _c_function("Py_DecRef", None, vp)
        # memmove, called with the GIL kept (ctypes.memmove itself lets the GIL go during the call)
        self.write = ctypes.PYFUNCTYPE(vp, vp, vp, ctypes.c_size_t)(ctypes.cast(ctypes.memmove, vp).value)
        self.func_off, self.obj_off = _find_profile_fields(self.get_tstate)
        # Python 3.11: where the thread's current ``_PyCFrame`` pointer sits (None elsewhere, or when not found:
        # then only this thread's own visits work there, as before; see _find_cframe_field)
        self.cframe_off: Optional[int] = None
        self.cframe_why_not = ""
        # Where a thread's ``tracing`` count sits (None when not found: then clear_unless_a_thread_traces never
        # clears, see there)
        self.tracing_off: Optional[int] = None
        try:
            self.tracing_off = _find_tracing_field(self.get_tstate, self.func_off)
        except Exception:
            self.tracing_off = None
        if sys.version_info[:2] == (3, 11):
            try:
                self.cframe_off = _find_cframe_field(self.get_tstate, self.func_off)
            except Exception as err:
                self.cframe_why_not = f"{type(err).__name__}: {err}"

    def read(self, tstate: int) -> Tuple[int, int]:
        """This thread's ``(c_profilefunc, c_profileobj)`` (0 for NULL): only for the calling thread's own state."""
        func = ctypes.c_void_p.from_address(tstate + self.func_off).value or 0
        obj = ctypes.c_void_p.from_address(tstate + self.obj_off).value or 0
        return func, obj

    def install(self, tstate: int, func: int, obj: int) -> None:
        """Make ``(func, obj)`` this thread's profile function and object (``tstate`` is the calling thread's
        own state), taking a reference on ``obj`` and giving back the one on the object it replaces.

        3.12+: ``_PyEval_SetProfile``, which also keeps the interpreter's count of profiled threads. 3.11:
        the fields are written here, with the frame's ``use_tracing`` flag as _PyThreadState_UpdateTracingState
        computes it, because 3.11's ``_PyEval_SetProfile`` guards itself with one process-wide ``reentrant``
        flag: while any thread is inside it (an audit hook that lets the GIL go), a call from another thread
        fails with "Cannot install a profile function while another profile function is being installed" and
        clears the flag, so ours would have made a user's own ``sys.setprofile`` fail. The three words
        ``c_profilefunc, c_tracefunc, c_profileobj``, the object they replace and the frame flag are moved in one
        C-level pass (the GIL kept, no Python code in it: no other thread's pass can come between the read and
        the write), the trace function as it is: only this thread changes it on 3.11. Inside a profile call
        (``tracing`` > 0) the flag written here is recomputed by the call on its way out, from these fields."""
        if self.cframe_off is None:
            self.set_profile(tstate, func or None, obj or None)
            return
        trace = ctypes.c_void_p.from_address(tstate + self.func_off + _WORD).value or 0  # (only this thread sets it)
        frame = ctypes.c_void_p.from_address(tstate + self.cframe_off).value or 0
        if obj:
            self.incref(obj)
        words = (ctypes.c_void_p * 3)(func or None, trace or None, obj or None)
        flag = ctypes.c_uint8(255 if (func or trace) else 0)
        old = ctypes.c_void_p(None)
        # One C-level pass, no Python code in it (so no other thread's pass can come between): the object being
        # replaced is read, the three words written, the frame flag set. What it replaced gets its reference back.
        moves = [(ctypes.addressof(old), tstate + self.obj_off, _WORD),
                 (tstate + self.func_off, ctypes.addressof(words), 3 * _WORD)]
        if frame:
            moves.append((frame, ctypes.addressof(flag), 1))
        deque(itertools.starmap(self.write, moves), maxlen=0)
        if old.value:
            self.decref(old.value)

    def put_func(self, tstate: int, func: int) -> None:
        """Write this thread's ``c_profilefunc`` alone (the count of profiled threads is not changed)."""
        ctypes.c_void_p.from_address(tstate + self.func_off).value = func or None


def _c_function(name: str, restype, *argtypes):  # type: ignore[no-untyped-def]
    """A foreign function object of our own for ``name`` in the interpreter (not the one
    ``ctypes.pythonapi.name`` caches and shares: a user's code may set that one's ``argtypes``)."""
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


def _probe_in_a_fresh_thread(probe: Callable[[int], T], what: str, get_tstate: Callable[[], int]) -> T:
    """``probe(tstate)`` run in a fresh thread of ours (no profiler there: ``_thread`` threads do not run
    ``threading``'s profile hook), its result returned; anything it raises becomes one RuntimeError naming
    ``what`` (never raised into a thread of ours)."""
    found: List[T] = []
    failed: List[BaseException] = []
    done = _thread.allocate_lock()
    done.acquire()

    def run() -> None:
        try:
            found.append(probe(get_tstate()))
        except BaseException as err:  # reported to the caller
            failed.append(err)
        finally:
            done.release()

    _thread.start_new_thread(run, ())
    done.acquire()
    if not found:
        raise RuntimeError(f"cannot locate {what}: {failed[0] if failed else 'no result'}")
    return found[0]


def _marker(frame, event, arg):  # type: ignore[no-untyped-def]
    """The profile function the probes set: its identity is what they look for."""
    return None


def _find_profile_fields(get_tstate: Callable[[], int]) -> Tuple[int, int]:
    """Offsets of ``c_profilefunc`` and ``c_profileobj`` in ``PyThreadState``, found in a fresh thread of ours:
    the object slot holds a marker's address exactly while ``sys.setprofile(marker)`` is in force, and the
    function slot, two words before it in every CPython that has them (``c_profilefunc, c_tracefunc,
    c_profileobj, c_traceobj``), is set and cleared with it. Raises when either check fails."""

    def probe(tstate: int) -> Tuple[int, int]:
        def words() -> List[int]:
            raw = ctypes.string_at(tstate, _SCAN_WORDS * _WORD)
            return [int.from_bytes(raw[i:i + _WORD], sys.byteorder) for i in range(0, len(raw), _WORD)]

        before = words()
        sys.setprofile(_marker)
        during = words()
        sys.setprofile(None)
        after = words()
        hits = [i for i, w in enumerate(during) if w == id(_marker) and before[i] == 0 and after[i] == 0]
        if len(hits) != 1 or hits[0] < 2:
            raise RuntimeError(f"profile object slot not found ({len(hits)} candidates)")
        obj = hits[0]
        func = obj - 2
        if not (before[func] == 0 and during[func] != 0 and after[func] == 0):
            raise RuntimeError("profile function slot not where expected")
        return func * _WORD, obj * _WORD

    return _probe_in_a_fresh_thread(probe, "the profile fields", get_tstate)


def _find_cframe_field(get_tstate: Callable[[], int], func_off: int) -> int:
    """Python 3.11: the offset of ``PyThreadState.cframe``, the word just before ``c_profilefunc``
    (``_PyCFrame *cframe; Py_tracefunc c_profilefunc; ...`` in 3.11's ``cpython/pystate.h``). Its first byte,
    ``use_tracing``, is what 3.11's eval loop reads to call profile functions; CPython's own
    ``_PyEval_SetProfile(tstate, ...)`` sets it for another thread through ``_PyThreadState_UpdateTracingState``
    ("tstate->cframe->use_tracing = (use_tracing ? 255 : 0)"), and a returning frame hands it to the frame
    below ("tstate->cframe->use_tracing = cframe.use_tracing" in ceval.c), so setting it in the innermost
    frame is enough. Checked in a fresh thread of ours: the word must look like a pointer, and the byte it
    points at must be 0, then 255 while ``sys.setprofile(marker)`` is in force, then 0 again. Raises when
    either check fails (the door to other threads then stays closed on 3.11, as before)."""
    off = func_off - _WORD

    def use_tracing(tstate: int) -> int:
        pointer = ctypes.c_void_p.from_address(tstate + off).value or 0
        if pointer < 65536 or pointer % _WORD:  # the ints before it, or an odd layout: never dereferenced
            raise RuntimeError(f"PyThreadState.cframe not where expected ({pointer:#x})")
        return ctypes.c_uint8.from_address(pointer).value

    def probe(tstate: int) -> int:
        before = use_tracing(tstate)
        sys.setprofile(_marker)
        during = use_tracing(tstate)
        sys.setprofile(None)
        after = use_tracing(tstate)
        if (before, during, after) != (0, 255, 0):
            raise RuntimeError(f"use_tracing did not follow sys.setprofile ({before}, {during}, {after})")
        return off

    return _probe_in_a_fresh_thread(probe, "PyThreadState.cframe", get_tstate)


def _find_tracing_field(get_tstate: Callable[[], int], func_off: int) -> int:
    """Offset of ``PyThreadState.tracing`` (an ``int``, a few words before ``c_profilefunc`` in 3.11-3.13):
    above 0 exactly while the thread runs a trace or profile function. Found in a fresh thread of ours: the one
    int slot within the 8 words before ``c_profilefunc`` that is 0 outside a ``sys.setprofile`` callback and 1
    inside it (a "call" event, so ``tracing_what`` beside it stays 0). Raises when not exactly one slot does."""
    first = max(0, func_off - 8 * _WORD)
    slots = (func_off - first) // 4

    def ints(tstate: int) -> List[int]:
        raw = ctypes.string_at(tstate + first, slots * 4)
        return [int.from_bytes(raw[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(raw), 4)]

    def probe(tstate: int) -> int:
        seen: List[List[int]] = []

        def during(frame, event, arg):  # type: ignore[no-untyped-def]
            if event == "call" and not seen:
                seen.append(ints(tstate))

        def callee() -> None:
            return None

        before = ints(tstate)
        sys.setprofile(during)
        callee()
        sys.setprofile(None)
        after = ints(tstate)
        if not seen:
            raise RuntimeError("the probe's profile function did not run")
        hits = [i for i in range(slots) if before[i] == 0 and after[i] == 0 and seen[0][i] == 1]
        if len(hits) != 1:
            raise RuntimeError(f"PyThreadState.tracing not found ({len(hits)} candidates)")
        return first + 4 * hits[0]

    return _probe_in_a_fresh_thread(probe, "PyThreadState.tracing", get_tstate)


def _gil_enabled() -> bool:
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


_api: Optional[_Api] = None
_why_not = ""
if sys.implementation.name == "cpython" and _gil_enabled():
    try:
        _api = _Api()
    except Exception as err:  # an odd build: the door stays closed, callers keep their older rule
        _why_not = f"{type(err).__name__}: {err}"
else:
    _why_not = "not CPython with a GIL"

HERE_AVAILABLE: bool = _api is not None
"""Can a visit be put on the calling thread (:func:`run_here_when`)?"""
AVAILABLE: bool = HERE_AVAILABLE and (sys.version_info >= (3, 12) or _api is not None and _api.cframe_off is not None)
"""Can other running threads be visited (:func:`run_in_running_threads`)? 3.12+, and 3.11 where its frame's
tracing flag was found (:func:`_find_cframe_field`). (3.11's was closed for a while: a pass's batch that
died crashed the process there; there batches are now never freed, :func:`_release_settled`.)"""


class _Batch(dict):
    """One pass's saved profilers, ``(tstate, thread state id) -> (c_profilefunc, c_profileobj)``; the object
    each visited thread's profile object points at. An object slot holds a reference taken in the pass
    (``Py_IncRef``): given back when the entry is used, or when the batch goes.

    A batch that goes with entries left lost visits that never ran: a thread ended without another Python
    event, or (the case that matters) something replaced the threads' profile functions before they ran
    (``threading.setprofile_all_threads`` of a sampling profiler starting or stopping): :data:`on_lost` is
    told, and its owner visits them again."""

    def __del__(self) -> None:
        self.settle()

    def settle(self) -> None:
        """Give back what the entries left hold, and tell :data:`on_lost` when there were any."""
        decref = _api.decref if _api is not None else None
        lost = bool(self)
        if decref is not None:
            for _func, obj in self.values():
                if obj:
                    decref(obj)
            self.clear()
        hook = on_lost
        if lost and hook is not None:
            try:
                hook()
            except Exception:  # (a finalizer: never raises)
                pass


on_lost: Optional[Callable[[], None]] = None
"""Called (from a finalizer, anywhere: only schedule work there) when visits were lost before they ran."""


_run_in_threads: Optional[Callable[[], None]] = None
"""What a visit of :func:`run_in_running_threads` runs (the latest: callers read their state when it runs)."""


def _on_event(obj: int, frame: int, what: int, arg: int) -> int:
    """Our profile function: put the thread's own back, run ours, pass the event on (never raises)."""
    api = _api
    if api is None:
        return 0
    try:
        tstate = api.get_tstate()
        holder = ctypes.cast(obj, ctypes.py_object).value if obj else None
        if isinstance(holder, _Here):
            fn: Optional[Callable[[], None]] = holder.fn
            if holder.ready is not None and not _safe_call(holder.ready, False):
                if not (what == _C_CALL and arg == _GETPROFILE):
                    return _forward_as_its_own(api, tstate, holder, frame, what, arg)
                fn = None  # the thread asks for its profiler: it gets its own; the visit is given up
            func, own = holder.func, holder.obj
            holder.obj = 0  # (its reference is ours now)
        else:
            func, own = _unwind(holder, (tstate, api.get_id(tstate)))
            fn = _run_in_threads
        api.install(tstate, func, own)  # the thread's own, exactly (it takes a reference)
        if fn is not None:
            _safe_call(fn, None)
        if own:
            api.decref(own)  # (ours: the thread state holds its own again)
        return _forward(func, own, frame, what, arg)
    except BaseException:  # a profile function must not raise into the thread's code
        return 0


def _forward_as_its_own(api: _Api, tstate: int, here: "_Here", frame: int, what: int, arg: int) -> int:
    """While a visit waits here, pass an event on to the thread's own profiler with the thread's own fields in
    place, so that ``sys.getprofile()`` inside that profiler answers itself (a hook that checks it is still
    installed saw our visit instead: a blind user's test, 3.11), and put the visit back afterwards, unless the
    profiler replaced itself meanwhile (or a pass from another thread visited this one): then the visit is
    given up (its caller retries at its next chance). ``here`` keeps its own reference on the thread's object
    throughout, and the caller's local keeps ``here`` alive."""
    func, obj = here.func, here.obj
    if not func:
        return 0  # (no profiler of its own: nothing to pass the event to)
    api.install(tstate, func, obj)
    try:
        return _forward(func, obj, frame, what, arg)
    finally:
        if api.read(tstate) == (func, obj):
            api.install(tstate, _ON_EVENT_ADDRESS, id(here))


def _unwind(batch: object, key: Tuple[int, int]) -> Tuple[int, int]:
    """What was this thread's profiler before a pass visited it: ``(func, object)``, the object with a
    reference for the caller. When it was a visit of ours (an earlier pass, whose object is its batch; or a
    visit waiting here, a :class:`_Here`), follow the earlier batches and stop at a waiting visit, which is put
    back as it was (it runs when its time comes, and chains to the thread's own profiler in turn)."""
    while isinstance(batch, _Batch):
        func, obj = batch.pop(key, (None, None))
        if func != _ON_EVENT_ADDRESS or not obj:
            return func or 0, obj or 0
        earlier = ctypes.cast(obj, ctypes.py_object).value
        if not isinstance(earlier, _Batch):
            return func, obj
        if _api is not None:
            _api.decref(obj)  # (the reference the pass took on the earlier batch; ``earlier`` holds one)
        batch = earlier
    return 0, 0


def _forward(func: int, obj: int, frame: int, what: int, arg: int) -> int:
    """Pass the event to the thread's own profile function (a visit of ours waiting under it is skipped: it
    gets the thread's next event)."""
    if func == _ON_EVENT_ADDRESS and obj:
        waiting = ctypes.cast(obj, ctypes.py_object).value
        if not isinstance(waiting, _Here):
            return 0
        func, obj = waiting.func, waiting.obj
    if not func or func == _ON_EVENT_ADDRESS:
        return 0
    try:
        return _TRACEFUNC(func)(obj or None, frame, what, arg)
    except BaseException:  # the thread's own profiler raised: it is told no more than before (see module doc)
        return 0


def _safe_call(fn: Callable, default):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except BaseException:
        return default


_C_CALL = 4  # PyTrace_C_CALL: ``arg`` is the builtin about to be called
_GETPROFILE = id(sys.getprofile)
_ON_EVENT = _TRACEFUNC(_on_event)
_ON_EVENT_ADDRESS: int = ctypes.cast(_ON_EVENT, ctypes.c_void_p).value or 0
_NOOP = _TRACEFUNC(lambda obj, frame, what, arg: 0)
_NOOP_ADDRESS: int = ctypes.cast(_NOOP, ctypes.c_void_p).value or 0


class _Here:
    """A visit put on the calling thread: its own profiler (func, object with a reference of ours), what to run,
    and when (``ready``: the visit waits, passing events on, until it holds)."""

    __slots__ = ("func", "obj", "fn", "ready")

    def __init__(self, func: int, obj: int, fn: Callable[[], None], ready: Optional[Callable[[], bool]]):
        self.func, self.obj, self.fn, self.ready = func, obj, fn, ready

    def __del__(self) -> None:  # the thread ended (or replaced its profiler) before the visit ran
        if self.obj and _api is not None:
            _api.decref(self.obj)
            self.obj = 0


def run_here_when(ready: Optional[Callable[[], bool]], fn: Callable[[], None]) -> bool:
    """At this thread's next profile event at which ``ready()`` holds (the next one, without ``ready``), run
    ``fn()`` once; the thread's own profiler keeps every event and is put back exactly. A visit that waits is
    given up (its ``fn`` not run) when the thread calls ``sys.getprofile()``, which so always answers the
    thread's own profiler: callers arm it again at their next chance. False when not possible (the door is closed),
    inside this thread's own trace or profile function, or when a visit of ours already waits here (callers
    read their state when it runs)."""
    api = _api
    if api is None:
        return False
    tstate = api.get_tstate()
    if api.tracing_off is not None and ctypes.c_int.from_address(tstate + api.tracing_off).value > 0:
        # Inside this thread's own trace or profile function (a hook that runs torch ops): a visit put now
        # would be what ``sys.getprofile()`` answers there until the hook returns (no event runs inside it
        # to give the thread's own back; a blind user's hook saw ours). The caller retries later.
        return False
    func, obj = api.read(tstate)
    if func == _ON_EVENT_ADDRESS:
        return False
    here = _Here(func, obj, fn, ready)
    if obj:
        api.incref(obj)
    # (Another thread's pass visiting this one in between is overwritten here: its batch keeps the entry, and a
    # batch that goes with entries left tells on_lost, whose owner visits again.)
    api.install(tstate, _ON_EVENT_ADDRESS, id(here))
    return True


def run_in_running_threads(fn: Callable[[], None]) -> bool:
    """Arrange for ``fn()`` to run once in every other running thread, at its next Python call or return, each
    thread's own profiler kept (see the module doc); False when not possible here (or when an audit hook
    refuses ``sys.setprofile``: it raises then)."""
    global _run_in_threads
    api = _api
    if not AVAILABLE or api is None:
        return False
    caller = threading.get_ident()

    def _once() -> None:
        if threading.get_ident() != caller:
            fn()

    with _PASSES:  # one pass at a time: each counts the threads it gives a profile function
        _run_in_threads = _once
        if _POOLED:
            _release_settled(api)
            batch = _FREE.pop() if _FREE else _Batch()
            _BATCHES.append(batch)
        else:
            batch = _Batch()
        me = api.get_tstate()
        my_func, my_obj = api.read(me)
        # The audit hooks see the change now, on this thread, before any other thread's state is held: one
        # that refuses raises here (the caller falls back); one that lets the GIL go frees nothing under us.
        if api.cframe_off is not None:  # 3.11: the audit alone (see _Api.install)
            sys.audit("sys.setprofile")
        else:  # (our own reference on the object while it is set again: a visit waiting here, run_here_when's,
            # is held by nothing else, and a _PyEval_SetProfile that lets go of the old object first frees it)
            if my_obj:
                api.incref(my_obj)
            try:
                api.set_profile(me, my_func or None, my_obj or None)
            finally:
                if my_obj:
                    api.decref(my_obj)
        # No collection during the C-level passes: each step allocates (ctypes values, tuples), and a collection
        # there runs finalizers, Python code that may let the GIL go at the eval breaker; a thread that ends
        # then would free its state under the walk. (Added while chasing 3.11's segfault, which it did not
        # stop: see _release_settled; the hazard it guards holds on every version.)
        collecting = gc.isenabled()
        gc.disable()
        try:
            for _round in range(_ROUNDS):
                # Threads with no profile function get ours only as far as the count was raised for them first
                # (the count may be above the truth for a moment, never below: below, a profiler set meanwhile
                # in another thread could find the monitoring events off and miss its events).
                wanted = _count_states(api, me, _with_none)
                _shift_count(api, me, wanted)
                _visit(api, me, batch, _with_another, None)
                given = _visit(api, me, batch, _with_none, wanted)
                _shift_count(api, me, given - wanted)
                if given < wanted or wanted == 0:
                    break
        finally:
            if collecting:
                gc.enable()
        return True


def _release_settled(api: _Api) -> None:
    """Python 3.11: settle the batches no thread state points at any more, and keep them for later passes (at a
    pass's start, on the passing thread, before its C-level walk).

    On 3.11 a batch must never die: with batches freed when the last visited state let go of them (in that
    thread's own profile event, or in the clean-up of a thread that ended), a program whose threads start and
    end while the gc runs inside ops segfaulted in 3 runs of 4 (a corrupted gc list, or the batch's own
    deallocation); freed here instead, at a pass's start, still 2 runs of 10; kept for good, 0 of 14, and
    kept and used again (this), 0 of 32. 3.12 never crashed, and keeps batches that die (so a visit taken
    away by ``threading.setprofile_all_threads`` is redone at once: :data:`on_lost`); here such a visit is
    redone at the next pass, when its batch settles. The root cause in 3.11 was not found.

    Safe against a stale read: only a pass, which holds ``_PASSES``, points a state at a batch, and a thread
    only moves its own state away from one, so the set read here can only be larger than the truth: a batch is
    settled late, never early. Settling gives back the saved profile objects of threads that ended before
    their visit, and tells :data:`on_lost` when there were any."""
    if not _BATCHES:
        return
    pointed = set(_field(_all_states(api, 0), api.obj_off))
    # (a saved profiler that is itself a visit of ours, which _unwind follows, keeps its batch too)
    pointed.update(obj for b in _BATCHES for func, obj in b.values() if func == _ON_EVENT_ADDRESS)
    kept, settled = [], []
    for b in _BATCHES:
        (kept if id(b) in pointed else settled).append(b)
    if settled:
        _BATCHES[:] = kept
        for b in settled:
            b.settle()
        _FREE.extend(settled)


_POOLED: bool = sys.version_info[:2] == (3, 11)
"""Batches are kept and used again, never freed (see :func:`_release_settled`)."""
_BATCHES: List["_Batch"] = []
"""3.11: every batch some thread state may still point at (see :func:`_release_settled`)."""
_FREE: List["_Batch"] = []
"""Settled batches, used again by later passes instead of new ones: a batch never dies while the process
runs. (At most one batch is pinned per thread state, so these are at most as many as threads ever were.)"""

_PASSES = threading.RLock()
"""One pass at a time. Re-entrant: a lease that dies in a garbage collection run between the C-level steps
reaches a pass again on the same thread (the inner one counts and visits what is left, and the outer one
then finds fewer states with no profiler than it counted for, and gives the difference back)."""
_ROUNDS = 8


@forking.in_child
def _after_fork() -> None:
    """A child forked while another thread of the parent was in a pass would inherit the lock held."""
    global _PASSES
    _PASSES = threading.RLock()
"""Passes over the threads with no profiler, while threads keep starting between the count and the pass."""


def _all_states(api: _Api, me: int):  # type: ignore[no-untyped-def]
    """Every thread state but ``me``, from the head: ``PyThreadState_Next`` driven by ``accumulate`` and stopped
    at NULL by ``takewhile`` (C-level, no Python code while it is consumed)."""
    walk = itertools.takewhile(bool, itertools.accumulate(
        itertools.chain(map(api.head, (api.interp(),)), itertools.repeat(None)), api.next2))
    return itertools.filterfalse(functools.partial(operator.eq, me), walk)


def _field(states, offset: int, ctype=ctypes.c_void_p):  # type: ignore[no-untyped-def]
    """Each state's field at ``offset`` (a pointer by default, None for NULL), read lazily: C-level while it is
    consumed."""
    return map(_VALUE, map(ctype.from_address, map(operator.add, states, itertools.repeat(offset))))


def _with_none(funcs):  # type: ignore[no-untyped-def]
    """Selector: the states with no profile function."""
    return map(operator.not_, funcs)


def _with_another(funcs):  # type: ignore[no-untyped-def]
    """Selector: the states whose profile function is some other one than ours (a visit of ours that waits
    there is not stacked again)."""
    some, other = itertools.tee(funcs, 2)
    return map(operator.and_, map(bool, some), map(operator.ne, other, itertools.repeat(_ON_EVENT_ADDRESS)))


def _count_states(api: _Api, me: int, select) -> int:  # type: ignore[no-untyped-def]
    """How many other thread states ``select`` keeps (one C-level pass)."""
    return sum(select(_field(_all_states(api, me), api.func_off)))


def _visit(api: _Api, me: int, batch: _Batch, select, limit: Optional[int]) -> int:  # type: ignore[no-untyped-def]
    """One C-level pass, no Python code until the deque is done: for each other thread state that ``select``
    keeps (at most ``limit``), zip reads its profile function and object and saves them in the batch (the
    state's reference on the object moves to the batch), takes a reference on the batch for the state, and
    writes ours into the two fields. Returns how many states it visited."""
    s_read, s_keep = itertools.tee(_all_states(api, me), 2)
    states = itertools.compress(s_keep, select(_field(s_read, api.func_off)))
    if limit is not None:
        states = itertools.islice(states, max(0, limit))
    flagged = api.cframe_off is not None
    t_key, t_id, t_func, t_obj, t_wf, t_wo, *t_cf = itertools.tee(states, 7 if flagged else 6)
    keys = zip(t_key, map(api.get_id, t_id))
    cells = (ctypes.c_void_p(_ON_EVENT_ADDRESS), ctypes.c_void_p(id(batch)), ctypes.c_uint8(255))
    before = len(batch)
    steps = [map(batch.__setitem__, keys, zip(_field(t_func, api.func_off), _field(t_obj, api.obj_off))),
             map(api.incref, itertools.repeat(id(batch))),
             map(api.write, map(operator.add, t_wf, itertools.repeat(api.func_off)),
                 itertools.repeat(ctypes.addressof(cells[0])), itertools.repeat(_WORD)),
             map(api.write, map(operator.add, t_wo, itertools.repeat(api.obj_off)),
                 itertools.repeat(ctypes.addressof(cells[1])), itertools.repeat(_WORD))]
    if flagged:
        # 3.11: the thread's innermost frame starts calling profile functions (``use_tracing = 255``, as
        # _PyThreadState_UpdateTracingState would write for it); a thread inside its own profiler's call is
        # left alone by that call (``tracing`` > 0), which recomputes the flag from the fields on its way out.
        frames = _field(t_cf[0], api.cframe_off)
        steps.append(map(api.write, frames, itertools.repeat(ctypes.addressof(cells[2])), itertools.repeat(1)))
    deque(zip(*steps), maxlen=0)
    return len(batch) - before


def _shift_count(api: _Api, me: int, delta: int) -> None:
    """Move the interpreter's count of threads with a profile function (``sys_profiling_threads``: while it is
    non-zero the monitoring events that call profilers stay on) by ``delta``, through ``_PyEval_SetProfile``
    on this thread's own state, which counts a change from none to one (+1) or back (-1): each round first
    writes this thread's function field alone to the other side. This thread's profiler is as it was
    afterwards. The rounds run in one C-level loop, so no profile event of this thread falls between them
    (audit hooks run with tracing off)."""
    if delta == 0 or api.cframe_off is not None:  # (3.11 keeps no such count: each thread's frame flag says it)
        return
    func, obj = api.read(me)
    field = me + api.func_off
    if delta > 0:
        side, target = ctypes.c_void_p(None), func or _NOOP_ADDRESS  # from none to one: +1
    else:
        side, target = ctypes.c_void_p(func or _NOOP_ADDRESS), None  # from one to none: -1
    try:  # (the finite range first: zip stops before starting a round past it)
        deque(zip(range(abs(delta)),
                  map(api.write, itertools.repeat(field), itertools.repeat(ctypes.addressof(side)),
                      itertools.repeat(_WORD)),
                  map(api.set_profile, itertools.repeat(me), itertools.repeat(target),
                      itertools.repeat(obj or None))),
              maxlen=0)
    finally:
        api.put_func(me, func)


def clear_unless_a_thread_traces(snapshot: dict) -> bool:
    """Clear ``snapshot`` (a frame's ``f_locals`` dict on CPython < 3.13) unless some thread is inside a trace
    or profile function; True when cleared.

    Why: a Python-level profile or trace function (``sys.setprofile``, ``sys.settrace``: pdb, coverage's Python
    tracer, a user's hook) is called through CPython's trampoline, which copies the frame's fast locals into
    that very dict, calls the hook, and copies the dict back into the fast locals, deleting every local the
    dict lacks (``PyFrame_LocalsToFast(frame, 1)``). A walk in another thread that cleared the dict while the
    hook ran left the program's live locals unbound (``UnboundLocalError`` on a variable assigned the line
    before: a blind user's test, 3 runs of 16 on 3.11). A thread inside such a call has ``tracing`` > 0 for
    all of it, so the check and the clear run as one C-level step (no Python code between them: no other
    thread can enter a hook after the check and before the clear). Where ``tracing`` was not found, nothing is
    cleared (the snapshot keeps the frame's locals alive a while longer, as any Python profiler's own does)."""
    api = _api
    if api is None or api.tracing_off is None:
        return False
    tracing = _field(_all_states(api, 0), api.tracing_off, ctypes.c_int)
    # compress pulls its selector (no thread tracing: one C-level pass over the states) and then the dict;
    # dict.clear runs on it only when selected, still inside the same deque step
    cleared = deque(map(dict.clear, itertools.compress(
        (snapshot,), map(operator.not_, map(any, (tracing,))))), maxlen=1)
    return bool(cleared)


_VALUE = operator.attrgetter("value")


__all__ = ["AVAILABLE", "HERE_AVAILABLE", "run_in_running_threads", "run_here_when", "on_lost",
           "clear_unless_a_thread_traces"]
