/* bench_passes.c — what the pass pipeline makes of three staged programs:
 * an MLP 784-256-256-10 training step (forward, tape gradient, SGD), an LSTM
 * cell (batch 64, 128 -> 256) and an L2HMC-like leapfrog sampler step (10
 * leapfrog steps, batch 200, a 2-10-2 tanh MLP energy differentiated by a
 * tape). For each: ops before and after, kernels, fused ops, and the arena
 * (peak) against every temporary in its own buffer (unshared) and the
 * liveness lower bound (the goal is peak <= 1.1 x the lower bound). */
#include <kiln.h>
#include <stdio.h>
#include <stdlib.h>

#include "buffers.h"
#include "jit.h"
#include "l2hmc_model.h"

static kiln_tensor *normal(int rank, const int64_t *shape, double scale) {
  return kiln_mul(kiln_random_normal(KILN_F32, rank, shape), kiln_scalar(KILN_F32, scale));
}

/* ---- the MLP step ---- */
typedef struct {
  kiln_variable *v[6];
  kiln_optimizer *sgd;
} mlp;

static kiln_tensor *dense(kiln_tensor *h, kiln_variable *w, kiln_variable *b) {
  return kiln_add(kiln_matmul(h, kiln_variable_read(w)), kiln_variable_read(b));
}

static int mlp_step(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  mlp *m = user;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *h = kiln_relu(dense(in[0], m->v[0], m->v[1]));
  h = kiln_relu(dense(h, m->v[2], m->v[3]));
  kiln_tensor *l = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(in[1], dense(h, m->v[4], m->v[5])), 0,
                                    NULL, false);
  kiln_tape_end(tape);
  kiln_tensor *g[6] = {0};
  int rc = l ? kiln_tape_gradient_vars(tape, l, 6, m->v, g) : -1;
  if (!rc) rc = kiln_optimizer_apply(m->sgd, 6, m->v, g);
  kiln_tape_free(tape);
  out[0] = l;
  return rc;
}

/* ---- the LSTM cell: in = x, h, c; out = h', c' ---- */
typedef struct {
  kiln_tensor *wx, *wh, *b;
  int64_t hid;
} lstm;

static kiln_tensor *gate(kiln_tensor *z, int k, int64_t hid) {
  return kiln_slice(z, (const int64_t[]){0, k * hid}, (const int64_t[]){-1, hid});
}

static int lstm_cell(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  lstm *l = user;
  kiln_tensor *z = kiln_add(kiln_add(kiln_matmul(in[0], l->wx), kiln_matmul(in[1], l->wh)), l->b);
  kiln_tensor *i = kiln_sigmoid(gate(z, 0, l->hid)), *f = kiln_sigmoid(gate(z, 1, l->hid));
  kiln_tensor *g = kiln_tanh(gate(z, 2, l->hid)), *o = kiln_sigmoid(gate(z, 3, l->hid));
  out[1] = kiln_add(kiln_mul(f, in[2]), kiln_mul(i, g));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  return out[0] && out[1] ? 0 : -1;
}

static void report(const char *what, kiln_function *f) {
  kiln_stats st;
  pass_buffer_stats bs = {0};
  const ir_func *g = jit_optimized_func(f, 0);
  if (kiln_function_stats(f, 0, &st) || !g) {
    printf("%-8s %s\n", what, kiln_last_error());
    return;
  }
  bool plan = pass_buffer_stats_of(g, &bs) == 0;
  printf("%-8s ops %4d -> %4d  kernels %3d  fused ops %4d  trace %6.2f ms  passes %6.2f ms", what, st.traced_ops,
         st.optimized_ops, st.kernels, st.fused_ops, st.trace_ms, st.optimize_ms);
  if (plan)
    printf("  peak %8.1f KiB  unshared %8.1f KiB  lower bound %8.1f KiB  peak/bound %.3f\n", bs.peak_bytes / 1024.0,
           bs.unshared_bytes / 1024.0, bs.lower_bound / 1024.0,
           bs.lower_bound ? (double)bs.peak_bytes / (double)bs.lower_bound : 1.0);
  else
    printf("  (no buffer plan)\n");
}

int main(void) {
  kiln_random_seed(1);
  kiln_scope_push();
  /* MLP */
  static const int64_t shapes[6][2] = {{784, 256}, {256, 0}, {256, 256}, {256, 0}, {256, 10}, {10, 0}};
  mlp m = {.sgd = kiln_sgd_new(0.01)};
  for (int i = 0; i < 6; i++) m.v[i] = kiln_variable_new(normal(shapes[i][1] ? 2 : 1, shapes[i], 0.05), NULL);
  kiln_tensor *x = normal(2, (const int64_t[]){64, 784}, 1);
  kiln_tensor *y = kiln_cast(kiln_random_uniform(KILN_F64, KILN_SHAPE(64), 0, 10), KILN_I64);
  kiln_function *fm = kiln_function_new("mlp_step", mlp_step, &m, 2, 1);
  kiln_tensor *mi[2] = {x, y}, *mo[1];
  if (kiln_function_call(fm, mi, mo)) fprintf(stderr, "mlp: %s\n", kiln_last_error());
  report("mlp", fm);
  /* LSTM */
  lstm l = {normal(2, (const int64_t[]){128, 1024}, 0.05), normal(2, (const int64_t[]){256, 1024}, 0.05),
            normal(1, (const int64_t[]){1024}, 0.05), 256};
  kiln_function *fl = kiln_function_new("lstm_cell", lstm_cell, &l, 3, 2);
  kiln_tensor *li[3] = {normal(2, (const int64_t[]){64, 128}, 1), normal(2, (const int64_t[]){64, 256}, 1),
                        normal(2, (const int64_t[]){64, 256}, 1)},
              *lo[2];
  if (kiln_function_call(fl, li, lo)) fprintf(stderr, "lstm: %s\n", kiln_last_error());
  report("lstm", fl);
  /* L2HMC */
  energy e = {normal(2, (const int64_t[]){2, 10}, 0.5), normal(1, (const int64_t[]){10}, 0.1),
              normal(2, (const int64_t[]){10, 2}, 0.5), normal(1, (const int64_t[]){2}, 0.1)};
  kiln_function *fe = kiln_function_new("leapfrog", sample_step, &e, 2, 2);
  kiln_tensor *ei[2] = {normal(2, (const int64_t[]){200, 2}, 1), normal(2, (const int64_t[]){200, 2}, 1)}, *eo[2];
  if (kiln_function_call(fe, ei, eo)) fprintf(stderr, "l2hmc: %s\n", kiln_last_error());
  report("l2hmc", fe);
  kiln_function_free(fm);
  kiln_function_free(fl);
  kiln_function_free(fe);
  for (int i = 0; i < 6; i++) kiln_variable_free(m.v[i]);
  kiln_optimizer_free(m.sgd);
  kiln_scope_pop();
  return 0;
}
