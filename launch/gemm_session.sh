#!/usr/bin/env bash
# One device call for the grouped-GEMM work: install, GPU tests, the config sweep and the benchmark.
#
#   bash launch/gemm_session.sh LOGDIR [tests|tune|tune90|profile|ncu|bench|power|all ...]
#
# Optional environment: EXTRA_TESTS (more test files), PYTEST_K (a -k expression), TUNE_ARGS, TUNE90_ARGS, BENCH_ARGS,
# WHEELS (a folder of wheels to install first, default .dev/wheels), PREBUILT (a kernel cache to start from).
set -uo pipefail
LOG=${1:?usage: gemm_session.sh LOGDIR [steps]}
shift
STEPS=${*:-all}
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 FLASHINFER_MOE_CACHE_DIR=${FLASHINFER_MOE_CACHE_DIR:-/tmp/flashinfer_moe_cache}
PY=${PYTHON:-python3}
status=0
has() { [[ " $STEPS " == *" $1 "* || " $STEPS " == *" all "* ]]; }
# Wheels of the dependencies a bare GPU machine lacks (nvidia-cutlass's headers), if the caller brought them.
WHEELS=${WHEELS:-.dev/wheels}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  $PY -m pip install -q --no-deps --no-index "$WHEELS"/*.whl >"$LOG/install_wheels.txt" 2>&1 || { cat "$LOG/install_wheels.txt"; exit 1; }
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOG/install.txt" 2>&1 || { cat "$LOG/install.txt"; exit 1; }
if [ -n "${PREBUILT:-}" ] && [ -d "$PREBUILT" ]; then
  mkdir -p "$FLASHINFER_MOE_CACHE_DIR" && cp -rn "$PREBUILT"/. "$FLASHINFER_MOE_CACHE_DIR"/
fi
echo "=== kernel builds ($(date -u +%T))"
$PY -m flashinfer_moe build 2>&1 | tee "$LOG/build.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$LOG/env.txt"
if has tests; then
  echo "=== pytest gemm/layer GPU tests ($(date -u +%T))"
  $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gemm_gpu.py tests/test_packed_gpu.py ${EXTRA_TESTS:-} ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -40 | tee "$LOG/pytest_gemm_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has tune; then
  echo "=== tune ($(date -u +%T))"
  $PY launch/tune_gemm.py ${TUNE_ARGS:-} --json "$LOG/tune.json" 2>&1 | tee "$LOG/tune.txt"
fi
if has tune90; then
  echo "=== CUTLASS config sweep ($(date -u +%T))"
  $PY launch/tune_gemm_sm90.py ${TUNE90_ARGS:-} --json "$LOG/tune_sm90.json" 2>&1 | tee "$LOG/tune_sm90.txt"
fi
if has profile; then
  echo "=== group-count profile ($(date -u +%T))"
  $PY launch/profile_gemm_sm90.py ${PROFILE_ARGS:-} --json "$LOG/profile.json" 2>&1 | tee "$LOG/profile.txt"
fi
# Hardware counters of single launches (NCU_CASES: "case:config ..."), where ncu can read them.
if has ncu && command -v ncu >/dev/null; then
  for c in ${NCU_CASES:-masked16:pingpong contiguous32:coop}; do
    echo "=== ncu $c ($(date -u +%T))"
    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section LaunchStats -k regex:device_kernel --launch-skip 2 --launch-count 1 \
      $PY launch/profile_gemm_sm90.py --once "${c%%:*}" --config "${c##*:}" >"$LOG/ncu_${c/:/_}.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Registers|Shared Memory Config|Stall|Warp Cycles" \
      "$LOG/ncu_${c/:/_}.txt" | head -20
  done
fi
if has bench; then
  echo "=== bench ($(date -u +%T))"
  $PY launch/bench_gemm.py ${BENCH_ARGS:-} --markdown "$LOG/bench_gemm.md" --json "$LOG/bench_gemm.json" --sass "$LOG/sass" 2>&1 | tee "$LOG/bench.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has power; then
  echo "=== power and clocks ($(date -u +%T))"
  $PY launch/power_gemm.py --json "$LOG/power_gemm.json" 2>&1 | tee "$LOG/power.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
echo "=== done ($(date -u +%T), status $status)"
exit $status
