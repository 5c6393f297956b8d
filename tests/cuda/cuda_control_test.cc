// cuda_control_test.cc — control flow compiled by the CUDA backend (a
// cond, while or scan step holding nested step lists, run by the host in
// backends/cuda/launch.c) against tests/fake_cuda. The fake cannot run a
// kernel, so what a predicate kernel computes is scripted
// (fake_cuda_launch_script): a while's predicate kernel writing 1, 1, 1, 0
// runs the body three times. Checked: which kernels launch how often, the
// rows' device addresses a scan passes each iteration, that the predicate
// is read back in stream order, the error word raised inside a loop, the
// PTX cache of nested kernels, and staged functions with control flow
// compiled (not interpreted) on a GPU.
//
// Part of the cuda_runtime_test executable (its main points the runtime at
// the fake driver).
#include <dlfcn.h>
#include <gmock/gmock.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "../test_util.h"
#include "cuda_test_util.h"
#include "cuda/cuda_rt.h"
#include "cuda/ptx.h"
#include "fake_access.h"
#include "ir.h"

extern "C" const ir_func *jit_optimized_func(kiln_function *f, int trace);

using namespace kiln_test;
using ::testing::HasSubstr;

namespace {

// launches per kernel name
std::map<std::string, int> counts(const std::vector<fake_launch> &l) {
  std::map<std::string, int> m;
  for (const fake_launch &x : l) m[x.name]++;
  return m;
}

struct GpuTest : Scoped {
  GpuTest() {
    clear_launches();
    no_scripts();
  }
  ~GpuTest() {
    no_scripts();
    EXPECT_EQ(ctx_depth(), 0) << "a CUDA context was left current";
  }
};

struct Mod {
  ir_module *m;
  explicit Mod(const std::string &text) : m(ir_parse(text.c_str(), "control.kir")) {
    EXPECT_NE(m, nullptr) << error();
  }
  ~Mod() { ir_module_free(m); }
  const ir_func *f(const char *name) const {
    for (int i = 0; m && i < m->n_funcs; i++)
      if (!strcmp(m->funcs[i]->name, name)) return m->funcs[i];
    return nullptr;
  }
};

struct Prog {
  cuda_program *p;
  Prog(const ir_func *f, const char *arch = "sm_90") : p(f ? cuda_compile(f, arch) : nullptr) {
    EXPECT_NE(p, nullptr) << error();
  }
  ~Prog() { cuda_program_free(p); }
};

// the kernel steps of a step list and its nested lists, in order
void kernels_of(const cuda_step *steps, int n, std::vector<const cuda_step *> &out) {
  for (int s = 0; s < n; s++) {
    if (steps[s].kind == CUDA_STEP_KERNEL && steps[s].grid[0]) out.push_back(&steps[s]);
    for (int b = 0; b < 2; b++) kernels_of(steps[s].sub[b], steps[s].n_sub[b], out);
  }
}
std::vector<const cuda_step *> kernels_of(const cuda_step *steps, int n) {
  std::vector<const cuda_step *> v;
  kernels_of(steps, n, v);
  return v;
}

// the first step of kind in the tree
const cuda_step *find_step(const cuda_program *p, int kind) {
  for (int s = 0; s < p->n_all; s++)
    if (p->all[s]->kind == kind) return p->all[s];
  return nullptr;
}

// the kernel of steps (nested ones included) that writes ref as its first output
const cuda_step *writer(const cuda_step *steps, int n, const cuda_ref &ref) {
  for (const cuda_step *k : kernels_of(steps, n))
    if (k->n_bufs && k->bufs[0].kind == ref.kind && k->bufs[0].index == ref.index && k->bufs[0].offset == ref.offset)
      return k;
  return nullptr;
}

// A run of p on gpu:0 with the host tensors args (copied there); 0 / -1.
int run(const cuda_program *p, std::vector<kiln_tensor *> args, std::vector<kiln_tensor *> *res = nullptr) {
  for (kiln_tensor *&a : args) a = on("gpu:0", a);
  std::vector<kiln_tensor *> out((size_t)p->n_results + 1, nullptr);
  int rc = cuda_program_run(const_cast<cuda_program *>(p), 0, args.data(), out.data());
  if (res) *res = out;
  return rc;
}

int64_t bytes_of(const op_type &t) {
  int64_t n = kiln_dtype_size(t.dtype);
  for (int d = 0; d < t.rank; d++) n *= t.shape[d];
  return n;
}

// A run of p on gpu:0 over buffers of its own (garbage contents: the fake
// runs no kernel), whose device addresses the test knows.
struct Raw {
  std::vector<void *> params, results;
  std::vector<int32_t> pc, rcls;
  explicit Raw(const cuda_program *p) {
    for (int i = 0; i < p->n_params; i++) {
      int32_t c = 0;
      params.push_back(cuda_alloc("test", 0, (size_t)bytes_of(p->param_types[i]) + 1, &c));
      pc.push_back(c);
    }
    for (int i = 0; i < p->n_results; i++) {
      int32_t c = 0;
      results.push_back(cuda_alloc("test", 0, (size_t)bytes_of(p->result_types[i]) + 1, &c));
      rcls.push_back(c);
    }
  }
  ~Raw() {
    for (size_t i = 0; i < params.size(); i++) cuda_free(0, params[i], pc[i]);
    for (size_t i = 0; i < results.size(); i++) cuda_free(0, results[i], rcls[i]);
  }
  int launch(const cuda_program *p) {
    return cuda_program_launch(const_cast<cuda_program *>(p), 0, params.data(), results.data());
  }
  // the device address of the program's slot s (a row's base)
  unsigned long long addr(const cuda_program *p, int s) const {
    const plan_slot &sl = p->slots[s];
    if (sl.kind == PLAN_SLOT_PARAM) return (unsigned long long)(uintptr_t)params[(size_t)sl.index];
    if (sl.kind == PLAN_SLOT_RESULT) return (unsigned long long)(uintptr_t)results[(size_t)sl.index];
    return 0;
  }
};

// ---- programs ----

// cond: then exp(x), else x * -x
const char *kCond = R"(
func @f(%s: f32[8], %x: f32[8]) -> f32[8] {
  %r = reduce_sum %s {axes=[0]} : f32[]
  %z = constant dense<0.0> : f32[]
  %p = gt %r, %z : bool[]
  %y = cond %p, %x : f32[8]
    then func @f.then(%a: f32[8]) -> f32[8] {
      %0 = exp %a : f32[8]
      return %0
    }
    else func @f.else(%a: f32[8]) -> f32[8] {
      %0 = neg %a : f32[8]
      %1 = mul %0, %a : f32[8]
      return %1
    }
  return %y
}
)";

// while (i < n) { i += 1; s = s * 2 + c }
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

// carry c, y_t = (c + x_t * w, c) and z_t = sum(c)
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

// a scan over the rows of %xs inside a while counting %j down
const char *kNested = R"(
func @f(%m: i32[], %a: f32[3], %q: f32[4,3]) -> (i32[], f32[3]) {
  %i, %acc = while %m, %a, %q {state=2, max_iterations=-1} : i32[], f32[3]
    cond func @f.w.cond(%j: i32[], %c: f32[3], %q: f32[4,3]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %j, %z : bool[]
      return %0
    }
    body func @f.w.body(%j: i32[], %c: f32[3], %q: f32[4,3]) -> (i32[], f32[3]) {
      %one = constant dense<1> : i32[]
      %0 = sub %j, %one : i32[]
      %c2 = scan %c, %q {carry=1, xs=1, length=4, reverse=true} : f32[3]
        body func @f.s.body(%k: f32[3], %t: f32[3]) -> f32[3] {
          %0 = add %k, %t : f32[3]
          %1 = mul %0, %0 : f32[3]
          return %1
        }
      return %0, %c2
    }
  return %i, %acc
}
)";

// sum over t of rows tab[idx_t] (a gather whose indices are the row t of %idx)
std::string gather_scan(int len) {
  std::string L = std::to_string(len);
  return R"(
func @f(%c0: f32[4], %idx: i64[)" + L + R"(,2], %tab: f32[10,4]) -> f32[4] {
  %c = scan %c0, %idx, %tab {carry=1, xs=1, length=)" + L + R"(, reverse=false} : f32[4]
    body func @f.body(%c: f32[4], %i: i64[2], %tab: f32[10,4]) -> f32[4] {
      %g = gather %tab, %i {axis=0} : f32[2,4]
      %s = reduce_sum %g {axes=[0]} : f32[4]
      %0 = add %c, %s : f32[4]
      return %0
    }
  return %c
}
)";
}

// the same gather in an unbounded while whose predicate the test scripts
const char *kGatherWhile = R"(
func @f(%c0: f32[4], %i: i64[2], %tab: f32[10,4]) -> f32[4] {
  %c = while %c0, %i, %tab {state=1, max_iterations=-1} : f32[4]
    cond func @f.cond(%c: f32[4], %i: i64[2], %tab: f32[10,4]) -> bool[] {
      %r = reduce_sum %c {axes=[0]} : f32[]
      %z = constant dense<0.0> : f32[]
      %0 = lt %r, %z : bool[]
      return %0
    }
    body func @f.body(%c: f32[4], %i: i64[2], %tab: f32[10,4]) -> f32[4] {
      %g = gather %tab, %i {axis=0} : f32[2,4]
      %s = reduce_sum %g {axes=[0]} : f32[4]
      %0 = add %c, %s : f32[4]
      return %0
    }
  return %c
}
)";

}  // namespace

// ---- the launch plan ----

TEST(CudaControl, ThePlanNestsStepListsAndNumbersEveryStep) {
  GpuTest s;
  EnvGuard loops("KILN_CUDA_SCAN_LOOPS", "1");  // its elementwise scan a host loop, not the device loop
  Mod m(kNested);
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE), *sc = find_step(p.p, CUDA_STEP_SCAN);
  ASSERT_NE(w, nullptr);
  ASSERT_NE(sc, nullptr);
  EXPECT_EQ(w->trip, -1);
  EXPECT_EQ(sc->trip, 4);
  EXPECT_TRUE(sc->reverse);
  ASSERT_EQ(sc->n_bufs, 1) << "the row of %q";
  EXPECT_EQ(sc->bufs[0].kind, CUDA_REF_ROW);
  const plan_slot &row = p.p->slots[sc->bufs[0].index];
  EXPECT_EQ(row.kind, PLAN_SLOT_ROW);
  EXPECT_EQ(row.offset, 12) << "a row of f32[4,3]";
  EXPECT_EQ(p.p->slots[row.index].kind, PLAN_SLOT_PARAM) << "of the while's capture, the parameter %q";
  // pre-order numbering, and every kernel's .entry in the PTX
  int kernels = 0;
  for (int i = 0; i < p.p->n_all; i++) {
    EXPECT_EQ(p.p->all[i]->no, i);
    if (p.p->all[i]->kind != CUDA_STEP_KERNEL) continue;
    kernels++;
    EXPECT_EQ(std::string(p.p->all[i]->name), "kernel" + std::to_string(i));
    EXPECT_THAT(p.p->ptx, HasSubstr(".entry " + std::string(p.p->all[i]->name) + "("));
  }
  EXPECT_EQ(kernels, cuda_program_kernels(p.p));
  EXPECT_GE(kernels, 3) << "the predicate, the counter and the scan body";
  EXPECT_EQ(cuda_program_unsupported(p.p), 0) << error();
}

// ---- cond ----

TEST(CudaControl, CondLaunchesTheTakenBranchOnlyReadingThePredicateInStreamOrder) {
  GpuTest s;
  Mod m(kCond);
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *c = find_step(p.p, CUDA_STEP_COND);
  ASSERT_NE(c, nullptr);
  auto then_k = kernels_of(c->sub[0], c->n_sub[0]), else_k = kernels_of(c->sub[1], c->n_sub[1]);
  ASSERT_FALSE(then_k.empty());
  ASSERT_FALSE(else_k.empty());
  const cuda_step *pred = writer(p.p->steps, p.p->n_steps, c->bufs[0]);
  ASSERT_NE(pred, nullptr) << "a kernel computes the predicate";
  std::vector<float> x(8, 0.5f);
  for (int take : {1, 0}) {
    SCOPED_TRACE(take ? "then" : "else");
    // the predicate kernel "computes" take; the arena's fresh bytes are
    // 0xA5 (true): reading before the store lands would take then
    script(pred->name, 0, 1, {take});
    clear_launches();
    long syncs = calls("cuStreamSynchronize");
    ASSERT_EQ(run(p.p, {f32({8}, x), f32({8}, x)}), 0) << error();
    EXPECT_GT(calls("cuStreamSynchronize"), syncs) << "the predicate is waited for";
    auto got = counts(launches());
    for (const cuda_step *k : then_k) EXPECT_EQ(got[k->name], take ? 1 : 0) << k->name;
    for (const cuda_step *k : else_k) EXPECT_EQ(got[k->name], take ? 0 : 1) << k->name;
    EXPECT_EQ(got[pred->name], 1);
  }
  // a predicate that is a parameter: its bytes as the caller gave them
  Mod m2(R"(
func @g(%p: bool[], %x: f32[8]) -> f32[8] {
  %y = cond %p, %x : f32[8]
    then func @g.then(%a: f32[8]) -> f32[8] {
      %0 = exp %a : f32[8]
      return %0
    }
    else func @g.else(%a: f32[8]) -> f32[8] {
      %0 = neg %a : f32[8]
      return %0
    }
  return %y
}
)");
  Prog q(m2.f("g"));
  ASSERT_NE(q.p, nullptr);
  const cuda_step *c2 = find_step(q.p, CUDA_STEP_COND);
  ASSERT_NE(c2, nullptr);
  std::string then_name = kernels_of(c2->sub[0], c2->n_sub[0]).at(0)->name,
              else_name = kernels_of(c2->sub[1], c2->n_sub[1]).at(0)->name;
  for (bool b : {true, false}) {
    clear_launches();
    bool v = b;
    kiln_tensor *pt = kiln_tensor_new(KILN_BOOL, 0, nullptr, &v);
    ASSERT_EQ(run(q.p, {pt, f32({8}, x)}), 0) << error();
    auto l = launches();
    ASSERT_EQ(l.size(), 1u);
    EXPECT_EQ(std::string(l[0].name), b ? then_name : else_name);
  }
}

// ---- while ----

TEST(CudaControl, WhileRunsTheBodyUntilThePredicateKernelSaysFalse) {
  GpuTest s;
  Mod m(while_text(-1));
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE);
  ASSERT_NE(w, nullptr);
  const cuda_step *pred = writer(w->sub[0], w->n_sub[0], w->bufs[0]);
  ASSERT_NE(pred, nullptr);
  auto body = kernels_of(w->sub[1], w->n_sub[1]);
  ASSERT_FALSE(body.empty());
  script(pred->name, 0, 1, {1, 1, 1, 0});
  long syncs = calls("cuStreamSynchronize");
  ASSERT_EQ(run(p.p, {i32({}, {3}), f32({2}, {1, 0}), f32({2}, {1, 1})}), 0) << error();
  EXPECT_GE(calls("cuStreamSynchronize"), syncs + 4) << "each predicate read back";
  auto got = counts(launches());
  EXPECT_EQ(got[pred->name], 4);
  for (const cuda_step *k : body) EXPECT_EQ(got[k->name], 3) << k->name;
  // the order: predicate, body, predicate, ... predicate
  auto l = launches();
  EXPECT_EQ(std::string(l.front().name), pred->name);
  EXPECT_EQ(std::string(l.back().name), pred->name);

  // false at once: no body
  script(pred->name, 0, 1, {0});
  clear_launches();
  ASSERT_EQ(run(p.p, {i32({}, {3}), f32({2}, {1, 0}), f32({2}, {1, 1})}), 0) << error();
  got = counts(launches());
  EXPECT_EQ(got[pred->name], 1);
  for (const cuda_step *k : body) EXPECT_EQ(got[k->name], 0) << k->name;
}

// The body's kernels store the new carries straight over the loop's state
// (plan_policy.state_in_place: each reads its carry only at the element it
// stores): the copies are the state's copies in before the loop, none per
// iteration, however many iterations run.
TEST(CudaControl, ALoopsCarriesAreStoredInPlaceWithNoCopyPerIteration) {
  GpuTest s;
  Mod m(while_text(-1));
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE);
  ASSERT_NE(w, nullptr);
  for (int b = 0; b < 2; b++)
    for (int k = 0; k < w->n_sub[b]; k++) EXPECT_NE(w->sub[b][k].kind, CUDA_STEP_COPY) << "no copy back in the body";
  const cuda_step *pred = writer(w->sub[0], w->n_sub[0], w->bufs[0]);
  ASSERT_NE(pred, nullptr);
  std::vector<long> copies;
  for (int iterations : {1, 3, 7}) {
    std::vector<int> yes(iterations, 1);
    yes.push_back(0);
    script(pred->name, 0, 1, yes);
    clear_launches();
    long before = calls("cuMemcpyDtoDAsync");
    ASSERT_EQ(run(p.p, {i32({}, {3}), f32({2}, {1, 0}), f32({2}, {1, 1})}), 0) << error();
    copies.push_back(calls("cuMemcpyDtoDAsync") - before);
    EXPECT_EQ(counts(launches())[pred->name], iterations + 1);
  }
  EXPECT_EQ(copies[0], copies[1]) << "copies do not grow with the iterations";
  EXPECT_EQ(copies[1], copies[2]);
  EXPECT_LE(copies[0], 2) << "the two carries' copies in";
}

// Carries that trade places, (j, a, b) -> (j - 1, b, a): no kernel and no
// copy per iteration, the state's slots swap places (double buffering,
// plan_step.move); after the loop the state is copied back to its own
// buffers (through scratch: each is the other's place). The fake driver's
// memory is the host's, so the values are checked: swapped after an odd
// number of iterations.
TEST(CudaControl, CarriesTradingPlacesMoveInsteadOfCopying) {
  GpuTest s;
  Mod m(R"(
func @f(%n: i32[], %a0: f32[3], %b0: f32[3]) -> (f32[3], f32[3]) {
  %i, %a, %b = while %n, %a0, %b0 {state=3, max_iterations=-1} : i32[], f32[3], f32[3]
    cond func @f.cond(%j: i32[], %a: f32[3], %b: f32[3]) -> bool[] {
      %z = constant dense<0> : i32[]
      %0 = gt %j, %z : bool[]
      return %0
    }
    body func @f.body(%j: i32[], %a: f32[3], %b: f32[3]) -> (i32[], f32[3], f32[3]) {
      %one = constant dense<1> : i32[]
      %0 = sub %j, %one : i32[]
      return %0, %b, %a
    }
  return %a, %b
}
)");
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE);
  ASSERT_NE(w, nullptr);
  EXPECT_GE(w->n_move, 2) << "a and b move";
  for (int k = 0; k < w->n_sub[1]; k++) EXPECT_NE(w->sub[1][k].kind, CUDA_STEP_COPY) << "no copy in the body";
  const cuda_step *pred = writer(w->sub[0], w->n_sub[0], w->bufs[0]);
  ASSERT_NE(pred, nullptr);
  std::map<int, long> copies;
  for (int iterations : {0, 1, 2, 3, 7}) {
    SCOPED_TRACE(iterations);
    std::vector<int> yes(iterations, 1);
    yes.push_back(0);
    script(pred->name, 0, 1, yes);
    long before = calls("cuMemcpyDtoDAsync");
    std::vector<kiln_tensor *> out;
    ASSERT_EQ(run(p.p, {i32({}, {9}), f32({3}, {1, 2, 3}), f32({3}, {4, 5, 6})}, &out), 0) << error();
    copies[iterations] = calls("cuMemcpyDtoDAsync") - before;
    bool odd = iterations % 2;
    EXPECT_EQ(values(out[0]), odd ? (VD{4, 5, 6}) : (VD{1, 2, 3}));
    EXPECT_EQ(values(out[1]), odd ? (VD{1, 2, 3}) : (VD{4, 5, 6}));
  }
  EXPECT_EQ(copies[1], copies[3]) << "no copy per iteration";
  EXPECT_EQ(copies[1], copies[7]);
  EXPECT_EQ(copies[0], copies[2]) << "back in their own places: nothing to copy back";
  EXPECT_GT(copies[1], copies[0]) << "swapped: copied back after the loop";
}

TEST(CudaControl, ABoundedWhileStopsAtItsBound) {
  GpuTest s;
  for (int bound : {0, 2, 5}) {
    SCOPED_TRACE(bound);
    Mod m(while_text(bound));
    Prog p(m.f("f"));
    ASSERT_NE(p.p, nullptr);
    const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE);
    ASSERT_NE(w, nullptr);
    EXPECT_EQ(w->trip, bound);
    const cuda_step *pred = writer(w->sub[0], w->n_sub[0], w->bufs[0]);
    ASSERT_NE(pred, nullptr);
    auto body = kernels_of(w->sub[1], w->n_sub[1]);
    script(pred->name, 0, 1, {1});  // always true
    clear_launches();
    ASSERT_EQ(run(p.p, {i32({}, {100}), f32({2}, {1, 0}), f32({2}, {1, 1})}), 0) << error();
    auto got = counts(launches());
    EXPECT_EQ(got[pred->name], bound) << "the predicate is not evaluated past the bound (as the interpreter)";
    for (const cuda_step *k : body) EXPECT_EQ(got[k->name], bound) << k->name;
  }
}

// ---- scan ----

TEST(CudaControl, ScanLaunchesItsBodyPerRowWithAdvancingRowPointers) {
  GpuTest s;
  const int T = 5;
  for (bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    Mod m(scan_text(T, reverse));
    Prog p(m.f("f"));
    ASSERT_NE(p.p, nullptr);
    const cuda_step *sc = find_step(p.p, CUDA_STEP_SCAN);
    ASSERT_NE(sc, nullptr);
    EXPECT_EQ(sc->trip, T);
    EXPECT_EQ(sc->reverse, reverse);
    auto body = kernels_of(sc->sub[0], sc->n_sub[0]);
    ASSERT_FALSE(body.empty());
    clear_launches();
    Raw raw(p.p);
    ASSERT_EQ(raw.launch(p.p), 0) << error();
    std::vector<fake_launch> l = launches();
    ASSERT_EQ(l.size(), (size_t)T * body.size()) << "trip x body kernels";
    int rows_seen = 0;
    for (size_t b = 0; b < body.size(); b++) {
      const cuda_step *k = body[b];
      std::vector<const fake_launch *> mine;
      for (const fake_launch &x : l)
        if (k->name == std::string(x.name)) mine.push_back(&x);
      ASSERT_EQ(mine.size(), (size_t)T) << k->name;
      for (int q = 0; q < k->n_bufs && q < 16; q++) {
        const cuda_ref &r = k->bufs[q];
        if (r.kind != CUDA_REF_ROW) {  // one place, or two alternating (a double-buffered carry)
          std::set<unsigned long long> places;
          for (int t = 0; t < T; t++) places.insert(mine[t]->ptr[q]);
          EXPECT_LE(places.size(), 2u) << k->name << " param " << q;
          for (int t = 2; t < T; t++) EXPECT_EQ(mine[t]->ptr[q], mine[t - 2]->ptr[q]) << k->name << " param " << q;
          continue;
        }
        rows_seen++;
        const plan_slot &row = p.p->slots[r.index];
        int64_t step = reverse ? -row.offset : row.offset;
        for (int t = 1; t < T; t++)
          EXPECT_EQ((int64_t)(mine[t]->ptr[q] - mine[t - 1]->ptr[q]), step) << k->name << " param " << q;
        // the first iteration's row: row 0 (or T-1) of its base
        unsigned long long base = raw.addr(p.p, row.index);
        if (base) {
          EXPECT_EQ(mine[0]->ptr[q], base + (unsigned long long)(reverse ? (T - 1) * row.offset : 0))
              << k->name << " param " << q;
        }
        EXPECT_EQ(mine[0]->bad_params, 0);
      }
    }
    EXPECT_GE(rows_seen, 2) << "the body reads a row of %xs and writes a row of %zs";
  }
}

TEST(CudaControl, AScanInsideAWhileRestartsItsRowsEachIteration) {
  GpuTest s;
  EnvGuard loops("KILN_CUDA_SCAN_LOOPS", "1");  // its elementwise scan a host loop, not the device loop
  Mod m(kNested);
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE), *sc = find_step(p.p, CUDA_STEP_SCAN);
  ASSERT_NE(w, nullptr);
  ASSERT_NE(sc, nullptr);
  const cuda_step *pred = writer(w->sub[0], w->n_sub[0], w->bufs[0]);
  ASSERT_NE(pred, nullptr);
  auto body = kernels_of(sc->sub[0], sc->n_sub[0]);
  ASSERT_FALSE(body.empty());
  script(pred->name, 0, 1, {1, 1, 0});
  Raw raw(p.p);
  ASSERT_EQ(raw.launch(p.p), 0) << error();
  // the kernel reading the row of %q (add; mul is its own kernel unfused)
  const cuda_step *reader = nullptr;
  int qi = -1;
  for (const cuda_step *k : body)
    for (int q = 0; q < k->n_bufs; q++)
      if (k->bufs[q].kind == CUDA_REF_ROW) reader = k, qi = q;
  ASSERT_NE(reader, nullptr);
  std::vector<unsigned long long> rows;
  for (const fake_launch &l : launches())
    if (std::string(l.name) == reader->name) rows.push_back(l.ptr[qi]);
  ASSERT_EQ(rows.size(), 8u) << "2 while iterations x 4 rows";
  auto base = (unsigned long long)(uintptr_t)raw.params[2];
  for (int it = 0; it < 2; it++)
    for (int t = 0; t < 4; t++) EXPECT_EQ(rows[(size_t)(4 * it + t)], base + (unsigned long long)(3 - t) * 12) << it << " " << t;
  EXPECT_EQ(counts(launches())[pred->name], 3);
}

// A scan over the rows of a constant: the constant is uploaded to the GPU
// once (with the module), and the rows are device addresses inside it.
TEST(CudaControl, ARowOfAConstantIsReadOnTheGpu) {
  GpuTest s;
  EnvGuard loops("KILN_CUDA_SCAN_LOOPS", "1");  // its elementwise scan a host loop, not the device loop
  Mod m(R"(
func @f(%c0: f32[3]) -> f32[3] {
  %w = constant dense<[1, 2, 3, 4, 5, 6, 7, 8, 9, 1.5, 2.5, 3.5]> : f32[4,3]
  %c = scan %c0, %w {carry=1, xs=1, length=4, reverse=false} : f32[3]
    body func @f.body(%k: f32[3], %r: f32[3]) -> f32[3] {
      %0 = mul %k, %r : f32[3]
      return %0
    }
  return %c
}
)");
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *sc = find_step(p.p, CUDA_STEP_SCAN);
  ASSERT_NE(sc, nullptr);
  ASSERT_EQ(sc->n_bufs, 1);
  ASSERT_EQ(p.p->slots[p.p->slots[sc->bufs[0].index].index].kind, PLAN_SLOT_CONST);
  auto body = kernels_of(sc->sub[0], sc->n_sub[0]);
  ASSERT_EQ(body.size(), 1u);
  int qi = -1;
  for (int q = 0; q < body[0]->n_bufs; q++)
    if (body[0]->bufs[q].kind == CUDA_REF_ROW) qi = q;
  ASSERT_GE(qi, 0);
  long htod = calls("cuMemcpyHtoDAsync");
  for (int call = 0; call < 2; call++) {
    clear_launches();
    ASSERT_EQ(run(p.p, {f32({3}, {1, 1, 1})}), 0) << error();
    auto l = launches();
    ASSERT_EQ(l.size(), 4u);
    for (int t = 0; t < 4; t++) {
      EXPECT_EQ(l[t].bad_params, 0) << "the rows are GPU memory";
      EXPECT_NE(l[t].ptr[qi], 0u);
      if (t) {
        EXPECT_EQ(l[t].ptr[qi] - l[t - 1].ptr[qi], 12u);
      }
    }
  }
  // the argument twice, the constant once
  EXPECT_EQ(calls("cuMemcpyHtoDAsync"), htod + 3);
}

// ---- errors ----

TEST(CudaControl, AnErrorInIteration57NamesTheOpAndTheProgramRunsAgain) {
  GpuTest s;
  Mod m(gather_scan(60));
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *g = nullptr;
  for (int i = 0; i < p.p->n_all; i++)
    if (p.p->all[i]->kind == CUDA_STEP_KERNEL && p.p->all[i]->op == OP_GATHER) g = p.p->all[i];
  ASSERT_NE(g, nullptr) << "a gather kernel inside the scan";
  std::vector<int> word(60, FAKE_CUDA_SKIP);
  word[56] = g->no + 1;  // the 57th launch raises the error word
  script(g->name, -1, 4, word);
  std::vector<int64_t> idx(120, 3);
  auto args = [&] {
    return std::vector<kiln_tensor *>{f32({4}, {0, 0, 0, 0}), kiln_tensor_new(KILN_I64, KILN_SHAPE(60, 2), idx.data()),
                                      kiln_ones(KILN_F32, KILN_SHAPE(10, 4))};
  };
  EXPECT_EQ(run(p.p, args()), -1);
  EXPECT_EQ(error(), "gather: an index is not in [0, 10)");
  EXPECT_EQ(counts(launches())[g->name], 60) << "the scan ran to its end; the word is read after";
  script(g->name, 0, 4, {});
  kiln_clear_error();
  clear_launches();
  EXPECT_EQ(run(p.p, args()), 0) << "usable afterwards: " << error();
  EXPECT_EQ(counts(launches())[g->name], 60);
}

TEST(CudaControl, AnErrorInsideAnUnboundedWhileStopsTheLoop) {
  GpuTest s;
  Mod m(kGatherWhile);
  Prog p(m.f("f"));
  ASSERT_NE(p.p, nullptr);
  const cuda_step *w = find_step(p.p, CUDA_STEP_WHILE);
  ASSERT_NE(w, nullptr);
  const cuda_step *pred = writer(w->sub[0], w->n_sub[0], w->bufs[0]), *g = nullptr;
  ASSERT_NE(pred, nullptr);
  for (const cuda_step *k : kernels_of(w->sub[1], w->n_sub[1]))
    if (k->op == OP_GATHER) g = k;
  ASSERT_NE(g, nullptr);
  script(pred->name, 0, 1, {1});  // never false: only the error ends it
  script(g->name, -1, 4, {FAKE_CUDA_SKIP, FAKE_CUDA_SKIP, g->no + 1, FAKE_CUDA_SKIP});
  std::vector<int64_t> idx = {1, 12};
  auto args = [&] {
    return std::vector<kiln_tensor *>{f32({4}, {0, 0, 0, 0}), kiln_tensor_new(KILN_I64, KILN_SHAPE(2), idx.data()),
                                      kiln_ones(KILN_F32, KILN_SHAPE(10, 4))};
  };
  EXPECT_EQ(run(p.p, args()), -1);
  EXPECT_EQ(error(), "gather: indices[1] = 12 is not in [0, 10)") << "the indices are a parameter: found";
  EXPECT_EQ(counts(launches())[g->name], 3) << "stopped at the predicate after the 3rd body";
  script(pred->name, 0, 1, {1, 1, 0});
  script(g->name, 0, 4, {});
  clear_launches();
  idx[1] = 2;
  EXPECT_EQ(run(p.p, args()), 0) << error();
  EXPECT_EQ(counts(launches())[g->name], 2);
}

// ---- the PTX cache ----

TEST(CudaControl, ACachedScanReloadsItsNestedKernelsAndLaunchesTheSame) {
  GpuTest s;
  char t[] = "/tmp/kiln-ptx-ctl-XXXXXX";
  ASSERT_NE(mkdtemp(t), nullptr);
  EnvGuard env("KILN_CACHE_DIR", t);
  Mod m(scan_text(4, true));
  Prog cold(m.f("f")), warm(m.f("f"));
  ASSERT_NE(cold.p, nullptr);
  ASSERT_NE(warm.p, nullptr);
  EXPECT_FALSE(cuda_program_from_cache(cold.p));
  EXPECT_TRUE(cuda_program_from_cache(warm.p));
  EXPECT_STREQ(cold.p->ptx, warm.p->ptx);
  ASSERT_EQ(cold.p->n_all, warm.p->n_all);
  for (int i = 0; i < cold.p->n_all; i++) {
    const cuda_step &x = *cold.p->all[i], &y = *warm.p->all[i];
    SCOPED_TRACE(i);
    EXPECT_EQ(x.kind, y.kind);
    EXPECT_STREQ(x.name, y.name);
    for (int d = 0; d < 3; d++) {
      EXPECT_EQ(x.grid[d], y.grid[d]);
      EXPECT_EQ(x.block[d], y.block[d]);
    }
    ASSERT_EQ(x.n_bufs, y.n_bufs);
    for (int q = 0; q < x.n_bufs; q++) {
      EXPECT_EQ(x.bufs[q].kind, y.bufs[q].kind);
      EXPECT_EQ(x.bufs[q].index, y.bufs[q].index);
      EXPECT_EQ(x.bufs[q].offset, y.bufs[q].offset);
    }
  }
  EXPECT_GT(kernels_of(find_step(warm.p, CUDA_STEP_SCAN)->sub[0], find_step(warm.p, CUDA_STEP_SCAN)->n_sub[0]).size(),
            0u)
      << "the scan body's kernels have launch shapes from the cache";
  // both run the same launches, rows and all
  std::vector<float> xv(8, 1.0f);
  kiln_tensor *c0 = on("gpu:0", f32({2}, {0, 1})), *xs = on("gpu:0", f32({4, 2}, xv)), *w = on("gpu:0", f32({}, {2}));
  kiln_tensor *args[3] = {c0, xs, w}, *res[3];
  std::vector<fake_launch> a, b;
  clear_launches();
  ASSERT_EQ(cuda_program_run(cold.p, 0, args, res), 0) << error();
  a = launches();
  clear_launches();
  ASSERT_EQ(cuda_program_run(warm.p, 0, args, res), 0) << error();
  b = launches();
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 4u);
  for (size_t i = 0; i < a.size(); i++) {
    EXPECT_STREQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].n_params, b[i].n_params);
    EXPECT_EQ(b[i].bad_params, 0);
    for (int q = 0; q < a[i].n_params - 1 && q < 16; q++) {
      // rows of xs (a parameter) are the same addresses; others may differ (the results, the arena)
      bool is_xs_row = false;
      for (int k = 0; k < warm.p->n_all; k++) {
        const cuda_step *st = warm.p->all[k];
        if (st->kind == CUDA_STEP_KERNEL && st->name == std::string(b[i].name) && q < st->n_bufs &&
            st->bufs[q].kind == CUDA_REF_ROW && warm.p->slots[warm.p->slots[st->bufs[q].index].index].kind == PLAN_SLOT_PARAM)
          is_xs_row = true;
      }
      if (is_xs_row) {
        EXPECT_EQ(a[i].ptr[q], b[i].ptr[q]) << a[i].name << " " << q;
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(t, ec);
}

// ---- staged functions ----

namespace {

int cf_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], in[1]);
  out[1] = kiln_exp(out[0]);
  return out[0] && out[1] ? 0 : -1;
}

int cf_then(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_neg(in[0]);
  return out[0] ? 0 : -1;
}

int cf_scan(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tensor *c = nullptr, *ys = nullptr, *r = nullptr;
  if (kiln_scan(cf_body, nullptr, 1, &in[0], 1, &in[1], -1, true, 1, &c, &ys)) return -1;
  kiln_tensor *p = kiln_greater(kiln_reduce_sum(c, 0, nullptr, false), kiln_scalar(KILN_F32, 0));
  if (kiln_cond(p, cf_then, cf_then, nullptr, 1, &c, 1, &r)) return -1;
  out[0] = r;
  out[1] = ys;
  return 0;
}

struct OnDevice {
  explicit OnDevice(const char *d) { EXPECT_EQ(kiln_device_push(d), 0) << error(); }
  ~OnDevice() { kiln_device_pop(); }
};

}  // namespace

// A GPU trace with control flow is compiled: its loop's kernels launch per
// row from one module.
TEST(CudaControl, AStagedFunctionWithControlFlowCompilesForTheGpu) {
  GpuTest s;
  kiln_function *f = kiln_function_new("cf", cf_scan, nullptr, 2, 2);
  kiln_tensor *c0 = on("gpu:0", f32({2}, {1, 2})), *xs = on("gpu:0", f32({3, 2}, {1, 2, 3, 4, 5, 6}));
  kiln_tensor *in[2] = {c0, xs}, *out[2] = {nullptr, nullptr};
  long loads = calls("cuModuleLoadData");
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(f, in, out), 0) << error();
  }
  kiln_stats st{};
  ASSERT_EQ(kiln_function_stats(f, 0, &st), 0) << error();
  EXPECT_GT(st.compile_ms, 0.0) << "compiled, not interpreted";
  EXPECT_EQ(calls("cuModuleLoadData"), loads + 1) << "one module: no eager kernels";
  EXPECT_GE(launches().size(), 3u) << "the scan body per row";
  EXPECT_STREQ(kiln_tensor_device(out[0]), "gpu:0");
  EXPECT_STREQ(kiln_tensor_device(out[1]), "gpu:0");
  EXPECT_EQ(shape_of(out[1]), (V64{3, 2}));
  kiln_function_free(f);
}

// With KILN_BACKEND=interp the same trace runs interpreted: the interpreter
// reads the predicate back and moves rows through the host instead of
// dereferencing GPU memory (the fake driver's device addresses crash on the
// host).
TEST(CudaControl, InterpretedControlFlowNeverTouchesGpuMemoryOnTheHost) {
  GpuTest s;
  EnvGuard env("KILN_BACKEND", "interp");
  kiln_function *f = kiln_function_new("cfi", cf_scan, nullptr, 2, 2);
  kiln_tensor *c0 = on("gpu:0", f32({2}, {1, 2})), *xs = on("gpu:0", f32({3, 2}, {1, 2, 3, 4, 5, 6}));
  kiln_tensor *in[2] = {c0, xs}, *out[2] = {nullptr, nullptr};
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(f, in, out), 0) << error();
  }
  kiln_stats st{};
  ASSERT_EQ(kiln_function_stats(f, 0, &st), 0) << error();
  EXPECT_EQ(st.compile_ms, 0.0) << "interpreted";
  EXPECT_STREQ(kiln_tensor_device(out[0]), "gpu:0");
  EXPECT_STREQ(kiln_tensor_device(out[1]), "gpu:0");
  EXPECT_EQ(shape_of(out[1]), (V64{3, 2}));
  kiln_function_free(f);
}

namespace {

// c += sum(tab[idx_t]) over the rows of idx (tab captured)
int gather_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int axis = 0;
  out[0] = kiln_add(in[0], kiln_reduce_sum(kiln_gather((kiln_tensor *)user, in[1], 0), 1, &axis, false));
  return out[0] ? 0 : -1;
}
int gather_loop(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(gather_body, in[2], 1, &in[0], 1, &in[1], -1, false, 0, out, nullptr);
}

}  // namespace

// The issue's bad input: an error inside the 57th iteration of a staged
// loop on a GPU comes back as the op's message under the function's name,
// and the function works on the next call.
TEST(CudaControl, AStagedLoopFailingInIteration57NamesTheOpAndWorksAfter) {
  GpuTest s;
  kiln_function *f = kiln_function_new("gl", gather_loop, nullptr, 3, 1);
  std::vector<int64_t> idx(120, 3);
  kiln_tensor *in[3] = {on("gpu:0", f32({4}, {0, 0, 0, 0})),
                        on("gpu:0", kiln_tensor_new(KILN_I64, KILN_SHAPE(60, 2), idx.data())),
                        on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(10, 4)))};
  kiln_tensor *out = nullptr;
  {
    OnDevice d("gpu:0");
    ASSERT_EQ(kiln_function_call(f, in, &out), 0) << error();
  }
  kiln_stats st{};
  ASSERT_EQ(kiln_function_stats(f, 0, &st), 0) << error();
  EXPECT_GT(st.compile_ms, 0.0) << "compiled, not interpreted";
  // the trace's program, as jit compiled it for gpu:0: its gather kernel
  const ir_func *opt = jit_optimized_func(f, 0);
  ASSERT_NE(opt, nullptr) << error();
  Prog p(opt);
  ASSERT_NE(p.p, nullptr);
  const cuda_step *sc = find_step(p.p, CUDA_STEP_SCAN), *g = nullptr;
  ASSERT_NE(sc, nullptr);
  for (const cuda_step *k : kernels_of(sc->sub[0], sc->n_sub[0]))
    if (k->op == OP_GATHER) g = k;
  ASSERT_NE(g, nullptr);
  std::vector<int> word(60, FAKE_CUDA_SKIP);
  word[56] = g->no + 1;
  script(g->name, -1, 4, word);
  clear_launches();
  {
    OnDevice d("gpu:0");
    EXPECT_EQ(kiln_function_call(f, in, &out), -1);
  }
  EXPECT_EQ(error(), "@gl: gather: an index is not in [0, 10)");
  EXPECT_EQ(counts(launches())[g->name], 60);
  script(g->name, 0, 4, {});
  kiln_clear_error();
  {
    OnDevice d("gpu:0");
    EXPECT_EQ(kiln_function_call(f, in, &out), 0) << error();
  }
  EXPECT_EQ(kiln_function_trace_count(f), 1) << "the same compiled trace";
  kiln_function_free(f);
}
