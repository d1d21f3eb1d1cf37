#!/usr/bin/env bash
# The GPU check, in one prepared run (at most 6 minutes on one GPU, whatever hangs; no network needed):
#   0. trap mode's probe first (bench/device_trap.py --probe-only): what the fake driver cannot answer
#   1. the environment: python, torch and its CUDA, the GPUs, numba and its CUDA target (numba's built-in
#      one or NVIDIA's numba-cuda), the CUDA toolkit found as tests/cuda/test_kernels_ptx.py finds it (exported
#      as CUDA_HOME), the NVVM version, the kernels compiled and loaded (seconds, registers, resident blocks)
#   2. InstantTensor installed offline from .whl/ (put there by bench/device_prepare.sh) into a temp dir
#   3. the CUDA tests: tests/cuda/test_cuda_device.py on the GPU (OWNSAN_REQUIRE_CUDA=1: never the fake devices),
#      the device half of tests/cuda/test_bridge.py, the PTX/ptxas check, the launch tests, InstantTensor on CUDA;
#      a skip is a failure, except the multi-GPU case on a one-GPU machine and the ptxas check without ptxas
#   4. the hash against torch's int64 sum of the same bytes (>= 0.9), misaligned against aligned, and the
#      host synchronisations per CUDA lend with checksum=1 (torch's sync debug mode: none), bench/device_hash.py
#   5. a real InstantTensor load through the adapter with checksum=1: bit-exact, a retained view caught
#   6. trap mode on CUDA (the driver's virtual memory management), bench/device_trap.py: a raw alias of a
#      retired lease reads poison, after rescue=1 the rescued bytes; lend and a ring load with trap against
#      without (bit-identical); trap=fault ends a read with CUDA's illegal-address error (in a child)
# Each section prints PASS, FAIL or SKIP with its figures as soon as it ends, on stdout and into
# $OUT/device_check.txt (the section logs into $OUT/device_check.log), so a run cut short still says what
# it found; the summary comes last. Every section runs under what is left of the budget (360 s on a GPU).
# Usage: bench/device_check.sh [--cpu-ok]
#   PYTHON=...  the interpreter (default: .venv/bin/python if present, else python3)
#   OUT=...     where the verdicts and the log go (default: a new directory under $TMPDIR, kept)
#   DEVICE_CHECK_BUDGET=...  seconds for the whole check (default 360 on a GPU, 900 with --cpu-ok)
#   --cpu-ok    without a CUDA device, run the CPU-safe parts instead (the PTX/ptxas check, the fake-device
#               and simulator suites, the launch tests) and exit 0 if they pass (default: exit 2, since
#               nothing was checked on a GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
CPU_OK=0
for arg in "$@"; do
  case "$arg" in
    --cpu-ok) CPU_OK=1 ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "device_check: unknown argument '$arg' (known: --cpu-ok, --help)" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, installed or not
unset OWNERSHIP_SANITIZE OWNERSHIP_SANITIZE_OPTIONS NUMBA_ENABLE_CUDASIM
START=$SECONDS
RESULTS=()
WORK=$(mktemp -d "${TMPDIR:-/tmp}/device_check-XXXXXX")  # scratch (pip's, the wheel's site): removed at exit
trap 'rm -rf "$WORK"' EXIT

record() {  # record NAME STATUS DETAIL: printed and written at once (a run cut short keeps what it found)
  local line
  line=$(printf '%-22s %-5s %s' "$1" "$2" "$3")
  RESULTS+=("$line")
  echo "== $1: $2 $3"
  echo "$line" >>"$VERDICTS"
}

left() {  # seconds of the budget left, less a margin for the summary
  echo $((BUDGET - (SECONDS - START) - 5))
}

run_bounded() {  # run_bounded SECONDS CMD...: output to the terminal, $LOG and $FULL_LOG; 124 on time-out
  local limit=$1 rest
  shift
  rest=$(left)
  if [ "$rest" -lt "$limit" ]; then limit=$rest; fi
  if [ "$limit" -lt 10 ]; then
    echo "(not run: the check's ${BUDGET} s budget is spent)" | tee "$LOG" >>"$FULL_LOG"
    return 124
  fi
  echo "--- $* (at most $limit s)" >>"$FULL_LOG"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$LOG" | tee -a "$FULL_LOG"
  return "${PIPESTATUS[0]}"
}

unexpected_skips() {  # unexpected_skips ALLOWED_REGEX: the pytest skip lines of $LOG that are not allowed
  grep -E '^SKIPPED \[' "$LOG" | grep -vE "$1" || true
}

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "device_check: $PY cannot import torch; set PYTHON to an interpreter that has it" >&2
  exit 2
fi
CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))')
NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$CUDA" != 1 ] && [ "$CPU_OK" != 1 ]; then
  echo "device_check: torch sees no CUDA device: nothing can be checked on a GPU (--cpu-ok runs the CPU-safe parts)" >&2
  exit 2
fi
if [ "$CUDA" = 1 ]; then BUDGET=${DEVICE_CHECK_BUDGET:-360}; else BUDGET=${DEVICE_CHECK_BUDGET:-900}; fi
case "$BUDGET" in
  ''|*[!0-9]*) echo "device_check: DEVICE_CHECK_BUDGET must be a whole number of seconds, got '$BUDGET'" >&2; exit 2 ;;
esac
# (only a run that checks something writes its files: one that stops above leaves $OUT as it was)
DEST=${OUT:-}
if [ -z "$DEST" ]; then DEST=$(mktemp -d "${TMPDIR:-/tmp}/device_check-out-XXXXXX"); fi
if ! mkdir -p "$DEST" 2>/dev/null || [ ! -w "$DEST" ]; then
  echo "device_check: OUT='$DEST' is not a directory this run can write its verdicts to" >&2
  exit 2
fi
VERDICTS="$DEST/device_check.txt"
FULL_LOG="$DEST/device_check.log"
LOG="$WORK/section"  # the running section's output (also appended to $FULL_LOG)
: >"$VERDICTS"
: >"$FULL_LOG"
echo "device_check: verdicts go to $VERDICTS as each section ends, the sections' output to $FULL_LOG"

# 0. What cannot be known without a GPU, asked first (issue 48): does cuMemMap refuse a non-zero offset,
#    does a device accept a read-only mapping, what does a trap lend cost behind queued work.
if [ "$CUDA" = 1 ]; then
  run_bounded 90 "$PY" bench/device_trap.py --probe-only
  code=$?
  probes=$(grep -E '^PROBE' "$LOG" | tr '\n' ';' | sed 's/;$//')
  if [ "$code" = 0 ]; then record "trap probe" PASS "$probes"
  else record "trap probe" FAIL "status $code: ${probes:-$(tail -n 1 "$LOG")}"
  fi
fi

# 1. The environment, the toolkit, the kernels.
t0=$SECONDS
if TOOLKIT=$("$PY" tests/cuda_toolkit.py --export 2>"$WORK/toolkit"); then
  eval "$TOOLKIT"
fi
echo "toolkit: $(cat "$WORK/toolkit")${CUDA_HOME:+ (CUDA_HOME=$CUDA_HOME)}"
CUDA=$CUDA run_bounded 60 "$PY" - <<'EOF'
import json, os, platform, time
import torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.multi_processor_count} SMs, {p.total_memory >> 30} GiB, cc {p.major}.{p.minor}")
import numba
from numba import cuda
print(f"numba {numba.__version__}, CUDA target: {getattr(cuda, 'implementation', '?')}"
      f"{'' if getattr(cuda, 'implementation', '') == 'NVIDIA' else ' (numba-cuda not installed)'}")
try:
    from numba.cuda.cudadrv import nvvm
    print("NVVM", ".".join(map(str, nvvm.NVVM().get_version())))
except Exception as exc:
    print(f"NVVM unavailable: {type(exc).__name__}: {exc}")
if os.environ["CUDA"] == "1":
    import cuda_hooks
    t0 = time.perf_counter()
    cuda_hooks.warm()
    info = cuda_hooks.kernel_info()
    print(f"KERNELS warm in {time.perf_counter() - t0:.2f} s; registers {info['registers']}; resident blocks "
          f"{info['resident_blocks']}; first use (s) {json.dumps({k: round(v, 3) for k, v in info['compile_seconds'].items()})}")
EOF
code=$?
kernels=$(sed -n 's/^KERNELS //p' "$LOG")
nvvm=$(grep -E '^NVVM' "$LOG" | head -n 1)
impl=$(sed -n 's/.*CUDA target: \([^ ]*\).*/\1/p' "$LOG")
if [ "$code" != 0 ]; then record "environment" FAIL "status $code: $(tail -n 1 "$LOG")"
elif [ "$CUDA" = 1 ] && [ -z "$kernels" ]; then record "environment" FAIL "the kernels did not build: $nvvm"
elif [ "$CUDA" = 1 ]; then record "environment" PASS "numba CUDA target $impl, $nvvm; $kernels ($((SECONDS - t0)) s)"
else record "environment" SKIP "no CUDA device; numba CUDA target $impl, $nvvm"
fi

# 2. InstantTensor, offline.
if [ "$CUDA" = 1 ]; then
  if "$PY" -c 'import instanttensor' 2>/dev/null; then
    record "InstantTensor wheel" PASS "already installed"
  elif ! ls .whl/instanttensor-*.whl >/dev/null 2>&1; then
    record "InstantTensor wheel" FAIL "no .whl/instanttensor-*.whl here: .whl/ is git-ignored, so it reaches the device machine only when the run carries it (the run tool's carry: [\".whl\"]), after bench/device_prepare.sh filled it where there is network"
  elif timeout 60 "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --find-links .whl \
        --target "$WORK/site" instanttensor >"$WORK/pip" 2>&1; then
    export PYTHONPATH="$PYTHONPATH:$WORK/site"
    record "InstantTensor wheel" PASS "$(ls "$WORK/site" | grep -m1 dist-info) from .whl/"
  else
    record "InstantTensor wheel" FAIL "not installable offline from .whl/ (none for this Python?): $(tail -n 1 "$WORK/pip" 2>/dev/null)"
  fi
fi

# 3. The tests. On a GPU nothing may skip but the multi-GPU case on a one-GPU machine.
t0=$SECONDS
if [ "$CUDA" = 1 ]; then
  TESTS=(tests/cuda/test_cuda_device.py tests/cuda/test_bridge.py tests/cuda/test_kernels_ptx.py tests/cuda/test_cuda_launch.py
         tests/cuda/test_cuda_extras.py tests/adapters/test_adapters.py::test_instanttensor_real_on_cuda)
  ALLOWED='ptxas is not on the PATH'  # (the kernels' registers are then read from the loaded module, section 1)
  [ "$NGPU" -lt 2 ] && ALLOWED="$ALLOWED|needs 2 CUDA devices"
  LIMIT=180
else
  TESTS=(tests/cuda/test_kernels_ptx.py tests/cuda/test_cuda_fake.py tests/cuda/test_cuda_device.py tests/cuda/test_cuda_launch.py
         tests/cuda/test_cuda_extras.py tests/cuda/test_kernels_cuda_sim.py tests/cuda/test_cuda_fake_simulator.py tests/cuda/test_bridge.py
         tests/cuda/test_trap_cuda.py)
  ALLOWED='needs a CUDA device'
  LIMIT=540
fi
OWNSAN_REQUIRE_CUDA=$CUDA run_bounded "$LIMIT" "$PY" -m pytest -q -rs -s -p no:cacheprovider "${TESTS[@]}"
code=$?
summary=$(grep -E '[0-9]+ (passed|failed|error)' "$LOG" | tail -n 1)
skips=$(unexpected_skips "$ALLOWED")
regs=$(grep -oE '(checksum|verify): [0-9]+ registers per thread on sm_90' "$LOG" | sed 's/ registers.*//' | tr '\n' ' ')
if [ "$code" = 124 ] || [ "$code" = 137 ]; then record "tests" FAIL "timed out (limit $LIMIT s, budget $BUDGET s): $summary"
elif [ "$code" != 0 ]; then record "tests" FAIL "$summary"
elif [ -n "$skips" ]; then record "tests" FAIL "$summary; unexpected skips: $(echo "$skips" | tr '\n' ';')"
else record "tests" PASS "$summary; sm_90 registers: ${regs:-?}($((SECONDS - t0)) s)"
fi

# 4. The hash against the memory bandwidth.
t0=$SECONDS
if [ "$CUDA" = 1 ]; then
  run_bounded 75 "$PY" bench/device_hash.py --mib 1024 --repeats 3
  code=$?
  verdicts=$(grep '^VERDICT' "$LOG" | sed 's/^VERDICT //' | tr '\n' ';')
  figures=$(grep -E 'GB/s (read|of traffic)|synchronisations per CUDA lend' "$LOG" | sed 's/^ *//; s/ GB\/s.*/ GB\/s/' | tr '\n' ';')
  if [ "$code" = 0 ]; then record "hash throughput" PASS "$figures $verdicts ($((SECONDS - t0)) s)"
  else record "hash throughput" FAIL "status $code: ${verdicts:-$(tail -n 1 "$LOG")}"
  fi
else
  record "hash throughput" SKIP "no CUDA device"
fi

# 5. A real InstantTensor load through the adapter, checksums on.
t0=$SECONDS
if [ "$CUDA" = 1 ]; then
  run_bounded 45 "$PY" - <<'EOF'
import os, tempfile, time
import torch
from safetensors.torch import save_file
import sanitizer
from sanitizer import adapters

adapters.install_import_hooks()
import instanttensor

tensors = {f"layers.{i}.weight": torch.randn(1024, 1023, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
           for i in range(16)}  # odd row length: leases start at every 2-byte offset
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "model.safetensors")
    save_file(tensors, path)
    with sanitizer.sanitize(checksum=1):
        t0 = time.perf_counter()
        with instanttensor.safe_open([path], framework="pt", device=0, copy=False) as f:
            got = {k: t.cpu() for k, t in f.tensors()}  # a correct consumer: copies each one out
        seconds = time.perf_counter() - t0
        sanitizer.synchronize()
        exact = set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)
        assert exact and sanitizer.errors() == [], f"a correct consumer got a wrong tensor or an error: {sanitizer.errors()[:1]}"
        with instanttensor.safe_open([path], framework="pt", device=0, copy=False) as f:
            kept = dict(f.tensors())  # a retaining consumer
        try:
            next(iter(kept.values())).sum()
            raise AssertionError("a retained InstantTensor view was read after its lifetime without an error")
        except sanitizer.OwnershipError as exc:
            caught = type(exc).__name__
nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
print(f"INSTANTTENSOR ok: {len(got)} tensors, {nbytes >> 20} MiB bit-exact with checksum=1 in {seconds * 1e3:.1f} ms; "
      f"a retained view raised {caught}")
EOF
  code=$?
  line=$(sed -n 's/^INSTANTTENSOR ok: //p' "$LOG")
  if [ "$code" = 0 ] && [ -n "$line" ]; then record "InstantTensor load" PASS "$line ($((SECONDS - t0)) s)"
  else record "InstantTensor load" FAIL "status $code: $(tail -n 1 "$LOG")"
  fi
else
  record "InstantTensor load" SKIP "no CUDA device (InstantTensor is CUDA only)"
fi

# 6. Trap mode on CUDA.
t0=$SECONDS
if [ "$CUDA" = 1 ]; then
  run_bounded 60 "$PY" bench/device_trap.py --leases 200 --repeats 3
  code=$?
  figures=$(grep -E '^(granularity|ALIASES|RESCUE|LEND|RING|FAULT)' "$LOG" | tr '\n' ';')
  if [ "$code" = 0 ]; then record "trap mode on CUDA" PASS "$figures ($((SECONDS - t0)) s)"
  else record "trap mode on CUDA" FAIL "status $code: ${figures:-$(tail -n 1 "$LOG")}"
  fi
else
  record "trap mode on CUDA" SKIP "no CUDA device (tests/cuda/test_trap_cuda.py ran on the fake in section 3)"
fi

echo
echo "device check summary ($((SECONDS - START)) s of a ${BUDGET} s budget, $NGPU GPU(s)); also in $VERDICTS:"
printf '  %s\n' "${RESULTS[@]}"
echo "summary: $((SECONDS - START)) s, $NGPU GPU(s)" >>"$VERDICTS"
if printf '%s\n' "${RESULTS[@]}" | grep -q ' FAIL '; then exit 1; fi
exit 0
