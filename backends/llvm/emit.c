/* emit.c — the element emitter shared by the backends: the value of a
 * group's instruction at one index, pulled from its inputs (elementwise
 * ops compute, broadcast / reshape / transpose / slice only remap the
 * index) on an explicit stack, each value once per index however often it
 * is read, plus the pieces of reductions. Every op gives exactly
 * the eager kernels' results (lib/kernels_*.c), bit for bit, except the
 * vector math (vecmath.c: a few ulp) and FMA contraction when asked. */
#include <math.h>
#include <stdlib.h>

#include "llvm_emit.h"

/* ---- set-up and small builders ---- */

void llvm_emit_init(llvm_emit *e, LLVMContextRef ctx, LLVMModuleRef mod) {
  memset(e, 0, sizeof *e);
  e->ctx = ctx;
  e->mod = mod;
  e->b = LLVMCreateBuilderInContext(ctx);
  e->t_void = LLVMVoidTypeInContext(ctx);
  e->t_i1 = LLVMInt1TypeInContext(ctx);
  e->t_i8 = LLVMInt8TypeInContext(ctx);
  e->t_i16 = LLVMInt16TypeInContext(ctx);
  e->t_i32 = LLVMInt32TypeInContext(ctx);
  e->t_i64 = LLVMInt64TypeInContext(ctx);
  e->t_f32 = LLVMFloatTypeInContext(ctx);
  e->t_f64 = LLVMDoubleTypeInContext(ctx);
  e->t_ptr = LLVMPointerTypeInContext(ctx, 0);
}

void llvm_emit_dispose(llvm_emit *e) {
  if (e->b) LLVMDisposeBuilder(e->b);
  e->b = NULL;
}

LLVMTypeRef llvm_value_type(const llvm_emit *e, kiln_dtype dt) {
  switch (dt) {
    case KILN_F32: return e->t_f32;
    case KILN_F64: return e->t_f64;
    case KILN_I32: return e->t_i32;
    case KILN_I64: return e->t_i64;
    case KILN_BOOL: return e->t_i1;
    default: return e->t_i16; /* f16, bf16: their bits */
  }
}

LLVMTypeRef llvm_memory_type(const llvm_emit *e, kiln_dtype dt) {
  return dt == KILN_BOOL ? e->t_i8 : llvm_value_type(e, dt);
}

LLVMValueRef llvm_i64(llvm_emit *e, int64_t v) { return LLVMConstInt(e->t_i64, (unsigned long long)v, 1); }
LLVMValueRef llvm_i32(llvm_emit *e, int32_t v) { return LLVMConstInt(e->t_i32, (unsigned long long)(int64_t)v, 1); }

LLVMValueRef llvm_const_f(LLVMTypeRef t, double v) {
  if (LLVMGetTypeKind(t) == LLVMVectorTypeKind) {
    unsigned n = LLVMGetVectorSize(t);
    LLVMValueRef s = llvm_const_f(LLVMGetElementType(t), v), lanes[64];
    for (unsigned i = 0; i < n && i < 64; i++) lanes[i] = s;
    return LLVMConstVector(lanes, n);
  }
  return LLVMConstReal(t, v);
}

LLVMValueRef llvm_const_i(LLVMTypeRef t, int64_t v) {
  if (LLVMGetTypeKind(t) == LLVMVectorTypeKind) {
    unsigned n = LLVMGetVectorSize(t);
    LLVMValueRef s = llvm_const_i(LLVMGetElementType(t), v), lanes[64];
    for (unsigned i = 0; i < n && i < 64; i++) lanes[i] = s;
    return LLVMConstVector(lanes, n);
  }
  return LLVMConstInt(t, (unsigned long long)v, 1);
}

LLVMValueRef llvm_intrinsic(llvm_emit *e, const char *name, LLVMTypeRef *types, int n, LLVMTypeRef *fn_type) {
  unsigned id = LLVMLookupIntrinsicID(name, strlen(name));
  *fn_type = LLVMIntrinsicGetType(e->ctx, id, types, (size_t)n);
  return LLVMGetIntrinsicDeclaration(e->mod, id, types, (size_t)n);
}

LLVMValueRef llvm_call(llvm_emit *e, LLVMValueRef fn, LLVMTypeRef fn_type, LLVMValueRef *args, int n) {
  return LLVMBuildCall2(e->b, fn_type, fn, args, (unsigned)n, "");
}

/* an intrinsic overloaded on its operand type, applied to n operands */
LLVMValueRef llvm_intr(llvm_emit *e, const char *name, LLVMValueRef *args, int n) {
  LLVMTypeRef t = LLVMTypeOf(args[0]), ft;
  LLVMValueRef fn = llvm_intrinsic(e, name, &t, 1, &ft);
  return llvm_call(e, fn, ft, args, n);
}

LLVMValueRef llvm_loop_begin(llvm_emit *e, llvm_loop *l, LLVMValueRef lo, LLVMValueRef hi, const char *name) {
  LLVMBasicBlockRef pre = LLVMGetInsertBlock(e->b);
  LLVMValueRef fn = LLVMGetBasicBlockParent(pre);
  l->head = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  l->body = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  l->exit = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  LLVMBuildBr(e->b, l->head);
  LLVMPositionBuilderAtEnd(e->b, l->head);
  l->iv = LLVMBuildPhi(e->b, e->t_i64, name);
  LLVMAddIncoming(l->iv, &lo, &pre, 1);
  LLVMBuildCondBr(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, l->iv, hi, ""), l->body, l->exit);
  LLVMPositionBuilderAtEnd(e->b, l->body);
  return l->iv;
}

void llvm_loop_end(llvm_emit *e, llvm_loop *l) {
  LLVMValueRef next = LLVMBuildAdd(e->b, l->iv, llvm_i64(e, 1), "");
  LLVMSetNUW(next, 1);
  LLVMBasicBlockRef latch = LLVMGetInsertBlock(e->b);
  LLVMAddIncoming(l->iv, &next, &latch, 1);
  LLVMBuildBr(e->b, l->head);
  LLVMPositionBuilderAtEnd(e->b, l->exit);
}

/* fast-math flags on an instruction (a folded constant has none) */
static LLVMValueRef with_fmf(LLVMValueRef v, LLVMFastMathFlags f) {
  if (f && LLVMIsAInstruction(v) && LLVMCanValueUseFastMathFlags(v)) LLVMSetFastMathFlags(v, f);
  return v;
}

/* ---- indices ---- */

void llvm_index_linear(llvm_index *x, const op_type *t, LLVMValueRef linear) {
  memset(x, 0, sizeof *x);
  x->rank = t->rank;
  for (int i = 0; i < t->rank; i++) x->shape[i] = t->shape[i];
  x->linear = linear;
}

void llvm_index_dims(llvm_index *x, const op_type *t, const LLVMValueRef *dims) {
  memset(x, 0, sizeof *x);
  x->rank = t->rank;
  for (int i = 0; i < t->rank; i++) x->shape[i] = t->shape[i], x->dim[i] = dims[i];
}

LLVMValueRef llvm_index_get_linear(llvm_emit *e, llvm_index *x) {
  if (x->linear) return x->linear;
  LLVMValueRef lin = NULL;
  int64_t stride = 1;
  for (int i = x->rank - 1; i >= 0; i--) {
    if (x->shape[i] != 1) { /* nuw on what is built here only (the flag bit means "exact" on a udiv) */
      LLVMValueRef term = x->dim[i];
      if (stride != 1) {
        term = LLVMBuildMul(e->b, x->dim[i], llvm_i64(e, stride), "");
        if (LLVMIsAInstruction(term)) LLVMSetNUW(term, 1);
      }
      if (lin) {
        lin = LLVMBuildAdd(e->b, lin, term, "");
        if (LLVMIsAInstruction(lin)) LLVMSetNUW(lin, 1);
      } else {
        lin = term;
      }
    }
    stride *= x->shape[i];
  }
  x->linear = lin ? lin : llvm_i64(e, 0);
  return x->linear;
}

void llvm_index_get_dims(llvm_emit *e, llvm_index *x) {
  bool have = true;
  for (int i = 0; i < x->rank; i++) have = have && x->dim[i];
  if (have) return;
  LLVMValueRef rest = x->linear;
  int last = -1; /* the outermost dim longer than 1 takes the quotient whole */
  for (int i = 0; i < x->rank; i++)
    if (x->shape[i] != 1) {
      last = i;
      break;
    }
  for (int i = x->rank - 1; i >= 0; i--) {
    if (x->shape[i] == 1) {
      x->dim[i] = llvm_i64(e, 0);
    } else if (i == last) {
      x->dim[i] = rest;
    } else {
      LLVMValueRef n = llvm_i64(e, x->shape[i]);
      x->dim[i] = LLVMBuildURem(e->b, rest, n, "");
      rest = LLVMBuildUDiv(e->b, rest, n, "");
    }
  }
}

static int64_t type_size(const op_type *t) {
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

/* The index into an input of type in that NumPy broadcasting reads for
 * output index idx (dims aligned right; a dim of 1 reads element 0). */
static void broadcast_index(llvm_emit *e, llvm_index *idx, const op_type *in, llvm_index *out) {
  int64_t n = type_size(in);
  int64_t m = 1;
  for (int i = 0; i < idx->rank; i++) m *= idx->shape[i];
  if (n == m) { /* only unit dims added or kept: the same linear index */
    llvm_index_linear(out, in, llvm_index_get_linear(e, idx));
    return;
  }
  if (n == 1) {
    llvm_index_linear(out, in, llvm_i64(e, 0));
    return;
  }
  llvm_index_get_dims(e, idx);
  LLVMValueRef dims[KILN_MAX_RANK];
  for (int i = 0; i < in->rank; i++) dims[i] = in->shape[i] == 1 ? llvm_i64(e, 0) : idx->dim[idx->rank - in->rank + i];
  llvm_index_dims(out, in, dims);
}

/* ---- memo: (value, index) -> element, so a value read several times at
 * one index (the diamonds of a DAG of shared values) is emitted once per
 * element: the entries of each value are a list (first[v], then next), so
 * a lookup looks only at v's entries ---- */

typedef struct {
  ir_value v;
  int next; /* v's next entry, or -1 */
  llvm_index idx;
  LLVMValueRef val;
} memo_entry;

/* An operand the emitter still has to compute: value v at idx. */
typedef struct {
  ir_value v;
  llvm_index idx;
} elem_req;

/* A value being emitted: its operands are reqs[req0, req0 + n_req), the
 * first `done` of them computed (their elements in vals[req0, ...)). */
typedef struct {
  ir_value v;
  int req0, n_req, done;
  llvm_index idx;
} emit_frame;

struct llvm_memo {
  memo_entry *e;
  int n, cap;
  int *first; /* per value of the group's function: its newest entry, or -1 */
  /* the emitter's explicit stack (no recursion: a chain of 10,000 ops
   * would overflow the thread's stack) */
  emit_frame *frames;
  int n_frames, cap_frames;
  elem_req *reqs;
  LLVMValueRef *vals;
  int n_reqs, cap_reqs;
};

void llvm_group_init(llvm_group *g) {
  g->bad = NULL;
  g->bad_op = OP_COUNT;
  g->memo = calloc(1, sizeof *g->memo);
  int n = g->f ? g->f->n_values : 0;
  if (g->memo && !(g->memo->first = malloc(((size_t)n + 1) * sizeof *g->memo->first))) {
    free(g->memo);
    g->memo = NULL; /* llvm_emit_value then fails, out of memory */
  }
  for (int v = 0; g->memo && v < n; v++) g->memo->first[v] = -1;
}

void llvm_group_dispose(llvm_group *g) {
  if (g->memo) {
    free(g->memo->e);
    free(g->memo->first);
    free(g->memo->frames);
    free(g->memo->reqs);
    free(g->memo->vals);
  }
  free(g->memo);
  g->memo = NULL;
}

void llvm_group_forget(llvm_group *g) {
  llvm_memo *m = g->memo;
  if (!m) return;
  for (int i = 0; i < m->n; i++) m->first[m->e[i].v] = -1;
  m->n = 0;
}

/* Whether a and b (indices into one value) are the same element: the same
 * linear index, or the same multi-index (either may have been computed
 * since the other was made, so neither needs both). */
static bool same_index(const llvm_index *a, const llvm_index *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  if (a->linear && a->linear == b->linear) return true;
  for (int i = 0; i < a->rank; i++)
    if (!a->dim[i] || a->dim[i] != b->dim[i]) return false;
  return true; /* rank 0: its one element */
}

static LLVMValueRef memo_find(llvm_group *g, ir_value v, const llvm_index *idx) {
  llvm_memo *m = g->memo;
  for (int i = m->first[v]; i >= 0; i = m->e[i].next)
    if (same_index(&m->e[i].idx, idx)) return m->e[i].val;
  return NULL;
}

static void memo_add(llvm_group *g, ir_value v, const llvm_index *idx, LLVMValueRef val) {
  llvm_memo *m = g->memo;
  if (m->n == m->cap) {
    int cap = m->cap ? 2 * m->cap : 32;
    memo_entry *q = realloc(m->e, (size_t)cap * sizeof *q);
    if (!q) return; /* only a lost optimisation */
    m->e = q;
    m->cap = cap;
  }
  m->e[m->n] = (memo_entry){v, m->first[v], *idx, val};
  m->first[v] = m->n++;
}

void llvm_group_set(llvm_group *g, ir_value v, const llvm_index *idx, LLVMValueRef val) {
  if (g->memo) memo_add(g, v, idx, val);
}

/* ---- loads and stores ---- */

LLVMValueRef llvm_emit_load(llvm_emit *e, kiln_dtype dt, LLVMValueRef p, LLVMValueRef i) {
  LLVMTypeRef mt = llvm_memory_type(e, dt);
  LLVMValueRef a = LLVMBuildGEP2(e->b, mt, p, &i, 1, "");
  LLVMValueRef v = LLVMBuildLoad2(e->b, mt, a, "");
  LLVMSetAlignment(v, (unsigned)kiln_dtype_sizes[dt]);
  if (dt == KILN_BOOL) v = LLVMBuildTrunc(e->b, v, e->t_i1, "");
  return v;
}

LLVMValueRef llvm_emit_store(llvm_emit *e, kiln_dtype dt, LLVMValueRef p, LLVMValueRef i, LLVMValueRef v) {
  LLVMTypeRef mt = llvm_memory_type(e, dt);
  if (dt == KILN_BOOL) v = LLVMBuildZExt(e->b, v, e->t_i8, "");
  LLVMValueRef a = LLVMBuildGEP2(e->b, mt, p, &i, 1, "");
  LLVMValueRef s = LLVMBuildStore(e->b, v, a);
  LLVMSetAlignment(s, (unsigned)kiln_dtype_sizes[dt]);
  return s;
}

/* element 0 of a constant tensor as an immediate of dtype dt */
static LLVMValueRef immediate(llvm_emit *e, const kiln_tensor *t) {
  const void *d = t->data;
  switch ((kiln_dtype)t->dtype) {
    case KILN_F32: {
      float f;
      memcpy(&f, d, 4);
      /* through the bits: NaN payloads survive */
      return LLVMConstBitCast(LLVMConstInt(e->t_i32, f32_bits(f), 0), e->t_f32);
    }
    case KILN_F64: {
      uint64_t u;
      memcpy(&u, d, 8);
      return LLVMConstBitCast(LLVMConstInt(e->t_i64, u, 0), e->t_f64);
    }
    case KILN_I32: {
      int32_t v;
      memcpy(&v, d, 4);
      return llvm_i32(e, v);
    }
    case KILN_I64: {
      int64_t v;
      memcpy(&v, d, 8);
      return llvm_i64(e, v);
    }
    case KILN_BOOL: return LLVMConstInt(e->t_i1, *(const uint8_t *)d != 0, 0);
    default: {
      uint16_t h;
      memcpy(&h, d, 2);
      return LLVMConstInt(e->t_i16, h, 0);
    }
  }
}

/* ---- conversions: kernels_convert.c's table, op for op ---- */

static LLVMValueRef ci(LLVMValueRef like, int64_t v) { return llvm_const_i(LLVMTypeOf(like), v); }

/* f16 bits (i16) -> f32, exact, NaN payloads kept (kernels_convert.c f16_f32) */
static LLVMValueRef f16_to_f32(llvm_emit *e, LLVMValueRef h) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef x = LLVMBuildZExt(b, h, e->t_i32, "");
  LLVMValueRef sign = LLVMBuildShl(b, LLVMBuildAnd(b, x, ci(x, 0x8000), ""), ci(x, 16), "");
  LLVMValueRef ex = LLVMBuildAnd(b, LLVMBuildLShr(b, x, ci(x, 10), ""), ci(x, 0x1f), "");
  LLVMValueRef man = LLVMBuildAnd(b, x, ci(x, 0x3ff), "");
  LLVMValueRef man13 = LLVMBuildShl(b, man, ci(x, 13), "");
  LLVMValueRef normal = LLVMBuildOr(
      b, LLVMBuildOr(b, sign, LLVMBuildShl(b, LLVMBuildAdd(b, ex, ci(x, 112), ""), ci(x, 23), ""), ""), man13, "");
  LLVMValueRef inf_nan = LLVMBuildOr(b, LLVMBuildOr(b, sign, ci(x, 0x7f800000), ""), man13, "");
  LLVMValueRef subf = LLVMBuildFMul(b, LLVMBuildUIToFP(b, man, e->t_f32, ""), LLVMConstReal(e->t_f32, 0x1p-24), "");
  LLVMValueRef sub = LLVMBuildOr(b, sign, LLVMBuildBitCast(b, subf, e->t_i32, ""), "");
  LLVMValueRef r = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, ex, ci(x, 0x1f), ""), inf_nan, normal, "");
  r = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntEQ, ex, ci(x, 0), ""), sub, r, "");
  return LLVMBuildBitCast(b, r, e->t_f32, "");
}

/* f32 -> f16 bits, round to nearest even (kernels_convert.c f32_f16) */
static LLVMValueRef f32_to_f16(llvm_emit *e, LLVMValueRef f) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef u = LLVMBuildBitCast(b, f, e->t_i32, "");
  LLVMValueRef sign = LLVMBuildAnd(b, LLVMBuildLShr(b, u, ci(u, 16), ""), ci(u, 0x8000), "");
  LLVMValueRef a = LLVMBuildAnd(b, u, ci(u, 0x7fffffff), "");
  LLVMValueRef inf_nan =
      LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGT, a, ci(u, 0x7f800000), ""), ci(u, 0x7e00), ci(u, 0x7c00), "");
  /* no contraction here: the rounding is the point */
  LLVMValueRef af = LLVMBuildBitCast(b, a, e->t_f32, "");
  LLVMValueRef s =
      LLVMBuildFAdd(b, LLVMBuildFMul(b, af, LLVMConstReal(e->t_f32, 0x1p24), ""), LLVMConstReal(e->t_f32, 0x1p23), "");
  LLVMValueRef subnormal = LLVMBuildSub(b, LLVMBuildBitCast(b, s, e->t_i32, ""), ci(u, 0x4b000000), "");
  LLVMValueRef odd = LLVMBuildAnd(b, LLVMBuildLShr(b, a, ci(u, 13), ""), ci(u, 1), "");
  LLVMValueRef normal = LLVMBuildLShr(
      b, LLVMBuildSub(b, LLVMBuildAdd(b, LLVMBuildAdd(b, a, ci(u, 0xfff), ""), odd, ""), ci(u, 0x38000000), ""),
      ci(u, 13), "");
  LLVMValueRef h = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntULT, a, ci(u, 0x38800000), ""), subnormal, normal, "");
  h = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGE, a, ci(u, 0x477ff000), ""), ci(u, 0x7c00), h, "");
  h = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntUGE, a, ci(u, 0x7f800000), ""), inf_nan, h, "");
  return LLVMBuildTrunc(b, LLVMBuildOr(b, sign, h, ""), e->t_i16, "");
}

static LLVMValueRef bf16_to_f32(llvm_emit *e, LLVMValueRef h) {
  LLVMValueRef x = LLVMBuildZExt(e->b, h, e->t_i32, "");
  return LLVMBuildBitCast(e->b, LLVMBuildShl(e->b, x, ci(x, 16), ""), e->t_f32, "");
}

static LLVMValueRef f32_to_bf16(llvm_emit *e, LLVMValueRef f) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef u = LLVMBuildBitCast(b, f, e->t_i32, "");
  LLVMValueRef hi = LLVMBuildLShr(b, u, ci(u, 16), "");
  LLVMValueRef nan = LLVMBuildOr(b, hi, ci(u, 0x40), "");
  LLVMValueRef rounded = LLVMBuildLShr(
      b, LLVMBuildAdd(b, LLVMBuildAdd(b, u, ci(u, 0x7fff), ""), LLVMBuildAnd(b, hi, ci(u, 1), ""), ""), ci(u, 16), "");
  LLVMValueRef is_nan = LLVMBuildICmp(b, LLVMIntUGT, LLVMBuildAnd(b, u, ci(u, 0x7fffffff), ""), ci(u, 0x7f800000), "");
  return LLVMBuildTrunc(b, LLVMBuildSelect(b, is_nan, nan, rounded, ""), e->t_i16, "");
}

/* f64 -> f32 rounded to odd where inexact (runtime.h f64_to_f32_odd), so
 * that the f16/bf16 rounding after it rounds the f64 value once */
static LLVMValueRef emit_f64_to_f32_odd(llvm_emit *e, LLVMValueRef d) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef f = LLVMBuildFPTrunc(b, d, e->t_f32, "");
  LLVMValueRef back = LLVMBuildFPExt(b, f, e->t_f64, "");
  LLVMValueRef inexact = LLVMBuildFCmp(b, LLVMRealONE, back, d, "");
  LLVMValueRef mag = LLVMConstInt(e->t_i64, 0x7fffffffffffffffULL, 0);
  LLVMValueRef ab = LLVMBuildAnd(b, LLVMBuildBitCast(b, back, e->t_i64, ""), mag, "");
  LLVMValueRef ad = LLVMBuildAnd(b, LLVMBuildBitCast(b, d, e->t_i64, ""), mag, "");
  LLVMValueRef away = LLVMBuildAnd(b, LLVMBuildICmp(b, LLVMIntUGT, ab, ad, ""), inexact, "");
  LLVMValueRef u = LLVMBuildBitCast(b, f, e->t_i32, "");
  u = LLVMBuildSub(b, u, LLVMBuildZExt(b, away, e->t_i32, ""), "");
  u = LLVMBuildOr(b, u, LLVMBuildZExt(b, inexact, e->t_i32, ""), "");
  return LLVMBuildBitCast(b, u, e->t_f32, "");
}

/* i64 -> f64 rounded to odd where inexact (kernels_convert.c i64_f64_odd) */
static LLVMValueRef i64_to_f64_odd(llvm_emit *e, LLVMValueRef x) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef d = LLVMBuildSIToFP(b, x, e->t_f64, "");
  LLVMValueRef top = LLVMBuildFCmp(b, LLVMRealOGE, d, LLVMConstReal(e->t_f64, 0x1p63), "");
  LLVMValueRef back = LLVMBuildSelect(b, top, LLVMConstInt(e->t_i64, 0x7fffffffffffffffULL, 0),
                                      LLVMBuildFPToSI(b, d, e->t_i64, ""), "");
  LLVMValueRef inexact = LLVMBuildOr(b, top, LLVMBuildICmp(b, LLVMIntNE, back, x, ""), "");
  LLVMValueRef neg = LLVMBuildICmp(b, LLVMIntSLT, x, ci(x, 0), "");
  LLVMValueRef away = LLVMBuildSelect(b, neg, LLVMBuildICmp(b, LLVMIntSLT, back, x, ""),
                                      LLVMBuildICmp(b, LLVMIntSGT, back, x, ""), "");
  away = LLVMBuildOr(b, top, away, "");
  LLVMValueRef u = LLVMBuildBitCast(b, d, e->t_i64, "");
  u = LLVMBuildSub(b, u, LLVMBuildZExt(b, away, e->t_i64, ""), "");
  u = LLVMBuildOr(b, u, LLVMBuildZExt(b, inexact, e->t_i64, ""), "");
  return LLVMBuildBitCast(b, u, e->t_f64, "");
}

static LLVMValueRef convert(llvm_emit *e, LLVMValueRef x, kiln_dtype from, kiln_dtype to) {
  LLVMBuilderRef b = e->b;
  if (from == to) return x;
  /* storage-only floats go through f32, as the eager table does */
  if (from == KILN_F16 || from == KILN_BF16) {
    if (to == KILN_BOOL) /* (x & 0x7fff) != 0 */
      return LLVMBuildICmp(b, LLVMIntNE, LLVMBuildAnd(b, x, ci(x, 0x7fff), ""), ci(x, 0), "");
    x = from == KILN_F16 ? f16_to_f32(e, x) : bf16_to_f32(e, x);
    return convert(e, x, KILN_F32, to);
  }
  if (to == KILN_F16 || to == KILN_BF16) {
    if (from == KILN_BOOL)
      return LLVMBuildSelect(b, x, ci(LLVMConstInt(e->t_i16, 0, 0), to == KILN_F16 ? 0x3c00 : 0x3f80),
                             LLVMConstInt(e->t_i16, 0, 0), "");
    /* rounded once: f64 and the integers reach f32 rounded to odd */
    if (from == KILN_I32 || from == KILN_I64)
      x = from == KILN_I64 ? i64_to_f64_odd(e, x) : LLVMBuildSIToFP(b, x, e->t_f64, "");
    if (from != KILN_F32) x = emit_f64_to_f32_odd(e, x);
    return to == KILN_F16 ? f32_to_f16(e, x) : f32_to_bf16(e, x);
  }
  LLVMTypeRef tt = llvm_value_type(e, to);
  bool ff = dtype_is_float(from), tf = dtype_is_float(to);
  if (to == KILN_BOOL)
    return ff ? LLVMBuildFCmp(b, LLVMRealUNE, x, llvm_const_f(LLVMTypeOf(x), 0), "")
              : LLVMBuildICmp(b, LLVMIntNE, x, ci(x, 0), "");
  if (from == KILN_BOOL) return tf ? LLVMBuildUIToFP(b, x, tt, "") : LLVMBuildZExt(b, x, tt, "");
  if (ff && tf) return from == KILN_F32 ? LLVMBuildFPExt(b, x, tt, "") : LLVMBuildFPTrunc(b, x, tt, "");
  if (!ff && !tf) return from == KILN_I32 ? LLVMBuildSExt(b, x, tt, "") : LLVMBuildTrunc(b, x, tt, "");
  if (!ff) return LLVMBuildSIToFP(b, x, tt, "");
  /* float -> int: truncate, saturate, NaN -> 0: exactly fptosi.sat */
  LLVMTypeRef types[2] = {tt, LLVMTypeOf(x)}, ft;
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.fptosi.sat", types, 2, &ft);
  return llvm_call(e, fn, ft, &x, 1);
}

/* ---- elementwise ops ---- */

static LLVMValueRef fcmp(llvm_emit *e, LLVMRealPredicate p, LLVMValueRef x, LLVMValueRef y) {
  return LLVMBuildFCmp(e->b, p, x, y, "");
}
static LLVMValueRef icmp(llvm_emit *e, LLVMIntPredicate p, LLVMValueRef x, LLVMValueRef y) {
  return LLVMBuildICmp(e->b, p, x, y, "");
}
static LLVMValueRef sel(llvm_emit *e, LLVMValueRef c, LLVMValueRef x, LLVMValueRef y) {
  return LLVMBuildSelect(e->b, c, x, y, "");
}

static LLVMValueRef unary(llvm_emit *e, op_id op, kiln_dtype dt, LLVMValueRef x) {
  LLVMBuilderRef b = e->b;
  LLVMTypeRef t = LLVMTypeOf(x);
  bool fl = dtype_is_float(dt);
  switch (op) {
    case OP_NEG: return fl ? LLVMBuildFNeg(b, x, "") : LLVMBuildSub(b, ci(x, 0), x, "");
    case OP_ABS:
      if (fl) return llvm_intr(e, "llvm.fabs", &x, 1);
      return sel(e, icmp(e, LLVMIntSLT, x, ci(x, 0)), LLVMBuildSub(b, ci(x, 0), x, ""), x);
    case OP_SIGN:
      if (fl) /* 0 and NaN give themselves */
        return sel(e, fcmp(e, LLVMRealOGT, x, llvm_const_f(t, 0)), llvm_const_f(t, 1),
                   sel(e, fcmp(e, LLVMRealOLT, x, llvm_const_f(t, 0)), llvm_const_f(t, -1), x));
      return LLVMBuildSub(b, LLVMBuildZExt(b, icmp(e, LLVMIntSGT, x, ci(x, 0)), t, ""),
                          LLVMBuildZExt(b, icmp(e, LLVMIntSLT, x, ci(x, 0)), t, ""), "");
    case OP_RELU:
      if (fl) return sel(e, fcmp(e, LLVMRealOLT, x, llvm_const_f(t, 0)), llvm_const_f(t, 0), x);
      return sel(e, icmp(e, LLVMIntSLT, x, ci(x, 0)), ci(x, 0), x);
    case OP_EXP: return llvm_vm_exp(e, x);
    case OP_LOG: return llvm_vm_log(e, x);
    case OP_LOG1P: return llvm_vm_log1p(e, x);
    case OP_SQRT: return llvm_intr(e, "llvm.sqrt", &x, 1);
    case OP_RSQRT: return LLVMBuildFDiv(b, llvm_const_f(t, 1), llvm_intr(e, "llvm.sqrt", &x, 1), "");
    case OP_SIN: return llvm_vm_sin(e, x);
    case OP_COS: return llvm_vm_cos(e, x);
    case OP_TANH: return llvm_vm_tanh(e, x);
    case OP_SIGMOID: return llvm_vm_sigmoid(e, x);
    case OP_FLOOR: return llvm_intr(e, "llvm.floor", &x, 1);
    case OP_CEIL: return llvm_intr(e, "llvm.ceil", &x, 1);
    case OP_NOT: return LLVMBuildXor(b, x, ci(x, 1), "");
    default: return NULL;
  }
}

/* x ** y for integers, by squaring (unrolled, so it vectorizes); a
 * negative exponent leaves 0 unless |x| == 1 (kernels_elementwise.c) */
static LLVMValueRef int_pow(llvm_emit *e, LLVMValueRef x, LLVMValueRef y) {
  LLVMBuilderRef b = e->b;
  unsigned bits = LLVMGetIntTypeWidth(LLVMTypeOf(x));
  LLVMValueRef r = ci(x, 1), base = x, ex = y;
  for (unsigned k = 0; k < bits - 1; k++) { /* y >= 0 here: its sign bit is clear */
    LLVMValueRef odd = LLVMBuildTrunc(b, ex, e->t_i1, "");
    r = sel(e, odd, LLVMBuildMul(b, r, base, ""), r);
    base = LLVMBuildMul(b, base, base, "");
    ex = LLVMBuildLShr(b, ex, ci(x, 1), "");
  }
  LLVMValueRef yodd = LLVMBuildTrunc(b, y, e->t_i1, "");
  LLVMValueRef neg = sel(e, icmp(e, LLVMIntEQ, x, ci(x, 1)), ci(x, 1),
                         sel(e, icmp(e, LLVMIntEQ, x, ci(x, -1)), sel(e, yodd, ci(x, -1), ci(x, 1)), ci(x, 0)));
  return sel(e, icmp(e, LLVMIntSLT, y, ci(x, 0)), neg, r);
}

static void add_bad(llvm_group *g, op_id op, LLVMValueRef c) {
  g->bad = g->bad ? LLVMBuildOr(g->e->b, g->bad, c, "") : c;
  if (g->bad_op == OP_COUNT) g->bad_op = op;
}

static LLVMValueRef binary(llvm_group *g, op_id op, kiln_dtype dt, LLVMValueRef x, LLVMValueRef y) {
  llvm_emit *e = g->e;
  LLVMBuilderRef b = e->b;
  bool fl = dtype_is_float(dt);
  LLVMFastMathFlags fm = e->contract ? LLVMFastMathAllowContract : 0;
  switch (op) {
    case OP_ADD: return fl ? with_fmf(LLVMBuildFAdd(b, x, y, ""), fm) : LLVMBuildAdd(b, x, y, "");
    case OP_SUB: return fl ? with_fmf(LLVMBuildFSub(b, x, y, ""), fm) : LLVMBuildSub(b, x, y, "");
    case OP_MUL: return fl ? with_fmf(LLVMBuildFMul(b, x, y, ""), fm) : LLVMBuildMul(b, x, y, "");
    case OP_DIV:
    case OP_MOD: {
      if (fl && op == OP_MOD && e->exact_fmod) return llvm_vm_fmod(e, x, y);
      if (fl) return op == OP_DIV ? LLVMBuildFDiv(b, x, y, "") : LLVMBuildFRem(b, x, y, "");
      /* a zero divisor fails the call; -1 is negation (INT_MIN / -1 would
       * trap), so the division itself only ever sees safe divisors */
      LLVMValueRef zero = icmp(e, LLVMIntEQ, y, ci(y, 0)), m1 = icmp(e, LLVMIntEQ, y, ci(y, -1));
      add_bad(g, op, zero);
      LLVMValueRef safe = sel(e, LLVMBuildOr(b, zero, m1, ""), ci(y, 1), y);
      if (op == OP_DIV) return sel(e, m1, LLVMBuildSub(b, ci(x, 0), x, ""), LLVMBuildSDiv(b, x, safe, ""));
      return sel(e, m1, ci(x, 0), LLVMBuildSRem(b, x, safe, ""));
    }
    case OP_POW: return fl ? llvm_vm_pow(e, x, y) : int_pow(e, x, y);
    case OP_MAX:
    case OP_MIN:
      if (dt == KILN_BOOL) return op == OP_MAX ? LLVMBuildOr(b, x, y, "") : LLVMBuildAnd(b, x, y, "");
      if (fl) { /* NaN in either gives NaN, as NumPy's maximum does */
        LLVMValueRef pick =
            LLVMBuildOr(b, fcmp(e, op == OP_MAX ? LLVMRealOGT : LLVMRealOLT, x, y), fcmp(e, LLVMRealUNO, x, x), "");
        return sel(e, pick, x, y);
      }
      return sel(e, icmp(e, op == OP_MAX ? LLVMIntSGT : LLVMIntSLT, x, y), x, y);
    case OP_AND: return LLVMBuildAnd(b, x, y, "");
    case OP_OR: return LLVMBuildOr(b, x, y, "");
    default: break;
  }
  /* compares */
  static const LLVMRealPredicate fp[] = {LLVMRealOEQ, LLVMRealUNE, LLVMRealOLT, LLVMRealOLE, LLVMRealOGT, LLVMRealOGE};
  static const LLVMIntPredicate sp[] = {LLVMIntEQ, LLVMIntNE, LLVMIntSLT, LLVMIntSLE, LLVMIntSGT, LLVMIntSGE};
  static const LLVMIntPredicate up[] = {LLVMIntEQ, LLVMIntNE, LLVMIntULT, LLVMIntULE, LLVMIntUGT, LLVMIntUGE};
  if (op < OP_EQ || op > OP_GE) return NULL;
  int k = op - OP_EQ;
  if (fl) return fcmp(e, fp[k], x, y);
  return icmp(e, dt == KILN_BOOL ? up[k] : sp[k], x, y);
}

/* ---- the element emitter ---- */

LLVMValueRef llvm_splat(llvm_emit *e, int lanes, LLVMValueRef x) {
  if (LLVMGetTypeKind(LLVMTypeOf(x)) == LLVMVectorTypeKind) return x;
  LLVMTypeRef vt = LLVMVectorType(LLVMTypeOf(x), (unsigned)lanes);
  LLVMValueRef v = LLVMBuildInsertElement(e->b, LLVMGetPoison(vt), x, llvm_i32(e, 0), "");
  return LLVMBuildShuffleVector(e->b, v, LLVMGetPoison(vt), LLVMConstNull(LLVMVectorType(e->t_i32, (unsigned)lanes)), "");
}

void llvm_splat_all(llvm_emit *e, int lanes, LLVMValueRef *x, int n) {
  bool any = false;
  for (int i = 0; i < n && !any; i++) any = LLVMGetTypeKind(LLVMTypeOf(x[i])) == LLVMVectorTypeKind;
  for (int i = 0; any && i < n; i++) x[i] = llvm_splat(e, lanes, x[i]);
}

int llvm_emit_outputs(llvm_group *g, int n, const ir_value *vals, LLVMValueRef const *ptrs, llvm_index *idx,
                      LLVMValueRef at) {
  LLVMValueRef *v = malloc(((size_t)n + 1) * sizeof *v);
  if (!v) return kiln_set_error("llvm: out of memory");
  for (int k = 0; k < n; k++)
    if (!(v[k] = llvm_emit_value(g, vals[k], idx))) {
      free(v);
      return -1;
    }
  for (int k = 0; k < n; k++) llvm_emit_store(g->e, g->f->types[vals[k]].dtype, ptrs[k], at, v[k]);
  free(v);
  return 0;
}

/* the same shape (any dtypes) */
static bool same_dims(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int k = 0; k < a->rank; k++)
    if (a->shape[k] != b->shape[k]) return false;
  return true;
}

bool llvm_fusion_one_kernel(const ir_func *c, bool (*dot_ok)(const ir_func *c, const ir_instr *in), bool side_outputs) {
  if (c->n_results < 1) return false;
  const ir_instr *red = NULL;
  for (int i = 0; i < c->n_instrs; i++) {
    const ir_instr *in = &c->instrs[i];
    if (in->op == OP_DOT || in->op == OP_CONV2D) { /* run by the kernel, or before it */
      if (!dot_ok || !dot_ok(c, in)) return false;
    } else if (!llvm_op_fusible(in->op) || in->n_out != 1) {
      return false;
    }
    for (int k = 0; k < in->n_in; k++) {
      const ir_instr *d = ir_def(c, in->in[k]);
      if (d && llvm_op_is_reduce(d->op)) return false; /* a reduction must end the kernel */
    }
    if (llvm_op_is_reduce(in->op)) {
      bool is_result = false;
      for (int r = 0; r < c->n_results; r++) is_result = is_result || c->results[r] == in->out;
      if (!is_result) return false;
      if (red) {
        const op_type *a = &c->types[red->in[0]], *b = &c->types[in->in[0]];
        bool same = a->dtype == b->dtype && /* the kernels accumulate every reduction in one dtype's way */
                    same_dims(a, b) && red->attrs.naxes == in->attrs.naxes && red->attrs.keepdims == in->attrs.keepdims;
        for (int k = 0; same && k < in->attrs.naxes; k++) same = red->attrs.axes[k] == in->attrs.axes[k];
        if (!same) return false;
      }
      red = in;
    }
  }
  const op_type *t0 = NULL; /* the shape of every result but the side outputs */
  for (int r = 0; r < c->n_results; r++) {
    ir_value v = c->results[r];
    const ir_instr *d = ir_def(c, v);
    if (!d) return false;
    for (int q = 0; q < r; q++)
      if (c->results[q] == v) return false;
    const op_type *t = &c->types[v];
    if (red && !llvm_op_is_reduce(d->op)) { /* a side output: over the reductions' input */
      if (!side_outputs || !same_dims(t, &c->types[red->in[0]])) return false;
      continue;
    }
    if (!t0) t0 = t;
    if (!same_dims(t, t0)) return false;
  }
  return true;
}

bool llvm_dot_inline(const ir_func *f, const ir_instr *in) {
  if (in->op != OP_DOT) return false;
  const op_type *at = &f->types[in->in[0]];
  int64_t k = at->shape[at->rank - 1];
  bool dtype_ok = at->dtype == KILN_F32 || at->dtype == KILN_F64 || at->dtype == KILN_I32 || at->dtype == KILN_I64;
  return dtype_ok && k >= 1 && k <= LLVM_DOT_INLINE_K;
}

bool llvm_op_is_reduce(op_id op) {
  return op == OP_REDUCE_SUM || op == OP_REDUCE_PROD || op == OP_REDUCE_MAX || op == OP_REDUCE_MIN;
}

bool llvm_op_fusible(op_id op) {
  switch (kiln_ops[op].kind) {
    case OPK_UNARY:
    case OPK_BINARY:
    case OPK_COMPARE:
    case OPK_SELECT:
    case OPK_CONVERT:
    case OPK_VIEW:
    case OPK_CONST: return true;
    case OPK_MOVE: return op != OP_CONCAT;
    case OPK_SOURCE: return op == OP_IOTA;
    case OPK_REDUCE: return llvm_op_is_reduce(op);
    default: return false;
  }
}

static int fail(const llvm_group *g, ir_value v, const char *why) {
  return kiln_set_error("llvm: @%s: value %d: %s", g->f->name, (int)v, why);
}

/* a transpose that moves only unit dims keeps the elements' order */
static bool transpose_keeps_order(const ir_instr *in, const op_type *rt) {
  int last = -1;
  for (int i = 0; i < rt->rank; i++) {
    if (rt->shape[i] == 1) continue;
    if (in->attrs.axes[i] < last) return false;
    last = in->attrs.axes[i];
  }
  return true;
}

/* One more operand request (value u at idx); false out of memory. */
static bool request(llvm_group *g, ir_value u, const llvm_index *idx) {
  llvm_memo *m = g->memo;
  if (m->n_reqs == m->cap_reqs) {
    int cap = m->cap_reqs ? 2 * m->cap_reqs : 64;
    elem_req *q = realloc(m->reqs, (size_t)cap * sizeof *q);
    if (q) m->reqs = q;
    LLVMValueRef *w = q ? realloc(m->vals, (size_t)cap * sizeof *w) : NULL;
    if (!w) return kiln_set_error("llvm: out of memory"), false;
    m->vals = w;
    m->cap_reqs = cap;
  }
  m->reqs[m->n_reqs++] = (elem_req){u, *idx};
  return true;
}

/* input k of instruction in, requested at the index its result (type rt)
 * is read at (idx), broadcast where the shapes differ */
static bool request_operand(llvm_group *g, const ir_instr *in, int k, const op_type *rt, llvm_index *idx) {
  const op_type *it = &g->f->types[in->in[k]];
  if (same_shape(it, rt)) return request(g, in->in[k], idx);
  llvm_index sub;
  broadcast_index(g->e, idx, it, &sub);
  return request(g, in->in[k], &sub);
}

/* Requests the operands that value v (defined by in) reads at idx, in the
 * order finish_instr takes them; index arithmetic is emitted here. False
 * with the error set when in cannot be part of a kernel. */
static bool request_operands(llvm_group *g, ir_value v, const ir_instr *in, llvm_index *idx) {
  llvm_emit *e = g->e;
  const ir_func *f = g->f;
  const op_type *rt = &f->types[v];
  const op_info *info = &kiln_ops[in->op];
  llvm_index sub;
  switch (info->kind) {
    case OPK_UNARY:
    case OPK_BINARY:
    case OPK_COMPARE:
    case OPK_SELECT:
    case OPK_CONVERT:
      for (int k = 0; k < in->n_in; k++)
        if (!request_operand(g, in, k, rt, idx)) return false;
      return true;
    case OPK_VIEW: /* identity, stop_gradient, reshape: the same elements in order */
      if (same_shape(&f->types[in->in[0]], rt)) return request(g, in->in[0], idx);
      llvm_index_linear(&sub, &f->types[in->in[0]], llvm_index_get_linear(e, idx));
      return request(g, in->in[0], &sub);
    case OPK_CONST:
    case OPK_SOURCE: return true;
    case OPK_MOVE: {
      const op_type *it = &f->types[in->in[0]];
      if (in->op == OP_BROADCAST) {
        broadcast_index(e, idx, it, &sub);
        return request(g, in->in[0], &sub);
      }
      if (type_size(it) == type_size(rt) && (in->op == OP_SLICE || transpose_keeps_order(in, rt))) {
        llvm_index_linear(&sub, it, llvm_index_get_linear(e, idx)); /* the same order: no multi-index */
        return request(g, in->in[0], &sub);
      }
      LLVMValueRef dims[KILN_MAX_RANK];
      if (in->op == OP_TRANSPOSE) {
        llvm_index_get_dims(e, idx);
        for (int i = 0; i < rt->rank; i++) dims[in->attrs.axes[i]] = idx->dim[i];
      } else if (in->op == OP_SLICE) {
        llvm_index_get_dims(e, idx);
        for (int i = 0; i < rt->rank; i++)
          dims[i] =
              in->attrs.begin[i] ? LLVMBuildAdd(e->b, idx->dim[i], llvm_i64(e, in->attrs.begin[i]), "") : idx->dim[i];
      } else {
        break;
      }
      llvm_index_dims(&sub, it, dims);
      return request(g, in->in[0], &sub);
    }
    case OPK_DOT: { /* a[batch, i, k] and b[batch, k, j] for each k, ascending */
      if (!llvm_dot_inline(f, in)) break;
      const op_type *at = &f->types[in->in[0]], *bt = &f->types[in->in[1]];
      int r = rt->rank;
      llvm_index_get_dims(e, idx);
      for (int64_t k = 0; k < at->shape[at->rank - 1]; k++) {
        LLVMValueRef ad[KILN_MAX_RANK], bd[KILN_MAX_RANK];
        for (int d = 0; d < at->rank - 2; d++) /* batch dims broadcast, aligned right */
          ad[d] = at->shape[d] == 1 ? llvm_i64(e, 0) : idx->dim[r - at->rank + d];
        for (int d = 0; d < bt->rank - 2; d++) bd[d] = bt->shape[d] == 1 ? llvm_i64(e, 0) : idx->dim[r - bt->rank + d];
        ad[at->rank - 2] = idx->dim[r - 2];
        ad[at->rank - 1] = llvm_i64(e, k);
        bd[bt->rank - 2] = llvm_i64(e, k);
        bd[bt->rank - 1] = idx->dim[r - 1];
        llvm_index ai, bi;
        llvm_index_dims(&ai, at, ad);
        llvm_index_dims(&bi, bt, bd);
        if (!request(g, in->in[0], &ai) || !request(g, in->in[1], &bi)) return false;
      }
      return true;
    }
    default: break;
  }
  kiln_set_error("llvm: @%s: value %d: %s cannot be part of a kernel", f->name, (int)v, info->name);
  return false;
}

/* The element of v (defined by in) at idx from its operands' elements x
 * (request_operands' order). NULL with the error set. */
static LLVMValueRef finish_instr(llvm_group *g, ir_value v, const ir_instr *in, llvm_index *idx,
                                 LLVMValueRef *x) {
  llvm_emit *e = g->e;
  const ir_func *f = g->f;
  const op_type *rt = &f->types[v];
  const op_info *info = &kiln_ops[in->op];
  kiln_dtype kdt = in->n_in ? f->types[in->in[in->op == OP_SELECT ? 1 : 0]].dtype : rt->dtype;
  LLVMValueRef r = NULL;
  switch (info->kind) {
    case OPK_UNARY: r = unary(e, in->op, kdt, x[0]); break;
    case OPK_BINARY:
    case OPK_COMPARE: r = binary(g, in->op, kdt, x[0], x[1]); break;
    case OPK_SELECT: r = sel(e, x[0], x[1], x[2]); break;
    case OPK_CONVERT: r = convert(e, x[0], kdt, rt->dtype); break;
    case OPK_VIEW:
    case OPK_MOVE: r = x[0]; break;
    case OPK_CONST: {
      const kiln_tensor *t = in->attrs.value;
      if (t->size == 1) return immediate(e, t);
      LLVMValueRef p = e->const_data ? e->const_data(e->user, t) : NULL;
      if (!p) return fail(g, v, "a constant of more than one element has no address here"), NULL;
      return llvm_emit_load(e, (kiln_dtype)t->dtype, p, llvm_index_get_linear(e, idx));
    }
    case OPK_SOURCE: { /* iota: element i is (T)i */
      LLVMValueRef i = llvm_index_get_linear(e, idx);
      return dtype_is_float(rt->dtype) ? LLVMBuildSIToFP(e->b, i, llvm_value_type(e, rt->dtype), "")
                                       : LLVMBuildTrunc(e->b, i, llvm_value_type(e, rt->dtype), "");
    }
    case OPK_DOT: { /* sum over k of a * b, unrolled, k ascending, with FMAs: the eager kernels' rounding */
      const op_type *at = &f->types[in->in[0]];
      for (int64_t k = 0; k < at->shape[at->rank - 1]; k++) {
        LLVMValueRef a = x[2 * k], b = x[2 * k + 1];
        if (!r) {
          r = binary(g, OP_MUL, rt->dtype, a, b);
        } else if (dtype_is_float(rt->dtype)) { /* fused, as the eager matmul kernels accumulate */
          LLVMValueRef args[3] = {a, b, r};
          r = llvm_intr(e, "llvm.fma", args, 3);
        } else {
          r = binary(g, OP_ADD, rt->dtype, r, binary(g, OP_MUL, rt->dtype, a, b));
        }
      }
      break;
    }
    default: break;
  }
  if (!r && !kiln_has_error())
    kiln_set_error("llvm: @%s: value %d: %s cannot be part of a kernel", f->name, (int)v, info->name);
  return r;
}

/* v at idx when it is already known: memoized, or a load from the group's
 * buffer of v (then memoized); else NULL */
static LLVMValueRef known(llvm_group *g, ir_value v, llvm_index *idx) {
  LLVMValueRef r = memo_find(g, v, idx);
  if (r || !g->buf[v]) return r;
  const op_type *t = &g->f->types[v];
  LLVMValueRef i = type_size(t) <= 1 ? llvm_i64(g->e, 0) : llvm_index_get_linear(g->e, idx);
  r = llvm_emit_load(g->e, t->dtype, g->buf[v], i);
  memo_add(g, v, idx, r);
  return r;
}

/* A frame for v at idx, its operands requested; false with the error set. */
static bool push_frame(llvm_group *g, ir_value v, const llvm_index *idx) {
  llvm_memo *m = g->memo;
  int d = g->f->def[v];
  if (d < 0) return fail(g, v, "a parameter with no buffer"), false;
  if (m->n_frames == m->cap_frames) {
    int cap = m->cap_frames ? 2 * m->cap_frames : 32;
    emit_frame *q = realloc(m->frames, (size_t)cap * sizeof *q);
    if (!q) return kiln_set_error("llvm: out of memory"), false;
    m->frames = q;
    m->cap_frames = cap;
  }
  emit_frame *fr = &m->frames[m->n_frames++];
  *fr = (emit_frame){.v = v, .req0 = m->n_reqs, .idx = *idx};
  if (!request_operands(g, v, &g->f->instrs[d], &fr->idx)) return false;
  fr->n_req = m->n_reqs - fr->req0;
  return true;
}

/* Each value is computed once per index (memo) after its operands, with an
 * explicit stack of frames: work and depth are linear in the group's
 * instructions, whatever the sharing. */
LLVMValueRef llvm_emit_value(llvm_group *g, ir_value v, llvm_index *idx) {
  llvm_memo *m = g->memo;
  if (!m) return kiln_set_error("llvm: out of memory"), NULL;
  LLVMValueRef r = known(g, v, idx);
  if (r) return r;
  int base = m->n_frames, req_base = m->n_reqs;
  if (!push_frame(g, v, idx)) goto failed;
  for (;;) {
    emit_frame *fr = &m->frames[m->n_frames - 1];
    if (fr->done < fr->n_req) { /* the next operand: known, or a frame of its own */
      elem_req *q = &m->reqs[fr->req0 + fr->done];
      LLVMValueRef x = known(g, q->v, &q->idx);
      if (x)
        m->vals[fr->req0 + fr->done++] = x;
      else if (!push_frame(g, q->v, &q->idx))
        goto failed;
      continue;
    }
    if (g->lanes > 1) llvm_splat_all(g->e, g->lanes, m->vals + fr->req0, fr->n_req);
    r = finish_instr(g, fr->v, &g->f->instrs[g->f->def[fr->v]], &fr->idx, m->vals + fr->req0);
    if (!r) goto failed;
    memo_add(g, fr->v, &fr->idx, r);
    m->n_reqs = fr->req0;
    if (--m->n_frames == base) return r;
    fr = &m->frames[m->n_frames - 1];
    m->vals[fr->req0 + fr->done++] = r;
  }
failed:
  m->n_frames = base;
  m->n_reqs = req_base;
  return NULL;
}

/* ---- flatness: can the group run over linear indices alone? ---- */

static bool flat_read(const op_type *in, const op_type *out) {
  int64_t n = type_size(in);
  return n == 1 || n == type_size(out);
}

/* whether member instruction in, defining rt, reads its inputs at its own
 * linear index (or at a single element) */
static bool reads_flat(const ir_func *f, const ir_instr *in, const op_type *rt) {
  switch (kiln_ops[in->op].kind) {
    case OPK_UNARY:
    case OPK_BINARY:
    case OPK_COMPARE:
    case OPK_SELECT:
    case OPK_CONVERT:
    case OPK_VIEW: break;
    case OPK_CONST:
    case OPK_SOURCE: return true;
    case OPK_MOVE:
      if (in->op == OP_BROADCAST) break;
      if (in->op == OP_SLICE) {
        if (type_size(&f->types[in->in[0]]) != type_size(rt)) return false;
        break;
      }
      if (in->op == OP_TRANSPOSE) {
        if (!transpose_keeps_order(in, rt)) return false;
        break;
      }
      return false;
    default: return false;
  }
  for (int k = 0; k < in->n_in; k++)
    if (kiln_ops[in->op].kind != OPK_VIEW && in->op != OP_TRANSPOSE && !flat_read(&f->types[in->in[k]], rt))
      return false;
  return true;
}

/* Flat when every member instruction v reaches reads flat: a walk that
 * visits each value once (a DAG of shared values is no tree), with a stack
 * of its own. Out of memory: not flat (the multi-index is always right). */
bool llvm_group_is_flat(const ir_func *f, const bool *member, ir_value v) {
  bool *seen = calloc((size_t)f->n_values + 1, sizeof *seen);
  ir_value *stack = malloc(((size_t)f->n_values + 1) * sizeof *stack);
  bool flat = seen && stack;
  int top = 0;
  if (flat) stack[top++] = v, seen[v] = true;
  while (flat && top > 0) {
    ir_value u = stack[--top];
    int d = f->def[u];
    if (d < 0 || !member[d]) continue;
    const ir_instr *in = &f->instrs[d];
    flat = reads_flat(f, in, &f->types[u]);
    for (int k = 0; flat && k < in->n_in && kiln_ops[in->op].kind != OPK_CONST && kiln_ops[in->op].kind != OPK_SOURCE;
         k++)
      if (!seen[in->in[k]]) seen[in->in[k]] = true, stack[top++] = in->in[k];
  }
  free(seen);
  free(stack);
  return flat;
}

/* ---- reductions ---- */

LLVMTypeRef llvm_reduce_type(llvm_emit *e, op_id op, kiln_dtype dt) {
  if (dt == KILN_F32 && (op == OP_REDUCE_SUM || op == OP_REDUCE_PROD)) return e->t_f64;
  return llvm_value_type(e, dt);
}

LLVMValueRef llvm_reduce_identity(llvm_emit *e, op_id op, kiln_dtype dt) {
  LLVMTypeRef t = llvm_reduce_type(e, op, dt);
  bool fl = dtype_is_float(dt), i32 = dt == KILN_I32;
  switch (op) {
    case OP_REDUCE_SUM: return fl ? llvm_const_f(t, 0) : llvm_const_i(t, 0);
    case OP_REDUCE_PROD: return fl ? llvm_const_f(t, 1) : llvm_const_i(t, 1);
    case OP_REDUCE_MAX: return fl ? llvm_const_f(t, -INFINITY) : llvm_const_i(t, i32 ? INT32_MIN : INT64_MIN);
    default: return fl ? llvm_const_f(t, INFINITY) : llvm_const_i(t, i32 ? INT32_MAX : INT64_MAX);
  }
}

LLVMValueRef llvm_reduce_combine(llvm_emit *e, op_id op, kiln_dtype dt, LLVMValueRef acc, LLVMValueRef x) {
  LLVMBuilderRef b = e->b;
  bool fl = dtype_is_float(dt);
  LLVMTypeRef at = LLVMTypeOf(acc);
  if (fl && LLVMTypeOf(x) != at) x = LLVMBuildFPExt(b, x, at, "");
  LLVMValueRef args[2] = {acc, x};
  /* reassociation lets the vectorizer keep several partial sums (the
   * pairwise-like accuracy of the eager kernels' lanes) */
  LLVMFastMathFlags fm = LLVMFastMathAllowReassoc | LLVMFastMathAllowContract;
  switch (op) {
    case OP_REDUCE_SUM: return fl ? with_fmf(LLVMBuildFAdd(b, acc, x, ""), fm) : LLVMBuildAdd(b, acc, x, "");
    case OP_REDUCE_PROD: return fl ? with_fmf(LLVMBuildFMul(b, acc, x, ""), fm) : LLVMBuildMul(b, acc, x, "");
    case OP_REDUCE_MAX: return llvm_intr(e, fl ? "llvm.maximum" : "llvm.smax", args, 2);
    default: return llvm_intr(e, fl ? "llvm.minimum" : "llvm.smin", args, 2);
  }
}

LLVMValueRef llvm_reduce_finish(llvm_emit *e, op_id op, kiln_dtype dt, LLVMValueRef acc) {
  LLVMTypeRef t = llvm_value_type(e, dt);
  (void)op;
  return LLVMTypeOf(acc) == t ? acc : LLVMBuildFPTrunc(e->b, acc, t, "");
}

/* ---- scan bodies as one element's code (both backends' one-kernel scans) ---- */

/* The body's values at idx (one element of the row, its carries and xs
 * given in the body group's memo): its fusions evaluated in order, each
 * through a group of its own (fg, per instruction of the body), their
 * results given to the body group; then the results into vals. */
int llvm_scan_body_values(const ir_func *body, llvm_group *bg, llvm_group *fg, llvm_index *idx, LLVMValueRef *vals) {
  const op_type *s = &body->types[0];
  for (int i = 0; i < body->n_instrs; i++) {
    const ir_instr *in = &body->instrs[i];
    if (in->op != OP_FUSION) continue;
    const ir_func *c = in->attrs.callee;
    for (int k = 0; k < in->n_in; k++) {
      const op_type *t = &body->types[in->in[k]];
      bool row = t->rank == s->rank;
      for (int d = 0; row && d < t->rank; d++) row = t->shape[d] == s->shape[d];
      if (!row) continue; /* a capture: the fusion reads it from memory */
      LLVMValueRef v = llvm_emit_value(bg, in->in[k], idx);
      if (!v) return -1;
      llvm_group_set(&fg[i], k, idx, v);
    }
    for (int r = 0; r < in->n_out; r++) {
      LLVMValueRef v = llvm_emit_value(&fg[i], c->results[r], idx);
      if (!v) return -1;
      llvm_group_set(bg, in->out + r, idx, v);
    }
  }
  for (int r = 0; r < body->n_results; r++)
    if (!(vals[r] = llvm_emit_value(bg, body->results[r], idx))) return -1;
  return 0;
}
