/* digits_cnn.c — a small convolutional network on scikit-learn's digits set
 * (1437 training and 360 test images of 8x8 pixels, examples/data/), trained
 * with its whole training step staged: forward pass, tape gradient and Adam
 * update traced into one compiled function. An input pipeline feeds it
 * (the training set shuffled each epoch, in batches, prepared by a
 * background thread while the step runs); metrics keep the mean loss and
 * the test accuracy, printed each epoch and written for TensorBoard. It
 * prints the test accuracy (and fails below 98%), checkpoints the weights,
 * restores them into fresh variables and checks that the restored model
 * scores the same.
 *
 *   ./build/digits_cnn [CHECKPOINT [LOGDIR]]
 *     CHECKPOINT: default a file under $TMPDIR or /tmp
 *     LOGDIR: the summaries' folder, default runs/digits_cnn
 *             (tensorboard --logdir runs)
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

/* The fraction of images whose arg-max logit is their label, by the
 * accuracy metric (-1 on error). */
static double accuracy(digits_model *m, kiln_tensor *images, kiln_tensor *labels) {
  kiln_function *f = kiln_function_new("digits_predict", predict, m, 1, 1);
  kiln_metric *hits = kiln_metric_accuracy_new();
  double acc = -1;
  kiln_scope_push();
  kiln_tensor *logits = NULL;
  if (f && hits && kiln_function_call(f, &images, &logits) == 0 && kiln_metric_update(hits, labels, logits) == 0)
    acc = kiln_metric_result(hits);
  kiln_scope_pop();
  kiln_metric_free(hits);
  kiln_function_free(f);
  return acc;
}

/* next, the stage just built on d; where it failed, d is freed (a stage
 * takes over its input only when it succeeds) and NULL returned, Kiln's
 * error saying why. */
static kiln_dataset *then(kiln_dataset *d, kiln_dataset *next) {
  if (!next) kiln_dataset_free(d);
  return next;
}

/* The training pairs, shuffled anew each epoch, in batches of BATCH (the
 * last partial batch of each epoch dropped: one shape, one trace), for
 * EPOCHS epochs, two batches ahead on a background thread; NULL on error. */
static kiln_dataset *pipeline(kiln_tensor *images, kiln_tensor *labels) {
  kiln_tensor *const pairs[2] = {images, labels};
  kiln_dataset *d = kiln_dataset_from_tensors(2, pairs);
  d = then(d, kiln_dataset_shuffle(d, kiln_tensor_shape(images)[0], 2026));
  d = then(d, kiln_dataset_batch(d, BATCH, true));
  d = then(d, kiln_dataset_repeat(d, EPOCHS));
  return then(d, kiln_dataset_prefetch(d, 2));
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

static int run(const char *checkpoint, const char *logdir) {
  kiln_tensor *train_x = NULL, *train_y = NULL, *test_x = NULL, *test_y = NULL;
  if (digits_load(NULL, "train", &train_x, &train_y) || digits_load(NULL, "test", &test_x, &test_y))
    return fail("loading the data (scripts/make_digits.py writes it)");
  const int64_t n_train = kiln_tensor_shape(train_x)[0];
  printf("digits: %lld training and %lld test images of 8x8, from %s; summaries in %s\n", (long long)n_train,
         (long long)kiln_tensor_shape(test_x)[0], digits_data_dir(), logdir);

  kiln_random_seed(1);
  digits_model m = {{0}};
  trainer t = {&m, digits_optimizer_new()};
  kiln_function *step = kiln_function_new("digits_train_step", train_step, &t, 2, 1);
  kiln_dataset *data = pipeline(train_x, train_y);
  kiln_metric *mean_loss = kiln_metric_mean_new();
  kiln_summary_writer *log = kiln_summary_writer_new(logdir);
  int rc = digits_model_init(&m) || !t.opt || !step || !data || !mean_loss || !log ? -1 : 0;

  /* EPOCHS passes of steps_per_epoch batches, the step's first call
   * (trace, passes and compile) timed apart */
  const int64_t steps_per_epoch = n_train / BATCH;
  double first_ms = 0, steps_ms = 0;
  for (int epoch = 0; epoch < EPOCHS && !rc; epoch++) {
    double epoch_ms = 0;
    for (int64_t s = 0; s < steps_per_epoch && !rc; s++) {
      kiln_scope_push();
      kiln_tensor *in[2], *l = NULL;
      int got = kiln_dataset_next(data, 2, in);
      double t0 = now_ms();
      rc = got == 1 ? kiln_function_call(step, in, &l) : -1;
      double ms = now_ms() - t0;
      if (got == 0) kiln_fail("digits_cnn: the pipeline ended early");
      if (epoch == 0 && s == 0) first_ms = ms;
      else steps_ms += ms, epoch_ms += ms;
      if (!rc) rc = kiln_metric_update(mean_loss, l, NULL);
      kiln_scope_pop();
    }
    double acc = rc ? -1 : accuracy(&m, test_x, test_y), loss = kiln_metric_result(mean_loss);
    if (acc < 0) rc = -1;
    if (!rc) rc = kiln_summary_scalar(log, "loss", loss, epoch + 1) || kiln_summary_scalar(log, "test_accuracy", acc, epoch + 1) ||
                  kiln_summary_histogram(log, "dense/w", kiln_variable_read(m.v[4]), epoch + 1);
    if (!rc)
      printf("  epoch %2d/%d: mean loss %.4f, test accuracy %.2f%%, %.2f ms per step\n", epoch + 1, EPOCHS, loss,
             100 * acc, epoch_ms / (double)(steps_per_epoch - (epoch == 0)));
    kiln_metric_reset(mean_loss);
  }
  if (!rc) rc = kiln_summary_flush(log);
  kiln_summary_writer_free(log);
  kiln_metric_free(mean_loss);
  kiln_dataset_free(data);
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
  if (argc > 3) {
    fprintf(stderr, "usage: %s [CHECKPOINT [LOGDIR]]\n", argv[0]);
    return 2;
  }
  char tmp[4096] = "";
  const char *checkpoint = argc >= 2 ? argv[1] : NULL, *logdir = argc == 3 ? argv[2] : "runs/digits_cnn";
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
  int rc = run(checkpoint, logdir);
  kiln_scope_pop();
  if (*tmp) remove(tmp);
  if (!rc && kiln_debug_live_tensors() != 0) {
    fprintf(stderr, "digits_cnn: %lld tensors still alive\n", (long long)kiln_debug_live_tensors());
    rc = 1;
  }
  return rc;
}
