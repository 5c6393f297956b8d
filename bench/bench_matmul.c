/* bench_matmul.c — f32 matmul speed in GFLOP/s (2*n^3 flops): eager
 * kiln_matmul (with the CPU backend's LLVM micro-kernel where it runs one),
 * eager kiln_matmul with the C micro-kernel (KILN_GEMM=c around the call),
 * a staged kiln_function whose body is one matmul (whatever
 * kiln_function_call runs), and OpenBLAS's cblas_sgemm on the same data when
 * the build found OpenBLAS (KILN_HAVE_OPENBLAS), interleaved run by run in
 * one process; medians. Fails if Kiln and OpenBLAS disagree on the result,
 * or the two micro-kernels differ in any bit.
 *
 *   bench_matmul [--threads T] [--sizes N,N,...] [--runs R]
 *
 * --threads T sets KILN_NUM_THREADS=T before Kiln's pool starts (the pool
 * reads it once) and gives OpenBLAS the same count (openblas_set_num_threads);
 * by default both use kiln_num_threads(). Default sizes 256, 512, 1024, 2048
 * with 15, 9, 5, 3 runs. Lines starting with "@" (matmul.nN.tT.IMPL) are for
 * scripts/bench_issue6.sh. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, setenv */
#include <kiln.h>

#include "bench_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KILN_HAVE_OPENBLAS
#include <cblas.h>
int openblas_get_num_threads(void);
void openblas_set_num_threads(int);
#endif

enum { MAX_RUNS = 31, MAX_SIZES = 16 };
enum { I_EAGER, I_EAGER_C, I_STAGED, I_BLAS, N_IMPL };
static const char *impl_names[N_IMPL] = {"eager", "eager-c", "staged", "openblas"};

static int matmul_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_matmul(in[0], in[1]);
  return out[0] ? 0 : -1;
}

static double max_diff(const float *x, const float *y, int64_t n) {
  double d = 0;
  for (int64_t i = 0; i < n; i++) d = fmax(d, fabs((double)x[i] - y[i]));
  return d;
}

/* One size: returns 0, or -1 if Kiln failed or disagreed with OpenBLAS. */
static int bench(int64_t n, int runs) {
  double flops = 2.0 * (double)n * (double)n * (double)n;
  int threads = kiln_num_threads();
  kiln_tensor *a = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n));
  kiln_tensor *b = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n));
  kiln_function *f = kiln_function_new("matmul", matmul_body, NULL, 2, 1);
  size_t bytes = (size_t)(n * n) * sizeof(float);
  float *res[N_IMPL] = {malloc(bytes), malloc(bytes), malloc(bytes), malloc(bytes)};
  kiln_tensor *in[2] = {a, b};
  double s[N_IMPL][MAX_RUNS], first_call = 0;
  bool have[N_IMPL] = {true, true, true, false};
#ifdef KILN_HAVE_OPENBLAS
  have[I_BLAS] = true;
#endif
  int rc = a && b && f && res[0] && res[1] && res[2] && res[3] ? 0 : -1;
  for (int r = -1; !rc && r < runs; r++) { /* run -1 warms up (and traces) */
    for (int k = 0; k < N_IMPL && !rc; k++) {
      if (!have[k]) continue;
      kiln_scope_push();
      kiln_tensor *c = NULL;
      double t0 = now_s();
      if (k == I_EAGER || k == I_EAGER_C) {
        if (k == I_EAGER_C) setenv("KILN_GEMM", "c", 1);
        c = kiln_matmul(a, b);
        if (k == I_EAGER_C) unsetenv("KILN_GEMM");
        if (!c) rc = -1;
      } else if (k == I_STAGED) {
        rc = kiln_function_call(f, in, &c);
      } else {
#ifdef KILN_HAVE_OPENBLAS
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, (int)n, (int)n, 1.0f, kiln_tensor_data(a),
                    (int)n, kiln_tensor_data(b), (int)n, 0.0f, res[I_BLAS], (int)n);
#endif
      }
      double dt = now_s() - t0;
      if (!rc && c && r == runs - 1) rc = kiln_tensor_read(c, res[k], bytes);
      kiln_scope_pop();
      if (r >= 0) s[k][r] = dt;
      if (r < 0 && k == I_STAGED) first_call = dt;
    }
  }
  if (!rc && memcmp(res[I_EAGER], res[I_EAGER_C], bytes)) {
    fprintf(stderr, "bench_matmul: n = %lld: the LLVM and C micro-kernels differ\n", (long long)n);
    rc = -1;
  } else if (rc) {
    fprintf(stderr, "bench_matmul: n = %lld: %s\n", (long long)n, kiln_last_error());
  } else {
    double g[N_IMPL];
    kiln_stats st = {0};
    kiln_function_stats(f, 0, &st);
    printf("matmul %4lldx%-4lld f32, %d thread(s):", (long long)n, (long long)n, threads);
    for (int k = 0; k < N_IMPL; k++) {
      if (!have[k]) continue;
      g[k] = flops / median(s[k], runs) / 1e9;
      printf("  %s %6.1f GFLOP/s", impl_names[k], g[k]);
    }
    if (have[I_BLAS]) {
      /* Both sum n products of N(0,1) numbers: results are ~sqrt(n), and f32
       * rounding in different orders differs by ~1e-6 relative per term. */
      double de = max_diff(res[I_EAGER], res[I_BLAS], n * n), ds = max_diff(res[I_STAGED], res[I_BLAS], n * n);
      printf("  eager/openblas %.2f  eager-c/openblas %.2f  staged/openblas %.2f  max|diff| %.1e %.1e",
             g[I_EAGER] / g[I_BLAS], g[I_EAGER_C] / g[I_BLAS], g[I_STAGED] / g[I_BLAS], de, ds);
      if (!(de < 1e-3 * sqrt((double)n)) || !(ds < 1e-3 * sqrt((double)n))) {
        fprintf(stderr, "bench_matmul: kiln and openblas disagree at n = %lld\n", (long long)n);
        rc = -1;
      }
    }
    printf("  (median of %d; staged %s, first call %.1f ms)\n", runs, st.compile_ms > 0 ? "compiled" : "interpreter?",
           first_call * 1e3);
    char key[96];
    for (int k = 0; k < N_IMPL; k++) {
      if (!have[k]) continue;
      snprintf(key, sizeof key, "matmul.n%lld.t%d.%s", (long long)n, threads, impl_names[k]);
      bench_figure(key, g[k], "GFLOP/s");
    }
  }
  for (int k = 0; k < N_IMPL; k++) free(res[k]);
  kiln_function_free(f);
  kiln_release(a);
  kiln_release(b);
  return rc;
}

static void usage(void) {
  fprintf(stderr, "usage: bench_matmul [--threads T] [--sizes N,N,...] [--runs R (1..%d)]\n", MAX_RUNS);
}

int main(int argc, char **argv) {
  int64_t sizes[MAX_SIZES] = {256, 512, 1024, 2048};
  int default_runs[MAX_SIZES] = {15, 9, 5, 3}, n_sizes = 4, runs = 0;
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!v) return usage(), 2;
    if (!strcmp(a, "--threads")) {
      if (atoi(v) < 1) return usage(), 2;
      setenv("KILN_NUM_THREADS", v, 1); /* before anything starts Kiln's pool */
    } else if (!strcmp(a, "--runs")) {
      runs = atoi(v);
      if (runs < 1 || runs > MAX_RUNS) return usage(), 2;
    } else if (!strcmp(a, "--sizes")) {
      n_sizes = 0;
      for (char *p = (char *)v; *p && n_sizes < MAX_SIZES;) {
        char *end;
        long long n = strtoll(p, &end, 10);
        if (end == p || n < 1) return usage(), 2;
        sizes[n_sizes] = n;
        default_runs[n_sizes++] = n <= 256 ? 15 : n <= 512 ? 9 : n <= 1024 ? 5 : 3;
        p = *end == ',' ? end + 1 : end;
      }
    } else {
      return usage(), 2;
    }
  }
  int threads = kiln_num_threads();
#ifdef KILN_HAVE_OPENBLAS
  openblas_set_num_threads(threads);
#endif
  kiln_random_seed(7);
  int rc = 0;
  for (int i = 0; i < n_sizes; i++) rc |= bench(sizes[i], runs ? runs : default_runs[i]);
#ifdef KILN_HAVE_OPENBLAS
  printf("(kiln %s: %d thread(s); openblas: %d thread(s))\n", kiln_version(), threads, openblas_get_num_threads());
#else
  printf("(kiln %s: %d thread(s); built without OpenBLAS, so no peer)\n", kiln_version(), threads);
#endif
  return rc ? 1 : 0;
}
