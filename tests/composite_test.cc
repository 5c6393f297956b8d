// composite_test.cc — the composite ops (square, reduce_mean, expand_dims,
// squeeze, index, stack, split, one_hot, softmax, log_softmax, the two
// cross-entropies, clip_by_norm) against hand-computed values, their
// ownership (no intermediate survives the call), and every bad input.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

// Checks dtype, shape and values (within tol) of t.
void expect_tensor(const kiln_tensor *t, kiln_dtype dt, std::vector<int64_t> shape,
                   std::vector<double> want, double tol = 0) {
  ASSERT_NE(t, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_dtype(t), dt) << kiln_dtype_name(kiln_tensor_dtype(t));
  EXPECT_EQ(shape_of(t), shape);
  std::vector<double> got = values(t);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); i++) {
    if (std::isnan(want[i]))
      EXPECT_TRUE(std::isnan(got[i])) << "element " << i << " = " << got[i];
    else if (tol == 0)
      EXPECT_EQ(got[i], want[i]) << "element " << i;
    else
      EXPECT_NEAR(got[i], want[i], tol) << "element " << i;
  }
}

// The call failed: NULL, and the message begins with prefix.
#define EXPECT_FAILS(call, prefix)                              \
  do {                                                          \
    kiln_clear_error();                                         \
    EXPECT_EQ((call), nullptr);                                 \
    EXPECT_THAT(kiln_last_error(), StartsWith(prefix));         \
  } while (0)

#define EXPECT_ERROR(call, message)                             \
  do {                                                          \
    kiln_clear_error();                                         \
    EXPECT_EQ((call), nullptr);                                 \
    EXPECT_STREQ(kiln_last_error(), message);                   \
  } while (0)

// softmax([1, 2, 3]) and log_softmax([1, 2, 3]) by hand: with
// s = 1 + e^-1 + e^-2 = 1.5032147244080550, p = e^(x-3) / s and
// log p = x - 3 - log s, log s = 0.4076059644443806.
const double kP[3] = {0.09003057317038046, 0.24472847105479764, 0.6652409557748219};
const double kLogP[3] = {-2.4076059644443806, -1.4076059644443806, -0.4076059644443806};
const double kLn2 = 0.6931471805599453, kLn3 = 1.0986122886681098;

// ---- square ----

TEST(Composite, Square) {
  Scoped s;
  expect_tensor(kiln_square(f32({3}, {-3, 0.5f, 4})), KILN_F32, {3}, {9, 0.25, 16});
  expect_tensor(kiln_square(f64({2, 1}, {-1.5, 1e100})), KILN_F64, {2, 1}, {2.25, 1e200}, 1e186);
  expect_tensor(kiln_square(i32({2}, {-3, 46340})), KILN_I32, {2}, {9, 2147395600});
  expect_tensor(kiln_square(i64({1}, {-3000000000LL})), KILN_I64, {1}, {9e18});
  expect_tensor(kiln_square(f32({0}, {})), KILN_F32, {0}, {});
  EXPECT_ERROR(kiln_square(make<uint8_t>(KILN_BOOL, {1}, {1})),
               "square: dtype bool is not supported (f32, f64, i32, i64)");
  EXPECT_FAILS(kiln_square(make<uint16_t>(KILN_F16, {1}, {0x3C00})), "square: dtype f16");
  EXPECT_ERROR(kiln_square(nullptr), "square: input is NULL");
}

// ---- reduce_mean ----

TEST(Composite, ReduceMeanFloat) {
  Scoped s;
  kiln_tensor *x = f32({2, 2}, {1, 2, 3, 4});
  expect_tensor(kiln_reduce_mean(x, 0, nullptr, false), KILN_F32, {}, {2.5});
  expect_tensor(kiln_reduce_mean(x, 0, nullptr, true), KILN_F32, {1, 1}, {2.5});
  expect_tensor(kiln_reduce_mean(x, KILN_AXES(0), false), KILN_F32, {2}, {2, 3});
  expect_tensor(kiln_reduce_mean(x, KILN_AXES(-1), true), KILN_F32, {2, 1}, {1.5, 3.5});
  expect_tensor(kiln_reduce_mean(x, KILN_AXES(1, 0), false), KILN_F32, {}, {2.5});
  kiln_tensor *y = f64({2, 3}, {1, 2, 4, 0.5, 0.25, 0.125});
  expect_tensor(kiln_reduce_mean(y, KILN_AXES(1), false), KILN_F64, {2}, {7.0 / 3, 0.875 / 3}, 1e-15);
  expect_tensor(kiln_reduce_mean(kiln_scalar(KILN_F64, 4), 0, nullptr, false), KILN_F64, {}, {4});
}

TEST(Composite, ReduceMeanEmpty) {
  Scoped s;
  // NaN = 0/0 for an empty float axis; an empty result stays empty
  expect_tensor(kiln_reduce_mean(kiln_zeros(KILN_F32, KILN_SHAPE(2, 0)), KILN_AXES(1), false), KILN_F32,
                {2}, {NAN, NAN});
  expect_tensor(kiln_reduce_mean(kiln_zeros(KILN_F32, KILN_SHAPE(2, 0)), KILN_AXES(0), false), KILN_F32,
                {0}, {});
  expect_tensor(kiln_reduce_mean(kiln_zeros(KILN_I32, KILN_SHAPE(0, 3)), KILN_AXES(1), false), KILN_I32,
                {0}, {});
  EXPECT_ERROR(kiln_reduce_mean(kiln_zeros(KILN_I64, KILN_SHAPE(2, 0)), KILN_AXES(1), false),
               "reduce_mean: the mean of an empty axis is undefined for i64");
}

TEST(Composite, ReduceMeanIntegerTruncates) {
  Scoped s;
  kiln_tensor *x = i32({2, 2}, {1, 2, 3, 6});
  expect_tensor(kiln_reduce_mean(x, KILN_AXES(1), false), KILN_I32, {2}, {1, 4});  // 1.5, 4.5
  expect_tensor(kiln_reduce_mean(x, 0, nullptr, false), KILN_I32, {}, {3});        // 12 / 4
  kiln_tensor *y = i64({2}, {-1, -2});
  expect_tensor(kiln_reduce_mean(y, 0, nullptr, false), KILN_I64, {}, {-1});  // -1.5 toward zero
}

TEST(Composite, ReduceMeanErrors) {
  Scoped s;
  kiln_tensor *x = f32({2, 2}, {1, 2, 3, 4});
  EXPECT_ERROR(kiln_reduce_mean(x, KILN_AXES(2), false), "reduce_mean: axis 2 is out of range for rank 2");
  EXPECT_ERROR(kiln_reduce_mean(x, KILN_AXES(0, -2), false), "reduce_mean: axis -2 is repeated");
  EXPECT_ERROR(kiln_reduce_mean(x, 3, (const int[]){0, 1, 0}, false), "reduce_mean: 3 axes given for rank 2");
  EXPECT_ERROR(kiln_reduce_mean(make<uint8_t>(KILN_BOOL, {1}, {1}), 0, nullptr, false),
               "reduce_mean: dtype bool is not supported (f32, f64, i32, i64)");
  EXPECT_FAILS(kiln_reduce_mean(make<uint16_t>(KILN_BF16, {1}, {0}), 0, nullptr, false),
               "reduce_mean: dtype bf16 is not supported");
  EXPECT_ERROR(kiln_reduce_mean(nullptr, 0, nullptr, false), "reduce_mean: input is NULL");
}

// ---- expand_dims, squeeze, index ----

TEST(Composite, ExpandDims) {
  Scoped s;
  kiln_tensor *x = i32({2, 3}, {1, 2, 3, 4, 5, 6});
  std::vector<double> v = {1, 2, 3, 4, 5, 6};
  expect_tensor(kiln_expand_dims(x, 0), KILN_I32, {1, 2, 3}, v);
  expect_tensor(kiln_expand_dims(x, 1), KILN_I32, {2, 1, 3}, v);
  expect_tensor(kiln_expand_dims(x, 2), KILN_I32, {2, 3, 1}, v);
  expect_tensor(kiln_expand_dims(x, -1), KILN_I32, {2, 3, 1}, v);
  expect_tensor(kiln_expand_dims(x, -3), KILN_I32, {1, 2, 3}, v);
  expect_tensor(kiln_expand_dims(kiln_scalar(KILN_F32, 7), 0), KILN_F32, {1}, {7});
  expect_tensor(kiln_expand_dims(kiln_zeros(KILN_F32, KILN_SHAPE(0)), 0), KILN_F32, {1, 0}, {});
  EXPECT_ERROR(kiln_expand_dims(x, 3), "expand_dims: axis 3 is out of range for rank 2 (expected [-3, 2])");
  EXPECT_ERROR(kiln_expand_dims(x, -4), "expand_dims: axis -4 is out of range for rank 2 (expected [-3, 2])");
  kiln_tensor *r8 = kiln_zeros(KILN_F32, KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1));
  EXPECT_FAILS(kiln_expand_dims(r8, 0), "expand_dims: the result would have rank 9");
  EXPECT_ERROR(kiln_expand_dims(nullptr, 0), "expand_dims: input is NULL");
}

TEST(Composite, Squeeze) {
  Scoped s;
  kiln_tensor *x = f32({2, 1, 3}, {1, 2, 3, 4, 5, 6});
  std::vector<double> v = {1, 2, 3, 4, 5, 6};
  expect_tensor(kiln_squeeze(x, 1), KILN_F32, {2, 3}, v);
  expect_tensor(kiln_squeeze(x, -2), KILN_F32, {2, 3}, v);
  expect_tensor(kiln_squeeze(make<uint8_t>(KILN_BOOL, {1}, {1}), 0), KILN_BOOL, {}, {1});
  expect_tensor(kiln_squeeze(kiln_zeros(KILN_I64, KILN_SHAPE(0, 1)), 1), KILN_I64, {0}, {});
  EXPECT_ERROR(kiln_squeeze(f32({2, 3}, {1, 2, 3, 4, 5, 6}), 1), "squeeze: axis 1 has size 3, not 1");
  EXPECT_ERROR(kiln_squeeze(x, -3), "squeeze: axis -3 has size 2, not 1");
  EXPECT_ERROR(kiln_squeeze(x, 3), "squeeze: axis 3 is out of range for rank 3");
  EXPECT_ERROR(kiln_squeeze(kiln_scalar(KILN_F32, 1), 0), "squeeze: axis 0 is out of range for rank 0");
  EXPECT_ERROR(kiln_squeeze(nullptr, 0), "squeeze: input is NULL");
}

TEST(Composite, Index) {
  Scoped s;
  kiln_tensor *x = f32({3, 2}, {1, 2, 3, 4, 5, 6});
  expect_tensor(kiln_index(x, 0), KILN_F32, {2}, {1, 2});
  expect_tensor(kiln_index(x, 1), KILN_F32, {2}, {3, 4});
  expect_tensor(kiln_index(x, -1), KILN_F32, {2}, {5, 6});
  expect_tensor(kiln_index(x, -3), KILN_F32, {2}, {1, 2});
  expect_tensor(kiln_index(i64({3}, {7, 8, 9}), 2), KILN_I64, {}, {9});
  kiln_tensor *cube = i32({2, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7});
  expect_tensor(kiln_index(cube, 1), KILN_I32, {2, 2}, {4, 5, 6, 7});
  expect_tensor(kiln_index(kiln_zeros(KILN_F32, KILN_SHAPE(2, 0)), 1), KILN_F32, {0}, {});
  EXPECT_ERROR(kiln_index(x, 5), "index: i = 5 is not in [-3, 3)");
  EXPECT_ERROR(kiln_index(x, 3), "index: i = 3 is not in [-3, 3)");
  EXPECT_ERROR(kiln_index(x, -4), "index: i = -4 is not in [-3, 3)");
  EXPECT_ERROR(kiln_index(kiln_zeros(KILN_F32, KILN_SHAPE(0)), 0), "index: i = 0 is not in [0, 0)");
  EXPECT_ERROR(kiln_index(kiln_scalar(KILN_F32, 1), 0), "index: cannot index a scalar (rank 0)");
  EXPECT_ERROR(kiln_index(nullptr, 0), "index: input is NULL");
}

// ---- stack, split ----

TEST(Composite, Stack) {
  Scoped s;
  kiln_tensor *a = f32({2}, {1, 2}), *b = f32({2}, {3, 4}), *c = f32({2}, {5, 6});
  kiln_tensor *abc[3] = {a, b, c};
  expect_tensor(kiln_stack(3, abc, 0), KILN_F32, {3, 2}, {1, 2, 3, 4, 5, 6});
  expect_tensor(kiln_stack(3, abc, 1), KILN_F32, {2, 3}, {1, 3, 5, 2, 4, 6});
  expect_tensor(kiln_stack(3, abc, -1), KILN_F32, {2, 3}, {1, 3, 5, 2, 4, 6});
  expect_tensor(kiln_stack(3, abc, -2), KILN_F32, {3, 2}, {1, 2, 3, 4, 5, 6});
  expect_tensor(kiln_stack(1, abc, 0), KILN_F32, {1, 2}, {1, 2});
  kiln_tensor *sc[2] = {kiln_scalar(KILN_I64, 4), kiln_scalar(KILN_I64, -5)};
  expect_tensor(kiln_stack(2, sc, 0), KILN_I64, {2}, {4, -5});
  kiln_tensor *m[2] = {i32({2, 2}, {1, 2, 3, 4}), i32({2, 2}, {5, 6, 7, 8})};
  expect_tensor(kiln_stack(2, m, 1), KILN_I32, {2, 2, 2}, {1, 2, 5, 6, 3, 4, 7, 8});
  expect_tensor(kiln_stack(2, m, 2), KILN_I32, {2, 2, 2}, {1, 5, 2, 6, 3, 7, 4, 8});
  kiln_tensor *e[2] = {kiln_zeros(KILN_F32, KILN_SHAPE(0)), kiln_zeros(KILN_F32, KILN_SHAPE(0))};
  expect_tensor(kiln_stack(2, e, 0), KILN_F32, {2, 0}, {});
}

TEST(Composite, StackErrors) {
  Scoped s;
  kiln_tensor *a = f32({2}, {1, 2});
  kiln_tensor *bad_shape[2] = {a, f32({3}, {1, 2, 3})};
  EXPECT_ERROR(kiln_stack(2, bad_shape, 0), "stack: tensor 1 has shape (3,), tensor 0 has (2,)");
  kiln_tensor *bad_dtype[2] = {a, f64({2}, {1, 2})};
  EXPECT_ERROR(kiln_stack(2, bad_dtype, 0), "stack: tensor 1 has dtype f64, tensor 0 has f32");
  kiln_tensor *ok[2] = {a, a};
  EXPECT_ERROR(kiln_stack(2, ok, 2), "stack: axis 2 is out of range for rank 1 (expected [-2, 1])");
  EXPECT_ERROR(kiln_stack(0, ok, 0), "stack: needs at least one tensor, got 0");
  EXPECT_ERROR(kiln_stack(2, nullptr, 0), "stack: needs at least one tensor, got 0");
  kiln_tensor *with_null[2] = {a, nullptr};
  EXPECT_ERROR(kiln_stack(2, with_null, 0), "stack: input is NULL");
  kiln_fail("first: failure");
  EXPECT_EQ(kiln_stack(2, with_null, 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "first: failure");
}

TEST(Composite, Split) {
  Scoped s;
  kiln_tensor *x = f32({2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  kiln_tensor *out[4] = {nullptr};
  ASSERT_EQ(kiln_split(x, 2, 1, out), 0) << kiln_last_error();
  expect_tensor(out[0], KILN_F32, {2, 2}, {0, 1, 4, 5});
  expect_tensor(out[1], KILN_F32, {2, 2}, {2, 3, 6, 7});
  ASSERT_EQ(kiln_split(x, 2, 0, out), 0) << kiln_last_error();
  expect_tensor(out[0], KILN_F32, {1, 4}, {0, 1, 2, 3});
  expect_tensor(out[1], KILN_F32, {1, 4}, {4, 5, 6, 7});
  ASSERT_EQ(kiln_split(x, 4, -1, out), 0) << kiln_last_error();
  for (int k = 0; k < 4; k++) expect_tensor(out[k], KILN_F32, {2, 1}, {(double)k, (double)k + 4});
  ASSERT_EQ(kiln_split(x, 1, 0, out), 0) << kiln_last_error();
  expect_tensor(out[0], KILN_F32, {2, 4}, {0, 1, 2, 3, 4, 5, 6, 7});
  ASSERT_EQ(kiln_split(kiln_zeros(KILN_I32, KILN_SHAPE(0, 3)), 3, 0, out), 0) << kiln_last_error();
  for (int k = 0; k < 3; k++) expect_tensor(out[k], KILN_I32, {0, 3}, {});
}

TEST(Composite, SplitErrorsLeaveOutUntouched) {
  Scoped s;
  kiln_tensor *x = i64({7}, {0, 1, 2, 3, 4, 5, 6});
  kiln_tensor *sentinel = kiln_scalar(KILN_F32, 0);
  kiln_tensor *out[2] = {sentinel, sentinel};
  auto untouched = [&] { return out[0] == sentinel && out[1] == sentinel; };
  kiln_clear_error();
  EXPECT_EQ(kiln_split(x, 2, 0, out), -1);
  EXPECT_STREQ(kiln_last_error(), "split: dimension 7 of axis 0 is not divisible by 2");
  EXPECT_TRUE(untouched());
  EXPECT_EQ(kiln_split(x, 0, 0, out), -1);
  EXPECT_STREQ(kiln_last_error(), "split: n = 0 must be positive");
  EXPECT_EQ(kiln_split(x, 1, 1, out), -1);
  EXPECT_STREQ(kiln_last_error(), "split: axis 1 is out of range for rank 1");
  EXPECT_EQ(kiln_split(kiln_scalar(KILN_F32, 1), 1, 0, out), -1);
  EXPECT_STREQ(kiln_last_error(), "split: axis 0 is out of range for rank 0");
  EXPECT_EQ(kiln_split(x, 7, 0, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "split: out is NULL");
  kiln_clear_error();
  EXPECT_EQ(kiln_split(nullptr, 2, 0, out), -1);
  EXPECT_STREQ(kiln_last_error(), "split: input is NULL");
  EXPECT_TRUE(untouched());
}

// With no scope open the parts belong to the caller, like any returned tensor.
TEST(Composite, SplitOwnershipWithoutScope) {
  kiln_clear_error();
  int64_t live = kiln_debug_live_tensors();
  kiln_tensor *x = f32({4}, {1, 2, 3, 4});
  kiln_tensor *out[2] = {nullptr, nullptr};
  ASSERT_EQ(kiln_split(x, 2, 0, out), 0) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), live + 3);
  expect_tensor(out[1], KILN_F32, {2}, {3, 4});
  kiln_release(out[0]);
  kiln_release(out[1]);
  kiln_release(x);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// ---- one_hot ----

TEST(Composite, OneHot) {
  Scoped s;
  kiln_tensor *idx = i32({4}, {0, 2, -1, 3});  // -1 and 3 are out of [0, 3): zero rows
  expect_tensor(kiln_one_hot(idx, 3, KILN_F32), KILN_F32, {4, 3}, {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0});
  kiln_tensor *idx2 = i64({2, 2}, {1, 0, 0, 1});
  expect_tensor(kiln_one_hot(idx2, 2, KILN_I32), KILN_I32, {2, 2, 2}, {0, 1, 1, 0, 1, 0, 0, 1});
  expect_tensor(kiln_one_hot(idx2, 2, KILN_BOOL), KILN_BOOL, {2, 2, 2}, {0, 1, 1, 0, 1, 0, 0, 1});
  expect_tensor(kiln_one_hot(idx2, 3, KILN_F64), KILN_F64, {2, 2, 3}, {0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0});
  expect_tensor(kiln_one_hot(kiln_scalar(KILN_I64, 1), 4, KILN_I64), KILN_I64, {4}, {0, 1, 0, 0});
  expect_tensor(kiln_one_hot(idx, 0, KILN_F32), KILN_F32, {4, 0}, {});
  expect_tensor(kiln_one_hot(kiln_zeros(KILN_I32, KILN_SHAPE(0)), 5, KILN_F32), KILN_F32, {0, 5}, {});
  // a storage dtype works: 1.0 in f16 is 0x3C00
  kiln_tensor *h = kiln_one_hot(i32({2}, {1, 0}), 2, KILN_F16);
  ASSERT_NE(h, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_dtype(h), KILN_F16);
  uint16_t bits[4];
  ASSERT_EQ(kiln_tensor_read(h, bits, sizeof bits), 0);
  EXPECT_EQ(bits[0], 0);
  EXPECT_EQ(bits[1], 0x3C00);
  EXPECT_EQ(bits[2], 0x3C00);
  EXPECT_EQ(bits[3], 0);
}

TEST(Composite, OneHotErrors) {
  Scoped s;
  EXPECT_ERROR(kiln_one_hot(f32({1}, {1}), 3, KILN_F32), "one_hot: indices must be i32 or i64, not f32");
  EXPECT_ERROR(kiln_one_hot(i32({1}, {1}), -1, KILN_F32), "one_hot: depth = -1 is negative");
  EXPECT_ERROR(kiln_one_hot(i32({1}, {1}), 3, (kiln_dtype)42), "one_hot: invalid dtype 42");
  kiln_tensor *r8 = kiln_zeros(KILN_I32, KILN_SHAPE(1, 1, 1, 1, 1, 1, 1, 1));
  EXPECT_FAILS(kiln_one_hot(r8, 2, KILN_F32), "one_hot: the result would have rank 9");
  EXPECT_ERROR(kiln_one_hot(nullptr, 3, KILN_F32), "one_hot: input is NULL");
}

// ---- softmax, log_softmax ----

TEST(Composite, Softmax) {
  Scoped s;
  expect_tensor(kiln_softmax(f32({3}, {1, 2, 3}), 0), KILN_F32, {3}, {0.09003057, 0.24472847, 0.66524096},
                1e-7);
  expect_tensor(kiln_softmax(f64({3}, {1, 2, 3}), -1), KILN_F64, {3}, {kP[0], kP[1], kP[2]}, 1e-15);
  // stable: shifting by 1000 changes nothing, and exp(1000) would overflow
  expect_tensor(kiln_softmax(f32({3}, {1001, 1002, 1003}), 0), KILN_F32, {3}, {kP[0], kP[1], kP[2]}, 1e-7);
  expect_tensor(kiln_softmax(f64({2}, {-1000, 0}), 0), KILN_F64, {2}, {0, 1});
  // rows: [1 2 3] and equal logits
  kiln_tensor *x = f32({2, 3}, {1, 2, 3, 5, 5, 5});
  expect_tensor(kiln_softmax(x, 1), KILN_F32, {2, 3}, {kP[0], kP[1], kP[2], 1.0 / 3, 1.0 / 3, 1.0 / 3}, 1e-7);
  // columns: softmax([1, 3]) = [1 / (1 + e^2), e^2 / (1 + e^2)]
  kiln_tensor *y = f64({2, 2}, {1, 2, 3, 4});
  expect_tensor(kiln_softmax(y, 0), KILN_F64, {2, 2},
                {0.11920292202211755, 0.11920292202211755, 0.8807970779778823, 0.8807970779778823}, 1e-15);
  expect_tensor(kiln_softmax(kiln_zeros(KILN_F32, KILN_SHAPE(0, 4)), 1), KILN_F32, {0, 4}, {});
}

TEST(Composite, LogSoftmax) {
  Scoped s;
  expect_tensor(kiln_log_softmax(f64({3}, {1, 2, 3}), 0), KILN_F64, {3}, {kLogP[0], kLogP[1], kLogP[2]},
                1e-15);
  expect_tensor(kiln_log_softmax(f32({3}, {1, 2, 3}), -1), KILN_F32, {3}, {kLogP[0], kLogP[1], kLogP[2]},
                1e-6);
  // no overflow, and no log(0) = -inf where the probability underflows
  expect_tensor(kiln_log_softmax(f64({2}, {-1000, 0}), 0), KILN_F64, {2}, {-1000, 0});
  expect_tensor(kiln_log_softmax(f32({2, 2}, {0, 0, 7, 7}), 1), KILN_F32, {2, 2}, {-kLn2, -kLn2, -kLn2, -kLn2},
                1e-7);
}

TEST(Composite, SoftmaxErrors) {
  Scoped s;
  kiln_tensor *x = f32({2, 2}, {1, 2, 3, 4});
  EXPECT_ERROR(kiln_softmax(x, 2), "softmax: axis 2 is out of range for rank 2");
  EXPECT_ERROR(kiln_softmax(x, -3), "softmax: axis -3 is out of range for rank 2");
  EXPECT_ERROR(kiln_log_softmax(x, 2), "log_softmax: axis 2 is out of range for rank 2");
  EXPECT_ERROR(kiln_softmax(kiln_scalar(KILN_F32, 1), 0), "softmax: axis 0 is out of range for rank 0");
  EXPECT_ERROR(kiln_softmax(i32({2}, {1, 2}), 0), "softmax: dtype i32 is not supported (f32, f64)");
  EXPECT_ERROR(kiln_log_softmax(i64({2}, {1, 2}), 0), "log_softmax: dtype i64 is not supported (f32, f64)");
  EXPECT_FAILS(kiln_softmax(make<uint16_t>(KILN_F16, {1}, {0}), 0), "softmax: dtype f16 is not supported");
  EXPECT_ERROR(kiln_softmax(nullptr, 0), "softmax: input is NULL");
  EXPECT_ERROR(kiln_log_softmax(nullptr, 0), "log_softmax: input is NULL");
}

// ---- cross-entropies ----

// -sum(labels * log_softmax(logits)) = logsumexp(logits) - sum(labels * logits)
// when the labels sum to 1; logsumexp([1, 2, 3]) = 3.4076059644443806.
TEST(Composite, SoftmaxCrossEntropy) {
  Scoped s;
  kiln_tensor *labels = f64({3, 3}, {0, 1, 0, 0.25, 0.25, 0.5, 0, 0, 1});
  kiln_tensor *logits = f64({3, 3}, {1, 2, 3, 1, 2, 3, 1, 2, 3});
  expect_tensor(kiln_softmax_cross_entropy(labels, logits), KILN_F64, {3},
                {1.4076059644443806, 1.1576059644443806, 0.4076059644443806}, 1e-15);
  kiln_tensor *l32 = f32({2}, {1, 0}), *z32 = f32({2}, {0, 0});
  expect_tensor(kiln_softmax_cross_entropy(l32, z32), KILN_F32, {}, {kLn2}, 1e-7);
  // batch dimensions (2, 1) and 3 equal logits: log 3 each
  kiln_tensor *l3 = f32({2, 1, 3}, {1, 0, 0, 0, 0, 1}), *z3 = f32({2, 1, 3}, {4, 4, 4, -2, -2, -2});
  expect_tensor(kiln_softmax_cross_entropy(l3, z3), KILN_F32, {2, 1}, {kLn3, kLn3}, 1e-6);
  expect_tensor(kiln_softmax_cross_entropy(kiln_zeros(KILN_F32, KILN_SHAPE(0, 3)),
                                           kiln_zeros(KILN_F32, KILN_SHAPE(0, 3))),
                KILN_F32, {0}, {});
}

TEST(Composite, SoftmaxCrossEntropyErrors) {
  Scoped s;
  kiln_tensor *logits = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_ERROR(kiln_softmax_cross_entropy(f32({2, 2}, {1, 0, 0, 1}), logits),
               "softmax_cross_entropy: labels shape (2, 2) does not match logits shape (2, 3)");
  EXPECT_ERROR(kiln_softmax_cross_entropy(f64({2, 3}, {0, 0, 1, 0, 0, 1}), logits),
               "softmax_cross_entropy: labels have dtype f64, logits f32");
  EXPECT_ERROR(kiln_softmax_cross_entropy(i32({2}, {0, 1}), i32({2}, {0, 1})),
               "softmax_cross_entropy: dtype i32 is not supported (f32, f64)");
  EXPECT_ERROR(kiln_softmax_cross_entropy(kiln_scalar(KILN_F32, 1), kiln_scalar(KILN_F32, 1)),
               "softmax_cross_entropy: logits need rank >= 1 (classes on the last axis), got a scalar");
  EXPECT_ERROR(kiln_softmax_cross_entropy(nullptr, logits), "softmax_cross_entropy: input is NULL");
  EXPECT_ERROR(kiln_softmax_cross_entropy(logits, nullptr), "softmax_cross_entropy: input is NULL");
}

// -log_softmax(logits)[label]: [1 2 3] gives 2.4076, 1.4076, 0.4076 for
// labels 0, 1, 2; equal logits give log(classes).
TEST(Composite, SparseSoftmaxCrossEntropy) {
  Scoped s;
  kiln_tensor *logits = f64({3, 3}, {1, 2, 3, 1, 2, 3, 0, 0, 0});
  expect_tensor(kiln_sparse_softmax_cross_entropy(i32({3}, {1, 2, 0}), logits), KILN_F64, {3},
                {-kLogP[1], -kLogP[2], kLn3}, 1e-15);
  expect_tensor(kiln_sparse_softmax_cross_entropy(i64({3}, {0, 0, 2}), logits), KILN_F64, {3},
                {-kLogP[0], -kLogP[0], kLn3}, 1e-15);
  // labels (2, 2), logits (2, 2, 2)
  kiln_tensor *z = f32({2, 2, 2}, {0, 0, 1, 2, 5, 5, 2, 1});
  // [1 2] label 1: log(1 + e^-1) = 0.3132616875182228; [2 1] label 1: 1.3132616875182228
  expect_tensor(kiln_sparse_softmax_cross_entropy(i64({2, 2}, {0, 1, 1, 1}), z), KILN_F32, {2, 2},
                {kLn2, 0.3132616875182228, kLn2, 1.3132616875182228}, 1e-6);
  // one example: labels are a scalar
  expect_tensor(kiln_sparse_softmax_cross_entropy(kiln_scalar(KILN_I32, 2), f32({3}, {1, 2, 3})), KILN_F32, {},
                {-kLogP[2]}, 1e-6);
  expect_tensor(kiln_sparse_softmax_cross_entropy(kiln_zeros(KILN_I32, KILN_SHAPE(0)),
                                                  kiln_zeros(KILN_F32, KILN_SHAPE(0, 4))),
                KILN_F32, {0}, {});
}

TEST(Composite, SparseSoftmaxCrossEntropyErrors) {
  Scoped s;
  kiln_tensor *logits = kiln_zeros(KILN_F32, KILN_SHAPE(4, 10));
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i32({4}, {0, 1, 9, 10}), logits),
               "sparse_softmax_cross_entropy: labels[3] = 10 is not in [0, 10)");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i64({4}, {-1, 1, 9, 10}), logits),
               "sparse_softmax_cross_entropy: labels[0] = -1 is not in [0, 10)");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i64({2, 2}, {0, 1, 3, 0}), kiln_zeros(KILN_F64, KILN_SHAPE(2, 2, 3))),
               "sparse_softmax_cross_entropy: labels[1, 0] = 3 is not in [0, 3)");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(kiln_scalar(KILN_I32, 5), kiln_zeros(KILN_F32, KILN_SHAPE(5))),
               "sparse_softmax_cross_entropy: labels = 5 is not in [0, 5)");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i32({1}, {0}), kiln_zeros(KILN_F32, KILN_SHAPE(1, 0))),
               "sparse_softmax_cross_entropy: labels[0] = 0 is not in [0, 0)");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(f32({4}, {0, 1, 2, 3}), logits),
               "sparse_softmax_cross_entropy: labels must be i32 or i64, not f32");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i32({3}, {0, 1, 2}), logits),
               "sparse_softmax_cross_entropy: labels shape (3,) does not match logits shape (4, 10) without its "
               "last axis");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i32({4, 10}, std::vector<int32_t>(40)), logits),
               "sparse_softmax_cross_entropy: labels shape (4, 10) does not match logits shape (4, 10) without "
               "its last axis");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i32({2}, {0, 1}), i32({2, 2}, {0, 1, 2, 3})),
               "sparse_softmax_cross_entropy: dtype i32 is not supported (f32, f64)");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(kiln_scalar(KILN_I32, 0), kiln_scalar(KILN_F32, 0)),
               "sparse_softmax_cross_entropy: logits need rank >= 1 (classes on the last axis), got a scalar");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(nullptr, logits), "sparse_softmax_cross_entropy: input is NULL");
  EXPECT_ERROR(kiln_sparse_softmax_cross_entropy(i32({4}, {0, 0, 0, 0}), nullptr),
               "sparse_softmax_cross_entropy: input is NULL");
}

// ---- clip_by_norm ----

TEST(Composite, ClipByNorm) {
  Scoped s;
  // |[3 4]| = 5 > 2.5: scaled by 2.5 / 5
  expect_tensor(kiln_clip_by_norm(f32({2}, {3, 4}), 2.5), KILN_F32, {2}, {1.5, 2});
  // within the norm: unchanged
  expect_tensor(kiln_clip_by_norm(f32({2}, {3, 4}), 5), KILN_F32, {2}, {3, 4});
  expect_tensor(kiln_clip_by_norm(f32({2}, {3, 4}), 10), KILN_F32, {2}, {3, 4});
  // over every axis: |[[1 2] [2 4]]| = 5
  expect_tensor(kiln_clip_by_norm(f64({2, 2}, {1, -2, 2, 4}), 1), KILN_F64, {2, 2}, {0.2, -0.4, 0.4, 0.8}, 1e-16);
  expect_tensor(kiln_clip_by_norm(f64({3}, {0, 0, 0}), 1), KILN_F64, {3}, {0, 0, 0});
  expect_tensor(kiln_clip_by_norm(kiln_scalar(KILN_F32, -8), 2), KILN_F32, {}, {-2});
  expect_tensor(kiln_clip_by_norm(kiln_zeros(KILN_F32, KILN_SHAPE(0)), 2), KILN_F32, {0}, {});
}

TEST(Composite, ClipByNormErrors) {
  Scoped s;
  kiln_tensor *x = f32({2}, {3, 4});
  EXPECT_ERROR(kiln_clip_by_norm(x, 0), "clip_by_norm: max_norm = 0 must be positive and finite");
  EXPECT_ERROR(kiln_clip_by_norm(x, -1), "clip_by_norm: max_norm = -1 must be positive and finite");
  EXPECT_FAILS(kiln_clip_by_norm(x, NAN), "clip_by_norm: max_norm = ");
  EXPECT_FAILS(kiln_clip_by_norm(x, INFINITY), "clip_by_norm: max_norm = ");
  EXPECT_ERROR(kiln_clip_by_norm(i32({2}, {3, 4}), 1), "clip_by_norm: dtype i32 is not supported (f32, f64)");
  EXPECT_ERROR(kiln_clip_by_norm(nullptr, 1), "clip_by_norm: input is NULL");
}

// ---- ownership ----

// Only the result survives a composite: its temporaries die inside it.
TEST(Composite, NoIntermediatesSurvive) {
  Scoped s;
  kiln_tensor *x = f32({2, 3}, {1, 2, 3, 4, 5, 6});
  kiln_tensor *labels = i32({2}, {0, 2});
  kiln_tensor *parts[3];
  int64_t live = kiln_debug_live_tensors();
  auto one_more = [&](kiln_tensor *r, const char *what) {
    EXPECT_NE(r, nullptr) << what << ": " << kiln_last_error();
    EXPECT_EQ(kiln_debug_live_tensors(), ++live) << what;
  };
  one_more(kiln_softmax(x, 1), "softmax");
  one_more(kiln_log_softmax(x, 0), "log_softmax");
  one_more(kiln_reduce_mean(x, 0, nullptr, false), "reduce_mean");
  one_more(kiln_clip_by_norm(x, 1), "clip_by_norm");
  one_more(kiln_softmax_cross_entropy(x, x), "softmax_cross_entropy");
  one_more(kiln_sparse_softmax_cross_entropy(labels, x), "sparse_softmax_cross_entropy");
  one_more(kiln_one_hot(labels, 4, KILN_F32), "one_hot");
  // index is a reshape view of a slice: the view holds the slice, two headers in all
  EXPECT_NE(kiln_index(x, 1), nullptr) << kiln_last_error();
  live += 2;
  EXPECT_EQ(kiln_debug_live_tensors(), live) << "index";
  kiln_tensor *pair[2] = {x, x};
  one_more(kiln_stack(2, pair, 1), "stack");
  ASSERT_EQ(kiln_split(x, 3, 1, parts), 0) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), live + 3);
}

// A composite called with no scope open hands its result to the caller.
TEST(Composite, ResultBelongsToCallerWithoutScope) {
  kiln_clear_error();
  int64_t live = kiln_debug_live_tensors();
  kiln_tensor *x = f32({3}, {1, 2, 3});
  kiln_tensor *p = kiln_softmax(x, 0);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), live + 2);
  expect_tensor(p, KILN_F32, {3}, {kP[0], kP[1], kP[2]}, 1e-7);
  kiln_release(p);
  kiln_release(x);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// In nested scopes the result belongs to the caller's (innermost) scope.
TEST(Composite, ResultBelongsToInnermostScope) {
  kiln_clear_error();
  int64_t live = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *x = f32({3}, {1, 2, 3});
  kiln_scope_push();
  kiln_tensor *p = kiln_log_softmax(x, 0);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), live + 2);
  kiln_scope_pop();  // releases p
  EXPECT_EQ(kiln_debug_live_tensors(), live + 1);
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// A NULL input keeps the first error, for every composite.
TEST(Composite, NullKeepsFirstError) {
  Scoped s;
  kiln_tensor *out[2];
  auto keeps = [](bool failed, const char *what) {
    EXPECT_TRUE(failed) << what;
    EXPECT_STREQ(kiln_last_error(), "first: failure") << what;
  };
  kiln_fail("first: failure");
  keeps(!kiln_square(nullptr), "square");
  keeps(!kiln_reduce_mean(nullptr, 0, nullptr, false), "reduce_mean");
  keeps(!kiln_expand_dims(nullptr, 0), "expand_dims");
  keeps(!kiln_squeeze(nullptr, 0), "squeeze");
  keeps(!kiln_index(nullptr, 0), "index");
  keeps(kiln_split(nullptr, 2, 0, out) == -1, "split");
  keeps(!kiln_one_hot(nullptr, 2, KILN_F32), "one_hot");
  keeps(!kiln_softmax(nullptr, 0), "softmax");
  keeps(!kiln_log_softmax(nullptr, 0), "log_softmax");
  keeps(!kiln_softmax_cross_entropy(nullptr, nullptr), "softmax_cross_entropy");
  keeps(!kiln_sparse_softmax_cross_entropy(nullptr, nullptr), "sparse_softmax_cross_entropy");
  keeps(!kiln_clip_by_norm(nullptr, 1), "clip_by_norm");
  // a failed chain inside: softmax of a failed op keeps that op's error
  kiln_clear_error();
  EXPECT_EQ(kiln_softmax(kiln_add(f32({2}, {1, 2}), f32({3}, {1, 2, 3})), 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: "));
}

// ---- errors that read the same staged as eagerly ----

// KILN_BACKEND for the traces compiled while it lives
struct BackendEnv : EnvGuard {
  explicit BackendEnv(const char *v) : EnvGuard("KILN_BACKEND", v) {}
};

int sparse_ce_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(in[0], in[1]), 0, nullptr, false);
  return out[0] ? 0 : -1;
}

// A staged sparse_softmax_cross_entropy with a bad label fails naming the op
// and the label, as eagerly (it said "gather: indices[1] = -1 ..."), compiled
// and interpreted; good labels give the eager value.
TEST(Composite, StagedSparseSoftmaxCrossEntropyNamesTheBadLabel) {
  Scoped s;
  kiln_tensor *logits = f32({4, 3}, {1, 2, 3, 0, 0, 0, -1, 2, 0.5f, 3, 1, 2});
  struct {
    kiln_tensor *labels;
    const char *eager;
  } bad[] = {
      {i32({4}, {0, -1, 2, 1}), "sparse_softmax_cross_entropy: labels[1] = -1 is not in [0, 3)"},
      {i64({4}, {0, 1, 2, 3}), "sparse_softmax_cross_entropy: labels[3] = 3 is not in [0, 3)"},
  };
  kiln_tensor *good = i32({4}, {2, 0, 1, 0});
  kiln_tensor *want = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(good, logits), 0, nullptr, false);
  for (const char *backend : {"cpu", "interp"}) {
    SCOPED_TRACE(backend);
    BackendEnv env(backend);
    for (auto &b : bad) {
      kiln_clear_error();
      EXPECT_EQ(kiln_sparse_softmax_cross_entropy(b.labels, logits), nullptr);
      EXPECT_STREQ(kiln_last_error(), b.eager);
      kiln_function *f = kiln_function_new("loss", sparse_ce_body, nullptr, 2, 1);
      kiln_tensor *in[2] = {b.labels, logits}, *out = nullptr;
      EXPECT_EQ(kiln_function_call(f, in, &out), -1);
      EXPECT_EQ(kiln_last_error(), std::string("@loss: ") + b.eager);
      EXPECT_THAT(kiln_last_error(), Not(HasSubstr("gather")));
      // the same trace with good labels
      kiln_tensor *in2[2] = {b.labels == bad[0].labels ? good : kiln_cast(good, KILN_I64), logits};
      ASSERT_EQ(kiln_function_call(f, in2, &out), 0) << kiln_last_error();
      EXPECT_NEAR(kiln_tensor_item(out), kiln_tensor_item(want), 1e-6);
      EXPECT_EQ(kiln_function_trace_count(f), 1);
      kiln_function_free(f);
    }
  }
}

// one_hot with a depth whose result cannot exist fails as one_hot, not as a
// crash or another op's allocation error; with no indices it is empty.
TEST(Composite, OneHotHugeDepth) {
  Scoped s;
  for (int64_t depth : {INT64_MAX / 2, INT64_MAX, (int64_t)1 << 62}) {
    kiln_clear_error();
    EXPECT_EQ(kiln_one_hot(i32({2}, {0, 1}), depth, KILN_F32), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("one_hot: "));
    kiln_clear_error();
    EXPECT_EQ(kiln_one_hot(kiln_scalar(KILN_I64, 3), depth, KILN_BOOL), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("one_hot: "));
  }
  // large but countable: fails as one_hot when it cannot be allocated (1 << 56 f64 is 512 PiB)
  kiln_clear_error();
  EXPECT_EQ(kiln_one_hot(i32({1}, {0}), (int64_t)1 << 56, KILN_F64), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("one_hot: "));
  // no indices: an empty result, whatever the depth
  kiln_tensor *e = kiln_one_hot(kiln_zeros(KILN_I32, KILN_SHAPE(0)), INT64_MAX / 2, KILN_F32);
  ASSERT_NE(e, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(e), (std::vector<int64_t>{0, INT64_MAX / 2}));
  EXPECT_EQ(kiln_tensor_size(e), 0);
}

// A zero anywhere in a shape makes it empty, whatever the size and order of
// the other dimensions.
TEST(Composite, ZeroSizeShapesInAnyOrder) {
  Scoped s;
  const int64_t big = (int64_t)1 << 40;
  std::vector<std::vector<int64_t>> shapes = {
      {0, 5}, {5, 0}, {3, 0, 1000000000000}, {big, big, 0}, {0, big, big}, {big, 0, big}, {INT64_MAX, 0}};
  for (auto &sh : shapes) {
    SCOPED_TRACE(::testing::PrintToString(sh));
    int r = (int)sh.size();
    kiln_tensor *z = kiln_zeros(KILN_F32, r, sh.data());
    ASSERT_NE(z, nullptr) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_size(z), 0);
    EXPECT_EQ(shape_of(z), sh);
    kiln_tensor *t = kiln_tensor_new(KILN_F64, r, sh.data(), nullptr);
    ASSERT_NE(t, nullptr) << kiln_last_error();
    ASSERT_NE(kiln_fill(KILN_I32, r, sh.data(), 7), nullptr) << kiln_last_error();
    kiln_tensor *e = kiln_exp(kiln_add(z, z));
    ASSERT_NE(e, nullptr) << kiln_last_error();
    EXPECT_EQ(shape_of(e), sh);
    std::vector<int64_t> rev(sh.rbegin(), sh.rend());
    kiln_tensor *re = kiln_reshape(z, r, rev.data());
    ASSERT_NE(re, nullptr) << kiln_last_error();
    EXPECT_EQ(shape_of(re), rev);
    kiln_tensor *tr = kiln_transpose(z, r, nullptr);
    ASSERT_NE(tr, nullptr) << kiln_last_error();
    EXPECT_EQ(shape_of(tr), rev);
    kiln_tensor *c = kiln_cast(z, KILN_F16);
    ASSERT_NE(c, nullptr) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_size(c), 0);
  }
  // without a zero, an overflowing count is still an error
  int64_t huge[3] = {big, big, 2};
  kiln_clear_error();
  EXPECT_EQ(kiln_zeros(KILN_F32, 3, huge), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("overflows"));
}

}  // namespace
