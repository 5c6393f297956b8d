// mlir_test.cc — the MLIR export (backends/mlir, kiln-opt --emit=mlir, the
// "mlir" stage of kiln_function_ir). Hand-written programs of every op
// family and control flow, checked on the printed text; then, where
// mlir-19-tools is installed, random programs and the examples' traced
// functions parsed and verified by mlir-opt-19, and random programs lowered
// by MLIR's own pipeline, run by mlir-cpu-runner-19 and compared with the
// reference interpreter.
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
#include "mlir/mlir.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

// The MLIR text of the .kir module, or "error: " and the message.
std::string emit(const char *kir) {
  ir_module *m = ir_parse(kir, "test.kir");
  if (!m) return std::string("parse error: ") + kiln_last_error();
  char *t = mlir_emit_module(m);
  std::string s = t ? t : std::string("error: ") + kiln_last_error();
  free(t);
  ir_module_free(m);
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

ir_gen_options random_options() {
  ir_gen_options o = ir_gen_default_options();
  o.kinds |= IR_GEN_CONTROL | IR_GEN_WINDOW;
  return o;
}

constexpr int kVerifySeeds = 400;

TEST(Mlir, RandomProgramsVerifyInMlirOpt) {
  ir_gen_options o = random_options();
  std::string all;
  int emitted = 0, control = 0, windows = 0;
  for (uint64_t seed = 0; seed < kVerifySeeds; seed++) {
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
  EXPECT_GT(control, kVerifySeeds / 10);
  EXPECT_GT(windows, kVerifySeeds / 20);
  std::string opt = find_tool("mlir-opt");
  if (opt.empty()) GTEST_SKIP() << "mlir-opt-19 not installed (apt-get install mlir-19-tools): " << emitted
                                << " programs emitted, none verified";
  TempDir dir;
  std::string err = verify(opt, dir, all, true);
  ASSERT_EQ(err.substr(0, 4000), "") << "mlir-opt-19 rejected some of the " << emitted << " programs";
  std::printf("  %d random programs (%d control-flow and %d window instructions) verified by %s\n", emitted, control,
              windows, opt.c_str());
}

}  // namespace
