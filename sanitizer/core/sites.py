"""Call-site capture for reports: cheap at capture time, formatted only when read.

Stacks are taken at lend and at reuse (never per op), so capture must cost well
under a microsecond per frame. We keep ``(code, instruction offset)`` pairs,
which hold no frame locals alive (``f_lineno`` would scan the line table on
every capture), and turn them into file:line text only when a report is built.
Pure Python: no torch import, so the ledger and its tests stay torch-free.
"""
from __future__ import annotations

import os
import sys
from types import CodeType
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

Site = Tuple[Tuple[CodeType, int], ...]
"""A captured stack, innermost frame first, as (code object, instruction offset) pairs."""

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The one rule for "our own frames", shared by stack capture here and the holder walk in
# sanitizer.features.holder_paths: files under the sanitizer package and under cuda_hooks/
# (its numba kernels) are internal, except sanitizer/testing/, which holds reference
# *consumers* (the deferred loader, the demo): a report must show their frames
# like any user code, so only the plumbing around them is internal.
_HOOKS_DIR = os.path.join(os.path.dirname(_PKG_DIR), "cuda_hooks")
_INTERNAL_PREFIXES: Tuple[str, ...] = (_PKG_DIR + os.sep, _HOOKS_DIR + os.sep)
_USER_PREFIX = os.path.join(_PKG_DIR, "testing") + os.sep


def _internal(filename: str, prefixes: Tuple[str, ...]) -> bool:
    return filename.startswith(prefixes) and not filename.startswith(_USER_PREFIX)


def is_internal_file(filename: str) -> bool:
    """Whether ``filename`` is our own plumbing (hidden from stacks and holder walks).

    Files under the sanitizer package, under ``cuda_hooks/`` and under any prefix given to
    :func:`add_internal_prefix` are internal; ``sanitizer/testing/`` is not (it is user code).
    """
    return _internal(filename, _INTERNAL_PREFIXES)


def add_internal_prefix(path: str) -> None:
    """Hide frames under ``path`` from captured stacks (our own plumbing)."""
    global _INTERNAL_PREFIXES
    prefix = os.path.abspath(path) + os.sep
    if prefix not in _INTERNAL_PREFIXES:
        _INTERNAL_PREFIXES = _INTERNAL_PREFIXES + (prefix,)


def capture(depth: int, skip: int = 1) -> Site:
    """Return up to ``depth`` frames of the caller's stack, innermost first.

    Our own frames at the top are skipped so that a site starts at the code
    that called the public API, which is what a person needs to find. This
    runs on every lend and reuse, so the walk below is as plain as it gets.

    A loader lends from one loop: the same few sites over and over. Each site is
    interned (stored once: a lease then costs a pointer, not ~100-200 bytes of
    tuples) under the *identities* of its code objects and their offsets. Hashing
    a code object hashes its bytecode, constants and names at every call (a
    module's code: microseconds); its ``id`` is an int, and it cannot be reused
    while the interned site, which holds the code, is kept.
    """
    if depth <= 0:
        return ()
    frame = sys._getframe(skip)
    prefixes, user = _INTERNAL_PREFIXES, _USER_PREFIX
    while frame is not None:  # inlined _internal(): this runs on every lend
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(prefixes) or filename.startswith(user):
            break
        frame = frame.f_back
    if frame is None:
        return ()
    if depth == 1:  # the sanitizer off keeps one frame: no list, one small key
        code = frame.f_code
        lasti = frame.f_lasti
        key = (id(code), lasti)
        site = _INTERNED.get(key)
        if site is None:
            site = _intern(key, ((code, lasti),))
        return site
    out = []
    ids = []
    for _ in range(depth):
        if frame is None:
            break
        code = frame.f_code
        lasti = frame.f_lasti
        out.append((code, lasti))
        ids.append(id(code))
        ids.append(lasti)
        frame = frame.f_back
    key = tuple(ids)
    site = _INTERNED.get(key)
    if site is None:
        site = _intern(key, tuple(out))
    return site


def _intern(key: tuple, site: Site) -> Site:
    """Keep ``site`` under ``key`` (the ids of its code objects, which the kept site holds alive)."""
    if len(_INTERNED) >= _INTERNED_MAX:
        _INTERNED.clear()
    _INTERNED[key] = site
    return site


_INTERNED: dict = {}  # (id(code), lasti, ...) -> the site tuple, which keeps those code objects alive
_INTERNED_MAX = 4096


def capture_excluding(depth: int, extra_prefixes: Sequence[str], skip: int = 1) -> Site:
    """Like :func:`capture`, also skipping frames under ``extra_prefixes`` (e.g. torch)."""
    if depth <= 0:
        return ()
    prefixes = _INTERNAL_PREFIXES + tuple(extra_prefixes)
    frame = sys._getframe(skip)
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        if not _internal(code.co_filename, prefixes):
            out.append((code, frame.f_lasti))
        frame = frame.f_back
    return tuple(out)


_LINES: dict = {}  # (code, lasti) -> line: reports format the same few sites over and over
_LINES_MAX = 1 << 16


def line_of(code: CodeType, lasti: int) -> int:
    """The source line of instruction offset ``lasti`` in ``code`` (cached: a linear scan of the line table)."""
    key = (code, lasti)
    line = _LINES.get(key)
    if line is not None:
        return line
    line = code.co_firstlineno
    for start, end, ln in code.co_lines():
        if start <= lasti < end and ln is not None:
            line = ln
            break
    if len(_LINES) >= _LINES_MAX:
        _LINES.clear()
    _LINES[key] = line
    return line


def _shown(site: Site) -> Site:
    """The frames of ``site`` a person reads: our own plumbing (and any prefix added as internal, such as
    pytest's and pluggy's under the plugin) is left out wherever it is, as it is at the top by
    :func:`capture` (which keeps the lend path cheap by filtering only there)."""
    prefixes, user = _INTERNAL_PREFIXES, _USER_PREFIX
    kept = tuple((code, lasti) for code, lasti in site
                 if not code.co_filename.startswith(prefixes) or code.co_filename.startswith(user))
    return kept or site[:1]


_LOOPS: Dict[CodeType, Tuple[Tuple[int, int], ...]] = {}


def loops_of(code: CodeType) -> Tuple[Tuple[int, int], ...]:
    """The bytecode spans ``(first, last)`` that run once per iteration of a loop of ``code`` (a backward
    jump's target up to the jump): from the code itself, so a ``-c`` script or a notebook cell, whose source
    no file holds, is read as well as a module."""
    spans = _LOOPS.get(code)
    if spans is None:
        import dis

        found = []
        try:
            for ins in dis.get_instructions(code):
                # (not a ``yield from``/``await`` send loop's NO_INTERRUPT jump: no iteration of the program's)
                if "JUMP" in ins.opname and "NO_INTERRUPT" not in ins.opname and isinstance(ins.argval, int) \
                        and ins.argval <= ins.offset:
                    found.append((ins.argval, ins.offset))
        except Exception:  # a code object dis cannot read: no loops known
            found = []
        spans = tuple(found)
        if len(_LOOPS) >= _LINES_MAX:
            _LOOPS.clear()
        _LOOPS[code] = spans
    return spans


def in_a_loop(code: CodeType, lasti: int) -> bool:
    """Does the instruction at ``lasti`` of ``code`` run again at a loop's next iteration?"""
    return any(first <= lasti <= last for first, last in loops_of(code))


_RECORDS: dict = {}  # site -> its frame records: a ring load files the same lend and reuse sites per retention


def to_records(site: Optional[Site]) -> list:
    """JSON-ready frames: ``[{"file", "line", "function"}, ...]``, innermost first (our own frames left out).

    Fresh dicts every call (a caller may amend its records), built from a cache of the site's frames."""
    if not site:
        return []
    frames = _RECORDS.get(site)
    if frames is None:
        frames = tuple((code.co_filename, line_of(code, lasti), code.co_name) for code, lasti in _shown(site))
        if len(_RECORDS) >= _LINES_MAX:
            _RECORDS.clear()
        _RECORDS[site] = frames
    return [{"file": f, "line": ln, "function": fn} for f, ln, fn in frames]


def site_text(frame: Optional[Mapping[str, Any]], basename: bool = False) -> Optional[str]:
    """``file:line`` of a frame record (``{"file", "line", "function"}``), ``file`` when the line is
    unknown, None without a file. The one way every report, page and trace writes a place in code."""
    if not frame or not frame.get("file"):
        return None
    path = os.path.basename(frame["file"]) if basename else frame["file"]
    line = frame.get("line")
    return f"{path}:{line}" if line else path


def frame_text(frame: Optional[Mapping[str, Any]], basename: bool = False) -> Optional[str]:
    """``function file:line`` of a frame record (just ``file:line`` without a function); None without a file."""
    where = site_text(frame, basename)
    if where is None:
        return None
    function = frame.get("function") if frame else None
    return f"{function} {where}" if function else where


_TORCH_DIR: Optional[str] = None


def torch_dir() -> str:
    """torch's package directory (with a trailing separator), found without importing torch: its frames
    are dispatch plumbing, never a use site or a holder. Empty when torch is not installed."""
    global _TORCH_DIR
    if _TORCH_DIR is None:
        module = sys.modules.get("torch")
        origin = getattr(module, "__file__", None)
        if origin is None:
            import importlib.util

            spec = importlib.util.find_spec("torch")
            origin = spec.origin if spec is not None else None
        _TORCH_DIR = os.path.dirname(os.path.abspath(origin)) + os.sep if origin else ""
    return _TORCH_DIR


def format_site(site: Optional[Site], indent: str = "    ") -> str:
    """Human-readable stack, one frame a line, in the style of ASan's reports."""
    if not site:
        return f"{indent}<no stack captured (stack_depth=0 or captured outside user code)>"
    lines = []
    for i, (code, lasti) in enumerate(_shown(site)):
        lines.append(f"{indent}#{i} {code.co_name} {code.co_filename}:{line_of(code, lasti)}")
    return "\n".join(lines)


__all__ = ["Site", "is_internal_file", "capture", "capture_excluding", "to_records", "format_site", "add_internal_prefix",
           "site_text", "frame_text", "torch_dir"]
