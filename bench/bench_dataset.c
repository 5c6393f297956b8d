/* bench_dataset.c — input pipelines (issue 19, API.md §13).
 * overhead: us per batch of 64 of from_tensors + shuffle (buffer = the set)
 *   + batch 64 (+ repeat) over the digits training set (examples/data/, else
 *   a synthetic [1797, 8, 8, 1] f32 set with i64 labels), taken with
 *   kiln_dataset_next and released, beside a plain memcpy of the same rows
 *   (64 random rows of images and labels into a buffer) in the same run; and
 *   the same pipeline without the shuffle. Goal: pipeline <= copy + 2 us.
 * training: ms per step of bench_mlp's staged MLP 784-256-256-10 SGD step at
 *   batch 64, alone (on one batch made beforehand, and on the set's 64
 *   batches made beforehand, in turn: a cold batch each step as a pipeline
 *   gives, with nothing working beside the step) and fed from a synthetic
 *   [4096, 784] set through shuffle + batch + repeat, without a prefetch
 *   and with one of depth 2 and 8. Goal: prefetched = alone (on the batches
 *   made beforehand: what a loop without a pipeline would step over).
 * Runs alternate between the variants; medians of the runs. Prints
 * "@ dataset.KEY VALUE UNIT" lines. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, readlink */
#include <kiln.h>

#include "bench_util.h"
#include "mlp_model.h"
#include "../examples/digits_data.h"

#include <stdint.h>

/* short overhead runs: on a shared machine the median then falls among the
 * runs no other process interrupted */
enum { RUNS = 31, BATCHES = 200, TRAIN_RUNS = 15, STEPS = 40, B = 64, ROTATE = 64 }; /* ROTATE * B: the set */

static kiln_dataset *pipeline(kiln_tensor *x, kiln_tensor *y, bool shuffle, int prefetch) {
  kiln_tensor *ts[2] = {x, y};
  kiln_dataset *ds = kiln_dataset_from_tensors(2, ts);
  if (shuffle) ds = kiln_dataset_shuffle(ds, kiln_tensor_shape(x)[0], 1);
  ds = kiln_dataset_repeat(kiln_dataset_batch(ds, B, true), -1);
  if (prefetch) ds = kiln_dataset_prefetch(ds, prefetch);
  return ds;
}

/* ns per batch of n batches from ds; -1 on error */
static double time_pipeline(kiln_dataset *ds, int n) {
  double t0 = now_ns();
  for (int i = 0; i < n; i++) {
    kiln_scope_push();
    kiln_tensor *out[2];
    int rc = kiln_dataset_next(ds, 2, out);
    kiln_scope_pop();
    if (rc != 1) return -1;
  }
  return (now_ns() - t0) / n;
}

/* ns per batch of copying 64 rows picked by idx (row bytes rb, label 8) */
static double time_copy(const char *x, const int64_t *y, size_t rb, const int64_t *idx, int64_t rows, int n,
                        char *xb, int64_t *yb) {
  double t0 = now_ns();
  int64_t k = 0;
  for (int i = 0; i < n; i++)
    for (int j = 0; j < B; j++, k = k + 1 == rows ? 0 : k + 1) {
      memcpy(xb + (size_t)j * rb, x + (size_t)idx[k] * rb, rb);
      yb[j] = y[idx[k]];
    }
  double t = (now_ns() - t0) / n;
  static volatile int64_t sink; /* the copies are used */
  sink += yb[B - 1] + xb[0];
  return t;
}

static int bench_overhead(void) {
  kiln_tensor *x = NULL, *y = NULL;
  const char *source = "digits";
  if (digits_load(NULL, "train", &x, &y)) {
    source = "synthetic";
    kiln_clear_error();
    kiln_random_seed(3);
    x = kiln_random_uniform(KILN_F32, KILN_SHAPE(1797, 8, 8, 1), 0, 1);
    kiln_tensor *u = kiln_random_uniform(KILN_F64, KILN_SHAPE(1797), 0, 10);
    y = kiln_cast(u, KILN_I64);
    kiln_release(u);
  }
  if (!x || !y) return fprintf(stderr, "bench_dataset: %s\n", kiln_last_error()), 1;
  int64_t rows = kiln_tensor_shape(x)[0];
  size_t rb = (size_t)(kiln_tensor_size(x) / rows) * sizeof(float);
  int64_t *idx = malloc((size_t)rows * sizeof *idx);
  char *xb = malloc(B * rb);
  int64_t *yb = malloc(B * sizeof *yb);
  for (int64_t i = 0; i < rows; i++) idx[i] = i;
  srand(1);
  for (int64_t i = rows - 1; i > 0; i--) { /* Fisher-Yates */
    int64_t j = rand() % (i + 1), t = idx[i];
    idx[i] = idx[j];
    idx[j] = t;
  }
  kiln_dataset *shuffled = pipeline(x, y, true, 0), *plain = pipeline(x, y, false, 0);
  if (!shuffled || !plain) return fprintf(stderr, "bench_dataset: %s\n", kiln_last_error()), 1;
  double tp[RUNS], tn[RUNS], tc[RUNS];
  time_pipeline(shuffled, BATCHES); /* warm-up */
  time_pipeline(plain, BATCHES);
  time_copy(kiln_tensor_data(x), kiln_tensor_data(y), rb, idx, rows, BATCHES, xb, yb);
  for (int r = 0; r < RUNS; r++) {
    tp[r] = time_pipeline(shuffled, BATCHES);
    tn[r] = time_pipeline(plain, BATCHES);
    tc[r] = time_copy(kiln_tensor_data(x), kiln_tensor_data(y), rb, idx, rows, BATCHES, xb, yb);
    if (tp[r] < 0 || tn[r] < 0) return fprintf(stderr, "bench_dataset: %s\n", kiln_last_error()), 1;
  }
  double p = median(tp, RUNS) / 1e3, n = median(tn, RUNS) / 1e3, c = median(tc, RUNS) / 1e3;
  printf("overhead: %s set, %lld rows of %zu bytes + an i64 label; batch %d (%zu bytes), medians of %d runs of %d "
         "batches\n", source, (long long)rows, rb, B, B * (rb + 8), RUNS, BATCHES);
  printf("  from_tensors+shuffle+batch+repeat  %7.2f us/batch\n", p);
  printf("  from_tensors+batch+repeat          %7.2f us/batch\n", n);
  printf("  memcpy of the same rows            %7.2f us/batch\n", c);
  printf("  pipeline - copy                    %7.2f us/batch (goal <= 2)\n", p - c);
  bench_figure("dataset.shuffle_batch", p, "us");
  bench_figure("dataset.batch", n, "us");
  bench_figure("dataset.copy", c, "us");
  bench_figure("dataset.overhead", p - c, "us");
  kiln_dataset_free(shuffled);
  kiln_dataset_free(plain);
  kiln_release(x);
  kiln_release(y);
  free(idx);
  free(xb);
  free(yb);
  return 0;
}

typedef struct {
  kiln_variable *v[MLP_VARS];
  kiln_optimizer *sgd;
} model;

static int step_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  model *m = user;
  return mlp_train_step(m->v, m->sgd, in[0], in[1], &out[0]);
}

/* ms per step of STEPS steps, on the nb batches x[i % nb], y[i % nb] or
 * (ds non-NULL) on ds's batches; adds the ms per step spent in
 * kiln_dataset_next to *in_next */
static double time_steps(kiln_function *f, kiln_dataset *ds, kiln_tensor **x, kiln_tensor **y, int nb,
                         double *in_next) {
  double t0 = now_ns(), tn = 0;
  for (int i = 0; i < STEPS; i++) {
    kiln_scope_push();
    kiln_tensor *in[2] = {ds ? NULL : x[i % nb], ds ? NULL : y[i % nb]}, *loss = NULL;
    double t1 = now_ns();
    int rc = ds ? (kiln_dataset_next(ds, 2, in) == 1 ? 0 : -1) : 0;
    tn += now_ns() - t1;
    if (!rc) rc = kiln_function_call(f, in, &loss);
    kiln_scope_pop();
    if (rc) return -1;
  }
  if (in_next) *in_next = tn / STEPS / 1e6;
  return (now_ns() - t0) / STEPS / 1e6;
}

static int bench_training(void) {
  model m = {0};
  kiln_random_seed(42);
  for (int i = 0; i < MLP_VARS; i++) {
    kiln_scope_push();
    kiln_tensor *init = kiln_mul(kiln_random_normal(KILN_F32, mlp_shapes[i][1] ? 2 : 1, mlp_shapes[i]),
                                 kiln_scalar(KILN_F32, 0.05));
    m.v[i] = kiln_variable_new(init, mlp_names[i]);
    kiln_scope_pop();
  }
  m.sgd = kiln_sgd_new(0.01);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(4096, MLP_IN));
  kiln_tensor *u = kiln_random_uniform(KILN_F64, KILN_SHAPE(4096), 0, (double)MLP_OUT);
  kiln_tensor *y = kiln_cast(u, KILN_I64);
  kiln_release(u);
  kiln_function *f = kiln_function_new("mlp_step", step_body, &m, 2, 1);
  kiln_dataset *fed = pipeline(x, y, true, 0), *pre = pipeline(x, y, true, 2), *deep = pipeline(x, y, true, 8), *all = pipeline(x, y, false, 0);
  /* every batch of the set built before timing: the rotating control steps
   * over them in turn (a new, cold batch each step, as a pipeline gives,
   * with no pipeline working beside the step); the hot control reuses the
   * first one */
  kiln_tensor *bx[ROTATE] = {0}, *by[ROTATE] = {0};
  int nb = 0;
  for (kiln_tensor *b[2] = {0}; all && nb < ROTATE && kiln_dataset_next(all, 2, b) == 1; nb++) bx[nb] = b[0], by[nb] = b[1];
  if (!m.sgd || !f || !fed || !pre || !deep || !all || nb < ROTATE)
    return fprintf(stderr, "bench_dataset: %s\n", kiln_last_error()), 1;
  kiln_dataset_free(all);
  double ta[TRAIN_RUNS], tr[TRAIN_RUNS], tf[TRAIN_RUNS], tp[TRAIN_RUNS], td[TRAIN_RUNS], nf[TRAIN_RUNS],
      np[TRAIN_RUNS], nd[TRAIN_RUNS];
  if (time_steps(f, NULL, bx, by, 1, NULL) < 0 || time_steps(f, NULL, bx, by, ROTATE, NULL) < 0 ||
      time_steps(f, fed, NULL, NULL, 0, NULL) < 0 || time_steps(f, pre, NULL, NULL, 0, NULL) < 0 ||
      time_steps(f, deep, NULL, NULL, 0, NULL) < 0)
    return fprintf(stderr, "bench_dataset: %s\n", kiln_last_error()), 1;
  for (int r = 0; r < TRAIN_RUNS; r++) {
    ta[r] = time_steps(f, NULL, bx, by, 1, NULL);
    tr[r] = time_steps(f, NULL, bx, by, ROTATE, NULL);
    tf[r] = time_steps(f, fed, NULL, NULL, 0, &nf[r]);
    tp[r] = time_steps(f, pre, NULL, NULL, 0, &np[r]);
    td[r] = time_steps(f, deep, NULL, NULL, 0, &nd[r]);
    if (ta[r] < 0 || tr[r] < 0 || tf[r] < 0 || tp[r] < 0 || td[r] < 0)
      return fprintf(stderr, "bench_dataset: %s\n", kiln_last_error()), 1;
  }
  double a = median(ta, TRAIN_RUNS), ro = median(tr, TRAIN_RUNS), fd = median(tf, TRAIN_RUNS),
         p = median(tp, TRAIN_RUNS), d = median(td, TRAIN_RUNS);
  printf("training: staged MLP 784-256-256-10 SGD step, batch %d, %d threads; medians of %d runs of %d steps\n", B,
         kiln_num_threads(), TRAIN_RUNS, STEPS);
  printf("  step alone, one hot batch           %7.3f ms\n", a);
  printf("  step alone, %d prebuilt batches in turn %7.3f ms  (x%.3f)\n", ROTATE, ro, ro / a);
  printf("  fed by shuffle+batch                %7.3f ms  (x%.3f; in next %.3f ms)\n", fd, fd / a,
         median(nf, TRAIN_RUNS));
  printf("  fed by shuffle+batch+prefetch(2)    %7.3f ms  (x%.3f, goal x1; x%.3f of the prebuilt; in next %.3f ms)\n",
         p, p / a, p / ro, median(np, TRAIN_RUNS));
  printf("  fed by shuffle+batch+prefetch(8)    %7.3f ms  (x%.3f, goal x1; x%.3f of the prebuilt; in next %.3f ms)\n",
         d, d / a, d / ro, median(nd, TRAIN_RUNS));
  bench_figure("dataset.step_alone", a, "ms");
  bench_figure("dataset.step_prebuilt", ro, "ms");
  bench_figure("dataset.step_fed", fd, "ms");
  bench_figure("dataset.step_prefetched", p, "ms");
  bench_figure("dataset.step_prefetched8", d, "ms");
  kiln_dataset_free(fed);
  kiln_dataset_free(pre);
  kiln_dataset_free(deep);
  kiln_function_free(f);
  for (int i = 0; i < nb; i++) kiln_release(bx[i]), kiln_release(by[i]);
  kiln_release(x);
  kiln_release(y);
  for (int i = 0; i < MLP_VARS; i++) kiln_variable_free(m.v[i]);
  kiln_optimizer_free(m.sgd);
  return 0;
}

int main(int argc, char **argv) {
  bool train = !(argc > 1 && !strcmp(argv[1], "overhead"));
  bool over = !(argc > 1 && !strcmp(argv[1], "training"));
  int rc = over ? bench_overhead() : 0;
  if (!rc && train) rc = bench_training();
  return rc;
}
