"""The pass that infers producers (:mod:`.producers`) over the files of one audit, before the audit itself:
round after round, the functions that call a producer are walked with nothing seeded, and what they return
from one makes them producers, until nothing changes. Kept apart from the audit's own walk so that the
audit reads each file once more only where a loader's API (or an inferred producer) is named in it."""
from __future__ import annotations

import ast
import re
from dataclasses import replace
from typing import Dict, Optional, Sequence

from sanitizer.audit import vocabulary as V
from sanitizer.audit.flow import Flow
from sanitizer.audit.graph import node_spec
from sanitizer.audit.index import annotation_text, build_index
from sanitizer.audit.passed import record_passed
from sanitizer.audit.producers import (MAX_ROUNDS, InferredProducers, SelfSources, candidate, record,
                                       record_definition, record_iterable, record_mapping, record_method)
from sanitizer.audit.project import Project
from sanitizer.audit.settings import Settings
from sanitizer.audit.snippets import Snippets
from sanitizer.audit.targets import attribute_classes
from sanitizer.audit.sources import AuditInputError, Source, read


def may_define_producer(text: str, table: InferredProducers, declared: Optional["re.Pattern[str]"] = None) -> bool:
    """Might the module define a producer: does it name a loader API, a producer inferred so far, or (with
    ``declared``, :func:`declared_hint`) a configured getter?"""
    return V.names_loader_api(text) or table.mentioned_in(text) or bool(
        declared is not None and declared.search(text))


def declared_hint(settings: Optional[Settings]) -> Optional["re.Pattern[str]"]:
    """A call to one of the ``=tensor`` getters of ``[tool.ownsan] producers`` (by its last dotted part, a
    glob's ``*`` any name): a module that makes one is walked for inference as one naming a loader API is,
    so that a helper returning the getter's tensor (converted, or in a dict it fills) is inferred, and a
    declared helper's own definition refines its declared kind (:meth:`Settings.producer_kind`)."""
    if settings is None or not settings.producers:
        return None
    names = sorted({re.escape(p.rpartition(".")[2]).replace(r"\*", r"\w*").replace(r"\?", r"\w")
                    for p, k in zip(settings.producers, settings.producer_kinds) if k == "tensor"})
    names = [n for n in names if n.strip(r"\w*")]
    return re.compile(r"\b(?:" + "|".join(names) + r")\s*\(") if names else None


def handles_of(index, settings: Optional[Settings]) -> Optional[SelfSources]:  # type: ignore[no-untyped-def]
    """The module's getter objects on ``self`` (None when it keeps none)."""
    inferred = settings.inferred if settings is not None else None

    def is_source(name: str) -> bool:
        if V.SOURCE_FACTORIES.search(name):
            return True
        if inferred is None:
            return False
        if inferred.kind_of(name) == "source":
            return True
        # `TensorLoader.get(path)`: a factory called on its class (a classmethod or staticmethod), matched by
        # class and method, since its name (`get`, `open`) is too common to be matched alone
        receiver, _, meth = name.rpartition(".")
        return bool(receiver) and inferred.kind_of_method(receiver.rpartition(".")[2], meth) == "source"

    found = SelfSources(index, is_source, inferred.mappings if inferred is not None else None)
    return found if found else None


def calls_producer(name: str, settings: Settings) -> bool:
    return bool(V.SOURCE_FACTORIES.search(name) or V.ITERATOR_FACTORY.search(name) or name == "torch.load"
                or V.loader_call_kind(name, None) or settings.is_producer(name)
                or ("." in name and name.rpartition(".")[2] in V.LIBRARY_DICT_METHODS))


def calls_defined_producer(info, index, table: InferredProducers) -> bool:  # type: ignore[no-untyped-def]
    """Does ``info`` call a module-level function inferred a producer under a generic name (``model_checkpoint =
    load(path)`` with ``def load(filename)`` above it, or imported: ``from helpers import load``, ``helpers.load``),
    or an inferred producer under an import alias (``from .helpers import read_shard as rs``)?"""
    generic = {p.name for p in table.by_definition.values()}
    for name in info.calls:
        defined = index.top_functions.get(name)
        if defined is not None and (index.path, defined.node.lineno) in table.by_definition:
            return True
        imported = index.imports.get(name)
        if imported is not None and (imported[2] in generic or (imported[2] != name and imported[2] in table.by_name)):
            return True  # `from helpers import load`, `from .helpers import read_shard as rs`
        receiver, _, last = name.rpartition(".")
        if receiver and last in generic and (receiver in index.imports or receiver in index.module_aliases):
            return True  # `helpers.load(p)`
    return hands_a_producer_over(info, table)


_HANDED_TO = V.MAPPERS | V.SUBMITTERS | {"starmap"}


def hands_a_producer_over(info, table: InferredProducers) -> bool:  # type: ignore[no-untyped-def]
    """Does ``info`` hand an inferred producer to an executor or a mapper (``executor.submit(_load_shard, path)``,
    ``pool.map(read_shard, paths)``) rather than call it? The future's ``.result()`` (or the mapper's items)
    hand out what the producer returns, so the function is walked as a caller of it (MAGI-1's parallel shard
    loader). Only a function whose calls include such a method is looked into."""
    if not table.by_name or not any(c.rpartition(".")[2] in _HANDED_TO for c in info.calls):
        return False
    for sub in ast.walk(info.node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in _HANDED_TO \
                and sub.args and isinstance(sub.args[0], (ast.Name, ast.Attribute)):
            handed = sub.args[0].id if isinstance(sub.args[0], ast.Name) else sub.args[0].attr
            if handed in table.by_name:
                return True
    return False


def calls_typed_producer(info, table: InferredProducers) -> bool:  # type: ignore[no-untyped-def]
    """Does ``info`` call a method inferred a producer on a parameter annotated with its class
    (``checkpoint_loader.load(key)``, ``checkpoint_loader: HFCheckpointLoader``)?"""
    if not table.by_method:
        return False
    cls = info.enclosing_class
    if cls is not None and info.is_method and info.params:  # `self.get("emb")` of the class's own producer
        me = info.params[0].arg
        owners = [cls.qualname.rpartition(".")[2]] + [b.rpartition(".")[2] for b in cls.bases]
        for call in info.calls:
            receiver, _, meth = call.rpartition(".")
            if receiver == me and any(f"{o}.{meth}" in table.by_method for o in owners):
                return True
    typed = {}
    for arg in info.params:
        if arg.annotation is not None:
            typed[arg.arg] = [c.rpartition(".")[2] for c in V.ANNOTATED_CLASS.findall(annotation_text(arg.annotation))]
    methods = {key.rpartition(".")[2] for key in table.by_method}
    for call in info.calls:
        receiver, _, meth = call.rpartition(".")
        if receiver in typed and any(f"{c}.{meth}" in table.by_method for c in typed[receiver]):
            return True
        if meth in methods and (receiver in typed or cls is not None and info.is_method and info.params and (
                receiver.partition(".")[0] == info.params[0].arg and receiver.count(".") == 1
                and attribute_classes(cls, receiver.partition(".")[2]))):
            # a typed receiver (a parameter, or `self.<attr>` typed where it is stored) whose class may be an
            # abstract base of the producer's class: walked, and resolved by the flow (Flow._method_of_classes)
            return True
    return False


def infer(sources: Sequence[Source], settings: Optional[Settings] = None,
          project: Optional[Project] = None) -> Settings:
    """``settings`` (or the defaults) with the producers inferred over ``sources``."""
    from sanitizer.audit.summaries import ModuleAnalysis  # (summaries imports the flow: no cycle at import)

    table = InferredProducers()
    now = replace(settings if settings is not None else Settings(), inferred=table, _producer_res=None)
    declared = declared_hint(settings)
    for _ in range(MAX_ROUNDS):
        changed = False
        for source in sources:
            if not may_define_producer(source.text, table, declared):
                continue
            index = build_index(source.path, source.tree, source.text)
            snippets = Snippets(source.text)
            analysis = ModuleAnalysis(source.path, index, snippets, project, now)
            handles = handles_of(index, now)
            analysis.handles = handles
            if record_passed(table, index, source.path, source.text, now.producer_kind):
                changed = True
            for info in index.functions:
                if not candidate(info, lambda c: calls_producer(c, now), handles or _NO_HANDLES) \
                        and not calls_typed_producer(info, table) and not calls_defined_producer(info, index, table) \
                        and not table.passed_into(source.path, info.qualname):
                    continue
                flow = Flow(source.path, info, {}, index.globals, snippets, analysis.resolve,
                            module_aliases=index.module_aliases, producer_kind=now.producer_kind)
                flow.infer = True
                flow.attribute_source = handles.value if handles is not None else None
                try:
                    out = flow.run()
                except Exception:  # (RecursionError, or a bug of the audit's own: the audit's walk of the
                    continue  # same function names it as skipped, with its reason; no producer from it)
                generator = info.is_generator
                val = out.produced_yield if generator else out.produced
                if val is not None and info.name == "__getitem__" and not generator:
                    if record_mapping(table.mappings, info, source.path, val):
                        changed = True
                elif val is not None and info.name == "__iter__" and generator:
                    if record_iterable(table.by_name, info, source.path, val):
                        changed = True
                        table._mention = None
                elif val is not None:
                    if record(table.by_name, info, source.path, val, generator):
                        changed = True
                        table._mention = None
                    if record_definition(table.by_definition, info, source.path, val, generator):
                        changed = True
                        table._generic_mention = None
                    if record_method(table.by_method, info, source.path, val, generator):
                        changed = True
        if project is not None:
            project.close()  # summaries memoised under the last round's table
        if not changed:
            break
    if table.by_method:
        _graph_outputs(sources, table)
    return now


def _graph_outputs(sources: Sequence[Source], table: InferredProducers) -> None:
    """The ComfyUI node types whose nodes hand out a loader's tensors: a node class whose ``FUNCTION`` method
    was inferred a producer, each element of its returned tuple that holds them typed by ``RETURN_TYPES``."""
    for source in sources:
        if "RETURN_TYPES" not in source.text:
            continue
        for node in ast.walk(source.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            spec = node_spec(node)
            found = table.by_method.get(f"{node.name}.{spec.function}") if spec is not None else None
            if found is None or spec is None:
                continue
            kinds = found.parts if len(found.parts) == len(spec.returns) else ()
            for kind, type_name in zip(kinds, spec.returns):
                if kind in ("dict", "holder", "tensor"):
                    table.graph_outputs.setdefault(type_name, (kind, found))


def infer_paths(files: Sequence[str], settings: Optional[Settings] = None) -> Settings:
    """:func:`infer` over files: only those whose text names a loader API (or, in a later round, an
    inferred producer) are parsed; the others are read as text only."""
    texts: Dict[str, str] = {}
    for path in files:
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        texts[path] = raw.decode("utf-8", "replace")
    project = Project(files)
    parsed: Dict[str, Source] = {}
    table_probe = InferredProducers()
    result = replace(settings if settings is not None else Settings(), inferred=table_probe, _producer_res=None)
    declared = declared_hint(settings)
    # rounds grow the candidate set: parse what a round's table names, then infer over all parsed again
    for _ in range(MAX_ROUNDS):
        wanted = [p for p, t in texts.items() if p not in parsed and may_define_producer(t, table_probe, declared)]
        for path in wanted:
            try:
                parsed[path] = read(path)
            except AuditInputError:
                texts.pop(path, None)  # the audit names it
        if not wanted:
            break
        result = infer(list(parsed.values()), settings, project)
        table_probe = result.inferred  # type: ignore[assignment]
    project.close()
    return result


class _Empty:
    def reads(self, info) -> bool:  # type: ignore[no-untyped-def]
        return False


_NO_HANDLES = _Empty()

__all__ = ["infer", "infer_paths", "handles_of", "may_define_producer", "declared_hint", "calls_producer"]
