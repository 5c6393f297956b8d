#!/usr/bin/env bash
# bench_lib.sh — what the benchmark scripts share; sourced, not run.
#   bench_build TARGET...  installs what is missing (setup.sh) and builds the
#                          targets in a Release build in build/
#   torch_python           prints a python3 that imports torch (Debian's
#                          python3-torch lives in /usr/bin/python3, which may
#                          not be the first python3 on PATH), or nothing

bench_build() {
  ./scripts/setup.sh
  local gen=()
  [ -f build/CMakeCache.txt ] || gen=(-G Ninja)
  cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build --target "$@" -j2
}

torch_python() {
  local p
  for p in /usr/bin/python3 python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import torch' >/dev/null 2>&1; then
      echo "$p"
      return 0
    fi
  done
}
