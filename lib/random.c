/* random.c — Kiln's counter-based generator: Philox-4x32-10 (Salmon et al.,
 * "Parallel random numbers: as easy as 1, 2, 3", SC'11), the global
 * (seed, counter) stream, and the RNG_UNIFORM / RNG_NORMAL kernels. Each
 * element is a pure function of (seed, block, word) in the layout runtime.h
 * documents, so a draw is the same however it is split over threads. */
#include <float.h>
#include <math.h>

#include "ops.h"
#include "random.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define PHILOX_ROUNDS 10

/* ---- the block function ---- */

void kiln_debug_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
  uint32_t x0 = ctr[0], x1 = ctr[1], x2 = ctr[2], x3 = ctr[3], k0 = key[0], k1 = key[1];
  for (int r = 0; r < PHILOX_ROUNDS; r++) {
    if (r) k0 += PHILOX_W0, k1 += PHILOX_W1;
    uint64_t p0 = (uint64_t)PHILOX_M0 * x0, p1 = (uint64_t)PHILOX_M1 * x2;
    uint32_t y0 = (uint32_t)(p1 >> 32) ^ x1 ^ k0, y2 = (uint32_t)(p0 >> 32) ^ x3 ^ k1;
    x1 = (uint32_t)p1;
    x3 = (uint32_t)p0;
    x0 = y0;
    x2 = y2;
  }
  out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3;
}

void philox4x32(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  const uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0, 0};
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  kiln_debug_philox4x32(ctr, key, out);
}

/* Blocks c0 .. c0+n-1 into four word arrays (struct of arrays, so the
 * kernels read them with unit stride). One flat loop with the round keys
 * precomputed, so that gcc vectorizes it; the 32-bit words ride in 64-bit
 * lanes, which saves the widening shuffles around each multiply (twice as
 * fast as uint32_t lanes with gcc 12). */
enum { CHUNK = 256 };
typedef struct {
  uint32_t w[4][CHUNK];
} philox_chunk;

static void philox_blocks(uint64_t seed, uint64_t c0, int n, philox_chunk *restrict out) {
  const uint64_t lo32 = 0xffffffffu;
  uint64_t k0[PHILOX_ROUNDS], k1[PHILOX_ROUNDS];
  k0[0] = seed & lo32, k1[0] = seed >> 32;
  for (int r = 1; r < PHILOX_ROUNDS; r++)
    k0[r] = (k0[r - 1] + PHILOX_W0) & lo32, k1[r] = (k1[r - 1] + PHILOX_W1) & lo32;
  for (int b = 0; b < n; b++) {
    uint64_t c = c0 + (uint64_t)b;
    uint64_t x0 = c & lo32, x1 = c >> 32, x2 = 0, x3 = 0;
    for (int r = 0; r < PHILOX_ROUNDS; r++) {
      uint64_t p0 = PHILOX_M0 * x0, p1 = PHILOX_M1 * x2;
      uint64_t y0 = (p1 >> 32) ^ x1 ^ k0[r], y2 = (p0 >> 32) ^ x3 ^ k1[r];
      x1 = p1 & lo32;
      x3 = p0 & lo32;
      x0 = y0;
      x2 = y2;
    }
    out->w[0][b] = (uint32_t)x0, out->w[1][b] = (uint32_t)x1;
    out->w[2][b] = (uint32_t)x2, out->w[3][b] = (uint32_t)x3;
  }
}

/* ---- the global stream ---- */

/* Seeding while another thread draws is not synchronised: the pair may be
 * read half-updated, as with any global generator. */
static _Atomic uint64_t rng_seed, rng_counter;

void kiln_random_seed(uint64_t seed) { kiln_random_set_state(seed, 0); }

void kiln_random_get_state(uint64_t *seed, uint64_t *counter) {
  if (seed) *seed = atomic_load(&rng_seed);
  if (counter) *counter = atomic_load(&rng_counter);
}

void kiln_random_set_state(uint64_t seed, uint64_t counter) {
  atomic_store(&rng_seed, seed);
  atomic_store(&rng_counter, counter);
}

uint64_t rng_reserve(uint64_t blocks, uint64_t *seed) {
  *seed = atomic_load(&rng_seed);
  return atomic_fetch_add(&rng_counter, blocks);
}

/* ---- kernels ----
 * Element i takes the 64-bit value r = lo | hi << 32 of its word pair
 * (words 0-1 for even i, 2-3 for odd i). Uniform f32 uses the top 24 bits
 * of r, f64 the top 53; integers take the high half of r * span (bias below
 * span / 2^64, none that any test of a 32-bit range can see). A normal pair
 * (2j, 2j+1) is Box-Muller over u1 = top 53 bits of words 0-1, shifted into
 * (0, 1], and u2 = top 53 bits of words 2-3; f32 normals are the f64 values
 * rounded. */

static inline uint64_t word_pair(uint32_t lo, uint32_t hi) { return (uint64_t)lo | (uint64_t)hi << 32; }

/* floats: v = scale * (lo_s + d_s * u), then clamped below hi */
typedef struct {
  double lo_s, d_s, scale, hi, top; /* top: the largest double below hi (lo when lo == hi) */
  float hi_f, top_f;                /* the same for f32 results */
} float_range;

static inline float float_range_f32(float_range p, uint32_t a, uint32_t c) {
  double u = (double)(word_pair(a, c) >> 40) * 0x1p-24;
  float f = (float)(p.scale * (p.lo_s + p.d_s * u));
  return f < p.hi_f ? f : p.top_f;
}

static inline double float_range_f64(float_range p, uint32_t a, uint32_t c) {
  double u = (double)(word_pair(a, c) >> 11) * 0x1p-53;
  double v = p.scale * (p.lo_s + p.d_s * u);
  return v < p.hi ? v : p.top;
}

/* integers: lo + mulhi(r, span); span 0 stands for 2^64 */
typedef struct {
  int64_t lo;
  uint64_t span;
} int_range;

/* high 64 bits of a * b, in portable C */
static inline uint64_t mulhi64(uint64_t a, uint64_t b) {
  uint64_t a0 = (uint32_t)a, a1 = a >> 32, b0 = (uint32_t)b, b1 = b >> 32;
  uint64_t p00 = a0 * b0, p01 = a0 * b1, p10 = a1 * b0, p11 = a1 * b1;
  uint64_t mid = (p00 >> 32) + (uint32_t)p01 + (uint32_t)p10;
  return p11 + (p01 >> 32) + (p10 >> 32) + (mid >> 32);
}

/* unsigned arithmetic wraps; the conversion back is modular in gcc and clang */
static inline int64_t int_range_i64(int_range p, uint32_t a, uint32_t c) {
  uint64_t r = word_pair(a, c);
  return (int64_t)((uint64_t)p.lo + (p.span ? mulhi64(r, p.span) : r));
}

static inline int32_t int_range_i32(int_range p, uint32_t a, uint32_t c) {
  return (int32_t)int_range_i64(p, a, c);
}

/* A draw: tasks take ranges of blocks, generate them CHUNK at a time and
 * convert them into their elements. */
typedef struct rng_ctx rng_ctx;
typedef void (*rng_convert)(const rng_ctx *x, const philox_chunk *restrict w, int64_t b, int m);
struct rng_ctx {
  uint64_t seed, counter;
  int64_t n; /* elements */
  void *out;
  rng_convert convert;
  float_range fr;
  int_range ir;
};

static void rng_task(void *arg, int64_t b0, int64_t b1) {
  const rng_ctx *x = arg;
  philox_chunk w;
  for (int64_t b = b0; b < b1; b += CHUNK) {
    int m = b1 - b < CHUNK ? (int)(b1 - b) : CHUNK;
    philox_blocks(x->seed, x->counter + (uint64_t)b, m, &w);
    x->convert(x, &w, b, m);
  }
}

/* The elements of blocks [b, b+m) that exist: 2m, or 2m - 1 when the draw
 * ends half way through its last block. F(p, lo_word, hi_word) gives one. */
#define FOR_ELEMENTS(x, w, b, m, out, F, p)                                       \
  do {                                                                            \
    int64_t ne_ = (x)->n - 2 * (b) < 2 * (m) ? (x)->n - 2 * (b) : 2 * (m);      \
    for (int64_t j = 0; j < ne_ / 2; j++) {                                       \
      (out)[2 * j] = F(p, (w)->w[0][j], (w)->w[1][j]);                            \
      (out)[2 * j + 1] = F(p, (w)->w[2][j], (w)->w[3][j]);                        \
    }                                                                             \
    if (ne_ & 1) (out)[ne_ - 1] = F(p, (w)->w[0][ne_ / 2], (w)->w[1][ne_ / 2]);  \
  } while (0)

#define UNIFORM_CONVERT(T, P, field, F)                                                          \
  static void uniform_##T(const rng_ctx *x, const philox_chunk *restrict w, int64_t b, int m) { \
    T *restrict out = (T *)x->out + 2 * b;                                                       \
    const P p = x->field;                                                                        \
    FOR_ELEMENTS(x, w, b, m, out, F, p);                                                         \
  }

typedef float f32;
typedef double f64;
typedef int32_t i32;
typedef int64_t i64;
UNIFORM_CONVERT(f32, float_range, fr, float_range_f32)
UNIFORM_CONVERT(f64, float_range, fr, float_range_f64)
UNIFORM_CONVERT(i32, int_range, ir, int_range_i32)
UNIFORM_CONVERT(i64, int_range, ir, int_range_i64)

#define TWO_PI 6.283185307179586

/* One Box-Muller pair from a whole block. */
static inline void box_muller(const philox_chunk *w, int64_t j, double *z0, double *z1) {
  double u1 = ((double)(word_pair(w->w[0][j], w->w[1][j]) >> 11) + 1.0) * 0x1p-53; /* (0, 1] */
  double u2 = (double)(word_pair(w->w[2][j], w->w[3][j]) >> 11) * 0x1p-53;         /* [0, 1) */
  double rad = sqrt(-2.0 * log(u1)), theta = TWO_PI * u2;
  *z0 = rad * cos(theta);
  *z1 = rad * sin(theta);
}

#define NORMAL_CONVERT(T)                                                                       \
  static void normal_##T(const rng_ctx *x, const philox_chunk *restrict w, int64_t b, int m) { \
    T *restrict out = (T *)x->out + 2 * b;                                                      \
    int64_t ne = x->n - 2 * b < 2 * m ? x->n - 2 * b : 2 * m;                                   \
    for (int64_t j = 0; j < (ne + 1) / 2; j++) {                                                \
      double z0, z1;                                                                            \
      box_muller(w, j, &z0, &z1);                                                               \
      out[2 * j] = (T)z0;                                                                       \
      if (2 * j + 1 < ne) out[2 * j + 1] = (T)z1;                                               \
    }                                                                                           \
  }

NORMAL_CONVERT(f32)
NORMAL_CONVERT(f64)

/* Blocks per task: about 32K elements for the cheap uniform draws, fewer
 * for normals, whose logs and sines cost far more per element. */
enum { UNIFORM_GRAIN = 16384, NORMAL_GRAIN = 2048 };

static int rng_run(const op_call *c, rng_ctx *x, int64_t grain) {
  x->seed = c->attrs->seed;
  x->counter = c->attrs->counter;
  x->n = c->out->size;
  x->out = c->out->data;
  parallel_for((x->n + 1) / 2, grain, rng_task, x);
  return 0;
}

static int bad_range(const op_attrs *a) {
  if (a->lo <= a->hi && isfinite(a->lo) && isfinite(a->hi)) return 0;
  return kiln_set_error("random_uniform: need finite lo <= hi, got [%g, %g)", a->lo, a->hi);
}

/* [lo, hi) as floats; lo == hi gives lo. The computation runs at half
 * scale when hi - lo overflows, so [-DBL_MAX, DBL_MAX) works. */
static float_range make_float_range(double lo, double hi) {
  float_range p = {.lo_s = lo, .d_s = hi - lo, .scale = 1, .hi = hi};
  if (isinf(p.d_s)) p.lo_s = lo / 2, p.d_s = hi / 2 - lo / 2, p.scale = 2;
  p.top = hi > lo ? nextafter(hi, -INFINITY) : lo;
  return p;
}

static int uniform_float_kernel(const op_call *c, rng_convert convert) {
  const op_attrs *a = c->attrs;
  if (bad_range(a)) return -1;
  rng_ctx x = {.convert = convert, .fr = make_float_range(a->lo, a->hi)};
  if (c->out->dtype == KILN_F32) {
    if (fabs(a->lo) > FLT_MAX || fabs(a->hi) > FLT_MAX)
      return kiln_set_error("random_uniform: range [%g, %g) does not fit f32", a->lo, a->hi);
    /* rounding to f32 can reach hi (1 + (1 - 2^-24) rounds to 2): clamp
     * to the float below it */
    x.fr.hi_f = (float)a->hi;
    float lo_f = (float)a->lo;
    x.fr.top_f = x.fr.hi_f > lo_f ? nextafterf(x.fr.hi_f, -INFINITY) : lo_f;
  }
  return rng_run(c, &x, UNIFORM_GRAIN);
}

static int uniform_f32_kernel(const op_call *c) { return uniform_float_kernel(c, uniform_f32); }
static int uniform_f64_kernel(const op_call *c) { return uniform_float_kernel(c, uniform_f64); }

/* Integers in [ceil(lo), ceil(hi)), which must be non-empty and fit. */
static int uniform_int_kernel(const op_call *c, rng_convert convert) {
  const op_attrs *a = c->attrs;
  if (bad_range(a)) return -1;
  double lo = ceil(a->lo), hi = ceil(a->hi);
  if (!(lo < hi)) return kiln_set_error("random_uniform: empty integer range [%g, %g)", a->lo, a->hi);
  double limit = c->out->dtype == KILN_I32 ? 0x1p31 : 0x1p63;
  if (lo < -limit || hi > limit)
    return kiln_set_error("random_uniform: range [%g, %g) does not fit %s", a->lo, a->hi,
                          kiln_dtype_name((kiln_dtype)c->out->dtype));
  rng_ctx x = {.convert = convert};
  x.ir.lo = (int64_t)lo;
  /* hi may be 2^63, one past INT64_MAX: count from hi - 1 */
  uint64_t last = hi == 0x1p63 ? (uint64_t)INT64_MAX : (uint64_t)((int64_t)hi - 1);
  x.ir.span = last - (uint64_t)x.ir.lo + 1; /* wraps to 0 for the full 2^64 */
  return rng_run(c, &x, UNIFORM_GRAIN);
}

static int uniform_i32_kernel(const op_call *c) { return uniform_int_kernel(c, uniform_i32); }
static int uniform_i64_kernel(const op_call *c) { return uniform_int_kernel(c, uniform_i64); }

static int normal_f32_kernel(const op_call *c) {
  rng_ctx x = {.convert = normal_f32};
  return rng_run(c, &x, NORMAL_GRAIN);
}

static int normal_f64_kernel(const op_call *c) {
  rng_ctx x = {.convert = normal_f64};
  return rng_run(c, &x, NORMAL_GRAIN);
}

KILN_CONSTRUCTOR static void register_kernels(void) {
  dispatch_register(OP_RNG_UNIFORM, 0, KILN_F32, uniform_f32_kernel);
  dispatch_register(OP_RNG_UNIFORM, 0, KILN_F64, uniform_f64_kernel);
  dispatch_register(OP_RNG_UNIFORM, 0, KILN_I32, uniform_i32_kernel);
  dispatch_register(OP_RNG_UNIFORM, 0, KILN_I64, uniform_i64_kernel);
  dispatch_register(OP_RNG_NORMAL, 0, KILN_F32, normal_f32_kernel);
  dispatch_register(OP_RNG_NORMAL, 0, KILN_F64, normal_f64_kernel);
}
