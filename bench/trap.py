"""What trap mode (``trap=poison``) costs, measured side by side in one run.

Prints absolute figures and ratios:

* **lend**: ``StagingBuffer.lend`` of a trap buffer (one ``mmap`` of the lease's pages per lend, one
  ``munmap`` when the dropped view dies) vs today's lend (sanitizer enabled, default options), in
  turns; target <= 3x;
* **ring load**: the reference checkpoint (``sanitizer.testing.reference``) streamed through a
  ``StagingRing`` smaller than it by a correct consumer (copies each tensor out), ``trap=poison``
  vs the default debug run (``sanitizer.enable()``), interleaved run by run; target <= 1.25x;
* **mappings held per 10,000 retained views**: trap windows (one per lease), and the process's map
  count (``/proc/self/maps`` lines) before and after, fresh and after a reuse retired them all,
  next to the guard's tombstones (``trap=0``) for the same retention.

* **leases sharing pages**: 10,000 live leases, 64 on a page, lent from buffers of 16 MiB, 256 MiB and
  1 GiB: the time per lend must not grow with the buffer.

    python bench/trap.py [--lends 2000] [--reps 7] [--hidden 512] [--views 10000] [--shared 10000]
    python bench/trap.py --only-shared [--shared 10000] [--sizes 16,256,1024]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import sanitizer  # noqa: E402
from sanitizer import StagingBuffer  # noqa: E402
from sanitizer.torch_layer import trap  # noqa: E402
from sanitizer.torch_layer.ring import StagingRing  # noqa: E402


def _maps() -> int:
    with open("/proc/self/maps") as fh:
        return sum(1 for _ in fh)


def lend_us(buf: StagingBuffer, number: int) -> float:
    lend = buf.lend
    t0 = time.perf_counter()
    for _ in range(number):
        lend(8192, (256, 128), torch.bfloat16, "layers.0.w")  # dropped at once: its release is paid too
    return (time.perf_counter() - t0) / number * 1e6


def bench_lend(number: int, reps: int) -> None:
    sanitizer.enable()
    plain = StagingBuffer(1 << 20, name="plain")
    sanitizer.enable(trap="poison")
    trapped = StagingBuffer(1 << 20, name="trapped")
    assert type(trapped) is not StagingBuffer
    anchors = (plain.lend(0, (16,), torch.float32, "a"), trapped.lend(0, (16,), torch.float32, "a"))
    times = {"today's lend": [], "trap=poison lend": [], "ratio": []}
    for _ in range(reps):
        gc.collect()
        p = lend_us(plain, number)
        t = lend_us(trapped, number)
        times["today's lend"].append(p)
        times["trap=poison lend"].append(t)
        times["ratio"].append(t / p)
    del anchors
    print(f"lend ({number} lends x {reps} interleaved repeats; sanitizer enabled, bf16[256, 128], view dropped):")
    for k, v in times.items():
        unit = "x" if k == "ratio" else " us"
        print(f"  {k:22s} min {min(v):8.2f}{unit}   median {statistics.median(v):8.2f}{unit}")
    print("  target: <= 3x")
    plain.close()
    trapped.close()
    sanitizer.disable()


def _load(path: str, ring_bytes: int, **options) -> float:
    from sanitizer.testing.reference.checkpoint import stream_through_ring

    sanitizer.enable(**options)
    t0 = time.perf_counter()
    with StagingRing(ring_bytes, name="ring") as ring:
        out = {name: t.clone() for name, t in stream_through_ring(path, ring)}  # a correct consumer
    took = time.perf_counter() - t0
    sanitizer.disable()
    del out
    return took


def bench_ring(hidden: int, reps: int) -> None:
    from sanitizer.testing.reference.checkpoint import write_checkpoint
    from sanitizer.testing.reference.fused_loaders import TinyConfig

    cfg = TinyConfig(hidden=hidden, intermediate=2 * hidden, moe_intermediate=hidden)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ref.safetensors")
        sizes = write_checkpoint(path, cfg)
        ring_bytes = max(sizes["largest"], sizes["bytes"] // 4)
        runs = {"default debug run": [], "trap=poison": [], "ratio": []}
        _load(path, ring_bytes)  # warm the page cache and the imports
        for _ in range(reps):
            gc.collect()
            d = _load(path, ring_bytes, trap="0")
            t = _load(path, ring_bytes, trap="poison")
            runs["default debug run"].append(d * 1e3)
            runs["trap=poison"].append(t * 1e3)
            runs["ratio"].append(t / d)
    print(f"ring load of the reference checkpoint ({sizes['bytes'] / 2**20:.1f} MiB, {sizes['tensors']} tensors, "
          f"ring {ring_bytes / 2**20:.1f} MiB; {reps} interleaved runs):")
    for k, v in runs.items():
        unit = "x" if k == "ratio" else " ms"
        print(f"  {k:22s} min {min(v):8.2f}{unit}   median {statistics.median(v):8.2f}{unit}")
    print("  target: <= 1.25x")


def bench_mappings(views: int) -> None:
    from sanitizer.features import guard
    from sanitizer.torch_layer import storage_handles

    print(f"mappings held per {views} retained views (float32[16] each, 64 bytes apart):")
    for mode in ("poison", "0"):
        sanitizer.enable(trap=mode)
        gc.collect()
        maps0, windows0 = _maps(), trap.stats()["windows"]
        tomb0 = storage_handles.POISON.live
        buf = StagingBuffer(64 * views, name=f"keep-{mode}")
        kept = [buf.lend(64 * i, (16,), torch.float32, f"v{i}") for i in range(views)]
        fresh = _maps() - maps0
        buf.reuse(0, 64 * views, by="next")  # every kept view is now retired (trapped, or a tombstone)
        retired = _maps() - maps0
        print(f"  trap={mode:6s}  trap windows {trap.stats()['windows'] - windows0:6d}   "
              f"guard tombstones {storage_handles.POISON.live - tomb0:6d}   "
              f"process maps +{fresh} fresh, +{retired} after the reuse")
        del kept
        buf.close()
        gc.collect()
        print(f"  {'':13s}after the views died: process maps {_maps() - maps0:+d}")
        sanitizer.disable()
    print(f"  vm.max_map_count = {trap.stats()['max_map_count']}, trap budget {trap.stats()['max_windows']} windows")
    del guard


def bench_shared_pages(leases: int, sizes_mib: list) -> None:
    """Leases that share pages, all alive (64 float32[16] on a page): the lend cost per lease for buffers of
    growing size. Each depth of leases on a page needs a mapping of its own; what that mapping covers (the
    whole buffer, populated, before issue 48; a 2 MiB chunk now) decides whether the cost grows with the
    buffer."""
    print(f"{leases} live leases sharing pages (64 on a page), lend time by buffer size (trap=poison):")
    sanitizer.enable(trap="poison")
    for mib in sizes_mib:
        gc.collect()
        buf = StagingBuffer(mib << 20, name=f"shared-{mib}")
        maps0 = _maps()
        t0 = time.perf_counter()
        kept = [buf.lend(64 * i, (16,), torch.float32, f"v{i}") for i in range(leases)]
        took = time.perf_counter() - t0
        print(f"  {mib:6d} MiB buffer: {took:8.3f} s in all, {took / leases * 1e6:8.1f} us per lend, "
              f"process maps +{_maps() - maps0}")
        del kept
        buf.close()
        del buf
        gc.collect()
    sanitizer.disable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lends", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--views", type=int, default=10000)
    ap.add_argument("--shared", type=int, default=10000, help="live leases sharing pages (0: skip)")
    ap.add_argument("--sizes", default="16,256,1024", help="buffer sizes in MiB for --shared")
    ap.add_argument("--only-shared", action="store_true", help="run the shared-pages case alone")
    args = ap.parse_args()
    if args.only_shared:
        bench_shared_pages(args.shared, [int(x) for x in args.sizes.split(",")])
        return
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs (shared machine: ratios are interleaved, same run)\n")
    bench_lend(args.lends, args.reps)
    print()
    bench_ring(args.hidden, args.reps)
    print()
    bench_mappings(args.views)
    if args.shared:
        print()
        bench_shared_pages(args.shared, [int(x) for x in args.sizes.split(",")])


if __name__ == "__main__":
    main()
