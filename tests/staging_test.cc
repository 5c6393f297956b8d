// staging_test.cc — the staging features beyond one flat trace: nested
// staged calls recorded as call instructions, variables assigned inside
// staged bodies, kiln_host_call, gradients through staged calls and
// kiln_gradients, and the TF Eager paper's listings in C.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ir.h"
#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;
using testing::Not;
using testing::StartsWith;

// Every function traced anywhere in this test binary must round-trip through
// its .kir text (function.c checks each trace when this is set).
static const bool roundtrip_checked = (setenv("KILN_CHECK_ROUNDTRIP", "1", 0), true);

namespace {

TEST(Roundtrip, CheckIsOnForTheWholeSuite) { EXPECT_TRUE(roundtrip_checked && getenv("KILN_CHECK_ROUNDTRIP")); }

// ---- nested functions (TF Eager paper: outer calls inner) ----
int inner_relu(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_relu(in[0]);
  return out[0] ? 0 : -1;
}
int outer_matmul(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *p = kiln_matmul(in[0], in[1]);
  return kiln_function_call((kiln_function *)user, &p, out);
}

TEST(Nested, OuterCallsInnerRecordsACall) {
  Scoped s;
  kiln_function *inner = kiln_function_new("inner", inner_relu, nullptr, 1, 1);
  kiln_function *outer = kiln_function_new("outer", outer_matmul, inner, 2, 1);
  kiln_tensor *in[2] = {kiln_eye(KILN_F32, 3), kiln_mul(kiln_eye(KILN_F32, 3), f32({-1, 1, 2}))}, *out = nullptr;
  ASSERT_EQ(kiln_function_call(outer, in, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{0, 0, 0, 0, 1, 0, 0, 0, 2}));
  char *ir = kiln_function_ir(outer, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("func @inner(%0: f32[3,3]) -> f32[3,3]"));
  EXPECT_THAT(ir, HasSubstr("= call @inner("));
  const char *outer_text = strstr(ir, "func @outer(");
  ASSERT_NE(outer_text, nullptr) << ir;
  EXPECT_THAT(outer_text, Not(HasSubstr("relu %"))) << "the outer trace must not inline relu:\n" << ir;
  // the text parses back to the same text
  ir_module *m = ir_parse(ir, "outer.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  char *again = ir_print_module(m);
  EXPECT_STREQ(again, ir);
  free(again);
  ir_module_free(m);
  free(ir);
  // a second call reuses both traces
  ASSERT_EQ(kiln_function_call(outer, in, &out), 0);
  EXPECT_EQ(kiln_function_trace_count(outer), 1);
  EXPECT_EQ(kiln_function_trace_count(inner), 1);
  // the inner function still works on its own, with its trace
  ASSERT_EQ(kiln_function_call(inner, in + 1, &out), 0);
  EXPECT_EQ(values(out), (VD{0, 0, 0, 0, 1, 0, 0, 0, 2}));
  EXPECT_EQ(kiln_function_trace_count(inner), 1);
  kiln_function_free(outer);
  kiln_function_free(inner);
}

int calls_itself(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_function_call(*(kiln_function **)user, in, out);
}

TEST(Nested, RecursionFailsCleanly) {
  Scoped s;
  kiln_function *f = nullptr;
  f = kiln_function_new("rec", calls_itself, &f, 1, 1);
  kiln_tensor *x = f32({1}), *out = nullptr;
  EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("@rec calls itself while being traced"));
  EXPECT_EQ(kiln_function_trace_count(f), 0);
  kiln_function_free(f);
}

int counts_own_traces(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  *(int *)((void **)user)[1] = kiln_function_trace_count(*(kiln_function **)user); // must not deadlock
  out[0] = kiln_neg(in[0]);
  return 0;
}

TEST(Nested, TraceCountInsideOwnBody) {
  Scoped s;
  int seen = -1;
  void *user[2] = {nullptr, &seen};
  kiln_function *f = kiln_function_new("self", counts_own_traces, user, 1, 1);
  user[0] = f;
  kiln_tensor *x = f32({1}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(seen, 0);
  kiln_function_free(f);
}

// ---- variables assigned inside staged functions ----
int mutate(void *user, int, kiln_tensor *const *, int, kiln_tensor **out) {
  kiln_variable *v = (kiln_variable *)user;
  if (kiln_variable_assign_add(v, kiln_scalar(KILN_F32, 1))) return -1;
  out[0] = kiln_variable_read(v);
  return out[0] ? 0 : -1;
}

TEST(Variables, MutatedStagedAndEagerlyInBetween) { // the TF Eager paper's listing
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(kiln_scalar(KILN_F32, 0), "state");
  kiln_function *f = kiln_function_new("mutate", mutate, v, 0, 1);
  kiln_tensor *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, nullptr, &out), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(out), 1);
  ASSERT_EQ(kiln_variable_assign_add(v, kiln_scalar(KILN_F32, 1)), 0);
  EXPECT_EQ(kiln_tensor_item(kiln_variable_read(v)), 2);
  ASSERT_EQ(kiln_function_call(f, nullptr, &out), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(out), 3);
  EXPECT_EQ(kiln_tensor_item(kiln_variable_read(v)), 3);
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("%state: f32[]"));
  free(ir);
  kiln_function_free(f);
}

int assign_twice(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_variable *v = (kiln_variable *)user;
  kiln_tensor *before = kiln_variable_read(v);
  if (kiln_variable_assign(v, in[0])) return -1;
  kiln_tensor *mid = kiln_variable_read(v);
  if (kiln_variable_assign_sub(v, kiln_mul(mid, kiln_scalar(KILN_F32, 0.5)))) return -1;
  out[0] = kiln_add(before, kiln_variable_read(v)); // old value + in/2
  out[1] = mid;
  return 0;
}

TEST(Variables, ReadsAfterWritesSeeThemInProgramOrder) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(f32({10, 20}), "w");
  kiln_function *f = kiln_function_new("assign_twice", assign_twice, v, 1, 2);
  kiln_tensor *x = f32({2, 4}), *out[2] = {nullptr, nullptr};
  ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{11, 22}));
  EXPECT_EQ(values(out[1]), (VD{2, 4}));
  EXPECT_EQ(values(kiln_variable_read(v)), (VD{1, 2}));
  ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{2, 4}));
  EXPECT_EQ(values(kiln_variable_read(v)), (VD{1, 2}));
  // x is not aliased by the variable: a later eager assignment leaves x alone
  ASSERT_EQ(kiln_variable_assign(v, f32({7, 7})), 0);
  EXPECT_EQ(values(x), (VD{2, 4}));
  kiln_function_free(f);
}

int bump_inner(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_variable_assign_add((kiln_variable *)user, in[0])) return -1;
  out[0] = kiln_neg(in[0]);
  return 0;
}
int bump_outer(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_function *inner = (kiln_function *)user;
  kiln_tensor *t;
  if (kiln_function_call(inner, in, &t) || kiln_function_call(inner, &t, out)) return -1;
  return 0;
}

TEST(Variables, WritesOfANestedCallReachTheVariable) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(f32({0, 0}), "acc");
  kiln_function *inner = kiln_function_new("bump", bump_inner, v, 1, 1);
  kiln_function *outer = kiln_function_new("twice", bump_outer, inner, 1, 1);
  kiln_tensor *x = f32({1, 5}), *out = nullptr;
  for (int i = 0; i < 3; i++) ASSERT_EQ(kiln_function_call(outer, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{1, 5}));
  EXPECT_EQ(values(kiln_variable_read(v)), (VD{0, 0})); // +x then -x, three times
  ASSERT_EQ(kiln_variable_assign(v, f32({1, 1})), 0);
  kiln_tensor *y = f32({2, 3});
  ASSERT_EQ(kiln_function_call(inner, &y, &out), 0);
  EXPECT_EQ(values(kiln_variable_read(v)), (VD{3, 4}));
  char *ir = kiln_function_ir(outer, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("call @bump("));
  free(ir);
  kiln_function_free(outer);
  kiln_function_free(inner);
}

// ---- random draws per call (the paper's add_noise) ----
int add_noise(void *, int, kiln_tensor *const *, int, kiln_tensor **out) {
  out[0] = kiln_add(kiln_eye(KILN_F32, 2), kiln_random_normal(KILN_F32, KILN_SHAPE(2, 2)));
  return out[0] ? 0 : -1;
}

TEST(Random, AddNoiseDrawsNewValuesEachCallAndReseedReproduces) {
  Scoped s;
  kiln_function *f = kiln_function_new("add_noise", add_noise, nullptr, 0, 1);
  kiln_tensor *a = nullptr, *b = nullptr, *c = nullptr, *e = nullptr;
  kiln_random_seed(5);
  ASSERT_EQ(kiln_function_call(f, nullptr, &a), 0) << kiln_last_error();  // traces, then runs
  ASSERT_EQ(kiln_function_call(f, nullptr, &b), 0);
  EXPECT_NE(values(a), values(b));
  kiln_random_seed(5);
  ASSERT_EQ(kiln_function_call(f, nullptr, &c), 0);
  EXPECT_TRUE(same_bits(a, c));
  kiln_random_seed(5); // the staged draws are the eager draws
  ASSERT_EQ(add_noise(nullptr, 0, nullptr, 1, &e), 0);
  EXPECT_TRUE(same_bits(a, e));
  char *ir = kiln_function_ir(f, 0, "traced");
  EXPECT_THAT(ir, HasSubstr("seed=global, counter=global"));
  free(ir);
  kiln_function_free(f);
}

// ---- kiln_host_call ----
std::atomic<int> host_calls{0};
int host_scale(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  host_calls++;
  double k = *(double *)user;
  out[0] = kiln_mul(in[0], kiln_scalar((kiln_dtype)kiln_tensor_dtype(in[0]), k));
  out[1] = kiln_reduce_sum(in[0], 0, nullptr, false);
  return out[0] && out[1] ? 0 : -1;
}
int host_wrong_shape(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *two[2] = {in[0], in[0]};
  out[0] = kiln_concat(2, two, 0);
  out[1] = kiln_reduce_sum(in[0], 0, nullptr, false);
  return 0;
}
bool flaky_fail = false;
int host_flaky(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  if (flaky_fail) return kiln_fail("flaky: asked to fail");
  return host_scale(user, n, in, n_out, out);
}
struct HostUser {
  kiln_host_fn fn;
  double k;
};
int with_host(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  HostUser *h = (HostUser *)user;
  kiln_spec specs[2] = {{KILN_F32, 1, {3}}, {KILN_F32, 0, {}}};
  kiln_tensor *r[2];
  if (kiln_host_call(h->fn, &h->k, 1, in, 2, specs, r)) return -1;
  out[0] = kiln_add(r[0], r[1]);
  return out[0] ? 0 : -1;
}

TEST(HostCall, EagerAndStagedRunTheCallbackEachCall) {
  Scoped s;
  HostUser h = {host_scale, 2.0};
  kiln_tensor *x = f32({1, 2, 3}), *out = nullptr, *r[2];
  kiln_spec specs[2] = {{KILN_F32, 1, {3}}, {KILN_F32, 0, {}}};
  host_calls = 0;
  ASSERT_EQ(kiln_host_call(host_scale, &h.k, 1, &x, 2, specs, r), 0) << kiln_last_error();
  EXPECT_EQ(values(r[0]), (VD{2, 4, 6}));
  EXPECT_EQ(kiln_tensor_item(r[1]), 6);
  kiln_function *f = kiln_function_new("with_host", with_host, &h, 1, 1);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{8, 10, 12}));
  int after_first = host_calls;
  EXPECT_EQ(after_first, 2); // once eagerly, once by the staged call (tracing runs no callback)
  h.k = 3; // read through user at each call
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{9, 12, 15}));
  EXPECT_EQ(host_calls, 3);
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("= host_call @"));
  EXPECT_THAT(ir, HasSubstr(": f32[3], f32[]"));
  ir_module *m = ir_parse(ir, "host.kir"); // round trip (the callback is not bound by name here)
  ASSERT_NE(m, nullptr) << kiln_last_error();
  char *again = ir_print_module(m);
  EXPECT_STREQ(again, ir);
  free(again);
  ir_module_free(m);
  free(ir);
  kiln_function_free(f);
}

TEST(HostCall, WrongOutputsFailAndTheFunctionStillWorks) {
  Scoped s;
  HostUser h = {host_wrong_shape, 1.0};
  kiln_tensor *x = f32({1, 2, 3}), *out = nullptr, *r[2];
  kiln_spec specs[2] = {{KILN_F32, 1, {3}}, {KILN_F32, 0, {}}};
  EXPECT_EQ(kiln_host_call(host_wrong_shape, nullptr, 1, &x, 2, specs, r), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("host_call: the callback returned f32[6] for output 0, the spec says f32[3]"));
  kiln_function *f = kiln_function_new("bad_host", with_host, &h, 1, 1);
  EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("host_call: @"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("returned f32[6] for output 0, declared f32[3]"));
  kiln_function_free(f);
  // a callback that fails once: the staged function works again afterwards
  HostUser flaky = {host_flaky, 2.0};
  flaky_fail = true;
  f = kiln_function_new("flaky", with_host, &flaky, 1, 1);
  EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("flaky: asked to fail"));
  flaky_fail = false;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{8, 10, 12}));
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
  // bad arguments
  EXPECT_EQ(kiln_host_call(nullptr, nullptr, 1, &x, 2, specs, r), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("host_call: fn is NULL"));
  EXPECT_EQ(kiln_host_call(host_scale, &h.k, 1, &x, 0, specs, r), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("host_call: needs n_out >= 1"));
  kiln_spec bad[2] = {{KILN_F32, 9, {}}, {KILN_F32, 0, {}}};
  EXPECT_EQ(kiln_host_call(host_scale, &h.k, 1, &x, 2, bad, r), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("host_call: out_specs[0] has rank 9"));
}

// ---- gradients through staged calls ----
std::atomic<int> cube_runs{0};
int cube_sum(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  cube_runs++;
  out[0] = kiln_mul(kiln_mul(in[0], in[0]), kiln_mul(in[0], in[1]));  // x^3 * y
  return out[0] ? 0 : -1;
}

TEST(Gradients, TapeThroughAStagedCallMatchesEager) {
  Scoped s;
  kiln_function *f = kiln_function_new("cube", cube_sum, nullptr, 2, 1);
  cube_runs = 0;
  for (int rep = 0; rep < 2; rep++) {
    kiln_tensor *in[2] = {f64({1, 2, -3}), f64({0.5, 1, 2})}, *out = nullptr, *g[2];
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, in[0]);
    kiln_tape_watch(tape, in[1]);
    ASSERT_EQ(kiln_function_call(f, in, &out), 0) << kiln_last_error();
    kiln_tape_end(tape);
    ASSERT_EQ(kiln_tape_gradient(tape, out, 2, in, g), 0) << kiln_last_error();
    kiln_tape_free(tape);
    EXPECT_EQ(values(out), (VD{0.5, 8, -54}));
    EXPECT_EQ(values(g[0]), (VD{1.5, 12, 54}));   // 3 x^2 y
    EXPECT_EQ(values(g[1]), (VD{1, 8, -27}));     // x^3
  }
  // one trace of the body made the forward (with residuals) and backward
  // traces, reused by the second taped call; an untaped call traces anew
  EXPECT_EQ(cube_runs, 1);
  kiln_tensor *in[2] = {f64({1, 2, -3}), f64({0.5, 1, 2})}, *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, in, &out), 0);
  EXPECT_EQ(cube_runs, 2);
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

int net(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *h = kiln_tanh(kiln_matmul(in[0], in[1]));
  out[0] = kiln_add(kiln_exp(kiln_mul(h, h)), in[0]);  // reads x again: a residual and a direct path
  out[1] = kiln_argmax(h, 1);                             // an integer output: no tape node
  out[2] = in[1];                                         // an input handed back
  return out[0] && out[1] ? 0 : -1;
}

TEST(Gradients, StagedCallWithSeveralOutputsMatchesEager) {
  Scoped s;
  kiln_function *f = kiln_function_new("net", net, nullptr, 2, 3);
  kiln_tensor *x = f64({2, 2}, {0.1, -0.2, 0.3, 0.4}), *w = f64({2, 2}, {0.5, -1, 2, 0.25});
  kiln_tensor *in[2] = {x, w};
  auto grads = [&](bool staged, kiln_tensor **g) {
    kiln_function_set_eager(f, !staged);
    kiln_tensor *out[3];
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tape_watch(tape, w);
    ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
    // a target mixing outputs 0 and 2
    kiln_tensor *t = kiln_add(kiln_reduce_sum(out[0], 0, nullptr, false),
                              kiln_reduce_sum(kiln_mul(out[2], out[2]), 0, nullptr, false));
    kiln_tape_end(tape);
    ASSERT_EQ(kiln_tape_gradient(tape, t, 2, in, g), 0) << kiln_last_error();
    kiln_tape_free(tape);
  };
  kiln_tensor *ge[2], *gs[2];
  grads(false, ge);
  grads(true, gs);
  ASSERT_TRUE(ge[0] && ge[1] && gs[0] && gs[1]);
  for (int i = 0; i < 2; i++) {
    VD a = values(ge[i]), b = values(gs[i]);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); k++) EXPECT_NEAR(a[k], b[k], 1e-12) << i << " " << k;
  }
  kiln_function_free(f);
}

TEST(Gradients, SecondOrderThroughAStagedCall) {
  Scoped s;
  kiln_function *f = kiln_function_new("cube", cube_sum, nullptr, 2, 1);
  kiln_tensor *in[2] = {f64({2}), f64({1})}, *out = nullptr, *g = nullptr, *gg = nullptr;
  kiln_tape *t1 = kiln_tape_begin(false);
  kiln_tape_watch(t1, in[0]);
  kiln_tape *t2 = kiln_tape_begin(false);
  kiln_tape_watch(t2, in[0]);
  ASSERT_EQ(kiln_function_call(f, in, &out), 0) << kiln_last_error();
  kiln_tape_end(t2);
  ASSERT_EQ(kiln_tape_gradient(t2, out, 1, in, &g), 0) << kiln_last_error();
  kiln_tape_end(t1);
  ASSERT_EQ(kiln_tape_gradient(t1, g, 1, in, &gg), 0) << kiln_last_error();
  EXPECT_EQ(values(g), (VD{12}));  // 3 x^2
  EXPECT_EQ(values(gg), (VD{12})); // 6 x
  kiln_tape_free(t2);
  kiln_tape_free(t1);
  kiln_function_free(f);
}

double cube_fd(double x, double y) { return x * x * x * y; }

TEST(Gradients, KilnGradientsToSecondOrder) {
  Scoped s;
  kiln_function *f = kiln_function_new("cube", cube_sum, nullptr, 2, 1);
  kiln_function *g = kiln_gradients(f);
  kiln_function *vg = kiln_value_and_gradients(f);
  kiln_function *gg = kiln_gradients(g);
  ASSERT_TRUE(g && vg && gg) << kiln_last_error();
  kiln_tensor *in[2] = {f64({1, -2}), f64({3, 0.5})}, *o[3];
  ASSERT_EQ(kiln_function_call(g, in, o), 0) << kiln_last_error();
  EXPECT_EQ(values(o[0]), (VD{9, 6}));  // 3 x^2 y
  EXPECT_EQ(values(o[1]), (VD{1, -8})); // x^3
  // against central differences
  for (int i = 0; i < 2; i++) {
    double x = i ? -2 : 1, y = i ? 0.5 : 3, h = 1e-5;
    EXPECT_NEAR(values(o[0])[i], (cube_fd(x + h, y) - cube_fd(x - h, y)) / (2 * h), 1e-6);
  }
  ASSERT_EQ(kiln_function_call(vg, in, o), 0) << kiln_last_error();
  EXPECT_EQ(values(o[0]), (VD{3, -4}));
  EXPECT_EQ(values(o[1]), (VD{9, 6}));
  ASSERT_EQ(kiln_function_call(gg, in, o), 0) << kiln_last_error();
  EXPECT_EQ(values(o[0]), (VD{18, -6}));  // d/dx sum(3x^2 y) = 6 x y
  EXPECT_EQ(values(o[1]), (VD{3, 12}));   // d/dy sum(3x^2 y) = 3 x^2
  EXPECT_EQ(kiln_function_trace_count(gg), 1);
  EXPECT_EQ(kiln_gradients(nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("gradients: function is NULL"));
  kiln_function_free(gg);
  kiln_function_free(vg);
  kiln_function_free(g);
  kiln_function_free(f);
}

// ---- a staged training step: tape, gradient and update in one trace ----
struct Model {
  kiln_variable *w, *b;
  double lr;
};
int train_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Model *m = (Model *)user;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *pred = kiln_add(kiln_mul(in[0], kiln_variable_read(m->w)), kiln_variable_read(m->b));
  kiln_tensor *d = kiln_sub(pred, in[1]);
  kiln_tensor *loss = kiln_reduce_mean(kiln_mul(d, d), 0, nullptr, false);
  kiln_tape_end(tape);
  kiln_variable *vars[2] = {m->w, m->b};
  kiln_tensor *g[2];
  int rc = kiln_tape_gradient_vars(tape, loss, 2, vars, g);
  kiln_tape_free(tape);
  if (rc) return -1;
  kiln_tensor *lr = kiln_scalar(KILN_F32, m->lr);
  if (kiln_variable_assign_sub(m->w, kiln_mul(lr, g[0])) || kiln_variable_assign_sub(m->b, kiln_mul(lr, g[1])))
    return -1;
  out[0] = loss;
  return 0;
}

TEST(Training, StagedLinearRegressionTracesOnceAndMatchesEager) {
  Scoped s;
  Owned own;
  kiln_random_seed(3);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(1000));
  kiln_tensor *noise = kiln_random_normal(KILN_F32, KILN_SHAPE(1000));
  kiln_tensor *y = kiln_add(kiln_add(kiln_mul(x, kiln_scalar(KILN_F32, 3)), kiln_scalar(KILN_F32, 2)), noise);
  Model staged = {own.var(kiln_scalar(KILN_F32, 5), "W"), own.var(kiln_scalar(KILN_F32, 10), "B"), 0.01};
  Model eager = {own.var(kiln_scalar(KILN_F32, 5), "W2"), own.var(kiln_scalar(KILN_F32, 10), "B2"), 0.01};
  kiln_function *step = kiln_function_new("step", train_step, &staged, 2, 1);
  kiln_tensor *in[2] = {x, y};
  for (int i = 0; i < 200; i++) {
    kiln_scope_push();
    kiln_tensor *l1 = nullptr, *l2 = nullptr;
    ASSERT_EQ(kiln_function_call(step, in, &l1), 0) << kiln_last_error();
    ASSERT_EQ(train_step(&eager, 2, in, 1, &l2), 0) << kiln_last_error();
    ASSERT_NEAR(kiln_tensor_item(l1), kiln_tensor_item(l2), 1e-4 * kiln_tensor_item(l2)) << "step " << i;
    kiln_scope_pop();
  }
  EXPECT_EQ(kiln_function_trace_count(step), 1);
  double w = kiln_tensor_item(kiln_variable_read(staged.w)), b = kiln_tensor_item(kiln_variable_read(staged.b));
  EXPECT_NEAR(w, kiln_tensor_item(kiln_variable_read(eager.w)), 1e-4);
  EXPECT_NEAR(b, kiln_tensor_item(kiln_variable_read(eager.b)), 1e-4);
  EXPECT_NEAR(w, 3, 0.1);
  EXPECT_NEAR(b, 2, 0.3);
  char *ir = kiln_function_ir(step, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("%W: f32[]"));
  EXPECT_THAT(ir, HasSubstr("-> (f32[], f32[], f32[])")); // loss, new W, new B
  free(ir);
  kiln_function_free(step);
}

}  // namespace
