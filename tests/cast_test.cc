// cast_test.cc — kiln_cast (the CONVERT primitive) between all seven dtypes,
// against hand-computed values: float -> int truncation and saturation, NaN,
// integer narrowing, bool, and the exact f16/bf16 bit patterns (round to
// nearest even, subnormals, overflow to inf), round trips, large and empty
// tensors, and bad inputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_util.h"

using ::testing::StartsWith;

namespace {

using namespace kiln_test;

using Bits = std::vector<uint16_t>;  // raw f16 / bf16

// A 1-D tensor of dtype dt from raw host values of type T.
template <typename T>
kiln_tensor *vec(kiln_dtype dt, const std::vector<T> &data) {
  EXPECT_EQ(kiln_dtype_size(dt), sizeof(T));
  const int64_t n = (int64_t)data.size();
  kiln_tensor *t = kiln_tensor_new(dt, 1, &n, data.data());
  EXPECT_NE(t, nullptr) << kiln_last_error();
  return t;
}

// Casts to dt and reads the result's raw values as T.
template <typename T>
std::vector<T> cast(kiln_tensor *t, kiln_dtype dt) {
  kiln_tensor *r = kiln_cast(t, dt);
  EXPECT_NE(r, nullptr) << kiln_last_error();
  if (!r) return {};
  EXPECT_EQ(kiln_tensor_dtype(r), dt);
  EXPECT_EQ(kiln_tensor_size(r), kiln_tensor_size(t));
  std::vector<T> v(kiln_tensor_size(r));
  EXPECT_EQ(kiln_tensor_read(r, v.data(), v.size() * sizeof(T)), 0) << kiln_last_error();
  return v;
}

float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(Cast, SameDtypeIsACopy) {
  Scoped s;
  std::vector<float> x = {1.5f, kNanF, -0.0f};
  kiln_tensor *t = vec(KILN_F32, x);
  kiln_tensor *r = kiln_cast(t, KILN_F32);
  ASSERT_NE(r, nullptr);
  EXPECT_NE(r, t);
  std::vector<float> v = cast<float>(t, KILN_F32);
  EXPECT_EQ(v[0], 1.5f);
  EXPECT_TRUE(std::isnan(v[1]));
  EXPECT_TRUE(std::signbit(v[2]));
  EXPECT_EQ(cast<int64_t>(vec(KILN_I64, std::vector<int64_t>{INT64_MIN, 3}), KILN_I64),
            (std::vector<int64_t>{INT64_MIN, 3}));
  EXPECT_EQ(cast<uint16_t>(vec(KILN_F16, Bits{0x7E01, 0x8001}), KILN_F16), (Bits{0x7E01, 0x8001}));
  EXPECT_EQ(cast<uint16_t>(vec(KILN_BF16, Bits{0xFFC1, 0x0001}), KILN_BF16), (Bits{0xFFC1, 0x0001}));
  EXPECT_EQ(cast<uint8_t>(vec(KILN_BOOL, std::vector<uint8_t>{1, 0}), KILN_BOOL),
            (std::vector<uint8_t>{1, 0}));
}

TEST(Cast, FloatToIntTruncatesAndSaturates) {
  Scoped s;
  const int32_t mn = INT32_MIN, mx = INT32_MAX;
  std::vector<float> x = {1.9f, -1.9f, 0.5f,          -0.5f,         kNanF,          kInfF,      -kInfF,
                          3e9f, -3e9f, 2147483520.0f, 2147483648.0f, -2147483648.0f, 16777217.0f};
  EXPECT_EQ(cast<int32_t>(vec(KILN_F32, x), KILN_I32),
            (std::vector<int32_t>{1, -1, 0, 0, 0, mx, mn, mx, mn, 2147483520, mx, mn, 16777216}));
  EXPECT_EQ(cast<int64_t>(vec(KILN_F32, x), KILN_I64),
            (std::vector<int64_t>{1, -1, 0, 0, 0, INT64_MAX, INT64_MIN, 3000000000LL, -3000000000LL,
                                  2147483520LL, 2147483648LL, -2147483648LL, 16777216}));
  std::vector<float> big = {9.3e18f, -9.3e18f, 9223371487098961920.0f, 9223372036854775808.0f,
                            -9223372036854775808.0f};
  EXPECT_EQ(cast<int64_t>(vec(KILN_F32, big), KILN_I64),
            (std::vector<int64_t>{INT64_MAX, INT64_MIN, 9223371487098961920LL, INT64_MAX, INT64_MIN}));

  std::vector<double> d = {2147483647.9, 2147483648.0, -2147483648.9, -2147483649.0,
                           -7.99,        kNan,         kInf,          1e300};
  EXPECT_EQ(cast<int32_t>(vec(KILN_F64, d), KILN_I32), (std::vector<int32_t>{mx, mx, mn, mn, -7, 0, mx, mx}));
  std::vector<double> e = {9007199254740993.0,    -1e19, 1e19,  9223372036854774784.0,
                           9223372036854775808.0, kNan,  -kInf, -0.999};
  EXPECT_EQ(cast<int64_t>(vec(KILN_F64, e), KILN_I64),
            (std::vector<int64_t>{9007199254740992LL, INT64_MIN, INT64_MAX, 9223372036854774784LL, INT64_MAX,
                                  0, INT64_MIN, 0}));
}

TEST(Cast, IntToFloatRoundsToNearest) {
  Scoped s;
  // 2^24 + 1 is halfway between two floats: ties to even (2^24); 2^24 + 3 -> 2^24 + 4
  std::vector<float> f =
      cast<float>(vec(KILN_I32, std::vector<int32_t>{16777217, 16777219, -3, INT32_MIN}), KILN_F32);
  EXPECT_EQ(f, (std::vector<float>{16777216.0f, 16777220.0f, -3.0f, -2147483648.0f}));
  std::vector<double> d =
      cast<double>(vec(KILN_I64, std::vector<int64_t>{9007199254740993LL, INT64_MAX, -5}), KILN_F64);
  EXPECT_EQ(d, (std::vector<double>{9007199254740992.0, 9223372036854775808.0, -5.0}));
  std::vector<float> g =
      cast<float>(vec(KILN_I64, std::vector<int64_t>{INT64_MIN, 1LL << 40, 33554435}), KILN_F32);
  EXPECT_EQ(g, (std::vector<float>{-9223372036854775808.0f, 1099511627776.0f, 33554436.0f}));
  EXPECT_EQ(cast<double>(vec(KILN_I32, std::vector<int32_t>{INT32_MAX, -1}), KILN_F64),
            (std::vector<double>{2147483647.0, -1.0}));
}

TEST(Cast, BetweenFloats) {
  Scoped s;
  std::vector<double> d = cast<double>(vec(KILN_F32, std::vector<float>{0.1f, kInfF, -0.0f}), KILN_F64);
  EXPECT_EQ(d[0], 0.100000001490116119384765625);  // the f32 nearest 0.1, exactly
  EXPECT_EQ(d[1], kInf);
  EXPECT_TRUE(std::signbit(d[2]));
  std::vector<float> f =
      cast<float>(vec(KILN_F64, std::vector<double>{0.1, 1e39, -1e39, 1e-46, kNan}), KILN_F32);
  EXPECT_EQ(f[0], 0.1f);
  EXPECT_EQ(f[1], kInfF);
  EXPECT_EQ(f[2], -kInfF);
  EXPECT_EQ(f[3], 0.0f);
  EXPECT_TRUE(std::isnan(f[4]));
}

TEST(Cast, IntegerNarrowingWraps) {
  Scoped s;
  std::vector<int64_t> x = {4294967297LL, -1, 2147483648LL, -2147483649LL, 123};
  EXPECT_EQ(cast<int32_t>(vec(KILN_I64, x), KILN_I32),
            (std::vector<int32_t>{1, -1, INT32_MIN, INT32_MAX, 123}));
  EXPECT_EQ(cast<int64_t>(vec(KILN_I32, std::vector<int32_t>{INT32_MIN, -1, 7}), KILN_I64),
            (std::vector<int64_t>{-2147483648LL, -1, 7}));
}

TEST(Cast, ToAndFromBool) {
  Scoped s;
  using B = std::vector<uint8_t>;
  EXPECT_EQ(
      cast<uint8_t>(vec(KILN_F32, std::vector<float>{0.0f, -0.0f, 0.5f, kNanF, -kInfF, 1e-45f}), KILN_BOOL),
      (B{0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(cast<uint8_t>(vec(KILN_F64, std::vector<double>{0.0, 1e-300, -2.0}), KILN_BOOL), (B{0, 1, 1}));
  EXPECT_EQ(cast<uint8_t>(vec(KILN_I32, std::vector<int32_t>{0, 5, -1, INT32_MIN}), KILN_BOOL),
            (B{0, 1, 1, 1}));
  EXPECT_EQ(cast<uint8_t>(vec(KILN_I64, std::vector<int64_t>{1LL << 40, 0}), KILN_BOOL), (B{1, 0}));
  // f16/bf16: any bits but the sign make it true (subnormals and NaN included)
  EXPECT_EQ(cast<uint8_t>(vec(KILN_F16, Bits{0x0000, 0x8000, 0x0001, 0x7E00, 0xBC00}), KILN_BOOL),
            (B{0, 0, 1, 1, 1}));
  EXPECT_EQ(cast<uint8_t>(vec(KILN_BF16, Bits{0x8000, 0x0001, 0x3F80}), KILN_BOOL), (B{0, 1, 1}));

  kiln_tensor *b = vec(KILN_BOOL, B{0, 1});
  EXPECT_EQ(cast<float>(b, KILN_F32), (std::vector<float>{0.0f, 1.0f}));
  EXPECT_EQ(cast<double>(b, KILN_F64), (std::vector<double>{0.0, 1.0}));
  EXPECT_EQ(cast<int32_t>(b, KILN_I32), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(cast<int64_t>(b, KILN_I64), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(cast<uint16_t>(b, KILN_F16), (Bits{0x0000, 0x3C00}));
  EXPECT_EQ(cast<uint16_t>(b, KILN_BF16), (Bits{0x0000, 0x3F80}));
}

TEST(Cast, F32ToF16) {
  Scoped s;
  std::vector<float> x = {
      1.0f,          0.1f, 65504.0f, 65519.99f, 65520.0f, -2.0f, kInfF, -kInfF, kNanF, 0.0f, -0.0f,
      0x1p-24f,       // the smallest subnormal
      0x1p-25f,       // a tie between 0 and 2^-24 -> 0 (even)
      0x1.8p-25f,     // 1.5 * 2^-25 -> 2^-24
      0x1.8p-24f,     // 1.5 * 2^-24: a tie -> 2 * 2^-24 (even)
      0x1p-14f,       // the smallest normal
      0x1.ff8p-15f,   // the largest subnormal, 1023 * 2^-24
      0x1.002p0f,     // 1 + 2^-11: a tie -> 1 (even)
      0x1.006p0f,     // 1 + 3 * 2^-11: a tie -> 1 + 2^-9 (even)
      0x1.002002p0f,  // just above 1 + 2^-11 -> 1 + 2^-10
      -0.333333333f,
      1e-10f,  // underflows to 0
      -1e10f,
  };
  Bits want = {0x3C00, 0x2E66, 0x7BFF, 0x7BFF, 0x7C00, 0xC000, 0x7C00, 0xFC00, 0x7E00, 0x0000, 0x8000, 0x0001,
               0x0000, 0x0001, 0x0002, 0x0400, 0x03FF, 0x3C00, 0x3C02, 0x3C01, 0xB555, 0x0000, 0xFC00};
  EXPECT_EQ(cast<uint16_t>(vec(KILN_F32, x), KILN_F16), want);
}

TEST(Cast, F16ToF32) {
  Scoped s;
  Bits h = {0x3C00, 0x2E66, 0x7BFF, 0x0001, 0x03FF, 0x0400, 0x8000, 0x7C00, 0xFC00, 0xC000, 0x3555, 0x8001};
  std::vector<float> f = cast<float>(vec(KILN_F16, h), KILN_F32);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], 0.0999755859375f);
  EXPECT_EQ(f[2], 65504.0f);
  EXPECT_EQ(f[3], 5.9604644775390625e-08f);
  EXPECT_EQ(f[4], 6.097555160522461e-05f);
  EXPECT_EQ(f[5], 6.103515625e-05f);
  EXPECT_EQ(f[6], 0.0f);
  EXPECT_TRUE(std::signbit(f[6]));
  EXPECT_EQ(f[7], kInfF);
  EXPECT_EQ(f[8], -kInfF);
  EXPECT_EQ(f[9], -2.0f);
  EXPECT_EQ(f[10], 0.333251953125f);
  EXPECT_EQ(f[11], -5.9604644775390625e-08f);
  std::vector<float> n = cast<float>(vec(KILN_F16, Bits{0x7E00, 0xFC01}), KILN_F32);
  EXPECT_TRUE(std::isnan(n[0]));
  EXPECT_TRUE(std::isnan(n[1]));
  // f16 -> f64 is exact too
  std::vector<double> d = cast<double>(vec(KILN_F16, Bits{0x2E66, 0x0001}), KILN_F64);
  EXPECT_EQ(d[0], 0.0999755859375);
  EXPECT_EQ(d[1], 5.9604644775390625e-08);
}

TEST(Cast, F32ToBf16) {
  Scoped s;
  std::vector<float> x = {1.0f,
                          0.1f,  // 0x3DCCCCCD: the lower half 0xCCCD rounds up
                          3.0f,
                          -1.0f,
                          f32_from_bits(0x3F808000),  // 1 + 2^-8: a tie -> 1 (even)
                          f32_from_bits(0x3F818000),  // a tie -> 0x3F82 (even)
                          f32_from_bits(0x3F808001),  // just above the tie -> up
                          kInfF,
                          -kInfF,
                          3.4028235e38f,  // FLT_MAX rounds to inf
                          -0.0f,
                          f32_from_bits(0x00000001),  // the smallest f32 subnormal -> 0
                          3.14159265f};
  Bits want = {0x3F80, 0x3DCD, 0x4040, 0xBF80, 0x3F80, 0x3F82, 0x3F81,
               0x7F80, 0xFF80, 0x7F80, 0x8000, 0x0000, 0x4049};
  EXPECT_EQ(cast<uint16_t>(vec(KILN_F32, x), KILN_BF16), want);
  Bits nan = cast<uint16_t>(vec(KILN_F32, std::vector<float>{kNanF, f32_from_bits(0x7F800001)}), KILN_BF16);
  for (uint16_t b : nan)
    EXPECT_TRUE((b & 0x7F80) == 0x7F80 && (b & 0x007F) != 0) << std::hex << b;  // still NaN
}

TEST(Cast, Bf16ToF32) {
  Scoped s;
  std::vector<float> f =
      cast<float>(vec(KILN_BF16, Bits{0x3F80, 0x4049, 0xC000, 0x0001, 0x7F80, 0x8000}), KILN_F32);
  EXPECT_EQ(f[0], 1.0f);
  EXPECT_EQ(f[1], 3.140625f);
  EXPECT_EQ(f[2], -2.0f);
  EXPECT_EQ(f[3], f32_from_bits(0x00010000));  // a subnormal, 2^-133
  EXPECT_EQ(f[4], kInfF);
  EXPECT_TRUE(std::signbit(f[5]));
  EXPECT_TRUE(std::isnan(cast<float>(vec(KILN_BF16, Bits{0x7FC0}), KILN_F32)[0]));
}

TEST(Cast, HalfToAndFromOtherDtypes) {
  Scoped s;
  // f16 <-> bf16 through f32
  EXPECT_EQ(cast<uint16_t>(vec(KILN_F16, Bits{0x3C00, 0x2E66, 0x7C00, 0x0001}), KILN_BF16),
            (Bits{0x3F80, 0x3DCD, 0x7F80, 0x3380}));  // 0.0999755859375 -> 0x3DCCC000 -> 0x3DCD
  EXPECT_EQ(cast<uint16_t>(vec(KILN_BF16, Bits{0x3F80, 0x4780, 0x477F, 0x3380}), KILN_F16),
            (Bits{0x3C00, 0x7C00, 0x7BF8, 0x0001}));  // 65536 -> inf; 65280 fits
  // f64 -> f16/bf16 (through f32)
  EXPECT_EQ(cast<uint16_t>(vec(KILN_F64, std::vector<double>{0.1, 1e6, -0.5}), KILN_F16),
            (Bits{0x2E66, 0x7C00, 0xB800}));
  EXPECT_EQ(cast<uint16_t>(vec(KILN_F64, std::vector<double>{0.1, 1e6}), KILN_BF16), (Bits{0x3DCD, 0x4974}));
  // integers -> f16: 2049 is a tie between 2048 and 2050 -> 2048 (even); 70000 overflows
  EXPECT_EQ(cast<uint16_t>(vec(KILN_I32, std::vector<int32_t>{2049, 2051, 70000, -1}), KILN_F16),
            (Bits{0x6800, 0x6802, 0x7C00, 0xBC00}));
  EXPECT_EQ(cast<uint16_t>(vec(KILN_I64, std::vector<int64_t>{1, 1LL << 40}), KILN_BF16),
            (Bits{0x3F80, 0x5380}));
  EXPECT_EQ(cast<uint16_t>(vec(KILN_I64, std::vector<int64_t>{-65504, 3}), KILN_F16), (Bits{0xFBFF, 0x4200}));
  EXPECT_EQ(cast<uint16_t>(vec(KILN_I32, std::vector<int32_t>{257}), KILN_BF16),
            (Bits{0x4380}));  // 257 -> 256
  // f16/bf16 -> integers: truncate, NaN -> 0, saturate
  EXPECT_EQ(cast<int32_t>(vec(KILN_F16, Bits{0x7BFF, 0xFC00, 0x7E00, 0x3E00, 0xBE00}), KILN_I32),
            (std::vector<int32_t>{65504, INT32_MIN, 0, 1, -1}));
  EXPECT_EQ(cast<int64_t>(vec(KILN_F16, Bits{0x7C00, 0xD640}), KILN_I64),
            (std::vector<int64_t>{INT64_MAX, -100}));
  EXPECT_EQ(cast<int32_t>(vec(KILN_BF16, Bits{0x4F80, 0xCF00, 0x42F7}), KILN_I32),  // 2^32, -2^31, 123.5
            (std::vector<int32_t>{INT32_MAX, INT32_MIN, 123}));
  EXPECT_EQ(cast<int64_t>(vec(KILN_BF16, Bits{0x5F80, 0x7FC0}), KILN_I64),
            (std::vector<int64_t>{INT64_MAX, 0}));
  EXPECT_EQ(cast<double>(vec(KILN_BF16, Bits{0x4049}), KILN_F64), (std::vector<double>{3.140625}));
}

// Every finite and infinite f16 (and bf16) survives a trip through f32.
TEST(Cast, HalfRoundTripsThroughF32) {
  Scoped s;
  for (kiln_dtype dt : {KILN_F16, KILN_BF16}) {
    Bits all;
    for (uint32_t i = 0; i < 65536; i++) {
      uint16_t h = (uint16_t)i;
      bool nan =
          dt == KILN_F16 ? (h & 0x7C00) == 0x7C00 && (h & 0x03FF) : (h & 0x7F80) == 0x7F80 && (h & 0x007F);
      if (!nan) all.push_back(h);
    }
    kiln_tensor *f = kiln_cast(vec(dt, all), KILN_F32);
    EXPECT_EQ(cast<uint16_t>(f, dt), all) << kiln_dtype_name(dt);
    // and through f64
    EXPECT_EQ(cast<uint16_t>(kiln_cast(f, KILN_F64), dt), all) << kiln_dtype_name(dt);
  }
}

TEST(Cast, LargeTensors) {
  Scoped s;
  const int64_t n = 300000;
  kiln_tensor *i = kiln_arange(KILN_I32, n);
  std::vector<float> f = cast<float>(i, KILN_F32);
  ASSERT_EQ((int64_t)f.size(), n);
  double sum = 0;
  for (float v : f) sum += v;
  EXPECT_EQ(sum, (double)(n - 1) * n / 2);
  EXPECT_EQ(f[299999], 299999.0f);
  // f32 -> f16 -> f32 on the parallel path: 2049 -> 2048, 4097 -> 4096
  std::vector<float> h = cast<float>(kiln_cast(kiln_cast(i, KILN_F32), KILN_F16), KILN_F32);
  EXPECT_EQ(h[2048], 2048.0f);
  EXPECT_EQ(h[2049], 2048.0f);
  EXPECT_EQ(h[4097], 4096.0f);
  EXPECT_EQ(h[70000], kInfF);
  // i32 -> bool and -> i64
  std::vector<uint8_t> b = cast<uint8_t>(i, KILN_BOOL);
  EXPECT_EQ(b[0], 0);
  EXPECT_EQ(b[n - 1], 1);
  std::vector<int64_t> w = cast<int64_t>(i, KILN_I64);
  EXPECT_EQ(w[123456], 123456);
  // the same-dtype copy, large
  std::vector<int32_t> c = cast<int32_t>(i, KILN_I32);
  EXPECT_EQ(c[n - 1], n - 1);
}

TEST(Cast, ShapesKeptAndEmpty) {
  Scoped s;
  kiln_tensor *m = kiln_ones(KILN_F32, KILN_SHAPE(2, 3));
  kiln_tensor *r = kiln_cast(m, KILN_I64);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(kiln_tensor_rank(r), 2);
  EXPECT_EQ(kiln_tensor_shape(r)[1], 3);
  kiln_tensor *sc = kiln_cast(kiln_scalar(KILN_F64, -2.75), KILN_I32);
  EXPECT_EQ(kiln_tensor_rank(sc), 0);
  EXPECT_EQ(kiln_tensor_item(sc), -2.0);
  for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {
    for (int to = 0; to < KILN_DTYPE_COUNT; to++) {
      kiln_tensor *e = kiln_cast(kiln_zeros((kiln_dtype)dt, KILN_SHAPE(0, 4)), (kiln_dtype)to);
      ASSERT_NE(e, nullptr) << kiln_last_error();
      EXPECT_EQ(kiln_tensor_size(e), 0);
      EXPECT_EQ(kiln_tensor_shape(e)[1], 4);
    }
  }
}

// Every pair of dtypes converts 0 and 1 (1 is 0x3C00 in f16, 0x3F80 in bf16).
TEST(Cast, AllPairsZeroAndOne) {
  Scoped s;
  for (int from = 0; from < KILN_DTYPE_COUNT; from++) {
    kiln_tensor *zero = kiln_zeros((kiln_dtype)from, KILN_SHAPE(1));
    kiln_tensor *one = kiln_ones((kiln_dtype)from, KILN_SHAPE(1));
    for (int to = 0; to < KILN_DTYPE_COUNT; to++) {
      const char *f = kiln_dtype_name((kiln_dtype)from), *t = kiln_dtype_name((kiln_dtype)to);
      kiln_tensor *z = kiln_cast(zero, (kiln_dtype)to), *o = kiln_cast(one, (kiln_dtype)to);
      ASSERT_NE(z, nullptr) << kiln_last_error();
      ASSERT_NE(o, nullptr) << kiln_last_error();
      EXPECT_EQ(kiln_tensor_dtype(o), (kiln_dtype)to);
      EXPECT_EQ(kiln_tensor_item(z), 0.0) << f << " -> " << t;
      EXPECT_EQ(kiln_tensor_item(o), 1.0) << f << " -> " << t;
    }
  }
}

// ---- f64 and the integers to f16/bf16: rounded once ----
// The exact reference: x (a long double holds every f64 and i64 exactly)
// rounded to nearest even at the target's precision, straight to its bits.
struct Half {
  int man_bits, emin, emax;  // f16: 10, -14, 15; bf16: 7, -126, 127
};
const Half kF16 = {10, -14, 15}, kBf16 = {7, -126, 127};

uint16_t exact_half(long double x, const Half &h) {
  int bias = h.emax, exp_shift = h.man_bits;
  uint16_t sign = std::signbit(x) ? (uint16_t)(1u << 15) : 0, inf = (uint16_t)(((2 * bias + 1) << exp_shift));
  if (std::isnan(x)) return (uint16_t)(sign | inf | (1u << (exp_shift - 1)));
  long double a = std::fabs(x);
  if (std::isinf(a)) return (uint16_t)(sign | inf);
  if (a == 0) return sign;
  int e = std::max(std::ilogb(a), h.emin);
  long double q = std::ldexp(1.0L, e - h.man_bits);  // the spacing of the target's values near x
  long double n = std::nearbyint(a / q);              // exact scaling; ties to even
  long double r = n * q;
  if (r >= std::ldexp(1.0L, h.emax + 1)) return (uint16_t)(sign | inf);
  int re = std::ilogb(r);
  if (re < h.emin) return (uint16_t)(sign | (uint16_t)std::ldexp(r, h.man_bits - h.emin));  // subnormal
  uint32_t man = (uint32_t)(std::ldexp(r, h.man_bits - re) - std::ldexp(1.0L, h.man_bits));
  return (uint16_t)(sign | (uint32_t)(re + bias) << exp_shift | man);
}

bool same_half(uint16_t got, uint16_t want, const Half &h) {
  uint16_t inf = (uint16_t)((2 * h.emax + 1) << h.man_bits);
  bool nan_w = (want & 0x7fff) > inf, nan_g = (got & 0x7fff) > inf;
  return nan_w ? nan_g : got == want;
}

// Doubles around the rounding points of the target: every kind of edge the
// f32 detour got wrong (just off a tie, just below the overflow point), ties,
// subnormals, overflow, zeros, NaN and infinities, plus random ones.
std::vector<double> half_edge_cases(const Half &h) {
  std::vector<double> v = {2049.0000000000005, 2049.0, 2051.0, 2049.0 - 0x1p-42, -2049.0000000000005,
                           0.0, -0.0, kNan, -kNan, kInf, -kInf, 1e300, -1e300, 1e-300, -1e-300,
                           0x1p-24, 0x1p-25, 0x1p-25 + 0x1p-60, 0x1p-25 - 0x1p-60, 0x1.8p-24, 0x1.8p-24 + 0x1p-70,
                           0x1p-133, 0x1p-134, 0x1p-134 + 0x1p-170, 0x1.8p-133, 0x1p-126, 0x1.fcp-127,
                           65504.0, 65519.99999999999, 65520.0, 65520.00000000001, 65536.0,
                           0x1.fep127, 0x1.ffp127 - 0x1p80, 0x1.ffp127, 0x1.ffp127 + 0x1p80, 3.5e38, 1.0 / 3};
  std::mt19937_64 g(1401);
  int top = h.emax + 1, bottom = h.emin - h.man_bits - 1;
  std::uniform_int_distribution<int> ex(bottom, top);
  std::uniform_int_distribution<int> man(0, (1 << h.man_bits) - 1), off(-3, 3), tail(1, 40);
  for (int i = 0; i < 20000; i++) {
    // a tie between two neighbours of the target, moved by a few f64 ulps or 2^-tail of its spacing
    int e = ex(g);
    double q = std::ldexp(1.0, e - h.man_bits);
    double tie = std::ldexp(1.0, e) + (man(g) + 0.5) * q;
    double x = i % 2 ? tie + off(g) * tie * 0x1p-52 : tie + (off(g) < 0 ? -1 : 1) * q * std::ldexp(1.0, -tail(g));
    v.push_back(i % 3 ? x : -x);
  }
  return v;
}

int cast_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_cast(in[0], *static_cast<kiln_dtype *>(user));
  return out[0] ? 0 : -1;
}

// KILN_BACKEND for the traces compiled while it lives
struct BackendEnv : EnvGuard {
  explicit BackendEnv(const char *v) : EnvGuard("KILN_BACKEND", v) {}
};

// The cast of x to dt eagerly, then staged compiled and interpreted.
std::vector<std::vector<uint16_t>> cast_three_ways(kiln_tensor *x, kiln_dtype dt) {
  std::vector<std::vector<uint16_t>> out;
  out.push_back(cast<uint16_t>(x, dt));
  for (const char *backend : {"cpu", "interp"}) {
    BackendEnv env(backend);
    kiln_function *f = kiln_function_new("cast_half", cast_body, &dt, 1, 1);
    kiln_tensor *r = nullptr;
    EXPECT_EQ(kiln_function_call(f, &x, &r), 0) << backend << ": " << kiln_last_error();
    out.push_back(r ? read<uint16_t>(r) : std::vector<uint16_t>{});
    kiln_function_free(f);
  }
  return out;
}

void expect_rounded_once(kiln_tensor *x, const std::vector<long double> &exact, kiln_dtype dt, const char *what) {
  const Half &h = dt == KILN_F16 ? kF16 : kBf16;
  std::vector<std::vector<uint16_t>> got = cast_three_ways(x, dt);
  const char *way[] = {"eager", "compiled", "interpreted"};
  for (int w = 0; w < 3; w++) {
    ASSERT_EQ(got[(size_t)w].size(), exact.size()) << way[w];
    int bad = 0;
    for (size_t i = 0; i < exact.size() && bad < 5; i++) {
      uint16_t want = exact_half(exact[i], h);
      if (same_half(got[(size_t)w][i], want, h)) continue;
      bad++;
      ADD_FAILURE() << what << " -> " << kiln_dtype_name(dt) << ", " << way[w] << ": element " << i << " = "
                    << std::hexfloat << (double)exact[i] << " gave 0x" << std::hex << got[(size_t)w][i]
                    << ", rounding once gives 0x" << want;
    }
  }
}

TEST(Cast, F64ToHalfRoundsOnce) {
  Scoped s;
  for (kiln_dtype dt : {KILN_F16, KILN_BF16}) {
    std::vector<double> v = half_edge_cases(dt == KILN_F16 ? kF16 : kBf16);
    expect_rounded_once(vec(KILN_F64, v), std::vector<long double>(v.begin(), v.end()), dt, "f64");
  }
  // the case, literally: NumPy's float16(2049.0000000000005) is 2050
  kiln_tensor *x = kiln_scalar(KILN_F64, 2049.0000000000005);
  uint16_t h = 0;
  ASSERT_EQ(kiln_tensor_read(kiln_cast(x, KILN_F16), &h, 2), 0);
  EXPECT_EQ(h, 0x6801);
  EXPECT_EQ(kiln_tensor_item(kiln_cast(x, KILN_F16)), 2050.0);
  // kiln_fill/kiln_scalar of a half dtype round a double the same way
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_F16, 2049.0000000000005)), 2050.0);
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_F16, 65519.99999999999)), 65504.0);
}

TEST(Cast, IntegersToHalfRoundOnce) {
  Scoped s;
  std::mt19937_64 g(7);
  std::vector<int64_t> v64 = {0, 1, -1, 2049, 2051, 65504, 65519, 65520, 65535, 1 << 24, (1 << 24) + (1 << 16) + 1,
                              -((1 << 24) + (1 << 16) + 1), INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN, INT64_MAX - 1,
                              (int64_t)1 << 53, ((int64_t)1 << 56) + ((int64_t)1 << 48) + 1,
                              ((int64_t)1 << 62) + ((int64_t)1 << 54) + 1, -(((int64_t)1 << 62) + ((int64_t)1 << 54) + 1)};
  for (int i = 0; i < 5000; i++) {  // ties of bf16 at every magnitude, a little off
    int e = (int)(g() % 55) + 8;  // 8..62: the tie, 2^e and a bit more, stays below 2^63
    int64_t tie = ((int64_t)1 << e) + ((int64_t)(g() % 128) << (e - 7)) + ((int64_t)1 << (e - 8));
    int64_t off = (int64_t)(g() % 5) - 2;
    v64.push_back(i % 2 ? tie + off : -(tie + off));
  }
  std::vector<int32_t> v32;
  for (int64_t x : v64)
    if (x >= INT32_MIN && x <= INT32_MAX) v32.push_back((int32_t)x);
  for (kiln_dtype dt : {KILN_F16, KILN_BF16}) {
    expect_rounded_once(vec(KILN_I64, v64), std::vector<long double>(v64.begin(), v64.end()), dt, "i64");
    expect_rounded_once(vec(KILN_I32, v32), std::vector<long double>(v32.begin(), v32.end()), dt, "i32");
  }
}

// The reference itself, on values it must get right.
TEST(Cast, ExactHalfReference) {
  EXPECT_EQ(exact_half(1.0L, kF16), 0x3C00);
  EXPECT_EQ(exact_half(65504.0L, kF16), 0x7BFF);
  EXPECT_EQ(exact_half(65520.0L, kF16), 0x7C00);
  EXPECT_EQ(exact_half(0x1p-24L, kF16), 0x0001);
  EXPECT_EQ(exact_half(0x1p-25L, kF16), 0x0000);
  EXPECT_EQ(exact_half(-0.0L, kF16), 0x8000);
  EXPECT_EQ(exact_half(2050.0L, kF16), 0x6801);
  EXPECT_EQ(exact_half(1.0L, kBf16), 0x3F80);
  EXPECT_EQ(exact_half(0x1p-133L, kBf16), 0x0001);
  EXPECT_EQ(exact_half(0x1.fep127L, kBf16), 0x7F7F);
  EXPECT_EQ(exact_half(0x1.ffp127L, kBf16), 0x7F80);
}

TEST(Cast, BadInputs) {
  Scoped s;
  EXPECT_EQ(kiln_cast(nullptr, KILN_F32), nullptr);
  EXPECT_STREQ(kiln_last_error(), "cast: input 0 is NULL");
  kiln_clear_error();
  kiln_tensor *t = kiln_ones(KILN_F32, KILN_SHAPE(2));
  EXPECT_EQ(kiln_cast(t, (kiln_dtype)42), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("cast: invalid dtype 42"));
  kiln_clear_error();
  EXPECT_EQ(kiln_cast(t, (kiln_dtype)-1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("cast: invalid dtype -1"));
}

}  // namespace
