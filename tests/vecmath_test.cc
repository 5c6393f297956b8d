// vecmath_test.cc — the accuracy of the CPU backend's own vector math
// (backends/llvm/vecmath.c): exp, log, log1p, tanh, sigmoid, sin, cos and
// pow in f32 and f64, compiled as one-op kernels and compared with libm's
// long double functions over dense ranges, random bit patterns (every
// exponent: subnormals, huge values, NaN), special values and large
// arguments; the f32 exp, log, tanh and sigmoid also over a sweep of the
// f32 bit patterns (every one in a disabled test), against the eager
// kernels bit for bit. Errors are counted in units in the last place of the
// result type; the worst error of each function is printed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu.h"
#include "ir.h"
#include "test_util.h"

namespace {

using namespace kiln_test;

using Ref = std::function<long double(long double, long double)>;

// Runs op (one or two operands of dtype dt, n elements) compiled; the results as doubles.
std::vector<double> compiled(op_id op, kiln_dtype dt, const std::vector<double> &x, const std::vector<double> &y) {
  int64_t n = (int64_t)x.size();
  op_type t{dt, 1, {n}};
  ir_module *m = ir_module_new();
  int np = y.empty() ? 1 : 2;
  op_type ts[2] = {t, t};
  ir_func *f = ir_func_new(m, "vm", np, ts);
  ir_value in[2] = {0, 1};
  ir_value v = ir_append(f, op, nullptr, np, in, ir_loc{nullptr, 0});
  EXPECT_GE(v, 0) << kiln_last_error();
  EXPECT_EQ(ir_set_results(f, 1, &v), 0);
  cpu_program *p = cpu_compile(f);
  EXPECT_NE(p, nullptr) << kiln_last_error();
  std::vector<double> out;
  if (!p) {
    ir_module_free(m);
    return out;
  }
  kiln_scope_push();
  auto make = [&](const std::vector<double> &v) {
    if (dt == KILN_F64) return kiln_tensor_new(KILN_F64, 1, &n, v.data());
    std::vector<float> f32v(v.begin(), v.end());
    return kiln_tensor_new(KILN_F32, 1, &n, f32v.data());
  };
  kiln_tensor *args[2] = {make(x), y.empty() ? nullptr : make(y)}, *r = nullptr;
  EXPECT_EQ(cpu_run(p, args, &r), 0) << kiln_last_error();
  if (r) {
    out.resize((size_t)n);
    for (int64_t i = 0; i < n; i++)
      out[(size_t)i] =
          dt == KILN_F64 ? ((const double *)kiln_tensor_data(r))[i] : ((const float *)kiln_tensor_data(r))[i];
  }
  kiln_scope_pop();
  cpu_program_free(p);
  ir_module_free(m);
  return out;
}

// Distance in ulps of the result type between got and the exact value; 0
// when both are NaN or equal (infinities, zeros of the same sign), huge for
// a NaN against a number or a wrong sign of zero.
double ulp_error(double got, long double exact, bool f32) {
  if (std::isnan(got) && std::isnan((double)exact)) return 0;
  if (std::isnan(got) || std::isnan((double)exact)) return 1e30;
  long double rounded = f32 ? (long double)(float)exact : (long double)(double)exact;
  if ((long double)got == rounded && std::signbit(got) == std::signbit((double)rounded)) return 0;
  if (std::isinf(got) || std::isinf((double)rounded)) return 1e30;
  if (got == 0 && rounded == 0) return 1e30;  // -0 for +0
  // the ulp at the exact value's binade (subnormals: the smallest one)
  int e;
  std::frexp((double)exact, &e);
  int min_e = f32 ? -125 : -1021, digits = f32 ? 24 : 53;
  if (e < min_e) e = min_e;
  long double ulp = std::ldexp(1.0L, e - digits);
  return (double)(std::fabs((long double)got - exact) / ulp);
}

struct Report {
  double worst = 0;
  double at_x = 0, at_y = 0, got = 0;
  long double want = 0;
};

Report measure(op_id op, kiln_dtype dt, const std::vector<double> &x, const std::vector<double> &y, const Ref &ref) {
  Report r;
  bool f32 = dt == KILN_F32;
  std::vector<double> got = compiled(op, dt, x, y);
  if (got.size() != x.size()) {
    r.worst = 1e30;
    return r;
  }
  for (size_t i = 0; i < x.size(); i++) {
    long double xi = f32 ? (long double)(float)x[i] : (long double)x[i];
    long double yi = y.empty() ? 0 : f32 ? (long double)(float)y[i] : (long double)y[i];
    long double want = ref(xi, yi);
    double e = ulp_error(got[i], want, f32);
    if (e > r.worst) r = Report{e, (double)xi, (double)yi, got[i], want};
  }
  return r;
}

std::string describe(const char *name, kiln_dtype dt, const Report &r) {
  char buf[256], y[64] = "";
  if (r.at_y != 0) std::snprintf(y, sizeof y, ", y = %.17g", r.at_y);
  std::snprintf(buf, sizeof buf, "%s %s: worst %.3g ulp at x = %.17g%s: got %.17g, want %.20Lg", name,
                kiln_dtype_name(dt), r.worst, r.at_x, y, r.got, r.want);
  return buf;
}

// n values spread over [lo, hi]
std::vector<double> dense(double lo, double hi, int n) {
  std::vector<double> v((size_t)n);
  for (int i = 0; i < n; i++) v[(size_t)i] = lo + (hi - lo) * i / (n - 1);
  return v;
}

// n random bit patterns of the type: every exponent, sign, NaN and inf
std::vector<double> any_bits(kiln_dtype dt, int n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> v((size_t)n);
  for (auto &x : v) {
    uint64_t b = rng();
    if (dt == KILN_F32) {
      uint32_t u = (uint32_t)b;
      float f;
      std::memcpy(&f, &u, 4);
      x = f;
    } else {
      std::memcpy(&x, &b, 8);
    }
  }
  return v;
}

std::vector<double> specials(kiln_dtype dt) {
  double tiny = dt == KILN_F32 ? (double)FLT_TRUE_MIN : DBL_TRUE_MIN, minn = dt == KILN_F32 ? (double)FLT_MIN : DBL_MIN;
  double big = dt == KILN_F32 ? (double)FLT_MAX : DBL_MAX;
  return {0.0,   -0.0, kInf,   -kInf,    kNan,   1.0,   -1.0,   0.5,    -0.5, 2.0,  tiny,
          -tiny, minn, -minn,  minn / 3, big,    -big,  1e-10,  -1e-10, 3.0,  -3.0, 88.72,
          -87.3, 89.5, -104.5, 709.78,   -745.1, 710.0, -746.0, 1e5,    -1e5};
}

std::vector<double> concat(std::vector<double> a, const std::vector<double> &b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Fn1 {
  const char *name;
  op_id op;
  Ref ref;
  double lo64, hi64, lo32, hi32;  // dense ranges
  double max_ulp32, max_ulp64;    // the bounds the test holds them to
};

long double sigmoidl(long double x) { return 1.0L / (1.0L + expl(-x)); }

const Fn1 unary[] = {
    {"exp", OP_EXP, [](long double x, long double) { return expl(x); }, -746, 710, -104, 89, 1.5, 1.5},
    {"log", OP_LOG, [](long double x, long double) { return logl(x); }, 0, 10, 0, 10, 1, 1},
    {"log1p", OP_LOG1P, [](long double x, long double) { return log1pl(x); }, -1, 4, -1, 4, 2, 2},
    {"tanh", OP_TANH, [](long double x, long double) { return tanhl(x); }, -20, 20, -10, 10, 2, 2},
    {"sigmoid", OP_SIGMOID, [](long double x, long double) { return sigmoidl(x); }, -40, 40, -20, 20, 3, 3},
    {"sin", OP_SIN, [](long double x, long double) { return sinl(x); }, -100, 100, -100, 100, 1.5, 1.5},
    {"cos", OP_COS, [](long double x, long double) { return cosl(x); }, -100, 100, -100, 100, 1.5, 1.5},
};

TEST(VecMath, UnaryFunctionsAreWithinAFewUlp) {
  Scoped scope;
  for (const Fn1 &f : unary) {
    for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
      bool f32 = dt == KILN_F32;
      double lo = f32 ? f.lo32 : f.lo64, hi = f32 ? f.hi32 : f.hi64;
      std::vector<double> x = concat(concat(dense(lo, hi, 400000), any_bits(dt, 400000, 7)), specials(dt));
      if (f.op == OP_LOG || f.op == OP_LOG1P) x = concat(x, dense(1 - 1e-3, 1 + 1e-3, 20001));  // near the zero of log
      if (f.op == OP_SIN || f.op == OP_COS) x = concat(x, dense(-1e4, 1e4, 100001));
      Report r = measure(f.op, dt, x, {}, f.ref);
      std::printf("  %s\n", describe(f.name, dt, r).c_str());
      EXPECT_LE(r.worst, f32 ? f.max_ulp32 : f.max_ulp64) << describe(f.name, dt, r);
    }
  }
}

// sin and cos reduce exactly, so huge arguments are as accurate as small
// ones: the doubles closest to multiples of pi/2 (Muller's table) and beyond.
TEST(VecMath, SinCosOfLargeArguments) {
  Scoped scope;
  std::vector<double> x = {1e22,
                           -1e22,
                           1e300,
                           5.319372648326541416e+255,
                           8.8248251022494271e+294,
                           6381956970095103.0 * 1099511627776.0,  // 2^40 * a hard case
                           1.5707963267948966,
                           3.1415926535897931,
                           4.7123889803846897,
                           6.2831853071795862,
                           355.0,
                           103993.0,
                           104348.0,
                           1e8,
                           1.2e16,
                           3.4e38,
                           1.0e38,
                           16777216.0,
                           16777215.0};
  std::vector<double> wide;
  for (int e = 0; e < 1020; e += 3) wide.push_back(std::ldexp(1.2345678901234567, e));
  x = concat(concat(x, wide), any_bits(KILN_F64, 100000, 99));
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (op_id op : {OP_SIN, OP_COS}) {
      Report r = measure(op, dt, x, {}, [op](long double a, long double) { return op == OP_SIN ? sinl(a) : cosl(a); });
      std::printf("  %s\n", describe(op == OP_SIN ? "sin (large)" : "cos (large)", dt, r).c_str());
      EXPECT_LE(r.worst, 1.5) << describe(op == OP_SIN ? "sin" : "cos", dt, r);
    }
}

TEST(VecMath, PowIsWithinAFewUlp) {
  Scoped scope;
  std::mt19937_64 rng(3);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    bool f32 = dt == KILN_F32;
    std::vector<double> x, y;
    std::uniform_real_distribution<double> ux(0, 10), uy(-30, 30), big(-1, 1);
    for (int i = 0; i < 300000; i++) x.push_back(ux(rng)), y.push_back(uy(rng));
    // results near overflow and underflow, where y log x is large and every bit of it counts
    for (int i = 0; i < 100000; i++) {
      double b = 1 + ux(rng) * 100;
      double t = (f32 ? 88.0 : 709.0) * big(rng);
      x.push_back(b), y.push_back(t / std::log(b));
    }
    // negative bases with integer exponents, exact powers
    for (int i = 0; i < 20000; i++) x.push_back(-ux(rng)), y.push_back(std::floor(uy(rng)));
    for (int i = 0; i < 200; i++) x.push_back(i % 20 - 10), y.push_back(i / 20);
    std::vector<double> bx = any_bits(dt, 200000, 5), by = any_bits(dt, 200000, 6);
    x = concat(x, bx), y = concat(y, by);
    // C99's special cases: every pair of special values
    std::vector<double> sv = {0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, kInf, -kInf, kNan, 1e-300, 1e300};
    for (double a : sv)
      for (double b : sv) x.push_back(a), y.push_back(b);
    Report r = measure(OP_POW, dt, x, y, [](long double a, long double b) { return powl(a, b); });
    std::printf("  %s\n", describe("pow", dt, r).c_str());
    EXPECT_LE(r.worst, f32 ? 1.0 : 2.0) << describe("pow", dt, r);
  }
}

// The special values exactly as C's functions give them.
TEST(VecMath, SpecialValues) {
  Scoped scope;
  struct S {
    op_id op;
    double x, want;
  };
  const S cases[] = {
      {OP_EXP, 0.0, 1.0},       {OP_EXP, -0.0, 1.0},     {OP_EXP, kInf, kInf},     {OP_EXP, -kInf, 0.0},
      {OP_EXP, kNan, kNan},     {OP_EXP, 1000, kInf},    {OP_EXP, -1000, 0.0},     {OP_LOG, 0.0, -kInf},
      {OP_LOG, -0.0, -kInf},    {OP_LOG, -1.0, kNan},    {OP_LOG, kInf, kInf},     {OP_LOG, -kInf, kNan},
      {OP_LOG, 1.0, 0.0},       {OP_LOG, kNan, kNan},    {OP_LOG1P, -1.0, -kInf},  {OP_LOG1P, -0.0, -0.0},
      {OP_LOG1P, 0.0, 0.0},     {OP_LOG1P, kInf, kInf},  {OP_LOG1P, -2.0, kNan},   {OP_LOG1P, kNan, kNan},
      {OP_TANH, 0.0, 0.0},      {OP_TANH, -0.0, -0.0},   {OP_TANH, kInf, 1.0},     {OP_TANH, -kInf, -1.0},
      {OP_TANH, kNan, kNan},    {OP_SIGMOID, kInf, 1.0}, {OP_SIGMOID, -kInf, 0.0}, {OP_SIGMOID, 0.0, 0.5},
      {OP_SIGMOID, kNan, kNan}, {OP_SIN, 0.0, 0.0},      {OP_SIN, -0.0, -0.0},     {OP_SIN, kInf, kNan},
      {OP_SIN, -kInf, kNan},    {OP_SIN, kNan, kNan},    {OP_COS, 0.0, 1.0},       {OP_COS, -0.0, 1.0},
      {OP_COS, kInf, kNan},     {OP_COS, kNan, kNan},
  };
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (const S &s : cases) {
      std::vector<double> got = compiled(s.op, dt, {s.x}, {});
      ASSERT_EQ(got.size(), 1u);
      std::string what = std::string(ir_op_info(s.op)->name) + "(" + std::to_string(s.x) + ") " + kiln_dtype_name(dt);
      if (std::isnan(s.want)) {
        EXPECT_TRUE(std::isnan(got[0])) << what << " = " << got[0];
      } else {
        EXPECT_EQ(got[0], s.want) << what;
        EXPECT_EQ(std::signbit(got[0]), std::signbit(s.want)) << what << ": the sign of zero";
      }
    }
}

// Subnormal inputs and results: exp down to the smallest subnormal, log of
// subnormals, sin of them (sin x = x).
TEST(VecMath, Subnormals) {
  Scoped scope;
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    bool f32 = dt == KILN_F32;
    double lo = f32 ? -103.9 : -745.0, hi = f32 ? -87.4 : -708.4;  // exp is subnormal here
    Report r = measure(OP_EXP, dt, dense(lo, hi, 100000), {}, [](long double a, long double) { return expl(a); });
    EXPECT_LE(r.worst, 1.0) << describe("exp (subnormal results)", dt, r);
    double tiny = f32 ? (double)FLT_TRUE_MIN : DBL_TRUE_MIN, minn = f32 ? (double)FLT_MIN : DBL_MIN;
    std::vector<double> sub = dense(tiny, minn, 100000);
    r = measure(OP_LOG, dt, sub, {}, [](long double a, long double) { return logl(a); });
    EXPECT_LE(r.worst, 1.0) << describe("log (subnormal inputs)", dt, r);
    r = measure(OP_SIN, dt, sub, {}, [](long double a, long double) { return sinl(a); });
    EXPECT_EQ(r.worst, 0) << describe("sin (subnormal inputs)", dt, r);
    r = measure(OP_TANH, dt, sub, {}, [](long double a, long double) { return tanhl(a); });
    EXPECT_EQ(r.worst, 0) << describe("tanh (subnormal inputs)", dt, r);
  }
}

// The f32 exp, log, tanh and sigmoid over f32 bit patterns u = first, first
// + stride, ... (every one with stride 1): the compiled kernel's worst error
// against libm's double functions, and the eager kernel (the interpreter's)
// equal to it bit for bit, inputs NaN, infinite and subnormal included.
void sweep_f32(uint64_t first, uint64_t stride) {
  struct F {
    const char *name;
    op_id op;
    double (*ref)(double);
    double max_ulp;
  };
  const F fs[] = {
      {"exp", OP_EXP, [](double x) { return std::exp(x); }, 1.5},
      {"log", OP_LOG, [](double x) { return std::log(x); }, 1},
      {"tanh", OP_TANH, [](double x) { return std::tanh(x); }, 2},
      {"sigmoid", OP_SIGMOID, [](double x) { return 1 / (1 + std::exp(-x)); }, 3},
  };
  const int64_t chunk = 1 << 22;
  for (const F &f : fs) {
    op_type t{KILN_F32, 1, {chunk}};
    ir_module *m = ir_module_new();
    ir_func *fn = ir_func_new(m, "vm", 1, &t);
    ir_value in = 0, v = ir_append(fn, f.op, nullptr, 1, &in, ir_loc{nullptr, 0});
    ASSERT_GE(v, 0) << kiln_last_error();
    ASSERT_EQ(ir_set_results(fn, 1, &v), 0);
    cpu_program *p = cpu_compile(fn);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    std::vector<float> x((size_t)chunk);
    double worst = 0, at = 0, got_at = 0;
    int64_t differ = 0;
    bool more = true;
    for (uint64_t u = first; more;) {
      for (auto &xi : x) {  // the last chunk's tail repeats the first input
        uint32_t b = (uint32_t)(more ? u : first);
        std::memcpy(&xi, &b, 4);
        more = more && u + stride <= 0xffffffffu;
        u += more ? stride : 0;
      }
      kiln_scope_push();
      kiln_tensor *arg = kiln_tensor_new(KILN_F32, 1, &chunk, x.data()), *got = nullptr, *eager = nullptr;
      bool ran = cpu_run(p, &arg, &got) == 0 && ir_interpret(fn, &arg, &eager) == 0;
      EXPECT_TRUE(ran) << kiln_last_error();
      const float *g = ran ? (const float *)kiln_tensor_data(got) : nullptr;
      const float *e = ran ? (const float *)kiln_tensor_data(eager) : nullptr;
      for (int64_t i = 0; ran && i < chunk; i++) {
        differ += std::memcmp(&g[i], &e[i], 4) != 0;
        double err = ulp_error(g[i], f.ref(x[(size_t)i]), true);
        if (err > worst) worst = err, at = x[(size_t)i], got_at = g[i];
      }
      kiln_scope_pop();
      more = more && ran;
    }
    std::printf("  %s f32 (bit patterns %llu apart): worst %.3g ulp at x = %.9g (got %.9g), %lld differ from eager\n",
                f.name, (unsigned long long)stride, worst, at, got_at, (long long)differ);
    EXPECT_LE(worst, f.max_ulp) << f.name << " at x = " << at;
    EXPECT_EQ(differ, 0) << f.name << ": compiled and eager kernels differ";
    cpu_program_free(p);
    ir_module_free(m);
  }
}

// Every 1021st f32 (a prime stride: every exponent, scattered mantissas).
TEST(VecMath, F32SparseSweep) {
  Scoped scope;
  sweep_f32(0, 1021);
}

// Every f32 (about ten minutes): run it with --gtest_also_run_disabled_tests
// after changing either copy of the f32 algorithms.
TEST(VecMath, DISABLED_F32EveryInput) {
  Scoped scope;
  sweep_f32(0, 1);
}

}  // namespace
