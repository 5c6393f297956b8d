/* ir.c — building IR: modules, functions, values and instructions, and the
 * one check (ir_check_op) that the builder, the parser and the verifier
 * share, so an instruction is valid exactly when the op table says so. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"
#include "ir_internal.h"

const op_info *ir_op_info(op_id op) { return (unsigned)op < OP_COUNT ? &kiln_ops[op] : NULL; }

char *ir_type_str(char *buf, size_t n, const op_type *t) {
  size_t used = (size_t)snprintf(buf, n, "%s[", kiln_dtype_name(t->dtype));
  for (int i = 0; i < t->rank && i < KILN_MAX_RANK && used < n; i++)
    used += (size_t)snprintf(buf + used, n - used, i ? ",%lld" : "%lld", (long long)t->shape[i]);
  if (used < n) snprintf(buf + used, n - used, "]");
  return buf;
}

bool ir_type_eq(const op_type *a, const op_type *b) {
  if (a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

int ir_type_check(const char *what, const op_type *t) {
  int64_t size;
  if (!dtype_valid(t->dtype)) return kiln_set_error("%s: invalid dtype %d", what, (int)t->dtype);
  return shape_check(what, t->rank, t->shape, &size);
}

bool ir_ident_ok(const char *s) {
  if (!s || !(*s == '_' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z'))) return false;
  for (s++; *s; s++)
    if (!(*s == '_' || *s == '.' || (*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') ||
          (*s >= '0' && *s <= '9')))
      return false;
  return true;
}

/* ---- the shared check ---- */

static bool ascending(int n, const int *v) {
  for (int i = 1; i < n; i++)
    if (v[i - 1] >= v[i]) return false;
  return true;
}

int ir_check_op(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  if ((unsigned)op >= OP_COUNT) return kiln_set_error("ir: invalid op %d", (int)op);
  const op_info *info = &kiln_ops[op];
  static const op_attrs none;
  if (!a) a = &none;
  if (info->arity >= 0 ? n != info->arity : n < 1) {
    if (info->arity >= 0)
      return kiln_set_error("%s: takes %d input%s, got %d", info->api, info->arity,
                            info->arity == 1 ? "" : "s", n);
    return kiln_set_error("%s: takes at least one input, got %d", info->api, n);
  }
  for (int i = 0; i < n; i++)
    if (ir_type_check(info->api, &in[i])) return -1;
  if (a->rank < 0 || a->rank > KILN_MAX_RANK || a->naxes < 0 || a->naxes > KILN_MAX_RANK)
    return kiln_set_error("%s: attribute rank %d / %d axes out of range", info->api, a->rank, a->naxes);
  int key;
  if (op == OP_CONSTANT) {
    if (!a->value) return kiln_set_error("%s: no value", info->api);
    key = a->value->dtype;
  } else {
    key = n == 0 ? (int)a->dtype : op == OP_SELECT ? (int)in[1].dtype : (int)in[0].dtype;
  }
  if (!dtype_valid(key)) return kiln_set_error("%s: invalid dtype %d", info->api, key);
  if (!(info->dtypes & DT_BIT(key)))
    return kiln_set_error("%s: dtype %s is not supported", info->api, kiln_dtype_name((kiln_dtype)key));
  /* what the eager front ends normalise before op_apply, and kernels assume */
  if (info->kind == OPK_REDUCE && op != OP_ARGMAX && !ascending(a->naxes, a->axes))
    return kiln_set_error("%s: axes must be ascending and distinct", info->api);
  if (op == OP_SLICE && a->rank != in[0].rank)
    return kiln_set_error("%s: begin and size have %d entries, the input has rank %d", info->api, a->rank,
                          in[0].rank);
  if (op == OP_RNG_UNIFORM) { /* the checks kiln_random_uniform makes before drawing */
    if (!(a->lo <= a->hi) || !isfinite(a->lo) || !isfinite(a->hi))
      return kiln_set_error("%s: need finite lo <= hi, got [%g, %g)", info->api, a->lo, a->hi);
    if (dtype_is_int(a->dtype)) {
      double l = ceil(a->lo), h = ceil(a->hi), limit = a->dtype == KILN_I32 ? 0x1p31 : 0x1p63;
      if (!(l < h)) return kiln_set_error("%s: empty integer range [%g, %g)", info->api, a->lo, a->hi);
      if (l < -limit || h > limit)
        return kiln_set_error("%s: range [%g, %g) does not fit %s", info->api, a->lo, a->hi,
                              kiln_dtype_name(a->dtype));
    } else if (a->dtype == KILN_F32 && (fabs(a->lo) > 3.4028234663852886e38 || fabs(a->hi) > 3.4028234663852886e38)) {
      return kiln_set_error("%s: range [%g, %g) does not fit f32", info->api, a->lo, a->hi);
    }
  }
  if (info->infer(op, a, n, in, out)) return -1;
  return ir_type_check(info->api, out);
}

/* is g one of m's functions? */
static bool in_module(const ir_module *m, const ir_func *g) {
  for (int i = 0; m && i < m->n_funcs; i++)
    if (m->funcs[i] == g) return true;
  return false;
}

static bool in_hosts(const ir_module *m, const ir_host *h) {
  for (int i = 0; m && i < m->n_hosts; i++)
    if (m->hosts[i] == h) return true;
  return false;
}

int ir_check_instr(const ir_module *m, op_id op, const op_attrs *a, int n, const op_type *in, int *n_out,
                   op_type **out) {
  *n_out = 0;
  *out = NULL;
  if ((unsigned)op >= OP_COUNT) return kiln_set_error("ir: invalid op %d", (int)op);
  const op_info *info = &kiln_ops[op];
  if (info->kind == OPK_CONTROL) {
    if (!a) return kiln_set_error("%s: bad attributes", info->api);
    for (int i = 0; i < n; i++)
      if (ir_type_check(info->api, &in[i])) return -1;
    return ir_check_control(m, op, a, n, in, n_out, out);
  }
  if (info->kind != OPK_CALL && info->kind != OPK_HOST) {
    op_type t;
    if (ir_check_op(op, a, n, in, &t)) return -1;
    if (!(*out = malloc(sizeof **out))) return kiln_set_error("ir: out of memory");
    **out = t;
    *n_out = 1;
    return 0;
  }
  if (!a || a->value) return kiln_set_error("%s: bad attributes", info->api);
  for (int i = 0; i < n; i++)
    if (ir_type_check(info->api, &in[i])) return -1;
  int k;
  if (info->kind == OPK_HOST) {
    const ir_host *h = a->host;
    if (!h || !in_hosts(m, h)) return kiln_set_error("%s: no callback of this module", info->api);
    if (h->n_out < 1) return kiln_set_error("%s: @%s: has no outputs", info->api, h->name);
    if (!(*out = malloc((size_t)h->n_out * sizeof **out))) return kiln_set_error("ir: out of memory");
    for (k = 0; k < h->n_out; k++) (*out)[k] = h->out[k];
    *n_out = h->n_out;
    return 0;
  }
  const ir_func *g = a->callee;
  if (!g || !in_module(m, g)) return kiln_set_error("%s: the callee is not a function of this module", info->api);
  if (n != g->n_params)
    return kiln_set_error("%s: @%s takes %d argument%s, got %d", info->api, g->name, g->n_params,
                          g->n_params == 1 ? "" : "s", n);
  for (int i = 0; i < n; i++) {
    if (!ir_type_eq(&in[i], &g->types[i])) {
      char x[256], y[256];
      return kiln_set_error("%s: @%s: argument %d is %s, the parameter is %s", info->api, g->name, i,
                            ir_type_str(x, sizeof x, &in[i]), ir_type_str(y, sizeof y, &g->types[i]));
    }
  }
  if (g->n_results < 1) return kiln_set_error("%s: @%s returns nothing", info->api, g->name);
  if (!(*out = malloc((size_t)g->n_results * sizeof **out))) return kiln_set_error("ir: out of memory");
  for (k = 0; k < g->n_results; k++) {
    ir_value r = g->results[k];
    if (r < 0 || r >= g->n_values) {
      free(*out);
      *out = NULL;
      return kiln_set_error("%s: @%s: result %d is not a value", info->api, g->name, k);
    }
    (*out)[k] = g->types[r];
  }
  *n_out = g->n_results;
  return 0;
}

/* ---- modules ---- */

ir_module *ir_module_new(void) {
  ir_module *m = calloc(1, sizeof *m);
  if (!m) kiln_set_error("ir: out of memory");
  return m;
}

void ir_func_free_body(ir_func *f) {
  for (int i = 0; i < f->n_instrs; i++) {
    free(f->instrs[i].in);
    if (f->instrs[i].op == OP_CONSTANT) kiln_release(f->instrs[i].attrs.value);
  }
  for (int v = 0; v < f->n_values; v++) free(f->names[v]);
  free(f->instrs);
  free(f->names);
  free(f->types);
  free(f->def);
  free(f->results);
}

static void func_free(ir_func *f) {
  if (!f) return;
  ir_func_free_body(f);
  free(f->buf_offset);
  free(f->name);
  free(f);
}

void ir_module_truncate(ir_module *m, int keep) {
  while (m->n_funcs > keep) func_free(m->funcs[--m->n_funcs]);
}

void ir_plan_drop(ir_func *f) {
  if (!f) return;
  free(f->buf_offset);
  f->buf_offset = NULL;
  f->arena_bytes = 0;
}

void ir_module_free(ir_module *m) {
  if (!m) return;
  for (int i = 0; i < m->n_funcs; i++) func_free(m->funcs[i]);
  for (int i = 0; i < m->n_files; i++) free(m->files[i]);
  for (int i = 0; i < m->n_hosts; i++) {
    free(m->hosts[i]->name);
    free(m->hosts[i]->out);
    free(m->hosts[i]);
  }
  free(m->funcs);
  free(m->files);
  free(m->hosts);
  free(m);
}

/* grows *p (of *cap elements of size sz) to hold need; 0 / -1 */
static int grow(void **p, int *cap, int need, size_t sz) {
  if (need <= *cap) return 0;
  int c = *cap ? *cap : 8;
  while (c < need) c *= 2;
  void *q = realloc(*p, (size_t)c * sz);
  if (!q) return kiln_set_error("ir: out of memory");
  *p = q;
  *cap = c;
  return 0;
}

static char *dup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

const char *ir_intern_file(ir_module *m, const char *file) {
  if (!file) return NULL;
  for (int i = 0; i < m->n_files; i++)
    if (!strcmp(m->files[i], file)) return m->files[i];
  char *d = dup(file);
  if (!d || grow((void **)&m->files, &m->cap_files, m->n_files + 1, sizeof *m->files)) {
    free(d);
    kiln_set_error("ir: out of memory");
    return NULL;
  }
  return m->files[m->n_files++] = d;
}

ir_host *ir_module_add_host(ir_module *m, kiln_host_fn fn, void *user, const char *name, int n_out,
                            const op_type *out) {
  if (!m || n_out < 1 || !out) {
    kiln_set_error("host_call: %s", m ? "needs at least one output" : "no module");
    return NULL;
  }
  for (int i = 0; i < n_out; i++)
    if (ir_type_check("host_call", &out[i])) return NULL;
  if (!name || !ir_ident_ok(name)) name = "host";
  ir_host *h = calloc(1, sizeof *h);
  if (!h || !(h->name = dup(name)) || !(h->out = malloc((size_t)n_out * sizeof *out)) ||
      grow((void **)&m->hosts, &m->cap_hosts, m->n_hosts + 1, sizeof *m->hosts)) {
    if (h) free(h->name), free(h->out);
    free(h);
    kiln_set_error("ir: out of memory");
    return NULL;
  }
  memcpy(h->out, out, (size_t)n_out * sizeof *out);
  h->fn = fn;
  h->user = user;
  h->n_out = n_out;
  return m->hosts[m->n_hosts++] = h;
}

ir_func *ir_module_find(const ir_module *m, const char *name) {
  for (int i = 0; m && name && i < m->n_funcs; i++)
    if (!strcmp(m->funcs[i]->name, name)) return m->funcs[i];
  return NULL;
}

/* a new value of type t defined by instruction def; -1 on out of memory */
static ir_value new_value(ir_func *f, const op_type *t, int32_t def) {
  ir_plan_drop(f); /* a plan covers the values it was made for */
  int need = f->n_values + 1, cap = f->cap_values;
  if (grow((void **)&f->types, &cap, need, sizeof *f->types)) return -1;
  cap = f->cap_values;
  if (grow((void **)&f->def, &cap, need, sizeof *f->def)) return -1;
  cap = f->cap_values;
  if (grow((void **)&f->names, &cap, need, sizeof *f->names)) return -1;
  f->cap_values = cap;
  f->types[f->n_values] = *t;
  f->def[f->n_values] = def;
  f->names[f->n_values] = NULL;
  return f->n_values++;
}

ir_func *ir_func_new(ir_module *m, const char *name, int n_params, const op_type *params) {
  if (!m || !name || !*name) {
    kiln_set_error("ir_func_new: %s", m ? "empty function name" : "no module");
    return NULL;
  }
  if (ir_module_find(m, name)) {
    kiln_set_error("ir_func_new: redefinition of function @%s", name);
    return NULL;
  }
  if (n_params < 0 || (n_params > 0 && !params)) {
    kiln_set_error("ir_func_new: @%s: bad parameter list", name);
    return NULL;
  }
  for (int i = 0; i < n_params; i++)
    if (ir_type_check("ir_func_new", &params[i])) return NULL;
  ir_func *f = calloc(1, sizeof *f);
  if (!f || !(f->name = dup(name)) ||
      grow((void **)&m->funcs, &m->cap_funcs, m->n_funcs + 1, sizeof *m->funcs)) {
    if (f) free(f->name);
    free(f);
    kiln_set_error("ir: out of memory");
    return NULL;
  }
  f->module = m;
  m->funcs[m->n_funcs++] = f;
  for (int i = 0; i < n_params; i++) {
    if (new_value(f, &params[i], -1) < 0) return NULL; /* f stays in m, freed with it */
    f->n_params++;
  }
  return f;
}

ir_value ir_append(ir_func *f, op_id op, const op_attrs *attrs, int n_in, const ir_value *in, ir_loc loc) {
  static const op_attrs none;
  if (!f) return kiln_set_error("ir_append: no function");
  if ((unsigned)op >= OP_COUNT) return kiln_set_error("ir_append: invalid op %d", (int)op);
  if (n_in < 0 || (n_in > 0 && !in)) return kiln_set_error("ir_append: bad input list");
  op_type small[4] = {{0}}, *types = small, *outs = NULL;
  if (n_in > 4 && !(types = malloc((size_t)n_in * sizeof *types))) return kiln_set_error("ir: out of memory");
  int rc = 0, n_out = 0;
  for (int i = 0; i < n_in && !rc; i++) {
    if (in[i] < 0 || in[i] >= f->n_values)
      rc = kiln_set_error("%s: input %d (%d) is not a value of @%s", kiln_ops[op].api, i, (int)in[i], f->name);
    else
      types[i] = f->types[in[i]];
  }
  if (!rc) rc = ir_check_instr(f->module, op, attrs ? attrs : &none, n_in, types, &n_out, &outs);
  if (types != small) free(types);
  if (rc) return -1;

  ir_instr ins = {.op = op, .attrs = attrs ? *attrs : none, .n_in = n_in, .n_out = n_out, .loc = {NULL, loc.line}};
  if (op != OP_CONSTANT) ins.attrs.value = NULL; /* only constants own one */
  if (kiln_ops[op].kind != OPK_CALL && kiln_ops[op].kind != OPK_CONTROL) ins.attrs.callee = NULL;
  if (kiln_ops[op].kind != OPK_CONTROL) {
    ins.attrs.callee2 = NULL;
    ins.attrs.n_state = ins.attrs.n_xs = 0;
    ins.attrs.trip = 0;
    ins.attrs.reverse = false;
  } else {
    if (ins.attrs.callee) ins.attrs.callee->region = true;
    if (ins.attrs.callee2) ins.attrs.callee2->region = true;
  }
  if (kiln_ops[op].kind != OPK_HOST) ins.attrs.host = NULL;
  if (kiln_ops[op].kind != OPK_RANDOM) ins.attrs.stateful = false;
  if ((loc.file && !(ins.loc.file = ir_intern_file(f->module, loc.file))) ||
      (n_in && !(ins.in = malloc((size_t)n_in * sizeof *ins.in)))) {
    free(outs);
    return kiln_has_error() ? -1 : kiln_set_error("ir: out of memory");
  }
  if (n_in) memcpy(ins.in, in, (size_t)n_in * sizeof *in);
  if (grow((void **)&f->instrs, &f->cap_instrs, f->n_instrs + 1, sizeof *f->instrs)) {
    free(ins.in);
    free(outs);
    return -1;
  }
  int first = f->n_values;
  for (int k = 0; k < n_out; k++) {
    if (new_value(f, &outs[k], f->n_instrs) < 0) {
      f->n_values = first; /* undo: nothing refers to them yet */
      free(ins.in);
      free(outs);
      return -1;
    }
  }
  free(outs);
  ins.out = first;
  if (op == OP_CONSTANT) kiln_retain(ins.attrs.value);
  f->instrs[f->n_instrs++] = ins;
  return first;
}

ir_value ir_constant(ir_func *f, kiln_tensor *t, ir_loc loc) {
  if (!t) return kiln_set_error("constant: no value");
  op_attrs a = {.value = t};
  return ir_append(f, OP_CONSTANT, &a, 0, NULL, loc);
}

int ir_set_results(ir_func *f, int n, const ir_value *results) {
  if (!f || n < 0 || (n > 0 && !results)) return kiln_set_error("ir_set_results: bad arguments");
  for (int i = 0; i < n; i++)
    if (results[i] < 0 || results[i] >= f->n_values)
      return kiln_set_error("ir_set_results: @%s: result %d (%d) is not a value", f->name, i, (int)results[i]);
  ir_value *r = NULL;
  if (n && !(r = malloc((size_t)n * sizeof *r))) return kiln_set_error("ir: out of memory");
  if (n) memcpy(r, results, (size_t)n * sizeof *r);
  ir_plan_drop(f); /* results never live in the arena */
  free(f->results);
  f->results = r;
  f->n_results = n;
  return 0;
}

int ir_set_name(ir_func *f, ir_value v, const char *name) {
  if (!f || v < 0 || v >= f->n_values) return kiln_set_error("ir_set_name: bad value");
  if (!ir_ident_ok(name))
    return kiln_set_error("ir_set_name: @%s: '%s' is not a name ([A-Za-z_][A-Za-z0-9_.]*)", f->name,
                          name ? name : "(null)");
  for (int i = 0; i < f->n_values; i++)
    if (i != v && f->names[i] && !strcmp(f->names[i], name))
      return kiln_set_error("ir_set_name: @%s: %%%s is already defined", f->name, name);
  char *d = dup(name);
  if (!d) return kiln_set_error("ir: out of memory");
  free(f->names[v]);
  f->names[v] = d;
  return 0;
}

/* Unnamed values are numbered in the order they are printed: parameters,
 * then instruction results in instruction order. */
void ir_number_values(const ir_func *f, int32_t *num) {
  int32_t next = 0;
  for (int v = 0; v < f->n_values; v++) num[v] = -1;
  for (int v = 0; v < f->n_params; v++)
    if (!f->names[v]) num[v] = next++;
  for (int i = 0; i < f->n_instrs; i++)
    for (int k = 0; k < f->instrs[i].n_out; k++) {
      ir_value v = f->instrs[i].out + k;
      if (v >= 0 && v < f->n_values && !f->names[v] && num[v] < 0) num[v] = next++;
    }
}

char *ir_value_label(const ir_func *f, ir_value v, char *buf, size_t n) {
  if (v < 0 || v >= f->n_values) {
    snprintf(buf, n, "%%<%d>", (int)v);
  } else if (f->names[v]) {
    snprintf(buf, n, "%%%s", f->names[v]);
  } else {
    int32_t *num = malloc((size_t)f->n_values * sizeof *num);
    if (!num) {
      snprintf(buf, n, "%%?");
      return buf;
    }
    ir_number_values(f, num);
    snprintf(buf, n, "%%%d", (int)num[v]);
    free(num);
  }
  return buf;
}

/* ---- copies ---- */

ir_func *ir_clone_func(ir_module *m, const ir_func *src, ir_clone_memo *memo) {
  for (int i = 0; i < memo->n; i++)
    if (memo->src[i] == src) return memo->dst[i];
  char name[160];
  snprintf(name, sizeof name, "%s", src->name);
  for (int k = 1; ir_module_find(m, name); k++) snprintf(name, sizeof name, "%s.%d", src->name, k);
  ir_func *g = ir_func_new(m, name, src->n_params, src->types);
  ir_value *map = malloc(((size_t)src->n_values + 1) * sizeof *map);
  if (!g || !map) {
    free(map);
    if (g) kiln_set_error("ir: out of memory");
    return NULL;
  }
  for (int v = 0; v < src->n_params; v++) map[v] = v;
  for (int i = 0; i < src->n_instrs; i++) {
    const ir_instr *in = &src->instrs[i];
    op_attrs a = in->attrs;
    if (a.callee && !(a.callee = ir_clone_func(m, a.callee, memo))) goto fail;
    if (a.callee2 && !(a.callee2 = ir_clone_func(m, a.callee2, memo))) goto fail;
    if (a.host) {
      const ir_host *h = a.host;
      if (!(a.host = ir_module_add_host(m, h->fn, h->user, h->name, h->n_out, h->out))) goto fail;
    }
    ir_value small[8], *args = in->n_in > 8 ? malloc((size_t)in->n_in * sizeof *args) : small;
    if (!args) goto fail;
    for (int k = 0; k < in->n_in; k++) args[k] = map[in->in[k]];
    ir_value v = ir_append(g, in->op, &a, in->n_in, args, in->loc);
    if (args != small) free(args);
    if (v < 0) goto fail;
    for (int k = 0; k < in->n_out; k++) map[in->out + k] = v + k;
  }
  ir_value *res = malloc(((size_t)src->n_results + 1) * sizeof *res);
  if (!res) goto fail;
  for (int r = 0; r < src->n_results; r++) res[r] = map[src->results[r]];
  int rc = ir_set_results(g, src->n_results, res);
  free(res);
  if (rc) goto fail;
  for (int v = 0; v < src->n_values; v++)
    if (src->names[v]) ir_set_name(g, map[v], src->names[v]);
  free(map);
  if (memo->n == memo->cap) {
    int cap = memo->cap ? 2 * memo->cap : 4;
    const ir_func **s2 = realloc(memo->src, (size_t)cap * sizeof *s2);
    if (s2) memo->src = s2;
    ir_func **d2 = s2 ? realloc(memo->dst, (size_t)cap * sizeof *d2) : NULL;
    if (!d2) {
      kiln_set_error("ir: out of memory");
      return NULL;
    }
    memo->dst = d2;
    memo->cap = cap;
  }
  memo->src[memo->n] = src;
  memo->dst[memo->n++] = g;
  return g;
fail:
  free(map);
  return NULL;
}

void ir_clone_memo_free(ir_clone_memo *memo) {
  free(memo->src);
  free(memo->dst);
  memset(memo, 0, sizeof *memo);
}

ir_module *ir_module_clone(const ir_module *src) {
  ir_module *m = ir_module_new();
  ir_clone_memo memo = {0};
  for (int i = 0; m && i < src->n_funcs; i++)
    if (!ir_clone_func(m, src->funcs[i], &memo)) {
      ir_module_free(m);
      m = NULL;
    }
  ir_clone_memo_free(&memo);
  return m;
}
