// print_test.cc — kiln_tensor_str and kiln_tensor_print: the exact text for
// every dtype, scalars, empty and nested tensors, special values, scientific
// notation, summarised large tensors, and errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "test_util.h"

using ::testing::StartsWith;

namespace {

using namespace kiln_test;

// kiln_tensor_str as a std::string ("<NULL: error>" on failure).
std::string str(const kiln_tensor *t) {
  char *s = kiln_tensor_str(t);
  if (!s) return std::string("<NULL: ") + kiln_last_error() + ">";
  std::string r(s);
  free(s);
  return r;
}

TEST(Print, F32Matrix) {
  Scoped s;
  kiln_tensor *t = make<float>(KILN_F32, {2, 2}, {2, 3, 4, 5});
  EXPECT_EQ(str(t), "kiln.Tensor([[2. 3.] [4. 5.]], shape=(2, 2), dtype=f32)");
}

TEST(Print, F32ShortestDigits) {
  Scoped s;
  kiln_tensor *t = make<float>(KILN_F32, {5}, {0.1f, -1.5f, 100, 0.25f, 1.0f / 3});
  EXPECT_EQ(str(t), "kiln.Tensor([0.1 -1.5 100. 0.25 0.33333334], shape=(5,), dtype=f32)");
  // 8 significant digits at most; 16777216 = 2^24 is exact
  kiln_tensor *u = make<float>(KILN_F32, {3}, {16777216.0f, 1234.5677f, 0.0001f});
  EXPECT_EQ(str(u), "kiln.Tensor([16777216. 1234.5677 0.0001], shape=(3,), dtype=f32)");
}

TEST(Print, F64) {
  Scoped s;
  kiln_tensor *t = make<double>(KILN_F64, {4}, {1.0 / 3, 0.1, -2, 1e15});
  EXPECT_EQ(str(t),
            "kiln.Tensor([0.3333333333333333 0.1 -2. 1000000000000000.], shape=(4,), dtype=f64)");
  // 0.1 + 0.2 needs 17 digits to round-trip; at most 16 are shown
  kiln_tensor *u = make<double>(KILN_F64, {2}, {0.1 + 0.2, 2.5});
  EXPECT_EQ(str(u), "kiln.Tensor([0.3 2.5], shape=(2,), dtype=f64)");
}

TEST(Print, Ints) {
  Scoped s;
  kiln_tensor *a = make<int32_t>(KILN_I32, {2, 3}, {-1, 0, 7, 2147483647, -2147483647 - 1, 42});
  EXPECT_EQ(str(a), "kiln.Tensor([[-1 0 7] [2147483647 -2147483648 42]], shape=(2, 3), dtype=i32)");
  // i64 is printed exactly, not through a double
  kiln_tensor *b = make<int64_t>(KILN_I64, {2}, {9007199254740993LL, INT64_MIN});
  EXPECT_EQ(str(b), "kiln.Tensor([9007199254740993 -9223372036854775808], shape=(2,), dtype=i64)");
}

TEST(Print, Bool) {
  Scoped s;
  kiln_tensor *t = make<uint8_t>(KILN_BOOL, {3}, {1, 0, 1});
  EXPECT_EQ(str(t), "kiln.Tensor([True False True], shape=(3,), dtype=bool)");
}

TEST(Print, F16AndBF16) {
  Scoped s;
  // f16 bits of 0.5, -2, 0.1 (0.0999755859375), 1/3 (0.333251953125)
  kiln_tensor *h = make<uint16_t>(KILN_F16, {4}, {0x3800, 0xC000, 0x2E66, 0x3555});
  EXPECT_EQ(str(h), "kiln.Tensor([0.5 -2. 0.1 0.3333], shape=(4,), dtype=f16)");
  // bf16 bits of 0.5, -2, 0.1 (0.10009765625), 1/3 (0.333984375)
  kiln_tensor *b = make<uint16_t>(KILN_BF16, {4}, {0x3F00, 0xC000, 0x3DCD, 0x3EAB});
  EXPECT_EQ(str(b), "kiln.Tensor([0.5 -2. 0.1 0.334], shape=(4,), dtype=bf16)");
  // f16 infinity and NaN
  kiln_tensor *sp = make<uint16_t>(KILN_F16, {3}, {0x7C00, 0xFC00, 0x7E00});
  EXPECT_EQ(str(sp), "kiln.Tensor([inf -inf nan], shape=(3,), dtype=f16)");
}

TEST(Print, Scalars) {
  Scoped s;
  EXPECT_EQ(str(kiln_scalar(KILN_F32, 3.5)), "kiln.Tensor(3.5, shape=(), dtype=f32)");
  EXPECT_EQ(str(kiln_scalar(KILN_F64, -2)), "kiln.Tensor(-2., shape=(), dtype=f64)");
  EXPECT_EQ(str(kiln_scalar(KILN_I64, -7)), "kiln.Tensor(-7, shape=(), dtype=i64)");
  EXPECT_EQ(str(kiln_scalar(KILN_BOOL, 1)), "kiln.Tensor(True, shape=(), dtype=bool)");
  EXPECT_EQ(str(kiln_scalar(KILN_F32, 0)), "kiln.Tensor(0., shape=(), dtype=f32)");
  EXPECT_EQ(str(kiln_scalar(KILN_F32, -0.0)), "kiln.Tensor(-0., shape=(), dtype=f32)");
}

TEST(Print, Empty) {
  Scoped s;
  EXPECT_EQ(str(kiln_zeros(KILN_F32, KILN_SHAPE(0))), "kiln.Tensor([], shape=(0,), dtype=f32)");
  EXPECT_EQ(str(kiln_zeros(KILN_I32, KILN_SHAPE(2, 0))), "kiln.Tensor([], shape=(2, 0), dtype=i32)");
  EXPECT_EQ(str(kiln_zeros(KILN_BOOL, KILN_SHAPE(0, 3))), "kiln.Tensor([], shape=(0, 3), dtype=bool)");
}

TEST(Print, Rank3AndOnes) {
  Scoped s;
  kiln_tensor *t = make<int32_t>(KILN_I32, {2, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(str(t), "kiln.Tensor([[[0 1] [2 3]] [[4 5] [6 7]]], shape=(2, 2, 2), dtype=i32)");
  kiln_tensor *u = make<float>(KILN_F32, {1, 1, 1}, {-4.25f});
  EXPECT_EQ(str(u), "kiln.Tensor([[[-4.25]]], shape=(1, 1, 1), dtype=f32)");
}

TEST(Print, NanAndInf) {
  Scoped s;
  float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  kiln_tensor *t = make<float>(KILN_F32, {2, 2}, {nan, inf, -inf, 1});
  EXPECT_EQ(str(t), "kiln.Tensor([[nan inf] [-inf 1.]], shape=(2, 2), dtype=f32)");
  // infinities and NaN do not push the others into scientific notation
  kiln_tensor *u = make<double>(KILN_F64, {2}, {-std::nan(""), 0.5});
  EXPECT_EQ(str(u), "kiln.Tensor([nan 0.5], shape=(2,), dtype=f64)");
}

TEST(Print, Scientific) {
  Scoped s;
  EXPECT_EQ(str(make<float>(KILN_F32, {1}, {1e20f})), "kiln.Tensor([1e+20], shape=(1,), dtype=f32)");
  EXPECT_EQ(str(kiln_scalar(KILN_F32, 1e20)), "kiln.Tensor(1e+20, shape=(), dtype=f32)");
  // one small magnitude puts the whole tensor in scientific notation, as NumPy does
  EXPECT_EQ(str(make<float>(KILN_F32, {3}, {1e-5f, 1, -250})),
            "kiln.Tensor([1e-05 1e+00 -2.5e+02], shape=(3,), dtype=f32)");
  // f32 switches at 1e8 (8 digits), f64 at 1e16
  EXPECT_EQ(str(make<float>(KILN_F32, {2}, {12345678, 1e8f})),
            "kiln.Tensor([1.2345678e+07 1e+08], shape=(2,), dtype=f32)");
  EXPECT_EQ(str(make<double>(KILN_F64, {2}, {1.5e300, -2.5e-300})),
            "kiln.Tensor([1.5e+300 -2.5e-300], shape=(2,), dtype=f64)");
  EXPECT_EQ(str(make<double>(KILN_F64, {1}, {1e16})), "kiln.Tensor([1e+16], shape=(1,), dtype=f64)");
  // zeros do not count as small
  EXPECT_EQ(str(make<float>(KILN_F32, {2}, {0, 2})), "kiln.Tensor([0. 2.], shape=(2,), dtype=f32)");
}

TEST(Print, Summarised10000) {
  Scoped s;
  std::vector<int64_t> v(10000);
  for (int i = 0; i < 10000; i++) v[i] = i;
  EXPECT_EQ(str(make<int64_t>(KILN_I64, {10000}, v)),
            "kiln.Tensor([0 1 2 ... 9997 9998 9999], shape=(10000,), dtype=i64)");
}

TEST(Print, Summarised2000x3) {
  Scoped s;
  std::vector<int32_t> v(6000);
  for (int i = 0; i < 6000; i++) v[i] = i;
  EXPECT_EQ(str(make<int32_t>(KILN_I32, {2000, 3}, v)),
            "kiln.Tensor([[0 1 2] [3 4 5] [6 7 8] ... [5991 5992 5993] [5994 5995 5996] "
            "[5997 5998 5999]], shape=(2000, 3), dtype=i32)");
}

TEST(Print, SummarisedFloatsAndEveryAxis) {
  Scoped s;
  // 40 x 40 f32: both axes cut; notation decided by the shown elements only
  std::vector<float> v(1600);
  for (int i = 0; i < 1600; i++) v[i] = i * 0.5f;
  v[800] = 1e-9f;  // hidden: must not force scientific notation
  EXPECT_EQ(str(make<float>(KILN_F32, {40, 40}, v)),
            "kiln.Tensor([[0. 0.5 1. ... 18.5 19. 19.5] [20. 20.5 21. ... 38.5 39. 39.5] "
            "[40. 40.5 41. ... 58.5 59. 59.5] ... [740. 740.5 741. ... 758.5 759. 759.5] "
            "[760. 760.5 761. ... 778.5 779. 779.5] [780. 780.5 781. ... 798.5 799. 799.5]], "
            "shape=(40, 40), dtype=f32)");
}

TEST(Print, ThousandElementsAreNotSummarised) {
  Scoped s;
  std::vector<uint8_t> v(1000, 0);
  std::string text = str(make<uint8_t>(KILN_BOOL, {1000}, v));
  EXPECT_EQ(text.find("..."), std::string::npos);
  EXPECT_EQ(text.size(), std::string("kiln.Tensor([], shape=(1000,), dtype=bool)").size() + 1000 * 6 - 1);
  v.push_back(1);
  std::string cut = str(make<uint8_t>(KILN_BOOL, {1001}, v));
  EXPECT_EQ(cut, "kiln.Tensor([False False False ... False False True], shape=(1001,), dtype=bool)");
}

TEST(Print, PrintWritesALine) {
  Scoped s;
  FILE *f = tmpfile();
  ASSERT_NE(f, nullptr);
  kiln_tensor *t = make<float>(KILN_F32, {2}, {1.5f, -2});
  ASSERT_EQ(kiln_tensor_print(t, f), 0) << kiln_last_error();
  ASSERT_EQ(kiln_tensor_print(kiln_scalar(KILN_I32, 3), f), 0) << kiln_last_error();
  rewind(f);
  char buf[256] = {0};
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  EXPECT_EQ(std::string(buf, n),
            "kiln.Tensor([1.5 -2.], shape=(2,), dtype=f32)\nkiln.Tensor(3, shape=(), dtype=i32)\n");
}

TEST(Print, Errors) {
  Scoped s;
  kiln_clear_error();
  EXPECT_EQ(kiln_tensor_str(nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_str: "));
  // a NULL input keeps the first error
  kiln_fail("earlier: failure");
  EXPECT_EQ(kiln_tensor_str(nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "earlier: failure");

  kiln_clear_error();
  kiln_tensor *t = kiln_scalar(KILN_F32, 1);
  EXPECT_EQ(kiln_tensor_print(t, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_print: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_tensor_print(nullptr, stdout), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_print: "));
}

}  // namespace
