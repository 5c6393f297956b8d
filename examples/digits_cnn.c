/* digits_cnn.c — a small convolutional network on scikit-learn's digits set
 * (1437 training and 360 test images of 8x8 pixels, examples/data/), trained
 * with its whole training step staged: forward pass, tape gradient and Adam
 * update traced into one compiled function. It prints the test accuracy
 * (and fails below 98%), checkpoints the weights, restores them into fresh
 * variables and checks that the restored model scores the same.
 *
 *   ./build/digits_cnn [CHECKPOINT]     (default: a file under $TMPDIR or /tmp)
 *
 * The data folder is $KILN_DIGITS_DATA, else the source tree's examples/data. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, mkstemp */
#include <kiln.h>

#include "digits_data.h"
#include "digits_model.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The network, its variables and its training step (forward pass under a
 * tape, gradient, Adam update) are in digits_model.h, shared with the
 * benchmark and the tests:
 *   conv 3x3 (1 -> 32, SAME) -> relu -> max pool 2x2
 *   -> conv 3x3 (32 -> 64, SAME) -> relu -> max pool 2x2
 *   -> flatten -> dense 10 -> softmax cross-entropy */
enum { BATCH = 64, EPOCHS = 20 };

typedef struct {
  digits_model *m;
  kiln_optimizer *opt;
} trainer;

/* The training step, staged as one function: in = images [B, 8, 8, 1] and
 * labels [B]; out = the mean loss before the update. */
static int train_step(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  trainer *t = user;
  return digits_train_step(t->m, t->opt, in[0], in[1], &out[0]);
}

/* Inference, staged too: in = images, out = logits. */
static int predict(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  out[0] = digits_forward(user, in[0]);
  return out[0] ? 0 : -1;
}

/* The fraction of images whose arg-max logit is their label (-1 on error). */
static double accuracy(digits_model *m, kiln_tensor *images, kiln_tensor *labels) {
  kiln_function *f = kiln_function_new("digits_predict", predict, m, 1, 1);
  double acc = -1;
  kiln_scope_push();
  kiln_tensor *logits = NULL;
  if (f && kiln_function_call(f, &images, &logits) == 0) {
    kiln_tensor *hits = kiln_cast(kiln_equal(kiln_argmax(logits, 1), labels), KILN_F64);
    kiln_tensor *mean = kiln_reduce_mean(hits, 0, NULL, false);
    if (mean) acc = kiln_tensor_item(mean);
  }
  kiln_scope_pop();
  kiln_function_free(f);
  return acc;
}

/* A permutation of 0..n-1 from a small LCG (the same every run). */
static void shuffle(int64_t *idx, int64_t n, uint64_t *state) {
  for (int64_t i = n - 1; i > 0; i--) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    int64_t j = (int64_t)((*state >> 33) % (uint64_t)(i + 1));
    int64_t tmp = idx[i];
    idx[i] = idx[j];
    idx[j] = tmp;
  }
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int fail(const char *what) {
  fprintf(stderr, "digits_cnn: %s: %s\n", what, kiln_last_error());
  return 1;
}

static int run(const char *checkpoint) {
  kiln_tensor *train_x = NULL, *train_y = NULL, *test_x = NULL, *test_y = NULL;
  if (digits_load(NULL, "train", &train_x, &train_y) || digits_load(NULL, "test", &test_x, &test_y))
    return fail("loading the data (scripts/make_digits.py writes it)");
  const int64_t n_train = kiln_tensor_shape(train_x)[0];
  printf("digits: %lld training and %lld test images of 8x8, from %s\n", (long long)n_train,
         (long long)kiln_tensor_shape(test_x)[0], digits_data_dir());

  kiln_random_seed(1);
  digits_model m = {{0}};
  trainer t = {&m, digits_optimizer_new()};
  kiln_function *step = kiln_function_new("digits_train_step", train_step, &t, 2, 1);
  int64_t *idx = malloc((size_t)n_train * sizeof *idx);
  if (digits_model_init(&m) || !t.opt || !step || !idx) {
    free(idx);
    return fail("setting up");
  }
  for (int64_t i = 0; i < n_train; i++) idx[i] = i;

  /* EPOCHS passes over the shuffled training set in batches of BATCH (the
   * last partial batch of each epoch is dropped: one shape, one trace) */
  uint64_t rng = 2026;
  const int64_t steps_per_epoch = n_train / BATCH;
  double first_ms = 0, steps_ms = 0, loss = 0;
  int rc = 0;
  for (int epoch = 0; epoch < EPOCHS && !rc; epoch++) {
    shuffle(idx, n_train, &rng);
    double sum = 0;
    for (int64_t s = 0; s < steps_per_epoch && !rc; s++) {
      kiln_scope_push();
      kiln_tensor *batch_idx = kiln_tensor_new(KILN_I64, KILN_SHAPE(BATCH), idx + s * BATCH);
      kiln_tensor *in[2] = {kiln_gather(train_x, batch_idx, 0), kiln_gather(train_y, batch_idx, 0)};
      kiln_tensor *l = NULL;
      double t0 = now_ms();
      rc = in[0] && in[1] ? kiln_function_call(step, in, &l) : -1;
      double ms = now_ms() - t0;
      if (epoch == 0 && s == 0) first_ms = ms; /* trace, passes and compile */
      else steps_ms += ms;
      if (!rc) sum += kiln_tensor_item(l);
      kiln_scope_pop();
    }
    loss = sum / (double)steps_per_epoch;
    if (!rc && (epoch % 5 == 0 || epoch == EPOCHS - 1)) printf("  epoch %2d: mean loss %.4f\n", epoch + 1, loss);
  }
  free(idx);
  if (rc) return fail("training");

  const int total_steps = EPOCHS * (int)steps_per_epoch;
  kiln_stats st;
  if (kiln_function_stats(step, 0, &st) == 0)
    printf("staged training step (batch %d): %d ops traced, %d after the passes, %d kernels; first call %.0f ms "
           "(trace %.1f, passes %.1f, LLVM %.1f); then %.3f ms per step over %d steps\n",
           BATCH, st.traced_ops, st.optimized_ops, st.kernels, first_ms, st.trace_ms, st.optimize_ms, st.compile_ms,
           steps_ms / (total_steps - 1), total_steps - 1);
  printf("traces of the training step: %d\n", kiln_function_trace_count(step));

  double acc = accuracy(&m, test_x, test_y);
  if (acc < 0) return fail("evaluating");
  const int64_t n_test = kiln_tensor_shape(test_x)[0];
  printf("test accuracy: %.2f%% (%lld of %lld)\n", 100 * acc, (long long)llround(acc * (double)n_test),
         (long long)n_test);

  /* checkpoint, then the same numbers in fresh variables */
  if (kiln_checkpoint_save(checkpoint, DIGITS_VARS, m.v)) return fail("kiln_checkpoint_save");
  digits_model fresh = {{0}};
  kiln_random_seed(99); /* different initial values, so the restore has to work */
  if (digits_model_init(&fresh)) return fail("fresh variables");
  double before = accuracy(&fresh, test_x, test_y);
  if (kiln_checkpoint_restore(checkpoint, DIGITS_VARS, fresh.v)) {
    digits_model_free(&fresh);
    return fail("kiln_checkpoint_restore");
  }
  double restored = accuracy(&fresh, test_x, test_y);
  printf("checkpoint %s: a fresh model scores %.2f%%, restored from it %.2f%%\n", checkpoint, 100 * before,
         100 * restored);

  digits_model_free(&fresh);
  kiln_function_free(step);
  kiln_optimizer_free(t.opt);
  digits_model_free(&m);
  if (restored != acc) {
    fprintf(stderr, "digits_cnn: the restored model scores %.4f, the trained one %.4f\n", restored, acc);
    return 1;
  }
  if (acc < 0.98) {
    fprintf(stderr, "digits_cnn: test accuracy %.2f%% is below 98%%\n", 100 * acc);
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  if (argc > 2) {
    fprintf(stderr, "usage: %s [CHECKPOINT]\n", argv[0]);
    return 2;
  }
  char tmp[4096] = "";
  const char *checkpoint = argc == 2 ? argv[1] : NULL;
  if (!checkpoint) {
    const char *dir = getenv("TMPDIR");
    snprintf(tmp, sizeof tmp, "%s/digits_cnn_XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(tmp);
    if (fd < 0) {
      perror("digits_cnn: mkstemp");
      return 1;
    }
    close(fd);
    checkpoint = tmp;
  }
  kiln_scope_push();
  int rc = run(checkpoint);
  kiln_scope_pop();
  if (*tmp) remove(tmp);
  if (!rc && kiln_debug_live_tensors() != 0) {
    fprintf(stderr, "digits_cnn: %lld tensors still alive\n", (long long)kiln_debug_live_tensors());
    rc = 1;
  }
  return rc;
}
