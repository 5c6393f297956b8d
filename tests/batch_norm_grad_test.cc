// batch_norm_grad_test.cc — batch_norm as one tape node (lib/composite.c):
// its hand-written backward (bn_gradient, which recomputes x - mean and
// rsqrt instead of keeping the op-by-op intermediates): first derivatives
// of every input in every form (offset and scale given or not, per-channel
// and full-shape statistics) and second derivatives through nested tapes,
// against central differences in f64; eager against staged. And its eager
// passes (lib/bn_eager.c): the one-pass forward bit for bit the four
// elementwise ops, the fused backward against the staged ops.
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <functional>
#include <random>
#include <vector>

#include "test_util.h"

using namespace kiln_test;

namespace {

using Fn = std::function<kiln_tensor *(const std::vector<kiln_tensor *> &)>;

kiln_tensor *random_f64(const V64 &shape, std::mt19937_64 &rng, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<double> v((size_t)n);
  for (double &x : v) x = u(rng);
  return f64(shape, v);
}

double scalar_of(kiln_tensor *t) { return values(t)[0]; }

// sum(f(in) * w): a loss whose gradient reaches every output element differently
kiln_tensor *loss(const Fn &f, const std::vector<kiln_tensor *> &in, kiln_tensor *w) {
  kiln_tensor *y = f(in);
  return y ? kiln_reduce_sum(kiln_mul(y, w), 0, nullptr, false) : nullptr;
}

// d loss / d in[i] by the tape, and by central differences
void check_first(const Fn &f, std::vector<kiln_tensor *> in, kiln_tensor *w, const char *what) {
  kiln_tape *tape = kiln_tape_begin(false);
  for (auto *t : in) kiln_tape_watch(tape, t);
  kiln_tensor *l = loss(f, in, w);
  ASSERT_NE(l, nullptr) << what << ": " << kiln_last_error();
  std::vector<kiln_tensor *> g(in.size());
  ASSERT_EQ(kiln_tape_gradient(tape, l, (int)in.size(), in.data(), g.data()), 0) << what << ": " << kiln_last_error();
  kiln_tape_free(tape);
  const double h = 1e-6;
  for (size_t i = 0; i < in.size(); i++) {
    ASSERT_NE(g[i], nullptr) << what << " input " << i;
    VD base = values(in[i]), got = values(g[i]);
    for (size_t k = 0; k < base.size(); k++) {
      kiln_scope_push();
      VD p = base, m = base;
      p[k] += h, m[k] -= h;
      std::vector<kiln_tensor *> ip = in, im = in;
      ip[i] = from_values(KILN_F64, shape_of(in[i]), p);
      im[i] = from_values(KILN_F64, shape_of(in[i]), m);
      double want = (scalar_of(loss(f, ip, w)) - scalar_of(loss(f, im, w))) / (2 * h);
      EXPECT_NEAR(got[k], want, 1e-6 * (1 + std::fabs(want))) << what << " input " << i << " element " << k;
      kiln_scope_pop();
    }
  }
}

// u . d loss/dx as a function of x (the inner tape's gradient)
double directional(const Fn &f, const std::vector<kiln_tensor *> &in, kiln_tensor *w, kiln_tensor *u,
                   kiln_tensor **grad_of_it) {
  kiln_tape *outer = grad_of_it ? kiln_tape_begin(false) : nullptr;
  if (outer) kiln_tape_watch(outer, in[0]);
  kiln_tape *inner = kiln_tape_begin(false);
  kiln_tape_watch(inner, in[0]);
  kiln_tensor *l = loss(f, in, w), *g = nullptr;
  EXPECT_EQ(kiln_tape_gradient(inner, l, 1, &in[0], &g), 0) << kiln_last_error();
  kiln_tape_free(inner);
  kiln_tensor *s = kiln_reduce_sum(kiln_mul(g, u), 0, nullptr, false);
  if (outer) {
    EXPECT_EQ(kiln_tape_gradient(outer, s, 1, &in[0], grad_of_it), 0) << kiln_last_error();
    kiln_tape_free(outer);
  }
  return scalar_of(s);
}

kiln_tensor *bn_of_moments(const std::vector<kiln_tensor *> &in) {
  kiln_tensor *m = nullptr, *v = nullptr;
  if (kiln_moments(in[0], 3, (const int[]){0, 1, 2}, false, &m, &v)) return nullptr;
  return kiln_batch_norm(in[0], m, v, in.size() > 1 ? in[1] : nullptr, in.size() > 2 ? in[2] : nullptr, 1e-3);
}

}  // namespace

TEST(BatchNormGrad, EveryInputInEveryFormMatchesCentralDifferences) {
  Scoped s;
  std::mt19937_64 rng(21);
  const V64 xs = {2, 3, 2, 3};
  kiln_tensor *w = random_f64(xs, rng, -1, 1);
  for (int form = 0; form < 4; form++) {
    bool off = form & 1, sc = form & 2;
    kiln_scope_push();
    std::vector<kiln_tensor *> in = {random_f64(xs, rng, -2, 2), random_f64({3}, rng, -1, 1),
                                     random_f64({3}, rng, 0.5, 2)};
    if (off) in.push_back(random_f64({3}, rng, -1, 1));
    if (sc) in.push_back(random_f64({1, 1, 1, 3}, rng, -2, 2));
    Fn f = [off, sc](const std::vector<kiln_tensor *> &v) {
      return kiln_batch_norm(v[0], v[1], v[2], off ? v[3] : nullptr, sc ? v[3 + off] : nullptr, 1e-2);
    };
    std::string what = std::string("batch_norm offset ") + (off ? "yes" : "no") + " scale " + (sc ? "yes" : "no");
    check_first(f, in, w, what.c_str());
    kiln_scope_pop();
  }
  // statistics of x's own shape broadcast nothing
  std::vector<kiln_tensor *> in = {random_f64(xs, rng, -2, 2), random_f64(xs, rng, -1, 1), random_f64(xs, rng, 0.5, 2)};
  check_first([](const std::vector<kiln_tensor *> &v) { return kiln_batch_norm(v[0], v[1], v[2], nullptr, nullptr, 0); },
              in, w, "full-shape statistics");
  // the training form: moments of the batch, offset and scale
  check_first(bn_of_moments, {random_f64(xs, rng, -2, 2), random_f64({3}, rng, -1, 1), random_f64({3}, rng, -2, 2)}, w,
              "batch_norm of the batch's moments");
}

TEST(BatchNormGrad, SecondDerivativesThroughNestedTapes) {
  Scoped s;
  std::mt19937_64 rng(22);
  const V64 xs = {2, 2, 2, 3};
  kiln_tensor *w = random_f64(xs, rng, -1, 1), *u = random_f64(xs, rng, -1, 1);
  std::vector<kiln_tensor *> in = {random_f64(xs, rng, -2, 2), random_f64({3}, rng, -1, 1),
                                   random_f64({3}, rng, -2, 2)};
  kiln_tensor *hess_u = nullptr;  // d/dx of u . dL/dx
  directional(bn_of_moments, in, w, u, &hess_u);
  ASSERT_NE(hess_u, nullptr) << kiln_last_error();
  VD base = values(in[0]), got = values(hess_u);
  const double h = 1e-5;
  for (size_t k = 0; k < base.size(); k++) {
    kiln_scope_push();
    VD p = base, m = base;
    p[k] += h, m[k] -= h;
    std::vector<kiln_tensor *> ip = in, im = in;
    ip[0] = from_values(KILN_F64, xs, p);
    im[0] = from_values(KILN_F64, xs, m);
    double want = (directional(bn_of_moments, ip, w, u, nullptr) - directional(bn_of_moments, im, w, u, nullptr)) /
                  (2 * h);
    EXPECT_NEAR(got[k], want, 1e-5 * (1 + std::fabs(want))) << "element " << k;
    kiln_scope_pop();
  }
}

namespace {

int bn_grad_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tape *t = kiln_tape_begin(false);
  for (int i = 0; i < 3; i++) kiln_tape_watch(t, in[i]);
  kiln_tensor *l = loss(bn_of_moments, {in[0], in[1], in[2]}, in[3]);
  int rc = l ? kiln_tape_gradient(t, l, 3, in, out) : -1;
  kiln_tape_free(t);
  return rc;
}

}  // namespace

TEST(BatchNormGrad, StagedEqualsEager) {
  Scoped s;
  std::mt19937_64 rng(23);
  kiln_tensor *in[4] = {random_f64({4, 5, 5, 8}, rng, -2, 2), random_f64({8}, rng, -1, 1),
                        random_f64({8}, rng, -2, 2), random_f64({4, 5, 5, 8}, rng, -1, 1)};
  kiln_tensor *want[3] = {}, *got[3] = {};
  ASSERT_EQ(bn_grad_body(nullptr, 4, in, 3, want), 0) << kiln_last_error();
  kiln_function *f = kiln_function_new("bn_grads", bn_grad_body, nullptr, 4, 3);
  ASSERT_EQ(kiln_function_call(f, in, got), 0) << kiln_last_error();
  for (int i = 0; i < 3; i++) EXPECT_TRUE(allclose(got[i], want[i], 1e-12, 1e-12)) << "gradient " << i;
  kiln_function_free(f);
}

namespace {

// the op-by-op definition, each op rounded on its own
kiln_tensor *by_ops(kiln_tensor *x, kiln_tensor *m, kiln_tensor *v, kiln_tensor *o, kiln_tensor *sc, double eps) {
  kiln_tensor *y = kiln_mul(kiln_sub(x, m), kiln_rsqrt(kiln_add(v, kiln_scalar_like(v, eps))));
  if (sc) y = kiln_mul(y, sc);
  return o ? kiln_add(y, o) : y;
}

}  // namespace

// The eager backward's fused passes (lib/bn_eager.c: both sums in one pass
// over dy and x, moments' x gradient in one pass) against the staged
// gradient, which runs the public ops: shapes of one block of rows and of
// many (split over the threads), channels not a multiple of a vector, a
// [1,1,1,C] scale (the general path), f64 and f32 (whose blocks are added
// in f64).
TEST(BatchNormGrad, EagerFusedBackwardEqualsTheStagedOps) {
  Scoped s;
  std::mt19937_64 rng(25);
  const V64 shapes[] = {{2, 3, 3, 5}, {8, 17, 13, 40}, {3, 9, 7, 64}, {300, 1, 1, 3}};
  for (kiln_dtype dt : {KILN_F64, KILN_F32})
    for (const V64 &sh : shapes) {
      kiln_scope_push();
      V64 ch = {sh.back()}, ch4 = {1, 1, 1, sh.back()};
      kiln_tensor *in[4] = {random_f64(sh, rng, -2, 2), random_f64(ch, rng, -1, 1),
                            random_f64(sh[0] == 2 ? ch4 : ch, rng, -2, 2), random_f64(sh, rng, -1, 1)};
      for (kiln_tensor *&t : in) t = kiln_cast(t, dt);
      kiln_tensor *want[3] = {}, *got[3] = {};
      ASSERT_EQ(bn_grad_body(nullptr, 4, in, 3, got), 0) << kiln_last_error();
      kiln_function *f = kiln_function_new("bn_grads", bn_grad_body, nullptr, 4, 3);
      ASSERT_EQ(kiln_function_call(f, in, want), 0) << kiln_last_error();
      double tol = dt == KILN_F64 ? 1e-11 : 2e-4;
      for (int i = 0; i < 3; i++)
        EXPECT_TRUE(allclose(got[i], want[i], tol, tol))
            << kiln_dtype_name(dt) << " shape of " << sh.size() << " dims, last " << sh.back() << ", gradient " << i;
      kiln_function_free(f);
      kiln_scope_pop();
    }
}

TEST(BatchNormGrad, OnePassForwardEqualsTheOpsBitForBit) {
  Scoped s;
  std::mt19937_64 rng(24);
  struct Shape {
    V64 x, p;
  };
  // per-channel as [C] and [1,1,1,C], a scalar, full-shape (not one pass),
  // a row too short to split and one large enough for several threads
  const Shape shapes[] = {{{2, 3, 3, 5}, {5}}, {{2, 3, 3, 5}, {1, 1, 1, 5}}, {{2, 3, 3, 5}, {}},
                          {{2, 3, 3, 5}, {2, 3, 3, 5}}, {{7}, {7}}, {{64, 33, 17, 16}, {16}}};
  for (kiln_dtype dt : {KILN_F32, KILN_F64})
    for (const Shape &sh : shapes)
      for (int form = 0; form < 4; form++) {
        kiln_scope_push();
        kiln_tensor *x = kiln_random_normal(dt, (int)sh.x.size(), sh.x.data());
        kiln_tensor *m = kiln_random_normal(dt, (int)sh.p.size(), sh.p.data());
        kiln_tensor *v = kiln_abs(kiln_random_normal(dt, (int)sh.p.size(), sh.p.data()));
        kiln_tensor *o = form & 1 ? kiln_random_normal(dt, (int)sh.p.size(), sh.p.data()) : nullptr;
        kiln_tensor *sc = form & 2 ? kiln_random_normal(dt, (int)sh.p.size(), sh.p.data()) : nullptr;
        if (sh.x.size() == 4 && sh.x[3] == 5) {  // specials: NaN, infinities, a zero variance
          std::vector<double> xv = values(x);
          xv[0] = kNan, xv[1] = kInf, xv[2] = -kInf;
          // x - m = +0, times a negative scale: -0, which no offset must keep
          size_t at = sh.p.empty() ? 0 : 3;  // element 3's parameter (channel 3, or the scalar)
          xv[3] = values(m)[at];
          x = from_values(dt, sh.x, xv);
          if (sc) {
            std::vector<double> sv = values(sc);
            sv[at] = -std::fabs(sv[at]) - 0.5;
            sc = from_values(dt, sh.p, sv);
          }
          std::vector<double> vv = values(v);
          vv[0] = 0;
          v = from_values(dt, sh.p, vv);
        }
        kiln_tensor *got = kiln_batch_norm(x, m, v, o, sc, form == 3 ? 0.0 : 1e-3);
        kiln_tensor *want = by_ops(x, m, v, o, sc, form == 3 ? 0.0 : 1e-3);
        ASSERT_NE(got, nullptr) << kiln_last_error();
        EXPECT_TRUE(same_bits(got, want)) << kiln_dtype_name(dt) << " x " << sh.x.size() << "-d, params "
                                          << sh.p.size() << "-d, form " << form;
        kiln_scope_pop();
      }
}

namespace {

// moments and batch_norm on one tape (eagerly the linked node, lib/composite.c
// bn_link), with the loss reading the mean again when mode & 1; the
// gradients of x and the scale, then (mode & 2) of the mean and the variance
int linked_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int mode = *(const int *)user;
  bool also_mean = mode & 1;
  kiln_tape *t = kiln_tape_begin(false);
  kiln_tape_watch(t, in[0]);
  kiln_tape_watch(t, in[1]);
  kiln_tensor *mean = nullptr, *var = nullptr;
  static const int axes[3] = {0, 1, 2};
  int rc = kiln_moments(in[0], 3, axes, false, &mean, &var);
  kiln_tensor *y = rc ? nullptr : kiln_batch_norm(in[0], mean, var, nullptr, in[1], 1e-3);
  kiln_tensor *l = y ? kiln_reduce_sum(kiln_mul(y, in[2]), 0, nullptr, false) : nullptr;
  if (l && also_mean) l = kiln_add(l, kiln_reduce_sum(kiln_mul(mean, mean), 0, nullptr, false));
  kiln_tensor *src[4] = {in[0], in[1], mean, var};
  rc = l ? kiln_tape_gradient(t, l, mode & 2 ? 4 : 2, src, out) : -1;
  kiln_tape_free(t);
  return rc;
}

}  // namespace

// Eagerly, batch_norm of x's own moments is one linked node whose x
// gradient includes the paths through the mean and the variance. Alone, or
// with the mean read again by the loss, or asked for the mean's and the
// variance's own gradients too, the walk gives every gradient the staged
// function (op by op, never linked) gives.
TEST(BatchNormGrad, LinkedMomentsGiveEveryGradientAsTheStagedOps) {
  Scoped s;
  std::mt19937_64 rng(31);
  static const int modes[4] = {0, 1, 2, 3};
  for (const int &mode : modes)
    for (const V64 &sh : {V64{2, 3, 3, 5}, V64{4, 7, 9, 24}}) {
      kiln_scope_push();
      V64 ch = {sh.back()};
      kiln_tensor *in[3] = {random_f64(sh, rng, -2, 2), random_f64(ch, rng, -2, 2), random_f64(sh, rng, -1, 1)};
      void *user = (void *)&mode;
      int n = mode & 2 ? 4 : 2;
      kiln_tensor *got[4] = {}, *want[4] = {};
      ASSERT_EQ(linked_body(user, 3, in, n, got), 0) << kiln_last_error();
      kiln_function *f = kiln_function_new("linked", linked_body, user, 3, n);
      ASSERT_EQ(kiln_function_call(f, in, want), 0) << kiln_last_error();
      for (int i = 0; i < n; i++) {
        ASSERT_NE(got[i], nullptr) << "gradient " << i;
        EXPECT_TRUE(allclose(got[i], want[i], 1e-11, 1e-11)) << "gradient " << i << ", mode " << mode;
      }
      kiln_function_free(f);
      kiln_scope_pop();
    }
}

namespace {

// the gradient of sum(relu(x) * v) with respect to x: v where x > 0, else
// 0 (the tape seeds ones: the gradient into relu's output is v exactly);
// with nested, computed while an outer tape records
kiln_tensor *relu_grad_of(kiln_tensor *x, kiln_tensor *v, bool nested) {
  kiln_tape *outer = nested ? kiln_tape_begin(false) : nullptr;
  if (outer) kiln_tape_watch(outer, x);
  kiln_tape *t = kiln_tape_begin(false);
  kiln_tape_watch(t, x);
  kiln_tensor *y = kiln_mul(kiln_relu(x), v), *g = nullptr;
  EXPECT_EQ(kiln_tape_gradient(t, y, 1, &x, &g), 0) << kiln_last_error();
  kiln_tape_free(t);
  if (outer) kiln_tape_free(outer);
  return g;
}

int relu_grad_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = relu_grad_of(in[0], in[1], false);
  return out[0] ? 0 : -1;
}

}  // namespace

// relu's gradient in one eager pass (bn_eager.c, relu_eager_grad) has the
// bits of the public ops it replaces (greater, then select: what a
// recording tape still runs, and what the compiled function runs): NaN,
// -0, +0 and -inf in x give +0, dy's NaN and infinities pass where x > 0.
TEST(BatchNormGrad, ReluGradientInOnePassEqualsTheOpsBitForBit) {
  Scoped s;
  std::mt19937_64 rng(26);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    kiln_scope_push();
    const V64 sh = {3, 7, 5, 33};
    VD xv = values(random_f64(sh, rng, -2, 2)), vv = values(random_f64(sh, rng, -3, 3));
    const double special[] = {NAN, -0.0, 0.0, INFINITY, -INFINITY, 1e-310, -1e-310, 1.0};
    for (size_t k = 0; k < 64; k++) xv[k * 53 % xv.size()] = special[k % 8];
    for (size_t k = 0; k < 16; k++) vv[k * 97 % vv.size()] = k % 2 ? NAN : -INFINITY;
    kiln_tensor *in[2] = {from_values(dt, sh, xv), from_values(dt, sh, vv)};
    kiln_tensor *one_pass = relu_grad_of(in[0], in[1], false), *ops = relu_grad_of(in[0], in[1], true);
    ASSERT_NE(one_pass, nullptr);
    ASSERT_NE(ops, nullptr);
    EXPECT_TRUE(same_bits(one_pass, ops)) << kiln_dtype_name(dt);
    kiln_function *f = kiln_function_new("relu_grad", relu_grad_body, nullptr, 2, 1);
    kiln_tensor *staged = nullptr;
    ASSERT_EQ(kiln_function_call(f, in, &staged), 0) << kiln_last_error();
    EXPECT_TRUE(same_bits(one_pass, staged)) << kiln_dtype_name(dt);
    VD got = values(one_pass), xs = values(in[0]);  // as stored: f32 flushes 1e-310 to 0
    for (size_t k = 0; k < got.size(); k++) {
      double want = xs[k] > 0 ? vv[k] : 0.0;
      if (dt == KILN_F32) want = (double)(float)want;
      if (std::isnan(want))
        EXPECT_TRUE(std::isnan(got[k])) << k;
      else
        EXPECT_TRUE(got[k] == want && !std::signbit(got[k]) == !std::signbit(want)) << k << ": " << got[k];
    }
    kiln_function_free(f);
    kiln_scope_pop();
  }
}
