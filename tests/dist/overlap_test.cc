// overlap_test.cc — staged collectives overlapping independent kernels
// (issue 18, backends/cpu/overlap.c, lib/dist_async.c): functions where a
// collective has independent matmul and elementwise work after it, work
// reading its result, work writing over its operand's buffer, several
// collectives in flight, and collectives inside scan and while bodies give
// the same bits compiled (overlap on and off), interpreted and eager on
// every rank; the CPU plan runs the independent kernel while the
// collective is in flight; a mismatch inside an overlapped call fails on
// every rank naming the op, and the world goes on. Part of
// kiln_dist_tests: ctest runs it alone and under mpirun -np 2/3/4.
#include <string>
#include <vector>

#include "../test_util.h"
#include "dist_test_util.h"
#include "cpu/cpu.h"
#include "ir.h"

using namespace kiln_test;

namespace {

// rank r's values: exact small numbers, different per rank
kiln_tensor *rank_input(const V64 &shape, int r, int salt) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  VD v((size_t)n);
  for (int64_t i = 0; i < n; i++) v[(size_t)i] = (double)((i * 7 + r * 5 + salt) % 13) - 6 + 0.5 * (r % 2);
  return from_values(KILN_F32, shape, v);
}

// (x, w) -> (c(x + 1) * 3, c(x), tanh(w . w) * w, (x + 1) * 2): two
// collectives in flight, a matmul and elementwise work independent of
// them, work reading a result, and x + 1 dying in a kernel that may write
// its result over it while the first collective reads it.
int indep_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const Coll *c = static_cast<const Coll *>(user);
  kiln_tensor *t = kiln_add(in[0], kiln_scalar(KILN_F32, 1));
  kiln_tensor *y1 = c->run(t), *y2 = c->run(in[0]);
  kiln_tensor *m = kiln_mul(kiln_tanh(kiln_matmul(in[1], in[1])), in[1]);
  out[0] = kiln_mul(y1, kiln_scalar(KILN_F32, 3));
  out[1] = y2;
  out[2] = m;
  out[3] = kiln_mul(t, kiln_scalar(KILN_F32, 2));
  return out[0] && out[1] && out[2] && out[3] ? 0 : -1;
}

// body staged with backend, called on ins; nullptr on failure
std::vector<kiln_tensor *> staged(kiln_body_fn body, void *user, const std::vector<kiln_tensor *> &ins, int n_out,
                                  const char *backend) {
  EnvGuard b("KILN_BACKEND", backend);
  kiln_function *f = kiln_function_new("overlap", body, user, (int)ins.size(), n_out);
  EXPECT_NE(f, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> out((size_t)n_out, nullptr);
  int rc = kiln_function_call(f, ins.data(), out.data());
  kiln_function_free(f);
  if (rc) return {};
  return out;
}

struct Overlap : ::testing::Test {
  Scoped scope;
};

// compiled (overlap on, off) == interpreted == eager, output by output;
// exact: outputs whose bits must match; others (a matmul's) allclose
void expect_same(kiln_body_fn body, void *user, const std::vector<kiln_tensor *> &ins, int n_out,
                 const std::vector<bool> &exact, const std::string &what) {
  std::vector<kiln_tensor *> eager((size_t)n_out, nullptr);
  ASSERT_EQ(body(user, (int)ins.size(), ins.data(), n_out, eager.data()), 0) << what << ": " << kiln_last_error();
  for (const char *mode : {"1", "0"}) {
    EnvGuard o("KILN_DIST_OVERLAP", mode);
    for (const char *backend : {"cpu", "interp"}) {
      std::vector<kiln_tensor *> got = staged(body, user, ins, n_out, backend);
      ASSERT_EQ(got.size(), (size_t)n_out) << what << " " << backend << " overlap=" << mode << ": " << kiln_last_error();
      for (int k = 0; k < n_out; k++) {
        EXPECT_EQ(shape_of(got[k]), shape_of(eager[k])) << what << " " << backend << " output " << k;
        if (exact[k])
          EXPECT_TRUE(same_bits(got[k], eager[k])) << what << " " << backend << " overlap=" << mode << " output " << k;
        else
          EXPECT_TRUE(allclose(got[k], eager[k])) << what << " " << backend << " overlap=" << mode << " output " << k;
      }
    }
  }
}

TEST_F(Overlap, IndependentWorkReadersAndInPlaceWritesEqualEagerAndInterpreter) {
  int size = size_(), r = rank_();
  const Coll colls[] = {{"all_reduce", "sum", 0},     {"all_reduce", "mean", 0}, {"all_gather", nullptr, 0},
                        {"reduce_scatter", "sum", 0}, {"broadcast_from", nullptr, size - 1}};
  for (const Coll &c : colls) {
    for (int64_t rows : {(int64_t)2 * size, (int64_t)64 * size}) { // small, and past the pool's split
      kiln_tensor *x = rank_input({rows, 24}, r, 1), *w = rank_input({24, 24}, r, 2);
      expect_same(indep_body, const_cast<Coll *>(&c), {x, w}, 4, {true, true, false, true},
                  std::string(c.kind) + " rows " + std::to_string(rows));
    }
  }
}

// ---- loops ----

// scan: carry' = carry * 0.5 + all_reduce(x_t); y_t = all_gather(x_t) + 1
int scan_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *a = kiln_all_reduce(in[1], "sum");
  kiln_tensor *half = kiln_mul(in[0], kiln_scalar(KILN_F32, 0.5));
  kiln_tensor *g = kiln_all_gather(in[1], 0);
  out[0] = kiln_add(half, a);
  out[1] = kiln_add(g, kiln_scalar(KILN_F32, 1));
  return out[0] && out[1] ? 0 : -1;
}

int scan_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *final_carry = nullptr, *ys = nullptr;
  if (kiln_scan(scan_step, nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &final_carry, &ys)) return -1;
  out[0] = final_carry;
  out[1] = ys;
  return 0;
}

// while i < 3: v' = all_reduce(v, max) * 0.5 + v * 0.25, i' = i + 1
int while_cond(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_less(in[0], kiln_scalar(KILN_I32, 3));
  return out[0] ? 0 : -1;
}

int while_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *a = kiln_all_reduce(in[1], "max");
  kiln_tensor *q = kiln_mul(in[1], kiln_scalar(KILN_F32, 0.25));
  out[0] = kiln_add(in[0], kiln_scalar(KILN_I32, 1));
  out[1] = kiln_add(kiln_mul(a, kiln_scalar(KILN_F32, 0.5)), q);
  return out[0] && out[1] ? 0 : -1;
}

int while_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *state[2] = {kiln_scalar(KILN_I32, 0), in[0]}, *fin[2] = {nullptr, nullptr};
  if (kiln_while_loop(while_cond, while_step, nullptr, 2, state, -1, fin)) return -1;
  out[0] = fin[1];
  return 0;
}

TEST_F(Overlap, CollectivesInsideScanAndWhileBodies) {
  int r = rank_();
  kiln_tensor *c0 = rank_input({5}, r, 3), *xs = rank_input({4, 5}, r, 4);
  expect_same(scan_body, nullptr, {c0, xs}, 2, {true, true}, "scan");
  expect_same(while_body, nullptr, {rank_input({7}, r, 5)}, 1, {true}, "while");
}

// ---- the plan ----

cpu_program *compile_text(const std::string &text, ir_module **m) {
  *m = ir_parse(text.c_str(), "overlap.kir");
  EXPECT_NE(*m, nullptr) << kiln_last_error();
  if (!*m) return nullptr;
  ir_func *f = ir_module_find(*m, "f");
  cpu_program *p = cpu_compile(f);
  EXPECT_NE(p, nullptr) << kiln_last_error();
  return p;
}

TEST_F(Overlap, ThePlanRunsTheIndependentMatmulWhileTheAllReduceIsInFlight) {
  std::string w = "world=" + std::to_string(size_());
  // the dot needs nothing of %a: it runs between the start and the wait
  std::string apart = "func @f(%x: f32[64,64], %w: f32[64,64]) -> (f32[64,64], f32[64,64]) {\n"
                      "  %a = all_reduce %x {reduce=sum, " + w + "} : f32[64,64]\n"
                      "  %m = dot %w, %w : f32[64,64]\n"
                      "  %b = add %a, %m : f32[64,64]\n"
                      "  return %b, %m\n"
                      "}\n";
  // the add reads %a at once: nothing runs in flight
  std::string reads = "func @f(%x: f32[64,64], %w: f32[64,64]) -> (f32[64,64], f32[64,64]) {\n"
                      "  %a = all_reduce %x {reduce=sum, " + w + "} : f32[64,64]\n"
                      "  %c = add %a, %a : f32[64,64]\n"
                      "  %m = dot %w, %w : f32[64,64]\n"
                      "  %b = add %c, %m : f32[64,64]\n"
                      "  return %b, %m\n"
                      "}\n";
  kiln_tensor *x = rank_input({64, 64}, rank_(), 6), *wt = rank_input({64, 64}, rank_(), 7);
  kiln_tensor *sum = kiln_all_reduce(x, "sum"), *mm = kiln_matmul(wt, wt);
  kiln_tensor *want[2] = {kiln_add(sum, mm), kiln_add(kiln_add(sum, sum), mm)};
  int k = 0;
  for (const std::string *text : {&apart, &reads}) {
    ir_module *m = nullptr;
    cpu_program *p = compile_text(*text, &m);
    ASSERT_NE(p, nullptr);
    if (text == &apart)
      EXPECT_GE(cpu_program_overlapped(p), 1) << "the dot runs after the wait";
    else
      EXPECT_EQ(cpu_program_overlapped(p), 0);
    for (const char *mode : {"1", "0"}) {
      EnvGuard o("KILN_DIST_OVERLAP", mode);
      kiln_tensor *args[2] = {x, wt}, *res[2] = {nullptr, nullptr};
      ASSERT_EQ(cpu_run(p, args, res), 0) << kiln_last_error();
      EXPECT_TRUE(allclose(res[0], want[k])) << "overlap=" << mode;
      EXPECT_TRUE(allclose(res[1], mm)) << "overlap=" << mode;
    }
    cpu_program_free(p);
    ir_module_free(m);
    k++;
  }
}

// ---- errors ----

int reduce_then_matmul(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_all_reduce(in[0], "sum");
  out[1] = kiln_matmul(in[1], in[1]);
  return out[0] && out[1] ? 0 : -1;
}

TEST_F(Overlap, MismatchInsideAnOverlappedCallFailsOnEveryRankAndTheWorldGoesOn) {
  if (size_() < 2) GTEST_SKIP() << "needs a world of 2 processes: ctest runs this binary under mpirun -np 2, 3 and 4";
  int r = rank_(), size = size_();
  kiln_tensor *w = rank_input({32, 32}, r, 8);
  for (const char *mode : {"1", "0"}) {
    EnvGuard o("KILN_DIST_OVERLAP", mode);
    EnvGuard b("KILN_BACKEND", "cpu");
    kiln_function *f = kiln_function_new("reduce_mm", reduce_then_matmul, nullptr, 2, 2);
    int64_t n = r == 1 ? 3 : 4;
    kiln_tensor *bad[2] = {kiln_ones(KILN_F32, 1, &n), w}, *out[2] = {nullptr, nullptr};
    EXPECT_EQ(kiln_function_call(f, bad, out), -1) << mode;
    EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: rank 1 has shape (3,) where rank 0 has (4,)"),
              std::string::npos)
        << mode << ": " << kiln_last_error();
    kiln_clear_error();
    kiln_tensor *ok[2] = {f32({2}, {1, (float)r}), w};
    ASSERT_EQ(kiln_function_call(f, ok, out), 0) << mode << ": " << kiln_last_error();
    EXPECT_EQ(values(out[0]), (VD{(double)size, (double)size * (size - 1) / 2})) << mode;
    // an eager collective after a staged one keeps the order
    kiln_tensor *e = kiln_all_reduce(f32({1}, {(float)r}), "sum");
    ASSERT_NE(e, nullptr) << kiln_last_error();
    EXPECT_EQ(values(e), (VD{(double)size * (size - 1) / 2}));
    kiln_function_free(f);
  }
}

} // namespace
