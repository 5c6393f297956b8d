#!/usr/bin/env bash
# fuzz.sh — builds the libFuzzer target of the checkpoint reader
# (tests/fuzz/checkpoint_fuzz.c) with clang, AddressSanitizer and UBSan, outside
# the CMake build (which uses gcc and never needs clang), and runs it.
#   scripts/fuzz.sh [SECONDS] [libFuzzer flags...]     default 180 seconds
# Work and corpus in build-fuzz/ (FUZZ_DIR to change); a crash leaves its
# input there as crash-*, which `build-fuzz/checkpoint_fuzz FILE` replays.
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

seconds=${1:-180}
[ $# -gt 0 ] && shift

cc=${CC:-}
if [ -z "$cc" ]; then
  for c in clang-19 clang-18 clang-17 clang-16 clang-15 clang-14 clang; do
    if command -v "$c" >/dev/null 2>&1; then cc=$c; break; fi
  done
fi
if [ -z "$cc" ]; then
  echo "fuzz.sh: no clang found (Debian: apt-get install -y clang-19, or clang-14)" >&2
  exit 1
fi

out=${FUZZ_DIR:-build-fuzz}
mkdir -p "$out/obj" "$out/corpus" "$out/seeds"
flags=(-std=c11 -O1 -g -D_GNU_SOURCE -Iinclude -Ilib -Iir -fno-omit-frame-pointer
       -fsanitize=address,undefined -fno-sanitize-recover=undefined)

echo "fuzz.sh: building with $cc"
objs=()
for src in lib/*.c; do objs+=("$out/obj/$(basename "${src%.c}").o"); done
# stale: the object is missing or older than its source or any header
stale() {
  local f
  [ -f "$2" ] || return 0
  for f in "$1" lib/*.h include/kiln.h ir/ops.def; do [ "$f" -nt "$2" ] && return 0; done
  return 1
}
for src in lib/*.c; do
  if stale "$src" "$out/obj/$(basename "${src%.c}").o"; then echo "$src"; fi
done | xargs -r -P "$(nproc)" -I{} sh -c \
  'o="$1/obj/$(basename "${2%.c}").o"; shift 2; exec "$@" -fsanitize=fuzzer-no-link -c "$0" -o "$o"' \
  {} "$out" {} "$cc" "${flags[@]}"
"$cc" "${flags[@]}" -fsanitize=fuzzer tests/fuzz/checkpoint_fuzz.c "${objs[@]}" \
  -o "$out/checkpoint_fuzz" -lm -lpthread -ldl

# seeds: valid files whose tensors match the harness's variables
seed() { # seed NAME HEADER DATA (DATA as printf escapes)
  local h=$2
  while (( ${#h} % 8 )); do h+=" "; done
  local n=${#h}
  {
    printf "$(printf '\\%03o\\%03o\\%03o\\%03o\\000\\000\\000\\000' \
      $((n & 255)) $((n >> 8 & 255)) $((n >> 16 & 255)) $((n >> 24 & 255)))"
    printf '%s' "$h"
    printf "$3"
  } >"$out/seeds/$1"
}
f32w='\0\0\200\77\0\0\0\100\0\0\100\100\0\0\200\100\0\0\240\100\0\0\300\100' # 1..6
i64='\7\0\0\0\0\0\0\0'
f64='\0\0\0\0\0\0\340\77'
f16='\0\74\0\100\0\274'
seed full.st '{"__metadata__":{"format":"pt"},"d":{"dtype":"F64","shape":[1,1],"data_offsets":[0,8]},'\
'"step":{"dtype":"I64","shape":[],"data_offsets":[8,16]},"w":{"dtype":"F32","shape":[2,3],"data_offsets":[16,40]},'\
'"h":{"dtype":"F16","shape":[3],"data_offsets":[40,46]},"e":{"dtype":"BF16","shape":[0,2],"data_offsets":[46,46]},'\
'"m":{"dtype":"BOOL","shape":[2],"data_offsets":[46,48]},"x":{"dtype":"U8","shape":[1],"data_offsets":[48,49]}}' \
  "$f64$i64$f32w$f16\1\0\5"
seed spaced.st '{"w": {"shape": [2, 3], "data_offsets": [0, 24], "dtype": "F32", '\
'"extra": [1, -2.5e3, true, null, {"a": "b\u00e9\ud83d\ude00\n"}]}, "__metadata__": {"k": "v"}}' "$f32w"
seed hf.st '{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}' "$f32w"
seed empty.st '{}' ''

dict=tests/fuzz/safetensors.dict
echo "fuzz.sh: running $out/checkpoint_fuzz for ${seconds}s"
"$out/checkpoint_fuzz" -max_total_time="$seconds" -max_len=4096 -dict="$dict" -print_final_stats=1 \
  -artifact_prefix="$out/" "$@" "$out/corpus" "$out/seeds"
