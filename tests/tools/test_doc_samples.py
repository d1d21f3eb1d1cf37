"""The sample reports in docs/triage.md and docs/fuzzing.md are what real runs print (docs/samples.py)."""
from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _samples():
    spec = importlib.util.spec_from_file_location("doc_samples", os.path.join(ROOT, "docs", "samples.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", [pytest.param("several_holders", marks=pytest.mark.slow),
                                  pytest.param("deferred_loader", marks=pytest.mark.slow),
                                  "readme_error", "concepts_error"])  # (the last two: one small run each, quick)
def test_the_docs_sample_is_what_a_real_run_prints(name):
    if name == "several_holders":
        pytest.importorskip("safetensors", reason="the sample loads through safetensors (pip install safetensors)")
    samples = _samples()
    page_name, make = samples.SAMPLES[name]
    with open(os.path.join(ROOT, "docs", page_name), encoding="utf-8") as fh:
        shown = samples.block(fh.read(), name)
    assert shown == make(), f"docs/{page_name} is stale: run python docs/samples.py {name}"
