/* chain.c — row chains: consecutive kernels over the rows of narrow
 * matrices ([R, w] values, w at most CHAIN_MAX_W: a tiny MLP over a batch,
 * the L2HMC leapfrog's 2-10-2 energy and its gradient) evaluated as one
 * kernel, block by block of L rows (one vector's lanes). Within a block
 * every value is w vectors, one per column, lane l holding row row0 + l:
 * a dot [R, K] x [K, N] with a short K (llvm_dot_inline) is then K x N
 * multiply-adds of a column by a broadcast weight, where one kernel per
 * fusion gathered the K elements of each row across memory (stride K) for
 * every vector of rows. The values one kernel of the chain passes to the
 * next stay in registers; only what is read after the chain is stored,
 * each block's rows at the block's end, transposed back to rows.
 *
 * Blocks change the order of the kernels' memory accesses: the sequential
 * plan lets a later kernel write over bytes an earlier one read (the
 * arena's reuse), but in blocks the later kernel writes block b before the
 * earlier reads block b + 1. The chain is taken only where that cannot
 * matter: such bytes are the same rows of a value of the same row size at
 * the same place (a carry stored over itself), and no weight read whole
 * lies where the chain writes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/compile.h"

enum {
  CHAIN_MAX_W = 16,      /* columns of a value (each a vector per block) */
  CHAIN_MIN_ROWS = 32,   /* fewer rows: the kernels as they are */
  CHAIN_MAX_KERNELS = 64, /* kernels of one chain (one block's code) */
};

/* ---- which kernels ---- */

static bool row_value(const op_type *t, int64_t rows) {
  return t->rank == 2 && t->shape[0] == rows && t->shape[1] >= 1 && t->shape[1] <= CHAIN_MAX_W;
}

static bool any_dim(const op_type *t, int64_t rows) {
  for (int d = 0; d < t->rank; d++)
    if (t->shape[d] == rows) return true;
  return false;
}

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int d = 0; d < a->rank; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

/* Whether member in (of f) reads its operands at rows the block holds
 * (a row value at its own row, or one of [rows, 1] at column 0) or whole
 * (weights: no dim of rows), with ops that cannot fail on float values. */
static bool member_ok(const ir_func *f, const ir_instr *in, int64_t rows, kiln_dtype dt) {
  const op_type *rt = &f->types[in->out];
  if (in->n_out != 1) return false;
  if (in->op == OP_DOT) {
    const op_type *a = &f->types[in->in[0]], *b = &f->types[in->in[1]];
    return llvm_dot_inline(f, in) && a->dtype == dt && row_value(a, rows) && b->rank == 2 && !any_dim(b, rows) &&
           row_value(rt, rows);
  }
  switch (kiln_ops[in->op].kind) {
    case OPK_CONST: return in->attrs.value->size == 1;
    case OPK_UNARY:
    case OPK_BINARY:
    case OPK_COMPARE:
    case OPK_SELECT:
      if (in->op == OP_MOD) return false;
      break;
    case OPK_VIEW: return same_shape(&f->types[in->in[0]], rt) && row_value(rt, rows);
    case OPK_MOVE:
      if (in->op != OP_BROADCAST) return false;
      break;
    default: return false;
  }
  if (!row_value(rt, rows)) return false;
  if (rt->dtype != dt && !(rt->dtype == KILN_BOOL && kiln_ops[in->op].kind == OPK_COMPARE)) return false;
  for (int k = 0; k < in->n_in; k++) {
    const op_type *t = &f->types[in->in[k]];
    if (t->dtype != dt && !(t->dtype == KILN_BOOL && in->op == OP_SELECT && k == 0)) return false;
    bool row = t->rank == 2 && t->shape[0] == rows;
    if (row ? !(same_shape(t, rt) || t->shape[1] == 1) : any_dim(t, rows)) return false;
  }
  return true;
}

/* Whether kernel g can be part of a chain over rows of dtype dt. */
static bool kernel_ok(const plan_kernel *g, int64_t rows, kiln_dtype dt) {
  const ir_func *f = g->f;
  if (g->special || g->pass || g->n_out < 1) return false;
  for (int k = 0; k < g->n_out; k++) {
    const op_type *t = &f->types[g->out[k]];
    if (!row_value(t, rows) || t->dtype != dt) return false;
  }
  for (int v = 0; v < f->n_values; v++) {
    const op_type *t = &f->types[v];
    bool row = t->rank == 2 && t->shape[0] == rows;
    if (row ? !row_value(t, rows) : any_dim(t, rows)) return false;
    if (g->leaf[v] >= 0 && row && t->dtype != dt) return false;
  }
  for (int i = 0; i < f->n_instrs; i++)
    if (g->member[i] && !member_ok(f, &f->instrs[i], rows, dt)) return false;
  return true;
}

static bool has_dot(const plan_kernel *g) {
  for (int i = 0; i < g->f->n_instrs; i++)
    if (g->member[i] && g->f->instrs[i].op == OP_DOT) return true;
  return false;
}

/* ---- slots: who reads them, where they lie ---- */

/* per slot, its references by steps (n of them, nested lists included):
 * kernels' leaves, calls' and copies' slots, loops' states and moves */
static void count_reads(const plan *pl, const plan_step *steps, int n, int *reads) {
  for (int s = 0; s < n; s++) {
    const plan_step *st = &steps[s];
    if (st->kind == PLAN_STEP_KERNEL) {
      const plan_kernel *g = &pl->kernels[st->index];
      for (int v = 0; v < g->f->n_values; v++)
        if (g->leaf[v] >= 0) reads[g->leaf[v]]++;
    } else {
      for (int k = 0; k < st->n_slots; k++) reads[st->slots[k]]++; /* a call's outputs too: harmless */
    }
    for (int k = 0; k < st->n_state; k++) {
      if (st->state[k] >= 0) reads[st->state[k]]++;
      if (st->scratch && st->scratch[k] >= 0) reads[st->scratch[k]]++;
    }
    for (int k = 0; k < 2 * st->n_move; k++) reads[st->move[k]]++;
    for (int k = 0; k < 2; k++) count_reads(pl, st->sub[k], st->n_sub[k], reads);
  }
}

/* What the chain finder knows of the plan's slots (made once per build). */
struct cpu_chains {
  int *reads;            /* per slot: references by every step (kernels' leaves, calls, copies, loops) */
  const plan_step **mv;  /* per slot: the loop step whose moves list it, or NULL */
};

static void note_moves(const plan_step *steps, int n, const plan_step **mv) {
  for (int s = 0; s < n; s++) {
    const plan_step *st = &steps[s];
    for (int k = 0; k < 2 * st->n_move; k++) mv[st->move[k]] = st;
    for (int k = 0; k < 2; k++) note_moves(st->sub[k], st->n_sub[k], mv);
  }
}

static cpu_chains *chains_of(cpu_build *cb) {
  if (cb->chains) return cb->chains;
  const plan *pl = &cb->pl;
  cpu_chains *c = calloc(1, sizeof *c);
  if (c) c->reads = calloc((size_t)pl->n_slots + 1, sizeof *c->reads);
  if (c) c->mv = calloc((size_t)pl->n_slots + 1, sizeof *c->mv);
  if (!c || !c->reads || !c->mv) {
    cpu_chains_free(c);
    return NULL;
  }
  count_reads(pl, pl->steps, pl->n_steps, c->reads);
  note_moves(pl->steps, pl->n_steps, c->mv);
  return cb->chains = c;
}

void cpu_chains_free(cpu_chains *c) {
  if (!c) return;
  free(c->reads);
  free(c->mv);
  free(c);
}

/* A place a slot's bytes may lie at: a buffer (the arena, a parameter's, a
 * result's, a constant's) and a byte range in it. */
typedef struct {
  int buffer; /* 0 the arena; 1 + 2i parameter i; 2 + 2i result i; -1 - s constant slot s */
  int64_t lo, hi;
} place;

enum { MAX_PLACES = 16 };

static int own_place(const plan *pl, int s, place *p) {
  const plan_slot *sl = &pl->slots[s];
  switch (sl->kind) {
    case PLAN_SLOT_ARENA: *p = (place){0, sl->offset, sl->offset + pl->slot_bytes[s]}; return 1;
    case PLAN_SLOT_PARAM: *p = (place){1 + 2 * sl->index, 0, INT64_MAX}; return 1;
    case PLAN_SLOT_RESULT: *p = (place){2 + 2 * sl->index, 0, INT64_MAX}; return 1;
    case PLAN_SLOT_CONST: *p = (place){-1 - s, 0, INT64_MAX}; return 1;
    default: /* a row of another slot: anywhere in that one's bytes */
      if (sl->index < 0 || sl->index >= pl->n_slots || pl->slots[sl->index].kind == PLAN_SLOT_ROW) return -1;
      if (own_place(pl, sl->index, p) != 1) return -1;
      if (p->buffer == 0) p->hi = INT64_MAX; /* the arena's rows: from the base on */
      return 1;
  }
}

/* Every place slot s may lie at: its own, or, when a loop moves it, any
 * place of the slots that loop moves. -1 when there are too many. */
static int places_of(const plan *pl, const cpu_chains *c, int s, place *out) {
  const plan_step *st = c->mv[s];
  if (!st) return own_place(pl, s, out);
  int n = 0;
  for (int k = 0; k < 2 * st->n_move; k++) {
    if (n == MAX_PLACES) return -1;
    if (own_place(pl, st->move[k], &out[n]) != 1) return -1;
    n++;
  }
  return n;
}

/* Whether slots a and b may share bytes (-1: unknown, taken as yes). */
static bool may_overlap(const plan *pl, const cpu_chains *c, int a, int b) {
  if (a == b) return true;
  place pa[MAX_PLACES], pb[MAX_PLACES];
  int na = places_of(pl, c, a, pa), nb = places_of(pl, c, b, pb);
  if (na < 0 || nb < 0) return true;
  for (int i = 0; i < na; i++)
    for (int j = 0; j < nb; j++)
      if (pa[i].buffer == pb[j].buffer && pa[i].lo < pb[j].hi && pb[j].lo < pa[i].hi) return true;
  return false;
}

/* ---- the chain's slots ---- */

enum { USE_ROW = 1, USE_WHOLE = 2, USE_STORE = 4 };

typedef struct {
  int slot;
  int first;   /* the chain kernel that first reads or writes it */
  int written; /* the chain kernel that writes it, or -1 */
  int use;     /* USE_* */
  int w;       /* columns (row values) */
  bool read_first; /* read before the chain writes it (a carry stored over itself) */
  bool internal; /* written, and read by nobody after the chain: never stored */
} chain_slot;

typedef struct {
  chain_slot *s;
  int n;
} slot_list;

static chain_slot *find_slot(slot_list *l, int slot) {
  for (int i = 0; i < l->n; i++)
    if (l->s[i].slot == slot) return &l->s[i];
  return NULL;
}

static chain_slot *add_slot(slot_list *l, int slot, int k) {
  chain_slot *c = find_slot(l, slot);
  if (c) return c;
  c = &l->s[l->n++];
  *c = (chain_slot){.slot = slot, .first = k, .written = -1};
  return c;
}

/* The slots kernels steps[0..n) read and write, in order of first use;
 * false when a row value is read as two shapes or a weight is one the
 * chain computes. l->s holds room for every leaf and output. */
static bool chain_slots(const plan *pl, const plan_step *steps, int n, slot_list *l) {
  l->n = 0;
  for (int k = 0; k < n; k++) {
    const plan_kernel *g = &pl->kernels[steps[k].index];
    for (int v = 0; v < g->f->n_values; v++) {
      if (g->leaf[v] < 0) continue;
      const op_type *t = &g->f->types[v];
      bool row = t->rank == 2 && row_value(t, g->f->types[g->out[0]].shape[0]);
      chain_slot *c = add_slot(l, g->leaf[v], k);
      if (c->written >= 0 && (!row || c->w != t->shape[1])) return false; /* computed here, read otherwise */
      if (row && c->use & USE_ROW && c->w != t->shape[1]) return false;
      c->use |= row ? USE_ROW : USE_WHOLE;
      if (row) c->w = (int)t->shape[1];
      if (c->written < 0) c->read_first = true;
    }
    for (int r = 0; r < g->n_out; r++) {
      chain_slot *c = add_slot(l, g->out_slot[r], k);
      if (c->written >= 0 || c->use & USE_WHOLE) return false;
      if (c->use & USE_ROW && c->w != g->f->types[g->out[r]].shape[1]) return false;
      c->written = k;
      c->w = (int)g->f->types[g->out[r]].shape[1];
    }
  }
  return true;
}

/* Whether kernels steps[0..n) may run block by block (the file's comment),
 * their slots in l (internal ones marked). */
static bool chain_safe(const plan *pl, const cpu_chains *c, const plan_step *steps, int n, slot_list *l) {
  if (!chain_slots(pl, steps, n, l)) return false;
  for (int i = 0; i < l->n; i++) { /* read by nobody but the chain's kernels: never stored */
    chain_slot *a = &l->s[i];
    if (a->written < 0) continue;
    int inside = 0;
    for (int k = 0; k < n; k++) {
      const plan_kernel *g = &pl->kernels[steps[k].index];
      for (int v = 0; v < g->f->n_values; v++) inside += g->leaf[v] == a->slot;
    }
    a->internal = pl->slots[a->slot].kind == PLAN_SLOT_ARENA && c->reads[a->slot] == inside && !c->mv[a->slot] &&
                  !a->read_first;
    if (!a->internal) a->use |= USE_STORE;
  }
  for (int i = 0; i < l->n; i++) {
    const chain_slot *w = &l->s[i];
    if (!(w->use & USE_STORE)) continue;
    for (int j = 0; j < l->n; j++) {
      const chain_slot *x = &l->s[j];
      if (j == i || !(x->use & (USE_WHOLE | USE_STORE) || (x->use & USE_ROW && x->written < 0)) ||
          !may_overlap(pl, c, w->slot, x->slot))
        continue;
      /* the same rows of a value of the same row size at the same place:
       * a block's loads come before its stores, blocks touch their rows */
      const plan_slot *ws = &pl->slots[w->slot], *xs = &pl->slots[x->slot];
      bool aligned = !(x->use & (USE_WHOLE | USE_STORE)) && ws->kind == PLAN_SLOT_ARENA && xs->kind == PLAN_SLOT_ARENA &&
                     !c->mv[w->slot] && !c->mv[x->slot] && ws->offset == xs->offset && w->w == x->w;
      if (!aligned) return false;
    }
  }
  return true;
}

/* The kernels of a chain starting at steps[0] (n steps follow in its list):
 * its length (0: none). l gets its slots. */
static int chain_at(cpu_build *cb, const plan_step *steps, int n, slot_list *l) {
  const plan *pl = &cb->pl;
  if (steps[0].kind != PLAN_STEP_KERNEL) return 0;
  const plan_kernel *g0 = &pl->kernels[steps[0].index];
  if (g0->n_out < 1) return 0;
  const op_type *t0 = &g0->f->types[g0->out[0]];
  if (t0->rank != 2 || (t0->dtype != KILN_F32 && t0->dtype != KILN_F64)) return 0;
  int64_t rows = t0->shape[0];
  if (rows < CHAIN_MIN_ROWS) return 0;
  int len = 0;
  while (len < n && len < CHAIN_MAX_KERNELS && steps[len].kind == PLAN_STEP_KERNEL &&
         kernel_ok(&pl->kernels[steps[len].index], rows, t0->dtype))
    len++;
  cpu_chains *c = len ? chains_of(cb) : NULL;
  if (!c) return 0;
  for (; len > 0; len--) {
    bool dot = false;
    for (int k = 0; k < len && !dot; k++) dot = has_dot(&pl->kernels[steps[k].index]);
    if (dot && chain_safe(pl, c, steps, len, l)) return len;
  }
  return 0;
}

/* ---- emission ---- */

/* the vector of lanes elements i / w (i < lanes * w) compared below valid */
static LLVMValueRef row_mask(llvm_emit *e, int lanes, int w, LLVMValueRef valid) {
  LLVMValueRef c[CHAIN_MAX_W * 16];
  for (int i = 0; i < lanes * w; i++) c[i] = llvm_i32(e, i / w);
  LLVMValueRef lim = llvm_splat(e, lanes * w, valid);
  return LLVMBuildICmp(e->b, LLVMIntULT, LLVMConstVector(c, (unsigned)(lanes * w)), lim, "");
}

/* the block's rows of a row value of w columns at p, as w column vectors */
static void load_columns(llvm_emit *e, LLVMTypeRef et, int lanes, int w, LLVMValueRef p, LLVMValueRef row0,
                         LLVMValueRef valid, LLVMValueRef *col) {
  LLVMBuilderRef b = e->b;
  LLVMTypeRef wide = LLVMVectorType(et, (unsigned)(lanes * w)), ft;
  LLVMValueRef at = LLVMBuildGEP2(b, et, p, (LLVMValueRef[]){LLVMBuildMul(b, row0, llvm_i64(e, w), "")}, 1, "");
  LLVMTypeRef types[2] = {wide, e->t_ptr};
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.masked.load", types, 2, &ft);
  LLVMValueRef args[4] = {at, llvm_i32(e, LLVMGetTypeKind(et) == LLVMDoubleTypeKind ? 8 : 4),
                          row_mask(e, lanes, w, valid), LLVMConstNull(wide)};
  LLVMValueRef v = llvm_call(e, fn, ft, args, 4);
  if (w == 1) {
    col[0] = v;
    return;
  }
  for (int j = 0; j < w; j++) {
    LLVMValueRef m[16];
    for (int l = 0; l < lanes; l++) m[l] = llvm_i32(e, j + w * l);
    col[j] = LLVMBuildShuffleVector(b, v, LLVMGetPoison(wide), LLVMConstVector(m, (unsigned)lanes), "");
  }
}

/* w column vectors into the block's rows at p (rows past valid untouched) */
static void store_columns(llvm_emit *e, LLVMTypeRef et, int lanes, int w, LLVMValueRef p, LLVMValueRef row0,
                          LLVMValueRef valid, LLVMValueRef *col) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef v[CHAIN_MAX_W] = {0};
  int n = w, len = lanes;
  for (int j = 0; j < w; j++) v[j] = col[j];
  while (n > 1) { /* concatenated pairwise: [col 0 | col 1 | ... ] padded to a power of two */
    LLVMValueRef m[CHAIN_MAX_W * 16];
    for (int i = 0; i < 2 * len; i++) m[i] = llvm_i32(e, i);
    LLVMValueRef mask = LLVMConstVector(m, (unsigned)(2 * len));
    int k = 0;
    for (int j = 0; j < n; j += 2) {
      LLVMValueRef y = j + 1 < n ? v[j + 1] : LLVMGetPoison(LLVMTypeOf(v[j]));
      v[k++] = LLVMBuildShuffleVector(b, v[j], y, mask, "");
    }
    n = k, len *= 2;
  }
  LLVMValueRef all = v[0];
  if (w > 1) { /* element (row l, column j) from column j's lane l */
    LLVMValueRef m[CHAIN_MAX_W * 16];
    for (int i = 0; i < lanes * w; i++) m[i] = llvm_i32(e, (i % w) * lanes + i / w);
    all = LLVMBuildShuffleVector(b, all, LLVMGetPoison(LLVMTypeOf(all)), LLVMConstVector(m, (unsigned)(lanes * w)), "");
  }
  LLVMTypeRef wide = LLVMTypeOf(all), ft;
  LLVMValueRef at = LLVMBuildGEP2(b, et, p, (LLVMValueRef[]){LLVMBuildMul(b, row0, llvm_i64(e, w), "")}, 1, "");
  LLVMTypeRef types[2] = {wide, e->t_ptr};
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.masked.store", types, 2, &ft);
  LLVMValueRef args[4] = {all, at, llvm_i32(e, LLVMGetTypeKind(et) == LLVMDoubleTypeKind ? 8 : 4),
                          row_mask(e, lanes, w, valid)};
  llvm_call(e, fn, ft, args, 4);
}

/* ---- the chain's kernel ---- */

int cpu_chain_length(cpu_build *cb, const plan_step *steps, int n) {
  if (cb->no_chains || n < 1 || steps[0].kind != PLAN_STEP_KERNEL) return 0;
  int cap = 0;
  for (int k = 0; k < n && k < CHAIN_MAX_KERNELS && steps[k].kind == PLAN_STEP_KERNEL; k++) {
    const plan_kernel *g = &cb->pl.kernels[steps[k].index];
    cap += g->n_out + g->f->n_values;
  }
  slot_list l = {calloc((size_t)cap + 1, sizeof *l.s), 0};
  int len = l.s ? chain_at(cb, steps, n, &l) : 0;
  free(l.s);
  return len;
}

/* A slot's value in the block being emitted: its columns in registers
 * (NULL where not), and a tile of them on the stack (NULL until one is
 * needed): a kernel that loops over its columns reads and writes tiles. */
typedef struct {
  LLVMValueRef col[CHAIN_MAX_W];
  LLVMValueRef tile;
  bool have;
} slot_value;

typedef struct {
  cpu_build *cb;
  const slot_list *l;
  slot_value *sv;       /* per slot of l */
  LLVMValueRef *ptr;    /* per slot of l: its pointer (a parameter), or NULL */
  LLVMBuilderRef alloca_b; /* at the end of the function's entry block */
  LLVMTypeRef et, vt;   /* the element and the column type */
  int lanes;
  LLVMValueRef row0, valid;
} block;

/* Per-column code above this many instructions (a rough count) is a loop
 * over the columns, its values in tiles: the leapfrog's tanh layer, ten
 * columns of vector math straight, spilled registers and took the chain's
 * code generation from ~30 to ~45 ms. */
enum { UNROLL_COST = 48 };

static int member_cost(const ir_instr *in, const ir_func *f) {
  if (cpu_vector_math_op(in->op)) return 30;
  switch (in->op) {
    case OP_DIV:
    case OP_SQRT:
    case OP_RSQRT: return 4;
    case OP_DOT: return (int)f->types[in->in[0]].shape[1];
    default: return 1;
  }
}

static bool loops(const plan_kernel *g) {
  int64_t w = g->f->types[g->out[0]].shape[1], cost = 0;
  for (int i = 0; i < g->f->n_instrs; i++)
    if (g->member[i]) cost += member_cost(&g->f->instrs[i], g->f);
  return w > 2 && w * cost > UNROLL_COST;
}

static LLVMValueRef tile_at(block *bk, LLVMValueRef tile, int w, LLVMValueRef j) {
  LLVMTypeRef at = LLVMArrayType2(bk->vt, (uint64_t)w);
  return LLVMBuildGEP2(bk->cb->e.b, at, tile, (LLVMValueRef[]){llvm_i64(&bk->cb->e, 0), j}, 2, "");
}

static LLVMValueRef new_tile(block *bk, int w) {
  LLVMValueRef t = LLVMBuildAlloca(bk->alloca_b, LLVMArrayType2(bk->vt, (uint64_t)w), "tile");
  LLVMSetAlignment(t, 64);
  return t;
}

/* slot i's value present (its rows loaded when it comes from memory) */
static void need_value(block *bk, int i) {
  slot_value *v = &bk->sv[i];
  if (v->have) return;
  load_columns(&bk->cb->e, bk->et, bk->lanes, bk->l->s[i].w, bk->ptr[i], bk->row0, bk->valid, v->col);
  v->have = true;
}

/* slot i's value in a tile (stored there from its registers if need be) */
static LLVMValueRef need_tile(block *bk, int i) {
  slot_value *v = &bk->sv[i];
  need_value(bk, i);
  if (v->tile) return v->tile;
  int w = bk->l->s[i].w;
  v->tile = new_tile(bk, w);
  for (int j = 0; j < w; j++) LLVMBuildStore(bk->cb->e.b, v->col[j], tile_at(bk, v->tile, w, llvm_i64(&bk->cb->e, j)));
  return v->tile;
}

/* column j of slot i: its register, or a load from its tile (kept as the
 * register unless inside a loop, where the load holds in the body only) */
static LLVMValueRef column(block *bk, int i, int j, bool in_loop) {
  slot_value *v = &bk->sv[i];
  need_value(bk, i);
  if (v->col[j]) return v->col[j];
  LLVMValueRef x = LLVMBuildLoad2(bk->cb->e.b, bk->vt, tile_at(bk, v->tile, bk->l->s[i].w, llvm_i64(&bk->cb->e, j)), "");
  if (!in_loop) v->col[j] = x;
  return x;
}

static int slot_index(const slot_list *l, int slot) {
  int i = 0;
  while (l->s[i].slot != slot) i++;
  return i;
}

/* Kernel g's values in the block: each output column by column (j a
 * constant) or in a loop over its columns (j the loop's counter, its
 * outputs into new tiles); the slots' values then its outputs. */
static int emit_block_kernel(block *bk, const plan_kernel *g) {
  llvm_emit *e = &bk->cb->e;
  const ir_func *f = g->f;
  const op_type *ot = &f->types[g->out[0]];
  int64_t rows = ot->shape[0];
  int w = (int)ot->shape[1];
  bool looped = loops(g);
  LLVMValueRef *buf = calloc((size_t)f->n_values + 1, sizeof *buf);
  LLVMValueRef *outs = calloc((size_t)g->n_out * CHAIN_MAX_W + 1, sizeof *outs);
  if (!buf || !outs) {
    free(buf), free(outs);
    return cpu_oom();
  }
  llvm_group fg = {.e = e, .f = f, .buf = buf, .lanes = bk->lanes};
  llvm_group_init(&fg);
  /* the weights' pointers; the rows' values present before any loop */
  for (int v = 0; v < f->n_values; v++) {
    if (g->leaf[v] < 0) continue;
    int i = slot_index(bk->l, g->leaf[v]);
    if (!row_value(&f->types[v], rows)) buf[v] = bk->ptr[i];
    else if (looped && f->types[v].shape[1] == w) need_tile(bk, i);
    else need_value(bk, i);
  }
  LLVMValueRef tiles[64] = {0};
  llvm_loop lj;
  LLVMValueRef jv = NULL;
  int nj = looped ? 1 : w, rc = 0;
  if (looped) {
    if (g->n_out > 64) rc = kiln_set_error("cpu: @%s: a kernel with more than 64 outputs", bk->cb->f->name);
    for (int r = 0; r < g->n_out && !rc; r++) tiles[r] = new_tile(bk, w);
    jv = llvm_loop_begin(e, &lj, llvm_i64(e, 0), llvm_i64(e, w), "col");
  }
  for (int v = 0; v < f->n_values && !rc; v++) { /* each row leaf at the indices the kernel may read */
    if (g->leaf[v] < 0 || !row_value(&f->types[v], rows)) continue;
    const op_type *t = &f->types[v];
    int i = slot_index(bk->l, g->leaf[v]);
    llvm_index idx;
    for (int c = 0; c < t->shape[1]; c++) {
      llvm_index_dims(&idx, t, (LLVMValueRef[]){bk->row0, llvm_i64(e, c)});
      llvm_group_set(&fg, v, &idx, column(bk, i, c, looped));
    }
    if (looped && t->shape[1] == w) {
      llvm_index_dims(&idx, t, (LLVMValueRef[]){bk->row0, jv});
      llvm_group_set(&fg, v, &idx, LLVMBuildLoad2(e->b, bk->vt, tile_at(bk, bk->sv[i].tile, w, jv), ""));
    }
  }
  for (int j = 0; j < nj && !rc; j++)
    for (int r = 0; r < g->n_out && !rc; r++) {
      llvm_index idx;
      llvm_index_dims(&idx, ot, (LLVMValueRef[]){bk->row0, looped ? jv : llvm_i64(e, j)});
      LLVMValueRef x = llvm_emit_value(&fg, g->out[r], &idx);
      if (!x) {
        rc = -1;
        break;
      }
      x = llvm_splat(e, bk->lanes, x);
      if (looped) LLVMBuildStore(e->b, x, tile_at(bk, tiles[r], w, jv));
      else outs[r * CHAIN_MAX_W + j] = x;
    }
  if (looped && !rc) llvm_loop_end(e, &lj);
  if (!rc && (fg.bad || fg.bad_op != OP_COUNT))
    rc = kiln_set_error("cpu: @%s: internal error: a row chain's op can fail", bk->cb->f->name);
  for (int r = 0; r < g->n_out && !rc; r++) { /* the outputs: the slots' values from now on */
    slot_value *sv = &bk->sv[slot_index(bk->l, g->out_slot[r])];
    memset(sv, 0, sizeof *sv);
    sv->have = true;
    if (looped) sv->tile = tiles[r];
    else memcpy(sv->col, &outs[r * CHAIN_MAX_W], (size_t)w * sizeof *outs);
  }
  llvm_group_dispose(&fg);
  free(buf), free(outs);
  return rc;
}

int cpu_emit_chain(cpu_build *cb, const plan_step *steps, int n, int id, kinfo *ki) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const plan *pl = &cb->pl;
  memset(ki, 0, sizeof *ki);
  int cap = 0;
  for (int k = 0; k < n; k++) {
    const plan_kernel *g = &pl->kernels[steps[k].index];
    cap += g->n_out + g->f->n_values;
  }
  slot_list l = {calloc((size_t)cap + 1, sizeof *l.s), 0};
  ki->buf_slot = calloc((size_t)cap + 1, sizeof *ki->buf_slot);
  int *param_of = calloc((size_t)cap + 1, sizeof *param_of);
  LLVMTypeRef *params = calloc((size_t)cap + 4, sizeof *params);
  block bk = {.cb = cb, .l = &l};
  bk.sv = calloc((size_t)cap + 1, sizeof *bk.sv);
  bk.ptr = calloc((size_t)cap + 1, sizeof *bk.ptr);
  int rc = 0;
  cpu_chains *c = NULL;
  if (!l.s || !ki->buf_slot || !param_of || !params || !bk.sv || !bk.ptr || !(c = chains_of(cb))) {
    rc = cpu_oom();
    goto done;
  }
  if (!chain_safe(pl, c, steps, n, &l)) {
    rc = kiln_set_error("cpu: @%s: internal error: a row chain no longer holds", cb->f->name);
    goto done;
  }
  /* the pointers: what it stores, then what it reads from memory */
  for (int pass = 0; pass < 2; pass++)
    for (int i = 0; i < l.n; i++) {
      const chain_slot *s = &l.s[i];
      bool stored = s->use & USE_STORE, read = s->use & USE_WHOLE || (s->use & USE_ROW && !s->internal);
      if (pass == 0 ? !stored : stored || !read) continue;
      param_of[i] = ki->n_bufs;
      ki->buf_slot[ki->n_bufs++] = s->slot;
    }
  int nb = ki->n_bufs;
  for (int k = 0; k < nb; k++) params[k] = e->t_ptr;
  params[nb] = e->t_ptr, params[nb + 1] = e->t_i64, params[nb + 2] = e->t_i64;
  ki->fn_type = LLVMFunctionType(e->t_void, params, (unsigned)nb + 3, 0);
  char name[32];
  snprintf(name, sizeof name, "kernel%d", id);
  LLVMValueRef fn = ki->fn = LLVMAddFunction(e->mod, name, ki->fn_type);
  LLVMSetLinkage(fn, LLVMInternalLinkage);
  cpu_add_fn_attr(e->ctx, fn, "nounwind");
  /* a loop's body: inlined, a counted loop around it would be unrolled
   * whole (ten leapfrog steps: ten copies of the chain to compile) */
  cpu_add_fn_attr(e->ctx, fn, "noinline");
  cpu_add_target_attrs(e->ctx, fn);
  /* weights are never written while it runs: noalias; what it stores and
   * the rows it reads may share places (a carry stored over itself) */
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7), align = LLVMGetEnumAttributeKindForName("align", 5);
  for (int i = 0; i < l.n; i++) {
    bool stored = l.s[i].use & USE_STORE, read = l.s[i].use & USE_WHOLE || (l.s[i].use & USE_ROW && !l.s[i].internal);
    if (!stored && !read) continue;
    unsigned at = (unsigned)param_of[i] + 1;
    bk.ptr[i] = LLVMGetParam(fn, at - 1);
    if (l.s[i].use == USE_WHOLE) LLVMAddAttributeAtIndex(fn, at, LLVMCreateEnumAttribute(e->ctx, noalias, 0));
    LLVMAddAttributeAtIndex(fn, at, LLVMCreateEnumAttribute(e->ctx, align, (uint64_t)plan_slot_align(pl, l.s[i].slot)));
  }
  LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(e->ctx, fn, "entry");
  LLVMPositionBuilderAtEnd(b, entry);
  const plan_kernel *g0 = &pl->kernels[steps[0].index];
  const op_type *t0 = &g0->f->types[g0->out[0]];
  int64_t rows = t0->shape[0];
  int lanes = 64 / kiln_dtype_sizes[t0->dtype], width = 0;
  for (int k = 0; k < n; k++) {
    const plan_kernel *g = &pl->kernels[steps[k].index];
    for (int r = 0; r < g->n_out; r++) width += (int)g->f->types[g->out[r]].shape[1];
    /* LLVM's pipeline is chosen by the biggest kernel's work: the same
     * with the chain as with its kernels apart */
    if (cpu_kernel_work(g) > ki->work) ki->work = cpu_kernel_work(g);
  }
  ki->units = (rows + lanes - 1) / lanes;
  ki->per_unit = (int64_t)lanes * width;
  bk.lanes = lanes;
  bk.et = llvm_value_type(e, t0->dtype);
  bk.vt = LLVMVectorType(bk.et, (unsigned)lanes);
  llvm_loop lb;
  LLVMValueRef blk = llvm_loop_begin(e, &lb, LLVMGetParam(fn, (unsigned)nb + 1), LLVMGetParam(fn, (unsigned)nb + 2), "chain");
  bk.alloca_b = LLVMCreateBuilderInContext(e->ctx);
  LLVMPositionBuilderBefore(bk.alloca_b, LLVMGetBasicBlockTerminator(entry));
  bk.row0 = LLVMBuildMul(b, blk, llvm_i64(e, lanes), "");
  LLVMValueRef left = LLVMBuildSub(b, llvm_i64(e, rows), bk.row0, "");
  left = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, left, llvm_i64(e, lanes), ""), left, llvm_i64(e, lanes), "");
  bk.valid = LLVMBuildTrunc(b, left, e->t_i32, "");
  for (int k = 0; k < n && !rc; k++) rc = emit_block_kernel(&bk, &pl->kernels[steps[k].index]);
  for (int i = 0; i < l.n && !rc; i++) { /* the block's stores, after all its loads */
    if (!(l.s[i].use & USE_STORE)) continue;
    LLVMValueRef col[CHAIN_MAX_W];
    for (int j = 0; j < l.s[i].w; j++) col[j] = column(&bk, i, j, false);
    store_columns(e, bk.et, lanes, l.s[i].w, bk.ptr[i], bk.row0, bk.valid, col);
  }
  LLVMDisposeBuilder(bk.alloca_b);
  if (rc) goto done;
  llvm_loop_end(e, &lb);
  LLVMBuildRetVoid(b);
  rc = cpu_emit_task(cb, ki, id);
done:
  free(l.s), free(param_of), free(params), free(bk.sv), free(bk.ptr);
  return rc;
}
