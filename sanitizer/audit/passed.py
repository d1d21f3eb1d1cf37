"""Producers passed as callables: ``_merge_checkpoint_shards(dir, names, _load_safetensors_file, ...)``
hands a loader function to a helper that calls it under its own parameter's name (``shard_state =
shard_loader(shard_path)``, NeMo-RL's draft checkpoint loader). Nothing at the helper's call says what
``shard_loader`` is; its callers do. So each call that passes a producer (an inferred one, or a loader API
such as safetensors' ``load_file``) by name as an argument to a function of the same module records that
the callee's parameter is that producer, and the flow reads a call of the parameter as a call of it.

Only callees this module defines are followed (a module-level function, or a method of the caller's own
class through ``self``/``cls``), and only parameters the callee calls: a function that merely stores or
forwards a callable is not a caller of it. A parameter passed a producer at one call site and something
else at another is a producer where the producer was passed, which the audit cannot tell apart from here:
it is judged as one (the retention is real on that path)."""
from __future__ import annotations

import ast
import re
from typing import Callable, Dict, List, Optional, Tuple

from sanitizer.audit import vocabulary as V
from sanitizer.audit.index import FunctionInfo, ModuleIndex, dotted
from sanitizer.audit.producers import InferredProducers, Produced

_KINDS = ("tensor", "dict", "holder", "iterator", "dicts")


def _hint(table: InferredProducers) -> "re.Pattern[str]":
    """A name of a producer written as an argument (after ``(``, ``,`` or ``=``, before ``,`` or ``)``): the
    cheap pre-check before a module's calls are looked at."""
    names = sorted(set(table.by_name) | {"load_file", "load"})
    return re.compile(r"[(,=]\s*(?:[\w.]*\.)?(?:" + "|".join(map(re.escape, names)) + r")\s*[,)]")


def _kind(arg: ast.AST, index: ModuleIndex, producer_kind: Callable[[str], Optional[str]]) -> Optional[Produced]:
    """The producer an argument names, or None: an inferred producer by its name, or a loader API by the
    name its import gives it (``from safetensors.torch import load_file``: ``load_file``)."""
    if not isinstance(arg, (ast.Name, ast.Attribute)):
        return None
    name = dotted(arg)
    if not name:
        return None
    first = name.partition(".")[0]
    imported = index.imports.get(first)
    qualified = f"{imported[0]}.{imported[2]}{name[len(first):]}" if imported is not None and imported[0] else name
    if (qualified.startswith("safetensors.") or qualified == "torch.load") and V.loader_call_kind(qualified, None):
        return Produced("dict", origin=f"`{qualified}`")  # (torch.load passed bare: no mmap=True, not a loader)
    if name in index.top_functions or name.partition(".")[0] in ("self", "cls") or imported is not None:
        got = producer_kind(name)
        if got is not None and str(got) in _KINDS:
            return got if isinstance(got, Produced) else Produced(str(got))
    return None


def _callee(call: ast.Call, caller: FunctionInfo, index: ModuleIndex) -> Optional[Tuple[FunctionInfo, int]]:
    """The definition a call resolves to in this module, and how many of its leading parameters the call
    does not pass (1 for a method called through ``self``)."""
    func = call.func
    if isinstance(func, ast.Name):
        found = index.top_functions.get(func.id)
        return (found, 0) if found is not None else None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
        cls = caller.enclosing_class
        method = cls.methods.get(func.attr) if cls is not None else None
        if method is not None and not method.is_static:
            return method, 1
    return None


def record_passed(table: InferredProducers, index: ModuleIndex, path: str, text: str,
                  producer_kind: Callable[[str], Optional[str]]) -> bool:
    """Record every parameter of this module's functions that a caller here passes a producer as (True when
    something is new or changed)."""
    if not _hint(table).search(text):
        return False
    changed = False
    for caller in index.functions:
        for call in ast.walk(caller.node):
            if not isinstance(call, ast.Call) or not (call.args or call.keywords):
                continue
            passed: List[Tuple[Optional[int], Optional[str], ast.AST]] = [(i, None, a) for i, a in enumerate(call.args)]
            passed += [(None, kw.arg, kw.value) for kw in call.keywords if kw.arg]
            kinds = [(i, kw, k) for i, kw, a in passed for k in (_kind(a, index, producer_kind),) if k is not None]
            if not kinds:
                continue
            resolved = _callee(call, caller, index)
            if resolved is None:
                continue
            callee, skip = resolved
            params = [a.arg for a in callee.params][skip:]
            called = set(callee.calls)
            for position, keyword, kind in kinds:
                param = keyword if keyword is not None else (params[position] if position < len(params) else None)
                if param is None or param not in called or param not in params:
                    continue
                slot: Dict[str, Produced] = table.passed.setdefault((path, callee.qualname), {})
                old = slot.get(param)
                if old is None or (str(old), old.origin) != (str(kind), kind.origin):
                    slot[param] = kind
                    changed = True
    return changed


__all__ = ["record_passed"]
