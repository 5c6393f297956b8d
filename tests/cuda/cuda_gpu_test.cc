// cuda_gpu_test.cc — what the fake driver cannot check: the values GPU
// kernels compute. Every op and dtype eagerly on gpu:0 against the CPU, and
// random programs (tests/ir_gen) compiled by the CUDA backend against the
// reference interpreter; the window ops (conv2d, pooling, their
// gradients) on random shapes against the CPU kernels; dot- and
// conv2d-led fusions (a head kernel, one epilogue kernel) against the CPU
// backend. Uses the machine's own driver (libcuda.so.1); every
// test is skipped, saying why, where there is no GPU.
#include <gmock/gmock.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../ir_gen.h"
#include "../test_util.h"
#include "cuda/cuda_rt.h"
#include "cpu/cpu.h"
#include "cuda/ptx.h"
#include "fusion_cases.h"
#include "scan_cases.h"
#include "window_cases.h"

using namespace kiln_test;

namespace {

#define NEED_GPU()                                                                             \
  do {                                                                                         \
    if (kiln_device_count() < 2)                                                               \
      GTEST_SKIP() << "no GPU on this machine (" << kiln_debug_cuda_status() << "): nothing to test"; \
  } while (0)

// Elementwise closeness: exact for integers and bools; floats within a few
// ulps or an absolute 1e-5 (f32) / 1e-12 (f64), NaN where the CPU has NaN.
// GPU math (fast paths, fused multiply-add, summation order) differs.
::testing::AssertionResult close(const kiln_tensor *gpu, const kiln_tensor *cpu, double rel = 1e-5) {
  if (!gpu || !cpu) return ::testing::AssertionFailure() << "NULL: " << kiln_last_error();
  if (kiln_tensor_dtype(gpu) != kiln_tensor_dtype(cpu) || shape_of(gpu) != shape_of(cpu))
    return ::testing::AssertionFailure() << "types differ";
  VD g = values(gpu), c = values(cpu);
  bool fl = kiln_tensor_dtype(cpu) == KILN_F32 || kiln_tensor_dtype(cpu) == KILN_F64 ||
            kiln_tensor_dtype(cpu) == KILN_F16 || kiln_tensor_dtype(cpu) == KILN_BF16;
  if (kiln_tensor_dtype(cpu) == KILN_F16 || kiln_tensor_dtype(cpu) == KILN_BF16) rel = 1e-2;
  for (size_t i = 0; i < c.size(); i++) {
    bool ok = fl ? (std::isnan(c[i]) ? std::isnan(g[i])
                                     : (g[i] == c[i] || std::fabs(g[i] - c[i]) <= rel * (1 + std::fabs(c[i]))))
                 : g[i] == c[i];
    if (!ok) return ::testing::AssertionFailure() << "element " << i << ": gpu " << g[i] << ", cpu " << c[i];
  }
  return ::testing::AssertionSuccess();
}

kiln_tensor *to(kiln_tensor *t, const char *dev) { return t ? kiln_to_device(t, dev) : nullptr; }

}  // namespace

TEST(CudaGpu, EagerOpsMatchTheCpu) {
  NEED_GPU();
  Scoped s;
  const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64};
  for (kiln_dtype dt : dts) {
    SCOPED_TRACE(kiln_dtype_name(dt));
    kiln_tensor *a = kiln_cast(kiln_sub(kiln_arange(KILN_F64, 24), kiln_scalar(KILN_F64, 11.5)), dt);
    a = kiln_reshape(a, KILN_SHAPE(4, 6));
    kiln_tensor *b = kiln_cast(kiln_add(kiln_arange(KILN_F64, 24), kiln_scalar(KILN_F64, 1)), dt);
    b = kiln_reshape(b, KILN_SHAPE(4, 6));
    kiln_tensor *ga = to(a, "gpu:0"), *gb = to(b, "gpu:0");
    int axes[1] = {1}, perm[2] = {1, 0};
    kiln_tensor *idx = i64({3}, {3, 0, 2}), *gidx = to(idx, "gpu:0");
    auto both = [&](const char *what, auto op) {
      kiln_tensor *c = op(a, b, idx);
      ASSERT_EQ(kiln_device_push("gpu:0"), 0);
      kiln_tensor *g = op(ga, gb, gidx);
      kiln_device_pop();
      EXPECT_TRUE(close(g, c)) << what;
    };
    both("neg", [](auto x, auto, auto) { return kiln_neg(x); });
    both("abs", [](auto x, auto, auto) { return kiln_abs(x); });
    both("add", [](auto x, auto y, auto) { return kiln_add(x, y); });
    both("sub", [](auto x, auto y, auto) { return kiln_sub(x, y); });
    both("mul", [](auto x, auto y, auto) { return kiln_mul(x, y); });
    both("div", [](auto x, auto y, auto) { return kiln_div(x, y); });
    both("mod", [](auto x, auto y, auto) { return kiln_mod(x, y); });
    both("maximum", [](auto x, auto y, auto) { return kiln_maximum(x, y); });
    both("less", [](auto x, auto y, auto) { return kiln_less(x, y); });
    both("select", [](auto x, auto y, auto) { return kiln_select(kiln_less(x, y), x, y); });
    both("cast", [](auto x, auto, auto) { return kiln_cast(x, KILN_F64); });
    both("transpose", [&](auto x, auto, auto) { return kiln_transpose(x, 2, perm); });
    both("slice", [](auto x, auto, auto) {
      int64_t begin[2] = {1, 2}, size[2] = {2, 3};
      return kiln_slice(x, begin, size);
    });
    both("reduce_sum", [&](auto x, auto, auto) { return kiln_reduce_sum(x, 1, axes, false); });
    both("reduce_max", [&](auto x, auto, auto) { return kiln_reduce_max(x, 0, nullptr, true); });
    both("argmax", [](auto x, auto, auto) { return kiln_argmax(x, 1); });
    both("matmul", [&](auto x, auto y, auto) { return kiln_matmul(x, kiln_transpose(y, 2, perm)); });
    both("gather", [](auto x, auto, auto i) { return kiln_gather(x, i, 1); });
    both("concat", [](auto x, auto y, auto) {
      kiln_tensor *p[2] = {x, y};
      return kiln_concat(2, p, 0);
    });
    if (dt == KILN_F32 || dt == KILN_F64) {
      both("exp", [](auto x, auto, auto) { return kiln_exp(x); });
      both("tanh", [](auto x, auto, auto) { return kiln_tanh(x); });
      both("log", [](auto, auto y, auto) { return kiln_log(y); });
      both("sqrt", [](auto, auto y, auto) { return kiln_sqrt(y); });
      both("sigmoid", [](auto x, auto, auto) { return kiln_sigmoid(x); });
      both("pow", [](auto, auto y, auto) { return kiln_pow(y, kiln_scalar_like(y, 0.5)); });
    }
  }
  // the eager errors
  kiln_tensor *x = to(f32({3, 2}, {0, 1, 2, 3, 4, 5}), "gpu:0"), *bad = to(i64({2}, {1, 7}), "gpu:0");
  ASSERT_EQ(kiln_device_push("gpu:0"), 0);
  EXPECT_EQ(kiln_gather(x, bad, 0), nullptr);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[1] = 7 is not in [0, 3)");
  kiln_tensor *n = to(i32({2}, {4, 5}), "gpu:0"), *z = to(i32({2}, {1, 0}), "gpu:0");
  EXPECT_EQ(kiln_div(n, z), nullptr);
  EXPECT_STREQ(kiln_last_error(), "div: integer division by zero");
  kiln_device_pop();
}

// the random corpus (with control flow when control) compiled for gpu:0
// against the interpreter
void random_programs_match(bool control, unsigned more_kinds = 0) {
  const char *arch = cuda_arch_of(0);
  int n = 300, failures = 0;
  ir_gen_options o = ir_gen_default_options();
  if (control) o.kinds |= IR_GEN_CONTROL;
  o.kinds |= more_kinds;
  for (int seed = 1; seed <= n && failures < 5; seed++) {
    Scoped s;
    ir_module *m = ir_gen_program((uint64_t)seed, &o);
    ASSERT_NE(m, nullptr) << kiln_last_error();
    ir_func *f = m->funcs[m->n_funcs - 1];
    std::vector<kiln_tensor *> args((size_t)f->n_params + 1), want((size_t)f->n_results + 1),
        got((size_t)f->n_results + 1);
    ASSERT_EQ(ir_gen_args(f, (uint64_t)seed, args.data()), 0) << kiln_last_error();
    ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << kiln_last_error();
    cuda_program *p = cuda_compile(f, arch);
    ASSERT_NE(p, nullptr) << "seed " << seed << ": " << kiln_last_error();
    int rc = cuda_program_run(p, 0, args.data(), got.data());
    EXPECT_EQ(rc, 0) << "seed " << seed << ": " << kiln_last_error();
    for (int r = 0; rc == 0 && r < f->n_results; r++) {
      bool ok = close(got[(size_t)r], want[(size_t)r], 1e-4);
      EXPECT_TRUE(ok) << "seed " << seed << ", result " << r;
      failures += !ok;
    }
    cuda_program_free(p);
    ir_module_free(m);
  }
}

TEST(CudaGpu, RandomProgramsMatchTheInterpreter) {
  NEED_GPU();
  random_programs_match(false);
}

// cond, while and scan steps run by the host over the kernels of their bodies
TEST(CudaGpu, RandomProgramsWithControlFlowMatchTheInterpreter) {
  NEED_GPU();
  random_programs_match(true);
}

// convolutions, pooling and their gradients among the random ops
TEST(CudaGpu, RandomProgramsWithWindowOpsMatchTheInterpreter) {
  NEED_GPU();
  random_programs_match(false, IR_GEN_WINDOW);
}

// Every window op (conv2d, its two gradients, max and average pooling and
// theirs) on gpu:0 against the CPU kernel, on random shapes: strides 1-3,
// dilations 1-2, explicit padding, one group, several, depthwise; pooling
// windows with ties and NaN. Compiled as a one-op program (both passes of a
// split filter gradient), and eagerly where the op has a public entry.
// Pooling adds in the CPU's order: the same bits; convolutions sum in
// another order (and fuse multiply-adds): close.
TEST(CudaGpu, WindowOpsMatchTheCpu) {
  NEED_GPU();
  std::mt19937 rng(1616);
  const char *arch = cuda_arch_of(0);
  int failures = 0;
  for (op_id op : kWindowOps)
    for (kiln_dtype dt : {KILN_F32, KILN_F64})
      for (int k = 0; k < 16 && failures < 5; k++) {
        Scoped s;
        WinCase c = random_window_case(rng, op, dt, k % 2 == 1);
        SCOPED_TRACE(c.what);
        kiln_tensor *want = window_cpu(c);
        ASSERT_NE(want, nullptr) << kiln_last_error();
        bool conv = op == OP_CONV2D || op == OP_CONV2D_BP_INPUT || op == OP_CONV2D_BP_FILTER;
        auto check = [&](kiln_tensor *gpu, const char *how) {
          ASSERT_NE(gpu, nullptr) << how << ": " << kiln_last_error();
          EXPECT_STREQ(kiln_tensor_device(gpu), "gpu:0") << how;
          kiln_tensor *got = to(gpu, "cpu:0");
          bool ok = conv ? close(got, want, dt == KILN_F64 ? 1e-10 : 1e-4) : same_bits(got, want);
          EXPECT_TRUE(ok) << how << "\ngot  " << ::testing::PrintToString(values(got)) << "\nwant "
                          << ::testing::PrintToString(values(want));
          failures += !ok;
        };
        // compiled: the one-op function
        ir_module *m = ir_module_new();
        ir_func *f = window_func(m, c);
        ASSERT_NE(f, nullptr) << kiln_last_error();
        cuda_program *p = cuda_compile(f, arch);
        ASSERT_NE(p, nullptr) << kiln_last_error();
        std::vector<kiln_tensor *> args;
        for (kiln_tensor *t : c.in) args.push_back(to(t, "gpu:0"));
        kiln_tensor *got = nullptr;
        EXPECT_EQ(cuda_program_run(p, 0, args.data(), &got), 0) << kiln_last_error();
        check(got, "compiled");
        cuda_program_free(p);
        ir_module_free(m);
        // eager, through the public entry points
        kiln_conv_opts o{};
        for (int i = 0; i < 2; i++) o.stride[i] = c.a.stride[i], o.dilation[i] = conv ? c.a.dilation[i] : 0;
        for (int i = 0; i < 4; i++) o.padding[i] = c.a.padding[i];
        o.groups = conv ? c.a.groups : 0;
        ASSERT_EQ(kiln_device_push("gpu:0"), 0);
        if (op == OP_CONV2D) check(kiln_conv2d(args[0], args[1], &o), "eager");
        if (op == OP_CONV2D_BP_INPUT) check(kiln_conv2d_transpose(args[0], args[1], c.a.shape + 1, &o), "eager");
        if (op == OP_MAX_POOL2D) check(kiln_max_pool2d(args[0], c.a.window, &o), "eager");
        if (op == OP_AVG_POOL2D) check(kiln_avg_pool2d(args[0], c.a.window, &o), "eager");
        kiln_device_pop();
      }
}

// ResNet-50's 3x3 64->64 layer at 56x56, batch 8 (the benchmark
// shape): conv2d and its two gradients on gpu:0 against the CPU, and their
// times printed (GFLOP/s, the mean of 5 runs after a warm-up) for the first
// session with a GPU to record.
TEST(CudaGpu, ResNetLayerWindowKernelsMatchTheCpuAndAreTimed) {
  NEED_GPU();
  Scoped s;
  kiln_random_seed(50);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(8, 56, 56, 64));
  kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 64, 64));
  kiln_tensor *dy = kiln_random_normal(KILN_F32, KILN_SHAPE(8, 56, 56, 64));
  const char *ops[3] = {"conv2d", "conv2d_backprop_input", "conv2d_backprop_filter"};
  const char *kir[3] = {
      "func @f(%x: f32[8,56,56,64], %w: f32[3,3,64,64]) -> f32[8,56,56,64] {\n"
      "  %r = conv2d %x, %w {stride=[1,1], dilation=[1,1], padding=[1,1,1,1], groups=1} : f32[8,56,56,64]\n"
      "  return %r\n}\n",
      "func @f(%dy: f32[8,56,56,64], %w: f32[3,3,64,64]) -> f32[8,56,56,64] {\n"
      "  %r = conv2d_backprop_input %dy, %w {shape=[8,56,56,64], stride=[1,1], dilation=[1,1], "
      "padding=[1,1,1,1], groups=1} : f32[8,56,56,64]\n"
      "  return %r\n}\n",
      "func @f(%x: f32[8,56,56,64], %dy: f32[8,56,56,64]) -> f32[3,3,64,64] {\n"
      "  %r = conv2d_backprop_filter %x, %dy {shape=[3,3,64,64], stride=[1,1], dilation=[1,1], "
      "padding=[1,1,1,1], groups=1} : f32[3,3,64,64]\n"
      "  return %r\n}\n"};
  kiln_tensor *ins[3][2] = {{x, w}, {dy, w}, {x, dy}};
  double flops = 2.0 * 8 * 56 * 56 * 64 * 64 * 9;
  for (int q = 0; q < 3; q++) {
    SCOPED_TRACE(ops[q]);
    ir_module *m = ir_parse(kir[q], "resnet.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error();
    const ir_func *f = m->funcs[0];
    kiln_tensor *want[1] = {nullptr}, *got[1] = {nullptr};
    ASSERT_EQ(ir_interpret(f, ins[q], want), 0) << kiln_last_error();
    cuda_program *p = cuda_compile(f, cuda_arch_of(0));
    ASSERT_NE(p, nullptr) << kiln_last_error();
    kiln_tensor *args[2] = {to(ins[q][0], "gpu:0"), to(ins[q][1], "gpu:0")};
    ASSERT_EQ(cuda_program_run(p, 0, args, got), 0) << kiln_last_error();
    EXPECT_TRUE(allclose(to(got[0], "cpu:0"), want[0], 1e-3, 1e-3));
    double best = 1e30, sum = 0;
    for (int r = 0; r < 6; r++) {
      kiln_scope_push();
      ASSERT_EQ(kiln_debug_cuda_sync(0), 0);
      auto t0 = std::chrono::steady_clock::now();
      ASSERT_EQ(cuda_program_run(p, 0, args, got), 0) << kiln_last_error();
      ASSERT_EQ(kiln_debug_cuda_sync(0), 0);
      double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      kiln_scope_pop();
      if (r > 0) sum += sec, best = std::min(best, sec);
    }
    std::printf("[cuda window] %s f32 8x56x56x64, 3x3x64x64: %.3f ms mean, %.3f best, %.0f GFLOP/s (%s)\n", ops[q],
                sum / 5 * 1e3, best * 1e3, flops / (sum / 5) * 1e-9, cuda_arch_of(0));
    cuda_program_free(p);
    ir_module_free(m);
  }
}

// A conv net's training step on the GPU (the tape's gradients are the window
// ops' GPU kernels) against the same step on the CPU.
TEST(CudaGpu, ConvGradientsMatchTheCpu) {
  NEED_GPU();
  Scoped s;
  kiln_random_seed(16);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(4, 12, 12, 3));
  kiln_tensor *w1 = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 3, 8));
  kiln_tensor *w2 = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 1, 8));
  auto step = [&](const char *dev, kiln_tensor **grads) {
    kiln_tensor *xs[3] = {to(x, dev), to(w1, dev), to(w2, dev)};
    ASSERT_EQ(kiln_device_push(dev), 0);
    kiln_tape *tape = kiln_tape_begin(false);
    for (kiln_tensor *t : xs) kiln_tape_watch(tape, t);
    kiln_conv_opts o{};
    o.same = true;
    kiln_conv_opts dw{};
    dw.same = true, dw.groups = 8, dw.stride[0] = dw.stride[1] = 2;
    int win[2] = {3, 3};
    kiln_conv_opts po{};
    po.stride[0] = po.stride[1] = 2, po.padding[1] = po.padding[3] = 1;
    kiln_tensor *h = kiln_relu(kiln_conv2d(xs[0], xs[1], &o));
    h = kiln_max_pool2d(kiln_conv2d(h, xs[2], &dw), win, &po);
    int w2x2[2] = {2, 2};
    kiln_tensor *loss = kiln_reduce_sum(kiln_avg_pool2d(h, w2x2, nullptr), 0, nullptr, false);
    kiln_tape_end(tape);
    EXPECT_EQ(kiln_tape_gradient(tape, loss, 3, xs, grads), 0) << kiln_last_error();
    kiln_tape_free(tape);
    kiln_device_pop();
  };
  kiln_tensor *cpu[3] = {}, *gpu[3] = {};
  step("cpu:0", cpu);
  step("gpu:0", gpu);
  for (int i = 0; i < 3; i++) EXPECT_TRUE(close(gpu[i], cpu[i], 1e-4)) << "gradient " << i;
}

int mlp(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *h = kiln_relu(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  out[0] = kiln_reduce_mean(kiln_tanh(h), 0, nullptr, false);
  return out[0] ? 0 : -1;
}

TEST(CudaGpu, AStagedFunctionMatchesTheCpu) {
  NEED_GPU();
  Scoped s;
  kiln_function *f = kiln_function_new("mlp", mlp, nullptr, 3, 1);
  kiln_random_seed(3);
  kiln_tensor *in[3] = {kiln_random_normal(KILN_F32, KILN_SHAPE(64, 128)),
                        kiln_random_normal(KILN_F32, KILN_SHAPE(128, 32)),
                        kiln_random_normal(KILN_F32, KILN_SHAPE(32))};
  kiln_tensor *cpu = nullptr, *gpu = nullptr;
  ASSERT_EQ(kiln_function_call(f, in, &cpu), 0) << kiln_last_error();
  ASSERT_EQ(kiln_device_push("gpu:0"), 0);
  ASSERT_EQ(kiln_function_call(f, in, &gpu), 0) << kiln_last_error();
  kiln_device_pop();
  EXPECT_STREQ(kiln_tensor_device(gpu), "gpu:0");
  EXPECT_TRUE(close(gpu, cpu, 1e-4));
  kiln_function_free(f);
}

// Column reductions split over blocks (ptx.c's colplan): every reduction op
// over leading axes of a tall input matches the CPU, and two runs give the
// same bits (partials are combined in a fixed order).
TEST(CudaGpu, ColumnReductionsMatchTheCpuAndRepeat) {
  NEED_GPU();
  Scoped s;
  struct C {
    V64 shape;
    std::vector<int> axes;
  };
  const std::vector<C> cs = {{{100000, 4}, {0}}, {{300, 257}, {0}}, {{50, 60, 8}, {0, 1}}, {{9, 1000, 3}, {0, 1}},
                             {{4096, 33}, {0}}};
  const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64};
  for (const C &c : cs)
    for (kiln_dtype dt : dts) {
      SCOPED_TRACE(kiln_dtype_name(dt));
      int64_t n = 1;
      for (int64_t d : c.shape) n *= d;
      kiln_tensor *x = kiln_cast(kiln_reshape(kiln_sub(kiln_mod(kiln_arange(KILN_F64, n), kiln_scalar(KILN_F64, 7)),
                                                        kiln_scalar(KILN_F64, 3)),
                                              (int)c.shape.size(), c.shape.data()),
                                 dt);
      ASSERT_NE(x, nullptr) << kiln_last_error();
      kiln_tensor *g = to(x, "gpu:0");
      for (int which = 0; which < 3; which++) {
        auto red = [&](kiln_tensor *t) {
          int na = (int)c.axes.size();
          return which == 0 ? kiln_reduce_sum(t, na, c.axes.data(), false)
                 : which == 1 ? kiln_reduce_max(t, na, c.axes.data(), false)
                              : kiln_reduce_min(t, na, c.axes.data(), false);
        };
        kiln_tensor *want = red(x), *got = red(g), *again = red(g);
        EXPECT_TRUE(close(to(got, "cpu:0"), want, 1e-6)) << which;
        EXPECT_EQ(values(to(got, "cpu:0")), values(to(again, "cpu:0"))) << "run to run";
      }
    }
}

// KILN_CUDA_TF32=1: f32 matmuls on tensor cores (inputs rounded to TF32's
// 10-bit mantissa) close to the CPU's; off, as close as ever.
TEST(CudaGpu, Tf32MatmulIsCloseToTheCpu) {
  NEED_GPU();
  Scoped s;
  kiln_random_seed(5);
  const V64 shapes[][2] = {{{64, 64}, {64, 64}}, {{100, 37}, {37, 70}}, {{3, 130, 65}, {65, 129}}};
  for (const char *mode : {"1", "0"}) {
    setenv("KILN_CUDA_TF32", mode, 1);
    for (const auto &sh : shapes) {
      kiln_tensor *a = kiln_random_normal(KILN_F32, (int)sh[0].size(), sh[0].data());
      kiln_tensor *b = kiln_random_normal(KILN_F32, (int)sh[1].size(), sh[1].data());
      kiln_tensor *want = kiln_matmul(a, b), *got = kiln_matmul(to(a, "gpu:0"), to(b, "gpu:0"));
      // TF32 rounds each input to 2^-11 relative: a sum of K products of N(0,1)s is off by about sqrt(K) 2^-11
      EXPECT_TRUE(close(to(got, "cpu:0"), want, mode[0] == '1' ? 2e-2 : 1e-4)) << "KILN_CUDA_TF32=" << mode;
    }
  }
  unsetenv("KILN_CUDA_TF32");
}

// ---- control flow (backends/cuda/launch.c runs cond / while / scan steps) ----

namespace {

int neg_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}
int exp_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_exp(in[0]);
  return out[0] ? 0 : -1;
}
// exp(x) where sum(x) > 0, else -x
int cond_fn(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar_like(in[0], 0));
  return kiln_cond(p, exp_branch, neg_branch, nullptr, 1, in, 1, out);
}

// Collatz: while a != 1 { a = a even ? a / 2 : 3a + 1; n += 1 }
int collatz_cond(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_not_equal(in[0], kiln_scalar_like(in[0], 1));
  return out[0] ? 0 : -1;
}
int collatz_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *a = in[0], *two = kiln_scalar_like(a, 2);
  kiln_tensor *even = kiln_equal(kiln_mod(a, two), kiln_scalar_like(a, 0));
  out[0] = kiln_select(even, kiln_div(a, two), kiln_add(kiln_mul(a, kiln_scalar_like(a, 3)), kiln_scalar_like(a, 1)));
  out[1] = kiln_add(in[1], kiln_scalar_like(in[1], 1));
  return out[0] && out[1] ? 0 : -1;
}
int collatz(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {in[0], kiln_scalar_like(in[0], 0)};
  return kiln_while_loop(collatz_cond, collatz_body, nullptr, 2, init, -1, out);
}

// cumulative sum: carry c, y_t = c + x_t
int cumsum_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], in[1]);
  out[1] = out[0];
  return out[0] ? 0 : -1;
}
int cumsum(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(cumsum_body, nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
}
int cumsum_reversed(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(cumsum_body, nullptr, 1, &in[0], 1, &in[1], -1, true, 1, &out[0], &out[1]);
}

// an LSTM-like cell: gates from [x_t, h] @ w, c' = f*c + i*g, h' = o*tanh(c')
int lstm_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *w = (kiln_tensor *)user, *h = in[0], *c = in[1], *x = in[2];
  kiln_tensor *xh[2] = {x, h};
  kiln_tensor *z = kiln_matmul(kiln_concat(2, xh, 1), w);  // [B, 4H]
  if (!z) return -1;
  int64_t B = kiln_tensor_shape(h)[0], H = kiln_tensor_shape(h)[1];
  auto gate = [&](int k) {
    int64_t begin[2] = {0, k * H}, size[2] = {B, H};
    return kiln_slice(z, begin, size);
  };
  kiln_tensor *i = kiln_sigmoid(gate(0)), *f = kiln_sigmoid(gate(1)), *g = kiln_tanh(gate(2)),
              *o = kiln_sigmoid(gate(3));
  out[1] = kiln_add(kiln_mul(f, c), kiln_mul(i, g));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  out[2] = out[0];
  return out[0] && out[1] ? 0 : -1;
}
// (h0, c0, xs, w): w captured by the body
int lstm(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {in[0], in[1]};
  return kiln_scan(lstm_body, in[3], 2, init, 1, &in[2], -1, false, 1, out, &out[2]);
}

// f(in) on the CPU and under gpu:0 (inputs moved there): every output close
void same_on_both(const char *name, kiln_body_fn body, void *user, std::vector<kiln_tensor *> in, int n_out,
                  double rel = 1e-5) {
  SCOPED_TRACE(name);
  kiln_function *f = kiln_function_new(name, body, user, (int)in.size(), n_out);
  std::vector<kiln_tensor *> cpu((size_t)n_out), gpu((size_t)n_out), gin;
  ASSERT_EQ(kiln_function_call(f, in.data(), cpu.data()), 0) << kiln_last_error();
  for (kiln_tensor *t : in) gin.push_back(to(t, "gpu:0"));
  ASSERT_EQ(kiln_device_push("gpu:0"), 0);
  int rc = kiln_function_call(f, gin.data(), gpu.data());
  kiln_device_pop();
  ASSERT_EQ(rc, 0) << kiln_last_error();
  kiln_stats st{};
  ASSERT_EQ(kiln_function_stats(f, 1, &st), 0) << kiln_last_error();
  EXPECT_GT(st.compile_ms, 0.0) << "the GPU trace compiled";
  for (int k = 0; k < n_out; k++) {
    EXPECT_STREQ(kiln_tensor_device(gpu[(size_t)k]), "gpu:0");
    EXPECT_TRUE(close(gpu[(size_t)k], cpu[(size_t)k], rel)) << "output " << k;
  }
  kiln_function_free(f);
}

}  // namespace

TEST(CudaGpu, ControlFlowMatchesTheCpu) {
  NEED_GPU();
  Scoped s;
  same_on_both("cond_pos", cond_fn, nullptr, {f32({4}, {1, -2, 3, 0.5})}, 1);
  same_on_both("cond_neg", cond_fn, nullptr, {f32({4}, {-1, -2, 3, -0.5})}, 1);
  // 27 takes 111 steps to reach 1
  same_on_both("collatz", collatz, nullptr, {i64({}, {27})}, 2);
  kiln_tensor *c0 = f32({3}, {0, 1, 2});
  kiln_tensor *xs = kiln_reshape(kiln_arange(KILN_F32, 300), KILN_SHAPE(100, 3));
  same_on_both("cumsum", cumsum, nullptr, {c0, xs}, 2);
  kiln_random_seed(5);
  const int B = 8, H = 16, X = 12, T = 20;
  kiln_tensor *w = kiln_mul(kiln_random_normal(KILN_F32, KILN_SHAPE(X + H, 4 * H)), kiln_scalar(KILN_F32, 0.2));
  same_on_both("lstm", lstm, nullptr,
               {kiln_zeros(KILN_F32, KILN_SHAPE(B, H)), kiln_zeros(KILN_F32, KILN_SHAPE(B, H)),
                kiln_random_normal(KILN_F32, KILN_SHAPE(T, B, X)), w},
               3, 1e-4);
}

// The device loop (backends/cuda/ptx_scan.c): random scans whose bodies
// are elementwise (scan_cases.h) compiled into one kernel that loops over t
// on the GPU, against the reference interpreter; the same scans as host
// loops (KILN_CUDA_SCAN_LOOPS=1) against it too; long staged cumulative
// sums (1000 rows of 4096), forward and reversed, against the CPU.
TEST(CudaGpu, DeviceLoopScansMatchTheInterpreterAndTheCpu) {
  NEED_GPU();
  const char *arch = cuda_arch_of(0);
  int failures = 0;
  for (uint64_t seed = 1; seed <= 150 && failures < 5; seed++) {
    Scoped s;
    ScanCase c = scan_case(seed);
    ir_module *m = ir_parse(c.text.c_str(), "scan.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error();
    ir_func *f = ir_module_find(m, "f");
    std::vector<kiln_tensor *> args = scan_args(f, seed), want((size_t)f->n_results + 1);
    ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << kiln_last_error();
    for (const char *loops : {"0", "1"}) {
      EnvGuard env("KILN_CUDA_SCAN_LOOPS", loops);
      cuda_program *p = cuda_compile(f, arch);
      ASSERT_NE(p, nullptr) << "seed " << seed << ": " << kiln_last_error();
      if (loops[0] == '0') {
        EXPECT_EQ(cuda_program_kernels(p), 1) << "seed " << seed << ": the device loop is one kernel";
      }
      std::vector<kiln_tensor *> got((size_t)f->n_results + 1);
      int rc = cuda_program_run(p, 0, args.data(), got.data());
      EXPECT_EQ(rc, 0) << "seed " << seed << ": " << kiln_last_error();
      for (int r = 0; rc == 0 && r < f->n_results; r++) {
        bool ok = close(got[(size_t)r], want[(size_t)r], 1e-4);
        EXPECT_TRUE(ok) << "seed " << seed << " (KILN_CUDA_SCAN_LOOPS=" << loops << "), result " << r << "\n" << c.text;
        failures += !ok;
      }
      cuda_program_free(p);
    }
    ir_module_free(m);
  }
  Scoped s;
  kiln_tensor *c0 = kiln_zeros(KILN_F32, KILN_SHAPE(4096));
  kiln_tensor *xs = kiln_mul(kiln_random_normal(KILN_F32, KILN_SHAPE(1000, 4096)), kiln_scalar(KILN_F32, 0.01));
  same_on_both("cumsum_long", cumsum, nullptr, {c0, xs}, 2, 1e-4);
  same_on_both("cumsum_long_reversed", cumsum_reversed, nullptr, {c0, xs}, 2, 1e-4);
}

namespace {

// conv2d (same padding) + bias + the residual, relu: a ResNet block's tail
int conv_bias_residual_relu(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_conv_opts o{};
  o.same = true;
  out[0] = kiln_relu(kiln_add(kiln_add(kiln_conv2d(in[0], in[1], &o), in[2]), in[3]));
  return out[0] ? 0 : -1;
}

// a dense layer: tanh(x . w + b)
int dense_tanh(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_tanh(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  return out[0] ? 0 : -1;
}

}  // namespace

// Fusions led by a dot or a conv2d with their epilogues (fusion_cases.h:
// biases of [n], [1, n] and broadcast, residuals, relu and tanh, an
// update's longer tail; batched dots), f32 and f64: the head's kernel and
// ONE epilogue kernel on gpu:0 against the CPU backend's program of the
// same IR; then staged at a ResNet block's and a dense layer's sizes.
TEST(CudaGpu, DotAndConvEpilogueFusionsMatchTheCpu) {
  NEED_GPU();
  const char *arch = cuda_arch_of(0);
  int failures = 0;
  for (int k = 0; k < kFusionKinds && failures < 5; k++)
    for (uint64_t seed = 1; seed <= 10 && failures < 5; seed++) {
      Scoped s;
      FusionCase c = fusion_case((FusionKind)k, 1000 * seed + (uint64_t)k);
      ir_module *m = ir_parse(c.fn.c_str(), "fusion.kir");
      ASSERT_NE(m, nullptr) << kiln_last_error();
      ir_func *f = ir_module_find(m, "f");
      std::vector<kiln_tensor *> args((size_t)f->n_params + 1), want(2), got(2);
      ASSERT_EQ(ir_gen_args(f, seed, args.data()), 0) << kiln_last_error();
      cpu_program *cp = cpu_compile(f);
      ASSERT_NE(cp, nullptr) << kiln_last_error();
      ASSERT_EQ(cpu_run(cp, args.data(), want.data()), 0) << kiln_last_error();
      cpu_program_free(cp);
      cuda_program *p = cuda_compile(f, arch);
      ASSERT_NE(p, nullptr) << kiln_last_error();
      EXPECT_EQ(cuda_program_kernels(p), 2) << c.fn;
      int rc = cuda_program_run(p, 0, args.data(), got.data());
      EXPECT_EQ(rc, 0) << kiln_last_error();
      bool ok = rc == 0 && close(got[0], want[0], 1e-4);
      EXPECT_TRUE(ok) << c.fn;
      failures += !ok;
      cuda_program_free(p);
      ir_module_free(m);
    }
  Scoped s;
  kiln_random_seed(11);
  auto normal = [](V64 shape, double scale) {
    return kiln_mul(kiln_random_normal(KILN_F32, (int)shape.size(), shape.data()), kiln_scalar(KILN_F32, scale));
  };
  same_on_both("conv_bias_residual_relu", conv_bias_residual_relu, nullptr,
               {normal({8, 28, 28, 64}, 1), normal({3, 3, 64, 64}, 0.05), normal({64}, 0.1), normal({8, 28, 28, 64}, 1)},
               1, 1e-4);
  same_on_both("dense_tanh", dense_tanh, nullptr, {normal({64, 512}, 1), normal({512, 256}, 0.05), normal({256}, 0.1)},
               1, 1e-4);
}
