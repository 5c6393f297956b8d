/* scan_kernel.c — a scan whose body is elementwise planned as one kernel
 * (plan_policy.scan_one_kernel): every value the loop carries or reads
 * per row has one shape, each element of it depends only on the same
 * element of the carries and rows (and on captures, read broadcast), so
 * the backend can loop over t inside the kernel, per element, its carries
 * in registers. The kernel is one of the backend's own (special = the
 * scan): its leaves the scan's operands, its outputs the scan's results. */
#include <stdlib.h>

#include "plan/build.h"

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int d = 0; d < a->rank; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

static bool elementwise(op_id op) {
  op_kind k = kiln_ops[op].kind;
  return k == OPK_UNARY || k == OPK_BINARY || k == OPK_COMPARE || k == OPK_SELECT || k == OPK_CONVERT;
}

/* Whether function c (the body, depth 0, or a fusion of it) is elementwise
 * over shape s given which of its parameters vary along the loop (varies,
 * per value: set for the rest here). A value that varies is of shape s and
 * made by an elementwise op (or a fusion) from values of shape s or that
 * do not vary; one that does not vary may be a constant, a view or a
 * broadcast (of captures, constants). A fusion's operands of another shape
 * are the body's own parameters (captures, read from memory). *budget
 * counts the instructions down. */
static bool check_func(const ir_func *c, bool *varies, const op_type *s, int depth, int *budget) {
  for (int i = 0; i < c->n_instrs; i++) {
    const ir_instr *in = &c->instrs[i];
    if (--*budget < 0) return false;
    bool v = false;
    for (int k = 0; k < in->n_in; k++) v = v || varies[in->in[k]];
    if (in->op == OP_FUSION) {
      const ir_func *cal = in->attrs.callee;
      if (depth > 0) return false;
      bool *cv = calloc((size_t)cal->n_values + 1, sizeof *cv);
      if (!cv) return false;
      bool ok = true;
      for (int k = 0; k < in->n_in && ok; k++) {
        cv[k] = varies[in->in[k]];
        ok = same_shape(&c->types[in->in[k]], s) || (!ir_def(c, in->in[k]) && !varies[in->in[k]]);
      }
      ok = ok && check_func(cal, cv, s, depth + 1, budget);
      for (int r = 0; r < in->n_out && ok; r++) {
        ok = same_shape(&c->types[in->out + r], s);
        varies[in->out + r] = cv[cal->results[r]];
      }
      free(cv);
      if (!ok) return false;
      continue;
    }
    op_kind kind = kiln_ops[in->op].kind;
    if (v) {
      if (!elementwise(in->op) || in->n_out != 1 || !same_shape(&c->types[in->out], s)) return false;
      for (int k = 0; k < in->n_in; k++)
        if (varies[in->in[k]] && !same_shape(&c->types[in->in[k]], s)) return false;
    } else if (!elementwise(in->op) && kind != OPK_CONST && kind != OPK_VIEW &&
               !(kind == OPK_MOVE && in->op != OP_CONCAT)) {
      return false;
    }
    for (int r = 0; r < in->n_out; r++) varies[in->out + r] = v;
  }
  return true;
}

bool plan_scan_elementwise(const ir_func *f, const ir_instr *in, int max_instrs) {
  (void)f;
  const ir_func *body = in->attrs.callee;
  int nc = in->attrs.n_state, nx = in->attrs.n_xs;
  if (in->op != OP_SCAN || nc < 1 || in->attrs.trip < 0) return false;
  const op_type *s = &body->types[0];
  for (int k = 0; k < nc + nx; k++)
    if (!same_shape(&body->types[k], s)) return false;
  for (int r = 0; r < body->n_results; r++)
    if (!same_shape(&body->types[body->results[r]], s)) return false;
  bool *varies = calloc((size_t)body->n_values + 1, sizeof *varies);
  if (!varies) return false;
  for (int k = 0; k < nc + nx; k++) varies[k] = true;
  int budget = max_instrs;
  bool ok = check_func(body, varies, s, 0, &budget);
  free(varies);
  return ok;
}

/* the constants of c and of its fusions, noted in the plan's list */
static int note_consts(plan *pl, const ir_func *c) {
  for (int i = 0; i < c->n_instrs; i++) {
    const ir_instr *in = &c->instrs[i];
    if (in->op == OP_CONSTANT && plan_note_const(pl, in->attrs.value)) return -1;
    if (in->op == OP_FUSION && note_consts(pl, in->attrs.callee)) return -1;
  }
  return 0;
}

int plan_scan_kernel(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top) {
  plan_kernel *g = plan_new_kernel(pl, f, in->n_out, in->op);
  if (!g) return -1;
  g->special = in;
  for (int k = 0; k < in->n_in; k++) g->leaf[in->in[k]] = vs[in->in[k]];
  if (note_consts(pl, in->attrs.callee)) return -1;
  for (int k = 0; k < in->n_out; k++) {
    int s = vs[in->out + k] = plan_value_slot(pl, f, in->out + k, top);
    if (s < 0) return -1;
    g = &pl->kernels[pl->n_kernels - 1];
    g->out[k] = in->out + k;
    g->out_slot[k] = s;
  }
  return plan_add_step(pl, (plan_step){.kind = PLAN_STEP_KERNEL, .index = pl->n_kernels - 1});
}
