// control_ir_test.cc — control flow in the IR (cond, while, scan with
// regions): the text form read back byte for byte, the interpreter's values
// worked out by hand, the verifier's and the parser's errors, and every pass
// working through regions (simplify, fold, cse, dce, licm, fuse, inline,
// buffers), each checked against the interpreter on the unoptimized program,
// with and without KILN_POISON, plus random control-flow programs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "buffers.h"
#include "ir_gen.h"
#include "ir_test_util.h"
#include "passes.h"
#include "test_util.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace kiln_test;


// Runs pipeline on function name of a copy of text and checks that the
// result verifies (the whole module: a region belongs to one instruction),
// prints and reads back byte for byte, and computes the same bits as the
// unoptimized function, with and without KILN_POISON. Returns the
// optimized function's text.
std::string check_pipeline(const std::string &text, const char *name, const char *pipeline,
                           std::vector<kiln_tensor *> args) {
  Mod ref(text), opt(text);
  if (!ref.m || !opt.m) return "";
  std::vector<kiln_tensor *> want = run(ref.f(name), args);
  EXPECT_EQ(pass_run_pipeline(opt.f(name), pipeline, nullptr, nullptr, nullptr), 0)
      << pipeline << ": " << kiln_last_error();
  EXPECT_EQ(ir_verify_module(opt.m), 0) << pipeline << ": " << kiln_last_error() << "\n" << opt.text();
  std::string printed = opt.text();
  Mod back(printed, "printed.kir");
  EXPECT_EQ(back.text(), printed) << pipeline;
  for (const char *poison : {"0", "1"}) {
    EnvGuard g("KILN_POISON", poison);
    std::vector<kiln_tensor *> got = run(opt.f(name), args);
    for (size_t r = 0; r < want.size() && r < got.size(); r++) {
      EXPECT_TRUE(got[r] && want[r] && same_bits(got[r], want[r]))
          << pipeline << " result " << r << " KILN_POISON=" << poison << "\n"
          << printed;
    }
  }
  return opt.func_text(name);
}

kiln_tensor *b1(bool v) {
  uint8_t x = v;
  return kiln_tensor_new(KILN_BOOL, 0, nullptr, &x);
}
kiln_tensor *i32s(int32_t v) { return i32({}, {v}); }

// ---- the text form ----

// A scan inside a while inside a cond's then branch, every role spelled.
const char *kNested = R"(func @sq(%a: f32[3]) -> f32[3] {
  %0 = mul %a, %a : f32[3]
  return %0
}

func @f(%p: bool[], %x: f32[3], %n: i32[], %xs: f32[4,3]) -> (f32[3], f32[4,3]) {
  %r, %ys = cond %p, %x, %n, %xs : f32[3], f32[4,3]
    then func @f.c0.then(%a: f32[3], %m: i32[], %s: f32[4,3]) -> (f32[3], f32[4,3]) {
      %i, %acc = while %m, %a, %s {state=2, max_iterations=10} : i32[], f32[3]
        cond func @f.w0.cond(%j: i32[], %c: f32[3], %q: f32[4,3]) -> bool[] {
          %z = constant dense<0> : i32[]
          %0 = gt %j, %z : bool[]
          return %0
        }
        body func @f.w0.body(%j: i32[], %c: f32[3], %q: f32[4,3]) -> (i32[], f32[3]) {
          %one = constant dense<1> : i32[]
          %0 = sub %j, %one : i32[]
          %c2, %y = scan %c, %q {carry=1, xs=1, length=4, reverse=true} : f32[3], f32[4,3]
            body func @f.s0.body(%k: f32[3], %t: f32[3]) -> (f32[3], f32[3]) {
              %0 = add %k, %t : f32[3]
              %1 = call @sq(%0) : f32[3]
              return %0, %1
            }
          return %0, %c2
        }
      return %acc, %s
    }
    else func @f.c0.else(%a: f32[3], %m: i32[], %s: f32[4,3]) -> (f32[3], f32[4,3]) {
      %0 = neg %a : f32[3]
      return %0, %s
    }
  return %r, %ys
}
)";

TEST(ControlIR, NestedControlFlowPrintsAndParsesBackByteForByte) {
  Scoped s;
  Mod m(kNested);
  ASSERT_NE(m.m, nullptr);
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
  EXPECT_EQ(m.text(), kNested);
  Mod back(m.text());
  EXPECT_EQ(back.text(), kNested);
  // the regions are functions of the module marked region, held once each
  for (const char *r : {"f.c0.then", "f.c0.else", "f.w0.cond", "f.w0.body", "f.s0.body"}) {
    ASSERT_NE(m.f(r), nullptr) << r;
    EXPECT_TRUE(m.f(r)->region) << r;
  }
  EXPECT_FALSE(m.f("sq")->region);
  // a deep copy keeps the text
  ir_module *c = ir_module_clone(m.m);
  ASSERT_NE(c, nullptr) << kiln_last_error();
  char *t = ir_print_module(c);
  EXPECT_STREQ(t, kNested);
  free(t);
  ir_module_free(c);
}

// ---- the interpreter ----

const char *kCond = R"(
func @f(%p: bool[], %x: f32[3], %y: f32[3]) -> (f32[3], f32[]) {
  %r, %s = cond %p, %x, %y : f32[3], f32[]
    then func @f.then(%a: f32[3], %b: f32[3]) -> (f32[3], f32[]) {
      %0 = add %a, %b : f32[3]
      %1 = reduce_sum %0 {axes=[0]} : f32[]
      return %0, %1
    }
    else func @f.else(%a: f32[3], %b: f32[3]) -> (f32[3], f32[]) {
      %0 = mul %a, %b : f32[3]
      %1 = reduce_max %b {axes=[0]} : f32[]
      return %0, %1
    }
  return %r, %s
}
)";

TEST(ControlInterp, CondRunsTheBranchThePredicatePicks) {
  Scoped s;
  Mod m(kCond);
  ASSERT_NE(m.m, nullptr);
  kiln_tensor *x = f32({1, 2, 3}), *y = f32({4, 5, 6});
  auto t = run(m.f("f"), {b1(true), x, y});
  EXPECT_EQ(values(t[0]), (VD{5, 7, 9}));
  EXPECT_EQ(values(t[1]), (VD{21}));
  auto e = run(m.f("f"), {b1(false), x, y});
  EXPECT_EQ(values(e[0]), (VD{4, 10, 18}));
  EXPECT_EQ(values(e[1]), (VD{6}));
}

// while (i < n) { i += 1; s = s * 2 + c } with the capture c; max_iterations
// bounds it.
std::string while_text(int max_iterations) {
  return R"(
func @f(%n: i32[], %s0: f32[2], %c: f32[2]) -> (i32[], f32[2]) {
  %z = constant dense<0> : i32[]
  %i, %s = while %z, %s0, %n, %c {state=2, max_iterations=)" +
         std::to_string(max_iterations) + R"(} : i32[], f32[2]
    cond func @f.cond(%i: i32[], %s: f32[2], %n: i32[], %c: f32[2]) -> bool[] {
      %0 = lt %i, %n : bool[]
      return %0
    }
    body func @f.body(%i: i32[], %s: f32[2], %n: i32[], %c: f32[2]) -> (i32[], f32[2]) {
      %one = constant dense<1> : i32[]
      %two = constant dense<2.0> : f32[]
      %0 = add %i, %one : i32[]
      %1 = mul %s, %two : f32[2]
      %2 = add %1, %c : f32[2]
      return %0, %2
    }
  return %i, %s
}
)";
}

TEST(ControlInterp, WhileRunsUntilTheConditionFailsWithACapture) {
  Scoped s;
  Mod m(while_text(-1));
  ASSERT_NE(m.m, nullptr);
  // s: (1, 0) -> (3, 1) -> (7, 3) -> (15, 7)
  auto r = run(m.f("f"), {i32s(3), f32({1, 0}), f32({1, 1})});
  EXPECT_EQ(values(r[0]), (VD{3}));
  EXPECT_EQ(values(r[1]), (VD{15, 7}));
  // the condition false at once: the state as it came
  auto z = run(m.f("f"), {i32s(0), f32({1, 0}), f32({1, 1})});
  EXPECT_EQ(values(z[0]), (VD{0}));
  EXPECT_EQ(values(z[1]), (VD{1, 0}));
}

TEST(ControlInterp, WhileStopsAtMaxIterations) {
  Scoped s;
  Mod m(while_text(2));
  ASSERT_NE(m.m, nullptr);
  auto r = run(m.f("f"), {i32s(100), f32({1, 0}), f32({1, 1})});
  EXPECT_EQ(values(r[0]), (VD{2}));
  EXPECT_EQ(values(r[1]), (VD{7, 3}));
  Mod zero(while_text(0));
  auto z = run(zero.f("f"), {i32s(100), f32({1, 0}), f32({1, 1})});
  EXPECT_EQ(values(z[0]), (VD{0}));
  EXPECT_EQ(values(z[1]), (VD{1, 0}));
}

// carry c, y_t = (c + x_t * w, c): the running sum and the prefix before it
std::string scan_text(int len, bool reverse) {
  std::string L = std::to_string(len);
  return R"(
func @f(%c0: f32[2], %xs: f32[)" +
         L + R"(,2], %w: f32[]) -> (f32[2], f32[)" + L + R"(,2], f32[)" + L + R"(]) {
  %c, %ys, %zs = scan %c0, %xs, %w {carry=1, xs=1, length=)" +
         L + (reverse ? ", reverse=true" : ", reverse=false") + R"(} : f32[2], f32[)" + L + R"(,2], f32[)" + L + R"(]
    body func @f.body(%c: f32[2], %x: f32[2], %w: f32[]) -> (f32[2], f32[2], f32[]) {
      %0 = mul %x, %w : f32[2]
      %1 = add %c, %0 : f32[2]
      %2 = reduce_sum %c {axes=[0]} : f32[]
      return %1, %c, %2
    }
  return %c, %ys, %zs
}
)";
}

TEST(ControlInterp, ScanForwardCarriesXsAndStackedYs) {
  Scoped s;
  Mod m(scan_text(3, false));
  ASSERT_NE(m.m, nullptr);
  auto r = run(m.f("f"), {f32({0, 1}), f32({3, 2}, {1, 2, 3, 4, 5, 6}), f32({}, {10})});
  // c: (0,1) -> (10,21) -> (40,61) -> (90,121)
  EXPECT_EQ(values(r[0]), (VD{90, 121}));
  EXPECT_EQ(values(r[1]), (VD{0, 1, 10, 21, 40, 61}));
  EXPECT_EQ(values(r[2]), (VD{1, 31, 101}));
  EXPECT_EQ(shape_of(r[1]), (V64{3, 2}));
}

TEST(ControlInterp, ScanReverseWalksFromTheEndAndStoresYsInPlace) {
  Scoped s;
  Mod m(scan_text(3, true));
  ASSERT_NE(m.m, nullptr);
  auto r = run(m.f("f"), {f32({0, 1}), f32({3, 2}, {1, 2, 3, 4, 5, 6}), f32({}, {10})});
  // t = 2, 1, 0: c (0,1) -> (50,61) -> (80,101) -> (90,121); y_t is the carry before step t
  EXPECT_EQ(values(r[0]), (VD{90, 121}));
  EXPECT_EQ(values(r[1]), (VD{80, 101, 50, 61, 0, 1}));
  EXPECT_EQ(values(r[2]), (VD{181, 111, 1}));
}

TEST(ControlInterp, ScanOfLengthZeroReturnsTheInitialCarryAndEmptyYs) {
  Scoped s;
  Mod m(scan_text(0, false));
  ASSERT_NE(m.m, nullptr);
  auto r = run(m.f("f"), {f32({4, 5}), f32({0, 2}, {}), f32({}, {10})});
  EXPECT_EQ(values(r[0]), (VD{4, 5}));
  EXPECT_EQ(shape_of(r[1]), (V64{0, 2}));
  EXPECT_EQ(shape_of(r[2]), (V64{0}));
}

TEST(ControlInterp, NestedControlFlowRuns) {
  Scoped s;
  Mod m(kNested);
  ASSERT_NE(m.m, nullptr);
  kiln_tensor *x = f32({1, 0, -1}), *xs = f32({4, 3}, {1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1});
  // then: the while runs n = 2 times; each runs the reverse scan, whose
  // final carry is c + the sum of the rows = c + (1, 1, 2)
  auto t = run(m.f("f"), {b1(true), x, i32s(2), xs});
  EXPECT_EQ(values(t[0]), (VD{3, 2, 3}));
  EXPECT_TRUE(same_bits(t[1], xs));
  auto e = run(m.f("f"), {b1(false), x, i32s(2), xs});
  EXPECT_EQ(values(e[0]), (VD{-1, 0, 1}));
  // n = 20: max_iterations=10 stops it
  auto b = run(m.f("f"), {b1(true), x, i32s(20), xs});
  EXPECT_EQ(values(b[0]), (VD{11, 10, 19}));
}

// ---- bad input ----

std::string parse_error(const std::string &text) {
  ir_module *m = ir_parse(text.c_str(), "bad.kir");
  std::string e = m ? "(parsed)" : kiln_last_error();
  ir_module_free(m);
  return e;
}

TEST(ControlErrors, BranchesThatDisagree) {
  EXPECT_THAT(parse_error(R"(func @f(%p: bool[], %x: f32[3]) -> f32[3] {
  %r = cond %p, %x : f32[3]
    then func @t(%a: f32[3]) -> f32[3] {
      return %a
    }
    else func @e(%a: f32[3]) -> f32[] {
      %0 = reduce_sum %a {axes=[0]} : f32[]
      return %0
    }
  return %r
}
)"),
              HasSubstr("cond: the branches disagree: result 0 of @t is f32[3], of @e f32[]"));
  EXPECT_THAT(parse_error(R"(func @f(%p: bool[], %x: f32[3]) -> f32[3] {
  %r = cond %p, %x : f32[3]
    then func @t(%a: f32[3]) -> f32[3] {
      return %a
    }
    else func @e(%a: f32[3]) -> (f32[3], f32[3]) {
      return %a, %a
    }
  return %r
}
)"),
              HasSubstr("the branches disagree: @t returns 1 values, @e 2"));
}

TEST(ControlErrors, BodyChangingTheStateShape) {
  EXPECT_THAT(parse_error(R"(func @f(%x: f32[3]) -> f32[3] {
  %r = while %x {state=1, max_iterations=-1} : f32[3]
    cond func @c(%a: f32[3]) -> bool[] {
      %t = constant dense<false> : bool[]
      return %t
    }
    body func @b(%a: f32[3]) -> f32[3,1] {
      %0 = reshape %a {shape=[3,1]} : f32[3,1]
      return %0
    }
  return %r
}
)"),
              HasSubstr("while_loop: result 0 of @b is f32[3,1], expected f32[3]"));
  EXPECT_THAT(parse_error(R"(func @f(%x: f32[3], %xs: f32[2,3]) -> f32[3] {
  %r = scan %x, %xs {carry=1, xs=1, length=2, reverse=false} : f32[3]
    body func @b(%a: f32[3], %t: f32[3]) -> f32[] {
      %0 = reduce_sum %a {axes=[0]} : f32[]
      return %0
    }
  return %r
}
)"),
              HasSubstr("scan: result 0 of @b is f32[], expected f32[3]"));
}

TEST(ControlErrors, PredicatesThatAreNotBoolScalars) {
  EXPECT_THAT(parse_error(R"(func @f(%p: bool[2], %x: f32[3]) -> f32[3] {
  %r = cond %p, %x : f32[3]
    then func @t(%a: f32[3]) -> f32[3] {
      return %a
    }
    else func @e(%a: f32[3]) -> f32[3] {
      return %a
    }
  return %r
}
)"),
              HasSubstr("cond: the predicate is bool[2], expected bool[] (a scalar)"));
  EXPECT_THAT(parse_error(R"(func @f(%p: f32[], %x: f32[3]) -> f32[3] {
  %r = cond %p, %x : f32[3]
    then func @t(%a: f32[3]) -> f32[3] {
      return %a
    }
    else func @e(%a: f32[3]) -> f32[3] {
      return %a
    }
  return %r
}
)"),
              HasSubstr("cond: the predicate is f32[], expected bool[] (a scalar)"));
  EXPECT_THAT(parse_error(R"(func @f(%x: f32[3]) -> f32[3] {
  %r = while %x {state=1, max_iterations=-1} : f32[3]
    cond func @c(%a: f32[3]) -> f32[] {
      %0 = reduce_sum %a {axes=[0]} : f32[]
      return %0
    }
    body func @b(%a: f32[3]) -> f32[3] {
      return %a
    }
  return %r
}
)"),
              HasSubstr("while_loop: @c returns f32[], expected bool[] (a scalar)"));
}

TEST(ControlErrors, XsOfTheWrongLength) {
  EXPECT_THAT(parse_error(R"(func @f(%x: f32[3], %xs: f32[5,3]) -> f32[3] {
  %r = scan %x, %xs {carry=1, xs=1, length=4, reverse=false} : f32[3]
    body func @b(%a: f32[3], %t: f32[3]) -> f32[3] {
      return %a
    }
  return %r
}
)"),
              HasSubstr("scan: xs 0 is f32[5,3], expected a leading axis of length 4"));
}

TEST(ControlErrors, MissingRegionKeyword) {
  EXPECT_THAT(parse_error(R"(func @f(%p: bool[], %x: f32[3]) -> f32[3] {
  %r = cond %p, %x : f32[3]
    then func @t(%a: f32[3]) -> f32[3] {
      return %a
    }
    func @e(%a: f32[3]) -> f32[3] {
      return %a
    }
  return %r
}
)"),
              HasSubstr("expected the 'else' region of cond"));
  EXPECT_THAT(parse_error(R"(func @f(%x: f32[3]) -> f32[3] {
  %r = while %x {state=1, max_iterations=-1} : f32[3]
  return %r
}
)"),
              HasSubstr("expected the 'cond' region of while"));
}

TEST(ControlErrors, ARegionHeldByTwoInstructions) {
  Scoped s;
  Mod m(kCond);
  ASSERT_NE(m.m, nullptr);
  ir_func *f = m.f("f");
  // a second cond with the same regions
  ir_instr c = *first(f, OP_COND);
  ir_value in[3] = {0, 1, 2};
  ir_value v = ir_append(f, OP_COND, &c.attrs, 3, in, ir_loc{nullptr, 0});
  ASSERT_GE(v, 0) << kiln_last_error();
  EXPECT_EQ(ir_verify(f), 0) << kiln_last_error(); // each instruction alone is fine
  EXPECT_EQ(ir_verify_module(m.m), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("a region must belong to one instruction, it belongs to 2"));
  // the pass manager refuses it too
  EXPECT_EQ(pass_run_pipeline(f, "dce", nullptr, nullptr, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("a region must belong to one instruction"));
}

// ---- passes through regions ----

TEST(ControlPasses, SimplifyCseAndDceWorkInsideBodies) {
  Scoped s;
  const char *text = R"(
func @f(%c0: f32[4], %xs: f32[3,4]) -> (f32[4], f32[3,4]) {
  %c, %ys = scan %c0, %xs {carry=1, xs=1, length=3, reverse=false} : f32[4], f32[3,4]
    body func @f.body(%c: f32[4], %x: f32[4]) -> (f32[4], f32[4]) {
      %one = constant dense<1.0> : f32[]
      %0 = mul %x, %one : f32[4]
      %1 = add %c, %0 : f32[4]
      %2 = add %c, %x : f32[4]
      %3 = tanh %2 : f32[4]
      %4 = tanh %1 : f32[4]
      %dead = exp %x : f32[4]
      return %3, %4
    }
  return %c, %ys
}
)";
  kiln_tensor *c0 = f32({1, -1, 0.5f, 2}), *xs = f32({3, 4}, {0.1f, 0.2f, 0.3f, 0.4f, -1, -2, -3, -4, 5, 6, 7, 8});
  std::string out = check_pipeline(text, "f", "simplify,cse,dce", {c0, xs});
  // x * 1 goes, the two adds and the two tanhs merge, the dead exp goes
  EXPECT_THAT(out, Not(HasSubstr("mul")));
  EXPECT_THAT(out, Not(HasSubstr("exp")));
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "simplify,cse,dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *body = first(m.f("f"), OP_SCAN)->attrs.callee;
  EXPECT_EQ(count(body, OP_ADD), 1);
  EXPECT_EQ(count(body, OP_TANH), 1);
  EXPECT_EQ(body->n_instrs, 2) << out;
}

TEST(ControlPasses, SimplifyForwardsWhatControlFlowPassesThrough) {
  Scoped s;
  // the cond's first result is %x either way; the while never changes %k;
  // the scan returns its carry %d as it came
  const char *text = R"(
func @f(%p: bool[], %x: f32[2], %k: f32[2], %xs: f32[3,2]) -> (f32[2], f32[2], f32[2], f32[2], f32[2]) {
  %r, %q = cond %p, %x, %k : f32[2], f32[2]
    then func @f.then(%a: f32[2], %b: f32[2]) -> (f32[2], f32[2]) {
      return %a, %b
    }
    else func @f.else(%a: f32[2], %b: f32[2]) -> (f32[2], f32[2]) {
      %0 = neg %b : f32[2]
      return %a, %0
    }
  %z = constant dense<3> : i32[]
  %i, %s, %kk = while %z, %x, %k {state=3, max_iterations=-1} : i32[], f32[2], f32[2]
    cond func @f.cond(%i: i32[], %s: f32[2], %k: f32[2]) -> bool[] {
      %0 = constant dense<0> : i32[]
      %1 = gt %i, %0 : bool[]
      return %1
    }
    body func @f.body(%i: i32[], %s: f32[2], %k: f32[2]) -> (i32[], f32[2], f32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %1 = add %s, %k : f32[2]
      return %0, %1, %k
    }
  %c, %d, %ys = scan %x, %k, %xs {carry=2, xs=1, length=3, reverse=false} : f32[2], f32[2], f32[3,2]
    body func @f.scan(%c: f32[2], %d: f32[2], %t: f32[2]) -> (f32[2], f32[2], f32[2]) {
      %0 = add %c, %t : f32[2]
      return %0, %d, %c
    }
  return %r, %q, %s, %kk, %d
}
)";
  kiln_tensor *x = f32({1, 2}), *k = f32({-1, 0.5f}), *xs = f32({3, 2}, {1, 2, 3, 4, 5, 6});
  for (bool p : {true, false}) {
    std::string out = check_pipeline(text, "f", "simplify", {b1(p), x, k, xs});
    EXPECT_THAT(out, HasSubstr("return %x, %q, %s, %k, %k"));
  }
  std::string out = check_pipeline(text, "f", "simplify,dce", {b1(true), x, k, xs});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "simplify,dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(first(m.f("f"), OP_COND)->n_out, 1) << out;
  EXPECT_EQ(first(m.f("f"), OP_WHILE)->n_out, 3) << out; // %k is still read by the body: it stays
  EXPECT_EQ(count(m.f("f"), OP_SCAN), 0) << out;          // %c, %ys, %d: nothing read any more
}

TEST(ControlPasses, FoldTurnsLoopsThatNeverRunIntoTheirInitialState) {
  Scoped s;
  const char *text = R"(
func @f(%x: f32[2], %xs: f32[0,2], %n: i32[]) -> (f32[2], f32[0,2], i32[], f32[2], f32[2]) {
  %c, %ys = scan %x, %xs {carry=1, xs=1, length=0, reverse=false} : f32[2], f32[0,2]
    body func @f.scan(%c: f32[2], %t: f32[2]) -> (f32[2], f32[2]) {
      %0 = add %c, %t : f32[2]
      return %0, %0
    }
  %i, %s = while %n, %x {state=2, max_iterations=0} : i32[], f32[2]
    cond func @f.c1(%i: i32[], %s: f32[2]) -> bool[] {
      %t = constant dense<true> : bool[]
      return %t
    }
    body func @f.b1(%i: i32[], %s: f32[2]) -> (i32[], f32[2]) {
      %0 = neg %s : f32[2]
      return %i, %0
    }
  %j, %u = while %n, %x {state=2, max_iterations=-1} : i32[], f32[2]
    cond func @f.c2(%i: i32[], %s: f32[2]) -> bool[] {
      %f = constant dense<false> : bool[]
      return %f
    }
    body func @f.b2(%i: i32[], %s: f32[2]) -> (i32[], f32[2]) {
      %0 = neg %s : f32[2]
      return %i, %0
    }
  return %c, %ys, %i, %s, %u
}
)";
  std::string out = check_pipeline(text, "f", "fold", {f32({1, 2}), f32({0, 2}, {}), i32s(4)});
  EXPECT_THAT(out, Not(HasSubstr("scan")));
  EXPECT_THAT(out, Not(HasSubstr("while")));
  EXPECT_THAT(out, HasSubstr("return %x, %ys, %n, %x, %x"));
}

TEST(ControlPasses, CseMergesTheSamePureControlFlow) {
  Scoped s;
  const char *text = R"(
func @f(%p: bool[], %x: f32[3]) -> (f32[3], f32[3]) {
  %a = cond %p, %x : f32[3]
    then func @t1(%a: f32[3]) -> f32[3] {
      %0 = neg %a : f32[3]
      return %0
    }
    else func @e1(%a: f32[3]) -> f32[3] {
      return %a
    }
  %b = cond %p, %x : f32[3]
    then func @t2(%a: f32[3]) -> f32[3] {
      %0 = neg %a : f32[3]
      return %0
    }
    else func @e2(%a: f32[3]) -> f32[3] {
      return %a
    }
  return %a, %b
}
)";
  check_pipeline(text, "f", "cse", {b1(true), f32({1, 2, 3})});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "cse", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(count(m.f("f"), OP_COND), 1); // the same pure branches (control_passes_test.cc)
}

// a constant predicate: the cond becomes its branch, the while inside it
// moves with it (its regions are held once)
const char *kFoldCond = R"(
func @f(%x: f32[3], %n: i32[]) -> (f32[3], f32[3]) {
  %t = constant dense<true> : bool[]
  %f = constant dense<false> : bool[]
  %r = cond %t, %x, %n : f32[3]
    then func @f.then(%a: f32[3], %m: i32[]) -> f32[3] {
      %i, %s = while %m, %a {state=2, max_iterations=-1} : i32[], f32[3]
        cond func @f.w.cond(%j: i32[], %c: f32[3]) -> bool[] {
          %z = constant dense<0> : i32[]
          %0 = gt %j, %z : bool[]
          return %0
        }
        body func @f.w.body(%j: i32[], %c: f32[3]) -> (i32[], f32[3]) {
          %one = constant dense<1> : i32[]
          %0 = sub %j, %one : i32[]
          %1 = add %c, %c : f32[3]
          return %0, %1
        }
      return %s
    }
    else func @f.else(%a: f32[3], %m: i32[]) -> f32[3] {
      %0 = neg %a : f32[3]
      return %0
    }
  %q = cond %f, %x, %n : f32[3]
    then func @g.then(%a: f32[3], %m: i32[]) -> f32[3] {
      return %a
    }
    else func @g.else(%a: f32[3], %m: i32[]) -> f32[3] {
      %k = constant dense<[1.0, 2.0, 3.0]> : f32[3]
      %0 = mul %k, %k : f32[3]
      %1 = add %a, %0 : f32[3]
      return %1
    }
  return %r, %q
}
)";

TEST(ControlPasses, FoldReplacesACondOnAConstantPredicateByItsBranch) {
  Scoped s;
  std::string out = check_pipeline(kFoldCond, "f", "fold", {f32({1, 2, 3}), i32s(3)});
  EXPECT_THAT(out, Not(HasSubstr("cond %")));
  EXPECT_THAT(out, HasSubstr("while"));
  // the else branch's constant work folded as it came in
  EXPECT_THAT(out, HasSubstr("constant dense<[1, 4, 9]>"));
  Mod m(kFoldCond);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "fold", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(count(m.f("f"), OP_COND), 0);
  const ir_instr *w = first(m.f("f"), OP_WHILE);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->attrs.callee2, m.f("f.w.body")); // moved, not copied
  EXPECT_EQ(m.f("f.then")->n_instrs, 0);         // the old branch is emptied
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
}

TEST(ControlPasses, DceDropsUnusedScanYsAndTheWorkOnlyTheyNeeded) {
  Scoped s;
  const char *text = R"(
func @f(%c0: f32[2], %xs: f32[3,2], %w: f32[2]) -> (f32[2], f32[3,2]) {
  %c, %y1, %y2 = scan %c0, %xs, %w {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2], f32[3,2]
    body func @f.body(%c: f32[2], %x: f32[2], %w: f32[2]) -> (f32[2], f32[2], f32[2]) {
      %0 = add %c, %x : f32[2]
      %1 = mul %x, %w : f32[2]
      %2 = exp %1 : f32[2]
      %3 = neg %0 : f32[2]
      return %0, %2, %3
    }
  return %c, %y2
}
)";
  std::string out = check_pipeline(text, "f", "dce", {f32({1, 2}), f32({3, 2}, {1, 2, 3, 4, 5, 6}), f32({2, 3})});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_instr *sc = first(m.f("f"), OP_SCAN);
  ASSERT_NE(sc, nullptr);
  EXPECT_EQ(sc->n_out, 2);        // c and y2
  EXPECT_EQ(sc->n_in, 2);         // %w was read only for y1: the capture goes
  const ir_func *body = sc->attrs.callee;
  EXPECT_EQ(body->n_results, 2);
  EXPECT_EQ(body->n_params, 2);
  EXPECT_EQ(count(body, OP_EXP), 0);
  EXPECT_EQ(count(body, OP_MUL), 0);
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
  EXPECT_THAT(out, HasSubstr("%c, %y2 = scan %c0, %xs {carry=1, xs=1, length=3, reverse=false}"));
}

TEST(ControlPasses, DceDropsUnusedCondResultsFromBothBranchesAndUnusedOperands) {
  Scoped s;
  const char *text = R"(
func @f(%p: bool[], %x: f32[3], %y: f32[3]) -> f32[3] {
  %r, %s = cond %p, %x, %y : f32[3], f32[3]
    then func @f.then(%a: f32[3], %b: f32[3]) -> (f32[3], f32[3]) {
      %0 = neg %a : f32[3]
      %1 = exp %b : f32[3]
      return %0, %1
    }
    else func @f.else(%a: f32[3], %b: f32[3]) -> (f32[3], f32[3]) {
      %0 = abs %b : f32[3]
      return %a, %0
    }
  return %r
}
)";
  check_pipeline(text, "f", "dce", {b1(true), f32({1, -2, 3}), f32({4, 5, 6})});
  check_pipeline(text, "f", "dce", {b1(false), f32({1, -2, 3}), f32({4, 5, 6})});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_instr *c = first(m.f("f"), OP_COND);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->n_out, 1);
  EXPECT_EQ(c->n_in, 2); // %y was read only for %s
  EXPECT_EQ(c->attrs.callee->n_instrs, 1);
  EXPECT_EQ(c->attrs.callee2->n_instrs, 0);
  EXPECT_EQ(c->attrs.callee2->n_params, 1);
}

TEST(ControlPasses, DceDropsCapturesNoWhileRegionReads) {
  Scoped s;
  const char *text = R"(
func @f(%n: i32[], %x: f32[2], %u: f32[2], %v: f32[2]) -> f32[2] {
  %e = exp %v : f32[2]
  %i, %s = while %n, %x, %u, %e {state=2, max_iterations=-1} : i32[], f32[2]
    cond func @f.cond(%i: i32[], %s: f32[2], %u: f32[2], %e: f32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @f.body(%i: i32[], %s: f32[2], %u: f32[2], %e: f32[2]) -> (i32[], f32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %1 = add %s, %u : f32[2]
      return %0, %1
    }
  return %s
}
)";
  check_pipeline(text, "f", "dce", {i32s(4), f32({1, 2}), f32({0.5f, 0.25f}), f32({1, 1})});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_instr *w = first(m.f("f"), OP_WHILE);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->n_in, 3); // %e went, and with it the exp that made it
  EXPECT_EQ(count(m.f("f"), OP_EXP), 0);
  EXPECT_EQ(w->attrs.callee->n_params, 3);
  EXPECT_EQ(w->attrs.callee2->n_params, 3);
  EXPECT_EQ(w->n_out, 2); // the loop state stays
}

// while state: %i (the cond reads it) stays; %acc (used after the loop)
// stays, and %t with it (the body reads %t for %acc); %junk (used by
// nobody, not read for anything kept) goes. A scan carry nobody needs goes.
const char *kDeadState = R"(
func @f(%n: i32[], %x: f32[2], %xs: f32[3,2]) -> (f32[2], f32[3,2]) {
  %i, %acc, %t, %junk = while %n, %x, %x, %x {state=4, max_iterations=-1} : i32[], f32[2], f32[2], f32[2]
    cond func @f.cond(%i: i32[], %acc: f32[2], %t: f32[2], %junk: f32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @f.body(%i: i32[], %acc: f32[2], %t: f32[2], %junk: f32[2]) -> (i32[], f32[2], f32[2], f32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %1 = add %acc, %t : f32[2]
      %2 = sin %t : f32[2]
      %3 = mul %junk, %acc : f32[2]
      %4 = exp %3 : f32[2]
      return %0, %1, %2, %4
    }
  %c, %d, %ys = scan %x, %x, %xs {carry=2, xs=1, length=3, reverse=false} : f32[2], f32[2], f32[3,2]
    body func @f.scan(%c: f32[2], %d: f32[2], %r: f32[2]) -> (f32[2], f32[2], f32[2]) {
      %0 = add %c, %r : f32[2]
      %1 = mul %d, %c : f32[2]
      %2 = neg %c : f32[2]
      return %0, %1, %2
    }
  return %acc, %ys
}
)";

TEST(ControlPasses, DceDropsLoopStateNothingNeeds) {
  Scoped s;
  check_pipeline(kDeadState, "f", "dce", {i32s(3), f32({0.5f, -1}), f32({3, 2}, {1, 2, 3, 4, 5, 6})});
  Mod m(kDeadState);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_instr *w = first(m.f("f"), OP_WHILE);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->attrs.n_state, 3);
  EXPECT_EQ(w->n_out, 3);
  EXPECT_EQ(w->n_in, 3);
  EXPECT_EQ(w->attrs.callee->n_params, 3);
  EXPECT_EQ(w->attrs.callee2->n_params, 3);
  EXPECT_EQ(count(w->attrs.callee2, OP_EXP), 0);
  EXPECT_EQ(count(w->attrs.callee2, OP_SIN), 1);
  const ir_instr *sc = first(m.f("f"), OP_SCAN);
  ASSERT_NE(sc, nullptr);
  EXPECT_EQ(sc->attrs.n_state, 1); // %d goes; %c stays (the ys read it)
  EXPECT_EQ(sc->n_out, 2);
  EXPECT_EQ(count(sc->attrs.callee, OP_MUL), 0);
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
}

TEST(ControlPasses, ControlFlowIsPureExactlyWhenItsRegionsAre) {
  Scoped s;
  const char *text = R"(
func @f(%x: f32[2], %xs: f32[3,2]) -> f32[2] {
  %c, %ys = scan %x, %xs {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.pure(%c: f32[2], %t: f32[2]) -> (f32[2], f32[2]) {
      %0 = add %c, %t : f32[2]
      return %0, %0
    }
  %d, %zs = scan %x, %xs {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.rand(%c: f32[2], %t: f32[2]) -> (f32[2], f32[2]) {
      %u = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=global, counter=global} : f32[2]
      %0 = add %c, %u : f32[2]
      return %0, %0
    }
  %e, %ws = scan %x, %xs {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.rand2(%c: f32[2], %t: f32[2]) -> (f32[2], f32[2]) {
      %u = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=global, counter=global} : f32[2]
      %0 = add %c, %u : f32[2]
      return %0, %0
    }
  return %x
}
)";
  Mod m(text);
  ASSERT_NE(m.m, nullptr);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "cse,dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  // the pure scan goes; the two drawing ones stay, both (never merged)
  EXPECT_EQ(count(m.f("f"), OP_SCAN), 2);
  for (int i = 0; i < m.f("f")->n_instrs; i++)
    EXPECT_NE(m.f("f")->instrs[i].attrs.callee, m.f("f.pure"));
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
}

// a host callback that counts its calls and returns its input
int count_calls(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  ++*(int *)user;
  out[0] = kiln_identity(in[0]);
  return out[0] ? 0 : -1;
}

TEST(ControlPasses, AHostCallInsideABodyKeepsTheLoop) {
  Scoped s;
  Mod m(R"(
func @f(%x: f32[2], %xs: f32[3,2]) -> f32[2] {
  %c, %ys = scan %x, %xs {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.body(%c: f32[2], %t: f32[2]) -> (f32[2], f32[2]) {
      %e = exp %t : f32[2]
      %h = host_call @kiln_test_no_such_symbol(%c) : f32[2]
      %0 = add %h, %t : f32[2]
      return %0, %e
    }
  %d, %zs = scan %x, %xs {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.body2(%c: f32[2], %t: f32[2]) -> (f32[2], f32[2]) {
      %e = exp %t : f32[2]
      %h = host_call @kiln_test_no_such_symbol(%c) : f32[2]
      %0 = add %h, %t : f32[2]
      return %0, %e
    }
  return %x
}
)");
  ASSERT_NE(m.m, nullptr);
  int calls = 0;
  for (int i = 0; i < m.m->n_hosts; i++) {
    m.m->hosts[i]->fn = count_calls;
    m.m->hosts[i]->user = &calls;
  }
  ASSERT_EQ(pass_run_pipeline(m.f("f"), PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << kiln_last_error();
  // nothing reads the scans, but their bodies call back: both stay (never
  // merged), without their unused ys
  const ir_func *f = m.f("f");
  EXPECT_EQ(count(f, OP_SCAN), 2) << m.text();
  for (int i = 0; i < f->n_instrs; i++)
    if (f->instrs[i].op == OP_SCAN) {
      EXPECT_EQ(f->instrs[i].n_out, 1);
      EXPECT_EQ(count(f->instrs[i].attrs.callee, OP_EXP), 0);
    }
  run(f, {f32({1, 2}), f32({3, 2}, {1, 2, 3, 4, 5, 6})});
  EXPECT_EQ(calls, 6); // 3 steps, 2 scans
}

const char *kLicm = R"(
func @f(%n: i32[], %s0: f32[4], %a: f32[4], %b: f32[]) -> (i32[], f32[4]) {
  %i, %s = while %n, %s0, %a, %b {state=2, max_iterations=-1} : i32[], f32[4]
    cond func @f.cond(%i: i32[], %s: f32[4], %a: f32[4], %b: f32[]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @f.body(%i: i32[], %s: f32[4], %a: f32[4], %b: f32[]) -> (i32[], f32[4]) {
      %one = constant dense<1> : i32[]
      %half = constant dense<[0.5, 0.5, 0.5, 0.5]> : f32[4]
      %0 = sub %i, %one : i32[]
      %inv = exp %a : f32[4]
      %inv2 = mul %inv, %half : f32[4]
      %big = broadcast %b {shape=[4]} : f32[4]
      %1 = mul %s, %inv2 : f32[4]
      %2 = add %1, %big : f32[4]
      return %0, %2
    }
  return %i, %s
}
)";

TEST(ControlPasses, LicmMovesInvariantWorkOutOfAWhileBody) {
  Scoped s;
  std::string out = check_pipeline(kLicm, "f", "licm",
                                    {i32s(3), f32({1, 2, 3, 4}), f32({0, 0.5f, -1, 1}), f32({}, {0.25f})});
  Mod m(kLicm);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *f = m.f("f");
  // exp a and its product with the constant move out (the constant with them);
  // the broadcast stays (larger than its operand), so does what reads the state
  EXPECT_EQ(count(f, OP_EXP), 1);
  EXPECT_EQ(count(f, OP_MUL), 1);
  const ir_instr *w = first(f, OP_WHILE);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->n_in, 5); // one new capture: the product
  const ir_func *body = w->attrs.callee2;
  EXPECT_EQ(count(body, OP_EXP), 0);
  EXPECT_EQ(count(body, OP_BROADCAST), 1);
  EXPECT_EQ(count(body, OP_MUL), 1);
  EXPECT_EQ(body->n_params, 5);
  EXPECT_EQ(w->attrs.callee->n_params, 5);
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
  // dce then drops the capture %a nothing reads any more
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(first(m.f("f"), OP_WHILE)->n_in, 4);
  check_pipeline(kLicm, "f", "licm,cse,dce", {i32s(3), f32({1, 2, 3, 4}), f32({0, 0.5f, -1, 1}), f32({}, {0.25f})});
}

TEST(ControlPasses, LicmMovesInvariantWorkOutOfAWhileCondRegion) {
  Scoped s;
  // Newton-like: loop while |s|^2 > tol^2, tol a capture
  const char *text = R"(
func @f(%s0: f32[2], %tol: f32[], %k: f32[]) -> f32[2] {
  %s = while %s0, %tol, %k {state=1, max_iterations=50} : f32[2]
    cond func @f.cond(%s: f32[2], %tol: f32[], %k: f32[]) -> bool[] {
      %0 = mul %s, %s : f32[2]
      %1 = reduce_sum %0 {axes=[0], keepdims=false} : f32[]
      %t2 = mul %tol, %tol : f32[]
      %2 = gt %1, %t2 : bool[]
      return %2
    }
    body func @f.body(%s: f32[2], %tol: f32[], %k: f32[]) -> f32[2] {
      %h = sigmoid %k : f32[]
      %0 = mul %s, %h : f32[2]
      return %0
    }
  return %s
}
)";
  std::string out = check_pipeline(text, "f", "licm", {f32({3, -4}), f32({}, {0.01f}), f32({}, {0.5f})});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm,dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *f = m.f("f");
  EXPECT_EQ(count(f, OP_MUL), 1) << out;     // tol * tol
  EXPECT_EQ(count(f, OP_SIGMOID), 1) << out; // sigmoid k
  const ir_instr *w = first(f, OP_WHILE);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(count(w->attrs.callee, OP_MUL), 1) << out; // s * s stays
  EXPECT_EQ(count(w->attrs.callee2, OP_SIGMOID), 0) << out;
  EXPECT_EQ(w->n_in, 3) << out; // s, then the two new captures; tol and k went
  check_pipeline(text, "f", PASS_DEFAULT_PIPELINE, {f32({3, -4}), f32({}, {0.01f}), f32({}, {0.5f})});
}

TEST(ControlPasses, LicmEmptiesNestedLoopsFromTheInsideOut) {
  Scoped s;
  const char *text = R"(
func @f(%c0: f32[2], %xs: f32[3,2], %w: f32[2]) -> (f32[2], f32[3,2]) {
  %c, %ys = scan %c0, %xs, %w {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.outer(%c: f32[2], %x: f32[2], %w: f32[2]) -> (f32[2], f32[2]) {
      %d, %zs = scan %c, %xs_unused_never, %w {carry=1, xs=0, length=2, reverse=false} : f32[2], f32[2,2]
        body func @f.inner(%d: f32[2], %v: f32[2]) -> (f32[2], f32[2]) {
          %0 = sin %v : f32[2]
          %1 = add %d, %0 : f32[2]
          return %1, %0
        }
      %2 = add %d, %x : f32[2]
      return %2, %d
    }
  return %c, %ys
}
)";
  // (the inner scan has no xs: fix the operand list)
  std::string t = text;
  t.replace(t.find("%c, %xs_unused_never, %w"), strlen("%c, %xs_unused_never, %w"), "%c, %w");
  kiln_tensor *c0 = f32({1, 2}), *xs = f32({3, 2}, {1, 2, 3, 4, 5, 6}), *w = f32({0.5f, 1.5f});
  std::string out = check_pipeline(t, "f", "licm", {c0, xs, w});
  Mod m(t);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  // sin w moved out of the inner scan into the outer body, then out of it
  EXPECT_EQ(count(m.f("f"), OP_SIN), 1) << out;
  const ir_instr *outer = first(m.f("f"), OP_SCAN);
  const ir_instr *inner = first(outer->attrs.callee, OP_SCAN);
  ASSERT_NE(inner, nullptr);
  EXPECT_EQ(count(outer->attrs.callee, OP_SIN), 0);
  EXPECT_EQ(count(inner->attrs.callee, OP_SIN), 0);
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
}

TEST(ControlPasses, LicmLeavesWorkOnTheStateOrXsInside) {
  Scoped s;
  Mod m(scan_text(3, false));
  ASSERT_NE(m.m, nullptr);
  std::string before = m.text();
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(m.text(), before);
}

TEST(ControlPasses, FuseGroupsAScanBodyButNeverTheScanItself) {
  Scoped s;
  const char *text = R"(
func @f(%c0: f32[64], %xs: f32[5,64], %b: f32[64]) -> (f32[64], f32[64]) {
  %pre = mul %c0, %c0 : f32[64]
  %c, %ys = scan %pre, %xs, %b {carry=1, xs=1, length=5, reverse=false} : f32[64], f32[5,64]
    body func @f.body(%c: f32[64], %x: f32[64], %b: f32[64]) -> (f32[64], f32[64]) {
      %0 = mul %c, %x : f32[64]
      %1 = add %0, %b : f32[64]
      %2 = tanh %1 : f32[64]
      %3 = sub %2, %x : f32[64]
      return %2, %3
    }
  %post = neg %c : f32[64]
  %post2 = exp %post : f32[64]
  return %post2, %c
}
)";
  std::vector<float> xs(5 * 64), c0(64), b(64);
  for (size_t i = 0; i < xs.size(); i++) xs[i] = (float)((int)(i * 7 % 13) - 6) / 8;
  for (size_t i = 0; i < 64; i++) c0[i] = (float)i / 64, b[i] = (float)(i % 5) / 10;
  std::string out = check_pipeline(text, "f", "fuse,buffers", {f32(c0), f32({5, 64}, xs), f32(b)});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "fuse,buffers", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_instr *sc = first(m.f("f"), OP_SCAN);
  ASSERT_NE(sc, nullptr);
  const ir_func *body = sc->attrs.callee;
  EXPECT_EQ(count(body, OP_FUSION), 1) << out;
  EXPECT_EQ(body->n_instrs, 1) << out;
  // outside: the neg and exp fuse with each other, not with the scan
  EXPECT_EQ(count(m.f("f"), OP_SCAN), 1);
  EXPECT_EQ(count(m.f("f"), OP_FUSION), 1);
  EXPECT_EQ(count(m.f("f"), OP_MUL), 1);
  // the body got its own plan (its fusion writes the returned values: none
  // planned), the function its own
  EXPECT_NE(m.f("f")->buf_offset, nullptr);
}

TEST(ControlPasses, BuffersPlanEachRegionAndThePoisonedReplayAgrees) {
  Scoped s;
  // temporaries inside the body that live across others
  const char *text = R"(
func @f(%c0: f32[16], %xs: f32[4,16]) -> (f32[16], f32[4,16]) {
  %c, %ys = scan %c0, %xs {carry=1, xs=1, length=4, reverse=false} : f32[16], f32[4,16]
    body func @f.body(%c: f32[16], %x: f32[16]) -> (f32[16], f32[16]) {
      %0 = exp %x : f32[16]
      %1 = neg %c : f32[16]
      %2 = mul %0, %1 : f32[16]
      %3 = tanh %2 : f32[16]
      %4 = add %3, %0 : f32[16]
      %5 = sub %4, %1 : f32[16]
      return %5, %3
    }
  %r = neg %c : f32[16]
  return %r, %ys
}
)";
  std::vector<float> xs(64), c0(16);
  for (size_t i = 0; i < xs.size(); i++) xs[i] = (float)((int)(i % 9) - 4) / 4;
  for (size_t i = 0; i < 16; i++) c0[i] = (float)i / 16;
  check_pipeline(text, "f", "buffers", {f32(c0), f32({4, 16}, xs)});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "buffers", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *body = first(m.f("f"), OP_SCAN)->attrs.callee;
  ASSERT_NE(body->buf_offset, nullptr);
  pass_buffer_stats st;
  ASSERT_EQ(pass_buffer_stats_of(body, &st), 0) << kiln_last_error();
  EXPECT_GE(st.temporaries, 3);
  // the scan's own results are ordinary temporaries of @f (%c is, %ys is a result)
  ASSERT_NE(m.f("f")->buf_offset, nullptr);
  const ir_instr *sc = first(m.f("f"), OP_SCAN);
  EXPECT_GE(m.f("f")->buf_offset[sc->out], 0);
  EXPECT_EQ(m.f("f")->buf_offset[sc->out + 1], -1);
}

// a callee holding a while: each inlined copy gets its own regions
const char *kInline = R"(
func @g(%x: f32[2], %n: i32[]) -> f32[2] {
  %i, %s = while %n, %x {state=2, max_iterations=-1} : i32[], f32[2]
    cond func @g.cond(%i: i32[], %s: f32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @g.body(%i: i32[], %s: f32[2]) -> (i32[], f32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %1 = mul %s, %s : f32[2]
      return %0, %1
    }
  return %s
}

func @f(%x: f32[2], %n: i32[]) -> (f32[2], f32[2]) {
  %a = call @g(%x, %n) : f32[2]
  %b = call @g(%a, %n) : f32[2]
  return %a, %b
}
)";

TEST(ControlPasses, InlineCopiesTheRegionsOfACalleesWhile) {
  Scoped s;
  std::string out = check_pipeline(kInline, "f", "inline", {f32({1.5f, -0.5f}), i32s(2)});
  EXPECT_THAT(out, Not(HasSubstr("call")));
  Mod m(kInline);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "inline", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *f = m.f("f");
  ASSERT_EQ(count(f, OP_WHILE), 2);
  std::vector<const ir_func *> regions;
  for (int i = 0; i < f->n_instrs; i++)
    if (f->instrs[i].op == OP_WHILE) regions.push_back(f->instrs[i].attrs.callee), regions.push_back(f->instrs[i].attrs.callee2);
  for (size_t i = 0; i < regions.size(); i++) {
    EXPECT_TRUE(regions[i]->region);
    EXPECT_NE(regions[i], m.f("g.cond"));
    EXPECT_NE(regions[i], m.f("g.body"));
    for (size_t j = 0; j < i; j++) EXPECT_NE(regions[i], regions[j]);
  }
  // @g keeps its own, intact
  EXPECT_EQ(first(m.f("g"), OP_WHILE)->attrs.callee2, m.f("g.body"));
  EXPECT_EQ(m.f("g.body")->n_instrs, 3);
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
}

TEST(ControlPasses, InlineCountsTheRegionsOfACallee) {
  Scoped s;
  // @g has 1 instruction, its loop body 70: too big to inline
  std::string body;
  for (int i = 0; i < 70; i++)
    body += "      %" + std::to_string(i + 1) + " = add %" + (i ? std::to_string(i) : std::string("s")) + ", %s : f32[2]\n";
  std::string text = R"(
func @g(%x: f32[2], %n: i32[]) -> f32[2] {
  %i, %r = while %n, %x {state=2, max_iterations=3} : i32[], f32[2]
    cond func @g.cond(%i: i32[], %s: f32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @g.body(%i: i32[], %s: f32[2]) -> (i32[], f32[2]) {
)" + body + R"(      return %i, %70
    }
  return %r
}

func @f(%x: f32[2], %n: i32[]) -> f32[2] {
  %a = call @g(%x, %n) : f32[2]
  return %a
}
)";
  std::string out = check_pipeline(text, "f", "inline", {f32({0.5f, 1}), i32s(1)});
  EXPECT_THAT(out, HasSubstr("call @g"));
  // with a small body it is inlined
  std::string small = text;
  size_t a = small.find("      %1 = add"), b = small.find("      return %i, %70");
  small.replace(a, b - a, "      %70 = add %s, %s : f32[2]\n");
  std::string in = check_pipeline(small, "f", "inline", {f32({0.5f, 1}), i32s(1)});
  EXPECT_THAT(in, Not(HasSubstr("call @g")));
}

TEST(ControlPasses, CallsInsideRegionsAreInlined) {
  Scoped s;
  std::string out = check_pipeline(kNested, "f", "inline",
                                   {b1(true), f32({1, 0, -1}), i32s(2), f32({4, 3}, {1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1})});
  EXPECT_THAT(out, Not(HasSubstr("call @sq")));
}

TEST(ControlPasses, ThePipelineOnARegionItselfDoesNothing) {
  Scoped s;
  Mod m(kCond);
  ASSERT_NE(m.m, nullptr);
  std::string before = m.text();
  pass_report rep;
  EXPECT_EQ(pass_run_pipeline(m.f("f.then"), PASS_DEFAULT_PIPELINE, &rep, nullptr, nullptr), 0);
  EXPECT_EQ(rep.n, 0);
  EXPECT_EQ(m.text(), before);
}

TEST(ControlPasses, DefaultPipelineOnEveryExample) {
  Scoped s;
  kiln_tensor *xs = f32({4, 3}, {1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1});
  for (bool p : {true, false})
    check_pipeline(kNested, "f", PASS_DEFAULT_PIPELINE, {b1(p), f32({1, 0, -1}), i32s(3), xs});
  check_pipeline(kCond, "f", PASS_DEFAULT_PIPELINE, {b1(false), f32({1, 2, 3}), f32({4, 5, 6})});
  check_pipeline(while_text(-1), "f", PASS_DEFAULT_PIPELINE, {i32s(3), f32({1, 0}), f32({1, 1})});
  check_pipeline(while_text(2), "f", PASS_DEFAULT_PIPELINE, {i32s(9), f32({1, 0}), f32({1, 1})});
  for (bool r : {false, true})
    check_pipeline(scan_text(3, r), "f", PASS_DEFAULT_PIPELINE,
                   {f32({0, 1}), f32({3, 2}, {1, 2, 3, 4, 5, 6}), f32({}, {10})});
  check_pipeline(scan_text(0, false), "f", PASS_DEFAULT_PIPELINE, {f32({4, 5}), f32({0, 2}, {}), f32({}, {10})});
  check_pipeline(kFoldCond, "f", PASS_DEFAULT_PIPELINE, {f32({1, 2, 3}), i32s(3)});
  check_pipeline(kLicm, "f", PASS_DEFAULT_PIPELINE, {i32s(3), f32({1, 2, 3, 4}), f32({0, 0.5f, -1, 1}), f32({}, {0.25f})});
  check_pipeline(kInline, "f", PASS_DEFAULT_PIPELINE, {f32({1.5f, -0.5f}), i32s(2)});
}

// ---- random control-flow programs ----

// A random program over f32[4] values: elementwise chains around and inside
// a cond, a while (counting down an i32) and a scan (forward or reverse),
// nested at random, with captures of outer values, constant predicates now
// and then (fold), invariant work (licm), unused results (dce) and
// duplicated work (cse).
struct Gen {
  std::mt19937 rng;
  int next = 0, regions = 0;
  explicit Gen(unsigned seed) : rng(seed) {}
  int pick(int n) { return (int)(rng() % (unsigned)n); }
  std::string fresh() { return "%v" + std::to_string(next++); }
  std::string ind(int d) { return std::string((size_t)(2 + 6 * d), ' '); }

  // appends elementwise work over vals (f32[4] names) to out; returns a new value
  std::string elem(std::string &out, std::vector<std::string> &vals, int d) {
    static const char *un[] = {"neg", "tanh", "sin", "abs"};
    static const char *bin[] = {"add", "mul", "sub", "max"};
    std::string v = fresh();
    if (pick(3) == 0)
      out += ind(d) + v + " = " + un[pick(4)] + " " + vals[(size_t)pick((int)vals.size())] + " : f32[4]\n";
    else
      out += ind(d) + v + " = " + bin[pick(4)] + " " + vals[(size_t)pick((int)vals.size())] + ", " +
             vals[(size_t)pick((int)vals.size())] + " : f32[4]\n";
    vals.push_back(v);
    return v;
  }

  std::string params(const std::vector<std::string> &names, const std::vector<std::string> &types) {
    std::string s;
    for (size_t i = 0; i < names.size(); i++) s += (i ? ", " : "") + names[i] + ": " + types[i];
    return s;
  }

  // a control instruction reading vals; its results join vals
  void control(std::string &out, std::vector<std::string> &vals, int d) {
    std::string cap = vals[(size_t)pick((int)vals.size())], cap2 = vals[(size_t)pick((int)vals.size())];
    int kind = pick(3), id = regions++;
    std::string R = "@r" + std::to_string(id);
    if (kind == 0) { // cond
      std::string p = fresh(), r1 = fresh(), r2 = fresh();
      if (pick(3) == 0) {
        out += ind(d) + p + " = constant dense<" + (pick(2) ? "true" : "false") + "> : bool[]\n";
      } else {
        std::string s = fresh();
        out += ind(d) + s + " = reduce_sum " + cap + " {axes=[0]} : f32[]\n";
        std::string z = fresh();
        out += ind(d) + z + " = constant dense<0.0> : f32[]\n";
        out += ind(d) + p + " = gt " + s + ", " + z + " : bool[]\n";
      }
      out += ind(d) + r1 + ", " + r2 + " = cond " + p + ", " + cap + ", " + cap2 + " : f32[4], f32[4]\n";
      for (const char *role : {"then", "else"}) {
        out += ind(d) + "    " + role + " func " + R + "." + role + "(%a: f32[4], %b: f32[4]) -> (f32[4], f32[4]) {\n";
        std::vector<std::string> in = {"%a", "%b"};
        body(out, in, d + 1, 2);
      }
      vals.push_back(r1);
      vals.push_back(r2);
    } else if (kind == 1) { // while: i counts down from 3
      std::string n = fresh(), i = fresh(), s = fresh();
      out += ind(d) + n + " = constant dense<" + std::to_string(pick(4)) + "> : i32[]\n";
      out += ind(d) + i + ", " + s + " = while " + n + ", " + cap + ", " + cap2 + " {state=2, max_iterations=" +
             (pick(2) ? "-1" : "2") + "} : i32[], f32[4]\n";
      out += ind(d) + "    cond func " + R + ".cond(%i: i32[], %s: f32[4], %c: f32[4]) -> bool[] {\n";
      out += ind(d + 1) + "%z = constant dense<0> : i32[]\n";
      out += ind(d + 1) + "%0 = gt %i, %z : bool[]\n";
      out += ind(d + 1) + "return %0\n" + ind(d) + "    }\n";
      out += ind(d) + "    body func " + R + ".body(%i: i32[], %s: f32[4], %c: f32[4]) -> (i32[], f32[4]) {\n";
      out += ind(d + 1) + "%one = constant dense<1> : i32[]\n";
      out += ind(d + 1) + "%j = sub %i, %one : i32[]\n";
      std::vector<std::string> in = {"%s", "%c"};
      body(out, in, d + 1, 1, "%j, ");
      vals.push_back(s);
    } else { // scan over a stack of three rows
      std::string xs = fresh(), c = fresh(), ys = fresh();
      out += ind(d) + xs + " = broadcast " + cap2 + " {shape=[3,4]} : f32[3,4]\n";
      out += ind(d) + c + ", " + ys + " = scan " + cap + ", " + xs + ", " + cap2 + " {carry=1, xs=1, length=3" +
             (pick(2) ? ", reverse=true" : ", reverse=false") + "} : f32[4], f32[3,4]\n";
      out += ind(d) + "    body func " + R + ".body(%c: f32[4], %x: f32[4], %w: f32[4]) -> (f32[4], f32[4]) {\n";
      std::vector<std::string> in = {"%c", "%x", "%w"};
      body(out, in, d + 1, 2);
      vals.push_back(c);
      if (pick(2)) { // use a row of the ys
        std::string r = fresh(), q = fresh();
        out += ind(d) + r + " = slice " + ys + " {begin=[1,0], size=[1,4]} : f32[1,4]\n";
        out += ind(d) + q + " = reshape " + r + " {shape=[4]} : f32[4]\n";
        vals.push_back(q);
      }
    }
  }

  // a region's body (its header printed by the caller), returning n_res
  // values (prefix: results written before them)
  void body(std::string &out, std::vector<std::string> &vals, int d, int n_res, const std::string &prefix = "") {
    int n = 1 + pick(4);
    for (int k = 0; k < n; k++) {
      if (d < 3 && pick(4) == 0)
        control(out, vals, d);
      else
        elem(out, vals, d);
    }
    if (pick(2)) { // a duplicate (cse)
      std::string a = vals[(size_t)pick((int)vals.size())];
      std::string x = fresh(), y = fresh();
      out += ind(d) + x + " = tanh " + a + " : f32[4]\n" + ind(d) + y + " = tanh " + a + " : f32[4]\n";
      vals.push_back(x);
      vals.push_back(y);
    }
    out += ind(d) + "return " + prefix;
    for (int r = 0; r < n_res; r++) out += (r ? ", " : "") + vals[vals.size() - 1 - (size_t)pick(3 < (int)vals.size() ? 3 : (int)vals.size())];
    out += "\n" + ind(d - 1) + "    }\n";
  }

  std::string program() {
    std::string out = "func @f(%x: f32[4], %y: f32[4]) -> (f32[4], f32[4], f32[4]) {\n";
    std::vector<std::string> vals = {"%x", "%y"};
    int n = 2 + pick(3);
    std::string last_control;
    for (int k = 0; k < n; k++) {
      control(out, vals, 0);
      last_control = vals.back();
      elem(out, vals, 0);
    }
    out += "  return " + vals[vals.size() - 1] + ", " + vals[(size_t)pick((int)vals.size())] + ", " + last_control +
           "\n}\n";
    return out;
  }
};

TEST(ControlRandom, EveryPassAndTheDefaultPipelineKeepTheValues) {
  Scoped s;
  kiln_tensor *x = f32({0.5f, -1.25f, 2, 0.125f}), *y = f32({-0.75f, 1, 0.25f, -2});
  int checked = 0;
  for (unsigned seed = 1; seed <= 40; seed++) {
    Gen g(seed);
    std::string text = g.program();
    Mod probe(text);
    ASSERT_NE(probe.m, nullptr) << "seed " << seed << "\n" << text;
    for (const char *p : {"inline", "simplify", "fold", "licm", "cse", "dce", "fuse", "buffers", PASS_DEFAULT_PIPELINE,
                          "licm,cse,dce,licm,dce,fuse,buffers"}) {
      SCOPED_TRACE(std::string("seed ") + std::to_string(seed) + " pipeline " + p + "\n" + text);
      check_pipeline(text, "f", p, {x, y});
      checked++;
      if (HasFailure()) return;
    }
  }
  EXPECT_EQ(checked, 400);
}

// tests/ir_gen.cc with IR_GEN_CONTROL: every kind of control flow, nested,
// verified, the same text for the same seed, and the interpreter runs it
TEST(ControlRandom, TheGeneratorMakesControlFlow) {
  Scoped s;
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_CONTROL;
  int conds = 0, whiles = 0, scans = 0, nested = 0;
  for (uint64_t seed = 1; seed <= 200; seed++) {
    ir_module *m = ir_gen_program(seed, &o), *again = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << seed << ": " << kiln_last_error();
    ASSERT_NE(again, nullptr) << seed << ": " << kiln_last_error();
    char *t1 = ir_print_module(m), *t2 = ir_print_module(again);
    EXPECT_STREQ(t1, t2) << seed;
    ASSERT_EQ(ir_verify_module(m), 0) << seed << ": " << kiln_last_error() << "\n" << t1;
    Mod back(t1);
    EXPECT_EQ(back.text(), t1) << seed;
    free(t1);
    free(t2);
    for (int i = 0; i < m->n_funcs; i++) {
      const ir_func *g = m->funcs[i];
      for (int k = 0; k < g->n_instrs; k++) {
        conds += g->instrs[k].op == OP_COND;
        whiles += g->instrs[k].op == OP_WHILE;
        scans += g->instrs[k].op == OP_SCAN;
        nested += g->region && ir_op_info(g->instrs[k].op)->kind == OPK_CONTROL;
      }
    }
    const ir_func *f = ir_module_find(m, "gen");
    std::vector<kiln_tensor *> args((size_t)f->n_params + 1), res((size_t)f->n_results + 1);
    ASSERT_EQ(ir_gen_args(f, seed, args.data()), 0) << kiln_last_error();
    EXPECT_EQ(ir_interpret(f, args.data(), res.data()), 0) << seed << ": " << kiln_last_error();
    ir_module_free(m);
    ir_module_free(again);
  }
  EXPECT_GT(conds, 20);
  EXPECT_GT(whiles, 20);
  EXPECT_GT(scans, 20);
  EXPECT_GT(nested, 5);
}

}  // namespace
