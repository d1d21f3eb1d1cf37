"""Shared fixtures: every test starts with the sanitizer off, no errors, no stray leases."""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _forget_everything() -> None:
    """Sanitizer off, and no error, event or pending retention left over from another test."""
    import sanitizer
    from sanitizer.core import options
    from sanitizer.torch_layer import records, runtime
    from sanitizer.features import triage

    sanitizer.disable()
    runtime.set_options(options.resolve({}))  # options survive disable(): one test's must not leak into the next
    sanitizer.clear_errors()
    triage.reset()
    records.forget_events()


@pytest.fixture(autouse=True)
def _clean_sanitizer():
    _forget_everything()
    yield
    _forget_everything()
    collect_leftovers()


def collect_leftovers() -> None:
    """End the test's leftover leases and buffers (kept in a cycle) before the next test starts: the young
    generations first (a few ms, and where a test's last cycles usually are), the whole heap (~0.15 s over
    torch's) only when something of ours is still reachable after that."""
    if _ours_still_reachable():
        gc.collect(1)
        if _ours_still_reachable():
            gc.collect()


@pytest.fixture
def fresh_triage():
    """Triage's records and remembered holder paths forgotten before and after the test: what one test's
    retentions taught triage must not name the next test's holders."""
    from sanitizer.features import holders, triage

    triage.reset(records_too=True)
    holders.forget_patterns()
    yield
    triage.reset(records_too=True)
    holders.forget_patterns()


def _ours_still_reachable() -> bool:
    """Whether a lease or a staging buffer of the test outlived it (kept in a cycle: a caught error's
    traceback, a closure): then a full collection ends them here, not in the middle of the next test. A
    full collection costs ~0.25 s in this heap; paid after every test it was two thirds of the quick tests'
    time, though most tests leave nothing of ours behind once their frame is gone."""
    from sanitizer.torch_layer.state import state

    return bool(state.ledger.live_count or state.ledger.regions())


def run_python(code: str, env_extra: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repo on the path (for import-time behaviour)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
