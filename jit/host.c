/* host.c — kiln_host_call, the escape hatch into C from staged code (TF's
 * py_func): eagerly it runs the callback and checks its outputs; while
 * tracing it records a host_call instruction that does so at each call. */
#include <stdlib.h>

#include "jit.h"

static int spec_type(const kiln_spec *s, int k, op_type *t) {
  if (!dtype_valid(s->dtype)) return kiln_set_error("host_call: out_specs[%d] has invalid dtype %d", k, (int)s->dtype);
  if (s->rank < 0 || s->rank > KILN_MAX_RANK)
    return kiln_set_error("host_call: out_specs[%d] has rank %d (0 to %d)", k, s->rank, KILN_MAX_RANK);
  t->dtype = s->dtype;
  t->rank = s->rank;
  for (int d = 0; d < s->rank; d++) t->shape[d] = s->shape[d];
  int64_t size;
  return shape_check("host_call", t->rank, t->shape, &size);
}

/* outputs against specs, as the host_call instruction checks them */
static int check_outputs(int n_out, const op_type *types, kiln_tensor **o) {
  for (int k = 0; k < n_out; k++) {
    const kiln_tensor *t = o[k];
    bool ok = t && !(t->flags & TF_SYMBOLIC) && t->dtype == types[k].dtype && t->rank == types[k].rank;
    for (int d = 0; ok && d < t->rank; d++) ok = t->shape[d] == types[k].shape[d];
    if (ok) continue;
    char w[256], g[256] = "NULL";
    ir_type_str(w, sizeof w, &types[k]);
    if (t) {
      op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
      for (int d = 0; d < t->rank; d++) ty.shape[d] = t->shape[d];
      ir_type_str(g, sizeof g, &ty);
    }
    return kiln_set_error("host_call: the callback returned %s for output %d, the spec says %s", g, k, w);
  }
  return 0;
}

int kiln_host_call(kiln_host_fn fn, void *user, int n_in, kiln_tensor *const *in, int n_out,
                   const kiln_spec *out_specs, kiln_tensor **out) {
  if (!fn) return kiln_set_error("host_call: fn is NULL");
  if (n_in < 0 || (n_in && !in)) return kiln_set_error("host_call: bad inputs (n_in = %d)", n_in);
  if (n_out < 1 || !out_specs || !out)
    return kiln_set_error("host_call: needs n_out >= 1 with out_specs and out (n_out = %d)", n_out);
  for (int i = 0; i < n_in; i++)
    if (!in[i]) return kiln_has_error() ? -1 : kiln_set_error("host_call: input %d is NULL", i);
  op_type small[4], *types = n_out <= 4 ? small : malloc((size_t)n_out * sizeof *types);
  if (!types) return kiln_set_error("host_call: out of memory");
  int rc = 0;
  for (int k = 0; k < n_out && !rc; k++) rc = spec_type(&out_specs[k], k, &types[k]);
  if (!rc && trace_current) {
    rc = trace_host_call(fn, user, n_in, in, n_out, types, out);
  } else if (!rc) {
    for (int i = 0; i < n_in && !rc; i++)
      if (in[i]->flags & TF_SYMBOLIC)
        rc = kiln_set_error("host_call: input %d is a symbolic tensor that escaped a staged function's body", i);
    kiln_tensor **o = rc ? NULL : calloc((size_t)n_out, sizeof *o);
    if (!rc && !o) rc = kiln_set_error("host_call: out of memory");
    if (!rc && fn(user, n_in, in, n_out, o) && !kiln_has_error())
      rc = kiln_set_error("host_call: the callback failed without an error");
    else if (!rc && kiln_has_error())
      rc = -1;
    if (!rc) rc = check_outputs(n_out, types, o);
    if (!rc) memcpy(out, o, (size_t)n_out * sizeof *o);
    free(o);
  }
  if (types != small) free(types);
  return rc;
}
