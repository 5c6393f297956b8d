/* data_parallel_model.h — the MLP examples/data_parallel.c trains across
 * processes, and its data-parallel step: each rank's gradient of the mean
 * loss on its shard, averaged over the world (kiln_dist_average_gradients)
 * before the update, so that N ranks on shards of a batch take the step
 * one process takes on the whole batch. Shared with tests/dist/dist_test.cc
 * and bench/bench_dist.c (it compiles as C11 and as C++).
 *
 *   x [B, in] -> dense hidden -> relu -> dense 10 -> softmax cross-entropy */
#ifndef KILN_EXAMPLES_DATA_PARALLEL_MODEL_H
#define KILN_EXAMPLES_DATA_PARALLEL_MODEL_H

#include <kiln.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

enum { DP_VARS = 4, DP_CLASSES = 10 };

typedef struct {
  kiln_variable *v[DP_VARS]; /* W1 [in, hidden], b1, W2 [hidden, 10], b2 */
} dp_mlp;

/* Variables from Kiln's generator as seeded now (He-normal weights, zero
   biases). 0, or -1 (dp_mlp_free frees what was made). */
static inline int dp_mlp_init(dp_mlp *m, int64_t in, int64_t hidden) {
  static const char *const names[DP_VARS] = {"W1", "b1", "W2", "b2"};
  const int64_t rows[DP_VARS] = {in, hidden, hidden, DP_CLASSES}, cols[DP_VARS] = {hidden, 0, DP_CLASSES, 0};
  int rc = 0;
  kiln_scope_push();
  for (int i = 0; i < DP_VARS; i++) {
    const int64_t shape[2] = {rows[i], cols[i]};
    kiln_tensor *init = cols[i] ? kiln_mul(kiln_random_normal(KILN_F32, 2, shape),
                                           kiln_scalar(KILN_F32, sqrt(2.0 / (double)rows[i])))
                                : kiln_zeros(KILN_F32, 1, &rows[i]);
    if (!(m->v[i] = kiln_variable_new(init, names[i]))) rc = -1;
  }
  kiln_scope_pop();
  return rc;
}

static inline void dp_mlp_free(dp_mlp *m) {
  for (int i = 0; i < DP_VARS; i++) kiln_variable_free(m->v[i]), m->v[i] = NULL;
}

static inline kiln_tensor *dp_mlp_logits(dp_mlp *m, kiln_tensor *x) {
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(x, kiln_variable_read(m->v[0])), kiln_variable_read(m->v[1])));
  return kiln_add(kiln_matmul(h, kiln_variable_read(m->v[2])), kiln_variable_read(m->v[3]));
}

/* One step on x [B, in] f32 and labels y [B] i64: *loss (this rank's mean
   loss before the update), the gradient, averaged across the world when
   average is set, and opt's update. Tensors land in the caller's scope.
   0, or -1 with Kiln's error set. */
static inline int dp_mlp_step(dp_mlp *m, kiln_optimizer *opt, kiln_tensor *x, kiln_tensor *y, bool average,
                              kiln_tensor **loss) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *l = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(y, dp_mlp_logits(m, x)), 0, NULL, false);
  kiln_tape_end(tape);
  kiln_tensor *grads[DP_VARS] = {0};
  int rc = tape && l ? 0 : -1;
  if (!rc) rc = kiln_tape_gradient_vars(tape, l, DP_VARS, m->v, grads);
  if (!rc && average) rc = kiln_dist_average_gradients(DP_VARS, grads);
  if (!rc) rc = kiln_optimizer_apply(opt, DP_VARS, m->v, grads);
  kiln_tape_free(tape);
  *loss = l;
  return rc;
}

/* FNV-1a of the variables' bytes: equal hashes, equal parameters */
static inline uint64_t dp_mlp_hash(dp_mlp *m) {
  uint64_t h = 14695981039346656037u;
  kiln_scope_push();
  for (int i = 0; i < DP_VARS; i++) {
    kiln_tensor *t = kiln_variable_read(m->v[i]);
    const unsigned char *p = (const unsigned char *)kiln_tensor_data(t);
    size_t bytes = t ? (size_t)kiln_tensor_size(t) * 4 : 0;
    for (size_t k = 0; p && k < bytes; k++) h = (h ^ p[k]) * 1099511628211u;
  }
  kiln_scope_pop();
  return h;
}

/* Do all ranks hold the same bits? (the hash's all_reduce max equals its
   min; both halves, as i64). 1 yes, 0 no, -1 error. */
static inline int dp_mlp_ranks_agree(dp_mlp *m) {
  uint64_t h = dp_mlp_hash(m);
  int64_t halves[2] = {(int64_t)(h >> 32), (int64_t)(h & 0xffffffffu)}, hi[2], lo[2];
  kiln_scope_push();
  kiln_tensor *t = kiln_tensor_new(KILN_I64, 1, (const int64_t[]){2}, halves);
  int rc = kiln_tensor_read(kiln_all_reduce(t, "max"), hi, sizeof hi) || kiln_tensor_read(kiln_all_reduce(t, "min"), lo, sizeof lo)
               ? -1
               : memcmp(hi, lo, sizeof hi) == 0;
  kiln_scope_pop();
  return rc;
}

#endif
