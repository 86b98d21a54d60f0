#!/usr/bin/env bash
# The runs that need several GPUs of one host (one rank a GPU), in two stages that each fit a 10-minute window:
#
#   bash launch/multigpu_suite.sh LOGDIR tests   # install, JIT build, the probe's outputs, pytest -m multigpu
#   bash launch/multigpu_suite.sh LOGDIR bench   # bench_a2a, bench_ep and ep_moe --model deepseek-v3 (torchrun)
#
# Every step has its own time limit (STEP_TIMEOUT_S scales them), so one that hangs costs its limit and the
# rest still run; the exit status is nonzero if any step failed. Logs: LOGDIR/*.txt, JSON results LOGDIR/*.json.
# KERNELS="comm probe ..." builds only those kernel families up front (default: all; the rest build on first use).
set -uo pipefail
LOG=${1:?usage: multigpu_suite.sh LOGDIR tests|bench}
STAGE=${2:?usage: multigpu_suite.sh LOGDIR tests|bench}
mkdir -p "$LOG"
LOG=$(cd "$LOG" && pwd)
cd "$(dirname "$0")/.."
REPO=$PWD
export PYTHONUNBUFFERED=1
# NVLink multicast stays off wherever processes start (the hosts' GPUs are shared).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_MOE_CACHE_DIR=${FLASHINFER_MOE_CACHE_DIR:-/tmp/flashinfer_moe_cache}
PY=${PYTHON:-python3}
SCALE=${STEP_TIMEOUT_S:-1}
status=0

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }
# run LIMIT_S NAME CMD...: CMD with its output in LOG/NAME.txt (and on stdout), killed after LIMIT_S * SCALE s.
run() {
  local limit=$(( $1 * SCALE )) name=$2
  shift 2
  SECONDS=0
  timeout -k 10 "$limit" "$@" >"$LOG/$name.txt" 2>&1
  local rc=$?
  tail -n 40 "$LOG/$name.txt"
  echo "--- $name: exit $rc after ${SECONDS} s (limit ${limit} s)" | tee -a "$LOG/summary.txt"
  [ $rc = 0 ] || status=1
}

step install
$PY -m pip install -q --no-deps --no-build-isolation --no-index --force-reinstall "${WHEEL:-.}" >"$LOG/install.txt" 2>&1 \
  || { cat "$LOG/install.txt"; exit 1; }
cd /tmp  # nothing imports from the checkout from here on
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -lt 2 ]; then
  echo "needs two or more GPUs, found $NGPU" >&2
  exit 1
fi
{ date -u; nvidia-smi -L; nvidia-smi topo -m; flashinfer-moe env; } >"$LOG/env.txt" 2>&1
head -n 20 "$LOG/env.txt"
step "jit build"
build_args=()
for k in ${KERNELS:-}; do build_args+=(--kernel "$k"); done
run 300 jit flashinfer-moe build "${build_args[@]}"

case "$STAGE" in
  tests)
    step "probe"
    {
      echo "\$ flashinfer-moe probe --bandwidth"; flashinfer-moe probe --bandwidth; echo "(exit $?)"
      echo; echo "\$ flashinfer-moe probe --json"; flashinfer-moe probe --json; echo "(exit $?)"
      echo; echo "\$ flashinfer-moe probe"; flashinfer-moe probe; echo "(exit $?)"
      echo; echo "\$ flashinfer-moe probe --timeout 1 --force-failure timeout"
      SECONDS=0; flashinfer-moe probe --timeout 1 --force-failure timeout; rc=$?
      echo "(exit $rc, about ${SECONDS} s wall)"
    } >"$LOG/probe.txt" 2>&1
    tail -n 30 "$LOG/probe.txt"
    # Two runs, so that one that hangs until its limit still leaves the other's results and tracebacks.
    step "pytest -m multigpu, the all-to-all ($NGPU GPUs)"
    run 240 pytest_multigpu_a2a $PY -m pytest -q -p no:cacheprovider -m multigpu -rfEs "$REPO/tests/test_comm_alltoall.py"
    step "pytest -m multigpu, the rest ($NGPU GPUs)"
    run 200 pytest_multigpu_rest $PY -m pytest -q -p no:cacheprovider -m multigpu -rfEs "$REPO/tests" \
      --ignore "$REPO/tests/test_comm_alltoall.py"
    ;;
  bench)
    TR="torchrun --nproc-per-node $NGPU"
    step "all-to-all benchmark ($NGPU ranks)"
    run 150 bench_a2a $TR "$REPO/launch/bench_a2a.py" --json "$LOG/bench_a2a.json"
    step "expert-parallel layer benchmark ($NGPU ranks)"
    run 240 bench_ep $TR "$REPO/launch/bench_ep.py" --json "$LOG/bench_ep.json" --markdown "$LOG/bench_ep.md"
    step "the main job, DeepSeek-V3 layer ($NGPU ranks)"
    run 180 ep_moe $TR "$REPO/launch/ep_moe.py" --model deepseek-v3 --json "$LOG/ep_moe.json"
    ;;
  *)
    echo "unknown stage $STAGE (tests or bench)" >&2
    exit 2
    ;;
esac
step "done (status $status)"
exit $status
