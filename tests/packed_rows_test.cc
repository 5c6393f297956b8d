// packed_rows_test.cc — the CPU backend's packed row kernels (kernel.c,
// emit_packed): a kernel whose output rows are shorter than a 64-byte
// vector and whose elementwise tail holds an expensive op (tanh, exp, a
// division) computes the values that need the row index (a broadcast bias,
// an inline dot) row by row into tiles, then the tail over whole blocks of
// rows with every lane live. Checked: the staged results equal the same
// elements computed by flat kernels bit for bit (and f32 eager execution)
// over row lengths and row counts around the block sizes, in f32 and f64,
// with 1, 2 and 3 threads; the LLVM IR shows the
// packed path was taken where it should be and not where it should not;
// a dot-led kernel (the L2HMC shape) against eager within rounding.
#include <gtest/gtest.h>
#include <kiln.h>

#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln_test;

namespace {

// y = tanh(x + b) * 0.5, z = exp(x - b) / (|x| + 2): the adds and
// subtracts read a row-broadcast bias (tiles), the rest runs packed. No
// product feeds a sum across the cut, so contraction cannot differ.
int tail_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *x = in[0], *b = in[1];
  kiln_tensor *half = kiln_scalar(kiln_tensor_dtype(x), 0.5), *two = kiln_scalar(kiln_tensor_dtype(x), 2.0);
  out[0] = kiln_mul(kiln_tanh(kiln_add(x, b)), half);
  out[1] = kiln_div(kiln_exp(kiln_sub(x, b)), kiln_add(kiln_abs(x), two));
  return out[0] && out[1] ? 0 : -1;
}

// the L2HMC network's layer: tanh(v @ w + b) and 1 - tanh^2
int dot_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *t = kiln_tanh(kiln_add(kiln_matmul(in[0], in[1]), in[2]));
  out[0] = t;
  out[1] = kiln_sub(kiln_scalar(kiln_tensor_dtype(t), 1.0), kiln_mul(t, t));
  return out[0] && out[1] ? 0 : -1;
}

kiln_tensor *normal(kiln_dtype dt, const V64 &shape) { return kiln_random_normal(dt, (int)shape.size(), shape.data()); }

// the staged call's results and its LLVM IR text
std::vector<kiln_tensor *> staged(const char *name, kiln_body_fn body, std::vector<kiln_tensor *> in, std::string *ir) {
  kiln_function *f = kiln_function_new(name, body, nullptr, (int)in.size(), 2);
  std::vector<kiln_tensor *> out(2, nullptr);
  EXPECT_EQ(kiln_function_call(f, in.data(), out.data()), 0) << kiln_last_error();
  char *text = kiln_function_ir(f, 0, "llvm");
  EXPECT_NE(text, nullptr) << kiln_last_error();
  if (text) *ir = text;
  std::free(text);
  kiln_function_free(f);
  return out;
}

std::vector<kiln_tensor *> staged_flat(kiln_tensor *xf, kiln_tensor *bf, std::string *ir) {
  return staged("packed_flat", tail_body, {xf, bf}, ir);
}

std::vector<kiln_tensor *> eager(kiln_body_fn body, std::vector<kiln_tensor *> in) {
  std::vector<kiln_tensor *> out(2, nullptr);
  EXPECT_EQ(body(nullptr, (int)in.size(), in.data(), 2, out.data()), 0) << kiln_last_error();
  return out;
}

// whether kernel.c packs [rows, n]: rows under 64 bytes that do not divide
// it, and not the narrow rows (n <= 4, 16 rows or more) that vectorize
// across rows instead
bool packs(kiln_dtype dt, int64_t n, int64_t rows) {
  int64_t bytes = n * (dt == KILN_F32 ? 4 : 8);
  return bytes < 64 && 64 % bytes != 0 && rows >= 2 && !(n <= 4 && rows >= 16);
}

// The same elements with nothing broadcast: x and b (tiled to x's rows) as
// flat vectors, computed by flat kernels that never pack: each element's
// ops are the same, so are its bits (in f64 too, where the compiled vector
// math is not the eager one's).
std::vector<kiln_tensor *> flat_reference(kiln_tensor *x, kiln_tensor *b, std::string *ir) {
  int64_t r = kiln_tensor_shape(x)[0], n = kiln_tensor_shape(x)[1], flat = r * n;
  kiln_tensor *xf = kiln_reshape(x, 1, &flat);
  kiln_tensor *bf = kiln_reshape(kiln_add(kiln_zeros(kiln_tensor_dtype(x), 2, kiln_tensor_shape(x)), b), 1, &flat);
  return staged_flat(xf, bf, ir);
}

// The child's side of PackedRows.AnyThreadCountGivesEagerBits: with
// KILN_PACKED_TEST_CHILD set, compares and exits before main.
int packed_child_role() {
  if (!getenv("KILN_PACKED_TEST_CHILD")) return 0;
  bool packed = false, same = true;
  {
    Scoped scope;
    kiln_random_seed(12);
    kiln_tensor *x = normal(KILN_F32, {20011, 10}), *b = normal(KILN_F32, {10});
    std::string ir;
    std::vector<kiln_tensor *> got = staged("packed_threads", tail_body, {x, b}, &ir);
    std::vector<kiln_tensor *> want = eager(tail_body, {x, b});  // f32: the same bits as compiled
    packed = ir.find("%ptile") != std::string::npos;
    for (int k = 0; k < 2; k++) same = same && got[k] && same_bits(got[k], want[k]);
  }
  bool failed = ::testing::UnitTest::GetInstance()->ad_hoc_test_result().Failed();
  printf("packed %d same %d threads %d\n", packed, same, kiln_num_threads());
  fflush(stdout);
  _exit(failed ? 1 : 0);
}
const int packed_child_hook = packed_child_role();

}  // namespace

TEST(PackedRows, ShortRowsEqualEagerBitForBit) {
  Scoped s;
  kiln_random_seed(11);
  const int64_t lengths[] = {1, 2, 3, 5, 6, 7, 10, 12, 15, 17, 33};
  const int64_t counts[] = {1, 2, 7, 48, 49, 200, 1001};
  int packed = 0;
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (int64_t n : lengths)
      for (int64_t r : counts) {
        kiln_scope_push();
        std::string what = std::string(dt == KILN_F32 ? "f32" : "f64") + " [" + std::to_string(r) + "," +
                           std::to_string(n) + "]";
        kiln_tensor *x = normal(dt, {r, n}), *b = normal(dt, {n});
        std::string ir;
        std::vector<kiln_tensor *> got = staged("packed_tail", tail_body, {x, b}, &ir);
        std::string flat_ir;
        std::vector<kiln_tensor *> want = flat_reference(x, b, &flat_ir);
        EXPECT_EQ(flat_ir.find("%ptile"), std::string::npos) << what;
        std::vector<kiln_tensor *> ref = eager(tail_body, {x, b});
        for (int k = 0; k < 2; k++) {
          ASSERT_NE(got[k], nullptr) << what;
          ASSERT_NE(want[k], nullptr) << what;
          int64_t flat = kiln_tensor_size(got[k]);
          EXPECT_TRUE(same_bits(kiln_reshape(got[k], 1, &flat), want[k])) << what << " output " << k;
          if (dt == KILN_F32) EXPECT_TRUE(same_bits(got[k], ref[k])) << what << " output " << k << " vs eager";
          else EXPECT_TRUE(within_ulps(got[k], ref[k], 8)) << what << " output " << k << " vs eager";
        }
        bool has = ir.find("%ptile") != std::string::npos;
        EXPECT_EQ(has, packs(dt, n, r)) << what << ": packed path " << (has ? "taken" : "not taken");
        packed += has;
        kiln_scope_pop();
      }
  EXPECT_GT(packed, 20);
}

// The pool reads KILN_NUM_THREADS once: each count in a process of its own
// (as conv_test's), which prints whether the staged results of a kernel
// split into tasks across threads equal eager execution bit for bit.
TEST(PackedRows, AnyThreadCountGivesEagerBits) {
  EnvGuard cpu("KILN_BACKEND", "cpu");
  for (const char *env : {"KILN_NUM_THREADS=1", "KILN_NUM_THREADS=2", "KILN_NUM_THREADS=3"}) {
    int rc;
    std::string out = run_self(std::string(env) + " KILN_PACKED_TEST_CHILD=1", &rc);
    EXPECT_EQ(rc, 0) << env << ": " << out;
    EXPECT_NE(out.find("packed 1 same 1"), std::string::npos) << env << ": " << out;
  }
}

// The L2HMC layer: packed rows with row chains off (KILN_CPU_CHAINS=0);
// with them on (the default) a row chain of one kernel (chain.c) takes it.
TEST(PackedRows, DotLedLayerMatchesEager) {
  Scoped s;
  for (bool chains : {false, true}) {
    EnvGuard env("KILN_CPU_CHAINS", chains ? "1" : "0");
    kiln_random_seed(13);
    for (int64_t n : {5, 10}) {
      kiln_tensor *v = normal(KILN_F32, {200, 2}), *w = normal(KILN_F32, {2, n}), *b = normal(KILN_F32, {n});
      std::string ir;
      std::vector<kiln_tensor *> got = staged("packed_dot", dot_body, {v, w, b}, &ir);
      std::vector<kiln_tensor *> want = eager(dot_body, {v, w, b});
      EXPECT_EQ(ir.find("%ptile") != std::string::npos, !chains) << "n " << n << " chains " << chains;
      EXPECT_EQ(ir.find("%chain") != std::string::npos, chains) << "n " << n << " chains " << chains;
      for (int k = 0; k < 2; k++) EXPECT_TRUE(allclose(got[k], want[k], 1e-6, 1e-6)) << "n " << n << " output " << k;
    }
  }
}
