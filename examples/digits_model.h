/* digits_model.h — the convnet examples/digits_cnn.c trains on the digits
 * set, and its training step; bench/bench_digits.c times the same step and
 * tests/digits_cnn_test.cc checks it eager against staged (C11 and C++).
 *
 *   conv 3x3 (1 -> 32, SAME) -> relu -> max pool 2x2
 *   -> conv 3x3 (32 -> 64, SAME) -> relu -> max pool 2x2
 *   -> flatten (2*2*64 = 256) -> dense 10 -> softmax cross-entropy
 *
 * In digits_cnn's 20 epochs these reach 98.6-99.2% test accuracy over
 * eight seeds; half the channels (16, 32) 98.3-99.4%. */
#ifndef KILN_EXAMPLES_DIGITS_MODEL_H
#define KILN_EXAMPLES_DIGITS_MODEL_H

#include <kiln.h>

#include <math.h>

enum { DIGITS_VARS = 6, DIGITS_CLASSES = 10, DIGITS_FLAT = 2 * 2 * 64 };
static const char *const digits_var_names[DIGITS_VARS] = {"conv1/w", "conv1/b", "conv2/w",
                                                          "conv2/b", "dense/w", "dense/b"};
static const int digits_var_rank[DIGITS_VARS] = {4, 1, 4, 1, 2, 1};
static const int64_t digits_var_shape[DIGITS_VARS][4] = {
    {3, 3, 1, 32}, {32, 0, 0, 0}, {3, 3, 32, 64}, {64, 0, 0, 0}, {DIGITS_FLAT, DIGITS_CLASSES, 0, 0}, {DIGITS_CLASSES, 0, 0, 0}};
/* weights start He-normal (normal * sqrt(2 / fan in)); biases (0) at zero */
static const int64_t digits_var_fan_in[DIGITS_VARS] = {3 * 3 * 1, 0, 3 * 3 * 32, 0, DIGITS_FLAT, 0};

typedef struct {
  kiln_variable *v[DIGITS_VARS];
} digits_model;

/* The variables, from Kiln's random generator as seeded now. 0, or -1 (the
   variables made so far are set; digits_model_free frees them). */
static inline int digits_model_init(digits_model *m) {
  int rc = 0;
  kiln_scope_push();
  for (int i = 0; i < DIGITS_VARS; i++) {
    const int r = digits_var_rank[i];
    const int64_t *s = digits_var_shape[i];
    kiln_tensor *init = kiln_zeros(KILN_F32, r, s);
    if (digits_var_fan_in[i])
      init = kiln_mul(kiln_random_normal(KILN_F32, r, s),
                      kiln_scalar(KILN_F32, sqrt(2.0 / (double)digits_var_fan_in[i])));
    m->v[i] = kiln_variable_new(init, digits_var_names[i]);
    if (!m->v[i]) rc = -1;
  }
  kiln_scope_pop();
  return rc;
}

static inline void digits_model_free(digits_model *m) {
  for (int i = 0; i < DIGITS_VARS; i++) kiln_variable_free(m->v[i]), m->v[i] = NULL;
}

/* images [n, 8, 8, 1] f32 -> logits [n, 10] */
static inline kiln_tensor *digits_forward(digits_model *m, kiln_tensor *x) {
  kiln_conv_opts same = {{0, 0}, {0, 0}, {0, 0, 0, 0}, true, 0};
  kiln_conv_opts pool = {{2, 2}, {0, 0}, {0, 0, 0, 0}, false, 0};
  const int window[2] = {2, 2};
  kiln_tensor *h = kiln_conv2d(x, kiln_variable_read(m->v[0]), &same);
  h = kiln_relu(kiln_add(h, kiln_variable_read(m->v[1])));
  h = kiln_max_pool2d(h, window, &pool); /* [n, 4, 4, 32] */
  h = kiln_conv2d(h, kiln_variable_read(m->v[2]), &same);
  h = kiln_relu(kiln_add(h, kiln_variable_read(m->v[3])));
  h = kiln_max_pool2d(h, window, &pool); /* [n, 2, 2, 64] */
  h = kiln_reshape(h, KILN_SHAPE(-1, DIGITS_FLAT));
  return kiln_add(kiln_matmul(h, kiln_variable_read(m->v[4])), kiln_variable_read(m->v[5]));
}

/* One training step on images x [B, 8, 8, 1] f32 and labels y [B] i64: the
   mean cross-entropy (*loss, before the update) under a tape, its gradient
   w.r.t. the six variables and opt's update of them. Eagerly this runs op
   by op; as a kiln_function's body it traces into one staged step.
   0, or -1 with Kiln's error set. */
static inline int digits_train_step(digits_model *m, kiln_optimizer *opt, kiln_tensor *x, kiln_tensor *y,
                                    kiln_tensor **loss) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *l = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(y, digits_forward(m, x)), 0, NULL, false);
  kiln_tape_end(tape);
  kiln_tensor *grads[DIGITS_VARS] = {0};
  int rc = tape && l ? 0 : -1;
  if (!rc) rc = kiln_tape_gradient_vars(tape, l, DIGITS_VARS, m->v, grads);
  if (!rc) rc = kiln_optimizer_apply(opt, DIGITS_VARS, m->v, grads);
  kiln_tape_free(tape);
  *loss = l;
  return rc;
}

/* The optimizer digits_cnn trains with: Adam, learning rate 0.01. */
static inline kiln_optimizer *digits_optimizer_new(void) { return kiln_adam_new(0.01, 0.9, 0.999, 1e-7); }

#endif
