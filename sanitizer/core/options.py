"""The one table of options, in the manner of AddressSanitizer's flag table.

Every option is declared once here with its type, default and help. The
environment parser (``OWNERSHIP_SANITIZE_OPTIONS="halt_on_error=0:stack_depth=8"``),
the keyword arguments of :func:`sanitizer.enable`, the command line and the
README's option list all read this table, so they cannot drift apart.
"""
from __future__ import annotations

import operator

import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

ENV_SWITCH = "OWNERSHIP_SANITIZE"
ENV_OPTIONS = "OWNERSHIP_SANITIZE_OPTIONS"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class OptionError(ValueError):
    """An unknown option, a value of the wrong type or beyond its bounds; the message names both."""


SSIZE_MAX = sys.maxsize  # the largest C ssize_t: a count or a size the runtime hands to C (deque maxlen, mmap)
COUNT = (0, SSIZE_MAX)  # the bounds of a count, a size or a time: never negative, never beyond a C ssize_t
BYTE = (0, 255)


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE - {''})}")


def _parse_int(text: str) -> int:
    return int(text.strip(), 0)  # accepts 8, 0x10, 0o7


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    check: Optional[Callable[[Any], Optional[str]]] = None  # returns a complaint or None
    bounds: Optional[Tuple[Any, Any]] = None  # (low, high), both allowed: every int or float option has them
    byte: bool = False  # a byte value (poison_byte): shown in hex, and its bound said as a byte's

    def __post_init__(self) -> None:
        if self.type in (int, float) and self.bounds is None:  # a value past what C takes fails late, half-armed
            raise TypeError(f"option '{self.name}': a numeric option needs bounds=(low, high)")

    def parse(self, raw: Any) -> Any:
        """Turn ``raw`` (a string from the environment, or a Python value) into this option's type."""
        if isinstance(raw, str) and not raw.strip() and self.type is not str:
            example = int(self.default) if self.type is bool else self.default
            raise OptionError(f"option '{self.name}': empty value {raw!r}; give a {self.type.__name__} "
                              f"(e.g. {self.name}={example!r}) or leave the option out for its default")
        try:
            if isinstance(raw, str):
                value = {bool: parse_bool, int: _parse_int, float: float, str: str}[self.type](raw)
            elif self.type is bool and isinstance(raw, (bool, int)) and raw in (0, 1):
                value = bool(raw)
            elif self.type is float and isinstance(raw, (int, float)) and not isinstance(raw, bool):
                value = float(raw)
            elif isinstance(raw, self.type) and not (self.type is int and isinstance(raw, bool)):
                value = raw
            else:
                raise ValueError(f"expected {self.type.__name__}")
        except ValueError as exc:
            raise OptionError(
                f"option '{self.name}': bad value {raw!r} ({exc}); type {self.type.__name__}, default {self.default!r}"
            ) from None
        complaint = self._out_of_bounds(value) or (self.check(value) if self.check else None)
        if complaint:
            raise OptionError(f"option '{self.name}': bad value {raw!r}: {complaint}")
        return value

    def _out_of_bounds(self, value: Any) -> Optional[str]:
        """The complaint when ``value`` is beyond this option's bounds (checked in :func:`resolve`, so before
        anything is armed), naming the bound; None when within them (or when the option has none)."""
        if self.bounds is None:
            return None
        low, high = self.bounds
        if not value >= low:  # (NaN fails both)
            return f"must be >= {low}"
        if not value <= high:
            why = {SSIZE_MAX: " (the largest C ssize_t)"}.get(high, " (a byte, 0x00..0xff)" if self.byte else
                                                              " (an exit status)" if high == 255 else "")
            return f"must be <= {high}{why}"
        return None


def _trap_mode(v: str) -> Optional[str]:
    if v not in ("0", "poison", "fault"):
        return "must be poison, fault or 0"
    if v != "0":
        from sanitizer.core import pages  # (only when asked for: ctypes stays unimported otherwise)

        if not pages.AVAILABLE:
            return f"trap mode is unavailable here: it {pages.UNAVAILABLE_REASON}"
    return None


def _suppressions_file(v: str) -> Optional[str]:
    from sanitizer.core import suppressions  # (torch-free, standard library only)

    return suppressions.check(v)


OPTIONS: Dict[str, Option] = {
    o.name: o
    for o in [
        Option("halt_on_error", bool, True,
               "Raise StaleBorrowError at the first stale use. With 0, record the error, let the op run "
               "on the stale bytes, and go on (report() and report=path then list every error)."),
        Option("stack_depth", int, 8,
               "Frames kept for the lent-at, reused-at and used-at stacks. 0 captures none (cheapest).",
               bounds=COUNT),
        Option("report", str, "",
               "Write the JSON report to this path at process exit ({pid} and {rank} expand). Empty: no file. "
               "A file is replaced whole once written; a device (/dev/null), a FIFO or /dev/stdout is written "
               "through, and a symlink's target is written (the link kept). Beside a file (a link's target), each "
               "finding is also appended to PATH.journal as it is made (removed once a report is written there): "
               "a process killed first (Pool.terminate) keeps its findings, read in its report's place (missing, "
               "or an earlier process's) by ownsan run, triage and audit --report. "
               "A path with ':' or ',' is quoted in the options string (report='/runs/12:30/r.json')."),
        Option("checksum", bool, False,
               "Hash each lease's bytes at lend (numba kernels, CUDA or CPU) and verify them when a reuse retires "
               "the lease while it is alive and at sanitizer.verify(): catches writes that bypass the buffer API. "
               "(The safetensors_ring emulation's default mode retires no held view: it keeps its bytes, unverified "
               "from then on.)"),
        Option("poison", bool, False,
               "Fill the bytes of every retired lease with poison_byte before the producer writes, so stale reads "
               "through any path (numpy, C extensions) read NaN rather than plausible weights. Only memory the "
               "sanitizer allocated (StagingBuffer(nbytes), rings) is written; adopted loader memory (adopt(), "
               "borrowed_iterator) never is."),
        Option("poison_byte", int, 0xFF,
               "The poison fill byte; 0xFF reads as NaN in fp16, bf16 and fp32.", bounds=BYTE, byte=True),
        Option("guard", bool, True,
               "When a reuse or close retires a lease that something still holds (and rescue did not take it), "
               "re-point its storage to a tombstone filled with poison_byte, so a read the dispatch mode cannot see "
               "(ctypes, a C extension, DLPack, a thread started before enable) reads NaN, never the next tensor's "
               "bytes. The tombstone is freed with the lease; stats() counts them."),
        Option("trap", str, "0",
               "Trap mode for memory the sanitizer allocates (StagingBuffer(nbytes), rings, safetensors_ring; CPU, "
               "Linux): each lease gets its own page mapping of the buffer, and a retire replaces it in place, so "
               "every alias made while fresh (numpy, memoryview, DLPack, frombuffer, ctypes) hits it too. poison: "
               "reads poison_byte (NaN); fault: the first access prints one report and exits 1. With rescue=1 the "
               "mapping becomes a private copy, so every alias keeps the right bytes. 0: off.", _trap_mode),
        Option("quarantine", int, 0,
               "StagingRing: retire each tensor when the next one is put (strict lifetime) and keep the N most "
               "recently retired regions out of reuse (growing the ring if it must), so stale reads keep hitting "
               "poison longer.", bounds=COUNT),
        Option("rescue", bool, False,
               "When a reuse or close would overwrite a lease that something still holds, first move it and all "
               "its derived views onto an owned copy (same size), so retaining consumers keep correct data; "
               "sanitizer.rescues() lists each one with its lend site."),
        Option("safetensors_ring", int, 0,
               "With OWNERSHIP_SANITIZE=1: serve safetensors safe_open()'s get_tensor, get_slice(...)[...] and "
               "get_tensors() through a StagingRing of this many bytes (emulated borrowing: views reused as the "
               "ring comes round, freed when the file is closed), to test a consumer against the borrowed "
               "contract. A tensor, or a get_tensors() dict, larger than the ring is handed over owned and counted "
               "in the summary as not checked. 0: off (safetensors tensors are owned; load_file is never "
               "affected).", bounds=COUNT),
        Option("safetensors_strict", bool, False,
               "With safetensors_ring=N: hold the consumer to the emulated borrowed contract. 0 (default): a "
               "view still held when the ring reuses or frees it keeps its bytes, aliases included, and is reported as an "
               "emulated_retention event (correct under safetensors' own contract), never an error. 1: it is a "
               "retention, and its later use a stale-use error, as with a borrowing loader."),
        Option("triage", bool, False,
               "Triage mode: never raise; record every error and every retention (a retired view that something "
               "still held, with the holder named) so the program runs to the end. ownsan run and the pytest "
               "plugin set it."),
        Option("triage_budget_ms", int, 1000,
               "Time bound of one holder walk (gc referrers from a retained view up to a global, an object "
               "attribute, a closure, a partial or a frame local), in CPU time of the walking thread, so a loaded "
               "machine names the same holders. 0: record retentions without naming the holder.",
               bounds=COUNT),
        Option("triage_depth", int, 8,
               "Referrer levels the holder walk climbs before it gives up.", bounds=COUNT),
        Option("max_records", int, 1000,
               "Keep at most this many error and event records in all (errors, rescues, retentions); later ones "
               "are counted, not kept, so a long run's memory stays bounded. 0: count only.", bounds=COUNT),
        Option("max_errors_per_lease", int, 4,
               "With halt_on_error=0, keep at most this many stale-use records for one lease (the rest are counted).",
               bounds=COUNT),
        Option("timeline_events", int, 10000,
               "Lends kept (the most recent) for the report's timeline of each staging buffer (ownsan triage --html, "
               "--trace), and as many of the most recent reuses. 0: no timeline.", bounds=COUNT),
        Option("help", bool, False,
               "Print this option table to stderr when the sanitizer starts (as ASan's help=1), then go on."),
        Option("print_errors", bool, True,
               "With halt_on_error=0 (or triage=1), print each error to stderr as it is found, once per distinct "
               "use site (as ASan's recover mode prints each report), and one summary line at exit. 0: silent "
               "(the report and sanitizer.report() still list every error)."),
        Option("exitcode", int, 0,
               "With halt_on_error=0 (or triage=1), end the process with this status when an error was recorded "
               "(as ASan's exitcode=); the report is written first. 0: the program's own status.",
               bounds=(0, 255)),
        Option("fail_on_retention", bool, True,
               "ownsan run exits 1 when a retention was confirmed, even without an error (as LeakSanitizer fails "
               "a run that leaked). 0: only errors fail the run."),
        Option("suppressions", str, "",
               "A suppressions file (as LSan's suppressions=): one KIND:PATTERN rule a line, KIND retention, "
               "stale_use, checksum_mismatch, error or *, PATTERN a glob matched against the lease's name, the "
               "holder, and each frame (file, file:line, function). A matching finding is counted and listed as "
               "suppressed, not printed, and never fails the run. Empty: none.", check=_suppressions_file),
    ]
}


def defaults() -> Dict[str, Any]:
    return {name: opt.default for name, opt in OPTIONS.items()}


def _unknown(name: str) -> OptionError:
    from sanitizer.core.suggest import hint  # the CLI's did-you-mean too (commands, flags, consumers)

    return OptionError(f"unknown option '{name}'{hint(name, OPTIONS, cutoff=0.75)}; valid options: "
                       f"{', '.join(sorted(OPTIONS))}")


class Options(dict):
    """The options in force: frozen, every value parsed to its table type.

    Built only by :func:`resolve`, so a value never skips validation; read as
    ``opts["stack_depth"]`` or ``opts.stack_depth``; change by building a new
    one (:meth:`replace`). Rules that join several options live here, once.
    A read-only ``dict`` subclass rather than a Mapping: lending reads options
    on the hot path, and a dict lookup stays in C.
    """

    __slots__ = ()

    # What a type checker reads of ``opts.name`` (the values come from the dict through __getattr__): one
    # line per option of the table, in its order and type; tests/core/test_options.py pins them to it. The
    # runtime's hot paths read ``opts["name"]`` (a C dict lookup, no Python call).
    halt_on_error: bool
    stack_depth: int
    report: str
    checksum: bool
    poison: bool
    poison_byte: int
    guard: bool
    trap: str
    quarantine: int
    rescue: bool
    safetensors_ring: int
    safetensors_strict: bool
    triage: bool
    triage_budget_ms: int
    triage_depth: int
    max_records: int
    max_errors_per_lease: int
    timeline_events: int
    help: bool
    print_errors: bool
    exitcode: int
    fail_on_retention: bool
    suppressions: str

    def _frozen(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("options are frozen: build new ones with replace(name=value)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _frozen  # type: ignore

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no option '{name}'") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"options are frozen: build new ones with replace({name}=...)")

    def __repr__(self) -> str:
        return f"Options({dict.__repr__(self)})"

    def __reduce__(self):
        return (Options, (dict(self),))

    def __copy__(self) -> "Options":
        return self

    def replace(self, **changes: Any) -> "Options":
        return resolve(changes, base=self)

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """As ``dict.get``, for option names only: a misspelt name is an error, never a silent None."""
        if name not in OPTIONS:
            raise _unknown(name)
        return dict.get(self, name, default)

    @property
    def halts(self) -> bool:
        """Does a finding raise at once? ``triage=1`` overrides ``halt_on_error=1``: triage records every finding."""
        return bool(self["halt_on_error"]) and not self["triage"]


# Typed access, one attribute per option of the table (``opts.stack_depth``): a C-level item getter behind a
# property, so the hot paths (a lend reads ``stack_depth``) pay no Python call, and a misspelt name is an
# AttributeError (``__getattr__`` names it) where a string key would be a KeyError found only when it runs.
for _name in OPTIONS:
    setattr(Options, _name, property(operator.itemgetter(_name), doc=f"the ``{_name}`` option"))
del _name


def resolve(values: Mapping[str, Any], base: Optional[Mapping[str, Any]] = None) -> Options:
    """Validate ``values`` (strings or Python values) over ``base`` (defaults if None)."""
    out = dict(defaults() if base is None else base)
    for name, raw in values.items():
        opt = OPTIONS.get(name)
        if opt is None:
            raise _unknown(name)
        out[name] = opt.parse(raw)
    return Options(out)


def parse_options_string(text: str) -> Dict[str, str]:
    """``"a=1:b=2"`` (or comma-separated, as ASan accepts) -> ``{"a": "1", "b": "2"}``, unvalidated.

    A value holding ``:`` or ``,`` (a report path in a timestamped run directory) is quoted,
    ``report='/runs/12:30/r.json'`` (single or double quotes), or has them escaped with a backslash,
    ``report=/runs/12\\:30/r.json``."""
    out: Dict[str, str] = {}
    previous: Optional[Tuple[str, str]] = None  # the last option read and the text of its value
    for item, before in _split_with_separators(text):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            hint = ""
            if previous is not None and OPTIONS[previous[0]].type is str:  # a value cut at a separator it holds
                joined = _unquote(previous[1].strip(), previous[0]) + before + item.strip()
                hint = f" (did you mean {previous[0]}={_quoted(joined)}?)"
            raise OptionError(f"{ENV_OPTIONS}: '{item.strip()}' is not of the form name=value{hint}; {QUOTING}")
        previous = (name, value)
        if name not in OPTIONS:
            raise _unknown(name)
        out[name] = _unquote(value.strip(), name)
    return out


def format_options_string(values: Mapping[str, Any]) -> str:
    """The options string of ``values`` that :func:`parse_options_string` reads back (values holding a
    separator, a quote or a backslash are escaped)."""
    def escape(v: Any) -> str:
        text = str(int(v)) if isinstance(v, bool) else str(v)
        return "".join("\\" + c if c in ":,'\"\\" else c for c in text)

    return ":".join(f"{k}={escape(v)}" for k, v in values.items())


QUOTING = ("':' and ',' separate options, so a value holding one is quoted (report='/runs/12:30/r.json', "
           "single or double quotes) or escapes it with a backslash (report=/runs/12\\:30/r.json)")


def _quoted(value: str) -> str:
    """``value`` as an options string writes it: in quotes when it holds a separator."""
    if not any(c in value for c in ":,"):
        return value
    for quote in "'\"":
        if quote not in value:
            return quote + value + quote
    return "".join("\\" + c if c in ":,'\"\\" else c for c in value)


def _split_items(text: str) -> List[str]:
    """Split at ``:`` and ``,`` outside quotes and not after a backslash (kept in the items, for _unquote)."""
    return [item for item, _ in _split_with_separators(text)]


def _split_with_separators(text: str) -> List[Tuple[str, str]]:
    """:func:`_split_items`, each item with the separator before it ('' for the first)."""
    items, current, quote, i = [], [], None, 0
    before = ""
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            current.append(text[i:i + 2])
            i += 2
            continue
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in ":,":
            items.append(("".join(current), before))
            current, before = [], ch
            i += 1
            continue
        current.append(ch)
        i += 1
    if quote:
        raise OptionError(f"{ENV_OPTIONS}: unterminated {quote} quote in {text!r}")
    items.append(("".join(current), before))
    return items


def _unquote(value: str, name: str) -> str:
    """Drop one pair of surrounding quotes and the backslashes that escape a character."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        value = value[1:-1]
    out, i = [], 0
    while i < len(value):
        if value[i] == "\\" and i + 1 < len(value) and value[i + 1] in ":,'\"\\":
            out.append(value[i + 1])
            i += 2
            continue
        out.append(value[i])
        i += 1
    return "".join(out)


def switch_from_env(environ: Mapping[str, str]) -> bool:
    """Read ``OWNERSHIP_SANITIZE``: unset, 0, false, off, no or empty disable; 1, true, on, yes enable."""
    raw = environ.get(ENV_SWITCH)
    if raw is None:
        return False
    try:
        return parse_bool(raw)
    except ValueError:
        raise OptionError(
            f"{ENV_SWITCH}={raw!r} is not understood; use 1/true/on/yes to enable or 0/false/off/no/empty to disable"
        ) from None


def table_rows() -> Iterable[tuple]:
    """(name, type, default, help) rows, for the CLI and the docs."""
    for opt in OPTIONS.values():
        yield opt.name, opt.type.__name__, opt.default, opt.help


def format_table(width: Optional[int] = None) -> str:
    """The option table as ``ownsan options`` prints it: one row per option, its help wrapped to ``width``
    columns (default: the terminal's, 100 when unknown) under a hanging indent at the help column, so the
    name, type and default columns stay readable. Too narrow a terminal for that: the help goes below the
    row, indented by four."""
    import shutil
    import textwrap

    if width is None:
        width = shutil.get_terminal_size((100, 24)).columns
    width = max(width, 40) - 1  # a line that fills the last column wraps on some terminals
    rows = list(table_rows())
    name_w = max(len(r[0]) for r in rows)
    cells = []
    for name, typ, default, text in rows:
        shown = int(default) if isinstance(default, bool) else (repr(default) if default == "" else default)
        cells.append((f"{name:<{name_w}}  {typ:<5}  {str(shown):<8}  ", text))
    indent = max(len(head) for head, _ in cells)
    lines = [f"{'option':<{name_w}}  {'type':<5}  {'default':<8}  help"]
    for head, text in cells:
        if width - indent >= 30:
            lines.extend(textwrap.wrap(text, width, initial_indent=head.ljust(indent),
                                       subsequent_indent=" " * indent, break_on_hyphens=False))
        else:
            lines.append(head.rstrip())
            lines.extend(textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="    ",
                                       break_on_hyphens=False))
    return "\n".join(lines)


README_BEGIN = "<!-- options-table: generated from sanitizer/core/options.py by `ownsan options --sync-readme docs/options.md` -->"
README_END = "<!-- /options-table -->"


def _shown(opt: Option) -> str:
    if isinstance(opt.default, bool):
        return str(int(opt.default))
    if opt.default == "":
        return "(none)"
    return f"{opt.default:#04x}" if opt.byte else str(opt.default)


def markdown_table() -> str:
    """The option table as the README shows it (the README's copy is generated from this)."""
    lines = ["| option | type | default | meaning |", "| --- | --- | --- | --- |"]
    for opt in OPTIONS.values():
        lines.append(f"| `{opt.name}` | {opt.type.__name__} | {_shown(opt)} | {opt.help} |")
    return "\n".join(lines)


class ReadmeError(ValueError):
    """A page ``sync_readme`` cannot update (missing, unreadable, without its markers): the message names
    the file and what is wrong, for one line of ``ownsan options --sync-readme`` (exit status 2)."""


def sync_readme(path: str) -> bool:
    """Rewrite the generated block of ``path``; returns True when it changed. Raises
    :class:`ReadmeError` (once a bare ``ValueError: substring not found`` traceback) when the file is
    missing or unreadable, or lacks a marker; the file is then left as it was."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ReadmeError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ReadmeError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    begin = text.find(README_BEGIN)
    if begin < 0:
        raise ReadmeError(f"{path}: has no begin marker {README_BEGIN!r} (the options table goes between it "
                          f"and {README_END!r})")
    start = begin + len(README_BEGIN)
    end = text.find(README_END, start)
    if end < 0:
        if README_END in text[:begin]:
            raise ReadmeError(f"{path}: its end marker {README_END!r} comes before its begin marker "
                              f"{README_BEGIN[:19]!r}..., not after it")
        raise ReadmeError(f"{path}: has no end marker {README_END!r} after its begin marker "
                          f"{README_BEGIN[:19]!r}...")
    updated = text[:start] + "\n" + markdown_table() + "\n" + text[end:]
    if updated != text:
        try:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(updated)
        except OSError as exc:
            raise ReadmeError(f"{path}: cannot write it ({exc.strerror or exc})") from None
    return updated != text


__all__ = ["Option", "OPTIONS", "OptionError", "defaults", "resolve", "parse_options_string", "format_options_string",
           "switch_from_env", "format_table", "table_rows", "ENV_SWITCH", "ENV_OPTIONS", "parse_bool",
           "markdown_table", "sync_readme", "ReadmeError", "QUOTING"]

