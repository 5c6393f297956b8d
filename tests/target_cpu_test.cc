// KILN_CPU: the JIT compiles for the CPU it names, with that CPU's own
// features (not the host's), in the staged programs and in gemm.c's choice
// of micro-kernel, and the name is part of the disk cache's key. The JIT
// reads KILN_CPU once per process: each setting runs in a child process (this
// program again, which takes the child's role before main).
#include <gtest/gtest.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>
#include "cpu/cpu.h"
#include "cpu/gemm.h"
#include "test_util.h"

namespace {

int body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *x = in[0], *w = in[1];
  // elementwise math that vectorizes, and a matmul big enough for the
  // compiled micro-kernel where there is one
  kiln_tensor *e = kiln_add(kiln_mul(kiln_tanh(x), x), kiln_exp(kiln_neg(x)));
  out[0] = kiln_matmul(e, w);
  return out[0] ? 0 : -1;
}

// FNV-1a over the bytes of a tensor
unsigned long long bits_hash(const kiln_tensor *t) {
  const unsigned char *p = static_cast<const unsigned char *>(kiln_tensor_data(t));
  unsigned long long h = 1469598103934665603ull;
  for (int64_t i = 0; i < kiln_tensor_size(t) * 4; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// The child: one staged call; prints "hash H ymm Y zmm Z gemm G" (G: 1 when
// a compiled f32 micro-kernel exists, its assembly's use of zmm as 2) and
// exits before main.
int child_role() {
  if (!getenv("KILN_TARGET_CPU_TEST_CHILD")) return 0;
  kiln_scope_push();
  kiln_tensor *x = kiln_mul(kiln_arange(KILN_F32, 96 * 80), kiln_scalar(KILN_F32, 1e-3));
  x = kiln_reshape(x, 2, (const int64_t[]){96, 80});
  kiln_tensor *w = kiln_reshape(kiln_mul(kiln_arange(KILN_F32, 80 * 96), kiln_scalar(KILN_F32, -2e-4)), 2,
                                (const int64_t[]){80, 96});
  kiln_function *f = kiln_function_new("target_cpu", body, nullptr, 2, 1);
  kiln_tensor *in[2] = {x, w}, *y = nullptr;
  int rc = kiln_function_call(f, in, &y);
  if (rc) {
    printf("call failed: %s\n", kiln_last_error());
    fflush(stdout);
    _exit(1);
  }
  char *as = kiln_function_ir(f, 0, "asm");
  char *g = cpu_gemm_text(KILN_F32, GEMM_EPI_NONE, "asm");
  printf("hash %llu ymm %d zmm %d gemm %d\n", bits_hash(y), as && strstr(as, "%ymm") ? 1 : 0,
         as && strstr(as, "%zmm") ? 1 : 0, g ? (strstr(g, "%zmm") ? 2 : 1) : 0);
  free(as);
  free(g);
  kiln_function_free(f);
  kiln_scope_pop();
  fflush(stdout);
  fflush(stderr);
  _exit(0);
}
const int child_hook = child_role();

struct Child {
  std::string out;
  int rc = -1;
  unsigned long long hash = 0;
  int ymm = -1, zmm = -1, gemm = -1;
};

Child run(const std::string &env) {
  Child c;
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) return c;
  exe[len] = 0;
  std::string cmd = env + " KILN_TARGET_CPU_TEST_CHILD=1 " + exe + " --gtest_filter=-* 2>&1";
  FILE *p = popen(cmd.c_str(), "r");
  if (!p) return c;
  char buf[512];
  while (fgets(buf, sizeof buf, p)) c.out += buf;
  c.rc = pclose(p);
  size_t at = c.out.find("hash ");
  if (at != std::string::npos)
    sscanf(c.out.c_str() + at, "hash %llu ymm %d zmm %d gemm %d", &c.hash, &c.ymm, &c.zmm, &c.gemm);
  return c;
}

struct TargetCpu : ::testing::Test {
  std::string dir;
  void SetUp() override {
    char tmpl[] = "/tmp/kiln_target_cpu_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir); }
  std::string env(const char *rest) { return "KILN_BACKEND=cpu KILN_CACHE_DIR=" + dir + " " + rest; }
};

// x86-64-v2 has SSE4.2 and no AVX: the staged code uses xmm registers only,
// there is no compiled micro-kernel, and the results are the interpreter's
// bits (nothing to contract into an FMA either).
TEST_F(TargetCpu, BaselineCpuCompilesWithoutAvxAndMatchesTheInterpreter) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "this host is not x86-64: the test names x86-64 CPUs (x86-64-v2, haswell, skylake-avx512) in KILN_CPU";
#else
  Child v2 = run(env("KILN_CPU=x86-64-v2"));
  ASSERT_EQ(v2.rc, 0) << v2.out;
  ASSERT_NE(v2.ymm, -1) << v2.out;
  EXPECT_EQ(v2.ymm, 0) << "x86-64-v2 code uses ymm registers";
  EXPECT_EQ(v2.zmm, 0) << "x86-64-v2 code uses zmm registers";
  EXPECT_EQ(v2.gemm, 0) << "a compiled micro-kernel for a CPU without AVX2";
  Child interp = run("KILN_BACKEND=interp KILN_CACHE_DIR=off");
  ASSERT_EQ(interp.rc, 0) << interp.out;
  ASSERT_NE(interp.ymm, -1) << interp.out;
  EXPECT_EQ(v2.hash, interp.hash) << "compiled for x86-64-v2 and interpreted differ";
  // the check can see wide registers: the host's own code has them
  if (__builtin_cpu_supports("avx2")) {
    Child host = run(env(""));
    ASSERT_EQ(host.rc, 0) << host.out;
    EXPECT_EQ(host.ymm || host.zmm, 1) << "the host's code, with AVX2, uses no ymm or zmm register";
  }
#endif
}

// The features are the named CPU's, whatever the host has: haswell has AVX2
// and FMA and no AVX-512, so on an AVX-512 host its code and micro-kernel
// still use no zmm register.
TEST_F(TargetCpu, NamedCpuBringsItsOwnFeatures) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "this host is not x86-64: the test names x86-64 CPUs (x86-64-v2, haswell, skylake-avx512) in KILN_CPU";
#else
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
    GTEST_SKIP() << "the host has no AVX2 and FMA to run haswell code";
  Child hsw = run(env("KILN_CPU=haswell"));
  ASSERT_EQ(hsw.rc, 0) << hsw.out;
  EXPECT_EQ(hsw.zmm, 0) << hsw.out;
  EXPECT_EQ(hsw.gemm, 1) << "haswell's micro-kernel: AVX2 + FMA, no zmm\n" << hsw.out;
#endif
}

// An AVX-512 CPU's micro-kernel is in zmm registers (the child runs a
// staged call compiled for it: an AVX-512 host only).
TEST_F(TargetCpu, Avx512CpuGetsTheZmmMicroKernel) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "this host is not x86-64: the test names x86-64 CPUs (x86-64-v2, haswell, skylake-avx512) in KILN_CPU";
#else
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "the host has no AVX-512 to run skylake-avx512 code";
  Child skx = run(env("KILN_CPU=skylake-avx512"));
  ASSERT_EQ(skx.rc, 0) << skx.out;
  EXPECT_EQ(skx.gemm, 2) << "skylake-avx512's micro-kernel in zmm registers\n" << skx.out;
#endif
}

// The CPU is part of the cache key: a program compiled for the host is not
// reused for x86-64-v2 (a miss), and the second x86-64-v2 run hits.
TEST_F(TargetCpu, CpuNameIsPartOfTheCacheKey) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "this host is not x86-64: the test names x86-64 CPUs (x86-64-v2, haswell, skylake-avx512) in KILN_CPU";
#endif
  Child host = run(env("KILN_LOG=cache"));
  ASSERT_EQ(host.rc, 0) << host.out;
  Child v2 = run(env("KILN_LOG=cache KILN_CPU=x86-64-v2"));
  ASSERT_EQ(v2.rc, 0) << v2.out;
  EXPECT_NE(v2.out.find("@target_cpu: miss"), std::string::npos) << v2.out;
  EXPECT_EQ(v2.out.find("@target_cpu: hit"), std::string::npos) << v2.out;
  Child again = run(env("KILN_LOG=cache KILN_CPU=x86-64-v2"));
  ASSERT_EQ(again.rc, 0) << again.out;
  EXPECT_NE(again.out.find("@target_cpu: hit"), std::string::npos) << again.out;
  EXPECT_EQ(again.hash, v2.hash);
}

}  // namespace
