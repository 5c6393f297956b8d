#!/usr/bin/env bash
# fuzz.sh — builds a libFuzzer target (tests/fuzz/<target>_fuzz.c) with clang,
# AddressSanitizer and UBSan, outside the CMake build (which uses gcc and
# never needs clang), seeds it and runs it.
#   scripts/fuzz.sh checkpoint|kir|saved [SECONDS] [libFuzzer flags...]   default 180 s
# checkpoint: the safetensors reader; kir: the .kir parser and verifier;
# saved: kiln_function_load (a saved directory packed into one input; its
# corpus is kept in tests/fuzz/saved/, which seeds it).
# Work and corpus in build-fuzz-<target>/ (FUZZ_DIR to change); a crash leaves
# its input there as crash-*, which `build-fuzz-<target>/<target>_fuzz FILE`
# replays. The harnesses abort() on a broken invariant: that is how libFuzzer
# is told an input found a bug.
set -euo pipefail
cd "$(dirname "$0")/.."
export LC_ALL=C

target=${1:-}
case "$target" in
  checkpoint) dict=tests/fuzz/safetensors.dict ;;
  kir) dict=tests/fuzz/kir.dict ;;
  saved) dict=tests/fuzz/saved.dict ;;
  *) echo "usage: scripts/fuzz.sh checkpoint|kir|saved [SECONDS] [libFuzzer flags...]" >&2; exit 2 ;;
esac
shift
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

out=${FUZZ_DIR:-build-fuzz-$target}
mkdir -p "$out/obj" "$out/corpus" "$out/seeds"
read -r -a ffi_cflags <<<"$(pkg-config --cflags libffi)"
read -r -a ffi_libs <<<"$(pkg-config --libs libffi)"
llvm_config=${LLVM_CONFIG:-llvm-config-19}
llvm_inc=$("$llvm_config" --includedir)
llvm_lib=$("$llvm_config" --libdir)
flags=(-std=c11 -O1 -g -D_GNU_SOURCE -Iinclude -Ilib -Iir -Ijit -Ipasses -Ibackends -isystem "$llvm_inc" "${ffi_cflags[@]}"
       -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined)

echo "fuzz.sh: building $target with $cc"
srcs=(lib/*.c ir/*.c jit/*.c passes/*.c backends/*/*.c)
stale() { # stale SRC OBJ: the object is missing or older than its source or any header
  local f
  [ -f "$2" ] || return 0
  for f in "$1" lib/*.h ir/*.h jit/*.h passes/*.h backends/*/*.h include/kiln.h ir/ops.def; do [ "$f" -nt "$2" ] && return 0; done
  return 1
}
objs=()
pids=()
for src in "${srcs[@]}"; do
  d=$(dirname "$src")
  o="$out/obj/${d//\//_}_$(basename "${src%.c}").o"
  objs+=("$o")
  if stale "$src" "$o"; then
    "$cc" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$src" -o "$o" & pids+=($!)
    if [ "${#pids[@]}" -ge "${FUZZ_JOBS:-2}" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  fi
done
for p in "${pids[@]}"; do wait "$p"; done
"$cc" "${flags[@]}" -fsanitize=fuzzer "tests/fuzz/${target}_fuzz.c" "${objs[@]}" \
  -o "$out/${target}_fuzz" -lm -lpthread -ldl "${ffi_libs[@]}" -L"$llvm_lib" -lLLVM -Wl,-rpath,"$llvm_lib"

# seeds: valid safetensors files whose tensors match the harness's variables
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
checkpoint_seeds() {
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
}

if [ "$target" = saved ]; then
  cp tests/fuzz/saved/* "$out/seeds/"
elif [ "$target" = kir ]; then
  # seeds: the FileCheck tests (valid and malformed)
  for f in tests/ir/*.kir tests/ir/bad/*.kir; do cp "$f" "$out/seeds/$(basename "$(dirname "$f")")_$(basename "$f")"; done
else
  checkpoint_seeds
fi

echo "fuzz.sh: running $out/${target}_fuzz for ${seconds}s"
max_len=4096
[ "$target" = saved ] && max_len=16384 # a packed directory
"$out/${target}_fuzz" -max_total_time="$seconds" -max_len="$max_len" -dict="$dict" -print_final_stats=1 \
  -artifact_prefix="$out/" "$@" "$out/corpus" "$out/seeds"
