#!/usr/bin/env bash
# setup.sh — installs the Debian packages Kiln needs to build, test and
# benchmark, on Debian 12, as root or through sudo. Fast on repeat runs: when
# every package is already installed it never touches apt.
set -euo pipefail

# libopenblas-dev is only the benchmarks' peer (bench/bench_matmul.c);
# the library itself never links it.
packages=(cmake ninja-build llvm-19-dev llvm-19-tools libffi-dev libgtest-dev libgmock-dev
          pkg-config g++ python3 libopenblas-dev)
# Optional: the tests run without them and say so. python3-torch (PyTorch
# 1.13) and python3-numpy are the independent implementation that
# tests/torch_diff_test.cc compares every op, gradient and staged form with;
# gcc-aarch64-linux-gnu compiles the sources for aarch64 (ctest cross_aarch64);
# python3-sklearn regenerates examples/data/ (scripts/make_digits.py: the
# files are checked in) and python3-torchvision is the ResNet-50 bench's peer.
# mlir-19-tools (mlir-opt-19, mlir-cpu-runner-19) verifies and runs the MLIR
# export (tests/mlir_test.cc). python3-numpy also reads and writes the .npy
# files of tests/npy_test.cc; protobuf-compiler (protoc) and python3-protobuf
# parse the TensorBoard event files of tests/summary_test.cc. libopenmpi-dev
# and openmpi-bin (Open MPI and its mpirun) carry the distribution API across
# processes (API.md §12; the dist.np* tests); without them the world is one
# process. libmpich-dev and mpich (MPICH) are the second MPI that
# scripts/test.sh builds the distribution layer on (build-mpich/); Open MPI
# stays the default mpicc and mpirun (openmpi_default below).
optional=(python3-torch python3-numpy gcc-aarch64-linux-gnu python3-sklearn python3-torchvision mlir-19-tools
          protobuf-compiler python3-protobuf libopenmpi-dev openmpi-bin libmpich-dev mpich)

# With both MPIs installed, Debian's alternatives (mpi, mpirun and
# mpi-<triplet>) must keep pointing at Open MPI: the main build's FindMPI
# takes mpicc and mpirun. Auto mode does (priority 50 against MPICH's 40);
# this also undoes a manual switch. Needs root (or sudo); otherwise it warns.
alt_value() { update-alternatives --query "$1" 2>/dev/null | awk '$1 == "Value:" { print $2 }'; }
openmpi_default() {
  command -v update-alternatives >/dev/null 2>&1 || return 0
  local triplet name want
  triplet=$(gcc -dumpmachine 2>/dev/null || echo x86_64-linux-gnu)
  for name in mpi mpirun "mpi-$triplet"; do
    case $name in
      mpi) want=/usr/bin/mpicc.openmpi ;;
      mpirun) want=/usr/bin/mpirun.openmpi ;;
      *) want=/usr/lib/$triplet/openmpi/include ;;
    esac
    [ -e "$want" ] || continue
    [ "$(alt_value "$name")" = "$want" ] && continue
    local as=()
    [ "$(id -u)" -eq 0 ] || as=(sudo -n)
    # back to auto mode where that picks Open MPI (it does: priority 50 > 40)
    "${as[@]}" update-alternatives --auto "$name" 2>/dev/null || true
    [ "$(alt_value "$name")" = "$want" ] && continue
    "${as[@]}" update-alternatives --set "$name" "$want" ||
      echo "setup.sh: the $name alternative is not Open MPI's ($want) and could not be set" >&2
  done
}

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "setup.sh: no dpkg here (not Debian?); install these by hand: ${packages[*]}" >&2
  exit 0
fi

# One dpkg-query for all of them; unknown packages print nothing.
installed=$(dpkg-query -W -f='${db:Status-Abbrev} ${Package}\n' "${packages[@]}" "${optional[@]}" 2>/dev/null |
            awk '$1 == "ii" { print $2 }' || true)
missing=()
for p in "${packages[@]}"; do
  grep -qx -- "$p" <<<"$installed" || missing+=("$p")
done
missing_optional=()
for p in "${optional[@]}"; do
  grep -qx -- "$p" <<<"$installed" || missing_optional+=("$p")
done
if [ ${#missing[@]} -eq 0 ] && [ ${#missing_optional[@]} -eq 0 ]; then
  openmpi_default
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  if [ ${#missing[@]} -eq 0 ]; then
    echo "setup.sh: optional ${missing_optional[*]} not installed (no root or sudo); the tests that need them skip" >&2
    exit 0
  fi
  echo "setup.sh: missing ${missing[*]}, and neither root nor sudo is available" >&2
  exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  "${as_root[@]}" apt-get install -y -q -o DPkg::Lock::Timeout=900 "${missing[@]}"
fi
if [ ${#missing_optional[@]} -gt 0 ]; then
  echo "setup.sh: installing optional ${missing_optional[*]}"
  "${as_root[@]}" apt-get install -y -q -o DPkg::Lock::Timeout=900 "${missing_optional[@]}" ||
    echo "setup.sh: could not install optional ${missing_optional[*]}; the tests that need them skip" >&2
fi
openmpi_default
