/* bench_gpu.c — the CUDA backend's benchmarks on gpu:0, each beside its
 * ceiling or peer in the same run (issue 7):
 *   fused   tanh(x*a + b)*c + x over 256M f32 (a, b, c f32 scalars), staged
 *           (one fused kernel) and eager (five one-op kernels), in GB/s of
 *           the bytes it must move (x read, the result written), against
 *           the device-to-device copy of the same 1 GiB through the driver
 *           (cuMemcpyDtoDAsync, read + write) measured in between;
 *   sgemm   4096 x 4096 f32, eager and staged, GFLOP/s;
 *   seed    x = matmul(x, m) 200 times, 1000 x 1000 f32 (bench_seed.c's
 *           chain) on the GPU, total seconds;
 *   mlp     one training step of an MLP 784-256-256-10 (relu, softmax
 *           cross-entropy, SGD lr 0.01) staged on the GPU, batch 64, ms/step.
 * Every time is a median of RUNS runs after a warm-up, each run ending with
 * the GPU's stream drained (kiln_debug_cuda_sync). bench/gpu_torch.py is
 * PyTorch-on-CUDA's peer; scripts/bench_issue7.sh runs both.
 *
 *   bench_gpu [--quick] [--only fused|sgemm|seed|mlp]
 *
 * Without a GPU it prints "bench_gpu: no GPU: skipped (...)" and exits 0.
 * Lines starting with "@" are "@ KEY VALUE UNIT" (keys gpu.*). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "mlp_model.h"
#include "cuda/cuda_rt.h"
#include "runtime.h"

enum { RUNS = 7, MAX_RUNS = 15 };

static int64_t fused_n = (int64_t)256 << 20;
static int runs = RUNS, seed_iters = 200, mlp_steps = 50;

static int fail(const char *what) {
  fprintf(stderr, "bench_gpu: %s: %s\n", what, kiln_last_error());
  return 1;
}

static int sync0(void) { return kiln_debug_cuda_sync(0); }

/* a host tensor of n f32 with values in [-1, 1), moved to gpu:0 */
static kiln_tensor *gpu_vector(int64_t n) {
  float *d = malloc((size_t)n * sizeof *d);
  if (!d) {
    fprintf(stderr, "bench_gpu: out of memory\n");
    return NULL;
  }
  for (int64_t i = 0; i < n; i++) d[i] = (float)(i % 1000) * 0.002f - 1;
  kiln_tensor *h = kiln_tensor_new(KILN_F32, KILN_SHAPE(n), d);
  free(d);
  kiln_tensor *g = h ? kiln_to_device(h, "gpu:0") : NULL;
  kiln_release(h);
  return g;
}

static kiln_tensor *gpu_scalar(double v) {
  kiln_tensor *h = kiln_scalar(KILN_F32, v), *g = h ? kiln_to_device(h, "gpu:0") : NULL;
  kiln_release(h);
  return g;
}

/* ---- fused ---- */

static int expr(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_add(kiln_mul(kiln_tanh(kiln_add(kiln_mul(in[0], in[1]), in[2])), in[3]), in[0]);
  return out[0] ? 0 : -1;
}

enum { F_COPY, F_STAGED, F_EAGER, F_N };
static const char *fused_names[F_N] = {"copy", "staged", "eager"};

static int bench_fused(void) {
  int64_t n = fused_n;
  kiln_tensor *x = gpu_vector(n), *a = gpu_scalar(0.5), *b = gpu_scalar(0.25), *c = gpu_scalar(2);
  kiln_tensor *dst = x ? gpu_vector(n) : NULL; /* the copy's destination: a buffer of its own */
  if (!x || !a || !b || !c || !dst) return fail("fused: the inputs");
  kiln_tensor *args[4] = {x, a, b, c}, *out = NULL;
  kiln_function *f = kiln_function_new("gpu_fused", expr, NULL, 4, 1);
  if (!f) return fail("fused: kiln_function_new");
  if (kiln_device_push("gpu:0")) return fail("fused: device_push");
  double t0 = now_s();
  int rc = kiln_function_call(f, args, &out);
  if (!rc) rc = sync0();
  double first_ms = (now_s() - t0) * 1e3;
  kiln_release(out);
  double s[F_N][MAX_RUNS];
  for (int r = -1; !rc && r < runs; r++)
    for (int k = 0; k < F_N && !rc; k++) {
      kiln_scope_push();
      t0 = now_s();
      switch (k) {
        case F_COPY: rc = kiln_debug_cuda_copy(0, dst->data, x->data, (size_t)n * 4); break;
        case F_STAGED: rc = kiln_function_call(f, args, &out); break;
        default: rc = kiln_add(kiln_mul(kiln_tanh(kiln_add(kiln_mul(x, a), b)), c), x) ? 0 : -1; break;
      }
      if (!rc) rc = sync0();
      double dt = now_s() - t0;
      kiln_scope_pop();
      if (r >= 0) s[k][r] = dt;
    }
  kiln_device_pop();
  if (rc) return fail("fused");
  double gbs[F_N];
  for (int k = 0; k < F_N; k++) gbs[k] = 2.0 * (double)n * 4 / median(s[k], runs) / 1e9;
  printf("fused tanh(x*a+b)*c+x, %lld M f32: copy %.0f GB/s | staged %.0f GB/s = %.0f%% of copy | eager %.0f GB/s"
         " (%.0f%%)   first staged call %.0f ms\n",
         (long long)(n >> 20), gbs[F_COPY], gbs[F_STAGED], 100 * gbs[F_STAGED] / gbs[F_COPY], gbs[F_EAGER],
         100 * gbs[F_EAGER] / gbs[F_COPY], first_ms);
  char key[64];
  for (int k = 0; k < F_N; k++) {
    snprintf(key, sizeof key, "gpu.fused.%s", fused_names[k]);
    bench_figure(key, gbs[k], "GB/s");
  }
  bench_figure("gpu.fused.first_call", first_ms, "ms");
  kiln_function_free(f);
  kiln_release(x), kiln_release(a), kiln_release(b), kiln_release(c), kiln_release(dst);
  return 0;
}

/* ---- sgemm ---- */

static int matmul_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_matmul(in[0], in[1]);
  return out[0] ? 0 : -1;
}

static int bench_sgemm(void) {
  const int64_t n = 4096;
  kiln_random_seed(7);
  kiln_tensor *ha = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n)), *hb = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n));
  kiln_tensor *a = ha ? kiln_to_device(ha, "gpu:0") : NULL, *b = hb ? kiln_to_device(hb, "gpu:0") : NULL;
  kiln_release(ha), kiln_release(hb);
  if (!a || !b) return fail("sgemm: the inputs");
  kiln_function *f = kiln_function_new("gpu_sgemm", matmul_body, NULL, 2, 1);
  if (!f || kiln_device_push("gpu:0")) return fail("sgemm");
  kiln_tensor *args[2] = {a, b}, *out = NULL;
  double s[2][MAX_RUNS];
  int rc = 0;
  for (int r = -1; !rc && r < runs; r++)
    for (int k = 0; k < 2 && !rc; k++) {
      kiln_scope_push();
      double t0 = now_s();
      rc = k == 0 ? (kiln_matmul(a, b) ? 0 : -1) : kiln_function_call(f, args, &out);
      if (!rc) rc = sync0();
      double dt = now_s() - t0;
      kiln_scope_pop();
      if (r >= 0) s[k][r] = dt;
    }
  kiln_device_pop();
  if (rc) return fail("sgemm");
  double flop = 2.0 * (double)n * n * n, eager = flop / median(s[0], runs) / 1e9,
         staged = flop / median(s[1], runs) / 1e9;
  printf("sgemm %lld f32: eager %.0f GFLOP/s | staged %.0f GFLOP/s\n", (long long)n, eager, staged);
  bench_figure("gpu.sgemm4096.eager", eager, "GFLOP/s");
  bench_figure("gpu.sgemm4096.staged", staged, "GFLOP/s");
  kiln_function_free(f);
  kiln_release(a), kiln_release(b);
  return 0;
}

/* ---- the seed's chain ---- */

static int bench_seed(void) {
  const int64_t n = 1000;
  kiln_random_seed(42);
  kiln_scope_push();
  kiln_tensor *hm = kiln_mul(kiln_random_normal(KILN_F32, KILN_SHAPE(n, n)), kiln_scalar(KILN_F32, 1 / sqrt(1000.0)));
  kiln_tensor *hx = kiln_random_normal(KILN_F32, KILN_SHAPE(n, n));
  kiln_tensor *m = hm ? kiln_scope_escape(kiln_to_device(hm, "gpu:0")) : NULL;
  kiln_tensor *x0 = hx ? kiln_scope_escape(kiln_to_device(hx, "gpu:0")) : NULL;
  kiln_scope_pop();
  if (!m || !x0) return fail("seed: the inputs");
  double s[MAX_RUNS], check = NAN;
  int rc = kiln_device_push("gpu:0");
  for (int r = -1; !rc && r < runs; r++) {
    kiln_tensor *x = kiln_retain(x0);
    double t0 = now_s();
    for (int i = 0; x && i < seed_iters; i++) {
      kiln_tensor *next = kiln_matmul(x, m);
      kiln_release(x);
      x = next;
    }
    rc = x ? sync0() : -1;
    double dt = now_s() - t0;
    if (x && r == runs - 1) {
      kiln_scope_push();
      kiln_tensor *mean = kiln_reduce_mean(kiln_abs(x), 0, NULL, false);
      kiln_tensor *h = mean ? kiln_to_device(mean, "cpu:0") : NULL;
      check = h ? kiln_tensor_item(h) : NAN;
      kiln_scope_pop();
    }
    kiln_release(x);
    if (r >= 0) s[r] = dt;
  }
  kiln_device_pop();
  if (rc) return fail("seed");
  double t = median(s, runs);
  printf("seed chain: x = matmul(x, m) %d times, %lld x %lld f32 on gpu:0: %.3f s (%.2f ms per matmul, %.0f GFLOP/s)"
         "   mean|x| %.4g\n",
         seed_iters, (long long)n, (long long)n, t, t / seed_iters * 1e3, 2e-9 * n * n * n * seed_iters / t, check);
  bench_figure("gpu.seed.chain", t, "s");
  kiln_release(m), kiln_release(x0);
  return 0;
}

/* ---- the MLP training step ---- */

enum { N_VARS = MLP_VARS };
static const int64_t BATCH = 64;

typedef struct {
  kiln_variable *v[N_VARS];
  kiln_optimizer *sgd;
} model;

static int mlp_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  model *m = user;
  return mlp_train_step(m->v, m->sgd, in[0], in[1], &out[0]);
}

static int bench_mlp(void) {
  model m = {0};
  kiln_random_seed(42);
  int rc = 0;
  kiln_scope_push();
  for (int i = 0; i < N_VARS && !rc; i++) {
    kiln_tensor *h = kiln_mul(kiln_random_normal(KILN_F32, mlp_shapes[i][1] ? 2 : 1, mlp_shapes[i]), kiln_scalar(KILN_F32, 0.05));
    kiln_tensor *g = h ? kiln_to_device(h, "gpu:0") : NULL;
    if (!g || !(m.v[i] = kiln_variable_new(g, mlp_names[i]))) rc = -1;
  }
  kiln_tensor *hx = kiln_random_normal(KILN_F32, KILN_SHAPE(BATCH, MLP_IN));
  kiln_tensor *hy = kiln_cast(kiln_random_uniform(KILN_F64, KILN_SHAPE(BATCH), 0, (double)MLP_OUT), KILN_I64);
  kiln_tensor *x = hx ? kiln_scope_escape(kiln_to_device(hx, "gpu:0")) : NULL;
  kiln_tensor *y = hy ? kiln_scope_escape(kiln_to_device(hy, "gpu:0")) : NULL;
  kiln_scope_pop();
  m.sgd = kiln_sgd_new(0.01);
  if (rc || !x || !y || !m.sgd) return fail("mlp: the model");
  kiln_function *f = kiln_function_new("gpu_mlp_step", mlp_body, &m, 2, 1);
  if (!f || kiln_device_push("gpu:0")) return fail("mlp");
  kiln_tensor *in[2] = {x, y}, *l = NULL;
  double t0 = now_s(), loss0 = NAN, s[MAX_RUNS];
  kiln_scope_push();
  rc = kiln_function_call(f, in, &l);
  if (!rc) {
    kiln_tensor *h = kiln_to_device(l, "cpu:0");
    loss0 = h ? kiln_tensor_item(h) : NAN;
  }
  kiln_scope_pop();
  double first_ms = (now_s() - t0) * 1e3;
  for (int r = -1; !rc && r < runs; r++) {
    t0 = now_s();
    for (int i = 0; i < mlp_steps && !rc; i++) {
      kiln_scope_push();
      rc = kiln_function_call(f, in, &l);
      kiln_scope_pop();
    }
    if (!rc) rc = sync0();
    if (r >= 0) s[r] = (now_s() - t0) / mlp_steps;
  }
  kiln_device_pop();
  if (rc) return fail("mlp: a step");
  double ms = median(s, runs) * 1e3;
  printf("mlp 784-256-256-10, batch %lld, staged on gpu:0: %.3f ms/step   first call %.0f ms, loss before %.4f\n",
         (long long)BATCH, ms, first_ms, loss0);
  bench_figure("gpu.mlp.b64.staged", ms, "ms");
  bench_figure("gpu.mlp.first_call", first_ms, "ms");
  kiln_function_free(f);
  for (int i = 0; i < N_VARS; i++) kiln_variable_free(m.v[i]);
  kiln_optimizer_free(m.sgd);
  kiln_release(x), kiln_release(y);
  return 0;
}

int main(int argc, char **argv) {
  const char *only = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) {
      fused_n = (int64_t)32 << 20, runs = 3, seed_iters = 50, mlp_steps = 10;
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else {
      fprintf(stderr, "usage: bench_gpu [--quick] [--only fused|sgemm|seed|mlp]\n");
      return 2;
    }
  }
  if (kiln_device_count() < 2) {
    printf("bench_gpu: no GPU: skipped (%s)\n", kiln_debug_cuda_status());
    return 0;
  }
  cuda_device_info d;
  if (kiln_debug_cuda_device(0, &d) == 0)
    printf("gpu:0 is %s, sm_%d%d, %zu MiB; kernels for %s\n", d.name, d.cc_major, d.cc_minor, d.total_bytes >> 20,
           cuda_arch_of(0));
  int rc = 0;
  if (!only || !strcmp(only, "fused")) rc |= bench_fused();
  if (!only || !strcmp(only, "sgemm")) rc |= bench_sgemm();
  if (!only || !strcmp(only, "seed")) rc |= bench_seed();
  if (!only || !strcmp(only, "mlp")) rc |= bench_mlp();
  return rc;
}
