/* cse.c — common subexpression elimination: two pure instructions with the
 * same op, the same operands (after earlier merges) and the same attributes
 * compute the same value, so the later one is dropped for the earlier. One
 * forward sweep with a hash table over the new body.
 *
 * Attributes are compared field by field, only the fields ops.def lists for
 * the op (the others are unused leftovers); doubles by their bits, so lo=0
 * and lo=-0 differ. Constants are equal when dtype, shape and bytes are (so
 * 0.0 and -0.0 stay apart, and NaNs with the same bits merge). Operands are
 * matched in order: add(x, y) and add(y, x) are not merged (for floats the
 * NaN a kernel returns depends on the order). Random draws, calls and host
 * calls are never merged (pass_is_pure). */
#include <stdlib.h>
#include <string.h>

#include "rewrite.h"

enum {
  F_DTYPE = 1 << 0,
  F_SHAPE = 1 << 1, /* shape and size: rank + shape[] */
  F_BEGIN = 1 << 2,
  F_AXES = 1 << 3, /* axes and perm: naxes + axes[] */
  F_AXIS = 1 << 4,
  F_KEEPDIMS = 1 << 5,
  F_LO = 1 << 6,
  F_HI = 1 << 7,
  F_SEED = 1 << 8,
  F_COUNTER = 1 << 9,
  F_VALUE = 1 << 10,
  F_STRIDE = 1 << 11,
  F_DILATION = 1 << 12,
  F_PADDING = 1 << 13,
  F_GROUPS = 1 << 14,
  F_WINDOW = 1 << 15,
  F_UNKNOWN = 1 << 30, /* a field this pass does not know: never merge */
};

/* the fields ops.def names for op */
static unsigned attr_fields(op_id op) {
  static const struct {
    const char *name;
    unsigned bit;
  } known[] = {{"dtype", F_DTYPE}, {"shape", F_SHAPE},       {"size", F_SHAPE}, {"begin", F_BEGIN},
               {"axes", F_AXES},   {"perm", F_AXES},         {"axis", F_AXIS},  {"keepdims", F_KEEPDIMS},
               {"lo", F_LO},       {"hi", F_HI},             {"seed", F_SEED},  {"counter", F_COUNTER},
               {"value", F_VALUE}, {"stride", F_STRIDE},     {"dilation", F_DILATION},
               {"padding", F_PADDING}, {"groups", F_GROUPS}, {"window", F_WINDOW}};
  unsigned mask = 0;
  for (const char *p = kiln_ops[op].attrs; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    unsigned bit = F_UNKNOWN;
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
      if (strlen(known[i].name) == n && !memcmp(known[i].name, p, n)) bit = known[i].bit;
    mask |= bit;
    p = e ? e + 1 : p + n;
  }
  return mask;
}

static bool same_value(const kiln_tensor *a, const kiln_tensor *b) {
  if (a == b) return true;
  if (!a || !b || a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return !memcmp(a->data, b->data, tensor_bytes(a));
}

static bool same_attrs(unsigned m, const op_attrs *a, const op_attrs *b) {
  if ((m & F_DTYPE) && a->dtype != b->dtype) return false;
  if ((m & F_SHAPE) && (a->rank != b->rank || memcmp(a->shape, b->shape, (size_t)a->rank * sizeof a->shape[0])))
    return false;
  if ((m & F_BEGIN) && (a->rank != b->rank || memcmp(a->begin, b->begin, (size_t)a->rank * sizeof a->begin[0])))
    return false;
  if ((m & F_AXES) && (a->naxes != b->naxes || memcmp(a->axes, b->axes, (size_t)a->naxes * sizeof a->axes[0])))
    return false;
  if ((m & F_AXIS) && a->axis != b->axis) return false;
  if ((m & F_KEEPDIMS) && a->keepdims != b->keepdims) return false;
  if ((m & F_LO) && memcmp(&a->lo, &b->lo, sizeof a->lo)) return false;
  if ((m & F_HI) && memcmp(&a->hi, &b->hi, sizeof a->hi)) return false;
  if ((m & F_SEED) && a->seed != b->seed) return false;
  if ((m & F_COUNTER) && a->counter != b->counter) return false;
  if ((m & F_VALUE) && !same_value(a->value, b->value)) return false;
  if ((m & F_STRIDE) && memcmp(a->stride, b->stride, sizeof a->stride)) return false;
  if ((m & F_DILATION) && memcmp(a->dilation, b->dilation, sizeof a->dilation)) return false;
  if ((m & F_PADDING) && memcmp(a->padding, b->padding, sizeof a->padding)) return false;
  if ((m & F_GROUPS) && a->groups != b->groups) return false;
  if ((m & F_WINDOW) && memcmp(a->window, b->window, sizeof a->window)) return false;
  return true;
}

/* FNV-1a */
static uint64_t mix(uint64_t h, const void *p, size_t n) {
  const unsigned char *s = p;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h;
}

static uint64_t hash_instr(unsigned m, op_id op, int n, const ir_value *x, const op_attrs *a) {
  uint64_t h = mix(14695981039346656037ull, &op, sizeof op);
  h = mix(h, x, (size_t)n * sizeof *x);
  if (m & F_DTYPE) h = mix(h, &a->dtype, sizeof a->dtype);
  if (m & (F_SHAPE | F_BEGIN)) h = mix(h, a->shape, (size_t)a->rank * sizeof a->shape[0]);
  if (m & F_AXES) h = mix(h, a->axes, (size_t)a->naxes * sizeof a->axes[0]);
  if (m & F_AXIS) h = mix(h, &a->axis, sizeof a->axis);
  if ((m & F_VALUE) && a->value) {
    const kiln_tensor *t = a->value;
    h = mix(h, &t->dtype, sizeof t->dtype);
    h = mix(h, t->shape, (size_t)t->rank * sizeof t->shape[0]);
    h = mix(h, t->data, tensor_bytes(t));
  }
  return h;
}

typedef struct table {
  int *slot; /* new instruction index + 1; 0 = empty */
  uint64_t *hash;
  size_t mask;
} table;

int kiln_pass_cse(ir_func *f) {
  unsigned fields[OP_COUNT];
  for (int op = 0; op < OP_COUNT; op++) fields[op] = attr_fields((op_id)op);
  size_t cap = 16;
  while (cap < 2 * (size_t)f->n_instrs) cap *= 2;
  table t = {calloc(cap, sizeof *t.slot), calloc(cap, sizeof *t.hash), cap - 1};
  ir_value small[8], *x = small;
  int xcap = 8, rc = 0;
  bool changed = false;
  pass_builder b;
  if (!t.slot || !t.hash || pass_begin(&b, f)) {
    if (!t.slot || !t.hash) kiln_set_error("cse: out of memory");
    free(t.slot);
    free(t.hash);
    return pass_fail("cse");
  }
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    unsigned m = (unsigned)ins->op < OP_COUNT ? fields[ins->op] : F_UNKNOWN;
    if (!pass_is_pure(ins) || (m & F_UNKNOWN)) {
      rc = pass_copy(&b, ins) < 0;
      continue;
    }
    if (ins->n_in > xcap) {
      if (x != small) free(x);
      if (!(x = malloc((size_t)ins->n_in * sizeof *x))) {
        x = small;
        rc = kiln_set_error("cse: out of memory");
        break;
      }
      xcap = ins->n_in;
    }
    for (int k = 0; k < ins->n_in; k++) x[k] = pass_map(&b, ins->in[k]);
    uint64_t h = hash_instr(m, ins->op, ins->n_in, x, &ins->attrs);
    size_t s = h & t.mask;
    ir_value same = -1;
    for (; t.slot[s]; s = (s + 1) & t.mask) {
      const ir_instr *o = &b.body.instrs[t.slot[s] - 1];
      if (t.hash[s] == h && o->op == ins->op && o->n_in == ins->n_in &&
          (!ins->n_in || !memcmp(o->in, x, (size_t)ins->n_in * sizeof *x)) && /* in is NULL with no inputs */
          same_attrs(m, &o->attrs, &ins->attrs)) {
        same = o->out;
        break;
      }
    }
    if (same >= 0) {
      b.map[ins->out] = same;
      changed = true;
      continue;
    }
    if (pass_copy(&b, ins) < 0) {
      rc = -1;
      break;
    }
    t.slot[s] = b.body.n_instrs; /* the copy's index + 1 */
    t.hash[s] = h;
  }
  if (x != small) free(x);
  free(t.slot);
  free(t.hash);
  if (rc) {
    pass_abort(&b);
    return pass_fail("cse");
  }
  return pass_finish(&b, changed, "cse");
}
