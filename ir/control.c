/* control.c — the typing rules of the control-flow instructions (cond,
 * while, scan: ops.def): what their regions take and return, and the
 * result types of the instruction. Shared by the builder, the parser and
 * the verifier through ir_check_instr. */
#include <stdlib.h>

#include "ir_internal.h"

static int type_mismatch(const char *api, const char *what, int i, const char *region, const op_type *want,
                         const op_type *got) {
  char x[256], y[256];
  return kiln_set_error("%s: %s %d of @%s is %s, expected %s", api, what, i, region, ir_type_str(x, sizeof x, got),
                        ir_type_str(y, sizeof y, want));
}

static bool scalar_bool(const op_type *t) { return t->dtype == KILN_BOOL && t->rank == 0; }

/* g takes exactly params[0..n). */
static int check_params(const char *api, const ir_func *g, int n, const op_type *params) {
  if (g->n_params != n)
    return kiln_set_error("%s: @%s takes %d parameter%s, expected %d", api, g->name, g->n_params,
                          g->n_params == 1 ? "" : "s", n);
  for (int i = 0; i < n; i++)
    if (!ir_type_eq(&g->types[i], &params[i])) return type_mismatch(api, "parameter", i, g->name, &params[i], &g->types[i]);
  return 0;
}

/* The type of result k of g, or NULL with the error set. */
static const op_type *result_type(const char *api, const ir_func *g, int k) {
  ir_value r = k < g->n_results ? g->results[k] : -1;
  if (r < 0 || r >= g->n_values) {
    kiln_set_error("%s: @%s: result %d is not a value", api, g->name, k);
    return NULL;
  }
  return &g->types[r];
}

static int check_region(const char *api, const ir_module *m, const ir_func *g, const char *role) {
  if (!g) return kiln_set_error("%s: no %s region", api, role);
  if (!m) return 0; /* regions being built (tracing): not yet in a module */
  for (int i = 0; m && i < m->n_funcs; i++)
    if (m->funcs[i] == g) return 0;
  return kiln_set_error("%s: the %s region is not a function of this module", api, role);
}

static int check_cond(const ir_module *m, const op_attrs *a, int n, const op_type *in, int *n_out, op_type **out) {
  const char *api = "cond";
  if (check_region(api, m, a->callee, "then") || check_region(api, m, a->callee2, "else")) return -1;
  if (n < 1) return kiln_set_error("%s: needs a predicate", api);
  char t[256];
  if (!scalar_bool(&in[0]))
    return kiln_set_error("%s: the predicate is %s, expected bool[] (a scalar)", api, ir_type_str(t, sizeof t, &in[0]));
  const ir_func *th = a->callee, *el = a->callee2;
  if (check_params(api, th, n - 1, in + 1) || check_params(api, el, n - 1, in + 1)) return -1;
  if (th->n_results < 1) return kiln_set_error("%s: @%s returns nothing", api, th->name);
  if (th->n_results != el->n_results)
    return kiln_set_error("%s: the branches disagree: @%s returns %d values, @%s %d", api, th->name, th->n_results,
                          el->name, el->n_results);
  if (!(*out = malloc((size_t)th->n_results * sizeof **out))) return kiln_set_error("ir: out of memory");
  for (int k = 0; k < th->n_results; k++) {
    const op_type *x = result_type(api, th, k), *y = x ? result_type(api, el, k) : NULL;
    if (!y) goto fail;
    if (!ir_type_eq(x, y)) {
      char u[256], v[256];
      kiln_set_error("%s: the branches disagree: result %d of @%s is %s, of @%s %s", api, k, th->name,
                     ir_type_str(u, sizeof u, x), el->name, ir_type_str(v, sizeof v, y));
      goto fail;
    }
    (*out)[k] = *x;
  }
  *n_out = th->n_results;
  return 0;
fail:
  free(*out);
  *out = NULL;
  return -1;
}

static int check_while(const ir_module *m, const op_attrs *a, int n, const op_type *in, int *n_out, op_type **out) {
  const char *api = "while_loop";
  if (check_region(api, m, a->callee, "cond") || check_region(api, m, a->callee2, "body")) return -1;
  int ns = a->n_state;
  if (ns < 1 || ns > n) return kiln_set_error("%s: state=%d with %d operands", api, ns, n);
  if (a->trip < -1) return kiln_set_error("%s: max_iterations=%lld (-1 or more)", api, (long long)a->trip);
  const ir_func *c = a->callee, *b = a->callee2;
  if (check_params(api, c, n, in) || check_params(api, b, n, in)) return -1;
  if (c->n_results != 1) return kiln_set_error("%s: @%s returns %d values, expected one bool[]", api, c->name, c->n_results);
  const op_type *p = result_type(api, c, 0);
  if (!p) return -1;
  char t[256];
  if (!scalar_bool(p))
    return kiln_set_error("%s: @%s returns %s, expected bool[] (a scalar)", api, c->name, ir_type_str(t, sizeof t, p));
  if (b->n_results != ns)
    return kiln_set_error("%s: @%s returns %d values for a state of %d", api, b->name, b->n_results, ns);
  for (int k = 0; k < ns; k++) {
    const op_type *r = result_type(api, b, k);
    if (!r) return -1;
    if (!ir_type_eq(r, &in[k])) return type_mismatch(api, "result", k, b->name, &in[k], r);
  }
  if (!(*out = malloc((size_t)ns * sizeof **out))) return kiln_set_error("ir: out of memory");
  for (int k = 0; k < ns; k++) (*out)[k] = in[k];
  *n_out = ns;
  return 0;
}

static int check_scan(const ir_module *m, const op_attrs *a, int n, const op_type *in, int *n_out, op_type **out) {
  const char *api = "scan";
  if (check_region(api, m, a->callee, "body")) return -1;
  if (a->callee2) return kiln_set_error("%s: has one region", api);
  int nc = a->n_state, nx = a->n_xs;
  if (nc < 0 || nx < 0 || nc + nx > n) return kiln_set_error("%s: carry=%d, xs=%d with %d operands", api, nc, nx, n);
  if (a->trip < 0) return kiln_set_error("%s: length=%lld must not be negative", api, (long long)a->trip);
  op_type *params = malloc(((size_t)n + 1) * sizeof *params);
  if (!params) return kiln_set_error("ir: out of memory");
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) {
    params[i] = in[i];
    if (i < nc || i >= nc + nx) continue;
    char t[256];
    if (in[i].rank < 1 || in[i].shape[0] != a->trip) {
      rc = kiln_set_error("%s: xs %d is %s, expected a leading axis of length %lld", api, i - nc,
                          ir_type_str(t, sizeof t, &in[i]), (long long)a->trip);
      break;
    }
    params[i].rank--; /* x_t: one slice along axis 0 */
    for (int d = 0; d < params[i].rank; d++) params[i].shape[d] = in[i].shape[d + 1];
  }
  const ir_func *b = a->callee;
  if (!rc) rc = check_params(api, b, n, params);
  free(params);
  if (rc) return -1;
  if (b->n_results < nc || b->n_results < 1)
    return kiln_set_error("%s: @%s returns %d values, expected %d carries and any ys (at least one value)", api,
                          b->name, b->n_results, nc);
  if (!(*out = malloc((size_t)b->n_results * sizeof **out))) return kiln_set_error("ir: out of memory");
  for (int k = 0; k < b->n_results; k++) {
    const op_type *r = result_type(api, b, k);
    if (!r) goto fail;
    if (k < nc) {
      if (!ir_type_eq(r, &in[k])) {
        type_mismatch(api, "result", k, b->name, &in[k], r);
        goto fail;
      }
      (*out)[k] = *r;
      continue;
    }
    if (r->rank >= KILN_MAX_RANK) {
      kiln_set_error("%s: @%s: y %d has rank %d: stacked it would pass %d", api, b->name, k - nc, r->rank,
                     KILN_MAX_RANK);
      goto fail;
    }
    op_type *y = &(*out)[k];
    y->dtype = r->dtype;
    y->rank = r->rank + 1;
    y->shape[0] = a->trip;
    for (int d = 0; d < r->rank; d++) y->shape[d + 1] = r->shape[d];
    if (ir_type_check(api, y)) goto fail;
  }
  *n_out = b->n_results;
  return 0;
fail:
  free(*out);
  *out = NULL;
  return -1;
}

int ir_check_control(const ir_module *m, op_id op, const op_attrs *a, int n, const op_type *in, int *n_out,
                     op_type **out) {
  switch (op) {
  case OP_COND: return check_cond(m, a, n, in, n_out, out);
  case OP_WHILE: return check_while(m, a, n, in, n_out, out);
  case OP_SCAN: return check_scan(m, a, n, in, n_out, out);
  default: return kiln_set_error("ir: %s is not control flow", kiln_ops[op].name);
  }
}
