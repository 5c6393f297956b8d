// conv_test.cc — convolutional networks (API.md §10): conv2d, conv2d_transpose,
// max_pool2d and avg_pool2d (primitives with their gradients), pad,
// batch_norm, moments and dropout (composites). Hand-computed values; a
// naive direct convolution as the reference over strides, dilations,
// padding and groups; eager == staged (compiled) == interpreted; gradients
// against central differences in f64 (second order through conv2d too);
// bad inputs each failing with an error that names the op; the IR of a
// traced conv net round-tripping through its text.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <unistd.h>

#include "cpu/cpu.h"
#include "conv.h"
#include "ir.h"
#include "ir_gen.h"
#include "passes.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---- a naive direct convolution, the reference ----

struct Geo {
  int sh = 1, sw = 1, dh = 1, dw = 1;
  int pad[4] = {0, 0, 0, 0};  // top, bottom, left, right
  int groups = 1;
};

kiln_conv_opts opts_of(const Geo &g) {
  kiln_conv_opts o = {};
  o.stride[0] = g.sh, o.stride[1] = g.sw;
  o.dilation[0] = g.dh, o.dilation[1] = g.dw;
  for (int i = 0; i < 4; i++) o.padding[i] = g.pad[i];
  o.groups = g.groups;
  return o;
}

// y[n, oy, ox, o] = sum over (ky, kx, c) of x[n, oy*sh - pt + ky*dh, ox*sw - pl + kx*dw, grp*cg + c] f[ky, kx, c, o]
VD ref_conv(const VD &x, const V64 &xs, const VD &f, const V64 &fs, const Geo &g, V64 *ys) {
  int64_t n = xs[0], h = xs[1], w = xs[2], c = xs[3], kh = fs[0], kw = fs[1], cg = fs[2], o = fs[3];
  int64_t oh = (h + g.pad[0] + g.pad[1] - (kh - 1) * g.dh - 1) / g.sh + 1;
  int64_t ow = (w + g.pad[2] + g.pad[3] - (kw - 1) * g.dw - 1) / g.sw + 1;
  int64_t og = o / g.groups;
  *ys = {n, oh, ow, o};
  VD y((size_t)(n * oh * ow * o), 0.0);
  for (int64_t b = 0; b < n; b++)
    for (int64_t oy = 0; oy < oh; oy++)
      for (int64_t ox = 0; ox < ow; ox++)
        for (int64_t k = 0; k < o; k++) {
          double s = 0;
          int64_t grp = k / og;
          for (int64_t ky = 0; ky < kh; ky++)
            for (int64_t kx = 0; kx < kw; kx++)
              for (int64_t ci = 0; ci < cg; ci++) {
                int64_t iy = oy * g.sh - g.pad[0] + ky * g.dh, ix = ox * g.sw - g.pad[2] + kx * g.dw;
                if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                s += x[(size_t)(((b * h + iy) * w + ix) * c + grp * cg + ci)] *
                     f[(size_t)(((ky * kw + kx) * cg + ci) * o + k)];
              }
          y[(size_t)(((b * oh + oy) * ow + ox) * o + k)] = s;
        }
  return y;
}

int64_t numel(const V64 &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

VD random_values(std::mt19937_64 &rng, int64_t n, double lo = -1, double hi = 1) {
  std::uniform_real_distribution<double> u(lo, hi);
  VD v((size_t)n);
  for (auto &e : v) e = u(rng);
  return v;
}

void expect_near_all(const VD &got, const VD &want, double tol, const std::string &what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; i++)
    if (!(std::fabs(got[i] - want[i]) <= tol * (1 + std::fabs(want[i])))) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", want " << want[i];
      bad++;
    }
}

// The configurations the reference, the staged and the gradient tests run.
struct ConvCase {
  const char *name;
  V64 x;      // NHWC
  V64 f;      // HWIO
  Geo g;
};

std::vector<ConvCase> conv_cases() {
  std::vector<ConvCase> v;
  v.push_back({"plain 3x3", {2, 5, 6, 3}, {3, 3, 3, 4}, {}});
  Geo s2;
  s2.sh = 2, s2.sw = 3;
  v.push_back({"strides 2x3", {1, 7, 8, 2}, {3, 2, 2, 3}, s2});
  Geo d2;
  d2.dh = 2, d2.dw = 3;
  v.push_back({"dilation 2x3", {1, 7, 8, 2}, {2, 2, 2, 2}, d2});
  Geo p;
  p.pad[0] = 1, p.pad[1] = 2, p.pad[2] = 0, p.pad[3] = 3;
  v.push_back({"asymmetric padding", {2, 4, 5, 3}, {3, 3, 3, 2}, p});
  Geo all;
  all.sh = 2, all.sw = 1, all.dh = 1, all.dw = 2, all.pad[0] = 2, all.pad[1] = 1, all.pad[2] = 1, all.pad[3] = 1;
  v.push_back({"stride, dilation and padding", {1, 6, 6, 2}, {2, 3, 2, 3}, all});
  Geo g2;
  g2.groups = 2, g2.pad[0] = g2.pad[1] = g2.pad[2] = g2.pad[3] = 1;
  v.push_back({"2 groups", {2, 4, 4, 4}, {3, 3, 2, 6}, g2});
  Geo dw;
  dw.groups = 3, dw.sh = dw.sw = 2, dw.pad[1] = dw.pad[3] = 1;
  v.push_back({"depthwise", {1, 5, 5, 3}, {3, 3, 1, 3}, dw});
  Geo dwm;
  dwm.groups = 2, dwm.dh = 2;
  v.push_back({"depthwise, multiplier 2", {1, 5, 4, 2}, {2, 2, 1, 4}, dwm});
  v.push_back({"1x1 (one matmul)", {2, 3, 4, 5}, {1, 1, 5, 3}, {}});
  Geo s1x1;
  s1x1.sh = s1x1.sw = 2;
  v.push_back({"1x1 strided", {1, 5, 5, 3}, {1, 1, 3, 2}, s1x1});
  return v;
}

// ---- hand-computed values ----

TEST(ConvValues, HandComputed) {
  Scoped s;
  // x = 1..9 in 3x3, the filter [[1, 0], [0, 1]]: y[i, j] = x[i, j] + x[i+1, j+1]
  kiln_tensor *x = f32({1, 3, 3, 1}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  kiln_tensor *f = f32({2, 2, 1, 1}, {1, 0, 0, 1});
  kiln_tensor *y = kiln_conv2d(x, f, nullptr);
  EXPECT_EQ(shape_of(y), (V64{1, 2, 2, 1}));
  EXPECT_EQ(values(y), (VD{6, 8, 12, 14}));

  kiln_conv_opts o = {};
  o.stride[0] = o.stride[1] = 2;
  o.padding[0] = o.padding[1] = o.padding[2] = o.padding[3] = 1;
  y = kiln_conv2d(x, f, &o);  // windows at (-1,-1), (-1,1), (1,-1), (1,1) of the padded 5x5
  EXPECT_EQ(shape_of(y), (V64{1, 2, 2, 1}));
  EXPECT_EQ(values(y), (VD{1, 3, 7, 14}));

  o = {};
  o.dilation[0] = o.dilation[1] = 2;  // the window's corners: x[0,0] + x[2,2]
  y = kiln_conv2d(x, f, &o);
  EXPECT_EQ(shape_of(y), (V64{1, 1, 1, 1}));
  EXPECT_EQ(values(y), (VD{10}));

  o = {};
  o.same = true;  // padding 0 before and 1 after on both axes (TensorFlow's split)
  o.padding[0] = 5;  // overridden by same
  y = kiln_conv2d(x, f, &o);
  EXPECT_EQ(shape_of(y), (V64{1, 3, 3, 1}));
  EXPECT_EQ(values(y), (VD{6, 8, 3, 12, 14, 6, 7, 8, 9}));

  o = {};
  o.same = true, o.stride[0] = o.stride[1] = 2;  // ceil(3 / 2) = 2 outputs, padding 0 and 1
  y = kiln_conv2d(x, f, &o);
  EXPECT_EQ(values(y), (VD{6, 3, 7, 9}));

  // 2 groups: output 0 reads channels 0-1 with the filter's column 0, output 1 channels 2-3 with column 1
  kiln_tensor *xg = f32({1, 1, 1, 4}, {1, 2, 3, 4});
  kiln_tensor *fg = f32({1, 1, 2, 2}, {1, 10, 100, 1000});
  o = {};
  o.groups = 2;
  EXPECT_EQ(values(kiln_conv2d(xg, fg, &o)), (VD{1 * 1 + 2 * 100, 3 * 10 + 4 * 1000}));

  // depthwise: channel 0 summed, channel 1 [[1, 0], [0, -1]]
  kiln_tensor *xd = f64({1, 2, 2, 2}, {1, 10, 2, 20, 3, 30, 4, 40});
  kiln_tensor *fd = f64({2, 2, 1, 2}, {1, 1, 1, 0, 1, 0, 1, -1});
  o.groups = 2;
  y = kiln_conv2d(xd, fd, &o);
  EXPECT_EQ(shape_of(y), (V64{1, 1, 1, 2}));
  EXPECT_EQ(values(y), (VD{10, 10 - 40}));

  // conv2d_transpose scatters each input through the filter: the adjoint of the first conv
  kiln_tensor *dy = f32({1, 2, 2, 1}, {1, 2, 3, 4});
  int64_t hw[2] = {3, 3};
  kiln_tensor *dx = kiln_conv2d_transpose(dy, f, hw, nullptr);
  EXPECT_EQ(shape_of(dx), (V64{1, 3, 3, 1}));
  EXPECT_EQ(values(dx), (VD{1, 2, 0, 3, 4 + 1, 2, 0, 3, 4}));
}

TEST(PoolValues, HandComputed) {
  Scoped s;
  kiln_tensor *x = f32({1, 3, 3, 1}, {1, 2, 3, 4, 5, 6, 7, 8, 9});
  int w2[2] = {2, 2};
  EXPECT_EQ(values(kiln_max_pool2d(x, w2, nullptr)), (VD{5, 6, 8, 9}));
  EXPECT_EQ(values(kiln_avg_pool2d(x, w2, nullptr)), (VD{3, 4, 6, 7}));
  kiln_conv_opts o = {};
  o.same = true, o.stride[0] = o.stride[1] = 2;  // padding 0 before, 1 after: not counted
  EXPECT_EQ(values(kiln_max_pool2d(x, w2, &o)), (VD{5, 6, 8, 9}));
  EXPECT_EQ(values(kiln_avg_pool2d(x, w2, &o)), (VD{3, 4.5, 7.5, 9}));
  // padding never wins a max, nor counts in an average
  kiln_tensor *neg = f64({1, 3, 3, 1}, {-1, -2, -3, -4, -5, -6, -7, -8, -9});
  o = {};
  o.stride[0] = o.stride[1] = 2;
  o.padding[0] = o.padding[1] = o.padding[2] = o.padding[3] = 1;
  EXPECT_EQ(values(kiln_max_pool2d(neg, w2, &o)), (VD{-1, -2, -4, -5}));
  EXPECT_EQ(values(kiln_avg_pool2d(neg, w2, &o)), (VD{-1, -2.5, -5.5, -7}));
  // channels pool separately; strides 1x2
  kiln_tensor *xc = f32({1, 2, 3, 2}, {1, -1, 5, -5, 2, -2, 3, -3, 4, -4, 0, 9});
  o = {};
  o.stride[1] = 2;
  int w22[2] = {2, 2};
  kiln_tensor *m = kiln_max_pool2d(xc, w22, &o);
  EXPECT_EQ(shape_of(m), (V64{1, 1, 1, 2}));
  EXPECT_EQ(values(m), (VD{5, -1}));
  // NaN wins a max
  kiln_tensor *xn = f32({1, 1, 3, 1}, {1, kNanF, 2});
  int w12[2] = {1, 2};
  VD mn = values(kiln_max_pool2d(xn, w12, nullptr));
  ASSERT_EQ(mn.size(), 2u);
  EXPECT_TRUE(std::isnan(mn[0]) && std::isnan(mn[1]));
}

TEST(PoolGradient, MaxSharesTiesAsReduceMax) {
  Scoped s;
  kiln_tensor *x = f64({1, 2, 2, 1}, {1, 1, 0, 1});
  int w2[2] = {2, 2};
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_max_pool2d(x, w2, nullptr), *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(g), (VD{1.0 / 3, 1.0 / 3, 0, 1.0 / 3}));
  // reduce_max does the same with the same ties
  tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *r = kiln_reduce_max(x, 0, nullptr, false), *gr = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, r, 1, &x, &gr), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(gr), values(g));
  // overlapping windows add: stride 1 over 1x3 with a window of 2
  kiln_tensor *x3 = f64({1, 1, 3, 1}, {0, 5, 1});
  int w12[2] = {1, 2};
  tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x3);
  y = kiln_max_pool2d(x3, w12, nullptr);
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x3, &g), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(g), (VD{0, 2, 0}));
  // ties before a larger element count no more; a NaN max takes no gradient;
  // a window of -inf shares among all (one pass counts as it finds the max)
  auto pool_grad = [&](const VD &v) {
    kiln_tensor *xv = f64({1, 2, 2, 1}, v), *gv = nullptr;
    kiln_tape *tp = kiln_tape_begin(false);
    kiln_tape_watch(tp, xv);
    kiln_tensor *yv = kiln_max_pool2d(xv, w2, nullptr);
    EXPECT_EQ(kiln_tape_gradient(tp, yv, 1, &xv, &gv), 0) << kiln_last_error();
    kiln_tape_free(tp);
    return values(gv);
  };
  EXPECT_EQ(pool_grad({2, 2, 3, 3}), (VD{0, 0, 0.5, 0.5}));
  EXPECT_EQ(pool_grad({3, 2, 2, 3}), (VD{0.5, 0, 0, 0.5}));
  EXPECT_EQ(pool_grad({1, kNan, 2, 2}), (VD{0, 0, 0, 0}));
  EXPECT_EQ(pool_grad({5, 1, kNan, 7}), (VD{0, 0, 0, 0}));
  EXPECT_EQ(pool_grad({-kInf, -kInf, -kInf, -kInf}), (VD{0.25, 0.25, 0.25, 0.25}));
}

// ---- against the reference ----

TEST(ConvValues, MatchTheDirectReference) {
  Scoped s;
  std::mt19937_64 rng(3);
  for (const ConvCase &c : conv_cases()) {
    for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
      SCOPED_TRACE(std::string(c.name) + " " + kiln_dtype_name(dt));
      kiln_scope_push();
      VD xv = random_values(rng, numel(c.x)), fv = random_values(rng, numel(c.f));
      V64 ys;
      VD want = ref_conv(xv, c.x, fv, c.f, c.g, &ys);
      kiln_conv_opts o = opts_of(c.g);
      kiln_tensor *y = kiln_conv2d(from_values(dt, c.x, xv), from_values(dt, c.f, fv), &o);
      ASSERT_NE(y, nullptr) << kiln_last_error();
      EXPECT_EQ(shape_of(y), ys);
      expect_near_all(values(y), want, dt == KILN_F32 ? 1e-5 : 1e-13, "conv2d");
      // conv2d_transpose is conv2d's adjoint: <conv(x), v> = <x, conv_transpose(v)>
      VD vv = random_values(rng, numel(ys));
      int64_t hw[2] = {c.x[1], c.x[2]};
      kiln_tensor *t = kiln_conv2d_transpose(from_values(dt, ys, vv), from_values(dt, c.f, fv), hw, &o);
      ASSERT_NE(t, nullptr) << kiln_last_error();
      EXPECT_EQ(shape_of(t), c.x);
      double lhs = 0, rhs = 0;
      for (size_t i = 0; i < want.size(); i++) lhs += want[i] * vv[i];
      VD tv = values(t);
      for (size_t i = 0; i < tv.size(); i++) rhs += xv[i] * tv[i];
      EXPECT_NEAR(lhs, rhs, (dt == KILN_F32 ? 1e-4 : 1e-11) * (1 + std::fabs(lhs)));
      kiln_scope_pop();
    }
  }
}

// An image big enough that im2col runs in several chunks (4 MB each), and
// a 1x1 convolution wide enough for the packed matmul.
TEST(ConvValues, BigImagesRunInChunks) {
  Scoped s;
  std::mt19937_64 rng(5);
  V64 xs = {2, 40, 40, 64}, fs = {3, 3, 64, 8};  // 3200 rows of 576 floats: 7.4 MB of im2col
  Geo g;
  g.pad[0] = g.pad[1] = g.pad[2] = g.pad[3] = 1;
  VD xv = random_values(rng, numel(xs)), fv = random_values(rng, numel(fs));
  V64 ys;
  VD want = ref_conv(xv, xs, fv, fs, g, &ys);
  kiln_conv_opts o = opts_of(g);
  kiln_tensor *x = from_values(KILN_F32, xs, xv), *f = from_values(KILN_F32, fs, fv);
  kiln_tensor *y = kiln_conv2d(x, f, &o);
  ASSERT_NE(y, nullptr) << kiln_last_error();
  EXPECT_EQ(shape_of(y), ys);
  expect_near_all(values(y), want, 1e-4, "chunked conv2d");
  // the backward pass in chunks: its filter gradient against the reference's
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, f);
  kiln_tape_watch(tape, x);
  kiln_tensor *y2 = kiln_conv2d(x, f, &o), *gr[2] = {nullptr, nullptr};
  kiln_tensor *src[2] = {x, f};
  ASSERT_EQ(kiln_tape_gradient(tape, y2, 2, src, gr), 0) << kiln_last_error();
  kiln_tape_free(tape);
  // d sum(y) / d f[ky, kx, c, o] = sum of x over the window positions (the same for every o)
  VD gf = values(gr[1]);
  for (int64_t ky = 0; ky < 3; ky++)
    for (int64_t kx = 0; kx < 3; kx++)
      for (int64_t c = 0; c < 64; c += 21) {
        double sum = 0;
        for (int64_t n = 0; n < 2; n++)
          for (int64_t oy = 0; oy < 40; oy++)
            for (int64_t ox = 0; ox < 40; ox++) {
              int64_t iy = oy - 1 + ky, ix = ox - 1 + kx;
              if (iy >= 0 && iy < 40 && ix >= 0 && ix < 40) sum += xv[(size_t)(((n * 40 + iy) * 40 + ix) * 64 + c)];
            }
        EXPECT_NEAR(gf[(size_t)(((ky * 3 + kx) * 64 + c) * 8 + 5)], sum, 1e-3 * (1 + std::fabs(sum)));
      }
  // d sum(y) / d x = sum over the filter taps that reach it: at an interior pixel, all 9 of each channel's row
  VD gx = values(gr[0]);
  double tap = 0;
  for (int64_t ky = 0; ky < 3; ky++)
    for (int64_t kx = 0; kx < 3; kx++)
      for (int64_t k = 0; k < 8; k++) tap += fv[(size_t)(((ky * 3 + kx) * 64 + 7) * 8 + k)];
  EXPECT_NEAR(gx[(size_t)(((1 * 40 + 20) * 40 + 20) * 64 + 7)], tap, 1e-4);

  V64 ps = {1, 30, 30, 96}, qs = {1, 1, 96, 80};
  VD pv = random_values(rng, numel(ps)), qv = random_values(rng, numel(qs));
  VD pw = ref_conv(pv, ps, qv, qs, Geo{}, &ys);
  kiln_tensor *py = kiln_conv2d(from_values(KILN_F32, ps, pv), from_values(KILN_F32, qs, qv), nullptr);
  expect_near_all(values(py), pw, 1e-4, "1x1 conv2d");
}

TEST(PoolValues, MatchTheDirectReference) {
  Scoped s;
  std::mt19937_64 rng(9);
  struct P {
    V64 x;
    int win[2];
    Geo g;
  };
  Geo s2;
  s2.sh = 2, s2.sw = 1, s2.pad[0] = 1, s2.pad[3] = 2;
  Geo p1;
  p1.sh = p1.sw = 3, p1.pad[0] = p1.pad[1] = p1.pad[2] = p1.pad[3] = 1;
  std::vector<P> cases = {{{2, 5, 6, 3}, {2, 2}, {}}, {{1, 7, 5, 2}, {3, 3}, s2}, {{2, 8, 8, 4}, {3, 2}, p1}};
  for (const P &c : cases) {
    VD xv = random_values(rng, numel(c.x));
    kiln_conv_opts o = opts_of(c.g);
    o.dilation[0] = o.dilation[1] = 0, o.groups = 0;
    kiln_tensor *x = f64(c.x, xv);
    kiln_tensor *mx = kiln_max_pool2d(x, c.win, &o), *av = kiln_avg_pool2d(x, c.win, &o);
    ASSERT_NE(mx, nullptr) << kiln_last_error();
    ASSERT_NE(av, nullptr) << kiln_last_error();
    int64_t h = c.x[1], w = c.x[2], ch = c.x[3];
    int64_t oh = (h + c.g.pad[0] + c.g.pad[1] - c.win[0]) / c.g.sh + 1, ow = (w + c.g.pad[2] + c.g.pad[3] - c.win[1]) / c.g.sw + 1;
    EXPECT_EQ(shape_of(mx), (V64{c.x[0], oh, ow, ch}));
    VD mv = values(mx), avv = values(av);
    for (int64_t n = 0; n < c.x[0]; n++)
      for (int64_t oy = 0; oy < oh; oy++)
        for (int64_t ox = 0; ox < ow; ox++)
          for (int64_t k = 0; k < ch; k++) {
            double m = -INFINITY, sum = 0;
            int cnt = 0;
            for (int ky = 0; ky < c.win[0]; ky++)
              for (int kx = 0; kx < c.win[1]; kx++) {
                int64_t iy = oy * c.g.sh - c.g.pad[0] + ky, ix = ox * c.g.sw - c.g.pad[2] + kx;
                if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                double v = xv[(size_t)(((n * h + iy) * w + ix) * ch + k)];
                m = std::max(m, v), sum += v, cnt++;
              }
            size_t at = (size_t)(((n * oh + oy) * ow + ox) * ch + k);
            EXPECT_EQ(mv[at], m);
            EXPECT_NEAR(avv[at], sum / cnt, 1e-14);
          }
  }
}

// ---- eager == compiled == interpreted ----

struct BackendEnv : EnvGuard {
  explicit BackendEnv(const char *v) : EnvGuard("KILN_BACKEND", v) {}
};

using Body = std::function<kiln_tensor *(kiln_tensor *const *)>;

int body_of(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = (*static_cast<Body *>(user))(in);
  return out[0] ? 0 : -1;
}

// out of a fresh staged function of body over in, with backend
kiln_tensor *staged(const char *backend, Body &body, std::vector<kiln_tensor *> in) {
  BackendEnv env(backend);
  kiln_function *f = kiln_function_new("conv_fn", body_of, &body, (int)in.size(), 1);
  kiln_tensor *out = nullptr;
  EXPECT_EQ(kiln_function_call(f, in.data(), &out), 0) << backend << ": " << kiln_last_error();
  kiln_function_free(f);
  return out;
}

void expect_eager_staged_interpreted(Body body, std::vector<kiln_tensor *> in, bool exact, const std::string &what) {
  kiln_tensor *want = body(in.data());
  ASSERT_NE(want, nullptr) << what << ": " << kiln_last_error();
  kiln_tensor *compiled = staged("cpu", body, in), *interpreted = staged("interp", body, in);
  if (exact) {
    EXPECT_TRUE(same_bits(want, compiled)) << what << ": compiled";
    EXPECT_TRUE(same_bits(want, interpreted)) << what << ": interpreted";
  } else {
    EXPECT_TRUE(allclose(want, compiled, 1e-5, 1e-5)) << what << ": compiled";
    EXPECT_TRUE(allclose(want, interpreted, 1e-5, 1e-5)) << what << ": interpreted";
  }
}

TEST(ConvStaged, EveryOpEagerEqualsCompiledEqualsInterpreted) {
  Scoped s;
  std::mt19937_64 rng(21);
  for (const ConvCase &c : conv_cases()) {
    for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
      std::string what = std::string(c.name) + " " + kiln_dtype_name(dt);
      kiln_scope_push();
      kiln_conv_opts o = opts_of(c.g);
      kiln_tensor *x = from_values(dt, c.x, random_values(rng, numel(c.x)));
      kiln_tensor *f = from_values(dt, c.f, random_values(rng, numel(c.f)));
      kiln_tensor *y = kiln_conv2d(x, f, &o);
      ASSERT_NE(y, nullptr) << kiln_last_error();
      kiln_tensor *dy = from_values(dt, shape_of(y), random_values(rng, kiln_tensor_size(y)));
      int64_t hw[2] = {c.x[1], c.x[2]};
      expect_eager_staged_interpreted([&](kiln_tensor *const *in) { return kiln_conv2d(in[0], in[1], &o); }, {x, f},
                                      true, "conv2d " + what);
      expect_eager_staged_interpreted(
          [&](kiln_tensor *const *in) { return kiln_conv2d_transpose(in[0], in[1], hw, &o); }, {dy, f}, true,
          "conv2d_transpose " + what);
      // the filter gradient (backprop_filter) through a tape inside the body
      expect_eager_staged_interpreted(
          [&](kiln_tensor *const *in) -> kiln_tensor * {
            kiln_tape *tape = kiln_tape_begin(false);
            kiln_tape_watch(tape, in[1]);
            kiln_tensor *l = kiln_mul(kiln_conv2d(in[0], in[1], &o), in[2]), *g = nullptr;
            kiln_tensor *src = in[1];
            int rc = kiln_tape_gradient(tape, l, 1, &src, &g);
            kiln_tape_free(tape);
            return rc ? nullptr : g;
          },
          {x, f, dy}, true, "conv2d_backprop_filter " + what);
      kiln_scope_pop();
    }
  }
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    kiln_tensor *x = from_values(dt, {2, 7, 6, 3}, random_values(rng, 2 * 7 * 6 * 3));
    int win[2] = {3, 2};
    kiln_conv_opts o = {};
    o.stride[0] = 2, o.padding[0] = 1, o.padding[3] = 1;
    for (bool mx : {true, false}) {
      auto pool = [&, mx](kiln_tensor *t) { return mx ? kiln_max_pool2d(t, win, &o) : kiln_avg_pool2d(t, win, &o); };
      std::string what = std::string(mx ? "max_pool2d " : "avg_pool2d ") + kiln_dtype_name(dt);
      expect_eager_staged_interpreted([&](kiln_tensor *const *in) { return pool(in[0]); }, {x}, true, what);
      kiln_tensor *dy = from_values(dt, shape_of(pool(x)), random_values(rng, kiln_tensor_size(pool(x))));
      expect_eager_staged_interpreted(
          [&](kiln_tensor *const *in) -> kiln_tensor * {
            kiln_tape *tape = kiln_tape_begin(false);
            kiln_tape_watch(tape, in[0]);
            kiln_tensor *l = kiln_mul(pool(in[0]), in[1]), *g = nullptr;
            kiln_tensor *src = in[0];
            int rc = kiln_tape_gradient(tape, l, 1, &src, &g);
            kiln_tape_free(tape);
            return rc ? nullptr : g;
          },
          {x, dy}, true, what + " gradient");
    }
  }
}

// A small conv net: conv + bias + relu, max pool, batch norm, avg pool, a
// dense layer; its loss and gradients staged (kiln_gradients) against eager.
struct Net {
  kiln_conv_opts o1 = {}, o2 = {}, op = {};
  int pw[2] = {2, 2};
  Net() {
    op.stride[0] = op.stride[1] = 2;
    o1.same = true;
    o2.stride[0] = o2.stride[1] = 2;
    o2.groups = 2;
    o2.padding[1] = o2.padding[3] = 1;
  }
  // in: x [2,8,8,3], f1 [3,3,3,4], b1 [4], f2 [2,2,2,4], scale [4], w [4,5]
  kiln_tensor *loss(kiln_tensor *const *in) const {
    kiln_tensor *h = kiln_relu(kiln_add(kiln_conv2d(in[0], in[1], &o1), in[2]));
    h = kiln_max_pool2d(h, pw, &op);
    kiln_tensor *m = nullptr, *v = nullptr;
    if (kiln_moments(h, 3, (const int[]){0, 1, 2}, false, &m, &v)) return nullptr;
    h = kiln_batch_norm(h, m, v, nullptr, in[4], 1e-3);
    h = kiln_conv2d(h, in[3], &o2);
    h = kiln_avg_pool2d(h, (const int[]){2, 2}, nullptr);
    h = kiln_reshape(h, 2, (const int64_t[]){2, 4});
    kiln_tensor *logits = kiln_matmul(h, in[5]);
    return kiln_reduce_sum(kiln_square(logits), 0, nullptr, false);
  }
};

int net_loss(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = static_cast<Net *>(user)->loss(in);
  return out[0] ? 0 : -1;
}

std::vector<kiln_tensor *> net_inputs(std::mt19937_64 &rng) {
  std::vector<V64> shapes = {{2, 8, 8, 3}, {3, 3, 3, 4}, {4}, {2, 2, 2, 4}, {4}, {4, 5}};
  std::vector<kiln_tensor *> in;
  for (auto &sh : shapes) in.push_back(f64(sh, random_values(rng, numel(sh))));
  return in;
}

TEST(ConvStaged, ConvNetLossAndGradientsStagedEqualEager) {
  Scoped s;
  std::mt19937_64 rng(4);
  Net net;
  std::vector<kiln_tensor *> in = net_inputs(rng);
  kiln_tape *tape = kiln_tape_begin(false);
  for (auto *t : in) kiln_tape_watch(tape, t);
  kiln_tensor *loss = net.loss(in.data());
  ASSERT_NE(loss, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> g(in.size(), nullptr);
  ASSERT_EQ(kiln_tape_gradient(tape, loss, (int)in.size(), in.data(), g.data()), 0) << kiln_last_error();
  kiln_tape_free(tape);
  for (const char *backend : {"cpu", "interp"}) {
    SCOPED_TRACE(backend);
    BackendEnv env(backend);
    kiln_function *f = kiln_function_new("conv_net", net_loss, &net, (int)in.size(), 1);
    kiln_function *df = kiln_value_and_gradients(f);
    ASSERT_NE(df, nullptr) << kiln_last_error();
    std::vector<kiln_tensor *> out(in.size() + 1, nullptr);
    ASSERT_EQ(kiln_function_call(df, in.data(), out.data()), 0) << kiln_last_error();
    EXPECT_TRUE(allclose(out[0], loss, 1e-12, 1e-12));
    for (size_t i = 0; i < in.size(); i++) EXPECT_TRUE(allclose(out[i + 1], g[i], 1e-10, 1e-12)) << "input " << i;
    kiln_function_free(df);
    kiln_function_free(f);
  }
}

// The traced IR of the conv net (forward and backward) prints, parses back
// and prints the same text.
TEST(ConvIr, TracedConvNetRoundTripsThroughText) {
  Scoped s;
  std::mt19937_64 rng(8);
  Net net;
  std::vector<kiln_tensor *> in = net_inputs(rng);
  kiln_function *f = kiln_function_new("conv_net", net_loss, &net, (int)in.size(), 1);
  kiln_function *df = kiln_gradients(f);
  ASSERT_NE(df, nullptr) << kiln_last_error();
  std::vector<kiln_tensor *> out(in.size(), nullptr);
  ASSERT_EQ(kiln_function_call(df, in.data(), out.data()), 0) << kiln_last_error();
  for (const char *stage : {"traced", "optimized"}) {
    char *text = kiln_function_ir(df, 0, stage);
    ASSERT_NE(text, nullptr) << kiln_last_error();
    std::string t = text;
    free(text);
    EXPECT_THAT(t, HasSubstr("conv2d_backprop_input"));
    EXPECT_THAT(t, HasSubstr("conv2d_backprop_filter"));
    EXPECT_THAT(t, HasSubstr("max_pool2d_grad"));
    EXPECT_THAT(t, HasSubstr("avg_pool2d_grad"));
    EXPECT_THAT(t, HasSubstr("stride=[2,2], dilation=[1,1], padding=[0,1,0,1], groups=2"));
    ir_module *m = ir_parse(t.c_str(), "conv_net.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << t;
    char *again = ir_print_module(m);
    EXPECT_EQ(std::string(again), t) << stage;
    free(again);
    ir_module_free(m);
  }
  kiln_function_free(df);
  kiln_function_free(f);
}

TEST(ConvIr, BadAttributesAreParseErrors) {
  const char *head = "func @f(%x: f32[1,4,4,2], %w: f32[3,3,2,2]) -> f32[1,2,2,2] {\n  %0 = conv2d %x, %w ";
  const char *tail = " : f32[1,2,2,2]\n  return %0\n}\n";
  struct {
    const char *attrs, *error;
  } cases[] = {
      {"{stride=[1,1], dilation=[1,1], padding=[0,0,0,0], groups=1}", nullptr},
      {"{stride=[0,1], dilation=[1,1], padding=[0,0,0,0], groups=1}", "conv2d: stride 0 must be positive"},
      {"{stride=[1,1], dilation=[1,1], padding=[0,-1,0,0], groups=1}", "conv2d: padding -1 is negative"},
      {"{stride=[1,1], dilation=[1,1], padding=[0,0], groups=1}", "padding needs 4 entries, got 2"},
      {"{stride=[1,1], dilation=[1,1], padding=[0,0,0,0], groups=2}", "conv2d: channel mismatch"},
      {"{stride=[1,1], dilation=[1,1], padding=[0,0,0,0]}", "conv2d needs attribute 'groups'"},
      {"{stride=[1,1], dilation=[1,1], padding=[0,0,0,0], groups=1, window=[1,1]}", "has no attribute 'window'"},
  };
  for (auto &c : cases) {
    std::string text = std::string(head) + c.attrs + tail;
    kiln_clear_error();
    ir_module *m = ir_parse(text.c_str(), "bad.kir");
    if (!c.error) {
      EXPECT_NE(m, nullptr) << kiln_last_error();
      if (m) {
        char *p = ir_print_module(m);
        EXPECT_EQ(std::string(p), text);
        free(p);
      }
    } else {
      EXPECT_EQ(m, nullptr) << c.attrs;
      EXPECT_THAT(kiln_last_error(), HasSubstr(c.error));
    }
    ir_module_free(m);
  }
}

// Random programs with windows (tests/ir_gen.cc, IR_GEN_WINDOW): compiled
// for the CPU == interpreted, bit for bit (both run the eager kernels for
// the windows; the rest without FP contraction), and they do hold windows.
// optimized: compiled after the default pipeline, whose fusions make
// convolutions with bias, residual and activation epilogues
// (conv2d_epilogue), against the unoptimized program interpreted.
void check_window_programs(bool optimized) {
  Scoped s;
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_WINDOW;
  o.dtypes = DT_BIT(KILN_F32) | DT_BIT(KILN_F64);
  cpu_options strict{};
  strict.no_contract = true;
  int windows = 0, programs = 0, differ = 0, epilogues = 0;
  for (uint64_t seed = 1; seed <= (optimized ? 200u : 60u); seed++) {
    ir_module *m = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << "seed " << seed << ": " << kiln_last_error();
    ir_func *f = m->funcs[0];
    bool has = false;
    for (int i = 0; i < f->n_instrs; i++)
      if (ir_op_info(f->instrs[i].op)->kind == OPK_WINDOW) windows++, has = true;
    kiln_scope_push();
    std::vector<kiln_tensor *> args((size_t)f->n_params), want((size_t)f->n_results), got((size_t)f->n_results);
    ASSERT_EQ(ir_gen_args(f, seed, args.data()), 0) << kiln_last_error();
    ASSERT_EQ(ir_interpret(f, args.data(), want.data()), 0) << "seed " << seed << ": " << kiln_last_error();
    if (optimized) {
      ASSERT_EQ(pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0)
          << "seed " << seed << ": " << kiln_last_error();
      for (int i = 0; i < f->n_instrs; i++) {
        const ir_instr *in = &f->instrs[i];
        if (in->op == OP_FUSION && in->attrs.callee->n_instrs > 1 && in->attrs.callee->instrs[0].op == OP_CONV2D) {
          epilogues++;
          // only the epilogue's shape: + bias, + residual, activation
          EXPECT_LE(in->attrs.callee->n_instrs, 4) << "seed " << seed;
          EXPECT_EQ(in->attrs.callee->instrs[1].op, OP_ADD) << "seed " << seed;
        }
      }
    }
    cpu_program *p = cpu_compile_with(f, &strict);
    ASSERT_NE(p, nullptr) << "seed " << seed << ": " << kiln_last_error();
    ASSERT_EQ(cpu_run(p, args.data(), got.data()), 0) << "seed " << seed << ": " << kiln_last_error();
    cpu_program_free(p);
    for (int r = 0; r < f->n_results; r++) {
      bool ok = allclose(got[(size_t)r], want[(size_t)r], 1e-5, 1e-5);
      EXPECT_TRUE(ok) << "seed " << seed << " result " << r << (optimized ? " (optimized)" : "");
      differ += !ok;
    }
    kiln_scope_pop();
    programs += has;
    ir_module_free(m);
  }
  EXPECT_GT(programs, 30) << "programs with a window op";
  EXPECT_GT(windows, 60);
  EXPECT_EQ(differ, 0);
  if (optimized) {
    EXPECT_GE(epilogues, 8) << "fusions led by a conv2d";
  }
}

TEST(ConvRandom, ProgramsWithWindowsCompiledEqualInterpreted) { check_window_programs(false); }
TEST(ConvRandom, OptimizedProgramsWithWindowsCompiledEqualInterpreted) { check_window_programs(true); }

// ---- gradients against central differences (f64) ----

using Fn = std::function<kiln_tensor *(const std::vector<kiln_tensor *> &)>;

// Checks the tape's gradient of sum(fn(x) * ct) w.r.t. every input against
// central differences.
void check_gradients(const Fn &fn, const std::vector<V64> &shapes, std::mt19937_64 &rng, const std::string &what,
                     double tol = 1e-7) {
  kiln_scope_push();
  std::vector<VD> vals;
  std::vector<kiln_tensor *> in;
  for (auto &sh : shapes) {
    vals.push_back(random_values(rng, numel(sh)));
    in.push_back(f64(sh, vals.back()));
  }
  kiln_tensor *y0 = fn(in);
  ASSERT_NE(y0, nullptr) << what << ": " << kiln_last_error();
  kiln_tensor *ct = f64(shape_of(y0), random_values(rng, kiln_tensor_size(y0)));
  auto loss = [&](const std::vector<kiln_tensor *> &x) {
    return kiln_reduce_sum(kiln_mul(fn(x), ct), 0, nullptr, false);
  };
  kiln_tape *tape = kiln_tape_begin(false);
  for (auto *t : in) kiln_tape_watch(tape, t);
  kiln_tensor *l = loss(in);
  std::vector<kiln_tensor *> g(in.size(), nullptr);
  ASSERT_EQ(kiln_tape_gradient(tape, l, (int)in.size(), in.data(), g.data()), 0) << what << ": " << kiln_last_error();
  kiln_tape_free(tape);
  const double h = 1e-6;
  for (size_t i = 0; i < in.size(); i++) {
    VD got = g[i] ? values(g[i]) : VD(vals[i].size(), 0.0), num(vals[i].size());
    for (size_t j = 0; j < vals[i].size(); j++) {
      kiln_scope_push();
      std::vector<kiln_tensor *> x = in;
      VD p = vals[i];
      p[j] += h;
      x[i] = f64(shapes[i], p);
      double lp = values(loss(x))[0];
      p[j] -= 2 * h;
      x[i] = f64(shapes[i], p);
      double lm = values(loss(x))[0];
      num[j] = (lp - lm) / (2 * h);
      kiln_scope_pop();
    }
    expect_near_all(got, num, tol, what + ": input " + std::to_string(i));
  }
  kiln_scope_pop();
}

TEST(ConvGradient, MatchesFiniteDifferences) {
  Scoped s;
  std::mt19937_64 rng(12);
  for (const ConvCase &c : conv_cases()) {
    kiln_conv_opts o = opts_of(c.g);
    check_gradients([&](const std::vector<kiln_tensor *> &x) { return kiln_conv2d(x[0], x[1], &o); }, {c.x, c.f},
                    rng, std::string("conv2d ") + c.name);
    // conv2d_transpose w.r.t. both of its inputs (its gradients are conv2d and backprop_filter)
    V64 ys;
    ref_conv(VD((size_t)numel(c.x)), c.x, VD((size_t)numel(c.f)), c.f, c.g, &ys);
    int64_t hw[2] = {c.x[1], c.x[2]};
    check_gradients(
        [&](const std::vector<kiln_tensor *> &x) { return kiln_conv2d_transpose(x[0], x[1], hw, &o); }, {ys, c.f},
        rng, std::string("conv2d_transpose ") + c.name);
  }
  kiln_conv_opts same = {};
  same.same = true, same.stride[0] = 2;
  check_gradients([&](const std::vector<kiln_tensor *> &x) { return kiln_conv2d(x[0], x[1], &same); },
                  {{1, 5, 4, 2}, {3, 2, 2, 2}}, rng, "conv2d SAME");
}

TEST(PoolGradient, MatchesFiniteDifferences) {
  Scoped s;
  std::mt19937_64 rng(13);
  struct P {
    V64 x;
    int win[2];
    kiln_conv_opts o;
  };
  kiln_conv_opts plain = {}, strided = {}, same = {};
  strided.stride[0] = 2, strided.stride[1] = 3, strided.padding[0] = 1, strided.padding[3] = 2;
  same.same = true, same.stride[0] = same.stride[1] = 2;
  std::vector<P> cases = {{{2, 4, 5, 2}, {2, 2}, plain}, {{1, 5, 7, 3}, {3, 3}, strided}, {{1, 5, 5, 2}, {2, 3}, same}};
  for (const P &c : cases) {
    // random values: no ties, where a max has no derivative
    check_gradients([&](const std::vector<kiln_tensor *> &x) { return kiln_max_pool2d(x[0], c.win, &c.o); }, {c.x}, rng,
                    "max_pool2d");
    check_gradients([&](const std::vector<kiln_tensor *> &x) { return kiln_avg_pool2d(x[0], c.win, &c.o); }, {c.x}, rng,
                    "avg_pool2d");
  }
}

// Second order: m = <d sum(conv(x, f)^2) / d(x or f), w> differentiated again
// (the rules of backprop_input and backprop_filter), against central
// differences of the exact first derivative. Also avg_pool2d's gradient's gradient.
TEST(ConvGradient, SecondOrderMatchesFiniteDifferences) {
  Scoped s;
  std::mt19937_64 rng(14);
  for (const ConvCase &c : conv_cases()) {
    kiln_conv_opts o = opts_of(c.g);
    for (int wrt : {0, 1}) {
      V64 ws = wrt == 0 ? c.x : c.f;
      kiln_tensor *w = f64(ws, random_values(rng, numel(ws)));
      Fn first = [&, wrt, w](const std::vector<kiln_tensor *> &x) -> kiln_tensor * {
        kiln_tape *tape = kiln_tape_begin(false);
        kiln_tape_watch(tape, x[wrt]);
        kiln_tensor *y = kiln_conv2d(x[0], x[1], &o), *g = nullptr;
        kiln_tensor *src = x[wrt];
        int rc = kiln_tape_gradient(tape, kiln_reduce_sum(kiln_square(y), 0, nullptr, false), 1, &src, &g);
        kiln_tape_free(tape);
        return rc ? nullptr : kiln_reduce_sum(kiln_mul(g, w), 0, nullptr, false);
      };
      check_gradients(first, {c.x, c.f}, rng, std::string("second order ") + c.name + (wrt ? " (filter)" : " (x)"),
                      1e-6);
    }
  }
  int win[2] = {2, 3};
  kiln_conv_opts po = {};
  po.stride[0] = 1, po.stride[1] = 2, po.padding[2] = 1;
  kiln_tensor *w = f64({1, 4, 5, 2}, random_values(rng, 40));
  check_gradients(
      [&](const std::vector<kiln_tensor *> &x) -> kiln_tensor * {
        kiln_tape *tape = kiln_tape_begin(false);
        kiln_tape_watch(tape, x[0]);
        kiln_tensor *y = kiln_avg_pool2d(x[0], win, &po), *g = nullptr;
        kiln_tensor *src = x[0];
        int rc = kiln_tape_gradient(tape, kiln_reduce_sum(kiln_square(y), 0, nullptr, false), 1, &src, &g);
        kiln_tape_free(tape);
        return rc ? nullptr : kiln_reduce_sum(kiln_mul(g, w), 0, nullptr, false);
      },
      {{1, 4, 5, 2}}, rng, "second order avg_pool2d", 1e-6);
}

TEST(PoolGradient, MaxPoolHasNoSecondDerivative) {
  Scoped s;
  kiln_tensor *x = f64({1, 2, 2, 1}, {1, 2, 3, 4});
  int w2[2] = {2, 2};
  kiln_tape *outer = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape *inner = kiln_tape_begin(false);
  kiln_tape_watch(inner, x);
  kiln_tensor *y = kiln_max_pool2d(x, w2, nullptr);
  kiln_tensor *l = kiln_reduce_sum(kiln_square(y), 0, nullptr, false), *g = nullptr, *gg = nullptr;
  kiln_tape_end(inner);
  ASSERT_EQ(kiln_tape_gradient(inner, l, 1, &x, &g), 0) << kiln_last_error();
  EXPECT_EQ(values(g), (VD{0, 0, 0, 8}));
  kiln_tape_end(outer);
  EXPECT_EQ(kiln_tape_gradient(outer, g, 1, &x, &gg), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("max_pool2d_grad: the gradient of max_pool2d's gradient"));
  kiln_tape_free(inner);
  kiln_tape_free(outer);
  kiln_clear_error();
}

// ---- the composites ----

TEST(ConvComposites, Pad) {
  Scoped s;
  kiln_tensor *t = f32({2, 2}, {1, 2, 3, 4});
  kiln_tensor *p = kiln_pad(t, (const int64_t[]){1, 0}, (const int64_t[]){0, 2}, -1);
  EXPECT_EQ(shape_of(p), (V64{3, 4}));
  EXPECT_EQ(values(p), (VD{-1, -1, -1, -1, 1, 2, -1, -1, 3, 4, -1, -1}));
  EXPECT_EQ(values(kiln_pad(t, (const int64_t[]){0, 0}, (const int64_t[]){0, 0}, 7)), (VD{1, 2, 3, 4}));
  EXPECT_EQ(values(kiln_pad(i32({2}, {5, 6}), (const int64_t[]){1}, (const int64_t[]){1}, 0)), (VD{0, 5, 6, 0}));
  std::mt19937_64 rng(1);
  check_gradients(
      [](const std::vector<kiln_tensor *> &x) {
        return kiln_pad(x[0], (const int64_t[]){0, 1, 2, 0}, (const int64_t[]){1, 0, 1, 3}, 0.5);
      },
      {{1, 2, 3, 2}}, rng, "pad");
  expect_eager_staged_interpreted(
      [](kiln_tensor *const *in) { return kiln_pad(in[0], (const int64_t[]){2, 1}, (const int64_t[]){0, 3}, 2); },
      {t}, true, "pad");
}

TEST(ConvComposites, BatchNormAndMoments) {
  Scoped s;
  // two channels over 2 x 2 positions
  kiln_tensor *x = f64({2, 1, 2, 2}, {1, 10, 2, 20, 3, 30, 6, 40});
  kiln_tensor *m = nullptr, *v = nullptr;
  ASSERT_EQ(kiln_moments(x, 3, (const int[]){0, 1, 2}, false, &m, &v), 0) << kiln_last_error();
  EXPECT_EQ(shape_of(m), (V64{2}));
  EXPECT_EQ(values(m), (VD{3, 25}));
  EXPECT_EQ(values(v), (VD{(4 + 1 + 0 + 9) / 4.0, (225 + 25 + 25 + 225) / 4.0}));
  kiln_tensor *mk = nullptr, *vk = nullptr;
  ASSERT_EQ(kiln_moments(x, 2, (const int[]){-2, 0}, true, &mk, &vk), 0);
  EXPECT_EQ(shape_of(mk), (V64{1, 1, 1, 2}));
  EXPECT_EQ(shape_of(vk), (V64{1, 1, 1, 2}));
  ASSERT_EQ(kiln_moments(x, 0, nullptr, false, &mk, &vk), 0);
  EXPECT_EQ(values(mk), (VD{14}));
  kiln_tensor *bn = kiln_batch_norm(x, m, v, f64({2}, {1, -1}), f64({2}, {2, 0.5}), 0);
  VD got = values(bn);
  VD want = {(1 - 3) / std::sqrt(3.5) * 2 + 1, (10 - 25) / std::sqrt(125.0) * 0.5 - 1};
  EXPECT_NEAR(got[0], want[0], 1e-14);
  EXPECT_NEAR(got[1], want[1], 1e-14);
  kiln_tensor *plain = kiln_batch_norm(x, m, v, nullptr, nullptr, 1e-3);
  EXPECT_NEAR(values(plain)[7], (40 - 25) / std::sqrt(125.001), 1e-14);
  // training-mode batch norm: moments of the batch, gradients through both
  std::mt19937_64 rng(2);
  check_gradients(
      [](const std::vector<kiln_tensor *> &in) -> kiln_tensor * {
        kiln_tensor *mm = nullptr, *vv = nullptr;
        if (kiln_moments(in[0], 3, (const int[]){0, 1, 2}, false, &mm, &vv)) return nullptr;
        return kiln_batch_norm(in[0], mm, vv, in[1], in[2], 1e-3);
      },
      {{2, 3, 2, 3}, {3}, {3}}, rng, "batch_norm of the batch's moments", 1e-6);
  check_gradients(
      [](const std::vector<kiln_tensor *> &in) {
        return kiln_batch_norm(in[0], in[1], kiln_add(kiln_square(in[2]), kiln_scalar(KILN_F64, 0.5)), in[3], in[4],
                               1e-3);
      },
      {{2, 2, 2, 3}, {3}, {3}, {3}, {3}}, rng, "batch_norm");
  expect_eager_staged_interpreted(
      [](kiln_tensor *const *in) -> kiln_tensor * {
        kiln_tensor *mm = nullptr, *vv = nullptr;
        if (kiln_moments(in[0], 3, (const int[]){0, 1, 2}, false, &mm, &vv)) return nullptr;
        return kiln_batch_norm(in[0], mm, vv, nullptr, nullptr, 1e-5);
      },
      {x}, false, "batch_norm with moments");
}

TEST(ConvComposites, Dropout) {
  Scoped s;
  kiln_tensor *x = kiln_ones(KILN_F32, 2, (const int64_t[]){100, 100});
  kiln_tensor *a = kiln_dropout(x, 0.25), *b = kiln_dropout(x, 0.25);
  VD va = values(a), vb = values(b);
  int kept = 0, differ = 0;
  for (size_t i = 0; i < va.size(); i++) {
    EXPECT_TRUE(va[i] == 0 || std::fabs(va[i] - 4.0 / 3) < 1e-6) << va[i];
    kept += va[i] != 0;
    differ += (va[i] != 0) != (vb[i] != 0);
  }
  EXPECT_NEAR(kept, 7500, 300);
  EXPECT_GT(differ, 1000) << "a new mask every call";
  EXPECT_TRUE(same_bits(kiln_dropout(x, 0), x)) << "rate 0 is the identity";
  // staged: a new mask at every call, each scaled the same
  Body body = [](kiln_tensor *const *in) { return kiln_dropout(in[0], 0.5); };
  kiln_function *f = kiln_function_new("dropout_fn", body_of, &body, 1, 1);
  kiln_tensor *s1 = nullptr, *s2 = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &s1), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, &x, &s2), 0) << kiln_last_error();
  kiln_function_free(f);
  VD v1 = values(s1), v2 = values(s2);
  int k1 = 0, d = 0;
  for (size_t i = 0; i < v1.size(); i++) {
    EXPECT_TRUE(v1[i] == 0 || v1[i] == 2) << v1[i];
    k1 += v1[i] != 0, d += v1[i] != v2[i];
  }
  EXPECT_NEAR(k1, 5000, 300);
  EXPECT_GT(d, 2000);
  // the gradient is the mask, scaled
  kiln_tensor *xs = kiln_ones(KILN_F64, 1, (const int64_t[]){1000});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, xs);
  kiln_tensor *y = kiln_dropout(xs, 0.5), *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &xs, &g), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(g), values(y));
}

// ---- bad inputs: NULL and an error naming the op, never a crash ----

TEST(ConvErrors, BadInputsNameTheOp) {
  Scoped s;
  kiln_tensor *x = f32({1, 4, 4, 3}, std::vector<float>(48, 1));
  kiln_tensor *f = f32({3, 3, 3, 2}, std::vector<float>(54, 1));
  kiln_conv_opts o = {};
  auto fails = [](kiln_tensor *t, const std::string &msg) {
    EXPECT_EQ(t, nullptr) << msg;
    EXPECT_THAT(kiln_last_error(), StartsWith(msg));
    kiln_clear_error();
  };
  fails(kiln_conv2d(x, f32({3, 3, 2, 2}, std::vector<float>(36, 1)), nullptr),
        "conv2d: channel mismatch: the input has 3 channels, the filter takes 2");
  fails(kiln_conv2d(x, f32({5, 3, 3, 2}, std::vector<float>(90, 1)), nullptr),
        "conv2d: the window (5 rows, dilation 1) is larger than the padded input (4 + 0 + 0)");
  o.dilation[1] = 2;
  fails(kiln_conv2d(x, f, &o), "conv2d: the window (3 columns, dilation 2) is larger than the padded input");
  o = {};
  o.padding[2] = -1;
  fails(kiln_conv2d(x, f, &o), "conv2d: padding -1 is negative");
  o = {};
  o.groups = 2;
  fails(kiln_conv2d(x, f, &o), "conv2d: groups 2 does not divide the 3 input channels");
  o.groups = 3;
  fails(kiln_conv2d(x, f32({3, 3, 1, 4}, std::vector<float>(36, 1)), &o),
        "conv2d: groups 3 does not divide the 4 output channels");
  o = {};
  o.stride[0] = -2;
  fails(kiln_conv2d(x, f, &o), "conv2d: stride -2 must be positive");
  o = {};
  o.groups = -1;
  fails(kiln_conv2d(x, f, &o), "conv2d: groups -1 must be positive");
  fails(kiln_conv2d(f32({4, 4, 3}, std::vector<float>(48, 1)), f, nullptr), "conv2d: the input must have rank 4");
  fails(kiln_conv2d(x, f32({3, 3}, std::vector<float>(9, 1)), nullptr), "conv2d: the filter must have rank 4");
  fails(kiln_conv2d(i32({1, 4, 4, 3}, std::vector<int32_t>(48, 1)), f, nullptr),
        "conv2d: dtype i32 is not supported (f32, f64)");
  fails(kiln_conv2d(x, f64({3, 3, 3, 2}, VD(54, 1)), nullptr), "conv2d: dtype mismatch: f32 and f64");
  fails(kiln_conv2d(nullptr, f, nullptr), "conv2d: input 0 is NULL");
  fails(kiln_conv2d(x, nullptr, nullptr), "conv2d: input 1 is NULL");
  // conv2d_transpose
  int64_t hw[2] = {4, 4};
  kiln_tensor *dy = f32({1, 2, 2, 2}, std::vector<float>(8, 1));
  fails(kiln_conv2d_transpose(dy, f, nullptr, nullptr), "conv2d_transpose: out_hw is NULL");
  fails(kiln_conv2d_transpose(f32({1, 3, 2, 2}, std::vector<float>(12, 1)), f, hw, nullptr),
        "conv2d_transpose: the input has shape (1, 3, 2, 2), expected (1, 2, 2, 2)");
  int64_t neg[2] = {-4, 4};
  fails(kiln_conv2d_transpose(dy, f, neg, nullptr), "conv2d_transpose:");
  fails(kiln_conv2d_transpose(f32({1, 2, 2, 3}, std::vector<float>(12, 1)), f, hw, nullptr),
        "conv2d_transpose: the input has shape (1, 2, 2, 3), expected (1, 2, 2, 2)");
  // pooling
  int w2[2] = {2, 2}, w5[2] = {5, 1}, w0[2] = {0, 2};
  fails(kiln_max_pool2d(x, w5, nullptr), "max_pool2d: the window (5 rows, dilation 1) is larger than the padded input");
  fails(kiln_avg_pool2d(x, w0, nullptr), "avg_pool2d: window 0 must be positive");
  fails(kiln_max_pool2d(x, nullptr, nullptr), "max_pool2d: window is NULL");
  o = {};
  o.padding[0] = 2;
  fails(kiln_max_pool2d(x, w2, &o), "max_pool2d: padding 2 is not smaller than the window (2)");
  o.padding[0] = -1;
  fails(kiln_avg_pool2d(x, w2, &o), "avg_pool2d: padding -1 is negative");
  o = {};
  o.dilation[0] = 2;
  fails(kiln_max_pool2d(x, w2, &o), "max_pool2d: pooling has no dilation");
  o = {};
  o.groups = 3;
  fails(kiln_avg_pool2d(x, w2, &o), "avg_pool2d: pooling has no groups");
  fails(kiln_max_pool2d(f32({4, 4}, std::vector<float>(16, 1)), w2, nullptr), "max_pool2d: the input must have rank 4");
  fails(kiln_avg_pool2d(i64({1, 2, 2, 1}, {1, 2, 3, 4}), w2, nullptr), "avg_pool2d: dtype i64 is not supported");
  fails(kiln_max_pool2d(nullptr, w2, nullptr), "max_pool2d: input 0 is NULL");
  // composites
  fails(kiln_pad(x, (const int64_t[]){0, -1, 0, 0}, (const int64_t[]){0, 0, 0, 0}, 0),
        "pad: negative padding on axis 1 (before -1, after 0)");
  fails(kiln_pad(x, nullptr, (const int64_t[]){0, 0, 0, 0}, 0), "pad: before is NULL");
  fails(kiln_pad(nullptr, nullptr, nullptr, 0), "pad: input is NULL");
  kiln_tensor *c3 = f32({3}, {1, 1, 1});
  fails(kiln_batch_norm(x, f32({2}, {0, 0}), c3, nullptr, nullptr, 1e-3),
        "batch_norm: mean of shape (2,) does not broadcast to x's shape (1, 4, 4, 3)");
  fails(kiln_batch_norm(x, c3, f64({3}, {1, 1, 1}), nullptr, nullptr, 1e-3),
        "batch_norm: variance has dtype f64, x f32");
  fails(kiln_batch_norm(x, c3, c3, nullptr, nullptr, -1), "batch_norm: epsilon = -1 must be finite and >= 0");
  fails(kiln_batch_norm(x, nullptr, c3, nullptr, nullptr, 0), "batch_norm: input is NULL");
  fails(kiln_batch_norm(i32({3}, {1, 2, 3}), c3, c3, nullptr, nullptr, 0), "batch_norm: dtype i32 is not supported");
  kiln_tensor *m = nullptr, *v = nullptr;
  EXPECT_EQ(kiln_moments(x, 1, (const int[]){4}, false, &m, &v), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("moments: axis 4 is out of range for rank 4"));
  EXPECT_EQ(kiln_moments(x, 2, (const int[]){1, -3}, false, &m, &v), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("moments: axis -3 is repeated"));
  EXPECT_EQ(kiln_moments(x, 0, nullptr, false, nullptr, &v), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("moments: mean is NULL"));
  EXPECT_EQ(kiln_moments(i32({2}, {1, 2}), 0, nullptr, false, &m, &v), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("moments: dtype i32 is not supported"));
  EXPECT_EQ(m, nullptr);
  EXPECT_EQ(v, nullptr);
  fails(kiln_dropout(x, 1), "dropout: rate = 1 is not in [0, 1)");
  fails(kiln_dropout(x, -0.1), "dropout: rate = -0.1 is not in [0, 1)");
  fails(kiln_dropout(x, NAN), "dropout: rate = nan is not in [0, 1)");
  fails(kiln_dropout(i32({2}, {1, 2}), 0.5), "dropout: dtype i32 is not supported");
  // staged: the same errors while tracing, the function's call fails
  Body bad = [](kiln_tensor *const *in) { return kiln_conv2d(in[0], in[1], nullptr); };
  kiln_function *fn = kiln_function_new("bad_conv", body_of, &bad, 2, 1);
  kiln_tensor *in[2] = {x, f32({3, 3, 2, 2}, std::vector<float>(36, 1))}, *out = nullptr;
  EXPECT_EQ(kiln_function_call(fn, in, &out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("conv2d: channel mismatch"));
  kiln_function_free(fn);
  kiln_clear_error();
}

// ---- the direct convolution (lib/conv_direct.c) ----
// One group: tiles of 14 (JIT) or 6 (C) pixels x 32 channels read from the
// image in place; edge tiles (padding, fewer pixels than the tile) through
// a zero-padded copy. The cases put tiles on every edge: widths that the
// tile does not divide, channels past a multiple of 32, padding on each
// side (more than the window too), strides, dilations (along x: one tap per
// (ky, kx) instead of one per ky), 1x1 (every pixel one row of tiles) and
// the 7x7 stride-2 stem; rows of 7 or 31 take the narrow tile (7 pixels).
// The input gradient takes the direct kernel from 16 image channels on
// (phase by phase when strided): the strided cases have that many.

std::vector<ConvCase> direct_cases() {
  std::vector<ConvCase> v;
  Geo p1;
  p1.pad[0] = p1.pad[1] = p1.pad[2] = p1.pad[3] = 1;
  v.push_back({"3x3 pad 1, 31 wide, 37 out", {1, 9, 31, 5}, {3, 3, 5, 37}, p1});
  Geo s2;
  s2.sh = s2.sw = 2, s2.pad[0] = 1, s2.pad[1] = 0, s2.pad[2] = 1, s2.pad[3] = 2;
  v.push_back({"stride 2, asymmetric padding", {2, 11, 29, 17}, {3, 3, 17, 40}, s2});
  Geo d;
  d.dh = 2, d.dw = 3, d.pad[0] = 2, d.pad[1] = 2, d.pad[2] = 3, d.pad[3] = 1;
  v.push_back({"dilation 2x3 with padding", {1, 10, 33, 4}, {3, 2, 4, 33}, d});
  Geo stem;
  stem.sh = stem.sw = 2, stem.pad[0] = stem.pad[1] = stem.pad[2] = stem.pad[3] = 3;
  v.push_back({"7x7 stride 2 stem", {1, 40, 46, 3}, {7, 7, 3, 16}, stem});
  v.push_back({"1x1", {2, 7, 30, 20}, {1, 1, 20, 70}, {}});
  Geo s1;
  s1.sh = 2, s1.sw = 3;
  v.push_back({"1x1 stride 2x3", {1, 9, 33, 16}, {1, 1, 16, 33}, s1});
  // the filter gradient packs a 1x1's pixels block by block of rows (3 here)
  // for tiles of channels, the last one partial
  v.push_back({"1x1 over blocks of rows", {2, 40, 128, 40}, {1, 1, 40, 70}, {}});
  Geo below;  // padding below and right only: a 1x1 that reads zeros
  below.pad[1] = 1, below.pad[3] = 2;
  v.push_back({"1x1 padded below and right", {1, 6, 9, 17}, {1, 1, 17, 20}, below});
  Geo big;
  big.pad[0] = big.pad[1] = big.pad[2] = big.pad[3] = 4;
  v.push_back({"padding past the window", {1, 5, 17, 3}, {3, 3, 3, 8}, big});
  Geo sw3;
  sw3.sw = 3, sw3.pad[2] = 2, sw3.pad[3] = 2;
  v.push_back({"stride 3 along x, 50 wide", {1, 8, 50, 7}, {2, 4, 7, 9}, sw3});
  Geo dil;
  dil.dh = 1, dil.dw = 2, dil.sh = 3, dil.pad[0] = 1;
  v.push_back({"dilation along x, stride 3 down", {2, 10, 20, 9}, {2, 3, 9, 64}, dil});
  v.push_back({"one pixel wide", {1, 6, 1, 4}, {3, 1, 4, 5}, {}});
  v.push_back({"64 -> 64, 56 wide", {1, 4, 56, 64}, {3, 3, 64, 64}, p1});
  Geo s3;
  s3.sh = 3, s3.sw = 2, s3.pad[0] = 2, s3.pad[1] = 1, s3.pad[2] = 0, s3.pad[3] = 2;
  v.push_back({"stride 3x2, 4x5 filter, odd image", {2, 13, 17, 16}, {4, 5, 16, 35}, s3});
  Geo s4;
  s4.sh = s4.sw = 4, s4.pad[0] = s4.pad[2] = 1;
  v.push_back({"stride 4 past a 3x3 window", {1, 15, 30, 18}, {3, 3, 18, 7}, s4});
  // a filter of more than 1 MB a column tile: tasks take the columns in groups
  v.push_back({"3x3 1024 -> 70, 5 wide", {1, 3, 5, 1024}, {3, 3, 1024, 70}, p1});
  // the filter gradient packs dy NR channels at a time from rows of 1 KiB
  // on (the last tile partial), and splits blocks over parts with dfs of
  // their own where df is small: both, with partial last blocks of rows
  v.push_back({"1x1 to 260 channels", {2, 20, 30, 24}, {1, 1, 24, 260}, {}});
  v.push_back({"3x3 stride 2 to 300 channels over blocks", {2, 50, 120, 8}, {3, 3, 8, 300}, s2});
  // small images: the filter gradient sums several a block (8 of 30
  // pixels here), the last block fewer (2, 3)
  v.push_back({"1x1 over blocks of 8 images", {10, 5, 6, 64}, {1, 1, 64, 64}, {}});
  v.push_back({"3x3 over blocks of 8 images", {11, 6, 5, 32}, {3, 3, 32, 40}, p1});
  return v;
}

op_attrs attrs_of(const Geo &g) {
  op_attrs a = {};
  a.stride[0] = g.sh, a.stride[1] = g.sw, a.dilation[0] = g.dh, a.dilation[1] = g.dw, a.groups = g.groups;
  for (int i = 0; i < 4; i++) a.padding[i] = g.pad[i];
  return a;
}

// The gradient of conv2d(x, f) with respect to f for the upstream gradient
// v (the tape seeds ones into y * v: the gradient into y is v exactly).
kiln_tensor *filter_grad(kiln_tensor *x, kiln_tensor *f, kiln_tensor *v, const kiln_conv_opts *o) {
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, f);
  kiln_tensor *y = kiln_mul(kiln_conv2d(x, f, o), v), *g = nullptr;
  EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &f, &g), 0) << kiln_last_error();
  kiln_tape_free(tape);
  return g;
}

// df[ky, kx, c, o] = sum over (n, oy, ox) of x[n, oy*sh - pt + ky*dh, ox*sw - pl + kx*dw, c] v[n, oy, ox, o]
VD ref_filter_grad(const VD &x, const V64 &xs, const VD &v, const V64 &ys, const V64 &fs, const Geo &g) {
  int64_t h = xs[1], w = xs[2], c = xs[3], kh = fs[0], kw = fs[1], o = fs[3];
  VD df((size_t)numel(fs), 0.0);
  for (int64_t b = 0; b < ys[0]; b++)
    for (int64_t oy = 0; oy < ys[1]; oy++)
      for (int64_t ox = 0; ox < ys[2]; ox++)
        for (int64_t ky = 0; ky < kh; ky++)
          for (int64_t kx = 0; kx < kw; kx++) {
            int64_t iy = oy * g.sh - g.pad[0] + ky * g.dh, ix = ox * g.sw - g.pad[2] + kx * g.dw;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            for (int64_t ci = 0; ci < c; ci++)
              for (int64_t k = 0; k < o; k++)
                df[(size_t)(((ky * kw + kx) * c + ci) * o + k)] += x[(size_t)(((b * h + iy) * w + ix) * c + ci)] *
                                                                   v[(size_t)(((b * ys[1] + oy) * ys[2] + ox) * o + k)];
          }
  return df;
}

// dx[n, iy, ix, c] = sum of v[n, oy, ox, o] f[ky, kx, c, o] over the windows that read x[n, iy, ix, c]
VD ref_input_grad(const VD &v, const V64 &ys, const VD &f, const V64 &fs, const V64 &xs, const Geo &g) {
  int64_t h = xs[1], w = xs[2], c = xs[3], kh = fs[0], kw = fs[1], o = fs[3];
  VD dx((size_t)numel(xs), 0.0);
  for (int64_t b = 0; b < ys[0]; b++)
    for (int64_t oy = 0; oy < ys[1]; oy++)
      for (int64_t ox = 0; ox < ys[2]; ox++)
        for (int64_t ky = 0; ky < kh; ky++)
          for (int64_t kx = 0; kx < kw; kx++) {
            int64_t iy = oy * g.sh - g.pad[0] + ky * g.dh, ix = ox * g.sw - g.pad[2] + kx * g.dw;
            if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
            for (int64_t ci = 0; ci < c; ci++)
              for (int64_t k = 0; k < o; k++)
                dx[(size_t)(((b * h + iy) * w + ix) * c + ci)] += v[(size_t)(((b * ys[1] + oy) * ys[2] + ox) * o + k)] *
                                                                   f[(size_t)(((ky * kw + kx) * c + ci) * o + k)];
          }
  return dx;
}

// conv2d and its two gradients for every direct case in f32 and f64
// against the references (the input gradient of a strided convolution
// phase by phase, the phases a 1x1 stride-2 filter never reaches zeros), with the compiled micro-kernels and with the C
// ones (KILN_GEMM=c): the two give the same bits (each element one chain of
// FMAs over the taps, then k; the filter gradient's over each image's
// pixels, images added in turn).
TEST(ConvDirect, EveryEdgeMatchesTheReferenceAndTheCKernelsBits) {
  Scoped s;
  std::mt19937_64 rng(21);
  for (const ConvCase &c : direct_cases()) {
    for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
      SCOPED_TRACE(std::string(c.name) + " " + kiln_dtype_name(dt));
      kiln_scope_push();
      VD xv = random_values(rng, numel(c.x)), fv = random_values(rng, numel(c.f));
      V64 ys;
      VD want = ref_conv(xv, c.x, fv, c.f, c.g, &ys);
      kiln_conv_opts o = opts_of(c.g);
      kiln_tensor *x = from_values(dt, c.x, xv), *f = from_values(dt, c.f, fv);
      kiln_tensor *y = kiln_conv2d(x, f, &o);
      ASSERT_NE(y, nullptr) << kiln_last_error();
      EXPECT_EQ(shape_of(y), ys);
      double k = (double)(c.f[0] * c.f[1] * c.f[2]);  // f32 rounding grows with the sum's length
      expect_near_all(values(y), want, dt == KILN_F32 ? 1e-5 * (1 + k / 1000) : 1e-13, "conv2d");
      VD vv = random_values(rng, numel(ys));
      kiln_tensor *v = from_values(dt, ys, vv);
      kiln_tensor *df = filter_grad(x, f, v, &o);
      ASSERT_NE(df, nullptr);
      expect_near_all(values(df), ref_filter_grad(xv, c.x, vv, ys, c.f, c.g), dt == KILN_F32 ? 1e-4 : 1e-12,
                      "filter gradient");
      int64_t hw[2] = {c.x[1], c.x[2]};
      kiln_tensor *dx = kiln_conv2d_transpose(v, f, hw, &o);
      ASSERT_NE(dx, nullptr) << kiln_last_error();
      expect_near_all(values(dx), ref_input_grad(vv, ys, fv, c.f, c.x, c.g), dt == KILN_F32 ? 1e-4 : 1e-12,
                      "input gradient");
      kiln_tensor *yc, *dfc, *dxc;
      {
        EnvGuard cg("KILN_GEMM", "c");
        yc = kiln_conv2d(x, f, &o);
        dfc = filter_grad(x, f, v, &o);
        dxc = kiln_conv2d_transpose(v, f, hw, &o);
      }
      ASSERT_NE(yc, nullptr) << kiln_last_error();
      EXPECT_TRUE(same_bits(y, yc)) << "the C micro-kernel's bits differ";
      EXPECT_TRUE(same_bits(df, dfc)) << "the C filter-gradient micro-kernel's bits differ";
      EXPECT_TRUE(same_bits(dx, dxc)) << "the C micro-kernel's input-gradient bits differ";
      kiln_scope_pop();
    }
  }
}

// conv2d_epilogue (conv.h) has the bits of the separate ops: conv2d, + bias,
// relu (tanh within a few ulps: the compiled epilogue's tanh is its own);
// the residual after the bias. Through the direct kernel (JIT and C) and
// the paths that apply the epilogue afterwards (groups, depthwise).
TEST(ConvEpilogue, EqualsTheSeparateOps) {
  Scoped s;
  std::mt19937_64 rng(22);
  std::vector<ConvCase> cases = direct_cases();
  Geo g2;
  g2.groups = 2, g2.pad[0] = g2.pad[1] = g2.pad[2] = g2.pad[3] = 1;
  cases.push_back({"2 groups", {2, 4, 5, 4}, {3, 3, 2, 6}, g2});
  Geo dw;
  dw.groups = 3, dw.sh = dw.sw = 2, dw.pad[1] = dw.pad[3] = 1;
  cases.push_back({"depthwise", {1, 5, 5, 3}, {3, 3, 1, 3}, dw});
  for (const char *gemm : {"", "c"}) {
    EnvGuard cg("KILN_GEMM", *gemm ? gemm : nullptr);
    for (const ConvCase &c : cases) {
      for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
        SCOPED_TRACE(std::string(c.name) + " " + kiln_dtype_name(dt) + (*gemm ? " KILN_GEMM=c" : ""));
        kiln_scope_push();
        kiln_conv_opts o = opts_of(c.g);
        op_attrs a = attrs_of(c.g);
        kiln_tensor *x = from_values(dt, c.x, random_values(rng, numel(c.x)));
        kiln_tensor *f = from_values(dt, c.f, random_values(rng, numel(c.f)));
        kiln_tensor *bias = from_values(dt, {c.f[3]}, random_values(rng, c.f[3]));
        kiln_tensor *y = kiln_conv2d(x, f, &o);
        ASSERT_NE(y, nullptr) << kiln_last_error();
        V64 ys = shape_of(y);
        kiln_tensor *res = from_values(dt, ys, random_values(rng, numel(ys)));
        kiln_tensor *yb = kiln_add(y, bias);
        kiln_tensor *want[GEMM_EPI_COUNT] = {y, yb, kiln_relu(yb), kiln_tanh(yb)};
        kiln_tensor *ybr = kiln_add(yb, res);
        kiln_tensor *want_res[GEMM_EPI_COUNT] = {kiln_add(y, res), ybr, kiln_relu(ybr), kiln_tanh(ybr)};
        for (int e = 0; e < GEMM_EPI_COUNT; e++) {
          kiln_tensor *out = kiln_zeros(dt, (int)ys.size(), ys.data());
          ASSERT_EQ(conv2d_epilogue(x, f, bias, (gemm_epilogue)e, &a, out), 0) << kiln_last_error();
          if (e == GEMM_EPI_BIAS_TANH)
            EXPECT_TRUE(within_ulps(out, want[e], 4)) << "epilogue " << e;
          else
            EXPECT_TRUE(same_bits(out, want[e])) << "epilogue " << e;
          ASSERT_EQ(conv2d_epilogue_residual(x, f, bias, (gemm_epilogue)e, res, &a, out), 0) << kiln_last_error();
          if (e == GEMM_EPI_BIAS_TANH)
            EXPECT_TRUE(within_ulps(out, want_res[e], 4)) << "residual, epilogue " << e;
          else
            EXPECT_TRUE(same_bits(out, want_res[e])) << "residual, epilogue " << e;
        }
        kiln_scope_pop();
      }
    }
  }
}

TEST(ConvEpilogue, BadInputsAreErrors) {
  Scoped s;
  Geo g;
  g.pad[0] = g.pad[1] = g.pad[2] = g.pad[3] = 1;
  op_attrs a = attrs_of(g);
  kiln_tensor *x = kiln_zeros(KILN_F32, 4, (const int64_t[]){1, 4, 4, 2});
  kiln_tensor *f = kiln_zeros(KILN_F32, 4, (const int64_t[]){3, 3, 2, 3});
  kiln_tensor *bias = kiln_zeros(KILN_F32, 1, (const int64_t[]){3});
  kiln_tensor *out = kiln_zeros(KILN_F32, 4, (const int64_t[]){1, 4, 4, 3});
  auto fails = [](int rc, const char *msg) {
    EXPECT_EQ(rc, -1);
    EXPECT_THAT(kiln_last_error(), StartsWith(msg));
  };
  EXPECT_EQ(conv2d_epilogue(x, f, bias, GEMM_EPI_BIAS_RELU, &a, out), 0) << kiln_last_error();
  fails(conv2d_epilogue(nullptr, f, bias, GEMM_EPI_BIAS, &a, out), "conv2d: NULL operand");
  fails(conv2d_epilogue(x, f, bias, GEMM_EPI_BIAS, nullptr, out), "conv2d: NULL operand");
  fails(conv2d_epilogue(x, f, bias, (gemm_epilogue)9, &a, out), "conv2d: no epilogue 9");
  fails(conv2d_epilogue(x, f, nullptr, GEMM_EPI_BIAS, &a, out), "conv2d: the bias must be 3 values");
  fails(conv2d_epilogue(x, f, kiln_zeros(KILN_F32, 1, (const int64_t[]){2}), GEMM_EPI_BIAS, &a, out),
        "conv2d: the bias must be 3 values");
  fails(conv2d_epilogue(x, f, kiln_zeros(KILN_F64, 1, (const int64_t[]){3}), GEMM_EPI_BIAS, &a, out),
        "conv2d: the bias must be 3 values");
  fails(conv2d_epilogue(x, f, bias, GEMM_EPI_BIAS, &a, kiln_zeros(KILN_F32, 4, (const int64_t[]){1, 2, 2, 3})),
        "conv2d: the output does not have the convolution's type");
  fails(conv2d_epilogue(x, kiln_zeros(KILN_F32, 4, (const int64_t[]){3, 3, 5, 3}), bias, GEMM_EPI_BIAS, &a, out),
        "conv2d: channel mismatch");
  kiln_tensor *xi = kiln_zeros(KILN_I32, 4, (const int64_t[]){1, 4, 4, 2});
  fails(conv2d_epilogue(xi, f, bias, GEMM_EPI_NONE, &a, out), "conv2d: a fused conv2d needs f32 or f64, not i32");
  op_attrs neg = a;
  neg.padding[0] = -1;
  fails(conv2d_epilogue(x, f, bias, GEMM_EPI_BIAS, &neg, out), "conv2d:");
  fails(conv2d_epilogue_residual(x, f, bias, GEMM_EPI_BIAS, nullptr, &a, out), "conv2d: NULL residual");
  fails(conv2d_epilogue_residual(x, f, bias, GEMM_EPI_BIAS, bias, &a, out),
        "conv2d: the residual must have the convolution's type");
  fails(conv2d_epilogue_residual(x, f, bias, GEMM_EPI_BIAS, out, &a, out),
        "conv2d: the residual and the output must not alias");
  kiln_clear_error();
}

// ---- threads ----

uint64_t conv_fnv(const kiln_tensor *t, uint64_t h) {
  const unsigned char *p = (const unsigned char *)kiln_tensor_data(t);
  size_t n = (size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t));
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// convolutions big enough to split over threads (and their gradients), as
// one checksum
uint64_t conv_checksum() {
  std::mt19937_64 rng(23);
  uint64_t h = 1469598103934665603ull;
  for (const ConvCase &c : direct_cases()) {
    kiln_scope_push();
    V64 xs = c.x;
    xs[0] = 3;  // more rows
    kiln_conv_opts o = opts_of(c.g);
    kiln_tensor *x = from_values(KILN_F32, xs, random_values(rng, numel(xs)));
    kiln_tensor *f = from_values(KILN_F32, c.f, random_values(rng, numel(c.f)));
    kiln_tensor *y = kiln_conv2d(x, f, &o);
    EXPECT_NE(y, nullptr) << kiln_last_error();
    if (y) {
      h = conv_fnv(y, h);
      int64_t hw[2] = {xs[1], xs[2]};
      kiln_tensor *dx = kiln_conv2d_transpose(y, f, hw, &o);
      EXPECT_NE(dx, nullptr) << kiln_last_error();
      if (dx) h = conv_fnv(dx, h);
      kiln_tensor *df = filter_grad(x, f, y, &o);
      EXPECT_NE(df, nullptr) << kiln_last_error();
      if (df) h = conv_fnv(df, h);
    }
    kiln_scope_pop();
  }
  return h;
}

// The child's side of ConvDirect.AnyThreadCountGivesTheSameBits (as
// gemm_test's): with KILN_CONV_TEST_CHILD set, prints the checksum and exits
// before main.
int conv_child_role() {
  if (!getenv("KILN_CONV_TEST_CHILD")) return 0;
  unsigned long long sum;
  {
    Scoped scope;
    sum = (unsigned long long)conv_checksum();
  }
  bool failed = ::testing::UnitTest::GetInstance()->ad_hoc_test_result().Failed();
  printf("checksum %llu threads %d\n", sum, kiln_num_threads());
  fflush(stdout);
  _exit(failed ? 1 : 0);
}
const int conv_child_hook = conv_child_role();

std::string run_conv_child(const std::string &env, int *rc) { return run_self(env + " KILN_CONV_TEST_CHILD=1", rc); }

// The pool reads KILN_NUM_THREADS once: each count in a process of its own.
// Every output element is one micro-kernel's sum, whichever thread runs it;
// the C micro-kernel sums in the same order.
TEST(ConvDirect, AnyThreadCountGivesTheSameBits) {
  uint64_t here;
  {
    Scoped scope;
    here = conv_checksum();
  }
  EnvGuard any("KILN_GEMM", nullptr), cpu("KILN_BACKEND", "cpu");
  for (const char *env : {"KILN_NUM_THREADS=1", "KILN_NUM_THREADS=2", "KILN_NUM_THREADS=3",
                          "KILN_NUM_THREADS=2 KILN_GEMM=c"}) {
    int rc;
    std::string out = run_conv_child(env, &rc);
    EXPECT_EQ(rc, 0) << env << ": " << out;
    EXPECT_THAT(out, HasSubstr("checksum " + std::to_string((unsigned long long)here))) << env;
  }
}

}  // namespace
