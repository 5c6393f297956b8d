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
 * readers, outside it would be a buffer), and that cannot fail at run time
 * (pass_can_fail: no gather or scatter_add, whose index out of range must
 * fail only if the loop runs it, no integer div or mod by a divisor that
 * may be zero): a while may not run its body at all, so what moves out runs
 * speculatively. A `while`'s cond region is a loop body too (it runs every
 * iteration): its invariant work moves out the same way; both regions take
 * every new capture (each reading its own). The old regions are emptied by
 * pass_commit; dce drops captures nothing reads any more.
 *
 * Out of the branches of a cond inside a loop body: a cond directly in a
 * loop's body (or a while's cond region) whose branch computes from
 * operands of the cond that are invariant in the loop (captures, constants,
 * moved work) holds loop-invariant work too. It moves out of the loop the
 * same way, in two steps: first out of the branch into the body before the
 * cond (the cond gets the values as new operands, both branches new
 * parameters), then out of the body with the rest. Leaving the branch makes
 * it speculative (it now runs whichever branch is taken, and once even if
 * the loop never runs), which is sound exactly for the work moved out of
 * loops anyway: pure and unable to fail (the same predicate, so the first
 * step moves nothing the second leaves in the loop). Conds nested deeper
 * (a cond in a branch of a cond in a loop) keep their work.
 *
 * Work both branches do: an instruction of a cond's then branch that reads
 * only the branch's parameters (the cond's operands), constants and other
 * such work, with an instruction of the else branch that computes the same
 * (same op, attributes, types, operands by position, constants by value),
 * runs whichever branch is taken, so it moves before the cond, computed
 * once (then the loop rule above may take it further out). Not speculative;
 * still only work that cannot fail moves, so that which op reports an
 * error, and what ran before it, stay as they were. */
#include <stdlib.h>
#include <string.h>

#include "rewrite.h"

/* What moves out of region g. */
typedef struct hoist {
  bool *moved;   /* g->n_instrs: the instruction moves out */
  bool *copy;    /* g->n_instrs: the instruction stays in the region */
  ir_value *cap; /* values of g that become captures, n_cap of them */
  op_type *types;
  int n_cap;
} hoist;

static void hoist_free(hoist *h) {
  free(h->moved);
  free(h->copy);
  free(h->cap);
  free(h->types);
  memset(h, 0, sizeof *h);
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

/* May ins of g run where the program would not have run it? */
static bool may_move(const ir_func *g, const ir_instr *ins) {
  if (!pass_is_pure(ins) || ins->op == OP_CONSTANT || ins->n_in < 1 || pass_can_fail(g, ins)) return false;
  int64_t most = 0;
  for (int k = 0; k < ins->n_in; k++) {
    int64_t e = pass_elems(&g->types[ins->in[k]]);
    if (e > most) most = e;
  }
  return pass_elems(&g->types[ins->out]) <= most;
}

/* Marks what of g moves out: its parameters p with inv[p] are the same
 * every time (dep[p]: and not a constant); inv and dep (g->n_values) get the
 * same for every value, moved (g->n_instrs) the instructions that move.
 * The number moved. */
static int mark(const ir_func *g, bool *inv, bool *dep, bool *moved) {
  int n_moved = 0;
  for (int i = 0; i < g->n_instrs; i++) {
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
    moved[i] = true;
    inv[ins->out] = dep[ins->out] = true;
    n_moved++;
  }
  return n_moved;
}

/* With h->moved set: which instructions stay (h->copy: every other one but
 * the constants nothing left reads) and which moved values what stays still
 * reads (h->cap, h->types). 0 / -1. */
static int finish(const ir_func *g, hoist *h) {
  int nv = g->n_values;
  bool *inside = calloc((size_t)nv + 1, sizeof *inside); /* read by what stays, or a result */
  h->copy = calloc((size_t)g->n_instrs + 1, sizeof *h->copy);
  h->cap = malloc(((size_t)nv + 1) * sizeof *h->cap);
  h->types = malloc(((size_t)nv + 1) * sizeof *h->types);
  h->n_cap = 0;
  if (!inside || !h->copy || !h->cap || !h->types) {
    free(inside);
    return kiln_set_error("licm: out of memory");
  }
  for (int r = 0; r < g->n_results; r++) inside[g->results[r]] = true;
  for (int i = g->n_instrs - 1; i >= 0; i--) {
    const ir_instr *ins = &g->instrs[i];
    if (h->moved[i]) continue;
    bool used = ins->op != OP_CONSTANT || inside[ins->out];
    h->copy[i] = used;
    for (int k = 0; used && k < ins->n_in; k++) inside[ins->in[k]] = true;
  }
  for (int i = 0; i < g->n_instrs; i++)
    if (h->moved[i] && inside[g->instrs[i].out]) {
      h->cap[h->n_cap] = g->instrs[i].out;
      h->types[h->n_cap++] = g->types[g->instrs[i].out];
    }
  free(inside);
  return 0;
}

/* Finds what moves out of g whose parameters marked in pinv are invariant
 * (pdep: and not constants; NULL: pinv): h->moved, all false when nothing
 * does; h->copy and the captures when something does. 0 / -1. */
static int plan_with(const ir_func *g, const bool *pinv, const bool *pdep, hoist *h) {
  int nv = g->n_values, rc = 0;
  bool *inv = calloc((size_t)nv + 1, sizeof *inv); /* the same every iteration */
  bool *dep = calloc((size_t)nv + 1, sizeof *dep); /* ... and reads a capture */
  h->moved = calloc((size_t)g->n_instrs + 1, sizeof *h->moved);
  if (!inv || !dep || !h->moved) {
    rc = kiln_set_error("licm: out of memory");
    goto done;
  }
  for (int p = 0; p < g->n_params; p++) {
    inv[p] = pinv[p];
    dep[p] = pdep ? pdep[p] : pinv[p];
  }
  if (mark(g, inv, dep, h->moved)) rc = finish(g, h);
done:
  free(inv);
  free(dep);
  return rc;
}

/* plan_with for loop region g whose captures start at parameter c0 */
static int plan(const ir_func *g, int c0, hoist *h) {
  bool *pinv = calloc((size_t)g->n_params + 1, sizeof *pinv);
  if (!pinv) return kiln_set_error("licm: out of memory");
  for (int p = c0; p < g->n_params; p++) pinv[p] = true;
  int rc = plan_with(g, pinv, NULL, h);
  free(pinv);
  return rc;
}

/* Emits region g's moved instructions into the new body (g's parameters
 * bound to x, new values); writes the new value of each capture h->cap[k]
 * to out[k]. 0 / -1. */
static int emit_moved(pass_builder *b, const ir_func *g, const hoist *h, const ir_value *x, ir_value *out) {
  int rc = 0, cap = 8;
  ir_value *rmap = malloc(((size_t)g->n_values + 1) * sizeof *rmap);
  ir_value *tmp = malloc((size_t)cap * sizeof *tmp);
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
      if (!rc && rmap[v] < 0) rc = kiln_set_error("licm: @%s: a moved %s reads a value left behind", g->name,
                                                  kiln_ops[in->op].name);
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
  for (int k = 0; g && h->moved && k < g->n_instrs; k++)
    if (h->moved[k]) return true;
  return false;
}

/* Emits control instruction ins anew with n_extra more operands (extra, new
 * values of types types) after its own (x, new values): each region r
 * (callee, callee2) rebuilt with as many more parameters, the j-th standing
 * for its value fr[r][j] (-1: none), keeping the instructions copy[r] marks
 * (NULL: all). Maps ins's results. 0 / -1. */
static int emit_rebuilt(pass_builder *b, const ir_instr *ins, const ir_value *x, int n_extra, const ir_value *extra,
                        const op_type *types, const ir_value *const fr[2], const bool *const copy[2]) {
  int n = ins->n_in, rc = 0;
  ir_value *all = malloc(((size_t)n + n_extra + 1) * sizeof *all);
  if (!all) return kiln_set_error("licm: out of memory");
  memcpy(all, x, (size_t)n * sizeof *all);
  if (n_extra) memcpy(all + n, extra, (size_t)n_extra * sizeof *all);
  op_attrs a = ins->attrs;
  ir_func **slot[2] = {&a.callee, &a.callee2};
  const ir_func *old[2] = {ins->attrs.callee, ins->attrs.callee2};
  for (int r = 0; r < 2 && !rc; r++)
    if (old[r] && !(*slot[r] = pass_region_rebuild(old[r], NULL, n_extra, types, fr[r], copy[r], NULL))) rc = -1;
  if (!rc) {
    ir_value v = pass_emit(b, ins->op, &a, n + n_extra, all, ins->loc);
    if (v < 0) rc = -1;
    for (int k = 0; k < ins->n_out && !rc; k++) rc = pass_replace(b, ins->out + k, v + k, true);
  }
  free(all);
  return rc;
}

/* Emits what moves out of control instruction ins's regions (hr[0] for
 * callee: a scan's body, a while's cond region, a cond's then branch;
 * hr[1] for callee2: a while's body, a cond's else branch), whose
 * parameters are its operands from first on, then ins with new regions
 * that take every new capture (callee's, then callee2's) after the old
 * operands. 0 / -1. */
static int hoist_regions(pass_builder *b, const ir_instr *ins, int first, const hoist hr[2]) {
  const ir_func *rg[2] = {ins->attrs.callee, ins->attrs.callee2};
  int n = ins->n_in, n0 = hr[0].n_cap, n1 = hr[1].n_cap, ne = n0 + n1, rc = 0;
  ir_value *x = malloc(((size_t)n + ne + 1) * sizeof *x);
  ir_value *f0 = malloc(((size_t)ne + 1) * sizeof *f0), *f1 = malloc(((size_t)ne + 1) * sizeof *f1);
  op_type *types = malloc(((size_t)ne + 1) * sizeof *types);
  if (!x || !f0 || !f1 || !types) rc = kiln_set_error("licm: out of memory");
  for (int j = 0; j < n && !rc; j++) x[j] = pass_map(b, ins->in[j]);
  for (int r = 0; r < 2 && !rc; r++)
    if (any_moved(rg[r], &hr[r])) rc = emit_moved(b, rg[r], &hr[r], x + first, x + n + (r ? n0 : 0));
  for (int k = 0; k < ne && !rc; k++) {
    types[k] = k < n0 ? hr[0].types[k] : hr[1].types[k - n0];
    f0[k] = k < n0 ? hr[0].cap[k] : -1;
    f1[k] = k < n0 ? -1 : hr[1].cap[k - n0];
  }
  if (!rc) {
    const ir_value *fr[2] = {f0, f1};
    const bool *copy[2] = {any_moved(rg[0], &hr[0]) ? hr[0].copy : NULL, any_moved(rg[1], &hr[1]) ? hr[1].copy : NULL};
    rc = emit_rebuilt(b, ins, x, ne, x + n, types, fr, copy);
  }
  free(x);
  free(f0);
  free(f1);
  free(types);
  return rc;
}

/* ---- out of the branches of a cond in a loop body ---- */

/* Moves the loop-invariant work (inv, dep: g's values, from mark) of the
 * branches of each cond of g into g before the cond. *changed when it
 * moved anything. 0 / -1. */
static int from_conds(ir_func *g, const bool *inv, const bool *dep, bool *changed) {
  bool any = false;
  for (int i = 0; i < g->n_instrs && !any; i++) any = g->instrs[i].op == OP_COND;
  if (!any) return 0;
  pass_builder b;
  if (pass_begin(&b, g)) return -1;
  int rc = 0;
  bool moved_any = false;
  for (int i = 0; i < g->n_instrs && !rc; i++) {
    const ir_instr *ins = &g->instrs[i];
    const ir_func *br[2] = {ins->attrs.callee, ins->attrs.callee2};
    hoist h[2] = {{0}, {0}};
    bool moves = false;
    if (ins->op == OP_COND && br[0] && br[1] && br[0]->n_params == ins->n_in - 1 &&
        br[1]->n_params == ins->n_in - 1) {
      int np = ins->n_in - 1;
      bool *pinv = calloc((size_t)np + 1, sizeof *pinv), *pdep = calloc((size_t)np + 1, sizeof *pdep);
      if (!pinv || !pdep) rc = kiln_set_error("licm: out of memory");
      for (int j = 0; j < np && !rc; j++) {
        pinv[j] = inv[ins->in[1 + j]];
        pdep[j] = dep[ins->in[1 + j]];
      }
      for (int r = 0; r < 2 && !rc; r++) {
        rc = plan_with(br[r], pinv, pdep, &h[r]);
        moves |= !rc && any_moved(br[r], &h[r]);
      }
      free(pinv);
      free(pdep);
    }
    if (!rc && moves) {
      rc = hoist_regions(&b, ins, 1, h); /* the operands past the predicate are the branches' parameters */
      moved_any = true;
    } else if (!rc) {
      rc = pass_copy(&b, ins) < 0;
    }
    hoist_free(&h[0]);
    hoist_free(&h[1]);
  }
  if (rc) {
    pass_abort(&b);
    return -1;
  }
  if (pass_finish(&b, moved_any, "licm")) return -1;
  *changed |= moved_any;
  return 0;
}

/* from_conds for loop region g (captures from parameter c0) */
static int loop_conds(ir_func *g, int c0, bool *changed) {
  int nv = g->n_values, rc = 0;
  bool *inv = calloc((size_t)nv + 1, sizeof *inv), *dep = calloc((size_t)nv + 1, sizeof *dep);
  bool *moved = calloc((size_t)g->n_instrs + 1, sizeof *moved);
  if (!inv || !dep || !moved) rc = kiln_set_error("licm: out of memory");
  for (int p = c0; p < g->n_params && !rc; p++) inv[p] = dep[p] = true;
  if (!rc) {
    mark(g, inv, dep, moved);
    rc = from_conds(g, inv, dep, changed);
  }
  free(inv);
  free(dep);
  free(moved);
  return rc;
}

/* ---- work both branches of a cond do ---- */

/* Limits the pairs compared (then instructions x else instructions). */
enum { COMMON_MAX_PAIRS = 1 << 16 };

/* Finds the work both branches of cond ins do, reading only their
 * parameters, constants and other such work: h[0].moved marks it in the
 * then branch, h[1].moved its twin in the else branch (each else
 * instruction twins one then instruction at most); twin[v] is the else
 * value of then value v (-1 none).
 * Captures: each moved then value either branch still reads (h[0].cap, the
 * else twin's in h[1].cap). 0 / -1. */
static int plan_common(const ir_instr *ins, hoist h[2], ir_value **twin_out) {
  const ir_func *t = ins->attrs.callee, *e = ins->attrs.callee2;
  int rc = 0;
  ir_value *twin = malloc(((size_t)t->n_values + 1) * sizeof *twin);
  ir_value small[8], *in_y = small;
  int in_cap = 8;
  h[0].moved = calloc((size_t)t->n_instrs + 1, sizeof(bool));
  h[1].moved = calloc((size_t)e->n_instrs + 1, sizeof(bool));
  *twin_out = twin;
  if (!twin || !h[0].moved || !h[1].moved) return kiln_set_error("licm: out of memory");
  for (int v = 0; v < t->n_values; v++) twin[v] = v < t->n_params ? v : -1; /* parameters by position */
  int n_moved = 0;
  for (int i = 0; i < t->n_instrs && !rc; i++) {
    const ir_instr *x = &t->instrs[i];
    if (!may_move(t, x)) continue;
    if (x->n_in > in_cap) {
      ir_value *q = malloc((size_t)x->n_in * sizeof *q);
      if (!q) {
        rc = kiln_set_error("licm: out of memory");
        break;
      }
      if (in_y != small) free(in_y);
      in_y = q;
      in_cap = x->n_in;
    }
    bool ok = true, any = false;
    for (int k = 0; k < x->n_in && ok; k++) {
      ir_value v = x->in[k];
      if (twin[v] >= 0) {
        any = true;
        continue;
      }
      ok = pass_const(t, v) != NULL; /* matched against the else operand's constant below */
    }
    if (!ok || !any) continue;
    for (int j = 0; j < e->n_instrs; j++) {
      const ir_instr *y = &e->instrs[j];
      if (h[1].moved[j] || y->op != x->op || y->n_in != x->n_in) continue;
      bool fits = true;
      for (int k = 0; k < x->n_in && fits; k++) {
        ir_value v = x->in[k];
        if (twin[v] >= 0) {
          in_y[k] = twin[v];
        } else {
          const kiln_tensor *c = pass_const(e, y->in[k]);
          fits = c && pass_same_tensor(c, pass_const(t, v));
          in_y[k] = y->in[k];
        }
      }
      if (!fits || !pass_same_instr(t, x, e, y, in_y)) continue;
      h[0].moved[i] = h[1].moved[j] = true;
      twin[x->out] = y->out;
      n_moved++;
      break;
    }
  }
  if (in_y != small) free(in_y);
  if (rc || !n_moved) return rc;
  if (finish(t, &h[0]) || finish(e, &h[1])) return -1;
  /* one capture per moved then value read in either branch */
  bool *need = calloc((size_t)t->n_values + 1, sizeof *need);
  bool *need_e = calloc((size_t)e->n_values + 1, sizeof *need_e);
  if (!need || !need_e) {
    free(need);
    free(need_e);
    return kiln_set_error("licm: out of memory");
  }
  for (int k = 0; k < h[0].n_cap; k++) need[h[0].cap[k]] = true;
  for (int k = 0; k < h[1].n_cap; k++) need_e[h[1].cap[k]] = true;
  int n = 0;
  for (int i = 0; i < t->n_instrs; i++) {
    ir_value v = t->instrs[i].out;
    if (!h[0].moved[i] || !(need[v] || need_e[twin[v]])) continue;
    h[0].cap[n] = v;
    h[0].types[n] = t->types[v];
    h[1].cap[n++] = twin[v];
  }
  h[0].n_cap = h[1].n_cap = n;
  free(need);
  free(need_e);
  return 0;
}

/* Emits the work both branches of cond ins do before it, then the cond
 * with branches reading it as new parameters. *moved: anything was.
 * 0 / -1. */
static int hoist_common(pass_builder *b, const ir_instr *ins, bool *moved) {
  const ir_func *t = ins->attrs.callee, *e = ins->attrs.callee2;
  *moved = false;
  if (!t || !e || t->n_params != ins->n_in - 1 || e->n_params != ins->n_in - 1 ||
      (int64_t)t->n_instrs * e->n_instrs > COMMON_MAX_PAIRS)
    return 0;
  hoist h[2] = {{0}, {0}};
  ir_value *twin = NULL;
  int rc = plan_common(ins, h, &twin), n = ins->n_in, ne = h[0].n_cap;
  if (!rc && any_moved(t, &h[0])) {
    ir_value *x = malloc(((size_t)n + ne + 1) * sizeof *x);
    if (!x) rc = kiln_set_error("licm: out of memory");
    for (int j = 0; !rc && j < n; j++) x[j] = pass_map(b, ins->in[j]);
    if (!rc) rc = emit_moved(b, t, &h[0], x + 1, x + n);
    if (!rc) {
      const ir_value *fr[2] = {h[0].cap, h[1].cap};
      const bool *copy[2] = {h[0].copy, h[1].copy};
      rc = emit_rebuilt(b, ins, x, ne, x + n, h[0].types, fr, copy);
      *moved = !rc;
    }
    free(x);
  }
  free(twin);
  hoist_free(&h[0]);
  hoist_free(&h[1]);
  return rc;
}

int kiln_pass_licm(ir_func *f) {
  bool any = false;
  for (int i = 0; i < f->n_instrs && !any; i++) any = pass_is_control(&f->instrs[i]);
  if (!any) return 0;
  bool changed = false;
  int rc = 0;
  /* first the loop-invariant work of the conds in loop bodies moves into
   * the bodies (the regions change in place) */
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    int c0 = 0;
    ir_func *g = (ir_func *)loop_body(ins, &c0);
    if (!g) continue;
    rc = loop_conds(g, c0, &changed);
    if (!rc && ins->op == OP_WHILE && ins->attrs.callee) rc = loop_conds(ins->attrs.callee, c0, &changed);
  }
  if (rc) return pass_fail("licm");
  int keep_funcs = f->module ? f->module->n_funcs : 0;
  pass_builder b;
  if (pass_begin(&b, f)) return pass_fail("licm");
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    if (ins->op == OP_COND) {
      bool moved = false;
      rc = hoist_common(&b, ins, &moved);
      changed |= moved;
      if (!rc && !moved) rc = pass_copy(&b, ins) < 0;
      continue;
    }
    int c0 = 0;
    const ir_func *g = loop_body(ins, &c0);
    hoist h[2] = {{0}, {0}}; /* callee's, callee2's */
    bool moves = false;
    if (g) {
      for (int r = 0; r < 2 && !rc; r++) {
        const ir_func *rg = r ? ins->attrs.callee2 : ins->attrs.callee;
        if (!rg) continue;
        rc = plan(rg, c0, &h[r]);
        moves |= !rc && any_moved(rg, &h[r]);
      }
    }
    if (!rc && moves) {
      rc = hoist_regions(&b, ins, 0, h);
      changed = true;
    } else if (!rc) {
      rc = pass_copy(&b, ins) < 0;
    }
    hoist_free(&h[0]);
    hoist_free(&h[1]);
  }
  if (rc) {
    pass_abort(&b);
    if (f->module) ir_module_truncate(f->module, keep_funcs);
    return pass_fail("licm");
  }
  return pass_finish(&b, changed, "licm");
}
