/* data_parallel.c — data-parallel training over MPI processes (API.md §12):
 *
 *   mpirun -np 2 ./data_parallel        (or ./data_parallel: a world of one)
 *
 * Every rank builds the same MLP (64-64-10) on the digits set, takes root's
 * values (kiln_dist_sync_variables), and trains on its own shard of each
 * batch of 64 images per rank: the mean loss of its shard, the gradient,
 * the world's average of the gradients (kiln_dist_average_gradients), one
 * SGD step. The ranks' parameters stay bit-identical; the program checks
 * it after every step and fails otherwise. Rank 0 prints the world's mean
 * loss and, at the end, the test accuracy. */
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>

#include "data_parallel_model.h"
#include "digits_data.h"

enum { BATCH_PER_RANK = 64, STEPS = 300, HIDDEN = 64 };

static int fail(const char *what) {
  fprintf(stderr, "data_parallel (rank %d): %s: %s\n", kiln_dist_rank(), what, kiln_last_error());
  return 1;
}

/* rows [begin, begin + n) of the images, flattened to [n, 64], and their labels */
static void rows(kiln_tensor *images, kiln_tensor *labels, int64_t begin, int64_t n, kiln_tensor **x,
                 kiln_tensor **y) {
  *x = kiln_reshape(kiln_slice(images, (const int64_t[]){begin, 0, 0, 0}, (const int64_t[]){n, -1, -1, -1}),
                    KILN_SHAPE(n, 64));
  *y = kiln_slice(labels, (const int64_t[]){begin}, (const int64_t[]){n});
}

static int train(void) {
  int rank = kiln_dist_rank(), size = kiln_dist_size();
  kiln_tensor *train_x = NULL, *train_y = NULL, *test_x = NULL, *test_y = NULL;
  if (digits_load(NULL, "train", &train_x, &train_y) || digits_load(NULL, "test", &test_x, &test_y)) {
    int rc = fail("loading the digits (scripts/make_digits.py writes examples/data/)");
    kiln_release(train_x), kiln_release(train_y), kiln_release(test_x), kiln_release(test_y);
    return rc;
  }
  int64_t n_train = kiln_tensor_shape(train_x)[0], global = (int64_t)BATCH_PER_RANK * size;
  if (rank == 0)
    printf("data_parallel: %d process%s, %d images each per step (a global batch of %lld), %lld training images\n",
           size, size == 1 ? "" : "es", BATCH_PER_RANK, (long long)global, (long long)n_train);
  /* a different seed on each rank: sync_variables makes rank 0's values everyone's */
  kiln_random_seed(1234 + (uint64_t)rank);
  dp_mlp m;
  kiln_optimizer *sgd = kiln_sgd_new(0.1);
  int rc = dp_mlp_init(&m, 64, HIDDEN) || !sgd ? fail("the model") : 0;
  if (!rc && kiln_dist_sync_variables(DP_VARS, m.v, 0)) rc = fail("sync_variables");
  if (!rc && dp_mlp_ranks_agree(&m) != 1) rc = fail("the ranks' parameters differ after sync_variables");
  for (int step = 0; !rc && step < STEPS; step++) {
    kiln_scope_push();
    int64_t start = (step * global) % (n_train - global + 1);
    kiln_tensor *x, *y, *loss;
    rows(train_x, train_y, start + (int64_t)rank * BATCH_PER_RANK, BATCH_PER_RANK, &x, &y);
    if (dp_mlp_step(&m, sgd, x, y, true, &loss)) {
      rc = fail("the training step");
    } else if (dp_mlp_ranks_agree(&m) != 1) {
      rc = fail("the ranks' parameters differ");
      fprintf(stderr, "data_parallel (rank %d): parameters differ across ranks after step %d\n", rank, step);
    } else if (step % 50 == 0 || step == STEPS - 1) {
      double world = kiln_tensor_item(kiln_all_reduce(loss, "mean"));
      if (rank == 0) printf("  step %3d: the world's mean loss %.4f\n", step, world);
    }
    kiln_scope_pop();
  }
  if (!rc) {
    kiln_scope_push();
    kiln_tensor *x, *y;
    int64_t n_test = kiln_tensor_shape(test_x)[0];
    rows(test_x, test_y, 0, n_test, &x, &y);
    kiln_tensor *hit = kiln_equal(kiln_argmax(dp_mlp_logits(&m, x), 1), y);
    double acc = kiln_tensor_item(kiln_reduce_mean(kiln_cast(hit, KILN_F64), 0, NULL, false));
    if (rank == 0) printf("test accuracy: %.2f%%; parameters bit-identical on every rank after every step\n", 100 * acc);
    if (acc < 0.9) {
      fprintf(stderr, "data_parallel: test accuracy %.2f%% is below 90%%\n", 100 * acc);
      rc = 1;
    }
    kiln_scope_pop();
  }
  dp_mlp_free(&m);
  kiln_optimizer_free(sgd);
  kiln_release(train_x), kiln_release(train_y), kiln_release(test_x), kiln_release(test_y);
  return rc;
}

int main(void) {
  if (kiln_dist_init()) return fail("dist_init");
  int rc = train();
  kiln_dist_finalize();
  if (!rc && kiln_debug_live_tensors() != 0) {
    fprintf(stderr, "data_parallel: %lld tensors still alive\n", (long long)kiln_debug_live_tensors());
    rc = 1;
  }
  return rc;
}
