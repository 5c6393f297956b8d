/* bench_digits.c — the digits convnet's training step (examples/digits_model.h:
 * conv 3x3 1->32 SAME, relu, max pool 2x2, conv 3x3 32->64, relu, max pool,
 * dense 256->10, sparse softmax cross-entropy, tape gradient, Adam) in ms per
 * step at batch 64 and 256 on the first B training images:
 *   eager   op by op under a tape;
 *   staged  the step as one kiln_function (forward, gradient and update);
 * interleaved run by run from the same weights (their losses at the end
 * agree), medians of --runs runs of --steps steps after a warm-up; and the
 * staged step's compile time (its first call: trace, passes, LLVM; the disk
 * cache off, so cold). Then bench/digits_torch.py, PyTorch 1.13's eager
 * step on the same model and data (NCHW and channels_last), runs in a child
 * with Kiln's thread count, and the ratios are printed.
 *
 *   build/bench_digits [--runs R] [--steps S] [--batches 64,256] [--no-torch]
 *
 * Prints "@ digits.bB.{eager,staged} MS ms/step", "@ digits.bB.compile MS ms"
 * and the peer's "@ digits.bB.torch[-cl] MS ms/step". */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, setenv, popen */
#include <kiln.h>

#include "../examples/digits_data.h"
#include "../examples/digits_model.h"
#include "bench_util.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef DIGITS_TORCH_PY
#define DIGITS_TORCH_PY "bench/digits_torch.py"
#endif

enum { MAX_RUNS = 99, MAX_BATCHES = 8 };

typedef struct {
  digits_model m;
  kiln_optimizer *opt;
} trainer;

static int staged_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  trainer *t = user;
  return digits_train_step(&t->m, t->opt, in[0], in[1], &out[0]);
}

/* One step, eager (f NULL) or staged; *loss (when not NULL) the loss. */
static int step(kiln_function *f, trainer *t, kiln_tensor *const *in, double *loss) {
  kiln_scope_push();
  kiln_tensor *l = NULL;
  int rc = f ? kiln_function_call(f, in, &l) : digits_train_step(&t->m, t->opt, in[0], in[1], &l);
  if (!rc && loss) *loss = kiln_tensor_item(l);
  kiln_scope_pop();
  return rc;
}

static int trainer_init(trainer *t) {
  memset(t, 0, sizeof *t);
  kiln_random_seed(42);
  t->opt = digits_optimizer_new();
  return digits_model_init(&t->m) || !t->opt ? -1 : 0;
}

static void trainer_free(trainer *t) {
  digits_model_free(&t->m);
  kiln_optimizer_free(t->opt);
}

typedef struct {
  int64_t batch;
  double eager, staged, compile; /* ms */
} result;

static int bench(int64_t batch, kiln_tensor *x_all, kiln_tensor *y_all, int runs, int steps, result *res) {
  const int64_t xb[4] = {0, 0, 0, 0}, xn[4] = {batch, -1, -1, -1}, yb[1] = {0}, yn[1] = {batch};
  kiln_tensor *in[2] = {kiln_slice(x_all, xb, xn), kiln_slice(y_all, yb, yn)};
  trainer te, ts;
  int rc = in[0] && in[1] && !trainer_init(&te) && !trainer_init(&ts) ? 0 : -1;
  kiln_function *f = rc ? NULL : kiln_function_new("digits_step", staged_body, &ts, 2, 1);
  if (!f) rc = -1;
  double loss0_e = 0, loss0_s = 0, loss_e = 0, loss_s = 0, te_ms[MAX_RUNS], ts_ms[MAX_RUNS];
  double t0 = now_ns();
  if (!rc) rc = step(f, &ts, in, &loss0_s); /* trace, passes, compile */
  double first_ms = (now_ns() - t0) / 1e6;
  if (!rc) rc = step(NULL, &te, in, &loss0_e); /* the eager warm-up */
  for (int r = 0; r < runs && !rc; r++) {
    t0 = now_ns();
    for (int i = 0; i < steps && !rc; i++) rc = step(NULL, &te, in, i == steps - 1 ? &loss_e : NULL);
    double t1 = now_ns();
    for (int i = 0; i < steps && !rc; i++) rc = step(f, &ts, in, i == steps - 1 ? &loss_s : NULL);
    te_ms[r] = (t1 - t0) / 1e6 / steps;
    ts_ms[r] = (now_ns() - t1) / 1e6 / steps;
  }
  kiln_stats st = {0};
  if (!rc && kiln_function_stats(f, 0, &st)) rc = -1;
  if (rc) {
    fprintf(stderr, "bench_digits: batch %lld: %s\n", (long long)batch, kiln_last_error());
  } else {
    res->batch = batch;
    res->eager = median(te_ms, runs);
    res->staged = median(ts_ms, runs);
    res->compile = first_ms;
    printf("digits cnn batch %3lld  eager    %8.3f ms/step  staged %8.3f ms/step  (%.2fx; medians of %d runs x %d "
           "steps; staged min %.3f max %.3f)\n",
           (long long)batch, res->eager, res->staged, res->eager / res->staged, runs, steps, ts_ms[0],
           ts_ms[runs - 1]);
    printf("  losses eager %.4f -> %.4f, staged %.4f -> %.4f after %d steps%s\n", loss0_e, loss_e, loss0_s, loss_s,
           1 + runs * steps, fabs(loss_e - loss_s) <= 1e-3 * (1 + fabs(loss_e)) ? "" : "  (DISAGREE)");
    printf("  staged first call %.1f ms (cold, no disk cache): trace %.2f, passes %.2f, LLVM %.2f; ops %d traced -> "
           "%d optimized, %d kernels, arena %.0f KiB\n",
           first_ms, st.trace_ms, st.optimize_ms, st.compile_ms, st.traced_ops, st.optimized_ops, st.kernels,
           st.peak_bytes / 1024.0);
    char key[64];
    snprintf(key, sizeof key, "digits.b%lld.eager", (long long)batch);
    bench_figure(key, res->eager, "ms/step");
    snprintf(key, sizeof key, "digits.b%lld.staged", (long long)batch);
    bench_figure(key, res->staged, "ms/step");
    snprintf(key, sizeof key, "digits.b%lld.compile", (long long)batch);
    bench_figure(key, res->compile, "ms");
  }
  kiln_function_free(f);
  trainer_free(&te);
  trainer_free(&ts);
  return rc;
}

/* Runs the PyTorch peer, echoing its lines, and prints each of its figures
 * beside Kiln's. */
static void torch_peer(const char *batches, int runs, int steps, const result *res, int n_res) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' --batches %s --runs %d --steps %d --threads %d 2>&1",
           DIGITS_TORCH_PY, batches, runs, steps, kiln_num_threads());
  FILE *p = popen(cmd, "r");
  if (!p) {
    printf("torch peer: cannot run %s\n", cmd);
    return;
  }
  char line[1024];
  struct {
    long long batch;
    char impl[32];
    double ms;
  } peer[4 * MAX_BATCHES];
  int n = 0;
  while (fgets(line, sizeof line, p)) {
    fputs(line, stdout);
    long long b;
    char impl[32];
    double ms;
    if (n < 4 * MAX_BATCHES && sscanf(line, "@ digits.b%lld.%31s %lf", &b, impl, &ms) == 3) {
      peer[n].batch = b, peer[n].ms = ms;
      snprintf(peer[n].impl, sizeof peer[n].impl, "%s", impl);
      n++;
    }
  }
  int rc = pclose(p);
  if (rc) printf("torch peer exited with status %d\n", rc);
  for (int i = 0; i < n; i++)
    for (int k = 0; k < n_res; k++)
      if (res[k].batch == peer[i].batch)
        printf("batch %3lld: %-8s %8.3f ms/step  = %.2fx Kiln staged, %.2fx Kiln eager\n", peer[i].batch, peer[i].impl,
               peer[i].ms, peer[i].ms / res[k].staged, peer[i].ms / res[k].eager);
}

int main(int argc, char **argv) {
  int runs = 9, steps = 0;
  bool torch = true;
  const char *batches = "64,256";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--batches") && i + 1 < argc) batches = argv[++i];
    else if (!strcmp(argv[i], "--no-torch")) torch = false;
    else {
      fprintf(stderr, "usage: %s [--runs R] [--steps S] [--batches 64,256] [--no-torch]\n", argv[0]);
      return 2;
    }
  }
  if (runs < 1 || runs > MAX_RUNS || steps < 0) {
    fprintf(stderr, "bench_digits: --runs must be in [1, %d], --steps >= 0\n", MAX_RUNS);
    return 2;
  }
  setenv("KILN_CACHE_DIR", "off", 1); /* compile times are cold */
  kiln_scope_push();
  kiln_tensor *x = NULL, *y = NULL;
  if (digits_load(NULL, "train", &x, &y)) {
    fprintf(stderr, "bench_digits: %s\n", kiln_last_error());
    return 1;
  }
  printf("digits convnet training step, %d thread(s), Adam; data %s\n", kiln_num_threads(), digits_data_dir());
  result res[MAX_BATCHES];
  int n_res = 0, rc = 0;
  for (const char *p = batches; *p && n_res < MAX_BATCHES;) {
    char *end;
    long long b = strtoll(p, &end, 10);
    if (end == p || b < 1 || b > kiln_tensor_shape(x)[0]) {
      fprintf(stderr, "bench_digits: bad batch size in --batches %s\n", batches);
      return 2;
    }
    int s = steps ? steps : b <= 64 ? 20 : 10;
    if (bench(b, x, y, runs, s, &res[n_res]) == 0) n_res++;
    else rc = 1;
    p = *end == ',' ? end + 1 : end;
  }
  kiln_scope_pop();
  if (torch) torch_peer(batches, runs, steps, res, n_res);
  return rc;
}
