/* kernels_index.c — CPU kernels of the indexing primitives: gather (any
 * dtype, moved as bytes), scatter_add (its gradient, numeric dtypes) and
 * iota (kiln_arange); plus kiln_scatter_add, the public entry point of
 * scatter_add. Indices out of range are errors, never clamped (API.md §3). */
#include "ops.h"

/* Elements below which a kernel runs serially: small ops must stay cheap. */
enum { INDEX_GRAIN = 32768 };

/* Every index must be in [0, dim). The scan that finds a bad one has no
 * early exit, so it vectorizes; the first bad position is looked up only
 * on failure. */
#define CHECK_INDICES(IT)                                                                     \
  static int check_##IT(const char *op, const IT *idx, int64_t n, int64_t dim) {              \
    bool bad = false;                                                                         \
    for (int64_t j = 0; j < n; j++) bad |= (uint64_t)(int64_t)idx[j] >= (uint64_t)dim;       \
    if (KILN_LIKELY(!bad)) return 0;                                                          \
    for (int64_t j = 0;; j++)                                                                 \
      if ((uint64_t)(int64_t)idx[j] >= (uint64_t)dim)                                         \
        return kiln_set_error("%s: indices[%lld] = %lld is not in [0, %lld)", op, (long long)j, \
                              (long long)idx[j], (long long)dim);                             \
  }

CHECK_INDICES(int32_t)
CHECK_INDICES(int64_t)

static int check_indices(op_id op, const kiln_tensor *idx, int64_t dim) {
  if (idx->dtype == KILN_I32) return check_int32_t(kiln_ops[op].api, idx->data, idx->size, dim);
  return check_int64_t(kiln_ops[op].api, idx->data, idx->size, dim);
}

/* outer, dim and inner of a shape around axis */
static void split_axis(int rank, const int64_t *shape, int axis, int64_t *outer, int64_t *dim,
                       int64_t *inner) {
  *outer = *inner = 1;
  for (int i = 0; i < axis; i++) *outer *= shape[i];
  for (int i = axis + 1; i < rank; i++) *inner *= shape[i];
  *dim = shape[axis];
}

/* ---- gather: out[o, j, :] = params[o, idx[j], :] ----
 * One row is the inner block of params behind one index. Rows of 1, 2, 4
 * or 8 bytes (an axis-last gather of any dtype) copy with a constant-size
 * memcpy, one load and one store; longer rows with memcpy. */

typedef struct gather_ctx gather_ctx;
typedef void (*gather_rows_fn)(const gather_ctx *x, int64_t r0, int64_t r1);
struct gather_ctx {
  const char *params;
  char *dst;
  const void *idx;
  int64_t n, dim;   /* indices; params' axis dim */
  size_t row_bytes; /* inner * element size */
  gather_rows_fn rows;
};

#define GATHER_ROWS(IT, W)                                                              \
  static void gather_##IT##_##W(const gather_ctx *x, int64_t r0, int64_t r1) {          \
    const IT *idx = x->idx;                                                             \
    const size_t rb = W ? W : x->row_bytes;                                             \
    int64_t o = r0 / x->n, j = r0 % x->n;                                               \
    char *dst = x->dst + r0 * rb;                                                       \
    for (int64_t r = r0; r < r1; r++, dst += rb) {                                      \
      memcpy(dst, x->params + (o * x->dim + idx[j]) * rb, rb);                          \
      if (++j == x->n) j = 0, o++;                                                      \
    }                                                                                   \
  }
#define GATHER_WIDTHS(IT) \
  GATHER_ROWS(IT, 0) GATHER_ROWS(IT, 1) GATHER_ROWS(IT, 2) GATHER_ROWS(IT, 4) GATHER_ROWS(IT, 8)
GATHER_WIDTHS(int32_t)
GATHER_WIDTHS(int64_t)

static void gather_task(void *arg, int64_t r0, int64_t r1) {
  const gather_ctx *x = arg;
  x->rows(x, r0, r1);
}

static gather_rows_fn gather_rows_for(bool i64, size_t row_bytes) {
  static const gather_rows_fn by_width[2][9] = {
      {gather_int32_t_0, gather_int32_t_1, gather_int32_t_2, 0, gather_int32_t_4, 0, 0, 0, gather_int32_t_8},
      {gather_int64_t_0, gather_int64_t_1, gather_int64_t_2, 0, gather_int64_t_4, 0, 0, 0, gather_int64_t_8}};
  gather_rows_fn f = row_bytes <= 8 ? by_width[i64][row_bytes] : NULL;
  return f ? f : by_width[i64][0];
}

static int gather_kernel(const op_call *c) {
  const kiln_tensor *params = c->in[0], *idx = c->in[1];
  int64_t outer, dim, inner;
  split_axis(params->rank, params->shape, c->attrs->axis, &outer, &dim, &inner);
  if (check_indices(OP_GATHER, idx, dim)) return -1;
  if (c->out->size == 0) return 0;
  gather_ctx x = {params->data, c->out->data, idx->data, idx->size, dim,
                  (size_t)inner * kiln_dtype_sizes[params->dtype], NULL};
  x.rows = gather_rows_for(idx->dtype == KILN_I64, x.row_bytes);
  parallel_for(outer * idx->size, INDEX_GRAIN / inner + 1, gather_task, &x);
  return 0;
}

/* ---- scatter_add: zeros, then out[o, idx[j], :] += updates[o, j, :] ----
 * Duplicate indices make rows of out collide, so tasks split the columns
 * (o, inner position), never j: each task owns its slice of out. Integer
 * sums wrap (added as unsigned); UT is T itself for floats. */

typedef struct {
  char *out;
  const char *upd;
  const void *idx;
  int64_t n, dim, inner;
} scatter_ctx;

#define SCATTER_ADD(T, UT, IT)                                                            \
  static void scatter_##T##_##IT(void *arg, int64_t c0, int64_t c1) {                     \
    const scatter_ctx *x = arg;                                                           \
    const IT *idx = x->idx;                                                               \
    const int64_t n = x->n, inner = x->inner;                                             \
    while (c0 < c1) {                                                                     \
      int64_t o = c0 / inner, i0 = c0 % inner;                                            \
      int64_t i1 = inner - i0 < c1 - c0 ? inner : i0 + (c1 - c0);                         \
      T *out = (T *)x->out + o * x->dim * inner;                                          \
      const T *upd = (const T *)x->upd + o * n * inner;                                   \
      for (int64_t j = 0; j < n; j++) {                                                   \
        T *restrict dst = out + idx[j] * inner;                                           \
        const T *restrict src = upd + j * inner;                                          \
        for (int64_t i = i0; i < i1; i++) dst[i] = (T)((UT)dst[i] + (UT)src[i]);          \
      }                                                                                   \
      c0 += i1 - i0;                                                                      \
    }                                                                                     \
  }

#define SCATTER_KERNEL(T, UT, DT)                                                      \
  SCATTER_ADD(T, UT, int32_t)                                                          \
  SCATTER_ADD(T, UT, int64_t)                                                          \
  static int scatter_add_##DT(const op_call *c) {                                      \
    const kiln_tensor *upd = c->in[0], *idx = c->in[1];                                \
    int64_t outer, dim, inner;                                                         \
    split_axis(c->out->rank, c->out->shape, c->attrs->axis, &outer, &dim, &inner);     \
    if (check_indices(OP_SCATTER_ADD, idx, dim)) return -1;                            \
    memset(c->out->data, 0, tensor_bytes(c->out));                                     \
    if (upd->size == 0) return 0;                                                      \
    scatter_ctx x = {c->out->data, upd->data, idx->data, idx->size, dim, inner};       \
    parallel_for(outer * inner, INDEX_GRAIN / (x.n + 1) + 1,                          \
                 idx->dtype == KILN_I32 ? scatter_##T##_int32_t : scatter_##T##_int64_t, &x); \
    return 0;                                                                          \
  }

typedef float f32;
typedef double f64;
SCATTER_KERNEL(f32, f32, f32)
SCATTER_KERNEL(f64, f64, f64)
SCATTER_KERNEL(int32_t, uint32_t, i32)
SCATTER_KERNEL(int64_t, uint64_t, i64)

/* ---- iota: 0, 1, ..., n-1 ---- */

#define IOTA(T, DT)                                                   \
  static void iota_task_##DT(void *arg, int64_t b, int64_t e) {       \
    T *restrict out = arg;                                            \
    for (int64_t i = b; i < e; i++) out[i] = (T)i;                    \
  }                                                                   \
  static int iota_##DT(const op_call *c) {                            \
    parallel_for(c->out->size, INDEX_GRAIN, iota_task_##DT, c->out->data); \
    return 0;                                                         \
  }

IOTA(float, f32)
IOTA(double, f64)
IOTA(int32_t, i32)
IOTA(int64_t, i64)

/* ---- the public entry point of scatter_add ---- */

KILN_EXPORT kiln_tensor *kiln_scatter_add(kiln_tensor *updates, kiln_tensor *indices, int axis, int rank,
                                          const int64_t *shape) {
  op_attrs a = {0};
  if (updates && indices) { /* a NULL input is reported by op_apply, keeping the first error */
    if (rank < 0 || rank > KILN_MAX_RANK) {
      kiln_set_error("scatter_add: rank %d is not in [0, %d]", rank, KILN_MAX_RANK);
      return NULL;
    }
    if (rank > 0 && !shape) {
      kiln_set_error("scatter_add: shape is NULL for rank %d", rank);
      return NULL;
    }
    if (axis_normalize("scatter_add", axis, rank, &a.axis)) return NULL;
    a.rank = rank;
    for (int i = 0; i < rank; i++) a.shape[i] = shape[i];
  }
  return op_apply2(OP_SCATTER_ADD, &a, updates, indices);
}

KILN_CONSTRUCTOR static void register_kernels(void) {
  for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++)
    dispatch_register(OP_GATHER, 0, (kiln_dtype)dt, gather_kernel);
  dispatch_register(OP_SCATTER_ADD, 0, KILN_F32, scatter_add_f32);
  dispatch_register(OP_SCATTER_ADD, 0, KILN_F64, scatter_add_f64);
  dispatch_register(OP_SCATTER_ADD, 0, KILN_I32, scatter_add_i32);
  dispatch_register(OP_SCATTER_ADD, 0, KILN_I64, scatter_add_i64);
  dispatch_register(OP_IOTA, 0, KILN_F32, iota_f32);
  dispatch_register(OP_IOTA, 0, KILN_F64, iota_f64);
  dispatch_register(OP_IOTA, 0, KILN_I32, iota_i32);
  dispatch_register(OP_IOTA, 0, KILN_I64, iota_i64);
}
