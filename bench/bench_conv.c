/* bench_conv.c — conv2d speed in GFLOP/s (2 * N*OH*OW*O * KH*KW*C/groups
 * flops) and as a fraction of the machine's f32 FMA peak measured in the
 * same run (peak.h): eager kiln_conv2d and a staged kiln_function whose body
 * is one conv2d, for the issue's two layers of ResNet-50 (NHWC, batch 8,
 * 56x56): 3x3 64->64 SAME, and 1x1 256->64. Medians over runs. The PyTorch
 * peer is bench/conv_torch.py (same layers, NCHW and channels_last).
 *
 *   bench_conv [--runs R] [--batch N]
 *
 * Lines starting with "@" (conv.LAYER.IMPL) are machine-readable. */
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "bench_util.h"
#include "peak.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_RUNS = 31 };

typedef struct {
  const char *name;
  int64_t c, o, k;
} layer;

static kiln_conv_opts same_opts;

static int conv_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_conv2d(in[0], in[1], &same_opts);
  return out[0] ? 0 : -1;
}

static int bench(const layer *l, int64_t batch, int runs, double peak) {
  int64_t hw = 56;
  double flops = 2.0 * (double)batch * (double)(hw * hw) * (double)l->o * (double)(l->k * l->k * l->c);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(batch, hw, hw, l->c));
  kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(l->k, l->k, l->c, l->o));
  kiln_function *f = kiln_function_new("conv", conv_body, NULL, 2, 1);
  kiln_tensor *in[2] = {x, w};
  double s[2][MAX_RUNS];
  int rc = x && w && f ? 0 : -1;
  for (int r = -1; !rc && r < runs; r++) { /* run -1 warms up (and traces) */
    for (int k = 0; k < 2 && !rc; k++) {
      kiln_scope_push();
      kiln_tensor *y = NULL;
      double t0 = now_s();
      if (k == 0) {
        if (!(y = kiln_conv2d(x, w, &same_opts))) rc = -1;
      } else {
        rc = kiln_function_call(f, in, &y);
      }
      double t = now_s() - t0;
      if (r >= 0) s[k][r] = t;
      kiln_scope_pop();
    }
  }
  if (rc) {
    fprintf(stderr, "bench_conv: %s: %s\n", l->name, kiln_last_error());
  } else {
    static const char *impl[2] = {"eager", "staged"};
    for (int k = 0; k < 2; k++) {
      double g = flops / median(s[k], runs) * 1e-9;
      printf("conv %-16s %-6s %8.1f GFLOP/s  %5.1f%% of the FMA peak\n", l->name, impl[k], g, 100 * g / peak);
      char key[64];
      snprintf(key, sizeof key, "conv.%s.%s", l->name, impl[k]);
      bench_figure(key, g, "GFLOP/s");
    }
  }
  kiln_function_free(f);
  kiln_release(x);
  kiln_release(w);
  return rc;
}

int main(int argc, char **argv) {
  int runs = 5;
  int64_t batch = 8;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--batch") && i + 1 < argc) {
      batch = atoll(argv[++i]);
    } else {
      fprintf(stderr, "usage: bench_conv [--runs R] [--batch N]\n");
      return 2;
    }
  }
  if (runs < 1) runs = 1;
  if (runs > MAX_RUNS) runs = MAX_RUNS;
  same_opts.same = true;
  int threads = kiln_num_threads();
  double peak = peak_gflops(threads);
  printf("f32 FMA peak: %.1f GFLOP/s on %d threads (measured)\n", peak, threads);
  bench_figure("conv.fma_peak", peak, "GFLOP/s");
  static const layer layers[] = {{"3x3_64_64", 64, 64, 3}, {"1x1_256_64", 256, 64, 1}};
  int failed = 0;
  for (size_t k = 0; k < sizeof layers / sizeof layers[0]; k++) failed |= bench(&layers[k], batch, runs, peak) != 0;
  return failed;
}
