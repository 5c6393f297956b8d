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
  EXPECT_LT(long_run.llvm.size(), short_run.llvm.size() + short_run.llvm.size() / 10)
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

} // namespace
