"""Zero-code activation: ``OWNERSHIP_SANITIZE=1 python any_script.py``, no import of ours needed.

The package ships ``ownership_sanitizer.pth`` (at the top of site-packages,
as coverage.py does for subprocesses). Python runs its one line at every
start-up; with ``OWNERSHIP_SANITIZE`` unset it is one dictionary lookup. Only
when the variable is set does it load *this file* by path (importing the
``sanitizer`` package would import torch) and call :func:`activate`.

:func:`activate` imports nothing heavy either: it puts a finder on
``sys.meta_path`` that waits for the program itself to import torch or one of
the known loaders. Right after torch has executed (or right before a loader
package executes, so the loader's own import of torch is already ours), it
imports ``sanitizer``, which activates itself from the environment (the one
activation path, :func:`sanitizer.activation.activate_from_environment`: enable,
then the adapters wrap the loaders as they get imported). A program that
never imports torch pays nothing but the finder. A sanitizer that cannot start
(``OWNERSHIP_SANITIZE_OPTIONS=stack_dept=4``) stops the program there with
status 2 and a message naming the setting, as ``import sanitizer`` would raise:
it never runs unsanitized by mistake. This file must stay standalone: no
relative imports, standard library only.
"""
from __future__ import annotations

import _thread
import importlib.util
import os
import sys

# Standard library only, and little of it: this runs at every start-up while the variable is
# set. (importlib.abc alone pulls in pathlib and tempfile: ~14 ms; typing ~2 ms.)
if False:  # for the annotations only, which `from __future__ import annotations` never evaluates
    from typing import Any, Optional

ENV_SWITCH = "OWNERSHIP_SANITIZE"
ENV_OPTIONS = "OWNERSHIP_SANITIZE_OPTIONS"
# A Ray worker's request (sanitizer.tools.ray_env.runtime_env): the switch and the options under names of their
# own, so that Ray's import of the worker hook (the package's first import) does not turn the sanitizer on,
# and torch with it, before Ray has set the worker's OMP_NUM_THREADS. The hook arms from it; a worker Ray
# gives no hook (a runtime_env given per task or actor only) arms from it here at start-up, as for the switch.
ENV_RAY_REQUEST = "OWNSAN_RAY_SANITIZE"
ENV_RAY_OPTIONS = "OWNSAN_RAY_OPTIONS"
PTH_NAME = "ownership_sanitizer.pth"
MODULE_NAME = "_ownership_sanitizer_startup"
# Top-level packages of the loaders that sanitizer.adapters wraps (tests check this against
# adapters.TARGETS): we activate before they execute, so their import of torch is seen too.
LOADER_PACKAGES = frozenset({"fastsafetensors", "runai_model_streamer", "instanttensor", "safetensors"})
_FALSE = {"0", "false", "no", "off", ""}

# Loads this file by path under MODULE_NAME and calls activate(); used by the .pth line and by
# the sitecustomize that `ownsan run` puts on PYTHONPATH. A failure of the hook itself is printed, never raised; a
# sanitizer that was asked for and cannot start stops the program (see _refuse).
BOOTSTRAP = (
    "import sys\n"
    "try:\n"
    f" m = sys.modules.get('{MODULE_NAME}')\n"
    " if m is None:\n"
    "  import importlib.util as u, os.path as p\n"
    "  s = u.find_spec('sanitizer')\n"
    "  if s is not None and s.submodule_search_locations:\n"
    f"   f = u.spec_from_file_location('{MODULE_NAME}', p.join(list(s.submodule_search_locations)[0], 'tools', 'startup.py'))\n"
    "   m = u.module_from_spec(f); sys.modules[f.name] = m; f.loader.exec_module(m)\n"
    f"  elif __import__('os').environ.get('{ENV_SWITCH}', '').strip().lower() not in {tuple(sorted(_FALSE))!r}:\n"
    f"   print('ownership-sanitizer: {ENV_SWITCH} is set, but this interpreter cannot import the package (its start-up "
    f"hook was left by an install that moved or was removed): the program runs unsanitized; reinstall "
    f"ownership-sanitizer in this environment, or unset {ENV_SWITCH}', file=sys.stderr)\n"
    " m is not None and m.activate()\n"
    "except Exception as e:\n"
    " print('ownership-sanitizer: the start-up hook failed: %r' % (e,), file=sys.stderr)\n"
)
PTH_LINE = (f"import os; exec({BOOTSTRAP!r}) if os.environ.get({ENV_SWITCH!r}) or os.environ.get({ENV_RAY_REQUEST!r}) "
            f"else None\n")

_lock = _thread.RLock()
_finder: Optional["_StartupFinder"] = None
_done = False
state = {"activated": False, "trigger": None, "error": None}  # for tests and `ownsan doctor`-style checks


def switch_on(environ: Any = None) -> bool:
    """Whether to arm the hook: ``OWNERSHIP_SANITIZE`` is on, or set to a value that is not understood.

    A value that is neither on nor off is armed too, so that a program that imports torch stops with the
    sanitizer's own error (as ``import sanitizer`` does) instead of running unsanitized; a program that
    never imports torch (pip, a build script) is not disturbed by it.
    """
    raw = (os.environ if environ is None else environ).get(ENV_SWITCH)
    if raw is None:
        return False
    return raw.strip().lower() not in _FALSE


def take_ray_request(environ: Any) -> bool:
    """Turn a Ray worker's request (``OWNSAN_RAY_SANITIZE``/``_OPTIONS``) into the switch and the options
    (children of the worker inherit them). Whether there was one to take."""
    if not environ.get(ENV_RAY_REQUEST):
        return False
    environ[ENV_SWITCH] = environ.pop(ENV_RAY_REQUEST)
    options = environ.pop(ENV_RAY_OPTIONS, None)
    if options is not None:
        environ[ENV_OPTIONS] = options
    return True


def _enable_now(trigger: str) -> None:
    """Import the sanitizer (it enables itself from the environment) and hook the loaders."""
    global _done
    with _lock:
        if _done:
            return
        _done = True
        _remove_finder()
    state["trigger"] = trigger
    # A Ray worker whose request no worker hook took (its runtime_env was given per task or actor, where
    # Ray runs no worker_process_setup_hook): take it now, and start its report flusher once on.
    ray_worker = take_ray_request(os.environ)
    try:
        # the one activation path: the package activates itself from the environment at its first import
        # (sanitizer.activation.activate_from_environment: enable, then the adapters' import hooks)
        package = sys.modules.get("sanitizer")
        if package is not None and not getattr(getattr(package, "__spec__", None), "_initializing", False):
            # imported whole before the switch was set (Ray's worker hook lives in the package and arms
            # this hook from there): that import activated nothing, so activate as it would have
            from sanitizer.activation import activate_from_environment

            activate_from_environment()
        else:  # not imported yet, or being imported (activating itself: that import brought torch in)
            import sanitizer  # noqa: F401

        state["activated"] = True
        if ray_worker:
            from sanitizer.tools.ray_flusher import start_flusher

            start_flusher()
    except Exception as exc:
        state["error"] = repr(exc)
        _refuse(trigger, exc)


def _refuse(trigger: str, exc: BaseException) -> None:
    """The sanitizer was asked for and cannot start: stop the program, as ``import sanitizer`` would raise,
    rather than let it run unsanitized and exit 0. Status 2 for a bad setting (an unknown option, a bad
    value: the message names it and the closest valid one), 1 for any other failure."""
    setting = type(exc).__name__ == "OptionError"
    print(f"ownership-sanitizer: {ENV_SWITCH} is set but the sanitizer cannot start "
          f"({'bad setting' if setting else 'activation failed at ' + trigger}): {exc}\n"
          f"ownership-sanitizer: stopping rather than running the program unsanitized; fix the setting, "
          f"or unset {ENV_SWITCH} to run without the sanitizer", file=sys.stderr)
    code = 2 if setting else 1
    import threading

    site = sys.modules.get("site")  # still executing: we run from a .pth or a sitecustomize at start-up
    at_start_up = bool(getattr(getattr(site, "__spec__", None), "_initializing", False))
    if threading.current_thread() is threading.main_thread() and not at_start_up:
        raise SystemExit(code)  # out through the program's own `import torch`
    # A thread's SystemExit would end the thread alone; site's would be a "Fatal Python error".
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _post_import() -> "Any":
    """``sanitizer/core/post_import.py``, the loader wrapper both finders share, loaded by path (importing
    it as part of the package would run the package's ``__init__``, which imports torch)."""
    name = MODULE_NAME + "_post_import"
    module = sys.modules.get(name)
    if module is None:
        where = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core", "post_import.py")
        spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


class _StartupFinder:
    """Finds nothing itself; notices the first import of torch or of a known loader package."""

    def __init__(self) -> None:
        self._busy = _thread._local()
        self._shared = _post_import()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        shared = self._shared
        if shared.asking(self._busy, fullname):
            return None
        if fullname == "torch":
            # Never import torch from here (it would execute twice): wrap its loader instead.
            spec = shared.spec_from_others(self, self._busy, fullname, path, target)
            return shared.wrap(spec, lambda module: _enable_now(f"import {fullname}"))
        if fullname in LOADER_PACKAGES and "torch" not in sys.modules:
            # Importing torch here is safe (it is not being imported); the adapters' finder, installed
            # now, must still see this very import, so we ask the finders ourselves.
            _enable_now(f"import {fullname}")
            return shared.spec_from_others(self, self._busy, fullname, path, target)
        return None


def _remove_finder() -> None:
    global _finder
    if _finder is not None:
        _post_import().remove(_finder)
        _finder = None


def activate(environ: Any = None) -> bool:
    """Arrange for the sanitizer to turn on when the program imports torch (or now, if it has). Idempotent."""
    global _finder
    if not switch_on(environ) and not (os.environ if environ is None else environ).get(ENV_RAY_REQUEST):
        return False
    with _lock:
        if _done or _finder is not None:
            return True
        torch = sys.modules.get("torch")
        initializing = getattr(getattr(torch, "__spec__", None), "_initializing", False)
        if torch is not None and not initializing:
            ready = True
        else:
            ready = False
            _finder = _StartupFinder()
            sys.meta_path.insert(0, _finder)
    if ready:
        _enable_now("already imported")
    return True


def site_packages() -> str:
    """Where the .pth goes for this interpreter (the purelib of the running environment)."""
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def install_pth(directory: Optional[str] = None) -> str:
    """Write the .pth hook into ``directory`` (default: this environment's site-packages); return its path."""
    target = os.path.join(directory or site_packages(), PTH_NAME)
    with open(target, "w", encoding="utf-8") as fh:
        fh.write(PTH_LINE)
    return target


def uninstall_pth(directory: Optional[str] = None) -> Optional[str]:
    """Remove the .pth hook; return the path removed, or None if it was not there."""
    target = os.path.join(directory or site_packages(), PTH_NAME)
    try:
        os.remove(target)
    except FileNotFoundError:
        return None
    return target


__all__ = ["activate", "switch_on", "install_pth", "uninstall_pth", "site_packages", "PTH_LINE", "PTH_NAME",
           "BOOTSTRAP", "LOADER_PACKAGES", "ENV_SWITCH"]
