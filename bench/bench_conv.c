/* bench_conv.c — conv2d speed in GFLOP/s (2 * N*OH*OW*O * KH*KW*C/groups
 * flops, the same for each gradient) and as a fraction of the machine's f32
 * FMA peak measured in the same run (peak.h), for four ResNet-50 layers
 * (NHWC, batch 8): 3x3 64->64 56x56 stride 1, 1x1 256->64 56x56, 3x3
 * 128->128 56x56 stride 2 and the 7x7 stride-2 3->64 stem on 224x224
 * (padding k/2, as torchvision's). Forward eager and staged (a
 * kiln_function whose body is one conv2d), the input gradient (eager
 * kiln_conv2d_transpose) and the filter gradient (a tape's gradient of the
 * conv with respect to the filter alone: the tape seeds ones), the
 * filter gradient's kernel alone (dw-kernel: conv_direct_filter on a given
 * dy, no tape, no allocation), and the input gradient staged (dx-staged: a
 * kiln_function whose body is one conv2d_transpose; since session 23
 * compiled code keeps a parameter filter's packing across calls, as eager
 * calls do: before, it packed on every call).
 * Medians over runs. The PyTorch peer is bench/conv_torch.py (same layers,
 * NCHW and channels_last, forward and both gradients).
 *
 *   bench_conv [--runs R] [--batch N] [--only LAYER] [--shape C,O,K,S,HW]
 *
 * --shape measures one other layer instead: C -> O channels, a KxK filter
 * of stride S (padding K/2) on HWxHW images (named CxO_KxK_sS_HW).
 *
 * On a shared machine, KILN_NUM_THREADS=1 against conv_torch.py --threads 1
 * is the steadier comparison (one core each; the peak is then one core's).
 *
 * Lines starting with "@" (conv.LAYER.IMPL) are machine-readable. */
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "bench_util.h"
#include "conv.h"
#include "peak.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_RUNS = 31, IMPLS = 6 };

typedef struct {
  const char *name;
  int64_t c, o, k, stride, hw;
} layer;

static kiln_conv_opts conv_opts;
static int64_t conv_hw[2];

static int conv_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_conv2d(in[0], in[1], &conv_opts);
  return out[0] ? 0 : -1;
}

static int dx_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_conv2d_transpose(in[0], in[1], conv_hw, &conv_opts);
  return out[0] ? 0 : -1;
}

static int bench(const layer *l, int64_t batch, int runs, double peak) {
  int64_t oh = (l->hw + 2 * (l->k / 2) - l->k) / l->stride + 1;
  double flops = 2.0 * (double)batch * (double)(oh * oh) * (double)l->o * (double)(l->k * l->k * l->c);
  conv_opts = (kiln_conv_opts){.stride = {(int)l->stride, (int)l->stride}};
  for (int i = 0; i < 4; i++) conv_opts.padding[i] = (int)(l->k / 2);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(batch, l->hw, l->hw, l->c));
  kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(l->k, l->k, l->c, l->o));
  kiln_tensor *dy = kiln_random_normal(KILN_F32, KILN_SHAPE(batch, oh, oh, l->o));
  kiln_tensor *df = kiln_zeros(KILN_F32, KILN_SHAPE(l->k, l->k, l->c, l->o));
  kiln_function *f = kiln_function_new("conv", conv_body, NULL, 2, 1);
  kiln_function *fdx = kiln_function_new("conv_dx", dx_body, NULL, 2, 1);
  kiln_tensor *in[2] = {x, w}, *in_dx[2] = {dy, w};
  int64_t hw[2] = {l->hw, l->hw};
  conv_hw[0] = conv_hw[1] = l->hw;
  double s[IMPLS][MAX_RUNS];
  int rc = x && w && dy && df && f && fdx ? 0 : -1;
  for (int r = -1; !rc && r < runs; r++) { /* run -1 warms up (and traces) */
    for (int k = 0; k < IMPLS && !rc; k++) {
      kiln_scope_push();
      kiln_tensor *y = NULL;
      kiln_tape *tape = NULL;
      if (k == 3) { /* the forward pass on the tape, untimed */
        tape = kiln_tape_begin(false);
        kiln_tape_watch(tape, w);
        if (!tape || !(y = kiln_conv2d(x, w, &conv_opts))) rc = -1;
      }
      double t0 = now_s();
      if (k == 0) {
        if (!(y = kiln_conv2d(x, w, &conv_opts))) rc = -1;
      } else if (k == 1) {
        rc = kiln_function_call(f, in, &y);
      } else if (k == 2) {
        if (!kiln_conv2d_transpose(dy, w, hw, &conv_opts)) rc = -1;
      } else if (k == 3) {
        if (!rc) {
          kiln_tensor *dw = NULL;
          rc = kiln_tape_gradient(tape, y, 1, &w, &dw);
        }
      } else if (k == 5) {
        rc = kiln_function_call(fdx, in_dx, &y);
      } else { /* the filter gradient's kernel alone: no tape, dy given, df written in place */
        conv_shape cs = {.n = batch, .h = l->hw, .w = l->hw, .c = l->c, .oh = oh, .ow = oh, .o = l->o, .kh = l->k,
                         .kw = l->k, .sh = l->stride, .sw = l->stride, .dh = 1, .dw = 1, .pt = l->k / 2,
                         .pl = l->k / 2};
        rc = conv_direct_filter(&cs, KILN_F32, x->data, dy->data, df->data, "bench_conv");
      }
      double t = now_s() - t0;
      kiln_tape_free(tape);
      if (r >= 0) s[k][r] = t;
      kiln_scope_pop();
    }
  }
  if (rc) {
    fprintf(stderr, "bench_conv: %s: %s\n", l->name, kiln_last_error());
  } else {
    static const char *impl[IMPLS] = {"eager", "staged", "dx", "dw", "dw-kernel", "dx-staged"};
    for (int k = 0; k < IMPLS; k++) {
      double g = flops / median(s[k], runs) * 1e-9;
      printf("conv %-16s %-9s %8.1f GFLOP/s  %5.1f%% of the FMA peak\n", l->name, impl[k], g, 100 * g / peak);
      char key[64];
      snprintf(key, sizeof key, "conv.%s.%s", l->name, impl[k]);
      bench_figure(key, g, "GFLOP/s");
    }
  }
  kiln_function_free(f);
  kiln_function_free(fdx);
  kiln_release(x);
  kiln_release(w);
  kiln_release(dy);
  kiln_release(df);
  return rc;
}

int main(int argc, char **argv) {
  int runs = 5;
  int64_t batch = 8;
  const char *only = NULL;
  layer custom = {0};
  char custom_name[160];
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--batch") && i + 1 < argc) {
      batch = atoll(argv[++i]);
    } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
      long long v[5];
      if (sscanf(argv[++i], "%lld,%lld,%lld,%lld,%lld", &v[0], &v[1], &v[2], &v[3], &v[4]) != 5 || v[0] < 1 ||
          v[1] < 1 || v[2] < 1 || v[3] < 1 || v[4] < v[2]) {
        fprintf(stderr, "bench_conv: --shape wants C,O,K,S,HW (positive, HW >= K)\n");
        return 2;
      }
      snprintf(custom_name, sizeof custom_name, "%lldx%lld_%lldx%lld_s%lld_%lld", v[0], v[1], v[2], v[2], v[3], v[4]);
      custom = (layer){custom_name, v[0], v[1], v[2], v[3], v[4]};
    } else {
      fprintf(stderr, "usage: bench_conv [--runs R] [--batch N] [--only LAYER] [--shape C,O,K,S,HW]\n");
      return 2;
    }
  }
  if (runs < 1) runs = 1;
  if (runs > MAX_RUNS) runs = MAX_RUNS;
  int threads = kiln_num_threads();
  double peak = peak_gflops(threads);
  printf("f32 FMA peak: %.1f GFLOP/s on %d threads (measured)\n", peak, threads);
  bench_figure("conv.fma_peak", peak, "GFLOP/s");
  static const layer layers[] = {{"3x3_64_64", 64, 64, 3, 1, 56},
                                 {"1x1_256_64", 256, 64, 1, 1, 56},
                                 {"3x3s2_128_128", 128, 128, 3, 2, 56},
                                 {"7x7s2_3_64", 3, 64, 7, 2, 224}};
  int failed = 0;
  if (custom.name) return bench(&custom, batch, runs, peak) != 0;
  for (size_t k = 0; k < sizeof layers / sizeof layers[0]; k++)
    if (!only || !strcmp(only, layers[k].name)) failed |= bench(&layers[k], batch, runs, peak) != 0;
  return failed;
}
