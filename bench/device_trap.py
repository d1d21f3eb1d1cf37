"""Trap mode on a real GPU (``bench/device_check.sh`` section 6): the driver's virtual memory management.

First, the probe (``--probe-only`` stops there): one line each for what no fake can answer, so a short
device run answers them before anything else: does ``cuMemMap`` refuse a non-zero offset; does
``cuMemSetAccess`` accept a read-only (``PROT_READ``) device mapping; what a trap lend costs with GPU
work queued ahead of it. On a machine without CUDA it prints that it was skipped and exits 2.

Prints, side by side in one run: the device's granularity; lend with ``trap=poison`` against lend without
(median of interleaved repeats, and the absolute figures); a ring load with trap against the default debug
run (bit-identical results checked); what a raw alias of a retired lease reads (poison), what it reads
after ``rescue=1`` (the rescued bytes); and, in a child process, that ``trap=fault`` ends a read of a
retired lease with CUDA's illegal-address error. Exit 0 when every check holds, 1 otherwise, 2 without
a CUDA device.

    python bench/device_trap.py [--leases 200] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sanitizer  # noqa: E402
from sanitizer import StagingBuffer  # noqa: E402
from sanitizer.torch_layer.ring import StagingRing  # noqa: E402


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s bytes that the sanitizer never made (a C extension's alias), read on the GPU."""
    from sanitizer.torch_layer.aliasing import device_region

    alias = torch.as_tensor(device_region(None, t.data_ptr(), t.numel() * t.element_size()), device=t.device)
    with torch._C._DisableTorchDispatch():  # the mode would raise for it; a raw alias is what trap catches
        return alias.view(t.dtype).clone().cpu()


def lend_times(trap: str, leases: int) -> float:
    sanitizer.enable(trap=trap)
    buf = StagingBuffer(leases * 4096, device="cuda", name=f"lend-{trap}")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    views = [buf.lend(i * 4096, (1024,), torch.float32, f"v{i}") for i in range(leases)]
    seconds = (time.perf_counter() - t0) / leases
    del views
    buf.close()
    sanitizer.disable()
    return seconds


def ring_load(trap: str) -> tuple:
    sanitizer.enable(trap=trap)
    g = torch.Generator().manual_seed(11)
    weights = [torch.randn(256 + i, 1024, generator=g).cuda() for i in range(46)]
    out = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with StagingRing(5 << 20, device="cuda", name=f"ring-{trap}") as ring:
        for i, t in enumerate(weights):
            out.append(ring.put(f"w{i}", t).clone())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    errors = sanitizer.errors()
    sanitizer.disable()
    return seconds, [t.cpu() for t in out], errors


FAULT_CHILD = textwrap.dedent("""
    import torch, sanitizer
    from sanitizer import StagingBuffer
    sanitizer.enable(trap="fault")
    buf = StagingBuffer(1 << 22, device="cuda", name="faultbuf")
    w = buf.write(0, torch.arange(1024, dtype=torch.float32, device="cuda"), "w")
    ptr = w.data_ptr()
    buf.write(0, torch.zeros(1024, device="cuda"), "next")
    from sanitizer.torch_layer.aliasing import device_region
    alias = torch.as_tensor(device_region(None, ptr, 4096), device="cuda")
    with torch._C._DisableTorchDispatch():
        alias.view(torch.float32).sum().item()
    print("NOT REACHED", flush=True)
""")


def _probe_offset(drv, g: int) -> str:
    """Map the second granule of a two-granule allocation (offset = one granule): refused?"""
    from cuda_hooks import vmm

    h = drv.create(2 * g, 0)
    at = drv.reserve(g, g, 0)
    try:
        try:
            drv.map(at, g, h, g)
        except vmm.VmmError as exc:
            return f"refused ({exc})"
        drv.unmap(at, g)
        return "ACCEPTED (cuda.h says it must be zero; trap mode maps offset 0 only anyway)"
    finally:
        drv.free(at, g)
        drv.release(h)


def _probe_read_only(drv, g: int) -> str:
    """A device mapping granted PROT_READ: accepted, and does a device read of it work?"""
    from cuda_hooks import vmm

    h = drv.create(g, 0)
    at = drv.reserve(g, g, 0)
    try:
        drv.map(at, g, h, 0)
        try:
            drv.set_access(at, g, [0], True)
            drv.memset(at, 0xFF, g, 0)
            drv.set_access(at, g, [0], False)
        except vmm.VmmError as exc:
            drv.unmap(at, g)
            return f"REFUSED ({exc}): trap mode falls back to read-write poison"
        from sanitizer.torch_layer.aliasing import device_region

        t = torch.as_tensor(device_region(None, at, 16), device="cuda")
        ok = bytes(t.cpu().tolist()) == b"\xff" * 16
        del t
        torch.cuda.synchronize()
        drv.unmap(at, g)
        return f"accepted; a device read of it {'reads the bytes' if ok else 'READ WRONG BYTES'}"
    finally:
        drv.free(at, g)
        drv.release(h)


def _probe_lend_behind_queued_work(leases: int = 50) -> str:
    """Host cost of a trap lend (and of a trapping reuse) while a long kernel is queued ahead."""
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(leases * 4096 + (4 << 20), device="cuda", name="probe")
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # ~ tens of ms of queued GPU work
        a = a @ a
        a /= a.norm()
    t0 = time.perf_counter()
    views = [buf.lend(i * 4096, (1024,), torch.float32, f"p{i}") for i in range(leases)]
    lend = (time.perf_counter() - t0) / leases
    queued = not torch.cuda.current_stream().query()
    t0 = time.perf_counter()
    buf.reuse(0, 4096, by="probe-next")  # traps p0: waits for the queued work
    retire = time.perf_counter() - t0
    del views, a
    buf.close()
    sanitizer.disable()
    return (f"{lend * 1e6:.1f} us per lend with work still queued={queued}; "
            f"first trapping retire {retire * 1e3:.1f} ms (includes the device wait)")


def probe() -> int:
    """Answer first what only a GPU can: each on one line. 2 when skipped (no CUDA)."""
    if not torch.cuda.is_available():
        print("PROBE skipped: no CUDA")
        return 2
    from cuda_hooks import vmm
    from sanitizer.torch_layer import trap_cuda

    why = trap_cuda.unavailable(torch.device("cuda", 0))
    if why is not None:
        print(f"PROBE skipped: trap mode cannot use this GPU: {why}")
        return 1
    drv = vmm.driver()
    g = drv.granularity(0)
    print(f"PROBE granularity: {g >> 10} KiB", flush=True)
    for label, fn in (("cuMemMap non-zero offset", lambda: _probe_offset(drv, g)),
                      ("cuMemSetAccess read-only device mapping", lambda: _probe_read_only(drv, g)),
                      ("trap lend behind queued GPU work", _probe_lend_behind_queued_work)):
        try:
            answer = fn()
        except Exception as exc:  # one probe's failure must not hide the others' answers
            answer = f"ERROR {type(exc).__name__}: {exc}"
        print(f"PROBE {label}: {answer}", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--probe-only", action="store_true", help="answer the probe's questions, then stop")
    args = ap.parse_args()
    rc = probe()
    if rc == 2:
        print("SKIP: no CUDA device")
        return 2
    if args.probe_only:
        return rc
    from sanitizer.torch_layer import trap_cuda
    from cuda_hooks import vmm

    why = trap_cuda.unavailable(torch.device("cuda", 0))
    if why is not None:
        print(f"FAIL: trap mode cannot use this GPU: {why}")
        return 1
    ok = True
    print(f"granularity: {vmm.driver().granularity(0) >> 10} KiB")

    # 1. every alias of a retired lease reads poison; after rescue=1 the rescued bytes
    sanitizer.enable(trap="poison")
    buf = StagingBuffer(1 << 22, device="cuda", name="aliases")
    first = torch.arange(1024, dtype=torch.float32, device="cuda")
    w = buf.write(0, first, "w")
    dl = torch.from_dlpack(w)
    buf.write(0, torch.full((1024,), 7.0, device="cuda"), "next")
    raw = _raw(w)
    poison = bool(torch.isnan(raw).all())
    try:
        dl.sum()
        raised = "nothing"
    except sanitizer.StaleBorrowError:
        raised = "StaleBorrowError"
    print(f"ALIASES retired lease: raw alias reads {'poison (NaN)' if poison else raw[:4].tolist()}; "
          f"a DLPack alias raises {raised}")
    ok &= poison and raised == "StaleBorrowError"
    sanitizer.disable()
    sanitizer.enable(trap="poison", rescue=True)
    buf = StagingBuffer(1 << 22, device="cuda", name="rescued")
    w = buf.write(0, first, "w")
    buf.write(0, torch.full((1024,), 7.0, device="cuda"), "next")
    rescued = torch.equal(_raw(w).cuda(), first) and torch.equal(w, first)
    print(f"RESCUE raw alias and tensor read the rescued bytes: {rescued}")
    ok &= rescued
    sanitizer.disable()

    # 2. lend with trap against lend without, interleaved
    plain, trapped = [], []
    for _ in range(args.repeats):
        plain.append(lend_times("0", args.leases))
        trapped.append(lend_times("poison", args.leases))
    p, t = statistics.median(plain), statistics.median(trapped)
    print(f"LEND trap=0 {p * 1e6:.1f} us, trap=poison {t * 1e6:.1f} us per lend (median of {args.repeats}); "
          f"ratio {t / p:.2f}x (CPU target <= 3x)")

    # 3. a ring load: bit-identical, and its cost
    times = {"0": [], "poison": []}
    results = {}
    for _ in range(3):
        for mode in ("0", "poison"):
            seconds, out, errors = ring_load(mode)
            times[mode].append(seconds)
            results[mode] = out
            ok &= errors == []
    identical = all(torch.equal(a, b) for a, b in zip(results["0"], results["poison"]))
    r0, r1 = min(times["0"]), min(times["poison"])
    print(f"RING 46 tensors, 5 MiB ring: default {r0 * 1e3:.1f} ms, trap=poison {r1 * 1e3:.1f} ms "
          f"({r1 / r0:.2f}x, CPU target <= 1.25x); bit-identical: {identical}")
    ok &= identical

    # 4. trap=fault: the read of a retired lease is an illegal address (the context is gone: a child)
    child = subprocess.run([sys.executable, "-c", FAULT_CHILD], capture_output=True, text=True, timeout=60,
                           env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    illegal = child.returncode != 0 and "illegal" in child.stderr.lower() and "NOT REACHED" not in child.stdout
    print(f"FAULT child exit {child.returncode}: {'illegal address' if illegal else child.stderr.strip()[-200:]}")
    ok &= illegal
    print("VERDICT", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
