/* manifest.c — a saved function's manifest.json (manifest.h) written and
 * read back. The writer spells everything one way (keys in a fixed order,
 * integers in decimal), so a save is deterministic; the reader goes through
 * lib/json's steps and then checks every count, index and type, since the
 * file may be truncated, corrupt or from a newer Kiln. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"
#include "json.h"
#include "manifest.h"

/* ---- writing ---- */

static void put_int(json_buf *b, const char *key, int64_t v) {
  char tmp[64];
  snprintf(tmp, sizeof tmp, "\"%s\": %" PRId64, key, v);
  json_buf_str(b, tmp);
}

static void put_str(json_buf *b, const char *key, const char *v) {
  json_buf_quoted(b, key);
  json_buf_str(b, ": ");
  json_buf_quoted(b, v);
}

/* {"name": ..., "dtype": "f32", "shape": [2, 3], "device": ...} */
static void put_tensor(json_buf *b, const manifest_tensor *t) {
  json_buf_str(b, "{");
  if (t->name) {
    put_str(b, "name", t->name);
    json_buf_str(b, ", ");
  }
  put_str(b, "dtype", kiln_dtype_name(t->dtype));
  json_buf_str(b, ", \"shape\": [");
  for (int k = 0; k < t->rank; k++) {
    if (k) json_buf_str(b, ", ");
    json_buf_u64(b, (uint64_t)t->shape[k]);
  }
  json_buf_str(b, "]");
  if (t->device) {
    json_buf_str(b, ", ");
    put_str(b, "device", t->device);
  }
  json_buf_str(b, "}");
}

static void put_tensors(json_buf *b, const char *key, int n, const manifest_tensor *t, const char *indent) {
  json_buf_quoted(b, key);
  json_buf_str(b, ": [");
  for (int i = 0; i < n; i++) {
    json_buf_str(b, i ? ",\n" : "\n");
    json_buf_str(b, indent);
    put_tensor(b, &t[i]);
  }
  json_buf_str(b, "]");
}

static void put_ints(json_buf *b, const char *key, int n, const int *v) {
  json_buf_quoted(b, key);
  json_buf_str(b, ": [");
  for (int i = 0; i < n; i++) {
    if (i) json_buf_str(b, ", ");
    json_buf_u64(b, (uint64_t)v[i]);
  }
  json_buf_str(b, "]");
}

char *manifest_write(const manifest *m) {
  json_buf b = {0};
  json_buf_str(&b, "{\n  ");
  put_int(&b, "format", m->format);
  json_buf_str(&b, ",\n  ");
  put_str(&b, "kiln_version", m->kiln_version);
  json_buf_str(&b, ",\n  ");
  put_str(&b, "function", m->function);
  json_buf_str(&b, ",\n  ");
  put_int(&b, "inputs", m->n_in);
  json_buf_str(&b, ",\n  ");
  put_int(&b, "outputs", m->n_out);
  json_buf_str(&b, ",\n  \"optimize_for_inference\": ");
  json_buf_str(&b, m->inference ? "true" : "false");
  json_buf_str(&b, ",\n  ");
  put_str(&b, "static_arguments", m->static_letters);
  json_buf_str(&b, ",\n  ");
  put_tensors(&b, "variables", m->n_vars, m->vars, "    ");
  json_buf_str(&b, ",\n  \"traces\": [");
  for (int i = 0; i < m->n_traces; i++) {
    const manifest_trace *t = &m->traces[i];
    json_buf_str(&b, i ? ",\n    {\n      " : "\n    {\n      ");
    put_str(&b, "ir", t->ir);
    json_buf_str(&b, ",\n      ");
    put_str(&b, "func", t->func);
    json_buf_str(&b, ",\n      ");
    put_str(&b, "device_scope", t->device_scope);
    json_buf_str(&b, ",\n      ");
    put_tensors(&b, "inputs", t->n_in, t->in, "        ");
    json_buf_str(&b, ",\n      ");
    put_tensors(&b, "outputs", t->n_out, t->out, "        ");
    json_buf_str(&b, ",\n      \"static_values\": [");
    for (int s = 0; s < t->n_statics; s++) {
      if (s) json_buf_str(&b, ", ");
      json_buf_quoted(&b, t->statics[s]);
    }
    json_buf_str(&b, "],\n      ");
    put_tensors(&b, "constants", t->n_consts, t->consts, "        ");
    json_buf_str(&b, ",\n      ");
    put_ints(&b, "variables", t->n_vars, t->vars);
    json_buf_str(&b, ",\n      ");
    put_ints(&b, "writes", t->n_writes, t->writes);
    json_buf_str(&b, "\n    }");
  }
  json_buf_str(&b, "]\n}\n");
  if (b.oom) {
    free(b.s);
    return NULL;
  }
  return b.s;
}

/* ---- reading ---- */

static void tensor_free(manifest_tensor *t) {
  free(t->name);
  free(t->device);
}

static void trace_free(manifest_trace *t) {
  free(t->ir);
  free(t->func);
  free(t->device_scope);
  for (int i = 0; t->in && i < t->n_in; i++) tensor_free(&t->in[i]);
  for (int i = 0; t->out && i < t->n_out; i++) tensor_free(&t->out[i]);
  for (int i = 0; t->consts && i < t->n_consts; i++) tensor_free(&t->consts[i]);
  for (int i = 0; t->statics && i < t->n_statics; i++) free(t->statics[i]);
  free(t->in);
  free(t->out);
  free(t->consts);
  free(t->statics);
  free(t->vars);
  free(t->writes);
}

void manifest_free(manifest *m) {
  if (!m) return;
  free(m->kiln_version);
  free(m->function);
  free(m->static_letters);
  for (int i = 0; m->vars && i < m->n_vars; i++) tensor_free(&m->vars[i]);
  for (int i = 0; m->traces && i < m->n_traces; i++) trace_free(&m->traces[i]);
  free(m->vars);
  free(m->traces);
  memset(m, 0, sizeof *m);
}

/* The members of an object, each handed to member(p, key, ctx), which reads
 * its value (json_skip for keys it does not know). 0 / -1. */
typedef int (*member_fn)(json_parser *p, const char *key, void *ctx);

static int read_object(json_parser *p, member_fn member, void *ctx) {
  char b[JSON_FOUND_BYTES];
  if (json_expect(p, '{')) return -1;
  json_ws(p);
  if (json_at(p, '}')) {
    p->i++;
    return 0;
  }
  for (;;) {
    char *key;
    size_t len;
    if (json_string(p, &key, &len)) return -1;
    int rc = strlen(key) != len ? json_fail(p, "a key holds a NUL byte") : json_expect(p, ':');
    if (!rc) rc = member(p, key, ctx);
    free(key);
    if (rc) return -1;
    json_ws(p);
    if (json_at(p, ',')) {
      p->i++;
      continue;
    }
    if (json_at(p, '}')) {
      p->i++;
      return 0;
    }
    return json_fail(p, "expected ',' or '}', found %s", json_found(p, b, sizeof b));
  }
}

/* The elements of an array into a growing array of elem bytes each (zeroed),
 * each read by element(p, item, ctx); *n counts them. 0 / -1. */
typedef int (*element_fn)(json_parser *p, void *item, void *ctx);

static int read_array(json_parser *p, size_t elem, void **items, int *n, element_fn element, void *ctx) {
  char b[JSON_FOUND_BYTES];
  if (*items) return json_fail(p, "a key appears twice");
  if (json_expect(p, '[')) return -1;
  json_ws(p);
  if (json_at(p, ']')) {
    p->i++;
    return 0;
  }
  int cap = 0;
  for (;;) {
    if (*n == MANIFEST_MAX_ITEMS) return json_fail(p, "an array of more than %d items", MANIFEST_MAX_ITEMS);
    if (*n == cap) {
      cap = cap ? 2 * cap : 4;
      char *grown = realloc(*items, (size_t)cap * elem);
      if (!grown) return json_fail(p, "out of memory");
      memset(grown + (size_t)*n * elem, 0, (size_t)(cap - *n) * elem);
      *items = grown;
    }
    int rc = element(p, (char *)*items + (size_t)*n * elem, ctx);
    ++*n; /* counted even when it failed: its parts are freed with the rest */
    if (rc) return -1;
    json_ws(p);
    if (json_at(p, ',')) {
      p->i++;
      continue;
    }
    if (json_at(p, ']')) {
      p->i++;
      return 0;
    }
    return json_fail(p, "expected ',' or ']', found %s", json_found(p, b, sizeof b));
  }
}

static int read_str(json_parser *p, char **out) {
  if (*out) return json_fail(p, "a key appears twice");
  size_t len;
  if (json_string(p, out, &len)) return -1;
  if (strlen(*out) != len) return json_fail(p, "a string holds a NUL byte");
  return 0;
}

static int read_str_elem(json_parser *p, void *item, void *ctx) {
  (void)ctx;
  return read_str(p, item);
}

static int read_int(json_parser *p, const char *what, int *out) {
  uint64_t v;
  if (json_uint(p, what, &v)) return -1;
  if (v > INT32_MAX) return json_fail(p, "%s is too large", what);
  *out = (int)v;
  return 0;
}

static int read_int_elem(json_parser *p, void *item, void *ctx) { return read_int(p, ctx, item); }

static int read_dim_elem(json_parser *p, void *item, void *ctx) {
  (void)ctx;
  uint64_t v;
  if (json_uint(p, "a dimension", &v)) return -1;
  *(int64_t *)item = (int64_t)v;
  return 0;
}

static int read_bool(json_parser *p, bool *out) {
  json_ws(p);
  if (p->n - p->i >= 4 && !memcmp(p->s + p->i, "true", 4)) {
    p->i += 4;
    *out = true;
    return 0;
  }
  if (p->n - p->i >= 5 && !memcmp(p->s + p->i, "false", 5)) {
    p->i += 5;
    *out = false;
    return 0;
  }
  return json_fail(p, "expected true or false");
}

typedef struct {
  manifest_tensor *t;
  bool dtype, shape;
} tensor_ctx;

static int tensor_member(json_parser *p, const char *key, void *ctx) {
  tensor_ctx *c = ctx;
  if (!strcmp(key, "name")) return read_str(p, &c->t->name);
  if (!strcmp(key, "device")) return read_str(p, &c->t->device);
  if (!strcmp(key, "dtype")) {
    char *name = NULL;
    if (c->dtype) return json_fail(p, "a key appears twice");
    size_t at = p->i;
    if (read_str(p, &name)) return -1;
    int dt = -1;
    for (int d = 0; d <= KILN_BF16; d++)
      if (!strcmp(name, kiln_dtype_name((kiln_dtype)d))) dt = d;
    free(name);
    if (dt < 0) {
      p->i = at;
      return json_fail(p, "unknown dtype");
    }
    c->t->dtype = (kiln_dtype)dt;
    c->dtype = true;
    return 0;
  }
  if (!strcmp(key, "shape")) {
    int64_t *dims = NULL;
    int n = 0;
    if (c->shape) return json_fail(p, "a key appears twice");
    int rc = read_array(p, sizeof *dims, (void **)&dims, &n, read_dim_elem, NULL);
    if (!rc && n > KILN_MAX_RANK) rc = json_fail(p, "a shape of rank %d (at most %d)", n, KILN_MAX_RANK);
    for (int k = 0; !rc && k < n; k++) c->t->shape[k] = dims[k];
    c->t->rank = rc ? 0 : n;
    c->shape = true;
    free(dims);
    return rc;
  }
  return json_skip(p, 2);
}

static int read_tensor(json_parser *p, void *item, void *ctx) {
  (void)ctx;
  tensor_ctx c = {item, false, false};
  if (read_object(p, tensor_member, &c)) return -1;
  if (!c.dtype || !c.shape) return json_fail(p, "a tensor without \"%s\"", c.dtype ? "shape" : "dtype");
  int64_t size;
  if (shape_check("function_load", c.t->rank, c.t->shape, &size)) {
    kiln_clear_error();
    return json_fail(p, "a tensor of impossible shape");
  }
  return 0;
}

static int trace_member(json_parser *p, const char *key, void *ctx) {
  manifest_trace *t = ctx;
  if (!strcmp(key, "ir")) return read_str(p, &t->ir);
  if (!strcmp(key, "func")) return read_str(p, &t->func);
  if (!strcmp(key, "device_scope")) return read_str(p, &t->device_scope);
  if (!strcmp(key, "inputs")) return read_array(p, sizeof *t->in, (void **)&t->in, &t->n_in, read_tensor, NULL);
  if (!strcmp(key, "outputs")) return read_array(p, sizeof *t->out, (void **)&t->out, &t->n_out, read_tensor, NULL);
  if (!strcmp(key, "constants"))
    return read_array(p, sizeof *t->consts, (void **)&t->consts, &t->n_consts, read_tensor, NULL);
  if (!strcmp(key, "static_values"))
    return read_array(p, sizeof *t->statics, (void **)&t->statics, &t->n_statics, read_str_elem, NULL);
  if (!strcmp(key, "variables"))
    return read_array(p, sizeof *t->vars, (void **)&t->vars, &t->n_vars, read_int_elem, "a variable index");
  if (!strcmp(key, "writes"))
    return read_array(p, sizeof *t->writes, (void **)&t->writes, &t->n_writes, read_int_elem, "a write index");
  return json_skip(p, 2);
}

static int read_trace(json_parser *p, void *item, void *ctx) {
  (void)ctx;
  return read_object(p, trace_member, item);
}

typedef struct {
  manifest *m;
  bool format, n_in, n_out;
} top_ctx;

static int top_member(json_parser *p, const char *key, void *ctx) {
  top_ctx *c = ctx;
  manifest *m = c->m;
  if (!strcmp(key, "format")) {
    c->format = true;
    if (read_int(p, "the format", &m->format)) return -1;
    /* a newer format may mean anything after this key: stop here */
    if (m->format > MANIFEST_FORMAT) return json_fail(p, "format %d is newer than this Kiln reads", m->format);
    return 0;
  }
  if (!strcmp(key, "kiln_version")) return read_str(p, &m->kiln_version);
  if (!strcmp(key, "function")) return read_str(p, &m->function);
  if (!strcmp(key, "inputs")) return c->n_in = true, read_int(p, "the number of inputs", &m->n_in);
  if (!strcmp(key, "outputs")) return c->n_out = true, read_int(p, "the number of outputs", &m->n_out);
  if (!strcmp(key, "optimize_for_inference")) return read_bool(p, &m->inference);
  if (!strcmp(key, "static_arguments")) return read_str(p, &m->static_letters);
  if (!strcmp(key, "variables"))
    return read_array(p, sizeof *m->vars, (void **)&m->vars, &m->n_vars, read_tensor, NULL);
  if (!strcmp(key, "traces"))
    return read_array(p, sizeof *m->traces, (void **)&m->traces, &m->n_traces, read_trace, NULL);
  return json_skip(p, 1);
}

/* What the parse cannot see: every key present, counts that agree, indices
 * in range. A message, or NULL when m is whole. */
static const char *check(const manifest *m, const top_ctx *c, char *buf, size_t n) {
  if (!c->format) return "no \"format\"";
  if (m->format < 1) return "format 0 does not exist";
  if (!m->kiln_version || !m->function || !c->n_in || !c->n_out || !m->static_letters)
    return "a key is missing (kiln_version, function, inputs, outputs, static_arguments)";
  if (!*m->function) return "the function has no name";
  for (const char *s = m->static_letters; *s; s++)
    if (!strchr("ildbp", *s)) return "static_arguments has a letter other than i l d b p";
  for (int v = 0; v < m->n_vars; v++) {
    if (!m->vars[v].name || !*m->vars[v].name) return "a variable without a name";
    for (int w = 0; w < v; w++)
      if (!strcmp(m->vars[v].name, m->vars[w].name)) {
        snprintf(buf, n, "two variables are named '%.100s'", m->vars[v].name);
        return buf;
      }
  }
  for (int i = 0; i < m->n_traces; i++) {
    const manifest_trace *t = &m->traces[i];
    snprintf(buf, n, "trace %d: ", i);
    size_t used = strlen(buf);
    const char *why = NULL;
    if (!t->ir || !t->func || !t->device_scope)
      why = "a key is missing (ir, func, device_scope)";
    else if (strchr(t->ir, '/') || t->ir[0] == '.' || !*t->ir)
      why = "its IR file is not a plain name in the directory";
    else if (t->n_in != m->n_in || t->n_out != m->n_out)
      why = "its inputs or outputs do not match the function's count";
    else if (t->n_statics != (int)strlen(m->static_letters))
      why = "its static_values do not match static_arguments";
    for (int k = 0; !why && k < t->n_in; k++)
      if (!t->in[k].device) why = "an input without a device";
    for (int k = 0; !why && k < t->n_consts; k++)
      if (!t->consts[k].name || !*t->consts[k].name) why = "a constant without a name";
    for (int k = 0; !why && k < t->n_vars; k++) {
      if (t->vars[k] >= m->n_vars) why = "a variable index out of range";
      for (int j = 0; !why && j < k; j++)
        if (t->vars[j] == t->vars[k]) why = "a variable listed twice";
    }
    for (int k = 0; !why && k < t->n_writes; k++) {
      if (t->writes[k] >= t->n_vars) why = "a write index out of range";
      for (int j = 0; !why && j < k; j++)
        if (t->writes[j] == t->writes[k]) why = "a variable written twice";
    }
    if (why) {
      snprintf(buf + used, n - used, "%s", why);
      return buf;
    }
  }
  return NULL;
}

int manifest_read(const char *text, size_t n, manifest *m, char *err, size_t errn) {
  memset(m, 0, sizeof *m);
  json_parser p = {.s = (const uint8_t *)text, .n = n, .what = "manifest"};
  top_ctx c = {m, false, false, false};
  size_t bad;
  if (!json_utf8_valid(p.s, n, &bad)) {
    p.i = bad;
    json_fail(&p, "not UTF-8");
  } else if (!read_object(&p, top_member, &c)) {
    json_ws(&p);
    char b[JSON_FOUND_BYTES];
    if (p.i != p.n) json_fail(&p, "%s after the end of the manifest object", json_found(&p, b, sizeof b));
  }
  if (m->format > MANIFEST_FORMAT) {
    snprintf(err, errn, "format version %d is newer than this Kiln (%s) reads (%d): load it with a newer Kiln",
             m->format, kiln_version(), MANIFEST_FORMAT);
    return -1;
  }
  if (p.err[0]) {
    snprintf(err, errn, "%s", p.err);
    return -1;
  }
  char buf[256];
  const char *why = check(m, &c, buf, sizeof buf);
  if (why) {
    snprintf(err, errn, "corrupt manifest: %s", why);
    return -1;
  }
  return 0;
}

const char *manifest_signature(const manifest *m, const manifest_trace *t, char *buf, size_t n) {
  size_t used = 0;
  used += (size_t)snprintf(buf, n, "(");
  for (int k = 0; k < t->n_in && used < n; k++) {
    op_type ty = {t->in[k].dtype, t->in[k].rank, {0}};
    memcpy(ty.shape, t->in[k].shape, sizeof ty.shape);
    char s[280];
    ir_type_str(s, sizeof s, &ty);
    used += (size_t)snprintf(buf + used, n - used, "%s%s", k ? ", " : "", s);
    if (used < n && t->device_scope && strcmp(t->in[k].device, t->device_scope))
      used += (size_t)snprintf(buf + used, n - used, " on %s", t->in[k].device);
  }
  if (used < n) used += (size_t)snprintf(buf + used, n - used, ") on %s", t->device_scope);
  for (int s = 0; s < t->n_statics && used < n; s++)
    used += (size_t)snprintf(buf + used, n - used, "%sstatic %d = %s", s ? ", " : "; ", s, t->statics[s]);
  (void)m;
  return buf;
}
