// movement_test.cc — the data-movement primitives: broadcast_to, transpose,
// slice and concat, on every dtype (f16 and bool bytes move unchanged),
// zero-size tensors, the large (parallel, tiled) paths, and bad inputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

// 0, 1, 2, ... as i32 of the given shape: every element names its position.
kiln_tensor *iota_i32(std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<int32_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return make(KILN_I32, shape, v);
}

// ---- broadcast_to ----

TEST(Movement, BroadcastRowAndColumn) {
  Scoped s;
  kiln_tensor *row = make<float>(KILN_F32, {3}, {1, 2, 3});
  kiln_tensor *r = kiln_broadcast_to(row, KILN_SHAPE(2, 3));
  EXPECT_EQ(shape_of(r), (V64{2, 3}));
  EXPECT_EQ(read<float>(r), (std::vector<float>{1, 2, 3, 1, 2, 3}));

  kiln_tensor *col = make<double>(KILN_F64, {2, 1}, {5, 7});
  EXPECT_EQ(read<double>(kiln_broadcast_to(col, KILN_SHAPE(2, 3))),
            (std::vector<double>{5, 5, 5, 7, 7, 7}));
  // new leading axes
  EXPECT_EQ(read<double>(kiln_broadcast_to(col, KILN_SHAPE(2, 2, 2))),
            (std::vector<double>{5, 5, 7, 7, 5, 5, 7, 7}));
}

TEST(Movement, BroadcastMixedAxes) {
  Scoped s;
  // (1, 3, 1) -> (2, 3, 2): a broadcast, a copied and a broadcast axis
  kiln_tensor *t = make<int32_t>(KILN_I32, {1, 3, 1}, {1, 2, 3});
  kiln_tensor *r = kiln_broadcast_to(t, KILN_SHAPE(2, 3, 2));
  EXPECT_EQ(read<int32_t>(r), (std::vector<int32_t>{1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3}));
  // (2, 1, 2) i64 -> (2, 3, 2)
  kiln_tensor *u = make<int64_t>(KILN_I64, {2, 1, 2}, {1, 2, 3, 4});
  EXPECT_EQ(read<int64_t>(kiln_broadcast_to(u, KILN_SHAPE(2, 3, 2))),
            (std::vector<int64_t>{1, 2, 1, 2, 1, 2, 3, 4, 3, 4, 3, 4}));
}

TEST(Movement, BroadcastScalarAndSameShape) {
  Scoped s;
  kiln_tensor *x = kiln_scalar(KILN_F32, 2.5);
  kiln_tensor *r = kiln_broadcast_to(x, KILN_SHAPE(2, 2));
  EXPECT_EQ(read<float>(r), (std::vector<float>{2.5, 2.5, 2.5, 2.5}));
  kiln_tensor *r0 = kiln_broadcast_to(x, 0, nullptr);
  EXPECT_EQ(kiln_tensor_rank(r0), 0);
  EXPECT_EQ(kiln_tensor_item(r0), 2.5);
  kiln_tensor *m = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(read<float>(kiln_broadcast_to(m, KILN_SHAPE(2, 2))), (std::vector<float>{1, 2, 3, 4}));
}

TEST(Movement, BroadcastBoolAndF16Bytes) {
  Scoped s;
  kiln_tensor *b = make<uint8_t>(KILN_BOOL, {2, 1}, {1, 0});
  EXPECT_EQ(read<uint8_t>(kiln_broadcast_to(b, KILN_SHAPE(2, 3))),
            (std::vector<uint8_t>{1, 1, 1, 0, 0, 0}));
  // f16 bit patterns, NaN included, are copied as they are
  kiln_tensor *h = make<uint16_t>(KILN_F16, {3}, {0x3c00, 0x7e01, 0x8001});
  EXPECT_EQ(read<uint16_t>(kiln_broadcast_to(h, KILN_SHAPE(2, 3))),
            (std::vector<uint16_t>{0x3c00, 0x7e01, 0x8001, 0x3c00, 0x7e01, 0x8001}));
  kiln_tensor *bf = make<uint16_t>(KILN_BF16, {1}, {0x4049});
  EXPECT_EQ(read<uint16_t>(kiln_broadcast_to(bf, KILN_SHAPE(3))),
            (std::vector<uint16_t>{0x4049, 0x4049, 0x4049}));
}

TEST(Movement, BroadcastZeroSize) {
  Scoped s;
  kiln_tensor *row = make<float>(KILN_F32, {3}, {1, 2, 3});
  kiln_tensor *r = kiln_broadcast_to(row, KILN_SHAPE(0, 3));
  ASSERT_NE(r, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(r), (V64{0, 3}));
  EXPECT_EQ(kiln_tensor_size(r), 0);
  kiln_tensor *e = kiln_zeros(KILN_F32, KILN_SHAPE(0));
  kiln_tensor *r2 = kiln_broadcast_to(e, KILN_SHAPE(4, 0));
  ASSERT_NE(r2, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(r2), (V64{4, 0}));
  // (1,) can grow to 0 along that axis
  kiln_tensor *one = make<float>(KILN_F32, {1}, {9});
  EXPECT_EQ(kiln_tensor_size(kiln_broadcast_to(one, KILN_SHAPE(2, 0))), 0);
}

TEST(Movement, BroadcastLarge) {
  Scoped s;
  // bias-like (1000,) -> (300, 1000) and column (300, 1) -> (300, 1000): parallel paths
  std::vector<float> row(1000), col(300);
  for (int i = 0; i < 1000; i++) row[i] = (float)i;
  for (int i = 0; i < 300; i++) col[i] = (float)-i;
  auto a = read<float>(kiln_broadcast_to(make(KILN_F32, {1000}, row), KILN_SHAPE(300, 1000)));
  auto b = read<float>(kiln_broadcast_to(make(KILN_F32, {300, 1}, col), KILN_SHAPE(300, 1000)));
  ASSERT_EQ(a.size(), 300000u);
  ASSERT_EQ(b.size(), 300000u);
  bool ok = true;
  for (int i = 0; i < 300 && ok; i++)
    for (int j = 0; j < 1000 && ok; j++) ok = a[i * 1000 + j] == (float)j && b[i * 1000 + j] == (float)-i;
  EXPECT_TRUE(ok);
  // a scalar filling 100K i64
  auto c = read<int64_t>(kiln_broadcast_to(kiln_scalar(KILN_I64, -3), KILN_SHAPE(100, 1000)));
  EXPECT_TRUE(std::all_of(c.begin(), c.end(), [](int64_t v) { return v == -3; }));
}

TEST(Movement, BroadcastErrors) {
  Scoped s;
  kiln_tensor *row = make<float>(KILN_F32, {3}, {1, 2, 3});
  EXPECT_EQ(kiln_broadcast_to(row, KILN_SHAPE(2, 4)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "broadcast_to: cannot broadcast (3,) to (2, 4)");
  EXPECT_EQ(kiln_broadcast_to(make<float>(KILN_F32, {2, 3}, {1, 2, 3, 4, 5, 6}), KILN_SHAPE(3)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("broadcast_to: cannot broadcast (2, 3) to (3,)"));
  EXPECT_EQ(kiln_broadcast_to(row, KILN_SHAPE(-1, 3)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("broadcast_to: "));
  EXPECT_THAT(kiln_last_error(), HasSubstr("negative"));
  EXPECT_EQ(kiln_broadcast_to(row, 2, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("broadcast_to: shape is NULL"));
  EXPECT_EQ(kiln_broadcast_to(row, 9, (const int64_t[9]){1, 1, 1, 1, 1, 1, 1, 1, 3}), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("broadcast_to: rank 9"));
  kiln_clear_error();
  EXPECT_EQ(kiln_broadcast_to(nullptr, KILN_SHAPE(3)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("broadcast_to: "));
}

// ---- transpose ----

TEST(Movement, Transpose2D) {
  Scoped s;
  kiln_tensor *m = make<float>(KILN_F32, {2, 3}, {1, 2, 3, 4, 5, 6});
  kiln_tensor *t = kiln_transpose(m, 0, nullptr);  // NULL = reverse
  EXPECT_EQ(shape_of(t), (V64{3, 2}));
  EXPECT_EQ(read<float>(t), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(read<float>(kiln_transpose(m, KILN_AXES(1, 0))), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(read<float>(kiln_transpose(m, KILN_AXES(0, 1))), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(read<float>(kiln_transpose(m, KILN_AXES(-1, 0))), (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

TEST(Movement, Transpose3DHandValues) {
  Scoped s;
  kiln_tensor *x = iota_i32({2, 3, 2});  // x[i][j][k] = 6i + 2j + k
  // (1, 0, 2) keeps the last axis: rows of 2 move
  kiln_tensor *a = kiln_transpose(x, KILN_AXES(1, 0, 2));
  EXPECT_EQ(shape_of(a), (V64{3, 2, 2}));
  EXPECT_EQ(read<int32_t>(a), (std::vector<int32_t>{0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11}));
  // reverse: (2, 3, 2)
  kiln_tensor *b = kiln_transpose(x, 0, nullptr);
  EXPECT_EQ(shape_of(b), (V64{2, 3, 2}));
  EXPECT_EQ(read<int32_t>(b), (std::vector<int32_t>{0, 6, 2, 8, 4, 10, 1, 7, 3, 9, 5, 11}));
  // (0, 2, 1): batched 2-D transposes
  kiln_tensor *c = kiln_transpose(x, KILN_AXES(0, 2, 1));
  EXPECT_EQ(shape_of(c), (V64{2, 2, 3}));
  EXPECT_EQ(read<int32_t>(c), (std::vector<int32_t>{0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11}));
}

TEST(Movement, TransposeRank0And1) {
  Scoped s;
  kiln_tensor *x = kiln_scalar(KILN_F64, 4);
  kiln_tensor *t = kiln_transpose(x, 0, nullptr);
  ASSERT_NE(t, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_rank(t), 0);
  EXPECT_EQ(kiln_tensor_item(t), 4);
  kiln_tensor *v = make<int64_t>(KILN_I64, {3}, {7, 8, 9});
  EXPECT_EQ(read<int64_t>(kiln_transpose(v, 0, nullptr)), (std::vector<int64_t>{7, 8, 9}));
  EXPECT_EQ(read<int64_t>(kiln_transpose(v, KILN_AXES(0))), (std::vector<int64_t>{7, 8, 9}));
}

TEST(Movement, TransposeUnitAndZeroDims) {
  Scoped s;
  kiln_tensor *x = make<float>(KILN_F32, {1, 3, 1}, {1, 2, 3});
  kiln_tensor *t = kiln_transpose(x, KILN_AXES(2, 1, 0));
  EXPECT_EQ(shape_of(t), (V64{1, 3, 1}));
  EXPECT_EQ(read<float>(t), (std::vector<float>{1, 2, 3}));
  kiln_tensor *z = kiln_zeros(KILN_F32, KILN_SHAPE(0, 4));
  kiln_tensor *zt = kiln_transpose(z, 0, nullptr);
  ASSERT_NE(zt, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(zt), (V64{4, 0}));
}

// Reference: out[i] with its multi-index read from x at the permuted index.
std::vector<int32_t> transpose_ref(const std::vector<int64_t> &shape, const std::vector<int> &perm) {
  int r = (int)shape.size();
  std::vector<int64_t> in_stride(r), out_shape(r);
  int64_t n = 1;
  for (int i = r - 1; i >= 0; i--) in_stride[i] = n, n *= shape[i];
  for (int i = 0; i < r; i++) out_shape[i] = shape[perm[i]];
  std::vector<int32_t> out(n);
  std::vector<int64_t> idx(r, 0);
  for (int64_t o = 0; o < n; o++) {
    int64_t off = 0;
    for (int i = 0; i < r; i++) off += idx[i] * in_stride[perm[i]];
    out[o] = (int32_t)off;
    for (int i = r - 1; i >= 0; i--) {
      if (++idx[i] < out_shape[i]) break;
      idx[i] = 0;
    }
  }
  return out;
}

TEST(Movement, TransposeEveryPermOf4D) {
  Scoped s;
  std::vector<int64_t> shape = {2, 3, 4, 5};
  kiln_tensor *x = iota_i32(shape);
  std::vector<int> perm = {0, 1, 2, 3};
  do {
    kiln_tensor *t = kiln_transpose(x, 4, perm.data());
    EXPECT_EQ(read<int32_t>(t), transpose_ref(shape, perm))
        << "perm " << perm[0] << perm[1] << perm[2] << perm[3];
  } while (std::next_permutation(perm.begin(), perm.end()));
}

// Element i of a width-W tensor holds pattern(i); a permuted copy must hold
// pattern(source index) everywhere.
template <typename T>
void check_width(kiln_dtype dt, const std::vector<int64_t> &shape, const std::vector<int> &perm,
                 const std::vector<int32_t> &want, T (*pattern)(int64_t)) {
  std::vector<T> v(want.size());
  for (size_t i = 0; i < v.size(); i++) v[i] = pattern((int64_t)i);
  kiln_tensor *x = make(dt, shape, v);
  auto got = read<T>(kiln_transpose(x, (int)perm.size(), perm.data()));
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < got.size(); i++) ok = got[i] == pattern(want[i]);
  EXPECT_TRUE(ok) << kiln_dtype_name(dt);
}

TEST(Movement, TransposeLargeTiled) {
  Scoped s;
  // 2-D (tiled, parallel, sizes not multiples of the tile), batched, and
  // each element width (1, 2, 4, 8 bytes)
  struct Case {
    std::vector<int64_t> shape;
    std::vector<int> perm;
  } cases[] = {{{300, 517}, {1, 0}}, {{3, 130, 70}, {0, 2, 1}}, {{70, 3, 130}, {2, 1, 0}},
               {{64, 64, 8}, {1, 0, 2}}, {{5, 200, 7, 9}, {3, 1, 2, 0}}, {{1, 2000, 1, 33}, {3, 2, 1, 0}}};
  for (const Case &c : cases) {
    std::vector<int32_t> want = transpose_ref(c.shape, c.perm);
    EXPECT_EQ(read<int32_t>(kiln_transpose(iota_i32(c.shape), (int)c.perm.size(), c.perm.data())), want);
    check_width<double>(KILN_F64, c.shape, c.perm, want, [](int64_t i) { return 0.5 * (double)i; });
    check_width<int64_t>(KILN_I64, c.shape, c.perm, want, [](int64_t i) { return -i; });
    check_width<uint16_t>(KILN_F16, c.shape, c.perm, want, [](int64_t i) { return (uint16_t)(i * 7); });
    check_width<uint16_t>(KILN_BF16, c.shape, c.perm, want, [](int64_t i) { return (uint16_t)(i ^ 0x5555); });
    check_width<uint8_t>(KILN_BOOL, c.shape, c.perm, want, [](int64_t i) { return (uint8_t)(i % 3 == 0); });
  }
}

TEST(Movement, TransposeErrors) {
  Scoped s;
  kiln_tensor *m = make<float>(KILN_F32, {2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(kiln_transpose(m, KILN_AXES(0, 0)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "transpose: perm (0, 0) is not a permutation of 2 axes");
  EXPECT_EQ(kiln_transpose(m, KILN_AXES(0, 2)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("transpose: perm (0, 2)"));
  EXPECT_EQ(kiln_transpose(m, KILN_AXES(2, 1, 0)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("transpose: perm has 3 axes"));
  kiln_clear_error();
  EXPECT_EQ(kiln_transpose(nullptr, 0, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("transpose: "));
}

// ---- slice ----

TEST(Movement, SliceHandValues) {
  Scoped s;
  kiln_tensor *x = iota_i32({3, 4});  // rows 0..3, 4..7, 8..11
  kiln_tensor *a = kiln_slice(x, (const int64_t[]){1, 1}, (const int64_t[]){2, 2});
  EXPECT_EQ(shape_of(a), (V64{2, 2}));
  EXPECT_EQ(read<int32_t>(a), (std::vector<int32_t>{5, 6, 9, 10}));
  // -1 = to the end, on each axis
  kiln_tensor *b = kiln_slice(x, (const int64_t[]){1, 2}, (const int64_t[]){-1, -1});
  EXPECT_EQ(shape_of(b), (V64{2, 2}));
  EXPECT_EQ(read<int32_t>(b), (std::vector<int32_t>{6, 7, 10, 11}));
  // whole rows: one contiguous run
  kiln_tensor *c = kiln_slice(x, (const int64_t[]){1, 0}, (const int64_t[]){2, -1});
  EXPECT_EQ(read<int32_t>(c), (std::vector<int32_t>{4, 5, 6, 7, 8, 9, 10, 11}));
  // one column
  kiln_tensor *d = kiln_slice(x, (const int64_t[]){0, 3}, (const int64_t[]){-1, 1});
  EXPECT_EQ(shape_of(d), (V64{3, 1}));
  EXPECT_EQ(read<int32_t>(d), (std::vector<int32_t>{3, 7, 11}));
}

TEST(Movement, Slice3DAndDtypes) {
  Scoped s;
  kiln_tensor *x = iota_i32({2, 3, 4});  // 12i + 4j + k
  kiln_tensor *a = kiln_slice(x, (const int64_t[]){1, 1, 1}, (const int64_t[]){1, 2, 2});
  EXPECT_EQ(read<int32_t>(a), (std::vector<int32_t>{17, 18, 21, 22}));
  kiln_tensor *h = make<uint16_t>(KILN_F16, {2, 3}, {0x3c00, 0x4000, 0x4200, 0x7c00, 0xfc00, 0x7e00});
  EXPECT_EQ(read<uint16_t>(kiln_slice(h, (const int64_t[]){0, 1}, (const int64_t[]){2, 2})),
            (std::vector<uint16_t>{0x4000, 0x4200, 0xfc00, 0x7e00}));
  kiln_tensor *b = make<uint8_t>(KILN_BOOL, {4}, {1, 0, 0, 1});
  EXPECT_EQ(read<uint8_t>(kiln_slice(b, (const int64_t[]){1}, (const int64_t[]){3})),
            (std::vector<uint8_t>{0, 0, 1}));
  kiln_tensor *f = make<double>(KILN_F64, {3}, {1.5, -2.5, 3.5});
  EXPECT_EQ(read<double>(kiln_slice(f, (const int64_t[]){2}, (const int64_t[]){-1})),
            (std::vector<double>{3.5}));
  kiln_tensor *l = make<int64_t>(KILN_I64, {2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(read<int64_t>(kiln_slice(l, (const int64_t[]){0, 1}, (const int64_t[]){2, 1})),
            (std::vector<int64_t>{2, 4}));
  // rank 0: nothing to slice, a copy
  kiln_tensor *sc = kiln_slice(kiln_scalar(KILN_F32, 3), nullptr, nullptr);
  ASSERT_NE(sc, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(sc), 3);
}

TEST(Movement, SliceZeroSize) {
  Scoped s;
  kiln_tensor *x = iota_i32({3, 4});
  kiln_tensor *a = kiln_slice(x, (const int64_t[]){1, 1}, (const int64_t[]){0, 2});
  ASSERT_NE(a, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(a), (V64{0, 2}));
  // begin may equal the dim: an empty slice to the end
  kiln_tensor *b = kiln_slice(x, (const int64_t[]){3, 4}, (const int64_t[]){-1, -1});
  ASSERT_NE(b, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(b), (V64{0, 0}));
  kiln_tensor *e = kiln_zeros(KILN_F32, KILN_SHAPE(0, 5));
  kiln_tensor *c = kiln_slice(e, (const int64_t[]){0, 2}, (const int64_t[]){-1, 3});
  ASSERT_NE(c, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(c), (V64{0, 3}));
}

TEST(Movement, SliceLarge) {
  Scoped s;
  kiln_tensor *x = iota_i32({400, 300});
  kiln_tensor *a = kiln_slice(x, (const int64_t[]){10, 7}, (const int64_t[]){380, 250});
  auto got = read<int32_t>(a);
  ASSERT_EQ(got.size(), 380u * 250u);
  bool ok = true;
  for (int i = 0; i < 380 && ok; i++)
    for (int j = 0; j < 250 && ok; j++) ok = got[i * 250 + j] == (10 + i) * 300 + 7 + j;
  EXPECT_TRUE(ok);
}

TEST(Movement, SliceErrors) {
  Scoped s;
  kiln_tensor *x = iota_i32({3, 4});
  EXPECT_EQ(kiln_slice(x, (const int64_t[]){0, 5}, (const int64_t[]){1, -1}), nullptr);
  EXPECT_STREQ(kiln_last_error(), "slice: begin[1] = 5 is not in [0, 4]");
  EXPECT_EQ(kiln_slice(x, (const int64_t[]){-1, 0}, (const int64_t[]){1, 1}), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: begin[0] = -1"));
  EXPECT_EQ(kiln_slice(x, (const int64_t[]){2, 0}, (const int64_t[]){2, 1}), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: size[0] = 2 does not fit"));
  EXPECT_EQ(kiln_slice(x, (const int64_t[]){0, 0}, (const int64_t[]){1, -2}), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: size[1] = -2"));
  EXPECT_EQ(kiln_slice(x, nullptr, (const int64_t[]){1, 1}), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: begin is NULL"));
  EXPECT_EQ(kiln_slice(x, (const int64_t[]){0, 0}, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: size is NULL"));
  kiln_clear_error();
  EXPECT_EQ(kiln_slice(nullptr, nullptr, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: "));
}

// ---- concat ----

TEST(Movement, ConcatAxis0And1) {
  Scoped s;
  kiln_tensor *a = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  kiln_tensor *b = make<float>(KILN_F32, {1, 2}, {5, 6});
  kiln_tensor *ab[] = {a, b};
  kiln_tensor *r0 = kiln_concat(2, ab, 0);
  EXPECT_EQ(shape_of(r0), (V64{3, 2}));
  EXPECT_EQ(read<float>(r0), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  kiln_tensor *c = make<float>(KILN_F32, {2, 1}, {7, 8});
  kiln_tensor *ac[] = {a, c, a};
  kiln_tensor *r1 = kiln_concat(3, ac, 1);
  EXPECT_EQ(shape_of(r1), (V64{2, 5}));
  EXPECT_EQ(read<float>(r1), (std::vector<float>{1, 2, 7, 1, 2, 3, 4, 8, 3, 4}));
  // negative axis
  EXPECT_EQ(read<float>(kiln_concat(3, ac, -1)), (std::vector<float>{1, 2, 7, 1, 2, 3, 4, 8, 3, 4}));
}

TEST(Movement, ConcatMiddleAxisAndDtypes) {
  Scoped s;
  kiln_tensor *x = iota_i32({2, 1, 2});  // 0 1 | 2 3
  kiln_tensor *y = make<int32_t>(KILN_I32, {2, 2, 2}, {10, 11, 12, 13, 14, 15, 16, 17});
  kiln_tensor *xy[] = {x, y};
  kiln_tensor *r = kiln_concat(2, xy, 1);
  EXPECT_EQ(shape_of(r), (V64{2, 3, 2}));
  EXPECT_EQ(read<int32_t>(r), (std::vector<int32_t>{0, 1, 10, 11, 12, 13, 2, 3, 14, 15, 16, 17}));
  kiln_tensor *d1 = make<double>(KILN_F64, {2}, {0.5, 1.5}), *d2 = make<double>(KILN_F64, {1}, {-1});
  kiln_tensor *dd[] = {d1, d2};
  EXPECT_EQ(read<double>(kiln_concat(2, dd, 0)), (std::vector<double>{0.5, 1.5, -1}));
  kiln_tensor *l1 = make<int64_t>(KILN_I64, {1, 1}, {INT64_MAX});
  kiln_tensor *l2 = make<int64_t>(KILN_I64, {1, 1}, {INT64_MIN});
  kiln_tensor *ll[] = {l1, l2};
  EXPECT_EQ(read<int64_t>(kiln_concat(2, ll, 1)), (std::vector<int64_t>{INT64_MAX, INT64_MIN}));
  kiln_tensor *b1 = make<uint8_t>(KILN_BOOL, {1, 2}, {1, 0}), *b2 = make<uint8_t>(KILN_BOOL, {1, 1}, {1});
  kiln_tensor *bb[] = {b1, b2};
  EXPECT_EQ(read<uint8_t>(kiln_concat(2, bb, 1)), (std::vector<uint8_t>{1, 0, 1}));
  kiln_tensor *h1 = make<uint16_t>(KILN_F16, {1, 2}, {0x7e01, 0x0001});
  kiln_tensor *h2 = make<uint16_t>(KILN_F16, {1, 2}, {0x8000, 0xfbff});
  kiln_tensor *hh[] = {h1, h2};
  EXPECT_EQ(read<uint16_t>(kiln_concat(2, hh, 0)), (std::vector<uint16_t>{0x7e01, 0x0001, 0x8000, 0xfbff}));
  // one tensor: its value
  kiln_tensor *one[] = {d1};
  EXPECT_EQ(read<double>(kiln_concat(1, one, 0)), (std::vector<double>{0.5, 1.5}));
}

TEST(Movement, ConcatZeroSizeParts) {
  Scoped s;
  kiln_tensor *a = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  kiln_tensor *e = kiln_zeros(KILN_F32, KILN_SHAPE(2, 0));
  kiln_tensor *b = make<float>(KILN_F32, {2, 1}, {5, 6});
  kiln_tensor *parts[] = {e, a, e, b, e};
  kiln_tensor *r = kiln_concat(5, parts, 1);
  EXPECT_EQ(shape_of(r), (V64{2, 3}));
  EXPECT_EQ(read<float>(r), (std::vector<float>{1, 2, 5, 3, 4, 6}));
  kiln_tensor *z = kiln_zeros(KILN_F32, KILN_SHAPE(0, 2));
  kiln_tensor *zz[] = {z, a, z};
  EXPECT_EQ(read<float>(kiln_concat(3, zz, 0)), (std::vector<float>{1, 2, 3, 4}));
  kiln_tensor *only_empty[] = {e, e};
  kiln_tensor *r2 = kiln_concat(2, only_empty, 1);
  ASSERT_NE(r2, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(r2), (V64{2, 0}));
  kiln_tensor *z2[] = {z, z};
  kiln_tensor *r3 = kiln_concat(2, z2, 1);  // empty outer axis
  ASSERT_NE(r3, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(r3), (V64{0, 4}));
}

TEST(Movement, ConcatLargeAndMany) {
  Scoped s;
  // 40 parts of different widths along the last axis, 2000 rows: parallel,
  // chunks that start and end in the middle of parts and rows
  std::vector<kiln_tensor *> parts;
  std::vector<int64_t> widths;
  int64_t total = 0;
  for (int k = 0; k < 40; k++) {
    int64_t w = k % 7;  // zero-width parts too
    widths.push_back(w);
    std::vector<int32_t> v(2000 * w);
    for (int64_t i = 0; i < 2000; i++)
      for (int64_t j = 0; j < w; j++) v[i * w + j] = (int32_t)(k * 1000000 + i * 100 + j);
    parts.push_back(make(KILN_I32, {2000, w}, v));
    total += w;
  }
  kiln_tensor *r = kiln_concat((int)parts.size(), parts.data(), 1);
  EXPECT_EQ(shape_of(r), (V64{2000, total}));
  auto got = read<int32_t>(r);
  bool ok = (int64_t)got.size() == 2000 * total;
  for (int64_t i = 0; i < 2000 && ok; i++) {
    int64_t at = 0;
    for (int k = 0; k < 40 && ok; k++)
      for (int64_t j = 0; j < widths[k] && ok; j++, at++)
        ok = got[i * total + at] == k * 1000000 + i * 100 + j;
  }
  EXPECT_TRUE(ok);
  // axis 0 of two big blocks
  kiln_tensor *big[] = {iota_i32({300, 200}), iota_i32({100, 200})};
  auto g0 = read<int32_t>(kiln_concat(2, big, 0));
  ASSERT_EQ(g0.size(), 80000u);
  EXPECT_EQ(g0[59999], 59999);
  EXPECT_EQ(g0[60000], 0);
  EXPECT_EQ(g0[79999], 19999);
}

TEST(Movement, ConcatErrors) {
  Scoped s;
  kiln_tensor *a = make<float>(KILN_F32, {2, 2}, {1, 2, 3, 4});
  kiln_tensor *b = make<float>(KILN_F32, {3, 3}, {0, 0, 0, 0, 0, 0, 0, 0, 0});
  kiln_tensor *ab[] = {a, b};
  EXPECT_EQ(kiln_concat(2, ab, 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "concat: shapes (2, 2) and (3, 3) (tensor 1) differ outside axis 0");
  kiln_tensor *d = make<double>(KILN_F64, {2, 2}, {1, 2, 3, 4});
  kiln_tensor *ad[] = {a, d};
  EXPECT_EQ(kiln_concat(2, ad, 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "concat: dtype mismatch: f32 and f64");
  kiln_tensor *aa[] = {a, a};
  EXPECT_EQ(kiln_concat(2, aa, 2), nullptr);
  EXPECT_STREQ(kiln_last_error(), "concat: axis 2 is out of range for rank 2");
  kiln_tensor *v = make<float>(KILN_F32, {2}, {1, 2});
  kiln_tensor *av[] = {a, v};
  EXPECT_EQ(kiln_concat(2, av, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("concat: shapes (2, 2) and (2,)"));
  kiln_tensor *sc[] = {kiln_scalar(KILN_F32, 1), kiln_scalar(KILN_F32, 2)};
  EXPECT_EQ(kiln_concat(2, sc, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("concat: "));
  EXPECT_EQ(kiln_concat(0, ab, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("concat: needs at least one tensor"));
  EXPECT_EQ(kiln_concat(2, nullptr, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("concat: "));
  kiln_clear_error();
  kiln_tensor *an[] = {a, nullptr};
  EXPECT_EQ(kiln_concat(2, an, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("concat: input 1 is NULL"));
}

}  // namespace
