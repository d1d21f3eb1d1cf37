"""Benchmark: the CUDA checksum kernel against the device's own memory bandwidth, side by side in one run.

Why these references: the hash reads each byte once, so its ceiling is the rate
at which the device reads memory. A device-to-device copy (``dst.copy_(src)``)
measures that rate with nothing but loads and stores; its *traffic* (bytes read
plus bytes written per second) is what the memory system sustains, and
``torch``'s int64 sum is the cheapest full read torch offers. The hash is timed
with CUDA events over back-to-back launches, so its host overhead (Python, numba's
launch) is hidden behind the previous launch's work; that host cost is measured
apart, on small tensors where it dominates.

Prints every figure (GB/s, microseconds), the ratios, and one ``VERDICT`` line per
target; exits 1 when a target is missed, 0 otherwise (2 without a CUDA device).

Usage: ``python bench/device_hash.py [--mib 1024] [--repeats 5]``
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cuda_hooks  # noqa: E402

#: (name, figure, minimum): what the verdict checks. The hash is judged against torch's int64 sum of the
#: same bytes (one full read, as the hash): copy traffic is only a ceiling, and a kernel at half of
#: torch.sum passed a verdict against it.
TARGETS = [
    ("hash read rate / torch int64 sum of the same bytes", "hash_vs_sum", 0.9),
    ("misaligned hash / aligned hash", "misaligned_vs_aligned", 0.8),
]
#: Host synchronisations a CUDA lend with checksum=1 may cost once its slot table exists: none.
MAX_SYNCS_PER_LEND = 0.0


def _device_seconds(fn: Callable[[], object], launches: int, repeats: int) -> float:
    """Best seconds per call of ``fn`` over ``repeats`` rounds of ``launches`` back-to-back calls (CUDA events)."""
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / launches)
    return best


def _host_seconds(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """Best host seconds per call of ``fn`` (the device keeps up: small tensors)."""
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize()
    return best


def measure(mib: int, repeats: int) -> Dict[str, float]:
    n = mib << 20
    src = torch.randint(-(2**62), 2**62, (n // 8 + 1,), dtype=torch.int64, device="cuda").view(torch.uint8)
    aligned, misaligned = src[:n], src[3:n + 3]
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    words = aligned.view(torch.int64)
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    cuda_hooks.warm()
    cuda_hooks.checksum_into(aligned, out, 0)  # first launch of each configuration outside the timing
    cuda_hooks.checksum_into(misaligned, out, 1)
    torch.cuda.synchronize()
    assert cuda_hooks.to_unsigned(int(out[0])) == cuda_hooks.checksum(aligned.cpu()), "CUDA/CPU hash mismatch"
    assert cuda_hooks.to_unsigned(int(out[1])) == cuda_hooks.checksum(misaligned.cpu()), "CUDA/CPU hash mismatch"
    f: Dict[str, float] = {}
    f["copy_s"] = _device_seconds(lambda: dst.copy_(aligned), 10, repeats)
    f["sum_s"] = _device_seconds(lambda: words.sum(), 10, repeats)
    f["hash_s"] = _device_seconds(lambda: cuda_hooks.checksum_into(aligned, out, 0), 10, repeats)
    f["misaligned_s"] = _device_seconds(lambda: cuda_hooks.checksum_into(misaligned, out, 1), 10, repeats)
    small = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    flags = torch.zeros(2, dtype=torch.int32, device="cuda")
    cuda_hooks.checksum_into(small, out, 0)
    f["host_checksum_into_s"] = _host_seconds(lambda: cuda_hooks.checksum_into(small, out, 0), 2000, repeats)
    f["host_verify_into_s"] = _host_seconds(lambda: cuda_hooks.verify_into(small, out, 0, flags), 2000, repeats)
    f["small_device_s"] = _device_seconds(lambda: cuda_hooks.checksum_into(small, out, 0), 200, repeats)
    f["lend_checksum_s"], f["lend_plain_s"] = _lend_costs(repeats)
    f["syncs_per_lend"] = _syncs_per_lend(256)
    gb = n / 1e9
    f["copy_traffic_gbps"] = 2 * gb / f["copy_s"]
    f["sum_gbps"] = gb / f["sum_s"]
    f["hash_gbps"] = gb / f["hash_s"]
    f["misaligned_gbps"] = gb / f["misaligned_s"]
    f["hash_vs_copy"] = f["hash_gbps"] / f["copy_traffic_gbps"]
    f["hash_vs_sum"] = f["hash_gbps"] / f["sum_gbps"]
    f["misaligned_vs_aligned"] = f["misaligned_gbps"] / f["hash_gbps"]
    return f


def _lend_costs(repeats: int) -> tuple:
    """Host seconds per StagingBuffer.lend of a 4 KiB CUDA lease, with checksum=1 and with the sanitizer off."""
    import sanitizer

    buf = sanitizer.StagingBuffer(1 << 20, device="cuda", name="bench")
    costs = []
    for options in ({"checksum": 1}, None):
        ctx = sanitizer.sanitize(**options) if options is not None else None
        if ctx is not None:
            ctx.__enter__()
        try:
            kept: List[torch.Tensor] = []

            def lend() -> None:
                kept.append(buf.lend(0, (1024,), torch.float32, name="w"))
                if len(kept) > 64:
                    kept.clear()

            costs.append(_host_seconds(lend, 1000, repeats))
        finally:
            if ctx is not None:
                sanitizer.synchronize()
                ctx.__exit__(None, None, None)
    buf.close()
    return costs[0], costs[1]


def _syncs_per_lend(lends: int) -> float:
    """Host synchronisations per CUDA lend with checksum=1, counted by torch's sync debug mode (a warning
    per synchronising call), after a first lend made the slot table (a table's creation waits once)."""
    import warnings

    import sanitizer

    buf = sanitizer.StagingBuffer(1 << 20, device="cuda", name="syncs")
    try:
        with sanitizer.sanitize(checksum=1):
            kept = [buf.lend(0, (1024,), torch.float32, name="first")]
            torch.cuda.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            with warnings.catch_warnings(record=True) as caught:  # (a benchmark's own process)
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for i in range(lends):
                        kept.append(buf.lend(4096 * (i % 16), (1024,), torch.float32, name=f"w{i}"))
                        if len(kept) > 32:
                            kept.clear()
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            kept.clear()
            sanitizer.synchronize()
    finally:
        buf.close()
    syncs = [c for c in caught if "synchroniz" in str(c.message).lower()]
    return len(syncs) / lends


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes hashed per launch, in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, best kept (default 5)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("device_hash: no CUDA device")
        return 2
    f = measure(args.mib, args.repeats)
    info = cuda_hooks.kernel_info()
    print(f"CUDA {torch.cuda.get_device_name()}, {args.mib} MiB per launch, best of {args.repeats} x 10 launches "
          f"(numba CUDA: {info['implementation']}, NVVM {info.get('nvvm', '?')}):")
    print(f"  device-to-device copy   {f['copy_traffic_gbps']:8.1f} GB/s of traffic (read + write), "
          f"{f['copy_s'] * 1e3:.3f} ms")
    print(f"  torch int64 sum         {f['sum_gbps']:8.1f} GB/s read, {f['sum_s'] * 1e3:.3f} ms")
    print(f"  checksum_into, aligned  {f['hash_gbps']:8.1f} GB/s read, {f['hash_s'] * 1e3:.3f} ms")
    print(f"  checksum_into, offset 3 {f['misaligned_gbps']:8.1f} GB/s read, {f['misaligned_s'] * 1e3:.3f} ms")
    print(f"  ratios: hash/copy-traffic {f['hash_vs_copy']:.3f}, hash/sum {f['hash_vs_sum']:.3f}, "
          f"misaligned/aligned {f['misaligned_vs_aligned']:.3f}")
    print(f"  host cost per call on 4 KiB: checksum_into {f['host_checksum_into_s'] * 1e6:.1f} us, "
          f"verify_into {f['host_verify_into_s'] * 1e6:.1f} us (device time {f['small_device_s'] * 1e6:.1f} us); "
          f"a 4 KiB CUDA lend {f['lend_checksum_s'] * 1e6:.1f} us with checksum=1, "
          f"{f['lend_plain_s'] * 1e6:.1f} us off")
    print(f"  host synchronisations per CUDA lend with checksum=1 (torch's sync debug mode, {256} lends): "
          f"{f['syncs_per_lend']:.3f}")
    print(f"  kernels: registers {info.get('registers')}, resident blocks {info.get('resident_blocks')}, "
          f"first use (s) {({k: round(v, 3) for k, v in info.get('compile_seconds', {}).items()})}")
    missed = 0
    for label, key, minimum in TARGETS:
        ok = f[key] >= minimum
        missed += not ok
        print(f"VERDICT {key} {f[key]:.3f} {'>=' if ok else '<'} {minimum} ({label}): {'PASS' if ok else 'FAIL'}")
    ok = f["syncs_per_lend"] <= MAX_SYNCS_PER_LEND
    missed += not ok
    print(f"VERDICT syncs_per_lend {f['syncs_per_lend']:.3f} {'<=' if ok else '>'} {MAX_SYNCS_PER_LEND} "
          f"(host synchronisations per CUDA lend, checksum=1): {'PASS' if ok else 'FAIL'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
