// control_passes_test.cc — cse of whole control flow (cond, while, scan and
// calls whose regions or callees are pure and the same instruction for
// instruction) and licm out of the branches of conds (loop-invariant work
// of a cond in a loop body leaves the loop; work both branches do moves
// before the cond). Each program is checked against the interpreter on the
// unoptimized program (with and without KILN_POISON) and compiled by the CPU
// backend after the default pipeline; the negative cases (random draws,
// host calls, variables assigned in between, other attributes, gathers and
// integer divisions in branches) are checked to stay as they were.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu.h"
#include "ir.h"
#include "ir_test_util.h"
#include "passes.h"
#include "test_util.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace kiln_test;


// Runs pipeline on a copy of text: the module verifies, prints and reads
// back byte for byte, and computes the bits the unoptimized function does
// (interpreted, with and without KILN_POISON); then the default pipeline
// and the CPU backend agree with it too (to rounding). The optimized text.
std::string check(const std::string &text, const char *name, const char *pipeline, std::vector<kiln_tensor *> args) {
  Mod ref(text), opt(text), comp(text);
  if (!ref.m || !opt.m || !comp.m) return "";
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
    for (size_t r = 0; r < want.size() && r < got.size(); r++)
      EXPECT_TRUE(got[r] && want[r] && same_bits(got[r], want[r]))
          << pipeline << " result " << r << " KILN_POISON=" << poison << "\n" << printed;
  }
  EXPECT_EQ(pass_run_pipeline(comp.f(name), PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << kiln_last_error();
  cpu_program *c = cpu_compile(comp.f(name));
  EXPECT_NE(c, nullptr) << kiln_last_error();
  if (c) {
    EnvGuard g("KILN_POISON", "1");
    std::vector<kiln_tensor *> got(want.size() + 1, nullptr);
    EXPECT_EQ(cpu_run(c, args.data(), got.data()), 0) << kiln_last_error();
    for (size_t r = 0; r < want.size(); r++)
      EXPECT_TRUE(got[r] && want[r] && allclose(got[r], want[r], 1e-5, 1e-6)) << "compiled result " << r;
    cpu_program_free(c);
  }
  return opt.func_text(name);
}

// How many instructions of op f holds after pipeline (not counting regions').
int count_after(const std::string &text, const char *pipeline, op_id op, const char *name = "f") {
  Mod m(text);
  if (!m.m) return -1;
  EXPECT_EQ(pass_run_pipeline(m.f(name), pipeline, nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
  return count(m.f(name), op);
}

bool pass_is_control_op(op_id op) { return op == OP_COND || op == OP_WHILE || op == OP_SCAN; }

// The instructions (but constants) in the branches of every cond under f.
int in_branches(const ir_func *f, int depth = 0) {
  int n = 0;
  for (int i = 0; f && depth < 16 && i < f->n_instrs; i++) {
    const ir_instr &in = f->instrs[i];
    if (!pass_is_control_op(in.op)) continue;
    for (const ir_func *r : {in.attrs.callee, in.attrs.callee2}) {
      if (!r) continue;
      if (in.op == OP_COND)
        for (int k = 0; k < r->n_instrs; k++) n += r->instrs[k].op != OP_CONSTANT;
      n += in_branches(r, depth + 1);
    }
  }
  return n;
}

kiln_tensor *b1(bool v) {
  uint8_t x = v;
  return kiln_tensor_new(KILN_BOOL, 0, nullptr, &x);
}
kiln_tensor *i32s(int32_t v) { return i32({}, {v}); }

// Replaces the first occurrence of what in s by with.
std::string edit(std::string s, const std::string &what, const std::string &with) {
  size_t at = s.find(what);
  EXPECT_NE(at, std::string::npos) << what;
  if (at != std::string::npos) s.replace(at, what.size(), with);
  return s;
}

// ==== cse of whole control flow ====

// two conds traced separately: the same branches, other names
const char *kTwoConds = R"(
func @f(%p: bool[], %x: f32[3], %y: f32[3]) -> (f32[3], f32[3], f32[3]) {
  %a, %a2 = cond %p, %x, %y : f32[3], f32[3]
    then func @t1(%a: f32[3], %b: f32[3]) -> (f32[3], f32[3]) {
      %k = constant dense<[1.0, 2.0, 3.0]> : f32[3]
      %0 = mul %a, %k : f32[3]
      %1 = add %0, %b : f32[3]
      return %1, %0
    }
    else func @e1(%a: f32[3], %b: f32[3]) -> (f32[3], f32[3]) {
      %0 = neg %b : f32[3]
      return %a, %0
    }
  %b, %b2 = cond %p, %x, %y : f32[3], f32[3]
    then func @t2(%u: f32[3], %v: f32[3]) -> (f32[3], f32[3]) {
      %c = constant dense<[1.0, 2.0, 3.0]> : f32[3]
      %m = mul %u, %c : f32[3]
      %s = add %m, %v : f32[3]
      return %s, %m
    }
    else func @e2(%u: f32[3], %v: f32[3]) -> (f32[3], f32[3]) {
      %n = neg %v : f32[3]
      return %u, %n
    }
  %r = add %a2, %b2 : f32[3]
  return %a, %b, %r
}
)";

TEST(ControlCse, MergesTwoCondsWhoseBranchesAreTheSame) {
  Scoped s;
  for (bool p : {true, false}) {
    std::string out = check(kTwoConds, "f", "cse", {b1(p), f32({1, 2, 3}), f32({-1, 0.5f, 4})});
    EXPECT_THAT(out, HasSubstr("return %a, %a, %r")) << out;
    EXPECT_THAT(out, HasSubstr("%r = add %a2, %a2")) << out;
  }
  Mod m(kTwoConds);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "cse", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(count(m.f("f"), OP_COND), 1);
  EXPECT_EQ(first(m.f("f"), OP_COND)->attrs.callee, m.f("t1")); // the earlier one stays
  EXPECT_EQ(m.f("t2")->n_instrs, 0);                            // the later one's regions are emptied
  EXPECT_EQ(ir_verify_module(m.m), 0) << kiln_last_error();
}

TEST(ControlCse, CondsDifferingInAnyWayStayApart) {
  Scoped s;
  std::vector<kiln_tensor *> args = {b1(true), f32({1, 2, 3}), f32({-1, 0.5f, 4})};
  // another constant, another op, operands swapped, another result order,
  // other operands of the cond, another returned value
  const std::pair<const char *, const char *> edits[] = {
      {"%c = constant dense<[1.0, 2.0, 3.0]>", "%c = constant dense<[1.0, 2.0, 3.5]>"},
      {"%n = neg %v", "%n = abs %v"},
      {"%s = add %m, %v", "%s = add %v, %m"},
      {"return %s, %m", "return %m, %s"},
      {"%b, %b2 = cond %p, %x, %y", "%b, %b2 = cond %p, %y, %x"},
      {"return %u, %n", "return %v, %n"},
  };
  for (const auto &e : edits) {
    std::string t = edit(kTwoConds, e.first, e.second);
    SCOPED_TRACE(e.second);
    check(t, "f", "cse", args);
    EXPECT_EQ(count_after(t, "cse", OP_COND), 2);
  }
  // -0.0 and 0.0 are other constants
  std::string z = edit(edit(kTwoConds, "dense<[1.0, 2.0, 3.0]> : f32[3]\n      %0", "dense<[0.0, 2.0, 3.0]> : f32[3]\n      %0"),
                       "%c = constant dense<[1.0, 2.0, 3.0]>", "%c = constant dense<[-0.0, 2.0, 3.0]>");
  EXPECT_EQ(count_after(z, "cse", OP_COND), 2);
}

// two whiles and two scans, each pair the same, with a cond nested in the
// scans' bodies and a call of a pure function
const char *kLoops = R"(
func @sq(%a: f32[2]) -> f32[2] {
  %0 = mul %a, %a : f32[2]
  return %0
}

func @f(%n: i32[], %x: f32[2], %xs: f32[3,2], %w: f32[2]) -> (f32[2], f32[2], f32[2], f32[3,2], f32[2], f32[3,2]) {
  %i, %s = while %n, %x, %w {state=2, max_iterations=5} : i32[], f32[2]
    cond func @w1.cond(%i: i32[], %s: f32[2], %w: f32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @w1.body(%i: i32[], %s: f32[2], %w: f32[2]) -> (i32[], f32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %1 = mul %s, %w : f32[2]
      %2 = call @sq(%1) : f32[2]
      return %0, %2
    }
  %j, %t = while %n, %x, %w {state=2, max_iterations=5} : i32[], f32[2]
    cond func @w2.cond(%i: i32[], %s: f32[2], %w: f32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @w2.body(%i: i32[], %s: f32[2], %w: f32[2]) -> (i32[], f32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %1 = mul %s, %w : f32[2]
      %2 = call @sq(%1) : f32[2]
      return %0, %2
    }
  %c, %ys = scan %x, %xs, %w {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @s1.body(%c: f32[2], %r: f32[2], %w: f32[2]) -> (f32[2], f32[2]) {
      %z = constant dense<0.0> : f32[]
      %0 = reduce_sum %r {axes=[0]} : f32[]
      %p = gt %0, %z : bool[]
      %1 = cond %p, %c, %w : f32[2]
        then func @s1.then(%a: f32[2], %b: f32[2]) -> f32[2] {
          %0 = add %a, %b : f32[2]
          return %0
        }
        else func @s1.else(%a: f32[2], %b: f32[2]) -> f32[2] {
          %0 = sub %a, %b : f32[2]
          return %0
        }
      %2 = tanh %1 : f32[2]
      return %2, %1
    }
  %d, %zs = scan %x, %xs, %w {carry=1, xs=1, length=3, reverse=false} : f32[2], f32[3,2]
    body func @s2.body(%c: f32[2], %r: f32[2], %w: f32[2]) -> (f32[2], f32[2]) {
      %z = constant dense<0.0> : f32[]
      %0 = reduce_sum %r {axes=[0]} : f32[]
      %p = gt %0, %z : bool[]
      %1 = cond %p, %c, %w : f32[2]
        then func @s2.then(%a: f32[2], %b: f32[2]) -> f32[2] {
          %0 = add %a, %b : f32[2]
          return %0
        }
        else func @s2.else(%a: f32[2], %b: f32[2]) -> f32[2] {
          %0 = sub %a, %b : f32[2]
          return %0
        }
      %2 = tanh %1 : f32[2]
      return %2, %1
    }
  return %s, %t, %c, %ys, %d, %zs
}
)";

std::vector<kiln_tensor *> loop_args() {
  return {i32s(3), f32({0.5f, -1.25f}), f32({3, 2}, {1, 2, -3, -4, 5, -6}), f32({1.5f, 0.75f})};
}

TEST(ControlCse, MergesLoopsWithTheSameBodiesNestedRegionsAndCallsIncluded) {
  Scoped s;
  std::string out = check(kLoops, "f", "cse", loop_args());
  EXPECT_THAT(out, HasSubstr("return %s, %s, %c, %ys, %c, %ys")) << out;
  Mod m(kLoops);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "cse", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(count(m.f("f"), OP_WHILE), 1);
  EXPECT_EQ(count(m.f("f"), OP_SCAN), 1);
  EXPECT_EQ(m.f("s2.then")->n_instrs, 0); // the nested regions of the dropped scan are emptied too
  EXPECT_EQ(m.f("sq")->n_instrs, 1);       // the called function is not a region
  check(kLoops, "f", PASS_DEFAULT_PIPELINE, loop_args());
}

TEST(ControlCse, LoopsDifferingInAnAttributeOrANestedRegionStayApart) {
  Scoped s;
  struct Case {
    const char *what, *with;
    op_id op;
  } cases[] = {
      // the second while stops after 4 iterations, not 5
      {"%j, %t = while %n, %x, %w {state=2, max_iterations=5}", "%j, %t = while %n, %x, %w {state=2, max_iterations=4}",
       OP_WHILE},
      // the second scan runs from the end
      {"%d, %zs = scan %x, %xs, %w {carry=1, xs=1, length=3, reverse=false}",
       "%d, %zs = scan %x, %xs, %w {carry=1, xs=1, length=3, reverse=true}", OP_SCAN},
      // the second scan's nested cond subtracts the other way
      {"%0 = sub %a, %b : f32[2]\n          return %0\n        }\n      %2 = tanh %1 : f32[2]\n      return %2, %1\n    }\n  return",
       "%0 = sub %b, %a : f32[2]\n          return %0\n        }\n      %2 = tanh %1 : f32[2]\n      return %2, %1\n    }\n  return",
       OP_SCAN},
      // the second while's cond region compares with >=
      {"%0 = gt %i, %z : bool[]\n      return %0\n    }\n    body func @w2.body",
       "%0 = ge %i, %z : bool[]\n      return %0\n    }\n    body func @w2.body", OP_WHILE},
  };
  for (const Case &c : cases) {
    std::string t = edit(kLoops, c.what, c.with);
    SCOPED_TRACE(c.with);
    check(t, "f", "cse", loop_args());
    EXPECT_EQ(count_after(t, "cse", c.op), 2);
  }
}

TEST(ControlCse, ScansOfOtherLengthsOrCarryCountsStayApart) {
  Scoped s;
  // the same body; one scan has its x as a carry and no xs (xs=0,
  // length=3), the other has it as a capture
  const char *text = R"(
func @f(%x: f32[2]) -> (f32[2], f32[2]) {
  %a, %b = scan %x, %x {carry=2, xs=0, length=3, reverse=false} : f32[2], f32[2]
    body func @f.a(%c: f32[2], %d: f32[2]) -> (f32[2], f32[2]) {
      %0 = add %c, %d : f32[2]
      return %0, %d
    }
  %e, %g = scan %x, %x {carry=1, xs=0, length=3, reverse=false} : f32[2], f32[3,2]
    body func @f.b(%c: f32[2], %d: f32[2]) -> (f32[2], f32[2]) {
      %0 = add %c, %d : f32[2]
      return %0, %d
    }
  %h, %k = scan %x, %x {carry=1, xs=0, length=2, reverse=false} : f32[2], f32[2,2]
    body func @f.c(%c: f32[2], %d: f32[2]) -> (f32[2], f32[2]) {
      %0 = add %c, %d : f32[2]
      return %0, %d
    }
  %r = add %a, %e : f32[2]
  %q = add %r, %h : f32[2]
  return %q, %b
}
)";
  check(text, "f", "cse", {f32({1, -2})});
  EXPECT_EQ(count_after(text, "cse", OP_SCAN), 3);
}

// the two bodies draw (or call back): never merged, whatever they look like
TEST(ControlCse, BodiesThatDrawOrCallTheHostAreNeverMerged) {
  Scoped s;
  const char *draws = R"(
func @f(%p: bool[], %x: f32[2]) -> (f32[2], f32[2]) {
  %a = cond %p, %x : f32[2]
    then func @t1(%a: f32[2]) -> f32[2] {
      %u = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=global, counter=global} : f32[2]
      %0 = add %a, %u : f32[2]
      return %0
    }
    else func @e1(%a: f32[2]) -> f32[2] {
      return %a
    }
  %b = cond %p, %x : f32[2]
    then func @t2(%a: f32[2]) -> f32[2] {
      %u = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=global, counter=global} : f32[2]
      %0 = add %a, %u : f32[2]
      return %0
    }
    else func @e2(%a: f32[2]) -> f32[2] {
      return %a
    }
  return %a, %b
}
)";
  EXPECT_EQ(count_after(draws, "cse", OP_COND), 2);
  EXPECT_EQ(count_after(draws, PASS_DEFAULT_PIPELINE, OP_COND), 2);
  Mod m(draws);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << kiln_last_error();
  std::vector<kiln_tensor *> r = run(m.f("f"), {b1(true), f32({0, 0})});
  ASSERT_EQ(r.size(), 2u);
  EXPECT_NE(values(r[0]), values(r[1])) << "two draws";
  // fixed seeds and counters: the same numbers, still two draws by rule
  std::string fixed = draws;
  for (size_t at; (at = fixed.find("seed=global, counter=global")) != std::string::npos;)
    fixed.replace(at, strlen("seed=global, counter=global"), "seed=7, counter=0");
  EXPECT_EQ(count_after(fixed, "cse", OP_COND), 2);
  std::string host = draws;
  for (size_t at; (at = host.find("%u = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=global, counter=global} : f32[2]")) !=
                  std::string::npos;)
    host.replace(at, strlen("%u = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=global, counter=global} : f32[2]"),
                 "%u = host_call @kiln_test_no_such_symbol(%a) : f32[2]");
  EXPECT_EQ(count_after(host, "cse", OP_COND), 2);
}

TEST(ControlCse, CallsOfPureFunctionsMergeCallsOfDrawingOnesDoNot) {
  Scoped s;
  const char *text = R"(
func @sq(%a: f32[2]) -> (f32[2], f32[2]) {
  %0 = mul %a, %a : f32[2]
  %1 = neg %0 : f32[2]
  return %0, %1
}

func @sq2(%a: f32[2]) -> (f32[2], f32[2]) {
  %0 = mul %a, %a : f32[2]
  %1 = neg %0 : f32[2]
  return %0, %1
}

func @noise(%a: f32[2]) -> f32[2] {
  %u = rng_normal {dtype=f32, shape=[2], seed=global, counter=global} : f32[2]
  %0 = add %a, %u : f32[2]
  return %0
}

func @f(%x: f32[2]) -> (f32[2], f32[2], f32[2], f32[2], f32[2]) {
  %a, %b = call @sq(%x) : f32[2], f32[2]
  %c, %d = call @sq(%x) : f32[2], f32[2]
  %e, %g = call @sq2(%x) : f32[2], f32[2]
  %n = call @noise(%x) : f32[2]
  %o = call @noise(%x) : f32[2]
  return %b, %d, %g, %n, %o
}
)";
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "cse", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  std::string out = m.func_text("f");
  EXPECT_THAT(out, HasSubstr("return %b, %b, %b, %n, %o")) << out;
  EXPECT_EQ(count(m.f("f"), OP_CALL), 3) << out;
}

// ---- staged: traced bodies are separate regions, merged when the same ----

struct Staged {
  kiln_variable *v = nullptr;
  bool assign_between = false, draw = false;
};

int plus_v(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Staged *u = (Staged *)user;
  kiln_tensor *t = kiln_tanh(kiln_mul(in[0], in[1]));
  if (u->v) t = kiln_add(t, kiln_variable_read(u->v));
  static const int64_t two[1] = {2};
  if (u->draw) t = kiln_add(t, kiln_random_uniform(KILN_F32, 1, two, 0, 1));
  out[0] = t;
  return t ? 0 : -1;
}

int minus_x(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_sub(in[1], in[0]);
  return out[0] ? 0 : -1;
}

int two_conds(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  Staged *u = (Staged *)user;
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(in[0], 0, nullptr, false), kiln_scalar(KILN_F32, 0));
  kiln_tensor *args[2] = {in[0], in[1]};
  if (kiln_cond(p, plus_v, minus_x, user, 2, args, 1, &out[0])) return -1;
  if (u->assign_between && kiln_variable_assign_add(u->v, kiln_scalar(KILN_F32, 1))) return -1;
  return kiln_cond(p, plus_v, minus_x, user, 2, args, 1, &out[1]);
}

int count_text(const std::string &s, const std::string &what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}

// Stages two_conds with u, calls it on both backends; the optimized text.
std::string staged(Staged &u, kiln_tensor *out_cpu[2]) {
  kiln_tensor *in[2] = {f32({0.5f, 1}), f32({2, -1})};
  std::string text;
  for (const char *backend : {"cpu", "interp"}) {
    EnvGuard env("KILN_BACKEND", backend);
    if (u.v) { // as the other backend found it
      EXPECT_EQ(kiln_variable_assign(u.v, f32({0.25f, 0.25f})), 0);
    }
    kiln_function *f = kiln_function_new("two_conds", two_conds, &u, 2, 2);
    kiln_tensor *out[2] = {};
    EXPECT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
    if (!strcmp(backend, "cpu")) {
      char *t = kiln_function_ir(f, 0, "optimized");
      text = t ? t : "";
      free(t);
      out_cpu[0] = out[0], out_cpu[1] = out[1];
    } else if (!u.draw) {
      EXPECT_TRUE(allclose(out[0], out_cpu[0]) && allclose(out[1], out_cpu[1]));
    }
    kiln_function_free(f);
  }
  return text;
}

TEST(ControlCse, TracedCondsMergeUnlessAVariableChangesInBetweenOrTheyDraw) {
  Scoped s;
  Owned o;
  kiln_tensor *out[2] = {};
  Staged same;
  same.v = o.var(f32({0.25f, 0.25f}), "v");
  std::string t = staged(same, out);
  EXPECT_EQ(count_text(t, " = cond "), 1) << t;
  EXPECT_EQ(values(out[0]), values(out[1]));

  // v += 1 between: the second cond reads another value of v
  Staged assigned = same;
  assigned.assign_between = true;
  t = staged(assigned, out);
  EXPECT_EQ(count_text(t, " = cond "), 2) << t;
  VD a = values(out[0]), b = values(out[1]);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_NEAR(b[0] - a[0], 1.0, 1e-6);
  EXPECT_NEAR(b[1] - a[1], 1.0, 1e-6);

  Staged draws;
  draws.draw = true;
  t = staged(draws, out);
  EXPECT_EQ(count_text(t, " = cond "), 2) << t;
  EXPECT_NE(values(out[0]), values(out[1]));
}

// ==== licm out of cond branches ====

// a while whose body holds a cond: the then branch computes exp(a) * k and
// a gather and an integer division from captures, the else branch from the
// state
const char *kCondInLoop = R"(
func @f(%n: i32[], %s0: f32[4], %a: f32[4], %idx: i32[4], %m: i32[4], %q: i32[4]) -> (i32[], f32[4], i32[4]) {
  %i, %s, %acc = while %n, %s0, %q, %a, %idx, %m {state=3, max_iterations=-1} : i32[], f32[4], i32[4]
    cond func @f.cond(%i: i32[], %s: f32[4], %acc: i32[4], %a: f32[4], %idx: i32[4], %m: i32[4]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @f.body(%i: i32[], %s: f32[4], %acc: i32[4], %a: f32[4], %idx: i32[4], %m: i32[4]) -> (i32[], f32[4], i32[4]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %two = constant dense<2> : i32[]
      %r = mod %i, %two : i32[]
      %zero = constant dense<0> : i32[]
      %p = eq %r, %zero : bool[]
      %1, %2 = cond %p, %s, %a, %idx, %m, %acc : f32[4], i32[4]
        then func @f.then(%s: f32[4], %a: f32[4], %idx: i32[4], %m: i32[4], %acc: i32[4]) -> (f32[4], i32[4]) {
          %k = constant dense<[0.5, 0.25, 2.0, 1.0]> : f32[4]
          %e = exp %a : f32[4]
          %ek = mul %e, %k : f32[4]
          %g = gather %a, %idx {axis=0} : f32[4]
          %d = div %idx, %m : i32[4]
          %three = constant dense<[3, 3, 3, 3]> : i32[4]
          %h = div %m, %three : i32[4]
          %0 = add %s, %ek : f32[4]
          %1 = add %0, %g : f32[4]
          %2 = add %h, %d : i32[4]
          %3 = add %acc, %2 : i32[4]
          return %1, %3
        }
        else func @f.else(%s: f32[4], %a: f32[4], %idx: i32[4], %m: i32[4], %acc: i32[4]) -> (f32[4], i32[4]) {
          %0 = neg %s : f32[4]
          return %0, %acc
        }
      return %0, %1, %2
    }
  return %i, %s, %acc
}
)";

std::vector<kiln_tensor *> cond_loop_args(int32_t n) {
  return {i32s(n), f32({1, 2, 3, 4}), f32({0, 0.5f, -1, 1}), i32({4}, {3, 2, 1, 0}), i32({4}, {1, 2, -3, 4}),
          i32({4}, {7, -9, 11, 100})};
}

TEST(ControlLicm, InvariantWorkOfACondInALoopBodyLeavesTheLoop) {
  Scoped s;
  for (int32_t n : {0, 1, 4})
    check(kCondInLoop, "f", "licm", cond_loop_args(n));
  Mod m(kCondInLoop);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm,dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *f = m.f("f");
  // exp a * k and m / 3 (a constant divisor free of zeros) leave the loop
  EXPECT_EQ(count(f, OP_EXP), 1) << m.text();
  EXPECT_EQ(count(f, OP_MUL), 1) << m.text();
  EXPECT_EQ(count(f, OP_DIV), 1) << m.text();
  const ir_instr *w = first(f, OP_WHILE);
  ASSERT_NE(w, nullptr);
  const ir_func *body = w->attrs.callee2;
  EXPECT_EQ(count(body, OP_EXP), 0);
  const ir_instr *c = first(body, OP_COND);
  ASSERT_NE(c, nullptr);
  const ir_func *then = c->attrs.callee;
  EXPECT_EQ(count(then, OP_EXP), 0) << m.text();
  EXPECT_EQ(count(then, OP_MUL), 0) << m.text();
  // the gather (an index may be out of range) and idx / m (m may hold a
  // zero) run only when the branch does
  EXPECT_EQ(count(then, OP_GATHER), 1) << m.text();
  EXPECT_EQ(count(then, OP_DIV), 1) << m.text();
  EXPECT_EQ(count(f, OP_GATHER), 0);
  check(kCondInLoop, "f", PASS_DEFAULT_PIPELINE, cond_loop_args(4));
}

TEST(ControlLicm, AGatherOutOfRangeInABranchNeverTakenDoesNotFail) {
  Scoped s;
  // index 9 is out of range: the branch that gathers is never taken (the
  // loop runs 0 times, or the predicate is false every time), so nothing fails
  std::vector<kiln_tensor *> args = cond_loop_args(0);
  args[3] = i32({4}, {9, 9, 9, 9});
  args[4] = i32({4}, {0, 0, 0, 0}); // and a zero divisor
  check(kCondInLoop, "f", "licm", args);
  check(kCondInLoop, "f", PASS_DEFAULT_PIPELINE, args);
  std::string never = edit(kCondInLoop, "%p = eq %r, %zero : bool[]", "%p = ne %zero, %zero : bool[]");
  args[0] = i32s(5);
  check(never, "f", "licm", args);
  check(never, "f", PASS_DEFAULT_PIPELINE, args);
}

TEST(ControlLicm, ACondInAScanBodyAndWorkOnTheStateStays) {
  Scoped s;
  const char *text = R"(
func @f(%c0: f32[4], %xs: f32[3,4], %w: f32[4]) -> (f32[4], f32[3,4]) {
  %c, %ys = scan %c0, %xs, %w {carry=1, xs=1, length=3, reverse=true} : f32[4], f32[3,4]
    body func @f.body(%c: f32[4], %x: f32[4], %w: f32[4]) -> (f32[4], f32[4]) {
      %0 = reduce_sum %x {axes=[0]} : f32[]
      %z = constant dense<0.0> : f32[]
      %p = gt %0, %z : bool[]
      %1 = cond %p, %c, %x, %w : f32[4]
        then func @f.then(%c: f32[4], %x: f32[4], %w: f32[4]) -> f32[4] {
          %s = sin %w : f32[4]
          %t = tanh %x : f32[4]
          %u = mul %c, %s : f32[4]
          %0 = add %u, %t : f32[4]
          return %0
        }
        else func @f.else(%c: f32[4], %x: f32[4], %w: f32[4]) -> f32[4] {
          %0 = sub %c, %x : f32[4]
          return %0
        }
      return %1, %1
    }
  return %c, %ys
}
)";
  kiln_tensor *c0 = f32({1, 2, 3, 4}), *xs = f32({3, 4}, {1, 1, 1, 1, -1, -1, -1, -1, 2, -1, 0, 0}), *w = f32({0.5f, 1, 2, 3});
  std::string out = check(text, "f", "licm", {c0, xs, w});
  Mod m(text);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *f = m.f("f");
  EXPECT_EQ(count(f, OP_SIN), 1) << out; // sin w: out of the branch and the loop
  const ir_func *then = first(first(f, OP_SCAN)->attrs.callee, OP_COND)->attrs.callee;
  EXPECT_EQ(count(then, OP_SIN), 0);
  EXPECT_EQ(count(then, OP_TANH), 1); // tanh x reads the row: stays
  EXPECT_EQ(count(then, OP_MUL), 1);  // reads the carry: stays
  check(text, "f", PASS_DEFAULT_PIPELINE, {c0, xs, w});
}

// work both branches of a top-level cond do
const char *kCommon = R"(
func @f(%p: bool[], %x: f32[4], %y: f32[4], %idx: i32[4]) -> (f32[4], f32[4]) {
  %r, %q = cond %p, %x, %y, %idx : f32[4], f32[4]
    then func @f.then(%a: f32[4], %b: f32[4], %i: i32[4]) -> (f32[4], f32[4]) {
      %k = constant dense<2.0> : f32[]
      %e = exp %a : f32[4]
      %s = mul %e, %k : f32[4]
      %g = gather %b, %i {axis=0} : f32[4]
      %l = log %b : f32[4]
      %0 = add %s, %b : f32[4]
      %1 = add %g, %l : f32[4]
      return %0, %1
    }
    else func @f.else(%a: f32[4], %b: f32[4], %i: i32[4]) -> (f32[4], f32[4]) {
      %g = gather %b, %i {axis=0} : f32[4]
      %e = exp %a : f32[4]
      %k = constant dense<2.0> : f32[]
      %s = mul %e, %k : f32[4]
      %l = log %a : f32[4]
      %0 = sub %s, %b : f32[4]
      %1 = sub %g, %l : f32[4]
      return %0, %1
    }
  return %r, %q
}
)";

TEST(ControlLicm, WorkBothBranchesDoMovesBeforeTheCond) {
  Scoped s;
  for (bool p : {true, false})
    check(kCommon, "f", "licm", {b1(p), f32({0, 0.5f, -1, 1}), f32({1, 2, 3, 4}), i32({4}, {3, 2, 1, 0})});
  Mod m(kCommon);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  const ir_func *f = m.f("f");
  // exp a and its product with 2 (both branches, the constants by value) move
  EXPECT_EQ(count(f, OP_EXP), 1) << m.text();
  EXPECT_EQ(count(f, OP_MUL), 1) << m.text();
  // log b / log a differ; the gather may fail: stays in both
  EXPECT_EQ(count(f, OP_LOG), 0) << m.text();
  EXPECT_EQ(count(f, OP_GATHER), 0) << m.text();
  const ir_instr *c = first(f, OP_COND);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->n_in, 5); // one new operand: exp a * 2 (exp a is read by nothing left)
  for (const ir_func *br : {c->attrs.callee, c->attrs.callee2}) {
    EXPECT_EQ(count(br, OP_EXP), 0);
    EXPECT_EQ(count(br, OP_MUL), 0);
    EXPECT_EQ(count(br, OP_GATHER), 1);
    EXPECT_EQ(count(br, OP_LOG), 1);
    EXPECT_EQ(br->n_params, 4);
  }
  check(kCommon, "f", PASS_DEFAULT_PIPELINE, {b1(false), f32({0, 0.5f, -1, 1}), f32({1, 2, 3, 4}), i32({4}, {3, 2, 1, 0})});
}

TEST(ControlLicm, WorkOnlyOneBranchDoesStaysInATopLevelCond) {
  Scoped s;
  // the else branch multiplies by 3: only exp a is common
  std::string t = edit(kCommon, "%k = constant dense<2.0> : f32[]\n      %s = mul %e, %k : f32[4]\n      %l = log %a",
                       "%k = constant dense<3.0> : f32[]\n      %s = mul %e, %k : f32[4]\n      %l = log %a");
  check(t, "f", "licm", {b1(true), f32({0, 0.5f, -1, 1}), f32({1, 2, 3, 4}), i32({4}, {3, 2, 1, 0})});
  Mod m(t);
  ASSERT_EQ(pass_run_pipeline(m.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(count(m.f("f"), OP_EXP), 1);
  EXPECT_EQ(count(m.f("f"), OP_MUL), 0);
  const ir_instr *c = first(m.f("f"), OP_COND);
  EXPECT_EQ(count(c->attrs.callee, OP_MUL), 1);
  EXPECT_EQ(count(c->attrs.callee2, OP_MUL), 1);
  // a cond outside any loop: nothing of one branch alone moves
  const char *one = R"(
func @f(%p: bool[], %x: f32[4]) -> f32[4] {
  %r = cond %p, %x : f32[4]
    then func @f.then(%a: f32[4]) -> f32[4] {
      %e = exp %a : f32[4]
      return %e
    }
    else func @f.else(%a: f32[4]) -> f32[4] {
      return %a
    }
  return %r
}
)";
  Mod m1(one);
  std::string before = m1.text();
  ASSERT_EQ(pass_run_pipeline(m1.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(m1.text(), before);
}

TEST(ControlLicm, ALoopThatMayNotRunKeepsAnIntegerDivisionByACapture) {
  Scoped s;
  const char *text = R"(
func @f(%n: i32[], %s0: i32[2], %m: i32[2], %k: i32[2]) -> i32[2] {
  %i, %s = while %n, %s0, %m, %k {state=2, max_iterations=-1} : i32[], i32[2]
    cond func @f.cond(%i: i32[], %s: i32[2], %m: i32[2], %k: i32[2]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %i, %z : bool[]
      return %0
    }
    body func @f.body(%i: i32[], %s: i32[2], %m: i32[2], %k: i32[2]) -> (i32[], i32[2]) {
      %one = constant dense<1> : i32[]
      %0 = sub %i, %one : i32[]
      %d = div %k, %m : i32[2]
      %e = mod %k, %m : i32[2]
      %1 = add %s, %d : i32[2]
      %2 = add %1, %e : i32[2]
      return %0, %2
    }
  return %s
}
)";
  // a zero divisor, and a loop that never runs: no error
  check(text, "f", PASS_DEFAULT_PIPELINE, {i32s(0), i32({2}, {1, 2}), i32({2}, {0, 3}), i32({2}, {7, 8})});
  check(text, "f", "licm", {i32s(3), i32({2}, {1, 2}), i32({2}, {5, 3}), i32({2}, {7, 8})});
  EXPECT_EQ(count_after(text, "licm", OP_DIV), 0);
  EXPECT_EQ(count_after(text, "licm", OP_MOD), 0);
}

// ==== random programs: loops holding conds, conds sharing work, twins ====

// A random program over f32[4] values: blocks that are a while or a scan
// whose body holds a cond (its branches doing work on the loop's captures,
// a gather of a capture among it now and then), or a cond whose branches
// begin with the same work; each block now and then emitted twice (its
// regions renamed: cse merges the twin).
struct CondGen {
  std::mt19937 rng;
  explicit CondGen(unsigned seed) : rng(seed) {}
  int pick(int n) { return (int)(rng() % (unsigned)n); }

  // elementwise work over vals (f32[4] names), n instructions named
  // %<tag>N, appended to out at indent ind; the names join vals
  void chain(std::mt19937 &r, std::string &out, std::vector<std::string> &vals, int n, const std::string &tag,
             const std::string &ind) {
    static const char *un[] = {"neg", "tanh", "sin", "abs", "exp"};
    static const char *bin[] = {"add", "mul", "sub", "max"};
    for (int k = 0; k < n; k++) {
      std::string v = "%" + tag + std::to_string(k);
      const std::string &a = vals[r() % vals.size()], &b = vals[r() % vals.size()];
      if (r() % 3 == 0)
        out += ind + v + " = " + un[r() % 5] + " " + a + " : f32[4]\n";
      else
        out += ind + v + " = " + bin[r() % 4] + " " + a + ", " + b + " : f32[4]\n";
      vals.push_back(v);
    }
  }

  // a branch over (%a: varies, %b, %e: invariant in the loop, %q: indices)
  void branch(std::mt19937 &r, std::string &out, const std::string &head, const std::string &ind) {
    out += head;
    std::vector<std::string> inv = {"%b", "%e"};
    chain(r, out, inv, 1 + (int)(r() % 3), "u", ind + "  ");
    if (r() % 3 == 0) {
      out += ind + "  %g = gather " + inv.back() + ", %q {axis=0} : f32[4]\n";
      inv.push_back("%g");
    }
    std::vector<std::string> all = inv;
    all.push_back("%a");
    chain(r, out, all, 1 + (int)(r() % 3), "w", ind + "  ");
    out += ind + "  %last = add " + all.back() + ", %a : f32[4]\n";
    out += ind + "  return %last\n" + ind + "}\n";
  }

  // the cond of a loop body: reads cur (varies), c, d (captures), k
  void inner_cond(std::mt19937 &r, std::string &out, const std::string &R, const std::string &cur,
                  const std::string &ind) {
    out += ind + "%zf = constant dense<0.0> : f32[]\n";
    out += ind + "%sum = reduce_sum " + cur + " {axes=[0]} : f32[]\n";
    out += ind + "%p = gt %sum, %zf : bool[]\n";
    out += ind + "%o = cond %p, " + cur + ", %c, %d, %k : f32[4]\n";
    const std::string sig = "(%a: f32[4], %b: f32[4], %e: f32[4], %q: i32[4]) -> f32[4] {\n";
    branch(r, out, ind + "  then func " + R + ".then" + sig, ind + "  ");
    branch(r, out, ind + "  else func " + R + ".else" + sig, ind + "  ");
  }

  // one block reading pool values; its results named %<T>r...
  std::string block(unsigned seed, const std::string &T, const std::vector<std::string> &pool,
                    std::vector<std::string> &res) {
    std::mt19937 r(seed);
    std::string out, v1 = pool[r() % pool.size()], v2 = pool[r() % pool.size()], v3 = pool[r() % pool.size()];
    std::string R = "@" + T;
    int kind = (int)(r() % 3);
    if (kind == 0) { // while counting %n down
      std::string i = "%" + T + "i", s = "%" + T + "s";
      out += "  " + i + ", " + s + " = while %n, " + v1 + ", " + v2 + ", " + v3 + ", %idx {state=2, max_iterations=" +
             (r() % 2 ? "-1" : "3") + "} : i32[], f32[4]\n";
      const std::string params = "(%i: i32[], %s: f32[4], %c: f32[4], %d: f32[4], %k: i32[4])";
      out += "    cond func " + R + ".cond" + params + " -> bool[] {\n";
      out += "      %z = constant dense<0> : i32[]\n      %0 = gt %i, %z : bool[]\n      return %0\n    }\n";
      out += "    body func " + R + ".body" + params + " -> (i32[], f32[4]) {\n";
      out += "      %one = constant dense<1> : i32[]\n      %j = sub %i, %one : i32[]\n";
      std::vector<std::string> vals = {"%s", "%c", "%d"};
      chain(r, out, vals, 1 + (int)(r() % 2), "t", "      ");
      inner_cond(r, out, R + ".c", vals.back(), "      ");
      out += "      %next = tanh %o : f32[4]\n      return %j, %next\n    }\n";
      res.push_back(s);
    } else if (kind == 1) { // scan over the rows of %xs
      std::string c = "%" + T + "c", ys = "%" + T + "ys";
      out += "  " + c + ", " + ys + " = scan " + v1 + ", %xs, " + v2 + ", " + v3 + ", %idx {carry=1, xs=1, length=3, reverse=" +
             (r() % 2 ? "true" : "false") + "} : f32[4], f32[3,4]\n";
      out += "    body func " + R + ".body(%s: f32[4], %x: f32[4], %c: f32[4], %d: f32[4], %k: i32[4]) -> (f32[4], f32[4]) {\n";
      std::vector<std::string> vals = {"%s", "%x", "%c", "%d"};
      chain(r, out, vals, 1 + (int)(r() % 2), "t", "      ");
      inner_cond(r, out, R + ".c", vals.back(), "      ");
      out += "      %next = tanh %o : f32[4]\n      return %next, %o\n    }\n";
      res.push_back(c);
      std::string row = "%" + T + "row", q = "%" + T + "q";
      out += "  " + row + " = slice " + ys + " {begin=[2,0], size=[1,4]} : f32[1,4]\n";
      out += "  " + q + " = reshape " + row + " {shape=[4]} : f32[4]\n";
      res.push_back(q);
    } else { // a cond whose branches begin alike
      std::string o1 = "%" + T + "o1", o2 = "%" + T + "o2", p = "%" + T + "p", sm = "%" + T + "sm", z = "%" + T + "z";
      out += "  " + z + " = constant dense<0.0> : f32[]\n";
      out += "  " + sm + " = reduce_sum " + v1 + " {axes=[0]} : f32[]\n";
      out += "  " + p + " = gt " + sm + ", " + z + " : bool[]\n";
      out += "  " + o1 + ", " + o2 + " = cond " + p + ", " + v1 + ", " + v2 + ", " + v3 + " : f32[4], f32[4]\n";
      unsigned common = (unsigned)r();
      int n_common = 1 + (int)(r() % 3);
      for (const char *role : {"then", "else"}) {
        out += "    " + std::string(role) + " func " + R + "." + role +
               "(%a: f32[4], %b: f32[4], %e: f32[4]) -> (f32[4], f32[4]) {\n";
        std::mt19937 cr(common); // the same work in both
        std::vector<std::string> vals = {"%a", "%b", "%e"};
        chain(cr, out, vals, n_common, "s", "      ");
        chain(r, out, vals, 1 + (int)(r() % 2), std::string("d") + role[0], "      ");
        out += "      return " + vals.back() + ", " + vals[3] + "\n    }\n";
      }
      res.push_back(o1);
      res.push_back(o2);
    }
    return out;
  }

  std::string program() {
    std::string out = "func @f(%x: f32[4], %y: f32[4], %xs: f32[3,4], %idx: i32[4], %n: i32[]) -> (f32[4], f32[4]) {\n";
    std::vector<std::string> pool = {"%x", "%y"};
    int n = 2 + pick(3);
    for (int b = 0; b < n; b++) {
      unsigned seed = (unsigned)rng();
      std::vector<std::string> res, twin;
      out += block(seed, "b" + std::to_string(b), pool, res);
      if (pick(2)) out += block(seed, "b" + std::to_string(b) + "t", pool, twin); // the same block again
      for (const std::string &v : res) pool.push_back(v);
      for (const std::string &v : twin) pool.push_back(v);
    }
    out += "  return " + pool.back() + ", " + pool[2] + "\n}\n";
    return out;
  }
};

TEST(ControlRandomConds, LicmCseAndThePipelineKeepTheValues) {
  Scoped s;
  kiln_tensor *x = f32({0.5f, -1.25f, 2, 0.125f}), *y = f32({-0.75f, 1, 0.25f, -2});
  kiln_tensor *xs = f32({3, 4}, {0.5f, -1, 0.25f, 1, -2, 0.5f, 0.75f, -0.5f, 1, 1, -1, 0.125f});
  kiln_tensor *idx = i32({4}, {2, 0, 3, 1});
  int merged = 0, hoisted = 0, programs = 0;
  for (unsigned seed = 1; seed <= 40; seed++) {
    CondGen g(seed);
    std::string text = g.program();
    Mod probe(text);
    ASSERT_NE(probe.m, nullptr) << "seed " << seed << "\n" << text;
    for (int32_t n : {0, 3}) {
      for (const char *p : {"licm", "cse", "licm,cse,dce", PASS_DEFAULT_PIPELINE}) {
        SCOPED_TRACE(std::string("seed ") + std::to_string(seed) + " n " + std::to_string(n) + " pipeline " + p + "\n" +
                     text);
        check(text, "f", p, {x, y, xs, idx, i32s(n)});
        if (HasFailure()) return;
      }
    }
    programs++;
    // what changed: control flow merged, work moved out of loops or conds
    Mod a(text), b(text);
    int ctl = 0, ctl_after = 0;
    for (int i = 0; i < a.f("f")->n_instrs; i++) ctl += pass_is_control_op(a.f("f")->instrs[i].op);
    ASSERT_EQ(pass_run_pipeline(a.f("f"), "cse", nullptr, nullptr, nullptr), 0) << kiln_last_error();
    for (int i = 0; i < a.f("f")->n_instrs; i++) ctl_after += pass_is_control_op(a.f("f")->instrs[i].op);
    merged += ctl_after < ctl;
    int before = in_branches(b.f("f"));
    ASSERT_EQ(pass_run_pipeline(b.f("f"), "licm", nullptr, nullptr, nullptr), 0) << kiln_last_error();
    hoisted += in_branches(b.f("f")) < before;
  }
  EXPECT_EQ(programs, 40);
  EXPECT_GT(merged, 8) << "programs where cse merged control flow";
  EXPECT_GT(hoisted, 15) << "programs where licm moved work out of the branches of a cond";
  std::printf("  %d programs: cse merged control flow in %d, licm moved work out of cond branches in %d\n", programs,
              merged, hoisted);
}

}  // namespace
