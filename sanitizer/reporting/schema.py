"""A small JSON Schema validator for the subset the report schema uses.

The report schema (``report_schema.json``) is plain JSON Schema (draft
2020-12), so any standard validator accepts it. We check it with this one to
avoid a dependency for one file: it supports ``type``, ``const``, ``enum``,
``required``, ``properties``, ``additionalProperties``, ``items``,
``minimum``, ``maximum``, ``minItems``, ``maxItems``, ``uniqueItems``,
``pattern``, ``format`` (``uri``, ``uri-reference``, ``date-time``), ``anyOf``,
``oneOf``, ``not`` and local ``$ref`` (``#/$defs/NAME``, and draft-04's
``#/definitions/NAME``: the official SARIF 2.1.0 schema, which ``ownsan audit
--format sarif`` is checked against in tests/audit, is draft-04 and uses no
other keyword). An unsupported keyword is an error, so the schema
cannot silently say more than is checked. Types and equality are the
specification's, not Python's: ``1.0`` is an ``integer``, ``true`` is neither an
integer nor equal to ``1``. ``tests/reporting/test_report.py`` checks it against the
``jsonschema`` package (the test extra) on generated schemas and instances.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    # JSON Schema counts a number with a zero fractional part as an integer (1.0 is an integer, true is not).
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}
_ANNOTATIONS = {"$schema", "$id", "id", "$comment", "title", "description", "$defs", "definitions", "default",
                "examples"}
_KNOWN = _ANNOTATIONS | {"type", "const", "enum", "required", "properties", "additionalProperties", "items",
                         "minimum", "maximum", "minItems", "maxItems", "uniqueItems", "pattern", "format", "anyOf",
                         "oneOf", "not", "$ref"}
# RFC 3986: a URI has a scheme; a URI reference is made of its characters, a percent sign only before two hex digits.
_URI_CHARS = r"(?:[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=]|%[0-9A-Fa-f]{2})*"
_URI_REFERENCE = re.compile(_URI_CHARS + r"\Z")
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:" + _URI_CHARS + r"\Z")
# RFC 3339's date-time: full-date "T" full-time, the offset required.
_DATE_TIME = re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)"
                        r"(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)\Z")
_FORMATS: Dict[str, Callable[[str], bool]] = {
    "uri": lambda v: _URI.match(v) is not None,
    "uri-reference": lambda v: _URI_REFERENCE.match(v) is not None,
    "date-time": lambda v: _DATE_TIME.match(v) is not None,
}


class SchemaError(ValueError):
    """The schema itself uses something this validator does not support."""


def validate(instance: Any, schema: Dict[str, Any]) -> List[str]:
    """Every violation of ``schema`` by ``instance``, as ``"$.path: problem"`` lines; [] when valid."""
    errors: List[str] = []
    _check(instance, schema, schema, "$", errors)
    return errors


def _resolve(ref: str, root: Dict[str, Any]) -> Dict[str, Any]:
    if not ref.startswith("#/"):
        raise SchemaError(f"only local $ref are supported, got {ref!r}")
    node: Any = root
    for part in ref[2:].split("/"):
        try:
            node = node[part]
        except (KeyError, TypeError):
            raise SchemaError(f"$ref {ref!r} does not resolve") from None
    return node


def _check(v: Any, s: Dict[str, Any], root: Dict[str, Any], path: str, errors: List[str]) -> None:
    unknown = set(s) - _KNOWN
    if unknown:
        raise SchemaError(f"unsupported schema keywords at {path}: {sorted(unknown)}")
    if "$ref" in s:
        _check(v, _resolve(s["$ref"], root), root, path, errors)
    if "type" in s:
        types = s["type"] if isinstance(s["type"], list) else [s["type"]]
        if not any(_TYPES[t](v) for t in types):
            errors.append(f"{path}: expected {' or '.join(types)}, got {type(v).__name__} {_short(v)}")
            return
    if "const" in s and not _json_equal(v, s["const"]):
        errors.append(f"{path}: expected {s['const']!r}, got {_short(v)}")
    if "enum" in s and not any(_json_equal(v, option) for option in s["enum"]):
        errors.append(f"{path}: {_short(v)} is not one of {s['enum']}")
    if "minimum" in s and _TYPES["number"](v) and v < s["minimum"]:
        errors.append(f"{path}: {v} is below the minimum {s['minimum']}")
    if "maximum" in s and _TYPES["number"](v) and v > s["maximum"]:
        errors.append(f"{path}: {v} is above the maximum {s['maximum']}")
    if isinstance(v, str):
        if "pattern" in s and re.search(s["pattern"], v) is None:
            errors.append(f"{path}: {_short(v)} does not match the pattern {s['pattern']!r}")
        if "format" in s:
            if s["format"] not in _FORMATS:
                raise SchemaError(f"unsupported format at {path}: {s['format']!r} (known: {', '.join(_FORMATS)})")
            if not _FORMATS[s["format"]](v):
                errors.append(f"{path}: {_short(v)} is not a valid {s['format']}")
    if isinstance(v, dict):
        for key in s.get("required", ()):
            if key not in v:
                errors.append(f"{path}: missing required key {key!r}")
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for key, value in v.items():
            if key in props:
                _check(value, props[key], root, f"{path}.{key}", errors)
            elif extra is False:
                errors.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                _check(value, extra, root, f"{path}.{key}", errors)
    if isinstance(v, list):
        if "minItems" in s and len(v) < s["minItems"]:
            errors.append(f"{path}: {len(v)} items, fewer than {s['minItems']}")
        if "maxItems" in s and len(v) > s["maxItems"]:
            errors.append(f"{path}: {len(v)} items, more than {s['maxItems']}")
        if s.get("uniqueItems") is True:
            for i, item in enumerate(v):
                if any(_json_equal(item, earlier) for earlier in v[:i]):
                    errors.append(f"{path}[{i}]: {_short(item)} repeats an earlier item (uniqueItems)")
                    break
        if "items" in s:
            for i, item in enumerate(v):
                _check(item, s["items"], root, f"{path}[{i}]", errors)
    if "anyOf" in s:
        attempts = []
        for option in s["anyOf"]:
            sub: List[str] = []
            _check(v, option, root, path, sub)
            if not sub:
                break
            attempts.append(sub)
        else:
            best = min(attempts, key=len) if attempts else [f"{path}: no alternative given"]
            errors.append(f"{path}: matches none of {len(s['anyOf'])} alternatives; closest: {'; '.join(best[:3])}")
    if "oneOf" in s:
        outcomes = []
        for option in s["oneOf"]:
            sub = []
            _check(v, option, root, path, sub)
            outcomes.append(sub)
        matched = sum(1 for sub in outcomes if not sub)
        if matched != 1:
            closest = "" if matched else "; closest: " + "; ".join(min(outcomes, key=len)[:3]) if outcomes else ""
            errors.append(f"{path}: matches {matched} of {len(s['oneOf'])} alternatives, not exactly one{closest}")
    if "not" in s:
        sub = []
        _check(v, s["not"], root, path, sub)
        if not sub:
            errors.append(f"{path}: {_short(v)} matches a schema it must not match")


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON Schema defines it for ``const`` and ``enum``: 1 equals 1.0, but true is not 1 and
    false is not 0 (Python's ``==`` says they are), recursively through arrays and objects."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["validate", "SchemaError"]
