"""The sanitizer at a real checkpoint's scale: 1k, 10k and 100k leases (or regions), curve by curve.

A real MoE checkpoint has 100,000+ tensors, so every per-lend, per-reuse and
per-region cost must grow as O(log n + k) (k: the leases a call actually
touches), not with the number of leases alive. Printed, each at n = 1k, 10k,
100k, in microseconds per call, with the ratio of the 100k figure to the 1k one
next to its target. Every time is the CPU time of the measuring thread (user and
system), the best of many runs: the machines are shared, and wall time would
count the other processes' turns (on a loaded 2-core machine a 10 ms call
often took 3x its CPU time).

* ``lend`` into a buffer holding n fresh leases (at increasing offsets, as loaders lend);
* ``reuse`` of bytes no lease covers, and of bytes covering k = 1 and 16 held leases;
* ``retire`` of one held lease (``StagingBuffer.retire``), and ``release`` (a lease's view dies);
* ``create/close`` of a staging buffer while n others are open;
* ``is_borrowed`` of an owned tensor while n regions are open (the address lookup);
* ``overlapping()`` of one lease's bytes, and ``leases()`` of a small buffer while n leases live elsewhere.

Then: one reuse that retires K held leases, K = 1k, 3k, 10k, guard on and off
(target: linear in K); the Python heap per live lease (tracemalloc) against a
plain view's; the file descriptors and memory maps that retained tombstones
hold; and a ring load whose consumer keeps 5,000 views, off and under
``triage=1`` (target <= 2 s); and issue 27's curve: a one-tensor ring whose consumer keeps n views in a
list, a dict by name and an object attribute, triage=1 against the sanitizer on without triage, with how
many retentions were credited to the right holder. The curves above run with the sanitizer off (the
ledger's cost, as a loader pays it in production); the guard, memory and
retention figures with it on.

    python bench/scale.py [--sizes 1000,10000,100000] [--budget 30] [--quick]
                          [--sections curves,retire,heap,tombstones,ring,holders,shapes] [--holders 1000,5000,...]
                          [--shapes 1000,5000,50000]

``shapes`` (issue 47): the ways a user keeps views (a module list, a function's local list, a dict, an attribute
list, a list in a dict, a ``functools.partial`` per weight, all mixed), each load in a fresh process with torch
imported, wall time per retention from 1,000 to 50,000 (a heap walk once per holder, never per retention).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from typing import Callable, Dict, List, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import sanitizer  # noqa: E402
from sanitizer.torch_layer import storage_handles  # noqa: E402
from sanitizer.torch_layer.state import state  # noqa: E402

SLOT = 64  # bytes per lease in the curves: 16 float32
REFERENCE_HEAP_PER_LEASE = 1315  # bytes, this bench's heap figure (sanitizer off) on main abfd864, before this work
HEAP_TARGET = 500  # bytes per live lease, sanitizer off, 100,000 leases (issue 33)
QUIET = dict(halt_on_error=0, report="", stack_depth=1)


def best_us(fn: Callable[[], object], number: int, repeat: int,
            setup: Callable[[], None] = lambda: None, teardown: Callable[[], None] = lambda: None) -> float:
    """Best microseconds per call of ``fn`` over ``repeat`` runs of ``number`` calls each."""
    best = float("inf")
    for _ in range(repeat):
        setup()
        t0 = time.thread_time()
        for _ in range(number):
            fn()
        best = min(best, (time.thread_time() - t0) / number)
        teardown()
    return best * 1e6


def fmt_us(us: float) -> str:
    return f"{us:9.2f}" if us < 1000 else f"{us:9.0f}"


class Curves:
    """One row per operation, one column per n."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = list(sizes)
        self.rows: Dict[str, Dict[int, float]] = {}
        self.targets: Dict[str, float] = {}

    def add(self, row: str, n: int, us: float, target_ratio: float = 3.0) -> None:
        self.rows.setdefault(row, {})[n] = us
        self.targets[row] = target_ratio

    def print(self) -> bool:
        first, last = self.sizes[0], self.sizes[-1]
        head = "".join(f" {f'n={n:,}':>10}" for n in self.sizes)  # (a space: n=1,000,000 is 11 wide)
        print(f"{'µs per call':<34}{head}   {f'{last:,}/{first:,}':>10}  target")
        ok = True
        for row, by_n in self.rows.items():
            cells = "".join(f"  {fmt_us(by_n[n])}" if n in by_n else f"{'-':>11}" for n in self.sizes)
            ratio = by_n.get(last, float("nan")) / by_n.get(first, float("nan"))
            met = ratio <= self.targets[row]
            ok &= met
            print(f"{row:<34}{cells}   {ratio:9.2f}x  <= {self.targets[row]:.0f}x {'ok' if met else 'MISSED'}")
        return ok


def _held_buffer(n: int, spare: int) -> tuple:
    """A buffer with ``n`` fresh leases lent at increasing offsets (views held) and ``spare`` free bytes after."""
    buf = sanitizer.StagingBuffer(n * SLOT + spare, name=f"held{n}")
    views = [buf.lend(i * SLOT, (SLOT // 4,), torch.float32) for i in range(n)]
    return buf, views


def lease_curves(curves: Curves, n: int, number: int, repeat: int) -> None:
    spare = 64 * SLOT * number
    buf, views = _held_buffer(n, spare)
    base = n * SLOT
    ledger = state.ledger
    rid = buf._region.region_id
    box: List[torch.Tensor] = []

    def lend_more() -> None:
        box.append(buf.lend(base + len(box) * SLOT, (SLOT // 4,), torch.float32))

    curves.add("lend", n, best_us(lend_more, number, repeat, teardown=box.clear))
    far = base + spare - SLOT
    curves.add("reuse, no lease hit", n, best_us(lambda: buf.reuse(far, 16), number, repeat))
    for k in (1, 16):
        def held_k() -> None:
            box.extend(buf.lend(base + i * SLOT, (SLOT // 4,), torch.float32) for i in range(k))
        curves.add(f"reuse hitting k={k} held leases", n,
                   best_us(lambda: buf.reuse(base, k * SLOT), 1, repeat * 20, setup=held_k, teardown=box.clear))
    curves.add("retire 1 held lease", n,
               best_us(lambda: buf.retire(base, SLOT), 1, repeat * 20,
                       setup=lambda: box.append(buf.lend(base, (SLOT // 4,), torch.float32)), teardown=box.clear))

    def release() -> None:
        box.pop()
    curves.add("release (a lease's view dies)", n,
               best_us(release, number, repeat,
                       setup=lambda: box.extend(buf.lend(base + i * SLOT, (SLOT // 4,), torch.float32)
                                                for i in range(number))))
    mid = (n // 2) * SLOT
    curves.add("overlapping() of one lease", n, best_us(lambda: ledger.overlapping(rid, mid, mid + SLOT), number, repeat))
    small = sanitizer.StagingBuffer(4 * SLOT, name="small")
    small_views = [small.lend(i * SLOT, (SLOT // 4,), torch.float32) for i in range(4)]
    curves.add("leases() of a 4-lease buffer", n, best_us(small.leases, number, repeat))
    del small_views, views, box
    small.close()
    buf.close()
    gc.collect()


def region_curves(curves: Curves, n: int, number: int, repeat: int) -> None:
    backing = torch.empty(n * SLOT, dtype=torch.uint8)
    others = [sanitizer.StagingBuffer.adopt(backing[i * SLOT:(i + 1) * SLOT], name=f"r{i}") for i in range(n)]

    def create_close() -> None:
        sanitizer.StagingBuffer(SLOT, name="tmp").close()
    curves.add("buffer create + close", n, best_us(create_close, number, repeat))
    owned = torch.empty(16)  # not in any region: the lookup must say so quickly
    curves.add("is_borrowed(owned tensor)", n, best_us(lambda: sanitizer.is_borrowed(owned), number, repeat))
    for buf in others:
        buf.close()
    del others
    gc.collect()


def retire_many(ks: Sequence[int], budget: float) -> None:
    print("\none reuse retiring K held leases (CPU seconds; target: linear in K, i.e. per-lease cost flat)")
    print(f"{'':<12}" + "".join(f"{f'K={k:,}':>14}" for k in ks) + "   per lease at the last K / at the first")
    skipped = []
    for guard in (False, True):
        row, per, done = [], [], []
        for k in ks:
            if len(per) >= 2 and per[-1] > 2 * per[0]:  # growing faster than linear: predict it
                predicted = per[-1] * k * (k / done[-1])  # as if quadratic
                if predicted > budget:
                    row.append(f"{f'~{predicted:.0f} s?':>14}")
                    skipped.append(f"guard={int(guard)} K={k:,}: predicted {predicted:.0f} s (quadratic from "
                                   f"K={done[-1]:,}), past --budget {budget:.0f} s: not run")
                    continue
            with sanitizer.sanitize(guard=guard, **QUIET):  # lent while on: the guard covers them
                buf, views = _held_buffer(k, 0)
                gc.collect()
                t0 = time.thread_time()
                buf.reuse(0, k * SLOT, by="next")
                took = time.thread_time() - t0
            del views
            buf.close()
            gc.collect()
            per.append(took / k)
            done.append(k)
            row.append(f"{took:14.3f}")
        ratio = per[-1] / per[0] if len(per) > 1 else float("nan")
        print(f"{'guard=' + str(int(guard)):<12}" + "".join(row)
              + f"   {ratio:.2f}x (K={done[-1]:,}; target <= 3x) {'ok' if ratio <= 3 else 'MISSED'}")
    for line in skipped:
        print(f"  {line}")


_HEAP = r"""
import gc, sys, tracemalloc, torch
sys.path.insert(0, {root!r})
import sanitizer
n, slot, what = {n}, {slot}, {what!r}
backing = torch.empty(n * slot, dtype=torch.uint8)
buf = sanitizer.StagingBuffer(n * slot, name="heap")
if what == "plain":
    make = lambda i: backing[i * slot:(i + 1) * slot].view(torch.float32)
else:
    make = lambda i: buf.lend(i * slot, (slot // 4,), torch.float32)
    if what != "off":
        sanitizer.enable(halt_on_error=0, report="", **({{"triage": True}} if what == "triage" else {{}}))
    keep = [make(i) for i in range(64)]  # the first lends' one-time costs (imports, caches) are not a lease's
gc.collect()
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
kept = [make(i) for i in range(64, n)]
print((tracemalloc.get_traced_memory()[0] - before) / len(kept))
"""


def heap_per_lease(n: int) -> None:
    """Each figure in a fresh interpreter: the lookups' dicts only grow, so a second measurement in
    one process would find their tables already sized and count less than a lease really costs."""
    import subprocess

    print(f"\nPython heap per live lease (tracemalloc, {n:,} leases held, each in a fresh interpreter; "
          f"reference: a plain view, and {REFERENCE_HEAP_PER_LEASE:,} B measured before this work, sanitizer off)")
    target = HEAP_TARGET
    plain = None
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    for what, label in (("plain", "plain view (slice + view)"), ("off", "lease, sanitizer off"),
                        ("on", "lease, sanitizer on (defaults)"), ("triage", "lease, sanitizer on, triage=1")):
        code = _HEAP.format(root=ROOT, n=n, slot=SLOT, what=what)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        if out.returncode:
            print(f"  {label:<40} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        per = float(out.stdout.split()[-1])
        if plain is None:
            plain = per
            print(f"  {label:<40} {per:8.0f} B")
            continue
        print(f"  {label:<40} {per:8.0f} B   {per / plain:5.1f}x a plain view"
              + (f"   target <= {target:.0f} B (issue 33) {'ok' if per <= target else 'MISSED'}"
                 if what == "off" else ""))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def tombstones(kept_views: int) -> None:
    print(f"\ntombstones of {kept_views:,} retained stale views (guard=1; target: no descriptor held)")
    ring = sanitizer.StagingRing(16 * SLOT, name="tomb")
    gc.collect()
    fds0, maps0, live0 = _fds(), _maps(), storage_handles.POISON.live
    kept = []
    with sanitizer.sanitize(**QUIET):
        for i in range(kept_views):
            kept.append(ring.put(f"w{i}", torch.full((SLOT // 4,), float(i))))
        made = storage_handles.POISON.live - live0
        fds1, maps1 = _fds(), _maps()
        nan = bool(torch.isnan(kept[0]).all())
    print(f"  open fds {fds0} -> {fds1} (+{fds1 - fds0}; was +1 per tombstone), memory maps {maps0} -> {maps1} "
          f"({made:,} mapped tombstones, {storage_handles.POISON.fallbacks} allocated past the map limit "
          f"of {storage_handles.POISON.max_maps:,}), retained view reads NaN: {nan}")
    del kept
    ring.close()
    gc.collect()
    print(f"  after the views die: fds {_fds()}, maps {_maps()}, mapped tombstones alive "
          f"{storage_handles.POISON.live - live0}")


def ring_retention(kept_views: int) -> None:
    print(f"\nring load whose consumer keeps {kept_views:,} views (16-slot ring, CPU seconds; "
          f"target <= 2 s under triage=1)")
    for label, opts in (("sanitizer off", None), ("on, defaults (guard)", {}), ("on, triage=1", {"triage": True})):
        ring = sanitizer.StagingRing(16 * SLOT, name="keep")
        src = torch.ones(SLOT // 4)
        kept = []
        if opts is not None:
            sanitizer.enable(**QUIET, **opts)
        t0 = time.thread_time()
        for i in range(kept_views):
            kept.append(ring.put(f"w{i}", src))
        took = time.thread_time() - t0
        sanitizer.disable()
        del kept
        ring.close()
        gc.collect()
        print(f"  {label:<24} {took:8.3f} s" + (f"   {'ok' if took <= 2 else 'MISSED'}" if opts and "triage" in opts
                                                  else ""))


class _Keeper:
    def __init__(self) -> None:
        self.kept: list = []


def _holders_load(n: int, how: str) -> tuple:
    """One load of n tensors through a one-tensor ring (every put reuses the last), kept round robin in a
    list, a dict by name and an object attribute: ``how`` is off, on without triage, or triage=1.
    Returns (CPU seconds, retentions named, how many were credited to the right holder)."""
    from sanitizer.features import holders as _holders_mod, triage as _triage

    ring = sanitizer.StagingRing(SLOT, name=f"holders-{how}")
    src = torch.ones(SLOT // 4)
    lst, dct, obj = [], {}, _Keeper()
    where = {}
    if how != "off":
        sanitizer.enable(**QUIET, max_records=n + 16, **({"triage": True} if how == "triage" else {}))
        if how == "on":
            _triage.uninstall()
    _triage.reset(records_too=True)
    _holders_mod.forget_patterns()
    t0 = time.thread_time()
    for i in range(n):
        w = ring.put(f"layers.{i}.weight", src)
        if i % 3 == 0:
            lst.append(w)
        elif i % 3 == 1:
            dct[f"layers.{i}.weight"] = w
        else:
            obj.kept.append(w)
        where[f"layers.{i}.weight"] = ("'lst'", "'dct'", "_Keeper.kept")[i % 3]
    del w
    right = named = 0
    if how == "triage":
        for e in _triage.retentions():
            named += 1
            right += where[e["lease"]["name"]] in ((e.get("holder") or {}).get("path") or "")
    took = time.thread_time() - t0
    sanitizer.disable()
    _triage.install()
    _triage.reset(records_too=True)
    del lst, dct, obj
    ring.close()
    gc.collect()
    return took, named, right


def holders_curve(sizes: Sequence[int]) -> None:
    """Issue 27's figure: a ring load keeping n views in three holders, triage=1 against the same load with
    the sanitizer on and triage's hooks off (the guard and the ledger alone) and off."""
    print("\nring load keeping n views in a list, a dict by name and an object attribute (one-tensor ring: "
          "every put reuses the last; CPU seconds; targets: triage=1 <= 2 s at 5,000, <= 20 s at 50,000)")
    print(f"{'n':>8} {'off':>9} {'on, no triage':>14} {'triage=1':>10} {'triage adds':>12} {'per kept view':>14}"
          f" {'named right':>12}")
    per = []
    for n in sizes:
        # Best of three for the small loads (one run at 5,000 on a shared 2-core machine ranged 2.6-4.2 s),
        # of one past 10,000 (the curve's large end takes a minute a run).
        runs = 3 if n <= 10_000 else 1
        off = min(_holders_load(n, "off")[0] for _ in range(runs))
        on = min(_holders_load(n, "on")[0] for _ in range(runs))
        tri, named, right = min((_holders_load(n, "triage") for _ in range(runs)), key=lambda r: r[0])
        target = 2.0 if n <= 5_000 else 20.0 if n <= 50_000 else None
        per.append((tri - on) / max(n - 1, 1) * 1e3)
        verdict = "" if target is None or n not in (5_000, 50_000) else f"   {'ok' if tri <= target else 'MISSED'}"
        print(f"{n:>8,} {off:9.3f} {on:14.3f} {tri:10.3f} {tri - on:12.3f} {per[-1]:11.3f} ms {right:>5}/{named:<6}"
              + verdict)
    if len(per) > 1:
        print(f"  triage's cost per kept view, largest n / smallest: {per[-1] / per[0]:.2f}x (linear: ~1x)")


_SHAPE_RUN = r"""
import functools, sys, time
sys.path.insert(0, sys.argv[3])
import torch, sanitizer
shape, n = sys.argv[1], int(sys.argv[2])
sanitizer.enable(triage=1, halt_on_error=0, report="", max_records=n + 16)
ring = sanitizer.StagingRing(256 * 1024, name="shapes")  # 256 views of 1 KiB: a victim is a whole ring old
def load(w):
    return w
class Holder:
    pass
LIST, DICT, OBJ, NESTED, DEFERRED = [], {}, Holder(), {"layer": []}, []
OBJ.kept = []
KINDS = ("module list", "local list", "dict", "attribute list", "list in a dict", "partial per weight")
def run():
    local = []  # (each kept by a statement of its own, as a consumer writes it: no bound .append held anywhere)
    t0 = time.perf_counter()
    for i in range(n):
        t = ring.put(f"layers.{i}.weight", torch.full((256,), float(i)))
        how = KINDS[i % len(KINDS)] if shape == "mixed" else shape
        if how == "module list":
            LIST.append(t)
        elif how == "local list":
            local.append(t)
        elif how == "dict":
            DICT[f"w{i}"] = t
        elif how == "attribute list":
            OBJ.kept.append(t)
        elif how == "list in a dict":
            NESTED["layer"].append(t)
        else:
            DEFERRED.append(functools.partial(load, t))
    del t
    took = time.perf_counter() - t0
    from sanitizer.features import triage
    evs = triage.retentions()
    walks = sum(1 for e in evs if "walk" in ((e.get("walk") or {}).get("when"), (e.get("walk") or {}).get("others")))
    print(took, len(evs), walks)
run()
"""
SHAPES = ("module list", "local list", "dict", "attribute list", "list in a dict", "partial per weight", "mixed")


def shapes_curve(sizes: Sequence[int]) -> None:
    """Issue 47: triage's cost for the ways a user keeps views, each load in a fresh process with torch imported
    (the heap a user has), wall time: a heap walk is paid once per new holder, never per retention."""
    import subprocess

    print("\nhow views are kept, triage=1, ring of 256 views (each retention a whole ring old), fresh process, "
          "wall seconds; targets: <= 2 s at 5,000, cost per retention flat (<= 1.5x) from the smallest n")
    print(f"{'shape':<20}" + "".join(f"{n:>12,}" for n in sizes) + f"{'us/kept, last/first':>22}{'heap walks':>12}")
    for shape in SHAPES:
        cells, per, walks = [], [], []
        for n in sizes:
            proc = subprocess.run([sys.executable, "-c", _SHAPE_RUN, shape, str(n), ROOT], capture_output=True,
                                  text=True, timeout=3600)
            try:
                took, kept, walked = proc.stdout.split()
            except ValueError:
                cells.append(f"{'error':>12}")
                continue
            took_s = float(took)
            cells.append(f"{took_s:11.2f}s" + ("" if n != 5_000 else "" if took_s <= 2 else "!"))
            per.append(took_s / max(int(kept), 1) * 1e6)
            walks.append(walked)
        ratio = f"{per[-1]:.0f}/{per[0]:.0f} = {per[-1] / per[0]:.2f}x" if len(per) > 1 else ""
        print(f"{shape:<20}" + "".join(cells) + f"{ratio:>22}{'/'.join(walks):>12}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--retire", default="1000,3000,10000", help="K for the one-reuse-retires-K curve")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="skip a K predicted to take longer than this many seconds (a quadratic curve)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats, smaller retention figures")
    ap.add_argument("--holders", default="1000,5000,10000,50000", help="n for the three-holder ring load curve")
    ap.add_argument("--sections", default="curves,retire,heap,tombstones,ring,holders,shapes",
                    help="which parts to run (comma-separated)")
    ap.add_argument("--shapes", default="1000,5000,50000", help="n for the ways-views-are-kept curve (issue 47)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(s) for s in args.sizes.split(",")]
    sections = set(args.sections.split(","))
    number, repeat = (50, 3) if args.quick else (200, 7)
    one, five, _ = os.getloadavg()
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}; load average {one:.2f} (1 min) "
          f"{five:.2f} (5 min) on {os.cpu_count()} CPUs\n")
    ok = True
    if "curves" in sections:
        curves = Curves(sizes)
        for n in sizes:
            lease_curves(curves, n, number, repeat)
            region_curves(curves, n, number, repeat)
        print("the ledger at scale: n leases held in one buffer (or n regions open), sanitizer off\n")
        ok = curves.print()
    if "retire" in sections:
        retire_many([int(k) for k in args.retire.split(",")], args.budget)
    if "heap" in sections:
        heap_per_lease(2_000 if args.quick else 100_000)
    if "tombstones" in sections:
        tombstones(2_000)
    if "ring" in sections:
        ring_retention(1_000 if args.quick else 5_000)
    if "holders" in sections:
        holders_curve([1_000, 5_000] if args.quick else [int(n) for n in args.holders.split(",")])
    if "shapes" in sections:
        shapes_curve([1_000, 5_000] if args.quick else [int(n) for n in args.shapes.split(",")])
    print("\n(CPU time of the measuring thread, best of several runs: a shared machine still adds cache noise)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
