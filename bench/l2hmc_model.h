/* l2hmc_model.h — the L2HMC-like sampler step that bench_l2hmc.c times and
 * bench_passes.c stages: LEAPFROGS leapfrog steps on positions x and momenta
 * p under an energy U(x) = 0.5*|y|^2, y = tanh(x W1 + b1) W2 + b2 (a 2-10-2
 * tanh MLP), whose gradient dU/dx a gradient tape takes in every half step. */
#ifndef KILN_BENCH_L2HMC_MODEL_H
#define KILN_BENCH_L2HMC_MODEL_H

#include <kiln.h>

enum { L2HMC_BATCH = 200, L2HMC_DIM = 2, L2HMC_HID = 10, LEAPFROGS = 10 };

typedef struct {
  kiln_tensor *w1, *b1, *w2, *b2; /* captured by the staged step */
} energy;

/* dU/dx at x, by a tape */
static inline kiln_tensor *grad_energy(energy *e, kiln_tensor *x) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(x, e->w1), e->b1));
  kiln_tensor *y = kiln_add(kiln_matmul(h, e->w2), e->b2);
  kiln_tensor *u = kiln_mul(kiln_reduce_sum(kiln_mul(y, y), 0, NULL, false), kiln_scalar(KILN_F32, 0.5));
  kiln_tape_end(tape);
  kiln_tensor *g = NULL;
  if (u && tape) kiln_tape_gradient(tape, u, 1, &x, &g);
  kiln_tape_free(tape);
  return g;
}

/* a kiln_function body: user = energy, in = x, p; out = x', p' after
 * LEAPFROGS leapfrog steps of size eps = 0.1 */
static inline int sample_step(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  energy *e = user;
  kiln_tensor *x = in[0], *p = in[1], *half = kiln_scalar(KILN_F32, 0.05), *eps = kiln_scalar(KILN_F32, 0.1);
  for (int s = 0; s < LEAPFROGS; s++) {
    p = kiln_sub(p, kiln_mul(half, grad_energy(e, x)));
    x = kiln_add(x, kiln_mul(eps, p));
    p = kiln_sub(p, kiln_mul(half, grad_energy(e, x)));
  }
  out[0] = x;
  out[1] = p;
  return x && p ? 0 : -1;
}

#endif
