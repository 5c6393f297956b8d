/* rewrite.c — the machinery every pass shares: a builder that writes a new
 * body beside the old one and swaps it in (so a pass that fails halfway
 * leaves the function untouched), the purity predicates that decide what a
 * pass may fold, merge or remove, and readers of constant operands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rewrite.h"

static char *dup(const char *s) {
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

int pass_begin(pass_builder *b, ir_func *f) {
  memset(b, 0, sizeof *b);
  b->old = f;
  ir_func *g = &b->body;
  g->name = f->name; /* borrowed: the verifier and error messages want one */
  g->module = f->module;
  int cap = f->n_values > 8 ? f->n_values : 8;
  g->types = malloc((size_t)cap * sizeof *g->types);
  g->def = malloc((size_t)cap * sizeof *g->def);
  g->names = calloc((size_t)cap, sizeof *g->names);
  g->cap_values = cap;
  g->cap_instrs = f->n_instrs > 8 ? f->n_instrs : 8;
  g->instrs = malloc((size_t)g->cap_instrs * sizeof *g->instrs);
  b->map = malloc(((size_t)f->n_values + 1) * sizeof *b->map);
  if (!g->types || !g->def || !g->names || !g->instrs || !b->map) {
    pass_abort(b);
    return kiln_set_error("pass: out of memory");
  }
  for (int v = 0; v < f->n_values; v++) b->map[v] = -1;
  for (int v = 0; v < f->n_params; v++) {
    g->types[v] = f->types[v];
    g->def[v] = -1;
    if (f->names[v] && !(g->names[v] = dup(f->names[v]))) {
      g->n_values = v;
      pass_abort(b);
      return kiln_set_error("pass: out of memory");
    }
    b->map[v] = v;
    g->n_values = g->n_params = v + 1;
  }
  return 0;
}

ir_value pass_emit(pass_builder *b, op_id op, const op_attrs *a, int n, const ir_value *in, ir_loc loc) {
  return ir_append(&b->body, op, a, n, in, loc);
}

ir_value pass_emit_constant(pass_builder *b, kiln_tensor *t, ir_loc loc) {
  return ir_constant(&b->body, t, loc);
}

ir_value pass_copy(pass_builder *b, const ir_instr *ins) {
  ir_value small[8] = {0}, *in = small;
  if (ins->n_in > 8 && !(in = malloc((size_t)ins->n_in * sizeof *in))) return kiln_set_error("pass: out of memory");
  int rc = 0;
  for (int k = 0; k < ins->n_in && !rc; k++)
    if ((in[k] = pass_map(b, ins->in[k])) < 0)
      rc = kiln_set_error("pass: @%s: an operand of %s has no new value", b->old->name, kiln_ops[ins->op].name);
  ir_value first = rc ? -1 : ir_append(&b->body, ins->op, &ins->attrs, ins->n_in, in, ins->loc);
  if (in != small) free(in);
  if (first < 0) return -1;
  ir_func *g = &b->body;
  for (int k = 0; k < ins->n_out; k++) {
    const char *name = b->old->names[ins->out + k];
    if (name && !(g->names[first + k] = dup(name))) return kiln_set_error("pass: out of memory");
    b->map[ins->out + k] = first + k;
  }
  return first;
}

int pass_replace(pass_builder *b, ir_value v, ir_value r, bool fresh) {
  b->map[v] = r;
  const char *name = b->old->names[v];
  if (fresh && name && !b->body.names[r] && !(b->body.names[r] = dup(name)))
    return kiln_set_error("pass: out of memory");
  return 0;
}

/* ---- regions that a new body no longer holds ---- */

typedef struct region_set {
  const ir_func **r;
  int n, cap;
} region_set;

static bool in_set(const region_set *s, const ir_func *g) {
  for (int i = 0; i < s->n; i++)
    if (s->r[i] == g) return true;
  return false;
}

static int set_add(region_set *s, const ir_func *g) {
  if (s->n == s->cap) {
    int cap = s->cap ? 2 * s->cap : 8;
    const ir_func **q = realloc(s->r, (size_t)cap * sizeof *q);
    if (!q) return kiln_set_error("pass: out of memory");
    s->r = q;
    s->cap = cap;
  }
  s->r[s->n++] = g;
  return 0;
}

/* the regions of f's instructions, and (deep) theirs */
static int reachable(const ir_func *f, region_set *s, bool deep, int depth) {
  if (depth > 64) return 0;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_func *rg[2];
    int nr = ir_regions(&f->instrs[i], rg);
    for (int k = 0; k < nr; k++) {
      if (!rg[k] || in_set(s, rg[k])) continue;
      if (set_add(s, rg[k]) || (deep && reachable(rg[k], s, true, depth + 1))) return -1;
    }
  }
  return 0;
}

/* Empties region r (no instruction holds it any more) and, first, the
 * regions it holds that keep does not list. */
static void retire(ir_func *r, const region_set *keep, int depth) {
  for (int i = 0; depth < 64 && i < r->n_instrs; i++) {
    const ir_func *rg[2];
    int nr = ir_regions(&r->instrs[i], rg);
    for (int k = 0; k < nr; k++)
      if (rg[k] && !in_set(keep, rg[k])) retire((ir_func *)rg[k], keep, depth + 1);
  }
  ir_func_free_body(r);
  ir_plan_drop(r);
  r->n_params = r->n_results = r->n_values = r->cap_values = r->n_instrs = r->cap_instrs = 0;
  r->results = NULL;
  r->types = NULL;
  r->def = NULL;
  r->names = NULL;
  r->instrs = NULL;
}

int pass_commit(pass_builder *b) {
  ir_func *f = b->old, *g = &b->body;
  /* the old body's regions, and everything the new body reaches */
  region_set old = {0}, keep = {0};
  if (reachable(f, &old, false, 0) || reachable(g, &keep, true, 0)) {
    free(old.r);
    free(keep.r);
    pass_abort(b);
    return -1;
  }
  if (f->n_results && !(g->results = malloc((size_t)f->n_results * sizeof *g->results))) {
    free(old.r);
    free(keep.r);
    pass_abort(b);
    return kiln_set_error("pass: out of memory");
  }
  for (int r = 0; r < f->n_results; r++) {
    if ((g->results[r] = pass_map(b, f->results[r])) < 0) {
      free(old.r);
      free(keep.r);
      pass_abort(b);
      return kiln_set_error("pass: @%s: result %d has no new value", f->name, r);
    }
  }
  g->n_results = f->n_results;
  ir_func_free_body(f);
  ir_plan_drop(f); /* an arena plan names the old values */
  f->n_results = g->n_results;
  f->results = g->results;
  f->types = g->types;
  f->def = g->def;
  f->names = g->names;
  f->n_values = g->n_values;
  f->cap_values = g->cap_values;
  f->instrs = g->instrs;
  f->n_instrs = g->n_instrs;
  f->cap_instrs = g->cap_instrs;
  free(b->map);
  memset(b, 0, sizeof *b);
  for (int i = 0; i < old.n; i++)
    if (!in_set(&keep, old.r[i])) retire((ir_func *)old.r[i], &keep, 0);
  free(old.r);
  free(keep.r);
  return 0;
}

void pass_abort(pass_builder *b) {
  ir_func_free_body(&b->body);
  free(b->map);
  memset(b, 0, sizeof *b);
}

int pass_finish(pass_builder *b, bool changed, const char *pass) {
  if (!changed) {
    pass_abort(b);
    return 0;
  }
  return pass_commit(b) ? pass_fail(pass) : 0;
}

int pass_fail(const char *pass) {
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", kiln_has_error() ? kiln_last_error() : "failed");
  size_t n = strlen(pass);
  if (!strncmp(msg, pass, n) && msg[n] == ':') return -1;
  return kiln_set_error("%s: %s", pass, msg);
}

/* ---- purity ---- */

bool pass_is_pure(const ir_instr *ins) {
  if (ins->n_out != 1 || (unsigned)ins->op >= OP_COUNT) return false;
  switch (kiln_ops[ins->op].kind) {
  case OPK_UNARY:
  case OPK_BINARY:
  case OPK_COMPARE:
  case OPK_SELECT:
  case OPK_CONVERT:
  case OPK_VIEW:
  case OPK_MOVE:
  case OPK_REDUCE:
  case OPK_DOT:
  case OPK_INDEX:
  case OPK_WINDOW:
  case OPK_SOURCE:
  case OPK_CONST:
    return true;
  default: /* random draws, calls, host calls, and kinds added later */
    return false;
  }
}

/* Chains deeper than this count as impure (the verifier rejects recursion;
 * this only bounds the walk). */
enum { PURE_DEPTH = 16 };

static bool func_pure(const ir_func *f, int depth) {
  if (!f || depth > PURE_DEPTH) return false;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *ins = &f->instrs[i];
    if (pass_is_pure(ins)) continue;
    if ((unsigned)ins->op < OP_COUNT && kiln_ops[ins->op].kind == OPK_CALL &&
        func_pure(ins->attrs.callee, depth + 1))
      continue;
    if (pass_is_control(ins) && func_pure(ins->attrs.callee, depth + 1) &&
        (!ins->attrs.callee2 || func_pure(ins->attrs.callee2, depth + 1)))
      continue;
    return false;
  }
  return true;
}

bool pass_func_is_pure(const ir_func *f) { return func_pure(f, 0); }

bool pass_has_effect(const ir_instr *ins) {
  if (pass_is_pure(ins)) return false;
  if ((unsigned)ins->op < OP_COUNT && kiln_ops[ins->op].kind == OPK_CALL) return !pass_func_is_pure(ins->attrs.callee);
  if (pass_is_control(ins))
    return !pass_func_is_pure(ins->attrs.callee) || (ins->attrs.callee2 && !pass_func_is_pure(ins->attrs.callee2));
  return true;
}

bool pass_can_fail(const ir_func *f, const ir_instr *ins) {
  if (!pass_is_pure(ins) || kiln_ops[ins->op].kind == OPK_INDEX) return true;
  if ((ins->op != OP_DIV && ins->op != OP_MOD) || ins->n_in != 2) return false;
  kiln_dtype dt = f->types[ins->in[1]].dtype;
  if (dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16) return false;
  const kiln_tensor *d = pass_const(f, ins->in[1]); /* a divisor known free of zeros */
  if (!d) return true;
  for (int64_t i = 0; i < d->size; i++)
    if (dtype_load((kiln_dtype)d->dtype, d->data, i) == 0) return true;
  return false;
}

int pass_live(const ir_func *g, const bool *keep_result, bool *live_val, bool *live_ins) {
  bool *live = live_val ? live_val : calloc((size_t)g->n_values + 1, sizeof *live);
  if (!live) return kiln_set_error("pass: out of memory");
  if (live_val) memset(live, 0, (size_t)g->n_values * sizeof *live);
  for (int r = 0; r < g->n_results; r++)
    if (!keep_result || keep_result[r]) live[g->results[r]] = true;
  for (int i = g->n_instrs - 1; i >= 0; i--) {
    const ir_instr *ins = &g->instrs[i];
    bool needed = pass_has_effect(ins);
    for (int k = 0; k < ins->n_out && !needed; k++) needed = live[ins->out + k];
    if (live_ins) live_ins[i] = needed;
    if (!needed) continue;
    for (int k = 0; k < ins->n_out; k++) live[ins->out + k] = true;
    for (int k = 0; k < ins->n_in; k++) live[ins->in[k]] = true;
  }
  if (!live_val) free(live);
  return 0;
}

/* ---- new regions ---- */

/* A new function of m named after base (without a trailing .N): @base.1,
 * @base.2, ... the first one free; marked region. */
static ir_func *new_region(ir_module *m, const char *base, int n_params, const op_type *params) {
  size_t n = strlen(base);
  size_t d = n;
  while (d > 0 && base[d - 1] >= '0' && base[d - 1] <= '9') d--;
  if (d > 0 && d < n && base[d - 1] == '.') n = d - 1; /* "f.body.3" -> "f.body" */
  if (n > 200) n = 200;
  char name[256];
  int k = 1;
  do
    snprintf(name, sizeof name, "%.*s.%d", (int)n, base, k++);
  while (ir_module_find(m, name));
  ir_func *g = ir_func_new(m, name, n_params, params);
  if (g) g->region = true;
  return g;
}

static int name_value(ir_func *g, ir_value v, const char *name) {
  if (!name || g->names[v]) return 0;
  return (g->names[v] = dup(name)) ? 0 : kiln_set_error("pass: out of memory");
}

ir_func *pass_region_rebuild(const ir_func *src, const bool *keep_param, int n_extra, const op_type *extra,
                             const ir_value *extra_for, const bool *copy, const bool *keep_result) {
  ir_module *m = src->module;
  int np = 0;
  op_type *types = malloc(((size_t)src->n_params + n_extra + 1) * sizeof *types);
  ir_value *map = malloc(((size_t)src->n_values + 1) * sizeof *map);
  ir_value *res = malloc(((size_t)src->n_results + 1) * sizeof *res);
  ir_value small[8], *x = small;
  int cap = 8;
  ir_func *g = NULL;
  if (!types || !map || !res) {
    kiln_set_error("pass: out of memory");
    goto fail;
  }
  for (int v = 0; v < src->n_values; v++) map[v] = -1;
  for (int p = 0; p < src->n_params; p++)
    if (!keep_param || keep_param[p]) types[np++] = src->types[p];
  for (int k = 0; k < n_extra; k++) types[np + k] = extra[k];
  if (!(g = new_region(m, src->name, np + n_extra, types))) goto fail;
  np = 0;
  for (int p = 0; p < src->n_params; p++)
    if (!keep_param || keep_param[p]) {
      map[p] = np;
      if (name_value(g, np++, src->names[p])) goto fail;
    }
  for (int k = 0; k < n_extra; k++) {
    ir_value o = extra_for ? extra_for[k] : -1;
    if (o < 0) continue;
    map[o] = np + k;
    if (name_value(g, np + k, src->names[o])) goto fail;
  }
  for (int i = 0; i < src->n_instrs; i++) {
    const ir_instr *ins = &src->instrs[i];
    if (copy && !copy[i]) continue;
    if (ins->n_in > cap) {
      if (x != small) free(x);
      cap = ins->n_in;
      if (!(x = malloc((size_t)cap * sizeof *x))) {
        x = small;
        kiln_set_error("pass: out of memory");
        goto fail;
      }
    }
    for (int k = 0; k < ins->n_in; k++)
      if ((x[k] = map[ins->in[k]]) < 0) {
        kiln_set_error("pass: @%s: an operand of %s has no value in the new region", src->name,
                       kiln_ops[ins->op].name);
        goto fail;
      }
    ir_value v = ir_append(g, ins->op, &ins->attrs, ins->n_in, x, ins->loc);
    if (v < 0) goto fail;
    for (int k = 0; k < ins->n_out; k++) {
      map[ins->out + k] = v + k;
      if (name_value(g, v + k, src->names[ins->out + k])) goto fail;
    }
  }
  int nr = 0;
  for (int r = 0; r < src->n_results; r++) {
    if (keep_result && !keep_result[r]) continue;
    if ((res[nr++] = map[src->results[r]]) < 0) {
      kiln_set_error("pass: @%s: result %d has no value in the new region", src->name, r);
      goto fail;
    }
  }
  if (ir_set_results(g, nr, res)) goto fail;
  if (x != small) free(x);
  free(types);
  free(map);
  free(res);
  return g;
fail:
  if (x != small) free(x);
  free(types);
  free(map);
  free(res);
  return NULL; /* g, if made, stays in the module: the caller truncates it */
}

static ir_func *clone_region(ir_module *m, const ir_func *src, int depth);

static int clone_attrs(ir_module *m, const ir_instr *ins, op_attrs *a, int depth) {
  *a = ins->attrs;
  if (!pass_is_control(ins)) return 0;
  if (depth > 64) return kiln_set_error("pass: regions nested too deep");
  if (a->callee && !(a->callee = clone_region(m, ins->attrs.callee, depth + 1))) return -1;
  if (a->callee2 && !(a->callee2 = clone_region(m, ins->attrs.callee2, depth + 1))) return -1;
  return 0;
}

static ir_func *clone_region(ir_module *m, const ir_func *src, int depth) {
  ir_func *g = new_region(m, src->name, src->n_params, src->types);
  ir_value *map = malloc(((size_t)src->n_values + 1) * sizeof *map);
  ir_value small[8], *x = small;
  int cap = 8, rc = 0;
  if (!g || !map) {
    free(map);
    if (g) kiln_set_error("pass: out of memory");
    return NULL;
  }
  for (int p = 0; p < src->n_params && !rc; p++) {
    map[p] = p;
    rc = name_value(g, p, src->names[p]);
  }
  for (int i = 0; i < src->n_instrs && !rc; i++) {
    const ir_instr *ins = &src->instrs[i];
    if (ins->n_in > cap) {
      if (x != small) free(x);
      cap = ins->n_in;
      if (!(x = malloc((size_t)cap * sizeof *x))) {
        x = small;
        rc = kiln_set_error("pass: out of memory");
        break;
      }
    }
    for (int k = 0; k < ins->n_in; k++) x[k] = map[ins->in[k]];
    op_attrs a;
    ir_value v = clone_attrs(m, ins, &a, depth) ? -1 : ir_append(g, ins->op, &a, ins->n_in, x, ins->loc);
    if (v < 0) {
      rc = -1;
      break;
    }
    for (int k = 0; k < ins->n_out && !rc; k++) {
      map[ins->out + k] = v + k;
      rc = name_value(g, v + k, src->names[ins->out + k]);
    }
  }
  if (!rc) {
    ir_value *res = malloc(((size_t)src->n_results + 1) * sizeof *res);
    if (!res) rc = kiln_set_error("pass: out of memory");
    for (int r = 0; r < src->n_results && !rc; r++) res[r] = map[src->results[r]];
    if (!rc) rc = ir_set_results(g, src->n_results, res);
    free(res);
  }
  if (x != small) free(x);
  free(map);
  return rc ? NULL : g;
}

ir_func *pass_region_clone(ir_module *m, const ir_func *src) { return clone_region(m, src, 0); }

int pass_clone_regions(ir_module *m, const ir_instr *ins, op_attrs *a) { return clone_attrs(m, ins, a, 0); }

/* ---- constants ---- */

const kiln_tensor *pass_const(const ir_func *f, ir_value v) {
  const ir_instr *d = ir_def(f, v);
  return d && d->op == OP_CONSTANT ? d->attrs.value : NULL;
}

bool pass_splat(const ir_func *f, ir_value v, double *val, uint64_t *bits) {
  const ir_instr *d = ir_def(f, v);
  /* broadcasts and reshapes only repeat or regroup the elements */
  for (int hops = 0; d && hops < 8 && d->n_out == 1 &&
                     (d->op == OP_BROADCAST || d->op == OP_RESHAPE || d->op == OP_IDENTITY);
       hops++)
    d = ir_def(f, d->in[0]);
  if (!d || d->op != OP_CONSTANT || !d->attrs.value) return false;
  const kiln_tensor *t = d->attrs.value;
  size_t es = kiln_dtype_sizes[t->dtype];
  if (t->size < 1 || es > 8) return false;
  const unsigned char *p = t->data;
  for (int64_t i = 1; i < t->size; i++)
    if (memcmp(p, p + (size_t)i * es, es)) return false;
  uint64_t u = 0;
  memcpy(&u, p, es);
  if (bits) *bits = u;
  if (val) *val = dtype_load((kiln_dtype)t->dtype, p, 0);
  return true;
}

int64_t pass_elems(const op_type *t) {
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}

kiln_tensor *pass_filled(const op_type *t, double v) {
  kiln_tensor *x = tensor_alloc("pass", t->dtype, t->rank, t->shape);
  for (int64_t i = 0; x && i < x->size; i++) dtype_store(t->dtype, x->data, i, v);
  return x;
}
