"""``ownsan``: run a program under the sanitizer, read its report, show the options.

    ownsan run [-o k=v ...] [--report PATH] -- python script.py args
    ownsan triage report.json [--html timeline.html] [--trace trace.json] [--exit-zero]
    ownsan demo [demo args]
    ownsan options
    ownsan fuzz [fuzz args]
    ownsan audit PATH... [--format json|sarif] [--report ownsan-report.json]
    ownsan install-hook | uninstall-hook

``run`` needs no change to the program: it sets ``OWNERSHIP_SANITIZE=1`` (with
``triage=1``, so the program runs to the end and every retaining consumer is
recorded) and puts a ``sitecustomize`` on ``PYTHONPATH`` that arms the same
start-up hook as the installed .pth, so every Python process the command
starts (ranks, workers) is sanitized and writes its own report; they are merged
into one (``sanitizer.reporting.collect``, the one pipeline; the run's report
directory is exported as ``OWNSAN_RUN_REPORT_DIR`` so that a Ray driver's
``ray_env.collect`` hands its workers' reports to it). Exit status: the
program's own when it failed, else 1 when the sanitizer recorded an error or
confirmed a retention in any process (as LeakSanitizer fails a run that leaked;
``-o fail_on_retention=0`` keeps retentions from failing it), else 0;
``triage`` gives a saved report the same status (``--exit-zero``: 0), and 2
when it cannot be read. ``-o report=PATH`` is ``--report PATH``. Argument errors print the
usage of the command they were given to and one line naming the bad value, with
the closest valid name when one is close (``ownsan audti``: did you mean
'audit'?), and exit 2. ``--help`` and argument errors never import torch: each
command parses its arguments before it imports what its work needs.
"""
from __future__ import annotations

import argparse
import json
import glob
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from sanitizer.core import options as _opts
from sanitizer.core import output_file
from sanitizer.core.suggest import HintingParser
from sanitizer.core.version import __version__
from sanitizer.reporting import collect
from sanitizer.reporting.text import format_triage
from sanitizer.tools import startup

_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    try:
        _opts.resolve(out)
    except _opts.OptionError as exc:
        parser.error(str(exc))
    return out


def _options_from_env(parser: argparse.ArgumentParser) -> Dict[str, str]:
    """The options already in the environment (``OWNERSHIP_SANITIZE_OPTIONS``), which ``-o`` overrides one
    by one: the run sets that variable for its processes, and a user's own setting must not vanish under it
    without a word (a ``safetensors_ring`` set there was dropped and the run checked nothing it asked for)."""
    text = os.environ.get(_opts.ENV_OPTIONS, "")
    if not text.strip():
        return {}
    try:
        found = _opts.parse_options_string(text)
        _opts.resolve(found)
    except _opts.OptionError as exc:
        parser.error(f"{_opts.ENV_OPTIONS} in the environment: {exc}")
    found.pop("report", None)  # each process's report is the run's to place (--report names the merged one)
    return found


class _Progress:
    """A one-line spinner with the elapsed time on a terminal; silent otherwise."""

    def __init__(self, what: str, stream: Any = None):
        self.stream = stream or sys.stderr
        self.on = bool(getattr(self.stream, "isatty", lambda: False)())
        what = " ".join("".join(c if c.isprintable() else " " for c in what).split())  # one line, always
        self.what = what if len(what) <= 50 else what[:47] + "..."
        self.start = time.monotonic()
        self.i = 0

    shown = False  # the line is on the screen now

    def tick(self, reports: int) -> None:
        if not self.on:
            return
        self.i += 1
        extra = f", {reports} process report{'s' * (reports != 1)} written" if reports else ""
        spin = "|/-\\"[self.i % 4]
        line = f"{spin} ownsan: running {self.what} ({time.monotonic() - self.start:.1f} s{extra})"
        width = shutil.get_terminal_size((80, 24)).columns - 1  # a wrapped line could not be erased
        self.stream.write(f"\r{line[:max(width, 10)]}\x1b[K")
        self.stream.flush()
        self.shown = True

    def clear(self) -> None:
        self.stream.write("\r\x1b[K")
        self.stream.flush()
        self.shown = False

    def done(self) -> None:
        if self.on and self.shown:
            self.clear()


def _wait(proc: Any, progress: _Progress, report_dir: str) -> int:
    while True:
        try:
            return proc.wait(timeout=0.2 if progress.on else None)
        except KeyboardInterrupt:  # the child got the same SIGINT: let it finish writing its report
            continue
        except Exception:  # TimeoutExpired: time to redraw
            progress.tick(len(glob.glob(os.path.join(report_dir, "report-*.json"))))


def _run_child(command: List[str], env: Dict[str, str], progress: _Progress, report_dir: str) -> int:
    """Run the program; with a progress line, through a pseudo-terminal so the line never covers its output."""
    import subprocess

    relay = _TerminalRelay.open() if progress.on else None
    if relay is None:
        progress.on = False  # the child would write over the line (and the line over it): no line
        return _wait(subprocess.Popen(command, env=env), progress, report_dir)
    try:
        proc = subprocess.Popen(command, env=env, stdout=relay.slave if sys.stdout.isatty() else None,
                                stderr=relay.slave)
        relay.started()
        return relay.pump(proc, progress, report_dir)
    finally:
        relay.close()
        progress.done()


class _TerminalRelay:
    """The child's terminal output goes through a pseudo-terminal of its own (so it still sees a terminal:
    colours, line buffering, its width) and we copy it to ours. The progress line is erased before each
    piece of output and drawn again only while the child's cursor is at the start of a line, so neither
    ever writes over the other (a child's own ``\\r`` progress bar included)."""

    def __init__(self, master: int, slave: int):
        self.master, self.slave = master, slave
        self.at_line_start = True
        self._winch: Any = None

    @classmethod
    def open(cls) -> "Optional[_TerminalRelay]":
        try:
            import pty

            master, slave = pty.openpty()
        except (ImportError, OSError):
            return None
        relay = cls(master, slave)
        relay._copy_size()
        return relay

    def _copy_size(self, *_: Any) -> None:
        try:
            import fcntl
            import termios

            size = fcntl.ioctl(sys.stderr.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
            fcntl.ioctl(self.slave, termios.TIOCSWINSZ, size)
        except (ImportError, OSError, ValueError):
            pass

    def started(self) -> None:
        os.close(self.slave)  # the child holds it now; EOF on the master once every writer is gone
        self.slave = -1
        try:
            import signal

            self._winch = signal.signal(signal.SIGWINCH, self._copy_size)  # window resized: tell the child
        except (ImportError, AttributeError, ValueError):  # no SIGWINCH, or not the main thread
            self._winch = None

    def _copy_out(self, data: bytes, progress: _Progress) -> None:
        if progress.shown:
            progress.clear()
        out = sys.stderr.fileno()
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
        self.at_line_start = data.endswith(b"\n")

    def pump(self, proc: Any, progress: _Progress, report_dir: str) -> int:
        import select

        code = None
        while True:
            try:
                ready, _, _ = select.select([self.master], [], [], 0.2 if code is None else 0.05)
            except KeyboardInterrupt:  # the child got the same SIGINT: let it finish writing its report
                continue
            except InterruptedError:
                continue
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    data = b""
                if not data:
                    break
                self._copy_out(data, progress)
                continue
            if code is not None:
                break  # exited, and a grandchild that still holds the terminal is quiet: stop here
            code = proc.poll()
            if code is None and self.at_line_start:
                progress.tick(len(glob.glob(os.path.join(report_dir, "report-*.json"))))
        while code is None:
            try:
                code = proc.wait()
            except KeyboardInterrupt:
                continue
        return code

    def close(self) -> None:
        if self._winch is not None:
            import signal

            signal.signal(signal.SIGWINCH, self._winch)
        for fd in (self.master, self.slave):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import subprocess

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser.error("give the program to run after --, e.g.: ownsan run -- python train.py")
    options = _options_from_env(parser)
    options.update(_parse_options(args.option, parser))
    options = _project_suppressions(options)
    if "report" in options:  # -o report=PATH is --report PATH (each process's own report is ours to place)
        args.report = options.pop("report") or args.report
    # A confirmed retention fails the run, as LeakSanitizer fails a run that leaked (-o fail_on_retention=0: not).
    args.fail_on_retention = bool(_opts.resolve(options)["fail_on_retention"])
    why = _unwritable(args.report)
    if why:  # say so now, not after a long run whose findings would then be lost
        parser.error(f"--report {args.report!r}: cannot write the report there ({why}); nothing was run")
    options.setdefault("triage", "1")
    tmp = tempfile.mkdtemp(prefix="ownsan-")
    try:
        boot = os.path.join(tmp, "boot")
        os.makedirs(boot)
        with open(os.path.join(boot, "sitecustomize.py"), "w", encoding="utf-8") as fh:
            fh.write(_SITECUSTOMIZE.format(parent=_PKG_PARENT, bootstrap=startup.BOOTSTRAP))
        env = dict(os.environ)
        env[startup.ENV_SWITCH] = "1"
        env[collect.ENV_RUN_DIR] = tmp  # a Ray driver's collect() hands its workers' reports to us here
        env[_opts.ENV_OPTIONS] = _opts.format_options_string(
            {**options, "report": os.path.join(tmp, "report-{pid}.json")})
        env["PYTHONPATH"] = os.pathsep.join([boot] + [p for p in [env.get("PYTHONPATH")] if p])
        progress = _Progress(" ".join(command))
        try:
            code = _run_child(command, env, progress, tmp)
        except OSError as exc:
            print(f"ownsan run: cannot start {command[0]!r}: {exc.strerror or exc}", file=sys.stderr)
            return 127
        code = 128 - code if code < 0 else code  # killed by a signal: the shell's convention
        return _finish_run(args, _process_reports(tmp), code)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _project_suppressions(options: Dict[str, str]) -> Dict[str, str]:
    """``-o suppressions=FILE``, else the project's ``[tool.ownsan] suppressions`` (the nearest pyproject.toml
    above the current directory), checked now: a broken table or suppressions file is one line (naming the
    pyproject.toml and the rule) and exit 2 before anything runs, never a child that fails to start."""
    from sanitizer.audit import settings as project_table
    from sanitizer.core import suppressions
    from sanitizer.tools.project_settings import with_project_suppressions

    try:
        found = with_project_suppressions(options, os.getcwd())
    except project_table.SettingsError as exc:
        print(f"ownsan run: {exc}; nothing was run", file=sys.stderr)
        raise SystemExit(2) from None
    if "suppressions" in found and "suppressions" not in options:
        why = suppressions.check(found["suppressions"])
        if why:
            print(f"ownsan run: {project_table.find([os.getcwd()])}: [tool.ownsan] suppressions: {why}; "
                  f"nothing was run", file=sys.stderr)
            raise SystemExit(2)
    return found


def _unwritable(path: str) -> Optional[str]:
    """Why a report could not be written to ``path``, or None; tried for real (a read-only file system,
    or a file root may not write, is caught too), leaving no file behind."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return "it is a directory"
    if not os.path.isdir(os.path.dirname(full)):
        return f"no directory {os.path.dirname(full)}"
    existed = os.path.exists(full)
    if existed and not os.path.isfile(full):  # a device or a FIFO (opening one could wait for its reader)
        return None if os.access(full, os.W_OK) else "permission denied"
    try:
        with open(full, "a", encoding="utf-8"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        os.remove(full)
    return None


def _write_report(merged: Dict[str, Any], path: str) -> str:
    """Write the merged report to ``path``; if that fails now (it was writable at the start), to a temporary
    file instead, so the findings are never lost. Returns where it went."""
    try:
        return collect.write(merged, path)  # never half a report; /dev/null, a FIFO, a link kept as they are
    except OSError as exc:
        fd, fallback = tempfile.mkstemp(prefix="ownsan-report-", suffix=".json")
        os.close(fd)
        collect.write(merged, fallback)
        print(f"ownsan run: cannot write {path!r} ({exc.strerror or exc}); the report is in {fallback}",
              file=sys.stderr)
        return fallback


def _process_reports(directory: str) -> "collect.Collected":
    """Each process's report (its journal when it ended before writing one), and a Ray driver's collected
    workers' (``ray_env.collect`` under ``ownsan run``), read and merged by the one pipeline. A Ray job that
    never called ``collect()`` left only a pointer to its workers' directory (``runtime_env``): those reports
    are merged here, said in one line (without it the run printed "0 errors" and passed)."""
    uncollected = collect.pointed(directory)
    for place in uncollected:
        print(f"ownsan run: the Ray workers' reports in {place} were never collected (call collect() before "
              f"ray.shutdown()): merged here, as their workers last wrote them", file=sys.stderr)
    return collect.collect([directory, *uncollected])


def _finish_run(args: argparse.Namespace, found: "collect.Collected", code: int) -> int:
    if found.report is None and not found.unreadable:
        # A CI gate that ran nothing sanitized must not pass as if it had (a wrong interpreter, a command that
        # never reaches torch): a failing status, unless the run was told that is expected.
        allowed = getattr(args, "allow_unsanitized", False)
        print("ownsan run: no process wrote a report (the program never imported torch, or exited through "
              "os._exit): nothing was sanitized" + ("" if allowed or code else
                                                    "; exit status 1 (--allow-unsanitized: the program's own)"),
              file=sys.stderr)
        return code if allowed or code else 1
    for line in found.notes("ownsan run"):
        # A report is written whole (replaced atomically), so an unreadable file is a journal whose first
        # line was cut short: its process was killed while it recorded its first finding. That finding is
        # lost; the other processes' are all here, and the run fails for it.
        print(line, file=sys.stderr)
    if found.report is None:
        return code or 1
    merged = found.report
    args.report = _write_report(merged, args.report)
    if args.quiet:
        print(merged["summary"]["line"], file=sys.stderr)
    else:
        print(format_triage(merged, args.report, top=args.top), file=sys.stderr)
    if code:
        return code
    return 1 if found.failing(args.fail_on_retention) else 0


# -- triage ------------------------------------------------------------------
def cmd_triage(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Reads JSON only: torch is not imported (the runtime's report module is, for a journal's summary).
    Exit status as ``ownsan run``'s: 1 when the report has an error or a confirmed retention (unless it was
    made with ``fail_on_retention=0``), 0 when it has none or with ``--exit-zero``; 2 when it cannot be read."""
    from sanitizer.core import report_file

    found = collect.collect([args.report])
    if found.report is None:
        for problem in found.unreadable or [f"no report at {args.report!r}"]:
            print(f"ownsan triage: {problem}", file=sys.stderr)
        return 2
    rep = found.report
    note = report_file.journal_note(args.report, rep)
    if note:
        print(f"ownsan triage: {note}", file=sys.stderr)
    if args.json:  # the summary the table is printed from (counts, consumers, suppressed), as data
        print(json.dumps(rep.get("summary", {}), indent=2, default=str))
    else:
        _print(format_triage(rep, args.report, top=args.top))
    sys.stdout.flush()  # before a page or a trace written through /dev/stdout
    for flag in ("html", "trace"):
        target = getattr(args, flag, None)
        if target:
            try:
                _write_view(flag, rep, target)
            except (OSError, ValueError) as exc:  # ValueError: a path with a NUL in it
                print(f"ownsan triage: cannot write {target!r} ({getattr(exc, 'strerror', None) or exc})",
                      file=sys.stderr)
                return 2
            _print(f"wrote {target}" + (" (one page, no network: open it in a browser)" if flag == "html"
                                        else " (Chrome trace events: open it in Perfetto or chrome://tracing)"))
    return 1 if collect.failing(rep) and not args.exit_zero else 0


def _write_view(flag: str, rep: Dict[str, Any], target: str) -> None:
    """``--html``: the timeline page; ``--trace``: its Chrome trace events."""
    if flag == "html":
        from sanitizer.reporting.timeline import write_html

        write_html(rep, target)
    else:
        from sanitizer.reporting.trace import write_trace

        write_trace(rep, target)


def _print(text: str) -> None:
    """Print ``text`` on stdout; a non-UTF-8 name in it (surrogate escapes) is shown escaped (``\\xff``) where
    stdout cannot encode it (a UTF-8 locale is strict), never a UnicodeEncodeError after the work is done."""
    try:
        print(text)
    except UnicodeEncodeError:
        print(output_file.printable(text))


# -- the rest ----------------------------------------------------------------
def _missing(command: str, modules: Sequence[str], extra: str, args: Sequence[str] = ()) -> bool:
    """Say which optional packages ``command`` lacks (and the extra that installs them); False when none.
    ``--help`` never needs them."""
    if "-h" in args or "--help" in args:
        return False
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"ownsan {command}: needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
              f"installed; install it with: pip install 'ownership-sanitizer[{extra}]'", file=sys.stderr)
    return bool(missing)


_QUICKSTART = os.path.join(_PKG_PARENT, "examples", "quickstart.py")


def _quickstart(why: str) -> int:
    """Run the core scenario, ``examples/quickstart.py``, as a program of its own (its own frames, its own
    ``main``). A checkout, an editable install and an unpacked sdist have it; a wheel ships no examples, and
    then this says what to install instead."""
    if not os.path.isfile(_QUICKSTART):
        print(f"ownsan demo: {why}, and the core scenario (examples/quickstart.py) is not part of this "
              "installation", file=sys.stderr)
        return 2
    import runpy

    return int(runpy.run_path(_QUICKSTART, run_name="ownsan_quickstart")["main"]() or 0)


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if importlib.util.find_spec("sanitizer.testing.demo") is not None:
        if _missing("demo", ["safetensors"], "demo", args.args):
            if args.args or not os.path.isfile(_QUICKSTART):
                return 2
            print("ownsan demo: running the core scenario instead (torch only)\n", file=sys.stderr)
            return _quickstart("safetensors is missing")
        from sanitizer.testing import demo

        return int(demo.main(list(args.args), prog="ownsan demo") or 0)
    if args.args:
        parser.error("the core scenario takes no arguments (the end-to-end demo is not installed)")
    return _quickstart("the end-to-end demo is not installed")


def cmd_fuzz(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if importlib.util.find_spec("sanitizer.testing.fuzz") is None:
        print("ownsan fuzz: the fuzz campaign is not part of this installation (no sanitizer/testing/fuzz.py)",
              file=sys.stderr)
        return 2
    from sanitizer.testing.fuzz_args import build_parser as fuzz_parser

    fuzz = fuzz_parser()
    parsed = fuzz.parse_args(list(args.args))  # --help and usage errors first, before torch is imported
    if _missing("fuzz", ["safetensors"], "fuzz", args.args):
        return 2
    from sanitizer.testing.fuzz import run as run_campaign

    return int(run_campaign(parsed, fuzz) or 0)


def cmd_audit(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The static auditor (torch-free, imported only when asked for): see sanitizer/audit and docs/audit.md."""
    from sanitizer.audit.cli import main as audit_main

    return int(audit_main(list(args.args)) or 0)


def cmd_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.sync_readme:
        try:
            changed = _opts.sync_readme(args.sync_readme)
        except _opts.ReadmeError as exc:
            print(f"ownsan options: {exc}", file=sys.stderr)
            return 2
        print(f"{args.sync_readme}: {'updated' if changed else 'already in sync'}")
        return 0
    if args.json:  # the one table, as data: a script reads it instead of scraping the text
        print(json.dumps([{"name": o.name, "type": o.type.__name__, "default": o.default, "help": o.help,
                           "bounds": list(o.bounds) if o.bounds is not None else None}
                          for o in _opts.OPTIONS.values()], indent=2))
        return 0
    import textwrap

    width = max(shutil.get_terminal_size((100, 24)).columns, 40) - 1
    print(_opts.format_table(width + 1))
    print("\n" + textwrap.fill(f"Set them with {_opts.ENV_OPTIONS}=\"name=value:name=value\", "
                               f"sanitizer.enable(name=value), or ownsan run -o name=value. {_opts.QUOTING[0].upper()}{_opts.QUOTING[1:]}.",
                               width, break_on_hyphens=False, break_long_words=False))
    return 0


def cmd_install_hook(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    print(f"installed {startup.install_pth(args.dir)} (active when {startup.ENV_SWITCH}=1)")
    return 0


def cmd_uninstall_hook(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    removed = startup.uninstall_pth(args.dir)
    print(f"removed {removed}" if removed else f"no {startup.PTH_NAME} in {args.dir or startup.site_packages()}")
    return 0


def cmd_doctor(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from sanitizer.tools import doctor

    return doctor.main(as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    p = HintingParser(prog="ownsan", description="ownership-sanitizer: catch consumers that keep "
                                "borrowed tensor views past their lifetime, and name them.")
    p.add_argument("--version", action="version", version=f"ownsan (ownership-sanitizer) {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run a program with the sanitizer on and print who retained what",
                         description="Run COMMAND with the sanitizer on (triage=1: record, do not raise), "
                         "merge the reports of its processes, print the triage summary.")
    run.add_argument("-o", "--option", action="append", default=[], metavar="NAME=VALUE",
                     help="a sanitizer option (see ownsan options); repeat, or join with ':'; it overrides the same "
                     "option in OWNERSHIP_SANITIZE_OPTIONS, whose others apply too. The run exits 1 on "
                     "an error or a confirmed retention (-o fail_on_retention=0: on errors only)")
    run.add_argument("--report", default="ownsan-report.json", metavar="PATH",
                     help="where to write the merged JSON report (default: %(default)s)")
    run.add_argument("--top", type=int, default=20, help="consumers shown (default: %(default)s)")
    run.add_argument("-q", "--quiet", action="store_true", help="print only the one-line summary")
    run.add_argument("--allow-unsanitized", action="store_true",
                     help="a command that never imports torch (so nothing is sanitized) keeps its own exit status "
                     "(by default the run then exits 1: a CI gate that sanitized nothing does not pass)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the program and its arguments")
    tri = sub.add_parser("triage", help="show a report: retaining consumers by bytes, with holders and sites",
                         description="Show a report written by ownsan run or report=PATH: the summary, the retaining "
                         "consumers by bytes with their holders and storing lines, the errors.")
    tri.add_argument("report", help="a report written by ownsan run or report=path")
    tri.add_argument("--json", action="store_true", help="print the report's summary as JSON instead of the table")
    tri.add_argument("--top", type=int, default=20, help="consumers shown (default: %(default)s)")
    tri.add_argument("--exit-zero", action="store_true",
                     help="exit 0 even when the report has findings (by default it exits 1 on an error or a "
                     "confirmed retention, as ownsan run does; 2 when the report cannot be read)")
    tri.add_argument("--html", metavar="PATH", default=None,
                     help="also write one self-contained page with a timeline of each staging buffer (SVG)")
    tri.add_argument("--trace", metavar="PATH", default=None,
                     help="also write the timeline as Chrome trace events (open in Perfetto, as torch.profiler "
                     "traces)")
    demo = sub.add_parser("demo", help="the end-to-end demonstration (the layerwise-reload bug, caught and fixed)",
                          description="The end-to-end demonstration: a layerwise reload whose consumer keeps "
                          "borrowed views, caught, named and fixed (ownsan demo -- --help for its options).")
    demo.add_argument("args", nargs=argparse.REMAINDER, help="passed to the demo (ownsan demo -- --help)")
    opt = sub.add_parser("options", help="the option table: names, types, defaults, help",
                         description="Every sanitizer option: name, type, default and what it does (the table "
                         "OWNERSHIP_SANITIZE_OPTIONS, sanitizer.enable() and ownsan run -o read).")
    opt.add_argument("--json", action="store_true", help="print the table as JSON")
    opt.add_argument("--sync-readme", metavar="README", default=None,
                     help=argparse.SUPPRESS)  # maintainers: rewrite the generated table in a page (docs/options.md)
    fuzz = sub.add_parser("fuzz", help="the bounded fuzz campaign; with --consumer MODULE:FUNCTION, your own consumer",
                          description="The bounded fuzz campaign over randomized borrowed streams, checked bit for "
                          "bit; with --consumer MODULE:FUNCTION, your own consumer (ownsan fuzz --help).")
    fuzz.add_argument("args", nargs=argparse.REMAINDER, help="passed to the fuzzer")
    audit = sub.add_parser("audit", help="find retaining consumers of borrowed weights statically, without "
                           "running the code (ownsan audit --help)",
                           description="Find retaining consumers of borrowed weights statically, without running "
                           "the code (ownsan audit --help for its own options).")
    audit.add_argument("args", nargs=argparse.REMAINDER, help="paths and options (ownsan audit --help)")
    doctor_text = ("say whether OWNERSHIP_SANITIZE=1 would sanitize a program run by this interpreter (the zero-code "
                   "hook, the switch, the options, torch, numba, the loaders)")
    doc = sub.add_parser("doctor", help=doctor_text, description=doctor_text[0].upper() + doctor_text[1:] + ".")
    doc.add_argument("--json", action="store_true", help="print the checks as JSON")
    for name, text in (("install-hook", "write the zero-code activation .pth into site-packages"),
                       ("uninstall-hook", "remove the zero-code activation .pth")):
        hp = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        hp.add_argument("--dir", default=None, help="the site directory (default: this environment's)")
    return p


_COMMANDS = {"run": cmd_run, "triage": cmd_triage, "demo": cmd_demo, "options": cmd_options, "fuzz": cmd_fuzz,
             "audit": cmd_audit, "doctor": cmd_doctor, "install-hook": cmd_install_hook, "uninstall-hook": cmd_uninstall_hook}


_PASS_THROUGH = ("demo", "fuzz", "audit")  # their flags belong to the command itself (ownsan fuzz --seed 3 -j 2)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``ownsan`` command. A reader that closes its end early (``ownsan triage r.json | head``) ends the
    output quietly, as Python's documentation asks ("Note on SIGPIPE", the signal module): the rest of
    stdout goes to devnull so that the interpreter's own flush at exit does not fail again, and the status
    is 1, not a traceback."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # (inside the try: a broken pipe shows at the last flush too)
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in _PASS_THROUGH:
            sub = parser._subparsers._group_actions[0].choices[argv[0]]  # type: ignore[union-attr]
            rest = argv[1:][1:] if argv[1:2] == ["--"] else argv[1:]
            return _COMMANDS[argv[0]](argparse.Namespace(cmd=argv[0], args=rest), sub)
        args, extras = parser.parse_known_args(argv)
        sub = parser._subparsers._group_actions[0].choices[args.cmd]  # type: ignore[union-attr]
        if extras:  # named by the subcommand, with its usage and the closest of its own flags
            sub.unrecognized(extras)
        if getattr(args, "args", None) and args.args[:1] == ["--"]:
            args.args = args.args[1:]
        if getattr(args, "top", 1) < 1:
            sub.error(f"--top must be >= 1, got {args.top}")
        return _COMMANDS[args.cmd](args, sub)
    except SystemExit as exc:  # argparse: usage printed, status 2 (or 0 for --help)
        return exc.code if isinstance(exc.code, int) else 2


__all__ = ["main", "build_parser", "format_triage"]
