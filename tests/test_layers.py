"""Layering contract for the ``sanitizer`` package (issue 9).

Every module under ``sanitizer/`` belongs to a layer; a module may import only
sanitizer modules of its own layer or a lower one, and sanitizer modules must not
import each other in a cycle.  ``core`` stays free of torch, numpy and numba.
The package face (``sanitizer/__init__.py``, a lazy map of names) and
``sanitizer/__main__.py`` are exempt; ``sanitizer/activation.py`` composes the
features onto the runtime and sits at the face's layer, so only ``testing`` and
``tools`` (above it) may use the face.  ``audit`` (the static auditor) is a layer
of its own beside ``core``: it may import only ``sanitizer.core``, is forbidden
torch/numpy/numba like core, and only ``tools`` (the CLI's thin subcommand) imports
it.  All imports count, including those inside functions, relative and absolute.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PKG = "sanitizer"
ROOT = Path(__file__).resolve().parent.parent / PKG

LAYERS = {
    "core": 0,
    "audit": 0,  # beside core: see test_audit_is_its_own_torch_free_layer
    "torch_layer": 1,
    "features": 2,
    "adapters": 3,
    "reporting": 4,
    "activation": 5,  # the package face: sanitizer/__init__.py and its composition root, sanitizer/activation.py
    "testing": 6,
    "tools": 7,
}
TOP = max(LAYERS.values())
FACE = LAYERS["activation"]
EXEMPT = {PKG, f"{PKG}.__main__"}
CORE_FORBIDDEN = {"torch", "numpy", "numba"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _layer(mod: str) -> Optional[int]:
    parts = mod.split(".")
    if len(parts) < 2:
        return None
    return LAYERS.get(parts[1])


def _imports(mod: str, path: Path) -> List[Tuple[str, int]]:
    """Every imported module name (absolute) with its line, including names
    imported from a package that are themselves modules."""
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    out: List[Tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno))
            out.extend((f"{target}.{alias.name}", node.lineno) for alias in node.names)
    return out


def _graph() -> Tuple[Dict[str, Path], Dict[str, List[Tuple[str, int]]]]:
    mods = _modules()
    edges: Dict[str, List[Tuple[str, int]]] = {}
    for mod, path in mods.items():
        found = []
        for target, line in _imports(mod, path):
            # resolve to the longest sanitizer module the name denotes
            name = target
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != mod and name.split(".")[0] == PKG:
                found.append((name, line))
        edges[mod] = found
    return mods, edges


def test_every_module_has_a_layer():
    unknown = [m for m in _modules() if m not in EXEMPT and _layer(m) is None]
    assert not unknown, f"modules outside any layer: {unknown}"


def test_no_upward_imports():
    mods, edges = _graph()
    bad = []
    for mod, targets in edges.items():
        if mod in EXEMPT:
            continue
        mine = _layer(mod)
        for target, line in targets:
            if target == PKG:  # the face composes every layer: only the layers above it may use it
                if mine is None or mine <= FACE:
                    bad.append(f"{mod} (line {line}, layer {mine}) imports the package face {target!r}")
                continue
            theirs = _layer(target)
            if theirs is not None and mine is not None and theirs > mine:
                bad.append(f"{mod} (line {line}, layer {mine}) imports {target} (layer {theirs})")
    assert not bad, "upward imports:\n  " + "\n  ".join(sorted(set(bad)))


def test_no_import_cycles():
    mods, edges = _graph()
    graph = {m: sorted({t for t, _ in ts if t not in EXEMPT}) for m, ts in edges.items() if m not in EXEMPT}
    # a submodule's import of its own parent package is implicit in Python; skip those edges.
    cycles: List[List[str]] = []
    color: Dict[str, int] = {}
    stack: List[str] = []

    def visit(node: str) -> None:
        color[node] = 1
        stack.append(node)
        for nxt in graph.get(node, ()):
            if node.startswith(nxt + "."):
                continue
            if color.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in color:
                visit(nxt)
        stack.pop()
        color[node] = 2

    for node in sorted(graph):
        if node not in color:
            visit(node)
    assert not cycles, "import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_core_imports_no_array_libraries():
    bad = []
    for mod, path in _modules().items():
        if _layer(mod) != 0:
            continue
        for target, line in _imports(mod, path):
            if target.split(".")[0] in CORE_FORBIDDEN:
                bad.append(f"{mod} (line {line}) imports {target}")
    assert not bad, "core must stay torch/numpy/numba-free:\n  " + "\n  ".join(sorted(set(bad)))


def test_audit_is_its_own_torch_free_layer():
    mods, edges = _graph()
    bad = []
    for mod, path in mods.items():
        part = mod.split(".")[1] if "." in mod else ""
        if part == "audit":
            for target, line in _imports(mod, path):
                if target.split(".")[0] in CORE_FORBIDDEN:
                    bad.append(f"{mod} (line {line}) imports {target}")
            for target, line in edges[mod]:
                if target.split(".")[1:2] not in (["core"], ["audit"]):
                    bad.append(f"{mod} (line {line}) imports {target}: audit may import only sanitizer.core")
        elif mod not in EXEMPT and part != "tools":
            for target, line in edges[mod]:
                if target.split(".")[1:2] == ["audit"]:
                    bad.append(f"{mod} (line {line}) imports {target}: only the tools layer may use the auditor")
    assert not bad, "audit layer:\n  " + "\n  ".join(sorted(set(bad)))


def test_cuda_hooks_sits_below_the_torch_layer():
    """``cuda_hooks`` (the numba kernels and their torch bridge) is a layer of its own (issue 51 item 8): it
    imports nothing of the sanitizer (it runs on its own, in a CUDA simulator's child too), and the
    sanitizer reaches it only from the torch layer up: core and the audit stay free of numba."""
    import ast

    hooks = Path(__file__).resolve().parent.parent / "cuda_hooks"
    bad = []
    for path in sorted(hooks.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[0] == PKG]
    for mod, path in _modules().items():
        layer = _layer(mod)
        if layer is None or layer >= LAYERS["torch_layer"]:
            continue
        for target, line in _imports(mod, path):
            if target.split(".")[0] == "cuda_hooks":
                bad.append(f"{mod} (line {line}, layer {layer}) imports {target}")
    assert not bad, bad
