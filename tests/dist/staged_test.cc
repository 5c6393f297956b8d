// staged_test.cc — the collectives as IR instructions (API.md §12, issue
// 18): a staged function calling them equals the eager call, compiled by
// the CPU backend and run by the reference interpreter, bit for bit, for
// every collective, reduction and dtype; their gradients in staged bodies;
// a staged data-parallel MLP step equal to one process on the whole batch;
// a mismatch across ranks inside a staged call failing on every rank; the
// passes keeping every collective (cse, dce, fold), and the combiner
// merging independent all_reduces into one buffer with the same results.
// Part of kiln_dist_tests: ctest runs it alone and under mpirun -np 2/3/4,
// every rank the same tests in the same order.
#include <string>

#include "../test_util.h"
#include "dist_test_util.h"
#include "../../examples/data_parallel_model.h"
#include "cpu/cpu.h"
#include "ir.h"
#include "passes.h"

using namespace kiln_test;

namespace {

const kiln_dtype kEvery[] = {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL, KILN_F16, KILN_BF16};

// rank r's element i: small values exact in every dtype, different per rank
kiln_tensor *rank_input(kiln_dtype dt, const V64 &shape, int r) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  VD v((size_t)n);
  for (int64_t i = 0; i < n; i++) {
    double x = (double)((i * 7 + r * 5) % 13) - 6;
    v[(size_t)i] = dt == KILN_BOOL ? (i + r) % 3 == 0 : dt == KILN_I32 || dt == KILN_I64 ? x : x + 0.5 * (r % 2);
  }
  return kiln_cast(from_values(KILN_F64, shape, v), dt);
}

int coll_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = static_cast<const Coll *>(user)->run(in[0]);
  return out[0] ? 0 : -1;
}

// f(x) staged with backend ("cpu" or "interp"); the result, or nullptr
kiln_tensor *staged(const Coll &c, kiln_tensor *x, const char *backend, std::string *ir = nullptr) {
  EnvGuard b("KILN_BACKEND", backend);
  kiln_function *f = kiln_function_new("coll", coll_body, const_cast<Coll *>(&c), 1, 1);
  EXPECT_NE(f, nullptr) << kiln_last_error();
  kiln_tensor *out = nullptr;
  int rc = kiln_function_call(f, &x, &out);
  if (!rc && ir) {
    char *text = kiln_function_ir(f, 0, "optimized");
    *ir = text ? text : "";
    free(text);
  }
  kiln_function_free(f);
  return rc ? nullptr : out;
}

int count(const std::string &s, const std::string &what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) n++;
  return n;
}

struct Staged : ::testing::Test {
  Scoped scope;
};

TEST_F(Staged, EveryCollectiveEqualsEagerCompiledAndInterpreted) {
  int size = size_();
  const Coll colls[] = {{"all_reduce", "sum", 0},      {"all_reduce", "mean", 0},     {"all_reduce", "max", 0},
                        {"all_reduce", "min", 0},      {"all_gather", nullptr, 0},    {"all_gather", nullptr, -1},
                        {"reduce_scatter", "sum", 0},  {"reduce_scatter", "mean", 1}, {"reduce_scatter", "max", 0},
                        {"reduce_scatter", "min", 1},  {"broadcast_from", nullptr, size - 1}};
  int compared = 0;
  for (kiln_dtype dt : kEvery)
    for (const Coll &c : colls) {
      bool bool_sum = dt == KILN_BOOL && c.op && (std::string(c.op) == "sum" || std::string(c.op) == "mean");
      V64 shape = std::string(c.kind) == "reduce_scatter" ? V64{3 * size, 3 * size} : V64{3, 5};
      std::string what = std::string(kiln_dtype_name(dt)) + " " + c.name();
      kiln_tensor *x = rank_input(dt, shape, rank_());
      kiln_tensor *eager = c.run(x);
      if (bool_sum) { // refused while tracing too, with the eager message
        EXPECT_EQ(eager, nullptr);
        kiln_clear_error();
        EXPECT_EQ(staged(c, x, "cpu"), nullptr) << what;
        EXPECT_EQ(std::string(kiln_last_error()).find("@coll: " + std::string(c.kind) + ": \""), 0u) << kiln_last_error();
        kiln_clear_error();
        continue;
      }
      ASSERT_NE(eager, nullptr) << what << ": " << kiln_last_error();
      std::string ir;
      kiln_tensor *compiled = staged(c, x, "cpu", &ir);
      ASSERT_NE(compiled, nullptr) << what << ": " << kiln_last_error();
      EXPECT_EQ(count(ir, std::string("= ") + c.kind + " "), 1) << what << ": the instruction is staged\n" << ir;
      kiln_tensor *interp = staged(c, x, "interp");
      ASSERT_NE(interp, nullptr) << what << ": " << kiln_last_error();
      EXPECT_EQ(shape_of(compiled), shape_of(eager)) << what;
      EXPECT_TRUE(same_bits(compiled, eager)) << what << ": compiled";
      EXPECT_TRUE(same_bits(interp, eager)) << what << ": interpreted";
      compared++;
    }
  EXPECT_EQ(compared, 7 * 11 - 4);
}

TEST_F(Staged, OddAndEmptySizes) {
  const Coll sum = {"all_reduce", "sum", 0}, gather = {"all_gather", nullptr, 0};
  for (const V64 &shape : {V64{}, V64{1}, V64{1001}, V64{2, 0, 3}})
    for (const Coll *c : {&sum, &gather}) {
      if (shape.empty() && c == &gather) continue; // a scalar has no axis (below)
      kiln_tensor *x = rank_input(KILN_F32, shape, rank_());
      kiln_tensor *eager = c->run(x), *got = staged(*c, x, "cpu");
      ASSERT_NE(eager, nullptr) << kiln_last_error();
      ASSERT_NE(got, nullptr) << c->name() << ": " << kiln_last_error();
      EXPECT_TRUE(same_bits(got, eager)) << c->name();
    }
  EXPECT_EQ(staged(gather, kiln_scalar(KILN_F32, 1), "cpu"), nullptr);
  EXPECT_EQ(std::string(kiln_last_error()).find("@coll: all_gather: a scalar has no axis"), 0u) << kiln_last_error();
  kiln_clear_error();
  const Coll bad = {"all_reduce", "avg", 0};
  EXPECT_EQ(staged(bad, kiln_scalar(KILN_F32, 1), "cpu"), nullptr);
  EXPECT_EQ(std::string(kiln_last_error()).find("@coll: all_reduce: op \"avg\""), 0u) << kiln_last_error();
  kiln_clear_error();
}

// ---- gradients: the eager adjoints, while tracing ----

struct GradUser {
  Coll c;
  kiln_tensor *w; // this rank's weights of the world's loss
};

int loss_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const GradUser *g = static_cast<const GradUser *>(user);
  kiln_tensor *y = g->c.run(kiln_mul(in[0], in[0]));
  out[0] = kiln_reduce_sum(kiln_mul(g->w, y), 0, nullptr, false);
  return out[0] ? 0 : -1;
}

TEST_F(Staged, GradientsOfStagedCollectivesEqualTheEagerTapes) {
  int size = size_(), r = rank_();
  const Coll colls[] = {{"all_reduce", "sum", 0},     {"all_reduce", "mean", 0},    {"all_reduce", "max", 0},
                        {"all_gather", nullptr, 0},   {"reduce_scatter", "sum", 0}, {"reduce_scatter", "mean", 0},
                        {"broadcast_from", nullptr, 0}};
  for (const Coll &c : colls) {
    int64_t n = 2 * size;
    kiln_tensor *x = rank_input(KILN_F64, {n}, r);
    int64_t m = std::string(c.kind) == "all_gather" ? n * size : std::string(c.kind) == "reduce_scatter" ? 2 : n;
    VD w((size_t)m);
    for (int64_t i = 0; i < m; i++) w[(size_t)i] = 0.25 * (double)((i + 3 * r) % 5) - 0.5;
    GradUser u = {c, from_values(KILN_F64, {m}, w)};
    // eager: a tape around the body
    kiln_tape *tape = kiln_tape_begin(false);
    kiln_tape_watch(tape, x);
    kiln_tensor *loss = nullptr, *want = nullptr;
    ASSERT_EQ(loss_body(&u, 1, &x, 1, &loss), 0) << kiln_last_error();
    kiln_tape_end(tape);
    ASSERT_EQ(kiln_tape_gradient(tape, loss, 1, &x, &want), 0) << kiln_last_error();
    kiln_tape_free(tape);
    // staged: kiln_gradients of the staged body, compiled and interpreted
    for (const char *backend : {"cpu", "interp"}) {
      EnvGuard b("KILN_BACKEND", backend);
      kiln_function *f = kiln_function_new("loss", loss_body, &u, 1, 1);
      kiln_function *g = kiln_gradients(f);
      ASSERT_NE(g, nullptr) << kiln_last_error();
      kiln_tensor *got = nullptr;
      ASSERT_EQ(kiln_function_call(g, &x, &got), 0) << c.name() << " " << backend << ": " << kiln_last_error();
      EXPECT_TRUE(allclose(got, want, 1e-12, 1e-12)) << c.name() << " " << backend;
      char *text = kiln_function_ir(g, 0, "traced");
      ASSERT_NE(text, nullptr) << kiln_last_error();
      EXPECT_GE(count(text, "= " + std::string(c.kind) + " "), 1) << text; // the forward's
      free(text);
      kiln_function_free(g);
      kiln_function_free(f);
    }
  }
}

// ---- a staged data-parallel step ----

struct StepUser {
  dp_mlp *m;
  double lr;
};

// (x, y) -> loss: forward, tape gradient, all_reduce(mean) of each
// gradient, SGD, in one staged function
int dp_step_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  StepUser *s = static_cast<StepUser *>(user);
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *l = kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(in[1], dp_mlp_logits(s->m, in[0])), 0, nullptr,
                                    false);
  kiln_tape_end(tape);
  kiln_tensor *grads[DP_VARS] = {};
  int rc = l ? kiln_tape_gradient_vars(tape, l, DP_VARS, s->m->v, grads) : -1;
  kiln_tape_free(tape);
  for (int i = 0; i < DP_VARS && !rc; i++) {
    kiln_tensor *g = kiln_all_reduce(grads[i], "mean");
    kiln_tensor *v = kiln_sub(kiln_variable_read(s->m->v[i]), kiln_mul(g, kiln_scalar(KILN_F32, s->lr)));
    rc = kiln_variable_assign(s->m->v[i], v);
  }
  out[0] = l;
  return rc || !l ? -1 : 0;
}

TEST_F(Staged, DataParallelStepEqualsOneProcessOnTheWholeBatch) {
  enum { BATCH = 48, IN = 12, HIDDEN = 16, STEPS = 20 };
  int size = size_(), r = rank_();
  ASSERT_EQ(BATCH % size, 0);
  kiln_random_seed(7);
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(BATCH, IN));
  kiln_tensor *y =
      kiln_cast(kiln_mul(kiln_random_uniform(KILN_F32, KILN_SHAPE(BATCH), 0, 1), kiln_scalar(KILN_F32, 9.99)), KILN_I64);
  dp_mlp one, world;
  kiln_random_seed(11);
  ASSERT_EQ(dp_mlp_init(&one, IN, HIDDEN), 0) << kiln_last_error();
  kiln_random_seed(11); // the same draws: one's values
  ASSERT_EQ(dp_mlp_init(&world, IN, HIDDEN), 0) << kiln_last_error();
  Owned own;
  kiln_optimizer *sgd = own.opt(kiln_sgd_new(0.2));
  int64_t shard = BATCH / size;
  const int64_t begin[2] = {r * shard, 0}, extent[2] = {shard, IN};
  kiln_tensor *in[2] = {kiln_slice(x, begin, extent), kiln_slice(y, begin, extent)};
  StepUser u = {&world, 0.2};
  kiln_function *step = kiln_function_new("dp_step", dp_step_body, &u, 2, 1);
  ASSERT_NE(step, nullptr) << kiln_last_error();
  for (int s = 0; s < STEPS; s++) {
    kiln_scope_push();
    kiln_tensor *l1 = nullptr, *lw = nullptr;
    ASSERT_EQ(dp_mlp_step(&one, sgd, x, y, false, &l1), 0) << kiln_last_error();
    ASSERT_EQ(kiln_function_call(step, in, &lw), 0) << "step " << s << ": " << kiln_last_error();
    EXPECT_NEAR(kiln_tensor_item(kiln_all_reduce(lw, "mean")), kiln_tensor_item(l1), 1e-5) << "step " << s;
    for (int i = 0; i < DP_VARS; i++)
      EXPECT_TRUE(allclose(kiln_variable_read(world.v[i]), kiln_variable_read(one.v[i]), 1e-5, 1e-5))
          << "step " << s << " variable " << i;
    EXPECT_EQ(dp_mlp_ranks_agree(&world), 1) << "step " << s;
    kiln_scope_pop();
  }
  // the combiner made the four gradients' all_reduces one
  char *traced = kiln_function_ir(step, 0, "traced"), *optimized = kiln_function_ir(step, 0, "optimized");
  ASSERT_NE(traced, nullptr) << kiln_last_error();
  ASSERT_NE(optimized, nullptr) << kiln_last_error();
  EXPECT_EQ(count(traced, "= all_reduce "), DP_VARS) << traced;
  EXPECT_EQ(count(optimized, "= all_reduce "), 1) << optimized;
  free(traced);
  free(optimized);
  kiln_function_free(step);
  dp_mlp_free(&one);
  dp_mlp_free(&world);
}

// ---- calls that disagree across ranks ----

int reduce_sum_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_all_reduce(in[0], "sum");
  return out[0] ? 0 : -1;
}

TEST_F(Staged, MismatchInsideAStagedCallFailsOnEveryRank) {
  if (size_() < 2) GTEST_SKIP() << "needs a world of 2 processes: ctest runs this binary under mpirun -np 2, 3 and 4";
  int r = rank_();
  for (const char *backend : {"cpu", "interp"}) {
    EnvGuard b("KILN_BACKEND", backend);
    kiln_function *f = kiln_function_new("reduce", reduce_sum_body, nullptr, 1, 1);
    int64_t n = r == 1 ? 3 : 4;
    kiln_tensor *x = kiln_ones(KILN_F32, 1, &n), *out = nullptr;
    EXPECT_EQ(kiln_function_call(f, &x, &out), -1) << backend;
    EXPECT_NE(std::string(kiln_last_error()).find("all_reduce: rank 1 has shape (3,) where rank 0 has (4,)"),
              std::string::npos)
        << backend << ": " << kiln_last_error();
    kiln_clear_error();
    // the world goes on, staged
    kiln_tensor *ok = f32({2}, {1, (float)r});
    ASSERT_EQ(kiln_function_call(f, &ok, &out), 0) << backend << ": " << kiln_last_error();
    EXPECT_EQ(values(out), (VD{(double)size_(), (double)size_() * (size_() - 1) / 2})) << backend;
    kiln_function_free(f);
  }
}

// ---- the IR: text, passes, combiner ----

std::string module_text(ir_module *m) {
  char *s = ir_print_module(m);
  std::string out = s ? s : "";
  free(s);
  return out;
}

std::string world_attr() { return "world=" + std::to_string(size_()); }

// Two equal all_reduces of one value, one unused, and one of a constant:
// cse, dce and fold keep all three.
TEST_F(Staged, PassesKeepEveryCollective) {
  std::string w = world_attr();
  std::string text = "func @f(%x: f32[4]) -> (f32[4]) {\n"
                     "  %a = all_reduce %x {reduce=sum, " + w + "} : f32[4]\n"
                     "  %b = all_reduce %x {reduce=sum, " + w + "} : f32[4]\n"
                     "  %c = constant dense<[1, 2, 3, 4]> : f32[4]\n"
                     "  %d = all_reduce %c {reduce=max, " + w + "} : f32[4]\n"
                     "  %e = add %a, %d : f32[4]\n"
                     "  return %e\n"
                     "}\n";
  ir_module *m = ir_parse(text.c_str(), "keep.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  // the text round-trips
  ir_module *again = ir_parse(module_text(m).c_str(), "again.kir");
  ASSERT_NE(again, nullptr) << kiln_last_error();
  EXPECT_EQ(module_text(again), module_text(m));
  ir_module_free(again);
  ir_func *f = ir_module_find(m, "f");
  ASSERT_EQ(pass_run_pipeline(f, "inline,simplify,fold,licm,cse,dce", nullptr, nullptr, nullptr), 0)
      << kiln_last_error();
  std::string after = module_text(m);
  EXPECT_EQ(count(after, "= all_reduce "), 3) << after;
  ir_module_free(m);
  // attributes are checked
  for (const char *bad : {"{reduce=avg, world=1}", "{reduce=sum}", "{reduce=sum, world=0}"}) {
    std::string t = std::string("func @f(%x: f32[4]) -> (f32[4]) {\n  %a = all_reduce %x ") + bad +
                    " : f32[4]\n  return %a\n}\n";
    EXPECT_EQ(ir_parse(t.c_str(), "bad.kir"), nullptr) << bad;
    kiln_clear_error();
  }
  std::string t = "func @f(%x: f32[5]) -> (f32[1]) {\n  %a = reduce_scatter %x {axis=0, reduce=sum, world=5} : f32[1]\n"
                  "  return %a\n}\n";
  ir_module *ok = ir_parse(t.c_str(), "rs.kir");
  EXPECT_NE(ok, nullptr) << kiln_last_error();
  ir_module_free(ok);
  t = "func @f(%x: f32[5]) -> (f32[1]) {\n  %a = reduce_scatter %x {axis=0, reduce=sum, world=2} : f32[1]\n"
      "  return %a\n}\n";
  EXPECT_EQ(ir_parse(t.c_str(), "rs.kir"), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("not divisible"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
}

// IR staged for another world fails on every rank, before any data moves;
// ahead-of-time compilation refuses a collective, naming it
TEST_F(Staged, WrongWorldAndAheadOfTimeFailClearly) {
  std::string text = "func @f(%x: f32[4]) -> (f32[4]) {\n  %a = all_reduce %x {reduce=sum, world=" +
                     std::to_string(size_() + 1) + "} : f32[4]\n  return %a\n}\n";
  ir_module *m = ir_parse(text.c_str(), "world.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *f = ir_module_find(m, "f");
  kiln_tensor *x = f32({4}, {1, 2, 3, 4}), *out = nullptr;
  EXPECT_EQ(ir_interpret(f, &x, &out), -1);
  std::string want = "all_reduce: staged for a world of " + std::to_string(size_() + 1) + " processes, run in a world of " +
                     std::to_string(size_());
  EXPECT_NE(std::string(kiln_last_error()).find(want), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  cpu_aot_spec spec = {"f", nullptr, 1, nullptr};
  void *obj = nullptr;
  size_t len = 0, arena = 0;
  EXPECT_EQ(cpu_aot_object(f, &spec, &obj, &len, &arena), -1);
  EXPECT_NE(std::string(kiln_last_error()).find("cpu: @f: all_reduce cannot be compiled ahead of time"), std::string::npos)
      << kiln_last_error();
  kiln_clear_error();
  free(obj);
  ir_module_free(m);
  // and the world goes on
  EXPECT_EQ(values(kiln_all_reduce(x, "max")), (VD{1, 2, 3, 4}));
}

// %a, %b, %s (scalar) and %i (i32) are independent: a, b and s merge, i is
// another dtype; %d reads %a's result (it waits for the group); %m is
// another reduction; %e reads the merged results.
TEST_F(Staged, CombinerMergesIndependentAllReducesOnly) {
  std::string w = world_attr();
  std::string text =
      "func @f(%x: f32[3], %y: f32[2,5], %z: f32[], %k: i32[4]) -> (f32[3], f32[2,5], f32[], i32[4], f32[3], f32[3]) {\n"
      "  %a = all_reduce %x {reduce=sum, " + w + "} : f32[3]\n"
      "  %n = neg %x : f32[3]\n"
      "  %d0 = mul %a, %a : f32[3]\n"
      "  %b = all_reduce %y {reduce=sum, " + w + "} : f32[2,5]\n"
      "  %s = all_reduce %z {reduce=sum, " + w + "} : f32[]\n"
      "  %i = all_reduce %k {reduce=sum, " + w + "} : i32[4]\n"
      "  %d = all_reduce %d0 {reduce=sum, " + w + "} : f32[3]\n"
      "  %m = all_reduce %n {reduce=max, " + w + "} : f32[3]\n"
      "  %e = add %d, %m : f32[3]\n"
      "  return %a, %b, %s, %i, %d, %e\n"
      "}\n";
  ir_module *m = ir_parse(text.c_str(), "combine.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *f = ir_module_find(m, "f");
  kiln_tensor *args[4] = {rank_input(KILN_F32, {3}, rank_()), rank_input(KILN_F32, {2, 5}, rank_()),
                          kiln_scalar(KILN_F32, 0.5 + rank_()), rank_input(KILN_I32, {4}, rank_())};
  kiln_tensor *want[6] = {}, *got[6] = {};
  ASSERT_EQ(ir_interpret(f, args, want), 0) << kiln_last_error();
  ASSERT_EQ(pass_run_pipeline(f, "combine", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  std::string after = module_text(m);
  // a, b, s fused; i, d, m alone
  EXPECT_EQ(count(after, "= all_reduce "), 4) << after;
  EXPECT_EQ(count(after, "= concat "), 1) << after;
  EXPECT_NE(after.find("all_reduce %") , std::string::npos);
  EXPECT_NE(after.find(": f32[14]"), std::string::npos) << "3 + 10 + 1 elements in one buffer\n" << after;
  ASSERT_EQ(ir_interpret(f, args, got), 0) << kiln_last_error();
  for (int k = 0; k < 6; k++) EXPECT_TRUE(same_bits(got[k], want[k])) << "result " << k;
  // the order of the collectives is every rank's: a second run of the pass changes nothing
  ASSERT_EQ(pass_run_pipeline(f, "combine", nullptr, nullptr, nullptr), 0) << kiln_last_error();
  EXPECT_EQ(module_text(m), after);
  ir_module_free(m);
}

TEST_F(Staged, CombinedStepCompilesAndMatches) {
  // the default pipeline with the CPU backend: a staged body of three
  // independent all_reduces runs one, and equals the eager ones
  struct Three {
    static int body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
      for (int k = 0; k < 3; k++) out[k] = kiln_all_reduce(kiln_mul(in[k], in[k]), "mean");
      return out[0] && out[1] && out[2] ? 0 : -1;
    }
  };
  kiln_function *f = kiln_function_new("three", Three::body, nullptr, 3, 3);
  kiln_tensor *in[3] = {rank_input(KILN_F32, {7}, rank_()), rank_input(KILN_F32, {3, 3}, rank_()),
                        rank_input(KILN_F32, {1}, rank_())};
  kiln_tensor *out[3] = {};
  ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
  for (int k = 0; k < 3; k++) {
    kiln_tensor *want = kiln_all_reduce(kiln_mul(in[k], in[k]), "mean");
    EXPECT_TRUE(same_bits(out[k], want)) << k;
  }
  char *text = kiln_function_ir(f, 0, "optimized");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  EXPECT_EQ(count(text, "= all_reduce "), 1) << text;
  free(text);
  kiln_function_free(f);
}

} // namespace
