/* cse.c — common subexpression elimination: two pure instructions with the
 * same op, the same operands (after earlier merges) and the same attributes
 * compute the same values, so the later one is dropped for the earlier
 * (every result of it). One forward sweep with a hash table over the new
 * body.
 *
 * Attributes are compared field by field, only the fields ops.def lists for
 * the op (same.c; constants by dtype, shape and bytes). Operands are
 * matched in order: add(x, y) and add(y, x) are not merged (for floats the
 * NaN a kernel returns depends on the order). Random draws and host calls
 * are never merged.
 *
 * Whole control flow merges too: two cond, while or scan instructions with
 * the same operands and attributes (state, max_iterations; carry, xs,
 * length, reverse) whose regions are pure (pass_func_is_pure: no random
 * draw, no host call, nested) and the same instruction for instruction
 * (pass_same_func: separately traced regions are separate functions, so
 * their structure is compared, nested regions included) compute the same
 * results. So do two calls (or fusions) of the same pure callee, or of
 * callees that are the same. Merging the later into the earlier never runs
 * anything the program would not have run, so an instruction that can fail
 * (a gather out of range, an integer division by zero, a loop whose body
 * fails) merges as well: the earlier one fails first either way. Variables
 * read or assigned inside a body are not an effect here: tracing carries
 * them in and out as operands and results, so two bodies reading a variable
 * across an assignment see different operands and stay apart. The regions
 * of a dropped instruction are emptied by pass_commit. */
#include <stdlib.h>
#include <string.h>

#include "rewrite.h"

/* FNV-1a */
static uint64_t mix(uint64_t h, const void *p, size_t n) {
  const unsigned char *s = p;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h;
}

static uint64_t hash_instr(unsigned m, op_id op, int n, const ir_value *x, const op_attrs *a) {
  uint64_t h = mix(14695981039346656037ull, &op, sizeof op);
  h = mix(h, x, (size_t)n * sizeof *x);
  if (m & PASS_F_DTYPE) h = mix(h, &a->dtype, sizeof a->dtype);
  if (m & (PASS_F_SHAPE | PASS_F_BEGIN)) h = mix(h, a->shape, (size_t)a->rank * sizeof a->shape[0]);
  if (m & PASS_F_AXES) h = mix(h, a->axes, (size_t)a->naxes * sizeof a->axes[0]);
  if (m & PASS_F_AXIS) h = mix(h, &a->axis, sizeof a->axis);
  if (m & PASS_F_TRIP) h = mix(h, &a->trip, sizeof a->trip);
  if ((m & PASS_F_VALUE) && a->value) {
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

/* May ins merge with an equal one? Pure instructions, and calls and
 * control flow whose callees or regions are pure. */
static bool mergeable(const ir_instr *ins, unsigned m) {
  if (m & PASS_F_UNKNOWN) return false;
  if (pass_is_pure(ins)) return true;
  if (ins->op == OP_CALL || ins->op == OP_FUSION) return ins->attrs.callee && pass_func_is_pure(ins->attrs.callee);
  if (pass_is_control(ins))
    return ins->attrs.callee && pass_func_is_pure(ins->attrs.callee) &&
           (!ins->attrs.callee2 || pass_func_is_pure(ins->attrs.callee2));
  return false;
}

/* Are new instruction o and old instruction ins (operands mapped to x) the
 * same? */
static bool same(const pass_builder *b, const ir_instr *o, const ir_instr *ins, const ir_value *x, unsigned m) {
  if (o->op != ins->op || o->n_in != ins->n_in || o->n_out != ins->n_out) return false;
  if (ins->n_in && memcmp(o->in, x, (size_t)ins->n_in * sizeof *x)) return false; /* in is NULL with no inputs */
  if (!pass_same_attrs(m, &o->attrs, &ins->attrs)) return false;
  if (pass_is_pure(ins)) return true;
  /* calls and control flow: their results' types come from the callees */
  for (int r = 0; r < ins->n_out; r++) {
    const op_type *s = &b->body.types[o->out + r], *t = &b->old->types[ins->out + r];
    if (s->dtype != t->dtype || s->rank != t->rank || memcmp(s->shape, t->shape, (size_t)s->rank * sizeof s->shape[0]))
      return false;
  }
  if (ins->op == OP_CALL || ins->op == OP_FUSION)
    return o->attrs.callee == ins->attrs.callee || pass_same_func(o->attrs.callee, ins->attrs.callee);
  if (!o->attrs.callee2 != !ins->attrs.callee2) return false;
  return pass_same_func(o->attrs.callee, ins->attrs.callee) &&
         (!ins->attrs.callee2 || pass_same_func(o->attrs.callee2, ins->attrs.callee2));
}

int kiln_pass_cse(ir_func *f) {
  unsigned fields[OP_COUNT];
  for (int op = 0; op < OP_COUNT; op++) fields[op] = pass_attr_fields((op_id)op);
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
    unsigned m = (unsigned)ins->op < OP_COUNT ? fields[ins->op] : PASS_F_UNKNOWN;
    if (!mergeable(ins, m)) {
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
    ir_value first = -1;
    for (; t.slot[s]; s = (s + 1) & t.mask) {
      const ir_instr *o = &b.body.instrs[t.slot[s] - 1];
      if (t.hash[s] == h && same(&b, o, ins, x, m)) {
        first = o->out;
        break;
      }
    }
    if (first >= 0) {
      for (int r = 0; r < ins->n_out; r++) b.map[ins->out + r] = first + r;
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
