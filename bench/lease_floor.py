"""The Python heap per lease of a ledger kept as rows: the floor issue 33's 500 B target sits on.

Not the sanitizer: a model of the leanest pure-Python lease record with today's lent view. Each lend
builds the view as ``StagingBuffer.lend`` does (a numpy array over the buffer, ``from_numpy``: a storage
of its own), then files the lease as rows would: its ints in ``array('q')`` columns (no int objects), its
objects in lists, a one-slot weak reference on the storage (the death callback, with its row), the row in
a pending list; no per-lease dict entry, and the shape shared. Measured like ``bench/scale.py --sections
heap`` (tracemalloc, the leases held, sanitizer objects only where the model has them).

    python bench/lease_floor.py [--leases 100000]
"""
from __future__ import annotations

import argparse
import array
import gc
import sys
import tracemalloc
import weakref

import numpy as np
import torch


class _Token(weakref.ref):
    __slots__ = ("row",)


def _died(ref: _Token) -> None:
    pass


def floor_per_lease(n: int, slot: int = 256) -> float:
    host = np.zeros(n * slot, dtype=np.uint8)
    ints = [array.array("q") for _ in range(7)]  # lease id, start, end, generation, region, storage address, view id
    objects: list = [[] for _ in range(6)]  # name, dtype, shape, site, stale_by, checksum
    flags = bytearray()  # alive, rescued
    tokens: list = []
    pending: list = []
    shape = (slot // 4,)

    def lend(i: int) -> torch.Tensor:
        view = torch.from_numpy(np.ndarray(shape, np.float32, host, i * slot))
        storage = view.untyped_storage()
        row = len(flags)
        for column, value in zip(ints, (row + 1, i * slot, (i + 1) * slot, 1, 1, storage._cdata, id(view))):
            column.append(value)
        for column, value in zip(objects, (None, "float32", shape, (), None, None)):
            column.append(value)
        flags.append(1)
        token = _Token(storage, _died)
        token.row = row
        tokens.append(token)
        pending.append(row)
        return view

    warm = [lend(i) for i in range(64)]  # first-use costs are not a lease's
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [lend(i) for i in range(64, n)]
    per = (tracemalloc.get_traced_memory()[0] - before) / len(kept)
    tracemalloc.stop()
    del warm, kept
    return per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leases", type=int, default=100_000)
    args = ap.parse_args(argv)
    if args.leases < 65:
        ap.error(f"--leases must be at least 65, got {args.leases}")
    per = floor_per_lease(args.leases)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")
    print(f"rows model, {args.leases:,} leases held: {per:.0f} B per lease (the view itself included; "
          f"compare bench/scale.py --sections heap; issue 33's target: 500 B)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
