// dataset_test.cc — input pipelines (kiln_dataset_*, API.md §13): every
// stage's order and contents by hand, shuffle's statistics (all orders
// reachable, none favoured, a new one each epoch), map through staged
// functions and their errors, prefetch's thread (DatasetPrefetch.*, also run
// under ThreadSanitizer by scripts/test.sh), a 1M-element pipeline in flat
// memory, and the bad inputs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;
using testing::StartsWith;

namespace {

// ---- helpers ----

// The dataset of the scalars 0 .. n-1 (f32), one per element.
kiln_dataset *range(int64_t n) {
  kiln_scope_push();
  kiln_tensor *t = kiln_arange(KILN_F32, n);
  kiln_dataset *ds = kiln_dataset_from_tensors(1, &t);
  kiln_scope_pop();
  EXPECT_NE(ds, nullptr) << kiln_last_error();
  return ds;
}

// Every remaining element's tensor 0, flattened to doubles, one vector per
// element; the dataset must end without an error.
std::vector<VD> drain(kiln_dataset *ds, int arity = 1) {
  std::vector<VD> out;
  for (;;) {
    kiln_scope_push();
    std::vector<kiln_tensor *> t(arity);
    int rc = kiln_dataset_next(ds, arity, t.data());
    if (rc == 1) out.push_back(values(t[0]));
    kiln_scope_pop();
    EXPECT_GE(rc, 0) << kiln_last_error();
    if (rc != 1) return out;
  }
}

// The scalars of drain(ds), in order.
VD scalars(kiln_dataset *ds) {
  VD v;
  for (const VD &e : drain(ds)) {
    EXPECT_EQ(e.size(), 1u);
    v.push_back(e.empty() ? -1 : e[0]);
  }
  return v;
}

VD iota(int n, double from = 0) {
  VD v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

// Pearson's chi-square of counts against a uniform expectation over k cells.
double chi_square(const std::map<VD, int> &counts, int k, int draws) {
  double expect = (double)draws / k, chi = 0;
  int seen = 0;
  for (const auto &c : counts) {
    chi += (c.second - expect) * (c.second - expect) / expect;
    seen++;
  }
  chi += (k - seen) * expect; // cells never drawn
  return chi;
}

// The order shuffle(range(n), buffer, seed) gives.
VD shuffled(int n, int64_t buffer, uint64_t seed) {
  kiln_dataset *ds = kiln_dataset_shuffle(range(n), buffer, seed);
  EXPECT_NE(ds, nullptr) << kiln_last_error();
  VD v = scalars(ds);
  kiln_dataset_free(ds);
  return v;
}

// ---- staged bodies for map ----

int affine(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) { // x * 2 + 1
  out[0] = kiln_add(kiln_mul(in[0], kiln_scalar_like(in[0], 2)), kiln_scalar_like(in[0], 1));
  return out[0] ? 0 : -1;
}

int sum_and_product(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], in[1]);
  out[1] = kiln_mul(in[0], in[1]);
  return out[0] && out[1] ? 0 : -1;
}

// adds a [2] vector to its input: a shape error for inputs of shape [3]
int mismatched(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], kiln_ones(KILN_F32, KILN_SHAPE(2)));
  return out[0] ? 0 : -1;
}

// x + 1 after a millisecond: run eagerly (kiln_function_set_eager), so that
// the C code, and its sleep, runs at every call
std::atomic<int> slow_calls{0};
int slow(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  usleep(1000);
  slow_calls++;
  out[0] = kiln_add(in[0], kiln_scalar_like(in[0], 1));
  return out[0] ? 0 : -1;
}

// fails on the element whose value is 3 (eager: it reads the value)
int fails_on_three(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_tensor_item(in[0]) == 3) return kiln_fail("three is not allowed");
  out[0] = kiln_add(in[0], kiln_scalar_like(in[0], 0));
  return out[0] ? 0 : -1;
}

// ds maps range(5) through fails_on_three: 0 1 2, the error (its message on
// this thread, no other call leaving one), 4, the end, and the end again
void expect_three_fails(kiln_dataset *ds) {
  std::vector<int> rcs;
  VD got;
  kiln_tensor *out;
  for (;;) {
    kiln_scope_push();
    kiln_clear_error();
    int rc = kiln_dataset_next(ds, 1, &out);
    rcs.push_back(rc);
    if (rc == 1) got.push_back(kiln_tensor_item(out));
    if (rc == -1) {
      EXPECT_STREQ(kiln_last_error(), "kiln_dataset_next: map: element 3: @fails_on_three: three is not allowed");
    } else {
      EXPECT_STREQ(kiln_last_error(), "");
    }
    kiln_scope_pop();
    if (rc == 0) break;
  }
  EXPECT_EQ(rcs, (std::vector<int>{1, 1, 1, -1, 1, 0}));
  EXPECT_EQ(got, (VD{0, 1, 2, 4}));
  EXPECT_EQ(kiln_dataset_next(ds, 1, &out), 0);
}

struct Fn {
  kiln_function *f;
  Fn(const char *name, kiln_body_fn body, int n_in, int n_out, bool eager = false)
      : f(kiln_function_new(name, body, nullptr, n_in, n_out)) {
    EXPECT_NE(f, nullptr) << kiln_last_error();
    if (eager) kiln_function_set_eager(f, true);
  }
  ~Fn() { kiln_function_free(f); }
};

long rss_pages() {
  long size = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return -1;
  if (fscanf(f, "%ld %ld", &size, &resident) != 2) resident = -1;
  fclose(f);
  return resident;
}

// ---- from_tensors ----

TEST(Dataset, FromTensorsSlicesAxisZero) {
  Scoped s;
  kiln_tensor *ts[2] = {f32({3, 2}, {0, 1, 10, 11, 20, 21}), i64({3}, {7, 8, 9})};
  kiln_dataset *ds = kiln_dataset_from_tensors(2, ts);
  ASSERT_NE(ds, nullptr) << kiln_last_error();
  kiln_tensor *one = ts[0];
  EXPECT_EQ(kiln_dataset_next(ds, 1, &one), -1); // too few slots: an error, nothing taken
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: out has 1 slots, the elements have 2 tensors"));
  EXPECT_EQ(one, nullptr);
  for (int i = 0; i < 3; i++) {
    kiln_tensor *out[3] = {nullptr, nullptr, ts[0]};
    ASSERT_EQ(kiln_dataset_next(ds, 3, out), 1) << kiln_last_error();
    EXPECT_EQ(kiln_tensor_dtype(out[0]), KILN_F32);
    EXPECT_EQ(shape_of(out[0]), V64{2});
    EXPECT_EQ(values(out[0]), (VD{10.0 * i, 10.0 * i + 1}));
    EXPECT_EQ(kiln_tensor_dtype(out[1]), KILN_I64);
    EXPECT_EQ(kiln_tensor_rank(out[1]), 0);
    EXPECT_EQ(values(out[1]), VD{7.0 + i});
    EXPECT_EQ(out[2], nullptr); // slots past the arity are cleared
  }
  kiln_tensor *out[2] = {ts[0], ts[0]};
  EXPECT_EQ(kiln_dataset_next(ds, 2, out), 0);
  EXPECT_EQ(out[0], nullptr);
  EXPECT_EQ(kiln_dataset_next(ds, 2, out), 0); // the end again
  kiln_dataset_free(ds);
}

TEST(Dataset, FromTensorsKeepsItsReferencesAndElementsOutliveTheChain) {
  int64_t live = kiln_debug_live_tensors();
  kiln_tensor *x = kiln_tensor_new(KILN_F64, KILN_SHAPE(2, 2), (const double[]){1, 2, 3, 4});
  kiln_dataset *ds = kiln_dataset_from_tensors(1, &x);
  ASSERT_NE(ds, nullptr);
  kiln_release(x); // the dataset's reference keeps it
  kiln_tensor *a, *b;
  ASSERT_EQ(kiln_dataset_next(ds, 1, &a), 1); // no scope: ours to release
  kiln_dataset_free(ds);
  EXPECT_EQ(values(a), (VD{1, 2}));
  kiln_release(a);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
  // in a scope, elements belong to it
  x = kiln_tensor_new(KILN_F64, KILN_SHAPE(2, 2), (const double[]){1, 2, 3, 4});
  ds = kiln_dataset_from_tensors(1, &x);
  kiln_release(x);
  kiln_scope_push();
  ASSERT_EQ(kiln_dataset_next(ds, 1, &a), 1);
  ASSERT_EQ(kiln_dataset_next(ds, 1, &b), 1);
  EXPECT_EQ(values(b), (VD{3, 4}));
  kiln_scope_pop();
  kiln_dataset_free(ds);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

TEST(Dataset, EmptySource) {
  Scoped s;
  kiln_tensor *x = kiln_zeros(KILN_F32, KILN_SHAPE(0, 3));
  kiln_dataset *ds = kiln_dataset_repeat(kiln_dataset_batch(kiln_dataset_from_tensors(1, &x), 2, false), -1);
  ASSERT_NE(ds, nullptr) << kiln_last_error();
  EXPECT_TRUE(drain(ds).empty()); // repeat forever of nothing ends
  kiln_dataset_free(ds);
}

// ---- shuffle ----

TEST(Dataset, ShuffleBufferOfOneKeepsTheOrder) {
  Scoped s;
  EXPECT_EQ(shuffled(7, 1, 42), iota(7));
}

TEST(Dataset, ShuffleIsAPermutationReproduciblePerSeed) {
  Scoped s;
  for (int64_t buffer : std::vector<int64_t>{2, 3, 10, 100, (int64_t)1 << 62}) {
    VD a = shuffled(50, buffer, 7), b = shuffled(50, buffer, 7), c = shuffled(50, buffer, 8);
    EXPECT_EQ(a, b) << "buffer " << buffer;
    EXPECT_NE(a, c) << "buffer " << buffer;
    EXPECT_NE(a, iota(50)) << "buffer " << buffer;
    // tf.data's buffer: the element at position p came in among the first p + buffer
    for (size_t p = 0; p < a.size(); p++) EXPECT_LT(a[p], (double)p + (double)buffer) << p;
    std::sort(a.begin(), a.end());
    EXPECT_EQ(a, iota(50)) << "buffer " << buffer;
  }
}

// Over 2400 seeds, every order of 4 elements comes out (24 of them, 100
// expected each) and none is favoured: chi-square with 23 degrees of freedom
// stays under 70 (p < 1e-6 for a fair shuffle). A biased shuffle fails the
// same bound: a buffer of 2 (the first element is one of the first two), and
// no shuffle at all.
TEST(Dataset, ShuffleOrdersAreUniform) {
  Scoped s;
  const int n = 4, k = 24, draws = 2400;
  auto tally = [&](int64_t buffer) {
    std::map<VD, int> counts;
    for (int seed = 0; seed < draws; seed++) counts[shuffled(n, buffer, (uint64_t)seed * 7919 + 1)]++;
    return counts;
  };
  std::map<VD, int> fair = tally(n), wide = tally(1000);
  EXPECT_EQ(fair.size(), (size_t)k);
  EXPECT_EQ(wide.size(), (size_t)k);
  EXPECT_LT(chi_square(fair, k, draws), 70.0);
  EXPECT_LT(chi_square(wide, k, draws), 70.0);
  EXPECT_GT(chi_square(tally(2), k, draws), 70.0);
  EXPECT_GT(chi_square(tally(1), k, draws), 70.0);
  // 3 elements, 6 orders, under a repeat: the epochs of one seed too
  std::map<VD, int> epochs;
  kiln_dataset *ds = kiln_dataset_repeat(kiln_dataset_shuffle(range(3), 3, 99), 600);
  VD all = scalars(ds);
  kiln_dataset_free(ds);
  ASSERT_EQ(all.size(), 1800u);
  for (size_t e = 0; e < 600; e++) epochs[VD(all.begin() + 3 * e, all.begin() + 3 * e + 3)]++;
  EXPECT_EQ(epochs.size(), 6u);
  EXPECT_LT(chi_square(epochs, 6, 600), 30.0); // 5 degrees of freedom: p < 1e-5
}

TEST(Dataset, ShuffleDrawsANewOrderEachEpoch) {
  Scoped s;
  auto epochs = [](uint64_t seed) {
    kiln_dataset *ds = kiln_dataset_repeat(kiln_dataset_shuffle(range(10), 10, seed), 3);
    VD v = scalars(ds);
    kiln_dataset_free(ds);
    return v;
  };
  VD a = epochs(5);
  ASSERT_EQ(a.size(), 30u);
  std::vector<VD> e;
  for (int i = 0; i < 3; i++) {
    e.emplace_back(a.begin() + 10 * i, a.begin() + 10 * i + 10);
    VD sorted = e.back();
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, iota(10)) << "epoch " << i;
  }
  EXPECT_NE(e[0], e[1]);
  EXPECT_NE(e[1], e[2]);
  EXPECT_EQ(e[0], shuffled(10, 10, 5)); // epoch 0 is the shuffle's own first order
  EXPECT_EQ(epochs(5), a);              // and the whole run again per seed
  // after the repeat: one stream across the epochs' boundaries
  kiln_dataset *ds = kiln_dataset_shuffle(kiln_dataset_repeat(range(4), 2), 8, 3);
  VD b = scalars(ds);
  kiln_dataset_free(ds);
  std::sort(b.begin(), b.end());
  EXPECT_EQ(b, (VD{0, 0, 1, 1, 2, 2, 3, 3}));
}

// ---- batch ----

TEST(Dataset, BatchStacksEachTensor) {
  Scoped s;
  kiln_tensor *ts[2] = {f32({5, 2}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}), i32({5}, {10, 11, 12, 13, 14})};
  for (bool drop : {false, true}) {
    kiln_dataset *ds = kiln_dataset_batch(kiln_dataset_from_tensors(2, ts), 2, drop);
    ASSERT_NE(ds, nullptr) << kiln_last_error();
    std::vector<V64> shapes;
    VD xs, ys;
    kiln_tensor *out[2];
    int rc;
    while ((rc = kiln_dataset_next(ds, 2, out)) == 1) {
      shapes.push_back(shape_of(out[0]));
      EXPECT_EQ(kiln_tensor_dtype(out[1]), KILN_I32);
      EXPECT_EQ(shape_of(out[1]), V64{shape_of(out[0])[0]});
      for (double v : values(out[0])) xs.push_back(v);
      for (double v : values(out[1])) ys.push_back(v);
    }
    EXPECT_EQ(rc, 0) << kiln_last_error();
    if (drop) {
      EXPECT_EQ(shapes, (std::vector<V64>{{2, 2}, {2, 2}}));
      EXPECT_EQ(xs, iota(8));
      EXPECT_EQ(ys, iota(4, 10));
    } else {
      EXPECT_EQ(shapes, (std::vector<V64>{{2, 2}, {2, 2}, {1, 2}}));
      EXPECT_EQ(xs, iota(10));
      EXPECT_EQ(ys, iota(5, 10));
    }
    kiln_dataset_free(ds);
  }
  // a batch larger than the data: one short batch, or nothing
  kiln_dataset *ds = kiln_dataset_batch(range(3), 8, false);
  EXPECT_EQ(drain(ds), (std::vector<VD>{{0, 1, 2}}));
  kiln_dataset_free(ds);
  ds = kiln_dataset_batch(range(3), 8, true);
  EXPECT_TRUE(drain(ds).empty());
  kiln_dataset_free(ds);
}

TEST(Dataset, BatchOfMismatchedShapesFails) {
  Scoped s;
  // batches of 3 and 2 rows, batched again: the second differs from the first
  kiln_dataset *ds = kiln_dataset_batch(kiln_dataset_batch(range(5), 3, false), 2, false);
  ASSERT_NE(ds, nullptr);
  kiln_tensor *out;
  EXPECT_EQ(kiln_dataset_next(ds, 1, &out), -1);
  EXPECT_EQ(out, nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: batch:"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("(2,)"));
  EXPECT_THAT(kiln_last_error(), HasSubstr("(3,)"));
  EXPECT_EQ(kiln_dataset_next(ds, 1, &out), 0);
  kiln_dataset_free(ds);
}

// ---- repeat ----

TEST(Dataset, RepeatCounts) {
  Scoped s;
  for (int64_t count : {0, 1, 3}) {
    kiln_dataset *ds = kiln_dataset_repeat(range(3), count);
    VD want;
    for (int64_t i = 0; i < count; i++)
      for (double v : iota(3)) want.push_back(v);
    EXPECT_EQ(scalars(ds), want) << count;
    kiln_dataset_free(ds);
  }
  kiln_dataset *ds = kiln_dataset_repeat(range(3), -1);
  for (int i = 0; i < 3001; i++) {
    kiln_scope_push();
    kiln_tensor *t;
    ASSERT_EQ(kiln_dataset_next(ds, 1, &t), 1);
    EXPECT_EQ(kiln_tensor_item(t), i % 3);
    kiln_scope_pop();
  }
  kiln_dataset_free(ds);
  // nested repeats restart what they wrap; batches across epochs
  ds = kiln_dataset_batch(kiln_dataset_repeat(kiln_dataset_repeat(range(2), 2), 2), 3, false);
  EXPECT_EQ(drain(ds), (std::vector<VD>{{0, 1, 0}, {1, 0, 1}, {0, 1}}));
  kiln_dataset_free(ds);
}

// ---- map ----

TEST(Dataset, MapThroughAStagedFunction) {
  Scoped s;
  Fn f("affine", affine, 1, 1);
  kiln_dataset *ds = kiln_dataset_batch(kiln_dataset_map(range(5), f.f), 2, false);
  ASSERT_NE(ds, nullptr) << kiln_last_error();
  EXPECT_EQ(drain(ds), (std::vector<VD>{{1, 3}, {5, 7}, {9}}));
  kiln_dataset_free(ds);
  EXPECT_EQ(kiln_function_trace_count(f.f), 1); // one trace: every element is a scalar
  // two tensors in, two out
  Fn g("sum_and_product", sum_and_product, 2, 2);
  kiln_tensor *ts[2] = {f64({3}, {1, 2, 3}), f64({3}, {10, 20, 30})};
  ds = kiln_dataset_map(kiln_dataset_from_tensors(2, ts), g.f);
  ASSERT_NE(ds, nullptr) << kiln_last_error();
  kiln_tensor *out[2];
  for (int i = 1; i <= 3; i++) {
    ASSERT_EQ(kiln_dataset_next(ds, 2, out), 1) << kiln_last_error();
    EXPECT_EQ(values(out[0]), VD{11.0 * i});
    EXPECT_EQ(values(out[1]), VD{10.0 * i * i});
  }
  EXPECT_EQ(kiln_dataset_next(ds, 2, out), 0);
  kiln_dataset_free(ds);
  // the function's inputs must match the elements' arity
  Fn h("affine2", affine, 1, 1);
  ds = kiln_dataset_from_tensors(2, ts);
  EXPECT_EQ(kiln_dataset_map(ds, h.f), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_map: @affine2 takes 1 inputs"));
  kiln_dataset_free(ds); // still ours: the map failed
}

TEST(Dataset, MapErrorsNameTheFunction) {
  Scoped s;
  Fn f("mismatched", mismatched, 1, 1);
  kiln_tensor *x = kiln_ones(KILN_F32, KILN_SHAPE(2, 3));
  kiln_dataset *ds = kiln_dataset_map(kiln_dataset_from_tensors(1, &x), f.f);
  ASSERT_NE(ds, nullptr);
  kiln_tensor *out;
  for (int i = 0; i < 2; i++) {
    EXPECT_EQ(kiln_dataset_next(ds, 1, &out), -1);
    EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: map: element " + std::to_string(i) + ": @mismatched"));
    EXPECT_THAT(kiln_last_error(), HasSubstr("(3,)"));
  }
  EXPECT_EQ(kiln_dataset_next(ds, 1, &out), 0);
  kiln_dataset_free(ds);
  // an error on one element: the others come through
  Fn g("fails_on_three", fails_on_three, 1, 1, true);
  ds = kiln_dataset_map(range(5), g.f);
  expect_three_fails(ds);
  kiln_dataset_free(ds);
}

// ---- prefetch (also under ThreadSanitizer) ----

// shuffle, a slow map, batch, repeat: the same batches with a prefetch
// anywhere in the chain as without one
TEST(DatasetPrefetch, SameResultsAsWithout) {
  Scoped s;
  Fn f("slow", slow, 1, 1, true);
  auto run = [&](int where) {
    kiln_dataset *ds = kiln_dataset_shuffle(range(20), 8, 11);
    if (where == 1) ds = kiln_dataset_prefetch(ds, 2);
    ds = kiln_dataset_map(ds, f.f);
    if (where == 2) ds = kiln_dataset_prefetch(ds, 3);
    ds = kiln_dataset_repeat(kiln_dataset_batch(ds, 3, false), 2);
    if (where == 3) ds = kiln_dataset_prefetch(ds, 1);
    EXPECT_NE(ds, nullptr) << kiln_last_error();
    std::vector<VD> v = drain(ds);
    kiln_dataset_free(ds);
    return v;
  };
  std::vector<VD> want = run(0);
  ASSERT_EQ(want.size(), 14u);
  EXPECT_EQ(want[6].size(), 2u); // a short batch ends each epoch
  VD epoch0;
  for (int i = 0; i < 7; i++) epoch0.insert(epoch0.end(), want[i].begin(), want[i].end());
  EXPECT_NE(epoch0, iota(20, 1));
  std::sort(epoch0.begin(), epoch0.end());
  EXPECT_EQ(epoch0, iota(20, 1));
  for (int where = 1; where <= 3; where++) EXPECT_EQ(run(where), want) << "prefetch at " << where;
}

TEST(DatasetPrefetch, RunsAheadWhileTheConsumerWorks) {
  Scoped s;
  Fn f("slow", slow, 1, 1, true);
  kiln_dataset *ds = kiln_dataset_prefetch(kiln_dataset_map(range(10), f.f), 4);
  ASSERT_NE(ds, nullptr);
  slow_calls = 0;
  kiln_tensor *out;
  kiln_scope_push();
  ASSERT_EQ(kiln_dataset_next(ds, 1, &out), 1);
  kiln_scope_pop();
  for (int i = 0; i < 2000 && slow_calls < 5; i++) usleep(1000); // one taken, 4 queued
  EXPECT_EQ(slow_calls.load(), 5);
  usleep(20000);
  EXPECT_EQ(slow_calls.load(), 5); // the queue is full: the thread waits
  VD rest = scalars(ds);
  EXPECT_EQ(rest, iota(9, 2));
  kiln_dataset_free(ds);
}

TEST(DatasetPrefetch, FreeStopsTheThreadEarly) {
  Scoped s;
  Fn f("slow", slow, 1, 1, true);
  for (int taken : {0, 1, 3}) {
    kiln_dataset *ds = kiln_dataset_prefetch(kiln_dataset_map(kiln_dataset_repeat(range(4), -1), f.f), 2);
    ASSERT_NE(ds, nullptr);
    for (int i = 0; i < taken; i++) {
      kiln_scope_push();
      kiln_tensor *out;
      ASSERT_EQ(kiln_dataset_next(ds, 1, &out), 1);
      EXPECT_EQ(kiln_tensor_item(out), i % 4 + 1);
      kiln_scope_pop();
    }
    usleep(10000); // the thread fills the queue and waits on it
    kiln_dataset_free(ds);
  }
}

TEST(DatasetPrefetch, ErrorsComeThroughInOrder) {
  Scoped s;
  Fn f("fails_on_three", fails_on_three, 1, 1, true);
  kiln_dataset *ds = kiln_dataset_prefetch(kiln_dataset_map(range(5), f.f), 2);
  expect_three_fails(ds);
  kiln_dataset_free(ds);
}

TEST(DatasetPrefetch, TwoPipelinesOnTwoThreads) {
  Scoped s;
  Fn f("affine", affine, 1, 1);
  VD want;
  for (double v : iota(100)) want.push_back(2 * v + 1);
  auto work = [&](VD *got) {
    kiln_dataset *ds = kiln_dataset_prefetch(kiln_dataset_map(range(100), f.f), 3);
    *got = scalars(ds);
    kiln_dataset_free(ds);
  };
  VD a, b;
  std::thread t(work, &a);
  work(&b);
  t.join();
  EXPECT_EQ(a, want);
  EXPECT_EQ(b, want);
}

// ---- a long pipeline in flat memory ----

TEST(Dataset, MillionElementsInFlatMemory) {
  Scoped s;
  const int64_t n = 1000000;
  kiln_tensor *x = kiln_arange(KILN_F32, n);
  kiln_dataset *ds = kiln_dataset_repeat(kiln_dataset_batch(kiln_dataset_shuffle(kiln_dataset_from_tensors(1, &x), 1000, 1), 64, false), 2);
  ASSERT_NE(ds, nullptr) << kiln_last_error();
  double sum = 0;
  int64_t batches = 0, elements = 0;
  long rss_early = 0;
  for (;;) {
    kiln_scope_push();
    kiln_tensor *b;
    int rc = kiln_dataset_next(ds, 1, &b);
    if (rc == 1) {
      const float *p = (const float *)kiln_tensor_data(b);
      for (int64_t i = 0; i < kiln_tensor_size(b); i++) sum += p[i];
      elements += kiln_tensor_size(b);
      batches++;
    }
    kiln_scope_pop();
    ASSERT_GE(rc, 0) << kiln_last_error();
    if (rc == 0) break;
    if (batches == 1000) rss_early = rss_pages();
  }
  long rss_end = rss_pages();
  kiln_dataset_free(ds);
  EXPECT_EQ(batches, 2 * 15625);
  EXPECT_EQ(elements, 2 * n);
  EXPECT_EQ(sum, 2 * (double)n * (n - 1) / 2);
  ASSERT_GT(rss_early, 0);
  long page_kb = sysconf(_SC_PAGESIZE) / 1024;
  EXPECT_LT((rss_end - rss_early) * page_kb, 4 * 1024) << "RSS grew from " << rss_early * page_kb << " KB to "
                                                        << rss_end * page_kb << " KB";
}

// ---- bad input ----

TEST(Dataset, BadInputs) {
  Scoped s;
  kiln_tensor *x = f32({3}, {1, 2, 3}), *y = f32({2}, {1, 2}), *scalar = kiln_scalar(KILN_F32, 1);
  kiln_tensor *none[2] = {x, nullptr};
  auto fails = [](kiln_dataset *ds, const char *prefix) {
    EXPECT_EQ(ds, nullptr);
    EXPECT_THAT(kiln_last_error(), StartsWith(prefix));
    kiln_clear_error();
  };
  fails(kiln_dataset_from_tensors(0, &x), "kiln_dataset_from_tensors: n = 0");
  fails(kiln_dataset_from_tensors(-1, &x), "kiln_dataset_from_tensors: n = -1");
  fails(kiln_dataset_from_tensors(1, nullptr), "kiln_dataset_from_tensors: ts is NULL");
  fails(kiln_dataset_from_tensors(2, none), "kiln_dataset_from_tensors: ts[1] is NULL");
  fails(kiln_dataset_from_tensors(1, &scalar), "kiln_dataset_from_tensors: ts[0] is a scalar");
  kiln_tensor *xy[2] = {x, y};
  fails(kiln_dataset_from_tensors(2, xy), "kiln_dataset_from_tensors: ts[1] has shape (2,), ts[0] (3,)");
  // NULL in: NULL out, the first error kept
  kiln_fail("earlier: something");
  fails(kiln_dataset_shuffle(nullptr, 4, 0), "earlier: something");
  fails(kiln_dataset_batch(nullptr, 4, false), "kiln_dataset_batch: dataset is NULL");
  fails(kiln_dataset_repeat(nullptr, 1), "kiln_dataset_repeat: dataset is NULL");
  fails(kiln_dataset_map(nullptr, nullptr), "kiln_dataset_map: dataset is NULL");
  fails(kiln_dataset_prefetch(nullptr, 1), "kiln_dataset_prefetch: dataset is NULL");
  fails(kiln_dataset_shuffle(kiln_dataset_from_tensors(0, &x), 4, 0), "kiln_dataset_from_tensors: n = 0");
  kiln_tensor *out[2];
  EXPECT_EQ(kiln_dataset_next(nullptr, 1, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: dataset is NULL"));
  kiln_dataset_free(nullptr);
  // a failing transform leaves its input to the caller (ASan finds a leak or a double free)
  kiln_dataset *ds = kiln_dataset_from_tensors(1, &x);
  ASSERT_NE(ds, nullptr);
  fails(kiln_dataset_shuffle(ds, 0, 1), "kiln_dataset_shuffle: buffer_size = 0");
  fails(kiln_dataset_shuffle(ds, -5, 1), "kiln_dataset_shuffle: buffer_size = -5");
  fails(kiln_dataset_batch(ds, 0, false), "kiln_dataset_batch: batch_size = 0");
  fails(kiln_dataset_batch(ds, -1, true), "kiln_dataset_batch: batch_size = -1");
  fails(kiln_dataset_repeat(ds, -2), "kiln_dataset_repeat: count = -2");
  fails(kiln_dataset_prefetch(ds, 0), "kiln_dataset_prefetch: depth = 0");
  fails(kiln_dataset_prefetch(ds, -3), "kiln_dataset_prefetch: depth = -3");
  fails(kiln_dataset_map(ds, nullptr), "kiln_dataset_map: function is NULL");
  EXPECT_EQ(kiln_dataset_next(ds, 0, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: out has 0 slots, the elements have 1 tensors"));
  EXPECT_EQ(kiln_dataset_next(ds, 1, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: out is NULL"));
  // the input of one stage at most
  kiln_dataset *a = kiln_dataset_batch(ds, 2, false);
  ASSERT_NE(a, nullptr);
  fails(kiln_dataset_repeat(ds, 2), "kiln_dataset_repeat: the dataset is already the input of another stage");
  EXPECT_EQ(drain(a), (std::vector<VD>{{1, 2}, {3}})); // a still works
  kiln_dataset_free(a);
  // an element of rank 8 cannot be batched
  int64_t shape[8] = {2, 1, 1, 1, 1, 1, 1, 1};
  kiln_tensor *r8 = kiln_zeros(KILN_F32, 8, shape);
  ds = kiln_dataset_batch(kiln_dataset_batch(kiln_dataset_from_tensors(1, &r8), 1, false), 1, false);
  EXPECT_EQ(kiln_dataset_next(ds, 1, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("kiln_dataset_next: batch: tensor 0 of the elements has rank 8"));
  kiln_dataset_free(ds);
}

} // namespace
