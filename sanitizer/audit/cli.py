"""``ownsan audit [PATH...]`` (also ``python -m sanitizer audit`` and ``python -m sanitizer.audit``).

Its conventions are a linter's, spelt as ruff spells them: no PATH audits ``.``; ``--select``, ``--ignore``,
``--extend-select``, ``--extend-ignore``, ``--exclude``, ``--extend-exclude``, ``--per-file-ignores`` on
top of ``[tool.ownsan]``'s keys of the same names; ``# noqa: OWN106`` honoured. ``-o`` is not one of its
flags: across ``ownsan`` a short flag means one thing, and ``-o`` is ``ownsan run --option``.

Exit status: 0 when nothing is found, 1 when a finding is reported (or, with ``--report``, a retention
the run saw that the audit missed), 2 on a usage error: a path that does not exist, a file that does
not parse (named: whatever Python cannot compile), an unknown code in --select/--ignore, an unreadable
--report; and 2 when the audit is incomplete: a function too deep to follow is named as skipped (the
rest is audited and reported, as it is around a file that does not parse).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from sanitizer.audit.codes import CODES, CodeSelectionError
from sanitizer.core import output_file, report_file
from sanitizer.core.suggest import HintingParser

def epilog(width: Optional[int] = None) -> str:
    """The codes with their whole meaning (never cut at a parenthesis or a colon), each wrapped to ``width``
    (the terminal's, 100 when unknown) under a hanging indent, so the code column stays readable."""
    import shutil
    import textwrap

    width = max(40, width or shutil.get_terminal_size((100, 24)).columns) - 1
    lines = ["codes:"]
    for c in CODES.values():
        head = f"  {c.code}  "
        lines.extend(textwrap.wrap(f"{c.name}: {c.meaning}", width, initial_indent=head,
                                   subsequent_indent=" " * len(head), break_on_hyphens=False))
    return "\n".join(lines) + \
        "\n\nsuppress one statement with `# noqa: OWN101` or `# ownsan: ignore[OWN101]` (bare: every code)."


def build_parser(prog: str = "ownsan audit") -> argparse.ArgumentParser:
    p = HintingParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog(),
        description="Find, without running it, every statement of a code base that keeps a tensor a weight "
                    "loader yielded (or a view of it) past the loader's step. Reads the source with ast; "
                    "never imports it, never imports torch.")
    p.add_argument("paths", nargs="*", metavar="PATH", help="Python files or directories (default: .)")
    p.add_argument("--format", choices=("text", "concise", "json", "sarif"), default="text",
                   help="text (default: each finding with its chain and fix), concise (one line each), "
                        "json (findings_schema.json), sarif (SARIF 2.1.0, for code scanning)")
    p.add_argument("--output", metavar="FILE", default=None, help="write the output here, not to stdout")
    rules = p.add_argument_group("which codes and files (as ruff spells them; on top of [tool.ownsan])")
    rules.add_argument("--select", action="append", default=[], metavar="CODES",
                       help="report only these codes, instead of the settings' select (comma-separated; a prefix "
                            "such as OWN10 selects several, ALL every code)")
    rules.add_argument("--extend-select", action="append", default=[], metavar="CODES",
                       help="report these codes as well")
    rules.add_argument("--ignore", action="append", default=[], metavar="CODES", help="do not report these codes")
    rules.add_argument("--extend-ignore", action="append", default=[], metavar="CODES",
                       help="the same as --ignore (ruff's older spelling)")
    rules.add_argument("--exclude", action="append", default=None, metavar="GLOBS",
                       help="leave these files and directories out of an audited directory, instead of the "
                            "settings' exclude (comma-separated globs)")
    rules.add_argument("--extend-exclude", action="append", default=[], metavar="GLOBS",
                       help="leave these out as well")
    rules.add_argument("--per-file-ignores", action="append", default=None, metavar="GLOB:CODE",
                       help="ignore CODE in the files GLOB matches, instead of the settings' per-file-ignores "
                            "(comma-separated pairs)")
    rules.add_argument("--extend-per-file-ignores", action="append", default=[], metavar="GLOB:CODE",
                       help="the same, on top of the settings' per-file-ignores")
    p.add_argument("--report", metavar="REPORT", default=None,
                   help="an ownsan run report (ownsan-report.json): mark the findings the run confirmed and "
                        "list the retentions it saw that the audit missed")
    p.add_argument("--exit-zero", action="store_true", help="exit 0 even when something is found")
    p.add_argument("--config", metavar="PYPROJECT", default=None,
                   help="read [tool.ownsan] from this file (default: the nearest pyproject.toml that has one, "
                        "above the first PATH)")
    p.add_argument("--show-settings", action="store_true",
                   help="print the settings in effect (the file read, producers, consumers, per-path ignores) "
                        "and exit")
    return p


def _split(values: Optional[Sequence[str]]) -> Optional[List[str]]:
    """Repeated, comma-separated option values -> one list (None stays None: the option was not given)."""
    return None if values is None else [v.strip() for raw in values for v in raw.split(",") if v.strip()]


def _short_o(argv: Sequence[str]) -> bool:
    """Is ``-o`` (``-o FILE``, ``-oFILE``) among the flags? Once ``--output``'s short form; now refused with
    a line that says what to write, rather than argparse's bare "unrecognized argument"."""
    for arg in argv:
        if arg == "--":
            return False
        if arg.startswith("-o") and not arg.startswith("--"):
            return True
    return False


def main(argv: Optional[Sequence[str]] = None, prog: str = "ownsan audit") -> int:
    parser = build_parser(prog)
    argv = list(sys.argv[1:] if argv is None else argv)
    if _short_o(argv):
        print(f"{prog}: -o is not a flag of ownsan audit (across ownsan, -o is ownsan run's --option); "
              f"write --output FILE", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage printed; --help is 0
        return exc.code if isinstance(exc.code, int) else 2
    paths = args.paths or ["."]  # as ruff checks the current directory
    extend_select = args.extend_select
    ignore = args.ignore + args.extend_ignore
    from sanitizer.audit.engine import reported_codes
    from sanitizer.audit.settings import SettingsError, resolve

    try:
        reported_codes(args.select, ignore, None, extend_select)
        settings = resolve(paths, args.config).overridden(
            _split(args.exclude), _split(args.extend_exclude) or (), args.per_file_ignores,
            args.extend_per_file_ignores)
    except (SettingsError, CodeSelectionError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    if args.show_settings:  # with the producers the audit would infer over these paths (and where from)
        from sanitizer.audit.inference import infer_paths
        from sanitizer.audit.sources import AuditInputError, python_files

        try:
            settings = infer_paths(python_files(paths, settings.exclusion()), settings)
        except AuditInputError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(settings.describe())
        return 0
    from sanitizer.audit import crosscheck as cc
    from sanitizer.audit.engine import audit_paths
    from sanitizer.audit.formats import render
    from sanitizer.audit.sources import AuditInputError

    report = None
    if args.report:
        try:
            report = cc.load_report(args.report)
        except cc.ReportError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        note = report_file.journal_note(args.report, report)
        if note:  # the run was killed: its findings come from its journal
            print(f"{prog}: --report: {note}", file=sys.stderr)
    try:
        result = audit_paths(paths, args.select, ignore, settings, extend_select)
    except AuditInputError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    checked = cc.crosscheck(result, report, args.report, result.paths) if report is not None else None
    text = render(result, args.format, checked)
    if args.output:
        try:
            write_output(args.output, text)
        except OSError as exc:
            print(f"{prog}: cannot write {args.output!r} ({exc.strerror or exc})", file=sys.stderr)
            return 2
    else:
        write_stdout(text)
    if args.format in ("json", "sarif") or args.output:  # stdout is not where a person reads them
        for err in result.errors:
            print(f"{prog}: {err}", file=sys.stderr)
        for skip in result.skipped:
            print(f"{prog}: skipped {skip}", file=sys.stderr)
    if result.errors or result.skipped:  # the audit is incomplete: a file not read, a function not followed
        return 2
    found = bool(result.findings) or bool(checked and checked["missed"])
    return 1 if found and not args.exit_zero else 0


def _encoded(text: str, encoding: str = "utf-8") -> bytes:
    """The bytes of an output: a file name that is not UTF-8 (a surrogate escape) goes back to the name's
    own bytes, as ``ls`` shows it and a shell names it; anything else unencodable as a backslash escape."""
    try:
        return text.encode(encoding, "surrogateescape")
    except UnicodeEncodeError:
        return text.encode(encoding, "backslashreplace")


def write_output(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (an error half way, a full disk, an interrupt once
    left a truncated report that a CI step read as the audit's): :func:`sanitizer.core.output_file.write_bytes`,
    the one writer of every output file, atomic for a regular file (its mode kept, a symlink's target
    written), written through for a FIFO, a device or ``/dev/stdout``, never replacing what those stand for."""
    output_file.write_bytes(path, _encoded(text))


def write_stdout(text: str) -> None:
    """``text`` on stdout, never a traceback for a file name that is not UTF-8: a strict stdout
    (``PYTHONIOENCODING=utf-8:strict``, a UTF-8 locale) refuses its surrogate escape, so then the bytes
    go to the underlying buffer as :func:`_encoded` makes them."""
    try:
        text.encode(sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict")
    except (UnicodeEncodeError, LookupError):
        buffer = getattr(sys.stdout, "buffer", None)
        if buffer is not None:
            sys.stdout.flush()
            buffer.write(_encoded(text, sys.stdout.encoding or "utf-8"))
            buffer.flush()
            return
        text = _encoded(text, sys.stdout.encoding or "utf-8").decode(sys.stdout.encoding or "utf-8", "replace")
    sys.stdout.write(text)


__all__ = ["main", "build_parser", "write_output", "write_stdout"]
