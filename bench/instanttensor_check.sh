#!/usr/bin/env bash
# InstantTensor through the adapter on a GPU, at each version its contract table covers: 0.1.5 (no `copy`,
# always ring views: vLLM 0.20's pin) and 0.2.2 (`copy=False` views; vLLM 0.33 and SGLang pass copy=True).
# Each is installed side by side into .loaders/instanttensor-<version> (pip --target, --no-deps) and
# tests/adapters/test_adapters.py::test_instanttensor_real_on_cuda runs against it: a copying consumer bit-exact with no
# error, a retaining one caught. For bench/device_check.sh; prints PASS/FAIL/SKIP per version, exits 1 on a failure.
#
#   bash bench/instanttensor_check.sh [python]        (default: .venv/bin/python)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${1:-.venv/bin/python}"
status=0
for version in 0.1.5 0.2.2; do
    target=".loaders/instanttensor-$version"
    if [ ! -f "$target/.complete" ]; then
        rm -rf "$target"
        if timeout 300 "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$target" \
                "instanttensor==$version" >/dev/null 2>&1; then
            touch "$target/.complete"
        else
            echo "SKIP instanttensor $version: could not be installed"
            continue
        fi
    fi
    if PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
            tests/adapters/test_adapters.py -k instanttensor_real_on_cuda -rs 2>&1 | tail -3 | grep -q " passed"; then
        echo "PASS instanttensor $version"
    else
        echo "FAIL instanttensor $version (rerun: PYTHONPATH=$target $PY -m pytest -q tests/adapters/test_adapters.py -k instanttensor_real_on_cuda)"
        status=1
    fi
done
exit $status
