/* emit.c — the MLIR emitter's driver: a Kiln function becomes a func.func
 * over tensors, each instruction one or a few ops (the other files of this
 * folder), calls and fusions func.call of their callee (emitted once), and
 * the control-flow instructions scf ops whose regions hold their region
 * functions' bodies inline: cond as scf.if, while as scf.while (with a
 * counter when it has max_iterations), scan as scf.for building its
 * stacked outputs with tensor.insert_slice. */
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "mlir/emit.h"

/* one indented line of text, ending in a newline or not */
static void put_line(mlir_emitter *e, bool newline, const char *fmt, va_list ap) {
  for (int i = 0; i < e->indent; i++) ir_buf_put(e->b, "  ", 2);
  char small[1024];
  va_list again;
  va_copy(again, ap);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  if (n >= 0 && (size_t)n < sizeof small) {
    ir_buf_put(e->b, small, (size_t)n);
  } else if (n >= 0) { /* a long line: format it again into the right size */
    char *big = malloc((size_t)n + 1);
    if (big) vsnprintf(big, (size_t)n + 1, fmt, again);
    if (big) ir_buf_put(e->b, big, (size_t)n);
    else e->b->oom = true;
    free(big);
  }
  va_end(again);
  if (newline) ir_buf_put(e->b, "\n", 1);
}

void mlir_line(mlir_emitter *e, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  put_line(e, true, fmt, ap);
  va_end(ap);
}

void mlir_start(mlir_emitter *e, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  put_line(e, false, fmt, ap);
  va_end(ap);
}

char *mlir_fresh(mlir_emitter *e, char *buf) {
  snprintf(buf, MLIR_NAME, "%%t%d", e->tmp++);
  return buf;
}

int mlir_fail(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, const char *fmt, ...) {
  if (e->failed) return -1;
  char why[512], label[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  e->failed = true;
  return kiln_set_error("mlir: @%s: %s: %s: %s", s->f->name, ir_value_label(s->f, in->out, label, sizeof label),
                        kiln_ops[in->op].name, why);
}

/* the functions called or fused, to emit once each after their callers */
typedef struct callee_list {
  const ir_func **f;
  int n, cap;
} callee_list;

static int callee_add(callee_list *l, const ir_func *f) {
  for (int i = 0; i < l->n; i++)
    if (l->f[i] == f) return 0;
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 8;
    const ir_func **p = realloc(l->f, (size_t)cap * sizeof *p);
    if (!p) return kiln_set_error("mlir: out of memory");
    l->f = p, l->cap = cap;
  }
  l->f[l->n++] = f;
  return 0;
}

typedef struct emit_ctx {
  mlir_emitter *e;
  callee_list *callees;
} emit_ctx;

static int emit_body(emit_ctx *c, mlir_scope *s);

static int scope_open(mlir_scope *s, const ir_func *f) {
  s->f = f;
  s->name = calloc((size_t)f->n_values + 1, sizeof *s->name);
  return s->name ? 0 : kiln_set_error("mlir: out of memory");
}

/* "T0, T1" of the results of g */
static void result_types(ir_buf *b, const ir_func *g, int from, int n) {
  char ts[256];
  for (int k = from; k < from + n; k++) ir_buf_printf(b, "%s%s", k > from ? ", " : "", mlir_type(ts, &g->types[g->results[k]]));
}

/* "%r#k", result k of the op whose results are %r (fresh names: short) */
static void result_k(char *dst, const char *res, int k) {
  if (snprintf(dst, MLIR_NAME, "%s#%d", res, k) >= MLIR_NAME) dst[0] = '\0';
}

/* names of the results of an instruction with n_out results named res */
static void name_results(const mlir_scope *s, const ir_instr *in, const char *res) {
  if (in->n_out == 1) strcpy(s->name[in->out], res);
  for (int k = 0; in->n_out > 1 && k < in->n_out; k++) result_k(s->name[in->out + k], res, k);
}

/* The body of region g inline, its parameters named params; the names of
 * its results in results[]. */
static int emit_region(emit_ctx *c, const ir_func *g, char (*params)[MLIR_NAME], char (*results)[MLIR_NAME]) {
  mlir_scope r;
  if (scope_open(&r, g)) return -1;
  for (int i = 0; i < g->n_params; i++) strcpy(r.name[i], params[i]);
  int rc = emit_body(c, &r);
  for (int k = 0; !rc && k < g->n_results; k++) strcpy(results[k], r.name[g->results[k]]);
  free(r.name);
  return rc;
}

/* "scf.yield a, b : T, U" of g's results */
static void yield(mlir_emitter *e, const char *op, const ir_func *g, char (*results)[MLIR_NAME], int from, int n) {
  mlir_start(e, "%s ", op);
  for (int k = from; k < from + n; k++) ir_buf_printf(e->b, "%s%s", k > from ? ", " : "", results[k]);
  if (n) ir_buf_printf(e->b, " : ");
  result_types(e->b, g, from, n);
  ir_buf_printf(e->b, "\n");
}

typedef char name_t[MLIR_NAME];

static name_t *names_new(int n) { return calloc((size_t)n + 1, sizeof(name_t)); }

static int emit_cond(emit_ctx *c, mlir_scope *s, const ir_instr *in) {
  mlir_emitter *e = c->e;
  const ir_func *th = in->attrs.callee, *el = in->attrs.callee2;
  name_t p, res;
  name_t *args = names_new(in->n_in), *out = names_new(in->n_out);
  if (!args || !out) {
    free(args), free(out);
    return kiln_set_error("mlir: out of memory");
  }
  for (int i = 1; i < in->n_in; i++) strcpy(args[i - 1], s->name[in->in[i]]);
  mlir_line(e, "%s = tensor.extract %s[] : tensor<i1>", mlir_fresh(e, p), s->name[in->in[0]]);
  mlir_fresh(e, res);
  if (in->n_out > 1)
    mlir_start(e, "%s:%d = scf.if %s -> (", res, in->n_out, p);
  else
    mlir_start(e, "%s = scf.if %s -> (", res, p);
  result_types(e->b, th, 0, th->n_results);
  ir_buf_printf(e->b, ") {\n");
  int rc = 0;
  for (int br = 0; br < 2 && !rc; br++) {
    const ir_func *g = br ? el : th;
    e->indent++;
    rc = emit_region(c, g, args, out);
    if (!rc) yield(e, "scf.yield", g, out, 0, g->n_results);
    e->indent--;
    mlir_line(e, br ? "}" : "} else {");
  }
  if (!rc) name_results(s, in, res);
  free(args), free(out);
  return rc;
}

static int emit_while(emit_ctx *c, mlir_scope *s, const ir_instr *in) {
  mlir_emitter *e = c->e;
  const ir_func *cg = in->attrs.callee, *bg = in->attrs.callee2;
  int n = in->n_in, ns = in->attrs.n_state;
  bool counted = in->attrs.trip >= 0;
  name_t *args = names_new(n), *out = names_new(n), zero, res, ts_;
  if (!args || !out) {
    free(args), free(out);
    return kiln_set_error("mlir: out of memory");
  }
  char ts[256];
  if (counted) mlir_const_int(e, zero, "i64", 0);
  mlir_fresh(e, res);
  ir_buf *b = e->b;
  mlir_start(e, "%s:%d = scf.while (", res, ns + counted);
  for (int k = 0; k < ns; k++) ir_buf_printf(b, "%s%s = %s", k ? ", " : "", mlir_fresh(e, args[k]), s->name[in->in[k]]);
  if (counted) ir_buf_printf(b, ", %s = %s", mlir_fresh(e, ts_), zero);
  ir_buf_printf(b, ") : (");
  for (int pass = 0; pass < 2; pass++) {
    for (int k = 0; k < ns; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", mlir_type(ts, &s->f->types[in->in[k]]));
    if (counted) ir_buf_printf(b, ", i64");
    ir_buf_printf(b, pass ? ") {\n" : ") -> (");
  }
  for (int k = ns; k < n; k++) strcpy(args[k], s->name[in->in[k]]); /* captures */
  e->indent++;
  name_t p, cnt, trip, lt;
  int rc = 0;
  if (counted) { /* at most trip iterations: the condition runs only below it */
    strcpy(cnt, ts_);
    mlir_const_int(e, trip, "i64", in->attrs.trip);
    mlir_line(e, "%s = arith.cmpi slt, %s, %s : i64", mlir_fresh(e, lt), cnt, trip);
    mlir_line(e, "%s = scf.if %s -> (i1) {", mlir_fresh(e, p), lt);
    e->indent++;
  }
  rc = emit_region(c, cg, args, out);
  if (!rc) {
    name_t q;
    mlir_line(e, "%s = tensor.extract %s[] : tensor<i1>", mlir_fresh(e, q), out[0]);
    if (counted) {
      name_t f;
      mlir_line(e, "scf.yield %s : i1", q);
      e->indent--;
      mlir_line(e, "} else {");
      e->indent++;
      mlir_const_int(e, f, "i1", 0);
      mlir_line(e, "scf.yield %s : i1", f);
      e->indent--;
      mlir_line(e, "}");
    } else {
      strcpy(p, q);
    }
    mlir_start(e, "scf.condition(%s) ", p);
    for (int k = 0; k < ns; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", args[k]);
    if (counted) ir_buf_printf(b, ", %s", cnt);
    ir_buf_printf(b, " : ");
    for (int k = 0; k < ns; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", mlir_type(ts, &s->f->types[in->in[k]]));
    ir_buf_printf(b, "%s\n", counted ? ", i64" : "");
    e->indent--;
    mlir_line(e, "} do {");
    mlir_start(e, "^bb0(");
    for (int k = 0; k < ns; k++)
      ir_buf_printf(b, "%s%s: %s", k ? ", " : "", mlir_fresh(e, args[k]), mlir_type(ts, &s->f->types[in->in[k]]));
    if (counted) ir_buf_printf(b, ", %s: i64", mlir_fresh(e, cnt));
    ir_buf_printf(b, "):\n");
    e->indent++;
    rc = emit_region(c, bg, args, out);
  }
  if (!rc) {
    name_t one, next;
    if (counted) {
      mlir_const_int(e, one, "i64", 1);
      mlir_line(e, "%s = arith.addi %s, %s : i64", mlir_fresh(e, next), cnt, one);
    }
    mlir_start(e, "scf.yield ");
    for (int k = 0; k < ns; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", out[k]);
    if (counted) ir_buf_printf(b, ", %s", next);
    ir_buf_printf(b, " : ");
    result_types(b, bg, 0, ns);
    ir_buf_printf(b, "%s\n", counted ? ", i64" : "");
    e->indent--;
    mlir_line(e, "}");
    for (int k = 0; k < ns; k++) result_k(s->name[in->out + k], res, k);
  }
  free(args), free(out);
  return rc;
}

static int emit_scan(emit_ctx *c, mlir_scope *s, const ir_instr *in) {
  mlir_emitter *e = c->e;
  const ir_func *g = in->attrs.callee;
  int n = in->n_in, nc = in->attrs.n_state, nx = in->attrs.n_xs, nr = in->n_out;
  int64_t len = in->attrs.trip;
  name_t *args = names_new(n), *iter = names_new(nr), *init = names_new(nr), *out = names_new(nr);
  if (!args || !iter || !init || !out) {
    free(args), free(iter), free(init), free(out);
    return kiln_set_error("mlir: out of memory");
  }
  char ts[256], xs[256];
  name_t lo, hi, one, t, res, row;
  for (int k = 0; k < nc; k++) strcpy(init[k], s->name[in->in[k]]);
  for (int k = nc; k < nr; k++) mlir_empty(e, init[k], &s->f->types[in->out + k]);
  mlir_const_int(e, lo, "index", 0), mlir_const_int(e, hi, "index", len), mlir_const_int(e, one, "index", 1);
  mlir_fresh(e, res), mlir_fresh(e, t);
  ir_buf *b = e->b;
  if (nr > 1)
    mlir_start(e, "%s:%d = scf.for %s = %s to %s step %s iter_args(", res, nr, t, lo, hi, one);
  else
    mlir_start(e, "%s = scf.for %s = %s to %s step %s iter_args(", res, t, lo, hi, one);
  for (int k = 0; k < nr; k++) ir_buf_printf(b, "%s%s = %s", k ? ", " : "", mlir_fresh(e, iter[k]), init[k]);
  ir_buf_printf(b, ") -> (");
  for (int k = 0; k < nr; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", mlir_type(ts, &s->f->types[in->out + k]));
  ir_buf_printf(b, ") {\n");
  e->indent++;
  strcpy(row, t);
  if (in->attrs.reverse) { /* from the end: len - 1 - t */
    name_t last;
    mlir_const_int(e, last, "index", len - 1);
    mlir_line(e, "%s = arith.subi %s, %s : index", mlir_fresh(e, row), last, t);
  }
  for (int k = 0; k < nc; k++) strcpy(args[k], iter[k]);
  for (int k = nc; k < n; k++) strcpy(args[k], s->name[in->in[k]]);
  for (int k = nc; k < nc + nx; k++) { /* x_t: row t of xs k */
    const op_type *xt = &s->f->types[in->in[k]];
    op_type rt = *xt;
    rt.rank--;
    memmove(rt.shape, rt.shape + 1, (size_t)rt.rank * sizeof *rt.shape);
    mlir_start(e, "%s = tensor.extract_slice %s[%s", mlir_fresh(e, args[k]), s->name[in->in[k]], row);
    for (int d = 1; d < xt->rank; d++) ir_buf_printf(b, ", 0");
    ir_buf_printf(b, "] [1");
    for (int d = 1; d < xt->rank; d++) ir_buf_printf(b, ", %lld", (long long)xt->shape[d]);
    ir_buf_printf(b, "] [1");
    for (int d = 1; d < xt->rank; d++) ir_buf_printf(b, ", 1");
    ir_buf_printf(b, "] : %s to %s\n", mlir_type(xs, xt), mlir_type(ts, &rt));
  }
  int rc = emit_region(c, g, args, out);
  if (!rc) {
    for (int k = nc; k < nr; k++) { /* y_t into row t of its stack */
      const op_type *yt = &s->f->types[in->out + k];
      const op_type *rt = &g->types[g->results[k]];
      name_t next;
      mlir_start(e, "%s = tensor.insert_slice %s into %s[%s", mlir_fresh(e, next), out[k], iter[k], row);
      for (int d = 0; d < rt->rank; d++) ir_buf_printf(b, ", 0");
      ir_buf_printf(b, "] [1");
      for (int d = 0; d < rt->rank; d++) ir_buf_printf(b, ", %lld", (long long)rt->shape[d]);
      ir_buf_printf(b, "] [1");
      for (int d = 0; d < rt->rank; d++) ir_buf_printf(b, ", 1");
      ir_buf_printf(b, "] : %s into %s\n", mlir_type(xs, rt), mlir_type(ts, yt));
      strcpy(out[k], next);
    }
    mlir_start(e, "scf.yield ");
    for (int k = 0; k < nr; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", out[k]);
    ir_buf_printf(b, " : ");
    for (int k = 0; k < nr; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", mlir_type(ts, &s->f->types[in->out + k]));
    ir_buf_printf(b, "\n");
    e->indent--;
    mlir_line(e, "}");
    name_results(s, in, res);
  }
  free(args), free(iter), free(init), free(out);
  return rc;
}

static int emit_call(emit_ctx *c, mlir_scope *s, const ir_instr *in) {
  mlir_emitter *e = c->e;
  const ir_func *g = in->attrs.callee;
  if (callee_add(c->callees, g)) return -1;
  name_t res;
  char ts[256];
  ir_buf *b = e->b;
  mlir_fresh(e, res);
  if (in->n_out > 1)
    mlir_start(e, "%s:%d = func.call @%s(", res, in->n_out, g->name);
  else
    mlir_start(e, "%s = func.call @%s(", res, g->name);
  for (int k = 0; k < in->n_in; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", s->name[in->in[k]]);
  ir_buf_printf(b, ") : (");
  for (int k = 0; k < in->n_in; k++) ir_buf_printf(b, "%s%s", k ? ", " : "", mlir_type(ts, &s->f->types[in->in[k]]));
  ir_buf_printf(b, ") -> (");
  result_types(b, g, 0, g->n_results);
  ir_buf_printf(b, ")\n");
  name_results(s, in, res);
  return 0;
}

static int emit_instr(emit_ctx *c, mlir_scope *s, const ir_instr *in) {
  mlir_emitter *e = c->e;
  char *out = s->name[in->out];
  switch (kiln_ops[in->op].kind) {
  case OPK_UNARY:
  case OPK_BINARY:
  case OPK_COMPARE:
  case OPK_SELECT:
  case OPK_CONVERT: return mlir_emit_elementwise(e, s, in, out);
  case OPK_VIEW:
  case OPK_MOVE: return mlir_emit_movement(e, s, in, out);
  case OPK_REDUCE: return mlir_emit_reduce(e, s, in, out);
  case OPK_DOT: return mlir_emit_dot(e, s, in, out);
  case OPK_INDEX:
  case OPK_SOURCE: return mlir_emit_index(e, s, in, out);
  case OPK_WINDOW: return mlir_emit_window(e, s, in, out);
  case OPK_CONST:
    mlir_fresh(e, out);
    if (mlir_tensor_const(e, out, in->attrs.value)) return mlir_fail(e, s, in, "the constant is not on the CPU");
    return 0;
  case OPK_CALL: return emit_call(c, s, in);
  case OPK_CONTROL:
    return in->op == OP_COND ? emit_cond(c, s, in) : in->op == OP_WHILE ? emit_while(c, s, in) : emit_scan(c, s, in);
  case OPK_RANDOM:
    return mlir_fail(e, s, in, "random ops cannot be exported to MLIR (Kiln's Philox stream has no MLIR op)");
  case OPK_HOST:
    return mlir_fail(e, s, in, "@%s is a C callback, which MLIR cannot call", in->attrs.host ? in->attrs.host->name : "?");
  case OPK_COLLECTIVE:
    return mlir_fail(e, s, in, "a collective cannot be exported to MLIR (it runs on Kiln's MPI runtime)");
  }
  return mlir_fail(e, s, in, "no MLIR form");
}

static int emit_body(emit_ctx *c, mlir_scope *s) {
  for (int i = 0; i < s->f->n_instrs; i++)
    if (emit_instr(c, s, &s->f->instrs[i])) return -1;
  return c->e->b->oom ? kiln_set_error("mlir: out of memory") : 0;
}

static int emit_func(emit_ctx *c, const ir_func *f) {
  mlir_emitter *e = c->e;
  mlir_scope s;
  char ts[256];
  if (scope_open(&s, f)) return -1;
  e->tmp = 0;
  ir_buf *b = e->b;
  ir_buf_printf(b, "func.func @%s(", f->name);
  for (int i = 0; i < f->n_params; i++) {
    snprintf(s.name[i], MLIR_NAME, "%%arg%d", i);
    ir_buf_printf(b, "%s%s: %s", i ? ", " : "", s.name[i], mlir_type(ts, &f->types[i]));
  }
  ir_buf_printf(b, ") -> (");
  result_types(b, f, 0, f->n_results);
  ir_buf_printf(b, ") {\n");
  e->indent = 1;
  int rc = emit_body(c, &s);
  if (!rc) {
    name_t *res = names_new(f->n_results);
    if (!res) rc = kiln_set_error("mlir: out of memory");
    for (int k = 0; !rc && k < f->n_results; k++) strcpy(res[k], s.name[f->results[k]]);
    if (!rc) yield(e, "func.return", f, res, 0, f->n_results);
    free(res);
  }
  e->indent = 0;
  ir_buf_printf(b, "}\n");
  free(s.name);
  return rc;
}

/* roots, then every callee they reach, each once */
static char *emit_all(int n, const ir_func *const *roots) {
  ir_buf b = {0};
  mlir_emitter e = {&b, 0, 0, 0, false};
  callee_list done = {0}, callees = {0};
  emit_ctx c = {&e, &callees};
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) {
    if (roots[i]->region) rc = kiln_set_error("mlir: @%s is a region: emit the function that holds it", roots[i]->name);
    if (!rc) rc = callee_add(&done, roots[i]);
  }
  for (int i = 0; i < done.n && !rc; i++) {
    if (i) ir_buf_put(&b, "\n", 1);
    rc = emit_func(&c, done.f[i]);
    for (int k = 0; k < callees.n && !rc; k++) rc = callee_add(&done, callees.f[k]);
    callees.n = 0;
  }
  free(done.f);
  free(callees.f);
  if (rc) {
    free(b.s);
    return NULL;
  }
  return ir_buf_take(&b);
}

char *mlir_emit_func(const ir_func *f) {
  if (!f) {
    kiln_set_error("mlir: no function");
    return NULL;
  }
  if (ir_verify(f)) return NULL;
  return emit_all(1, &f);
}

/* whether some function of m calls, fuses or holds f as a region */
static bool is_callee(const ir_module *m, const ir_func *f) {
  if (f->region) return true;
  for (int i = 0; i < m->n_funcs; i++)
    for (int k = 0; k < m->funcs[i]->n_instrs; k++) {
      const ir_instr *in = &m->funcs[i]->instrs[k];
      if (kiln_ops[in->op].kind == OPK_CALL && in->attrs.callee == f) return true;
    }
  return false;
}

char *mlir_emit_module(const ir_module *m) {
  if (!m) {
    kiln_set_error("mlir: no module");
    return NULL;
  }
  if (ir_verify_module(m)) return NULL;
  const ir_func **roots = malloc(((size_t)m->n_funcs + 1) * sizeof *roots);
  if (!roots) {
    kiln_set_error("mlir: out of memory");
    return NULL;
  }
  int n = 0;
  for (int i = 0; i < m->n_funcs; i++)
    if (!is_callee(m, m->funcs[i])) roots[n++] = m->funcs[i];
  char *text = emit_all(n, roots);
  free(roots);
  return text;
}
