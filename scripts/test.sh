#!/usr/bin/env bash
# test.sh — the one test command, locally and in CI. Installs what is missing
# (scripts/setup.sh), then: a Release build in build/ and its ctest suite, the
# examples, an install smoke test (pkg-config, find_package(Kiln) and the
# installed kiln-opt), an AddressSanitizer+UBSan build in build-asan/ with
# the whole suite again, and a ThreadSanitizer build in build-tsan/ of the
# test binary alone, running the threaded tests.
# Every stage runs even after a failure; the exit status is non-zero if any
# failed, and the last line is "N passed, N failed".
# shellcheck disable=SC2317 # functions called through check() look unreachable
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

passed=0
failed=0
failures=()

pass() { passed=$((passed + 1)); echo "ok: $1"; }
fail() { failed=$((failed + 1)); failures+=("$1"); echo "FAILED: $1" >&2; }
# check NAME CMD...: one counted check
check() {
  local name=$1
  shift
  if "$@"; then pass "$name"; else fail "$name"; fi
}
section() { printf '\n==== %s ====\n' "$1"; }

summary() {
  echo
  if [ ${#failures[@]} -gt 0 ]; then
    echo "failed:"
    printf '  %s\n' "${failures[@]}"
  fi
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit $?
}

# configure DIR ARGS...: Ninja for a new build folder; an existing one keeps
# the generator it was made with.
configure() {
  local dir=$1
  shift
  local gen=()
  [ -f "$dir/CMakeCache.txt" ] || gen=(-G Ninja)
  cmake -S . -B "$dir" "${gen[@]}" "$@"
}

# run_ctest DIR [CTEST ARGS...]: runs the suite (or the tests the arguments
# select) and adds its counts to the totals. A suite that could not run at
# all (or exits non-zero with no failed test) counts as one failure.
run_ctest() {
  local dir=$1 log
  shift
  log=$(mktemp)
  ctest --test-dir "$dir" --output-on-failure -j2 --no-tests=error --timeout 900 "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local line
  line=$(grep -Eo '[0-9]+ tests? failed out of [0-9]+' "$log" | tail -n 1)
  rm -f "$log"
  if [ -z "$line" ]; then
    fail "ctest in $dir did not run"
    return
  fi
  local nfail ntotal
  nfail=$(awk '{ print $1 }' <<<"$line")
  ntotal=$(awk '{ print $NF }' <<<"$line")
  passed=$((passed + ntotal - nfail))
  failed=$((failed + nfail))
  [ "$nfail" -eq 0 ] || failures+=("$nfail ctest test(s) in $dir")
  if [ "$rc" -ne 0 ] && [ "$nfail" -eq 0 ]; then fail "ctest in $dir exited $rc"; fi
}

# run_gtest BINARY FILTER: runs the tests of one GoogleTest binary that FILTER
# names and adds their counts to the totals. A run that ends before gtest's
# summary (a sanitizer's report with halt_on_error, a crash) counts as one
# failure, as do a filter that matches nothing and a non-zero exit with no
# failed test.
run_gtest() {
  local bin=$1 filter=$2 log
  log=$(mktemp)
  "$bin" --gtest_filter="$filter" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local np nf
  np=$(grep -E '^\[  PASSED  \] [0-9]+ tests?' "$log" | grep -Eo '[0-9]+' | head -n 1)
  nf=$(grep -E '^\[  FAILED  \] [0-9]+ tests?,' "$log" | grep -Eo '[0-9]+' | head -n 1)
  rm -f "$log"
  if [ -z "$np" ] && [ -z "$nf" ]; then
    fail "$bin --gtest_filter='$filter' did not finish (exit $rc)"
    return
  fi
  np=${np:-0}
  nf=${nf:-0}
  if [ $((np + nf)) -eq 0 ]; then
    fail "$bin --gtest_filter='$filter' matched no test"
    return
  fi
  passed=$((passed + np))
  failed=$((failed + nf))
  [ "$nf" -eq 0 ] || failures+=("$nf test(s) of $bin --gtest_filter='$filter'")
  if [ "$rc" -ne 0 ] && [ "$nf" -eq 0 ]; then fail "$bin --gtest_filter='$filter' exited $rc"; fi
}

# ---- the install smoke test's two consumers ----
write_smoke_c() {
  cat >"$1" <<'C'
#include <kiln.h>
#include <stdio.h>

int main(void) {
  kiln_scope_push();
  kiln_tensor *x = kiln_arange(KILN_F32, 4); /* 0 1 2 3 */
  kiln_tensor *s = kiln_reduce_sum(kiln_add(x, x), 0, NULL, false);
  double v = kiln_tensor_item(s);
  kiln_scope_pop();
  if (v != 12.0) {
    fprintf(stderr, "smoke: sum = %g, want 12 (%s)\n", v, kiln_last_error());
    return 1;
  }
  if (kiln_debug_live_tensors() != 0) {
    fprintf(stderr, "smoke: %lld tensors leaked\n", (long long)kiln_debug_live_tensors());
    return 1;
  }
  printf("kiln %s: ok\n", kiln_version());
  return 0;
}
C
}

write_smoke_cmake() {
  cat >"$1" <<'CMAKE'
cmake_minimum_required(VERSION 3.20)
project(kiln_smoke C)
find_package(Kiln 0.1 REQUIRED)
add_executable(smoke smoke.c)
target_link_libraries(smoke PRIVATE Kiln::kiln)
CMAKE
}

# smoke_pkgconfig DIR PKG_CONFIG_PATH LD_LIBRARY_PATH: knows Kiln only
# through pkg-config.
smoke_pkgconfig() {
  local flags
  flags=$(PKG_CONFIG_PATH="$2" pkg-config --cflags --libs kiln) || return 1
  echo "pkg-config --cflags --libs kiln: $flags"
  # shellcheck disable=SC2086 # flags are words
  cc -std=c11 -Wall -Wextra -Werror "$1/smoke.c" -o "$1/smoke" $flags &&
    LD_LIBRARY_PATH="$3" "$1/smoke"
}

# smoke_cmake DIR PREFIX LD_LIBRARY_PATH: find_package(Kiln) + Kiln::kiln.
smoke_cmake() {
  if ! cmake -S "$1" -B "$1/build" -G Ninja -DCMAKE_PREFIX_PATH="$2" >"$1/configure.log" 2>&1; then
    cat "$1/configure.log"
    return 1
  fi
  cmake --build "$1/build" && LD_LIBRARY_PATH="$3" "$1/build/smoke"
}

# smoke_tool PREFIX BUILD: the installed bin/kiln-opt runs (on a tiny .kir,
# the default passes and --emit=dot) with no LD_LIBRARY_PATH, and neither it
# nor lib/libkiln.so has a RUNPATH or RPATH into the build tree.
smoke_tool() {
  local opt=$1/bin/kiln-opt out f
  [ -x "$opt" ] || { echo "no $opt"; return 1; }
  out=$(printf 'func @f(%%x: f32[4]) -> f32[4] {\n  %%a = add %%x, %%x : f32[4]\n  %%b = neg %%a : f32[4]\n  return %%b\n}\n' |
    env -u LD_LIBRARY_PATH "$opt" -) || { echo "$opt failed"; return 1; }
  grep -q 'neg' <<<"$out" || { echo "kiln-opt printed: $out"; return 1; }
  printf 'func @f(%%x: f32[4]) -> f32[4] {\n  return %%x\n}\n' | env -u LD_LIBRARY_PATH "$opt" --emit=dot - |
    grep -q digraph || { echo "kiln-opt --emit=dot drew no graph"; return 1; }
  for f in "$opt" "$(find "$1" -name 'libkiln.so.*.*' | head -n 1)"; do
    local rp
    rp=$(readelf -d "$f" | grep -E 'R(UN)?PATH' || true)
    echo "$f: ${rp:-no RUNPATH}"
    if [ -n "$rp" ] && grep -qF "$2" <<<"$rp"; then
      echo "$f: its RUNPATH names the build tree $2"
      return 1
    fi
  done
  readelf -d "$opt" | grep -q 'RUNPATH.*\$ORIGIN/\.\./lib' || { echo "$opt: RUNPATH is not \$ORIGIN/../lib"; return 1; }
}

# ---------------------------------------------------------------------------
section "packages"
if ! ./scripts/setup.sh; then
  fail "scripts/setup.sh"
  summary
fi

# ---------------------------------------------------------------------------
section "Release build (build/)"
release_ok=0
if configure build -DCMAKE_BUILD_TYPE=Release && cmake --build build; then
  release_ok=1
else
  fail "Release build"
fi

if [ $release_ok -eq 1 ]; then
  section "ctest (build/)"
  run_ctest build

  section "examples (build/)"
  check "build/hello" ./build/hello
  check "build/tour" ./build/tour
  # the guide's first loop and a convnet on examples/data/ (>= 98% test
  # accuracy or it fails), both fed by datasets; their checkpoint and
  # TensorBoard summaries go to a temporary folder
  runs=$(mktemp -d)
  check "build/linear_regression" ./build/linear_regression 300 "$runs/linear_regression"
  check "build/digits_cnn" ./build/digits_cnn "$runs/digits_cnn.ckpt" "$runs/digits_cnn"
  rm -rf "$runs"
  # data-parallel training in a world of one (ctest runs it on 2 processes
  # where MPI is installed: example.data_parallel.np2)
  check "build/data_parallel" ./build/data_parallel

  section "install smoke test"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  prefix=$work/prefix
  if cmake --install build --prefix "$prefix" >"$work/install.log" 2>&1; then
    pass "cmake --install build --prefix <tmp>"
    libdirs=$(find "$prefix" -name 'libkiln.so*' -printf '%h\n' | sort -u | paste -sd:)
    pcdirs=$(find "$prefix" -name kiln.pc -printf '%h\n' | sort -u | paste -sd:)

    mkdir -p "$work/pc" "$work/cm"
    write_smoke_c "$work/pc/smoke.c"
    write_smoke_c "$work/cm/smoke.c"
    write_smoke_cmake "$work/cm/CMakeLists.txt"
    check "pkg-config: compile and run a C program" smoke_pkgconfig "$work/pc" "$pcdirs" "$libdirs"
    check "find_package(Kiln): configure, build and run" smoke_cmake "$work/cm" "$prefix" "$libdirs"
    check "installed bin/kiln-opt runs; no RUNPATH into build/" smoke_tool "$prefix" "$PWD/build"
  else
    cat "$work/install.log"
    fail "cmake --install build --prefix <tmp>"
  fi
fi

# ---------------------------------------------------------------------------
section "MPICH build (build-mpich/): the distribution layer on the second MPI"
# Only what the distribution tests run (the library, the dist and remote
# test binaries, kiln-worker, data_parallel, bench_dist), built on MPICH by
# its own wrappers (KILN_MPI_FLAVOR=mpich) whatever mpicc points at; then
# the dist.* and remote.* ctests and data_parallel on 2 processes.
if ! command -v mpicc.mpich >/dev/null 2>&1 || ! command -v mpiexec.mpich >/dev/null 2>&1; then
  echo "skipped: MPICH is not installed (libmpich-dev mpich; scripts/setup.sh installs them)"
elif configure build-mpich -DCMAKE_BUILD_TYPE=Release -DKILN_MPI_FLAVOR=mpich &&
     cmake --build build-mpich --target kiln_dist_tests kiln_remote_tests kiln-worker data_parallel bench_dist; then
  run_ctest build-mpich -R '^(dist|remote|example\.data_parallel)\.'
else
  fail "MPICH build"
fi

# ---------------------------------------------------------------------------
section "sanitizer build (build-asan/)"
export ASAN_OPTIONS=detect_leaks=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# the Release suite runs the full random-program corpus; under the sanitizers
# (5-10x slower, the CPU backend compiling each program) a sample of it
export KILN_RANDOM_PROGRAMS=${KILN_RANDOM_PROGRAMS_ASAN:-50}
# the default, portable build (multiversioned kernels), as users get it
if configure build-asan -DKILN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug -DKILN_NATIVE=OFF &&
   cmake --build build-asan; then
  section "ctest (build-asan/)"
  run_ctest build-asan
  section "examples (build-asan/)"
  check "build-asan/hello" ./build-asan/hello
  check "build-asan/tour" ./build-asan/tour
else
  fail "sanitizer build"
fi

# ---------------------------------------------------------------------------
section "ThreadSanitizer build (build-tsan/): the threaded tests"
# Only the test binary, and only the tests that share variables, functions
# and optimizers between threads (and datasets' prefetch threads): measured on 2 cores shared with other jobs
# (load 10-16), a fresh build 22 min and the tests 60 s; an idle machine
# takes a fraction of that. Any report fails the stage (halt_on_error); tests/tsan.supp lists
# the benign reports of code TSan cannot see into, each with its reason.
tsan_filter='Threads*:Staging.Concurrent*:TraceCache.Concurrent*:DatasetPrefetch.*:Summary.ManyThreadsOneWriter:ConvCache.Concurrent*'
if configure build-tsan -DKILN_TSAN=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKILN_NATIVE=ON &&
   cmake --build build-tsan --target kiln_tests; then
  section "threaded tests under ThreadSanitizer (build-tsan/)"
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
    KILN_CACHE_DIR=$PWD/build-tsan/test-cache KILN_BACKEND=cpu \
    run_gtest ./build-tsan/kiln_tests "$tsan_filter"
else
  fail "ThreadSanitizer build"
fi

summary
