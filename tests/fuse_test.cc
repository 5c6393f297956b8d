// fuse_test.cc — the fuse and buffers passes on programs run by the
// interpreter: fusing changes no bit of any result, and neither does running
// over the arena plan with KILN_POISON=1 (every planned value written to and
// read back from its offset, poisoned when it dies), on an MLP layer's
// forward and backward pass, on random programs and on a staged MLP training
// step. The plan's figures are checked (peak <= unshared, peak >= the
// liveness lower bound, exact values on small cases), a wrong plan is shown
// to fail loudly, and a plan is dropped when the function changes.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "buffers.h"
#include "ir_gen.h"
#include "passes.h"
#include "test_util.h"

namespace {

using ::testing::HasSubstr;
using namespace kiln_test;

// KILN_POISON=1 for the lifetime of the object (the interpreter reads it on
// every run), restored after.
struct Poison {
  std::string old;
  bool had;
  explicit Poison(bool on) {
    const char *s = std::getenv("KILN_POISON");
    had = s != nullptr;
    if (s) old = s;
    if (on)
      setenv("KILN_POISON", "1", 1);
    else
      unsetenv("KILN_POISON");
  }
  ~Poison() {
    if (had)
      setenv("KILN_POISON", old.c_str(), 1);
    else
      unsetenv("KILN_POISON");
  }
};

// A parsed module, freed at the end.
struct Module {
  ir_module *m;
  explicit Module(const char *text) : m(ir_parse(text, "test.kir")) { EXPECT_NE(m, nullptr) << kiln_last_error(); }
  explicit Module(ir_module *mod) : m(mod) {}
  ~Module() { ir_module_free(m); }
  Module(const Module &) = delete;
  Module &operator=(const Module &) = delete;
  ir_func *func(const char *name) const { return ir_module_find(m, name); }
  std::string text() const {
    char *s = ir_print_module(m);
    std::string r = s ? s : "<null>";
    free(s);
    return r;
  }
};

// The results of f on args (owned by the current scope); empty on failure.
std::vector<kiln_tensor *> run(const ir_func *f, const std::vector<kiln_tensor *> &args) {
  std::vector<kiln_tensor *> out((size_t)f->n_results + 1, nullptr);
  if (ir_interpret(f, args.data(), out.data())) {
    ADD_FAILURE() << "interpret @" << f->name << ": " << kiln_last_error();
    return {};
  }
  out.resize((size_t)f->n_results);
  return out;
}

// Do a and b hold the same bits, result by result?
::testing::AssertionResult same_results(const std::vector<kiln_tensor *> &a, const std::vector<kiln_tensor *> &b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " results";
  for (size_t i = 0; i < a.size(); i++)
    if (!same_bits(a[i], b[i])) return ::testing::AssertionFailure() << "result " << i << " differs";
  return ::testing::AssertionSuccess();
}

int count_ops(const ir_func *f, op_id op) {
  int n = 0;
  for (int i = 0; i < f->n_instrs; i++) n += f->instrs[i].op == op;
  return n;
}

// Runs pass on every function of m that existed before it (bodies it adds
// are not passed again), as kiln-opt does, failing the test on an error.
void pass_all(ir_module *m, int (*pass)(ir_func *)) {
  int n = m->n_funcs;
  for (int i = 0; i < n; i++) ASSERT_EQ(pass(m->funcs[i]), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify_module(m), 0) << kiln_last_error();
}

// Stats of a planned function, and the sanity every plan has.
pass_buffer_stats stats_of(const ir_func *f) {
  pass_buffer_stats s{};
  EXPECT_EQ(pass_buffer_stats_of(f, &s), 0) << kiln_last_error();
  EXPECT_LE(s.peak_bytes, s.unshared_bytes);
  EXPECT_GE(s.peak_bytes, s.lower_bound);
  EXPECT_EQ(s.peak_bytes, f->arena_bytes);
  return s;
}

// One dense layer of an MLP, forward and backward, with a squared-error
// loss and an SGD update: the shapes of a training step (batch 64, 784 ->
// 256).
const char *kMlp = R"(
func @layer(%x: f32[64,784], %w: f32[784,256], %b: f32[256], %t: f32[64,256], %lr: f32[]) -> (f32[], f32[784,256], f32[256], f32[64,784]) {
  %d = dot %x, %w : f32[64,256]
  %z = add %d, %b : f32[64,256]
  %h = relu %z : f32[64,256]
  %e = sub %h, %t : f32[64,256]
  %sq = mul %e, %e : f32[64,256]
  %l = reduce_sum %sq {axes=[0,1], keepdims=false} : f32[]
  %two = constant dense<2.0> : f32[]
  %dh = mul %e, %two : f32[64,256]
  %zero = constant dense<0.0> : f32[]
  %m = gt %z, %zero : bool[64,256]
  %dz = select %m, %dh, %zero : f32[64,256]
  %xt = transpose %x {perm=[1,0]} : f32[784,64]
  %dw = dot %xt, %dz : f32[784,256]
  %db = reduce_sum %dz {axes=[0], keepdims=false} : f32[256]
  %wt = transpose %w {perm=[1,0]} : f32[256,784]
  %dx = dot %dz, %wt : f32[64,784]
  %sw = mul %dw, %lr : f32[784,256]
  %w2 = sub %w, %sw : f32[784,256]
  %sb = mul %db, %lr : f32[256]
  %b2 = sub %b, %sb : f32[256]
  return %l, %w2, %b2, %dx
}
)";

TEST(Fuse, MlpLayerForwardAndBackward) {
  Scoped scope;
  Module orig(kMlp), fused(kMlp);
  ASSERT_TRUE(orig.m && fused.m);
  ir_func *f = fused.func("layer");
  int before = f->n_instrs;
  std::vector<kiln_tensor *> args(5);
  ASSERT_EQ(ir_gen_args(orig.func("layer"), 7, args.data()), 0) << kiln_last_error();
  auto want = run(orig.func("layer"), args);
  ASSERT_EQ(want.size(), 4u);

  pass_all(fused.m, kiln_pass_fuse);
  std::string text = fused.text();
  // the forward dot leads its epilogue (bias, relu, and the backward's
  // mask of the same pre-activation); the error, its gradient and the bias
  // gradient's sum are one kernel, the loss another; the weight update is
  // the epilogue of dw; dx (a result) and the transposes stand alone
  EXPECT_EQ(before, 20);
  EXPECT_EQ(f->n_instrs, 8) << text;
  EXPECT_EQ(count_ops(f, OP_FUSION), 5) << text;
  EXPECT_EQ(count_ops(f, OP_DOT), 1) << text;
  EXPECT_EQ(count_ops(f, OP_TRANSPOSE), 2) << text;
  EXPECT_THAT(text, HasSubstr("  %d = dot %x, %w : f32[64,256]\n  %z = add %d, %b : f32[64,256]\n"
                              "  %h = relu %z : f32[64,256]\n  %0 = constant dense<0> : f32[]\n"
                              "  %m = gt %z, %0 : bool[64,256]\n  return %h, %m\n"));
  EXPECT_THAT(text, HasSubstr("  %dz = select %m, %dh, %zero : f32[64,256]\n"
                              "  %db = reduce_sum %dz {axes=[0], keepdims=false} : f32[256]\n  return %e, %dz, %db\n"));
  EXPECT_THAT(text, HasSubstr("  %dw = dot %xt, %dz : f32[784,256]\n  %sw = mul %dw, %lr : f32[784,256]\n"
                              "  %w2 = sub %w, %sw : f32[784,256]\n"));
  EXPECT_TRUE(same_results(want, run(f, args))) << text;

  pass_all(fused.m, kiln_pass_buffers);
  ASSERT_NE(f->buf_offset, nullptr);
  pass_buffer_stats s = stats_of(f);
  EXPECT_EQ(s.kernels, f->n_instrs - count_ops(f, OP_CONSTANT));
  EXPECT_GT(s.unshared_bytes, s.peak_bytes) << "some buffer is reused";
  for (int r = 0; r < f->n_results; r++) EXPECT_EQ(f->buf_offset[f->results[r]], -1) << "results stay outside";
  for (int v = 0; v < f->n_params; v++) EXPECT_EQ(f->buf_offset[v], -1) << "parameters stay outside";
  {
    Poison on(true);
    EXPECT_TRUE(same_results(want, run(f, args))) << fused.text();
  }
  // the text round-trips, plan included
  Module back(fused.text().c_str());
  ASSERT_TRUE(back.m);
  EXPECT_EQ(back.text(), fused.text());
  EXPECT_EQ(back.func("layer")->arena_bytes, f->arena_bytes);
}

// Random programs of every kind (every other one with NaN, inf and huge
// floats): fusing changes no bit, nor does running over the plan with
// poison; the text round-trips; every plan is sane. KILN_RANDOM_PROGRAMS=N
// runs N of them (default 300).
TEST(Fuse, RandomProgramsKeepTheirResults) {
  Scoped scope;
  const char *env = std::getenv("KILN_RANDOM_PROGRAMS");
  int n = env && std::atoi(env) > 0 ? std::atoi(env) : 300, fused_kernels = 0, planned = 0;
  ir_gen_options special = ir_gen_default_options();
  special.special_floats = 1;
  for (uint64_t seed = 1; seed <= (uint64_t)n; seed++) {
    kiln_scope_push();
    const ir_gen_options *o = seed % 2 ? nullptr : &special;
    Module orig(ir_gen_program(seed, o)), opt(ir_gen_program(seed, o));
    ASSERT_TRUE(orig.m && opt.m) << kiln_last_error();
    std::string where = "seed " + std::to_string(seed) + "\n" + orig.text();
    SCOPED_TRACE(where);
    ir_func *f = opt.m->funcs[0];
    std::vector<kiln_tensor *> args((size_t)f->n_params + 1);
    ASSERT_EQ(ir_gen_args(f, seed, args.data()), 0) << kiln_last_error();
    auto want = run(orig.m->funcs[0], args);
    pass_all(opt.m, kiln_pass_fuse);
    fused_kernels += count_ops(f, OP_FUSION);
    EXPECT_TRUE(same_results(want, run(f, args))) << where << "after fuse:\n" << opt.text();
    pass_all(opt.m, kiln_pass_buffers);
    if (f->buf_offset) {
      planned++;
      stats_of(f);
      Poison on(true);
      EXPECT_TRUE(same_results(want, run(f, args))) << where << "after buffers:\n" << opt.text();
    }
    Module back(opt.text().c_str());
    ASSERT_TRUE(back.m) << where;
    EXPECT_EQ(back.text(), opt.text()) << where;
    kiln_scope_pop();
    if (HasFailure()) break;
  }
  EXPECT_GT(fused_kernels, n) << "the generator's programs do fuse";
  EXPECT_GT(planned, n / 2);
}

// The same programs through the whole default pipeline, over the arena.
TEST(Fuse, RandomProgramsThroughTheDefaultPipeline) {
  Scoped scope;
  for (uint64_t seed = 1001; seed <= 1150; seed++) {
    kiln_scope_push();
    Module orig(ir_gen_program(seed, nullptr)), opt(ir_gen_program(seed, nullptr));
    ASSERT_TRUE(orig.m && opt.m) << kiln_last_error();
    ir_func *f = opt.m->funcs[0];
    std::vector<kiln_tensor *> args((size_t)f->n_params + 1);
    ASSERT_EQ(ir_gen_args(f, seed, args.data()), 0) << kiln_last_error();
    auto want = run(orig.m->funcs[0], args);
    ASSERT_EQ(pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << kiln_last_error();
    Poison on(true);
    auto got = run(f, args);
    ASSERT_EQ(got.size(), want.size());
    for (size_t r = 0; r < got.size(); r++) {  // fold and simplify may round differently
      VD a = values(want[r]), b = values(got[r]);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); i++) {
        if (std::isnan(a[i]) && std::isnan(b[i])) continue;
        ASSERT_NEAR(a[i], b[i], 1e-4 * (1 + std::fabs(a[i])))
            << "seed " << seed << " result " << r << "\n" << orig.text() << "optimized:\n" << opt.text();
      }
    }
    kiln_scope_pop();
  }
}

// Random draws from the global stream keep their order when fused.
TEST(Fuse, RandomDrawsKeepTheirOrder) {
  Scoped scope;
  const char *text = R"(
func @f(%x: f32[64,32]) -> (f32[64,32], f32[64,32]) {
  %r1 = rng_uniform {dtype=f32, shape=[64,32], lo=0, hi=1, seed=global, counter=global} : f32[64,32]
  %a = add %x, %r1 : f32[64,32]
  %r2 = rng_normal {dtype=f32, shape=[64,32], seed=global, counter=global} : f32[64,32]
  %b = mul %a, %r2 : f32[64,32]
  %r3 = rng_uniform {dtype=f32, shape=[32], lo=0, hi=1, seed=global, counter=global} : f32[32]
  %c = sub %b, %r3 : f32[64,32]
  %e = exp %a : f32[64,32]
  return %c, %e
}
)";
  Module orig(text), opt(text);
  ASSERT_TRUE(orig.m && opt.m);
  std::vector<kiln_tensor *> args(1);
  ASSERT_EQ(ir_gen_args(orig.func("f"), 3, args.data()), 0);
  kiln_random_seed(11);
  auto want = run(orig.func("f"), args);
  pass_all(opt.m, kiln_pass_fuse);
  pass_all(opt.m, kiln_pass_buffers);
  EXPECT_GE(count_ops(opt.func("f"), OP_FUSION), 1) << opt.text();
  Poison on(true);
  kiln_random_seed(11);
  EXPECT_TRUE(same_results(want, run(opt.func("f"), args))) << opt.text();
}

// The figures of a plan, by hand: four temporaries of 128, 192, 128 and 128
// bytes; at most 384 live at once (t0, t2, t3); best fit by first use
// reaches it.
TEST(Buffers, FiguresOfASmallPlan) {
  Scoped scope;
  Module m(R"(
func @f(%a: f32[32], %b: f32[48], %c: f32[32], %d: f32[32]) -> f32[64] {
  %t0 = neg %a : f32[32]
  %t1 = neg %b : f32[48]
  %t2 = neg %c : f32[32]
  %t3 = neg %d : f32[32]
  %r = concat %t2, %t0 {axis=0} : f32[64]
  return %r
}
)");
  ir_func *f = m.func("f");
  ASSERT_EQ(kiln_pass_buffers(f), 0) << kiln_last_error();
  pass_buffer_stats s = stats_of(f);
  EXPECT_EQ(s.peak_bytes, 384);
  EXPECT_EQ(s.unshared_bytes, 128 + 192 + 128 + 128);
  EXPECT_EQ(s.lower_bound, 384);
  EXPECT_EQ(s.kernels, 5);
  EXPECT_EQ(s.temporaries, 4);
  EXPECT_EQ(s.in_place, 0);
}

// In-place chains count each buffer once in the lower bound.
TEST(Buffers, InPlaceChains) {
  Scoped scope;
  Module m(R"(
func @f(%x: f32[8,8], %y: f32[8,8]) -> f32[8,8] {
  %a = exp %x : f32[8,8]
  %b = neg %a : f32[8,8]
  %c = mul %b, %y : f32[8,8]
  %i = convert %c {dtype=i32} : i32[8,8]
  %t = transpose %i {perm=[1,0]} : i32[8,8]
  %d = convert %t {dtype=f32} : f32[8,8]
  return %d
}
)");
  ir_func *f = m.func("f");
  std::vector<kiln_tensor *> args(2);
  ASSERT_EQ(ir_gen_args(f, 5, args.data()), 0);
  auto want = run(f, args);
  ASSERT_EQ(kiln_pass_buffers(f), 0) << kiln_last_error();
  pass_buffer_stats s = stats_of(f);
  EXPECT_EQ(s.temporaries, 5);
  EXPECT_EQ(s.in_place, 3);  // b, c over a; i (same bytes, other dtype) over c
  EXPECT_EQ(s.unshared_bytes, 5 * 256);
  EXPECT_EQ(s.lower_bound, 512);  // at the transpose: its input and output
  EXPECT_EQ(s.peak_bytes, 512);
  Poison on(true);
  EXPECT_TRUE(same_results(want, run(f, args))) << m.text();
}

// A plan that puts two live values in the same bytes changes the results
// under KILN_POISON=1; the interpreter ignores plans without it. An offset
// outside the arena is an error.
TEST(Buffers, PoisonCatchesAWrongPlan) {
  Scoped scope;
  Module m(R"(
func @f(%x: f32[16], %y: f32[16]) -> f32[16] {
  %a = exp %x : f32[16]
  %b = neg %y : f32[16]
  %c = add %a, %b : f32[16]
  return %c
}
)");
  ir_func *f = m.func("f");
  std::vector<kiln_tensor *> args(2);
  ASSERT_EQ(ir_gen_args(f, 9, args.data()), 0);
  auto want = run(f, args);
  ASSERT_EQ(kiln_pass_buffers(f), 0) << kiln_last_error();
  ir_value a = 2, b = 3;
  ASSERT_NE(f->buf_offset[a], f->buf_offset[b]) << "both live at the add";
  {
    Poison on(true);
    EXPECT_TRUE(same_results(want, run(f, args)));
  }
  f->buf_offset[b] = f->buf_offset[a];  // b overwrites a while a is live
  {
    Poison off(false);
    EXPECT_TRUE(same_results(want, run(f, args))) << "no poison: the plan is not used";
  }
  {
    Poison on(true);
    auto got = run(f, args);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_FALSE(same_bits(want[0], got[0])) << "an overlap must show";
  }
  f->buf_offset[b] = f->arena_bytes;  // past the end
  {
    Poison on(true);
    std::vector<kiln_tensor *> out(1);
    EXPECT_EQ(ir_interpret(f, args.data(), out.data()), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("outside the arena"));
  }
}

// A value read after its last planned use reads poison: here a plan that
// lets c take a's bytes in place although a is read again later.
TEST(Buffers, PoisonCatchesAShortLife) {
  Scoped scope;
  Module m(R"(
func @f(%x: f32[16]) -> f32[16] {
  %a = exp %x : f32[16]
  %c = neg %a : f32[16]
  %d = mul %c, %a : f32[16]
  return %d
}
)");
  ir_func *f = m.func("f");
  std::vector<kiln_tensor *> args(1);
  ASSERT_EQ(ir_gen_args(f, 4, args.data()), 0);
  auto want = run(f, args);
  ASSERT_EQ(kiln_pass_buffers(f), 0) << kiln_last_error();
  EXPECT_NE(f->buf_offset[1], f->buf_offset[2]) << "a is read after c is made: not in place";
  f->buf_offset[2] = f->buf_offset[1];
  Poison on(true);
  auto got = run(f, args);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_FALSE(same_bits(want[0], got[0]));
}

// A plan names values: appending one, changing the results or rewriting the
// body with a pass drops it. Kernel bodies and functions without
// temporaries get none.
TEST(Buffers, PlansAreDroppedWhenTheFunctionChanges) {
  Scoped scope;
  Module m(R"(
func @f(%x: f32[64,32]) -> f32[64,32] {
  %a = exp %x : f32[64,32]
  %t = transpose %a {perm=[1,0]} : f32[32,64]
  %b = transpose %t {perm=[1,0]} : f32[64,32]
  %c = neg %b : f32[64,32]
  return %c
}
func @g(%x: f32[4]) -> f32[4] {
  %n = neg %x : f32[4]
  return %n
}
)");
  ir_func *f = m.func("f"), *g = m.func("g");
  ASSERT_EQ(kiln_pass_buffers(g), 0);
  EXPECT_EQ(g->buf_offset, nullptr) << "no temporaries, no plan";
  pass_buffer_stats s;
  EXPECT_EQ(pass_buffer_stats_of(g, &s), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("buffers: @g has no arena plan"));

  ASSERT_EQ(kiln_pass_buffers(f), 0);
  ASSERT_NE(f->buf_offset, nullptr);
  ASSERT_EQ(kiln_pass_simplify(f), 0) << kiln_last_error();  // transpose of transpose
  EXPECT_EQ(f->buf_offset, nullptr);
  EXPECT_EQ(f->arena_bytes, 0);
  ASSERT_EQ(kiln_pass_buffers(f), 0);
  ASSERT_NE(f->buf_offset, nullptr);
  ir_value r = f->results[0];
  ASSERT_EQ(ir_set_results(f, 1, &r), 0);
  EXPECT_EQ(f->buf_offset, nullptr);
  ASSERT_EQ(kiln_pass_buffers(f), 0);
  ASSERT_NE(f->buf_offset, nullptr);
  ir_loc loc{nullptr, 0};
  ASSERT_GE(ir_append(f, OP_NEG, nullptr, 1, &r, loc), 0);
  EXPECT_EQ(f->buf_offset, nullptr);

  // a kernel body: no plan, and fuse leaves it alone
  ASSERT_EQ(kiln_pass_fuse(f), 0) << kiln_last_error();
  ir_func *body = nullptr;
  for (int i = 0; i < f->n_instrs; i++)
    if (f->instrs[i].op == OP_FUSION) body = f->instrs[i].attrs.callee;
  ASSERT_NE(body, nullptr) << m.text();
  EXPECT_TRUE(pass_is_kernel_body(body));
  EXPECT_FALSE(pass_is_kernel_body(f));
  int n = body->n_instrs;
  ASSERT_EQ(kiln_pass_fuse(body), 0);
  ASSERT_EQ(kiln_pass_buffers(body), 0);
  EXPECT_EQ(body->n_instrs, n);
  EXPECT_EQ(body->buf_offset, nullptr);
}

TEST(Fuse, BadArguments) {
  Scoped scope;
  EXPECT_EQ(kiln_pass_fuse(nullptr), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("fuse: no function"));
  EXPECT_EQ(kiln_pass_buffers(nullptr), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("buffers: no function"));
  pass_buffer_stats s;
  EXPECT_EQ(pass_buffer_stats_of(nullptr, &s), -1);
  EXPECT_EQ(pass_find("fuse")->run, kiln_pass_fuse);
  EXPECT_EQ(pass_find("buffers")->run, kiln_pass_buffers);
  EXPECT_THAT(PASS_DEFAULT_PIPELINE, ::testing::EndsWith("fuse,buffers"));
}

// An MLP 784-256-256-10 training step (forward, tape gradient, SGD), staged:
// what fuse and buffers make of it, and the staged step over its arena with
// poison gives the eager step's loss and updates.
struct MlpModel {
  kiln_variable *v[6] = {};
  kiln_optimizer *sgd = nullptr;
};

kiln_tensor *dense(kiln_tensor *h, kiln_variable *w, kiln_variable *b) {
  return kiln_add(kiln_matmul(h, kiln_variable_read(w)), kiln_variable_read(b));
}

int mlp_step(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  MlpModel *m = (MlpModel *)user;
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tensor *h = kiln_relu(dense(in[0], m->v[0], m->v[1]));
  h = kiln_relu(dense(h, m->v[2], m->v[3]));
  kiln_tensor *l =
      kiln_reduce_mean(kiln_sparse_softmax_cross_entropy(in[1], dense(h, m->v[4], m->v[5])), 0, nullptr, false);
  kiln_tape_end(tape);
  kiln_tensor *g[6] = {};
  int rc = l ? kiln_tape_gradient_vars(tape, l, 6, m->v, g) : -1;
  if (!rc) rc = kiln_optimizer_apply(m->sgd, 6, m->v, g);
  kiln_tape_free(tape);
  out[0] = l;
  return rc;
}

TEST(Fuse, MlpTrainingStep) {
  Scoped scope;
  Owned own;
  static const int64_t shapes[6][2] = {{784, 256}, {256, 0}, {256, 256}, {256, 0}, {256, 10}, {10, 0}};
  MlpModel eager_m, staged_m;
  kiln_random_seed(5);
  for (int i = 0; i < 6; i++) {
    kiln_tensor *init = kiln_mul(kiln_random_normal(KILN_F32, shapes[i][1] ? 2 : 1, shapes[i]),
                                 kiln_scalar(KILN_F32, 0.05));
    eager_m.v[i] = own.var(init, "w");
    staged_m.v[i] = own.var(init, "w");
  }
  eager_m.sgd = own.opt(kiln_sgd_new(0.01));
  staged_m.sgd = own.opt(kiln_sgd_new(0.01));
  kiln_tensor *x = kiln_random_normal(KILN_F32, KILN_SHAPE(64, 784));
  kiln_tensor *y = kiln_cast(kiln_random_uniform(KILN_F64, KILN_SHAPE(64), 0, 10), KILN_I64);
  kiln_tensor *in[2] = {x, y}, *le = nullptr, *ls = nullptr;

  kiln_function *fe = kiln_function_new("mlp_step", mlp_step, &eager_m, 2, 1);
  kiln_function *fs = kiln_function_new("mlp_step", mlp_step, &staged_m, 2, 1);
  kiln_function_set_eager(fe, true);
  ASSERT_EQ(kiln_function_call(fe, in, &le), 0) << kiln_last_error();
  {
    Poison on(true);
    ASSERT_EQ(kiln_function_call(fs, in, &ls), 0) << kiln_last_error();
  }
  EXPECT_NEAR(kiln_tensor_item(le), kiln_tensor_item(ls), 1e-5);
  for (int i = 0; i < 6; i++) {
    auto a = read<float>(eager_m.v[i]), b = read<float>(staged_m.v[i]);
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); k++) ASSERT_NEAR(a[k], b[k], 1e-6) << "variable " << i << " element " << k;
  }

  // the traced program through fuse and buffers alone, and the optimized one
  char *traced = kiln_function_ir(fs, 0, "traced"), *optimized = kiln_function_ir(fs, 0, "optimized");
  ASSERT_TRUE(traced && optimized) << kiln_last_error();
  Module t(traced), o(optimized);
  free(traced);
  free(optimized);
  ASSERT_TRUE(t.m && o.m);
  ir_func *tf = t.func("mlp_step"), *of = o.func("mlp_step");
  int traced_ops = tf->n_instrs;
  pass_all(t.m, kiln_pass_fuse);
  int fused_ops = tf->n_instrs;
  pass_all(t.m, kiln_pass_buffers);
  pass_buffer_stats a = stats_of(tf), b = stats_of(of);
  kiln_stats st;
  ASSERT_EQ(kiln_function_stats(fs, 0, &st), 0);
  EXPECT_EQ(st.kernels, b.kernels);
  EXPECT_EQ((int64_t)st.peak_bytes, b.peak_bytes);
  EXPECT_EQ((int64_t)st.unshared_bytes, b.unshared_bytes);
  EXPECT_LE((double)b.peak_bytes, 1.1 * (double)b.lower_bound) << "the goal: peak within 10% of the bound";
  EXPECT_LT(b.kernels, traced_ops / 2);
  std::printf("[ report   ] MLP 784-256-256-10 training step, batch 64\n"
              "[ report   ] fuse,buffers alone: ops %d -> %d, kernels %d (%d fusions), peak %lld B, unshared %lld B, "
              "lower bound %lld B, in place %d\n"
              "[ report   ] default pipeline:   ops %d -> %d, kernels %d (%d fusions), peak %lld B, unshared %lld B, "
              "lower bound %lld B, in place %d\n",
              traced_ops, fused_ops, a.kernels, count_ops(tf, OP_FUSION), (long long)a.peak_bytes,
              (long long)a.unshared_bytes, (long long)a.lower_bound, a.in_place, st.traced_ops, of->n_instrs,
              b.kernels, count_ops(of, OP_FUSION), (long long)b.peak_bytes, (long long)b.unshared_bytes,
              (long long)b.lower_bound, b.in_place);
  kiln_function_free(fe);
  kiln_function_free(fs);
}

}  // namespace

// The library's label check (a host call whose only effect is to fail) is
// no fusion barrier: the work on both sides of it joins one kernel, as the
// forward and backward passes around a staged loss do. A user's host call
// still is one.
TEST(Fuse, TheLabelCheckIsNoBarrier) {
  Scoped scope;
  static const char *const kText[2] = {R"(
func @f(%x: f32[8,16], %l: i64[8], %k: bool[0,16]) -> (f32[8,16], i64[8]) {
  %y = mul %x, %x : f32[8,16]
  %c = host_call @kiln.check_labels(%l, %k) : i64[8]
  %z = add %y, %x : f32[8,16]
  return %z, %c
}
)",
                                        R"(
func @f(%x: f32[8,16], %l: i64[8], %k: bool[0,16]) -> (f32[8,16], i64[8]) {
  %y = mul %x, %x : f32[8,16]
  %c = host_call @kiln_test_no_such_symbol(%l, %k) : i64[8]
  %z = add %y, %x : f32[8,16]
  return %z, %c
}
)"};
  for (int user = 0; user < 2; user++) {
    Module m(kText[user]);
    ASSERT_TRUE(m.m);
    ir_func *f = m.func("f");
    ASSERT_EQ(kiln_pass_fuse(f), 0) << kiln_last_error();
    EXPECT_EQ(count_ops(f, OP_FUSION), user ? 0 : 1) << m.text();
    EXPECT_EQ(count_ops(f, OP_HOST_CALL), 1) << m.text();
  }
}

namespace {

// A cheap chain over two large parameters, a + b, read by `readers`
// reductions over different axes (so each is a kernel of its own): the
// fused module's top function.
std::string two_leaf_chain(int readers) {
  std::string s = "func @f(%a: f32[64,64], %b: f32[64,64]) -> (";
  for (int r = 0; r < readers; r++) s += r ? ", f32[64]" : "f32[64]";
  s += ") {\n  %s = add %a, %b : f32[64,64]\n  %t = mul %s, %s : f32[64,64]\n";
  for (int r = 0; r < readers; r++) {
    std::string k = std::to_string(r);
    // reader r: exp(t) + r summed over axis r % 2 (readers over one axis
    // differ in their constant, so CSE keeps them apart)
    s += "  %c" + k + " = constant dense<" + k + ".0> : f32[]\n";
    s += "  %e" + k + " = add %t, %c" + k + " : f32[64,64]\n";
    s += "  %r" + k + " = reduce_sum %e" + k + " {axes=[" + std::to_string(r % 2) + "], keepdims=false} : f32[64]\n";
  }
  s += "  return ";
  for (int r = 0; r < readers; r++) s += (r ? ", %r" : "%r") + std::to_string(r);
  return s + "\n}\n";
}

}  // namespace

// fuse.c's cost model for cheap chains over two large values: each of up to
// three readers computes the chain again (one more read each, no write);
// with four or more, the chain is written once and read (a write costs
// about two reads). Either way the results keep their bits.
TEST(Fuse, ChainsOverTwoValuesAreComputedAgainByUpToThreeReaders) {
  Scoped s;
  for (int readers : {2, 3, 4, 5}) {
    SCOPED_TRACE(readers);
    Module plain(two_leaf_chain(readers).c_str()), fused(two_leaf_chain(readers).c_str());
    ASSERT_NE(plain.m, nullptr);
    pass_all(fused.m, kiln_pass_fuse);
    const ir_func *top = fused.func("f");
    ASSERT_NE(top, nullptr);
    int written = 0;  // values of [64,64] the top function writes
    for (int i = 0; i < top->n_instrs; i++)
      for (int r = 0; r < top->instrs[i].n_out; r++) {
        const op_type *t = &top->types[top->instrs[i].out + r];
        written += t->rank == 2 && t->shape[0] == 64 && t->shape[1] == 64;
      }
    EXPECT_EQ(written, readers <= 3 ? 0 : 1) << fused.text();
    std::vector<kiln_tensor *> args = {kiln_random_normal(KILN_F32, KILN_SHAPE(64, 64)),
                                       kiln_random_normal(KILN_F32, KILN_SHAPE(64, 64))};
    EXPECT_TRUE(same_results(run(plain.func("f"), args), run(top, args)));
  }
}
