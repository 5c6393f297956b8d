#!/usr/bin/env bash
# exports_test.sh LIBKILN NM — libkiln.so exports the public API alone: every
# defined dynamic symbol starts with kiln_ (cmake/kiln.map), the internal
# functions the tests call (ir_parse, cpu_compile, ...) are not among them,
# and a few public ones are. Registered by CMakeLists.txt as a ctest test.
set -uo pipefail
lib=$1 nm=${2:-nm}
syms=$("$nm" -D --defined-only "$lib" | awk 'NF >= 3 { print $3 }') || { echo "cannot read $lib" >&2; exit 1; }
n=$(wc -l <<<"$syms")
echo "$lib: $n exported symbols"
bad=$(grep -v '^kiln_' <<<"$syms")
if [ -n "$bad" ]; then
  echo "exported without the kiln_ prefix:" >&2
  echo "$bad" >&2
  exit 1
fi
rc=0
for want in kiln_add kiln_matmul kiln_function_new kiln_function_ir kiln_version kiln_last_error kiln_dataset_next; do
  grep -qx "$want" <<<"$syms" || { echo "missing export: $want" >&2; rc=1; }
done
for internal in ir_parse cpu_compile matmul_epilogue dispatch_register; do
  grep -qx "$internal" <<<"$syms" && { echo "internal function exported: $internal" >&2; rc=1; }
done
[ "$n" -ge 100 ] || { echo "only $n exports: the public API is bigger" >&2; rc=1; }
exit $rc
