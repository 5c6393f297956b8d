// control_test.cc — kiln_cond, kiln_while_loop and kiln_scan (API.md §9):
// eager runs as C loops; staged, one instruction with traced regions whose
// results match eager C (the Collatz loop, Newton's iteration stopping on
// convergence, a scan against its unrolled form), captures of the enclosing
// trace, variable reads, random draws per iteration, nesting, bad inputs.
// Every test runs twice, compiled by the CPU backend (real loops in the
// generated code) and interpreted (the reference): Control.X/cpu and
// Control.X/interp.
#include <gmock/gmock.h>

#include <cmath>
#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;
using testing::StartsWith;

namespace {

// the backend of a test's run: KILN_BACKEND=cpu (no interpreter fallback) or interp
struct Backend : EnvGuard {
  explicit Backend(const char *name) : EnvGuard("KILN_BACKEND", name) {}
};

class Control : public testing::TestWithParam<const char *> {};
class ControlGradients : public testing::TestWithParam<const char *> {};
std::string backend_name(const testing::TestParamInfo<const char *> &i) { return i.param; }


kiln_tensor *s64(int64_t v) { return kiln_scalar(KILN_I64, (double)v); }

// ---- Collatz: while a != 1: a = a even ? a / 2 : 3a + 1; count steps ----

int collatz_cond(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  out[0] = kiln_not_equal(s[0], s64(1));
  return out[0] ? 0 : -1;
}

int collatz_even(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_div(in[0], s64(2));
  return out[0] ? 0 : -1;
}

int collatz_odd(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(kiln_mul(in[0], s64(3)), s64(1));
  return out[0] ? 0 : -1;
}

int collatz_body(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  kiln_tensor *even = kiln_equal(kiln_mod(s[0], s64(2)), s64(0));
  if (kiln_cond(even, collatz_even, collatz_odd, nullptr, 1, s, 1, &out[0])) return -1;
  out[1] = kiln_add(s[1], s64(1));
  return out[1] ? 0 : -1;
}

int collatz(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {in[0], s64(0)};
  return kiln_while_loop(collatz_cond, collatz_body, nullptr, 2, init, -1, out);
}

int64_t collatz_c(int64_t a) {
  int64_t n = 0;
  for (; a != 1; n++) a = a % 2 == 0 ? a / 2 : 3 * a + 1;
  return n;
}

TEST_P(Control, CollatzEagerAndStagedMatchC) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("collatz", collatz, nullptr, 1, 2);
  for (int64_t a : {1, 6, 7, 27, 97}) {
    kiln_tensor *x = s64(a), *eager[2] = {}, *staged[2] = {};
    ASSERT_EQ(collatz(nullptr, 1, &x, 2, eager), 0) << kiln_last_error();
    ASSERT_EQ(kiln_function_call(f, &x, staged), 0) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_item(eager[1]), (double)collatz_c(a)) << a;
    EXPECT_EQ(kiln_tensor_item(staged[1]), (double)collatz_c(a)) << a;
    EXPECT_EQ(kiln_tensor_item(staged[0]), 1.0);
  }
  EXPECT_EQ(kiln_function_trace_count(f), 1) << "one trace for every start value";
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr) << kiln_last_error();
  EXPECT_THAT(ir, HasSubstr("= while "));
  EXPECT_THAT(ir, HasSubstr("= cond "));
  EXPECT_THAT(ir, HasSubstr("body func @while.body("));
  free(ir);
  kiln_function_free(f);
}

// ---- Newton's iteration for sqrt(a), stopping on convergence ----

int newton_cond(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  // |x^2 - a| > 1e-9 * a
  kiln_tensor *err = kiln_abs(kiln_sub(kiln_mul(s[0], s[0]), s[1]));
  out[0] = kiln_greater(err, kiln_mul(s[1], kiln_scalar(KILN_F64, 1e-9)));
  return out[0] ? 0 : -1;
}

int newton_body(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  out[0] = kiln_mul(kiln_scalar(KILN_F64, 0.5), kiln_add(s[0], kiln_div(s[1], s[0])));
  out[1] = s[1];
  out[2] = kiln_add(s[2], s64(1));
  return out[0] && out[2] ? 0 : -1;
}

int newton(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[3] = {in[0], in[0], s64(0)}, *fin[3];
  if (kiln_while_loop(newton_cond, newton_body, nullptr, 3, init, 100, fin)) return -1;
  out[0] = fin[0];
  out[1] = fin[2];
  return 0;
}

TEST_P(Control, NewtonStopsOnConvergence) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("newton", newton, nullptr, 1, 2);
  for (double a : {2.0, 1e6, 0.25}) {
    kiln_tensor *x = kiln_scalar(KILN_F64, a), *out[2] = {nullptr, nullptr}, *eager[2] = {nullptr, nullptr};
    ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
    ASSERT_EQ(newton(nullptr, 1, &x, 2, eager), 0) << kiln_last_error();
    EXPECT_NEAR(kiln_tensor_item(out[0]), std::sqrt(a), 1e-9 * std::sqrt(a));
    EXPECT_EQ(kiln_tensor_item(out[1]), kiln_tensor_item(eager[1])) << "the same number of steps";
    EXPECT_LT(kiln_tensor_item(out[1]), 30) << "it stopped when converged";
  }
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

// max_iterations stops the loop even where cond stays true
int always(void *, int, kiln_tensor *const *, int, kiln_tensor **out) {
  out[0] = kiln_scalar(KILN_BOOL, 1);
  return out[0] ? 0 : -1;
}

int inc(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  out[0] = kiln_add(s[0], kiln_scalar_like(s[0], 1));
  return out[0] ? 0 : -1;
}

int bounded(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_while_loop(always, inc, nullptr, 1, in, 7, out);
}

TEST_P(Control, MaxIterationsBoundsTheLoop) {
  Scoped s;
  Backend env(GetParam());
  kiln_tensor *x = f32({2}, {0, 10}), *out = nullptr;
  ASSERT_EQ(bounded(nullptr, 1, &x, 1, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{7, 17}));
  kiln_function *f = kiln_function_new("bounded", bounded, nullptr, 1, 1);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{7, 17}));
  kiln_function_free(f);
}

// ---- scan ----

// carry' = tanh(carry * w + x_t); y_t = carry' * 2 (w captured from the
// enclosing trace through user)
struct Rnn {
  kiln_tensor *w;
};

int rnn_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Rnn *r = (Rnn *)user;
  out[0] = kiln_tanh(kiln_add(kiln_mul(in[0], r->w), in[1]));
  out[1] = kiln_mul(out[0], kiln_scalar_like(out[0], 2));
  return out[0] && out[1] ? 0 : -1;
}

int rnn_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Rnn r{kiln_mul(in[2], kiln_scalar_like(in[2], 1.5))}; // a traced value the body closes over
  return kiln_scan(rnn_step, &r, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
}

int rnn_unrolled(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Rnn r{kiln_mul(in[2], kiln_scalar_like(in[2], 1.5))};
  kiln_tensor *c = in[0];
  std::vector<kiln_tensor *> ys;
  int64_t T = kiln_tensor_shape(in[1])[0];
  for (int64_t t = 0; t < T; t++) {
    kiln_tensor *io[2] = {c, kiln_index(in[1], t)}, *o[2];
    if (rnn_step(&r, 2, io, 2, o)) return -1;
    c = o[0];
    ys.push_back(o[1]);
  }
  out[0] = c;
  out[1] = kiln_stack((int)ys.size(), ys.data(), 0);
  return out[1] ? 0 : -1;
}

TEST_P(Control, ScanMatchesTheUnrolledLoop) {
  Scoped s;
  Backend env(GetParam());
  kiln_tensor *c0 = f64({2}, {0.1, -0.2});
  std::vector<double> xv;
  for (int i = 0; i < 10; i++) xv.push_back(std::sin(i * 0.7)), xv.push_back(std::cos(i * 0.3));
  kiln_tensor *xs = f64({5, 2, 2}, std::vector<double>(xv.begin(), xv.begin() + 20));
  kiln_tensor *w = f64({2}, {0.9, -0.4});
  kiln_tensor *in[3] = {c0, xs, w};
  // xs are (5, 2, 2): x_t is (2, 2), the carry broadcasts to it after step 0
  kiln_tensor *c2 = f64({2, 2}, {0.1, -0.2, 0.3, 0.0});
  in[0] = c2;
  kiln_tensor *want[2] = {}, *eager[2] = {}, *staged[2] = {};
  ASSERT_EQ(rnn_unrolled(nullptr, 3, in, 2, want), 0) << kiln_last_error();
  ASSERT_EQ(rnn_scan(nullptr, 3, in, 2, eager), 0) << kiln_last_error();
  EXPECT_TRUE(allclose(eager[0], want[0], 1e-12, 1e-12));
  EXPECT_TRUE(allclose(eager[1], want[1], 1e-12, 1e-12));
  kiln_function *f = kiln_function_new("rnn", rnn_scan, nullptr, 3, 2);
  ASSERT_EQ(kiln_function_call(f, in, staged), 0) << kiln_last_error();
  EXPECT_EQ(shape_of(staged[1]), (V64{5, 2, 2}));
  EXPECT_TRUE(allclose(staged[0], want[0], 1e-12, 1e-12));
  EXPECT_TRUE(allclose(staged[1], want[1], 1e-12, 1e-12));
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("= scan "));
  EXPECT_THAT(ir, HasSubstr("length=5, reverse=false"));
  free(ir);
  kiln_function_free(f);
}

// reverse: the loop runs from the end; ys[t] still lines up with xs[t]
int cumsum_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], in[1]);
  out[1] = out[0];
  return out[0] ? 0 : -1;
}

int rev_cumsum(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *zero = kiln_scalar(KILN_F32, 0);
  return kiln_scan(cumsum_step, nullptr, 1, &zero, 1, in, -1, true, 1, &out[0], &out[1]);
}

TEST_P(Control, ReverseScanLinesUpWithXs) {
  Scoped s;
  Backend env(GetParam());
  kiln_tensor *x = f32({1, 2, 3, 4}), *eager[2] = {}, *staged[2] = {};
  ASSERT_EQ(rev_cumsum(nullptr, 1, &x, 2, eager), 0) << kiln_last_error();
  EXPECT_EQ(values(eager[1]), (VD{10, 9, 7, 4}));
  EXPECT_EQ(kiln_tensor_item(eager[0]), 10);
  kiln_function *f = kiln_function_new("rev", rev_cumsum, nullptr, 1, 2);
  ASSERT_EQ(kiln_function_call(f, &x, staged), 0) << kiln_last_error();
  EXPECT_EQ(values(staged[1]), (VD{10, 9, 7, 4}));
  EXPECT_EQ(kiln_tensor_item(staged[0]), 10);
  kiln_tensor *empty = kiln_zeros(KILN_F32, 1, V64{0}.data());
  ASSERT_EQ(rev_cumsum(nullptr, 1, &empty, 2, eager), 0) << kiln_last_error();
  EXPECT_EQ(shape_of(eager[1]), (V64{0}));
  EXPECT_EQ(kiln_tensor_item(eager[0]), 0);
  ASSERT_EQ(kiln_function_call(f, &empty, staged), 0) << kiln_last_error();
  EXPECT_EQ(shape_of(staged[1]), (V64{0}));
  kiln_function_free(f);
}

// ---- random draws, variables, nesting, host and staged calls in bodies ----

int noisy_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = in[0];
  out[1] = kiln_random_uniform(KILN_F32, 0, nullptr, 0, 1);
  return out[1] ? 0 : -1;
}

int noisy(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(noisy_step, nullptr, 1, in, 0, nullptr, 8, false, 1, &out[0], &out[1]);
}

TEST_P(Control, RandomOpsDrawAfreshEachIteration) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("noisy", noisy, nullptr, 1, 2);
  kiln_tensor *x = f32({1}), *a[2] = {}, *b[2] = {};
  ASSERT_EQ(kiln_function_call(f, &x, a), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, &x, b), 0) << kiln_last_error();
  VD va = values(a[1]), vb = values(b[1]);
  ASSERT_EQ(va.size(), 8u);
  for (size_t i = 1; i < va.size(); i++) EXPECT_NE(va[i], va[0]) << "step " << i << " drew the same";
  EXPECT_NE(va, vb) << "each call draws afresh";
  kiln_function_free(f);
}

struct VarUser {
  kiln_variable *v;
};

int add_var(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], kiln_variable_read(((VarUser *)user)->v));
  return out[0] ? 0 : -1;
}

int lt_ten(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_less(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar(KILN_F32, 10));
  return out[0] ? 0 : -1;
}

int var_loop(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_while_loop(lt_ten, add_var, user, 1, in, -1, out);
}

TEST_P(Control, BodiesReadVariablesAtEachCall) {
  Scoped s;
  Backend env(GetParam());
  Owned o;
  VarUser u{o.var(f32({1, 2}), "step")};
  kiln_function *f = kiln_function_new("var_loop", var_loop, &u, 1, 1);
  kiln_tensor *x = f32({0, 0}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{4, 8})); // sum 12 after 4 steps of 3
  ASSERT_EQ(kiln_variable_assign(u.v, f32({2, 3})), 0);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{4, 6})) << "the variable's new value, no retrace";
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

// Bodies that assign variables: the variables are carried through the loop
// (each iteration sees the last one's assignment) and assigned when the call
// returns; a branch that does not assign passes the value through.
struct Counter {
  kiln_variable *count, *total;
};

int count_cond(void *user, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  (void)s;
  out[0] = kiln_less(kiln_variable_read(((Counter *)user)->count), kiln_scalar(KILN_F32, 5));
  return out[0] ? 0 : -1;
}

int count_body(void *user, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  Counter *c = (Counter *)user;
  if (kiln_variable_assign_add(c->count, kiln_scalar(KILN_F32, 1))) return -1;
  out[0] = kiln_add(s[0], kiln_variable_read(c->count)); // sees this iteration's count
  return out[0] ? 0 : -1;
}

int count_loop(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_while_loop(count_cond, count_body, user, 1, in, -1, out);
}

int add_to_total(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Counter *c = (Counter *)user;
  if (kiln_variable_assign_add(c->total, in[1])) return -1;
  out[0] = kiln_add(in[0], kiln_variable_read(c->total));
  out[1] = kiln_variable_read(c->total);
  return out[0] ? 0 : -1;
}

int total_scan(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(add_to_total, user, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
}

int assign_then(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_variable_assign(((Counter *)user)->total, in[0])) return -1;
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}

int keep_else(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = in[0];
  return 0;
}

int assign_if_positive(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar(KILN_F32, 0));
  return kiln_cond(p, assign_then, keep_else, user, 1, in, 1, out);
}

TEST_P(Control, BodiesAssignVariables) {
  Scoped s;
  Backend env(GetParam());
  for (bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "eager");
    Owned o;
    Counter c{o.var(kiln_scalar(KILN_F32, 0), "count"), o.var(f32({0, 0}), "total")};
    kiln_function *f = kiln_function_new("count_loop", count_loop, &c, 1, 1);
    kiln_function_set_eager(f, !staged);
    kiln_tensor *x = f32({10, 20}), *out[2] = {};
    ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
    EXPECT_EQ(values(out[0]), (VD{25, 35})) << "1 + 2 + 3 + 4 + 5 added";
    EXPECT_EQ(kiln_tensor_item(kiln_variable_read(c.count)), 5);
    ASSERT_EQ(kiln_variable_assign(c.count, kiln_scalar(KILN_F32, 3)), 0);
    ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
    EXPECT_EQ(values(out[0]), (VD{19, 29})) << "from count 3: 4 + 5";
    kiln_function_free(f);

    f = kiln_function_new("total_scan", total_scan, &c, 2, 2);
    kiln_function_set_eager(f, !staged);
    kiln_tensor *in[2] = {f32({0, 0}), f32({3, 2}, {1, 2, 3, 4, 5, 6})};
    ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
    EXPECT_EQ(values(kiln_variable_read(c.total)), (VD{9, 12}));
    EXPECT_EQ(values(out[1]), (VD{1, 2, 4, 6, 9, 12})) << "the running totals";
    EXPECT_EQ(values(out[0]), (VD{14, 20}));
    kiln_function_free(f);

    f = kiln_function_new("assign_if", assign_if_positive, &c, 1, 1);
    kiln_function_set_eager(f, !staged);
    kiln_tensor *neg = f32({-1, -2}), *pos = f32({7, 8});
    ASSERT_EQ(kiln_function_call(f, &neg, out), 0) << kiln_last_error();
    EXPECT_EQ(values(kiln_variable_read(c.total)), (VD{9, 12})) << "the else branch keeps it";
    ASSERT_EQ(kiln_function_call(f, &pos, out), 0) << kiln_last_error();
    EXPECT_EQ(values(kiln_variable_read(c.total)), (VD{7, 8}));
    EXPECT_EQ(values(out[0]), (VD{-7, -8}));
    kiln_function_free(f);
  }
}

// a cond inside a scan inside a cond branch; the inner branches read a
// value of the outermost trace
struct Nest {
  kiln_tensor *k;
};

int pos_branch(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_mul(in[0], ((Nest *)user)->k);
  return out[0] ? 0 : -1;
}

int neg_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}

int nest_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_greater(in[1], kiln_scalar_like(in[1], 0)), *v = nullptr;
  if (kiln_cond(p, pos_branch, neg_branch, user, 1, &in[1], 1, &v)) return -1;
  out[0] = kiln_add(in[0], v);
  out[1] = v;
  return out[0] ? 0 : -1;
}

int nest_then(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *zero = kiln_scalar(KILN_F64, 0), *c = nullptr, *ys = nullptr;
  if (kiln_scan(nest_step, user, 1, &zero, 1, in, -1, false, 1, &c, &ys)) return -1;
  out[0] = kiln_add(ys, c);
  return out[0] ? 0 : -1;
}

int nest_else(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = in[0];
  return 0;
}

int nested(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Nest n{kiln_add(in[1], kiln_scalar_like(in[1], 1))};
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar(KILN_F64, -100));
  return kiln_cond(p, nest_then, nest_else, &n, 1, in, 1, out);
}

TEST_P(Control, NestedControlFlowCapturesTheOutermostTrace) {
  Scoped s;
  Backend env(GetParam());
  kiln_tensor *x = f64({1, -2, 3}), *k = kiln_scalar(KILN_F64, 2), *in[2] = {x, k}, *eager = nullptr, *staged = nullptr;
  ASSERT_EQ(nested(nullptr, 2, in, 1, &eager), 0) << kiln_last_error();
  // v = [3, 2, 9] (x*3 where positive, -x else), c = 14: ys + c
  EXPECT_EQ(values(eager), (VD{17, 16, 23}));
  kiln_function *f = kiln_function_new("nested", nested, nullptr, 2, 1);
  ASSERT_EQ(kiln_function_call(f, in, &staged), 0) << kiln_last_error();
  EXPECT_EQ(values(staged), (VD{17, 16, 23}));
  kiln_tensor *in2[2] = {f64({-500, 1, 1}), k};
  ASSERT_EQ(kiln_function_call(f, in2, &staged), 0) << kiln_last_error();
  EXPECT_EQ(values(staged), (VD{-500, 1, 1})) << "the else branch";
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  // regions print nested, and the text parses back (checked by kiln-opt's tests)
  EXPECT_THAT(ir, HasSubstr("        body func @scan.body("));
  free(ir);
  kiln_function_free(f);
}

int twice_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_mul(in[0], kiln_scalar_like(in[0], 2));
  return out[0] ? 0 : -1;
}

int host_neg(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}

kiln_function *g_twice;

int calls_inside(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *a = nullptr, *b = nullptr;
  if (kiln_function_call(g_twice, in, &a)) return -1;
  kiln_spec spec = {(kiln_dtype)kiln_tensor_dtype(a), kiln_tensor_rank(a), {0}};
  for (int d = 0; d < spec.rank; d++) spec.shape[d] = kiln_tensor_shape(a)[d];
  if (kiln_host_call(host_neg, nullptr, 1, &a, 1, &spec, &b)) return -1;
  out[0] = b;
  out[1] = kiln_add(b, kiln_scalar_like(b, 1)); // a y
  return 0;
}

int calls_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(calls_inside, nullptr, 1, in, 0, nullptr, 3, false, 1, &out[0], &out[1]);
}

TEST_P(Control, StagedAndHostCallsInsideABody) {
  Scoped s;
  Backend env(GetParam());
  g_twice = kiln_function_new("twice", twice_body, nullptr, 1, 1);
  kiln_function *f = kiln_function_new("calls", calls_scan, nullptr, 1, 2);
  kiln_tensor *x = f32({1, 2}), *out[2] = {};
  ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{-8, -16})); // x -> -2x three times
  EXPECT_EQ(values(out[1]), (VD{-1, -3, 5, 9, -7, -15}));
  kiln_function_free(f);
  kiln_function_free(g_twice);
}

// ---- bad input ----

int wrong_shape_body(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  kiln_tensor *both[2] = {s[0], s[0]};
  out[0] = kiln_concat(2, both, 0);
  return out[0] ? 0 : -1;
}

int wrong_shape(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_while_loop(always, wrong_shape_body, nullptr, 1, in, 3, out);
}

int f32_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_cast(in[0], KILN_F32);
  return out[0] ? 0 : -1;
}

int f64_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_cast(in[0], KILN_F64);
  return out[0] ? 0 : -1;
}

int mismatched(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar_like(in[0], 0));
  return kiln_cond(p, f32_branch, f64_branch, nullptr, 1, in, 1, out);
}

int vector_pred(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_cond(kiln_greater(in[0], kiln_scalar_like(in[0], 0)), f32_branch, f32_branch, nullptr, 1, in, 1, out);
}

// an index error in iteration 57 (from the threshold in[1] on)
struct Threshold {
  kiln_tensor *at;
};

int bad_index_body(void *user, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  kiln_tensor *table = f32({10, 20, 30});
  kiln_tensor *late = kiln_greater_equal(s[1], ((Threshold *)user)->at);
  kiln_tensor *at = kiln_mul(kiln_reshape(kiln_cast(late, KILN_I64), 1, V64{1}.data()), s64(7)); // 7: out of range
  out[0] = kiln_add(s[0], kiln_reduce_sum(kiln_gather(table, at, 0), 0, nullptr, false));
  out[1] = kiln_add(s[1], s64(1));
  return out[0] && out[1] ? 0 : -1;
}

int bad_index(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {in[0], s64(0)};
  Threshold t{in[1]};
  return kiln_while_loop(always, bad_index_body, &t, 2, init, 100, out);
}

TEST_P(Control, BadInputFailsClearly) {
  Scoped s;
  Backend env(GetParam());
  kiln_tensor *x = f32({1, 2}), *out[2] = {nullptr, nullptr};
  EXPECT_EQ(wrong_shape(nullptr, 1, &x, 1, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("while_loop: the body returned state 0 as f32[4], expected f32[2]"));
  kiln_function *f = kiln_function_new("wrong_shape", wrong_shape, nullptr, 1, 1);
  EXPECT_EQ(kiln_function_call(f, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("while_loop: result 0 of @while.body is f32[4], expected f32[2]"));
  kiln_function_free(f);

  f = kiln_function_new("mismatched", mismatched, nullptr, 1, 1);
  EXPECT_EQ(kiln_function_call(f, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("cond: the branches disagree: result 0 of @cond.then is f32[2], of "
                                           "@cond.else f64[2]"));
  kiln_function_free(f);
  f = kiln_function_new("vector_pred", vector_pred, nullptr, 1, 1);
  EXPECT_EQ(kiln_function_call(f, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("cond: the predicate is bool[2], expected bool[] (a scalar)"));
  kiln_function_free(f);

  EXPECT_EQ(kiln_cond(kiln_scalar(KILN_F32, 1), f32_branch, f32_branch, nullptr, 1, &x, 1, out), -1);
  EXPECT_STREQ(kiln_last_error(), "cond: the predicate is f32[], expected bool[] (a scalar)");
  EXPECT_EQ(kiln_cond(kiln_scalar(KILN_BOOL, 1), nullptr, f32_branch, nullptr, 1, &x, 1, out), -1);
  EXPECT_STREQ(kiln_last_error(), "cond: then_fn is NULL");
  EXPECT_EQ(kiln_while_loop(always, inc, nullptr, 0, &x, 3, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("while_loop: the state needs at least one tensor"));
  EXPECT_EQ(kiln_while_loop(always, inc, nullptr, 1, &x, -2, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("while_loop: max_iterations = -2"));
  kiln_tensor *xs2[2] = {f32({1, 2, 3}), f32({1, 2})};
  EXPECT_EQ(kiln_scan(cumsum_step, nullptr, 1, &x, 2, xs2, -1, false, 1, &out[0], &out[1]), -1);
  EXPECT_STREQ(kiln_last_error(), "scan: xs[1] has length 2, xs[0] 3 (all the same length)");
  EXPECT_EQ(kiln_scan(cumsum_step, nullptr, 1, &x, 1, xs2, 4, false, 1, &out[0], &out[1]), -1);
  EXPECT_STREQ(kiln_last_error(), "scan: length = 4, but the xs have length 3");
  kiln_tensor *sc = kiln_scalar(KILN_F32, 1);
  EXPECT_EQ(kiln_scan(cumsum_step, nullptr, 1, &x, 1, &sc, -1, false, 1, &out[0], &out[1]), -1);
  EXPECT_STREQ(kiln_last_error(), "scan: xs[0] is a scalar: xs are sliced along axis 0");
  EXPECT_EQ(kiln_scan(cumsum_step, nullptr, 1, &x, 0, nullptr, -1, false, 1, &out[0], &out[1]), -1);
  EXPECT_STREQ(kiln_last_error(), "scan: without xs, length = -1 must be given (>= 0)");

  // an error in iteration 57 names the op; the function works afterwards
  kiln_tensor *ins[2] = {kiln_scalar(KILN_F32, 0), s64(56)};
  f = kiln_function_new("bad_index", bad_index, nullptr, 2, 2);
  EXPECT_EQ(kiln_function_call(f, ins, out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("gather: indices[0] = 7 is not in [0, 3)"));
  EXPECT_THAT(kiln_last_error(), StartsWith("@bad_index: "));
  EXPECT_EQ(bad_index(nullptr, 2, ins, 2, out), -1);
  EXPECT_STREQ(kiln_last_error(), "gather: indices[0] = 7 is not in [0, 3)");
  ins[1] = s64(1000);
  ASSERT_EQ(kiln_function_call(f, ins, out), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(out[0]), 1000) << "100 iterations of table[0]";
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

// Gradients: eagerly the tape records every iteration.
int square_body(void *, int, kiln_tensor *const *s, int, kiln_tensor **out) {
  out[0] = kiln_mul(s[0], s[0]);
  return out[0] ? 0 : -1;
}

int square_three(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_while_loop(always, square_body, nullptr, 1, in, 3, out);
}

TEST_P(Control, EagerGradientsThroughLoops) {
  Scoped s;
  Backend env(GetParam());
  kiln_tensor *x = f64({1.1, 0.9}), *y = nullptr, *dx = nullptr;
  kiln_tape *t = kiln_tape_begin(false);
  kiln_tape_watch(t, x);
  ASSERT_EQ(square_three(nullptr, 1, &x, 1, &y), 0) << kiln_last_error();
  kiln_tape_end(t);
  ASSERT_EQ(kiln_tape_gradient(t, y, 1, &x, &dx), 0) << kiln_last_error();
  VD g = values(dx);
  EXPECT_NEAR(g[0], 8 * std::pow(1.1, 7), 1e-9); // d x^8 / dx
  EXPECT_NEAR(g[1], 8 * std::pow(0.9, 7), 1e-9);
  kiln_tape_free(t);

}

// ---- gradients through staged control flow ----

// d(sum out0)/d(inputs) by kiln_gradients of the staged f (interpreted)
std::vector<kiln_tensor *> staged_grads(kiln_function *f, std::vector<kiln_tensor *> in) {
  kiln_function *g = kiln_gradients(f);
  std::vector<kiln_tensor *> d(in.size(), nullptr);
  EXPECT_NE(g, nullptr) << kiln_last_error();
  if (g) {
    EXPECT_EQ(kiln_function_call(g, in.data(), d.data()), 0) << kiln_last_error();
  }
  kiln_function_free(g);
  return d;
}

// the same by an eager tape over the body run as C
std::vector<kiln_tensor *> eager_grads(kiln_body_fn body, int n_out, std::vector<kiln_tensor *> in) {
  kiln_tape *t = kiln_tape_begin(false);
  for (kiln_tensor *x : in) kiln_tape_watch(t, x);
  std::vector<kiln_tensor *> out((size_t)n_out, nullptr), d(in.size(), nullptr);
  EXPECT_EQ(body(nullptr, (int)in.size(), in.data(), n_out, out.data()), 0) << kiln_last_error();
  kiln_tensor *loss = kiln_reduce_sum(out[0], 0, nullptr, false);
  kiln_tape_end(t);
  EXPECT_EQ(kiln_tape_gradient(t, loss, (int)in.size(), in.data(), d.data()), 0) << kiln_last_error();
  kiln_tape_free(t);
  return d;
}

// central differences of sum(out0) in f64
double fd(kiln_body_fn body, int n_out, std::vector<kiln_tensor *> in, size_t which, int64_t elem) {
  auto eval = [&](double delta) {
    std::vector<kiln_tensor *> x = in;
    VD v = values(in[which]);
    v[(size_t)elem] += delta;
    x[which] = from_values(KILN_F64, shape_of(in[which]), v);
    std::vector<kiln_tensor *> out((size_t)n_out, nullptr);
    EXPECT_EQ(body(nullptr, (int)x.size(), x.data(), n_out, out.data()), 0);
    return kiln_tensor_item(kiln_reduce_sum(out[0], 0, nullptr, false));
  };
  const double h = 1e-6;
  return (eval(h) - eval(-h)) / (2 * h);
}

void expect_grads_match(kiln_body_fn body, int n_out, std::vector<kiln_tensor *> in, const char *name) {
  kiln_function *f = kiln_function_new(name, body, nullptr, (int)in.size(), n_out);
  std::vector<kiln_tensor *> st = staged_grads(f, in), ea = eager_grads(body, n_out, in);
  for (size_t i = 0; i < in.size(); i++) {
    SCOPED_TRACE("input " + std::to_string(i));
    ASSERT_NE(st[i], nullptr);
    if (!ea[i]) ea[i] = kiln_zeros(kiln_tensor_dtype(in[i]), kiln_tensor_rank(in[i]), kiln_tensor_shape(in[i]));
    EXPECT_TRUE(allclose(st[i], ea[i], 1e-9, 1e-12)) << "staged " << testing::PrintToString(values(st[i]))
                                                     << " eager " << testing::PrintToString(values(ea[i]));
    VD g = values(st[i]);
    for (int64_t e = 0; e < (int64_t)g.size(); e++)
      EXPECT_NEAR(g[(size_t)e], fd(body, n_out, in, i, e), 1e-5 * (1 + std::fabs(g[(size_t)e]))) << "element " << e;
  }
  kiln_function_free(f);
}

struct CondCtx {
  kiln_tensor *w;
};

int g_then(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_mul(kiln_sin(in[0]), ((CondCtx *)user)->w); // w: a traced value of the enclosing body
  return out[0] ? 0 : -1;
}

int g_else(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_square(in[0]);
  return out[0] ? 0 : -1;
}

int cond_model(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  CondCtx c{kiln_mul(in[1], kiln_scalar_like(in[1], 1.5))};
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar_like(in[0], 0));
  kiln_tensor *r = nullptr;
  if (kiln_cond(p, g_then, g_else, &c, 1, in, 1, &r)) return -1;
  out[0] = kiln_mul(r, in[0]);
  return out[0] ? 0 : -1;
}

TEST_P(ControlGradients, CondTakesItsBranchsGradient) {
  Scoped s;
  Backend env(GetParam());
  expect_grads_match(cond_model, 1, {f64({0.5, 1.5, -0.3}), f64({0.2, -0.7, 1.1})}, "cond_pos");
  expect_grads_match(cond_model, 1, {f64({-0.5, 0.5, -0.3}), f64({0.2, -0.7, 1.1})}, "cond_neg");
}

// the RNN scan of ScanMatchesTheUnrolledLoop, in f64, against its unrolled
// form: values and gradients (to the carry, the xs and the captured w)
int rnn_loss(void *, int n, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *o[2] = {nullptr, nullptr};
  if (rnn_scan(nullptr, n, in, 2, o)) return -1;
  out[0] = kiln_add(kiln_reduce_sum(o[0], 0, nullptr, false), kiln_reduce_sum(kiln_square(o[1]), 0, nullptr, false));
  return out[0] ? 0 : -1;
}

int rnn_loss_unrolled(void *, int n, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *o[2] = {nullptr, nullptr};
  if (rnn_unrolled(nullptr, n, in, 2, o)) return -1;
  out[0] = kiln_add(kiln_reduce_sum(o[0], 0, nullptr, false), kiln_reduce_sum(kiln_square(o[1]), 0, nullptr, false));
  return out[0] ? 0 : -1;
}

// Dropout in a recurrent scan: the body draws a mask every step, and the
// gradient uses the forward's masks (stacked residuals), not new draws.
// Seeded, the staged run draws what the eager C loop draws, so staged and
// eager gradients agree, and central differences (reseeded per run) too.
kiln_tensor *g_drop_w;

int dropout_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *pre = kiln_tanh(kiln_add(kiln_matmul(in[0], g_drop_w), in[1]));
  const int64_t *shape = kiln_tensor_shape(in[0]);
  kiln_tensor *u = kiln_random_uniform(KILN_F64, 2, shape, 0, 1);
  kiln_tensor *keep = kiln_cast(kiln_less(u, kiln_scalar_like(u, 0.7)), KILN_F64);
  out[0] = kiln_div(kiln_mul(pre, keep), kiln_scalar_like(pre, 0.7));
  out[1] = kiln_mul(out[0], u); // the draw itself reaches the loss too
  return out[0] && out[1] ? 0 : -1;
}

int dropout_rnn(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  g_drop_w = in[2];
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(dropout_step, nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = kiln_add(kiln_reduce_sum(kiln_square(h), 0, nullptr, false), kiln_reduce_sum(kiln_sin(ys), 0, nullptr, false));
  return out[0] ? 0 : -1;
}

TEST_P(ControlGradients, ScanBodiesThatDrawRandomNumbersHaveGradients) {
  Scoped s;
  Backend env(GetParam());
  std::vector<double> xv, wv;
  for (int i = 0; i < 5 * 3 * 4; i++) xv.push_back(std::sin(i * 0.37));
  for (int i = 0; i < 16; i++) wv.push_back(std::cos(i * 0.9) * 0.6);
  std::vector<double> hv;
  for (int i = 0; i < 12; i++) hv.push_back(0.1 * i - 0.5);
  std::vector<kiln_tensor *> in = {f64({3, 4}, hv), f64({5, 3, 4}, xv), f64({4, 4}, wv)};
  kiln_function *f = kiln_function_new("dropout_rnn", dropout_rnn, nullptr, 3, 1);
  kiln_random_seed(3);
  std::vector<kiln_tensor *> st = staged_grads(f, in);
  kiln_random_seed(3);
  std::vector<kiln_tensor *> ea = eager_grads(dropout_rnn, 1, in);
  for (size_t i = 0; i < in.size(); i++) {
    SCOPED_TRACE("input " + std::to_string(i));
    ASSERT_NE(st[i], nullptr);
    ASSERT_NE(ea[i], nullptr);
    EXPECT_TRUE(allclose(st[i], ea[i], 1e-9, 1e-12)) << "staged " << testing::PrintToString(values(st[i]))
                                                     << " eager " << testing::PrintToString(values(ea[i]));
    VD g = values(st[i]);
    for (int64_t e = 0; e < (int64_t)g.size(); e += 3) {
      auto eval = [&](double delta) {
        std::vector<kiln_tensor *> x = in;
        VD v = values(in[i]);
        v[(size_t)e] += delta;
        x[i] = from_values(KILN_F64, shape_of(in[i]), v);
        kiln_tensor *o = nullptr;
        kiln_random_seed(3);
        EXPECT_EQ(dropout_rnn(nullptr, 3, x.data(), 1, &o), 0);
        return kiln_tensor_item(o);
      };
      EXPECT_NEAR(g[(size_t)e], (eval(1e-6) - eval(-1e-6)) / 2e-6, 1e-5 * (1 + std::fabs(g[(size_t)e]))) << e;
    }
  }
  // the masks differ from step to step and from call to call (fresh draws)
  kiln_tensor *a = nullptr, *b = nullptr;
  ASSERT_EQ(kiln_function_call(f, in.data(), &a), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, in.data(), &b), 0) << kiln_last_error();
  EXPECT_NE(kiln_tensor_item(a), kiln_tensor_item(b));
  kiln_function_free(f);
}

// A branch that draws: its gradient uses the forward's draws too (each
// branch returns its own draws, zeros for the other's).
int drawing_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *u = kiln_random_uniform(KILN_F64, 1, kiln_tensor_shape(in[0]), 0, 1);
  out[0] = kiln_mul(kiln_sin(in[0]), u);
  return out[0] ? 0 : -1;
}

int plain_branch(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_square(in[0]);
  return out[0] ? 0 : -1;
}

int drawing_cond(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar_like(in[0], 0)), *r = nullptr;
  if (kiln_cond(p, drawing_branch, plain_branch, nullptr, 1, in, 1, &r)) return -1;
  out[0] = kiln_mul(r, in[0]);
  return out[0] ? 0 : -1;
}

TEST_P(ControlGradients, CondBranchesThatDrawRandomNumbersHaveGradients) {
  Scoped s;
  Backend env(GetParam());
  for (std::vector<double> x : {std::vector<double>{0.5, 1.0, -0.2}, std::vector<double>{-0.5, 0.25, -0.2}}) {
    std::vector<kiln_tensor *> in = {f64(x)};
    kiln_function *f = kiln_function_new("drawing_cond", drawing_cond, nullptr, 1, 1);
    kiln_random_seed(8);
    std::vector<kiln_tensor *> st = staged_grads(f, in);
    kiln_random_seed(8);
    std::vector<kiln_tensor *> ea = eager_grads(drawing_cond, 1, in);
    ASSERT_NE(st[0], nullptr);
    ASSERT_NE(ea[0], nullptr);
    EXPECT_TRUE(allclose(st[0], ea[0], 1e-12, 1e-12)) << testing::PrintToString(values(st[0])) << " vs "
                                                      << testing::PrintToString(values(ea[0]));
    kiln_function_free(f);
  }
}

// A branch that draws inside a staged loop's body: its draws are the loop
// body's too (stacked per step), and the backward's replay of each step
// hands them to the branch's (more nestings: control_nested_draw_test.cc).
int cond_in_scan_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[1], 0, nullptr, false), kiln_scalar_like(in[1], 0)), *r = nullptr;
  if (kiln_cond(p, drawing_branch, plain_branch, nullptr, 1, &in[1], 1, &r)) return -1;
  out[0] = kiln_add(in[0], r);
  return out[0] ? 0 : -1;
}

int cond_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *zero = kiln_zeros(KILN_F64, 1, kiln_tensor_shape(in[0]) + 1);
  return kiln_scan(cond_in_scan_step, nullptr, 1, &zero, 1, in, -1, false, 0, out, nullptr);
}

TEST_P(ControlGradients, BranchesThatDrawInsideLoopsHaveGradients) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("cond_in_scan", cond_in_scan, nullptr, 1, 1);
  std::vector<kiln_tensor *> in = {f64({3, 2}, {0.5, 1.0, -0.5, -1.0, 0.2, 0.1})};
  kiln_random_seed(4);
  std::vector<kiln_tensor *> st = staged_grads(f, in);
  kiln_random_seed(4);
  std::vector<kiln_tensor *> ea = eager_grads(cond_in_scan, 1, in);
  ASSERT_NE(st[0], nullptr);
  ASSERT_NE(ea[0], nullptr);
  EXPECT_TRUE(allclose(st[0], ea[0], 1e-12, 1e-12)) << testing::PrintToString(values(st[0])) << " vs "
                                                    << testing::PrintToString(values(ea[0]));
  kiln_function_free(f);
}

TEST_P(ControlGradients, ScanMatchesTheUnrolledLoopsGradient) {
  Scoped s;
  Backend env(GetParam());
  std::vector<double> xv;
  for (int i = 0; i < 12; i++) xv.push_back(std::sin(i * 0.7));
  std::vector<kiln_tensor *> in = {f64({2}, {0.1, -0.2}), f64({6, 2}, xv), f64({2}, {0.9, -0.4})};
  expect_grads_match(rnn_loss, 1, in, "rnn");
  kiln_function *f = kiln_function_new("rnn", rnn_loss, nullptr, 3, 1);
  kiln_tensor *y = nullptr;
  ASSERT_EQ(kiln_function_call(f, in.data(), &y), 0) << kiln_last_error();
  std::vector<kiln_tensor *> st = staged_grads(f, in), un = eager_grads(rnn_loss_unrolled, 1, in);
  for (size_t i = 0; i < in.size(); i++) EXPECT_TRUE(allclose(st[i], un[i], 1e-9, 1e-12)) << "input " << i;
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("= scan ")) << "the forward stays a scan";
  free(ir);
  kiln_function_free(f);
}

// An LSTM (batch 4, input 3, hidden 5, 6 steps, f64) as a scan against its
// unrolled form: values and gradients with respect to everything.
enum { LB = 4, LIN = 3, LH = 5, LT = 6 };

kiln_tensor *lstm_gate(kiln_tensor *z, int k) {
  int64_t begin[2] = {0, (int64_t)k * LH}, size[2] = {LB, LH};
  return kiln_slice(z, begin, size);
}

struct LstmW {
  kiln_tensor *w, *b;
};

// carry (h, c), x_t -> (h', c'), y_t = h'
int lstm_cell(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  LstmW *m = (LstmW *)user;
  kiln_tensor *hx[2] = {in[2], in[0]};
  kiln_tensor *z = kiln_add(kiln_matmul(kiln_concat(2, hx, 1), m->w), m->b);
  kiln_tensor *i = kiln_sigmoid(lstm_gate(z, 0)), *f = kiln_sigmoid(lstm_gate(z, 1));
  kiln_tensor *g = kiln_tanh(lstm_gate(z, 2)), *o = kiln_sigmoid(lstm_gate(z, 3));
  out[1] = kiln_add(kiln_mul(f, in[1]), kiln_mul(i, g));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  out[2] = out[0];
  return out[0] && out[1] ? 0 : -1;
}

// in: h0, c0, xs, w, b; out: a loss of the last h and every y
int lstm_loss(bool scan, kiln_tensor *const *in, kiln_tensor **out) {
  LstmW m{in[3], in[4]};
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (scan) {
    kiln_tensor *carry[2] = {nullptr, nullptr};
    if (kiln_scan(lstm_cell, &m, 2, in, 1, &in[2], -1, false, 1, carry, &ys)) return -1;
    h = carry[0];
  } else {
    kiln_tensor *hc[2] = {in[0], in[1]};
    std::vector<kiln_tensor *> y;
    for (int64_t t = 0; t < LT; t++) {
      kiln_tensor *io[3] = {hc[0], hc[1], kiln_index(in[2], t)}, *o[3];
      if (lstm_cell(&m, 3, io, 3, o)) return -1;
      hc[0] = o[0], hc[1] = o[1];
      y.push_back(o[2]);
    }
    h = hc[0];
    ys = kiln_stack(LT, y.data(), 0);
  }
  out[0] = kiln_add(kiln_reduce_sum(kiln_mul(h, h), 0, nullptr, false), kiln_reduce_sum(kiln_sin(ys), 0, nullptr, false));
  return out[0] ? 0 : -1;
}

int lstm_scan_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) { return lstm_loss(true, in, out); }
int lstm_unrolled_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) { return lstm_loss(false, in, out); }

kiln_tensor *uniform64(V64 shape, double scale) {
  return kiln_random_uniform(KILN_F64, (int)shape.size(), shape.data(), -scale, scale);
}

TEST_P(ControlGradients, LstmScanMatchesUnrolledValuesAndGradients) {
  Scoped s;
  Backend env(GetParam());
  kiln_random_seed(11);
  std::vector<kiln_tensor *> in = {uniform64({LB, LH}, 0.5), uniform64({LB, LH}, 0.5), uniform64({LT, LB, LIN}, 1),
                                   uniform64({LIN + LH, 4 * LH}, 0.4), uniform64({4 * LH}, 0.1)};
  kiln_function *fs = kiln_function_new("lstm_scan", lstm_scan_body, nullptr, 5, 1);
  kiln_function *fu = kiln_function_new("lstm_unrolled", lstm_unrolled_body, nullptr, 5, 1);
  kiln_tensor *ys = nullptr, *yu = nullptr;
  ASSERT_EQ(kiln_function_call(fs, in.data(), &ys), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(fu, in.data(), &yu), 0) << kiln_last_error();
  EXPECT_NEAR(kiln_tensor_item(ys), kiln_tensor_item(yu), 1e-12);
  std::vector<kiln_tensor *> gs = staged_grads(fs, in), gu = staged_grads(fu, in);
  for (size_t i = 0; i < in.size(); i++) {
    ASSERT_NE(gs[i], nullptr) << i;
    EXPECT_TRUE(allclose(gs[i], gu[i], 1e-6, 1e-9)) << "input " << i;
  }
  char *ir = kiln_function_ir(fs, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("length=6"));
  free(ir);
  kiln_function_free(fs);
  kiln_function_free(fu);
}

// The L2HMC leapfrog steps (a gradient tape inside every half step) as a
// scan give what the unrolled C loop gives.
struct Energy {
  kiln_tensor *w1, *b1, *w2, *b2;
};

kiln_tensor *energy_grad(Energy *e, kiln_tensor *x) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(x, e->w1), e->b1));
  kiln_tensor *y = kiln_add(kiln_matmul(h, e->w2), e->b2);
  kiln_tensor *u = kiln_mul(kiln_reduce_sum(kiln_mul(y, y), 0, nullptr, false), kiln_scalar(KILN_F64, 0.5));
  kiln_tape_end(tape);
  kiln_tensor *g = nullptr;
  if (u) kiln_tape_gradient(tape, u, 1, &x, &g);
  kiln_tape_free(tape);
  return g;
}

int leapfrog_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Energy *e = (Energy *)user;
  kiln_tensor *half = kiln_scalar(KILN_F64, 0.05), *eps = kiln_scalar(KILN_F64, 0.1);
  kiln_tensor *p = kiln_sub(in[1], kiln_mul(half, energy_grad(e, in[0])));
  out[0] = kiln_add(in[0], kiln_mul(eps, p));
  out[1] = kiln_sub(p, kiln_mul(half, energy_grad(e, out[0])));
  return out[0] && out[1] ? 0 : -1;
}

Energy *g_energy;

int leapfrog_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(leapfrog_step, g_energy, 2, in, 0, nullptr, 10, false, 0, out, nullptr);
}

int leapfrog_unrolled(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *s[2] = {in[0], in[1]};
  for (int t = 0; t < 10; t++) {
    kiln_tensor *o[2];
    if (leapfrog_step(g_energy, 2, s, 2, o)) return -1;
    s[0] = o[0], s[1] = o[1];
  }
  out[0] = s[0], out[1] = s[1];
  return 0;
}

TEST_P(Control, L2hmcLeapfrogAsAScan) {
  Scoped s;
  Backend env(GetParam());
  kiln_random_seed(5);
  Energy e{uniform64({2, 10}, 0.5), uniform64({10}, 0.1), uniform64({10, 2}, 0.5), uniform64({2}, 0.1)};
  g_energy = &e;
  kiln_tensor *in[2] = {uniform64({20, 2}, 1), uniform64({20, 2}, 1)}, *a[2] = {}, *b[2] = {};
  kiln_function *fs = kiln_function_new("leapfrog_scan", leapfrog_scan, nullptr, 2, 2);
  ASSERT_EQ(kiln_function_call(fs, in, a), 0) << kiln_last_error();
  ASSERT_EQ(leapfrog_unrolled(nullptr, 2, in, 2, b), 0) << kiln_last_error();
  EXPECT_TRUE(allclose(a[0], b[0], 1e-12, 1e-12));
  EXPECT_TRUE(allclose(a[1], b[1], 1e-12, 1e-12));
  kiln_stats st;
  ASSERT_EQ(kiln_function_stats(fs, 0, &st), 0);
  EXPECT_LT(st.traced_ops, 80) << "one leapfrog step traced, not ten";
  kiln_function_free(fs);
}

// a bounded while_loop is differentiable; the loop stops on the data
int newton_loss(void *, int n, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *o[2] = {nullptr, nullptr};
  if (newton(nullptr, n, in, 2, o)) return -1;
  out[0] = o[0];
  return 0;
}

int pow8(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) { return square_three(nullptr, 1, in, 1, out); }

TEST_P(ControlGradients, BoundedWhileLoops) {
  Scoped s;
  Backend env(GetParam());
  expect_grads_match(pow8, 1, {f64({1.1, 0.9, -0.7})}, "pow8");
  kiln_function *f = kiln_function_new("newton", newton_loss, nullptr, 1, 1);
  kiln_tensor *a = kiln_scalar(KILN_F64, 2.0);
  std::vector<kiln_tensor *> d = staged_grads(f, {a});
  ASSERT_NE(d[0], nullptr);
  EXPECT_NEAR(kiln_tensor_item(d[0]), 0.5 / std::sqrt(2.0), 1e-7) << "d sqrt(a) / da through the iteration";
  kiln_function_free(f);
}

// the second derivative through a scan: d2/dx2 sum(x^8) = 56 x^6
int scan_pow(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *c = nullptr;
  if (kiln_scan(square_body, nullptr, 1, in, 0, nullptr, 3, false, 0, &c, nullptr)) return -1;
  out[0] = c;
  return 0;
}

TEST_P(ControlGradients, SecondOrderThroughAScan) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("scan_pow", scan_pow, nullptr, 1, 1);
  kiln_function *g = kiln_gradients(f), *h = g ? kiln_gradients(g) : nullptr;
  ASSERT_NE(h, nullptr) << kiln_last_error();
  kiln_tensor *x = f64({1.1, -0.9}), *d2 = nullptr, *d1 = nullptr;
  ASSERT_EQ(kiln_function_call(g, &x, &d1), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(h, &x, &d2), 0) << kiln_last_error();
  VD v1 = values(d1), v2 = values(d2);
  EXPECT_NEAR(v1[0], 8 * std::pow(1.1, 7), 1e-9);
  EXPECT_NEAR(v2[0], 56 * std::pow(1.1, 6), 1e-8);
  EXPECT_NEAR(v2[1], 56 * std::pow(0.9, 6), 1e-8);
  kiln_function_free(h);
  kiln_function_free(g);
  kiln_function_free(f);
}

int unbounded_pow(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_while_loop(lt_ten, inc, nullptr, 1, in, -1, out);
}

// an eager tape over a staged call (the taped-call path) and an unbounded loop
TEST_P(ControlGradients, TapedCallsAndUnboundedLoops) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("rnn", rnn_loss, nullptr, 3, 1);
  std::vector<double> xv;
  for (int i = 0; i < 8; i++) xv.push_back(std::cos(i * 0.4));
  std::vector<kiln_tensor *> in = {f64({2}, {0.3, 0.1}), f64({4, 2}, xv), f64({2}, {0.5, 0.6})};
  kiln_tape *t = kiln_tape_begin(false);
  for (kiln_tensor *x : in) kiln_tape_watch(t, x);
  kiln_tensor *y = nullptr;
  ASSERT_EQ(kiln_function_call(f, in.data(), &y), 0) << kiln_last_error();
  kiln_tape_end(t);
  std::vector<kiln_tensor *> d(3, nullptr);
  ASSERT_EQ(kiln_tape_gradient(t, y, 3, in.data(), d.data()), 0) << kiln_last_error();
  kiln_tape_free(t);
  std::vector<kiln_tensor *> want = eager_grads(rnn_loss_unrolled, 1, in);
  for (size_t i = 0; i < 3; i++) EXPECT_TRUE(allclose(d[i], want[i], 1e-9, 1e-12)) << "input " << i;
  kiln_function_free(f);

  f = kiln_function_new("unbounded", unbounded_pow, nullptr, 1, 1);
  kiln_function *g = kiln_gradients(f);
  kiln_tensor *x = f32({1, 2}), *dx = nullptr;
  EXPECT_EQ(kiln_function_call(g, &x, &dx), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("while_loop: a gradient tape watches an operand of a staged while_loop "
                                           "without a bound: give it max_iterations"));
  kiln_function_free(g);
  kiln_function_free(f);
}

INSTANTIATE_TEST_SUITE_P(, Control, testing::Values("cpu", "interp"), backend_name);
INSTANTIATE_TEST_SUITE_P(, ControlGradients, testing::Values("cpu", "interp"), backend_name);

} // namespace
