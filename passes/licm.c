/* licm.c — loop-invariant code motion, as LLVM's LICM and XLA's
 * while-loop invariant code motion: an instruction of a `while` or `scan`
 * body whose operands are captures (operands past the state, the same every
 * iteration), constants, or other such instructions computes the same value
 * every iteration, so it moves out, before the loop, and what the body
 * still reads of it becomes a new capture. Runs after the regions were
 * optimized (manager.c), so nested loops empty from the inside out.
 *
 * Moved: pure instructions (pass_is_pure) that read at least one capture
 * (a chain of constants alone is fold's) and are not larger than their
 * largest operand (a broadcast or iota stays: inside it fuses into its
 * readers, outside it would be a buffer); gathers and scatters stay (an
 * index out of range must fail only if the loop runs it). A `while`'s cond
 * region is a loop body too (it runs every iteration): its invariant work
 * moves out the same way; both regions take every new capture (each
 * reading its own). The old regions are emptied by pass_commit; dce drops
 * captures nothing reads any more. */
#include <stdlib.h>

#include "rewrite.h"

/* What moves out of body g of loop ins. */
typedef struct hoist {
  bool *moved;   /* g->n_instrs: the instruction moves out */
  bool *copy;    /* g->n_instrs: the instruction stays in the body */
  ir_value *cap; /* values of g that become captures, n_cap of them */
  op_type *types;
  int n_cap;
} hoist;

static void hoist_free(hoist *h) {
  free(h->moved);
  free(h->copy);
  free(h->cap);
  free(h->types);
}

/* the loop's body region and its first capture parameter */
static const ir_func *loop_body(const ir_instr *ins, int *c0) {
  if (ins->op == OP_WHILE) {
    *c0 = ins->attrs.n_state;
    return ins->attrs.callee2;
  }
  if (ins->op == OP_SCAN) {
    *c0 = ins->attrs.n_state + ins->attrs.n_xs;
    return ins->attrs.callee;
  }
  return NULL;
}

static bool may_move(const ir_func *g, const ir_instr *ins) {
  if (!pass_is_pure(ins) || ins->op == OP_CONSTANT || kiln_ops[ins->op].kind == OPK_INDEX || ins->n_in < 1)
    return false;
  int64_t most = 0;
  for (int k = 0; k < ins->n_in; k++) {
    int64_t e = pass_elems(&g->types[ins->in[k]]);
    if (e > most) most = e;
  }
  return pass_elems(&g->types[ins->out]) <= most;
}

/* Finds what moves out of g (captures from parameter c0 on): h->moved,
 * all false when nothing does. 0 / -1. */
static int plan(const ir_func *g, int c0, hoist *h) {
  int nv = g->n_values, ni = g->n_instrs, rc = 0;
  bool *inv = calloc((size_t)nv + 1, sizeof *inv);   /* the same every iteration */
  bool *dep = calloc((size_t)nv + 1, sizeof *dep);   /* ... and reads a capture */
  bool *inside = calloc((size_t)nv + 1, sizeof *inside); /* read by what stays, or a result */
  h->moved = calloc((size_t)ni + 1, sizeof *h->moved);
  h->copy = calloc((size_t)ni + 1, sizeof *h->copy);
  h->cap = malloc(((size_t)nv + 1) * sizeof *h->cap);
  h->types = malloc(((size_t)nv + 1) * sizeof *h->types);
  h->n_cap = 0;
  if (!inv || !dep || !inside || !h->moved || !h->copy || !h->cap || !h->types) {
    rc = kiln_set_error("licm: out of memory");
    goto done;
  }
  for (int p = c0; p < g->n_params; p++) inv[p] = dep[p] = true;
  int n_moved = 0;
  for (int i = 0; i < ni; i++) {
    const ir_instr *ins = &g->instrs[i];
    if (ins->op == OP_CONSTANT) {
      inv[ins->out] = true;
      continue;
    }
    if (!may_move(g, ins)) continue;
    bool all = true, any = false;
    for (int k = 0; k < ins->n_in; k++) {
      all &= inv[ins->in[k]];
      any |= dep[ins->in[k]];
    }
    if (!all || !any) continue;
    h->moved[i] = true;
    inv[ins->out] = dep[ins->out] = true;
    n_moved++;
  }
  if (!n_moved) goto done;
  /* what stays reads what: moved values it reads become captures */
  for (int r = 0; r < g->n_results; r++) inside[g->results[r]] = true;
  for (int i = ni - 1; i >= 0; i--) {
    const ir_instr *ins = &g->instrs[i];
    if (h->moved[i]) continue;
    bool used = ins->op != OP_CONSTANT || inside[ins->out];
    h->copy[i] = used;
    for (int k = 0; used && k < ins->n_in; k++) inside[ins->in[k]] = true;
  }
  for (int i = 0; i < ni; i++)
    if (h->moved[i] && inside[g->instrs[i].out]) {
      h->cap[h->n_cap] = g->instrs[i].out;
      h->types[h->n_cap++] = g->types[g->instrs[i].out];
    }
done:
  free(inv);
  free(dep);
  free(inside);
  return rc;
}

/* Emits region g's moved instructions into the new body (g's parameters
 * bound to the loop's operands x); writes the new value of each capture
 * h->cap[k] to out[k]. 0 / -1. */
static int emit_moved(pass_builder *b, const ir_func *g, const hoist *h, const ir_value *x, ir_value *out) {
  int rc = 0, cap = 8;
  ir_value *rmap = malloc(((size_t)g->n_values + 1) * sizeof *rmap), *tmp = malloc((size_t)cap * sizeof *tmp);
  if (!rmap || !tmp) {
    free(rmap);
    free(tmp);
    return kiln_set_error("licm: out of memory");
  }
  for (int v = 0; v < g->n_values; v++) rmap[v] = v < g->n_params ? x[v] : -1;
  for (int i = 0; i < g->n_instrs && !rc; i++) {
    const ir_instr *in = &g->instrs[i];
    if (!h->moved[i]) continue;
    if (in->n_in > cap) {
      ir_value *q = realloc(tmp, (size_t)in->n_in * sizeof *q);
      if (!q) {
        rc = kiln_set_error("licm: out of memory");
        break;
      }
      tmp = q;
      cap = in->n_in;
    }
    for (int k = 0; k < in->n_in && !rc; k++) {
      ir_value v = in->in[k];
      if (v < 0 || v >= g->n_values) {
        rc = kiln_set_error("licm: @%s: bad operand", g->name);
        break;
      }
      const ir_instr *d = g->def[v] >= 0 ? &g->instrs[g->def[v]] : NULL;
      if (rmap[v] < 0 && d && d->op == OP_CONSTANT) /* a constant it reads comes along */
        rc = (rmap[v] = pass_emit_constant(b, d->attrs.value, d->loc)) < 0;
      tmp[k] = rmap[v];
    }
    ir_value v = rc ? -1 : pass_emit(b, in->op, &in->attrs, in->n_in, tmp, in->loc);
    if (v < 0) rc = -1;
    rmap[in->out] = v;
  }
  for (int k = 0; k < h->n_cap && !rc; k++) out[k] = rmap[h->cap[k]];
  free(rmap);
  free(tmp);
  return rc;
}

/* Does anything of g move out? */
static bool any_moved(const ir_func *g, const hoist *h) {
  for (int k = 0; h->moved && k < g->n_instrs; k++)
    if (h->moved[k]) return true;
  return false;
}

/* Emits what moves out of loop ins's regions (hb: its body, hc: a while's
 * cond region, NULL for a scan), then the loop with new regions that take
 * every new capture (the body's, then the cond region's) after the old
 * operands. 0 / -1. */
static int hoist_loop(pass_builder *b, const ir_instr *ins, const hoist *hb, const hoist *hc) {
  const ir_func *body = ins->op == OP_WHILE ? ins->attrs.callee2 : ins->attrs.callee;
  const ir_func *cond = ins->op == OP_WHILE ? ins->attrs.callee : NULL;
  int n = ins->n_in, nb = hb->n_cap, nc = hc ? hc->n_cap : 0, rc = 0;
  ir_value *x = malloc(((size_t)n + nb + nc + 1) * sizeof *x);
  ir_value *fb = malloc(((size_t)nb + nc + 1) * sizeof *fb); /* extra_for of the body */
  op_type *types = malloc(((size_t)nb + nc + 1) * sizeof *types);
  if (!x || !fb || !types) {
    free(x);
    free(fb);
    free(types);
    return kiln_set_error("licm: out of memory");
  }
  ir_value *fcond = malloc(((size_t)nb + nc + 1) * sizeof *fcond);
  if (!fcond) rc = kiln_set_error("licm: out of memory");
  for (int j = 0; j < n; j++) x[j] = pass_map(b, ins->in[j]);
  if (!rc) rc = emit_moved(b, body, hb, x, x + n);
  if (!rc && nc) rc = emit_moved(b, cond, hc, x, x + n + nb);
  for (int k = 0; k < nb + nc && !rc; k++) {
    types[k] = k < nb ? hb->types[k] : hc->types[k - nb];
    fb[k] = k < nb ? hb->cap[k] : -1;
    fcond[k] = k < nb ? -1 : hc->cap[k - nb];
  }
  op_attrs a = ins->attrs;
  ir_func *nbody = NULL, *ncond = NULL;
  const bool *copy_body = any_moved(body, hb) ? hb->copy : NULL;
  const bool *copy_cond = hc && any_moved(cond, hc) ? hc->copy : NULL;
  if (!rc && !(nbody = pass_region_rebuild(body, NULL, nb + nc, types, fb, copy_body, NULL))) rc = -1;
  if (!rc && cond && !(ncond = pass_region_rebuild(cond, NULL, nb + nc, types, fcond, copy_cond, NULL))) rc = -1;
  if (!rc) {
    if (cond) {
      a.callee = ncond;
      a.callee2 = nbody;
    } else {
      a.callee = nbody;
    }
    ir_value v = pass_emit(b, ins->op, &a, n + nb + nc, x, ins->loc);
    if (v < 0) rc = -1;
    for (int k = 0; k < ins->n_out && !rc; k++) rc = pass_replace(b, ins->out + k, v + k, true);
  }
  free(x);
  free(fb);
  free(fcond);
  free(types);
  return rc;
}

int kiln_pass_licm(ir_func *f) {
  bool any = false;
  for (int i = 0; i < f->n_instrs && !any; i++) any = f->instrs[i].op == OP_WHILE || f->instrs[i].op == OP_SCAN;
  if (!any) return 0;
  int keep_funcs = f->module ? f->module->n_funcs : 0, rc = 0;
  bool changed = false;
  pass_builder b;
  if (pass_begin(&b, f)) return pass_fail("licm");
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    int c0 = 0;
    const ir_func *g = loop_body(ins, &c0);
    hoist hb = {0}, hc = {0};
    bool moves = false;
    if (g) {
      rc = plan(g, c0, &hb);
      moves = !rc && any_moved(g, &hb);
      if (!rc && ins->op == OP_WHILE) {
        rc = plan(ins->attrs.callee, c0, &hc);
        moves |= !rc && any_moved(ins->attrs.callee, &hc);
      }
    }
    if (!rc && moves) {
      rc = hoist_loop(&b, ins, &hb, ins->op == OP_WHILE ? &hc : NULL);
      changed = true;
    } else if (!rc) {
      rc = pass_copy(&b, ins) < 0;
    }
    hoist_free(&hb);
    hoist_free(&hc);
  }
  if (rc) {
    pass_abort(&b);
    if (f->module) ir_module_truncate(f->module, keep_funcs);
    return pass_fail("licm");
  }
  return pass_finish(&b, changed, "licm");
}
