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
 * region gains the new parameters too (unused there). The old regions are
 * emptied by pass_commit; dce drops captures nothing reads any more. */
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

/* Emits the moved instructions of body g before loop ins, then the loop
 * with new regions and the captures appended. 0 / -1. */
static int hoist_loop(pass_builder *b, const ir_instr *ins, const ir_func *g, const hoist *h) {
  int rc = 0, n = ins->n_in;
  ir_value *rmap = malloc(((size_t)g->n_values + 1) * sizeof *rmap);
  ir_value *x = malloc(((size_t)n + h->n_cap + g->n_values + 1) * sizeof *x), *tmp = x + n + h->n_cap;
  if (!rmap || !x) {
    free(rmap);
    free(x);
    return kiln_set_error("licm: out of memory");
  }
  for (int j = 0; j < n; j++) x[j] = pass_map(b, ins->in[j]);
  for (int v = 0; v < g->n_values; v++) rmap[v] = v < g->n_params ? x[v] : -1;
  for (int i = 0; i < g->n_instrs && !rc; i++) {
    const ir_instr *in = &g->instrs[i];
    if (!h->moved[i]) continue;
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
  for (int k = 0; k < h->n_cap && !rc; k++) x[n + k] = rmap[h->cap[k]];
  op_attrs a = ins->attrs;
  ir_func *body = NULL, *cond = NULL;
  if (!rc && !(body = pass_region_rebuild(g, NULL, h->n_cap, h->types, h->cap, h->copy, NULL))) rc = -1;
  if (!rc && ins->op == OP_WHILE &&
      !(cond = pass_region_rebuild(ins->attrs.callee, NULL, h->n_cap, h->types, NULL, NULL, NULL)))
    rc = -1;
  if (!rc) {
    if (ins->op == OP_WHILE) {
      a.callee = cond;
      a.callee2 = body;
    } else {
      a.callee = body;
    }
    ir_value v = pass_emit(b, ins->op, &a, n + h->n_cap, x, ins->loc);
    if (v < 0) rc = -1;
    for (int k = 0; k < ins->n_out && !rc; k++) rc = pass_replace(b, ins->out + k, v + k, true);
  }
  free(rmap);
  free(x);
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
    hoist h = {0};
    if (g && !(rc = plan(g, c0, &h)) && h.moved) {
      bool moves = false;
      for (int k = 0; k < g->n_instrs && !moves; k++) moves = h.moved[k];
      if (moves) {
        rc = hoist_loop(&b, ins, g, &h);
        changed = true;
        hoist_free(&h);
        continue;
      }
    }
    hoist_free(&h);
    if (!rc) rc = pass_copy(&b, ins) < 0;
  }
  if (rc) {
    pass_abort(&b);
    if (f->module) ir_module_truncate(f->module, keep_funcs);
    return pass_fail("licm");
  }
  return pass_finish(&b, changed, "licm");
}
