"""The CUDA extras exist and the errors that recommend them name them right."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parent.parent


def _extras() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def test_cuda_extras_pull_numba_cuda_with_the_nvvm_of_their_cuda_major():
    extras = _extras()
    for extra, cu in (("cuda12", "cu12"), ("cuda13", "cu13")):
        (req,) = extras[extra]
        assert req.startswith(f"numba-cuda[{cu}]"), req


def test_the_messages_recommending_an_extra_name_existing_ones():
    extras = set(_extras())
    for source in ("cuda_hooks/gpu.py", "cuda_hooks/bridge.py"):
        named = set(re.findall(r"ownership-sanitizer\[(\w+)\]", (ROOT / source).read_text()))
        named |= set(re.findall(r"or \[(cuda\d+)\]", (ROOT / source).read_text()))
        assert named and named <= extras, (source, named - extras)
