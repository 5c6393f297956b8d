// tape_test.cc — the semantics of gradient tapes, variables and custom
// gradients (API.md §4): what a tape records and when, persistence, nesting
// and higher order, NULL and unconnected sources, ownership and leaks, bad
// arguments; and the seed examples (the 4-d box hypersurface, x*x to second
// order, abs by C control flow, a stable log(1 + e^x), gradient clipping,
// the TF eager guide's linear regression).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

#include "test_util.h"

using ::testing::HasSubstr;
using ::testing::StartsWith;

namespace {

using namespace kiln_test;

kiln_tensor *scalar(double v) { return kiln_scalar(KILN_F64, v); }

// d target / d source on a fresh non-persistent tape already recorded: a helper
// for the one-source cases.
kiln_tensor *grad1(kiln_tape *tape, kiln_tensor *target, kiln_tensor *source) {
  kiln_tensor *g = nullptr;
  EXPECT_EQ(kiln_tape_gradient(tape, target, 1, &source, &g), 0) << kiln_last_error();
  return g;
}

// ---- what a tape records ----

TEST(Tape, GradientOfAProduct) {
  Scoped scope;
  kiln_tensor *x = f64({3}, {1, 2, 3}), *y = f64({3}, {4, 5, 6});
  kiln_tape *tape = kiln_tape_begin(false);
  ASSERT_NE(tape, nullptr);
  kiln_tape_watch(tape, x);
  kiln_tensor *z = kiln_mul(x, y);  // non-scalar target: summed
  kiln_tensor *src[2] = {x, y}, *g[2];
  ASSERT_EQ(kiln_tape_gradient(tape, z, 2, src, g), 0) << kiln_last_error();
  EXPECT_EQ(values(g[0]), (std::vector<double>{4, 5, 6}));
  EXPECT_EQ(g[1], nullptr) << "y is not watched";
  kiln_tape_free(tape);
}

TEST(Tape, FanOutAccumulates) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  // y = x*x + 2x + x: 2x + 3 = 9
  kiln_tensor *y = kiln_add(kiln_add(kiln_mul(x, x), kiln_mul(scalar(2), x)), x);
  EXPECT_EQ(values(grad1(tape, y, x)), (std::vector<double>{9}));
  kiln_tape_free(tape);
}

TEST(Tape, RecordsOnlyWhileActive) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *inside = kiln_mul(x, x);
  kiln_tape_end(tape);
  kiln_tensor *after = kiln_mul(x, x);  // recorded after the end: not on the tape
  EXPECT_EQ(grad1(tape, after, x), nullptr);
  // what it recorded still has its gradient after the end
  EXPECT_EQ(values(grad1(tape, inside, x)), (std::vector<double>{6}));
  EXPECT_EQ(grad1(tape, kiln_add(inside, after), x), nullptr);  // the add is not on the tape either
  kiln_tape_free(tape);
}

// Ops that do not depend on a watched tensor are not recorded: the tape keeps
// nothing of them alive once their scope is gone, but keeps what it recorded.
TEST(Tape, RecordsOnlyWhatDependsOnAWatchedTensor) {
  Scoped scope;
  kiln_tensor *x = scalar(2), *a = scalar(5);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  int64_t before = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_mul(a, kiln_exp(a));
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), before) << "an unrelated op was recorded";
  kiln_scope_push();
  kiln_mul(x, a);
  kiln_scope_pop();
  EXPECT_GT(kiln_debug_live_tensors(), before) << "a dependent op was not recorded";
  kiln_tape_free(tape);
  EXPECT_EQ(kiln_debug_live_tensors(), before);
}

TEST(Tape, UnconnectedSourceGetsNull) {
  Scoped scope;
  kiln_tensor *x = scalar(1), *y = scalar(2);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tape_watch(tape, y);
  kiln_tensor *z = kiln_exp(x);
  kiln_tensor *src[2] = {y, x}, *g[2];
  ASSERT_EQ(kiln_tape_gradient(tape, z, 2, src, g), 0);
  EXPECT_EQ(g[0], nullptr);
  EXPECT_NEAR(kiln_tensor_item(g[1]), std::exp(1.0), 1e-12);
  kiln_tape_free(tape);
}

TEST(Tape, TargetThatIsASourceGetsOnes) {
  Scoped scope;
  kiln_tensor *x = f32({2, 2}, {1, 2, 3, 4});
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *g = grad1(tape, x, x);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(kiln_tensor_dtype(g), KILN_F32);
  EXPECT_EQ(shape_of(g), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(values(g), (std::vector<double>{1, 1, 1, 1}));
  // even for a tensor the tape never saw
  kiln_tensor *other = scalar(7);
  EXPECT_EQ(kiln_tensor_item(grad1(tape, other, other)), 1);
  kiln_tape_free(tape);
}

TEST(Tape, IntegerAndBoolResultsCarryNoGradient) {
  Scoped scope;
  kiln_tensor *x = f64({3}, {1.5, -2.5, 3.5});
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *through_int = kiln_cast(kiln_cast(x, KILN_I32), KILN_F64);
  kiln_tensor *through_bool = kiln_cast(kiln_greater(x, scalar(0)), KILN_F64);
  kiln_tensor *through_argmax = kiln_cast(kiln_argmax(x, 0), KILN_F64);
  for (kiln_tensor *t :
       {through_int, through_bool, through_argmax, kiln_sign(x), kiln_floor(x), kiln_ceil(x)}) {
    ASSERT_NE(t, nullptr) << kiln_last_error();
    EXPECT_EQ(grad1(tape, t, x), nullptr);
  }
  // an integer target has no gradient either
  kiln_tensor *g = x;
  EXPECT_EQ(kiln_tape_gradient(tape, kiln_cast(x, KILN_I64), 1, &x, &g), 0) << kiln_last_error();
  EXPECT_EQ(g, nullptr);
  kiln_tape_free(tape);
}

TEST(Tape, WatchingAnIntegerTensorIsIgnored) {
  Scoped scope;
  kiln_tensor *i = kiln_arange(KILN_I32, 3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, i);
  kiln_tape_watch(tape, nullptr);
  kiln_tape_watch(nullptr, i);
  kiln_tensor *y = kiln_cast(kiln_mul(i, i), KILN_F32);
  EXPECT_EQ(grad1(tape, y, i), nullptr);
  EXPECT_STREQ(kiln_last_error(), "");
  kiln_tape_free(tape);
}

TEST(Tape, StopGradientBlocks) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(x, kiln_stop_gradient(x));  // d/dx = stop(x) = 3, not 6
  EXPECT_EQ(kiln_tensor_item(grad1(tape, y, x)), 3);
  kiln_tape_free(tape);
}

TEST(Tape, ZeroSizeTensors) {
  Scoped scope;
  kiln_tensor *x = kiln_zeros(KILN_F64, KILN_SHAPE(0, 3));
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_reduce_sum(kiln_exp(x), KILN_AXES(0), false);  // (3,) of zeros
  kiln_tensor *g = grad1(tape, y, x);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(shape_of(g), (std::vector<int64_t>{0, 3}));
  kiln_tape_free(tape);
}

// Tapes belong to the thread that began them: another thread's ops are
// not recorded, and it can run its own tapes meanwhile.
TEST(Tape, TapesArePerThread) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *other = nullptr;
  double other_grad = 0;
  std::thread t([&] {
    other = kiln_mul(x, x);  // no scope open on this thread: caller-owned
    kiln_scope_push();
    kiln_tensor *z = kiln_scalar(KILN_F64, 5);
    kiln_tape *mine = kiln_tape_begin(false);
    kiln_tape_watch(mine, z);
    kiln_tensor *g = nullptr;
    kiln_tape_gradient(mine, kiln_mul(z, z), 1, &z, &g);
    other_grad = kiln_tensor_item(g);
    kiln_tape_free(mine);
    kiln_scope_pop();
  });
  t.join();
  EXPECT_EQ(other_grad, 10);
  EXPECT_EQ(grad1(tape, other, x), nullptr);
  kiln_release(other);
  kiln_tape_free(tape);
}

// ---- persistence ----

TEST(Tape, NonPersistentTapeGivesOneGradient) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(x, x);
  EXPECT_EQ(kiln_tensor_item(grad1(tape, y, x)), 6);
  kiln_tensor *g = x;
  EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient:"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("persistent"));
  EXPECT_EQ(g, nullptr);
  kiln_tape_free(tape);
}

TEST(Tape, PersistentTapeGivesMany) {
  Scoped scope;
  kiln_tensor *x = scalar(3), *w = scalar(2);
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tape_watch(tape, w);
  kiln_tensor *y = kiln_mul(x, x), *z = kiln_mul(y, w);
  kiln_tape_end(tape);
  for (int k = 0; k < 3; k++) {
    EXPECT_EQ(kiln_tensor_item(grad1(tape, y, x)), 6);
    EXPECT_EQ(kiln_tensor_item(grad1(tape, z, x)), 12);
    EXPECT_EQ(kiln_tensor_item(grad1(tape, z, w)), 9);
    EXPECT_EQ(kiln_tensor_item(grad1(tape, z, y)), 2);
  }
  kiln_tape_free(tape);
}

// ---- nesting and higher order ----

TEST(Tape, NestedTapesSeeTheirOwnWatches) {
  Scoped scope;
  kiln_tensor *x = scalar(2), *y = scalar(5);
  kiln_tape *outer = kiln_tape_begin(true);
  kiln_tape_watch(outer, x);
  kiln_tape *inner = kiln_tape_begin(true);
  kiln_tape_watch(inner, y);
  kiln_tensor *z = kiln_mul(x, y);
  kiln_tape_end(inner);
  kiln_tape_end(outer);
  kiln_tensor *src[2] = {x, y}, *g[2];
  ASSERT_EQ(kiln_tape_gradient(inner, z, 2, src, g), 0);
  EXPECT_EQ(g[0], nullptr);
  EXPECT_EQ(kiln_tensor_item(g[1]), 2);
  ASSERT_EQ(kiln_tape_gradient(outer, z, 2, src, g), 0);
  EXPECT_EQ(kiln_tensor_item(g[0]), 5);
  EXPECT_EQ(g[1], nullptr);
  kiln_tape_free(inner);
  kiln_tape_free(outer);
}

// A non-persistent tape leaves the active list while its gradient walks
// (lib/tape.c: its own walk is not recorded on it) and comes back to the
// same place: still innermost, so ending it works, and the outer tape has
// recorded the walk for a second derivative.
TEST(Tape, ANonPersistentTapeIsBackInPlaceAfterItsGradient) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *outer = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape *inner = kiln_tape_begin(false);
  kiln_tape_watch(inner, x);
  kiln_tensor *y = kiln_mul(kiln_mul(x, x), x);  // x^3
  kiln_tensor *dy = nullptr;
  ASSERT_EQ(kiln_tape_gradient(inner, y, 1, &x, &dy), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(dy), 27);  // 3 x^2
  kiln_clear_error();
  kiln_tape_end(inner);
  EXPECT_STREQ(kiln_last_error(), "");
  kiln_tape_end(outer);
  EXPECT_STREQ(kiln_last_error(), "");
  EXPECT_EQ(kiln_tensor_item(grad1(outer, dy, x)), 18);  // 6 x
  kiln_tape_free(inner);
  kiln_tape_free(outer);
}

TEST(Tape, EndingATapeThatIsNotInnermostFails) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *outer = kiln_tape_begin(false);
  kiln_tape *inner = kiln_tape_begin(false);
  kiln_tape_watch(outer, x);
  kiln_tape_end(outer);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_end:"));
  kiln_tensor *y = kiln_mul(x, x);  // the outer tape still records
  kiln_tape_end(inner);
  kiln_tape_end(outer);
  EXPECT_EQ(kiln_tensor_item(grad1(outer, y, x)), 6);
  kiln_tape_free(inner);
  kiln_tape_free(outer);
  kiln_tape_end(nullptr);  // fine
  kiln_tape_free(nullptr);
}

// Freeing an active tape that is not innermost unlinks it; the others go on.
TEST(Tape, FreeingAnActiveTapeUnlinksIt) {
  Scoped scope;
  kiln_tensor *x = scalar(4);
  kiln_tape *a = kiln_tape_begin(false);
  kiln_tape *b = kiln_tape_begin(false);
  kiln_tape *c = kiln_tape_begin(false);
  kiln_tape_watch(a, x);
  kiln_tape_watch(c, x);
  kiln_tape_free(b);
  kiln_tensor *y = kiln_mul(x, x);
  kiln_tape_end(c);
  kiln_tape_end(a);
  EXPECT_STREQ(kiln_last_error(), "");
  EXPECT_EQ(kiln_tensor_item(grad1(a, y, x)), 8);
  EXPECT_EQ(kiln_tensor_item(grad1(c, y, x)), 8);
  kiln_tape_free(c);
  kiln_tape_free(a);
  kiln_tensor *z = kiln_mul(x, x);  // nothing active: not recorded anywhere
  EXPECT_NE(z, nullptr);
}

// d²(x·x)/dx² = 2 at x = 3, with an outer tape recording the inner
// gradient computation.
TEST(Tape, SecondDerivativeWithNestedTapes) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *t1 = kiln_tape_begin(false);
  kiln_tape_watch(t1, x);
  kiln_tape *t2 = kiln_tape_begin(false);
  kiln_tape_watch(t2, x);
  kiln_tensor *y = kiln_mul(x, x);
  kiln_tape_end(t2);
  kiln_tensor *dy = grad1(t2, y, x);  // recorded by t1, still active
  kiln_tape_end(t1);
  EXPECT_EQ(kiln_tensor_item(dy), 6);
  EXPECT_EQ(kiln_tensor_item(grad1(t1, dy, x)), 2);
  kiln_tape_free(t2);
  kiln_tape_free(t1);
}

TEST(Tape, ThirdDerivative) {
  Scoped scope;
  kiln_tensor *x = scalar(2);
  kiln_tape *t1 = kiln_tape_begin(false), *t2 = kiln_tape_begin(false), *t3 = kiln_tape_begin(false);
  for (kiln_tape *t : {t1, t2, t3}) kiln_tape_watch(t, x);
  kiln_tensor *y = kiln_mul(kiln_exp(x), kiln_sin(x));  // y''' = 2 e^x (cos x - sin x)
  kiln_tape_end(t3);
  kiln_tensor *d1 = grad1(t3, y, x);
  kiln_tape_end(t2);
  kiln_tensor *d2 = grad1(t2, d1, x);
  kiln_tape_end(t1);
  kiln_tensor *d3 = grad1(t1, d2, x);
  double e = std::exp(2.0), s = std::sin(2.0), c = std::cos(2.0);
  EXPECT_NEAR(kiln_tensor_item(d1), e * (s + c), 1e-12);
  EXPECT_NEAR(kiln_tensor_item(d2), 2 * e * c, 1e-12);
  EXPECT_NEAR(kiln_tensor_item(d3), 2 * e * (c - s), 1e-12);
  for (kiln_tape *t : {t3, t2, t1}) kiln_tape_free(t);
}

// The TF Eager paper's Listing 1: the gradient is taken while its own
// (persistent) tape is still recording, so the tape can differentiate it.
TEST(Tape, GradientWhileItsTapeIsRecording) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(x, x);
  kiln_tensor *dy = grad1(tape, y, x);
  kiln_tensor *d2 = grad1(tape, dy, x);
  kiln_tape_end(tape);
  EXPECT_EQ(kiln_tensor_item(dy), 6);
  EXPECT_EQ(kiln_tensor_item(d2), 2);
  kiln_tape_free(tape);
}

// A non-persistent tape still recording: one gradient, then nothing kept.
TEST(Tape, NonPersistentGradientWhileRecording) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(x, x);
  EXPECT_EQ(kiln_tensor_item(grad1(tape, y, x)), 6);
  kiln_tensor *z = kiln_mul(x, y);
  kiln_tape_end(tape);
  kiln_tensor *g = x;
  EXPECT_EQ(kiln_tape_gradient(tape, z, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient:"));
  kiln_tape_free(tape);
}

// ---- bad arguments ----

TEST(Tape, NullArgumentsFailCleanly) {
  Scoped scope;
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_mul(x, x), *g = x;

  EXPECT_EQ(kiln_tape_gradient(nullptr, y, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient: tape is NULL"));
  EXPECT_EQ(g, nullptr);
  kiln_clear_error();
  EXPECT_EQ(kiln_tape_gradient(tape, nullptr, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient: target is NULL"));
  kiln_clear_error();
  EXPECT_EQ(kiln_tape_gradient(tape, y, 1, nullptr, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient:"));
  kiln_clear_error();
  EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &x, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient:"));
  kiln_clear_error();
  EXPECT_EQ(kiln_tape_gradient(tape, y, -1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient:"));
  kiln_clear_error();
  kiln_tensor *src[2] = {x, nullptr}, *gs[2] = {x, x};
  EXPECT_EQ(kiln_tape_gradient(tape, y, 2, src, gs), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient: sources[1] is NULL"));
  EXPECT_EQ(gs[0], nullptr);
  EXPECT_EQ(gs[1], nullptr);
  // a failed op upstream: the target is NULL and its error is kept
  kiln_clear_error();
  kiln_tensor *bad = kiln_add(x, f64({2}, {1, 2}));
  bad = kiln_add(bad, f64({3}, {1, 2, 3}));  // NULL in: the first error stays
  EXPECT_EQ(kiln_tape_gradient(tape, bad, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("add:"));
  // no sources is fine
  kiln_clear_error();
  EXPECT_EQ(kiln_tape_gradient(tape, y, 0, nullptr, nullptr), 0);

  kiln_variable *v = kiln_variable_new(x, "v");
  kiln_clear_error();
  EXPECT_EQ(kiln_tape_gradient_vars(nullptr, y, 1, &v, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient_vars: tape is NULL"));
  kiln_variable *vs[1] = {nullptr};
  EXPECT_EQ(kiln_tape_gradient_vars(tape, y, 1, vs, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient_vars: vars[0] is NULL"));
  EXPECT_EQ(kiln_tape_gradient_vars(tape, y, 1, nullptr, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient_vars:"));
  kiln_variable_free(v);
  kiln_tape_free(tape);
}

// ---- variables ----

TEST(Variable, NamesAndValues) {
  Scoped scope;
  kiln_variable *a = kiln_variable_new(f32({2}, {1, 2}), "weights");
  kiln_variable *b = kiln_variable_new(scalar(1), nullptr);
  kiln_variable *c = kiln_variable_new(scalar(1), nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_STREQ(kiln_variable_name(a), "weights");
  EXPECT_THAT(kiln_variable_name(b), StartsWith("var"));
  EXPECT_STRNE(kiln_variable_name(b), kiln_variable_name(c));
  EXPECT_EQ(kiln_variable_name(nullptr), nullptr);
  kiln_tensor *r = kiln_variable_read(a);
  EXPECT_EQ(kiln_tensor_dtype(r), KILN_F32);
  EXPECT_EQ(values(r), (std::vector<double>{1, 2}));
  kiln_variable_free(a);  // tensors read stay valid
  EXPECT_EQ(values(r), (std::vector<double>{1, 2}));
  kiln_variable_free(b);
  kiln_variable_free(c);
  kiln_variable_free(nullptr);
}

TEST(Variable, InitIsCopied) {
  Scoped scope;
  char name[8] = "w";
  kiln_tensor *init = f64({2}, {1, 2});
  kiln_variable *v = kiln_variable_new(init, name);
  name[0] = 'z';
  EXPECT_STREQ(kiln_variable_name(v), "w");
  EXPECT_NE(kiln_variable_read(v), init);
  EXPECT_EQ(values(kiln_variable_read(v)), (std::vector<double>{1, 2}));
  kiln_variable_free(v);
}

TEST(Variable, BadArguments) {
  Scoped scope;
  EXPECT_EQ(kiln_variable_new(nullptr, "x"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_new:"));
  kiln_clear_error();
  EXPECT_EQ(kiln_variable_read(nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_read:"));
  kiln_variable *v = kiln_variable_new(f64({2}, {1, 2}), "w");
  EXPECT_EQ(kiln_variable_assign(v, f32({2}, {1, 2})), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign: "));
  EXPECT_THAT(kiln_last_error(), HasSubstr("'w'"));
  EXPECT_EQ(kiln_variable_assign(v, f64({3}, {1, 2, 3})), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign: "));
  EXPECT_EQ(kiln_variable_assign(v, scalar(1)), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_variable_assign(v, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_variable_assign(nullptr, scalar(1)), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign: "));
  EXPECT_EQ(kiln_variable_assign_add(v, f64({3}, {1, 2, 3})), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign_add: "));
  EXPECT_EQ(kiln_variable_assign_sub(v, f32({2}, {1, 2})), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign_sub: "));
  EXPECT_EQ(kiln_variable_assign_add(v, f64({2, 2}, {1, 2, 3, 4})), -1);  // would grow the variable
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign_add: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_variable_assign_sub(nullptr, scalar(1)), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign_sub: "));
  kiln_clear_error();
  EXPECT_EQ(kiln_variable_assign_add(v, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("variable_assign_add: "));
  EXPECT_EQ(values(kiln_variable_read(v)), (std::vector<double>{1, 2})) << "a failed assignment changed it";
  kiln_variable_free(v);
}

TEST(Variable, Assignments) {
  Scoped scope;
  kiln_variable *v = kiln_variable_new(f64({2}, {1, 2}), "w");
  kiln_tensor *old = kiln_variable_read(v);
  ASSERT_EQ(kiln_variable_assign(v, f64({2}, {5, 6})), 0);
  EXPECT_EQ(values(kiln_variable_read(v)), (std::vector<double>{5, 6}));
  EXPECT_EQ(values(old), (std::vector<double>{1, 2})) << "a read tensor is immutable";
  ASSERT_EQ(kiln_variable_assign_add(v, f64({2}, {0.5, 1})), 0);
  EXPECT_EQ(values(kiln_variable_read(v)), (std::vector<double>{5.5, 7}));
  ASSERT_EQ(kiln_variable_assign_sub(v, scalar(2)), 0);  // delta broadcasts
  EXPECT_EQ(values(kiln_variable_read(v)), (std::vector<double>{3.5, 5}));
  kiln_variable_free(v);
}

TEST(Variable, ReadsAreWatchedAutomatically) {
  Scoped scope;
  kiln_variable *w = kiln_variable_new(f64({2}, {2, 3}), "w");
  kiln_tensor *x = f64({2}, {5, 7});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *y = kiln_mul(kiln_variable_read(w), x);
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient_vars(tape, y, 1, &w, &g), 0) << kiln_last_error();
  EXPECT_EQ(values(g), (std::vector<double>{5, 7}));
  kiln_tape_free(tape);
  kiln_variable_free(w);
}

// Every read of a variable counts, including reads of different values
// (an assignment in between), and a read before the tape began does not.
TEST(Variable, GradientSumsEveryRead) {
  Scoped scope;
  kiln_variable *v = kiln_variable_new(scalar(3), "v");
  kiln_variable *unread = kiln_variable_new(scalar(1), "unread");
  kiln_tensor *before = kiln_variable_read(v);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *a = kiln_variable_read(v);
  kiln_tensor *b = kiln_variable_read(v);
  kiln_tensor *y = kiln_mul(a, b);  // 2v = 6
  kiln_variable_assign(v, scalar(10));
  kiln_tensor *z = kiln_mul(kiln_variable_read(v), scalar(4));  // + 4
  kiln_tensor *t = kiln_add(kiln_add(y, z), kiln_mul(before, scalar(100)));
  kiln_variable *vars[3] = {v, unread, v};
  kiln_tensor *g[3];
  ASSERT_EQ(kiln_tape_gradient_vars(tape, t, 3, vars, g), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(g[0]), 10);
  EXPECT_EQ(g[1], nullptr);
  EXPECT_EQ(kiln_tensor_item(g[2]), 10);
  kiln_tape_free(tape);
  kiln_variable_free(v);
  kiln_variable_free(unread);
}

// Assignments are not recorded: they do not make later reads depend on
// what was assigned.
TEST(Variable, AssignmentsAreNotRecorded) {
  Scoped scope;
  kiln_variable *v = kiln_variable_new(scalar(1), "v");
  kiln_tensor *x = scalar(2);
  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  ASSERT_EQ(kiln_variable_assign_add(v, x), 0);
  kiln_tensor *y = kiln_mul(kiln_variable_read(v), scalar(5));
  EXPECT_EQ(grad1(tape, y, x), nullptr);
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient_vars(tape, y, 1, &v, &g), 0);
  EXPECT_EQ(kiln_tensor_item(g), 5);
  kiln_tape_free(tape);
  kiln_variable_free(v);
}

TEST(Variable, SecondDerivative) {
  Scoped scope;
  kiln_variable *x = kiln_variable_new(scalar(3), "x");
  kiln_tape *t1 = kiln_tape_begin(false);
  kiln_tape *t2 = kiln_tape_begin(false);
  kiln_tensor *y = kiln_mul(kiln_variable_read(x), kiln_variable_read(x));
  kiln_tape_end(t2);
  kiln_tensor *dy = nullptr, *d2 = nullptr;
  ASSERT_EQ(kiln_tape_gradient_vars(t2, y, 1, &x, &dy), 0) << kiln_last_error();
  kiln_tape_end(t1);
  ASSERT_EQ(kiln_tape_gradient_vars(t1, dy, 1, &x, &d2), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(dy), 6);
  EXPECT_EQ(kiln_tensor_item(d2), 2);
  kiln_tape_free(t2);
  kiln_tape_free(t1);
  kiln_variable_free(x);
}

// ---- ownership ----

// With no scope open the caller owns the gradients; freeing the tape and
// releasing them leaves nothing behind.
TEST(Tape, NoScopeOwnership) {
  int64_t live = kiln_debug_live_tensors();
  kiln_tensor *x = kiln_scalar(KILN_F64, 3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *x2 = kiln_mul(x, x);
  kiln_tensor *y = kiln_mul(x2, x);
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(g), 27);
  kiln_tape_free(tape);
  for (kiln_tensor *t : {x, x2, y, g}) kiln_release(t);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

TEST(Tape, GradientsBelongToTheCallersScope) {
  int64_t live = kiln_debug_live_tensors();
  kiln_scope_push();
  kiln_tensor *x = scalar(3);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_exp(kiln_mul(x, x));
  int64_t before = kiln_debug_live_tensors();
  kiln_tensor *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0);
  // only the gradient survived the walk (plus what it views), and the tape
  // dropped its records
  EXPECT_LE(kiln_debug_live_tensors(), before + 2);
  kiln_tape_free(tape);
  kiln_scope_pop();
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// The walk frees as it goes, as PyTorch's engine does: each node's rule runs
// in a scope of its own, a gradient is given up once the node that made its
// tensor is walked, and a tape that takes one gradient gives up each node
// it walks, with the tensors it kept. A custom gradient at the bottom of a
// chain of kChain multiplications counts the tensors alive when the walk
// reaches it (all tensors are the caller's: no scope is open).
constexpr int kChain = 200;
int64_t live_at_probe;
kiln_tensor *twice_fwd(void *, int, kiln_tensor *const *xs) { return kiln_add(xs[0], xs[0]); }
int twice_probe_grad(void *, int, kiln_tensor *const *, kiln_tensor *, kiln_tensor *dy, kiln_tensor **dxs) {
  live_at_probe = kiln_debug_live_tensors();
  return (dxs[0] = kiln_add(dy, dy)) ? 0 : -1;
}
int refusing_probe_grad(void *, int, kiln_tensor *const *, kiln_tensor *, kiln_tensor *, kiln_tensor **) {
  live_at_probe = kiln_debug_live_tensors();
  return kiln_fail("probe: refused");
}

// twice(x) * c^kChain, elementwise; *mid gets the product after half the
// multiplications (the caller's reference), when asked for
kiln_tensor *probe_chain(kiln_tensor *x, kiln_tensor *c, kiln_gradient_fn grad, kiln_tensor **mid) {
  kiln_tensor *h = kiln_custom_gradient(twice_fwd, grad, nullptr, 1, &x);
  for (int i = 0; i < kChain; i++) {
    kiln_tensor *next = kiln_mul(h, c);
    if (mid && i == kChain / 2) *mid = kiln_retain(next);
    kiln_release(h);
    h = next;
  }
  return h;
}

// the mean, max and min of t (made in a scope, so nothing is left behind)
double stat(kiln_tensor *t, int which) {
  kiln_scope_push();
  kiln_tensor *r = which == 0 ? kiln_reduce_mean(t, 0, nullptr, false)
                   : which == 1 ? kiln_reduce_max(t, 0, nullptr, false)
                                : kiln_reduce_min(t, 0, nullptr, false);
  double v = r ? kiln_tensor_item(r) : NAN;
  kiln_scope_pop();
  return v;
}

TEST(Tape, TheWalkFreesAsItGoes) {
  int64_t baseline = kiln_debug_live_tensors();
  kiln_tensor *x = kiln_fill(KILN_F64, 1, std::vector<int64_t>{64}.data(), 0.5);
  kiln_tensor *c = kiln_scalar(KILN_F64, 1.01);
  for (bool persistent : {false, true}) {
    int64_t start = kiln_debug_live_tensors();
    kiln_tape *tape = kiln_tape_begin(persistent);
    kiln_tape_watch(tape, x);
    kiln_tensor *y = probe_chain(x, c, twice_probe_grad, nullptr);
    kiln_tape_end(tape);
    // the tape keeps every result of the chain until the walk
    EXPECT_GE(kiln_debug_live_tensors(), start + kChain);
    kiln_tensor *g = nullptr;
    live_at_probe = -1;
    ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), 0) << kiln_last_error();
    ASSERT_GE(live_at_probe, 0);
    if (persistent) // the records stay; the gradients above the probe are gone (was 2 * kChain more)
      EXPECT_LE(live_at_probe - start, kChain + 16);
    else // the chain above the probe is gone, records and gradients
      EXPECT_LE(live_at_probe - start, 16);
    EXPECT_NEAR(stat(g, 0), 2 * std::pow(1.01, kChain), 1e-9) << kiln_last_error();
    kiln_tape_free(tape);
    kiln_release(g);
    kiln_release(y);
    EXPECT_EQ(kiln_debug_live_tensors(), start) << (persistent ? "persistent" : "non-persistent");
  }
  kiln_release(x);
  kiln_release(c);
  EXPECT_EQ(kiln_debug_live_tensors(), baseline);
}

// A source in the middle of the chain keeps its gradient through the walk
// (its node is given up, its gradient is not); a walk that fails half way
// leaves nothing behind.
TEST(Tape, TheWalkKeepsItsSourcesAndFailsCleanly) {
  int64_t baseline = kiln_debug_live_tensors();
  kiln_tensor *x = kiln_fill(KILN_F64, 1, std::vector<int64_t>{8}.data(), 0.25);
  kiln_tensor *c = kiln_scalar(KILN_F64, 1.01);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *mid = nullptr, *y = probe_chain(x, c, twice_probe_grad, &mid);
  kiln_tensor *src[2] = {x, mid}, *g[2] = {nullptr, nullptr};
  ASSERT_EQ(kiln_tape_gradient(tape, y, 2, src, g), 0) << kiln_last_error();
  ASSERT_TRUE(g[0] && g[1]);
  EXPECT_NEAR(stat(g[0], 1), 2 * std::pow(1.01, kChain), 1e-9);
  EXPECT_NEAR(stat(g[0], 2), 2 * std::pow(1.01, kChain), 1e-9);
  EXPECT_NEAR(stat(g[1], 1), std::pow(1.01, kChain - 1 - kChain / 2), 1e-9);
  EXPECT_NEAR(stat(g[1], 2), std::pow(1.01, kChain - 1 - kChain / 2), 1e-9);
  kiln_tape_free(tape);
  for (kiln_tensor *t : {y, mid, g[0], g[1]}) kiln_release(t);

  for (bool persistent : {false, true}) {
    tape = kiln_tape_begin(persistent);
    kiln_tape_watch(tape, x);
    y = probe_chain(x, c, refusing_probe_grad, nullptr);
    g[0] = x;
    EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &x, g), -1);
    EXPECT_THAT(kiln_last_error(), StartsWith("probe: refused"));
    EXPECT_EQ(g[0], nullptr);
    kiln_tape_free(tape);
    kiln_release(y);
  }
  kiln_release(x);
  kiln_release(c);
  EXPECT_EQ(kiln_debug_live_tensors(), baseline);
}

// ---- custom gradients ----

// log(1 + e^x): f32 e^100 overflows, so the plain gradient is inf/inf = NaN;
// the custom one, 1 - 1/(1 + e^x), is 1.
kiln_tensor *log1pexp_fwd(void *, int, kiln_tensor *const *xs) {
  return kiln_log(kiln_add(kiln_scalar_like(xs[0], 1), kiln_exp(xs[0])));
}
int log1pexp_grad(void *, int, kiln_tensor *const *xs, kiln_tensor *, kiln_tensor *dy, kiln_tensor **dxs) {
  kiln_tensor *one = kiln_scalar_like(xs[0], 1);
  dxs[0] = kiln_mul(dy, kiln_sub(one, kiln_div(one, kiln_add(one, kiln_exp(xs[0])))));
  return dxs[0] ? 0 : -1;
}

TEST(CustomGradient, StableLog1pExp) {
  Scoped scope;
  kiln_tensor *x = kiln_scalar(KILN_F32, 100);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = log1pexp_fwd(nullptr, 1, &x);
  EXPECT_TRUE(std::isnan(kiln_tensor_item(grad1(tape, y, x))));
  kiln_tape_free(tape);

  tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  y = kiln_custom_gradient(log1pexp_fwd, log1pexp_grad, nullptr, 1, &x);
  ASSERT_NE(y, nullptr) << kiln_last_error();
  kiln_tensor *g = grad1(tape, y, x);
  EXPECT_EQ(kiln_tensor_dtype(g), KILN_F32);
  EXPECT_EQ(kiln_tensor_item(g), 1.0);
  kiln_tape_free(tape);

  // at 0: log 2 and 1/2
  kiln_tensor *zero = kiln_scalar(KILN_F64, 0);
  tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, zero);
  y = kiln_custom_gradient(log1pexp_fwd, log1pexp_grad, nullptr, 1, &zero);
  EXPECT_NEAR(kiln_tensor_item(y), std::log(2.0), 1e-15);
  EXPECT_EQ(kiln_tensor_item(grad1(tape, y, zero)), 0.5);
  kiln_tape_free(tape);
}

// Gradient clipping: the identity forward, clip_by_norm of dy backward.
kiln_tensor *identity_fwd(void *, int, kiln_tensor *const *xs) { return kiln_identity(xs[0]); }
int clip_grad(void *user, int, kiln_tensor *const *, kiln_tensor *, kiln_tensor *dy, kiln_tensor **dxs) {
  dxs[0] = kiln_clip_by_norm(dy, *(double *)user);
  return dxs[0] ? 0 : -1;
}

TEST(CustomGradient, GradientClipping) {
  Scoped scope;
  double max_norm = 2;
  kiln_tensor *x = f64({2}, {1, 1});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_custom_gradient(identity_fwd, clip_grad, &max_norm, 1, &x);
  EXPECT_EQ(values(y), (std::vector<double>{1, 1}));
  kiln_tensor *target = kiln_mul(y, f64({2}, {3, 4}));  // dy = (3, 4), norm 5
  kiln_tensor *g = grad1(tape, target, x);
  ASSERT_NE(g, nullptr);
  std::vector<double> got = values(g);
  EXPECT_NEAR(got[0], 1.2, 1e-15);
  EXPECT_NEAR(got[1], 1.6, 1e-15);
  kiln_tape_free(tape);
}

// A forward that returns its input itself still gives a fresh result node.
kiln_tensor *passthrough_fwd(void *, int, kiln_tensor *const *xs) { return xs[0]; }
int times3_grad(void *, int, kiln_tensor *const *, kiln_tensor *, kiln_tensor *dy, kiln_tensor **dxs) {
  dxs[0] = kiln_mul(dy, kiln_scalar_like(dy, 3));
  return 0;
}

TEST(CustomGradient, ForwardReturningItsInput) {
  Scoped scope;
  kiln_tensor *x = scalar(2);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_custom_gradient(passthrough_fwd, times3_grad, nullptr, 1, &x);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(kiln_tensor_item(y), 2);
  EXPECT_EQ(kiln_tensor_item(grad1(tape, y, x)), 3);
  kiln_tape_free(tape);
}

// Two inputs, one without a gradient; forward ops are not recorded.
kiln_tensor *muladd_fwd(void *, int, kiln_tensor *const *xs) {
  return kiln_add(kiln_mul(xs[0], xs[1]), xs[1]);
}
int muladd_grad(void *, int, kiln_tensor *const *xs, kiln_tensor *, kiln_tensor *dy, kiln_tensor **dxs) {
  dxs[0] = kiln_mul(dy, xs[1]);
  dxs[1] = nullptr;  // claimed to have none
  return dxs[0] ? 0 : -1;
}

TEST(CustomGradient, SeveralInputs) {
  Scoped scope;
  kiln_tensor *a = scalar(2), *b = scalar(5);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, a);
  kiln_tape_watch(tape, b);
  kiln_tensor *xs[2] = {a, b};
  kiln_tensor *y = kiln_custom_gradient(muladd_fwd, muladd_grad, nullptr, 2, xs);
  EXPECT_EQ(kiln_tensor_item(y), 15);
  kiln_tensor *g[2];
  ASSERT_EQ(kiln_tape_gradient(tape, kiln_mul(y, y), 2, xs, g), 0) << kiln_last_error();
  EXPECT_EQ(kiln_tensor_item(g[0]), 2 * 15 * 5);
  EXPECT_EQ(g[1], nullptr);
  kiln_tape_free(tape);
}

// The gradient function's ops are recorded by an outer tape: the custom
// gradient of x^3 (3x^2 dy, written by hand) differentiates again to 6x.
kiln_tensor *cube_fwd(void *, int, kiln_tensor *const *xs) { return kiln_mul(xs[0], kiln_mul(xs[0], xs[0])); }
int cube_grad(void *, int, kiln_tensor *const *xs, kiln_tensor *, kiln_tensor *dy, kiln_tensor **dxs) {
  dxs[0] = kiln_mul(dy, kiln_mul(kiln_scalar_like(dy, 3), kiln_mul(xs[0], xs[0])));
  return dxs[0] ? 0 : -1;
}

TEST(CustomGradient, ComposesWithNesting) {
  Scoped scope;
  kiln_tensor *x = scalar(2);
  kiln_tape *t1 = kiln_tape_begin(false);
  kiln_tape_watch(t1, x);
  kiln_tape *t2 = kiln_tape_begin(false);
  kiln_tape_watch(t2, x);
  kiln_tensor *y = kiln_custom_gradient(cube_fwd, cube_grad, nullptr, 1, &x);
  kiln_tape_end(t2);
  kiln_tensor *dy = grad1(t2, y, x);
  kiln_tape_end(t1);
  EXPECT_EQ(kiln_tensor_item(dy), 12);
  EXPECT_EQ(kiln_tensor_item(grad1(t1, dy, x)), 12);  // 6x
  kiln_tape_free(t2);
  kiln_tape_free(t1);
}

int failing_grad(void *, int, kiln_tensor *const *, kiln_tensor *, kiln_tensor *, kiln_tensor **) {
  return kiln_fail("my_grad: refused");
}
int wrong_shape_grad(void *, int, kiln_tensor *const *, kiln_tensor *, kiln_tensor *, kiln_tensor **dxs) {
  dxs[0] = kiln_zeros(KILN_F64, KILN_SHAPE(3));
  return 0;
}
kiln_tensor *null_fwd(void *, int, kiln_tensor *const *) { return nullptr; }

TEST(CustomGradient, Errors) {
  Scoped scope;
  kiln_tensor *x = scalar(2);
  EXPECT_EQ(kiln_custom_gradient(nullptr, times3_grad, nullptr, 1, &x), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("custom_gradient:"));
  EXPECT_EQ(kiln_custom_gradient(identity_fwd, nullptr, nullptr, 1, &x), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("custom_gradient:"));
  EXPECT_EQ(kiln_custom_gradient(identity_fwd, times3_grad, nullptr, 1, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("custom_gradient:"));
  kiln_clear_error();
  kiln_tensor *none = nullptr;
  EXPECT_EQ(kiln_custom_gradient(identity_fwd, times3_grad, nullptr, 1, &none), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("custom_gradient:"));
  kiln_clear_error();
  EXPECT_EQ(kiln_custom_gradient(null_fwd, times3_grad, nullptr, 1, &x), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("custom_gradient:"));

  kiln_tape *tape = kiln_tape_begin(true);
  kiln_tape_watch(tape, x);
  kiln_tensor *y = kiln_custom_gradient(identity_fwd, failing_grad, nullptr, 1, &x);
  kiln_tensor *g = x;
  EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("my_grad: refused"));
  EXPECT_EQ(g, nullptr);
  y = kiln_custom_gradient(identity_fwd, wrong_shape_grad, nullptr, 1, &x);
  EXPECT_EQ(kiln_tape_gradient(tape, y, 1, &x, &g), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("tape_gradient:"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("custom_gradient"));
  kiln_tape_free(tape);
}

// Outside any tape a custom gradient just runs fwd.
TEST(CustomGradient, WithoutATape) {
  Scoped scope;
  kiln_tensor *x = scalar(2);
  kiln_tensor *y = kiln_custom_gradient(cube_fwd, cube_grad, nullptr, 1, &x);
  EXPECT_EQ(kiln_tensor_item(y), 8);
}

// ---- the seed examples ----

// The surface area of a 4-d box with sides x1..x4:
// f4 = 2 (x1x2x3 + x1x2x4 + x1x3x4 + x2x3x4); its gradient at (1, 2, 3, 4)
// is (52, 38, 28, 22).
kiln_tensor *f4(kiln_tensor *const *x) {
  kiln_tensor *a = kiln_mul(kiln_mul(x[0], x[1]), x[2]);
  kiln_tensor *b = kiln_mul(kiln_mul(x[0], x[1]), x[3]);
  kiln_tensor *c = kiln_mul(kiln_mul(x[0], x[2]), x[3]);
  kiln_tensor *d = kiln_mul(kiln_mul(x[1], x[2]), x[3]);
  return kiln_mul(kiln_scalar_like(x[0], 2), kiln_add(kiln_add(a, b), kiln_add(c, d)));
}

TEST(TapeSeed, Hypersurface) {
  Scoped scope;
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    kiln_tensor *x[4];
    for (int i = 0; i < 4; i++) x[i] = kiln_scalar(dt, i + 1);
    kiln_tape *tape = kiln_tape_begin(false);
    for (kiln_tensor *xi : x) kiln_tape_watch(tape, xi);
    kiln_tensor *y = f4(x);
    EXPECT_EQ(kiln_tensor_item(y), 100);
    kiln_tensor *g[4];
    ASSERT_EQ(kiln_tape_gradient(tape, y, 4, x, g), 0) << kiln_last_error();
    double want[4] = {52, 38, 28, 22};
    for (int i = 0; i < 4; i++) {
      EXPECT_EQ(kiln_tensor_dtype(g[i]), dt);
      EXPECT_EQ(kiln_tensor_item(g[i]), want[i]) << "x" << i + 1;
    }
    kiln_tape_free(tape);
  }
}

// abs by C control flow: the tape records whichever branch ran.
kiln_tensor *abs_by_branch(kiln_tensor *x) { return kiln_tensor_item(x) > 0 ? x : kiln_neg(x); }

TEST(TapeSeed, AbsByControlFlow) {
  Scoped scope;
  for (double v : {2.5, -2.5}) {
    kiln_tensor *x = scalar(v);
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tensor *y = abs_by_branch(x);
    EXPECT_EQ(kiln_tensor_item(y), 2.5);
    EXPECT_EQ(kiln_tensor_item(grad1(tape, y, x)), v > 0 ? 1 : -1);
    kiln_tape_free(tape);
  }
}

// The TF eager guide's linear regression: y = 3x + 2 + noise, W = 5 and
// B = 10 trained by SGD on the mean squared error. Each step multiplies the
// distance to (3, 2) by about 1 - 2 * 0.01, so 300 steps (the guide's count)
// leave 8 * 0.98^300 ~ 0.02 of B's error; 200 would leave ~0.14.
TEST(TapeSeed, LinearRegression) {
  Scoped scope;
  kiln_random_seed(42);
  const int64_t n = 1000;
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(n));
  kiln_tensor *noise = kiln_random_normal(KILN_F32, KILN_SHAPE(n));
  kiln_tensor *y = kiln_add(kiln_add(kiln_mul(x, kiln_scalar(KILN_F32, 3)), kiln_scalar(KILN_F32, 2)), noise);
  kiln_variable *vars[2] = {kiln_variable_new(kiln_scalar(KILN_F32, 5), "W"),
                            kiln_variable_new(kiln_scalar(KILN_F32, 10), "B")};
  kiln_optimizer *sgd = kiln_sgd_new(0.01);
  ASSERT_NE(sgd, nullptr) << kiln_last_error();
  double first_loss = 0, loss = 0;
  for (int step = 0; step < 300; step++) {
    kiln_scope_push();
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tensor *pred = kiln_add(kiln_mul(x, kiln_variable_read(vars[0])), kiln_variable_read(vars[1]));
    kiln_tensor *l = kiln_reduce_mean(kiln_square(kiln_sub(pred, y)), 0, nullptr, false);
    kiln_tensor *g[2];
    ASSERT_EQ(kiln_tape_gradient_vars(tape, l, 2, vars, g), 0) << kiln_last_error();
    kiln_tape_free(tape);
    ASSERT_EQ(kiln_optimizer_apply(sgd, 2, vars, g), 0) << kiln_last_error();
    loss = kiln_tensor_item(l);
    if (step == 0) first_loss = loss;
    kiln_scope_pop();
  }
  double w = kiln_tensor_item(kiln_variable_read(vars[0])), b = kiln_tensor_item(kiln_variable_read(vars[1]));
  EXPECT_NEAR(w, 3, 0.1);
  EXPECT_NEAR(b, 2, 0.1);
  EXPECT_LT(loss, first_loss / 10);
  EXPECT_NEAR(loss, 1, 0.2);  // the noise's variance
  kiln_optimizer_free(sgd);
  for (kiln_variable *v : vars) kiln_variable_free(v);
}

}  // namespace
