// conv_cache_test.cc — the packed filters eager convolutions keep across
// calls (lib/conv_cache.c): a kept packing gives the bits of a fresh one,
// for every layout (conv2d's, conv2d_transpose's, a strided input
// gradient's phases, a variable's value read as a new view each time); a
// filter written over by a staged call's donation, or a new filter at a
// freed one's address, is packed again; filters used once are never kept;
// the cache stays within its bounds; threads sharing filters agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "ir.h" // first: the runtime header's atomics in C++
#include "conv.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

struct Stats {
  int64_t entries = 0, bytes = 0, hits = 0, fills = 0;
  Stats() { conv_cache_stats(&entries, &bytes, &hits, &fills); }
};

kiln_conv_opts opts(int stride, int pad) {
  kiln_conv_opts o = {};
  o.stride[0] = o.stride[1] = stride;
  for (int i = 0; i < 4; i++) o.padding[i] = pad;
  return o;
}

// a copy of t with a serial of its own: its packing is never a kept one
kiln_tensor *fresh(kiln_tensor *t) { return kiln_mul(t, kiln_scalar_like(t, 1)); }

// conv2d (transpose: conv2d_transpose onto an image of hw) of x with w,
// four times: each must have the bits of the same op with a fresh copy of w
void expect_kept_equal(const char *what, kiln_tensor *x, kiln_tensor *w, const kiln_conv_opts &o, bool transpose,
                       int64_t hw = 0, int phases = 1) {
  const int64_t out_hw[2] = {hw, hw};
  auto run = [&](kiln_tensor *f) {
    return transpose ? kiln_conv2d_transpose(x, f, out_hw, &o) : kiln_conv2d(x, f, &o);
  };
  kiln_tensor *want = run(fresh(w));
  ASSERT_NE(want, nullptr) << what << ": " << kiln_last_error();
  Stats before;
  for (int k = 0; k < 4; k++) {
    kiln_tensor *got = run(w);
    ASSERT_NE(got, nullptr) << what << ": " << kiln_last_error();
    EXPECT_TRUE(same_bits(got, want)) << what << ", call " << k;
  }
  // the first packing leaves a note, the second keeps the panels: the last
  // two calls at least read them (each phase's, transposed with a stride:
  // every sh-th tap, flipped)
  EXPECT_GE(Stats().hits - before.hits, 2 * phases) << what;
}

TEST(ConvCache, KeptPackingsGiveTheBitsOfFreshOnes) {
  Scoped scope;
  conv_cache_clear();
  Stats before;
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 9, 9, 32));
  kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 32, 48));
  expect_kept_equal("conv2d, padding 1", x, w, opts(1, 1), false);
  expect_kept_equal("conv2d, stride 2", x, w, opts(2, 1), false);
  kiln_tensor *dy1 = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 9, 9, 48));
  expect_kept_equal("conv2d_transpose, stride 1", dy1, w, opts(1, 1), true, 9);
  // stride 2: four phases, each its own taps of the filter (1x1 to 2x2 of
  // 96 -> 64 channels: each large enough to keep), flipped
  kiln_tensor *wt = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 64, 96));
  kiln_tensor *dy2 = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 5, 5, 96));
  expect_kept_equal("conv2d_transpose, stride 2", dy2, wt, opts(2, 1), true, 9, 4);
  // stride 3: nine phases of one tap each, all 1x1: only the tap they read
  // tells their packings apart
  kiln_tensor *dy3 = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 3, 3, 96));
  expect_kept_equal("conv2d_transpose, stride 3", dy3, wt, opts(3, 0), true, 9, 9);
  kiln_tensor *w64 = kiln_random_normal(KILN_F64, KILN_SHAPE(1, 1, 64, 80));
  expect_kept_equal("conv2d f64 1x1", kiln_random_normal(KILN_F64, KILN_SHAPE(1, 6, 6, 64)), w64, opts(1, 0), false);
  Stats after;
  // a layout is kept once: the forward's (one for both strides or two),
  // the transpose's, the phases' (4 and 9), the f64 filter's
  EXPECT_GE(after.fills - before.fills, 1 + 1 + 4 + 9 + 1);
  EXPECT_LE(after.fills - before.fills, 2 + 1 + 4 + 9 + 1);
  EXPECT_EQ(after.entries, after.fills - before.fills);

  // a variable's value is read as a new view each time: the view's base keys it
  kiln_variable *v = kiln_variable_new(w, "w");
  ASSERT_NE(v, nullptr) << kiln_last_error();
  kiln_tensor *want = kiln_conv2d(x, fresh(w), nullptr);
  for (int k = 0; k < 4; k++) EXPECT_TRUE(same_bits(kiln_conv2d(x, kiln_variable_read(v), nullptr), want)) << k;
  EXPECT_EQ(Stats().hits - after.hits, 2);
  kiln_variable_free(v);
}

// A filter used once per layout (a training step's: new every step) leaves
// a note, never panels; and a small filter is not looked up at all.
TEST(ConvCache, FiltersUsedOnceAreNotKept) {
  Scoped scope;
  conv_cache_clear();
  Stats before;
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 8, 8, 32));
  for (int step = 0; step < 5; step++) {
    kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 32, 32));
    ASSERT_NE(kiln_conv2d(x, w, nullptr), nullptr) << kiln_last_error();
  }
  kiln_tensor *small = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 4, 8));
  kiln_tensor *xs = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 8, 8, 4));
  for (int k = 0; k < 3; k++) ASSERT_NE(kiln_conv2d(xs, small, nullptr), nullptr);
  Stats after;
  EXPECT_EQ(after.entries, 0);
  EXPECT_EQ(after.fills - before.fills, 0);
  EXPECT_EQ(after.hits - before.hits, 0);
}

// A packing kept outlives the notes of many filters used once (a training
// step's, between two evaluations of a model).
TEST(ConvCache, KeptPackingsOutliveNotes) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 4, 4, 64));
  kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 1, 64, 64));
  kiln_tensor *want = kiln_conv2d(x, fresh(w), nullptr);
  for (int k = 0; k < 2; k++) ASSERT_NE(kiln_conv2d(x, w, nullptr), nullptr); // kept
  for (int i = 0; i < 300; i++) { // more notes than the cache has keys
    kiln_scope_push();
    ASSERT_NE(kiln_conv2d(x, kiln_random_normal(KILN_F32, KILN_SHAPE(1, 1, 64, 64)), nullptr), nullptr);
    kiln_scope_pop();
  }
  Stats before;
  EXPECT_TRUE(same_bits(kiln_conv2d(x, w, nullptr), want));
  EXPECT_EQ(Stats().hits - before.hits, 1);
}

// A staged call that assigns the variable writes its new value over the
// old one's buffer (donation) in the same tensor: the tensor's serial is
// renewed, so the packing kept for the old value is not used for the new.
int double_it(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  auto *v = static_cast<kiln_variable *>(user);
  if (kiln_variable_assign(v, kiln_mul(kiln_variable_read(v), kiln_scalar(KILN_F32, 2)))) return -1;
  out[0] = kiln_reduce_sum(in[0], 0, nullptr, false);
  return out[0] ? 0 : -1;
}

TEST(ConvCache, ADonatedFilterIsPackedAgain) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 7, 7, 32));
  kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 32, 40));
  kiln_conv_opts o = opts(1, 1);
  kiln_variable *v = kiln_variable_new(w, "w");
  kiln_function *f = kiln_function_new("double_it", double_it, v, 1, 1);
  ASSERT_TRUE(v && f) << kiln_last_error();
  const void *buffer = nullptr;
  for (int k = 0; k < 3; k++) { // kept, then hit
    kiln_scope_push();
    kiln_tensor *r = kiln_variable_read(v);
    buffer = kiln_tensor_data(r);
    ASSERT_NE(kiln_conv2d(x, r, &o), nullptr) << kiln_last_error();
    kiln_scope_pop(); // nothing but the variable holds its value now
  }
  Stats kept;
  ASSERT_EQ(kept.entries, 1);
  kiln_tensor *one = kiln_scalar(KILN_F32, 1), *sum = nullptr;
  ASSERT_EQ(kiln_function_call(f, &one, &sum), 0) << kiln_last_error();
  kiln_tensor *now = kiln_variable_read(v);
  // the test means something only if the value was written in place
  ASSERT_EQ(kiln_tensor_data(now), buffer) << "the staged call did not donate the variable's buffer";
  kiln_tensor *want = kiln_conv2d(x, kiln_mul(w, kiln_scalar(KILN_F32, 2)), &o);
  for (int k = 0; k < 3; k++) {
    kiln_tensor *got = kiln_conv2d(x, kiln_variable_read(v), &o);
    ASSERT_NE(got, nullptr) << kiln_last_error();
    EXPECT_TRUE(same_bits(got, want)) << "call " << k << " after the donation";
  }
  kiln_function_free(f);
  kiln_variable_free(v);
}

// A filter made where a freed one was (the allocator hands the same blocks
// back) is another tensor: its serial, not its address, is the key.
TEST(ConvCache, ANewFilterAtAFreedOnesAddressIsPackedAgain) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 6, 6, 32));
  const int64_t shape[4] = {3, 3, 32, 32};
  kiln_tensor *w1 = kiln_random_normal(KILN_F32, 4, shape);
  kiln_scope_escape(w1); // ours to free
  for (int k = 0; k < 3; k++) ASSERT_NE(kiln_conv2d(x, w1, nullptr), nullptr);
  ASSERT_EQ(Stats().entries, 1);
  const void *data = kiln_tensor_data(w1);
  kiln_release(w1);
  kiln_tensor *w2 = nullptr;
  for (int tries = 0; tries < 8 && !w2; tries++) {
    kiln_tensor *t = kiln_fill(KILN_F32, 4, shape, 0.25 + tries);
    if (kiln_tensor_data(t) == data) w2 = t;
  }
  ASSERT_NE(w2, nullptr) << "no new filter landed at the freed one's address";
  kiln_tensor *want = kiln_conv2d(x, fresh(w2), nullptr);
  for (int k = 0; k < 3; k++) EXPECT_TRUE(same_bits(kiln_conv2d(x, w2, nullptr), want)) << k;
}

// At most 128 keys and 256 MiB of panels, whatever is asked of it.
TEST(ConvCache, StaysWithinItsBounds) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 2, 2, 64));
  for (int i = 0; i < 150; i++) { // more keys than it holds
    kiln_scope_push();
    kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 1, 64, 64));
    for (int k = 0; k < 2; k++) ASSERT_NE(kiln_conv2d(x, w, nullptr), nullptr);
    kiln_scope_pop();
  }
  Stats keys;
  EXPECT_GE(keys.entries, 64);
  EXPECT_LE(keys.entries, 128);
  kiln_tensor *xb = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 3, 3, 256));
  int64_t most = 0;
  for (int i = 0; i < 60; i++) { // 60 x 4.7 MB of panels
    kiln_scope_push();
    kiln_tensor *w = kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 256, 512));
    kiln_conv_opts o = opts(1, 1);
    for (int k = 0; k < 2; k++) ASSERT_NE(kiln_conv2d(xb, w, &o), nullptr);
    kiln_scope_pop();
    Stats s;
    most = std::max(most, s.bytes);
  }
  EXPECT_LE(most, (int64_t)256 << 20);
  EXPECT_GE(most, (int64_t)200 << 20); // it did fill up
  conv_cache_clear();
  EXPECT_EQ(Stats().bytes, 0);
}

// Threads sharing filters (each layout kept by whichever thread packs it
// second, then read by all) get the bits a fresh packing gives.
TEST(ConvCache, ConcurrentCallsAgree) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 8, 8, 32));
  kiln_tensor *dy = kiln_random_normal(KILN_F32, KILN_SHAPE(1, 4, 4, 32));
  std::vector<kiln_tensor *> ws, want_f, want_t;
  kiln_conv_opts o = opts(2, 1);
  const int64_t hw[2] = {8, 8};
  for (int i = 0; i < 3; i++) {
    ws.push_back(kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 32, 32)));
    want_f.push_back(kiln_conv2d(x, fresh(ws[i]), &o));
    want_t.push_back(kiln_conv2d_transpose(dy, fresh(ws[i]), hw, &o));
  }
  std::vector<int> wrong(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; t++)
    threads.emplace_back([&, t] {
      for (int k = 0; k < 25; k++) {
        kiln_scope_push();
        int i = (k + t) % 3;
        wrong[t] += !same_bits(kiln_conv2d(x, ws[i], &o), want_f[i]);
        wrong[t] += !same_bits(kiln_conv2d_transpose(dy, ws[i], hw, &o), want_t[i]);
        kiln_scope_pop();
      }
    });
  for (auto &th : threads) th.join();
  for (int t = 0; t < 4; t++) EXPECT_EQ(wrong[t], 0) << "thread " << t;
  EXPECT_GT(Stats().hits, 0);
}

}  // namespace

namespace {

// conv2d(x, w) and conv2d_transpose(x', w) with w a variable: compiled code
// reads the filter as a parameter
int staged_convs(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *w = kiln_variable_read((kiln_variable *)user);
  kiln_conv_opts o = opts(1, 1);
  int64_t hw[2] = {7, 7};
  out[0] = kiln_conv2d(in[0], w, &o);
  out[1] = out[0] ? kiln_conv2d_transpose(out[0], w, hw, &o) : nullptr;
  return out[0] && out[1] ? 0 : -1;
}

// two convolutions of one layout with the variable, then the variable
// doubled: a staged call writes it over in place (donation) after its
// convolutions read it
int staged_convs_then_double(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_variable *v = (kiln_variable *)user;
  kiln_tensor *w = kiln_variable_read(v);
  kiln_conv_opts o = opts(1, 1);
  out[0] = kiln_conv2d(in[0], w, &o);
  out[1] = kiln_conv2d(kiln_neg(in[0]), w, &o);
  if (!out[0] || !out[1]) return -1;
  return kiln_variable_assign(v, kiln_mul(w, kiln_scalar(KILN_F32, 2)));
}

}  // namespace

// A staged function's convolutions whose filter is a parameter keep its
// packing across calls, as eager ones do (compiled code passed no owner, so
// it packed every filter on every call); the bits stay those of eager
// calls.
TEST(ConvCache, StagedConvolutionsKeepTheirFiltersPacking) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 7, 7, 32));
  kiln_variable *v = kiln_variable_new(kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 32, 40)), "w");
  kiln_function *f = kiln_function_new("convs", staged_convs, v, 1, 2);
  ASSERT_TRUE(v && f) << kiln_last_error();
  kiln_tensor *want[2];
  ASSERT_EQ(staged_convs(v, 1, &x, 2, want), 0) << kiln_last_error();
  for (int k = 0; k < 4; k++) {
    kiln_tensor *got[2];
    ASSERT_EQ(kiln_function_call(f, &x, got), 0) << kiln_last_error();
    EXPECT_TRUE(same_bits(got[0], want[0])) << "call " << k;
    EXPECT_TRUE(same_bits(got[1], want[1])) << "call " << k;
  }
  Stats s;
  EXPECT_GE(s.hits, 2) << "the compiled calls kept no packing";
  kiln_function_free(f);
  kiln_variable_free(v);
}

// A staged call that convolves twice with a variable (one layout) and then
// writes it over in place: the new value's serial is given before the
// program runs, so its convolutions (which read the old bytes) must not
// key a packing on it, or the next call that reads the variable finds the
// old filter's packing under the new value.
TEST(ConvCache, AStagedCallThatWritesItsFilterInPlaceGivesFreshBits) {
  Scoped scope;
  conv_cache_clear();
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(2, 7, 7, 32));
  kiln_variable *v = kiln_variable_new(kiln_random_normal(KILN_F32, KILN_SHAPE(3, 3, 32, 40)), "w");
  kiln_function *write = kiln_function_new("convs_double", staged_convs_then_double, v, 1, 2);
  kiln_function *read = kiln_function_new("convs", staged_convs, v, 1, 2);
  ASSERT_TRUE(v && write && read) << kiln_last_error();
  const void *buffer = nullptr;
  for (int k = 0; k < 4; k++) {
    kiln_scope_push();
    kiln_tensor *out[2], *got[2], *want[2];
    ASSERT_EQ(kiln_function_call(write, &x, out), 0) << kiln_last_error();
    kiln_tensor *now = kiln_variable_read(v);
    if (k == 0) buffer = kiln_tensor_data(now);
    ASSERT_EQ(kiln_tensor_data(now), buffer) << "call " << k << " did not write the variable in place";
    ASSERT_EQ(kiln_function_call(read, &x, got), 0) << kiln_last_error();
    kiln_variable *copy = kiln_variable_new(fresh(now), "copy");  // eagerly, from a copy of the value now
    ASSERT_EQ(staged_convs(copy, 1, &x, 2, want), 0) << kiln_last_error();
    kiln_variable_free(copy);
    EXPECT_TRUE(same_bits(got[0], want[0])) << "call " << k;
    EXPECT_TRUE(same_bits(got[1], want[1])) << "call " << k;
    kiln_scope_pop();
  }
  kiln_function_free(write);
  kiln_function_free(read);
  kiln_variable_free(v);
}
