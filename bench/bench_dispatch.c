/* bench_dispatch.c — the fixed cost of one eager op: nanoseconds per f32
 * kiln_add on 1-element and 1000-element tensors, made and released inside a
 * scope as a program would. Goal: <= 60 ns for the 1-element add. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"

#include <stdlib.h>
#include <time.h>

enum { RUNS = 11, ADDS = 1000, SCOPES = 20 };

/* Median over RUNS of the ns per add; one run is SCOPES x (push, ADDS adds,
 * pop), so releasing the results is part of the cost. NAN on failure. */
static double ns_per_add(kiln_tensor *x, kiln_tensor *y) {
  double ns[RUNS];
  for (int r = -1; r < RUNS; r++) { /* run -1 warms up the allocator's caches */
    double t0 = now_ns();
    for (int s = 0; s < SCOPES; s++) {
      kiln_scope_push();
      for (int i = 0; i < ADDS; i++) kiln_add(x, y);
      kiln_scope_pop();
    }
    if (r >= 0) ns[r] = (now_ns() - t0) / (SCOPES * ADDS);
  }
  qsort(ns, RUNS, sizeof ns[0], cmp_double);
  return ns[RUNS / 2];
}

/* The same, with each result released at once instead of by a scope. */
static double ns_per_add_release(kiln_tensor *x, kiln_tensor *y) {
  double ns[RUNS];
  for (int r = -1; r < RUNS; r++) {
    double t0 = now_ns();
    for (int i = 0; i < SCOPES * ADDS; i++) kiln_release(kiln_add(x, y));
    if (r >= 0) ns[r] = (now_ns() - t0) / (SCOPES * ADDS);
  }
  qsort(ns, RUNS, sizeof ns[0], cmp_double);
  return ns[RUNS / 2];
}

static int check(kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *z = kiln_add(x, y);
  if (!z) {
    fprintf(stderr, "bench_dispatch: %s\n", kiln_last_error());
    return -1;
  }
  kiln_release(z);
  return 0;
}

int main(void) {
  kiln_tensor *x1 = kiln_fill(KILN_F32, KILN_SHAPE(1), 1.0);
  kiln_tensor *y1 = kiln_fill(KILN_F32, KILN_SHAPE(1), 2.0);
  kiln_tensor *xk = kiln_fill(KILN_F32, KILN_SHAPE(1000), 1.0);
  kiln_tensor *yk = kiln_fill(KILN_F32, KILN_SHAPE(1000), 2.0);
  if (check(x1, y1) != 0 || check(xk, yk) != 0) return 1;

  double one = ns_per_add(x1, y1);
  printf("dispatch: f32 add, 1 element, in a scope:       %7.1f ns/op (goal <= 60 ns: %s)\n",
         one, one <= 60 ? "met" : "missed");
  printf("dispatch: f32 add, 1 element, released at once: %7.1f ns/op\n",
         ns_per_add_release(x1, y1));
  printf("dispatch: f32 add, 1000 elements, in a scope:   %7.1f ns/op\n", ns_per_add(xk, yk));
  printf("(median of %d runs of %d adds each; kiln %s, %d thread(s))\n", RUNS, SCOPES * ADDS,
         kiln_version(), kiln_num_threads());

  kiln_release(x1);
  kiln_release(y1);
  kiln_release(xk);
  kiln_release(yk);
  return 0;
}
