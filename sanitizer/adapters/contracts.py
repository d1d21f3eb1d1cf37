"""The loaders' lifetime contracts, per version, as read from their sources: one table for everything.

Each adapter declares its :class:`LoaderContracts` (the versions it knows, what it assumes outside
them, one :class:`Contract` row per borrowing entry point and version range, the versions CI tests);
its docstring carries the rendered table, ``docs/loaders.md`` carries every table and the engine
table (:data:`ENGINE_PATHS`), and ``tests/adapters/test_loader_docs.py`` checks that both are what
:func:`render_contracts` and :func:`render_engines` produce now, as the README's option table is
checked against ``core/options.py``. Standard library only: the docs are rendered without torch.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

Version = Tuple[int, int, int]


def parse_version(text: Optional[str]) -> Optional[Version]:
    """``"0.15.7"`` -> ``(0, 15, 7)``; ``"0.3"`` -> ``(0, 3, 0)``; a pre-release suffix is ignored; None if unreadable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not match:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


@dataclass(frozen=True)
class Contract:
    """One row: an entry point, the versions it holds for, when it borrows and until when."""

    versions: str  # as people write them: "0.2.x-0.4.x"
    entry: str  # the call(s) a consumer makes
    borrows: str  # under which arguments it yields borrowed memory ("never" for owning rows)
    valid_until: str  # when the memory is reused or freed
    checked: str  # what the sanitizer does about it


@dataclass(frozen=True)
class LoaderContracts:
    """A loader's contracts and the range of versions they were read from."""

    loader: str  # as people name it
    distribution: str  # the name pip knows
    low: str  # first known version (inclusive)
    high: str  # first version not known (exclusive)
    assumed: str  # what the adapter assumes outside [low, high)
    rows: Tuple[Contract, ...]
    matrix: Tuple[str, ...] = ()  # versions CI runs the adapter's tests against (.ci/loader_matrix.sh)

    @property
    def known(self) -> str:
        hi = parse_version(self.high)
        last = f"{hi[0]}.{hi[1] - 1}.x" if hi and hi[1] > 0 and hi[2] == 0 else f"below {self.high}"
        return f"{self.low} to {last}"

    def knows(self, version: Optional[str]) -> bool:
        v, lo, hi = parse_version(version), parse_version(self.low), parse_version(self.high)
        return v is not None and lo is not None and hi is not None and lo <= v < hi

    def warning(self, version: Optional[str]) -> Optional[str]:
        """One line for a version outside the known range (None inside it)."""
        if self.knows(version):
            return None
        what = f"{self.loader} {version}" if version else f"{self.loader} (version unknown)"
        return (f"ownership-sanitizer: {what} is outside the versions its adapter was read from "
                f"({self.known}); assuming {self.assumed}")


def installed_version(module: Any, distribution: str) -> Optional[str]:
    """The version of the copy of ``distribution`` that ``module`` was imported from.

    The distribution metadata next to the imported package wins over the first one on ``sys.path``,
    so a loader installed side by side into a folder (the CI version matrix) reports its own version.
    """
    wanted = re.sub(r"[-_.]+", "-", distribution).lower()
    top = sys.modules.get(getattr(module, "__name__", "").split(".")[0])
    location = getattr(top, "__file__", None) or getattr(module, "__file__", None)
    if location:
        site = os.path.dirname(os.path.dirname(os.path.abspath(location)))
        try:
            for dist in importlib.metadata.distributions(path=[site]):
                if re.sub(r"[-_.]+", "-", dist.metadata.get("Name", "")).lower() == wanted:
                    return dist.version
        except Exception:
            pass
    try:
        return importlib.metadata.version(distribution)
    except Exception:
        return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_contracts(contracts: LoaderContracts) -> str:
    """The markdown table of one loader (what each adapter's docstring and docs/loaders.md carry)."""
    lines = [f"{contracts.loader} ({contracts.distribution}), read from versions {contracts.known}; "
             f"outside them: {contracts.assumed}.",
             "",
             "| versions | entry point | borrows when | valid until | checked |",
             "| --- | --- | --- | --- | --- |"]
    for row in contracts.rows:
        lines.append("| " + " | ".join(_cell(c) for c in (row.versions, row.entry, row.borrows, row.valid_until,
                                                           row.checked)) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class EnginePath:
    """How an engine calls a loader, and what the sanitizer checks there, per loader version.

    ``outcomes`` maps a loader version (one of the matrix) to ``"caught"`` (a consumer that keeps every
    tensor is caught: borrowed memory) or ``"clean"`` (owned memory, or memory never reused: keeping it
    is correct, nothing is reported); ``tests/adapters/test_engines.py`` drives a loop of this shape under
    ``ownsan run`` and checks it.
    """

    key: str  # the test's name for the loop
    engine: str  # "vLLM 0.20.0 (b8160878f)"
    function: str  # "weight_utils.runai_safetensors_weights_iterator"
    loader: str
    calls: str  # what it calls
    outcomes: Tuple[Tuple[str, str], ...]
    note: str = ""


_VLLM_020 = "vLLM 0.20.0 (b8160878f)"
_VLLM_033 = "vLLM 0.33.0 (4ba787ec9)"
_SGLANG = "SGLang 0.5.23 (PyPI wheel)"

ENGINE_PATHS: Tuple[EnginePath, ...] = (
    EnginePath("vllm020_runai", _VLLM_020, "runai_safetensors_weights_iterator", "runai-model-streamer",
               "`SafetensorsStreamer().stream_files(files, device=, is_distributed=)`, `yield from get_tensors()`",
               (("0.15.7", "caught"), ("0.16.1", "caught"), ("0.17.1", "clean")),
               "0.15-0.16 always lend views of one reused buffer; 0.17 owns by default (`owned=True`)"),
    EnginePath("vllm033_runai", _VLLM_033, "runai_safetensors_weights_iterator", "runai-model-streamer",
               "as 0.20, then `yield name, tensor.clone()`",
               (("0.15.7", "clean"), ("0.17.1", "clean")),
               "the clone is taken within the view's lifetime: the engine never hands a borrowed view on"),
    EnginePath("vllm020_fst", _VLLM_020, "fastsafetensors_weights_iterator", "fastsafetensors",
               "`SafeTensorsFileLoader(pg, device, nogds=)`, `add_filenames`, `fb = copy_files_to_device()`, "
               "`fb.get_tensor(k)` per key, `fb.close()`, `loader.close()`",
               (("0.2.2", "caught"), ("0.4.0", "caught"), ("0.5.0", "clean")),
               "0.2-0.4: zero-copy views freed by `fb.close()`; 0.5 owns unless `borrowed_tensors=True`"),
    EnginePath("vllm033_fst", _VLLM_033, "fastsafetensors_weights_iterator", "fastsafetensors",
               "`ParallelLoader(pg, files, queue_size=, device=, nogds=).iterate_weights()`, `close()`",
               (("0.3.3", "clean"), ("0.5.0", "clean")),
               "ParallelLoader clones each tensor (0.3+) unless `borrowed_tensors=True` (0.5)"),
    EnginePath("sglang_runai", _SGLANG, "runai_safetensors_weights_iterator", "runai-model-streamer",
               "`stream_files(files, device=, is_distributed=)`, `get_tensors()`, marks each tensor "
               "`_sglang_runai_streamer_tensor`",
               (("0.15.7", "caught"), ("0.17.1", "clean")),
               "the marker attribute is dropped by views; the sanitizer tracks the storage"),
    EnginePath("sglang_fst", _SGLANG, "fastsafetensors_weights_iterator", "fastsafetensors",
               "`SafeTensorsFileLoader(pg, device, nogds=)`, `copy_files_to_device()`, `fb.get_tensor(k)`, "
               "`loader.close()` (never `fb.close()`)",
               (("0.2.2", "clean"), ("0.5.0", "clean")),
               "the file buffer is never closed, so in 0.2-0.4 it is never freed or reused (it leaks until exit): "
               "nothing goes stale"),
    EnginePath("instanttensor", "vLLM 0.20.0 / 0.33.0, SGLang 0.5.23", "instanttensor_weights_iterator",
               "InstantTensor", "`safe_open(files, framework='pt', device=, process_group=)` (vLLM 0.20), "
               "`copy=True` (vLLM 0.33, SGLang); `tensors()`",
               (("0.1.5", "caught"), ("0.2.2", "clean")),
               "CUDA only: checked against a CPU fake of each version's API (tests/adapters/test_adapters_instanttensor.py) "
               "and on a GPU by bench/device_check.sh; 0.1.5-0.1.8 have no `copy` and always lend ring views"),
)


def render_engines(paths: Sequence[EnginePath] = ENGINE_PATHS) -> str:
    """The table "your engine, your loader, your version -> what is checked"."""
    lines = ["| engine | function | loader | what it calls | loader version: checked | note |",
             "| --- | --- | --- | --- | --- | --- |"]
    verdict = {"caught": "borrowed: a retaining consumer is caught",
               "clean": "kept tensors stay valid: nothing reported"}
    for p in paths:
        outcome = "; ".join(f"{v}: {verdict[o]}" for v, o in p.outcomes)
        lines.append("| " + " | ".join(_cell(c) for c in (p.engine, f"`{p.function}`", p.loader, p.calls, outcome,
                                                           p.note)) + " |")
    return "\n".join(lines)


def render_engines_brief(paths: Sequence[EnginePath] = ENGINE_PATHS) -> str:
    """The README's short form of :func:`render_engines`: per engine path, the loader versions at which a
    retaining consumer is caught (the loader lends borrowed memory) and those where keeping is correct."""
    lines = ["| your engine | its weight iterator | your loader | borrowed: a retaining consumer is caught | "
             "owned (or never reused): nothing to report |", "| --- | --- | --- | --- | --- |"]
    for p in paths:
        caught = ", ".join(v for v, o in p.outcomes if o == "caught") or "-"
        clean = ", ".join(v for v, o in p.outcomes if o == "clean") or "-"
        lines.append("| " + " | ".join(_cell(c) for c in (p.engine.split(" (")[0], f"`{p.function}`", p.loader,
                                                           caught, clean)) + " |")
    return "\n".join(lines)


_BEGIN = "<!-- {name}: generated from sanitizer/adapters by `python -m sanitizer.adapters.contracts --sync` -->"
_END = "<!-- /{name} -->"


def doc_sections(contracts: Sequence[LoaderContracts]) -> dict:
    """The generated sections of docs/loaders.md: name -> text."""
    return {"engine-table": render_engines(),
            **{f"contracts-{c.distribution}": render_contracts(c) for c in contracts}}


def readme_sections() -> dict:
    """The generated section of README.md: the short engine table."""
    return {"engine-summary": render_engines_brief()}


def sync_text(text: str, sections: dict, required: bool = True) -> str:
    """``text`` with every generated section replaced by its current rendering (with ``required``, every
    section's markers must be present; else the sections whose markers are absent are skipped)."""
    for name, body in sections.items():
        begin, end = _BEGIN.format(name=name), _END.format(name=name)
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            if not required:
                continue
            raise ValueError(f"the document has no section '{name}' (expected the markers {begin!r} ... {end!r})")
        text = text[:i + len(begin)] + "\n" + body + "\n" + text[j:]
    return text


def all_contracts() -> Tuple[LoaderContracts, ...]:
    """Every adapter's contracts (imports the adapters: torch)."""
    import importlib

    names = ("fastsafetensors_adapter", "runai_adapter", "instanttensor_adapter", "safetensors_adapter")
    return tuple(importlib.import_module(f"sanitizer.adapters.{n}").CONTRACTS for n in names)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m sanitizer.adapters.contracts --sync [docs/loaders.md]``: rewrite the generated tables."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] != "--sync":
        print("usage: python -m sanitizer.adapters.contracts --sync [docs/loaders.md]", file=sys.stderr)
        return 2
    path = args[1] if len(args) > 1 else os.path.join("docs", "loaders.md")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    sections = {**doc_sections(all_contracts()), **readme_sections()}
    new = sync_text(text, sections, required=False)
    if new != text:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(new)
    print(f"{path}: {'updated' if new != text else 'up to date'}")
    return 0


__all__ = ["Contract", "LoaderContracts", "EnginePath", "ENGINE_PATHS", "parse_version", "installed_version",
           "render_contracts", "render_engines", "render_engines_brief", "doc_sections", "readme_sections",
           "sync_text", "all_contracts"]


if __name__ == "__main__":
    sys.exit(main())
