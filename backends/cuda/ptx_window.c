/* ptx_window.c — the GPU kernels of the window ops (OPK_WINDOW, API.md
 * §10): conv2d over NHWC images with HWIO filters (stride, dilation,
 * explicit padding, groups, depthwise included), its input and filter
 * gradients, max and average pooling and their gradients, with the CPU
 * kernels' semantics (lib/kernels_conv.c).
 *
 * Every kernel is a thread per output element in a grid-stride loop (per 4
 * adjacent output channels for conv2d and the filter gradient where a
 * group's channels come in fours: window_vec), and every sum is that
 * thread's own loop in a fixed order: no atomics, the same bits run after
 * run. Simple direct kernels, no shared-memory tiling yet: adjacent threads
 * take adjacent channels, so the image's loads are one address per warp and
 * the filter's (or dy's) are coalesced.
 *   conv2d            y[n,oy,ox,k]  a loop over the taps (ky, kx) inside
 *                     the image and the group's input channels.
 *   backprop_input    dx[n,iy,ix,c] a gather: the taps whose window of
 *                     some output (oy, ox) reads (iy, ix), i.e. iy + pt -
 *                     ky dh a multiple of the stride, and the group's
 *                     output channels.
 *   backprop_filter   df[ky,kx,c,k] a loop over the rows (n, oy) and the
 *                     columns ox. Few filter elements over a big batch
 *                     would leave the GPU idle, so the rows are split into
 *                     `split` ranges (cuda_window_split, the plan's split):
 *                     the first kernel writes a partial sum per (range,
 *                     element) into the arena, a second adds each
 *                     element's partials in range order.
 *   max_pool2d        the window's max; NaN propagates.
 *   avg_pool2d        the window's sum over the image elements it covers
 *                     (the padding never counts), divided by their count.
 *   max_pool2d_grad   dx[n,iy,ix,c] a gather over the windows holding
 *                     (iy, ix), in (oy, ox) order as the CPU adds them:
 *                     each window's max and its count of ties recomputed,
 *                     dy / count added where x equals the max (so ties
 *                     share evenly, as reduce_max's gradient does).
 *   avg_pool2d_grad   dx a gather of dy / count over the windows holding it.
 * The pooling kernels add in the CPU's order and match it bit for bit; the
 * convolutions' sums run in another order than the CPU's GEMM.
 *
 * The element code is target-independent: kiln_debug_cuda_window emits the
 * very same code for the host and runs it in LLVM's interpreter, so the
 * index arithmetic is tested without a GPU. f32 and f64 (the op table). */
#include <llvm-c/Core.h>
#include <llvm-c/ExecutionEngine.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda/compile.h"

enum {
  WIN_WANT_THREADS = 1 << 18, /* a filter gradient splits its rows until it has this many threads (an H100 runs 270k at once) */
  WIN_MIN_ROWS = 4,           /* rows (n, oy) per range at least */
  WIN_MAX_SPLIT = 4096,
};

/* ---- geometry ---- */

typedef struct {
  int64_t n, h, w, c;     /* the image */
  int64_t oh, ow, o;      /* the output of the forward op (o = c for pooling) */
  int64_t kh, kw, cg, og; /* window rows, columns; channels per group in, out */
  int64_t sh, sw, dh, dw, pt, pl;
} wgeom;

/* the geometry of op with inputs in and output out (types the op table
 * inferred) */
static void wgeom_init(wgeom *g, op_id op, const op_attrs *a, const op_type *in0, const op_type *in1,
                       const op_type *out) {
  const op_type *x = NULL, *y = NULL, *f = NULL; /* image, forward output, filter */
  switch (op) {
    case OP_CONV2D: x = in0, f = in1, y = out; break;
    case OP_CONV2D_BP_INPUT: y = in0, f = in1, x = out; break;
    case OP_CONV2D_BP_FILTER: x = in0, y = in1, f = out; break;
    case OP_MAX_POOL2D:
    case OP_AVG_POOL2D: x = in0, y = out; break;
    case OP_MAX_POOL2D_GRAD: x = in0, y = in1; break;
    default: x = out, y = in0; break; /* avg_pool2d_grad */
  }
  *g = (wgeom){.n = x->shape[0], .h = x->shape[1], .w = x->shape[2], .c = x->shape[3], .oh = y->shape[1],
               .ow = y->shape[2], .o = y->shape[3], .sh = a->stride[0], .sw = a->stride[1], .pt = a->padding[0],
               .pl = a->padding[2]};
  if (f) {
    g->kh = f->shape[0], g->kw = f->shape[1], g->cg = f->shape[2];
    g->og = a->groups > 0 ? g->o / a->groups : 0;
    g->dh = a->dilation[0], g->dw = a->dilation[1];
  } else {
    g->kh = a->window[0], g->kw = a->window[1], g->cg = g->og = 1;
    g->dh = g->dw = 1;
  }
}

/* The filter gradient's split: ranges of rows (n, oy), `chunk` rows each,
 * so that split x filter elements is about WIN_WANT_THREADS (1: one pass). */
static void filter_split(const wgeom *g, int64_t elems, int64_t *split, int64_t *chunk) {
  int64_t rows = g->n * g->oh;
  *split = 1, *chunk = rows;
  if (elems <= 0 || rows <= 0) return;
  int64_t want = (WIN_WANT_THREADS + elems - 1) / elems, most = (rows + WIN_MIN_ROWS - 1) / WIN_MIN_ROWS;
  int64_t s = want < most ? want : most;
  if (s > WIN_MAX_SPLIT) s = WIN_MAX_SPLIT;
  if (s < 1) s = 1;
  *chunk = (rows + s - 1) / s;
  *split = (rows + *chunk - 1) / *chunk; /* no empty ranges */
}

/* Output channels per thread of conv2d and of the filter gradient's first
 * pass: 4 where a group's channels come in fours (the 4 share a group, so
 * each image element loaded serves 4 products and the filter's or dy's 4
 * adjacent values load as one vector), else 1. */
static int window_vec(const wgeom *g, op_id op) {
  return (op == OP_CONV2D || op == OP_CONV2D_BP_FILTER) && g->og > 0 && g->og % 4 == 0 ? 4 : 1;
}

static int64_t type_size(const op_type *t) {
  int64_t n = 1;
  for (int d = 0; d < t->rank; d++) n *= t->shape[d];
  return n;
}

int64_t cuda_window_split(const plan_kernel *k) {
  const ir_instr *in = k->special;
  if (!in || in->op != OP_CONV2D_BP_FILTER) return 0;
  const ir_func *f = k->f;
  wgeom g;
  wgeom_init(&g, in->op, &in->attrs, &f->types[in->in[0]], &f->types[in->in[1]], &f->types[in->out]);
  int64_t split, chunk;
  filter_split(&g, type_size(&f->types[in->out]) / window_vec(&g, in->op), &split, &chunk);
  return split > 1 ? split : 0;
}

/* ---- the element code ---- */

/* One kernel's (or one pass's) element code. */
typedef struct {
  llvm_emit *e;
  op_id op;
  kiln_dtype dt;
  LLVMTypeRef t; /* dt's value type */
  wgeom g;
  LLVMValueRef in0, in1, out; /* pointers (pass 2: in0 the partials) */
  int pass;                   /* the filter gradient's: 0 one pass, 1 partials (or the result: split 1), 2 their sum */
  int64_t split, chunk, elems; /* elems: of the output */
  int vec;                     /* conv2d and the filter gradient's first pass: output channels per thread (window_vec) */
} wgen;

static LLVMValueRef I(wgen *w, int64_t v) { return llvm_i64(w->e, v); }
static LLVMValueRef add(wgen *w, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildAdd(w->e->b, a, b, ""); }
static LLVMValueRef sub(wgen *w, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildSub(w->e->b, a, b, ""); }
static LLVMValueRef mul(wgen *w, LLVMValueRef a, int64_t b) { return LLVMBuildMul(w->e->b, a, I(w, b), ""); }
static LLVMValueRef udiv(wgen *w, LLVMValueRef a, int64_t b) { return LLVMBuildUDiv(w->e->b, a, I(w, b), ""); }
static LLVMValueRef urem(wgen *w, LLVMValueRef a, int64_t b) { return LLVMBuildURem(w->e->b, a, I(w, b), ""); }
/* a * s + b */
static LLVMValueRef mad(wgen *w, LLVMValueRef a, int64_t s, LLVMValueRef b) { return add(w, mul(w, a, s), b); }
static LLVMValueRef smax(wgen *w, LLVMValueRef a, LLVMValueRef b) {
  return LLVMBuildSelect(w->e->b, LLVMBuildICmp(w->e->b, LLVMIntSGT, a, b, ""), a, b, "");
}
static LLVMValueRef smin(wgen *w, LLVMValueRef a, LLVMValueRef b) {
  return LLVMBuildSelect(w->e->b, LLVMBuildICmp(w->e->b, LLVMIntSLT, a, b, ""), a, b, "");
}
/* 0 <= a < n (a signed) */
static LLVMValueRef inside(wgen *w, LLVMValueRef a, int64_t n) { return LLVMBuildICmp(w->e->b, LLVMIntULT, a, I(w, n), ""); }
static LLVMValueRef fzero(wgen *w) { return llvm_const_f(w->t, 0); }
static LLVMValueRef load(wgen *w, LLVMValueRef p, LLVMValueRef i) { return llvm_emit_load(w->e, w->dt, p, i); }

static LLVMValueRef with_contract(LLVMValueRef v) {
  if (LLVMIsAInstruction(v) && LLVMCanValueUseFastMathFlags(v)) LLVMSetFastMathFlags(v, LLVMFastMathAllowContract);
  return v;
}
/* acc + a b (the GPU fuses them: contract) */
static LLVMValueRef fmac(wgen *w, LLVMValueRef acc, LLVMValueRef a, LLVMValueRef b) {
  return with_contract(LLVMBuildFAdd(w->e->b, acc, with_contract(LLVMBuildFMul(w->e->b, a, b, "")), ""));
}

/* an alloca of t in the function's entry block (promoted to a register) */
static LLVMValueRef var(wgen *w, LLVMTypeRef t, LLVMValueRef init) {
  llvm_emit *e = w->e;
  LLVMBasicBlockRef entry = LLVMGetEntryBasicBlock(LLVMGetBasicBlockParent(LLVMGetInsertBlock(e->b)));
  LLVMBuilderRef b = LLVMCreateBuilderInContext(e->ctx);
  LLVMValueRef first = LLVMGetFirstInstruction(entry);
  if (first)
    LLVMPositionBuilderBefore(b, first);
  else
    LLVMPositionBuilderAtEnd(b, entry);
  LLVMValueRef v = LLVMBuildAlloca(b, t, "");
  LLVMDisposeBuilder(b);
  LLVMBuildStore(e->b, init, v);
  return v;
}
static LLVMValueRef get(wgen *w, LLVMValueRef v) { return LLVMBuildLoad2(w->e->b, w->t, v, ""); }
static void set(wgen *w, LLVMValueRef v, LLVMValueRef x) { LLVMBuildStore(w->e->b, x, v); }

/* if (cond) { ... }: when_begin leaves the builder in the body, when_end
 * after it */
static LLVMBasicBlockRef when_begin(wgen *w, LLVMValueRef cond) {
  llvm_emit *e = w->e;
  LLVMValueRef fn = LLVMGetBasicBlockParent(LLVMGetInsertBlock(e->b));
  LLVMBasicBlockRef body = LLVMAppendBasicBlockInContext(e->ctx, fn, "then"),
                    after = LLVMAppendBasicBlockInContext(e->ctx, fn, "after");
  LLVMBuildCondBr(e->b, cond, body, after);
  LLVMPositionBuilderAtEnd(e->b, body);
  return after;
}
static void when_end(wgen *w, LLVMBasicBlockRef after) {
  LLVMBuildBr(w->e->b, after);
  LLVMPositionBuilderAtEnd(w->e->b, after);
}

/* i = ((n * a + p) * b + q) * c + r: r, q, p, n from the linear index */
static void split4(wgen *w, LLVMValueRef i, int64_t a, int64_t b, int64_t c, LLVMValueRef *n, LLVMValueRef *p,
                   LLVMValueRef *q, LLVMValueRef *r) {
  *r = urem(w, i, c);
  LLVMValueRef t = udiv(w, i, c);
  *q = urem(w, t, b);
  t = udiv(w, t, b);
  *p = urem(w, t, a);
  *n = udiv(w, t, a);
}

/* the image's linear index of (n, iy, ix, c) */
static LLVMValueRef at_image(wgen *w, LLVMValueRef n, LLVMValueRef iy, LLVMValueRef ix, LLVMValueRef c) {
  const wgeom *g = &w->g;
  return mad(w, mad(w, mad(w, n, g->h, iy), g->w, ix), g->c, c);
}
/* the forward output's linear index of (n, oy, ox, k) */
static LLVMValueRef at_out(wgen *w, LLVMValueRef n, LLVMValueRef oy, LLVMValueRef ox, LLVMValueRef k) {
  const wgeom *g = &w->g;
  return mad(w, mad(w, mad(w, n, g->oh, oy), g->ow, ox), g->o, k);
}

/* y[n,oy,ox,k .. k+vec-1] (item i: outputs i vec ..) = sums over the taps
 * inside the image and the group's channels; stored here */
static void conv_element(wgen *w, LLVMValueRef i) {
  const wgeom *g = &w->g;
  int vec = w->vec;
  LLVMValueRef first = mul(w, i, vec), n, oy, ox, k;
  split4(w, first, g->oh, g->ow, g->o, &n, &oy, &ox, &k);
  LLVMValueRef cbase = mul(w, udiv(w, k, g->og), g->cg); /* the group's first input channel */
  LLVMValueRef acc[4];
  for (int j = 0; j < vec; j++) acc[j] = var(w, w->t, fzero(w));
  llvm_loop ly, lx, lc;
  LLVMValueRef ky = llvm_loop_begin(w->e, &ly, I(w, 0), I(w, g->kh), "ky");
  LLVMValueRef iy = add(w, mul(w, oy, g->sh), sub(w, mul(w, ky, g->dh), I(w, g->pt)));
  LLVMBasicBlockRef y_ok = when_begin(w, inside(w, iy, g->h));
  LLVMValueRef kx = llvm_loop_begin(w->e, &lx, I(w, 0), I(w, g->kw), "kx");
  LLVMValueRef ix = add(w, mul(w, ox, g->sw), sub(w, mul(w, kx, g->dw), I(w, g->pl)));
  LLVMBasicBlockRef x_ok = when_begin(w, inside(w, ix, g->w));
  LLVMValueRef xb = at_image(w, n, iy, ix, cbase);
  LLVMValueRef fb = add(w, mul(w, mad(w, ky, g->kw, kx), g->cg * g->o), k); /* f[ky, kx, 0, k] */
  LLVMValueRef c = llvm_loop_begin(w->e, &lc, I(w, 0), I(w, g->cg), "c");
  LLVMValueRef xv = load(w, w->in0, add(w, xb, c)), fc = mad(w, c, g->o, fb);
  for (int j = 0; j < vec; j++) set(w, acc[j], fmac(w, get(w, acc[j]), xv, load(w, w->in1, add(w, fc, I(w, j)))));
  llvm_loop_end(w->e, &lc);
  when_end(w, x_ok);
  llvm_loop_end(w->e, &lx);
  when_end(w, y_ok);
  llvm_loop_end(w->e, &ly);
  for (int j = 0; j < vec; j++) llvm_emit_store(w->e, w->dt, w->out, add(w, first, I(w, j)), get(w, acc[j]));
}

/* the forward output position o (i64) whose tap (k, dilation d) reads image
 * position p (stride s, padding pad, m outputs): *ok when there is one */
static LLVMValueRef tap_source(wgen *w, LLVMValueRef p, LLVMValueRef k, int64_t d, int64_t s, int64_t pad, int64_t m,
                               LLVMValueRef *ok) {
  LLVMBuilderRef b = w->e->b;
  LLVMValueRef t = sub(w, add(w, p, I(w, pad)), mul(w, k, d));
  LLVMValueRef o = LLVMBuildSDiv(b, t, I(w, s), "");
  *ok = LLVMBuildAnd(b, LLVMBuildICmp(b, LLVMIntSGE, t, I(w, 0), ""),
                     LLVMBuildAnd(b, LLVMBuildICmp(b, LLVMIntEQ, LLVMBuildSRem(b, t, I(w, s), ""), I(w, 0), ""),
                                  LLVMBuildICmp(b, LLVMIntSLT, o, I(w, m), ""), ""),
                     "");
  return o;
}

/* dx[n,iy,ix,ci] = sum over the taps whose window reads it and the group's
 * output channels of dy f */
static LLVMValueRef bp_input_element(wgen *w, LLVMValueRef i) {
  const wgeom *g = &w->g;
  LLVMValueRef n, iy, ix, ci;
  split4(w, i, g->h, g->w, g->c, &n, &iy, &ix, &ci);
  LLVMValueRef grp = udiv(w, ci, g->cg), c = urem(w, ci, g->cg);
  LLVMValueRef kbase = mul(w, grp, g->og); /* the group's first output channel */
  LLVMValueRef acc = var(w, w->t, fzero(w));
  llvm_loop ly, lx, lk;
  LLVMValueRef ky = llvm_loop_begin(w->e, &ly, I(w, 0), I(w, g->kh), "ky"), yok, xok;
  LLVMValueRef oy = tap_source(w, iy, ky, g->dh, g->sh, g->pt, g->oh, &yok);
  LLVMBasicBlockRef y_ok = when_begin(w, yok);
  LLVMValueRef kx = llvm_loop_begin(w->e, &lx, I(w, 0), I(w, g->kw), "kx");
  LLVMValueRef ox = tap_source(w, ix, kx, g->dw, g->sw, g->pl, g->ow, &xok);
  LLVMBasicBlockRef x_ok = when_begin(w, xok);
  LLVMValueRef db = at_out(w, n, oy, ox, kbase);
  LLVMValueRef fb = add(w, mul(w, mad(w, mad(w, ky, g->kw, kx), g->cg, c), g->o), kbase); /* f[ky, kx, c, kbase] */
  LLVMValueRef k = llvm_loop_begin(w->e, &lk, I(w, 0), I(w, g->og), "k");
  set(w, acc, fmac(w, get(w, acc), load(w, w->in0, add(w, db, k)), load(w, w->in1, add(w, fb, k))));
  llvm_loop_end(w->e, &lk);
  when_end(w, x_ok);
  llvm_loop_end(w->e, &lx);
  when_end(w, y_ok);
  llvm_loop_end(w->e, &ly);
  return get(w, acc);
}

/* pass 0 / 1 of df: item i = (range s, elements e .. e+vec-1); the sums
 * over the rows (n, oy) of range s and the columns ox of x dy, stored at
 * s elems + e .. (the result itself for one range) */
static void bp_filter_element(wgen *w, LLVMValueRef i) {
  const wgeom *g = &w->g;
  int vec = w->vec;
  int64_t per = w->elems / vec; /* items per range */
  LLVMValueRef el = mul(w, urem(w, i, per), vec), s = udiv(w, i, per);
  LLVMValueRef ky, kx, c, k;
  split4(w, el, g->kw, g->cg, g->o, &ky, &kx, &c, &k);
  LLVMValueRef ci = mad(w, udiv(w, k, g->og), g->cg, c); /* the image channel */
  LLVMValueRef lo = mul(w, s, w->chunk), hi = smin(w, add(w, lo, I(w, w->chunk)), I(w, g->n * g->oh));
  LLVMValueRef acc[4];
  for (int j = 0; j < vec; j++) acc[j] = var(w, w->t, fzero(w));
  llvm_loop lr, lx;
  LLVMValueRef row = llvm_loop_begin(w->e, &lr, lo, hi, "row");
  LLVMValueRef n = udiv(w, row, g->oh), oy = urem(w, row, g->oh);
  LLVMValueRef iy = add(w, mul(w, oy, g->sh), sub(w, mul(w, ky, g->dh), I(w, g->pt)));
  LLVMBasicBlockRef y_ok = when_begin(w, inside(w, iy, g->h));
  LLVMValueRef ox = llvm_loop_begin(w->e, &lx, I(w, 0), I(w, g->ow), "ox");
  LLVMValueRef ix = add(w, mul(w, ox, g->sw), sub(w, mul(w, kx, g->dw), I(w, g->pl)));
  LLVMBasicBlockRef x_ok = when_begin(w, inside(w, ix, g->w));
  LLVMValueRef xv = load(w, w->in0, at_image(w, n, iy, ix, ci));
  LLVMValueRef db = mad(w, mad(w, row, g->ow, ox), g->o, k);
  for (int j = 0; j < vec; j++) set(w, acc[j], fmac(w, get(w, acc[j]), xv, load(w, w->in1, add(w, db, I(w, j)))));
  when_end(w, x_ok);
  llvm_loop_end(w->e, &lx);
  when_end(w, y_ok);
  llvm_loop_end(w->e, &lr);
  LLVMValueRef at = mad(w, s, w->elems, el);
  for (int j = 0; j < vec; j++) llvm_emit_store(w->e, w->dt, w->out, add(w, at, I(w, j)), get(w, acc[j]));
}

/* pass 2 of df: element i's partials added in range order */
static LLVMValueRef bp_filter_combine(wgen *w, LLVMValueRef i) {
  LLVMValueRef acc = var(w, w->t, load(w, w->in0, i));
  llvm_loop ls;
  LLVMValueRef s = llvm_loop_begin(w->e, &ls, I(w, 1), I(w, w->split), "split");
  set(w, acc, LLVMBuildFAdd(w->e->b, get(w, acc), load(w, w->in0, mad(w, s, w->elems, i)), ""));
  llvm_loop_end(w->e, &ls);
  return get(w, acc);
}

/* the image rows [*y0, *y1) and columns [*x0, *x1) of pooling window (oy, ox) */
static void pool_window(wgen *w, LLVMValueRef oy, LLVMValueRef ox, LLVMValueRef *y0, LLVMValueRef *y1,
                        LLVMValueRef *x0, LLVMValueRef *x1) {
  const wgeom *g = &w->g;
  LLVMValueRef ys = sub(w, mul(w, oy, g->sh), I(w, g->pt)), xs = sub(w, mul(w, ox, g->sw), I(w, g->pl));
  *y0 = smax(w, ys, I(w, 0)), *y1 = smin(w, add(w, ys, I(w, g->kh)), I(w, g->h));
  *x0 = smax(w, xs, I(w, 0)), *x1 = smin(w, add(w, xs, I(w, g->kw)), I(w, g->w));
}

/* the max of channel c of image n over window (oy, ox); NaN wins */
static LLVMValueRef window_max(wgen *w, LLVMValueRef n, LLVMValueRef oy, LLVMValueRef ox, LLVMValueRef c) {
  LLVMBuilderRef b = w->e->b;
  LLVMValueRef y0, y1, x0, x1;
  pool_window(w, oy, ox, &y0, &y1, &x0, &x1);
  LLVMValueRef m = var(w, w->t, llvm_const_f(w->t, -INFINITY));
  llvm_loop ly, lx;
  LLVMValueRef iy = llvm_loop_begin(w->e, &ly, y0, y1, "py");
  LLVMValueRef ix = llvm_loop_begin(w->e, &lx, x0, x1, "px");
  LLVMValueRef v = load(w, w->in0, at_image(w, n, iy, ix, c)), mv = get(w, m);
  LLVMValueRef take = LLVMBuildOr(b, LLVMBuildFCmp(b, LLVMRealOGT, v, mv, ""), LLVMBuildFCmp(b, LLVMRealUNO, v, v, ""), "");
  set(w, m, LLVMBuildSelect(b, take, v, mv, ""));
  llvm_loop_end(w->e, &lx);
  llvm_loop_end(w->e, &ly);
  return get(w, m);
}

static LLVMValueRef pool_element(wgen *w, LLVMValueRef i) {
  const wgeom *g = &w->g;
  LLVMBuilderRef b = w->e->b;
  LLVMValueRef n, oy, ox, c;
  split4(w, i, g->oh, g->ow, g->c, &n, &oy, &ox, &c);
  if (w->op == OP_MAX_POOL2D) return window_max(w, n, oy, ox, c);
  LLVMValueRef y0, y1, x0, x1;
  pool_window(w, oy, ox, &y0, &y1, &x0, &x1);
  LLVMValueRef s = var(w, w->t, fzero(w));
  llvm_loop ly, lx;
  LLVMValueRef iy = llvm_loop_begin(w->e, &ly, y0, y1, "py");
  LLVMValueRef ix = llvm_loop_begin(w->e, &lx, x0, x1, "px");
  set(w, s, LLVMBuildFAdd(b, get(w, s), load(w, w->in0, at_image(w, n, iy, ix, c)), ""));
  llvm_loop_end(w->e, &lx);
  llvm_loop_end(w->e, &ly);
  LLVMValueRef count = LLVMBuildSIToFP(b, LLVMBuildMul(b, sub(w, y1, y0), sub(w, x1, x0), ""), w->t, "");
  return LLVMBuildFDiv(b, get(w, s), count, "");
}

/* the pooling outputs [*lo, *hi) whose windows (kernel k, stride s, padding
 * pad, m outputs) hold image position p */
static void windows_of(wgen *w, LLVMValueRef p, int64_t k, int64_t s, int64_t pad, int64_t m, LLVMValueRef *lo,
                       LLVMValueRef *hi) {
  LLVMBuilderRef b = w->e->b;
  /* o s - pad <= p < o s - pad + k: o >= ceil((p + pad - k + 1) / s), o <= (p + pad) / s */
  LLVMValueRef a = add(w, p, I(w, pad - k + 1));
  LLVMValueRef up = udiv(w, add(w, a, I(w, s - 1)), s);
  *lo = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSGT, a, I(w, 0), ""), up, I(w, 0), "");
  *hi = smin(w, add(w, udiv(w, add(w, p, I(w, pad)), s), I(w, 1)), I(w, m));
}

/* dx[n,iy,ix,c]: over the windows holding it, in (oy, ox) order */
static LLVMValueRef pool_grad_element(wgen *w, LLVMValueRef i) {
  const wgeom *g = &w->g;
  LLVMBuilderRef b = w->e->b;
  bool mx = w->op == OP_MAX_POOL2D_GRAD;
  LLVMValueRef dy = mx ? w->in1 : w->in0;
  LLVMValueRef n, iy, ix, c;
  split4(w, i, g->h, g->w, g->c, &n, &iy, &ix, &c);
  LLVMValueRef xv = mx ? load(w, w->in0, i) : NULL;
  LLVMValueRef oy0, oy1, ox0, ox1;
  windows_of(w, iy, g->kh, g->sh, g->pt, g->oh, &oy0, &oy1);
  windows_of(w, ix, g->kw, g->sw, g->pl, g->ow, &ox0, &ox1);
  LLVMValueRef acc = var(w, w->t, fzero(w));
  llvm_loop ly, lx;
  LLVMValueRef oy = llvm_loop_begin(w->e, &ly, oy0, oy1, "oy");
  LLVMValueRef ox = llvm_loop_begin(w->e, &lx, ox0, ox1, "ox");
  LLVMValueRef gv = load(w, dy, at_out(w, n, oy, ox, c));
  if (mx) {
    /* the window's max and how many elements equal it */
    LLVMValueRef m = window_max(w, n, oy, ox, c);
    LLVMValueRef y0, y1, x0, x1;
    pool_window(w, oy, ox, &y0, &y1, &x0, &x1);
    LLVMValueRef cnt = var(w, w->t, fzero(w));
    llvm_loop lcy, lcx;
    LLVMValueRef py = llvm_loop_begin(w->e, &lcy, y0, y1, "cy");
    LLVMValueRef px = llvm_loop_begin(w->e, &lcx, x0, x1, "cx");
    LLVMValueRef eq = LLVMBuildFCmp(b, LLVMRealOEQ, load(w, w->in0, at_image(w, n, py, px, c)), m, "");
    set(w, cnt, LLVMBuildFAdd(b, get(w, cnt), LLVMBuildUIToFP(b, eq, w->t, ""), ""));
    llvm_loop_end(w->e, &lcx);
    llvm_loop_end(w->e, &lcy);
    LLVMValueRef cv = get(w, cnt);
    LLVMValueRef share = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOGT, cv, fzero(w), ""),
                                         LLVMBuildFDiv(b, gv, cv, ""), fzero(w), "");
    LLVMValueRef mine = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOEQ, xv, m, ""), share, fzero(w), "");
    set(w, acc, LLVMBuildFAdd(b, get(w, acc), mine, ""));
  } else {
    LLVMValueRef y0, y1, x0, x1;
    pool_window(w, oy, ox, &y0, &y1, &x0, &x1);
    LLVMValueRef count = LLVMBuildSIToFP(b, LLVMBuildMul(b, sub(w, y1, y0), sub(w, x1, x0), ""), w->t, "");
    set(w, acc, LLVMBuildFAdd(b, get(w, acc), LLVMBuildFDiv(b, gv, count, ""), ""));
  }
  llvm_loop_end(w->e, &lx);
  llvm_loop_end(w->e, &ly);
  return get(w, acc);
}

/* the items of w's kernel: its threads' work (a thread each) */
static int64_t wgen_items(const wgen *w) {
  if (w->op == OP_CONV2D_BP_FILTER && w->pass != 2) return w->split * (w->elems / w->vec);
  return w->elems / w->vec;
}

/* item i: computed and stored */
static void wgen_element(wgen *w, LLVMValueRef i) {
  LLVMValueRef v;
  switch (w->op) {
    case OP_CONV2D: conv_element(w, i); return;
    case OP_CONV2D_BP_FILTER:
      if (w->pass != 2) {
        bp_filter_element(w, i);
        return;
      }
      v = bp_filter_combine(w, i);
      break;
    case OP_CONV2D_BP_INPUT: v = bp_input_element(w, i); break;
    case OP_MAX_POOL2D:
    case OP_AVG_POOL2D: v = pool_element(w, i); break;
    default: v = pool_grad_element(w, i); break;
  }
  llvm_emit_store(w->e, w->dt, w->out, i, v);
}

/* w for op (of dtype dt) over its types, pass `pass` of a filter gradient
 * split in `split` (as cuda_window_split made it) */
static int wgen_init(wgen *w, llvm_emit *e, op_id op, const op_attrs *a, const op_type *in0, const op_type *in1,
                     const op_type *out, int pass) {
  if (kiln_ops[op].kind != OPK_WINDOW) return kiln_set_error("cuda: %s is not a window op", kiln_ops[op].name);
  if (out->dtype != KILN_F32 && out->dtype != KILN_F64)
    return kiln_set_error("cuda: %s of %s (f32 and f64 only)", kiln_ops[op].name, kiln_dtype_name(out->dtype));
  *w = (wgen){.e = e, .op = op, .dt = out->dtype, .t = llvm_value_type(e, out->dtype), .pass = pass, .split = 1};
  wgeom_init(&w->g, op, a, in0, in1, out);
  w->elems = type_size(out);
  w->chunk = w->g.n * w->g.oh;
  w->vec = pass == 2 ? 1 : window_vec(&w->g, op);
  if (op == OP_CONV2D_BP_FILTER) {
    filter_split(&w->g, w->elems / w->vec, &w->split, &w->chunk);
    if (pass == 0) w->split = 1, w->chunk = w->g.n * w->g.oh; /* the plan took it whole */
  }
  return 0;
}

int cuda_emit_window(kctx *k) {
  cuda_build *cb = k->cb;
  llvm_emit *e = &cb->e;
  const plan_kernel *g = k->g;
  const ir_func *f = g->f;
  /* pass 2 of a split filter gradient is no special: its instruction stores its output */
  const ir_instr *in = g->special ? g->special : &f->instrs[f->def[g->out[0]]];
  const op_type *t1 = in->n_in > 1 ? &f->types[in->in[1]] : NULL;
  wgen w;
  if (wgen_init(&w, e, in->op, &in->attrs, &f->types[in->in[0]], t1, &f->types[in->out], g->pass)) return -1;
  w.in0 = g->pass == 2 ? k->buf[g->out[0]] : k->buf[in->in[0]];
  w.in1 = t1 && g->pass != 2 ? k->buf[in->in[1]] : NULL;
  w.out = k->outp[0];
  if (!w.in0 || (t1 && g->pass != 2 && !w.in1))
    return kiln_set_error("cuda: @%s: internal error: %s has no input buffer", cb->f->name, kiln_ops[in->op].name);
  int64_t items = wgen_items(&w);
  cuda_launch_1d(k->st, items);
  sloop l;
  LLVMValueRef i = cuda_grid_loop_begin(e, &l, items);
  wgen_element(&w, i);
  cuda_grid_loop_end(e, &l);
  return 0;
}

/* ---- the same element code on the host ---- */

static bool same_shape(const op_type *t, const kiln_tensor *x) {
  if (t->rank != x->rank || t->dtype != (kiln_dtype)x->dtype) return false;
  for (int d = 0; d < t->rank; d++)
    if (t->shape[d] != x->shape[d]) return false;
  return true;
}

static op_type type_of(const kiln_tensor *x) {
  op_type t = {(kiln_dtype)x->dtype, x->rank, {0}};
  for (int d = 0; d < x->rank; d++) t.shape[d] = x->shape[d];
  return t;
}

int kiln_debug_cuda_window(op_id op, const op_attrs *a, int n_in, kiln_tensor *const *in, kiln_tensor *out) {
  if (op < 0 || op >= OP_COUNT || kiln_ops[op].kind != OPK_WINDOW)
    return kiln_set_error("cuda: kiln_debug_cuda_window: op %d is not a window op", (int)op);
  if (!a || !in || !out || n_in != kiln_ops[op].arity || n_in < 1 || n_in > 2)
    return kiln_set_error("cuda: kiln_debug_cuda_window: %s: bad arguments", kiln_ops[op].name);
  op_type ts[2], ot;
  for (int q = 0; q < n_in; q++) {
    if (!in[q] || in[q]->device != 0) return kiln_set_error("cuda: kiln_debug_cuda_window: input %d is not on the CPU", q);
    ts[q] = type_of(in[q]);
  }
  if (out->device != 0) return kiln_set_error("cuda: kiln_debug_cuda_window: the output is not on the CPU");
  /* the op table's inference: the output's type must be what it infers */
  if (kiln_ops[op].infer(op, a, n_in, ts, &ot)) return -1;
  if (!same_shape(&ot, out))
    return kiln_set_error("cuda: kiln_debug_cuda_window: %s: the output is not of the inferred type", kiln_ops[op].name);
  void *data[2] = {in[0]->data, n_in > 1 ? in[1]->data : NULL};
  return cuda_host_window(op, a, n_in, ts, &ot, data, out->data);
}

int cuda_host_window(op_id op, const op_attrs *a, int n_in, const op_type *ts, const op_type *ot, void *const *in,
                     void *out) {
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMModuleRef mod = LLVMModuleCreateWithNameInContext("window", ctx);
  llvm_emit e;
  llvm_emit_init(&e, ctx, mod);
  wgen w;
  int rc = wgen_init(&w, &e, op, a, &ts[0], n_in > 1 ? &ts[1] : NULL, ot, op == OP_CONV2D_BP_FILTER ? 1 : 0);
  /* a function per pass: void pass(ptr out, ptr in0, ptr in1), a loop over its items */
  int passes = !rc && op == OP_CONV2D_BP_FILTER && w.split > 1 ? 2 : 1;
  LLVMValueRef fns[2] = {NULL, NULL};
  int64_t items[2] = {0, 0};
  LLVMTypeRef ps[3] = {e.t_ptr, e.t_ptr, e.t_ptr};
  for (int p = 0; !rc && p < passes; p++) {
    char name[16];
    snprintf(name, sizeof name, "pass%d", p + 1);
    fns[p] = LLVMAddFunction(mod, name, LLVMFunctionType(e.t_void, ps, 3, 0));
    LLVMPositionBuilderAtEnd(e.b, LLVMAppendBasicBlockInContext(ctx, fns[p], "entry"));
    wgen pw = w;
    pw.pass = op == OP_CONV2D_BP_FILTER ? p + 1 : 0;
    if (pw.pass == 2) pw.vec = 1;
    pw.out = LLVMGetParam(fns[p], 0), pw.in0 = LLVMGetParam(fns[p], 1), pw.in1 = LLVMGetParam(fns[p], 2);
    items[p] = wgen_items(&pw);
    llvm_loop l;
    LLVMValueRef i = llvm_loop_begin(&e, &l, llvm_i64(&e, 0), llvm_i64(&e, items[p]), "i");
    wgen_element(&pw, i);
    llvm_loop_end(&e, &l);
    LLVMBuildRetVoid(e.b);
  }
  llvm_emit_dispose(&e);
  void *partials = NULL;
  if (!rc && passes == 2 && !(partials = calloc((size_t)(w.split * w.elems) + 1, sizeof(double))))
    rc = kiln_set_error("cuda: out of memory");
  LLVMExecutionEngineRef ee = NULL;
  if (rc)
    LLVMDisposeModule(mod);
  else
    rc = cuda_host_engine(mod, "kiln_debug_cuda_window", &ee);
  if (!rc) {
    for (int p = 0; p < passes; p++) {
      void *o = passes == 2 && p == 0 ? partials : out;
      void *x0 = p == 1 ? partials : in[0], *x1 = n_in > 1 ? in[1] : NULL;
      LLVMGenericValueRef args[3] = {LLVMCreateGenericValueOfPointer(o), LLVMCreateGenericValueOfPointer(x0),
                                     LLVMCreateGenericValueOfPointer(x1)};
      LLVMDisposeGenericValue(LLVMRunFunction(ee, fns[p], 3, args));
      for (int q = 0; q < 3; q++) LLVMDisposeGenericValue(args[q]);
    }
    LLVMDisposeExecutionEngine(ee);
  }
  free(partials);
  LLVMContextDispose(ctx);
  return rc;
}
