/* bench_tape.c — what autodiff costs per op: nanoseconds per 1-element f32
 * kiln_mul with no tape (the eager path pays one branch for autodiff), with
 * an active tape watching the input (the record cost is the difference),
 * and per node of the backward walk (the gradient of a chain of muls). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"

#include <stdlib.h>
#include <time.h>

enum { RUNS = 11, OPS = 1000, SCOPES = 20, CHAIN = 1000 };

/* ns per mul(x, c) over SCOPES x (push, OPS muls, pop). With a tape, one
 * tape per scope watches x and records the OPS muls; it is begun before
 * and freed after the timed part, so only recording is measured. */
static double ns_per_mul(kiln_tensor *x, kiln_tensor *c, bool taped) {
  double ns[RUNS];
  for (int r = -1; r < RUNS; r++) { /* run -1 warms up the allocator's caches */
    double total = 0;
    for (int s = 0; s < SCOPES; s++) {
      kiln_tape *tape = NULL;
      if (taped) {
        tape = kiln_tape_begin(false);
        kiln_tape_watch(tape, x);
      }
      kiln_scope_push();
      double t0 = now_ns();
      for (int i = 0; i < OPS; i++) kiln_mul(x, c);
      total += now_ns() - t0;
      kiln_scope_pop();
      kiln_tape_free(tape);
    }
    if (r >= 0) ns[r] = total / (SCOPES * OPS);
  }
  return median(ns, RUNS);
}

/* ns per node of one kiln_tape_gradient through y = x c c ... c (CHAIN
 * muls): each step runs the mul rule (one mul: c's side is not watched),
 * looks up and stores gradients, and releases them at the end. */
static double ns_per_backward_node(kiln_tensor *x, kiln_tensor *c) {
  double ns[RUNS];
  for (int r = -1; r < RUNS; r++) {
    kiln_scope_push();
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tensor *y = x;
    for (int i = 0; i < CHAIN; i++) y = kiln_mul(y, c);
    kiln_tape_end(tape);
    kiln_tensor *g = NULL;
    double t0 = now_ns();
    int rc = kiln_tape_gradient(tape, y, 1, &x, &g);
    double t = now_ns() - t0;
    kiln_tape_free(tape);
    kiln_scope_pop();
    if (rc) return -1;
    if (r >= 0) ns[r] = t / CHAIN;
  }
  return median(ns, RUNS);
}

int main(void) {
  kiln_tensor *x = kiln_fill(KILN_F32, KILN_SHAPE(1), 1.0);
  kiln_tensor *c = kiln_fill(KILN_F32, KILN_SHAPE(1), 1.0);
  kiln_tensor *check = kiln_mul(x, c);
  if (!check) {
    fprintf(stderr, "bench_tape: %s\n", kiln_last_error());
    return 1;
  }
  kiln_release(check);

  double plain = ns_per_mul(x, c, false), taped = ns_per_mul(x, c, true);
  double back = ns_per_backward_node(x, c);
  if (back < 0) {
    fprintf(stderr, "bench_tape: %s\n", kiln_last_error());
    return 1;
  }
  printf("tape: f32 mul, 1 element, no tape:            %7.1f ns/op\n", plain);
  printf("tape: f32 mul, 1 element, recorded on a tape: %7.1f ns/op (record cost %.1f ns/op)\n", taped,
         taped - plain);
  printf("tape: backward through a chain of %d muls:  %7.1f ns/node\n", CHAIN, back);
  printf("(medians of %d runs; %d ops per run; kiln %s)\n", RUNS, SCOPES * OPS, kiln_version());
  kiln_release(x);
  kiln_release(c);
  return 0;
}
