/* print.c — the text form (.kir) of IR: one canonical spelling of every
 * function, so that print -> parse -> print is byte-identical. Also the
 * Graphviz view of the dataflow (kiln-opt --emit=dot). */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir_internal.h"

/* ---- growable strings ---- */

static void buf_reserve(ir_buf *b, size_t extra) {
  if (b->oom || b->len + extra + 1 <= b->cap) return;
  size_t c = b->cap ? b->cap : 256;
  while (c < b->len + extra + 1) c *= 2;
  char *s = realloc(b->s, c);
  if (!s) {
    b->oom = true;
    return;
  }
  b->s = s;
  b->cap = c;
}

void ir_buf_put(ir_buf *b, const char *s, size_t n) {
  buf_reserve(b, n);
  if (b->oom) return;
  memcpy(b->s + b->len, s, n);
  b->len += n;
  b->s[b->len] = '\0';
}

void ir_buf_printf(ir_buf *b, const char *fmt, ...) {
  char small[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n < sizeof small) {
    ir_buf_put(b, small, (size_t)n);
    return;
  }
  buf_reserve(b, (size_t)n);
  if (b->oom) return;
  va_start(ap, fmt);
  vsnprintf(b->s + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
}

char *ir_buf_take(ir_buf *b) {
  ir_buf_put(b, "", 0);
  if (b->oom) {
    free(b->s);
    kiln_set_error("ir: out of memory");
    return NULL;
  }
  return b->s;
}

/* ---- pieces ---- */

static bool bare_char(char c, bool file) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '.' || (file && (c == '/' || c == '-' || c == '+'));
}

/* A function name or file name: bare when it is plain, else quoted. */
static void put_name(ir_buf *b, const char *s, bool file) {
  bool bare = *s != '\0' && (file || ir_ident_ok(s));
  for (const char *p = s; bare && *p; p++) bare = bare_char(*p, file);
  if (bare) {
    ir_buf_put(b, s, strlen(s));
    return;
  }
  ir_buf_put(b, "\"", 1);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    if (*p == '"' || *p == '\\')
      ir_buf_printf(b, "\\%c", *p);
    else if (*p < 0x20 || *p >= 0x7f)
      ir_buf_printf(b, "\\x%02x", *p);
    else
      ir_buf_put(b, (const char *)p, 1);
  }
  ir_buf_put(b, "\"", 1);
}

static void put_value(ir_buf *b, const ir_func *f, const int32_t *num, ir_value v) {
  if (v >= 0 && v < f->n_values && f->names[v])
    ir_buf_printf(b, "%%%s", f->names[v]);
  else
    ir_buf_printf(b, "%%%d", v >= 0 && v < f->n_values ? (int)num[v] : -1);
}

static void put_type(ir_buf *b, const op_type *t) {
  char s[256];
  ir_type_str(s, sizeof s, t);
  ir_buf_put(b, s, strlen(s));
}

static void put_i64_list(ir_buf *b, int n, const int64_t *v) {
  ir_buf_put(b, "[", 1);
  for (int i = 0; i < n; i++) ir_buf_printf(b, i ? ",%lld" : "%lld", (long long)v[i]);
  ir_buf_put(b, "]", 1);
}

static void put_int_list(ir_buf *b, int n, const int *v) {
  ir_buf_put(b, "[", 1);
  for (int i = 0; i < n; i++) ir_buf_printf(b, i ? ",%d" : "%d", v[i]);
  ir_buf_put(b, "]", 1);
}

/* The attributes of ops.def's list, in its order, every one spelled out. */
static void put_attrs(ir_buf *b, op_id op, const op_attrs *a) {
  const char *list = kiln_ops[op].attrs;
  if (!*list || op == OP_CONSTANT || kiln_ops[op].kind == OPK_CALL || kiln_ops[op].kind == OPK_HOST) return;
  ir_buf_put(b, " {", 2);
  for (const char *p = list; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    if (p != list) ir_buf_put(b, ", ", 2);
    ir_buf_put(b, p, n);
    ir_buf_put(b, "=", 1);
#define IS(k) (n == sizeof(k) - 1 && !memcmp(p, k, n))
    if (IS("dtype"))
      ir_buf_printf(b, "%s", kiln_dtype_name(a->dtype));
    else if (IS("shape") || IS("size"))
      put_i64_list(b, a->rank, a->shape);
    else if (IS("begin"))
      put_i64_list(b, a->rank, a->begin);
    else if (IS("axes") || IS("perm"))
      put_int_list(b, a->naxes, a->axes);
    else if (IS("axis"))
      ir_buf_printf(b, "%d", a->axis);
    else if (IS("keepdims"))
      ir_buf_printf(b, "%s", a->keepdims ? "true" : "false");
    else if (IS("lo"))
      ir_buf_printf(b, "%.17g", a->lo);
    else if (IS("hi"))
      ir_buf_printf(b, "%.17g", a->hi);
    else if ((IS("seed") || IS("counter")) && a->stateful)
      ir_buf_put(b, "global", 6); /* drawn from the global stream at run time */
    else if (IS("seed"))
      ir_buf_printf(b, "%llu", (unsigned long long)a->seed);
    else if (IS("counter"))
      ir_buf_printf(b, "%llu", (unsigned long long)a->counter);
    else if (IS("state") || IS("carry"))
      ir_buf_printf(b, "%d", a->n_state);
    else if (IS("xs"))
      ir_buf_printf(b, "%d", a->n_xs);
    else if (IS("max_iterations") || IS("length"))
      ir_buf_printf(b, "%lld", (long long)a->trip);
    else if (IS("reverse"))
      ir_buf_printf(b, "%s", a->reverse ? "true" : "false");
    else if (IS("stride"))
      put_int_list(b, 2, a->stride);
    else if (IS("dilation"))
      put_int_list(b, 2, a->dilation);
    else if (IS("padding"))
      put_int_list(b, 4, a->padding);
    else if (IS("window"))
      put_int_list(b, 2, a->window);
    else if (IS("groups"))
      ir_buf_printf(b, "%d", a->groups);
    else if (IS("reduce"))
      ir_buf_printf(b, "%s", a->reduce >= 0 && a->reduce < 4 ? ir_reduce_names[a->reduce] : "?");
    else if (IS("root"))
      ir_buf_printf(b, "%d", a->root);
    else if (IS("world"))
      ir_buf_printf(b, "%d", a->world);
#undef IS
    p = e ? e + 1 : p + n;
  }
  ir_buf_put(b, "}", 1);
}

/* ---- constants ---- */

/* The decimal spelling of element i; false if it would not parse back to
 * the same bits (NaN payloads, bool bytes other than 0/1). */
static bool elem_text(const kiln_tensor *t, int64_t i, char *s, size_t n) {
  const void *d = t->data;
  switch ((kiln_dtype)t->dtype) {
  case KILN_F32: snprintf(s, n, "%.9g", (double)((const float *)d)[i]); break;
  case KILN_F64: snprintf(s, n, "%.17g", ((const double *)d)[i]); break;
  case KILN_I32: snprintf(s, n, "%d", (int)((const int32_t *)d)[i]); break;
  case KILN_I64: snprintf(s, n, "%lld", (long long)((const int64_t *)d)[i]); break;
  case KILN_BOOL: snprintf(s, n, "%s", ((const uint8_t *)d)[i] ? "true" : "false"); break;
  case KILN_F16: snprintf(s, n, "%.9g", (double)kiln_f16_to_f32(((const uint16_t *)d)[i])); break;
  case KILN_BF16: snprintf(s, n, "%.9g", (double)kiln_bf16_to_f32(((const uint16_t *)d)[i])); break;
  }
  size_t es = kiln_dtype_sizes[t->dtype];
  unsigned char back[8];
  if (ir_elem_from_text((kiln_dtype)t->dtype, s, strlen(s), back, 0)) return false;
  return !memcmp(back, (const unsigned char *)d + (size_t)i * es, es);
}

enum { INLINE_MAX = 16 }; /* more elements print as hex bytes */

static void put_dense(ir_buf *b, const kiln_tensor *t) {
  char s[64];
  bool text = t->size <= INLINE_MAX;
  for (int64_t i = 0; text && i < t->size; i++) text = elem_text(t, i, s, sizeof s);
  ir_buf_put(b, "dense<", 6);
  if (text) {
    if (t->rank > 0) ir_buf_put(b, "[", 1);
    for (int64_t i = 0; i < t->size; i++) {
      elem_text(t, i, s, sizeof s);
      if (i) ir_buf_put(b, ", ", 2);
      ir_buf_put(b, s, strlen(s));
    }
    if (t->rank > 0) ir_buf_put(b, "]", 1);
  } else {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = t->data;
    size_t bytes = tensor_bytes(t);
    buf_reserve(b, 2 + 2 * bytes);
    ir_buf_put(b, "0x", 2);
    for (size_t i = 0; i < bytes && !b->oom; i++) {
      char h[2] = {hex[p[i] >> 4], hex[p[i] & 15]};
      ir_buf_put(b, h, 2);
    }
  }
  ir_buf_put(b, ">", 1);
}

/* ---- functions ---- */

/* The roles of a control-flow instruction's regions, as printed. */
static const char *region_role(op_id op, int k) {
  static const char *roles[][2] = {{"then", "else"}, {"cond", "body"}, {"body", "body"}};
  return roles[op == OP_COND ? 0 : op == OP_WHILE ? 1 : 2][k];
}

static void put_indent(ir_buf *b, int n) {
  for (int i = 0; i < n; i++) ir_buf_put(b, " ", 1);
}

/* f, each line indented by indent spaces after the first (which the caller
 * places); regions print nested under their instruction, 4 deeper. */
static void put_func(ir_buf *b, const ir_func *f, int indent, int depth) {
  int32_t *num = malloc(((size_t)f->n_values + 1) * sizeof *num);
  if (!num || depth > 64) {
    free(num);
    b->oom = true;
    return;
  }
  ir_number_values(f, num);
  ir_buf_put(b, "func @", 6);
  put_name(b, f->name, false);
  ir_buf_put(b, "(", 1);
  for (int i = 0; i < f->n_params; i++) {
    if (i) ir_buf_put(b, ", ", 2);
    put_value(b, f, num, i);
    ir_buf_put(b, ": ", 2);
    put_type(b, &f->types[i]);
  }
  ir_buf_put(b, ") -> ", 5);
  if (f->n_results != 1) ir_buf_put(b, "(", 1);
  for (int i = 0; i < f->n_results; i++) {
    if (i) ir_buf_put(b, ", ", 2);
    ir_value r = f->results[i];
    if (r >= 0 && r < f->n_values)
      put_type(b, &f->types[r]);
    else
      ir_buf_put(b, "?", 1);
  }
  if (f->n_results != 1) ir_buf_put(b, ")", 1);
  ir_buf_put(b, " {\n", 3);
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i];
    put_indent(b, indent + 2);
    for (int k = 0; k < in->n_out; k++) {
      if (k) ir_buf_put(b, ", ", 2);
      put_value(b, f, num, in->out + k);
    }
    ir_buf_printf(b, " = %s", (unsigned)in->op < OP_COUNT ? kiln_ops[in->op].name : "?");
    if (in->op == OP_CONSTANT && in->attrs.value) {
      ir_buf_put(b, " ", 1);
      put_dense(b, in->attrs.value);
    }
    bool control = (unsigned)in->op < OP_COUNT && kiln_ops[in->op].kind == OPK_CONTROL;
    const char *callee = control ? NULL
                         : in->attrs.callee ? in->attrs.callee->name
                         : in->attrs.host   ? in->attrs.host->name
                                            : NULL;
    if (callee) { /* call @g(%a, %b) */
      ir_buf_put(b, " @", 2);
      put_name(b, callee, false);
      ir_buf_put(b, "(", 1);
    }
    for (int k = 0; k < in->n_in; k++) {
      ir_buf_put(b, k ? ", " : callee ? "" : " ", k ? 2 : callee ? 0 : 1);
      put_value(b, f, num, in->in[k]);
    }
    if (callee) ir_buf_put(b, ")", 1);
    if ((unsigned)in->op < OP_COUNT) put_attrs(b, in->op, &in->attrs);
    ir_buf_put(b, " : ", 3);
    for (int k = 0; k < in->n_out; k++) {
      if (k) ir_buf_put(b, ", ", 2);
      if (in->out + k >= 0 && in->out + k < f->n_values) put_type(b, &f->types[in->out + k]);
      if (f->buf_offset && in->out + k >= 0 && in->out + k < f->n_values && f->buf_offset[in->out + k] >= 0)
        ir_buf_printf(b, " buf(%lld, %lld)", (long long)f->buf_offset[in->out + k],
                      (long long)ir_type_bytes(&f->types[in->out + k])); /* its arena offset and bytes */
    }
    if (in->loc.file) {
      ir_buf_put(b, "  loc(", 6);
      put_name(b, in->loc.file, true);
      ir_buf_printf(b, ":%d)", in->loc.line);
    }
    ir_buf_put(b, "\n", 1);
    const ir_func *rg[2];
    int nr = ir_regions(in, rg);
    for (int k = 0; k < nr; k++) {
      if (!rg[k]) continue;
      put_indent(b, indent + 4);
      const char *role = region_role(in->op, k);
      ir_buf_printf(b, "%s ", role);
      put_func(b, rg[k], indent + 4, depth + 1);
    }
  }
  put_indent(b, indent + 2);
  ir_buf_put(b, "return", 6);
  for (int i = 0; i < f->n_results; i++) {
    ir_buf_put(b, i ? ", " : " ", i ? 2 : 1);
    put_value(b, f, num, f->results[i]);
  }
  ir_buf_put(b, "\n", 1);
  put_indent(b, indent);
  ir_buf_put(b, "}\n", 2);
  free(num);
}

char *ir_print_func(const ir_func *f) {
  ir_buf b = {0};
  if (!f) {
    kiln_set_error("ir_print_func: no function");
    return NULL;
  }
  put_func(&b, f, 0, 0);
  return ir_buf_take(&b);
}

static void put_func_after_callees(ir_buf *b, const ir_module *m, const ir_func *g, bool *done, int depth);

/* The functions g's instructions call, and those its regions call. */
static void put_callees(ir_buf *b, const ir_module *m, const ir_func *g, bool *done, int depth) {
  if (depth > 64) return;
  for (int i = 0; i < g->n_instrs; i++) {
    const ir_instr *in = &g->instrs[i];
    const ir_func *rg[2];
    int nr = ir_regions(in, rg);
    for (int k = 0; k < nr; k++)
      if (rg[k]) put_callees(b, m, rg[k], done, depth + 1);
    if (!nr && in->attrs.callee) put_func_after_callees(b, m, in->attrs.callee, done, depth + 1);
  }
}

/* Prints g after every function it calls (each once), so that the text
 * reads, and parses, callees first; regions print inside their instruction. */
static void put_func_after_callees(ir_buf *b, const ir_module *m, const ir_func *g, bool *done, int depth) {
  int k = 0;
  while (k < m->n_funcs && m->funcs[k] != g) k++;
  if (k == m->n_funcs || done[k] || depth > 64 || g->region) return;
  done[k] = true;
  put_callees(b, m, g, done, depth);
  if (b->len) ir_buf_put(b, "\n", 1);
  put_func(b, g, 0, 0);
}

char *ir_print_module(const ir_module *m) {
  ir_buf b = {0};
  if (!m) {
    kiln_set_error("ir_print_module: no module");
    return NULL;
  }
  bool *done = calloc((size_t)m->n_funcs + 1, sizeof *done);
  if (!done) {
    kiln_set_error("ir: out of memory");
    return NULL;
  }
  for (int i = 0; i < m->n_funcs; i++) put_func_after_callees(&b, m, m->funcs[i], done, 0);
  free(done);
  return ir_buf_take(&b);
}

/* ---- Graphviz ---- */

char *ir_print_dot(const ir_module *m) {
  ir_buf b = {0};
  if (!m) {
    kiln_set_error("ir_print_dot: no module");
    return NULL;
  }
  ir_buf_printf(&b, "digraph kir {\n  node [shape=box, fontname=monospace];\n");
  for (int k = 0; k < m->n_funcs; k++) {
    const ir_func *f = m->funcs[k];
    char t[256], l[256];
    ir_buf_printf(&b, "  subgraph cluster_%d {\n    label=\"@", k);
    put_name(&b, f->name, true);
    ir_buf_put(&b, "\";\n", 3);
    for (int v = 0; v < f->n_params; v++)
      ir_buf_printf(&b, "    f%d_v%d [label=\"%s: %s\", shape=ellipse];\n", k, v,
                    ir_value_label(f, v, l, sizeof l), ir_type_str(t, sizeof t, &f->types[v]));
    for (int i = 0; i < f->n_instrs; i++) {
      const ir_instr *in = &f->instrs[i];
      ir_buf_printf(&b, "    f%d_v%d [label=\"%s = %s\\n%s\"];\n", k, (int)in->out,
                    ir_value_label(f, in->out, l, sizeof l), kiln_ops[in->op].name,
                    ir_type_str(t, sizeof t, &f->types[in->out]));
      for (int j = 0; j < in->n_in; j++)
        ir_buf_printf(&b, "    f%d_v%d -> f%d_v%d;\n", k, (int)in->in[j], k, (int)in->out);
    }
    for (int r = 0; r < f->n_results; r++) {
      ir_buf_printf(&b, "    f%d_r%d [label=\"result %d\", shape=ellipse];\n", k, r, r);
      ir_buf_printf(&b, "    f%d_v%d -> f%d_r%d;\n", k, (int)f->results[r], k, r);
    }
    ir_buf_put(&b, "  }\n", 4);
  }
  ir_buf_put(&b, "}\n", 2);
  return ir_buf_take(&b);
}

/* ---- reading one element back (shared with parse.c) ---- */

int ir_elem_from_text(kiln_dtype dt, const char *tok, size_t len, void *data, int64_t i) {
  char s[64];
  if (len == 0 || len >= sizeof s) return -1;
  memcpy(s, tok, len);
  s[len] = '\0';
  char *end = NULL;
  errno = 0;
  switch (dt) {
  case KILN_BOOL:
    if (!strcmp(s, "true") || !strcmp(s, "false")) {
      ((uint8_t *)data)[i] = s[0] == 't';
      return 0;
    }
    return -1;
  case KILN_I32:
  case KILN_I64: {
    long long v = strtoll(s, &end, 10);
    if (*end || errno == ERANGE || (dt == KILN_I32 && (v < INT32_MIN || v > INT32_MAX))) return -1;
    if (dt == KILN_I32)
      ((int32_t *)data)[i] = (int32_t)v;
    else
      ((int64_t *)data)[i] = v;
    return 0;
  }
  case KILN_F64: {
    double v = strtod(s, &end);
    if (*end || end == s) return -1;
    ((double *)data)[i] = v;
    return 0;
  }
  case KILN_F32:
  case KILN_F16:
  case KILN_BF16: {
    float v = strtof(s, &end);
    if (*end || end == s) return -1;
    if (dt == KILN_F32)
      ((float *)data)[i] = v;
    else
      ((uint16_t *)data)[i] = dt == KILN_F16 ? kiln_f32_to_f16(v) : kiln_f32_to_bf16(v);
    return 0;
  }
  }
  return -1;
}
