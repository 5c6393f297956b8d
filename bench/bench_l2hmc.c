/* bench_l2hmc.c — an L2HMC-like sampler step: 10 leapfrog steps on a batch
 * of 200 2-d positions x and momenta p, under an energy U(x) = 0.5*|y|^2,
 * y = tanh(x W1 + b1) W2 + b2 (a 2-10-2 tanh MLP), whose gradient dU/dx is
 * taken by a gradient tape inside every half step (the model bench_passes.c
 * stages). ms per sample step (one call: 10 leapfrog steps, 20 gradients):
 *   staged  the step as one kiln_function (whatever kiln_function_call runs);
 *   eager   the same body run op by op;
 * medians of --runs runs of --steps calls; bench/l2hmc_torch.py is PyTorch
 * eager's peer (torch.autograd.grad in each half step). --dump FILE writes
 * W1 b1 W2 b2 x p (f32) for l2hmc_torch.py --init, so all three print the
 * same checksum of one sample step's result. "@ l2hmc.{staged,eager} MS ms"
 * lines (and the first call's compile ms) are for scripts/bench_issue6.sh. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"
#include "l2hmc_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BATCH = L2HMC_BATCH, DIM = L2HMC_DIM, HID = L2HMC_HID, MAX_RUNS = 99 };

/* one call of the staged (f) or eager (f NULL) step; *check = sum(x') + 2 sum(p') when not NULL */
static int call(kiln_function *f, energy *e, kiln_tensor *const *in, double *check) {
  kiln_scope_push();
  kiln_tensor *out[2] = {NULL, NULL};
  int rc = f ? kiln_function_call(f, in, out) : sample_step(e, 2, in, 2, out);
  if (!rc && check) {
    kiln_tensor *sx = kiln_reduce_sum(out[0], 0, NULL, false), *sp = kiln_reduce_sum(out[1], 0, NULL, false);
    if (sx && sp) *check = kiln_tensor_item(sx) + 2 * kiln_tensor_item(sp);
    else rc = -1;
  }
  kiln_scope_pop();
  return rc;
}

static kiln_tensor *normal(int rank, const int64_t *shape, double scale) {
  kiln_scope_push();
  kiln_tensor *t = kiln_scope_escape(kiln_mul(kiln_random_normal(KILN_F32, rank, shape), kiln_scalar(KILN_F32, scale)));
  kiln_scope_pop();
  return t;
}

static int write_tensor(FILE *f, const kiln_tensor *t) {
  size_t n = (size_t)kiln_tensor_size(t);
  return fwrite(kiln_tensor_data(t), sizeof(float), n, f) == n ? 0 : -1;
}

int main(int argc, char **argv) {
  int runs = 9, steps = 50;
  const char *dump = NULL;
  for (int i = 1; i < argc; i += 2) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v && !strcmp(a, "--runs")) runs = atoi(v);
    else if (v && !strcmp(a, "--steps")) steps = atoi(v);
    else if (v && !strcmp(a, "--dump")) dump = v;
    else runs = 0;
    if (runs < 1 || runs > MAX_RUNS || steps < 1) {
      fprintf(stderr, "usage: bench_l2hmc [--runs R (1..%d)] [--steps N] [--dump FILE]\n", MAX_RUNS);
      return 2;
    }
  }
  kiln_random_seed(5);
  energy e = {normal(KILN_SHAPE(DIM, HID), 0.5), normal(KILN_SHAPE(HID), 0.1), normal(KILN_SHAPE(HID, DIM), 0.5),
              normal(KILN_SHAPE(DIM), 0.1)};
  kiln_tensor *in[2] = {normal(KILN_SHAPE(BATCH, DIM), 1), normal(KILN_SHAPE(BATCH, DIM), 1)};
  if (!e.w1 || !e.b1 || !e.w2 || !e.b2 || !in[0] || !in[1]) {
    fprintf(stderr, "bench_l2hmc: %s\n", kiln_last_error());
    return 1;
  }
  if (dump) {
    FILE *f = fopen(dump, "wb");
    int rc = f ? 0 : -1;
    kiln_tensor *all[6] = {e.w1, e.b1, e.w2, e.b2, in[0], in[1]};
    for (int i = 0; !rc && i < 6; i++) rc = write_tensor(f, all[i]);
    if (f && fclose(f)) rc = -1;
    if (rc) {
      perror(dump);
      return 1;
    }
  }
  kiln_function *f = kiln_function_new("l2hmc_step", sample_step, &e, 2, 2);
  double check[2] = {0, 0}, t[2][MAX_RUNS], first_ms = 0;
  double t0 = now_s();
  int rc = call(f, &e, in, &check[0]); /* traces (and compiles) */
  first_ms = (now_s() - t0) * 1e3;
  if (!rc) rc = call(NULL, &e, in, &check[1]);
  for (int r = -1; !rc && r < runs; r++) { /* run -1 warms up; staged and eager alternate run by run */
    for (int k = 0; k < 2 && !rc; k++) {
      t0 = now_s();
      for (int i = 0; !rc && i < steps; i++) rc = call(k ? NULL : f, &e, in, NULL);
      if (r >= 0) t[k][r] = (now_s() - t0) / steps;
    }
  }
  if (rc) {
    fprintf(stderr, "bench_l2hmc: %s\n", kiln_last_error());
    return 1;
  }
  kiln_stats st = {0};
  kiln_function_stats(f, 0, &st);
  double ms_staged = median(t[0], runs) * 1e3, ms_eager = median(t[1], runs) * 1e3;
  printf("l2hmc sample step (%d leapfrogs, batch %d, 2-10-2 tanh energy, tape gradient): staged %.4f ms (%s)"
         "  eager %.4f ms  eager/staged %.1fx  (median of %d runs x %d steps)  check %.6f staged %.6f eager"
         "  [%d thread(s)]\n",
         LEAPFROGS, BATCH, ms_staged, st.compile_ms > 0 ? "compiled" : "interpreter?", ms_eager, ms_eager / ms_staged,
         runs, steps, check[0], check[1], kiln_num_threads());
  printf("  staged first call %.1f ms: trace %.2f ms, passes %.2f ms, compile %.2f ms; ops %d traced -> %d optimized,"
         " %d kernels\n",
         first_ms, st.trace_ms, st.optimize_ms, st.compile_ms, st.traced_ops, st.optimized_ops, st.kernels);
  bench_figure("l2hmc.staged", ms_staged, "ms");
  bench_figure("l2hmc.eager", ms_eager, "ms");
  bench_figure("l2hmc.first_call.compile", st.compile_ms, "ms");
  kiln_function_free(f);
  kiln_release(in[0]), kiln_release(in[1]);
  kiln_release(e.w1), kiln_release(e.b1), kiln_release(e.w2), kiln_release(e.b2);
  return fabs(check[0] - check[1]) <= 1e-3 * (1 + fabs(check[1])) ? 0 : (fprintf(stderr, "bench_l2hmc: staged and eager disagree\n"), 1);
}
