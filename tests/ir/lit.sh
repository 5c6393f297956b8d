#!/usr/bin/env bash
# lit.sh — a minimal lit: runs the "// RUN:" lines of one .kir test with
# %s = the file, kiln-opt and FileCheck = the given paths, and `not` =
# LLVM's not beside FileCheck. Fails if any RUN line fails (pipefail).
#   tests/ir/lit.sh KILN_OPT FILECHECK FILE.kir
set -uo pipefail
opt=$1 fc=$2 file=$3
not="$(dirname "$fc")/not"
runs=0
while IFS= read -r line; do
  case "$line" in "// RUN:"*) ;; *) continue ;; esac
  read -r -a words <<<"${line#// RUN:}"
  cmd=()
  for w in "${words[@]}"; do
    case "$w" in
      %s) cmd+=("$(printf %q "$file")") ;;
      kiln-opt) cmd+=("$(printf %q "$opt")") ;;
      FileCheck) cmd+=("$(printf %q "$fc")") ;;
      not) cmd+=("$(printf %q "$not")") ;;
      *) cmd+=("$w") ;;
    esac
  done
  runs=$((runs + 1))
  echo "RUN: ${cmd[*]}"
  bash -o pipefail -c "${cmd[*]}" || { echo "lit.sh: $file: RUN line $runs failed" >&2; exit 1; }
done <"$file"
[ "$runs" -gt 0 ] || { echo "lit.sh: $file: no RUN line" >&2; exit 1; }
