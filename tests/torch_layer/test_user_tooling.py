"""The sanitizer never harms the user's own tooling (issue 46, points 0-4).

* The garbage collector may free a stale view in the middle of any op: nothing it triggers may change that
  op's dispatch-mode stack (torch's fallback had chosen the mode and asserted when it was gone).
* A profile function the user set, in any thread or for new threads, survives every enable, disable and stale
  lease; threads started while enabled are checked under such a profiler.

What the sanitizer wraps (readers, exporters) is tested in test_wrapped_functions.py.
"""
from __future__ import annotations

import copy
import gc
import os
import random
import subprocess
import sys
import threading

import pytest
import torch
import torch.utils.dlpack

import sanitizer
from sanitizer.core import thread_reach
from sanitizer.torch_layer import mode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- 0. the GC inside an op --------------------------------------------------------------------------------
class _Cycle:
    pass


def _gc_inside_ops(iterations: int, **options) -> dict:
    """Make a stale view that only a reference cycle keeps, drop the cycle, and let a generation-0 collection
    (a low threshold, a random count of allocations before it) free it somewhere inside the next ops: in
    torch's Python fallback between its choice of the mode and its pop, in some iterations. Each op's result is
    compared with the same op run unsanitized."""
    x, y = torch.randn(1000), torch.randn(1000)
    expected = torch.add(x, y)
    param = torch.nn.Parameter(torch.randn(64))
    expected_copy = param.detach().clone()
    rng = random.Random(46)
    out = {"wrong": 0, "raised": [], "mode_left": 0}
    add, args = torch.add, (x, y)  # one call with a prepared tuple: the first allocation is torch's own
    thresholds = gc.get_threshold()
    with sanitizer.sanitize(**options):
        buf = sanitizer.StagingBuffer(1 << 16, name="gc-inside-ops")
        for i in range(iterations):
            gc.disable()
            w = buf.lend(0, (16,), torch.float32, name=f"t{i}")
            cycle = _Cycle()
            cycle.self, cycle.w = cycle, w
            del w
            buf.reuse(0, 64, by="next")
            gc.set_threshold(rng.randint(1, 4), 1, 1)
            del cycle
            junk = [[] for _ in range(rng.randint(0, 6))]  # noqa: F841  (moves the collection around)
            try:
                gc.enable()
                results = [add(*args), add(*args), add(*args)]
                copied = copy.deepcopy(param)  # safetensors' test_workaround_copy: Parameter.data.clone()
            except Exception as err:  # what a user's program would have seen
                out["raised"].append(f"{type(err).__name__}: {str(err)[:200]}")
                continue
            finally:
                gc.set_threshold(*thresholds)
                gc.enable()
            out["wrong"] += sum(not torch.equal(r, expected) for r in results)
            out["wrong"] += not torch.equal(copied.detach(), expected_copy)
        gc.collect()
        _a_python_call()
        out["mode_left"] = torch._C._len_torch_dispatch_stack()
        buf.close()
    out["errors"] = len(sanitizer.errors())
    return out


def _a_python_call() -> None:
    """A Python call outside any op: where a removal that had to wait happens (at the latest)."""


@pytest.mark.parametrize("options", [{}, {"triage": 1, "halt_on_error": 0}], ids=["defaults", "triage"])
def test_a_stale_view_freed_by_the_gc_inside_an_op_never_breaks_that_op(options):
    out = _gc_inside_ops(300, **options)
    assert out["raised"] == [] and out["wrong"] == 0
    assert out["mode_left"] == 0  # the removal that had to wait happened once the ops were done
    assert out["errors"] == 0  # nothing stale was used


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"triage": 1, "halt_on_error": 0}], ids=["defaults", "triage"])
def test_ten_thousand_gc_frees_inside_ops_never_change_a_result(options):
    out = _gc_inside_ops(10_000, **options)
    assert out == {"wrong": 0, "raised": [], "mode_left": 0, "errors": 0}


def test_the_stack_is_not_changed_inside_a_python_dispatched_op():
    """The predicate the removal waits on: false inside a mode's dispatch (ours or a user's) and under
    ``_DisableTorchDispatch``, true outside."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(mode.stack_change_safe())
            return func(*args, **(kwargs or {}))

    assert mode.stack_change_safe()
    with Probe():
        torch.ones(2).add(1)
    assert seen and not any(seen)
    with torch._C._DisableTorchDispatch():
        assert not mode.stack_change_safe()
    assert mode.stack_change_safe()


def test_a_removal_asked_for_inside_an_op_waits_and_then_happens():
    """The last stale lease dies inside an op (its death callback asks for the mode's removal): the mode stays
    for that op, which completes, and is gone at the next Python call outside it."""
    buf = sanitizer.StagingBuffer(256, name="wait")
    box = {"w": buf.write(0, torch.ones(4), name="w")}
    buf.reuse(0, 16, by="next")
    from torch.utils._python_dispatch import TorchDispatchMode

    class DropsTheLastStaleView(TorchDispatchMode):  # a user mode above ours, run inside the op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            box.pop("w", None)  # the lease dies here: its removal must wait
            return func(*args, **(kwargs or {}))

    with sanitizer.sanitize():
        assert torch._C._len_torch_dispatch_stack() == 1  # ours, for the stale lease
        with DropsTheLastStaleView():
            r = torch.full((3,), 2.0).mul(3)
        assert torch.equal(r, torch.full((3,), 6.0))
        _a_python_call()
        assert torch._C._len_torch_dispatch_stack() == 0
    assert sanitizer.errors() == []


# -- 1, 2. profilers ------------------------------------------------------------------------------------------
_PROFILERS_KEPT = r"""
import sys, threading, time, ctypes
sys.path.insert(0, sys.argv[1])
from sanitizer.core import thread_reach

def make(name, box):
    def prof(frame, event, arg):
        box[name] = box.get(name, 0) + 1
    return prof

# A C-level profiler, as yappi and viztracer set one: a Py_tracefunc with an object of its own.
FUNC = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
c_events = [0]
def c_prof(obj, frame, what, arg):
    c_events[0] += 1
    return 0
C_PROF = FUNC(c_prof)
set_profile = ctypes.pythonapi._PyEval_SetProfile
set_profile.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.py_object]
get_tstate = ctypes.pythonapi.PyThreadState_Get
get_tstate.restype = ctypes.c_void_p
c_obj = object()

events, ok, reached = {}, [], []
stop, ready = threading.Event(), threading.Barrier(5)

def py_worker(name):
    prof = make(name, events)
    sys.setprofile(prof)
    ready.wait()
    while not stop.is_set():
        time.sleep(0.002)
    ok.append((name, sys.getprofile() is prof))

def c_worker():
    set_profile(get_tstate(), ctypes.cast(C_PROF, ctypes.c_void_p).value, c_obj)
    ready.wait()
    while not stop.is_set():
        time.sleep(0.002)
    ok.append(("c", sys.getprofile() is c_obj))

def plain_worker():
    ready.wait()
    while not stop.is_set():
        time.sleep(0.002)
    ok.append(("plain", sys.getprofile() is None))

threads = [threading.Thread(target=py_worker, args=(f"w{i}",)) for i in range(2)]
threads += [threading.Thread(target=c_worker), threading.Thread(target=plain_worker)]
for t in threads:
    t.start()
ready.wait()
main_prof = make("main", events)
sys.setprofile(main_prof)
new_thread_prof = make("new", events)
threading.setprofile(new_thread_prof)
for _ in range(50):  # every pass visits every thread, each visit chains to the thread's own profiler
    assert thread_reach.run_in_running_threads(lambda: reached.append(threading.get_ident()))
    time.sleep(0.005)
main_kept = sys.getprofile() is main_prof and threading.getprofile() is new_thread_prof
sys.setprofile(None)
threading.setprofile(None)
stop.set()
for t in threads:
    t.join()
print(main_kept, sorted(ok), len(set(reached)), min(events.get("w0", 0), events.get("w1", 0)) > 100,
      c_events[0] > 100)
"""


@pytest.mark.parametrize("version", ["3.11", "3.12", "3.13"])
def test_every_profiler_a_user_set_survives_the_reach_and_keeps_its_events(version):
    """Python profilers and a C-level one (as yappi sets it), in workers, in the main thread and for new
    threads: every visit puts each back exactly and passes it every event (torch-free: run on 3.12 and 3.13
    from here)."""
    from tests.torch_layer.test_mode_placement import _python

    exe = _python(version)
    if exe is None:
        pytest.skip(f"no Python {version} on this machine")
    proc = subprocess.run([exe, "-c", _PROFILERS_KEPT, ROOT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[0] == ("True [('c', True), ('plain', True), ('w0', True), ('w1', True)] 4 "
                                          "True True"), proc.stdout + proc.stderr


_THREAD_CHURN = r"""
import sys, threading, time, random, _thread
sys.path.insert(0, sys.argv[1])
from sanitizer.core import thread_reach
AUDIT = sys.argv[2] == "audit"
if AUDIT:  # a Python audit hook that lets the GIL go at every sys.setprofile (filelock installs one on 3.12+)
    def hook(event, args):
        if event == "sys.setprofile":
            time.sleep(0)
    sys.addaudithook(hook)
lock = threading.Lock(); bad = []; done = [0]; stop = threading.Event()
def churn():
    rng = random.Random(threading.get_ident())
    while not stop.is_set():
        def body(with_prof):
            seen = [0]
            def prof(f, e, a):
                seen[0] += 1
            if with_prof:
                sys.setprofile(prof)
            total = sum(len(str(i)) for i in range(300))
            if with_prof and (sys.getprofile() is not prof or seen[0] < 300):
                bad.append(seen[0])
            with lock:
                done[0] += 1
        if rng.random() < 0.5:
            threading.Thread(target=body, args=(rng.random() < 0.5,)).start()
        else:
            _thread.start_new_thread(body, (rng.random() < 0.5,))
        time.sleep(0.0003)
workers = [threading.Thread(target=churn) for _ in range(3)]
for w in workers:
    w.start()
passes, t0 = 0, time.time()
while time.time() - t0 < 3:
    thread_reach.run_in_running_threads(lambda: None)
    passes += 1
    time.sleep(0.0002)
stop.set()
for w in workers:
    w.join()
time.sleep(0.2)
# The count of profiled threads is exact afterwards: a worker setting and clearing its profiler does not turn
# off the events of the main thread's one (it would, were the count below the truth).
main_events = [0]
def main_prof(f, e, a):
    main_events[0] += 1
sys.setprofile(main_prof)
def on_and_off():
    sys.setprofile(lambda f, e, a: None)
    sys.setprofile(None)
t = threading.Thread(target=on_and_off); t.start(); t.join()
main_events[0] = 0
sum(len(str(i)) for i in range(300))
sys.setprofile(None)
print(passes > (100 if AUDIT else 1000), done[0] > 1000, bad, main_events[0] > 300)
"""


@pytest.mark.slow  # a soak (thousands of visits under thread churn, ~2.7 s of CPU a case, 11 s in all): the full run's
@pytest.mark.parametrize("version", ["3.11", "3.12", "3.13"])
@pytest.mark.parametrize("audit", ["plain", "audit"])
def test_the_reach_survives_threads_that_start_and_end_under_it(version, audit):
    """Thousands of visits while short-lived threads (``threading`` and raw ``_thread`` ones, half with their own
    profiler) start and end: no crash, every profiler kept with all its events, and the interpreter's count of
    profiled threads exact afterwards. With a Python audit hook that lets the GIL go at each ``sys.setprofile``
    (as filelock's may), a pass that called ``_PyEval_SetProfile`` per thread segfaulted within a second."""
    from tests.torch_layer.test_mode_placement import _python

    exe = _python(version)
    if exe is None:
        pytest.skip(f"no Python {version} on this machine")
    proc = subprocess.run([exe, "-c", _THREAD_CHURN, ROOT, audit], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "[]", "True"], proc.stdout


def test_a_visit_here_waits_for_its_moment_and_keeps_the_threads_profiler():
    if not thread_reach.HERE_AVAILABLE:
        pytest.skip("no visits on this interpreter")
    seen, ran, flag = [], [], [False]

    def prof(frame, event, arg):
        seen.append(event)

    sys.setprofile(prof)
    try:
        assert thread_reach.run_here_when(lambda: flag[0], lambda: ran.append(sys.getprofile() is prof))
        _a_python_call()
        assert ran == []  # not ready: it waits (passing the events on)
        flag[0] = True
        _a_python_call()
        assert ran == [True] and sys.getprofile() is prof
        # A visit that waits is given up when the thread asks for its profiler: the answer is its own.
        flag[0] = False
        assert thread_reach.run_here_when(lambda: flag[0], lambda: ran.append("late"))
        assert sys.getprofile() is prof
        flag[0] = True
        _a_python_call()
        assert ran == [True]
    finally:
        sys.setprofile(None)
    assert seen  # the user's profiler got its events meanwhile



def test_a_profiler_that_asks_for_itself_inside_its_own_callback_is_answered_itself_while_a_visit_waits():
    """A hook that checks it is still the thread's profiler (``sys.getprofile() is me`` inside its callback, as
    tools that warn when displaced do) saw our waiting visit instead (a blind user's test, 3.11): the events
    it gets while a visit waits are passed on with the thread's own profiler in place."""
    if not thread_reach.HERE_AVAILABLE:
        pytest.skip("no visits on this interpreter")
    answers, ran, flag = [], [], [False]

    def prof(frame, event, arg):
        answers.append(sys.getprofile() is prof)

    sys.setprofile(prof)
    try:
        assert thread_reach.run_here_when(lambda: flag[0], lambda: ran.append(sys.getprofile() is prof))
        answers.clear()
        _a_python_call()
        _a_python_call()
        assert ran == [] and answers and all(answers), answers  # it waits; each event sees the hook itself
        flag[0] = True
        _a_python_call()
        assert ran == [True] and sys.getprofile() is prof and all(answers)
    finally:
        sys.setprofile(None)

def _user_profilers_survive(hooked: str, worker_first: bool) -> dict:
    """A ``sys.setprofile`` hook in the ``hooked`` threads ("worker", "main" or "both") across enable, lends, a
    stale lease made by the main thread and one made by a worker (the worker's first when ``worker_first``),
    and disable: is each still the thread's?"""
    hooks = {"main": lambda f, e, a: None, "worker": lambda f, e, a: None}
    want = {"main": hooks["main"] if hooked in ("main", "both") else None,
            "worker": hooks["worker"] if hooked in ("worker", "both") else None}
    seen: dict = {}
    go, done, worker_stale = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        sys.setprofile(want["worker"])
        go.wait()
        buf2 = sanitizer.StagingBuffer(64, name="w-ring")
        v = buf2.write(0, torch.ones(4), name="v")
        buf2.reuse(0, 16, by="next")  # a stale lease made by a worker
        worker_stale.set()
        torch.ones(1).add(1)
        seen["worker_during"] = sys.getprofile() is want["worker"]
        del v
        buf2.close()
        done.wait()
        seen["worker_after"] = sys.getprofile() is want["worker"]
        sys.setprofile(None)

    t = threading.Thread(target=worker)
    t.start()
    sys.setprofile(want["main"])
    try:
        sanitizer.enable()
        buf = sanitizer.StagingBuffer(64, name="m-ring")
        w = buf.write(0, torch.ones(4), name="w")
        if worker_first:
            go.set()
            worker_stale.wait(30)
        buf.reuse(0, 16, by="next")  # a stale lease made by the main thread
        torch.ones(1).add(1)
        go.set()
        _a_python_call()
        seen["main_during"] = sys.getprofile() is want["main"]
        del w
        buf.close()
        done.set()
        t.join(30)
        sanitizer.disable()
        seen["main_after"] = sys.getprofile() is want["main"]
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("hooked,worker_first", [("worker", False), ("main", True), ("both", False),
                                                  ("both", True)])
def test_a_users_profile_hooks_survive_enable_lend_stale_and_disable_in_every_thread(hooked, worker_first):
    """Issue 46: a worker's hook was gone after the main thread's first stale lease, and the main thread's
    after a worker's first stale lease (3.11+; the reach is what replaced them)."""
    seen = _user_profilers_survive(hooked, worker_first)
    assert seen == {"worker_during": True, "worker_after": True, "main_during": True, "main_after": True}


def _stale_read_in_a_thread(name: str, hook, set_in_thread: bool):
    """A thread started while enabled (its own profiler ``hook`` set in it when ``set_in_thread``) reads a view
    that the main thread's reuse made stale: (was it caught, is the thread's profiler still ``hook``)."""
    caught, kept = [], []
    with sanitizer.sanitize():
        buf = sanitizer.StagingBuffer(64, name=name)
        box = {"w": buf.write(0, torch.ones(4), name="w")}
        ready, stale = threading.Event(), threading.Event()

        def reader() -> None:
            if set_in_thread:
                sys.setprofile(hook)
            ready.set()
            stale.wait()
            try:
                box["w"].sum()
                caught.append(False)
            except sanitizer.StaleBorrowError:
                caught.append(True)
            kept.append(sys.getprofile() is hook)
            sys.setprofile(None)

        t = threading.Thread(target=reader)
        t.start()
        ready.wait()
        buf.reuse(0, 16, by="next")
        stale.set()
        t.join(30)
        box.clear()
        buf.close()
    sanitizer.clear_errors()
    return caught, kept


def test_threads_started_while_enabled_are_checked_under_a_profiler_for_new_threads():
    """yappi and viztracer set ``threading.setprofile``: the threads started while enabled carry that
    profiler, and a stale read there is still caught (3.11+ reaches them under it; before, they carry the
    mode from their start)."""
    hook = lambda f, e, a: None  # noqa: E731
    threading.setprofile(hook)
    try:
        caught, kept = _stale_read_in_a_thread("yappi", hook, set_in_thread=False)
    finally:
        threading.setprofile(None)
    assert caught == [True] and kept == [True]


def test_a_thread_with_its_own_profiler_is_checked_and_keeps_it():
    """A worker started while enabled sets its own ``sys.setprofile`` hook (cProfile in a worker, 3.11's
    cProfile; pyinstrument): at the first stale lease it is still reached (3.11+: through its profiler, which
    keeps every event), and a stale read there raises."""
    calls = [0]

    def hook(frame, event, arg):
        calls[0] += 1

    caught, kept = _stale_read_in_a_thread("own-profiler", hook, set_in_thread=True)
    assert caught == [True] and kept == [True] and calls[0] > 0


_RESET_ALL = r"""
import sys, threading, time, torch, sanitizer
variant = sys.argv[1]
def userprof(frame, event, arg):
    pass
sanitizer.enable()
buf = sanitizer.StagingBuffer(1 << 16, name="b")
box, res, go = [None], {}, threading.Event()
def worker(i):
    go.wait()
    try:
        box[0].sum(); res[i] = "missed"
    except sanitizer.StaleBorrowError:
        res[i] = "caught"
    res[f"{i}_profiler_kept"] = sys.getprofile() is (userprof if variant == "user" else None)
threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
for t in threads:
    t.start()
time.sleep(0.2)
w = buf.lend(0, (16,), torch.float32, name="w"); box[0] = w[:4]; del w
buf.reuse(0, 64, by="next")  # the first stale lease: the waiting workers get a visit
threading.setprofile_all_threads(userprof if variant == "user" else None)  # a profiler starting (or stopping)
go.set()
for t in threads:
    t.join(30)
threading.setprofile_all_threads(None)
print(sorted(res.items(), key=str))
"""


@pytest.mark.parametrize("variant", ["user", "none"])
def test_a_profiler_resetting_every_thread_does_not_take_our_visits_with_it(variant):
    """A sampling profiler that sets (or clears) every thread's profile function before the visited threads ran
    took our visits away: those threads stayed unchecked while the lease stayed stale (3.12+)."""
    if not thread_reach.AVAILABLE or not hasattr(threading, "setprofile_all_threads"):
        pytest.skip("needs Python 3.12+ (threading.setprofile_all_threads, running threads visited)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _RESET_ALL, variant], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(sorted({**{i: "caught" for i in range(3)},
                                               **{f"{i}_profiler_kept": True for i in range(3)}}.items(),
                                              key=str))


def test_running_threads_can_be_reached_on_cpython_311_and_later():
    """The door that lets a worker drop the dispatch mode while nothing is stale (issue 52: a 4-thread load was
    4.8x of off on 3.11 while every worker kept it) must stay open on the Pythons the project supports: on
    3.11 it needs the frame flag found beside the profile fields at run time (``_find_cframe_field``)."""
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        pytest.skip("CPython 3.11+ only (3.10 keeps the mode for a thread's life)")
    assert thread_reach.AVAILABLE, thread_reach._why_not or thread_reach._api.cframe_why_not
    if sys.version_info[:2] == (3, 11):
        assert thread_reach._api.cframe_off == thread_reach._api.func_off - 8



def test_on_311_a_batch_is_kept_while_a_thread_points_at_it_then_settled_and_used_again():
    """3.11: a pass's batch must never die (that crashed the process, below): it is kept while a visited thread
    has not taken its visit, settled at the first pass after it has, and that pass uses it again."""
    if not thread_reach.AVAILABLE or not thread_reach._POOLED:
        pytest.skip("batches are pooled on Python 3.11 only, where other threads are reached")
    release, started, ran = threading.Event(), threading.Event(), []

    def worker() -> None:
        started.set()
        release.wait()  # blocked in C: no Python event until it is released
        sum(range(10))

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    visit = lambda: ran.append(threading.get_ident())  # noqa: E731 (a visit runs the latest pass's function)
    try:
        assert thread_reach.run_in_running_threads(visit)
        first = thread_reach._BATCHES[-1]
        assert len(first) >= 1  # the worker's visit waits in it
        thread_reach.run_in_running_threads(visit)
        assert any(b is first for b in thread_reach._BATCHES)  # the worker still points at it: kept
    finally:
        release.set()
        t.join()
    assert t.ident in ran
    thread_reach.run_in_running_threads(visit)
    # settled: in the pool, or already this pass's batch again (never freed)
    assert len(first) == 0 and (thread_reach._BATCHES[-1] is first or any(b is first for b in thread_reach._FREE))
    assert sum(b is first for b in thread_reach._BATCHES + thread_reach._FREE) == 1

_ENDING_THREADS = """
import sys, threading
sys.path.insert(0, {root!r})
from tests.torch_layer.test_user_tooling import _gc_inside_ops
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a thread that waits (tqdm's monitor did, in CI)
def churn():
    while not stop.is_set():
        t = threading.Thread(target=lambda: sum(range(200)))
        t.start(); t.join()
threading.Thread(target=churn, daemon=True).start()
print(_gc_inside_ops(3000, triage=1, halt_on_error=0))
stop.set()
"""


def test_threads_that_start_and_end_while_the_gc_runs_inside_ops_never_crash_the_process():
    """CI's full 3.11 run segfaulted in the ten-thousand-gc test while tqdm's monitor thread lived: with the
    reach of other threads on, this program crashed 3.11 in 3 runs of 4 (0 of 4 on 3.12; a segfault in a
    later collection, or in a visited thread's profile event freeing a batch). It was a batch dying where the
    last thread state let go of it (the thread's own event, an ending thread's clean-up): with every batch kept
    alive it never crashed, nor once batches are let go only at a pass's start (``_release_settled``: 16
    runs of 16). Three runs, each must exit cleanly with every result right."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _ENDING_THREADS.format(root=root)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "{'wrong': 0, 'raised': [], 'mode_left': 0, 'errors': 0}" in proc.stdout, proc.stdout
