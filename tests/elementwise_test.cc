// elementwise_test.cc — the elementwise primitives (unary, binary, compare,
// logical, select) on every dtype they take, against hand-computed values:
// broadcasting, zero-size and large (parallel) tensors, integer edge cases,
// NaN, bad inputs, and the f32 exp/log/tanh/sigmoid accuracy against libm.
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

template <typename T>
struct Dtype;
template <>
struct Dtype<float> {
  static constexpr kiln_dtype value = KILN_F32;
};
template <>
struct Dtype<double> {
  static constexpr kiln_dtype value = KILN_F64;
};
template <>
struct Dtype<int32_t> {
  static constexpr kiln_dtype value = KILN_I32;
};
template <>
struct Dtype<int64_t> {
  static constexpr kiln_dtype value = KILN_I64;
};
template <>
struct Dtype<uint8_t> {
  static constexpr kiln_dtype value = KILN_BOOL;
};  // bool

using Shape = std::vector<int64_t>;
using Bools = std::vector<uint8_t>;
using Fn1 = kiln_tensor *(*)(kiln_tensor *);
using Fn2 = kiln_tensor *(*)(kiln_tensor *, kiln_tensor *);

template <typename T>
kiln_tensor *tensor(const Shape &shape, const std::vector<T> &data) {
  kiln_tensor *t = kiln_tensor_new(Dtype<T>::value, (int)shape.size(), shape.data(), data.data());
  EXPECT_NE(t, nullptr) << kiln_last_error();
  return t;
}

template <typename T>
kiln_tensor *vec(const std::vector<T> &data) {
  return tensor<T>({(int64_t)data.size()}, data);
}

// read<T>, after checking that t's dtype is T's.
template <typename T>
std::vector<T> values(const kiln_tensor *t) {
  if (t) {
    EXPECT_EQ(kiln_tensor_dtype(t), Dtype<T>::value);
  }
  return read<T>(t);
}

template <typename T>
std::vector<T> un(Fn1 f, const std::vector<T> &x) {
  return values<T>(f(vec(x)));
}

template <typename R, typename T>
std::vector<R> bin(Fn2 f, const std::vector<T> &x, const std::vector<T> &y) {
  return values<R>(f(vec(x), vec(y)));
}

// Distance in units in the last place between two finite floats (or equal infinities).
int64_t ulps(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  int64_t oa = ia < 0 ? -(int64_t)(ia & 0x7fffffff) : ia, ob = ib < 0 ? -(int64_t)(ib & 0x7fffffff) : ib;
  return oa > ob ? oa - ob : ob - oa;
}

// ---- unary ----

TEST(Elementwise, NegAbsSignReluFloat) {
  Scoped s;
  std::vector<float> x = {-2.5f, -0.0f, 0.0f, 3.0f, -kInfF, kNanF};
  std::vector<float> neg = un(kiln_neg, x), abs = un(kiln_abs, x), sign = un(kiln_sign, x),
                     relu = un(kiln_relu, x);
  EXPECT_EQ(neg[0], 2.5f);
  EXPECT_EQ(neg[1], 0.0f);
  EXPECT_FALSE(std::signbit(neg[1]));
  EXPECT_TRUE(std::signbit(neg[2]));
  EXPECT_EQ(neg[3], -3.0f);
  EXPECT_EQ(neg[4], kInfF);
  EXPECT_TRUE(std::isnan(neg[5]));
  EXPECT_EQ(abs[0], 2.5f);
  EXPECT_FALSE(std::signbit(abs[1]));
  EXPECT_EQ(abs[3], 3.0f);
  EXPECT_EQ(abs[4], kInfF);
  EXPECT_TRUE(std::isnan(abs[5]));
  EXPECT_EQ(sign[0], -1.0f);
  EXPECT_EQ(sign[1], 0.0f);
  EXPECT_EQ(sign[2], 0.0f);
  EXPECT_EQ(sign[3], 1.0f);
  EXPECT_EQ(sign[4], -1.0f);
  EXPECT_TRUE(std::isnan(sign[5]));  // sign(NaN) = NaN
  EXPECT_EQ(relu[0], 0.0f);
  EXPECT_EQ(relu[2], 0.0f);
  EXPECT_EQ(relu[3], 3.0f);
  EXPECT_EQ(relu[4], 0.0f);
  EXPECT_TRUE(std::isnan(relu[5]));  // max(NaN, 0) propagates NaN

  std::vector<double> d = {-7.25, 0.0, 1e300, kNan};
  EXPECT_THAT(un(kiln_neg, d)[0], 7.25);
  EXPECT_EQ(un(kiln_abs, d)[0], 7.25);
  std::vector<double> sd = un(kiln_sign, d), rd = un(kiln_relu, d);
  EXPECT_EQ(sd[0], -1.0);
  EXPECT_EQ(sd[1], 0.0);
  EXPECT_EQ(sd[2], 1.0);
  EXPECT_TRUE(std::isnan(sd[3]));
  EXPECT_EQ(rd[0], 0.0);
  EXPECT_EQ(rd[2], 1e300);
}

TEST(Elementwise, NegAbsSignReluInt) {
  Scoped s;
  const int32_t min32 = INT32_MIN, max32 = INT32_MAX;
  std::vector<int32_t> x = {-5, 0, 7, min32, max32};
  EXPECT_EQ(un(kiln_neg, x), (std::vector<int32_t>{5, 0, -7, min32, -max32}));  // -INT_MIN wraps
  EXPECT_EQ(un(kiln_abs, x), (std::vector<int32_t>{5, 0, 7, min32, max32}));
  EXPECT_EQ(un(kiln_sign, x), (std::vector<int32_t>{-1, 0, 1, -1, 1}));
  EXPECT_EQ(un(kiln_relu, x), (std::vector<int32_t>{0, 0, 7, 0, max32}));
  const int64_t min64 = INT64_MIN, max64 = INT64_MAX;
  std::vector<int64_t> y = {-5, 0, 7, min64, max64};
  EXPECT_EQ(un(kiln_neg, y), (std::vector<int64_t>{5, 0, -7, min64, -max64}));
  EXPECT_EQ(un(kiln_abs, y), (std::vector<int64_t>{5, 0, 7, min64, max64}));
  EXPECT_EQ(un(kiln_sign, y), (std::vector<int64_t>{-1, 0, 1, -1, 1}));
  EXPECT_EQ(un(kiln_relu, y), (std::vector<int64_t>{0, 0, 7, 0, max64}));
}

TEST(Elementwise, FloorCeil) {
  Scoped s;
  std::vector<float> x = {-1.5f, 2.7f, -0.5f, 0.5f, -0.0f, 3.0f, 1e20f, -2.5f, 0.2f, kInfF, kNanF};
  std::vector<float> f = un(kiln_floor, x), c = un(kiln_ceil, x);
  EXPECT_EQ(std::vector<float>(f.begin(), f.end() - 1),
            (std::vector<float>{-2, 2, -1, 0, -0.0f, 3, 1e20f, -3, 0, kInfF}));
  EXPECT_EQ(std::vector<float>(c.begin(), c.end() - 1),
            (std::vector<float>{-1, 3, -0.0f, 1, -0.0f, 3, 1e20f, -2, 1, kInfF}));
  EXPECT_TRUE(std::signbit(f[4]));
  EXPECT_TRUE(std::signbit(c[2]));  // ceil(-0.5) = -0
  EXPECT_FALSE(std::signbit(f[3]));
  EXPECT_TRUE(std::isnan(f[10]));
  EXPECT_TRUE(std::isnan(c[10]));
  std::vector<double> d = {-1.5, 2.5, 4503599627370495.5, -0.25};
  EXPECT_EQ(un(kiln_floor, d), (std::vector<double>{-2, 2, 4503599627370495.0, -1}));
  EXPECT_EQ(un(kiln_ceil, d), (std::vector<double>{-1, 3, 4503599627370496.0, -0.0}));
}

TEST(Elementwise, SqrtRsqrt) {
  Scoped s;
  std::vector<float> x = {4.0f, 2.0f, 0.0f, -1.0f, kInfF};
  std::vector<float> r = un(kiln_sqrt, x), q = un(kiln_rsqrt, x);
  EXPECT_EQ(r[0], 2.0f);
  EXPECT_FLOAT_EQ(r[1], 1.41421356f);
  EXPECT_EQ(r[2], 0.0f);
  EXPECT_TRUE(std::isnan(r[3]));
  EXPECT_EQ(r[4], kInfF);
  EXPECT_EQ(q[0], 0.5f);
  EXPECT_FLOAT_EQ(q[1], 0.707106781f);
  EXPECT_EQ(q[2], kInfF);
  EXPECT_TRUE(std::isnan(q[3]));
  EXPECT_EQ(q[4], 0.0f);
  std::vector<double> d = un(kiln_sqrt, std::vector<double>{9.0, 2.0});
  EXPECT_EQ(d[0], 3.0);
  EXPECT_DOUBLE_EQ(d[1], 1.4142135623730951);
  EXPECT_DOUBLE_EQ(un(kiln_rsqrt, std::vector<double>{16.0})[0], 0.25);
}

TEST(Elementwise, ExpLogF32) {
  Scoped s;
  std::vector<float> e = un(kiln_exp, std::vector<float>{0.0f, 1.0f, -1.0f, 10.0f, 88.0f, 89.0f, -87.0f,
                                                         -104.0f, -kInfF, kInfF, kNanF, -100.0f});
  EXPECT_EQ(e[0], 1.0f);
  EXPECT_FLOAT_EQ(e[1], 2.71828183f);
  EXPECT_FLOAT_EQ(e[2], 0.367879441f);
  EXPECT_FLOAT_EQ(e[3], 22026.4658f);
  EXPECT_FLOAT_EQ(e[4], 1.65163625e38f);
  EXPECT_EQ(e[5], kInfF);  // overflow
  EXPECT_FLOAT_EQ(e[6], 1.64581143e-38f);
  EXPECT_EQ(e[7], 0.0f);  // e^-104 = 6.8e-46 rounds to 0
  EXPECT_EQ(e[8], 0.0f);
  EXPECT_EQ(e[9], kInfF);
  EXPECT_TRUE(std::isnan(e[10]));
  EXPECT_NEAR(e[11], 3.72007598e-44f, 1.5e-45f);  // subnormal

  std::vector<float> l = un(kiln_log, std::vector<float>{1.0f, 2.0f, 0.5f, 10.0f, 0.0f, -1.0f, kInfF, kNanF,
                                                         1e-45f, 3.4e38f, -0.0f});
  EXPECT_EQ(l[0], 0.0f);
  EXPECT_FLOAT_EQ(l[1], 0.693147181f);
  EXPECT_FLOAT_EQ(l[2], -0.693147181f);
  EXPECT_FLOAT_EQ(l[3], 2.30258509f);
  EXPECT_EQ(l[4], -kInfF);
  EXPECT_TRUE(std::isnan(l[5]));
  EXPECT_EQ(l[6], kInfF);
  EXPECT_TRUE(std::isnan(l[7]));
  EXPECT_FLOAT_EQ(l[8], -103.278931f);  // the smallest subnormal, 2^-149
  EXPECT_FLOAT_EQ(l[9], 88.7220090f);
  EXPECT_EQ(l[10], -kInfF);

  std::vector<float> p = un(kiln_log1p, std::vector<float>{0.0f, 1e-10f, 1.0f, -1.0f});
  EXPECT_EQ(p[0], 0.0f);
  EXPECT_FLOAT_EQ(p[1], 1e-10f);
  EXPECT_FLOAT_EQ(p[2], 0.693147181f);
  EXPECT_EQ(p[3], -kInfF);
}

TEST(Elementwise, ExpLogF64) {
  Scoped s;
  std::vector<double> e = un(kiln_exp, std::vector<double>{0.0, 1.0, -1.0, 710.0, kNan});
  EXPECT_EQ(e[0], 1.0);
  EXPECT_DOUBLE_EQ(e[1], 2.718281828459045);
  EXPECT_DOUBLE_EQ(e[2], 0.36787944117144233);
  EXPECT_EQ(e[3], kInf);
  EXPECT_TRUE(std::isnan(e[4]));
  std::vector<double> l = un(kiln_log, std::vector<double>{1.0, 2.0, 0.0, -1.0});
  EXPECT_EQ(l[0], 0.0);
  EXPECT_DOUBLE_EQ(l[1], 0.6931471805599453);
  EXPECT_EQ(l[2], -kInf);
  EXPECT_TRUE(std::isnan(l[3]));
  std::vector<double> p = un(kiln_log1p, std::vector<double>{1e-20, 1.0});
  EXPECT_DOUBLE_EQ(p[0], 1e-20);
  EXPECT_DOUBLE_EQ(p[1], 0.6931471805599453);
}

TEST(Elementwise, SinCos) {
  Scoped s;
  std::vector<float> x = {0.0f, 1.0f, -1.0f, 3.14159265f};
  std::vector<float> sn = un(kiln_sin, x), cs = un(kiln_cos, x);
  EXPECT_EQ(sn[0], 0.0f);
  EXPECT_FLOAT_EQ(sn[1], 0.841470985f);
  EXPECT_FLOAT_EQ(sn[2], -0.841470985f);
  EXPECT_NEAR(sn[3], 0.0f, 1e-6f);
  EXPECT_EQ(cs[0], 1.0f);
  EXPECT_FLOAT_EQ(cs[1], 0.540302306f);
  EXPECT_FLOAT_EQ(cs[3], -1.0f);
  std::vector<double> d = {1.0, 0.5};
  EXPECT_DOUBLE_EQ(un(kiln_sin, d)[0], 0.8414709848078965);
  EXPECT_DOUBLE_EQ(un(kiln_cos, d)[1], 0.8775825618903728);
}

TEST(Elementwise, TanhSigmoid) {
  Scoped s;
  std::vector<float> t = un(kiln_tanh, std::vector<float>{0.0f, 0.5f, 1.0f, -2.0f, 20.0f, -kInfF, kNanF,
                                                          -0.0f, 1e-30f, 0.6f, 9.0f});
  EXPECT_EQ(t[0], 0.0f);
  EXPECT_FLOAT_EQ(t[1], 0.462117157f);
  EXPECT_FLOAT_EQ(t[2], 0.761594156f);
  EXPECT_FLOAT_EQ(t[3], -0.964027580f);
  EXPECT_EQ(t[4], 1.0f);
  EXPECT_EQ(t[5], -1.0f);
  EXPECT_TRUE(std::isnan(t[6]));
  EXPECT_TRUE(std::signbit(t[7]));
  EXPECT_EQ(t[8], 1e-30f);
  EXPECT_FLOAT_EQ(t[9], 0.537049567f);
  EXPECT_FLOAT_EQ(t[10], 0.999999970f);

  std::vector<float> g = un(kiln_sigmoid, std::vector<float>{0.0f, 2.0f, -2.0f, 100.0f, -100.0f, kInfF,
                                                             -kInfF, kNanF, 1000.0f, -1000.0f});
  EXPECT_EQ(g[0], 0.5f);
  EXPECT_FLOAT_EQ(g[1], 0.880797078f);
  EXPECT_FLOAT_EQ(g[2], 0.119202922f);
  EXPECT_EQ(g[3], 1.0f);
  EXPECT_NEAR(g[4], 3.72007598e-44f, 1.5e-45f);  // e^-100, no overflow on the way
  EXPECT_EQ(g[5], 1.0f);
  EXPECT_EQ(g[6], 0.0f);
  EXPECT_TRUE(std::isnan(g[7]));
  EXPECT_EQ(g[8], 1.0f);
  EXPECT_EQ(g[9], 0.0f);

  std::vector<double> td = un(kiln_tanh, std::vector<double>{0.5, -30.0});
  EXPECT_DOUBLE_EQ(td[0], 0.46211715726000974);
  EXPECT_EQ(td[1], -1.0);
  std::vector<double> gd = un(kiln_sigmoid, std::vector<double>{2.0, -2.0, 800.0, -800.0, kNan});
  EXPECT_DOUBLE_EQ(gd[0], 0.8807970779778823);
  EXPECT_DOUBLE_EQ(gd[1], 0.11920292202211755);
  EXPECT_EQ(gd[2], 1.0);
  EXPECT_EQ(gd[3], 0.0);  // e^-800 underflows to 0 in f64, without inf/inf
  EXPECT_TRUE(std::isnan(gd[4]));
}

// The f32 exp/log/tanh/sigmoid are our own vectorizable polynomials: sweep
// them against libm in double, rounded to f32, over the whole range (normal,
// subnormal, huge, zero, infinities, NaN).
TEST(Elementwise, F32TranscendentalsMatchLibm) {
  Scoped s;
  std::vector<float> x;
  for (float v : {0.0f, -0.0f, kInfF, -kInfF, kNanF, 1e-45f, -1e-45f, 1.17549435e-38f, 3.4028235e38f,
                  -3.4028235e38f, 88.7228394f, 88.7228317f, -87.3365479f, -103.972077f, -103.278931f})
    x.push_back(v);
  // every 4099th bit pattern covers all exponents and signs
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) {
    float f;
    uint32_t b = (uint32_t)u;
    std::memcpy(&f, &b, 4);
    x.push_back(f);
  }
  for (int i = -200000; i <= 200000; i++) x.push_back((float)i * 1e-4f);  // dense near 0
  kiln_tensor *t = vec(x);
  struct Case {
    const char *name;
    Fn1 fn;
    double (*ref)(double);
    int64_t max_ulps;
  } cases[] = {
      {"exp", kiln_exp, [](double v) { return std::exp(v); }, 1},
      {"log", kiln_log, [](double v) { return std::log(v); }, 1},
      {"tanh", kiln_tanh, [](double v) { return std::tanh(v); }, 1},
      {"sigmoid", kiln_sigmoid, [](double v) { return 1.0 / (1.0 + std::exp(-v)); }, 2},
  };
  for (const Case &c : cases) {
    std::vector<float> y = values<float>(c.fn(t));
    ASSERT_EQ(y.size(), x.size());
    int64_t worst = 0;
    float worst_x = 0;
    for (size_t i = 0; i < x.size(); i++) {
      float want = (float)c.ref((double)x[i]);
      if (std::isnan(want) || std::isnan(y[i])) {
        EXPECT_EQ(std::isnan(want), std::isnan(y[i])) << c.name << "(" << x[i] << ") = " << y[i];
        continue;
      }
      if (std::isinf(want) || std::isinf(y[i])) {
        EXPECT_EQ(want, y[i]) << c.name << "(" << x[i] << ")";
        continue;
      }
      int64_t d = ulps(y[i], want);
      if (d > worst) worst = d, worst_x = x[i];
    }
    EXPECT_LE(worst, c.max_ulps) << c.name << " is " << worst << " ulps off at x = " << worst_x;
  }
}

TEST(Elementwise, LogicalOps) {
  Scoped s;
  Bools a = {0, 0, 1, 1}, b = {0, 1, 0, 1};
  EXPECT_EQ(un(kiln_logical_not, a), (Bools{1, 1, 0, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_logical_and, a, b), (Bools{0, 0, 0, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_logical_or, a, b), (Bools{0, 1, 1, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_maximum, a, b), (Bools{0, 1, 1, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_minimum, a, b), (Bools{0, 0, 0, 1}));
  // broadcast: a scalar true against a vector
  EXPECT_EQ(values<uint8_t>(kiln_logical_and(kiln_scalar(KILN_BOOL, 1), vec(b))), b);
}

// ---- binary arithmetic ----

TEST(Elementwise, ArithmeticF32) {
  Scoped s;
  std::vector<float> a = {1.5f, -2.0f, 3.0f, 0.0f}, b = {0.25f, 2.0f, -5.0f, 4.0f};
  EXPECT_EQ(bin<float>(kiln_add, a, b), (std::vector<float>{1.75f, 0.0f, -2.0f, 4.0f}));
  EXPECT_EQ(bin<float>(kiln_sub, a, b), (std::vector<float>{1.25f, -4.0f, 8.0f, -4.0f}));
  EXPECT_EQ(bin<float>(kiln_mul, a, b), (std::vector<float>{0.375f, -4.0f, -15.0f, 0.0f}));
  EXPECT_EQ(bin<float>(kiln_div, a, b), (std::vector<float>{6.0f, -1.0f, -0.6f, 0.0f}));
  EXPECT_EQ(bin<float>(kiln_maximum, a, b), (std::vector<float>{1.5f, 2.0f, 3.0f, 4.0f}));
  EXPECT_EQ(bin<float>(kiln_minimum, a, b), (std::vector<float>{0.25f, -2.0f, -5.0f, 0.0f}));
  // float division by zero is IEEE, not an error
  std::vector<float> z = bin<float>(kiln_div, std::vector<float>{1, -1, 0}, std::vector<float>{0, 0, 0});
  EXPECT_EQ(z[0], kInfF);
  EXPECT_EQ(z[1], -kInfF);
  EXPECT_TRUE(std::isnan(z[2]));
}

TEST(Elementwise, ArithmeticF64) {
  Scoped s;
  std::vector<double> a = {1e300, -0.5, 7.0}, b = {1e300, 0.25, 2.0};
  EXPECT_EQ(bin<double>(kiln_add, a, b), (std::vector<double>{2e300, -0.25, 9.0}));
  EXPECT_EQ(bin<double>(kiln_sub, a, b), (std::vector<double>{0.0, -0.75, 5.0}));
  std::vector<double> m = bin<double>(kiln_mul, a, b);
  EXPECT_EQ(m[0], kInf);
  EXPECT_EQ(m[1], -0.125);
  EXPECT_EQ(bin<double>(kiln_div, a, b), (std::vector<double>{1.0, -2.0, 3.5}));
  EXPECT_EQ(bin<double>(kiln_maximum, a, b), (std::vector<double>{1e300, 0.25, 7.0}));
  EXPECT_EQ(bin<double>(kiln_minimum, a, b), (std::vector<double>{1e300, -0.5, 2.0}));
}

TEST(Elementwise, MaxMinPropagateNaN) {
  Scoped s;
  std::vector<float> a = {kNanF, 1.0f, kNanF, -kInfF}, b = {1.0f, kNanF, kNanF, 3.0f};
  std::vector<float> mx = bin<float>(kiln_maximum, a, b), mn = bin<float>(kiln_minimum, a, b);
  for (int i = 0; i < 3; i++) {
    EXPECT_TRUE(std::isnan(mx[i])) << i;
    EXPECT_TRUE(std::isnan(mn[i])) << i;
  }
  EXPECT_EQ(mx[3], 3.0f);
  EXPECT_EQ(mn[3], -kInfF);
  std::vector<double> d =
      bin<double>(kiln_maximum, std::vector<double>{kNan, 2.0}, std::vector<double>{0.0, kNan});
  EXPECT_TRUE(std::isnan(d[0]));
  EXPECT_TRUE(std::isnan(d[1]));
}

TEST(Elementwise, ArithmeticI32Wraps) {
  Scoped s;
  const int32_t mn = INT32_MIN, mx = INT32_MAX;
  std::vector<int32_t> a = {7, -3, mx, mn, 65536}, b = {2, 5, 1, 1, 65536};
  EXPECT_EQ(bin<int32_t>(kiln_add, a, b), (std::vector<int32_t>{9, 2, mn, mn + 1, 131072}));
  EXPECT_EQ(bin<int32_t>(kiln_sub, a, b), (std::vector<int32_t>{5, -8, mx - 1, mx, 0}));
  EXPECT_EQ(bin<int32_t>(kiln_mul, a, b), (std::vector<int32_t>{14, -15, mx, mn, 0}));  // 2^32 wraps to 0
  EXPECT_EQ(bin<int32_t>(kiln_maximum, a, b), (std::vector<int32_t>{7, 5, mx, 1, 65536}));
  EXPECT_EQ(bin<int32_t>(kiln_minimum, a, b), (std::vector<int32_t>{2, -3, 1, mn, 65536}));
}

TEST(Elementwise, ArithmeticI64Wraps) {
  Scoped s;
  const int64_t mn = INT64_MIN, mx = INT64_MAX;
  std::vector<int64_t> a = {7, -3, mx, mn, 4294967296LL}, b = {2, 5, 1, 1, 4294967296LL};
  EXPECT_EQ(bin<int64_t>(kiln_add, a, b), (std::vector<int64_t>{9, 2, mn, mn + 1, 8589934592LL}));
  EXPECT_EQ(bin<int64_t>(kiln_sub, a, b), (std::vector<int64_t>{5, -8, mx - 1, mx, 0}));
  EXPECT_EQ(bin<int64_t>(kiln_mul, a, b), (std::vector<int64_t>{14, -15, mx, mn, 0}));  // 2^64 wraps to 0
  EXPECT_EQ(bin<int64_t>(kiln_maximum, a, b), (std::vector<int64_t>{7, 5, mx, 1, 4294967296LL}));
  EXPECT_EQ(bin<int64_t>(kiln_minimum, a, b), (std::vector<int64_t>{2, -3, 1, mn, 4294967296LL}));
}

TEST(Elementwise, IntegerDivModTruncate) {
  Scoped s;
  std::vector<int32_t> a = {7, -7, 7, -7, 6, 0}, b = {2, 2, -2, -2, 3, 5};
  EXPECT_EQ(bin<int32_t>(kiln_div, a, b), (std::vector<int32_t>{3, -3, -3, 3, 2, 0}));
  EXPECT_EQ(bin<int32_t>(kiln_mod, a, b),
            (std::vector<int32_t>{1, -1, 1, -1, 0, 0}));  // sign of the dividend
  std::vector<int64_t> c = {7, -7, 7, -7, 1000000000000LL}, d = {2, 2, -2, -2, 7};
  EXPECT_EQ(bin<int64_t>(kiln_div, c, d), (std::vector<int64_t>{3, -3, -3, 3, 142857142857LL}));
  EXPECT_EQ(bin<int64_t>(kiln_mod, c, d), (std::vector<int64_t>{1, -1, 1, -1, 1}));
}

TEST(Elementwise, IntMinDividedByMinusOneWraps) {
  Scoped s;
  std::vector<int32_t> a = {INT32_MIN, INT32_MIN, 5}, b = {-1, 1, -1};
  EXPECT_EQ(bin<int32_t>(kiln_div, a, b), (std::vector<int32_t>{INT32_MIN, INT32_MIN, -5}));
  EXPECT_EQ(bin<int32_t>(kiln_mod, a, b), (std::vector<int32_t>{0, 0, 0}));
  std::vector<int64_t> c = {INT64_MIN, 9}, d = {-1, -1};
  EXPECT_EQ(bin<int64_t>(kiln_div, c, d), (std::vector<int64_t>{INT64_MIN, -9}));
  EXPECT_EQ(bin<int64_t>(kiln_mod, c, d), (std::vector<int64_t>{0, 0}));
  // and as a broadcast scalar divisor
  EXPECT_EQ(values<int32_t>(kiln_div(vec(a), kiln_scalar(KILN_I32, -1))),
            (std::vector<int32_t>{INT32_MIN, INT32_MIN, -5}));
}

TEST(Elementwise, IntegerDivisionByZeroIsAnError) {
  Scoped s;
  kiln_tensor *a = vec(std::vector<int32_t>{1, 2, 3});
  kiln_tensor *b = vec(std::vector<int32_t>{1, 0, 3});
  EXPECT_EQ(kiln_div(a, b), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("div: integer division by zero"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("element 1"));
  kiln_clear_error();
  EXPECT_EQ(kiln_mod(a, b), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("mod: integer division by zero"));
  kiln_clear_error();
  EXPECT_EQ(kiln_div(vec(std::vector<int64_t>{5}), kiln_scalar(KILN_I64, 0)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("div: integer division by zero"));
  kiln_clear_error();
  EXPECT_EQ(kiln_mod(kiln_scalar(KILN_I64, 5), kiln_scalar(KILN_I64, 0)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("mod: integer division by zero"));
  kiln_clear_error();
  // an empty result divides nothing
  kiln_tensor *e = kiln_div(kiln_zeros(KILN_I32, KILN_SHAPE(0, 3)), vec(std::vector<int32_t>{0, 0, 0}));
  ASSERT_NE(e, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(e), (Shape{0, 3}));
}

TEST(Elementwise, FloatMod) {
  Scoped s;
  std::vector<float> m = bin<float>(kiln_mod, std::vector<float>{7.5f, -7.5f, 5.0f, 1.0f, -0.0f},
                                    std::vector<float>{2.0f, 2.0f, -3.0f, 0.0f, 1.0f});
  EXPECT_EQ(m[0], 1.5f);
  EXPECT_EQ(m[1], -1.5f);
  EXPECT_EQ(m[2], 2.0f);
  EXPECT_TRUE(std::isnan(m[3]));
  EXPECT_TRUE(std::signbit(m[4]));
  std::vector<double> d =
      bin<double>(kiln_mod, std::vector<double>{10.25, -1.0}, std::vector<double>{3.0, 0.75});
  EXPECT_EQ(d[0], 1.25);
  EXPECT_EQ(d[1], -0.25);
}

TEST(Elementwise, PowInt) {
  Scoped s;
  std::vector<int32_t> a = {2, -3, 5, 0, 2, 1, -1, -1, 0, 2, 7, -2},
                       b = {10, 3, 0, 0, -1, -5, -3, -4, -1, 31, 2, 31};
  EXPECT_EQ(bin<int32_t>(kiln_pow, a, b),
            (std::vector<int32_t>{1024, -27, 1, 1, 0, 1, -1, 1, 0, INT32_MIN, 49, INT32_MIN}));
  std::vector<int64_t> c = {3, 2, 10, -2, 3}, d = {39, 62, 18, 63, 41};
  // 3^41 = 36472996377170786403 wraps mod 2^64 to 36472996377170786403 - 2 * 2^64
  EXPECT_EQ(bin<int64_t>(kiln_pow, c, d),
            (std::vector<int64_t>{4052555153018976267LL, 4611686018427387904LL, 1000000000000000000LL,
                                  INT64_MIN, -420491770248316829LL}));
}

TEST(Elementwise, PowFloat) {
  Scoped s;
  std::vector<float> p = bin<float>(kiln_pow, std::vector<float>{2.0f, -8.0f, 0.0f, 2.0f, -2.0f, kNanF, 4.0f},
                                    std::vector<float>{0.5f, 1.0f / 3.0f, 0.0f, -1.0f, 3.0f, 0.0f, 1.5f});
  EXPECT_FLOAT_EQ(p[0], 1.41421356f);
  EXPECT_TRUE(std::isnan(p[1]));
  EXPECT_EQ(p[2], 1.0f);
  EXPECT_EQ(p[3], 0.5f);
  EXPECT_EQ(p[4], -8.0f);
  EXPECT_EQ(p[5], 1.0f);  // pow(NaN, 0) = 1, as C and NumPy say
  EXPECT_EQ(p[6], 8.0f);
  std::vector<double> d =
      bin<double>(kiln_pow, std::vector<double>{10.0, 2.0}, std::vector<double>{-2.0, 0.5});
  EXPECT_DOUBLE_EQ(d[0], 0.01);
  EXPECT_DOUBLE_EQ(d[1], 1.4142135623730951);
}

// ---- comparisons ----

TEST(Elementwise, CompareFloat) {
  Scoped s;
  std::vector<float> a = {1.0f, 2.0f, 3.0f, kNanF, -0.0f}, b = {2.0f, 2.0f, 2.0f, kNanF, 0.0f};
  EXPECT_EQ(bin<uint8_t>(kiln_equal, a, b), (Bools{0, 1, 0, 0, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_not_equal, a, b), (Bools{1, 0, 1, 1, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_less, a, b), (Bools{1, 0, 0, 0, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_less_equal, a, b), (Bools{1, 1, 0, 0, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_greater, a, b), (Bools{0, 0, 1, 0, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_greater_equal, a, b), (Bools{0, 1, 1, 0, 1}));
  std::vector<double> c = {1.0, kNan, 5.0}, d = {1.5, 0.0, 5.0};
  EXPECT_EQ(bin<uint8_t>(kiln_less, c, d), (Bools{1, 0, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_equal, c, d), (Bools{0, 0, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_not_equal, c, d), (Bools{1, 1, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_greater_equal, c, d), (Bools{0, 0, 1}));
}

TEST(Elementwise, CompareIntAndBool) {
  Scoped s;
  std::vector<int32_t> a = {INT32_MIN, 0, 5}, b = {INT32_MAX, 0, -5};
  EXPECT_EQ(bin<uint8_t>(kiln_less, a, b), (Bools{1, 0, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_equal, a, b), (Bools{0, 1, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_greater, a, b), (Bools{0, 0, 1}));
  std::vector<int64_t> c = {INT64_MIN, 1, 9}, d = {INT64_MIN, 2, 8};
  EXPECT_EQ(bin<uint8_t>(kiln_less_equal, c, d), (Bools{1, 1, 0}));
  EXPECT_EQ(bin<uint8_t>(kiln_not_equal, c, d), (Bools{0, 1, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_greater_equal, c, d), (Bools{1, 0, 1}));
  Bools p = {0, 0, 1, 1}, q = {0, 1, 0, 1};
  EXPECT_EQ(bin<uint8_t>(kiln_equal, p, q), (Bools{1, 0, 0, 1}));
  EXPECT_EQ(bin<uint8_t>(kiln_less, p, q), (Bools{0, 1, 0, 0}));  // false < true
  EXPECT_EQ(bin<uint8_t>(kiln_greater_equal, p, q), (Bools{1, 0, 1, 1}));
}

// ---- broadcasting ----

TEST(Elementwise, BroadcastRowVector) {
  Scoped s;
  kiln_tensor *m = tensor<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  kiln_tensor *r = kiln_add(m, vec(std::vector<float>{10, 20, 30}));
  EXPECT_EQ(shape_of(r), (Shape{2, 3}));
  EXPECT_EQ(values<float>(r), (std::vector<float>{11, 22, 33, 14, 25, 36}));
  // the other order: [3] - [2, 3]
  EXPECT_EQ(values<float>(kiln_sub(vec(std::vector<float>{10, 20, 30}), m)),
            (std::vector<float>{9, 18, 27, 6, 15, 24}));
}

TEST(Elementwise, BroadcastOuter) {
  Scoped s;
  kiln_tensor *col = tensor<int32_t>({2, 1}, {1, 2});
  kiln_tensor *row = tensor<int32_t>({1, 3}, {10, 20, 30});
  kiln_tensor *r = kiln_mul(col, row);
  EXPECT_EQ(shape_of(r), (Shape{2, 3}));
  EXPECT_EQ(values<int32_t>(r), (std::vector<int32_t>{10, 20, 30, 20, 40, 60}));
  // a column against a full matrix: the inner loop reads the column as a scalar
  kiln_tensor *m = tensor<double>({2, 3}, {1, 2, 3, 4, 5, 6});
  EXPECT_EQ(values<double>(kiln_div(m, tensor<double>({2, 1}, {2, 4}))),
            (std::vector<double>{0.5, 1, 1.5, 1, 1.25, 1.5}));
}

TEST(Elementwise, BroadcastScalars) {
  Scoped s;
  kiln_tensor *v = vec(std::vector<float>{1, 2, 3, 4});
  kiln_tensor *two = kiln_scalar(KILN_F32, 2);
  EXPECT_EQ(values<float>(kiln_mul(two, v)), (std::vector<float>{2, 4, 6, 8}));
  EXPECT_EQ(values<float>(kiln_sub(v, two)), (std::vector<float>{-1, 0, 1, 2}));
  EXPECT_EQ(values<uint8_t>(kiln_greater(v, two)), (Bools{0, 0, 1, 1}));
  kiln_tensor *r = kiln_add(two, kiln_scalar(KILN_F32, 0.5));  // rank 0 op rank 0
  EXPECT_EQ(kiln_tensor_rank(r), 0);
  EXPECT_EQ(kiln_tensor_item(r), 2.5);
  kiln_tensor *one = tensor<float>({1}, {5});  // a [1] against a [4]
  EXPECT_EQ(values<float>(kiln_maximum(v, one)), (std::vector<float>{5, 5, 5, 5}));
  EXPECT_EQ(shape_of(kiln_add(one, two)), (Shape{1}));
}

TEST(Elementwise, BroadcastHigherRank) {
  Scoped s;
  // [3,1,2] + [4,1] -> [3,4,2]: out[i][j][k] = a[i][0][k] + b[j][0]
  kiln_tensor *a = tensor<int64_t>({3, 1, 2}, {100, 200, 300, 400, 500, 600});
  kiln_tensor *b = tensor<int64_t>({4, 1}, {1, 2, 3, 4});
  kiln_tensor *r = kiln_add(a, b);
  EXPECT_EQ(shape_of(r), (Shape{3, 4, 2}));
  std::vector<int64_t> v = values<int64_t>(r);
  ASSERT_EQ(v.size(), 24u);
  EXPECT_EQ(v[0], 101);   // [0][0][0]
  EXPECT_EQ(v[1], 201);   // [0][0][1]
  EXPECT_EQ(v[2], 102);   // [0][1][0]
  EXPECT_EQ(v[7], 204);   // [0][3][1]
  EXPECT_EQ(v[8], 301);   // [1][0][0]
  EXPECT_EQ(v[23], 604);  // [2][3][1]
  // [2,3,4] - [4]: merges into a [6,4] walk; [2,1,4] leaves a broadcast middle dim
  std::vector<float> x(24);
  for (int i = 0; i < 24; i++) x[i] = (float)i;
  kiln_tensor *big = tensor<float>({2, 3, 4}, x);
  std::vector<float> d = values<float>(kiln_sub(big, vec(std::vector<float>{0, 1, 2, 3})));
  EXPECT_EQ(d[5], 4.0f);    // 5 - 1
  EXPECT_EQ(d[23], 20.0f);  // 23 - 3
  std::vector<float> e =
      values<float>(kiln_add(big, tensor<float>({2, 1, 4}, {0, 0, 0, 0, 100, 100, 100, 100})));
  EXPECT_EQ(e[11], 11.0f);
  EXPECT_EQ(e[12], 112.0f);
  // broadcasting against 1-sized dims of the result
  EXPECT_EQ(shape_of(kiln_add(tensor<float>({1, 1}, {1}), tensor<float>({1}, {2}))), (Shape{1, 1}));
}

TEST(Elementwise, ZeroSize) {
  Scoped s;
  kiln_tensor *e = kiln_zeros(KILN_F32, KILN_SHAPE(0, 3));
  kiln_tensor *r = kiln_add(e, vec(std::vector<float>{1, 2, 3}));
  ASSERT_NE(r, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(r), (Shape{0, 3}));
  EXPECT_EQ(kiln_tensor_size(r), 0);
  EXPECT_EQ(shape_of(kiln_mul(kiln_zeros(KILN_I32, KILN_SHAPE(2, 0)), kiln_scalar(KILN_I32, 3))),
            (Shape{2, 0}));
  EXPECT_EQ(shape_of(kiln_exp(e)), (Shape{0, 3}));
  EXPECT_EQ(shape_of(kiln_less(e, e)), (Shape{0, 3}));
  EXPECT_EQ(kiln_tensor_dtype(kiln_less(e, e)), KILN_BOOL);
  EXPECT_EQ(shape_of(kiln_select(kiln_zeros(KILN_BOOL, KILN_SHAPE(0, 1)), e, e)), (Shape{0, 3}));
  // [0] broadcasts against [1] but not against [2]
  EXPECT_EQ(shape_of(kiln_add(kiln_zeros(KILN_F32, KILN_SHAPE(0)), tensor<float>({1}, {1}))), (Shape{0}));
  EXPECT_EQ(kiln_add(kiln_zeros(KILN_F32, KILN_SHAPE(0)), kiln_zeros(KILN_F32, KILN_SHAPE(2))), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: incompatible shapes (0,) and (2,)"));
}

// ---- large tensors: the parallel paths ----

TEST(Elementwise, LargeSameShape) {
  Scoped s;
  const int64_t n = 300001;
  kiln_tensor *a = kiln_arange(KILN_F64, n);
  kiln_tensor *r = kiln_add(a, kiln_ones(KILN_F64, KILN_SHAPE(n)));
  std::vector<double> v = values<double>(r);
  ASSERT_EQ((int64_t)v.size(), n);
  double sum = 0;
  for (double x : v) sum += x;
  EXPECT_EQ(sum, (double)n * (n + 1) / 2);  // 1 + 2 + ... + n
  EXPECT_EQ(v[0], 1.0);
  EXPECT_EQ(v[150000], 150001.0);
  EXPECT_EQ(v[n - 1], (double)n);
  // f32 unary and compare, large
  kiln_tensor *f = kiln_arange(KILN_F32, n);
  std::vector<float> ng = values<float>(kiln_neg(f));
  EXPECT_EQ(ng[123457], -123457.0f);
  std::vector<uint8_t> lt = values<uint8_t>(kiln_less(f, kiln_scalar(KILN_F32, 1000)));
  int64_t count = 0;
  for (uint8_t b : lt) count += b;
  EXPECT_EQ(count, 1000);
  std::vector<float> th = values<float>(kiln_tanh(kiln_mul(f, kiln_scalar(KILN_F32, 1e-5f))));
  EXPECT_FLOAT_EQ(th[100000], 0.761594156f);  // tanh(1)
  EXPECT_EQ(th[0], 0.0f);
}

TEST(Elementwise, LargeBroadcast) {
  Scoped s;
  // [1000, 300] + [300]: rows in parallel, each inner loop contiguous
  const int64_t rows = 1000, cols = 300;
  std::vector<int32_t> m(rows * cols);
  for (int64_t i = 0; i < rows * cols; i++) m[i] = (int32_t)(i / cols);  // row index
  std::vector<int32_t> row(cols);
  for (int64_t j = 0; j < cols; j++) row[j] = (int32_t)j * 1000;
  std::vector<int32_t> v = values<int32_t>(kiln_add(tensor<int32_t>({rows, cols}, m), vec(row)));
  ASSERT_EQ((int64_t)v.size(), rows * cols);
  EXPECT_EQ(v[0], 0);
  EXPECT_EQ(v[cols + 1], 1001);                 // [1][1]
  EXPECT_EQ(v[rows * cols - 1], 999 + 299000);  // [999][299]
  int64_t sum = 0;
  for (int32_t x : v) sum += x;
  // sum of row indices * cols + sum of columns * rows
  EXPECT_EQ(sum, (int64_t)(999 * 1000 / 2) * cols + (int64_t)(299 * 300 / 2) * 1000 * rows);

  // [rows, 1] * [1, cols]: an outer product, every element i * j
  kiln_tensor *ci = kiln_reshape(kiln_arange(KILN_I64, rows), KILN_SHAPE(rows, 1));
  kiln_tensor *rj = kiln_reshape(kiln_arange(KILN_I64, cols), KILN_SHAPE(1, cols));
  std::vector<int64_t> o = values<int64_t>(kiln_mul(ci, rj));
  EXPECT_EQ(o[7 * cols + 11], 77);
  EXPECT_EQ(o[999 * cols + 299], 999 * 299);

  // two long rows against a column: each row is cut into blocks
  const int64_t len = 100003;
  kiln_tensor *wide = kiln_ones(KILN_F32, KILN_SHAPE(2, len));
  std::vector<float> w = values<float>(kiln_mul(wide, tensor<float>({2, 1}, {3, -4})));
  EXPECT_EQ(w[0], 3.0f);
  EXPECT_EQ(w[len - 1], 3.0f);
  EXPECT_EQ(w[len], -4.0f);
  EXPECT_EQ(w[2 * len - 1], -4.0f);
  double ws = 0;
  for (float x : w) ws += x;
  EXPECT_EQ(ws, -1.0 * len);

  // scalar against a large vector, and select on large inputs
  kiln_tensor *big = kiln_arange(KILN_F32, 200000);
  std::vector<float> half = values<float>(kiln_mul(kiln_scalar(KILN_F32, 0.5f), big));
  EXPECT_EQ(half[199999], 99999.5f);
  kiln_tensor *even =
      kiln_equal(kiln_mod(kiln_arange(KILN_I32, 200000), kiln_scalar(KILN_I32, 2)), kiln_scalar(KILN_I32, 0));
  std::vector<float> sel = values<float>(kiln_select(even, big, kiln_scalar(KILN_F32, -1)));
  EXPECT_EQ(sel[4], 4.0f);
  EXPECT_EQ(sel[5], -1.0f);
  EXPECT_EQ(sel[199998], 199998.0f);
  EXPECT_EQ(sel[199999], -1.0f);
}

TEST(Elementwise, LargeIntegerDivisionByZero) {
  Scoped s;
  std::vector<int64_t> d(150000, 3);
  d[149999] = 0;
  EXPECT_EQ(kiln_div(kiln_ones(KILN_I64, KILN_SHAPE(150000)), vec(d)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("div: integer division by zero (element 149999"));
  kiln_clear_error();
  d[149999] = -1;
  std::vector<int64_t> q = values<int64_t>(kiln_div(kiln_arange(KILN_I64, 150000), vec(d)));
  EXPECT_EQ(q[100], 33);
  EXPECT_EQ(q[149999], -149999);
}

// ---- select ----

TEST(Elementwise, SelectAllDtypes) {
  Scoped s;
  kiln_tensor *c = vec(Bools{1, 0, 1});
  EXPECT_EQ(
      values<float>(kiln_select(c, vec(std::vector<float>{1, 2, 3}), vec(std::vector<float>{-1, -2, -3}))),
      (std::vector<float>{1, -2, 3}));
  EXPECT_EQ(
      values<double>(kiln_select(c, vec(std::vector<double>{1, 2, 3}), vec(std::vector<double>{-1, -2, -3}))),
      (std::vector<double>{1, -2, 3}));
  EXPECT_EQ(
      values<int32_t>(kiln_select(c, vec(std::vector<int32_t>{1, 2, 3}), vec(std::vector<int32_t>{7, 8, 9}))),
      (std::vector<int32_t>{1, 8, 3}));
  EXPECT_EQ(values<int64_t>(kiln_select(c, vec(std::vector<int64_t>{INT64_MAX, 2, 3}),
                                        vec(std::vector<int64_t>{7, INT64_MIN, 9}))),
            (std::vector<int64_t>{INT64_MAX, INT64_MIN, 3}));
  EXPECT_EQ(values<uint8_t>(kiln_select(c, vec(Bools{0, 0, 0}), vec(Bools{1, 1, 1}))), (Bools{0, 1, 0}));
  // f16 and bf16: the 2-byte patterns are copied exactly, NaN payloads included
  for (kiln_dtype dt : {KILN_F16, KILN_BF16}) {
    uint16_t a[3] = {0x3C00, 0x7E01, 0x8001}, b[3] = {0x1234, 0xFFFF, 0x0000};
    kiln_tensor *r =
        kiln_select(c, kiln_tensor_new(dt, KILN_SHAPE(3), a), kiln_tensor_new(dt, KILN_SHAPE(3), b));
    ASSERT_NE(r, nullptr) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_dtype(r), dt);
    uint16_t got[3];
    ASSERT_EQ(kiln_tensor_read(r, got, sizeof got), 0);
    EXPECT_EQ(got[0], 0x3C00);
    EXPECT_EQ(got[1], 0xFFFF);
    EXPECT_EQ(got[2], 0x8001);
  }
  // NaN values pass through untouched
  std::vector<float> n = values<float>(
      kiln_select(vec(Bools{1, 0}), vec(std::vector<float>{kNanF, 0}), vec(std::vector<float>{1, kNanF})));
  EXPECT_TRUE(std::isnan(n[0]));
  EXPECT_TRUE(std::isnan(n[1]));
}

TEST(Elementwise, SelectBroadcast) {
  Scoped s;
  // cond [2,1], a [1,3], b scalar -> [2,3]
  kiln_tensor *c = tensor<uint8_t>({2, 1}, {1, 0});
  kiln_tensor *a = tensor<int32_t>({1, 3}, {1, 2, 3});
  kiln_tensor *r = kiln_select(c, a, kiln_scalar(KILN_I32, -7));
  EXPECT_EQ(shape_of(r), (Shape{2, 3}));
  EXPECT_EQ(values<int32_t>(r), (std::vector<int32_t>{1, 2, 3, -7, -7, -7}));
  // a scalar condition picks a whole operand
  kiln_tensor *x = vec(std::vector<float>{1, 2}), *y = vec(std::vector<float>{3, 4});
  EXPECT_EQ(values<float>(kiln_select(kiln_scalar(KILN_BOOL, 1), x, y)), (std::vector<float>{1, 2}));
  EXPECT_EQ(values<float>(kiln_select(kiln_scalar(KILN_BOOL, 0), x, y)), (std::vector<float>{3, 4}));
  // the condition alone sets the shape: [3] cond, scalar values
  EXPECT_EQ(
      values<double>(kiln_select(vec(Bools{0, 1, 0}), kiln_scalar(KILN_F64, 1), kiln_scalar(KILN_F64, 2))),
      (std::vector<double>{2, 1, 2}));
  // the condition broadcasts against rows of a matrix
  kiln_tensor *m = tensor<float>({2, 2}, {1, 2, 3, 4});
  EXPECT_EQ(values<float>(kiln_select(vec(Bools{0, 1}), m, kiln_neg(m))), (std::vector<float>{-1, 2, -3, 4}));
}

// ---- bad inputs ----

TEST(Elementwise, NullInputs) {
  Scoped s;
  kiln_tensor *x = vec(std::vector<float>{1, 2});
  EXPECT_EQ(kiln_add(nullptr, x), nullptr);
  EXPECT_STREQ(kiln_last_error(), "add: input 0 is NULL");
  kiln_clear_error();
  EXPECT_EQ(kiln_less(x, nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "less: input 1 is NULL");
  kiln_clear_error();
  EXPECT_EQ(kiln_exp(nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "exp: input 0 is NULL");
  kiln_clear_error();
  EXPECT_EQ(kiln_select(nullptr, x, x), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("select: input 0 is NULL"));
  kiln_clear_error();
  // a chain keeps the first error
  EXPECT_EQ(kiln_tanh(kiln_mul(kiln_add(x, vec(std::vector<int32_t>{1, 2})), x)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: dtype mismatch"));
}

TEST(Elementwise, DtypeMismatch) {
  Scoped s;
  kiln_tensor *f = vec(std::vector<float>{1, 2}), *i = vec(std::vector<int32_t>{1, 2});
  EXPECT_EQ(kiln_add(f, i), nullptr);
  EXPECT_STREQ(kiln_last_error(), "add: dtype mismatch: f32 and i32");
  kiln_clear_error();
  EXPECT_EQ(kiln_greater(i, kiln_cast(i, KILN_I64)), nullptr);
  EXPECT_STREQ(kiln_last_error(), "greater: dtype mismatch: i32 and i64");
  kiln_clear_error();
  EXPECT_EQ(kiln_select(vec(Bools{1, 0}), f, i), nullptr);
  EXPECT_STREQ(kiln_last_error(), "select: dtype mismatch: f32 and i32");
  kiln_clear_error();
  EXPECT_EQ(kiln_select(vec(std::vector<int32_t>{1, 0}), f, f), nullptr);
  EXPECT_STREQ(kiln_last_error(), "select: condition must be bool, not i32");
  kiln_clear_error();
  EXPECT_EQ(kiln_select(f, f, f), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("select: condition must be bool, not f32"));
}

TEST(Elementwise, IncompatibleShapes) {
  Scoped s;
  kiln_tensor *a = kiln_zeros(KILN_F32, KILN_SHAPE(2, 3)), *b = kiln_zeros(KILN_F32, KILN_SHAPE(4));
  EXPECT_EQ(kiln_add(a, b), nullptr);
  EXPECT_STREQ(kiln_last_error(), "add: incompatible shapes (2, 3) and (4,)");
  kiln_clear_error();
  EXPECT_EQ(kiln_equal(kiln_zeros(KILN_F32, KILN_SHAPE(3, 2)), a), nullptr);
  EXPECT_STREQ(kiln_last_error(), "equal: incompatible shapes (3, 2) and (2, 3)");
  kiln_clear_error();
  EXPECT_EQ(kiln_select(kiln_zeros(KILN_BOOL, KILN_SHAPE(5)), a, a), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("select: incompatible shapes (5,) and (2, 3)"));
}

TEST(Elementwise, UnsupportedDtypes) {
  Scoped s;
  kiln_tensor *i = vec(std::vector<int32_t>{1, 2});
  kiln_tensor *b = vec(Bools{1, 0});
  uint16_t raw[2] = {0x3C00, 0x4000};
  kiln_tensor *h = kiln_tensor_new(KILN_F16, KILN_SHAPE(2), raw);
  kiln_tensor *bh = kiln_tensor_new(KILN_BF16, KILN_SHAPE(2), raw);
  struct {
    kiln_tensor *t;
    const char *prefix;
  } cases[] = {
      {kiln_exp(i), "exp: dtype i32 is not supported"},
      {kiln_tanh(kiln_cast(i, KILN_I64)), "tanh: dtype i64 is not supported"},
      {kiln_floor(i), "floor: dtype i32 is not supported"},
      {kiln_add(h, h), "add: dtype f16 is not supported"},
      {kiln_mul(bh, bh), "mul: dtype bf16 is not supported"},
      {kiln_add(b, b), "add: dtype bool is not supported"},
      {kiln_neg(b), "neg: dtype bool is not supported"},
      {kiln_abs(h), "abs: dtype f16 is not supported"},
      {kiln_logical_not(i), "logical_not: dtype i32 is not supported"},
      {kiln_logical_and(i, i), "logical_and: dtype i32 is not supported"},
      {kiln_logical_or(h, h), "logical_or: dtype f16 is not supported"},
      {kiln_less(h, h), "less: dtype f16 is not supported"},
      {kiln_maximum(bh, bh), "maximum: dtype bf16 is not supported"},
      {kiln_sigmoid(b), "sigmoid: dtype bool is not supported"},
  };
  for (auto &c : cases) {
    EXPECT_EQ(c.t, nullptr) << c.prefix;
    kiln_clear_error();
  }
  // the messages, one at a time (each call overwrites the last)
  EXPECT_EQ(kiln_exp(i), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("exp: dtype i32 is not supported"));
  kiln_clear_error();
  EXPECT_EQ(kiln_add(h, h), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: dtype f16 is not supported"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("kiln_cast"));
  kiln_clear_error();
  EXPECT_EQ(kiln_add(b, b), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: dtype bool is not supported"));
  kiln_clear_error();
  EXPECT_EQ(kiln_logical_not(i), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("logical_not: dtype i32 is not supported"));
}

}  // namespace
