/* conv.h — conv2d with an epilogue, for the CPU backend's fused conv2d +
 * bias add (+ activation, + residual add): one call instead of a pass per
 * op. The epilogue is the matmul's (matmul.h): bias (one value per output
 * channel) added to each finished sum, then the residual, then relu or tanh,
 * so the result has exactly the bits of the separate ops
 * act((conv2d(x, filter) + bias) + residual). Internal. */
#ifndef KILN_CONV_H
#define KILN_CONV_H

#include "matmul.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out = act(conv2d(x, filter) + bias): x [n,h,w,c] and filter [kh,kw,c/groups,o]
 * as OP_CONV2D takes them, attrs as OP_CONV2D's (explicit padding, stride,
 * dilation, groups), bias [o] (ignored with GEMM_EPI_NONE), out [n,oh,ow,o]
 * allocated by the caller with conv2d's inferred shape; all f32 or all f64.
 * 0, or -1 with the error set ("conv2d: ..."). */
KILN_EXPORT int conv2d_epilogue(const kiln_tensor *x, const kiln_tensor *filter, const kiln_tensor *bias,
                                gemm_epilogue epi, const op_attrs *attrs, kiln_tensor *out);

/* out = act((conv2d(x, filter) + bias) + residual), residual of out's shape
 * and dtype (ResNet's shortcut); with GEMM_EPI_NONE, conv2d(x, filter) +
 * residual. Otherwise as conv2d_epilogue. out may be residual itself. */
KILN_EXPORT int conv2d_epilogue_residual(const kiln_tensor *x, const kiln_tensor *filter, const kiln_tensor *bias,
                                         gemm_epilogue epi, const kiln_tensor *residual, const op_attrs *attrs,
                                         kiln_tensor *out);

/* ---- the direct convolution (conv_direct.c) ----
 * One group, NHWC: the output's pixels in tiles of MR consecutive pixels of
 * one output row times NR output channels, each tile summed in registers by
 * the convolution micro-kernel (matmul.h) straight from the image (row i of
 * the tile reads the window of pixel ox0 + i in place, stride sw * c apart),
 * the filter packed once per call (or kept from an eager call before:
 * conv_cache.c); tiles whose windows hang over the left or right padding
 * (or past the last pixel) read a small zero-padded copy, rows over the top
 * or bottom padding a row of zeros. No im2col. */
typedef struct conv_shape {
  int64_t n, h, w, c; /* the image */
  int64_t oh, ow, o;  /* the output */
  int64_t kh, kw;     /* the filter: [kh, kw, c, o], or with flip [kh, kw, o, c] read flipped */
  int64_t sh, sw, dh, dw, pt, pl; /* padding (any sign; bottom and right: what the output size implies) */
  /* the filter is that of the convolution whose input gradient this is:
   * tap (ky, kx) from channel ci to co is f[kh-1-ky, kw-1-kx, co, ci] */
  bool flip;
  /* optional (0: as above): tap (ky, kx) is the filter's tap (fy0 + ky *
   * fys, fx0 + kx * fxs) of its fkh x fkw (a strided input gradient's phase:
   * every sh-th tap, flipped) */
  int64_t fkh, fkw, fy0, fx0, fys, fxs;
  /* optional (0: packed, [n, oh, ow, o]): the output's element strides of a
   * pixel, a row and an image (a phase writes every sw-th pixel of every
   * sh-th row of dx) */
  int64_t opx, orow, oimg;
} conv_shape;

/* out [n, oh, ow, o] = the convolution, then the epilogue (bias [o]; res
 * of out's shape when not NULL). f32 or f64. owner: the tensor whose data f
 * is, when it is a live tensor (an eager op's operand: its packed panels
 * may be kept, conv_cache.c), else NULL. 0, or -1 with the error set
 * ("<op>: out of memory"). The sums do not depend on the thread count. */
int conv_direct(const conv_shape *s, kiln_dtype dt, const void *x, const void *f, const kiln_tensor *owner,
                const void *bias, gemm_epilogue epi, const void *res, void *out, const char *op);

/* ---- packed filters kept across eager calls (conv_cache.c) ---- */
typedef struct conv_cache_pin {
  void *e;    /* the entry pinned, or NULL */
  void *fill; /* panels the caller packs now (the entry's first keeping), or NULL */
} conv_cache_pin;
/* The panels of owner's filter at f packed for s (normalised), dt and nr
 * (bytes of them), pinned until conv_cache_unpin; or NULL, when pin->fill
 * may be panels for the caller to pack into (kept from the unpin on). */
const void *conv_cache_find(const kiln_tensor *owner, const void *f, const conv_shape *s, kiln_dtype dt, int64_t nr,
                            size_t bytes, conv_cache_pin *pin);
void conv_cache_unpin(conv_cache_pin *pin);
/* the same, when pin->fill was not packed after all (it is not kept) */
void conv_cache_discard(conv_cache_pin *pin);
/* entries with panels, their bytes, hits and keepings so far (tests, bench) */
KILN_EXPORT void conv_cache_stats(int64_t *entries, int64_t *bytes, int64_t *hits, int64_t *fills);
/* drops every entry not in use */
KILN_EXPORT void conv_cache_clear(void);

/* df [kh, kw, c, o] = the gradient of the convolution s (flip unset) with
 * respect to its filter, from x [n, h, w, c] and dy [n, oh, ow, o]: block
 * by block of output rows (the block's image rows copied zero-padded, or a
 * 1x1 filter's pixels packed; dy packed where its rows are 1 KiB or more),
 * tiles of the filter summed by the filter-gradient micro-kernel (matmul.h)
 * over the block's pixels and added to df; large images' blocks in parts of
 * their own, added in order. 0, or -1 with the error set. The sums do not
 * depend on the thread count. Exported for bench and tests. */
KILN_EXPORT int conv_direct_filter(const conv_shape *s, kiln_dtype dt, const void *x, const void *dy, void *df,
                                   const char *op);

#ifdef __cplusplus
}
#endif
#endif
