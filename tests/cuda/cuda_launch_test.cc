// cuda_launch_test.cc — running compiled code on a GPU (backends/cuda/launch.c,
// eager.c, the GPU branch of jit/compile.c) against tests/fake_cuda. The fake
// loads PTX and records launches but cannot execute a kernel, so what a
// kernel computes is NOT checked here (tests/cuda/cuda_gpu_test.cc does that
// on a real GPU); checked is all the plumbing: which kernels are launched, in
// which order, with which launch shape and device pointers, module loading
// and caching, the error word, host steps, and driver errors.
//
// Part of the cuda_runtime_test executable (its main points the runtime at
// the fake driver).
#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>
#include <gmock/gmock.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "cuda_test_util.h"
#include "cuda/cuda_rt.h"
#include "cuda/ptx.h"
#include "fake_access.h"

extern "C" const ir_func *jit_optimized_func(kiln_function *f, int trace);

using namespace kiln_test;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

cuda_eager_stats eager() {
  cuda_eager_stats s{};
  kiln_debug_cuda_eager_stats(&s);
  return s;
}

// Pushes a device scope for one block.
struct OnDevice {
  explicit OnDevice(const char *d) { EXPECT_EQ(kiln_device_push(d), 0) << error(); }
  ~OnDevice() { kiln_device_pop(); }
};

// Fake state reset around each test; no context left pushed.
struct GpuTest : Scoped {
  GpuTest() {
    clear_launches();
    fail_launch(nullptr, 0);
    launch_write(nullptr, 0);
  }
  ~GpuTest() {
    fail_launch(nullptr, 0);
    launch_write(nullptr, 0);
    EXPECT_EQ(ctx_depth(), 0) << "a CUDA context was left current";
  }
};

// out0 = reduce_sum(exp(x) * y, axis 1), out1 = matmul(x, w) + 1
int two_outputs(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int axis = 1;
  out[0] = kiln_reduce_sum(kiln_mul(kiln_exp(in[0]), in[1]), 1, &axis, false);
  out[1] = kiln_add(kiln_matmul(in[0], in[2]), kiln_scalar_like(in[0], 1));
  return out[0] && out[1] ? 0 : -1;
}

struct Fn {
  kiln_function *f;
  Fn(const char *name, kiln_body_fn body, int n_in, int n_out) : f(kiln_function_new(name, body, nullptr, n_in, n_out)) {}
  ~Fn() { kiln_function_free(f); }
};

}  // namespace

// ---- staged calls ----

TEST(CudaStaged, KernelsLaunchInScheduleOrderWithThePlansShapes) {
  GpuTest s;
  Fn fn("two", two_outputs, 3, 2);
  std::vector<float> xv(64 * 40, 0.5f), wv(40 * 24, 0.25f);
  kiln_tensor *x = on("gpu:0", f32({64, 40}, xv)), *y = on("gpu:0", f32({64, 40}, xv)),
              *w = on("gpu:0", f32({40, 24}, wv));
  kiln_tensor *in[3] = {x, y, w}, *out[2] = {nullptr, nullptr};
  long loads = calls("cuModuleLoadData"), live = modules_live();
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(fn.f, in, out), 0) << error();
  }
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 1) << "the trace's PTX is loaded once";
  EXPECT_EQ(modules_live(), live + 1);
  ASSERT_NE(out[0], nullptr);
  EXPECT_STREQ(kiln_tensor_device(out[0]), "gpu:0");
  EXPECT_STREQ(kiln_tensor_device(out[1]), "gpu:0");
  EXPECT_EQ(shape_of(out[0]), (V64{64}));
  EXPECT_EQ(shape_of(out[1]), (V64{64, 24}));

  // the plan of the optimized trace, as compile.c compiled it for gpu:0 (9.0)
  const ir_func *opt = jit_optimized_func(fn.f, 0);
  ASSERT_NE(opt, nullptr) << error();
  cuda_program *p = cuda_compile(opt, "sm_90");
  ASSERT_NE(p, nullptr) << error();
  std::vector<const cuda_step *> want;
  for (int i = 0; i < p->n_steps; i++)
    if (p->steps[i].kind == CUDA_STEP_KERNEL && p->steps[i].grid[0]) want.push_back(&p->steps[i]);
  ASSERT_GE(want.size(), 2u) << "a reduction and a dot at least";
  std::vector<fake_launch> got = launches();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); i++) {
    SCOPED_TRACE(want[i]->name);
    EXPECT_STREQ(got[i].name, want[i]->name) << "schedule order";
    EXPECT_EQ(got[i].dev, 0);
    for (int k = 0; k < 3; k++) {
      EXPECT_EQ(got[i].grid[k], want[i]->grid[k]);
      EXPECT_EQ(got[i].block[k], want[i]->block[k]);
    }
    EXPECT_EQ(got[i].shared_bytes, want[i]->shared_bytes);
    EXPECT_EQ(got[i].n_params, want[i]->n_bufs + 1) << "its buffers, then the error word";
    EXPECT_EQ(got[i].bad_params, 0) << "every buffer is memory of gpu:0";
  }
  cuda_program_free(p);

  // a second call: no new module, the same launches again
  clear_launches();
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(fn.f, in, out), 0) << error();
  }
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 1);
  EXPECT_EQ(launches().size(), want.size());
  EXPECT_EQ(kiln_function_trace_count(fn.f), 1);
  kiln_stats st;
  ASSERT_EQ(kiln_function_stats(fn.f, 0, &st), 0) << error();
  EXPECT_GT(st.compile_ms, 0.0);

  // CPU inputs under gpu:0: copied there, and the call runs there
  long htod = calls("cuMemcpyHtoDAsync");
  kiln_tensor *cin[3] = {f32({64, 40}, xv), f32({64, 40}, xv), f32({40, 24}, wv)};
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(fn.f, cin, out), 0) << error();
  }
  EXPECT_STREQ(kiln_tensor_device(out[1]), "gpu:0");
  EXPECT_GE(calls("cuMemcpyHtoDAsync"), htod + 3);
}

TEST(CudaStaged, Gpu1IsAnAmpereAndGetsSm80) {
  GpuTest s;
  Fn fn("two1", two_outputs, 3, 2);
  kiln_tensor *in[3] = {kiln_ones(KILN_F32, KILN_SHAPE(8, 4)), kiln_ones(KILN_F32, KILN_SHAPE(8, 4)),
                        kiln_ones(KILN_F32, KILN_SHAPE(4, 2))};
  kiln_tensor *out[2];
  {
    // the fake refuses PTX for a newer .target than the device's
    OnDevice d("gpu:1");
    ASSERT_EQ(kiln_function_call(fn.f, in, out), 0) << error();
  }
  for (const fake_launch &l : launches()) EXPECT_EQ(l.dev, 1) << l.name;
  EXPECT_STREQ(kiln_tensor_device(out[0]), "gpu:1");
  char *ptx = kiln_function_ir(fn.f, 0, "ptx");
  ASSERT_NE(ptx, nullptr) << error();
  free(ptx);
}

TEST(CudaStaged, AFailingLaunchIsAnErrorNamingTheKernelsOp) {
  GpuTest s;
  Fn fn("fails", two_outputs, 3, 2);
  kiln_tensor *in[3] = {on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(5, 3))),
                        on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(5, 3))),
                        on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3, 2)))};
  kiln_tensor *out[2] = {nullptr, nullptr};
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(fn.f, in, out), 0) << error();  // traced, compiled, loaded
  }
  size_t in_use = mem(0).in_use;
  fail_launch(nullptr, CUDA_ERROR_LAUNCH_FAILED);
  {
    OnDevice d("gpu:0");
    EXPECT_EQ(kiln_function_call(fn.f, in, out), -1);
  }
  EXPECT_THAT(error(), HasSubstr("cuda: @fails"));
  EXPECT_THAT(error(), HasSubstr(": kernel0 ("));
  EXPECT_THAT(error(), HasSubstr("): CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure (cuLaunchKernel)"));
  EXPECT_EQ(mem(0).in_use, in_use) << "results and arena went back";
  fail_launch(nullptr, 0);
  kiln_clear_error();
  OnDevice d("gpu:0");
  EXPECT_EQ(kiln_function_call(fn.f, in, out), 0) << error();
}

// A host callback inside a GPU trace: its input comes from the GPU, its
// output goes back there. Values can be checked: no kernel computes them.
int twice_on_host(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  ++*(int *)user;
  std::vector<float> v((size_t)kiln_tensor_size(in[0]));
  if (kiln_tensor_read(in[0], v.data(), v.size() * 4)) return -1;
  for (float &x : v) x *= 2;
  int64_t shape[1] = {(int64_t)v.size()};
  out[0] = kiln_tensor_new(KILN_F32, 1, shape, v.data());
  return out[0] ? 0 : -1;
}

int with_host_call(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_spec spec = {KILN_F32, 1, {3}};
  if (kiln_host_call(twice_on_host, user, 1, in, 1, &spec, &out[0])) return -1;
  out[1] = kiln_exp(out[0]);
  return out[1] ? 0 : -1;
}

TEST(CudaStaged, HostCallsRunOnTheHostBetweenKernels) {
  GpuTest s;
  int ran = 0;
  kiln_function *f = kiln_function_new("hosted", with_host_call, &ran, 1, 2);
  kiln_tensor *x = on("gpu:0", f32({3}, {1, 2, 3})), *out[2];
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(f, &x, out), 0) << error();
  }
  EXPECT_EQ(ran, 1);
  EXPECT_STREQ(kiln_tensor_device(out[0]), "gpu:0");
  EXPECT_EQ(values(out[0]), (VD{2, 4, 6})) << "the callback's output, copied to the GPU";
  EXPECT_STREQ(kiln_tensor_device(out[1]), "gpu:0");
  ASSERT_EQ(launches().size(), 1u) << "exp after the callback";
  kiln_function_free(f);
}

int draw(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_random_uniform(KILN_F32, kiln_tensor_rank(in[0]), kiln_tensor_shape(in[0]), -1, 1);
  return out[0] ? 0 : -1;
}

int softmax_loss(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_sparse_softmax_cross_entropy(in[0], in[1]);
  return out[0] ? 0 : -1;
}

// A bad label on a GPU fails as on the CPU, naming the op and the label
// (the staged check is a host step: the labels are read back each call).
TEST(CudaStaged, ABadLabelNamesTheOpAndTheLabel) {
  GpuTest s;
  kiln_tensor *logits = on("gpu:0", f32({3, 4}, std::vector<float>(12, 0.5f)));
  kiln_tensor *bad = on("gpu:0", i32({3}, {1, -1, 2})), *bad64 = on("gpu:0", i64({3}, {0, 1, 4}));
  {
    OnDevice d("gpu:0");
    EXPECT_EQ(kiln_sparse_softmax_cross_entropy(bad, logits), nullptr);
    EXPECT_EQ(error(), "sparse_softmax_cross_entropy: labels[1] = -1 is not in [0, 4)");
  }
  Fn f("loss", softmax_loss, 2, 1);
  kiln_tensor *in[2] = {bad, logits}, *out = nullptr;
  {
    OnDevice d("gpu:0");
    EXPECT_EQ(kiln_function_call(f.f, in, &out), -1);
    EXPECT_EQ(error(), "@loss: sparse_softmax_cross_entropy: labels[1] = -1 is not in [0, 4)");
    in[0] = bad64;
    EXPECT_EQ(kiln_function_call(f.f, in, &out), -1);
    EXPECT_EQ(error(), "@loss: sparse_softmax_cross_entropy: labels[2] = 4 is not in [0, 4)");
  }
}

// Control flow on a GPU (compiled, and interpreted with KILN_BACKEND=interp):
// cuda_control_test.cc.

TEST(CudaStaged, RandomDrawsMatchTheCpus) {
  GpuTest s;
  Fn fn("draw", draw, 1, 1);
  kiln_tensor *shape = kiln_zeros(KILN_F32, KILN_SHAPE(5, 3)), *cpu = nullptr, *gpu = nullptr;
  kiln_random_seed(42);
  ASSERT_EQ(kiln_function_call(fn.f, &shape, &cpu), 0) << error();
  kiln_random_seed(42);
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(fn.f, &shape, &gpu), 0) << error();
  }
  EXPECT_STREQ(kiln_tensor_device(gpu), "gpu:0");
  EXPECT_TRUE(same_bits(kiln_to_device(gpu, "cpu:0"), cpu));

  // eagerly too
  kiln_random_seed(7);
  kiln_tensor *c = kiln_random_uniform(KILN_F64, KILN_SHAPE(4, 4), 0, 1);
  kiln_random_seed(7);
  kiln_tensor *g;
  {
    OnDevice d("gpu:0");
    g = kiln_random_uniform(KILN_F64, KILN_SHAPE(4, 4), 0, 1);
  }
  ASSERT_NE(g, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(g), "gpu:0");
  EXPECT_TRUE(same_bits(kiln_to_device(g, "cpu:0"), c));
}

// ---- eager ops ----

TEST(CudaEager, AnOpCompilesOncePerShape) {
  GpuTest s;
  kiln_tensor *a = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(17, 3)));
  cuda_eager_stats e0 = eager();
  long loads = calls("cuModuleLoadData");
  OnDevice d("gpu:0");
  kiln_tensor *r = kiln_add(a, a);
  ASSERT_NE(r, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(r), "gpu:0");
  EXPECT_EQ(shape_of(r), (V64{17, 3}));
  EXPECT_EQ(eager().compiles, e0.compiles + 1);
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 1);
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 1u);
  EXPECT_STREQ(l[0].name, "kernel0");
  EXPECT_EQ(l[0].grid[0], 1u);
  EXPECT_EQ(l[0].block[0], 256u);
  EXPECT_EQ(l[0].n_params, 4) << "out, both operands, the error word";
  EXPECT_EQ(l[0].bad_params, 0);

  // the same op and types: a cache hit, no new module
  kiln_tensor *r2 = kiln_add(r, a);
  ASSERT_NE(r2, nullptr) << error();
  EXPECT_EQ(eager().compiles, e0.compiles + 1);
  EXPECT_EQ(eager().hits, e0.hits + 1);
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 1);
  EXPECT_EQ(launches().size(), 2u);

  // another shape, another op, another attribute: compiled
  kiln_add(on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(18, 3))), a);  // broadcast fails: checked first
  kiln_clear_error();
  ASSERT_NE(kiln_add(on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(3))), a), nullptr) << error();
  ASSERT_NE(kiln_mul(a, a), nullptr) << error();
  int ax0 = 0, ax1 = 1;
  ASSERT_NE(kiln_reduce_sum(a, 1, &ax0, false), nullptr) << error();
  ASSERT_NE(kiln_reduce_sum(a, 1, &ax1, false), nullptr) << error();
  ASSERT_NE(kiln_reduce_sum(a, 1, &ax1, false), nullptr) << error();
  EXPECT_EQ(eager().compiles, e0.compiles + 5);
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 5);

  // a CPU input is copied to the GPU first
  long htod = calls("cuMemcpyHtoDAsync");
  kiln_tensor *m = kiln_matmul(kiln_ones(KILN_F32, KILN_SHAPE(2, 17)), a);
  ASSERT_NE(m, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(m), "gpu:0");
  EXPECT_EQ(shape_of(m), (V64{2, 3}));
  EXPECT_EQ(calls("cuMemcpyHtoDAsync"), htod + 1);
}

TEST(CudaEager, EachGpuLoadsItsOwnModuleForItsArchitecture) {
  GpuTest s;
  kiln_tensor *a0 = on("gpu:0", kiln_ones(KILN_F64, KILN_SHAPE(9))), *a1 = on("gpu:1", kiln_ones(KILN_F64, KILN_SHAPE(9)));
  cuda_eager_stats e0 = eager();
  long loads = calls("cuModuleLoadData");
  {
    OnDevice d("gpu:0");
    ASSERT_NE(kiln_exp(a0), nullptr) << error();
  }
  {
    OnDevice d("gpu:1");
    ASSERT_NE(kiln_exp(a1), nullptr) << error();  // sm_80: the fake refuses sm_90 PTX on gpu:1
    ASSERT_NE(kiln_exp(a0), nullptr) << error();  // a gpu:0 input is copied to gpu:1
  }
  EXPECT_EQ(eager().compiles, e0.compiles + 2) << "one program per architecture";
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 2);
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 3u);
  EXPECT_EQ(l[0].dev, 0);
  EXPECT_EQ(l[1].dev, 1);
  EXPECT_EQ(l[2].dev, 1);
  for (auto &x : l) EXPECT_EQ(x.bad_params, 0);
}

TEST(CudaEager, EveryOpKindRunsOnAGpu) {
  GpuTest s;
  kiln_tensor *x = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(4, 6)));
  kiln_tensor *i = on("gpu:0", i64({3}, {0, 2, 1}));
  kiln_tensor *b = on("gpu:0", kiln_scalar(KILN_BOOL, 1));
  OnDevice d("gpu:0");
  int perm[2] = {1, 0};
  int axes[1] = {1};
  kiln_tensor *parts[2] = {x, x};
  std::vector<std::pair<const char *, kiln_tensor *>> r = {
      {"neg", kiln_neg(x)},
      {"sub", kiln_sub(x, x)},
      {"less", kiln_less(x, x)},
      {"select", kiln_select(b, x, x)},
      {"cast", kiln_cast(x, KILN_BF16)},
      {"broadcast_to", kiln_broadcast_to(x, KILN_SHAPE(2, 4, 6))},
      {"transpose", kiln_transpose(x, 2, perm)},
      {"concat", kiln_concat(2, parts, 0)},
      {"reduce_max", kiln_reduce_max(x, 1, axes, true)},
      {"argmax", kiln_argmax(x, 1)},
      {"matmul", kiln_matmul(x, kiln_transpose(x, 2, perm))},
      {"gather", kiln_gather(x, i, 0)},
      {"arange", kiln_arange(KILN_I32, 10)},
  };
  for (auto &[name, t] : r) {
    EXPECT_NE(t, nullptr) << name << ": " << error();
    if (t) {
      EXPECT_STREQ(kiln_tensor_device(t), "gpu:0") << name;
    }
  }
  for (const fake_launch &l : launches()) EXPECT_EQ(l.bad_params, 0) << l.name;
}

TEST(CudaEager, AFailingLaunchNamesTheOp) {
  GpuTest s;
  kiln_tensor *a = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(5)));
  size_t in_use;
  {
    OnDevice d("gpu:0");
    ASSERT_NE(kiln_add(a, a), nullptr) << error();  // compiled and loaded
    in_use = mem(0).in_use;
    fail_launch("kernel0", CUDA_ERROR_LAUNCH_FAILED);
    EXPECT_EQ(kiln_add(a, a), nullptr);
  }
  EXPECT_EQ(error(), "add: cuda: @add: kernel0 (add): CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure "
                     "(cuLaunchKernel)");
  EXPECT_EQ(mem(0).in_use, in_use) << "the result's block went back";
  fail_launch(nullptr, 0);
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuModuleLoadData=218");
    OnDevice d("gpu:0");
    EXPECT_EQ(kiln_sub(a, a), nullptr);
    EXPECT_EQ(error(), "sub: cuda: @sub: loading its PTX on gpu:0: CUDA_ERROR_INVALID_PTX: a PTX JIT compilation "
                       "failed (cuModuleLoadData)");
  }
  OnDevice d("gpu:0");
  EXPECT_NE(kiln_sub(a, a), nullptr) << "a failed load is retried: " << error();
}

// The fake writes the error word as a failing kernel would; the host finds
// the bad index and reports it as the eager op does.
TEST(CudaEager, TheErrorWordBecomesTheEagerMessage) {
  GpuTest s;
  kiln_tensor *x = on("gpu:0", f32({3, 2}, {0, 1, 2, 3, 4, 5}));
  kiln_tensor *idx = on("gpu:0", i64({2}, {1, 7}));
  OnDevice d("gpu:0");
  launch_write("kernel0", 1);  // step 0 failed
  EXPECT_EQ(kiln_gather(x, idx, 0), nullptr);
  EXPECT_EQ(error(), "gather: indices[1] = 7 is not in [0, 3)");
  kiln_tensor *idx32 = on("gpu:0", i32({3}, {0, -2, 9}));
  EXPECT_EQ(kiln_gather(x, idx32, 0), nullptr);
  EXPECT_EQ(error(), "gather: indices[1] = -2 is not in [0, 3)");
  kiln_tensor *n = on("gpu:0", i32({2}, {4, 5})), *z = on("gpu:0", i32({2}, {1, 0}));
  EXPECT_EQ(kiln_div(n, z), nullptr);
  EXPECT_EQ(error(), "div: integer division by zero");
  EXPECT_EQ(kiln_mod(n, z), nullptr);
  EXPECT_EQ(error(), "mod: integer division by zero");
  launch_write("kernel0", 99);
  EXPECT_EQ(kiln_gather(x, idx, 0), nullptr);
  EXPECT_THAT(error(), HasSubstr("raised the error word 99, which names no step"));
  launch_write(nullptr, 0);
  long syncs = calls("cuStreamSynchronize");
  EXPECT_NE(kiln_gather(x, idx, 0), nullptr) << "the word stayed 0: " << error();
  EXPECT_EQ(calls("cuStreamSynchronize"), syncs + 1) << "a kernel that can fail is waited for";
  syncs = calls("cuStreamSynchronize");
  EXPECT_NE(kiln_add(n, z), nullptr) << error();
  EXPECT_EQ(calls("cuStreamSynchronize"), syncs) << "one that cannot is not";
}

TEST(CudaEager, ManyThreadsShareTheCache) {
  GpuTest s;
  cuda_eager_stats e0 = eager();
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; t++)
    threads.emplace_back([&bad] {
      kiln_scope_push();
      if (kiln_device_push("gpu:0")) bad++;
      for (int i = 0; i < 20; i++) {
        int64_t shape[2] = {31, 1 + i % 4};
        kiln_tensor *a = kiln_to_device(kiln_ones(KILN_I64, 2, shape), "gpu:0");
        kiln_tensor *r = kiln_maximum(a, a);
        if (!r || strcmp(kiln_tensor_device(r), "gpu:0")) bad++;
      }
      kiln_device_pop();
      kiln_scope_pop();
    });
  for (auto &th : threads) th.join();
  EXPECT_EQ(bad.load(), 0) << error();
  cuda_eager_stats e1 = eager();
  EXPECT_EQ(e1.entries, e0.entries + 4) << "four shapes";
  EXPECT_EQ(e1.compiles - e0.compiles + e1.hits - e0.hits, 80);
}

// ---- column reductions: the launch shapes the fake driver sees ----

TEST(CudaStaged, AColumnSumLaunchesPartialsThenTheirSum) {
  GpuTest s;
  Scoped sc;
  ir_module *m = ir_parse(
      "func @f(%x: f32[100000,4]) -> f32[4] {\n"
      "  %s = reduce_sum %x {axes=[0]} : f32[4]\n"
      "  return %s\n"
      "}\n",
      "col.kir");
  ASSERT_NE(m, nullptr) << error();
  cuda_program *p = cuda_compile(m->funcs[0], "sm_90");
  ASSERT_NE(p, nullptr) << error();
  kiln_tensor *x = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(100000, 4)));
  kiln_tensor *out = nullptr;
  ASSERT_EQ(cuda_program_run(p, 0, &x, &out), 0) << error();
  EXPECT_EQ(shape_of(out), (V64{4}));
  std::vector<fake_launch> l = launches();
  ASSERT_EQ(l.size(), 2u);
  EXPECT_EQ(l[0].grid[0], 1u);
  EXPECT_GE(l[0].grid[1], 64u) << "the rows over many blocks";
  EXPECT_EQ(l[0].block[0], 256u);
  EXPECT_EQ(l[0].n_params, 3) << "partials, x, the error word";
  EXPECT_EQ(l[1].grid[0], 1u);
  EXPECT_EQ(l[1].grid[1], 1u);
  EXPECT_EQ(l[1].n_params, 3) << "result, partials, the error word";
  EXPECT_EQ(l[0].bad_params + l[1].bad_params, 0);
  cuda_program_free(p);
  ir_module_free(m);
}

// ---- the disk cache of PTX (ptx_cache.c) ----

namespace {

namespace fs = std::filesystem;

// KILN_CACHE_DIR set for one test (a fresh directory, removed after, when
// make), then put back as it was
std::string fresh_dir() {
  char t[] = "/tmp/kiln-ptx-cache-XXXXXX";
  EXPECT_NE(mkdtemp(t), nullptr);
  return t;
}
struct CacheEnv {
  std::string dir;
  EnvGuard env;
  explicit CacheEnv(const std::string &value, bool make = true)
      : dir(make ? fresh_dir() : ""), env("KILN_CACHE_DIR", make ? dir.c_str() : value.c_str()) {}
  ~CacheEnv() {
    std::error_code ec;
    if (!dir.empty()) fs::remove_all(dir, ec);
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> v;
    std::error_code ec;
    if (dir.empty() || !fs::is_directory(dir, ec)) return v;
    for (const auto &e : fs::directory_iterator(dir))
      if (e.path().extension() == ".kco") v.push_back(e.path().string());
    return v;
  }
};

const char *kCacheProg =
    "func @f(%x: f32[3000,4], %y: f32[3000,4], %i: i64[5]) -> (f32[4], f32[3000,4], f32[5,4], f32[4,4]) {\n"
    "  %m = mul %x, %y : f32[3000,4]\n"
    "  %s = reduce_sum %m {axes=[0]} : f32[4]\n"
    "  %e = exp %x : f32[3000,4]\n"
    "  %g = gather %x, %i {axis=0} : f32[5,4]\n"
    "  %t = transpose %x {perm=[1,0]} : f32[4,3000]\n"
    "  %d = dot %t, %y : f32[4,4]\n"
    "  return %s, %e, %g, %d\n"
    "}\n";

void expect_same_plan(const cuda_program *a, const cuda_program *b) {
  EXPECT_STREQ(a->ptx, b->ptx);
  ASSERT_EQ(a->n_steps, b->n_steps);
  EXPECT_EQ(a->n_kernels, b->n_kernels);
  EXPECT_EQ(a->arena_bytes, b->arena_bytes);
  for (int i = 0; i < a->n_steps; i++) {
    const cuda_step &x = a->steps[i], &y = b->steps[i];
    SCOPED_TRACE("step " + std::to_string(i));
    EXPECT_EQ(x.kind, y.kind);
    EXPECT_STREQ(x.name, y.name);
    for (int k = 0; k < 3; k++) {
      EXPECT_EQ(x.grid[k], y.grid[k]);
      EXPECT_EQ(x.block[k], y.block[k]);
    }
    EXPECT_EQ(x.shared_bytes, y.shared_bytes);
    EXPECT_EQ(x.op, y.op);
    EXPECT_EQ(x.kernel_op, y.kernel_op);
    EXPECT_EQ(x.index_buf, y.index_buf);
    EXPECT_EQ(x.index_count, y.index_count);
    EXPECT_EQ(x.index_dim, y.index_dim);
    EXPECT_EQ(x.index_dtype, y.index_dtype);
    ASSERT_EQ(x.n_bufs, y.n_bufs);
    for (int q = 0; q < x.n_bufs; q++) {
      EXPECT_EQ(x.bufs[q].kind, y.bufs[q].kind);
      EXPECT_EQ(x.bufs[q].index, y.bufs[q].index);
      EXPECT_EQ(x.bufs[q].offset, y.bufs[q].offset);
    }
  }
}

std::string last_ptx() {
  auto get = (size_t(*)(char *, size_t))fake("fake_cuda_last_ptx");
  size_t n = get(nullptr, 0);
  std::string s(n + 1, '\0');
  get(s.data(), s.size());
  s.resize(n);
  return s;
}

}  // namespace

TEST(CudaPtxCache, ASecondCompileReadsThePtxAndLaunchPlan) {
  GpuTest s;
  Scoped sc;
  CacheEnv env("");
  ir_module *m = ir_parse(kCacheProg, "cache.kir");
  ASSERT_NE(m, nullptr) << error();
  const ir_func *f = m->funcs[0];
  cuda_program *cold = cuda_compile(f, "sm_90");
  ASSERT_NE(cold, nullptr) << error();
  EXPECT_FALSE(cuda_program_from_cache(cold));
  EXPECT_EQ(env.entries().size(), 1u);
  cuda_program *warm = cuda_compile(f, "sm_90");
  ASSERT_NE(warm, nullptr) << error();
  EXPECT_TRUE(cuda_program_from_cache(warm));
  expect_same_plan(cold, warm);
  EXPECT_EQ(env.entries().size(), 1u);

  // another architecture is another entry
  cuda_program *other = cuda_compile(f, "sm_80");
  ASSERT_NE(other, nullptr) << error();
  EXPECT_FALSE(cuda_program_from_cache(other));
  EXPECT_THAT(other->ptx, HasSubstr(".target sm_80"));
  EXPECT_EQ(env.entries().size(), 2u);

  // the cached program runs: its PTX is what the driver loads, its launches
  // have the plan's shapes and device pointers
  std::vector<float> xv(3000 * 4, 0.5f);
  std::vector<int64_t> iv = {0, 4, 2999, 7, 7};
  kiln_tensor *x = on("gpu:0", f32({3000, 4}, xv)), *y = on("gpu:0", f32({3000, 4}, xv));
  kiln_tensor *i = on("gpu:0", kiln_tensor_new(KILN_I64, KILN_SHAPE(5), iv.data()));
  kiln_tensor *args[3] = {x, y, i}, *res[4] = {};
  ASSERT_EQ(cuda_program_run(warm, 0, args, res), 0) << error();
  EXPECT_EQ(last_ptx(), std::string(cold->ptx));
  std::vector<fake_launch> l = launches();
  std::vector<const cuda_step *> want;
  for (int k = 0; k < cold->n_steps; k++)
    if (cold->steps[k].kind == CUDA_STEP_KERNEL && cold->steps[k].grid[0]) want.push_back(&cold->steps[k]);
  ASSERT_EQ(l.size(), want.size());
  for (size_t k = 0; k < l.size(); k++) {
    EXPECT_STREQ(l[k].name, want[k]->name);
    for (int d = 0; d < 3; d++) {
      EXPECT_EQ(l[k].grid[d], want[k]->grid[d]);
      EXPECT_EQ(l[k].block[d], want[k]->block[d]);
    }
    EXPECT_EQ(l[k].n_params, want[k]->n_bufs + 1);
    EXPECT_EQ(l[k].bad_params, 0);
  }
  cuda_program_free(cold);
  cuda_program_free(warm);
  cuda_program_free(other);
  ir_module_free(m);
}

TEST(CudaPtxCache, CorruptEntriesAreRebuilt) {
  GpuTest s;
  Scoped sc;
  CacheEnv env("");
  ir_module *m = ir_parse(kCacheProg, "cache.kir");
  ASSERT_NE(m, nullptr) << error();
  const ir_func *f = m->funcs[0];
  cuda_program *cold = cuda_compile(f, "sm_90");
  ASSERT_NE(cold, nullptr) << error();
  ASSERT_EQ(env.entries().size(), 1u);
  std::string path = env.entries()[0];
  auto size = fs::file_size(path);
  // a flipped byte in the middle (the checksum), then a cut-off file, then garbage
  for (int how = 0; how < 3; how++) {
    SCOPED_TRACE(how);
    if (how == 0) {
      std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp((std::streamoff)(size / 2));
      char c = 0;
      io.seekg((std::streamoff)(size / 2));
      io.get(c);
      io.seekp((std::streamoff)(size / 2));
      io.put((char)(c ^ 0x5a));
    } else if (how == 1) {
      fs::resize_file(path, size / 3);
    } else {
      std::ofstream(path, std::ios::binary | std::ios::trunc) << "not an entry";
    }
    cuda_program *p = cuda_compile(f, "sm_90");
    ASSERT_NE(p, nullptr) << error();
    EXPECT_FALSE(cuda_program_from_cache(p)) << "a bad entry is a miss";
    expect_same_plan(cold, p);
    cuda_program_free(p);
    EXPECT_EQ(fs::file_size(path), size) << "and is written again";
    p = cuda_compile(f, "sm_90");
    ASSERT_NE(p, nullptr) << error();
    EXPECT_TRUE(cuda_program_from_cache(p));
    expect_same_plan(cold, p);
    cuda_program_free(p);
  }
  cuda_program_free(cold);
  ir_module_free(m);
}

// PTX is code that runs: the PTX cache reads through the CPU cache's safe
// open, so a FIFO named like an entry (it hung every process: an alarm
// kills this one if it still does), or a link to a valid entry, is a miss
// that the store replaces with a regular file; a directory others may
// write is no cache, said once.
TEST(CudaPtxCache, OnlyRegularEntriesInAPrivateDirectory) {
  GpuTest s;
  Scoped sc;
  CacheEnv env("");
  ir_module *m = ir_parse(kCacheProg, "cache.kir");
  ASSERT_NE(m, nullptr) << error();
  const ir_func *f = m->funcs[0];
  cuda_program *cold = cuda_compile(f, "sm_90");
  ASSERT_NE(cold, nullptr) << error();
  ASSERT_EQ(env.entries().size(), 1u);
  std::string path = env.entries()[0], copy = env.dir + "/copy";
  fs::copy_file(path, copy);
  for (int how = 0; how < 2; how++) {
    SCOPED_TRACE(how == 0 ? "a FIFO" : "a link to a valid entry");
    ASSERT_EQ(unlink(path.c_str()), 0);
    ASSERT_EQ(how == 0 ? mkfifo(path.c_str(), 0600) : symlink(copy.c_str(), path.c_str()), 0);
    alarm(60);
    cuda_program *p = cuda_compile(f, "sm_90");
    alarm(0);
    ASSERT_NE(p, nullptr) << error();
    EXPECT_FALSE(cuda_program_from_cache(p));
    cuda_program_free(p);
    struct stat st;
    ASSERT_EQ(lstat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISREG(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  std::string open_dir = env.dir + "/open";
  ASSERT_EQ(mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(chmod(open_dir.c_str(), 0777), 0);
  EnvGuard g("KILN_CACHE_DIR", open_dir.c_str());
  testing::internal::CaptureStderr();
  for (int k = 0; k < 2; k++) {
    cuda_program *p = cuda_compile(f, "sm_90");
    ASSERT_NE(p, nullptr) << error();
    EXPECT_FALSE(cuda_program_from_cache(p));
    cuda_program_free(p);
  }
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_THAT(err, HasSubstr(open_dir + ": writable by others"));
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  EXPECT_TRUE(fs::is_empty(open_dir));
  cuda_program_free(cold);
  ir_module_free(m);
}

TEST(CudaPtxCache, OffMeansNoCache) {
  Scoped sc;
  for (const char *v : {"off", ""}) {
    CacheEnv env(v, false);
    ir_module *m = ir_parse(kCacheProg, "cache.kir");
    ASSERT_NE(m, nullptr) << error();
    for (int k = 0; k < 2; k++) {
      cuda_program *p = cuda_compile(m->funcs[0], "sm_90");
      ASSERT_NE(p, nullptr) << error();
      EXPECT_FALSE(cuda_program_from_cache(p));
      cuda_program_free(p);
    }
    ir_module_free(m);
  }
}

// KILN_CUDA_TF32=1: an eager f32 matmul loads tensor-core PTX with the same
// launch shape, compiled apart from the default one (the eager cache and
// the disk cache both keep the mode in their keys)
TEST(CudaEager, Tf32IsAModeOfItsOwn) {
  GpuTest s;
  Scoped sc;
  kiln_tensor *a = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(100, 40))), *b = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(40, 70)));
  OnDevice d("gpu:0");
  const char *mma = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32";
  std::vector<std::string> ptx;
  std::vector<fake_launch> l;
  std::vector<long> loads;
  for (const char *mode : {"0", "1", "0"}) {
    setenv("KILN_CUDA_TF32", mode, 1);
    clear_launches();
    long before = calls("cuModuleLoadData");
    ASSERT_NE(kiln_matmul(a, b), nullptr) << error();
    loads.push_back(calls("cuModuleLoadData") - before);
    ptx.push_back(last_ptx());
    std::vector<fake_launch> got = launches();
    ASSERT_EQ(got.size(), 1u);
    l.push_back(got[0]);
  }
  unsetenv("KILN_CUDA_TF32");
  EXPECT_EQ(ptx[0].find("mma.sync"), std::string::npos);
  EXPECT_THAT(ptx[1], HasSubstr(mma));
  EXPECT_EQ(loads[1], 1) << "the TF32 program is a program of its own";
  EXPECT_EQ(loads[2], 0) << "back to the default program, already loaded";
  for (int k = 0; k < 3; k++) {
    EXPECT_EQ(l[1].grid[k], l[0].grid[k]);
    EXPECT_EQ(l[1].block[k], l[0].block[k]);
  }
  EXPECT_EQ(l[1].bad_params, 0);
}

// ---- what benchmarks use: a stream wait and a device copy ----

TEST(CudaDebug, SyncAndDeviceCopy) {
  GpuTest s;
  Scoped sc;
  kiln_tensor *a = on("gpu:0", f32({5}, {1, 2, 3, 4, 5})), *b = on("gpu:0", kiln_zeros(KILN_F32, KILN_SHAPE(5)));
  long dtod = calls("cuMemcpyDtoDAsync");
  EXPECT_EQ(kiln_debug_cuda_copy(0, b->data, a->data, 5 * sizeof(float)), 0) << error();
  EXPECT_EQ(calls("cuMemcpyDtoDAsync"), dtod + 1);
  long syncs = calls("cuStreamSynchronize");
  EXPECT_EQ(kiln_debug_cuda_sync(0), 0) << error();
  EXPECT_EQ(calls("cuStreamSynchronize"), syncs + 1);
  EXPECT_EQ(values(b), (VD{1, 2, 3, 4, 5}));
  EXPECT_EQ(kiln_debug_cuda_copy(0, b->data, a->data, 0), 0) << "nothing to copy";
  EXPECT_EQ(kiln_debug_cuda_sync(7), -1);
  EXPECT_EQ(error(), "cuda_sync: no gpu:7");
  EXPECT_EQ(kiln_debug_cuda_copy(-1, b->data, a->data, 4), -1);
  EXPECT_EQ(error(), "cuda_copy: no gpu:-1");
  EXPECT_EQ(kiln_debug_cuda_copy(0, nullptr, a->data, 4), -1);
  EXPECT_EQ(error(), "cuda_copy: a NULL buffer");
  EXPECT_EQ(ctx_depth(), 0);
}
