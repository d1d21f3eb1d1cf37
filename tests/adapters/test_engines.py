"""vLLM's and SGLang's own weight iterators, under ``ownsan run``, against every loader version of the matrix.

The loops below are written from the engines' sources, shaped as they are there (what they call, in
which order, what they keep and close), with the device set to CPU and progress bars disabled. The
script that drives them (this file run as ``python -m tests.adapters.test_engines LOADER``) imports nothing of
the sanitizer: ``ownsan run`` turns it on, the adapters wrap the loader as it is imported, and the
merged report says what was found. Each scenario reads its own checkpoint (tensor names prefixed by
the scenario), so every finding is attributed to its scenario by lease name. Two consumers per loop:
one keeps every tensor in a module dict and reads them after the loop (vLLM's layerwise deferral),
one copies each tensor into preallocated memory before the next (correct under every contract).
Expected per loader version: ``sanitizer.adapters.contracts.ENGINE_PATHS`` (also docs/loaders.md's
table); the adapters' own API scenarios for the version matrix are checked by test_loader_matrix.py.
"""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOADERS_DIR = os.path.join(ROOT, ".loaders")
DISTRIBUTIONS = {"fst": "fastsafetensors", "runai": "runai-model-streamer"}
RUNAI_LIMIT = 16 << 10  # the streamer's buffer: two tensors, so that it really is reused (unsanitized corruption)

try:
    from tqdm.auto import tqdm as _tqdm
except ImportError:  # the engines wrap their iterators in tqdm; without it the loop is the same
    _tqdm = None


def tqdm(iterable: Any, **kwargs: Any) -> Any:
    return iterable if _tqdm is None else _tqdm(iterable, disable=True, **{k: v for k, v in kwargs.items()
                                                                          if k != "disable"})


# -- vLLM 0.20.0 (commit b8160878f), vllm/model_executor/model_loader/weight_utils.py ----------------------
def vllm020_runai(hf_weights_files: List[str], is_distributed: bool = False) -> Iterator[Tuple[str, Any]]:
    """``runai_safetensors_weights_iterator``: the streamer's own tensors, yielded as they come."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        device = "cpu"  # vLLM: f"cuda:{current_device()}" only if is_distributed and cuda-alike
        streamer.stream_files(hf_weights_files, device=device, is_distributed=is_distributed)
        total_tensors = sum(len(tensors_meta) for tensors_meta in streamer.files_to_tensors_metadata.values())
        tensor_iter = tqdm(streamer.get_tensors(), total=total_tensors, mininterval=2)
        yield from tensor_iter


def _vllm_init_fastsafetensors_loader(pg: Any, device: Any, f_list: List[str], *, nogds: bool = False) -> Any:
    """``_init_fastsafetensors_loader``."""
    from fastsafetensors import SafeTensorsFileLoader

    loader = SafeTensorsFileLoader(pg, device, nogds=nogds)
    rank_file_map = {i: [f] for i, f in enumerate(f_list)}
    loader.add_filenames(rank_file_map)
    return loader


def vllm020_fst(hf_weights_files: List[str]) -> Iterator[Tuple[str, Any]]:
    """``fastsafetensors_weights_iterator``: the file buffer's ``get_tensor`` per key, ``fb.close()`` per file group."""
    from fastsafetensors import SingleGroup

    pg = SingleGroup()  # vLLM: torch.distributed.group.WORLD when initialized
    device = "cpu"  # vLLM: torch.device(f"cuda:{current_device()}")
    hf_weights_files = sorted(hf_weights_files)  # vLLM: key=_natural_sort_key
    weight_files_sub_lists = [hf_weights_files[i: i + pg.size()] for i in range(0, len(hf_weights_files), pg.size())]
    nogds = True  # vLLM: pg.size() > 1, with a fallback to True when GDS is missing (always, on CPU)
    for f_list in tqdm(weight_files_sub_lists):
        loader = _vllm_init_fastsafetensors_loader(pg, device, f_list, nogds=nogds)
        try:
            fb = loader.copy_files_to_device()
            try:
                keys = list(fb.key_to_rank_lidx.keys())
                for k in keys:
                    t = fb.get_tensor(k)
                    yield k, t
            finally:
                fb.close()
        finally:
            loader.close()


# -- vLLM 0.33.0 (commit 4ba787ec9), vllm/model_executor/model_loader/weight_utils.py ----------------------
def vllm033_runai(hf_weights_files: List[str], is_distributed: bool = False) -> Iterator[Tuple[str, Any]]:
    """``runai_safetensors_weights_iterator``: as 0.20, but each tensor is cloned before it is yielded."""
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        device = "cpu"
        streamer.stream_files(hf_weights_files, device=device, is_distributed=is_distributed)
        total_tensors = sum(len(tensors_meta) for tensors_meta in streamer.files_to_tensors_metadata.values())
        tensor_iter = tqdm(streamer.get_tensors(), total=total_tensors, mininterval=2)
        for name, tensor in tensor_iter:
            yield name, tensor.clone()


def vllm033_fst(hf_weights_files: List[str]) -> Iterator[Tuple[str, Any]]:
    """``fastsafetensors_weights_iterator``: ``ParallelLoader.iterate_weights()``, closed in ``finally``."""
    from fastsafetensors import SingleGroup
    from fastsafetensors.parallel_loader import ParallelLoader

    pg = SingleGroup()
    hf_weights_files = sorted(hf_weights_files)
    pl = None
    try:
        pl = ParallelLoader(pg=pg, hf_weights_files=hf_weights_files, queue_size=0,  # VLLM_FASTSAFETENSORS_QUEUE_SIZE
                            use_tqdm_on_load=False, device="cpu", nogds=True)
        for name, tensor in pl.iterate_weights():
            yield name, tensor
    finally:
        if pl is not None:
            pl.close()


# -- SGLang 0.5.23 (PyPI wheel; it records no commit), python/sglang/srt/model_loader/weight_utils.py -------
RUNAI_STREAMER_TENSOR_ATTR = "_sglang_runai_streamer_tensor"


def sglang_runai(hf_weights_files: List[str], is_distributed: bool = False, device: str = "cpu"):
    """``runai_safetensors_weights_iterator``: the streamer's tensors, marked on the tensor and its storage."""
    from runai_model_streamer import SafetensorsStreamer

    device = device if is_distributed else "cpu"  # SGLang: `and is_cuda_alike()`
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(hf_weights_files, device=device, is_distributed=is_distributed)
        total_tensors = sum(len(tensors_meta) for tensors_meta in streamer.files_to_tensors_metadata.values())
        tensor_iter = tqdm(streamer.get_tensors(), total=total_tensors, mininterval=2)
        for name, tensor in tensor_iter:
            setattr(tensor, RUNAI_STREAMER_TENSOR_ATTR, True)
            # Views and detach() share storage but do not inherit tensor attributes.
            setattr(tensor.untyped_storage(), RUNAI_STREAMER_TENSOR_ATTR, True)
            yield name, tensor


def sglang_fst(hf_weights_files: List[str], enable_gds: bool = False) -> Iterator[Tuple[str, Any]]:
    """``fastsafetensors_weights_iterator``: ``get_tensor`` per key, ``loader.close()``; the buffer is never closed."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    pg = SingleGroup()
    rank = pg.rank()
    device = "cpu"  # SGLang: torch.device(f"cuda:{rank}")
    weight_files_sub_lists = [hf_weights_files[i: i + pg.size()] for i in range(0, len(hf_weights_files), pg.size())]
    for f_list in tqdm(weight_files_sub_lists):
        loader = SafeTensorsFileLoader(pg, device, nogds=not enable_gds)
        rank_file_map = {i: [f] for i, f in enumerate(f_list)}
        loader.add_filenames(rank_file_map)
        try:
            fb = loader.copy_files_to_device()
            keys = list(fb.key_to_rank_lidx.keys())
            for k in keys:
                t = fb.get_tensor(k)
                yield k, t
        finally:
            loader.close()
        # (SGLang drops the page cache of rank `rank`'s files here when drop_cache_after_load is set)


ENGINE_LOOPS: Dict[str, Callable[[List[str]], Iterator]] = {
    "vllm020_runai": vllm020_runai, "vllm033_runai": vllm033_runai, "sglang_runai": sglang_runai,
    "vllm020_fst": vllm020_fst, "vllm033_fst": vllm033_fst, "sglang_fst": sglang_fst,
}
LOOP_LOADER = {key: ("runai" if key.endswith("runai") else "fst") for key in ENGINE_LOOPS}


# -- the adapters' own API, as a consumer calls it (checked by test_loader_matrix.py) ------------------------
def fst_low_level(files: List[str], borrowed_tensors: bool = False) -> Iterator[Tuple[str, Any]]:
    """The documented basic API: copy_files_to_device, get_tensor, fb.close() per file."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    for path in files:
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True, set_numa=False)
        loader.add_filenames({0: [path]})
        kwargs = {"borrowed_tensors": True} if borrowed_tensors else {}
        fb = loader.copy_files_to_device(**kwargs)
        try:
            for k in list(fb.key_to_rank_lidx):
                yield k, fb.get_tensor(k)
        finally:
            fb.close()
            loader.close()


def fst_parallel(files: List[str], borrowed_tensors: bool = False) -> Iterator[Tuple[str, Any]]:
    from fastsafetensors import ParallelLoader

    kwargs = {"borrowed_tensors": True, "accumulate_resident": False} if borrowed_tensors else {}
    from fastsafetensors import SingleGroup

    pl = ParallelLoader(SingleGroup(), files, device="cpu", nogds=True, use_tqdm_on_load=False, set_numa=False, **kwargs)
    try:
        yield from pl.iterate_weights()
    finally:
        pl.close()


def fst_open(files: List[str]) -> Iterator[Tuple[str, Any]]:
    """``fastsafe_open``: tensors valid until the with block ends (0.2-0.4); owned (0.5)."""
    from fastsafetensors import fastsafe_open

    with fastsafe_open(files, framework="pt", device="cpu", nogds=True) as f:
        for k in f.keys():
            yield k, f.get_tensor(k)


def runai_plain(files: List[str], owned: Any = None) -> Iterator[Tuple[str, Any]]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu", **({} if owned is None else {"owned": owned}))
        yield from streamer.get_tensors()


API_LOOPS: Dict[str, Callable[[List[str]], Iterator]] = {
    "fst_low_level": fst_low_level, "fst_low_level_borrowed": functools.partial(fst_low_level, borrowed_tensors=True),
    "fst_parallel": fst_parallel, "fst_parallel_borrowed": functools.partial(fst_parallel, borrowed_tensors=True),
    "fst_open": fst_open, "runai_plain": runai_plain, "runai_owned_false": functools.partial(runai_plain, owned=False),
}
API_LOADER = {key: key.split("_")[0] for key in API_LOOPS}


# -- the script: run every loop of one loader, each with both consumers, nothing of the sanitizer imported ----
KEPT: Dict[str, Any] = {}  # the retaining consumer's holder (what the report must name)


def _checkpoint(directory: str, tag: str) -> Tuple[List[str], Dict[str, Any]]:
    import torch
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(len(tag))
    paths = []
    for f in range(2):
        tensors = {f"{tag}.layers.{f}.{i}.weight": torch.randn(32, 32, generator=g).to(dtype)
                   for i, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32, torch.float16))}
        path = os.path.join(directory, f"{tag}-{f:05d}.safetensors")
        save_file(tensors, path)
        paths.append(path)
    oracle: Dict[str, Any] = {}
    for p in paths:
        oracle.update(load_file(p))
    return paths, oracle


def _retain(loop: Callable, files: List[str], tag: str) -> Dict[str, Any]:
    """Keep every tensor, then read them all after the loop (the layerwise loader's deferral)."""
    for name, tensor in loop(files):
        KEPT[name] = tensor
    return {name: KEPT[name].clone() for name in list(KEPT) if name.startswith(tag + ".")}


def _copy(loop: Callable, files: List[str], oracle: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    params = {k: torch.empty_like(v) for k, v in oracle.items()}
    for name, tensor in loop(files):
        params[name].copy_(tensor)
    return params


def _imported_version(loader: str) -> str:
    """The version of the loader this interpreter imports (the matrix folder's, first on the path)."""
    import importlib
    import importlib.metadata

    package = importlib.import_module({"fst": "fastsafetensors", "runai": "runai_model_streamer"}[loader])
    site = os.path.dirname(os.path.dirname(os.path.abspath(package.__file__)))
    for dist in importlib.metadata.distributions(path=[site]):
        if dist.metadata.get("Name", "").lower().replace("_", "-") == DISTRIBUTIONS[loader]:
            return dist.version
    return "unknown"


def _script(loader: str, out: str, version: str) -> None:
    import torch

    version = _imported_version(loader)
    results: Dict[str, Any] = {"version": version}
    loops = {**{k: v for k, v in ENGINE_LOOPS.items() if LOOP_LOADER[k] == loader},
             **{k: v for k, v in API_LOOPS.items() if API_LOADER[k] == loader}}
    with tempfile.TemporaryDirectory() as tmp:
        for key, loop in loops.items():
            if key.endswith("_borrowed") and not version.startswith("0.5"):
                continue  # borrowed_tensors= is 0.5's
            if key == "runai_owned_false" and not version.startswith("0.17"):
                continue  # owned= is 0.17's
            for consumer in ("retain", "copy"):
                tag = f"{key}-{consumer}"
                files, oracle = _checkpoint(tmp, tag)
                try:
                    got = _retain(loop, files, tag) if consumer == "retain" else _copy(loop, files, oracle)
                    results[tag] = {"bit_exact": set(got) == set(oracle) and all(
                        torch.equal(got[k], oracle[k]) for k in oracle), "names": sorted(oracle)}
                except Exception as exc:  # a loop that this loader version cannot run at all
                    results[tag] = {"error": f"{type(exc).__name__}: {exc}", "names": sorted(oracle)}
                KEPT.clear()
    with open(out, "w", encoding="utf-8") as fh:
        json.dump(results, fh)


# -- the tests ------------------------------------------------------------------------------------------------
def loader_folder(loader: str, version: str) -> str:
    folder = os.path.join(LOADERS_DIR, f"{DISTRIBUTIONS[loader]}-{version}")
    if not os.path.isfile(os.path.join(folder, ".complete")):
        log = f"{folder}.log"
        why = (f"it did not install or import there (see {log})" if os.path.isfile(log) else
               "run `./dev test --full` (or `bash .ci/loader_matrix.sh`), as .ci/run does")
        pytest.skip(f"{DISTRIBUTIONS[loader]} {version} is not installed in {folder}: {why}")
    return folder


_RUNS: Dict[Tuple[str, str], Dict[str, Any]] = {}


def matrix_run(loader: str, version: str) -> Dict[str, Any]:
    """Run the script for ``loader`` at ``version`` under ``ownsan run`` (once per test session)."""
    key = (loader, version)
    if key in _RUNS:
        return _RUNS[key]
    folder = loader_folder(loader, version)
    with tempfile.TemporaryDirectory() as tmp:
        out, report = os.path.join(tmp, "results.json"), os.path.join(tmp, "report.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
        env["PYTHONPATH"] = os.pathsep.join([folder, ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
        env.update(RUNAI_STREAMER_MEMORY_LIMIT=str(RUNAI_LIMIT), RUNAI_STREAMER_LOG_LEVEL="WARNING",
                   PYTHONWARNINGS="always::RuntimeWarning")
        proc = subprocess.run([sys.executable, "-m", "sanitizer", "run", "-q", "--report", report, "--",
                               sys.executable, "-m", "tests.adapters.test_engines", loader, out, version],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert os.path.exists(out), f"the script did not finish:\n{proc.stdout}\n{proc.stderr}"
        with open(out, encoding="utf-8") as fh:
            results = json.load(fh)
        with open(report, encoding="utf-8") as fh:
            rep = json.load(fh)
    results["_report"] = rep
    results["_stderr"] = proc.stderr
    _RUNS[key] = results
    return results


def findings(results: Dict[str, Any], tag: str) -> Dict[str, Any]:
    """The report's errors and retentions about the scenario ``tag``'s tensors, by lease name."""
    names = set(results[tag]["names"])
    rep = results["_report"]
    errors = [e for e in rep["errors"] if (e.get("lease") or {}).get("name") in names]
    retentions = [e for e in rep["events"] if e.get("kind") == "retention"
                  and (e.get("lease") or {}).get("name") in names]
    return {"errors": errors, "retentions": retentions, "names": names}


def assert_outcome(results: Dict[str, Any], key: str, outcome: str) -> None:
    """``caught``: every retained tensor is a named retention and a stale read; ``clean``: nothing reported,
    bit-exact. The copying consumer is clean and bit-exact under every contract."""
    retain, copy = results[f"{key}-retain"], results[f"{key}-copy"]
    assert "error" not in retain and "error" not in copy, (retain, copy, results["_stderr"][-2000:])
    ret, cop = findings(results, f"{key}-retain"), findings(results, f"{key}-copy")
    assert copy["bit_exact"] and not cop["errors"] and not cop["retentions"], (cop, results["_stderr"][-2000:])
    if outcome == "caught":
        held = {e["lease"]["name"] for e in ret["retentions"]}
        assert held == ret["names"], f"{key}: not every retained tensor was caught: missing {ret['names'] - held}"
        assert all("KEPT" in ((e.get("holder") or {}).get("path") or "") for e in ret["retentions"]), \
            [(e.get("holder") or {}).get("path") for e in ret["retentions"]][:3]
        assert {e["lease"]["name"] for e in ret["errors"] if e["kind"] == "stale_use"} == ret["names"]
    else:
        assert retain["bit_exact"], f"{key}: the loader owns its tensors, retaining them must be correct"
        assert not ret["errors"] and not ret["retentions"], (ret["errors"][:1], ret["retentions"][:1])


def _engine_cases():
    from sanitizer.adapters.contracts import ENGINE_PATHS

    for path in ENGINE_PATHS:
        if path.key not in ENGINE_LOOPS:
            continue  # InstantTensor: CUDA only (tests/adapters/test_adapters_instanttensor.py)
        for version, outcome in path.outcomes:
            yield pytest.param(path.key, version, outcome, id=f"{path.key}-{version}")


@pytest.mark.parametrize("key,version,outcome", list(_engine_cases()))
def test_engine_iterator_under_ownsan_run(key, version, outcome):
    results = matrix_run(LOOP_LOADER[key], version)
    assert results["version"] == version
    assert_outcome(results, key, outcome)


def test_every_engine_path_of_the_table_is_driven_here():
    from sanitizer.adapters.contracts import ENGINE_PATHS

    assert {p.key for p in ENGINE_PATHS} - {"instanttensor"} == set(ENGINE_LOOPS)


if __name__ == "__main__":
    _script(sys.argv[1], sys.argv[2], sys.argv[3])
