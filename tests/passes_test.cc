// passes_test.cc — the pass manager (registry, pipeline parsing, the
// verifier naming the pass that broke the IR, reports and observers) and the
// simple passes (inline, simplify, fold, cse, dce) on programs built with the
// builder: what each one removes or keeps, checked against the interpreter,
// simplify bit for bit on float inputs chosen to break wrong rules (NaN,
// -0.0, inf, subnormals), and every pass alone on random programs.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ir_gen.h"
#include "passes.h"
#include "test_util.h"

namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace kiln_test;

op_type T(kiln_dtype dt, std::vector<int64_t> shape) {
  op_type t{};
  t.dtype = dt;
  t.rank = (int)shape.size();
  for (int i = 0; i < t.rank; i++) t.shape[i] = shape[i];
  return t;
}

const ir_loc kNoLoc{nullptr, 0};

// A module with one function under construction.
struct Fn {
  ir_module *m = ir_module_new();
  ir_func *f = nullptr;
  Fn(const char *name, std::vector<op_type> params) {
    f = ir_func_new(m, name, (int)params.size(), params.data());
    EXPECT_NE(f, nullptr) << kiln_last_error();
  }
  ~Fn() { ir_module_free(m); }
  Fn(const Fn &) = delete;
  Fn &operator=(const Fn &) = delete;
  ir_value op(op_id o, std::vector<ir_value> in, const op_attrs *a = nullptr) {
    ir_value v = ir_append(f, o, a, (int)in.size(), in.data(), kNoLoc);
    EXPECT_GE(v, 0) << kiln_last_error();
    return v;
  }
  // a constant of t (owned by the test's scope; the IR takes a reference)
  ir_value constant(kiln_tensor *t) {
    ir_value v = ir_constant(f, t, kNoLoc);
    EXPECT_GE(v, 0) << kiln_last_error();
    return v;
  }
  void results(std::vector<ir_value> r) { ASSERT_EQ(ir_set_results(f, (int)r.size(), r.data()), 0) << kiln_last_error(); }
  std::string text() const {
    char *s = ir_print_module(m);
    std::string r = s ? s : "<null>";
    free(s);
    return r;
  }
  int count(op_id o) const {
    int n = 0;
    for (int i = 0; i < f->n_instrs; i++) n += f->instrs[i].op == o;
    return n;
  }
};

op_attrs shape_attrs(std::vector<int64_t> shape) {
  op_attrs a{};
  a.rank = (int)shape.size();
  for (int i = 0; i < a.rank; i++) a.shape[i] = shape[i];
  return a;
}

op_attrs perm_attrs(std::vector<int> perm) {
  op_attrs a{};
  a.naxes = (int)perm.size();
  for (int i = 0; i < a.naxes; i++) a.axes[i] = perm[i];
  return a;
}

// Runs f (a copy read back from text, when given) on args; the results'
// bytes, one vector per result. The tensors die with a scope of their own.
std::vector<std::vector<unsigned char>> run(const ir_func *f, const std::vector<kiln_tensor *> &args) {
  std::vector<std::vector<unsigned char>> out;
  std::vector<kiln_tensor *> res(f->n_results + 1);
  kiln_scope_push();
  EXPECT_EQ(ir_interpret(f, args.data(), res.data()), 0) << kiln_last_error();
  for (int r = 0; r < f->n_results; r++) {
    const kiln_tensor *t = res[r];
    size_t bytes = t ? (size_t)kiln_tensor_size(t) * kiln_dtype_size(kiln_tensor_dtype(t)) : 0;
    std::vector<unsigned char> b(bytes);
    if (t) {
      EXPECT_EQ(kiln_tensor_read(t, b.data(), bytes), 0);
    }
    out.push_back(b);
  }
  kiln_scope_pop();
  return out;
}

// Results as hex, one string per result: readable when they differ.
std::vector<std::string> hex(const std::vector<std::vector<unsigned char>> &rs) {
  std::vector<std::string> out;
  for (const auto &r : rs) {
    std::string s;
    char b[4];
    for (unsigned char c : r) {
      std::snprintf(b, sizeof b, "%02x", c);
      s += b;
    }
    out.push_back(s);
  }
  return out;
}

// The function's results on args before and after pipeline: the copy that
// runs "before" is the module read back from its own text.
struct Before {
  ir_module *m;
  explicit Before(const Fn &fn) : m(ir_parse(fn.text().c_str(), "before.kir")) {
    EXPECT_NE(m, nullptr) << kiln_last_error();
  }
  ~Before() { ir_module_free(m); }
  const ir_func *f(const char *name) const { return ir_module_find(m, name); }
};

// ---- the manager ----

TEST(PassManager, RegistryListsThePassesInPipelineOrder) {
  std::vector<std::string> names;
  for (const pass_info *p = pass_list(); p->name; p++) {
    names.push_back(p->name);
    EXPECT_NE(p->run, nullptr);
    EXPECT_GT(std::strlen(p->summary), 10u);
    EXPECT_EQ(pass_find(p->name), p);
  }
  // the simple passes first, in this order (fuse and buffers follow them)
  ASSERT_GE(names.size(), 6u);
  EXPECT_EQ(std::vector<std::string>(names.begin(), names.begin() + 6),
            (std::vector<std::string>{"inline", "simplify", "fold", "licm", "cse", "dce"}));
  EXPECT_EQ(pass_find("cse")->run, &kiln_pass_cse);
  EXPECT_EQ(pass_find("fuse_everything"), nullptr);
  EXPECT_EQ(pass_find(""), nullptr);
  EXPECT_EQ(pass_find(nullptr), nullptr);
  EXPECT_EQ(pass_find("CSE"), nullptr);
  // every name of the default pipeline is registered
  Fn fn("f", {T(KILN_F32, {2})});
  fn.results({0});
  EXPECT_EQ(pass_run_pipeline(fn.f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << kiln_last_error();
}

TEST(PassManager, RejectsBadPipelinesBeforeRunningAnything) {
  Fn fn("f", {T(KILN_F32, {2})});
  ir_value n = fn.op(OP_NEG, {0});
  ir_value nn = fn.op(OP_NEG, {n});
  fn.results({nn});
  std::string before = fn.text();
  EXPECT_EQ(pass_run_pipeline(fn.f, "simplify,nope,dce", nullptr, nullptr, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "pass: unknown pass 'nope'");
  EXPECT_EQ(pass_run_pipeline(fn.f, "simplify,,dce", nullptr, nullptr, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("empty pass name"));
  EXPECT_EQ(pass_run_pipeline(fn.f, ",", nullptr, nullptr, nullptr), -1);
  EXPECT_EQ(fn.text(), before);  // simplify did not run
  EXPECT_EQ(pass_run_pipeline(nullptr, "dce", nullptr, nullptr, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("pass: no function"));
  // empty and NULL pipelines run nothing
  EXPECT_EQ(pass_run_pipeline(fn.f, "", nullptr, nullptr, nullptr), 0);
  EXPECT_EQ(pass_run_pipeline(fn.f, nullptr, nullptr, nullptr, nullptr), 0);
  EXPECT_EQ(fn.text(), before);
}

// test-only passes, registered in a table of their own
int g_runs = 0;
int counting_pass(ir_func *) {
  g_runs++;
  return 0;
}
int breaking_pass(ir_func *f) {  // points the result at a value that does not exist
  f->results[0] = f->n_values + 5;
  return 0;
}
int retyping_pass(ir_func *f) {  // changes a value's type behind the op table's back
  f->types[f->n_values - 1].shape[0] = 3;
  return 0;
}
int failing_pass(ir_func *) {  // fails with a library error (kiln_set_error is not exported)
  EXPECT_EQ(kiln_tensor_new((kiln_dtype)99, 0, nullptr, nullptr), nullptr);
  return -1;
}
int silent_failing_pass(ir_func *) { return -1; }

const pass_info kTestPasses[] = {
    {"count", counting_pass, "counts its runs"},
    {"break", breaking_pass, "breaks the results"},
    {"retype", retyping_pass, "breaks a type"},
    {"fail", failing_pass, "fails"},
    {"silent", silent_failing_pass, "fails without a message"},
};
const int kNTestPasses = sizeof kTestPasses / sizeof kTestPasses[0];

TEST(PassManager, VerifierFailureNamesThePassThatBrokeTheIR) {
  {
    Fn fn("f", {T(KILN_F32, {2})});
    fn.results({fn.op(OP_NEG, {0})});
    g_runs = 0;
    EXPECT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, "count,break,count", nullptr, nullptr, nullptr), -1);
    EXPECT_THAT(kiln_last_error(), StartsWith("break: broke the IR: verify: @f: "));
    EXPECT_THAT(kiln_last_error(), HasSubstr("is not a value"));
    EXPECT_EQ(g_runs, 1);  // the pipeline stopped at the broken step
  }
  {
    Fn fn("g", {T(KILN_F32, {2})});
    fn.results({fn.op(OP_EXP, {0})});
    EXPECT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, "retype", nullptr, nullptr, nullptr), -1);
    EXPECT_THAT(kiln_last_error(), StartsWith("retype: broke the IR: verify: @g: %1: type f32[3], but exp infers f32[2]"));
  }
  // passes of one table are unknown to the other
  Fn fn("h", {T(KILN_F32, {2})});
  fn.results({0});
  EXPECT_EQ(pass_run_pipeline(fn.f, "count", nullptr, nullptr, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "pass: unknown pass 'count'");
  EXPECT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, "dce", nullptr, nullptr, nullptr), -1);
  EXPECT_EQ(pass_run_pipeline_with(nullptr, 0, fn.f, "", nullptr, nullptr, nullptr), -1);
}

TEST(PassManager, FailingPassStopsThePipelineWithItsError) {
  Fn fn("f", {T(KILN_F32, {2})});
  fn.results({0});
  g_runs = 0;
  EXPECT_EQ(kiln_tensor_new((kiln_dtype)99, 0, nullptr, nullptr), nullptr);
  std::string want = kiln_last_error();
  ASSERT_FALSE(want.empty());
  kiln_clear_error();
  EXPECT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, "count,fail,count", nullptr, nullptr, nullptr), -1);
  EXPECT_EQ(kiln_last_error(), want);
  EXPECT_EQ(g_runs, 1);
  kiln_clear_error();
  EXPECT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, "silent", nullptr, nullptr, nullptr), -1);
  EXPECT_STREQ(kiln_last_error(), "silent: failed");
}

TEST(PassManager, InvalidInputIsReportedBeforeAnyPassRuns) {
  Fn fn("f", {T(KILN_F32, {2})});
  fn.results({fn.op(OP_NEG, {0})});
  fn.f->results[0] = 42;
  g_runs = 0;
  EXPECT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, "count", nullptr, nullptr, nullptr), -1);
  EXPECT_THAT(kiln_last_error(), StartsWith("verify: @f"));
  EXPECT_EQ(g_runs, 0);
  fn.f->results[0] = 1;
}

struct Seen {
  std::vector<int> steps;
  std::vector<std::string> names;
  std::vector<int> ops;
};
void observe(void *ctx, int step, const char *pass, const ir_func *f) {
  Seen *s = (Seen *)ctx;
  s->steps.push_back(step);
  s->names.push_back(pass);
  s->ops.push_back(f->n_instrs);
  EXPECT_EQ(ir_verify(f), 0);
}

TEST(PassManager, ReportsAndObservesEveryStep) {
  Scoped scope;
  Fn fn("f", {T(KILN_F32, {2})});
  ir_value z = fn.constant(f32({}, {-0.0f}));
  ir_value a = fn.op(OP_ADD, {0, z});
  ir_value n = fn.op(OP_NEG, {a});
  ir_value nn = fn.op(OP_NEG, {n});
  fn.results({nn});
  ASSERT_EQ(fn.f->n_instrs, 4);
  pass_report rep;
  rep.n = 99;
  Seen seen;
  ASSERT_EQ(pass_run_pipeline(fn.f, "simplify,dce,cse", &rep, observe, &seen), 0) << kiln_last_error();
  ASSERT_EQ(rep.n, 3);
  EXPECT_STREQ(rep.step[0].name, "simplify");
  EXPECT_STREQ(rep.step[1].name, "dce");
  EXPECT_STREQ(rep.step[2].name, "cse");
  EXPECT_EQ(rep.step[0].ops_after, 2);  // the constant and the first neg, dead, stay until dce
  EXPECT_EQ(rep.step[1].ops_after, 0);
  EXPECT_EQ(rep.step[2].ops_after, 0);
  for (int i = 0; i < 3; i++) EXPECT_GE(rep.step[i].ms, 0.0);
  EXPECT_EQ(seen.steps, (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(seen.names, (std::vector<std::string>{"simplify", "dce", "cse"}));
  EXPECT_EQ(seen.ops, (std::vector<int>{2, 0, 0}));
  EXPECT_EQ(fn.f->results[0], 0);  // the parameter itself
}

TEST(PassManager, ReportKeepsTheFirst32Steps) {
  Fn fn("f", {T(KILN_F32, {2})});
  fn.results({0});
  std::string pipeline;
  for (int i = 0; i < 40; i++) pipeline += i ? ",count" : "count";
  pass_report rep;
  Seen seen;
  g_runs = 0;
  ASSERT_EQ(pass_run_pipeline_with(kTestPasses, kNTestPasses, fn.f, pipeline.c_str(), &rep, observe, &seen), 0);
  EXPECT_EQ(g_runs, 40);
  EXPECT_EQ(rep.n, PASS_REPORT_MAX);
  EXPECT_EQ(seen.steps.size(), 40u);
  EXPECT_EQ(seen.steps.back(), 40);
}

// ---- simplify ----

// Float rules must not change a single bit of any result, on inputs made to
// break wrong ones. (Signalling NaNs are left out: a kernel quiets them where
// a removed instruction would have, the one documented difference.)
template <typename F>
void float_rules_keep_bits(kiln_dtype dt) {
  Scoped scope;
  const F nan = std::numeric_limits<F>::quiet_NaN(), inf = std::numeric_limits<F>::infinity();
  const F den = std::numeric_limits<F>::denorm_min(), mx = std::numeric_limits<F>::max();
  F neg_nan = -nan, payload_nan;
  uint64_t bits = dt == KILN_F32 ? 0x7fc12345u : 0x7ff8000012345678ull;
  std::memcpy(&payload_nan, &bits, sizeof(F));
  std::vector<F> xs = {nan, neg_nan, payload_nan, F(0), F(-0.0), inf, -inf, den, -den,
                       mx, -mx, F(1), F(-1), F(3), F(0.1), std::numeric_limits<F>::min()};
  const int64_t n = (int64_t)xs.size();
  auto scalar = [&](F v) { return make<F>(dt, {}, {v}); };
  auto vec = [&](std::vector<F> v) { return make<F>(dt, {(int64_t)v.size()}, v); };

  Fn fn("f", {T(dt, {n}), T(dt, {n}), T(KILN_BOOL, {n})});
  ir_value x = 0, y = 1, p = 2;
  ir_value nz = fn.constant(scalar(F(-0.0))), pz = fn.constant(scalar(F(0))), one = fn.constant(scalar(F(1)));
  ir_value four = fn.constant(scalar(F(4)));
  std::vector<F> pows(n);
  for (int64_t i = 0; i < n; i++) pows[i] = std::ldexp(F(i % 2 ? -1 : 1), (int)(i * 17 % 251) - 125);
  ir_value pw = fn.constant(vec(pows));
  ir_value t = fn.constant(make<uint8_t>(KILN_BOOL, {}, {1}));
  ir_value ff = fn.constant(make<uint8_t>(KILN_BOOL, {n}, std::vector<uint8_t>(n, 0)));
  op_attrs r44 = shape_attrs({4, 4}), rn = shape_attrs({n}), tp = perm_attrs({1, 0});
  op_attrs cv{};
  cv.dtype = dt;
  ir_value x44 = fn.op(OP_RESHAPE, {x}, &r44);
  ir_value tt = fn.op(OP_TRANSPOSE, {fn.op(OP_TRANSPOSE, {x44}, &tp)}, &tp);
  std::vector<ir_value> fired = {
      fn.op(OP_ADD, {x, nz}),        fn.op(OP_ADD, {nz, x}),
      fn.op(OP_SUB, {x, pz}),
      fn.op(OP_MUL, {x, one}),       fn.op(OP_MUL, {one, y}),
      fn.op(OP_DIV, {x, one}),       fn.op(OP_DIV, {x, four}),
      fn.op(OP_DIV, {y, pw}),        fn.op(OP_NEG, {fn.op(OP_NEG, {x})}),
      fn.op(OP_SELECT, {t, x, y}),   fn.op(OP_SELECT, {ff, x, y}),
      fn.op(OP_SELECT, {p, y, y}),   fn.op(OP_RESHAPE, {tt}, &rn),
      fn.op(OP_CONVERT, {x}, &cv),   fn.op(OP_IDENTITY, {y}),
  };
  // rules that must not fire for floats
  std::vector<ir_value> kept = {
      fn.op(OP_ADD, {x, pz}), fn.op(OP_SUB, {x, nz}), fn.op(OP_SUB, {pz, x}), fn.op(OP_SUB, {nz, x}),
      fn.op(OP_MUL, {x, pz}), fn.op(OP_SUB, {x, x}),  fn.op(OP_DIV, {x, fn.constant(scalar(F(3)))}),
  };
  std::vector<ir_value> results = fired;
  results.insert(results.end(), kept.begin(), kept.end());
  fn.results(results);
  Before before(fn);

  std::vector<F> ys(xs.rbegin(), xs.rend());
  std::vector<uint8_t> ps(n);
  for (int64_t i = 0; i < n; i++) ps[i] = i % 3 == 0;
  std::vector<kiln_tensor *> args = {vec(xs), vec(ys), make<uint8_t>(KILN_BOOL, {n}, ps)};
  auto want = run(before.f("f"), args);

  ASSERT_EQ(pass_run_pipeline(fn.f, "simplify,dce", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  // the fired rules left only the two multiplications by reciprocals
  EXPECT_EQ(fn.count(OP_DIV), 1) << fn.text();  // x / 3
  EXPECT_EQ(fn.count(OP_MUL), 3) << fn.text();  // two reciprocals, x * 0
  EXPECT_EQ(fn.count(OP_NEG), 0) << fn.text();
  EXPECT_EQ(fn.count(OP_RESHAPE), 0) << fn.text();
  EXPECT_EQ(fn.count(OP_TRANSPOSE), 0) << fn.text();
  EXPECT_EQ(fn.count(OP_SELECT), 0) << fn.text();
  EXPECT_EQ(fn.count(OP_CONVERT) + fn.count(OP_IDENTITY), 0) << fn.text();
  EXPECT_EQ(fn.count(OP_ADD), 1) << fn.text();  // x + 0.0
  EXPECT_EQ(fn.count(OP_SUB), 4) << fn.text();
  auto got = run(fn.f, args);
  ASSERT_EQ(got.size(), want.size());
  for (size_t r = 0; r < want.size(); r++) EXPECT_EQ(hex(got)[r], hex(want)[r]) << "result " << r << "\n" << fn.text();

  // the whole default pipeline keeps the bits too
  ASSERT_EQ(pass_run_pipeline(fn.f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(hex(run(fn.f, args)), hex(want));
}

TEST(Simplify, FloatRulesKeepEveryBitF32) { float_rules_keep_bits<float>(KILN_F32); }
TEST(Simplify, FloatRulesKeepEveryBitF64) { float_rules_keep_bits<double>(KILN_F64); }

TEST(Simplify, IntegerRules) {
  Scoped scope;
  Fn fn("f", {T(KILN_I32, {3}), T(KILN_I64, {40, 40})});
  ir_value i = 0, big = 1;
  ir_value z = fn.constant(i32({}, {0})), one = fn.constant(i32({3}, {1, 1, 1}));
  ir_value z64 = fn.constant(i64({}, {0}));
  ir_value a = fn.op(OP_ADD, {i, z});
  ir_value b = fn.op(OP_MUL, {a, one});
  ir_value c = fn.op(OP_SUB, {b, z});
  ir_value d = fn.op(OP_SUB, {z, c});          // neg i
  ir_value e = fn.op(OP_MUL, {d, z});          // zeros
  ir_value g = fn.op(OP_SUB, {i, i});          // zeros
  ir_value h = fn.op(OP_MUL, {big, z64});      // 1600 zeros: a broadcast scalar
  ir_value k = fn.op(OP_DIV, {c, one});        // c
  fn.results({c, d, e, g, h, k});
  Before before(fn);
  std::vector<kiln_tensor *> args = {i32({3}, {-2147483647 - 1, 5, -7}), kiln_fill(KILN_I64, 2, std::vector<int64_t>{40, 40}.data(), 9)};
  auto want = run(before.f("f"), args);
  ASSERT_EQ(kiln_pass_simplify(fn.f), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify(fn.f), 0) << kiln_last_error();
  EXPECT_EQ(fn.f->results[0], i);
  EXPECT_EQ(fn.f->results[5], i);
  const ir_instr *dn = ir_def(fn.f, fn.f->results[1]);
  ASSERT_NE(dn, nullptr);
  EXPECT_EQ(dn->op, OP_NEG);
  EXPECT_EQ(dn->in[0], i);
  EXPECT_EQ(ir_def(fn.f, fn.f->results[2])->op, OP_CONSTANT);
  EXPECT_EQ(ir_def(fn.f, fn.f->results[3])->op, OP_CONSTANT);
  EXPECT_EQ(ir_def(fn.f, fn.f->results[4])->op, OP_BROADCAST);
  EXPECT_EQ(run(fn.f, args), want);
}

TEST(Simplify, LeavesUnknownAndMultiResultInstructionsAlone) {
  Scoped scope;
  ir_module *m = ir_parse(
      "func @g(%a: f32[2]) -> (f32[2], f32[2]) {\n"
      "  %n = neg %a : f32[2]\n"
      "  %m = neg %n : f32[2]\n"
      "  return %m, %a\n"
      "}\n"
      "func @f(%x: f32[2]) -> f32[2] {\n"
      "  %p, %q = call @g(%x) : f32[2], f32[2]\n"
      "  %n = neg %p : f32[2]\n"
      "  %h = host_call @kiln_no_such_callback(%n) : f32[2]\n"
      "  %r = rng_uniform {dtype=f32, shape=[2], lo=0, hi=1, seed=1, counter=0} : f32[2]\n"
      "  %s = add %h, %r : f32[2]\n"
      "  return %s\n"
      "}\n",
      "t.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *f = ir_module_find(m, "f");
  for (const char *p : {"simplify", "fold", "cse", "dce"}) {
    ASSERT_EQ(pass_run_pipeline(f, p, nullptr, nullptr, nullptr), 0) << p << ": " << kiln_last_error();
    EXPECT_EQ(f->n_instrs, 5) << p;
  }
  EXPECT_EQ(f->instrs[0].op, OP_CALL);
  EXPECT_EQ(f->instrs[0].n_out, 2);
  EXPECT_EQ(f->instrs[0].attrs.callee, ir_module_find(m, "g"));
  EXPECT_EQ(f->instrs[2].op, OP_HOST_CALL);
  ir_module_free(m);
}

// ---- fold ----

TEST(Fold, EvaluatesConstantChainsWithTheKernels) {
  Scoped scope;
  Fn fn("f", {T(KILN_F32, {3})});
  ir_value a = fn.constant(f32({3}, {1, 4, 9}));
  ir_value s = fn.op(OP_SQRT, {a});
  op_attrs red{};
  red.naxes = 1;
  red.axes[0] = 0;
  ir_value r = fn.op(OP_REDUCE_SUM, {s}, &red);  // 6
  ir_value m = fn.op(OP_MUL, {0, r});            // not constant
  op_attrs io{};
  io.dtype = KILN_I64;
  io.rank = 1;
  io.shape[0] = 2000;
  ir_value big = fn.op(OP_IOTA, {}, &io);
  io.shape[0] = 5;
  ir_value small = fn.op(OP_IOTA, {}, &io);
  fn.results({r, m, big, small});
  ASSERT_EQ(kiln_pass_fold(fn.f), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify(fn.f), 0) << kiln_last_error();
  const ir_instr *rc = ir_def(fn.f, fn.f->results[0]);
  ASSERT_EQ(rc->op, OP_CONSTANT);
  EXPECT_EQ(values(rc->attrs.value), VD({6}));
  const ir_instr *mi = ir_def(fn.f, fn.f->results[1]);
  EXPECT_EQ(mi->op, OP_MUL);
  EXPECT_EQ(mi->in[1], fn.f->results[0]);
  EXPECT_EQ(ir_def(fn.f, fn.f->results[2])->op, OP_IOTA);
  const ir_instr *si = ir_def(fn.f, fn.f->results[3]);
  ASSERT_EQ(si->op, OP_CONSTANT);
  EXPECT_EQ(values(si->attrs.value), VD({0, 1, 2, 3, 4}));
  ASSERT_EQ(kiln_pass_dce(fn.f), 0);
  EXPECT_EQ(fn.f->n_instrs, 4);  // the folded r, mul, the big iota, the small constant
}

TEST(Fold, KeepsWhatWouldFailAtRunTime) {
  Scoped scope;
  Fn fn("f", {});
  ir_value p = fn.constant(f32({2}, {1, 2}));
  ir_value idx = fn.constant(i32({1}, {7}));
  op_attrs ax{};
  ir_value g = fn.op(OP_GATHER, {p, idx}, &ax);
  fn.results({g});
  ASSERT_EQ(kiln_pass_fold(fn.f), 0) << kiln_last_error();
  EXPECT_EQ(ir_def(fn.f, fn.f->results[0])->op, OP_GATHER);
  kiln_tensor *out = nullptr;
  EXPECT_EQ(ir_interpret(fn.f, nullptr, &out), -1);  // the error is reported when it runs
}

// ---- cse and dce ----

TEST(CSE, MergesIdenticalPureInstructionsOnly) {
  Scoped scope;
  Fn fn("f", {T(KILN_F32, {2, 3})});
  op_attrs tp = perm_attrs({1, 0});
  op_attrs red{};
  red.naxes = 1;
  red.axes[0] = 1;
  op_attrs red_keep = red;
  red_keep.keepdims = true;
  op_attrs rng{};
  rng.dtype = KILN_F32;
  rng.rank = 1;
  rng.shape[0] = 3;
  rng.lo = 0;
  rng.hi = 1;
  rng.seed = 5;
  ir_value t1 = fn.op(OP_TRANSPOSE, {0}, &tp), t2 = fn.op(OP_TRANSPOSE, {0}, &tp);
  ir_value e1 = fn.op(OP_EXP, {t1}), e2 = fn.op(OP_EXP, {t2});
  ir_value s1 = fn.op(OP_REDUCE_SUM, {0}, &red), s2 = fn.op(OP_REDUCE_SUM, {0}, &red_keep);
  ir_value r1 = fn.op(OP_RNG_UNIFORM, {}, &rng), r2 = fn.op(OP_RNG_UNIFORM, {}, &rng);
  ir_value c1 = fn.constant(f32({2}, {1, 2})), c2 = fn.constant(f32({2}, {1, 2}));
  ir_value c3 = fn.constant(f32({2}, {1, -0.0f}));
  fn.results({e1, e2, s1, s2, r1, r2, c1, c2, c3});
  ASSERT_EQ(kiln_pass_cse(fn.f), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify(fn.f), 0) << kiln_last_error();
  const ir_value *r = fn.f->results;
  EXPECT_EQ(r[0], r[1]);
  EXPECT_NE(r[2], r[3]);
  EXPECT_NE(r[4], r[5]);
  EXPECT_EQ(r[6], r[7]);
  EXPECT_NE(r[6], r[8]);
  EXPECT_EQ(fn.count(OP_TRANSPOSE), 1);
  EXPECT_EQ(fn.count(OP_EXP), 1);
  EXPECT_EQ(fn.count(OP_RNG_UNIFORM), 2);
  EXPECT_EQ(fn.count(OP_CONSTANT), 2);
}

TEST(DCE, KeepsDrawsAndOnlyWhatResultsNeed) {
  Scoped scope;
  Fn fn("f", {T(KILN_F32, {2}), T(KILN_F32, {2})});
  op_attrs rng{};
  rng.dtype = KILN_F32;
  rng.rank = 1;
  rng.shape[0] = 2;
  rng.hi = 1;
  rng.stateful = true;
  ir_value draw = fn.op(OP_RNG_UNIFORM, {}, &rng);
  ir_value dead = fn.op(OP_ADD, {0, draw});
  ir_value dead2 = fn.op(OP_EXP, {dead});
  ir_value live = fn.op(OP_MUL, {0, 1});
  (void)dead2;
  fn.results({live, 1});
  ASSERT_EQ(kiln_pass_dce(fn.f), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify(fn.f), 0) << kiln_last_error();
  ASSERT_EQ(fn.f->n_instrs, 2);
  EXPECT_EQ(fn.f->instrs[0].op, OP_RNG_UNIFORM);
  EXPECT_TRUE(fn.f->instrs[0].attrs.stateful);
  EXPECT_EQ(fn.f->instrs[1].op, OP_MUL);
  EXPECT_EQ(fn.f->results[1], 1);
}

// ---- inline ----

TEST(Inline, InlinesNestedCallsAndKeepsResults) {
  Scoped scope;
  ir_module *m = ir_parse(
      "func @sq(%a: f32[3]) -> f32[3] {\n"
      "  %m = mul %a, %a : f32[3]\n"
      "  return %m\n"
      "}\n"
      "func @mid(%a: f32[3], %b: f32[3]) -> (f32[3], f32[3]) {\n"
      "  %s = call @sq(%a) : f32[3]\n"
      "  %t = add %s, %b : f32[3]\n"
      "  return %t, %a\n"
      "}\n"
      "func @top(%x: f32[3]) -> (f32[3], f32[3]) {\n"
      "  %p, %q = call @mid(%x, %x) : f32[3], f32[3]\n"
      "  %r = call @sq(%p) : f32[3]\n"
      "  return %r, %q\n"
      "}\n",
      "t.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *top = ir_module_find(m, "top");
  std::vector<kiln_tensor *> args = {f32({3}, {1.5f, -2, 0.25f})};
  auto want = run(top, args);
  ASSERT_EQ(kiln_pass_inline(top), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify_module(m), 0) << kiln_last_error();
  char *text = ir_print_func(top);
  EXPECT_STREQ(text,
               "func @top(%x: f32[3]) -> (f32[3], f32[3]) {\n"
               "  %0 = mul %x, %x : f32[3]\n"
               "  %p = add %0, %x : f32[3]\n"
               "  %r = mul %p, %p : f32[3]\n"
               "  return %r, %x\n"
               "}\n");
  free(text);
  EXPECT_EQ(run(top, args), want);
  EXPECT_EQ(m->n_funcs, 3);  // callees stay
  EXPECT_EQ(ir_module_find(m, "mid")->n_instrs, 2);  // and are not changed
  ir_module_free(m);
}

// ---- every pass alone, on random programs ----

TEST(Passes, EachPassAloneKeepsRandomProgramResults) {
  Scoped scope;
  const char *pipelines[] = {"inline", "simplify", "fold", "cse", "dce", PASS_DEFAULT_PIPELINE};
  int changed = 0;
  for (uint64_t seed = 1; seed <= 150; seed++) {
    ir_module *orig = ir_gen_program(seed, nullptr);
    ASSERT_NE(orig, nullptr) << kiln_last_error();
    char *text = ir_print_module(orig);
    std::vector<kiln_tensor *> args(orig->funcs[0]->n_params + 1);
    kiln_scope_push();
    ASSERT_EQ(ir_gen_args(orig->funcs[0], seed, args.data()), 0) << kiln_last_error();
    auto want = run(orig->funcs[0], args);
    for (const char *p : pipelines) {
      ir_module *m = ir_parse(text, "gen.kir");
      ASSERT_NE(m, nullptr) << kiln_last_error();
      int before = m->funcs[0]->n_instrs;
      ASSERT_EQ(pass_run_pipeline(m->funcs[0], p, nullptr, nullptr, nullptr), 0)
          << p << ": " << kiln_last_error() << "\nseed " << seed << "\n" << text;
      changed += m->funcs[0]->n_instrs != before;
      auto got = run(m->funcs[0], args);
      EXPECT_EQ(hex(got), hex(want)) << p << " changed the results of seed " << seed << "\n" << text;
      ir_module_free(m);
    }
    kiln_scope_pop();
    free(text);
    ir_module_free(orig);
  }
  EXPECT_GT(changed, 100);  // the passes did something
}

}  // namespace
