/* aot.c — what kiln-aot takes of a loaded function (kiln_function_load):
 * saved trace I as a call of its signature would make it, optimized by the
 * same pipeline, and the values its parameters past the inputs are bound
 * to (captured tensors, the variables' values now). */
#include <stdio.h>
#include <stdlib.h>

#include "saved.h"
#include "../lib/variable.h"

int jit_saved_trace(kiln_function *f, int trace, traced_fn *fn, kiln_tensor ***data, int *n_data) {
  const char *who = "kiln-aot";
  memset(fn, 0, sizeof *fn);
  *data = NULL, *n_data = 0;
  if (!f || !f->saved) return kiln_set_error("%s: not a function from kiln_function_load", who);
  const saved_fn *s = f->saved;
  if (trace < 0 || trace >= s->m.n_traces)
    return kiln_set_error("%s: @%s has %d saved trace%s (0 to %d); there is no trace %d", who, f->name, s->m.n_traces,
                          s->m.n_traces == 1 ? "" : "s", s->m.n_traces - 1, trace);
  const manifest_trace *t = &s->m.traces[trace];
  if (s->scope[trace] != 0)
    return kiln_set_error("%s: @%s: trace %d was made in device scope %s; objects run traces of cpu:0", who, f->name,
                          trace, t->device_scope);
  for (int i = 0; i < t->n_in; i++)
    if (s->in_device[trace][i] != 0)
      return kiln_set_error("%s: @%s: trace %d takes input %d on %s; objects take inputs on cpu:0", who, f->name,
                            trace, i, t->in[i].device);
  if (t->n_writes)
    return kiln_set_error("%s: @%s: trace %d assigns %d variable%s (a training step); objects run functions that "
                          "only read variables (inference)", who, f->name, trace, t->n_writes,
                          t->n_writes == 1 ? "" : "s");
  /* the trace that a call with inputs of its signature takes */
  kiln_scope_push();
  kiln_tensor **in = calloc((size_t)t->n_in + 1, sizeof *in);
  int rc = in ? 0 : kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < t->n_in && !rc; i++)
    if (!(in[i] = kiln_zeros(t->in[i].dtype, t->in[i].rank, t->in[i].shape))) rc = -1;
  if (!rc) rc = saved_trace_fn(f, in, fn);
  free(in);
  kiln_scope_pop();
  if (!rc) rc = function_optimize(f, fn);
  int n = fn->n_caps + fn->n_vars;
  kiln_tensor **d = rc ? NULL : calloc((size_t)n + 1, sizeof *d);
  if (!rc && !d) rc = kiln_set_error("%s: out of memory", who);
  for (int i = 0; !rc && i < n; i++)
    d[i] = i < fn->n_caps ? kiln_retain(fn->caps[i]) : variable_acquire(fn->vars[i - fn->n_caps]);
  if (rc) {
    free(d);
    traced_fn_free(fn);
    memset(fn, 0, sizeof *fn);
    return -1;
  }
  *data = d, *n_data = n;
  return 0;
}
