/* foldbn.c — folds a per-channel affine map that follows a convolution or
 * a matmul into its weights, as TensorFlow's fold_batch_norms and PyTorch's
 * optimize_for_inference fold an inference batch norm into the conv before
 * it:
 *
 *     ((conv2d(x, w) - mean) * inv) * scale + offset
 *  -> conv2d(x, w * (inv * scale)) + (offset - mean * inv * scale)
 *
 * The chain is the conv's single user, then each link's single user: add,
 * sub (the chain on the left) and mul whose other operand varies only along
 * the last axis (the output channels: a [C] or [1,1,1,C] vector, or a
 * scalar). The single uses make the factors independent of the conv: a
 * training batch norm, whose mean is a reduction of the conv's output, is
 * never folded. The per-channel arithmetic and the weight product are small
 * ([C] and the filter's size); what is left is the conv and a bias add,
 * which the CPU backend runs as the conv's epilogue.
 *
 * This changes rounding (the products are associated differently, and an
 * infinite factor can give NaN where the chain gave an infinity), so it is
 * not in the default pipeline: kiln_function_set_optimize_for_inference
 * asks for it (PASS_INFERENCE_PIPELINE). */
#include <stdlib.h>

#include "rewrite.h"

/* the fewest output rows (elements / channels) for which a product of the
 * weights costs little beside the conv or matmul itself */
enum { FOLD_MIN_ROWS = 8, FOLD_MAX_CHAIN = 16 };

typedef struct {
  const ir_instr *head;              /* the conv2d or dot */
  const ir_instr *link[FOLD_MAX_CHAIN]; /* the chain, in order */
  ir_value other[FOLD_MAX_CHAIN];    /* each link's per-channel operand */
  int n;
  bool has_mul;
} chain;

static bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }

/* v's type varies at most along its last axis, which is 1 or c long */
static bool per_channel(const op_type *t, int64_t c) {
  for (int d = 0; d + 1 < t->rank; d++)
    if (t->shape[d] != 1) return false;
  return t->rank == 0 || t->shape[t->rank - 1] == 1 || t->shape[t->rank - 1] == c;
}

static bool same_type(const op_type *a, const op_type *b) {
  if (a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int d = 0; d < a->rank; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

/* The chain that follows head (whose result has type t, c channels), or
 * n = 0. uses: of each value of f, results included; user: each value's
 * user when it has exactly one. */
static void find_chain(const ir_func *f, const ir_instr *head, const int *uses, const int32_t *user, chain *ch) {
  ch->head = head, ch->n = 0, ch->has_mul = false;
  const op_type *t = &f->types[head->out];
  int64_t c = t->rank ? t->shape[t->rank - 1] : 0;
  if (!is_float((kiln_dtype)t->dtype) || c < 1 || pass_elems(t) / c < FOLD_MIN_ROWS) return;
  ir_value v = head->out;
  while (ch->n < FOLD_MAX_CHAIN && uses[v] == 1 && user[v] >= 0) {
    const ir_instr *u = &f->instrs[user[v]];
    if ((u->op != OP_ADD && u->op != OP_SUB && u->op != OP_MUL) || u->n_in != 2 || u->in[0] == u->in[1]) break;
    if (u->op == OP_SUB && u->in[0] != v) break;
    ir_value o = u->in[0] == v ? u->in[1] : u->in[0];
    const op_type *ot = &f->types[o];
    if (ot->dtype != t->dtype || !per_channel(ot, c) || !same_type(&f->types[u->out], t)) break;
    ch->link[ch->n] = u;
    ch->other[ch->n++] = o;
    ch->has_mul |= u->op == OP_MUL;
    v = u->out;
  }
  /* adds alone are a bias: nothing to fold (and no rounding to change) */
  if (!ch->has_mul) ch->n = 0;
}

static ir_value emit2(pass_builder *b, op_id op, ir_value x, ir_value y, ir_loc loc) {
  ir_value in[2] = {x, y};
  return pass_emit(b, op, NULL, 2, in, loc);
}

/* The folded form of ch, in place of its last link: the factor a and the
 * shift s of c * a + s over the channels, the head with its weights times
 * a, then + s. */
static int emit_folded(pass_builder *b, const chain *ch) {
  ir_loc loc = ch->link[ch->n - 1]->loc;
  ir_value a = -1, s = -1; /* none yet: 1 and 0 */
  bool has_a = false, has_s = false;
  for (int i = 0; i < ch->n; i++) {
    ir_value o = pass_map(b, ch->other[i]);
    if (o < 0) return -1;
    switch (ch->link[i]->op) {
    case OP_ADD: s = has_s ? emit2(b, OP_ADD, s, o, loc) : o; break;
    case OP_SUB: s = has_s ? emit2(b, OP_SUB, s, o, loc) : pass_emit(b, OP_NEG, NULL, 1, &o, loc); break;
    default: /* mul */
      a = has_a ? emit2(b, OP_MUL, a, o, loc) : o;
      if (has_s && (s = emit2(b, OP_MUL, s, o, loc)) < 0) return -1;
      has_a = true;
      break;
    }
    if (ch->link[i]->op != OP_MUL) has_s = true;
    if ((has_a && a < 0) || (has_s && s < 0)) return -1;
  }
  const ir_instr *h = ch->head;
  ir_value in[2] = {pass_map(b, h->in[0]), pass_map(b, h->in[1])};
  if (in[0] < 0 || in[1] < 0) return -1;
  if ((in[1] = emit2(b, OP_MUL, in[1], a, loc)) < 0) return -1;
  ir_value r = pass_emit(b, h->op, &h->attrs, 2, in, h->loc);
  if (r >= 0 && has_s) r = emit2(b, OP_ADD, r, s, loc);
  if (r < 0) return -1;
  return pass_replace(b, ch->link[ch->n - 1]->out, r, true);
}

/* a head the pass folds into: a conv2d, or a dot, of two operands */
static bool is_head(const ir_instr *in) {
  return (in->op == OP_CONV2D || in->op == OP_DOT) && in->n_in == 2 && in->n_out == 1;
}

int kiln_pass_foldbn(ir_func *f) {
  int n = f->n_values;
  int *uses = calloc((size_t)n + 1, sizeof *uses);
  int32_t *user = malloc(((size_t)n + 1) * sizeof *user);
  /* per instruction: the chain it ends (its index in chains), or skipped */
  int *ends = malloc(((size_t)f->n_instrs + 1) * sizeof *ends);
  bool *skip = calloc((size_t)f->n_instrs + 1, sizeof *skip);
  chain *chains = malloc(((size_t)f->n_instrs + 1) * sizeof *chains);
  int rc = 0, n_chains = 0;
  if (!uses || !user || !ends || !skip || !chains) {
    rc = kiln_set_error("foldbn: out of memory");
    goto out;
  }
  for (int v = 0; v < n; v++) user[v] = -1;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i];
    ends[i] = -1;
    for (int k = 0; k < in->n_in; k++) uses[in->in[k]]++, user[in->in[k]] = i;
  }
  for (int r = 0; r < f->n_results; r++) uses[f->results[r]]++;
  for (int i = 0; i < f->n_instrs; i++) {
    if (!is_head(&f->instrs[i])) continue;
    chain *ch = &chains[n_chains];
    find_chain(f, &f->instrs[i], uses, user, ch);
    if (!ch->n) continue;
    skip[i] = true;
    for (int k = 0; k + 1 < ch->n; k++) skip[ch->link[k] - f->instrs] = true;
    ends[ch->link[ch->n - 1] - f->instrs] = n_chains++;
  }
  if (!n_chains) goto out;
  pass_builder b;
  if (pass_begin(&b, f)) {
    rc = pass_fail("foldbn");
    goto out;
  }
  for (int i = 0; i < f->n_instrs && !rc; i++) {
    if (skip[i]) continue;
    rc = ends[i] >= 0 ? emit_folded(&b, &chains[ends[i]]) : (pass_copy(&b, &f->instrs[i]) < 0 ? -1 : 0);
  }
  if (rc) {
    pass_abort(&b);
    rc = pass_fail("foldbn");
  } else {
    rc = pass_finish(&b, true, "foldbn");
  }
out:
  free(uses), free(user), free(ends), free(skip), free(chains);
  return rc;
}
