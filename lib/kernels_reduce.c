/* kernels_reduce.c — CPU kernels of REDUCE_SUM/PROD/MAX/MIN and ARGMAX.
 * The input is collapsed into groups of adjacent kept or reduced dims, then
 * reduced either by rows (the innermost group is reduced: contiguous runs)
 * or by columns (it is kept: whole rows accumulate into a vector tile). */
#include <math.h>

#include "ops.h"

enum {
  LANES = 32,            /* partial results per row reduction: gcc vectorizes them */
  TILE = 2048,           /* output columns accumulated at once in column mode */
  ARG_TILE = 1024,       /* the same for argmax, which keeps values and indices */
  ARG_BLOCK = 1024,      /* argmax finds the best block first, then scans it */
  MAX_PARTS = 64,        /* most pieces one reduction is split into */
  PAIRWISE_BLOCK = 4096, /* f64 row sums: blocks summed directly, then pairwise */
};
#define GRAIN ((int64_t)1 << 15) /* input elements below which a reduction runs serially */

/* The input seen as groups: every kept group but the innermost one is an
 * "outer" (k) group, every reduced one but the innermost one an "r" group.
 * Work is split into units (output elements, or TILE-wide slices of output
 * rows in column mode) times parts (slices of the reduction, when there are
 * too few units to keep the threads busy; their partials are combined). */
typedef struct {
  int nk, nr;
  int64_t ksize[KILN_MAX_RANK], kstride[KILN_MAX_RANK];
  int64_t rsize[KILN_MAX_RANK], rstride[KILN_MAX_RANK];
  bool rows;     /* the innermost group is reduced */
  int64_t inner; /* size of the innermost group (stride 1) */
  int64_t tiles; /* column mode: TILE slices per output row */
  int64_t units, parts;
  int64_t span; /* reduction length parts split: elements (rows) or rows (columns) */
  int64_t out_count;
  const void *in;
  void *out;
  void *partial; /* parts > 1: parts x out_count accumulators */
} reduce_plan;

typedef struct {
  parallel_fn task;
  void (*combine)(const reduce_plan *P);
  void (*fill)(void *out, int64_t n); /* the identity: what an empty reduction gives */
  size_t acc_size;
} reduce_impl;

/* input offset of kept (outer) index u */
static int64_t kept_offset(const reduce_plan *P, int64_t u) {
  int64_t off = 0;
  for (int i = P->nk - 1; i >= 0; i--) {
    off += u % P->ksize[i] * P->kstride[i];
    u /= P->ksize[i];
  }
  return off;
}

/* walks the r groups in row-major order, tracking the input offset */
typedef struct {
  int64_t idx[KILN_MAX_RANK];
  int64_t off;
} odometer;

static void odo_init(const reduce_plan *P, odometer *o, int64_t row) {
  o->off = 0;
  for (int i = P->nr - 1; i >= 0; i--) {
    o->idx[i] = row % P->rsize[i];
    o->off += o->idx[i] * P->rstride[i];
    row /= P->rsize[i];
  }
}

static inline void odo_next(const reduce_plan *P, odometer *o) {
  for (int i = P->nr - 1; i >= 0; i--) {
    o->off += P->rstride[i];
    if (++o->idx[i] < P->rsize[i]) return;
    o->off -= P->rstride[i] * P->rsize[i];
    o->idx[i] = 0;
  }
}

/* the slice [*f0, *f1) of [0, span) that part s of parts covers */
static void part_range(int64_t span, int64_t parts, int64_t s, int64_t *f0, int64_t *f1) {
  int64_t q = span / parts, r = span % parts;
  *f0 = s * q + (s < r ? s : r);
  *f1 = *f0 + q + (s < r);
}

/* Combining operators: a is the accumulator, b the new value. Float max
 * and min propagate NaN: once a lane holds NaN nothing replaces it. */
#define OP_ADD(a, b) ((a) + (b))
#define OP_MUL(a, b) ((a) * (b))
#define OP_FMAX(a, b) ((b) > (a) || isnan(b) ? (b) : (a))
#define OP_FMIN(a, b) ((b) < (a) || isnan(b) ? (b) : (a))
#define OP_IMAX(a, b) ((b) > (a) ? (b) : (a))
#define OP_IMIN(a, b) ((b) < (a) ? (b) : (a))

/* REDUCER(NAME, T, ACC, ID, OP): the kernel pieces for one (reduction,
 * dtype). ACC is the accumulator type: double for f32 sums and products (so
 * long rows stay accurate), the unsigned type of the same width for integer
 * sums and products (they wrap without undefined behaviour). */
#define REDUCER(NAME, T, ACC, ID, OP)                                                             \
  /* a function, not the macro: nested macro calls would copy their arguments */                  \
  static inline ACC op_##NAME(ACC a, ACC b) { return OP(a, b); }                                  \
                                                                                                  \
  KILN_HOT static ACC row_##NAME(const T *KILN_RESTRICT p, int64_t n) {                                    \
    ACC acc = (ID);                                                                               \
    if (n < LANES) {                                                                              \
      for (int64_t i = 0; i < n; i++) acc = op_##NAME(acc, (ACC)p[i]);                            \
      return acc;                                                                                 \
    }                                                                                             \
    ACC lane[LANES];                                                                              \
    for (int j = 0; j < LANES; j++) lane[j] = (ID);                                               \
    int64_t i = 0;                                                                                \
    for (; i + LANES <= n; i += LANES)                                                            \
      for (int j = 0; j < LANES; j++) lane[j] = op_##NAME(lane[j], (ACC)p[i + j]);                \
    for (; i < n; i++) acc = op_##NAME(acc, (ACC)p[i]);                                           \
    for (int w = LANES / 2; w >= 1; w /= 2)                                                       \
      for (int j = 0; j < w; j++) lane[j] = op_##NAME(lane[j], lane[j + w]);                      \
    return op_##NAME(lane[0], acc);                                                               \
  }                                                                                               \
                                                                                                  \
  KILN_HOT static void col_##NAME(ACC *KILN_RESTRICT acc, const T *KILN_RESTRICT p, int64_t n) {           \
    for (int64_t j = 0; j < n; j++) acc[j] = op_##NAME(acc[j], (ACC)p[j]);                        \
  }                                                                                               \
                                                                                                  \
  /* four rows per pass: a quarter of the accumulator traffic */                                  \
  KILN_HOT static void col4_##NAME(ACC *KILN_RESTRICT acc, const T *const *rows, int64_t n) {              \
    const T *KILN_RESTRICT p0 = rows[0], *KILN_RESTRICT p1 = rows[1];                             \
    const T *KILN_RESTRICT p2 = rows[2], *KILN_RESTRICT p3 = rows[3];                             \
    for (int64_t j = 0; j < n; j++) {                                                             \
      ACC a = op_##NAME(op_##NAME(acc[j], (ACC)p0[j]), (ACC)p1[j]);                               \
      acc[j] = op_##NAME(op_##NAME(a, (ACC)p2[j]), (ACC)p3[j]);                                   \
    }                                                                                             \
  }                                                                                               \
                                                                                                  \
  /* rows mode: unit u over the slice [f0, f1) of its rows, laid end to end */                    \
  static ACC rows_##NAME(const reduce_plan *P, int64_t u, int64_t f0, int64_t f1) {               \
    const T *base = (const T *)P->in + kept_offset(P, u);                                         \
    int64_t col = f0 % P->inner;                                                                  \
    ACC acc = (ID);                                                                               \
    odometer o;                                                                                   \
    odo_init(P, &o, f0 / P->inner);                                                               \
    while (f0 < f1) {                                                                             \
      int64_t len = P->inner - col < f1 - f0 ? P->inner - col : f1 - f0;                          \
      acc = op_##NAME(acc, ROW_##NAME(base + o.off + col, len));                                  \
      f0 += len;                                                                                  \
      col = 0;                                                                                    \
      odo_next(P, &o);                                                                            \
    }                                                                                             \
    return acc;                                                                                   \
  }                                                                                               \
                                                                                                  \
  /* columns mode: unit u (a TILE slice of an output row) over rows [f0, f1) */                   \
  static void cols_##NAME(const reduce_plan *P, int64_t u, int64_t f0, int64_t f1, ACC *acc,      \
                          int64_t *at, int64_t *w) {                                              \
    int64_t ko = u / P->tiles, j0 = u % P->tiles * TILE;                                          \
    *w = P->inner - j0 < TILE ? P->inner - j0 : TILE;                                             \
    *at = ko * P->inner + j0;                                                                     \
    const T *base = (const T *)P->in + kept_offset(P, ko) + j0;                                   \
    for (int64_t j = 0; j < *w; j++) acc[j] = (ID);                                               \
    odometer o;                                                                                   \
    odo_init(P, &o, f0);                                                                          \
    for (; f0 + 4 <= f1; f0 += 4) {                                                               \
      const T *r[4];                                                                              \
      for (int q = 0; q < 4; q++, odo_next(P, &o)) r[q] = base + o.off;                           \
      col4_##NAME(acc, r, *w);                                                                    \
    }                                                                                             \
    for (; f0 < f1; f0++, odo_next(P, &o)) col_##NAME(acc, base + o.off, *w);                     \
  }                                                                                               \
                                                                                                  \
  static void task_##NAME(void *ctx, int64_t begin, int64_t end) {                                \
    const reduce_plan *P = ctx;                                                                   \
    T *out = P->out;                                                                              \
    ACC *partial = P->partial;                                                                    \
    if (P->rows && P->nr == 0 && P->parts == 1) { /* contiguous rows, one per output */           \
      const T *in = P->in;                                                                        \
      for (int64_t u = begin; u < end; u++) out[u] = (T)ROW_##NAME(in + u * P->inner, P->inner);  \
      return;                                                                                     \
    }                                                                                             \
    for (int64_t t = begin; t < end; t++) {                                                       \
      int64_t u = t / P->parts, s = t % P->parts, f0, f1;                                         \
      part_range(P->span, P->parts, s, &f0, &f1);                                                 \
      if (P->rows) {                                                                              \
        ACC acc = rows_##NAME(P, u, f0, f1);                                                      \
        if (P->parts == 1)                                                                        \
          out[u] = (T)acc;                                                                        \
        else                                                                                      \
          partial[s * P->out_count + u] = acc;                                                    \
        continue;                                                                                 \
      }                                                                                           \
      ACC acc[TILE];                                                                              \
      int64_t at, w;                                                                              \
      cols_##NAME(P, u, f0, f1, acc, &at, &w);                                                    \
      if (P->parts == 1)                                                                          \
        for (int64_t j = 0; j < w; j++) out[at + j] = (T)acc[j];                                  \
      else                                                                                        \
        memcpy(partial + s * P->out_count + at, acc, (size_t)w * sizeof(ACC));                    \
    }                                                                                             \
  }                                                                                               \
                                                                                                  \
  static void combine_##NAME(const reduce_plan *P) {                                              \
    const ACC *partial = P->partial;                                                              \
    T *out = P->out;                                                                              \
    for (int64_t e = 0; e < P->out_count; e++) {                                                  \
      ACC acc = partial[e];                                                                       \
      for (int64_t s = 1; s < P->parts; s++) acc = op_##NAME(acc, partial[s * P->out_count + e]); \
      out[e] = (T)acc;                                                                            \
    }                                                                                             \
  }                                                                                               \
                                                                                                  \
  static void fill_##NAME(void *out, int64_t n) {                                                 \
    for (int64_t i = 0; i < n; i++) ((T *)out)[i] = (T)(ID);                                      \
  }                                                                                               \
                                                                                                  \
  static const reduce_impl impl_##NAME = {task_##NAME, combine_##NAME, fill_##NAME, sizeof(ACC)};

/* Rows of f64 sums are summed pairwise (as NumPy does): the error grows with
 * log n, not n. Every other row reduction uses row_NAME directly. */
static double row_sum_f64(const double *KILN_RESTRICT p, int64_t n);
static double pairwise_f64(const double *p, int64_t n) {
  if (n <= PAIRWISE_BLOCK) return row_sum_f64(p, n);
  int64_t h = n / 2 / LANES * LANES;
  return pairwise_f64(p, h) + pairwise_f64(p + h, n - h);
}

#define ROW_sum_f32 row_sum_f32
#define ROW_sum_f64 pairwise_f64
#define ROW_sum_i32 row_sum_i32
#define ROW_sum_i64 row_sum_i64
#define ROW_prod_f32 row_prod_f32
#define ROW_prod_f64 row_prod_f64
#define ROW_prod_i32 row_prod_i32
#define ROW_prod_i64 row_prod_i64
#define ROW_max_f32 row_max_f32
#define ROW_max_f64 row_max_f64
#define ROW_max_i32 row_max_i32
#define ROW_max_i64 row_max_i64
#define ROW_min_f32 row_min_f32
#define ROW_min_f64 row_min_f64
#define ROW_min_i32 row_min_i32
#define ROW_min_i64 row_min_i64

REDUCER(sum_f32, float, double, 0, OP_ADD)
REDUCER(sum_f64, double, double, 0, OP_ADD)
REDUCER(sum_i32, int32_t, uint32_t, 0, OP_ADD)
REDUCER(sum_i64, int64_t, uint64_t, 0, OP_ADD)
REDUCER(prod_f32, float, double, 1, OP_MUL)
REDUCER(prod_f64, double, double, 1, OP_MUL)
REDUCER(prod_i32, int32_t, uint32_t, 1, OP_MUL)
REDUCER(prod_i64, int64_t, uint64_t, 1, OP_MUL)
REDUCER(max_f32, float, float, -INFINITY, OP_FMAX)
REDUCER(max_f64, double, double, -INFINITY, OP_FMAX)
REDUCER(max_i32, int32_t, int32_t, INT32_MIN, OP_IMAX)
REDUCER(max_i64, int64_t, int64_t, INT64_MIN, OP_IMAX)
REDUCER(min_f32, float, float, INFINITY, OP_FMIN)
REDUCER(min_f64, double, double, INFINITY, OP_FMIN)
REDUCER(min_i32, int32_t, int32_t, INT32_MAX, OP_IMIN)
REDUCER(min_i64, int64_t, int64_t, INT64_MAX, OP_IMIN)

/* how many pieces to split work into: enough for every thread, and none
 * smaller than GRAIN input elements */
static int64_t pieces(int64_t elements) {
  int64_t threads = kiln_num_threads();
  if (threads == 1 || elements < 2 * GRAIN) return 1;
  int64_t want = 4 * threads, most = elements / GRAIN;
  return want < most ? want : most;
}

static int reduce_run(const op_call *c, const reduce_impl *impl) {
  const kiln_tensor *x = c->in[0];
  kiln_tensor *y = c->out;
  const op_attrs *a = c->attrs;
  size_t esize = kiln_dtype_sizes[x->dtype];
  if (y->size == 0) return 0;
  if (x->size == 0) { /* a kept dim is not empty, so a reduced one is */
    impl->fill(y->data, y->size);
    return 0;
  }

  /* collapse: drop size-1 dims, merge neighbours that are both kept or both reduced */
  bool reduced[KILN_MAX_RANK] = {false};
  for (int i = 0; i < a->naxes; i++) reduced[a->axes[i]] = true;
  int ng = 0;
  int64_t gsize[KILN_MAX_RANK], gstride[KILN_MAX_RANK], stride = x->size;
  bool gred[KILN_MAX_RANK];
  for (int i = 0; i < x->rank; i++) {
    stride /= x->shape[i];
    if (x->shape[i] == 1) continue;
    if (ng > 0 && gred[ng - 1] == reduced[i]) {
      gsize[ng - 1] *= x->shape[i];
    } else {
      gsize[ng] = x->shape[i];
      gred[ng++] = reduced[i];
    }
    gstride[ng - 1] = stride;
  }
  bool any_reduced = false;
  for (int i = 0; i < ng; i++) any_reduced |= gred[i];
  if (!any_reduced) { /* every reduced dim has size 1 */
    memcpy(y->data, x->data, (size_t)x->size * esize);
    return 0;
  }

  reduce_plan P = {.in = x->data, .out = y->data, .out_count = y->size};
  P.rows = gred[ng - 1];
  P.inner = gsize[ng - 1];
  for (int i = 0; i < ng - 1; i++) {
    if (gred[i]) {
      P.rsize[P.nr] = gsize[i];
      P.rstride[P.nr++] = gstride[i];
    } else {
      P.ksize[P.nk] = gsize[i];
      P.kstride[P.nk++] = gstride[i];
    }
  }
  int64_t nrows = x->size / (y->size * (P.rows ? P.inner : 1));
  P.tiles = P.rows ? 1 : (P.inner + TILE - 1) / TILE;
  P.units = P.rows ? y->size : y->size / P.inner * P.tiles;
  P.span = P.rows ? nrows * P.inner : nrows;
  P.parts = 1;
  int64_t want = pieces(x->size);
  if (P.units < want) { /* too few outputs to share: split the reduction too */
    P.parts = (want + P.units - 1) / P.units;
    if (P.parts > P.span) P.parts = P.span;
    if (P.parts > MAX_PARTS) P.parts = MAX_PARTS;
  }
  int32_t cls = 0;
  if (P.parts > 1) {
    P.partial = mem_alloc((size_t)(P.parts * P.out_count) * impl->acc_size, &cls);
    if (!P.partial) return kiln_set_error("%s: out of memory", kiln_ops[c->op].api);
  }
  int64_t tasks = P.units * P.parts;
  parallel_for(tasks, want > 1 ? (tasks + want - 1) / want : tasks, impl->task, &P);
  if (P.parts > 1) {
    impl->combine(&P);
    mem_free(P.partial, cls);
  }
  return 0;
}

/* ---- argmax: the first maximum wins; NaN counts as the maximum (the
 * first NaN wins), as in NumPy ---- */

/* x != x is isnan(x): written so, gcc 12 vectorizes the column loop */
#define BETTER_F(x, best) ((x) > (best) || ((x) != (x) && (best) == (best)))
#define BETTER_I(x, best) ((x) > (best))
#define SAME_F(x, best) ((x) == (best) || ((x) != (x) && (best) != (best)))
#define SAME_I(x, best) ((x) == (best))

typedef struct {
  const void *in;
  int64_t *out;
  int64_t outer, axis_len, inner, tiles, parts;
  void *best; /* parts > 1: each part's best value (T) and index */
  int64_t *where;
} argmax_plan;

#define ARGMAX(SUF, T, BETTER, SAME)                                                          \
  static inline bool better_##SUF(T x, T best) { return BETTER(x, best); }                    \
                                                                                              \
  /* rows k .. k+n-1 (n <= 4) of a column tile, in one pass over best and                     \
   * idx: the first best of those rows, then strictly better than best */                     \
  KILN_HOT static void argcol_##SUF(T *KILN_RESTRICT best, int64_t *KILN_RESTRICT idx, const T *p,     \
                           int64_t ld, int64_t k, int n, int64_t w) {                         \
    const T *KILN_RESTRICT q0 = p + k * ld, *KILN_RESTRICT q1 = q0 + (n > 1) * ld;            \
    const T *KILN_RESTRICT q2 = q0 + (n > 2) * 2 * ld;                                        \
    const T *KILN_RESTRICT q3 = q0 + (n > 3) * 3 * ld;                                        \
    for (int64_t j = 0; j < w; j++) {                                                         \
      T m = q0[j];                                                                            \
      int32_t o = 0;                                                                          \
      bool t = better_##SUF(q1[j], m);                                                        \
      m = t ? q1[j] : m, o = t ? 1 : o;                                                       \
      t = better_##SUF(q2[j], m);                                                             \
      m = t ? q2[j] : m, o = t ? 2 : o;                                                       \
      t = better_##SUF(q3[j], m);                                                             \
      m = t ? q3[j] : m, o = t ? 3 : o;                                                       \
      T b = best[j];                                                                          \
      t = better_##SUF(m, b);                                                                 \
      best[j] = t ? m : b;                                                                    \
      idx[j] = t ? k + o : idx[j];                                                            \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
  /* index of the first best element of p[0, n), n >= 1; its value in *val */                 \
  static int64_t row_argmax_##SUF(const T *p, int64_t n, T *val) {                            \
    T best = row_max_##SUF(p, n < ARG_BLOCK ? n : ARG_BLOCK);                                 \
    int64_t block = 0;                                                                        \
    for (int64_t b = ARG_BLOCK; b < n; b += ARG_BLOCK) {                                      \
      T m = row_max_##SUF(p + b, n - b < ARG_BLOCK ? n - b : ARG_BLOCK);                      \
      if (better_##SUF(m, best)) best = m, block = b;                                         \
    }                                                                                         \
    int64_t i = block; /* skip LANES-wide chunks without a match, then scan one */            \
    for (; i + LANES <= n; i += LANES) {                                                      \
      int hit = 0;                                                                            \
      for (int j = 0; j < LANES; j++) hit |= SAME(p[i + j], best);                            \
      if (hit) break;                                                                         \
    }                                                                                         \
    while (!SAME(p[i], best)) i++;                                                            \
    *val = best;                                                                              \
    return i;                                                                                 \
  }                                                                                           \
                                                                                              \
  static void argmax_task_##SUF(void *ctx, int64_t begin, int64_t end) {                      \
    const argmax_plan *P = ctx;                                                               \
    const T *in = P->in;                                                                      \
    for (int64_t t = begin; t < end; t++) {                                                   \
      if (P->inner == 1) {                                                                    \
        int64_t u = t / P->parts, s = t % P->parts, f0, f1;                                   \
        part_range(P->axis_len, P->parts, s, &f0, &f1);                                       \
        T val;                                                                                \
        int64_t i = f0 + row_argmax_##SUF(in + u * P->axis_len + f0, f1 - f0, &val);          \
        if (P->parts == 1) {                                                                  \
          P->out[u] = i;                                                                      \
        } else {                                                                              \
          ((T *)P->best)[t] = val;                                                            \
          P->where[t] = i;                                                                    \
        }                                                                                     \
        continue;                                                                             \
      }                                                                                       \
      int64_t o = t / P->tiles, j0 = t % P->tiles * ARG_TILE;                                 \
      int64_t w = P->inner - j0 < ARG_TILE ? P->inner - j0 : ARG_TILE;                        \
      const T *p = in + o * P->axis_len * P->inner + j0;                                      \
      T best[ARG_TILE];                                                                       \
      int64_t idx[ARG_TILE];                                                                  \
      for (int64_t j = 0; j < w; j++) best[j] = p[j], idx[j] = 0;                             \
      for (int64_t k = 1; k < P->axis_len; k += 4) {                                          \
        int n = P->axis_len - k < 4 ? (int)(P->axis_len - k) : 4;                             \
        argcol_##SUF(best, idx, p, P->inner, k, n, w);                                        \
      }                                                                                       \
      memcpy(P->out + o * P->inner + j0, idx, (size_t)w * sizeof(int64_t));                   \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
  static void argmax_combine_##SUF(const argmax_plan *P) {                                    \
    const T *best = P->best;                                                                  \
    for (int64_t u = 0; u < P->outer; u++) {                                                  \
      int64_t b = u * P->parts;                                                               \
      for (int64_t s = 1; s < P->parts; s++)                                                  \
        if (better_##SUF(best[u * P->parts + s], best[b])) b = u * P->parts + s;              \
      P->out[u] = P->where[b];                                                                \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
  static int argmax_##SUF(const op_call *c) {                                                 \
    const kiln_tensor *x = c->in[0];                                                          \
    int axis = c->attrs->axis;                                                                \
    argmax_plan P = {.in = x->data, .out = c->out->data, .outer = 1, .inner = 1, .parts = 1}; \
    for (int i = 0; i < axis; i++) P.outer *= x->shape[i];                                    \
    for (int i = axis + 1; i < x->rank; i++) P.inner *= x->shape[i];                          \
    P.axis_len = x->shape[axis];                                                              \
    if (c->out->size == 0) return 0;                                                          \
    P.tiles = (P.inner + ARG_TILE - 1) / ARG_TILE;                                            \
    int64_t units = P.outer * P.tiles, want = pieces(x->size);                                \
    int32_t cls = 0;                                                                          \
    if (P.inner == 1 && units < want) {                                                       \
      P.parts = (want + units - 1) / units;                                                   \
      if (P.parts > P.axis_len) P.parts = P.axis_len;                                         \
      if (P.parts > MAX_PARTS) P.parts = MAX_PARTS;                                           \
      size_t n = (size_t)(units * P.parts);                                                   \
      P.where = mem_alloc(n * (sizeof(int64_t) + sizeof(T)), &cls);                           \
      if (!P.where) return kiln_set_error("argmax: out of memory");                           \
      P.best = P.where + n;                                                                   \
    }                                                                                         \
    int64_t tasks = units * P.parts;                                                          \
    parallel_for(tasks, want > 1 ? (tasks + want - 1) / want : tasks, argmax_task_##SUF, &P); \
    if (P.parts > 1) {                                                                        \
      argmax_combine_##SUF(&P);                                                               \
      mem_free(P.where, cls);                                                                 \
    }                                                                                         \
    return 0;                                                                                 \
  }

ARGMAX(f32, float, BETTER_F, SAME_F)
ARGMAX(f64, double, BETTER_F, SAME_F)
ARGMAX(i32, int32_t, BETTER_I, SAME_I)
ARGMAX(i64, int64_t, BETTER_I, SAME_I)

#define REDUCE_KERNEL(NAME) \
  static int reduce_##NAME(const op_call *c) { return reduce_run(c, &impl_##NAME); }
REDUCE_KERNEL(sum_f32)
REDUCE_KERNEL(sum_f64)
REDUCE_KERNEL(sum_i32)
REDUCE_KERNEL(sum_i64)
REDUCE_KERNEL(prod_f32)
REDUCE_KERNEL(prod_f64)
REDUCE_KERNEL(prod_i32)
REDUCE_KERNEL(prod_i64)
REDUCE_KERNEL(max_f32)
REDUCE_KERNEL(max_f64)
REDUCE_KERNEL(max_i32)
REDUCE_KERNEL(max_i64)
REDUCE_KERNEL(min_f32)
REDUCE_KERNEL(min_f64)
REDUCE_KERNEL(min_i32)
REDUCE_KERNEL(min_i64)

KILN_CONSTRUCTOR static void register_kernels(void) {
#ifndef KILN_RT_BUILD /* libkiln_rt's helpers run argmax alone: compiled code does the reductions */
#define REG(OP, name)                                      \
  dispatch_register(OP, 0, KILN_F32, reduce_##name##_f32); \
  dispatch_register(OP, 0, KILN_F64, reduce_##name##_f64); \
  dispatch_register(OP, 0, KILN_I32, reduce_##name##_i32); \
  dispatch_register(OP, 0, KILN_I64, reduce_##name##_i64);
  REG(OP_REDUCE_SUM, sum)
  REG(OP_REDUCE_PROD, prod)
  REG(OP_REDUCE_MAX, max)
  REG(OP_REDUCE_MIN, min)
#undef REG
#endif
  dispatch_register(OP_ARGMAX, 0, KILN_F32, argmax_f32);
  dispatch_register(OP_ARGMAX, 0, KILN_F64, argmax_f64);
  dispatch_register(OP_ARGMAX, 0, KILN_I32, argmax_i32);
  dispatch_register(OP_ARGMAX, 0, KILN_I64, argmax_i64);
}
