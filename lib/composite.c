/* composite.c — the public ops that are not primitives (square, mean,
 * expand_dims, softmax, cross-entropy, one_hot, ...), each written once from
 * the public primitive ops, so tapes, the tracer and the backends only ever
 * see the short list of ir/ops.def (DESIGN.md, "Keep the primitive set small"). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "autodiff.h"
#include "bn_eager.h"
#include "ops.h"
#include "../jit/jit.h"

/* Each composite checks its own arguments first, so that its errors begin
 * with its own name rather than that of a primitive it happens to use. */

static bool null_input(const char *op, const kiln_tensor *t) {
  if (t) return false;
  if (!kiln_has_error()) kiln_set_error("%s: input is NULL", op);
  return true;
}

static int check_dtype(const char *op, const kiln_tensor *t, unsigned mask) {
  kiln_dtype dt = (kiln_dtype)t->dtype;
  if (mask & DT_BIT(dt)) return 0;
  char list[64] = "";
  size_t used = 0;
  for (int d = 0; d < KILN_DTYPE_COUNT; d++)
    if (mask & DT_BIT(d))
      used += (size_t)snprintf(list + used, sizeof list - used, used ? ", %s" : "%s",
                               kiln_dtype_name((kiln_dtype)d));
  if (dt == KILN_F16 || dt == KILN_BF16)
    return kiln_set_error("%s: dtype %s is not supported (%s); %s is a storage type: kiln_cast it to f32 first",
                          op, kiln_dtype_name(dt), list, kiln_dtype_name(dt));
  return kiln_set_error("%s: dtype %s is not supported (%s)", op, kiln_dtype_name(dt), list);
}

/* Axes that insert a new dimension: [-rank-1, rank], normalised into *out. */
static int new_axis(const char *op, int axis, int rank, int *out) {
  if (axis < -rank - 1 || axis > rank)
    return kiln_set_error("%s: axis %d is out of range for rank %d (expected [%d, %d])", op, axis, rank,
                          -rank - 1, rank);
  if (rank == KILN_MAX_RANK)
    return kiln_set_error("%s: the result would have rank %d, more than %d", op, rank + 1, KILN_MAX_RANK);
  *out = axis < 0 ? axis + rank + 1 : axis;
  return 0;
}

/* A composite opens its own scope so that its intermediates die at the
 * pop; the result escapes to the caller's scope, or to the caller itself
 * when none is open: the ownership any returned tensor has. */
static kiln_tensor *finish(kiln_tensor *result) {
  if (result) result = kiln_scope_escape(result);
  kiln_scope_pop();
  return result;
}

/* ---- elementwise and reductions ---- */

kiln_tensor *kiln_square(kiln_tensor *a) {
  if (null_input("square", a) || check_dtype("square", a, DT_NUM)) return NULL;
  return kiln_mul(a, a);
}

/* sum / count. Integer tensors stay integers: the mean truncates toward
 * zero as integer div does (NumPy would return a float). The mean of an
 * empty axis is NaN for floats and an error for integers. */
kiln_tensor *kiln_reduce_mean(kiln_tensor *t, int naxes, const int *axes, bool keepdims) {
  const char *op = "reduce_mean";
  if (null_input(op, t) || check_dtype(op, t, DT_NUM)) return NULL;
  bool reduced[KILN_MAX_RANK] = {false};
  if (!axes) {
    for (int i = 0; i < t->rank; i++) reduced[i] = true;
  } else {
    if (naxes < 0 || naxes > t->rank) {
      kiln_set_error("%s: %d axes given for rank %d", op, naxes, t->rank);
      return NULL;
    }
    for (int i = 0; i < naxes; i++) {
      int ax;
      if (axis_normalize(op, axes[i], t->rank, &ax)) return NULL;
      if (reduced[ax]) {
        kiln_set_error("%s: axis %d is repeated", op, axes[i]);
        return NULL;
      }
      reduced[ax] = true;
    }
  }
  int64_t count = 1, kept = 1;
  for (int i = 0; i < t->rank; i++) {
    if (reduced[i])
      count *= t->shape[i];
    else
      kept *= t->shape[i];
  }
  if (dtype_is_int((kiln_dtype)t->dtype) && count == 0 && kept > 0) {
    kiln_set_error("%s: the mean of an empty axis is undefined for %s", op,
                   kiln_dtype_name((kiln_dtype)t->dtype));
    return NULL;
  }
  kiln_scope_push();
  kiln_tensor *sum = kiln_reduce_sum(t, naxes, axes, keepdims);
  if (count == 0 && kept == 0) return finish(sum); /* nothing to divide */
  return finish(kiln_div(sum, kiln_scalar_like(t, (double)count)));
}

/* ---- shape ---- */

kiln_tensor *kiln_expand_dims(kiln_tensor *t, int axis) {
  int ax = 0;
  if (null_input("expand_dims", t) || new_axis("expand_dims", axis, t->rank, &ax)) return NULL;
  int64_t shape[KILN_MAX_RANK];
  for (int i = 0, j = 0; i <= t->rank; i++) shape[i] = i == ax ? 1 : t->shape[j++];
  return kiln_reshape(t, t->rank + 1, shape);
}

kiln_tensor *kiln_squeeze(kiln_tensor *t, int axis) {
  int ax = 0;
  if (null_input("squeeze", t) || axis_normalize("squeeze", axis, t->rank, &ax)) return NULL;
  if (t->shape[ax] != 1) {
    kiln_set_error("squeeze: axis %d has size %lld, not 1", axis, (long long)t->shape[ax]);
    return NULL;
  }
  int64_t shape[KILN_MAX_RANK];
  for (int i = 0, j = 0; i < t->rank; i++)
    if (i != ax) shape[j++] = t->shape[i];
  return kiln_reshape(t, t->rank - 1, shape);
}

kiln_tensor *kiln_index(kiln_tensor *t, int64_t i) {
  if (null_input("index", t)) return NULL;
  if (t->rank == 0) {
    kiln_set_error("index: cannot index a scalar (rank 0)");
    return NULL;
  }
  int64_t n = t->shape[0];
  if (i < -n || i >= n) {
    kiln_set_error("index: i = %lld is not in [%lld, %lld)", (long long)i, (long long)-n, (long long)n);
    return NULL;
  }
  int64_t begin[KILN_MAX_RANK] = {i < 0 ? i + n : i}, size[KILN_MAX_RANK];
  size[0] = 1;
  for (int d = 1; d < t->rank; d++) size[d] = -1;
  kiln_scope_push();
  return finish(kiln_reshape(kiln_slice(t, begin, size), t->rank - 1, t->shape + 1));
}

kiln_tensor *kiln_stack(int n, kiln_tensor *const *ts, int axis) {
  const char *op = "stack";
  if (n < 1 || !ts) {
    kiln_set_error("%s: needs at least one tensor, got %d", op, ts ? n : 0);
    return NULL;
  }
  for (int k = 0; k < n; k++)
    if (null_input(op, ts[k])) return NULL;
  const kiln_tensor *t0 = ts[0];
  for (int k = 1; k < n; k++) {
    const kiln_tensor *t = ts[k];
    if (t->dtype != t0->dtype) {
      kiln_set_error("%s: tensor %d has dtype %s, tensor 0 has %s", op, k,
                     kiln_dtype_name((kiln_dtype)t->dtype), kiln_dtype_name((kiln_dtype)t0->dtype));
      return NULL;
    }
    bool same = t->rank == t0->rank;
    for (int d = 0; same && d < t->rank; d++) same = t->shape[d] == t0->shape[d];
    if (!same) {
      char a[160], b[160];
      kiln_set_error("%s: tensor %d has shape %s, tensor 0 has %s", op, k,
                     shape_str(a, sizeof a, t->rank, t->shape), shape_str(b, sizeof b, t0->rank, t0->shape));
      return NULL;
    }
  }
  int ax = 0;
  if (new_axis(op, axis, t0->rank, &ax)) return NULL;
  kiln_tensor **parts = malloc((size_t)n * sizeof *parts);
  if (!parts) {
    kiln_set_error("%s: out of memory", op);
    return NULL;
  }
  kiln_scope_push();
  for (int k = 0; k < n; k++) parts[k] = kiln_expand_dims(ts[k], ax);
  kiln_tensor *r = kiln_concat(n, parts, ax); /* reports a failed expand_dims */
  free(parts);
  return finish(r);
}

int kiln_split(kiln_tensor *t, int n, int axis, kiln_tensor **out) {
  const char *op = "split";
  int ax = 0;
  if (null_input(op, t)) return -1;
  if (!out) return kiln_set_error("%s: out is NULL", op);
  if (n < 1) return kiln_set_error("%s: n = %d must be positive", op, n);
  if (axis_normalize(op, axis, t->rank, &ax)) return -1;
  int64_t dim = t->shape[ax];
  if (dim % n)
    return kiln_set_error("%s: dimension %lld of axis %d is not divisible by %d", op, (long long)dim, axis,
                          n);
  kiln_tensor **parts = malloc((size_t)n * sizeof *parts);
  if (!parts) return kiln_set_error("%s: out of memory", op);
  int64_t begin[KILN_MAX_RANK] = {0}, size[KILN_MAX_RANK];
  for (int d = 0; d < t->rank; d++) size[d] = -1;
  size[ax] = dim / n;
  kiln_scope_push();
  int rc = 0;
  for (int k = 0; k < n && rc == 0; k++) {
    begin[ax] = k * size[ax];
    parts[k] = kiln_slice(t, begin, size);
    rc = parts[k] ? 0 : -1;
  }
  /* out is written only once every part exists: untouched on failure */
  for (int k = 0; k < n && rc == 0; k++) out[k] = kiln_scope_escape(parts[k]);
  kiln_scope_pop();
  free(parts);
  return rc;
}

/* equal(expand_dims(indices, -1), arange(depth)): an index outside
 * [0, depth) matches nothing and leaves its row all zeros, as in TF. */
kiln_tensor *kiln_one_hot(kiln_tensor *indices, int64_t depth, kiln_dtype dt) {
  const char *op = "one_hot";
  if (null_input(op, indices)) return NULL;
  kiln_dtype it = (kiln_dtype)indices->dtype;
  if (it != KILN_I32 && it != KILN_I64) {
    kiln_set_error("%s: indices must be i32 or i64, not %s", op, kiln_dtype_name(it));
    return NULL;
  }
  if (depth < 0) {
    kiln_set_error("%s: depth = %lld is negative", op, (long long)depth);
    return NULL;
  }
  if (!dtype_valid(dt)) {
    kiln_set_error("%s: invalid dtype %d", op, (int)dt);
    return NULL;
  }
  int ax = 0;
  if (new_axis(op, -1, indices->rank, &ax)) return NULL;
  int64_t shape[KILN_MAX_RANK], size;
  for (int d = 0; d < indices->rank; d++) shape[d] = indices->shape[d];
  shape[indices->rank] = depth;
  if (shape_check(op, indices->rank + 1, shape, &size)) return NULL; /* too large: named here */
  if (size == 0) return kiln_zeros(dt, indices->rank + 1, shape);    /* no arange(depth) to make */
  kiln_scope_push();
  kiln_tensor *idx = indices;
  if (it == KILN_I32 && depth > INT32_MAX) { /* arange(depth) would not fit in i32 */
    idx = kiln_cast(indices, KILN_I64);
    it = KILN_I64;
  }
  kiln_tensor *hot = kiln_equal(kiln_expand_dims(idx, -1), kiln_arange(it, depth));
  kiln_tensor *r = finish(dt == KILN_BOOL ? hot : kiln_cast(hot, dt));
  if (!r && strncmp(kiln_last_error(), "one_hot:", 8)) { /* out of memory in a part: say so as one_hot */
    char why[512];
    snprintf(why, sizeof why, "%s", kiln_last_error());
    kiln_set_error("%s: depth = %lld: %s", op, (long long)depth, why);
  }
  return r;
}

/* ---- neural-network helpers ---- */

static int float_along(const char *op, kiln_tensor *t, int axis, int *ax) {
  if (null_input(op, t) || check_dtype(op, t, DT_FLOAT)) return -1;
  return axis_normalize(op, axis, t->rank, ax);
}

/* t - max(t) along ax. The max only keeps exp from overflowing and cancels
 * out of the result, so no gradient flows through it. */
static kiln_tensor *shift_by_max(kiln_tensor *t, int ax) {
  return kiln_sub(t, kiln_stop_gradient(kiln_reduce_max(t, 1, &ax, true)));
}

kiln_tensor *kiln_softmax(kiln_tensor *t, int axis) {
  int ax = 0;
  if (float_along("softmax", t, axis, &ax)) return NULL;
  kiln_scope_push();
  kiln_tensor *e = kiln_exp(shift_by_max(t, ax));
  return finish(kiln_div(e, kiln_reduce_sum(e, 1, &ax, true)));
}

kiln_tensor *kiln_log_softmax(kiln_tensor *t, int axis) {
  int ax = 0;
  if (float_along("log_softmax", t, axis, &ax)) return NULL;
  kiln_scope_push();
  kiln_tensor *s = shift_by_max(t, ax);
  return finish(kiln_sub(s, kiln_log(kiln_reduce_sum(kiln_exp(s), 1, &ax, true))));
}

/* logits float, rank >= 1, classes on the last axis */
static int check_logits(const char *op, const kiln_tensor *logits) {
  if (check_dtype(op, logits, DT_FLOAT)) return -1;
  if (logits->rank == 0)
    return kiln_set_error("%s: logits need rank >= 1 (classes on the last axis), got a scalar", op);
  return 0;
}

kiln_tensor *kiln_softmax_cross_entropy(kiln_tensor *labels, kiln_tensor *logits) {
  const char *op = "softmax_cross_entropy";
  if (null_input(op, labels) || null_input(op, logits) || check_logits(op, logits)) return NULL;
  if (labels->dtype != logits->dtype) {
    kiln_set_error("%s: labels have dtype %s, logits %s", op, kiln_dtype_name((kiln_dtype)labels->dtype),
                   kiln_dtype_name((kiln_dtype)logits->dtype));
    return NULL;
  }
  bool same = labels->rank == logits->rank;
  for (int d = 0; same && d < logits->rank; d++) same = labels->shape[d] == logits->shape[d];
  if (!same) {
    char a[160], b[160];
    kiln_set_error("%s: labels shape %s does not match logits shape %s", op,
                   shape_str(a, sizeof a, labels->rank, labels->shape),
                   shape_str(b, sizeof b, logits->rank, logits->shape));
    return NULL;
  }
  int last = -1;
  kiln_scope_push();
  kiln_tensor *picked = kiln_mul(labels, kiln_log_softmax(logits, -1));
  return finish(kiln_neg(kiln_reduce_sum(picked, 1, &last, false)));
}

/* Concrete labels are checked here so that a bad one is reported under this
 * op's name with its position; returns 0 / -1. */
static int check_labels(const char *op, const kiln_tensor *labels, int64_t classes) {
  if (labels->flags & TF_SYMBOLIC) return 0;
  if (labels->device != 0) { /* a GPU's labels: read back (a few bytes per example) */
    kiln_scope_push();
    kiln_tensor *host = kiln_to_device((kiln_tensor *)labels, "cpu");
    int rc = host ? check_labels(op, host, classes) : -1;
    kiln_scope_pop();
    return rc;
  }
  for (int64_t i = 0; i < labels->size; i++) {
    int64_t v = labels->dtype == KILN_I32 ? ((const int32_t *)labels->data)[i]
                                          : ((const int64_t *)labels->data)[i];
    if (v >= 0 && v < classes) continue;
    char where[200] = "";
    size_t used = 0;
    int64_t stride = labels->size;
    for (int d = 0; d < labels->rank; d++) { /* the row-major index of element i */
      stride /= labels->shape[d];
      used += (size_t)snprintf(where + used, sizeof where - used, d ? ", %lld" : "[%lld",
                               (long long)(i / stride % labels->shape[d]));
    }
    if (labels->rank > 0) snprintf(where + used, sizeof where - used, "]");
    return kiln_set_error("%s: labels%s = %lld is not in [0, %lld)", op, where, (long long)v,
                          (long long)classes);
  }
  return 0;
}

/* check_labels at each call of a staged function: a host call that passes
 * the labels on (so that the gather after it waits for it) and fails as the
 * eager op does, naming this op and the label. The class count comes as the
 * shape of an empty [0, classes] tensor, not as user data, so that the call
 * is named and saved like any other (host_names.c). On a GPU the host step
 * copies the labels to the host and back. */
int composite_check_labels_host(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_out;
  if (n_in != 2 || in[1]->rank != 2) return kiln_set_error("sparse_softmax_cross_entropy: bad label check");
  if (check_labels("sparse_softmax_cross_entropy", in[0], in[1]->shape[1])) return -1;
  return (out[0] = kiln_identity(in[0])) ? 0 : -1;
}

static kiln_tensor *staged_label_check(kiln_tensor *labels, int64_t classes) {
  kiln_spec spec = {(kiln_dtype)labels->dtype, labels->rank, {0}};
  for (int d = 0; d < labels->rank; d++) spec.shape[d] = labels->shape[d];
  kiln_tensor *checked = NULL, *in[2] = {labels, kiln_zeros(KILN_BOOL, 2, (const int64_t[]){0, classes})};
  if (!in[1] || kiln_host_call(composite_check_labels_host, NULL, 2, in, 1, &spec, &checked)) return NULL;
  return checked;
}

/* -log_softmax(logits)[label] per example, picked by one gather from the
 * flattened log-probabilities at row * classes + label (O(examples), where
 * one_hot would cost O(examples * classes)). */
kiln_tensor *kiln_sparse_softmax_cross_entropy(kiln_tensor *labels, kiln_tensor *logits) {
  const char *op = "sparse_softmax_cross_entropy";
  if (null_input(op, labels) || null_input(op, logits) || check_logits(op, logits)) return NULL;
  if (labels->dtype != KILN_I32 && labels->dtype != KILN_I64) {
    kiln_set_error("%s: labels must be i32 or i64, not %s", op, kiln_dtype_name((kiln_dtype)labels->dtype));
    return NULL;
  }
  bool same = labels->rank == logits->rank - 1;
  for (int d = 0; same && d < labels->rank; d++) same = labels->shape[d] == logits->shape[d];
  if (!same) {
    char a[160], b[160];
    kiln_set_error("%s: labels shape %s does not match logits shape %s without its last axis", op,
                   shape_str(a, sizeof a, labels->rank, labels->shape),
                   shape_str(b, sizeof b, logits->rank, logits->shape));
    return NULL;
  }
  int64_t classes = logits->shape[logits->rank - 1], n = labels->size;
  if (check_labels(op, labels, classes)) return NULL;
  kiln_scope_push();
  if ((labels->flags & TF_SYMBOLIC) && !(labels = staged_label_check(labels, classes)))
    return finish(NULL);
  kiln_tensor *flat = kiln_reshape(kiln_log_softmax(logits, -1), 1, (int64_t[]){n * classes});
  kiln_tensor *label = kiln_reshape(labels->dtype == KILN_I64 ? labels : kiln_cast(labels, KILN_I64), 1,
                                    (int64_t[]){n});
  kiln_tensor *row_start = kiln_mul(kiln_arange(KILN_I64, n), kiln_scalar(KILN_I64, (double)classes));
  kiln_tensor *at = kiln_add(row_start, label);
  kiln_tensor *picked = kiln_gather(flat, at, 0);
  return finish(kiln_neg(kiln_reshape(picked, labels->rank, labels->shape)));
}

/* t * max_norm / max(l2norm(t), max_norm), the norm taken over all of t.
 * As TF does, the square root is kept away from 0 so that the gradient at
 * t = 0 is finite rather than NaN. */
kiln_tensor *kiln_clip_by_norm(kiln_tensor *t, double max_norm) {
  const char *op = "clip_by_norm";
  if (null_input(op, t) || check_dtype(op, t, DT_FLOAT)) return NULL;
  if (!(max_norm > 0) || isinf(max_norm)) {
    kiln_set_error("%s: max_norm = %g must be positive and finite", op, max_norm);
    return NULL;
  }
  kiln_scope_push();
  kiln_tensor *m = kiln_scalar_like(t, max_norm), *zero = kiln_scalar_like(t, 0);
  kiln_tensor *sum2 = kiln_reduce_sum(kiln_square(t), 0, NULL, false);
  kiln_tensor *pos = kiln_greater(sum2, zero);
  kiln_tensor *norm = kiln_select(pos, kiln_sqrt(kiln_select(pos, sum2, kiln_scalar_like(t, 1))), zero);
  return finish(kiln_mul(t, kiln_div(m, kiln_maximum(norm, m))));
}

/* ---- convolutional networks (API.md §10): the composites ---- */

/* t with before[i] and after[i] elements of value around axis i: one
 * concat per padded axis, the pads broadcasts of one scalar (they fuse). */
kiln_tensor *kiln_pad(kiln_tensor *t, const int64_t *before, const int64_t *after, double value) {
  const char *op = "pad";
  if (null_input(op, t)) return NULL;
  if (t->rank > 0 && (!before || !after)) {
    kiln_set_error("%s: %s is NULL", op, before ? "after" : "before");
    return NULL;
  }
  int64_t shape[KILN_MAX_RANK], size;
  for (int i = 0; i < t->rank; i++) {
    if (before[i] < 0 || after[i] < 0) {
      kiln_set_error("%s: negative padding on axis %d (before %lld, after %lld)", op, i, (long long)before[i],
                     (long long)after[i]);
      return NULL;
    }
    if (KILN_ADD_OVERFLOW(t->shape[i], before[i], &shape[i]) || KILN_ADD_OVERFLOW(shape[i], after[i], &shape[i])) {
      kiln_set_error("%s: axis %d overflows with its padding", op, i);
      return NULL;
    }
  }
  if (shape_check(op, t->rank, shape, &size)) return NULL;
  kiln_scope_push();
  kiln_tensor *cur = t, *fill = kiln_scalar_like(t, value);
  for (int i = 0; i < t->rank && cur; i++) {
    if (!before[i] && !after[i]) continue;
    kiln_tensor *parts[3];
    int n = 0;
    int64_t part[KILN_MAX_RANK];
    memcpy(part, cur->shape, sizeof part);
    if (before[i]) part[i] = before[i], parts[n++] = kiln_broadcast_to(fill, cur->rank, part);
    parts[n++] = cur;
    if (after[i]) part[i] = after[i], parts[n++] = kiln_broadcast_to(fill, cur->rank, part);
    cur = kiln_concat(n, parts, i);
  }
  return finish(cur == t ? kiln_identity(t) : cur);
}

/* Does p broadcast to x's shape without changing it? */
static int broadcasts_into(const char *op, const char *what, const kiln_tensor *p, const kiln_tensor *x) {
  if (p->dtype != x->dtype)
    return kiln_set_error("%s: %s has dtype %s, x %s", op, what, kiln_dtype_name((kiln_dtype)p->dtype),
                          kiln_dtype_name((kiln_dtype)x->dtype));
  bool ok = p->rank <= x->rank;
  for (int i = 0; ok && i < p->rank; i++) {
    int64_t d = p->shape[p->rank - 1 - i];
    ok = d == 1 || d == x->shape[x->rank - 1 - i];
  }
  if (ok) return 0;
  char a[160], b[160];
  return kiln_set_error("%s: %s of shape %s does not broadcast to x's shape %s", op, what,
                        shape_str(a, sizeof a, p->rank, p->shape), shape_str(b, sizeof b, x->rank, x->shape));
}

/* batch_norm on a tape is one node (as PyTorch's native_batch_norm): its
 * inputs x, mean, variance + epsilon, then offset and scale where given;
 * the backward recomputes x - mean and rsqrt from them instead of the tape
 * keeping the op-by-op intermediates (two tensors of x's size per batch
 * norm). bn_forms[offset + 2 * scale] says which are given.
 *
 * Eagerly, when mean and variance are kiln_moments of x per channel taken
 * on the same (only) tape, the node is linked (bn_link): its gradient of x
 * is the whole of it, through mean and variance too, as PyTorch's training
 * batch norm's is (dx = a dy + b (x - mean) + c per channel, one pass), and
 * it gives mean and variance none, unless the walk asks for their own
 * gradients. Else moments' nodes carried those parts back to x: a
 * broadcast, a pass over x - mean and two adds of x's size. */
typedef struct {
  bool offset, scale;
  bool linked; /* the form of a bn_link */
} bn_form;
static const bn_form bn_forms[4] = {{false, false, false}, {true, false, false}, {false, true, false}, {true, true, false}};

typedef struct {
  bn_form form; /* first: bn_forward reads it */
  atomic_int refs;
  const kiln_tensor *variance; /* the moments' variance (held by the tape's node for it) */
} bn_link;

static void link_retain(void *user) { atomic_fetch_add(&((bn_link *)user)->refs, 1); }
static void link_release(void *user) {
  if (atomic_fetch_sub(&((bn_link *)user)->refs, 1) == 1) free(user);
}
static const tape_closure link_closure = {link_retain, link_release, "batch_norm"};
static int var_gradient(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs);

static kiln_tensor *bn_forward(void *user, int n, kiln_tensor *const *xs) {
  const bn_form *b = user;
  (void)n;
  kiln_tensor *offset = b->offset ? xs[3] : NULL, *scale = b->scale ? xs[3 + b->offset] : NULL;
  kiln_tensor *fast = bn_eager_forward(xs[0], xs[1], xs[2], scale, offset);
  if (fast || kiln_has_error()) return fast;
  kiln_tensor *y = kiln_mul(kiln_sub(xs[0], xs[1]), kiln_rsqrt(xs[2]));
  if (scale) y = kiln_mul(y, scale);
  return offset ? kiln_add(y, offset) : y;
}

static bool same_shape(const kiln_tensor *a, const kiln_tensor *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

/* The linked node's gradient (bn_link): with N elements per channel,
 * s0 = sum(dy), s1 = sum(dy (x - m)), g = s r,
 * dx = g dy - g r^2 s1 / N (x - m) - g s0 / N. */
static int bn_linked_gradient(const bn_form *b, kiln_tensor *const *xs, kiln_tensor *dy, kiln_tensor **dxs) {
  kiln_tensor *x = xs[0], *mean = xs[1], *ve = xs[2];
  kiln_tensor *offset = b->offset ? xs[3] : NULL, *scale = b->scale ? xs[3 + b->offset] : NULL;
  kiln_tensor *r = kiln_rsqrt(ve), *s0, *s1;
  int rc = bn_eager_sums(dy, x, mean, &s0, &s1); /* eagerly: one pass over dy and x */
  if (rc < 0) return -1;
  if (rc > 0) { /* on a tape: the public ops */
    s0 = grad_unbroadcast(dy, ve);
    s1 = grad_unbroadcast(kiln_mul(dy, kiln_sub(x, mean)), ve);
  }
  kiln_tensor *inv_n = kiln_scalar_like(ve, (double)kiln_tensor_size(ve) / (double)kiln_tensor_size(x));
  kiln_tensor *g = scale ? kiln_mul(scale, r) : r;
  kiln_tensor *bx = kiln_neg(kiln_mul(kiln_mul(g, kiln_mul(r, r)), kiln_mul(s1, inv_n)));
  kiln_tensor *c = kiln_neg(kiln_mul(g, kiln_mul(s0, inv_n)));
  dxs[0] = g && bx && c ? bn_eager_dx(dy, x, mean, g, bx, c) : NULL; /* eagerly: one pass */
  if (!dxs[0] && !kiln_has_error()) dxs[0] = kiln_add(kiln_add(kiln_mul(dy, g), kiln_mul(kiln_sub(x, mean), bx)), c);
  dxs[1] = dxs[2] = NULL;
  if (offset) dxs[3] = kiln_reshape(s0, offset->rank, offset->shape);
  if (scale) dxs[3 + b->offset] = kiln_reshape(kiln_mul(s1, r), scale->rank, scale->shape);
  return dxs[0] && (!offset || dxs[3]) && (!scale || dxs[3 + b->offset]) ? 0 : -1;
}

/* y = (x - m) * r * s + o with r = rsqrt(v): dx = dy s r, dm = -sum(dy s r),
 * dv = sum(dy s (x - m)) * -r^3 / 2, do = sum(dy), ds = sum(dy (x - m) r),
 * each summed over the axes its input broadcast along. Public ops only, so
 * outer tapes differentiate it again. */
static int bn_gradient(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  const bn_form *b = user;
  (void)y;
  kiln_tensor *x = xs[0], *mean = xs[1], *ve = xs[2];
  if (b->linked && !tape_walk_source(mean) && !tape_walk_source(((const bn_link *)user)->variance))
    return bn_linked_gradient(b, xs, dy, dxs);
  kiln_tensor *offset = b->offset ? xs[3] : NULL, *scale = b->scale ? xs[3 + b->offset] : NULL;
  kiln_tensor *r = kiln_rsqrt(ve), *xm = NULL;
  if (same_shape(mean, ve) && (!offset || same_shape(offset, ve)) && (!scale || same_shape(scale, ve))) {
    /* the statistics and parameters share one shape (per channel, as a
     * batch norm's do): their factors are constant along the axes summed,
     * so two sums serve every gradient, s0 = sum(dy) and s1 = sum(dy (x -
     * m)), and x's takes one pass (three full-size ops in all, was seven) */
    kiln_tensor *s0, *s1;
    int rc = bn_eager_sums(dy, x, mean, &s0, &s1); /* eagerly: one pass over dy and x */
    if (rc < 0) return -1;
    if (rc > 0) { /* traced, or on a tape: the public ops */
      xm = kiln_sub(x, mean);
      s0 = grad_unbroadcast(dy, ve);
      s1 = grad_unbroadcast(kiln_mul(dy, xm), ve);
    }
    kiln_tensor *sr = scale ? kiln_mul(scale, r) : r;
    dxs[0] = kiln_mul(dy, sr);
    dxs[1] = kiln_neg(kiln_mul(s0, sr));
    dxs[2] = kiln_mul(s1, kiln_mul(sr, kiln_mul(kiln_mul(r, r), kiln_scalar_like(ve, -0.5))));
    if (offset) dxs[3] = s0;
    if (scale) dxs[3 + b->offset] = kiln_mul(s1, r);
  } else { /* any shapes that broadcast into x: each sum over its own input's axes */
    xm = kiln_sub(x, mean);
    kiln_tensor *g = scale ? kiln_mul(dy, scale) : dy, *gr = kiln_mul(g, r);
    dxs[0] = gr;
    dxs[1] = grad_unbroadcast(kiln_neg(gr), mean);
    kiln_tensor *r3 = kiln_mul(kiln_mul(r, r), kiln_mul(r, kiln_scalar_like(ve, -0.5)));
    dxs[2] = kiln_mul(grad_unbroadcast(kiln_mul(g, xm), ve), r3);
    if (offset) dxs[3] = grad_unbroadcast(dy, offset);
    if (scale) dxs[3 + b->offset] = grad_unbroadcast(kiln_mul(dy, kiln_mul(xm, r)), scale);
  }
  for (int i = 0; i < n; i++)
    if (!dxs[i]) return -1;
  return 0;
}

static bool moments_link(kiln_tensor *x, kiln_tensor *mean, kiln_tensor *variance, kiln_tensor *offset,
                         kiln_tensor *scale);

/* (x - mean) * rsqrt(variance + epsilon) * scale + offset, in that order:
 * folding the per-channel factors first (x * a + b) would save passes over
 * x eagerly but gives NaN where this gives infinities (an infinite scale). */
kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *mean, kiln_tensor *variance, kiln_tensor *offset,
                             kiln_tensor *scale, double epsilon) {
  const char *op = "batch_norm";
  if (null_input(op, x) || null_input(op, mean) || null_input(op, variance)) return NULL;
  if (check_dtype(op, x, DT_FLOAT) || broadcasts_into(op, "mean", mean, x) ||
      broadcasts_into(op, "variance", variance, x) || (offset && broadcasts_into(op, "offset", offset, x)) ||
      (scale && broadcasts_into(op, "scale", scale, x)))
    return NULL;
  if (!(epsilon >= 0) || isinf(epsilon)) {
    kiln_set_error("%s: epsilon = %g must be finite and >= 0", op, epsilon);
    return NULL;
  }
  kiln_scope_push();
  kiln_tensor *xs[5] = {x, mean, kiln_add(variance, kiln_scalar_like(variance, epsilon))};
  int n = 3;
  if (offset) xs[n++] = offset;
  if (scale) xs[n++] = scale;
  if (!xs[2]) return finish(NULL);
  const bn_form *form = &bn_forms[(offset != NULL) + 2 * (scale != NULL)];
  if (!moments_link(x, mean, variance, offset, scale))
    return finish(kiln_custom_gradient(bn_forward, bn_gradient, (void *)form, n, xs));
  bn_link *link = malloc(sizeof *link);
  if (!link) {
    kiln_set_error("%s: out of memory", op);
    return finish(NULL);
  }
  link->form = *form;
  link->form.linked = true;
  atomic_init(&link->refs, 1);
  link->variance = variance;
  kiln_tensor *y = tape_custom_gradient(bn_forward, bn_gradient, link, &link_closure, n, xs);
  link_release(link);
  return finish(y);
}

/* Are mean and variance kiln_moments of x over every axis but the last,
 * recorded just now on the only active tape, eagerly on the CPU, with the
 * offset and scale one value per channel (bn_link)? */
static bool moments_link(kiln_tensor *x, kiln_tensor *mean, kiln_tensor *variance, kiln_tensor *offset,
                         kiln_tensor *scale) {
  if (tape_active_count != 1 || trace_current || (x->flags & TF_SYMBOLIC) || x->device || x->rank < 1) return false;
  kiln_tensor *const *vin, *const *rin;
  if (tape_recent(variance, OP_COUNT, var_gradient, &vin) != 2 || vin[0] != x) return false;
  kiln_tensor *m = vin[1];
  if (m != mean && (tape_recent(mean, OP_RESHAPE, NULL, &rin) != 1 || rin[0] != m)) return false;
  int64_t C = x->shape[x->rank - 1];
  const kiln_tensor *per[4] = {m, variance, offset, scale};
  for (int k = 0; k < 4; k++) {
    if (!per[k]) continue;
    if (per[k]->size != C || per[k]->rank < 1 || per[k]->rank > x->rank || per[k]->shape[per[k]->rank - 1] != C)
      return false;
  }
  return m->rank == x->rank && x->size > C;
}

/* The variance of moments on a tape is one node of x and the mean (kept
 * dims): its backward, dx = dv * 2 (x - mean) / n, recomputes x - mean
 * instead of the tape keeping it, and gives the mean none (its part,
 * sum(x - mean) = 0 times dv, vanishes). Written with public ops on the
 * mean as given, so an outer tape sees x - mean depend on x through the
 * mean too (second derivatives: the stop_gradient this replaces cut it). */
typedef struct {
  atomic_int refs;
  int naxes, axes[KILN_MAX_RANK];
  bool keepdims;
} var_node;

static void var_retain(void *user) { atomic_fetch_add(&((var_node *)user)->refs, 1); }
static void var_release(void *user) {
  if (atomic_fetch_sub(&((var_node *)user)->refs, 1) == 1) free(user);
}
static const tape_closure var_closure = {var_retain, var_release, "moments"};

static kiln_tensor *var_forward(void *user, int n, kiln_tensor *const *xs) {
  const var_node *v = user;
  (void)n;
  int64_t shape[KILN_MAX_RANK];
  int rank = 0;
  for (int i = 0, k = 0; i < xs[0]->rank; i++) {
    bool reduced = k < v->naxes && v->axes[k] == i;
    k += reduced;
    if (!reduced || v->keepdims) shape[rank++] = reduced ? 1 : xs[0]->shape[i];
  }
  kiln_tensor *fast;
  int rc = bn_eager_variance(xs[0], xs[1], rank, shape, &fast); /* eagerly: one pass over x */
  if (rc <= 0) return rc ? NULL : fast;
  kiln_tensor *d = kiln_sub(xs[0], xs[1]);
  return kiln_reduce_mean(kiln_mul(d, d), v->naxes, v->axes, v->keepdims);
}

static int var_gradient(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  (void)user, (void)n, (void)y;
  kiln_tensor *x = xs[0], *mean = xs[1];
  double count = (double)kiln_tensor_size(x) / (double)kiln_tensor_size(mean);
  kiln_tensor *dv = kiln_reshape(dy, mean->rank, mean->shape); /* the kept dims broadcast it */
  kiln_tensor *k = kiln_mul(dv, kiln_scalar_like(x, 2.0 / count));
  dxs[0] = k ? bn_eager_centered_scale(x, mean, k) : NULL; /* eagerly: one pass */
  if (!dxs[0] && !kiln_has_error() && k) dxs[0] = kiln_mul(kiln_sub(x, mean), k);
  dxs[1] = NULL;
  return dxs[0] ? 0 : -1;
}

/* mean(x) and mean((x - mean)^2) over axes. */
int kiln_moments(kiln_tensor *x, int naxes, const int *axes, bool keepdims, kiln_tensor **mean,
                 kiln_tensor **variance) {
  const char *op = "moments";
  if (null_input(op, x)) return -1;
  if (!mean || !variance) return kiln_set_error("%s: %s is NULL", op, mean ? "variance" : "mean");
  if (check_dtype(op, x, DT_FLOAT)) return -1;
  bool reduced[KILN_MAX_RANK] = {false};
  if (!axes) {
    for (int i = 0; i < x->rank; i++) reduced[i] = true;
  } else {
    if (naxes < 0 || naxes > x->rank) return kiln_set_error("%s: %d axes given for rank %d", op, naxes, x->rank);
    for (int i = 0; i < naxes; i++) {
      int ax;
      if (axis_normalize(op, axes[i], x->rank, &ax)) return -1;
      if (reduced[ax]) return kiln_set_error("%s: axis %d is repeated", op, axes[i]);
      reduced[ax] = true;
    }
  }
  int64_t shape[KILN_MAX_RANK];
  int rank = 0;
  for (int i = 0; i < x->rank; i++)
    if (!reduced[i]) shape[rank++] = x->shape[i];
  var_node *node = malloc(sizeof *node);
  if (!node) return kiln_set_error("%s: out of memory", op);
  atomic_init(&node->refs, 1);
  node->naxes = 0;
  for (int i = 0; i < x->rank; i++)
    if (reduced[i]) node->axes[node->naxes++] = i;
  node->keepdims = keepdims;
  kiln_scope_push();
  kiln_tensor *m = kiln_reduce_mean(x, naxes, axes, true);
  kiln_tensor *v = m ? tape_custom_gradient(var_forward, var_gradient, node, &var_closure, 2, (kiln_tensor *[]){x, m})
                     : NULL;
  var_release(node);
  if (!keepdims) m = kiln_reshape(m, rank, shape);
  int rc = m && v ? 0 : -1;
  if (!rc) {
    *mean = kiln_scope_escape(m);
    *variance = kiln_scope_escape(v);
  }
  kiln_scope_pop();
  return rc;
}

/* select(u >= rate, x / (1 - rate), 0): the draw is an op like any other,
 * so a staged function draws a new mask at each call. */
kiln_tensor *kiln_dropout(kiln_tensor *x, double rate) {
  const char *op = "dropout";
  if (null_input(op, x) || check_dtype(op, x, DT_FLOAT)) return NULL;
  if (!(rate >= 0 && rate < 1)) {
    kiln_set_error("%s: rate = %g is not in [0, 1)", op, rate);
    return NULL;
  }
  if (rate == 0) return kiln_identity(x);
  kiln_scope_push();
  kiln_tensor *u = kiln_random_uniform((kiln_dtype)x->dtype, x->rank, x->shape, 0, 1);
  kiln_tensor *keep = kiln_greater_equal(u, kiln_scalar_like(x, rate));
  kiln_tensor *kept = kiln_mul(x, kiln_scalar_like(x, 1 / (1 - rate)));
  return finish(kiln_select(keep, kept, kiln_scalar_like(x, 0)));
}
