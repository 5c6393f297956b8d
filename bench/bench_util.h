/* bench_util.h — the timing helpers every benchmark program shares: a
 * monotonic clock and the median of a set of runs. */
#ifndef KILN_BENCH_UTIL_H
#define KILN_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static inline double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline double now_s(void) { return now_ns() * 1e-9; }

static inline int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* sorts v in place; the middle element */
static inline double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof v[0], cmp_double);
  return v[n / 2];
}

/* One machine-readable figure, for scripts/bench_issue6.sh: "@ KEY VALUE UNIT"
 * where KEY is dotted (bench.config.impl), e.g. "@ fused.t2.staged 14.1 GB/s".
 * The Python peers print the same format. */
/* The path of bench/NAME (a peer's script), beside the bench's source:
 * __FILE__, relative to the build directory where the binary lives when
 * it is not absolute. Needs readlink (_POSIX_C_SOURCE 200809L, unistd.h). */
static inline void bench_script_path(const char *file, const char *name, char *out, size_t size) {
  char dir[4096] = "";
  const char *slash = strrchr(file, '/');
  if (file[0] != '/') {
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n > 0) {
      dir[n] = 0;
      char *e = strrchr(dir, '/');
      if (e) e[1] = 0;
    } else {
      dir[0] = 0;
    }
  }
  snprintf(out, size, "%s%.*s%s", dir, slash ? (int)(slash - file + 1) : 0, file, name);
}

static inline void bench_figure(const char *key, double value, const char *unit) {
  printf("@ %s %.6g %s\n", key, value, unit);
  fflush(stdout);
}

#endif
