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
  int64_t segs, seg; /* pieces of an output row a task takes, of seg pixels */
  int64_t pieces;    /* n * oh * segs */
  int64_t group;     /* column tiles (NR channels) a task takes: their packed filter fits in L2 */
  int32_t flags;
  bool padded; /* x is a zero-padded copy: every tile reads its windows in place */
  atomic_int failed;
} direct_job;

/* Tiles in a piece of an output row: one task. The most bytes of packed
 * filter one task streams through (tile after tile, so it stays in L2:
 * 3x3 512 -> 512 has 9.4 MB of it). */
enum { SEG_TILES = 8, GROUP_BYTES = 1 << 20 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* packed filter column block jt: element (r, j) at bp[(jt * K + r) * NR + j],
 * r = (ky * kw + kx) * c + ci, zeros past o; tap (ky, kx) is the filter's
 * (fy0 + ky * fys, fx0 + kx * fxs) (s normalised: fkh etc. set) */
#define PACK_FILTER(T)                                                                                 \
  static void pack_filter_##T(const conv_shape *s, const T *f, int64_t nr, T *bp, int64_t b, int64_t e) { \
    int64_t k = s->kh * s->kw * s->c;                                                                  \
    for (int64_t u = b; u < e; u++) { /* row r of column block jt */                                  \
      int64_t jt = u / k, r = u % k, j0 = jt * nr, w = min64(nr, s->o - j0);                           \
      int64_t tap = r / s->c, ci = r % s->c;                                                           \
      int64_t ft = (s->fy0 + tap / s->kw * s->fys) * s->fkw + s->fx0 + tap % s->kw * s->fxs;           \
      T *restrict d = bp + u * nr;                                                                     \
      if (!s->flip) {                                                                                  \
        const T *restrict src = f + (ft * s->c + ci) * s->o + j0;                                      \
        for (int64_t j = 0; j < w; j++) d[j] = src[j];                                                 \
      } else {                                                                                         \
        const T *restrict src = f + ft * s->c * s->o + j0 * s->c + ci;                                 \
        for (int64_t j = 0; j < w; j++) d[j] = src[j * s->c];                                          \
      }                                                                                                \
      for (int64_t j = w; j < nr; j++) d[j] = 0;                                                       \
    }                                                                                                  \
  }
PACK_FILTER(float)
PACK_FILTER(double)

typedef struct {
  const conv_shape *s;
  const void *f;
  void *bp;
  int64_t nr;
  kiln_dtype dt;
} pack_filter_job;

/* rows [b, e) of the packed filter, all its column blocks' in turn */
static void pack_filter_task(void *arg, int64_t b, int64_t e) {
  const pack_filter_job *p = arg;
  if (p->dt == KILN_F32)
    pack_filter_float(p->s, p->f, p->nr, p->bp, b, e);
  else
    pack_filter_double(p->s, p->f, p->nr, p->bp, b, e);
}

/* units [b, e): column groups x pieces of the n * oh output rows (segs a
 * row), groups outer (consecutive units share the group's filter) */
static void direct_task(void *arg, int64_t b, int64_t e) {
  direct_job *j = arg;
  const conv_shape *s = j->s;
  int64_t mr_full = j->uk.mr, nr_full = j->uk.nr, c = s->c;
  size_t es = j->es, row_bytes = (size_t)(j->span * c) * es;
  mem_scratch sb = {0}, sa = {0};
  char *buf = mem_scratch_get(&sb, row_bytes * (size_t)s->kh + 64);
  const void **a = mem_scratch_get(&sa, sizeof(void *) * (size_t)j->taps);
  if (!buf || !a) {
    atomic_store(&j->failed, 1);
    mem_scratch_put(&sb), mem_scratch_put(&sa);
    return;
  }
  bool fold = s->dw == 1; /* one tap per ky */
  int64_t lda = s->sw * c;
  for (int64_t u = b; u < e; u++) {
    int64_t grp = u / j->pieces, piece = u % j->pieces;
    int64_t r = piece / j->segs, n = r / s->oh, oy = r % s->oh, end = min64(s->ow, (piece % j->segs + 1) * j->seg);
    int64_t jlo = grp * j->group * nr_full, jhi = min64(s->o, (grp + 1) * j->group * nr_full);
    const char *img = j->x + (size_t)(n * s->h * s->w * c) * es;
    for (int64_t ox0 = piece % j->segs * j->seg; ox0 < end; ox0 += mr_full) {
      int64_t mr = min64(mr_full, s->ow - ox0), ix0 = ox0 * s->sw - s->pl;
      bool inside = j->padded || (mr == mr_full && ix0 >= 0 && ix0 + j->span <= s->w);
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
      char *dst = j->out + (size_t)(n * s->oimg + oy * s->orow + ox0 * s->opx) * es;
      const char *res = j->res ? j->res + (dst - j->out) : NULL;
      for (int64_t j0 = jlo, jt = jlo / nr_full; j0 < jhi; j0 += nr_full, jt++)
        j->uk.fn(j->taps, a, j->kc, lda, j->bp + (size_t)(jt * j->k * nr_full) * es, dst + (size_t)j0 * es, s->opx, mr,
                 min64(nr_full, s->o - j0), j->flags, j->bias ? j->bias + (size_t)j0 * es : NULL,
                 res ? res + (size_t)j0 * es : NULL);
    }
  }
  mem_scratch_put(&sb), mem_scratch_put(&sa);
}

typedef struct {
  const char *x;
  char *xp;
  int64_t h, w, c, hp, wp, pt, pl;
  size_t es;
} prepad_job;

/* rows [b, e) of the padded copy of images of h x w x c into hp x wp x c
 * (n * hp rows for n images) */
static void prepad_task(void *arg, int64_t b, int64_t e) {
  const prepad_job *p = arg;
  size_t row = (size_t)(p->wp * p->c) * p->es, run = (size_t)(p->w * p->c) * p->es;
  for (int64_t r = b; r < e; r++) {
    int64_t n = r / p->hp, iy = r % p->hp - p->pt;
    char *dst = p->xp + (size_t)r * row;
    memset(dst, 0, row);
    if (iy >= 0 && iy < p->h)
      memcpy(dst + (size_t)(p->pl * p->c) * p->es, p->x + (size_t)((n * p->h + iy) * p->w * p->c) * p->es, run);
  }
}

int conv_direct(const conv_shape *shape, kiln_dtype dt, const void *x, const void *f, const void *bias,
                gemm_epilogue epi, const void *res, void *out, const char *op) {
  conv_shape norm = *shape, *s = &norm; /* the optional fields filled in */
  if (!s->fkh) {
    s->fkh = s->kh, s->fkw = s->kw;
    s->fy0 = s->flip ? s->kh - 1 : 0, s->fys = s->flip ? -1 : 1;
    s->fx0 = s->flip ? s->kw - 1 : 0, s->fxs = s->flip ? -1 : 1;
  }
  if (!s->opx) {
    s->opx = s->o, s->orow = s->ow * s->o, s->oimg = s->oh * s->ow * s->o;
    if (s->kh == 1 && s->kw == 1 && s->sh == 1 && s->sw == 1 && s->pt == 0 && s->pl == 0 && s->oh == s->h &&
        s->ow == s->w) { /* 1x1 over every pixel: one row of them all, in tiles that span rows and images */
      s->w = s->ow = s->n * s->h * s->w;
      s->n = s->h = s->oh = 1;
      s->orow = s->oimg = s->ow * s->o;
    }
  }
  direct_job j = {.s = s, .es = kiln_dtype_sizes[dt], .x = x, .bias = bias, .res = res, .out = out};
  int64_t rows = s->n * s->oh;
  if (rows == 0 || s->ow == 0 || s->o == 0) return 0;
  j.k = s->kh * s->kw * s->c;
  int64_t work = rows * s->ow * s->o * j.k;
  /* the narrow tile (7 pixels) where it leaves fewer pixels of the tiles empty (rows of 7, 21) */
  bool narrow = (s->ow + 6) / 7 * 7 < (s->ow + 13) / 14 * 14;
  j.uk = matmul_conv_ukernel(dt, epi, s->sw * s->c, narrow, work >= MATMUL_JIT_WORK);
  j.taps = s->dw == 1 ? s->kh : s->kh * s->kw;
  j.kc = s->dw == 1 ? s->kw * s->c : s->c;
  j.span = (j.uk.mr - 1) * s->sw + (s->kw - 1) * s->dw + 1;
  j.flags = GEMM_LAST | (res ? GEMM_RESIDUAL : 0) | (int32_t)epi << GEMM_EPI_SHIFT;
  atomic_init(&j.failed, 0);
  int64_t blocks = (s->o + j.uk.nr - 1) / j.uk.nr;
  mem_scratch sbp = {0}, sz = {0};
  void *bp = mem_scratch_get(&sbp, (size_t)(blocks * j.uk.nr * j.k) * j.es + 64);
  size_t zbytes = ((size_t)(j.span * s->c) + 16) * j.es;
  void *zeros = mem_scratch_get(&sz, zbytes);
  if (!bp || !zeros) {
    mem_scratch_put(&sbp), mem_scratch_put(&sz);
    return kiln_set_error("%s: out of memory", op);
  }
  memset(zeros, 0, zbytes);
  pack_filter_job pj = {s, f, bp, j.uk.nr, dt};
  parallel_for(blocks * j.k, 256, pack_filter_task, &pj); /* a 3x3 512 -> 512 filter is 9.4 MB */
  j.bp = bp, j.zeros = zeros;
  j.seg = SEG_TILES * j.uk.mr;
  j.segs = (s->ow + j.seg - 1) / j.seg;
  j.pieces = rows * j.segs;
  j.group = GROUP_BYTES / (j.k * j.uk.nr * (int64_t)j.es);
  if (j.group < 1) j.group = 1;
  int64_t groups = (blocks + j.group - 1) / j.group;
  /* Tiles whose windows hang over the padding copy their rows first, again
   * for each group of columns. Where most tiles do (rows of one or two
   * tiles: 7x7 and 14x14 images) or the copies repeat (more than one
   * group), the image is padded once instead, with room for the last
   * tile's full span, and every tile reads in place (3x3 512 -> 512 at 7x7
   * copied its rows 8 times). */
  int64_t tiles_w = (s->ow + j.uk.mr - 1) / j.uk.mr * j.uk.mr;
  int64_t need_h = (s->oh - 1) * s->sh + (s->kh - 1) * s->dh + 1, need_w = (s->ow - 1) * s->sw + (s->kw - 1) * s->dw + 1;
  bool padding = s->pt > 0 || s->pl > 0 || need_h > s->h + s->pt || need_w > s->w + s->pl;
  mem_scratch sxp = {0};
  if (padding && s->pt >= 0 && s->pl >= 0 && (groups > 1 || s->ow <= 2 * j.uk.mr)) {
    prepad_job pp = {.x = x, .h = s->h, .w = s->w, .c = s->c, .pt = s->pt, .pl = s->pl, .es = j.es};
    pp.hp = need_h > s->h + s->pt ? need_h : s->h + s->pt;
    pp.wp = (tiles_w - 1) * s->sw + (s->kw - 1) * s->dw + 1;
    if (pp.wp < s->w + s->pl) pp.wp = s->w + s->pl;
    /* slack: the last row's tiles read up to a tile's span further */
    pp.xp = mem_scratch_get(&sxp, (size_t)((s->n * pp.hp * pp.wp + j.span) * s->c) * j.es);
    if (!pp.xp) {
      mem_scratch_put(&sbp), mem_scratch_put(&sz);
      return kiln_set_error("%s: out of memory", op);
    }
    memset(pp.xp + (size_t)(s->n * pp.hp * pp.wp * s->c) * j.es, 0, (size_t)(j.span * s->c) * j.es);
    parallel_for(s->n * pp.hp, 16, prepad_task, &pp);
    s->h = pp.hp, s->w = pp.wp, s->pt = s->pl = 0;
    j.x = pp.xp, j.padded = true;
  }
  int64_t unit_work = min64(s->ow, j.seg) * min64(s->o, j.group * j.uk.nr) * j.k;
  parallel_for(groups * j.pieces, unit_work >= ((int64_t)1 << 20) ? 1 : ((int64_t)1 << 20) / unit_work + 1, direct_task,
               &j);
  mem_scratch_put(&sbp), mem_scratch_put(&sz), mem_scratch_put(&sxp);
  if (atomic_load(&j.failed)) return kiln_set_error("%s: out of memory", op);
  return 0;
}

/* ---- the filter gradient ----
 * df[ky, kx, c, o] = sum over (n, oy, ox) of x[n, oy*sh - pt + ky*dh,
 * ox*sw - pl + kx*dw, c] dy[n, oy, ox, o]: per tap ky (or (ky, kx)), a
 * product whose K runs over the pixels. Image by image, the image is copied
 * once into a zero-padded buffer (its padding, and slack for the tiles'
 * last rows); then, block by block of its output rows (as many as keep
 * their image and dy rows in L2), every tile of MR filter rows (kx, c) x NR
 * output channels sums, in registers, over the block's rows (one run of ow
 * pixels each: A the padded image read in place, B the rows of dy) and adds
 * the sum to df. A 1x1 filter without padding copies no image: each block's
 * pixels are packed MR channels at a time instead, and a tile runs over
 * them in one run. Tiles are split over threads, blocks taken in turn: each
 * element's sum runs over the blocks in order, whatever the thread count. */

typedef struct {
  const conv_shape *s;
  wgrad_ukernel uk;
  size_t es;
  const char *x, *dy; /* this image's */
  char *xp, *df;
  int64_t hp, wp;        /* the padded image's rows and columns */
  int64_t rows, tiles_m; /* filter rows per tap (kw * c folded, else c); their tiles */
  int64_t tiles_n, taps;
  int64_t oy0, oy1; /* the block of output rows */
  /* a 1x1 filter without padding: the block's pixels packed, MR channels
   * of each in turn, per tile of filter rows (tiles_m x npix x MR) */
  char *pk;
  int64_t npix;
  int32_t flags;
  atomic_int failed;
} wgrad_job;

/* The most bytes of image and dy rows one block of output rows reads: the
 * tiles of a block take turns over the same rows, which stay in L2. */
enum { WGRAD_BLOCK_BYTES = 1 << 20 };

/* units [b, e) of the block's rows: each pixel's channels, read once,
 * dealt out to the tiles of filter rows (MR each, zeros past the filter's) */
#define PACK_PIXELS(T)                                                                                  \
  static void pack_pixels_##T(const wgrad_job *j, int64_t b, int64_t e) {                              \
    const conv_shape *s = j->s;                                                                         \
    int64_t mr = j->uk.mr, c = s->c;                                                                    \
    for (int64_t r = b; r < e; r++) {                                                                   \
      const T *src = (const T *)j->x + (j->oy0 + r) * s->sh * s->w * c;                                 \
      T *dst = (T *)j->pk + r * s->ow * mr;                                                             \
      for (int64_t ox = 0; ox < s->ow; ox++, src += s->sw * c, dst += mr)                               \
        for (int64_t tm = 0; tm < j->tiles_m; tm++) {                                                   \
          T *restrict d = dst + tm * j->npix * mr;                                                      \
          const T *restrict v = src + tm * mr;                                                          \
          int64_t w = min64(mr, c - tm * mr);                                                           \
          for (int64_t i = 0; i < w; i++) d[i] = v[i];                                                  \
          for (int64_t i = w; i < mr; i++) d[i] = 0;                                                    \
        }                                                                                               \
    }                                                                                                   \
  }
PACK_PIXELS(float)
PACK_PIXELS(double)

static void pack_task(void *arg, int64_t b, int64_t e) {
  const wgrad_job *j = arg;
  if (j->es == 4)
    pack_pixels_float(j, b, e);
  else
    pack_pixels_double(j, b, e);
}

/* tiles [b, e) of taps x tiles_m x tiles_n */
static void wgrad_task(void *arg, int64_t b, int64_t e) {
  wgrad_job *j = arg;
  const conv_shape *s = j->s;
  size_t es = j->es;
  int64_t mr_full = j->uk.mr, nr_full = j->uk.nr;
  mem_scratch sr = {0};
  conv_run *run = mem_scratch_get(&sr, sizeof *run * (size_t)s->oh);
  if (!run) {
    atomic_store(&j->failed, 1);
    return;
  }
  for (int64_t t = b; t < e; t++) {
    int64_t tap = t / (j->tiles_m * j->tiles_n), tm = t / j->tiles_n % j->tiles_m, tn = t % j->tiles_n;
    int64_t ky = s->dw == 1 ? tap : tap / s->kw, kx = s->dw == 1 ? 0 : tap % s->kw;
    int64_t i0 = tm * mr_full, j0 = tn * nr_full;
    char *dst = j->df + (size_t)((tap * j->rows + i0) * s->o + j0) * es;
    int64_t mr = min64(mr_full, j->rows - i0), nr = min64(nr_full, s->o - j0);
    if (j->pk) { /* one run over the block's packed pixels */
      run[0] = (conv_run){j->pk + (size_t)(tm * j->npix * mr_full) * es, j->dy + (size_t)(j->oy0 * s->ow * s->o + j0) * es,
                          j->npix};
      j->uk.fn(1, run, mr_full, s->o, dst, s->o, mr, nr, j->flags);
      continue;
    }
    for (int64_t oy = j->oy0; oy < j->oy1; oy++) {
      int64_t yp = oy * s->sh + ky * s->dh;
      run[oy - j->oy0] = (conv_run){j->xp + (size_t)((yp * j->wp + kx * s->dw) * s->c + i0) * es,
                           j->dy + (size_t)(oy * s->ow * s->o + j0) * es, s->ow};
    }
    /* filter row (tap, i0 + i) is df row tap * rows + i0 + i of c * o */
    j->uk.fn(j->oy1 - j->oy0, run, s->sw * s->c, s->o, dst, s->o, mr, nr, j->flags);
  }
  mem_scratch_put(&sr);
}

int conv_direct_filter(const conv_shape *s, kiln_dtype dt, const void *x, const void *dy, void *df, const char *op) {
  wgrad_job j = {.s = s, .es = kiln_dtype_sizes[dt], .df = df};
  int64_t k = s->kh * s->kw * s->c;
  if (k == 0 || s->o == 0) return 0;
  if (s->n == 0 || s->oh == 0 || s->ow == 0) {
    memset(df, 0, (size_t)(k * s->o) * j.es);
    return 0;
  }
  j.uk = matmul_wgrad_ukernel(dt, s->n * s->oh * s->ow * s->o * k >= MATMUL_JIT_WORK);
  j.hp = (s->oh - 1) * s->sh + (s->kh - 1) * s->dh + 1;
  j.wp = (s->ow - 1) * s->sw + (s->kw - 1) * s->dw + 1;
  if (j.hp < s->h + s->pt) j.hp = s->h + s->pt;
  if (j.wp < s->w + s->pl) j.wp = s->w + s->pl;
  j.taps = s->dw == 1 ? s->kh : s->kh * s->kw;
  j.rows = s->dw == 1 ? s->kw * s->c : s->c;
  j.tiles_m = (j.rows + j.uk.mr - 1) / j.uk.mr;
  j.tiles_n = (s->o + j.uk.nr - 1) / j.uk.nr;
  atomic_init(&j.failed, 0);
  /* A 1x1 filter without padding reads the image where it lies, packing
   * each block's pixels for the tiles: read in place, a tile's MR channels
   * of a pixel are one piece of a longer row, too far from the next pixel's
   * for the prefetchers (1x1 256 -> 64 ran at half the 3x3's speed). */
  mem_scratch sxp = {0}, spk = {0};
  bool pack = s->kh == 1 && s->kw == 1 && s->pt == 0 && s->pl == 0 && (s->oh - 1) * s->sh < s->h &&
              (s->ow - 1) * s->sw < s->w;
  int64_t tiles = j.taps * j.tiles_m * j.tiles_n;
  int64_t row_bytes = (pack ? s->ow * s->c : s->sh * j.wp * s->c) * (int64_t)j.es + s->ow * s->o * (int64_t)j.es;
  int64_t block = WGRAD_BLOCK_BYTES / (row_bytes > 0 ? row_bytes : 1);
  if (block < 1) block = 1;
  if (block > s->oh) block = s->oh;
  if (pack) {
    j.pk = mem_scratch_get(&spk, (size_t)(j.tiles_m * j.uk.mr * block * s->ow) * j.es);
    if (!j.pk) return kiln_set_error("%s: out of memory", op);
  } else {
    /* slack: a tile's rows past the filter's read up to MR further */
    j.xp = mem_scratch_get(&sxp, (size_t)(j.hp * j.wp * s->c + j.uk.mr) * j.es);
    if (!j.xp) return kiln_set_error("%s: out of memory", op);
    memset(j.xp + (size_t)(j.hp * j.wp * s->c) * j.es, 0, (size_t)j.uk.mr * j.es);
  }
  for (int64_t n = 0; n < s->n && !atomic_load(&j.failed); n++) {
    j.x = (const char *)x + (size_t)(n * s->h * s->w * s->c) * j.es;
    j.dy = (const char *)dy + (size_t)(n * s->oh * s->ow * s->o) * j.es;
    if (!pack) {
      prepad_job pp = {.x = j.x, .xp = j.xp, .h = s->h, .w = s->w, .c = s->c, .hp = j.hp, .wp = j.wp, .pt = s->pt,
                       .pl = s->pl, .es = j.es};
      parallel_for(j.hp, 16, prepad_task, &pp);
    }
    for (j.oy0 = 0; j.oy0 < s->oh; j.oy0 = j.oy1) {
      j.oy1 = min64(s->oh, j.oy0 + block);
      j.flags = n > 0 || j.oy0 > 0 ? GEMM_ACCUMULATE : 0;
      if (pack) {
        j.npix = (j.oy1 - j.oy0) * s->ow;
        parallel_for(j.oy1 - j.oy0, 1, pack_task, &j);
      }
      parallel_for(tiles, 1, wgrad_task, &j);
    }
  }
  mem_scratch_put(&sxp), mem_scratch_put(&spk);
  if (atomic_load(&j.failed)) return kiln_set_error("%s: out of memory", op);
  return 0;
}
