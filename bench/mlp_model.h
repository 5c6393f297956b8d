/* mlp_model.h — the MLP 784-256-256-10 training step that bench_mlp.c (CPU,
 * eager and staged) and bench_gpu.c (staged on a GPU) time: relu layers,
 * sparse softmax cross-entropy, the gradient by a tape and an SGD update of
 * the six variables through kiln_optimizer_apply. */
#ifndef KILN_BENCH_MLP_MODEL_H
#define KILN_BENCH_MLP_MODEL_H

#include <kiln.h>

enum { MLP_VARS = 6 };
static const int64_t MLP_IN = 784, MLP_HID = 256, MLP_OUT = 10;
/* the variables: W1 b1 W2 b2 W3 b3 (a 0 second dim: a vector) */
static const char *const mlp_names[MLP_VARS] = {"W1", "b1", "W2", "b2", "W3", "b3"};
static const int64_t mlp_shapes[MLP_VARS][2] = {{784, 256}, {256, 0}, {256, 256}, {256, 0}, {256, 10}, {10, 0}};

static inline kiln_tensor *mlp_dense(kiln_tensor *h, kiln_variable *w, kiln_variable *b) {
  return kiln_add(kiln_matmul(h, kiln_variable_read(w)), kiln_variable_read(b));
}

/* One step on the batch x [B, 784] f32, y [B] i64: *loss gets the loss
 * before the update. 0, or -1 with Kiln's error set. */
static inline int mlp_train_step(kiln_variable *const *v, kiln_optimizer *sgd, kiln_tensor *x, kiln_tensor *y,
                                 kiln_tensor **loss) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *h = kiln_relu(mlp_dense(x, v[0], v[1]));
  h = kiln_relu(mlp_dense(h, v[2], v[3]));
  kiln_tensor *logits = mlp_dense(h, v[4], v[5]);
  kiln_tensor *l = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(y, logits), 0, NULL, false);
  kiln_tape_end(tape);
  kiln_tensor *grads[MLP_VARS] = {0};
  int rc = tape && l ? 0 : -1;
  if (!rc) rc = kiln_tape_gradient_vars(tape, l, MLP_VARS, v, grads);
  if (!rc) rc = kiln_optimizer_apply(sgd, MLP_VARS, v, grads);
  kiln_tape_free(tape);
  *loss = l;
  return rc;
}

#endif
