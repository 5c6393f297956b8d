/* bench_seed.c — the seed's benchmark: a 1000x1000 f32 matrix m multiplied
 * into x 200 times eagerly (x = kiln_matmul(x, m)), total seconds. m is
 * N(0, 1/1000), so that the products neither overflow nor underflow (the
 * entries of m^k grow like sqrt(k+1)). bench/seed_torch.py does the same in
 * PyTorch eager; scripts/bench_issue6.sh runs the two alternately.
 *
 *   bench_seed [--runs R] [--iters N]    (defaults 1 timed run of 200)
 *
 * Prints "@ seed.chain.kiln SECONDS s" (the median of the runs). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { N = 1000, MAX_RUNS = 15 };

/* x = x0 * m^iters; seconds, or NAN with the error set. *check gets mean|x|. */
static double chain(kiln_tensor *x0, kiln_tensor *m, int iters, double *check) {
  kiln_tensor *x = kiln_retain(x0);
  double t0 = now_s();
  for (int i = 0; x && i < iters; i++) {
    kiln_tensor *next = kiln_matmul(x, m);
    kiln_release(x);
    x = next;
  }
  double dt = now_s() - t0;
  if (!x) return NAN;
  kiln_tensor *a = kiln_abs(x), *mean = kiln_reduce_mean(a, 0, NULL, false);
  *check = mean ? kiln_tensor_item(mean) : NAN;
  kiln_release(mean);
  kiln_release(a);
  kiln_release(x);
  return dt;
}

int main(int argc, char **argv) {
  int runs = 1, iters = 200;
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v && !strcmp(a, "--runs")) runs = atoi(v);
    else if (v && !strcmp(a, "--iters")) iters = atoi(v);
    else runs = 0;
    if (runs < 1 || runs > MAX_RUNS || iters < 1) {
      fprintf(stderr, "usage: bench_seed [--runs R (1..%d)] [--iters N]\n", MAX_RUNS);
      return 2;
    }
  }
  kiln_random_seed(11);
  kiln_tensor *r = kiln_random_normal(KILN_F32, KILN_SHAPE(N, N));
  kiln_tensor *s = kiln_scalar(KILN_F32, 1 / sqrt((double)N));
  kiln_tensor *m = kiln_mul(r, s), *x0 = kiln_random_normal(KILN_F32, KILN_SHAPE(N, N));
  double t[MAX_RUNS], check = 0;
  if (!m || !x0 || isnan(chain(x0, m, 3, &check))) { /* warm-up */
    fprintf(stderr, "bench_seed: %s\n", kiln_last_error());
    return 1;
  }
  for (int i = 0; i < runs; i++) {
    t[i] = chain(x0, m, iters, &check);
    if (isnan(t[i])) {
      fprintf(stderr, "bench_seed: %s\n", kiln_last_error());
      return 1;
    }
  }
  double med = median(t, runs);
  printf("seed: %dx%d f32, x = matmul(x, m) %d times, eager: kiln %.3f s (%.1f GFLOP/s; median of %d; min %.3f)"
         "  mean|x| %.3g  [%d thread(s)]\n",
         N, N, iters, med, 2.0 * N * N * N * iters / med / 1e9, runs, t[0], check, kiln_num_threads());
  bench_figure("seed.chain.kiln", med, "s");
  kiln_release(x0), kiln_release(m), kiln_release(s), kiln_release(r);
  return 0;
}
