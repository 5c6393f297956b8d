// control_compiled_test.cc — staged control flow compiled by the CPU
// backend: a scan is one loop over its body's steps, so its code does not
// grow with its length (nor its compile time much); its results match the
// interpreter's at any length; a GPU trace with control flow is refused by
// the CUDA backend with a clear error (calls then run the interpreter).
#include <gmock/gmock.h>

#include <chrono>
#include <string>

#include "cpu/cpu.h"
#include "ir.h"
#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;

namespace {

// h = tanh(h * w + x_t); y_t = 2 h (an elementwise body) over xs of (T, 8)
int step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_tanh(kiln_add(kiln_mul(in[0], in[2]), in[1]));
  out[1] = kiln_mul(out[0], kiln_scalar_like(out[0], 2));
  return out[0] && out[1] ? 0 : -1;
}

int body_rnn(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  // the carry, then w as a second carry (passed through) and xs
  kiln_tensor *init[2] = {in[0], in[2]};
  int rc = kiln_scan(
      [](void *, int, kiln_tensor *const *s, int, kiln_tensor **o) {
        kiln_tensor *a[3] = {s[0], s[2], s[1]};
        kiln_tensor *r[2];
        if (step(nullptr, 3, a, 2, r)) return -1;
        o[0] = r[0];
        o[1] = s[1];
        o[2] = r[1];
        return 0;
      },
      nullptr, 2, init, 1, &in[1], -1, false, 1, out, &out[2]);
  return rc;
}

struct Compiled {
  std::string llvm;
  double compile_ms = 0;
  kiln_tensor *out[3] = {};
};

Compiled compile_and_run(const char *backend, int64_t T) {
  EnvGuard env("KILN_BACKEND", backend);
  std::vector<float> xv((size_t)T * 8), hv(8), wv(8);
  for (size_t i = 0; i < xv.size(); i++) xv[i] = (float)std::sin(0.37 * (double)i);
  for (int i = 0; i < 8; i++) hv[i] = 0.1f * (float)i - 0.3f, wv[i] = 0.9f - 0.1f * (float)i;
  kiln_tensor *in[3] = {f32({8}, hv), f32({T, 8}, xv), f32({8}, wv)};
  kiln_function *f = kiln_function_new("rnn", body_rnn, nullptr, 3, 3);
  Compiled r;
  EXPECT_EQ(kiln_function_call(f, in, r.out), 0) << kiln_last_error();
  if (!strcmp(backend, "cpu")) {
    char *text = kiln_function_ir(f, 0, "llvm");
    EXPECT_NE(text, nullptr) << kiln_last_error();
    r.llvm = text ? text : "";
    free(text);
    kiln_stats st;
    EXPECT_EQ(kiln_function_stats(f, 0, &st), 0);
    r.compile_ms = st.compile_ms;
  }
  kiln_function_free(f);
  return r;
}

// body staged (2 inputs, 2 results) and called compiled (got[0]) and
// interpreted (got[1]); false on an error
bool on_both(kiln_body_fn body, kiln_tensor *const *in, kiln_tensor *got[2][2]) {
  const char *backends[2] = {"cpu", "interp"};
  for (int b = 0; b < 2; b++) {
    EnvGuard env("KILN_BACKEND", backends[b]);
    kiln_function *f = kiln_function_new("both", body, nullptr, 2, 2);
    int rc = kiln_function_call(f, in, got[b]);
    kiln_function_free(f);
    if (rc) return false;
  }
  return true;
}

int count(const std::string &s, const std::string &what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}

TEST(ControlCompiled, ScanIsOneLoopWhateverItsLength) {
  Scoped s;
  EnvGuard cache("KILN_CACHE_DIR", "off"); // compile times of LLVM, not of the disk cache
  Compiled short_run = compile_and_run("cpu", 10), long_run = compile_and_run("cpu", 1000);
  Compiled want = compile_and_run("interp", 1000);
  ASSERT_FALSE(short_run.llvm.empty());
  ASSERT_FALSE(long_run.llvm.empty());
  EXPECT_EQ(count(short_run.llvm, "define "), count(long_run.llvm, "define "))
      << "as many functions (kernels) at T = 1000 as at T = 10";
  // (the body here is one kernel looping over t inside, whose loops LLVM
  // may unroll or vectorize differently for another trip count)
  EXPECT_LT(long_run.llvm.size(), short_run.llvm.size() + short_run.llvm.size() / 2)
      << "the body is emitted once, not T times";
  EXPECT_THAT(long_run.llvm, HasSubstr("1000")) << "the trip count is the loop's bound";
  EXPECT_EQ(shape_of(long_run.out[2]), (V64{1000, 8}));
  for (int k = 0; k < 3; k++) EXPECT_TRUE(allclose(long_run.out[k], want.out[k], 1e-5, 1e-6)) << "result " << k;
  std::printf("  scan compile: T=10 %.2f ms, T=1000 %.2f ms; LLVM %zu vs %zu bytes\n", short_run.compile_ms,
              long_run.compile_ms, short_run.llvm.size(), long_run.llvm.size());
}

TEST(ControlCompiled, RowsOfOddSizesAndReverse) {
  // rows of 3 floats (12 bytes: not 64-byte aligned) read and written in
  // place, from the end
  Scoped s;
  auto rev = [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
    return kiln_scan(
        [](void *, int, kiln_tensor *const *s, int, kiln_tensor **o) {
          o[0] = kiln_add(s[0], s[1]);
          o[1] = kiln_mul(o[0], s[1]);
          return o[1] ? 0 : -1;
        },
        nullptr, 1, &in[0], 1, &in[1], -1, true, 1, &out[0], &out[1]);
  };
  std::vector<float> xv(7 * 3);
  for (size_t i = 0; i < xv.size(); i++) xv[i] = (float)i * 0.25f - 1.0f;
  kiln_tensor *in[2] = {f32({3}, {1, 2, 3}), f32({7, 3}, xv)};
  kiln_tensor *got[2][2] = {};
  ASSERT_TRUE(on_both(rev, in, got)) << kiln_last_error();
  for (int k = 0; k < 2; k++) EXPECT_TRUE(allclose(got[0][k], got[1][k], 0, 0)) << "result " << k;
  // the last row is the first step: ys[6] = (c0 + x6) * x6
  std::vector<double> y = values(got[0][1]);
  EXPECT_FLOAT_EQ((float)y[18], (1 + xv[18]) * xv[18]);
}

TEST(ControlCompiled, WhileSwappingItsStateMatchesTheInterpreter) {
  // (a, b, n) -> (b, a + b, n + 1) while n < 9: the body's results are
  // other state values (a swap): no copy back may clobber one still to be read
  Scoped s;
  auto fib = [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
    kiln_tensor *init[3] = {in[0], in[1], kiln_scalar(KILN_I64, 0)}, *fin[3];
    int rc = kiln_while_loop(
        [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          o[0] = kiln_less(st[2], kiln_scalar(KILN_I64, 9));
          return o[0] ? 0 : -1;
        },
        [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          o[0] = st[1];
          o[1] = kiln_add(st[0], st[1]);
          o[2] = kiln_add(st[2], kiln_scalar(KILN_I64, 1));
          return o[1] && o[2] ? 0 : -1;
        },
        nullptr, 3, init, -1, fin);
    out[0] = fin[0], out[1] = fin[1];
    return rc;
  };
  kiln_tensor *in[2] = {f32({2}, {0, 1}), f32({2}, {1, 1})};
  kiln_tensor *got[2][2] = {};
  ASSERT_TRUE(on_both(fib, in, got)) << kiln_last_error();
  EXPECT_EQ(values(got[0][0]), (VD{34, 55}));
  EXPECT_EQ(values(got[0][1]), (VD{55, 89}));
  for (int k = 0; k < 2; k++) EXPECT_TRUE(allclose(got[0][k], got[1][k], 0, 0)) << "result " << k;
}

TEST(ControlCompiled, ALoopWhoseKernelsLieInTwoModules) {
  // the body's two kernels compiled in two LLVM modules (cpu_options.parts),
  // the loop in the entry calling across them
  Scoped s;
  auto two = [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
    return kiln_scan(
        [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          o[0] = kiln_tanh(kiln_mul(st[0], st[0])); // no constants: the compiled
          o[1] = kiln_exp(kiln_neg(st[1]));        // function has the two parameters
          return o[0] && o[1] ? 0 : -1;
        },
        nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
  };
  std::vector<float> xv(5 * 3);
  for (size_t i = 0; i < xv.size(); i++) xv[i] = (float)i * 0.1f;
  kiln_tensor *in[2] = {f32({8}, std::vector<float>(8, 0.7f)), f32({5, 3}, xv)};
  EnvGuard env("KILN_BACKEND", "interp");
  kiln_function *f = kiln_function_new("two", two, nullptr, 2, 2);
  kiln_tensor *want[2];
  ASSERT_EQ(kiln_function_call(f, in, want), 0) << kiln_last_error();
  char *text = kiln_function_ir(f, 0, "optimized");
  kiln_function_free(f);
  ASSERT_NE(text, nullptr) << kiln_last_error();
  ir_module *m = ir_parse(text, "two.kir");
  free(text);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cpu_options opt = {};
  opt.parts = 2;
  cpu_program *p = cpu_compile_with(ir_module_find(m, "two"), &opt);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_EQ(cpu_program_kernels(p), 2);
  EXPECT_EQ(cpu_program_parts(p), 2);
  kiln_tensor *got[2] = {};
  ASSERT_EQ(cpu_run(p, in, got), 0) << kiln_last_error();
  for (int k = 0; k < 2; k++) EXPECT_TRUE(allclose(got[k], want[k], 1e-6, 1e-6)) << "result " << k;
  cpu_program_free(p);
  ir_module_free(m);
}

TEST(ControlCompiled, GpuCodeHoldsTheLoopBodysKernels) {
  // the CUDA backend lowers control flow (host-side loops over the body's
  // kernels): the trace's PTX has them (tests/cuda/cuda_control_test.cc runs it)
  Scoped s;
  EnvGuard env("KILN_BACKEND", "interp");
  kiln_function *f = kiln_function_new("rnn", body_rnn, nullptr, 3, 3);
  kiln_tensor *in[3] = {f32({8}, std::vector<float>(8, 0.5f)), f32({4, 8}, std::vector<float>(32, 0.25f)),
                        f32({8}, std::vector<float>(8, 0.5f))};
  kiln_tensor *out[3];
  ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  char *ptx = kiln_function_ir(f, 0, "ptx");
  ASSERT_NE(ptx, nullptr) << kiln_last_error();
  EXPECT_THAT(ptx, HasSubstr(".entry kernel"));
  free(ptx);
  kiln_function_free(f);
}

// ---- loop state stored in place (backends/plan/carry.c) ----

// body staged (n_in inputs, n_out results) and called compiled and
// interpreted with KILN_POISON=1 (every planned buffer filled with NaNs
// first); each result equal to within 1e-5
void expect_same(kiln_body_fn body, std::vector<kiln_tensor *> in, int n_out) {
  EnvGuard poison("KILN_POISON", "1");
  const char *backends[2] = {"cpu", "interp"};
  std::vector<kiln_tensor *> got[2];
  for (int b = 0; b < 2; b++) {
    EnvGuard env("KILN_BACKEND", backends[b]);
    got[b].assign((size_t)n_out, nullptr);
    kiln_function *f = kiln_function_new("state", body, nullptr, (int)in.size(), n_out);
    int rc = kiln_function_call(f, in.data(), got[b].data());
    kiln_function_free(f);
    ASSERT_EQ(rc, 0) << backends[b] << ": " << kiln_last_error();
  }
  for (int k = 0; k < n_out; k++) EXPECT_TRUE(allclose(got[0][k], got[1][k], 1e-5, 1e-6)) << "result " << k;
}

std::vector<float> wave(size_t n, double f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; i++) v[i] = (float)std::sin(f * (double)i + 0.3);
  return v;
}

kiln_tensor *half(kiln_tensor *like) { return kiln_scalar_like(like, 0.5); }

// c = c * 0.5 + x_t; y_t = 2 c (the carry updated in place), forward and
// reverse, over 0, 1 and 7 rows
int ema_body(void *, int, kiln_tensor *const *s, int, kiln_tensor **o) {
  o[0] = kiln_add(kiln_mul(s[0], half(s[0])), s[1]);
  o[1] = kiln_mul(o[0], kiln_scalar_like(o[0], 2));
  return o[1] ? 0 : -1;
}
int ema(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(ema_body, nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
}
int ema_rev(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(ema_body, nullptr, 1, &in[0], 1, &in[1], -1, true, 1, &out[0], &out[1]);
}

TEST(ControlCompiled, StateUpdatedInPlaceMatchesTheInterpreter) {
  Scoped s;
  for (int64_t T : {1, 7}) {
    for (kiln_body_fn fn : {ema, ema_rev}) {
      SCOPED_TRACE("T=" + std::to_string(T) + (fn == ema ? "" : " reverse"));
      expect_same(fn, {f32({5}, wave(5, 0.7)), f32({T, 5}, wave((size_t)T * 5, 0.37))}, 2);
    }
  }
  // and its value: c_1 = (1.5, 1), c_2 = (3.75, 4.5), c_3 = (6.875, 8.25)
  EnvGuard env("KILN_BACKEND", "cpu");
  kiln_function *f = kiln_function_new("ema", ema, nullptr, 2, 2);
  kiln_tensor *in[2] = {f32({2}, {1, -2}), f32({3, 2}, {1, 2, 3, 4, 5, 6})}, *out[2];
  ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{6.875, 8.25}));
  EXPECT_EQ(values(out[1]), (VD{3, 2, 7.5, 9, 13.75, 16.5}));
  kiln_function_free(f);
}

TEST(ControlCompiled, StateSwappedPassedThroughOrAlsoAYs) {
  Scoped s;
  // (s0, s1) -> (s1, s0 + x_t), y_t = s0'
  expect_same(
      [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
        return kiln_scan(
            [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
              o[0] = st[1];
              o[1] = kiln_add(st[0], st[2]);
              o[2] = o[0];
              return o[1] ? 0 : -1;
            },
            nullptr, 2, in, 1, &in[2], -1, false, 1, out, &out[2]);
      },
      {f32({4}, wave(4, 0.5)), f32({4}, wave(4, 0.9)), f32({5, 4}, wave(20, 0.3))}, 3);
  // (a, b) -> (a, b * x_t + a): a returned unchanged; y_t = b' (the carry
  // also a ys), and a second ys that reads the new b
  expect_same(
      [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
        return kiln_scan(
            [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
              o[0] = st[0];
              o[1] = kiln_add(kiln_mul(st[1], st[2]), st[0]);
              o[2] = o[1];
              o[3] = kiln_exp(kiln_neg(o[1]));
              return o[3] ? 0 : -1;
            },
            nullptr, 2, in, 1, &in[2], -1, true, 2, out, &out[2]);
      },
      {f32({4}, wave(4, 0.5)), f32({4}, wave(4, 0.9)), f32({6, 4}, wave(24, 0.3))}, 4);
}

TEST(ControlCompiled, StateReadAfterItsUpdateKeepsItsOldValue) {
  Scoped s;
  // c' = tanh(c + x_t); y_t = sum(2 c' * c): the reduction reads the old c
  // after the kernel that makes c'; and w' = w * 0.5 + sum(c) (the old c
  // read across its elements, by a reduction before)
  expect_same(
      [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
        return kiln_scan(
            [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
              o[0] = kiln_tanh(kiln_add(st[0], st[2]));
              o[1] = kiln_add(kiln_mul(st[1], half(st[1])), kiln_reduce_sum(st[0], 0, nullptr, false));
              o[2] = kiln_reduce_sum(kiln_mul(kiln_mul(o[0], kiln_scalar_like(o[0], 2)), st[0]), 0, nullptr, false);
              return o[1] && o[2] ? 0 : -1;
            },
            nullptr, 2, in, 1, &in[2], -1, false, 1, out, &out[2]);
      },
      {f32({6}, wave(6, 0.5)), f32({6}, wave(6, 0.8)), f32({5, 6}, wave(30, 0.3))}, 3);
}

TEST(ControlCompiled, StateOfNestedLoopsAndCondsInsideLoops) {
  Scoped s;
  // an outer scan whose body runs a while (v, n) -> (v * 0.5 + c, n + 1)
  // while n < 3 and a cond on sum(c) > 0; c' = the cond's result + x_t
  expect_same(
      [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
        return kiln_scan(
            [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
              kiln_tensor *init[3] = {st[0], kiln_scalar(KILN_I64, 0), st[0]}, *fin[3];
              if (kiln_while_loop(
                      [](void *, int, kiln_tensor *const *w, int, kiln_tensor **p) {
                        p[0] = kiln_less(w[1], kiln_scalar(KILN_I64, 3));
                        return p[0] ? 0 : -1;
                      },
                      [](void *, int, kiln_tensor *const *w, int, kiln_tensor **p) {
                        p[0] = kiln_add(kiln_mul(w[0], half(w[0])), w[2]);
                        p[1] = kiln_add(w[1], kiln_scalar(KILN_I64, 1));
                        p[2] = w[2];
                        return p[0] && p[1] ? 0 : -1;
                      },
                      nullptr, 3, init, -1, fin))
                return -1;
              kiln_tensor *pred = kiln_greater(kiln_reduce_sum(fin[0], 0, nullptr, false), kiln_scalar(KILN_F32, 0));
              kiln_tensor *arm[1] = {fin[0]}, *r[1];
              if (kiln_cond(
                      pred,
                      [](void *, int, kiln_tensor *const *a, int, kiln_tensor **b) {
                        b[0] = kiln_mul(a[0], half(a[0]));
                        return b[0] ? 0 : -1;
                      },
                      [](void *, int, kiln_tensor *const *a, int, kiln_tensor **b) {
                        b[0] = kiln_add(a[0], kiln_scalar_like(a[0], 1));
                        return b[0] ? 0 : -1;
                      },
                      nullptr, 1, arm, 1, r))
                return -1;
              o[0] = kiln_add(r[0], st[1]);
              o[1] = kiln_neg(o[0]);
              return o[1] ? 0 : -1;
            },
            nullptr, 1, in, 1, &in[1], -1, false, 1, out, &out[1]);
      },
      {f32({3}, {0.5f, -2.0f, 1.0f}), f32({6, 3}, wave(18, 0.9))}, 2);
  // a scan in a reverse scan, each updating its carry in place
  expect_same(
      [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
        return kiln_scan(
            [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
              kiln_tensor *c[1] = {st[0]}, *xs[1] = {st[1]}, *inner[1];
              if (kiln_scan(
                      [](void *, int, kiln_tensor *const *a, int, kiln_tensor **b) {
                        b[0] = kiln_add(kiln_mul(a[0], half(a[0])), a[1]);
                        return b[0] ? 0 : -1;
                      },
                      nullptr, 1, c, 1, xs, -1, false, 0, inner, nullptr))
                return -1;
              o[0] = kiln_tanh(inner[0]);
              o[1] = kiln_reduce_sum(o[0], 0, nullptr, false);
              return o[1] ? 0 : -1;
            },
            nullptr, 1, in, 1, &in[1], -1, true, 1, out, &out[1]);
      },
      {f32({3}, {0.5f, -2.0f, 1.0f}), f32({4, 5, 3}, wave(60, 0.7))}, 2);
}

TEST(ControlCompiled, WhileStateUpdatedInPlaceMatchesTheInterpreter) {
  Scoped s;
  // Newton's square root: x' = (x + a / x) / 2 until n = 6; the predicate
  // reads the state too
  auto newton = [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
    kiln_tensor *init[3] = {in[0], in[1], kiln_scalar(KILN_I64, 0)}, *fin[3];
    int rc = kiln_while_loop(
        [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          o[0] = kiln_less(st[2], kiln_scalar(KILN_I64, 6));
          return o[0] ? 0 : -1;
        },
        [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          o[0] = kiln_mul(kiln_add(st[0], kiln_div(st[1], st[0])), half(st[0]));
          o[1] = st[1];
          o[2] = kiln_add(st[2], kiln_scalar(KILN_I64, 1));
          return o[0] && o[2] ? 0 : -1;
        },
        nullptr, 3, init, 10, fin);
    out[0] = fin[0], out[1] = fin[2];
    return rc;
  };
  expect_same(newton, {f32({4}, {1, 1, 1, 1}), f32({4}, {4, 9, 2, 100})}, 2);
  EnvGuard env("KILN_BACKEND", "cpu");
  kiln_function *f = kiln_function_new("newton", newton, nullptr, 2, 2);
  kiln_tensor *in[2] = {f32({4}, {1, 1, 1, 1}), f32({4}, {4, 9, 2, 100})}, *out[2];
  ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  kiln_function_free(f);
  std::vector<double> x = values(out[0]);
  EXPECT_NEAR(x[0], 2, 1e-5);
  EXPECT_NEAR(x[1], 3, 1e-5);
  EXPECT_NEAR(x[2], std::sqrt(2.0), 1e-5);
  EXPECT_EQ(values(out[1]), (VD{6}));
}

// ---- a scan of an elementwise body as one kernel (backends/cpu/scan_kernel.c) ----

// f staged, its optimized IR compiled by the CPU backend with the scan as
// one kernel (cpu_options.scan_kernels: whatever its rows' length) and as
// a loop of steps (cpu_options.scan_loops), each run on
// in and compared with the interpreter (KILN_POISON=1); the kernels each
// compile has in kernels[2]
void expect_one_kernel_same(kiln_body_fn body, void *user, std::vector<kiln_tensor *> in, int n_out,
                            int kernels[2]) {
  EnvGuard poison("KILN_POISON", "1");
  EnvGuard env("KILN_BACKEND", "interp");
  kiln_function *f = kiln_function_new("scan1", body, user, (int)in.size(), n_out);
  std::vector<kiln_tensor *> want((size_t)n_out, nullptr);
  ASSERT_EQ(kiln_function_call(f, in.data(), want.data()), 0) << kiln_last_error();
  char *text = kiln_function_ir(f, 0, "optimized");
  kiln_function_free(f);
  ASSERT_NE(text, nullptr) << kiln_last_error();
  ir_module *m = ir_parse(text, "scan1.kir");
  free(text);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  for (int loops = 0; loops < 2; loops++) {
    cpu_options opt = {};
    opt.scan_loops = loops;
    opt.scan_kernels = !loops;
    cpu_program *p = cpu_compile_with(ir_module_find(m, "scan1"), &opt);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    kernels[loops] = cpu_program_kernels(p);
    std::vector<kiln_tensor *> got((size_t)n_out, nullptr);
    ASSERT_EQ(cpu_run(p, in.data(), got.data()), 0) << kiln_last_error();
    for (int k = 0; k < n_out; k++)
      EXPECT_TRUE(allclose(got[k], want[k], 1e-5, 1e-6)) << "result " << k << (loops ? " (loop of steps)" : "");
    cpu_program_free(p);
  }
  ir_module_free(m);
}

// cumulative sum, forward or (user non-NULL) reverse: c' = c + x_t, y_t = c'
int cumsum(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(
      [](void *, int, kiln_tensor *const *s, int, kiln_tensor **o) {
        o[0] = kiln_add(s[0], s[1]);
        o[1] = o[0];
        return o[0] ? 0 : -1;
      },
      nullptr, 1, &in[0], 1, &in[1], -1, user != nullptr, 1, &out[0], &out[1]);
}

TEST(ControlCompiled, ElementwiseScanIsOneKernel) {
  Scoped s;
  int reverse = 1;
  for (int64_t T : {0, 1, 7, 300}) {
    for (void *user : {(void *)nullptr, (void *)&reverse}) {
      SCOPED_TRACE("T=" + std::to_string(T) + (user ? " reverse" : ""));
      int kernels[2] = {0, 0};
      // rows of 5 (one tile) and of 700 (three tiles, the last partial)
      expect_one_kernel_same(cumsum, user, {f32({5}, wave(5, 0.7)), f32({T, 5}, wave((size_t)T * 5, 0.37))}, 2,
                             kernels);
      expect_one_kernel_same(cumsum, user, {f32({700}, wave(700, 0.7)), f32({T, 700}, wave((size_t)T * 700, 0.1))},
                             2, kernels);
      if (T > 0) { // (a scan of no rows folds away)
        EXPECT_EQ(kernels[0], 1) << "the scan is one kernel";
      }
    }
  }
  // its values: the running sums
  EnvGuard env("KILN_BACKEND", "cpu");
  kiln_function *f = kiln_function_new("cumsum", cumsum, nullptr, 2, 2);
  kiln_tensor *in[2] = {f32({2}, {1, -2}), f32({3, 2}, {1, 2, 3, 4, 5, 6})}, *out[2];
  ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  kiln_function_free(f);
  EXPECT_EQ(values(out[0]), (VD{10, 10}));
  EXPECT_EQ(values(out[1]), (VD{2, 0, 5, 4, 10, 10}));
}

TEST(ControlCompiled, ElementwiseScanOfSeveralCarriesAndCaptures) {
  Scoped s;
  int kernels[2] = {0, 0};
  // a leaky integrator with a captured rate (a scalar, broadcast) and a
  // captured bias (a row): v' = v + a (tanh(x_t + b) - v); u' = v (the old
  // v: a carry that is another's value); y_t = v' * u
  auto leaky = [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
    kiln_tensor *init[2] = {in[0], in[0]}, *fin[2], *cap[2] = {in[2], in[3]};
    int rc = kiln_scan(
        [](void *user, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          kiln_tensor **c = (kiln_tensor **)user;
          o[0] = kiln_add(st[0], kiln_mul(c[0], kiln_sub(kiln_tanh(kiln_add(st[2], c[1])), st[0])));
          o[1] = st[0];
          o[2] = kiln_mul(o[0], st[1]);
          return o[0] && o[2] ? 0 : -1;
        },
        cap, 2, init, 1, &in[1], -1, false, 1, fin, &out[1]);
    out[0] = fin[1];
    return rc;
  };
  expect_one_kernel_same(leaky, nullptr,
                         {f32({6}, wave(6, 0.5)), f32({9, 6}, wave(54, 0.3)), kiln_scalar(KILN_F32, 0.25),
                          f32({6}, wave(6, 1.1))},
                         2, kernels);
  EXPECT_EQ(kernels[0], 1);
  // an integer body that can fail: the error names the op, as a loop's would
  auto idiv = [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) -> int {
    return kiln_scan(
        [](void *, int, kiln_tensor *const *st, int, kiln_tensor **o) {
          o[0] = kiln_div(st[0], st[1]);
          o[1] = o[0];
          return o[0] ? 0 : -1;
        },
        nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
  };
  EnvGuard env("KILN_BACKEND", "cpu");
  kiln_function *f = kiln_function_new("idiv", idiv, nullptr, 2, 2);
  kiln_tensor *ok[2] = {i32({3}, {100, 50, 7}), i32({2, 3}, {2, 5, 1, 5, 1, 7})}, *out[2];
  ASSERT_EQ(kiln_function_call(f, ok, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{10, 10, 1}));
  kiln_tensor *bad[2] = {i32({3}, {100, 50, 7}), i32({2, 3}, {2, 5, 1, 5, 0, 7})};
  EXPECT_NE(kiln_function_call(f, bad, out), 0);
  EXPECT_THAT(kiln_last_error(), HasSubstr("div"));
  ASSERT_EQ(kiln_function_call(f, ok, out), 0) << "usable afterwards: " << kiln_last_error();
  kiln_function_free(f);
}

// ---- double buffering: the state moves between buffers (plan_step.move) ----

// (h, w, a, b) over xs of rows of 16 floats (64 bytes: a row can be a
// state's place): h' = tanh(h x_t + sum(h)) also a ys (the state takes its
// row), w' = the capture (copied into a temporary that moves), (a, b) ->
// (b, a + h') (a swap through a temporary); odd and even lengths (the
// final state in its own buffer or not), forward and reverse
int moving(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[4] = {in[0], in[0], in[2], in[3]};
  kiln_tensor *fin[4] = {};
  int rc = kiln_scan(
      [](void *cap, int, kiln_tensor *const *st, int, kiln_tensor **o) {
        kiln_tensor *h = kiln_tanh(kiln_add(kiln_mul(st[0], st[4]), kiln_reduce_sum(st[0], 0, nullptr, false)));
        o[0] = h;
        o[1] = (kiln_tensor *)cap;
        o[2] = st[3];
        o[3] = kiln_add(st[2], kiln_mul(h, st[1]));
        o[4] = h;
        return o[3] ? 0 : -1;
      },
      in[4], 4, init, 1, &in[1], -1, user != nullptr, 1, fin, &out[1]);
  out[0] = kiln_add(kiln_add(fin[0], fin[1]), kiln_add(fin[2], fin[3]));
  return rc;
}

TEST(ControlCompiled, StateMovingBetweenBuffersMatchesTheInterpreter) {
  Scoped s;
  kiln_body_fn fwd = [](void *, int n, kiln_tensor *const *in, int m, kiln_tensor **out) {
    return moving(nullptr, n, in, m, out);
  };
  kiln_body_fn rev = [](void *, int n, kiln_tensor *const *in, int m, kiln_tensor **out) {
    int r = 1;
    return moving(&r, n, in, m, out);
  };
  for (int64_t T : {0, 1, 5, 6}) {
    for (kiln_body_fn fn : {fwd, rev}) {
      SCOPED_TRACE("T=" + std::to_string(T) + (fn == rev ? " reverse" : ""));
      expect_same(fn,
                  {f32({16}, wave(16, 0.3)), f32({T, 16}, wave((size_t)T * 16, 0.21)), f32({16}, wave(16, 0.9)),
                   f32({16}, wave(16, 1.3)), f32({16}, wave(16, 0.05))},
                  2);
    }
  }
}

} // namespace
