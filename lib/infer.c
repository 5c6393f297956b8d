/* infer.c — the shape/dtype rule of every primitive, named in ir/ops.def.
 * Eager ops, the tracer, the parser and the verifier all call these, so
 * nothing can disagree about an op's result type. Errors start with the
 * op's public name and name the offending values. */
#include <stdio.h>

#include "ops.h"

const op_info kiln_ops[OP_COUNT] = {
#define KILN_OP(ID, name, api, arity, kind, dtypes, attrs, infer) \
  {name, api, arity, kind, dtypes, attrs, infer},
#include "ops.def"
#undef KILN_OP
};

#define API(op) (kiln_ops[op].api)
#define SHAPE(buf, t) shape_str(buf, sizeof buf, (t).rank, (t).shape)

static int same_dtype(op_id op, const op_type *a, const op_type *b) {
  if (a->dtype == b->dtype) return 0;
  return kiln_set_error("%s: dtype mismatch: %s and %s", API(op), kiln_dtype_name(a->dtype),
                        kiln_dtype_name(b->dtype));
}

/* NumPy broadcasting of two shapes into out; -1 if incompatible */
static int broadcast2(const op_type *a, const op_type *b, op_type *out) {
  int r = a->rank > b->rank ? a->rank : b->rank;
  for (int i = 0; i < r; i++) {
    int ia = a->rank - r + i, ib = b->rank - r + i;
    int64_t da = ia >= 0 ? a->shape[ia] : 1, db = ib >= 0 ? b->shape[ib] : 1;
    if (da != db && da != 1 && db != 1) return -1;
    out->shape[i] = da == 1 ? db : da;
  }
  out->rank = r;
  return 0;
}

static int incompatible(op_id op, const op_type *a, const op_type *b) {
  char x[160], y[160];
  return kiln_set_error("%s: incompatible shapes %s and %s", API(op), SHAPE(x, *a), SHAPE(y, *b));
}

int infer_unary(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)op, (void)a, (void)n;
  *out = in[0];
  return 0;
}

int infer_binary(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)a, (void)n;
  if (same_dtype(op, &in[0], &in[1])) return -1;
  if (broadcast2(&in[0], &in[1], out)) return incompatible(op, &in[0], &in[1]);
  out->dtype = in[0].dtype;
  return 0;
}

int infer_compare(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  if (infer_binary(op, a, n, in, out)) return -1;
  out->dtype = KILN_BOOL;
  return 0;
}

int infer_select(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)a, (void)n;
  if (in[0].dtype != KILN_BOOL)
    return kiln_set_error("%s: condition must be bool, not %s", API(op), kiln_dtype_name(in[0].dtype));
  if (same_dtype(op, &in[1], &in[2])) return -1;
  op_type ab;
  if (broadcast2(&in[1], &in[2], &ab)) return incompatible(op, &in[1], &in[2]);
  if (broadcast2(&in[0], &ab, out)) return incompatible(op, &in[0], &ab);
  out->dtype = in[1].dtype;
  return 0;
}

int infer_convert(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  if (!dtype_valid(a->dtype)) return kiln_set_error("%s: invalid dtype %d", API(op), (int)a->dtype);
  *out = in[0];
  out->dtype = a->dtype;
  return 0;
}

static int attr_shape(op_id op, const op_attrs *a, op_type *out, kiln_dtype dt) {
  int64_t size;
  if (shape_check(API(op), a->rank, a->shape, &size)) return -1;
  out->dtype = dt;
  out->rank = a->rank;
  for (int i = 0; i < a->rank; i++) out->shape[i] = a->shape[i];
  return 0;
}

/* elements of t: 0 when any dim is 0 (whatever the others), INT64_MAX
 * when the product does not fit (a shape no tensor can have) */
static int64_t type_size(const op_type *t) {
  for (int i = 0; i < t->rank; i++)
    if (t->shape[i] == 0) return 0;
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++)
    if (KILN_MUL_OVERFLOW(n, t->shape[i], &n)) return INT64_MAX;
  return n;
}

int infer_reshape(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  if (attr_shape(op, a, out, in[0].dtype)) return -1;
  if (type_size(out) != type_size(&in[0])) {
    char x[160], y[160];
    return kiln_set_error("%s: cannot reshape %s (%lld elements) to %s (%lld elements)", API(op),
                          SHAPE(x, in[0]), (long long)type_size(&in[0]), SHAPE(y, *out),
                          (long long)type_size(out));
  }
  return 0;
}

int infer_broadcast(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  if (attr_shape(op, a, out, in[0].dtype)) return -1;
  bool ok = in[0].rank <= out->rank;
  for (int i = 0; ok && i < in[0].rank; i++) {
    int64_t d = in[0].shape[i], o = out->shape[out->rank - in[0].rank + i];
    ok = d == o || d == 1;
  }
  if (!ok) {
    char x[160], y[160];
    return kiln_set_error("%s: cannot broadcast %s to %s", API(op), SHAPE(x, in[0]), SHAPE(y, *out));
  }
  return 0;
}

int infer_transpose(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  int r = in[0].rank;
  bool seen[KILN_MAX_RANK] = {false}, ok = a->naxes == r;
  for (int i = 0; ok && i < r; i++) {
    ok = a->axes[i] >= 0 && a->axes[i] < r && !seen[a->axes[i]];
    if (ok) seen[a->axes[i]] = true;
  }
  if (!ok) {
    char buf[160] = "(";
    size_t used = 1;
    for (int i = 0; i < a->naxes && i < KILN_MAX_RANK; i++)
      used += (size_t)snprintf(buf + used, sizeof buf - used, i ? ", %d" : "%d", a->axes[i]);
    snprintf(buf + used, sizeof buf - used, ")");
    return kiln_set_error("%s: perm %s is not a permutation of %d axes", API(op), buf, r);
  }
  *out = in[0];
  for (int i = 0; i < r; i++) out->shape[i] = in[0].shape[a->axes[i]];
  return 0;
}

/* attrs: begin[i], shape[i] = size (-1 = to the end); out gets the sizes */
int infer_slice(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  *out = in[0];
  for (int i = 0; i < in[0].rank; i++) {
    int64_t dim = in[0].shape[i], b = a->begin[i], s = a->shape[i];
    if (b < 0 || b > dim)
      return kiln_set_error("%s: begin[%d] = %lld is not in [0, %lld]", API(op), i, (long long)b,
                            (long long)dim);
    if (s == -1) s = dim - b;
    if (s < 0 || s > dim - b)
      return kiln_set_error("%s: size[%d] = %lld does not fit: begin %lld + size exceeds dim %lld",
                            API(op), i, (long long)a->shape[i], (long long)b, (long long)dim);
    out->shape[i] = s;
  }
  return 0;
}

int infer_concat(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  if (n < 1) return kiln_set_error("%s: needs at least one tensor", API(op));
  *out = in[0];
  if (in[0].rank == 0) return kiln_set_error("%s: cannot concatenate scalars (rank 0)", API(op));
  if (a->axis < 0 || a->axis >= in[0].rank)
    return kiln_set_error("%s: axis %d is out of range for rank %d", API(op), a->axis, in[0].rank);
  for (int k = 1; k < n; k++) {
    if (same_dtype(op, &in[0], &in[k])) return -1;
    bool ok = in[k].rank == in[0].rank;
    for (int i = 0; ok && i < in[0].rank; i++) ok = i == a->axis || in[k].shape[i] == in[0].shape[i];
    if (!ok) {
      char x[160], y[160];
      return kiln_set_error("%s: shapes %s and %s (tensor %d) differ outside axis %d", API(op),
                            SHAPE(x, in[0]), SHAPE(y, in[k]), k, a->axis);
    }
    out->shape[a->axis] += in[k].shape[a->axis];
  }
  return 0;
}

int infer_reduce(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  bool reduced[KILN_MAX_RANK] = {false};
  for (int i = 0; i < a->naxes; i++) {
    if (a->axes[i] < 0 || a->axes[i] >= in[0].rank)
      return kiln_set_error("%s: axis %d is out of range for rank %d", API(op), a->axes[i], in[0].rank);
    if (reduced[a->axes[i]]) return kiln_set_error("%s: axis %d is repeated", API(op), a->axes[i]);
    reduced[a->axes[i]] = true;
  }
  out->dtype = in[0].dtype;
  out->rank = 0;
  for (int i = 0; i < in[0].rank; i++) {
    if (!reduced[i])
      out->shape[out->rank++] = in[0].shape[i];
    else if (a->keepdims)
      out->shape[out->rank++] = 1;
  }
  return 0;
}

int infer_argmax(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  if (in[0].rank == 0) return kiln_set_error("%s: needs rank >= 1, got a scalar", API(op));
  if (a->axis < 0 || a->axis >= in[0].rank)
    return kiln_set_error("%s: axis %d is out of range for rank %d", API(op), a->axis, in[0].rank);
  if (in[0].shape[a->axis] == 0)
    return kiln_set_error("%s: axis %d is empty", API(op), a->axis);
  out->dtype = KILN_I64;
  out->rank = 0;
  for (int i = 0; i < in[0].rank; i++)
    if (i != a->axis) out->shape[out->rank++] = in[0].shape[i];
  return 0;
}

int infer_dot(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)a, (void)n;
  const op_type *x = &in[0], *y = &in[1];
  if (x->rank < 2 || y->rank < 2)
    return kiln_set_error("%s: operands need rank >= 2, got ranks %d and %d", API(op), x->rank, y->rank);
  if (same_dtype(op, x, y)) return -1;
  char s1[160], s2[160];
  if (x->shape[x->rank - 1] != y->shape[y->rank - 2])
    return kiln_set_error("%s: inner dimensions differ: %s and %s", API(op), SHAPE(s1, *x), SHAPE(s2, *y));
  op_type bx = *x, by = *y, batch;
  bx.rank -= 2;
  by.rank -= 2;
  if (broadcast2(&bx, &by, &batch))
    return kiln_set_error("%s: batch dimensions of %s and %s do not broadcast", API(op), SHAPE(s1, *x),
                          SHAPE(s2, *y));
  *out = batch;
  out->dtype = x->dtype;
  out->shape[out->rank++] = x->shape[x->rank - 2];
  out->shape[out->rank++] = y->shape[y->rank - 1];
  return 0;
}

static int index_dtype(op_id op, const op_type *idx) {
  if (idx->dtype == KILN_I32 || idx->dtype == KILN_I64) return 0;
  return kiln_set_error("%s: indices must be i32 or i64, not %s", API(op), kiln_dtype_name(idx->dtype));
}

/* params.shape[:axis] + indices.shape + params.shape[axis+1:] */
static int gather_shape(op_id op, const op_type *p, const op_type *idx, int axis, op_type *out) {
  if (p->rank == 0) return kiln_set_error("%s: params must have rank >= 1", API(op));
  if (axis < 0 || axis >= p->rank)
    return kiln_set_error("%s: axis %d is out of range for rank %d", API(op), axis, p->rank);
  int r = p->rank - 1 + idx->rank;
  if (r > KILN_MAX_RANK)
    return kiln_set_error("%s: result rank %d exceeds %d", API(op), r, KILN_MAX_RANK);
  out->dtype = p->dtype;
  out->rank = 0;
  for (int i = 0; i < axis; i++) out->shape[out->rank++] = p->shape[i];
  for (int i = 0; i < idx->rank; i++) out->shape[out->rank++] = idx->shape[i];
  for (int i = axis + 1; i < p->rank; i++) out->shape[out->rank++] = p->shape[i];
  return 0;
}

int infer_gather(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  if (index_dtype(op, &in[1])) return -1;
  return gather_shape(op, &in[0], &in[1], a->axis, out);
}

/* in: updates, indices; attrs.shape: the result (params) shape */
int infer_scatter_add(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  if (index_dtype(op, &in[1])) return -1;
  op_type params, expect;
  if (attr_shape(op, a, &params, in[0].dtype)) return -1;
  if (gather_shape(op, &params, &in[1], a->axis, &expect)) return -1;
  bool ok = expect.rank == in[0].rank;
  for (int i = 0; ok && i < expect.rank; i++) ok = expect.shape[i] == in[0].shape[i];
  if (!ok) {
    char x[160], y[160];
    return kiln_set_error("%s: updates have shape %s, expected %s", API(op), SHAPE(x, in[0]),
                          SHAPE(y, expect));
  }
  *out = params;
  return 0;
}

int infer_source(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n, (void)in;
  if (!dtype_valid(a->dtype)) return kiln_set_error("%s: invalid dtype %d", API(op), (int)a->dtype);
  return attr_shape(op, a, out, a->dtype);
}

int infer_constant(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n, (void)in;
  if (!a->value) return kiln_set_error("%s: no value", API(op));
  out->dtype = (kiln_dtype)a->value->dtype;
  out->rank = a->value->rank;
  for (int i = 0; i < a->value->rank; i++) out->shape[i] = a->value->shape[i];
  return 0;
}

/* call, fusion, host_call: their result types come from the callee (IR) */
int infer_none(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)a, (void)n, (void)in, (void)out;
  return kiln_set_error("%s: its result types come from its callee, not from an inference rule", API(op));
}

/* ---- windows over NHWC images (conv2d, pooling and their gradients) ---- */

static int rank4(op_id op, const char *what, const op_type *t) {
  if (t->rank == 4) return 0;
  char s[160];
  return kiln_set_error("%s: the %s must have rank 4 (%s), got shape %s", API(op), what,
                        what[0] == 'f' ? "HWIO" : "NHWC", SHAPE(s, *t));
}

/* stride and padding (and dilation and groups for convolutions) as the API
 * leaves them: explicit, strides >= 1, padding >= 0 */
static int window_attrs(op_id op, const op_attrs *a, bool conv) {
  for (int i = 0; i < 2; i++) {
    if (a->stride[i] < 1) return kiln_set_error("%s: stride %d must be positive", API(op), a->stride[i]);
    if (conv && a->dilation[i] < 1)
      return kiln_set_error("%s: dilation %d must be positive", API(op), a->dilation[i]);
    if (!conv && a->window[i] < 1) return kiln_set_error("%s: window %d must be positive", API(op), a->window[i]);
  }
  for (int i = 0; i < 4; i++)
    if (a->padding[i] < 0) return kiln_set_error("%s: padding %d is negative", API(op), a->padding[i]);
  if (conv && a->groups < 1) return kiln_set_error("%s: groups %d must be positive", API(op), a->groups);
  return 0;
}

/* The output length of a window of extent k (dilated) over n + padding,
 * or -1 with the error set when the window is larger than the padded input. */
static int64_t window_out(op_id op, int64_t n, int64_t k, int dilation, int pad0, int pad1, int stride,
                          const char *axis) {
  int64_t span, padded = n + pad0 + pad1;
  if (k == 0) return kiln_set_error("%s: the window has no %s", API(op), axis), -1;
  if (KILN_MUL_OVERFLOW(k - 1, (int64_t)dilation, &span) || span + 1 > padded) {
    kiln_set_error("%s: the window (%lld %s, dilation %d) is larger than the padded input (%lld + %d + %d)", API(op),
                   (long long)k, axis, dilation, (long long)n, pad0, pad1);
    return -1;
  }
  return (padded - span - 1) / stride + 1;
}

/* the result of conv2d(x, f) under a */
static int conv_result(op_id op, const op_attrs *a, const op_type *x, const op_type *f, op_type *out) {
  if (rank4(op, "input", x) || rank4(op, "filter", f) || same_dtype(op, x, f) || window_attrs(op, a, true)) return -1;
  int64_t c = x->shape[3], cg = f->shape[2], o = f->shape[3], g = a->groups;
  if (c % g)
    return kiln_set_error("%s: groups %lld does not divide the %lld input channels", API(op), (long long)g,
                          (long long)c);
  if (o % g)
    return kiln_set_error("%s: groups %lld does not divide the %lld output channels (filter dim 3)", API(op),
                          (long long)g, (long long)o);
  if (cg * g != c) {
    if (g == 1)
      return kiln_set_error("%s: channel mismatch: the input has %lld channels, the filter takes %lld", API(op),
                            (long long)c, (long long)cg);
    return kiln_set_error("%s: channel mismatch: the input has %lld channels, the filter takes %lld per group "
                          "(%lld groups)", API(op), (long long)c, (long long)cg, (long long)g);
  }
  int64_t oh = window_out(op, x->shape[1], f->shape[0], a->dilation[0], a->padding[0], a->padding[1], a->stride[0],
                          "rows");
  if (oh < 0) return -1;
  int64_t ow = window_out(op, x->shape[2], f->shape[1], a->dilation[1], a->padding[2], a->padding[3], a->stride[1],
                          "columns");
  if (ow < 0) return -1;
  *out = (op_type){x->dtype, 4, {x->shape[0], oh, ow, o}};
  return 0;
}

/* the result of pooling x under a; the padding on each side is smaller than
 * the window, so every window holds an element of x */
static int pool_result(op_id op, const op_attrs *a, const op_type *x, op_type *out) {
  if (rank4(op, "input", x) || window_attrs(op, a, false)) return -1;
  for (int i = 0; i < 4; i++)
    if (a->padding[i] >= a->window[i / 2])
      return kiln_set_error("%s: padding %d is not smaller than the window (%d)", API(op), a->padding[i],
                            a->window[i / 2]);
  int64_t oh = window_out(op, x->shape[1], a->window[0], 1, a->padding[0], a->padding[1], a->stride[0], "rows");
  if (oh < 0) return -1;
  int64_t ow = window_out(op, x->shape[2], a->window[1], 1, a->padding[2], a->padding[3], a->stride[1], "columns");
  if (ow < 0) return -1;
  *out = (op_type){x->dtype, 4, {x->shape[0], oh, ow, x->shape[3]}};
  return 0;
}

static int same_type(op_id op, const char *what, const op_type *have, const op_type *want) {
  bool eq = have->dtype == want->dtype && have->rank == want->rank;
  for (int i = 0; eq && i < have->rank; i++) eq = have->shape[i] == want->shape[i];
  if (eq) return 0;
  char x[160], y[160];
  return kiln_set_error("%s: %s has shape %s, expected %s", API(op), what, SHAPE(x, *have), SHAPE(y, *want));
}

int infer_conv2d(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  return conv_result(op, a, &in[0], &in[1], out);
}

/* in: dy, filter; attrs.shape: the image's (the result's) shape */
int infer_conv2d_bp_input(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  op_type x, y;
  if (attr_shape(op, a, &x, in[0].dtype) || rank4(op, "output shape", &x)) return -1;
  if (rank4(op, "input", &in[0]) || conv_result(op, a, &x, &in[1], &y) || same_type(op, "the input", &in[0], &y))
    return -1;
  *out = x;
  return 0;
}

/* in: x, dy; attrs.shape: the filter's (the result's) shape */
int infer_conv2d_bp_filter(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  op_type f, y;
  if (attr_shape(op, a, &f, in[0].dtype) || rank4(op, "filter", &f)) return -1;
  if (same_dtype(op, &in[0], &in[1]) || conv_result(op, a, &in[0], &f, &y) || same_type(op, "dy", &in[1], &y))
    return -1;
  *out = f;
  return 0;
}

int infer_pool2d(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  return pool_result(op, a, &in[0], out);
}

/* in: x, dy */
int infer_max_pool2d_grad(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  op_type y;
  if (same_dtype(op, &in[0], &in[1]) || pool_result(op, a, &in[0], &y) || same_type(op, "dy", &in[1], &y)) return -1;
  *out = in[0];
  return 0;
}

/* in: dy; attrs.shape: the image's (the result's) shape */
int infer_avg_pool2d_grad(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  op_type x, y;
  if (attr_shape(op, a, &x, in[0].dtype) || pool_result(op, a, &x, &y) || same_type(op, "dy", &in[0], &y)) return -1;
  *out = x;
  return 0;
}

/* ---- collectives (API.md §12): the type each rank's result has in a world
 * of a->world processes ---- */

int infer_collective(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out) {
  (void)n;
  static const char *const reduce_names[] = {"sum", "mean", "max", "min"};
  if (a->world < 1) return kiln_set_error("%s: world size %d (need at least 1 process)", API(op), a->world);
  bool reduces = op == OP_ALL_REDUCE || op == OP_REDUCE_SCATTER;
  if (reduces && (a->reduce < 0 || a->reduce > 3))
    return kiln_set_error("%s: reduce %d is not sum, mean, max or min", API(op), a->reduce);
  if (reduces && in[0].dtype == KILN_BOOL && a->reduce <= 1)
    return kiln_set_error("%s: \"%s\" of a bool tensor (cast it to a number first; \"max\" and \"min\" are or "
                          "and and)", API(op), reduce_names[a->reduce]);
  *out = in[0];
  if (op == OP_BROADCAST_FROM && (a->root < 0 || a->root >= a->world))
    return kiln_set_error("%s: root %d is not a rank of this world of %d process%s", API(op), a->root, a->world,
                          a->world == 1 ? "" : "es");
  if (op != OP_ALL_GATHER && op != OP_REDUCE_SCATTER) return 0;
  if (a->axis < 0 || a->axis >= in[0].rank)
    return kiln_set_error("%s: axis %d is out of range for rank %d", API(op), a->axis, in[0].rank);
  int64_t *d = &out->shape[a->axis];
  if (op == OP_ALL_GATHER) {
    if (*d > INT64_MAX / a->world) return kiln_set_error("%s: the gathered axis overflows", API(op));
    *d *= a->world;
  } else if (*d % a->world) {
    return kiln_set_error("%s: axis %d of length %lld is not divisible into %d equal blocks", API(op), a->axis,
                          (long long)*d, a->world);
  } else {
    *d /= a->world;
  }
  return 0;
}
