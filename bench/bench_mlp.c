/* bench_mlp.c — one training step of an MLP 784-256-256-10 (relu, sparse
 * softmax cross-entropy, SGD lr 0.01) in ms per step at batch 64 and batch 1:
 *   kiln    eager, under a gradient tape, op by op;
 *   staged  the same step as one kiln_function (forward, tape gradient and the
 *           SGD variable updates traced into one body; whatever
 *           kiln_function_call runs: the interpreter, or compiled code);
 * both start from the same weights, so their losses at step N agree. Also the
 * staged step's first-call latency (trace, passes, compile: kiln_function_stats).
 * bench/mlp_torch.py times PyTorch's eager step (scripts/bench_mlp.sh and
 * scripts/bench_issue6.sh run the two alternately).
 *
 * --compile LABEL only measures the first call of a fresh staged step at
 * batch 64 and 1 and prints "@ mlp.compile.LABEL.bB.{trace,optimize,compile,
 * first_call} MS ms": scripts/bench_issue6.sh runs it as "cold" and then as
 * "warm" in a second process with the same KILN_CACHE_DIR. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"
#include "mlp_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { N_VARS = MLP_VARS, MAX_RUNS = 99, SANITY_STEPS = 300 };

typedef struct {
  kiln_variable *v[N_VARS]; /* W1 b1 W2 b2 W3 b3 */
  kiln_tensor *x, *y;
  kiln_optimizer *sgd;
} model;

/* One training step; *loss gets the loss before the update when not NULL. */
static int step(model *m, double *loss) {
  kiln_scope_push();
  kiln_tensor *l = NULL;
  int rc = mlp_train_step(m->v, m->sgd, m->x, m->y, &l);
  if (!rc && loss) *loss = kiln_tensor_item(l);
  kiln_scope_pop();
  return rc;
}

/* The same step as a staged function's body: forward, gradient and update
 * trace into one function (in = x, y; out = the loss). */
static int staged_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  model *m = user;
  return mlp_train_step(m->v, m->sgd, in[0], in[1], &out[0]);
}

static kiln_tensor *scaled_normal(int rank, const int64_t *shape) {
  kiln_scope_push();
  kiln_tensor *t = kiln_mul(kiln_random_normal(KILN_F32, rank, shape),
                            kiln_scalar(KILN_F32, 0.05));
  t = kiln_scope_escape(t);
  kiln_scope_pop();
  return t;
}

/* The same seed for every batch size: batch 1 is the first row of batch 64. */
static int model_init(model *m, int64_t batch, FILE *dump) {
  memset(m, 0, sizeof *m);
  kiln_random_seed(42);
  int rc = 0;
  for (int i = 0; i < N_VARS; i++) {
    kiln_tensor *init = scaled_normal(mlp_shapes[i][1] ? 2 : 1, mlp_shapes[i]);
    m->v[i] = kiln_variable_new(init, mlp_names[i]);
    if (init && dump) {
      size_t bytes = (size_t)kiln_tensor_size(init) * sizeof(float);
      const void *p = kiln_tensor_data(init);
      if (!p || fwrite(p, 1, bytes, dump) != bytes) rc = -1;
    }
    kiln_release(init);
    if (!m->v[i]) rc = -1;
  }
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(64, MLP_IN));
  kiln_tensor *u = kiln_random_uniform(KILN_F64, KILN_SHAPE(64), 0, (double)MLP_OUT);
  kiln_tensor *y = kiln_cast(u, KILN_I64);
  if (!x || !y) rc = -1;
  if (!rc && dump) {
    if (fwrite(kiln_tensor_data(x), sizeof(float), 64 * MLP_IN, dump) != (size_t)(64 * MLP_IN)) rc = -1;
    if (fwrite(kiln_tensor_data(y), sizeof(int64_t), 64, dump) != 64) rc = -1;
  }
  if (!rc) {
    m->x = kiln_slice(x, (const int64_t[]){0, 0}, (const int64_t[]){batch, -1});
    m->y = kiln_slice(y, (const int64_t[]){0}, (const int64_t[]){batch});
    /* own contiguous copies, so a step does not start from a view */
    if (m->x && m->y) {
      kiln_tensor *xc = kiln_tensor_new(KILN_F32, 2, (const int64_t[]){batch, MLP_IN},
                                         kiln_tensor_data(m->x));
      kiln_tensor *yc = kiln_tensor_new(KILN_I64, 1, &batch, kiln_tensor_data(m->y));
      kiln_release(m->x);
      kiln_release(m->y);
      m->x = xc;
      m->y = yc;
    }
    if (!m->x || !m->y) rc = -1;
  }
  kiln_release(x);
  kiln_release(u);
  kiln_release(y);
  m->sgd = kiln_sgd_new(0.01);
  if (!m->sgd) rc = -1;
  return rc;
}

static void model_free(model *m) {
  for (int i = 0; i < N_VARS; i++) kiln_variable_free(m->v[i]);
  kiln_release(m->x);
  kiln_release(m->y);
  kiln_optimizer_free(m->sgd);
}

static int staged_step(kiln_function *f, model *m, double *loss) {
  kiln_scope_push();
  kiln_tensor *in[2] = {m->x, m->y}, *l = NULL;
  int rc = kiln_function_call(f, in, &l);
  if (!rc && loss) *loss = kiln_tensor_item(l);
  kiln_scope_pop();
  return rc;
}

/* One step of the eager (f NULL) or the staged (f) version. */
static int any_step(kiln_function *f, model *m, double *loss) {
  return f ? staged_step(f, m, loss) : step(m, loss);
}

static const char *engine_of(kiln_function *f) {
  kiln_stats st = {0};
  if (kiln_function_stats(f, 0, &st)) return "?";
  return st.compile_ms > 0 ? "compiled" : "interpreter";
}

static int bench(int64_t batch, bool staged, int steps, int runs, int train) {
  model m;
  int rc = model_init(&m, batch, NULL);
  kiln_function *f = NULL;
  double loss0 = 0, loss = 0, t[MAX_RUNS], first_ms = 0;
  int done = 0;
  if (!rc && staged) {
    f = kiln_function_new("mlp_step", staged_body, &m, 2, 1);
    if (!f) rc = -1;
  }
  /* loss before any update (for staged: the first call, which traces), then
   * a warm-up (also fills the allocator's caches) */
  double t0 = now_s();
  if (!rc) rc = any_step(f, &m, &loss0);
  first_ms = (now_s() - t0) * 1e3;
  done++;
  for (int i = 0; !rc && i < steps; i++, done++) rc = any_step(f, &m, NULL);
  for (int r = 0; !rc && r < runs; r++) {
    t0 = now_s();
    for (int i = 0; !rc && i < steps; i++, done++) rc = any_step(f, &m, NULL);
    t[r] = (now_s() - t0) / steps;
  }
  while (!rc && done < train - 1) {
    rc = any_step(f, &m, NULL);
    done++;
  }
  if (!rc) rc = any_step(f, &m, &loss); /* loss after train-1 updates: compare with torch */
  done++;
  if (rc) {
    fprintf(stderr, "bench_mlp: %s batch %lld: %s\n", staged ? "staged" : "eager", (long long)batch,
            kiln_last_error());
    kiln_function_free(f);
    model_free(&m);
    return -1;
  }
  qsort(t, (size_t)runs, sizeof t[0], cmp_double);
  printf("mlp 784-256-256-10 batch %2lld  %-6s %8.4f ms/step  (median of %d runs x %d steps;"
         " min %.4f max %.4f)  loss %.6f -> %.6f at step %d  [%d thread(s)%s%s]\n",
         (long long)batch, staged ? "staged" : "kiln", t[runs / 2] * 1e3, runs, steps, t[0] * 1e3, t[runs - 1] * 1e3,
         loss0, loss, done - 1, kiln_num_threads(), staged ? ", " : "", staged ? engine_of(f) : "");
  if (staged) {
    kiln_stats st = {0};
    if (!kiln_function_stats(f, 0, &st))
      printf("  staged first call %.1f ms: trace %.2f ms, passes %.2f ms, compile %.2f ms; ops %d traced -> %d "
             "optimized, %d kernels, arena %.1f KiB\n",
             first_ms, st.trace_ms, st.optimize_ms, st.compile_ms, st.traced_ops, st.optimized_ops, st.kernels,
             st.peak_bytes / 1024.0);
    if (kiln_function_trace_count(f) != 1)
      printf("  (staged step traced %d times, expected once)\n", kiln_function_trace_count(f));
  }
  char key[64];
  snprintf(key, sizeof key, "mlp.b%lld.%s", (long long)batch, staged ? "staged" : "kiln");
  bench_figure(key, t[runs / 2] * 1e3, "ms/step");
  kiln_function_free(f);
  model_free(&m);
  return 0;
}

/* The first call of a fresh staged step: its wall time and kiln_function_stats. */
static int bench_compile(int64_t batch, const char *label) {
  model m;
  if (model_init(&m, batch, NULL)) return -1;
  kiln_function *f = kiln_function_new("mlp_step", staged_body, &m, 2, 1);
  double t0 = now_s();
  int rc = f ? staged_step(f, &m, NULL) : -1;
  double first_ms = (now_s() - t0) * 1e3;
  /* a second call: the cost of a step, to read the first call against */
  t0 = now_s();
  if (!rc) rc = staged_step(f, &m, NULL);
  double second_ms = (now_s() - t0) * 1e3;
  kiln_stats st = {0};
  if (!rc) rc = kiln_function_stats(f, 0, &st);
  if (rc) {
    fprintf(stderr, "bench_mlp: compile batch %lld: %s\n", (long long)batch, kiln_last_error());
  } else {
    printf("mlp step compile latency (%s) batch %2lld: first call %.2f ms (second %.3f ms) = trace %.2f + passes "
           "%.2f + compile %.2f ms (total %.2f ms) + the step; %s\n",
           label, (long long)batch, first_ms, second_ms, st.trace_ms, st.optimize_ms, st.compile_ms,
           st.trace_ms + st.optimize_ms + st.compile_ms, engine_of(f));
    const char *what[4] = {"trace", "optimize", "compile", "first_call"};
    double v[4] = {st.trace_ms, st.optimize_ms, st.compile_ms, first_ms};
    char key[96];
    for (int k = 0; k < 4; k++) {
      snprintf(key, sizeof key, "mlp.compile.%s.b%lld.%s", label, (long long)batch, what[k]);
      bench_figure(key, v[k], "ms");
    }
  }
  kiln_function_free(f);
  model_free(&m);
  return rc;
}

static void usage(void) {
  fprintf(stderr,
          "usage: bench_mlp [--steps N] [--runs R] [--batch B] [--train N] [--dump FILE] [--no-staged|--no-eager]\n"
          "       bench_mlp --compile LABEL [--batch B]\n"
          "  --steps N   timed steps per run (default: 50 at batch 64, 200 at batch 1)\n"
          "  --runs R    timed runs, median reported (default 9, 1..%d)\n"
          "  --batch B   only this batch size, 1..64 (default: 64 then 1)\n"
          "  --train N   the loss is printed at step N (default %d, at least every step run)\n"
          "  --dump FILE write the initial W1 b1 W2 b2 W3 b3 x[64,784] (f32) y[64] (i64)\n"
          "  --no-staged only the eager step; --no-eager only the staged one\n"
          "  --compile LABEL  only the staged step's first-call latency, keys mlp.compile.LABEL.*\n",
          MAX_RUNS, SANITY_STEPS);
}

int main(int argc, char **argv) {
  int steps = 0, runs = 9, train = SANITY_STEPS;
  long batch = 0;
  const char *dump_path = NULL, *compile_label = NULL;
  bool staged = true, eager = true;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--no-staged")) {
      staged = false;
      continue;
    }
    if (!strcmp(a, "--no-eager")) {
      eager = false;
      continue;
    }
    if (!v) {
      usage();
      return 2;
    }
    if (!strcmp(a, "--steps")) steps = atoi(v);
    else if (!strcmp(a, "--runs")) runs = atoi(v);
    else if (!strcmp(a, "--batch")) batch = atol(v);
    else if (!strcmp(a, "--train")) train = atoi(v);
    else if (!strcmp(a, "--dump")) dump_path = v;
    else if (!strcmp(a, "--compile")) compile_label = v;
    else {
      usage();
      return 2;
    }
    i++;
  }
  if (steps < 0 || runs < 1 || runs > MAX_RUNS || batch < 0 || batch > 64 || train < 1) {
    usage();
    return 2;
  }
  int rc = 0;
  if (dump_path) { /* mlp_torch.py --init FILE starts from the same numbers */
    FILE *dump = fopen(dump_path, "wb");
    if (!dump) {
      perror(dump_path);
      return 1;
    }
    model m = {0};
    if (model_init(&m, 64, dump)) rc = -1;
    if (fclose(dump)) rc = -1;
    model_free(&m);
    if (rc) {
      fprintf(stderr, "bench_mlp: could not write %s %s\n", dump_path, kiln_last_error());
      return 1;
    }
  }
  if (compile_label) {
    if (batch == 0 || batch == 64) rc |= bench_compile(64, compile_label);
    if (batch == 0 || batch == 1) rc |= bench_compile(1, compile_label);
    if (batch > 1 && batch != 64) rc |= bench_compile(batch, compile_label);
    return rc ? 1 : 0;
  }
  int64_t order[3] = {64, 1, batch > 1 && batch != 64 ? batch : 0};
  for (int k = 0; k < 3; k++) {
    int64_t b = order[k];
    if (!b || (batch && b != batch)) continue;
    int st = steps ? steps : b == 1 ? 200 : 50;
    if (eager) rc |= bench(b, false, st, runs, train);
    if (staged) rc |= bench(b, true, st, runs, train);
  }
  return rc ? 1 : 0;
}
