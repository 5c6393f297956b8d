// gradient_test.cc — the gradient of every differentiable primitive and
// composite against central finite differences in f64, on random inputs kept
// away from kinks, ties and discontinuities; with broadcasting wherever the
// op broadcasts. Also checks that f32 gradients come back as f32.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "test_util.h"

namespace {

using Tensors = std::vector<kiln_tensor *>;
using Fn = std::function<kiln_tensor *(const Tensors &)>;
using Shape = std::vector<int64_t>;

using namespace kiln_test;

std::mt19937_64 &gen() {
  static std::mt19937_64 g(20240601);
  return g;
}

int64_t count(const Shape &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

kiln_tensor *boolean(const Shape &s, const std::vector<uint8_t> &d) { return make(KILN_BOOL, s, d); }

std::vector<double> uniform_values(int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v((size_t)n);
  for (double &x : v) x = u(gen());
  return v;
}
// Uniform in [lo, hi).
kiln_tensor *uniform(const Shape &s, double lo, double hi) {
  return f64(s, uniform_values(count(s), lo, hi));
}
// |x| in [lo, hi) with a random sign: away from the kink at 0.
kiln_tensor *signed_away(const Shape &s, double lo, double hi) {
  std::vector<double> v = uniform_values(count(s), lo, hi);
  std::bernoulli_distribution coin(0.5);
  for (double &x : v)
    if (coin(gen())) x = -x;
  return f64(s, v);
}
// Pairwise distinct values at least 0.1 apart across all the given shapes
// (a shuffled grid with a little jitter): no ties for max/min.
Tensors distinct(const std::vector<Shape> &shapes) {
  int64_t total = 0;
  for (const Shape &s : shapes) total += count(s);
  std::vector<double> grid((size_t)total);
  std::uniform_real_distribution<double> jitter(-0.05, 0.05);
  for (int64_t i = 0; i < total; i++) grid[(size_t)i] = 0.2 * (double)(i - total / 2) + jitter(gen());
  std::shuffle(grid.begin(), grid.end(), gen());
  Tensors out;
  size_t at = 0;
  for (const Shape &s : shapes) {
    std::vector<double> v(grid.begin() + (long)at, grid.begin() + (long)(at + (size_t)count(s)));
    at += (size_t)count(s);
    out.push_back(f64(s, v));
  }
  return out;
}

bool is_float(const kiln_tensor *t) {
  return kiln_tensor_dtype(t) == KILN_F32 || kiln_tensor_dtype(t) == KILN_F64;
}

// A copy of x (f32 or f64) with element j moved by delta.
kiln_tensor *nudged(kiln_tensor *x, int64_t j, double delta) {
  std::vector<double> v = values(x);
  v[(size_t)j] += delta;
  Shape s = shape_of(x);
  kiln_tensor *t = f64(s, v);
  return kiln_tensor_dtype(x) == KILN_F64 ? t : kiln_cast(t, kiln_tensor_dtype(x));
}

// sum(f(xs) * w), evaluated without any tape, in double.
double weighted_sum(const Fn &f, const Tensors &xs, const std::vector<double> &w) {
  kiln_scope_push();
  kiln_tensor *y = f(xs);
  double s = NAN;
  if (y) {
    std::vector<double> v = values(y);
    s = 0;
    for (size_t i = 0; i < v.size() && i < w.size(); i++) s += v[i] * w[i];
  }
  kiln_scope_pop();
  return s;
}

// The tape gradient of target = sum(f(xs) * w), w a fixed random weight (so
// that a permuted or misplaced gradient shows), against central differences
// with step h, element by element: |tape - fd| <= atol + rtol * |fd|.
// Float inputs are watched; the others (indices, conditions) must get NULL.
void check_gradients(const Fn &f, const Tensors &xs, double h = 1e-6, double atol = 1e-6,
                     double rtol = 1e-5) {
  for (kiln_tensor *x : xs) ASSERT_NE(x, nullptr) << kiln_last_error();
  kiln_scope_push();
  kiln_tape *tape = kiln_tape_begin(false);
  ASSERT_NE(tape, nullptr);
  for (kiln_tensor *x : xs) kiln_tape_watch(tape, x);
  kiln_tensor *y = f(xs);
  ASSERT_NE(y, nullptr) << kiln_last_error();
  std::vector<double> w = uniform_values(kiln_tensor_size(y), 0.5, 1.5);
  Shape ys = shape_of(y);
  kiln_tensor *wt = f64(ys, w);
  if (kiln_tensor_dtype(y) != KILN_F64) wt = kiln_cast(wt, kiln_tensor_dtype(y));
  kiln_tensor *target = kiln_mul(y, wt);
  kiln_tape_end(tape);
  Tensors grads(xs.size());
  ASSERT_EQ(kiln_tape_gradient(tape, target, (int)xs.size(), xs.data(), grads.data()), 0)
      << kiln_last_error();
  kiln_tape_free(tape);
  for (size_t i = 0; i < xs.size(); i++) {
    SCOPED_TRACE("input " + std::to_string(i));
    if (!is_float(xs[i])) {
      EXPECT_EQ(grads[i], nullptr) << "a non-float input got a gradient";
      continue;
    }
    ASSERT_NE(grads[i], nullptr) << "no gradient";
    EXPECT_EQ(kiln_tensor_dtype(grads[i]), kiln_tensor_dtype(xs[i]));
    ASSERT_EQ(shape_of(grads[i]), shape_of(xs[i]));
    std::vector<double> g = values(grads[i]);
    for (int64_t j = 0; j < kiln_tensor_size(xs[i]); j++) {
      Tensors plus = xs, minus = xs;
      kiln_scope_push();
      plus[i] = nudged(xs[i], j, h);
      minus[i] = nudged(xs[i], j, -h);
      double fd = (weighted_sum(f, plus, w) - weighted_sum(f, minus, w)) / (2 * h);
      kiln_scope_pop();
      EXPECT_NEAR(g[(size_t)j], fd, atol + rtol * std::fabs(fd)) << "element " << j;
    }
  }
  kiln_scope_pop();
}

// Shapes for binary ops: same shape, and every way of broadcasting.
const std::vector<std::pair<Shape, Shape>> kBinaryShapes = {
    {{2, 3}, {2, 3}}, {{2, 3}, {3}}, {{3}, {2, 3}},       {{2, 1}, {1, 3}},
    {{}, {2, 3}},     {{2, 3}, {}},  {{4, 1, 3}, {2, 3}},
};

// ---- elementwise unary ----

struct Unary {
  const char *name;
  kiln_tensor *(*op)(kiln_tensor *);
  std::function<kiln_tensor *(const Shape &)> input;
};

TEST(Gradient, UnaryOps) {
  Shape s = {2, 3};
  std::vector<Unary> ops = {
      {"neg", kiln_neg, [](const Shape &s) { return uniform(s, -2, 2); }},
      {"abs", kiln_abs, [](const Shape &s) { return signed_away(s, 0.1, 2); }},
      {"exp", kiln_exp, [](const Shape &s) { return uniform(s, -2, 2); }},
      {"log", kiln_log, [](const Shape &s) { return uniform(s, 0.2, 3); }},
      {"log1p", kiln_log1p, [](const Shape &s) { return uniform(s, -0.5, 3); }},
      {"sqrt", kiln_sqrt, [](const Shape &s) { return uniform(s, 0.2, 3); }},
      {"rsqrt", kiln_rsqrt, [](const Shape &s) { return uniform(s, 0.2, 3); }},
      {"sin", kiln_sin, [](const Shape &s) { return uniform(s, -3, 3); }},
      {"cos", kiln_cos, [](const Shape &s) { return uniform(s, -3, 3); }},
      {"tanh", kiln_tanh, [](const Shape &s) { return uniform(s, -2, 2); }},
      {"sigmoid", kiln_sigmoid, [](const Shape &s) { return uniform(s, -4, 4); }},
      {"relu", kiln_relu, [](const Shape &s) { return signed_away(s, 0.1, 2); }},
      {"square", kiln_square, [](const Shape &s) { return uniform(s, -2, 2); }},
  };
  for (const Unary &u : ops) {
    SCOPED_TRACE(u.name);
    Scoped scope;
    auto op = u.op;
    check_gradients([op](const Tensors &x) { return op(x[0]); }, {u.input(s)});
    check_gradients([op](const Tensors &x) { return op(x[0]); }, {u.input({})});  // a scalar
  }
}

// ---- elementwise binary ----

struct Binary {
  const char *name;
  kiln_tensor *(*op)(kiln_tensor *, kiln_tensor *);
  std::function<Tensors(const Shape &, const Shape &)> inputs;
};

TEST(Gradient, BinaryOpsWithBroadcasting) {
  auto any = [](const Shape &a, const Shape &b) { return Tensors{uniform(a, -2, 2), uniform(b, -2, 2)}; };
  std::vector<Binary> ops = {
      {"add", kiln_add, any},
      {"sub", kiln_sub, any},
      {"mul", kiln_mul, any},
      {"div", kiln_div,
       [](const Shape &a, const Shape &b) {
         return Tensors{uniform(a, -2, 2), signed_away(b, 0.5, 2)};
       }},
      {"pow", kiln_pow,
       [](const Shape &a, const Shape &b) {
         return Tensors{uniform(a, 0.3, 2), uniform(b, -2, 2)};
       }},
      {"maximum", kiln_maximum,
       [](const Shape &a, const Shape &b) {
         return distinct({a, b});
       }},
      {"minimum", kiln_minimum,
       [](const Shape &a, const Shape &b) {
         return distinct({a, b});
       }},
  };
  for (const Binary &b : ops) {
    for (const auto &shapes : kBinaryShapes) {
      SCOPED_TRACE(std::string(b.name) + " " + ::testing::PrintToString(shapes));
      Scoped scope;
      auto op = b.op;
      check_gradients([op](const Tensors &x) { return op(x[0], x[1]); },
                      b.inputs(shapes.first, shapes.second));
    }
  }
}

// fmod jumps where a / b is an integer. |b| in [1.9, 2.1] and |a| within
// 0.2 of an odd integer up to 5 keep every quotient, whichever elements
// broadcasting pairs, at least 0.2 from an integer; signs are random.
TEST(Gradient, ModWithBroadcasting) {
  for (const auto &shapes : kBinaryShapes) {
    SCOPED_TRACE(::testing::PrintToString(shapes));
    Scoped scope;
    std::vector<double> a = values(signed_away(shapes.first, 0.8, 1.2));
    std::uniform_int_distribution<int> odd(0, 2);
    for (double &v : a) v = std::copysign(std::fabs(v) - 1 + 2 * odd(gen()) + 1, v);
    kiln_tensor *b = signed_away(shapes.second, 1.9, 2.1);
    check_gradients([](const Tensors &x) { return kiln_mod(x[0], x[1]); }, {f64(shapes.first, a), b});
  }
}

TEST(Gradient, SelectWithBroadcasting) {
  Scoped scope;
  kiln_tensor *cond = boolean({2, 3}, {1, 0, 0, 1, 1, 0});
  auto f = [](const Tensors &x) { return kiln_select(x[0], x[1], x[2]); };
  check_gradients(f, {cond, uniform({2, 3}, -2, 2), uniform({2, 3}, -2, 2)});
  check_gradients(f, {cond, uniform({3}, -2, 2), uniform({}, -2, 2)});
  check_gradients(f, {boolean({2, 1}, {1, 0}), uniform({1, 3}, -2, 2), uniform({2, 3}, -2, 2)});
}

// The cast rule sends the gradient back in the input's dtype; the f32 round
// trip costs precision, so the step and tolerance are those of f32.
TEST(Gradient, CastChain) {
  Scoped scope;
  auto f = [](const Tensors &x) { return kiln_cast(kiln_square(kiln_cast(x[0], KILN_F32)), KILN_F64); };
  check_gradients(f, {uniform({5}, 0.5, 2)}, 1e-2, 1e-3, 1e-3);
  auto g = [](const Tensors &x) { return kiln_cast(kiln_cast(x[0], KILN_F32), KILN_F64); };
  check_gradients(g, {uniform({2, 2}, -2, 2)}, 1e-2, 1e-4, 1e-4);
}

// ---- data movement ----

TEST(Gradient, DataMovement) {
  Scoped scope;
  check_gradients([](const Tensors &x) { return kiln_identity(x[0]); }, {uniform({2, 3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_reshape(x[0], KILN_SHAPE(3, -1)); },
                  {uniform({2, 3, 2}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_reshape(x[0], 0, nullptr); }, {uniform({1, 1}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_broadcast_to(x[0], KILN_SHAPE(4, 2, 3)); },
                  {uniform({2, 1}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_broadcast_to(x[0], KILN_SHAPE(2, 3)); },
                  {uniform({}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_broadcast_to(x[0], KILN_SHAPE(2, 3)); },
                  {uniform({3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_transpose(x[0], 0, nullptr); },
                  {uniform({2, 3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_transpose(x[0], KILN_AXES(1, 2, 0)); },
                  {uniform({2, 3, 4}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_transpose(x[0], KILN_AXES(2, 0, 1)); },
                  {uniform({2, 3, 4}, -1, 1)});
  check_gradients(
      [](const Tensors &x) {
        const int64_t begin[] = {1, 0, 2}, size[] = {2, -1, 1};
        return kiln_slice(x[0], begin, size);
      },
      {uniform({4, 2, 3}, -1, 1)});
  check_gradients(
      [](const Tensors &x) {
        const int64_t begin[] = {0, 1}, size[] = {3, 2};
        return kiln_slice(x[0], begin, size);
      },
      {uniform({3, 4}, -1, 1)});
  for (int axis : {0, 1, -1}) {
    SCOPED_TRACE("concat axis " + std::to_string(axis));
    Shape a = {2, 3}, b = {2, 3}, c = {2, 3};
    (axis == 0 ? b[0] : b[1]) = 1, (axis == 0 ? c[0] : c[1]) = 4;
    check_gradients([axis](const Tensors &x) { return kiln_concat(3, x.data(), axis); },
                    {uniform(a, -1, 1), uniform(b, -1, 1), uniform(c, -1, 1)});
  }
  check_gradients([](const Tensors &x) { return kiln_concat(1, x.data(), 0); }, {uniform({3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_expand_dims(x[0], 1); }, {uniform({2, 3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_expand_dims(x[0], -1); }, {uniform({2, 3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_squeeze(x[0], 1); }, {uniform({2, 1, 3}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_index(x[0], 1); }, {uniform({3, 2}, -1, 1)});
  check_gradients([](const Tensors &x) { return kiln_index(x[0], -1); }, {uniform({3, 2, 2}, -1, 1)});
  for (int axis : {0, 1, 2, -1}) {
    SCOPED_TRACE("stack axis " + std::to_string(axis));
    check_gradients([axis](const Tensors &x) { return kiln_stack(3, x.data(), axis); },
                    {uniform({2, 3}, -1, 1), uniform({2, 3}, -1, 1), uniform({2, 3}, -1, 1)});
  }
  for (int axis : {0, 1}) {
    SCOPED_TRACE("split axis " + std::to_string(axis));
    // the parts put back in reverse order: each part's gradient must land in its own slice
    check_gradients(
        [axis](const Tensors &x) {
          kiln_tensor *parts[3] = {nullptr, nullptr, nullptr};
          if (kiln_split(x[0], 3, axis, parts)) return (kiln_tensor *)nullptr;
          kiln_tensor *rev[3] = {parts[2], parts[1], parts[0]};
          return kiln_concat(3, rev, axis);
        },
        {uniform({6, 3}, -1, 1)});
    check_gradients(  // only one part used: the others get zeros
        [axis](const Tensors &x) {
          kiln_tensor *parts[3] = {nullptr, nullptr, nullptr};
          if (kiln_split(x[0], 3, axis, parts)) return (kiln_tensor *)nullptr;
          return kiln_exp(parts[1]);
        },
        {uniform({3, 6}, -1, 1)});
  }
}

// ---- reductions ----

struct AxisSet {
  std::vector<int> axes;
  bool all;  // axes NULL
};

TEST(Gradient, Reductions) {
  using Reduce = kiln_tensor *(*)(kiln_tensor *, int, const int *, bool);
  struct Named {
    const char *name;
    Reduce op;
  };
  std::vector<Named> ops = {{"reduce_sum", kiln_reduce_sum},
                            {"reduce_mean", kiln_reduce_mean},
                            {"reduce_max", kiln_reduce_max},
                            {"reduce_min", kiln_reduce_min},
                            {"reduce_prod", kiln_reduce_prod}};
  std::vector<AxisSet> sets = {{{}, true},         {{0}, false},    {{1}, false},    {{2}, false},
                               {{-1}, false},      {{0, 2}, false}, {{2, 0}, false}, {{1, 2}, false},
                               {{0, 1, 2}, false}, {{}, false}};
  for (const Named &r : ops) {
    for (const AxisSet &s : sets) {
      for (bool keep : {false, true}) {
        SCOPED_TRACE(std::string(r.name) + " axes " + (s.all ? "NULL" : ::testing::PrintToString(s.axes)) +
                     (keep ? " keepdims" : ""));
        Scoped scope;
        Reduce op = r.op;
        AxisSet set = s;
        Fn f = [op, set, keep](const Tensors &x) {
          return op(x[0], set.all ? 0 : (int)set.axes.size(), set.all ? nullptr : set.axes.data(), keep);
        };
        // prod: magnitudes near 1 keep the product (and its derivative) well scaled
        kiln_tensor *x =
            r.op == kiln_reduce_prod ? signed_away({2, 3, 4}, 0.6, 1.4) : distinct({{2, 3, 4}})[0];
        check_gradients(f, {x});
      }
    }
  }
}

// The product of the others, also where an element is 0 (where prod / x
// would be NaN): one zero in a row gets the product of the rest, two zeros
// give zeros.
TEST(Gradient, ReduceProdWithZeros) {
  Scoped scope;
  kiln_tensor *x = f64({3, 3}, {2, 0, 3, 0, 0, 5, 1, 2, 4});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_reduce_prod(x, KILN_AXES(1), false);
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0) << kiln_last_error();
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(values(g), (std::vector<double>{0, 6, 0, 0, 0, 0, 8, 4, 2}));
  kiln_tape_free(tape);
  // finite differences agree around a single zero
  check_gradients([](const Tensors &x) { return kiln_reduce_prod(x[0], KILN_AXES(0), true); },
                  {f64({3, 2}, {0.5, 0, -1.5, 2, 3, 1.25})});
}

// ---- reduce_prod's second derivative at zeros ----
// The rule (the product of the others, as exclusive prefix times suffix
// products) must itself be differentiable where x has zeros: the Hessian of
// prod(x) is prod of all but i and j off the diagonal, 0 on it.

// prod over `axes` of x, every group's product of all elements but i and j
// (i != j, same group) summed over j: d/dx_i of sum(d prod/dx).
struct ProdCase {
  Shape shape;
  std::vector<double> x;
  std::vector<int> axes;  // empty: every axis
};

// The exact first derivative and d/dx of sum(first derivative), by brute force.
void prod_derivatives(const ProdCase &c, std::vector<double> *d1, std::vector<double> *d2) {
  int r = (int)c.shape.size();
  std::vector<bool> red((size_t)r, c.axes.empty());
  for (int a : c.axes) red[(size_t)(a < 0 ? a + r : a)] = true;
  int64_t n = count(c.shape);
  auto group = [&](int64_t flat) {  // the flat index with the reduced coordinates zeroed
    int64_t key = 0, stride = 1;
    for (int d = r - 1; d >= 0; d--) {
      int64_t coord = flat / stride % c.shape[(size_t)d];
      if (!red[(size_t)d]) key += coord * stride;
      stride *= c.shape[(size_t)d];
    }
    return key;
  };
  d1->assign((size_t)n, 0);
  d2->assign((size_t)n, 0);
  for (int64_t i = 0; i < n; i++) {
    double p = 1;
    for (int64_t k = 0; k < n; k++)
      if (k != i && group(k) == group(i)) p *= c.x[(size_t)k];
    (*d1)[(size_t)i] = p;
    for (int64_t j = 0; j < n; j++) {
      if (j == i || group(j) != group(i)) continue;
      double q = 1;
      for (int64_t k = 0; k < n; k++)
        if (k != i && k != j && group(k) == group(i)) q *= c.x[(size_t)k];
      (*d2)[(size_t)i] += q;
    }
  }
}

const std::vector<ProdCase> &prod_cases() {
  static const std::vector<ProdCase> cases = {
      {{3}, {0, 2, 3}, {}},                            // the case: [6 0 0] then [5 3 2]
      {{3}, {1.5, 2, 3}, {}},                          // no zero
      {{4}, {0, 2, 0, 3}, {}},                         // two zeros
      {{5}, {0, 0, 0, 1.5, 2}, {}},                    // three zeros
      {{1}, {0}, {}},                                  // one element
      {{2, 3}, {0, 2, 3, 0, 0, 4}, {1}},               // along an axis: one zero, two zeros
      {{2, 3}, {0, 2, 3, 1.5, 0, 4}, {0}},             // the other axis
      {{2, 2, 3}, {1, 0, 2, 3, 1, 2, 0, 0, 1, 2, 3, 4}, {0, 2}},  // two axes, not adjacent
      {{3, 1, 2}, {0, 1, 2, 0, 3, 4}, {-3, 1}},
  };
  return cases;
}

kiln_tensor *prod_of(kiln_tensor *x, const ProdCase &c, bool keepdims) {
  if (c.axes.empty()) return kiln_reduce_prod(x, 0, nullptr, keepdims);
  return kiln_reduce_prod(x, (int)c.axes.size(), c.axes.data(), keepdims);
}

void expect_close(const std::vector<double> &got, const std::vector<double> &want, double tol,
                  const char *what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); i++) EXPECT_NEAR(got[i], want[i], tol) << what << " element " << i;
}

TEST(Gradient, ReduceProdSecondDerivativeNestedTapes) {
  Scoped scope;
  for (bool keepdims : {false, true}) {
    for (const ProdCase &c : prod_cases()) {
      SCOPED_TRACE("case of " + std::to_string(c.x.size()) + " elements, keepdims " + std::to_string(keepdims));
      std::vector<double> d1, d2;
      prod_derivatives(c, &d1, &d2);
      kiln_scope_push();
      kiln_tensor *x = f64(c.shape, c.x);
      kiln_tape *outer = kiln_tape_begin(false);
      kiln_tape_watch(outer, x);
      kiln_tape *inner = kiln_tape_begin(false);
      kiln_tape_watch(inner, x);
      kiln_tensor *y = prod_of(x, c, keepdims);
      kiln_tape_end(inner);
      kiln_tensor *g = nullptr, *gg = nullptr;
      ASSERT_EQ(kiln_tape_gradient(inner, y, 1, &x, &g), 0) << kiln_last_error();
      kiln_tape_end(outer);
      ASSERT_EQ(kiln_tape_gradient(outer, g, 1, &x, &gg), 0) << kiln_last_error();
      kiln_tape_free(inner);
      kiln_tape_free(outer);
      expect_close(values(g), d1, 1e-12, "first derivative");
      if (c.x.size() == 1)  // the first derivative is the constant 1: no second one
        EXPECT_EQ(gg, nullptr);
      else
        expect_close(values(gg), d2, 1e-12, "second derivative");
      kiln_scope_pop();
    }
  }
  // the numbers, literally
  kiln_tensor *x = f64({0, 2, 3});
  kiln_tape *outer = kiln_tape_begin(true), *inner = kiln_tape_begin(true);
  kiln_tape_watch(outer, x);
  kiln_tape_watch(inner, x);
  kiln_tensor *g = nullptr, *gg = nullptr;
  ASSERT_EQ(kiln_tape_gradient(inner, kiln_reduce_prod(x, 0, nullptr, false), 1, &x, &g), 0);
  kiln_tape_end(inner);
  kiln_tape_end(outer);
  ASSERT_EQ(kiln_tape_gradient(outer, g, 1, &x, &gg), 0) << kiln_last_error();
  EXPECT_EQ(values(g), (std::vector<double>{6, 0, 0}));
  EXPECT_EQ(values(gg), (std::vector<double>{5, 3, 2}));
  kiln_tape_free(inner);
  kiln_tape_free(outer);
}

// The first derivative (from the tape) against central differences of the
// product, and the second against central differences of the exact first
// derivative, around zeros.
TEST(Gradient, ReduceProdDerivativesMatchFiniteDifferences) {
  Scoped scope;
  for (const ProdCase &c : prod_cases()) {
    SCOPED_TRACE("case of " + std::to_string(c.x.size()) + " elements");
    check_gradients([&c](const Tensors &x) { return prod_of(x[0], c, false); }, {f64(c.shape, c.x)});
    // d/dx sum(grad prod(x)): the tape's, against differences of the tape's first derivative
    Fn first = [&c](const Tensors &x) {
      kiln_tensor *xx = x[0];
      kiln_tape *t = kiln_tape_begin(false);
      kiln_tape_watch(t, xx);
      kiln_tensor *y = prod_of(xx, c, false), *g = nullptr;
      if (kiln_tape_gradient(t, y, 1, &xx, &g)) g = nullptr;
      kiln_tape_free(t);
      return g;
    };
    if (c.x.size() > 1) check_gradients(first, {f64(c.shape, c.x)});
  }
}

// A staged prod and the gradient of its gradient: compiled and interpreted.
int prod_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const ProdCase *c = static_cast<const ProdCase *>(user);
  out[0] = prod_of(in[0], *c, false);
  return out[0] ? 0 : -1;
}

// KILN_BACKEND for the traces compiled while it lives
struct BackendEnv : EnvGuard {
  explicit BackendEnv(const char *v) : EnvGuard("KILN_BACKEND", v) {}
};

TEST(Gradient, ReduceProdSecondDerivativeStaged) {
  Scoped scope;
  for (const char *backend : {"cpu", "interp"}) {
    BackendEnv env(backend);
    for (const ProdCase &c : prod_cases()) {
      SCOPED_TRACE(std::string(backend) + ", case of " + std::to_string(c.x.size()) + " elements");
      std::vector<double> d1, d2;
      prod_derivatives(c, &d1, &d2);
      kiln_function *f = kiln_function_new("prod", prod_body, const_cast<ProdCase *>(&c), 1, 1);
      kiln_function *df = kiln_gradients(f);
      kiln_function *ddf = kiln_gradients(df);
      ASSERT_NE(ddf, nullptr) << kiln_last_error();
      kiln_scope_push();
      kiln_tensor *x = f64(c.shape, c.x), *g = nullptr, *gg = nullptr;
      ASSERT_EQ(kiln_function_call(df, &x, &g), 0) << kiln_last_error();
      ASSERT_EQ(kiln_function_call(ddf, &x, &gg), 0) << kiln_last_error();
      expect_close(values(g), d1, 1e-12, "first derivative");
      expect_close(values(gg), d2, 1e-12, "second derivative");
      kiln_scope_pop();
      kiln_function_free(ddf);
      kiln_function_free(df);
      kiln_function_free(f);
    }
  }
}

// At a tie the gradient is split evenly (kiln.h): reduce_max/min among
// the tied extrema of each group, maximum/minimum half to each side. At the
// kinks of abs and relu it is 0, as in TF.
TEST(Gradient, TiesSplitEvenly) {
  Scoped scope;
  auto grad = [](kiln_tensor *x, const Fn &f) {
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tensor *y = f({x});
    kiln_tensor *g = nullptr;
    EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0) << kiln_last_error();
    kiln_tape_free(tape);
    return g ? values(g) : std::vector<double>{};
  };
  kiln_tensor *x = f64({2, 4}, {1, 3, 3, 2, 5, 5, 5, 0});
  EXPECT_EQ(grad(x, [](const Tensors &x) { return kiln_reduce_max(x[0], KILN_AXES(1), false); }),
            (std::vector<double>{0, 0.5, 0.5, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3, 0}));
  EXPECT_EQ(grad(x, [](const Tensors &x) { return kiln_reduce_max(x[0], 0, nullptr, false); }),
            (std::vector<double>{0, 0, 0, 0, 1.0 / 3, 1.0 / 3, 1.0 / 3, 0}));
  EXPECT_EQ(grad(x, [](const Tensors &x) { return kiln_reduce_min(x[0], KILN_AXES(0), true); }),
            (std::vector<double>{1, 1, 1, 0, 0, 0, 0, 1}));
  kiln_tensor *y = f64({2, 2}, {1, 1, 1, 1});
  EXPECT_EQ(grad(y, [](const Tensors &x) { return kiln_reduce_min(x[0], KILN_AXES(-1), false); }),
            (std::vector<double>{0.5, 0.5, 0.5, 0.5}));
  kiln_tensor *b = f64({4}, {2, 3, 2, 0});
  EXPECT_EQ(grad(x, [b](const Tensors &x) { return kiln_maximum(x[0], b); }),
            (std::vector<double>{0, 0.5, 1, 1, 1, 1, 1, 0.5}));
  EXPECT_EQ(grad(b, [x](const Tensors &b) { return kiln_minimum(x, b[0]); }),  // b broadcast over 2 rows
            (std::vector<double>{1, 1.5, 2, 1.5}));
  kiln_tensor *k = f64({3}, {-1, 0, 2});
  EXPECT_EQ(grad(k, [](const Tensors &x) { return kiln_abs(x[0]); }), (std::vector<double>{-1, 0, 1}));
  EXPECT_EQ(grad(k, [](const Tensors &x) { return kiln_relu(x[0]); }), (std::vector<double>{0, 0, 1}));
}

// ---- linear algebra ----

TEST(Gradient, Matmul) {
  Scoped scope;
  auto f = [](const Tensors &x) { return kiln_matmul(x[0], x[1]); };
  std::vector<std::pair<Shape, Shape>> cases = {
      {{3, 4}, {4, 2}},       {{1, 1}, {1, 1}},          {{2, 3, 4}, {4, 5}},    {{3, 4}, {2, 4, 5}},
      {{2, 3, 4}, {2, 4, 2}}, {{2, 1, 3, 4}, {3, 4, 2}}, {{1, 3, 4}, {2, 4, 2}},
  };
  for (const auto &c : cases) {
    SCOPED_TRACE(::testing::PrintToString(c));
    check_gradients(f, {uniform(c.first, -1, 1), uniform(c.second, -1, 1)});
  }
}

// ---- indexing ----

TEST(Gradient, GatherScatterAddsRepeatedIndices) {
  Scoped scope;
  auto f0 = [](const Tensors &x) { return kiln_gather(x[0], x[1], 0); };
  check_gradients(f0, {uniform({4, 3}, -1, 1), i64({5}, {0, 2, 2, 3, 0})});
  check_gradients(f0, {uniform({4, 3}, -1, 1), i32({2, 2}, {3, 3, 1, 3})});
  check_gradients(f0, {uniform({4}, -1, 1), i64({}, {2})});
  auto f1 = [](const Tensors &x) { return kiln_gather(x[0], x[1], 1); };
  check_gradients(f1, {uniform({2, 3}, -1, 1), i64({4}, {2, 0, 2, 2})});
  check_gradients(f1, {uniform({2, 3, 2}, -1, 1), i32({2, 2}, {0, 1, 1, 1})});
  auto fm = [](const Tensors &x) { return kiln_gather(x[0], x[1], -1); };
  check_gradients(fm, {uniform({2, 3}, -1, 1), i64({3}, {1, 1, 0})});
  // gathered twice and through an op: the two scatter-adds accumulate
  check_gradients(
      [](const Tensors &x) {
        return kiln_mul(kiln_gather(x[0], x[1], 0), kiln_gather(kiln_exp(x[0]), x[1], 0));
      },
      {uniform({3, 2}, -1, 1), i64({4}, {2, 0, 2, 1})});
}

// ---- neural-network helpers ----

TEST(Gradient, SoftmaxAndLogSoftmax) {
  Scoped scope;
  for (int axis : {0, 1, -1}) {
    SCOPED_TRACE("axis " + std::to_string(axis));
    check_gradients([axis](const Tensors &x) { return kiln_softmax(x[0], axis); }, {uniform({3, 4}, -2, 2)});
    check_gradients([axis](const Tensors &x) { return kiln_log_softmax(x[0], axis); },
                    {uniform({3, 4}, -2, 2)});
  }
  // large logits: the max shift keeps both finite
  check_gradients([](const Tensors &x) { return kiln_log_softmax(x[0], -1); }, {uniform({2, 3}, 300, 302)});
}

TEST(Gradient, CrossEntropiesWithRespectToLogits) {
  Scoped scope;
  std::vector<double> p = uniform_values(8, 0.1, 1);
  for (int r = 0; r < 2; r++) {  // rows of labels are distributions
    double s = 0;
    for (int c = 0; c < 4; c++) s += p[(size_t)(r * 4 + c)];
    for (int c = 0; c < 4; c++) p[(size_t)(r * 4 + c)] /= s;
  }
  kiln_tensor *labels = f64({2, 4}, p);
  check_gradients([labels](const Tensors &x) { return kiln_softmax_cross_entropy(labels, x[0]); },
                  {uniform({2, 4}, -2, 2)});
  check_gradients([](const Tensors &x) { return kiln_sparse_softmax_cross_entropy(x[1], x[0]); },
                  {uniform({3, 4}, -2, 2), i64({3}, {3, 0, 3})});
  check_gradients([](const Tensors &x) { return kiln_sparse_softmax_cross_entropy(x[1], x[0]); },
                  {uniform({2, 2, 3}, -2, 2), i32({2, 2}, {0, 2, 1, 1})});
  check_gradients([](const Tensors &x) { return kiln_sparse_softmax_cross_entropy(x[1], x[0]); },
                  {uniform({5}, -2, 2), i64({}, {4})});
}

TEST(Gradient, ClipByNorm) {
  Scoped scope;
  auto f = [](double m) { return [m](const Tensors &x) { return kiln_clip_by_norm(x[0], m); }; };
  check_gradients(f(1.0), {uniform({2, 3}, -2, 2)});    // norm above max_norm: scaled
  check_gradients(f(100.0), {uniform({2, 3}, -2, 2)});  // below: the identity
  check_gradients(f(0.5), {uniform({}, 1, 2)});
}

TEST(Gradient, OneHotCarriesNoGradient) {
  Scoped scope;
  kiln_tensor *x = uniform({3, 4}, -1, 1);
  kiln_tensor *idx = i64({3}, {0, 3, 1});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tape_watch(tape, idx);  // ignored: an integer tensor
  kiln_tensor *hot = kiln_one_hot(idx, 4, KILN_F64);
  kiln_tensor *y = kiln_mul(hot, x);
  kiln_tensor *sources[2] = {x, idx}, *grads[2];
  ASSERT_EQ(kiln_tape_gradient(tape, y, 2, sources, grads), 0) << kiln_last_error();
  ASSERT_NE(grads[0], nullptr);
  EXPECT_EQ(values(grads[0]), values(hot));  // d(hot * x)/dx = hot
  EXPECT_EQ(grads[1], nullptr);
  kiln_tape_free(tape);
  // and a one-hot target depends on nothing
  check_gradients([](const Tensors &x) { return kiln_mul(kiln_one_hot(x[1], 3, KILN_F64), kiln_exp(x[0])); },
                  {uniform({2, 3}, -1, 1), i32({2}, {2, 0})});
}

// Composed models: an MLP layer with a loss, through every kind of rule at once.
TEST(Gradient, SmallNetwork) {
  Scoped scope;
  auto net = [](const Tensors &p) {
    kiln_tensor *h = kiln_tanh(kiln_add(kiln_matmul(p[0], p[1]), p[2]));
    kiln_tensor *logits = kiln_matmul(h, p[3]);
    return kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(p[4], logits), 0, nullptr, false);
  };
  check_gradients(net, {uniform({4, 3}, -1, 1), uniform({3, 5}, -1, 1), uniform({5}, -1, 1),
                        uniform({5, 2}, -1, 1), i64({4}, {0, 1, 1, 0})});
}

// ---- f32 ----

// f32 gradients come back as f32 with the input's shape and agree with f64.
TEST(Gradient, F32GradientsAreF32) {
  Scoped scope;
  std::vector<Fn> fns = {
      [](const Tensors &x) { return kiln_mul(kiln_sin(x[0]), x[1]); },
      [](const Tensors &x) { return kiln_div(kiln_exp(x[0]), kiln_add(x[1], kiln_scalar_like(x[1], 3))); },
      [](const Tensors &x) {
        return kiln_matmul(kiln_reshape(x[0], KILN_SHAPE(2, 3)), kiln_reshape(x[1], KILN_SHAPE(3, 1)));
      },
      [](const Tensors &x) { return kiln_softmax(kiln_mul(x[0], x[1]), -1); },
      [](const Tensors &x) { return kiln_reduce_max(kiln_sub(x[0], x[1]), KILN_AXES(0), false); },
  };
  for (size_t k = 0; k < fns.size(); k++) {
    SCOPED_TRACE("function " + std::to_string(k));
    kiln_tensor *a64 = distinct({{2, 3}})[0], *b64 = uniform({3}, 0.5, 1.5);
    kiln_tensor *a32 = kiln_cast(a64, KILN_F32), *b32 = kiln_cast(b64, KILN_F32);
    kiln_tensor *g64[2], *g32[2];
    for (int pass = 0; pass < 2; pass++) {
      Tensors x = pass ? Tensors{a32, b32} : Tensors{a64, b64};
      kiln_tape *tape = kiln_tape_begin(false);
      kiln_tape_watch(tape, x[0]);
      kiln_tape_watch(tape, x[1]);
      kiln_tensor *y = fns[k](x);
      ASSERT_EQ(kiln_tape_gradient(tape, y, 2, x.data(), pass ? g32 : g64), 0) << kiln_last_error();
      kiln_tape_free(tape);
    }
    for (int i = 0; i < 2; i++) {
      ASSERT_NE(g32[i], nullptr);
      EXPECT_EQ(kiln_tensor_dtype(g32[i]), KILN_F32);
      EXPECT_EQ(shape_of(g32[i]), (i ? Shape{3} : Shape{2, 3}));
      std::vector<double> a = values(g32[i]), b = values(g64[i]);
      ASSERT_EQ(a.size(), b.size());
      for (size_t j = 0; j < a.size(); j++) EXPECT_NEAR(a[j], b[j], 1e-5 * (1 + std::fabs(b[j])));
    }
  }
}

}  // namespace
