#!/usr/bin/env bash
# Runs everything that needs a GPU in one go: install, JIT compile times, the GPU test tiers and the
# benchmarks. Logs go to the directory given as the first argument.
#
#   bash launch/gpu_suite.sh LOGDIR [--quick | --no-bench]
#
# --quick: a short routing benchmark; --no-bench: none. BENCHES (default "routing permute gemm"; add "a2a" for
# the all-to-all benchmark under torchrun on two or more GPUs) picks
# the benchmarks; SKIP_CPU_TIER=1 skips the CPU tests. With two or more GPUs it also runs the multigpu tier and
# records the probe's outputs (plain, --json, --bandwidth, and a forced failure) in probe.txt.
set -uo pipefail
LOG=${1:?usage: gpu_suite.sh LOGDIR [--quick]}
QUICK=${2:-}
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_MOE_CACHE_DIR=${FLASHINFER_MOE_CACHE_DIR:-/tmp/flashinfer_moe_cache}
PY=${PYTHON:-python3}
status=0

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step install
# Regular (non-editable) install: the kernels' sources are then read from the installed package.
# WHEEL=path installs a wheel built elsewhere (machines that cannot build one); else build from the checkout.
$PY -m pip install -q --no-deps --no-build-isolation --no-index --force-reinstall "${WHEEL:-.}" \
  >"$LOG/env.txt" 2>&1 || { cat "$LOG/env.txt"; exit 1; }
cd /tmp  # from here on, nothing may import from the checkout by accident
REPO=$OLDPWD

step env
flashinfer-moe env | tee -a "$LOG/env.txt"
nvidia-smi topo -m >>"$LOG/env.txt" 2>&1

step "jit: cold and warm builds"
flashinfer-moe clear-cache
TIMEFORMAT="cold build: %R s wall"
{ time flashinfer-moe build; } 2>&1 | tee "$LOG/jit.txt"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
TIMEFORMAT="warm (cached) build: %R s wall"
{ time flashinfer-moe build; } 2>&1 | tee -a "$LOG/jit.txt"
# First call in a fresh process with an empty cache: what a user waits the first time.
flashinfer-moe clear-cache >/dev/null
$PY - <<'PYEOF' 2>&1 | tee -a "$LOG/jit.txt" || status=1
import time, torch, flashinfer_moe
x = torch.randn(16, 256, device="cuda")
t0 = time.perf_counter(); flashinfer_moe.route(x, 8); torch.cuda.synchronize(); t1 = time.perf_counter()
flashinfer_moe.route(x, 8); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"first route() call (compile + load + run): {t1 - t0:.2f} s; second call: {(t2 - t1) * 1e3:.3f} ms")
ids = torch.randint(0, 256, (16, 8), device="cuda", dtype=torch.int32)
h = torch.randn(16, 7168, device="cuda", dtype=torch.bfloat16)
def layer():
    layout = flashinfer_moe.moe_align_contiguous(ids, 256, 128)
    flashinfer_moe.permute_fp8_per_token_group(h, layout)
t0 = time.perf_counter(); layer(); torch.cuda.synchronize(); t1 = time.perf_counter()
layer(); torch.cuda.synchronize(); t2 = time.perf_counter()
print(f"first align + permute call (compile + load + run): {t1 - t0:.2f} s; second call: {(t2 - t1) * 1e3:.3f} ms")
PYEOF

if [ -z "${SKIP_CPU_TIER:-}" ]; then  # SKIP_CPU_TIER=1 saves device time when only GPU code changed
  step "pytest CPU tier"
  $PY -m pytest -q -p no:cacheprovider "$REPO/tests" 2>&1 | tee "$LOG/pytest_cpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

step "pytest -m gpu"
$PY -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests" 2>&1 | tee "$LOG/pytest_gpu.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ "$NGPU" -ge 2 ]; then
  step "pytest -m multigpu ($NGPU GPUs)"
  $PY -m pytest -q -p no:cacheprovider -m multigpu "$REPO/tests" 2>&1 | tee -a "$LOG/pytest_gpu.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

step "probe"
{
  echo "\$ flashinfer-moe probe --bandwidth"; flashinfer-moe probe --bandwidth; echo "(exit $?)"
  echo; echo "\$ flashinfer-moe probe --json"; flashinfer-moe probe --json; echo "(exit $?)"
  echo; echo "\$ flashinfer-moe probe --timeout 1 --force-failure timeout"
  SECONDS=0; flashinfer-moe probe --timeout 1 --force-failure timeout; rc=$?
  echo "(exit $rc, about ${SECONDS} s wall)"
} 2>&1 | tee "$LOG/probe.txt"

step "kernels' resource usage (registers, stack, shared memory)"
for so in $(find "$FLASHINFER_MOE_CACHE_DIR" -name 'lib*.so' | sort); do
  echo "--- $(basename "$so")"
  cuobjdump --dump-resource-usage "$so" 2>&1 | grep -E "Function|REG" | head -60
done | tee -a "$LOG/jit.txt"

BENCHES=${BENCHES:-routing permute gemm}
if [ "$QUICK" != "--no-bench" ] && [[ " $BENCHES " == *" routing "* ]]; then
  step "benchmark: routing"
  if [ "$QUICK" = "--quick" ]; then extra="--tokens 1,4096 --models deepseek_v3 --no-compile"; else extra=""; fi
  $PY "$REPO/launch/bench_routing.py" $extra --markdown "$LOG/bench_routing.md" --json "$LOG/bench_routing.json"
  [ $? = 0 ] || status=1
fi
if [ "$QUICK" != "--no-bench" ] && [[ " $BENCHES " == *" permute "* ]]; then
  step "benchmark: layout, permute and combine"
  $PY "$REPO/launch/bench_permute.py" --markdown "$LOG/bench_permute.md" --json "$LOG/bench_permute.json"
  [ $? = 0 ] || status=1
fi

if [ "$QUICK" != "--no-bench" ] && [[ " $BENCHES " == *" gemm "* ]]; then
  step "benchmark: grouped GEMMs and fused_moe (with the SASS check)"
  $PY "$REPO/launch/bench_gemm.py" --markdown "$LOG/bench_gemm.md" --json "$LOG/bench_gemm.json" --sass "$LOG/sass"
  [ $? = 0 ] || status=1
fi
if [ "$NGPU" -ge 2 ] && [[ " $BENCHES " == *" a2a "* ]]; then
  step "benchmark: all-to-all ($NGPU ranks)"
  torchrun --nproc-per-node "$NGPU" "$REPO/launch/bench_a2a.py" --json "$LOG/bench_a2a.json" 2>&1 | tee "$LOG/bench_a2a.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

step "done (status $status)"
exit $status
