"""A worker's findings reach the merged report however the worker ends (issue 29, point 1).

``with multiprocessing.Pool(...)`` ends with ``terminate()``: spawn and forkserver pools lost every stale
read their workers saw (a forkserver's worker ends with ``os._exit`` and was enabled after its fork, so no
atexit handler and no exit wrapper ran), fork pools some. Each context, several runs, every finding.
"""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent('''
    import multiprocessing as mp, sys, torch
    import sanitizer
    KEPT = []
    def work(i):
        ring = sanitizer.StagingRing(4096, name=f"w{i}")
        a = ring.put("a", torch.ones(1024))
        KEPT.append(a)
        ring.put("b", torch.zeros(1024))
        float(a.sum())  # a stale read, recorded (ownsan run: triage=1)
        return i
    if __name__ == "__main__":
        with mp.get_context(sys.argv[1]).Pool(2) as pool:
            print(pool.map(work, range(4)))
''')


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_every_stale_read_of_a_terminated_pool_reaches_the_report(tmp_path, method):
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method on this platform")
    script = tmp_path / "pool.py"
    script.write_text(_PROGRAM)
    for run in range(3):
        report = tmp_path / f"r{run}.json"
        out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", str(report), "--", sys.executable,
                              str(script), method], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        rep = json.loads(report.read_text())
        stale = [e for e in rep["errors"] if e["kind"] == "stale_use"]
        assert len(stale) == 4, (run, out.stdout, out.stderr[-2000:])
        assert out.returncode == 1  # findings: the run fails, as ASan's does
