#!/usr/bin/env bash
# bench_mlp.sh — builds Release in build/ and times one training step of
# the MLP 784-256-256-10 in Kiln (build/bench_mlp: eager, and staged as one
# kiln_function) and in PyTorch eager
# (bench/mlp_torch.py) at batch 64 and 1, alternating the two peers over
# ROUNDS rounds (default 3) because this machine's timings are noisy; prints
# the median of the rounds' medians and torch/kiln (> 1: Kiln is faster),
# (torch/staged too), and the best single run of each as a less noise-prone
# second figure. All
# start from the same weights and data (bench_mlp --dump), so their final
# losses should agree to about 6 digits: a check of Kiln's gradients.
# Extra arguments (--steps N, --runs R, --batch B, --train N) go to both;
# KILN_NUM_THREADS=N sets Kiln's thread count, which torch is then given.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/bench_lib.sh
source scripts/bench_lib.sh

rounds=${ROUNDS:-3}
bench_build bench_mlp

py=$(torch_python)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Kiln's worker count, which torch is given too
threads=$(build/bench_mlp --batch 1 --runs 1 --steps 1 --train 1 --no-staged | sed -n 's/.*\[\([0-9]*\) thread.*/\1/p')
[ -n "$threads" ] || { echo "bench_mlp.sh: build/bench_mlp failed" >&2; exit 1; }
build/bench_mlp --dump "$tmp/init.bin" --batch 1 --runs 1 --steps 1 --train 1 --no-staged >/dev/null

run_kiln() { build/bench_mlp "$@" | tee -a "$tmp/all"; }
run_torch() {
  if [ -n "$py" ]; then
    "$py" bench/mlp_torch.py --threads "$threads" --init "$tmp/init.bin" "$@" | tee -a "$tmp/all"
  fi
}

for ((r = 1; r <= rounds; r++)); do
  # torch's OpenMP threads slow down many times over when another process
  # wants the cores: read a round under a high load average with suspicion
  printf '\n== round %d of %d (load average %s) ==\n' "$r" "$rounds" "$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null)"
  if ((r % 2)); then
    run_kiln "$@"
    run_torch "$@"
  else
    run_torch "$@"
    run_kiln "$@"
  fi
done
[ -n "$py" ] || echo "bench_mlp.sh: no python3 here imports torch (Debian: apt-get install python3-torch); no peer"

printf '\n== summary: median over %d rounds, %d thread(s) each ==\n' "$rounds" "$threads"
awk '
  $1 == "mlp" && $7 == "ms/step" {
    key = $4 SUBSEP $5
    t[key, ++n[key]] = $6
    batches[$4] = 1
    for (i = 1; i < NF; i++) {
      if ($i == "->") loss[key] = $(i + 1)
      if ($i == "min" && (!(key in best) || $(i + 1) < best[key])) best[key] = $(i + 1)
    }
  }
  function median(key,   i, j, v, m) {
    m = n[key]
    for (i = 1; i <= m; i++) v[i] = t[key, i]
    for (i = 2; i <= m; i++) for (j = i; j > 1 && v[j - 1] > v[j]; j--) { x = v[j]; v[j] = v[j - 1]; v[j - 1] = x }
    return m % 2 ? v[(m + 1) / 2] : (v[m / 2] + v[m / 2 + 1]) / 2
  }
  END {
    for (b = 64; b >= 1; b--) {
      if (!(b in batches)) continue
      k = b SUBSEP "kiln"; p = b SUBSEP "torch"; st = b SUBSEP "staged"
      if (!n[k]) continue
      line = sprintf("batch %2d: kiln eager %8.4f ms/step (best %.4f)", b, median(k), best[k])
      if (n[st])
        line = line sprintf("   staged %8.4f ms/step (best %.4f)   eager/staged %.2f", median(st), best[st],
                            median(k) / median(st))
      if (n[p]) {
        line = line sprintf("   torch %8.4f ms/step (best %.4f)   torch/kiln %.2f (best %.2f)",
                            median(p), best[p], median(p) / median(k), best[p] / best[k])
        if (n[st]) line = line sprintf("   torch/staged %.2f", median(p) / median(st))
        line = line sprintf("   final loss kiln %s torch %s", loss[k], loss[p])
      }
      if (n[st]) line = line sprintf(" staged %s", loss[st])
      print line
    }
  }' "$tmp/all"
