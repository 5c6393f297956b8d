/* kernel.c — one kernel of the plan as LLVM IR: a function over a range of
 * task units (flat blocks, rows, tiles, reduction outputs) that computes
 * each output element with llvm_emit's element emitter, stores it (around
 * the caches when it is large), and raises an error flag when an element
 * fails; plus the task that the thread pool calls. */
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"
#include "ir_internal.h"

enum {
  FLAT_BLOCK = 64,   /* elements: a flat kernel's tasks start 64-byte aligned, whatever the dtype */
  ROW_BLOCK = 16384, /* a long innermost row is cut into blocks of this many (tasks) */
  NARROW_ROW = 4,    /* innermost rows up to this long are unrolled (vectors run across rows) */
  TILE_ROWS = 16,    /* the tiles of a kernel that reads across rows (a transpose) */
  TILE_COLS = 64,
};
/* outputs of at least this many bytes are stored around the caches (x86) */
#define NT_MIN_BYTES ((int64_t)32 << 20)
/* flat kernels with outputs of at least this many bytes prefetch their
 * inputs (parts.c's prefetches); PF_ATTR marks them */
#define PF_MIN_BYTES ((int64_t)8 << 20)

void cpu_add_fn_attr(LLVMContextRef ctx, LLVMValueRef fn, const char *name) {
  unsigned kind = LLVMGetEnumAttributeKindForName(name, strlen(name));
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(ctx, kind, 0));
}

void cpu_add_target_attrs(LLVMContextRef ctx, LLVMValueRef fn) {
  const char *cpu = cpu_host_cpu(), *features = cpu_host_features();
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                          LLVMCreateStringAttribute(ctx, "target-cpu", 10, cpu, (unsigned)strlen(cpu)));
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                          LLVMCreateStringAttribute(ctx, "target-features", 15, features, (unsigned)strlen(features)));
  /* LLVM picks 256-bit vectors on AVX-512 machines unless told: whole
   * registers run the vector math 30-40% faster (tanh(x*a+b)*c+x: 0.42 vs
   * 0.54 ns per element in cache, measured) */
  if (cpu_jit_target_has("avx512f"))
    LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                            LLVMCreateStringAttribute(ctx, "prefer-vector-width", 19, "512", 3));
}

/* ORs g->bad into the kernel's flag and forgets it */
static void flush_bad(llvm_emit *e, llvm_group *g, LLVMValueRef bad_slot) {
  if (!g->bad) return;
  LLVMValueRef old = LLVMBuildLoad2(e->b, e->t_i1, bad_slot, "");
  LLVMBuildStore(e->b, LLVMBuildOr(e->b, old, g->bad, ""), bad_slot);
  g->bad = NULL;
}

/* kept input dims of a reduction from its output index */
static void reduce_dims(llvm_emit *e, const ir_instr *in, const op_type *it, llvm_index *oidx, LLVMValueRef *dims,
                        bool *reduced) {
  for (int d = 0; d < it->rank; d++) reduced[d] = false;
  for (int k = 0; k < in->attrs.naxes; k++) reduced[in->attrs.axes[k]] = true;
  llvm_index_get_dims(e, oidx);
  for (int d = 0, pos = 0; d < it->rank; d++) {
    if (reduced[d]) {
      dims[d] = NULL;
      if (in->attrs.keepdims) pos++;
    } else {
      dims[d] = oidx->dim[pos++];
    }
  }
}

/* the bytes a slot covers in the arena (type of the value g stores or reads there) */
static int64_t slot_bytes(const cpu_build *cb, const plan_kernel *g, int s) {
  int64_t bytes = 0;
  for (int k = 0; k < g->n_out; k++)
    if (g->out_slot[k] == s) bytes = plan_type_bytes(&g->f->types[g->out[k]]);
  for (int v = 0; v < g->f->n_values; v++)
    if (g->leaf[v] == s && plan_type_bytes(&g->f->types[v]) > bytes) bytes = plan_type_bytes(&g->f->types[v]);
  (void)cb;
  return bytes;
}

/* Whether g's one output, in slot out, lies exactly over the input in
 * slot in (the buffers pass put it there, or they are one slot) and g
 * reads that input only at the element it stores (plan_at_store_index,
 * at): each element's loads of it come before its store, which depends on
 * them, so the code stays right with noalias kept on both, as donate.c's
 * donated parameters. Without noalias the vectorizer's overlap check sends
 * an exact overlap to the scalar loop: a training step's batch-norm
 * gradient over a dying input ran 3x slower. */
static bool exactly_in_place(const cpu_build *cb, const plan_kernel *g, const bool *at, int out, int in) {
  const plan_slot *x = &cb->pl.slots[out], *y = &cb->pl.slots[in];
  if (!at || g->n_out != 1 || g->out_slot[0] != out) return false;
  if (out != in && (x->kind != PLAN_SLOT_ARENA || y->kind != PLAN_SLOT_ARENA || x->offset != y->offset)) return false;
  bool read = false;
  for (int v = 0; v < g->f->n_values; v++) {
    if (g->leaf[v] != in) continue;
    if (!at[v] || !ir_type_eq(&g->f->types[v], &g->f->types[g->out[0]])) return false;
    read = true;
  }
  return read;
}

static bool slots_overlap(const cpu_build *cb, const plan_kernel *g, int a, int b) {
  const plan_slot *x = &cb->pl.slots[a], *y = &cb->pl.slots[b];
  if (a == b) return true;
  if (x->kind != PLAN_SLOT_ARENA || y->kind != PLAN_SLOT_ARENA) return false;
  return x->offset < y->offset + slot_bytes(cb, g, b) && y->offset < x->offset + slot_bytes(cb, g, a);
}

enum { COL_TILE = 256 }; /* outputs a column reduction accumulates at once */

/* A column reduction with fewer tiles than threads to share them (its
 * output one row of kept innermost dims, the reduced dims leading) is
 * split: its rows cut into parts of COL_SPLIT_CHUNK elements or more (at
 * most COL_SPLIT_MAX parts), a first pass writing each part's partials
 * into the arena, a second adding them in part order. The parts depend on
 * the shapes alone, so the sums are the same for any thread count. A
 * training step's batch norm statistics and their backward's sums over
 * [N,H,W,C] ran on one thread before. */
enum { COL_SPLIT_MIN = 1 << 16, COL_SPLIT_CHUNK = 1 << 14, COL_SPLIT_MAX = 64, COL_SPLIT_TILES = 4 };

/* is g a column reduction (emit_reduce_columns): it keeps the innermost
 * dim, and its rows accumulate into a tile? */
static bool is_column(const plan_kernel *g) {
  if (g->special || g->n_out < 1) return false;
  const ir_func *f = g->f;
  ir_value out = g->out[0];
  if (out < f->n_params || f->def[out] < 0) return false;
  const ir_instr *first = &f->instrs[f->def[out]];
  if (!llvm_op_is_reduce(first->op)) return false;
  const op_type *it = &f->types[first->in[0]], *ot = &f->types[out];
  bool kept_last = it->rank > 0 && first->attrs.naxes > 0;
  for (int k = 0; k < first->attrs.naxes; k++) kept_last = kept_last && first->attrs.axes[k] != it->rank - 1;
  return kept_last && it->shape[it->rank - 1] >= 8 && plan_type_size(ot) > 0 && plan_type_size(it) > plan_type_size(ot);
}

/* the rows of g's column reduction in each part (*chunk) and the number
 * of parts, or 0 when it is not split */
static int64_t column_parts(const plan_kernel *g, int64_t *chunk) {
  if (!is_column(g)) return 0;
  const ir_func *f = g->f;
  const ir_instr *first = &f->instrs[f->def[g->out[0]]];
  const op_type *it = &f->types[first->in[0]];
  for (int k = 0; k < first->attrs.naxes; k++)
    if (first->attrs.axes[k] != k) return 0; /* the reduced dims lead */
  int64_t n_out = plan_type_size(&f->types[g->out[0]]), n_in = plan_type_size(it), rows = n_in / n_out;
  if (n_in < COL_SPLIT_MIN || (n_out + COL_TILE - 1) / COL_TILE >= COL_SPLIT_TILES) return 0;
  int64_t c = (COL_SPLIT_CHUNK + n_out - 1) / n_out, least = (rows + COL_SPLIT_MAX - 1) / COL_SPLIT_MAX;
  if (c < least) c = least;
  int64_t parts = (rows + c - 1) / c;
  if (chunk) *chunk = c;
  return parts >= 2 ? parts : 0;
}

int64_t cpu_column_split(const plan_kernel *g) { return column_parts(g, NULL); }

/* The second pass of a split column reduction: each output element the
 * combination of its parts' partials (read as the reduction's leaf), in
 * part order. */
static int emit_combine_columns(cpu_build *cb, const plan_kernel *g, LLVMValueRef fn, LLVMValueRef *buf,
                                LLVMValueRef begin, LLVMValueRef end, kinfo *ki) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = g->f;
  const ir_instr *first = &f->instrs[f->def[g->out[0]]];
  kiln_dtype dt = f->types[first->in[0]].dtype;
  int64_t chunk, parts = column_parts(g, &chunk), n_out = plan_type_size(&f->types[g->out[0]]);
  if (parts < 2) return kiln_set_error("cpu: @%s: internal error: a combine pass of no split", cb->f->name);
  ki->units = n_out;
  ki->per_unit = parts;
  llvm_loop lo, ls;
  LLVMValueRef o = llvm_loop_begin(e, &lo, begin, end, "out");
  for (int q = 0; q < g->n_out; q++) {
    const ir_instr *rk = &f->instrs[f->def[g->out[q]]];
    LLVMTypeRef at = llvm_reduce_type(e, rk->op, dt);
    LLVMValueRef part = buf[g->out[q]], acc = LLVMBuildAlloca(b, at, "acc");
    LLVMBuildStore(b, LLVMBuildLoad2(b, at, LLVMBuildGEP2(b, at, part, &o, 1, ""), ""), acc);
    LLVMValueRef s = llvm_loop_begin(e, &ls, llvm_i64(e, 1), llvm_i64(e, parts), "part");
    LLVMValueRef i = LLVMBuildAdd(b, LLVMBuildMul(b, s, llvm_i64(e, n_out), ""), o, "");
    LLVMValueRef x = LLVMBuildLoad2(b, at, LLVMBuildGEP2(b, at, part, &i, 1, ""), "");
    LLVMBuildStore(b, llvm_reduce_combine(e, rk->op, dt, LLVMBuildLoad2(b, at, acc, ""), x), acc);
    llvm_loop_end(e, &ls);
    llvm_emit_store(e, f->types[g->out[q]].dtype, LLVMGetParam(fn, (unsigned)q), o,
                    llvm_reduce_finish(e, rk->op, dt, LLVMBuildLoad2(b, at, acc, "")));
  }
  llvm_loop_end(e, &lo);
  return 0;
}

/* Outputs [first, first + n) of g at idx (linear index at), from the
 * kernel's parameters of the same numbers (llvm_emit_outputs). */
static int emit_outputs_from(const plan_kernel *g, llvm_group *lg, LLVMValueRef fn, int first, int n, llvm_index *idx,
                             LLVMValueRef at) {
  if (n == 0) return 0;
  LLVMValueRef *p = malloc((size_t)n * sizeof *p);
  if (!p) return cpu_oom();
  for (int k = 0; k < n; k++) p[k] = LLVMGetParam(fn, (unsigned)(first + k));
  int rc = llvm_emit_outputs(lg, n, g->out + first, p, idx, at);
  free(p);
  return rc;
}

/* A reduction kernel's side outputs (plan_kernel.n_side) at xidx, an
 * element of the reductions' input (their shape), stored as the
 * reductions read it. */
static int emit_side_outputs(const plan_kernel *g, llvm_group *lg, LLVMValueRef fn, llvm_index *xidx) {
  if (!g->n_side) return 0;
  return emit_outputs_from(g, lg, fn, g->n_out - g->n_side, g->n_side, xidx, llvm_index_get_linear(lg->e, xidx));
}

/* A reduction whose innermost input dims are kept: for each tile of an
 * output row, the rows of the reduced dims accumulate into an array, the
 * innermost loop running along contiguous memory (it vectorizes). */
static int emit_reduce_columns(cpu_build *cb, const plan_kernel *g, llvm_group *lg, LLVMValueRef fn, LLVMValueRef begin,
                               LLVMValueRef end, LLVMValueRef bad_slot, kinfo *ki) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = g->f;
  const ir_instr *first = &f->instrs[f->def[g->out[0]]];
  ir_value x = first->in[0];
  const op_type *it = &f->types[x], *ot = &f->types[g->out[0]];
  bool reduced[KILN_MAX_RANK] = {false};
  for (int k = 0; k < first->attrs.naxes; k++) reduced[first->attrs.axes[k]] = true;
  int nt = 0; /* the trailing kept dims, `inner` elements */
  int64_t inner = 1;
  for (int d = it->rank - 1; d >= 0 && !reduced[d]; d--) nt++, inner *= it->shape[d];
  int64_t n_out = plan_type_size(ot), n_in = plan_type_size(it);
  int64_t tile = inner < COL_TILE ? inner : COL_TILE, ntile = (inner + tile - 1) / tile, rows = n_out / inner;
  int64_t chunk = 0, parts = g->pass == 1 ? column_parts(g, &chunk) : 0; /* split: rows == 1 */
  ki->units = (parts ? parts : rows) * ntile;
  ki->per_unit = tile * (parts ? chunk : n_in / n_out);
  int nr = g->n_out - g->n_side; /* the reductions, then the side outputs */
  if (nr > 64) return kiln_set_error("cpu: @%s: a kernel with more than 64 reductions", cb->f->name);
  LLVMValueRef acc[64];
  LLVMTypeRef at[64];
  for (int k = 0; k < nr; k++) {
    at[k] = llvm_reduce_type(e, f->instrs[f->def[g->out[k]]].op, it->dtype);
    acc[k] = LLVMBuildAlloca(b, LLVMArrayType2(at[k], (uint64_t)tile), "acc");
  }
  llvm_loop lu, lj, lr[KILN_MAX_RANK];
  LLVMValueRef u = llvm_loop_begin(e, &lu, begin, end, "tile");
  LLVMValueRef row = u, j0 = llvm_i64(e, 0), w = llvm_i64(e, inner);
  if (ntile > 1) {
    row = LLVMBuildUDiv(b, u, llvm_i64(e, ntile), "");
    j0 = LLVMBuildMul(b, LLVMBuildURem(b, u, llvm_i64(e, ntile), ""), llvm_i64(e, tile), "");
    LLVMValueRef left = LLVMBuildSub(b, llvm_i64(e, inner), j0, "");
    w = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, left, llvm_i64(e, tile), ""), left, llvm_i64(e, tile), "");
  }
  /* acc = identity */
  LLVMValueRef jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "init");
  for (int k = 0; k < nr; k++) {
    op_id op = f->instrs[f->def[g->out[k]]].op;
    LLVMBuildStore(b, llvm_reduce_identity(e, op, it->dtype), LLVMBuildGEP2(b, at[k], acc[k], &jj, 1, ""));
  }
  llvm_loop_end(e, &lj);
  /* the kept outer dims from the output row; the reduced ones loop */
  op_type oo = *ot, io = *it;
  oo.rank -= nt;
  io.rank -= nt;
  llvm_index ridx;
  llvm_index_linear(&ridx, &oo, row);
  llvm_index_get_dims(e, &ridx);
  LLVMValueRef dims[KILN_MAX_RANK];
  int nloops = 0;
  for (int d = 0, pos = 0; d < io.rank; d++) {
    if (reduced[d]) {
      dims[d] = NULL;
      if (first->attrs.keepdims) pos++;
    } else {
      dims[d] = ridx.dim[pos++];
    }
  }
  LLVMValueRef part = NULL, base;
  if (parts) { /* one loop over this part's rows (the reduced dims, leading) */
    part = row; /* rows == 1: the unit's row is its part */
    LLVMValueRef r0 = LLVMBuildMul(b, part, llvm_i64(e, chunk), "");
    LLVMValueRef r1 = LLVMBuildAdd(b, r0, llvm_i64(e, chunk), "");
    LLVMValueRef all = llvm_i64(e, n_in / n_out);
    r1 = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, r1, all, ""), r1, all, "");
    LLVMValueRef r = llvm_loop_begin(e, &lr[nloops++], r0, r1, "red");
    llvm_index pidx;
    llvm_index_linear(&pidx, &io, r);
    llvm_index_get_dims(e, &pidx);
    for (int d = 0; d < io.rank; d++) dims[d] = pidx.dim[d];
    base = LLVMBuildMul(b, r, llvm_i64(e, inner), "");
  } else {
    for (int d = 0; d < io.rank; d++)
      if (reduced[d]) dims[d] = llvm_loop_begin(e, &lr[nloops++], llvm_i64(e, 0), llvm_i64(e, it->shape[d]), "red");
    llvm_index oidx;
    llvm_index_dims(&oidx, &io, dims);
    base = LLVMBuildMul(b, llvm_index_get_linear(e, &oidx), llvm_i64(e, inner), "");
  }
  jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "col");
  LLVMValueRef col = LLVMBuildAdd(b, j0, jj, "");
  llvm_index xidx;
  if (llvm_group_is_flat(f, g->member, x)) {
    llvm_index_linear(&xidx, it, LLVMBuildAdd(b, base, col, ""));
  } else {
    op_type tt = *it;
    tt.rank = nt;
    for (int d = 0; d < nt; d++) tt.shape[d] = it->shape[it->rank - nt + d];
    llvm_index tidx;
    llvm_index_linear(&tidx, &tt, col);
    llvm_index_get_dims(e, &tidx);
    for (int d = 0; d < nt; d++) dims[io.rank + d] = tidx.dim[d];
    llvm_index_dims(&xidx, it, dims);
  }
  for (int k = 0; k < nr; k++) {
    const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
    LLVMValueRef xv = llvm_emit_value(lg, rk->in[0], &xidx);
    if (!xv) return -1;
    LLVMValueRef a = LLVMBuildGEP2(b, at[k], acc[k], &jj, 1, "");
    LLVMBuildStore(b, llvm_reduce_combine(e, rk->op, it->dtype, LLVMBuildLoad2(b, at[k], a, ""), xv), a);
  }
  if (emit_side_outputs(g, lg, fn, &xidx)) return -1;
  flush_bad(e, lg, bad_slot);
  llvm_group_forget(lg);
  llvm_loop_end(e, &lj);
  while (nloops > 0) llvm_loop_end(e, &lr[--nloops]);
  /* out = acc; a part's partials: the accumulators as they are */
  LLVMValueRef obase = LLVMBuildAdd(b, LLVMBuildMul(b, row, llvm_i64(e, inner), ""), j0, "");
  jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "store");
  for (int k = 0; k < nr; k++) {
    const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
    LLVMValueRef a = LLVMBuildLoad2(b, at[k], LLVMBuildGEP2(b, at[k], acc[k], &jj, 1, ""), "");
    LLVMValueRef i = LLVMBuildAdd(b, obase, jj, "");
    if (parts)
      LLVMBuildStore(b, a, LLVMBuildGEP2(b, at[k], LLVMGetParam(fn, (unsigned)k), &i, 1, ""));
    else
      llvm_emit_store(e, ot->dtype, LLVMGetParam(fn, (unsigned)k), i, llvm_reduce_finish(e, rk->op, it->dtype, a));
  }
  llvm_loop_end(e, &lj);
  llvm_loop_end(e, &lu);
  return 0;
}

/* whether g's outputs are all KILN_ALIGN-aligned (not a scan's rows) */
static bool outs_aligned(const cpu_build *cb, const plan_kernel *g) {
  for (int k = 0; k < g->n_out; k++)
    if (plan_slot_align(&cb->pl, g->out_slot[k]) < KILN_ALIGN) return false;
  return true;
}

enum { NT_TILE = 1024 }; /* elements a streaming kernel computes into L1 before storing them */

/* A kernel of cheap ops waits on memory: streaming stores then save a third
 * of its traffic (measured: x + x on 16M f32, 6.6 -> 10.1 GB/s). One with
 * vector math computes as long as it moves data; there computing tiles,
 * then storing them, overlaps the two worse than plain stores (tanh(x*a+b)*c+x:
 * 6.4 -> 5.0 GB/s), so it does not stream. */
bool cpu_vector_math_op(op_id op) {
  switch (op) {
    case OP_EXP:
    case OP_LOG:
    case OP_LOG1P:
    case OP_SIN:
    case OP_COS:
    case OP_TANH:
    case OP_SIGMOID:
    case OP_POW: return true;
    default: return false;
  }
}

static bool memory_bound(const plan_kernel *g) {
  for (int i = 0; i < g->f->n_instrs; i++)
    if (g->member[i] && (cpu_vector_math_op(g->f->instrs[i].op) || g->f->instrs[i].op == OP_MOD)) return false;
  return true;
}

int64_t cpu_kernel_work(const plan_kernel *g) {
  int64_t most = 1;
  for (int k = 0; k < g->n_out; k++) {
    const ir_instr *d = &g->f->instrs[g->f->def[g->out[k]]];
    int64_t n = plan_type_size(&g->f->types[llvm_op_is_reduce(d->op) ? d->in[0] : g->out[k]]);
    if (n > most) most = n;
  }
  return (most + FLAT_BLOCK - 1) / FLAT_BLOCK * FLAT_BLOCK; /* as a flat kernel's tasks cover it */
}

/* memory_bound, and no dot summing more than a few products per element
 * (an SGD update's batch-1 outer product is cheap) */
bool cpu_cheap_kernel(const plan_kernel *g) {
  const ir_func *f = g->f;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i];
    const op_type *a = in->n_in ? &f->types[in->in[0]] : NULL;
    if (g->member[i] && in->op == OP_DOT && (a->rank == 0 || a->shape[a->rank - 1] > 4)) return false;
  }
  return memory_bound(g);
}

/* A flat kernel's elements [lo, hi) (lo a multiple of FLAT_BLOCK) with
 * streaming stores: each tile of NT_TILE elements is computed into an
 * aligned stack buffer by the ordinary (vectorized) loop, then copied out in
 * 64-byte non-temporal stores, aligned because tiles start at multiples of
 * FLAT_BLOCK; a last partial tile is copied plainly. */
static int emit_streaming(cpu_build *cb, const plan_kernel *g, llvm_group *lg, LLVMValueRef fn, LLVMValueRef lo,
                          LLVMValueRef hi, LLVMValueRef bad_slot) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = g->f;
  const op_type *ot = &f->types[g->out[0]];
  LLVMValueRef tile[8];
  LLVMTypeRef line = LLVMVectorType(e->t_i64, 8); /* 64 bytes */
  for (int k = 0; k < g->n_out; k++) {
    tile[k] = LLVMBuildAlloca(b, LLVMArrayType2(llvm_memory_type(e, f->types[g->out[k]].dtype), NT_TILE), "tile");
    LLVMSetAlignment(tile[k], KILN_ALIGN);
  }
  LLVMValueRef ntiles = LLVMBuildUDiv(b, LLVMBuildAdd(b, LLVMBuildSub(b, hi, lo, ""), llvm_i64(e, NT_TILE - 1), ""),
                                      llvm_i64(e, NT_TILE), "");
  llvm_loop lq, li, lc;
  LLVMValueRef q = llvm_loop_begin(e, &lq, llvm_i64(e, 0), ntiles, "tile");
  LLVMValueRef start = LLVMBuildAdd(b, lo, LLVMBuildMul(b, q, llvm_i64(e, NT_TILE), ""), "");
  LLVMValueRef left = LLVMBuildSub(b, hi, start, "");
  LLVMValueRef full = LLVMBuildICmp(b, LLVMIntSGE, left, llvm_i64(e, NT_TILE), "");
  LLVMValueRef m = LLVMBuildSelect(b, full, llvm_i64(e, NT_TILE), left, "");
  LLVMValueRef i = llvm_loop_begin(e, &li, llvm_i64(e, 0), m, "i");
  llvm_index idx;
  llvm_index_linear(&idx, ot, LLVMBuildAdd(b, start, i, ""));
  for (int k = 0; k < g->n_out; k++) {
    LLVMValueRef v = llvm_emit_value(lg, g->out[k], &idx);
    if (!v) return -1;
    llvm_emit_store(e, f->types[g->out[k]].dtype, tile[k], i, v);
  }
  flush_bad(e, lg, bad_slot);
  llvm_group_forget(lg);
  llvm_loop_end(e, &li);
  LLVMBasicBlockRef stream = LLVMAppendBasicBlockInContext(e->ctx, fn, "stream");
  LLVMBasicBlockRef plain = LLVMAppendBasicBlockInContext(e->ctx, fn, "plain");
  LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->ctx, fn, "next");
  LLVMBuildCondBr(b, full, stream, plain);
  LLVMPositionBuilderAtEnd(b, stream);
  LLVMMetadataRef one = LLVMValueAsMetadata(llvm_i32(e, 1));
  LLVMValueRef nt = LLVMMetadataAsValue(e->ctx, LLVMMDNodeInContext2(e->ctx, &one, 1));
  unsigned nt_kind = LLVMGetMDKindIDInContext(e->ctx, "nontemporal", 11);
  for (int k = 0; k < g->n_out; k++) {
    int64_t es = (int64_t)kiln_dtype_sizes[f->types[g->out[k]].dtype];
    LLVMValueRef dst = LLVMBuildGEP2(b, e->t_i8, LLVMGetParam(fn, (unsigned)k),
                                     (LLVMValueRef[]){LLVMBuildMul(b, start, llvm_i64(e, es), "")}, 1, "");
    LLVMValueRef c = llvm_loop_begin(e, &lc, llvm_i64(e, 0), llvm_i64(e, NT_TILE * es / 64), "line");
    LLVMValueRef ld = LLVMBuildLoad2(b, line, LLVMBuildGEP2(b, line, tile[k], &c, 1, ""), "");
    LLVMSetAlignment(ld, KILN_ALIGN);
    LLVMValueRef st = LLVMBuildStore(b, ld, LLVMBuildGEP2(b, line, dst, &c, 1, ""));
    LLVMSetAlignment(st, KILN_ALIGN);
    LLVMSetMetadata(st, nt_kind, nt);
    llvm_loop_end(e, &lc);
  }
  LLVMBuildBr(b, next);
  LLVMPositionBuilderAtEnd(b, plain);
  for (int k = 0; k < g->n_out; k++) {
    int64_t es = (int64_t)kiln_dtype_sizes[f->types[g->out[k]].dtype];
    LLVMValueRef off = LLVMBuildMul(b, start, llvm_i64(e, es), "");
    LLVMValueRef dst = LLVMBuildGEP2(b, e->t_i8, LLVMGetParam(fn, (unsigned)k), &off, 1, "");
    LLVMBuildMemCpy(b, dst, KILN_ALIGN, tile[k], KILN_ALIGN, LLVMBuildMul(b, m, llvm_i64(e, es), ""));
  }
  LLVMBuildBr(b, next);
  LLVMPositionBuilderAtEnd(b, next);
  llvm_loop_end(e, &lq);
  /* order the streaming stores before the task ends */
  LLVMTypeRef ft;
  LLVMValueRef fence = llvm_intrinsic(e, "llvm.x86.sse.sfence", NULL, 0, &ft);
  llvm_call(e, fence, ft, NULL, 0);
  return 0;
}

/* A kernel that is one transpose of the last two dims of 4-byte elements,
 * both at least 16: moved in 16x16 tiles through registers. */
static const ir_instr *tile_transpose(const plan_kernel *g) {
  const ir_func *f = g->f;
  const ir_instr *t = NULL;
  for (int i = 0; i < f->n_instrs; i++) {
    if (!g->member[i]) continue;
    if (t) return NULL;
    t = &f->instrs[i];
  }
  if (!t || t->op != OP_TRANSPOSE || g->n_out != 1 || g->out[0] != t->out || g->leaf[t->in[0]] < 0) return NULL;
  const op_type *it = &f->types[t->in[0]];
  int r = it->rank;
  if (r < 2 || kiln_dtype_sizes[it->dtype] != 4 || it->shape[r - 1] < 16 || it->shape[r - 2] < 16) return NULL;
  for (int k = 0; k < r - 2; k++)
    if (t->attrs.axes[k] != k) return NULL;
  return t->attrs.axes[r - 2] == r - 1 && t->attrs.axes[r - 1] == r - 2 ? t : NULL;
}

/* 4-byte element at + i (i in elements) */
static LLVMValueRef elem_ptr(llvm_emit *e, LLVMValueRef at, LLVMValueRef i) {
  return LLVMBuildGEP2(e->b, e->t_i32, at, &i, 1, "");
}

/* out[r][c] = in[c][r] for r in [r0, r1), c in [c0, c1), element by element */
static void copy_transposed(llvm_emit *e, LLVMValueRef src, LLVMValueRef dst, LLVMValueRef in0, LLVMValueRef out0,
                            int64_t R, int64_t C, LLVMValueRef r0, LLVMValueRef r1, LLVMValueRef c0,
                            LLVMValueRef c1) {
  LLVMBuilderRef b = e->b;
  llvm_loop lr, lc;
  LLVMValueRef r = llvm_loop_begin(e, &lr, r0, r1, "r");
  LLVMValueRef c = llvm_loop_begin(e, &lc, c0, c1, "c");
  LLVMValueRef from = LLVMBuildAdd(b, in0, LLVMBuildAdd(b, LLVMBuildMul(b, c, llvm_i64(e, R), ""), r, ""), "");
  LLVMValueRef to = LLVMBuildAdd(b, out0, LLVMBuildAdd(b, LLVMBuildMul(b, r, llvm_i64(e, C), ""), c, ""), "");
  LLVMValueRef v = LLVMBuildLoad2(b, e->t_i32, elem_ptr(e, src, from), "");
  LLVMSetAlignment(v, 4);
  LLVMSetAlignment(LLVMBuildStore(b, v, elem_ptr(e, dst, to)), 4);
  llvm_loop_end(e, &lc);
  llvm_loop_end(e, &lr);
}

/* The tile transpose: each task unit is 16 output rows of one matrix of the
 * batch; its full 16x16 tiles go through registers (16 row loads, four
 * butterfly stages of shuffles that swap the off-diagonal b x b blocks of
 * each 2b x 2b block, 16 row stores), the rest element by element. About 4x
 * the gathers of the generic kernel (the MLP step's 256x256 transpose). */
static void emit_transpose_tiles(cpu_build *cb, const plan_kernel *g, const ir_instr *t, LLVMValueRef src,
                                 LLVMValueRef dst, LLVMValueRef begin, LLVMValueRef end, kinfo *ki) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const op_type *it = &g->f->types[t->in[0]];
  int64_t C = it->shape[it->rank - 2], R = it->shape[it->rank - 1], nrb = (R + 15) / 16;
  ki->units = plan_type_size(it) / (C * R) * nrb;
  ki->per_unit = 16 * C;
  LLVMTypeRef vt = LLVMVectorType(e->t_i32, 16);
  llvm_loop lu, lb;
  LLVMValueRef u = llvm_loop_begin(e, &lu, begin, end, "unit");
  LLVMValueRef m = LLVMBuildUDiv(b, u, llvm_i64(e, nrb), "");
  LLVMValueRef r0 = LLVMBuildMul(b, LLVMBuildURem(b, u, llvm_i64(e, nrb), ""), llvm_i64(e, 16), "");
  LLVMValueRef base = LLVMBuildMul(b, m, llvm_i64(e, C * R), ""); /* both matrices start here */
  LLVMValueRef fn = LLVMGetBasicBlockParent(LLVMGetInsertBlock(b));
  LLVMBasicBlockRef tiles = LLVMAppendBasicBlockInContext(e->ctx, fn, "tiles");
  LLVMBasicBlockRef edge = LLVMAppendBasicBlockInContext(e->ctx, fn, "edge");
  LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->ctx, fn, "next");
  LLVMValueRef r16 = LLVMBuildAdd(b, r0, llvm_i64(e, 16), "");
  LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, r16, llvm_i64(e, R), ""), tiles, edge);

  LLVMPositionBuilderAtEnd(b, tiles);
  LLVMValueRef cblk = llvm_loop_begin(e, &lb, llvm_i64(e, 0), llvm_i64(e, C / 16), "cb");
  LLVMValueRef c0 = LLVMBuildMul(b, cblk, llvm_i64(e, 16), ""), row[16];
  for (int k = 0; k < 16; k++) {
    LLVMValueRef c = LLVMBuildAdd(b, c0, llvm_i64(e, k), "");
    LLVMValueRef at = LLVMBuildAdd(b, base, LLVMBuildAdd(b, LLVMBuildMul(b, c, llvm_i64(e, R), ""), r0, ""), "");
    row[k] = LLVMBuildLoad2(b, vt, elem_ptr(e, src, at), "");
    LLVMSetAlignment(row[k], 4);
  }
  for (int w = 8; w >= 1; w /= 2) {
    LLVMValueRef lo_mask[16], hi_mask[16];
    for (int j = 0; j < 16; j++) {
      lo_mask[j] = llvm_i32(e, (j & w) ? 16 + j - w : j);
      hi_mask[j] = llvm_i32(e, (j & w) ? 16 + j : j + w);
    }
    LLVMValueRef lo = LLVMConstVector(lo_mask, 16), hi = LLVMConstVector(hi_mask, 16);
    for (int i = 0; i < 16; i++) {
      if (i & w) continue;
      LLVMValueRef x = row[i], y = row[i + w];
      row[i] = LLVMBuildShuffleVector(b, x, y, lo, "");
      row[i + w] = LLVMBuildShuffleVector(b, x, y, hi, "");
    }
  }
  for (int k = 0; k < 16; k++) {
    LLVMValueRef r = LLVMBuildAdd(b, r0, llvm_i64(e, k), "");
    LLVMValueRef at = LLVMBuildAdd(b, base, LLVMBuildAdd(b, LLVMBuildMul(b, r, llvm_i64(e, C), ""), c0, ""), "");
    LLVMSetAlignment(LLVMBuildStore(b, row[k], elem_ptr(e, dst, at)), 4);
  }
  llvm_loop_end(e, &lb);
  if (C % 16)
    copy_transposed(e, src, dst, base, base, R, C, r0, r16, llvm_i64(e, C / 16 * 16), llvm_i64(e, C));
  LLVMBuildBr(b, next);

  LLVMPositionBuilderAtEnd(b, edge); /* the last rows, fewer than 16 */
  copy_transposed(e, src, dst, base, base, R, C, r0, llvm_i64(e, R), llvm_i64(e, 0), llvm_i64(e, C));
  LLVMBuildBr(b, next);
  LLVMPositionBuilderAtEnd(b, next);
  llvm_loop_end(e, &lu);
}

/* Whether g reads some input across its rows: a transpose that brings a
 * dim other than the input's innermost (of more than one element) to the
 * output's innermost, so consecutive output elements lie a row apart. */
static bool reads_across_rows(const plan_kernel *g) {
  const ir_func *f = g->f;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i];
    if (!g->member[i] || in->op != OP_TRANSPOSE) continue;
    const op_type *it = &f->types[in->in[0]];
    int r = it->rank;
    if (r >= 2 && in->attrs.axes[r - 1] != r - 1 && it->shape[r - 1] > 1) return true;
  }
  return false;
}

/* Stores each of g's outputs at idx (linear index at) */
static int emit_outputs(const plan_kernel *g, llvm_group *lg, LLVMValueRef fn, llvm_index *idx, LLVMValueRef at) {
  return emit_outputs_from(g, lg, fn, 0, g->n_out, idx, at);
}

/* ---- packed rows: short rows, expensive elementwise tails ---- */

enum {
  PACK_ELEMS = 512, /* elements of a packed block (per frontier tile) */
  PACK_MAX = 8,     /* frontier values at most */
};

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    int64_t t = a % b;
    a = b, b = t;
  }
  return a;
}

/* ops whose vector code is long (a division, a polynomial): worth computing
 * with every lane live */
static bool expensive_op(op_id op) { return cpu_vector_math_op(op) || op == OP_DIV; }

typedef struct {
  ir_value v[PACK_MAX];
  int n;
  bool expensive;
} frontier;

/* Whether v is computed from the block's tiles and flat reads alone: a leaf
 * of the output's shape or a single element, a scalar constant, or an
 * elementwise member op of the output's shape whose operands are (values
 * of the output's shape that are not are added to fr: they are computed row
 * by row into tiles). False when the kernel cannot run packed. */
static bool pack_value(const cpu_build *cb, const plan_kernel *g, const op_type *ot, ir_value v, frontier *fr,
                       signed char *state) {
  const ir_func *f = g->f;
  if (state[v]) return state[v] > 0;
  const op_type *t = &f->types[v];
  bool shaped = t->rank == ot->rank && !memcmp(t->shape, ot->shape, (size_t)ot->rank * sizeof ot->shape[0]);
  int d = f->def[v];
  bool ok = false;
  if (g->leaf[v] >= 0) {
    ok = shaped || plan_type_size(t) <= 1;
  } else if (d >= 0 && g->member[d]) {
    const ir_instr *in = &f->instrs[d];
    switch (kiln_ops[in->op].kind) {
      case OPK_CONST: ok = plan_type_size(t) <= 1; break;
      case OPK_UNARY:
      case OPK_BINARY:
      case OPK_COMPARE:
      case OPK_SELECT:
      case OPK_CONVERT:
        ok = shaped;
        for (int k = 0; ok && k < in->n_in; k++) ok = pack_value(cb, g, ot, in->in[k], fr, state);
        if (ok && expensive_op(in->op)) fr->expensive = true;
        break;
      default: break;
    }
    if (!ok && shaped) { /* a tile of its own, if its last op cannot fuse with a consumer (an FMA) */
      bool contracts = cb->e.contract && (in->op == OP_MUL || (in->op == OP_DOT && f->types[in->in[0]].rank > 0 &&
                                                                    f->types[in->in[0]].shape[f->types[in->in[0]].rank - 1] == 1));
      if (!contracts && fr->n < PACK_MAX) {
        fr->v[fr->n++] = v;
        state[v] = 1;
        return true;
      }
    }
  }
  state[v] = ok ? 1 : -1;
  return ok;
}

/* The frontier of a row kernel with short rows (under a 64-byte vector)
 * whose flat tail holds an expensive op; false when it has none. */
static bool packed_rows(const cpu_build *cb, const plan_kernel *g, const op_type *ot, int64_t inner, frontier *fr) {
  const ir_func *f = g->f;
  int64_t es = (int64_t)kiln_dtype_sizes[ot->dtype];
  if (inner * es >= 64 || (64 % (inner * es)) == 0 || plan_type_size(ot) / inner < 2) return false;
  signed char *state = calloc((size_t)f->n_values + 1, 1);
  if (!state) return false;
  memset(fr, 0, sizeof *fr);
  bool ok = true;
  for (int k = 0; k < g->n_out && ok; k++) {
    const op_type *t = &f->types[g->out[k]];
    ok = t->rank == ot->rank && !memcmp(t->shape, ot->shape, (size_t)ot->rank * sizeof ot->shape[0]) &&
         pack_value(cb, g, ot, g->out[k], fr, state);
  }
  free(state);
  return ok && fr->expensive && fr->n > 0;
}

/* Rows [begin, end) of a packed kernel, in blocks of rows: the frontier's
 * values row by row into stack tiles (one short vector per row), then the
 * rest over the block's elements as one flat run (every lane live). Each
 * element's ops are the same as row by row, so are its bits. */
static int emit_packed(cpu_build *cb, const plan_kernel *g, llvm_group *lg, LLVMValueRef fn, const frontier *fr,
                       LLVMValueRef begin, LLVMValueRef end, LLVMValueRef bad_slot) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = g->f;
  const op_type *ot = &f->types[g->out[0]];
  int64_t inner = ot->shape[ot->rank - 1], es = (int64_t)kiln_dtype_sizes[ot->dtype];
  int64_t unit = 64 / gcd64(inner * es, 64); /* rows of a block: whole 64-byte vectors */
  int64_t brows = PACK_ELEMS / inner / unit * unit;
  if (brows < unit) brows = unit;
  LLVMValueRef tile[PACK_MAX];
  for (int k = 0; k < fr->n; k++) {
    tile[k] = LLVMBuildAlloca(b, LLVMArrayType2(llvm_memory_type(e, f->types[fr->v[k]].dtype), (uint64_t)(brows * inner)),
                              "ptile");
    LLVMSetAlignment(tile[k], KILN_ALIGN);
  }
  LLVMValueRef nblocks = LLVMBuildUDiv(
      b, LLVMBuildAdd(b, LLVMBuildSub(b, end, begin, ""), llvm_i64(e, brows - 1), ""), llvm_i64(e, brows), "");
  llvm_loop lq, lr, lj, li;
  LLVMValueRef q = llvm_loop_begin(e, &lq, llvm_i64(e, 0), nblocks, "block");
  LLVMValueRef r0 = LLVMBuildAdd(b, begin, LLVMBuildMul(b, q, llvm_i64(e, brows), ""), "");
  LLVMValueRef r1 = LLVMBuildAdd(b, r0, llvm_i64(e, brows), "");
  r1 = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, r1, end, ""), r1, end, "");
  /* the frontier, row by row */
  LLVMValueRef row = llvm_loop_begin(e, &lr, r0, r1, "prow");
  op_type outer = *ot;
  outer.rank--;
  llvm_index ridx, idx;
  llvm_index_linear(&ridx, &outer, row);
  llvm_index_get_dims(e, &ridx);
  LLVMValueRef dims[KILN_MAX_RANK];
  for (int d = 0; d < outer.rank; d++) dims[d] = ridx.dim[d];
  LLVMValueRef j = llvm_loop_begin(e, &lj, llvm_i64(e, 0), llvm_i64(e, inner), "pj");
  dims[ot->rank - 1] = j;
  llvm_index_dims(&idx, ot, dims);
  idx.linear = LLVMBuildAdd(b, LLVMBuildMul(b, row, llvm_i64(e, inner), ""), j, "");
  LLVMValueRef local = LLVMBuildAdd(b, LLVMBuildMul(b, LLVMBuildSub(b, row, r0, ""), llvm_i64(e, inner), ""), j, "");
  for (int k = 0; k < fr->n; k++) {
    LLVMValueRef v = llvm_emit_value(lg, fr->v[k], &idx);
    if (!v) return -1;
    llvm_emit_store(e, f->types[fr->v[k]].dtype, tile[k], local, v);
  }
  flush_bad(e, lg, bad_slot);
  llvm_group_forget(lg);
  llvm_loop_end(e, &lj);
  llvm_loop_end(e, &lr);
  /* the rest, flat over the block */
  LLVMValueRef base = LLVMBuildMul(b, r0, llvm_i64(e, inner), "");
  LLVMValueRef count = LLVMBuildMul(b, LLVMBuildSub(b, r1, r0, ""), llvm_i64(e, inner), "");
  LLVMValueRef i = llvm_loop_begin(e, &li, llvm_i64(e, 0), count, "pi");
  LLVMValueRef at = LLVMBuildAdd(b, base, i, "");
  llvm_index_linear(&idx, ot, at);
  for (int k = 0; k < fr->n; k++)
    llvm_group_set(lg, fr->v[k], &idx, llvm_emit_load(e, f->types[fr->v[k]].dtype, tile[k], i));
  int rc = emit_outputs(g, lg, fn, &idx, at);
  flush_bad(e, lg, bad_slot);
  llvm_group_forget(lg);
  llvm_loop_end(e, &li);
  llvm_loop_end(e, &lq);
  return rc;
}

int cpu_emit_kernel(cpu_build *cb, const plan_kernel *g, int id, kinfo *ki) {
  llvm_emit *e = &cb->e;
  const ir_func *f = g->f;
  memset(ki, 0, sizeof *ki);
  ki->buf_slot = malloc(((size_t)g->n_out + (size_t)f->n_values + 1) * sizeof *ki->buf_slot);
  LLVMTypeRef *params = malloc(((size_t)g->n_out + (size_t)f->n_values + 4) * sizeof *params);
  if (!ki->buf_slot || !params) {
    free(params);
    return cpu_oom();
  }
  for (int k = 0; k < g->n_out; k++) ki->buf_slot[ki->n_bufs++] = g->out_slot[k];
  for (int v = 0; v < f->n_values; v++) {
    if (g->leaf[v] < 0) continue;
    bool seen = false;
    for (int k = 0; k < ki->n_bufs && !seen; k++) seen = ki->buf_slot[k] == g->leaf[v];
    if (!seen) ki->buf_slot[ki->n_bufs++] = g->leaf[v];
  }
  int nb = ki->n_bufs;
  for (int k = 0; k < nb; k++) params[k] = e->t_ptr;
  params[nb] = e->t_ptr;     /* the error flag */
  params[nb + 1] = e->t_i64; /* begin */
  params[nb + 2] = e->t_i64; /* end */
  ki->fn_type = LLVMFunctionType(e->t_void, params, (unsigned)nb + 3, 0);
  free(params);
  char name[32];
  snprintf(name, sizeof name, "kernel%d", id);
  LLVMValueRef fn = ki->fn = LLVMAddFunction(e->mod, name, ki->fn_type);
  LLVMSetLinkage(fn, LLVMInternalLinkage);
  cpu_add_fn_attr(e->ctx, fn, "nounwind");
  cpu_add_target_attrs(e->ctx, fn);
  /* noalias: an output shares its buffer with nothing else (inputs are only
   * read), unless the buffers pass put it over an input that dies here and
   * not exactly in place (exactly_in_place) */
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7), align = LLVMGetEnumAttributeKindForName("align", 5);
  bool *at = NULL;
  if (g->n_out == 1 && !llvm_op_is_reduce(f->instrs[f->def[g->out[0]]].op) &&
      (at = malloc(sizeof *at * ((size_t)f->n_values + 1))))
    plan_at_store_index(g, at);
  for (int k = 0; k < nb; k++) {
    bool alone = true;
    for (int q = 0; q < nb && alone; q++)
      if (q != k && (q < g->n_out || k < g->n_out))
        alone = !slots_overlap(cb, g, ki->buf_slot[k], ki->buf_slot[q]) ||
                exactly_in_place(cb, g, at, ki->buf_slot[k < g->n_out ? k : q], ki->buf_slot[k < g->n_out ? q : k]);
    if (alone) LLVMAddAttributeAtIndex(fn, (unsigned)k + 1, LLVMCreateEnumAttribute(e->ctx, noalias, 0));
    /* tensors, the arena and its offsets are all 64-byte aligned; a scan's
     * rows at the alignment of their size */
    uint64_t al = (uint64_t)plan_slot_align(&cb->pl, ki->buf_slot[k]);
    LLVMAddAttributeAtIndex(fn, (unsigned)k + 1, LLVMCreateEnumAttribute(e->ctx, align, al));
  }
  free(at);
  LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, fn, "entry"));
  LLVMValueRef begin = LLVMGetParam(fn, (unsigned)nb + 1), end = LLVMGetParam(fn, (unsigned)nb + 2);
  LLVMValueRef *buf = calloc((size_t)f->n_values + 1, sizeof *buf);
  if (!buf) return kiln_set_error("cpu: out of memory");
  for (int v = 0; v < f->n_values; v++) {
    if (g->leaf[v] < 0) continue;
    for (int k = 0; k < nb; k++)
      if (ki->buf_slot[k] == g->leaf[v]) buf[v] = LLVMGetParam(fn, (unsigned)k);
  }
  LLVMValueRef bad_slot = LLVMBuildAlloca(e->b, e->t_i1, "bad");
  LLVMBuildStore(e->b, LLVMConstInt(e->t_i1, 0, 0), bad_slot);
  llvm_group lg = {.e = e, .f = f, .buf = buf};
  llvm_group_init(&lg);
  int rc = 0;
  const ir_instr *first = &f->instrs[f->def[g->out[0]]];
  const op_type *ot = &f->types[g->out[0]];
  bool column = is_column(g); /* a reduction that keeps the innermost dim: rows accumulate into a tile */
  const ir_instr *tt = tile_transpose(g);
  if (g->special) { /* the CPU's only kernel of its own: a scan (scan_kernel.c) */
    op_id bad_op = OP_COUNT;
    rc = cpu_emit_scan_kernel(cb, g, fn, buf, begin, end, bad_slot, ki, &bad_op);
    lg.bad_op = bad_op;
  } else if (tt) {
    emit_transpose_tiles(cb, g, tt, buf[tt->in[0]], LLVMGetParam(fn, 0), begin, end, ki);
  } else if (g->pass == 2) {
    rc = emit_combine_columns(cb, g, fn, buf, begin, end, ki);
  } else if (column) {
    rc = emit_reduce_columns(cb, g, &lg, fn, begin, end, bad_slot, ki);
  } else if (llvm_op_is_reduce(first->op)) {
    /* for each output element: loops over the reduced dims */
    ir_value x = first->in[0];
    const op_type *it = &f->types[x];
    int64_t n_out = plan_type_size(ot), n_in = plan_type_size(it);
    ki->units = n_out;
    ki->per_unit = n_out ? n_in / n_out : 0;
    LLVMValueRef acc_slot[64];
    LLVMTypeRef acc_type[64];
    int nr = g->n_out - g->n_side; /* the reductions, then the side outputs */
    if (nr > 64) {
      free(buf);
      return kiln_set_error("cpu: @%s: a kernel with more than 64 reductions", cb->f->name);
    }
    for (int k = 0; k < nr; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      acc_type[k] = llvm_reduce_type(e, rk->op, it->dtype);
      acc_slot[k] = LLVMBuildAlloca(e->b, acc_type[k], "acc");
    }
    llvm_loop lo;
    LLVMValueRef o = llvm_loop_begin(e, &lo, begin, end, "out");
    for (int k = 0; k < nr; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      LLVMBuildStore(e->b, llvm_reduce_identity(e, rk->op, it->dtype), acc_slot[k]);
    }
    bool trailing = true, reduced[KILN_MAX_RANK];
    for (int k = 0; k < first->attrs.naxes; k++)
      trailing = trailing && first->attrs.axes[k] == it->rank - first->attrs.naxes + k;
    llvm_index oidx, xidx;
    llvm_index_linear(&oidx, ot, o);
    llvm_loop loops[KILN_MAX_RANK];
    int nloops = 0;
    if (trailing && llvm_group_is_flat(f, g->member, x)) { /* one loop over a contiguous run */
      int64_t span = ki->per_unit;
      LLVMValueRef base = LLVMBuildMul(e->b, o, llvm_i64(e, span), "");
      LLVMValueRef r = llvm_loop_begin(e, &loops[nloops++], llvm_i64(e, 0), llvm_i64(e, span), "red");
      llvm_index_linear(&xidx, it, LLVMBuildAdd(e->b, base, r, ""));
    } else {
      LLVMValueRef dims[KILN_MAX_RANK];
      reduce_dims(e, first, it, &oidx, dims, reduced);
      for (int d = 0; d < it->rank; d++)
        if (reduced[d])
          dims[d] = llvm_loop_begin(e, &loops[nloops++], llvm_i64(e, 0), llvm_i64(e, it->shape[d]), "red");
      llvm_index_dims(&xidx, it, dims);
    }
    for (int k = 0; k < nr && !rc; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      LLVMValueRef xv = llvm_emit_value(&lg, rk->in[0], &xidx);
      if (!xv) {
        rc = -1;
        break;
      }
      LLVMValueRef acc = LLVMBuildLoad2(e->b, acc_type[k], acc_slot[k], "");
      LLVMBuildStore(e->b, llvm_reduce_combine(e, rk->op, it->dtype, acc, xv), acc_slot[k]);
    }
    if (!rc) rc = emit_side_outputs(g, &lg, fn, &xidx);
    flush_bad(e, &lg, bad_slot);
    llvm_group_forget(&lg);
    while (nloops > 0) llvm_loop_end(e, &loops[--nloops]);
    for (int k = 0; k < nr && !rc; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      LLVMValueRef acc = LLVMBuildLoad2(e->b, acc_type[k], acc_slot[k], "");
      llvm_emit_store(e, ot->dtype, LLVMGetParam(fn, (unsigned)k), o, llvm_reduce_finish(e, rk->op, it->dtype, acc));
    }
    llvm_loop_end(e, &lo);
  } else {
    int64_t n = plan_type_size(ot);
    bool flat = true;
    for (int k = 0; k < g->n_out; k++) flat = flat && llvm_group_is_flat(f, g->member, g->out[k]);
    llvm_index idx;
    llvm_loop lo, li, lt;
    LLVMValueRef at = NULL;
    int64_t inner = ot->rank ? ot->shape[ot->rank - 1] : 1;
    bool rows = !flat && ot->rank > 0 && n > 0;
    /* rows of a few elements (a dot's [batch, 2] output, say): vectors across
     * rows beat one short vector per row */
    bool narrow = rows && inner <= NARROW_ROW && n / inner >= 16;
    /* a transposed read walks its input across rows: tiles of TILE_ROWS rows
     * by TILE_COLS columns keep the input lines they read in L1 meanwhile
     * (row by row, a 256x256 f32 transpose read 16x the matrix from L2) */
    bool tiled = rows && !narrow && reads_across_rows(g) && n / inner >= 2 * TILE_ROWS && inner >= 2 * TILE_ROWS;
    frontier fr;
    if (rows && !narrow && !tiled && inner <= ROW_BLOCK && packed_rows(cb, g, ot, inner, &fr)) {
      ki->units = n / inner;
      ki->per_unit = inner;
      rc = emit_packed(cb, g, &lg, fn, &fr, begin, end, bad_slot);
      goto flat_done;
    }
    int64_t nblk = 1, blk = inner, per_task_rows = tiled ? TILE_ROWS : 1;
    if (!rows) { /* one loop over linear indices, tasks taking whole blocks of FLAT_BLOCK */
      ki->units = (n + FLAT_BLOCK - 1) / FLAT_BLOCK;
      ki->per_unit = FLAT_BLOCK;
      LLVMValueRef lo_i = LLVMBuildMul(e->b, begin, llvm_i64(e, FLAT_BLOCK), "");
      LLVMValueRef hi_i = LLVMBuildMul(e->b, end, llvm_i64(e, FLAT_BLOCK), "");
      hi_i = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, hi_i, llvm_i64(e, n), ""), hi_i, llvm_i64(e, n), "");
      /* an output far bigger than the caches goes around them: nothing reads it
       * from there, and the store then costs no read for ownership */
      if (cb->x86 && plan_type_bytes(ot) >= PF_MIN_BYTES) { /* found by its attribute after the passes */
        LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                                LLVMCreateStringAttribute(e->ctx, PF_ATTR, (unsigned)strlen(PF_ATTR), "", 0));
        cpu_add_fn_attr(e->ctx, fn, "noinline");
      }
      if (cb->x86 && plan_type_bytes(ot) >= NT_MIN_BYTES && g->n_out <= 8 && memory_bound(g) && outs_aligned(cb, g)) {
        rc = emit_streaming(cb, g, &lg, fn, lo_i, hi_i, bad_slot);
        goto flat_done;
      }
      at = llvm_loop_begin(e, &lo, lo_i, hi_i, "i");
      llvm_index_linear(&idx, ot, at);
    } else { /* rows of the innermost dim, a multi-index per row */
      if (inner > ROW_BLOCK) nblk = (inner + ROW_BLOCK - 1) / ROW_BLOCK, blk = ROW_BLOCK;
      if (tiled) nblk = (inner + TILE_COLS - 1) / TILE_COLS, blk = TILE_COLS;
      int64_t nrows = n / inner, groups = (nrows + per_task_rows - 1) / per_task_rows;
      ki->units = groups * nblk;
      ki->per_unit = blk * per_task_rows;
      LLVMValueRef u = llvm_loop_begin(e, &lo, begin, end, "row");
      LLVMValueRef row = u, j0 = llvm_i64(e, 0), j1 = llvm_i64(e, inner);
      if (nblk > 1) {
        row = LLVMBuildUDiv(e->b, u, llvm_i64(e, nblk), "");
        j0 = LLVMBuildMul(e->b, LLVMBuildURem(e->b, u, llvm_i64(e, nblk), ""), llvm_i64(e, blk), "");
        LLVMValueRef j1c = LLVMBuildAdd(e->b, j0, llvm_i64(e, blk), "");
        j1 = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, j1c, j1, ""), j1c, j1, "");
      }
      if (tiled) { /* the rows of this tile */
        LLVMValueRef r0 = LLVMBuildMul(e->b, row, llvm_i64(e, TILE_ROWS), "");
        LLVMValueRef r1 = LLVMBuildAdd(e->b, r0, llvm_i64(e, TILE_ROWS), "");
        LLVMValueRef last = llvm_i64(e, nrows);
        r1 = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, r1, last, ""), r1, last, "");
        row = llvm_loop_begin(e, &lt, r0, r1, "tile");
      }
      op_type outer = *ot;
      outer.rank--;
      llvm_index ridx;
      llvm_index_linear(&ridx, &outer, row);
      llvm_index_get_dims(e, &ridx);
      LLVMValueRef rowbase = LLVMBuildMul(e->b, row, llvm_i64(e, inner), "");
      LLVMValueRef dims[KILN_MAX_RANK];
      for (int d = 0; d < outer.rank; d++) dims[d] = ridx.dim[d];
      if (narrow) { /* every column of the row, unrolled: the row loop vectorizes */
        for (int64_t jc = 0; jc < inner && !rc; jc++) {
          dims[ot->rank - 1] = llvm_i64(e, jc);
          llvm_index_dims(&idx, ot, dims);
          at = idx.linear = LLVMBuildAdd(e->b, rowbase, llvm_i64(e, jc), "");
          rc = emit_outputs(g, &lg, fn, &idx, at);
          llvm_group_forget(&lg);
        }
      } else {
        LLVMValueRef j = llvm_loop_begin(e, &li, j0, j1, "j");
        dims[ot->rank - 1] = j;
        llvm_index_dims(&idx, ot, dims);
        at = idx.linear = LLVMBuildAdd(e->b, rowbase, j, "");
      }
    }
    if (!narrow && !rc) rc = emit_outputs(g, &lg, fn, &idx, at);
    flush_bad(e, &lg, bad_slot);
    llvm_group_forget(&lg);
    if (rows && !narrow) llvm_loop_end(e, &li);
    if (tiled) llvm_loop_end(e, &lt);
    llvm_loop_end(e, &lo);
  flat_done:;
  }
  ki->can_fail = lg.bad_op != OP_COUNT;
  ki->fail_op = lg.bad_op;
  llvm_group_dispose(&lg);
  free(buf);
  if (rc) return -1;
  /* raise the flag once, after the loops */
  if (ki->can_fail) {
    LLVMBasicBlockRef set = LLVMAppendBasicBlockInContext(e->ctx, fn, "fail");
    LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->ctx, fn, "done");
    LLVMBuildCondBr(e->b, LLVMBuildLoad2(e->b, e->t_i1, bad_slot, ""), set, done);
    LLVMPositionBuilderAtEnd(e->b, set);
    LLVMValueRef st = LLVMBuildStore(e->b, llvm_i32(e, 1), LLVMGetParam(fn, (unsigned)nb));
    LLVMSetOrdering(st, LLVMAtomicOrderingMonotonic); /* several tasks may fail at once */
    LLVMSetAlignment(st, 4);
    LLVMBuildBr(e->b, done);
    LLVMPositionBuilderAtEnd(e->b, done);
  }
  LLVMBuildRetVoid(e->b);
  return cpu_emit_task(cb, ki, id);
}

int cpu_emit_task(cpu_build *cb, kinfo *ki, int id) {
  llvm_emit *e = &cb->e;
  int nb = ki->n_bufs;
  char name[32];
  /* the thread pool's task: (ctx = buffers and flag, begin, end) */
  snprintf(name, sizeof name, "kernel%d.task", id);
  ki->task = LLVMAddFunction(e->mod, name, cb->ty_task);
  LLVMSetLinkage(ki->task, LLVMInternalLinkage);
  cpu_add_fn_attr(e->ctx, ki->task, "nounwind");
  cpu_add_target_attrs(e->ctx, ki->task);
  LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, ki->task, "entry"));
  LLVMValueRef *args = malloc(((size_t)nb + 3) * sizeof *args);
  if (!args) return cpu_oom();
  LLVMValueRef ctx = LLVMGetParam(ki->task, 0);
  for (int k = 0; k <= nb; k++) {
    LLVMValueRef ix = llvm_i64(e, k);
    args[k] = LLVMBuildLoad2(e->b, e->t_ptr, LLVMBuildGEP2(e->b, e->t_ptr, ctx, &ix, 1, ""), "");
  }
  args[nb + 1] = LLVMGetParam(ki->task, 1);
  args[nb + 2] = LLVMGetParam(ki->task, 2);
  LLVMBuildCall2(e->b, ki->fn_type, ki->fn, args, (unsigned)nb + 3, "");
  LLVMBuildRetVoid(e->b);
  free(args);
  return 0;
}
