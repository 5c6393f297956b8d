// ir_test.cc — the IR's builder, text form and verifier: exact printing,
// print -> parse -> print identity (constants of every dtype included),
// parse errors at file:line:col, verifier messages, and a deterministic
// mutation fuzz of the parser (never crashes; what parses round-trips).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ir.h"
#include "test_util.h"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

op_type T(kiln_dtype dt, std::vector<int64_t> shape) {
  op_type t{};
  t.dtype = dt;
  t.rank = (int)shape.size();
  for (int i = 0; i < t.rank; i++) t.shape[i] = shape[i];
  return t;
}

std::string print(const ir_module *m) {
  char *s = ir_print_module(m);
  std::string r = s ? s : "<null>";
  free(s);
  return r;
}

// parse, print, parse again, print again: the two prints must agree
std::string round_trip(const std::string &text) {
  ir_module *m = ir_parse(text.c_str(), "rt.kir");
  EXPECT_NE(m, nullptr) << kiln_last_error() << "\n" << text;
  if (!m) return "";
  std::string a = print(m);
  ir_module *m2 = ir_parse(a.c_str(), "rt2.kir");
  EXPECT_NE(m2, nullptr) << kiln_last_error() << "\n" << a;
  std::string b = m2 ? print(m2) : "";
  EXPECT_EQ(a, b);
  ir_module_free(m);
  ir_module_free(m2);
  return a;
}

const char *kMlp =
    "func @f(%x: f32[64,784], %w: f32[784,256], %b: f32[256]) -> f32[64,256] {\n"
    "  %0 = dot %x, %w : f32[64,256]\n"
    "  %1 = broadcast %b {shape=[64,256]} : f32[64,256]\n"
    "  %2 = add %0, %1 : f32[64,256]  loc(mlp.c:12)\n"
    "  %3 = relu %2 : f32[64,256]\n"
    "  return %3\n"
    "}\n";

TEST(IR, BuilderPrintsDesignExample) {
  ir_module *m = ir_module_new();
  op_type params[3] = {T(KILN_F32, {64, 784}), T(KILN_F32, {784, 256}), T(KILN_F32, {256})};
  ir_func *f = ir_func_new(m, "f", 3, params);
  ASSERT_NE(f, nullptr) << kiln_last_error();
  ASSERT_EQ(ir_set_name(f, 0, "x"), 0);
  ASSERT_EQ(ir_set_name(f, 1, "w"), 0);
  ASSERT_EQ(ir_set_name(f, 2, "b"), 0);
  ir_value xw[2] = {0, 1};
  ir_value d = ir_append(f, OP_DOT, nullptr, 2, xw, ir_loc{nullptr, 0});
  op_attrs a{};
  a.rank = 2, a.shape[0] = 64, a.shape[1] = 256;
  ir_value b = 2;
  ir_value bb = ir_append(f, OP_BROADCAST, &a, 1, &b, ir_loc{nullptr, 0});
  ir_value in[2] = {d, bb};
  ir_value s = ir_append(f, OP_ADD, nullptr, 2, in, ir_loc{"mlp.c", 12});
  ir_value r = ir_append(f, OP_RELU, nullptr, 1, &s, ir_loc{nullptr, 0});
  ASSERT_GE(r, 0) << kiln_last_error();
  ASSERT_EQ(ir_set_results(f, 1, &r), 0);
  EXPECT_EQ(ir_verify_module(m), 0) << kiln_last_error();
  EXPECT_EQ(print(m), kMlp);
  EXPECT_EQ(round_trip(kMlp), kMlp);
  EXPECT_EQ(ir_module_find(m, "f"), f);
  EXPECT_EQ(ir_module_find(m, "g"), nullptr);
  ir_module_free(m);
}

TEST(IR, BuilderRejectsBadInstructions) {
  ir_module *m = ir_module_new();
  op_type p[2] = {T(KILN_F32, {2, 3}), T(KILN_I32, {3})};
  ir_func *f = ir_func_new(m, "f", 2, p);
  ASSERT_NE(f, nullptr);
  ir_value xy[2] = {0, 1}, x = 0, bad = 7;
  ir_loc nl{nullptr, 0};
  EXPECT_EQ(ir_append(f, OP_ADD, nullptr, 2, xy, nl), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("add: dtype mismatch: f32 and i32"));
  EXPECT_EQ(ir_append(f, OP_NEG, nullptr, 2, xy, nl), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("neg: takes 1 input, got 2"));
  EXPECT_EQ(ir_append(f, OP_NEG, nullptr, 1, &bad, nl), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("is not a value of @f"));
  ir_value i = 1;
  EXPECT_EQ(ir_append(f, OP_EXP, nullptr, 1, &i, nl), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("exp: dtype i32 is not supported"));
  op_attrs a{};
  a.naxes = 2, a.axes[0] = 1, a.axes[1] = 0;
  EXPECT_EQ(ir_append(f, OP_REDUCE_SUM, &a, 1, &x, nl), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("reduce_sum: axes must be ascending"));
  op_attrs sl{};
  sl.rank = 1;
  EXPECT_EQ(ir_append(f, OP_SLICE, &sl, 1, &x, nl), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("slice: begin and size have 1 entries"));
  EXPECT_EQ(ir_constant(f, nullptr, nl), -1);
  EXPECT_EQ(ir_append(f, OP_COUNT, nullptr, 0, nullptr, nl), -1);
  EXPECT_EQ(f->n_instrs, 0);
  EXPECT_EQ(ir_func_new(m, "f", 0, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), HasSubstr("redefinition of function @f"));
  EXPECT_EQ(ir_set_name(f, 0, "9x"), -1);
  EXPECT_EQ(ir_set_name(f, 0, "x"), 0);
  EXPECT_EQ(ir_set_name(f, 1, "x"), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("%x is already defined"));
  EXPECT_EQ(ir_set_results(f, 1, &bad), -1);
  ir_module_free(m);
}

TEST(IR, EveryAttributeRoundTrips) {
  const char *text =
      "func @attrs(%a: f32[2,3], %i: i64[2,2], %u: f32[2,2,3]) -> (f32[3], i64[2], f32[3,2], f16[2,3], f32[2,2]) {\n"
      "  %s = reduce_sum %a {axes=[0], keepdims=false} : f32[3]\n"
      "  %k = reduce_max %a {axes=[0,1], keepdims=true} : f32[1,1]\n"
      "  %m = argmax %a {axis=1} : i64[2]\n"
      "  %t = transpose %a {perm=[1,0]} : f32[3,2]\n"
      "  %sl = slice %a {begin=[0,1], size=[2,2]} : f32[2,2]\n"
      "  %to = slice %a {begin=[1,0], size=[-1,-1]} : f32[1,3]\n"
      "  %h = convert %a {dtype=f16} : f16[2,3]\n"
      "  %r = reshape %a {shape=[3,2]} : f32[3,2]\n"
      "  %g = gather %a, %i {axis=0} : f32[2,2,3]\n"
      "  %sc = scatter_add %u, %i {axis=0, shape=[4,3]} : f32[4,3]\n"
      "  %c = concat %a, %a, %a {axis=1} : f32[2,9]\n"
      "  %io = iota {dtype=i64, shape=[5]} : i64[5]\n"
      "  %ru = rng_uniform {dtype=f64, shape=[2], lo=-0.10000000000000001, hi=2.5, seed=18446744073709551615, "
      "counter=3} : f64[2]\n"
      "  %rn = rng_normal {dtype=f32, shape=[], seed=1, counter=0} : f32[]\n"
      "  %sel = select %b, %a, %a : f32[2,3]  loc(\"dir with space/x.c\":7)\n"
      "  return %s, %m, %t, %h, %sl\n"
      "}\n";
  // %b is undefined in the text above on purpose: fix it, then round trip
  std::string ok = text;
  ok.replace(ok.find("  %sel"), 0, "  %b = gt %a, %a : bool[2,3]\n");
  std::string out = round_trip(ok);
  EXPECT_EQ(out, ok);
  ir_module *m = ir_parse(text, "attrs.kir");
  EXPECT_EQ(m, nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("attrs.kir:16:17: undefined value %b"));
}

TEST(IR, MultipleFunctionsAndNumbering) {
  const char *in =
      "// comments are skipped\n"
      "func @a() -> () {\n  return\n}\n"
      "func @\"odd name\"(%7: f32[], %y: f32[]) -> (f32[], f32[]) {\n"
      "  %9 = add %7, %y : f32[]\n  %z = mul %9, %9 : f32[]\n  %3 = neg %z : f32[]\n  return %3, %9\n}\n";
  const char *want =
      "func @a() -> () {\n  return\n}\n\n"
      "func @\"odd name\"(%0: f32[], %y: f32[]) -> (f32[], f32[]) {\n"
      "  %1 = add %0, %y : f32[]\n  %z = mul %1, %1 : f32[]\n  %2 = neg %z : f32[]\n  return %2, %1\n}\n";
  EXPECT_EQ(round_trip(in), want);
}

// constants of every dtype, special values, inline and hex
TEST(IR, ConstantsRoundTripBitExact) {
  kiln_scope_push();
  std::mt19937 rng(11);
  ir_module *m = ir_module_new();
  ir_func *f = ir_func_new(m, "c", 0, nullptr);
  std::vector<kiln_tensor *> originals;
  auto add = [&](kiln_dtype dt, std::vector<int64_t> shape, const void *data) {
    kiln_tensor *t = kiln_tensor_new(dt, (int)shape.size(), shape.data(), data);
    ASSERT_NE(t, nullptr);
    ASSERT_GE(ir_constant(f, t, ir_loc{nullptr, 0}), 0) << kiln_last_error();
    originals.push_back(t);
  };
  float f32[] = {0.1f, -0.0f, INFINITY, -INFINITY, NAN, 1e-45f, 3.4028235e38f, 1.0f / 3};
  double f64[] = {0.1, -0.0, INFINITY, -INFINITY, NAN, 5e-324, 1.7976931348623157e308, 1.0 / 3};
  int32_t i32[] = {0, -1, INT32_MIN, INT32_MAX};
  int64_t i64[] = {0, -1, INT64_MIN, INT64_MAX};
  uint8_t b[] = {1, 0, 1};
  uint16_t h[] = {0x3c00, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x0001, 0x7bff, 0x3555};
  uint16_t bf[] = {0x3f80, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x0001, 0x7f7f, 0x3eab};
  add(KILN_F32, {8}, f32);
  add(KILN_F64, {2, 4}, f64);
  add(KILN_I32, {4}, i32);
  add(KILN_I64, {2, 2}, i64);
  add(KILN_BOOL, {3}, b);
  add(KILN_F16, {8}, h);
  add(KILN_BF16, {8}, bf);
  add(KILN_F32, {}, f32);
  add(KILN_F64, {0}, nullptr);
  uint32_t odd_nan = 0x7fc00001u, neg_nan = 0xffc00000u;  // not canonical: printed as hex
  add(KILN_F32, {1}, &odd_nan);
  add(KILN_F32, {}, &neg_nan);
  uint8_t bool2 = 2;
  add(KILN_BOOL, {}, &bool2);
  for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {  // large: hex
    std::vector<unsigned char> raw(17 * 8 * kiln_dtype_size((kiln_dtype)dt));
    for (auto &c : raw) c = (unsigned char)rng();
    if (dt == KILN_BOOL)
      for (auto &c : raw) c &= 1;
    add((kiln_dtype)dt, {17, 8}, raw.data());
  }
  std::vector<ir_value> res;
  for (int i = 0; i < f->n_instrs; i++) res.push_back(f->instrs[i].out);
  ASSERT_EQ(ir_set_results(f, (int)res.size(), res.data()), 0);
  std::string text = print(m);
  EXPECT_THAT(text, HasSubstr("dense<[0.100000001, -0, inf, -inf, nan, 1.40129846e-45, 3.40282347e+38, "
                              "0.333333343]> : f32[8]"));
  EXPECT_THAT(text, HasSubstr("dense<[0, -1, -2147483648, 2147483647]> : i32[4]"));
  EXPECT_THAT(text, HasSubstr("dense<[0, -1, -9223372036854775808, 9223372036854775807]> : i64[2,2]"));
  EXPECT_THAT(text, HasSubstr("dense<[true, false, true]> : bool[3]"));
  EXPECT_THAT(text, HasSubstr("dense<0.100000001> : f32[]"));
  EXPECT_THAT(text, HasSubstr("dense<[]> : f64[0]"));
  EXPECT_THAT(text, HasSubstr("dense<0x0100c07f> : f32[1]"));
  EXPECT_THAT(text, HasSubstr("dense<-nan> : f32[]"));
  EXPECT_THAT(text, HasSubstr("dense<true> : bool[]"));  // kiln_tensor_new stores bools as 0/1
  ir_module *m2 = ir_parse(text.c_str(), "c.kir");
  ASSERT_NE(m2, nullptr) << kiln_last_error();
  EXPECT_EQ(print(m2), text);
  ir_func *g = m2->funcs[0];
  ASSERT_EQ(g->n_instrs, (int)originals.size());
  for (size_t i = 0; i < originals.size(); i++) {
    kiln_tensor *a = originals[i], *c = g->instrs[i].attrs.value;
    ASSERT_EQ(kiln_tensor_dtype(a), kiln_tensor_dtype(c));
    ASSERT_EQ(kiln_tensor_size(a), kiln_tensor_size(c));
    size_t bytes = (size_t)kiln_tensor_size(a) * kiln_dtype_size(kiln_tensor_dtype(a));
    EXPECT_TRUE(bytes == 0 || !memcmp(kiln_tensor_data(a), kiln_tensor_data(c), bytes)) << "constant " << i;
  }
  ir_module_free(m);
  ir_module_free(m2);
  kiln_scope_pop();
}

// malformed inputs: each fails at file:line:col with a reason
TEST(IR, ParseErrorsHaveLocations) {
  struct Case {
    const char *text, *error;
  } cases[] = {
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = foo %x : f32[3]\n  return %0\n}\n", "e.kir:2:8: unknown op 'foo'"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = neg %y : f32[3]\n  return %0\n}\n", "e.kir:2:12: undefined value %y"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %x = neg %x : f32[3]\n  return %x\n}\n", "e.kir:2:3: redefinition of %x"},
      {"func @f(%x: f32[3], %x: f32[3]) -> () {\n  return\n}\n", "e.kir:1:21: redefinition of %x"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = neg %x : f32[4]\n  return %0\n}\n",
       "e.kir:2:17: type mismatch: f32[4] annotated, f32[3] inferred by neg"},
      {"func @f(%x: f32[3]) -> f32[] {\n  %0 = reduce_sum %x {axes=[0], bogus=1} : f32[]\n  return %0\n}\n",
       "e.kir:2:33: bad attribute: reduce_sum has no attribute 'bogus'"},
      {"func @f(%x: f32[3]) -> f32[] {\n  %0 = reduce_sum %x {axes=[0], axes=[0]} : f32[]\n  return %0\n}\n",
       "e.kir:2:33: bad attribute: 'axes' given twice"},
      {"func @f(%x: f32[3]) -> f32[] {\n  %0 = reduce_sum %x : f32[]\n  return %0\n}\n",
       "e.kir:2:22: bad attribute: reduce_sum needs attribute 'axes'"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = neg %x : f32[3]", "e.kir:2:23: unexpected end of input"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = neg %x : f32[", "e.kir:2:21: expected dimension, got end of input"},
      {"func @f(%x: f32[3]", "e.kir:1:19: expected ',' or ')' after a parameter, got end of input"},
      {"func @f(%x: f32[3], %y: i32[3]) -> f32[3] {\n  %0 = add %x, %y : f32[3]\n  return %0\n}\n",
       "e.kir:2:8: add: dtype mismatch: f32 and i32"},
      {"func @f(%x: i32[3]) -> i32[3] {\n  %0 = exp %x : i32[3]\n  return %0\n}\n",
       "e.kir:2:8: exp: dtype i32 is not supported"},
      {"func @f(%x: f32[3]) -> f32[4] {\n  return %x\n}\n",
       "e.kir:1:24: type mismatch: result 0 is f32[3], the signature says f32[4]"},
      {"func @f(%x: f32[3]) -> (f32[3], f32[3]) {\n  return %x\n}\n",
       "e.kir:2:3: return has 1 value, the signature of @f declares 2"},
      {"func @f() -> f32[3] {\n  %0 = constant dense<[1, 2]> : f32[3]\n  return %0\n}\n",
       "e.kir:2:33: constant has 2 elements, type f32[3] has 3"},
      {"func @f() -> f32[3] {\n  %0 = constant dense<[1, x, 3]> : f32[3]\n  return %0\n}\n",
       "e.kir:2:27: 'x' is not a f32 value"},
      {"func @f() -> i32[] {\n  %0 = constant dense<3000000000> : i32[]\n  return %0\n}\n",
       "e.kir:2:23: '3000000000' is not a i32 value"},
      {"func @f() -> f32[3] {\n  %0 = constant dense<0x0000> : f32[3]\n  return %0\n}\n",
       "e.kir:2:23: constant has 2 bytes, type f32[3] needs 12"},
      {"func @f() -> f32[] {\n  %0 = constant dense<[1]> : f32[]\n  return %0\n}\n",
       "e.kir:2:23: constant of rank 0 is written without brackets"},
      {"func @f() -> () {\n  return\n}\nfunc @f() -> () {\n  return\n}\n", "e.kir:4:7: redefinition of function @f"},
      {"func @f(%x: f33[3]) -> () {\n  return\n}\n", "e.kir:1:13: expected a dtype"},
      {"func @f(%x: f32[-1]) -> () {\n  return\n}\n", "e.kir:1:17: dimension -1 is out of range"},
      {"func @f(%x: f32[1,1,1,1,1,1,1,1,1]) -> () {\n  return\n}\n", "e.kir:1:33: more than 8 entries in dimension"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = transpose %x {perm=[1]} : f32[3]\n  return %0\n}\n",
       "e.kir:2:8: transpose: perm (1) is not a permutation of 1 axes"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = neg %x : f32[3]  loc(a.c)\n  return %0\n}\n",
       "e.kir:2:32: expected ':' between file and line in loc, got ')'"},
      {"garbage", "e.kir:1:1: expected 'func', got 'garbage'"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  neg %x\n}\n", "e.kir:2:3: expected an instruction"},
      {"func @f(%x: f32[3]) -> f32[3] {\n  %0 = slice %x {begin=[0,0], size=[1]} : f32[1]\n  return %0\n}\n",
       "e.kir:2:17: bad attribute: begin has 2 entries, size 1"},
  };
  for (const Case &c : cases) {
    ir_module *m = ir_parse(c.text, "e.kir");
    EXPECT_EQ(m, nullptr) << c.text;
    EXPECT_THAT(kiln_last_error(), StartsWith(c.error)) << c.text;
    ir_module_free(m);
  }
}

TEST(IR, VerifierNamesFunctionAndValue) {
  ir_module *m = ir_parse(kMlp, "v.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *f = m->funcs[0];
  EXPECT_EQ(ir_verify(f), 0);
  // a wrong result type
  f->types[f->instrs[3].out].shape[0] = 65;
  EXPECT_EQ(ir_verify(f), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f: %3: type f32[65,256], but relu infers f32[64,256]"));
  f->types[f->instrs[3].out].shape[0] = 64;
  // a use before the definition
  f->instrs[2].in[0] = f->instrs[3].out;
  EXPECT_EQ(ir_verify(f), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f: %2: input 0 (%3) is used before its definition"));
  f->instrs[2].in[0] = f->instrs[0].out;
  // arity
  f->instrs[3].n_in = 2;
  f->instrs[3].in = (ir_value *)realloc(f->instrs[3].in, 2 * sizeof(ir_value));
  f->instrs[3].in[1] = 0;
  EXPECT_EQ(ir_verify(f), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f: %3: relu: takes 1 input, got 2"));
  f->instrs[3].n_in = 1;
  // attributes
  f->instrs[1].attrs.rank = 1;
  EXPECT_EQ(ir_verify(f), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f: %1: broadcast_to: cannot broadcast (256,) to (64,)"));
  f->instrs[1].attrs.rank = 2;
  // duplicate names, bad results
  free(f->names[1]);
  f->names[1] = strdup("x");
  EXPECT_EQ(ir_verify(f), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f: %x: defined more than once"));
  free(f->names[1]);
  f->names[1] = strdup("w");
  f->results[0] = 99;
  EXPECT_EQ(ir_verify(f), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f: signature: result 0 (99) is not a value"));
  f->results[0] = f->instrs[3].out;
  EXPECT_EQ(ir_verify_module(m), 0) << kiln_last_error();
  ir_module_free(m);
}

TEST(IR, DotOutput) {
  ir_module *m = ir_parse(kMlp, "d.kir");
  ASSERT_NE(m, nullptr);
  char *dot = ir_print_dot(m);
  ASSERT_NE(dot, nullptr);
  EXPECT_THAT(dot, StartsWith("digraph kir {"));
  EXPECT_THAT(dot, HasSubstr("f0_v3 -> f0_v5;"));
  free(dot);
  ir_module_free(m);
}

// Random mutations of valid text: the parser must never crash, and whatever
// it accepts must print, parse and print again identically.
TEST(IR, MutationFuzzNeverCrashes) {
  const char *seeds[] = {
      kMlp,
      "func @g(%a: f32[2,3], %i: i32[2]) -> (f32[3], f32[2,3]) {\n"
      "  %s = reduce_sum %a {axes=[0], keepdims=false} : f32[3]\n"
      "  %c = constant dense<[1, 2.5, nan, -inf, 0, 7]> : f32[2,3]\n"
      "  %t = transpose %c {perm=[1,0]} : f32[3,2]\n"
      "  %g = gather %a, %i {axis=1} : f32[2,2]\n"
      "  %r = rng_uniform {dtype=f32, shape=[4], lo=0, hi=1, seed=42, counter=7} : f32[4]\n"
      "  %h = constant dense<0x00003c00> : f16[2]\n"
      "  %m = select %b, %a, %c : f32[2,3]\n"
      "  return %s, %c\n"
      "}\n",
  };
  static const char *tokens[] = {"%", "@", "{", "}", "[", "]", "(", ")", ",", ":", "=", "->", "<", ">", "\"",
                                 "0x", "-", "nan", "1e999", "f16", "bool", "dense", "loc(", "\n", " ", "//",
                                 "99999999999999999999", "%0", "func", "return", "\\", "\xff", "8"};
  std::mt19937 rng(2024);
  int parsed = 0;
  const int iters = 20000;
  for (int it = 0; it < iters; it++) {
    std::string s = seeds[it % 2];
    int edits = 1 + (int)(rng() % 4);
    for (int e = 0; e < edits && !s.empty(); e++) {
      size_t pos = rng() % s.size();
      switch (rng() % 5) {
        case 0: s[pos] = (char)(rng() % 256); break;
        case 1: s.erase(pos, 1 + rng() % 8); break;
        case 2: s.insert(pos, tokens[rng() % (sizeof tokens / sizeof *tokens)]); break;
        case 3: s.resize(pos); break;
        default: {
          size_t from = rng() % s.size(), n = rng() % 16;
          s.insert(pos, s.substr(from, n));
        }
      }
    }
    kiln_clear_error();
    ir_module *m = ir_parse(s.c_str(), "fuzz.kir");
    if (!m) {
      EXPECT_THAT(kiln_last_error(), StartsWith("fuzz.kir:")) << s;
      continue;
    }
    parsed++;
    std::string a = print(m);
    ir_module *m2 = ir_parse(a.c_str(), "fuzz2.kir");
    ASSERT_NE(m2, nullptr) << kiln_last_error() << "\n--- input\n" << s << "\n--- printed\n" << a;
    ASSERT_EQ(print(m2), a) << s;
    ir_module_free(m);
    ir_module_free(m2);
  }
  EXPECT_GT(parsed, 0);
}

}  // namespace

namespace {
int add_one_host(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  ++*(int *)user;
  out[0] = kiln_add(in[0], kiln_scalar_like(in[0], 1));
  return out[0] ? 0 : -1;
}
}  // namespace

TEST(IR, CallsAndHostCallsThroughTheBuilder) {
  kiln_test::Scoped s;
  ir_value zero[1] = {0};
  ir_loc nl{nullptr, 0};
  ir_module *m = ir_module_new();
  op_type t{KILN_F32, 1, {2}};
  ir_func *g = ir_func_new(m, "g", 1, &t);
  ir_value gv = ir_append(g, OP_NEG, nullptr, 1, zero, nl);
  ir_value gr[2] = {gv, 0};
  ASSERT_EQ(ir_set_results(g, 2, gr), 0);
  ir_func *f = ir_func_new(m, "f", 1, &t);
  op_attrs a{};
  a.callee = g;
  ir_value c = ir_append(f, OP_CALL, &a, 1, zero, nl);
  ASSERT_GE(c, 0) << kiln_last_error();
  EXPECT_EQ(f->instrs[0].n_out, 2);
  int calls = 0;
  ir_host *h = ir_module_add_host(m, add_one_host, &calls, "add_one", 1, &t);
  ASSERT_NE(h, nullptr);
  op_attrs ha{};
  ha.host = h;
  ir_value hv = ir_append(f, OP_HOST_CALL, &ha, 1, &c, nl);
  ASSERT_GE(hv, 0) << kiln_last_error();
  ir_value fr[2] = {hv, c + 1};
  ASSERT_EQ(ir_set_results(f, 2, fr), 0);
  ASSERT_EQ(ir_verify_module(m), 0) << kiln_last_error();
  kiln_tensor *x = kiln_test::f32({1, -2}), *r[2];
  ASSERT_EQ(ir_interpret(f, &x, r), 0) << kiln_last_error();
  EXPECT_EQ(kiln_test::values(r[0]), (kiln_test::VD{0, 3}));  // -x + 1
  EXPECT_EQ(kiln_test::values(r[1]), (kiln_test::VD{1, -2})); // g's second result: its parameter
  EXPECT_EQ(calls, 1);
  // wrong argument type for a call, and a callee of another module
  op_type t3{KILN_F32, 1, {3}};
  ir_func *k = ir_func_new(m, "k", 1, &t3);
  EXPECT_EQ(ir_append(k, OP_CALL, &a, 1, zero, nl), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("call: @g: argument 0 is f32[3], the parameter is f32[2]"));
  ir_module *other = ir_module_new();
  ir_func *o = ir_func_new(other, "o", 1, &t);
  EXPECT_EQ(ir_append(o, OP_CALL, &a, 1, zero, nl), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("not a function of this module"));
  ir_module_free(other);
  // mutual recursion, which only the builder can make, fails verification
  ir_func *p = ir_func_new(m, "p", 1, &t), *q = ir_func_new(m, "q", 1, &t);
  op_attrs ap{}, aq{};
  ap.callee = q;
  aq.callee = p;
  ASSERT_EQ(ir_set_results(p, 1, zero), 0);
  ASSERT_EQ(ir_set_results(q, 1, zero), 0);
  ir_value pv = ir_append(p, OP_CALL, &ap, 1, zero, nl);
  ir_value qv = ir_append(q, OP_CALL, &aq, 1, zero, nl);
  ASSERT_GE(pv, 0);
  ASSERT_GE(qv, 0);
  EXPECT_EQ(ir_verify(p), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("(recursion)"));
  ir_module_free(m);
}
