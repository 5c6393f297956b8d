/* gradients.c — the gradient rule of every differentiable primitive, in the
 * op table's order, written with the public ops so that the backward pass
 * is itself made of ordinary, recordable, traceable ops. A rule gets
 * out = op(in) and dout, and writes dx[i] with in[i]'s shape (NULL = none). */
#include "autodiff.h"
#include "bn_eager.h"
#include "dist.h"

#define X(i) (g->in[i])
#define DOUT (g->dout)
#define OUT (g->out)
#define C(t, v) kiln_scalar_like((t), (v))

#define NEED(i) (g->need[i])

/* -1 when a needed gradient is missing: a primitive failed (error set) */
static int done(const grad_args *g) {
  for (int i = 0; i < g->n; i++)
    if (g->need[i] && !g->dx[i]) return -1;
  return 0;
}

kiln_tensor *grad_unbroadcast(kiln_tensor *grad, const kiln_tensor *like) {
  if (!grad) return NULL;
  bool same = grad->rank == like->rank;
  for (int i = 0; same && i < like->rank; i++) same = grad->shape[i] == like->shape[i];
  if (same) return grad;
  int axes[KILN_MAX_RANK], n = 0, lead = grad->rank - like->rank;
  for (int i = 0; i < grad->rank; i++)
    if (i < lead || (like->shape[i - lead] == 1 && grad->shape[i] != 1)) axes[n++] = i;
  kiln_tensor *s = n ? kiln_reduce_sum(grad, n, axes, true) : grad;
  return kiln_reshape(s, like->rank, like->shape);
}

/* g for a in a (op) b after broadcasting */
#define UNB(t, i) grad_unbroadcast((t), X(i))

/* ---- unary ---- */
static int g_neg(const grad_args *g) { return g->dx[0] = kiln_neg(DOUT), done(g); }
static int g_abs(const grad_args *g) { return g->dx[0] = kiln_mul(DOUT, kiln_sign(X(0))), done(g); }
static int g_exp(const grad_args *g) { return g->dx[0] = kiln_mul(DOUT, OUT), done(g); }
static int g_log(const grad_args *g) { return g->dx[0] = kiln_div(DOUT, X(0)), done(g); }
static int g_log1p(const grad_args *g) {
  return g->dx[0] = kiln_div(DOUT, kiln_add(X(0), C(X(0), 1))), done(g);
}
static int g_sqrt(const grad_args *g) {
  return g->dx[0] = kiln_div(kiln_mul(DOUT, C(OUT, 0.5)), OUT), done(g);
}
static int g_rsqrt(const grad_args *g) { /* d x^-1/2 = -1/2 x^-3/2 = -1/2 out / x */
  return g->dx[0] = kiln_mul(DOUT, kiln_div(kiln_mul(OUT, C(OUT, -0.5)), X(0))), done(g);
}
static int g_sin(const grad_args *g) { return g->dx[0] = kiln_mul(DOUT, kiln_cos(X(0))), done(g); }
static int g_cos(const grad_args *g) {
  return g->dx[0] = kiln_neg(kiln_mul(DOUT, kiln_sin(X(0)))), done(g);
}
static int g_tanh(const grad_args *g) {
  return g->dx[0] = kiln_mul(DOUT, kiln_sub(C(OUT, 1), kiln_square(OUT))), done(g);
}
static int g_sigmoid(const grad_args *g) {
  return g->dx[0] = kiln_mul(DOUT, kiln_mul(OUT, kiln_sub(C(OUT, 1), OUT))), done(g);
}
static int g_relu(const grad_args *g) {
  int rc = relu_eager_grad(DOUT, X(0), &g->dx[0]); /* eagerly: one pass */
  if (rc <= 0) return rc;
  kiln_tensor *pos = kiln_greater(X(0), C(X(0), 0));
  return g->dx[0] = kiln_select(pos, DOUT, C(DOUT, 0)), done(g);
}

/* ---- binary ---- */
static int g_add(const grad_args *g) {
  if (NEED(0)) g->dx[0] = UNB(DOUT, 0);
  if (NEED(1)) g->dx[1] = UNB(DOUT, 1);
  return done(g);
}
static int g_sub(const grad_args *g) {
  if (NEED(0)) g->dx[0] = UNB(DOUT, 0);
  if (NEED(1)) g->dx[1] = UNB(kiln_neg(DOUT), 1);
  return done(g);
}
static int g_mul(const grad_args *g) {
  if (NEED(0)) g->dx[0] = UNB(kiln_mul(DOUT, X(1)), 0);
  if (NEED(1)) g->dx[1] = UNB(kiln_mul(DOUT, X(0)), 1);
  return done(g);
}
static int g_div(const grad_args *g) { /* a/b: 1/b and -a/b^2 = -out/b */
  if (NEED(0)) g->dx[0] = UNB(kiln_div(DOUT, X(1)), 0);
  if (NEED(1)) g->dx[1] = UNB(kiln_neg(kiln_div(kiln_mul(DOUT, OUT), X(1))), 1);
  return done(g);
}
/* a^b: b a^(b-1) (0 where b == 0: at a == 0 that is 0 * inf), and out log a
 * where a > 0 (else 0) */
static int g_pow(const grad_args *g) {
  kiln_tensor *a = X(0), *b = X(1);
  if (NEED(0)) {
    kiln_tensor *d = kiln_mul(DOUT, kiln_mul(b, kiln_pow(a, kiln_sub(b, C(b, 1)))));
    g->dx[0] = UNB(kiln_select(kiln_equal(b, C(b, 0)), C(d, 0), d), 0);
  }
  if (NEED(1)) {
    kiln_tensor *pos = kiln_greater(a, C(a, 0));
    kiln_tensor *loga = kiln_select(pos, kiln_log(kiln_select(pos, a, C(a, 1))), C(a, 0));
    g->dx[1] = UNB(kiln_mul(DOUT, kiln_mul(OUT, loga)), 1);
  }
  return done(g);
}
/* maximum/minimum: the winner takes the gradient, ties split it evenly */
static int g_extremum(const grad_args *g, kiln_tensor *a_wins) {
  kiln_tensor *a = X(0), *b = X(1), *half = kiln_mul(DOUT, C(DOUT, 0.5)), *zero = C(DOUT, 0);
  kiln_tensor *tie = kiln_equal(a, b);
  if (NEED(0)) g->dx[0] = UNB(kiln_select(a_wins, DOUT, kiln_select(tie, half, zero)), 0);
  if (NEED(1)) g->dx[1] = UNB(kiln_select(a_wins, zero, kiln_select(tie, half, DOUT)), 1);
  return done(g);
}
static int g_max(const grad_args *g) { return g_extremum(g, kiln_greater(X(0), X(1))); }
static int g_min(const grad_args *g) { return g_extremum(g, kiln_less(X(0), X(1))); }
static int g_mod(const grad_args *g) { /* fmod(a, b) = a - trunc(a/b) b */
  kiln_tensor *q = kiln_div(X(0), X(1));
  kiln_tensor *trunc = kiln_select(kiln_less(q, C(q, 0)), kiln_ceil(q), kiln_floor(q));
  if (NEED(0)) g->dx[0] = UNB(DOUT, 0);
  if (NEED(1)) g->dx[1] = UNB(kiln_neg(kiln_mul(DOUT, trunc)), 1);
  return done(g);
}

static int g_select(const grad_args *g) {
  kiln_tensor *zero = C(DOUT, 0);
  g->dx[0] = NULL;
  if (NEED(1)) g->dx[1] = UNB(kiln_select(X(0), DOUT, zero), 1);
  if (NEED(2)) g->dx[2] = UNB(kiln_select(X(0), zero, DOUT), 2);
  return done(g);
}

static int g_convert(const grad_args *g) {
  kiln_dtype from = (kiln_dtype)X(0)->dtype;
  if (from != KILN_F32 && from != KILN_F64) return 0; /* from integers: no gradient */
  return g->dx[0] = kiln_cast(DOUT, from), done(g);
}

/* ---- data movement ---- */
static int g_identity(const grad_args *g) { return g->dx[0] = kiln_identity(DOUT), done(g); }
static int g_reshape(const grad_args *g) {
  return g->dx[0] = kiln_reshape(DOUT, X(0)->rank, X(0)->shape), done(g);
}
static int g_broadcast(const grad_args *g) { return g->dx[0] = UNB(DOUT, 0), done(g); }
static int g_transpose(const grad_args *g) {
  int inv[KILN_MAX_RANK];
  for (int i = 0; i < g->attrs->naxes; i++) inv[g->attrs->axes[i]] = i;
  return g->dx[0] = kiln_transpose(DOUT, g->attrs->naxes, inv), done(g);
}
static int g_slice(const grad_args *g) { /* pad with zeros back to the input's shape */
  kiln_tensor *x = X(0), *cur = DOUT;
  for (int i = 0; i < x->rank && cur; i++) {
    int64_t before = g->attrs->begin[i], after = x->shape[i] - before - cur->shape[i];
    if (before == 0 && after == 0) continue;
    kiln_tensor *parts[3];
    int n = 0;
    int64_t shape[KILN_MAX_RANK];
    memcpy(shape, cur->shape, sizeof shape);
    if (before) {
      shape[i] = before;
      parts[n++] = kiln_zeros((kiln_dtype)cur->dtype, cur->rank, shape);
    }
    parts[n++] = cur;
    if (after) {
      shape[i] = after;
      parts[n++] = kiln_zeros((kiln_dtype)cur->dtype, cur->rank, shape);
    }
    cur = kiln_concat(n, parts, i);
  }
  return g->dx[0] = cur, done(g);
}
static int g_concat(const grad_args *g) {
  int axis = g->attrs->axis;
  int64_t begin[KILN_MAX_RANK] = {0}, size[KILN_MAX_RANK];
  for (int i = 0; i < g->n; i++) {
    for (int d = 0; d < DOUT->rank; d++) size[d] = d == axis ? X(i)->shape[d] : -1;
    if (NEED(i) && !(g->dx[i] = kiln_slice(DOUT, begin, size))) return -1;
    begin[axis] += X(i)->shape[axis];
  }
  return 0;
}

/* ---- reductions ---- */
/* dout with the reduced axes restored as 1s, broadcast back to x's shape */
static kiln_tensor *expand_reduced(const grad_args *g, kiln_tensor *t) {
  int64_t shape[KILN_MAX_RANK];
  const kiln_tensor *x = X(0);
  for (int i = 0; i < x->rank; i++) shape[i] = x->shape[i];
  for (int k = 0; k < g->attrs->naxes; k++) shape[g->attrs->axes[k]] = 1;
  kiln_tensor *kept = kiln_reshape(t, x->rank, shape);
  return kiln_broadcast_to(kept, x->rank, x->shape);
}
static int g_reduce_sum(const grad_args *g) { return g->dx[0] = expand_reduced(g, DOUT), done(g); }
/* Exclusive products along the last axis of t (length n >= 1): prefix[i]
 * = t[0] * .. * t[i-1], suffix[i] = t[i+1] * .. * t[n-1], each an inclusive
 * scan by doubling (log2 n multiplies of shifted copies) shifted by one. */
static kiln_tensor *exclusive_prod(kiln_tensor *t, bool suffix) {
  if (!t) return NULL;
  int r = t->rank, last = r - 1;
  int64_t n = t->shape[last], begin[KILN_MAX_RANK] = {0}, size[KILN_MAX_RANK], ones[KILN_MAX_RANK];
  for (int d = 0; d < r; d++) size[d] = ones[d] = t->shape[d];
  kiln_tensor *scan = t;
  for (int64_t step = 1; step < n && scan; step *= 2) {
    begin[last] = suffix ? step : 0;
    size[last] = n - step;
    ones[last] = step;
    kiln_tensor *shifted = kiln_slice(scan, begin, size), *pad = kiln_ones((kiln_dtype)t->dtype, r, ones);
    kiln_tensor *parts[2] = {suffix ? shifted : pad, suffix ? pad : shifted};
    scan = kiln_mul(scan, kiln_concat(2, parts, last));
  }
  if (!scan) return NULL;
  begin[last] = suffix ? 1 : 0;
  size[last] = n - 1;
  ones[last] = 1;
  kiln_tensor *kept = kiln_slice(scan, begin, size), *pad = kiln_ones((kiln_dtype)t->dtype, r, ones);
  kiln_tensor *parts[2] = {suffix ? kept : pad, suffix ? pad : kept};
  return kiln_concat(2, parts, last);
}

/* The product of the other elements of each reduced group, prefix times
 * suffix exclusive products: exact at zeros (prod / x is NaN there) and
 * made of mul, slice and concat only, so it is itself differentiable at
 * zeros too (d^2 prod(x)/dx^2 at x = [0, 2, 3] is [5, 3, 2]). The reduced
 * axes are moved last and flattened into one. */
static kiln_tensor *prod_of_others(const grad_args *g) {
  const op_attrs *a = g->attrs;
  kiln_tensor *x = X(0);
  int r = x->rank, perm[KILN_MAX_RANK], inv[KILN_MAX_RANK], np = 0;
  bool reduced[KILN_MAX_RANK] = {false}, moved = false;
  for (int k = 0; k < a->naxes; k++) reduced[a->axes[k]] = true;
  int64_t shape[KILN_MAX_RANK + 1], n = 1;
  for (int i = 0; i < r; i++)
    if (!reduced[i]) shape[np] = x->shape[i], perm[np++] = i;
  int kept = np;
  for (int i = 0; i < r; i++)
    if (reduced[i]) n *= x->shape[i], perm[np++] = i;
  if (x->size == 0 || n == 1) return kiln_fill((kiln_dtype)x->dtype, r, x->shape, 1);
  for (int i = 0; i < r; i++) moved |= perm[i] != i, inv[perm[i]] = i;
  kiln_tensor *xt = moved ? kiln_transpose(x, r, perm) : x;
  shape[kept] = n;
  kiln_tensor *flat = kiln_reshape(xt, kept + 1, shape);
  kiln_tensor *others = kiln_mul(exclusive_prod(flat, false), exclusive_prod(flat, true));
  if (!others || !xt) return NULL;
  others = kiln_reshape(others, r, xt->shape);
  return moved ? kiln_transpose(others, r, inv) : others;
}
static int g_reduce_prod(const grad_args *g) {
  return g->dx[0] = kiln_mul(expand_reduced(g, DOUT), prod_of_others(g)), done(g);
}
static int g_reduce_extremum(const grad_args *g) { /* ties share the gradient evenly */
  kiln_tensor *x = X(0), *mask = kiln_cast(kiln_equal(x, expand_reduced(g, OUT)), (kiln_dtype)x->dtype);
  kiln_tensor *count = kiln_reduce_sum(mask, g->attrs->naxes, g->attrs->axes, g->attrs->keepdims);
  return g->dx[0] = kiln_mul(mask, expand_reduced(g, kiln_div(DOUT, count))), done(g);
}

/* ---- dot ---- */
static kiln_tensor *swap_last2(kiln_tensor *t) {
  if (!t) return NULL;
  int perm[KILN_MAX_RANK];
  for (int i = 0; i < t->rank; i++) perm[i] = i;
  perm[t->rank - 2] = t->rank - 1;
  perm[t->rank - 1] = t->rank - 2;
  return kiln_transpose(t, t->rank, perm);
}
static int g_dot(const grad_args *g) {
  if (NEED(0)) g->dx[0] = UNB(kiln_matmul(DOUT, swap_last2(X(1))), 0);
  if (NEED(1)) g->dx[1] = UNB(kiln_matmul(swap_last2(X(0)), DOUT), 1);
  return done(g);
}

/* ---- indexing ---- */
static int g_gather(const grad_args *g) {
  op_attrs a = *g->attrs;
  a.rank = X(0)->rank;
  memcpy(a.shape, X(0)->shape, sizeof a.shape);
  if (NEED(0)) g->dx[0] = op_apply2(OP_SCATTER_ADD, &a, DOUT, X(1));
  g->dx[1] = NULL;
  return done(g);
}
static int g_scatter_add(const grad_args *g) {
  if (NEED(0)) g->dx[0] = op_apply2(OP_GATHER, g->attrs, DOUT, X(1));
  g->dx[1] = NULL;
  return done(g);
}

/* ---- windows (conv2d, pooling) ----
 * The three convolutions are bilinear, each the gradient of another, with
 * the same stride, dilation, padding and groups: conv2d(x, f) = y,
 * backprop_input(dy, f) = dx, backprop_filter(x, dy) = df. So gradients of
 * any order are convolutions again. attrs.shape names the result's shape
 * of the two backprops. */
static kiln_tensor *window_op(op_id op, const op_attrs *attrs, const kiln_tensor *shaped, kiln_tensor *a,
                              kiln_tensor *b) {
  op_attrs at = *attrs;
  if (shaped) {
    at.rank = shaped->rank;
    memcpy(at.shape, shaped->shape, (size_t)shaped->rank * sizeof at.shape[0]);
  }
  return b ? op_apply2(op, &at, a, b) : op_apply1(op, &at, a);
}
static int g_conv2d(const grad_args *g) { /* in: x, f */
  if (NEED(0)) g->dx[0] = window_op(OP_CONV2D_BP_INPUT, g->attrs, X(0), DOUT, X(1));
  if (NEED(1)) g->dx[1] = window_op(OP_CONV2D_BP_FILTER, g->attrs, X(1), X(0), DOUT);
  return done(g);
}
static int g_conv2d_bp_input(const grad_args *g) { /* in: dy, f; out: dx */
  if (NEED(0)) g->dx[0] = window_op(OP_CONV2D, g->attrs, NULL, DOUT, X(1));
  if (NEED(1)) g->dx[1] = window_op(OP_CONV2D_BP_FILTER, g->attrs, X(1), DOUT, X(0));
  return done(g);
}
static int g_conv2d_bp_filter(const grad_args *g) { /* in: x, dy; out: df */
  if (NEED(0)) g->dx[0] = window_op(OP_CONV2D_BP_INPUT, g->attrs, X(0), X(1), DOUT);
  if (NEED(1)) g->dx[1] = window_op(OP_CONV2D, g->attrs, NULL, X(0), DOUT);
  return done(g);
}
static int g_avg_pool2d(const grad_args *g) {
  return g->dx[0] = window_op(OP_AVG_POOL2D_GRAD, g->attrs, X(0), DOUT, NULL), done(g);
}
static int g_avg_pool2d_grad(const grad_args *g) { /* linear in dy: its own transpose */
  return g->dx[0] = window_op(OP_AVG_POOL2D, g->attrs, NULL, DOUT, NULL), done(g);
}
static int g_max_pool2d(const grad_args *g) { /* to the window's max, ties sharing (as reduce_max) */
  return g->dx[0] = window_op(OP_MAX_POOL2D_GRAD, g->attrs, NULL, X(0), DOUT), done(g);
}
/* max_pool2d_grad(x, dy): piecewise constant in x (no gradient flows to x);
 * linear in dy, but its transpose (a gather of each window's max) is not an
 * op yet, so a second derivative through max pooling is an error. */
static int g_max_pool2d_grad(const grad_args *g) {
  if (NEED(1))
    return kiln_set_error("max_pool2d_grad: the gradient of max_pool2d's gradient with respect to dy is not "
                          "supported (a second derivative through max_pool2d)");
  if (NEED(0)) g->dx[0] = kiln_zeros((kiln_dtype)X(0)->dtype, X(0)->rank, X(0)->shape);
  return done(g);
}

/* NULL: the result carries no gradient (integer, boolean or piecewise
 * constant: sign, floor, ceil, comparisons, argmax; sources). */
const grad_fn kiln_grads[OP_COUNT] = {
    [OP_NEG] = g_neg,
    [OP_ABS] = g_abs,
    [OP_EXP] = g_exp,
    [OP_LOG] = g_log,
    [OP_LOG1P] = g_log1p,
    [OP_SQRT] = g_sqrt,
    [OP_RSQRT] = g_rsqrt,
    [OP_SIN] = g_sin,
    [OP_COS] = g_cos,
    [OP_TANH] = g_tanh,
    [OP_SIGMOID] = g_sigmoid,
    [OP_RELU] = g_relu,
    [OP_ADD] = g_add,
    [OP_SUB] = g_sub,
    [OP_MUL] = g_mul,
    [OP_DIV] = g_div,
    [OP_POW] = g_pow,
    [OP_MAX] = g_max,
    [OP_MIN] = g_min,
    [OP_MOD] = g_mod,
    [OP_SELECT] = g_select,
    [OP_CONVERT] = g_convert,
    [OP_IDENTITY] = g_identity,
    [OP_RESHAPE] = g_reshape,
    [OP_BROADCAST] = g_broadcast,
    [OP_TRANSPOSE] = g_transpose,
    [OP_SLICE] = g_slice,
    [OP_CONCAT] = g_concat,
    [OP_REDUCE_SUM] = g_reduce_sum,
    [OP_REDUCE_PROD] = g_reduce_prod,
    [OP_REDUCE_MAX] = g_reduce_extremum,
    [OP_REDUCE_MIN] = g_reduce_extremum,
    [OP_DOT] = g_dot,
    [OP_GATHER] = g_gather,
    [OP_SCATTER_ADD] = g_scatter_add,
    [OP_ALL_REDUCE] = dist_grad_rule,
    [OP_ALL_GATHER] = dist_grad_rule,
    [OP_REDUCE_SCATTER] = dist_grad_rule,
    [OP_BROADCAST_FROM] = dist_grad_rule,
    [OP_CONV2D] = g_conv2d,
    [OP_CONV2D_BP_INPUT] = g_conv2d_bp_input,
    [OP_CONV2D_BP_FILTER] = g_conv2d_bp_filter,
    [OP_MAX_POOL2D] = g_max_pool2d,
    [OP_MAX_POOL2D_GRAD] = g_max_pool2d_grad,
    [OP_AVG_POOL2D] = g_avg_pool2d,
    [OP_AVG_POOL2D_GRAD] = g_avg_pool2d_grad,
};
