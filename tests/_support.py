"""Test helpers: an independent hash oracle and a subprocess runner.

Why an oracle: it shares no code with the kernels, so a bug in the one shared
definition (cuda_hooks/hashdef.py) cannot hide by being compiled identically
for both targets.  ``ref_hash`` is pure Python ints (no numpy scalars, hence
no overflow warnings); ``ref_hash_np`` is the same spec vectorised with numpy
arrays (array integer arithmetic wraps silently) for multi-MiB inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # make ``cuda_hooks`` importable without installing
    sys.path.insert(0, str(ROOT))

MASK = (1 << 64) - 1
K_POS = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB
F1 = 0xFF51AFD7ED558CCD
F2 = 0xC4CEB9FE1A85EC53
K_LEN = 0xD6E8FEB86659FD93
SEED = 0x2545F4914F6CDD1D


def ref_mix(word: int, index: int) -> int:
    x = word ^ ((index * K_POS) & MASK)
    x = (x * M1) & MASK
    x ^= x >> 32
    x = (x * M2) & MASK
    return x ^ (x >> 29)


def ref_finalize(total: int, n: int) -> int:
    x = total ^ ((n * K_LEN) & MASK) ^ SEED
    x ^= x >> 33
    x = (x * F1) & MASK
    x ^= x >> 33
    x = (x * F2) & MASK
    return x ^ (x >> 33)


def ref_hash(data: bytes) -> int:
    """The spec, word by word."""
    total = 0
    for i in range((len(data) + 7) // 8):
        word = int.from_bytes(data[8 * i : 8 * i + 8].ljust(8, b"\0"), "little")
        total = (total + ref_mix(word, i)) & MASK
    return ref_finalize(total, len(data))


def ref_hash_np(data: np.ndarray) -> int:
    """The spec vectorised over a uint8 array (for large inputs)."""
    n = data.size
    padded = np.zeros((n + 7) // 8 * 8, dtype=np.uint8)
    padded[:n] = data
    x = padded.view("<u8") ^ (np.arange(padded.size // 8, dtype=np.uint64) * np.uint64(K_POS))
    x = x * np.uint64(M1)
    x ^= x >> np.uint64(32)
    x = x * np.uint64(M2)
    x ^= x >> np.uint64(29)
    return ref_finalize(int(x.sum(dtype=np.uint64)), n)


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repo importable; warnings are errors."""
    full_env = dict(os.environ if env is None else env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), full_env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
