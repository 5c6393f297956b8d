/* kernels_elementwise.c — CPU kernels of the elementwise primitives: unary,
 * binary, compare and select, for every dtype their ops.def masks allow. One
 * driver (ew_run) walks NumPy broadcasting and the thread pool; an op only
 * supplies an element function, expanded into contiguous loops by macros. */
#include <math.h>

#include "ops.h"

/* Elements below a grain run serially (small ops must stay cheap); the heavy
 * grain is for ops that call libm per element (sin, cos, log1p, pow, fmod)
 * or divide integers. Long rows are cut into blocks so that a few huge rows
 * still spread over the pool. */
enum { GRAIN = 32768, GRAIN_HEAVY = 8192, BLOCK = 16384 };

/* ------------------------------------------------------------------------
 * Vectorizable f32 exp, log, tanh and sigmoid. glibc's scalar expf/tanhf
 * stop gcc's vectorizer. Over every f32 input these stay within 1.08 ulp
 * of the correctly rounded result (exp), 0.76 (log), 1.72 (tanh) and 2.4
 * (sigmoid): tests/vecmath_test.cc. They use only selects, never branches:
 * gcc does not if-convert float compares or conversions it must keep
 * conditional (they may trap). backends/llvm/vecmath.c emits the same
 * operations for compiled kernels, bit for bit.
 * ---------------------------------------------------------------------- */

#if KILN_FUSED_FMA /* compat.h: fused in hardware wherever a hot kernel runs */
#define FMAF(a, b, c) fmaf((a), (b), (c))
#else /* without hardware FMA, fmaf is a slow libm call */
#define FMAF(a, b, c) ((a) * (b) + (c))
#endif

/* Adding 1.5 * 2^23 rounds a float below 2^22 in magnitude to an integer k;
 * the sum's bits are then 0x4b400000 + k. Powers of two are built from those
 * bits, never by a conversion: one instruction less, and defined for NaN. */
#define ROUND_SHIFT 0x1.8p23f

/* e^x for x in [-104, 89] or NaN: 2^k e^r with k = round(x / ln2), |r| <=
 * ln2/2, e^r a degree-6 Chebyshev fit. */
static inline float exp_clamped_f32(float xc) {
  float kb = FMAF(xc, 1.44269504f, ROUND_SHIFT), k = kb - ROUND_SHIFT;
  float r = FMAF(k, -0.693359375f, xc); /* ln 2 in two parts: k * hi is exact */
  r = FMAF(k, 2.12194440e-4f, r);
  float p = 1.392617612e-03f;
  p = FMAF(p, r, 8.363173075e-03f);
  p = FMAF(p, r, 4.166655466e-02f);
  p = FMAF(p, r, 1.666657703e-01f);
  p = FMAF(p, r, 0.5f);
  p = FMAF(p, r * r, r) + 1.0f;
  /* 2^k as two normal factors, 2^floor(k/2) and 2^ceil(k/2): k reaches 128
   * (overflow to inf) and -150 (subnormal); u = k + 254 > 0 */
  uint32_t u = f32_bits(kb) - (0x4b400000u - 254u);
  return p * bits_f32((u >> 1) << 23) * bits_f32((u - (u >> 1)) << 23);
}

/* e^-104 rounds to 0, e^89 overflows; NaN passes the clamps */
static inline float exp_f32(float x) {
  float xc = x < -104.0f ? -104.0f : x;
  return exp_clamped_f32(xc > 89.0f ? 89.0f : xc);
}

/* log x = e ln2 + log1p(f), m = 1 + f in [sqrt(1/2), sqrt(2)]. */
static inline float log_f32(float x) {
  uint32_t ux = f32_bits(x);  /* integer tests: they if-convert where float compares may not */
  int sub = ux < 0x00800000u; /* +0 and subnormals: scale by 2^23 first */
  float xs = x * bits_f32(sub ? 0x4b000000u : 0x3f800000u);
  uint32_t u = f32_bits(xs), mbits = u & 0x007fffffu;
  int big = mbits > 0x3504f3u; /* mantissa above sqrt(2): halve it */
  int32_t e = (int32_t)((u >> 23) & 0xff) - 127 - (sub ? 23 : 0) + big;
  float m = bits_f32(mbits | (big ? 0x3f000000u : 0x3f800000u));
  float f = m - 1.0f, fe = (float)e;
  float q = 6.971611471e-02f;
  q = FMAF(q, f, -1.147973385e-01f);
  q = FMAF(q, f, 1.168541992e-01f);
  q = FMAF(q, f, -1.242568733e-01f);
  q = FMAF(q, f, 1.424905765e-01f);
  q = FMAF(q, f, -1.666780232e-01f);
  q = FMAF(q, f, 2.000071575e-01f);
  q = FMAF(q, f, -2.499999696e-01f);
  q = FMAF(q, f, 3.333333118e-01f);
  float y = f * (f * f) * q;
  y = FMAF(fe, -2.12194440e-4f, y);
  y = FMAF(-0.5f * f, f, y);
  float r = FMAF(fe, 0.693359375f, f + y);
  /* 0 -> -inf, negative -> NaN, inf and NaN -> themselves. A bitwise blend,
   * not ?:, or gcc sinks the polynomial into a branch it cannot vectorize. */
  uint32_t special = (ux & 0x7fffffffu) == 0 ? 0xff800000u
                     : ux > 0x80000000u      ? 0x7fc00000u
                     : ux == 0x7f800000u     ? ux
                                             : ux | 0x00400000u;
  uint32_t ok = 0u - (uint32_t)(ux - 1u < 0x7f7fffffu); /* all ones for finite x > 0 */
  return bits_f32((f32_bits(r) & ok) | (special & ~ok));
}

/* tanh |x| = h / (h + 1), h = (e^2|x| - 1) / 2 = 2^k (e^2r - 1)/2 + (2^k - 1)/2,
 * one division for every x. k = floor(2|x| / ln2) keeps r in [0, ln2/2), so
 * the two terms of h never cancel; (e^2r - 1)/2 = r + r^2 P(r), P of degree
 * 5 (a relative-error fit). Below |x| = 0.55 the quotient q is refined by
 * one step of t = h (1 - t), which scales q's rounding errors by h. The
 * sign last, so tanh(-0) = -0. */
static inline float tanh_f32(float x) {
  float a = fabsf(x);
  a = a > 9.5f ? 9.5f : a; /* tanh(9.5) rounds to 1; NaN stays NaN */
  float kb = FMAF(a, 2.88539004f, -0.5f) + ROUND_SHIFT, k = kb - ROUND_SHIFT;
  float r = FMAF(k, -0.346573591f, a); /* ln2 / 2 in one part: k <= 27 */
  float p = 1.71554089e-02f;
  p = FMAF(p, r, 4.22738381e-02f);
  p = FMAF(p, r, 1.33836105e-01f);
  p = FMAF(p, r, 3.33275706e-01f);
  p = FMAF(p, r, 6.66669607e-01f);
  p = FMAF(p, r, 9.99999940e-01f);
  float s = bits_f32((f32_bits(kb) << 23) + 0x3f800000u); /* 2^k, k in [0, 27] */
  float h = FMAF(s, FMAF(p, r * r, r), FMAF(s, 0.5f, -0.5f));
  float q = h / (h + 1.0f), c = FMAF(-h, q, h);
  return copysignf(a < 0.55f ? c : q, x);
}

/* e^-|x| never overflows: 1/(1+e) for x >= 0, e/(1+e) below. */
static inline float sigmoid_f32(float x) {
  float nx = -fabsf(x);
  float e = exp_clamped_f32(nx < -104.0f ? -104.0f : nx);
  return (x >= 0 ? 1.0f : e) / (1.0f + e);
}

static inline double sigmoid_f64(double x) {
  double e = exp(-fabs(x));
  return (x >= 0 ? 1.0 : e) / (1.0 + e);
}

/* ------------------------------------------------------------------------
 * Element functions el_<op>_<dtype>. Integer arithmetic runs in the
 * unsigned type and converts back (wrapping, never signed overflow).
 * Compares are hoisted into variables so the selects if-convert.
 * ---------------------------------------------------------------------- */

#define FLOAT_ELEMS(sfx, T, M)                                                    \
  static inline T el_neg_##sfx(T x) { return -x; }                                \
  static inline T el_abs_##sfx(T x) { return fabs##M(x); }                        \
  static inline T el_sign_##sfx(T x) { /* 0 and NaN give themselves */            \
    int gt = x > 0, lt = x < 0;                                                   \
    return gt ? (T)1 : lt ? (T)-1 : x;                                            \
  }                                                                               \
  static inline T el_relu_##sfx(T x) { return x < 0 ? (T)0 : x; } /* NaN stays */ \
  static inline T el_log1p_##sfx(T x) { return log1p##M(x); }                     \
  static inline T el_sqrt_##sfx(T x) { return sqrt##M(x); }                       \
  static inline T el_rsqrt_##sfx(T x) { return (T)1 / sqrt##M(x); }               \
  static inline T el_sin_##sfx(T x) { return sin##M(x); }                         \
  static inline T el_cos_##sfx(T x) { return cos##M(x); }                         \
  /* through nearbyint, which vectorizes (floor may not: it must not raise        \
   * inexact); the rounded value is x's floor or ceiling, and copysign keeps      \
   * the sign of a zero result (ceil(-0.5) = -0) */                               \
  static inline T el_floor_##sfx(T x) {                                           \
    T r = nearbyint##M(x), d = r > x ? (T)1 : (T)0;                               \
    return copysign##M(r - d, x);                                                 \
  }                                                                               \
  static inline T el_ceil_##sfx(T x) {                                            \
    T r = nearbyint##M(x), d = r < x ? (T)1 : (T)0;                               \
    return copysign##M(r + d, x);                                                 \
  }                                                                               \
  static inline T el_add_##sfx(T x, T y) { return x + y; }                        \
  static inline T el_sub_##sfx(T x, T y) { return x - y; }                        \
  static inline T el_mul_##sfx(T x, T y) { return x * y; }                        \
  static inline T el_div_##sfx(T x, T y) { return x / y; }                        \
  static inline T el_pow_##sfx(T x, T y) { return pow##M(x, y); }                 \
  static inline T el_mod_##sfx(T x, T y) { return fmod##M(x, y); }                \
  /* NaN in either operand gives NaN, as NumPy's maximum and minimum do */        \
  static inline T el_max_##sfx(T x, T y) {                                        \
    int pick = (x > y) | (x != x);                                                \
    return pick ? x : y;                                                          \
  }                                                                               \
  static inline T el_min_##sfx(T x, T y) {                                        \
    int pick = (x < y) | (x != x);                                                \
    return pick ? x : y;                                                          \
  }

FLOAT_ELEMS(f32, float, f)
FLOAT_ELEMS(f64, double, )

static inline float el_exp_f32(float x) { return exp_f32(x); }
static inline float el_log_f32(float x) { return log_f32(x); }
static inline float el_tanh_f32(float x) { return tanh_f32(x); }
static inline float el_sigmoid_f32(float x) { return sigmoid_f32(x); }
static inline double el_exp_f64(double x) { return exp(x); }
static inline double el_log_f64(double x) { return log(x); }
static inline double el_tanh_f64(double x) { return tanh(x); }
static inline double el_sigmoid_f64(double x) { return sigmoid_f64(x); }

/* Division and mod by zero never get here (checked first); x / -1 would
 * trap on INT_MIN, so it is negation, which wraps. */
#define INT_ELEMS(sfx, T, U)                                                           \
  static inline T el_neg_##sfx(T x) { return (T)((U)0 - (U)x); }                       \
  static inline T el_abs_##sfx(T x) { return x < 0 ? (T)((U)0 - (U)x) : x; }           \
  static inline T el_sign_##sfx(T x) { return (T)((x > 0) - (x < 0)); }                \
  static inline T el_relu_##sfx(T x) { return x < 0 ? 0 : x; }                         \
  static inline T el_add_##sfx(T x, T y) { return (T)((U)x + (U)y); }                  \
  static inline T el_sub_##sfx(T x, T y) { return (T)((U)x - (U)y); }                  \
  static inline T el_mul_##sfx(T x, T y) { return (T)((U)x * (U)y); }                  \
  static inline T el_div_##sfx(T x, T y) { return y == -1 ? el_neg_##sfx(x) : x / y; } \
  static inline T el_mod_##sfx(T x, T y) { return y == -1 ? 0 : x % y; }               \
  static inline T el_max_##sfx(T x, T y) { return x > y ? x : y; }                     \
  static inline T el_min_##sfx(T x, T y) { return x < y ? x : y; }                     \
  /* by squaring; a negative exponent leaves 0 unless |x| == 1 */                      \
  static inline T el_pow_##sfx(T x, T y) {                                             \
    if (y < 0) return x == 1 ? 1 : x == -1 ? (y % 2 ? -1 : 1) : 0;                     \
    U r = 1, b = (U)x;                                                                 \
    for (U e = (U)y; e; e >>= 1) {                                                     \
      if (e & 1) r *= b;                                                               \
      b *= b;                                                                          \
    }                                                                                  \
    return (T)r;                                                                       \
  }

INT_ELEMS(i32, int32_t, uint32_t)
INT_ELEMS(i64, int64_t, uint64_t)

/* bool is one canonical byte, 0 or 1 */
static inline uint8_t el_not_b8(uint8_t x) { return x ^ 1; }
static inline uint8_t el_and_b8(uint8_t x, uint8_t y) { return x & y; }
static inline uint8_t el_or_b8(uint8_t x, uint8_t y) { return x | y; }
static inline uint8_t el_max_b8(uint8_t x, uint8_t y) { return x | y; }
static inline uint8_t el_min_b8(uint8_t x, uint8_t y) { return x & y; }

#define COMPARE_ELEMS(sfx, T)                                    \
  static inline uint8_t el_eq_##sfx(T x, T y) { return x == y; } \
  static inline uint8_t el_ne_##sfx(T x, T y) { return x != y; } \
  static inline uint8_t el_lt_##sfx(T x, T y) { return x < y; }  \
  static inline uint8_t el_le_##sfx(T x, T y) { return x <= y; } \
  static inline uint8_t el_gt_##sfx(T x, T y) { return x > y; }  \
  static inline uint8_t el_ge_##sfx(T x, T y) { return x >= y; }

COMPARE_ELEMS(f32, float)
COMPARE_ELEMS(f64, double)
COMPARE_ELEMS(i32, int32_t)
COMPARE_ELEMS(i64, int64_t)
COMPARE_ELEMS(b8, uint8_t)

/* ------------------------------------------------------------------------
 * The driver. A loop computes n outputs from up to three inputs, each either
 * contiguous (stride 1) or one broadcast element (stride 0); loops[] holds
 * every such variant, indexed by a mask with bit k set when input k is
 * contiguous. ew_run coalesces the broadcast shape into as few dimensions as
 * possible and runs the variant that fits the innermost one, row by row.
 * ---------------------------------------------------------------------- */

/* restrict on the parameters: the buffers never overlap (the output is new),
 * and without it gcc adds a run-time overlap check to every loop */
#define LOOP_PARAMS                                                                   \
  void *KILN_RESTRICT o_, const void *KILN_RESTRICT x_, const void *KILN_RESTRICT y_, \
      const void *KILN_RESTRICT z_, int64_t n
typedef void (*ew_loop)(LOOP_PARAMS);

typedef struct {
  ew_loop loop; /* the variant for the innermost dimension */
  int nin, rank;
  char *out;
  size_t osz;
  const char *in[3];
  size_t isz[3];
  int64_t dim[KILN_MAX_RANK];
  int64_t stride[3][KILN_MAX_RANK]; /* in elements; 0 where broadcast */
  int64_t block, nblk;              /* a row is nblk units of at most block elements */
} ew_plan;

/* Runs units [u0, u1): unit u is block u % nblk of row u / nblk. */
static void ew_chunk(void *ctx, int64_t u0, int64_t u1) {
  const ew_plan *p = ctx;
  int R = p->rank;
  int64_t inner = p->dim[R - 1], row = u0 / p->nblk, col = (u0 % p->nblk) * p->block;
  int64_t idx[KILN_MAX_RANK] = {0}, off[3] = {0, 0, 0};
  for (int64_t d = R - 2, r = row; d >= 0; d--) {
    idx[d] = r % p->dim[d];
    r /= p->dim[d];
    for (int k = 0; k < p->nin; k++) off[k] += idx[d] * p->stride[k][d];
  }
  for (int64_t u = u0; u < u1; u++) {
    const void *arg[3] = {NULL, NULL, NULL};
    for (int k = 0; k < p->nin; k++)
      arg[k] = p->in[k] + (off[k] + col * p->stride[k][R - 1]) * (int64_t)p->isz[k];
    int64_t len = inner - col < p->block ? inner - col : p->block;
    p->loop(p->out + (row * inner + col) * (int64_t)p->osz, arg[0], arg[1], arg[2], len);
    col += p->block;
    if (col < inner) continue;
    col = 0;
    row++;
    for (int d = R - 2; d >= 0; d--) { /* the next row: an odometer over the outer dims */
      for (int k = 0; k < p->nin; k++) off[k] += p->stride[k][d];
      if (++idx[d] < p->dim[d]) break;
      for (int k = 0; k < p->nin; k++) off[k] -= p->stride[k][d] * p->dim[d];
      idx[d] = 0;
    }
  }
}

static int ew_run(const op_call *c, const ew_loop *loops, int64_t grain) {
  const kiln_tensor *o = c->out;
  int64_t n = o->size;
  if (n == 0) return 0;
  ew_plan p;
  p.nin = c->n;
  p.out = o->data;
  p.osz = kiln_dtype_sizes[o->dtype];
  bool flat = true; /* every input full-size or a single element */
  for (int k = 0; k < c->n; k++) {
    p.in[k] = c->in[k]->data;
    p.isz[k] = kiln_dtype_sizes[c->in[k]->dtype];
    flat = flat && (c->in[k]->size == n || c->in[k]->size == 1);
  }
  if (flat) {
    p.rank = 1;
    p.dim[0] = n;
    for (int k = 0; k < c->n; k++) p.stride[k][0] = c->in[k]->size == n;
  } else {
    int64_t st[3][KILN_MAX_RANK];
    for (int k = 0; k < c->n; k++)
      broadcast_strides(c->in[k]->rank, c->in[k]->shape, o->rank, o->shape, st[k]);
    /* drop size-1 dims; merge a dim into the one outside it when every
     * input steps through both as through one ([2,3,4] + [4] -> [6,4] + [4]) */
    p.rank = 0;
    for (int d = 0; d < o->rank; d++) {
      int64_t len = o->shape[d];
      if (len == 1) continue;
      bool merge = p.rank > 0;
      for (int k = 0; merge && k < c->n; k++) merge = p.stride[k][p.rank - 1] == st[k][d] * len;
      if (merge) {
        p.dim[p.rank - 1] *= len;
      } else {
        p.dim[p.rank] = len;
        p.rank++;
      }
      for (int k = 0; k < c->n; k++) p.stride[k][p.rank - 1] = st[k][d];
    }
  }
  int64_t inner = p.dim[p.rank - 1];
  int mask = 0;
  for (int k = 0; k < c->n; k++) mask |= (p.stride[k][p.rank - 1] != 0) << k;
  p.loop = loops[mask];
  p.block = inner > BLOCK ? BLOCK : inner;
  p.nblk = (inner + p.block - 1) / p.block;
  int64_t units = n / inner * p.nblk;
  if (n <= grain)
    ew_chunk(&p, 0, units);
  else
    parallel_for(units, grain > p.block ? grain / p.block : 1, ew_chunk, &p);
  return 0;
}

/* ------------------------------------------------------------------------
 * Loops and kernels. Strides SX, SY, SZ are the constants 0 or 1, so each
 * variant is a plain counted loop gcc vectorizes (a stride-0 operand is a
 * loop-invariant load). Each kernel runs a small same-shape call directly:
 * that path must cost next to nothing beyond the loop (the dispatch budget).
 * ---------------------------------------------------------------------- */

#define LOOP1(name, F, TI, TO)                      \
  KILN_HOT static void name(LOOP_PARAMS) {                   \
    (void)y_, (void)z_;                             \
    TO *KILN_RESTRICT o = o_;                       \
    const TI *KILN_RESTRICT x = x_;                 \
    for (int64_t i = 0; i < n; i++) o[i] = F(x[i]); \
  }

#define LOOP2(name, F, TI, TO, SX, SY)                              \
  KILN_HOT static void name(LOOP_PARAMS) {                                   \
    (void)z_;                                                       \
    TO *KILN_RESTRICT o = o_;                                       \
    const TI *KILN_RESTRICT x = x_;                                 \
    const TI *KILN_RESTRICT y = y_;                                 \
    for (int64_t i = 0; i < n; i++) o[i] = F(x[i * SX], y[i * SY]); \
  }

/* select: x is the bool condition; values are copied as raw bits of their size */
#define LOOP3(name, T, SX, SY, SZ)                                       \
  KILN_HOT static void name(LOOP_PARAMS) {                                        \
    T *KILN_RESTRICT o = o_;                                             \
    const uint8_t *KILN_RESTRICT cond = x_;                              \
    const T *KILN_RESTRICT a = y_;                                       \
    const T *KILN_RESTRICT b = z_;                                       \
    for (int64_t i = 0; i < n; i++) {                                    \
      T va = a[i * SY], vb = b[i * SZ]; /* both loaded: a plain blend */ \
      o[i] = cond[i * SX] ? va : vb;                                     \
    }                                                                    \
  }

static inline int no_check(const op_call *c) {
  (void)c;
  return 0;
}

#define UNARY_KERNEL(op, sfx, T, grain)                               \
  LOOP1(op##_##sfx##_1, el_##op##_##sfx, T, T)                        \
  static int k_##op##_##sfx(const op_call *c) {                       \
    static const ew_loop loops[2] = {op##_##sfx##_1, op##_##sfx##_1}; \
    kiln_tensor *o = c->out;                                          \
    if (KILN_LIKELY(o->size <= (grain))) {                            \
      op##_##sfx##_1(o->data, c->in[0]->data, NULL, NULL, o->size);   \
      return 0;                                                       \
    }                                                                 \
    return ew_run(c, loops, grain);                                   \
  }

/* check(c) runs first and may refuse the inputs (integer division by zero) */
#define BINARY_KERNEL(op, sfx, TI, TO, grain, check)                                    \
  LOOP2(op##_##sfx##_00, el_##op##_##sfx, TI, TO, 0, 0)                                 \
  LOOP2(op##_##sfx##_10, el_##op##_##sfx, TI, TO, 1, 0)                                 \
  LOOP2(op##_##sfx##_01, el_##op##_##sfx, TI, TO, 0, 1)                                 \
  LOOP2(op##_##sfx##_11, el_##op##_##sfx, TI, TO, 1, 1)                                 \
  static int k_##op##_##sfx(const op_call *c) {                                         \
    static const ew_loop loops[4] = {op##_##sfx##_00, op##_##sfx##_10, op##_##sfx##_01, \
                                     op##_##sfx##_11};                                  \
    const kiln_tensor *x = c->in[0], *y = c->in[1];                                     \
    kiln_tensor *o = c->out;                                                            \
    if (check(c)) return -1;                                                            \
    if (KILN_LIKELY(x->size == o->size && y->size == o->size && o->size <= (grain))) {  \
      op##_##sfx##_11(o->data, x->data, y->data, NULL, o->size);                        \
      return 0;                                                                         \
    }                                                                                   \
    return ew_run(c, loops, grain);                                                     \
  }

/* Integer div and mod refuse a zero divisor before computing anything. */
#define DIVISOR_CHECK(sfx, T)                                                           \
  static int nonzero_##sfx(const op_call *c) {                                          \
    const T *y = c->in[1]->data;                                                        \
    int64_t n = c->out->size ? c->in[1]->size : 0;                                      \
    int zero = 0;                                                                       \
    for (int64_t i = 0; i < n; i++) zero |= y[i] == 0;                                  \
    if (KILN_LIKELY(!zero)) return 0;                                                   \
    int64_t i = 0;                                                                      \
    while (y[i] != 0) i++;                                                              \
    return kiln_set_error("%s: integer division by zero (element %lld of the divisor)", \
                          kiln_ops[c->op].api, (long long)i);                           \
  }

DIVISOR_CHECK(i32, int32_t)
DIVISOR_CHECK(i64, int64_t)

#define SELECT_KERNEL(sfx, T)                                                                    \
  LOOP3(select_##sfx##_000, T, 0, 0, 0)                                                          \
  LOOP3(select_##sfx##_100, T, 1, 0, 0)                                                          \
  LOOP3(select_##sfx##_010, T, 0, 1, 0)                                                          \
  LOOP3(select_##sfx##_110, T, 1, 1, 0)                                                          \
  LOOP3(select_##sfx##_001, T, 0, 0, 1)                                                          \
  LOOP3(select_##sfx##_101, T, 1, 0, 1)                                                          \
  LOOP3(select_##sfx##_011, T, 0, 1, 1)                                                          \
  LOOP3(select_##sfx##_111, T, 1, 1, 1)                                                          \
  static int k_select_##sfx(const op_call *c) {                                                  \
    static const ew_loop loops[8] = {select_##sfx##_000, select_##sfx##_100, select_##sfx##_010, \
                                     select_##sfx##_110, select_##sfx##_001, select_##sfx##_101, \
                                     select_##sfx##_011, select_##sfx##_111};                    \
    kiln_tensor *o = c->out;                                                                     \
    int64_t n = o->size;                                                                         \
    if (KILN_LIKELY(c->in[0]->size == n && c->in[1]->size == n && c->in[2]->size == n &&         \
                    n <= GRAIN)) {                                                               \
      select_##sfx##_111(o->data, c->in[0]->data, c->in[1]->data, c->in[2]->data, n);            \
      return 0;                                                                                  \
    }                                                                                            \
    return ew_run(c, loops, GRAIN);                                                              \
  }

/* ---- the op lists: X(OP id, element name, grain) ---- */

/* clang-format off */
#define NUM_UNARY(X)                                                             \
  X(NEG, neg, GRAIN) X(ABS, abs, GRAIN) X(SIGN, sign, GRAIN) X(RELU, relu, GRAIN)
#define FLOAT_UNARY(X)                                                           \
  X(EXP, exp, GRAIN) X(LOG, log, GRAIN) X(LOG1P, log1p, GRAIN_HEAVY)            \
  X(SQRT, sqrt, GRAIN) X(RSQRT, rsqrt, GRAIN)                                    \
  X(SIN, sin, GRAIN_HEAVY) X(COS, cos, GRAIN_HEAVY)                              \
  X(TANH, tanh, GRAIN) X(SIGMOID, sigmoid, GRAIN)                                \
  X(FLOOR, floor, GRAIN) X(CEIL, ceil, GRAIN)
#define NUM_BINARY(X)                                                            \
  X(ADD, add, GRAIN) X(SUB, sub, GRAIN) X(MUL, mul, GRAIN)                       \
  X(MAX, max, GRAIN) X(MIN, min, GRAIN)
#define COMPARE(X)                                                               \
  X(EQ, eq, GRAIN) X(NE, ne, GRAIN) X(LT, lt, GRAIN)                             \
  X(LE, le, GRAIN) X(GT, gt, GRAIN) X(GE, ge, GRAIN)
/* clang-format on */

#define FLOAT_UNARY_K(ID, op, grain) \
  UNARY_KERNEL(op, f32, float, grain) UNARY_KERNEL(op, f64, double, grain)
#define INT_UNARY_K(ID, op, grain) \
  UNARY_KERNEL(op, i32, int32_t, grain) UNARY_KERNEL(op, i64, int64_t, grain)
#define FLOAT_BINARY_K(ID, op, grain)                   \
  BINARY_KERNEL(op, f32, float, float, grain, no_check) \
  BINARY_KERNEL(op, f64, double, double, grain, no_check)
#define INT_BINARY_K(ID, op, grain)                         \
  BINARY_KERNEL(op, i32, int32_t, int32_t, grain, no_check) \
  BINARY_KERNEL(op, i64, int64_t, int64_t, grain, no_check)
#define COMPARE_K(ID, op, grain)                            \
  BINARY_KERNEL(op, f32, float, uint8_t, grain, no_check)   \
  BINARY_KERNEL(op, f64, double, uint8_t, grain, no_check)  \
  BINARY_KERNEL(op, i32, int32_t, uint8_t, grain, no_check) \
  BINARY_KERNEL(op, i64, int64_t, uint8_t, grain, no_check) \
  BINARY_KERNEL(op, b8, uint8_t, uint8_t, grain, no_check)

NUM_UNARY(FLOAT_UNARY_K)
NUM_UNARY(INT_UNARY_K)
FLOAT_UNARY(FLOAT_UNARY_K)
UNARY_KERNEL(not, b8, uint8_t, GRAIN)

NUM_BINARY(FLOAT_BINARY_K)
NUM_BINARY(INT_BINARY_K)
BINARY_KERNEL(div, f32, float, float, GRAIN, no_check)
BINARY_KERNEL(div, f64, double, double, GRAIN, no_check)
BINARY_KERNEL(div, i32, int32_t, int32_t, GRAIN_HEAVY, nonzero_i32)
BINARY_KERNEL(div, i64, int64_t, int64_t, GRAIN_HEAVY, nonzero_i64)
BINARY_KERNEL(mod, f32, float, float, GRAIN_HEAVY, no_check)
BINARY_KERNEL(mod, f64, double, double, GRAIN_HEAVY, no_check)
BINARY_KERNEL(mod, i32, int32_t, int32_t, GRAIN_HEAVY, nonzero_i32)
BINARY_KERNEL(mod, i64, int64_t, int64_t, GRAIN_HEAVY, nonzero_i64)
FLOAT_BINARY_K(POW, pow, GRAIN_HEAVY)
INT_BINARY_K(POW, pow, GRAIN_HEAVY)
BINARY_KERNEL(max, b8, uint8_t, uint8_t, GRAIN, no_check)
BINARY_KERNEL(min, b8, uint8_t, uint8_t, GRAIN, no_check)
BINARY_KERNEL(and, b8, uint8_t, uint8_t, GRAIN, no_check)
BINARY_KERNEL(or, b8, uint8_t, uint8_t, GRAIN, no_check)
COMPARE(COMPARE_K)

SELECT_KERNEL(u8, uint8_t)
SELECT_KERNEL(u16, uint16_t)
SELECT_KERNEL(u32, uint32_t)
SELECT_KERNEL(u64, uint64_t)

/* ---- registration ---- */

#define REG(ID, op, sfx, DT) dispatch_register(OP_##ID, 0, DT, k_##op##_##sfx);
#define REG_FLOAT(ID, op, grain) REG(ID, op, f32, KILN_F32) REG(ID, op, f64, KILN_F64)
#define REG_INT(ID, op, grain) REG(ID, op, i32, KILN_I32) REG(ID, op, i64, KILN_I64)
#define REG_NUM(ID, op, grain) REG_FLOAT(ID, op, grain) REG_INT(ID, op, grain)
#define REG_NUMB(ID, op, grain) REG_NUM(ID, op, grain) REG(ID, op, b8, KILN_BOOL)

KILN_CONSTRUCTOR static void register_elementwise_kernels(void) {
  NUM_UNARY(REG_NUM)
  FLOAT_UNARY(REG_FLOAT)
  REG(NOT, not, b8, KILN_BOOL)
  NUM_BINARY(REG_NUM)
  REG_NUM(DIV, div, GRAIN)
  REG_NUM(MOD, mod, GRAIN)
  REG_NUM(POW, pow, GRAIN)
  REG(MAX, max, b8, KILN_BOOL)
  REG(MIN, min, b8, KILN_BOOL)
  REG(AND, and, b8, KILN_BOOL)
  REG(OR, or, b8, KILN_BOOL)
  COMPARE(REG_NUMB)
  REG(SELECT, select, u32, KILN_F32)
  REG(SELECT, select, u64, KILN_F64)
  REG(SELECT, select, u32, KILN_I32)
  REG(SELECT, select, u64, KILN_I64)
  REG(SELECT, select, u8, KILN_BOOL)
  REG(SELECT, select, u16, KILN_F16)
  REG(SELECT, select, u16, KILN_BF16)
}
