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
 * where it reports the error. */
#include <stdlib.h>

#include "rewrite.h"

/* Should ins, whose operands in the new body are x, be evaluated now? */
static bool should_fold(const pass_builder *b, const ir_instr *ins, const ir_value *x) {
  if (!pass_is_pure(ins) || ins->op == OP_CONSTANT) return false;
  if (pass_elems(&b->old->types[ins->out]) > PASS_CONST_MAX_ELEMS) return false;
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

int kiln_pass_fold(ir_func *f) {
  pass_builder b;
  if (pass_begin(&b, f)) return pass_fail("fold");
  ir_value small[8], *x = small;
  int cap = 8, rc = 0;
  bool changed = false;
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    if (ins->n_in > cap) {
      if (x != small) free(x);
      if (!(x = malloc((size_t)ins->n_in * sizeof *x))) {
        x = small;
        rc = kiln_set_error("fold: out of memory");
        break;
      }
      cap = ins->n_in;
    }
    for (int k = 0; k < ins->n_in; k++) x[k] = pass_map(&b, ins->in[k]);
    kiln_tensor *t = should_fold(&b, ins, x) ? evaluate(&b, ins, x) : NULL;
    if (t) {
      ir_value v = pass_emit_constant(&b, t, ins->loc);
      kiln_release(t);
      rc = v < 0 || pass_replace(&b, ins->out, v, true);
      changed = true;
    } else {
      rc = pass_copy(&b, ins) < 0;
    }
  }
  if (x != small) free(x);
  if (rc) {
    pass_abort(&b);
    return pass_fail("fold");
  }
  return pass_finish(&b, changed, "fold");
}
