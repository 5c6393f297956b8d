#!/usr/bin/env bash
# bench_lib.sh — what the benchmark scripts share; sourced, not run.
#   bench_build TARGET...  installs what is missing (setup.sh) and builds the
#                          targets in a Release build in build/
#   torch_python           prints a python3 that imports torch (Debian's
#                          python3-torch lives in /usr/bin/python3, which may
#                          not be the first python3 on PATH), or nothing
#   bench_run KIND CMD...  runs one program of a round, keeping its figures
#   bench_summary F R G    the medians over rounds and the ratios in a round

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

# bench_run KIND CMD...: runs CMD (KIND: kiln, torch or torch-passive; the
# peers only where torch_python found a python), shows its output but for
# the "@ KEY VALUE UNIT" lines, which go to $figs tagged with $round (keys
# of torch-passive runs get "-passive"); everything goes to $log.
bench_run() {
  local kind=$1
  shift
  if [ "$kind" != kiln ] && [ -z "$py" ]; then return 0; fi
  local out
  if ! out=$("$@" 2>&1); then
    printf '%s\n' "$out"
    echo "${0##*/}: FAILED: $*" | tee -a "$log"
    return 0
  fi
  printf '%s\n' "$out" | grep -v '^@ ' || true
  printf '%s\n' "$out" >>"$log"
  printf '%s\n' "$out" | awk -v r="$round" -v k="$kind" '
    $1 == "@" { if (k == "torch-passive") $2 = $2 "-passive"; print r, $2, $3, $4 }' >>"$figs"
}

# bench_summary FIGS RATIOS GOALS: each figure of FIGS ("ROUND KEY VALUE
# UNIT" lines) as its median over the rounds [min..max] (n), with its goal
# from GOALS ("KEY|GOAL" lines); then each ratio of RATIOS
# ("LABEL|NUM|DEN|GOAL" lines), NUM/DEN taken within each round, as the
# median over the rounds. KEY.torch-best is the faster of KEY.torch and
# KEY.torch-passive in each round; mlp.compile.cold.*.total sums a cold
# compile's trace, passes and compile.
bench_summary() {
  awk -v ratios="$2" -v goals="$3" '
  function med(arr, n,   i, j, x) {  # sorts arr[1..n]; the median
    for (i = 2; i <= n; i++) for (j = i; j > 1 && arr[j - 1] > arr[j]; j--) { x = arr[j]; arr[j] = arr[j - 1]; arr[j - 1] = x }
    return n % 2 ? arr[(n + 1) / 2] : (arr[n / 2] + arr[n / 2 + 1]) / 2
  }
  function stat(key,   n, r, a) {  # "median [min..max] (n)" of key over the rounds
    n = 0
    for (r = 1; r <= maxr; r++) if ((key, r) in v) a[++n] = v[key, r]
    if (!n) return ""
    m = med(a, n)
    return sprintf("%10.4g %-8s [%.4g..%.4g] (%d)", m, unit[key], a[1], a[n], n)
  }
  {
    v[$2, $1] = $3; unit[$2] = $4; if ($1 > maxr) maxr = $1
    if (!($2 in seen)) { seen[$2] = 1; order[++nk] = $2; nk0 = nk }
    if ($2 ~ /^mlp\.compile\.cold\./ && $2 !~ /first_call$/) {  # trace + passes + compile
      t = $2; sub(/\.[a-z_]+$/, ".total", t)
      v[t, $1] += $3; unit[t] = "ms"
      if (!(t in seen)) { seen[t] = 1; order[++nk] = t }
    }
  }
  END {
    for (i = 1; i <= nk0; i++) {  # KEY.torch-best: the faster of KEY.torch and KEY.torch-passive, round by round
      k = order[i]
      if (k !~ /\.torch$/) continue
      b = k "-best"; unit[b] = unit[k]; order[++nk] = b
      for (r = 1; r <= maxr; r++) {
        p = (k, r) in v; q = (k "-passive", r) in v
        if (!p && !q) continue
        x = p ? v[k, r] : v[k "-passive", r]
        if (p && q) {
          y = v[k "-passive", r]
          x = unit[k] ~ /\/s$/ ? (x > y ? x : y) : (x < y ? x : y)  # GB/s, GFLOP/s: larger; times: smaller
        }
        v[b, r] = x
      }
    }
    while ((getline line < goals) > 0) { split(line, g, "|"); goal[g[1]] = g[2] }
    print "-- figures"
    for (i = 1; i <= nk; i++) printf("%-36s %s%s\n", order[i], stat(order[i]), order[i] in goal ? "   goal " goal[order[i]] : "")
    print "-- ratios within a round"
    while ((getline line < ratios) > 0) {
      split(line, f, "|")
      n = 0
      for (r = 1; r <= maxr; r++)
        if ((f[2], r) in v && (f[3], r) in v && v[f[3], r] > 0) a[++n] = v[f[2], r] / v[f[3], r]
      if (!n) { printf("%-58s   (not measured)\n", f[1]); continue }
      m = med(a, n)
      printf("%-58s %7.3f [%.3f..%.3f] (%d)%s\n", f[1], m, a[1], a[n], n, f[4] != "" ? "   goal " f[4] : "")
      delete a
    }
  }' "$1"
}
