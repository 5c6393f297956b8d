/* bench_resnet.c — ResNet-50 (torchvision's resnet50, v1.5: resnet_model.h)
 * on synthetic 224x224x3 images, the TF Eager paper's Figure 3: images/s of
 * a training step (forward, tape gradient, SGD with momentum 0.9, batch
 * norm's running statistics updated) run eagerly and staged as one
 * kiln_function (with its first call's trace / passes / compile ms and
 * kernel count), and of inference (running statistics) eagerly and staged;
 * each as a fraction of the f32 FMA peak measured in the same run (peak.h;
 * flops counted as 2 per multiply-add of the convs and the dense layer, 3x
 * the forward's for a training step). Medians of --runs steps after
 * --warmup ones. Then bench/resnet_torch.py, PyTorch's peer (torchvision's
 * resnet50 in NCHW and channels_last, with glibc's malloc as it is and
 * told to keep freed memory), in the same run, and the ratios Kiln /
 * PyTorch (against PyTorch's fastest variant).
 *
 *   bench_resnet [--batch N] [--runs R] [--warmup W] [--modes LIST]
 *                [--no-torch] [--python CMD] [--cache] [--breakdown] [--force]
 *   bench_resnet --check [--python CMD]
 *
 * LIST: train-eager,train-staged,infer-eager,infer-staged (the default,
 * all). --cache keeps Kiln's disk cache of compiled code (off by default, so
 * the compile time is cold). --check runs resnet_model.h's resnet_check: a
 * small ResNet in f64, eager == staged, and == PyTorch where CMD (default
 * /usr/bin/python3) imports torch, torchvision and numpy; exit status 0 when
 * everything agrees. --breakdown times each piece of the training step
 * alone (below) and ranks them against the measured steps. A mode whose
 * memory (estimated from the peak RSS measured at batch 8 and 32) would not fit in
 * 80% of MemAvailable is skipped with a message unless --force.
 *
 * Lines starting with "@" (resnet.bBATCH.MODE.IMPL) are machine-readable. */
#define _POSIX_C_SOURCE 200809L /* setenv, popen, mkdtemp, readlink */
#include <kiln.h>

#include "bench_util.h"
#include "conv.h"
#include "peak.h"
#include "resnet_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

enum { MAX_RUNS = 51 };

/* bench/resnet_torch.py, next to this source (or KILN_RESNET_TORCH) */
static void script_path(char *out, size_t size) {
  const char *env = getenv("KILN_RESNET_TORCH");
  if (env) snprintf(out, size, "%s", env);
  else bench_script_path(__FILE__, "resnet_torch.py", out, size);
}

static int torch_available(const char *python) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s -c 'import torch, torchvision, numpy' >/dev/null 2>&1", python);
  return system(cmd) == 0;
}

static int run_check(const char *python) {
  char script[4096], cmd[8192], dir[] = "/tmp/kiln_resnet_check_XXXXXX", report[16384];
  script_path(script, sizeof script);
  int torch = torch_available(python);
  if (!torch)
    printf("resnet check: %s cannot import torch, torchvision and numpy (install python3-torch and "
           "python3-torchvision): comparing eager with staged only\n",
           python);
  if (!mkdtemp(dir)) {
    fprintf(stderr, "bench_resnet: cannot make %s\n", dir);
    return 1;
  }
  snprintf(cmd, sizeof cmd, "%s '%s' --check", python, script);
  double t0 = now_s();
  int bad = resnet_check(torch ? cmd : NULL, dir, 1e-8, report, sizeof report);
  printf("%s\n(%.1f s)\n", report, now_s() - t0);
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "bench_resnet: cannot remove %s\n", dir);
  if (bad) printf("resnet check: FAILED (%d)\n", bad);
  return bad != 0;
}

typedef struct {
  const char *name; /* train-eager ... */
  bool train, staged;
  double ips;       /* images/s, 0 = not run */
} mode;

/* MemAvailable of /proc/meminfo in bytes, or -1 */
static double mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  char line[256];
  double kb = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
  if (f) fclose(f);
  return kb < 0 ? -1 : kb * 1024;
}

/* The memory a mode needs at this batch, from the peak RSS measured (eager
 * training 2.0 GB at batch 8 and 6.1 GB at batch 32 since the tape's walk
 * frees as it goes: 3.3 and 10.5 GB before; staged training 2.2 GB, a 1.69
 * GB arena, and 7.2 GB at batch 32, a 6.77 GB arena, since
 * backends/plan/arena.c; inference well under 1 GB), with room. */
static double mode_bytes(const mode *md, int64_t batch) {
  double per_image = md->train ? (md->staged ? 0.25e9 : 0.3e9) : 0.1e9;
  return 0.6e9 + per_image * (double)batch;
}

static int time_mode(mode *md, resnet_model *m, kiln_tensor *x, kiln_tensor *labels, int warmup, int runs,
                     double peak) {
  int64_t batch = kiln_tensor_shape(x)[0];
  kiln_optimizer *opt = md->train ? kiln_sgd_momentum_new(0.01, 0.9, false) : NULL;
  resnet_stage st = {m, opt};
  kiln_function *f = NULL;
  if (md->staged)
    f = md->train ? kiln_function_new("resnet_train", resnet_train_body, &st, 2, 1)
                  : kiln_function_new("resnet_infer", resnet_infer_body, &st, 1, 1);
  int rc = (md->train && !opt) || (md->staged && !f) ? -1 : 0;
  /* staged inference as a deployed model runs: batch norms folded into the
   * convs (foldbn), whose bias and relu are then the convs' epilogues */
  if (!rc && f && !md->train) rc = kiln_function_set_optimize_for_inference(f, true);
  double s[MAX_RUNS], first = 0, last_loss = NAN;
  struct rusage ru0, ru1;
  memset(&ru0, 0, sizeof ru0);
  for (int r = 0; !rc && r < warmup + runs; r++) {
    if (r == warmup) getrusage(RUSAGE_SELF, &ru0);
    kiln_scope_push();
    kiln_tensor *in[2] = {x, labels}, *out = NULL;
    double t0 = now_s();
    if (md->staged) {
      rc = kiln_function_call(f, in, &out);
    } else if (md->train) {
      rc = resnet_train_step(m, opt, x, labels, &out);
    } else {
      rc = (out = resnet_forward(m, x, false, false)) ? 0 : -1;
    }
    if (!rc && md->train) last_loss = kiln_tensor_item(out); /* eager work is done by now; staged too */
    double t = now_s() - t0;
    if (r == 0) first = t;
    if (r >= warmup) s[r - warmup] = t;
    kiln_scope_pop();
  }
  if (rc) {
    fprintf(stderr, "bench_resnet: %s: %s\n", md->name, kiln_last_error());
  } else {
    getrusage(RUSAGE_SELF, &ru1);
    double faults = (double)(ru1.ru_minflt - ru0.ru_minflt) / runs;
    double sys = ((double)(ru1.ru_stime.tv_sec - ru0.ru_stime.tv_sec) +
                  1e-6 * (double)(ru1.ru_stime.tv_usec - ru0.ru_stime.tv_usec)) / runs;
    double med = median(s, runs);
    double flops = m->flops * (md->train ? 3 : 1) * (double)batch;
    md->ips = (double)batch / med;
    printf("kiln  resnet50 %-12s batch %lld: %7.2f img/s  %5.1f%% of the FMA peak  (median of %d, %.0f ms per step",
           md->name, (long long)batch, md->ips, 100 * flops / med * 1e-9 / peak, runs, med * 1e3);
    if (md->train) printf(", loss %.4f", last_loss);
    /* a fault brings in 4 KiB, or 2 MiB of a huge page (alloc.c asks for
     * them): the count, not bytes */
    printf(")\n      per step: %.0f minor page faults, %.0f ms of system time; peak RSS so far %.1f GB\n", faults,
           sys * 1e3, (double)ru1.ru_maxrss / 1e6);
    if (!md->staged) { /* the packed filters eager convs keep (lib/conv_cache.c), since the process began */
      int64_t entries, bytes, hits, fills;
      conv_cache_stats(&entries, &bytes, &hits, &fills);
      printf("      packed filters kept: %lld (%.0f MB), %lld hits, %lld kept in all\n", (long long)entries,
             (double)bytes / 1e6, (long long)hits, (long long)fills);
    }
    char key[96];
    snprintf(key, sizeof key, "resnet.b%lld.%s.kiln-%s", (long long)batch, md->train ? "train" : "infer",
             md->staged ? "staged" : "eager");
    bench_figure(key, md->ips, "img/s");
    if (md->staged) {
      kiln_stats stt;
      int tr = kiln_function_trace_count(f) - 1;
      if (!kiln_function_stats(f, tr, &stt)) {
        printf("      first call %.2f s: trace %.0f ms, passes %.0f ms, compile %.0f ms; %d traced ops -> %d optimized, "
               "%d kernels (%d fused ops), temporaries %.0f MB (%.0f MB unshared); %d traces\n",
               first, stt.trace_ms, stt.optimize_ms, stt.compile_ms, stt.traced_ops, stt.optimized_ops, stt.kernels,
               stt.fused_ops, stt.peak_bytes / 1e6, stt.unshared_bytes / 1e6, tr + 1);
        snprintf(key, sizeof key, "resnet.b%lld.%s.compile_ms", (long long)batch, md->train ? "train" : "infer");
        bench_figure(key, stt.trace_ms + stt.optimize_ms + stt.compile_ms, "ms");
        snprintf(key, sizeof key, "resnet.b%lld.%s.kernels", (long long)batch, md->train ? "train" : "infer");
        bench_figure(key, stt.kernels, "kernels");
      }
    }
  }
  kiln_function_free(f);
  kiln_optimizer_free(opt);
  return rc;
}

/* ---- --breakdown: where an eager training step's time goes ----
 * Each piece of the step timed alone with the step's shapes (median of
 * `reps` after a warm-up): every conv's forward, input gradient (conv2d_
 * transpose; none for the stem, whose images need none) and filter
 * gradient (a tape's, less the forward), every batch norm's
 * training forward (moments + batch_norm) and its backward (a tape's
 * gradient w.r.t. x, scale and offset, less the forward), relu, its
 * gradient and the residual adds (timed on layer1's 56x56x256 output and
 * scaled by the elements), the stem's max pool and its gradient, and the
 * SGD-momentum update of the 25.6M parameters. Whatever the step takes
 * beyond their sum is allocation (page faults on fresh memory), the tape
 * and dispatch. */

enum { BK_CONV_FWD, BK_CONV_BPI, BK_CONV_BPF, BK_BN_FWD, BK_BN_BWD, BK_RELU_FWD, BK_RELU_BWD, BK_ADD, BK_POOL,
       BK_OPT, BK_N };
static const char *const bk_names[BK_N] = {
    "conv forward",          "conv input gradient", "conv filter gradient", "batch norm forward",
    "batch norm backward",   "relu forward",        "relu gradient",        "residual add",
    "max pool fwd + grad",   "SGD momentum update"};

typedef struct {
  int what; /* 0 conv fwd, 1 bpi, 2 fwd + bpf, 3 bn fwd, 4 bn fwd + bwd, 5 relu, 6 relu fwd + grad, 7 add,
               8 pool fwd + grad */
  kiln_tensor *x, *w, *dy, *scale, *offset;
  kiln_conv_opts o;
  int64_t hw_in[2];
} piece;

static int piece_run(piece *p) {
  kiln_tensor *r = NULL, *g[3] = {NULL, NULL, NULL};
  static const int axes[3] = {0, 1, 2}, window[2] = {3, 3};
  switch (p->what) {
  case 0: r = kiln_conv2d(p->x, p->w, &p->o); break;
  case 1: r = kiln_conv2d_transpose(p->dy, p->w, p->hw_in, &p->o); break;
  case 2: { /* forward and filter gradient (the tape's backprop_filter op); less the forward below */
    kiln_tape *t = kiln_tape_begin(false);
    kiln_tape_watch(t, p->w);
    r = kiln_conv2d(p->x, p->w, &p->o);
    kiln_tape_end(t);
    if (r && kiln_tape_gradient(t, r, 1, &p->w, g)) r = NULL;
    kiln_tape_free(t);
    break;
  }
  case 3:
  case 4: {
    kiln_tape *t = p->what == 4 ? kiln_tape_begin(false) : NULL;
    kiln_tensor *src[3] = {p->x, p->scale, p->offset}, *mean = NULL, *var = NULL;
    for (int i = 0; t && i < 3; i++) kiln_tape_watch(t, src[i]);
    if (!kiln_moments(p->x, 3, axes, false, &mean, &var))
      r = kiln_batch_norm(p->x, mean, var, p->offset, p->scale, 1e-5);
    if (t) {
      kiln_tape_end(t);
      if (r && kiln_tape_gradient(t, r, 3, src, g)) r = NULL;
      kiln_tape_free(t);
    }
    break;
  }
  case 5: r = kiln_relu(p->x); break;
  case 6:
  case 8: {
    kiln_tape *t = kiln_tape_begin(false);
    kiln_tape_watch(t, p->x);
    r = p->what == 6 ? kiln_relu(p->x) : kiln_max_pool2d(p->x, window, &p->o);
    kiln_tape_end(t);
    if (r && kiln_tape_gradient(t, r, 1, &p->x, g)) r = NULL;
    kiln_tape_free(t);
    break;
  }
  case 7: r = kiln_add(p->x, p->dy); break;
  }
  return r ? 0 : -1;
}

static double piece_time(piece *p, int reps, int *rc) {
  double s[MAX_RUNS];
  for (int r = -1; r < reps && !*rc; r++) {
    kiln_scope_push();
    double t0 = now_s();
    *rc = piece_run(p);
    if (r >= 0) s[r] = now_s() - t0;
    kiln_scope_pop();
  }
  return *rc ? 0 : median(s, reps);
}

/* fills ms[BK_N] with the seconds per step of each piece */
/* per conv: seconds of its forward, input gradient and filter gradient */
static double conv_sec[RN_MAX_CONVS][3];

static int breakdown(resnet_model *m, int64_t batch, int reps, double *sec) {
  int rc = 0;
  memset(sec, 0, BK_N * sizeof sec[0]);
  double bn_fwd_bwd = 0, relu_pair = 0;
  for (int i = 0; i < m->nconvs && !rc; i++) {
    const rn_conv_geo *g = &m->convs[i];
    kiln_scope_push();
    piece p;
    memset(&p, 0, sizeof p);
    int64_t xs[4] = {batch, g->hw_in, g->hw_in, g->cin}, ws[4] = {g->k, g->k, g->cin, g->cout},
            ys[4] = {batch, g->hw_out, g->hw_out, g->cout}, cs[1] = {g->cout};
    p.x = kiln_random_normal(KILN_F32, 4, xs);
    p.w = kiln_random_normal(KILN_F32, 4, ws);
    p.dy = kiln_random_normal(KILN_F32, 4, ys);
    p.o.stride[0] = p.o.stride[1] = g->stride;
    for (int k = 0; k < 4; k++) p.o.padding[k] = (int)(g->k / 2);
    p.hw_in[0] = p.hw_in[1] = g->hw_in;
    double t[3] = {0, 0, 0};
    /* the stem reads the images, which need no gradient: the step computes
     * no input gradient for it */
    for (p.what = 0; p.what < 3 && !rc; p.what++)
      if (p.what != 1 || i > 0) t[p.what] = piece_time(&p, reps, &rc);
    if (!rc) sec[BK_CONV_FWD] += t[0], sec[BK_CONV_BPI] += t[1], sec[BK_CONV_BPF] += t[2] - t[0];
    conv_sec[i][0] = t[0], conv_sec[i][1] = t[1], conv_sec[i][2] = t[2] - t[0];
    /* the batch norm after this conv, on its output */
    p.x = p.dy;
    p.scale = kiln_random_uniform(KILN_F32, 1, cs, 0.5, 1.5);
    p.offset = kiln_random_normal(KILN_F32, 1, cs);
    p.what = 3;
    if (!rc) sec[BK_BN_FWD] += piece_time(&p, reps, &rc);
    p.what = 4;
    if (!rc) bn_fwd_bwd += piece_time(&p, reps, &rc);
    if (!rc && i == 0) { /* the stem's max pool, on conv1's output */
      p.what = 8;
      memset(&p.o, 0, sizeof p.o);
      p.o.stride[0] = p.o.stride[1] = 2;
      for (int k = 0; k < 4; k++) p.o.padding[k] = 1;
      p.x = kiln_relu(p.dy);
      sec[BK_POOL] = piece_time(&p, reps, &rc);
    }
    if (!rc && g->hw_out == 56 && g->cout == 256 && relu_pair == 0) { /* layer1's output: relu and add per element */
      double elems = (double)(g->hw_out * g->hw_out * g->cout);
      p.x = p.dy, p.dy = kiln_random_normal(KILN_F32, 4, ys);
      p.what = 5;
      double relu = piece_time(&p, reps, &rc) / elems;
      p.what = 6;
      relu_pair = piece_time(&p, reps, &rc) / elems;
      p.what = 7;
      double add = piece_time(&p, reps, &rc) / elems;
      sec[BK_RELU_FWD] = relu * (double)m->relu_elems;
      sec[BK_RELU_BWD] = (relu_pair - relu) * (double)m->relu_elems;
      sec[BK_ADD] = add * (double)m->add_elems;
    }
    kiln_scope_pop();
  }
  sec[BK_BN_BWD] = bn_fwd_bwd - sec[BK_BN_FWD];
  /* the optimizer: one update of every trainable variable with zero gradients (a warm-up creates the slots) */
  kiln_optimizer *opt = kiln_sgd_momentum_new(0.01, 0.9, false); /* zero gradients: nothing moves */
  kiln_tensor *grads[RN_MAX_VARS];
  kiln_scope_push();
  for (int i = 0; i < m->ntrain && !rc; i++) {
    kiln_tensor *v = kiln_variable_read(m->train[i]);
    if (!(grads[i] = kiln_zeros(kiln_tensor_dtype(v), kiln_tensor_rank(v), kiln_tensor_shape(v)))) rc = -1;
  }
  double s[MAX_RUNS];
  for (int r = -1; r < reps && !rc; r++) {
    double t0 = now_s();
    rc = opt ? kiln_optimizer_apply(opt, m->ntrain, m->train, grads) : -1;
    if (r >= 0) s[r] = now_s() - t0;
  }
  if (!rc) sec[BK_OPT] = median(s, reps);
  kiln_scope_pop();
  kiln_optimizer_free(opt);
  return rc;
}

/* the convs' GFLOP/s by kind, and the slowest layers (summed over their three kinds, merged by shape) */
static void print_convs(const resnet_model *m, int64_t batch, double peak) {
  static const char *const kind[3] = {"forward", "input gradient", "filter gradient"};
  double flops[3] = {0, 0, 0}, t[3] = {0, 0, 0};
  for (int i = 0; i < m->nconvs; i++) {
    const rn_conv_geo *g = &m->convs[i];
    for (int k = 0; k < 3; k++)
      if (conv_sec[i][k] > 0) { /* the stem's input gradient: none */
        flops[k] += 2.0 * (double)(batch * g->hw_out * g->hw_out) * (double)(g->k * g->k * g->cin * g->cout);
        t[k] += conv_sec[i][k];
      }
  }
  for (int k = 0; k < 3; k++)
    printf("  convs' %-16s %7.1f GFLOP/s  %5.1f%% of the FMA peak\n", kind[k], flops[k] / t[k] * 1e-9,
           100 * flops[k] / t[k] * 1e-9 / peak);
  /* layers of the same shape together: shape key -> time, flops, count */
  double lt[RN_MAX_CONVS][3], lf[RN_MAX_CONVS];
  int first[RN_MAX_CONVS], count[RN_MAX_CONVS], n = 0;
  for (int i = 0; i < m->nconvs; i++) {
    const rn_conv_geo *g = &m->convs[i];
    int j = 0;
    for (; j < n; j++) {
      const rn_conv_geo *h = &m->convs[first[j]];
      if (h->k == g->k && h->cin == g->cin && h->cout == g->cout && h->hw_in == g->hw_in && h->stride == g->stride) break;
    }
    if (j == n) first[n] = i, count[n] = 0, lt[n][0] = lt[n][1] = lt[n][2] = 0, lf[n] = 0, n++;
    count[j]++;
    for (int k = 0; k < 3; k++) lt[j][k] += conv_sec[i][k];
    lf[j] += 2.0 * (double)(batch * g->hw_out * g->hw_out) * (double)(g->k * g->k * g->cin * g->cout);
  }
  printf("  the slowest conv shapes (ms per step: forward / input gradient / filter gradient, GFLOP/s of each):\n");
  for (int r = 0; r < n; r++) {
    int best = -1;
    double bt = -1;
    for (int j = 0; j < n; j++) {
      double tj = lt[j][0] + lt[j][1] + lt[j][2];
      if (count[j] > 0 && tj > bt) bt = tj, best = j;
    }
    const rn_conv_geo *g = &m->convs[first[best]];
    printf("    %2dx %lldx%lld %4lld->%-4lld /%d at %3lldx%-3lld %6.0f / %6.0f / %6.0f ms  %5.0f / %5.0f / %5.0f GFLOP/s\n",
           count[best], (long long)g->k, (long long)g->k, (long long)g->cin, (long long)g->cout, g->stride,
           (long long)g->hw_in, (long long)g->hw_in, lt[best][0] * 1e3, lt[best][1] * 1e3, lt[best][2] * 1e3,
           lf[best] / lt[best][0] * 1e-9, lt[best][1] > 0 ? lf[best] / lt[best][1] * 1e-9 : 0,
           lf[best] / lt[best][2] * 1e-9);
    count[best] = -count[best];
  }
}

static void print_breakdown(const double *sec, int64_t batch, double eager_step, double staged_step) {
  int order[BK_N];
  for (int i = 0; i < BK_N; i++) order[i] = i;
  for (int i = 0; i < BK_N; i++) /* by time, largest first */
    for (int j = i + 1; j < BK_N; j++)
      if (sec[order[j]] > sec[order[i]]) {
        int t = order[i];
        order[i] = order[j], order[j] = t;
      }
  double sum = 0, conv = sec[BK_CONV_FWD] + sec[BK_CONV_BPI] + sec[BK_CONV_BPF];
  for (int i = 0; i < BK_N; i++) sum += sec[i];
  printf("breakdown of a training step at batch %lld, each piece timed alone (ms per step):\n", (long long)batch);
  for (int i = 0; i < BK_N; i++) {
    printf("  %-24s %8.0f ms", bk_names[order[i]], sec[order[i]] * 1e3);
    if (eager_step > 0) printf("  %5.1f%% of the eager step", 100 * sec[order[i]] / eager_step);
    printf("\n");
  }
  static const char *const keys[BK_N] = {"conv_fwd", "conv_bp_input", "conv_bp_filter", "bn_fwd", "bn_bwd",
                                         "relu_fwd", "relu_bwd",  "add",         "pool",           "sgd"};
  for (int i = 0; i < BK_N; i++) {
    char key[96];
    snprintf(key, sizeof key, "resnet.b%lld.breakdown.%s", (long long)batch, keys[i]);
    bench_figure(key, sec[i] * 1e3, "ms");
  }
  printf("  %-24s %8.0f ms  (convs %.0f ms)\n", "sum of the pieces", sum * 1e3, conv * 1e3);
  if (eager_step > 0)
    printf("  eager step %.0f ms: %.0f ms (%.1f%%) beyond the pieces: allocation (page faults on fresh memory), tape, "
           "dispatch\n",
           eager_step * 1e3, (eager_step - sum) * 1e3, 100 * (eager_step - sum) / eager_step);
  if (staged_step > 0)
    printf("  staged step %.0f ms: convs (the same kernels) %.0f ms, the rest %.0f ms (fused elementwise and batch "
           "norm, the optimizer, the arena's page faults)\n",
           staged_step * 1e3, conv * 1e3, (staged_step - conv) * 1e3);
}

/* PyTorch's four variants: NCHW and channels_last, each with glibc's
 * malloc as it is and told to keep freed memory (resnet_torch.py's "-mk") */
enum { TORCH_VARIANTS = 4 };
static const char *torch_variant_names[TORCH_VARIANTS] = {"NCHW", "channels_last", "NCHW, malloc-keep",
                                                          "channels_last, malloc-keep"};
static const char *malloc_keep_env =
    "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736 MALLOC_TOP_PAD_=1073741824";

/* runs resnet_torch.py (under env, if not NULL), echoing it; torch[mode][v]
 * gets "@ resnet.bB.{train,infer}.torch[-cl][-mk]" (v: -cl is 1, -mk 2) */
static void run_torch(const char *env, const char *python, int64_t batch, int warmup, int runs, int threads,
                      bool train, bool infer, double torch[2][TORCH_VARIANTS]) {
  char script[4096], cmd[8192], line[1024];
  script_path(script, sizeof script);
  snprintf(cmd, sizeof cmd, "%s %s '%s' --batch %lld --warmup %d --runs %d --threads %d --modes %s%s%s 2>&1",
           env ? env : "", python, script, (long long)batch, warmup, runs, threads, train ? "train" : "",
           train && infer ? "," : "", infer ? "infer" : "");
  fflush(stdout);
  FILE *p = popen(cmd, "r");
  if (!p) {
    printf("torch: cannot run %s\n", cmd);
    return;
  }
  while (fgets(line, sizeof line, p)) {
    fputs(line, stdout);
    char key[256];
    double v;
    if (sscanf(line, "@ %255s %lf", key, &v) == 2) {
      char prefix[64];
      int n = snprintf(prefix, sizeof prefix, "resnet.b%lld.", (long long)batch);
      if (strncmp(key, prefix, (size_t)n)) continue;
      const char *k = key + n;
      int mode = !strncmp(k, "train.", 6) ? 0 : !strncmp(k, "infer.", 6) ? 1 : -1;
      if (mode < 0) continue;
      torch[mode][(strstr(k, "-cl") != NULL) + 2 * (strstr(k, "-mk") != NULL)] = v;
    }
  }
  int st = pclose(p);
  if (st) printf("torch: %s exited with status %d\n", script, st);
}

int main(int argc, char **argv) {
  int runs = 5, warmup = 2;
  int64_t batch = 8;
  bool check = false, with_torch = true, cache = false, do_breakdown = false, force = false;
  const char *python = "/usr/bin/python3", *modes = "train-eager,train-staged,infer-eager,infer-staged";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
      warmup = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--batch") && i + 1 < argc) {
      batch = atoll(argv[++i]);
    } else if (!strcmp(argv[i], "--modes") && i + 1 < argc) {
      modes = argv[++i];
    } else if (!strcmp(argv[i], "--python") && i + 1 < argc) {
      python = argv[++i];
    } else if (!strcmp(argv[i], "--check")) {
      check = true;
    } else if (!strcmp(argv[i], "--no-torch")) {
      with_torch = false;
    } else if (!strcmp(argv[i], "--cache")) {
      cache = true;
    } else if (!strcmp(argv[i], "--breakdown")) {
      do_breakdown = true;
    } else if (!strcmp(argv[i], "--force")) {
      force = true;
    } else {
      fprintf(stderr,
              "usage: bench_resnet [--batch N] [--runs R] [--warmup W] [--modes LIST] [--no-torch] [--python CMD] "
              "[--cache] [--breakdown] [--force]\n       bench_resnet --check [--python CMD]\n"
              "LIST: comma-separated train-eager,train-staged,infer-eager,infer-staged\n");
      return 2;
    }
  }
  if (!cache) setenv("KILN_CACHE_DIR", "off", 1); /* the compile time is cold */
  if (check) return run_check(python);
  if (runs < 1) runs = 1;
  if (runs > MAX_RUNS) runs = MAX_RUNS;
  if (warmup < 1) warmup = 1;
  if (batch < 1) batch = 1;

  int threads = kiln_num_threads();
  double peak = peak_gflops(threads);
  printf("f32 FMA peak: %.1f GFLOP/s on %d threads (measured)\n", peak, threads);
  bench_figure("resnet.fma_peak", peak, "GFLOP/s");
  resnet_config cfg = resnet50_config();
  kiln_random_seed(50);
  resnet_model *m = resnet_new(&cfg, NULL);
  if (!m) {
    fprintf(stderr, "bench_resnet: %s\n", kiln_last_error());
    return 1;
  }
  printf("kiln  resnet50: %d variables, %lld parameters, %.2f GFLOP per image forward (2 per multiply-add), "
         "training 3x\n",
         m->nvars, (long long)m->params, m->flops * 1e-9);
  bench_figure("resnet.params.kiln", (double)m->params, "parameters");
  int64_t xs[4] = {batch, cfg.image, cfg.image, 3}, ls[1] = {batch};
  kiln_tensor *x = kiln_random_normal(KILN_F32, 4, xs);
  kiln_tensor *labels = kiln_cast(kiln_random_uniform(KILN_F64, 1, ls, 0, (double)cfg.classes), KILN_I64);

  mode all[4] = {{"train-eager", true, false, 0},
                 {"train-staged", true, true, 0},
                 {"infer-eager", false, false, 0},
                 {"infer-staged", false, true, 0}};
  int failed = !x || !labels;
  bool any_train = false, any_infer = false;
  for (int k = 0; k < 4 && !failed; k++) {
    const char *p = strstr(modes, all[k].name);
    size_t len = strlen(all[k].name);
    if (!p || (p[len] && p[len] != ',')) continue;
    double need = mode_bytes(&all[k], batch), avail = mem_available();
    if (!force && avail > 0 && need > 0.8 * avail) {
      printf("kiln  resnet50 %-12s batch %lld: skipped: needs about %.1f GB, %.1f GB available (--force runs it)\n",
             all[k].name, (long long)batch, need / 1e9, avail / 1e9);
      continue;
    }
    if (time_mode(&all[k], m, x, labels, warmup, runs, peak)) failed = 1;
    any_train |= all[k].train, any_infer |= !all[k].train;
  }
  if (do_breakdown && !failed) {
    double sec[BK_N];
    if (breakdown(m, batch, runs, sec)) {
      fprintf(stderr, "bench_resnet: breakdown: %s\n", kiln_last_error());
      failed = 1;
    } else {
      print_breakdown(sec, batch, all[0].ips > 0 ? (double)batch / all[0].ips : 0,
                      all[1].ips > 0 ? (double)batch / all[1].ips : 0);
      print_convs(m, batch, peak);
    }
  }
  if (with_torch && !failed) {
    double torch[2][TORCH_VARIANTS] = {{0}};
    if (!torch_available(python)) {
      printf("torch: %s cannot import torch and torchvision (install python3-torch and python3-torchvision): "
             "no peer\n",
             python);
    } else {
      run_torch(NULL, python, batch, warmup, runs, threads, any_train, any_infer, torch);
      run_torch(malloc_keep_env, python, batch, warmup, runs, threads, any_train, any_infer, torch);
      for (int k = 0; k < 4; k++) {
        const double *t = torch[all[k].train ? 0 : 1];
        int b = 0; /* the fastest of PyTorch's variants is the peer */
        for (int v = 1; v < TORCH_VARIANTS; v++)
          if (t[v] > t[b]) b = v;
        double best = t[b];
        if (all[k].ips <= 0 || best <= 0) continue;
        double goal = all[k].staged ? 1.3 : 0.9;
        printf("ratio kiln %-12s / torch (%s): %.2f  (goal >= %.1f)\n", all[k].name, torch_variant_names[b],
               all[k].ips / best, goal);
        char key[96];
        snprintf(key, sizeof key, "resnet.b%lld.%s.ratio", (long long)batch, all[k].name);
        bench_figure(key, all[k].ips / best, "x");
      }
    }
  }
  kiln_release(x);
  kiln_release(labels);
  resnet_free(m);
  return failed;
}
