/* bn_eager.c — batch norm's eager CPU passes, and the relu gradient that
 * follows batch norm's backward in a conv block (bn_eager.h). Per-channel
 * statistics and parameters are spread into vectors along the last axis
 * (a scalar repeated), so each row's loop is branch-free and vectorises.
 * The elementwise passes compute each element with the op-by-op roundings
 * in the same order ((x - m) * r, * s, + o; no contraction: ISO C), so
 * their bits equal the public ops' while x is read once and y written once
 * instead of a pass each way per op. */
#include <stdlib.h>
#include <string.h>

#include "autodiff.h"
#include "bn_eager.h"
#include "../jit/jit.h"

/* x is a dense float tensor on the CPU, outside a trace */
static bool eager_cpu(const kiln_tensor *x) {
  return !trace_current && !device_now && !x->device && !(x->flags & TF_SYMBOLIC) && x->rank >= 1 && x->size >= 1 &&
         (x->dtype == KILN_F32 || x->dtype == KILN_F64);
}

/* p broadcasts into x's last axis only: one value, or one per channel */
static bool per_channel(const kiln_tensor *p, const kiln_tensor *x) {
  if (!p) return true;
  if (p->device || (p->flags & TF_SYMBOLIC) || p->dtype != x->dtype) return false;
  if (p->size == 1) return true;
  for (int i = 0; i + 1 < p->rank; i++)
    if (p->shape[i] != 1) return false;
  return p->rank >= 1 && p->rank <= x->rank && p->shape[p->rank - 1] == x->shape[x->rank - 1];
}

/* dst[c] = p's value for channel c (NULL: neutral) */
#define BN_SPREAD(T)                                                                                     \
  static void bn_spread_##T(T *dst, const kiln_tensor *p, T neutral, int64_t C) {                        \
    for (int64_t c = 0; c < C; c++) dst[c] = !p ? neutral : ((const T *)p->data)[p->size == 1 ? 0 : c]; \
  }
BN_SPREAD(float)
BN_SPREAD(double)

/* ---- y = (x - p0) * p1 * p2 + p3 ---- */

typedef struct {
  kiln_tensor *y;
  const kiln_tensor *x;
  const void *p; /* per channel: p0, p1, p2, p3; C values each */
  int64_t channels;
} affine_pass;

/* An absent p2 is 1 and an absent p3 -0 (v * 1 and v + -0 are v, bit for
 * bit, -0 and NaN included). */
#define AFFINE_ROWS(T)                                                                                        \
  KILN_HOT static void affine_rows_##T(const affine_pass *b, int64_t r0, int64_t r1) {                       \
    int64_t C = b->channels;                                                                                \
    const T *KILN_RESTRICT m = b->p, *KILN_RESTRICT r = m + C, *KILN_RESTRICT s = r + C, *KILN_RESTRICT o = s + C; \
    for (int64_t row = r0; row < r1; row++) {                                                               \
      const T *KILN_RESTRICT x = (const T *)b->x->data + row * C;                                           \
      T *KILN_RESTRICT y = (T *)b->y->data + row * C;                                                       \
      for (int64_t c = 0; c < C; c++) y[c] = (x[c] - m[c]) * r[c] * s[c] + o[c];                            \
    }                                                                                                       \
  }
AFFINE_ROWS(float)
AFFINE_ROWS(double)

static void affine_rows(void *ctx, int64_t r0, int64_t r1) {
  const affine_pass *b = ctx;
  if (b->x->dtype == KILN_F32)
    affine_rows_float(b, r0, r1);
  else
    affine_rows_double(b, r0, r1);
}

/* The result of x's shape and dtype, and src's per-channel values spread
 * into four vectors of C (from the allocator's caches; an absent src[k]
 * is neutral[k]); NULL with the error set. */
static kiln_tensor *pass_setup(const char *op, kiln_tensor *x, const kiln_tensor *const src[4], const double neutral[4],
                               mem_scratch *scratch, void **p) {
  kiln_tensor *y = tensor_alloc(op, (kiln_dtype)x->dtype, x->rank, x->shape);
  if (!y) return NULL;
  int64_t C = x->shape[x->rank - 1];
  if (!(*p = mem_scratch_get(scratch, 4 * (size_t)C * kiln_dtype_sizes[x->dtype]))) {
    kiln_release(y);
    kiln_set_error("%s: out of memory", op);
    return NULL;
  }
  for (int k = 0; k < 4; k++) {
    if (x->dtype == KILN_F32)
      bn_spread_float((float *)*p + k * C, src[k], (float)neutral[k], C);
    else
      bn_spread_double((double *)*p + k * C, src[k], neutral[k], C);
  }
  return y;
}

static kiln_tensor *affine(const char *op, kiln_tensor *x, const kiln_tensor *const src[4]) {
  static const double neutral[4] = {-0.0, -0.0, 1.0, -0.0};
  mem_scratch scratch;
  void *p;
  kiln_tensor *y = pass_setup(op, x, src, neutral, &scratch, &p);
  if (!y) return NULL;
  int64_t C = x->shape[x->rank - 1];
  affine_pass b = {y, x, p, C};
  parallel_for(x->size / C, (16384 + C - 1) / C, affine_rows, &b);
  mem_scratch_put(&scratch);
  return scope_own(y);
}

kiln_tensor *bn_eager_forward(kiln_tensor *x, kiln_tensor *mean, kiln_tensor *ve, kiln_tensor *scale,
                              kiln_tensor *offset) {
  if (!eager_cpu(x) || !per_channel(mean, x) || !per_channel(ve, x) || !per_channel(scale, x) ||
      !per_channel(offset, x))
    return NULL;
  kiln_tensor *r = kiln_rsqrt(ve);
  return r ? affine("batch_norm", x, (const kiln_tensor *[4]){mean, r, scale, offset}) : NULL;
}

kiln_tensor *bn_eager_centered_scale(kiln_tensor *x, kiln_tensor *a, kiln_tensor *b) {
  if (tape_active_count || !eager_cpu(x) || !per_channel(a, x) || !per_channel(b, x)) return NULL;
  return affine("moments", x, (const kiln_tensor *[4]){a, b, NULL, NULL});
}

/* ---- per-channel sums: s0 = sum(dy), s1 = sum(dy (x - m)); or s0 = sum((x - m)^2) ----
 * Blocks of SUM_ROWS_ELEMS / C rows (at least one), each summed row by row
 * into its own partials; the blocks' partials then added in block order
 * (f32 in f64), so the sums are the same whatever the thread count. */
enum { SUM_ROWS_ELEMS = 4096 };

typedef struct {
  const void *dy, *x, *m; /* dy NULL: the centred sum of squares */
  void *part;             /* per block: s0 then s1, C each, of the element type */
  int64_t channels, rows, block;
  bool f32;
} sums_pass;

#define SUM_ROWS(T)                                                                                         \
  KILN_HOT static void sum_rows_##T(const sums_pass *p, int64_t b0, int64_t b1) {                          \
    int64_t C = p->channels;                                                                              \
    const T *KILN_RESTRICT m = p->m;                                                                      \
    for (int64_t blk = b0; blk < b1; blk++) {                                                             \
      T *KILN_RESTRICT s0 = (T *)p->part + blk * 2 * C, *KILN_RESTRICT s1 = s0 + C;                       \
      for (int64_t c = 0; c < C; c++) s0[c] = 0, s1[c] = 0;                                               \
      int64_t end = (blk + 1) * p->block < p->rows ? (blk + 1) * p->block : p->rows;                      \
      for (int64_t row = blk * p->block; row < end; row++) {                                              \
        const T *KILN_RESTRICT x = (const T *)p->x + row * C;                                             \
        if (!p->dy) {                                                                                     \
          for (int64_t c = 0; c < C; c++) s0[c] += (x[c] - m[c]) * (x[c] - m[c]);                         \
          continue;                                                                                       \
        }                                                                                                 \
        const T *KILN_RESTRICT dy = (const T *)p->dy + row * C;                                           \
        for (int64_t c = 0; c < C; c++) {                                                                 \
          s0[c] += dy[c];                                                                                 \
          s1[c] += dy[c] * (x[c] - m[c]);                                                                 \
        }                                                                                                 \
      }                                                                                                   \
    }                                                                                                     \
  }
SUM_ROWS(float)
SUM_ROWS(double)

static void sum_rows(void *ctx, int64_t b0, int64_t b1) {
  const sums_pass *p = ctx;
  if (p->f32)
    sum_rows_float(p, b0, b1);
  else
    sum_rows_double(p, b0, b1);
}

/* The per-channel sums of x (and dy) into t0 (and t1), each scaled by
 * `scale` (in f64, before the rounding to T). */
static int channel_sums(const char *op, kiln_tensor *dy, kiln_tensor *x, kiln_tensor *mean, double scale,
                        kiln_tensor *t0, kiln_tensor *t1) {
  int64_t C = mean->size, rows = x->size / C, block = SUM_ROWS_ELEMS / C > 0 ? SUM_ROWS_ELEMS / C : 1;
  int64_t blocks = (rows + block - 1) / block;
  bool f32 = x->dtype == KILN_F32;
  size_t es = kiln_dtype_sizes[x->dtype];
  mem_scratch scratch, total;
  void *part = mem_scratch_get(&scratch, (size_t)(blocks * 2 * C) * es);
  double *sum = mem_scratch_get(&total, 2 * (size_t)C * sizeof *sum);
  if (!part || !sum) {
    mem_scratch_put(&scratch), mem_scratch_put(&total);
    return kiln_set_error("%s: out of memory", op);
  }
  sums_pass p = {dy ? dy->data : NULL, x->data, mean->data, part, C, rows, block, f32};
  parallel_for(blocks, 1, sum_rows, &p);
  /* block by block, each channel's partials added in block order (row by
   * row through part: channel by channel, each block a cache line apart,
   * took longer than the pass over x) */
  for (int64_t k = 0; k < 2 * C; k++) sum[k] = 0;
  for (int64_t blk = 0; blk < blocks; blk++) {
    if (f32) {
      const float *q = (const float *)part + blk * 2 * C;
      for (int64_t k = 0; k < 2 * C; k++) sum[k] += q[k];
    } else {
      const double *q = (const double *)part + blk * 2 * C;
      for (int64_t k = 0; k < 2 * C; k++) sum[k] += q[k];
    }
  }
  for (int64_t c = 0; c < C; c++) {
    if (f32) {
      ((float *)t0->data)[c] = (float)(sum[c] * scale);
      if (t1) ((float *)t1->data)[c] = (float)(sum[C + c] * scale);
    } else {
      ((double *)t0->data)[c] = sum[c] * scale;
      if (t1) ((double *)t1->data)[c] = sum[C + c] * scale;
    }
  }
  mem_scratch_put(&scratch), mem_scratch_put(&total);
  return 0;
}

/* x and dy: the same dtype and shape */
static bool same_dense(const kiln_tensor *a, const kiln_tensor *b) {
  return a->dtype == b->dtype && a->rank == b->rank && !memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->rank);
}

int bn_eager_sums(kiln_tensor *dy, kiln_tensor *x, kiln_tensor *mean, kiln_tensor **s0, kiln_tensor **s1) {
  if (tape_active_count || !eager_cpu(x) || !eager_cpu(dy) || !same_dense(dy, x) || !per_channel(mean, x) ||
      mean->size != x->shape[x->rank - 1])
    return 1;
  kiln_tensor *t0 = tensor_alloc("batch_norm", (kiln_dtype)x->dtype, mean->rank, mean->shape);
  kiln_tensor *t1 = t0 ? tensor_alloc("batch_norm", (kiln_dtype)x->dtype, mean->rank, mean->shape) : NULL;
  if (!t1 || channel_sums("batch_norm", dy, x, mean, 1.0, t0, t1)) {
    kiln_release(t0), kiln_release(t1);
    return kiln_has_error() ? -1 : kiln_set_error("batch_norm: out of memory");
  }
  *s0 = scope_own(t0), *s1 = scope_own(t1);
  return 0;
}

int bn_eager_variance(kiln_tensor *x, kiln_tensor *mean, int rank, const int64_t *shape, kiln_tensor **var) {
  if (tape_active_count || !eager_cpu(x) || !per_channel(mean, x) || mean->size != x->shape[x->rank - 1] ||
      x->size == mean->size)
    return 1;
  kiln_tensor *v = tensor_alloc("moments", (kiln_dtype)x->dtype, rank, shape);
  if (!v || channel_sums("moments", NULL, x, mean, 1.0 / (double)(x->size / mean->size), v, NULL)) {
    kiln_release(v);
    return kiln_has_error() ? -1 : kiln_set_error("moments: out of memory");
  }
  *var = scope_own(v);
  return 0;
}

/* ---- dx = a dy + b (x - m) + c per channel ---- */

typedef struct {
  kiln_tensor *dx;
  const kiln_tensor *dy, *x;
  const void *p; /* per channel: m, a, b, c; C values each */
  int64_t channels;
} dx_pass;

#define DX_ROWS(T)                                                                                            \
  KILN_HOT static void dx_rows_##T(const dx_pass *q, int64_t r0, int64_t r1) {                               \
    int64_t C = q->channels;                                                                                \
    const T *KILN_RESTRICT m = q->p, *KILN_RESTRICT a = m + C, *KILN_RESTRICT b = a + C, *KILN_RESTRICT c = b + C; \
    for (int64_t row = r0; row < r1; row++) {                                                               \
      const T *KILN_RESTRICT x = (const T *)q->x->data + row * C, *KILN_RESTRICT dy = (const T *)q->dy->data + row * C; \
      T *KILN_RESTRICT dx = (T *)q->dx->data + row * C;                                                     \
      for (int64_t k = 0; k < C; k++) dx[k] = a[k] * dy[k] + b[k] * (x[k] - m[k]) + c[k];                   \
    }                                                                                                       \
  }
DX_ROWS(float)
DX_ROWS(double)

static void dx_rows(void *ctx, int64_t r0, int64_t r1) {
  const dx_pass *q = ctx;
  if (q->x->dtype == KILN_F32)
    dx_rows_float(q, r0, r1);
  else
    dx_rows_double(q, r0, r1);
}

kiln_tensor *bn_eager_dx(kiln_tensor *dy, kiln_tensor *x, kiln_tensor *mean, kiln_tensor *a, kiln_tensor *b,
                         kiln_tensor *c) {
  if (tape_active_count || !eager_cpu(x) || !eager_cpu(dy) || !same_dense(dy, x) || !per_channel(mean, x) ||
      !per_channel(a, x) || !per_channel(b, x) || !per_channel(c, x))
    return NULL;
  static const double neutral[4] = {0, 0, 0, 0};
  const kiln_tensor *src[4] = {mean, a, b, c};
  mem_scratch scratch;
  void *p;
  kiln_tensor *dx = pass_setup("batch_norm", x, src, neutral, &scratch, &p);
  if (!dx) return NULL;
  int64_t C = x->shape[x->rank - 1];
  dx_pass q = {dx, dy, x, p, C};
  parallel_for(x->size / C, (16384 + C - 1) / C, dx_rows, &q);
  mem_scratch_put(&scratch);
  return scope_own(dx);
}

/* ---- relu's gradient: dy where x > 0, else +0 ---- */

typedef struct {
  kiln_tensor *dx;
  const kiln_tensor *dy, *x;
} relu_pass;

/* select(x > 0, dy, 0) element by element: NaN and -0 in x give +0 */
#define RELU_GRAD(T)                                                                                   \
  KILN_HOT static void relu_grad_##T(const relu_pass *q, int64_t b, int64_t e) {                       \
    const T *KILN_RESTRICT x = q->x->data, *KILN_RESTRICT dy = q->dy->data;                            \
    T *KILN_RESTRICT dx = q->dx->data;                                                                 \
    for (int64_t i = b; i < e; i++) dx[i] = x[i] > 0 ? dy[i] : (T)0;                                   \
  }
RELU_GRAD(float)
RELU_GRAD(double)

static void relu_grad_task(void *ctx, int64_t b, int64_t e) {
  const relu_pass *q = ctx;
  if (q->x->dtype == KILN_F32)
    relu_grad_float(q, b, e);
  else
    relu_grad_double(q, b, e);
}

int relu_eager_grad(kiln_tensor *dy, kiln_tensor *x, kiln_tensor **dx) {
  if (tape_active_count || !eager_cpu(x) || !eager_cpu(dy) || !same_dense(dy, x)) return 1;
  if (!(*dx = tensor_alloc("relu", (kiln_dtype)x->dtype, x->rank, x->shape))) return -1;
  relu_pass q = {*dx, dy, x};
  parallel_for(x->size, 16384, relu_grad_task, &q);
  *dx = scope_own(*dx);
  return 0;
}
