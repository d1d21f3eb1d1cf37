"""Benchmark: cuda_hooks checksum throughput vs torch's int64 sum over the same bytes.

Why a sum as the yardstick: summing int64 words is the cheapest full read of a
buffer torch offers, i.e. roughly memory bandwidth; the hash (a sum of mixed
words) should get close to it (targets: 0.9x on CPU, 0.85x on CUDA).  The CPU
section also prints the physical reference: the best read bandwidth measured
in the same rounds (torch's sum, and a plain numba sum over the same chunks
with numba's threads and with one thread).  The ring-load section prints what
``checksum=1`` costs a loader end to end (target: 1.15x of the sanitizer off).

Every comparison is measured in interleaved rounds (each function once per
round, in turn) so they share the machine's noise; the best and the median of
the rounds are printed, with how busy the machine was.  Each section is its
own function taking the parsed arguments and printing its lines; ``main()``
runs them in order, so another section can be appended.

Usage: ``python bench/checksum.py [--sizes 256,2048] [--repeats 15] [--ring-mib 2048] [--ring-repeats 5]``
(run on an otherwise idle machine; ``--sizes`` and ``--ring-mib`` in MiB)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cuda_hooks  # noqa: E402


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall times of each function per round, alternating them each round to share noise."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def best_of_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each function over interleaved rounds."""
    return {name: min(ts) for name, ts in interleaved(fns, repeats).items()}


def bench_compile(args: argparse.Namespace) -> None:
    """First-use compile time in a fresh process, then disk-cache load time in a second one."""
    with tempfile.TemporaryDirectory(prefix="cuda_hooks_numba_cache_") as cache_dir:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
        runs = []
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, __file__, "--probe-compile"], env=env, capture_output=True, text=True, check=True
            )
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print("first-use kernel time (s): process 1 compiles, process 2 loads numba's disk cache")
    print("  (the first kernel used also pays numba's one-time CPU target start-up, ~0.2 s)")
    for key in sorted(set(runs[0]) | set(runs[1])):
        print(f"  {key:22s} {runs[0].get(key, float('nan')):8.3f} {runs[1].get(key, float('nan')):8.3f}")


def _probe_compile() -> None:
    """Child of bench_compile: use every kernel once, print compile_seconds() as JSON."""
    cuda_hooks.checksum(torch.zeros(64, dtype=torch.uint8))
    cuda_hooks.checksum(torch.zeros(2 << 20, dtype=torch.uint8))  # parallel kernel path
    if torch.cuda.is_available():
        from cuda_hooks import gpu

        t = torch.zeros(4096, dtype=torch.uint8, device="cuda")
        out = torch.zeros(1, dtype=torch.int64, device="cuda")
        flags = torch.zeros(1, dtype=torch.int32, device="cuda")
        cuda_hooks.checksum_into(t, out, 0)
        cuda_hooks.verify_into(t, out, 0, flags)
        gpu.poison_async(gpu.cuda.as_cuda_array(t, sync=False), 1, gpu.stream_for(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
    print(json.dumps(cuda_hooks.compile_seconds()))


class CpuShare:
    """CPU time used by *other* processes (and stolen by the host) over a window.

    The hash costs ~2.2x the ALU work of a sum per word, so when the CPUs are
    oversubscribed it falls further behind than the sum; this makes that visible.
    """

    def __enter__(self) -> "CpuShare":
        self.t0, self.stat0, self.own0 = time.perf_counter(), self._stat(), self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self.t0
        stat1, tick, ncpu = self._stat(), os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        busy = sum(stat1[:3]) + sum(stat1[5:7]) - sum(self.stat0[:3]) - sum(self.stat0[5:7])
        steal = stat1[7] - self.stat0[7]
        self.others = max(0.0, busy / tick - (self._own() - self.own0)) / (wall * ncpu)
        self.steal = steal / tick / (wall * ncpu)

    @staticmethod
    def _stat() -> list[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:9]]

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def __str__(self) -> str:
        return f"other processes used {self.others:.0%} of the CPUs, host steal {self.steal:.0%}"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def _read_kernels() -> tuple[Callable, Callable]:
    """Plain numba sums (parallel over the hash's chunks, and serial): the same reads as the hash, no mix."""
    import numba
    import numpy as np

    @numba.njit(nogil=True)
    def sum_serial(words):
        s = np.uint64(0)
        for i in range(np.uint64(0), np.uint64(words.size)):
            s += words[i]
        return s

    @numba.njit(parallel=True, nogil=True)
    def sum_parallel(words, chunk):
        n = words.size
        nchunks = (n + chunk - 1) // chunk
        parts = np.zeros(nchunks, dtype=np.uint64)
        for c in numba.prange(nchunks):
            s = np.uint64(0)
            for i in range(np.uint64(c * chunk), np.uint64(min((c + 1) * chunk, n))):
                s += words[i]
            parts[c] = s
        return parts.sum()

    return sum_serial, sum_parallel


def bench_cpu_hash(args: argparse.Namespace) -> None:
    """CPU hash vs ``t.view(torch.int64).sum()`` and plain numba sums over one buffer per size, interleaved."""
    import numpy as np
    from cuda_hooks import cpu

    sum_serial, sum_parallel = _read_kernels()
    for mib in args.sizes:
        nbytes = mib << 20
        t = torch.randint(-(2**62), 2**62, (nbytes // 8,), dtype=torch.int64).view(torch.uint8)
        words_t = t.view(torch.int64)
        raw = t.numpy()
        words, tail = cpu._split(raw)
        chunk = cpu._chunk_words(words.size)
        reads = {  # plain reads of the same bytes: the physical reference is the best of them
            "torch int64 sum": lambda: words_t.sum(),
            f"numba sum, {cpu.numba.get_num_threads()} threads": lambda: sum_parallel(words, chunk),
            "numba sum, 1 thread": lambda: sum_serial(words),
        }
        fns = {
            "cuda_hooks.checksum": lambda: cuda_hooks.checksum(t),
            **reads,
            f"hash parallel kernel, {cpu.numba.get_num_threads()} thr": lambda: cpu._hash_parallel(
                words, tail, nbytes, chunk),
            "hash serial kernel, 1 thread": lambda: cpu._hash_serial(words, tail, nbytes),
        }
        for fn in fns.values():  # compile/load and fault the pages in, outside the timing
            fn()
        assert int(sum_serial(words)) == int(sum_parallel(words, chunk)) == int(words_t.sum()) % (1 << 64)
        assert cuda_hooks.checksum(t) == int(cpu._hash_serial(words, tail, nbytes))
        runs0 = cpu.kernel_runs()
        with CpuShare() as share:
            times = interleaved(fns, args.repeats)
        runs = {k: v - runs0[k] for k, v in cpu.kernel_runs().items()}
        ref_name = min(reads, key=lambda name: min(times[name]))
        ref = _gbps(nbytes, min(times[ref_name]))
        print(f"CPU hash of {mib} MiB, {torch.get_num_threads()} torch threads, {args.repeats} interleaved rounds "
              f"({share}; {_load()}):")
        print(f"  {'':30s} {'best GB/s':>10s} {'median GB/s':>12s}")
        for name, ts in times.items():
            print(f"  {name:30s} {_gbps(nbytes, min(ts)):10.2f} {_gbps(nbytes, _median(ts)):12.2f}")
        print(f"  {'read reference (best read)':30s} {ref:10.2f}   ({ref_name})")
        h, s = _gbps(nbytes, min(times["cuda_hooks.checksum"])), _gbps(nbytes, min(times["torch int64 sum"]))
        paired = [ts / th for th, ts in zip(times["cuda_hooks.checksum"], times["torch int64 sum"])]
        medians = _median(times["torch int64 sum"]) / _median(times["cuda_hooks.checksum"])
        print(f"  ratio hash/sum       {h / s:7.3f} best, {medians:.3f} of the medians, "
              f"{_median(paired):.3f} median of per-round ratios   (target >= 0.9)")
        print(f"  ratio hash/read ref  {h / ref:7.3f} best")
        print(f"  cuda_hooks.checksum ran the parallel kernel {runs['parallel']} times, the serial one "
              f"{runs['serial']} times (the faster lately, see cuda_hooks/kernel_choice.py)")
        del t, words_t, raw, words, tail, fns, reads


def bench_cpu_poison(args: argparse.Namespace) -> None:
    """Why CPU poison uses numpy's fill: compare it with torch's fill_ on the same bytes."""
    nbytes = args.mib << 20
    t = torch.empty(nbytes, dtype=torch.uint8)
    fns = {"poison": lambda: cuda_hooks.poison(t, 0xA5), "torch": lambda: t.fill_(0x5A), "numpy": lambda: t.numpy().fill(0x3C)}
    best = best_of_interleaved(fns, max(3, args.repeats // 2))
    print(f"CPU fill {args.mib} MiB: cuda_hooks.poison {_gbps(nbytes, best['poison']):.2f} GB/s, "
          f"numpy fill {_gbps(nbytes, best['numpy']):.2f} GB/s, torch fill_ {_gbps(nbytes, best['torch']):.2f} GB/s")


def bench_cuda_hash(args: argparse.Namespace) -> None:
    """Device hash (checksum_into) vs torch int64 sum on the device, timed with CUDA events."""
    if not torch.cuda.is_available():
        print("CUDA: not available, device section skipped")
        return
    nbytes = args.mib << 20
    t = torch.randint(-(2**62), 2**62, (nbytes // 8,), dtype=torch.int64, device="cuda").view(torch.uint8)
    words = t.view(torch.int64)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")
    cuda_hooks.checksum_into(t, out, 0)
    torch.cuda.synchronize()

    def timed(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / 10
        return run

    runs = {"hash": timed(lambda: cuda_hooks.checksum_into(t, out, 0)), "sum": timed(lambda: words.sum())}
    best = {k: float("inf") for k in runs}
    for _ in range(args.repeats):
        for k, fn in runs.items():
            best[k] = min(best[k], fn())
    assert cuda_hooks.to_unsigned(int(out.item())) == cuda_hooks.checksum(t.cpu()), "CUDA/CPU hash mismatch"
    h, s = _gbps(nbytes, best["hash"]), _gbps(nbytes, best["sum"])
    print(f"CUDA {torch.cuda.get_device_name()} {args.mib} MiB, best of {args.repeats} x 10 launches:")
    print(f"  checksum_into        {h:7.1f} GB/s")
    print(f"  torch int64 sum      {s:7.1f} GB/s")
    print(f"  ratio hash/sum       {h / s:7.3f}   (target >= 0.85)")


def _ring_load(data: bytes, tensor_bytes: int, ring_bytes: int, options: dict | None) -> tuple[float, float, list[float]]:
    """Stream ``data`` through a StagingRing from a file object, consuming each tensor with a copy.

    This is the loop of a fast loader plus a correct consumer: ``readinto`` the ring, lend, copy
    out (into fresh memory, as a loader's parameters are), move on. ``options`` None runs it with the
    sanitizer off; a dict runs it enabled. Returns (wall seconds, CPU seconds of this process, the wall
    seconds of each tensor's put + copy).
    """
    import io

    import sanitizer

    n = len(data) // tensor_bytes
    ring = sanitizer.StagingRing(ring_bytes, name="bench-ring")
    src = io.BytesIO(data)
    dst = torch.empty(n, tensor_bytes // 2, dtype=torch.bfloat16)
    ctx = sanitizer.sanitize(**options) if options is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        each = [0.0] * n
        c0, t0 = time.process_time(), time.perf_counter()
        t = t0
        for i in range(n):
            w = ring.put(f"layers.{i}.weight", src, shape=(tensor_bytes // 2,), dtype=torch.bfloat16)
            dst[i].copy_(w)
            del w
            each[i], t = time.perf_counter() - t, time.perf_counter()
        return time.perf_counter() - t0, time.process_time() - c0, each
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
        ring.close()


RING_CONFIGS: dict[str, dict | None] = {
    "off": None,
    "generations only": {},
    "checksum=1": {"checksum": 1},
    "checksum=1:poison=1": {"checksum": 1, "poison": 1},
}
RING_TARGETS = {"checksum=1": 1.15, "checksum=1:poison=1": 1.3}


def bench_debug_load(args: argparse.Namespace) -> None:
    """Whole cost of a debug-mode ring load: off vs generation tracking vs checksum=1 (and with poison=1)."""
    import numpy as np

    total = args.ring_mib << 20
    tensor_bytes = 2 << 20
    data = np.random.default_rng(0).bytes(total)
    saved_threads = torch.get_num_threads()
    if args.ring_torch_threads > 0:
        torch.set_num_threads(args.ring_torch_threads)
    try:
        _ring_rounds(args, data, tensor_bytes)
    finally:
        torch.set_num_threads(saved_threads)


def _ring_rounds(args: argparse.Namespace, data: bytes, tensor_bytes: int) -> None:
    """The timed rounds of :func:`bench_debug_load` and its table."""
    total = len(data)
    warm = data[: 64 << 20]
    threads = torch.get_num_threads()
    for opts in RING_CONFIGS.values():  # warm up on 64 MiB: compile/load the kernels, start the pools
        _ring_load(warm, tensor_bytes, 16 << 20, opts)
    torch.set_num_threads(threads)  # starting numba's pool reset it before cuda_hooks kept it (older checkouts)
    load = lambda o: _ring_load(data, tensor_bytes, 16 << 20, o)  # noqa: E731
    wall: dict[str, list[float]] = {name: [] for name in RING_CONFIGS}
    cpu_s: dict[str, list[float]] = {name: [] for name in RING_CONFIGS}
    floor: dict[str, list[float]] = {}  # per tensor: its best put + copy over the rounds
    with CpuShare() as share:
        for _ in range(args.ring_repeats):
            for name, opts in RING_CONFIGS.items():
                w, c, each = load(opts)
                wall[name].append(w)
                cpu_s[name].append(c)
                floor[name] = [min(a, b) for a, b in zip(floor[name], each)] if name in floor else each
    print(f"ring load of {total >> 20} MiB in {tensor_bytes >> 20} MiB tensors through a 16 MiB ring "
          f"(readinto + copy out), {torch.get_num_threads()} torch threads, {args.ring_repeats} interleaved rounds "
          f"({share}; {_load()}):")
    print(f"  {'':22s} {'best ms':>8s} {'median ms':>9s} {'GB/s':>6s} {'ratio':>6s} {'per-round':>9s} "
          f"{'floor ms':>9s} {'ratio':>6s} {'CPU s':>6s} {'ratio':>6s}")
    off, off_cpu, off_floor = min(wall["off"]), min(cpu_s["off"]), sum(floor["off"])
    for name in RING_CONFIGS:
        paired = _median([a / b for a, b in zip(wall[name], wall["off"])])
        target = f"  (target <= {RING_TARGETS[name]}x)" if name in RING_TARGETS else ""
        print(f"  {name:<22s} {min(wall[name]) * 1e3:8.1f} {_median(wall[name]) * 1e3:9.1f} "
              f"{_gbps(total, min(wall[name])):6.2f} {min(wall[name]) / off:5.2f}x {paired:8.2f}x "
              f"{sum(floor[name]) * 1e3:9.1f} {sum(floor[name]) / off_floor:5.2f}x "
              f"{min(cpu_s[name]):6.2f} {min(cpu_s[name]) / off_cpu:5.2f}x{target}")
    print("  (best/median: the whole load's wall time, ratio to the best off; per-round: median of each round's "
          "ratio to that round's off; floor: the sum over tensors of each tensor's best time in the rounds, "
          "i.e. the load without the other processes' preemptions; CPU: this process's CPU seconds, best; "
          "ASan's published slowdown is ~1.7-2x)")


SECTIONS: list[Callable[[argparse.Namespace], None]] = [
    bench_compile, bench_cpu_hash, bench_cpu_poison, bench_cuda_hash, bench_debug_load]


def _mib_list(text: str) -> list[int]:
    try:
        sizes = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated MiB counts, got {text!r}") from None
    if not sizes or min(sizes) <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive MiB counts, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_mib_list, default=[256, 2048],
                        help="CPU hash buffer sizes in MiB, comma-separated (default 256,2048)")
    parser.add_argument("--mib", type=int, default=256, help="buffer size of the fill and CUDA sections (default 256)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds of the kernel sections (default 15)")
    parser.add_argument("--ring-mib", type=int, default=2048, help="bytes streamed by the ring load, MiB (default 2048)")
    parser.add_argument("--ring-repeats", type=int, default=5, help="interleaved rounds of the ring load (default 5)")
    parser.add_argument("--ring-torch-threads", type=int, default=0,
                        help="torch threads during the ring load (default 0: torch's own choice); 1 keeps the "
                             "consumer's copy out of torch's fork-join, which stalls on a shared machine")
    parser.add_argument("--only", default="", help="comma-separated section names to run (default: all), e.g. cpu_hash,debug_load")
    parser.add_argument("--probe-compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe_compile:
        _probe_compile()
        return
    chosen = {v.strip() for v in args.only.split(",") if v.strip()}
    known = {section.__name__.removeprefix("bench_") for section in SECTIONS}
    if chosen - known:
        parser.error(f"unknown section(s) {sorted(chosen - known)}; known: {sorted(known)}")
    for section in SECTIONS:
        if not chosen or section.__name__.removeprefix("bench_") in chosen:
            section(args)


if __name__ == "__main__":
    main()
