/* control.h — what control.c (kiln_cond, kiln_while_loop, kiln_scan) hands
 * control_grad.c to give a staged cond or scan a gradient. Internal. */
#ifndef KILN_CONTROL_H
#define KILN_CONTROL_H

#include "jit.h"

/* One staged cond or scan whose operands a tape watches. */
typedef struct cf_spec {
  op_id op;             /* OP_COND or OP_SCAN */
  int n_in;             /* explicit inputs of a region: cond n; scan carries + xs */
  int n_out;            /* the instruction's outputs: cond n_out; scan carries + ys (+ the stacked carries) */
  /* scan: n_ys counts the stacked carries (nc ys after the body's own) and
   * the stacked random draws (the last n_draws) */
  int nc, nx, n_ys, n_draws;
  int n_draws0;         /* cond: the last n_draws outputs are the then branch's n_draws0 draws, then the else's */
  int64_t len;
  bool reverse;
} cf_spec;

/* Records a tape node for each float output of the staged instruction.
 * regions are its traced regions (copied: the backward replays them, not
 * the C bodies, whose user data may be gone by then); head its operands
 * (cond: pred, inputs; scan: carries, xs) and env the environment's
 * operands (retained by the nodes); outs[0..s->n_out) its outputs, replaced
 * by the nodes' results. For a scan, stack[0..nc) holds each step's
 * incoming carries (stacked, nc outputs after the body's ys: they get nodes too, so
 * that a second derivative sees how they depend on the inputs), which the
 * backward scan reads; and when the body draws random numbers (its own
 * random ops', and the draws that conds and scans nested in it return),
 * the outputs after them are each draw, stacked, that the backward's replay
 * of a step uses instead of drawing again. 0 / -1. */
int cf_record_gradients(const cf_spec *s, const ir_func *const *regions, int n_head, kiln_tensor *const *head,
                        int n_env, kiln_tensor *const *env, kiln_tensor **outs, kiln_tensor *const *stack);

#endif
