// jit_test.cc — kiln_jit / KILN_JIT (natural C signatures through libffi):
// jitted calls equal eager ones, trace once per tensor signature and static
// values, write o outputs back, report bad signatures and failures, no leaks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cstring>
#include <thread>
#include <vector>

#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;
using testing::StartsWith;

namespace {

// Frees a jitted pointer at the end of a test (declare it after Scoped).
struct Jitted {
  kiln_fnptr p;
  explicit Jitted(kiln_fnptr q) : p(q) { EXPECT_NE(q, nullptr) << kiln_last_error(); }
  ~Jitted() { kiln_jit_free(p); }
};

int g_runs; // C side effects: they happen at trace time only

kiln_tensor *mul_add(kiln_tensor *x, kiln_tensor *y) {
  g_runs++;
  return kiln_add(kiln_mul(x, y), x);
}

kiln_tensor *branch(kiln_tensor *x, int mode) {
  g_runs++;
  if (mode == 0) return kiln_add(x, x);
  return kiln_mul(x, x);
}

kiln_tensor *scale(kiln_tensor *x, double s) {
  g_runs++;
  return kiln_mul(x, kiln_scalar_like(x, s));
}

// An LSTM-like cell: returns h, writes c.
kiln_tensor *cell(kiln_tensor *x, kiln_tensor *h, kiln_tensor *c, kiln_tensor **c_out) {
  g_runs++;
  kiln_tensor *gate = kiln_sigmoid(kiln_add(x, h));
  kiln_tensor *cn = kiln_add(kiln_mul(gate, c), kiln_tanh(x));
  *c_out = cn;
  return kiln_mul(kiln_tanh(cn), gate);
}

int exp_into(kiln_tensor *x, int fail, kiln_tensor **out) {
  g_runs++;
  if (fail) return kiln_fail("exp_into: asked to fail with %d", fail);
  *out = kiln_exp(x);
  return *out ? 0 : -1;
}

void neg_into(kiln_tensor *x, kiln_tensor **out) { *out = kiln_neg(x); }

kiln_tensor *mixed(kiln_tensor *x, int64_t n, bool neg, void *tag) {
  g_runs++;
  kiln_tensor *y = kiln_mul(x, kiln_scalar_like(x, (double)n));
  if (tag) y = kiln_add(y, kiln_scalar_like(x, *(double *)tag));
  return neg ? kiln_neg(y) : y;
}

} // namespace

TEST(Jit, TwoInputsMatchEagerAndTraceOnce) {
  Scoped s;
  auto jf = KILN_JIT(mul_add, "t:tt");
  ASSERT_NE(jf, nullptr) << kiln_last_error();
  Jitted owner((kiln_fnptr)jf);

  kiln_function *f = kiln_jit_function((kiln_fnptr)jf);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  EXPECT_EQ(kiln_function_trace_count(f), 0);

  g_runs = 0;
  kiln_tensor *r1 = jf(f64({2}, {1, 2}), f64({2}, {3, 4}));
  ASSERT_NE(r1, nullptr) << kiln_last_error();
  EXPECT_EQ(values(r1), (VD{4, 10})); // 1*3+1, 2*4+2
  kiln_tensor *r2 = jf(f64({2}, {-1, 0.5}), f64({2}, {2, 6}));
  ASSERT_NE(r2, nullptr) << kiln_last_error();
  EXPECT_EQ(values(r2), (VD{-3, 3.5}));
  EXPECT_EQ(g_runs, 1) << "the body runs at trace time only";
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  EXPECT_EQ(kiln_jit_function((kiln_fnptr)jf), f);

  kiln_tensor *x = f64({2, 2}, {1, 2, 3, 4}), *y = f64({2}, {10, -1});
  kiln_tensor *r3 = jf(x, y);
  int saved = g_runs;
  kiln_tensor *e3 = mul_add(x, y);
  EXPECT_TRUE(same_bits(r3, e3));
  EXPECT_EQ(values(r3), (VD{11, 0, 33, 0}));
  EXPECT_EQ(saved, 2);
  EXPECT_EQ(kiln_function_trace_count(f), 2);
}

TEST(Jit, StaticIntSpecialises) {
  Scoped s;
  auto jb = KILN_JIT(branch, "t:ti");
  Jitted owner((kiln_fnptr)jb);
  ASSERT_NE(jb, nullptr);
  kiln_function *f = kiln_jit_function((kiln_fnptr)jb);
  ASSERT_NE(f, nullptr) << "one function, there from the start";

  g_runs = 0;
  kiln_tensor *x = f32({3}, {1, 2, -3});
  EXPECT_EQ(values(jb(x, 0)), (VD{2, 4, -6}));
  kiln_function *f0 = kiln_jit_function((kiln_fnptr)jb);
  EXPECT_EQ(values(jb(x, 1)), (VD{1, 4, 9}));
  kiln_function *f1 = kiln_jit_function((kiln_fnptr)jb);
  EXPECT_EQ(values(jb(f32({3}, {5, 6, 7}), 0)), (VD{10, 12, 14}));
  EXPECT_EQ(values(jb(f32({3}, {5, 6, 7}), 1)), (VD{25, 36, 49}));
  EXPECT_EQ(g_runs, 2) << "one trace per static value";
  EXPECT_EQ(f0, f);
  EXPECT_EQ(f1, f) << "static values key the one function's trace cache";
  EXPECT_EQ(kiln_function_trace_count(f), 2) << "the traces of every static value";
  // the C branch is baked into each trace
  char *ir0 = kiln_function_ir(f, 0, "traced"), *ir1 = kiln_function_ir(f, 1, "traced");
  ASSERT_NE(ir0, nullptr);
  ASSERT_NE(ir1, nullptr);
  EXPECT_THAT(ir0, HasSubstr("add"));
  EXPECT_THAT(ir1, HasSubstr("mul"));
  free(ir0);
  free(ir1);
}

TEST(Jit, OutParameterMatchesEager) {
  Scoped s;
  auto jc = KILN_JIT(cell, "t:ttto");
  Jitted owner((kiln_fnptr)jc);
  ASSERT_NE(jc, nullptr);
  g_runs = 0;
  for (int step = 0; step < 3; step++) {
    kiln_tensor *x = f32({2, 3}, {0.5f * step, -1, 2, 0.25f, 3, -0.5f});
    kiln_tensor *h = f32({2, 3}, {0.1f, 0.2f, 0.3f, -0.4f, 0.5f, step * 1.0f});
    kiln_tensor *c = f32({2, 3}, {1, -1, 0, 2, 0.5f, -2});
    kiln_tensor *c_jit = nullptr, *c_eager = nullptr;
    kiln_tensor *h_jit = jc(x, h, c, &c_jit);
    ASSERT_NE(h_jit, nullptr) << kiln_last_error();
    ASSERT_NE(c_jit, nullptr);
    int runs = g_runs;
    kiln_tensor *h_eager = cell(x, h, c, &c_eager);
    g_runs = runs;
    EXPECT_TRUE(same_bits(h_jit, h_eager)) << step;
    EXPECT_TRUE(same_bits(c_jit, c_eager)) << step;
  }
  EXPECT_EQ(g_runs, 1);
  EXPECT_EQ(kiln_function_trace_count(kiln_jit_function((kiln_fnptr)jc)), 1);
  // hand-computed: x = 0, h = 0, c = 1: gate 0.5, c' = 0.5, h' = tanh(0.5) * 0.5
  kiln_tensor *c_out = nullptr;
  kiln_tensor *hh = jc(f64({1}, {0}), f64({1}, {0}), f64({1}, {1}), &c_out);
  EXPECT_EQ(values(c_out), (VD{0.5}));
  EXPECT_NEAR(values(hh)[0], 0.23105857863000487, 1e-15);
  // a NULL o pointer discards that output
  EXPECT_NE(jc(f64({1}, {0}), f64({1}, {0}), f64({1}, {1}), nullptr), nullptr);
}

TEST(Jit, DoubleStatic) {
  Scoped s;
  auto js = KILN_JIT(scale, "t:td");
  Jitted owner((kiln_fnptr)js);
  ASSERT_NE(js, nullptr);
  g_runs = 0;
  kiln_tensor *x = f64({2}, {3, -4});
  EXPECT_EQ(values(js(x, 2.0)), (VD{6, -8}));
  kiln_function *f2 = kiln_jit_function((kiln_fnptr)js);
  EXPECT_EQ(values(js(x, 0.5)), (VD{1.5, -2}));
  EXPECT_EQ(values(js(f64({2}, {1, 1}), 2.0)), (VD{2, 2}));
  EXPECT_EQ(g_runs, 2);
  EXPECT_EQ(kiln_jit_function((kiln_fnptr)js), f2);
  EXPECT_EQ(kiln_function_trace_count(f2), 2);
}

TEST(Jit, OtherStaticKinds) {
  Scoped s;
  auto jm = KILN_JIT(mixed, "t:tlbp");
  Jitted owner((kiln_fnptr)jm);
  ASSERT_NE(jm, nullptr);
  double a = 1, b = 1; // equal values, distinct pointers: distinct keys
  g_runs = 0;
  kiln_tensor *x = f64({2}, {1, 2});
  EXPECT_EQ(values(jm(x, 3, false, nullptr)), (VD{3, 6}));
  EXPECT_EQ(values(jm(x, 3, true, nullptr)), (VD{-3, -6}));
  EXPECT_EQ(values(jm(x, int64_t(1) << 40, false, nullptr)), (VD{1099511627776.0, 2199023255552.0}));
  EXPECT_EQ(values(jm(x, 3, false, &a)), (VD{4, 7}));
  EXPECT_EQ(values(jm(x, 3, false, &b)), (VD{4, 7}));
  EXPECT_EQ(g_runs, 5);
  EXPECT_EQ(values(jm(x, 3, true, nullptr)), (VD{-3, -6}));
  EXPECT_EQ(g_runs, 5);
}

TEST(Jit, IntAndVoidReturns) {
  Scoped s;
  auto je = KILN_JIT(exp_into, "i:tio");
  Jitted owner((kiln_fnptr)je);
  ASSERT_NE(je, nullptr);
  kiln_tensor *out = nullptr;
  EXPECT_EQ(je(f64({2}, {0, 0}), 0, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{1, 1}));
  kiln_clear_error();
  EXPECT_EQ(je(f64({2}, {0, 0}), 7, &out), -1);
  EXPECT_EQ(out, nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("@")) << "names the staged function";
  EXPECT_THAT(kiln_last_error(), testing::EndsWith(": exp_into: asked to fail with 7"));
  kiln_function *f7 = kiln_jit_function((kiln_fnptr)je);
  EXPECT_EQ(kiln_function_trace_count(f7), 1) << "static 0's trace; the failed trace of 7 is not kept";

  auto jn = KILN_JIT(neg_into, "v:to");
  Jitted owner2((kiln_fnptr)jn);
  ASSERT_NE(jn, nullptr);
  kiln_clear_error();
  jn(f32({2}, {1, -2}), &out);
  EXPECT_STREQ(kiln_last_error(), "");
  EXPECT_EQ(values(out), (VD{-1, 2}));
  jn(nullptr, &out);
  EXPECT_EQ(out, nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call"));
}

TEST(Jit, CallFailureReturnsNull) {
  Scoped s;
  auto jf = KILN_JIT(mul_add, "t:tt");
  Jitted owner((kiln_fnptr)jf);
  kiln_clear_error();
  EXPECT_EQ(jf(f32({2}, {1, 2}), f32({3}, {1, 2, 3})), nullptr);
  EXPECT_THAT(kiln_last_error(), testing::MatchesRegex("@[a-z_]+: mul.*"));
  EXPECT_EQ(kiln_function_trace_count(kiln_jit_function((kiln_fnptr)jf)), 0);
  kiln_clear_error();
  EXPECT_EQ(jf(f32({2}, {1, 2}), nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("NULL"));
  EXPECT_NE(jf(f32({2}, {1, 2}), f32({2}, {1, 2})), nullptr);
}

TEST(Jit, BadSignatures) {
  Scoped s;
  struct {
    const char *sig, *msg;
  } cases[] = {
      {"tx", "jit: bad signature 'tx': unknown letter 'x' at 1"},
      {"t:tq", "jit: bad signature 't:tq': unknown letter 'q' at 3"},
      {"T:t", "unknown letter 'T' at 0"},
      {"o:t", "'o' at 0 cannot be a return type"},
      {"d:t", "return type 'd' at 0 is not supported"},
      {"t", "missing ':'"},
      {"", "missing ':'"},
      {"tt", "missing ':'"},
      {":t", "missing return type"},
      {"t:t:t", "a second ':' at 3"},
      {"t:tv", "'v' at 3 is only a return type"},
  };
  for (auto &c : cases) {
    kiln_clear_error();
    EXPECT_EQ(kiln_jit((kiln_fnptr)mul_add, c.sig), nullptr) << c.sig;
    EXPECT_THAT(kiln_last_error(), StartsWith("jit: bad signature"));
    EXPECT_THAT(kiln_last_error(), HasSubstr(c.msg));
  }
  EXPECT_EQ(kiln_jit(nullptr, "t:tt"), nullptr);
  EXPECT_STREQ(kiln_last_error(), "jit: fn is NULL");
  EXPECT_EQ(kiln_jit((kiln_fnptr)mul_add, nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "jit: signature is NULL");

  EXPECT_EQ(kiln_jit_function((kiln_fnptr)mul_add), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("jit_function: the pointer is not from kiln_jit"));
  EXPECT_EQ(kiln_jit_function(nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "jit_function: jitted is NULL");
  kiln_clear_error();
  kiln_jit_free(nullptr);
  EXPECT_STREQ(kiln_last_error(), "");
  kiln_jit_free((kiln_fnptr)mul_add);
  EXPECT_THAT(kiln_last_error(), StartsWith("jit_free: the pointer is not from kiln_jit"));
}

TEST(Jit, NoArgsAndFreeForgetsPointer) {
  Scoped s;
  kiln_fnptr p = kiln_jit((kiln_fnptr)mul_add, "t:tt");
  ASSERT_NE(p, nullptr);
  ASSERT_NE(kiln_jit_function(p), nullptr);
  kiln_jit_free(p);
  EXPECT_EQ(kiln_jit_function(p), nullptr);
}

// Threads calling one jitted pointer with several static values: each key
// gets one trace of the one function, and every result is right.
TEST(Jit, Threads) {
  Scoped s;
  auto jb = KILN_JIT(branch, "t:ti");
  Jitted owner((kiln_fnptr)jb);
  ASSERT_NE(jb, nullptr);
  std::vector<int> bad(8, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; t++)
    threads.emplace_back([&, t] {
      kiln_scope_push();
      for (int k = 0; k < 50; k++) {
        kiln_tensor *r = jb(f32({2}, {3, (float)k}), (t + k) % 2);
        VD want = (t + k) % 2 ? VD{9, (double)k * k} : VD{6, 2.0 * k};
        if (!r || values(r) != want) bad[t]++;
      }
      kiln_scope_pop();
    });
  for (auto &th : threads) th.join();
  for (int t = 0; t < 8; t++) EXPECT_EQ(bad[t], 0) << t;
  jb(f32({2}, {0, 0}), 0);
  EXPECT_EQ(kiln_function_trace_count(kiln_jit_function((kiln_fnptr)jb)), 2) << "one trace per key";
  jb(f32({2}, {0, 0}), 1);
  EXPECT_EQ(kiln_function_trace_count(kiln_jit_function((kiln_fnptr)jb)), 2);
}

// A jitted call inside another staged function's body is traced into it.
namespace {
kiln_tensor *(*g_inner)(kiln_tensor *, kiln_tensor *);
int outer_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_neg(g_inner(in[0], in[1]));
  return out[0] ? 0 : -1;
}
} // namespace

TEST(Jit, InsideAnotherFunction) {
  Scoped s;
  auto jf = KILN_JIT(mul_add, "t:tt");
  Jitted owner((kiln_fnptr)jf);
  g_inner = jf;
  kiln_function *outer = kiln_function_new("outer", outer_body, nullptr, 2, 1);
  ASSERT_NE(outer, nullptr);
  kiln_tensor *in[2] = {f64({2}, {1, 2}), f64({2}, {3, 4})}, *out[1] = {nullptr};
  ASSERT_EQ(kiln_function_call(outer, in, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{-4, -10}));
  EXPECT_EQ(kiln_function_trace_count(outer), 1);
  kiln_function_free(outer);
}
