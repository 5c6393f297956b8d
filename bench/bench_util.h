/* bench_util.h — the timing helpers every benchmark program shares: a
 * monotonic clock and the median of a set of runs. */
#ifndef KILN_BENCH_UTIL_H
#define KILN_BENCH_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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
static inline void bench_figure(const char *key, double value, const char *unit) {
  printf("@ %s %.6g %s\n", key, value, unit);
  fflush(stdout);
}

#endif
