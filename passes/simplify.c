/* simplify.c — algebraic identities, in the spirit of XLA's algebraic
 * simplifier and LLVM's instcombine: each rule replaces an instruction by a
 * value that already exists or by a cheaper instruction, in one forward sweep
 * (so chains collapse: operands are seen already simplified). What a rule
 * leaves unused is dce's to remove.
 *
 * Rules (x any value, c a constant, or a broadcast/reshape of one, whose
 * elements are all the same; "ints" = i32/i64 only). A rule that would change
 * the result's type (a constant operand broadcasting x to a larger shape)
 * does not fire.
 *   x + 0, 0 + x  -> x     ints; floats only for 0 = -0.0 (x + -0.0 == x for
 *                          every x, NaN and -0.0 included; x + +0.0 turns
 *                          -0.0 into +0.0, so it stays)
 *   x - 0         -> x     ints; floats only for 0 = +0.0 (x - +0.0 == x + -0.0)
 *   0 - x         -> neg x ints only (floats: -0.0 - x equals -x except that
 *                          a NaN keeps its sign bit, which neg flips)
 *   x * 1, 1 * x  -> x     any dtype (exact for floats: NaN, inf, -0.0 kept)
 *   x * 0, 0 * x  -> 0     ints only (floats: NaN * 0, inf * 0, -x * 0)
 *   x - x         -> 0     ints only (floats: inf - inf, NaN - NaN)
 *   x / 1         -> x     any dtype
 *   x / c         -> x * (1/c)  floats, where every element of c is a power of
 *                          two whose reciprocal the dtype holds exactly (so
 *                          both round the same real number once)
 *   neg neg x     -> x     (exact: negation only flips the sign bit)
 *   identity x, stop_gradient x -> x   (gradients are built before passes run)
 *   transpose with the identity perm -> x; transpose of transpose -> one
 *                          transpose with the composed perm (or x)
 *   reshape to x's own shape -> x; reshape of reshape -> one reshape
 *   broadcast to x's own shape -> x; broadcast of broadcast -> one broadcast;
 *   broadcast of a one-element constant -> a constant of the result's shape,
 *                          when it has at most PASS_CONST_MAX_ELEMS elements
 *   convert to x's own dtype -> x
 *   select(c, a, b) with c all true -> a, all false -> b; select(p, a, a) -> a
 *   an elementwise op's operand reshape(a) -> a, when the two shapes differ
 *                          only in leading 1s (both broadcast to the same
 *                          elements) and another operand still gives the
 *                          result its rank
 * Control flow (the instruction stays; dce drops the results nothing reads):
 *   cond result k that both branches return as the same parameter j
 *                          -> operand j + 1
 *   while state k (scan carry k) the body returns as parameter k unchanged
 *                          -> operand k, the state as it came in
 * Floats: no rule changes a float result, bit for bit (NaN signs and payloads
 * included), except that a signalling NaN a removed instruction would have
 * quieted stays signalling. */
#include <math.h>
#include <string.h>

#include "rewrite.h"

enum { NO_RULE = -1, FAILED = -2 };

static bool type_eq(const op_type *a, const op_type *b) {
  if (a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

typedef struct ctx {
  pass_builder *b;
  ir_func *g;          /* the new body */
  const ir_instr *ins; /* the old instruction */
  const op_type *type; /* its result type */
  ir_value x[3];       /* its operands, in the new body */
} ctx;

/* v may stand for the instruction's result: same type */
static bool fits(const ctx *c, ir_value v) { return type_eq(&c->g->types[v], c->type); }

static bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }
static bool is_int(kiln_dtype dt) { return dt == KILN_I32 || dt == KILN_I64; }

/* ---- what a constant operand is ---- */

static bool splat_is(const ctx *c, ir_value v, double want, int sign) {
  double val;
  if (!pass_splat(c->g, v, &val, NULL) || val != want) return false;
  return sign == 0 || (sign < 0) == (signbit(val) != 0);
}
/* c is 0, with the sign float rules need (ints: any zero) */
static bool is_zero(const ctx *c, ir_value v, int float_sign) {
  return splat_is(c, v, 0.0, is_float(c->type->dtype) ? float_sign : 0);
}
static bool is_one(const ctx *c, ir_value v) { return splat_is(c, v, 1.0, 0); }

/* the reciprocal of power-of-two d, exact in dt; false otherwise */
static bool exact_reciprocal(kiln_dtype dt, double d, double *r) {
  int e;
  if (!isfinite(d) || d == 0 || fabs(frexp(d, &e)) != 0.5) return false;
  *r = 1.0 / d; /* exact in double: a power of two */
  if (!isfinite(*r)) return false;
  return dt == KILN_F64 || (isfinite((float)*r) && (double)(float)*r == *r);
}

/* ---- building replacements ---- */

static ir_value emit(ctx *c, op_id op, const op_attrs *a, int n, const ir_value *in) {
  ir_value v = pass_emit(c->b, op, a, n, in, c->ins->loc);
  return v < 0 ? FAILED : v;
}

static ir_value emit_constant(ctx *c, kiln_tensor *t) {
  if (!t) return FAILED;
  ir_value v = pass_emit_constant(c->b, t, c->ins->loc);
  kiln_release(t);
  return v < 0 ? FAILED : v;
}

/* zeros of the result type: a constant, or a broadcast scalar when large */
static ir_value zeros(ctx *c) {
  if (pass_elems(c->type) <= PASS_CONST_MAX_ELEMS) return emit_constant(c, pass_filled(c->type, 0));
  op_type scalar = {c->type->dtype, 0, {0}};
  ir_value z = emit_constant(c, pass_filled(&scalar, 0));
  if (z < 0) return z;
  op_attrs a = {0};
  a.rank = c->type->rank;
  memcpy(a.shape, c->type->shape, sizeof a.shape);
  return emit(c, OP_BROADCAST, &a, 1, &z);
}

/* the instruction defining v, when it is op */
static const ir_instr *def_is(const ctx *c, ir_value v, op_id op) {
  const ir_instr *d = ir_def(c->g, v);
  return d && d->op == op && d->n_out == 1 ? d : NULL;
}

/* ---- the rules, one function per op ---- */

static ir_value rule_add(ctx *c) {
  if (is_zero(c, c->x[1], -1) && fits(c, c->x[0])) return c->x[0];
  if (is_zero(c, c->x[0], -1) && fits(c, c->x[1])) return c->x[1];
  return NO_RULE;
}

static ir_value rule_sub(ctx *c) {
  kiln_dtype dt = c->type->dtype;
  if (is_zero(c, c->x[1], +1) && fits(c, c->x[0])) return c->x[0];
  if (is_int(dt) && is_zero(c, c->x[0], 0) && fits(c, c->x[1])) return emit(c, OP_NEG, NULL, 1, &c->x[1]);
  if (is_int(dt) && c->x[0] == c->x[1]) return zeros(c);
  return NO_RULE;
}

static ir_value rule_mul(ctx *c) {
  if (is_one(c, c->x[1]) && fits(c, c->x[0])) return c->x[0];
  if (is_one(c, c->x[0]) && fits(c, c->x[1])) return c->x[1];
  if (is_int(c->type->dtype) && (is_zero(c, c->x[0], 0) || is_zero(c, c->x[1], 0))) return zeros(c);
  return NO_RULE;
}

static ir_value rule_div(ctx *c) {
  kiln_dtype dt = c->type->dtype;
  if (is_one(c, c->x[1]) && fits(c, c->x[0])) return c->x[0];
  if (!is_float(dt)) return NO_RULE;
  /* a constant divisor: every element's reciprocal must be exact */
  const kiln_tensor *d = pass_const(c->g, c->x[1]);
  double val, r = 0;
  if (d) {
    for (int64_t i = 0; i < d->size; i++)
      if (!exact_reciprocal(dt, dtype_load(dt, d->data, i), &r)) return NO_RULE;
    kiln_tensor *t = tensor_alloc("simplify", dt, d->rank, d->shape);
    if (!t) return FAILED;
    for (int64_t i = 0; i < d->size; i++) {
      exact_reciprocal(dt, dtype_load(dt, d->data, i), &r);
      dtype_store(dt, t->data, i, r);
    }
    ir_value in[2] = {c->x[0], emit_constant(c, t)};
    return in[1] < 0 ? FAILED : emit(c, OP_MUL, NULL, 2, in);
  }
  /* a broadcast of one: a scalar reciprocal, if x has the result's shape */
  if (pass_splat(c->g, c->x[1], &val, NULL) && exact_reciprocal(dt, val, &r) && fits(c, c->x[0])) {
    op_type scalar = {dt, 0, {0}};
    ir_value in[2] = {c->x[0], emit_constant(c, pass_filled(&scalar, r))};
    return in[1] < 0 ? FAILED : emit(c, OP_MUL, NULL, 2, in);
  }
  return NO_RULE;
}

static ir_value rule_neg(ctx *c) {
  const ir_instr *d = def_is(c, c->x[0], OP_NEG);
  return d ? d->in[0] : NO_RULE;
}

static bool identity_perm(int n, const int *p) {
  for (int i = 0; i < n; i++)
    if (p[i] != i) return false;
  return true;
}

static ir_value rule_transpose(ctx *c) {
  const op_attrs *q = &c->ins->attrs;
  if (identity_perm(q->naxes, q->axes)) return c->x[0];
  const ir_instr *d = def_is(c, c->x[0], OP_TRANSPOSE);
  if (!d) return NO_RULE;
  /* y = transpose(x, p): y.shape[i] = x.shape[p[i]]; transpose(y, q) reads
   * x.shape[p[q[i]]] */
  op_attrs a = {0};
  a.naxes = q->naxes;
  for (int i = 0; i < q->naxes; i++) a.axes[i] = d->attrs.axes[q->axes[i]];
  if (identity_perm(a.naxes, a.axes)) return d->in[0];
  return emit(c, OP_TRANSPOSE, &a, 1, &d->in[0]);
}

static ir_value rule_reshape(ctx *c) {
  if (fits(c, c->x[0])) return c->x[0];
  const ir_instr *d = def_is(c, c->x[0], OP_RESHAPE);
  if (!d) return NO_RULE;
  if (fits(c, d->in[0])) return d->in[0];
  return emit(c, OP_RESHAPE, &c->ins->attrs, 1, &d->in[0]);
}

static ir_value rule_broadcast(ctx *c) {
  if (fits(c, c->x[0])) return c->x[0];
  const kiln_tensor *k = pass_const(c->g, c->x[0]);
  if (k && k->size == 1 && pass_elems(c->type) <= PASS_CONST_MAX_ELEMS) {
    kiln_tensor *t = tensor_alloc("simplify", c->type->dtype, c->type->rank, c->type->shape);
    if (!t) return FAILED;
    size_t es = kiln_dtype_sizes[k->dtype];
    for (int64_t i = 0; i < t->size; i++) memcpy((char *)t->data + (size_t)i * es, k->data, es);
    return emit_constant(c, t);
  }
  /* broadcasting is right-aligned, so a broadcast of a broadcast is one */
  const ir_instr *d = def_is(c, c->x[0], OP_BROADCAST);
  if (d) return emit(c, OP_BROADCAST, &c->ins->attrs, 1, &d->in[0]);
  return NO_RULE;
}

static ir_value rule_select(ctx *c) {
  double p;
  if (c->x[1] == c->x[2] && fits(c, c->x[1])) return c->x[1];
  if (!pass_splat(c->g, c->x[0], &p, NULL)) return NO_RULE;
  ir_value pick = p != 0 ? c->x[1] : c->x[2];
  return fits(c, pick) ? pick : NO_RULE;
}

/* the replacement of c->ins, NO_RULE, or FAILED */
/* shape t without its leading 1s: how it broadcasts (aligned right) */
static int strip_ones(const op_type *t, const int64_t **dims) {
  int k = 0;
  while (k < t->rank && t->shape[k] == 1) k++;
  *dims = t->shape + k;
  return t->rank - k;
}

/* An elementwise op reading reshape(a) where a broadcasts to the result
 * exactly as the reshape does (their shapes differ only in leading 1s: a
 * moments mean kept as [1,1,1,C] and the same mean reshaped to [C]) reads a
 * itself: the two forms of one subtraction then look alike to cse. */
static ir_value rule_broadcast_operands(ctx *c) {
  ir_value in[3];
  bool any = false;
  for (int k = 0; k < c->ins->n_in; k++) {
    in[k] = c->x[k];
    const ir_instr *r = def_is(c, c->x[k], OP_RESHAPE);
    if (!r) continue;
    const op_type *from = &c->g->types[r->in[0]], *to = &c->g->types[c->x[k]];
    const int64_t *fd, *td;
    int fn = strip_ones(from, &fd), tn = strip_ones(to, &td);
    if (from->rank > c->type->rank || fn != tn || memcmp(fd, td, (size_t)fn * sizeof *fd)) continue;
    in[k] = r->in[0];
    any = true;
  }
  int rank = 0; /* the result's rank must still come from some operand */
  for (int k = 0; k < c->ins->n_in; k++)
    if (c->g->types[in[k]].rank > rank) rank = c->g->types[in[k]].rank;
  if (!any || rank != c->type->rank) return NO_RULE;
  ir_value v = emit(c, c->ins->op, &c->ins->attrs, c->ins->n_in, in);
  return v >= 0 && !fits(c, v) ? FAILED : v;
}

static ir_value simplify_instr(ctx *c) {
  ir_value r = NO_RULE;
  switch (kiln_ops[c->ins->op].kind) {
  case OPK_BINARY:
  case OPK_COMPARE:
  case OPK_SELECT:
    if ((r = rule_broadcast_operands(c)) != NO_RULE) return r;
    break;
  default: break;
  }
  switch (c->ins->op) {
  case OP_ADD: return rule_add(c);
  case OP_SUB: return rule_sub(c);
  case OP_MUL: return rule_mul(c);
  case OP_DIV: return rule_div(c);
  case OP_NEG: return rule_neg(c);
  case OP_IDENTITY:
  case OP_STOP_GRADIENT: return c->x[0];
  case OP_TRANSPOSE: return rule_transpose(c);
  case OP_RESHAPE: return rule_reshape(c);
  case OP_BROADCAST: return rule_broadcast(c);
  case OP_CONVERT: return fits(c, c->x[0]) ? c->x[0] : NO_RULE;
  case OP_SELECT: return rule_select(c);
  default: return NO_RULE;
  }
}

/* The parameter region g returns as result k, or -1. */
static int returns_param(const ir_func *g, int k) {
  ir_value r = k < g->n_results ? g->results[k] : -1;
  return r >= 0 && r < g->n_params ? r : -1;
}

/* Control instruction ins, just copied: maps each result that is one of
 * its operands (see the rules above) to that operand. */
static int pass_through(pass_builder *b, const ir_instr *ins, bool *changed) {
  for (int k = 0; k < ins->n_out; k++) {
    int j = -1;
    if (ins->op == OP_COND) {
      int p = returns_param(ins->attrs.callee, k);
      if (p >= 0 && p == returns_param(ins->attrs.callee2, k)) j = p + 1;
    } else if (k < ins->attrs.n_state) {
      const ir_func *body = ins->op == OP_WHILE ? ins->attrs.callee2 : ins->attrs.callee;
      if (returns_param(body, k) == k) j = k;
    }
    if (j < 0) continue;
    b->map[ins->out + k] = pass_map(b, ins->in[j]);
    *changed = true;
  }
  return 0;
}

int kiln_pass_simplify(ir_func *f) {
  pass_builder b;
  bool changed = false;
  if (pass_begin(&b, f)) return pass_fail("simplify");
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *ins = &f->instrs[i];
    ir_value r = NO_RULE, mark = b.body.n_values;
    if (pass_is_control(ins)) {
      if (pass_copy(&b, ins) < 0 || pass_through(&b, ins, &changed)) {
        pass_abort(&b);
        return pass_fail("simplify");
      }
      continue;
    }
    if (pass_is_pure(ins) && ins->n_in <= 3) {
      ctx c = {&b, &b.body, ins, &f->types[ins->out], {-1, -1, -1}};
      for (int k = 0; k < ins->n_in; k++) c.x[k] = pass_map(&b, ins->in[k]);
      r = simplify_instr(&c);
    }
    if (r == FAILED || (r == NO_RULE && pass_copy(&b, ins) < 0) ||
        (r >= 0 && pass_replace(&b, ins->out, r, r >= mark))) {
      pass_abort(&b);
      return pass_fail("simplify");
    }
    changed |= r >= 0;
  }
  return pass_finish(&b, changed, "simplify");
}
