"""Load time of the real loaders on CPU: sanitizer off, generation tracking, full debug.

For each loader that is installed (fastsafetensors 0.5 borrowed mode, its file
buffer's views leased until ``fb.close()`` as vLLM 0.20 calls it, runai-model-streamer
owned=False, safetensors safe_open tracked as borrowed),
the same checkpoint is loaded by a correct consumer (copy into preallocated
parameters) in three modes, interleaved run by run so that machine noise hits
all modes alike:

* ``off``: the loader's own iterator, sanitizer disabled;
* ``tracking``: ``sanitizer.enable()`` and the loader under ``borrowed_iterator``
  (what ``OWNERSHIP_SANITIZE=1`` does through the adapters): leases, generations;
* ``full``: ``enable(checksum=1, poison=1)``: also a hash of every lease at lend,
  verification at retire and a poison fill of every retired lease that is held.

``--breakdown`` adds ``tracking-noguard`` (``guard=0``: no tombstone for a retired
lease that is still referenced, such as the consumer's loop variable) and
``tracking-notriage`` (the retention hooks unregistered), so that the share of
each feature in the tracking cost is printed next to it. Triage walks the heap
only for a confirmed retention: a correct consumer costs it a counter and a
deque append per lend.

Targets: tracking <= 1.05x, full <= 1.3x. The checkpoint mimics an LLM's
tensor sizes (a few KB norms, tens of MB projections); ``--hidden`` and
``--layers`` scale it.

    python bench/loaders.py [--layers 4] [--hidden 2048] [--reps 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import sanitizer  # noqa: E402
from sanitizer.core import options as option_table  # noqa: E402

MODES = ("off", "tracking", "full")
BREAKDOWN = ("tracking-noguard", "tracking-notriage")


def make_checkpoint(directory: str, layers: int, hidden: int,
                    vocab: Optional[int] = None) -> Tuple[List[str], Dict[str, torch.Tensor]]:
    """An LLM's tensors (an embedding of ``vocab`` rows, default ``8 * hidden``, and ``layers`` layers of norms,
    attention and MLP projections), bf16, in two shards under ``directory`` (also used by bench/e2e.py)."""
    from safetensors.torch import save_file

    inter = hidden * 11 // 4
    g = torch.Generator().manual_seed(0)
    rows = 8 * hidden if vocab is None else vocab
    tensors: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(rows, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[p + f"self_attn.{name}.weight"] = torch.randn(hidden, hidden, generator=g)
        tensors[p + "post_attention_layernorm.weight"] = torch.randn(hidden, generator=g)
        for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            tensors[p + f"mlp.{name}.weight"] = torch.randn(*shape, generator=g)
    tensors = {k: v.to(torch.bfloat16) for k, v in tensors.items()}
    names = list(tensors)
    half = len(names) // 2
    paths = []
    for i, part in enumerate((names[:half], names[half:])):
        path = os.path.join(directory, f"model-{i + 1:05d}-of-00002.safetensors")
        save_file({k: tensors[k] for k in part}, path)
        paths.append(path)
    return paths, tensors


# -- loaders: each returns a fresh (name, tensor) iterator and a cleanup ------------------
def fastsafetensors_loader(paths: List[str]) -> Tuple[Iterator, Callable[[], None]]:
    from fastsafetensors import ParallelLoader

    loader = ParallelLoader(None, paths, device="cpu", nogds=True, borrowed_tensors=True,
                            accumulate_resident=False, use_tqdm_on_load=False, set_numa=False)
    return loader.iterate_weights(), loader.close


def runai_loader(paths: List[str]) -> Tuple[Iterator, Callable[[], None]]:
    from runai_model_streamer import SafetensorsStreamer

    streamer = SafetensorsStreamer()
    streamer.__enter__()
    streamer.stream_files(paths, device="cpu", owned=False)
    return streamer.get_tensors(), lambda: streamer.__exit__(None, None, None)


def safetensors_loader(paths: List[str]) -> Tuple[Iterator, Callable[[], None]]:
    from safetensors import safe_open

    def gen() -> Iterator:
        for path in paths:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    return gen(), lambda: None


def fastsafetensors_file_buffer_loader(paths: List[str], tracked: bool = False) -> Tuple[Iterator, Callable[[], None]]:
    """vLLM 0.20's path: ``copy_files_to_device`` + ``fb.get_tensor`` per key + ``fb.close()`` per file, the views
    leased until the close as the adapter does (``BorrowedLoans``), or not at all when ``tracked`` is False."""
    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    from sanitizer.torch_layer.iterators import BorrowedLoans

    def gen() -> Iterator:
        for path in paths:
            loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True, set_numa=False)
            loader.add_filenames({0: [path]})
            fb = loader.copy_files_to_device(borrowed_tensors=True)  # 0.5: the 0.2-0.4 zero-copy views
            loans = BorrowedLoans("bench:file-buffer") if tracked else None
            try:
                for k in list(fb.key_to_rank_lidx):
                    t = fb.get_tensor(k)
                    yield k, (loans.lend(k, t) if loans is not None else t)
            finally:
                if loans is not None:
                    loans.close()
                fb.close()
                loader.close()

    return gen(), lambda: None


SELF_TRACKING = {fastsafetensors_file_buffer_loader}  # they lend leases themselves (as their adapter does)

LOADERS = {
    "fastsafetensors (borrowed_tensors=True)": ("fastsafetensors", fastsafetensors_loader),
    "fastsafetensors file buffer (until close)": ("fastsafetensors", fastsafetensors_file_buffer_loader),
    "runai-model-streamer (owned=False)": ("runai_model_streamer", runai_loader),
    "safetensors safe_open (tracked as borrowed)": ("safetensors", safetensors_loader),
}


def available() -> Dict[str, Callable]:
    import importlib.util

    return {label: fn for label, (module, fn) in LOADERS.items() if importlib.util.find_spec(module) is not None}


def _triage_hooks(on: bool) -> None:
    from sanitizer.features import triage

    if on:
        triage.install()
    else:
        triage.uninstall()


def load_once(make: Callable, paths: List[str], params: Dict[str, torch.Tensor], mode: str) -> float:
    if mode != "off":  # options persist across disable(): set them every time
        extra = {"guard": False} if mode == "tracking-noguard" and "guard" in option_table.OPTIONS else {}
        sanitizer.enable(checksum=mode == "full", poison=mode == "full", **extra)
        if mode == "tracking-notriage":  # after enable(): it re-arms the features
            _triage_hooks(False)
    try:
        start = time.perf_counter()
        if make in SELF_TRACKING:
            iterator, cleanup = make(paths, tracked=mode != "off")
        else:
            iterator, cleanup = make(paths)
            if mode != "off":
                iterator = sanitizer.borrowed_iterator(iterator, lifetime=1, name="bench")
        for name, t in iterator:
            params[name].copy_(t)
        del t
        cleanup()
        elapsed = time.perf_counter() - start
    finally:
        sanitizer.disable()
        if mode == "tracking-notriage":
            _triage_hooks(True)
        if mode == "tracking-noguard":
            sanitizer.enable(guard=True)
            sanitizer.disable()
    errors = sanitizer.errors()
    if errors:
        raise SystemExit(f"a correct consumer got {len(errors)} sanitizer error(s): {errors[0]['summary']}")
    return elapsed


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--breakdown", action="store_true",
                        help="also time tracking without the guard and without the retention hooks")
    args = parser.parse_args(argv)
    os.environ.setdefault("RUNAI_STREAMER_MEMORY_LIMIT", str(256 << 20))
    os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
    missing = [o for o in ("checksum", "poison") if o not in option_table.OPTIONS]
    modes = MODES if not missing else ("off", "tracking")
    if args.breakdown:
        modes = modes + BREAKDOWN
    if missing:
        print(f"note: options {missing} are not in the option table yet: the 'full' column is skipped")
    loaders = available()
    if not loaders:
        print("no loader installed (pip install fastsafetensors runai-model-streamer safetensors)")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        paths, ckpt = make_checkpoint(tmp, args.layers, args.hidden)
        total = sum(t.numel() * t.element_size() for t in ckpt.values())
        print(f"checkpoint: {len(ckpt)} tensors, {total / 2**20:.0f} MiB bf16 in 2 files; "
              f"{args.reps} interleaved runs per mode, median seconds; torch {torch.__version__}, {os.cpu_count()} CPUs")
        params = {k: torch.empty_like(v) for k, v in ckpt.items()}
        wd = max(13, max(len(m) for m in modes) + 4)
        print(f"{'loader':46s} " + " ".join(f"{m + ' (s)':>{wd}s}" for m in modes) + "   "
              + " ".join(f"{m + '/off':>{wd}s}" for m in modes[1:]))
        for label, make in loaders.items():
            for mode in modes:  # warm-up: page cache, numba compile, first-use imports
                load_once(make, paths, params, mode)
            times: Dict[str, List[float]] = {m: [] for m in modes}
            for _ in range(args.reps):
                for mode in modes:
                    times[mode].append(load_once(make, paths, params, mode))
            assert all(torch.equal(params[k], ckpt[k]) for k in ckpt), f"{label}: wrong weights"
            med = {m: statistics.median(v) for m, v in times.items()}
            # each run's ratio to the 'off' run right before it, then the median: robust to a busy machine
            ratio = {m: statistics.median(t / o for t, o in zip(times[m], times["off"])) for m in modes[1:]}
            print(f"{label:46s} " + " ".join(f"{med[m]:{wd}.3f}" for m in modes) + "   "
                  + " ".join(f"{ratio[m]:{wd - 1}.2f}x" for m in modes[1:]))
    print("targets: tracking <= 1.05x, full <= 1.30x")
    print("note: safetensors is not a borrowing loader (its row shows the wrapper's per-tensor cost); its tensors\n"
          "are copy-on-write pages of a file mapping, so poison=1 copies every page it fills")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
