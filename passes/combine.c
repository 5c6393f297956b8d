/* combine.c — the all-reduce combiner (XLA's AllReduceCombiner, Horovod's
 * tensor fusion): all_reduces of one step with the same reduction, dtype
 * and world, none of which reads another's result, become one all_reduce
 * over one buffer, so the step pays one header exchange and one MPI call
 * instead of one per gradient. The group's operands are flattened and
 * concatenated, reduced together, and each result is sliced back out and
 * reshaped; the reduction of each element is the same as unfused, so the
 * results are the same bits.
 *
 * One forward sweep keeps one open group. Collectives must keep their order
 * on every rank, and an instruction with an effect must not move past
 * another, so anything with an effect that does not join the group (another
 * collective, a host call, a random draw, a group member that reads the
 * group's results, or one that would pass GROUP_MAX_BYTES) closes it first:
 * the fused all_reduce runs where the group's last member ran. The pure
 * instructions that read a member's result before then wait and are
 * written after it, in their order. */
#include <stdlib.h>

#include "rewrite.h"

#define GROUP_MAX_BYTES ((int64_t)64 << 20) /* XLA's default combine threshold */

typedef struct {
  pass_builder b;
  const ir_func *f;
  bool *waits;    /* waits[v]: old value v depends on an open member's result */
  int *members;   /* instruction indices of the open group */
  int n_members;
  int *deferred;  /* instruction indices waiting for the group, in order */
  int n_deferred;
  int64_t bytes;
  bool changed;
} combiner;

static int64_t elems(const op_type *t) {
  int64_t n = 1;
  for (int d = 0; d < t->rank; d++) n *= t->shape[d];
  return n;
}

/* Writes the open group (fused when it has two members or more), then the
 * instructions that waited for it. */
static int flush(combiner *c) {
  const ir_func *f = c->f;
  int rc = 0;
  if (c->n_members == 1) {
    rc = pass_copy(&c->b, &f->instrs[c->members[0]]) < 0;
  } else if (c->n_members > 1) {
    ir_value *flat = malloc((size_t)c->n_members * sizeof *flat);
    if (!flat) return kiln_set_error("combine: out of memory");
    const ir_instr *last = &f->instrs[c->members[c->n_members - 1]];
    for (int k = 0; k < c->n_members && !rc; k++) {
      const ir_instr *m = &f->instrs[c->members[k]];
      const op_type *t = &f->types[m->in[0]];
      op_attrs a = {.rank = 1, .shape = {elems(t)}};
      ir_value x = pass_map(&c->b, m->in[0]);
      rc = (flat[k] = pass_emit(&c->b, OP_RESHAPE, &a, 1, &x, m->loc)) < 0;
    }
    op_attrs cat = {.axis = 0};
    ir_value buf = rc ? -1 : pass_emit(&c->b, OP_CONCAT, &cat, c->n_members, flat, last->loc);
    ir_value red = buf < 0 ? -1 : pass_emit(&c->b, OP_ALL_REDUCE, &last->attrs, 1, &buf, last->loc);
    rc = red < 0;
    int64_t at = 0;
    for (int k = 0; k < c->n_members && !rc; k++) {
      const ir_instr *m = &f->instrs[c->members[k]];
      const op_type *t = &f->types[m->out];
      int64_t n = elems(t);
      op_attrs s = {.rank = 1, .shape = {n}, .begin = {at}};
      op_attrs r = {.rank = t->rank};
      for (int d = 0; d < t->rank; d++) r.shape[d] = t->shape[d];
      ir_value piece = pass_emit(&c->b, OP_SLICE, &s, 1, &red, m->loc);
      ir_value out = piece < 0 ? -1 : pass_emit(&c->b, OP_RESHAPE, &r, 1, &piece, m->loc);
      rc = out < 0 || pass_replace(&c->b, m->out, out, true);
      at += n;
    }
    free(flat);
    c->changed = true;
  }
  for (int k = 0; k < c->n_deferred && !rc; k++) rc = pass_copy(&c->b, &f->instrs[c->deferred[k]]) < 0;
  for (int k = 0; k < c->n_members; k++) c->waits[f->instrs[c->members[k]].out] = false;
  for (int k = 0; k < c->n_deferred; k++) {
    const ir_instr *d = &f->instrs[c->deferred[k]];
    for (int r = 0; r < d->n_out; r++) c->waits[d->out + r] = false;
  }
  c->n_members = c->n_deferred = 0;
  c->bytes = 0;
  return rc ? -1 : 0;
}

/* Can all_reduce ins join the open group? */
static bool joins(const combiner *c, const ir_instr *ins, int64_t bytes) {
  if (!c->n_members) return true;
  const ir_instr *first = &c->f->instrs[c->members[0]];
  return !c->waits[ins->in[0]] && ins->attrs.reduce == first->attrs.reduce &&
         ins->attrs.world == first->attrs.world && c->f->types[ins->in[0]].dtype == c->f->types[first->in[0]].dtype &&
         c->bytes + bytes <= GROUP_MAX_BYTES;
}

int kiln_pass_combine(ir_func *f) {
  combiner c = {.f = f};
  c.waits = calloc((size_t)f->n_values + 1, sizeof *c.waits);
  c.members = malloc(((size_t)f->n_instrs + 1) * sizeof *c.members);
  c.deferred = malloc(((size_t)f->n_instrs + 1) * sizeof *c.deferred);
  int rc = !c.waits || !c.members || !c.deferred ? kiln_set_error("combine: out of memory") : pass_begin(&c.b, f);
  bool begun = !rc;
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    const ir_instr *ins = &f->instrs[i];
    int64_t bytes = ins->op == OP_ALL_REDUCE ? ir_type_bytes(&f->types[ins->in[0]]) : 0;
    if (ins->op == OP_ALL_REDUCE && ins->n_in == 1 && bytes > 0 && bytes <= GROUP_MAX_BYTES) {
      if (!joins(&c, ins, bytes) && flush(&c)) {
        rc = -1;
        break;
      }
      c.members[c.n_members++] = i;
      c.bytes += bytes;
      c.waits[ins->out] = true;
      continue;
    }
    bool waits = false;
    for (int k = 0; k < ins->n_in; k++) waits = waits || c.waits[ins->in[k]];
    if (pass_has_effect(ins)) { /* nothing with an effect moves: the group runs first */
      rc = flush(&c) || pass_copy(&c.b, ins) < 0;
    } else if (waits) {
      c.deferred[c.n_deferred++] = i;
      for (int r = 0; r < ins->n_out; r++) c.waits[ins->out + r] = true;
    } else {
      rc = pass_copy(&c.b, ins) < 0;
    }
  }
  if (!rc) rc = flush(&c);
  free(c.waits);
  free(c.members);
  free(c.deferred);
  if (rc) {
    if (begun) pass_abort(&c.b);
    return pass_fail("combine");
  }
  return pass_finish(&c.b, c.changed, "combine");
}
