// index_test.cc — the indexing primitives: gather (every dtype, i32 and i64
// indices, any axis, multi-dimensional indices), scatter_add (duplicates
// accumulate) and arange; index errors name the flat position exactly.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "test_util.h"

// Public entry point of scatter_add, defined in lib/kernels_index.c; it
// moves into kiln.h (this redeclaration then stays harmless).
extern "C" kiln_tensor *kiln_scatter_add(kiln_tensor *updates, kiln_tensor *indices, int axis, int rank,
                                         const int64_t *shape);

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

// ---- gather ----

TEST(Index, GatherAxis0) {
  Scoped s;
  kiln_tensor *p = make<float>(KILN_F32, {3, 2}, {1, 2, 3, 4, 5, 6});
  kiln_tensor *g = kiln_gather(p, i32({3}, {2, 0, 2}), 0);
  EXPECT_EQ(shape_of(g), (V64{3, 2}));
  EXPECT_EQ(read<float>(g), (std::vector<float>{5, 6, 1, 2, 5, 6}));
  kiln_tensor *g64 = kiln_gather(p, i64({2}, {1, 1}), 0);
  EXPECT_EQ(read<float>(g64), (std::vector<float>{3, 4, 3, 4}));
}

TEST(Index, GatherAxis1AndLast) {
  Scoped s;
  kiln_tensor *p = make<double>(KILN_F64, {2, 3}, {1, 2, 3, 4, 5, 6});
  kiln_tensor *g = kiln_gather(p, i64({4}, {2, 0, 1, 2}), 1);
  EXPECT_EQ(shape_of(g), (V64{2, 4}));
  EXPECT_EQ(read<double>(g), (std::vector<double>{3, 1, 2, 3, 6, 4, 5, 6}));
  EXPECT_EQ(read<double>(kiln_gather(p, i32({2}, {1, 0}), -1)), (std::vector<double>{2, 1, 5, 4}));
  EXPECT_EQ(read<double>(kiln_gather(p, i32({1}, {1}), -2)), (std::vector<double>{4, 5, 6}));
}

TEST(Index, GatherMiddleAxis) {
  Scoped s;
  // params (2, 3, 2): 6i + 2j + k
  std::vector<int32_t> v(12);
  std::iota(v.begin(), v.end(), 0);
  kiln_tensor *p = make(KILN_I32, {2, 3, 2}, v);
  kiln_tensor *g = kiln_gather(p, i32({2}, {2, 0}), 1);
  EXPECT_EQ(shape_of(g), (V64{2, 2, 2}));
  EXPECT_EQ(read<int32_t>(g), (std::vector<int32_t>{4, 5, 0, 1, 10, 11, 6, 7}));
}

TEST(Index, GatherMultiDimIndices) {
  Scoped s;
  kiln_tensor *p = make<int64_t>(KILN_I64, {4}, {10, 20, 30, 40});
  kiln_tensor *g = kiln_gather(p, i32({2, 3}, {3, 0, 1, 1, 2, 3}), 0);
  EXPECT_EQ(shape_of(g), (V64{2, 3}));
  EXPECT_EQ(read<int64_t>(g), (std::vector<int64_t>{40, 10, 20, 20, 30, 40}));
  // (2, 2) params, (2, 2) indices on axis 1 -> (2, 2, 2)
  kiln_tensor *q = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  kiln_tensor *h = kiln_gather(q, i64({2, 2}, {1, 0, 1, 1}), 1);
  EXPECT_EQ(shape_of(h), (V64{2, 2, 2}));
  EXPECT_EQ(read<float>(h), (std::vector<float>{2, 1, 2, 2, 4, 3, 4, 4}));
  // scalar index: the axis disappears
  kiln_tensor *sc = kiln_gather(q, i32({}, {1}), 0);
  EXPECT_EQ(shape_of(sc), (V64{2}));
  EXPECT_EQ(read<float>(sc), (std::vector<float>{3, 4}));
}

TEST(Index, GatherStorageDtypes) {
  Scoped s;
  kiln_tensor *b = make<uint8_t>(KILN_BOOL, {3}, {1, 0, 1});
  EXPECT_EQ(read<uint8_t>(kiln_gather(b, i32({4}, {1, 2, 0, 1}), 0)), (std::vector<uint8_t>{0, 1, 1, 0}));
  kiln_tensor *h = make<uint16_t>(KILN_F16, {2, 2}, {0x3c00, 0x7e01, 0xfc00, 0x0001});
  EXPECT_EQ(read<uint16_t>(kiln_gather(h, i64({1}, {1}), 1)), (std::vector<uint16_t>{0x7e01, 0x0001}));
  kiln_tensor *bf = make<uint16_t>(KILN_BF16, {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(read<uint16_t>(kiln_gather(bf, i32({1}, {1}), 0)), (std::vector<uint16_t>{4, 5, 6}));
}

TEST(Index, GatherEmpty) {
  Scoped s;
  kiln_tensor *p = make<float>(KILN_F32, {3, 2}, {1, 2, 3, 4, 5, 6});
  kiln_tensor *g = kiln_gather(p, i32({0}, {}), 0);
  ASSERT_NE(g, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(g), (V64{0, 2}));
  kiln_tensor *e = kiln_zeros(KILN_F32, KILN_SHAPE(0, 3));
  kiln_tensor *g2 = kiln_gather(e, i64({2}, {2, 0}), 1);
  ASSERT_NE(g2, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(g2), (V64{0, 2}));
  // an index into an empty axis is still an error, even with no output
  EXPECT_EQ(kiln_gather(e, i64({1}, {0}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[0] = 0 is not in [0, 0)");
}

TEST(Index, GatherLarge) {
  Scoped s;
  // an embedding lookup: (1000, 64) rows, 20000 indices; and an axis-last
  // gather of 100K single elements (the constant-width row path)
  std::vector<float> table(1000 * 64);
  for (int i = 0; i < 1000 * 64; i++) table[i] = (float)i;
  std::vector<int64_t> ids(20000);
  for (int i = 0; i < 20000; i++) ids[i] = (i * 7919) % 1000;
  auto g = read<float>(kiln_gather(make(KILN_F32, {1000, 64}, table), i64({20000}, ids), 0));
  ASSERT_EQ(g.size(), 20000u * 64u);
  bool ok = true;
  for (int i = 0; i < 20000 && ok; i++)
    for (int j = 0; j < 64 && ok; j++) ok = g[i * 64 + j] == (float)(ids[i] * 64 + j);
  EXPECT_TRUE(ok);

  std::vector<int32_t> cols(1000);
  for (int i = 0; i < 1000; i++) cols[i] = 63 - i % 64;
  auto h = read<float>(kiln_gather(make(KILN_F32, {1000, 64}, table), i32({1000}, cols), 1));
  ASSERT_EQ(h.size(), 1000u * 1000u);
  ok = true;
  for (int r = 0; r < 1000 && ok; r++)
    for (int j = 0; j < 1000 && ok; j++) ok = h[r * 1000 + j] == (float)(r * 64 + cols[j]);
  EXPECT_TRUE(ok);
}

TEST(Index, GatherOutOfRange) {
  Scoped s;
  kiln_tensor *p = make<float>(KILN_F32, {3}, {1, 2, 3});
  EXPECT_EQ(kiln_gather(p, i32({1}, {7}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[0] = 7 is not in [0, 3)");
  EXPECT_EQ(kiln_gather(p, i64({3}, {0, 1, 3}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[2] = 3 is not in [0, 3)");
  // negative indices are errors, not counted from the end
  EXPECT_EQ(kiln_gather(p, i32({2}, {0, -1}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[1] = -1 is not in [0, 3)");
  // the position is flat over multi-dimensional indices; the first bad one is named
  EXPECT_EQ(kiln_gather(p, i64({2, 2}, {0, 1, 5, -9}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[2] = 5 is not in [0, 3)");
  EXPECT_EQ(kiln_gather(p, i64({1}, {INT64_MIN}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[0] = -9223372036854775808 is not in [0, 3)");
  kiln_tensor *q = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(kiln_gather(q, i32({1}, {2}), 1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[0] = 2 is not in [0, 2)");
}

TEST(Index, GatherBadInputs) {
  Scoped s;
  kiln_tensor *p = make<float>(KILN_F32, {3}, {1, 2, 3});
  EXPECT_EQ(kiln_gather(p, make<float>(KILN_F32, {1}, {0}), 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices must be i32 or i64, not f32");
  EXPECT_EQ(kiln_gather(p, i32({1}, {0}), 1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: axis 1 is out of range for rank 1");
  EXPECT_EQ(kiln_gather(p, i32({1}, {0}), -2), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("gather: axis -2"));
  EXPECT_EQ(kiln_gather(kiln_scalar(KILN_F32, 1), i32({1}, {0}), 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("gather: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_gather(nullptr, i32({1}, {0}), 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("gather: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_gather(p, nullptr, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("gather: "));
}

// ---- scatter_add ----

TEST(Index, ScatterAddDuplicatesAccumulate) {
  Scoped s;
  kiln_tensor *u = make<float>(KILN_F32, {4}, {1, 2, 4, 8});
  kiln_tensor *r = kiln_scatter_add(u, i32({4}, {0, 2, 0, 1}), 0, KILN_SHAPE(3));
  EXPECT_EQ(shape_of(r), (V64{3}));
  EXPECT_EQ(read<float>(r), (std::vector<float>{5, 8, 2}));
  // untouched rows stay zero
  kiln_tensor *d = make<double>(KILN_F64, {3}, {0.5, 0.25, 1});
  EXPECT_EQ(read<double>(kiln_scatter_add(d, i64({3}, {4, 4, 1}), 0, KILN_SHAPE(6))),
            (std::vector<double>{0, 1, 0, 0, 0.75, 0}));
}

TEST(Index, ScatterAddRowsAndAxes) {
  Scoped s;
  // axis 0: rows of (3, 2)
  kiln_tensor *u = make<int32_t>(KILN_I32, {3, 2}, {1, 2, 10, 20, 100, 200});
  EXPECT_EQ(read<int32_t>(kiln_scatter_add(u, i32({3}, {1, 1, 0}), 0, KILN_SHAPE(2, 2))),
            (std::vector<int32_t>{100, 200, 11, 22}));
  // axis 1 (and -1): columns of (2, 3) from updates (2, 4)
  kiln_tensor *v = make<int64_t>(KILN_I64, {2, 4}, {1, 2, 3, 4, 5, 6, 7, 8});
  kiln_tensor *r = kiln_scatter_add(v, i64({4}, {2, 0, 2, 2}), 1, KILN_SHAPE(2, 3));
  EXPECT_EQ(shape_of(r), (V64{2, 3}));
  EXPECT_EQ(read<int64_t>(r), (std::vector<int64_t>{2, 0, 8, 6, 0, 20}));
  EXPECT_EQ(read<int64_t>(kiln_scatter_add(v, i64({4}, {2, 0, 2, 2}), -1, KILN_SHAPE(2, 3))),
            (std::vector<int64_t>{2, 0, 8, 6, 0, 20}));
  // multi-dimensional indices (2, 2) into axis 0 of (3,)
  kiln_tensor *w = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(read<float>(kiln_scatter_add(w, i32({2, 2}, {2, 2, 0, 2}), 0, KILN_SHAPE(3))),
            (std::vector<float>{3, 0, 7}));
}

TEST(Index, ScatterAddInvertsGather) {
  Scoped s;
  // sum over gathered rows == scatter_add of ones counts how often each row was taken
  kiln_tensor *ones = kiln_ones(KILN_F32, KILN_SHAPE(5, 2));
  kiln_tensor *r = kiln_scatter_add(ones, i64({5}, {3, 0, 3, 3, 1}), 0, KILN_SHAPE(4, 2));
  EXPECT_EQ(read<float>(r), (std::vector<float>{1, 1, 1, 1, 0, 0, 3, 3}));
}

TEST(Index, ScatterAddIntegerWraps) {
  Scoped s;
  kiln_tensor *u = make<int32_t>(KILN_I32, {2}, {INT32_MAX, 1});
  EXPECT_EQ(read<int32_t>(kiln_scatter_add(u, i32({2}, {0, 0}), 0, KILN_SHAPE(1))),
            (std::vector<int32_t>{INT32_MIN}));
  kiln_tensor *v = make<int64_t>(KILN_I64, {2}, {INT64_MIN, -1});
  EXPECT_EQ(read<int64_t>(kiln_scatter_add(v, i32({2}, {0, 0}), 0, KILN_SHAPE(1))),
            (std::vector<int64_t>{INT64_MAX}));
}

TEST(Index, ScatterAddEmpty) {
  Scoped s;
  kiln_tensor *u = kiln_zeros(KILN_F32, KILN_SHAPE(0, 2));
  kiln_tensor *r = kiln_scatter_add(u, i32({0}, {}), 0, KILN_SHAPE(3, 2));
  EXPECT_EQ(read<float>(r), (std::vector<float>(6, 0.0f)));
  kiln_tensor *e =
      kiln_scatter_add(kiln_zeros(KILN_F64, KILN_SHAPE(2, 0)), i64({2}, {0, 1}), 0, KILN_SHAPE(2, 0));
  ASSERT_NE(e, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(e), (V64{2, 0}));
}

TEST(Index, ScatterAddLarge) {
  Scoped s;
  // an embedding gradient: 3000 updates of width 512 into 10 rows, many duplicates
  const int n = 3000, w = 512, rows = 10;
  std::vector<double> upd((size_t)n * w);
  std::vector<int32_t> ids(n);
  for (int j = 0; j < n; j++) {
    ids[j] = (j * 7) % rows;
    for (int i = 0; i < w; i++) upd[(size_t)j * w + i] = j + i * 1e-3;
  }
  auto got =
      read<double>(kiln_scatter_add(make(KILN_F64, {n, w}, upd), i32({n}, ids), 0, KILN_SHAPE(rows, w)));
  ASSERT_EQ(got.size(), (size_t)rows * w);
  // row r gets every j with 7j = r (mod 10): j = 3r (mod 10); 300 of them
  bool ok = true;
  for (int r = 0; r < rows && ok; r++) {
    double js = 0;
    int cnt = 0;
    for (int j = 0; j < n; j++)
      if (j % 10 == (3 * r) % 10) js += j, cnt++;
    for (int i = 0; i < w && ok; i++) ok = std::abs(got[r * w + i] - (js + cnt * i * 1e-3)) < 1e-6;
  }
  EXPECT_TRUE(ok);
  // axis 1 of (64, 50000): a tall scatter over columns
  std::vector<float> u2(64 * 3, 1.0f);
  auto g2 = read<float>(kiln_scatter_add(make(KILN_F32, {64, 3}, u2), i64({3}, {49999, 0, 49999}), 1,
                                         KILN_SHAPE(64, 50000)));
  ASSERT_EQ(g2.size(), 64u * 50000u);
  double sum = 0;
  for (float x : g2) sum += x;
  EXPECT_EQ(sum, 192);
  EXPECT_EQ(g2[49999], 2);
  EXPECT_EQ(g2[63 * 50000], 1);
}

TEST(Index, ScatterAddErrors) {
  Scoped s;
  kiln_tensor *u = make<float>(KILN_F32, {3}, {1, 2, 3});
  EXPECT_EQ(kiln_scatter_add(u, i32({3}, {0, 1, -1}), 0, KILN_SHAPE(4)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "scatter_add: indices[2] = -1 is not in [0, 4)");
  EXPECT_EQ(kiln_scatter_add(u, i64({3}, {0, 4, 1}), 0, KILN_SHAPE(4)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "scatter_add: indices[1] = 4 is not in [0, 4)");
  EXPECT_EQ(kiln_scatter_add(u, i32({2}, {0, 1}), 0, KILN_SHAPE(4)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "scatter_add: updates have shape (3,), expected (2,)");
  EXPECT_EQ(kiln_scatter_add(u, make<float>(KILN_F32, {3}, {0, 1, 2}), 0, KILN_SHAPE(4)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "scatter_add: indices must be i32 or i64, not f32");
  EXPECT_EQ(kiln_scatter_add(make<uint8_t>(KILN_BOOL, {1}, {1}), i32({1}, {0}), 0, KILN_SHAPE(2)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: dtype bool is not supported"));
  EXPECT_EQ(kiln_scatter_add(make<uint16_t>(KILN_F16, {1}, {0}), i32({1}, {0}), 0, KILN_SHAPE(2)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: dtype f16 is not supported"));
  EXPECT_EQ(kiln_scatter_add(u, i32({3}, {0, 1, 2}), 1, KILN_SHAPE(4)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "scatter_add: axis 1 is out of range for rank 1");
  EXPECT_EQ(kiln_scatter_add(u, i32({3}, {0, 1, 2}), 0, 0, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: axis 0 is out of range for rank 0"));
  EXPECT_EQ(kiln_scatter_add(u, i32({3}, {0, 1, 2}), 0, 1, nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "scatter_add: shape is NULL for rank 1");
  EXPECT_EQ(kiln_scatter_add(u, i32({3}, {0, 1, 2}), 0, 9, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: rank 9"));
  EXPECT_EQ(kiln_scatter_add(u, i32({3}, {0, 1, 2}), 0, KILN_SHAPE(-4)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: "));
  EXPECT_THAT(kiln_last_error(), HasSubstr("negative"));
  kiln_clear_error();
  EXPECT_EQ(kiln_scatter_add(nullptr, i32({1}, {0}), 0, 7, nullptr), nullptr);  // NULL wins over bad attrs
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: input 0 is NULL"));
  kiln_clear_error();
  EXPECT_EQ(kiln_scatter_add(u, nullptr, 0, KILN_SHAPE(4)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scatter_add: input 1 is NULL"));
}

// ---- arange ----

TEST(Index, ArangeEachDtype) {
  Scoped s;
  kiln_tensor *a = kiln_arange(KILN_F32, 5);
  EXPECT_EQ(shape_of(a), (V64{5}));
  EXPECT_EQ(read<float>(a), (std::vector<float>{0, 1, 2, 3, 4}));
  EXPECT_EQ(read<double>(kiln_arange(KILN_F64, 3)), (std::vector<double>{0, 1, 2}));
  EXPECT_EQ(read<int32_t>(kiln_arange(KILN_I32, 4)), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(read<int64_t>(kiln_arange(KILN_I64, 2)), (std::vector<int64_t>{0, 1}));
  kiln_tensor *e = kiln_arange(KILN_I64, 0);
  ASSERT_NE(e, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(e), (V64{0}));
  // large: parallel, and exact in f32 below 2^24
  auto big = read<float>(kiln_arange(KILN_F32, 1 << 20));
  bool ok = big.size() == (1u << 20);
  for (size_t i = 0; ok && i < big.size(); i++) ok = big[i] == (float)i;
  EXPECT_TRUE(ok);
  auto bigl = read<int64_t>(kiln_arange(KILN_I64, 100000));
  EXPECT_EQ(bigl[99999], 99999);
}

TEST(Index, ArangeErrors) {
  Scoped s;
  EXPECT_EQ(kiln_arange(KILN_F32, -1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "arange: n = -1 is negative");
  EXPECT_EQ(kiln_arange(KILN_BOOL, 3), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("arange: dtype bool is not supported"));
  EXPECT_EQ(kiln_arange(KILN_F16, 3), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("arange: dtype f16 is not supported"));
  EXPECT_EQ(kiln_arange((kiln_dtype)42, 3), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("arange: invalid dtype 42"));
}

// ---- index errors, staged: the same message compiled and interpreted ----

// KILN_BACKEND for the traces compiled while it lives
struct BackendEnv : EnvGuard {
  explicit BackendEnv(const char *v) : EnvGuard("KILN_BACKEND", v) {}
};

struct GatherCase {
  const char *name;
  int axis;
  bool fused;  // elementwise work before and after, so that the gather sits in a fused kernel
};

int gather_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const GatherCase *c = static_cast<const GatherCase *>(user);
  kiln_tensor *p = c->fused ? kiln_exp(in[0]) : in[0];
  kiln_tensor *g = kiln_gather(p, in[1], c->axis);
  out[0] = c->fused ? kiln_mul(g, kiln_scalar(KILN_F32, 2)) : g;
  return out[0] ? 0 : -1;
}

// The error of a call of a fresh staged function on (p, idx) with backend.
std::string staged_error(const char *backend, GatherCase *c, kiln_tensor *p, kiln_tensor *idx) {
  BackendEnv env(backend);
  kiln_function *f = kiln_function_new(c->name, gather_body, c, 2, 1);
  kiln_tensor *in[2] = {p, idx}, *out = nullptr;
  kiln_clear_error();
  EXPECT_EQ(kiln_function_call(f, in, &out), -1) << backend;
  std::string msg = kiln_last_error();
  kiln_clear_error();
  kiln_function_free(f);
  return msg;
}

TEST(Index, StagedIndexErrorsReadTheSameCompiledAndInterpreted) {
  Scoped s;
  kiln_tensor *p = make<float>(KILN_F32, {3, 4}, std::vector<float>(12, 0.5f));
  struct {
    kiln_tensor *idx;
    int axis;
    const char *eager;  // the eager message
  } cases[] = {
      {i32({2}, {0, 7}), 0, "gather: indices[1] = 7 is not in [0, 3)"},
      {i64({3}, {0, -1, 9}), 0, "gather: indices[1] = -1 is not in [0, 3)"},
      {i64({2, 2}, {0, 1, 2, 4}), 1, "gather: indices[3] = 4 is not in [0, 4)"},
      {i32({1}, {INT32_MIN}), 1, "gather: indices[0] = -2147483648 is not in [0, 4)"},
  };
  for (auto &k : cases) {
    for (bool fused : {false, true}) {
      GatherCase c = {"gather_fn", k.axis, fused};
      SCOPED_TRACE(std::string(k.eager) + (fused ? ", fused" : ""));
      kiln_clear_error();
      EXPECT_EQ(kiln_gather(p, k.idx, k.axis), nullptr);
      EXPECT_STREQ(kiln_last_error(), k.eager);
      std::string compiled = staged_error("cpu", &c, p, k.idx), interpreted = staged_error("interp", &c, p, k.idx);
      EXPECT_EQ(compiled, interpreted);
      EXPECT_EQ(compiled, std::string("@gather_fn: ") + k.eager);  // the function, then the op's own message
    }
  }
}

}  // namespace
