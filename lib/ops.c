/* ops.c — the eager front end: op_apply runs one primitive (the path of
 * DESIGN.md: check, infer by the op table's rule, dispatch, own), and the
 * public entry points of every primitive API op. Composites live in
 * composite.c. */
#include <math.h>
#include <stdlib.h>

#include "autodiff.h"
#include "../jit/jit.h"

static const op_attrs no_attrs;

static void dtype_list(unsigned mask, char *buf, size_t n) {
  size_t used = 0;
  buf[0] = '\0';
  for (int d = 0; d < KILN_DTYPE_COUNT && used < n; d++)
    if (mask & DT_BIT(d))
      used += (size_t)snprintf(buf + used, n - used, used ? ", %s" : "%s", kiln_dtype_name((kiln_dtype)d));
}

static int unsupported_dtype(op_id op, kiln_dtype dt) {
  char list[64];
  dtype_list(kiln_ops[op].dtypes, list, sizeof list);
  if (dt == KILN_F16 || dt == KILN_BF16)
    return kiln_set_error("%s: dtype %s is not supported (%s); %s is a storage type: kiln_cast it to f32 first",
                          kiln_ops[op].api, kiln_dtype_name(dt), list, kiln_dtype_name(dt));
  return kiln_set_error("%s: dtype %s is not supported (%s)", kiln_ops[op].api, kiln_dtype_name(dt), list);
}

int axis_normalize(const char *op, int axis, int rank, int *out) {
  if (axis < -rank || axis >= rank || rank == 0)
    return kiln_set_error("%s: axis %d is out of range for rank %d", op, axis, rank);
  *out = axis < 0 ? axis + rank : axis;
  return 0;
}

/* An op with an input or its device scope off the CPU (API.md §7): inputs
 * that live elsewhere are copied to the device it runs on, and it runs
 * there. Apart from op_apply so that the CPU path stays one test. */
static kiln_tensor *apply_on_device(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in,
                                    const op_type *ty, kiln_dtype key, int device) {
  const op_info *info = &kiln_ops[op];
  if (device_is_remote(device)) return remote_apply(op, attrs, n, in, ty, device);
  kernel_fn kernel = kiln_kernels[op][device][key];
  if (info->kind != OPK_VIEW && !kernel) { /* before copying anything */
    kiln_set_error("%s: no kernel for %s on %s%s", info->api, kiln_dtype_name(key), kiln_device_name(device),
                   device ? " yet" : "");
    return NULL;
  }
  kiln_tensor *small[4], **moved = n > 4 ? malloc((size_t)n * sizeof *moved) : small, *out = NULL;
  if (!moved) {
    kiln_set_error("%s: out of memory", info->api);
    return NULL;
  }
  int ok = 0;
  for (; ok < n; ok++)
    if (!(moved[ok] = in[ok]->device == device ? kiln_retain(in[ok]) : tensor_to_device(info->api, in[ok], device)))
      break;
  if (ok == n && info->kind == OPK_VIEW) {
    out = tensor_view(moved[0], ty->rank, ty->shape);
  } else if (ok == n && (out = tensor_alloc_device(info->api, ty->dtype, ty->rank, ty->shape, device))) {
    op_call call = {op, attrs, n, moved, out};
    if (kernel(&call)) {
      kiln_release(out);
      out = NULL;
    }
  }
  for (int i = 0; i < ok; i++) kiln_release(moved[i]);
  if (moved != small) free(moved);
  return out;
}

kiln_tensor *op_apply(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in) {
  const op_info *info = &kiln_ops[op];
  op_type small[4] = {{0}}, *types = small, out_type; /* zeroed: gcc cannot see n bounds the reads */
  kiln_tensor *out = NULL;
  for (int i = 0; i < n; i++) {
    if (KILN_UNLIKELY(!in[i])) {
      if (!kiln_has_error()) kiln_set_error("%s: input %d is NULL", info->api, i);
      return NULL;
    }
  }
  if (n > 4 && !(types = malloc((size_t)n * sizeof *types))) {
    kiln_set_error("%s: out of memory", info->api);
    return NULL;
  }
  unsigned flags = 0, devices = 0;
  for (int i = 0; i < n; i++) {
    flags |= in[i]->flags;
    devices |= in[i]->device;
    types[i].dtype = (kiln_dtype)in[i]->dtype;
    types[i].rank = in[i]->rank;
    memcpy(types[i].shape, in[i]->shape, (size_t)in[i]->rank * sizeof(int64_t));
  }
  kiln_dtype key = dispatch_key(op, n, in, attrs->dtype);
  if (KILN_UNLIKELY(!dtype_valid(key) || !(info->dtypes & DT_BIT(key)))) {
    if (!dtype_valid(key))
      kiln_set_error("%s: invalid dtype %d", info->api, (int)key);
    else
      unsupported_dtype(op, key);
    goto done;
  }
  if (KILN_UNLIKELY(info->infer(op, attrs, n, types, &out_type))) goto done;

  /* Symbolic inputs (and random draws) go to the tracer while one records
   * on this thread, whatever their devices. */
  if (KILN_UNLIKELY(trace_current) && trace_routes(op, n, in, &out_type)) {
    out = trace_apply(op, attrs, n, in);
    goto done;
  }
  if (KILN_UNLIKELY(flags & TF_SYMBOLIC)) { /* escaped from a trace: it has no value */
    kiln_set_error("%s: an input is a symbolic tensor of a staged function's trace; "
                   "it has no value outside that trace", info->api);
    goto done;
  }
  int device = device_now;
  if (KILN_UNLIKELY((devices | (unsigned)device) != 0)) { /* a GPU input or scope */
    out = apply_on_device(op, attrs, n, in, &out_type, key, device);
    goto done;
  }
  if (info->kind == OPK_VIEW) {
    out = tensor_view(in[0], out_type.rank, out_type.shape);
    goto done;
  }
  kernel_fn kernel = kiln_kernels[op][device][key];
  if (KILN_UNLIKELY(!kernel)) {
    kiln_set_error("%s: no kernel for dtype %s on %s", info->api, kiln_dtype_name(key),
                   kiln_device_name(device));
    goto done;
  }
  out = tensor_alloc(info->api, out_type.dtype, out_type.rank, out_type.shape);
  if (!out) goto done;
  op_call call = {op, attrs, n, in, out};
  if (KILN_UNLIKELY(kernel(&call))) {
    kiln_release(out);
    out = NULL;
  }
done:
  if (types != small) free(types);
  if (KILN_UNLIKELY(tape_active_count) && out) tape_record(op, attrs, n, in, out);
  return scope_own(out);
}

/* ---- elementwise ---- */

#define UNARY(fn, OP) \
  kiln_tensor *kiln_##fn(kiln_tensor *a) { return op_apply1(OP, &no_attrs, a); }
#define BINARY(fn, OP) \
  kiln_tensor *kiln_##fn(kiln_tensor *a, kiln_tensor *b) { return op_apply2(OP, &no_attrs, a, b); }

UNARY(neg, OP_NEG)
UNARY(abs, OP_ABS)
UNARY(sign, OP_SIGN)
UNARY(exp, OP_EXP)
UNARY(log, OP_LOG)
UNARY(log1p, OP_LOG1P)
UNARY(sqrt, OP_SQRT)
UNARY(rsqrt, OP_RSQRT)
UNARY(sin, OP_SIN)
UNARY(cos, OP_COS)
UNARY(tanh, OP_TANH)
UNARY(sigmoid, OP_SIGMOID)
UNARY(relu, OP_RELU)
UNARY(floor, OP_FLOOR)
UNARY(ceil, OP_CEIL)
UNARY(logical_not, OP_NOT)
UNARY(identity, OP_IDENTITY)
UNARY(stop_gradient, OP_STOP_GRADIENT)

BINARY(add, OP_ADD)
BINARY(sub, OP_SUB)
BINARY(mul, OP_MUL)
BINARY(div, OP_DIV)
BINARY(pow, OP_POW)
BINARY(maximum, OP_MAX)
BINARY(minimum, OP_MIN)
BINARY(mod, OP_MOD)
BINARY(logical_and, OP_AND)
BINARY(logical_or, OP_OR)
BINARY(equal, OP_EQ)
BINARY(not_equal, OP_NE)
BINARY(less, OP_LT)
BINARY(less_equal, OP_LE)
BINARY(greater, OP_GT)
BINARY(greater_equal, OP_GE)

kiln_tensor *kiln_select(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *in[3] = {cond, a, b};
  return op_apply(OP_SELECT, &no_attrs, 3, in);
}

kiln_tensor *kiln_cast(kiln_tensor *t, kiln_dtype dt) {
  op_attrs a = {.dtype = dt};
  return op_apply1(OP_CONVERT, &a, t);
}

/* ---- reductions ---- */

/* axes NULL = all; negative from the end; sorted ascending into a */
static int reduce_axes(op_id op, const kiln_tensor *t, int naxes, const int *axes, bool keepdims,
                       op_attrs *a) {
  const char *name = kiln_ops[op].api;
  a->keepdims = keepdims;
  if (!axes) {
    a->naxes = t->rank;
    for (int i = 0; i < t->rank; i++) a->axes[i] = i;
    return 0;
  }
  if (naxes < 0 || naxes > t->rank)
    return kiln_set_error("%s: %d axes given for rank %d", name, naxes, t->rank);
  a->naxes = naxes;
  for (int i = 0; i < naxes; i++) {
    if (axis_normalize(name, axes[i], t->rank, &a->axes[i])) return -1;
    for (int j = i; j > 0 && a->axes[j - 1] >= a->axes[j]; j--) {
      if (a->axes[j - 1] == a->axes[j]) return kiln_set_error("%s: axis %d is repeated", name, axes[i]);
      int tmp = a->axes[j];
      a->axes[j] = a->axes[j - 1];
      a->axes[j - 1] = tmp;
    }
  }
  return 0;
}

static kiln_tensor *reduce(op_id op, kiln_tensor *t, int naxes, const int *axes, bool keepdims) {
  op_attrs a = no_attrs;
  if (!t) return op_apply1(op, &a, t);
  if (reduce_axes(op, t, naxes, axes, keepdims, &a)) return NULL;
  return op_apply1(op, &a, t);
}

kiln_tensor *kiln_reduce_sum(kiln_tensor *t, int naxes, const int *axes, bool keepdims) {
  return reduce(OP_REDUCE_SUM, t, naxes, axes, keepdims);
}
kiln_tensor *kiln_reduce_prod(kiln_tensor *t, int naxes, const int *axes, bool keepdims) {
  return reduce(OP_REDUCE_PROD, t, naxes, axes, keepdims);
}
kiln_tensor *kiln_reduce_max(kiln_tensor *t, int naxes, const int *axes, bool keepdims) {
  return reduce(OP_REDUCE_MAX, t, naxes, axes, keepdims);
}
kiln_tensor *kiln_reduce_min(kiln_tensor *t, int naxes, const int *axes, bool keepdims) {
  return reduce(OP_REDUCE_MIN, t, naxes, axes, keepdims);
}

kiln_tensor *kiln_argmax(kiln_tensor *t, int axis) {
  op_attrs a = no_attrs;
  if (t && axis_normalize("argmax", axis, t->rank, &a.axis)) return NULL;
  return op_apply1(OP_ARGMAX, &a, t);
}

kiln_tensor *kiln_matmul(kiln_tensor *a, kiln_tensor *b) { return op_apply2(OP_DOT, &no_attrs, a, b); }

/* ---- shape ---- */

kiln_tensor *kiln_reshape(kiln_tensor *t, int rank, const int64_t *shape) {
  op_attrs a = no_attrs;
  if (!t) return op_apply1(OP_RESHAPE, &a, t);
  if (rank < 0 || rank > KILN_MAX_RANK) {
    kiln_set_error("reshape: rank %d is not in [0, %d]", rank, KILN_MAX_RANK);
    return NULL;
  }
  if (rank > 0 && !shape) {
    kiln_set_error("reshape: shape is NULL for rank %d", rank);
    return NULL;
  }
  int infer_at = -1;
  int64_t known = 1;
  bool empty = false; /* a 0 makes the count 0 whatever the others: no overflow */
  for (int i = 0; i < rank; i++) empty |= shape[i] == 0;
  a.rank = rank;
  for (int i = 0; i < rank; i++) {
    a.shape[i] = shape[i];
    if (shape[i] == -1) {
      if (infer_at >= 0) {
        kiln_set_error("reshape: more than one -1 in the shape (axes %d and %d)", infer_at, i);
        return NULL;
      }
      infer_at = i;
    } else if (shape[i] < 0) {
      kiln_set_error("reshape: shape[%d] = %lld is negative", i, (long long)shape[i]);
      return NULL;
    } else if (empty) {
      known = 0;
    } else if (KILN_MUL_OVERFLOW(known, shape[i], &known)) {
      kiln_set_error("reshape: the element count of the shape overflows");
      return NULL;
    }
  }
  if (infer_at >= 0) {
    if (known == 0 || t->size % known) {
      char buf[160];
      kiln_set_error("reshape: cannot infer the -1 in shape %s from %lld elements",
                     shape_str(buf, sizeof buf, rank, shape), (long long)t->size);
      return NULL;
    }
    a.shape[infer_at] = t->size / known;
  }
  return op_apply1(OP_RESHAPE, &a, t);
}

kiln_tensor *kiln_transpose(kiln_tensor *t, int rank, const int *perm) {
  op_attrs a = no_attrs;
  if (!t) return op_apply1(OP_TRANSPOSE, &a, t);
  if (!perm) {
    a.naxes = t->rank;
    for (int i = 0; i < t->rank; i++) a.axes[i] = t->rank - 1 - i;
  } else {
    if (rank != t->rank) {
      kiln_set_error("transpose: perm has %d axes, the tensor has rank %d", rank, t->rank);
      return NULL;
    }
    a.naxes = rank;
    for (int i = 0; i < rank; i++) a.axes[i] = perm[i] < 0 ? perm[i] + rank : perm[i];
  }
  return op_apply1(OP_TRANSPOSE, &a, t);
}

kiln_tensor *kiln_broadcast_to(kiln_tensor *t, int rank, const int64_t *shape) {
  op_attrs a = no_attrs;
  if (t) {
    if (rank < 0 || rank > KILN_MAX_RANK) {
      kiln_set_error("broadcast_to: rank %d is not in [0, %d]", rank, KILN_MAX_RANK);
      return NULL;
    }
    if (rank > 0 && !shape) {
      kiln_set_error("broadcast_to: shape is NULL for rank %d", rank);
      return NULL;
    }
    a.rank = rank;
    for (int i = 0; i < rank; i++) a.shape[i] = shape[i];
  }
  return op_apply1(OP_BROADCAST, &a, t);
}

kiln_tensor *kiln_slice(kiln_tensor *t, const int64_t *begin, const int64_t *size) {
  op_attrs a = no_attrs;
  if (t && t->rank > 0 && (!begin || !size)) {
    kiln_set_error("slice: %s is NULL", begin ? "size" : "begin");
    return NULL;
  }
  if (t) {
    a.rank = t->rank;
    for (int i = 0; i < t->rank; i++) {
      a.begin[i] = begin[i];
      a.shape[i] = size[i];
    }
  }
  return op_apply1(OP_SLICE, &a, t);
}

kiln_tensor *kiln_concat(int n, kiln_tensor *const *ts, int axis) {
  op_attrs a = no_attrs;
  if (n < 1 || !ts) {
    kiln_set_error("concat: needs at least one tensor, got %d", ts ? n : 0);
    return NULL;
  }
  for (int i = 0; i < n; i++)
    if (!ts[i]) return op_apply(OP_CONCAT, &a, n, ts); /* reports the NULL */
  if (axis_normalize("concat", axis, ts[0]->rank, &a.axis)) return NULL;
  if (n == 1) return kiln_identity(ts[0]);
  return op_apply(OP_CONCAT, &a, n, ts);
}

kiln_tensor *kiln_gather(kiln_tensor *params, kiln_tensor *indices, int axis) {
  op_attrs a = no_attrs;
  if (params && indices && axis_normalize("gather", axis, params->rank, &a.axis)) return NULL;
  return op_apply2(OP_GATHER, &a, params, indices);
}

/* ---- sources ---- */

kiln_tensor *kiln_arange(kiln_dtype dt, int64_t n) {
  if (n < 0) {
    kiln_set_error("arange: n = %lld is negative", (long long)n);
    return NULL;
  }
  op_attrs a = {.dtype = dt, .rank = 1, .shape = {n}};
  return op_apply(OP_IOTA, &a, 0, NULL);
}

static kiln_tensor *random_draw(op_id op, kiln_dtype dt, int rank, const int64_t *shape, double lo,
                                double hi) {
  const char *name = kiln_ops[op].api;
  int64_t size;
  if (shape_check(name, rank, shape, &size)) return NULL;
  if (!(lo <= hi) || !isfinite(lo) || !isfinite(hi)) { /* also rejects NaN */
    kiln_set_error("%s: need finite lo <= hi, got [%g, %g)", name, lo, hi);
    return NULL;
  }
  op_attrs a = {.dtype = dt, .rank = rank, .lo = lo, .hi = hi};
  for (int i = 0; i < rank; i++) a.shape[i] = shape[i];
  /* reserve only for a call that will run: a failed draw must not move the stream */
  if (!dtype_valid(dt) || !(kiln_ops[op].dtypes & DT_BIT(dt))) return op_apply(op, &a, 0, NULL);
  if (dtype_is_int(dt)) {
    double l = ceil(lo), h = ceil(hi), limit = dt == KILN_I32 ? 0x1p31 : 0x1p63;
    if (!(l < h)) {
      kiln_set_error("%s: empty integer range [%g, %g)", name, lo, hi);
      return NULL;
    }
    if (l < -limit || h > limit) {
      kiln_set_error("%s: range [%g, %g) does not fit %s", name, lo, hi, kiln_dtype_name(dt));
      return NULL;
    }
  } else if (dt == KILN_F32 && (fabs(lo) > 3.4028234663852886e38 || fabs(hi) > 3.4028234663852886e38)) {
    kiln_set_error("%s: range [%g, %g) does not fit f32", name, lo, hi);
    return NULL;
  }
  if (!trace_current) /* a traced draw takes its block at each call, not now */
    a.counter = rng_reserve(((uint64_t)size + 1) / 2, &a.seed);
  return op_apply(op, &a, 0, NULL);
}

kiln_tensor *kiln_random_uniform(kiln_dtype dt, int rank, const int64_t *shape, double lo, double hi) {
  return random_draw(OP_RNG_UNIFORM, dt, rank, shape, lo, hi);
}

kiln_tensor *kiln_random_normal(kiln_dtype dt, int rank, const int64_t *shape) {
  return random_draw(OP_RNG_NORMAL, dt, rank, shape, 0, 1);
}
