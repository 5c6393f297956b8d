// ptx_test.cc — the CUDA code generator (backends/cuda/ptx.c) without a GPU:
// every op of ops.def with every dtype it allows (the window ops too:
// conv2d, pooling, their gradients), fusion bodies, the three reduction
// forms, dot, the index ops and random programs (with window ops) from
// tests/ir_gen.h compile to PTX with one .entry per kernel step, and that
// PTX passes `ptxas -arch=sm_90` and `-arch=sm_80` where ptxas is installed
// (/usr/local/cuda/bin/ptxas or on PATH; the ptxas checks are skipped, not
// failed, where it is not). KILN_RANDOM_PROGRAMS=N sets the random corpus
// (default 500 at sm_90, every fifth also at sm_80).
#include "cuda/ptx.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ir.h"
#include "ir_gen.h"
#include "passes.h"
#include "ptxas_util.h"
#include "test_util.h"

namespace {

using namespace kiln_test;
using ::testing::HasSubstr;
using ::testing::StartsWith;

int count_entries(const std::string &ptx) {
  int n = 0;
  for (size_t at = ptx.find(".entry "); at != std::string::npos; at = ptx.find(".entry ", at + 1)) n++;
  return n;
}

// Compiles f for arch; checks the PTX's header and .entry count (and the
// kernel count when expect >= 0) and, where ptxas exists, assembles it.
// Returns the PTX ("" on failure).
std::string check_ptx(const ir_func *f, const char *arch, int expect, const std::string &what, bool assemble = true) {
  cuda_program *p = cuda_compile(f, arch);
  EXPECT_NE(p, nullptr) << what << ": " << kiln_last_error();
  if (!p) return "";
  std::string ptx = cuda_program_ptx(p);
  int kernels = cuda_program_kernels(p);
  cuda_program_free(p);
  EXPECT_THAT(ptx, HasSubstr(std::string(".target ") + arch)) << what;
  EXPECT_THAT(ptx, HasSubstr(".address_size 64")) << what;
  EXPECT_EQ(count_entries(ptx), kernels) << what << "\n" << ptx;
  if (expect >= 0) {
    EXPECT_EQ(kernels, expect) << what;
  }
  EXPECT_EQ(ptx.find(".extern"), std::string::npos) << what << ": calls an outside function\n" << ptx;
  if (assemble && have_ptxas()) {
    std::string err = ptxas(ptx, arch);
    EXPECT_EQ(err, "") << what << "\n" << ptx;
  }
  return ptx;
}

// ---- one-instruction functions of every op and dtype ----

struct Fn {
  ir_module *m = ir_module_new();
  ir_func *f = nullptr;
  ~Fn() { ir_module_free(m); }
};

op_type ty(kiln_dtype dt, V64 shape) {
  op_type t{};
  t.dtype = dt;
  t.rank = (int)shape.size();
  for (size_t i = 0; i < shape.size(); i++) t.shape[i] = shape[i];
  return t;
}

kiln_tensor *filled(kiln_dtype dt, V64 shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<unsigned char> buf((size_t)n * kiln_dtype_size(dt) + 8);
  for (size_t i = 0; i < buf.size(); i++) buf[i] = (unsigned char)(i * 37 % 3);
  return kiln_tensor_new(dt, (int)shape.size(), shape.data(), buf.data());
}

struct Case {
  op_attrs a{};
  std::vector<op_type> in;
  int const_input = -1;  // this input is a constant (filled) instead of a parameter
};

bool one_op(Fn &fn, op_id op, const Case &c) {
  std::vector<op_type> params;
  for (size_t k = 0; k < c.in.size(); k++)
    if ((int)k != c.const_input) params.push_back(c.in[k]);
  fn.f = ir_func_new(fn.m, "one", (int)params.size(), params.data());
  if (!fn.f) return false;
  std::vector<ir_value> vals;
  for (size_t k = 0, p = 0; k < c.in.size(); k++) {
    if ((int)k == c.const_input) {
      const op_type &t = c.in[k];
      kiln_tensor *x = filled(t.dtype, V64(t.shape, t.shape + t.rank));
      vals.push_back(ir_constant(fn.f, x, ir_loc{nullptr, 0}));
    } else {
      vals.push_back((ir_value)p++);
    }
  }
  ir_value v = ir_append(fn.f, op, &c.a, (int)c.in.size(), vals.data(), ir_loc{"ptx_test.cc", 1});
  EXPECT_GE(v, 0) << ir_op_info(op)->name << ": " << kiln_last_error();
  int n_out = v >= 0 ? fn.f->instrs[fn.f->n_instrs - 1].n_out : 0;
  std::vector<ir_value> res;
  for (int k = 0; k < n_out; k++) res.push_back(v + k);
  return v >= 0 && ir_set_results(fn.f, n_out, res.data()) == 0;
}

std::vector<Case> cases_for(op_id op, kiln_dtype dt) {
  std::vector<Case> out;
  Case c;
  auto T = [](kiln_dtype d, V64 s) { return ty(d, s); };
  switch (ir_op_info(op)->kind) {
    case OPK_UNARY:
      for (V64 s : {V64{2, 3}, V64{}, V64{0, 3}, V64{257, 263}}) {
        c.in = {T(dt, s)};
        out.push_back(c);
      }
      return out;
    case OPK_BINARY:
    case OPK_COMPARE:
      for (auto pr :
           std::vector<std::pair<V64, V64>>{{{2, 3}, {3}}, {{4, 1}, {1, 5}}, {{}, {3}}, {{300, 257}, {257}}}) {
        c.in = {T(dt, pr.first), T(dt, pr.second)};
        out.push_back(c);
      }
      c.in = {T(dt, {5, 3}), T(dt, {})};
      c.const_input = 1;  // an immediate
      out.push_back(c);
      c.in = {T(dt, {4, 3}), T(dt, {3})};
      c.const_input = 1;  // a constant array: a global of the module
      out.push_back(c);
      return out;
    case OPK_SELECT:
      c.in = {T(KILN_BOOL, {2, 3}), T(dt, {2, 3}), T(dt, {3})};
      out.push_back(c);
      c.in = {T(KILN_BOOL, {3}), T(dt, {}), T(dt, {4, 1})};
      out.push_back(c);
      return out;
    case OPK_CONVERT:
      for (int to = 0; to < KILN_DTYPE_COUNT; to++) {
        c.a = op_attrs{};
        c.a.dtype = (kiln_dtype)to;
        c.in = {T(dt, {3, 40})};
        out.push_back(c);
      }
      return out;
    case OPK_CONST: return out;  // below
    default: break;
  }
  switch (op) {
    case OP_IDENTITY:
    case OP_STOP_GRADIENT:
      c.in = {T(dt, {2, 3})};
      out.push_back(c);
      break;
    case OP_RESHAPE:
      c.a.rank = 3, c.a.shape[0] = 3, c.a.shape[1] = 1, c.a.shape[2] = 2;
      c.in = {T(dt, {2, 3})};
      out.push_back(c);
      break;
    case OP_BROADCAST:
      c.a.rank = 3, c.a.shape[0] = 2, c.a.shape[1] = 4, c.a.shape[2] = 3;
      c.in = {T(dt, {1, 3})};
      out.push_back(c);
      break;
    case OP_TRANSPOSE:
      c.a.naxes = 3, c.a.axes[0] = 2, c.a.axes[1] = 0, c.a.axes[2] = 1;
      c.in = {T(dt, {2, 3, 4})};
      out.push_back(c);
      break;
    case OP_SLICE:
      c.a.rank = 2, c.a.begin[0] = 1, c.a.begin[1] = 2, c.a.shape[0] = 2, c.a.shape[1] = 3;
      c.in = {T(dt, {4, 5})};
      out.push_back(c);
      break;
    case OP_CONCAT:
      c.a.axis = 1;
      c.in = {T(dt, {2, 3}), T(dt, {2, 1}), T(dt, {2, 2})};
      out.push_back(c);
      break;
    case OP_REDUCE_SUM:
    case OP_REDUCE_PROD:
    case OP_REDUCE_MAX:
    case OP_REDUCE_MIN: {
      struct R1 {
        V64 shape;
        std::vector<int> axes;
        bool keep;
      };
      // a thread per row (short rows, columns), a warp per row, a block per row
      const std::vector<R1> rs = {{{2, 3, 4}, {0, 2}, false}, {{2, 3, 4}, {1, 2}, true},
                                  {{0, 3}, {0}, false},       {{}, {}, false},
                                  {{300, 257}, {1}, false},   {{300, 257}, {0}, false},
                                  {{3, 5000}, {1}, false},    {{4, 30, 100}, {1, 2}, false}};
      for (const R1 &r : rs) {
        c.a = op_attrs{};
        c.a.naxes = (int)r.axes.size();
        for (size_t k = 0; k < r.axes.size(); k++) c.a.axes[k] = r.axes[k];
        c.a.keepdims = r.keep;
        c.in = {T(dt, r.shape)};
        out.push_back(c);
      }
      break;
    }
    case OP_ARGMAX:
      c.a.axis = 1;
      c.in = {T(dt, {3, 4})};
      out.push_back(c);
      c.a.axis = 0;
      c.in = {T(dt, {5, 2, 3})};
      out.push_back(c);
      break;
    case OP_DOT:
      c.in = {T(dt, {2, 3, 4}), T(dt, {4, 5})};
      out.push_back(c);
      c.in = {T(dt, {130, 70}), T(dt, {70, 200})};
      out.push_back(c);
      c.in = {T(dt, {3, 1, 7, 9}), T(dt, {2, 9, 5})};
      out.push_back(c);
      break;
    case OP_GATHER:
      c.a.axis = 0;
      c.in = {T(dt, {5, 3}), T(KILN_I64, {2, 2})};
      out.push_back(c);
      c.a.axis = 1;
      c.in = {T(dt, {2, 3}), T(KILN_I32, {4})};
      out.push_back(c);
      break;
    case OP_SCATTER_ADD:
      c.a.axis = 0, c.a.rank = 2, c.a.shape[0] = 5, c.a.shape[1] = 3;
      c.in = {T(dt, {2, 2, 3}), T(KILN_I32, {2, 2})};
      out.push_back(c);
      break;
    case OP_IOTA:
      c.a.dtype = dt, c.a.rank = 2, c.a.shape[0] = 3, c.a.shape[1] = 5;
      out.push_back(c);
      break;
    case OP_CONV2D:  // groups, stride, dilation, padding; depthwise; 1x1
      c.a.stride[0] = 2, c.a.stride[1] = 1, c.a.dilation[0] = 1, c.a.dilation[1] = 2, c.a.groups = 2;
      c.a.padding[0] = 1, c.a.padding[2] = 2, c.a.padding[3] = 1;
      c.in = {T(dt, {2, 7, 6, 4}), T(dt, {3, 3, 2, 6})};
      out.push_back(c);
      c.a = op_attrs{};
      c.a.stride[0] = c.a.stride[1] = c.a.dilation[0] = c.a.dilation[1] = 1, c.a.groups = 3;
      c.a.padding[0] = c.a.padding[1] = c.a.padding[2] = c.a.padding[3] = 1;
      c.in = {T(dt, {1, 5, 5, 3}), T(dt, {3, 3, 1, 6})};
      out.push_back(c);
      c.a.groups = 1, c.a.padding[0] = c.a.padding[1] = c.a.padding[2] = c.a.padding[3] = 0;
      c.in = {T(dt, {1, 5, 5, 4}), T(dt, {1, 1, 4, 8})};
      c.const_input = 1;  // the filter a constant of the module
      out.push_back(c);
      break;
    case OP_CONV2D_BP_INPUT:
      c.a.stride[0] = 2, c.a.stride[1] = 1, c.a.dilation[0] = 1, c.a.dilation[1] = 2, c.a.groups = 2;
      c.a.padding[0] = 1, c.a.padding[2] = 2, c.a.padding[3] = 1;
      c.a.rank = 4, c.a.shape[0] = 2, c.a.shape[1] = 7, c.a.shape[2] = 6, c.a.shape[3] = 4;
      c.in = {T(dt, {2, 3, 5, 6}), T(dt, {3, 3, 2, 6})};
      out.push_back(c);
      break;
    case OP_CONV2D_BP_FILTER:  // few elements over many rows: two kernels (partials, their sum); many: one
      c.a.stride[0] = 2, c.a.stride[1] = 1, c.a.dilation[0] = 1, c.a.dilation[1] = 2, c.a.groups = 2;
      c.a.padding[0] = 1, c.a.padding[2] = 2, c.a.padding[3] = 1;
      c.a.rank = 4, c.a.shape[0] = 3, c.a.shape[1] = 3, c.a.shape[2] = 2, c.a.shape[3] = 6;
      c.in = {T(dt, {2, 7, 6, 4}), T(dt, {2, 3, 5, 6})};
      out.push_back(c);
      c.a = op_attrs{};
      c.a.stride[0] = c.a.stride[1] = c.a.dilation[0] = c.a.dilation[1] = c.a.groups = 1;
      c.a.rank = 4, c.a.shape[0] = 3, c.a.shape[1] = 3, c.a.shape[2] = 64, c.a.shape[3] = 128;
      c.in = {T(dt, {1, 4, 4, 64}), T(dt, {1, 2, 2, 128})};
      out.push_back(c);
      break;
    case OP_MAX_POOL2D:
    case OP_AVG_POOL2D:
      c.a.window[0] = 3, c.a.window[1] = 2, c.a.stride[0] = c.a.stride[1] = 2;
      c.a.padding[0] = c.a.padding[1] = c.a.padding[3] = 1;
      c.in = {T(dt, {2, 7, 6, 3})};
      out.push_back(c);
      break;
    case OP_MAX_POOL2D_GRAD:
      c.a.window[0] = 3, c.a.window[1] = 2, c.a.stride[0] = c.a.stride[1] = 2;
      c.a.padding[0] = c.a.padding[1] = c.a.padding[3] = 1;
      c.in = {T(dt, {2, 7, 6, 3}), T(dt, {2, 4, 3, 3})};
      out.push_back(c);
      break;
    case OP_AVG_POOL2D_GRAD:
      c.a.window[0] = 3, c.a.window[1] = 2, c.a.stride[0] = c.a.stride[1] = 2;
      c.a.padding[0] = c.a.padding[1] = c.a.padding[3] = 1;
      c.a.rank = 4, c.a.shape[0] = 2, c.a.shape[1] = 7, c.a.shape[2] = 6, c.a.shape[3] = 3;
      c.in = {T(dt, {2, 4, 3, 3})};
      out.push_back(c);
      break;
    case OP_RNG_UNIFORM:
    case OP_RNG_NORMAL:
      c.a.dtype = dt, c.a.rank = 2, c.a.shape[0] = 3, c.a.shape[1] = 5;
      c.a.lo = op == OP_RNG_UNIFORM ? -2 : 0, c.a.hi = op == OP_RNG_UNIFORM ? 3 : 0;
      c.a.seed = 1234, c.a.counter = 17;
      out.push_back(c);
      break;
    default: break;
  }
  return out;
}

// kernels a one-op function compiles to
int kernels_of(op_id op) {
  switch (ir_op_info(op)->kind) {
    case OPK_VIEW:
    case OPK_CONST:
    case OPK_RANDOM: return 0;
    default: return 1;
  }
}

TEST(Ptx, EveryOpEveryDtypeAssembles) {
  Scoped scope;
  int checked = 0;
  for (int op = 0; op < OP_COUNT; op++) {
    const op_info *info = ir_op_info((op_id)op);
    if (info->kind == OPK_CALL || info->kind == OPK_COLLECTIVE || info->kind == OPK_HOST || info->kind == OPK_CONTROL || info->kind == OPK_CONST)
      continue;  // below (control flow)
    for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {
      if (!(info->dtypes & (1u << dt))) continue;
      std::vector<Case> cases = cases_for((op_id)op, (kiln_dtype)dt);
      EXPECT_FALSE(cases.empty()) << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << " not covered";
      for (size_t k = 0; k < cases.size(); k++) {
        Fn fn;
        std::string what =
            std::string(info->name) + " " + kiln_dtype_name((kiln_dtype)dt) + " case " + std::to_string(k);
        ASSERT_TRUE(one_op(fn, (op_id)op, cases[k])) << what << ": " << kiln_last_error();
        // sm_90 for every case, sm_80 for the first of each op and dtype
        // a column reduction split over blocks is two kernels (the partials, then their sum)
        // and so is a filter gradient of few elements over many rows
        int want = ir_op_info((op_id)op)->kind == OPK_REDUCE || op == OP_CONV2D_BP_FILTER ? -1 : kernels_of((op_id)op);
        check_ptx(fn.f, "sm_90", want, what + " sm_90");
        if (k == 0) check_ptx(fn.f, "sm_80", want, what + " sm_80");
        checked++;
      }
    }
  }
  EXPECT_GT(checked, 250);
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

// Functions written as .kir: fusion bodies, the reduction forms, dot, index
// ops, constants, f16/bf16, f64 math, calls.
struct Prog {
  const char *text;
  int kernels;
  std::vector<const char *> must;  // substrings the sm_90 PTX must contain
};

const Prog kProgs[] = {
    {"func @k(%x: f32[37,53], %a: f32[], %b: f32[53], %c: f32[37,1]) -> f32[37,53] {\n"
     "  %0 = broadcast %a {shape=[37,53]} : f32[37,53]\n"
     "  %1 = mul %x, %0 : f32[37,53]\n"
     "  %2 = add %1, %b : f32[37,53]\n"
     "  %3 = tanh %2 : f32[37,53]\n"
     "  %4 = mul %3, %c : f32[37,53]\n"
     "  %5 = add %4, %x : f32[37,53]\n"
     "  return %5\n"
     "}\n"
     "func @f(%x: f32[37,53], %a: f32[], %b: f32[53], %c: f32[37,1]) -> f32[37,53] {\n"
     "  %r = fusion @k(%x, %a, %b, %c) : f32[37,53]\n"
     "  return %r\n"
     "}\n",
     1,
     {"fma.rn.f32"}},
    // index remapping in a kernel, a constant array, two outputs
    {"func @k(%x: f64[6,4]) -> (f64[3,6], i32[3,6]) {\n"
     "  %t = transpose %x {perm=[1,0]} : f64[4,6]\n"
     "  %s = slice %t {begin=[1,0], size=[3,6]} : f64[3,6]\n"
     "  %r = reshape %s {shape=[18]} : f64[18]\n"
     "  %c = constant dense<[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, "
     "17.0, 18.0]> : f64[18]\n"
     "  %m = mul %r, %c : f64[18]\n"
     "  %b = reshape %m {shape=[3,6]} : f64[3,6]\n"
     "  %e = exp %b : f64[3,6]\n"
     "  %i = convert %b {dtype=i32} : i32[3,6]\n"
     "  return %e, %i\n"
     "}\n"
     "func @f(%x: f64[6,4]) -> (f64[3,6], i32[3,6]) {\n"
     "  %e, %i = fusion @k(%x) : f64[3,6], i32[3,6]\n"
     "  return %e, %i\n"
     "}\n",
     1,
     {".global .align 16 .b8 const0[144]"}},
    // producers into two reductions of one input (a warp per row)
    {"func @k(%x: f32[31,67], %y: f32[67]) -> (f32[31], f32[31]) {\n"
     "  %d = sub %x, %y : f32[31,67]\n"
     "  %e = exp %d : f32[31,67]\n"
     "  %s = reduce_sum %e {axes=[1]} : f32[31]\n"
     "  %m = reduce_max %d {axes=[1]} : f32[31]\n"
     "  return %s, %m\n"
     "}\n"
     "func @f(%x: f32[31,67], %y: f32[67]) -> (f32[31], f32[31]) {\n"
     "  %s, %m = fusion @k(%x, %y) : f32[31], f32[31]\n"
     "  return %s, %m\n"
     "}\n",
     1,
     {"shfl.sync.bfly.b32"}},
    // a block per row: shuffles, shared memory, barriers
    {"func @f(%x: f32[8,10000]) -> (f32[8], f32[8]) {\n"
     "  %s = reduce_sum %x {axes=[1]} : f32[8]\n"
     "  %m = reduce_min %x {axes=[1]} : f32[8]\n"
     "  return %s, %m\n"
     "}\n",
     2,
     {"shfl.sync.bfly.b32", "bar.sync", ".shared"}},
    // a reduction over leading axes with a select (a thread per output)
    {"func @k(%x: f64[9,5,4], %z: f64[]) -> f64[5] {\n"
     "  %p = gt %x, %z : bool[9,5,4]\n"
     "  %n = neg %x : f64[9,5,4]\n"
     "  %s = select %p, %x, %n : f64[9,5,4]\n"
     "  %r = reduce_sum %s {axes=[0,2]} : f64[5]\n"
     "  return %r\n"
     "}\n"
     "func @f(%x: f64[9,5,4], %z: f64[]) -> f64[5] {\n"
     "  %r = fusion @k(%x, %z) : f64[5]\n"
     "  return %r\n"
     "}\n",
     1,
     {}},
    // a body that is not one kernel: inlined
    {"func @k(%x: f32[4,6]) -> f32[4,6] {\n"
     "  %m = reduce_max %x {axes=[1], keepdims=true} : f32[4,1]\n"
     "  %d = sub %x, %m : f32[4,6]\n"
     "  return %d\n"
     "}\n"
     "func @f(%x: f32[4,6]) -> f32[4,6] {\n"
     "  %r = fusion @k(%x) : f32[4,6]\n"
     "  return %r\n"
     "}\n",
     2,
     {}},
    // dot in all its dtypes, tiled through shared memory
    {"func @f(%a: f32[3,70,33], %b: f32[33,90], %c: f64[2,5,7], %d: f64[1,7,3], %i: i64[4,5], %j: i64[5,6]) -> "
     "(f32[3,70,90], f64[2,5,3], i64[4,6]) {\n"
     "  %0 = dot %a, %b : f32[3,70,90]\n"
     "  %1 = dot %c, %d : f64[2,5,3]\n"
     "  %2 = dot %i, %j : i64[4,6]\n"
     "  return %0, %1, %2\n"
     "}\n",
     3,
     {"ld.shared.f32", "fma.rn.f32", "fma.rn.f64", "bar.sync"}},
    // index checks raise the error word
    {"func @f(%p: f32[5,3], %ix: i64[4], %u: f64[4,3], %b: bool[5,3]) -> (f32[4,3], f64[5,3], bool[4,3]) {\n"
     "  %g = gather %p, %ix {axis=0} : f32[4,3]\n"
     "  %s = scatter_add %u, %ix {axis=0, shape=[5,3]} : f64[5,3]\n"
     "  %h = gather %b, %ix {axis=0} : bool[4,3]\n"
     "  return %g, %s, %h\n"
     "}\n",
     3,
     {"atom.global.cas.b32"}},
    // integer division can fail: the error word again
    {"func @f(%x: i32[7,9], %y: i32[9]) -> i32[7,9] {\n"
     "  %d = div %x, %y : i32[7,9]\n"
     "  return %d\n"
     "}\n",
     1,
     {"atom.global.cas.b32"}},
    // storage floats, f64 vector math, float mod
    {"func @f(%h: f16[40], %g: bf16[40], %x: f64[40], %y: f32[40]) -> (f16[40], bf16[40], f64[40], f32[40]) {\n"
     "  %a = convert %h {dtype=f32} : f32[40]\n"
     "  %b = convert %g {dtype=f64} : f64[40]\n"
     "  %s = sin %x : f64[40]\n"
     "  %p = pow %s, %b : f64[40]\n"
     "  %l = log1p %p : f64[40]\n"
     "  %t = tanh %l : f64[40]\n"
     "  %m = mod %a, %y : f32[40]\n"
     "  %c = cos %m : f32[40]\n"
     "  %h2 = convert %c {dtype=f16} : f16[40]\n"
     "  %g2 = convert %t {dtype=bf16} : bf16[40]\n"
     "  return %h2, %g2, %t, %m\n"
     "}\n",
     -1,
     {}},
    // calls inlined, a view as a result, concat, argmax, iota
    {"func @sq(%a: f32[2,3]) -> f32[2,3] {\n"
     "  %m = mul %a, %a : f32[2,3]\n"
     "  return %m\n"
     "}\n"
     "func @f(%x: f32[2,3]) -> (f32[2,3], f32[6], f32[4,3], i64[3], i32[2,3]) {\n"
     "  %s = call @sq(%x) : f32[2,3]\n"
     "  %r = reshape %s {shape=[6]} : f32[6]\n"
     "  %c = concat %s, %x {axis=0} : f32[4,3]\n"
     "  %a = argmax %x {axis=0} : i64[3]\n"
     "  %i = iota {dtype=i32, shape=[2,3]} : i32[2,3]\n"
     "  return %s, %r, %c, %a, %i\n"
     "}\n",
     4,
     {}},
};

TEST(Ptx, ProgramsAssemble) {
  Scoped scope;
  for (const Prog &t : kProgs) {
    ir_module *m = ir_parse(t.text, "ptx.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error() << "\n" << t.text;
    const ir_func *f = ir_module_find(m, "f");
    std::string ptx = check_ptx(f, "sm_90", t.kernels, t.text);
    for (const char *s : t.must) EXPECT_THAT(ptx, HasSubstr(s)) << t.text << "\n" << ptx;
    check_ptx(f, "sm_80", t.kernels, t.text);
    ir_module_free(m);
  }
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

TEST(Ptx, LaunchPlan) {
  Scoped scope;
  const char *text =
      "func @f(%x: f32[8,10000], %a: f32[130,70], %b: f32[70,200]) -> (f32[8], f32[130,200], f32[8,10000]) {\n"
      "  %s = reduce_sum %x {axes=[1]} : f32[8]\n"
      "  %d = dot %a, %b : f32[130,200]\n"
      "  %u = rng_uniform {dtype=f32, shape=[8,10000], lo=0.0, hi=1.0, seed=1, counter=2} : f32[8,10000]\n"
      "  return %s, %d, %u\n"
      "}\n";
  ir_module *m = ir_parse(text, "plan.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  cuda_program *p = cuda_compile(m->funcs[0], nullptr);
  ASSERT_NE(p, nullptr) << kiln_last_error();
  EXPECT_STREQ(p->arch, "sm_80");
  ASSERT_EQ(p->n_steps, 3);
  const cuda_step &red = p->steps[0], &dot = p->steps[1], &rng = p->steps[2];
  EXPECT_EQ(red.kind, CUDA_STEP_KERNEL);
  EXPECT_EQ(red.grid[0], 8u);  // a block per row
  EXPECT_EQ(red.block[0], 256u);
  ASSERT_EQ(red.n_bufs, 2);
  EXPECT_EQ(red.bufs[0].kind, CUDA_REF_RESULT);
  EXPECT_EQ(red.bufs[1].kind, CUDA_REF_PARAM);
  EXPECT_EQ(dot.kind, CUDA_STEP_KERNEL);
  EXPECT_EQ(dot.grid[0], 4u);  // 200 / 64 columns of tiles
  EXPECT_EQ(dot.grid[1], 3u);  // 130 / 64 rows
  EXPECT_EQ(dot.grid[2], 1u);
  EXPECT_EQ(rng.kind, CUDA_STEP_HOST);
  EXPECT_EQ(rng.op, OP_RNG_UNIFORM);
  EXPECT_THAT(p->ptx, HasSubstr(std::string(".entry ") + red.name));
  EXPECT_THAT(p->ptx, HasSubstr(std::string(".entry ") + dot.name));
  EXPECT_EQ(cuda_program_unsupported(p), -1);
  EXPECT_THAT(kiln_last_error(), HasSubstr("cuda: @f: rng_uniform is not supported on the GPU yet"));
  cuda_program_free(p);
  ir_module_free(m);
}

TEST(Ptx, BadInputsAreErrors) {
  Scoped scope;
  EXPECT_EQ(cuda_compile(nullptr, "sm_90"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("cuda:"));
  EXPECT_EQ(cuda_ptx_text(nullptr, nullptr), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("cuda:"));
  ir_module *m = ir_parse("func @f(%x: f32[3]) -> f32[3] {\n  %y = exp %x : f32[3]\n  return %y\n}\n", "bad.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  EXPECT_EQ(cuda_compile(m->funcs[0], "sm_75"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("cuda: unknown architecture \"sm_75\""));
  EXPECT_EQ(cuda_ptx_text(m->funcs[0], "gfx90a"), nullptr);
  EXPECT_THAT(kiln_last_error(), StartsWith("cuda:"));
  char *ptx = cuda_ptx_text(m->funcs[0], "sm_90");
  ASSERT_NE(ptx, nullptr) << kiln_last_error();
  EXPECT_THAT(ptx, HasSubstr(".target sm_90"));
  free(ptx);
  EXPECT_EQ(cuda_program_ptx(nullptr), nullptr);
  EXPECT_EQ(cuda_program_kernels(nullptr), 0);
  cuda_program_free(nullptr);
  ir_module_free(m);
}

// The random corpus, after the default pipeline (fusion groups, buffer
// plans), every program at sm_90 and every fifth at sm_80; every seventh
// also as traced (one kernel per op).
TEST(Ptx, RandomProgramsAssemble) {
  Scoped scope;
  ir_gen_options o = ir_gen_default_options();
  o.dtypes |= DT_BIT(KILN_F16) | DT_BIT(KILN_BF16);
  int n = program_count(), done = 0;
  ptxas_seconds = 0;
  ptxas_runs = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; i++) {
    uint64_t seed = 1 + (uint64_t)i;
    ir_module *m = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << kiln_last_error();
    char *t = ir_print_module(m);
    std::string what = "seed " + std::to_string(seed) + "\n" + (t ? t : "");
    free(t);
    ir_func *f = m->funcs[0];
    if (i % 7 == 0) check_ptx(f, "sm_90", -1, what + "(traced)");
    ASSERT_EQ(pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << what << kiln_last_error();
    check_ptx(f, "sm_90", -1, what);
    if (i % 5 == 0) check_ptx(f, "sm_80", -1, what);
    ir_module_free(m);
    done++;
    if (HasFailure()) break;
  }
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ptx] %d random programs: %.1f s in all, %d ptxas runs in %.1f s\n", done, total, ptxas_runs,
              ptxas_seconds);
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

// Random programs with convolutions, pooling and their gradients (tests/
// ir_gen.h IR_GEN_WINDOW; every other one with control flow too), after the
// default pipeline: every window op a kernel of its own (no host step), and
// the module assembles.
TEST(Ptx, RandomProgramsWithWindowsAssemble) {
  Scoped scope;
  ir_gen_options o = ir_gen_default_options();
  int windows = 0;
  for (int i = 0; i < 60; i++) {
    uint64_t seed = 1 + (uint64_t)i;
    o.kinds = ir_gen_default_options().kinds | IR_GEN_WINDOW | (i % 2 ? (unsigned)IR_GEN_CONTROL : 0u);  // in loop bodies too
    ir_module *m = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << kiln_last_error();
    char *t = ir_print_module(m);
    std::string what = "seed " + std::to_string(seed) + "\n" + (t ? t : "");
    free(t);
    ir_func *f = m->funcs[0];
    ASSERT_EQ(pass_run_pipeline(f, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << what << kiln_last_error();
    for (int k = 0; k < f->n_instrs; k++) windows += ir_op_info(f->instrs[k].op)->kind == OPK_WINDOW;
    cuda_program *p = cuda_compile(f, "sm_90");
    ASSERT_NE(p, nullptr) << what << kiln_last_error();
    EXPECT_EQ(cuda_program_unsupported(p), 0) << what << kiln_last_error();
    cuda_program_free(p);
    check_ptx(f, "sm_90", -1, what, i % 3 == 0);
    if (i % 10 == 0) check_ptx(f, "sm_80", -1, what);
    ir_module_free(m);
    if (HasFailure()) break;
  }
  EXPECT_GT(windows, 20) << "the corpus holds window ops";
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

}  // namespace

// Control flow (cond / while / scan steps): the kernels of every nested
// body are in the module, and it assembles; a hand-written program nesting
// all three (a gather in a scan body, rows of a constant), then random
// programs with control flow after the default pipeline.
TEST(Ptx, ControlFlowBodiesAssemble) {
  Scoped scope;
  const char *text =
      "func @f(%p: bool[], %x: f32[3], %n: i32[], %xs: f32[4,3], %ix: i64[4,2], %tab: f32[6,3]) -> (f32[3], f32[4,3], f32[3]) {\n"
      "  %r, %ys = cond %p, %x, %n, %xs : f32[3], f32[4,3]\n"
      "    then func @f.then(%a: f32[3], %m: i32[], %s: f32[4,3]) -> (f32[3], f32[4,3]) {\n"
      "      %i, %acc = while %m, %a, %s {state=2, max_iterations=10} : i32[], f32[3]\n"
      "        cond func @f.wc(%j: i32[], %c: f32[3], %q: f32[4,3]) -> bool[] {\n"
      "          %z = constant dense<0> : i32[]\n"
      "          %0 = gt %j, %z : bool[]\n"
      "          return %0\n"
      "        }\n"
      "        body func @f.wb(%j: i32[], %c: f32[3], %q: f32[4,3]) -> (i32[], f32[3]) {\n"
      "          %one = constant dense<1> : i32[]\n"
      "          %0 = sub %j, %one : i32[]\n"
      "          %c2, %y = scan %c, %q {carry=1, xs=1, length=4, reverse=true} : f32[3], f32[4,3]\n"
      "            body func @f.sb(%k: f32[3], %t: f32[3]) -> (f32[3], f32[3]) {\n"
      "              %0 = add %k, %t : f32[3]\n"
      "              %1 = tanh %0 : f32[3]\n"
      "              return %1, %0\n"
      "            }\n"
      "          return %0, %c2\n"
      "        }\n"
      "      return %acc, %s\n"
      "    }\n"
      "    else func @f.else(%a: f32[3], %m: i32[], %s: f32[4,3]) -> (f32[3], f32[4,3]) {\n"
      "      %0 = neg %a : f32[3]\n"
      "      return %0, %s\n"
      "    }\n"
      "  %w = constant dense<[1, 2, 3, 4, 5, 6, 7, 8, 9, 1.5, 2.5, 3.5]> : f32[4,3]\n"
      "  %g = scan %r, %ix, %w, %tab {carry=1, xs=2, length=4, reverse=false} : f32[3]\n"
      "    body func @f.gb(%c: f32[3], %i: i64[2], %wr: f32[3], %tab: f32[6,3]) -> f32[3] {\n"
      "      %0 = gather %tab, %i {axis=0} : f32[2,3]\n"
      "      %1 = reduce_sum %0 {axes=[0]} : f32[3]\n"
      "      %2 = mul %1, %wr : f32[3]\n"
      "      %3 = add %c, %2 : f32[3]\n"
      "      return %3\n"
      "    }\n"
      "  return %r, %ys, %g\n"
      "}\n";
  ir_module *m = ir_parse(text, "control.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  const ir_func *f = ir_module_find(m, "f");
  std::string ptx = check_ptx(f, "sm_90", -1, "nested control flow");
  EXPECT_THAT(ptx, HasSubstr("atom.global.cas.b32")) << "the gather's error word";
  check_ptx(f, "sm_80", -1, "nested control flow");
  cuda_program *p = cuda_compile(f, "sm_90");
  ASSERT_NE(p, nullptr) << kiln_last_error();
  int control = 0, scan_kernels = 0;
  for (int s = 0; s < p->n_all; s++) {
    control += p->all[s]->kind >= CUDA_STEP_COND;
    scan_kernels += p->all[s]->kind == CUDA_STEP_KERNEL && p->all[s]->kernel_op == OP_SCAN;
  }
  EXPECT_EQ(control, 3) << "cond, while, the gather's scan (a host loop)";
  EXPECT_EQ(scan_kernels, 1) << "the elementwise scan in the while: one kernel looping on the device (ptx_scan.c)";
  EXPECT_GT(cuda_program_kernels(p), p->n_steps) << "most kernels are nested";
  for (int s = 0; s < p->n_all; s++)  // every nested kernel is an .entry
    if (p->all[s]->kind == CUDA_STEP_KERNEL) {
      EXPECT_THAT(ptx, HasSubstr(".entry " + std::string(p->all[s]->name) + "("));
    }
  cuda_program_free(p);
  ir_module_free(m);

  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_CONTROL;
  int n = program_count() / 5, with_control = 0;
  for (int i = 0; i < n && !HasFailure(); i++) {
    uint64_t seed = 1 + (uint64_t)i;
    ir_module *g = ir_gen_program(seed, &o);
    ASSERT_NE(g, nullptr) << kiln_last_error();
    char *t = ir_print_module(g);
    std::string what = "seed " + std::to_string(seed) + "\n" + (t ? t : "");
    free(t);
    ir_func *gf = ir_module_find(g, "gen");
    ASSERT_NE(gf, nullptr);
    ASSERT_EQ(pass_run_pipeline(gf, PASS_DEFAULT_PIPELINE, nullptr, nullptr, nullptr), 0) << what << kiln_last_error();
    bool has = false;
    for (int k = 0; k < gf->n_instrs; k++)
      has = has || gf->instrs[k].op == OP_COND || gf->instrs[k].op == OP_WHILE || gf->instrs[k].op == OP_SCAN;
    with_control += has;
    check_ptx(gf, i % 2 ? "sm_80" : "sm_90", -1, what);
    ir_module_free(g);
  }
  EXPECT_GT(with_control, n / 4) << "the generator made control flow";
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

namespace {

using namespace kiln_test;

// The GPU's float mod is integer arithmetic (NVPTX's frem is not C's fmod):
// it must be fmod to the bit, subnormals, huge quotients and specials included.
TEST(Ptx, FmodIsExact) {
  std::mt19937_64 rng(7);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    std::vector<double> x, y;
    const double special[] = {0.0, -0.0, 1.0, -1.5, 3.0, 1e-310, 5e-324, 1e-40, 1e30, -1e300, kInf, -kInf, kNan, 7.25};
    for (double a : special)
      for (double b : special) x.push_back(a), y.push_back(b);
    for (int i = 0; i < 3000; i++) {  // random bit patterns: every exponent
      uint64_t a = rng(), b = rng();
      double da, db;
      if (dt == KILN_F32) {
        float fa, fb;
        uint32_t ua = (uint32_t)a, ub = (uint32_t)(i % 3 ? b : a >> 32);
        std::memcpy(&fa, &ua, 4);
        std::memcpy(&fb, &ub, 4);
        da = fa, db = fb;
      } else {
        std::memcpy(&da, &a, 8);
        std::memcpy(&db, &b, 8);
      }
      x.push_back(da), y.push_back(db);
    }
    std::vector<double> got(x.size());
    ASSERT_EQ(kiln_debug_cuda_fmod(dt, (int64_t)x.size(), x.data(), y.data(), got.data()), 0) << kiln_last_error();
    int bad = 0;
    for (size_t i = 0; i < x.size() && bad < 10; i++) {
      double want = dt == KILN_F32 ? (double)std::fmod((float)x[i], (float)y[i]) : std::fmod(x[i], y[i]);
      bool same = std::isnan(want) ? std::isnan(got[i]) : std::memcmp(&want, &got[i], 8) == 0;
      if (!same) bad++;
      EXPECT_TRUE(same) << kiln_dtype_name(dt) << ": fmod(" << x[i] << ", " << y[i] << ") = " << want << ", got "
                        << got[i];
    }
  }
}

}  // namespace

// ---- column reductions: few outputs, long columns ----

namespace {

struct Parsed {
  ir_module *m;
  explicit Parsed(const std::string &text) : m(ir_parse(text.c_str(), "col.kir")) {
    EXPECT_NE(m, nullptr) << kiln_last_error() << "\n" << text;
  }
  ~Parsed() { ir_module_free(m); }
  const ir_func *f() const { return m ? ir_module_find(m, "f") : nullptr; }
};

std::vector<const cuda_step *> kernel_steps(const cuda_program *p) {
  std::vector<const cuda_step *> v;
  for (int i = 0; i < p->n_steps; i++)
    if (p->steps[i].kind == CUDA_STEP_KERNEL) v.push_back(&p->steps[i]);
  return v;
}

}  // namespace

// sum over axis 0 of [100000, 4]: blocks of 4 columns x 64 rows, many blocks
// down the column, then a kernel that adds each column's partials
TEST(Ptx, AColumnSumIsSplitOverBlocks) {
  Scoped scope;
  Parsed p("func @f(%x: f32[100000,4]) -> f32[4] {\n"
           "  %s = reduce_sum %x {axes=[0]} : f32[4]\n"
           "  return %s\n"
           "}\n");
  ASSERT_NE(p.f(), nullptr);
  for (const char *arch : {"sm_90", "sm_80"}) {
    SCOPED_TRACE(arch);
    std::string ptx = check_ptx(p.f(), arch, 2, "column sum");
    EXPECT_THAT(ptx, HasSubstr("bar.sync"));
    EXPECT_THAT(ptx, HasSubstr(".shared"));
    cuda_program *c = cuda_compile(p.f(), arch);
    ASSERT_NE(c, nullptr) << kiln_last_error();
    auto ks = kernel_steps(c);
    ASSERT_EQ(ks.size(), 2u);
    const cuda_step &part = *ks[0], &sum = *ks[1];
    EXPECT_EQ(part.grid[0], 1u) << "one tile of 4 columns";
    EXPECT_GE(part.grid[1], 64u) << "the 100000 rows over many blocks";
    EXPECT_LE(part.grid[1], 512u);
    EXPECT_EQ(part.grid[2], 1u);
    EXPECT_EQ(part.block[0], 256u);
    EXPECT_EQ(part.kernel_op, OP_REDUCE_SUM);
    ASSERT_EQ(part.n_bufs, 2);
    EXPECT_EQ(part.bufs[0].kind, CUDA_REF_ARENA) << "the partials";
    EXPECT_EQ(part.bufs[1].kind, CUDA_REF_PARAM);
    EXPECT_GE((int64_t)c->arena_bytes, (int64_t)part.grid[1] * 4 * 8) << "f64 partials, one per block and column";
    EXPECT_EQ(sum.grid[0], 1u);
    EXPECT_EQ(sum.block[0], 256u);
    ASSERT_EQ(sum.n_bufs, 2);
    EXPECT_EQ(sum.bufs[0].kind, CUDA_REF_RESULT);
    EXPECT_EQ(sum.bufs[1].kind, CUDA_REF_ARENA);
    EXPECT_EQ(sum.bufs[1].offset, part.bufs[0].offset) << "the second kernel reads what the first wrote";
    cuda_program_free(c);
  }
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

// the forms a reduction over leading axes takes: short columns keep a thread
// per output, many outputs keep a thread per output, a tile of 32 columns
// with few blocks is one kernel, a fused producer with two reductions
TEST(Ptx, ColumnReductionForms) {
  Scoped scope;
  struct C {
    std::string text;
    int kernels;
    unsigned grid0, grid1;  // of the first kernel
  };
  const std::vector<C> cs = {
      {"func @f(%x: f32[40,6]) -> f32[6] {\n  %s = reduce_sum %x {axes=[0]} : f32[6]\n  return %s\n}\n", 1, 1, 1},
      {"func @f(%x: f32[300,70000]) -> f32[70000] {\n  %s = reduce_max %x {axes=[0]} : f32[70000]\n  return %s\n}\n",
       1, 274, 1},
      // 257 columns: 9 tiles of 32, 300 rows of 8 threads: 2 splits
      {"func @f(%x: f64[300,257]) -> f64[257] {\n  %s = reduce_sum %x {axes=[0]} : f64[257]\n  return %s\n}\n", 2,
       9, 2},
      // 20 x 30 rows of 8 columns, no split: one kernel writes the outputs
      {"func @f(%x: i32[20,30,8]) -> i32[8] {\n  %s = reduce_min %x {axes=[0,1]} : i32[8]\n  return %s\n}\n", 1, 1,
       1},
      {"func @k(%x: f32[50,60,8], %y: f32[8]) -> (f32[8], f32[8]) {\n"
       "  %m = mul %x, %y : f32[50,60,8]\n"
       "  %s = reduce_sum %m {axes=[0,1]} : f32[8]\n"
       "  %t = reduce_max %m {axes=[0,1]} : f32[8]\n"
       "  return %s, %t\n"
       "}\n"
       "func @f(%x: f32[50,60,8], %y: f32[8]) -> (f32[8], f32[8]) {\n"
       "  %s, %t = fusion @k(%x, %y) : f32[8], f32[8]\n"
       "  return %s, %t\n"
       "}\n",
       2, 1, 0},
      {"func @f(%x: f64[9,1000,3]) -> f64[1,3] {\n  %s = reduce_prod %x {axes=[0,1], keepdims=true} : f64[1,1,3]\n"
       "  %r = reshape %s {shape=[1,3]} : f64[1,3]\n  return %r\n}\n",
       2, 1, 0},
  };
  for (const C &c : cs) {
    SCOPED_TRACE(c.text);
    Parsed p(c.text);
    if (!p.f()) continue;
    check_ptx(p.f(), "sm_90", c.kernels, c.text);
    check_ptx(p.f(), "sm_80", c.kernels, c.text);
    cuda_program *prog = cuda_compile(p.f(), "sm_90");
    ASSERT_NE(prog, nullptr) << kiln_last_error();
    auto ks = kernel_steps(prog);
    ASSERT_FALSE(ks.empty());
    EXPECT_EQ(ks[0]->grid[0], c.grid0);
    if (c.grid1)
      EXPECT_EQ(ks[0]->grid[1], c.grid1);
    else
      EXPECT_GT(ks[0]->grid[1], 1u);
    cuda_program_free(prog);
  }
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

// A fusion of reductions that also returns elementwise values of their
// input's shape (a batch norm backward's dy after relu beside its two sums)
// is one kernel, or its parts' kernel and their sum, that stores those
// values as its threads read each element; it was ten kernels, op by op.
// A column reduction split over blocks and a row reduction a block per row.
TEST(Ptx, ReductionKernelsStoreTheirSideOutputs) {
  Scoped scope;
  struct C {
    std::string text;
    int kernels;
    int first_bufs;  // the first kernel's buffers: side outputs, partials or sums, inputs
  };
  const std::vector<C> cs = {
      {"func @k(%x: f32[8,28,28,128], %m: f32[1,1,1,128], %z: f32[], %dy: f32[8,28,28,128])"
       " -> (f32[8,28,28,128], f32[1,1,1,128], f32[1,1,1,128]) {\n"
       "  %d = sub %x, %m : f32[8,28,28,128]\n"
       "  %p = gt %d, %z : bool[8,28,28,128]\n"
       "  %s = select %p, %dy, %z : f32[8,28,28,128]\n"
       "  %a = reduce_sum %s {axes=[0,1,2], keepdims=true} : f32[1,1,1,128]\n"
       "  %e = mul %s, %d : f32[8,28,28,128]\n"
       "  %b = reduce_sum %e {axes=[0,1,2], keepdims=true} : f32[1,1,1,128]\n"
       "  return %s, %a, %b\n}\n"
       "func @f(%x: f32[8,28,28,128], %m: f32[1,1,1,128], %z: f32[], %dy: f32[8,28,28,128])"
       " -> (f32[8,28,28,128], f32[1,1,1,128], f32[1,1,1,128]) {\n"
       "  %s, %a, %b = fusion @k(%x, %m, %z, %dy) : f32[8,28,28,128], f32[1,1,1,128], f32[1,1,1,128]\n"
       "  return %s, %a, %b\n}\n",
       2, 7},
      {"func @k(%x: f32[64,1000]) -> (f32[64,1000], f32[64]) {\n"
       "  %e = exp %x : f32[64,1000]\n"
       "  %s = reduce_sum %e {axes=[1]} : f32[64]\n"
       "  return %e, %s\n}\n"
       "func @f(%x: f32[64,1000]) -> (f32[64,1000], f32[64]) {\n"
       "  %e, %s = fusion @k(%x) : f32[64,1000], f32[64]\n"
       "  return %e, %s\n}\n",
       1, 3},
  };
  for (const C &c : cs) {
    SCOPED_TRACE(c.text);
    Parsed p(c.text);
    ASSERT_NE(p.f(), nullptr);
    for (const char *arch : {"sm_90", "sm_80"}) check_ptx(p.f(), arch, c.kernels, c.text);
    cuda_program *prog = cuda_compile(p.f(), "sm_90");
    ASSERT_NE(prog, nullptr) << kiln_last_error();
    auto ks = kernel_steps(prog);
    ASSERT_EQ((int)ks.size(), c.kernels);
    EXPECT_EQ(ks[0]->n_bufs, c.first_bufs);
    cuda_program_free(prog);
  }
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}

// ---- TF32 tensor cores (KILN_CUDA_TF32=1) ----

// f32 dot through mma.sync m16n8k8 TF32 only when asked; the launch shape is
// the same; f64 and integer dots never; off by default, so results match the CPU
TEST(Ptx, Tf32DotOnlyWhenAsked) {
  Scoped scope;
  Parsed p("func @f(%a: f32[3,70,33], %b: f32[33,90], %c: f64[5,7], %d: f64[7,3], %i: i32[4,9], %j: i32[9,6]) -> "
           "(f32[3,70,90], f64[5,3], i32[4,6]) {\n"
           "  %0 = dot %a, %b : f32[3,70,90]\n"
           "  %1 = dot %c, %d : f64[5,3]\n"
           "  %2 = dot %i, %j : i32[4,6]\n"
           "  return %0, %1, %2\n"
           "}\n");
  ASSERT_NE(p.f(), nullptr);
  const char *mma = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32";
  std::string plain;
  {
    EnvGuard env("KILN_CUDA_TF32", nullptr);
    plain = check_ptx(p.f(), "sm_90", 3, "default");
    EXPECT_EQ(plain.find("mma.sync"), std::string::npos) << "off by default";
  }
  {
    EnvGuard env("KILN_CUDA_TF32", "0");
    EXPECT_EQ(check_ptx(p.f(), "sm_80", 3, "KILN_CUDA_TF32=0").find("mma.sync"), std::string::npos);
  }
  EnvGuard env("KILN_CUDA_TF32", "1");
  for (const char *arch : {"sm_90", "sm_80"}) {
    SCOPED_TRACE(arch);
    std::string ptx = check_ptx(p.f(), arch, 3, std::string("tf32 ") + arch);
    size_t n = 0;
    for (size_t at = ptx.find(mma); at != std::string::npos; at = ptx.find(mma, at + 1)) n++;
    EXPECT_EQ(n, 8u) << "two k-steps of four n-tiles, in the f32 dot alone\n" << ptx;
    EXPECT_THAT(ptx, HasSubstr("cvt.rna.tf32.f32"));
    EXPECT_THAT(ptx, HasSubstr("fma.rn.f64")) << "the f64 dot keeps its FMAs";
    cuda_program *c = cuda_compile(p.f(), arch);
    ASSERT_NE(c, nullptr) << kiln_last_error();
    EXPECT_EQ(c->steps[0].grid[0], 2u);
    EXPECT_EQ(c->steps[0].grid[1], 2u);
    EXPECT_EQ(c->steps[0].grid[2], 3u);
    EXPECT_EQ(c->steps[0].block[0], 256u);
    cuda_program_free(c);
  }
  if (!have_ptxas()) GTEST_SKIP() << "ptxas not installed: PTX generated but not assembled";
}
