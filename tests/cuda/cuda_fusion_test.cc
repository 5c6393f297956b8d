// cuda_fusion_test.cc — a fusion led by a dot or a conv2d with an
// elementwise epilogue (a bias, a residual, an activation, an update) on
// the CUDA backend: the head's own kernel into a temporary, then ONE kernel
// for the rest of the body, where the body inlined op by op (as such a
// fusion was before) launches a kernel per epilogue op. Checked against the
// fake driver (tests/fake_cuda: the launches and their buffers), with ptxas
// (sm_80, sm_90), for values on the host (kiln_debug_cuda_run: the plan's
// steps, the fused kernel by its very element code in LLVM's interpreter)
// against the reference interpreter, and over random programs
// (tests/ir_gen) holding such fusions after the default pipeline.
//
// Part of the cuda_runtime_test executable (its main points the runtime at
// the fake driver).
#include <gmock/gmock.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "../ir_gen.h"
#include "../ir_test_util.h"
#include "../test_util.h"
#include "cuda/cuda_rt.h"
#include "cuda/ptx.h"
#include "cuda_test_util.h"
#include "fake_access.h"
#include "fusion_cases.h"
#include "ir.h"
#include "../../passes/passes.h"

using namespace kiln_test;

namespace {

struct FuseTest : Scoped {
  FuseTest() { clear_launches(); }
  ~FuseTest() { EXPECT_EQ(ctx_depth(), 0) << "a CUDA context was left current"; }
};

struct Program {
  cuda_program *p;
  explicit Program(const ir_func *f, const char *arch = "sm_90") : p(f ? cuda_compile(f, arch) : nullptr) {
    EXPECT_NE(p, nullptr) << error();
  }
  ~Program() { cuda_program_free(p); }
};

// the launches of a run of p (compiled from f) on gpu:0 of the fake over args
std::vector<fake_launch> launches_of(const cuda_program *p, const ir_func *f, std::vector<kiln_tensor *> args) {
  for (kiln_tensor *&a : args) a = on("gpu:0", a);
  std::vector<kiln_tensor *> out((size_t)f->n_results + 1, nullptr);
  clear_launches();
  EXPECT_EQ(cuda_program_run(const_cast<cuda_program *>(p), 0, args.data(), out.data()), 0) << error();
  return launches();
}

// ir_gen_args' random arguments of f
std::vector<kiln_tensor *> args_of(const ir_func *f, uint64_t seed) {
  std::vector<kiln_tensor *> a((size_t)f->n_params + 1, nullptr);
  EXPECT_EQ(ir_gen_args(f, seed, a.data()), 0) << error();
  a.pop_back();
  return a;
}

bool has_ref(const cuda_step *st, const cuda_ref &r) {
  for (int q = 0; q < st->n_bufs; q++)
    if (st->bufs[q].kind == r.kind && st->bufs[q].index == r.index && st->bufs[q].offset == r.offset) return true;
  return false;
}

// The head (conv2d or dot) and epilogue pairs of the top-level steps: a
// head's kernel right before a fusion's kernel that reads the head's output
int head_epilogue_pairs(const cuda_program *p) {
  int n = 0;
  for (int s = 0; s + 1 < p->n_steps; s++) {
    const cuda_step *h = &p->steps[s], *e = &p->steps[s + 1];
    if (h->kind == CUDA_STEP_KERNEL && e->kind == CUDA_STEP_KERNEL && e->kernel_op == OP_FUSION &&
        (h->kernel_op == OP_DOT || h->kernel_op == OP_CONV2D) && h->n_bufs && has_ref(e, h->bufs[0]))
      n++;
  }
  return n;
}

// f's results by the host run of its CUDA plan against the interpreter's
::testing::AssertionResult host_run_matches(const ir_func *f, const std::vector<kiln_tensor *> &args) {
  std::vector<kiln_tensor *> want((size_t)f->n_results + 1, nullptr), got((size_t)f->n_results + 1, nullptr);
  if (ir_interpret(f, args.data(), want.data())) return ::testing::AssertionFailure() << "interpreter: " << error();
  for (int r = 0; r < f->n_results; r++) {
    const op_type &t = f->types[f->results[r]];
    if (!(got[(size_t)r] = kiln_zeros(t.dtype, t.rank, t.shape))) return ::testing::AssertionFailure() << error();
  }
  if (kiln_debug_cuda_run(f, args.data(), got.data())) return ::testing::AssertionFailure() << "host run: " << error();
  for (int r = 0; r < f->n_results; r++) {
    bool f32 = kiln_tensor_dtype(want[(size_t)r]) == KILN_F32;
    double rtol = f32 ? 1e-4 : 1e-10, atol = f32 ? 1e-5 : 1e-12;  // sums in another order, GPU math
    VD g = values(got[(size_t)r]), w = values(want[(size_t)r]);
    for (size_t i = 0; i < g.size(); i++)
      if (!(std::isnan(w[i]) ? std::isnan(g[i]) : std::fabs(g[i] - w[i]) <= atol + rtol * std::fabs(w[i])))
        return ::testing::AssertionFailure() << "result " << r << " element " << i << ": " << g[i] << ", want " << w[i];
  }
  return ::testing::AssertionSuccess();
}

op_id head_op(FusionKind k) { return k == kConvBiasRelu || k == kConvBiasResidualRelu ? OP_CONV2D : OP_DOT; }

}  // namespace

// Each kind: two kernels, the head's and the epilogue's, launched in that
// order; the head writes a temporary of the arena that the epilogue reads
// and the epilogue writes the result. The same body as a call (inlined op
// by op, as a fusion was before): the head and a kernel per epilogue op.
TEST(CudaFusion, AHeadAndItsWholeEpilogueAreTwoLaunches) {
  FuseTest t;
  for (int k = 0; k < kFusionKinds; k++) {
    FusionKind kind = (FusionKind)k;
    SCOPED_TRACE(kFusionKindNames[k]);
    FusionCase c = fusion_case(kind, 11 + (uint64_t)k, 0);
    Mod fused(c.fn), called(c.call);
    const ir_func *f = fused.f("f");
    ASSERT_NE(f, nullptr);
    Program p(f);
    ASSERT_NE(p.p, nullptr);
    ASSERT_EQ(p.p->n_steps, 2) << c.fn;
    ASSERT_EQ(cuda_program_kernels(p.p), 2);
    const cuda_step *h = &p.p->steps[0], *e = &p.p->steps[1];
    EXPECT_EQ(h->kernel_op, head_op(kind));
    EXPECT_EQ(e->kernel_op, OP_FUSION);
    ASSERT_GT(h->n_bufs, 0);
    EXPECT_EQ(h->bufs[0].kind, CUDA_REF_ARENA) << "the head writes a temporary";
    EXPECT_TRUE(has_ref(e, h->bufs[0])) << "the epilogue reads it";
    EXPECT_EQ(e->bufs[0].kind, CUDA_REF_RESULT) << "and writes the result";
    EXPECT_EQ(head_epilogue_pairs(p.p), 1);
    std::vector<fake_launch> l = launches_of(p.p, f, args_of(f, 1));
    ASSERT_EQ(l.size(), 2u);
    EXPECT_STREQ(l[0].name, h->name);
    EXPECT_STREQ(l[1].name, e->name);
    for (const fake_launch &x : l) EXPECT_EQ(x.bad_params, 0);

    const ir_func *g = called.f("f");
    ASSERT_NE(g, nullptr);
    Program q(g);
    ASSERT_NE(q.p, nullptr);
    size_t inlined = launches_of(q.p, g, args_of(g, 1)).size();
    EXPECT_EQ(inlined, 1u + (size_t)c.epilogue_ops);
    std::printf("[fusion] %s: %zu launches op by op, %zu fused\n", kFusionKindNames[k], inlined, l.size());
  }
}

// The fused programs, f32 and f64, assemble for sm_80 and sm_90.
TEST(CudaFusion, FusedProgramsAssemble) {
  Scoped s;
  int n = 0;
  for (int k = 0; k < kFusionKinds; k++)
    for (int f64 = 0; f64 < 2; f64++)
      for (uint64_t seed = 1; seed <= 2; seed++) {
        FusionCase c = fusion_case((FusionKind)k, seed * 7 + (uint64_t)k, f64);
        SCOPED_TRACE(c.fn);
        Mod m(c.fn);
        for (const char *arch : {"sm_80", "sm_90"}) {
          Program p(m.f("f"), arch);
          ASSERT_NE(p.p, nullptr);
          EXPECT_EQ(cuda_program_kernels(p.p), 2);
          if (have_ptxas()) {
            EXPECT_EQ(ptxas(p.p->ptx, arch), "");
          }
          n++;
        }
      }
  EXPECT_EQ(n, 32);
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

// Random cases of every kind (f32 and f64, biases of [n], [1, n] and
// broadcast, batched dots) on the host: the plan's two steps, the epilogue
// by the fused kernel's element code, against the reference interpreter.
TEST(CudaFusion, TheFusedEpilogueMatchesTheInterpreter) {
  Scoped s;
  for (int k = 0; k < kFusionKinds; k++)
    for (uint64_t seed = 1; seed <= 8; seed++) {
      FusionCase c = fusion_case((FusionKind)k, 100 * seed + (uint64_t)k, (int)(seed % 2));
      SCOPED_TRACE(c.fn);
      Mod m(c.fn);
      const ir_func *f = m.f("f");
      ASSERT_NE(f, nullptr);
      Program p(f);
      ASSERT_NE(p.p, nullptr);
      EXPECT_EQ(cuda_program_kernels(p.p), 2);
      EXPECT_TRUE(host_run_matches(f, args_of(f, seed)));
    }
}

// What the host run does not run, it says (no silent zeros).
TEST(CudaFusion, TheHostRunRefusesWhatItCannotRun) {
  Scoped s;
  Mod m("func @f(%x: f32[4,6]) -> f32[4] {\n"
        "  %s = reduce_sum %x {axes=[1]} : f32[4]\n"
        "  return %s\n"
        "}\n");
  const ir_func *f = m.f("f");
  ASSERT_NE(f, nullptr);
  kiln_tensor *x = kiln_zeros(KILN_F32, KILN_SHAPE(4, 6)), *r = kiln_zeros(KILN_F32, KILN_SHAPE(4));
  EXPECT_EQ(kiln_debug_cuda_run(f, &x, &r), -1);
  EXPECT_THAT(error(), ::testing::HasSubstr("no host run of a reduce_sum kernel"));
  EXPECT_EQ(kiln_debug_cuda_run(f, &r, &r), -1);
  EXPECT_THAT(error(), ::testing::HasSubstr("argument 0 is not a CPU tensor of the parameter's type"));
}

// Random programs with dots, dense layers' backward passes and window ops
// after the default pipeline: every kernel step is launched once, in
// order (the fake's launches), the PTX has an .entry per kernel and
// assembles, each dot- or conv2d-led fusion is its head and one epilogue
// kernel, and where the host run covers the plan its values match the
// interpreter's.
TEST(CudaFusion, RandomProgramsKeepTheirLaunchAccounting) {
  FuseTest t;
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_WINDOW | IR_GEN_DENSE;
  int pairs = 0, compared = 0;
  for (int i = 0; i < 60; i++) {
    uint64_t seed = 500 + (uint64_t)i;
    ir_module *m = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << error();
    ir_func *f = m->funcs[0];
    ASSERT_EQ(pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << error();
    char *text = ir_print_module(m);
    std::string what = "seed " + std::to_string(seed) + "\n" + (text ? text : "");
    free(text);
    SCOPED_TRACE(what);
    {
      Program p(f);
      ASSERT_NE(p.p, nullptr);
      std::vector<const cuda_step *> want;
      for (int s = 0; s < p.p->n_steps; s++)
        if (p.p->steps[s].kind == CUDA_STEP_KERNEL && p.p->steps[s].grid[0]) want.push_back(&p.p->steps[s]);
      std::vector<fake_launch> got = launches_of(p.p, f, args_of(f, seed));
      ASSERT_EQ(got.size(), want.size());
      for (size_t k = 0; k < got.size(); k++) EXPECT_STREQ(got[k].name, want[k]->name);
      std::string ptx = p.p->ptx;
      int entries = 0;
      for (size_t at = ptx.find(".entry "); at != std::string::npos; at = ptx.find(".entry ", at + 1)) entries++;
      EXPECT_EQ(entries, cuda_program_kernels(p.p));
      int here = head_epilogue_pairs(p.p);
      pairs += here;
      if (have_ptxas() && (here || i % 6 == 0)) {
        EXPECT_EQ(ptxas(ptx, "sm_90"), "");
      }
      if (have_ptxas() && here && i % 3 == 0) {
        Program q(f, "sm_80");
        ASSERT_NE(q.p, nullptr);
        EXPECT_EQ(ptxas(q.p->ptx, "sm_80"), "");
      }
    }
    std::vector<kiln_tensor *> args = args_of(f, seed), res((size_t)f->n_results + 1, nullptr);
    for (int r = 0; r < f->n_results; r++) {
      const op_type &ty = f->types[f->results[r]];
      res[(size_t)r] = kiln_zeros(ty.dtype, ty.rank, ty.shape);
    }
    if (kiln_debug_cuda_run(f, args.data(), res.data()) == 0) {
      EXPECT_TRUE(host_run_matches(f, args));
      compared++;
    } else {
      EXPECT_THAT(error(), ::testing::HasSubstr("host run")) << "refused, saying why";
    }
    ir_module_free(m);
    if (HasFailure()) break;
  }
  std::printf("[fusion] 60 random programs: %d head + epilogue pairs, %d run on the host\n", pairs, compared);
  EXPECT_GE(pairs, 10) << "the corpus holds dot- and conv2d-led fusions";
  EXPECT_GE(compared, 10);
}
