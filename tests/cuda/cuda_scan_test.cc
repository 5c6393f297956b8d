// cuda_scan_test.cc — the device loop (backends/cuda/ptx_scan.c): a scan
// whose body is elementwise is ONE kernel in which each thread loops over
// t itself, launched once instead of once per row. Checked against the
// fake driver (tests/fake_cuda: which kernels launch, with which
// pointers), with ptxas (hand-written and random scans, sm_80 and sm_90),
// and for its arithmetic on the host: kiln_debug_cuda_scan runs the very
// element code of the kernel in LLVM's interpreter, compared with the
// reference interpreter over random scans (tests/cuda/scan_cases.h).
//
// Part of the cuda_runtime_test executable (its main points the runtime at
// the fake driver).
#include <gmock/gmock.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../test_util.h"
#include "cuda/cuda_rt.h"
#include "cuda/ptx.h"
#include "cuda_test_util.h"
#include "fake_access.h"
#include "ir.h"
#include "../../passes/passes.h"
#include "scan_cases.h"

using namespace kiln_test;
using ::testing::HasSubstr;

namespace {

struct ScanTest : Scoped {
  ScanTest() {
    clear_launches();
    no_scripts();
  }
  ~ScanTest() {
    no_scripts();
    EXPECT_EQ(ctx_depth(), 0) << "a CUDA context was left current";
  }
};

struct Mod {
  ir_module *m;
  explicit Mod(const std::string &text) : m(ir_parse(text.c_str(), "scan.kir")) {
    EXPECT_NE(m, nullptr) << error() << "\n" << text;
  }
  ~Mod() { ir_module_free(m); }
  ir_func *f() const { return m ? ir_module_find(m, "f") : nullptr; }
};

struct Prog {
  cuda_program *p;
  explicit Prog(const ir_func *f, const char *arch = "sm_90") : p(f ? cuda_compile(f, arch) : nullptr) {
    EXPECT_NE(p, nullptr) << error();
  }
  ~Prog() { cuda_program_free(p); }
};

// the kernel steps of the program's tree
std::vector<const cuda_step *> kernel_steps(const cuda_program *p) {
  std::vector<const cuda_step *> v;
  for (int s = 0; s < p->n_all; s++)
    if (p->all[s]->kind == CUDA_STEP_KERNEL) v.push_back(p->all[s]);
  return v;
}

bool has_step(const cuda_program *p, int kind) {
  for (int s = 0; s < p->n_all; s++)
    if (p->all[s]->kind == kind) return true;
  return false;
}

// the program is one kernel, the scan's device loop: no SCAN step, no row
// pointers
::testing::AssertionResult one_loop_kernel(const cuda_program *p) {
  if (!p) return ::testing::AssertionFailure() << "no program: " << error();
  if (has_step(p, CUDA_STEP_SCAN)) return ::testing::AssertionFailure() << "a host loop (a SCAN step)";
  auto k = kernel_steps(p);
  if (k.size() != 1) return ::testing::AssertionFailure() << k.size() << " kernels";
  if (k[0]->kernel_op != OP_SCAN) return ::testing::AssertionFailure() << "the kernel is " << ir_op_info(k[0]->kernel_op)->name;
  for (int q = 0; q < k[0]->n_bufs; q++)
    if (k[0]->bufs[q].kind == CUDA_REF_ROW) return ::testing::AssertionFailure() << "buffer " << q << " is a row";
  return ::testing::AssertionSuccess();
}

// A run of p on gpu:0 with the host tensors args (copied there); 0 / -1.
int run(const cuda_program *p, std::vector<kiln_tensor *> args, std::vector<kiln_tensor *> *res = nullptr) {
  for (kiln_tensor *&a : args) a = on("gpu:0", a);
  std::vector<kiln_tensor *> out((size_t)p->n_results + 1, nullptr);
  int rc = cuda_program_run(const_cast<cuda_program *>(p), 0, args.data(), out.data());
  if (res) *res = out;
  return rc;
}

// ---- programs ----

// two carries that trade places (a, b) -> (b, a + x_t), ys_t = a * w
std::string swap_text(int T, bool reverse) {
  std::string L = std::to_string(T);
  return R"(
func @f(%a0: f32[5], %b0: f32[5], %xs: f32[)" + L + R"(,5], %w: f32[]) -> (f32[5], f32[5], f32[)" + L + R"(,5]) {
  %a, %b, %ys = scan %a0, %b0, %xs, %w {carry=2, xs=1, length=)" + L + (reverse ? ", reverse=true" : ", reverse=false") +
         R"(} : f32[5], f32[5], f32[)" + L + R"(,5]
    body func @f.body(%a: f32[5], %b: f32[5], %x: f32[5], %w: f32[]) -> (f32[5], f32[5], f32[5]) {
      %0 = add %a, %x : f32[5]
      %1 = mul %a, %w : f32[5]
      return %b, %0, %1
    }
  return %a, %b, %ys
}
)";
}

// cumulative sum: c' = c + x_t, ys_t = c' (ys only: the carry is not returned)
std::string cumsum_text(int T, int n, bool reverse, const char *dt = "f32") {
  std::string L = std::to_string(T), N = std::to_string(n), D = dt;
  return "func @f(%c0: " + D + "[" + N + "], %xs: " + D + "[" + L + "," + N + "]) -> (" + D + "[" + N + "], " + D + "[" +
         L + "," + N + "]) {\n  %c, %ys = scan %c0, %xs {carry=1, xs=1, length=" + L +
         (reverse ? ", reverse=true" : ", reverse=false") + "} : " + D + "[" + N + "], " + D + "[" + L + "," + N +
         "]\n    body func @f.body(%c: " + D + "[" + N + "], %x: " + D + "[" + N + "]) -> (" + D + "[" + N + "], " +
         D + "[" + N + "]) {\n      %0 = add %c, %x : " + D + "[" + N + "]\n      return %0, %0\n    }\n  return %c, %ys\n}\n";
}

// the element code on the host against the reference interpreter
::testing::AssertionResult host_matches(const ir_func *f, const std::vector<kiln_tensor *> &args, double rtol = 1e-5) {
  std::vector<kiln_tensor *> want((size_t)f->n_results + 1, nullptr), got((size_t)f->n_results + 1, nullptr);
  if (ir_interpret(f, args.data(), want.data())) return ::testing::AssertionFailure() << "interpreter: " << error();
  for (int r = 0; r < f->n_results; r++) {
    const op_type &t = f->types[f->results[r]];
    got[(size_t)r] = kiln_zeros(t.dtype, t.rank, t.shape);
    if (!got[(size_t)r]) return ::testing::AssertionFailure() << error();
  }
  if (kiln_debug_cuda_scan(f, args.data(), got.data())) return ::testing::AssertionFailure() << "host run: " << error();
  for (int r = 0; r < f->n_results; r++)
    if (!allclose(got[(size_t)r], want[(size_t)r], rtol, 1e-6)) {
      VD g = values(got[(size_t)r]), w = values(want[(size_t)r]);
      for (size_t i = 0; i < g.size(); i++)
        if (std::fabs(g[i] - w[i]) > 1e-6 + rtol * std::fabs(w[i]))
          return ::testing::AssertionFailure() << "result " << r << " element " << i << ": " << g[i] << ", want " << w[i];
      return ::testing::AssertionFailure() << "result " << r << " differs";
    }
  return ::testing::AssertionSuccess();
}

}  // namespace

// ---- one launch ----

// A cumulative sum over 50 rows: one kernel, launched once, with the xs'
// and ys' whole buffers (no row pointers); the host loop of old
// (KILN_CUDA_SCAN_LOOPS=1) launches per row.
TEST(CudaScan, AnElementwiseScanIsOneKernelLaunchedOnce) {
  ScanTest s;
  const int T = 50;
  for (bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    Mod m(cumsum_text(T, 3, reverse));
    Prog p(m.f());
    ASSERT_TRUE(one_loop_kernel(p.p));
    const cuda_step *k = kernel_steps(p.p)[0];
    EXPECT_GT(k->grid[0], 0u);
    EXPECT_EQ(k->block[0], 256u);
    std::vector<float> xs(3 * T, 1.0f);
    clear_launches();
    ASSERT_EQ(run(p.p, {f32({3}, {0, 1, 2}), f32({T, 3}, xs)}), 0) << error();
    auto l = launches();
    ASSERT_EQ(l.size(), 1u) << "one launch for 50 rows";
    EXPECT_EQ(std::string(l[0].name), k->name);
    EXPECT_EQ(l[0].bad_params, 0);
    // its parameters: the outputs, then the carry's start and the whole xs
    int xs_param = -1;
    for (int q = 0; q < k->n_bufs; q++)
      if (k->bufs[q].kind == CUDA_REF_PARAM && k->bufs[q].index == 1) xs_param = q;
    ASSERT_GE(xs_param, 0) << "xs is passed whole";
    EXPECT_THAT(p.p->ptx, HasSubstr(".entry " + std::string(k->name) + "("));

    // the host loop: a launch per row
    EnvGuard loops("KILN_CUDA_SCAN_LOOPS", "1");
    Prog q(m.f());
    ASSERT_NE(q.p, nullptr);
    EXPECT_TRUE(has_step(q.p, CUDA_STEP_SCAN));
    clear_launches();
    ASSERT_EQ(run(q.p, {f32({3}, {0, 1, 2}), f32({T, 3}, xs)}), 0) << error();
    EXPECT_GE(launches().size(), (size_t)T);
  }
}

// What is not elementwise along the rows stays a host loop: a reduction of
// the carry, a body reading a row at another element (a transpose).
TEST(CudaScan, ABodyThatIsNotElementwiseStaysAHostLoop) {
  ScanTest s;
  Mod red(R"(
func @f(%c0: f32[4], %xs: f32[6,4]) -> f32[4] {
  %c = scan %c0, %xs {carry=1, xs=1, length=6, reverse=false} : f32[4]
    body func @f.body(%c: f32[4], %x: f32[4]) -> f32[4] {
      %0 = reduce_sum %c {axes=[0]} : f32[]
      %1 = add %x, %0 : f32[4]
      return %1
    }
  return %c
}
)");
  Prog a(red.f());
  ASSERT_NE(a.p, nullptr);
  EXPECT_TRUE(has_step(a.p, CUDA_STEP_SCAN));
  Mod tr(R"(
func @f(%c0: f32[2,2], %xs: f32[3,2,2]) -> f32[2,2] {
  %c = scan %c0, %xs {carry=1, xs=1, length=3, reverse=false} : f32[2,2]
    body func @f.body(%c: f32[2,2], %x: f32[2,2]) -> f32[2,2] {
      %0 = transpose %c {perm=[1,0]} : f32[2,2]
      %1 = add %x, %0 : f32[2,2]
      return %1
    }
  return %c
}
)");
  Prog b(tr.f());
  ASSERT_NE(b.p, nullptr);
  EXPECT_TRUE(has_step(b.p, CUDA_STEP_SCAN));
  // and the host check refuses them
  ir_func *f = red.f();
  std::vector<kiln_tensor *> args = {f32({4}, {0, 0, 0, 0}), kiln_zeros(KILN_F32, KILN_SHAPE(6, 4))};
  kiln_tensor *out = kiln_zeros(KILN_F32, KILN_SHAPE(4));
  EXPECT_EQ(kiln_debug_cuda_scan(f, args.data(), &out), -1);
  EXPECT_THAT(error(), HasSubstr("not elementwise"));
}

// An integer division by zero inside the loop raises the kernel's error
// word: the eager message, and the program runs again.
TEST(CudaScan, ADivisionByZeroInsideTheLoopNamesTheOp) {
  ScanTest s;
  Mod m(R"(
func @f(%c0: i32[4], %xs: i32[8,4]) -> i32[4] {
  %c = scan %c0, %xs {carry=1, xs=1, length=8, reverse=false} : i32[4]
    body func @f.body(%c: i32[4], %x: i32[4]) -> i32[4] {
      %0 = div %c, %x : i32[4]
      return %0
    }
  return %c
}
)");
  Prog p(m.f());
  ASSERT_TRUE(one_loop_kernel(p.p));
  const cuda_step *k = kernel_steps(p.p)[0];
  EXPECT_EQ(k->op, OP_DIV) << "the op whose check can fail";
  EXPECT_THAT(p.p->ptx, HasSubstr("atom.global.cas.b32")) << "the error word";
  script(k->name, -1, 4, {k->no + 1});
  std::vector<int32_t> xs(32, 1);
  EXPECT_EQ(run(p.p, {i32({4}, {1, 2, 3, 4}), i32({8, 4}, xs)}), -1);
  EXPECT_THAT(error(), HasSubstr("division by zero"));
  script(k->name, 0, 4, {});
  kiln_clear_error();
  clear_launches();
  EXPECT_EQ(run(p.p, {i32({4}, {1, 2, 3, 4}), i32({8, 4}, xs)}), 0) << error();
  EXPECT_EQ(launches().size(), 1u);
}

namespace {

// c' = c + x_t staged: the trace's scan body is elementwise
int cumsum_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_add(in[0], in[1]);
  out[1] = kiln_tanh(out[0]);
  return out[0] && out[1] ? 0 : -1;
}
int staged_cumsum(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return kiln_scan(cumsum_body, nullptr, 1, &in[0], 1, &in[1], -1, true, 1, &out[0], &out[1]);
}

}  // namespace

// A staged function on gpu:0 whose scan is elementwise: compiled into one
// module whose one kernel launches once for 40 rows.
TEST(CudaScan, AStagedScanOnTheGpuIsOneLaunch) {
  ScanTest s;
  kiln_function *f = kiln_function_new("cs", staged_cumsum, nullptr, 2, 2);
  kiln_tensor *c0 = on("gpu:0", f32({2}, {1, 2})), *xs = on("gpu:0", kiln_ones(KILN_F32, KILN_SHAPE(40, 2)));
  kiln_tensor *in[2] = {c0, xs}, *out[2] = {nullptr, nullptr};
  ASSERT_EQ(kiln_device_push("gpu:0"), 0);
  clear_launches();
  int rc = kiln_function_call(f, in, out);
  kiln_device_pop();
  ASSERT_EQ(rc, 0) << error();
  kiln_stats st{};
  ASSERT_EQ(kiln_function_stats(f, 0, &st), 0) << error();
  EXPECT_GT(st.compile_ms, 0.0) << "compiled, not interpreted";
  EXPECT_EQ(launches().size(), 1u) << "the device loop: one launch for 40 rows";
  EXPECT_STREQ(kiln_tensor_device(out[1]), "gpu:0");
  EXPECT_EQ(shape_of(out[1]), (V64{40, 2}));
  kiln_function_free(f);
}

// ---- ptxas ----

// The device loop's PTX assembles for sm_80 and sm_90: hand-written scans
// (both directions, swapping carries, f64 and i32, a row of 1000 elements
// and more threads than a block), then random scans (scan_cases.h) as
// written and after the default pipeline (fusions inside the body).
TEST(CudaScan, TheDeviceLoopAssemblesWithPtxas) {
  Scoped s;
  std::vector<std::pair<std::string, std::string>> hand = {
      {"cumsum", cumsum_text(7, 3, false)},       {"cumsum reversed", cumsum_text(7, 3, true)},
      {"swap", swap_text(4, false)},              {"swap reversed", swap_text(4, true)},
      {"f64", cumsum_text(5, 8, true, "f64")},    {"i32", cumsum_text(5, 8, false, "i32")},
      {"wide rows", cumsum_text(3, 1000, false)},
  };
  int assembled = 0;
  auto check = [&](const ir_func *f, const std::string &what, bool sm80) {
    for (const char *arch : {"sm_90", "sm_80"}) {
      if (!sm80 && std::string(arch) == "sm_80") continue;
      Prog p(f, arch);
      ASSERT_TRUE(one_loop_kernel(p.p)) << what;
      EXPECT_THAT(p.p->ptx, HasSubstr(std::string(".target ") + arch)) << what;
      EXPECT_EQ(std::string(p.p->ptx).find(".extern"), std::string::npos) << what << ": calls an outside function";
      if (have_ptxas()) {
        EXPECT_EQ(ptxas(p.p->ptx, arch), "") << what << "\n" << p.p->ptx;
        assembled++;
      }
    }
  };
  for (auto &h : hand) {
    Mod m(h.second);
    ASSERT_NE(m.f(), nullptr);
    check(m.f(), h.first, true);
  }
  int fused = 0;
  for (uint64_t seed = 1; seed <= 60 && !HasFailure(); seed++) {
    ScanCase c = scan_case(seed);
    std::string what = "seed " + std::to_string(seed) + "\n" + c.text;
    Mod m(c.text);
    ASSERT_NE(m.f(), nullptr) << what;
    check(m.f(), what, seed % 4 == 0);
    ASSERT_EQ(pass_run_pipeline(m.f(), PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << what << error();
    bool scan_left = false;
    for (int i = 0; i < m.f()->n_instrs; i++) scan_left = scan_left || m.f()->instrs[i].op == OP_SCAN;
    if (!scan_left) continue;
    const ir_func *body = nullptr;
    for (int i = 0; i < m.f()->n_instrs; i++)
      if (m.f()->instrs[i].op == OP_SCAN) body = m.f()->instrs[i].attrs.callee;
    for (int i = 0; body && i < body->n_instrs; i++) fused += body->instrs[i].op == OP_FUSION;
    Prog p(m.f(), "sm_90");
    ASSERT_NE(p.p, nullptr) << what;
    EXPECT_FALSE(has_step(p.p, CUDA_STEP_SCAN)) << "after the pipeline: " << what;
    if (have_ptxas()) {
      EXPECT_EQ(ptxas(p.p->ptx, "sm_90"), "") << "after the pipeline: " << what << "\n" << p.p->ptx;
      assembled++;
    }
  }
  EXPECT_GT(fused, 5) << "the pipeline left fusions inside the bodies";
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
  EXPECT_GT(assembled, 100);
}

// ---- the arithmetic, on the host ----

// Known values: a cumulative sum forward and reversed (the reversed scan
// walks the rows from the last), carries trading places.
TEST(CudaScan, TheLoopsElementCodeComputesKnownScans) {
  Scoped s;
  for (bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    Mod m(cumsum_text(4, 2, reverse));
    kiln_tensor *args[2] = {f32({2}, {0, 100}), f32({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8})};
    kiln_tensor *out[2] = {kiln_zeros(KILN_F32, KILN_SHAPE(2)), kiln_zeros(KILN_F32, KILN_SHAPE(4, 2))};
    ASSERT_EQ(kiln_debug_cuda_scan(m.f(), args, out), 0) << error();
    EXPECT_EQ(values(out[0]), (VD{16, 120}));
    if (!reverse) {
      EXPECT_EQ(values(out[1]), (VD{1, 102, 4, 106, 9, 112, 16, 120}));
    } else {
      EXPECT_EQ(values(out[1]), (VD{16, 120, 15, 118, 12, 114, 7, 108}));
    }
  }
  // (a, b) -> (b, a + x_t): every new value before any store
  Mod m(swap_text(3, false));
  std::vector<float> xs(15);
  for (int i = 0; i < 15; i++) xs[(size_t)i] = (float)(i / 5 + 1) * 10;  // rows of 10, 20, 30
  kiln_tensor *args[4] = {f32({5}, {1, 1, 1, 1, 1}), f32({5}, {2, 2, 2, 2, 2}), f32({3, 5}, xs), f32({}, {0.5})};
  kiln_tensor *out[3] = {kiln_zeros(KILN_F32, KILN_SHAPE(5)), kiln_zeros(KILN_F32, KILN_SHAPE(5)),
                         kiln_zeros(KILN_F32, KILN_SHAPE(3, 5))};
  ASSERT_EQ(kiln_debug_cuda_scan(m.f(), args, out), 0) << error();
  // t0: (1, 2) -> (2, 11), y 0.5; t1: -> (11, 22), y 1; t2: -> (22, 41), y 5.5
  EXPECT_EQ(values(out[0]), VD(5, 22));
  EXPECT_EQ(values(out[1]), VD(5, 41));
  EXPECT_EQ(values(out[2])[0], 0.5);
  EXPECT_EQ(values(out[2])[5], 1);
  EXPECT_EQ(values(out[2])[14], 5.5);
}

// Random scans: the element code of the kernel run on the host equals the
// reference interpreter (rows of up to 300 elements, up to 16 steps, f32,
// f64 and i32, captures broadcast, constants in the body).
TEST(CudaScan, TheLoopsElementCodeMatchesTheInterpreter) {
  int n = 0, reversed = 0, many = 0;
  for (uint64_t seed = 1; seed <= 150 && !HasFailure(); seed++) {
    Scoped s;
    ScanCase c = scan_case(seed);
    Mod m(c.text);
    ASSERT_NE(m.f(), nullptr);
    std::vector<kiln_tensor *> args = scan_args(m.f(), seed);
    EXPECT_TRUE(host_matches(m.f(), args, c.dt == KILN_F32 ? 1e-5 : 1e-12)) << "seed " << seed << "\n" << c.text;
    n++;
    reversed += c.reverse;
    many += c.nc > 1 && c.nx > 0 && c.ny > 0;
  }
  if (HasFailure()) return;  // stopped at the first failing seed
  EXPECT_EQ(n, 150);
  EXPECT_GT(reversed, 40);
  EXPECT_GT(many, 10);
}

TEST(CudaScan, TheHostCheckRefusesBadInput) {
  Scoped s;
  Mod m(cumsum_text(4, 2, false));
  kiln_tensor *args[2] = {f32({2}, {0, 1}), f32({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8})};
  kiln_tensor *out[2] = {kiln_zeros(KILN_F32, KILN_SHAPE(2)), kiln_zeros(KILN_F32, KILN_SHAPE(4, 2))};
  EXPECT_EQ(kiln_debug_cuda_scan(nullptr, args, out), -1);
  EXPECT_THAT(error(), HasSubstr("bad arguments"));
  kiln_tensor *wrong[2] = {f32({2}, {0, 1}), f32({3, 2}, {1, 2, 3, 4, 5, 6})};
  EXPECT_EQ(kiln_debug_cuda_scan(m.f(), wrong, out), -1);
  EXPECT_THAT(error(), HasSubstr("argument 1"));
  kiln_tensor *wrong_out[2] = {kiln_zeros(KILN_F64, KILN_SHAPE(2)), out[1]};
  EXPECT_EQ(kiln_debug_cuda_scan(m.f(), args, wrong_out), -1);
  EXPECT_THAT(error(), HasSubstr("result 0"));
  Mod two(R"(
func @f(%x: f32[2]) -> f32[2] {
  %0 = neg %x : f32[2]
  return %0
}
)");
  EXPECT_EQ(kiln_debug_cuda_scan(two.f(), args, out), -1);
  EXPECT_THAT(error(), HasSubstr("not one scan"));
}
