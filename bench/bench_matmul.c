/* bench_matmul.c — eager f32 matmul speed in GFLOP/s (2*n^3 flops) for
 * n = 256, 512 and 1024, beside OpenBLAS's cblas_sgemm on the same data in
 * the same run when the build found OpenBLAS (KILN_HAVE_OPENBLAS). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

#ifdef KILN_HAVE_OPENBLAS
#include <cblas.h>
int openblas_get_num_threads(void);
#endif

enum { MAX_RUNS = 15 };

/* One size: returns 0, or -1 if Kiln failed or disagreed with OpenBLAS. */
static int bench(int64_t n, int runs) {
  double flops = 2.0 * (double)n * (double)n * (double)n;
  kiln_tensor *a = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n));
  kiln_tensor *b = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n));
  if (!a || !b) goto failed;

  double s[MAX_RUNS];
  float *mine = malloc((size_t)(n * n) * sizeof(float));
  if (!mine) goto failed;
  for (int r = -1; r < runs; r++) { /* run -1 warms up */
    kiln_scope_push();
    double t0 = now_s();
    kiln_tensor *c = kiln_matmul(a, b);
    double t1 = now_s();
    if (c && r == runs - 1) kiln_tensor_read(c, mine, (size_t)(n * n) * sizeof(float));
    kiln_scope_pop();
    if (!c) {
      free(mine);
      goto failed;
    }
    if (r >= 0) s[r] = t1 - t0;
  }
  double kiln = flops / median(s, runs) / 1e9;
  printf("matmul %4lldx%-4lld f32: kiln %7.1f GFLOP/s", (long long)n, (long long)n, kiln);

  int rc = 0;
#ifdef KILN_HAVE_OPENBLAS
  const float *pa = kiln_tensor_data(a), *pb = kiln_tensor_data(b);
  float *theirs = malloc((size_t)(n * n) * sizeof(float));
  if (pa && pb && theirs) {
    for (int r = -1; r < runs; r++) {
      double t0 = now_s();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)n, (int)n, 1.0f, pa,
                  (int)n, pb, (int)n, 0.0f, theirs, (int)n);
      if (r >= 0) s[r] = now_s() - t0;
    }
    double blas = flops / median(s, runs) / 1e9;
    /* Both sum n products of N(0,1) numbers: results are ~sqrt(n), and f32
     * rounding in different orders differs by ~1e-6 relative per term. */
    double diff = 0;
    for (int64_t i = 0; i < n * n; i++) diff = fmax(diff, fabs((double)mine[i] - theirs[i]));
    printf("   openblas %7.1f GFLOP/s   kiln/openblas %.2f   max|diff| %.1e", blas, kiln / blas,
           diff);
    if (!(diff < 1e-3 * sqrt((double)n))) rc = -1;
  }
  free(theirs);
#endif
  printf("   (median of %d)\n", runs);
  if (rc) fprintf(stderr, "bench_matmul: kiln and openblas disagree at n = %lld\n", (long long)n);
  free(mine);
  kiln_release(a);
  kiln_release(b);
  return rc;

failed:
  fprintf(stderr, "bench_matmul: n = %lld: %s\n", (long long)n, kiln_last_error());
  kiln_release(a);
  kiln_release(b);
  return -1;
}

int main(void) {
  kiln_random_seed(7);
  int rc = 0;
  rc |= bench(256, 15);
  rc |= bench(512, 9);
  rc |= bench(1024, 5);
#ifdef KILN_HAVE_OPENBLAS
  printf("(kiln %s: %d thread(s); openblas: %d thread(s))\n", kiln_version(), kiln_num_threads(),
         openblas_get_num_threads());
#else
  printf("(kiln %s: %d thread(s); built without OpenBLAS, so no peer)\n", kiln_version(),
         kiln_num_threads());
#endif
  return rc ? 1 : 0;
}
