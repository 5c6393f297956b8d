/* bn_eager.c — batch norm's eager CPU passes (bn_eager.h). Per-channel
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

static kiln_tensor *affine(const char *op, kiln_tensor *x, const kiln_tensor *const src[4]) {
  kiln_tensor *y = tensor_alloc(op, (kiln_dtype)x->dtype, x->rank, x->shape);
  if (!y) return NULL;
  int64_t C = x->shape[x->rank - 1];
  void *p = malloc(4 * (size_t)C * kiln_dtype_sizes[x->dtype]);
  if (!p) {
    kiln_release(y);
    kiln_set_error("%s: out of memory", op);
    return NULL;
  }
  for (int k = 0; k < 4; k++) {
    if (x->dtype == KILN_F32)
      bn_spread_float((float *)p + k * C, src[k], k == 2 ? 1.0f : -0.0f, C);
    else
      bn_spread_double((double *)p + k * C, src[k], k == 2 ? 1.0 : -0.0, C);
  }
  affine_pass b = {y, x, p, C};
  parallel_for(x->size / C, (16384 + C - 1) / C, affine_rows, &b);
  free(p);
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

/* ---- s0 = sum(dy), s1 = sum(dy (x - m)) per channel ----
 * Blocks of SUM_ROWS_ELEMS / C rows (at least one), each summed row by row
 * into its own partials; the blocks' partials then added in block order
 * (f32 in f64), so the sums are the same whatever the thread count. */
enum { SUM_ROWS_ELEMS = 4096 };

typedef struct {
  const void *dy, *x, *m;
  void *part; /* per block: s0 then s1, C each, of the element type */
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
        const T *KILN_RESTRICT dy = (const T *)p->dy + row * C, *KILN_RESTRICT x = (const T *)p->x + row * C; \
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

int bn_eager_sums(kiln_tensor *dy, kiln_tensor *x, kiln_tensor *mean, kiln_tensor **s0, kiln_tensor **s1) {
  if (tape_active_count || !eager_cpu(x) || !eager_cpu(dy) || dy->dtype != x->dtype || dy->rank != x->rank ||
      memcmp(dy->shape, x->shape, sizeof(int64_t) * (size_t)x->rank) || !per_channel(mean, x) ||
      mean->size != x->shape[x->rank - 1])
    return 1;
  int64_t C = mean->size, rows = x->size / C, block = SUM_ROWS_ELEMS / C > 0 ? SUM_ROWS_ELEMS / C : 1;
  int64_t blocks = (rows + block - 1) / block;
  bool f32 = x->dtype == KILN_F32;
  size_t es = kiln_dtype_sizes[x->dtype];
  void *part = malloc((size_t)(blocks * 2 * C) * es);
  kiln_tensor *t0 = tensor_alloc("batch_norm", (kiln_dtype)x->dtype, mean->rank, mean->shape);
  kiln_tensor *t1 = t0 ? tensor_alloc("batch_norm", (kiln_dtype)x->dtype, mean->rank, mean->shape) : NULL;
  if (!part || !t1) {
    free(part), kiln_release(t0), kiln_release(t1);
    return kiln_has_error() ? -1 : kiln_set_error("batch_norm: out of memory");
  }
  sums_pass p = {dy->data, x->data, mean->data, part, C, rows, block, f32};
  parallel_for(blocks, 1, sum_rows, &p);
  for (int64_t c = 0; c < C; c++) {
    double a = 0, b = 0;
    for (int64_t blk = 0; blk < blocks; blk++) {
      a += f32 ? ((const float *)part)[blk * 2 * C + c] : ((const double *)part)[blk * 2 * C + c];
      b += f32 ? ((const float *)part)[blk * 2 * C + C + c] : ((const double *)part)[blk * 2 * C + C + c];
    }
    if (f32)
      ((float *)t0->data)[c] = (float)a, ((float *)t1->data)[c] = (float)b;
    else
      ((double *)t0->data)[c] = a, ((double *)t1->data)[c] = b;
  }
  free(part);
  *s0 = scope_own(t0), *s1 = scope_own(t1);
  return 0;
}
