/* control.c — cond, while and scan as control steps (plan.h): each region
 * planned into a nested step list over the one plan's slots. The carried
 * state lives in the instruction's result slots (the buffers pass never
 * lets them share bytes with an operand: they are live together), copied
 * in once before the loop; the body reads it in place and its last steps
 * copy its new values back, but for those a kernel stores straight over
 * the state (carry.c); where the backend moves the state between buffers
 * (plan_policy.swap_state), none: the loop step lists the moves. A cond's
 * branches, and a scan body's ys, write their results straight into the
 * result slots (a row of the stacked ys per iteration), or copy them
 * there when another slot holds them. A scan of an elementwise body may
 * be one kernel instead (scan_kernel.c). */
#include <stdlib.h>
#include <string.h>

#include "plan/build.h"

/* A nested step list: region r (a function of the module) planned with
 * parameter slots ps into *steps (*n of them); rs gets the slot of each of
 * its results (malloc'd). dest (per result of r, or NULL): the slot each
 * result is to be made in, where a step makes it. */
static int plan_region(plan *pl, const ir_func *r, const int *ps, const int *dest, int depth, plan_step **steps,
                       int *n, int **rs) {
  plan_step *outer = pl->steps;
  int n_outer = pl->n_steps;
  const ir_func *outer_f = pl->dest_f;
  int *outer_dest = pl->dest;
  int *vs = malloc(((size_t)r->n_values + 1) * sizeof *vs);
  int *want = malloc(((size_t)r->n_values + 1) * sizeof *want);
  *rs = malloc(((size_t)r->n_results + 1) * sizeof **rs);
  if (!vs || !want || !*rs) {
    free(vs), free(want);
    return plan_oom(pl);
  }
  for (int v = 0; v < r->n_values; v++) want[v] = -1;
  for (int k = 0; dest && k < r->n_results; k++)
    if (want[r->results[k]] < 0 && ir_def(r, r->results[k])) want[r->results[k]] = dest[k];
  pl->steps = NULL, pl->n_steps = 0;
  pl->dest_f = r, pl->dest = want;
  int rc = plan_func_steps(pl, r, vs, ps, false, depth + 1);
  for (int k = 0; !rc && k < r->n_results; k++) (*rs)[k] = vs[r->results[k]];
  *steps = pl->steps, *n = pl->n_steps;
  pl->steps = outer, pl->n_steps = n_outer;
  pl->dest_f = outer_f, pl->dest = outer_dest;
  free(vs), free(want);
  return rc;
}

/* a copy step of t's bytes from slot src into slot dst, appended to
 * *steps (n of them) */
int plan_copy_into(plan *pl, plan_step **steps, int *n, int dst, int src, const op_type *t) {
  int *sl = malloc(2 * sizeof *sl);
  if (!sl) return plan_oom(pl);
  sl[0] = dst, sl[1] = src;
  plan_step st = {.kind = PLAN_STEP_COPY, .n_slots = 2, .slots = sl, .bytes = plan_type_bytes(t)};
  if (steps == &pl->steps) return plan_add_step(pl, st);
  plan_step *outer = pl->steps;
  int n_outer = pl->n_steps;
  pl->steps = *steps, pl->n_steps = *n;
  int rc = plan_add_step(pl, st);
  *steps = pl->steps, *n = pl->n_steps;
  pl->steps = outer, pl->n_steps = n_outer;
  return rc;
}

/* The body's new state (its first ns results, in slots rs, of types ty)
 * copied back into the state's slots st, appended to its steps: a result
 * that is another state slot goes through a fresh temporary first, so no
 * copy overwrites a state value a later copy reads. */
static int copy_back(plan *pl, plan_step **steps, int *n, const int *st, int *rs, int ns, const op_type *ty) {
  for (int k = 0; k < ns; k++) {
    bool is_state = false;
    for (int j = 0; j < ns && !is_state; j++) is_state = rs[k] == st[j];
    if (!is_state || rs[k] == st[k]) continue;
    int tmp = plan_arena_slot(pl, &ty[k]);
    if (tmp < 0 || plan_copy_into(pl, steps, n, tmp, rs[k], &ty[k])) return -1;
    rs[k] = tmp;
  }
  for (int k = 0; k < ns; k++)
    if (rs[k] != st[k] && plan_copy_into(pl, steps, n, st[k], rs[k], &ty[k])) return -1;
  return 0;
}

/* The result slots of in (of f) in vs; the first ns get the operands'
 * values copied in (the state), appended to pl->steps. */
static int result_slots(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, int ns) {
  for (int k = 0; k < in->n_out; k++)
    if ((vs[in->out + k] = plan_value_slot(pl, f, in->out + k, top)) < 0) return -1;
  for (int k = 0; k < ns; k++)
    if (plan_copy_into(pl, &pl->steps, &pl->n_steps, vs[in->out + k], vs[in->in[k]], &f->types[in->out + k]))
      return -1;
  return 0;
}

/* the region's parameter slots: the operands' slots, the first ns (the
 * state) replaced by the result slots, the next nx by rows (or -1s); malloc'd */
static int *param_slots(plan *pl, const ir_instr *in, const int *vs, int ns) {
  int *ps = malloc(((size_t)in->n_in + 1) * sizeof *ps);
  if (!ps) return plan_oom(pl), NULL;
  for (int k = 0; k < in->n_in; k++) ps[k] = k < ns ? vs[in->out + k] : vs[in->in[k]];
  return ps;
}

/* a control step's nested lists and slots, freed (after a failure) */
static void drop_step(plan_step *st) {
  for (int b = 0; b < 2; b++) plan_free_steps(st->sub[b], st->n_sub[b]);
  free(st->slots);
  free(st->state), free(st->move), free(st->state_bytes), free(st->scratch);
}

/* cond(pred, x...): each branch over the x's slots, its results made in
 * (or copied into) the cond's result slots */
static int plan_cond(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, int depth) {
  if (result_slots(pl, f, in, vs, top, 0)) return -1;
  plan_step st = {.kind = PLAN_STEP_COND, .n_slots = 1};
  int *out = malloc(((size_t)in->n_out + 1) * sizeof *out), *ps = malloc(((size_t)in->n_in + 1) * sizeof *ps);
  st.slots = malloc(sizeof *st.slots);
  int rc = !out || !ps || !st.slots ? plan_oom(pl) : 0;
  if (!rc) {
    st.slots[0] = vs[in->in[0]];
    for (int k = 0; k < in->n_out; k++) out[k] = vs[in->out + k];
    for (int k = 1; k < in->n_in; k++) ps[k - 1] = vs[in->in[k]];
  }
  const ir_func *r[2] = {NULL, NULL};
  ir_regions(in, r);
  for (int b = 0; b < 2 && !rc; b++) {
    int *rs = NULL;
    rc = plan_region(pl, r[b], ps, out, depth, &st.sub[b], &st.n_sub[b], &rs);
    for (int k = 0; !rc && k < in->n_out; k++)
      if (rs[k] != out[k])
        rc = plan_copy_into(pl, &st.sub[b], &st.n_sub[b], out[k], rs[k], &f->types[in->out + k]);
    free(rs);
  }
  free(out), free(ps);
  if (rc) {
    drop_step(&st);
    return -1;
  }
  return plan_add_step(pl, st);
}

/* while(s..., c...): the predicate's steps, then the body's, over the
 * state in the while's result slots */
static int plan_while(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, int depth) {
  int ns = in->attrs.n_state;
  if (result_slots(pl, f, in, vs, top, ns)) return -1;
  plan_step st = {.kind = PLAN_STEP_WHILE, .n_slots = 1, .trip = in->attrs.trip};
  int *ps = param_slots(pl, in, vs, ns), *rs = NULL;
  st.slots = malloc(sizeof *st.slots);
  int rc = !ps || !st.slots ? plan_oom(pl) : 0;
  const ir_func *r[2] = {NULL, NULL};
  ir_regions(in, r);
  if (!rc) rc = plan_region(pl, r[0], ps, NULL, depth, &st.sub[0], &st.n_sub[0], &rs);
  if (!rc) st.slots[0] = rs[0];
  free(rs);
  rs = NULL;
  int first_slot = pl->n_slots;
  if (!rc) rc = plan_region(pl, r[1], ps, NULL, depth, &st.sub[1], &st.n_sub[1], &rs);
  if (!rc) plan_carries_in_place(pl, st.sub[1], st.n_sub[1], ps, rs, ns, &f->types[in->out], first_slot);
  if (!rc && pl->policy->swap_state && pl->policy->swap_state())
    rc = plan_swap_state(pl, &st, 1, ps, rs, ns, &f->types[in->out], first_slot, NULL, 0);
  else if (!rc)
    rc = copy_back(pl, &st.sub[1], &st.n_sub[1], ps, rs, ns, &f->types[in->out]);
  free(rs), free(ps);
  if (rc) {
    drop_step(&st);
    return -1;
  }
  return plan_add_step(pl, st);
}

/* a row slot of slot base, rows of t's bytes */
static int row_slot(plan *pl, int base, const op_type *t) {
  return plan_add_slot(pl, (plan_slot){PLAN_SLOT_ROW, base, plan_type_bytes(t), NULL});
}

/* scan(carry..., xs..., c...): the body over the carries (in the scan's
 * first result slots), row t of each xs and the captures; its ys made in
 * (or copied into) row t of the stacked results */
static int plan_scan(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, int depth) {
  int nc = in->attrs.n_state, nx = in->attrs.n_xs, ny = in->n_out - nc;
  if (pl->policy->scan_one_kernel && pl->policy->scan_one_kernel(f, in)) return plan_scan_kernel(pl, f, in, vs, top);
  if (result_slots(pl, f, in, vs, top, nc)) return -1;
  const ir_func *body = in->attrs.callee;
  plan_step st = {.kind = PLAN_STEP_SCAN, .n_slots = nx + ny, .trip = in->attrs.trip, .reverse = in->attrs.reverse};
  int *ps = param_slots(pl, in, vs, nc), *rs = NULL, *dest = calloc((size_t)in->n_out + 1, sizeof *dest);
  st.slots = malloc(((size_t)nx + ny + 1) * sizeof *st.slots);
  int rc = !ps || !st.slots || !dest ? plan_oom(pl) : 0;
  for (int k = 0; !rc && k < nx; k++) /* row t of each xs, read in place */
    if ((rc = st.slots[k] = ps[nc + k] = row_slot(pl, vs[in->in[nc + k]], &body->types[nc + k])) >= 0) rc = 0;
  for (int k = 0; !rc && k < in->n_out; k++) {
    dest[k] = -1;
    if (k >= nc && (rc = dest[k] = st.slots[nx + k - nc] = row_slot(pl, vs[in->out + k], &body->types[body->results[k]])) >= 0)
      rc = 0;
  }
  int first_slot = pl->n_slots;
  if (!rc) rc = plan_region(pl, body, ps, dest, depth, &st.sub[0], &st.n_sub[0], &rs);
  for (int k = nc; !rc && k < in->n_out; k++)
    if (rs[k] != dest[k])
      rc = plan_copy_into(pl, &st.sub[0], &st.n_sub[0], dest[k], rs[k], &body->types[body->results[k]]);
  if (!rc) {
    op_type *ty = malloc(((size_t)nc + 1) * sizeof *ty);
    rc = !ty ? plan_oom(pl) : 0;
    for (int k = 0; !rc && k < nc; k++) ty[k] = body->types[body->results[k]];
    if (!rc) plan_carries_in_place(pl, st.sub[0], st.n_sub[0], ps, rs, nc, ty, first_slot);
    if (!rc && pl->policy->swap_state && pl->policy->swap_state())
      rc = plan_swap_state(pl, &st, 0, ps, rs, nc, ty, first_slot, st.slots + nx, ny);
    else if (!rc)
      rc = copy_back(pl, &st.sub[0], &st.n_sub[0], ps, rs, nc, ty);
    free(ty);
  }
  free(rs), free(ps), free(dest);
  if (rc) {
    drop_step(&st);
    return -1;
  }
  return plan_add_step(pl, st);
}

int plan_control(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, int depth) {
  if (depth > 100) return kiln_set_error("%s: @%s: control flow nests too deep", pl->policy->who, pl->f->name);
  switch (in->op) {
    case OP_COND: return plan_cond(pl, f, in, vs, top, depth);
    case OP_WHILE: return plan_while(pl, f, in, vs, top, depth);
    default: return plan_scan(pl, f, in, vs, top, depth);
  }
}
