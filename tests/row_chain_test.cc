// row_chain_test.cc — the CPU's row chains (backends/cpu/chain.c) through
// the public API: staged functions whose kernels over narrow rows run as
// one chain, against the same functions with chains off (KILN_CPU_CHAINS=0,
// every kernel of its own: the same bits) and eager execution (within
// rounding). Cases: the L2HMC leapfrog as a scan (carries stored over
// themselves each step), rows that are no multiple of a vector (f32 and
// f64), a chain big enough to be split over the thread pool, and shapes
// that must not chain (too few rows, a long dot) still computing right.
// The random programs of ir_random_test.cc (IrRandom.RowChains*) check
// the plan's side: which kernels may chain, arena places, moved state.
#include <gtest/gtest.h>
#include <kiln.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln_test;

namespace {

kiln_tensor *normal(kiln_dtype dt, const V64 &shape) { return kiln_random_normal(dt, (int)shape.size(), shape.data()); }

struct Mlp {
  kiln_tensor *w1, *b1, *w2, *b2;
};

// dU/dx of U = 0.5 |tanh(x w1 + b1) w2 + b2|^2, by a tape (L2HMC's energy)
kiln_tensor *grad_energy(const Mlp *e, kiln_tensor *x) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(x, e->w1), e->b1));
  kiln_tensor *y = kiln_add(kiln_matmul(h, e->w2), e->b2);
  kiln_tensor *u = kiln_mul(kiln_reduce_sum(kiln_mul(y, y), 0, nullptr, false), kiln_scalar(kiln_tensor_dtype(x), 0.5));
  kiln_tape_end(tape);
  kiln_tensor *g = nullptr;
  if (u) {
    EXPECT_EQ(kiln_tape_gradient(tape, u, 1, &x, &g), 0) << kiln_last_error();
  }
  kiln_tape_free(tape);
  return g;
}

int leapfrog(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const Mlp *e = static_cast<const Mlp *>(user);
  kiln_dtype dt = kiln_tensor_dtype(in[0]);
  kiln_tensor *half = kiln_scalar(dt, 0.05), *eps = kiln_scalar(dt, 0.1);
  kiln_tensor *p = kiln_sub(in[1], kiln_mul(half, grad_energy(e, in[0])));
  out[0] = kiln_add(in[0], kiln_mul(eps, p));
  out[1] = kiln_sub(p, kiln_mul(half, grad_energy(e, out[0])));
  return out[0] && out[1] ? 0 : -1;
}

int sampler(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(leapfrog, user, 2, in, 0, nullptr, 10, false, 0, out, nullptr);
}

// one layer and its "gradient": y = tanh(x w + b), z = (1 - y^2) w^T
int layer(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const Mlp *e = static_cast<const Mlp *>(user);
  kiln_dtype dt = kiln_tensor_dtype(in[0]);
  kiln_tensor *y = kiln_tanh(kiln_add(kiln_matmul(in[0], e->w1), e->b1));
  kiln_tensor *d = kiln_sub(kiln_scalar(dt, 1.0), kiln_mul(y, y));
  out[0] = y;
  out[1] = kiln_matmul(d, kiln_transpose(e->w1, 2, nullptr));
  return out[0] && out[1] ? 0 : -1;
}

// the staged results (n_out of them) of body with chains on or off, and
// whether the LLVM IR shows a chain
std::vector<kiln_tensor *> staged(kiln_body_fn body, Mlp *e, const std::vector<kiln_tensor *> &in, int n_out,
                                  bool chains, bool *chained) {
  EnvGuard env("KILN_CPU_CHAINS", chains ? "1" : "0");
  EnvGuard cpu("KILN_BACKEND", "cpu");
  kiln_function *f = kiln_function_new(chains ? "chained" : "apart", body, e, (int)in.size(), n_out);
  std::vector<kiln_tensor *> out((size_t)n_out, nullptr);
  EXPECT_EQ(kiln_function_call(f, in.data(), out.data()), 0) << kiln_last_error();
  char *ir = kiln_function_ir(f, 0, "llvm");
  EXPECT_NE(ir, nullptr) << kiln_last_error();
  *chained = ir && std::strstr(ir, "%chain");
  std::free(ir);
  kiln_function_free(f);
  return out;
}

bool same_bits(kiln_tensor *a, kiln_tensor *b) {
  return a && b && kiln_tensor_size(a) == kiln_tensor_size(b) &&
         std::memcmp(kiln_tensor_data(a), kiln_tensor_data(b),
                     (size_t)kiln_tensor_size(a) * kiln_dtype_size(kiln_tensor_dtype(a))) == 0;
}

// body staged with and without chains (the same bits; a chain where
// expected) and eagerly (within tol)
void check(kiln_body_fn body, Mlp *e, const std::vector<kiln_tensor *> &in, int n_out, bool chain_expected, double tol) {
  bool chained, apart_chained;
  std::vector<kiln_tensor *> got = staged(body, e, in, n_out, true, &chained);
  std::vector<kiln_tensor *> ref = staged(body, e, in, n_out, false, &apart_chained);
  std::vector<kiln_tensor *> want((size_t)n_out, nullptr);
  ASSERT_EQ(body(e, (int)in.size(), in.data(), n_out, want.data()), 0) << kiln_last_error();
  EXPECT_EQ(chained, chain_expected);
  EXPECT_FALSE(apart_chained);
  for (int k = 0; k < n_out; k++) {
    EXPECT_TRUE(same_bits(got[(size_t)k], ref[(size_t)k])) << "output " << k << ": chains change the bits";
    EXPECT_TRUE(allclose(got[(size_t)k], want[(size_t)k], tol, tol)) << "output " << k << " against eager";
  }
}

Mlp mlp(kiln_dtype dt, int64_t in, int64_t hid) {
  return {normal(dt, {in, hid}), normal(dt, {hid}), normal(dt, {hid, in}), normal(dt, {in})};
}

TEST(RowChains, LeapfrogScanMatchesKernelsApartAndEager) {
  Scoped s;
  kiln_random_seed(3);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    Mlp e = mlp(dt, 2, 10);
    check(sampler, &e, {normal(dt, {200, 2}), normal(dt, {200, 2})}, 2, true, dt == KILN_F32 ? 1e-4 : 1e-10);
  }
}

// the ten leapfrog steps unrolled at trace time: one chain of 40 kernels
// passing more pointers than any kernel alone, over the thread pool (its
// array of them once overflowed the entry's, and the call crashed)
int unrolled(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *x = in[0], *p = in[1];
  for (int s = 0; s < 10 && x && p; s++) {
    kiln_tensor *step_in[2] = {x, p};
    if (leapfrog(user, 2, step_in, 2, out)) return -1;
    x = out[0], p = out[1];
  }
  return x && p ? 0 : -1;
}

TEST(RowChains, UnrolledLeapfrogsAsOneLongChain) {
  Scoped s;
  kiln_random_seed(7);
  Mlp e = mlp(KILN_F32, 2, 10);
  check(unrolled, &e, {normal(KILN_F32, {200, 2}), normal(KILN_F32, {200, 2})}, 2, true, 1e-4);
}

TEST(RowChains, RowsThatAreNoMultipleOfAVector) {
  Scoped s;
  kiln_random_seed(4);
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (int64_t rows : {32, 33, 47, 100})
      for (int64_t hid : {1, 3, 16}) {
        SCOPED_TRACE("rows " + std::to_string(rows) + " hid " + std::to_string(hid));
        Mlp e = mlp(dt, 3, hid);
        check(layer, &e, {normal(dt, {rows, 3})}, 2, true, dt == KILN_F32 ? 1e-5 : 1e-12);
      }
}

// 100,000 rows: the chain's blocks go over the thread pool
TEST(RowChains, ABigChainSplitOverThreads) {
  Scoped s;
  kiln_random_seed(5);
  Mlp e = mlp(KILN_F32, 4, 8);
  check(layer, &e, {normal(KILN_F32, {100000, 4})}, 2, true, 1e-5);
}

// no chain: rows too few (16), a dot too long for a kernel (K = 40), and
// columns too many (24): the kernels as they were, the results right
TEST(RowChains, ShapesThatDoNotChain) {
  Scoped s;
  kiln_random_seed(6);
  Mlp few = mlp(KILN_F32, 3, 8), longk = mlp(KILN_F32, 40, 8), wide = mlp(KILN_F32, 3, 24);
  check(layer, &few, {normal(KILN_F32, {16, 3})}, 2, false, 1e-5);
  check(layer, &longk, {normal(KILN_F32, {64, 40})}, 2, false, 1e-4);
  check(layer, &wide, {normal(KILN_F32, {64, 3})}, 2, false, 1e-5);
}

}  // namespace
