/* dce.c — dead code elimination: keeps only the instructions some result of
 * the function needs, plus those that must run anyway: random draws (they
 * advance the generator), host calls (a C callback's effects), calls and
 * control flow whose callee or regions have either, and any op this pass
 * does not know. One backward sweep marks what is needed; the new body
 * keeps it, in order.
 *
 * Control flow shrinks too (its regions were optimized first, see
 * manager.c): an unused result of a `cond` leaves both branches, an unused
 * y of a `scan` leaves its body, and so does loop state (a while's state, a
 * scan's carry) that nothing after the loop uses, the while's cond region
 * does not read, and the body needs for no state or y that stays; with
 * them goes the work only they needed; then an operand whose parameter no
 * region reads any more goes (a capture, a scan's xs, a cond's operand).
 * The instruction is rebuilt with new regions; pass_commit empties the old
 * ones. A control instruction with an effect and no used result stays as
 * it is. */
#include <stdlib.h>
#include <string.h>

#include "rewrite.h"

/* What a needed control instruction keeps. */
typedef struct ctl_plan {
  bool *keep_res; /* n_out: results (and region results) kept */
  bool *keep_op;  /* n_in: operands kept */
  bool changed;   /* drops something */
} ctl_plan;

static void plan_free(ctl_plan *p) {
  free(p->keep_res);
  free(p->keep_op);
  memset(p, 0, sizeof *p);
}

/* Which parameters of region g the results marked in keep (NULL = all)
 * read: ORed into used (g->n_params entries). 0 / -1. */
static int params_read(const ir_func *g, const bool *keep, bool *used) {
  bool *lv = calloc((size_t)g->n_values + 1, sizeof *lv);
  if (!lv) return kiln_set_error("dce: out of memory");
  int rc = pass_live(g, keep, lv, NULL);
  for (int j = 0; !rc && j < g->n_params; j++) used[j] |= lv[j];
  free(lv);
  return rc;
}

/* The plan of control instruction ins whose results marked in live are
 * used: which results and operands stay. A loop's state (a while's state,
 * a scan's carries) stays where it is used after the loop, read by a
 * while's cond region, or read by the body for state or ys that stay
 * (to a fixed point); the rest goes with its parameters and results.
 * 0 / -1. */
static int plan_control(const ir_instr *ins, const bool *live, ctl_plan *p) {
  int n = ins->n_in, no = ins->n_out, ns = ins->op == OP_COND ? 0 : ins->attrs.n_state;
  p->keep_res = calloc((size_t)no + 1, sizeof *p->keep_res);
  p->keep_op = calloc((size_t)n + 1, sizeof *p->keep_op);
  if (!p->keep_res || !p->keep_op) return kiln_set_error("dce: out of memory");
  int first = ins->op == OP_COND ? 1 : 0; /* operand j is parameter j - first */
  const ir_func *rg[2];
  int nr = ir_regions(ins, rg);
  bool *used = p->keep_op + first; /* parameters read, by index */
  for (int k = 0; k < no; k++) p->keep_res[k] = live[ins->out + k];
  if (ins->op == OP_WHILE && params_read(rg[0], NULL, used)) return -1;
  const ir_func *body = ins->op == OP_WHILE ? rg[1] : rg[0];
  int kept = 0;
  for (int pass = 0; pass < 2 && !kept; pass++) {
    if (pass) /* kept for an effect only: with all its state */
      for (int k = 0; k < ns; k++) p->keep_res[k] = true;
    for (bool grew = ns > 0; grew;) { /* the state the kept state and ys need */
      grew = false;
      for (int k = 0; k < ns; k++) p->keep_res[k] |= used[k];
      if (params_read(body, p->keep_res, used)) return -1;
      for (int k = 0; k < ns; k++) grew |= used[k] && !p->keep_res[k];
    }
    for (int k = 0; k < no; k++) kept += p->keep_res[k];
  }
  if (!kept) { /* kept for an effect only, and it has no state: as it is */
    for (int k = 0; k < no; k++) p->keep_res[k] = true;
    for (int j = 0; j < n; j++) p->keep_op[j] = true;
    return 0;
  }
  p->changed = kept < no;
  /* the parameters every region reads, given the results it keeps */
  for (int r = 0; r < nr; r++)
    if (params_read(rg[r], ins->op == OP_WHILE && r == 0 ? NULL : p->keep_res, used)) return -1;
  if (ins->op == OP_COND) p->keep_op[0] = true; /* the predicate */
  for (int k = 0; k < ns; k++) p->keep_op[k] = p->keep_res[k];
  for (int j = 0; j < n; j++)
    if (!p->keep_op[j]) p->changed = true;
  return 0;
}

/* ins rebuilt with the plan: new regions without the dropped parameters and
 * results, fewer operands; maps the kept results. 0 / -1. */
static int rebuild_control(pass_builder *b, const ir_instr *ins, const ctl_plan *p) {
  int n = ins->n_in, first = ins->op == OP_COND ? 1 : 0, rc = 0;
  bool *keep_param = calloc((size_t)n + 1, sizeof *keep_param);
  ir_value *x = malloc(((size_t)n + 1) * sizeof *x);
  if (!keep_param || !x) {
    free(keep_param);
    free(x);
    return kiln_set_error("dce: out of memory");
  }
  int nx = 0;
  for (int j = first; j < n; j++) keep_param[j - first] = p->keep_op[j];
  for (int j = 0; j < n; j++)
    if (p->keep_op[j]) x[nx++] = pass_map(b, ins->in[j]);
  op_attrs a = ins->attrs;
  if (ins->op != OP_COND) {
    a.n_state = 0;
    for (int j = 0; j < ins->attrs.n_state; j++) a.n_state += p->keep_op[j];
  }
  if (ins->op == OP_SCAN) {
    a.n_xs = 0;
    for (int j = ins->attrs.n_state; j < ins->attrs.n_state + ins->attrs.n_xs; j++) a.n_xs += p->keep_op[j];
  }
  const ir_func *rg[2];
  int nr = ir_regions(ins, rg);
  ir_func *nw[2] = {NULL, NULL};
  for (int r = 0; r < nr && !rc; r++) {
    const ir_func *g = rg[r];
    bool *live_ins = calloc((size_t)g->n_instrs + 1, sizeof *live_ins);
    const bool *keep_res = ins->op == OP_WHILE && r == 0 ? NULL : p->keep_res; /* a while's cond: its bool */
    if (!live_ins) rc = kiln_set_error("dce: out of memory");
    if (!rc) rc = pass_live(g, keep_res, NULL, live_ins);
    if (!rc && !(nw[r] = pass_region_rebuild(g, keep_param, 0, NULL, NULL, live_ins, keep_res))) rc = -1;
    free(live_ins);
  }
  if (!rc) {
    a.callee = nw[0];
    a.callee2 = nw[1];
    ir_value v = pass_emit(b, ins->op, &a, nx, x, ins->loc);
    if (v < 0) rc = -1;
    for (int k = 0, i = 0; k < ins->n_out && !rc; k++)
      if (p->keep_res[k]) rc = pass_replace(b, ins->out + k, v + i++, true);
  }
  free(keep_param);
  free(x);
  return rc;
}

int kiln_pass_dce(ir_func *f) {
  bool *live = calloc((size_t)f->n_values + 1, sizeof *live);
  bool *keep = calloc((size_t)f->n_instrs + 1, sizeof *keep);
  ctl_plan *plans = NULL;
  int n_plans = 0;
  int rc = 0, dead = 0, keep_funcs = f->module ? f->module->n_funcs : 0;
  bool shrinks = false;
  if (!live || !keep) {
    free(live);
    free(keep);
    return kiln_set_error("dce: out of memory");
  }
  for (int r = 0; r < f->n_results; r++) live[f->results[r]] = true;
  for (int i = f->n_instrs - 1; i >= 0 && !rc; i--) {
    const ir_instr *ins = &f->instrs[i];
    bool needed = pass_has_effect(ins);
    for (int k = 0; k < ins->n_out && !needed; k++) needed = live[ins->out + k];
    if (!needed) {
      dead++;
      continue;
    }
    keep[i] = true;
    if (pass_is_control(ins)) { /* (its results' liveness first: what it keeps) */
      if (!plans && !(plans = calloc((size_t)(n_plans = f->n_instrs), sizeof *plans))) {
        rc = kiln_set_error("dce: out of memory");
        break;
      }
      if ((rc = plan_control(ins, live, &plans[i]))) break;
      shrinks |= plans[i].changed;
      for (int k = 0; k < ins->n_in; k++)
        if (plans[i].keep_op[k]) live[ins->in[k]] = true;
      continue;
    }
    for (int k = 0; k < ins->n_out; k++) live[ins->out + k] = true;
    for (int k = 0; k < ins->n_in; k++) live[ins->in[k]] = true;
  }
  if (!rc && (dead || shrinks)) {
    pass_builder b;
    rc = pass_begin(&b, f);
    for (int i = 0; i < f->n_instrs && !rc; i++) {
      if (!keep[i]) continue;
      if (plans && plans[i].changed)
        rc = rebuild_control(&b, &f->instrs[i], &plans[i]);
      else
        rc = pass_copy(&b, &f->instrs[i]) < 0;
    }
    if (rc)
      pass_abort(&b);
    else
      rc = pass_commit(&b);
  }
  if (rc && f->module) ir_module_truncate(f->module, keep_funcs);
  for (int i = 0; plans && i < n_plans; i++) plan_free(&plans[i]); /* (the commit may have shrunk f) */
  free(plans);
  free(live);
  free(keep);
  return rc ? pass_fail("dce") : 0;
}
