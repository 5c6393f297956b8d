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
#if KILN_MULTIVERSION
#include <immintrin.h>
#endif

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
/* filters with fewer elements are packed on every call: a lookup would cost
 * about what their packing does */
enum { CACHE_MIN_ELEMS = 4096 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* packed filter column block jt: element (r, j) at bp[(jt * K + r) * NR + j],
 * r = (ky * kw + kx) * c + ci, zeros past o; tap (ky, kx) is the filter's
 * (fy0 + ky * fys, fx0 + kx * fxs) (s normalised: fkh etc. set).
 * pack_rows_T: rows [b, e), each read whole and dealt out to every column
 * block (a row of 2048 channels is 8 KiB: column block by column block,
 * every 128 bytes read were a page away from the last); pack_filter_T
 * (flipped filters, whose rows are columns of the filter): units [b, e)
 * of column block jt's rows, block by block. */
#define PACK_FILTER(T)                                                                                 \
  static void pack_rows_##T(const conv_shape *s, const T *f, int64_t nr, T *bp, int64_t b, int64_t e) { \
    int64_t k = s->kh * s->kw * s->c, blocks = (s->o + nr - 1) / nr, full = s->o / nr;                \
    for (int64_t r = b; r < e; r++) {                                                                  \
      int64_t tap = r / s->c, ci = r % s->c;                                                           \
      int64_t ft = (s->fy0 + tap / s->kw * s->fys) * s->fkw + s->fx0 + tap % s->kw * s->fxs;           \
      const T *restrict src = f + (ft * s->c + ci) * s->o;                                             \
      T *restrict d = bp + r * nr;                                                                     \
      if (nr == 32)                                                                                    \
        for (int64_t jt = 0; jt < full; jt++) memcpy(d + jt * k * nr, src + jt * nr, 32 * sizeof(T));  \
      else                                                                                             \
        for (int64_t jt = 0; jt < full; jt++) memcpy(d + jt * k * nr, src + jt * nr, (size_t)nr * sizeof(T)); \
      if (full < blocks) {                                                                             \
        T *restrict l = d + full * k * nr;                                                             \
        for (int64_t j = 0; j < nr; j++) l[j] = full * nr + j < s->o ? src[full * nr + j] : 0;        \
      }                                                                                                \
    }                                                                                                  \
  }                                                                                                    \
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

/* rows [b, e) of the packed filter: the filter's rows, or (flipped) all
 * its column blocks' in turn */
static void pack_filter_task(void *arg, int64_t b, int64_t e) {
  const pack_filter_job *p = arg;
  if (!p->s->flip && p->dt == KILN_F32)
    pack_rows_float(p->s, p->f, p->nr, p->bp, b, e);
  else if (!p->s->flip)
    pack_rows_double(p->s, p->f, p->nr, p->bp, b, e);
  else if (p->dt == KILN_F32)
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
  int64_t first; /* xp holds the padded rows from this one on */
  size_t es;
} prepad_job;

/* rows [b, e) of the padded copy of images of h x w x c into hp x wp x c
 * (n * hp rows for n images) */
static void prepad_task(void *arg, int64_t b, int64_t e) {
  const prepad_job *p = arg;
  size_t row = (size_t)(p->wp * p->c) * p->es, run = (size_t)(p->w * p->c) * p->es;
  for (int64_t r = b; r < e; r++) {
    int64_t n = r / p->hp, iy = r % p->hp - p->pt;
    char *dst = p->xp + (size_t)(r - p->first) * row;
    memset(dst, 0, row);
    if (iy >= 0 && iy < p->h)
      memcpy(dst + (size_t)(p->pl * p->c) * p->es, p->x + (size_t)((n * p->h + iy) * p->w * p->c) * p->es, run);
  }
}

int conv_direct(const conv_shape *shape, kiln_dtype dt, const void *x, const void *f, const kiln_tensor *owner,
                const void *bias, gemm_epilogue epi, const void *res, void *out, const char *op) {
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
  size_t bp_bytes = (size_t)(blocks * j.uk.nr * j.k) * j.es + 64;
  conv_cache_pin pin;
  const void *kept = conv_cache_find(j.k * s->o >= CACHE_MIN_ELEMS ? owner : NULL, f, s, dt, j.uk.nr, bp_bytes, &pin);
  void *bp = kept ? NULL : pin.fill ? pin.fill : mem_scratch_get(&sbp, bp_bytes);
  size_t zbytes = ((size_t)(j.span * s->c) + 16) * j.es;
  void *zeros = mem_scratch_get(&sz, zbytes);
  if ((!kept && !bp) || !zeros) {
    conv_cache_discard(&pin);
    mem_scratch_put(&sbp), mem_scratch_put(&sz);
    return kiln_set_error("%s: out of memory", op);
  }
  memset(zeros, 0, zbytes);
  if (!kept) {
    pack_filter_job pj = {s, f, bp, j.uk.nr, dt};
    if (s->flip) /* a 3x3 512 -> 512 filter is 9.4 MB */
      parallel_for(blocks * j.k, 256, pack_filter_task, &pj);
    else
      parallel_for(j.k, 256 / blocks + 1, pack_filter_task, &pj);
  }
  j.bp = kept ? kept : bp, j.zeros = zeros;
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
      conv_cache_unpin(&pin);
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
  conv_cache_unpin(&pin);
  mem_scratch_put(&sbp), mem_scratch_put(&sz), mem_scratch_put(&sxp);
  if (atomic_load(&j.failed)) return kiln_set_error("%s: out of memory", op);
  return 0;
}

/* ---- the filter gradient ----
 * df[ky, kx, c, o] = sum over (n, oy, ox) of x[n, oy*sh - pt + ky*dh,
 * ox*sw - pl + kx*dw, c] dy[n, oy, ox, o]: per tap ky (or (ky, kx)), a
 * product whose K runs over the pixels. The pixels are taken in blocks of
 * output rows (as many as keep their image and dy rows in L2), or of
 * whole images where they are small (7x7: a tile's sums then run over
 * several images before they are added to df). For a block,
 * its image rows are copied zero-padded (a 1x1 filter without padding
 * packs its pixels MR channels at a time instead: read in place, a tile's
 * MR channels of a pixel are a piece of a long row, too far from the next
 * pixel's for the prefetchers), and dy is packed NR channels at a time
 * where its rows are as long (1 KiB or more); then every tile of MR filter
 * rows (kx, c) x NR output channels sums, in registers, over the block's
 * pixels (one run of ow pixels per row, or one of the packed pixels) and
 * adds the sum to df. Packing the pixels reads them from memory while no
 * sums run, so there each tile's kernel also fetches its share of the next
 * block's image and dy rows into L2 (conv_run's pf), as BLIS's kernels
 * fetch their next panels; the packing then reads L2.
 *
 * Where the images and dy are large next to df (the early layers), the
 * blocks are split into parts, each summed whole by one thread into a df of
 * its own, then added in part order: each core reads only its own blocks
 * (split by tiles, both cores read every block: 1x1 64 -> 256 at 56x56 ran
 * 1.35x as fast on two threads as on one, 1.67x in parts). Otherwise the
 * blocks are taken in turn and each block's tiles split over the threads.
 * The number of parts depends on the shapes alone, so every element's sum
 * runs over the same pixels in the same order whatever the thread count. */

typedef struct {
  const conv_shape *s;
  wgrad_ukernel uk;
  size_t es;
  const char *x, *dy;
  char *df, *partials; /* parts 1.. each add into a df of their own (df's size, in turn) */
  int64_t hp, wp;      /* the padded image's rows and columns */
  int64_t rows, tiles_m, tiles_n, taps, tiles; /* filter rows per tap (kw * c folded, else c); the tiles */
  int64_t block, per_image, blocks, parts;     /* output rows a block; blocks an image and in all */
  int64_t images;                              /* images a block (more than 1 only when block is oh) */
  int64_t xrows;                               /* padded image rows a block reads */
  int64_t xa; /* pack_x: a pixel's MR channels in a panel take xa elements (MR rounded up to 64 bytes) */
  bool pack_x, pack_dy;
  bool deal_z; /* pack with AVX-512 (not under KILN_GEMM=c, so the tests reach the C copy too) */
  atomic_int failed;
} wgrad_job;

/* one block of pixels as its tiles read it */
typedef struct {
  int64_t oy0, oy1, npix; /* the block's output rows of each of its images; its pixels in all */
  int64_t images;         /* its images, consecutive */
  const char *x, *dy;     /* its first image's */
  char *xs; /* pack_x: its pixels [tiles_m][npix][xa]; else its images' padded rows from yp0, hp apart */
  int64_t yp0;
  char *ds;   /* pack_dy: its dy [tiles_n][npix][NR] */
  char *df;   /* the sums' destination */
  int32_t flags;
  const char *pf[2]; /* the next block's x and dy, which its tiles' kernels fetch into L2 */
  int64_t pf_lines[2];
} wgrad_block;

/* The most bytes of image and dy rows one block of output rows reads; the
 * most pixels a block of several small images has (a tile's rows of image
 * and dy over more of them leave L1: 3x3 256 -> 256 at 14x14, 2 images a
 * block, ran 20% slower than 1; at 7x7, 5 images a block ran 5-15% faster
 * than 1). */
enum { WGRAD_BLOCK_BYTES = 1 << 20, WGRAD_BLOCK_PIXELS = 256, WGRAD_PARTS = 16 };

/* [panels][npix][ld] from rows [b, e) of the block: pixel by pixel, its
 * first `len` channels dealt out W at a time (ld >= W apart; the elements
 * between are never read), zeros past them. A full piece's copy has W as a
 * constant, so it is a few vector moves (a loop of W steps took a third of
 * a 1x1 filter gradient's time). */
#define DEAL_CASE(T, W)                                                                                 \
  case W:                                                                                               \
    for (int64_t q = 0; q < full; q++) memcpy(dst + q * panel, src + q * W, W * sizeof(T));             \
    break;
#define DEAL(T)                                                                                         \
  static void deal_##T(const T *src, int64_t step, int64_t px, int64_t len, int64_t w, int64_t ld,      \
                       int64_t panels, int64_t panel, T *dst) {                                         \
    int64_t full = len / w;                                                                             \
    for (int64_t p = 0; p < px; p++, src += step, dst += ld) {                                         \
      switch (w) {                                                                                      \
        DEAL_CASE(T, 32)                                                                                \
        DEAL_CASE(T, 16)                                                                                \
        DEAL_CASE(T, 14)                                                                                \
        DEAL_CASE(T, 8)                                                                                 \
        DEAL_CASE(T, 7)                                                                                 \
        DEAL_CASE(T, 6)                                                                                 \
        default:                                                                                        \
          for (int64_t q = 0; q < full; q++)                                                            \
            for (int64_t i = 0; i < w; i++) dst[q * panel + i] = src[q * w + i];                        \
      }                                                                                                 \
      if (full < panels) { /* the last piece: what is left, then zeros */                               \
        T *d = dst + full * panel;                                                                      \
        for (int64_t i = 0; i < len - full * w; i++) d[i] = src[full * w + i];                          \
        for (int64_t i = len - full * w; i < w; i++) d[i] = 0;                                          \
      }                                                                                                 \
    }                                                                                                   \
  }
DEAL(float)
DEAL(double)

#if KILN_MULTIVERSION
/* deal_float with AVX-512: each piece of up to 32 channels one or two
 * masked loads and stores, the last piece's zeros included (the C copy's
 * 16-byte moves and scalar tail were a store-bound third of a 1x1 filter
 * gradient's time) */
KILN_HOT_AVX512 static void deal_float_z(const float *src, int64_t step, int64_t px, int64_t len, int64_t w,
                                         int64_t ld, int64_t panels, int64_t panel, float *dst) {
  int64_t full = len / w, rest = len - full * w;
  __mmask16 lo = (__mmask16)((1u << (w < 16 ? w : 16)) - 1), hi = (__mmask16)(w > 16 ? (1u << (w - 16)) - 1 : 0);
  __mmask16 rlo = (__mmask16)((1u << (rest < 16 ? rest : 16)) - 1),
            rhi = (__mmask16)(rest > 16 ? (1u << (rest - 16)) - 1 : 0);
  for (int64_t p = 0; p < px; p++, src += step, dst += ld) {
    for (int64_t q = 0; q < full; q++) {
      _mm512_mask_storeu_ps(dst + q * panel, lo, _mm512_maskz_loadu_ps(lo, src + q * w));
      if (hi) _mm512_mask_storeu_ps(dst + q * panel + 16, hi, _mm512_maskz_loadu_ps(hi, src + q * w + 16));
    }
    if (full < panels) { /* the last piece: what is left, then zeros */
      _mm512_mask_storeu_ps(dst + full * panel, lo, _mm512_maskz_loadu_ps(rlo, src + full * w));
      if (hi) _mm512_mask_storeu_ps(dst + full * panel + 16, hi, _mm512_maskz_loadu_ps(rhi, src + full * w + 16));
    }
  }
}
#endif

static void deal_f32(bool z, const float *src, int64_t step, int64_t px, int64_t len, int64_t w, int64_t ld,
                     int64_t panels, int64_t panel, float *dst) {
#if KILN_MULTIVERSION
  if (z && w <= 32) {
    deal_float_z(src, step, px, len, w, ld, panels, panel, dst);
    return;
  }
#else
  (void)z;
#endif
  deal_float(src, step, px, len, w, ld, panels, panel, dst);
}

typedef struct {
  const wgrad_job *j;
  const wgrad_block *bk;
} block_ref;

/* output rows [b, e) of the block: its pixels and dy packed, or its image
 * rows padded (row q pads the padded rows from q * sh on that the next
 * output row does not start at; the block's last row, all it reads) */
static void prepare_task(void *arg, int64_t b, int64_t e) {
  const block_ref *r = arg;
  const wgrad_job *j = r->j;
  const wgrad_block *bk = r->bk;
  const conv_shape *s = j->s;
  int64_t rows = bk->oy1 - bk->oy0, mr = j->uk.mr, nr = j->uk.nr, xa = j->xa;
  for (int64_t q = b; q < e; q++) { /* row q % rows of image q / rows */
    int64_t img = q / rows, r = q % rows;
    if (j->pack_x) {
      size_t at = (size_t)(q * s->ow * xa),
             from = (size_t)((img * s->h + (bk->oy0 + r) * s->sh) * s->w * s->c);
      if (j->es == 4)
        deal_f32(j->deal_z, (const float *)bk->x + from, s->sw * s->c, s->ow, s->c, mr, xa, j->tiles_m, bk->npix * xa,
                   (float *)bk->xs + at);
      else
        deal_double((const double *)bk->x + from, s->sw * s->c, s->ow, s->c, mr, xa, j->tiles_m, bk->npix * xa,
                    (double *)bk->xs + at);
    } else {
      prepad_job pp = {.x = bk->x, .xp = bk->xs, .h = s->h, .w = s->w, .c = s->c, .hp = j->hp, .wp = j->wp,
                       .pt = s->pt, .pl = s->pl, .first = bk->yp0, .es = j->es};
      int64_t lo = img * j->hp + bk->yp0 + r * s->sh,
              hi = r + 1 == rows ? img * j->hp + bk->yp0 + (rows - 1) * s->sh + (s->kh - 1) * s->dh + 1 : lo + s->sh;
      prepad_task(&pp, lo, hi);
    }
    if (j->pack_dy) {
      size_t at = (size_t)(q * s->ow * nr), from = (size_t)((img * s->oh + bk->oy0 + r) * s->ow * s->o);
      if (j->es == 4)
        deal_f32(j->deal_z, (const float *)bk->dy + from, s->o, s->ow, s->o, nr, nr, j->tiles_n, bk->npix * nr,
                   (float *)bk->ds + at);
      else
        deal_double((const double *)bk->dy + from, s->o, s->ow, s->o, nr, nr, j->tiles_n, bk->npix * nr,
                    (double *)bk->ds + at);
    }
  }
}

/* The 64-byte lines of x and of dy that block g of a packing (1x1,
 * unpadded) filter gradient reads, from the first row of its first image
 * to the last of its last, into bk's pf. */
static void block_lines(const wgrad_job *j, int64_t g, wgrad_block *bk) {
  const conv_shape *s = j->s;
  int64_t n = g / j->per_image * j->images, last = n + min64(j->images, s->n - n) - 1;
  int64_t oy0 = g % j->per_image * j->block, oy1 = min64(s->oh, oy0 + j->block);
  int64_t from = n * s->h + oy0 * s->sh, to = last * s->h + (oy1 - 1) * s->sh + 1, row = s->w * s->c * (int64_t)j->es;
  bk->pf[0] = j->x + from * row;
  bk->pf_lines[0] = (to - from) * row / 64;
  row = s->ow * s->o * (int64_t)j->es;
  bk->pf[1] = j->dy + (n * s->oh + oy0) * row;
  bk->pf_lines[1] = (last * s->oh + oy1 - n * s->oh - oy0) * row / 64;
}

/* block g of the batch, its sums into df (added unless first); its
 * packed or padded copies made in parallel or on this thread */
static void block_begin(const wgrad_job *j, wgrad_block *bk, int64_t g, char *df, bool first, bool parallel) {
  const conv_shape *s = j->s;
  int64_t n = g / j->per_image * j->images;
  bk->images = min64(j->images, s->n - n);
  bk->oy0 = g % j->per_image * j->block, bk->oy1 = min64(s->oh, bk->oy0 + j->block);
  bk->npix = bk->images * (bk->oy1 - bk->oy0) * s->ow;
  bk->x = j->x + (size_t)(n * s->h * s->w * s->c) * j->es;
  bk->dy = j->dy + (size_t)(n * s->oh * s->ow * s->o) * j->es;
  bk->yp0 = bk->oy0 * s->sh;
  bk->df = df, bk->flags = first ? 0 : GEMM_ACCUMULATE;
  bk->pf_lines[0] = bk->pf_lines[1] = 0;
  if (j->pack_x && g + 1 < j->blocks) block_lines(j, g + 1, bk);
  block_ref r = {j, bk};
  if (parallel)
    parallel_for(bk->images * (bk->oy1 - bk->oy0), 1, prepare_task, &r);
  else
    prepare_task(&r, 0, bk->images * (bk->oy1 - bk->oy0));
}

/* tiles [b, e) of taps x tiles_m x tiles_n of block bk, run: the block's
 * rows' worth */
static void block_tiles(const wgrad_job *j, const wgrad_block *bk, int64_t b, int64_t e, conv_run *run) {
  const conv_shape *s = j->s;
  size_t es = j->es;
  int64_t mr_full = j->uk.mr, nr_full = j->uk.nr;
  int64_t lines = bk->pf_lines[0] + bk->pf_lines[1];
  for (int64_t t = b; t < e; t++) {
    int64_t tap = t / (j->tiles_m * j->tiles_n), tm = t / j->tiles_n % j->tiles_m, tn = t % j->tiles_n;
    int64_t ky = s->dw == 1 ? tap : tap / s->kw, kx = s->dw == 1 ? 0 : tap % s->kw;
    int64_t i0 = tm * mr_full, j0 = tn * nr_full;
    /* filter row (tap, i0 + i) is df row tap * rows + i0 + i of c * o */
    char *dst = bk->df + (size_t)((tap * j->rows + i0) * s->o + j0) * es;
    int64_t mr = min64(mr_full, j->rows - i0), nr = min64(nr_full, s->o - j0);
    const char *dyb = j->pack_dy ? bk->ds + (size_t)(tn * bk->npix * nr_full) * es
                                 : bk->dy + (size_t)(bk->oy0 * s->ow * s->o + j0) * es;
    int64_t ldb = j->pack_dy ? nr_full : s->o;
    if (j->pack_x) { /* one run over the block's packed pixels, fetching the tile's share of the next block's
                        lines: x's, then dy's */
      int64_t l0 = lines * t / j->tiles, l1 = lines * (t + 1) / j->tiles, r = l0 < bk->pf_lines[0] ? 0 : 1;
      if (r) l0 -= bk->pf_lines[0], l1 -= bk->pf_lines[0];
      else if (l1 > bk->pf_lines[0]) l1 = bk->pf_lines[0];
      run[0] = (conv_run){bk->xs + (size_t)(tm * bk->npix * j->xa) * es, dyb, bk->npix,
                          l1 > l0 ? bk->pf[r] + l0 * 64 : dyb, l1 - l0};
      j->uk.fn(1, run, j->xa, ldb, dst, s->o, mr, nr, bk->flags);
      continue;
    }
    int64_t rows = bk->oy1 - bk->oy0;
    for (int64_t q = 0; q < bk->images * rows; q++) { /* row q % rows of image q / rows */
      int64_t yp = q / rows * j->hp + (bk->oy0 + q % rows) * s->sh + ky * s->dh - bk->yp0;
      const char *a = bk->xs + (size_t)((yp * j->wp + kx * s->dw) * s->c + i0) * es;
      run[q] = (conv_run){a, dyb + (size_t)(q * s->ow * ldb) * es, s->ow, a, 0}; /* its kernel does not prefetch */
    }
    j->uk.fn(bk->images * rows, run, s->sw * s->c, ldb, dst, s->o, mr, nr, bk->flags);
  }
}

/* a block's scratch: its copies and its tiles' runs */
typedef struct {
  mem_scratch sx, sd, sr;
  wgrad_block bk;
  conv_run *run;
} wgrad_scratch;

static bool scratch_get(const wgrad_job *j, wgrad_scratch *w) {
  const conv_shape *s = j->s;
  /* padded rows: with slack, as a tile reads up to MR further */
  size_t xs = j->pack_x ? (size_t)(j->tiles_m * j->xa * j->images * j->block * s->ow)
                        : (size_t)(((j->images - 1) * j->hp + j->xrows) * j->wp * s->c + j->uk.mr);
  w->bk.xs = mem_scratch_get(&w->sx, xs * j->es);
  size_t ds = (size_t)(j->tiles_n * j->uk.nr * j->images * j->block * s->ow) * j->es;
  w->bk.ds = j->pack_dy ? mem_scratch_get(&w->sd, ds) : NULL;
  w->run = mem_scratch_get(&w->sr, sizeof *w->run * (size_t)(j->images * j->block));
  if (!w->bk.xs || (j->pack_dy && !w->bk.ds) || !w->run) return false;
  if (!j->pack_x) memset(w->bk.xs + (xs - (size_t)j->uk.mr) * j->es, 0, (size_t)j->uk.mr * j->es);
  return true;
}

static void scratch_put(wgrad_scratch *w) { mem_scratch_put(&w->sx), mem_scratch_put(&w->sd), mem_scratch_put(&w->sr); }

typedef struct {
  wgrad_job *j;
  const wgrad_block *bk;
} tiles_ref;

static void tiles_task(void *arg, int64_t b, int64_t e) {
  tiles_ref *r = arg;
  mem_scratch sr = {0};
  conv_run *run = mem_scratch_get(&sr, sizeof *run * (size_t)(r->j->images * r->j->block));
  if (run)
    block_tiles(r->j, r->bk, b, e, run);
  else
    atomic_store(&r->j->failed, 1);
  mem_scratch_put(&sr);
}

/* parts [b, e): each its blocks, in order, on this thread */
static void part_task(void *arg, int64_t b, int64_t e) {
  wgrad_job *j = arg;
  size_t df_bytes = (size_t)(j->taps * j->rows * j->s->o) * j->es;
  wgrad_scratch w = {0};
  if (!scratch_get(j, &w)) {
    atomic_store(&j->failed, 1);
    scratch_put(&w);
    return;
  }
  for (int64_t p = b; p < e; p++) {
    char *df = p == 0 ? j->df : j->partials + (size_t)(p - 1) * df_bytes;
    for (int64_t g = j->blocks * p / j->parts; g < j->blocks * (p + 1) / j->parts; g++) {
      block_begin(j, &w.bk, g, df, g == j->blocks * p / j->parts, false);
      block_tiles(j, &w.bk, 0, j->tiles, w.run);
    }
  }
  scratch_put(&w);
}

/* df[b, e) += the parts' sums, in part order */
#define ADD_PARTS(T)                                                                                     \
  static void add_parts_##T(const wgrad_job *j, int64_t b, int64_t e) {                                  \
    int64_t size = j->taps * j->rows * j->s->o;                                                          \
    T *df = (T *)j->df;                                                                                  \
    const T *parts = (const T *)j->partials;                                                             \
    for (int64_t p = 1; p < j->parts; p++)                                                               \
      for (int64_t i = b; i < e; i++) df[i] += parts[(p - 1) * size + i];                                \
  }
ADD_PARTS(float)
ADD_PARTS(double)

static void add_task(void *arg, int64_t b, int64_t e) {
  const wgrad_job *j = arg;
  if (j->es == 4)
    add_parts_float(j, b, e);
  else
    add_parts_double(j, b, e);
}

int conv_direct_filter(const conv_shape *s, kiln_dtype dt, const void *x, const void *dy, void *df, const char *op) {
  wgrad_job j = {.s = s, .es = kiln_dtype_sizes[dt], .x = x, .dy = dy, .df = df};
  int64_t k = s->kh * s->kw * s->c;
  if (k == 0 || s->o == 0) return 0;
  if (s->n == 0 || s->oh == 0 || s->ow == 0) {
    memset(df, 0, (size_t)(k * s->o) * j.es);
    return 0;
  }
  j.pack_x = s->kh == 1 && s->kw == 1 && s->pt == 0 && s->pl == 0 && (s->oh - 1) * s->sh < s->h &&
             (s->ow - 1) * s->sw < s->w;
  /* packing x reads it from memory while no sums run: the kernel that
   * fetches the next block meanwhile (1x1 256 -> 64 and 64 -> 256 at 56x56
   * +13-35% on two threads; where x is padded instead, 3x3 shapes, its
   * instructions cost more than it saved: 3x3 256 -> 256 at 14x14 -10%) */
  j.uk = matmul_wgrad_ukernel(dt, s->n * s->oh * s->ow * s->o * k >= MATMUL_JIT_WORK, j.pack_x);
  j.hp = (s->oh - 1) * s->sh + (s->kh - 1) * s->dh + 1;
  j.wp = (s->ow - 1) * s->sw + (s->kw - 1) * s->dw + 1;
  if (j.hp < s->h + s->pt) j.hp = s->h + s->pt;
  if (j.wp < s->w + s->pl) j.wp = s->w + s->pl;
  j.taps = s->dw == 1 ? s->kh : s->kh * s->kw;
  j.rows = s->dw == 1 ? s->kw * s->c : s->c;
  j.tiles_m = (j.rows + j.uk.mr - 1) / j.uk.mr;
  const char *gemm = getenv("KILN_GEMM");
  j.deal_z = KILN_HAVE_AVX512() && !(gemm && !strcmp(gemm, "c"));
  /* a packed pixel's MR channels start a 64-byte line: one line a step for
   * the micro-kernel, and no copy split over two (14 -> 16 floats) */
  j.xa = (j.uk.mr * (int64_t)j.es + 63) / 64 * 64 / (int64_t)j.es;
  j.tiles_n = (s->o + j.uk.nr - 1) / j.uk.nr;
  j.tiles = j.taps * j.tiles_m * j.tiles_n;
  atomic_init(&j.failed, 0);
  j.pack_dy = s->o * (int64_t)j.es >= 1024;
  int64_t row_bytes = (j.pack_x ? s->ow * s->c : s->sh * j.wp * s->c) * (int64_t)j.es + s->ow * s->o * (int64_t)j.es;
  j.block = WGRAD_BLOCK_BYTES / row_bytes;
  if (j.block < 1) j.block = 1;
  if (j.block > s->oh) j.block = s->oh;
  j.xrows = (j.block - 1) * s->sh + (s->kh - 1) * s->dh + 1;
  j.per_image = (s->oh + j.block - 1) / j.block;
  /* small images: several a block, up to WGRAD_BLOCK_PIXELS, so that a
   * tile sums over more than one image's pixels in registers before it adds
   * to df */
  j.images = j.block == s->oh ? WGRAD_BLOCK_BYTES / (s->oh * row_bytes) : 1;
  if (j.images > WGRAD_BLOCK_PIXELS / (s->oh * s->ow)) j.images = WGRAD_BLOCK_PIXELS / (s->oh * s->ow);
  if (j.images < 1) j.images = 1;
  if (j.images > s->n) j.images = s->n;
  j.blocks = (s->n + j.images - 1) / j.images * j.per_image;
  /* parts: while their own dfs cost a quarter of the bytes they read */
  size_t df_bytes = (size_t)(k * s->o) * j.es;
  double in_bytes = (double)(s->n * (s->h * s->w * s->c + s->oh * s->ow * s->o)) * (double)j.es;
  double fit = in_bytes / (4.0 * (double)df_bytes);
  j.parts = fit < (double)WGRAD_PARTS ? (int64_t)fit : WGRAD_PARTS;
  if (j.parts > j.blocks) j.parts = j.blocks;
  if (j.parts < 2) j.parts = 1;
  mem_scratch sp = {0};
  if (j.parts > 1) {
    j.partials = mem_scratch_get(&sp, df_bytes * (size_t)(j.parts - 1));
    if (!j.partials) return kiln_set_error("%s: out of memory", op);
    parallel_for(j.parts, 1, part_task, &j);
    if (!atomic_load(&j.failed)) parallel_for(k * s->o, 4096, add_task, &j);
  } else {
    wgrad_scratch w = {0};
    if (!scratch_get(&j, &w)) {
      scratch_put(&w);
      return kiln_set_error("%s: out of memory", op);
    }
    tiles_ref r = {&j, &w.bk};
    for (int64_t g = 0; g < j.blocks && !atomic_load(&j.failed); g++) {
      block_begin(&j, &w.bk, g, df, g == 0, true);
      parallel_for(j.tiles, 1, tiles_task, &r);
    }
    scratch_put(&w);
  }
  mem_scratch_put(&sp);
  if (atomic_load(&j.failed)) return kiln_set_error("%s: out of memory", op);
  return 0;
}
