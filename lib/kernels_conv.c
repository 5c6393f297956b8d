/* kernels_conv.c — CPU kernels of the window primitives over NHWC images
 * (API.md §10): conv2d with HWIO filters and its two gradients, max and
 * average pooling and theirs; and their public entry points, which turn
 * kiln_conv_opts (defaults, TensorFlow's SAME padding) into the explicit
 * attributes the op table's inference checks.
 *
 * Convolutions with one group are the direct NHWC kernels of conv_direct.c
 * (conv.h): conv2d, its filter gradient, and its input gradient for stride
 * 1 (a convolution of dy with the flipped filter). The filter gradient of a
 * 1x1 convolution was one blocked matmul of x^T and dy until the direct
 * kernel packed its pixels: 1x1 256 -> 64 at 56x56, batch 8, went from 46
 * to 75 GFLOP/s on one thread (95 to 116 on two). The rest are im2col +
 * the blocked matmul (matmul.h): the output rows (n, oy, ox) are taken in
 * chunks whose im2col block, rows x (kh kw cg), stays under
 * CONV_CHUNK_BYTES, so a big image never has its whole im2col buffer in
 * memory. Per group g of channels:
 *   conv2d:          out[rows, g]  = col(x)[rows, K] . f_g[K, og]
 *   backprop_input:  dcol[rows, K] = dy[rows, g] . f_g^T, scattered back
 *                    into dx (col2im, adding where windows overlap)
 *   backprop_filter: df_g[K, og]  += col(x)[rows, K]^T . dy[rows, g]
 * with K = kh * kw * cg, one filter row per (ky, kx, c) as HWIO lays it out.
 * Depthwise convolutions (one channel per group) are direct loops instead.
 * conv2d_epilogue (conv.h) is conv2d with the matmul's epilogue, applied by
 * the direct kernel as it stores, by a pass over the output elsewhere.
 * Every sum runs in a fixed order (chunks in turn, no atomics): the same
 * inputs give the same bits. Pooling is direct loops, vectorised over the
 * channels, in parallel over images. Only f32 and f64 (the op table). */
#include <math.h>
#include <stdlib.h>

#include "conv.h"

/* The most bytes of one chunk's im2col block. The fewest image channels
 * for which the input gradient takes the direct kernel (7x7 3 -> 64 stride
 * 2, one thread: 15 GFLOP/s direct, 49 through im2col + GEMM). */
enum { CONV_CHUNK_BYTES = 4 << 20, DIRECT_MIN_C = 16 };

/* ---- geometry ---- */

typedef struct {
  int64_t n, h, w, c;     /* the image */
  int64_t oh, ow, o;      /* the output (o = all output channels) */
  int64_t kh, kw, cg, og; /* the filter: rows, columns, channels per group in and out */
  int64_t groups;
  int64_t sh, sw, dh, dw, pt, pl;
  int64_t k;              /* kh * kw * cg: one row of im2col */
  size_t es;              /* element size */
  kiln_dtype dt;
} geom;

/* x [n,h,w,c], filter [kh,kw,cg,o], output [n,oh,ow,o] */
static void geom_init(geom *g, const int64_t *x, const int64_t *f, const int64_t *y, const op_attrs *a, kiln_dtype dt) {
  *g = (geom){.n = x[0], .h = x[1], .w = x[2], .c = x[3], .oh = y[1], .ow = y[2], .o = y[3], .kh = f[0], .kw = f[1],
              .cg = f[2], .groups = a->groups, .sh = a->stride[0], .sw = a->stride[1], .dh = a->dilation[0],
              .dw = a->dilation[1], .pt = a->padding[0], .pl = a->padding[2], .es = kiln_dtype_sizes[dt], .dt = dt};
  g->og = g->o / g->groups;
  g->k = g->kh * g->kw * g->cg;
}

/* output rows per chunk */
static int64_t chunk_rows(const geom *g) {
  int64_t rows = g->k ? CONV_CHUNK_BYTES / (g->k * (int64_t)g->es) : 1;
  int64_t all = g->n * g->oh * g->ow;
  if (rows < 1) rows = 1;
  return rows < all ? rows : all;
}

/* a rank-2 header over a raw buffer, for the matmul */
static void mat(kiln_tensor *h, kiln_dtype dt, int64_t rows, int64_t cols, void *data) {
  memset(h, 0, sizeof *h);
  atomic_init(&h->refs, 1);
  h->dtype = (uint8_t)dt;
  h->rank = 2;
  h->shape[0] = rows, h->shape[1] = cols;
  h->size = rows * cols;
  h->data = data;
}

/* ---- im2col and col2im ---- */

typedef struct {
  const geom *g;
  const char *x; /* the image */
  char *col;     /* rows x k */
  int64_t r0;    /* the chunk's first output row */
  int64_t group;
} cols_ctx;

/* col[r - r0] = the window of output row r, its cg channels of the group per
 * (ky, kx), zeros where the window hangs over the padding */
static void im2col_task(void *arg, int64_t b, int64_t e) {
  const cols_ctx *t = arg;
  const geom *g = t->g;
  size_t run = (size_t)g->cg * g->es;
  for (int64_t i = b; i < e; i++) {
    int64_t r = t->r0 + i, n = r / (g->oh * g->ow), oy = r / g->ow % g->oh, ox = r % g->ow;
    char *dst = t->col + (size_t)(i * g->k) * g->es;
    for (int64_t ky = 0; ky < g->kh; ky++) {
      int64_t iy = oy * g->sh - g->pt + ky * g->dh;
      for (int64_t kx = 0; kx < g->kw; kx++, dst += run) {
        int64_t ix = ox * g->sw - g->pl + kx * g->dw;
        if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w)
          memset(dst, 0, run);
        else
          memcpy(dst, t->x + (size_t)(((n * g->h + iy) * g->w + ix) * g->c + t->group * g->cg) * g->es, run);
      }
    }
  }
}

static void im2col(const geom *g, const void *x, void *col, int64_t r0, int64_t rows, int64_t group) {
  cols_ctx t = {g, x, col, r0, group};
  parallel_for(rows, 64, im2col_task, &t);
}

/* dx[window of row r] += dcol[r - r0] over the chunk's rows, in order */
#define COL2IM(T)                                                                                   \
  static void col2im_##T(const geom *g, T *dx, const T *dcol, int64_t r0, int64_t rows, int64_t group) { \
    for (int64_t i = 0; i < rows; i++) {                                                            \
      int64_t r = r0 + i, n = r / (g->oh * g->ow), oy = r / g->ow % g->oh, ox = r % g->ow;          \
      const T *src = dcol + i * g->k;                                                               \
      for (int64_t ky = 0; ky < g->kh; ky++) {                                                      \
        int64_t iy = oy * g->sh - g->pt + ky * g->dh;                                               \
        for (int64_t kx = 0; kx < g->kw; kx++, src += g->cg) {                                      \
          int64_t ix = ox * g->sw - g->pl + kx * g->dw;                                             \
          if (iy < 0 || iy >= g->h || ix < 0 || ix >= g->w) continue;                               \
          T *restrict d = dx + ((n * g->h + iy) * g->w + ix) * g->c + group * g->cg;                \
          for (int64_t c = 0; c < g->cg; c++) d[c] += src[c];                                       \
        }                                                                                           \
      }                                                                                             \
    }                                                                                               \
  }
COL2IM(float)
COL2IM(double)

static void col2im(const geom *g, void *dx, const void *dcol, int64_t r0, int64_t rows, int64_t group) {
  if (g->dt == KILN_F32)
    col2im_float(g, dx, dcol, r0, rows, group);
  else
    col2im_double(g, dx, dcol, r0, rows, group);
}

/* ---- moving a group's columns ---- */

/* dst[r, 0:cols] = src[r, off:off+cols] (src rows ld elements long) */
static void take_cols(const geom *g, char *dst, const char *src, int64_t rows, int64_t ld, int64_t off, int64_t cols) {
  size_t run = (size_t)cols * g->es;
  for (int64_t r = 0; r < rows; r++) memcpy(dst + r * run, src + (size_t)(r * ld + off) * g->es, run);
}

/* dst[r, off:off+cols] = src[r, 0:cols] */
static void put_cols(const geom *g, char *dst, const char *src, int64_t rows, int64_t ld, int64_t off, int64_t cols) {
  size_t run = (size_t)cols * g->es;
  for (int64_t r = 0; r < rows; r++) memcpy(dst + (size_t)(r * ld + off) * g->es, src + r * run, run);
}

/* ---- depthwise: direct loops ----
 * One input channel per group (cg = 1, groups = c, og = o / c the channel
 * multiplier): output channel k reads input channel k / og only, so im2col
 * would copy single elements and multiply c matrices of one column. Here
 * each tap (ky, kx) is a vector operation over the channels, in the order
 * the taps come. Forward and backprop_input split the work over images
 * (each writes only its own), backprop_filter over taps (each sums every
 * position for its own): deterministic either way. */

typedef struct {
  const geom *g;
  const void *a, *b; /* conv2d: x, f; backprop_input: dy, f; backprop_filter: x, dy */
  void *out;
} dw_ctx;

#define DEPTHWISE(T)                                                                                  \
  static void dw_fwd_##T(void *arg, int64_t b, int64_t e) {                                           \
    const dw_ctx *t = arg;                                                                            \
    const geom *g = t->g;                                                                             \
    const T *x = t->a, *f = t->b;                                                                     \
    int64_t m = g->og;                                                                                \
    for (int64_t r = b; r < e; r++) {                                                                 \
      int64_t n = r / (g->oh * g->ow), oy = r / g->ow % g->oh, ox = r % g->ow;                        \
      T *restrict y = (T *)t->out + r * g->o;                                                         \
      for (int64_t k = 0; k < g->o; k++) y[k] = 0;                                                    \
      for (int64_t ky = 0; ky < g->kh; ky++) {                                                        \
        int64_t iy = oy * g->sh - g->pt + ky * g->dh;                                                 \
        if (iy < 0 || iy >= g->h) continue;                                                           \
        for (int64_t kx = 0; kx < g->kw; kx++) {                                                      \
          int64_t ix = ox * g->sw - g->pl + kx * g->dw;                                               \
          if (ix < 0 || ix >= g->w) continue;                                                         \
          const T *restrict v = x + ((n * g->h + iy) * g->w + ix) * g->c;                             \
          const T *restrict w = f + (ky * g->kw + kx) * g->o;                                         \
          if (m == 1)                                                                                 \
            for (int64_t k = 0; k < g->o; k++) y[k] += v[k] * w[k];                                   \
          else                                                                                        \
            for (int64_t k = 0; k < g->o; k++) y[k] += v[k / m] * w[k];                               \
        }                                                                                             \
      }                                                                                               \
    }                                                                                                 \
  }                                                                                                   \
  /* images [b, e) of dx (zeroed) */                                                                  \
  static void dw_bp_input_##T(void *arg, int64_t b, int64_t e) {                                      \
    const dw_ctx *t = arg;                                                                            \
    const geom *g = t->g;                                                                             \
    const T *dy = t->a, *f = t->b;                                                                    \
    int64_t m = g->og;                                                                                \
    for (int64_t n = b; n < e; n++)                                                                   \
      for (int64_t oy = 0; oy < g->oh; oy++)                                                          \
        for (int64_t ox = 0; ox < g->ow; ox++) {                                                      \
          const T *restrict d = dy + ((n * g->oh + oy) * g->ow + ox) * g->o;                          \
          for (int64_t ky = 0; ky < g->kh; ky++) {                                                    \
            int64_t iy = oy * g->sh - g->pt + ky * g->dh;                                             \
            if (iy < 0 || iy >= g->h) continue;                                                       \
            for (int64_t kx = 0; kx < g->kw; kx++) {                                                  \
              int64_t ix = ox * g->sw - g->pl + kx * g->dw;                                           \
              if (ix < 0 || ix >= g->w) continue;                                                     \
              T *restrict dx = (T *)t->out + ((n * g->h + iy) * g->w + ix) * g->c;                    \
              const T *restrict w = f + (ky * g->kw + kx) * g->o;                                     \
              if (m == 1)                                                                             \
                for (int64_t k = 0; k < g->o; k++) dx[k] += d[k] * w[k];                              \
              else                                                                                    \
                for (int64_t k = 0; k < g->o; k++) dx[k / m] += d[k] * w[k];                          \
            }                                                                                         \
          }                                                                                           \
        }                                                                                             \
  }                                                                                                   \
  /* taps [b, e) of df (zeroed) */                                                                    \
  static void dw_bp_filter_##T(void *arg, int64_t b, int64_t e) {                                     \
    const dw_ctx *t = arg;                                                                            \
    const geom *g = t->g;                                                                             \
    const T *x = t->a, *dy = t->b;                                                                    \
    int64_t m = g->og;                                                                                \
    for (int64_t tap = b; tap < e; tap++) {                                                           \
      int64_t ky = tap / g->kw, kx = tap % g->kw;                                                     \
      T *restrict acc = (T *)t->out + tap * g->o;                                                     \
      for (int64_t n = 0; n < g->n; n++)                                                              \
        for (int64_t oy = 0; oy < g->oh; oy++) {                                                      \
          int64_t iy = oy * g->sh - g->pt + ky * g->dh;                                               \
          if (iy < 0 || iy >= g->h) continue;                                                         \
          for (int64_t ox = 0; ox < g->ow; ox++) {                                                    \
            int64_t ix = ox * g->sw - g->pl + kx * g->dw;                                             \
            if (ix < 0 || ix >= g->w) continue;                                                       \
            const T *restrict v = x + ((n * g->h + iy) * g->w + ix) * g->c;                           \
            const T *restrict d = dy + ((n * g->oh + oy) * g->ow + ox) * g->o;                        \
            if (m == 1)                                                                               \
              for (int64_t k = 0; k < g->o; k++) acc[k] += v[k] * d[k];                               \
            else                                                                                      \
              for (int64_t k = 0; k < g->o; k++) acc[k] += v[k / m] * d[k];                           \
          }                                                                                           \
        }                                                                                             \
    }                                                                                                 \
  }
DEPTHWISE(float)
DEPTHWISE(double)

/* depthwise with more than one group (one channel is an ordinary conv) */
static bool depthwise(const geom *g) { return g->cg == 1 && g->groups == g->c && g->groups > 1; }

/* ---- the three convolutions ---- */

/* The buffers of one kernel call, freed together. */
typedef struct {
  void *col, *tmp, *fg, *acc;
} bufs;

static void bufs_free(bufs *b) {
  free(b->col), free(b->tmp), free(b->fg), free(b->acc);
}

static int oom(op_id op, bufs *b) {
  bufs_free(b);
  return kiln_set_error("%s: out of memory", kiln_ops[op].api);
}

/* a chunk's columns (rows x k) and, with groups, a group's share of a
 * chunk's products (rows x og) and of the filter (k x og); 0, or -1 out of
 * memory (nothing left allocated) */
static int chunk_bufs(const geom *g, op_id op, int64_t rows, bufs *b) {
  *b = (bufs){malloc((size_t)(rows * g->k) * g->es), NULL, NULL, NULL};
  if (!b->col) return oom(op, b);
  if (g->groups > 1 &&
      (!(b->tmp = malloc((size_t)(rows * g->og) * g->es)) || !(b->fg = malloc((size_t)(g->k * g->og) * g->es))))
    return oom(op, b);
  return 0;
}

/* the filter's columns of group grp as a [k, og] matrix (the filter itself
 * for one group) */
static const void *group_filter(const geom *g, const void *f, void *buf, int64_t grp) {
  if (g->groups == 1) return f;
  take_cols(g, buf, f, g->k, g->o, grp * g->og, g->og);
  return buf;
}

/* The direct kernel's shape of a one-group convolution (conv.h). */
static conv_shape direct_shape(const geom *g) {
  return (conv_shape){.n = g->n, .h = g->h, .w = g->w, .c = g->c, .oh = g->oh, .ow = g->ow, .o = g->o, .kh = g->kh,
                      .kw = g->kw, .sh = g->sh, .sw = g->sw, .dh = g->dh, .dw = g->dw, .pt = g->pt, .pl = g->pl};
}

/* out = act((out + bias) + res) row by row: the epilogue of the paths whose
 * kernels do not apply it as they store (the same operations, in the same
 * order, as the micro-kernels' epilogue) */
#define EPILOGUE_PASS(T)                                                                                  \
  static void epilogue_pass_##T(T *out, const T *bias, const T *res, gemm_epilogue epi, int64_t rows,      \
                                int64_t o) {                                                              \
    for (int64_t r = 0; r < rows; r++, out += o, res = res ? res + o : NULL)                              \
      for (int64_t j = 0; j < o; j++) {                                                                   \
        T v = out[j];                                                                                     \
        if (epi != GEMM_EPI_NONE) v += bias[j];                                                           \
        if (res) v += res[j];                                                                             \
        if (epi == GEMM_EPI_BIAS_RELU) v = v < 0 ? (T)0 : v;                                              \
        if (epi == GEMM_EPI_BIAS_TANH) v = sizeof(T) == 4 ? (T)tanhf((float)v) : (T)tanh((double)v);     \
        out[j] = v;                                                                                       \
      }                                                                                                   \
  }
EPILOGUE_PASS(float)
EPILOGUE_PASS(double)

/* out = act((conv2d(x, f) + bias) + res) (res may be NULL; bias read only
 * with an epilogue); owner: f's tensor, when its packing may be kept
 * (conv_direct) */
static int conv2d_run(const geom *gp, op_id op, const void *x, const void *f, const kiln_tensor *owner,
                      const void *bias, gemm_epilogue epi, const void *res, void *out) {
  geom g = *gp;
  kiln_tensor A, B, C;
  int64_t m = g.n * g.oh * g.ow;
  int rc = 0;
  bool done = false; /* the epilogue applied */
  if (m == 0 || g.o == 0) return 0;
  if (g.k == 0) { /* no input channels: empty sums */
    memset(out, 0, (size_t)(m * g.o) * g.es);
  } else if (g.groups == 1) {
    conv_shape s = direct_shape(&g);
    rc = conv_direct(&s, g.dt, x, f, owner, bias, epi, res, out, kiln_ops[op].api);
    done = true;
  } else if (depthwise(&g)) {
    dw_ctx t = {&g, x, f, out};
    parallel_for(m, 64, g.dt == KILN_F32 ? dw_fwd_float : dw_fwd_double, &t);
  } else {
    int64_t rows = chunk_rows(&g);
    bufs b;
    if (chunk_bufs(&g, op, rows, &b)) return -1;
    for (int64_t grp = 0; grp < g.groups && !rc; grp++) {
      mat(&B, g.dt, g.k, g.og, (void *)group_filter(&g, f, b.fg, grp));
      for (int64_t r0 = 0; r0 < m && !rc; r0 += rows) {
        int64_t nr = m - r0 < rows ? m - r0 : rows;
        im2col(&g, x, b.col, r0, nr, grp);
        mat(&A, g.dt, nr, g.k, b.col);
        char *dst = (char *)out + (size_t)(r0 * g.o) * g.es;
        mat(&C, g.dt, nr, g.og, b.tmp);
        rc = matmul_epilogue(&A, &B, NULL, GEMM_EPI_NONE, &C);
        if (!rc) put_cols(&g, dst, b.tmp, nr, g.o, grp * g.og, g.og);
      }
    }
    bufs_free(&b);
  }
  if (!rc && !done && (epi != GEMM_EPI_NONE || res)) {
    if (g.dt == KILN_F32)
      epilogue_pass_float(out, bias, res, epi, m, g.o);
    else
      epilogue_pass_double(out, bias, res, epi, m, g.o);
  }
  return rc;
}

static int conv2d_kernel(const op_call *c) {
  geom g;
  geom_init(&g, c->in[0]->shape, c->in[1]->shape, c->out->shape, c->attrs, (kiln_dtype)c->out->dtype);
  return conv2d_run(&g, c->op, c->in[0]->data, c->in[1]->data, c->in[1], NULL, GEMM_EPI_NONE, NULL, c->out->data);
}

/* conv2d_epilogue and conv2d_epilogue_residual: the checks, then conv2d_run */
static int conv2d_fused(const kiln_tensor *x, const kiln_tensor *filter, const kiln_tensor *bias, gemm_epilogue epi,
                        const kiln_tensor *res, const op_attrs *attrs, kiln_tensor *out) {
  if (!x || !filter || !out || !attrs) return kiln_set_error("conv2d: NULL operand for a fused conv2d");
  if ((int)epi < 0 || epi >= GEMM_EPI_COUNT) return kiln_set_error("conv2d: no epilogue %d", (int)epi);
  if (x->dtype != KILN_F32 && x->dtype != KILN_F64)
    return kiln_set_error("conv2d: a fused conv2d needs f32 or f64, not %s", kiln_dtype_name((kiln_dtype)x->dtype));
  op_type in[2], want;
  op_type_of(x, &in[0]), op_type_of(filter, &in[1]);
  if (kiln_ops[OP_CONV2D].infer(OP_CONV2D, attrs, 2, in, &want)) return -1;
  if (!op_type_is(out, &want)) return kiln_set_error("conv2d: the output does not have the convolution's type");
  if (!x->data || !filter->data || !out->data) return kiln_set_error("conv2d: a fused conv2d needs host tensors");
  if (epi != GEMM_EPI_NONE &&
      (!bias || bias->dtype != x->dtype || bias->rank != 1 || bias->shape[0] != out->shape[3] || !bias->data))
    return kiln_set_error("conv2d: the bias must be %lld values of the convolution's dtype",
                          (long long)out->shape[3]);
  if (res && (!op_type_is(res, &want) || !res->data))
    return kiln_set_error("conv2d: the residual must have the convolution's type");
  if (res && res->data == out->data) return kiln_set_error("conv2d: the residual and the output must not alias");
  geom g;
  geom_init(&g, x->shape, filter->shape, out->shape, attrs, (kiln_dtype)x->dtype);
  return conv2d_run(&g, OP_CONV2D, x->data, filter->data, filter, epi != GEMM_EPI_NONE ? bias->data : NULL, epi,
                    res ? res->data : NULL, out->data);
}

int conv2d_epilogue(const kiln_tensor *x, const kiln_tensor *filter, const kiln_tensor *bias, gemm_epilogue epi,
                    const op_attrs *attrs, kiln_tensor *out) {
  return conv2d_fused(x, filter, bias, epi, NULL, attrs, out);
}

int conv2d_epilogue_residual(const kiln_tensor *x, const kiln_tensor *filter, const kiln_tensor *bias,
                             gemm_epilogue epi, const kiln_tensor *residual, const op_attrs *attrs, kiln_tensor *out) {
  if (!residual) return kiln_set_error("conv2d: NULL residual for a fused conv2d");
  return conv2d_fused(x, filter, bias, epi, residual, attrs, out);
}

/* The input gradient of a strided convolution (one group, no dilation)
 * through the direct kernel, phase by phase: the pixels (iy, ix) of dx with
 * iy = qy*sh + ry and ix = qx*sw + rx receive only the taps ky = ky0 +
 * m*sh (ky0 = (ry + pt) mod sh), from dy row qy + (ry + pt - ky0)/sh - m,
 * and likewise along x: a stride-1 convolution of dy with every sh-th
 * (sw-th) tap of the filter, flipped, written to every sh-th row and sw-th
 * pixel of dx. A phase no tap reaches (a 1x1 filter's, stride 2) is zeros.
 * Each element of dx is one sum of one phase: the bits do not depend on the
 * thread count. */
static int bp_input_phases(const geom *g, const void *dy, const void *f, const kiln_tensor *owner, void *dx,
                           const char *op) {
  for (int64_t ry = 0; ry < g->sh && ry < g->h; ry++)
    for (int64_t rx = 0; rx < g->sw && rx < g->w; rx++) {
      int64_t ky0 = (ry + g->pt) % g->sh, kx0 = (rx + g->pl) % g->sw;
      int64_t my = ky0 < g->kh ? (g->kh - 1 - ky0) / g->sh + 1 : 0; /* taps of the phase */
      int64_t mx = kx0 < g->kw ? (g->kw - 1 - kx0) / g->sw + 1 : 0;
      int64_t ohp = (g->h - ry + g->sh - 1) / g->sh, owp = (g->w - rx + g->sw - 1) / g->sw;
      char *out = (char *)dx + (size_t)((ry * g->w + rx) * g->c) * g->es;
      if (!my || !mx) { /* no tap reaches these pixels */
        for (int64_t n = 0; n < g->n; n++)
          for (int64_t qy = 0; qy < ohp; qy++)
            for (int64_t qx = 0; qx < owp; qx++)
              memset(out + (size_t)(((n * g->h + qy * g->sh) * g->w + qx * g->sw) * g->c) * g->es, 0,
                     (size_t)g->c * g->es);
        continue;
      }
      conv_shape s = {.n = g->n, .h = g->oh, .w = g->ow, .c = g->o, .oh = ohp, .ow = owp, .o = g->c, .kh = my,
                      .kw = mx, .sh = 1, .sw = 1, .dh = 1, .dw = 1,
                      .pt = my - 1 - (ry + g->pt - ky0) / g->sh, .pl = mx - 1 - (rx + g->pl - kx0) / g->sw,
                      .flip = true, .fkh = g->kh, .fkw = g->kw, .fy0 = ky0 + (my - 1) * g->sh, .fys = -g->sh,
                      .fx0 = kx0 + (mx - 1) * g->sw, .fxs = -g->sw, .opx = g->sw * g->c,
                      .orow = g->sh * g->w * g->c, .oimg = g->h * g->w * g->c};
      if (conv_direct(&s, g->dt, dy, f, owner, NULL, GEMM_EPI_NONE, NULL, out, op)) return -1;
    }
  return 0;
}

/* in: dy [n,oh,ow,o], filter; out: dx [n,h,w,c] */
static int conv2d_bp_input_kernel(const op_call *c) {
  geom g;
  geom_init(&g, c->out->shape, c->in[1]->shape, c->in[0]->shape, c->attrs, (kiln_dtype)c->out->dtype);
  kiln_tensor A, B, C;
  int64_t m = g.n * g.oh * g.ow;
  if (c->out->size == 0) return 0;
  /* the direct kernel's tiles are 32 or 64 channels of dx wide: with fewer
   * than DIRECT_MIN_C (an RGB stem's 3) im2col + GEMM wastes less */
  bool direct = g.groups == 1 && g.c >= DIRECT_MIN_C && m > 0 && g.o > 0;
  if (direct && (g.sh > 1 || g.sw > 1) && g.dh == 1 && g.dw == 1)
    return bp_input_phases(&g, c->in[0]->data, c->in[1]->data, c->in[1], c->out->data, kiln_ops[c->op].api);
  if (direct && g.sh == 1 && g.sw == 1) {
    /* stride 1: the convolution of dy with the flipped filter, its in and
     * out channels swapped, padded by the window's span less the padding
     * (the far sides implied by dx's size) */
    conv_shape s = {.n = g.n, .h = g.oh, .w = g.ow, .c = g.o, .oh = g.h, .ow = g.w, .o = g.c, .kh = g.kh,
                    .kw = g.kw, .sh = 1, .sw = 1, .dh = g.dh, .dw = g.dw, .pt = g.dh * (g.kh - 1) - g.pt,
                    .pl = g.dw * (g.kw - 1) - g.pl, .flip = true};
    return conv_direct(&s, g.dt, c->in[0]->data, c->in[1]->data, c->in[1], NULL, GEMM_EPI_NONE, NULL,
                       c->out->data, kiln_ops[c->op].api);
  }
  memset(c->out->data, 0, tensor_bytes(c->out));
  if (m == 0 || g.og == 0) return 0;
  if (depthwise(&g)) {
    dw_ctx t = {&g, c->in[0]->data, c->in[1]->data, c->out->data};
    parallel_for(g.n, 1, g.dt == KILN_F32 ? dw_bp_input_float : dw_bp_input_double, &t);
    return 0;
  }
  int64_t rows = chunk_rows(&g);
  bufs b;
  if (chunk_bufs(&g, c->op, rows, &b)) return -1;
  int rc = 0;
  for (int64_t grp = 0; grp < g.groups && !rc; grp++) {
    mat(&B, g.dt, g.k, g.og, (void *)group_filter(&g, c->in[1]->data, b.fg, grp));
    for (int64_t r0 = 0; r0 < m && !rc; r0 += rows) {
      int64_t nr = m - r0 < rows ? m - r0 : rows;
      char *src = (char *)c->in[0]->data + (size_t)(r0 * g.o) * g.es;
      if (g.groups > 1) take_cols(&g, b.tmp, src, nr, g.o, grp * g.og, g.og);
      mat(&A, g.dt, nr, g.og, g.groups > 1 ? b.tmp : src);
      mat(&C, g.dt, nr, g.k, b.col);
      rc = matmul_trans(&A, &B, false, true, &C);
      if (!rc) col2im(&g, c->out->data, b.col, r0, nr, grp);
    }
  }
  bufs_free(&b);
  return rc;
}

/* acc += part, n elements */
static void accumulate(const geom *g, void *acc, const void *part, int64_t n) {
  if (g->dt == KILN_F32) {
    float *restrict a = acc;
    const float *restrict p = part;
    for (int64_t i = 0; i < n; i++) a[i] += p[i];
  } else {
    double *restrict a = acc;
    const double *restrict p = part;
    for (int64_t i = 0; i < n; i++) a[i] += p[i];
  }
}

/* in: x, dy [n,oh,ow,o]; out: df [kh,kw,cg,o] */
static int conv2d_bp_filter_kernel(const op_call *c) {
  geom g;
  geom_init(&g, c->in[0]->shape, c->out->shape, c->in[1]->shape, c->attrs, (kiln_dtype)c->out->dtype);
  kiln_tensor A, B, C;
  int64_t m = g.n * g.oh * g.ow;
  if (c->out->size == 0) return 0;
  if (g.groups == 1) {
    conv_shape s = direct_shape(&g);
    return conv_direct_filter(&s, g.dt, c->in[0]->data, c->in[1]->data, c->out->data, kiln_ops[c->op].api);
  }
  memset(c->out->data, 0, tensor_bytes(c->out));
  if (m == 0) return 0;
  if (depthwise(&g)) {
    dw_ctx t = {&g, c->in[0]->data, c->in[1]->data, c->out->data};
    parallel_for(g.kh * g.kw, 1, g.dt == KILN_F32 ? dw_bp_filter_float : dw_bp_filter_double, &t);
    return 0;
  }
  int64_t rows = chunk_rows(&g);
  size_t part = (size_t)(g.k * g.og) * g.es;
  bufs b = {malloc((size_t)(rows * g.k) * g.es), malloc((size_t)(rows * g.og) * g.es + 1), malloc(part),
            malloc(part)};
  if (!b.col || !b.tmp || !b.fg || !b.acc) return oom(c->op, &b);
  int rc = 0;
  for (int64_t grp = 0; grp < g.groups && !rc; grp++) {
    memset(b.acc, 0, part);
    for (int64_t r0 = 0; r0 < m && !rc; r0 += rows) {
      int64_t nr = m - r0 < rows ? m - r0 : rows;
      im2col(&g, c->in[0]->data, b.col, r0, nr, grp);
      char *src = (char *)c->in[1]->data + (size_t)(r0 * g.o) * g.es;
      if (g.groups > 1) take_cols(&g, b.tmp, src, nr, g.o, grp * g.og, g.og);
      mat(&A, g.dt, nr, g.k, b.col), mat(&B, g.dt, nr, g.og, g.groups > 1 ? b.tmp : src);
      mat(&C, g.dt, g.k, g.og, r0 == 0 ? b.acc : b.fg); /* the first chunk's product is the sum so far */
      rc = matmul_trans(&A, &B, true, false, &C);
      if (!rc && r0 > 0) accumulate(&g, b.acc, b.fg, g.k * g.og);
    }
    if (!rc) put_cols(&g, c->out->data, b.acc, g.k, g.o, grp * g.og, g.og);
  }
  bufs_free(&b);
  return rc;
}

/* ---- pooling ----
 * The window of output (oy, ox) covers rows [oy*sh - pt, +kh) and columns
 * [ox*sw - pl, +kw) of the image; the padding never counts (inference
 * keeps it smaller than the window, so every window holds an element).
 * Max pooling propagates NaN. Its gradient goes to the elements equal to
 * the window's max, shared evenly among ties: what reduce_max's gradient
 * does (gradients.c, g_reduce_extremum), not TensorFlow's first arg-max.
 * Average pooling divides by the count of image elements in the window, as
 * TensorFlow does (count_include_pad=False in PyTorch). */

typedef struct {
  int64_t n, h, w, c, oh, ow, kh, kw, sh, sw, pt, pl;
} pgeom;

static void pgeom_init(pgeom *p, const int64_t *x, const int64_t *y, const op_attrs *a) {
  *p = (pgeom){x[0], x[1], x[2], x[3], y[1], y[2], a->window[0], a->window[1], a->stride[0], a->stride[1],
               a->padding[0], a->padding[2]};
}

/* the image rows [*y0, *y1) and columns [*x0, *x1) of window (oy, ox) */
static void pool_window(const pgeom *p, int64_t oy, int64_t ox, int64_t *y0, int64_t *y1, int64_t *x0, int64_t *x1) {
  int64_t ys = oy * p->sh - p->pt, xs = ox * p->sw - p->pl;
  *y0 = ys < 0 ? 0 : ys, *y1 = ys + p->kh < p->h ? ys + p->kh : p->h;
  *x0 = xs < 0 ? 0 : xs, *x1 = xs + p->kw < p->w ? xs + p->kw : p->w;
}

typedef struct {
  const pgeom *p;
  const void *x, *dy;
  void *out;
  void *scratch; /* max_pool2d_grad: 2 c elements per image */
} pool_ctx;

#define POOL_KERNELS(T)                                                                                   \
  /* the max of each channel over window (oy, ox) of image n into m */                                    \
  static inline void window_max_##T(const pgeom *p, const T *x, int64_t n, int64_t oy, int64_t ox,       \
                                    T *restrict m) {                                                      \
    int64_t y0, y1, x0, x1;                                                                               \
    pool_window(p, oy, ox, &y0, &y1, &x0, &x1);                                                           \
    for (int64_t c = 0; c < p->c; c++) m[c] = -(T)INFINITY;                                               \
    for (int64_t iy = y0; iy < y1; iy++)                                                                  \
      for (int64_t ix = x0; ix < x1; ix++) {                                                              \
        const T *restrict v = x + ((n * p->h + iy) * p->w + ix) * p->c;                                   \
        for (int64_t c = 0; c < p->c; c++) m[c] = v[c] > m[c] || v[c] != v[c] ? v[c] : m[c];             \
      }                                                                                                   \
  }                                                                                                       \
  KILN_HOT static void max_pool_task_##T(void *arg, int64_t b, int64_t e) {                                        \
    const pool_ctx *t = arg;                                                                              \
    const pgeom *p = t->p;                                                                                \
    for (int64_t r = b; r < e; r++) {                                                                     \
      int64_t n = r / (p->oh * p->ow), oy = r / p->ow % p->oh, ox = r % p->ow;                            \
      window_max_##T(p, t->x, n, oy, ox, (T *)t->out + r * p->c);                                         \
    }                                                                                                     \
  }                                                                                                       \
  KILN_HOT static void avg_pool_task_##T(void *arg, int64_t b, int64_t e) {                                        \
    const pool_ctx *t = arg;                                                                              \
    const pgeom *p = t->p;                                                                                \
    const T *x = t->x;                                                                                    \
    for (int64_t r = b; r < e; r++) {                                                                     \
      int64_t n = r / (p->oh * p->ow), oy = r / p->ow % p->oh, ox = r % p->ow, y0, y1, x0, x1;            \
      T *restrict s = (T *)t->out + r * p->c;                                                             \
      pool_window(p, oy, ox, &y0, &y1, &x0, &x1);                                                         \
      for (int64_t c = 0; c < p->c; c++) s[c] = 0;                                                        \
      for (int64_t iy = y0; iy < y1; iy++)                                                                \
        for (int64_t ix = x0; ix < x1; ix++) {                                                            \
          const T *restrict v = x + ((n * p->h + iy) * p->w + ix) * p->c;                                 \
          for (int64_t c = 0; c < p->c; c++) s[c] += v[c];                                                \
        }                                                                                                 \
      T count = (T)((y1 - y0) * (x1 - x0));                                                               \
      for (int64_t c = 0; c < p->c; c++) s[c] /= count;                                                   \
    }                                                                                                     \
  }                                                                                                       \
  /* images [b, e): each task owns its images' part of dx */                                              \
  KILN_HOT static void max_pool_grad_task_##T(void *arg, int64_t b, int64_t e) {                                   \
    const pool_ctx *t = arg;                                                                              \
    const pgeom *p = t->p;                                                                                \
    const T *x = t->x, *dy = t->dy;                                                                       \
    T *dx = t->out;                                                                                       \
    for (int64_t n = b; n < e; n++)                                                                       \
      for (int64_t oy = 0; oy < p->oh; oy++)                                                              \
        for (int64_t ox = 0; ox < p->ow; ox++) {                                                          \
          int64_t y0, y1, x0, x1;                                                                         \
          T *restrict m = (T *)t->scratch + 2 * n * p->c, *restrict cnt = m + p->c;                       \
          const T *g = dy + ((n * p->oh + oy) * p->ow + ox) * p->c;                                       \
          window_max_##T(p, x, n, oy, ox, m);                                                             \
          pool_window(p, oy, ox, &y0, &y1, &x0, &x1);                                                     \
          for (int64_t c = 0; c < p->c; c++) cnt[c] = 0;                                                  \
          for (int64_t iy = y0; iy < y1; iy++)                                                            \
            for (int64_t ix = x0; ix < x1; ix++) {                                                        \
              const T *restrict v = x + ((n * p->h + iy) * p->w + ix) * p->c;                             \
              for (int64_t c = 0; c < p->c; c++) cnt[c] += v[c] == m[c];                                  \
            }                                                                                             \
          for (int64_t c = 0; c < p->c; c++) cnt[c] = cnt[c] > 0 ? g[c] / cnt[c] : 0;                     \
          for (int64_t iy = y0; iy < y1; iy++)                                                            \
            for (int64_t ix = x0; ix < x1; ix++) {                                                        \
              int64_t at = ((n * p->h + iy) * p->w + ix) * p->c;                                          \
              const T *restrict v = x + at;                                                               \
              T *restrict d = dx + at;                                                                    \
              for (int64_t c = 0; c < p->c; c++) d[c] += v[c] == m[c] ? cnt[c] : 0;                       \
            }                                                                                             \
        }                                                                                                 \
  }                                                                                                       \
  KILN_HOT static void avg_pool_grad_task_##T(void *arg, int64_t b, int64_t e) {                                   \
    const pool_ctx *t = arg;                                                                              \
    const pgeom *p = t->p;                                                                                \
    const T *dy = t->dy;                                                                                  \
    T *dx = t->out;                                                                                       \
    for (int64_t n = b; n < e; n++)                                                                       \
      for (int64_t oy = 0; oy < p->oh; oy++)                                                              \
        for (int64_t ox = 0; ox < p->ow; ox++) {                                                          \
          int64_t y0, y1, x0, x1;                                                                         \
          const T *restrict g = dy + ((n * p->oh + oy) * p->ow + ox) * p->c;                              \
          pool_window(p, oy, ox, &y0, &y1, &x0, &x1);                                                     \
          T count = (T)((y1 - y0) * (x1 - x0));                                                           \
          for (int64_t iy = y0; iy < y1; iy++)                                                            \
            for (int64_t ix = x0; ix < x1; ix++) {                                                        \
              T *restrict d = dx + ((n * p->h + iy) * p->w + ix) * p->c;                                  \
              for (int64_t c = 0; c < p->c; c++) d[c] += g[c] / count;                                    \
            }                                                                                             \
        }                                                                                                 \
  }
POOL_KERNELS(float)
POOL_KERNELS(double)

static int max_pool_kernel(const op_call *c) {
  pgeom p;
  pgeom_init(&p, c->in[0]->shape, c->out->shape, c->attrs);
  pool_ctx t = {&p, c->in[0]->data, NULL, c->out->data, NULL};
  if (c->out->size == 0) return 0;
  parallel_for(p.n * p.oh * p.ow, 256, c->out->dtype == KILN_F32 ? max_pool_task_float : max_pool_task_double, &t);
  return 0;
}

static int avg_pool_kernel(const op_call *c) {
  pgeom p;
  pgeom_init(&p, c->in[0]->shape, c->out->shape, c->attrs);
  pool_ctx t = {&p, c->in[0]->data, NULL, c->out->data, NULL};
  if (c->out->size == 0) return 0;
  parallel_for(p.n * p.oh * p.ow, 256, c->out->dtype == KILN_F32 ? avg_pool_task_float : avg_pool_task_double, &t);
  return 0;
}

/* in: x, dy; out: dx */
static int max_pool_grad_kernel(const op_call *c) {
  pgeom p;
  pgeom_init(&p, c->in[0]->shape, c->in[1]->shape, c->attrs);
  memset(c->out->data, 0, tensor_bytes(c->out));
  if (c->in[1]->size == 0) return 0;
  void *scratch = malloc(2 * (size_t)(p.n * p.c) * kiln_dtype_sizes[c->out->dtype] + 1);
  if (!scratch) return kiln_set_error("%s: out of memory", kiln_ops[c->op].api);
  pool_ctx t = {&p, c->in[0]->data, c->in[1]->data, c->out->data, scratch};
  parallel_for(p.n, 1, c->out->dtype == KILN_F32 ? max_pool_grad_task_float : max_pool_grad_task_double, &t);
  free(scratch);
  return 0;
}

/* in: dy; out: dx */
static int avg_pool_grad_kernel(const op_call *c) {
  pgeom p;
  pgeom_init(&p, c->out->shape, c->in[0]->shape, c->attrs);
  memset(c->out->data, 0, tensor_bytes(c->out));
  if (c->in[0]->size == 0) return 0;
  pool_ctx t = {&p, NULL, c->in[0]->data, c->out->data, NULL};
  parallel_for(p.n, 1, c->out->dtype == KILN_F32 ? avg_pool_grad_task_float : avg_pool_grad_task_double, &t);
  return 0;
}

/* ---- the public entry points ---- */

/* TensorFlow's SAME padding of one axis: the output is ceil(n / stride)
 * long and the padding it needs is split with the odd one at the end. */
static void same_padding(int64_t n, int64_t k, int dilation, int stride, int *before, int *after) {
  int64_t out = (n + stride - 1) / stride, span = (k - 1) * dilation + 1;
  int64_t total = (out - 1) * stride + span - n;
  if (total < 0) total = 0;
  if (total > INT32_MAX) total = INT32_MAX; /* an absurd window: inference reports it */
  *before = (int)(total / 2);
  *after = (int)(total - total / 2);
}

/* attrs from opts for a window of kh x kw over an image of h x w (each
 * known only when the ranks are right; otherwise inference reports them) */
static void window_opts(const kiln_conv_opts *o, bool known, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        op_attrs *a) {
  static const kiln_conv_opts none;
  if (!o) o = &none;
  for (int i = 0; i < 2; i++) {
    a->stride[i] = o->stride[i] ? o->stride[i] : 1;
    a->dilation[i] = o->dilation[i] ? o->dilation[i] : 1;
  }
  a->groups = o->groups ? o->groups : 1;
  for (int i = 0; i < 4; i++) a->padding[i] = o->padding[i];
  if (o->same && known && a->stride[0] > 0 && a->stride[1] > 0 && a->dilation[0] > 0 && a->dilation[1] > 0) {
    same_padding(h, kh, a->dilation[0], a->stride[0], &a->padding[0], &a->padding[1]);
    same_padding(w, kw, a->dilation[1], a->stride[1], &a->padding[2], &a->padding[3]);
  }
}

kiln_tensor *kiln_conv2d(kiln_tensor *x, kiln_tensor *filter, const kiln_conv_opts *opts) {
  op_attrs a = {0};
  bool known = x && filter && x->rank == 4 && filter->rank == 4;
  window_opts(opts, known, known ? x->shape[1] : 0, known ? x->shape[2] : 0, known ? filter->shape[0] : 0,
              known ? filter->shape[1] : 0, &a);
  return op_apply2(OP_CONV2D, &a, x, filter);
}

kiln_tensor *kiln_conv2d_transpose(kiln_tensor *x, kiln_tensor *filter, const int64_t out_hw[2],
                                   const kiln_conv_opts *opts) {
  op_attrs a = {0};
  if (x && filter && !out_hw) {
    kiln_set_error("conv2d_transpose: out_hw is NULL");
    return NULL;
  }
  bool known = x && filter && x->rank == 4 && filter->rank == 4;
  window_opts(opts, known, known ? out_hw[0] : 0, known ? out_hw[1] : 0, known ? filter->shape[0] : 0,
              known ? filter->shape[1] : 0, &a);
  if (known) { /* the image conv2d would have read: [n, out_hw, channels per group x groups] */
    int64_t c;
    if (KILN_MUL_OVERFLOW(filter->shape[2], (int64_t)(a.groups > 0 ? a.groups : 1), &c)) c = -1;
    a.rank = 4;
    a.shape[0] = x->shape[0], a.shape[1] = out_hw[0], a.shape[2] = out_hw[1], a.shape[3] = c;
  }
  return op_apply2(OP_CONV2D_BP_INPUT, &a, x, filter);
}

static kiln_tensor *pool(op_id op, kiln_tensor *x, const int window[2], const kiln_conv_opts *opts) {
  const char *name = kiln_ops[op].api;
  op_attrs a = {0};
  if (x && !window) {
    kiln_set_error("%s: window is NULL", name);
    return NULL;
  }
  if (x && opts && ((opts->dilation[0] | opts->dilation[1]) & ~1)) {
    kiln_set_error("%s: pooling has no dilation (got %d, %d)", name, opts->dilation[0], opts->dilation[1]);
    return NULL;
  }
  if (x && opts && opts->groups > 1) {
    kiln_set_error("%s: pooling has no groups (got %d)", name, opts->groups);
    return NULL;
  }
  bool known = x && x->rank == 4;
  window_opts(opts, known, known ? x->shape[1] : 0, known ? x->shape[2] : 0, window ? window[0] : 1,
              window ? window[1] : 1, &a);
  a.dilation[0] = a.dilation[1] = 0, a.groups = 0; /* not pooling attributes */
  if (window) a.window[0] = window[0], a.window[1] = window[1];
  return op_apply1(op, &a, x);
}

kiln_tensor *kiln_max_pool2d(kiln_tensor *x, const int window[2], const kiln_conv_opts *opts) {
  return pool(OP_MAX_POOL2D, x, window, opts);
}

kiln_tensor *kiln_avg_pool2d(kiln_tensor *x, const int window[2], const kiln_conv_opts *opts) {
  return pool(OP_AVG_POOL2D, x, window, opts);
}

KILN_CONSTRUCTOR static void register_kernels(void) {
  for (int dt = KILN_F32; dt <= KILN_F64; dt++) {
    dispatch_register(OP_CONV2D, 0, (kiln_dtype)dt, conv2d_kernel);
    dispatch_register(OP_CONV2D_BP_INPUT, 0, (kiln_dtype)dt, conv2d_bp_input_kernel);
    dispatch_register(OP_CONV2D_BP_FILTER, 0, (kiln_dtype)dt, conv2d_bp_filter_kernel);
    dispatch_register(OP_MAX_POOL2D, 0, (kiln_dtype)dt, max_pool_kernel);
    dispatch_register(OP_MAX_POOL2D_GRAD, 0, (kiln_dtype)dt, max_pool_grad_kernel);
    dispatch_register(OP_AVG_POOL2D, 0, (kiln_dtype)dt, avg_pool_kernel);
    dispatch_register(OP_AVG_POOL2D_GRAD, 0, (kiln_dtype)dt, avg_pool_grad_kernel);
  }
}
