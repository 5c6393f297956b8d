/* same.c — when two instructions compute the same values: the attribute
 * comparison cse merges by, and the structural equality of two pure
 * functions (regions, callees) that lets cse merge whole control flow and
 * licm find the work both branches of a cond do.
 *
 * Attributes are compared field by field, only the fields ops.def lists for
 * the op (the others are unused leftovers); doubles by their bits, so lo=0
 * and lo=-0 differ. Constants are equal when dtype, shape and bytes are (so
 * 0.0 and -0.0 stay apart, and NaNs with the same bits merge).
 *
 * Two functions are the same when they have the same parameter types and,
 * instruction by instruction in order, the same op, the same operands (the
 * k-th value of one for the k-th of the other: parameters by position,
 * results of the instructions compared before), the same attributes, the
 * same result types, and callees and regions that are the same in turn;
 * and they return corresponding values. Separately traced regions are
 * separate functions, so pointers are not compared, structure is. Only pure
 * functions compare equal: a random draw, a host call or an op this file
 * does not know makes a function differ from everything, itself included. */
#include <string.h>

#include "rewrite.h"

unsigned pass_attr_fields(op_id op) {
  static const struct {
    const char *name;
    unsigned bit;
  } known[] = {{"dtype", PASS_F_DTYPE},
               {"shape", PASS_F_SHAPE},
               {"size", PASS_F_SHAPE},
               {"begin", PASS_F_BEGIN},
               {"axes", PASS_F_AXES},
               {"perm", PASS_F_AXES},
               {"axis", PASS_F_AXIS},
               {"keepdims", PASS_F_KEEPDIMS},
               {"lo", PASS_F_LO},
               {"hi", PASS_F_HI},
               {"seed", PASS_F_SEED},
               {"counter", PASS_F_COUNTER},
               {"value", PASS_F_VALUE},
               {"stride", PASS_F_STRIDE},
               {"dilation", PASS_F_DILATION},
               {"padding", PASS_F_PADDING},
               {"groups", PASS_F_GROUPS},
               {"window", PASS_F_WINDOW},
               {"callee", PASS_F_CALLEE},
               {"state", PASS_F_STATE},
               {"carry", PASS_F_STATE},
               {"xs", PASS_F_XS},
               {"length", PASS_F_TRIP},
               {"max_iterations", PASS_F_TRIP},
               {"reverse", PASS_F_REVERSE}};
  if ((unsigned)op >= OP_COUNT) return PASS_F_UNKNOWN;
  unsigned mask = 0;
  for (const char *p = kiln_ops[op].attrs; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    unsigned bit = PASS_F_UNKNOWN;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
      if (strlen(known[i].name) == n && !memcmp(known[i].name, p, n)) bit = known[i].bit;
    mask |= bit;
    p = e ? e + 1 : p + n;
  }
  return mask;
}

bool pass_same_tensor(const kiln_tensor *a, const kiln_tensor *b) {
  if (a == b) return true;
  if (!a || !b || a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return !memcmp(a->data, b->data, tensor_bytes(a));
}

bool pass_same_attrs(unsigned m, const op_attrs *a, const op_attrs *b) {
  if (m & PASS_F_UNKNOWN) return false;
  if ((m & PASS_F_DTYPE) && a->dtype != b->dtype) return false;
  if ((m & PASS_F_SHAPE) &&
      (a->rank != b->rank || memcmp(a->shape, b->shape, (size_t)a->rank * sizeof a->shape[0])))
    return false;
  if ((m & PASS_F_BEGIN) &&
      (a->rank != b->rank || memcmp(a->begin, b->begin, (size_t)a->rank * sizeof a->begin[0])))
    return false;
  if ((m & PASS_F_AXES) && (a->naxes != b->naxes || memcmp(a->axes, b->axes, (size_t)a->naxes * sizeof a->axes[0])))
    return false;
  if ((m & PASS_F_AXIS) && a->axis != b->axis) return false;
  if ((m & PASS_F_KEEPDIMS) && a->keepdims != b->keepdims) return false;
  if ((m & PASS_F_LO) && memcmp(&a->lo, &b->lo, sizeof a->lo)) return false;
  if ((m & PASS_F_HI) && memcmp(&a->hi, &b->hi, sizeof a->hi)) return false;
  if ((m & PASS_F_SEED) && (a->seed != b->seed || a->stateful != b->stateful)) return false;
  if ((m & PASS_F_COUNTER) && a->counter != b->counter) return false;
  if ((m & PASS_F_VALUE) && !pass_same_tensor(a->value, b->value)) return false;
  if ((m & PASS_F_STRIDE) && memcmp(a->stride, b->stride, sizeof a->stride)) return false;
  if ((m & PASS_F_DILATION) && memcmp(a->dilation, b->dilation, sizeof a->dilation)) return false;
  if ((m & PASS_F_PADDING) && memcmp(a->padding, b->padding, sizeof a->padding)) return false;
  if ((m & PASS_F_GROUPS) && a->groups != b->groups) return false;
  if ((m & PASS_F_WINDOW) && memcmp(a->window, b->window, sizeof a->window)) return false;
  if ((m & PASS_F_STATE) && a->n_state != b->n_state) return false;
  if ((m & PASS_F_XS) && a->n_xs != b->n_xs) return false;
  if ((m & PASS_F_TRIP) && a->trip != b->trip) return false;
  if ((m & PASS_F_REVERSE) && a->reverse != b->reverse) return false;
  /* callee (and a control instruction's regions): pass_same_func's business */
  return true;
}

static bool same_type(const op_type *a, const op_type *b) {
  if (a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

/* Bounds the walk through callees and regions (the verifier rejects
 * recursion; deeper nesting compares unequal). */
enum { SAME_DEPTH = 16 };

static bool same_func(const ir_func *a, const ir_func *b, int depth);

/* Regions or callees of two instructions of the same op. */
static bool same_callees(const ir_instr *x, const ir_instr *y, int depth) {
  op_kind k = kiln_ops[x->op].kind;
  if (k == OPK_CALL) {
    if (x->attrs.callee == y->attrs.callee) return x->attrs.callee && pass_func_is_pure(x->attrs.callee);
    return same_func(x->attrs.callee, y->attrs.callee, depth + 1);
  }
  if (k == OPK_CONTROL) {
    if (!x->attrs.callee2 != !y->attrs.callee2) return false;
    return same_func(x->attrs.callee, y->attrs.callee, depth + 1) &&
           (!x->attrs.callee2 || same_func(x->attrs.callee2, y->attrs.callee2, depth + 1));
  }
  return true;
}

/* Two draws, host calls or collectives are never the same, even alike:
 * each has its own effect. */
static bool has_effect(op_kind k) { return k == OPK_RANDOM || k == OPK_HOST || k == OPK_COLLECTIVE; }

bool pass_same_instr(const ir_func *fx, const ir_instr *x, const ir_func *fy, const ir_instr *y,
                     const ir_value *in_y) {
  if (x->op != y->op || (unsigned)x->op >= OP_COUNT || x->n_in != y->n_in || x->n_out != y->n_out) return false;
  op_kind k = kiln_ops[x->op].kind;
  if (has_effect(k)) return false;
  if (!pass_same_attrs(pass_attr_fields(x->op), &x->attrs, &y->attrs)) return false;
  for (int i = 0; i < x->n_in; i++)
    if (in_y[i] != y->in[i]) return false;
  for (int r = 0; r < x->n_out; r++)
    if (!same_type(&fx->types[x->out + r], &fy->types[y->out + r])) return false;
  return same_callees(x, y, 0);
}

static bool same_func(const ir_func *a, const ir_func *b, int depth) {
  if (!a || !b || depth > SAME_DEPTH) return false;
  if (a->n_params != b->n_params || a->n_results != b->n_results || a->n_instrs != b->n_instrs ||
      a->n_values != b->n_values)
    return false;
  for (int p = 0; p < a->n_params; p++)
    if (!same_type(&a->types[p], &b->types[p])) return false;
  /* a's values are numbered as b's when the instructions correspond one to
   * one (both number their results in order): the map is the identity, but
   * checked, not assumed */
  for (int i = 0; i < a->n_instrs; i++) {
    const ir_instr *x = &a->instrs[i], *y = &b->instrs[i];
    if (x->op != y->op || (unsigned)x->op >= OP_COUNT || x->n_in != y->n_in || x->n_out != y->n_out ||
        x->out != y->out)
      return false;
    op_kind k = kiln_ops[x->op].kind;
    if (has_effect(k)) return false;
    if (!pass_same_attrs(pass_attr_fields(x->op), &x->attrs, &y->attrs)) return false;
    if (x->n_in && memcmp(x->in, y->in, (size_t)x->n_in * sizeof *x->in)) return false;
    for (int r = 0; r < x->n_out; r++)
      if (!same_type(&a->types[x->out + r], &b->types[y->out + r])) return false;
    if (!same_callees(x, y, depth)) return false;
  }
  for (int r = 0; r < a->n_results; r++)
    if (a->results[r] != b->results[r]) return false;
  return true;
}

bool pass_same_func(const ir_func *a, const ir_func *b) { return same_func(a, b, 0); }
