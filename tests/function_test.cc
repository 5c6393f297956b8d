// function_test.cc — staged functions (kiln_function_*): staged results equal
// the eager ones bit for bit, the trace cache, captures, variables by
// reference, random draws per call, errors, IR text, threads and leaks.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <kiln.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "ir.h"
#include "test_util.h"

using namespace kiln_test;
using testing::HasSubstr;
using testing::StartsWith;

namespace {

// ---- bodies ----
int chain(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *y = kiln_tanh(kiln_add(kiln_mul(in[0], in[0]), kiln_exp(kiln_neg(in[0]))));
  out[0] = kiln_sub(kiln_sigmoid(y), kiln_sqrt(kiln_abs(in[0])));
  return out[0] ? 0 : -1;
}
int bcast(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_div(kiln_add(in[0], in[1]), kiln_maximum(in[1], kiln_scalar_like(in[1], 0.5)));
  return out[0] ? 0 : -1;
}
int reduce(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int ax = 1;
  out[0] = kiln_reduce_sum(in[0], 1, &ax, false);
  out[1] = kiln_reduce_max(in[0], 0, nullptr, false);
  out[2] = kiln_argmax(in[0], 0);
  return out[0] && out[1] && out[2] ? 0 : -1;
}
int matmul(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_relu(kiln_matmul(in[0], kiln_transpose(in[1], 2, nullptr)));
  return out[0] ? 0 : -1;
}
int composites(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_softmax(in[0], -1);
  out[1] = kiln_sparse_softmax_cross_entropy(in[1], in[0]);
  return out[0] && out[1] ? 0 : -1;
}

struct Case {
  const char *name;
  kiln_body_fn body;
  int n_in, n_out;
  std::vector<kiln_tensor *> (*inputs)(int seed);
};

std::vector<kiln_tensor *> one_vec(int s) { return {f32({1.5f + s, -2, 0.25, 3, -0.5f * s})}; }
std::vector<kiln_tensor *> two_bcast(int s) {
  return {f32({2, 3}, {1, 2, 3, 4, 5, (float)s}), f32({1, 3}, {0.25, 2, 3.5f + s})};
}
std::vector<kiln_tensor *> mat(int s) {
  return {f32({2, 3}, {1, -2, 3, 4, 5, (float)-s}), f32({2, 3}, {0.5, 1, -1, 2, 0, (float)s})};
}
std::vector<kiln_tensor *> comp(int s) {
  return {f32({2, 3}, {1, 2, 3, -1, 0.5f * s, 4}), i32({2}, {s % 3, 1})};
}
std::vector<kiln_tensor *> f64mat(int s) { return {f64({2, 2}, {1, 7, (double)s, -3})}; }

const Case kCases[] = {
    {"chain", chain, 1, 1, one_vec},   {"bcast", bcast, 2, 1, two_bcast}, {"reduce", reduce, 1, 3, f64mat},
    {"matmul", matmul, 2, 1, mat},     {"composites", composites, 2, 2, comp},
};

}  // namespace

TEST(Staging, MatchesEagerBitForBit) {
  for (const Case &c : kCases) {
    SCOPED_TRACE(c.name);
    Scoped s;
    kiln_function *f = kiln_function_new(c.name, c.body, nullptr, c.n_in, c.n_out);
    ASSERT_NE(f, nullptr);
    for (int seed = 0; seed < 3; seed++) {
      std::vector<kiln_tensor *> in = c.inputs(seed);
      kiln_tensor *eager[4] = {}, *staged[4] = {};
      ASSERT_EQ(c.body(nullptr, c.n_in, in.data(), c.n_out, eager), 0) << kiln_last_error();
      ASSERT_EQ(kiln_function_call(f, in.data(), staged), 0) << kiln_last_error();
      for (int o = 0; o < c.n_out; o++) EXPECT_TRUE(same_bits(eager[o], staged[o])) << "output " << o;
    }
    EXPECT_EQ(kiln_function_trace_count(f), 1);
    kiln_function_free(f);
  }
}

TEST(Staging, RetracesOnNewShapeOrDtype) {
  Scoped s;
  kiln_function *f = kiln_function_new("chain", chain, nullptr, 1, 1);
  kiln_tensor *out = nullptr;
  kiln_tensor *a = f32({1, 2, 3}), *b = f32({4, 5, 6}), *c = f32({1, 2, 3, 4}), *d = f64({1, 2, 3});
  ASSERT_EQ(kiln_function_call(f, &a, &out), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, &b, &out), 0);
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  testing::internal::CaptureStderr();
  setenv("KILN_LOG", "retrace", 1);
  ASSERT_EQ(kiln_function_call(f, &c, &out), 0);
  ASSERT_EQ(kiln_function_call(f, &d, &out), 0);
  unsetenv("KILN_LOG");
  std::string log = testing::internal::GetCapturedStderr();
  EXPECT_THAT(log, HasSubstr("kiln: retrace @chain: arg 0: f32[3] -> f32[4] ("));
  EXPECT_THAT(log, HasSubstr("kiln: retrace @chain: arg 0: f32[4] -> f64[3] ("));
  EXPECT_EQ(kiln_function_trace_count(f), 3);
  ASSERT_EQ(kiln_function_call(f, &a, &out), 0); // cached
  EXPECT_EQ(kiln_function_trace_count(f), 3);
  EXPECT_THAT(values(out), testing::SizeIs(3));
  kiln_function_free(f);
}

// The TF paper's listing: C control flow on a static flag is baked in.
struct Flags {
  bool use_relu;
  int traced;
};
int flagged(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Flags *fl = (Flags *)user;
  fl->traced++; // a C side effect: happens at trace time only
  out[0] = fl->use_relu ? kiln_relu(in[0]) : kiln_neg(in[0]);
  return 0;
}

TEST(Staging, StaticFlagIsBakedAtTraceTime) {
  Scoped s;
  Flags fl = {true, 0};
  kiln_function *f = kiln_function_new("flagged", flagged, &fl, 1, 1);
  kiln_tensor *x = f32({-1, 2}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{0, 2}));
  fl.use_relu = false;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{0, 2})); // still the relu trace
  EXPECT_EQ(fl.traced, 1);
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("relu"));
  EXPECT_THAT(ir, testing::Not(HasSubstr("neg")));
  free(ir);
  kiln_function_free(f);
}

int add_captured(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *c = (kiln_tensor *)user;
  out[0] = kiln_add(kiln_mul(in[0], c), c); // c once as a parameter, however often used
  out[1] = c;                               // a concrete output: captured
  out[2] = in[0];                           // an input passed through
  return 0;
}

TEST(Staging, CapturesConcreteTensors) {
  Scoped s;
  kiln_tensor *c = kiln_retain(f32({10, 20}));
  kiln_function *f = kiln_function_new("cap", add_captured, c, 1, 3);
  {
    kiln_scope_push();
    kiln_tensor *x = f32({1, 2}), *out[3];
    ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
    EXPECT_EQ(values(out[0]), (VD{20, 60}));
    EXPECT_EQ(values(out[1]), (VD{10, 20}));
    EXPECT_EQ(out[2], x);
    char *ir = kiln_function_ir(f, 0, "traced");
    ASSERT_NE(ir, nullptr);
    // two parameters: the input and the capture
    EXPECT_THAT(ir, HasSubstr("f32[2], %1: f32[2])")) << ir;
    free(ir);
    kiln_scope_pop();
  }
  kiln_release(c); // the trace still holds it
  kiln_scope_push();
  kiln_tensor *x = f32({2, 3}), *out[3];
  ASSERT_EQ(kiln_function_call(f, &x, out), 0);
  EXPECT_EQ(values(out[0]), (VD{30, 80}));
  kiln_scope_pop();
  kiln_function_free(f); // drops the capture: Scoped checks that nothing leaked
}

// Each pass makes its own constants: equal bits, different tensors.
int fresh_constants(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *a = kiln_mul(in[0], kiln_scalar(KILN_F32, 0.5));
  kiln_tensor *b = kiln_mul(in[0], kiln_scalar(KILN_F32, 0.5));
  kiln_tensor *c = kiln_mul(in[0], kiln_scalar(KILN_F32, 0.25));
  kiln_tensor *nz = kiln_mul(in[0], kiln_scalar(KILN_F32, -0.0)); // other bits than 0.0
  kiln_tensor *z = kiln_mul(in[0], kiln_scalar(KILN_F32, 0.0));
  out[0] = kiln_add(kiln_add(a, b), c);
  out[1] = kiln_sub(nz, z);
  return out[0] && out[1] ? 0 : -1;
}

TEST(Staging, CapturesWithEqualBitsAreOneParameter) {
  Scoped s;
  kiln_function *f = kiln_function_new("fresh", fresh_constants, nullptr, 1, 2);
  kiln_tensor *x = f32({2, -4}), *out[2];
  ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{2.5, -5}));
  EXPECT_EQ(values(out[1]), (VD{0, 0}));
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  // x, 0.5 (captured once for both uses), 0.25, -0.0 and 0.0
  EXPECT_THAT(ir, HasSubstr("(%0: f32[2], %1: f32[], %2: f32[], %3: f32[], %4: f32[])")) << ir;
  EXPECT_THAT(ir, testing::Not(HasSubstr("%5: f32[]"))) << ir;
  free(ir);
  char *opt = kiln_function_ir(f, 0, "optimized");
  ASSERT_NE(opt, nullptr);
  // CSE now sees x * 0.5 twice and keeps one
  const std::string text = opt;
  size_t muls = 0;
  for (size_t at = text.find("= mul "); at != std::string::npos; at = text.find("= mul ", at + 1)) muls++;
  EXPECT_EQ(muls, 4u) << opt;
  free(opt);
  kiln_function_free(f);
}

// A concrete value broadcast to a large shape while tracing (a loss's seed
// broadcast to the shape it summed): traced as a broadcast of the small
// capture, where run eagerly it was captured at its full size and read by
// every call; a small broadcast still runs eagerly.
int broadcast_constants(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int64_t big[2] = {64, 64}, small[2] = {2, 3};
  out[0] = kiln_add(in[0], kiln_broadcast_to(kiln_scalar(KILN_F32, 1.5), 2, big));
  out[1] = kiln_broadcast_to(kiln_scalar(KILN_F32, 2.0), 2, small);
  return out[0] && out[1] ? 0 : -1;
}

TEST(Staging, LargeBroadcastsOfConstantsAreTraced) {
  Scoped s;
  kiln_function *f = kiln_function_new("bcast", broadcast_constants, nullptr, 1, 2);
  int64_t big[2] = {64, 64};
  kiln_tensor *x = kiln_ones(KILN_F32, 2, big), *out[2];
  ASSERT_EQ(kiln_function_call(f, &x, out), 0) << kiln_last_error();
  std::vector<float> got(64 * 64);
  ASSERT_EQ(kiln_tensor_read(out[0], got.data(), got.size() * sizeof(float)), 0);
  for (float v : got) ASSERT_EQ(v, 2.5f);
  EXPECT_EQ(values(out[1]), (VD{2, 2, 2, 2, 2, 2}));
  char *ir = kiln_function_ir(f, 0, "traced");
  ASSERT_NE(ir, nullptr);
  // x and 1.5; the small broadcast's result captured (an output)
  EXPECT_THAT(ir, HasSubstr("(%0: f32[64,64], %1: f32[], %2: f32[2,3])")) << ir;
  EXPECT_THAT(ir, HasSubstr("broadcast %1")) << ir;
  free(ir);
  kiln_function_free(f);
}

int read_var(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_mul(kiln_variable_read((kiln_variable *)user), in[0]);
  return out[0] ? 0 : -1;
}

TEST(Staging, VariablesAreReadByReference) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(f32({1, 2}), "w");
  kiln_function *f = kiln_function_new("scale", read_var, v, 1, 1);
  kiln_tensor *x = f32({3, 4}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{3, 8}));
  ASSERT_EQ(kiln_variable_assign(v, f32({-1, 10})), 0);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{-3, 40}));
  ASSERT_EQ(kiln_variable_assign_add(v, f32({1, 1})), 0);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{0, 44}));
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

int make_var(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_variable *v = kiln_variable_new(in[0], "inside");
  if (!v) return -1;
  out[0] = in[0];
  return 0;
}
int make_var_concrete(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_variable *v = kiln_variable_new(kiln_scalar(KILN_F32, 1), "inside");
  if (!v) return -1;
  out[0] = in[0];
  return 0;
}
int assign_var(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_variable_assign((kiln_variable *)user, in[0])) return -1;
  out[0] = in[0];
  return 0;
}
int assign_add_var(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (kiln_variable_assign_add((kiln_variable *)user, in[0])) return -1;
  out[0] = in[0];
  return 0;
}

// State creation (API.md §5): a variable made from a traced value fails; one
// made on every trace fails on the second (the first may create variables,
// then the function is traced once more). trace_cache_test covers success.
TEST(Staging, CreatingVariablesInsideFails) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(f32({1, 2}), "w");
  kiln_tensor *x = f32({3, 4}), *out = nullptr;
  for (kiln_body_fn b : {make_var, make_var_concrete}) {
    kiln_function *f = kiln_function_new("mk", b, nullptr, 1, 1);
    EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
    if (b == make_var) {
      EXPECT_THAT(kiln_last_error(), StartsWith("@mk: variable_new: the initial value is a traced (symbolic) value"));
    } else {
      EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @mk: the body created variable 'inside' on a later trace"));
    }
    EXPECT_EQ(kiln_function_trace_count(f), 0);
    kiln_function_free(f); // frees the variables its traces created
  }
  for (kiln_body_fn b : {assign_var, assign_add_var}) { // a wrong shape fails at trace time
    kiln_tensor *x3 = f32({3, 4, 5});
    kiln_function *f = kiln_function_new("as", b, v, 1, 1);
    EXPECT_EQ(kiln_function_call(f, &x3, &out), -1);
    EXPECT_THAT(kiln_last_error(), StartsWith("@as: variable_assign"));
    EXPECT_THAT(kiln_last_error(), HasSubstr("variable 'w'"));
    kiln_function_free(f);
  }
  EXPECT_EQ(values(kiln_variable_read(v)), (VD{1, 2}));
  EXPECT_EQ(out, nullptr);
}

int noise(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int64_t shape[1] = {kiln_tensor_shape(in[0])[0]};
  out[0] = kiln_add(in[0], kiln_random_normal(KILN_F32, 1, shape));
  out[1] = kiln_random_uniform(KILN_F32, 1, shape, 0, 1); // no symbolic input: still staged
  return out[0] && out[1] ? 0 : -1;
}

TEST(Staging, RandomOpsDrawPerCallAndReproduce) {
  Scoped s;
  kiln_function *f = kiln_function_new("noise", noise, nullptr, 1, 2);
  const int64_t five[1] = {5};
  kiln_tensor *x = kiln_zeros(KILN_F32, 1, five), *a[2], *b[2], *c[2], *e[2];
  ASSERT_EQ(kiln_function_call(f, &x, a), 0) << kiln_last_error();
  ASSERT_EQ(kiln_function_call(f, &x, b), 0);
  EXPECT_FALSE(same_bits(a[0], b[0]));
  EXPECT_FALSE(same_bits(a[1], b[1]));
  kiln_random_seed(42);
  ASSERT_EQ(kiln_function_call(f, &x, b), 0);
  kiln_random_seed(42);
  ASSERT_EQ(kiln_function_call(f, &x, c), 0);
  kiln_random_seed(42);
  ASSERT_EQ(noise(nullptr, 1, &x, 2, e), 0); // the eager body draws the same numbers
  for (int i = 0; i < 2; i++) {
    EXPECT_TRUE(same_bits(b[i], c[i]));
    EXPECT_TRUE(same_bits(b[i], e[i]));
  }
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

struct FailOnce {
  bool fail;
};
int maybe_fail(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  if (((FailOnce *)user)->fail) return kiln_fail("my body: %d is not allowed", 7);
  out[0] = kiln_neg(in[0]);
  return 0;
}

TEST(Staging, BodyFailureKeepsNoTrace) {
  Scoped s;
  FailOnce fo = {true};
  kiln_function *f = kiln_function_new("mf", maybe_fail, &fo, 1, 1);
  kiln_tensor *x = f32({1, 2}), *out = nullptr;
  EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
  EXPECT_STREQ(kiln_last_error(), "@mf: my body: 7 is not allowed") << "the body's error, naming the function";
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(kiln_function_trace_count(f), 0);
  fo.fail = false;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{-1, -2}));
  kiln_function_free(f);
}

int read_value(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const void *p = kiln_tensor_data(in[0]);
  if (!p) return -1;
  out[0] = in[0];
  return 0;
}
int item_value(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  double v = kiln_tensor_item(kiln_reduce_sum(in[0], 0, nullptr, false));
  if (v != v) return -1;
  out[0] = in[0];
  return 0;
}
int leave_null(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = in[0];
  return 0;
}

TEST(Staging, ReadingASymbolicValueFails) {
  Scoped s;
  kiln_tensor *x = f32({1, 2}), *out = nullptr;
  for (kiln_body_fn b : {read_value, item_value}) {
    kiln_function *f = kiln_function_new("rv", b, nullptr, 1, 1);
    EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("the tensor is symbolic (being traced) and has no value yet"));
    EXPECT_EQ(kiln_function_trace_count(f), 0);
    kiln_function_set_eager(f, true); // op by op it works
    EXPECT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
    EXPECT_EQ(out, x);
    kiln_function_free(f);
  }
}

TEST(Staging, BadArguments) {
  Scoped s;
  kiln_tensor *x = f32({1, 2}), *out[2] = {};
  EXPECT_EQ(kiln_function_call(nullptr, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: function is NULL"));
  EXPECT_EQ(kiln_function_new("f", nullptr, nullptr, 1, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_new: body is NULL"));
  EXPECT_EQ(kiln_function_new("f", chain, nullptr, -1, 1), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_new: "));
  kiln_function *f = kiln_function_new("chain", chain, nullptr, 1, 1);
  EXPECT_EQ(kiln_function_call(f, nullptr, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @chain: in is NULL"));
  EXPECT_EQ(kiln_function_call(f, &x, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @chain: out is NULL"));
  kiln_tensor *null_in = nullptr;
  kiln_clear_error(); // a NULL input with an error set passes that error on, as ops do
  EXPECT_EQ(kiln_function_call(f, &null_in, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @chain: input 0 is NULL"));
  // n mismatch: the body asks for a second output that this function lacks
  kiln_function *g = kiln_function_new("two", leave_null, nullptr, 1, 2);
  EXPECT_EQ(kiln_function_call(g, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @two: the body left output 1 NULL"));
  kiln_function_set_eager(g, true);
  EXPECT_EQ(kiln_function_call(g, &x, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_call: @two: the body left output 1 NULL"));
  // an op error inside the body keeps the op's message
  kiln_function *h = kiln_function_new("bc", bcast, nullptr, 2, 1);
  kiln_tensor *in2[2] = {f32({1, 2, 3}), f32({1, 2})};
  EXPECT_EQ(kiln_function_call(h, in2, out), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("@bc: add: "));
  EXPECT_EQ(kiln_function_trace_count(nullptr), -1);
  EXPECT_EQ(kiln_function_ir(nullptr, 0, "traced"), nullptr);
  EXPECT_EQ(kiln_function_ir(f, 0, "traced"), nullptr); // no trace yet
  EXPECT_THAT(kiln_last_error(), StartsWith("function_ir: @chain: trace 0 does not exist"));
  kiln_stats st;
  EXPECT_EQ(kiln_function_stats(f, 0, &st), -1);
  kiln_function_free(f);
  kiln_function_free(g);
  kiln_function_free(h);
  kiln_function_free(nullptr);
}

TEST(Staging, IrTextAndStats) {
  Scoped s;
  kiln_function *f = kiln_function_new("chain", chain, nullptr, 1, 1);
  kiln_tensor *x = f32({1, 2}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  char *traced = kiln_function_ir(f, 0, "traced"), *opt = kiln_function_ir(f, 0, "optimized");
  ASSERT_NE(traced, nullptr);
  ASSERT_NE(opt, nullptr);
  ir_module *mo = ir_parse(opt, "chain.opt.kir"); // the optimized text is valid IR too
  ASSERT_NE(mo, nullptr) << kiln_last_error() << "\n" << opt;
  ir_module_free(mo);
  for (const char *op : {"@chain", "mul", "exp", "neg", "tanh", "sigmoid", "sqrt", "abs", "sub"})
    EXPECT_THAT(traced, HasSubstr(op));
  ir_module *m = ir_parse(traced, "chain.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << traced;
  char *again = ir_print_func(m->funcs[0]);
  EXPECT_STREQ(again, traced);
  free(again);
  ir_module_free(m);
  free(traced);
  free(opt);
  char *llvm = kiln_function_ir(f, 0, "llvm"), *assembly = kiln_function_ir(f, 0, "asm");
  ASSERT_NE(llvm, nullptr) << kiln_last_error();
  ASSERT_NE(assembly, nullptr) << kiln_last_error();
  EXPECT_THAT(llvm, HasSubstr("define "));      // the kernels and the entry
  EXPECT_THAT(llvm, HasSubstr("kiln_entry"));
  EXPECT_THAT(assembly, HasSubstr("kiln_entry"));
  EXPECT_THAT(assembly, HasSubstr("ret"));
  free(llvm);
  free(assembly);
  char *ptx = kiln_function_ir(f, 0, "ptx"); // cross-compiled, GPU or not
  ASSERT_NE(ptx, nullptr) << kiln_last_error();
  EXPECT_THAT(ptx, HasSubstr(".target sm_80"));
  EXPECT_THAT(ptx, HasSubstr(".entry"));
  free(ptx);
  EXPECT_EQ(kiln_function_ir(f, 1, "llvm"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_ir: @chain: trace 1 does not exist"));
  EXPECT_EQ(kiln_function_ir(f, 0, "bogus"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("function_ir: unknown stage 'bogus'"));
  kiln_stats st;
  ASSERT_EQ(kiln_function_stats(f, 0, &st), 0);
  EXPECT_EQ(st.traced_ops, 9);
  EXPECT_LE(st.optimized_ops, 9); // nothing to simplify in chain; fusion may group it
  EXPECT_GE(st.optimized_ops, 1);
  EXPECT_GE(st.kernels, 1);
  EXPECT_GE(st.trace_ms, 0);
  EXPECT_GE(st.optimize_ms, 0);
  EXPECT_GT(st.compile_ms, 0);
  EXPECT_LE(st.peak_bytes, st.unshared_bytes);
  kiln_function_free(f);
}

TEST(Staging, ConcurrentCalls) {
  Scoped s;
  kiln_function *f = kiln_function_new("chain", chain, nullptr, 1, 1);
  std::vector<std::thread> ts;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; t++)
    ts.emplace_back([f, t, &bad] {
      for (int i = 0; i < 50; i++) {
        kiln_scope_push();
        kiln_tensor *x = f32({(float)t, (float)i, 1}), *out = nullptr, *want = nullptr;
        if (kiln_function_call(f, &x, &out) || chain(nullptr, 1, &x, 1, &want) || !allclose(out, want)) bad[t]++;
        kiln_scope_pop();
      }
    });
  for (auto &t : ts) t.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

int outer_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *t;
  if (kiln_function_call((kiln_function *)user, in, &t)) return -1;
  out[0] = kiln_add(t, in[0]);
  return 0;
}

TEST(Staging, CallInsideABodyIsRecorded) {
  Scoped s;
  kiln_function *inner = kiln_function_new("inner", chain, nullptr, 1, 1);
  kiln_function *outer = kiln_function_new("outer", outer_body, inner, 1, 1);
  kiln_tensor *x = f32({1, 2}), *out = nullptr, *want = nullptr;
  ASSERT_EQ(kiln_function_call(outer, &x, &out), 0) << kiln_last_error();
  kiln_function_set_eager(inner, true);
  ASSERT_EQ(outer_body(inner, 1, &x, 1, &want), 0);
  EXPECT_TRUE(allclose(out, want));
  EXPECT_EQ(kiln_function_trace_count(outer), 1);
  EXPECT_EQ(kiln_function_trace_count(inner), 1); // traced once, for the call
  char *ir = kiln_function_ir(outer, 0, "traced");
  ASSERT_NE(ir, nullptr);
  EXPECT_THAT(ir, HasSubstr("= call @inner(%0) : f32[2]"));
  EXPECT_THAT(ir, HasSubstr("func @inner("));
  free(ir);
  kiln_function_free(outer);
  kiln_function_free(inner);
}

kiln_tensor *g_leaked = nullptr;
int leak_symbolic(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  g_leaked = kiln_retain(kiln_neg(in[0])); // keeps a symbolic tensor past the trace
  out[0] = in[0];
  return 0;
}

TEST(Staging, EscapedSymbolicTensorIsRejected) {
  Scoped s;
  kiln_function *f = kiln_function_new("leak", leak_symbolic, nullptr, 1, 1);
  kiln_function *g = kiln_function_new("chain", chain, nullptr, 1, 1);
  kiln_tensor *x = f32({1, 2}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  ASSERT_NE(g_leaked, nullptr);
  EXPECT_EQ(kiln_function_call(g, &g_leaked, &out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("input 0 is a symbolic tensor that escaped"));
  EXPECT_EQ(kiln_tensor_data(g_leaked), nullptr);
  // an eager op or a view outside any trace must not read its (absent) data
  kiln_clear_error();
  EXPECT_EQ(kiln_add(g_leaked, g_leaked), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: an input is a symbolic tensor"));
  kiln_clear_error();
  EXPECT_EQ(kiln_reshape(g_leaked, KILN_SHAPE(2)), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("reshape: an input is a symbolic tensor"));
  kiln_release(g_leaked);
  g_leaked = nullptr;
  kiln_function_free(f);
  kiln_function_free(g);
}

TEST(Staging, VariableReadUnderATapeFails) {
  Scoped s;
  Owned own;
  kiln_variable *v = own.var(f32({1, 2}), "w");
  kiln_function *f = kiln_function_new("scale", read_var, v, 1, 1);
  kiln_tensor *x = f32({3, 4}), *out = nullptr;
  kiln_tape *tape = kiln_tape_begin(false);
  EXPECT_EQ(kiln_function_call(f, &x, &out), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("reads variable 'w' while a gradient tape is active"));
  kiln_tape_end(tape);
  kiln_tape_free(tape);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(values(out), (VD{3, 8}));
  kiln_function_free(f);
}

TEST(Staging, EagerModeRunsTheBody) {
  Scoped s;
  Flags fl = {true, 0};
  kiln_function *f = kiln_function_new("flagged", flagged, &fl, 1, 1);
  kiln_function_set_eager(f, true);
  kiln_tensor *x = f32({-1, 2}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  fl.use_relu = false;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(values(out), (VD{1, -2})); // the C flag is read at every call
  EXPECT_EQ(fl.traced, 2);
  EXPECT_EQ(kiln_function_trace_count(f), 0);
  kiln_function_set_eager(f, false);
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0);
  EXPECT_EQ(kiln_function_trace_count(f), 1);
  kiln_function_free(f);
}

TEST(Staging, ConcurrentCallsOfManyShapes) {
  Scoped s;
  kiln_function *f = kiln_function_new("chain", chain, nullptr, 1, 1);
  std::vector<std::thread> ts;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; t++)
    ts.emplace_back([f, t, &bad] {
      for (int i = 0; i < 40; i++) {
        kiln_scope_push();
        int64_t n = 1 + (i + t) % 5;
        kiln_tensor *x = kiln_random_uniform(KILN_F32, 1, &n, -2, 2), *out = nullptr, *want = nullptr;
        if (kiln_function_call(f, &x, &out) || chain(nullptr, 1, &x, 1, &want) || !allclose(out, want)) bad[t]++;
        kiln_scope_pop();
      }
    });
  for (auto &t : ts) t.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
  EXPECT_EQ(kiln_function_trace_count(f), 5); // one per shape, however the threads raced
  kiln_function_free(f);
}
