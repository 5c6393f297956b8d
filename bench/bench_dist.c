/* bench_dist.c — distribution (API.md §12) on this machine:
 *
 *   mpirun --oversubscribe -np 2 ./bench_dist     (and ./bench_dist: one process)
 *
 * 1. all-reduce bus bandwidth, 2(n-1)/n * bytes / time, of kiln_all_reduce
 *    ("sum", f32) for 4 KB to 64 MB beside a plain MPI_Allreduce loop in
 *    the same run, alternating, so both see the same noise: the median of
 *    the iterations, each timed on rank 0 between barriers;
 * 2. the data-parallel MLP step (784-256-10, batch 64 per rank, SGD,
 *    kiln_dist_average_gradients): median step time, and the share of it
 *    the ranks spend waiting in collectives (dist_wait_seconds);
 * 3. overlap (issue 18): a staged step of an all_reduce of a 4 MB gradient
 *    and an independent chain of 512x512 matmuls, median time with
 *    KILN_DIST_OVERLAP=1 (the matmuls run while the all_reduce is in
 *    flight on the communication thread) and =0 (one after the other),
 *    alternating step by step, beside each part alone. */
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../examples/data_parallel_model.h"
#include "bench_util.h"

#ifdef KILN_HAVE_MPI
#include <mpi.h>
#endif

double dist_wait_seconds(void); /* lib/dist_mpi.c (kiln_internal) */

static int rank, size;

/* Kiln's error, and this rank's exit (mpirun then ends the others) */
static void fail(void) {
  fprintf(stderr, "bench_dist: rank %d: %s\n", rank, kiln_last_error());
  exit(1);
}

#ifdef KILN_HAVE_MPI
static void bandwidth(void) {
  if (rank == 0)
    printf("all-reduce (sum, f32) on %d processes: bus bandwidth 2(n-1)/n * bytes / time, median;\n"
           "MPI in place (MPI_IN_PLACE) and out of place (send -> recv, kiln_all_reduce's meaning)\n"
           "  %9s %10s %10s %10s %9s %9s\n",
           size, "bytes", "Kiln GB/s", "MPI in", "MPI out", "in/Kiln", "out/Kiln");
  for (size_t bytes = 4096; bytes <= ((size_t)64 << 20); bytes *= 4) {
    int64_t n = (int64_t)(bytes / 4);
    int iters = bytes <= (1 << 20) ? 100 : bytes <= (16 << 20) ? 20 : 8;
    float *buf = malloc(bytes), *out = malloc(bytes);
    for (int64_t i = 0; i < n; i++) buf[i] = (float)(i % 7);
    kiln_tensor *t = kiln_tensor_new(KILN_F32, 1, &n, buf);
    double *tk = malloc(sizeof(double) * (size_t)iters), *tm = malloc(sizeof(double) * (size_t)iters),
           *to = malloc(sizeof(double) * (size_t)iters);
    memset(out, 0, bytes);
    for (int it = -2; it < iters; it++) { /* two warm-up rounds */
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = now_s();
      kiln_tensor *y = kiln_all_reduce(t, "sum");
      double t1 = now_s();
      if (!y) fail();
      kiln_release(y);
      MPI_Barrier(MPI_COMM_WORLD);
      double t2 = now_s();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double t3 = now_s();
      MPI_Barrier(MPI_COMM_WORLD);
      double t4 = now_s();
      MPI_Allreduce(buf, out, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      double t5 = now_s();
      if (it >= 0) tk[it] = t1 - t0, tm[it] = t3 - t2, to[it] = t5 - t4;
    }
    double bus = 2.0 * (size - 1) / size * (double)bytes;
    double k = median(tk, iters), m = median(tm, iters), o = median(to, iters);
    if (rank == 0) {
      printf("  %9zu %10.3f %10.3f %10.3f %9.2f %9.2f\n", bytes, bus / k * 1e-9, bus / m * 1e-9, bus / o * 1e-9,
             m / k, o / k);
      char key[64];
      snprintf(key, sizeof key, "dist.allreduce.np%d.%zu.ratio", size, bytes);
      bench_figure(key, m / k, "x");
      snprintf(key, sizeof key, "dist.allreduce.np%d.%zu.out_ratio", size, bytes);
      bench_figure(key, o / k, "x");
    }
    kiln_release(t);
    free(buf);
    free(out);
    free(tk);
    free(tm);
    free(to);
  }
}
#endif

static void training(void) {
  enum { BATCH = 64, IN = 784, HIDDEN = 256, WARMUP = 5, STEPS = 60 };
  kiln_random_seed(42);
  dp_mlp m;
  kiln_optimizer *sgd = kiln_sgd_new(0.05);
  if (dp_mlp_init(&m, IN, HIDDEN) || !sgd) fail();
  kiln_random_seed(100 + (uint64_t)rank); /* each rank its own shard */
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(BATCH, IN));
  kiln_tensor *y = kiln_cast(kiln_mul(kiln_random_uniform(KILN_F32, KILN_SHAPE(BATCH), 0, 1),
                                      kiln_scalar(KILN_F32, 9.99)), KILN_I64);
  double t[STEPS], waited = 0, total = 0;
  for (int s = -WARMUP; s < STEPS; s++) {
    kiln_scope_push();
    double w0 = dist_wait_seconds(), t0 = now_s();
    kiln_tensor *loss;
    if (dp_mlp_step(&m, sgd, x, y, true, &loss)) fail();
    double dt = now_s() - t0;
    if (s >= 0) t[s] = dt, total += dt, waited += dist_wait_seconds() - w0;
    kiln_scope_pop();
  }
  double med = median(t, STEPS);
  /* the ranks' largest share: a rank that waits for a slower one waits in the collective */
  double share = total > 0 ? waited / total : 0, worst = share;
  kiln_tensor *st = kiln_scalar(KILN_F64, share), *mx = kiln_all_reduce(st, "max");
  if (mx) worst = kiln_tensor_item(mx);
  kiln_release(st), kiln_release(mx);
  if (rank == 0) {
    printf("data-parallel MLP %d-%d-10, batch %d per rank, SGD + average_gradients, %d process%s:\n"
           "  %.3f ms/step (median of %d), %.1f%% of the step in collectives (the most of any rank)\n",
           IN, HIDDEN, BATCH, size, size == 1 ? "" : "es", med * 1e3, STEPS, 100 * worst);
    char key[64];
    snprintf(key, sizeof key, "dist.mlp_step.np%d", size);
    bench_figure(key, med * 1e3, "ms");
  }
  kiln_release(x), kiln_release(y);
  dp_mlp_free(&m);
  kiln_optimizer_free(sgd);
}

enum { OV_GRAD = 1 << 20, OV_N = 512 };
typedef struct {
  bool reduce;
  int matmuls;
} ov_step;

/* (g, w) -> (all_reduce(g), w . w . ... with tanh between): independent */
static int ov_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  const ov_step *o = user;
  out[0] = o->reduce ? kiln_all_reduce(in[0], "sum") : kiln_mul(in[0], kiln_scalar(KILN_F32, 2));
  kiln_tensor *m = in[1];
  for (int k = 0; k < o->matmuls; k++) m = kiln_tanh(kiln_matmul(m, in[1]));
  out[1] = m;
  return out[0] && out[1] ? 0 : -1;
}

static void overlap(void) {
  enum { WARMUP = 3, STEPS = 30, MATMULS = 2 };
  kiln_tensor *g = kiln_random_normal(KILN_F32, KILN_SHAPE(OV_GRAD));
  kiln_tensor *w = kiln_mul(kiln_random_normal(KILN_F32, KILN_SHAPE(OV_N, OV_N)), kiln_scalar(KILN_F32, 0.04));
  ov_step parts[3] = {{true, 0}, {false, MATMULS}, {true, MATMULS}};
  kiln_function *f[3];
  for (int k = 0; k < 3; k++)
    if (!(f[k] = kiln_function_new("overlap_step", ov_body, &parts[k], 2, 2))) fail();
  /* rows: the all_reduce alone, the matmuls alone, both overlapped, both one after the other */
  double t[4][STEPS];
  kiln_tensor *in[2] = {g, w};
  for (int s = -WARMUP; s < STEPS; s++)
    for (int row = 0; row < 4; row++) {
      setenv("KILN_DIST_OVERLAP", row == 3 ? "0" : "1", 1);
      kiln_scope_push();
      kiln_tensor *out[2];
#ifdef KILN_HAVE_MPI
      MPI_Barrier(MPI_COMM_WORLD);
#endif
      double t0 = now_s();
      if (kiln_function_call(f[row < 3 ? row : 2], in, out)) fail();
      if (s >= 0) t[row][s] = now_s() - t0;
      kiln_scope_pop();
    }
  unsetenv("KILN_DIST_OVERLAP");
  if (rank == 0) {
    double med[4];
    for (int row = 0; row < 4; row++) med[row] = median(t[row], STEPS) * 1e3;
    printf("overlap: staged all_reduce of 4 MB f32 + %d independent %dx%d matmuls, %d process%s (median of %d):\n"
           "  all_reduce alone %.2f ms, matmuls alone %.2f ms; both: overlapped %.2f ms, one after the other "
           "%.2f ms (%.2fx)\n",
           MATMULS, OV_N, OV_N, size, size == 1 ? "" : "es", STEPS, med[0], med[1], med[2], med[3],
           med[2] > 0 ? med[3] / med[2] : 0);
    char key[64];
    snprintf(key, sizeof key, "dist.overlap.np%d", size);
    bench_figure(key, med[2], "ms");
    snprintf(key, sizeof key, "dist.no_overlap.np%d", size);
    bench_figure(key, med[3], "ms");
  }
  for (int k = 0; k < 3; k++) kiln_function_free(f[k]);
  kiln_release(g), kiln_release(w);
}

int main(void) {
  if (kiln_dist_init()) {
    fprintf(stderr, "bench_dist: %s\n", kiln_last_error());
    return 1;
  }
  rank = kiln_dist_rank();
  size = kiln_dist_size();
#ifdef KILN_HAVE_MPI
  if (size > 1) bandwidth();
#else
  printf("bench_dist: Kiln was built without MPI (libopenmpi-dev openmpi-bin): a world of one process\n");
#endif
  training();
  overlap();
  kiln_dist_finalize();
  return 0;
}
