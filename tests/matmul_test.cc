// matmul_test.cc — kiln_matmul: hand-computed products for every dtype,
// identity, batch broadcasting, edge tiles and sizes that take each kernel
// path (checked against a naive triple loop in double written here), integer
// wrap-around, K = 0, concurrent callers, and every bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

// Small integers (-4..4) from a fixed hash: every product and every sum of
// up to 2^18 of them is exact in f32, so kernels must match the reference
// exactly whatever order they add in.
VD small_ints(int64_t n, uint32_t seed) {
  VD v(n);
  uint32_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; i++) {
    s = s * 1664525u + 1013904223u;
    v[i] = (double)((int)(s >> 24) % 9 - 4);
  }
  return v;
}

// Arbitrary reals in [-1, 1), for tolerance checks.
VD reals(int64_t n, uint32_t seed) {
  VD v(n);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 7;
  for (int64_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v[i] = (double)(s >> 11) / 9007199254740992.0 * 2 - 1;
  }
  return v;
}

// The reference: C[m,n] = A[m,k] B[k,n], a naive loop in double.
VD naive(const VD &a, const VD &b, int64_t m, int64_t n, int64_t k) {
  VD c(m * n, 0.0);
  for (int64_t i = 0; i < m; i++)
    for (int64_t j = 0; j < n; j++) {
      double s = 0;
      for (int64_t p = 0; p < k; p++) s += a[i * k + p] * b[p * n + j];
      c[i * n + j] = s;
    }
  return c;
}

const kiln_dtype kNumeric[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64};

// one m x k @ k x n product, exact, in every dtype
void check_exact(int64_t m, int64_t n, int64_t k) {
  SCOPED_TRACE(std::to_string(m) + "x" + std::to_string(k) + " @ " + std::to_string(k) + "x" +
               std::to_string(n));
  VD a = small_ints(m * k, (uint32_t)(m * 31 + k)), b = small_ints(k * n, (uint32_t)(n * 17 + k));
  VD want = naive(a, b, m, n, k);
  for (kiln_dtype dt : kNumeric) {
    Scoped s;
    kiln_tensor *c = kiln_matmul(from_values(dt, {m, k}, a), from_values(dt, {k, n}, b));
    ASSERT_NE(c, nullptr) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_dtype(c), dt);
    EXPECT_EQ(shape_of(c), (V64{m, n}));
    EXPECT_EQ(values(c), want) << kiln_dtype_name(dt);
  }
}

// ---- hand-computed ----

TEST(Matmul, TwoByThreeTimesThreeByTwo) {
  for (kiln_dtype dt : kNumeric) {
    Scoped s;
    kiln_tensor *a = from_values(dt, {2, 3}, {1, 2, 3, 4, 5, 6});
    kiln_tensor *b = from_values(dt, {3, 2}, {7, 8, 9, 10, 11, 12});
    kiln_tensor *c = kiln_matmul(a, b);
    EXPECT_EQ(shape_of(c), (V64{2, 2})) << kiln_dtype_name(dt);
    EXPECT_EQ(values(c), (VD{58, 64, 139, 154})) << kiln_dtype_name(dt);
    kiln_tensor *d = kiln_matmul(b, a);  // 3x2 @ 2x3: 3x3
    EXPECT_EQ(values(d), (VD{39, 54, 69, 49, 68, 87, 59, 82, 105})) << kiln_dtype_name(dt);
  }
}

TEST(Matmul, TwoByTwoAndOneByOne) {
  Scoped s;
  kiln_tensor *a = from_values(KILN_F32, {2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(values(kiln_matmul(a, a)), (VD{7, 10, 15, 22}));
  EXPECT_EQ(values(kiln_matmul(from_values(KILN_I64, {1, 1}, {-6}), from_values(KILN_I64, {1, 1}, {7}))),
            (VD{-42}));
}

TEST(Matmul, Identity) {
  Scoped s;
  const int64_t n = 37;
  VD eye(n * n, 0.0);
  for (int64_t i = 0; i < n; i++) eye[i * n + i] = 1;
  VD x = reals(20 * n, 3);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    kiln_tensor *a = from_values(dt, {20, n}, x);
    VD ax = values(a);
    EXPECT_EQ(values(kiln_matmul(a, from_values(dt, {n, n}, eye))), ax) << kiln_dtype_name(dt);
    kiln_tensor *at = from_values(dt, {n, 20}, reals(20 * n, 4));
    EXPECT_EQ(values(kiln_matmul(from_values(dt, {n, n}, eye), at)), values(at)) << kiln_dtype_name(dt);
  }
}

TEST(Matmul, BatchBroadcast) {
  // (2, 1, 2, 3) @ (3, 3, 2) -> (2, 3, 2, 2): out[a][b] = A[a][0] @ B[b].
  // A[0] picks rows 0 and 1 of B[b]; A[1] sums its rows and doubles row 2.
  VD a = {1, 0, 0, 0, 1, 0,  //
          1, 1, 1, 0, 0, 2};
  VD b = {1, 2, 3, 4, 0, 1,                       // B[0]
          2, 2, 3, 5, 1, 1,                       // B[1]
          3, 2, 3, 6, 2, 1};                      // B[2]
  VD want = {1, 2, 3, 4, 2, 2, 3, 5, 3, 2, 3, 6,  //
             4, 7, 0, 2, 6, 8, 2, 2, 8, 9, 4, 2};
  for (kiln_dtype dt : kNumeric) {
    Scoped s;
    kiln_tensor *c = kiln_matmul(from_values(dt, {2, 1, 2, 3}, a), from_values(dt, {3, 3, 2}, b));
    ASSERT_NE(c, nullptr) << kiln_last_error();
    EXPECT_EQ(shape_of(c), (V64{2, 3, 2, 2})) << kiln_dtype_name(dt);
    EXPECT_EQ(values(c), want) << kiln_dtype_name(dt);
  }
}

TEST(Matmul, BatchOnOneSide) {
  Scoped s;
  // (3, 2, 2) @ (2, 1): each batch of A times the same B
  kiln_tensor *a = from_values(KILN_F64, {3, 2, 2}, {1, 0, 0, 1, 2, 0, 0, 2, 0, 1, 1, 0});
  kiln_tensor *b = from_values(KILN_F64, {2, 1}, {5, 7});
  kiln_tensor *c = kiln_matmul(a, b);
  EXPECT_EQ(shape_of(c), (V64{3, 2, 1}));
  EXPECT_EQ(values(c), (VD{5, 7, 10, 14, 7, 5}));
  // (2, 2) @ (2, 2, 1): A broadcast over B's batch
  kiln_tensor *d =
      kiln_matmul(from_values(KILN_I32, {2, 2}, {1, 2, 3, 4}), from_values(KILN_I32, {2, 2, 1}, {1, 1, 0, 1}));
  EXPECT_EQ(shape_of(d), (V64{2, 2, 1}));
  EXPECT_EQ(values(d), (VD{3, 7, 2, 4}));
}

// ---- sizes that exercise each path, against the naive loop ----

TEST(Matmul, EdgeTiles) {
  check_exact(67, 45, 131);   // no dimension a multiple of any tile
  check_exact(1, 1, 1000);    // a dot product
  check_exact(1, 300, 1000);  // a row vector times a matrix
  check_exact(300, 1, 1000);  // a matrix times a column
  check_exact(5, 7, 3);       // below the packing threshold
  check_exact(7, 33, 40);
  check_exact(97, 65, 257);  // K crosses a cache block
}

TEST(Matmul, TileBoundarySweep) {
  // around the register tiles (6 x 32 on AVX-512), the strips (8..64) and
  // the K block (256), on both the unpacked and the packed paths
  for (int64_t m : {1, 5, 6, 7, 13})
    for (int64_t n : {2, 31, 32, 33, 65})
      for (int64_t k : {1, 255, 257}) check_exact(m, n, k);
}

TEST(Matmul, LargeThreaded) {
  check_exact(300, 513, 260);
  check_exact(640, 96, 64);  // tall: split over rows
}

TEST(Matmul, RealsWithinRounding) {
  const int64_t m = 129, n = 200, k = 300;
  VD a = reals(m * k, 1), b = reals(k * n, 2), want = naive(a, b, m, n, k);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    Scoped s;
    VD got = values(kiln_matmul(from_values(dt, {m, k}, a), from_values(dt, {k, n}, b)));
    ASSERT_EQ(got.size(), want.size());
    // f32 inputs are rounded, so compare against the rounded inputs' product
    VD ar = a, br = b;
    if (dt == KILN_F32) {
      for (double &x : ar) x = (float)x;
      for (double &x : br) x = (float)x;
    }
    VD ref = naive(ar, br, m, n, k);
    double tol = dt == KILN_F32 ? 1e-4 : 1e-12, worst = 0;
    for (size_t i = 0; i < got.size(); i++) worst = std::fmax(worst, std::fabs(got[i] - ref[i]));
    EXPECT_LT(worst, tol) << kiln_dtype_name(dt);
  }
}

TEST(Matmul, ManySmallBatches) {
  Scoped s;
  const int64_t batch = 200, m = 5, n = 3, k = 7;
  VD a = small_ints(batch * m * k, 9), b = small_ints(k * n, 10);
  VD want;
  for (int64_t t = 0; t < batch; t++) {
    VD at(a.begin() + t * m * k, a.begin() + (t + 1) * m * k);
    VD ct = naive(at, b, m, n, k);
    want.insert(want.end(), ct.begin(), ct.end());
  }
  for (kiln_dtype dt : kNumeric) {
    kiln_tensor *c = kiln_matmul(from_values(dt, {batch, m, k}, a), from_values(dt, {k, n}, b));
    EXPECT_EQ(shape_of(c), (V64{batch, m, n}));
    EXPECT_EQ(values(c), want) << kiln_dtype_name(dt);
  }
}

TEST(Matmul, BigBatches) {
  Scoped s;
  const int64_t m = 70, n = 90, k = 80;
  VD a = small_ints(2 * m * k, 11), b = small_ints(2 * k * n, 12);
  VD want;
  for (int t = 0; t < 2; t++) {
    VD ct = naive(VD(a.begin() + t * m * k, a.begin() + (t + 1) * m * k),
                  VD(b.begin() + t * k * n, b.begin() + (t + 1) * k * n), m, n, k);
    want.insert(want.end(), ct.begin(), ct.end());
  }
  kiln_tensor *c = kiln_matmul(from_values(KILN_F32, {2, m, k}, a), from_values(KILN_F32, {2, k, n}, b));
  EXPECT_EQ(shape_of(c), (V64{2, m, n}));
  EXPECT_EQ(values(c), want);
}

// ---- integers, empty dims ----

TEST(Matmul, IntegersWrap) {
  Scoped s;
  // 65536 * 65537 + 5 = 2^32 + 65541
  kiln_tensor *c =
      kiln_matmul(from_values(KILN_I32, {1, 2}, {65536, 1}), from_values(KILN_I32, {2, 1}, {65537, 5}));
  std::vector<int32_t> v32(1);
  ASSERT_EQ(kiln_tensor_read(c, v32.data(), sizeof(int32_t)), 0) << kiln_last_error();
  EXPECT_EQ(v32[0], 65541);
  // (2^62)(4) + 3 wraps to 3 in i64; the reverse order too
  std::vector<int64_t> a = {INT64_C(1) << 62, 3}, b = {4, 1};
  kiln_tensor *d = kiln_matmul(kiln_tensor_new(KILN_I64, KILN_SHAPE(1, 2), a.data()),
                               kiln_tensor_new(KILN_I64, KILN_SHAPE(2, 1), b.data()));
  std::vector<int64_t> v64(1);
  ASSERT_EQ(kiln_tensor_read(d, v64.data(), sizeof(int64_t)), 0) << kiln_last_error();
  EXPECT_EQ(v64[0], 3);
  // negative values
  EXPECT_EQ(
      values(kiln_matmul(from_values(KILN_I32, {1, 2}, {-3, 2}), from_values(KILN_I32, {2, 2}, {4, -1, -5, 6}))),
      (VD{-22, 15}));
}

TEST(Matmul, EmptyInnerGivesZeros) {
  for (kiln_dtype dt : kNumeric) {
    Scoped s;
    kiln_tensor *c =
        kiln_matmul(kiln_zeros(dt, KILN_SHAPE(2, 0)), kiln_zeros(dt, KILN_SHAPE(0, 3)));
    ASSERT_NE(c, nullptr) << kiln_last_error();
    EXPECT_EQ(shape_of(c), (V64{2, 3}));
    EXPECT_EQ(values(c), (VD(6, 0.0))) << kiln_dtype_name(dt);
    // a batch of them, and a big one (no stale memory behind the zeros)
    kiln_tensor *e =
        kiln_matmul(kiln_zeros(dt, KILN_SHAPE(4, 100, 0)), kiln_zeros(dt, KILN_SHAPE(0, 300)));
    EXPECT_EQ(shape_of(e), (V64{4, 100, 300}));
    EXPECT_EQ(values(e), (VD(120000, 0.0))) << kiln_dtype_name(dt);
  }
}

TEST(Matmul, EmptyOuterDims) {
  Scoped s;
  kiln_tensor *a =
      kiln_matmul(kiln_zeros(KILN_F32, KILN_SHAPE(0, 3)), kiln_zeros(KILN_F32, KILN_SHAPE(3, 2)));
  ASSERT_NE(a, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(a), (V64{0, 2}));
  kiln_tensor *b =
      kiln_matmul(kiln_zeros(KILN_F64, KILN_SHAPE(4, 3)), kiln_zeros(KILN_F64, KILN_SHAPE(3, 0)));
  ASSERT_NE(b, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(b), (V64{4, 0}));
  kiln_tensor *c = kiln_matmul(kiln_zeros(KILN_I32, KILN_SHAPE(0, 2, 3)),
                               kiln_zeros(KILN_I32, KILN_SHAPE(3, 2)));
  ASSERT_NE(c, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(c), (V64{0, 2, 2}));
}

// ---- concurrent callers ----

TEST(Matmul, TwoThreadsAtOnce) {
  const int64_t n = 150;
  VD a = small_ints(n * n, 21), b = small_ints(n * n, 22), want = naive(a, b, n, n, n);
  int64_t live = kiln_debug_live_tensors();
  auto worker = [&](bool *ok) {
    kiln_scope_push();
    kiln_tensor *x = from_values(KILN_F32, {n, n}, a), *y = from_values(KILN_F32, {n, n}, b);
    *ok = true;
    for (int r = 0; r < 10 && *ok; r++) {
      kiln_tensor *c = kiln_matmul(x, y);
      *ok = c && values(c) == want;
      kiln_release(kiln_scope_escape(c));
    }
    kiln_scope_pop();
  };
  bool ok1 = false, ok2 = false;
  std::thread t1(worker, &ok1), t2(worker, &ok2);
  t1.join();
  t2.join();
  EXPECT_TRUE(ok1);
  EXPECT_TRUE(ok2);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// ---- bad inputs ----

TEST(Matmul, BadInputs) {
  Scoped s;
  kiln_tensor *v = kiln_zeros(KILN_F32, KILN_SHAPE(3));
  kiln_tensor *m23 = kiln_zeros(KILN_F32, KILN_SHAPE(2, 3));
  kiln_tensor *m42 = kiln_zeros(KILN_F32, KILN_SHAPE(4, 2));
  EXPECT_EQ(kiln_matmul(v, m23), nullptr);
  EXPECT_STREQ(kiln_last_error(), "matmul: operands need rank >= 2, got ranks 1 and 2");
  EXPECT_EQ(kiln_matmul(m23, kiln_scalar(KILN_F32, 2)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("matmul: operands need rank >= 2"));
  EXPECT_EQ(kiln_matmul(m23, m42), nullptr);
  EXPECT_STREQ(kiln_last_error(), "matmul: inner dimensions differ: (2, 3) and (4, 2)");
  EXPECT_EQ(kiln_matmul(kiln_zeros(KILN_F32, KILN_SHAPE(2, 2, 3)),
                        kiln_zeros(KILN_F32, KILN_SHAPE(3, 3, 2))),
            nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("matmul: batch dimensions of (2, 2, 3) and (3, 3, 2)"));
  EXPECT_EQ(kiln_matmul(m23, kiln_zeros(KILN_F64, KILN_SHAPE(3, 2))), nullptr);
  EXPECT_STREQ(kiln_last_error(), "matmul: dtype mismatch: f32 and f64");
  EXPECT_EQ(
      kiln_matmul(kiln_zeros(KILN_BOOL, KILN_SHAPE(2, 2)), kiln_zeros(KILN_BOOL, KILN_SHAPE(2, 2))),
      nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("matmul: dtype bool is not supported"));
  EXPECT_EQ(
      kiln_matmul(kiln_zeros(KILN_F16, KILN_SHAPE(2, 2)), kiln_zeros(KILN_F16, KILN_SHAPE(2, 2))),
      nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("matmul: dtype f16 is not supported"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("cast"));
  kiln_clear_error();
  EXPECT_EQ(kiln_matmul(nullptr, m23), nullptr);
  EXPECT_STREQ(kiln_last_error(), "matmul: input 0 is NULL");
  kiln_clear_error();
  EXPECT_EQ(kiln_matmul(m23, nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "matmul: input 1 is NULL");
  // a NULL keeps the first error of a chain
  kiln_clear_error();
  EXPECT_EQ(kiln_matmul(kiln_matmul(m23, m42), m23), nullptr);
  EXPECT_STREQ(kiln_last_error(), "matmul: inner dimensions differ: (2, 3) and (4, 2)");
}

}  // namespace
