/* round_odd.h — f64 -> f32 rounded to odd, the first step of every
 * conversion to f16/bf16 that does not start from f32 (kernels_convert.c,
 * dtype_store), so that the value is rounded once. Internal. */
#ifndef KILN_ROUND_ODD_H
#define KILN_ROUND_ODD_H

#include "runtime.h"

/* x rounded to f32 toward the odd neighbour where it is inexact ("round to
 * odd"): then rounding that to f16 or bf16 (fewer than 23 bits) to nearest
 * even gives what rounding x once would, with no double rounding (2049 +
 * 2^-42 goes to f16 2050, not 2048 through f32). Branch-free; NaN stays NaN. */
static inline float f64_to_f32_odd(double x) {
  float f = (float)x;
  double back = (double)f;
  uint32_t inexact = back != x && x == x, away = (back < 0 ? -back : back) > (x < 0 ? -x : x);
  return bits_f32((f32_bits(f) - away) | inexact); /* truncate toward 0, then make it odd */
}
#endif
