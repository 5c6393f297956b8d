/* linear_regression.c — the TF eager guide's first training loop in Kiln:
 * fit y = W x + B to noisy samples of y = 3x + 2 with a gradient tape,
 * variables and SGD on the mean squared error, fed by an input pipeline
 * (the samples shuffled, in batches of 100, prepared by a background
 * thread), with the loss kept by a metric and written for TensorBoard.
 *
 * Each SGD step shrinks the expected distance to (3, 2) by about
 * 1 - 2 * 0.01, so from (5, 10) B is within 8 * 0.98^steps of 2: about 0.14
 * after 200 steps and 0.02 after 300, the guide's count (a batch's noise
 * adds a few hundredths). Pass the step count as argv[1]; the summaries go
 * to argv[2] (default runs/linear_regression; `tensorboard --logdir runs`). */
#include <kiln.h>
#include <stdio.h>
#include <stdlib.h>

enum { N = 1000, BATCH = 100, REPORT = 50 };

/* mean((W x + B - y)^2): the variables are read, so every active tape watches them */
static kiln_tensor *loss(kiln_variable *w, kiln_variable *b, kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *pred = kiln_add(kiln_mul(x, kiln_variable_read(w)), kiln_variable_read(b));
  return kiln_reduce_mean(kiln_square(kiln_sub(pred, y)), 0, NULL, false);
}

/* next, the stage just built on d; where it failed, d is freed (a stage
 * takes over its input only when it succeeds) and NULL returned, Kiln's
 * error saying why. */
static kiln_dataset *then(kiln_dataset *d, kiln_dataset *next) {
  if (!next) kiln_dataset_free(d);
  return next;
}

/* The (x, y) pairs, shuffled anew each pass, in batches, forever, two
 * batches ahead; NULL on error. */
static kiln_dataset *pipeline(kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *const pairs[2] = {x, y};
  kiln_dataset *d = kiln_dataset_from_tensors(2, pairs);
  d = then(d, kiln_dataset_shuffle(d, N, 7));
  d = then(d, kiln_dataset_batch(d, BATCH, false));
  d = then(d, kiln_dataset_repeat(d, -1));
  return then(d, kiln_dataset_prefetch(d, 2));
}

int main(int argc, char **argv) {
  int steps = argc > 1 ? atoi(argv[1]) : 300;
  const char *logdir = argc > 2 ? argv[2] : "runs/linear_regression";
  kiln_random_seed(42);
  kiln_scope_push();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(N));
  kiln_tensor *noise = kiln_random_normal(KILN_F32, KILN_SHAPE(N));
  kiln_tensor *y = kiln_add(kiln_add(kiln_mul(x, kiln_scalar(KILN_F32, 3)), kiln_scalar(KILN_F32, 2)), noise);

  kiln_variable *vars[2] = {kiln_variable_new(kiln_scalar(KILN_F32, 5), "W"),
                            kiln_variable_new(kiln_scalar(KILN_F32, 10), "B")};
  kiln_optimizer *sgd = kiln_sgd_new(0.01);
  kiln_dataset *data = y ? pipeline(x, y) : NULL;
  kiln_metric *mean_loss = kiln_metric_mean_new();
  kiln_summary_writer *log = kiln_summary_writer_new(logdir);
  int rc = vars[0] && vars[1] && sgd && data && mean_loss && log ? 0 : -1;
  if (rc == 0) printf("initial loss %.4f; summaries in %s\n", kiln_tensor_item(loss(vars[0], vars[1], x, y)), logdir);

  for (int step = 0; step < steps && rc == 0; step++) {
    kiln_scope_push(); /* this step's tensors die at its end */
    kiln_tensor *batch[2];
    rc = kiln_dataset_next(data, 2, batch) == 1 ? 0 : -1; /* repeated forever: never the end */
    kiln_tape *tape = rc == 0 ? kiln_tape_begin(false) : NULL;
    kiln_tensor *l = tape ? loss(vars[0], vars[1], batch[0], batch[1]) : NULL;
    kiln_tensor *grads[2];
    if (rc == 0) rc = kiln_tape_gradient_vars(tape, l, 2, vars, grads);
    kiln_tape_free(tape);
    if (rc == 0) rc = kiln_optimizer_apply(sgd, 2, vars, grads);
    if (rc == 0) rc = kiln_metric_update(mean_loss, l, NULL);
    if (rc == 0) rc = kiln_summary_scalar(log, "loss", kiln_tensor_item(l), step);
    if (rc == 0 && ((step + 1) % REPORT == 0 || step == steps - 1)) {
      double w = kiln_tensor_item(kiln_variable_read(vars[0])), b = kiln_tensor_item(kiln_variable_read(vars[1]));
      printf("step %3d  mean loss of the last %d batches %.4f  W %.4f  B %.4f\n", step + 1,
             (step % REPORT) + 1, kiln_metric_result(mean_loss), w, b);
      kiln_metric_reset(mean_loss);
      rc = kiln_summary_scalar(log, "W", w, step) || kiln_summary_scalar(log, "B", b, step) ? -1 : 0;
    }
    kiln_scope_pop();
  }
  if (rc == 0) rc = kiln_summary_flush(log);
  if (rc == 0)
    printf("after %d steps: W = %.4f (true 3), B = %.4f (true 2), loss on all %d samples %.4f\n", steps,
           kiln_tensor_item(kiln_variable_read(vars[0])), kiln_tensor_item(kiln_variable_read(vars[1])), N,
           kiln_tensor_item(loss(vars[0], vars[1], x, y)));
  else
    fprintf(stderr, "error: %s\n", kiln_last_error());

  kiln_summary_writer_free(log);
  kiln_metric_free(mean_loss);
  kiln_dataset_free(data);
  kiln_optimizer_free(sgd);
  kiln_variable_free(vars[0]);
  kiln_variable_free(vars[1]);
  kiln_scope_pop();
  return rc == 0 ? 0 : 1;
}
