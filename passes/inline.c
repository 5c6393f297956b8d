/* inline.c — replaces a `call` of a small function by a copy of its body:
 * the callee's parameters become the call's operands and the call's results
 * the callee's results, so the other passes (and fusion) see across the call
 * boundary. Calls inside an inlined body are inlined in turn, to a bounded
 * depth and total size. The traced IR keeps its calls; fusion instructions
 * (whose callee is a kernel body) and host calls are never inlined.
 *
 * A control-flow instruction of the callee is copied with copies of its
 * regions (a region belongs to one instruction; the callee keeps its own),
 * and the regions count towards the callee's size.
 *
 * Callees stay in the module even when no call is left (a pass rewrites one
 * function; other functions of the module, and the JIT's handles, may still
 * name them): dropping unused functions is the module owner's job. */
#include <stdlib.h>

#include "rewrite.h"

enum {
  INLINE_MAX_INSTRS = 64, /* a callee this small is inlined */
  INLINE_MAX_DEPTH = 8,   /* calls inside inlined bodies, this deep */
  INLINE_BUDGET = 16384,  /* instructions one run may copy in */
};

typedef struct inliner {
  pass_builder *b;
  int budget;
} inliner;

/* g's instructions, its regions' included (a loop body is copied whole) */
static int size_of(const ir_func *g, int depth) {
  int n = g->n_instrs;
  for (int i = 0; i < g->n_instrs && n <= INLINE_BUDGET; i++) {
    const ir_func *rg[2];
    int nr = ir_regions(&g->instrs[i], rg);
    for (int k = 0; k < nr; k++) n += rg[k] && depth < 64 ? size_of(rg[k], depth + 1) : INLINE_BUDGET;
  }
  return n;
}

/* Is this call worth inlining, and within the limits? */
static bool should_inline(const inliner *in, const ir_instr *ins, int depth) {
  const ir_func *g = ins->attrs.callee;
  if (ins->op != OP_CALL || !g || g->n_instrs > INLINE_MAX_INSTRS || depth >= INLINE_MAX_DEPTH) return false;
  int n = size_of(g, 0);
  return n <= INLINE_MAX_INSTRS && n <= in->budget;
}

/* Appends g's body with its parameters bound to args (new values) and
 * writes the new value of each of g's results to res. 0 / -1. */
static int inline_body(inliner *il, const ir_func *g, const ir_value *args, ir_value *res, ir_loc at, int depth) {
  il->budget -= size_of(g, 0);
  ir_value *map = malloc(((size_t)g->n_values + 1) * sizeof *map);
  ir_value *x = NULL;
  int cap = 0, rc = 0;
  if (!map) return kiln_set_error("inline: out of memory");
  for (int p = 0; p < g->n_params; p++) map[p] = args[p];
  for (int i = 0; i < g->n_instrs && !rc; i++) {
    const ir_instr *ins = &g->instrs[i];
    if (ins->n_in > cap) {
      free(x);
      cap = ins->n_in;
      if (!(x = malloc((size_t)cap * sizeof *x))) {
        rc = kiln_set_error("inline: out of memory");
        break;
      }
    }
    for (int k = 0; k < ins->n_in; k++) x[k] = map[ins->in[k]];
    ir_loc loc = ins->loc.file ? ins->loc : at;
    if (should_inline(il, ins, depth + 1)) {
      rc = inline_body(il, ins->attrs.callee, x, map + ins->out, loc, depth + 1);
    } else {
      op_attrs a;
      ir_value v = pass_clone_regions(il->b->body.module, ins, &a) ? -1
                                                                   : pass_emit(il->b, ins->op, &a, ins->n_in, x, loc);
      if (v < 0) rc = -1;
      for (int k = 0; k < ins->n_out; k++) map[ins->out + k] = v + k;
    }
  }
  for (int r = 0; r < g->n_results && !rc; r++) res[r] = map[g->results[r]];
  free(x);
  free(map);
  return rc;
}

int kiln_pass_inline(ir_func *f) {
  bool any = false;
  for (int i = 0; i < f->n_instrs && !any; i++) any = f->instrs[i].op == OP_CALL;
  if (!any) return 0;
  pass_builder b;
  int keep_funcs = f->module ? f->module->n_funcs : 0;
  if (pass_begin(&b, f)) return pass_fail("inline");
  inliner il = {&b, INLINE_BUDGET};
  ir_value *x = NULL;
  int cap = 0, rc = 0;
  bool changed = false;
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    if (!should_inline(&il, ins, 0)) {
      rc = pass_copy(&b, ins) < 0;
      continue;
    }
    if (ins->n_in > cap) {
      free(x);
      cap = ins->n_in;
      if (!(x = malloc((size_t)cap * sizeof *x))) {
        rc = kiln_set_error("inline: out of memory");
        break;
      }
    }
    for (int k = 0; k < ins->n_in; k++) x[k] = pass_map(&b, ins->in[k]);
    ir_value mark = b.body.n_values, *res = b.map + ins->out;
    changed = true;
    rc = inline_body(&il, ins->attrs.callee, x, res, ins->loc, 0);
    /* a result computed by the copied body keeps the call result's name */
    for (int k = 0; k < ins->n_out && !rc; k++) rc = pass_replace(&b, ins->out + k, res[k], res[k] >= mark);
  }
  free(x);
  if (rc) {
    pass_abort(&b);
    if (f->module) ir_module_truncate(f->module, keep_funcs); /* the regions it copied */
    return pass_fail("inline");
  }
  return pass_finish(&b, changed, "inline");
}
