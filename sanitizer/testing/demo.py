"""The end-to-end demo and benchmark: the vLLM layerwise-reload bug on CPU, caught and fixed.

``python examples/layerwise_reload.py`` (or ``ownsan demo``, or ``python -m
sanitizer.testing.demo``) first says what it simulates (:data:`INTRO`), then
writes a real ``.safetensors`` checkpoint whose layers are interleaved, reads
it through a :class:`~sanitizer.StagingRing` smaller than a layer's deferral
window, loads it with the faithful layerwise deferred loader
(:mod:`sanitizer.testing.reference.deferred_loader`) plus an online int8
quantizer, and compares every checkpoint tensor bit for bit against
``load_file`` + the same quantizer, in five configurations:

* ``unsafe``: borrowed views retained as they are (the bug);
* ``debug``: the same, in a child process with ``OWNERSHIP_SANITIZE=1``
  (activation at import, for real): it stops at the first stale replay, and
  the demo says which frames of that report are the consumer's;
* ``clone-on-defer``: ``own_arguments`` at the deferral point (the fix, printed
  at the line the sanitizer's own report names: :func:`fix_site`, :func:`fix_text`);
* ``rescue``: unsafe consumer, sanitizer with ``rescue=1``;
* ``copy-everything``: the loader hands out owned copies (``INSTANTTENSOR_COPY=1``).

Then the unsafe load runs once more with ``triage=1`` (record, never raise:
:func:`report_run`). Its report is written as JSON (``--report``: what ``ownsan
triage REPORT --html/--trace`` reads) and its timeline as one HTML page
(``--html``): each staging buffer's leases over its generations, the deferred
views retained past the reuse of their bytes in red, numbered and listed with
their holder. In that run the guard (on by default) re-points each retained
view to poison when its bytes are reused, so the tensors the consumer loaded
from one read NaN instead of the next tensor's bytes; the demo says so where
it lists them.

The table is the benchmark: corruption, errors, load time (best of
``--repeat``, each configuration after a warm-up) and extra memory (bytes of
owned copies alive at peak, and copied in total) side by side.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from sanitizer import activation
from sanitizer.core import output_file
from sanitizer.core.errors import OwnershipError, fix_site as report_fix_site
from sanitizer.core.options import OPTIONS
from sanitizer.core.sites import frame_text
from sanitizer.features import ownership
from sanitizer.features import rescue
from sanitizer.testing.reference.checkpoint import (ORDERS, config_of, corrupted_tensors, deferral_windows,
                                                    read_header, reference_state, stream_through_ring,
                                                    write_checkpoint)
from sanitizer.testing.reference.deferred_loader import LayerwiseLoader
from sanitizer.testing.reference.fused_loaders import TinyConfig, TinyForCausalLM
from sanitizer.torch_layer import records
from sanitizer.torch_layer.ring import StagingRing
from sanitizer.torch_layer.state import state

CONFIGS = ("unsafe", "debug", "clone-on-defer", "rescue", "copy-everything")
LABELS = {
    "unsafe": "unsafe borrowed",
    "debug": "debug (OWNERSHIP_SANITIZE=1)",
    "clone-on-defer": "clone-on-defer (own_arguments)",
    "rescue": "rescue (rescue=1)",
    "copy-everything": "copy-everything (INSTANTTENSOR_COPY=1)",
}
SAFE = ("clone-on-defer", "rescue", "copy-everything")
_RESULT_TAG = "DEMO-RESULT "

INTRO = (
    "What this simulates: vLLM's layerwise weight reload with online int8 quantization, on CPU, for a small "
    "MoE model. A fast loader reads the checkpoint into one staging ring it reuses and lends views of it; the "
    "layerwise loader defers each weight_loader call until its layer is complete, keeping the borrowed view, "
    "and replays it then. The ring is smaller than a layer's deferral window, so by replay time it has reused "
    "those bytes for a later tensor.\n"
    "'corrupted' counts checkpoint tensors whose loaded (quantized) values differ, bit for bit, from "
    "safetensors.load_file + the same quantizer: they were built from another tensor's bytes."
)


@dataclass
class Result:
    config: str
    corrupted: Optional[int]  # None when the load stopped at an error
    total: int
    errors: int
    error_kind: str
    seconds: float
    copies: int
    copied_bytes: int
    peak_extra_bytes: int
    rescues: int
    summary: str = ""
    report: str = ""
    guide: str = ""  # (debug) which frames of the report are the consumer's
    fix_site: str = ""  # (debug) file:line of the error's fix (where the consumer stored the view)


def load(path: str, ring_bytes: int, *, ownership_on: bool, copy: bool = False) -> TinyForCausalLM:
    """One layerwise deferred load of ``path`` through a fresh ring (closed afterwards)."""
    with torch.device("meta"):
        model = TinyForCausalLM(config_of(path))
    loader = LayerwiseLoader(model, ownership=ownership_on)
    ring = StagingRing(ring_bytes, name="demo-ring")
    try:
        model.load_weights(stream_through_ring(path, ring, copy=copy))
        loader.finalize()
    finally:
        ring.close()
    return model


def fix_site(results: Sequence["Result"], run: Optional["ReportRun"] = None) -> Optional[str]:
    """``file:line`` of the fix, as the sanitizer's own report names it: where the consumer stored the view
    the debug load stopped at (that error's ``fix:``), else where the ``triage=1`` run's first retaining
    consumer stored its views; shown relative to the working directory. None when no sanitized load ran."""
    site = next((r.fix_site for r in results if r.config == "debug" and r.fix_site), None)
    if site is None and run is not None:
        site = next((g.get("stored_at") for g in run.report["summary"]["retaining_consumers"] if g.get("stored_at")),
                    None)
    return _shown_path(site) if site else None


def fix_text(site: Optional[str] = None) -> str:
    """The fix, spelled out: where it goes (``site``, from :func:`fix_site`: the line the report names) and
    what it does."""
    where = (f"online_process_loader ({site}, where it stores the call)" if site else
             "online_process_loader (deferred_loader.py, where it stores the call; the debug row's report names "
             "the line)")
    return (f"The fix (the clone-on-defer row): own the borrowed arguments before the deferred call is kept, in "
            f"{where}:\n"
            "    bound = sanitizer.own_arguments(bound)   # before info.loaded_weights.append((param_name, bound))\n"
            "own_arguments copies only the tensor arguments that are borrowed views (the destination 'param' is "
            "skipped), so the copy costs the deferred bytes alone; the call that completes a layer is replayed at "
            "once and keeps its view. The reference loader does this through DeferralScope.defer, which also "
            "frees the copies when the layer is processed.")


def _shown_path(path: str) -> str:
    """``path`` relative to the working directory when it is under it (shorter to read), else as it is."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return path if rel.startswith("..") else rel


def _frames(frames: Any) -> List[Dict[str, Any]]:
    return [f for f in frames or () if isinstance(f, dict)]


def _first(frames: List[Dict[str, Any]], filename: str) -> Optional[Dict[str, Any]]:
    return next((f for f in frames if os.path.basename(f.get("file") or "") == filename), None)


def stack_guide(record: Dict[str, Any]) -> str:
    """Which frames of the debug report are whose: the loader that lent the view, the consumer that kept
    it and replayed it late, and the demo's own driver below them (read from the error's record)."""
    lent = _frames((record.get("lease") or {}).get("lent_at"))
    used = _frames(record.get("used_at"))
    lines = ["How to read the report below:"]
    lender = lent[0] if lent else None
    pulled = _first(lent, "fused_loaders.py")
    if lender is not None:
        lines.append(f"  lent at / reused at: {frame_text(lender, basename=True)} is the demo's stand-in for a fast "
                     f"loader's iterator" + (f", pulled by the model's {frame_text(pulled, basename=True)}"
                                             if pulled else ""))
    replay = _first(used, "deferred_loader.py")
    reader = used[0] if used else None
    if replay is not None and reader is not None:
        lines.append(f"  used at: the consumer, LayerwiseLoader, replaying a deferred call "
                     f"({frame_text(replay, basename=True)}) into {frame_text(reader, basename=True)}, "
                     "which read the view after the ring had reused its bytes")
    kept = report_fix_site(record.get("holder"))
    if kept:
        lines.append(f"  held by: the consumer's retained calls; it kept them at {_shown_path(kept)} "
                     "(online_process_loader), where the fix goes")
    lines.append("  frames in demo.py are the demo's driver (it runs this load in a child process)")
    return "\n".join(lines)


def _measure(config: str, path: str, ring_bytes: int) -> TinyForCausalLM:
    if config == "rescue":
        # Rescue alone: the heap walk that names holders (triage, a debug-mode diagnostic) is off.
        quiet = {"triage_budget_ms": 0} if "triage_budget_ms" in OPTIONS else {}
        with activation.sanitize(rescue=1, **quiet):
            return load(path, ring_bytes, ownership_on=False)
    return load(path, ring_bytes, ownership_on=config == "clone-on-defer", copy=config == "copy-everything")


def _run_once(config: str, path: str, ring_bytes: int, reference: Dict[str, torch.Tensor]) -> Result:
    if ownership.stats()["owned_bytes"]:
        gc.collect()  # copies of the previous run still in a cycle (a full collection costs ~0.3 s here)
    ownership.reset_stats()
    rescue.clear()
    start = time.perf_counter()
    model = _measure(config, path, ring_bytes)
    seconds = time.perf_counter() - start
    st = ownership.stats()
    bad = corrupted_tensors(model, reference, config_of(path))
    return Result(config, len(bad), len(read_header(path)[0]), 0, "", seconds, st["copies"], st["copied_bytes"],
                  st["peak_owned_bytes"], len(rescue.rescues()),
                  summary=", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))


def run_configs(configs: Sequence[str], path: str, ring_bytes: int, reference: Dict[str, torch.Tensor],
                repeat: int = 3, progress: Optional[Callable[[str], None]] = None) -> List[Result]:
    """Run in-process configurations: each warmed up once, then ``repeat`` rounds taken round-robin
    (so load from other processes hits all alike); the best time of each, its worst corruption.
    ``progress`` is told when each round is done (the rounds take most of the demo's time)."""
    for c in configs:
        if c not in CONFIGS or c == "debug":
            raise ValueError(f"in-process configurations are {', '.join(x for x in CONFIGS if x != 'debug')}; "
                             f"got {c!r}")
        _measure(c, path, ring_bytes)  # warm-up: first dispatch-mode use, allocator, file cache
    best: Dict[str, Result] = {}
    rounds = max(1, repeat)
    start = time.perf_counter()
    for done in range(1, rounds + 1):
        if progress is not None and done > 1:
            progress(f"round {done - 1} of {rounds} done ({time.perf_counter() - start:.1f} s)")
        for c in configs:
            r = _run_once(c, path, ring_bytes, reference)
            prev = best.get(c)
            if prev is not None:
                r.corrupted = max(r.corrupted or 0, prev.corrupted or 0)
                if prev.seconds <= r.seconds:
                    prev.corrupted = r.corrupted
                    continue
            best[c] = r
    if progress is not None:
        progress(f"round {rounds} of {rounds} done ({time.perf_counter() - start:.1f} s)")
    return [best[c] for c in configs]


def _child_debug(path: str, ring_bytes: int) -> Result:
    """In the ``OWNERSHIP_SANITIZE=1`` child: the unsafe load, stopped by the sanitizer."""
    if not state.enabled:
        raise SystemExit("the debug configuration must run with OWNERSHIP_SANITIZE=1 in the environment")
    total = len(read_header(path)[0])
    load(path, ring_bytes, ownership_on=True)  # warm-up (owned: no error)
    records.clear_errors()
    start = time.perf_counter()
    try:
        model = load(path, ring_bytes, ownership_on=False)
    except OwnershipError as err:
        return Result("debug", None, total, 1, type(err).__name__, time.perf_counter() - start, 0, 0, 0, 0,
                      summary=err.summary, report=str(err), guide=stack_guide(err.record),
                      fix_site=report_fix_site(getattr(err, "holder", None)) or "")
    bad = corrupted_tensors(model, reference_state(path), config_of(path))
    return Result("debug", len(bad), total, 0, "", time.perf_counter() - start, 0, 0, 0, 0)


def child_main(argv: Optional[Sequence[str]] = None) -> int:
    """The debug child's entry (``--child debug --checkpoint PATH --ring-bytes N``): prints the report it
    stopped at, then its result as one tagged JSON line for the parent."""
    args = _parser().parse_args(argv)
    if args.child != "debug" or not args.checkpoint:
        raise SystemExit("child_main runs the debug configuration: --child debug --checkpoint PATH --ring-bytes N")
    result = _child_debug(args.checkpoint, args.ring_bytes)
    if result.report:
        print(result.report)
    print(_RESULT_TAG + json.dumps(asdict(result)))
    return 0


def start_debug_subprocess(path: str, ring_bytes: int) -> subprocess.Popen:
    """Start the debug configuration in a fresh interpreter with ``OWNERSHIP_SANITIZE=1`` (activation at import)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
    env["OWNERSHIP_SANITIZE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    # Started through child_main (not ``-m``): under the consumer's frames, its stacks show one frame of the
    # demo's driver and the command line's, not runpy's and the demo's argument handling.
    cmd = [sys.executable, "-c", "import sys; from sanitizer.testing.demo import child_main; sys.exit(child_main())",
           "--child", "debug", "--checkpoint", path, "--ring-bytes", str(ring_bytes)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_debug_subprocess(proc: subprocess.Popen, timeout: float = 300) -> Result:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise RuntimeError(f"the debug child did not finish in {timeout} s:\n{err[-4000:]}") from None
    for line in reversed(out.splitlines()):
        if line.startswith(_RESULT_TAG):
            return Result(**json.loads(line[len(_RESULT_TAG):]))
    raise RuntimeError(f"the debug child failed (exit {proc.returncode}):\n{out[-2000:]}{err[-4000:]}")


def run_debug_subprocess(path: str, ring_bytes: int, timeout: float = 300) -> Result:
    return finish_debug_subprocess(start_debug_subprocess(path, ring_bytes), timeout)


@dataclass
class ReportRun:
    """The unsafe load under ``triage=1``: its report, what came out wrong, and where it was written."""

    report: Dict[str, Any]
    corrupted: List[str] = field(default_factory=list)  # checkpoint tensors loaded wrong
    nan_parameters: List[str] = field(default_factory=list)  # parameters holding NaN: the guard's poison
    html: Optional[str] = None
    json: Optional[str] = None

    def lines(self) -> List[str]:
        """What the demo prints about this run: the findings, the NaNs explained, the files and how to read them."""
        rep = self.report
        out = ["the unsafe load once more with triage=1 (every stale read recorded, none raised; the guard on):",
               f"  {rep['summary']['line']}"]
        if self.corrupted:
            out.append(f"  {len(self.corrupted)} of the checkpoint's tensors came out wrong: "
                       f"{', '.join(self.corrupted[:2])}" + (", ..." if len(self.corrupted) > 2 else ""))
        if self.nan_parameters:
            first, more = self.nan_parameters[0], self.nan_parameters[1:]
            out.append(f"  {first} reads NaN: the guard re-pointed the retained view it was loaded from to poison "
                       "when the ring reused its bytes (so it never read the next tensor's bytes); see the report")
            if more:
                out.append(f"  so do {len(more)} more parameter{'s' * (len(more) != 1)}, for the same reason: "
                           f"{', '.join(more[:2])}" + (", ..." if len(more) > 2 else ""))
        if self.json:
            out.append(f"  report: {self.json}")
            out.append(f"    read it with: ownsan triage {self.json} --html PAGE --trace TRACE")
        if self.html:
            out.append(f"  timeline: {self.html}  (one page, no network: open it in a browser)")
        return out


def report_run(path: str, ring_bytes: int, html_path: Optional[str] = None, report_path: Optional[str] = None,
               reference: Optional[Dict[str, torch.Tensor]] = None) -> ReportRun:
    """The unsafe load once more with ``triage=1`` (every finding recorded, none raised): its report written
    as JSON to ``report_path`` and drawn as the timeline page at ``html_path`` (either may be None), and the
    tensors it loaded wrong (with the guard on, as NaN). The sanitizer's records are cleared again afterwards."""
    from sanitizer.features import triage
    from sanitizer.reporting import report as report_mod
    from sanitizer.reporting import timeline

    triage.reset(records_too=True)
    records.clear_errors()
    try:
        with activation.sanitize(triage=1):
            model = load(path, ring_bytes, ownership_on=False)
            gc.collect()  # the loader and its half-built model are gone: their retained views die
            rep = report_mod.report(final=True)
    finally:
        triage.reset(records_too=True)
        records.clear_errors()
    run = ReportRun(rep)
    if reference is not None:
        run.corrupted = corrupted_tensors(model, reference, config_of(path))
    run.nan_parameters = [name for name, t in model.state_dict().items()
                          if t.is_floating_point() and bool(torch.isnan(t).any())]
    del model
    if report_path:
        directory = os.path.dirname(report_path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        # as the sanitizer's own report=PATH writes it (atomically; a device, a FIFO, a link kept as they are)
        output_file.write_text(report_path, json.dumps(rep, indent=2, default=str) + "\n")
        run.json = report_path
    if html_path:
        timeline.write_html(rep, html_path, title="layerwise reload through a staging ring: which view was kept "
                                                  "past the reuse of its bytes, and by whom", intro=INTRO)
        run.html = html_path
    return run


def write_timeline(path: str, ring_bytes: int, html_path: str) -> Dict[str, Any]:
    """:func:`report_run` with the page alone: its report."""
    return report_run(path, ring_bytes, html_path).report


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def format_table(results: Sequence[Result]) -> str:
    head = ("configuration", "corrupted", "errors raised", "load time", "copies", "bytes copied", "peak extra memory")
    rows = [head]
    for r in results:
        corrupted = "stopped" if r.corrupted is None else f"{r.corrupted} / {r.total}"
        errors = f"{r.errors} {r.error_kind}".strip() if r.errors else "0"
        rows.append((LABELS[r.config], corrupted, errors, f"{r.seconds * 1e3:.1f} ms", str(r.copies),
                     _size(r.copied_bytes), _size(r.peak_extra_bytes)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(results: Sequence[Result]) -> List[str]:
    """What went wrong, if anything: a safe configuration not bit-exact, or corruption the sanitizer missed."""
    by = {r.config: r for r in results}
    problems = [f"{LABELS[c]}: {by[c].corrupted} of {by[c].total} tensors corrupted ({by[c].summary})"
                for c in SAFE if c in by and by[c].corrupted]
    if "unsafe" in by and by["unsafe"].corrupted and "debug" in by and not by["debug"].errors:
        problems.append("the unsafe load corrupted tensors but debug mode raised nothing")
    return problems


def _parser(prog: str = "layerwise_reload") -> argparse.ArgumentParser:
    d = TinyConfig()
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                epilog=INTRO.replace("\n", " "))
    p.add_argument("--dense-layers", type=int, default=d.dense_layers, help="dense decoder layers (%(default)s)")
    p.add_argument("--moe-layers", type=int, default=d.moe_layers, help="MoE decoder layers (%(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts per MoE layer (%(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size (%(default)s)")
    p.add_argument("--intermediate", type=int, default=d.intermediate, help="dense MLP size (%(default)s)")
    p.add_argument("--moe-intermediate", type=int, default=d.moe_intermediate,
                   help="expert MLP size (%(default)s)")
    p.add_argument("--order", choices=ORDERS, default="interleaved", help="tensor order in the file (%(default)s)")
    p.add_argument("--ring-bytes", type=int, default=0, help="staging ring size (default: 2x the largest tensor)")
    p.add_argument("--seed", type=int, default=0, help="seed of the checkpoint's values (%(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per configuration (best is shown)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--report", default=None, help="where to write the sanitizer's JSON report of the unsafe load "
                   "with triage=1, for ownsan triage (default: layerwise_reload_report.json in --dir, else here; "
                   "'' for none)")
    p.add_argument("--html", default=None, help="where to write the timeline page of that load "
                   "(default: layerwise_reload_timeline.html in --dir, else here; '' for none)")
    p.add_argument("--child", choices=("debug",), help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[Sequence[str]] = None, prog: str = "layerwise_reload") -> int:
    """``prog``: how its usage line names it (``ownsan demo`` from the CLI, the example's name from it)."""
    args = _parser(prog).parse_args(argv)
    if args.child:
        return child_main(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one intra-op thread is faster and steadier on a shared machine
    try:
        return _main(args)
    finally:
        torch.set_num_threads(threads)


def _default_path(given: Optional[str], directory: Optional[str], name: str) -> Optional[str]:
    """A flag's path: as given ('' for none), else ``name`` in ``directory`` (or here)."""
    if given is not None:
        return given or None
    return os.path.join(directory or os.getcwd(), name)


def _progress(line: str) -> None:
    """What the demo is doing, on stderr as it happens (the table on stdout comes when every run is done)."""
    print(line, file=sys.stderr, flush=True)


def _wrapped(lines: Sequence[str], width: int = 110) -> str:
    """Lines wrapped for a terminal, each continuation indented under its line."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent=" " * (len(line) - len(line.lstrip()) + 2),
                                    break_on_hyphens=False, break_long_words=False) for line in lines)


def _main(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; valid: {', '.join(CONFIGS)}")
    cfg = TinyConfig(hidden=args.hidden, intermediate=args.intermediate, dense_layers=args.dense_layers,
                     moe_layers=args.moe_layers, experts=args.experts, moe_intermediate=args.moe_intermediate)
    if args.dir:
        try:  # where its report and page go: made if missing, as an output directory is
            os.makedirs(args.dir, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"--dir {args.dir!r}: cannot make that directory ({exc.strerror or exc})") from None
    print("\n".join(textwrap.fill(paragraph, 110) for paragraph in INTRO.split("\n")) + "\n")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "tiny-moe.safetensors")
        info = write_checkpoint(path, cfg, args.order, args.seed)
        ring_bytes = args.ring_bytes or 2 * info["largest"]
        if ring_bytes < info["largest"]:
            raise SystemExit(f"--ring-bytes {ring_bytes} is smaller than the largest tensor ({info['largest']} bytes)")
        windows = deferral_windows(path, cfg)
        wider = sum(w > ring_bytes for w in windows.values())
        print(f"checkpoint: {_size(info['bytes'])} in {info['tensors']} tensors ({cfg.num_layers} layers, "
              f"{cfg.moe_layers} MoE with {cfg.experts} experts), order '{args.order}'")
        print(f"staging ring: {_size(ring_bytes)}; {wider} of {len(windows)} fused parameters have a deferral "
              f"window wider than the ring (largest {_size(max(windows.values(), default=0))})\n")
        # The debug child (mostly interpreter start-up) overlaps the in-process runs; its own time is its own.
        child = start_debug_subprocess(path, ring_bytes) if "debug" in configs else None
        _progress(f"running {len(configs)} configurations ({', '.join(LABELS[c] for c in configs)}): a warm-up, "
                  f"then {max(1, args.repeat)} rounds taken in turn" + ("; debug mode in a child process"
                                                                         if child is not None else "") + " ...")
        try:
            reference = reference_state(path)
            inproc = run_configs([c for c in configs if c != "debug"], path, ring_bytes, reference, args.repeat,
                                 progress=lambda line: _progress("  " + line))
        finally:
            debug = [finish_debug_subprocess(child)] if child is not None else []
        order = {c: i for i, c in enumerate(CONFIGS)}
        results = sorted(inproc + debug, key=lambda r: order[r.config])
        html = _default_path(args.html, args.dir, "layerwise_reload_timeline.html")
        report_path = _default_path(args.report, args.dir, "layerwise_reload_report.json")
        if html or report_path:
            _progress("the triage=1 run (its report and timeline page) ...")
        run = report_run(path, ring_bytes, html, report_path, reference) if html or report_path else None
    print(format_table(results))
    print(f"\ncopy-everything would copy {_size(info['bytes'])} (the whole checkpoint); "
          "peak extra memory = owned copies alive at once; load time = best of "
          f"{max(1, args.repeat)} after a warm-up")
    print("\n" + "\n".join(line if line.startswith("    ") else textwrap.fill(line, 110)
                            for line in fix_text(fix_site(results, run)).split("\n")))
    stopped = next((r for r in results if r.config == "debug" and r.report), None)
    if stopped is not None:
        print("\ndebug mode stopped at the first stale replay with the report below.")
        if stopped.guide:
            print(_wrapped(stopped.guide.split("\n")))
        print()
        print(stopped.report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"checkpoint": info, "ring_bytes": ring_bytes, "order": args.order,
                       "results": [asdict(r) for r in results],
                       "report_run": None if run is None else {
                           "summary": run.report["summary"]["line"], "corrupted": run.corrupted,
                           "nan_parameters": run.nan_parameters, "report": run.json, "html": run.html}},
                      fh, indent=2)
    if run is not None:
        print("\n" + _wrapped(run.lines()))
    problems = verdict(results)
    for p in problems:
        print(f"\nFAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
