// arena_test.cc — the compiled program's arena (backends/plan/arena.c):
// arena slots that are never live at once share bytes, so the CPU arena
// stays near the buffers pass's plan although the plan makes values the
// pass never saw (inlined calls, regions of control flow, split
// reductions' partials, loop temporaries). Every program compiled here runs
// under KILN_POISON=1 (the arena starts as 0xff bytes; user_programs_test.cc
// sets it for the whole binary, and the first test here too) and equals the
// interpreter: a slot given bytes that another live slot holds shows as
// wrong results. Random programs (tests/ir_gen.cc) of every kind, with
// control flow, windows and dense blocks; loops whose bodies make
// temporaries; branches; ResNet's gradient function.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "../bench/resnet_model.h"
#include "cpu/cpu.h"
#include "ir.h"
#include "ir_gen.h"
#include "may_jump.h"
#include "passes.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

// set before the first compiled call of the process (run.c reads it once)
const bool poisoned = (setenv("KILN_POISON", "1", 0), true);

struct Figures {
  int programs = 0, shrunk = 0, control = 0;
  double packed = 0, unpacked = 0;
};

// Compiled (after the default pipeline, or as it is) under poison ==
// interpreted before the pipeline; the arena no bigger than before packing.
// "" or what went wrong.
std::string check_one(ir_func *f, uint64_t seed, bool optimize, Figures *fig) {
  std::vector<bool> jumps = may_jump(f, true);
  std::vector<bool> unchecked((size_t)f->n_results);
  for (int r = 0; r < f->n_results; r++) unchecked[(size_t)r] = jumps[(size_t)f->results[r]];
  bool control = false;
  for (int i = 0; i < f->n_instrs; i++) control = control || ir_op_info(f->instrs[i].op)->kind == OPK_CONTROL;
  kiln_scope_push();
  std::vector<kiln_tensor *> args((size_t)f->n_params + 1), want((size_t)f->n_results + 1),
      got((size_t)f->n_results + 1);
  std::string problem;
  cpu_options strict{};
  strict.no_contract = true;
  cpu_program *c = nullptr;
  if (ir_gen_args(f, seed, args.data()) || ir_interpret(f, args.data(), want.data())) {
    problem = std::string("no reference: ") + kiln_last_error();
  } else if (optimize && pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr)) {
    problem = std::string("pipeline: ") + kiln_last_error();
  } else if (!(c = cpu_compile_with(f, &strict))) {
    problem = std::string("compile: ") + kiln_last_error();
  } else if (cpu_run(c, args.data(), got.data())) {
    problem = std::string("run: ") + kiln_last_error();
  } else {
    for (int r = 0; r < f->n_results && problem.empty(); r++)
      if (!unchecked[(size_t)r] && !allclose(got[(size_t)r], want[(size_t)r], 1e-5, 1e-5))
        problem = "result " + std::to_string(r) + " differs from the interpreter's";
    if (c->arena_bytes > c->arena_unpacked_bytes)
      problem += " arena " + std::to_string(c->arena_bytes) + " > unpacked " + std::to_string(c->arena_unpacked_bytes);
    fig->programs++;
    fig->control += control;
    fig->shrunk += c->arena_bytes < c->arena_unpacked_bytes;
    fig->packed += (double)c->arena_bytes;
    fig->unpacked += (double)c->arena_unpacked_bytes;
  }
  cpu_program_free(c);
  kiln_scope_pop();
  return problem;
}

Figures check_random(unsigned kinds, unsigned dtypes, int n, bool optimize) {
  Figures fig;
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= kinds;
  if (dtypes) o.dtypes = dtypes;
  /* programs long enough to leave temporaries beside their kernels: a
   * reduction's kernel stores its elementwise side outputs itself
   * (plan_kernel.n_side), so short programs leave few to pack */
  if (kinds & (IR_GEN_DENSE | IR_GEN_WINDOW | IR_GEN_CONTROL)) o.min_instrs = 30, o.max_instrs = 60;
  int failed = 0;
  std::string seeds;
  for (uint64_t seed = 1; seed <= (uint64_t)n; seed++) {
    ir_module *m = ir_gen_program(seed, &o);
    if (!m) {
      ADD_FAILURE() << "seed " << seed << ": " << kiln_last_error();
      continue;
    }
    char *text = ir_print_module(m);
    std::string problem = check_one(ir_module_find(m, "gen"), seed, optimize, &fig);
    if (!problem.empty()) {
      if (failed < 2) ADD_FAILURE() << "seed " << seed << ": " << problem << "\n" << text;
      failed++;
      seeds += " " + std::to_string(seed);
    }
    std::free(text);
    ir_module_free(m);
  }
  EXPECT_EQ(failed, 0) << "seeds:" << seeds;
  std::printf("  %d programs (%d with control flow), %d arenas shrunk, %.0f bytes in all against %.0f unpacked\n",
              fig.programs, fig.control, fig.shrunk, fig.packed, fig.unpacked);
  return fig;
}

TEST(Arena, PoisonIsOn) { EXPECT_TRUE(poisoned && getenv("KILN_POISON")); }

TEST(Arena, RandomProgramsCompiledUnderPoisonEqualTheInterpreter) {
  Scoped s;
  Figures a = check_random(0, 0, 120, true);
  EXPECT_EQ(a.programs, 120);
  EXPECT_GT(a.shrunk, 10) << "programs whose arena packing shrank";
  Figures raw = check_random(0, DT_BIT(KILN_F32) | DT_BIT(KILN_F64), 60, false);  // no buffers plan: all appended
  EXPECT_GT(raw.shrunk, 30);
  EXPECT_LT(raw.packed, 0.8 * raw.unpacked);
}

TEST(Arena, RandomControlFlowProgramsCompiledUnderPoisonEqualTheInterpreter) {
  Scoped s;
  Figures a = check_random(IR_GEN_CONTROL, 0, 150, true);
  EXPECT_GT(a.control, 60) << "programs with cond, while or scan";
  EXPECT_GT(a.shrunk, 30);
  EXPECT_LT(a.packed, 0.9 * a.unpacked);
  Figures raw = check_random(IR_GEN_CONTROL, DT_BIT(KILN_F32) | DT_BIT(KILN_F64), 60, false);
  EXPECT_GT(raw.control, 20);
}

TEST(Arena, RandomConvAndDenseProgramsCompiledUnderPoisonEqualTheInterpreter) {
  Scoped s;
  Figures w = check_random(IR_GEN_WINDOW, DT_BIT(KILN_F32) | DT_BIT(KILN_F64), 80, true);
  // windows alone leave almost nothing to pack (their values are the pass's,
  // cheap chains are computed again where they are read, and a reduction's
  // kernel stores its side outputs itself): the packing is exercised with
  // windows by the programs with control flow and the dense ones below
  EXPECT_EQ(w.programs, 80);
  Figures wc = check_random(IR_GEN_WINDOW | IR_GEN_CONTROL, DT_BIT(KILN_F32) | DT_BIT(KILN_F64), 60, true);
  EXPECT_GT(wc.control, 20);
  EXPECT_GT(wc.shrunk, 5);
  Figures d = check_random(IR_GEN_DENSE, DT_BIT(KILN_F32) | DT_BIT(KILN_F64), 40, true);
  EXPECT_EQ(d.programs, 40);
  EXPECT_GT(d.shrunk, 10);
}

// ---- hand-written programs: the bound ----

struct Compiled {
  ir_module *m = nullptr;
  cpu_program *p = nullptr;
  explicit Compiled(const char *text) {
    m = ir_parse(text, "arena_test.kir");
    if (!m) {
      ADD_FAILURE() << kiln_last_error();
      return;
    }
    p = cpu_compile(ir_module_find(m, "f"));
    if (!p) ADD_FAILURE() << kiln_last_error();
  }
  ~Compiled() {
    cpu_program_free(p);
    ir_module_free(m);
  }
  const ir_func *f() const { return ir_module_find(m, "f"); }
  // run under poison == interpreted
  void check(const std::vector<kiln_tensor *> &args, double tol = 1e-6) {
    ASSERT_NE(p, nullptr);
    std::vector<kiln_tensor *> want((size_t)f()->n_results), got((size_t)f()->n_results);
    ASSERT_EQ(ir_interpret(f(), args.data(), want.data()), 0) << kiln_last_error();
    ASSERT_EQ(cpu_run(p, args.data(), got.data()), 0) << kiln_last_error();
    for (size_t r = 0; r < want.size(); r++) {
      EXPECT_TRUE(allclose(got[r], want[r], tol, tol)) << "result " << r;
      double sum = 0;  // not all but zero: a wrong value would not hide
      for (double v : values(want[r])) sum += std::fabs(v);
      EXPECT_GT(sum, 0.05 * (double)values(want[r]).size()) << "result " << r << ": " << sum;
    }
  }
};

// normal values times scale
kiln_tensor *normal_times(const V64 &shape, double scale) {
  return kiln_mul(kiln_random_normal(KILN_F32, (int)shape.size(), shape.data()), kiln_scalar(KILN_F32, scale));
}

const int64_t kMat = 64 * 64 * 4;  // bytes of an f32[64,64]

// A while loop whose body makes a chain of 64x64 matrices (dots: calls,
// and kernels, each a temporary of the body; scaled so that tanh does not
// saturate and hide a wrong value): they shared nothing; now about two
// (one read while the next is made), the state's and the captured %v's. %v is a temporary made before the loop and
// read only by the body's first step: it lives over the whole loop, else
// the second iteration reads a matrix that took its bytes.
TEST(Arena, ALoopBodysTemporariesShareBytes) {
  Scoped s;
  Compiled c(
      "func @f(%x: f32[64,64], %w: f32[64,64]) -> f32[64,64] {\n"
      "  %z = constant dense<0> : i32[]\n"
      "  %k = constant dense<0.5> : f32[]\n"
      "  %kb = broadcast %k {shape=[64,64]} : f32[64,64]\n"
      "  %w2 = mul %w, %kb : f32[64,64]\n"
      "  %i, %y = while %z, %x, %w2 {state=2, max_iterations=5} : i32[], f32[64,64]\n"
      "    cond func @f.cond(%j: i32[], %a: f32[64,64], %v: f32[64,64]) -> bool[] {\n"
      "      %n = constant dense<3> : i32[]\n"
      "      %0 = lt %j, %n : bool[]\n"
      "      return %0\n"
      "    }\n"
      "    body func @f.body(%j: i32[], %a: f32[64,64], %v: f32[64,64]) -> (i32[], f32[64,64]) {\n"
      "      %one = constant dense<1> : i32[]\n"
      "      %0 = add %j, %one : i32[]\n"
      "      %1 = dot %a, %v : f32[64,64]\n"
      "      %2 = tanh %1 : f32[64,64]\n"
      "      %c = constant dense<0.3> : f32[]\n"
      "      %s = broadcast %c {shape=[64,64]} : f32[64,64]\n"
      "      %3 = dot %2, %2 : f32[64,64]\n"
      "      %4 = mul %3, %s : f32[64,64]\n"
      "      %5 = tanh %4 : f32[64,64]\n"
      "      %6 = dot %5, %2 : f32[64,64]\n"
      "      %7 = mul %6, %s : f32[64,64]\n"
      "      %8 = tanh %7 : f32[64,64]\n"
      "      return %0, %8\n"
      "    }\n"
      "  return %y\n"
      "}\n");
  ASSERT_NE(c.p, nullptr);
  EXPECT_GE(c.p->arena_unpacked_bytes, (size_t)(9 * kMat));
  EXPECT_LE(c.p->arena_bytes, (size_t)(6 * kMat)) << "unpacked " << c.p->arena_unpacked_bytes;
  c.check({normal_times({64, 64}, 1.0), normal_times({64, 64}, 1.0)}, 1e-4);
}

// A scan whose body makes temporaries, and a cond whose branches each make
// some: only one branch runs, so the two share bytes.
TEST(Arena, ScanBodiesAndCondBranchesShareBytes) {
  Scoped s;
  Compiled c(
      "func @f(%p: bool[], %x: f32[64,64], %w: f32[64,64], %xs: f32[3,64,64]) -> (f32[64,64], f32[3,64,64]) {\n"
      "  %r = cond %p, %x, %w : f32[64,64]\n"
      "    then func @f.then(%a: f32[64,64], %v: f32[64,64]) -> f32[64,64] {\n"
      "      %0 = dot %a, %v : f32[64,64]\n"
      "      %1 = dot %0, %v : f32[64,64]\n"
      "      %2 = dot %1, %v : f32[64,64]\n"
      "      return %2\n"
      "    }\n"
      "    else func @f.else(%a: f32[64,64], %v: f32[64,64]) -> f32[64,64] {\n"
      "      %0 = dot %v, %a : f32[64,64]\n"
      "      %1 = dot %v, %0 : f32[64,64]\n"
      "      %2 = dot %v, %1 : f32[64,64]\n"
      "      return %2\n"
      "    }\n"
      "  %c, %ys = scan %r, %xs, %w {carry=1, xs=1, length=3, reverse=false} : f32[64,64], f32[3,64,64]\n"
      "    body func @f.s(%k: f32[64,64], %t: f32[64,64], %v: f32[64,64]) -> (f32[64,64], f32[64,64]) {\n"
      "      %0 = dot %k, %v : f32[64,64]\n"
      "      %1 = dot %0, %t : f32[64,64]\n"
      "      %2 = dot %1, %v : f32[64,64]\n"
      "      %3 = tanh %2 : f32[64,64]\n"
      "      %4 = dot %3, %t : f32[64,64]\n"
      "      return %3, %4\n"
      "    }\n"
      "  return %c, %ys\n"
      "}\n");
  ASSERT_NE(c.p, nullptr);
  EXPECT_GE(c.p->arena_unpacked_bytes, (size_t)(9 * kMat));
  EXPECT_LE(c.p->arena_bytes, (size_t)(5 * kMat)) << "unpacked " << c.p->arena_unpacked_bytes;
  kiln_tensor *yes = kiln_scalar(KILN_BOOL, 1), *no = kiln_scalar(KILN_BOOL, 0);
  for (kiln_tensor *p : {yes, no}) c.check({p, normal_times({64, 64}, 1.0), normal_times({64, 64}, 0.15), normal_times({3, 64, 64}, 0.15)}, 1e-4);
}

// Known bug (issue 16's ResNet-50 bench), fixed: the plan appended every
// value the buffers pass left unplaced at the arena's end, with no reuse
// (the small ResNet's gradient function: 2,262,336 bytes against the pass's
// 778,496; ResNet-50's training step at batch 8: 4.72 GB against 1.70 GB).
// Its inference function too (tests/resnet_test.cc compares staged and
// eager values, under poison).
TEST(Arena, ResNetFunctionsNearTheBuffersPlan) {
  Scoped s;
  resnet_config cfg = resnet_check_config();
  kiln_random_seed(3);
  resnet_model *m = resnet_new(&cfg, nullptr);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  resnet_stage st = {m, nullptr};
  for (int grads = 0; grads < 2; grads++) {
    kiln_function *f = grads ? kiln_function_new("resnet_arena", resnet_grads_body, &st, 2, 1 + m->ntrain)
                             : kiln_function_new("resnet_arena", resnet_infer_body, &st, 1, 1);
    kiln_tensor *x = kiln_random_normal(KILN_F64, 4, V64{2, 32, 32, 3}.data());
    kiln_tensor *labels = i64({2}, {1, 7});
    kiln_tensor *in[2] = {x, labels}, *out[RN_MAX_VARS + 1] = {};
    ASSERT_EQ(kiln_function_call(f, in, out), 0) << kiln_last_error();
    char *text = kiln_function_ir(f, 0, "optimized");
    ASSERT_NE(text, nullptr) << kiln_last_error();
    ir_module *mod = ir_parse(text, "resnet.kir");
    std::free(text);
    ASSERT_NE(mod, nullptr) << kiln_last_error();
    ir_func *entry = ir_module_find(mod, "resnet_arena");
    ASSERT_NE(entry, nullptr);
    cpu_program *p = cpu_compile(entry);
    ASSERT_NE(p, nullptr) << kiln_last_error();
    int64_t planned = entry->arena_bytes;
    EXPECT_GT(planned, 0);
    EXPECT_LE((double)p->arena_bytes, 1.25 * (double)planned)
        << (grads ? "grads" : "infer") << ": CPU arena " << p->arena_bytes << " bytes, buffers pass " << planned
        << ", unpacked " << p->arena_unpacked_bytes;
    std::printf("  %s: arena %zu bytes (unpacked %zu), buffers pass %lld\n", grads ? "grads" : "infer", p->arena_bytes,
                p->arena_unpacked_bytes, (long long)planned);
    // the staged call ran this program (KILN_BACKEND=cpu) or another
    // backend's: its values against eager are resnet_test.cc's
    for (int r = 0; r < (grads ? 1 + m->ntrain : 1); r++) ASSERT_NE(out[r], nullptr) << r;
    cpu_program_free(p);
    ir_module_free(mod);
    kiln_function_free(f);
  }
  resnet_free(m);
}

}  // namespace
