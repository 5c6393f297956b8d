#!/usr/bin/env bash
# tour.sh — the demo: installs what is missing, builds Release in build/ and
# runs the tour (examples/tour.c).
set -euo pipefail
cd "$(dirname "$0")/.."

./scripts/setup.sh
gen=()
[ -f build/CMakeCache.txt ] || gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target tour
exec ./build/tour
