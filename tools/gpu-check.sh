#!/usr/bin/env bash
# The GPU machine's check: build, import the CUDA module, run the tests, run the benchmark.
#
#   bash tools/gpu-check.sh [tests/test_x.py ...]     (from the repo root)
#
# Arguments: test files to run instead of all of tests/. Output files go to $OUT (default
# /tmp/jaxops-gpu-check): build.log, tests.log, bench.log, bench.json, bench.md, summary.txt.
# Every step runs whatever the earlier ones did; each is time-boxed so the summary at the end
# (the part of the output that comes back) is always printed. Environment knobs:
#   GPU_CHECK_BUDGET  total seconds (default 530)    BENCH_ARGS  extra `python -m bench` args
#   SKIP_TESTS=1 / SKIP_BENCH=1                       BENCH_RESERVE  seconds kept for the bench (200)
#   PYTEST_ARGS  (default "-q --maxfail=30")
set -uo pipefail
export PYTHONUNBUFFERED=1
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax and torch share the GPU in the bench

OUT="${OUT:-/tmp/jaxops-gpu-check}"
mkdir -p "$OUT"
BUDGET="${GPU_CHECK_BUDGET:-530}"
BENCH_RESERVE="${BENCH_RESERVE:-200}"
T0=$SECONDS
left() { echo $(( BUDGET - (SECONDS - T0) )); }
clamp() { local v=$1 lo=$2 hi=$3; (( v < lo )) && v=$lo; (( v > hi )) && v=$hi; echo "$v"; }
step() { echo; echo "=== $* ($(( SECONDS - T0 )) s elapsed, $(left) s left)"; }

step "machine and versions"
nvidia-smi -L 2>&1 || echo "nvidia-smi failed"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 || true
python3 - <<'EOF' 2>&1
import platform
print("python", platform.python_version())
for mod in ("jax", "jaxlib", "torch", "numpy", "nanobind", "scikit_build_core", "pytest"):
    try:
        m = __import__(mod)
        print(f"{mod} {getattr(m, '__version__', '?')}")
    except Exception as e:
        print(f"{mod}: not importable ({type(e).__name__}: {e})")
try:
    import jax
    print("jax devices:", jax.devices())
except Exception as e:
    print("jax devices: FAILED", e)
EOF
nvcc --version 2>&1 | tail -n 1 || echo "nvcc: missing"
cmake --version 2>&1 | head -n 1 || echo "cmake: missing"

step "build"
T=$(clamp $(( $(left) - BENCH_RESERVE - 60 )) 60 300)
timeout -k 10 "$T" python3 -m pip install --no-build-isolation --no-deps -e . 2>&1 | tee "$OUT/build.log"
BUILD_RC=${PIPESTATUS[0]}
BUILD_S=$(( SECONDS - T0 ))
[[ $BUILD_RC == 124 ]] && echo "build: TIMED OUT after $T s"

step "import jaxops._cuda"
timeout -k 5 60 python3 - <<'EOF' 2>&1 | tee "$OUT/import.log"
import jaxops._cuda as m
print("jaxops._cuda:", m.__file__)
print("CUDA targets:", sorted(m.registrations()))
from jaxops._src.ffi import available_platforms
print("kernel platforms:", available_platforms())
EOF
IMPORT_RC=${PIPESTATUS[0]}

TESTS_RC=skipped
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  step "tests"
  if (( $# )); then TESTS=("$@"); else TESTS=(tests); fi
  T=$(clamp $(( $(left) - BENCH_RESERVE )) 30 600)
  echo "pytest ${TESTS[*]} (time box $T s)"
  # shellcheck disable=SC2086
  JAX_PLATFORMS=cuda timeout -k 10 "$T" python3 -m pytest ${PYTEST_ARGS:--q --maxfail=30} --timeout=600 "${TESTS[@]}" 2>&1 \
    | tee "$OUT/tests.log"
  TESTS_RC=${PIPESTATUS[0]}
  [[ $TESTS_RC == 124 ]] && echo "tests: TIMED OUT after $T s"
fi
TESTS_S=$(( SECONDS - T0 ))

BENCH_RC=skipped
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  step "bench"
  T=$(clamp $(( $(left) - 15 )) 30 400)
  echo "python3 -m bench ${BENCH_ARGS:-} (time box $T s; SIGTERM still prints the table)"
  # shellcheck disable=SC2086
  JAX_PLATFORMS=cuda timeout -k 15 "$T" python3 -m bench --out "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log"
  BENCH_RC=${PIPESTATUS[0]}
fi

# ---- summary: the last part of the output is what comes back
{
  echo
  echo "==================== SUMMARY ($(( SECONDS - T0 )) s) ===================="
  if [[ $BUILD_RC == 0 ]]; then echo "build: ok (${BUILD_S} s)"
  else
    echo "build: FAILED rc=$BUILD_RC (${BUILD_S} s); last lines of build.log:"
    grep -v '^\s*$' "$OUT/build.log" | tail -n 25
  fi
  if [[ $IMPORT_RC == 0 ]]; then echo "import jaxops._cuda: ok; $(grep 'CUDA targets' "$OUT/import.log")"
  else echo "import jaxops._cuda: FAILED rc=$IMPORT_RC: $(tail -n 1 "$OUT/import.log")"; fi
  if [[ $TESTS_RC == skipped ]]; then echo "tests: skipped"
  else
    echo "tests: rc=$TESTS_RC ($(( TESTS_S - BUILD_S )) s): $(grep -E '(passed|failed|error|no tests ran|skipped|deselected)' "$OUT/tests.log" | tail -n 1)"
    if [[ $TESTS_RC != 0 ]]; then
      grep -E '^(FAILED|ERROR) ' "$OUT/tests.log" | head -n 15
      grep -E '^E ' "$OUT/tests.log" | head -n 15
      grep -E 'Timeout|TIMED OUT' "$OUT/tests.log" | head -n 3
    fi
  fi
  if [[ $BENCH_RC == skipped ]]; then echo "bench: skipped"
  else
    echo "bench: rc=$BENCH_RC$([[ $BENCH_RC == 124 ]] && echo ' (timed out)')"
    if [[ -f "$OUT/bench.md" ]]; then echo; cat "$OUT/bench.md"
    else echo "no bench table; last lines of bench.log:"; tail -n 20 "$OUT/bench.log"; fi
  fi
} 2>&1 | tee "$OUT/summary.txt"
