/* conv_direct.c — the direct NHWC convolution (conv.h): register tiles of
 * MR output pixels x NR output channels summed by the convolution
 * micro-kernel (matmul.h) from the image in place, as oneDNN's brgemm
 * convolutions do on NHWC. im2col + GEMM writes an m x K column matrix and
 * packs it again, and with 64 output channels each of its elements feeds
 * only 64 FMAs: the copies cost as much as the arithmetic. Here the image
 * is read where it lies: for the tile of pixels ox0 .. ox0+MR-1 of output
 * row (n, oy), tap ky (all kx at once when the dilation along x is 1, the
 * window's row then being kw * c contiguous elements) reads row i at
 * x[n, oy*sh - pt + ky*dh, (ox0+i)*sw - pl, 0], so the micro-kernel's A is
 * strided (lda = sw * c) instead of packed, and only the filter is packed,
 * once per call. A tile whose windows hang over the left or right padding,
 * or that has fewer than MR pixels, copies its kh window rows into a small
 * zero-padded buffer first; a row over the top or bottom padding reads a
 * row of zeros. Every output element is one micro-kernel sum (taps, then
 * k, in order), so the bits do not depend on how the rows are split over
 * threads. */
#include <stdlib.h>

#include "conv.h"

typedef struct {
  const conv_shape *s;
  conv_ukernel uk;
  size_t es;
  const char *x;
  const char *bp;     /* packed filter: per NR columns, K rows of NR */
  const char *bias, *res;
  char *out;
  const char *zeros;  /* span * c zeros */
  int64_t taps, kc, k, span;
  int32_t flags;
  atomic_int failed;
} direct_job;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* packed filter column block jt: element (r, j) at bp[(jt * K + r) * NR + j],
 * r = (ky * kw + kx) * c + ci, zeros past o */
#define PACK_FILTER(T)                                                                                 \
  static void pack_filter_##T(const conv_shape *s, const T *f, int64_t nr, T *bp) {                    \
    int64_t k = s->kh * s->kw * s->c;                                                                  \
    for (int64_t j0 = 0; j0 < s->o; j0 += nr)                                                          \
      for (int64_t r = 0; r < k; r++, bp += nr) {                                                      \
        int64_t tap = r / s->c, ci = r % s->c, w = min64(nr, s->o - j0);                               \
        if (!s->flip) {                                                                                \
          const T *src = f + r * s->o + j0;                                                            \
          for (int64_t j = 0; j < nr; j++) bp[j] = j < w ? src[j] : 0;                                 \
        } else {                                                                                       \
          int64_t ft = s->kh * s->kw - 1 - tap; /* (kh-1-ky, kw-1-kx) */                              \
          const T *src = f + ft * s->c * s->o + j0 * s->c + ci;                                        \
          for (int64_t j = 0; j < nr; j++) bp[j] = j < w ? src[j * s->c] : 0;                          \
        }                                                                                              \
      }                                                                                                \
  }
PACK_FILTER(float)
PACK_FILTER(double)

/* output rows [b, e) of the n * oh */
static void direct_task(void *arg, int64_t b, int64_t e) {
  direct_job *j = arg;
  const conv_shape *s = j->s;
  int64_t mr_full = j->uk.mr, nr_full = j->uk.nr, c = s->c;
  size_t es = j->es, row_bytes = (size_t)(j->span * c) * es;
  char *buf = malloc(row_bytes * (size_t)s->kh + 64);
  const void **a = malloc(sizeof(void *) * (size_t)j->taps);
  if (!buf || !a) {
    atomic_store(&j->failed, 1);
    free(buf), free(a);
    return;
  }
  bool fold = s->dw == 1; /* one tap per ky */
  int64_t lda = s->sw * c;
  for (int64_t r = b; r < e; r++) {
    int64_t n = r / s->oh, oy = r % s->oh;
    const char *img = j->x + (size_t)(n * s->h * s->w * c) * es;
    for (int64_t ox0 = 0; ox0 < s->ow; ox0 += mr_full) {
      int64_t mr = min64(mr_full, s->ow - ox0), ix0 = ox0 * s->sw - s->pl;
      bool inside = mr == mr_full && ix0 >= 0 && ix0 + j->span <= s->w;
      for (int64_t ky = 0; ky < s->kh; ky++) {
        int64_t iy = oy * s->sh - s->pt + ky * s->dh;
        bool row_ok = iy >= 0 && iy < s->h;
        const char *row;
        if (!row_ok) {
          row = j->zeros;
        } else if (inside) {
          row = img + (size_t)((iy * s->w + ix0) * c) * es;
        } else { /* the window row with its padding, zeros outside the image */
          char *dst = buf + (size_t)ky * row_bytes;
          int64_t lo = ix0 < 0 ? -ix0 : 0, hi = min64(j->span, s->w - ix0); /* columns in the image */
          if (hi < lo) hi = lo;
          memset(dst, 0, (size_t)(lo * c) * es);
          if (hi > lo) memcpy(dst + (size_t)(lo * c) * es, img + (size_t)((iy * s->w + ix0 + lo) * c) * es,
                              (size_t)((hi - lo) * c) * es);
          memset(dst + (size_t)(hi * c) * es, 0, (size_t)((j->span - hi) * c) * es);
          row = dst;
        }
        if (fold) {
          a[ky] = row;
        } else {
          for (int64_t kx = 0; kx < s->kw; kx++)
            a[ky * s->kw + kx] = row_ok ? row + (size_t)(kx * s->dw * c) * es : row;
        }
      }
      char *dst = j->out + (size_t)(((n * s->oh + oy) * s->ow + ox0) * s->o) * es;
      const char *res = j->res ? j->res + (dst - j->out) : NULL;
      for (int64_t j0 = 0, jt = 0; j0 < s->o; j0 += nr_full, jt++)
        j->uk.fn(j->taps, a, j->kc, lda, j->bp + (size_t)(jt * j->k * nr_full) * es, dst + (size_t)j0 * es, s->o, mr,
                 min64(nr_full, s->o - j0), j->flags, j->bias ? j->bias + (size_t)j0 * es : NULL,
                 res ? res + (size_t)j0 * es : NULL);
    }
  }
  free(buf), free(a);
}

int conv_direct(const conv_shape *s, kiln_dtype dt, const void *x, const void *f, const void *bias,
                gemm_epilogue epi, const void *res, void *out, const char *op) {
  direct_job j = {.s = s, .es = kiln_dtype_sizes[dt], .x = x, .bias = bias, .res = res, .out = out};
  int64_t rows = s->n * s->oh;
  if (rows == 0 || s->ow == 0 || s->o == 0) return 0;
  j.k = s->kh * s->kw * s->c;
  int64_t work = rows * s->ow * s->o * j.k;
  j.uk = matmul_conv_ukernel(dt, epi, s->sw * s->c, work >= MATMUL_JIT_WORK);
  j.taps = s->dw == 1 ? s->kh : s->kh * s->kw;
  j.kc = s->dw == 1 ? s->kw * s->c : s->c;
  j.span = (j.uk.mr - 1) * s->sw + (s->kw - 1) * s->dw + 1;
  j.flags = GEMM_LAST | (res ? GEMM_RESIDUAL : 0) | (int32_t)epi << GEMM_EPI_SHIFT;
  atomic_init(&j.failed, 0);
  int64_t blocks = (s->o + j.uk.nr - 1) / j.uk.nr;
  void *bp = malloc((size_t)(blocks * j.uk.nr * j.k) * j.es + 64);
  void *zeros = calloc((size_t)(j.span * s->c) + 16, j.es);
  if (!bp || !zeros) {
    free(bp), free(zeros);
    return kiln_set_error("%s: out of memory", op);
  }
  if (dt == KILN_F32)
    pack_filter_float(s, f, j.uk.nr, bp);
  else
    pack_filter_double(s, f, j.uk.nr, bp);
  j.bp = bp, j.zeros = zeros;
  int64_t row_work = s->ow * s->o * j.k;
  parallel_for(rows, row_work >= ((int64_t)1 << 20) ? 1 : ((int64_t)1 << 20) / row_work + 1, direct_task, &j);
  free(bp), free(zeros);
  if (atomic_load(&j.failed)) return kiln_set_error("%s: out of memory", op);
  return 0;
}
