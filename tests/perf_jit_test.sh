#!/bin/bash
# KILN_PERF=1 (backends/cpu/jit.c): the random user-shaped programs still
# equal the interpreter and eager execution with the code linked through
# LLVM's perf listener, and the listener wrote a jitdump naming kernels.
# usage: perf_jit_test.sh KILN_TESTS
set -u
tests=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
JITDUMPDIR=$dir KILN_PERF=1 KILN_CACHE_DIR=$dir/cache KILN_BACKEND=cpu \
  "$tests" --gtest_filter=UserPrograms.EagerCompiledAndInterpretedAgree --gtest_color=no || exit 1
dump=$(find "$dir/.debug/jit" -name 'jit-*.dump' -size +1k 2>/dev/null | head -1)
if [ -z "$dump" ]; then
  echo "perf_jit_test: no jitdump of more than 1 KB under $dir/.debug/jit"
  exit 1
fi
# the dump holds the compiled functions' names (JIT_CODE_LOAD records)
if ! grep -aq 'kernel' "$dump"; then
  echo "perf_jit_test: $dump names no kernel"
  exit 1
fi
echo "perf_jit_test: $(stat -c %s "$dump") bytes of jitdump in $dump"
