"""ComfyUI's node graph, read from the node classes' declarations: what one node hands another with no call between.

A ComfyUI node is a class whose ``FUNCTION`` names the method the graph runs, whose ``RETURN_TYPES`` names the
type of each element of the tuple that method returns, and whose ``INPUT_TYPES`` classmethod returns the inputs
the method takes, each by parameter name with its type (ComfyUI's documentation, "Custom nodes: properties":
"INPUT_TYPES ... a dictionary with keys required, optional ... each value a tuple whose first element is the
type"; "RETURN_TYPES: a tuple of the types of the outputs"; "FUNCTION: the name of the entry-point method").
The graph links an output of one node to an input of the same type of another: a node whose method returns a
file's tensors in an output of a type of its own (``LBW_MODEL``, Inspire-Pack's ``MakeLBW``) hands them to every
node that takes that type (``ApplyLBW.doit(..., lbw_model)``), which then holds them as its caller's step's.

Only declarations written as literals are read (a tuple of strings, a dict of tuples): the graph of a pack that
builds them at run time is not seen.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

_SECTIONS = ("required", "optional")


@dataclass(frozen=True)
class NodeSpec:
    """One node class: the method the graph runs, its outputs' types, its inputs' types by parameter."""

    name: str
    function: str
    returns: Tuple[str, ...]
    inputs: Dict[str, str] = field(default_factory=dict)


def node_spec(cls: ast.ClassDef) -> Optional[NodeSpec]:
    """The node ``cls`` declares, or None when it declares no ``FUNCTION`` and ``RETURN_TYPES`` as literals."""
    function: Optional[str] = None
    returns: Optional[Tuple[str, ...]] = None
    inputs: Dict[str, str] = {}
    for stmt in cls.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, value = stmt.targets[0].id, stmt.value
            if name == "FUNCTION" and isinstance(value, ast.Constant) and isinstance(value.value, str):
                function = value.value
            elif name == "RETURN_TYPES" and isinstance(value, (ast.Tuple, ast.List)):
                types = [e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                returns = tuple(types) if len(types) == len(value.elts) else None
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == "INPUT_TYPES":
            for ret in ast.walk(stmt):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                    inputs.update(_declared_inputs(ret.value))
    if function is None or returns is None:
        return None
    return NodeSpec(cls.name, function, returns, inputs)


def _declared_inputs(spec: ast.Dict) -> Dict[str, str]:
    """``{"required": {"lbw_model": ("LBW_MODEL",), ...}, "optional": {...}}``: parameter -> type."""
    out: Dict[str, str] = {}
    for key, section in zip(spec.keys, spec.values):
        if not (isinstance(key, ast.Constant) and key.value in _SECTIONS and isinstance(section, ast.Dict)):
            continue
        for name, decl in zip(section.keys, section.values):
            if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                continue
            if isinstance(decl, (ast.Tuple, ast.List)) and decl.elts and isinstance(decl.elts[0], ast.Constant) \
                    and isinstance(decl.elts[0].value, str):
                out[name.value] = decl.elts[0].value  # (a list of choices, a combo input, is no type)
    return out


__all__ = ["NodeSpec", "node_spec"]
