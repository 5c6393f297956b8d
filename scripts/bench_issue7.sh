#!/usr/bin/env bash
# bench_issue7.sh — the CUDA backend's benchmarks (issue 7) beside PyTorch on
# the same GPU, in the same run: builds Release in build/, then runs ROUNDS
# rounds (default 3) of build/bench_gpu (fused chain vs the device copy,
# sgemm 4096, the 1000x1000 matmul chain x200, the MLP training step staged
# on the GPU) and bench/gpu_torch.py, Kiln first in odd rounds and PyTorch in
# even ones. Every program prints "@ KEY VALUE UNIT" lines; the summary gives
# each figure's median over the rounds and, for each comparison, the median
# of the ratio taken within a round. Without a GPU both programs say
# "no GPU: skipped" and the script exits 0. Environment: ROUNDS=N; QUICK=1
# for shorter runs; KEEP=DIR keeps the raw log.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_lib.sh
source scripts/bench_lib.sh

rounds=${ROUNDS:-3}
quick=${QUICK:-0}
bench_build bench_gpu

py=$(torch_python)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Kiln's disk cache (compiled code and PTX): one fresh directory for the run
export KILN_CACHE_DIR=$tmp/cache
log=$tmp/log
figs=$tmp/figures
touch "$figs"
args=()
((quick)) && args=(--quick)

probe=$(build/bench_gpu --only none 2>&1 || true)
if grep -q 'no GPU: skipped' <<<"$probe"; then
  printf '%s\n' "$probe"
  [ -z "$py" ] || "$py" bench/gpu_torch.py --only sgemm --quick | grep -i 'skipped' || true
  echo "bench_issue7.sh: no GPU on this machine: nothing measured"
  exit 0
fi

round=0
run() { bench_run "$@"; }

start=$(date +%s)
for ((round = 1; round <= rounds; round++)); do
  printf '\n======== round %d of %d ========\n' "$round" "$rounds"
  if ((round % 2)); then
    run kiln build/bench_gpu "${args[@]}"
    run torch "$py" bench/gpu_torch.py "${args[@]}"
  else
    run torch "$py" bench/gpu_torch.py "${args[@]}"
    run kiln build/bench_gpu "${args[@]}"
  fi
done
[ -n "$py" ] || echo "bench_issue7.sh: no python3 here imports torch: no PyTorch peer"
if [ -n "${KEEP:-}" ]; then
  mkdir -p "$KEEP"
  cp "$log" "$figs" "$KEEP/"
fi

printf '\n======== summary: %d round(s), %d s; median over rounds [min..max] (n rounds) ========\n' \
  "$rounds" "$(($(date +%s) - start))"
# LABEL|NUM|DEN|GOAL: NUM/DEN within each round, then the median over rounds
cat >"$tmp/ratios" <<EOF
fused: staged / device copy (GB/s)|gpu.fused.staged|gpu.fused.copy|>= 0.85
fused: eager / device copy (GB/s)|gpu.fused.eager|gpu.fused.copy|
fused: staged / torch eager (GB/s)|gpu.fused.staged|gpu.fused.torch|
fused: torch eager / its device copy (GB/s)|gpu.fused.torch|gpu.fused.copy.torch|
sgemm 4096: eager / torch (GFLOP/s)|gpu.sgemm4096.eager|gpu.sgemm4096.torch|
sgemm 4096: staged / torch (GFLOP/s)|gpu.sgemm4096.staged|gpu.sgemm4096.torch|
seed chain: torch s / kiln s (> 1: Kiln faster)|gpu.seed.chain.torch|gpu.seed.chain|
mlp batch 64: torch / staged ms (> 1: staged faster)|gpu.mlp.b64.torch|gpu.mlp.b64.staged|
EOF
bench_summary "$figs" "$tmp/ratios" /dev/null
