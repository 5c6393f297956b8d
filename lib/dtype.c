/* dtype.c — element sizes and names, half-precision conversions, and
 * element access by dtype for the slow, generic paths (printing, item,
 * cast of f16/bf16). */
#include <math.h>

#include "runtime.h"
#include "round_odd.h"

const uint8_t kiln_dtype_sizes[KILN_DTYPE_COUNT] = {4, 8, 4, 8, 1, 2, 2};
static const char *const dtype_names[KILN_DTYPE_COUNT] = {"f32",  "f64", "i32", "i64",
                                                          "bool", "f16", "bf16"};

const char *kiln_dtype_name(kiln_dtype dt) { return dtype_valid(dt) ? dtype_names[dt] : "?"; }

size_t kiln_dtype_size(kiln_dtype dt) { return dtype_valid(dt) ? kiln_dtype_sizes[dt] : 0; }

float kiln_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_f32(sign | 0x7f800000u | (man << 13)); /* inf, nan */
  if (exp == 0) {                                                     /* zero, subnormal */
    float v = ldexpf((float)man, -24);
    return sign ? -v : v;
  }
  return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

uint16_t kiln_f32_to_f16(float f) {
  uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000;
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (a > 0x7f800000u ? 0x200 : 0));
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds past 65504: inf */
  if (a < 0x38800000u) {                                  /* below 2^-14: subnormal or zero */
    float v = bits_f32(a) * 16777216.0f;                  /* in units of 2^-24 */
    return (uint16_t)(sign | (uint32_t)nearbyintf(v));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1); /* round to nearest even */
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

float kiln_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kiln_f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet nan */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

double dtype_load(kiln_dtype dt, const void *data, int64_t i) {
  switch (dt) {
    case KILN_F32: return ((const float *)data)[i];
    case KILN_F64: return ((const double *)data)[i];
    case KILN_I32: return ((const int32_t *)data)[i];
    case KILN_I64: return (double)((const int64_t *)data)[i];
    case KILN_BOOL: return ((const uint8_t *)data)[i] != 0;
    case KILN_F16: return kiln_f16_to_f32(((const uint16_t *)data)[i]);
    case KILN_BF16: return kiln_bf16_to_f32(((const uint16_t *)data)[i]);
  }
  return 0;
}

/* float -> integer as kiln_cast does: truncate, NaN -> 0, saturate */
static int64_t sat_i64(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

static int32_t sat_i32(double v) {
  if (v != v) return 0;
  if (v >= 2147483647.0) return INT32_MAX;
  if (v <= -2147483648.0) return INT32_MIN;
  return (int32_t)v;
}

void dtype_store(kiln_dtype dt, void *data, int64_t i, double v) {
  switch (dt) {
    case KILN_F32: ((float *)data)[i] = (float)v; break;
    case KILN_F64: ((double *)data)[i] = v; break;
    case KILN_I32: ((int32_t *)data)[i] = sat_i32(v); break;
    case KILN_I64: ((int64_t *)data)[i] = sat_i64(v); break;
    case KILN_BOOL: ((uint8_t *)data)[i] = v != 0; break;
    case KILN_F16: ((uint16_t *)data)[i] = kiln_f32_to_f16(f64_to_f32_odd(v)); break;
    case KILN_BF16: ((uint16_t *)data)[i] = kiln_f32_to_bf16(f64_to_f32_odd(v)); break;
  }
}
