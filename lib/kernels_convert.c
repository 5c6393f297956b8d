/* kernels_convert.c — the CONVERT primitive (kiln_cast) on the CPU, between
 * all seven dtypes. One table of element conversions, expanded into one
 * vectorizable loop per (source, target) pair. */
#include <math.h>

#include "ops.h"
#include "round_odd.h"

enum { GRAIN = 32768 };

/* ---- float -> integer: truncate toward zero, NaN -> 0, saturate ----
 * Clamping first keeps every C conversion in range (no UB) and the whole
 * function branch-free, so the loops vectorize. The upper clamps are the
 * largest values below 2^31 and 2^63 that the float type holds; at 2^31
 * (2^63) and above the result is the maximum. */

static inline int32_t f32_i32(float x) {
  float c = x == x ? x : 0.0f;
  c = c > -2147483648.0f ? c : -2147483648.0f;
  c = c < 2147483520.0f ? c : 2147483520.0f;
  int32_t r = (int32_t)c;
  return x >= 2147483648.0f ? INT32_MAX : r;
}

static inline int64_t f32_i64(float x) {
  float c = x == x ? x : 0.0f;
  c = c > -9223372036854775808.0f ? c : -9223372036854775808.0f;
  c = c < 9223371487098961920.0f ? c : 9223371487098961920.0f;
  int64_t r = (int64_t)c;
  return x >= 9223372036854775808.0f ? INT64_MAX : r;
}

static inline int32_t f64_i32(double x) {
  double c = x == x ? x : 0.0;
  c = c > -2147483648.0 ? c : -2147483648.0;
  c = c < 2147483647.0 ? c : 2147483647.0;
  return (int32_t)c;
}

static inline int64_t f64_i64(double x) {
  double c = x == x ? x : 0.0;
  c = c > -9223372036854775808.0 ? c : -9223372036854775808.0;
  c = c < 9223372036854774784.0 ? c : 9223372036854774784.0;
  int64_t r = (int64_t)c;
  return x >= 9223372036854775808.0 ? INT64_MAX : r;
}

/* ---- f16 and bf16: the same results as kiln_f16_to_f32, kiln_f32_to_f16,
 * kiln_bf16_to_f32 and kiln_f32_to_bf16 (runtime.h; round to nearest even,
 * checked equal on every input), written without branches so they vectorize.
 * Other dtypes go through f32, as dtype_store does: f64 (and the integers,
 * through f64) rounded to odd first (f64_to_f32_odd), so that the value is
 * rounded once. */

/* i64 -> f64 rounded to odd where inexact (|x| > 2^53), as f64_to_f32_odd;
 * round-to-odd twice (53 then 24 bits) is still rounding once to odd. */
static inline double i64_f64_odd(int64_t x) {
  double d = (double)x;
  bool top = d >= 0x1p63; /* x near INT64_MAX rounded up to 2^63 */
  int64_t back = top ? INT64_MAX : (int64_t)d;
  uint64_t inexact = top || back != x, away = top || (x < 0 ? back < x : back > x);
  uint64_t u;
  memcpy(&u, &d, 8);
  u = (u - away) | inexact;
  memcpy(&d, &u, 8);
  return d;
}

static inline float f16_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t normal = sign | ((exp + 112) << 23) | (man << 13);
  uint32_t inf_nan = sign | 0x7f800000u | (man << 13);
  uint32_t subnormal = sign | f32_bits((float)man * 0x1p-24f); /* exact */
  /* a bitwise blend, not ?:, so gcc cannot sink the conversion into a branch */
  uint32_t is_sub = 0u - (uint32_t)(exp == 0);
  uint32_t r = exp == 0x1f ? inf_nan : normal;
  return bits_f32((subnormal & is_sub) | (r & ~is_sub));
}

static inline uint16_t f32_f16(float f) {
  uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
  uint32_t inf_nan = 0x7c00u | (a > 0x7f800000u ? 0x200u : 0);
  /* below 2^-14: a count of 2^-24 units, rounded to even by adding 2^23 */
  uint32_t subnormal = f32_bits(bits_f32(a) * 0x1p24f + 0x1p23f) - 0x4b000000u;
  uint32_t normal = (a + 0xfffu + ((a >> 13) & 1) - 0x38000000u) >> 13;
  uint32_t h = a >= 0x7f800000u   ? inf_nan
               : a >= 0x477ff000u ? 0x7c00u /* rounds past 65504: inf */
               : a < 0x38800000u  ? subnormal
                                  : normal;
  return (uint16_t)(sign | h);
}

static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t f32_bf16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t nan = (u >> 16) | 0x40, rounded = (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
  return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/* ---- the table: X(source, target, source type, target type, expression of x).
 * Same-dtype casts are copies and not listed. Integer narrowing wraps (as C,
 * NumPy and LLVM's trunc do); anything to bool is x != 0 (NaN is true). */

#define CAST_PAIRS(X)                                           \
  X(f32, f64, float, double, (double)x)                         \
  X(f32, i32, float, int32_t, f32_i32(x))                       \
  X(f32, i64, float, int64_t, f32_i64(x))                       \
  X(f32, b8, float, uint8_t, x != 0)                            \
  X(f32, f16, float, uint16_t, f32_f16(x))                      \
  X(f32, bf16, float, uint16_t, f32_bf16(x))                    \
  X(f64, f32, double, float, (float)x)                          \
  X(f64, i32, double, int32_t, f64_i32(x))                      \
  X(f64, i64, double, int64_t, f64_i64(x))                      \
  X(f64, b8, double, uint8_t, x != 0)                           \
  X(f64, f16, double, uint16_t, f32_f16(f64_to_f32_odd(x)))              \
  X(f64, bf16, double, uint16_t, f32_bf16(f64_to_f32_odd(x)))            \
  X(i32, f32, int32_t, float, (float)x)                         \
  X(i32, f64, int32_t, double, (double)x)                       \
  X(i32, i64, int32_t, int64_t, (int64_t)x)                     \
  X(i32, b8, int32_t, uint8_t, x != 0)                          \
  X(i32, f16, int32_t, uint16_t, f32_f16(f64_to_f32_odd(x)))             \
  X(i32, bf16, int32_t, uint16_t, f32_bf16(f64_to_f32_odd(x)))           \
  X(i64, f32, int64_t, float, (float)x)                         \
  X(i64, f64, int64_t, double, (double)x)                       \
  X(i64, i32, int64_t, int32_t, (int32_t)(uint32_t)(uint64_t)x) \
  X(i64, b8, int64_t, uint8_t, x != 0)                          \
  X(i64, f16, int64_t, uint16_t, f32_f16(f64_to_f32_odd(i64_f64_odd(x))))             \
  X(i64, bf16, int64_t, uint16_t, f32_bf16(f64_to_f32_odd(i64_f64_odd(x))))           \
  X(b8, f32, uint8_t, float, (float)x)                          \
  X(b8, f64, uint8_t, double, (double)x)                        \
  X(b8, i32, uint8_t, int32_t, (int32_t)x)                      \
  X(b8, i64, uint8_t, int64_t, (int64_t)x)                      \
  X(b8, f16, uint8_t, uint16_t, x ? 0x3c00 : 0)                 \
  X(b8, bf16, uint8_t, uint16_t, x ? 0x3f80 : 0)                \
  X(f16, f32, uint16_t, float, f16_f32(x))                      \
  X(f16, f64, uint16_t, double, (double)f16_f32(x))             \
  X(f16, i32, uint16_t, int32_t, f32_i32(f16_f32(x)))           \
  X(f16, i64, uint16_t, int64_t, f32_i64(f16_f32(x)))           \
  X(f16, b8, uint16_t, uint8_t, (x & 0x7fff) != 0)              \
  X(f16, bf16, uint16_t, uint16_t, f32_bf16(f16_f32(x)))        \
  X(bf16, f32, uint16_t, float, bf16_f32(x))                    \
  X(bf16, f64, uint16_t, double, (double)bf16_f32(x))           \
  X(bf16, i32, uint16_t, int32_t, f32_i32(bf16_f32(x)))         \
  X(bf16, i64, uint16_t, int64_t, f32_i64(bf16_f32(x)))         \
  X(bf16, b8, uint16_t, uint8_t, (x & 0x7fff) != 0)             \
  X(bf16, f16, uint16_t, uint16_t, f32_f16(bf16_f32(x)))

typedef void (*cast_loop)(void *KILN_RESTRICT o, const void *KILN_RESTRICT x, int64_t n);

#define CAST_LOOP(src, dst, TS, TD, expr)                                              \
  static inline TD cv_##src##_##dst(TS x) { return (TD)(expr); }                       \
  KILN_HOT static void cast_##src##_##dst(void *KILN_RESTRICT o_, const void *KILN_RESTRICT x_, \
                                 int64_t n) {                                          \
    TD *KILN_RESTRICT o = o_;                                                          \
    const TS *KILN_RESTRICT x = x_;                                                    \
    for (int64_t i = 0; i < n; i++) o[i] = cv_##src##_##dst(x[i]);                     \
  }

CAST_PAIRS(CAST_LOOP)

#define DT_f32 KILN_F32
#define DT_f64 KILN_F64
#define DT_i32 KILN_I32
#define DT_i64 KILN_I64
#define DT_b8 KILN_BOOL
#define DT_f16 KILN_F16
#define DT_bf16 KILN_BF16
#define CAST_ENTRY(src, dst, TS, TD, expr) [DT_##src][DT_##dst] = cast_##src##_##dst,

static const cast_loop cast_loops[KILN_DTYPE_COUNT][KILN_DTYPE_COUNT] = {CAST_PAIRS(CAST_ENTRY)};

typedef struct {
  cast_loop loop; /* NULL: a copy */
  const char *in;
  char *out;
  size_t isz, osz;
} cast_job;

static void cast_chunk(void *ctx, int64_t begin, int64_t end) {
  const cast_job *j = ctx;
  const char *in = j->in + begin * (int64_t)j->isz;
  char *out = j->out + begin * (int64_t)j->osz;
  if (j->loop)
    j->loop(out, in, end - begin);
  else
    memcpy(out, in, (size_t)(end - begin) * j->isz);
}

/* Keyed by the input dtype; the target is the result's (attrs->dtype). */
static int k_cast(const op_call *c) {
  const kiln_tensor *x = c->in[0];
  kiln_tensor *o = c->out;
  cast_job j = {cast_loops[x->dtype][o->dtype], x->data, o->data, kiln_dtype_sizes[x->dtype],
                kiln_dtype_sizes[o->dtype]};
  if (KILN_LIKELY(o->size <= GRAIN))
    cast_chunk(&j, 0, o->size);
  else
    parallel_for(o->size, GRAIN, cast_chunk, &j);
  return 0;
}

KILN_CONSTRUCTOR static void register_convert_kernels(void) {
  for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++)
    dispatch_register(OP_CONVERT, 0, (kiln_dtype)dt, k_cast);
}
