"""Per-rank operation under torch.distributed (gloo, two processes on this machine).

Tensor-parallel loaders run one loader per rank. Each rank loads its own shard
through a staging ring; rank 1 has a retaining consumer. Its report must carry
rank 1 of world 2 and the error, rank 0's report must be clean, and neither
rank may hang when the other raises.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from tests.conftest import ROOT  # noqa: E402

WORKER = textwrap.dedent("""
    import datetime, os, sys
    import torch
    import torch.distributed as dist
    import sanitizer  # OWNERSHIP_SANITIZE=1: enabled at import, report=...-{rank}.json at exit

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    full = {f"layers.{i}.mlp.weight": torch.arange(256, dtype=torch.float32).view(16, 16) + i for i in range(8)}
    shard = {k: v.chunk(world, dim=0)[rank].clone() for k, v in full.items()}  # this rank's TP slice
    ring_bytes = 2 * next(iter(shard.values())).nbytes  # a ring of two tensors: real reuse
    params = {}
    for name, t in sanitizer.emulate_borrowed(shard.items(), ring_bytes=ring_bytes, name=f"ring-rank{rank}"):
        params[name] = t if rank == 1 else t.clone()  # rank 1 retains borrowed views: the bug
    try:
        total = torch.tensor([sum(float(v.sum()) for v in params.values())])  # rank 1 raises here
        dist.all_reduce(total)
        print("all_reduce done", float(total))
    except sanitizer.StaleBorrowError:
        dist.destroy_process_group()  # leave cleanly: the peer's collective fails fast instead of hanging
        raise
    except RuntimeError as exc:  # the peer left: report it and exit, do not hang
        print("peer failed:", type(exc).__name__)
        sys.exit(3)
""")


@pytest.mark.slow
def test_each_rank_reports_its_own_errors_and_no_rank_hangs(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    store = tmp_path / "store"
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
        env.update({
            "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
            "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "GLOO_SOCKET_IFNAME": "lo",
            "OWNERSHIP_SANITIZE": "1",
            "OWNERSHIP_SANITIZE_OPTIONS": f"report={tmp_path}/report-{{rank}}.json",
        })
        procs.append(subprocess.Popen([sys.executable, str(worker), str(store)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    outputs = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a rank hung after its peer raised")
        outputs.append((proc.returncode, out, err))

    (rc0, out0, err0), (rc1, out1, err1) = outputs
    assert rc1 != 0 and "StaleBorrowError" in err1, err1
    assert rc0 in (0, 3), err0  # finished: the collective completed or failed fast, no hang
    reports = [json.loads((tmp_path / f"report-{rank}.json").read_text()) for rank in range(2)]
    assert [r["rank"] for r in reports] == [0, 1]
    assert [r["world_size"] for r in reports] == [2, 2]
    assert reports[0]["error_count"] == 0 and reports[0]["errors"] == []
    assert reports[1]["error_count"] >= 1
    error = reports[1]["errors"][0]
    assert error["kind"] == "stale_use" and error["lease"]["buffer"] == "ring-rank1"
    assert error["lease"]["name"].startswith("layers.")
