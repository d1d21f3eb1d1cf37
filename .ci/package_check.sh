#!/usr/bin/env bash
# The package as a user gets it: build the sdist from the tracked files, build the wheel FROM the unpacked
# sdist (which proves the sdist is complete), install that wheel into a fresh venv, and check there: the
# metadata, `ownsan --version`, the zero-code hook (off, on, and a typo stops the program), and that
# `pip uninstall` takes the hook away. Offline: .venv's setuptools builds (no build isolation), and the fresh
# venv borrows .venv's torch and numba through a path file instead of installing them again.
# Usage: .ci/package_check.sh [PYTHON]   (default .venv/bin/python, which needs torch installed)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
PY="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")"  # absolute, but not resolved: a venv's python is a link
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/ownsan-package-XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { echo "package check: $*"; }
fail() { echo "package check: FAILED: $*" >&2; exit 1; }

"$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' || fail "$PY is not a virtual environment's python"
"$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null \
  || "$PY" -m pip install -q 'setuptools>=77'  # what pyproject.toml's build-system asks for

# 1. sdist, from a clean copy of the tracked (and not ignored) files: no build/ or egg-info of this tree.
mkdir -p "$work/tree" "$work/dist" "$work/unpacked"
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf - | tar -xf - -C "$work/tree"
sdist=$(cd "$work/tree" && "$PY" -c 'import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))' \
  "$work/dist" 2>"$work/sdist.log" | tail -n 1) || { cat "$work/sdist.log" >&2; fail "building the sdist"; }
tar -xzf "$work/dist/$sdist" -C "$work/unpacked"
src=$(echo "$work"/unpacked/*/)
for f in ownership_sanitizer.pth LICENSE README.md setup.py sanitizer/reporting/report_schema.json; do
  [ -f "$src/$f" ] || fail "the sdist $sdist lacks $f"
done
say "sdist $sdist"

# 2. The wheel, built from the unpacked sdist alone.
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$src" >/dev/null
wheel=$(echo "$work"/dist/*.whl)
[ -f "$wheel" ] || fail "no wheel was built from the sdist"
say "wheel $(basename "$wheel") (built from the sdist)"

# 3. A fresh venv with that wheel; torch and numba come from .venv, added after the install.
"$PY" -m venv --without-pip "$work/venv"
V="$work/venv/bin/python"
"$PY" -m pip --python "$V" install -q --no-deps --root-user-action=ignore "$wheel"
site=$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -f "$site/ownership_sanitizer.pth" ] || fail "the wheel did not put ownership_sanitizer.pth into $site"
"$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$site/zz_borrow_dotvenv.pth"
cd "$work"  # not the checkout: its sanitizer/ must not shadow the installed one
env -u OWNERSHIP_SANITIZE -u OWNERSHIP_SANITIZE_OPTIONS "$V" - "$work/venv" <<'EOF' || fail "installed package or metadata"
import importlib.metadata as md, os, sys
venv = os.path.realpath(sys.argv[1])
import sanitizer
assert os.path.realpath(sanitizer.__file__).startswith(venv), sanitizer.__file__
meta = md.metadata("ownership-sanitizer")
assert meta["Version"] == sanitizer.__version__, (meta["Version"], sanitizer.__version__)
assert meta["License-Expression"] == "Apache-2.0", meta["License-Expression"]
assert meta["Requires-Python"] == ">=3.10", meta["Requires-Python"]
files = [str(f) for f in md.files("ownership-sanitizer")]
assert any(f.endswith("licenses/LICENSE") for f in files), files
assert "torch" not in sys.modules
EOF
version=$("$work/venv/bin/ownsan" --version)
[ "$version" = "ownsan (ownership-sanitizer) $("$V" -c 'import sanitizer; print(sanitizer.__version__)')" ] \
  || fail "ownsan --version printed '$version'"
env -u OWNERSHIP_SANITIZE "$V" -c "import sys, torch; assert 'sanitizer' not in sys.modules" \
  || fail "with OWNERSHIP_SANITIZE unset, the hook loaded the sanitizer"
OWNERSHIP_SANITIZE=1 "$V" - "$work/venv" <<'EOF' || fail "OWNERSHIP_SANITIZE=1 did not enable the installed sanitizer"
import os, sys
assert "sanitizer" not in sys.modules
import torch
s = sys.modules["sanitizer"]
assert s.enabled() and os.path.realpath(s.__file__).startswith(os.path.realpath(sys.argv[1])), s.__file__
EOF
set +e
typo=$(OWNERSHIP_SANITIZE=1 OWNERSHIP_SANITIZE_OPTIONS=stack_dept=4 "$V" -c "import torch; print('ran unsanitized')" 2>&1)
code=$?
set -e
[ "$code" = 2 ] && [[ "$typo" == *"did you mean 'stack_depth'?"* ]] && [[ "$typo" != *"ran unsanitized"* ]] \
  || fail "a typo in OWNERSHIP_SANITIZE_OPTIONS gave status $code: $typo"
say "hook: off, on, and a typo (status 2, names stack_depth) as expected"

# 4. pip uninstall removes the hook.
rm "$site/zz_borrow_dotvenv.pth"
"$PY" -m pip --python "$V" uninstall -q -y --root-user-action=ignore ownership-sanitizer
[ ! -e "$site/ownership_sanitizer.pth" ] || fail "pip uninstall left ownership_sanitizer.pth behind"
say "uninstall removes the hook; ok in $((SECONDS - start)) s"
