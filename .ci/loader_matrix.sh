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
exit 0
