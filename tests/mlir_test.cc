// mlir_test.cc — the MLIR export (backends/mlir, kiln-opt --emit=mlir, the
// "mlir" stage of kiln_function_ir). Hand-written programs of every op
// family and control flow, checked on the printed text; then, where
// mlir-19-tools is installed, random programs and the examples' traced
// functions parsed and verified by mlir-opt-19, and random programs lowered
// by MLIR's own pipeline, run by mlir-cpu-runner-19 and compared with the
// reference interpreter.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ir.h"
#include "ir_gen.h"
#include "may_jump.h"
#include "mlir/mlir.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

std::string mlir_opt_verify(const std::string &text);

// The MLIR text of the .kir module, or "error: " and the message. Where
// mlir-opt-19 is installed, the text must verify.
std::string emit(const char *kir) {
  ir_module *m = ir_parse(kir, "test.kir");
  if (!m) return std::string("parse error: ") + kiln_last_error();
  char *t = mlir_emit_module(m);
  std::string s = t ? t : std::string("error: ") + kiln_last_error();
  free(t);
  ir_module_free(m);
  if (s.compare(0, 6, "error:")) {
    EXPECT_EQ(mlir_opt_verify(s), "") << s;
  }
  return s;
}

#define EXPECT_HAS(text, needle) EXPECT_NE((text).find(needle), std::string::npos) << "no '" << (needle) << "' in\n" << (text)

TEST(Mlir, ElementwiseBroadcastsInTheIndexingMaps) {
  std::string s = emit(
      "func @f(%x: f32[2,3], %y: f32[1,3], %z: f32[]) -> f32[2,3] {\n"
      "  %a = add %x, %y : f32[2,3]\n"
      "  %b = mul %a, %z : f32[2,3]\n"
      "  return %b\n}\n");
  EXPECT_HAS(s, "func.func @f(%arg0: tensor<2x3xf32>, %arg1: tensor<1x3xf32>, %arg2: tensor<f32>) -> (tensor<2x3xf32>)");
  EXPECT_HAS(s, "affine_map<(d0, d1) -> (0, d1)>");  // the size-1 axis broadcast
  EXPECT_HAS(s, "affine_map<(d0, d1) -> ()>");       // the scalar
  EXPECT_HAS(s, "arith.addf");
  EXPECT_HAS(s, "arith.mulf");
  EXPECT_HAS(s, "func.return");
}

TEST(Mlir, UnaryOpsFollowTheKernels) {
  std::string s = emit(
      "func @f(%x: f32[4], %i: i32[4], %p: bool[4]) -> (f32[4], f32[4], f32[4], f32[4], f32[4], i32[4], i32[4], bool[4]) {\n"
      "  %a = tanh %x : f32[4]\n  %b = sigmoid %x : f32[4]\n  %c = relu %x : f32[4]\n"
      "  %d = rsqrt %x : f32[4]\n  %e = sign %x : f32[4]\n  %f = abs %i : i32[4]\n  %g = neg %i : i32[4]\n"
      "  %h = not %p : bool[4]\n"
      "  return %a, %b, %c, %d, %e, %f, %g, %h\n}\n");
  EXPECT_HAS(s, "math.tanh");
  EXPECT_HAS(s, "math.exp");      // sigmoid through e^-|x|
  EXPECT_HAS(s, "arith.cmpf olt"); // relu keeps NaN and -0
  EXPECT_HAS(s, "math.sqrt");     // rsqrt is 1 / sqrt, not math.rsqrt
  EXPECT_EQ(s.find("math.rsqrt"), std::string::npos);
  EXPECT_HAS(s, "arith.subi");    // integer neg and abs wrap
  EXPECT_HAS(s, "arith.xori");
}

TEST(Mlir, BinaryOpsKeepKilnsMeaning) {
  std::string s = emit(
      "func @f(%x: f32[4], %y: f32[4], %i: i64[4], %j: i64[4]) -> (f32[4], f32[4], i64[4], i64[4], i64[4], f32[4]) {\n"
      "  %a = max %x, %y : f32[4]\n  %b = mod %x, %y : f32[4]\n  %c = div %i, %j : i64[4]\n"
      "  %d = mod %i, %j : i64[4]\n  %e = pow %i, %j : i64[4]\n  %f = pow %x, %y : f32[4]\n"
      "  return %a, %b, %c, %d, %e, %f\n}\n");
  EXPECT_HAS(s, "arith.cmpf uno");  // NaN-propagating max, not arith.maximumf
  EXPECT_EQ(s.find("arith.maximumf"), std::string::npos);
  EXPECT_HAS(s, "arith.remf");
  EXPECT_HAS(s, "arith.divsi");
  EXPECT_HAS(s, "arith.remsi");
  EXPECT_HAS(s, "cf.assert");  // integer division by zero is an error in Kiln
  EXPECT_HAS(s, "math.ipowi");
  EXPECT_HAS(s, "math.powf");
}

TEST(Mlir, ComparesSelectsAndConverts) {
  std::string s = emit(
      "func @f(%x: f32[4], %y: f32[4], %d: f64[4], %i: i64[4]) -> (bool[4], f32[4], i32[4], f16[4], bf16[4], bool[4]) {\n"
      "  %n = ne %x, %y : bool[4]\n  %s = select %n, %x, %y : f32[4]\n"
      "  %c = convert %x {dtype=i32} : i32[4]\n  %h = convert %d {dtype=f16} : f16[4]\n"
      "  %b = convert %i {dtype=bf16} : bf16[4]\n  %z = convert %x {dtype=bool} : bool[4]\n"
      "  return %n, %s, %c, %h, %b, %z\n}\n");
  EXPECT_HAS(s, "arith.cmpf une");  // x != y holds for NaN
  EXPECT_HAS(s, "arith.select");
  EXPECT_HAS(s, "arith.fptosi");
  EXPECT_HAS(s, "0x4EFFFFFF");  // 2147483520: the largest f32 below 2^31, the saturating clamp
  EXPECT_HAS(s, "arith.truncf %");
  EXPECT_HAS(s, ": f32 to f16");   // f64 -> f16 through f32 rounded to odd
  EXPECT_HAS(s, ": i64 to f64");   // i64 -> bf16 likewise
  EXPECT_HAS(s, ": f32 to bf16");
}

TEST(Mlir, DataMovement) {
  std::string s = emit(
      "func @f(%x: f32[2,3], %s: f32[]) -> (f32[3,2], f32[6], f32[1,2], f32[4,3], f32[2,2,3], f32[1,1]) {\n"
      "  %t = transpose %x {perm=[1,0]} : f32[3,2]\n  %r = reshape %x {shape=[6]} : f32[6]\n"
      "  %l = slice %x {begin=[1,0], size=[1,2]} : f32[1,2]\n  %c = concat %x, %x {axis=0} : f32[4,3]\n"
      "  %b = broadcast %x {shape=[2,2,3]} : f32[2,2,3]\n  %e = reshape %s {shape=[1,1]} : f32[1,1]\n"
      "  return %t, %r, %l, %c, %b, %e\n}\n");
  EXPECT_HAS(s, "linalg.transpose");
  EXPECT_HAS(s, "permutation = [1, 0]");
  EXPECT_HAS(s, "tensor.collapse_shape %arg0 [[0, 1]] : tensor<2x3xf32> into tensor<6xf32>");
  EXPECT_HAS(s, "tensor.extract_slice %arg0[1, 0] [1, 2] [1, 1] : tensor<2x3xf32> to tensor<1x2xf32>");
  EXPECT_HAS(s, "into %t");
  EXPECT_HAS(s, "[2, 0] [2, 3] [1, 1] : tensor<2x3xf32> into tensor<4x3xf32>");  // the second operand's rows
  EXPECT_HAS(s, "tensor.expand_shape %arg1 [] output_shape [1, 1] : tensor<f32> into tensor<1x1xf32>");
}

TEST(Mlir, Reductions) {
  std::string s = emit(
      "func @f(%x: f32[2,3], %i: i32[2,3]) -> (f32[2,1], i32[3], f32[2], i64[3]) {\n"
      "  %a = reduce_sum %x {axes=[1], keepdims=true} : f32[2,1]\n"
      "  %b = reduce_prod %i {axes=[0], keepdims=false} : i32[3]\n"
      "  %c = reduce_max %x {axes=[1], keepdims=false} : f32[2]\n"
      "  %d = argmax %x {axis=0} : i64[3]\n"
      "  return %a, %b, %c, %d\n}\n");
  EXPECT_HAS(s, "linalg.reduce");
  EXPECT_HAS(s, "dimensions = [1]");
  EXPECT_HAS(s, "arith.extf");   // f32 sums accumulate in f64, as the kernels do
  EXPECT_HAS(s, "tensor<2xf64>");
  EXPECT_HAS(s, "arith.muli");
  EXPECT_HAS(s, "0xFF800000");  // reduce_max starts from -inf
  EXPECT_HAS(s, "linalg.index 0");  // argmax's position
  EXPECT_HAS(s, "into tensor<2x1xf32>");  // keepdims
}

TEST(Mlir, DotAsMatmulAndBatchMatmul) {
  std::string s = emit(
      "func @f(%a: f32[2,3], %b: f32[3,4], %c: f32[5,2,3], %d: f32[3,4]) -> (f32[2,4], f32[5,2,4]) {\n"
      "  %m = dot %a, %b : f32[2,4]\n  %n = dot %c, %d : f32[5,2,4]\n"
      "  return %m, %n\n}\n");
  EXPECT_HAS(s, "linalg.matmul ins(%arg0, %arg1 : tensor<2x3xf32>, tensor<3x4xf32>)");
  EXPECT_HAS(s, "linalg.batch_matmul");
  EXPECT_HAS(s, "tensor<5x3x4xf32>");  // the unbatched operand broadcast over the batch
  EXPECT_HAS(s, "linalg.fill");
}

TEST(Mlir, GatherScatterIota) {
  std::string s = emit(
      "func @f(%p: f32[5,3], %i: i32[2], %u: f32[2,3]) -> (f32[2,3], f32[5,3], i64[2,3]) {\n"
      "  %g = gather %p, %i {axis=0} : f32[2,3]\n"
      "  %s = scatter_add %u, %i {axis=0, shape=[5,3]} : f32[5,3]\n"
      "  %n = iota {dtype=i64, shape=[2,3]} : i64[2,3]\n"
      "  return %g, %s, %n\n}\n");
  EXPECT_HAS(s, "tensor.extract %arg0[");  // gather reads params inside the generic
  EXPECT_HAS(s, "\"gather: index out of range\"");
  EXPECT_HAS(s, "scf.for");
  EXPECT_HAS(s, "tensor.insert");
  EXPECT_HAS(s, "\"scatter_add: index out of range\"");
  EXPECT_HAS(s, "linalg.index 1");
}

TEST(Mlir, ConstantsAreExact) {
  std::string s = emit(
      "func @f() -> (i32[3], f32[2], f32[2], bool[2], f32[0,2]) {\n"
      "  %a = constant dense<[1, -2, 3]> : i32[3]\n  %b = constant dense<[1.0, 1.0]> : f32[2]\n"
      "  %c = constant dense<[nan, -inf]> : f32[2]\n  %d = constant dense<[true, false]> : bool[2]\n"
      "  %e = constant dense<[]> : f32[0,2]\n"
      "  return %a, %b, %c, %d, %e\n}\n");
  EXPECT_HAS(s, "arith.constant dense<[1, -2, 3]> : tensor<3xi32>");
  EXPECT_HAS(s, "arith.constant dense<0x3F800000> : tensor<2xf32>");  // a splat
  EXPECT_HAS(s, "0xFF800000]");
  EXPECT_HAS(s, "dense<[true, false]> : tensor<2xi1>");
  EXPECT_HAS(s, "tensor.empty() : tensor<0x2xf32>");
}

TEST(Mlir, Windows) {
  std::string s = emit(
      "func @f(%x: f32[1,5,5,4], %w: f32[3,3,4,6], %g: f32[3,3,2,6], %dy: f32[1,3,3,6]) -> "
      "(f32[1,3,3,6], f32[1,3,3,6], f32[1,2,2,4], f32[1,2,2,4], f32[1,5,5,4], f32[3,3,4,6]) {\n"
      "  %c = conv2d %x, %w {stride=[2,2], dilation=[1,1], padding=[1,1,1,1], groups=1} : f32[1,3,3,6]\n"
      "  %k = conv2d %x, %g {stride=[2,2], dilation=[1,1], padding=[1,1,1,1], groups=2} : f32[1,3,3,6]\n"
      "  %m = max_pool2d %x {window=[2,2], stride=[2,2], padding=[0,0,0,0]} : f32[1,2,2,4]\n"
      "  %a = avg_pool2d %x {window=[3,3], stride=[2,2], padding=[1,0,1,0]} : f32[1,2,2,4]\n"
      "  %bi = conv2d_backprop_input %dy, %w {shape=[1,5,5,4], stride=[2,2], dilation=[1,1], padding=[1,1,1,1], groups=1} : f32[1,5,5,4]\n"
      "  %bf = conv2d_backprop_filter %x, %dy {shape=[3,3,4,6], stride=[2,2], dilation=[1,1], padding=[1,1,1,1], groups=1} : f32[3,3,4,6]\n"
      "  return %c, %k, %m, %a, %bi, %bf\n}\n");
  EXPECT_HAS(s, "linalg.conv_2d_nhwc_hwcf {dilations = dense<[1, 1]> : tensor<2xi64>, strides = dense<[2, 2]> : tensor<2xi64>}");
  EXPECT_HAS(s, "tensor<1x7x7x4xf32>");  // the padded image
  EXPECT_HAS(s, "(d3 floordiv 3) * 2 + d6");  // the grouped convolution's input channel
  EXPECT_HAS(s, "d1 * 2 + d4 * 1");
  EXPECT_HAS(s, "arith.divf");  // average pooling divides by the count inside the image
}

TEST(Mlir, PoolingGradients) {
  std::string s = emit(
      "func @f(%x: f64[1,4,4,2], %dy: f64[1,2,2,2]) -> (f64[1,4,4,2], f64[1,4,4,2]) {\n"
      "  %m = max_pool2d_grad %x, %dy {window=[2,2], stride=[2,2], padding=[0,0,0,0]} : f64[1,4,4,2]\n"
      "  %a = avg_pool2d_grad %dy {shape=[1,4,4,2], window=[3,3], stride=[1,1], padding=[0,0,0,0]} : f64[1,4,4,2]\n"
      "  return %m, %a\n}\n");
  EXPECT_HAS(s, "scf.for");
  EXPECT_HAS(s, "arith.cmpf oeq");  // ties share the gradient
  EXPECT_HAS(s, "tensor.insert");
}

TEST(Mlir, ControlFlowAsScf) {
  std::string s = emit(
      "func @sq(%a: f32[3]) -> f32[3] {\n  %0 = mul %a, %a : f32[3]\n  return %0\n}\n"
      "func @f(%p: bool[], %x: f32[3], %n: i32[], %xs: f32[4,3]) -> (f32[3], f32[4,3]) {\n"
      "  %r, %ys = cond %p, %x, %n, %xs : f32[3], f32[4,3]\n"
      "    then func @f.c0.then(%a: f32[3], %m: i32[], %s: f32[4,3]) -> (f32[3], f32[4,3]) {\n"
      "      %i, %acc = while %m, %a, %s {state=2, max_iterations=10} : i32[], f32[3]\n"
      "        cond func @f.w0.cond(%j: i32[], %c: f32[3], %q: f32[4,3]) -> bool[] {\n"
      "          %z = constant dense<0> : i32[]\n          %0 = gt %j, %z : bool[]\n          return %0\n        }\n"
      "        body func @f.w0.body(%j: i32[], %c: f32[3], %q: f32[4,3]) -> (i32[], f32[3]) {\n"
      "          %one = constant dense<1> : i32[]\n          %0 = sub %j, %one : i32[]\n"
      "          %c2, %y = scan %c, %q {carry=1, xs=1, length=4, reverse=true} : f32[3], f32[4,3]\n"
      "            body func @f.s0.body(%k: f32[3], %t: f32[3]) -> (f32[3], f32[3]) {\n"
      "              %0 = add %k, %t : f32[3]\n              %1 = call @sq(%0) : f32[3]\n"
      "              return %0, %1\n            }\n"
      "          return %0, %c2\n        }\n"
      "      return %acc, %s\n    }\n"
      "    else func @f.c0.else(%a: f32[3], %m: i32[], %s: f32[4,3]) -> (f32[3], f32[4,3]) {\n"
      "      %0 = neg %a : f32[3]\n      return %0, %s\n    }\n"
      "  return %r, %ys\n}\n");
  EXPECT_HAS(s, "scf.if");
  EXPECT_HAS(s, "} else {");
  EXPECT_HAS(s, "scf.while");
  EXPECT_HAS(s, "scf.condition(");
  EXPECT_HAS(s, "arith.constant 10 : i64");  // max_iterations counts the trips
  EXPECT_HAS(s, "tensor.extract_slice");     // x_t
  EXPECT_HAS(s, "arith.constant 3 : index");  // reverse: row 3 - t
  EXPECT_HAS(s, "func.call @sq(");
  EXPECT_HAS(s, "func.func @sq(");
  // the regions are inline: no function of their own
  EXPECT_EQ(s.find("func.func @f.c0.then"), std::string::npos);
  EXPECT_EQ(s.find("func.func @f.s0.body"), std::string::npos);
}

TEST(Mlir, WhatMlirCannotExpressIsAnErrorNamingTheOp) {
  std::string s = emit(
      "func @f() -> f32[4] {\n"
      "  %u = rng_uniform {dtype=f32, shape=[4], lo=0.0, hi=1.0, seed=1, counter=2} : f32[4]\n"
      "  return %u\n}\n");
  EXPECT_HAS(s, "error: mlir: @f: %u: rng_uniform: random ops cannot be exported");
  s = emit(
      "func @f(%x: f32[4]) -> f32[4] {\n"
      "  %u = rng_normal {dtype=f32, shape=[4], seed=1, counter=2} : f32[4]\n"
      "  %v = add %x, %u : f32[4]\n  return %v\n}\n");
  EXPECT_HAS(s, "error: mlir: @f: %u: rng_normal:");
  s = emit(
      "func @f(%t: f32[3], %s: i32[2]) -> f32[3] {\n"
      "  %h, %k = host_call @no_such_callback(%t, %s) : f32[3], i32[2]\n  return %h\n}\n");
  EXPECT_HAS(s, "error: mlir: @f: %h: host_call: @no_such_callback is a C callback");
  // inside a region: the region's function and value
  s = emit(
      "func @f(%p: bool[]) -> f32[2] {\n"
      "  %r = cond %p : f32[2]\n"
      "    then func @f.t() -> f32[2] {\n"
      "      %u = rng_uniform {dtype=f32, shape=[2], lo=0.0, hi=1.0, seed=1, counter=2} : f32[2]\n"
      "      return %u\n    }\n"
      "    else func @f.e() -> f32[2] {\n      %z = constant dense<[0.0, 0.0]> : f32[2]\n      return %z\n    }\n"
      "  return %r\n}\n");
  EXPECT_HAS(s, "error: mlir: @f.t: %u: rng_uniform:");
  EXPECT_EQ(mlir_emit_func(nullptr), nullptr);
  EXPECT_STREQ(kiln_last_error(), "mlir: no function");
  EXPECT_EQ(mlir_emit_module(nullptr), nullptr);
}

// ---- the tools ----

std::string find_tool(const char *name) {
  std::string a = std::string("/usr/bin/") + name + "-19", b = std::string("/usr/lib/llvm-19/bin/") + name;
  if (access(a.c_str(), X_OK) == 0) return a;
  if (access(b.c_str(), X_OK) == 0) return b;
  return "";
}

// output (stdout and stderr) of a shell command; its status in *rc
std::string shell(const std::string &cmd, int *rc) {
  FILE *p = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  if (!p) {
    *rc = -1;
    return out;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  *rc = pclose(p);
  return out;
}

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/kiln_mlir_XXXXXX";
    path = mkdtemp(t) ? t : "";
  }
  ~TempDir() {
    if (!path.empty()) {
      int rc;
      shell("rm -rf '" + path + "'", &rc);
    }
  }
  std::string file(const std::string &name) const { return path + "/" + name; }
};

void write_file(const std::string &path, const std::string &text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Verifies text with mlir-opt; "" or mlir-opt's complaint.
std::string verify(const std::string &opt, const TempDir &dir, const std::string &text, bool split = false) {
  std::string in = dir.file("verify.mlir");
  write_file(in, text);
  int rc;
  std::string out = shell("timeout 300 " + opt + (split ? " --split-input-file " : " ") + in + " -o /dev/null", &rc);
  return rc == 0 ? "" : out.empty() ? "mlir-opt failed" : out;
}

std::string mlir_opt_verify(const std::string &text) {
  std::string opt = find_tool("mlir-opt");
  if (opt.empty()) return "";
  TempDir dir;
  return verify(opt, dir, text).substr(0, 4000);
}

// Every op kind, control flow and windows; from seed 1000 on, f16 and bf16
// values too (through convert and data movement); from seed 2000 on,
// special floats (NaN, infinities, 1e30 in the constants and arguments).
ir_gen_options random_options(uint64_t seed = 0) {
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_CONTROL | IR_GEN_WINDOW;
  if (seed >= 1000) o.dtypes |= 1u << KILN_F16 | 1u << KILN_BF16;
  if (seed >= 2000) o.special_floats = 1;
  return o;
}

// the seeds of the random tests: n of each option set
std::vector<uint64_t> random_seeds(int n_plain, int n_half, int n_special) {
  std::vector<uint64_t> s;
  for (int i = 0; i < n_plain; i++) s.push_back((uint64_t)i);
  for (int i = 0; i < n_half; i++) s.push_back(1000 + (uint64_t)i);
  for (int i = 0; i < n_special; i++) s.push_back(2000 + (uint64_t)i);
  return s;
}

// The "mlir" stage of a staged function: its traced IR (captures are
// parameters) as MLIR.
int dense_tanh(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_tanh(kiln_add(kiln_matmul(in[0], in[1]), kiln_scalar(KILN_F32, 0.5)));
  return out[0] ? 0 : -1;
}

TEST(Mlir, StageOfAStagedFunction) {
  Scoped sc;
  kiln_function *f = kiln_function_new("dense_tanh", dense_tanh, nullptr, 2, 1);
  kiln_tensor *in[2] = {f32({2, 3}, {1, 2, 3, 4, 5, 6}), f32({3, 2}, {1, 0, 0, 1, 1, 1})}, *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, in, &out), 0) << kiln_last_error();
  char *t = kiln_function_ir(f, 0, "mlir");
  ASSERT_NE(t, nullptr) << kiln_last_error();
  std::string s = t;
  free(t);
  EXPECT_HAS(s, "func.func @dense_tanh(%arg0: tensor<2x3xf32>, %arg1: tensor<3x2xf32>");
  EXPECT_HAS(s, "linalg.matmul");
  EXPECT_HAS(s, "math.tanh");
  EXPECT_EQ(mlir_opt_verify(s), "") << s;
  EXPECT_EQ(kiln_function_ir(f, 1, "mlir"), nullptr);
  EXPECT_THAT(kiln_last_error(), testing::StartsWith("function_ir: @dense_tanh: trace 1 does not exist"));
  EXPECT_EQ(kiln_function_ir(f, 0, "mlir-x"), nullptr);
  EXPECT_THAT(kiln_last_error(), testing::HasSubstr("(traced, optimized, llvm, asm, ptx, mlir)"));
  kiln_function_free(f);
}

// A staged function whose body draws random numbers: the stage fails
// naming the op, prefixed like every function_ir error.
int noisy(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  int64_t shape[1] = {3};
  out[0] = kiln_add(in[0], kiln_random_uniform(KILN_F32, 1, shape, 0.0, 1.0));
  return out[0] ? 0 : -1;
}

TEST(Mlir, StageOfARandomFunctionFailsNamingTheOp) {
  Scoped sc;
  kiln_function *f = kiln_function_new("noisy", noisy, nullptr, 1, 1);
  kiln_tensor *x = f32({1, 2, 3}), *out = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &out), 0) << kiln_last_error();
  EXPECT_EQ(kiln_function_ir(f, 0, "mlir"), nullptr);
  EXPECT_THAT(kiln_last_error(), testing::StartsWith("function_ir: @noisy: mlir: @noisy: "));
  EXPECT_THAT(kiln_last_error(), testing::HasSubstr("rng_uniform: random ops cannot be exported"));
  kiln_function_free(f);
}

// Every .kir file of tests/ir that parses (the bad ones do not) as MLIR
// that verifies, or an error naming the op MLIR cannot express.
TEST(Mlir, TestKirFilesVerify) {
  std::string dir = source_dir(__FILE__) + "ir";
  int rc, n = 0, refused = 0;
  std::string list = shell("find '" + dir + "' -name '*.kir' -not -path '*/bad/*' | sort", &rc);
  std::istringstream ls(list);
  std::string path;
  while (std::getline(ls, path)) {
    std::ifstream in(path);
    std::stringstream buf;
    buf << in.rdbuf();
    ir_module *m = ir_parse(buf.str().c_str(), path.c_str());
    if (!m) continue;  // files that test parse errors
    char *t = mlir_emit_module(m);
    ir_module_free(m);
    if (!t) {
      std::string e = kiln_last_error();
      EXPECT_TRUE(e.find("host_call:") != std::string::npos || e.find("rng_") != std::string::npos ||
                  e.find("a collective cannot be exported") != std::string::npos)
          << path << ": " << e;
      refused++;
      continue;
    }
    EXPECT_EQ(mlir_opt_verify(t), "") << path;
    free(t);
    n++;
  }
  EXPECT_GT(n, 15);
  std::printf("  %d tests/ir files as MLIR, %d refused (random ops, host callbacks, collectives)%s\n", n, refused,
              find_tool("mlir-opt").empty() ? " (not verified: no mlir-opt-19)" : ", verified by mlir-opt-19");
}

// The examples' traced functions (examples/*.c, run with KILN_DUMP to
// write each trace's IR): every one verifies, or fails naming the op MLIR
// cannot express (digits_train_step's host callback).
TEST(Mlir, ExamplesTracedFunctionsVerify) {
  char exe[4096];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  ASSERT_GT(len, 0);
  exe[len] = 0;
  std::string bin = std::string(exe).substr(0, std::string(exe).rfind('/') + 1);
  TempDir dir;
  int rc, traced = 0, verified = 0, refused = 0;
  for (const char *ex : {"tour", "digits_cnn", "hello", "linear_regression", "hypersurface"}) {
    std::string d = dir.file(ex);
    std::string out = shell("cd '" + bin + "' && KILN_DUMP='" + d + "' KILN_CACHE_DIR='" + dir.file("cache") +
                                "' timeout 300 ./" + ex + " > /dev/null",
                            &rc);
    ASSERT_EQ(rc, 0) << ex << ": " << out;
    std::string list = shell("ls '" + d + "'/*.traced.kir 2>/dev/null", &rc);
    std::istringstream ls(list);
    std::string path;
    while (std::getline(ls, path)) {
      std::ifstream in(path);
      std::stringstream buf;
      buf << in.rdbuf();
      ir_module *m = ir_parse(buf.str().c_str(), path.c_str());
      ASSERT_NE(m, nullptr) << path << ": " << kiln_last_error();
      char *t = mlir_emit_module(m);
      ir_module_free(m);
      traced++;
      if (!t) {
        EXPECT_THAT(kiln_last_error(), testing::HasSubstr(": host_call: @")) << path;
        refused++;
        continue;
      }
      EXPECT_EQ(mlir_opt_verify(t), "") << path;
      verified += !find_tool("mlir-opt").empty();
      free(t);
    }
  }
  EXPECT_GE(traced, 4);
  if (find_tool("mlir-opt").empty())
    GTEST_SKIP() << "mlir-opt-19 not installed (apt-get install mlir-19-tools): " << traced
                 << " traced functions emitted, none verified";
  std::printf("  %d traced functions of the examples: %d verified by mlir-opt-19, %d refused (host callbacks)\n", traced,
              verified, refused);
}

constexpr int kVerifySeeds = 400;

TEST(Mlir, RandomProgramsVerifyInMlirOpt) {
  std::string all;
  int emitted = 0, control = 0, windows = 0;
  for (uint64_t seed : random_seeds(kVerifySeeds, 100, 100)) {
    ir_gen_options o = random_options(seed);
    ir_module *m = ir_gen_program(seed, &o);
    ASSERT_NE(m, nullptr) << "seed " << seed << ": " << kiln_last_error();
    char *t = mlir_emit_module(m);
    ASSERT_NE(t, nullptr) << "seed " << seed << ": " << kiln_last_error();
    for (int i = 0; i < m->funcs[0]->n_instrs; i++) {
      op_kind k = ir_op_info(m->funcs[0]->instrs[i].op)->kind;
      control += k == OPK_CONTROL, windows += k == OPK_WINDOW;
    }
    if (emitted++) all += "// -----\n";
    all += "// seed " + std::to_string(seed) + "\n" + t;
    free(t);
    ir_module_free(m);
  }
  EXPECT_GT(control, emitted / 10);
  EXPECT_GT(windows, emitted / 20);
  std::string opt = find_tool("mlir-opt");
  if (opt.empty()) GTEST_SKIP() << "mlir-opt-19 not installed (apt-get install mlir-19-tools): " << emitted
                                << " programs emitted, none verified";
  TempDir dir;
  std::string err = verify(opt, dir, all, true);
  ASSERT_EQ(err.substr(0, 4000), "") << "mlir-opt-19 rejected some of the " << emitted << " programs";
  std::printf("  %d random programs (%d control-flow and %d window instructions) verified by %s\n", emitted, control,
              windows, opt.c_str());
}

// ---- running random programs through MLIR's own pipeline ----

// Which values may differ from the interpreter by more than rounding when
// MLIR computes them: libm's exp, log, tanh and sigmoid (Kiln has its own)
// and convolutions' summation order too; regions followed (may_jump.h).
JumpRules mlir_jump_rules() {
  JumpRules r;
  r.libm = r.windows = true;
  return r;
}

const char *elem(kiln_dtype dt) {
  static const char *const n[] = {"f32", "f64", "i32", "i64", "i1", "f16", "bf16"};
  return n[dt];
}

std::string type_of(const op_type &t) {
  std::string s = "tensor<";
  for (int i = 0; i < t.rank; i++) s += std::to_string(t.shape[i]) + "x";
  return s + elem(t.dtype) + ">";
}

// Prints a 64-bit value as 16 hex digits and a newline, through libc's
// putchar (no MLIR runtime library needed).
const char *kPrintHex = R"(func.func private @putchar(i32) -> i32
func.func @kiln_print_hex(%v: i64) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c16 = arith.constant 16 : index
  %c4 = arith.constant 4 : i64
  %c10 = arith.constant 10 : i64
  %c15 = arith.constant 15 : i64
  %c48 = arith.constant 48 : i64
  %c87 = arith.constant 87 : i64
  scf.for %i = %c0 to %c16 step %c1 {
    %i64 = arith.index_cast %i : index to i64
    %k = arith.subi %c15, %i64 : i64
    %sh = arith.muli %k, %c4 : i64
    %s = arith.shrui %v, %sh : i64
    %d = arith.andi %s, %c15 : i64
    %lt = arith.cmpi ult, %d, %c10 : i64
    %base = arith.select %lt, %c48, %c87 : i64
    %ch64 = arith.addi %d, %base : i64
    %ch = arith.trunci %ch64 : i64 to i32
    %r = func.call @putchar(%ch) : (i32) -> i32
  }
  %nl = arith.constant 10 : i32
  %r2 = func.call @putchar(%nl) : (i32) -> i32
  return
}
)";

// The statements of @main printing every element of result r (named res)
// of type t, in row-major order, as its bits.
std::string print_result(const std::string &res, const op_type &t, int *tmp) {
  std::string s, idx, ind = "  ";
  std::string id = std::to_string((*tmp)++);
  for (int d = 0; d < t.rank; d++) {
    std::string iv = "%i" + id + "_" + std::to_string(d);
    s += ind + "%n" + id + "_" + std::to_string(d) + " = arith.constant " + std::to_string(t.shape[d]) + " : index\n";
    s += ind + "scf.for " + iv + " = %c0 to %n" + id + "_" + std::to_string(d) + " step %c1 {\n";
    idx += (d ? ", " : "") + iv;
    ind += "  ";
  }
  std::string e = "%e" + id, b = "%b" + id, w = "%w" + id;
  s += ind + e + " = tensor.extract " + res + "[" + idx + "] : " + type_of(t) + "\n";
  switch (t.dtype) {
    case KILN_F32: s += ind + b + " = arith.bitcast " + e + " : f32 to i32\n" + ind + w + " = arith.extui " + b + " : i32 to i64\n"; break;
    case KILN_F64: s += ind + w + " = arith.bitcast " + e + " : f64 to i64\n"; break;
    case KILN_I32: s += ind + w + " = arith.extui " + e + " : i32 to i64\n"; break;
    case KILN_I64: w = e; break;
    case KILN_BOOL: s += ind + w + " = arith.extui " + e + " : i1 to i64\n"; break;
    default:
      s += ind + b + " = arith.bitcast " + e + " : " + elem(t.dtype) + " to i16\n" + ind + w + " = arith.extui " + b +
           " : i16 to i64\n";
  }
  s += ind + "func.call @kiln_print_hex(" + w + ") : (i64) -> ()\n";
  for (int d = t.rank - 1; d >= 0; d--) {
    ind.resize(ind.size() - 2);
    s += ind + "}\n";
  }
  return s;
}

// memrefCopy, the one function of MLIR's runtime library (libmlir_c_runner_utils,
// not in mlir-19-tools) that lowered code calls: a copy between strided
// memrefs (finalize-memref-to-llvm calls it for non-contiguous ones).
// Compiled for the test with the system's C compiler.
const char *kMemrefCopy = R"(#include <stdint.h>
#include <string.h>
typedef struct { int64_t rank; void *descriptor; } unranked;
void memrefCopy(int64_t es, unranked *src, unranked *dst) {
  int64_t r = src->rank, idx[64] = {0}, n = 1;
  char **s = (char **)src->descriptor, **d = (char **)dst->descriptor;
  int64_t *sm = (int64_t *)(s + 2), *dm = (int64_t *)(d + 2);
  for (int64_t i = 0; i < r; i++) n *= sm[1 + i];
  for (int64_t k = 0; k < n; k++) {
    int64_t so = sm[0], dof = dm[0];
    for (int64_t i = 0; i < r; i++) so += idx[i] * sm[1 + r + i], dof += idx[i] * dm[1 + r + i];
    memcpy(d[1] + dof * es, s[1] + so * es, (size_t)es);
    for (int64_t i = r - 1; i >= 0 && ++idx[i] == sm[1 + i]; i--) idx[i] = 0;
  }
}
)";

// MLIR's pipeline from tensors to the LLVM dialect (LLVM 19: no
// linalg-bufferize; math.tanh and friends through libm, math.ipowi through
// a function).
const char *kLowering =
    " --one-shot-bufferize=\"bufferize-function-boundaries function-boundary-type-conversion=identity-layout-map allow-return-allocs-from-loops\""
    " --convert-linalg-to-loops --lower-affine --convert-scf-to-cf --convert-math-to-funcs --convert-math-to-libm"
    " --convert-math-to-llvm --expand-strided-metadata --lower-affine --finalize-memref-to-llvm --convert-arith-to-llvm"
    " --convert-index-to-llvm --convert-func-to-llvm --convert-cf-to-llvm --reconcile-unrealized-casts";

// One random program made runnable: @kiln_main_<seed> returns @gen applied
// to constant arguments; want holds the interpreter's results.
struct Runnable {
  uint64_t seed;
  ir_module *m = nullptr;
  std::vector<kiln_tensor *> want;
  std::vector<bool> jumped;
  std::string text, kir, error;
  int64_t lines = 0;  // elements printed
  explicit Runnable(uint64_t s) : seed(s) {
    kiln_scope_push();  // the arguments and results: the IR's constants and want retain what they keep
    build(s);
    kiln_scope_pop();
  }
  void build(uint64_t s) {
    ir_gen_options o = random_options(s);
    m = ir_gen_program(s, &o);
    if (!m) {
      error = kiln_last_error();
      return;
    }
    char *k = ir_print_module(m);
    kir = k ? k : "";
    free(k);
    ir_func *f = m->funcs[0];
    std::vector<kiln_tensor *> args((size_t)f->n_params);
    want.resize((size_t)f->n_results);
    if ((o.special_floats ? ir_gen_special_args(f, s, args.data()) : ir_gen_args(f, s, args.data())) ||
        ir_interpret(f, args.data(), want.data())) {
      error = kiln_last_error();
      return;
    }
    for (auto *t : want) kiln_retain(t);
    JumpFlags fl;  // of f's results
    std::vector<bool> exact((size_t)f->n_params, false);
    region_jump_flags(f, exact, exact, mlir_jump_rules(), &fl);
    jumped = fl.jumped;
    // every function renamed after the seed, so that programs share a module
    for (int i = 0; i < m->n_funcs; i++) {
      std::string n = "s" + std::to_string(s) + "_" + m->funcs[i]->name;
      free(m->funcs[i]->name);
      m->funcs[i]->name = strdup(n.c_str());
    }
    std::string mn = "s" + std::to_string(s) + "_main";
    ir_func *main = ir_func_new(m, mn.c_str(), 0, nullptr);
    std::vector<ir_value> in;
    ir_loc loc = {nullptr, 0};
    for (auto *a : args) in.push_back(ir_constant(main, a, loc));
    op_attrs at;
    memset(&at, 0, sizeof at);
    at.callee = f;
    ir_value r = ir_append(main, OP_CALL, &at, (int)in.size(), in.data(), loc);
    std::vector<ir_value> res;
    for (int k = 0; k < f->n_results; k++) res.push_back(r + k);
    if (r < 0 || ir_set_results(main, (int)res.size(), res.data())) {
      error = kiln_last_error();
      return;
    }
    char *t = mlir_emit_module(m);
    if (!t) {
      error = kiln_last_error();
      return;
    }
    text = t;
    free(t);
    for (auto *w : want) lines += kiln_tensor_size(w);
  }
  ~Runnable() {
    for (auto *t : want) kiln_release(t);
    ir_module_free(m);
  }
  // the statements of @main calling it and printing its results
  std::string main_calls(int *tmp) const {
    const ir_func *f = m->funcs[0];
    std::string r = "%r" + std::to_string(seed), types;
    for (int k = 0; k < f->n_results; k++) types += (k ? ", " : "") + type_of(f->types[f->results[k]]);
    std::string s = "  " + r + (f->n_results > 1 ? ":" + std::to_string(f->n_results) : "") + " = func.call @s" +
                    std::to_string(seed) + "_main() : () -> (" + types + ")\n";
    for (int k = 0; k < f->n_results; k++)
      s += print_result(f->n_results > 1 ? r + "#" + std::to_string(k) : r, f->types[f->results[k]], tmp);
    return s;
  }
  // compares the printed bits from line *at on; "" or what differs
  std::string check(const std::vector<uint64_t> &bits, size_t *at) const {
    const ir_func *f = m->funcs[0];
    std::ostringstream why;
    for (int k = 0; k < f->n_results; k++) {
      kiln_tensor *w = want[(size_t)k];
      int64_t n = kiln_tensor_size(w);
      kiln_dtype dt = kiln_tensor_dtype(w);
      size_t es = kiln_dtype_size(dt);
      if (*at + (size_t)n > bits.size()) return "the output ends early";
      bool skip = jumped[(size_t)k];
      for (int64_t i = 0; i < n && why.tellp() == 0; i++) {
        uint64_t u = bits[*at + (size_t)i], v = 0;
        std::memcpy(&v, (const char *)kiln_tensor_data(w) + (size_t)i * es, es);
        if (u == v || skip) continue;
        if (dt == KILN_F32 || dt == KILN_F64) {
          double a, b;
          if (dt == KILN_F32) {
            float fa, fb;
            uint32_t ua = (uint32_t)u, ub = (uint32_t)v;
            std::memcpy(&fa, &ua, 4), std::memcpy(&fb, &ub, 4);
            a = fa, b = fb;
          } else {
            std::memcpy(&a, &u, 8), std::memcpy(&b, &v, 8);
          }
          if ((a != a && b != b) || std::fabs(a - b) <= 1e-5 * std::fabs(b) + 1e-5) continue;
          why << "result " << k << " element " << i << ": MLIR " << a << ", interpreter " << b;
        } else {
          why << "result " << k << " (" << elem(dt) << ") element " << i << ": MLIR bits " << std::hex << u
              << ", interpreter " << v << std::dec;
        }
      }
      *at += (size_t)n;
      if (why.tellp() != 0) return why.str();
    }
    return "";
  }
};

// Lowers and runs the programs in one module; their outputs' lines.
std::string run_batch(const std::string &opt, const std::string &runner, const std::string &shim, const TempDir &dir,
                      const std::vector<Runnable *> &batch, std::vector<uint64_t> *bits) {
  std::string text = kPrintHex, main = "func.func @main() {\n  %c0 = arith.constant 0 : index\n  %c1 = arith.constant 1 : index\n";
  int tmp = 0;
  for (const Runnable *r : batch) text += r->text, main += r->main_calls(&tmp);
  text += main + "  return\n}\n";
  std::string in = dir.file("run.mlir"), low = dir.file("run.llvm.mlir");
  write_file(in, text);
  int rc;
  std::string out = shell("timeout 300 " + opt + " " + in + kLowering + " -o " + low, &rc);
  if (rc) return "lowering failed: " + out.substr(0, 3000);
  out = shell("timeout 300 " + runner + " " + low + " -e main -entry-point-result=void -shared-libs=" + shim, &rc);
  if (rc) return "mlir-cpu-runner failed (" + std::to_string(rc) + "): " + out.substr(0, 3000);
  std::istringstream ls(out);
  std::string line;
  while (std::getline(ls, line)) {
    if (line.size() != 16) return "unexpected output line '" + line + "'";
    bits->push_back(std::stoull(line, nullptr, 16));
  }
  return "";
}

constexpr int kRunSeeds = 240, kBatch = 20;

TEST(Mlir, RandomProgramsRunInMlirAsInTheInterpreter) {
  Scoped sc;  // no tensor outlives the programs
  std::string opt = find_tool("mlir-opt"), runner = find_tool("mlir-cpu-runner");
  std::vector<Runnable *> progs;
  for (uint64_t seed : random_seeds(kRunSeeds, 40, 40)) {
    progs.push_back(new Runnable(seed));
    ASSERT_EQ(progs.back()->error, "") << "seed " << seed;
  }
  if (opt.empty() || runner.empty()) {
    for (auto *p : progs) delete p;
    GTEST_SKIP() << "mlir-opt-19 / mlir-cpu-runner-19 not installed (apt-get install mlir-19-tools): " << progs.size()
                 << " programs emitted, none run";
  }
  TempDir dir;
  std::string shim = dir.file("libmemrefcopy.so");
  write_file(dir.file("memrefcopy.c"), kMemrefCopy);
  int rc;
  std::string cc = shell("cc -shared -fPIC -O1 -o " + shim + " " + dir.file("memrefcopy.c"), &rc);
  if (rc) {
    for (auto *p : progs) delete p;
    GTEST_SKIP() << "no C compiler (cc) for the runner's memrefCopy: " << cc;
  }
  int ran = 0, checked = 0, results = 0, control = 0;
  for (size_t b0 = 0; b0 < progs.size(); b0 += kBatch) {
    std::vector<Runnable *> batch(progs.begin() + (long)b0, progs.begin() + (long)std::min(progs.size(), b0 + kBatch));
    std::vector<uint64_t> bits;
    std::string err = run_batch(opt, runner, shim, dir, batch, &bits);
    if (!err.empty() && getenv("KILN_MLIR_KEEP")) { int rc; shell("cp " + dir.file("run.mlir") + " /tmp/mlirw/fail.mlir", &rc); }
    ASSERT_EQ(err, "") << "programs " << batch.front()->seed << " to " << batch.back()->seed;
    size_t at = 0;
    for (const Runnable *r : batch) {
      std::string why = r->check(bits, &at);
      EXPECT_EQ(why, "") << "seed " << r->seed << ":\n" << r->kir;
      ran++;
      for (bool j : r->jumped) checked += !j, results++;
      for (int i = 0; i < r->m->funcs[0]->n_instrs; i++)
        control += ir_op_info(r->m->funcs[0]->instrs[i].op)->kind == OPK_CONTROL;
    }
    EXPECT_EQ(at, bits.size()) << "extra output";
  }
  for (auto *p : progs) delete p;
  std::printf("  %d random programs (%d control-flow instructions) run by %s; %d of their %d results checked (the "
              "others may jump: a compare of an inexact float, ...)\n", ran, control, runner.c_str(), checked, results);
  EXPECT_GT(checked, results / 2);
}

}  // namespace
