"""The audited files as one project, so that a call into a helper imported from another audited module
(``from .deepseek_v2 import _try_load_fp8_indexer_wk``) gets that helper's summary too.

Modules are found by the dotted path their file has under the audited directories (the longest
suffix of ``a.b.c`` that names an audited file), or relative to the importing file for
``from .x import f``. An imported module is parsed when a call with a tainted argument first needs it
and kept in a small cache; a file outside the audited paths is never read.
"""
from __future__ import annotations

import os
import re
from collections import OrderedDict
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from sanitizer.audit.sources import AuditInputError, Source, read

CACHE_SIZE = 48
_CLASS = re.compile(rb"^[ \t]*class[ \t]+(\w+)[ \t]*\(([^)]*)\)", re.M)
_METHOD = re.compile(rb"^[ \t]+(?:async[ \t]+)?def[ \t]+(\w+)[ \t]*\([ \t\n]*(self|cls)\b", re.M)
# a static method (no `self`): `@staticmethod` on the line above its `def`
_STATIC = re.compile(rb"^[ \t]+@staticmethod[ \t]*\r?\n[ \t]+(?:async[ \t]+)?def[ \t]+(\w+)", re.M)


def _dotted(path: str) -> Tuple[str, ...]:
    parts = os.path.normpath(os.path.abspath(path))[:-3].split(os.sep)
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return tuple(p for p in parts if p)


class Project:
    def __init__(self, files: Iterable[str]):
        self._by_suffix: Dict[Tuple[str, ...], str] = {}
        self._abs: Dict[str, str] = {}
        for f in files:
            parts = _dotted(f)
            self._abs[os.path.normpath(os.path.abspath(f))] = f
            for i in range(len(parts)):
                self._by_suffix.setdefault(parts[i:], f)
        self._cache: "OrderedDict[str, object]" = OrderedDict()
        self.texts: Dict[str, str] = {}  # path -> source text of every module read (for suppression comments)
        # path -> class -> attribute -> (value, line, method): what a method of an audited class was found storing
        # on `self` (noted by any analysis of that module, whichever module's walk reached the store), and the
        # (class, attribute) pairs each module's second pass already read (engine.analyse, engine._audit_files)
        self.self_kept: Dict[str, Dict[str, Dict[str, tuple]]] = {}
        self.self_kept_read: Dict[str, set] = {}
        self._subclasses: Optional[Dict[str, List[Tuple[str, str]]]] = None
        self._methods: Optional[Dict[str, List[str]]] = None
        self._class_methods: Set[str] = set()  # names of methods taking `cls` (classmethods), any file
        self._reexports: Dict[Tuple[str, str], Optional[str]] = {}  # (package, "def f"/"class C") -> file
        self._constructed: Dict[str, bool] = {}

    def subclasses(self, name: str) -> List[Tuple[str, str]]:
        """(file, class name) of every audited class that names ``name`` (its last dotted part) among its
        bases: where an override of a method called through ``self.`` may live. Read once from the files'
        bytes (a pattern, not a parse: a method call on ``self`` that needs it must not parse every file)."""
        if self._subclasses is None:
            self._scan()
        return self._subclasses.get(name, [])  # type: ignore[union-attr]

    def method_files(self, name: str) -> List[str]:
        """The audited files that define a method ``name`` (an indented ``def name(self``), each once per
        definition: where ``obj.name(...)`` on an object of no known class may be defined. Read once from
        the files' bytes, with :meth:`subclasses`."""
        if self._methods is None:
            self._scan()
        return self._methods.get(name, [])  # type: ignore[union-attr]

    def constructed(self, cls: str) -> bool:
        """Is ``cls(`` called anywhere in the audited files (its objects made by the project itself, not only by
        a framework that holds the class: ComfyUI's graph building a node from ``NODE_CLASS_MAPPINGS``)? Read
        from the files' bytes once per class asked about (a pattern, not a parse)."""
        known = self._constructed.get(cls)
        if known is None:
            pattern = re.compile(rb"(?<!\w)" + re.escape(cls.encode()) + rb"[ \t]*\(")
            definition = re.compile(rb"^[ \t]*class[ \t]+" + re.escape(cls.encode()) + rb"\b", re.M)
            known = any(not definition.match(raw, raw.rfind(b"\n", 0, m.start()) + 1)
                        for _, raw in self._raw_files() for m in pattern.finditer(raw))
            self._constructed[cls] = known
        return known

    def _raw_files(self) -> Iterator[Tuple[str, bytes]]:
        """Each audited file's path and bytes (one that cannot be read is left out: the audit names it)."""
        for path in self._abs.values():
            try:
                with open(path, "rb") as fh:
                    yield path, fh.read()
            except OSError:
                continue

    def _scan(self) -> None:
        """One read of every audited file's bytes for both patterns (classes' bases, methods' names)."""
        subclasses: Dict[str, List[Tuple[str, str]]] = {}
        methods: Dict[str, List[str]] = {}
        for path, raw in self._raw_files():
            for m in _CLASS.finditer(raw):
                for base in m.group(2).split(b","):
                    base = base.strip()
                    if not base or b"=" in base:  # metaclass=..., a keyword
                        continue
                    short = base.rsplit(b".", 1)[-1].split(b"[", 1)[0].decode("ascii", "replace")
                    subclasses.setdefault(short, []).append((path, m.group(1).decode("ascii", "replace")))
            for m in _METHOD.finditer(raw):
                if m.group(2) == b"cls":
                    self._class_methods.add(m.group(1).decode("ascii", "replace"))
                    continue
                methods.setdefault(m.group(1).decode("ascii", "replace"), []).append(path)
            for m in _STATIC.finditer(raw):
                methods.setdefault(m.group(1).decode("ascii", "replace"), []).append(path)
        self._subclasses, self._methods = subclasses, methods

    def defines_method(self, name: str) -> bool:
        """Does an audited class define a method ``name`` (taking ``self`` or ``cls``)? Then a call of that name
        may be the project's own, not a library's method of that name (diffusers' ``lora_state_dict``)."""
        if self._methods is None:
            self._scan()
        return name in self._methods or name in self._class_methods  # type: ignore[operator]

    def locate(self, importer: str, module: str, level: int) -> Optional[str]:
        """The audited file that ``from <level dots><module> import ...`` in ``importer`` names, if any."""
        if level:
            base = os.path.dirname(os.path.abspath(importer))
            for _ in range(level - 1):
                base = os.path.dirname(base)
            target = os.path.join(base, *module.split(".")) if module else base
            for candidate in (target + ".py", os.path.join(target, "__init__.py")):
                found = self._abs.get(os.path.normpath(candidate))
                if found is not None:
                    return found
            return None
        if not module:
            return None
        found = self._by_suffix.get(tuple(module.split(".")))
        return found

    def reexported(self, importer: str, module: str, level: int, name: str, kind: str = "def") -> Optional[str]:
        """``from .utils import set_peft_model_state_dict`` where ``utils/__init__.py`` is not audited (it
        only re-exports): the one audited file under that package that defines ``def name`` at module
        level (None when none, or more than one, does: an ambiguous name is not guessed)."""
        if level:
            base = os.path.dirname(os.path.abspath(importer))
            for _ in range(level - 1):
                base = os.path.dirname(base)
            package = os.path.normpath(os.path.join(base, *module.split("."))) if module else base
        else:
            if not module:
                return None
            tail = tuple(module.split("."))
            package = next((os.path.normpath(os.path.abspath(os.path.dirname(f))) for suffix, f in self._by_suffix.items()
                            if suffix[:len(tail)] == tail and len(suffix) > len(tail)), "")
            if not package:
                return None
        key = (package, f"{kind} {name}")
        if key in self._reexports:
            return self._reexports[key]
        self._reexports[key] = None
        keyword = rb"(async[ \t]+)?def" if kind == "def" else rb"class"
        pattern = re.compile(rb"^" + keyword + rb"[ \t]+" + re.escape(name.encode()) + rb"[ \t]*[(:]", re.M)
        found: List[str] = []
        prefix = package + os.sep
        for absolute, f in self._abs.items():
            if not absolute.startswith(prefix):
                continue
            try:
                with open(absolute, "rb") as fh:
                    if pattern.search(fh.read()):
                        found.append(f)
            except OSError:
                continue
            if len(found) > 1:
                return None
        self._reexports[key] = found[0] if found else None
        return self._reexports[key]

    def close(self) -> None:
        """Let the cached modules go (they point back to this project: a cycle the audit breaks itself)."""
        self._cache.clear()

    def module(self, path: str, build: Callable[[Source], object]) -> Optional[object]:
        """The analysis of an audited module (built by ``build`` on first use), or None if it does not parse."""
        if path in self._cache:
            self._cache.move_to_end(path)
            return self._cache[path]
        try:
            source = read(path)
        except AuditInputError:
            return None
        self.texts[path] = source.text
        made = build(source)
        self._cache[path] = made
        while len(self._cache) > CACHE_SIZE:
            _, old = self._cache.popitem(last=False)
            getattr(old, "close", lambda: None)()
        return made


__all__ = ["Project"]
