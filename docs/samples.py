"""Regenerate (or check) the sample reports in the docs from real runs, so that they cannot go stale.

Each sample is a block of ``docs/*.md`` between ``<!-- sample: NAME -->`` and ``<!-- /sample -->``, holding
a fenced block of what a real run printed, with the checkout's path cut off (``examples/...``) and the
process id written as ``N``:

* ``several_holders`` (docs/triage.md): ``ownsan run -o safetensors_ring=16384 -o safetensors_strict=1 --
  python examples/several_holders.py``, its summary and table;
* ``deferred_loader`` (docs/fuzzing.md): the ``RetainedBorrowError`` of ``check_consumer(load_deferred, ...)``
  from ``examples/test_deferred_loader_ownership.py``;
* ``readme_error`` (README.md) and ``concepts_error`` (docs/concepts.md): the ``StaleBorrowError`` that the
  page's own Python block, run as ``example.py``, raises (the block right above the sample is what runs).

    python docs/samples.py            # rewrite the blocks
    python docs/samples.py --check    # exit 1, naming the sample, when a block differs from a fresh run

``tests/tools/test_doc_samples.py`` runs the check.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _normalise(text: str) -> str:
    text = text.replace(ROOT + os.sep, "")
    text = re.sub(r"\(pid \d+\)", "(pid N)", text)
    text = re.sub(r"check_consumer-\d+#", "check_consumer#", text)  # the process's first checker's buffer names
    text = re.sub(r"report: \S+ \(", "report: ownsan-report.json (", text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def several_holders() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--report", os.path.join(tmp, "r.json"),
                              "-o", "safetensors_ring=16384", "-o", "safetensors_strict=1", "--", sys.executable,
                              os.path.join("examples", "several_holders.py"), "--dir", tmp],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
    if "retentions by" not in out.stderr:
        raise RuntimeError(f"several_holders: the run printed no summary:\n{out.stdout}\n{out.stderr}")
    return _normalise(out.stderr)


def deferred_loader() -> str:
    spec = importlib.util.spec_from_file_location(
        "test_deferred_loader_ownership", os.path.join(ROOT, "examples", "test_deferred_loader_ownership.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from sanitizer.testing import RetainedBorrowError, check_consumer

    try:
        check_consumer(module.load_deferred, module.STATE_DICT)
    except RetainedBorrowError as e:
        return _normalise(f"RetainedBorrowError: {e}")
    raise RuntimeError("deferred_loader: check_consumer(load_deferred) passed; it must fail")


def _page_example(page_name: str, name: str) -> str:
    """What the page's Python block just above ``<!-- sample: name -->`` raises, run as ``example.py`` (its
    error's last lines: the class and the report, as the page shows them)."""
    with open(os.path.join(ROOT, "docs", page_name), encoding="utf-8") as fh:
        page = fh.read()
    at = page.index(f"<!-- sample: {name} -->")
    code = re.findall(r"```python\n(.*?)```", page[:at], re.S)[-1]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "example.py"), "w", encoding="utf-8") as fh:
            fh.write(code)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OWNERSHIP_SANITIZE")}
        out = subprocess.run([sys.executable, "example.py"], capture_output=True, text=True, timeout=300, cwd=tmp,
                             env=dict(env, PYTHONPATH=ROOT))
    err = out.stderr.replace(os.path.join(tmp, ""), "")  # `example.py:3`, as a user running it in place sees
    start = err.find("sanitizer.core.errors.StaleBorrowError:")
    if out.returncode == 0 or start < 0:
        raise RuntimeError(f"{name}: the page's example raised no StaleBorrowError:\n{out.stdout}\n{err}")
    return _normalise(err[start:])


def readme_error() -> str:
    return _page_example(os.path.join(os.pardir, "README.md"), "readme_error")


def concepts_error() -> str:
    return _page_example("concepts.md", "concepts_error")


SAMPLES: Dict[str, Tuple[str, Callable[[], str]]] = {
    "several_holders": ("triage.md", several_holders),
    "deferred_loader": ("fuzzing.md", deferred_loader),
    "readme_error": (os.path.join(os.pardir, "README.md"), readme_error),
    "concepts_error": ("concepts.md", concepts_error),
}
_BLOCK = r"(<!-- sample: {name} -->\n```\n)(.*?)(\n```\n<!-- /sample -->)"


def block(page: str, name: str) -> str:
    found = re.search(_BLOCK.format(name=re.escape(name)), page, re.S)
    if found is None:
        raise RuntimeError(f"no '<!-- sample: {name} -->' block in the page")
    return found.group(2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write; exit 1 when a block differs")
    ap.add_argument("names", nargs="*", help="samples to do (default: all)")
    args = ap.parse_args(argv)
    bad = 0
    for name in args.names or list(SAMPLES):
        page_name, make = SAMPLES[name]
        path = os.path.join(ROOT, "docs", page_name)
        with open(path, encoding="utf-8") as fh:
            page = fh.read()
        fresh = make()
        if args.check:
            if block(page, name) != fresh:
                print(f"docs/{page_name}: sample '{name}' differs from a fresh run (python docs/samples.py {name})")
                bad += 1
            continue
        block(page, name)  # the markers must be there
        page = re.sub(_BLOCK.format(name=re.escape(name)), lambda m: m.group(1) + fresh + m.group(3), page, flags=re.S)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(page)
        print(f"docs/{page_name}: sample '{name}' written")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
