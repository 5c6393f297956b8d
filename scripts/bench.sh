#!/usr/bin/env bash
# bench.sh — builds Release in build/ and runs every benchmark in bench/.
# Speed is measured here, never asserted by tests. `bench.sh --peers` runs
# scripts/bench_issue6.sh instead: the CPU backend's figures beside their
# PyTorch and OpenBLAS peers over several rounds, with medians and ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --peers ]; then
  exec ./scripts/bench_issue6.sh
fi

./scripts/setup.sh
gen=()
[ -f build/CMakeCache.txt ] || gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
benches=()
for src in bench/*.c; do benches+=("$(basename "$src" .c)"); done
cmake --build build --target "${benches[@]}"
# OpenBLAS's idle threads spin for a while after each call and would take
# the second core from Kiln's pool in the alternating matmul comparison.
export OPENBLAS_THREAD_TIMEOUT=4
for b in "${benches[@]}"; do
  printf '\n== %s ==\n' "$b"
  "./build/$b"
done
