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

int pass_commit(pass_builder *b) {
  ir_func *f = b->old, *g = &b->body;
  if (f->n_results && !(g->results = malloc((size_t)f->n_results * sizeof *g->results))) {
    pass_abort(b);
    return kiln_set_error("pass: out of memory");
  }
  for (int r = 0; r < f->n_results; r++) {
    if ((g->results[r] = pass_map(b, f->results[r])) < 0) {
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
    return false;
  }
  return true;
}

bool pass_func_is_pure(const ir_func *f) { return func_pure(f, 0); }

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
