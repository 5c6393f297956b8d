// backend_cpu_test.cc — the LLVM CPU backend (backends/cpu) against the
// reference interpreter: every op of ops.def with every dtype it allows as a
// one-instruction function, on odd shapes (rank 0, empty dims, 1 x N,
// primes, sizes that split over threads); fusion bodies compiled as one
// kernel; calls and host callbacks; many threads running one program; bad
// arguments and run-time failures; the text stages; and random programs
// from tests/ir_gen.h. Results agree bit for bit except where the compiled
// code may round differently: the vector math (a few ulp), float sums and
// products (another order), and FMA contraction inside fused kernels.
#include <pthread.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu/cpu.h"
#include "ir.h"
#include "passes.h"
#include "test_util.h"
#if __has_include("ir_gen.h")
#include "ir_gen.h"
#define KILN_TEST_HAVE_IR_GEN 1
#endif

namespace {

using namespace kiln_test;
using ::testing::HasSubstr;

op_type type_of(const kiln_tensor *t) {
  op_type ty{};
  ty.dtype = kiln_tensor_dtype(t);
  ty.rank = kiln_tensor_rank(t);
  for (int i = 0; i < ty.rank; i++) ty.shape[i] = kiln_tensor_shape(t)[i];
  return ty;
}

// Random data of any dtype: floats in [-3, 3] (with special values when
// asked: +-0, +-inf, NaN, huge, tiny, subnormal), ints in [lo, hi] (never 0
// when nonzero), f16/bf16 any bit pattern.
kiln_tensor *random_tensor(std::mt19937 &rng, kiln_dtype dt, V64 shape, int lo = -5, int hi = 5, bool nonzero = false,
                           bool special = false) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<unsigned char> buf((size_t)n * kiln_dtype_size(dt) + 8);
  std::uniform_real_distribution<double> real(-3, 3);
  std::uniform_int_distribution<int> integer(lo, hi), pick(0, 19);
  static const double specials[] = {0.0,   -0.0,   kInf,   -kInf, kNan, 1e30, -1e30,
                                    1e-30, 5e-324, 1e-310, 88.5,  -104, 710,  1e5};
  for (int64_t i = 0; i < n; i++) {
    double r = real(rng);
    int p = pick(rng);
    if (special && p < 5) r = specials[(size_t)(rng() % (sizeof specials / sizeof *specials))];
    int k = integer(rng);
    if (nonzero && k == 0) k = 1;
    switch (dt) {
      case KILN_F32: ((float *)buf.data())[i] = (float)r; break;
      case KILN_F64: ((double *)buf.data())[i] = r; break;
      case KILN_I32: ((int32_t *)buf.data())[i] = k; break;
      case KILN_I64: ((int64_t *)buf.data())[i] = k; break;
      case KILN_BOOL: buf[(size_t)i] = (unsigned char)(k & 1); break;
      default: ((uint16_t *)buf.data())[i] = (uint16_t)rng(); break;
    }
  }
  return kiln_tensor_new(dt, (int)shape.size(), shape.data(), buf.data());
}

// ---- comparing ----

// How closely a compiled result must match the interpreter's.
struct Tol {
  double ulps = 0;         // floats: this many units in the last place
  double rel = 0;          // or this relative error (sums in another order)
  double abs = 0;          // or this absolute error (cancellation after contraction)
  bool zero_sign = false;  // -0 == +0 (max/min reductions pick either)
};

int64_t ordered(double x, bool f32) {
  if (f32) {
    int32_t i;
    float f = (float)x;
    std::memcpy(&i, &f, 4);
    return i < 0 ? (int64_t)INT32_MIN - i : i;
  }
  int64_t i;
  std::memcpy(&i, &x, 8);
  return i < 0 ? INT64_MIN - i : i;
}

// "" when got matches want within tol, else what differs
std::string mismatch(const kiln_tensor *want, const kiln_tensor *got, Tol tol = {}) {
  if (!want || !got) return std::string("missing result: ") + kiln_last_error();
  if (kiln_tensor_dtype(want) != kiln_tensor_dtype(got) || shape_of(want) != shape_of(got))
    return "dtype or shape differs";
  kiln_dtype dt = kiln_tensor_dtype(want);
  int64_t n = kiln_tensor_size(want);
  if (dt != KILN_F32 && dt != KILN_F64) {
    size_t bytes = (size_t)n * kiln_dtype_size(dt);
    if (bytes && std::memcmp(kiln_tensor_data(want), kiln_tensor_data(got), bytes)) {
      for (int64_t i = 0; i < n; i++) {
        size_t es = kiln_dtype_size(dt);
        if (std::memcmp((const char *)kiln_tensor_data(want) + i * es, (const char *)kiln_tensor_data(got) + i * es,
                        es)) {
          VD a = dt == KILN_F16 || dt == KILN_BF16 ? VD() : values(want),
             b = dt == KILN_F16 || dt == KILN_BF16 ? VD() : values(got);
          return "element " + std::to_string(i) +
                 (a.empty() ? "" : ": want " + std::to_string(a[i]) + ", got " + std::to_string(b[i]));
        }
      }
    }
    return "";
  }
  bool f32 = dt == KILN_F32;
  for (int64_t i = 0; i < n; i++) {
    double a = f32 ? ((const float *)kiln_tensor_data(want))[i] : ((const double *)kiln_tensor_data(want))[i];
    double b = f32 ? ((const float *)kiln_tensor_data(got))[i] : ((const double *)kiln_tensor_data(got))[i];
    if (std::isnan(a) && std::isnan(b)) continue;
    if (ordered(a, f32) == ordered(b, f32)) continue;
    if (tol.zero_sign && a == b) continue;
    if (tol.ulps > 0 && !std::isnan(a) && !std::isnan(b) && std::llabs(ordered(a, f32) - ordered(b, f32)) <= tol.ulps)
      continue;
    if (tol.rel > 0 && std::fabs(a - b) <= tol.rel * std::max(std::fabs(a), std::fabs(b)) + 1e-300) continue;
    if (std::fabs(a - b) <= tol.abs) continue;
    char msg[160];
    std::snprintf(msg, sizeof msg, "element %lld: want %.17g, got %.17g", (long long)i, a, b);
    return msg;
  }
  return "";
}

// ---- one-instruction functions ----

struct Fn {
  ir_module *m = ir_module_new();
  ir_func *f = nullptr;
  ~Fn() { ir_module_free(m); }
};

// f(in...) = op(in...), parameters of the inputs' types (constants stay
// constants when asked: they are then embedded in the kernel)
bool one_op(Fn &fn, op_id op, const op_attrs &a, const std::vector<kiln_tensor *> &in, std::vector<kiln_tensor *> &args,
            int const_input = -1) {
  std::vector<op_type> types;
  for (size_t k = 0; k < in.size(); k++)
    if ((int)k != const_input) types.push_back(type_of(in[k])), args.push_back(in[k]);
  fn.f = ir_func_new(fn.m, "one", (int)types.size(), types.data());
  if (!fn.f) return false;
  std::vector<ir_value> vals;
  for (size_t k = 0, p = 0; k < in.size(); k++)
    vals.push_back((int)k == const_input ? ir_constant(fn.f, in[k], ir_loc{nullptr, 0}) : (ir_value)p++);
  ir_value v = ir_append(fn.f, op, &a, (int)in.size(), vals.data(), ir_loc{"cpu_test.cc", 1});
  EXPECT_GE(v, 0) << ir_op_info(op)->name << ": " << kiln_last_error();
  return v >= 0 && ir_set_results(fn.f, 1, &v) == 0;
}

// Interprets and compiles f; compares each result. false after a failure.
bool same_as_interpreter(const ir_func *f, const std::vector<kiln_tensor *> &args, Tol tol, const std::string &what,
                         int *kernels = nullptr, const cpu_options *opt = nullptr) {
  std::vector<kiln_tensor *> want(f->n_results), got(f->n_results);
  kiln_clear_error();
  int irc = ir_interpret(f, args.data(), want.data());
  std::string ierr = kiln_last_error();
  cpu_program *p = cpu_compile_with(f, opt);
  EXPECT_NE(p, nullptr) << what << ": " << kiln_last_error();
  if (!p) return false;
  if (kernels) *kernels = cpu_program_kernels(p);
  kiln_clear_error();
  int crc = cpu_run(p, args.data(), got.data());
  std::string cerr = kiln_last_error();
  cpu_program_free(p);
  if (irc) {  // failures must match: the same op, the same reason
    EXPECT_NE(crc, 0) << what << ": the interpreter failed (" << ierr << "), the compiled code did not";
    EXPECT_THAT(ierr, HasSubstr(cerr.substr(0, cerr.find(" (")))) << what;
    return crc != 0;
  }
  EXPECT_EQ(crc, 0) << what << ": " << cerr;
  if (crc) return false;
  bool ok = true;
  for (int r = 0; r < f->n_results; r++) {
    std::string m = mismatch(want[r], got[r], tol);
    EXPECT_EQ(m, "") << what << " result " << r;
    ok = ok && m.empty();
  }
  return ok;
}

struct Case {
  op_attrs a{};
  std::vector<kiln_tensor *> in;
  int const_input = -1;
};

bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }

// The cases of op with key dtype dt.
std::vector<Case> cases_for(op_id op, kiln_dtype dt, std::mt19937 &rng) {
  std::vector<Case> out;
  Case c;
  bool fl = is_float(dt), ints = dt == KILN_I32 || dt == KILN_I64;
  auto R = [&](kiln_dtype d, V64 s, int lo = -5, int hi = 5, bool nz = false, bool sp = false) {
    return random_tensor(rng, d, s, lo, hi, nz, sp);
  };
  const std::vector<V64> shapes = {{2, 3}, {}, {0, 3}, {1, 17}, {7, 13}, {257, 263}};
  switch (ir_op_info(op)->kind) {
    case OPK_UNARY:
      for (const V64 &s : shapes) {
        c.in = {R(dt, s, -5, 5, false, fl && s.size() == 2 && s[0] == 7)};
        out.push_back(c);
      }
      return out;
    case OPK_BINARY:
    case OPK_COMPARE: {
      bool nz = (op == OP_DIV || op == OP_MOD) && ints;
      int lo = op == OP_POW && ints ? -2 : -5;
      const std::vector<std::pair<V64, V64>> pairs = {{{2, 3}, {3}},       {{4, 1}, {1, 5}},      {{}, {3}},
                                                      {{0, 3}, {3}},       {{7, 13}, {7, 13}},    {{3, 1, 4}, {2, 1}},
                                                      {{300, 257}, {257}}, {{300, 1}, {300, 257}}};
      for (auto &pr : pairs) {
        c.in = {R(dt, pr.first), R(dt, pr.second, lo, 5, nz, fl && pr.first.size() == 2 && pr.first[0] == 7)};
        out.push_back(c);
      }
      c.in = {R(dt, {5, 3}), R(dt, {}, 2, 3, nz)};  // x op constant: an immediate in the kernel
      c.const_input = 1;
      out.push_back(c);
      c.in = {R(dt, {}, 2, 3), R(dt, {4}, lo, 5, nz)};
      c.const_input = 0;
      out.push_back(c);
      return out;
    }
    case OPK_SELECT:
      c.in = {R(KILN_BOOL, {2, 3}), R(dt, {2, 3}), R(dt, {3})};
      out.push_back(c);
      c.in = {R(KILN_BOOL, {3}), R(dt, {}), R(dt, {4, 1})};
      out.push_back(c);
      c.in = {R(KILN_BOOL, {260, 260}), R(dt, {260, 260}), R(dt, {260, 260})};
      out.push_back(c);
      return out;
    case OPK_CONVERT:
      for (int to = 0; to < KILN_DTYPE_COUNT; to++) {
        c.a = op_attrs{};
        c.a.dtype = (kiln_dtype)to;
        c.in = {R(dt, {3, 40}, -5, 5, false, fl)};
        out.push_back(c);
      }
      if (fl) {  // saturation at the integer limits, NaN -> 0
        float fv[] = {3e9f,  -3e9f,  2147483520.0f, 2147483648.0f, -2147483648.0f, 9.3e18f,  -9.3e18f, kNanF,
                      kInfF, -kInfF, -0.0f,         0.5f,          -1.5f,          65504.0f, 65520.0f, 1e-8f};
        double dv[] = {3e9,  -3e9,  2147483647.0, 2147483647.5, -2147483648.9, 9.3e18,  -9.3e18, kNan,
                       kInf, -kInf, -0.0,         0.5,          -1.5,          65504.0, 65520.0, 1e-8};
        kiln_tensor *t = dt == KILN_F32 ? kiln_tensor_new(KILN_F32, KILN_SHAPE(16), fv)
                                        : kiln_tensor_new(KILN_F64, KILN_SHAPE(16), dv);
        for (int to = 0; to < KILN_DTYPE_COUNT; to++) {
          c.a = op_attrs{};
          c.a.dtype = (kiln_dtype)to;
          c.in = {t};
          out.push_back(c);
        }
      }
      return out;
    case OPK_CONST:
      c.a.value = R(dt, {2, 2});
      out.push_back(c);
      c.a.value = R(dt, {});
      out.push_back(c);
      return out;
    default: break;
  }
  switch (op) {
    case OP_CONV2D:
    case OP_CONV2D_BP_INPUT:
    case OP_CONV2D_BP_FILTER: {  // stride, dilation, uneven padding and 2 groups at once
      c.a.stride[0] = 2, c.a.stride[1] = 1, c.a.dilation[0] = 1, c.a.dilation[1] = 2, c.a.groups = 2;
      c.a.padding[0] = 1, c.a.padding[1] = 0, c.a.padding[2] = 2, c.a.padding[3] = 1;
      V64 xs = {2, 5, 6, 4}, fs = {3, 2, 2, 4}, ys = {2, 2, 7, 4};
      const V64 &res = op == OP_CONV2D_BP_INPUT ? xs : fs;
      if (op != OP_CONV2D) {
        c.a.rank = 4;
        for (int k = 0; k < 4; k++) c.a.shape[k] = res[k];
      }
      c.in = op == OP_CONV2D ? std::vector<kiln_tensor *>{R(dt, xs), R(dt, fs)}
             : op == OP_CONV2D_BP_INPUT ? std::vector<kiln_tensor *>{R(dt, ys), R(dt, fs)}
                                        : std::vector<kiln_tensor *>{R(dt, xs), R(dt, ys)};
      out.push_back(c);
      break;
    }
    case OP_MAX_POOL2D:
    case OP_MAX_POOL2D_GRAD:
    case OP_AVG_POOL2D:
    case OP_AVG_POOL2D_GRAD: {
      c.a.window[0] = 3, c.a.window[1] = 2, c.a.stride[0] = c.a.stride[1] = 2;
      c.a.padding[0] = 1, c.a.padding[1] = 1, c.a.padding[2] = 0, c.a.padding[3] = 1;
      V64 xs = {2, 5, 6, 3}, ys = {2, 3, 3, 3};
      if (op == OP_AVG_POOL2D_GRAD) {
        c.a.rank = 4;
        for (int k = 0; k < 4; k++) c.a.shape[k] = xs[k];
      }
      c.in = op == OP_MAX_POOL2D || op == OP_AVG_POOL2D ? std::vector<kiln_tensor *>{R(dt, xs)}
             : op == OP_MAX_POOL2D_GRAD                ? std::vector<kiln_tensor *>{R(dt, xs), R(dt, ys)}
                                                       : std::vector<kiln_tensor *>{R(dt, ys)};
      out.push_back(c);
      break;
    }
    case OP_IDENTITY:
    case OP_STOP_GRADIENT:
      c.in = {R(dt, {2, 3})};
      out.push_back(c);
      break;
    case OP_RESHAPE:
      c.a.rank = 3, c.a.shape[0] = 3, c.a.shape[1] = 1, c.a.shape[2] = 2;
      c.in = {R(dt, {2, 3})};
      out.push_back(c);
      break;
    case OP_BROADCAST:
      c.a.rank = 3, c.a.shape[0] = 2, c.a.shape[1] = 4, c.a.shape[2] = 3;
      c.in = {R(dt, {1, 3})};
      out.push_back(c);
      c.a.rank = 2, c.a.shape[0] = 5, c.a.shape[1] = 7;
      c.in = {R(dt, {5, 1})};
      out.push_back(c);
      c.a.rank = 2, c.a.shape[0] = 300, c.a.shape[1] = 301;
      c.in = {R(dt, {})};
      out.push_back(c);
      break;
    case OP_TRANSPOSE:
      c.a.naxes = 3, c.a.axes[0] = 2, c.a.axes[1] = 0, c.a.axes[2] = 1;
      c.in = {R(dt, {2, 3, 4})};
      out.push_back(c);
      c.a.naxes = 2, c.a.axes[0] = 1, c.a.axes[1] = 0;
      c.in = {R(dt, {257, 300})};
      out.push_back(c);
      c.in = {R(dt, {1, 9})};
      out.push_back(c);
      break;
    case OP_SLICE:
      c.a.rank = 2, c.a.begin[0] = 1, c.a.begin[1] = 2, c.a.shape[0] = 2, c.a.shape[1] = 3;
      c.in = {R(dt, {4, 5})};
      out.push_back(c);
      c.a = op_attrs{};
      c.a.rank = 1, c.a.begin[0] = 5, c.a.shape[0] = 70000;  // one long row, cut into blocks
      c.in = {R(dt, {70010})};
      out.push_back(c);
      c.a = op_attrs{};
      c.a.rank = 2, c.a.begin[0] = 0, c.a.begin[1] = 3, c.a.shape[0] = 4, c.a.shape[1] = 0;
      c.in = {R(dt, {4, 5})};
      out.push_back(c);
      break;
    case OP_CONCAT:
      c.a.axis = 1;
      c.in = {R(dt, {2, 3}), R(dt, {2, 1}), R(dt, {2, 2})};
      out.push_back(c);
      break;
    case OP_REDUCE_SUM:
    case OP_REDUCE_PROD:
    case OP_REDUCE_MAX:
    case OP_REDUCE_MIN: {
      struct R1 {
        V64 shape;
        std::vector<int> axes;
        bool keep;
      };
      const std::vector<R1> rs = {{{2, 3, 4}, {0, 2}, false},
                                  {{2, 3, 4}, {0, 2}, true},
                                  {{2, 3, 4}, {1, 2}, false},
                                  {{2, 3, 4}, {0, 1, 2}, false},
                                  {{0, 3}, {0}, false},
                                  {{3, 0}, {1}, true},
                                  {{}, {}, false},
                                  {{300, 257}, {1}, false},
                                  {{300, 257}, {0}, false},
                                  {{5, 7}, {}, false}};
      for (const R1 &r : rs) {
        c.a = op_attrs{};
        c.a.naxes = (int)r.axes.size();
        for (size_t k = 0; k < r.axes.size(); k++) c.a.axes[k] = r.axes[k];
        c.a.keepdims = r.keep;
        // products of many values stay finite: values near 1
        c.in = {op == OP_REDUCE_PROD && fl
                    ? kiln_add(kiln_mul(R(dt, r.shape), kiln_scalar(dt, 0.01)), kiln_scalar(dt, 1))
                    : R(dt, r.shape, -5, 5, false, fl && r.shape.size() == 3 && r.keep)};
        out.push_back(c);
      }
      break;
    }
    case OP_ARGMAX:
      c.a.axis = 1;
      c.in = {R(dt, {3, 4})};
      out.push_back(c);
      break;
    case OP_DOT:
      c.in = {R(dt, {2, 3, 4}), R(dt, {4, 5})};
      out.push_back(c);
      c.in = {R(dt, {1, 7}), R(dt, {7, 13})};
      out.push_back(c);
      break;
    case OP_GATHER:
      c.a.axis = 0;
      c.in = {R(dt, {5, 3}), R(KILN_I64, {2, 2}, 0, 4)};
      out.push_back(c);
      c.a.axis = 1;
      c.in = {R(dt, {2, 3}), R(KILN_I32, {4}, 0, 2)};
      out.push_back(c);
      break;
    case OP_SCATTER_ADD:
      c.a.axis = 0, c.a.rank = 2, c.a.shape[0] = 5, c.a.shape[1] = 3;
      c.in = {R(dt, {2, 2, 3}), R(KILN_I32, {2, 2}, 0, 4)};
      out.push_back(c);
      break;
    case OP_IOTA:
      c.a.dtype = dt, c.a.rank = 1, c.a.shape[0] = 7;
      out.push_back(c);
      c.a.rank = 2, c.a.shape[0] = 3, c.a.shape[1] = 5;
      out.push_back(c);
      break;
    case OP_RNG_UNIFORM:
    case OP_RNG_NORMAL:
      c.a.dtype = dt, c.a.rank = 2, c.a.shape[0] = 3, c.a.shape[1] = 5;
      c.a.lo = op == OP_RNG_UNIFORM ? -2 : 0, c.a.hi = op == OP_RNG_UNIFORM ? 3 : 0;
      c.a.seed = 1234, c.a.counter = 17;
      out.push_back(c);
      break;
    default: break;
  }
  return out;
}

Tol tolerance(op_id op, kiln_dtype dt) {
  Tol t;
  if (!is_float(dt)) return t;
  switch (op) {
    case OP_EXP:
    case OP_LOG:
    case OP_LOG1P:
    case OP_SIN:
    case OP_COS:
    case OP_TANH:
    case OP_SIGMOID:
    case OP_POW: t.ulps = 4; break;
    case OP_REDUCE_SUM:
    case OP_REDUCE_PROD: t.rel = dt == KILN_F32 ? 1e-6 : 1e-12; break;
    case OP_REDUCE_MAX:
    case OP_REDUCE_MIN: t.zero_sign = true; break;
    default: break;
  }
  return t;
}

TEST(CpuBackend, EveryOpEveryDtypeMatchesTheInterpreter) {
  Scoped scope;
  std::mt19937 rng(11);
  int compared = 0;
  for (int op = 0; op < OP_COUNT; op++) {
    const op_info *info = ir_op_info((op_id)op);
    if (info->kind == OPK_CALL || info->kind == OPK_COLLECTIVE || info->kind == OPK_HOST || info->kind == OPK_CONTROL) continue;  // tested below, control_test, dist/staged_test
    for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {
      if (!(info->dtypes & (1u << dt))) continue;
      kiln_scope_push();
      std::vector<Case> cases = cases_for((op_id)op, (kiln_dtype)dt, rng);
      EXPECT_FALSE(cases.empty()) << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << " not covered";
      for (size_t k = 0; k < cases.size(); k++) {
        Case &c = cases[k];
        Fn fn;
        std::vector<kiln_tensor *> args;
        std::string what =
            std::string(info->name) + " " + kiln_dtype_name((kiln_dtype)dt) + " case " + std::to_string(k);
        ASSERT_TRUE(one_op(fn, (op_id)op, c.a, c.in, args, c.const_input)) << what << ": " << kiln_last_error();
        if (same_as_interpreter(fn.f, args, tolerance((op_id)op, (kiln_dtype)dt), what)) compared++;
      }
      kiln_scope_pop();
    }
  }
  EXPECT_GT(compared, 700);
}

// Compiled f32 exp, log, tanh and sigmoid are the eager kernels' own
// algorithms: bit for bit equal, not just close.
TEST(CpuBackend, F32VectorMathIsTheEagerKernels) {
  Scoped scope;
  std::mt19937 rng(5);
  for (op_id op : {OP_EXP, OP_LOG, OP_TANH, OP_SIGMOID}) {
    Fn fn;
    std::vector<kiln_tensor *> args;
    ASSERT_TRUE(one_op(fn, op, op_attrs{}, {random_tensor(rng, KILN_F32, {1000}, 0, 0, false, true)}, args));
    same_as_interpreter(fn.f, args, Tol{}, ir_op_info(op)->name);
  }
}

TEST(CpuBackend, RandomDrawsMatchTheInterpreterBitForBit) {
  Scoped scope;
  const char *text =
      "func @r() -> (f32[4,5], f64[7], i32[9]) {\n"
      "  %u = rng_uniform {dtype=f32, shape=[4,5], lo=-1.0, hi=2.0, seed=global, counter=global} : f32[4,5]\n"
      "  %n = rng_normal {dtype=f64, shape=[7], seed=global, counter=global} : f64[7]\n"
      "  %i = rng_uniform {dtype=i32, shape=[9], lo=0.0, hi=10.0, seed=global, counter=global} : i32[9]\n"
      "  return %u, %n, %i\n"
      "}\n";
  ir_module *m = ir_parse(text, "rng.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cpu_program *p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  kiln_tensor *want[3], *got[3], *again[3];
  kiln_random_set_state(42, 1000);
  ASSERT_EQ(cpu_run(p, nullptr, got), 0) << kiln_last_error();
  uint64_t seed, after_compiled, after_interp;
  kiln_random_get_state(&seed, &after_compiled);
  kiln_random_set_state(42, 1000);
  ASSERT_EQ(ir_interpret(m->funcs[0], nullptr, want), 0) << kiln_last_error();
  kiln_random_get_state(&seed, &after_interp);
  EXPECT_EQ(after_compiled, after_interp);  // the same blocks of the stream, in program order
  for (int r = 0; r < 3; r++) EXPECT_TRUE(same_bits(want[r], got[r])) << "result " << r;
  ASSERT_EQ(cpu_run(p, nullptr, again), 0) << kiln_last_error();
  EXPECT_FALSE(same_bits(got[0], again[0])) << "each call draws anew";
  cpu_program_free(p);
  ir_module_free(m);
}

// ---- fused kernels ----

TEST(CpuBackend, FusionBodiesCompileToOneKernel) {
  Scoped scope;
  std::mt19937 rng(3);
  struct F {
    const char *text;
    int kernels;
  };
  const F fs[] = {
      // the bench's expression: tanh(x*a+b)*c+x, with broadcast scalars
      {"func @k(%x: f32[37,53], %a: f32[], %b: f32[53], %c: f32[37,1]) -> f32[37,53] {\n"
       "  %0 = broadcast %a {shape=[37,53]} : f32[37,53]\n"
       "  %1 = mul %x, %0 : f32[37,53]\n"
       "  %2 = add %1, %b : f32[37,53]\n"
       "  %3 = tanh %2 : f32[37,53]\n"
       "  %4 = mul %3, %c : f32[37,53]\n"
       "  %5 = add %4, %x : f32[37,53]\n"
       "  return %5\n"
       "}\n"
       "func @f(%x: f32[37,53], %a: f32[], %b: f32[53], %c: f32[37,1]) -> f32[37,53] {\n"
       "  %r = fusion @k(%x, %a, %b, %c) : f32[37,53]\n"
       "  return %r\n"
       "}\n",
       1},
      // index remapping inside a kernel: transpose, slice, reshape, a constant
      {"func @k(%x: f64[6,4]) -> (f64[3,6], i32[3,6]) {\n"
       "  %t = transpose %x {perm=[1,0]} : f64[4,6]\n"
       "  %s = slice %t {begin=[1,0], size=[3,6]} : f64[3,6]\n"
       "  %r = reshape %s {shape=[18]} : f64[18]\n"
       "  %c = constant dense<[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, "
       "17.0, 18.0]> : f64[18]\n"
       "  %m = mul %r, %c : f64[18]\n"
       "  %b = reshape %m {shape=[3,6]} : f64[3,6]\n"
       "  %e = exp %b : f64[3,6]\n"
       "  %i = convert %b {dtype=i32} : i32[3,6]\n"
       "  return %e, %i\n"
       "}\n"
       "func @f(%x: f64[6,4]) -> (f64[3,6], i32[3,6]) {\n"
       "  %e, %i = fusion @k(%x) : f64[3,6], i32[3,6]\n"
       "  return %e, %i\n"
       "}\n",
       1},
      // elementwise producers into a reduction; two reductions of one input
      {"func @k(%x: f32[31,67], %y: f32[67]) -> (f32[31], f32[31]) {\n"
       "  %d = sub %x, %y : f32[31,67]\n"
       "  %e = exp %d : f32[31,67]\n"
       "  %s = reduce_sum %e {axes=[1]} : f32[31]\n"
       "  %m = reduce_max %d {axes=[1]} : f32[31]\n"
       "  return %s, %m\n"
       "}\n"
       "func @f(%x: f32[31,67], %y: f32[67]) -> (f32[31], f32[31]) {\n"
       "  %s, %m = fusion @k(%x, %y) : f32[31], f32[31]\n"
       "  return %s, %m\n"
       "}\n",
       1},
      // a reduction over a leading axis, with a select
      {"func @k(%x: f64[9,5,4], %z: f64[]) -> f64[5] {\n"
       "  %p = gt %x, %z : bool[9,5,4]\n"
       "  %n = neg %x : f64[9,5,4]\n"
       "  %s = select %p, %x, %n : f64[9,5,4]\n"
       "  %r = reduce_sum %s {axes=[0,2]} : f64[5]\n"
       "  return %r\n"
       "}\n"
       "func @f(%x: f64[9,5,4], %z: f64[]) -> f64[5] {\n"
       "  %r = fusion @k(%x, %z) : f64[5]\n"
       "  return %r\n"
       "}\n",
       1},
      // dot epilogues. A short inner dimension is summed in the kernel: the
      // batch-1 weight gradient (an outer product) fused into its SGD update
      {"func @k(%h: f32[64,1], %dy: f32[1,48], %lr: f32[], %w: f32[64,48]) -> f32[64,48] {\n"
       "  %g = dot %h, %dy : f32[64,48]\n"
       "  %s = mul %g, %lr : f32[64,48]\n"
       "  %n = sub %w, %s : f32[64,48]\n"
       "  return %n\n"
       "}\n"
       "func @f(%h: f32[64,1], %dy: f32[1,48], %lr: f32[], %w: f32[64,48]) -> f32[64,48] {\n"
       "  %r = fusion @k(%h, %dy, %lr, %w) : f32[64,48]\n"
       "  return %r\n"
       "}\n",
       1},
      // ... batched, batch dims broadcast, integers, the dot itself a result,
      // an operand transposed inside the kernel
      {"func @k(%a: i64[2,1,5,3], %b: i64[4,7,3]) -> (i64[2,4,5,7], i64[2,4,5,7]) {\n"
       "  %t = transpose %b {perm=[0,2,1]} : i64[4,3,7]\n"
       "  %d = dot %a, %t : i64[2,4,5,7]\n"
       "  %r = mul %d, %d : i64[2,4,5,7]\n"
       "  return %d, %r\n"
       "}\n"
       "func @f(%a: i64[2,1,5,3], %b: i64[4,7,3]) -> (i64[2,4,5,7], i64[2,4,5,7]) {\n"
       "  %d, %r = fusion @k(%a, %b) : i64[2,4,5,7], i64[2,4,5,7]\n"
       "  return %d, %r\n"
       "}\n",
       1},
      {"func @k(%a: f64[3,8], %b: f64[8,5], %c: f64[3,5]) -> f64[3,5] {\n"
       "  %d = dot %a, %b : f64[3,5]\n"
       "  %r = add %d, %c : f64[3,5]\n"
       "  return %r\n"
       "}\n"
       "func @f(%a: f64[3,8], %b: f64[8,5], %c: f64[3,5]) -> f64[3,5] {\n"
       "  %r = fusion @k(%a, %b, %c) : f64[3,5]\n"
       "  return %r\n"
       "}\n",
       1},
      // narrow rows (2-4 columns): the columns are unrolled and vectors run
      // across rows, with a remainder of rows (203 = 12 * 16 + 11)
      {"func @k(%x: f32[203,10], %w: f32[10,2], %b: f32[2], %y: f32[203,2]) -> (f32[203,2], f32[203,2]) {\n"
       "  %d = dot %x, %w : f32[203,2]\n"
       "  %a = add %d, %b : f32[203,2]\n"
       "  %t = tanh %a : f32[203,2]\n"
       "  %m = mul %t, %y : f32[203,2]\n"
       "  return %a, %m\n"
       "}\n"
       "func @f(%x: f32[203,10], %w: f32[10,2], %b: f32[2], %y: f32[203,2]) -> (f32[203,2], f32[203,2]) {\n"
       "  %a, %m = fusion @k(%x, %w, %b, %y) : f32[203,2], f32[203,2]\n"
       "  return %a, %m\n"
       "}\n",
       1},
      // ... batched, integer, three columns, an operand transposed
      {"func @k(%a: i32[3,41,5], %b: i32[3,3,5]) -> i32[3,41,3] {\n"
       "  %t = transpose %b {perm=[0,2,1]} : i32[3,5,3]\n"
       "  %d = dot %a, %t : i32[3,41,3]\n"
       "  %r = mul %d, %d : i32[3,41,3]\n"
       "  return %r\n"
       "}\n"
       "func @f(%a: i32[3,41,5], %b: i32[3,3,5]) -> i32[3,41,3] {\n"
       "  %r = fusion @k(%a, %b) : i32[3,41,3]\n"
       "  return %r\n"
       "}\n",
       1},
      // ... split over the thread pool (140004 elements of 5 products
      // each): tasks take whole rows
      {"func @k(%x: f64[35001,5], %w: f64[5,4], %b: f64[4]) -> f64[35001,4] {\n"
       "  %d = dot %x, %w : f64[35001,4]\n"
       "  %a = sub %d, %b : f64[35001,4]\n"
       "  return %a\n"
       "}\n"
       "func @f(%x: f64[35001,5], %w: f64[5,4], %b: f64[4]) -> f64[35001,4] {\n"
       "  %r = fusion @k(%x, %w, %b) : f64[35001,4]\n"
       "  return %r\n"
       "}\n",
       1},
      // cheap kernels split over the pool only from PAR_MIN_CHEAP elements
      {"func @f(%x: f32[600001], %y: f32[600001]) -> f32[600001] {\n"
       "  %r = add %x, %y : f32[600001]\n"
       "  return %r\n"
       "}\n",
       1},
      // a transposed read runs in tiles of rows x columns: ragged edges
      // (67 = 4 * 16 + 3 rows, 131 = 2 * 64 + 3 columns), batched, and a
      // threaded one (700 x 300)
      {"func @k(%x: f64[131,67], %y: f64[67]) -> f64[67,131] {\n"
       "  %t = transpose %x {perm=[1,0]} : f64[67,131]\n"
       "  %b = broadcast %y {shape=[131,67]} : f64[131,67]\n"
       "  %u = transpose %b {perm=[1,0]} : f64[67,131]\n"
       "  %r = mul %t, %u : f64[67,131]\n"
       "  return %r\n"
       "}\n"
       "func @f(%x: f64[131,67], %y: f64[67]) -> f64[67,131] {\n"
       "  %r = fusion @k(%x, %y) : f64[67,131]\n"
       "  return %r\n"
       "}\n",
       1},
      {"func @k(%x: i32[3,40,50]) -> i32[3,50,40] {\n"
       "  %t = transpose %x {perm=[0,2,1]} : i32[3,50,40]\n"
       "  %r = add %t, %t : i32[3,50,40]\n"
       "  return %r\n"
       "}\n"
       "func @f(%x: i32[3,40,50]) -> i32[3,50,40] {\n"
       "  %r = fusion @k(%x) : i32[3,50,40]\n"
       "  return %r\n"
       "}\n",
       1},
      {"func @k(%x: f32[300,700]) -> f32[700,300] {\n"
       "  %t = transpose %x {perm=[1,0]} : f32[700,300]\n"
       "  %e = exp %t : f32[700,300]\n"
       "  return %e\n"
       "}\n"
       "func @f(%x: f32[300,700]) -> f32[700,300] {\n"
       "  %r = fusion @k(%x) : f32[700,300]\n"
       "  return %r\n"
       "}\n",
       1},
      // a transpose of 4-byte elements alone: 16x16 tiles through registers,
      // with ragged columns and rows (40 x 35), batched, exact multiples
      {"func @f(%x: f32[40,35], %y: i32[3,33,20], %z: f32[32,48]) -> (f32[35,40], i32[3,20,33], f32[48,32]) {\n"
       "  %t = transpose %x {perm=[1,0]} : f32[35,40]\n"
       "  %u = transpose %y {perm=[0,2,1]} : i32[3,20,33]\n"
       "  %v = transpose %z {perm=[1,0]} : f32[48,32]\n"
       "  return %t, %u, %v\n"
       "}\n",
       3},
      // a long inner dimension: the packed matmul first, then bias and relu
      // as one kernel
      {"func @k(%x: f32[33,100], %w: f32[100,29], %b: f32[29]) -> f32[33,29] {\n"
       "  %d = dot %x, %w : f32[33,29]\n"
       "  %a = add %d, %b : f32[33,29]\n"
       "  %z = relu %a : f32[33,29]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f32[33,100], %w: f32[100,29], %b: f32[29]) -> f32[33,29] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[33,29]\n"
       "  return %r\n"
       "}\n",
       1},
      // ... but not when the dot reads a value the body computes: inlined
      // (here a transpose, which the packing then reads in place: the add's
      // kernel is the only one)
      {"func @k(%x: f32[100,33], %w: f32[100,29], %b: f32[29]) -> f32[33,29] {\n"
       "  %t = transpose %x {perm=[1,0]} : f32[33,100]\n"
       "  %d = dot %t, %w : f32[33,29]\n"
       "  %a = add %d, %b : f32[33,29]\n"
       "  return %a\n"
       "}\n"
       "func @f(%x: f32[100,33], %w: f32[100,29], %b: f32[29]) -> f32[33,29] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[33,29]\n"
       "  return %r\n"
       "}\n",
       1},
      // conv2d epilogues: + bias (+ relu) is the convolution's epilogue, no
      // kernel (conv2d_epilogue); + a residual too (ResNet's shortcut), the
      // bias of shape [1,1,1,o]; f64, strided and padded
      {"func @k(%x: f32[2,9,9,3], %w: f32[3,3,3,5], %b: f32[5]) -> f32[2,7,7,5] {\n"
       "  %c = conv2d %x, %w {stride=[1,1], dilation=[1,1], padding=[0,0,0,0], groups=1} : f32[2,7,7,5]\n"
       "  %a = add %c, %b : f32[2,7,7,5]\n"
       "  %z = relu %a : f32[2,7,7,5]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f32[2,9,9,3], %w: f32[3,3,3,5], %b: f32[5]) -> f32[2,7,7,5] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[2,7,7,5]\n"
       "  return %r\n"
       "}\n",
       0},
      {"func @k(%x: f64[1,8,7,4], %w: f64[3,3,4,6], %b: f64[1,1,1,6], %s: f64[1,4,4,6]) -> f64[1,4,4,6] {\n"
       "  %c = conv2d %x, %w {stride=[2,2], dilation=[1,1], padding=[1,1,1,1], groups=1} : f64[1,4,4,6]\n"
       "  %a = add %b, %c : f64[1,4,4,6]\n"
       "  %r = add %a, %s : f64[1,4,4,6]\n"
       "  %z = relu %r : f64[1,4,4,6]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f64[1,8,7,4], %w: f64[3,3,4,6], %b: f64[1,1,1,6], %s: f64[1,4,4,6]) -> f64[1,4,4,6] {\n"
       "  %r = fusion @k(%x, %w, %b, %s) : f64[1,4,4,6]\n"
       "  return %r\n"
       "}\n",
       0},
      // ... an inference batch norm after it is no epilogue: the conv runs
      // before the kernel of the rest
      {"func @k(%x: f32[2,6,6,4], %w: f32[1,1,4,8], %m: f32[8], %v: f32[8], %g: f32[8]) -> f32[2,6,6,8] {\n"
       "  %c = conv2d %x, %w {stride=[1,1], dilation=[1,1], padding=[0,0,0,0], groups=1} : f32[2,6,6,8]\n"
       "  %d = sub %c, %m : f32[2,6,6,8]\n"
       "  %e = mul %d, %v : f32[2,6,6,8]\n"
       "  %h = add %e, %g : f32[2,6,6,8]\n"
       "  %z = relu %h : f32[2,6,6,8]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f32[2,6,6,4], %w: f32[1,1,4,8], %m: f32[8], %v: f32[8], %g: f32[8]) -> f32[2,6,6,8] {\n"
       "  %r = fusion @k(%x, %w, %m, %v, %g) : f32[2,6,6,8]\n"
       "  return %r\n"
       "}\n",
       1},
      // a body that is not one kernel (a reduction read inside it): inlined,
      // one kernel per instruction
      {"func @k(%x: f32[4,6]) -> f32[4,6] {\n"
       "  %m = reduce_max %x {axes=[1], keepdims=true} : f32[4,1]\n"
       "  %d = sub %x, %m : f32[4,6]\n"
       "  return %d\n"
       "}\n"
       "func @f(%x: f32[4,6]) -> f32[4,6] {\n"
       "  %r = fusion @k(%x) : f32[4,6]\n"
       "  return %r\n"
       "}\n",
       2},
  };
  for (const F &t : fs) {
    ir_module *m = ir_parse(t.text, "fuse.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << t.text;
    const ir_func *f = ir_module_find(m, "f");
    std::vector<kiln_tensor *> args;
    for (int i = 0; i < f->n_params; i++) {
      const op_type &ty = f->types[i];
      args.push_back(random_tensor(rng, ty.dtype, V64(ty.shape, ty.shape + ty.rank)));
    }
    int kernels = 0;
    Tol tol;
    tol.rel = 1e-5;  // FMA contraction, exp's last bit
    tol.abs = 1e-5;
    same_as_interpreter(f, args, tol, t.text, &kernels);
    EXPECT_EQ(kernels, t.kernels) << t.text;
    ir_module_free(m);
  }
}

TEST(CpuBackend, CallsAndViewsAsResults) {
  Scoped scope;
  const char *text =
      "func @sq(%a: f32[2,3]) -> (f32[2,3], f32[2,3]) {\n"
      "  %m = mul %a, %a : f32[2,3]\n"
      "  return %m, %a\n"
      "}\n"
      "func @f(%x: f32[2,3], %y: i64[3]) -> (f32[2,3], f32[6], f32[2,3], f32[3,2], f32[2,3], i64[3], f32[2,3], f32[]) "
      "{\n"
      "  %s, %same = call @sq(%x) : f32[2,3], f32[2,3]\n"
      "  %t, %t2 = call @sq(%s) : f32[2,3], f32[2,3]\n"
      "  %r = reshape %s {shape=[6]} : f32[6]\n"
      "  %v = reshape %x {shape=[3,2]} : f32[3,2]\n"
      "  %c = constant dense<2.5> : f32[]\n"
      "  return %s, %r, %same, %v, %x, %y, %s, %c\n"
      "}\n";
  ir_module *m = ir_parse(text, "calls.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  const ir_func *f = ir_module_find(m, "f");
  std::vector<kiln_tensor *> args = {f32({2, 3}, {1, -2, 3, 0.5f, 5, -6}), i64({3}, {7, 8, 9})};
  same_as_interpreter(f, args, Tol{}, "calls");
  cpu_program *p = cpu_compile(f);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> got(8);
  ASSERT_EQ(cpu_run(p, args.data(), got.data()), 0) << kiln_last_error();
  EXPECT_EQ(got[4], args[0]);  // a parameter returned as it is, as the interpreter does
  EXPECT_EQ(got[5], args[1]);
  EXPECT_EQ(got[6], got[0]);  // the same value twice: one tensor
  EXPECT_EQ(read<float>(got[1]), (std::vector<float>{1, 4, 9, 0.25f, 25, 36}));
  EXPECT_EQ(read<float>(got[7]), (std::vector<float>{2.5f}));
  cpu_program_free(p);
  ir_module_free(m);
}

int twice(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_mul(in[0], kiln_scalar(KILN_F32, 2));
  return out[0] ? 0 : -1;
}

int wrong_shape(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out, (void)in;
  out[0] = kiln_zeros(KILN_F32, KILN_SHAPE(5));
  return 0;
}

TEST(CpuBackend, HostCalls) {
  Scoped scope;
  for (kiln_host_fn fn : {twice, wrong_shape}) {
    ir_module *m = ir_module_new();
    op_type t{KILN_F32, 1, {3}};
    ir_func *f = ir_func_new(m, "h", 1, &t);
    ir_host *h = ir_module_add_host(m, fn, nullptr, fn == twice ? "twice" : "wrong", 1, &t);
    ASSERT_NE(h, nullptr) << kiln_last_error();
    op_attrs a{};
    a.host = h;
    ir_value x = 0;
    ir_value e = ir_append(f, OP_EXP, nullptr, 1, &x, ir_loc{nullptr, 0});
    ir_value v = ir_append(f, OP_HOST_CALL, &a, 1, &e, ir_loc{nullptr, 0});
    ir_value r = ir_append(f, OP_NEG, nullptr, 1, &v, ir_loc{nullptr, 0});
    ASSERT_GE(r, 0) << kiln_last_error();
    ASSERT_EQ(ir_set_results(f, 1, &r), 0);
    std::vector<kiln_tensor *> args = {f32({3}, {0, 1, -1})};
    if (fn == twice) {
      Tol tol;
      tol.ulps = 4;
      same_as_interpreter(f, args, tol, "host");
    } else {
      cpu_program *p = cpu_compile(f);
      ASSERT_NE(p, nullptr) << kiln_last_error();
      kiln_tensor *out = nullptr;
      EXPECT_EQ(cpu_run(p, args.data(), &out), -1);
      EXPECT_THAT(kiln_last_error(), HasSubstr("host_call: @wrong returned f32[5] for output 0, declared f32[3]"));
      cpu_program_free(p);
    }
    ir_module_free(m);
  }
}

// Outputs bigger than the caches are written with streaming stores from
// aligned tiles; a last partial tile is copied plainly.
TEST(CpuBackend, LargeOutputsStreamAroundTheCaches) {
  Scoped scope;
  std::mt19937 rng(21);
  const char *text =
      "func @k(%x: f64[4194329], %y: f64[]) -> (f64[4194329], i32[4194329]) {\n"
      "  %m = mul %x, %y : f64[4194329]\n"
      "  %a = add %m, %x : f64[4194329]\n"
      "  %c = convert %a {dtype=i32} : i32[4194329]\n"
      "  return %a, %c\n"
      "}\n"
      "func @f(%x: f64[4194329], %y: f64[]) -> (f64[4194329], i32[4194329], f32[8388645]) {\n"
      "  %a, %c = fusion @k(%x, %y) : f64[4194329], i32[4194329]\n"
      "  %h = convert %x {dtype=f32} : f32[4194329]\n"
      "  %t = concat %h, %h {axis=0} : f32[8388658]\n"
      "  %s = slice %t {begin=[13], size=[8388645]} : f32[8388645]\n"
      "  %n = neg %s : f32[8388645]\n"
      "  return %a, %c, %n\n"
      "}\n";
  ir_module *m = ir_parse(text, "big.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> args = {random_tensor(rng, KILN_F64, {4194329}), kiln_scalar(KILN_F64, 3)};
  cpu_options strict{};
  strict.no_contract = true;
  cpu_program *p = cpu_compile_with(ir_module_find(m, "f"), &strict);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  kiln_tensor *want[3], *got[3];
  ASSERT_EQ(ir_interpret(ir_module_find(m, "f"), args.data(), want), 0) << kiln_last_error();
  ASSERT_EQ(cpu_run(p, args.data(), got), 0) << kiln_last_error();
  for (int r = 0; r < 3; r++) EXPECT_EQ(mismatch(want[r], got[r]), "") << "result " << r;
#if defined(__x86_64__)
  char *as = cpu_program_text(p, "asm");
  ASSERT_NE(as, nullptr);
  EXPECT_THAT(as, HasSubstr("movnt"));
  EXPECT_THAT(as, HasSubstr("prefetcht0"));
  free(as);
#endif
  cpu_program_free(p);
  ir_module_free(m);
}

// A flat kernel over inputs far bigger than the caches prefetches its input
// lines ahead of the vector loads (the hardware prefetchers alone leave a
// kernel of vector math short of the memory's bandwidth); a small one does
// not. Both equal the interpreter.
TEST(CpuBackend, BigFlatKernelsPrefetchTheirInputs) {
  Scoped scope;
  std::mt19937 rng(22);
  for (int64_t n : {int64_t{2097169}, int64_t{4099}}) {
    const std::string t = "f32[" + std::to_string(n) + "]";
    const std::string text = "func @f(%x: " + t + ", %a: f32[]) -> " + t + " {\n  %m = mul %x, %a : " + t +
                             "\n  %h = tanh %m : " + t + "\n  %r = add %h, %x : " + t + "\n  return %r\n}\n";
    ir_module *m = ir_parse(text.c_str(), "pf.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error();
    std::vector<kiln_tensor *> args = {random_tensor(rng, KILN_F32, {n}), kiln_scalar(KILN_F32, 0.75)};
    Tol tol;
    tol.ulps = 4;
    EXPECT_TRUE(same_as_interpreter(m->funcs[0], args, tol, text));
#if defined(__x86_64__)
    cpu_program *p = cpu_compile(m->funcs[0]);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    char *as = cpu_program_text(p, "asm");
    ASSERT_NE(as, nullptr) << kiln_last_error();
    EXPECT_EQ(std::string(as).find("prefetcht0") != std::string::npos, n * 4 >= (8 << 20)) << n;
    free(as);
    cpu_program_free(p);
#endif
    ir_module_free(m);
  }
}

// ---- threads ----

TEST(CpuBackend, ManyThreadsRunOneProgram) {
  Scoped scope;
  std::mt19937 rng(9);
  const char *text =
      "func @f(%x: f32[300,257], %y: f32[257], %i: i64[4]) -> (f32[300,257], f32[300], f32[4,257]) {\n"
      "  %a = mul %x, %y : f32[300,257]\n"
      "  %t = tanh %a : f32[300,257]\n"
      "  %s = reduce_sum %t {axes=[1]} : f32[300]\n"
      "  %g = gather %t, %i {axis=0} : f32[4,257]\n"
      "  return %t, %s, %g\n"
      "}\n";
  ir_module *m = ir_parse(text, "threads.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> args = {random_tensor(rng, KILN_F32, {300, 257}), random_tensor(rng, KILN_F32, {257}),
                                     i64({4}, {0, 299, 7, 7})};
  cpu_program *p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  kiln_tensor *want[3];
  ASSERT_EQ(cpu_run(p, args.data(), want), 0) << kiln_last_error();
  std::vector<std::thread> threads;
  std::vector<int> bad(8, 0);
  for (int t = 0; t < 8; t++)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 25; k++) {
        kiln_scope_push();
        kiln_tensor *got[3];
        if (cpu_run(p, args.data(), got))
          bad[t]++;
        else
          for (int r = 0; r < 3; r++) bad[t] += !same_bits(want[r], got[r]);
        kiln_scope_pop();
      }
    });
  for (auto &th : threads) th.join();
  for (int t = 0; t < 8; t++) EXPECT_EQ(bad[t], 0) << "thread " << t;
  cpu_program_free(p);
  ir_module_free(m);
}

// Compiling is thread-safe too: one LLVM context per program, one JIT.
TEST(CpuBackend, ThreadsCompileAtOnce) {
  Scoped scope;
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; t++)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 5; k++) {
        kiln_scope_push();
        char text[400];
        std::snprintf(text, sizeof text,
                      "func @f(%%x: f64[%d]) -> f64[] {\n  %%s = sin %%x : f64[%d]\n"
                      "  %%r = reduce_sum %%s {axes=[0]} : f64[]\n  return %%r\n}\n",
                      t * 10 + k + 1, t * 10 + k + 1);
        ir_module *m = ir_parse(text, "c.kir");
        cpu_program *p = m ? cpu_compile(m->funcs[0]) : nullptr;
        int64_t n = t * 10 + k + 1;
        kiln_tensor *x = kiln_fill(KILN_F64, 1, &n, 0.5), *r = nullptr;
        if (!p || cpu_run(p, &x, &r) || std::fabs(values(r)[0] - (t * 10 + k + 1) * std::sin(0.5)) > 1e-12) bad[t]++;
        cpu_program_free(p);
        ir_module_free(m);
        kiln_scope_pop();
      }
    });
  for (auto &th : threads) th.join();
  for (int t = 0; t < 4; t++) EXPECT_EQ(bad[t], 0) << "thread " << t;
}

// ---- failures ----

TEST(CpuBackend, BadArgumentsAreErrors) {
  Scoped scope;
  ir_module *m =
      ir_parse("func @f(%x: i32[2], %y: i32[2]) -> i32[2] {\n  %q = div %x, %y : i32[2]\n  return %q\n}\n", "bad.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cpu_program *p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  kiln_tensor *ok[2] = {i32({2}, {6, 9}), i32({2}, {2, 3})}, *res = nullptr;
  kiln_tensor *wrong_dtype[2] = {f32({2}, {1, 2}), ok[1]};
  EXPECT_EQ(cpu_run(p, wrong_dtype, &res), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("cpu: @f: argument 0 is f32[2], the parameter is i32[2]"));
  kiln_tensor *wrong_shape[2] = {ok[0], i32({3}, {1, 2, 3})};
  EXPECT_EQ(cpu_run(p, wrong_shape, &res), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("argument 1 is i32[3], the parameter is i32[2]"));
  kiln_tensor *null_arg[2] = {nullptr, ok[1]};
  EXPECT_EQ(cpu_run(p, null_arg, &res), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("argument 0 is NULL"));
  EXPECT_EQ(cpu_run(p, nullptr, &res), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("args or results is NULL"));
  EXPECT_EQ(cpu_run(nullptr, ok, &res), -1);
  EXPECT_EQ(res, nullptr);
  // integer division by zero fails the call, as the eager op does
  kiln_tensor *zero[2] = {ok[0], i32({2}, {1, 0})};
  EXPECT_EQ(cpu_run(p, zero, &res), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("div: integer division by zero"));
  EXPECT_EQ(res, nullptr);
  ASSERT_EQ(cpu_run(p, ok, &res), 0) << kiln_last_error();
  EXPECT_EQ(read<int32_t>(res), (std::vector<int32_t>{3, 3}));
  cpu_program_free(p);
  ir_module_free(m);
  EXPECT_EQ(cpu_compile(nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("cpu: no function"));
  cpu_program_free(nullptr);
}

TEST(CpuBackend, IndexErrorsFailTheCall) {
  Scoped scope;
  ir_module *m = ir_parse(
      "func @f(%x: f32[3,2], %i: i64[2]) -> f32[2,2] {\n  %e = exp %x : f32[3,2]\n"
      "  %g = gather %e, %i {axis=0} : f32[2,2]\n  return %g\n}\n",
      "idx.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cpu_program *p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  kiln_tensor *args[2] = {f32({3, 2}, {0, 1, 2, 3, 4, 5}), i64({2}, {1, 7})}, *res = nullptr;
  EXPECT_EQ(cpu_run(p, args, &res), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("gather: indices[1] = 7 is not in [0, 3)"));
  EXPECT_EQ(res, nullptr);
  cpu_program_free(p);
  ir_module_free(m);
}

// Kernels that are the same code (a loop body traced twice, an unrolled
// loop's steps) are compiled once: one LLVM function called from each
// place, whatever buffers each is given (reuse.c).
TEST(CpuBackend, KernelsThatAreTheSameCodeAreCompiledOnce) {
  Scoped scope;
  ir_module *m = ir_parse(
      "func @f(%x: f32[1000], %y: f32[1000]) -> (f32[1000], f32[1000]) {\n"
      "  %a = tanh %x : f32[1000]\n  %b = tanh %a : f32[1000]\n  %c = exp %b : f32[1000]\n"
      "  %d = tanh %c : f32[1000]\n  %e = tanh %y : f32[1000]\n  %g = add %d, %e : f32[1000]\n"
      "  %h = add %b, %e : f32[1000]\n  return %g, %h\n}\n",
      "reuse.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  const int64_t n[1] = {1000};
  std::vector<kiln_tensor *> args = {kiln_random_uniform(KILN_F32, 1, n, -2, 2),
                                     kiln_random_uniform(KILN_F32, 1, n, -2, 2)};
  for (int parts = 1; parts <= 2; parts++) {
    cpu_options o{};
    o.parts = parts;
    EXPECT_TRUE(same_as_interpreter(m->funcs[0], args, Tol{0, 1e-5}, "reuse", nullptr, &o)) << parts;
    cpu_program *p = cpu_compile_with(m->funcs[0], &o);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    EXPECT_EQ(cpu_program_kernels(p), 7);
    char *ll = cpu_program_text(p, "llvm");
    ASSERT_NE(ll, nullptr) << kiln_last_error();
    // The four tanh kernels are one function, called four times (and kept
    // out of line); the two adds one more; exp, used once, is inlined.
    int defs = 0;
    for (const char *at = ll; (at = strstr(at, "define ")); at++) {
      const char *eol = strchr(at, '\n');
      std::string line(at, eol ? eol : at + strlen(at));
      if (line.find("@kernel") != std::string::npos && line.find(".task") == std::string::npos) defs++;
    }
    if (parts == 1) {
      EXPECT_EQ(defs, 2) << ll;
    }
    free(ll);
    cpu_program_free(p);
  }
  ir_module_free(m);
}

// A kernel the buffers pass puts exactly over an input that dies in it,
// reading that input only at the element it stores, keeps noalias on both
// (kernel.c's exactly_in_place): its vectorized loop runs without the
// vectorizer's overlap check, which sent an exact overlap to the scalar
// loop. Here tanh(a - colsum(a)) over the product a, as a batch norm's
// gradient over the dying dy.
int in_place_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *a = kiln_matmul(in[0], in[1]);
  const int axis[1] = {0};
  kiln_tensor *d = kiln_tanh(kiln_sub(a, kiln_reduce_sum(a, 1, axis, true)));
  out[0] = kiln_matmul(d, in[1]);
  return out[0] ? 0 : -1;
}

TEST(CpuBackend, KernelsExactlyInPlaceAreVectorizedWithoutAnOverlapCheck) {
  Scoped scope;
  kiln_function *f = kiln_function_new("in_place", in_place_body, nullptr, 2, 1);
  ASSERT_NE(f, nullptr);
  kiln_tensor *in[2] = {kiln_random_uniform(KILN_F32, 2, (const int64_t[]){512, 512}, -1, 1),
                        kiln_random_uniform(KILN_F32, 2, (const int64_t[]){512, 512}, -1, 1)};
  kiln_tensor *y = nullptr, *want = nullptr;
  ASSERT_EQ(kiln_function_call(f, in, &y), 0) << kiln_last_error();
  ASSERT_EQ(in_place_body(nullptr, 2, in, 1, &want), 0) << kiln_last_error();
  EXPECT_TRUE(allclose(y, want, 1e-4, 1e-4));
  char *ll = kiln_function_ir(f, 0, "llvm");
  ASSERT_NE(ll, nullptr) << kiln_last_error();
  EXPECT_THAT(ll, HasSubstr("x float>"));
  EXPECT_EQ(strstr(ll, "diff.check"), nullptr) << ll;
  EXPECT_EQ(strstr(ll, "memcheck"), nullptr) << ll;
  free(ll);
  kiln_function_free(f);
}

// ---- text ----

TEST(CpuBackend, TextStages) {
  Scoped scope;
  ir_module *m = ir_parse(
      "func @f(%x: f32[1000], %y: f32[1000]) -> f32[1000] {\n  %a = add %x, %y : f32[1000]\n"
      "  %e = exp %a : f32[1000]\n  return %e\n}\n",
      "text.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cpu_program *p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_EQ(cpu_program_kernels(p), 2);
  EXPECT_GT(cpu_program_compile_ms(p), 0);
  char *ll = cpu_program_text(p, "llvm");
  ASSERT_NE(ll, nullptr) << kiln_last_error();
  EXPECT_THAT(ll, HasSubstr("define"));
  EXPECT_THAT(ll, HasSubstr("x float>"));  // vectorized
  free(ll);
  char *as = cpu_program_text(p, "asm");
  ASSERT_NE(as, nullptr) << kiln_last_error();
  EXPECT_THAT(as, HasSubstr("vfmadd"));  // the exp polynomial, in FMAs
  free(as);
  EXPECT_EQ(cpu_program_text(p, "ptx"), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("cpu: unknown stage \"ptx\""));
  cpu_program_free(p);
  ir_module_free(m);
}

// ---- compiling in two parts ----

// Four kernels (a gather that can fail among them), a transpose and a
// reduction: compiled as one module and as two, each equals the interpreter,
// an index error in either part fails the call, and the text stages show the
// whole program.
const char *kTwoPartText =
    "func @k0(%x: f32[1024,64], %b: f32[64]) -> f32[1024,64] {\n"
    "  %a = add %x, %b : f32[1024,64]\n  %t = tanh %a : f32[1024,64]\n  return %t\n}\n"
    "func @k1(%t: f32[1024,64], %i: i32[8]) -> f32[8,64] {\n"
    "  %g = gather %t, %i {axis=0} : f32[8,64]\n  %e = exp %g : f32[8,64]\n  return %e\n}\n"
    "func @f(%x: f32[1024,64], %b: f32[64], %i: i32[8]) -> (f32[1024,64], f32[8,64], f32[64,1024], f32[1024]) {\n"
    "  %t = fusion @k0(%x, %b) : f32[1024,64]\n"
    "  %g = fusion @k1(%t, %i) : f32[8,64]\n"
    "  %tr = transpose %t {perm=[1,0]} : f32[64,1024]\n"
    "  %s = reduce_sum %t {axes=[1]} : f32[1024]\n"
    "  return %t, %g, %tr, %s\n}\n";

TEST(CpuBackend, ProgramsCompiledInTwoPartsMatchTheInterpreter) {
  Scoped scope;
  std::mt19937 rng(7);
  ir_module *m = ir_parse(kTwoPartText, "parts.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  const ir_func *f = ir_module_find(m, "f");
  std::vector<kiln_tensor *> args = {random_tensor(rng, KILN_F32, {1024, 64}), random_tensor(rng, KILN_F32, {64}),
                                     i32({8}, {0, 1023, 3, 17, 128, 1, 700, 9})};
  std::vector<kiln_tensor *> bad = args;
  bad[2] = i32({8}, {0, 1, 2, 3, 4, 5, 1024, 7});
  for (int parts : {1, 2}) {
    cpu_options o{};
    o.parts = parts;
    const std::string what = std::to_string(parts) + " part(s)";
    int kernels = 0;
    EXPECT_TRUE(same_as_interpreter(f, args, Tol{4, 1e-5, 1e-5}, what, &kernels, &o));
    EXPECT_GE(kernels, 4) << what;
    EXPECT_TRUE(same_as_interpreter(f, bad, Tol{4, 1e-5, 1e-5}, what + ", index out of range", nullptr, &o));
    cpu_program *p = cpu_compile_with(f, &o);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    EXPECT_EQ(cpu_program_parts(p), parts);
    kiln_tensor *out[4];
    EXPECT_EQ(cpu_run(p, bad.data(), out), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("gather: indices[6] = 1024 is not in [0, 1024)")) << what;
    // the text shows both parts as one module: the entry, and the kernels
    // the second part exported to it
    char *ll = cpu_program_text(p, "llvm");
    ASSERT_NE(ll, nullptr) << kiln_last_error();
    const std::string text = ll;
    free(ll);
    EXPECT_NE(text.find(" @kiln_entry("), std::string::npos) << what;
    EXPECT_EQ(text.find("define dso_local void @kernel") != std::string::npos, parts == 2) << what;
    char *as = cpu_program_text(p, "asm");
    ASSERT_NE(as, nullptr) << kiln_last_error();
    EXPECT_NE(std::string(as).find("kiln_entry:"), std::string::npos) << what;
    free(as);
    cpu_program_free(p);
  }
  ir_module_free(m);
}

// cpu_compile's own choice: a program with a large kernel is compiled in
// two parts when there are two threads to compile it; a program of small
// kernels in one (its kernels stay inlinable into the entry).
TEST(CpuBackend, BigProgramsCompileInTwoPartsByDefault) {
  Scoped scope;
  // twelve kernels of vector math, no two the same code (reuse.c would
  // compile a repeated one once): six ops over two sizes
  std::string big = "func @f(%x: f32[1024,64], %y: f32[1000,64]) -> (f32[1024,64], f32[1000,64]) {\n";
  const char *ops[] = {"sin", "exp", "cos", "tanh", "sigmoid", "log1p"};
  for (int k = 0; k < 12; k++) {
    std::string ty = k < 6 ? "f32[1024,64]" : "f32[1000,64]";
    std::string from = k == 0 ? "%x" : k == 6 ? "%y" : "%v" + std::to_string(k - 1);
    big += "  %v" + std::to_string(k) + " = " + ops[k % 6] + " " + from + " : " + ty + "\n";
  }
  big += "  return %v5, %v11\n}\n";
  ir_module *m = ir_parse(big.c_str(), "big.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cpu_program *p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_GE(cpu_program_kernels(p), 12);
  EXPECT_EQ(cpu_program_parts(p), kiln_num_threads() >= 2 ? 2 : 1);
  cpu_program_free(p);
  ir_module_free(m);
  m = ir_parse(
      "func @f(%x: f32[16], %y: f32[16]) -> (f32[16], f32[16,16]) {\n  %a = add %x, %y : f32[16]\n"
      "  %e = exp %a : f32[16]\n  %o = broadcast %e {shape=[16,16]} : f32[16,16]\n"
      "  %t = transpose %o {perm=[1,0]} : f32[16,16]\n  return %e, %t\n}\n",
      "small.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  p = cpu_compile(m->funcs[0]);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_EQ(cpu_program_parts(p), 1);
  cpu_program_free(p);
  ir_module_free(m);
}

// A product by a transposed matrix with a few rows on the left reads the
// matrix in place (matmul_nt): no transpose kernel runs. A transpose that
// something else reads too, or a product with more rows, keeps it.
TEST(CpuBackend, ProductsByATransposeReadTheMatrixInPlace) {
  Scoped scope;
  std::mt19937 rng(9);
  struct Case {
    int64_t m;
    bool transpose_returned;
    int kernels;
  };
  for (Case c : {Case{1, false, 0}, Case{4, false, 0}, Case{5, false, 1}, Case{2, true, 1}, Case{64, false, -1}})
    for (const char *dt : {"f32", "f64", "i32"}) {
      const std::string m = std::to_string(c.m), t = dt;
      std::string text = "func @f(%a: " + t + "[" + m + ",40], %w: " + t + "[33,40]) -> (" + t + "[" + m + ",33]" +
                         (c.transpose_returned ? ", " + t + "[40,33]" : std::string()) + ") {\n" +
                         "  %t = transpose %w {perm=[1,0]} : " + t + "[40,33]\n" + "  %d = dot %a, %t : " + t +
                         "[" + m + ",33]\n" + "  return %d" + (c.transpose_returned ? ", %t" : "") + "\n}\n";
      ir_module *mo = ir_parse(text.c_str(), "nt.kir");
      ASSERT_NE(mo, nullptr) << kiln_last_error() << "\n" << text;
      kiln_dtype d = t == "f32" ? KILN_F32 : t == "f64" ? KILN_F64 : KILN_I32;
      std::vector<kiln_tensor *> args = {random_tensor(rng, d, {c.m, 40}), random_tensor(rng, d, {33, 40})};
      int kernels = -1;
      EXPECT_TRUE(same_as_interpreter(mo->funcs[0], args, Tol{0, 1e-5, 1e-5}, text, &kernels));
      // a product that packs reads the transposed operand as it lies, in floats
      EXPECT_EQ(kernels, c.kernels >= 0 ? c.kernels : t == "i32" ? 1 : 0) << text;
      ir_module_free(mo);
    }
}

// The packing reads either operand of a packed float product as it lies:
// transposes feeding a top-level dot, or the parameters of a fusion whose
// dot runs before its kernel (the batch's weight gradient x^T . dy of a
// training step), are never made.
TEST(CpuBackend, PackedProductsReadTransposedOperandsInPlace) {
  Scoped scope;
  std::mt19937 rng(10);
  const char *texts[] = {
      // x^T . w^T at the top level: no kernel at all
      "func @f(%x: f32[70,64], %w: f32[48,70]) -> f32[64,48] {\n"
      "  %xt = transpose %x {perm=[1,0]} : f32[64,70]\n"
      "  %wt = transpose %w {perm=[1,0]} : f32[70,48]\n"
      "  %d = dot %xt, %wt : f32[64,48]\n"
      "  return %d\n}\n",
      // an SGD step's fused weight update: x^T . dy, scaled, from w; one kernel
      "func @k(%xt: f32[70,64], %dy: f32[64,48], %lr: f32[], %w: f32[70,48]) -> f32[70,48] {\n"
      "  %g = dot %xt, %dy : f32[70,48]\n"
      "  %s = mul %g, %lr : f32[70,48]\n"
      "  %n = sub %w, %s : f32[70,48]\n"
      "  return %n\n}\n"
      "func @f(%x: f32[64,70], %dy: f32[64,48], %lr: f32[], %w: f32[70,48]) -> f32[70,48] {\n"
      "  %xt = transpose %x {perm=[1,0]} : f32[70,64]\n"
      "  %n = fusion @k(%xt, %dy, %lr, %w) : f32[70,48]\n"
      "  return %n\n}\n",
      // the same transpose read twice: made once, as before
      "func @f(%x: f64[64,70], %w: f64[64,48]) -> (f64[70,48], f64[70,64]) {\n"
      "  %xt = transpose %x {perm=[1,0]} : f64[70,64]\n"
      "  %d = dot %xt, %w : f64[70,48]\n"
      "  return %d, %xt\n}\n",
  };
  const int kernels_want[] = {0, 1, 1};
  for (int i = 0; i < 3; i++) {
    ir_module *m = ir_parse(texts[i], "trans.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << texts[i];
    const ir_func *f = ir_module_find(m, "f");
    std::vector<kiln_tensor *> args;
    for (int p = 0; p < f->n_params; p++) {
      const op_type &ty = f->types[p];
      args.push_back(random_tensor(rng, ty.dtype, V64(ty.shape, ty.shape + ty.rank)));
    }
    int kernels = -1;
    EXPECT_TRUE(same_as_interpreter(f, args, Tol{0, 1e-5, 1e-5}, texts[i], &kernels));
    EXPECT_EQ(kernels, kernels_want[i]) << texts[i];
    ir_module_free(m);
  }
}

#ifdef KILN_TEST_HAVE_IR_GEN
// ---- random programs ----

// Programs over integers and bools: compiled == interpreted, bit for bit.
TEST(CpuBackend, RandomIntegerProgramsMatchExactly) {
  Scoped scope;
  ir_gen_options o = ir_gen_default_options();
  o.dtypes = DT_BIT(KILN_I32) | DT_BIT(KILN_I64) | DT_BIT(KILN_BOOL);
  int n = program_count();
  for (uint64_t s = first_seed(); s < first_seed() + (uint64_t)n; s++) {
    ir_module *m = ir_gen_program(s, &o);
    ASSERT_NE(m, nullptr) << "seed " << s << ": " << kiln_last_error();
    kiln_scope_push();
    std::vector<kiln_tensor *> args(m->funcs[0]->n_params);
    ASSERT_EQ(ir_gen_args(m->funcs[0], s, args.data()), 0) << kiln_last_error();
    char *text = ir_print_module(m);
    cpu_options parts{};
    parts.parts = s % 2 ? 2 : 0;  // every other program compiled as two modules on two threads
    bool ok = same_as_interpreter(
        m->funcs[0], args, Tol{},
        "seed " + std::to_string(s) + " (KILN_RANDOM_SEED=" + std::to_string(s) + " KILN_RANDOM_PROGRAMS=1)\n" + text,
        nullptr, &parts);
    free(text);
    kiln_scope_pop();
    ir_module_free(m);
    if (!ok) break;
  }
}

// What a value of a float program can be checked for: computed exactly as
// the interpreter does, close to it (continuous functions of values the
// compiled code rounds differently), or neither (a compare, floor, sign,
// mod, conversion to integers or argmax of such a value may jump).
enum { EXACT, CLOSE, UNCHECKED };

bool inexact_source(const ir_func *f, const ir_instr &in) {
  kiln_dtype dt = in.n_in ? f->types[in.in[0]].dtype : KILN_I32;
  if (!is_float(dt)) return false;
  switch (in.op) {
    case OP_SIN:
    case OP_COS:
    case OP_LOG1P:
    case OP_POW:
    case OP_REDUCE_SUM:  // in another order
    case OP_REDUCE_PROD: return true;
    case OP_EXP:
    case OP_LOG:
    case OP_TANH:
    case OP_SIGMOID: return dt == KILN_F64;  // libm's there; f32 is the eager kernels' own
    default: return false;
  }
}

bool jumps(const ir_func *f, const ir_instr &in) {
  switch (in.op) {
    case OP_FLOOR:
    case OP_CEIL:
    case OP_SIGN:
    case OP_MOD:
    case OP_ARGMAX:
    case OP_EQ:
    case OP_NE:
    case OP_LT:
    case OP_LE:
    case OP_GT:
    case OP_GE: return true;
    case OP_CONVERT:
      return !is_float(f->types[in.out].dtype) && f->types[in.out].dtype != KILN_F16 &&
             f->types[in.out].dtype != KILN_BF16;
    default: return false;
  }
}

std::vector<int> checkability(const ir_func *f) {
  std::vector<int> st((size_t)f->n_values, EXACT);
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr &in = f->instrs[i];
    int s = EXACT;
    for (int k = 0; k < in.n_in; k++) s = std::max(s, st[(size_t)in.in[k]]);
    if (s == CLOSE && jumps(f, in)) s = UNCHECKED;
    if (inexact_source(f, in)) s = std::max(s, (int)CLOSE);
    for (int k = 0; k < in.n_out; k++) st[(size_t)in.out + k] = s;
  }
  return st;
}

// Float programs (and their integer parts), compiled without contraction:
// exact results bit for bit, close ones within a relative 1e-3 (f32) or
// 1e-9 (f64) of the result's scale.
TEST(CpuBackend, RandomFloatProgramsMatch) {
  Scoped scope;
  ir_gen_options o = ir_gen_default_options();
  cpu_options strict{};
  strict.no_contract = true;
  int n = program_count(), exact = 0, close = 0, unchecked = 0;
  for (uint64_t s = first_seed(); s < first_seed() + (uint64_t)n; s++) {
    ir_module *m = ir_gen_program(s + 1000000, &o);
    ASSERT_NE(m, nullptr) << "seed " << s << ": " << kiln_last_error();
    const ir_func *f = m->funcs[0];
    char *text = ir_print_module(m);
    std::string what =
        "seed " + std::to_string(s) + " (KILN_RANDOM_SEED=" + std::to_string(s) + " KILN_RANDOM_PROGRAMS=1)\n" + text;
    free(text);
    kiln_scope_push();
    std::vector<kiln_tensor *> args(f->n_params), want(f->n_results), got(f->n_results);
    ASSERT_EQ(ir_gen_args(f, s, args.data()), 0) << kiln_last_error();
    ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << what << kiln_last_error();
    strict.parts = s % 2 ? 0 : 2;  // every other program compiled as two modules on two threads
    cpu_program *p = cpu_compile_with(f, &strict);
    ASSERT_NE(p, nullptr) << what << kiln_last_error();
    ASSERT_EQ(cpu_run(p, args.data(), got.data()), 0) << what << kiln_last_error();
    cpu_program_free(p);
    std::vector<int> st = checkability(f);
    bool ok = true;
    for (int r = 0; r < f->n_results && ok; r++) {
      int c = st[(size_t)f->results[r]];
      Tol tol;
      if (c == UNCHECKED) {
        unchecked++;
        EXPECT_EQ(shape_of(want[r]), shape_of(got[r])) << what;
        continue;
      }
      if (c == CLOSE) {
        close++;
        double scale = 0;
        if (is_float(kiln_tensor_dtype(want[r])))
          for (double v : values(want[r]))
            if (std::isfinite(v)) scale = std::max(scale, std::fabs(v));
        tol.rel = kiln_tensor_dtype(want[r]) == KILN_F32 ? 1e-3 : 1e-9;
        tol.abs = tol.rel * (scale + 1);
        tol.zero_sign = true;
      } else {
        exact++;
      }
      std::string mm = mismatch(want[r], got[r], tol);
      EXPECT_EQ(mm, "") << what << " result " << r << (c == CLOSE ? " (close)" : " (exact)");
      ok = mm.empty();
    }
    kiln_scope_pop();
    ir_module_free(m);
    if (!ok) break;
  }
  std::printf("  %d results bit-exact, %d close, %d not checkable\n", exact, close, unchecked);
  EXPECT_GT(exact, n / 2);
}
#endif

// ---- compile time: DAGs of shared values (issue 14) ----
// A fused chain whose values are each read two or three times has 2^n (3^n)
// paths: the emitter once expanded them as a tree (20 Newton steps compiled
// in 0.2 s, 30 in 23 s, 12 steps with a select did not finish in a minute).
// These check values only (never timings): each chain equals the
// interpreter, bit for bit without FMA contraction, as one kernel.

ir_value chain_op(ir_func *f, op_id op, std::vector<ir_value> in, const op_attrs *a = nullptr) {
  op_attrs none{};
  ir_value r = ir_append(f, op, a ? a : &none, (int)in.size(), in.data(), ir_loc{"chain.c", 1});
  EXPECT_GE(r, 0) << ir_op_info(op)->name << ": " << kiln_last_error();
  return r;
}

enum class Chain { Newton, Select, Pairs };

// steps of a chain over x and a (parameters 0 and 1 of f), appended to f;
// the last value. Newton: x = 0.5 * (x + a / x). Select: then x =
// select(y > x, x, y). Pairs: x' = select(x * w > a, x - w * 0.5, x * 0.75 +
// w), w' = x (each value read by the next two steps, 5 ops a step).
// transpose_every > 0 (x square): x = x + transpose(x) * 0.001 that often,
// so shared values are also read at a second, transposed index.
ir_value append_chain(ir_func *f, Chain kind, int steps, int transpose_every = 0) {
  ir_value x = 0, a = 1, w = 1;
  // scalars of the caller's scope (the IR retains its constants)
  kiln_tensor *half = kiln_scalar(KILN_F32, 0.5), *three_q = kiln_scalar(KILN_F32, 0.75),
              *small = kiln_scalar(KILN_F32, 0.001);
  ir_value h = ir_constant(f, half, ir_loc{"chain.c", 1});
  for (int s = 0; s < steps; s++) {
    if (kind == Chain::Pairs) {
      ir_value gt = chain_op(f, OP_GT, {chain_op(f, OP_MUL, {x, w}), a});
      ir_value lo = chain_op(f, OP_SUB, {x, chain_op(f, OP_MUL, {w, h})});
      ir_value hi = chain_op(f, OP_ADD, {chain_op(f, OP_MUL, {x, ir_constant(f, three_q, ir_loc{"chain.c", 1})}), w});
      ir_value nx = chain_op(f, OP_SELECT, {gt, lo, hi});
      w = x;
      x = nx;
    } else {
      ir_value y = chain_op(f, OP_MUL, {h, chain_op(f, OP_ADD, {x, chain_op(f, OP_DIV, {a, x})})});
      x = kind == Chain::Select ? chain_op(f, OP_SELECT, {chain_op(f, OP_GT, {y, x}), x, y}) : y;
    }
    if (transpose_every > 0 && (s + 1) % transpose_every == 0) {
      op_attrs perm{};
      perm.naxes = 2;
      perm.axes[0] = 1, perm.axes[1] = 0;
      ir_value t = chain_op(f, OP_TRANSPOSE, {x}, &perm);
      x = chain_op(f, OP_ADD, {x, chain_op(f, OP_MUL, {t, ir_constant(f, small, ir_loc{"chain.c", 1})})});
    }
  }
  return x;
}

// @f(x, a) -> the chain, as one fusion @k (fused) or inline
ir_func *chain_function(ir_module *m, Chain kind, int steps, const op_type &t, bool fused = true,
                        int transpose_every = 0) {
  op_type ts[2] = {t, t};
  ir_func *f = ir_func_new(m, "f", 2, ts);
  if (!f) return nullptr;
  ir_value r;
  if (fused) {
    ir_func *k = ir_func_new(m, "k", 2, ts);
    if (!k) return nullptr;
    ir_value kr = append_chain(k, kind, steps, transpose_every);
    if (ir_set_results(k, 1, &kr)) return nullptr;
    op_attrs a{};
    a.callee = k;
    r = chain_op(f, OP_FUSION, {0, 1}, &a);
  } else {
    r = append_chain(f, kind, steps, transpose_every);
  }
  return ir_set_results(f, 1, &r) ? nullptr : f;
}

// x in [1, 100), a in [2, 14): the Newton chain stays finite
std::vector<kiln_tensor *> chain_args(const op_type &t) {
  int64_t n = 1;
  for (int d = 0; d < t.rank; d++) n *= t.shape[d];
  std::vector<float> x((size_t)n), a((size_t)n);
  for (int64_t i = 0; i < n; i++) x[(size_t)i] = 1.0f + (float)(i % 97), a[(size_t)i] = 2.0f + (float)(i % 13);
  V64 shape(t.shape, t.shape + t.rank);
  return {f32(shape, x), f32(shape, a)};
}

TEST(CpuBackend, FusedChainsOfSharedValuesMatchTheInterpreter) {
  Scoped scope;
  op_type t{KILN_F32, 1, {1000}};
  cpu_options strict{};
  strict.no_contract = true;  // then every op rounds as the interpreter's: bit for bit
  for (Chain kind : {Chain::Newton, Chain::Select}) {
    for (int steps : {20, 30, 200}) {
      ir_module *m = ir_module_new();
      ir_func *f = chain_function(m, kind, steps, t);
      ASSERT_NE(f, nullptr) << kiln_last_error();
      std::string what = std::string(kind == Chain::Newton ? "newton" : "select") + " chain of " +
                         std::to_string(steps) + " steps";
      int kernels = 0;
      EXPECT_TRUE(same_as_interpreter(f, chain_args(t), Tol{}, what, &kernels, &strict));
      EXPECT_EQ(kernels, 1) << what;
      // with contraction (the default): FMAs round differently, within a few ulp
      EXPECT_TRUE(same_as_interpreter(f, chain_args(t), Tol{0, 1e-5, 1e-5}, what + ", contracted"));
      ir_module_free(m);
    }
  }
}

// The same chains as plain instructions: the fusion pass makes them one
// kernel (without sorting the kernel at every merge), which compiles.
TEST(CpuBackend, ChainsTheFusionPassGroupsMatchTheInterpreter) {
  Scoped scope;
  op_type t{KILN_F32, 1, {1000}};
  cpu_options strict{};
  strict.no_contract = true;
  for (Chain kind : {Chain::Newton, Chain::Select}) {
    ir_module *m = ir_module_new();
    ir_func *f = chain_function(m, kind, 200, t, false);
    ASSERT_NE(f, nullptr) << kiln_last_error();
    ASSERT_EQ(kiln_pass_fuse(f), 0) << kiln_last_error();
    int fusions = 0;
    for (int i = 0; i < f->n_instrs; i++) fusions += f->instrs[i].op == OP_FUSION;
    EXPECT_EQ(fusions, 1);
    int kernels = 0;
    EXPECT_TRUE(same_as_interpreter(f, chain_args(t), Tol{}, "fused by the pass", &kernels, &strict));
    EXPECT_EQ(kernels, 1);
    ir_module_free(m);
  }
}

// 2,000 ops and more in one kernel, each value read by the next two steps,
// over a matrix that is read transposed now and then (a second index per
// shared value, and the multi-index path): compiles (it never finished
// before) and equals the interpreter.
TEST(CpuBackend, TwoThousandOpSharedDagCompiles) {
  Scoped scope;
  op_type t{KILN_F32, 2, {24, 24}};
  cpu_options strict{};
  strict.no_contract = true;
  ir_module *m = ir_module_new();
  ir_func *f = chain_function(m, Chain::Pairs, 400, t, true, 50);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  const ir_func *k = f->instrs[f->n_instrs - 1].attrs.callee;
  ASSERT_NE(k, nullptr);
  EXPECT_GE(k->n_instrs, 2000);
  int kernels = 0;
  EXPECT_TRUE(same_as_interpreter(f, chain_args(t), Tol{}, "2,000-op DAG", &kernels, &strict));
  EXPECT_EQ(kernels, 1);
  ir_module_free(m);
}

// A chain of 10,000 ops in one kernel is emitted without recursion: it
// compiles on a thread whose stack would not hold 10,000 nested calls of
// the element emitter (1 MiB), and equals the interpreter.
TEST(CpuBackend, TenThousandOpChainCompilesOnASmallStack) {
  Scoped scope;
  op_type t{KILN_F32, 1, {64}};
  ir_module *m = ir_module_new();
  ir_func *f = chain_function(m, Chain::Newton, 3400, t);  // 3 ops a step
  ASSERT_NE(f, nullptr) << kiln_last_error();
  cpu_options strict{};
  strict.no_contract = true;
  struct Job {
    ir_func *f;
    cpu_options *opt;
    cpu_program *p;
    std::string err;
  } job{f, &strict, nullptr, ""};
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 1 << 20);
  pthread_t th;
  auto body = [](void *arg) -> void * {
    Job *j = (Job *)arg;
    j->p = cpu_compile_with(j->f, j->opt);
    if (!j->p) j->err = kiln_last_error();
    return nullptr;
  };
  ASSERT_EQ(pthread_create(&th, &attr, body, &job), 0);
  pthread_join(th, nullptr);
  pthread_attr_destroy(&attr);
  ASSERT_NE(job.p, nullptr) << job.err;
  std::vector<kiln_tensor *> args = chain_args(t), want(1), got(1);
  ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << kiln_last_error();
  ASSERT_EQ(cpu_run(job.p, args.data(), got.data()), 0) << kiln_last_error();
  EXPECT_EQ(mismatch(want[0], got[0]), "");
  cpu_program_free(job.p);
  ir_module_free(m);
}

}  // namespace

// A function @s of plain ops, fused by the pass, and the fusions it must
// become: it equals the interpreter and compiles to `kernels` kernels.
struct FusedCase {
  const char *text;
  std::vector<kiln_tensor *> args;
  int kernels;
  Tol tol;
};

void check_fused(const FusedCase &c, int fusions) {
  ir_module *m = ir_parse(c.text, "fused.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *f = ir_module_find(m, "s");
  ASSERT_EQ(kiln_pass_fuse(f), 0) << kiln_last_error();
  if (fusions >= 0) {
    int n = 0;
    for (int i = 0; i < f->n_instrs; i++) n += f->instrs[i].op == OP_FUSION;
    EXPECT_EQ(n, fusions) << c.text;
  }
  int kernels = 0;
  EXPECT_TRUE(same_as_interpreter(f, c.args, c.tol, c.text, &kernels));
  EXPECT_EQ(kernels, c.kernels) << c.text;
  ir_module_free(m);
}

// A column reduction too narrow to share among the threads (a [C] result
// over N x H x W rows, C <= 768) is split (kernel.c's column_parts): a
// first pass of partials per part of the rows, a second adding them in part
// order; two kernels where there was one. Sums with their producers fused
// (a batch norm's statistics), max and min, integers, a last tile of 44
// columns, and reductions that are not split (inner axes only; a short
// one) all equal the interpreter.
TEST(CpuBackend, NarrowColumnReductionsAreSplitIntoParts) {
  Scoped scope;
  std::mt19937 rng(41);
  const FusedCase cases[] = {
      {"func @s(%x: f32[8,56,56,64], %m: f32[1,1,1,64]) -> (f32[1,1,1,64], f32[64]) {\n"
       "  %a = reduce_sum %x {axes=[0,1,2], keepdims=true} : f32[1,1,1,64]\n"
       "  %d = sub %x, %m : f32[8,56,56,64]\n"
       "  %q = mul %d, %d : f32[8,56,56,64]\n"
       "  %v = reduce_sum %q {axes=[0,1,2], keepdims=false} : f32[64]\n"
       "  return %a, %v\n}\n",
       {random_tensor(rng, KILN_F32, {8, 56, 56, 64}), random_tensor(rng, KILN_F32, {1, 1, 1, 64})},
       4,
       Tol{0, 1e-5, 0}},
      {"func @s(%x: f64[6,30,30,24]) -> (f64[24], f64[24]) {\n"
       "  %a = reduce_max %x {axes=[0,1,2], keepdims=false} : f64[24]\n"
       "  %b = reduce_min %x {axes=[0,1,2], keepdims=false} : f64[24]\n"
       "  return %a, %b\n}\n",
       {random_tensor(rng, KILN_F64, {6, 30, 30, 24})},
       2,
       Tol{0, 0, 0, true}},
      {"func @s(%x: i64[4,200,100]) -> i64[100] {\n"
       "  %a = reduce_sum %x {axes=[0,1], keepdims=false} : i64[100]\n"
       "  return %a\n}\n",
       {random_tensor(rng, KILN_I64, {4, 200, 100})},
       2,
       Tol{}},
      {"func @s(%x: f32[2,40,40,300]) -> f32[300] {\n"
       "  %a = reduce_sum %x {axes=[0,1,2], keepdims=false} : f32[300]\n"
       "  return %a\n}\n",
       {random_tensor(rng, KILN_F32, {2, 40, 40, 300})},
       2,
       Tol{0, 1e-5, 0}},
      {"func @s(%x: f32[8,56,56,64]) -> f32[8,1,1,64] {\n"
       "  %a = reduce_sum %x {axes=[1,2], keepdims=true} : f32[8,1,1,64]\n"
       "  return %a\n}\n",
       {random_tensor(rng, KILN_F32, {8, 56, 56, 64})},
       1,
       Tol{0, 1e-5, 0}},
      {"func @s(%x: f32[30,64]) -> f32[64] {\n"
       "  %a = reduce_sum %x {axes=[0], keepdims=false} : f32[64]\n"
       "  return %a\n}\n",
       {random_tensor(rng, KILN_F32, {30, 64})},
       1,
       Tol{0, 1e-6, 0}},
  };
  for (const FusedCase &c : cases) check_fused(c, -1);
}

// A fusion of reductions that also returns elementwise values of their
// input's shape (a batch norm backward: dy after relu beside its two sums)
// is one kernel that stores those values as it reads each element. Before,
// the backend ran such a body op by op (ten kernels, each a pass over
// memory). Column reductions split into parts (the first case), not split
// (1024 columns: four tiles), a row reduction and a reduction over a
// middle axis with a side output that reads a broadcast and is a mask.
TEST(CpuBackend, ReductionKernelsStoreTheirSideOutputs) {
  Scoped scope;
  std::mt19937 rng(43);
  const FusedCase cases[] = {
      {"func @s(%x: f32[8,28,28,128], %m: f32[1,1,1,128], %r: f32[128], %w: f32[128], %b: f32[128], %z: f32[],"
       " %dy: f32[8,28,28,128]) -> (f32[8,28,28,128], f32[1,1,1,128], f32[1,1,1,128]) {\n"
       "  %5 = sub %x, %m : f32[8,28,28,128]\n"
       "  %6 = mul %5, %r : f32[8,28,28,128]\n"
       "  %7 = mul %6, %w : f32[8,28,28,128]\n"
       "  %8 = add %7, %b : f32[8,28,28,128]\n"
       "  %9 = gt %8, %z : bool[8,28,28,128]\n"
       "  %10 = select %9, %dy, %z : f32[8,28,28,128]\n"
       "  %11 = reduce_sum %10 {axes=[0,1,2], keepdims=true} : f32[1,1,1,128]\n"
       "  %12 = mul %10, %5 : f32[8,28,28,128]\n"
       "  %13 = reduce_sum %12 {axes=[0,1,2], keepdims=true} : f32[1,1,1,128]\n"
       "  return %10, %11, %13\n}\n",
       {random_tensor(rng, KILN_F32, {8, 28, 28, 128}), random_tensor(rng, KILN_F32, {1, 1, 1, 128}),
        random_tensor(rng, KILN_F32, {128}), random_tensor(rng, KILN_F32, {128}), random_tensor(rng, KILN_F32, {128}),
        random_tensor(rng, KILN_F32, {}), random_tensor(rng, KILN_F32, {8, 28, 28, 128})},
       2,  // the parts' pass (storing the side output) and the pass that adds the parts
       Tol{0, 1e-5, 1e-4}},
      {"func @s(%a: f32[2,7,7,1024], %b: f32[2,7,7,1024]) -> (f32[1024], f32[2,7,7,1024], f32[1024]) {\n"
       "  %s = add %a, %b : f32[2,7,7,1024]\n"
       "  %t = tanh %s : f32[2,7,7,1024]\n"
       "  %u = reduce_sum %s {axes=[0,1,2], keepdims=false} : f32[1024]\n"
       "  %v = reduce_max %t {axes=[0,1,2], keepdims=false} : f32[1024]\n"
       "  return %u, %t, %v\n}\n",
       {random_tensor(rng, KILN_F32, {2, 7, 7, 1024}), random_tensor(rng, KILN_F32, {2, 7, 7, 1024})},
       1,
       Tol{4, 1e-5, 1e-5}},
      {"func @s(%x: f64[64,1000], %c: f64[]) -> (f64[64,1000], f64[64,1]) {\n"
       "  %e = exp %x : f64[64,1000]\n"
       "  %y = mul %e, %c : f64[64,1000]\n"
       "  %s = reduce_sum %y {axes=[1], keepdims=true} : f64[64,1]\n"
       "  return %y, %s\n}\n",
       {random_tensor(rng, KILN_F64, {64, 1000}), random_tensor(rng, KILN_F64, {})},
       1,
       Tol{4, 1e-12, 0}},
      {"func @s(%x: f32[6,50,40], %b: f32[6,1,40]) -> (bool[6,50,40], f32[6,40], f32[6,50,40]) {\n"
       "  %y = add %x, %b : f32[6,50,40]\n"
       "  %k = ge %y, %x : bool[6,50,40]\n"
       "  %m = reduce_min %y {axes=[1], keepdims=false} : f32[6,40]\n"
       "  %n = neg %y : f32[6,50,40]\n"
       "  return %k, %m, %n\n}\n",
       {random_tensor(rng, KILN_F32, {6, 50, 40}, -5, 5, false, true), random_tensor(rng, KILN_F32, {6, 1, 40})},
       1,
       Tol{0, 0, 0, true}},
  };
  for (const FusedCase &c : cases) check_fused(c, 1);
}
