// host_grad_test.cc — kiln_host_call under tapes: kiln_host_call_with_gradient
// gives a host callback a gradient (a second callback computing the VJP),
// eagerly, staged (kiln_gradients, compiled and interpreted) and under a tape
// over a staged call, checked against finite differences; a plain
// kiln_host_call whose gradient a tape needs fails naming the callback
// instead of returning zeros.
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::Not;

namespace {

using namespace kiln_test;

std::atomic<int> fn_runs{0}, grad_runs{0};

kiln_tensor *like(const kiln_tensor *t, const std::vector<double> &v) {
  return kiln_tensor_new(KILN_F64, kiln_tensor_rank(t), kiln_tensor_shape(t), v.data());
}

// (x, z, k) -> (k x^2, x z), on raw f64 data (opaque to the tapes); k is an i32 scalar.
int square_times(void *, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  fn_runs++;
  if (n_in != 3 || n_out != 2) return kiln_fail("square_times: wrong arity");
  std::vector<double> x = read<double>(in[0]), z = read<double>(in[1]), a(x.size()), b(x.size());
  int32_t k = read<int32_t>(in[2])[0];
  for (size_t i = 0; i < x.size(); i++) a[i] = k * x[i] * x[i], b[i] = x[i] * z[i];
  out[0] = like(in[0], a);
  out[1] = like(in[0], b);
  return out[0] && out[1] ? 0 : -1;
}

// dx = dy0 2 k x + dy1 z, dz = dy1 x, dk = none
int square_times_grad(void *, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor *const *out,
                      kiln_tensor *const *dout, kiln_tensor **din) {
  grad_runs++;
  if (n_in != 3 || n_out != 2 || !out[0] || !out[1]) return kiln_fail("square_times_grad: wrong arity");
  std::vector<double> x = read<double>(in[0]), z = read<double>(in[1]);
  std::vector<double> d0 = read<double>(dout[0]), d1 = read<double>(dout[1]), dx(x.size()), dz(x.size());
  int32_t k = read<int32_t>(in[2])[0];
  for (size_t i = 0; i < x.size(); i++) dx[i] = d0[i] * 2 * k * x[i] + d1[i] * z[i], dz[i] = d1[i] * x[i];
  din[0] = like(in[0], dx);
  din[1] = like(in[1], dz);
  din[2] = nullptr;
  return din[0] && din[1] ? 0 : -1;
}

// a gradient that only knows about x (dz left NULL: zeros)
int square_times_grad_x_only(void *u, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor *const *out,
                             kiln_tensor *const *dout, kiln_tensor **din) {
  int rc = square_times_grad(u, n_in, in, n_out, out, dout, din);
  din[1] = nullptr;
  return rc;
}

int failing_grad(void *, int, kiln_tensor *const *, int, kiln_tensor *const *, kiln_tensor *const *, kiln_tensor **) {
  return kiln_fail("failing_grad: no gradient today");
}

const kiln_spec kSpecs[2] = {{KILN_F64, 1, {3}}, {KILN_F64, 1, {3}}};

struct Call {
  kiln_host_grad_fn grad;  // NULL: a plain kiln_host_call
  double w1;               // target = sum(y0) + w1 * sum(y1)
};

// sum(y0) + w1 sum(y1) of the host call on (x, z, k = 3)
kiln_tensor *target(const Call &c, kiln_tensor *x, kiln_tensor *z) {
  kiln_tensor *in[3] = {x, z, kiln_scalar(KILN_I32, 3)}, *y[2] = {nullptr, nullptr};
  int rc = c.grad ? kiln_host_call_with_gradient(square_times, c.grad, nullptr, 3, in, 2, kSpecs, y)
                  : kiln_host_call(square_times, nullptr, 3, in, 2, kSpecs, y);
  if (rc) return nullptr;
  return kiln_add(kiln_reduce_sum(y[0], 0, nullptr, false),
                  kiln_mul(kiln_scalar(KILN_F64, c.w1), kiln_reduce_sum(y[1], 0, nullptr, false)));
}

// The exact gradient of target: d/dx = 2 k x + w1 z, d/dz = w1 x (k = 3).
void exact(const Call &c, const VD &x, const VD &z, VD *dx, VD *dz) {
  dx->resize(x.size());
  dz->resize(x.size());
  for (size_t i = 0; i < x.size(); i++) (*dx)[i] = 6 * x[i] + c.w1 * z[i], (*dz)[i] = c.w1 * x[i];
}

double eval(const Call &c, const VD &x, const VD &z) {
  kiln_scope_push();
  double v = kiln_tensor_item(target(c, f64(x), f64(z)));
  kiln_scope_pop();
  return v;
}

// central differences of target w.r.t. x (which = 0) or z (1)
VD finite_differences(const Call &c, const VD &x, const VD &z, int which) {
  VD g(x.size());
  const double h = 1e-6;
  for (size_t i = 0; i < x.size(); i++) {
    VD xp = x, xm = x, zp = z, zm = z;
    (which ? zp : xp)[i] += h;
    (which ? zm : xm)[i] -= h;
    g[i] = (eval(c, xp, zp) - eval(c, xm, zm)) / (2 * h);
  }
  return g;
}

void expect_near(const VD &got, const VD &want, double tol, const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); i++) EXPECT_NEAR(got[i], want[i], tol) << what << " element " << i;
}

// How the library names a callback: @symbol where the process has one, else its address.
std::string label(void *p) {
  Dl_info info;
  if (dladdr(p, &info) && info.dli_sname && info.dli_saddr == p) return std::string("@") + info.dli_sname;
  char buf[64];
  snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

const VD kX = {0.5, -1.25, 2.0}, kZ = {1.5, 0.25, -0.75};

TEST(HostGrad, EagerTapeMatchesExactAndFiniteDifferences) {
  Scoped s;
  for (double w1 : {0.0, 2.0}) {
    Call c = {square_times_grad, w1};
    kiln_tensor *x = f64(kX), *z = f64(kZ);
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tape_watch(tape, z);
    kiln_tensor *t = target(c, x, z);
    ASSERT_NE(t, nullptr) << kiln_last_error();
    kiln_tape_end(tape);
    kiln_tensor *src[2] = {x, z}, *g[2] = {nullptr, nullptr};
    grad_runs = 0;
    ASSERT_EQ(kiln_tape_gradient(tape, t, 2, src, g), 0) << kiln_last_error();
    kiln_tape_free(tape);
    // one call per output whose cotangent the target reaches (y1's is 0 * ones when w1 = 0)
    EXPECT_EQ(grad_runs, 2);
    VD dx, dz;
    exact(c, kX, kZ, &dx, &dz);
    expect_near(values(g[0]), dx, 1e-12, "dx");
    expect_near(values(g[1]), dz, 1e-12, "dz");
    expect_near(values(g[0]), finite_differences(c, kX, kZ, 0), 1e-6, "dx vs finite differences");
    expect_near(values(g[1]), finite_differences(c, kX, kZ, 1), 1e-6, "dz vs finite differences");
  }
  // a NULL din is zeros
  Call c = {square_times_grad_x_only, 1.0};
  kiln_tensor *x = f64(kX), *z = f64(kZ), *src[2] = {x, z}, *g[2];
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tape_watch(tape, z);
  kiln_tensor *t = target(c, x, z);
  ASSERT_EQ(kiln_tape_gradient(tape, t, 2, src, g), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(g[1]), (VD{0, 0, 0}));
}

TEST(HostGrad, PlainHostCallUnderATapeFailsNamingTheCallback) {
  Scoped s;
  Call c = {nullptr, 1.0};
  kiln_tensor *x = f64(kX), *z = f64(kZ);
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *t = target(c, x, z);
  ASSERT_NE(t, nullptr) << kiln_last_error();  // the forward runs
  EXPECT_EQ(values(t), (VD{eval(c, kX, kZ)}));
  kiln_tensor *g = nullptr;
  EXPECT_EQ(kiln_tape_gradient(tape, t, 1, &x, &g), -1);  // was: rc 0 and zeros
  EXPECT_EQ(g, nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("host_call"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("has no gradient"));
  EXPECT_THAT(kiln_last_error(), HasSubstr(label(reinterpret_cast<void *>(&square_times))));
  EXPECT_THAT(kiln_last_error(), HasSubstr("kiln_host_call_with_gradient"));
  // a source the host call does not reach still gets its gradient
  kiln_clear_error();
  kiln_tensor *other = f64({2.0}), *u = kiln_mul(other, other), *gu = nullptr;
  kiln_tape_watch(tape, other);
  u = kiln_mul(other, other);
  ASSERT_EQ(kiln_tape_gradient(tape, kiln_add(u, kiln_stop_gradient(t)), 1, &other, &gu), 0) << kiln_last_error();
  EXPECT_EQ(values(gu), (VD{4}));
  kiln_tape_free(tape);
  // inputs no tape watches: nothing recorded, nothing fails
  kiln_tape *t2 = kiln_tape_begin(false);
  kiln_tensor *w = f64({1.0});
  kiln_tape_watch(t2, w);
  kiln_tensor *y = kiln_add(kiln_mul(w, w), target(c, x, z)), *gw = nullptr;
  ASSERT_EQ(kiln_tape_gradient(t2, y, 1, &w, &gw), 0) << kiln_last_error();
  EXPECT_EQ(values(gw), (VD{2}));
  kiln_tape_free(t2);
}

TEST(HostGrad, GradientCallbackErrorsReachTheCaller) {
  Scoped s;
  Call c = {failing_grad, 1.0};
  kiln_tensor *x = f64(kX), *z = f64(kZ), *g = nullptr;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *t = target(c, x, z);
  EXPECT_EQ(kiln_tape_gradient(tape, t, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("failing_grad: no gradient today"));
  kiln_tape_free(tape);
  kiln_clear_error();
  kiln_tensor *in[3] = {x, z, kiln_scalar(KILN_I32, 3)}, *y[2];
  EXPECT_EQ(kiln_host_call_with_gradient(square_times, nullptr, nullptr, 3, in, 2, kSpecs, y), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("host_call: grad is NULL"));
  EXPECT_EQ(kiln_host_call_with_gradient(nullptr, square_times_grad, nullptr, 3, in, 2, kSpecs, y), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("host_call: fn is NULL"));
}

// The gradient's own gradient: a tape differentiating it again fails naming grad.
TEST(HostGrad, SecondOrderFailsNamingTheGradientCallback) {
  Scoped s;
  Call c = {square_times_grad, 1.0};
  kiln_tensor *x = f64(kX), *z = f64(kZ), *g = nullptr, *gg = nullptr;
  kiln_tape *outer = kiln_tape_begin(false), *inner = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape_watch(inner, x);
  kiln_tensor *t = target(c, x, z);
  kiln_tape_end(inner);
  ASSERT_EQ(kiln_tape_gradient(inner, t, 1, &x, &g), 0) << kiln_last_error();
  kiln_tape_end(outer);
  VD dx, dz;
  exact(c, kX, kZ, &dx, &dz);
  expect_near(values(g), dx, 1e-12, "first derivative");
  EXPECT_EQ(kiln_tape_gradient(outer, g, 1, &x, &gg), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("the gradient callback"));
  EXPECT_THAT(kiln_last_error(), HasSubstr(label(reinterpret_cast<void *>(&square_times_grad))));
  kiln_tape_free(inner);
  kiln_tape_free(outer);
}

// ---- staged ----

// KILN_BACKEND for the traces compiled while it lives
struct BackendEnv : EnvGuard {
  explicit BackendEnv(const char *v) : EnvGuard("KILN_BACKEND", v) {}
};

int target_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = target(*static_cast<const Call *>(user), in[0], in[1]);
  return out[0] ? 0 : -1;
}

TEST(HostGrad, StagedGradientsCallTheGradientCallback) {
  Scoped s;
  for (const char *backend : {"cpu", "interp"}) {
    SCOPED_TRACE(backend);
    BackendEnv env(backend);
    Call c = {square_times_grad, 2.0};
    kiln_function *f = kiln_function_new("host_target", target_body, &c, 2, 1);
    kiln_function *df = kiln_gradients(f);
    ASSERT_NE(df, nullptr) << kiln_last_error();
    VD dx, dz;
    for (int call = 0; call < 3; call++) {  // the compiled backward calls grad each time
      VD x = kX, z = kZ;
      for (double &v : x) v += call;
      exact(c, x, z, &dx, &dz);
      kiln_tensor *in[2] = {f64(x), f64(z)}, *g[2] = {nullptr, nullptr};
      fn_runs = grad_runs = 0;
      ASSERT_EQ(kiln_function_call(df, in, g), 0) << kiln_last_error();
      EXPECT_EQ(fn_runs, 1);
      EXPECT_EQ(grad_runs, 2);
      expect_near(values(g[0]), dx, 1e-12, "dx");
      expect_near(values(g[1]), dz, 1e-12, "dz");
      expect_near(values(g[0]), finite_differences(c, x, z, 0), 1e-6, "dx vs finite differences");
    }
    EXPECT_EQ(kiln_function_trace_count(df), 1);
    char *ir = kiln_function_ir(df, 0, "traced");
    ASSERT_NE(ir, nullptr) << kiln_last_error();
    std::string text(ir);
    free(ir);
    size_t calls = 0;
    for (size_t at = text.find("host_call"); at != std::string::npos; at = text.find("host_call", at + 1)) calls++;
    EXPECT_EQ(calls, 3u) << text;  // the forward and one gradient per output
    // a tape over the staged call (the backward is a staged trace too)
    kiln_tensor *x = f64(kX), *z = f64(kZ), *in[2] = {x, z}, *y = nullptr;
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tape_watch(tape, z);
    ASSERT_EQ(kiln_function_call(f, in, &y), 0) << kiln_last_error();
    kiln_tensor *g[2] = {nullptr, nullptr};
    ASSERT_EQ(kiln_tape_gradient(tape, y, 2, in, g), 0) << kiln_last_error();
    kiln_tape_free(tape);
    exact(c, kX, kZ, &dx, &dz);
    expect_near(values(g[0]), dx, 1e-12, "dx through a tape");
    expect_near(values(g[1]), dz, 1e-12, "dz through a tape");
    kiln_function_free(df);
    kiln_function_free(f);
  }
}

TEST(HostGrad, StagedGradientOfAPlainHostCallFails) {
  Scoped s;
  for (const char *backend : {"cpu", "interp"}) {
    SCOPED_TRACE(backend);
    BackendEnv env(backend);
    Call c = {nullptr, 1.0};
    kiln_function *f = kiln_function_new("plain_host", target_body, &c, 2, 1);
    kiln_function *df = kiln_gradients(f);
    kiln_tensor *in[2] = {f64(kX), f64(kZ)}, *g[2] = {nullptr, nullptr}, *y = nullptr;
    EXPECT_EQ(kiln_function_call(df, in, g), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("has no gradient"));
    EXPECT_THAT(kiln_last_error(), HasSubstr(label(reinterpret_cast<void *>(&square_times))));
    EXPECT_THAT(kiln_last_error(), Not(HasSubstr("left output")));
    // the forward alone still works
    kiln_clear_error();
    ASSERT_EQ(kiln_function_call(f, in, &y), 0) << kiln_last_error();
    EXPECT_NEAR(kiln_tensor_item(y), eval(c, kX, kZ), 1e-12);
    kiln_function_free(df);
    kiln_function_free(f);
  }
}

}  // namespace
