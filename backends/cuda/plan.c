/* plan.c — the CUDA backend's side of the shared plan (backends/plan):
 * its policy (fusion bodies and elementwise ops are kernels, a dot or
 * conv2d leading a fusion run just before its kernel as a kernel of its
 * own; dot, argmax, concat, gather, scatter_add and the window ops
 * (conv2d, pooling and their gradients) kernels of their own; random draws
 * and host callbacks host steps; column reductions and big filter gradients
 * split in two passes; a scan whose body is elementwise one kernel looping
 * over t on the device, ptx_scan.c; a loop's new carries stored in place
 * over its state where the planner finds it safe) and the launch plan made
 * from the plan's steps. */
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
  if (k->special && kiln_ops[k->special->op].kind == OPK_WINDOW) return cuda_window_split(k);
  return !k->special && cuda_column_plan(k->f, k->out[0], &cp) ? cp.split : 0;
}

/* Whether a fusion's body can be one kernel: the CPU backend's rule, a
 * dot or conv2d that leads it (its epilogue: a bias, a residual, an
 * activation, an SGD update) run just before that kernel as the kernel of
 * its own it is when alone (place: PLAN_AS_SPECIAL), into a temporary. Two
 * launches, not one per epilogue op. */
static bool fusion_ok(const ir_func *c) { return llvm_fusion_one_kernel(c, plan_head_apart, true); }

static plan_as place(const ir_func *f, const ir_instr *in) {
  (void)f;
  op_kind kind = kiln_ops[in->op].kind;
  if (llvm_op_fusible(in->op)) return PLAN_AS_KERNEL;
  if (kind == OPK_DOT || kind == OPK_INDEX || kind == OPK_WINDOW || in->op == OP_CONCAT || in->op == OP_ARGMAX)
    return PLAN_AS_SPECIAL;
  if (kind == OPK_RANDOM || kind == OPK_HOST) return PLAN_AS_CALL; /* kept for the host */
  return PLAN_AS_UNSUPPORTED;
}

/* Any kernel may store a new carry over the loop's state: an elementwise
 * kernel computes every output of an element before storing any (ptx.c's
 * emit_elementwise), a thread per element, so the element it stores was
 * read by that thread alone (the planner admits a kernel reading the state
 * only at the element it stores: plan_at_store_index; a reduction, a
 * transpose or a kernel of its own reading it keeps its state). The host
 * loop then copies nothing back for that carry. */
static bool state_in_place(const plan_kernel *k) {
  (void)k;
  return true;
}

/* the host loops move a loop's state between buffers (launch.c: each
 * slot's place, followed by every buffer naming it) */
static bool swap_state(void) { return true; }

static const plan_policy cuda_policy = {
    .who = "cuda",
    .unsupported = "is not supported on the GPU yet",
    .place = place,
    .fusion_one_kernel = fusion_ok,
    .dot_before_kernel = plan_head_apart,
    .split = column_split,
    .state_in_place = state_in_place,
    .swap_state = swap_state,
    .scan_one_kernel = cuda_scan_one_kernel,
};

int cuda_plan_build(plan *pl, const ir_func *f) { return plan_build(pl, f, &cuda_policy); }

cuda_ref cuda_slot_ref(const plan *pl, int s) {
  const plan_slot *sl = &pl->slots[s];
  if (sl->kind == PLAN_SLOT_ROW) return (cuda_ref){CUDA_REF_ROW, s, 0, NULL, s};
  return (cuda_ref){sl->kind, sl->index, sl->offset, sl->cst, s};
}

/* a copy of n ints (NULL for none); -1 out of memory */
static int dup_ints(int **to, const int *from, int n) {
  *to = NULL;
  if (!from || n <= 0) return 0;
  if (!(*to = malloc((size_t)n * sizeof **to))) return cuda_oom();
  memcpy(*to, from, (size_t)n * sizeof **to);
  return 0;
}

/* the plan step's double buffering (plan_step.move) into st */
static int take_moves(cuda_step *st, const plan_step *q) {
  if (!q->n_move) return 0;
  st->n_state = q->n_state, st->n_move = q->n_move;
  if (dup_ints(&st->state, q->state, q->n_state) || dup_ints(&st->move, q->move, 2 * q->n_move) ||
      dup_ints(&st->scratch, q->scratch, q->n_state))
    return -1;
  if (!(st->state_bytes = malloc(((size_t)q->n_state + 1) * sizeof *st->state_bytes))) return cuda_oom();
  memcpy(st->state_bytes, q->state_bytes, (size_t)q->n_state * sizeof *st->state_bytes);
  return 0;
}

/* step st (zeroed by the caller) made of kind with n_bufs buffers, zeroed
 * for the caller to fill */
static int init_step(cuda_step *st, int kind, int n_bufs) {
  st->kind = kind;
  st->op = OP_COUNT;
  st->kernel_op = OP_COUNT;
  st->index_buf = -1;
  st->kernel = -1;
  st->n_bufs = n_bufs;
  st->bufs = calloc((size_t)n_bufs + 1, sizeof *st->bufs);
  return st->bufs ? 0 : cuda_oom();
}

/* a call step of the plan: an op the host runs (random draws, host callbacks) */
static int host_step(cuda_step *st, const plan *pl, const plan_step *ps) {
  const plan_call *c = &pl->calls[ps->index];
  if (init_step(st, CUDA_STEP_HOST, c->n_out + c->n_in)) return -1;
  st->op = c->op;
  st->n_out = c->n_out;
  st->attrs = c->attrs;
  if (!(st->types = malloc(((size_t)c->n_out + (size_t)c->n_in) * sizeof *st->types))) return cuda_oom();
  memcpy(st->types, c->out_types, (size_t)c->n_out * sizeof *st->types);
  memcpy(st->types + c->n_out, c->in_types, (size_t)c->n_in * sizeof *st->types);
  for (int k = 0; k < ps->n_slots; k++) st->bufs[k] = cuda_slot_ref(pl, ps->slots[k]);
  return 0;
}

/* The launch steps of the n plan steps ps into *out (malloc'd, n of them,
 * freed with the program even half made), control flow recursively. */
static int make_steps(cuda_program *p, const plan *pl, const plan_step *ps, int n, cuda_step **out) {
  cuda_step *steps = *out = calloc((size_t)n + 1, sizeof *steps);
  if (!steps) return cuda_oom();
  for (int s = 0; s < n; s++) {
    const plan_step *q = &ps[s];
    cuda_step *st = &steps[s];
    int rc = 0;
    switch (q->kind) {
      case PLAN_STEP_KERNEL:
        rc = init_step(st, CUDA_STEP_KERNEL, 0);
        st->kernel = q->index;
        st->kernel_op = pl->kernels[q->index].op;
        p->n_kernels++;
        break;
      case PLAN_STEP_CALL: rc = host_step(st, pl, q); break;
      case PLAN_STEP_COPY:
        if (!(rc = init_step(st, CUDA_STEP_COPY, 2))) {
          st->bufs[0] = cuda_slot_ref(pl, q->slots[0]);
          st->bufs[1] = cuda_slot_ref(pl, q->slots[1]);
          st->bytes = q->bytes;
        }
        break;
      case PLAN_STEP_COND:
      case PLAN_STEP_WHILE:
      case PLAN_STEP_SCAN: {
        int kind = q->kind == PLAN_STEP_COND ? CUDA_STEP_COND : q->kind == PLAN_STEP_WHILE ? CUDA_STEP_WHILE : CUDA_STEP_SCAN;
        if ((rc = init_step(st, kind, q->n_slots))) break;
        for (int k = 0; k < q->n_slots; k++) st->bufs[k] = cuda_slot_ref(pl, q->slots[k]);
        st->trip = q->trip;
        st->reverse = q->reverse;
        rc = take_moves(st, q);
        for (int b = 0; b < 2 && !rc; b++) {
          st->n_sub[b] = q->n_sub[b];
          rc = make_steps(p, pl, q->sub[b], q->n_sub[b], &st->sub[b]);
        }
        break;
      }
      default: rc = kiln_set_error("cuda: @%s: unknown plan step %d", p->name, q->kind);
    }
    if (rc) return -1;
  }
  return 0;
}

/* numbers the tree's steps in pre-order into p->all (counted first) */
static void number_steps(cuda_program *p, cuda_step *steps, int n) {
  for (int s = 0; s < n; s++) {
    cuda_step *st = &steps[s];
    st->no = p->n_all;
    if (p->all) p->all[st->no] = st;
    p->n_all++;
    for (int b = 0; b < 2; b++) number_steps(p, st->sub[b], st->n_sub[b]);
  }
}

void cuda_steps_free(cuda_step *steps, int n) {
  for (int s = 0; steps && s < n; s++) {
    cuda_step *st = &steps[s];
    free(st->bufs), free(st->types);
    free(st->state), free(st->move), free(st->scratch), free(st->state_bytes);
    for (int b = 0; b < 2; b++) cuda_steps_free(st->sub[b], st->n_sub[b]);
  }
  free(steps);
}

/* Plans cb->f and makes the launch plan: a step per plan step (a kernel's
 * buffers and launch shape come with its emission), control flow nested as
 * the plan's, the results, the constants the steps read (retained). */
int cuda_plan(cuda_build *cb) {
  cuda_program *p = cb->p;
  plan *pl = &cb->pl;
  if (cuda_plan_build(pl, cb->f)) return -1;
  p->arena_bytes = pl->arena_bytes;
  for (int s = 0; s < pl->n_slots; s++) /* uploaded by the runtime */
    if (pl->slots[s].kind == PLAN_SLOT_CONST && plan_keep_const(&p->consts, &p->n_consts, pl->slots[s].cst))
      return cuda_oom();
  if (!(p->slots = malloc(((size_t)pl->n_slots + 1) * sizeof *p->slots))) return cuda_oom();
  memcpy(p->slots, pl->slots, (size_t)pl->n_slots * sizeof *p->slots);
  p->n_slots = pl->n_slots;
  p->n_steps = pl->n_steps;
  if (make_steps(p, pl, pl->steps, pl->n_steps, &p->steps)) return -1;
  number_steps(p, p->steps, p->n_steps);
  if (!(p->all = malloc(((size_t)p->n_all + 1) * sizeof *p->all))) return cuda_oom();
  p->n_all = 0;
  number_steps(p, p->steps, p->n_steps);
  p->results = calloc((size_t)cb->f->n_results + 1, sizeof *p->results);
  if (!p->results) return cuda_oom();
  for (int r = 0; r < cb->f->n_results; r++)
    p->results[r] = (cuda_result){pl->results[r].kind, pl->results[r].index, pl->results[r].cst};
  return 0;
}
