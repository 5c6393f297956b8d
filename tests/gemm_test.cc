// gemm_test.cc — the blocked matmul (lib/kernels_matmul.c) with its two
// micro-kernels, the C one and the one the CPU backend compiles with LLVM
// (backends/cpu/gemm.c): products against a double-precision loop on odd
// shapes (1 x 1, vectors, primes, partial tiles, K over several cache
// blocks), batches, every epilogue, the two micro-kernels bit for bit,
// thread counts (child processes with KILN_NUM_THREADS), many threads at
// once, and the compiled dot + bias (+ relu / tanh) fusions against the
// interpreter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "cpu/cpu.h"
#include "cpu/gemm.h"
#include "ir.h"
#include "test_util.h"

namespace {

using namespace kiln_test;
using ::testing::HasSubstr;

// a tensor of uniform values in [-1, 1)
kiln_tensor *random_tensor(std::mt19937 &rng, kiln_dtype dt, const V64 &shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::uniform_real_distribution<double> u(-1, 1);
  VD v((size_t)n);
  for (double &x : v) x = u(rng);
  return from_values(dt, shape, v);
}

// The product of a [..., m, k] and b [..., k, n] (batch dims broadcast, as
// kiln_matmul does) in doubles, then the epilogue; with each element's
// error bound for a sum in T of k products: 2 k u sum |a b| (+ the bias's
// rounding, and tanh's few ulp).
struct Ref {
  VD value, bound;
};

double act(double x, gemm_epilogue epi) {
  if (epi == GEMM_EPI_BIAS_RELU) return x < 0 ? 0 : x;
  if (epi == GEMM_EPI_BIAS_TANH) return std::tanh(x);
  return x;
}

Ref reference(const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *bias, gemm_epilogue epi) {
  V64 as = shape_of(a), bs = shape_of(b);
  int64_t m = as[as.size() - 2], k = as.back(), n = bs.back();
  int rank = (int)std::max(as.size(), bs.size());
  V64 batch(rank - 2, 1);
  auto dim = [&](const V64 &s, int i) {  // batch dim i of s, aligned right
    int j = i - (rank - (int)s.size());
    return j >= 0 ? s[j] : (int64_t)1;
  };
  int64_t batches = 1;
  for (int i = 0; i < rank - 2; i++) batch[i] = std::max(dim(as, i), dim(bs, i)), batches *= batch[i];
  VD x = values(a), y = values(b), c = bias ? values(bias) : VD();
  double u = kiln_tensor_dtype(a) == KILN_F32 ? 0x1p-24 : 0x1p-53;
  Ref r;
  r.value.resize((size_t)(batches * m * n));
  r.bound.resize(r.value.size());
  for (int64_t t = 0; t < batches; t++) {
    int64_t ia = 0, ib = 0, sa = 1, sb = 1, rest = t;
    for (int i = rank - 3; i >= 0; i--) {
      int64_t idx = rest % batch[i];
      rest /= batch[i];
      ia += (dim(as, i) == 1 ? 0 : idx) * sa;
      ib += (dim(bs, i) == 1 ? 0 : idx) * sb;
      sa *= dim(as, i);
      sb *= dim(bs, i);
    }
    const double *pa = x.data() + ia * m * k, *pb = y.data() + ib * k * n;
    for (int64_t i = 0; i < m; i++) {
      for (int64_t j = 0; j < n; j++) {
        double s = 0, mag = 0;
        for (int64_t p = 0; p < k; p++)
          s += pa[i * k + p] * pb[p * n + j], mag += std::fabs(pa[i * k + p] * pb[p * n + j]);
        double bound = 2 * (double)(k + 1) * u * mag;
        if (epi != GEMM_EPI_NONE) s += c[j], bound += 2 * u * (std::fabs(s) + 1e-300);
        if (epi == GEMM_EPI_BIAS_TANH) bound += 8 * u;
        size_t o = (size_t)((t * m + i) * n + j);
        r.value[o] = act(s, epi);
        r.bound[o] = bound + 1e-300;
      }
    }
  }
  return r;
}

std::string check(const kiln_tensor *got, const Ref &want) {
  VD g = values(got);
  if (g.size() != want.value.size()) return "wrong size";
  for (size_t i = 0; i < g.size(); i++)
    if (!(std::fabs(g[i] - want.value[i]) <= want.bound[i]))
      return "element " + std::to_string(i) + ": " + std::to_string(g[i]) + " want " + std::to_string(want.value[i]) +
             " (bound " + std::to_string(want.bound[i]) + ")";
  return "";
}

kiln_tensor *zeros_like_product(kiln_dtype dt, V64 shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return from_values(dt, shape, VD((size_t)n, 0.0));
}

V64 product_shape(const kiln_tensor *a, const kiln_tensor *b) {
  V64 as = shape_of(a), bs = shape_of(b);
  size_t rank = std::max(as.size(), bs.size());
  V64 s(rank);
  for (size_t i = 0; i + 2 < rank; i++) {
    int64_t x = i + as.size() >= rank ? as[i + as.size() - rank] : 1;
    int64_t y = i + bs.size() >= rank ? bs[i + bs.size() - rank] : 1;
    s[i] = std::max(x, y);
  }
  s[rank - 2] = as[as.size() - 2];
  s[rank - 1] = bs.back();
  return s;
}

// matmul_epilogue into a new tensor (NULL on failure)
kiln_tensor *fused(const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *bias, gemm_epilogue epi) {
  kiln_tensor *out = zeros_like_product(kiln_tensor_dtype(a), product_shape(a, b));
  if (matmul_epilogue(a, b, bias, epi, out)) return nullptr;
  return out;
}

struct Shape {
  int64_t m, n, k;
};
// 1 x 1, vectors, below and above the packing and the compiled kernel's
// thresholds, primes, partial register tiles in both directions, K over
// several 256-deep cache blocks, N over several 1024-wide panels
const Shape kShapes[] = {{1, 1, 1},     {1, 1, 300},    {1, 77, 5},      {1, 300, 600},   {300, 1, 600},
                         {77, 1, 5},    {2, 2, 2},      {5, 7, 3},       {24, 24, 24},    {25, 33, 17},
                         {64, 64, 64},  {65, 64, 63},   {97, 131, 67},   {12, 32, 700},   {13, 33, 257},
                         {200, 45, 90}, {31, 1100, 70}, {150, 70, 1000}, {256, 256, 256}, {263, 97, 513}};

TEST(Gemm, OddShapesMatchADoubleLoop) {
  Scoped scope;
  std::mt19937 rng(1);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    for (const Shape &s : kShapes) {
      kiln_tensor *a = random_tensor(rng, dt, {s.m, s.k}), *b = random_tensor(rng, dt, {s.k, s.n});
      kiln_tensor *c = kiln_matmul(a, b);
      ASSERT_NE(c, nullptr) << kiln_last_error();
      EXPECT_EQ(shape_of(c), (V64{s.m, s.n}));
      EXPECT_EQ(check(c, reference(a, b, nullptr, GEMM_EPI_NONE)), "")
          << kiln_dtype_name(dt) << " " << s.m << "x" << s.n << "x" << s.k;
    }
  }
}

TEST(Gemm, BatchesMatchADoubleLoop) {
  Scoped scope;
  std::mt19937 rng(2);
  struct B {
    V64 a, b;
  };
  const B cases[] = {
      {{3, 70, 90}, {90, 80}},           // one weight for every batch
      {{2, 1, 65, 70}, {1, 3, 70, 66}},  // batch dims broadcast both ways
      {{4, 97, 131}, {4, 131, 67}},      // big enough for the compiled kernel each
      {{40, 5, 7}, {40, 7, 9}},          // many small ones, split over threads
      {{2, 130, 300}, {300, 1}},         // matrix-vector per batch
  };
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    for (const B &t : cases) {
      kiln_tensor *a = random_tensor(rng, dt, t.a), *b = random_tensor(rng, dt, t.b);
      kiln_tensor *c = kiln_matmul(a, b);
      ASSERT_NE(c, nullptr) << kiln_last_error();
      EXPECT_EQ(shape_of(c), product_shape(a, b));
      EXPECT_EQ(check(c, reference(a, b, nullptr, GEMM_EPI_NONE)), "") << kiln_dtype_name(dt) << " " << t.a.size();
      // the fused form applies its bias to every matrix of the batch
      kiln_tensor *bias = random_tensor(rng, dt, {t.b.back()});
      kiln_tensor *r = fused(a, b, bias, GEMM_EPI_BIAS_RELU);
      ASSERT_NE(r, nullptr) << kiln_last_error();
      EXPECT_EQ(check(r, reference(a, b, bias, GEMM_EPI_BIAS_RELU)), "") << kiln_dtype_name(dt);
    }
  }
}

const gemm_epilogue kEpilogues[] = {GEMM_EPI_NONE, GEMM_EPI_BIAS, GEMM_EPI_BIAS_RELU, GEMM_EPI_BIAS_TANH};

TEST(Gemm, EveryEpilogueMatchesADoubleLoop) {
  Scoped scope;
  std::mt19937 rng(3);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    for (const Shape &s : kShapes) {
      kiln_tensor *a = random_tensor(rng, dt, {s.m, s.k}), *b = random_tensor(rng, dt, {s.k, s.n});
      kiln_tensor *bias = random_tensor(rng, dt, {s.n});
      for (gemm_epilogue epi : kEpilogues) {
        kiln_tensor *c = fused(a, b, bias, epi);
        ASSERT_NE(c, nullptr) << kiln_last_error();
        EXPECT_EQ(check(c, reference(a, b, bias, epi)), "")
            << kiln_dtype_name(dt) << " " << s.m << "x" << s.n << "x" << s.k << " epilogue " << epi;
      }
    }
  }
  // an empty sum (k = 0) is zero, then the epilogue
  kiln_tensor *a = from_values(KILN_F32, {3, 0}, {}), *b = from_values(KILN_F32, {0, 2}, {});
  kiln_tensor *bias = from_values(KILN_F32, {2}, {-1.5, 2.5});
  kiln_tensor *c = fused(a, b, bias, GEMM_EPI_BIAS_RELU);
  ASSERT_NE(c, nullptr) << kiln_last_error();
  EXPECT_EQ(values(c), (VD{0, 2.5, 0, 2.5, 0, 2.5}));
}

TEST(Gemm, EpilogueErrorsNameMatmul) {
  Scoped scope;
  kiln_tensor *a = from_values(KILN_F32, {2, 3}, VD(6, 1.0)), *b = from_values(KILN_F32, {3, 4}, VD(12, 1.0));
  kiln_tensor *out = zeros_like_product(KILN_F32, {2, 4});
  kiln_tensor *short_bias = from_values(KILN_F32, {3}, VD(3, 1.0));
  EXPECT_EQ(matmul_epilogue(a, b, short_bias, GEMM_EPI_BIAS, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: "));
  EXPECT_EQ(matmul_epilogue(a, b, nullptr, GEMM_EPI_BIAS_RELU, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: "));
  EXPECT_EQ(matmul_epilogue(a, b, nullptr, (gemm_epilogue)17, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: "));
  kiln_tensor *ia = from_values(KILN_I32, {2, 3}, VD(6, 1.0)), *ib = from_values(KILN_I32, {3, 4}, VD(12, 1.0));
  kiln_tensor *iout = zeros_like_product(KILN_I32, {2, 4});
  EXPECT_EQ(matmul_epilogue(ia, ib, nullptr, GEMM_EPI_BIAS, iout), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: "));
  EXPECT_EQ(matmul_epilogue(ia, ib, nullptr, GEMM_EPI_NONE, iout), 0) << kiln_last_error();
  EXPECT_EQ(values(iout), VD(8, 3.0));
}

// matmul_nt: a . transpose(w) with w read in place. Against the reference
// for shapes around its four-row groups and sixteen-lane sums, in every
// dtype; and bit for bit the n = 1 product (the same sums in the same order).
TEST(Gemm, TransposedOperandReadInPlace) {
  Scoped scope;
  std::mt19937 rng(12);
  for (kiln_dtype dt : {KILN_F32, KILN_F64, KILN_I32, KILN_I64})
    for (int64_t m : {1, 2, 4})
      for (int64_t n : {1, 3, 4, 5, 9, 64})
        for (int64_t k : {0, 1, 15, 16, 17, 100}) {
          SCOPED_TRACE(std::string(kiln_dtype_name(dt)) + " " + std::to_string(m) + "x" + std::to_string(k) +
                       " . (" + std::to_string(n) + "x" + std::to_string(k) + ")T");
          kiln_tensor *a = random_tensor(rng, KILN_F64, {m, k}), *w = random_tensor(rng, KILN_F64, {n, k});
          if (dt == KILN_I32 || dt == KILN_I64) {  // small integers: exact
            a = kiln_cast(kiln_mul(a, kiln_scalar(KILN_F64, 9)), dt);
            w = kiln_cast(kiln_mul(w, kiln_scalar(KILN_F64, 9)), dt);
          } else {
            a = kiln_cast(a, dt), w = kiln_cast(w, dt);
          }
          kiln_tensor *wt = kiln_transpose(w, 0, nullptr), *out = zeros_like_product(dt, {m, n});
          ASSERT_EQ(matmul_nt(a, w, out), 0) << kiln_last_error();
          if (dt == KILN_I32 || dt == KILN_I64) {
            EXPECT_EQ(values(out), values(kiln_matmul(a, wt)));
            continue;
          }
          EXPECT_EQ(check(out, reference(a, wt, nullptr, GEMM_EPI_NONE)), "");
          for (int64_t i = 0; i < m; i++) {  // row i = w . (row i of a) as a column
            int64_t begin[2] = {i, 0}, size[2] = {1, k}, ob[2] = {i, 0}, os[2] = {1, n}, col_shape[2] = {n, 1};
            kiln_tensor *col = kiln_transpose(kiln_slice(a, begin, size), 0, nullptr);
            kiln_tensor *want = kiln_matmul(w, col);
            EXPECT_TRUE(same_bits(kiln_reshape(kiln_slice(out, ob, os), 2, col_shape), want)) << i;
          }
        }
  // bad operands name matmul
  kiln_tensor *a = from_values(KILN_F32, {2, 3}, VD(6, 1.0)), *w = from_values(KILN_F32, {4, 3}, VD(12, 1.0));
  EXPECT_EQ(matmul_nt(a, w, zeros_like_product(KILN_F32, {2, 4})), 0);
  EXPECT_EQ(matmul_nt(a, from_values(KILN_F32, {4, 2}, VD(8, 1.0)), zeros_like_product(KILN_F32, {2, 4})), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: "));
  EXPECT_EQ(matmul_nt(a, w, zeros_like_product(KILN_F32, {4, 2})), -1);
  EXPECT_EQ(matmul_nt(a, from_values(KILN_F64, {4, 3}, VD(12, 1.0)), zeros_like_product(KILN_F32, {2, 4})), -1);
  EXPECT_EQ(matmul_nt(from_values(KILN_F32, {1, 2, 3}, VD(6, 1.0)), w, zeros_like_product(KILN_F32, {2, 4})), -1);
  kiln_tensor *ba = kiln_cast(a, KILN_BOOL), *bw = kiln_cast(w, KILN_BOOL);
  EXPECT_EQ(matmul_nt(ba, bw, kiln_cast(zeros_like_product(KILN_F32, {2, 4}), KILN_BOOL)), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: no kernel for bool"));
  EXPECT_EQ(matmul_nt(nullptr, w, nullptr), -1);
}

// matmul_trans: either operand given transposed, read as it lies by the
// packing. The same bits as the product of transposed copies where both
// take the same path (packed products; small ones element by element), and
// close to it where a few rows times a transposed matrix sum as matmul_nt.
TEST(Gemm, TransposedOperandsArePackedInPlace) {
  Scoped scope;
  std::mt19937 rng(13);
  struct Shape {
    int64_t m, n, k;
  };
  for (kiln_dtype dt : {KILN_F32, KILN_F64, KILN_I32})
    for (Shape sh : {Shape{1, 5, 7}, Shape{3, 4, 9}, Shape{5, 9, 17}, Shape{33, 29, 100}, Shape{64, 256, 300},
                     Shape{130, 70, 257}})
      for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
          SCOPED_TRACE(std::string(kiln_dtype_name(dt)) + " " + std::to_string(sh.m) + "x" + std::to_string(sh.k) +
                       " . " + std::to_string(sh.k) + "x" + std::to_string(sh.n) + (ta ? " A^T" : "") +
                       (tb ? " B^T" : ""));
          kiln_tensor *a = random_tensor(rng, KILN_F64, ta ? V64{sh.k, sh.m} : V64{sh.m, sh.k});
          kiln_tensor *b = random_tensor(rng, KILN_F64, tb ? V64{sh.n, sh.k} : V64{sh.k, sh.n});
          if (dt == KILN_I32) {
            a = kiln_mul(a, kiln_scalar(KILN_F64, 9)), b = kiln_mul(b, kiln_scalar(KILN_F64, 9));
          }
          a = kiln_cast(a, dt), b = kiln_cast(b, dt);
          kiln_tensor *opa = ta ? kiln_transpose(a, 0, nullptr) : a, *opb = tb ? kiln_transpose(b, 0, nullptr) : b;
          kiln_tensor *out = zeros_like_product(dt, {sh.m, sh.n});
          ASSERT_EQ(matmul_trans(a, b, ta, tb, out), 0) << kiln_last_error();
          kiln_tensor *want = kiln_matmul(opa, opb);
          if (dt == KILN_I32 || ta || !tb || sh.m > MATMUL_NT_ROWS)
            EXPECT_TRUE(same_bits(out, want));
          else
            EXPECT_EQ(check(out, reference(opa, opb, nullptr, GEMM_EPI_NONE)), "");
        }
  kiln_tensor *a = from_values(KILN_F32, {3, 2}, VD(6, 1.0)), *b = from_values(KILN_F32, {4, 3}, VD(12, 1.0));
  EXPECT_EQ(matmul_trans(a, b, true, true, zeros_like_product(KILN_F32, {2, 4})), 0) << kiln_last_error();
  EXPECT_EQ(matmul_trans(a, b, false, true, zeros_like_product(KILN_F32, {3, 4})), -1);  // k: 2 vs 3
  EXPECT_THAT(kiln_last_error(), HasSubstr("matmul: "));
  EXPECT_EQ(matmul_trans(a, b, true, true, zeros_like_product(KILN_F32, {4, 2})), -1);
  EXPECT_EQ(matmul_trans(a, nullptr, true, true, zeros_like_product(KILN_F32, {2, 4})), -1);
}

// Where the host's JIT works, the compiled micro-kernel is there for f32
// and f64 and every epilogue, vector code for the host (AVX-512 when it
// has it), and gives the C kernel's bits: the same sum per element.
bool host_has_kernels() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// A host without AVX2 and FMA has no compiled micro-kernel: the provider
// says so for every dtype and epilogue (the C kernel then runs) and the
// kernel's text is an error naming gemm.
void expect_no_compiled_kernels() {
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (gemm_epilogue epi : kEpilogues) {
      gemm_ukernel uk;
      EXPECT_FALSE(cpu_gemm_ukernel(dt, epi, &uk)) << kiln_dtype_name(dt) << " " << epi;
    }
  EXPECT_EQ(cpu_gemm_text(KILN_F32, GEMM_EPI_NONE, "asm"), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("gemm: no compiled micro-kernel for this CPU"));
}

TEST(Gemm, CompiledMicroKernelIsTheCKernelBitForBit) {
  EnvGuard cpu("KILN_BACKEND", "cpu"), any("KILN_GEMM", nullptr);
  Scoped scope;
  if (!host_has_kernels()) return expect_no_compiled_kernels();
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (gemm_epilogue epi : kEpilogues) {
      gemm_ukernel uk;
      ASSERT_TRUE(cpu_gemm_ukernel(dt, epi, &uk)) << kiln_dtype_name(dt) << " " << epi;
      EXPECT_NE(uk.fn, nullptr);
      EXPECT_GE(uk.mr, 1);
      EXPECT_GE(uk.nr, 4);
    }
  {
    EnvGuard c("KILN_GEMM", "c");
    gemm_ukernel uk;
    EXPECT_FALSE(cpu_gemm_ukernel(KILN_F32, GEMM_EPI_NONE, &uk));
  }
  {
    EnvGuard interp("KILN_BACKEND", "interp");
    gemm_ukernel uk;
    EXPECT_FALSE(cpu_gemm_ukernel(KILN_F32, GEMM_EPI_NONE, &uk));
  }
  gemm_ukernel uk;
  EXPECT_FALSE(cpu_gemm_ukernel(KILN_I32, GEMM_EPI_NONE, &uk));

  char *text = cpu_gemm_text(KILN_F32, GEMM_EPI_BIAS_RELU, "asm");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  std::string s = text;
  free(text);
  EXPECT_THAT(s, HasSubstr("vfmadd231ps"));
  if (__builtin_cpu_supports("avx512f")) {
    EXPECT_THAT(s, HasSubstr("zmm"));
  }
  text = cpu_gemm_text(KILN_F64, GEMM_EPI_BIAS_TANH, "llvm");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  EXPECT_THAT(std::string(text), HasSubstr("llvm.fma.v"));
  free(text);
  EXPECT_EQ(cpu_gemm_text(KILN_F32, GEMM_EPI_NONE, "ptx"), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("gemm: "));

  std::mt19937 rng(4);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    for (const Shape &s : kShapes) {
      if (s.m * s.n * s.k < MATMUL_JIT_WORK) continue;
      kiln_tensor *a = random_tensor(rng, dt, {s.m, s.k}), *b = random_tensor(rng, dt, {s.k, s.n});
      kiln_tensor *bias = random_tensor(rng, dt, {s.n});
      for (gemm_epilogue epi : kEpilogues) {
        kiln_tensor *jit = fused(a, b, bias, epi), *c = nullptr;
        {
          EnvGuard g("KILN_GEMM", "c");
          c = fused(a, b, bias, epi);
        }
        ASSERT_NE(jit, nullptr) << kiln_last_error();
        ASSERT_NE(c, nullptr) << kiln_last_error();
        // tanh: the LLVM kernel's vector tanh against libm's
        EXPECT_TRUE(epi == GEMM_EPI_BIAS_TANH ? within_ulps(jit, c, 4) : same_bits(jit, c))
            << kiln_dtype_name(dt) << " " << s.m << "x" << s.n << "x" << s.k << " epilogue " << epi;
      }
    }
  }
}

// ---- threads ----

uint64_t fnv(const kiln_tensor *t) {
  const unsigned char *p = (const unsigned char *)kiln_tensor_data(t);
  size_t n = (size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t));
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// products big enough to split over every thread, as one checksum
uint64_t threaded_checksum() {
  std::mt19937 rng(5);
  uint64_t h = 0;
  const Shape shapes[] = {{300, 260, 270}, {1000, 40, 300}, {33, 2100, 100}, {4000, 1, 300}, {1, 4000, 300}};
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    for (const Shape &s : shapes) {
      kiln_tensor *a = random_tensor(rng, dt, {s.m, s.k}), *b = random_tensor(rng, dt, {s.k, s.n});
      kiln_tensor *bias = random_tensor(rng, dt, {s.n});
      kiln_tensor *c = kiln_matmul(a, b);
      EXPECT_EQ(check(c, reference(a, b, nullptr, GEMM_EPI_NONE)), "");
      kiln_tensor *r = fused(a, b, bias, GEMM_EPI_BIAS_RELU);
      EXPECT_NE(r, nullptr) << kiln_last_error();
      h = h * 31 + fnv(c);
      if (r) h = h * 31 + fnv(r);
    }
    kiln_tensor *a = random_tensor(rng, dt, {6, 90, 100}), *b = random_tensor(rng, dt, {6, 100, 110});
    h = h * 31 + fnv(kiln_matmul(a, b));
  }
  return h;
}

// The child's side of Gemm.AnyThreadCountGivesTheSameBits: with
// KILN_GEMM_TEST_CHILD set, this binary prints the checksum and exits from a
// static initializer, before main, so the child is no test of its own. The
// expectations inside count through gtest's ad hoc result; the exit status
// says whether any failed.
int gemm_child_role() {
  if (!getenv("KILN_GEMM_TEST_CHILD")) return 0;
  unsigned long long sum;
  int nr, bad = 0;
  {
    Scoped scope;
    // a fresh process: threads race to compile every micro-kernel first
    const char *backend = getenv("KILN_BACKEND");
    bool want = host_has_kernels() && !getenv("KILN_GEMM") && !(backend && !strcmp(backend, "interp"));
    std::vector<std::thread> threads;
    std::vector<gemm_ukernel> got(8 * 8, gemm_ukernel{nullptr, 0, 0});
    std::vector<int> wrong(8, 0);
    for (int t = 0; t < 8; t++)
      threads.emplace_back([&, t] {
        for (int v = 0; v < 8; v++)
          wrong[t] += cpu_gemm_ukernel(v < 4 ? KILN_F32 : KILN_F64, kEpilogues[(v + t) % 4], &got[t * 8 + v]) != want;
      });
    for (std::thread &th : threads) th.join();
    for (int t = 0; t < 8; t++) bad += wrong[t];
    for (int t = 1; t < 8; t++)
      for (int v = 0; v < 8; v++) {
        int w = (v / 4) * 4 + ((v % 4) + t) % 4; /* thread 0's call for the same kernel */
        bad += got[t * 8 + v].fn != got[w].fn;
      }
    sum = (unsigned long long)threaded_checksum();
    nr = got[0].nr;
  }
  bool failed = bad || ::testing::UnitTest::GetInstance()->ad_hoc_test_result().Failed();
  printf("checksum %llu threads %d nr %d\n", sum, kiln_num_threads(), nr);
  if (bad) fprintf(stderr, "child: %d micro-kernel lookups were wrong or differed between threads\n", bad);
  fflush(stdout);
  fflush(stderr);
  _exit(failed ? 1 : 0);
}
const int gemm_child_hook = gemm_child_role();

// Runs gemm_child_role in a child process with env ("NAME=value ...") set;
// its output (stdout and stderr) and exit status.
std::string run_child(const std::string &env, int *rc) { return run_self(env + " KILN_GEMM_TEST_CHILD=1", rc); }

size_t count(const std::string &s, const std::string &what) {
  size_t n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}

// The pool reads KILN_NUM_THREADS once: each count runs in a process of its
// own. The grid of tasks never splits K, so the bits never change; nor do
// they with the AVX2 kernels (KILN_GEMM_ISA=avx2, read once per kernel) or
// the C one.
TEST(Gemm, AnyThreadCountGivesTheSameBits) {
  uint64_t here;
  {
    Scoped scope;
    here = threaded_checksum();
  }
  struct Run {
    int threads;
    const char *env;
  };
  const Run runs[] = {{1, ""}, {2, ""}, {3, ""}, {5, ""}, {2, "KILN_GEMM_ISA=avx2 "}, {3, "KILN_GEMM=c "}};
  EnvGuard any("KILN_GEMM", nullptr), isa("KILN_GEMM_ISA", nullptr), cpu("KILN_BACKEND", "cpu"); /* as a run names */
  for (const Run &run : runs) {
    int threads = run.threads;
    int rc;
    std::string out = run_child(std::string(run.env) + "KILN_NUM_THREADS=" + std::to_string(threads), &rc);
    EXPECT_EQ(rc, 0) << out;
    size_t at = out.find("checksum ");
    ASSERT_NE(at, std::string::npos) << out;
    unsigned long long sum = 0;
    int n = 0, nr = 0;
    ASSERT_EQ(sscanf(out.c_str() + at, "checksum %llu threads %d nr %d", &sum, &n, &nr), 3) << out;
    EXPECT_EQ(n, threads);
    EXPECT_EQ(sum, here) << threads << " threads " << run.env;
    if (strstr(run.env, "avx2") && host_has_kernels()) {
      EXPECT_EQ(nr, 16) << "8 floats a vector";
    }
  }
}

// The micro-kernels are in the disk cache as programs are: a second process
// links them instead of running LLVM, and gets the same bits; damaged
// entries are compiled again. A host without them caches nothing and gets
// the same bits too.
TEST(Gemm, ASecondProcessLoadsTheKernelsFromTheDiskCache) {
  const size_t kernels = host_has_kernels() ? 8 : 0;  // f32 and f64, four epilogues each
  uint64_t here;
  {
    Scoped scope;
    here = threaded_checksum();
  }
  char tmpl[] = "/tmp/kiln-gemm-cache-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  EnvGuard any("KILN_GEMM", nullptr), isa("KILN_GEMM_ISA", nullptr), cpu("KILN_BACKEND", "cpu");
  const std::string env = "KILN_LOG=cache KILN_CACHE_DIR=" + dir;
  auto checksum = [](const std::string &out) {
    unsigned long long sum = 0;
    size_t at = out.find("checksum ");
    return at != std::string::npos && sscanf(out.c_str() + at, "checksum %llu", &sum) == 1 ? sum : 0ull;
  };
  int rc;
  std::string cold = run_child(env, &rc);
  EXPECT_EQ(rc, 0) << cold;
  EXPECT_EQ(count(cold, ": miss"), kernels) << cold;
  EXPECT_EQ(checksum(cold), here) << cold;
  std::string warm = run_child(env, &rc);
  EXPECT_EQ(rc, 0) << warm;
  EXPECT_EQ(count(warm, ": hit"), kernels) << warm;
  EXPECT_EQ(count(warm, ": miss"), 0u) << warm;
  EXPECT_EQ(checksum(warm), here) << warm;
  // every entry cut in half: each is noticed, rebuilt and stored again
  std::vector<std::string> entries;
  if (std::filesystem::is_directory(dir))
    for (const auto &e : std::filesystem::directory_iterator(dir))
      if (e.path().extension() == ".kco") entries.push_back(e.path().string());
  EXPECT_EQ(entries.size(), kernels);
  for (const std::string &e : entries) std::filesystem::resize_file(e, std::filesystem::file_size(e) / 2);
  std::string rebuilt = run_child(env, &rc);
  EXPECT_EQ(rc, 0) << rebuilt;
  EXPECT_EQ(count(rebuilt, "rebuilding it"), kernels) << rebuilt;
  EXPECT_EQ(count(rebuilt, ": miss"), kernels) << rebuilt;
  EXPECT_EQ(checksum(rebuilt), here) << rebuilt;
  std::string again = run_child(env, &rc);
  EXPECT_EQ(count(again, ": hit"), kernels) << again;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

TEST(Gemm, ManyThreadsMultiplyAtOnce) {
  Scoped scope;
  std::mt19937 rng(6);
  struct Job {
    kiln_tensor *a, *b, *bias;
    gemm_epilogue epi;
    kiln_tensor *want;
  };
  std::vector<Job> jobs;
  const Shape shapes[] = {{97, 131, 67}, {64, 64, 64}, {130, 70, 300}, {5, 7, 3}, {1, 200, 300}, {200, 33, 513}};
  int i = 0;
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (const Shape &s : shapes) {
      Job j{random_tensor(rng, dt, {s.m, s.k}), random_tensor(rng, dt, {s.k, s.n}), random_tensor(rng, dt, {s.n}),
            kEpilogues[i++ % 4], nullptr};
      j.want = fused(j.a, j.b, j.bias, j.epi);
      ASSERT_NE(j.want, nullptr) << kiln_last_error();
      jobs.push_back(j);
    }
  std::vector<std::thread> threads;
  std::vector<int> bad(8, 0);
  for (int t = 0; t < 8; t++)
    threads.emplace_back([&, t] {
      kiln_scope_push();
      for (int rep = 0; rep < 4; rep++)
        for (size_t k = 0; k < jobs.size(); k++) {
          const Job &j = jobs[(k + (size_t)t) % jobs.size()];
          kiln_tensor *c = fused(j.a, j.b, j.bias, j.epi);
          if (!c || !same_bits(c, j.want)) bad[t]++;
          kiln_tensor *d = kiln_matmul(j.a, j.b);
          if (!d) bad[t]++;
        }
      kiln_scope_pop();
    });
  for (std::thread &th : threads) th.join();
  for (int t = 0; t < 8; t++) EXPECT_EQ(bad[t], 0) << "thread " << t;
}

// ---- the compiled fusions ----

kiln_tensor *random_arg(std::mt19937 &rng, const op_type &ty) {
  return random_tensor(rng, ty.dtype, V64(ty.shape, ty.shape + ty.rank));
}

// A dot + bias (+ relu / tanh) fusion: the matmul applies the epilogue and
// the program has no kernel; anything else keeps its kernel. Each against
// the interpreter (which runs dot, add and relu one by one): bit for bit but
// tanh (the compiled vector tanh against the eager one).
TEST(Gemm, CompiledDotEpiloguesMatchTheInterpreter) {
  Scoped scope;
  std::mt19937 rng(7);
  struct F {
    const char *text;
    int kernels;
    int ulps;
  };
  const F fs[] = {
      {"func @k(%x: f32[70,90], %w: f32[90,80], %b: f32[80]) -> f32[70,80] {\n"
       "  %d = dot %x, %w : f32[70,80]\n"
       "  %a = add %d, %b : f32[70,80]\n"
       "  %z = relu %a : f32[70,80]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f32[70,90], %w: f32[90,80], %b: f32[80]) -> f32[70,80] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[70,80]\n"
       "  return %r\n"
       "}\n",
       0, 0},
      // bias first, a [1, n] bias, K over several blocks
      {"func @k(%x: f32[67,600], %w: f32[600,97], %b: f32[1,97]) -> f32[67,97] {\n"
       "  %d = dot %x, %w : f32[67,97]\n"
       "  %a = add %b, %d : f32[67,97]\n"
       "  return %a\n"
       "}\n"
       "func @f(%x: f32[67,600], %w: f32[600,97], %b: f32[1,97]) -> f32[67,97] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[67,97]\n"
       "  return %r\n"
       "}\n",
       0, 0},
      // batched, f64, tanh
      {"func @k(%x: f64[3,65,130], %w: f64[130,67], %b: f64[67]) -> f64[3,65,67] {\n"
       "  %d = dot %x, %w : f64[3,65,67]\n"
       "  %a = add %d, %b : f64[3,65,67]\n"
       "  %t = tanh %a : f64[3,65,67]\n"
       "  return %t\n"
       "}\n"
       "func @f(%x: f64[3,65,130], %w: f64[130,67], %b: f64[67]) -> f64[3,65,67] {\n"
       "  %r = fusion @k(%x, %w, %b) : f64[3,65,67]\n"
       "  return %r\n"
       "}\n",
       0, 4},
      {"func @k(%x: f32[100,120], %w: f32[120,90], %b: f32[90]) -> f32[100,90] {\n"
       "  %d = dot %x, %w : f32[100,90]\n"
       "  %a = add %d, %b : f32[100,90]\n"
       "  %t = tanh %a : f32[100,90]\n"
       "  return %t\n"
       "}\n"
       "func @f(%x: f32[100,120], %w: f32[120,90], %b: f32[90]) -> f32[100,90] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[100,90]\n"
       "  return %r\n"
       "}\n",
       0, 4},
      // not the pattern: a bias per element, two results, another op: a kernel
      {"func @k(%x: f32[70,90], %w: f32[90,80], %b: f32[70,80]) -> f32[70,80] {\n"
       "  %d = dot %x, %w : f32[70,80]\n"
       "  %a = add %d, %b : f32[70,80]\n"
       "  %z = relu %a : f32[70,80]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f32[70,90], %w: f32[90,80], %b: f32[70,80]) -> f32[70,80] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[70,80]\n"
       "  return %r\n"
       "}\n",
       1, 0},
      {"func @k(%x: f32[70,90], %w: f32[90,80], %b: f32[80]) -> (f32[70,80], f32[70,80]) {\n"
       "  %d = dot %x, %w : f32[70,80]\n"
       "  %a = add %d, %b : f32[70,80]\n"
       "  %z = relu %a : f32[70,80]\n"
       "  return %a, %z\n"
       "}\n"
       "func @f(%x: f32[70,90], %w: f32[90,80], %b: f32[80]) -> (f32[70,80], f32[70,80]) {\n"
       "  %r, %s = fusion @k(%x, %w, %b) : f32[70,80], f32[70,80]\n"
       "  return %r, %s\n"
       "}\n",
       1, 0},
      {"func @k(%x: f32[70,90], %w: f32[90,80], %b: f32[80]) -> f32[70,80] {\n"
       "  %d = dot %x, %w : f32[70,80]\n"
       "  %a = sub %d, %b : f32[70,80]\n"
       "  %z = relu %a : f32[70,80]\n"
       "  return %z\n"
       "}\n"
       "func @f(%x: f32[70,90], %w: f32[90,80], %b: f32[80]) -> f32[70,80] {\n"
       "  %r = fusion @k(%x, %w, %b) : f32[70,80]\n"
       "  return %r\n"
       "}\n",
       1, 0},
      // too small for the compiled micro-kernel: the kernel after the dot
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
       1, 0},
  };
  for (const F &t : fs) {
    for (const char *gemm : {(const char *)nullptr, "c"}) {  // the compiled and the C micro-kernel
      EnvGuard g("KILN_GEMM", gemm);
      ir_module *m = ir_parse(t.text, "gemm.kir");
      ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << t.text;
      const ir_func *f = ir_module_find(m, "f");
      std::vector<kiln_tensor *> args;
      for (int i = 0; i < f->n_params; i++) args.push_back(random_arg(rng, f->types[i]));
      std::vector<kiln_tensor *> want(f->n_results), got(f->n_results);
      ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << kiln_last_error();
      cpu_program *p = cpu_compile(f);
      ASSERT_NE(p, nullptr) << kiln_last_error();
      EXPECT_EQ(cpu_program_kernels(p), t.kernels) << t.text;
      ASSERT_EQ(cpu_run(p, args.data(), got.data()), 0) << kiln_last_error();
      for (int r = 0; r < f->n_results; r++)
        EXPECT_TRUE(within_ulps(got[r], want[r], t.ulps))
            << t.text << " result " << r << " KILN_GEMM " << (gemm ? gemm : "(unset)");
      // and against the double loop
      if (t.kernels == 0) {
        gemm_epilogue epi = strstr(t.text, "relu")   ? GEMM_EPI_BIAS_RELU
                            : strstr(t.text, "tanh") ? GEMM_EPI_BIAS_TANH
                                                     : GEMM_EPI_BIAS;
        EXPECT_EQ(check(got[0], reference(args[0], args[1], args[2], epi)), "") << t.text;
      }
      cpu_program_free(p);
      ir_module_free(m);
    }
  }
}

// ---- the convolution micro-kernels (matmul.h) ----

// Runs a convolution micro-kernel over a whole mr x nr tile (rows i0, i0 +
// uk.mr, ...: the C kernel's tile is smaller), rows of A lda apart.
template <typename T>
void conv_tile(const conv_ukernel &uk, int taps, const std::vector<const T *> &a, int64_t kc,
               int64_t lda, const std::vector<T> &b, std::vector<T> &c, int64_t ldc, int64_t mr, int64_t nr,
               int32_t flags, const std::vector<T> &bias, const std::vector<T> &res) {
  for (int64_t i0 = 0; i0 < mr; i0 += uk.mr) {
    for (int64_t j0 = 0; j0 < nr; j0 += uk.nr) {
      // B packed for this kernel's nr: columns j0 .. j0 + uk.nr of the full panel (zeros past nr)
      std::vector<T> bp((size_t)(taps * kc * uk.nr), 0);
      for (int64_t r = 0; r < taps * kc; r++)
        for (int64_t j = 0; j < uk.nr && j0 + j < nr; j++)  // b: rows of ldc
          bp[(size_t)(r * uk.nr + j)] = b[(size_t)(r * ldc + j0 + j)];
      std::vector<const void *> at;
      for (int t = 0; t < taps; t++) at.push_back(a[t] + i0 * lda);
      uk.fn(taps, at.data(), kc, lda, bp.data(), c.data() + i0 * ldc + j0, ldc, std::min<int64_t>(uk.mr, mr - i0),
            std::min<int64_t>(uk.nr, nr - j0), flags, bias.data() + j0, res.data() + i0 * ldc + j0);
    }
  }
}

// The compiled convolution kernels (the usual tile and the narrow one): one
// per (dtype, epilogue, lda, narrow), the same
// one on a second request, a generic one (lda 0) too; each gives the C
// kernel's bits (the same sum per element: taps, then k, one FMA each) for
// every epilogue, with and without the residual, on full and partial tiles.
template <typename T>
void check_conv_kernels(kiln_dtype dt) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<T> u(-1, 1);
  const int taps = 3;
  // A: taps x rows readable rows of lda; a kernel reads whole tiles of its
  // MR rows (the C kernel's 6 from row 12 of a 14-row tile: 18), storing mr
  const int64_t kc = 21, lda = 37, rows = 14 + 2 + 16, cols = 40;
  std::vector<std::vector<T>> img(taps, std::vector<T>((size_t)(rows * lda)));
  std::vector<const T *> a;
  for (auto &v : img) {
    for (T &e : v) e = u(rng);
    a.push_back(v.data());
  }
  std::vector<T> b((size_t)(taps * kc * cols)), bias((size_t)cols), res((size_t)(rows * cols));
  for (T &e : b) e = u(rng);
  for (T &e : bias) e = u(rng);
  for (T &e : res) e = u(rng);
  for (bool narrow : {false, true})
  for (gemm_epilogue epi : kEpilogues) {
    conv_ukernel jit, again, generic, c = matmul_conv_ukernel(dt, epi, lda, narrow, false);
    ASSERT_TRUE(cpu_conv_ukernel(dt, epi, lda, narrow, &jit)) << epi;
    ASSERT_TRUE(cpu_conv_ukernel(dt, epi, lda, narrow, &again));
    ASSERT_TRUE(cpu_conv_ukernel(dt, epi, 0, narrow, &generic));
    EXPECT_EQ(jit.fn, again.fn);
    EXPECT_NE(jit.fn, generic.fn);
    EXPECT_NE(jit.fn, c.fn);
    for (int64_t mr : {jit.mr, jit.mr - 5})
      for (int64_t nr : {(int64_t)cols, (int64_t)7})
        for (int32_t flags : {(int32_t)GEMM_LAST, (int32_t)(GEMM_LAST | GEMM_RESIDUAL)}) {
          int32_t f = flags | (int32_t)epi << GEMM_EPI_SHIFT;
          std::vector<T> cj((size_t)(rows * cols), 0), cg = cj, cc = cj;
          conv_tile<T>(jit, taps, a, kc, lda, b, cj, cols, mr, nr, f, bias, res);
          conv_tile<T>(generic, taps, a, kc, lda, b, cg, cols, mr, nr, f, bias, res);
          conv_tile<T>(c, taps, a, kc, lda, b, cc, cols, mr, nr, f, bias, res);
          EXPECT_EQ(cj, cg) << "epilogue " << epi << " mr " << mr << " nr " << nr << " flags " << flags;
          if (epi != GEMM_EPI_BIAS_TANH) {  // the compiled tanh is its own
            EXPECT_EQ(cj, cc) << "epilogue " << epi << " mr " << mr << " nr " << nr << " flags " << flags;
          }
          // the sums themselves, against a double loop
          for (int64_t i = 0; i < mr; i++)
            for (int64_t j = 0; j < nr; j++) {
              double want = 0;
              for (int t = 0; t < taps; t++)
                for (int64_t p = 0; p < kc; p++)
                  want += (double)a[t][i * lda + p] * b[(size_t)((t * kc + p) * cols + j)];
              if (epi != GEMM_EPI_NONE) want += bias[(size_t)j];
              if (flags & GEMM_RESIDUAL) want += res[(size_t)(i * cols + j)];
              if (epi == GEMM_EPI_BIAS_RELU) want = want < 0 ? 0 : want;
              if (epi == GEMM_EPI_BIAS_TANH) want = std::tanh(want);
              EXPECT_NEAR(cj[(size_t)(i * cols + j)], want, 1e-4) << i << " " << j;
            }
          // nothing stored past the tile
          for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++)
              if (i >= mr || j >= nr) {
                EXPECT_EQ(cj[(size_t)(i * cols + j)], 0) << i << " " << j;
              }
        }
  }
}

TEST(GemmConv, CompiledConvolutionKernelsPerLdaGiveTheCKernelsBits) {
  EnvGuard cpu("KILN_BACKEND", "cpu"), any("KILN_GEMM", nullptr);
  Scoped scope;
  if (!host_has_kernels()) {
    conv_ukernel uk;
    EXPECT_FALSE(cpu_conv_ukernel(KILN_F32, GEMM_EPI_NONE, 64, false, &uk));
    return;
  }
  check_conv_kernels<float>(KILN_F32);
  check_conv_kernels<double>(KILN_F64);
  char *text = cpu_gemm_text(KILN_F32, GEMM_EPI_BIAS_RELU, "conv64-asm");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  EXPECT_THAT(std::string(text), HasSubstr("vfmadd231ps"));
  free(text);
  text = cpu_gemm_text(KILN_F64, GEMM_EPI_NONE, "wgrad-llvm");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  EXPECT_THAT(std::string(text), HasSubstr("llvm.fma.v"));
  free(text);
  conv_ukernel uk;
  EXPECT_FALSE(cpu_conv_ukernel(KILN_I32, GEMM_EPI_NONE, 64, false, &uk));
  {
    EnvGuard c("KILN_GEMM", "c");
    EXPECT_FALSE(cpu_conv_ukernel(KILN_F32, GEMM_EPI_NONE, 64, false, &uk));
    wgrad_ukernel w;
    EXPECT_FALSE(cpu_wgrad_ukernel(KILN_F32, false, &w));
    EXPECT_FALSE(cpu_wgrad_ukernel(KILN_F32, true, &w));
  }
}

// The filter-gradient kernel: runs of strided columns of A and rows of B,
// the C kernel's bits, C added to with GEMM_ACCUMULATE, nothing read past
// nr columns of B (its last row ends the buffer).
template <typename T>
void check_wgrad_kernels(kiln_dtype dt) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<T> u(-1, 1);
  for (bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "the kernel that prefetches" : "the kernel without prefetches");
    wgrad_ukernel jit, c = matmul_wgrad_ukernel(dt, false, prefetch);
    ASSERT_TRUE(cpu_wgrad_ukernel(dt, prefetch, &jit));
    EXPECT_NE(jit.fn, c.fn);
    const int64_t lda = 23, ldb = 45, steps[2] = {13, 6}, cols = 45;
    std::vector<T> a((size_t)(19 * lda + 32)), b((size_t)(19 * ldb));
    for (T &e : a) e = u(rng);
    for (T &e : b) e = u(rng);
    for (int64_t nr : {(int64_t)jit.nr, (int64_t)5}) {
      const int64_t mr = jit.mr - 3;
      std::vector<T> cj((size_t)(jit.mr * cols), (T)0.5), cc = cj;
      for (int32_t flags : {0, (int32_t)GEMM_ACCUMULATE}) {
        // two runs: steps 0..12, then 6 steps from row 13; B's last row is b's end when nr = ldb - (ldb - nr);
        // the first fetches 5 lines of b ahead, the second a's (more lines than steps: as many as steps)
        conv_run runs[2] = {{a.data(), b.data() + (ldb - nr), steps[0], b.data(), 5},
                            {a.data() + 13 * lda, b.data() + 13 * ldb + (ldb - nr), steps[1], a.data(), 100}};
        jit.fn(2, runs, lda, ldb, cj.data(), cols, mr, nr, flags);
        for (int64_t i0 = 0; i0 < mr; i0 += c.mr)
          for (int64_t j0 = 0; j0 < nr; j0 += c.nr) {
            conv_run cr[2] = {{(const T *)runs[0].a + i0, (const T *)runs[0].b + j0, steps[0], runs[0].a, 0},
                              {(const T *)runs[1].a + i0, (const T *)runs[1].b + j0, steps[1], runs[1].a, 0}};
            c.fn(2, cr, lda, ldb, cc.data() + i0 * cols + j0, cols, std::min<int64_t>(c.mr, mr - i0),
                 std::min<int64_t>(c.nr, nr - j0), flags);
          }
        EXPECT_EQ(cj, cc) << "nr " << nr << " flags " << flags;
        for (int64_t i = 0; i < mr; i++)
          for (int64_t j = 0; j < nr; j++) {
            double want = 0;
            for (int64_t p = 0; p < 19; p++)
              want += (double)a[(size_t)(p * lda + i)] * b[(size_t)(p * ldb + ldb - nr + j)];
            if (flags) want = 2 * want;  // the first pass's sum, added to again
            EXPECT_NEAR(cj[(size_t)(i * cols + j)], want, 1e-4) << i << " " << j;
          }
      }
    }
  }
}

TEST(GemmConv, CompiledFilterGradientKernelGivesTheCKernelsBits) {
  EnvGuard cpu("KILN_BACKEND", "cpu"), any("KILN_GEMM", nullptr);
  Scoped scope;
  if (!host_has_kernels()) return;
  check_wgrad_kernels<float>(KILN_F32);
  check_wgrad_kernels<double>(KILN_F64);
}

}  // namespace
