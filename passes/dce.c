/* dce.c — dead code elimination: keeps only the instructions some result of
 * the function needs, plus those that must run anyway: random draws (they
 * advance the generator), host calls (a C callback's effects), calls whose
 * callee has either, and any op this pass does not know. One backward sweep
 * marks what is needed; the new body keeps it, in order. */
#include <stdlib.h>

#include "rewrite.h"

/* Must ins run even when no result needs its values? */
static bool has_effect(const ir_instr *ins) {
  if (pass_is_pure(ins)) return false;
  /* call and fusion: as pure as their callee */
  if ((unsigned)ins->op < OP_COUNT && kiln_ops[ins->op].kind == OPK_CALL)
    return !pass_func_is_pure(ins->attrs.callee);
  return true;
}

int kiln_pass_dce(ir_func *f) {
  bool *live = calloc((size_t)f->n_values + 1, sizeof *live);
  if (!live) return kiln_set_error("dce: out of memory");
  for (int r = 0; r < f->n_results; r++) live[f->results[r]] = true;
  int dead = 0;
  for (int i = f->n_instrs - 1; i >= 0; i--) {
    const ir_instr *ins = &f->instrs[i];
    bool needed = has_effect(ins);
    for (int k = 0; k < ins->n_out && !needed; k++) needed = live[ins->out + k];
    if (!needed) {
      dead++;
      continue;
    }
    for (int k = 0; k < ins->n_out; k++) live[ins->out + k] = true;
    for (int k = 0; k < ins->n_in; k++) live[ins->in[k]] = true;
  }
  if (!dead) { /* nothing to do: keep the body as it is */
    free(live);
    return 0;
  }
  pass_builder b;
  int rc = pass_begin(&b, f);
  for (int i = 0; i < f->n_instrs && !rc; i++)
    if (live[f->instrs[i].out]) rc = pass_copy(&b, &f->instrs[i]) < 0;
  free(live);
  if (rc) {
    pass_abort(&b);
    return pass_fail("dce");
  }
  return pass_commit(&b) ? pass_fail("dce") : 0;
}
