#!/usr/bin/env bash
# fuzz_kir.sh — builds the libFuzzer target of the .kir parser
# (tests/fuzz/kir_fuzz.c) with clang, AddressSanitizer and UBSan, outside the
# CMake build (which uses gcc), seeds it with tests/ir/*.kir and runs it.
#   scripts/fuzz_kir.sh [SECONDS] [libFuzzer flags...]     default 120 seconds
# Work and corpus in build-fuzz-kir/ (FUZZ_DIR to change); a crash leaves its
# input there as crash-*, which `build-fuzz-kir/kir_fuzz FILE` replays.
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

seconds=${1:-120}
[ $# -gt 0 ] && shift

cc=${CC:-}
if [ -z "$cc" ]; then
  for c in clang-19 clang-18 clang-17 clang-16 clang-15 clang-14 clang; do
    if command -v "$c" >/dev/null 2>&1; then cc=$c; break; fi
  done
fi
if [ -z "$cc" ]; then
  echo "fuzz_kir.sh: no clang found (Debian: apt-get install -y clang-19, or clang-14)" >&2
  exit 1
fi

out=${FUZZ_DIR:-build-fuzz-kir}
mkdir -p "$out/obj" "$out/corpus" "$out/seeds"
flags=(-std=c11 -O1 -g -D_GNU_SOURCE -Iinclude -Ilib -Iir -fno-omit-frame-pointer
       -fsanitize=address,undefined -fno-sanitize-recover=undefined)

echo "fuzz_kir.sh: building with $cc"
srcs=(lib/*.c ir/*.c)
objs=()
for src in "${srcs[@]}"; do objs+=("$out/obj/$(dirname "$src")_$(basename "${src%.c}").o"); done
stale() { # stale SRC OBJ: the object is missing or older than its source or any header
  local f
  [ -f "$2" ] || return 0
  for f in "$1" lib/*.h ir/*.h include/kiln.h ir/ops.def; do [ "$f" -nt "$2" ] && return 0; done
  return 1
}
pids=()
for src in "${srcs[@]}"; do
  o="$out/obj/$(dirname "$src")_$(basename "${src%.c}").o"
  if stale "$src" "$o"; then "$cc" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$src" -o "$o" & pids+=($!); fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$cc" "${flags[@]}" -fsanitize=fuzzer tests/fuzz/kir_fuzz.c "${objs[@]}" \
  -o "$out/kir_fuzz" -lm -lpthread -ldl

# seeds: the FileCheck tests (valid and malformed)
for f in tests/ir/*.kir tests/ir/bad/*.kir; do cp "$f" "$out/seeds/$(basename "$(dirname "$f")")_$(basename "$f")"; done

echo "fuzz_kir.sh: running $out/kir_fuzz for ${seconds}s"
"$out/kir_fuzz" -max_total_time="$seconds" -max_len=4096 -dict=tests/fuzz/kir.dict -print_final_stats=1 \
  -artifact_prefix="$out/" "$@" "$out/corpus" "$out/seeds"
