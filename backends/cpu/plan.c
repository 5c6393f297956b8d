/* plan.c — the plan of a compiled program: every value gets a place (a
 * parameter, a result, an arena offset, a constant, or the place of the
 * value a view reads) and every instruction a step: a compiled kernel (a
 * group of fusible instructions), a runtime helper (dot, gather, ...
 * through the eager kernels) or a copy into a result's buffer; then which
 * results may be written over a parameter's buffer (donation). */
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"
#include "cpu/gemm.h"

int cpu_oom(void) { return kiln_set_error("cpu: out of memory"); }

static int add_slot(cpu_build *cb, slot s) {
  if (cb->n_slots == cb->cap_slots) {
    int cap = cb->cap_slots ? 2 * cb->cap_slots : 16;
    slot *q = realloc(cb->slots, (size_t)cap * sizeof *q);
    if (!q) return cpu_oom();
    cb->slots = q;
    cb->cap_slots = cap;
  }
  cb->slots[cb->n_slots] = s;
  return cb->n_slots++;
}

int64_t cpu_type_size(const op_type *t) {
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}

int64_t cpu_type_bytes(const op_type *t) { return cpu_type_size(t) * (int64_t)kiln_dtype_sizes[t->dtype]; }

static int arena_slot(cpu_build *cb, const op_type *t) {
  int64_t off = (int64_t)cb->p->arena_bytes;
  cb->p->arena_bytes = (size_t)((off + cpu_type_bytes(t) + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN);
  return add_slot(cb, (slot){SLOT_ARENA, 0, off, NULL});
}

/* A fresh place for value v of f: the buffer of the result that returns it
 * (top level), else the arena. */
static int value_slot(cpu_build *cb, const ir_func *f, ir_value v, bool top) {
  if (top && cb->result_of[v] >= 0 && !cb->result_done[cb->result_of[v]]) {
    cb->result_done[cb->result_of[v]] = true;
    return add_slot(cb, (slot){SLOT_RESULT, cb->result_of[v], 0, NULL});
  }
  if (top && f->buf_offset && f->buf_offset[v] >= 0) /* the buffers pass's plan */
    return add_slot(cb, (slot){SLOT_ARENA, 0, f->buf_offset[v], NULL});
  return arena_slot(cb, &f->types[v]);
}

static int add_step(cpu_build *cb, step st) {
  step *q = realloc(cb->steps, (size_t)(cb->n_steps + 1) * sizeof *q);
  if (!q) {
    free(st.slots);
    return cpu_oom();
  }
  cb->steps = q;
  cb->steps[cb->n_steps++] = st;
  if (st.n_slots + 1 > cb->max_bufs) cb->max_bufs = st.n_slots + 1;
  return 0;
}

static int retain_const(cpu_build *cb, kiln_tensor *t) {
  const_list *l = cb->consts;
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 16;
    const kiln_tensor **q = realloc(l->t, (size_t)cap * sizeof *q);
    if (!q) return cpu_oom();
    l->t = q;
    l->cap = cap;
  }
  l->t[l->n++] = t;
  cpu_program *p = cb->p;
  for (int i = 0; i < p->n_consts; i++)
    if (p->consts[i] == t) return 0;
  kiln_tensor **q = realloc(p->consts, (size_t)(p->n_consts + 1) * sizeof *q);
  if (!q) return cpu_oom();
  p->consts = q;
  p->consts[p->n_consts++] = kiln_retain(t);
  return 0;
}

static kgroup *new_group(cpu_build *cb, const ir_func *f, int n_out) {
  kgroup *q = realloc(cb->groups, (size_t)(cb->n_groups + 1) * sizeof *q);
  if (!q) return cpu_oom(), NULL;
  cb->groups = q;
  kgroup *g = &cb->groups[cb->n_groups];
  memset(g, 0, sizeof *g);
  g->f = f;
  g->member = calloc((size_t)f->n_instrs + 1, sizeof *g->member);
  g->leaf = malloc(((size_t)f->n_values + 1) * sizeof *g->leaf);
  g->out = malloc((size_t)n_out * sizeof *g->out);
  g->out_slot = malloc((size_t)n_out * sizeof *g->out_slot);
  cb->n_groups++; /* freed with the build, even half made */
  if (!g->member || !g->leaf || !g->out || !g->out_slot) return cpu_oom(), NULL;
  for (int v = 0; v < f->n_values; v++) g->leaf[v] = -1;
  g->n_out = n_out;
  return g;
}

/* the step of the newest group, after counting the pointers it passes */
static int group_step(cpu_build *cb, kgroup *g) {
  int bufs = g->n_out;
  for (int v = 0; v < g->f->n_values; v++) bufs += g->leaf[v] >= 0;
  if (bufs + 2 > cb->max_bufs) cb->max_bufs = bufs + 2;
  return add_step(cb, (step){STEP_KERNEL, cb->n_groups - 1, 0, NULL, 0});
}

/* one instruction as a kernel, with the constants it reads pulled inside */
static int plan_kernel(cpu_build *cb, const ir_func *f, int i, const int *vs, int dst) {
  const ir_instr *in = &f->instrs[i];
  kgroup *g = new_group(cb, f, 1);
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
  return group_step(cb, g);
}

/* A dot of a fusion body that runs just before the body's kernel, as a
 * packed matmul (a runtime helper) into a temporary that the kernel reads:
 * its inner dimension is too long to sum per element, its operands are the
 * body's parameters, and only the body reads it. The rest of the body (a
 * bias, an activation, an SGD update) is then one kernel, not one per op. */
static bool dot_before_kernel(const ir_func *c, const ir_instr *in) {
  if (in->op != OP_DOT || llvm_dot_inline(c, in)) return false;
  for (int k = 0; k < in->n_in; k++)
    if (ir_def(c, in->in[k])) return false;
  for (int r = 0; r < c->n_results; r++)
    if (c->results[r] == in->out) return false;
  return true;
}

/* a dot a kernel can take: summed in it, or run just before it */
static bool dot_in_fusion(const ir_func *c, const ir_instr *in) {
  return llvm_dot_inline(c, in) || dot_before_kernel(c, in);
}

/* Whether a fusion's body can be one kernel (the shared rule) */
static bool fusion_ok(const ir_func *c) { return llvm_fusion_one_kernel(c, dot_in_fusion); }

static int plan_helper(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top);

/* Whether a fusion body is exactly a dot that runs before its kernel, big
 * enough for the compiled micro-kernel (lib/matmul.h), + a bias over its
 * columns (a parameter of n values), and maybe relu or tanh, with that one
 * result. The matmul then applies bias and activation as it stores its
 * tiles, and the body needs no kernel (nor a temporary). ops gets the
 * parameters that are the dot's operands and the bias. */
static bool dot_epilogue(const ir_func *c, ir_value ops[3], gemm_epilogue *epi) {
  if (c->n_results != 1 || c->n_instrs < 2 || c->n_instrs > 3) return false;
  const ir_instr *d = &c->instrs[0], *add = &c->instrs[1];
  const op_type *t = &c->types[d->out];
  if (!dot_before_kernel(c, d) || add->op != OP_ADD || (t->dtype != KILN_F32 && t->dtype != KILN_F64)) return false;
  int64_t m = t->shape[t->rank - 2], n = t->shape[t->rank - 1];
  int64_t k = c->types[d->in[0]].shape[c->types[d->in[0]].rank - 1];
  if (m < 2 || n < 2 || m * n * k < MATMUL_JIT_WORK) return false;
  ir_value bias = add->in[0] == d->out ? add->in[1] : add->in[0];
  const op_type *bt = &c->types[bias], *at = &c->types[add->out];
  if (bias == d->out || (add->in[0] != d->out && add->in[1] != d->out) || ir_def(c, bias)) return false;
  if (bt->rank < 1 || bt->shape[bt->rank - 1] != n || cpu_type_size(bt) != n || bt->rank > t->rank ||
      cpu_type_size(at) != cpu_type_size(t))
    return false;
  *epi = GEMM_EPI_BIAS;
  ir_value out = add->out;
  if (c->n_instrs == 3) {
    const ir_instr *act = &c->instrs[2];
    if ((act->op != OP_RELU && act->op != OP_TANH) || act->in[0] != add->out) return false;
    *epi = act->op == OP_RELU ? GEMM_EPI_BIAS_RELU : GEMM_EPI_BIAS_TANH;
    out = act->out;
  }
  if (c->results[0] != out) return false;
  ops[0] = d->in[0], ops[1] = d->in[1], ops[2] = bias;
  return true;
}

/* The fusion as one helper: a dot of three inputs (the operands and the
 * bias) with its epilogue, which run.c gives to matmul_epilogue
 * (lib/matmul.h), writing the fusion's result. */
static int plan_dot_epilogue(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top,
                             const ir_value ops[3], gemm_epilogue epi) {
  ir_value args[3];
  for (int k = 0; k < 3; k++) args[k] = in->in[ops[k]]; /* the body's parameters are its first values */
  ir_instr call = {.op = OP_DOT, .n_in = 3, .in = args, .out = in->out, .n_out = 1, .loc = in->loc};
  if (plan_helper(cb, f, &call, vs, top)) return -1;
  cb->p->helpers[cb->p->n_helpers - 1].epilogue = (int)epi;
  return 0;
}

/* A transpose (of a matrix: its two dims swapped) that defines value v of
 * f and that nothing else reads (uses: of each value of f, results
 * included), else NULL. */
static const ir_instr *lone_transpose(const ir_func *f, ir_value v, const int *uses) {
  const ir_instr *t = ir_def(f, v);
  if (!t || t->op != OP_TRANSPOSE || uses[v] != 1 || f->types[t->in[0]].rank != 2) return NULL;
  return t->attrs.axes[0] == 1 && t->attrs.axes[1] == 0 ? t : NULL;
}

/* The transposes (c[0] of the first operand, c[1] of the second, either
 * NULL) that a dot helper of operand types a . b (rank 2) reads in place
 * (matmul_trans), in t: a few rows times a transposed matrix (matmul_nt),
 * or float products that pack, whose packing reads either operand as it
 * lies. False when none. */
static bool trans_plan(const op_type *a, const op_type *b, const ir_instr *const c[2], const ir_instr *t[2]) {
  t[0] = t[1] = NULL;
  if (a->rank != 2 || b->rank != 2 || (!c[0] && !c[1])) return false;
  int64_t m = a->shape[0], k = a->shape[1], n = b->shape[1];
  if (c[1] && !c[0] && m <= MATMUL_NT_ROWS) {
    t[1] = c[1];
    return true;
  }
  if ((a->dtype != KILN_F32 && a->dtype != KILN_F64) || !matmul_packs(m, n, k)) return false;
  t[0] = c[0], t[1] = c[1];
  return true;
}

/* trans_plan for a top-level dot in of f that runs as a helper */
static bool dot_transposes(const ir_func *f, const ir_instr *in, const int *uses, const ir_instr *t[2]) {
  t[0] = t[1] = NULL;
  if (in->op != OP_DOT || in->n_in != 2 || llvm_dot_inline(f, in)) return false;
  const ir_instr *c[2] = {lone_transpose(f, in->in[0], uses), lone_transpose(f, in->in[1], uses)};
  return trans_plan(&f->types[in->in[0]], &f->types[in->in[1]], c, t);
}

/* trans_plan for dot d that runs before the kernel of fusion fu (of f):
 * its operands are body parameters, which the dot alone reads (body_uses),
 * bound to values of f that lone transposes define */
static bool fusion_dot_transposes(const ir_func *f, const ir_instr *fu, const int *uses, const ir_instr *d,
                                  const int *body_uses, const ir_instr *t[2]) {
  const ir_func *c = fu->attrs.callee;
  const ir_instr *cand[2] = {NULL, NULL};
  for (int s = 0; s < 2; s++) {
    ir_value q = d->in[s]; /* a parameter: dot_before_kernel */
    if (q < fu->n_in && body_uses[q] == 1) cand[s] = lone_transpose(f, fu->in[q], uses);
  }
  return trans_plan(&c->types[d->in[0]], &c->types[d->in[1]], cand, t);
}

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

/* uses: of each value of f (plan_func's), for the transposes the fusion's
 * dots read in place */
static int plan_fusion(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top, const int *uses) {
  const ir_func *c = in->attrs.callee;
  ir_value ops[3];
  gemm_epilogue epi;
  if (dot_epilogue(c, ops, &epi)) return plan_dot_epilogue(cb, f, in, vs, top, ops, epi);
  /* the body's slots, for the dots that run before its kernel; parameters
   * bound to a transpose such a dot reads in place are not the kernel's */
  int *cvs = malloc(((size_t)c->n_values + 1) * sizeof *cvs), *body_uses = value_uses(c);
  bool *unread = calloc((size_t)in->n_in + 1, sizeof *unread);
  if (!cvs || !body_uses || !unread) {
    free(cvs), free(body_uses), free(unread);
    return cpu_oom();
  }
  for (int k = 0; k < in->n_in; k++) cvs[k] = vs[in->in[k]];
  int rc = 0;
  for (int i = 0; i < c->n_instrs && !rc; i++) {
    const ir_instr *d = &c->instrs[i], *t[2];
    if (!dot_before_kernel(c, d)) continue;
    bool trans = fusion_dot_transposes(f, in, uses, d, body_uses, t);
    for (int s = 0; trans && s < 2; s++)
      if (t[s]) cvs[d->in[s]] = vs[t[s]->in[0]], unread[d->in[s]] = true;
    rc = plan_helper(cb, c, d, cvs, false);
    if (!rc && trans) {
      cpu_helper *h = &cb->p->helpers[cb->p->n_helpers - 1];
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
  kgroup *g = new_group(cb, c, c->n_results);
  for (int i = 0; g && i < c->n_instrs; i++) {
    if (dot_before_kernel(c, &c->instrs[i])) {
      g->leaf[c->instrs[i].out] = cvs[c->instrs[i].out];
      continue;
    }
    g->member[i] = true;
    if (c->instrs[i].op == OP_CONSTANT && retain_const(cb, c->instrs[i].attrs.value)) g = NULL;
  }
  free(cvs);
  if (!g) {
    free(unread);
    return -1;
  }
  for (int k = 0; k < in->n_in; k++) g->leaf[k] = unread[k] ? -1 : vs[in->in[k]];
  free(unread);
  for (int r = 0; r < c->n_results; r++) {
    int s = value_slot(cb, f, in->out + r, top);
    if (s < 0) return -1;
    vs[in->out + r] = s;
    g->out[r] = c->results[r];
    g->out_slot[r] = s;
  }
  return group_step(cb, g);
}

static int plan_helper(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top) {
  cpu_program *p = cb->p;
  cpu_helper *q = realloc(p->helpers, (size_t)(p->n_helpers + 1) * sizeof *q);
  if (!q) return cpu_oom();
  p->helpers = q;
  cpu_helper *h = &p->helpers[p->n_helpers++];
  memset(h, 0, sizeof *h);
  h->op = in->op;
  h->attrs = in->attrs;
  h->n_in = in->n_in;
  h->n_out = in->n_out;
  h->in_types = malloc(((size_t)in->n_in + 1) * sizeof *h->in_types);
  h->out_types = malloc((size_t)in->n_out * sizeof *h->out_types);
  step st = {STEP_HELPER, p->n_helpers - 1, in->n_out + in->n_in, NULL, 0};
  st.slots = malloc((size_t)st.n_slots * sizeof *st.slots);
  if (!h->in_types || !h->out_types || !st.slots) {
    free(st.slots);
    return cpu_oom();
  }
  if (kiln_ops[in->op].kind == OPK_HOST) {
    const ir_host *host = in->attrs.host;
    h->host_fn = host->fn;
    h->host_user = host->user;
    h->host_name = malloc(strlen(host->name) + 1);
    if (!h->host_name) {
      free(st.slots);
      return cpu_oom();
    }
    strcpy(h->host_name, host->name);
    h->attrs.host = NULL; /* the module's; not kept */
  }
  for (int k = 0; k < in->n_in; k++) {
    h->in_types[k] = f->types[in->in[k]];
    st.slots[in->n_out + k] = vs[in->in[k]];
  }
  for (int k = 0; k < in->n_out; k++) {
    h->out_types[k] = f->types[in->out + k];
    if ((vs[in->out + k] = st.slots[k] = value_slot(cb, f, in->out + k, top)) < 0) {
      free(st.slots);
      return -1;
    }
  }
  return add_step(cb, st);
}


/* Plans f's instructions. vs (per value of f) gets each value's slot; the
 * parameters' slots are given. top: f is the compiled function, whose
 * results get their own buffers. Calls are inlined. */
static int plan_func(cpu_build *cb, const ir_func *f, int *vs, const int *param_slots, bool top, int depth) {
  if (depth > 100) return kiln_set_error("cpu: @%s: calls nest too deep", cb->f->name);
  for (int i = 0; i < f->n_params; i++) vs[i] = param_slots[i];
  int *uses = value_uses(f);
  bool *skip = calloc((size_t)f->n_instrs + 1, sizeof *skip); /* transposes that matmul_nt saves */
  if (!uses || !skip) {
    free(uses);
    free(skip);
    return cpu_oom();
  }
  int rc = 0;
  for (int i = 0; i < f->n_instrs && rc >= 0; i++) { /* the transposes dots read in place */
    const ir_instr *in = &f->instrs[i], *t[2];
    if (dot_transposes(f, in, uses, t)) {
      for (int s = 0; s < 2; s++)
        if (t[s]) skip[t[s] - f->instrs] = true;
    } else if (in->op == OP_FUSION && fusion_ok(in->attrs.callee) &&
               !dot_epilogue(in->attrs.callee, (ir_value[3]){0}, &(gemm_epilogue){0})) {
      const ir_func *c = in->attrs.callee;
      int *body_uses = value_uses(c);
      if (!body_uses) rc = cpu_oom();
      for (int j = 0; body_uses && j < c->n_instrs; j++)
        if (dot_before_kernel(c, &c->instrs[j]) && fusion_dot_transposes(f, in, uses, &c->instrs[j], body_uses, t))
          for (int s = 0; s < 2; s++)
            if (t[s]) skip[t[s] - f->instrs] = true;
      free(body_uses);
    }
  }
  for (int i = 0; i < f->n_instrs && rc >= 0; i++) {
    rc = 0;
    const ir_instr *in = &f->instrs[i];
    ir_value v = in->out;
    op_id op = in->op;
    op_kind kind = kiln_ops[op].kind;
    const ir_instr *t[2];
    if (skip[i]) {
      continue;
    } else if (dot_transposes(f, in, uses, t)) { /* the dot reads the matrices before their transposes */
      ir_value args[2] = {t[0] ? t[0]->in[0] : in->in[0], t[1] ? t[1]->in[0] : in->in[1]};
      ir_instr dot = *in;
      dot.in = args;
      rc = plan_helper(cb, f, &dot, vs, top);
      if (rc >= 0) {
        cpu_helper *h = &cb->p->helpers[cb->p->n_helpers - 1];
        h->trans_a = t[0] != NULL, h->trans_b = t[1] != NULL;
      }
    } else if (op == OP_FUSION && fusion_ok(in->attrs.callee)) {
      rc = plan_fusion(cb, f, in, vs, top, uses);
    } else if (op == OP_CONSTANT) {
      rc = retain_const(cb, in->attrs.value);
      if (rc >= 0) rc = vs[v] = add_slot(cb, (slot){SLOT_CONST, 0, 0, in->attrs.value});
    } else if (kind == OPK_VIEW) {
      vs[v] = vs[in->in[0]]; /* the same bytes, read with another shape */
    } else if (kind == OPK_CALL) { /* call, and fusions that are not one kernel: inline */
      const ir_func *c = in->attrs.callee;
      int *cvs = malloc(((size_t)c->n_values + 1) * sizeof *cvs);
      int *ps = malloc(((size_t)in->n_in + 1) * sizeof *ps);
      if (!cvs || !ps) rc = cpu_oom();
      for (int k = 0; !rc && k < in->n_in; k++) ps[k] = vs[in->in[k]];
      if (!rc) rc = plan_func(cb, c, cvs, ps, false, depth + 1);
      for (int k = 0; !rc && k < in->n_out; k++) vs[v + k] = cvs[c->results[k]];
      free(cvs);
      free(ps);
    } else if (llvm_op_fusible(op) || llvm_dot_inline(f, in)) {
      int dst = vs[v] = value_slot(cb, f, v, top);
      rc = dst < 0 ? -1 : plan_kernel(cb, f, i, vs, dst);
    } else if (kind == OPK_DOT || kind == OPK_INDEX || kind == OPK_RANDOM || kind == OPK_SOURCE || kind == OPK_HOST ||
               op == OP_CONCAT || op == OP_ARGMAX) {
      rc = plan_helper(cb, f, in, vs, top);
    } else {
      rc = kiln_set_error("cpu: @%s: %s is not supported by the CPU backend", f->name, kiln_ops[op].name);
    }
  }
  free(uses);
  free(skip);
  return rc < 0 ? -1 : 0;
}

/* ---- buffer donation: results written over parameters' buffers ---- */

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

static bool same_type(const op_type *a, const op_type *b) { return a->dtype == b->dtype && same_shape(a, b); }

/* For each value u of g's function, whether g evaluates u only at the
 * index of the element it stores: u is an output, or every member reading
 * it is elementwise over u's shape and such a value itself (at, per value).
 * One pass over the instructions from the last: a value's readers come
 * after it, so theirs are known by then (no recursion along a chain, no
 * walk per value). */
static void at_store_index(const kgroup *g, bool *at) {
  const ir_func *f = g->f;
  bool *used = calloc((size_t)f->n_values + 1, sizeof *used);
  for (int v = 0; v < f->n_values; v++) at[v] = used ? true : false; /* out of memory: nothing is */
  if (!used) return;
  for (int k = 0; k < g->n_out; k++) used[g->out[k]] = true;
  for (int i = f->n_instrs - 1; i >= 0; i--) {
    const ir_instr *in = &f->instrs[i];
    if (!g->member[i]) continue;
    op_kind kind = kiln_ops[in->op].kind;
    bool elementwise =
        kind == OPK_UNARY || kind == OPK_BINARY || kind == OPK_COMPARE || kind == OPK_SELECT || kind == OPK_CONVERT;
    bool ok = elementwise && in->n_out == 1 && used[in->out] && at[in->out];
    for (int k = 0; k < in->n_in; k++) {
      ir_value u = in->in[k];
      used[u] = true;
      at[u] = at[u] && ok && same_shape(&f->types[in->out], &f->types[u]);
    }
  }
  for (int v = 0; v < f->n_values; v++) at[v] = at[v] && used[v];
  free(used);
}

/* whether a step reads slot s, or can fail */
static bool step_reads(const cpu_build *cb, const step *st, int s) {
  if (st->kind == STEP_HELPER) {
    for (int k = 0; k < st->n_slots; k++)
      if (st->slots[k] == s) return true;
    return false;
  }
  if (st->kind == STEP_COPY) return st->slots[1] == s;
  const kgroup *g = &cb->groups[st->index];
  for (int v = 0; v < g->f->n_values; v++)
    if (g->leaf[v] == s) return true;
  return false;
}

static bool step_can_fail(const cpu_build *cb, const step *st) {
  if (st->kind == STEP_HELPER) return true;
  if (st->kind == STEP_COPY) return false;
  const kgroup *g = &cb->groups[st->index]; /* integer division checks its divisors */
  for (int i = 0; i < g->f->n_instrs; i++) {
    const ir_instr *in = &g->f->instrs[i];
    if (g->member[i] && (in->op == OP_DIV || in->op == OP_MOD) && dtype_is_int(g->f->types[in->out].dtype)) return true;
  }
  return false;
}

/* For each result a kernel stores, a parameter of its type it may be
 * written over (cpu_program_donor): nothing after that kernel reads the
 * parameter or can fail (a failed call leaves the caller's tensors as they
 * were), the kernel reads it only at the element it writes (in place is
 * then the same computation), and no result returns the parameter. */
static int plan_donors(cpu_build *cb) {
  const ir_func *f = cb->f;
  cpu_program *p = cb->p;
  p->donor = malloc(((size_t)f->n_results + 1) * sizeof *p->donor);
  bool *taken = calloc((size_t)f->n_params + 1, sizeof *taken);
  int *pslot = malloc(((size_t)f->n_params + 1) * sizeof *pslot);
  if (!p->donor || !taken || !pslot) {
    free(taken);
    free(pslot);
    return cpu_oom();
  }
  for (int r = 0; r < f->n_results; r++) {
    p->donor[r] = -1;
    if (p->results[r].kind == CPU_RES_PARAM) taken[p->results[r].index] = true;
  }
  for (int s = 0; s < cb->n_slots; s++)
    if (cb->slots[s].kind == SLOT_PARAM) pslot[cb->slots[s].index] = s;
  int rc = 0, first_fail = cb->n_steps; /* steps from first_fail on may fail */
  while (first_fail > 0 && !step_can_fail(cb, &cb->steps[first_fail - 1])) first_fail--;
  for (int s = first_fail; s < cb->n_steps && !rc; s++) {
    const step *st = &cb->steps[s];
    if (st->kind != STEP_KERNEL) continue;
    const kgroup *g = &cb->groups[st->index];
    /* One output: its element's loads of the parameter all come before its
     * store, which depends on them, so the code stays right with noalias
     * kept on both (dropping it costs the vectorizer's overlap check, which
     * sends an exact overlap to the scalar loop: 2.3x slower, measured). */
    if (g->n_out != 1 || llvm_op_is_reduce(g->f->instrs[g->f->def[g->out[0]]].op)) continue;
    for (int k = 0; k < g->n_out; k++) {
      const slot *os = &cb->slots[g->out_slot[k]];
      if (os->kind != SLOT_RESULT || p->results[os->index].kind != CPU_RES_OWN) continue;
      for (int q = 0; q < f->n_params && p->donor[os->index] < 0; q++) {
        if (taken[q] || !same_type(&f->types[q], &p->result_types[os->index])) continue;
        bool ok = true;
        for (int later = s + 1; later < cb->n_steps && ok; later++) ok = !step_reads(cb, &cb->steps[later], pslot[q]);
        bool *at = calloc((size_t)g->f->n_values + 1, sizeof *at);
        if (!at) {
          rc = cpu_oom();
          break;
        }
        at_store_index(g, at);
        for (int v = 0; v < g->f->n_values && ok; v++)
          if (g->leaf[v] == pslot[q]) ok = same_type(&g->f->types[v], &f->types[q]) && at[v];
        free(at);
        if (ok) p->donor[os->index] = q, taken[q] = true;
      }
    }
  }
  free(taken);
  free(pslot);
  return rc;
}

int cpu_plan(cpu_build *cb) {
  const ir_func *f = cb->f;
  cpu_program *p = cb->p;
  cb->vslot = malloc(((size_t)f->n_values + 1) * sizeof *cb->vslot);
  cb->result_of = malloc(((size_t)f->n_values + 1) * sizeof *cb->result_of);
  cb->result_done = calloc((size_t)f->n_results + 1, sizeof *cb->result_done);
  int *ps = malloc(((size_t)f->n_params + 1) * sizeof *ps);
  p->results = calloc((size_t)f->n_results + 1, sizeof *p->results);
  if (!cb->vslot || !cb->result_of || !cb->result_done || !ps || !p->results) {
    free(ps);
    return cpu_oom();
  }
  for (int v = 0; v < f->n_values; v++) cb->vslot[v] = -1, cb->result_of[v] = -1;
  for (int r = f->n_results - 1; r >= 0; r--) cb->result_of[f->results[r]] = r;
  /* with a plan, its arena comes first; values it did not place follow */
  if (f->buf_offset) p->arena_bytes = (size_t)((f->arena_bytes + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN);
  int rc = 0;
  for (int i = 0; i < f->n_params && rc >= 0; i++) rc = ps[i] = add_slot(cb, (slot){SLOT_PARAM, i, 0, NULL});
  cb->max_bufs = 2;
  if (rc >= 0) rc = plan_func(cb, f, cb->vslot, ps, true, 0);
  free(ps);
  if (rc < 0) return -1;
  /* how each result is produced; one computed elsewhere (a view, a call's
   * result) is copied into its buffer at the end */
  for (int r = 0; r < f->n_results; r++) {
    ir_value v = f->results[r];
    const ir_instr *d = ir_def(f, v);
    cpu_result *res = &p->results[r];
    if (cb->result_of[v] != r) {
      *res = (cpu_result){CPU_RES_SAME, cb->result_of[v], NULL};
    } else if (!d) {
      *res = (cpu_result){CPU_RES_PARAM, v, NULL};
    } else if (d->op == OP_CONSTANT) {
      *res = (cpu_result){CPU_RES_CONST, 0, d->attrs.value};
    } else {
      *res = (cpu_result){CPU_RES_OWN, 0, NULL};
      const slot *s = &cb->slots[cb->vslot[v]];
      if (s->kind == SLOT_RESULT && s->index == r) continue;
      int dst = add_slot(cb, (slot){SLOT_RESULT, r, 0, NULL});
      int *sl = malloc(2 * sizeof *sl);
      if (dst < 0 || !sl) {
        free(sl);
        return dst < 0 ? -1 : cpu_oom();
      }
      sl[0] = dst;
      sl[1] = cb->vslot[v];
      if (add_step(cb, (step){STEP_COPY, 0, 2, sl, cpu_type_bytes(&f->types[v])})) return -1;
    }
  }
  return plan_donors(cb);
}
