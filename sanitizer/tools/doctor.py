"""``ownsan doctor``: would ``OWNERSHIP_SANITIZE=1`` sanitize a program run by this interpreter?

The zero-code switch works through a start-up hook (a ``.pth`` file in site-packages, written by
``pip install`` or ``ownsan install-hook``). A checkout on ``PYTHONPATH`` without it imports fine, and
``OWNERSHIP_SANITIZE=1 python serve.py`` then runs unsanitized without a word: no code of ours ever
runs to say so. This command says it, with everything else the switch depends on (the variable's and
the options' values, torch's version, numba for checksums, the loaders installed), one line each, and
exits 1 when the switch would not do what it says.

It reads metadata and the environment only: no torch import for the hook's answer (torch's version
comes from its distribution's metadata), so it answers in a fraction of a second.
"""
from __future__ import annotations

import importlib.metadata as metadata
import importlib.util
import os
import site
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from sanitizer.core import options as _opts
from sanitizer.core.version import __version__
from sanitizer.tools import startup

_LOADERS = (("safetensors", "safetensors"), ("fastsafetensors", "fastsafetensors"),
            ("runai-model-streamer", "runai_model_streamer"), ("instanttensor", "instanttensor"))
_MIN_TORCH = (2, 4)


def _site_dirs() -> List[str]:
    """The directories whose ``.pth`` files this interpreter ran at start-up (site-packages, the user's)."""
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    if site.ENABLE_USER_SITE and getattr(site, "getusersitepackages", None):
        dirs.append(site.getusersitepackages())
    dirs.append(startup.site_packages())
    out: List[str] = []
    for d in dirs:
        if d and d not in out:
            out.append(d)
    return out


def hook_files() -> List[str]:
    """Every start-up hook file (``ownership_sanitizer.pth``) this interpreter would run."""
    return [p for p in (os.path.join(d, startup.PTH_NAME) for d in _site_dirs()) if os.path.isfile(p)]


def _hook_finds_package() -> bool:
    """The hook imports ``sanitizer`` by name at start-up: does this interpreter find the same one?"""
    spec = importlib.util.find_spec("sanitizer")
    return spec is not None and bool(spec.submodule_search_locations)


def _version_tuple(text: str) -> Tuple[int, ...]:
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _dist_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(environ: Optional[Dict[str, str]] = None) -> Tuple[List[Tuple[str, str, str]], bool]:
    """(rows of (verdict, what, detail), whether the zero-code switch works as set). Verdicts: ``ok``,
    ``warn`` (works, with a caveat), ``FAIL`` (the switch would not do what it says)."""
    env = os.environ if environ is None else environ
    rows: List[Tuple[str, str, str]] = []
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows.append(("ok", "package", f"ownership-sanitizer {__version__} at {here} "
                                  f"(Python {sys.version.split()[0]}, {sys.executable})"))
    raw = env.get(_opts.ENV_SWITCH)
    try:
        on = _opts.switch_from_env(env)
        switch_ok = True
        shown = "unset (off)" if raw is None else f"{raw!r} ({'on' if on else 'off'})"
    except _opts.OptionError as exc:
        on, switch_ok, shown = True, False, str(exc)
    rows.append(("ok" if switch_ok else "FAIL", _opts.ENV_SWITCH, shown))
    hooks = hook_files()
    if hooks and _hook_finds_package():
        rows.append(("ok", "zero-code hook", f"installed ({hooks[0]}): {_opts.ENV_SWITCH}=1 python PROGRAM "
                                             f"sanitizes PROGRAM in this interpreter"))
        hook_ok = True
    elif hooks:
        rows.append(("FAIL", "zero-code hook", f"{hooks[0]} is there but this interpreter does not find the "
                                               f"sanitizer package it imports"))
        hook_ok = False
    else:
        rows.append(("FAIL" if on else "warn", "zero-code hook",
                     f"not installed in {startup.site_packages()}: {_opts.ENV_SWITCH}=1 python PROGRAM runs PROGRAM "
                     f"UNSANITIZED unless it imports sanitizer itself; fix: pip install . (from the clone), or "
                     f"ownsan install-hook; ownsan run -- PROGRAM works either way"))
        hook_ok = False
    text = env.get(_opts.ENV_OPTIONS)
    if text is not None:
        try:
            _opts.resolve(_opts.parse_options_string(text))
            rows.append(("ok", _opts.ENV_OPTIONS, repr(text)))
        except (_opts.OptionError, ValueError) as exc:
            rows.append(("FAIL", _opts.ENV_OPTIONS, f"{text!r}: {exc}"))
            switch_ok = False
    torch_version = _dist_version("torch")
    if torch_version is None:
        rows.append(("FAIL", "torch", "not installed (the sanitizer needs torch >= 2.4)"))
    else:
        fits = _version_tuple(torch_version) >= _MIN_TORCH
        rows.append(("ok" if fits else "FAIL", "torch", f"{torch_version}" + ("" if fits else " (needs >= 2.4)")))
    numba = _dist_version("numba")
    rows.append(("ok" if numba else "warn", "numba", f"{numba} (checksum=1 hashes lent bytes)" if numba else
                 "not installed: checksum=1 is unavailable (pip install numba)"))
    found = [f"{dist} {v}" for dist, _ in _LOADERS for v in [_dist_version(dist)] if v]
    rows.append(("ok", "loaders", ", ".join(found) if found else "none installed (the sanitizer's own "
                                                                "StagingBuffer/StagingRing still work)"))
    works = switch_ok and (hook_ok or not on) and all(v != "FAIL" for v, _, _ in rows)
    return rows, works


def main(argv: Sequence[str] = (), as_json: bool = False) -> int:
    rows, works = check()
    if as_json:  # for a CI step or a script: the same verdicts, parsed instead of scraped
        import json

        print(json.dumps({"works": works, "checks": [{"verdict": v, "what": w, "detail": d} for v, w, d in rows]},
                         indent=2))
        return 0 if works else 1
    width = max(len(what) for _, what, _ in rows)
    for verdict, what, detail in rows:
        print(f"{verdict:<4}  {what:<{width}}  {detail}")
    print("the zero-code switch works as set" if works else
          "the zero-code switch would not do what it says: see FAIL above")
    return 0 if works else 1


__all__ = ["check", "hook_files", "main"]
