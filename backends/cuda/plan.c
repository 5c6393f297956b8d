/* plan.c — the CUDA backend's side of the shared plan (backends/plan):
 * its policy (fusion bodies and elementwise ops are kernels, with no dot
 * inside one; dot, argmax, concat, gather and scatter_add kernels of their
 * own; random draws and host callbacks host steps; column reductions split
 * in two passes) and the launch plan made from the plan's steps. */
#include <stdlib.h>
#include <string.h>

#include "cuda/compile.h"

int cuda_oom(void) { return kiln_set_error("cuda: out of memory"); }

enum {
  COL_MIN_LEN = 64,        /* shorter columns: a thread per output */
  COL_MAX_OUT = 1 << 16,   /* more outputs: a thread per output has the GPU busy */
  COL_BLOCKS = 512,        /* blocks to aim for (a few per SM of an H100) */
  COL_ROWS_PER_THREAD = 16 /* at least, before a column is split over more blocks */
}; /* the column reductions' limits (compile.h's colplan) */

bool cuda_column_plan(const ir_func *f, ir_value out, colplan *cp) {
  if (out < f->n_params || f->def[out] < 0) return false;
  const ir_instr *first = &f->instrs[f->def[out]];
  if (!llvm_op_is_reduce(first->op)) return false;
  const op_type *it = &f->types[first->in[0]], *ot = &f->types[out];
  if (it->rank == 0 || first->attrs.naxes == 0) return false;
  for (int q = 0; q < first->attrs.naxes; q++)
    if (first->attrs.axes[q] == it->rank - 1) return false;
  int64_t n_out = plan_type_size(ot), len = n_out ? plan_type_size(it) / n_out : 0;
  if (n_out <= 0 || n_out >= COL_MAX_OUT || len < COL_MIN_LEN) return false;
  int tx = 1;
  while (tx < 32 && tx < n_out) tx *= 2;
  cp->tx = tx;
  cp->ty = 256 / tx;
  cp->tiles = (n_out + tx - 1) / tx;
  int64_t most = len / ((int64_t)cp->ty * COL_ROWS_PER_THREAD), want = (COL_BLOCKS + cp->tiles - 1) / cp->tiles;
  cp->split = want < most ? want : most;
  if (cp->split < 1) cp->split = 1;
  if (cp->split > 65535) cp->split = 65535;
  cp->chunk = (len + cp->split - 1) / cp->split;
  cp->split = (len + cp->chunk - 1) / cp->chunk; /* no empty splits */
  return true;
}

/* the policy's split: a column reduction's partials */
static int64_t column_split(const plan_kernel *k) {
  colplan cp;
  return !k->special && cuda_column_plan(k->f, k->out[0], &cp) ? cp.split : 0;
}

/* Whether a fusion's body can be one kernel: the CPU backend's rule, with
 * no dots (a dot is a kernel of its own here) */
static bool fusion_ok(const ir_func *c) { return llvm_fusion_one_kernel(c, NULL); }

static plan_as place(const ir_func *f, const ir_instr *in) {
  (void)f;
  op_kind kind = kiln_ops[in->op].kind;
  if (llvm_op_fusible(in->op)) return PLAN_AS_KERNEL;
  if (kind == OPK_DOT || kind == OPK_INDEX || in->op == OP_CONCAT || in->op == OP_ARGMAX) return PLAN_AS_SPECIAL;
  if (kind == OPK_RANDOM || kind == OPK_HOST) return PLAN_AS_CALL; /* kept for the host */
  return PLAN_AS_UNSUPPORTED;
}

static const plan_policy cuda_policy = {
    .who = "cuda",
    .unsupported = "is not supported on the GPU yet",
    .place = place,
    .fusion_one_kernel = fusion_ok,
    .split = column_split,
};


/* a new launch step; its buffers (n of them) zeroed for the caller to fill */
static cuda_step *add_step(cuda_program *p, int kind, int n_bufs) {
  cuda_step *q = realloc(p->steps, (size_t)(p->n_steps + 1) * sizeof *q);
  if (!q) return cuda_oom(), NULL;
  p->steps = q;
  cuda_step *st = &p->steps[p->n_steps++]; /* freed with the program, even half made */
  memset(st, 0, sizeof *st);
  st->kind = kind;
  st->op = OP_COUNT;
  st->kernel_op = OP_COUNT;
  st->index_buf = -1;
  st->n_bufs = n_bufs;
  st->bufs = calloc((size_t)n_bufs + 1, sizeof *st->bufs);
  if (!st->bufs) return cuda_oom(), NULL;
  return st;
}

/* a call step of the plan: an op the host runs (random draws, host callbacks) */
static int host_step(cuda_program *p, const plan *pl, const plan_step *ps) {
  const plan_call *c = &pl->calls[ps->index];
  cuda_step *st = add_step(p, CUDA_STEP_HOST, c->n_out + c->n_in);
  if (!st) return -1;
  st->op = c->op;
  st->n_out = c->n_out;
  st->attrs = c->attrs;
  if (!(st->types = malloc(((size_t)c->n_out + (size_t)c->n_in) * sizeof *st->types))) return cuda_oom();
  memcpy(st->types, c->out_types, (size_t)c->n_out * sizeof *st->types);
  memcpy(st->types + c->n_out, c->in_types, (size_t)c->n_in * sizeof *st->types);
  for (int k = 0; k < ps->n_slots; k++) st->bufs[k] = pl->slots[ps->slots[k]];
  return 0;
}

/* Plans cb->f and makes the launch plan: a step per plan step (a kernel's
 * buffers and launch shape come with its emission), the results, the
 * constants the steps read (retained). */
int cuda_plan(cuda_build *cb) {
  cuda_program *p = cb->p;
  plan *pl = &cb->pl;
  if (plan_build(pl, cb->f, &cuda_policy)) return -1;
  p->arena_bytes = pl->arena_bytes;
  for (int s = 0; s < pl->n_slots; s++) /* uploaded by the runtime */
    if (pl->slots[s].kind == PLAN_SLOT_CONST && plan_keep_const(&p->consts, &p->n_consts, pl->slots[s].cst))
      return cuda_oom();
  for (int s = 0; s < pl->n_steps; s++) {
    const plan_step *ps = &pl->steps[s];
    cuda_step *st;
    if (ps->kind == PLAN_STEP_KERNEL) {
      if (!(st = add_step(p, CUDA_STEP_KERNEL, 0))) return -1;
      st->kernel_op = pl->kernels[ps->index].op;
      p->n_kernels++;
    } else if (ps->kind == PLAN_STEP_CALL) {
      if (host_step(p, pl, ps)) return -1;
    } else if (ps->kind == PLAN_STEP_COPY) {
      if (!(st = add_step(p, CUDA_STEP_COPY, 2))) return -1;
      st->bufs[0] = pl->slots[ps->slots[0]];
      st->bufs[1] = pl->slots[ps->slots[1]];
      st->bytes = ps->bytes;
    } else {
      return kiln_set_error("cuda: @%s: control flow is not supported on the GPU yet", cb->f->name);
    }
  }
  p->results = calloc((size_t)cb->f->n_results + 1, sizeof *p->results);
  if (!p->results) return cuda_oom();
  for (int r = 0; r < cb->f->n_results; r++)
    p->results[r] = (cuda_result){pl->results[r].kind, pl->results[r].index, pl->results[r].cst};
  return 0;
}
