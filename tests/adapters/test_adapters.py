"""Named adapters against the real loaders on CPU (each skips cleanly when its package is missing).

A stale read is only ever made under the sanitizer with halt_on_error=1, which
raises before the op touches memory: these tests never read bytes a loader freed.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import textwrap

import pytest
import torch

import sanitizer
from sanitizer import StaleBorrowError, adapters
from tests.conftest import run_python

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture
def ckpt_files(tmp_path):
    """Two files, mixed dtypes; the oracle is safetensors.torch.load_file."""
    g = torch.Generator().manual_seed(5)
    a = {f"layers.{i}.{p}": torch.randn(32, 16, generator=g).to(dt)
         for i in range(3) for p, dt in (("q", torch.bfloat16), ("k", torch.float32))}
    b = {"lm_head.weight": torch.randint(-100, 100, (64,), dtype=torch.int8, generator=g),
         "norm.weight": torch.randn(16, generator=g).half()}
    paths = [str(tmp_path / "model-00001.safetensors"), str(tmp_path / "model-00002.safetensors")]
    safetensors_torch.save_file(a, paths[0])
    safetensors_torch.save_file(b, paths[1])
    oracle = {}
    for p in paths:
        oracle.update(safetensors_torch.load_file(p))
    return paths, oracle


@pytest.fixture
def hooks():
    sanitizer.enable()
    adapters.install_import_hooks()
    yield adapters
    adapters.uninstall_import_hooks()


def _copy_into_params(iterator, oracle):
    """The correct consumer: copy each tensor into preallocated memory before advancing."""
    params = {k: torch.empty_like(v) for k, v in oracle.items()}
    for name, t in iterator:
        params[name].copy_(t)
    return params


def _retain(iterator):
    """The buggy consumer: keep every yielded tensor (the vLLM deferral bug)."""
    return dict(iterator)


def _bit_exact(got, oracle):
    return set(got) == set(oracle) and all(torch.equal(got[k], oracle[k]) for k in oracle)


# -- fastsafetensors ---------------------------------------------------------------
def _fst_loader(paths, borrowed=True):
    fst = pytest.importorskip("fastsafetensors")
    return fst.ParallelLoader(None, paths, device="cpu", nogds=True, borrowed_tensors=borrowed,
                              accumulate_resident=not borrowed, use_tqdm_on_load=False, set_numa=False)


@pytest.mark.slow
def test_fastsafetensors_retaining_consumer_is_caught(ckpt_files, hooks):
    paths, oracle = ckpt_files
    loader = _fst_loader(paths)
    kept = _retain(loader.iterate_weights())
    loader.close()
    assert set(kept) == set(oracle)
    for name, t in kept.items():  # every buffer was freed: each read must raise before touching memory
        with pytest.raises(StaleBorrowError) as err:
            t.float().sum()
        assert err.value.lease.name == name and "fastsafetensors" in err.value.lease.region_name


def test_fastsafetensors_correct_consumer_passes(ckpt_files, hooks):
    paths, oracle = ckpt_files
    loader = _fst_loader(paths)
    it = loader.iterate_weights()
    assert isinstance(it, sanitizer.torch_layer.iterators.BorrowedIterator)
    got = _copy_into_params(it, oracle)
    loader.close()
    assert _bit_exact(got, oracle) and sanitizer.errors() == []


def test_fastsafetensors_owning_mode_is_left_alone(ckpt_files, hooks):
    paths, oracle = ckpt_files
    loader = _fst_loader(paths, borrowed=False)
    it = loader.iterate_weights()
    assert not isinstance(it, sanitizer.torch_layer.iterators.BorrowedIterator)
    kept = dict(it)  # clones: retaining is correct here
    loader.close()
    assert _bit_exact(kept, oracle) and sanitizer.errors() == []


def test_fastsafetensors_early_exit_then_close(ckpt_files, hooks):
    paths, oracle = ckpt_files
    loader = _fst_loader(paths)
    it = loader.iterate_weights()
    name, first = next(it)
    assert torch.equal(first, oracle[name])
    it.close()  # leases end with every check while the buffer is still there, then the loader frees it
    loader.close()
    with pytest.raises(StaleBorrowError):
        first.sum()


# -- runai-model-streamer ------------------------------------------------------------
@pytest.fixture
def runai(monkeypatch):
    mod = pytest.importorskip("runai_model_streamer")
    monkeypatch.setenv("RUNAI_STREAMER_MEMORY_LIMIT", str(4096))  # a pool of a few KB: real slot reuse
    monkeypatch.setenv("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
    return mod


@pytest.mark.slow
def test_runai_retaining_consumer_is_caught(ckpt_files, hooks, runai):
    paths, oracle = ckpt_files
    with runai.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu", owned=False)
        kept = _retain(streamer.get_tensors())
        stale = [name for name, t in kept.items() if sanitizer.lease_of(t).stale]
        assert sorted(stale) == sorted(oracle)  # the pool still exists here, but every lease has ended
        with pytest.raises(StaleBorrowError) as err:
            kept[stale[0]].sum()
        assert "runai" in err.value.lease.region_name


def test_runai_correct_consumer_passes(ckpt_files, hooks, runai):
    paths, oracle = ckpt_files
    with runai.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu", owned=False)
        got = _copy_into_params(streamer.get_tensors(), oracle)
    assert _bit_exact(got, oracle) and sanitizer.errors() == []


def test_runai_owned_mode_is_left_alone_and_exit_ends_open_leases(ckpt_files, hooks, runai):
    paths, oracle = ckpt_files
    with runai.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu")  # owned=True by default
        assert _bit_exact(dict(streamer.get_tensors()), oracle)
    with runai.SafetensorsStreamer() as streamer:
        streamer.stream_files(paths, device="cpu", owned=False)
        it = streamer.get_tensors()
        name, first = next(it)
        assert torch.equal(first, oracle[name])
    with pytest.raises(StaleBorrowError):  # the streamer exited: the pool is gone
        first.sum()
    assert sanitizer.errors()[-1]["kind"] == "stale_use"


# -- safetensors (emulated) ------------------------------------------------------------
@pytest.mark.slow
def test_safetensors_iterate_emulates_borrowing(ckpt_files):
    from sanitizer.adapters import safetensors_adapter

    paths, oracle = ckpt_files
    with sanitizer.sanitize():
        got = _copy_into_params(safetensors_adapter.iterate(paths), oracle)
        assert _bit_exact(got, oracle)
        kept = _retain(safetensors_adapter.iterate(paths))
        with pytest.raises(StaleBorrowError):
            kept["layers.0.q"].sum()
    assert safetensors_adapter.largest_tensor_bytes(paths) == 32 * 16 * 4


@pytest.mark.slow
def test_safetensors_ring_option_patches_safe_open_but_not_load_file(ckpt_files):
    paths, oracle = ckpt_files
    sanitizer.enable(safetensors_ring=1 << 12, safetensors_strict=1)  # the borrowed contract (tests/adapters/test_loader_safetensors.py: both)
    try:
        assert "safetensors" in adapters.install_import_hooks()
        from safetensors import safe_open

        with safe_open(paths[0], framework="pt") as f:
            views = {k: f.get_tensor(k) for k in f.keys()}
            assert all(sanitizer.is_borrowed(v) for v in views.values())
        with pytest.raises(StaleBorrowError):
            views["layers.0.q"].sum()
        owned = safetensors_torch.load_file(paths[0])
        assert not any(sanitizer.is_borrowed(v) for v in owned.values())
        assert all(torch.equal(owned[k], oracle[k]) for k in owned)
    finally:
        adapters.uninstall_import_hooks()
    from safetensors import safe_open

    assert not isinstance(safe_open, type) or safe_open.__module__ != "sanitizer.adapters.safetensors_adapter"


def test_an_emulated_slice_has_safetensors_strides_and_values(tmp_path):
    """safetensors returns ``get_slice(k)[:, 2:5]`` as a strided view of the whole tensor; the emulation lent a
    contiguous copy, so ``view()``, ``stride()`` and ``is_contiguous()`` answered otherwise under the sanitizer."""
    from safetensors.torch import save_file

    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.arange(64, dtype=torch.float32).view(8, 8), "e": torch.zeros(0, 4)}, path)
    code = textwrap.dedent(f"""
        import json, torch, sanitizer
        from safetensors import safe_open
        out = []
        with safe_open({path!r}, framework="pt") as f:
            for idx in [(slice(None), slice(2, 5)), (slice(1, 7, 2),), (slice(None), 3), (Ellipsis,),
                        (slice(None), slice(None, None, 2)), (slice(3, 3),)]:
                t = f.get_slice("a")[idx]
                out.append([list(t.shape), list(t.stride()), t.is_contiguous(), t.flatten().tolist(),
                            sanitizer.is_borrowed(t)])
            e = f.get_slice("e")[:, 1:3]
            out.append([list(e.shape), e.is_contiguous(), list(e.stride()), sanitizer.is_borrowed(e)])
        print(json.dumps(out))
    """)
    off = run_python(code)
    on = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "safetensors_ring=4096"})
    assert off.returncode == 0 and on.returncode == 0, off.stderr + on.stderr
    import json

    got_off, got_on = json.loads(off.stdout.splitlines()[-1]), json.loads(on.stdout.splitlines()[-1])
    assert [row[:4] for row in got_on[:-1]] == [row[:4] for row in got_off[:-1]]
    assert got_on[-1][:3] == got_off[-1][:3]  # an empty slice's strides too (a blind user's case)
    assert all(row[-1] for row in got_on[:-2]) and not any(row[-1] for row in got_off)


# -- import hooks ---------------------------------------------------------------------
def test_enable_in_code_with_safetensors_ring_lends_from_the_ring(ckpt_files):
    """``sanitizer.enable(safetensors_ring=N)`` (the code form of the option) installed no adapter: safe_open
    stayed safetensors' own and nothing was emulated, without a word. Plain ``enable()`` patches nothing."""
    paths, _ = ckpt_files
    code = textwrap.dedent(f"""
        import sanitizer
        from sanitizer import adapters
        sanitizer.enable()
        print(adapters.patched() == [] or sorted(adapters.patched()))
        sanitizer.enable(safetensors_ring=1 << 12)
        from safetensors import safe_open
        with safe_open({paths[0]!r}, framework="pt") as f:
            print(all(sanitizer.is_borrowed(f.get_tensor(k)) for k in f.keys()))
    """)
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"], proc.stdout


def test_a_tensor_larger_than_the_ring_is_handed_over_owned_and_counted(ckpt_files):
    """``safetensors_ring`` smaller than a tensor raised ValueError out of the program's own ``get_tensor``:
    a setting's mistake broke a correct program. Now the tensor comes back as safetensors returns it (owned,
    the same values), the ones that fit are still lent, and the summary names the option to raise."""
    paths, _ = ckpt_files
    code = textwrap.dedent(f"""
        import torch, sanitizer
        from safetensors import safe_open
        with safe_open({paths[0]!r}, framework="pt") as f:
            got = {{}}
            for k in f.keys():
                t = f.get_tensor(k)
                got[k] = (t.float().sum().item(), sanitizer.is_borrowed(t))
            part = f.get_slice("layers.0.k")[:2]
            got["slice"] = (part.float().sum().item(), sanitizer.is_borrowed(part))
        for k in sorted(got):
            print(k, got[k][0], got[k][1])
        if sanitizer.enabled():
            from sanitizer.reporting.report import summarize
            print(summarize(sanitizer.report())["line"])
    """)
    off = run_python(code)
    # layers.*.q are bf16 32x16 (1024 bytes), layers.*.k float32 (2048 bytes): a 1536-byte ring holds only q
    on = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "safetensors_ring=1536"})
    assert off.returncode == 0 and on.returncode == 0, on.stderr
    assert "Traceback" not in on.stderr and "ValueError" not in on.stderr, on.stderr
    *rows, line = on.stdout.splitlines()
    sums = lambda out: [row.rsplit(" ", 1)[0] for row in out]
    assert sums(rows) == sums(off.stdout.splitlines())
    lent = {row.split()[0]: row.split()[-1] == "True" for row in rows}
    assert lent == {k: (k.endswith(".q") or k == "slice") for k in lent}, on.stdout  # the slice's 256 bytes fit
    assert ("3 loads not checked (safetensors.safe_open (tensors larger than safetensors_ring=1536): 3 tensors, "
            "6.0 KiB; owned tensors as safetensors returns them") in line, line
    assert "raise safetensors_ring to at least the largest tensor" in line


def test_get_tensors_larger_than_the_ring_is_handed_over_owned_not_overwritten_by_itself(ckpt_files):
    """A blind user's case: ``get_tensors()`` lends the whole file's dict at once, so through a ring smaller
    than the file the emulation overwrote the dict's first tensors with its last: ``load_state_dict(
    f.get_tensors())``, correct, read as 18 emulated retentions (strict: stale-use errors, NaN). A dict the
    ring cannot hold whole is handed over owned and counted; one it can is lent."""
    paths, oracle = ckpt_files
    code = textwrap.dedent(f"""
        import torch, sanitizer
        from safetensors import safe_open
        with safe_open({paths[0]!r}, framework="pt") as f:
            got = {{k: v.clone() for k, v in f.get_tensors().items()}}
            lent = [sanitizer.is_borrowed(v) for v in f.get_tensors().values()]
        print(all(lent), any(lent))
        from sanitizer.reporting.report import summarize
        rep = sanitizer.report(final=True)
        print(summarize(rep)["line"])
        print(sum(1 for e in rep["events"] if e["kind"] in ("retention", "emulated_retention")), len(rep["errors"]))
        torch.save(got, {paths[0] + ".pt"!r})
    """)
    small = run_python(code, {"OWNERSHIP_SANITIZE": "1",  # the file: 3 x (1024 + 2048) bytes; the ring: 4096
                              "OWNERSHIP_SANITIZE_OPTIONS": "safetensors_ring=4096,safetensors_strict=1"})
    assert small.returncode == 0, small.stderr
    flags, line, found = small.stdout.splitlines()[-3:]
    assert flags == "False False" and found == "0 0", small.stdout
    assert ("2 loads not checked (safetensors.safe_open.get_tensors (a dict larger than safetensors_ring=4096): "
            "12 tensors, 18.0 KiB") in line and "raise safetensors_ring to at least that" in line, line
    got = torch.load(paths[0] + ".pt")
    assert set(got) == {k for k in oracle if k.startswith("layers.")}
    assert all(torch.equal(got[k], oracle[k]) for k in got)
    big = run_python(code, {"OWNERSHIP_SANITIZE": "1", "OWNERSHIP_SANITIZE_OPTIONS": "safetensors_ring=65536"})
    assert big.returncode == 0, big.stderr
    assert big.stdout.splitlines()[-3] == "True True", big.stdout


def test_hooks_cost_nothing_when_off():
    proc = run_python("import sys, sanitizer; print('sanitizer.adapters' in sys.modules, "
                      "any(type(f).__name__ == '_PostImportFinder' for f in sys.meta_path))")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_hooks_patch_a_loader_imported_later():
    pytest.importorskip("fastsafetensors")
    code = textwrap.dedent("""
        import sys, sanitizer
        from sanitizer import adapters
        sanitizer.enable()
        assert 'fastsafetensors' not in sys.modules
        assert adapters.install_import_hooks() == []
        import fastsafetensors
        print(adapters.patched())
        print(hasattr(fastsafetensors.ParallelLoader.iterate_weights, "__wrapped__"))
    """)
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("\n")
    assert "fastsafetensors.parallel_loader" in lines[0]
    assert lines[1] == "True"


INSTANTTENSOR_STAND_IN = '''
"""A CPU stand-in with InstantTensor's safe_open(copy=False).tensors() contract (the real one needs CUDA)."""
import torch

class safe_open:
    def __init__(self, tensors, framework="pt", device="cpu", *, copy=True):
        self.copy = copy
        self._tensors = tensors
        self.ring = torch.zeros(max(v.numel() * v.element_size() for v in tensors.values()), dtype=torch.uint8)
        self.exited = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exited = True

    def tensors(self):
        for name, value in self._tensors.items():
            raw = value.view(-1).view(torch.uint8)
            self.ring[:raw.numel()].copy_(raw)
            view = self.ring[:raw.numel()].view(value.dtype).view(value.shape)
            yield name, (view if not self.copy else view.clone())
'''


@pytest.mark.slow
def test_instanttensor_adapter_on_a_stand_in_module(tmp_path):
    pkg = tmp_path / "instanttensor"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from ._impl import safe_open\n")
    (pkg / "_impl.py").write_text(INSTANTTENSOR_STAND_IN)
    code = textwrap.dedent("""
        import torch, sanitizer
        from sanitizer import adapters
        sanitizer.enable()
        adapters.install_import_hooks()
        import instanttensor
        src = {"a": torch.full((8,), 1.0), "b": torch.full((8,), 2.0)}
        with instanttensor.safe_open(src, copy=False) as f:
            params = {k: torch.empty(8) for k in src}
            for k, t in f.tensors():
                params[k].copy_(t)
        assert all(torch.equal(params[k], src[k]) for k in src), params
        with instanttensor.safe_open(src, copy=False) as f:
            kept = dict(f.tensors())
        try:
            kept["a"].sum()
        except sanitizer.StaleBorrowError as e:
            print("caught", e.lease.name, e.lease.region_name)
        with instanttensor.safe_open(src, copy=False) as f:
            it = f.tensors()
            k, first = next(it)
        print("after exit stale:", sanitizer.lease_of(first).stale)
        with instanttensor.safe_open(src, copy=True) as f:
            print("owned wrapped:", type(f.tensors()).__name__)
    """)
    proc = run_python(code, {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "caught a instanttensor@" + lines[0].split("@")[1]
    assert lines[1:] == ["after exit stale: True", "owned wrapped: generator"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="InstantTensor is CUDA only")
def test_instanttensor_real_on_cuda(ckpt_files, hooks):
    """The installed InstantTensor (bench/instanttensor_check.sh runs this at each known version)."""
    instanttensor = pytest.importorskip("instanttensor")
    import inspect

    paths, oracle = ckpt_files
    # 0.1.5-0.1.8 have no `copy` and always lend ring views; from 0.1.9, copy=False lends them
    kw = {"copy": False} if "copy" in inspect.signature(instanttensor.safe_open.__init__).parameters else {}
    with instanttensor.safe_open(paths, framework="pt", device=0, **kw) as f:
        got = {k: t.cpu() for k, t in f.tensors()}
    assert _bit_exact(got, oracle) and sanitizer.errors() == []
    with instanttensor.safe_open(paths, framework="pt", device=0, **kw) as f:
        kept = dict(f.tensors())
        with pytest.raises(StaleBorrowError):
            next(iter(kept.values())).sum()


def test_uninstall_restores_the_loaders(hooks):
    fst = pytest.importorskip("fastsafetensors")
    assert hasattr(fst.ParallelLoader.iterate_weights, "__wrapped__")
    adapters.uninstall_import_hooks()
    assert not hasattr(fst.ParallelLoader.iterate_weights, "__wrapped__")
    assert not any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)


@pytest.mark.slow
def test_zero_code_activation_wraps_a_loader(ckpt_files):
    """OWNERSHIP_SANITIZE=1 and the start-up hook (what the .pth runs): no sanitizer import in the program."""
    pytest.importorskip("fastsafetensors")
    if importlib.util.find_spec("sanitizer.tools.startup") is None:
        pytest.skip("the zero-code start-up hook is not part of this installation")
    from sanitizer.tools.startup import PTH_LINE

    paths, _ = ckpt_files
    code = textwrap.dedent(f"""
        import sys
        exec({PTH_LINE!r})  # what the installed .pth runs at start-up
        assert 'torch' not in sys.modules and 'sanitizer' not in sys.modules
        from fastsafetensors import ParallelLoader
        loader = ParallelLoader(None, {paths!r}, device="cpu", nogds=True, borrowed_tensors=True,
                                accumulate_resident=False, use_tqdm_on_load=False, set_numa=False)
        kept = dict(loader.iterate_weights())
        loader.close()
        try:
            next(iter(kept.values())).sum()
        except Exception as e:
            print(type(e).__name__)
    """)
    proc = run_python(code, {"OWNERSHIP_SANITIZE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "StaleBorrowError"


@pytest.mark.slow
def test_an_unknown_loader_version_is_reported_not_broken(tmp_path):
    pkg = tmp_path / "instanttensor"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_impl.py").write_text("class NotSafeOpen:\n    pass\n")  # no safe_open: an API we do not know
    code = textwrap.dedent("""
        import warnings, sanitizer
        from sanitizer import adapters
        sanitizer.enable()
        adapters.install_import_hooks()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import instanttensor._impl
        print(instanttensor._impl.NotSafeOpen.__name__, adapters.patched())
        print([str(w.message) for w in caught if "could not wrap instanttensor._impl" in str(w.message)][0])
    """)
    proc = run_python(code, {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first == "NotSafeOpen []" and "safe_open" in second and "runs unsanitized" in second
