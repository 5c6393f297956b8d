// cuda_runtime_test.cc — the CUDA device runtime (backends/cuda) against
// tests/fake_cuda, a driver on host memory: devices listed, copies, the
// caching allocator, driver errors, and ops given GPU tensors.
//
// An executable of its own: the driver is loaded once per process. main()
// points KILN_CUDA_DRIVER at the fake; the other set-ups (no driver, a stub,
// no device, the real driver) run in a fresh process each, with gtest's
// "threadsafe" death-test style, which re-runs the test alone in a child.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>

#include "../test_util.h"
#include "cuda_test_util.h"
#include "cuda/cuda_rt.h"

using namespace kiln_test;
using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

// ---- the fake driver's own counters, through the handle Kiln opened ----

void *fake_symbol(const char *name) {
  static void *h = dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD);
  return h ? dlsym(h, name) : nullptr;
}

long calls(const char *name) {
  auto f = (long (*)(const char *))fake_symbol("fake_cuda_calls");
  EXPECT_NE(f, nullptr) << "the fake driver is not loaded";
  return f ? f(name) : -1;
}

size_t fake_live_bytes(int dev) {
  auto f = (size_t(*)(int))fake_symbol("fake_cuda_live_bytes");
  return f ? f(dev) : (size_t)-1;
}

int ctx_depth() {
  auto f = (int (*)())fake_symbol("fake_cuda_ctx_depth");
  return f ? f() : -1;
}

// Raw bytes of every kind for dtype dt: random bit patterns (NaN payloads,
// signed zeros, denormals and infinities included) for the float dtypes, 0/1
// for bool.
std::vector<unsigned char> pattern(kiln_dtype dt, size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> b(n * kiln_dtype_size(dt));
  for (auto &c : b) c = (unsigned char)rng();
  if (dt == KILN_BOOL)
    for (auto &c : b) c &= 1;
  return b;
}

std::vector<unsigned char> bytes_of(const kiln_tensor *t) {
  std::vector<unsigned char> b((size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t)));
  EXPECT_EQ(kiln_tensor_read(t, b.data(), b.size()), 0) << error();
  return b;
}

const kiln_dtype kAllDtypes[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL, KILN_F16, KILN_BF16};

// A test's own Scoped that also checks no context is left pushed.
struct GpuScoped : Scoped {
  ~GpuScoped() { EXPECT_EQ(ctx_depth(), 0) << "a CUDA context was left current"; }
};

}  // namespace

// ---- the device list ----

TEST(CudaDevices, ListsCpuThenTheFakeGpus) {
  ASSERT_EQ(kiln_device_count(), 3) << kiln_debug_cuda_status();
  EXPECT_STREQ(kiln_device_name(0), "cpu:0");
  EXPECT_STREQ(kiln_device_name(1), "gpu:0");
  EXPECT_STREQ(kiln_device_name(2), "gpu:1");
  EXPECT_EQ(kiln_device_name(3), nullptr);
  EXPECT_EQ(kiln_device_name(-1), nullptr);
  EXPECT_STREQ(kiln_debug_cuda_status(), "");

  cuda_device_info d;
  ASSERT_EQ(kiln_debug_cuda_device(0, &d), 0);
  EXPECT_STREQ(d.name, "Fake GPU");
  EXPECT_EQ(d.cc_major, 9);
  EXPECT_EQ(d.cc_minor, 0);
  EXPECT_EQ(d.total_bytes, (size_t)1 << 30);
  ASSERT_EQ(kiln_debug_cuda_device(1, &d), 0);
  EXPECT_EQ(d.cc_major, 8);
  EXPECT_EQ(kiln_debug_cuda_device(2, &d), -1);
  EXPECT_EQ(kiln_debug_cuda_device(-1, &d), -1);
  EXPECT_EQ(calls("cuInit"), 1) << "the driver is initialised once";
  EXPECT_GE(calls("cuGetProcAddress"), 19) << "entry points are resolved through cuGetProcAddress";
}

TEST(CudaDevices, PushAndPopGpuScopes) {
  GpuScoped s;
  ASSERT_EQ(kiln_device_push("gpu:0"), 0) << error();
  EXPECT_STREQ(kiln_device_current(), "gpu:0");
  ASSERT_EQ(kiln_device_push("gpu:1"), 0) << error();
  EXPECT_STREQ(kiln_device_current(), "gpu:1");
  kiln_device_pop();
  EXPECT_STREQ(kiln_device_current(), "gpu:0");
  kiln_device_pop();
  EXPECT_STREQ(kiln_device_current(), "cpu:0");
  kiln_device_pop();  // nothing pushed: a no-op
  EXPECT_STREQ(kiln_device_current(), "cpu:0");

  ASSERT_EQ(kiln_device_push("gpu"), 0) << "'gpu' is the first GPU";
  EXPECT_STREQ(kiln_device_current(), "gpu:0");
  kiln_device_pop();

  EXPECT_EQ(kiln_device_push("gpu:2"), -1);
  EXPECT_EQ(error(), "device_push: unknown device 'gpu:2' (devices: cpu:0, gpu:0, gpu:1)");
  EXPECT_EQ(kiln_device_push("gpu:"), -1);
  EXPECT_STREQ(kiln_device_current(), "cpu:0");
}

// ---- copies ----

TEST(CudaCopies, RoundTripBitExactForEveryDtype) {
  GpuScoped s;
  // small (data inline in the CPU header) and large (a separate CPU block)
  for (int64_t n : {1, 105, 70000}) {
    for (kiln_dtype dt : kAllDtypes) {
      SCOPED_TRACE(std::string(kiln_dtype_name(dt)) + " x " + std::to_string(n));
      std::vector<unsigned char> b = pattern(dt, (size_t)n, (unsigned)(n * 7 + dt));
      int64_t shape[2] = {n > 1 ? 5 : 1, n > 1 ? n / 5 : 1};
      kiln_tensor *c = kiln_tensor_new(dt, 2, shape, b.data());
      ASSERT_NE(c, nullptr) << error();
      kiln_tensor *g = kiln_to_device(c, "gpu:0");
      ASSERT_NE(g, nullptr) << error();
      EXPECT_STREQ(kiln_tensor_device(g), "gpu:0");
      EXPECT_EQ(kiln_tensor_dtype(g), dt);
      EXPECT_EQ(shape_of(g), shape_of(c));
      EXPECT_EQ(kiln_tensor_data(g), nullptr) << "GPU data is not host memory";
      EXPECT_THAT(error(), HasSubstr("tensor lives on gpu:0"));
      EXPECT_EQ(bytes_of(g), b) << "tensor_read from the GPU";

      kiln_tensor *g1 = kiln_to_device(g, "gpu:1");  // between GPUs
      ASSERT_NE(g1, nullptr) << error();
      EXPECT_STREQ(kiln_tensor_device(g1), "gpu:1");
      EXPECT_EQ(bytes_of(g1), b);

      kiln_tensor *back = kiln_to_device(g1, "cpu:0");
      ASSERT_NE(back, nullptr) << error();
      EXPECT_STREQ(kiln_tensor_device(back), "cpu:0");
      ASSERT_NE(kiln_tensor_data(back), nullptr);
      EXPECT_EQ(std::memcmp(kiln_tensor_data(back), b.data(), b.size()), 0);
    }
  }
}

TEST(CudaCopies, SameDeviceSharesAndEmptyTensorsCopy) {
  GpuScoped s;
  kiln_tensor *g = on("gpu:0", f32({2}, {1, 2}));
  EXPECT_EQ(kiln_to_device(g, "gpu:0"), g) << "immutable: already there, shared";

  long allocs = calls("cuMemAlloc");
  kiln_tensor *e = on("gpu:0", kiln_zeros(KILN_F32, KILN_SHAPE(0, 3)));
  EXPECT_STREQ(kiln_tensor_device(e), "gpu:0");
  EXPECT_EQ(shape_of(e), (V64{0, 3}));
  EXPECT_EQ(calls("cuMemAlloc"), allocs) << "no device memory for no elements";
  kiln_tensor *back = kiln_to_device(e, "cpu:0");
  ASSERT_NE(back, nullptr) << error();
  EXPECT_EQ(shape_of(back), (V64{0, 3}));
  EXPECT_EQ(kiln_tensor_read(e, nullptr, 0), 0) << error();

  EXPECT_EQ(kiln_to_device(g, "gpu:7"), nullptr);
  EXPECT_EQ(error(), "to_device: unknown device 'gpu:7' (devices: cpu:0, gpu:0, gpu:1)");
  EXPECT_EQ(kiln_to_device(nullptr, "gpu:0"), nullptr);
}

TEST(CudaCopies, ReadingWaitsForTheStream) {
  GpuScoped s;
  // The fake lands device-to-host copies only when the stream is
  // synchronized: a read that did not wait would see the 0xA5 fill.
  kiln_tensor *g = on("gpu:0", i32({3}, {7, -8, 9}));
  long syncs = calls("cuStreamSynchronize");
  EXPECT_EQ(read<int32_t>(g), (std::vector<int32_t>{7, -8, 9}));
  EXPECT_EQ(calls("cuStreamSynchronize"), syncs + 1);
  std::vector<int32_t> small(2);
  EXPECT_EQ(kiln_tensor_read(g, small.data(), 8), -1);
  EXPECT_THAT(error(), StartsWith("tensor_read: buffer of 8 bytes is too small"));
}

// ---- reading, printing ----

TEST(CudaCopies, ItemAndPrintingOfGpuTensors) {
  GpuScoped s;
  kiln_tensor *m = on("gpu:0", f32({2, 2}, {2, 3, 4, 5}));
  char *str = kiln_tensor_str(m);
  ASSERT_NE(str, nullptr) << error();
  EXPECT_STREQ(str, "kiln.Tensor([[2. 3.] [4. 5.]], shape=(2, 2), dtype=f32)");
  free(str);
  FILE *f = tmpfile();
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(kiln_tensor_print(m, f), 0) << error();
  rewind(f);
  char line[128] = "";
  EXPECT_NE(fgets(line, sizeof line, f), nullptr);
  EXPECT_STREQ(line, "kiln.Tensor([[2. 3.] [4. 5.]], shape=(2, 2), dtype=f32)\n");
  fclose(f);

  EXPECT_EQ(kiln_tensor_item(on("gpu:0", kiln_scalar(KILN_F32, 2.5))), 2.5);
  EXPECT_EQ(kiln_tensor_item(on("gpu:1", kiln_scalar(KILN_I64, -(1ll << 40)))), -1099511627776.0);
  EXPECT_EQ(kiln_tensor_item(on("gpu:0", kiln_scalar(KILN_BF16, -3.0))), -3.0);
  EXPECT_EQ(kiln_tensor_item(on("gpu:0", kiln_scalar(KILN_BOOL, 1))), 1.0);
  EXPECT_TRUE(std::isnan(kiln_tensor_item(m)));
  EXPECT_EQ(error(), "item: tensor has 4 elements, not 1");

  str = kiln_tensor_str(on("gpu:0", kiln_arange(KILN_I64, 2000)));
  ASSERT_NE(str, nullptr) << error();
  EXPECT_STREQ(str, "kiln.Tensor([0 1 2 ... 1997 1998 1999], shape=(2000,), dtype=i64)");
  free(str);
}

// ---- the allocator ----

TEST(CudaAllocator, FreedBlocksAreCachedAndReused) {
  GpuScoped s;
  ASSERT_EQ(kiln_debug_cuda_trim(0), 0) << error();
  cuda_mem_stats m0 = mem(0);
  EXPECT_EQ(m0.cached, 0u);
  long allocs = calls("cuMemAlloc");

  kiln_scope_push();
  kiln_tensor *a = kiln_to_device(kiln_zeros(KILN_F32, KILN_SHAPE(1000)), "gpu:0");  // 4000 bytes
  EXPECT_NE(a, nullptr) << error();
  cuda_mem_stats m1 = mem(0);
  EXPECT_EQ(m1.in_use, m0.in_use + 4096) << "4000 bytes take the 4 KiB class";
  EXPECT_EQ(m1.driver_allocs, m0.driver_allocs + 1);
  EXPECT_EQ(calls("cuMemAlloc"), allocs + 1);
  kiln_scope_pop();  // a dies
  cuda_mem_stats m2 = mem(0);
  EXPECT_EQ(m2.in_use, m0.in_use);
  EXPECT_EQ(m2.cached, 4096u) << "freed, kept for reuse";
  EXPECT_EQ(m2.driver_frees, m0.driver_frees);

  // 990 f32 = 3960 bytes: the same class, so the same block. a's copy to the
  // GPU is still queued (the fake runs copies at the next synchronization),
  // but b's queues after it on the one stream: no wait is needed to reuse.
  std::vector<float> v(990, 1.5f);
  kiln_tensor *b = on("gpu:0", f32({990}, v));
  cuda_mem_stats m3 = mem(0);
  EXPECT_EQ(m3.reuses, m2.reuses + 1);
  EXPECT_EQ(m3.cached, 0u);
  EXPECT_EQ(m3.in_use, m0.in_use + 4096);
  EXPECT_EQ(calls("cuMemAlloc"), allocs + 1) << "no new driver allocation";
  EXPECT_EQ(read<float>(b), v) << "the reused block holds the new data";

  // 129 f32 = 516 bytes: the 640-byte class, a new block
  kiln_tensor *c = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(129)));
  EXPECT_EQ(mem(0).in_use, m0.in_use + 4096 + 640);
  EXPECT_EQ(calls("cuMemAlloc"), allocs + 2);
  EXPECT_EQ(mem(0).peak_in_use >= m0.in_use + 4096 + 640, true);
  (void)c;
}

TEST(CudaAllocator, ViewsKeepTheirBlockAlive) {
  GpuScoped s;
  kiln_tensor *g = kiln_scope_escape(kiln_to_device(f32({2, 3}, {1, 2, 3, 4, 5, 6}), "gpu:0"));
  ASSERT_NE(g, nullptr) << error();
  kiln_tensor *view = kiln_reshape(g, KILN_SHAPE(3, 2));  // under cpu:0: copied to the host
  EXPECT_STREQ(kiln_tensor_device(view), "cpu:0");
  ASSERT_EQ(kiln_device_push("gpu:0"), 0);
  kiln_tensor *gview = kiln_scope_escape(kiln_reshape(g, KILN_SHAPE(6)));  // on the GPU: a view
  kiln_device_pop();
  ASSERT_NE(gview, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(gview), "gpu:0");
  size_t in_use = mem(0).in_use;
  kiln_release(g);  // the view still holds the block
  EXPECT_EQ(mem(0).in_use, in_use);
  EXPECT_EQ(read<float>(gview), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  kiln_release(gview);
  EXPECT_EQ(mem(0).in_use, in_use - 512);
}

TEST(CudaAllocator, OutOfMemoryIsACleanError) {
  GpuScoped s;
  kiln_tensor *c = kiln_ones(KILN_F64, KILN_SHAPE(3000));
  kiln_scope_push();
  on("gpu:0", kiln_zeros(KILN_F32, KILN_SHAPE(10)));  // a block in the cache
  kiln_scope_pop();
  cuda_mem_stats m0 = mem(0);
  size_t live = fake_live_bytes(0);
  ASSERT_GT(m0.cached, 0u);
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuMemAlloc");
    EXPECT_EQ(kiln_to_device(c, "gpu:0"), nullptr);
    EXPECT_EQ(error(), "to_device: CUDA_ERROR_OUT_OF_MEMORY: out of memory (allocating 24576 bytes on gpu:0)");
    kiln_clear_error();
    // an op on cpu:0 needs no GPU memory; to_device the other way neither
    EXPECT_NE(kiln_add(c, c), nullptr) << error();
  }
  cuda_mem_stats m1 = mem(0);
  EXPECT_EQ(m1.in_use, m0.in_use);
  EXPECT_EQ(m1.driver_allocs, m0.driver_allocs);
  EXPECT_EQ(m1.cached, 0u) << "the cache went back to the driver before the retry";
  EXPECT_EQ(fake_live_bytes(0), live - m0.cached);
  kiln_tensor *g = kiln_to_device(c, "gpu:0");
  ASSERT_NE(g, nullptr) << "fine once the driver is: " << error();
  EXPECT_EQ(values(g), VD(3000, 1.0));
}

TEST(CudaAllocator, OutOfMemoryGivesTheCacheBackAndRetries) {
  GpuScoped s;
  ASSERT_EQ(kiln_debug_cuda_trim(0), 0);
  size_t live = fake_live_bytes(0);
  std::string limit = std::to_string(live + (1 << 20));  // 1 MiB free on gpu:0
  EnvGuard mem_limit("FAKE_CUDA_MEMORY", limit.c_str());
  // 600000 bytes: the 655360-byte class; then 700000: 786432; both don't fit
  kiln_scope_push();
  EXPECT_NE(kiln_to_device(kiln_zeros(KILN_I32, KILN_SHAPE(150000)), "gpu:0"), nullptr) << error();
  kiln_scope_pop();
  cuda_mem_stats m0 = mem(0);
  EXPECT_EQ(m0.cached, 655360u);
  kiln_tensor *b = on("gpu:0", kiln_zeros(KILN_I32, KILN_SHAPE(175000)));
  ASSERT_NE(b, nullptr);
  cuda_mem_stats m1 = mem(0);
  EXPECT_EQ(m1.cached, 0u) << "the cache went back to the driver";
  EXPECT_EQ(m1.driver_frees, m0.driver_frees + 1);
  EXPECT_EQ(fake_live_bytes(0), live + 786432);
  EXPECT_EQ(values(b), VD(175000, 0.0));

  kiln_tensor *big = kiln_zeros(KILN_F32, KILN_SHAPE(1 << 20));  // 4 MiB
  EXPECT_EQ(kiln_to_device(big, "gpu:0"), nullptr);
  EXPECT_EQ(error(), "to_device: CUDA_ERROR_OUT_OF_MEMORY: out of memory (allocating 4194304 bytes on gpu:0)");
  EXPECT_EQ(fake_live_bytes(0), live + 786432);
}

// ---- errors from the driver ----

TEST(CudaErrors, FailedCopiesNameTheOp) {
  GpuScoped s;
  kiln_tensor *c = f32({2}, {1, 2});
  kiln_tensor *g = on("gpu:0", c), *one = on("gpu:0", kiln_scalar(KILN_F32, 1));
  size_t in_use = mem(0).in_use;
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuMemcpyDtoHAsync=700");
    const char *illegal = "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered (copying from the GPU)";
    float out[2];
    EXPECT_EQ(kiln_tensor_read(g, out, sizeof out), -1);
    EXPECT_EQ(error(), std::string("tensor_read: ") + illegal);
    EXPECT_TRUE(std::isnan(kiln_tensor_item(one)));
    EXPECT_EQ(error(), std::string("item: ") + illegal);
    kiln_clear_error();
    EXPECT_EQ(kiln_tensor_str(g), nullptr);
    EXPECT_EQ(error(), std::string("tensor_str: ") + illegal);
    kiln_clear_error();
    EXPECT_EQ(kiln_add(c, g), nullptr);
    EXPECT_EQ(error(), std::string("add: ") + illegal);
    kiln_clear_error();
    EXPECT_EQ(kiln_to_device(g, "cpu:0"), nullptr);
    EXPECT_EQ(error(), std::string("to_device: ") + illegal);
  }
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuMemcpyHtoDAsync");
    kiln_clear_error();
    EXPECT_EQ(kiln_to_device(c, "gpu:0"), nullptr);
    EXPECT_EQ(error(), "to_device: CUDA_ERROR_UNKNOWN: unknown error (copying to the GPU)");
    EXPECT_EQ(mem(0).in_use, in_use) << "the new tensor's block went back";
  }
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuMemcpyHtoDAsync=12345");
    EXPECT_EQ(kiln_to_device(c, "gpu:0"), nullptr);
    EXPECT_EQ(error(), "to_device: CUDA error 12345 (copying to the GPU)");
  }
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuMemcpyPeerAsync=1");
    EXPECT_EQ(kiln_to_device(g, "gpu:1"), nullptr);
    EXPECT_EQ(error(), "to_device: CUDA_ERROR_INVALID_VALUE: invalid argument (copying between GPUs)");
  }
  {
    EnvGuard fail("FAKE_CUDA_FAIL", "cuCtxPushCurrent=201");
    EXPECT_TRUE(std::isnan(kiln_tensor_item(one)));
    EXPECT_EQ(error(), "item: CUDA_ERROR_INVALID_CONTEXT: invalid device context (cuCtxPushCurrent)");
  }
  kiln_clear_error();
  EXPECT_EQ(read<float>(g), (std::vector<float>{1, 2})) << "all fine again";
}

// ---- ops given GPU tensors ----

TEST(CudaOps, OnCpuGpuInputsAreCopiedToTheHost) {
  GpuScoped s;
  kiln_tensor *a = on("gpu:0", f32({2, 2}, {1, 2, 3, 4}));
  kiln_tensor *b = on("gpu:1", f32({2, 2}, {10, 20, 30, 40}));
  kiln_tensor *c = f32({2}, {100, 200});
  long dtoh = calls("cuMemcpyDtoHAsync");
  kiln_tensor *sum = kiln_add(kiln_add(a, b), c);
  ASSERT_NE(sum, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(sum), "cpu:0");
  EXPECT_EQ(values(sum), (VD{111, 222, 133, 244}));
  EXPECT_EQ(calls("cuMemcpyDtoHAsync"), dtoh + 2) << "one copy per GPU input";

  EXPECT_EQ(values(kiln_matmul(a, a)), (VD{7, 10, 15, 22}));
  EXPECT_EQ(values(kiln_reduce_sum(b, 0, nullptr, false)), (VD{100}));
  EXPECT_EQ(values(kiln_neg(a)), (VD{-1, -2, -3, -4}));
  kiln_tensor *parts[3] = {a, c, b};
  EXPECT_EQ(kiln_concat(3, parts, 0), nullptr);
  EXPECT_EQ(error(), "concat: shapes (2, 2) and (2,) (tensor 1) differ outside axis 0") << "checked before copying";
  kiln_clear_error();
  kiln_tensor *rows[2] = {a, b};
  EXPECT_EQ(values(kiln_concat(2, rows, 0)), (VD{1, 2, 3, 4, 10, 20, 30, 40}));
  EXPECT_TRUE(same_bits(kiln_softmax(b, 1), kiln_softmax(kiln_to_device(b, "cpu:0"), 1))) << "a composite";
  EXPECT_EQ(values(kiln_reduce_mean(a, 0, nullptr, false)), (VD{2.5})) << "a composite";
}

TEST(CudaOps, GradientsThroughOpsWithGpuInputs) {
  GpuScoped s;
  kiln_tensor *x = on("gpu:0", f64({3}, {1, -2, 3}));
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(x, x);
  kiln_tape_end(tape);
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0) << error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(g), (VD{2, -4, 6}));
}

// Under a GPU's scope ops run there (eager GPU kernels: cuda_launch_test.cc
// checks their launches; the fake cannot run them, so only their placement
// is checked here).
TEST(CudaOps, OnAGpuOpsRunThere) {
  GpuScoped s;
  kiln_tensor *c = f32({2, 2}, {1, 2, 3, 4});
  kiln_tensor *g = on("gpu:0", c);
  long htod = calls("cuMemcpyHtoDAsync");
  ASSERT_EQ(kiln_device_push("gpu:0"), 0);
  kiln_tensor *sum = kiln_add(g, g);
  ASSERT_NE(sum, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(sum), "gpu:0");
  EXPECT_EQ(calls("cuMemcpyHtoDAsync"), htod) << "nothing to copy: the inputs are there";
  kiln_tensor *mm = kiln_matmul(c, c);
  ASSERT_NE(mm, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(mm), "gpu:0");
  EXPECT_EQ(calls("cuMemcpyHtoDAsync"), htod + 2) << "a CPU input is copied to the GPU, once per operand";
  kiln_tensor *ar = kiln_arange(KILN_I32, 4);
  ASSERT_NE(ar, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(ar), "gpu:0");
  kiln_tensor *mean = kiln_reduce_mean(g, 0, nullptr, false);
  ASSERT_NE(mean, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(mean), "gpu:0");
  EXPECT_EQ(kiln_add(g, kiln_ones(KILN_F32, KILN_SHAPE(3))), nullptr);
  EXPECT_THAT(error(), StartsWith("add: ")) << "checked before anything runs";
  kiln_clear_error();
  htod = calls("cuMemcpyHtoDAsync");  // reduce_mean made its count on gpu:0

  // views need no kernel: on the GPU they share its data
  kiln_tensor *r = kiln_reshape(g, KILN_SHAPE(4));
  ASSERT_NE(r, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(r), "gpu:0");
  EXPECT_EQ(calls("cuMemcpyHtoDAsync"), htod);
  kiln_tensor *rc = kiln_reshape(c, KILN_SHAPE(4, 1));  // a CPU input is copied there first
  ASSERT_NE(rc, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(rc), "gpu:0");
  EXPECT_EQ(calls("cuMemcpyHtoDAsync"), htod + 1);
  kiln_tensor *k = kiln_scalar_like(g, 3);
  kiln_device_pop();

  EXPECT_EQ(values(r), (VD{1, 2, 3, 4}));
  EXPECT_EQ(values(rc), (VD{1, 2, 3, 4}));
  EXPECT_EQ(shape_of(rc), (V64{4, 1}));
  ASSERT_NE(k, nullptr) << error();
  EXPECT_STREQ(kiln_tensor_device(k), "gpu:0");
  EXPECT_EQ(kiln_tensor_item(k), 3.0);
}

TEST(CudaOps, VariablesFromGpuTensorsStayThere) {
  GpuScoped s;
  Owned own;
  kiln_tensor *g = on("gpu:1", i64({2}, {5, 6}));
  kiln_variable *v = own.var(g, "w");
  ASSERT_NE(v, nullptr);
  kiln_tensor *r = kiln_variable_read(v);
  EXPECT_STREQ(kiln_tensor_device(r), "gpu:1");
  EXPECT_EQ(read<int64_t>(r), (std::vector<int64_t>{5, 6}));
  EXPECT_GE(calls("cuMemcpyDtoDAsync"), 1) << "copied on the device";
}

TEST(CudaOps, ManyThreadsCopyAtOnce) {
  GpuScoped s;
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  for (int t = 0; t < 4; t++)
    threads.emplace_back([t, &bad] {
      for (int i = 0; i < 50; i++) {
        kiln_scope_push();
        std::vector<int32_t> v(100 + 37 * t + i, t * 1000 + i);
        kiln_tensor *c = i32({(int64_t)v.size()}, v);
        kiln_tensor *g = kiln_to_device(c, t % 2 ? "gpu:1" : "gpu:0");
        std::vector<int32_t> out(v.size());
        if (!g || kiln_tensor_read(g, out.data(), out.size() * 4) || out != v) bad++;
        kiln_scope_pop();
      }
    });
  for (auto &th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
}

// ---- other drivers, each in a fresh process ----

namespace {

// The exit of a child process: 1 after a failed expectation, each written
// to stderr, which gtest shows the parent under "Actual msg".
[[noreturn]] void exit_child() {
  const ::testing::TestResult *r = ::testing::UnitTest::GetInstance()->current_test_info()->result();
  for (int i = 0; i < r->total_part_count(); i++) {
    const ::testing::TestPartResult &p = r->GetTestPartResult(i);
    if (p.failed()) fprintf(stderr, "%s:%d: %s\n", p.file_name() ? p.file_name() : "?", p.line_number(), p.message());
  }
  fflush(stderr);
  _exit(::testing::Test::HasFailure() ? 1 : 0);
}

// Runs body in a child process (the test re-run alone: no driver loaded
// yet) with the environment first set by body.
#define IN_FRESH_PROCESS(body) EXPECT_EXIT({ body; exit_child(); }, ::testing::ExitedWithCode(0), "")

// Everything but GPUs works: the checks a process without a GPU must pass.
void expect_cpu_only(const char *why) {
  EXPECT_EQ(kiln_device_count(), 1);
  EXPECT_STREQ(kiln_device_name(0), "cpu:0");
  EXPECT_EQ(kiln_device_name(1), nullptr);
  EXPECT_THAT(kiln_debug_cuda_status(), HasSubstr(why));
  EXPECT_EQ(kiln_device_push("gpu:0"), -1);
  EXPECT_EQ(error(), std::string("device_push: unknown device 'gpu:0' (devices: cpu:0; no GPU: ") +
                         kiln_debug_cuda_status() + ")");
  EXPECT_STREQ(kiln_device_current(), "cpu:0");
  Scoped s;
  kiln_tensor *c = f32({2}, {1, 2});
  EXPECT_EQ(kiln_to_device(c, "gpu:0"), nullptr);
  EXPECT_THAT(error(), StartsWith("to_device: unknown device 'gpu:0'"));
  EXPECT_EQ(kiln_to_device(c, "cpu:0"), c);
  EXPECT_EQ(values(kiln_add(c, c)), (VD{2, 4}));
  cuda_mem_stats m;
  EXPECT_EQ(kiln_debug_cuda_memory(0, &m), -1);
  // staged calls compile for the CPU as ever
  kiln_function *f = kiln_function_new(
      "twice", [](void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
        out[0] = kiln_add(in[0], in[0]);
        return out[0] ? 0 : -1;
      }, nullptr, 1, 1);
  kiln_tensor *y = nullptr;
  EXPECT_EQ(kiln_function_call(f, &c, &y), 0) << error();
  EXPECT_EQ(values(y), (VD{2, 4}));
  kiln_function_free(f);
}

}  // namespace

TEST(CudaNoGpu, MissingDriverListsOnlyTheCpu) {
  IN_FRESH_PROCESS({
    setenv("KILN_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
    expect_cpu_only("cannot load the CUDA driver: /nonexistent/libcuda.so.1");
  });
}

TEST(CudaNoGpu, StubDriverListsOnlyTheCpu) {
  IN_FRESH_PROCESS({
    setenv("FAKE_CUDA_STUB", "1", 1);
    expect_cpu_only("is the CUDA toolkit's stub library, not a driver");
  });
}

TEST(CudaNoGpu, TheToolkitsStubLibraryListsOnlyTheCpu) {
  const char *stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
  struct stat st;
  if (stat(stub, &st) != 0) GTEST_SKIP() << stub << " is not installed";
  IN_FRESH_PROCESS({
    setenv("KILN_CUDA_DRIVER", stub, 1);
    expect_cpu_only("stub library");
  });
}

TEST(CudaNoGpu, NoDeviceListsOnlyTheCpu) {
  IN_FRESH_PROCESS({
    setenv("FAKE_CUDA_DEVICES", "0", 1);
    expect_cpu_only("the CUDA driver finds no device");
  });
}

TEST(CudaNoGpu, FailedInitListsOnlyTheCpu) {
  IN_FRESH_PROCESS({
    setenv("FAKE_CUDA_FAIL", "cuInit=999", 1);
    expect_cpu_only("failed: CUDA_ERROR_UNKNOWN: unknown error");
  });
}

TEST(CudaNoGpu, ALibraryThatIsNotADriverListsOnlyTheCpu) {
  IN_FRESH_PROCESS({
    setenv("KILN_CUDA_DRIVER", "libm.so.6", 1);
    expect_cpu_only("libm.so.6 has no entry point cuGetErrorName");
  });
}

TEST(CudaDriverLoading, CpuOnlyWorkNeverLoadsTheDriver) {
  IN_FRESH_PROCESS({
    {
      Scoped s;
      kiln_tensor *c = f32({2}, {1, 2});
      EXPECT_STREQ(kiln_tensor_device(kiln_add(c, c)), "cpu:0");
      EXPECT_EQ(kiln_to_device(c, "cpu"), c);
      EXPECT_EQ(kiln_device_push("cpu:0"), 0);
      kiln_device_pop();
      EXPECT_STREQ(kiln_device_name(0), "cpu:0");
      char *str = kiln_tensor_str(c);
      free(str);
    }
    EXPECT_EQ(dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD), nullptr) << "the driver was loaded";
    EXPECT_EQ(kiln_device_count(), 3) << "listing the devices loads it";
    EXPECT_NE(dlopen(FAKE_CUDA_PATH, RTLD_NOW | RTLD_NOLOAD), nullptr);
  });
}

TEST(CudaDriverLoading, WithoutCuGetProcAddressSymbolsAreFound) {
  IN_FRESH_PROCESS({
    setenv("FAKE_CUDA_NO_PROC", "1", 1);  // the versioned symbols, by dlsym
    ASSERT_EQ(kiln_device_count(), 3) << kiln_debug_cuda_status();
    Scoped s;
    EXPECT_EQ(values(on("gpu:1", f32({3}, {1, 2, 3}))), (VD{1, 2, 3}));
  });
}

TEST(CudaDriverLoading, AContextThatFailsToOpenIsRetried) {
  IN_FRESH_PROCESS({
    setenv("FAKE_CUDA_FAIL", "cuDevicePrimaryCtxRetain", 1);
    ASSERT_EQ(kiln_device_count(), 3) << "listing needs no context";
    Scoped s;
    kiln_tensor *c = f32({1}, {4});
    EXPECT_EQ(kiln_to_device(c, "gpu:0"), nullptr);
    EXPECT_EQ(error(), "to_device: CUDA_ERROR_UNKNOWN: unknown error (opening gpu:0)");
    unsetenv("FAKE_CUDA_FAIL");
    EXPECT_EQ(values(on("gpu:0", c)), (VD{4}));
    EXPECT_EQ(ctx_depth(), 0);
  });
}

// The machine's own driver, where it has a GPU. The probe only looks (the
// driver is loaded and initialised in the child alone: under LeakSanitizer,
// libcuda's own allocations would otherwise be reported at exit).
TEST(CudaRealDriver, CopiesRoundTrip) {
  void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!lib) GTEST_SKIP() << "no CUDA driver on this machine (" << dlerror() << "): no GPU to test";
  dlclose(lib);
  struct stat st;
  if (stat("/dev/nvidia0", &st) != 0) GTEST_SKIP() << "a CUDA driver but no /dev/nvidia0: no GPU to test";
  IN_FRESH_PROCESS({
    unsetenv("KILN_CUDA_DRIVER");
    ASSERT_GT(kiln_device_count(), 1) << kiln_debug_cuda_status();
    cuda_device_info d;
    ASSERT_EQ(kiln_debug_cuda_device(0, &d), 0);
    fprintf(stderr, "gpu:0 is %s, sm_%d%d, %zu MiB\n", d.name, d.cc_major, d.cc_minor, d.total_bytes >> 20);
    Scoped s;
    for (kiln_dtype dt : kAllDtypes) {
      std::vector<unsigned char> b = pattern(dt, 100000, 1);
      kiln_tensor *g = on("gpu:0", kiln_tensor_new(dt, KILN_SHAPE(100000), b.data()));
      EXPECT_EQ(bytes_of(g), b) << kiln_dtype_name(dt);
    }
    kiln_scope_push();
    on("gpu:0", kiln_zeros(KILN_F32, KILN_SHAPE(1000)));
    kiln_scope_pop();
    int64_t reuses = mem(0).reuses;
    EXPECT_EQ(values(on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(1000)))), VD(1000, 1.0));
    EXPECT_EQ(mem(0).reuses, reuses + 1) << "the freed block is reused";
    char *str = kiln_tensor_str(on("gpu:0", f32({2}, {1.5f, -2})));
    EXPECT_STREQ(str, "kiln.Tensor([1.5 -2.], shape=(2,), dtype=f32)");
    free(str);
  });
}

// ---- the disk cache of PTX across processes ----

namespace {

// eager ops of several kernel kinds on gpu:0; the eager cache's figures after
std::string eager_ops_on_gpu0() {
  Scoped s;
  if (kiln_device_push("gpu:0")) return std::string("device_push: ") + kiln_last_error();
  std::vector<float> xv(1000 * 4);
  for (size_t i = 0; i < xv.size(); i++) xv[i] = (float)(i % 7) - 3;
  kiln_tensor *x = kiln_to_device(f32({1000, 4}, xv), "gpu:0");
  int ax0 = 0, ax1 = 1;
  bool ok = x && kiln_exp(x) && kiln_add(x, x) && kiln_reduce_sum(x, 1, &ax0, false) &&
            kiln_reduce_max(x, 1, &ax1, false) && kiln_matmul(kiln_transpose(x, 2, nullptr), x);
  kiln_device_pop();
  if (!ok) return std::string("an op failed: ") + kiln_last_error();
  cuda_eager_stats st{};
  kiln_debug_cuda_eager_stats(&st);
  return "compiles " + std::to_string(st.compiles) + " disk_hits " + std::to_string(st.disk_hits);
}

}  // namespace

// A process running eager GPU ops stores their PTX; another process running
// the same ops reads every one from the disk cache instead of running LLVM.
TEST(CudaPtxCache, AnotherProcessReadsTheCache) {
  char tmpl[] = "/tmp/kiln-ptx-proc-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  std::string dir = tmpl;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ASSERT_GT(n, 0);
  self[n] = 0;
  auto child = [&]() {
    std::string cmd = "KILN_PTX_CACHE_ROLE=1 KILN_CACHE_DIR='" + dir + "' '" + self + "' 2>&1";
    FILE *p = popen(cmd.c_str(), "r");
    std::string out, line;
    char buf[1024];
    while (p && fgets(buf, sizeof buf, p)) {
      line = buf;
      if (line.rfind("@child ", 0) == 0) out = line.substr(7);
    }
    int rc = p ? pclose(p) : -1;
    EXPECT_EQ(rc, 0) << cmd;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  };
  // exp, add, two reductions, transpose, matmul: six one-op programs
  EXPECT_EQ(child(), "compiles 6 disk_hits 0") << "a fresh directory: every op compiled by LLVM";
  int entries = -1;
  std::string c = "ls '" + dir + "' | grep -c '\\.kco$'";
  if (FILE *p = popen(c.c_str(), "r")) {
    if (fscanf(p, "%d", &entries) != 1) entries = -1;
    pclose(p);
  }
  EXPECT_EQ(entries, 6) << "an entry per op";
  EXPECT_EQ(child(), "compiles 6 disk_hits 6") << "the second process reads them all";
  std::string rm = "rm -rf '" + dir + "'";
  EXPECT_EQ(system(rm.c_str()), 0);
}

int main(int argc, char **argv) {
  setenv("KILN_CUDA_DRIVER", FAKE_CUDA_PATH, 1);
  if (getenv("KILN_PTX_CACHE_ROLE")) {  // the child of CudaPtxCache.AnotherProcessReadsTheCache, no test of its own
    printf("@child %s\n", eager_ops_on_gpu0().c_str());
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // children start afresh
  return RUN_ALL_TESTS();
}
