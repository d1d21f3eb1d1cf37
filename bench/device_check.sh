#!/usr/bin/env bash
# Everything that needs a GPU, in one command, bounded to under 5 minutes:
#   1. the CUDA tests (tests/test_bridge.py's device half, the PTX check, InstantTensor on CUDA);
#   2. the device checksum throughput against torch's int64 sum over the same bytes (target >= 0.85);
#   3. a real InstantTensor load through the adapter (pip-installed if missing and reachable; else skipped);
#   4. rescue=1 and, where the sanitizer has it, guard=1 on a CUDA staging buffer.
# Each section prints PASS, FAIL or SKIP with its figures; the last lines are a summary.
# Usage: bench/device_check.sh [--cpu-ok]
#   PYTHON=...   the interpreter (default: .venv/bin/python if present, else python3)
#   --cpu-ok     without a CUDA device, run what can run and exit 0 (default: exit 2, nothing was checked)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CPU_OK=0
for arg in "$@"; do
  case "$arg" in
    --cpu-ok) CPU_OK=1 ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "device_check: unknown argument '$arg' (known: --cpu-ok, --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
unset OWNERSHIP_SANITIZE OWNERSHIP_SANITIZE_OPTIONS
START=$SECONDS
RESULTS=()
LOG=$(mktemp "${TMPDIR:-/tmp}/device_check-XXXXXX")
trap 'rm -f "$LOG"' EXIT

record() {  # record NAME STATUS DETAIL
  RESULTS+=("$(printf '%-26s %-5s %s' "$1" "$2" "$3")")
  echo "== $1: $2 $3"
}

run_bounded() {  # run_bounded SECONDS CMD...: output to the terminal and $LOG; status 124 on time-out
  local limit=$1
  shift
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$LOG"
  return "${PIPESTATUS[0]}"
}

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "device_check: $PY cannot import torch; set PYTHON to an interpreter that has it" >&2
  exit 2
fi
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
"$PY" - <<'EOF'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
try:
    import numba
    print(f"numba {numba.__version__}")
except ImportError:
    print("numba: not installed (the checksum kernels need it)")
EOF

# 1. The CUDA tests: they skip without a device, so a skip here is a failure when there is one.
t0=$SECONDS
TESTS=(tests/test_bridge.py tests/test_kernels_ptx.py tests/test_adapters.py::test_instanttensor_real_on_cuda)
run_bounded 110 "$PY" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}"
code=$?
summary=$(grep -E '^[0-9]+ (passed|failed)|passed|failed|error' "$LOG" | tail -n 1)
cuda_skips=$(grep -c 'needs a CUDA device' "$LOG")
if [ "$code" = 124 ]; then record "CUDA tests" FAIL "timed out after 110 s"
elif [ "$code" != 0 ]; then record "CUDA tests" FAIL "$summary"
elif [ "$CUDA" = 1 ] && [ "$cuda_skips" != 0 ]; then record "CUDA tests" FAIL "$summary; $cuda_skips skipped for want of a device"
elif [ "$CUDA" = 1 ]; then record "CUDA tests" PASS "$summary ($((SECONDS - t0)) s)"
else record "CUDA tests" SKIP "no CUDA device ($summary)"
fi

# 2. Device checksum throughput vs torch.sum (bench/checksum.py's CUDA section).
t0=$SECONDS
if [ "$CUDA" = 1 ]; then
  run_bounded 60 "$PY" -c '
import argparse, sys
sys.path.insert(0, "bench")
import checksum
checksum.bench_cuda_hash(argparse.Namespace(mib=512, repeats=7))'
  code=$?
  ratio=$(sed -n 's/.*ratio hash\/sum *\([0-9.]*\).*/\1/p' "$LOG" | tail -n 1)
  rates="checksum_into $(awk '/checksum_into/ {print $2, $3}' "$LOG"), torch.sum $(awk '/torch int64 sum/ {print $4, $5}' "$LOG")"
  if [ "$code" != 0 ] || [ -z "$ratio" ]; then record "checksum throughput" FAIL "status $code"
  elif "$PY" -c "import sys; sys.exit(not float('$ratio') >= 0.85)"; then
    record "checksum throughput" PASS "hash/sum $ratio >= 0.85: $rates ($((SECONDS - t0)) s)"
  else
    record "checksum throughput" FAIL "hash/sum $ratio < 0.85: $rates"
  fi
else
  record "checksum throughput" SKIP "no CUDA device"
fi

# 3. A real InstantTensor load through the adapter.
t0=$SECONDS
if [ "$CUDA" != 1 ]; then
  record "InstantTensor load" SKIP "no CUDA device (InstantTensor is CUDA only)"
else
  if ! "$PY" -c 'import instanttensor' 2>/dev/null; then
    echo "instanttensor is not installed; trying pip (20 s at most; the machine may have no network)"
    timeout 20 "$PY" -m pip install -q --timeout 5 --retries 0 instanttensor >/dev/null 2>&1
  fi
  if ! "$PY" -c 'import instanttensor' 2>/dev/null; then
    record "InstantTensor load" SKIP "instanttensor is not installed and could not be (pip install instanttensor)"
  else
    run_bounded 60 "$PY" - <<'EOF'
import os, sys, tempfile, time
import torch
from safetensors.torch import save_file
import instanttensor
import sanitizer
from sanitizer import adapters

adapters.install_import_hooks()
tensors = {f"layers.{i}.weight": torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
           for i in range(16)}
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "model.safetensors")
    save_file(tensors, path)
    with sanitizer.sanitize():
        t0 = time.perf_counter()
        with instanttensor.safe_open([path], framework="pt", device=0, copy=False) as f:
            got = {k: t.cpu() for k, t in f.tensors()}  # a correct consumer: copies each one out
        seconds = time.perf_counter() - t0
        exact = set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
        assert exact and sanitizer.errors() == [], "a correct consumer got a wrong tensor or an error"
        with instanttensor.safe_open([path], framework="pt", device=0, copy=False) as f:
            kept = dict(f.tensors())  # a retaining consumer
        try:
            next(iter(kept.values())).sum()
            raise AssertionError("a retained InstantTensor view was read after its lifetime without an error")
        except sanitizer.OwnershipError as exc:
            caught = type(exc).__name__
nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
print(f"INSTANTTENSOR ok: {len(got)} tensors, {nbytes >> 20} MiB bit-exact in {seconds * 1e3:.1f} ms; "
      f"a retained view raised {caught}")
EOF
    code=$?
    line=$(grep '^INSTANTTENSOR ok' "$LOG" | sed 's/^INSTANTTENSOR ok: //')
    if [ "$code" = 0 ] && [ -n "$line" ]; then record "InstantTensor load" PASS "$line"
    else record "InstantTensor load" FAIL "status $code: $(tail -n 1 "$LOG")"
    fi
  fi
fi

# 4. rescue=1 (and guard=1 where the sanitizer has it) on a CUDA staging buffer.
t0=$SECONDS
if [ "$CUDA" = 1 ]; then DEVICE=cuda; else DEVICE=cpu; fi
DEVICE=$DEVICE run_bounded 40 "$PY" - <<'EOF'
import os
import torch
import sanitizer

device = os.environ["DEVICE"]
src = torch.arange(4096, dtype=torch.float32, device=device)
buf = sanitizer.StagingBuffer(1 << 16, device=device, name=f"{device}-staging")
# rescue: a view kept past its reuse reads its own bytes, not the next tensor's
with sanitizer.sanitize(rescue=1):
    before = len(sanitizer.rescues())
    w = buf.write(0, src, name="layers.0.weight")
    kept = w[:1024]
    del w
    buf.write(0, torch.full((4096,), -1.0, device=device), name="layers.1.weight")  # overwrites those bytes
    assert torch.equal(kept, src[:1024]), "rescue=1 did not keep the retained view's bytes"
    assert not sanitizer.is_borrowed(kept), "a rescued view is still a borrow"
    rescued = len(sanitizer.rescues()) - before
    assert rescued == 1, f"expected one rescue, got {rescued}"
    if device == "cuda":
        torch.cuda.synchronize()
print(f"RESCUE ok on {device}: the retained view kept its bytes (1 rescue)")
# guard: another engineer's option; checked only where this sanitizer has it
if "guard" in sanitizer.options():
    with sanitizer.sanitize(guard=1):
        w = buf.write(0, src, name="layers.2.weight")
        out = w.clone()  # a correct consumer
        kept = w[:16]
        del w
        buf.write(0, torch.zeros(4096, device=device), name="layers.3.weight")
        assert torch.equal(out, src), "guard=1 changed what a correct consumer read"
        try:
            kept.sum()
            raise AssertionError("guard=1: a stale read did not raise")
        except sanitizer.OwnershipError as exc:
            print(f"GUARD ok on {device}: a correct consumer is exact, a stale read raised {type(exc).__name__}")
else:
    print("GUARD skipped: this sanitizer has no 'guard' option")
buf.close()
EOF
code=$?
detail=$(grep -E '^(RESCUE|GUARD)' "$LOG" | tr '\n' ';' | sed 's/;$//; s/;/; /g')
if [ "$code" != 0 ]; then record "rescue and guard" FAIL "status $code: $(tail -n 1 "$LOG")"
elif [ "$CUDA" = 1 ]; then record "rescue and guard" PASS "$detail"
else record "rescue and guard" SKIP "no CUDA device; on cpu: $detail"
fi

echo
echo "device check summary ($((SECONDS - START)) s):"
printf '  %s\n' "${RESULTS[@]}"
if printf '%s\n' "${RESULTS[@]}" | grep -q ' FAIL '; then exit 1; fi
if [ "$CUDA" != 1 ] && [ "$CPU_OK" != 1 ]; then
  echo "no CUDA device: nothing was checked on a GPU (--cpu-ok to accept that)" >&2
  exit 2
fi
exit 0
