/* interp.c — the reference interpreter: runs an IR function instruction by
 * instruction through op_apply, the eager front end, so it gives exactly the
 * eager results. Every compiled path is tested against it, and constant
 * folding evaluates through it. */
#include <stdlib.h>

#include "ir_internal.h"

static int arg_error(const ir_func *f, int i, const kiln_tensor *t) {
  char want[256], have[256] = "NULL";
  ir_type_str(want, sizeof want, &f->types[i]);
  if (t) {
    op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
    for (int k = 0; k < t->rank; k++) ty.shape[k] = t->shape[k];
    ir_type_str(have, sizeof have, &ty);
  }
  return kiln_set_error("interpret: @%s: argument %d is %s, the parameter is %s", f->name, i, have, want);
}

int ir_interpret(const ir_func *f, kiln_tensor *const *args, kiln_tensor **results) {
  if (!f) return kiln_set_error("interpret: no function");
  if (ir_verify(f)) return -1;
  if ((f->n_params && !args) || (f->n_results && !results))
    return kiln_set_error("interpret: @%s: args or results is NULL", f->name);
  for (int i = 0; i < f->n_params; i++) {
    const kiln_tensor *t = args[i];
    bool ok = t && t->dtype == f->types[i].dtype && t->rank == f->types[i].rank;
    for (int k = 0; ok && k < t->rank; k++) ok = t->shape[k] == f->types[i].shape[k];
    if (!ok) return arg_error(f, i, t);
  }
  kiln_tensor **vals = calloc((size_t)f->n_values + 1, sizeof *vals);
  kiln_tensor **ins = NULL;
  int cap = 0, rc = 0;
  if (!vals) return kiln_set_error("interpret: out of memory");
  for (int i = 0; i < f->n_params; i++) vals[i] = args[i];
  /* intermediates belong to this scope and die with it */
  kiln_scope_push();
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *in = &f->instrs[i];
    kiln_tensor *out;
    if (in->op == OP_CONSTANT) {
      out = scope_own(kiln_retain(in->attrs.value));
    } else {
      if (in->n_in > cap) {
        kiln_tensor **q = realloc(ins, (size_t)in->n_in * sizeof *q);
        if (!q) {
          rc = kiln_set_error("interpret: out of memory");
          break;
        }
        ins = q;
        cap = in->n_in;
      }
      for (int k = 0; k < in->n_in; k++) ins[k] = vals[in->in[k]];
      out = op_apply(in->op, &in->attrs, in->n_in, ins);
    }
    if (!out) {
      char msg[1024], label[160];
      snprintf(msg, sizeof msg, "%s", kiln_last_error());
      rc = kiln_set_error("interpret: @%s: %s: %s", f->name, ir_value_label(f, in->out, label, sizeof label), msg);
      break;
    }
    vals[in->out] = out;
  }
  if (!rc)
    for (int r = 0; r < f->n_results; r++) kiln_retain(vals[f->results[r]]);
  kiln_scope_pop();
  if (!rc)
    for (int r = 0; r < f->n_results; r++) results[r] = scope_own(vals[f->results[r]]);
  free(ins);
  free(vals);
  return rc;
}
