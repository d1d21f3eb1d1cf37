"""One audit: files in, findings out. Discovery picks the weight-consuming functions of each module,
the flow walks each of them (with the module's summaries for its helper calls), suppression comments
and ``--select/--ignore`` filter what is left."""
from __future__ import annotations

import ast
import os
import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Collection, Dict, Iterable, List, Optional, Sequence, Tuple

from sanitizer.audit import suppression
from sanitizer.audit.discovery import MAPPING, NESTED, Seed, seed_value, seeds_of, uses_producer
from sanitizer.audit.findings import Finding, Link
from sanitizer.audit.flow import Flow
from sanitizer.audit.graph import node_spec
from sanitizer.audit.index import FunctionInfo, ModuleIndex, annotation_text, build_index
from sanitizer.audit.inference import calls_defined_producer, calls_typed_producer, handles_of, infer, infer_paths, may_define_producer
from sanitizer.audit.producers import InferredProducers
from sanitizer.audit.project import Project
from sanitizer.audit.selection import RuleSelection, parse_selectors, resolve
from sanitizer.audit.settings import Settings
from sanitizer.audit.sources import TOO_DEEP_TO_FOLLOW, AuditInputError, Source, parse, python_files, read
from sanitizer.audit.snippets import Snippets
from sanitizer.audit.stores import attribute_depth, store_target
from sanitizer.audit.summaries import ModuleAnalysis
from sanitizer.audit.vocabulary import LAZY_MAPPING_TYPE, MAPPING_OF_ANY, PRODUCER_HINT, lazy_mapping_class
from sanitizer.audit.values import ITER, TENSOR, Val


@dataclass(frozen=True)
class Consumer:
    """A weight-consuming function the audit looked at (flagged or not): for coverage and metrics."""

    path: str
    line: int
    function: str
    why: str


def internal_error(exc: BaseException) -> str:
    """The reason a function was not followed when the audit itself failed on it (a bug to report)."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        where = f" at {os.path.basename(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
    return (f"the audit failed on it ({type(exc).__name__}: {exc}{where}; a bug of ownsan audit, please report "
            f"it with this line)")


@dataclass(frozen=True)
class Skipped:
    """A function the audit could not follow to its end (nested deeper than Python's recursion limit lets
    its walk go: statements a hundred levels deep through helpers that are as deep), or, failing that, a
    whole file. Its findings are missing, so the audit is incomplete: named with the reason, the rest
    audited, and the exit status is 2, as for a file that does not parse."""

    path: str
    reason: str
    line: int = 0  # the function's line (0: the whole file)
    function: str = ""

    def __str__(self) -> str:
        if not self.function:
            return f"{self.path}: {self.reason}"
        return f"{self.path}:{self.line}: `{self.function}` {self.reason}; its findings are missing"


@dataclass
class AuditResult:
    findings: List[Finding] = field(default_factory=list)
    consumers: List[Consumer] = field(default_factory=list)
    files: int = 0
    lines: int = 0
    errors: List[str] = field(default_factory=list)  # files that could not be read or parsed
    suppressed: int = 0
    paths: List[str] = field(default_factory=list)  # every file audited
    skipped: List[Skipped] = field(default_factory=list)  # functions (or files) too deep to follow, with the reason


def _inherited(info: FunctionInfo, seeds_by_fn: Dict[int, List[Seed]]) -> List[Seed]:
    """Seeds of enclosing functions that a nested function reads as free variables (a generator closure
    over the outer ``weights``: ``def weight_filter(): for name, w in weights: ...``)."""
    out: List[Seed] = []
    parent = info.parent
    reads: Optional[set] = None
    while parent is not None:
        for seed in seeds_by_fn.get(id(parent), ()):
            if seed.param in info.locals or any(s.param == seed.param for s in out):
                continue
            if reads is None:
                reads = {n.id for n in ast.walk(info.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            if seed.param in reads:
                out.append(Seed(seed.param, seed.kind, f"{seed.why}, of enclosing `{parent.qualname}`",
                                seed.consumer or parent.qualname))
        parent = parent.parent
    return out


def _binds_lazy_mapping(info: FunctionInfo, mappings: Collection[str] = ()) -> bool:
    """Does ``info`` bind a local annotated ``Mapping[str, Tensor]`` (a lazy mapping of weights when a class
    of the project reads a loader in its ``__getitem__``: see Flow._lazy_mapping), or take a parameter
    annotated with such a class (``disk_map: DiskMap``: see Flow._lazy_mapping_params)?"""
    if mappings and any(lazy_mapping_class(annotation_text(a.annotation), mappings)
                        for a in info.params if a.annotation is not None):
        return True
    return any(isinstance(sub, ast.AnnAssign) and sub.value is not None and isinstance(sub.target, ast.Name)
               and LAZY_MAPPING_TYPE.match(annotation_text(sub.annotation)) for sub in ast.walk(info.node))


_GRAPH_SEED = {"dict": NESTED, "holder": NESTED, "tensor": TENSOR}


def _graph_inputs(info: FunctionInfo, inferred: InferredProducers, seeds: List[Seed]) -> List[Seed]:
    """The parameters of a ComfyUI node's method that the graph hands another node's loaded tensors (an input
    declared of a type whose producing node returns them: Inspire-Pack's ``ApplyLBW.doit(..., lbw_model)``)."""
    spec = node_spec(info.cls.node)  # type: ignore[union-attr]
    if spec is None or spec.function != info.name:
        return []
    have = {s.param for s in seeds}
    names = {a.arg for a in info.params}
    out = []
    for param, type_name in spec.inputs.items():
        got = inferred.graph_outputs.get(type_name)
        if got is None or param in have or param not in names:
            continue
        kind, producer = got
        out.append(Seed(param, _GRAPH_SEED[kind], f"a ComfyUI input of type {type_name}, the output of "
                                                  f"`{producer.qualname}` ({producer.path}:{producer.line})"))
    return out


def analyse(source: Source, project: Optional[Project] = None, settings: Optional[Settings] = None,
            skipped: Optional[List[Skipped]] = None, only_kept: bool = False) -> Tuple[List[Finding], List[Consumer]]:
    """Every finding in one parsed module (before suppression and selection), and its consumers. A
    function whose walk overflows the recursion limit is put in ``skipped`` when it is given, and the
    module's other functions are still walked (without it, the RecursionError is raised). ``only_kept``: only
    the second pass, over the methods that read what their class keeps on ``self`` and was not read yet (a store
    noted after this module's own analysis, by a later module's walk through its constructor)."""
    index = build_index(source.path, source.tree, source.text)
    snippets = Snippets(source.text)
    analysis = ModuleAnalysis(source.path, index, snippets, project, settings)
    inferred = settings.inferred if settings is not None else None
    producers = bool(PRODUCER_HINT.search(source.text)) or bool(
        settings is not None and any(p.rpartition(".")[2].strip("*") in source.text for p in settings.producers))
    handles = None
    if may_define_producer(source.text, inferred or InferredProducers()):
        producers = True
        handles = analysis.handles = handles_of(index, settings)
    roots = []
    seeds_by_fn: Dict[int, List[Seed]] = {}
    for info in index.functions:
        seeds = _without_settings_dicts(info, seeds_of(info, settings), analysis)
        if inferred is not None and inferred.graph_outputs and info.cls is not None:
            seeds = seeds + _graph_inputs(info, inferred, seeds)
        if info.parent is not None:
            seeds = seeds + _inherited(info, seeds_by_fn)
        seeds_by_fn[id(info)] = seeds
        if seeds or (producers and (uses_producer(info, settings) or (handles is not None and handles.reads(info))
                                    or (inferred is not None and calls_typed_producer(info, inferred))
                                    or (inferred is not None and calls_defined_producer(info, index, inferred))
                                    or (inferred is not None and inferred.passed_into(source.path, info.qualname))
                                    or (inferred is not None and inferred.mappings
                                        and _binds_lazy_mapping(info, inferred.mappings)))):
            roots.append((0 if any(s.kind == ITER for s in seeds) else 1, info, seeds))
    roots.sort(key=lambda r: r[0])  # iterator consumers first: their chains are the informative ones
    found: Dict[Tuple[str, int, int, str], Finding] = {}
    consumers: List[Consumer] = []
    if not only_kept:
        _walk_roots(source, index, snippets, analysis, settings, handles, roots, found, consumers, skipped)
    done = project.self_kept_read.setdefault(_key(source.path), set()) if project is not None else set()
    kept = {cls: {a: got for a, got in attrs.items() if (cls, a) not in done}
            for cls, attrs in analysis.self_kept.items() if cls in _classes(index)}
    kept = {cls: attrs for cls, attrs in kept.items() if attrs}
    done.update((cls, a) for cls, attrs in kept.items() for a in attrs)
    if kept:  # the class's other methods, reading what one of them was found keeping on `self` (a second pass)
        again = [(1, info, seeds_by_fn[id(info)]) for info in index.functions
                 if _reads_kept(info, _kept_of(info, kept, index))]
        _walk_roots(source, index, snippets, analysis, settings, handles, again, found, consumers, skipped, kept)
    consumers.sort(key=lambda c: c.line)
    return sorted(found.values(), key=lambda f: (f.line, f.col, f.code)), consumers


def _kept_of(info: FunctionInfo, kept: Dict[str, Dict[str, Tuple[Val, int, str]]],
             index: ModuleIndex) -> Dict[str, Tuple[Val, int, str]]:
    """The attributes of ``info``'s class (or of its bases of this module) that a method was found keeping a
    borrowed value in."""
    cls = info.enclosing_class
    out: Dict[str, Tuple[Val, int, str]] = {}
    seen = 0
    while cls is not None and seen < 8:
        for attr, got in kept.get(cls.qualname, {}).items():
            out.setdefault(attr, got)
        base = next((index.classes.get(b.rpartition(".")[2]) for b in cls.bases
                     if index.classes.get(b.rpartition(".")[2]) is not None), None)
        cls, seen = (base if base is not cls else None), seen + 1
    return out


def _reads_kept(info: FunctionInfo, attrs: Dict[str, Tuple[Val, int, str]]) -> bool:
    """Does ``info`` read ``self.<attr>`` for one of ``attrs`` (and is it not the method that kept it)?"""
    if not attrs or not info.params:
        return False
    me = info.params[0].arg
    return any(isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and type(n.value) is ast.Name
               and n.value.id == me and n.attr in attrs and attrs[n.attr][2] != info.qualname
               for n in ast.walk(info.node))


def _walk_roots(source: Source, index: ModuleIndex, snippets: Snippets, analysis: ModuleAnalysis,
                settings: Optional[Settings], handles, roots, found: Dict[Tuple[str, int, int, str], Finding],
                consumers: List[Consumer], skipped: Optional[List[Skipped]],
                reading: Optional[Dict[str, Dict[str, Tuple[Val, int, str]]]] = None) -> None:
    """Walk each root function, merging its findings into ``found`` (the walks note, in ``analysis.self_kept``,
    the attributes of ``self`` the methods store a borrowed value in); with ``reading``, read those attributes as
    that value (``self.weights`` in ``to_train`` after ``__init__``'s ``self.weights = weights``: what the
    method puts in a new holder, a module's parameter, another object, is kept anew; put on ``self`` again,
    it keeps nothing new)."""
    for _, info, seeds in roots:
        attrs = _kept_of(info, reading, index) if reading is not None else {}
        if reading is None or not any(c.function == info.qualname for c in consumers):
            why = "; ".join(s.why for s in seeds) or ("calls a known producer" if reading is None else
                                                      "reads what its class keeps on `self`")
            consumers.append(Consumer(source.path, info.node.lineno, info.qualname, why))  # type: ignore[attr-defined]
        flow = Flow(source.path, info, {s.param: seed_value(info, s) for s in seeds}, index.globals, snippets,
                    analysis.resolve, module_aliases=index.module_aliases, producer_kind=analysis.producer_kind,
                    hands_on=settings is not None and settings.names_producer(info.name, info.qualname))
        if handles is not None:
            flow.attribute_source = handles.value  # `self.f.get_tensor(n)` with `self.f = safe_open(...)`
        if attrs:
            flow.attribute_source = _kept_reader(attrs, flow.attribute_source)
        try:
            outcome = flow.run()
        except RecursionError:
            if skipped is None:
                raise
            skipped.append(Skipped(source.path, TOO_DEEP_TO_FOLLOW, info.node.lineno, info.qualname))  # type: ignore
            continue
        except Exception as exc:  # a bug of the audit's own on code it did not expect: named, never a traceback
            if skipped is None:
                raise
            skipped.append(Skipped(source.path, internal_error(exc), info.node.lineno, info.qualname))  # type: ignore
            continue
        for finding in outcome.findings:
            if reading is not None and not _kept_anew(finding, info):
                continue
            if finding.key in found:
                found[finding.key].merge(finding)
            else:
                found[finding.key] = finding


def _kept_anew(finding: Finding, info: FunctionInfo) -> bool:
    """In the second pass, what a method does with a value its class keeps on ``self`` is a new keep only where
    it puts it in another holder: an object a constructor or helper builds or fills (credited there: ComfyUI's
    adapters' ``to_train()`` into ``LohaDiff.__init__``'s ``nn.Parameter``s), or an attribute of another object
    held by ``self`` (``self.model.w = self.weights[k]``). Handed to the caller's ``destination`` dict, written
    into in place, or re-filed on ``self``, it is the same hold, already reported where it began (LightX2V's
    weight templates' ``state_dict``/``load_state_dict``, a web UI's re-sorted embeddings)."""
    if not any(" (kept at line " in link.text for link in finding.chain):
        return False
    if finding.function != info.qualname:
        return True
    if finding.code not in ("OWN102", "OWN107"):
        return False
    me = info.params[0].arg if info.params else None
    for stmt in ast.walk(info.node):
        if isinstance(stmt, ast.stmt) and getattr(stmt, "lineno", 0) == finding.line \
                and isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            root, depth = attribute_depth(store_target(stmt))
            return type(root) is ast.Name and root.id == me and depth >= 2
    return False


def _key(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _classes(index: ModuleIndex) -> set:
    return {c.qualname for c in index.all_classes}


def _kept_reader(attrs: Dict[str, Tuple[Val, int, str]], other):
    """The flow's hook for ``self.<attr>``: what another method kept there, else ``other``'s answer."""
    def value(flow, node: ast.Attribute) -> Optional[Val]:
        got = attrs.get(node.attr)
        if got is None or got[2] == flow.info.qualname:
            return other(flow, node) if other is not None else None
        val, line, method = got
        return val.then(link=Link(node.lineno, flow.fn, f"`self.{node.attr}` (kept at line {line} by `{method}`)"),
                        step=flow.func_step, self_kept=True, reported=False, maybe=False, consumer=flow.fn,
                        label=f"`self.{node.attr}`")
    return value


def _audit_one(source: Source, codes: set, result: AuditResult, project: Optional[Project] = None,
               settings: Optional[Settings] = None, only_kept: bool = False) -> None:
    skipped: List[Skipped] = []
    findings, consumers = analyse(source, project, settings, skipped, only_kept)
    if only_kept:
        consumers = []  # (counted by the module's own analysis)
    texts = dict(project.texts) if project is not None else {}
    texts[source.path] = source.text
    kept = suppression.apply(findings, texts)
    if settings is not None and settings.per_path_ignores:  # [tool.ownsan.per-file-ignores]
        kept = [f for f in kept if f.code not in settings.ignored_codes(f.path)]
    result.suppressed += len(findings) - len(kept)
    result.findings.extend(f for f in kept if f.code in codes)
    result.consumers.extend(consumers)
    result.skipped.extend(skipped)
    if only_kept:
        return
    result.files += 1
    result.paths.append(source.path)
    result.lines += source.text.count("\n") + (not source.text.endswith("\n") and bool(source.text))


def reported_codes(select: Optional[Sequence[str]] = None, ignore: Optional[Sequence[str]] = None,
                   settings: Optional[Settings] = None, extend_select: Sequence[str] = ()) -> set:
    """The codes reported: the settings' selection, then the command line's (``select``, ``extend_select``,
    ``ignore``: selectors, comma-separated), resolved as ruff resolves them. A selector that names no code
    raises :class:`sanitizer.audit.codes.CodeSelectionError`."""
    cli = RuleSelection(parse_selectors(select, "--select") if select else None,
                        parse_selectors(extend_select, "--extend-select"), parse_selectors(ignore or (), "--ignore"))
    return set(resolve([settings.selection, cli] if settings is not None else [cli]))


_STATE_PROTOCOL = frozenset({"load_state_dict", "set_state_dict", "load_state", "set_state"})


def _without_settings_dicts(info: FunctionInfo, seeds: List[Seed], analysis: ModuleAnalysis) -> List[Seed]:
    """``seeds`` less the dict a plain object's state-restoring method is handed, unless its annotation says it
    holds tensors. torch's checkpoint protocol (``torch.distributed.checkpoint.stateful.Stateful``:
    "load_state_dict(state_dict): Restore the object's state from the provided state_dict") is written by LR
    schedulers, samplers and trainers' own objects (gpt-neox's ``AnnealingLR(object)`` reads
    ``sd["start_lr"]``; timm's ``PlateauLRScheduler(Scheduler)``, ``Scheduler(ABC)`` in another file, reads
    ``state_dict['best']``): their dict carries settings. A module's ``load_state_dict`` is on a class that
    derives from ``nn.Module`` (or from a base the audit cannot read), never a plain one."""
    if not seeds or info.name not in _STATE_PROTOCOL or info.cls_ref is None:
        return seeds
    cls = info.cls_ref()
    if cls is None or not analysis.is_plain_class(cls):
        return seeds
    untyped = {a.arg for a in info.params
               if not a.annotation or MAPPING_OF_ANY.match(annotation_text(a.annotation))}
    return [s for s in seeds if not (s.kind == MAPPING and s.param in untyped)]


def audit_sources(sources: Iterable[Source], select: Optional[Sequence[str]] = None,
                  ignore: Optional[Sequence[str]] = None, settings: Optional[Settings] = None,
                  extend_select: Sequence[str] = ()) -> AuditResult:
    codes = reported_codes(select, ignore, settings, extend_select)
    result = AuditResult()
    sources = list(sources)
    settings = infer(sources, settings)  # producers inferred over these modules (:mod:`.producers`)
    for source in sources:
        try:
            _audit_one(source, codes, result, settings=settings)
        except RecursionError:  # a safety net: outside any one function's walk
            result.skipped.append(Skipped(source.path, TOO_DEEP_TO_FOLLOW))
    return result


def audit_paths(paths: Sequence[str], select: Optional[Sequence[str]] = None,
                ignore: Optional[Sequence[str]] = None, settings: Optional[Settings] = None,
                extend_select: Sequence[str] = ()) -> AuditResult:
    """Audit files and directories (what the settings' ``exclude`` names is left out of a directory). A
    path that does not exist raises :class:`AuditInputError`; a file that cannot be read or parsed is
    named in ``errors``, a function too deep to follow in ``skipped``, and the rest are audited.

    One file at a time: parse, analyse, let the tree go (holding every tree of a large code base at
    once makes the garbage collector's full passes, and so parsing, several times slower)."""
    codes = reported_codes(select, ignore, settings, extend_select)
    files = python_files(paths, settings.exclusion() if settings is not None else None)
    with _collector_paused():
        settings = infer_paths(files, settings)  # producers inferred over the files (:mod:`.producers`)
        return _audit_files(files, codes, settings)


@contextmanager
def _collector_paused():
    """The cyclic garbage collector off while auditing (restored after). Each file's tree is hundreds of
    thousands of tracked nodes: the collector's passes over them cost as much as parsing (measured: the
    audit of a 37,000-line tree in 2.7 s with it, 1.6 s without). The audit makes almost no cycles, and
    each tree is freed by reference counting as soon as its file is done."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _audit_files(files: List[str], codes: set, settings: Optional[Settings] = None) -> AuditResult:
    result = AuditResult()
    project = Project(files)
    seen: Dict[Tuple[str, int, int, str], Finding] = {}
    for path in files:
        try:
            source = read(path)
        except AuditInputError as exc:
            result.errors.append(str(exc))
            continue
        before = len(result.findings)
        try:  # analyse() returns before _audit_one adds anything, so a skipped file leaves nothing behind
            _audit_one(source, codes, result, project, settings)
        except RecursionError:  # a safety net: outside any one function's walk (which analyse() catches)
            result.skipped.append(Skipped(path, TOO_DEEP_TO_FOLLOW))
            continue
        _merge_new(result, before, seen)
    # what a later module's walk found a class of an earlier one keeping on `self` (`Adapter(sd["w"])` in
    # loaders.py, `self.weights = weights` in adapters.py): that module's methods reading it, walked now
    for path in files:
        key = _key(path)
        pending = {(cls, a) for cls, attrs in project.self_kept.get(key, {}).items() for a in attrs}
        if not pending - project.self_kept_read.get(key, set()):
            continue
        try:
            source = read(path)
        except AuditInputError:
            continue
        before = len(result.findings)
        try:
            _audit_one(source, codes, result, project, settings, only_kept=True)
        except RecursionError:
            result.skipped.append(Skipped(path, TOO_DEEP_TO_FOLLOW))
            continue
        _merge_new(result, before, seen)
    project.close()
    return result


def _merge_new(result: AuditResult, before: int, seen: Dict[Tuple[str, int, int, str], Finding]) -> None:
    """Findings added since ``before`` that an earlier module already reported (a helper's statement, found
    from callers in two modules) merged into that one."""
    fresh = []
    for f in result.findings[before:]:
        if f.key in seen:
            seen[f.key].merge(f)
        else:
            seen[f.key] = f
            fresh.append(f)
    del result.findings[before:]
    result.findings.extend(fresh)


def audit_text(text: str, path: str = "<string>", select: Optional[Sequence[str]] = None,
               ignore: Optional[Sequence[str]] = None, settings: Optional[Settings] = None,
               extend_select: Sequence[str] = ()) -> AuditResult:
    """Audit one module given as text (tests, editors)."""
    return audit_sources([parse(path, text)], select, ignore, settings, extend_select)


__all__ = ["AuditResult", "Consumer", "Skipped", "analyse", "audit_sources", "audit_paths", "audit_text",
           "reported_codes"]
