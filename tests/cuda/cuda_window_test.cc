// cuda_window_test.cc — the window ops (conv2d, its two gradients, max and
// average pooling and theirs) on the CUDA backend (backends/cuda/
// ptx_window.c) without a GPU:
// - the kernels' element code, emitted for the host by
//   kiln_debug_cuda_window and run in LLVM's interpreter, against the CPU
//   kernels on random shapes (strides, dilations, padding, groups,
//   depthwise, ties and NaN in pooling windows): the index arithmetic the
//   GPU runs, checked here. Pooling matches the CPU bit for bit (same
//   order of sums); convolutions within rounding (another order than the
//   CPU's GEMM).
// - the plan and launches against tests/fake_cuda (which cannot run a
//   kernel): a kernel per op, a filter gradient of few elements split into
//   partials and their sum (through the arena), the launch shapes and device
//   pointers, eager window ops on a GPU compiled once per attributes.
// - the PTX cache keeps programs apart that differ only in attributes.
// - bad inputs are the op's errors on a GPU as on the CPU.
// Values computed on a real GPU: tests/cuda/cuda_gpu_test.cc.
//
// Part of the cuda_runtime_test executable (its main points the runtime at
// the fake driver).
#include <gmock/gmock.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "cuda/cuda_rt.h"
#include "cuda/ptx.h"
#include "cuda_test_util.h"
#include "fake_access.h"
#include "ir.h"
#include "window_cases.h"

using namespace kiln_test;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

struct WinGpuTest : Scoped {
  WinGpuTest() {
    clear_launches();
    fail_launch(nullptr, 0);
    launch_write(nullptr, 0);
  }
  ~WinGpuTest() { EXPECT_EQ(ctx_depth(), 0) << "a CUDA context was left current"; }
};

struct OnGpu {
  OnGpu() { EXPECT_EQ(kiln_device_push("gpu:0"), 0) << error(); }
  ~OnGpu() { kiln_device_pop(); }
};

cuda_eager_stats eager() {
  cuda_eager_stats s{};
  kiln_debug_cuda_eager_stats(&s);
  return s;
}

struct Kir {
  ir_module *m;
  explicit Kir(const std::string &text) : m(ir_parse(text.c_str(), "window.kir")) { EXPECT_NE(m, nullptr) << error(); }
  ~Kir() { ir_module_free(m); }
  const ir_func *f() const { return m ? m->funcs[m->n_funcs - 1] : nullptr; }
};

// The interpreted element code of c's kernels (a new tensor), NULL on failure.
kiln_tensor *window_emulated(const WinCase &c) {
  kiln_tensor *out = kiln_zeros(c.out.dtype, c.out.rank, c.out.shape);
  if (!out) return nullptr;
  return kiln_debug_cuda_window(c.op, &c.a, (int)c.in.size(), c.in.data(), out) ? nullptr : out;
}

const void *data_of(const kiln_tensor *t) { return t->data; }

}  // namespace

// ---- the element code, run on the host ----

TEST(CudaWindow, TheKernelsElementCodeMatchesTheCpu) {
  std::mt19937 rng(16);
  int checked = 0, exact = 0, fours = 0;
  for (op_id op : kWindowOps)
    for (kiln_dtype dt : {KILN_F32, KILN_F64})
      for (int k = 0; k < 12; k++) {
        Scoped s;
        WinCase c = random_window_case(rng, op, dt);
        SCOPED_TRACE(c.what);
        kiln_tensor *want = window_cpu(c);
        ASSERT_NE(want, nullptr) << error();
        kiln_tensor *got = window_emulated(c);
        ASSERT_NE(got, nullptr) << error();
        bool conv = op == OP_CONV2D || op == OP_CONV2D_BP_INPUT || op == OP_CONV2D_BP_FILTER;
        int64_t o = op == OP_CONV2D_BP_INPUT ? shape_of(c.in[0])[3] : c.out.shape[3];
        fours += op != OP_CONV2D_BP_INPUT && conv && (o / c.a.groups) % 4 == 0;  // the 4-wide kernels
        if (conv) {
          // another order of the sums than the CPU's GEMM
          EXPECT_TRUE(dt == KILN_F64 ? allclose(got, want, 1e-12, 1e-12) : allclose(got, want, 1e-5, 1e-5))
              << "got " << ::testing::PrintToString(values(got)) << "\nwant "
              << ::testing::PrintToString(values(want));
        } else {
          // the CPU's order: the same bits
          EXPECT_TRUE(same_bits(got, want)) << "got " << ::testing::PrintToString(values(got)) << "\nwant "
                                            << ::testing::PrintToString(values(want));
          exact++;
        }
        checked++;
      }
  EXPECT_EQ(checked, 7 * 2 * 12);
  EXPECT_EQ(exact, 4 * 2 * 12);
  EXPECT_GE(fours, 6) << "conv2d and its filter gradient 4 output channels a thread";
}

// Hand-computed: a 3x3 image, a 2x2 filter, stride 1, no padding; the max
// pool's gradient shares a tie evenly.
TEST(CudaWindow, HandComputedValues) {
  Scoped s;
  kiln_tensor *x = f32({1, 3, 3, 1}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  kiln_tensor *f = f32({2, 2, 1, 1}, {1, 0, 0, -1});
  op_attrs a{};
  a.stride[0] = a.stride[1] = a.dilation[0] = a.dilation[1] = a.groups = 1;
  kiln_tensor *in[2] = {x, f};
  kiln_tensor *y = kiln_zeros(KILN_F32, KILN_SHAPE(1, 2, 2, 1));
  ASSERT_EQ(kiln_debug_cuda_window(OP_CONV2D, &a, 2, in, y), 0) << error();
  EXPECT_EQ(values(y), (VD{1 - 5, 2 - 6, 4 - 8, 5 - 9}));

  // max pool 2x2 stride 2 over [[1, 3], [3, 0]]: the 3s share dy = 1
  op_attrs p{};
  p.stride[0] = p.stride[1] = 2, p.window[0] = p.window[1] = 2;
  kiln_tensor *px = f32({1, 2, 2, 1}, {1, 3, 3, 0}), *dy = f32({1, 1, 1, 1}, {1});
  kiln_tensor *pin[2] = {px, dy};
  kiln_tensor *dx = kiln_zeros(KILN_F32, KILN_SHAPE(1, 2, 2, 1));
  ASSERT_EQ(kiln_debug_cuda_window(OP_MAX_POOL2D_GRAD, &p, 2, pin, dx), 0) << error();
  EXPECT_EQ(values(dx), (VD{0, 0.5, 0.5, 0}));

  // avg pool 2x2 stride 1, padding 1 on the left: the padding never counts
  op_attrs q{};
  q.stride[0] = q.stride[1] = 1, q.window[0] = q.window[1] = 2, q.padding[2] = 1;
  kiln_tensor *ay = kiln_zeros(KILN_F32, KILN_SHAPE(1, 2, 3, 1));
  kiln_tensor *ain[1] = {x};
  ASSERT_EQ(kiln_debug_cuda_window(OP_AVG_POOL2D, &q, 1, ain, ay), 0) << error();
  EXPECT_EQ(values(ay), (VD{(1 + 4) / 2.0, 3, 4, (4 + 7) / 2.0, 6, 7}));
}

// Empty batches: nothing to compute for conv2d, zeros for the filter
// gradient (empty sums), on the host and in the launch plan.
TEST(CudaWindow, EmptyBatches) {
  WinGpuTest s;
  op_attrs a{};
  a.stride[0] = a.stride[1] = a.dilation[0] = a.dilation[1] = a.groups = 1;
  a.rank = 4, a.shape[0] = 3, a.shape[1] = 3, a.shape[2] = 2, a.shape[3] = 4;
  kiln_tensor *in[2] = {kiln_ones(KILN_F32, KILN_SHAPE(0, 5, 5, 2)), kiln_ones(KILN_F32, KILN_SHAPE(0, 3, 3, 4))};
  kiln_tensor *df = kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 2, 4));
  ASSERT_EQ(kiln_debug_cuda_window(OP_CONV2D_BP_FILTER, &a, 2, in, df), 0) << error();
  EXPECT_EQ(values(df), VD(72, 0.0));
  Kir k(
      "func @f(%x: f32[0,5,5,2], %w: f32[3,3,2,4], %dy: f32[0,3,3,4]) -> (f32[0,3,3,4], f32[3,3,2,4]) {\n"
      "  %y = conv2d %x, %w {stride=[1,1], dilation=[1,1], padding=[0,0,0,0], groups=1} : f32[0,3,3,4]\n"
      "  %g = conv2d_backprop_filter %x, %dy {shape=[3,3,2,4], stride=[1,1], dilation=[1,1], "
      "padding=[0,0,0,0], groups=1} : f32[3,3,2,4]\n"
      "  return %y, %g\n"
      "}\n");
  cuda_program *p = cuda_compile(k.f(), "sm_90");
  ASSERT_NE(p, nullptr) << error();
  kiln_tensor *args[3] = {on("gpu:0", in[0]), on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 2, 4))),
                          on("gpu:0", in[1])};
  kiln_tensor *out[2] = {nullptr, nullptr};
  ASSERT_EQ(cuda_program_run(p, 0, args, out), 0) << error();
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 1u) << "the empty conv launches nothing; the filter gradient writes its zeros";
  EXPECT_EQ(l[0].ptr[0], (unsigned long long)(uintptr_t)data_of(out[1]));
  cuda_program_free(p);
}

// The filter gradient's two passes (partials per range of rows, then their
// sum) compute what one pass does.
TEST(CudaWindow, ASplitFilterGradientSumsItsPartials) {
  Scoped s;
  std::mt19937 rng(7);
  // 2 x 3 x 2 x 4 filter elements over 3 x 20 rows: split in ranges of 4 rows
  op_attrs a{};
  a.stride[0] = a.stride[1] = a.dilation[0] = a.dilation[1] = 1, a.groups = 2;
  a.padding[0] = a.padding[1] = 1, a.padding[2] = a.padding[3] = 1;
  a.rank = 4, a.shape[0] = 2, a.shape[1] = 3, a.shape[2] = 2, a.shape[3] = 4;
  WinCase c;
  c.op = OP_CONV2D_BP_FILTER;
  c.a = a;
  c.in = {window_input(rng, KILN_F64, {3, 19, 6, 4}, false), window_input(rng, KILN_F64, {3, 20, 6, 4}, false)};
  c.out.dtype = KILN_F64, c.out.rank = 4;
  for (int d = 0; d < 4; d++) c.out.shape[d] = a.shape[d];
  kiln_tensor *want = window_cpu(c), *got = window_emulated(c);
  ASSERT_NE(want, nullptr) << error();
  ASSERT_NE(got, nullptr) << error();
  EXPECT_TRUE(allclose(got, want, 1e-12, 1e-12));

  // the compiled program has the two kernels
  Kir k(
      "func @f(%x: f64[3,19,6,4], %dy: f64[3,20,6,4]) -> f64[2,3,2,4] {\n"
      "  %df = conv2d_backprop_filter %x, %dy {shape=[2,3,2,4], stride=[1,1], dilation=[1,1], padding=[1,1,1,1], "
      "groups=2} : f64[2,3,2,4]\n"
      "  return %df\n"
      "}\n");
  cuda_program *p = cuda_compile(k.f(), "sm_90");
  ASSERT_NE(p, nullptr) << error();
  EXPECT_EQ(cuda_program_kernels(p), 2);
  EXPECT_GE(p->arena_bytes, 15u * 48 * 8) << "15 ranges of 4 rows, 48 elements, 8 bytes a partial";
  cuda_program_free(p);
}

// ---- compiled programs ----

// Every window op is a kernel of its own: no host step, no atomics.
TEST(CudaWindow, EveryWindowOpIsAKernel) {
  Scoped s;
  const char *ops[] = {
      "%r = conv2d %x, %f {stride=[2,1], dilation=[1,2], padding=[1,0,2,1], groups=2} : f32[2,3,5,6]",
      "%r = conv2d_backprop_input %y, %f {shape=[2,7,6,4], stride=[2,1], dilation=[1,2], padding=[1,0,2,1], "
      "groups=2} : f32[2,7,6,4]",
      "%r = max_pool2d %x {window=[3,2], stride=[2,2], padding=[1,1,0,1]} : f32[2,4,3,4]",
      "%r = avg_pool2d %x {window=[3,2], stride=[2,2], padding=[1,1,0,1]} : f32[2,4,3,4]",
      "%r = max_pool2d_grad %x, %p {window=[3,2], stride=[2,2], padding=[1,1,0,1]} : f32[2,7,6,4]",
      "%r = avg_pool2d_grad %p {shape=[2,7,6,4], window=[3,2], stride=[2,2], padding=[1,1,0,1]} : f32[2,7,6,4]",
  };
  for (const char *op : ops) {
    SCOPED_TRACE(op);
    std::string body = op;
    std::string type = body.substr(body.rfind(": ") + 2);
    Kir k("func @f(%x: f32[2,7,6,4], %f: f32[3,3,2,6], %y: f32[2,3,5,6], %p: f32[2,4,3,4]) -> " + type + " {\n  " +
          body + "\n  return %r\n}\n");
    ASSERT_NE(k.f(), nullptr);
    cuda_program *p = cuda_compile(k.f(), "sm_80");
    ASSERT_NE(p, nullptr) << error();
    EXPECT_EQ(cuda_program_unsupported(p), 0) << error();
    EXPECT_EQ(cuda_program_kernels(p), 1);
    ASSERT_EQ(p->n_steps, 1);
    const cuda_step &st = p->steps[0];
    EXPECT_EQ(st.kind, CUDA_STEP_KERNEL);
    EXPECT_EQ(st.bufs[0].kind, CUDA_REF_RESULT);
    for (int q = 1; q < st.n_bufs; q++) EXPECT_EQ(st.bufs[q].kind, CUDA_REF_PARAM);
    int64_t n = 1;
    for (int d = 0; d < p->result_types[0].rank; d++) n *= p->result_types[0].shape[d];
    EXPECT_EQ(st.grid[0], (unsigned)((n + 255) / 256)) << "a thread per output element";
    EXPECT_EQ(st.block[0], 256u);
    EXPECT_EQ(st.op, OP_COUNT) << "a window kernel raises no error word";
    std::string ptx = cuda_program_ptx(p);
    EXPECT_EQ(ptx.find("atom."), std::string::npos) << "deterministic sums: no atomics";
    cuda_program_free(p);
  }
}

// A small convnet's forward pass, staged: conv, bias and relu (a fused
// kernel), pooling, all on the GPU, launched in order with the plan's
// device pointers.
TEST(CudaWindow, AConvNetsForwardPassLaunchesItsKernels) {
  WinGpuTest s;
  Kir k(
      "func @k(%c: f32[2,8,8,4], %b: f32[4]) -> f32[2,8,8,4] {\n"
      "  %a = add %c, %b : f32[2,8,8,4]\n"
      "  %z = constant dense<0.0> : f32[]\n"
      "  %r = max %a, %z : f32[2,8,8,4]\n"
      "  return %r\n"
      "}\n"
      "func @f(%x: f32[2,8,8,3], %w: f32[3,3,3,4], %b: f32[4]) -> f32[2,4,4,4] {\n"
      "  %c = conv2d %x, %w {stride=[1,1], dilation=[1,1], padding=[1,1,1,1], groups=1} : f32[2,8,8,4]\n"
      "  %r = fusion @k(%c, %b) : f32[2,8,8,4]\n"
      "  %p = max_pool2d %r {window=[2,2], stride=[2,2], padding=[0,0,0,0]} : f32[2,4,4,4]\n"
      "  return %p\n"
      "}\n");
  ASSERT_NE(k.f(), nullptr);
  cuda_program *p = cuda_compile(k.f(), "sm_90");
  ASSERT_NE(p, nullptr) << error();
  EXPECT_EQ(cuda_program_unsupported(p), 0) << error();
  kiln_tensor *args[3] = {on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(2, 8, 8, 3))),
                          on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 3, 4))),
                          on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(4)))};
  kiln_tensor *out = nullptr;
  ASSERT_EQ(cuda_program_run(p, 0, args, &out), 0) << error();
  EXPECT_EQ(shape_of(out), (V64{2, 4, 4, 4}));
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 3u) << "conv2d, bias + relu, max_pool2d";
  EXPECT_EQ(l[0].ptr[1], (unsigned long long)(uintptr_t)data_of(args[0])) << "the conv reads x";
  EXPECT_EQ(l[0].ptr[2], (unsigned long long)(uintptr_t)data_of(args[1])) << "and the filter";
  EXPECT_EQ(l[1].ptr[1], l[0].ptr[0]) << "the epilogue reads the conv's output";
  EXPECT_EQ(l[2].ptr[0], (unsigned long long)(uintptr_t)data_of(out)) << "the pool writes the result";
  for (const fake_launch &x : l) EXPECT_EQ(x.bad_params, 0) << x.name;
  cuda_program_free(p);
}

// A filter gradient of few elements over many rows: partials per range of
// rows into the arena, then a kernel adding each element's in order. Of
// many elements: one kernel.
TEST(CudaWindow, AFilterGradientLaunchesPartialsThenTheirSum) {
  WinGpuTest s;
  Kir k(
      "func @f(%x: f32[8,32,32,3], %dy: f32[8,32,32,16]) -> f32[3,3,3,16] {\n"
      "  %df = conv2d_backprop_filter %x, %dy {shape=[3,3,3,16], stride=[1,1], dilation=[1,1], "
      "padding=[1,1,1,1], groups=1} : f32[3,3,3,16]\n"
      "  return %df\n"
      "}\n");
  ASSERT_NE(k.f(), nullptr);
  cuda_program *p = cuda_compile(k.f(), "sm_90");
  ASSERT_NE(p, nullptr) << error();
  kiln_tensor *args[2] = {on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(8, 32, 32, 3))),
                          on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(8, 32, 32, 16)))};
  kiln_tensor *out = nullptr;
  ASSERT_EQ(cuda_program_run(p, 0, args, &out), 0) << error();
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 2u);
  // 432 elements, 4 output channels a thread, 256 rows (n, oy): 64 ranges of 4 rows
  EXPECT_EQ(l[0].grid[0], (unsigned)(64 * 432 / 4 + 255) / 256);
  EXPECT_EQ(l[0].n_params, 4) << "partials, x, dy, the error word";
  EXPECT_EQ(l[0].ptr[1], (unsigned long long)(uintptr_t)data_of(args[0]));
  EXPECT_EQ(l[0].ptr[2], (unsigned long long)(uintptr_t)data_of(args[1]));
  EXPECT_NE(l[0].ptr[0], (unsigned long long)(uintptr_t)data_of(out)) << "the partials are in the arena";
  EXPECT_EQ(l[1].n_params, 3) << "result, partials, the error word";
  EXPECT_EQ(l[1].ptr[0], (unsigned long long)(uintptr_t)data_of(out));
  EXPECT_EQ(l[1].ptr[1], l[0].ptr[0]) << "the sum reads the partials";
  EXPECT_EQ(l[1].grid[0], (432u + 255) / 256);
  EXPECT_EQ(l[0].bad_params + l[1].bad_params, 0);
  EXPECT_GE(p->arena_bytes, 64u * 432 * 8);
  cuda_program_free(p);

  // 3 x 3 x 64 x 128 elements: a thread each is plenty
  Kir big(
      "func @f(%x: f32[1,4,4,64], %dy: f32[1,4,4,128]) -> f32[3,3,64,128] {\n"
      "  %df = conv2d_backprop_filter %x, %dy {shape=[3,3,64,128], stride=[1,1], dilation=[1,1], "
      "padding=[1,1,1,1], groups=1} : f32[3,3,64,128]\n"
      "  return %df\n"
      "}\n");
  cuda_program *q = cuda_compile(big.f(), "sm_90");
  ASSERT_NE(q, nullptr) << error();
  EXPECT_EQ(cuda_program_kernels(q), 1);
  EXPECT_EQ(q->arena_bytes, 0u);
  cuda_program_free(q);
}

// ---- eager ----

// An eager conv on a GPU compiles one program per (attributes, shapes):
// another stride, padding, dilation or group count is another program.
TEST(CudaWindow, EagerWindowOpsCompileOncePerAttributes) {
  WinGpuTest s;
  kiln_tensor *x = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(2, 9, 9, 4)));
  kiln_tensor *f = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 2, 4)));
  OnGpu g;
  cuda_eager_stats e0 = eager();
  kiln_conv_opts o{};
  o.groups = 2;
  kiln_tensor *y = kiln_conv2d(x, f, &o);
  ASSERT_NE(y, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(y), "gpu:0");
  EXPECT_EQ(shape_of(y), (V64{2, 7, 7, 4}));
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0].n_params, 4) << "out, x, filter, the error word";
  EXPECT_EQ(l[0].ptr[0], (unsigned long long)(uintptr_t)data_of(y));
  EXPECT_EQ(l[0].ptr[1], (unsigned long long)(uintptr_t)data_of(x));
  EXPECT_EQ(l[0].ptr[2], (unsigned long long)(uintptr_t)data_of(f));
  EXPECT_EQ(l[0].grid[0], (2u * 7 * 7 * 4 + 255) / 256);
  EXPECT_EQ(eager().compiles, e0.compiles + 1);
  ASSERT_NE(kiln_conv2d(x, f, &o), nullptr) << error();
  EXPECT_EQ(eager().compiles, e0.compiles + 1) << "the same conv again: a hit";

  // padding that keeps the output's shape: another program all the same
  kiln_conv_opts o2 = o;
  o2.padding[0] = 1;  // top 1, bottom 0 ...
  kiln_tensor *y2 = kiln_conv2d(x, f, &o2);
  ASSERT_NE(y2, nullptr) << error();
  kiln_conv_opts o3 = o;
  o3.padding[1] = 1;  // ... or bottom 1, top 0: the same shape
  kiln_tensor *y3 = kiln_conv2d(x, f, &o3);
  ASSERT_NE(y3, nullptr) << error();
  EXPECT_EQ(shape_of(y2), shape_of(y3));
  EXPECT_EQ(eager().compiles, e0.compiles + 3);
  kiln_conv_opts o4 = o;
  o4.stride[0] = 2;
  ASSERT_NE(kiln_conv2d(x, f, &o4), nullptr) << error();
  kiln_conv_opts o5 = o;
  o5.dilation[1] = 2;
  ASSERT_NE(kiln_conv2d(x, f, &o5), nullptr) << error();
  kiln_conv_opts o6{};
  o6.groups = 4;  // depthwise
  kiln_tensor *fd = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 1, 4)));
  ASSERT_NE(kiln_conv2d(x, fd, &o6), nullptr) << error();
  EXPECT_EQ(eager().compiles, e0.compiles + 6);

  // pooling: the window is an attribute too
  int w2[2] = {2, 2}, w3[2] = {3, 3};
  kiln_conv_opts po{};
  po.stride[0] = po.stride[1] = 1;
  ASSERT_NE(kiln_max_pool2d(x, w2, &po), nullptr) << error();
  ASSERT_NE(kiln_avg_pool2d(x, w2, &po), nullptr) << error();
  kiln_tensor *m3 = kiln_max_pool2d(x, w3, &po);
  ASSERT_NE(m3, nullptr) << error();
  EXPECT_EQ(shape_of(m3), (V64{2, 7, 7, 4}));
  EXPECT_EQ(eager().compiles, e0.compiles + 9);
  int64_t hw[2] = {9, 9};
  kiln_tensor *dx = kiln_conv2d_transpose(y, f, hw, &o);
  ASSERT_NE(dx, nullptr) << error();
  EXPECT_EQ(shape_of(dx), (V64{2, 9, 9, 4}));
  EXPECT_STREQ(kiln_tensor_device(dx), "gpu:0");
  for (const fake_launch &q : launches()) EXPECT_EQ(q.bad_params, 0) << q.name;
}

// The gradients of a conv and a pool taken on a GPU run there: the tape's
// backward ops are the window ops' GPU kernels.
TEST(CudaWindow, GradientsOfAConvRunOnTheGpu) {
  WinGpuTest s;
  kiln_tensor *x = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(1, 6, 6, 2)));
  kiln_tensor *f = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 2, 3)));
  OnGpu g;
  kiln_tape *tape = kiln_tape_begin(false);
  ASSERT_NE(tape, nullptr) << error();
  kiln_tape_watch(tape, x);
  kiln_tape_watch(tape, f);
  kiln_conv_opts o{};
  o.padding[0] = o.padding[1] = o.padding[2] = o.padding[3] = 1;
  int w[2] = {2, 2};
  kiln_conv_opts po{};
  po.stride[0] = po.stride[1] = 2;
  kiln_tensor *loss = kiln_reduce_sum(kiln_max_pool2d(kiln_conv2d(x, f, &o), w, &po), 0, nullptr, false);
  ASSERT_NE(loss, nullptr) << error();
  kiln_tape_end(tape);
  kiln_tensor *srcs[2] = {x, f}, *grads[2] = {nullptr, nullptr};
  clear_launches();
  ASSERT_EQ(kiln_tape_gradient(tape, loss, 2, srcs, grads), 0) << error();
  kiln_tape_free(tape);
  ASSERT_NE(grads[0], nullptr);
  ASSERT_NE(grads[1], nullptr);
  EXPECT_STREQ(kiln_tensor_device(grads[0]), "gpu:0");
  EXPECT_EQ(shape_of(grads[0]), (V64{1, 6, 6, 2}));
  EXPECT_EQ(shape_of(grads[1]), (V64{3, 3, 2, 3}));
  EXPECT_GE(launches().size(), 3u) << "max_pool2d_grad, conv2d_backprop_input, conv2d_backprop_filter at least";
}

// ---- the PTX cache ----

// Programs that differ only in a window attribute (the output's shape the
// same) are separate entries of the disk cache.
TEST(CudaWindow, ThePtxCacheKeepsAttributesApart) {
  Scoped s;
  char t[] = "/tmp/kiln-window-cache-XXXXXX";
  ASSERT_NE(mkdtemp(t), nullptr);
  EnvGuard env("KILN_CACHE_DIR", t);
  auto prog = [](const char *padding) {
    return std::string(
               "func @f(%x: f32[1,6,6,2], %w: f32[3,3,2,2]) -> f32[1,5,4,2] {\n"
               "  %c = conv2d %x, %w {stride=[1,1], dilation=[1,1], padding=") +
           padding + ", groups=1} : f32[1,5,4,2]\n  return %c\n}\n";
  };
  Kir a(prog("[1,0,0,0]")), b(prog("[0,1,0,0]"));
  cuda_program *p1 = cuda_compile(a.f(), "sm_90");
  ASSERT_NE(p1, nullptr) << error();
  EXPECT_FALSE(cuda_program_from_cache(p1));
  cuda_program *p2 = cuda_compile(b.f(), "sm_90");
  ASSERT_NE(p2, nullptr) << error();
  EXPECT_FALSE(cuda_program_from_cache(p2)) << "other padding, another entry";
  cuda_program *p3 = cuda_compile(a.f(), "sm_90");
  ASSERT_NE(p3, nullptr) << error();
  EXPECT_TRUE(cuda_program_from_cache(p3));
  EXPECT_EQ(std::string(cuda_program_ptx(p3)), std::string(cuda_program_ptx(p1)));
  EXPECT_NE(std::string(cuda_program_ptx(p1)), std::string(cuda_program_ptx(p2)));
  cuda_program_free(p1);
  cuda_program_free(p2);
  cuda_program_free(p3);
  std::error_code ec;
  std::filesystem::remove_all(t, ec);
}

// ---- bad inputs ----

TEST(CudaWindow, BadInputsAreTheOpsErrors) {
  WinGpuTest s;
  kiln_tensor *x = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(1, 5, 5, 4)));
  kiln_tensor *f3 = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 3, 2)));
  kiln_tensor *big = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(7, 7, 4, 2)));
  OnGpu g;
  EXPECT_EQ(kiln_conv2d(x, f3, nullptr), nullptr) << "4 channels, a filter for 3";
  EXPECT_THAT(error(), StartsWith("conv2d: "));
  EXPECT_EQ(kiln_conv2d(x, big, nullptr), nullptr) << "a window larger than the image";
  EXPECT_THAT(error(), StartsWith("conv2d: "));
  kiln_conv_opts o{};
  o.groups = 3;
  EXPECT_EQ(kiln_conv2d(x, f3, &o), nullptr) << "3 groups of 4 channels";
  EXPECT_THAT(error(), StartsWith("conv2d: "));
  o = kiln_conv_opts{};
  o.padding[0] = -1;
  kiln_tensor *f4 = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 4, 2)));
  EXPECT_EQ(kiln_conv2d(x, f4, &o), nullptr) << "negative padding";
  EXPECT_THAT(error(), StartsWith("conv2d: "));
  int w[2] = {6, 6};
  EXPECT_EQ(kiln_max_pool2d(x, w, nullptr), nullptr);
  EXPECT_THAT(error(), StartsWith("max_pool2d: "));
  EXPECT_TRUE(launches().empty()) << "nothing reaches the GPU";

  // the host check of the kernels refuses what is not a window op's call
  kiln_tensor *cx = kiln_ones(KILN_F32, KILN_SHAPE(1, 5, 5, 4)), *cf = kiln_ones(KILN_F32, KILN_SHAPE(3, 3, 4, 2));
  kiln_tensor *in[2] = {cx, cf};
  op_attrs a{};
  a.stride[0] = a.stride[1] = a.dilation[0] = a.dilation[1] = a.groups = 1;
  kiln_tensor *wrong = kiln_zeros(KILN_F32, KILN_SHAPE(1, 4, 4, 2));
  EXPECT_EQ(kiln_debug_cuda_window(OP_CONV2D, &a, 2, in, wrong), -1);
  EXPECT_THAT(error(), HasSubstr("not of the inferred type"));
  EXPECT_EQ(kiln_debug_cuda_window(OP_ADD, &a, 2, in, wrong), -1);
  EXPECT_THAT(error(), HasSubstr("not a window op"));
  EXPECT_EQ(kiln_debug_cuda_window(OP_CONV2D, &a, 1, in, wrong), -1);
  EXPECT_THAT(error(), HasSubstr("bad arguments"));
  a.groups = 3;
  EXPECT_EQ(kiln_debug_cuda_window(OP_CONV2D, &a, 2, in, wrong), -1);
  EXPECT_THAT(error(), StartsWith("conv2d: ")) << "the op table's inference";
}
