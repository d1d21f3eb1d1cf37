"""Project settings for the audit: ``[tool.ownsan]`` in ``pyproject.toml``, as ruff and mypy users expect,
so that a code base with its own loader names is audited without changing its code.

```toml
[tool.ownsan]
# calls that yield (name, tensor) pairs, one step per item (a dotted suffix or a glob: fnmatch), or
# with "=tensor", calls that return one borrowed tensor (valid for the call or loop step that fetched it)
producers = ["_checkpoint_engine.parameters", "my_loader.stream", "weights.get_tensor=tensor"]
# functions whose parameter receives weights: "Qualified.name:param" (a per-tensor weight whose
# step is the call), or with "=iterator", "=dict" (a dict of weights by name) or "=pairs"
consumers = ["LayerContainer.set_dependency:dep_value", "Layer.load:weights=dict"]

# which codes, as ruff spells it: codes, prefixes or "ALL"; the command line's --select/--ignore/
# --extend-select/--extend-ignore override or extend these (sanitizer.audit.selection)
select = ["OWN1"]
ignore = ["OWN107"]
# files left out of an audited directory: globs, as ruff's exclude (sanitizer.audit.exclusion)
extend-exclude = ["vendored/", "*_pb2.py"]

[tool.ownsan.per-file-ignores]      # ruff's name; per-path-ignores, the older one, still works
"tests/*" = ["OWN101", "OWN105"]
"scripts/convert_*.py" = ["OWN1"]
```

The file is the nearest ``pyproject.toml`` with a ``tool.ownsan`` table (in any TOML spelling: a
``[tool.ownsan]`` header, ``[tool]`` with ``ownsan = {...}``, dotted keys) above the first audited path
(or the current directory), or the one given with ``--config``; a ``tool.ownsan`` that is no table is an
error that names its value, never ignored. Read with ``tomllib`` (Python 3.11+)
or ``tomli`` when installed; on 3.10 without ``tomli`` a file that has a ``[tool.ownsan]`` table is an
error that says so (never a silent default), a file without one is ignored.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from sanitizer.audit.codes import CodeSelectionError
from sanitizer.audit.exclusion import Exclusion
from sanitizer.audit.selection import RuleSelection, codes_of, parse_selectors

if TYPE_CHECKING:
    from sanitizer.audit.producers import InferredProducers

CONSUMER_KINDS = ("tensor", "iterator", "dict", "pairs")
# What a configured producer's call returns: an iterator of (name, tensor) pairs (one step per item), or
# one borrowed tensor (a getter such as TGI's ``weights.get_tensor(name)``: valid for the step that called it).
PRODUCER_KINDS = ("iterator", "tensor")
_IGNORE_TABLES = ("per-file-ignores", "extend-per-file-ignores", "per-path-ignores")  # the last: the older name
_SELECTORS = ("select", "extend-select", "ignore", "extend-ignore")
# ``suppressions``: the runtime's suppressions file (``ownsan run`` and the pytest plugin read it; the audit
# only checks it is a path), so that one table holds a project's ownsan settings
_KEYS = frozenset({"producers", "consumers", "exclude", "extend-exclude", "suppressions", *_IGNORE_TABLES,
                   *_SELECTORS})


class SettingsError(Exception):
    """A ``[tool.ownsan]`` table that cannot be used: named, with the value (exit status 2)."""


class NoTomlReader(SettingsError):
    """Python 3.10 without ``tomli``: a file that has our table cannot be read (never a silent default)."""


@dataclass(frozen=True)
class Consumer:
    qualname: str
    param: str
    kind: str = "tensor"


@dataclass
class Settings:
    path: Optional[str] = None  # the pyproject.toml read (None: defaults)
    producers: Tuple[str, ...] = ()  # the call patterns
    consumers: Tuple[Consumer, ...] = ()
    per_path_ignores: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    producer_kinds: Tuple[str, ...] = ()  # one of PRODUCER_KINDS per pattern ("iterator" when not given)
    selection: RuleSelection = RuleSelection()  # select / extend-select / ignore (+ extend-ignore)
    exclude: Optional[Tuple[str, ...]] = None  # None: the default list
    extend_exclude: Tuple[str, ...] = ()
    suppressions: Optional[str] = None  # the runtime's suppressions file, absolute (relative to this file's dir)
    _producer_res: Optional[List["re.Pattern[str]"]] = None
    # producers inferred over the audited files (:mod:`.producers`): consulted after the configured ones
    inferred: Optional["InferredProducers"] = None

    @property
    def root(self) -> Optional[str]:
        """The project root relative globs are read from: the settings file's directory (None: the cwd)."""
        return os.path.dirname(os.path.abspath(self.path)) if self.path else None

    def exclusion(self) -> Exclusion:
        return Exclusion.of(self.exclude, self.extend_exclude, self.root)

    def overridden(self, exclude: Optional[Sequence[str]] = None,
                   extend_exclude: Sequence[str] = (), per_file_ignores: Optional[Sequence[str]] = None,
                   extend_per_file_ignores: Sequence[str] = ()) -> "Settings":
        """These settings with the command line's on top, as ruff combines them: ``--exclude`` and
        ``--per-file-ignores`` replace the file's, their ``--extend-`` forms add to it (the command line's
        ``--select``/``--ignore`` are a selection of a higher priority, given to the audit beside these).
        A ``--per-file-ignores`` value is ``GLOB:CODE`` pairs, comma-separated, as ruff's."""
        ignores = dict(self.per_path_ignores) if per_file_ignores is None else {}
        for option, values in (("--per-file-ignores", per_file_ignores or ()),
                               ("--extend-per-file-ignores", extend_per_file_ignores)):
            for pattern, codes in _pairs(values, option):
                ignores[pattern] = ignores.get(pattern, ()) + codes
        return replace(self, per_path_ignores=ignores, _producer_res=None,
                       exclude=self.exclude if exclude is None else tuple(exclude),
                       extend_exclude=self.extend_exclude + tuple(extend_exclude))

    def producer_kind(self, call_name: str) -> Optional[str]:
        """What ``call_name`` (dotted, as written) returns when it is a configured producer (equal, a dotted
        suffix, or a glob): ``"iterator"`` or ``"tensor"``; None when it is not one. A ``"tensor"`` getter
        whose definition the audit inferred as a producer is refined by that: the conversion it applies,
        or ``"dict"``/``"holder"`` when it returns tensors in a container."""
        if not call_name:
            return None
        if self.producers:
            if self._producer_res is None:
                self._producer_res = [re.compile(fnmatch.translate(p)) for p in self.producers]
            for i, (p, rx) in enumerate(zip(self.producers, self._producer_res)):
                if call_name == p or call_name.endswith("." + p) or rx.match(call_name):
                    declared = self.producer_kinds[i] if i < len(self.producer_kinds) else "iterator"
                    if declared == "tensor" and self.inferred is not None:
                        # a getter declared `=tensor` whose definition is audited: what inference read in
                        # its body says more (the conversion it applies, `.half()`, for OWN107; a dict or
                        # tuple of tensors rather than one); a kind it cannot refine (a stream, a handle)
                        # leaves the declared one
                        refined = self.inferred.kind_of(call_name)
                        if refined in ("tensor", "dict", "holder"):
                            return refined
                    return declared
        if self.inferred is not None:
            return self.inferred.kind_of(call_name)  # (a str with the inferred conversion and origin)
        return None

    def is_producer(self, call_name: str) -> bool:
        return self.producer_kind(call_name) is not None

    def names_producer(self, function_name: str, qualname: str = "") -> bool:
        """Is a function of this name one of the configured producers' definitions (the last part of a
        pattern, ``weights.get_weights_row`` -> every ``get_weights_row``: TGI's ``Weights`` delegates to
        its weights loaders' methods of the same name)? What it returns is borrowed by contract. An inferred
        producer is that very definition (its ``qualname``, given): another class's method of the same name
        (every ComfyUI node's ``loadmodel``) is judged by its own body."""
        if not function_name:
            return False
        if self.inferred is not None and function_name in self.inferred.by_name and (
                not qualname or self.inferred.by_name[function_name].qualname == qualname):
            return True  # inferred: hands on what it fetched, as a configured one does
        return any(fnmatch.fnmatchcase(function_name, p.rpartition(".")[2]) for p in self.producers)

    def consumer_params(self, qualname: str) -> List[Consumer]:
        return [c for c in self.consumers if c.qualname == qualname or qualname.endswith("." + c.qualname)]

    def ignored_codes(self, path: str) -> Tuple[str, ...]:
        """Codes ignored for ``path``: a glob matches the file's name, its path relative to the settings
        file's directory (or the cwd), or the path as given, a directory everything under it; as in ruff's
        per-file-ignores, "An initial '!' negates the file pattern" (the codes are ignored in every file
        it does not match)."""
        if not self.per_path_ignores:
            return ()
        candidates = {path.replace(os.sep, "/"), os.path.basename(path)}
        rel = os.path.relpath(os.path.abspath(path), self.root or os.getcwd())
        candidates.add(rel.replace(os.sep, "/"))
        out: List[str] = []
        for pattern, codes in self.per_path_ignores.items():
            negated = pattern.startswith("!")
            glob = pattern[1:] if negated else pattern
            glob = glob[2:] if glob.startswith("./") else glob
            hit = any(fnmatch.fnmatch(c, glob) or c.startswith(glob.rstrip("/") + "/") for c in candidates)
            if hit != negated:
                out.extend(codes)
        return tuple(out)

    def describe(self) -> str:
        """What ``--show-settings`` prints."""
        lines = [f"settings: {self.path or '(none found: defaults)'}"]
        lines.append("producers: " + (", ".join(f"{p}={self.producer_kind(p) or 'iterator'}" for p in self.producers)
                                      or "(none beyond the built-in ones)"))
        if self.inferred is not None:
            found = self.inferred.describe()
            lines.append("inferred producers: " + ("(none)" if not found else f"{len(found)}"))
            lines.extend(f"  {line}" for line in found)
        lines.append("consumers: " + (", ".join(f"{c.qualname}:{c.param}={c.kind}" for c in self.consumers)
                                      or "(none beyond the discovered ones)"))
        sel = self.selection
        lines.append("select: " + (", ".join(sel.select) if sel.select is not None else "(all codes)"))
        lines.append("extend-select: " + (", ".join(sel.extend_select) or "(none)"))
        lines.append("ignore: " + (", ".join(sel.ignore) or "(none)"))
        lines.append("exclude: " + (", ".join(self.exclude) if self.exclude is not None else "(the default list)"))
        lines.append("extend-exclude: " + (", ".join(self.extend_exclude) or "(none)"))
        if self.per_path_ignores:
            lines.append("per-file-ignores:")
            lines.extend(f"  {p}: {', '.join(c)}" for p, c in self.per_path_ignores.items())
        else:
            lines.append("per-file-ignores: (none)")
        lines.append(f"suppressions (runtime): {self.suppressions or '(none)'}")
        return "\n".join(lines) + "\n"


def _toml_loads(text: str, path: str) -> dict:
    try:
        import tomllib  # type: ignore[import-not-found]
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[import-not-found,no-redef]
        except ModuleNotFoundError:
            raise NoTomlReader(f"{path}: has a [tool.ownsan] table, but reading TOML needs Python 3.11 or the "
                               f"'tomli' package") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not valid TOML ({exc})") from None


def _strings(value: object, what: str, path: str) -> Tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise SettingsError(f"{path}: [tool.ownsan] {what} must be a list of non-empty strings, got {value!r:.80}")
    return tuple(v.strip() for v in value)


def _producer(spec: str, path: str) -> Tuple[str, str]:
    name, _, kind = spec.partition("=")
    kind = kind.strip() or "iterator"
    if not name.strip() or kind not in PRODUCER_KINDS:
        raise SettingsError(f"{path}: [tool.ownsan] producers entry {spec!r}: expected a call name or glob with an "
                            f"optional '={'|'.join(PRODUCER_KINDS)}'")
    return name.strip(), kind


def _consumer(spec: str, path: str) -> Consumer:
    name, sep, rest = spec.partition(":")
    param, _, kind = rest.partition("=")
    kind = kind.strip() or "tensor"
    if not sep or not name.strip() or not param.strip().isidentifier() or kind not in CONSUMER_KINDS:
        raise SettingsError(f"{path}: [tool.ownsan] consumers entry {spec!r}: expected 'Qualified.name:param' "
                            f"with an optional '={'|'.join(CONSUMER_KINDS)}'")
    return Consumer(name.strip(), param.strip(), kind)


def parse(table: dict, path: str) -> Settings:
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise SettingsError(f"{path}: [tool.ownsan] has unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    producer_specs = [_producer(s, path) for s in _strings(table.get("producers", []), "producers", path)]
    producers = tuple(name for name, _ in producer_specs)
    producer_kinds = tuple(kind for _, kind in producer_specs)
    consumers = tuple(_consumer(s, path) for s in _strings(table.get("consumers", []), "consumers", path))
    ignores: Dict[str, Tuple[str, ...]] = {}
    for key in _IGNORE_TABLES:
        raw = table.get(key, {})
        if not isinstance(raw, dict):
            raise SettingsError(f"{path}: [tool.ownsan] {key} must be a table of glob = [codes], got {raw!r:.80}")
        for pattern, codes in raw.items():
            names = _strings(codes, f"{key} {pattern!r}", path)
            ignores[pattern] = ignores.get(pattern, ()) + _codes(names, f"{key} {pattern!r}", path)
    selectors = {key: _selectors(table, key, path) for key in _SELECTORS}
    selection = RuleSelection(selectors["select"] if "select" in table else None, selectors["extend-select"],
                              selectors["ignore"] + selectors["extend-ignore"])
    exclude = _strings(table["exclude"], "exclude", path) if "exclude" in table else None
    extend_exclude = _strings(table.get("extend-exclude", []), "extend-exclude", path)
    return Settings(path, producers, consumers, ignores, producer_kinds, selection, exclude, extend_exclude,
                    _suppressions(table, path))


def _suppressions(table: dict, path: str) -> Optional[str]:
    """``suppressions = "FILE"``: the runtime's suppressions file, read relative to the pyproject.toml's
    directory (as ruff reads its paths), absolute here; the file itself is checked where it is used."""
    if "suppressions" not in table:
        return None
    value = table["suppressions"]
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"{path}: [tool.ownsan] suppressions must be a file name (a non-empty string), "
                            f"got {value!r:.80}")
    return os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(value.strip()))


def _selectors(table: dict, key: str, path: str) -> Tuple[str, ...]:
    try:  # `select = []` is an empty selection: nothing reported, as in ruff
        return parse_selectors(_strings(table.get(key, []), key, path), key)
    except CodeSelectionError as exc:
        raise SettingsError(f"{path}: [tool.ownsan] {exc}") from None


def _codes(names: Sequence[str], what: str, path: str) -> Tuple[str, ...]:
    """The codes a per-file-ignores entry's selectors denote (prefixes and ALL expanded)."""
    try:
        return tuple(code for s in parse_selectors(names, what) for code in codes_of(s))
    except CodeSelectionError as exc:
        raise SettingsError(f"{path}: [tool.ownsan] {exc}") from None


def _pairs(values: Sequence[str], option: str) -> List[Tuple[str, Tuple[str, ...]]]:
    """``["tests/*:OWN101,scripts/*:OWN1"]`` -> (glob, codes) pairs, as ruff reads ``--per-file-ignores``."""
    out = []
    for raw in values:
        for item in (p.strip() for p in raw.split(",")):
            if not item:
                continue
            pattern, sep, code = item.rpartition(":")
            if not sep or not pattern or not code:
                raise CodeSelectionError(f"{option} {item!r}: expected GLOB:CODE (for instance 'tests/*:OWN101')")
            out.append((pattern, tuple(c for s in parse_selectors([code], option) for c in codes_of(s))))
    return out


# `tool.ownsan` may be spelt `[tool.ownsan]`, `[tool]` then `ownsan = {...}` or `ownsan.key = ...`,
# `tool.ownsan.key = ...`, `[tool."ownsan"]`, an inline table: only TOML itself tells. A file whose bytes
# never name `ownsan` is not parsed (another tool's broken pyproject.toml is not the audit's business);
# one where `ownsan` reads as a key (followed by `.`, `=` or `]`, outside a comment) and that is not
# valid TOML is that error, never silently no settings.
_KEYLIKE = re.compile(rb"""^[^#\n]*?\bownsan\b["']?[ \t]*[.=\]]""", re.M)
_ABSENT = object()


def _ownsan_value(path: str, raw: bytes, strict: bool = False) -> object:
    """The value of ``tool.ownsan`` in a pyproject.toml's bytes, however it is spelt, or ``_ABSENT``.
    ``strict`` (the file given with ``--config``): a file that does not decode or parse is an error even
    when nothing in it looks like our table."""
    if not strict and b"ownsan" not in raw:
        return _ABSENT
    keylike = _KEYLIKE.search(raw) is not None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not (strict or keylike):
            return _ABSENT
        raise SettingsError(f"{path}: cannot read it ({exc})") from None
    try:
        data = _toml_loads(text, path)
    except NoTomlReader:
        if not keylike:
            return _ABSENT
        raise
    except SettingsError:
        if not (strict or keylike):
            return _ABSENT
        raise
    tool = data.get("tool")
    if not isinstance(tool, dict) or "ownsan" not in tool:
        return _ABSENT
    return tool["ownsan"]


def load(path: str, strict: bool = False) -> Settings:
    """The settings of one ``pyproject.toml`` (defaults when it has no ``tool.ownsan`` table)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    table = _ownsan_value(path, raw, strict)
    if table is _ABSENT:
        return Settings()
    if not isinstance(table, dict):
        raise SettingsError(f"{path}: tool.ownsan must be a table (`[tool.ownsan]` with its keys under it), "
                            f"got {table!r:.80}")
    return parse(table, path)


def find(paths: Sequence[str]) -> Optional[str]:
    """The nearest ``pyproject.toml`` with a ``tool.ownsan`` entry above the first path (or the cwd)."""
    start = os.path.abspath(paths[0]) if paths else os.getcwd()
    cur = start if os.path.isdir(start) else os.path.dirname(start)
    while True:
        candidate = os.path.join(cur, "pyproject.toml")
        if os.path.isfile(candidate):
            try:
                with open(candidate, "rb") as fh:
                    raw = fh.read()
            except OSError:
                raw = b""
            if _ownsan_value(candidate, raw) is not _ABSENT:
                return candidate
        parent = os.path.dirname(cur)
        if parent == cur:
            return None
        cur = parent


def resolve(paths: Sequence[str], config: Optional[str] = None) -> Settings:
    """``--config FILE`` when given, else the nearest project's settings, else defaults."""
    if config is not None:
        if not os.path.isfile(config):
            raise SettingsError(f"--config {config!r}: not a file (give the path of a pyproject.toml)")
        settings = load(config, strict=True)
        return settings if settings.path else Settings(config)
    found = find(paths)
    return load(found) if found else Settings()


DEFAULT = Settings()

__all__ = ["Settings", "Consumer", "SettingsError", "NoTomlReader", "load", "find", "resolve", "parse", "DEFAULT", "CONSUMER_KINDS", "PRODUCER_KINDS"]
