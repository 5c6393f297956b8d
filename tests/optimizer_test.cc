// optimizer_test.cc — SGD, momentum (plain and Nesterov) and Adam against
// steps computed by hand, training small problems to their minimum, and
// every bad argument.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

int apply1(kiln_optimizer *o, kiln_variable *v, kiln_tensor *g) { return kiln_optimizer_apply(o, 1, &v, &g); }

TEST(Optimizer, SgdOneStepF32) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f32({1, 2, 3}), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_new(0.5));
  ASSERT_EQ(apply1(o, w, f32({0.5f, -1, 4})), 0) << kiln_last_error();
  // 1 - 0.25, 2 + 0.5, 3 - 2
  EXPECT_EQ(read<float>(w), (std::vector<float>{0.75f, 2.5f, 1.0f}));
}

TEST(Optimizer, SgdOneStepF64Matrix) {
  Scoped s;
  Owned own;
  double init[4] = {1, 2, 3, 4}, grad[4] = {10, 0, -10, 0.5};
  kiln_variable *w = own.var(kiln_tensor_new(KILN_F64, KILN_SHAPE(2, 2), init), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_new(0.1));
  ASSERT_EQ(apply1(o, w, kiln_tensor_new(KILN_F64, KILN_SHAPE(2, 2), grad)), 0) << kiln_last_error();
  std::vector<double> got = read<double>(w);
  EXPECT_DOUBLE_EQ(got[0], 0.0);
  EXPECT_DOUBLE_EQ(got[1], 2.0);
  EXPECT_DOUBLE_EQ(got[2], 4.0);
  EXPECT_DOUBLE_EQ(got[3], 3.95);
}

TEST(Optimizer, SgdScalarVariable) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(kiln_scalar(KILN_F32, 3), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_new(0.25));
  ASSERT_EQ(apply1(o, w, kiln_scalar(KILN_F32, 2)), 0) << kiln_last_error();
  EXPECT_EQ(read<float>(w), (std::vector<float>{2.5f}));
}

TEST(Optimizer, MomentumTwoSteps) {
  Scoped s;
  Owned own;
  // lr 0.1, momentum 0.9; w = 1 then gradients 1 and 2.
  // step 1: m = 1,              w = 1 - 0.1 * 1     = 0.9
  // step 2: m = 0.9 * 1 + 2 = 2.9, w = 0.9 - 0.1 * 2.9 = 0.61
  kiln_variable *w = own.var(f64({1, -1}), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_momentum_new(0.1, 0.9, false));
  ASSERT_EQ(apply1(o, w, f64({1, -1})), 0) << kiln_last_error();
  std::vector<double> got = read<double>(w);
  EXPECT_NEAR(got[0], 0.9, 1e-15);
  EXPECT_NEAR(got[1], -0.9, 1e-15);
  ASSERT_EQ(apply1(o, w, f64({2, -2})), 0) << kiln_last_error();
  got = read<double>(w);
  EXPECT_NEAR(got[0], 0.61, 1e-15);
  EXPECT_NEAR(got[1], -0.61, 1e-15);
}

TEST(Optimizer, NesterovTwoSteps) {
  Scoped s;
  Owned own;
  // step 1: m = 1,   w = 1 - 0.1 * (1 + 0.9 * 1)      = 0.81
  // step 2: m = 2.9, w = 0.81 - 0.1 * (2 + 0.9 * 2.9) = 0.81 - 0.461 = 0.349
  kiln_variable *w = own.var(f32({1}), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_momentum_new(0.1, 0.9, true));
  ASSERT_EQ(apply1(o, w, f32({1})), 0) << kiln_last_error();
  EXPECT_NEAR(read<float>(w)[0], 0.81f, 1e-6);
  ASSERT_EQ(apply1(o, w, f32({2})), 0) << kiln_last_error();
  EXPECT_NEAR(read<float>(w)[0], 0.349f, 1e-6);
}

// The eager momentum step in one pass (sgd_eager.c) has the bits of the
// ops it replaces (m = m * 0.9 + g; w = w - m * 0.1; Nesterov: w = w - (g +
// m * 0.9) * 0.1), run here as eager ops: f32 and f64, three steps over
// NaN, infinities, -0, subnormals and huge values in the variable and the
// gradients, 70000 elements (many tasks).
TEST(Optimizer, MomentumInOnePassEqualsTheOpsBitForBit) {
  Scoped s;
  const int64_t n = 70000;
  const double specials[] = {NAN, INFINITY, -INFINITY, -0.0, 0.0, 1e-40, -3e-310, 3e38, -1e300, 1.0};
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    for (bool nesterov : {false, true}) {
      SCOPED_TRACE(std::string(kiln_dtype_name(dt)) + (nesterov ? " nesterov" : " plain"));
      Owned own;
      unsigned seed = 7;
      auto draw = [&]() {
        std::vector<double> v((size_t)n);
        for (int64_t i = 0; i < n; i++) {
          seed = seed * 1103515245u + 12345u;
          v[(size_t)i] = (seed >> 8) % 50 == 0 ? specials[(seed >> 16) % 10] : ((double)(seed >> 9) / 8388608.0 - 1) * 3;
        }
        return kiln_cast(kiln_tensor_new(KILN_F64, KILN_SHAPE(n), v.data()), dt);
      };
      kiln_tensor *w = draw(), *m = kiln_zeros(dt, KILN_SHAPE(n));
      kiln_variable *fast = own.var(w, "fast");
      kiln_optimizer *o = own.opt(kiln_sgd_momentum_new(0.1, 0.9, nesterov));
      kiln_tensor *mom = kiln_scalar(dt, 0.9), *lr = kiln_scalar(dt, 0.1);
      for (int step = 0; step < 3; step++) {
        kiln_tensor *g = draw();
        ASSERT_EQ(apply1(o, fast, g), 0) << kiln_last_error();
        m = kiln_add(kiln_mul(m, mom), g);
        w = kiln_sub(w, kiln_mul(nesterov ? kiln_add(g, kiln_mul(m, mom)) : m, lr));
        ASSERT_NE(w, nullptr) << kiln_last_error();
        kiln_tensor *got = kiln_variable_read(fast);
        size_t bytes = (size_t)n * kiln_dtype_size(dt);
        EXPECT_EQ(memcmp(kiln_tensor_data(got), kiln_tensor_data(w), bytes), 0) << "step " << step;
      }
    }
  }
}

TEST(Optimizer, MomentumZeroIsSgd) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f32({1}), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_momentum_new(0.5, 0.0, false));
  ASSERT_EQ(apply1(o, w, f32({1})), 0);
  ASSERT_EQ(apply1(o, w, f32({1})), 0);
  EXPECT_EQ(read<float>(w)[0], 0.0f);
}

TEST(Optimizer, AdamTwoStepsF64) {
  Scoped s;
  Owned own;
  // lr 0.01, beta1 0.9, beta2 0.999, eps 1e-8. Step 1: mhat = g and
  // vhat = g^2, so w -= 0.01 * g / (|g| + 1e-8): about lr * sign(g).
  kiln_variable *w = own.var(f64({1, 1, 1}), "w");
  kiln_optimizer *o = own.opt(kiln_adam_new(0.01, 0.9, 0.999, 1e-8));
  ASSERT_EQ(apply1(o, w, f64({2, -0.5, 0})), 0) << kiln_last_error();
  std::vector<double> got = read<double>(w);
  EXPECT_NEAR(got[0], 0.99000000005, 1e-15);  // 1 - 0.01 * 2 / (2 + 1e-8)
  EXPECT_NEAR(got[1], 1.0099999998, 1e-15);   // 1 + 0.01 * 0.5 / (0.5 + 1e-8)
  EXPECT_EQ(got[2], 1.0);                     // 0 / (0 + eps)
  // Step 2 with g = (1, 0.25, -3); for the first element:
  //   m = 0.9 * 0.2 + 0.1 * 1 = 0.28,  mhat = 0.28 / (1 - 0.81) = 1.47368...
  //   v = 0.999 * 0.004 + 0.001 * 1 = 0.004996,  vhat = v / (1 - 0.998001) = 2.49925...
  //   w = 0.99000000005 - 0.01 * 1.47368 / (sqrt(2.49925) + 1e-8) = 0.98067820372...
  ASSERT_EQ(apply1(o, w, f64({1, 0.25, -3})), 0) << kiln_last_error();
  got = read<double>(w);
  EXPECT_NEAR(got[0], 0.98067820372085098, 1e-14);
  EXPECT_NEAR(got[1], 1.0126633701292154, 1e-14);
  EXPECT_NEAR(got[2], 1.0074413682005997, 1e-14);
}

TEST(Optimizer, AdamFirstStepIsLearningRateTimesSignF32) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f32({0, 0, 0, 0}), "w");
  kiln_optimizer *o = own.opt(kiln_adam_new(0.001, 0.9, 0.999, 1e-8));
  ASSERT_EQ(apply1(o, w, f32({100, -3, 1e-3f, -7})), 0) << kiln_last_error();
  std::vector<float> got = read<float>(w);
  EXPECT_NEAR(got[0], -0.001f, 1e-8);
  EXPECT_NEAR(got[1], 0.001f, 1e-8);
  EXPECT_NEAR(got[2], -0.001f * (1e-3f / (1e-3f + 1e-8f)), 1e-8);  // eps matters at |g| = 1e-3
  EXPECT_NEAR(got[3], 0.001f, 1e-8);
}

TEST(Optimizer, AdamStepCountsApplies) {
  Scoped s;
  Owned own;
  // The step count belongs to the optimizer: a variable first updated at
  // step 2 is bias-corrected with t = 2 (m = 0.1 g, mhat = 0.1 g / 0.19).
  kiln_variable *a = own.var(f64({0}), "a");
  kiln_variable *b = own.var(f64({0}), "b");
  kiln_optimizer *o = own.opt(kiln_adam_new(1.0, 0.9, 0.999, 0));
  kiln_variable *vars[2] = {a, b};
  kiln_tensor *g1[2] = {f64({1}), nullptr};
  ASSERT_EQ(kiln_optimizer_apply(o, 2, vars, g1), 0) << kiln_last_error();
  EXPECT_EQ(read<double>(b)[0], 0.0);  // NULL gradient: skipped
  EXPECT_NEAR(read<double>(a)[0], -1.0, 1e-15);
  kiln_tensor *g2[2] = {nullptr, f64({1})};
  ASSERT_EQ(kiln_optimizer_apply(o, 2, vars, g2), 0) << kiln_last_error();
  // mhat = 0.1 / 0.19, vhat = 0.001 / 0.001999: w = -(0.1/0.19) / sqrt(0.001/0.001999)
  EXPECT_NEAR(read<double>(b)[0], -(0.1 / 0.19) / std::sqrt(0.001 / 0.001999), 1e-12);
  EXPECT_NEAR(read<double>(a)[0], -1.0, 1e-15);
}

TEST(Optimizer, HalfPrecisionVariables) {
  Scoped s;
  Owned own;
  // f16 and bf16 are computed in f32 and stored back: 1 - 0.5 and 2 - 0.25
  // are exact in both.
  for (kiln_dtype dt : {KILN_F16, KILN_BF16}) {
    kiln_variable *w = own.var(kiln_cast(f32({1, 2}), dt), "w");
    kiln_optimizer *o = own.opt(kiln_sgd_new(1.0));
    ASSERT_EQ(apply1(o, w, kiln_cast(f32({0.5f, 0.25f}), dt)), 0) << kiln_last_error();
    kiln_tensor *v = kiln_cast(kiln_variable_read(w), KILN_F32);
    ASSERT_NE(v, nullptr) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_dtype(kiln_variable_read(w)), dt);
    float out[2];
    ASSERT_EQ(kiln_tensor_read(v, out, sizeof out), 0);
    EXPECT_EQ(out[0], 0.5f) << kiln_dtype_name(dt);
    EXPECT_EQ(out[1], 1.75f) << kiln_dtype_name(dt);
  }
  kiln_variable *w = own.var(kiln_cast(f32({1}), KILN_BF16), "w");
  kiln_optimizer *adam = own.opt(kiln_adam_new(0.5, 0.9, 0.999, 0));
  ASSERT_EQ(apply1(adam, w, kiln_cast(f32({3}), KILN_BF16)), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(kiln_variable_read(w)), 0.5);  // 1 - 0.5 * sign(3)
}

TEST(Optimizer, SameVariableTwiceAppliesBoth) {
  Scoped s;
  Owned own;
  for (kiln_dtype dt : {KILN_F32, KILN_BF16}) {
    kiln_variable *w = own.var(kiln_cast(f32({1}), dt), "w");
    kiln_optimizer *o = own.opt(kiln_sgd_new(1.0));
    kiln_variable *vars[2] = {w, w};
    kiln_tensor *grads[2] = {kiln_cast(f32({1}), dt), kiln_cast(f32({2}), dt)};
    ASSERT_EQ(kiln_optimizer_apply(o, 2, vars, grads), 0) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_item(kiln_variable_read(w)), -2.0) << kiln_dtype_name(dt);  // 1 - 1 - 2
  }
}

TEST(Optimizer, ManyVariables) {
  Scoped s;
  Owned own;
  // enough variables to grow the slot table several times
  kiln_optimizer *o = own.opt(kiln_adam_new(0.5, 0.9, 0.999, 0));
  std::vector<kiln_variable *> vars;
  std::vector<kiln_tensor *> grads;
  for (int i = 0; i < 300; i++) {
    char name[16];
    snprintf(name, sizeof name, "v%d", i);
    vars.push_back(own.var(f32({(float)i}), name));
    grads.push_back(f32({i % 2 ? 1.0f : -1.0f}));
  }
  for (int step = 0; step < 2; step++)
    ASSERT_EQ(kiln_optimizer_apply(o, 300, vars.data(), grads.data()), 0) << kiln_last_error();
  // the same gradient twice: mhat = g and vhat = g^2 at both steps
  for (int i = 0; i < 300; i++)
    EXPECT_NEAR(read<float>(vars[i])[0], i + (i % 2 ? -1.0f : 1.0f), 1e-5) << i;
}

// Minimises sum((w - c)^2) with gradients from a tape.
template <typename Make>
void train_quadratic(Make make, int steps, double tol) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f32({0, 0, 0}), "w");
  kiln_optimizer *o = own.opt(make());
  for (int i = 0; i < steps; i++) {
    kiln_scope_push();
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tensor *d = kiln_sub(kiln_variable_read(w), f32({3, -2, 0.5f}));
    kiln_tensor *loss = kiln_reduce_sum(kiln_square(d), 0, nullptr, false);
    kiln_tape_end(tape);
    kiln_tensor *g = nullptr;
    ASSERT_EQ(kiln_tape_gradient_vars(tape, loss, 1, &w, &g), 0) << kiln_last_error();
    ASSERT_EQ(apply1(o, w, g), 0) << kiln_last_error();
    kiln_tape_free(tape);
    kiln_scope_pop();
  }
  std::vector<float> got = read<float>(w);
  EXPECT_NEAR(got[0], 3, tol);
  EXPECT_NEAR(got[1], -2, tol);
  EXPECT_NEAR(got[2], 0.5, tol);
}

TEST(Optimizer, TrainsQuadraticSgd) {
  train_quadratic([] { return kiln_sgd_new(0.1); }, 100, 1e-5);
}
TEST(Optimizer, TrainsQuadraticMomentum) {
  train_quadratic([] { return kiln_sgd_momentum_new(0.05, 0.9, false); }, 300, 1e-4);
}
TEST(Optimizer, TrainsQuadraticNesterov) {
  train_quadratic([] { return kiln_sgd_momentum_new(0.05, 0.9, true); }, 300, 1e-4);
}
TEST(Optimizer, TrainsQuadraticAdam) {
  train_quadratic([] { return kiln_adam_new(0.05, 0.9, 0.999, 1e-8); }, 1000, 1e-3);
}

TEST(Optimizer, ApplyIsNotRecorded) {
  Scoped s;
  Owned own;
  // An update under an active tape: the loss computed afterwards still
  // depends on the variable through one read only.
  kiln_variable *w = own.var(f32({2}), "w");
  kiln_optimizer *o = own.opt(kiln_adam_new(0.1, 0.9, 0.999, 1e-8));
  kiln_tape *tape = kiln_tape_begin(true);
  ASSERT_EQ(apply1(o, w, f32({1})), 0) << kiln_last_error();
  kiln_tensor *loss = kiln_mul(kiln_variable_read(w), f32({3}));
  kiln_tape_end(tape);
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient_vars(tape, loss, 1, &w, &g), 0) << kiln_last_error();
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(kiln_tensor_item(g), 3.0);
  kiln_tape_free(tape);
}

TEST(Optimizer, ConstructorErrors) {
  Scoped s;
  const double nan = std::nan(""), inf = INFINITY;
  for (double lr : {0.0, -1.0, nan, inf}) {
    kiln_clear_error();
    EXPECT_EQ(kiln_sgd_new(lr), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("sgd_new: learning_rate = "));
    EXPECT_EQ(kiln_sgd_momentum_new(lr, 0.9, false), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("sgd_momentum_new: learning_rate = "));
    EXPECT_EQ(kiln_adam_new(lr, 0.9, 0.999, 1e-8), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("adam_new: learning_rate = "));
  }
  EXPECT_EQ(kiln_sgd_new(-0.5), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("-0.5"));
  for (double m : {1.0, -0.1, 1.5, nan}) {
    EXPECT_EQ(kiln_sgd_momentum_new(0.1, m, true), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("sgd_momentum_new: momentum = "));
    EXPECT_THAT(kiln_last_error(), HasSubstr("is not in [0, 1)"));
  }
  for (double b : {1.0, -0.1, nan}) {
    EXPECT_EQ(kiln_adam_new(0.1, b, 0.999, 1e-8), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("adam_new: beta1 = "));
    EXPECT_EQ(kiln_adam_new(0.1, 0.9, b, 1e-8), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("adam_new: beta2 = "));
  }
  for (double e : {-1e-8, nan, inf}) {
    EXPECT_EQ(kiln_adam_new(0.1, 0.9, 0.999, e), nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith("adam_new: epsilon = "));
  }
  // the edges that are allowed
  kiln_optimizer *o = kiln_adam_new(1e-30, 0, 0, 0);
  EXPECT_NE(o, nullptr) << kiln_last_error();
  kiln_optimizer_free(o);
  kiln_optimizer_free(nullptr);
}

TEST(Optimizer, ApplyArgumentErrors) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f32({1, 2}), "w");
  kiln_optimizer *o = own.opt(kiln_sgd_new(0.1));
  kiln_tensor *g = f32({1, 1});
  kiln_variable *vars[2] = {w, nullptr};
  kiln_tensor *grads[2] = {g, g};

  EXPECT_EQ(kiln_optimizer_apply(nullptr, 1, vars, grads), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: optimizer is NULL");
  EXPECT_EQ(kiln_optimizer_apply(o, -1, vars, grads), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: n = -1 is negative");
  EXPECT_EQ(kiln_optimizer_apply(o, 1, nullptr, grads), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: vars is NULL");
  EXPECT_EQ(kiln_optimizer_apply(o, 1, vars, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: grads is NULL");
  EXPECT_EQ(kiln_optimizer_apply(o, 2, vars, grads), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: vars[1] is NULL");
  EXPECT_EQ(kiln_optimizer_apply(o, 0, nullptr, nullptr), 0) << "nothing to do";
  EXPECT_EQ(read<float>(w), (std::vector<float>{1, 2})) << "failed applies changed w";
}

TEST(Optimizer, GradientMustMatchVariable) {
  Scoped s;
  Owned own;
  kiln_variable *a = own.var(f32({1, 2, 3}), "a");
  kiln_variable *w = own.var(kiln_zeros(KILN_F32, KILN_SHAPE(2, 3)), "w");
  kiln_optimizer *o = own.opt(kiln_adam_new(0.1, 0.9, 0.999, 1e-8));
  kiln_variable *vars[2] = {a, w};
  kiln_tensor *shape_bad[2] = {f32({1, 1, 1}), f32({1, 1, 1})};
  EXPECT_EQ(kiln_optimizer_apply(o, 2, vars, shape_bad), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: grads[1] is f32(3,) but variable 'w' is f32(2, 3)");
  kiln_tensor *dtype_bad[2] = {f32({1, 1, 1}), kiln_zeros(KILN_F64, KILN_SHAPE(2, 3))};
  EXPECT_EQ(kiln_optimizer_apply(o, 2, vars, dtype_bad), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: grads[1] is f64(2, 3) but variable 'w' is f32(2, 3)");
  kiln_tensor *broadcastable[2] = {kiln_scalar(KILN_F32, 1), nullptr};
  EXPECT_EQ(kiln_optimizer_apply(o, 2, vars, broadcastable), -1);
  EXPECT_STREQ(kiln_last_error(), "optimizer_apply: grads[0] is f32() but variable 'a' is f32(3,)");
  // a failed apply changes nothing: a is untouched, and Adam's step count
  // did not advance (the next step is a first step: w -= lr * sign(g))
  EXPECT_EQ(read<float>(a), (std::vector<float>{1, 2, 3}));
  kiln_tensor *good[2] = {f32({1, -1, 1}), nullptr};
  ASSERT_EQ(kiln_optimizer_apply(o, 2, vars, good), 0) << kiln_last_error();
  std::vector<float> got = read<float>(a);
  EXPECT_NEAR(got[0], 0.9f, 1e-6);
  EXPECT_NEAR(got[1], 2.1f, 1e-6);
  EXPECT_NEAR(got[2], 2.9f, 1e-6);
}

TEST(Optimizer, IntegerVariablesAreRejected) {
  Scoped s;
  Owned own;
  int32_t one[2] = {1, 1};
  kiln_variable *w = own.var(kiln_tensor_new(KILN_I32, KILN_SHAPE(2), one), "steps");
  kiln_optimizer *o = own.opt(kiln_sgd_new(1));
  EXPECT_EQ(apply1(o, w, kiln_tensor_new(KILN_I32, KILN_SHAPE(2), one)), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("optimizer_apply: variable 'steps' is i32"));
  EXPECT_EQ(apply1(o, w, nullptr), 0) << "a NULL gradient skips the variable";
}

TEST(Optimizer, SeparateOptimizersKeepSeparateState) {
  Scoped s;
  Owned own;
  kiln_variable *w = own.var(f64({0}), "w");
  kiln_optimizer *a = own.opt(kiln_sgd_momentum_new(1, 0.5, false));
  kiln_optimizer *b = own.opt(kiln_sgd_momentum_new(1, 0.5, false));
  ASSERT_EQ(apply1(a, w, f64({1})), 0);  // m_a = 1, w = -1
  ASSERT_EQ(apply1(b, w, f64({1})), 0);  // m_b = 1, w = -2
  ASSERT_EQ(apply1(a, w, f64({1})), 0);  // m_a = 1.5, w = -3.5
  EXPECT_EQ(read<double>(w)[0], -3.5);
}

// Slots belong to a variable, not to its address: a variable made where a
// freed one lived starts from fresh moments (the reference: the same
// optimizer history on other variables, then a new one).
TEST(Optimizer, ANewVariableAtAFreedOnesAddressStartsFresh) {
  Scoped s;
  Owned own;
  kiln_optimizer *o = own.opt(kiln_adam_new(0.1, 0.9, 0.999, 1e-8));
  kiln_optimizer *ref = own.opt(kiln_adam_new(0.1, 0.9, 0.999, 1e-8));
  kiln_variable *v1 = kiln_variable_new(f64({1, 2, 3}), "w");
  kiln_variable *d = own.var(f64({1, 2, 3}), "w");
  for (int i = 0; i < 3; i++) {  // large first moments, all positive
    ASSERT_EQ(apply1(o, v1, f64({5, 5, 5})), 0) << kiln_last_error();
    ASSERT_EQ(apply1(ref, d, f64({5, 5, 5})), 0) << kiln_last_error();
  }
  const void *addr = v1;
  kiln_variable_free(v1);
  // a new variable at v1's address, where the allocator gives it back
  std::vector<kiln_variable *> tries;
  kiln_variable *v2 = nullptr;
  for (int i = 0; i < 64 && !v2; i++) {
    kiln_variable *t = kiln_variable_new(f64({4, 4, 4}), "w");
    ASSERT_NE(t, nullptr);
    if ((const void *)t == addr)
      v2 = t;
    else
      tries.push_back(t);
  }
  if (!v2) v2 = tries.back(), tries.pop_back();  // (a sanitizer's allocator never reuses at once)
  for (kiln_variable *t : tries) kiln_variable_free(t);
  kiln_variable *w = own.var(f64({4, 4, 4}), "w");
  ASSERT_EQ(apply1(o, v2, f64({-1, 1, -2})), 0) << kiln_last_error();
  ASSERT_EQ(apply1(ref, w, f64({-1, 1, -2})), 0) << kiln_last_error();
  EXPECT_EQ(read<double>(v2), read<double>(w)) << "v2 reused v1's address: " << ((const void *)v2 == addr);
  kiln_variable_free(v2);
}

// A freed variable's slots go with it at once, whichever of optimizer and
// variable is freed first; nothing leaks either way (Scoped counts tensors).
TEST(Optimizer, FreeingAVariableFreesItsSlots) {
  Scoped s;
  for (int order = 0; order < 2; order++) {
    kiln_optimizer *o = kiln_adam_new(0.1, 0.9, 0.999, 1e-8);
    kiln_optimizer *mom = kiln_sgd_momentum_new(0.1, 0.9, false);
    ASSERT_TRUE(o && mom);
    kiln_variable *a = kiln_variable_new(f32({1, 2}), "a"), *b = kiln_variable_new(f32({3}), "b");
    kiln_variable *vars[2] = {a, b};
    kiln_tensor *g[2] = {f32({1, 1}), f32({1})};
    ASSERT_EQ(kiln_optimizer_apply(o, 2, vars, g), 0) << kiln_last_error();
    ASSERT_EQ(kiln_optimizer_apply(mom, 2, vars, g), 0) << kiln_last_error();
    int64_t live = kiln_debug_live_tensors();
    kiln_variable_free(a);  // its value, Adam's m and v, momentum's m
    EXPECT_EQ(kiln_debug_live_tensors(), live - 4);
    ASSERT_EQ(apply1(o, b, g[1]), 0) << kiln_last_error();  // b's slots still work
    if (order == 0) {
      kiln_optimizer_free(o);
      kiln_optimizer_free(mom);
      kiln_variable_free(b);
    } else {
      kiln_variable_free(b);
      kiln_optimizer_free(mom);
      kiln_optimizer_free(o);
    }
  }
}

// Many variables made and freed: the slot table stays as small as the live
// variables need (no entry of a freed one stays behind to be probed).
TEST(Optimizer, ManyShortLivedVariables) {
  Scoped s;
  Owned own;
  kiln_optimizer *o = own.opt(kiln_sgd_momentum_new(0.5, 0.5, false));
  kiln_variable *keep = own.var(f64({0}), "keep");
  for (int i = 0; i < 500; i++) {
    kiln_scope_push();
    kiln_variable *v = kiln_variable_new(f64({0}), "v");
    ASSERT_EQ(apply1(o, v, f64({1})), 0) << kiln_last_error();
    if (i % 7 == 0) {
      ASSERT_EQ(apply1(o, keep, f64({1})), 0) << kiln_last_error();
    }
    EXPECT_EQ(read<double>(v)[0], -0.5) << "a fresh momentum slot, step " << i;
    kiln_variable_free(v);
    kiln_scope_pop();
  }
  // keep: m = 1, 1.5, 1.75, ... ; 72 applies
  double m = 0, w = 0;
  for (int i = 0; i < 500; i += 7) m = 0.5 * m + 1, w -= 0.5 * m;
  EXPECT_NEAR(read<double>(keep)[0], w, 1e-12);
}

// Cross-check against PyTorch's optimizers, compiled in when CMake found
// python3 with torch (Debian: python3-torch). The expected values above are
// the contract; this only confirms they agree with a widely used implementation.
#ifdef KILN_TEST_HAVE_TORCH
TEST(Optimizer, AgreesWithTorch) {
  const char *script =
      "try:\n"
      "    import torch\n"
      "except ImportError:\n"
      "    raise SystemExit(3)\n"
      "def run(make, grads):\n"
      "    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)\n"
      "    opt = make([w])\n"
      "    for g in grads:\n"
      "        opt.zero_grad(); w.grad = torch.tensor(g, dtype=torch.float64); opt.step()\n"
      "    return ' '.join(repr(x) for x in w.detach().tolist())\n"
      "gs = [[0.5, -1.0, 2.0], [1.5, 0.25, -3.0], [-0.5, 2.0, 0.0]]\n"
      "print(run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), gs))\n"
      "print(run(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), gs))\n"
      "print(run(lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6), gs))\n";
  std::string path = ::testing::TempDir() + "kiln_optimizer_torch_" + std::to_string(getpid()) + ".py";
  FILE *f = std::fopen(path.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs(script, f);
  std::fclose(f);
  double want[3][3];
  bool found = false;
  // python3 on PATH may be a private interpreter without torch; Debian's is /usr/bin/python3
  for (const char *python : {"python3", "/usr/bin/python3"}) {
    FILE *p = popen((std::string(python) + " " + path + " 2>/dev/null").c_str(), "r");
    if (!p) continue;
    int got = 0;
    for (auto &row : want)
      for (double &x : row) got += std::fscanf(p, "%lf", &x) == 1;
    pclose(p);
    if ((found = got == 9)) break;
  }
  std::remove(path.c_str());
  ASSERT_TRUE(found) << "CMake found python3 with torch, but running it failed";

  Scoped s;
  Owned own;
  kiln_optimizer *opts[3] = {own.opt(kiln_sgd_momentum_new(0.1, 0.9, false)),
                             own.opt(kiln_sgd_momentum_new(0.1, 0.9, true)),
                             own.opt(kiln_adam_new(0.01, 0.8, 0.99, 1e-6))};
  std::vector<std::vector<double>> gs = {{0.5, -1.0, 2.0}, {1.5, 0.25, -3.0}, {-0.5, 2.0, 0.0}};
  for (int k = 0; k < 3; k++) {
    kiln_variable *w = own.var(f64({1.0, -2.0, 0.5}), "w");
    for (auto &g : gs) ASSERT_EQ(apply1(opts[k], w, f64(g)), 0) << kiln_last_error();
    std::vector<double> got = read<double>(w);
    for (int i = 0; i < 3; i++) EXPECT_NEAR(got[i], want[k][i], 1e-13) << "optimizer " << k << " element " << i;
  }
}
#endif  // KILN_TEST_HAVE_TORCH

}  // namespace
