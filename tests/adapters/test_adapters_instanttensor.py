"""The InstantTensor adapter against a CPU fake of each version's API surface (InstantTensor is CUDA only).

The fakes reproduce, from each version's ``instanttensor/_impl.py``, what a consumer sees and what the
adapter relies on: the ``safe_open`` signature, ``tensors()`` (callable once) yielding views of a ring
that two tensors later is overwritten, ``__exit__`` freeing the ring, and per version:

* 0.1.5-0.1.8: no ``copy`` parameter (always views); ``get_tensor(name)`` in ``keys()`` order, drawn
  from an internal ``self.tensors()`` generator;
* 0.1.9-0.2.x: ``copy=True`` by default (clones), ``copy=False`` views except unaligned tensors (cloned,
  with a warning), no ``get_tensor``; ``tensors()`` refuses after exit.

Each fake is installed as a package named ``instanttensor`` with its own dist-info, so the adapter
finds it by import and reads its version. A real InstantTensor on a GPU: ``bench/instanttensor_check.sh``.
"""
from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch

from tests.conftest import run_python

safetensors_torch = pytest.importorskip("safetensors.torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_COMMON = '''
import warnings
import torch
from safetensors import safe_open as _st_open


class _Ring:
    """The device ring: room for two tensors (InstantTensor sizes it so that two neighbours do not overlap)."""

    def __init__(self, sizes):
        self.slot = max(sizes) + 64
        self.bytes = torch.zeros(2 * self.slot + 1, dtype=torch.uint8)
        self.next = 0

    def put(self, raw, unaligned):
        start = self.next * self.slot + (1 if unaligned else 0)
        self.next = 1 - self.next
        self.bytes[start:start + raw.numel()].copy_(raw)
        return self.bytes[start:start + raw.numel()]


class _Base:
    def _read(self, filename):
        files = [filename] if isinstance(filename, str) else list(filename)
        self._tensors = []
        for path in files:
            with _st_open(path, framework="pt") as f:
                for k in f.offset_keys():
                    self._tensors.append((k, f.get_tensor(k)))
        self.ring = _Ring([t.numel() * t.element_size() for _, t in self._tensors])
        self.iterated = False

    def __enter__(self):
        return self

    def keys(self):
        return [k for k, _ in self._tensors]

    def _views(self, copy):
        if self.iterated:
            raise RuntimeError("tensors() can only be called once")
        self.iterated = True
        for name, value in self._tensors:
            raw = value.reshape(-1).view(torch.uint8)
            unaligned = name.endswith(".unaligned")
            view = self.ring.put(raw, unaligned)
            if copy or unaligned:
                view = view.clone()
            yield name, view.view(value.dtype).view(value.shape)
'''

FAKES = {
    "0.1.5": _COMMON + '''

class safe_open(_Base):
    def __init__(self, filename, framework, device, process_group=None, buffer_size=None, chunk_size=None,
                 concurrency=None, load_now=True):
        self._read(filename)
        self.tmp_generator = None

    def __exit__(self, *exc):
        self.ring.bytes.fill_(0)  # _C.close: the ring is freed (and its memory reused)

    def tensors(self):
        return self._views(copy=False)

    def get_tensor(self, name):
        if self.tmp_generator is None:
            self.tmp_generator = self.tensors()
        expect_name, tensor = next(self.tmp_generator)
        if name != expect_name:
            raise ValueError("get_tensor() should be called in the order of tensor names returned by keys()")
        return tensor
''',
    "0.2.2": _COMMON + '''

class safe_open(_Base):
    def __init__(self, filename, framework, device, process_group=None, *, buffer_size=None, chunk_size=None,
                 concurrency=None, io_depth=None, max_free_mem_usage=None, load_now=True, copy=True, backend=None,
                 tensor_filter=None, tensor_name_match_mode="glob"):
        self._read(filename)
        self.copy = copy
        self._invalidated = False

    def __exit__(self, *exc):
        self._invalidated = True
        self.ring.bytes.fill_(0)

    def tensors(self):
        if self._invalidated:
            raise RuntimeError("tensors() called after safe_open context exited")
        return self._views(copy=self.copy)
''',
}

SCENARIOS = '''
import json, sys, torch, sanitizer
from sanitizer import adapters
from safetensors.torch import load_file
sanitizer.enable(triage=1)
adapters.install_import_hooks()
import instanttensor
from sanitizer.features import triage
files = sys.argv[1:]
oracle = {}
for p in files:
    oracle.update(load_file(p))
KEPT = {}
out = {"version": adapters.versions().get("InstantTensor")}

def scenario(tag, run):
    before = len(sanitizer.errors())
    KEPT.clear()
    run()
    kept_ok = all(torch.equal(v, oracle[k]) for k, v in KEPT.items()) if KEPT else None
    rep = sanitizer.report(final=True)
    names = set(KEPT)
    out[tag] = {
        "stale": sorted({e["lease"]["name"] for e in rep["errors"][before:] if e["kind"] == "stale_use"}),
        "held": sorted({e["lease"]["name"] for e in rep["events"] if e.get("kind") == "retention"
                        and e["lease"]["name"] in names and "KEPT" in ((e.get("holder") or {}).get("path") or "")}),
        "kept_bit_exact": kept_ok}
    sanitizer.clear_errors(); triage.reset()
    from sanitizer.torch_layer import records
    records.forget_events()
    KEPT.clear()

def retain(**kw):
    def run():
        with instanttensor.safe_open(files, framework="pt", device=0, **kw) as f:
            for name, t in f.tensors():
                KEPT[name] = t
        for t in KEPT.values():
            t.float().sum()
    return run

def copy_each(**kw):
    def run():
        params = {k: torch.empty_like(v) for k, v in oracle.items()}
        with instanttensor.safe_open(files, framework="pt", device=0, **kw) as f:
            for name, t in f.tensors():
                params[name].copy_(t)
        out["copy_bit_exact"] = all(torch.equal(params[k], oracle[k]) for k in oracle)
    return run

def get_tensor_retain():
    with instanttensor.safe_open(files, framework="pt", device=0) as f:
        for name in f.keys():
            KEPT[name] = f.get_tensor(name)
    for t in KEPT.values():
        t.float().sum()

if hasattr(instanttensor.safe_open, "get_tensor"):
    scenario("default_retain", retain())
    scenario("default_copy", copy_each())
    scenario("get_tensor_retain", get_tensor_retain)
else:
    scenario("default_retain", retain())  # copy=True: clones
    scenario("borrowed_retain", retain(copy=False))
    scenario("borrowed_copy", copy_each(copy=False))
print(json.dumps(out))
'''


def _install(tmp_path, version: str):
    pkg = tmp_path / "instanttensor"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._impl import safe_open\n")
    (pkg / "_impl.py").write_text(FAKES[version])
    dist = tmp_path / f"instanttensor-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: instanttensor\nVersion: {version}\n")


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(3)
    paths = []
    for f in range(2):
        tensors = {f"model.layers.{f}.{i}.weight": torch.randn(16, 8, generator=g) for i in range(3)}
        if f == 1:
            tensors["model.norm.unaligned"] = torch.randn(8, generator=g)  # cloned even with copy=False
        path = str(tmp_path / f"model-{f}.safetensors")
        safetensors_torch.save_file(tensors, path)
        paths.append(path)
    names = {n for p in paths for n in safetensors_torch.load_file(p)}
    return paths, names


def _run(tmp_path, version, paths):
    site = tmp_path / f"site-{version}"
    site.mkdir()
    _install(site, version)
    proc = run_python(SCENARIOS.replace("sys.argv[1:]", repr(paths)),
                      {"PYTHONPATH": str(site) + os.pathsep + ROOT, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
def test_instanttensor_0_1_x_always_lends_ring_views(tmp_path, checkpoint):
    """0.1.5-0.1.8 have no copy parameter: the old adapter (copy is False) treated them as owning."""
    paths, names = checkpoint
    out = _run(tmp_path, "0.1.5", paths)
    assert out["version"] == "0.1.5"
    assert out["default_retain"]["stale"] == sorted(names) and out["default_retain"]["held"] == sorted(names)
    assert out["default_copy"]["stale"] == [] and out["copy_bit_exact"] is True
    assert out["get_tensor_retain"]["stale"] == sorted(names)  # get_tensor draws from self.tensors()


@pytest.mark.slow
def test_instanttensor_0_2_x_lends_only_with_copy_false(tmp_path, checkpoint):
    paths, names = checkpoint
    out = _run(tmp_path, "0.2.2", paths)
    assert out["version"] == "0.2.2"
    owned = out["default_retain"]
    assert owned["stale"] == [] and owned["held"] == [] and owned["kept_bit_exact"] is True  # copy=True: clones
    # copy=False: every tensor is held to the contract, the unaligned clone included (a consumer cannot tell)
    assert out["borrowed_retain"]["stale"] == sorted(names) and out["borrowed_retain"]["held"] == sorted(names)
    assert out["borrowed_copy"]["stale"] == [] and out["copy_bit_exact"] is True


def test_the_fakes_cover_every_row_of_the_contract_table():
    from sanitizer.adapters import instanttensor_adapter

    rows = [row.versions for row in instanttensor_adapter.CONTRACTS.rows]
    assert rows == ["0.1.5-0.1.8", "0.1.9-0.2.x"]
    assert all(instanttensor_adapter.CONTRACTS.knows(v) for v in FAKES)
