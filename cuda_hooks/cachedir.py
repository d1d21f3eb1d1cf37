"""Where numba caches the compiled kernels: a user cache directory, never site-packages.

numba's ``cache=True`` writes ``__pycache__/*.nbi``/``*.nbc`` next to the
source file when that directory is writable, i.e. inside site-packages for an
installed package, where ``pip uninstall`` leaves them behind. While our
kernels are defined (numba picks a kernel's cache location when its decorator
runs), :func:`kernel_cache` points numba at
``$XDG_CACHE_HOME/ownership-sanitizer/numba`` (``~/.cache/...`` by default),
unless the user chose a directory (``NUMBA_CACHE_DIR``, or ``numba.config.CACHE_DIR`` set in code), which
then wins.
Other numba users in the process are not affected: the setting is restored
as soon as our kernels are defined. Deleting that directory is always safe.
Importing this module does not import numba.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator, Mapping, Optional

__all__ = ["cache_dir", "kernel_cache", "APP_DIR"]

APP_DIR = os.path.join("ownership-sanitizer", "numba")
# numba's configuration modules that may hold CACHE_DIR: numba's own, and numba-cuda's when that
# package provides numba.cuda with a configuration of its own.
_CONFIG_MODULES = ("numba.core.config", "numba.cuda.core.config")


def cache_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """The directory our kernels are cached in: ``NUMBA_CACHE_DIR`` if set, else the user cache directory."""
    env = os.environ if environ is None else environ
    chosen = env.get("NUMBA_CACHE_DIR")
    if chosen:
        return chosen
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, APP_DIR)


@contextmanager
def kernel_cache() -> Iterator[str]:
    """Around the numba decorators with ``cache=True``: their cache goes to :func:`cache_dir`."""
    from numba.core import config

    if os.environ.get("NUMBA_CACHE_DIR") or config.CACHE_DIR:  # the user's choice (numba read it at import)
        yield config.CACHE_DIR or os.environ["NUMBA_CACHE_DIR"]
        return
    target = cache_dir()
    saved = []
    for name in _CONFIG_MODULES:
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "CACHE_DIR"):
            saved.append((mod, mod.CACHE_DIR))
            mod.CACHE_DIR = target
    try:
        yield target
    finally:
        for mod, value in saved:
            mod.CACHE_DIR = value
