// threads_test.cc — variables shared between threads (API.md §8): staged and
// eager assign_adds from several threads lose no update, a reader sees a
// whole old or new value, never a freed or torn one, a staged training step
// and one optimizer may be used from two threads at once. scripts/test.sh
// runs this suite (and Staging.Concurrent*) under ThreadSanitizer.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <set>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

using namespace kiln_test;

constexpr int64_t kLen = 1 << 16; // each update takes a while: threads overlap inside it

// v += in[0]; returns -in[0] (the output does not alias the variable)
int add_to_var(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_variable_assign_add((kiln_variable *)user, in[0])) return -1;
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}

// v += in[0]; returns v's new value
int add_and_read(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_variable_assign_add((kiln_variable *)user, in[0])) return -1;
  out[0] = kiln_variable_read((kiln_variable *)user);
  return out[0] ? 0 : -1;
}

// returns v (a staged reader)
int read_var(void *user, int, kiln_tensor *const *, int, kiln_tensor **out) {
  out[0] = kiln_variable_read((kiln_variable *)user);
  return out[0] ? 0 : -1;
}

// Each element of t equals every other; false for NULL.
bool uniform(kiln_tensor *t, double *first) {
  if (!t) return false;
  VD v = values(t);
  if (v.empty()) return false;
  *first = v[0];
  for (double x : v)
    if (x != v[0]) return false;
  return true;
}

VD var_values(kiln_variable *v) {
  kiln_scope_push();
  VD out = values(kiln_variable_read(v));
  kiln_scope_pop();
  return out;
}

// runs body(t) on n threads, started together, and joins them
template <typename F>
void on_threads(int n, F body) {
  std::atomic<int> waiting{n};
  std::vector<std::thread> ts;
  for (int t = 0; t < n; t++)
    ts.emplace_back([&, t] {
      waiting--;
      while (waiting.load() > 0) std::this_thread::yield();
      body(t);
    });
  for (auto &th : ts) th.join();
}

class ThreadsStaged : public ::testing::TestWithParam<int> {};

TEST_P(ThreadsStaged, AssignAddLosesNoUpdate) {
  const int n_threads = GetParam(), calls = 100;
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(kiln_zeros(KILN_F32, 1, &kLen), "acc");
  kiln_function *f = kiln_function_new("add_to_var", add_to_var, v, 1, 1);
  std::vector<int> bad(n_threads, 0);
  on_threads(n_threads, [&](int t) {
    kiln_scope_push();
    kiln_tensor *x = kiln_ones(KILN_F32, 1, &kLen);
    for (int i = 0; i < calls; i++) {
      kiln_scope_push();
      kiln_tensor *out = nullptr;
      double first = 0;
      if (kiln_function_call(f, &x, &out) || !uniform(out, &first) || first != -1) bad[t]++;
      kiln_scope_pop();
    }
    kiln_scope_pop();
  });
  EXPECT_EQ(bad, std::vector<int>(n_threads, 0)) << kiln_last_error();
  EXPECT_EQ(var_values(v), VD(kLen, (double)(n_threads * calls)));
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

// Every call's result is the variable after exactly its own update: the
// results of all calls are 1, 2, ..., threads * calls, each once, each whole.
TEST_P(ThreadsStaged, EachCallSeesItsOwnUpdate) {
  const int n_threads = GetParam(), calls = 60;
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(kiln_zeros(KILN_F64, 1, &kLen), "acc");
  kiln_function *f = kiln_function_new("add_and_read", add_and_read, v, 1, 1);
  std::vector<std::vector<double>> seen(n_threads);
  std::vector<int> bad(n_threads, 0);
  on_threads(n_threads, [&](int t) {
    kiln_scope_push();
    kiln_tensor *x = kiln_ones(KILN_F64, 1, &kLen);
    for (int i = 0; i < calls; i++) {
      kiln_scope_push();
      kiln_tensor *out = nullptr;
      double first = 0;
      if (kiln_function_call(f, &x, &out) || !uniform(out, &first))
        bad[t]++;
      else
        seen[t].push_back(first);
      kiln_scope_pop();
    }
    kiln_scope_pop();
  });
  EXPECT_EQ(bad, std::vector<int>(n_threads, 0)) << kiln_last_error();
  std::vector<double> all;
  for (auto &s_t : seen) {
    EXPECT_TRUE(std::is_sorted(s_t.begin(), s_t.end())) << "one thread's calls are ordered";
    all.insert(all.end(), s_t.begin(), s_t.end());
  }
  std::sort(all.begin(), all.end());
  std::vector<double> want(n_threads * calls);
  for (size_t i = 0; i < want.size(); i++) want[i] = (double)(i + 1);
  EXPECT_EQ(all, want);
  EXPECT_EQ(var_values(v), VD(kLen, (double)(n_threads * calls)));
  kiln_function_free(f);
}

INSTANTIATE_TEST_SUITE_P(Threads, ThreadsStaged, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int> &i) { return std::to_string(i.param) + "threads"; });

TEST(Threads, EagerAssignAddLosesNoUpdate) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(kiln_zeros(KILN_F32, 1, &kLen), "acc");
  const int n_threads = 4, calls = 200;
  std::vector<int> bad(n_threads, 0);
  on_threads(n_threads, [&](int t) {
    kiln_scope_push();
    kiln_tensor *one = kiln_ones(KILN_F32, 1, &kLen), *two = kiln_mul(one, kiln_scalar(KILN_F32, 2));
    for (int i = 0; i < calls; i++) {
      // +2 then -1: every assignment kind, net +1 per iteration
      if (kiln_variable_assign_add(v, two) || kiln_variable_assign_sub(v, one)) bad[t]++;
    }
    kiln_scope_pop();
  });
  EXPECT_EQ(bad, std::vector<int>(n_threads, 0)) << kiln_last_error();
  EXPECT_EQ(var_values(v), VD(kLen, (double)(n_threads * calls)));
}

// Writers add 1 (staged and eager) and assign whole uniform values; readers
// (eager reads and a staged reader) see uniform values that never decrease.
TEST(Threads, ReadersSeeWholeValuesWhileWritersWrite) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(kiln_zeros(KILN_F32, 1, &kLen), "acc");
  kiln_function *add = kiln_function_new("add_to_var", add_to_var, v, 1, 1);
  kiln_function *reader = kiln_function_new("read_var", read_var, v, 0, 1);
  const int calls = 200;
  std::atomic<int> writers_left{2};
  std::vector<int> bad(4, 0), reads(4, 0);
  on_threads(4, [&](int t) {
    kiln_scope_push();
    kiln_tensor *one = kiln_ones(KILN_F32, 1, &kLen);
    if (t < 2) { // writers
      for (int i = 0; i < calls; i++) {
        kiln_scope_push();
        kiln_tensor *out = nullptr;
        int rc = t == 0 ? kiln_function_call(add, &one, &out) : kiln_variable_assign_add(v, one);
        if (rc) bad[t]++;
        kiln_scope_pop();
      }
      writers_left--;
    } else { // readers
      double last = 0;
      while (writers_left.load() > 0 || reads[t] < 10) {
        kiln_scope_push();
        kiln_tensor *got = nullptr;
        if (t == 2)
          got = kiln_variable_read(v);
        else if (kiln_function_call(reader, nullptr, &got))
          got = nullptr;
        double first = 0;
        if (!uniform(got, &first) || first < last) bad[t]++;
        last = first;
        reads[t]++;
        kiln_scope_pop();
      }
    }
    kiln_scope_pop();
  });
  EXPECT_EQ(bad, std::vector<int>(4, 0)) << kiln_last_error();
  EXPECT_GE(reads[2], 10);
  EXPECT_GE(reads[3], 10);
  EXPECT_EQ(var_values(v), VD(kLen, 2.0 * calls));
  kiln_function_free(add);
  kiln_function_free(reader);
}

// A value read before a staged update is never written over in place, even
// while other threads update the variable.
TEST(Threads, AHeldReadKeepsItsValue) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(kiln_zeros(KILN_F32, 1, &kLen), "acc");
  kiln_function *f = kiln_function_new("add_to_var", add_to_var, v, 1, 1);
  std::vector<int> bad(3, 0);
  on_threads(3, [&](int t) {
    kiln_scope_push();
    kiln_tensor *one = kiln_ones(KILN_F32, 1, &kLen);
    for (int i = 0; i < 100; i++) {
      kiln_scope_push();
      kiln_tensor *held = kiln_variable_read(v), *out = nullptr;
      double before = 0, after = 1;
      if (!uniform(held, &before) || kiln_function_call(f, &one, &out) || !uniform(held, &after) || after != before)
        bad[t]++;
      kiln_scope_pop();
    }
    kiln_scope_pop();
  });
  EXPECT_EQ(bad, std::vector<int>(3, 0)) << kiln_last_error();
  EXPECT_EQ(var_values(v), VD(kLen, 300.0));
  kiln_function_free(f);
}

struct Pair {
  kiln_variable *read, *write;
};

// write += read * 0 + 1: reads one variable, writes another
int cross(void *user, int, kiln_tensor *const *, int, kiln_tensor **out) {
  Pair *p = (Pair *)user;
  kiln_tensor *r = kiln_variable_read(p->read);
  kiln_tensor *d = r ? kiln_add(kiln_mul(r, kiln_scalar(KILN_F32, 0)), kiln_scalar(KILN_F32, 1)) : nullptr;
  if (!d || kiln_variable_assign_add(p->write, d)) return -1;
  out[0] = kiln_variable_read(p->write);
  return out[0] ? 0 : -1;
}

// One call reads u and writes v while another reads v and writes u: neither
// waits for the other for ever (variables are locked in one order).
TEST(Threads, CallsReadingWhatTheOtherWritesDoNotDeadlock) {
  Scoped s;
  Owned own;
  kiln_variable *u = own.var(kiln_zeros(KILN_F32, 1, &kLen), "u"), *v = own.var(kiln_zeros(KILN_F32, 1, &kLen), "v");
  Pair uv = {u, v}, vu = {v, u};
  kiln_function *f[2] = {kiln_function_new("u_to_v", cross, &uv, 0, 1), kiln_function_new("v_to_u", cross, &vu, 0, 1)};
  const int calls = 60;
  std::vector<int> bad(2, 0);
  on_threads(2, [&](int t) {
    for (int i = 0; i < calls; i++) {
      kiln_scope_push();
      kiln_tensor *out = nullptr;
      if (kiln_function_call(f[t], nullptr, &out)) bad[t]++;
      kiln_scope_pop();
    }
  });
  EXPECT_EQ(bad, std::vector<int>(2, 0)) << kiln_last_error();
  EXPECT_EQ(var_values(u), VD(kLen, calls));
  EXPECT_EQ(var_values(v), VD(kLen, calls));
  kiln_function_free(f[0]);
  kiln_function_free(f[1]);
}

// ---- training from two threads ----

struct Linear {
  kiln_variable *w, *b;
  kiln_optimizer *opt;
};

// loss = mean((x w + b - y)^2); one Adam step
int train_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Linear *m = (Linear *)user;
  kiln_variable *vars[2] = {m->w, m->b};
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *pred = kiln_add(kiln_matmul(in[0], kiln_variable_read(m->w)), kiln_variable_read(m->b));
  kiln_tensor *loss = kiln_reduce_mean(kiln_square(kiln_sub(pred, in[1])), 0, nullptr, false);
  kiln_tape_end(tape);
  kiln_tensor *g[2] = {};
  int rc = loss ? kiln_tape_gradient_vars(tape, loss, 2, vars, g) : -1;
  if (!rc) rc = kiln_optimizer_apply(m->opt, 2, vars, g);
  kiln_tape_free(tape);
  out[0] = loss;
  return rc;
}

TEST(Threads, StagedTrainingStepFromTwoThreads) {
  Scoped s;
  Owned own;
  Linear m = {own.var(kiln_zeros(KILN_F32, KILN_SHAPE(4, 1)), "w"), own.var(kiln_zeros(KILN_F32, KILN_SHAPE(1)), "b"),
              own.opt(kiln_adam_new(0.05, 0.9, 0.999, 1e-8))};
  // y = x . (1, -2, 3, 0.5) + 1
  kiln_random_seed(3);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(32, 4));
  kiln_tensor *y = kiln_add(kiln_matmul(x, f32({4, 1}, {1, -2, 3, 0.5f})), kiln_scalar(KILN_F32, 1));
  kiln_tensor *in[2] = {x, y}, *loss0 = nullptr;
  kiln_function *f = kiln_function_new("train_step", train_step, &m, 2, 1);
  // the first step staged too: Adam makes its slots (variables) while the
  // first trace records, and the function traces once more (state creation)
  ASSERT_EQ(kiln_function_call(f, in, &loss0), 0) << kiln_last_error();
  const int steps = 150;
  std::vector<int> bad(2, 0);
  std::vector<double> last(2, 0);
  on_threads(2, [&](int t) {
    for (int i = 0; i < steps; i++) {
      kiln_scope_push();
      kiln_tensor *loss = nullptr;
      if (kiln_function_call(f, in, &loss) || !std::isfinite(kiln_tensor_item(loss)))
        bad[t]++;
      else
        last[t] = kiln_tensor_item(loss);
      kiln_scope_pop();
    }
  });
  EXPECT_EQ(bad, std::vector<int>(2, 0)) << kiln_last_error();
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  double first = kiln_tensor_item(loss0);
  EXPECT_GT(first, 1.0);
  for (double l : last) EXPECT_LT(l, first / 20) << "training from two threads reduces the loss";
  kiln_function_free(f);
}

// One optimizer, threads creating, updating and freeing their own variables:
// slots are made and dropped concurrently, each update stays its own.
TEST(Threads, OneOptimizerManyThreadsVariables) {
  Scoped s;
  Owned own;
  kiln_optimizer *sgd_m = own.opt(kiln_sgd_momentum_new(0.5, 0.5, false));
  std::vector<int> bad(3, 0);
  on_threads(3, [&](int t) {
    kiln_scope_push();
    for (int i = 0; i < 40; i++) {
      kiln_scope_push();
      kiln_variable *v = kiln_variable_new(kiln_zeros(KILN_F64, KILN_SHAPE(8)), "v");
      kiln_tensor *g = kiln_ones(KILN_F64, KILN_SHAPE(8));
      // momentum 0.5, lr 0.5: m = 1, 1.5; v = -0.5, -1.25
      if (!v || kiln_optimizer_apply(sgd_m, 1, &v, &g) || kiln_optimizer_apply(sgd_m, 1, &v, &g) ||
          var_values(v) != VD(8, -1.25))
        bad[t]++;
      kiln_variable_free(v);
      kiln_scope_pop();
    }
    kiln_scope_pop();
  });
  EXPECT_EQ(bad, std::vector<int>(3, 0)) << kiln_last_error();
}

}  // namespace
