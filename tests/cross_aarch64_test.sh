#!/usr/bin/env bash
# cross_aarch64_test.sh SRC LLVM_INCLUDE — the library's C sources compile for
# aarch64 (Release flags, -Wall -Wextra -Werror) with Debian's cross compiler
# (gcc-aarch64-linux-gnu, installed by scripts/setup.sh as optional): the
# portable build must build there (issue 14). Objects only: linking needs
# aarch64 LLVM and libffi, which this x86-64 machine does not have, and
# jit/ffi.c needs the aarch64 ffi.h. Exit 77 (ctest: skipped) without the
# cross compiler. Registered by CMakeLists.txt as a ctest test.
set -uo pipefail
src=$1 llvm_inc=$2
cc=aarch64-linux-gnu-gcc
command -v "$cc" >/dev/null || { echo "skipped: $cc is not installed (apt install gcc-aarch64-linux-gnu)"; exit 77; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
n=0 fails=0
for f in "$src"/lib/*.c "$src"/ir/*.c "$src"/jit/*.c "$src"/passes/*.c "$src"/backends/*/*.c; do
  case $f in */jit/ffi.c) continue ;; esac # needs the aarch64 ffi.h
  n=$((n + 1))
  if ! "$cc" -std=gnu11 -O3 -DNDEBUG -Wall -Wextra -Werror -D_GNU_SOURCE -fPIC -I"$src"/lib -I"$src"/ir \
       -I"$src"/passes -I"$src"/backends -I"$src"/include -I"$llvm_inc" -c "$f" -o "$out/$n.o" 2>"$out/err"; then
    echo "FAILED: $f" >&2
    head -20 "$out/err" >&2
    fails=$((fails + 1))
  fi
done
file "$out/1.o" | grep -q aarch64 || { echo "the objects are not aarch64" >&2; exit 1; }
echo "$((n - fails)) of $n sources compile for aarch64"
[ "$fails" -eq 0 ]
