// reduce_test.cc — reduce_sum/prod/max/min and argmax: hand-computed values
// for every dtype on each axis set of a (2, 3, 4) tensor, keepdims, negative
// axes, empty axes (identities), NaN, ties, large inputs with closed-form
// results (which run the threaded paths), and every bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

using ReduceFn = kiln_tensor *(*)(kiln_tensor *, int, const int *, bool);

const kiln_dtype kNumeric[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64};

// x[i][j][k] = 12i + 4j + k: arange(24) as (2, 3, 4)
VD arange24() {
  VD v(24);
  for (int i = 0; i < 24; i++) v[i] = i;
  return v;
}

// a hand-written (2, 3, 4) tensor for max, min and argmax
const VD kM = {3, -1, 7, 0,  -5, 2, 2,  9, 4,  4, -8, 1,    // i = 0
               6, -2, 0, -3, 1,  8, -6, 5, -4, 3, 7,  -7};  // i = 1
// a (2, 3, 4) tensor of small factors for prod
const VD kP = {1, 2, -1, 1,  3, 1, 1, 2, 1,  -2, 1, 1,   // i = 0
               2, 1, 1,  -1, 1, 1, 2, 1, -1, 1,  3, 2};  // i = 1

struct Case {
  std::vector<int> axes;
  bool all;  // axes NULL
  V64 shape;
  VD expect;
};

void check_cases(const char *name, ReduceFn fn, const VD &input, const std::vector<Case> &cases) {
  for (kiln_dtype dt : kNumeric) {
    for (const Case &c : cases) {
      Scoped s;
      SCOPED_TRACE(std::string(name) + " " + kiln_dtype_name(dt) + " axes " +
                   (c.all ? "NULL" : std::to_string(c.axes.size())));
      kiln_tensor *x = from_values(dt, {2, 3, 4}, input);
      static const int none = 0;  // naxes 0 with axes non-NULL: reduce nothing
      const int *axes = c.all ? nullptr : c.axes.empty() ? &none : c.axes.data();
      kiln_tensor *y = fn(x, (int)c.axes.size(), axes, false);
      ASSERT_NE(y, nullptr) << kiln_last_error();
      EXPECT_EQ(kiln_tensor_dtype(y), dt);
      EXPECT_EQ(shape_of(y), c.shape);
      EXPECT_EQ(values(y), c.expect);
    }
  }
}

// ---- hand-computed values on (2, 3, 4) ----

TEST(Reduce, SumAxisSets) {
  check_cases("reduce_sum", kiln_reduce_sum, arange24(),
              {
                  {{0}, false, {3, 4}, {12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34}},
                  {{1}, false, {2, 4}, {12, 15, 18, 21, 48, 51, 54, 57}},
                  {{2}, false, {2, 3}, {6, 22, 38, 54, 70, 86}},
                  {{0, 2}, false, {3}, {60, 92, 124}},
                  {{}, true, {}, {276}},
                  {{0, 1, 2}, false, {}, {276}},
                  {{}, false, {2, 3, 4}, arange24()},  // no axes: a copy
                  {{-1}, false, {2, 3}, {6, 22, 38, 54, 70, 86}},
                  {{-1, -3}, false, {3}, {60, 92, 124}},
                  {{2, 0}, false, {3}, {60, 92, 124}},
                  {{1, 2}, false, {2}, {66, 210}},
                  {{0, 1}, false, {4}, {60, 66, 72, 78}},
              });
}

TEST(Reduce, ProdAxisSets) {
  check_cases("reduce_prod", kiln_reduce_prod, kP,
              {
                  {{0}, false, {3, 4}, {2, 2, -1, -1, 3, 1, 2, 2, -1, -2, 3, 2}},
                  {{1}, false, {2, 4}, {3, -4, -1, 2, -2, 1, 6, -2}},
                  {{2}, false, {2, 3}, {-2, 6, -2, -2, 2, -6}},
                  {{0, 2}, false, {3}, {4, 12, 12}},
                  {{}, true, {}, {576}},
                  {{}, false, {2, 3, 4}, kP},
                  {{-2}, false, {2, 4}, {3, -4, -1, 2, -2, 1, 6, -2}},
              });
}

TEST(Reduce, MaxAxisSets) {
  check_cases("reduce_max", kiln_reduce_max, kM,
              {
                  {{0}, false, {3, 4}, {6, -1, 7, 0, 1, 8, 2, 9, 4, 4, 7, 1}},
                  {{1}, false, {2, 4}, {4, 4, 7, 9, 6, 8, 7, 5}},
                  {{2}, false, {2, 3}, {7, 9, 4, 6, 8, 7}},
                  {{0, 2}, false, {3}, {7, 9, 7}},
                  {{}, true, {}, {9}},
                  {{}, false, {2, 3, 4}, kM},
                  {{-3, -1}, false, {3}, {7, 9, 7}},
              });
}

TEST(Reduce, MinAxisSets) {
  check_cases("reduce_min", kiln_reduce_min, kM,
              {
                  {{0}, false, {3, 4}, {3, -2, 0, -3, -5, 2, -6, 5, -4, 3, -8, -7}},
                  {{1}, false, {2, 4}, {-5, -1, -8, 0, -4, -2, -6, -7}},
                  {{2}, false, {2, 3}, {-1, -5, -8, -3, -6, -7}},
                  {{0, 2}, false, {3}, {-3, -6, -8}},
                  {{}, true, {}, {-8}},
                  {{}, false, {2, 3, 4}, kM},
                  {{1, -3}, false, {4}, {-5, -2, -8, -7}},
              });
}

TEST(Reduce, Keepdims) {
  Scoped s;
  kiln_tensor *x = from_values(KILN_F32, {2, 3, 4}, arange24());
  kiln_tensor *a = kiln_reduce_sum(x, KILN_AXES(0, 2), true);
  EXPECT_EQ(shape_of(a), (V64{1, 3, 1}));
  EXPECT_EQ(values(a), (VD{60, 92, 124}));
  kiln_tensor *b = kiln_reduce_max(x, 0, nullptr, true);
  EXPECT_EQ(shape_of(b), (V64{1, 1, 1}));
  EXPECT_EQ(values(b), (VD{23}));
  kiln_tensor *c = kiln_reduce_min(x, KILN_AXES(-1), true);
  EXPECT_EQ(shape_of(c), (V64{2, 3, 1}));
  EXPECT_EQ(values(c), (VD{0, 4, 8, 12, 16, 20}));
  int none = 0;
  kiln_tensor *d = kiln_reduce_prod(x, 0, &none, true);
  EXPECT_EQ(shape_of(d), (V64{2, 3, 4}));
  EXPECT_EQ(values(d), arange24());
}

TEST(Reduce, ScalarAndUnitDims) {
  Scoped s;
  kiln_tensor *sc = kiln_scalar(KILN_I64, 5);
  kiln_tensor *y = kiln_reduce_sum(sc, 0, nullptr, false);
  EXPECT_EQ(shape_of(y), V64{});
  EXPECT_EQ(values(y), (VD{5}));
  // reducing only size-1 axes is a copy; size-1 dims between others are skipped
  kiln_tensor *x = from_values(KILN_F64, {2, 1, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(values(kiln_reduce_sum(x, KILN_AXES(1), false)), (VD{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(values(kiln_reduce_sum(x, KILN_AXES(0, 1), false)), (VD{5, 7, 9}));
  EXPECT_EQ(values(kiln_reduce_max(x, KILN_AXES(2), true)), (VD{3, 6}));
  EXPECT_EQ(shape_of(kiln_reduce_max(x, KILN_AXES(2), true)), (V64{2, 1, 1}));
}

TEST(Reduce, GeneralAxisSetsRank4) {
  Scoped s;
  // x = arange(120) as (2, 3, 4, 5): x[a][b][c][d] = 60a + 20b + 5c + d
  VD v(120);
  for (int i = 0; i < 120; i++) v[i] = i;
  for (kiln_dtype dt : kNumeric) {
    SCOPED_TRACE(kiln_dtype_name(dt));
    kiln_tensor *x = from_values(dt, {2, 3, 4, 5}, v);
    // over a and c (8 terms each): 300 + 160b + 8d
    VD e1;
    for (int b = 0; b < 3; b++)
      for (int d = 0; d < 5; d++) e1.push_back(300 + 160 * b + 8 * d);
    kiln_tensor *y1 = kiln_reduce_sum(x, KILN_AXES(0, 2), false);
    EXPECT_EQ(shape_of(y1), (V64{3, 5}));
    EXPECT_EQ(values(y1), e1);
    // over b and d (15 terms each): 900a + 75c + 330
    kiln_tensor *y2 = kiln_reduce_sum(x, KILN_AXES(1, 3), false);
    EXPECT_EQ(shape_of(y2), (V64{2, 4}));
    EXPECT_EQ(values(y2), (VD{330, 405, 480, 555, 1230, 1305, 1380, 1455}));
    // max over b and d is at b = 2, d = 4: 60a + 5c + 44; min at b = d = 0
    EXPECT_EQ(values(kiln_reduce_max(x, KILN_AXES(1, 3), false)),
              (VD{44, 49, 54, 59, 104, 109, 114, 119}));
    EXPECT_EQ(values(kiln_reduce_min(x, KILN_AXES(3, 1), false)),
              (VD{0, 5, 10, 15, 60, 65, 70, 75}));
    // over a, b, d: 2*3*5 terms: 60*3*5 + 20*3*2*5 + 30*5c + 10*3*2 = 1560 + 150c
    EXPECT_EQ(values(kiln_reduce_sum(x, KILN_AXES(0, 1, 3), false)), (VD{1560, 1710, 1860, 2010}));
  }
}

// ---- empty axes and identities ----

TEST(Reduce, EmptyGivesIdentity) {
  Scoped s;
  const double inf = std::numeric_limits<double>::infinity();
  struct {
    kiln_dtype dt;
    double lo, hi;  // the dtype's range: max's and min's identities
  } types[] = {{KILN_F32, -inf, inf},
               {KILN_F64, -inf, inf},
               {KILN_I32, (double)INT32_MIN, (double)INT32_MAX},
               {KILN_I64, (double)INT64_MIN, (double)INT64_MAX}};
  for (auto &t : types) {
    SCOPED_TRACE(kiln_dtype_name(t.dt));
    kiln_tensor *x = kiln_zeros(t.dt, KILN_SHAPE(2, 0, 3));
    kiln_tensor *y = kiln_reduce_sum(x, KILN_AXES(1), false);
    EXPECT_EQ(shape_of(y), (V64{2, 3}));
    EXPECT_EQ(values(y), (VD{0, 0, 0, 0, 0, 0}));
    EXPECT_EQ(values(kiln_reduce_prod(x, KILN_AXES(1), false)), (VD{1, 1, 1, 1, 1, 1}));
    EXPECT_EQ(values(kiln_reduce_max(x, KILN_AXES(1), true)), (VD(6, t.lo)));
    EXPECT_EQ(shape_of(kiln_reduce_max(x, KILN_AXES(1), true)), (V64{2, 1, 3}));
    EXPECT_EQ(values(kiln_reduce_min(x, 0, nullptr, false)), (VD{t.hi}));
    // reducing a non-empty axis of an empty tensor gives an empty result
    kiln_tensor *z = kiln_reduce_sum(x, KILN_AXES(2), false);
    ASSERT_NE(z, nullptr) << kiln_last_error();
    EXPECT_EQ(shape_of(z), (V64{2, 0}));
    EXPECT_EQ(kiln_tensor_size(kiln_reduce_max(x, KILN_AXES(0), false)), 0);
  }
  // exact bit patterns for the integer extremes
  kiln_tensor *e64 = kiln_zeros(KILN_I64, KILN_SHAPE(0));
  EXPECT_EQ(read<int64_t>(kiln_reduce_max(e64, 0, nullptr, false)),
            (std::vector<int64_t>{INT64_MIN}));
  EXPECT_EQ(read<int64_t>(kiln_reduce_min(e64, 0, nullptr, false)),
            (std::vector<int64_t>{INT64_MAX}));
}

// ---- NaN ----

TEST(Reduce, NanPropagates) {
  Scoped s;
  const double nan = std::nan("");
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    SCOPED_TRACE(kiln_dtype_name(dt));
    kiln_tensor *x = from_values(dt, {2, 3}, {1, nan, 3, 4, 5, 6});
    for (ReduceFn fn : {kiln_reduce_max, kiln_reduce_min, kiln_reduce_sum, kiln_reduce_prod}) {
      VD rows = values(fn(x, KILN_AXES(1), false));
      ASSERT_EQ(rows.size(), 2u);
      EXPECT_TRUE(std::isnan(rows[0]));
      EXPECT_FALSE(std::isnan(rows[1]));
      VD cols = values(fn(x, KILN_AXES(0), false));
      ASSERT_EQ(cols.size(), 3u);
      EXPECT_FALSE(std::isnan(cols[0]));
      EXPECT_TRUE(std::isnan(cols[1]));
      EXPECT_FALSE(std::isnan(cols[2]));
    }
    EXPECT_EQ(values(kiln_reduce_max(x, KILN_AXES(0), false))[2], 6);
    EXPECT_EQ(values(kiln_reduce_min(x, KILN_AXES(0), false))[0], 1);
    // NaN first, NaN last, and in a long row (past the vector lanes)
    EXPECT_TRUE(
        std::isnan(values(kiln_reduce_max(from_values(dt, {3}, {nan, 1, 2}), 0, nullptr, false))[0]));
    EXPECT_TRUE(
        std::isnan(values(kiln_reduce_min(from_values(dt, {3}, {1, 2, nan}), 0, nullptr, false))[0]));
    VD big(1000, 1.0);
    big[777] = nan;
    big[3] = 50;
    EXPECT_TRUE(std::isnan(values(kiln_reduce_max(from_values(dt, {1000}, big), 0, nullptr, false))[0]));
    EXPECT_TRUE(std::isnan(values(kiln_reduce_min(from_values(dt, {1000}, big), 0, nullptr, false))[0]));
    // infinities are ordinary values
    kiln_tensor *inf = from_values(dt, {3}, {-INFINITY, -INFINITY, -INFINITY});
    EXPECT_EQ(values(kiln_reduce_max(inf, 0, nullptr, false)), (VD{-INFINITY}));
  }
}

// ---- integer wrap-around ----

TEST(Reduce, IntegerWraps) {
  Scoped s;
  kiln_tensor *a = from_values(KILN_I32, {2}, {2147483647, 1});
  EXPECT_EQ(read<int32_t>(kiln_reduce_sum(a, 0, nullptr, false)),
            (std::vector<int32_t>{INT32_MIN}));
  kiln_tensor *b = from_values(KILN_I32, {2}, {65536, 65537});  // 2^32 + 2^16
  EXPECT_EQ(read<int32_t>(kiln_reduce_prod(b, 0, nullptr, false)), (std::vector<int32_t>{65536}));
  std::vector<int64_t> big = {INT64_MAX, 2};
  kiln_tensor *c = kiln_tensor_new(KILN_I64, KILN_SHAPE(2), big.data());
  EXPECT_EQ(read<int64_t>(kiln_reduce_sum(c, 0, nullptr, false)),
            (std::vector<int64_t>{INT64_MIN + 1}));
  EXPECT_EQ(read<int64_t>(kiln_reduce_prod(c, 0, nullptr, false)), (std::vector<int64_t>{-2}));
}

// ---- argmax ----

TEST(Reduce, ArgmaxEachAxisAndDtype) {
  for (kiln_dtype dt : kNumeric) {
    Scoped s;
    SCOPED_TRACE(kiln_dtype_name(dt));
    kiln_tensor *x = from_values(dt, {2, 3, 4}, kM);
    kiln_tensor *a2 = kiln_argmax(x, 2);
    EXPECT_EQ(kiln_tensor_dtype(a2), KILN_I64);
    EXPECT_EQ(shape_of(a2), (V64{2, 3}));
    EXPECT_EQ(read<int64_t>(a2), (V64{2, 3, 0, 0, 1, 2}));  // row (4, 4, -8, 1): the first 4
    kiln_tensor *a0 = kiln_argmax(x, 0);
    EXPECT_EQ(shape_of(a0), (V64{3, 4}));
    EXPECT_EQ(read<int64_t>(a0), (V64{1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0}));
    kiln_tensor *a1 = kiln_argmax(x, -2);
    EXPECT_EQ(shape_of(a1), (V64{2, 4}));
    EXPECT_EQ(read<int64_t>(a1), (V64{2, 2, 0, 1, 0, 1, 2, 1}));
  }
}

TEST(Reduce, ArgmaxTiesFirstWins) {
  Scoped s;
  kiln_tensor *x = from_values(KILN_F32, {3, 2}, {1, 5, 5, 5, 5, 1});
  EXPECT_EQ(read<int64_t>(kiln_argmax(x, 0)), (V64{1, 0}));
  EXPECT_EQ(read<int64_t>(kiln_argmax(x, 1)), (V64{1, 0, 0}));
  // in long rows the tie spans blocks: 7 at 300 and 700, 9 at 420 and 999
  for (kiln_dtype dt : kNumeric) {
    VD v(1000, 0);
    v[300] = v[700] = 7;
    EXPECT_EQ(read<int64_t>(kiln_argmax(from_values(dt, {1000}, v), 0)), (V64{300}))
        << kiln_dtype_name(dt);
    v[999] = v[420] = 9;
    EXPECT_EQ(read<int64_t>(kiln_argmax(from_values(dt, {1000}, v), 0)), (V64{420}))
        << kiln_dtype_name(dt);
    VD neg(700, -3);
    EXPECT_EQ(read<int64_t>(kiln_argmax(from_values(dt, {700}, neg), -1)), (V64{0}))
        << kiln_dtype_name(dt);
  }
  // -0 and 0 compare equal: the first one wins
  kiln_tensor *z = from_values(KILN_F64, {2}, {-0.0, 0.0});
  EXPECT_EQ(read<int64_t>(kiln_argmax(z, 0)), (V64{0}));
}

TEST(Reduce, ArgmaxNanIsTheMaximum) {
  Scoped s;
  const double nan = std::nan("");
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    SCOPED_TRACE(kiln_dtype_name(dt));
    EXPECT_EQ(read<int64_t>(kiln_argmax(from_values(dt, {4}, {1, nan, 5, nan}), 0)), (V64{1}));
    EXPECT_EQ(read<int64_t>(kiln_argmax(from_values(dt, {3}, {nan, 9, 1}), 0)), (V64{0}));
    // columns: NaN in row 2 of column 0, in rows 1 and 2 of column 1
    kiln_tensor *c = from_values(dt, {3, 2}, {4, 0, 1, nan, nan, nan});
    EXPECT_EQ(read<int64_t>(kiln_argmax(c, 0)), (V64{2, 1}));
    VD v(1000, 0);
    v[10] = 100;
    v[900] = nan;
    v[950] = nan;
    EXPECT_EQ(read<int64_t>(kiln_argmax(from_values(dt, {1000}, v), 0)), (V64{900}));
  }
}

// ---- large inputs (threaded paths), closed-form results ----

TEST(Reduce, LargeArangeSums) {
  Scoped s;
  const int64_t n = 300000;  // sum 0..n-1 = n(n-1)/2 = 44999850000
  VD v(n);
  for (int64_t i = 0; i < n; i++) v[i] = (double)i;
  kiln_tensor *f32 = from_values(KILN_F32, {n}, v);
  // f32 sums must not lose the low bits along the way: only the final rounding
  EXPECT_EQ(read<float>(kiln_reduce_sum(f32, 0, nullptr, false)),
            (std::vector<float>{44999850000.0f}));
  EXPECT_EQ(read<double>(kiln_reduce_sum(from_values(KILN_F64, {n}, v), 0, nullptr, false)),
            (std::vector<double>{44999850000.0}));
  EXPECT_EQ(read<int64_t>(kiln_reduce_sum(from_values(KILN_I64, {n}, v), 0, nullptr, false)),
            (std::vector<int64_t>{44999850000}));
  // i32 wraps: 44999850000 - 10 * 2^32 = 2050177040
  EXPECT_EQ(read<int32_t>(kiln_reduce_sum(from_values(KILN_I32, {n}, v), 0, nullptr, false)),
            (std::vector<int32_t>{2050177040}));
  EXPECT_EQ(values(kiln_reduce_max(f32, 0, nullptr, false)), (VD{299999}));
  EXPECT_EQ(values(kiln_reduce_min(f32, 0, nullptr, false)), (VD{0}));
  EXPECT_EQ(read<int64_t>(kiln_argmax(f32, 0)), (V64{299999}));
}

TEST(Reduce, LargeRowsAndColumns) {
  Scoped s;
  // x[r][c] = r + 1000c for (100000, 3): columns sum to n(n-1)/2 + 1000cn
  const int64_t n = 100000;
  VD v(n * 3), t(n * 3);
  for (int64_t r = 0; r < n; r++)
    for (int c = 0; c < 3; c++) v[r * 3 + c] = t[c * n + r] = (double)(r + 1000 * c);
  const double base = 4999950000.0;  // n(n-1)/2
  VD expect = {base, base + 1e8, base + 2e8};
  for (kiln_dtype dt : {KILN_F64, KILN_I64, KILN_F32}) {
    SCOPED_TRACE(kiln_dtype_name(dt));
    VD want = expect;
    if (dt == KILN_F32)
      for (double &w : want) w = (double)(float)w;  // one rounding at the end
    kiln_tensor *cols = from_values(dt, {n, 3}, v);
    EXPECT_EQ(values(kiln_reduce_sum(cols, KILN_AXES(0), false)), want);
    kiln_tensor *rows = from_values(dt, {3, n}, t);  // the transpose: row sums
    EXPECT_EQ(values(kiln_reduce_sum(rows, KILN_AXES(1), false)), want);
    EXPECT_EQ(values(kiln_reduce_max(cols, KILN_AXES(0), false)), (VD{99999, 100999, 101999}));
    EXPECT_EQ(values(kiln_reduce_min(rows, KILN_AXES(-1), false)), (VD{0, 1000, 2000}));
    EXPECT_EQ(read<int64_t>(kiln_argmax(cols, 0)), (V64{n - 1, n - 1, n - 1}));
    EXPECT_EQ(read<int64_t>(kiln_argmax(rows, 1)), (V64{n - 1, n - 1, n - 1}));
  }
}

TEST(Reduce, LargeMixedAxes) {
  Scoped s;
  // x = arange(300000) as (1000, 3, 100): x[a][b][c] = 300a + 100b + c
  const int64_t n = 300000;
  VD v(n);
  for (int64_t i = 0; i < n; i++) v[i] = (double)i;
  for (kiln_dtype dt : {KILN_F64, KILN_I64}) {
    SCOPED_TRACE(kiln_dtype_name(dt));
    kiln_tensor *x = from_values(dt, {1000, 3, 100}, v);
    // over a and c: 300*100*499500 + 1e5*100b + 1000*4950 = 14989950000 + 1e7 b
    EXPECT_EQ(values(kiln_reduce_sum(x, KILN_AXES(0, 2), false)),
              (VD{14989950000.0, 14999950000.0, 15009950000.0}));
    EXPECT_EQ(values(kiln_reduce_max(x, KILN_AXES(0, 2), false)), (VD{299799, 299899, 299999}));
    // over b: 900a + 300 + 3c, checked at a few places
    kiln_tensor *y = kiln_reduce_sum(x, KILN_AXES(1), false);
    EXPECT_EQ(shape_of(y), (V64{1000, 100}));
    VD yv = values(y);
    ASSERT_EQ(yv.size(), 100000u);
    EXPECT_EQ(yv[0], 300);
    EXPECT_EQ(yv[99], 597);
    EXPECT_EQ(yv[100 * 999 + 50], 900 * 999 + 300 + 150);
    // over a: sum_a (300a + k) = 300*499500 + 1000k for k = 100b + c
    VD z = values(kiln_reduce_sum(x, KILN_AXES(0), false));
    ASSERT_EQ(z.size(), 300u);
    EXPECT_EQ(z[0], 149850000);
    EXPECT_EQ(z[299], 149850000 + 299000);
    // argmax over the middle axis is always b = 2
    EXPECT_EQ(values(kiln_reduce_sum(kiln_argmax(x, 1), 0, nullptr, false)),
              (VD{2.0 * 1000 * 100}));
  }
}

TEST(Reduce, LargeProd) {
  Scoped s;
  VD v(200000, 1);
  v[5] = 2;
  v[150000] = -3;
  v[199999] = -1;
  for (kiln_dtype dt : kNumeric)
    EXPECT_EQ(values(kiln_reduce_prod(from_values(dt, {200000}, v), 0, nullptr, false)), (VD{6}))
        << kiln_dtype_name(dt);
}

// ---- every axis subset against a naive loop written here ----

// The reduction of x (shape) over the axes in mask, by visiting every element.
VD naive_reduce(const VD &x, const V64 &shape, unsigned mask, int op) {
  int rank = (int)shape.size();
  int64_t out_n = 1;
  for (int d = 0; d < rank; d++)
    if (!(mask >> d & 1)) out_n *= shape[d];
  const double init[] = {0, 1, -INFINITY, INFINITY};
  VD out(out_n, init[op]);
  for (int64_t i = 0; i < (int64_t)x.size(); i++) {
    int64_t rest = i, o = 0, scale = 1;
    for (int d = rank - 1; d >= 0; d--) {
      int64_t idx = rest % shape[d];
      rest /= shape[d];
      if (!(mask >> d & 1)) {
        o += idx * scale;
        scale *= shape[d];
      }
    }
    double &r = out[o];
    if (op == 0) r += x[i];
    if (op == 1) r *= x[i];
    if (op == 2) r = std::fmax(r, x[i]);
    if (op == 3) r = std::fmin(r, x[i]);
  }
  return out;
}

// argmax along axis by a plain scan
V64 naive_argmax(const VD &x, const V64 &shape, int axis) {
  int64_t outer = 1, inner = 1, n = shape[axis];
  for (int d = 0; d < axis; d++) outer *= shape[d];
  for (int d = axis + 1; d < (int)shape.size(); d++) inner *= shape[d];
  V64 out;
  for (int64_t o = 0; o < outer; o++)
    for (int64_t j = 0; j < inner; j++) {
      int64_t best = 0;
      for (int64_t k = 1; k < n; k++)
        if (x[(o * n + k) * inner + j] > x[(o * n + best) * inner + j]) best = k;
      out.push_back(best);
    }
  return out;
}

TEST(Reduce, EveryAxisSubsetMatchesNaive) {
  const ReduceFn fns[] = {kiln_reduce_sum, kiln_reduce_prod, kiln_reduce_max, kiln_reduce_min};
  const char *names[] = {"sum", "prod", "max", "min"};
  const V64 shapes[] = {{3, 1, 4, 5}, {2, 3, 1, 7}, {1, 1, 1, 1}, {5, 2, 3, 2}, {40, 3, 100, 7}};
  for (const V64 &shape : shapes) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    // small integers for sum, max and min; +-1 for prod: every result is exact
    VD v(n), signs(n);
    uint32_t h = 12345;
    for (int64_t i = 0; i < n; i++) {
      h = h * 1664525u + 1013904223u;
      v[i] = (double)((int)(h >> 24) % 9 - 4);
      signs[i] = (h >> 13) & 1 ? 1 : -1;
    }
    for (kiln_dtype dt : kNumeric) {
      Scoped s;
      kiln_tensor *x = from_values(dt, shape, v), *xs = from_values(dt, shape, signs);
      for (unsigned mask = 0; mask < 16; mask++) {
        std::vector<int> axes;
        for (int d = 0; d < 4; d++)
          if (mask >> d & 1) axes.push_back(d - 4 * (d % 2));  // odd axes negative
        static const int none = 0;
        const int *ap = axes.empty() ? &none : axes.data();
        for (int op = 0; op < 4; op++) {
          SCOPED_TRACE(std::string(names[op]) + " " + kiln_dtype_name(dt) + " shape " +
                       std::to_string(shape[0]) + "x" + std::to_string(shape[1]) + "x" +
                       std::to_string(shape[2]) + "x" + std::to_string(shape[3]) + " mask " +
                       std::to_string(mask));
          const VD &in = op == 1 ? signs : v;
          kiln_tensor *y = fns[op](op == 1 ? xs : x, (int)axes.size(), ap, mask % 3 == 0);
          ASSERT_NE(y, nullptr) << kiln_last_error();
          EXPECT_EQ(values(y), naive_reduce(in, shape, mask, op));
        }
      }
      for (int axis = 0; axis < 4; axis++)
        EXPECT_EQ(read<int64_t>(kiln_argmax(x, axis)), naive_argmax(v, shape, axis))
            << kiln_dtype_name(dt) << " axis " << axis;
    }
  }
}

// ---- bad inputs ----

TEST(Reduce, BadInputs) {
  Scoped s;
  kiln_tensor *x = from_values(KILN_F32, {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(kiln_reduce_sum(x, KILN_AXES(3), false), nullptr);
  EXPECT_STREQ(kiln_last_error(), "reduce_sum: axis 3 is out of range for rank 2");
  EXPECT_EQ(kiln_reduce_max(x, KILN_AXES(-3), false), nullptr);
  EXPECT_STREQ(kiln_last_error(), "reduce_max: axis -3 is out of range for rank 2");
  EXPECT_EQ(kiln_reduce_min(x, KILN_AXES(0, 0), false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_min: axis 0 is repeated"));
  EXPECT_EQ(kiln_reduce_prod(x, KILN_AXES(1, -1), false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_prod: axis"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("repeated"));
  EXPECT_EQ(kiln_reduce_sum(x, KILN_AXES(0, 1, 0), false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_sum: 3 axes given for rank 2"));

  kiln_clear_error();
  EXPECT_EQ(kiln_reduce_sum(nullptr, 0, nullptr, false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_sum: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_argmax(nullptr, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("argmax: "));

  kiln_tensor *b = kiln_zeros(KILN_BOOL, KILN_SHAPE(3));
  EXPECT_EQ(kiln_reduce_sum(b, 0, nullptr, false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_sum: dtype bool is not supported"));
  EXPECT_EQ(kiln_argmax(b, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("argmax: dtype bool is not supported"));
  kiln_tensor *h = kiln_zeros(KILN_F16, KILN_SHAPE(3));
  EXPECT_EQ(kiln_reduce_max(h, 0, nullptr, false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_max: dtype f16 is not supported"));
  kiln_tensor *bf = kiln_zeros(KILN_BF16, KILN_SHAPE(3));
  EXPECT_EQ(kiln_reduce_prod(bf, 0, nullptr, false), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_prod: dtype bf16 is not supported"));

  EXPECT_EQ(kiln_argmax(x, 2), nullptr);
  EXPECT_STREQ(kiln_last_error(), "argmax: axis 2 is out of range for rank 2");
  EXPECT_EQ(kiln_argmax(x, -3), nullptr);
  EXPECT_STREQ(kiln_last_error(), "argmax: axis -3 is out of range for rank 2");
  EXPECT_EQ(kiln_argmax(kiln_zeros(KILN_F32, KILN_SHAPE(2, 0)), 1), nullptr);
  EXPECT_STREQ(kiln_last_error(), "argmax: axis 1 is empty");
  EXPECT_EQ(kiln_argmax(kiln_scalar(KILN_F32, 1), 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("argmax: "));
  // argmax over a non-empty axis of an empty tensor is an empty result
  kiln_tensor *e = kiln_argmax(kiln_zeros(KILN_F32, KILN_SHAPE(0, 3)), 1);
  ASSERT_NE(e, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(e), (V64{0}));
}

}  // namespace
