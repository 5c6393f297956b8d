/* plan.c — the CPU backend's side of the shared plan (backends/plan): its
 * policy (a kernel may sum a short dot in place; a longer dot of a fusion
 * runs as a packed matmul just before the fusion's kernel, or with the
 * fusion's bias and activation as its epilogue; a dot reads a lone
 * transposed matrix in place; dot, gather, random draws, host callbacks ...
 * are runtime helpers), and the program's helpers, constants and results
 * taken from the plan. */
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"
#include "cpu/gemm.h"

int cpu_oom(void) { return kiln_set_error("cpu: out of memory"); }

/* A dot of a fusion body that runs just before the body's kernel, as a
 * packed matmul (a runtime helper) into a temporary that the kernel reads
 * (a conv2d too, as its helper):
 * its inner dimension is too long to sum per element, its operands are the
 * body's parameters, and only the body reads it. The rest of the body (a
 * bias, an activation, an SGD update) is then one kernel, not one per op. */
static bool dot_before_kernel(const ir_func *c, const ir_instr *in) {
  return plan_head_apart(c, in) && !llvm_dot_inline(c, in);
}

/* a dot a kernel can take: summed in it, or run just before it */
static bool dot_in_fusion(const ir_func *c, const ir_instr *in) {
  return llvm_dot_inline(c, in) || dot_before_kernel(c, in);
}

/* Whether a fusion's body can be one kernel (the shared rule) */
static bool fusion_ok(const ir_func *c) { return llvm_fusion_one_kernel(c, dot_in_fusion, true); }

/* v's other operand in binary instruction in (which reads v once), or -1 */
static ir_value other_operand(const ir_instr *in, ir_value v) {
  if (in->n_in != 2 || in->in[0] == in->in[1]) return -1;
  return in->in[0] == v ? in->in[1] : in->in[1] == v ? in->in[0] : -1;
}

/* Whether a fusion body is exactly a dot that runs before its kernel, big
 * enough for the compiled micro-kernel (lib/matmul.h), or a conv2d, + a
 * bias over its columns (a parameter of n values), for a conv2d maybe +
 * a residual (a parameter of the result's type: ResNet's shortcut), and
 * maybe relu or tanh, with that one result. The matmul or the convolution
 * then applies them as it stores its tiles (run.c gives the helper to
 * matmul_epilogue or conv2d_epilogue), and the body needs no kernel (nor a
 * temporary). ops gets the parameters that are the head's operands, the
 * bias and the residual (-1: none); epi a gemm_epilogue. */
static bool dot_epilogue(const ir_func *c, ir_value ops[PLAN_EPILOGUE_OPS], int *epi) {
  if (c->n_results != 1 || c->n_instrs < 2 || c->n_instrs > 4) return false;
  const ir_instr *d = &c->instrs[0], *add = &c->instrs[1];
  const op_type *t = &c->types[d->out];
  if (!dot_before_kernel(c, d) || add->op != OP_ADD || (t->dtype != KILN_F32 && t->dtype != KILN_F64)) return false;
  int64_t n = t->shape[t->rank - 1];
  if (d->op == OP_DOT) { /* a conv2d applies its epilogue at any size (conv2d_epilogue) */
    int64_t m = t->shape[t->rank - 2], k = c->types[d->in[0]].shape[c->types[d->in[0]].rank - 1];
    if (m < 2 || n < 2 || m * n * k < MATMUL_JIT_WORK) return false;
  }
  ir_value bias = other_operand(add, d->out);
  if (bias < 0 || ir_def(c, bias)) return false;
  const op_type *bt = &c->types[bias], *at = &c->types[add->out];
  if (bt->rank < 1 || bt->shape[bt->rank - 1] != n || plan_type_size(bt) != n || bt->rank > t->rank ||
      plan_type_size(at) != plan_type_size(t))
    return false;
  *epi = GEMM_EPI_BIAS;
  ir_value out = add->out, res = -1;
  int i = 2;
  if (i < c->n_instrs && c->instrs[i].op == OP_ADD && d->op == OP_CONV2D) { /* + the residual */
    const ir_instr *r = &c->instrs[i++];
    res = other_operand(r, out);
    if (res < 0 || ir_def(c, res) || plan_type_size(&c->types[res]) != plan_type_size(t) ||
        c->types[res].rank != t->rank)
      return false;
    out = r->out;
  }
  if (i < c->n_instrs) {
    const ir_instr *act = &c->instrs[i++];
    if ((act->op != OP_RELU && act->op != OP_TANH) || act->in[0] != out) return false;
    *epi = act->op == OP_RELU ? GEMM_EPI_BIAS_RELU : GEMM_EPI_BIAS_TANH;
    out = act->out;
  }
  if (i != c->n_instrs || c->results[0] != out) return false;
  ops[0] = d->in[0], ops[1] = d->in[1], ops[2] = bias, ops[3] = res;
  return true;
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

static plan_as place(const ir_func *f, const ir_instr *in) {
  op_kind kind = kiln_ops[in->op].kind;
  if (llvm_op_fusible(in->op) || llvm_dot_inline(f, in)) return PLAN_AS_KERNEL;
  if (kind == OPK_DOT || kind == OPK_INDEX || kind == OPK_WINDOW || kind == OPK_RANDOM || kind == OPK_SOURCE || kind == OPK_HOST ||
      kind == OPK_COLLECTIVE ||
      in->op == OP_CONCAT || in->op == OP_ARGMAX)
    return PLAN_AS_CALL;
  return PLAN_AS_UNSUPPORTED;
}

/* Any kernel: each stores its outputs after loading all it reads of that
 * element (kernel.c's emit_outputs; a reduction's and a transpose's reads
 * are never at the stored element, so the planner keeps their states) */
static bool state_in_place(const plan_kernel *k) {
  (void)k;
  return true;
}

/* the entry moves a loop's state between buffers (control.c: the slots'
 * pointers phis of the loop's head) */
static bool swap_state(void) { return true; }

static const plan_policy cpu_policy = {
    .who = "cpu",
    .unsupported = "is not supported by the CPU backend",
    .place = place,
    .fusion_one_kernel = fusion_ok,
    .dot_before_kernel = dot_before_kernel,
    .dot_epilogue = dot_epilogue,
    .dot_transposes = trans_plan,
    .state_in_place = state_in_place,
    .split = cpu_column_split,
    .swap_state = swap_state,
    .scan_one_kernel = cpu_scan_one_kernel,
};

/* the runtime helper of call c */
static int take_helper(cpu_helper *h, const plan_call *c) {
  memset(h, 0, sizeof *h);
  h->op = c->op;
  h->attrs = c->attrs;
  h->n_in = c->n_in;
  h->n_out = c->n_out;
  h->epilogue = c->epilogue;
  h->trans_a = c->trans_a, h->trans_b = c->trans_b;
  h->in_types = malloc(((size_t)c->n_in + 1) * sizeof *h->in_types);
  h->out_types = malloc(((size_t)c->n_out + 1) * sizeof *h->out_types);
  if (!h->in_types || !h->out_types) return cpu_oom();
  memcpy(h->in_types, c->in_types, (size_t)c->n_in * sizeof *h->in_types);
  memcpy(h->out_types, c->out_types, (size_t)c->n_out * sizeof *h->out_types);
  if (kiln_ops[c->op].kind == OPK_HOST) {
    const ir_host *host = c->attrs.host;
    h->host_fn = host->fn;
    h->host_user = host->user;
    h->host_name = malloc(strlen(host->name) + 1);
    if (!h->host_name) return cpu_oom();
    strcpy(h->host_name, host->name);
    h->attrs.host = NULL; /* the module's; not kept */
  }
  return 0;
}

/* the most pointers one of steps (n of them, nested lists included) passes
 * (the entry's array of them) */
static int max_bufs(const plan *pl, const plan_step *steps, int n) {
  int most = 2;
  for (int s = 0; s < n; s++) {
    const plan_step *st = &steps[s];
    int bufs = st->n_slots + 1;
    if (st->kind == PLAN_STEP_KERNEL) {
      const plan_kernel *g = &pl->kernels[st->index];
      bufs = g->n_out + 2;
      for (int v = 0; v < g->f->n_values; v++) bufs += g->leaf[v] >= 0;
    }
    for (int k = 0; k < 2; k++) {
      int sub = max_bufs(pl, st->sub[k], st->n_sub[k]);
      if (sub > bufs) bufs = sub;
    }
    if (bufs > most) most = bufs;
  }
  return most;
}

int cpu_plan(cpu_build *cb) {
  cpu_program *p = cb->p;
  plan *pl = &cb->pl;
  /* cpu_options.scan_loops: every scan a loop of steps; scan_kernels:
   * every elementwise scan one kernel (tests, benchmarks) */
  cb->policy = cpu_policy;
  if (cb->scan_loops) cb->policy.scan_one_kernel = NULL;
  else if (cb->scan_kernels) cb->policy.scan_one_kernel = cpu_scan_one_kernel_any;
  if (plan_build(pl, cb->f, &cb->policy) || cpu_plan_overlap(cb)) return -1;
  p->arena_bytes = pl->arena_bytes;
  p->arena_unpacked_bytes = pl->arena_unpacked;
  cb->max_bufs = max_bufs(pl, pl->steps, pl->n_steps);
  p->results = calloc((size_t)cb->f->n_results + 1, sizeof *p->results);
  p->helpers = calloc((size_t)pl->n_calls + 1, sizeof *p->helpers);
  if (!p->results || !p->helpers) return cpu_oom();
  for (int r = 0; r < cb->f->n_results; r++)
    p->results[r] = (cpu_result){pl->results[r].kind, pl->results[r].index, pl->results[r].cst};
  for (int c = 0; c < pl->n_calls; c++) {
    p->n_helpers++; /* freed with the program, even half made */
    if (take_helper(&p->helpers[c], &pl->calls[c])) return -1;
    p->collectives |= kiln_ops[pl->calls[c].op].kind == OPK_COLLECTIVE;
  }
  for (int i = 0; i < pl->n_consts; i++) /* the code reads their data in place */
    if (plan_keep_const(&p->consts, &p->n_consts, pl->consts[i])) return cpu_oom();
  return cpu_plan_donors(cb);
}
