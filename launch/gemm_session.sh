#!/usr/bin/env bash
# One device call for the grouped-GEMM work: install, GPU tests, the config sweep and the benchmark.
#
#   bash launch/gemm_session.sh LOGDIR [tests|tune|bench|all ...]
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
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$LOG/install.txt" 2>&1 || { cat "$LOG/install.txt"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$LOG/env.txt"
if has tests; then
  echo "=== pytest gemm/layer GPU tests ($(date -u +%T))"
  $PY -m pytest -q -x -p no:cacheprovider -m gpu tests/test_gemm_gpu.py ${EXTRA_TESTS:-} 2>&1 | tail -40 | tee "$LOG/pytest_gemm_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if has tune; then
  echo "=== tune ($(date -u +%T))"
  $PY launch/tune_gemm.py ${TUNE_ARGS:-} --json "$LOG/tune.json" 2>&1 | tee "$LOG/tune.txt"
fi
if has bench; then
  echo "=== bench ($(date -u +%T))"
  $PY launch/bench_gemm.py ${BENCH_ARGS:-} --markdown "$LOG/bench_gemm.md" --json "$LOG/bench_gemm.json" --sass "$LOG/sass" 2>&1 | tee "$LOG/bench.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
echo "=== done ($(date -u +%T), status $status)"
exit $status
