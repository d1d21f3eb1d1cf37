"""``ownsan``: run a program under the sanitizer, read its report, show the options.

    ownsan run [-o k=v ...] [--report PATH] -- python script.py args
    ownsan triage report.json
    ownsan demo [demo args]
    ownsan options
    ownsan fuzz [fuzz args]
    ownsan install-hook | uninstall-hook

``run`` needs no change to the program: it sets ``OWNERSHIP_SANITIZE=1`` (with
``triage=1``, so the program runs to the end and every retaining consumer is
recorded) and puts a ``sitecustomize`` on ``PYTHONPATH`` that arms the same
start-up hook as the installed .pth, so every Python process the command
starts (ranks, workers) is sanitized and writes its own report; they are merged
into one. Exit status: the program's own when it failed, else 1 when the
sanitizer recorded an error (or a retention, with ``--fail-on-retention``),
else 0. Argument errors print the usage and exit 2.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from sanitizer.core import options as _opts
from sanitizer.core.units import format_bytes
from sanitizer.tools import startup

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _report_mod():
    return importlib.import_module("sanitizer.reporting.report")  # the package's `report` attribute is the function


# -- run ---------------------------------------------------------------------
_SITECUSTOMIZE = '''"""Written by `ownsan run`: arm the ownership sanitizer's start-up hook, then the real sitecustomize."""
import importlib.machinery as _m, importlib.util as _u, os as _os, sys as _sys
if _u.find_spec("sanitizer") is None:
    _sys.path.append({parent!r})  # the sanitizer that `ownsan` itself runs from
{bootstrap}
_me = _os.path.dirname(_os.path.abspath(__file__))
_spec = _m.PathFinder.find_spec("sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _me])
if _spec is not None and _spec.loader is not None:
    _mod = _u.module_from_spec(_spec)
    _sys.modules["sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
'''


def _parse_options(items: Sequence[str], parser: argparse.ArgumentParser) -> Dict[str, str]:
    """``-o a=1 -o b=2:c=3`` -> validated strings (usage error, exit 2, on a bad one)."""
    out: Dict[str, str] = {}
    for item in items:
        try:
            out.update(_opts.parse_options_string(item))
        except _opts.OptionError as exc:
            parser.error(str(exc))
    if "report" in out:
        parser.error("option 'report' is set by ownsan run; use --report PATH to choose where the report goes")
    for name, value in out.items():
        if ":" in value or "," in value:
            parser.error(f"option '{name}': value {value!r} may not contain ':' or ','")
    try:
        _opts.resolve(out)
    except _opts.OptionError as exc:
        parser.error(str(exc))
    return out


class _Progress:
    """A one-line spinner with the elapsed time on a terminal; silent otherwise."""

    def __init__(self, what: str, stream: Any = None):
        self.stream = stream or sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        self.what = what if len(what) <= 50 else what[:47] + "..."
        self.start = time.monotonic()
        self.i = 0

    def tick(self, reports: int) -> None:
        if not self.on:
            return
        self.i += 1
        extra = f", {reports} process report{'s' * (reports != 1)} written" if reports else ""
        spin = "|/-\\"[self.i % 4]
        self.stream.write(f"\r{spin} ownsan: running {self.what} ({time.monotonic() - self.start:.1f} s"
                          f"{extra})\x1b[K")
        self.stream.flush()

    def done(self) -> None:
        if self.on:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _wait(proc: Any, progress: _Progress, report_dir: str) -> int:
    while True:
        try:
            return proc.wait(timeout=0.2 if progress.on else None)
        except KeyboardInterrupt:  # the child got the same SIGINT: let it finish writing its report
            continue
        except Exception:  # TimeoutExpired: time to redraw
            progress.tick(len(glob.glob(os.path.join(report_dir, "report-*.json"))))


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import subprocess

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the program to run after --, e.g.: ownsan run -- python train.py")
    options = _parse_options(args.option, parser)
    options.setdefault("triage", "1")
    tmp = tempfile.mkdtemp(prefix="ownsan-")
    try:
        boot = os.path.join(tmp, "boot")
        os.makedirs(boot)
        with open(os.path.join(boot, "sitecustomize.py"), "w", encoding="utf-8") as fh:
            fh.write(_SITECUSTOMIZE.format(parent=_PKG_PARENT, bootstrap=startup.BOOTSTRAP))
        env = dict(os.environ)
        env[startup.ENV_SWITCH] = "1"
        env[_opts.ENV_OPTIONS] = ":".join([f"{k}={v}" for k, v in options.items()]
                                           + [f"report={os.path.join(tmp, 'report-{pid}.json')}"])
        env["PYTHONPATH"] = os.pathsep.join([boot] + [p for p in [env.get("PYTHONPATH")] if p])
        progress = _Progress(" ".join(command))
        try:
            proc = subprocess.Popen(command, env=env)
        except OSError as exc:
            print(f"ownsan run: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            return 127
        code = _wait(proc, progress, tmp)
        progress.done()
        code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
        return _finish_run(args, sorted(glob.glob(os.path.join(tmp, "report-*.json"))), code)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _finish_run(args: argparse.Namespace, files: List[str], code: int) -> int:
    rep_mod = _report_mod()
    if not files:
        print("ownsan run: no process wrote a report (the program never imported torch, or exited through "
              "os._exit): nothing was sanitized", file=sys.stderr)
        return code
    merged = rep_mod.merge([rep_mod.load(f) for f in files])
    with open(args.report, "w", encoding="utf-8") as fh:
        json.dump(merged, fh, indent=2)
        fh.write("\n")
    if args.quiet:
        print(merged["summary"]["line"], file=sys.stderr)
    else:
        print(format_triage(merged, args.report, top=args.top), file=sys.stderr)
    if code:
        return code
    if merged["error_count"] or (args.fail_on_retention and merged["summary"]["retentions"]):
        return 1
    return 0


# -- triage ------------------------------------------------------------------
_size = format_bytes  # the one byte-size formatter, shared with the report


def _frame(rec: Optional[dict]) -> str:
    if not rec:
        return "?"
    return f"{rec.get('function')} {rec.get('file')}:{rec.get('line')}"


def format_triage(rep: Dict[str, Any], path: Optional[str] = None, top: int = 20) -> str:
    """The human summary: one line, the retaining consumers by bytes with holder and sites, then the errors."""
    summary = rep["summary"]
    who = f"pid {rep['pid']}" if "processes" not in rep else f"{len(rep['processes'])} processes"
    if rep.get("rank") is not None:
        who += f", rank {rep['rank']} of {rep.get('world_size')}"
    lines = [summary["line"], f"report: {path or '(in process)'} ({who})"]
    consumers = summary["retaining_consumers"]
    if consumers:
        lines += ["", "retaining consumers, most bytes first:"]
        rows = [("#", "bytes", "count", "stale", "kind", "holder")]
        rows += [(str(i), _size(g["bytes"]), str(g["count"]), str(g["used_stale"]), g["kind"], g["consumer"])
                 for i, g in enumerate(consumers[:top], 1)]
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        for i, row in enumerate(rows):
            lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(row[:5], widths)) + "  " + row[5])
            if i == 0:
                continue
            g = consumers[i - 1]
            pad = "  " + " " * (sum(widths) + 2 * 5)
            first = g["first"]
            names = ", ".join(repr(n) for n in g["leases"][:4]) + (", ..." if g["count"] > 4 else "")
            lines.append(f"{pad}holder lives at {g['site'] or '?'}")
            lines.append(f"{pad}e.g. {first['holder']['path'] if first.get('holder') else '?'}")
            lines.append(f"{pad}leases: {names}")
            lines.append(f"{pad}lent at {_frame(first.get('lent_at'))}; reused at {_frame(first.get('reused_at'))}")
        if len(consumers) > top:
            lines.append(f"  ... {len(consumers) - top} more (ownsan triage --top N)")
    errors = rep.get("errors", [])
    if errors:
        lines += ["", "errors (first of each kind):"]
        seen = set()
        for e in errors:
            if e.get("kind") in seen:
                continue
            seen.add(e.get("kind"))
            lines.append(f"  {e.get('kind')}: {e.get('summary')}")
            if e.get("holder"):
                lines.append(f"    held by {e['holder']['path']}")
    pending = summary.get("pending_retentions")
    if pending:
        lines.append(f"\n({pending} retention(s) still pending: their consumer had not had its turn when the "
                     f"report was taken)")
    return "\n".join(lines)


def cmd_triage(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    rep_mod = _report_mod()
    try:
        rep = rep_mod.load(args.report)
    except ValueError as exc:
        print(f"ownsan triage: {exc}", file=sys.stderr)
        return 2
    problems = rep_mod.validate(rep)
    if problems:
        print(f"ownsan triage: {args.report} does not match the report schema:", file=sys.stderr)
        for p in problems[:10]:
            print(f"  {p}", file=sys.stderr)
        return 2
    print(format_triage(rep, args.report, top=args.top))
    return 0


# -- the rest ----------------------------------------------------------------
def _dispatch(module: str, argv: Sequence[str], missing: str) -> int:
    if importlib.util.find_spec(module) is None:
        print(missing, file=sys.stderr)
        return 2
    return int(importlib.import_module(module).main(list(argv)) or 0)


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if importlib.util.find_spec("sanitizer.testing.demo") is not None:
        return int(importlib.import_module("sanitizer.testing.demo").main(list(args.args)) or 0)
    if args.args:
        parser.error("the core scenario takes no arguments (the end-to-end demo is not installed)")
    from sanitizer.testing.quickstart import main as quickstart

    return int(quickstart() or 0)


def cmd_fuzz(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    return _dispatch("sanitizer.testing.fuzz", args.args,
                     "ownsan fuzz: the fuzz campaign is not part of this installation (no sanitizer/fuzz.py)")


def cmd_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.sync_readme:
        changed = _opts.sync_readme(args.sync_readme)
        print(f"{args.sync_readme}: {'updated' if changed else 'already in sync'}")
        return 0
    print(_opts.format_table())
    print(f"\nSet them with {_opts.ENV_OPTIONS}=\"name=value:name=value\", sanitizer.enable(name=value), "
          f"or ownsan run -o name=value.")
    return 0


def cmd_install_hook(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(f"installed {startup.install_pth(args.dir)} (active when {startup.ENV_SWITCH}=1)")
    return 0


def cmd_uninstall_hook(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    removed = startup.uninstall_pth(args.dir)
    print(f"removed {removed}" if removed else f"no {startup.PTH_NAME} in {args.dir or startup.site_packages()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ownsan", description="ownership-sanitizer: catch consumers that keep "
                                "borrowed tensor views past their lifetime, and name them.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run a program with the sanitizer on and print who retained what",
                         description="Run COMMAND with the sanitizer on (triage=1: record, do not raise), "
                         "merge the reports of its processes, print the triage summary.")
    run.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                     help="a sanitizer option (see ownsan options); repeat, or join with ':'")
    run.add_argument("--report", default="ownsan-report.json", metavar="PATH",
                     help="where to write the merged JSON report (default: %(default)s)")
    run.add_argument("--fail-on-retention", action="store_true",
                     help="exit 1 when a retention was recorded, even without an error")
    run.add_argument("--top", type=int, default=20, help="consumers shown (default: %(default)s)")
    run.add_argument("-q", "--quiet", action="store_true", help="print only the one-line summary")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    tri = sub.add_parser("triage", help="show a report: retaining consumers by bytes, with holders and sites")
    tri.add_argument("report", help="a report written by ownsan run or report=path")
    tri.add_argument("--top", type=int, default=20, help="consumers shown (default: %(default)s)")
    demo = sub.add_parser("demo", help="the end-to-end demonstration (the layerwise-reload bug, caught and fixed)")
    demo.add_argument("args", nargs=argparse.REMAINDER, help="passed to the demo (ownsan demo -- --help)")
    opt = sub.add_parser("options", help="the option table: names, types, defaults, help")
    opt.add_argument("--sync-readme", metavar="README", default=None,
                     help="rewrite the generated option table in this README instead of printing")
    fuzz = sub.add_parser("fuzz", help="the bounded fuzz campaign")
    fuzz.add_argument("args", nargs=argparse.REMAINDER, help="passed to the fuzzer")
    for name, text in (("install-hook", "write the zero-code activation .pth into site-packages"),
                       ("uninstall-hook", "remove the zero-code activation .pth")):
        hp = sub.add_parser(name, help=text)
        hp.add_argument("--dir", default=None, help="the site directory (default: this environment's)")
    return p


_COMMANDS = {"run": cmd_run, "triage": cmd_triage, "demo": cmd_demo, "options": cmd_options, "fuzz": cmd_fuzz,
             "install-hook": cmd_install_hook, "uninstall-hook": cmd_uninstall_hook}


_PASS_THROUGH = ("demo", "fuzz")  # their flags belong to the command itself (ownsan fuzz --seed 3 -j 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in _PASS_THROUGH:
            sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
            rest = argv[1:][1:] if argv[1:2] == ["--"] else argv[1:]
            return _COMMANDS[argv[0]](argparse.Namespace(cmd=argv[0], args=rest), sub)
        args = parser.parse_args(argv)
        sub = parser._subparsers._group_actions[0].choices[args.cmd]  # type: ignore[union-attr]
        if getattr(args, "args", None) and args.args[:1] == ["--"]:
            args.args = args.args[1:]
        if getattr(args, "top", 1) < 1:
            sub.error(f"--top must be >= 1, got {args.top}")
        return _COMMANDS[args.cmd](args, sub)
    except SystemExit as exc:  # argparse: usage printed, status 2 (or 0 for --help)
        return exc.code if isinstance(exc.code, int) else 2


__all__ = ["main", "build_parser", "format_triage"]
