// random_test.cc — the counter-based generator: Philox-4x32-10 against
// Random123's known answers, the documented block layout (so results do
// not depend on threads), reproducibility and state, the statistics of
// uniform and normal draws, and bad inputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "test_util.h"

// The general Philox block (full 128-bit counter), a test hook exported by
// lib/random.c.
extern "C" void kiln_debug_philox4x32(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

// Block `counter` of the stream keyed by seed, as runtime.h lays it out.
void block(uint64_t seed, uint64_t counter, uint32_t w[4]) {
  const uint32_t ctr[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), 0, 0};
  const uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
  kiln_debug_philox4x32(ctr, key, w);
}

// The 64-bit value of element i of a draw starting at block c0.
uint64_t element_bits(uint64_t seed, uint64_t c0, int64_t i) {
  uint32_t w[4];
  block(seed, c0 + (uint64_t)i / 2, w);
  return i % 2 == 0 ? (uint64_t)w[0] | (uint64_t)w[1] << 32 : (uint64_t)w[2] | (uint64_t)w[3] << 32;
}

// ---- Philox known answers (Random123 kat_vectors, philox4x32_10) ----

TEST(Random, PhiloxKnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], want[4];
  } kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat &k : kats) {
    uint32_t out[4];
    kiln_debug_philox4x32(k.ctr, k.key, out);
    for (int i = 0; i < 4; i++) EXPECT_EQ(out[i], k.want[i]) << "word " << i;
  }
}

// ---- the stream ----

TEST(Random, SameSeedSameNumbers) {
  Scoped s;
  kiln_random_seed(42);
  auto a = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(3, 5), 0, 1));
  auto a2 = read<float>(kiln_random_normal(KILN_F32, KILN_SHAPE(7)));
  kiln_random_seed(42);
  auto b = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(3, 5), 0, 1));
  auto b2 = read<float>(kiln_random_normal(KILN_F32, KILN_SHAPE(7)));
  EXPECT_EQ(a, b);
  EXPECT_EQ(a2, b2);
  kiln_random_seed(43);
  EXPECT_NE(read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(3, 5), 0, 1)), a);
}

TEST(Random, ConsecutiveDrawsDiffer) {
  Scoped s;
  kiln_random_seed(1);
  auto a = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(4), 0, 1));
  auto b = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(4), 0, 1));
  EXPECT_NE(a, b);
  for (double x : a)
    for (double y : b) EXPECT_NE(x, y);
}

TEST(Random, StateAdvancesByBlocksAndRoundTrips) {
  Scoped s;
  kiln_random_seed(7);
  uint64_t seed = 0, counter = 99;
  kiln_random_get_state(&seed, &counter);
  EXPECT_EQ(seed, 7u);
  EXPECT_EQ(counter, 0u);
  kiln_random_uniform(KILN_F32, KILN_SHAPE(5), 0, 1);  // 5 elements: 3 blocks
  kiln_random_get_state(&seed, &counter);
  EXPECT_EQ(counter, 3u);
  kiln_random_normal(KILN_F64, KILN_SHAPE(2, 2));  // 2 blocks
  kiln_random_get_state(nullptr, &counter);
  EXPECT_EQ(counter, 5u);
  kiln_random_uniform(KILN_F32, KILN_SHAPE(0, 9), 0, 1);  // nothing drawn
  kiln_random_get_state(&seed, nullptr);
  kiln_random_get_state(nullptr, &counter);
  EXPECT_EQ(seed, 7u);
  EXPECT_EQ(counter, 5u);

  auto a = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(6), -1, 1));
  kiln_random_set_state(7, 5);
  EXPECT_EQ(read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(6), -1, 1)), a);
  kiln_random_get_state(&seed, &counter);
  EXPECT_EQ(counter, 8u);
  // reseeding resets the counter
  kiln_random_seed(7);
  kiln_random_get_state(&seed, &counter);
  EXPECT_EQ(counter, 0u);
}

TEST(Random, ScalarDraw) {
  Scoped s;
  kiln_random_set_state(5, 100);
  kiln_tensor *t = kiln_random_uniform(KILN_F64, 0, nullptr, 0, 1);
  ASSERT_NE(t, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_rank(t), 0);
  EXPECT_EQ(kiln_tensor_item(t), (double)(element_bits(5, 100, 0) >> 11) * 0x1p-53);
  uint64_t counter;
  kiln_random_get_state(nullptr, &counter);
  EXPECT_EQ(counter, 101u);
}

// ---- the documented layout: a big draw (split over threads) equals the
// numbers computed element by element from the Philox blocks ----

TEST(Random, UniformF64MatchesBlockLayout) {
  Scoped s;
  // c0 + n/2 carries into word 1 of the counter
  const uint64_t seed = 0x0123456789abcdefull, c0 = 0xfffffffffff0ull;
  kiln_random_set_state(seed, c0);
  const int64_t n = 1000001;  // odd: the last block is half used
  auto got = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(n), 0, 1));
  ASSERT_EQ((int64_t)got.size(), n);
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; i++)
    if (got[i] != (double)(element_bits(seed, c0, i) >> 11) * 0x1p-53) bad = i;
  EXPECT_EQ(bad, -1) << "first mismatch at element " << bad;
  uint64_t counter;
  kiln_random_get_state(nullptr, &counter);
  EXPECT_EQ(counter, c0 + (uint64_t)(n + 1) / 2);
}

TEST(Random, UniformF32AndIntegersMatchBlockLayout) {
  Scoped s;
  const uint64_t seed = 99;
  kiln_random_set_state(seed, 1000);
  const int64_t n = 300001;
  auto f = read<float>(kiln_random_uniform(KILN_F32, KILN_SHAPE(n), 0, 1));  // blocks 1000 ..
  auto d = read<int32_t>(kiln_random_uniform(KILN_I32, KILN_SHAPE(n), 1, 7));  // then the next (n+1)/2
  auto l = read<int64_t>(kiln_random_uniform(KILN_I64, KILN_SHAPE(n), -1e18, 1e18));
  const uint64_t c1 = 1000 + (n + 1) / 2, c2 = c1 + (n + 1) / 2;
  int64_t bad_f = -1, bad_d = -1, bad_l = -1;
  for (int64_t i = 0; i < n; i++) {
    if (bad_f < 0 && f[i] != (float)(element_bits(seed, 1000, i) >> 40) * 0x1p-24f) bad_f = i;
    // an integer in [lo, hi) is lo + floor(r * span / 2^64)
    unsigned __int128 r = element_bits(seed, c1, i);
    if (bad_d < 0 && d[i] != 1 + (int32_t)((r * 6) >> 64)) bad_d = i;
    unsigned __int128 q = element_bits(seed, c2, i);
    if (bad_l < 0 && l[i] != (int64_t)-1000000000000000000ll + (int64_t)((q * 2000000000000000000ull) >> 64))
      bad_l = i;
  }
  EXPECT_EQ(bad_f, -1);
  EXPECT_EQ(bad_d, -1);
  EXPECT_EQ(bad_l, -1);
}

TEST(Random, NormalMatchesBoxMuller) {
  Scoped s;
  const uint64_t seed = 2024, c0 = 77;
  kiln_random_set_state(seed, c0);
  const int64_t n = 200001;
  auto z = read<double>(kiln_random_normal(KILN_F64, KILN_SHAPE(n)));
  kiln_random_set_state(seed, c0);
  auto zf = read<float>(kiln_random_normal(KILN_F32, KILN_SHAPE(n)));
  int64_t bad = -1, bad_f = -1;
  for (int64_t j = 0; 2 * j < n; j++) {
    uint32_t w[4];
    block(seed, c0 + (uint64_t)j, w);
    // u1 in (0, 1], so the log never sees 0; u2 in [0, 1)
    double u1 = (double)((((uint64_t)w[0] | (uint64_t)w[1] << 32) >> 11) + 1) * 0x1p-53;
    double u2 = (double)(((uint64_t)w[2] | (uint64_t)w[3] << 32) >> 11) * 0x1p-53;
    double rad = std::sqrt(-2 * std::log(u1));
    double want[2] = {rad * std::cos(2 * M_PI * u2), rad * std::sin(2 * M_PI * u2)};
    for (int k = 0; k < 2 && 2 * j + k < n; k++) {
      int64_t i = 2 * j + k;
      if (bad < 0 && std::abs(z[i] - want[k]) > 1e-12 * (1 + std::abs(want[k]))) bad = i;
      if (bad_f < 0 && zf[i] != (float)z[i]) bad_f = i;
    }
  }
  EXPECT_EQ(bad, -1) << "first mismatch at element " << bad;
  EXPECT_EQ(bad_f, -1) << "f32 normals are the f64 ones rounded; first mismatch at " << bad_f;
}

TEST(Random, SplitDrawsEqualOneDraw) {
  Scoped s;
  // one draw of 2k elements == two draws of k (k even) from the same state
  const int64_t k = 50000;
  kiln_random_set_state(11, 0);
  auto whole = read<float>(kiln_random_normal(KILN_F32, KILN_SHAPE(2 * k)));
  kiln_random_set_state(11, 0);
  auto a = read<float>(kiln_random_normal(KILN_F32, KILN_SHAPE(k)));
  auto b = read<float>(kiln_random_normal(KILN_F32, KILN_SHAPE(k)));
  a.insert(a.end(), b.begin(), b.end());
  EXPECT_EQ(a, whole);
}

TEST(Random, ConcurrentDrawsGetDisjointBlocks) {
  // Two threads draw at once: one may run on the pool, the other serially,
  // and each reserves its own blocks, so both results follow the layout from
  // their own first block and the two never overlap.
  Scoped s;  // checks the threads' tensors are all released
  const uint64_t seed = 31337, c0 = 5;
  const int64_t n = 200000, blocks = n / 2;
  kiln_random_set_state(seed, c0);
  std::vector<double> got[2];
  auto draw = [&](int k) {
    kiln_tensor *t = kiln_random_uniform(KILN_F64, KILN_SHAPE(n), 0, 1);
    got[k] = read<double>(t);
    kiln_release(t);
  };
  std::thread a(draw, 0), b(draw, 1);
  a.join();
  b.join();
  uint64_t counter;
  kiln_random_get_state(nullptr, &counter);
  EXPECT_EQ(counter, c0 + 2 * blocks);
  auto follows = [&](const std::vector<double> &v, uint64_t start) {
    if ((int64_t)v.size() != n) return false;
    for (int64_t i = 0; i < n; i++)
      if (v[i] != (double)(element_bits(seed, start, i) >> 11) * 0x1p-53) return false;
    return true;
  };
  bool first_then_second = follows(got[0], c0) && follows(got[1], c0 + blocks);
  bool second_then_first = follows(got[1], c0) && follows(got[0], c0 + blocks);
  EXPECT_TRUE(first_then_second || second_then_first);
}

// ---- statistics ----

TEST(Random, UniformF64Statistics) {
  Scoped s;
  kiln_random_seed(123);
  const int n = 1000000;
  auto u = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(n), -2, 6));
  double sum = 0, sq = 0, lo = 1e9, hi = -1e9;
  for (double x : u) sum += x, lo = std::min(lo, x), hi = std::max(hi, x);
  double mean = sum / n;
  for (double x : u) sq += (x - mean) * (x - mean);
  double var = sq / (n - 1);
  // uniform on [-2, 6): mean 2, variance 64/12; standard errors sqrt(var/n) and
  // sqrt((E(x-m)^4 - var^2)/n) = sqrt((8^4/80 - (64/12)^2)/n)
  EXPECT_NEAR(mean, 2.0, 5 * std::sqrt(64.0 / 12 / n));
  EXPECT_NEAR(var, 64.0 / 12, 5 * std::sqrt((4096.0 / 80 - (64.0 / 12) * (64.0 / 12)) / n));
  EXPECT_GE(lo, -2.0);
  EXPECT_LT(hi, 6.0);
  EXPECT_LT(lo, -1.99);
  EXPECT_GT(hi, 5.99);
}

TEST(Random, UniformF32Statistics) {
  Scoped s;
  kiln_random_seed(321);
  const int n = 1000000;
  auto u = read<float>(kiln_random_uniform(KILN_F32, KILN_SHAPE(n), 1, 2));
  double sum = 0, sq = 0;
  bool in_range = true;
  for (float x : u) sum += x, in_range = in_range && x >= 1.0f && x < 2.0f;
  double mean = sum / n;
  for (float x : u) sq += (x - mean) * (x - mean);
  EXPECT_TRUE(in_range);
  EXPECT_NEAR(mean, 1.5, 5 * std::sqrt(1.0 / 12 / n));
  EXPECT_NEAR(sq / (n - 1), 1.0 / 12, 5 * std::sqrt((1.0 / 80 - 1.0 / 144) / n));
}

TEST(Random, NormalStatistics) {
  Scoped s;
  kiln_random_seed(555);
  const int n = 1000000;
  for (kiln_dtype dt : {KILN_F64, KILN_F32}) {
    kiln_tensor *t = kiln_random_normal(dt, KILN_SHAPE(1000, 1000));
    std::vector<double> z(n);
    if (dt == KILN_F64) {
      z = read<double>(t);
    } else {
      auto f = read<float>(t);
      for (int i = 0; i < n; i++) z[i] = f[i];
    }
    double sum = 0, sq = 0, q = 0;
    int beyond2 = 0;
    for (double x : z) sum += x, sq += x * x, beyond2 += std::abs(x) > 2;
    double mean = sum / n, var = sq / n - mean * mean;
    for (double x : z) q += x * x * x * x;
    EXPECT_NEAR(mean, 0, 5 / std::sqrt((double)n)) << kiln_dtype_name(dt);
    EXPECT_NEAR(var, 1, 5 * std::sqrt(2.0 / n)) << kiln_dtype_name(dt);  // Var(x^2) = 2
    EXPECT_NEAR(q / n, 3, 5 * std::sqrt(96.0 / n)) << kiln_dtype_name(dt);  // kurtosis; Var(x^4) = 105 - 9
    // P(|x| > 2) = 0.0455003
    double p = 0.0455003;
    EXPECT_NEAR((double)beyond2 / n, p, 5 * std::sqrt(p * (1 - p) / n)) << kiln_dtype_name(dt);
  }
}

TEST(Random, IntegerDiceCoversRange) {
  Scoped s;
  kiln_random_seed(6);
  const int n = 600000;
  auto d = read<int32_t>(kiln_random_uniform(KILN_I32, KILN_SHAPE(n), 1, 7));
  int counts[8] = {0};
  bool in_range = true;
  for (int32_t x : d) {
    in_range = in_range && x >= 1 && x <= 6;
    if (x >= 1 && x <= 6) counts[x]++;
  }
  EXPECT_TRUE(in_range);
  double chi2 = 0, e = n / 6.0;
  for (int k = 1; k <= 6; k++) chi2 += (counts[k] - e) * (counts[k] - e) / e;
  EXPECT_LT(chi2, 25.7) << "chi-square with 5 degrees of freedom (p < 1e-4)";
  // i64 and fractional bounds: [0.5, 3.5) draws the integers 1, 2, 3
  auto l = read<int64_t>(kiln_random_uniform(KILN_I64, KILN_SHAPE(30000), 0.5, 3.5));
  int64_t seen[5] = {0};
  bool ok = true;
  for (int64_t x : l) {
    ok = ok && x >= 1 && x <= 3;
    if (x >= 0 && x <= 4) seen[x]++;
  }
  EXPECT_TRUE(ok);
  EXPECT_GT(seen[1], 9000);
  EXPECT_GT(seen[2], 9000);
  EXPECT_GT(seen[3], 9000);
  // negative bounds, and a one-value range
  auto neg = read<int32_t>(kiln_random_uniform(KILN_I32, KILN_SHAPE(1000), -3, -1));
  for (int32_t x : neg) EXPECT_TRUE(x == -3 || x == -2) << x;
  auto one = read<int64_t>(kiln_random_uniform(KILN_I64, KILN_SHAPE(100), 41.5, 42.5));
  for (int64_t x : one) EXPECT_EQ(x, 42);
}

TEST(Random, IntegerExtremeRanges) {
  Scoped s;
  kiln_random_seed(8);
  auto a = read<int32_t>(kiln_random_uniform(KILN_I32, KILN_SHAPE(10000), -2147483648.0, 2147483648.0));
  int neg = 0;
  for (int32_t x : a) neg += x < 0;
  EXPECT_GT(neg, 4500);
  EXPECT_LT(neg, 5500);
  // the whole i64 range (span 2^64)
  auto b = read<int64_t>(kiln_random_uniform(KILN_I64, KILN_SHAPE(10000), -0x1p63, 0x1p63));
  int bneg = 0;
  for (int64_t x : b) bneg += x < 0;
  EXPECT_GT(bneg, 4500);
  EXPECT_LT(bneg, 5500);
  auto c = read<int64_t>(kiln_random_uniform(KILN_I64, KILN_SHAPE(1000), 0x1p62, 0x1p63));
  for (int64_t x : c) EXPECT_GE(x, (int64_t)1 << 62);
}

TEST(Random, UniformNeverReturnsHi) {
  Scoped s;
  // f32: block 20568947 of seed 12345 has all top 24 bits set in element 0,
  // u = 1 - 2^-24, and 1 + u rounds to 2 in f32: it must give the float below 2
  kiln_random_set_state(12345, 20568947);
  EXPECT_EQ((uint64_t)element_bits(12345, 20568947, 0) >> 40, 0xffffffu);
  auto f = read<float>(kiln_random_uniform(KILN_F32, KILN_SHAPE(1), 1, 2));
  EXPECT_EQ(f[0], std::nextafter(2.0f, 0.0f));
  // ranges where rounding to the nearest representable value often reaches hi
  kiln_random_seed(3);
  auto d = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(100000), 1e16, 1e16 + 4));
  for (double x : d) ASSERT_LT(x, 1e16 + 4);
  auto g = read<float>(kiln_random_uniform(KILN_F32, KILN_SHAPE(100000), 16777216.0, 16777220.0));
  for (float x : g) ASSERT_LT(x, 16777220.0f);
  // lo == hi gives lo
  auto e = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(3), 2.5, 2.5));
  EXPECT_EQ(e, (std::vector<double>{2.5, 2.5, 2.5}));
  // the widest finite range does not overflow
  auto w = read<double>(kiln_random_uniform(KILN_F64, KILN_SHAPE(1000), -1.7e308, 1.7e308));
  for (double x : w) ASSERT_TRUE(std::isfinite(x) && x >= -1.7e308 && x < 1.7e308);
}

// ---- bad inputs ----

TEST(Random, BadInputs) {
  Scoped s;
  kiln_random_set_state(1, 10);
  EXPECT_EQ(kiln_random_uniform(KILN_F32, 2, nullptr, 0, 1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: shape is NULL for rank 2");
  EXPECT_EQ(kiln_random_normal(KILN_F32, 1, nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_normal: shape is NULL for rank 1");
  EXPECT_EQ(kiln_random_uniform(KILN_F32, KILN_SHAPE(2, -3), 0, 1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: shape[1] = -3 is negative");
  EXPECT_EQ(kiln_random_normal(KILN_F64, KILN_SHAPE(-1)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_normal: shape[0] = -1 is negative");
  EXPECT_EQ(kiln_random_normal(KILN_I32, KILN_SHAPE(3)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_normal: dtype i32 is not supported"));
  EXPECT_EQ(kiln_random_uniform(KILN_BOOL, KILN_SHAPE(3), 0, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_uniform: dtype bool is not supported"));
  EXPECT_EQ(kiln_random_uniform(KILN_F16, KILN_SHAPE(3), 0, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_uniform: dtype f16 is not supported"));
  EXPECT_EQ(kiln_random_uniform(KILN_F64, KILN_SHAPE(3), 2, 1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: need finite lo <= hi, got [2, 1)");
  EXPECT_EQ(kiln_random_uniform(KILN_F64, KILN_SHAPE(3), NAN, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_uniform: need finite lo <= hi"));
  EXPECT_EQ(kiln_random_uniform(KILN_F64, KILN_SHAPE(3), 0, NAN), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_uniform: need finite lo <= hi"));
  EXPECT_EQ(kiln_random_uniform(KILN_F64, KILN_SHAPE(3), 0, INFINITY), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_uniform: need finite lo <= hi"));
  uint64_t seed, counter;
  kiln_random_get_state(&seed, &counter);
  EXPECT_EQ(counter, 10u) << "failed draws must not move the stream";

  EXPECT_EQ(kiln_random_uniform(KILN_I32, KILN_SHAPE(3), 0.2, 0.7), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: empty integer range [0.2, 0.7)");
  EXPECT_EQ(kiln_random_uniform(KILN_I64, KILN_SHAPE(3), 5, 5), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: empty integer range [5, 5)");
  EXPECT_EQ(kiln_random_uniform(KILN_I32, KILN_SHAPE(3), 41.5, 42), nullptr);  // no integer is in it
  EXPECT_STREQ(kiln_last_error(), "random_uniform: empty integer range [41.5, 42)");
  EXPECT_EQ(kiln_random_uniform(KILN_I32, KILN_SHAPE(3), 0, 1e10), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: range [0, 1e+10) does not fit i32");
  EXPECT_EQ(kiln_random_uniform(KILN_I64, KILN_SHAPE(3), -1e19, 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: range [-1e+19, 0) does not fit i64");
  EXPECT_EQ(kiln_random_uniform(KILN_F32, KILN_SHAPE(3), 0, 1e39), nullptr);
  EXPECT_STREQ(kiln_last_error(), "random_uniform: range [0, 1e+39) does not fit f32");
  EXPECT_EQ(kiln_random_uniform((kiln_dtype)-1, KILN_SHAPE(3), 0, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("random_uniform: invalid dtype -1"));
}

}  // namespace
