// runtime_test.cc — the tensor runtime: constructors, accessors, ownership
// and scopes, errors and NULL propagation, devices, threads.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

TEST(Runtime, VersionAndDtypes) {
  EXPECT_STREQ(kiln_version(), "0.1.0");
  EXPECT_STREQ(kiln_dtype_name(KILN_F32), "f32");
  EXPECT_STREQ(kiln_dtype_name(KILN_F64), "f64");
  EXPECT_STREQ(kiln_dtype_name(KILN_I32), "i32");
  EXPECT_STREQ(kiln_dtype_name(KILN_I64), "i64");
  EXPECT_STREQ(kiln_dtype_name(KILN_BOOL), "bool");
  EXPECT_STREQ(kiln_dtype_name(KILN_F16), "f16");
  EXPECT_STREQ(kiln_dtype_name(KILN_BF16), "bf16");
  EXPECT_STREQ(kiln_dtype_name((kiln_dtype)99), "?");
  EXPECT_EQ(kiln_dtype_size(KILN_F64), 8u);
  EXPECT_EQ(kiln_dtype_size(KILN_BOOL), 1u);
  EXPECT_EQ(kiln_dtype_size(KILN_BF16), 2u);
}

TEST(Runtime, TensorNewCopiesAndReads) {
  Scoped s;
  float data[6] = {1, 2, 3, 4, 5, 6};
  kiln_tensor *t = kiln_tensor_new(KILN_F32, KILN_SHAPE(2, 3), data);
  ASSERT_NE(t, nullptr) << kiln_last_error();
  data[0] = 100;  // the tensor owns a copy
  EXPECT_EQ(kiln_tensor_dtype(t), KILN_F32);
  EXPECT_EQ(kiln_tensor_rank(t), 2);
  EXPECT_EQ(kiln_tensor_shape(t)[0], 2);
  EXPECT_EQ(kiln_tensor_shape(t)[1], 3);
  EXPECT_EQ(kiln_tensor_size(t), 6);
  EXPECT_STREQ(kiln_tensor_device(t), "cpu:0");
  EXPECT_EQ(read<float>(t), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ((uintptr_t)kiln_tensor_data(t) % 64, 0u) << "storage must be 64-byte aligned";
}

TEST(Runtime, LargeTensorsAreAligned) {
  Scoped s;
  kiln_tensor *t = kiln_zeros(KILN_F64, KILN_SHAPE(1000, 1000));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ((uintptr_t)kiln_tensor_data(t) % 64, 0u);
  const double *d = (const double *)kiln_tensor_data(t);
  double sum = 0;
  for (int i = 0; i < 1000000; i++) sum += d[i];
  EXPECT_EQ(sum, 0.0);
}

TEST(Runtime, Constructors) {
  Scoped s;
  kiln_tensor *z = kiln_zeros(KILN_I32, KILN_SHAPE(3));
  int32_t zi[3];
  ASSERT_EQ(kiln_tensor_read(z, zi, sizeof zi), 0);
  EXPECT_EQ(zi[0] | zi[1] | zi[2], 0);

  kiln_tensor *o = kiln_ones(KILN_F64, KILN_SHAPE(2, 2));
  double od[4];
  ASSERT_EQ(kiln_tensor_read(o, od, sizeof od), 0);
  for (double v : od) EXPECT_EQ(v, 1.0);

  kiln_tensor *f = kiln_fill(KILN_I64, KILN_SHAPE(5), -7);
  int64_t fd[5];
  ASSERT_EQ(kiln_tensor_read(f, fd, sizeof fd), 0);
  for (int64_t v : fd) EXPECT_EQ(v, -7);

  kiln_tensor *b = kiln_fill(KILN_BOOL, KILN_SHAPE(3), 2.5);
  uint8_t bd[3];
  ASSERT_EQ(kiln_tensor_read(b, bd, sizeof bd), 0);
  for (uint8_t v : bd) EXPECT_EQ(v, 1);

  kiln_tensor *e = kiln_eye(KILN_F32, 3);
  EXPECT_EQ(read<float>(e), (std::vector<float>{1, 0, 0, 0, 1, 0, 0, 0, 1}));

  kiln_tensor *sc = kiln_scalar(KILN_F32, 2.5);
  EXPECT_EQ(kiln_tensor_rank(sc), 0);
  EXPECT_EQ(kiln_tensor_size(sc), 1);
  EXPECT_EQ(kiln_tensor_item(sc), 2.5);

  kiln_tensor *like = kiln_scalar_like(e, -1.5);
  EXPECT_EQ(kiln_tensor_dtype(like), KILN_F32);
  EXPECT_EQ(kiln_tensor_rank(like), 0);
  EXPECT_EQ(kiln_tensor_item(like), -1.5);

  // f16 and bf16 scalars store rounded values
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_F16, 0.5)), 0.5);
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_BF16, 3.0)), 3.0);
  uint16_t h;
  ASSERT_EQ(kiln_tensor_read(kiln_scalar(KILN_F16, 1.0), &h, 2), 0);
  EXPECT_EQ(h, 0x3c00);
  ASSERT_EQ(kiln_tensor_read(kiln_scalar(KILN_BF16, 1.0), &h, 2), 0);
  EXPECT_EQ(h, 0x3f80);

  // bool data is kept canonical
  uint8_t raw[2] = {0, 7};
  kiln_tensor *bt = kiln_tensor_new(KILN_BOOL, KILN_SHAPE(2), raw);
  ASSERT_EQ(kiln_tensor_read(bt, raw, 2), 0);
  EXPECT_EQ(raw[1], 1);
  EXPECT_STREQ(kiln_last_error(), "");
}

TEST(Runtime, ZeroSizeAndRankEight) {
  Scoped s;
  kiln_tensor *t = kiln_zeros(KILN_F32, KILN_SHAPE(3, 0));
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(kiln_tensor_size(t), 0);
  EXPECT_EQ(kiln_tensor_read(t, nullptr, 0), 0);
  kiln_tensor *r8 = kiln_ones(KILN_F32, KILN_SHAPE(1, 2, 1, 2, 1, 2, 1, 2));
  ASSERT_NE(r8, nullptr);
  EXPECT_EQ(kiln_tensor_size(r8), 16);
}

TEST(Runtime, CastingToFloatSaturatesIntegers) {
  Scoped s;
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_I32, 1e20)), 2147483647.0);
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_I32, -3.9)), -3.0);
  EXPECT_EQ(kiln_tensor_item(kiln_scalar(KILN_I64, NAN)), 0.0);
}

TEST(Runtime, BadShapes) {
  Scoped s;
  EXPECT_EQ(kiln_zeros(KILN_F32, 9, (const int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 1}), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("zeros: rank 9 is not in [0, 8]"));
  EXPECT_EQ(kiln_ones(KILN_F32, KILN_SHAPE(2, -3)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("ones: shape[1] = -3 is negative"));
  EXPECT_EQ(kiln_tensor_new(KILN_F32, KILN_SHAPE(1LL << 40, 1LL << 40), nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_new: the element count of shape"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("overflows"));
  EXPECT_EQ(kiln_fill(KILN_F32, 2, nullptr, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("fill: shape is NULL"));
  EXPECT_EQ(kiln_zeros((kiln_dtype)42, KILN_SHAPE(2)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("zeros: invalid dtype 42"));
  EXPECT_EQ(kiln_eye(KILN_F32, -1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("eye: n = -1 is negative"));
  EXPECT_EQ(kiln_scalar((kiln_dtype)-1, 0), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scalar: invalid dtype -1"));
}

TEST(Runtime, ReadErrors) {
  Scoped s;
  kiln_tensor *t = kiln_ones(KILN_F32, KILN_SHAPE(4));
  float small[3];
  EXPECT_EQ(kiln_tensor_read(t, small, sizeof small), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_read: buffer of 12 bytes is too small"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("16 bytes"));
  EXPECT_EQ(kiln_tensor_read(t, nullptr, 16), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_read: destination is NULL"));
  kiln_clear_error();
  EXPECT_EQ(kiln_tensor_read(nullptr, small, sizeof small), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tensor_read: tensor is NULL"));
  EXPECT_TRUE(std::isnan(kiln_tensor_item(t)));
  EXPECT_THAT(kiln_last_error(), StartsWith("item: tensor has 4 elements, not 1"));
  EXPECT_EQ(kiln_tensor_rank(nullptr), -1);
  EXPECT_EQ(kiln_tensor_size(nullptr), -1);
  EXPECT_EQ(kiln_tensor_shape(nullptr), nullptr);
  EXPECT_EQ(kiln_tensor_device(nullptr), nullptr);
}

TEST(Runtime, ErrorsArePerThreadAndClearable) {
  kiln_clear_error();
  EXPECT_STREQ(kiln_last_error(), "");
  EXPECT_EQ(kiln_fail("user: %d is bad", 42), -1);
  EXPECT_STREQ(kiln_last_error(), "user: 42 is bad");
  std::string other;
  std::thread th([&] { other = kiln_last_error(); });
  th.join();
  EXPECT_EQ(other, "");
  EXPECT_STREQ(kiln_last_error(), "user: 42 is bad");
  kiln_clear_error();
  EXPECT_STREQ(kiln_last_error(), "");
}

TEST(Runtime, NullPropagatesAndKeepsTheFirstError) {
  Scoped s;
  kiln_tensor *a = kiln_ones(KILN_F32, KILN_SHAPE(2, 3));
  kiln_tensor *b = kiln_ones(KILN_F32, KILN_SHAPE(4));
  kiln_tensor *bad = kiln_add(a, b);
  EXPECT_EQ(bad, nullptr);
  std::string first = kiln_last_error();
  EXPECT_EQ(first, "add: incompatible shapes (2, 3) and (4,)");
  // a chain continues to fail with the first message
  EXPECT_EQ(kiln_mul(kiln_exp(bad), a), nullptr);
  EXPECT_EQ(kiln_reshape(bad, KILN_SHAPE(6)), nullptr);
  EXPECT_EQ(kiln_scalar_like(bad, 1), nullptr);
  EXPECT_EQ(kiln_to_device(bad, "cpu:0"), nullptr);
  EXPECT_EQ(kiln_last_error(), first);
  // with no error pending, a NULL input names the op
  kiln_clear_error();
  EXPECT_EQ(kiln_add(a, nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "add: input 1 is NULL");
  kiln_clear_error();
  EXPECT_EQ(kiln_scalar_like(nullptr, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scalar_like:"));
}

TEST(Runtime, ScopesReleaseWhatTheyOwn) {
  int64_t before = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *a = kiln_ones(KILN_F32, KILN_SHAPE(8));
  kiln_tensor *b = kiln_reshape(a, KILN_SHAPE(2, 4));  // a view holds a reference to a
  ASSERT_NE(b, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), before + 2);
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, EscapeHandsToParentOrCaller) {
  int64_t before = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *kept = nullptr;
  {
    kiln_scope_push();
    kiln_tensor *x = kiln_fill(KILN_F32, KILN_SHAPE(3), 2);
    kiln_fill(KILN_F32, KILN_SHAPE(3), 5);  // dies with the inner scope
    kept = kiln_scope_escape(x);
    EXPECT_EQ(kept, x);
    kiln_scope_pop();
  }
  EXPECT_EQ(kiln_debug_live_tensors(), before + 1);
  EXPECT_EQ(read<float>(kept), (std::vector<float>{2, 2, 2}));
  // escaping from the outermost scope gives the tensor to the caller
  kiln_tensor *mine = kiln_scope_escape(kept);
  EXPECT_EQ(mine, kept);
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), before + 1);
  kiln_release(mine);
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, EscapeErrors) {
  kiln_clear_error();
  kiln_tensor *t = kiln_ones(KILN_F32, KILN_SHAPE(1));  // caller-owned: no scope
  EXPECT_EQ(kiln_scope_escape(t), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scope_escape: no scope is open"));
  kiln_scope_push();
  EXPECT_EQ(kiln_scope_escape(t), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("scope_escape: the tensor is not owned by the current scope"));
  EXPECT_EQ(kiln_scope_escape(nullptr), nullptr);
  kiln_scope_pop();
  kiln_release(t);
  kiln_release(nullptr);  // fine
  kiln_scope_pop();       // popping with no scope open is harmless
}

TEST(Runtime, RetainOutlivesTheScope) {
  int64_t before = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *t = kiln_retain(kiln_fill(KILN_I32, KILN_SHAPE(2), 9));
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), before + 1);
  kiln_tensor *sum = kiln_reduce_sum(t, 0, nullptr, false);  // no scope: the caller owns it
  EXPECT_EQ(kiln_tensor_item(sum), 18.0) << kiln_last_error();
  EXPECT_EQ(kiln_debug_live_tensors(), before + 2);
  kiln_release(sum);
  kiln_release(t);
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, TenThousandScopedIterationsLeaveNothing) {
  int64_t before = kiln_debug_live_tensors();
  kiln_tensor *w = kiln_fill(KILN_F32, KILN_SHAPE(4, 4), 0.5);
  for (int i = 0; i < 10000; i++) {
    kiln_scope_push();
    kiln_tensor *x = kiln_fill(KILN_F32, KILN_SHAPE(4, 4), i);
    kiln_tensor *y = kiln_add(kiln_mul(x, w), kiln_reshape(x, KILN_SHAPE(16)) ? x : nullptr);
    ASSERT_NE(y, nullptr) << kiln_last_error();
    kiln_scope_pop();
  }
  kiln_release(w);
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, NestedScopesOnlyReleaseTheirOwn) {
  int64_t before = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *outer = kiln_ones(KILN_F32, KILN_SHAPE(2));
  for (int i = 0; i < 100; i++) {
    kiln_scope_push();
    for (int j = 0; j < 50; j++) kiln_add(outer, outer);
    kiln_scope_pop();
  }
  EXPECT_EQ(kiln_debug_live_tensors(), before + 1);
  EXPECT_EQ(read<float>(outer), (std::vector<float>{1, 1}));
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, Devices) {
  Scoped s;
  ASSERT_GE(kiln_device_count(), 1);
  EXPECT_STREQ(kiln_device_name(0), "cpu:0");
  EXPECT_EQ(kiln_device_name(-1), nullptr);
  EXPECT_EQ(kiln_device_name(kiln_device_count()), nullptr);
  EXPECT_STREQ(kiln_device_current(), "cpu:0");
  EXPECT_EQ(kiln_device_push("cpu:0"), 0);
  EXPECT_STREQ(kiln_device_current(), "cpu:0");
  kiln_device_pop();
  kiln_device_pop();  // extra pops are harmless
  EXPECT_EQ(kiln_device_push("tpu:3"), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("device_push: unknown device 'tpu:3' (devices: cpu:0"));
  EXPECT_EQ(kiln_device_push(nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("device_push: unknown device"));
  kiln_tensor *t = kiln_ones(KILN_F32, KILN_SHAPE(3));
  kiln_tensor *c = kiln_to_device(t, "cpu:0");
  ASSERT_NE(c, nullptr);
  EXPECT_STREQ(kiln_tensor_device(c), "cpu:0");
  EXPECT_EQ(read<float>(c), (std::vector<float>{1, 1, 1}));
  if (kiln_device_count() == 1) {
    EXPECT_EQ(kiln_to_device(t, "gpu:0"), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("to_device: unknown device 'gpu:0'"));
  }
}

TEST(Runtime, IndependentEagerWorkInTwoThreads) {
  int64_t before = kiln_debug_live_tensors();
  kiln_tensor *shared = kiln_fill(KILN_F32, KILN_SHAPE(64), 1);  // immutable, shared by both
  auto work = [&](float k, double *result) {
    kiln_scope_push();
    double total = 0;
    for (int i = 0; i < 2000; i++) {
      kiln_scope_push();
      kiln_tensor *x = kiln_fill(KILN_F32, KILN_SHAPE(64), k);
      kiln_tensor *y = kiln_reduce_sum(kiln_mul(kiln_add(x, shared), shared), 0, nullptr, false);
      total += kiln_tensor_item(y);
      kiln_scope_pop();
    }
    *result = total;
    kiln_scope_pop();
  };
  double r1 = 0, r2 = 0;
  std::thread t1(work, 2.0f, &r1), t2(work, 3.0f, &r2);
  t1.join();
  t2.join();
  EXPECT_EQ(r1, 2000.0 * 64 * 3);
  EXPECT_EQ(r2, 2000.0 * 64 * 4);
  kiln_release(shared);
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

// Large ops split over the pool; two threads compete for it (one gets it,
// the other runs serially) and many back-to-back jobs reuse the workers.
TEST(Runtime, ParallelKernelsFromTwoThreads) {
  int64_t before = kiln_debug_live_tensors();
  const int64_t n = 1 << 18;
  auto work = [&](float k, bool *ok) {
    kiln_scope_push();
    *ok = true;
    for (int i = 0; i < 200 && *ok; i++) {
      kiln_scope_push();
      kiln_tensor *x = kiln_fill(KILN_F32, 1, &n, k);
      kiln_tensor *y = kiln_add(kiln_mul(x, x), x);  // k*k + k everywhere
      const float *d = y ? (const float *)kiln_tensor_data(y) : nullptr;
      *ok = d && d[0] == k * k + k && d[n / 2] == k * k + k && d[n - 1] == k * k + k;
      kiln_scope_pop();
    }
    kiln_scope_pop();
  };
  bool ok1 = false, ok2 = false;
  std::thread t1(work, 2.0f, &ok1), t2(work, 3.0f, &ok2);
  t1.join();
  t2.join();
  EXPECT_TRUE(ok1);
  EXPECT_TRUE(ok2);
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, ThreadExitReleasesItsOpenScopes) {
  int64_t before = kiln_debug_live_tensors();
  std::thread th([] {
    kiln_scope_push();
    kiln_ones(KILN_F32, KILN_SHAPE(16));  // never popped: released at thread exit
  });
  th.join();
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Runtime, NumThreads) { EXPECT_GE(kiln_num_threads(), 1); }

}  // namespace
