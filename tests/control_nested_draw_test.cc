// control_nested_draw_test.cc — gradients through staged control flow
// nested in a staged loop's body or branch whose bodies draw random
// numbers: a cond that draws inside a scan, a scan that draws inside a
// scan, a bounded while_loop that draws inside a cond, and nestings two
// and three deep. The nested construct's draws are residuals of every body
// around it (stacked per step by each enclosing scan, returned by each
// enclosing cond), and the backward's replay of each body hands them to
// the nested one's replay: the gradient uses the forward's draws.
//
// Seeded, a staged run draws what the eager C run draws (the same ops in
// the same order), so each case checks, compiled by the CPU backend and
// interpreted: staged values == eager values, staged gradients == an eager
// tape's, and the staged gradients against central differences in f64
// (the stream reseeded for each evaluation). NestedDraws.X/cpu and
// NestedDraws.X/interp.
#include <gmock/gmock.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;

namespace {

struct Backend : EnvGuard {
  explicit Backend(const char *name) : EnvGuard("KILN_BACKEND", name) {}
};

class NestedDraws : public testing::TestWithParam<const char *> {};
std::string backend_name(const testing::TestParamInfo<const char *> &i) { return i.param; }

const uint64_t kSeed = 21;

// A dropout whose draw reaches the result smoothly too: x * mask / 0.7 +
// 0.3 * u * sin(x), u uniform in [0, 1), mask = u < 0.7. A gradient
// computed with other draws than the forward's is wrong almost surely.
kiln_tensor *drop(kiln_tensor *x) {
  kiln_tensor *u = kiln_random_uniform(KILN_F64, kiln_tensor_rank(x), kiln_tensor_shape(x), 0, 1);
  kiln_tensor *keep = kiln_cast(kiln_less(u, kiln_scalar_like(u, 0.7)), KILN_F64);
  return kiln_add(kiln_div(kiln_mul(x, keep), kiln_scalar_like(x, 0.7)),
                  kiln_mul(kiln_mul(u, kiln_sin(x)), kiln_scalar_like(x, 0.3)));
}

kiln_tensor *positive_sum(kiln_tensor *x) {
  return kiln_greater(kiln_reduce_sum(x, 0, nullptr, false), kiln_scalar_like(x, 0));
}

kiln_tensor *sum(kiln_tensor *x) { return kiln_reduce_sum(x, 0, nullptr, false); }

// the weights every body reads (captured from the enclosing body: each
// region's environment)
struct W {
  kiln_tensor *w;
};

int drop_branch(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = drop(kiln_tanh(kiln_mul(in[0], ((W *)user)->w)));
  return out[0] ? 0 : -1;
}

int plain_branch(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_mul(kiln_sin(in[0]), ((W *)user)->w);
  return out[0] ? 0 : -1;
}

// ---- dropout in a cond in a scan ----
// in: h0 [3], xs [5, 3], w [3]; step: h' = cond(sum(x) > 0, drop(tanh((h + x) w)), sin(h + x) w)
int cond_in_scan_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *hx = kiln_add(in[0], in[1]);
  if (kiln_cond(positive_sum(in[1]), drop_branch, plain_branch, user, 1, &hx, 1, &out[0])) return -1;
  out[1] = kiln_mul(out[0], in[1]);
  return out[1] ? 0 : -1;
}

int cond_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[2]};
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(cond_in_scan_step, &w, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = kiln_add(sum(kiln_square(h)), sum(kiln_sin(ys)));
  return out[0] ? 0 : -1;
}

// ---- both branches draw (the then branch twice), in a scan ----
// the else branch's draws come after the then branch's in the residuals
int drop_twice(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = drop(kiln_cos(drop(kiln_tanh(kiln_mul(in[0], ((W *)user)->w)))));
  return out[0] ? 0 : -1;
}

int both_draw_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *hx = kiln_add(in[0], in[1]);
  if (kiln_cond(positive_sum(in[1]), drop_twice, drop_branch, user, 1, &hx, 1, &out[0])) return -1;
  out[1] = kiln_mul(out[0], in[1]);
  return out[1] ? 0 : -1;
}

int both_draw_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[2]};
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(both_draw_step, &w, 1, &in[0], 1, &in[1], -1, true, 1, &h, &ys)) return -1;
  out[0] = kiln_add(sum(kiln_square(h)), sum(kiln_sin(ys)));
  return out[0] ? 0 : -1;
}

// ---- a scan that draws in a scan ----
// in: h0 [3], xs [4, 3], w [3]; outer step: an inner scan of 3 steps over
// c = h + x drawing each step (c' = drop(tanh(c w)), y = c' * c), then
// h' = c_final + 0.5 h; the reverse flag on the inner one
int inner_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = drop(kiln_tanh(kiln_mul(in[0], ((W *)user)->w)));
  out[1] = kiln_mul(out[0], in[0]);
  return out[0] && out[1] ? 0 : -1;
}

int scan_in_scan_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *c = kiln_add(in[0], in[1]), *fin = nullptr, *ys = nullptr;
  if (kiln_scan(inner_step, user, 1, &c, 0, nullptr, 3, true, 1, &fin, &ys)) return -1;
  out[0] = kiln_add(fin, kiln_mul(in[0], kiln_scalar_like(in[0], 0.5)));
  out[1] = kiln_reduce_sum(ys, KILN_AXES(0), false);
  return out[0] && out[1] ? 0 : -1;
}

int scan_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[2]};
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(scan_in_scan_step, &w, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = kiln_add(sum(kiln_square(h)), sum(kiln_cos(ys)));
  return out[0] ? 0 : -1;
}

// ---- a bounded while_loop that draws, in a cond ----
// in: x [3], w [3]; cond(sum(x) > 0, then: (s, i) = (x, 0); while i < 3:
// s = drop(tanh(s w)) (max_iterations 5), else: sin(x) w)
int while_cond(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_less(in[1], kiln_scalar(KILN_I64, 3));
  return out[0] ? 0 : -1;
}

int while_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = drop(kiln_tanh(kiln_mul(in[0], ((W *)user)->w)));
  out[1] = kiln_add(in[1], kiln_scalar(KILN_I64, 1));
  return out[0] && out[1] ? 0 : -1;
}

int while_branch(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {in[0], kiln_scalar(KILN_I64, 0)}, *fin[2] = {nullptr, nullptr};
  if (kiln_while_loop(while_cond, while_body, user, 2, init, 5, fin)) return -1;
  out[0] = fin[0];
  return 0;
}

int while_in_cond(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[1]};
  kiln_tensor *r = nullptr;
  if (kiln_cond(positive_sum(in[0]), while_branch, plain_branch, &w, 1, in, 1, &r)) return -1;
  out[0] = kiln_add(sum(kiln_mul(r, in[0])), sum(kiln_square(r)));
  return out[0] ? 0 : -1;
}

// the bounded while_loop that draws on its own (a scan of conds under a tape)
int drawing_while(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[1]};
  if (while_branch(&w, 1, in, 1, out)) return -1;
  out[0] = sum(kiln_mul(out[0], in[0]));
  return out[0] ? 0 : -1;
}

// ---- two levels: a scan that draws in a scan in a cond ----
// in: x [3], xs [3, 3], w [3]; cond(sum(x) > 0, then: the outer scan of
// scan_in_scan over xs from x, else: sin(x) w)
int scans_branch(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const W *w = (const W *)user;
  kiln_tensor *ys = nullptr;
  if (kiln_scan(scan_in_scan_step, (void *)w, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &ys)) return -1;
  out[0] = kiln_add(out[0], kiln_reduce_sum(ys, KILN_AXES(0), false));
  return out[0] ? 0 : -1;
}

int plain_branch2(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(kiln_mul(kiln_sin(in[0]), ((W *)user)->w), kiln_reduce_sum(in[1], KILN_AXES(0), false));
  return out[0] ? 0 : -1;
}

int scan_in_scan_in_cond(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[2]};
  kiln_tensor *r = nullptr;
  if (kiln_cond(positive_sum(in[0]), scans_branch, plain_branch2, &w, 2, in, 1, &r)) return -1;
  out[0] = sum(kiln_square(r));
  return out[0] ? 0 : -1;
}

// ---- three levels: a cond that draws in a bounded while in a scan ----
// in: h0 [3], xs [4, 3], w [3]; step: (s, i) = (h + x, 0); while i < 2
// (max_iterations 3): s = cond(sum(s) > 0, drop(tanh(s w)), sin(s) w)
int cond_while_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_cond(positive_sum(in[0]), drop_branch, plain_branch, user, 1, in, 1, &out[0])) return -1;
  out[1] = kiln_add(in[1], kiln_scalar(KILN_I64, 1));
  return out[1] ? 0 : -1;
}

int two_steps(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_less(in[1], kiln_scalar(KILN_I64, 2));
  return out[0] ? 0 : -1;
}

int while_in_scan_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {kiln_add(in[0], in[1]), kiln_scalar(KILN_I64, 0)}, *fin[2] = {nullptr, nullptr};
  if (kiln_while_loop(two_steps, cond_while_body, user, 2, init, 3, fin)) return -1;
  out[0] = fin[0];
  out[1] = kiln_mul(fin[0], in[0]);
  return out[1] ? 0 : -1;
}

int cond_in_while_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[2]};
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(while_in_scan_step, &w, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = kiln_add(sum(h), sum(kiln_sin(ys)));
  return out[0] ? 0 : -1;
}

// s' = s + u, u uniform (a while body with a counter)
int nest_uniform(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], kiln_random_uniform(KILN_F64, kiln_tensor_rank(in[0]), kiln_tensor_shape(in[0]), 0, 1));
  out[1] = kiln_add(in[1], kiln_scalar(KILN_I64, 1));
  return out[0] && out[1] ? 0 : -1;
}

// ---- checking one case ----

double eager_value(kiln_body_fn body, const std::vector<kiln_tensor *> &in) {
  kiln_tensor *o = nullptr;
  kiln_random_seed(kSeed);
  EXPECT_EQ(body(nullptr, (int)in.size(), in.data(), 1, &o), 0) << kiln_last_error();
  return o ? kiln_tensor_item(o) : NAN;
}

std::vector<kiln_tensor *> eager_grads(kiln_body_fn body, const std::vector<kiln_tensor *> &in) {
  kiln_random_seed(kSeed);
  kiln_tape *t = kiln_tape_begin(false);
  for (kiln_tensor *x : in) kiln_tape_watch(t, x);
  kiln_tensor *o = nullptr;
  std::vector<kiln_tensor *> d(in.size(), nullptr);
  EXPECT_EQ(body(nullptr, (int)in.size(), in.data(), 1, &o), 0) << kiln_last_error();
  kiln_tape_end(t);
  EXPECT_EQ(kiln_tape_gradient(t, o, (int)in.size(), in.data(), d.data()), 0) << kiln_last_error();
  kiln_tape_free(t);
  return d;
}

// staged == eager (values, gradients), gradients == central differences;
// wants: the instructions the traced forward must hold (nested)
void expect_nested_grads(kiln_body_fn body, std::vector<kiln_tensor *> in, const char *name,
                         std::vector<std::string> wants) {
  SCOPED_TRACE(name);
  kiln_function *f = kiln_function_new(name, body, nullptr, (int)in.size(), 1);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  kiln_tensor *y = nullptr;
  kiln_random_seed(kSeed);
  ASSERT_EQ(kiln_function_call(f, in.data(), &y), 0) << kiln_last_error();
  EXPECT_NEAR(kiln_tensor_item(y), eager_value(body, in), 1e-12 * (1 + std::fabs(kiln_tensor_item(y))))
      << "staged and eager draw the same numbers";
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr) << kiln_last_error();
  for (const std::string &w : wants) EXPECT_THAT(ir, HasSubstr(w)) << ir;
  free(ir);

  kiln_function *g = kiln_gradients(f);
  ASSERT_NE(g, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> st(in.size(), nullptr);
  kiln_random_seed(kSeed);
  ASSERT_EQ(kiln_function_call(g, in.data(), st.data()), 0) << kiln_last_error();
  std::vector<kiln_tensor *> ea = eager_grads(body, in);
  for (size_t i = 0; i < in.size(); i++) {
    SCOPED_TRACE("input " + std::to_string(i));
    ASSERT_NE(st[i], nullptr);
    if (!ea[i]) ea[i] = kiln_zeros(kiln_tensor_dtype(in[i]), kiln_tensor_rank(in[i]), kiln_tensor_shape(in[i]));
    EXPECT_TRUE(allclose(st[i], ea[i], 1e-9, 1e-12)) << "staged " << testing::PrintToString(values(st[i]))
                                                     << " eager " << testing::PrintToString(values(ea[i]));
    VD gv = values(st[i]);
    for (int64_t e = 0; e < (int64_t)gv.size(); e++) {
      auto eval = [&](double delta) {
        std::vector<kiln_tensor *> x = in;
        VD v = values(in[i]);
        v[(size_t)e] += delta;
        x[i] = from_values(KILN_F64, shape_of(in[i]), v);
        return eager_value(body, x);
      };
      const double h = 1e-6;
      EXPECT_NEAR(gv[(size_t)e], (eval(h) - eval(-h)) / (2 * h), 1e-5 * (1 + std::fabs(gv[(size_t)e])))
          << "element " << e;
    }
  }
  kiln_function_free(g);
  kiln_function_free(f);
}

std::vector<double> wave(int n, double a, double b) {
  std::vector<double> v;
  for (int i = 0; i < n; i++) v.push_back(std::sin(i * a + b));
  return v;
}

TEST_P(NestedDraws, DropoutInACondInAScan) {
  Scoped s;
  Backend env(GetParam());
  // the steps' x sums change sign: both branches run, the drawing one on some steps
  expect_nested_grads(cond_in_scan, {f64({0.2, -0.4, 0.6}), f64({5, 3}, wave(15, 0.9, 0.3)), f64({0.8, -1.1, 0.5})},
                      "cond_in_scan", {"= scan ", "= cond "});
}

TEST_P(NestedDraws, BothBranchesDrawInAReverseScan) {
  Scoped s;
  Backend env(GetParam());
  expect_nested_grads(both_draw_in_scan,
                      {f64({0.2, -0.4, 0.6}), f64({5, 3}, wave(15, 0.9, 0.3)), f64({0.8, -1.1, 0.5})},
                      "both_draw_in_scan", {"= scan ", "= cond "});
}

TEST_P(NestedDraws, AScanThatDrawsInAScan) {
  Scoped s;
  Backend env(GetParam());
  expect_nested_grads(scan_in_scan, {f64({0.2, -0.4, 0.6}), f64({4, 3}, wave(12, 0.7, 0.1)), f64({0.8, -1.1, 0.5})},
                      "scan_in_scan", {"= scan "});
}

TEST_P(NestedDraws, ABoundedWhileThatDrawsInACond) {
  Scoped s;
  Backend env(GetParam());
  expect_nested_grads(while_in_cond, {f64({0.5, 1.0, -0.2}), f64({0.9, -0.6, 1.3})}, "while_in_cond_then",
                      {"= cond "});
  expect_nested_grads(while_in_cond, {f64({-0.5, 0.25, -0.2}), f64({0.9, -0.6, 1.3})}, "while_in_cond_else",
                      {"= cond "});
}

TEST_P(NestedDraws, ABoundedWhileThatDraws) {
  Scoped s;
  Backend env(GetParam());
  expect_nested_grads(drawing_while, {f64({0.5, 1.0, -0.2}), f64({0.9, -0.6, 1.3})}, "drawing_while", {});
}

TEST_P(NestedDraws, AScanThatDrawsInAScanInACond) {
  Scoped s;
  Backend env(GetParam());
  std::vector<double> xs = wave(9, 0.8, 0.5);
  expect_nested_grads(scan_in_scan_in_cond, {f64({0.3, 0.1, -0.2}), f64({3, 3}, xs), f64({0.8, -1.1, 0.5})},
                      "scans_in_cond_then", {"= cond ", "= scan "});
  expect_nested_grads(scan_in_scan_in_cond, {f64({-0.3, 0.1, -0.2}), f64({3, 3}, xs), f64({0.8, -1.1, 0.5})},
                      "scans_in_cond_else", {"= cond ", "= scan "});
}

TEST_P(NestedDraws, ACondThatDrawsInABoundedWhileInAScan) {
  Scoped s;
  Backend env(GetParam());
  expect_nested_grads(cond_in_while_in_scan,
                      {f64({0.2, -0.4, 0.6}), f64({4, 3}, wave(12, 1.3, 0.2)), f64({0.8, -1.1, 0.5})},
                      "cond_in_while_in_scan", {"= scan ", "= cond "});
}

// Second order: the gradient function differentiated again replays the
// backward's replays, which read the same draws (the forward's, passed on as
// inputs): d/dx sum(df/dh0) against central differences of the staged
// gradient (reseeded per call).
TEST_P(NestedDraws, SecondOrderThroughACondThatDrawsInAScan) {
  Scoped s;
  Backend env(GetParam());
  std::vector<kiln_tensor *> in = {f64({0.2, -0.4, 0.6}), f64({5, 3}, wave(15, 0.9, 0.3)), f64({0.8, -1.1, 0.5})};
  kiln_function *f = kiln_function_new("cond_in_scan", cond_in_scan, nullptr, 3, 1);
  kiln_function *g = kiln_gradients(f), *h = g ? kiln_gradients(g) : nullptr;
  ASSERT_NE(h, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> d2(3, nullptr);
  kiln_random_seed(kSeed);
  ASSERT_EQ(kiln_function_call(h, in.data(), d2.data()), 0) << kiln_last_error();
  double biggest = 0;
  for (kiln_tensor *t : d2)
    for (double v : t ? values(t) : VD{}) biggest = std::max(biggest, std::fabs(v));
  EXPECT_GT(biggest, 0.1) << "second derivatives that are not all zero";
  for (size_t i = 0; i < in.size(); i++) {
    SCOPED_TRACE("input " + std::to_string(i));
    ASSERT_NE(d2[i], nullptr);
    VD gv = values(d2[i]);
    for (int64_t e = 0; e < (int64_t)gv.size(); e++) {
      auto eval = [&](double delta) {
        std::vector<kiln_tensor *> x = in;
        VD v = values(in[i]);
        v[(size_t)e] += delta;
        x[i] = from_values(KILN_F64, shape_of(in[i]), v);
        std::vector<kiln_tensor *> d(3, nullptr);
        kiln_random_seed(kSeed);
        EXPECT_EQ(kiln_function_call(g, x.data(), d.data()), 0) << kiln_last_error();
        return d[0] ? kiln_tensor_item(sum(d[0])) : NAN;
      };
      const double step = 1e-5;
      EXPECT_NEAR(gv[(size_t)e], (eval(step) - eval(-step)) / (2 * step), 1e-5 * (1 + std::fabs(gv[(size_t)e])))
          << "element " << e;
    }
  }
  kiln_function_free(h);
  kiln_function_free(g);
  kiln_function_free(f);
}

// Each call of the staged gradient draws afresh (the residuals are this
// call's draws, not the trace's): two calls give different gradients.
TEST_P(NestedDraws, EachCallDrawsAfresh) {
  Scoped s;
  Backend env(GetParam());
  std::vector<kiln_tensor *> in = {f64({0.2, -0.4, 0.6}), f64({4, 3}, wave(12, 0.7, 0.1)), f64({0.8, -1.1, 0.5})};
  kiln_function *f = kiln_function_new("scan_in_scan", scan_in_scan, nullptr, 3, 1);
  kiln_function *g = kiln_gradients(f);
  ASSERT_NE(g, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> a(3, nullptr), b(3, nullptr);
  ASSERT_EQ(kiln_function_call(g, in.data(), a.data()), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(g, in.data(), b.data()), 0) << kiln_last_error();
  EXPECT_FALSE(allclose(a[2], b[2], 1e-9, 1e-12));
  kiln_function_free(g);
  kiln_function_free(f);
}

// A staged function that draws, called in a scan's body: under a tape the
// call is inlined into the body (function.c), so its draws are the body's.
kiln_function *g_drawing_fn;

int drawing_fn_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = drop(kiln_tanh(in[0]));
  return out[0] ? 0 : -1;
}

int call_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *hx = kiln_add(in[0], in[1]);
  if (kiln_function_call(g_drawing_fn, &hx, &out[0])) return -1;
  out[1] = kiln_mul(out[0], in[1]);
  return 0;
}

int call_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(call_step, nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = kiln_add(sum(kiln_square(h)), sum(kiln_sin(ys)));
  return out[0] ? 0 : -1;
}

TEST_P(NestedDraws, AStagedCallThatDrawsInAScan) {
  Scoped s;
  Backend env(GetParam());
  g_drawing_fn = kiln_function_new("drawing_fn", drawing_fn_body, nullptr, 1, 1);
  expect_nested_grads(call_in_scan, {f64({0.2, -0.4, 0.6}), f64({4, 3}, wave(12, 0.7, 0.1))}, "call_in_scan",
                      {"= scan "});
  kiln_function_free(g_drawing_fn);
}

// ---- what still has no gradient: a clear error, the function usable ----

// an unbounded while_loop that draws in a scan's body, its state not
// watched: the backward would draw again
int unwatched_step(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {kiln_zeros(KILN_F64, 1, kiln_tensor_shape(in[1])), kiln_scalar(KILN_I64, 0)};
  kiln_tensor *fin[2] = {nullptr, nullptr};
  if (kiln_while_loop(two_steps, nest_uniform, nullptr, 2, init, -1, fin)) return -1;
  out[0] = kiln_add(in[0], kiln_mul(in[1], fin[0]));
  out[1] = out[0];
  return out[0] ? 0 : -1;
}

int unwatched_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(unwatched_step, nullptr, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = sum(kiln_square(h));
  return out[0] ? 0 : -1;
}

TEST_P(NestedDraws, AnUnboundedWhileThatDrawsInALoopSaysItHasNoGradient) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("unwatched_in_scan", unwatched_in_scan, nullptr, 2, 1);
  std::vector<kiln_tensor *> in = {f64({0.2, -0.4, 0.6}), f64({4, 3}, wave(12, 0.7, 0.1))};
  kiln_function *g = kiln_gradients(f);
  ASSERT_NE(g, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> d(2, nullptr);
  EXPECT_NE(kiln_function_call(g, in.data(), d.data()), 0);
  EXPECT_THAT(kiln_last_error(), HasSubstr("random_uniform: drawn in a staged while_loop without max_iterations"));
  kiln_tensor *y = nullptr;
  EXPECT_EQ(kiln_function_call(f, in.data(), &y), 0) << kiln_last_error();  // the function itself still runs
  kiln_function_free(g);
  kiln_function_free(f);
}

// an unbounded while_loop that draws in a scan's body: no gradient, asks for a bound
int unbounded_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *init[2] = {kiln_add(in[0], in[1]), kiln_scalar(KILN_I64, 0)}, *fin[2] = {nullptr, nullptr};
  if (kiln_while_loop(two_steps, while_body, user, 2, init, -1, fin)) return -1;
  out[0] = fin[0];
  out[1] = fin[0];
  return 0;
}

int unbounded_in_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  W w{in[2]};
  kiln_tensor *h = nullptr, *ys = nullptr;
  if (kiln_scan(unbounded_step, &w, 1, &in[0], 1, &in[1], -1, false, 1, &h, &ys)) return -1;
  out[0] = sum(kiln_square(h));
  return out[0] ? 0 : -1;
}

TEST_P(NestedDraws, AnUnboundedWhileThatDrawsInALoopAsksForABound) {
  Scoped s;
  Backend env(GetParam());
  kiln_function *f = kiln_function_new("unbounded_in_scan", unbounded_in_scan, nullptr, 3, 1);
  std::vector<kiln_tensor *> in = {f64({0.2, -0.4, 0.6}), f64({4, 3}, wave(12, 0.7, 0.1)), f64({0.8, -1.1, 0.5})};
  kiln_function *g = kiln_gradients(f);
  ASSERT_NE(g, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> d(3, nullptr);
  EXPECT_NE(kiln_function_call(g, in.data(), d.data()), 0);
  EXPECT_THAT(kiln_last_error(), HasSubstr("max_iterations"));
  kiln_tensor *y = nullptr;
  EXPECT_EQ(kiln_function_call(f, in.data(), &y), 0) << kiln_last_error();
  kiln_function_free(g);
  kiln_function_free(f);
}

INSTANTIATE_TEST_SUITE_P(, NestedDraws, testing::Values("cpu", "interp"), backend_name);

}  // namespace
