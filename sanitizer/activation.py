"""Turning the sanitizer on: the one place where the features are composed onto the runtime.

:func:`compose` registers every feature's hooks on the runtime's slots
(checksums and poison, triage and its timeline, rescue, the guard, the exit
report, TorchScript's error text), once. :func:`enable` composes, then arms
the runtime; the environment activation (``OWNERSHIP_SANITIZE=1`` at import,
the zero-code hook, Ray's worker hook: all of them import the package, which
calls :func:`activate_from_environment`) goes through :func:`enable` too, and
installs the adapters' import hooks: the one activation path. Nothing is composed by
importing a module: a program that never enables the sanitizer never has a
feature hook installed.

This module is part of the package face (above every feature), so it may
import them all; the runtime below knows none of them.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Dict, Iterator, Mapping, Optional

from sanitizer.core import forking
from sanitizer.core import options as _opts

_lock = threading.Lock()
_composed = False


def compose() -> None:
    """Install every feature on the runtime's hook slots (idempotent, thread-safe)."""
    global _composed
    if _composed:
        return
    with _lock:
        if _composed:
            return
        from sanitizer.features import aliases, checksums, guard, rescue, streams, trap_mode, triage
        from sanitizer.reporting import recover, report
        from sanitizer.torch_layer import script_calls

        checksums.install()  # verify at retire (checksum=1), poison what is left stale (poison=1)
        triage.install()  # retentions named, the timeline's flight log, holders in the errors
        aliases.install()  # exports of fresh leases (numpy, DLPack): aliases named among the holders
        rescue.install()  # enable(rescue=1) installs its hooks
        guard.install()  # enable(guard=1), the default, installs its hooks
        trap_mode.install()  # enable(trap=poison|fault) arms trap buffers
        streams.install()  # record_stream on a CUDA lease reaches the memory it aliases
        recover.install()  # halt_on_error=0 prints each error once per site, a summary and exitcode= at exit
        report.install()  # enable(report=path) writes the report at exit
        script_calls.install()  # TorchScript keeps a sanitizer error's text
        _composed = True


def composed() -> bool:
    return _composed


def enable(**options: Any) -> None:
    """Turn debug mode on (options as in the table; unknown ones raise OptionError).

    An option served only through a loader's adapter (``safetensors_ring``) installs the adapters' import
    hooks, as ``OWNERSHIP_SANITIZE=1`` does: ``enable(safetensors_ring=N)`` in code emulated nothing and said
    nothing. Without one, code that enables keeps the loaders' own functions unpatched."""
    from sanitizer.torch_layer import runtime
    from sanitizer.torch_layer.state import state

    resolved = _opts.resolve(options, base=state.options)  # validated once, before anything is installed
    compose()
    runtime.arm(resolved)
    if resolved["safetensors_ring"]:
        from sanitizer.adapters import install_import_hooks

        install_import_hooks()
    _print_help_once(resolved)


_helped = False


def _print_help_once(resolved: "_opts.Options") -> None:
    """``help=1``: the option table on stderr, once per process, as ASan's ``help=1`` prints its flags."""
    global _helped
    if resolved["help"] and not _helped:
        _helped = True
        import sys

        sys.stderr.write(_opts.format_table() + "\n")


def disable() -> None:
    """Turn debug mode off: no error anywhere from now on, no mode in the main thread, no thread hook.
    Other threads' modes pass everything through until those threads end."""
    from sanitizer.torch_layer import runtime

    runtime.disarm()


def enabled() -> bool:
    from sanitizer.torch_layer.state import state

    return state.enabled


@contextlib.contextmanager
def sanitize(**options: Any) -> Iterator[None]:
    """``with sanitizer.sanitize(halt_on_error=0): ...``: debug mode for a block, then the previous state."""
    from sanitizer.torch_layer import runtime
    from sanitizer.torch_layer.state import state

    before_enabled, before_options = state.enabled, state.options
    enable(**options)
    state.scopes += 1
    try:
        yield
    finally:
        state.scopes -= 1
        runtime.set_options(before_options)
        if before_enabled:  # even when the block called disable()
            enable()
        else:
            disable()


def activate_from_environment(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Read ``OWNERSHIP_SANITIZE`` and ``OWNERSHIP_SANITIZE_OPTIONS``; enable when asked. Returns enabled().

    Options without the switch are put in force without enabling (a later :func:`enable` uses them)."""
    env = os.environ if environ is None else environ
    raw = env.get(_opts.ENV_OPTIONS, "")
    parsed: Dict[str, str] = _opts.parse_options_string(raw) if raw else {}
    switch = _opts.switch_from_env(env)
    from sanitizer.torch_layer import runtime
    from sanitizer.torch_layer.state import state

    if parsed:
        runtime.set_options(_opts.resolve(parsed, base=state.options))
    if switch:
        enable()
        from sanitizer.adapters import install_import_hooks

        install_import_hooks()  # the loaders' entry points, wrapped as they get imported (zero-code users)
    return state.enabled



@forking.in_child
def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()


__all__ = ["compose", "composed", "enable", "disable", "enabled", "sanitize", "activate_from_environment"]
