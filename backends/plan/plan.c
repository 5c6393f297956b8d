/* plan.c — plans a function for a backend (plan.h): every value gets a
 * slot and every instruction a step, in schedule order; calls and fusions
 * that are not one kernel are inlined; control flow gets nested step lists
 * (control.c); results computed elsewhere (a view, a
 * call's result) are copied into their buffers at the end. The backend's
 * plan_policy says what one kernel holds and which ops are calls. */
#include "plan/build.h"

#include <stdlib.h>
#include <string.h>

int plan_oom(const plan *pl) { return kiln_set_error("%s: out of memory", pl->policy->who); }

int64_t plan_type_size(const op_type *t) {
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}

int64_t plan_slot_align(const plan *pl, int s) {
  int64_t a = KILN_ALIGN;
  while (pl->slots[s].kind == PLAN_SLOT_ROW) {
    int64_t row = pl->slots[s].offset;
    while (a > 1 && row % a) a /= 2;
    s = pl->slots[s].index;
  }
  return a;
}

int64_t plan_type_bytes(const op_type *t) { return plan_type_size(t) * (int64_t)kiln_dtype_sizes[t->dtype]; }

int plan_keep_const(kiln_tensor ***list, int *n, const kiln_tensor *t) {
  for (int i = 0; i < *n; i++)
    if ((*list)[i] == t) return 0;
  kiln_tensor **q = realloc(*list, (size_t)(*n + 1) * sizeof *q);
  if (!q) return -1;
  *list = q;
  q[(*n)++] = kiln_retain((kiln_tensor *)t);
  return 0;
}

/* a new slot of bytes in the arena (0 for other kinds) */
static int add_slot_of(plan *pl, plan_slot s, int64_t bytes) {
  if (pl->n_slots == pl->cap_slots) {
    int cap = pl->cap_slots ? 2 * pl->cap_slots : 16;
    plan_slot *q = realloc(pl->slots, (size_t)cap * sizeof *q);
    if (!q) return plan_oom(pl);
    pl->slots = q;
    int64_t *b = realloc(pl->slot_bytes, (size_t)cap * sizeof *b);
    if (!b) return plan_oom(pl);
    pl->slot_bytes = b;
    pl->cap_slots = cap;
  }
  pl->slots[pl->n_slots] = s;
  pl->slot_bytes[pl->n_slots] = bytes;
  return pl->n_slots++;
}

int plan_add_slot(plan *pl, plan_slot s) { return add_slot_of(pl, s, 0); }

int plan_arena_slot(plan *pl, const op_type *t) {
  int64_t off = (int64_t)pl->arena_bytes;
  pl->arena_bytes = (size_t)((off + plan_type_bytes(t) + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN);
  return add_slot_of(pl, (plan_slot){PLAN_SLOT_ARENA, 0, off, NULL}, plan_type_bytes(t));
}

/* A fresh place for value v of f: the buffer of the result that returns it
 * (top level), else the buffers pass's place, else the arena's end; in a
 * region with a place given for v (a cond's result, a scan's row of ys),
 * that place. */
int plan_value_slot(plan *pl, const ir_func *f, ir_value v, bool top) {
  if (f == pl->dest_f && pl->dest[v] >= 0) {
    int s = pl->dest[v];
    pl->dest[v] = -1; /* once: a value is made once */
    return s;
  }
  if (top && pl->result_of[v] >= 0 && !pl->result_done[pl->result_of[v]]) {
    pl->result_done[pl->result_of[v]] = true;
    return plan_add_slot(pl, (plan_slot){PLAN_SLOT_RESULT, pl->result_of[v], 0, NULL});
  }
  if (top && f->buf_offset && f->buf_offset[v] >= 0)
    return add_slot_of(pl, (plan_slot){PLAN_SLOT_ARENA, 0, f->buf_offset[v], NULL}, ir_buf_bytes(&f->types[v]));
  return plan_arena_slot(pl, &f->types[v]);
}

int plan_add_step(plan *pl, plan_step st) {
  plan_step *q = realloc(pl->steps, (size_t)(pl->n_steps + 1) * sizeof *q);
  if (!q) {
    free(st.slots);
    free(st.state), free(st.move), free(st.state_bytes), free(st.scratch);
    return plan_oom(pl);
  }
  pl->steps = q;
  pl->steps[pl->n_steps++] = st;
  return 0;
}

int plan_note_const(plan *pl, const kiln_tensor *t) {
  if (pl->n_consts == pl->cap_consts) {
    int cap = pl->cap_consts ? 2 * pl->cap_consts : 16;
    const kiln_tensor **q = realloc(pl->consts, (size_t)cap * sizeof *q);
    if (!q) return plan_oom(pl);
    pl->consts = q;
    pl->cap_consts = cap;
  }
  pl->consts[pl->n_consts++] = t;
  return 0;
}

plan_kernel *plan_new_kernel(plan *pl, const ir_func *f, int n_out, op_id op) {
  plan_kernel *q = realloc(pl->kernels, (size_t)(pl->n_kernels + 1) * sizeof *q);
  if (!q) return plan_oom(pl), NULL;
  pl->kernels = q;
  plan_kernel *g = &pl->kernels[pl->n_kernels++]; /* freed with the plan, even half made */
  memset(g, 0, sizeof *g);
  g->f = f;
  g->op = op;
  g->member = calloc((size_t)f->n_instrs + 1, sizeof *g->member);
  g->leaf = malloc(((size_t)f->n_values + 1) * sizeof *g->leaf);
  g->out = malloc(((size_t)n_out + 1) * sizeof *g->out);
  g->out_slot = malloc(((size_t)n_out + 1) * sizeof *g->out_slot);
  if (!g->member || !g->leaf || !g->out || !g->out_slot) return plan_oom(pl), NULL;
  for (int v = 0; v < f->n_values; v++) g->leaf[v] = -1;
  g->n_out = n_out;
  return g;
}

static int add_kernel_step(plan *pl, int gi) {
  return plan_add_step(pl, (plan_step){.kind = PLAN_STEP_KERNEL, .index = gi});
}

/* The step(s) of the newest kernel: two for a reduction the policy splits
 * (its partials in the arena between them). */
static int kernel_step(plan *pl) {
  int gi = pl->n_kernels - 1;
  plan_kernel *g = &pl->kernels[gi];
  int64_t split = pl->policy->split ? pl->policy->split(g) : 0;
  if (split == 0) return add_kernel_step(pl, gi);
  g->pass = 1;
  if (split == 1) return add_kernel_step(pl, gi);
  plan_kernel *g2 = plan_new_kernel(pl, g->f, g->n_out - g->n_side, g->op); /* the reductions */
  if (!g2) return -1;
  g = &pl->kernels[gi];
  g2->pass = 2;
  for (int q = 0; q < g2->n_out; q++) {
    op_type t = {KILN_F64, 1, {split * plan_type_size(&g->f->types[g->out[q]])}}; /* 8 bytes: any accumulator */
    int s = plan_arena_slot(pl, &t);
    if (s < 0) return -1;
    g2->out[q] = g->out[q];
    g2->out_slot[q] = g->out_slot[q];
    g2->leaf[g->out[q]] = s;
    g->out_slot[q] = s;
  }
  if (add_kernel_step(pl, gi)) return -1;
  return add_kernel_step(pl, gi + 1);
}

/* one instruction as a kernel, with the constants it reads pulled inside */
static int instr_kernel(plan *pl, const ir_func *f, int i, const int *vs, int dst) {
  const ir_instr *in = &f->instrs[i];
  plan_kernel *g = plan_new_kernel(pl, f, 1, in->op);
  if (!g) return -1;
  g->member[i] = true;
  for (int k = 0; k < in->n_in; k++) {
    ir_value u = in->in[k];
    const ir_instr *d = ir_def(f, u);
    if (d && d->op == OP_CONSTANT)
      g->member[f->def[u]] = true;
    else
      g->leaf[u] = vs[u];
  }
  g->out[0] = in->out;
  g->out_slot[0] = dst;
  return kernel_step(pl);
}

/* an instruction with a kernel of the backend's own */
static int special_kernel(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top) {
  plan_kernel *g = plan_new_kernel(pl, f, 1, in->op);
  if (!g) return -1;
  g->special = in;
  for (int k = 0; k < in->n_in; k++) g->leaf[in->in[k]] = vs[in->in[k]];
  int s = vs[in->out] = plan_value_slot(pl, f, in->out, top);
  if (s < 0) return -1;
  g = &pl->kernels[pl->n_kernels - 1];
  g->out[0] = in->out;
  g->out_slot[0] = s;
  return kernel_step(pl);
}

/* in (of f) as a call step: its outputs get fresh slots */
static int add_call(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top) {
  plan_call *q = realloc(pl->calls, (size_t)(pl->n_calls + 1) * sizeof *q);
  if (!q) return plan_oom(pl);
  pl->calls = q;
  plan_call *h = &pl->calls[pl->n_calls++];
  memset(h, 0, sizeof *h);
  h->op = in->op;
  h->attrs = in->attrs;
  h->n_in = in->n_in;
  h->n_out = in->n_out;
  h->in_types = malloc(((size_t)in->n_in + 1) * sizeof *h->in_types);
  h->out_types = malloc(((size_t)in->n_out + 1) * sizeof *h->out_types);
  plan_step st = {.kind = PLAN_STEP_CALL, .index = pl->n_calls - 1, .n_slots = in->n_out + in->n_in};
  st.slots = malloc((size_t)st.n_slots * sizeof *st.slots + 1);
  if (!h->in_types || !h->out_types || !st.slots) {
    free(st.slots);
    return plan_oom(pl);
  }
  for (int k = 0; k < in->n_in; k++) {
    h->in_types[k] = f->types[in->in[k]];
    st.slots[in->n_out + k] = vs[in->in[k]];
  }
  for (int k = 0; k < in->n_out; k++) {
    h->out_types[k] = f->types[in->out + k];
    if ((vs[in->out + k] = st.slots[k] = plan_value_slot(pl, f, in->out + k, top)) < 0) {
      free(st.slots);
      return -1;
    }
  }
  return plan_add_step(pl, st);
}

/* ---- dots that read transposed operands in place (plan_policy.dot_transposes) ---- */

/* Per value of f: how many instructions and results read it. malloc'd;
 * NULL out of memory. */
static int *value_uses(const ir_func *f) {
  int *uses = calloc((size_t)f->n_values + 1, sizeof *uses);
  if (!uses) return NULL;
  for (int i = 0; i < f->n_instrs; i++)
    for (int k = 0; k < f->instrs[i].n_in; k++) uses[f->instrs[i].in[k]]++;
  for (int r = 0; r < f->n_results; r++) uses[f->results[r]]++;
  return uses;
}

/* Whether the arena bytes of t's operand stay unwritten from t until reader
 * (both of f) is done reading it: the buffers pass freed them after t, their
 * last reader as it sees it, so an instruction in between may have taken
 * them, and so may the reader's own results when it writes them as it reads
 * (a dot call: its result, a temporary, may lie in those bytes; a fusion
 * runs its dots before its kernel writes anything, so own_outputs false). */
static bool source_intact(const ir_func *f, const ir_instr *t, const ir_instr *reader, bool own_outputs) {
  ir_value s = t->in[0];
  if (!f->buf_offset || f->buf_offset[s] < 0) return true; /* a parameter, constant or result: not reused */
  int64_t lo = f->buf_offset[s], hi = lo + ir_buf_bytes(&f->types[s]);
  for (const ir_instr *i = t + 1; i < reader + own_outputs; i++)
    for (int r = 0; r < i->n_out; r++) {
      int64_t o = f->buf_offset[i->out + r];
      if (o >= 0 && o < hi && o + ir_buf_bytes(&f->types[i->out + r]) > lo) return false;
    }
  return true;
}

/* A transpose (of a matrix: its two dims swapped) that defines value v of
 * f, that nothing else reads (uses: of each value of f, results included)
 * and whose operand is still intact when reader runs, else NULL. */
static const ir_instr *lone_transpose(const ir_func *f, ir_value v, const int *uses, const ir_instr *reader,
                                      bool own_outputs) {
  const ir_instr *t = ir_def(f, v);
  if (!t || t->op != OP_TRANSPOSE || uses[v] != 1 || f->types[t->in[0]].rank != 2) return NULL;
  if (!(t->attrs.axes[0] == 1 && t->attrs.axes[1] == 0)) return NULL;
  return source_intact(f, t, reader, own_outputs) ? t : NULL;
}

/* The transposes a top-level dot call (in, of f) reads in place, in t */
static bool dot_transposes(const plan *pl, const ir_func *f, const ir_instr *in, const int *uses,
                           const ir_instr *t[2]) {
  t[0] = t[1] = NULL;
  if (in->op != OP_DOT || in->n_in != 2 || pl->policy->place(f, in) != PLAN_AS_CALL) return false;
  const ir_instr *c[2] = {lone_transpose(f, in->in[0], uses, in, true), lone_transpose(f, in->in[1], uses, in, true)};
  return pl->policy->dot_transposes(&f->types[in->in[0]], &f->types[in->in[1]], c, t);
}

/* The transposes that dot d, run before the kernel of fusion fu (of f),
 * reads in place: its operands are body parameters, which the dot alone
 * reads (body_uses), bound to values of f that lone transposes define */
static bool fusion_dot_transposes(const plan *pl, const ir_func *f, const ir_instr *fu, const int *uses,
                                  const ir_instr *d, const int *body_uses, const ir_instr *t[2]) {
  const ir_func *c = fu->attrs.callee;
  const ir_instr *cand[2] = {NULL, NULL};
  for (int s = 0; s < 2; s++) {
    ir_value q = d->in[s]; /* a parameter: dot_before_kernel */
    if (q < fu->n_in && body_uses[q] == 1) cand[s] = lone_transpose(f, fu->in[q], uses, fu, false);
  }
  return pl->policy->dot_transposes(&c->types[d->in[0]], &c->types[d->in[1]], cand, t);
}

bool plan_head_apart(const ir_func *c, const ir_instr *in) {
  if (in->op != OP_DOT && in->op != OP_CONV2D) return false;
  for (int k = 0; k < in->n_in; k++)
    if (ir_def(c, in->in[k])) return false;
  for (int r = 0; r < c->n_results; r++)
    if (c->results[r] == in->out) return false;
  return true;
}

static bool before_kernel(const plan *pl, const ir_func *c, const ir_instr *in) {
  return pl->policy->dot_before_kernel && pl->policy->dot_before_kernel(c, in);
}

static bool epilogue(const plan *pl, const ir_func *c, ir_value ops[PLAN_EPILOGUE_OPS], int *epi) {
  for (int k = 0; k < PLAN_EPILOGUE_OPS; k++) ops[k] = -1; /* a policy may leave the residual unset */
  return pl->policy->dot_epilogue && pl->policy->dot_epilogue(c, ops, epi);
}

/* The transposes of f (uses: of its values) that dot calls read in place,
 * marked in skip (per instruction): they are never made. */
static int mark_read_transposes(const plan *pl, const ir_func *f, const int *uses, bool *skip) {
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i], *t[2];
    ir_value ops[PLAN_EPILOGUE_OPS];
    int epi;
    if (dot_transposes(pl, f, in, uses, t)) {
      for (int s = 0; s < 2; s++)
        if (t[s]) skip[t[s] - f->instrs] = true;
    } else if (in->op == OP_FUSION && pl->policy->fusion_one_kernel(in->attrs.callee) &&
               !epilogue(pl, in->attrs.callee, ops, &epi)) {
      const ir_func *c = in->attrs.callee;
      int *body_uses = value_uses(c);
      if (!body_uses) return plan_oom(pl);
      for (int j = 0; j < c->n_instrs; j++)
        if (before_kernel(pl, c, &c->instrs[j]) && pl->policy->place(c, &c->instrs[j]) == PLAN_AS_CALL &&
            fusion_dot_transposes(pl, f, in, uses, &c->instrs[j], body_uses, t))
          for (int s = 0; s < 2; s++)
            if (t[s]) skip[t[s] - f->instrs] = true;
      free(body_uses);
    }
  }
  return 0;
}

/* ---- fusions ---- */

/* The fusion as one call: its head (the body's first instruction, a dot or
 * a conv2d) of three or four inputs (the operands, the bias, a residual) with its epilogue,
 * writing the fusion's result. */
static int dot_epilogue_call(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top,
                             const ir_value ops[PLAN_EPILOGUE_OPS], int epi) {
  ir_value args[PLAN_EPILOGUE_OPS];
  int n = ops[3] >= 0 ? 4 : 3;
  for (int k = 0; k < n; k++) args[k] = in->in[ops[k]]; /* the body's parameters are its first values */
  const ir_instr *head = &in->attrs.callee->instrs[0];
  ir_instr call = {.op = head->op, .attrs = head->attrs, .n_in = n, .in = args, .out = in->out, .n_out = 1,
                   .loc = in->loc};
  if (add_call(pl, f, &call, vs, top)) return -1;
  pl->calls[pl->n_calls - 1].epilogue = epi;
  return 0;
}

/* A fusion that is one kernel, after the dots that run before it (calls,
 * or kernels of the backend's own; uses: of each value of f, for the
 * transposes those dots read in place; NULL when the policy reads none). */
static int fusion_kernel(plan *pl, const ir_func *f, const ir_instr *in, int *vs, bool top, const int *uses) {
  const ir_func *c = in->attrs.callee;
  ir_value ops[PLAN_EPILOGUE_OPS];
  int epi;
  if (epilogue(pl, c, ops, &epi)) return dot_epilogue_call(pl, f, in, vs, top, ops, epi);
  /* the body's slots, for the dots that run before its kernel; parameters
   * bound to a transpose such a dot reads in place are not the kernel's */
  int *cvs = malloc(((size_t)c->n_values + 1) * sizeof *cvs), *body_uses = value_uses(c);
  bool *unread = calloc((size_t)in->n_in + 1, sizeof *unread);
  if (!cvs || !body_uses || !unread) {
    free(cvs), free(body_uses), free(unread);
    return plan_oom(pl);
  }
  for (int k = 0; k < in->n_in; k++) cvs[k] = vs[in->in[k]];
  int rc = 0;
  for (int i = 0; i < c->n_instrs && !rc; i++) {
    const ir_instr *d = &c->instrs[i], *t[2];
    if (!before_kernel(pl, c, d)) continue;
    /* as the instruction alone would run: a kernel of the backend's own
     * (its operands the body's parameters), or a call */
    if (pl->policy->place(c, d) == PLAN_AS_SPECIAL) {
      rc = special_kernel(pl, c, d, cvs, false);
      continue;
    }
    bool trans = uses && fusion_dot_transposes(pl, f, in, uses, d, body_uses, t);
    for (int s = 0; trans && s < 2; s++)
      if (t[s]) cvs[d->in[s]] = vs[t[s]->in[0]], unread[d->in[s]] = true;
    rc = add_call(pl, c, d, cvs, false);
    if (!rc && trans) {
      plan_call *h = &pl->calls[pl->n_calls - 1];
      for (int s = 0; s < 2; s++)
        if (t[s]) h->in_types[s] = f->types[t[s]->in[0]];
      h->trans_a = t[0] != NULL, h->trans_b = t[1] != NULL;
    }
  }
  free(body_uses);
  if (rc) {
    free(cvs), free(unread);
    return -1;
  }
  plan_kernel *g = plan_new_kernel(pl, c, c->n_results, in->op);
  for (int i = 0; g && i < c->n_instrs; i++) {
    if (before_kernel(pl, c, &c->instrs[i])) {
      g->leaf[c->instrs[i].out] = cvs[c->instrs[i].out];
      continue;
    }
    g->member[i] = true;
    if (c->instrs[i].op == OP_CONSTANT && plan_note_const(pl, c->instrs[i].attrs.value)) g = NULL;
  }
  free(cvs);
  if (!g) {
    free(unread);
    return -1;
  }
  for (int k = 0; k < in->n_in; k++) g->leaf[k] = unread[k] ? -1 : vs[in->in[k]];
  free(unread);
  /* the reductions first, then the side outputs (plan_kernel.n_side) */
  bool any_reduce = false;
  for (int r = 0; r < c->n_results; r++)
    any_reduce = any_reduce || kiln_ops[ir_def(c, c->results[r])->op].kind == OPK_REDUCE;
  for (int round = 0, n = 0; round < 2; round++)
    for (int r = 0; r < c->n_results; r++) {
      bool side = any_reduce && kiln_ops[ir_def(c, c->results[r])->op].kind != OPK_REDUCE;
      if (side != (round == 1)) continue;
      int s = plan_value_slot(pl, f, in->out + r, top);
      if (s < 0) return -1;
      vs[in->out + r] = s;
      g->out[n] = c->results[r];
      g->out_slot[n++] = s;
      g->n_side += side;
    }
  return kernel_step(pl);
}

/* ---- functions ---- */

/* Plans f's instructions. vs (per value of f) gets each value's slot; the
 * parameters' slots are given. top: f is the compiled function, whose
 * results get their own buffers. Calls are inlined. */
int plan_func_steps(plan *pl, const ir_func *f, int *vs, const int *param_slots, bool top, int depth) {
  const plan_policy *po = pl->policy;
  if (depth > 100) return kiln_set_error("%s: @%s: calls nest too deep", po->who, pl->f->name);
  for (int i = 0; i < f->n_params; i++) vs[i] = param_slots[i];
  int *uses = NULL;
  bool *skip = NULL; /* transposes that dot calls read in place */
  int rc = 0;
  if (po->dot_transposes) {
    uses = value_uses(f);
    skip = calloc((size_t)f->n_instrs + 1, sizeof *skip);
    rc = !uses || !skip ? plan_oom(pl) : mark_read_transposes(pl, f, uses, skip);
  }
  for (int i = 0; i < f->n_instrs && rc >= 0; i++) {
    rc = 0;
    const ir_instr *in = &f->instrs[i];
    ir_value v = in->out;
    op_id op = in->op;
    op_kind kind = kiln_ops[op].kind;
    const ir_instr *t[2];
    if (skip && skip[i]) {
      continue;
    } else if (uses && dot_transposes(pl, f, in, uses, t)) { /* the dot reads the matrices before their transposes */
      ir_value args[2] = {t[0] ? t[0]->in[0] : in->in[0], t[1] ? t[1]->in[0] : in->in[1]};
      ir_instr dot = *in;
      dot.in = args;
      rc = add_call(pl, f, &dot, vs, top);
      if (rc >= 0) {
        plan_call *h = &pl->calls[pl->n_calls - 1];
        h->trans_a = t[0] != NULL, h->trans_b = t[1] != NULL;
      }
    } else if (op == OP_FUSION && po->fusion_one_kernel(in->attrs.callee)) {
      rc = fusion_kernel(pl, f, in, vs, top, uses);
    } else if (op == OP_CONSTANT) {
      rc = plan_note_const(pl, in->attrs.value);
      if (rc >= 0) rc = vs[v] = plan_add_slot(pl, (plan_slot){PLAN_SLOT_CONST, 0, 0, in->attrs.value});
    } else if (kind == OPK_CONTROL) {
      rc = plan_control(pl, f, in, vs, top, depth);
    } else if (kind == OPK_VIEW) {
      vs[v] = vs[in->in[0]]; /* the same bytes, read with another shape */
    } else if (kind == OPK_CALL) { /* call, and fusions that are not one kernel: inline */
      const ir_func *c = in->attrs.callee;
      int *cvs = malloc(((size_t)c->n_values + 1) * sizeof *cvs);
      int *ps = malloc(((size_t)in->n_in + 1) * sizeof *ps);
      if (!cvs || !ps) rc = plan_oom(pl);
      for (int k = 0; !rc && k < in->n_in; k++) ps[k] = vs[in->in[k]];
      if (!rc) rc = plan_func_steps(pl, c, cvs, ps, false, depth + 1);
      for (int k = 0; !rc && k < in->n_out; k++) vs[v + k] = cvs[c->results[k]];
      free(cvs);
      free(ps);
    } else {
      switch (po->place(f, in)) {
        case PLAN_AS_KERNEL: {
          int dst = vs[v] = plan_value_slot(pl, f, v, top);
          rc = dst < 0 ? -1 : instr_kernel(pl, f, i, vs, dst);
          break;
        }
        case PLAN_AS_SPECIAL: rc = special_kernel(pl, f, in, vs, top); break;
        case PLAN_AS_CALL: rc = add_call(pl, f, in, vs, top); break;
        default:
          rc = kiln_set_error("%s: @%s: %s %s", po->who, f->name, kiln_ops[op].name, po->unsupported);
      }
    }
  }
  free(uses);
  free(skip);
  return rc < 0 ? -1 : 0;
}

/* How each result is produced; one computed elsewhere (a view, a call's
 * result) is copied into its buffer at the end. */
static int plan_results(plan *pl) {
  const ir_func *f = pl->f;
  for (int r = 0; r < f->n_results; r++) {
    ir_value v = f->results[r];
    const ir_instr *d = ir_def(f, v);
    plan_result *res = &pl->results[r];
    if (pl->result_of[v] != r) {
      *res = (plan_result){PLAN_RES_SAME, pl->result_of[v], NULL};
    } else if (!d) {
      *res = (plan_result){PLAN_RES_PARAM, v, NULL};
    } else if (d->op == OP_CONSTANT) {
      *res = (plan_result){PLAN_RES_CONST, 0, d->attrs.value};
    } else {
      *res = (plan_result){PLAN_RES_OWN, 0, NULL};
      const plan_slot *s = &pl->slots[pl->vslot[v]];
      if (s->kind == PLAN_SLOT_RESULT && s->index == r) continue;
      int dst = plan_add_slot(pl, (plan_slot){PLAN_SLOT_RESULT, r, 0, NULL});
      int *sl = malloc(2 * sizeof *sl);
      if (dst < 0 || !sl) {
        free(sl);
        return dst < 0 ? -1 : plan_oom(pl);
      }
      sl[0] = dst;
      sl[1] = pl->vslot[v];
      if (plan_add_step(pl, (plan_step){.kind = PLAN_STEP_COPY, .n_slots = 2, .slots = sl,
                                   .bytes = plan_type_bytes(&f->types[v])}))
        return -1;
    }
  }
  return 0;
}

int plan_build(plan *pl, const ir_func *f, const plan_policy *policy) {
  memset(pl, 0, sizeof *pl);
  pl->f = f;
  pl->policy = policy;
  pl->vslot = malloc(((size_t)f->n_values + 1) * sizeof *pl->vslot);
  pl->result_of = malloc(((size_t)f->n_values + 1) * sizeof *pl->result_of);
  pl->result_done = calloc((size_t)f->n_results + 1, sizeof *pl->result_done);
  pl->results = calloc((size_t)f->n_results + 1, sizeof *pl->results);
  int *ps = malloc(((size_t)f->n_params + 1) * sizeof *ps);
  if (!pl->vslot || !pl->result_of || !pl->result_done || !pl->results || !ps) {
    free(ps);
    return plan_oom(pl);
  }
  for (int v = 0; v < f->n_values; v++) pl->vslot[v] = -1, pl->result_of[v] = -1;
  for (int r = f->n_results - 1; r >= 0; r--) pl->result_of[f->results[r]] = r;
  /* with a buffers plan, its arena comes first; values it did not place follow */
  if (f->buf_offset) pl->arena_bytes = (size_t)((f->arena_bytes + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN);
  int rc = 0;
  for (int i = 0; i < f->n_params && rc >= 0; i++)
    rc = ps[i] = plan_add_slot(pl, (plan_slot){PLAN_SLOT_PARAM, i, 0, NULL});
  if (rc >= 0) rc = plan_func_steps(pl, f, pl->vslot, ps, true, 0);
  free(ps);
  if (rc < 0 || plan_results(pl)) return -1;
  return plan_pack_arena(pl);
}

void plan_free_steps(plan_step *steps, int n) {
  for (int s = 0; s < n; s++) {
    free(steps[s].slots);
    free(steps[s].state), free(steps[s].move), free(steps[s].state_bytes), free(steps[s].scratch);
    for (int k = 0; k < 2; k++) plan_free_steps(steps[s].sub[k], steps[s].n_sub[k]);
  }
  free(steps);
}

void plan_free(plan *pl) {
  for (int g = 0; g < pl->n_kernels; g++) {
    free(pl->kernels[g].member);
    free(pl->kernels[g].leaf);
    free(pl->kernels[g].out);
    free(pl->kernels[g].out_slot);
  }
  for (int c = 0; c < pl->n_calls; c++) free(pl->calls[c].in_types), free(pl->calls[c].out_types);
  plan_free_steps(pl->steps, pl->n_steps);
  free(pl->kernels);
  free(pl->calls);
  free(pl->slots);
  free(pl->slot_bytes);
  free(pl->vslot);
  free(pl->results);
  free(pl->consts);
  free(pl->result_of);
  free(pl->result_done);
  memset(pl, 0, sizeof *pl);
}
