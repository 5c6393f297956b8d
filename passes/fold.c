/* fold.c — constant folding: an instruction whose operands are all constants
 * is evaluated now, with the same eager kernels the interpreter runs (so a
 * folded program computes exactly what the unfolded one did), and becomes a
 * constant. One forward sweep: a chain of constant work folds to its end.
 *
 * Never folded: random draws (each run draws afresh), calls and host calls
 * (pass_is_pure says no), and any result of more than PASS_CONST_MAX_ELEMS
 * (1024) elements: a broadcast or iota that large stays an instruction over
 * its small operand, which costs no memory and fuses into its consumers. An
 * evaluation that fails (a gather index out of range) is left for run time,
 * where it reports the error.
 *
 * A `cond` whose predicate is a constant becomes the branch it takes: the
 * branch's instructions are copied in (folded as they come), its
 * parameters bound to the cond's operands; nested control flow moves with
 * them, and pass_commit empties the two old regions. A loop whose body
 * never runs (a scan of length 0, a while with max_iterations=0 or whose
 * cond region, pure, returns a constant false) becomes its initial state,
 * and a scan's ys empty constants. */
#include <stdlib.h>
#include <string.h>

#include "rewrite.h"

/* Should ins (of g), whose operands in the new body are x, be evaluated now? */
static bool should_fold(const pass_builder *b, const ir_func *g, const ir_instr *ins, const ir_value *x) {
  if (!pass_is_pure(ins) || ins->op == OP_CONSTANT) return false;
  if (pass_elems(&g->types[ins->out]) > PASS_CONST_MAX_ELEMS) return false;
  for (int k = 0; k < ins->n_in; k++)
    if (!pass_const(&b->body, x[k])) return false;
  return true;
}

/* ins applied to the constants x on the CPU: a tensor owned by the caller,
 * or NULL (error set) */
static kiln_tensor *evaluate(const pass_builder *b, const ir_instr *ins, const ir_value *x) {
  kiln_tensor *small[8], **in = small;
  if (ins->n_in > 8 && !(in = malloc((size_t)ins->n_in * sizeof *in))) {
    kiln_set_error("fold: out of memory");
    return NULL;
  }
  for (int k = 0; k < ins->n_in; k++) in[k] = (kiln_tensor *)pass_const(&b->body, x[k]);
  kiln_device_push("cpu:0"); /* constants live on the CPU */
  kiln_scope_push();
  kiln_tensor *out = op_apply(ins->op, &ins->attrs, ins->n_in, in);
  if (out) kiln_retain(out);
  kiln_scope_pop();
  kiln_device_pop();
  if (in != small) free(in);
  return out;
}

typedef struct folder {
  pass_builder b;
  ir_value *x; /* operands of the instruction at hand */
  int cap;
  bool changed;
} folder;

static int fold_body(folder *fo, const ir_func *g, ir_value *map, bool top, int depth);

/* cond ins (operands x) on constant predicate: the branch's body copied in;
 * map gets its results. 0 / -1. */
static int inline_branch(folder *fo, const ir_instr *ins, const ir_value *x, ir_value *res, int depth) {
  const kiln_tensor *p = pass_const(&fo->b.body, x[0]);
  const ir_func *g = *(const uint8_t *)p->data ? ins->attrs.callee : ins->attrs.callee2;
  if (depth > 64) return kiln_set_error("fold: regions nested too deep");
  ir_value *map = malloc(((size_t)g->n_values + 1) * sizeof *map);
  if (!map) return kiln_set_error("fold: out of memory");
  for (int v = 0; v < g->n_values; v++) map[v] = v < g->n_params ? x[v + 1] : -1;
  int rc = fold_body(fo, g, map, false, depth + 1);
  for (int r = 0; r < g->n_results && !rc; r++) res[r] = map[g->results[r]];
  free(map);
  return rc;
}

/* Does loop ins never run its body? */
static bool never_runs(const ir_instr *ins) {
  if (ins->op == OP_SCAN) return ins->attrs.trip == 0;
  if (ins->op != OP_WHILE) return false;
  if (ins->attrs.trip == 0) return true;
  const ir_func *c = ins->attrs.callee;
  const kiln_tensor *p = c->n_results == 1 ? pass_const(c, c->results[0]) : NULL;
  return p && !*(const uint8_t *)p->data && pass_func_is_pure(c);
}

/* g's instructions, folded, appended to the new body; map: g's values to
 * new ones (the builder's own map when top, g being the function). */
static int fold_body(folder *fo, const ir_func *g, ir_value *map, bool top, int depth) {
  pass_builder *b = &fo->b;
  for (int i = 0; i < g->n_instrs; i++) {
    const ir_instr *ins = &g->instrs[i];
    if (ins->n_in > fo->cap) {
      ir_value *q = realloc(fo->x, (size_t)ins->n_in * sizeof *q);
      if (!q) return kiln_set_error("fold: out of memory");
      fo->x = q;
      fo->cap = ins->n_in;
    }
    ir_value *x = fo->x;
    for (int k = 0; k < ins->n_in; k++) x[k] = map[ins->in[k]];
    if (ins->op == OP_COND && pass_const(&b->body, x[0])) {
      ir_value *xs = malloc(((size_t)ins->n_in + ins->n_out + 1) * sizeof *xs), *res = xs + ins->n_in;
      if (!xs) return kiln_set_error("fold: out of memory");
      memcpy(xs, x, (size_t)ins->n_in * sizeof *xs);
      ir_value mark = b->body.n_values;
      int rc = inline_branch(fo, ins, xs, res, depth);
      for (int k = 0; k < ins->n_out && !rc; k++) {
        map[ins->out + k] = res[k];
        if (top) rc = pass_replace(b, ins->out + k, res[k], res[k] >= mark);
      }
      free(xs);
      if (rc) return -1;
      fo->changed = true;
      continue;
    }
    if (never_runs(ins)) { /* the initial state; empty ys */
      for (int k = 0; k < ins->n_out; k++) {
        ir_value v = x[k];
        bool fresh = false;
        if (k >= ins->attrs.n_state) {
          kiln_tensor *e = pass_filled(&g->types[ins->out + k], 0);
          v = e ? pass_emit_constant(b, e, ins->loc) : -1;
          kiln_release(e);
          fresh = true;
        }
        if (v < 0) return -1;
        map[ins->out + k] = v;
        if (top && pass_replace(b, ins->out + k, v, fresh)) return -1;
      }
      fo->changed = true;
      continue;
    }
    kiln_tensor *t = should_fold(b, g, ins, x) ? evaluate(b, ins, x) : NULL;
    if (t) {
      ir_value v = pass_emit_constant(b, t, ins->loc);
      kiln_release(t);
      if (v < 0) return -1;
      map[ins->out] = v;
      if (top && pass_replace(b, ins->out, v, true)) return -1;
      fo->changed = true;
    } else if (top) {
      if (pass_copy(b, ins) < 0) return -1;
    } else { /* an inlined branch's instruction: its names would clash */
      ir_value v = pass_emit(b, ins->op, &ins->attrs, ins->n_in, x, ins->loc);
      if (v < 0) return -1;
      for (int k = 0; k < ins->n_out; k++) map[ins->out + k] = v + k;
    }
  }
  return 0;
}

int kiln_pass_fold(ir_func *f) {
  folder fo = {.cap = 0};
  if (pass_begin(&fo.b, f)) return pass_fail("fold");
  int rc = fold_body(&fo, f, fo.b.map, true, 0);
  free(fo.x);
  if (rc) {
    pass_abort(&fo.b);
    return pass_fail("fold");
  }
  return pass_finish(&fo.b, fo.changed, "fold");
}
