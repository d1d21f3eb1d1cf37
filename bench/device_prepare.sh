#!/usr/bin/env bash
# Fetch, on a machine with network, what bench/device_check.sh needs on a GPU machine without it.
#   .whl/: the InstantTensor wheels for CPython 3.10-3.13. It is git-ignored, so it reaches the GPU machine only
#   when the run carries it (the device run tool: carry [".whl"]), never with the working tree alone
#   (InstantTensor is CUDA only, and its wheels are per Python version: the GPU machine's is unknown here).
# The check installs them with `pip install --no-index --find-links .whl`, never from the network.
# Not fetched: a CUDA toolkit's libNVVM (64 MB unpacked, over what travels with a working tree): the GPU
# machine needs its own (a CUDA toolkit, or numba-cuda[cu12]/[cu13]); the check says which it found.
# Usage: bench/device_prepare.sh        PYTHON=... the interpreter whose pip downloads (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
mkdir -p .whl
got=0
for version in 3.10 3.11 3.12 3.13; do
  if timeout 180 "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$version" --platform manylinux_2_28_x86_64 -d .whl instanttensor 2>/dev/null; then
    got=$((got + 1))
  else
    echo "device_prepare: no instanttensor wheel for CPython $version (skipped)" >&2
  fi
done
if [ "$got" = 0 ]; then
  echo "device_prepare: could not download any instanttensor wheel (no network, or no such package?)" >&2
  exit 1
fi
echo "device_prepare: .whl/ holds:"
ls -l .whl
du -sh .whl
