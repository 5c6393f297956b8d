// simplify_broadcast_test.cc — simplify's rule for an elementwise operand
// that is a reshape broadcasting like its source: sub(x, reshape(m)) with m
// [1,1,1,C] and the reshape [C] reads m itself, so cse merges it with
// sub(x, m) (a training batch norm computed x - mean twice, once from
// moments' kept dims and once from the mean reshaped for batch_norm, and
// wrote both). Checked on the IR (the rule fires where the shapes differ
// only in leading 1s and not otherwise), on values (interpreted before and
// after, bit for bit), and on a staged batch norm's kernels.
#include <gtest/gtest.h>
#include <kiln.h>

#include <cstring>
#include <string>
#include <vector>

#include "ir.h"
#include "ir_test_util.h"
#include "passes.h"
#include "test_util.h"

using namespace kiln_test;

namespace {

// the results' bytes (the interpreter's tensors live in the caller's scope)
std::vector<std::vector<unsigned char>> interpret(const ir_func *f, const std::vector<kiln_tensor *> &args) {
  std::vector<kiln_tensor *> res((size_t)f->n_results + 1, nullptr);
  std::vector<std::vector<unsigned char>> out;
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
  return out;
}

}  // namespace

TEST(SimplifyBroadcast, ReshapedOperandsMergeWithTheirSource) {
  Scoped s;
  ir_module *m = ir_parse(
      "func @f(%x: f32[2,3,4], %m: f32[1,1,4], %k: f32[4,1], %c: bool[2,3,4], %p: f32[3,4], %y: f32[2,4,3], "
      "%n: f32[], %z: f32[4]) -> (f32[2,3,4], f32[2,3,4], f32[2,3,4], f32[2,3,4], f32[2,3,4], bool[2,3,4], "
      "f32[2,4,3], f32[1,1,4]) {\n"
      "  %a = sub %x, %m : f32[2,3,4]\n"
      "  %r = reshape %m {shape=[4]} : f32[4]\n"
      "  %b = sub %x, %r : f32[2,3,4]\n"           // the same elements as %a
      "  %q = reshape %m {shape=[1,4]} : f32[1,4]\n"
      "  %d = select %c, %q, %x : f32[2,3,4]\n"    // reads %m
      "  %t = reshape %k {shape=[1,4]} : f32[1,4]\n"
      "  %e = add %x, %t : f32[2,3,4]\n"           // [4,1] -> [1,4] moves the 4: stays
      "  %w = reshape %m {shape=[2,2]} : f32[2,2]\n"
      "  %u = reshape %w {shape=[4]} : f32[4]\n"
      "  %g = mul %x, %u : f32[2,3,4]\n"           // reshape of reshape: simplify makes it one, then reads %m
      "  %h = gt %x, %r : bool[2,3,4]\n"
      "  %v = reshape %p {shape=[4,3]} : f32[4,3]\n"
      "  %i = add %y, %v : f32[2,4,3]\n"           // [3,4] -> [4,3]: the same rank, other dims: stays
      "  %o = reshape %n {shape=[1,1,1]} : f32[1,1,1]\n"
      "  %j = add %z, %o : f32[1,1,4]\n"            // only the reshape gives the result its rank: stays
      "  return %a, %b, %d, %e, %g, %h, %i, %j\n"
      "}\n",
      "bcast.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  ir_func *f = ir_module_find(m, "f");
  kiln_random_seed(5);
  int64_t xs[3] = {2, 3, 4}, ms[3] = {1, 1, 4}, ks[2] = {4, 1}, ps[2] = {3, 4}, ys[3] = {2, 4, 3};
  std::vector<kiln_tensor *> args = {kiln_random_normal(KILN_F32, 3, xs), kiln_random_normal(KILN_F32, 3, ms),
                                     kiln_random_normal(KILN_F32, 2, ks),
                                     kiln_greater(kiln_random_normal(KILN_F32, 3, xs), kiln_scalar(KILN_F32, 0)),
                                     kiln_random_normal(KILN_F32, 2, ps), kiln_random_normal(KILN_F32, 3, ys),
                                     kiln_scalar(KILN_F32, 0.25), kiln_random_normal(KILN_F32, 1, ms + 2)};
  std::vector<std::vector<unsigned char>> want = interpret(f, args);
  ASSERT_EQ(kiln_pass_simplify(f), 0) << kiln_last_error();
  ASSERT_EQ(kiln_pass_cse(f), 0) << kiln_last_error();
  ASSERT_EQ(kiln_pass_dce(f), 0) << kiln_last_error();
  ASSERT_EQ(ir_verify(f), 0) << kiln_last_error();
  EXPECT_EQ(f->results[0], f->results[1]) << "sub(x, reshape(m)) and sub(x, m) merged";
  for (int k : {0, 2, 5}) {
    const ir_instr *d = ir_def(f, f->results[k]);
    ASSERT_NE(d, nullptr);
    bool reads_m = false;
    for (int j = 0; j < d->n_in; j++) reads_m |= d->in[j] == 1;
    EXPECT_TRUE(reads_m) << "result " << k << " reads %m directly";
  }
  const ir_instr *e = ir_def(f, f->results[3]);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(ir_def(f, e->in[1])->op, OP_RESHAPE) << "a reshape that moves a dim stays";
  const ir_instr *g = ir_def(f, f->results[4]);
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->in[1], 1) << "a reshape of a reshape of %m reads %m";
  const ir_instr *i = ir_def(f, f->results[6]);
  ASSERT_NE(i, nullptr);
  EXPECT_EQ(ir_def(f, i->in[1])->op, OP_RESHAPE) << "a reshape that reorders dims stays";
  const ir_instr *j = ir_def(f, f->results[7]);
  ASSERT_NE(j, nullptr);
  EXPECT_EQ(ir_def(f, j->in[1])->op, OP_RESHAPE) << "the reshape that gives the result its rank stays";
  EXPECT_EQ(count(f, OP_RESHAPE), 3);
  EXPECT_EQ(interpret(f, args), want);
  ir_module_free(m);
}

namespace {

int bn_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tape *t = kiln_tape_begin(false);
  kiln_tape_watch(t, in[0]);
  kiln_tensor *mean, *var;
  int ax[3] = {0, 1, 2};
  int rc = kiln_moments(in[0], 3, ax, false, &mean, &var);
  kiln_tensor *y = rc ? nullptr : kiln_relu(kiln_batch_norm(in[0], mean, var, in[2], in[1], 1e-5));
  kiln_tensor *loss = kiln_reduce_sum(kiln_mul(y, in[3]), 0, nullptr, false);
  rc = loss ? kiln_tape_gradient(t, loss, 1, &in[0], out) : -1;
  kiln_tape_free(t);
  return rc;
}

}  // namespace

// The training batch norm's backward gives eager's values and never writes
// x - mean, the pre-relu output or the relu-masked gradient (it wrote the
// masked gradient until session 23, x - mean as well before that): each
// kernel that reads them computes them again from x and the incoming
// gradient (fuse.c's cheap chains), so the step writes only one value of
// x's size, dx. (The loss weighs each channel, in[3]: the incoming
// gradient is then one large value, the loss's seed broadcast.)
TEST(SimplifyBroadcast, BatchNormGradientNeverWritesTheCenteredInput) {
  Scoped s;
  kiln_random_seed(6);
  int64_t xs[4] = {2, 5, 5, 8}, cs[1] = {8};
  kiln_tensor *in[4] = {kiln_random_normal(KILN_F64, 4, xs), kiln_random_normal(KILN_F64, 1, cs),
                        kiln_random_normal(KILN_F64, 1, cs), kiln_random_normal(KILN_F64, 1, cs)};
  kiln_function *f = kiln_function_new("bn_grad", bn_body, nullptr, 4, 1);
  kiln_tensor *got = nullptr, *want = nullptr;
  ASSERT_EQ(kiln_function_call(f, in, &got), 0) << kiln_last_error();
  ASSERT_EQ(bn_body(nullptr, 4, in, 1, &want), 0) << kiln_last_error();
  EXPECT_TRUE(allclose(got, want, 1e-12, 1e-12));
  char *text = kiln_function_ir(f, 0, "optimized");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  ir_module *m = ir_parse(text, "bn.kir");
  std::free(text);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  int subs = 0, written = 0;  // x - mean over the whole input in any kernel; values of x's size written
  for (int i = 0; i < m->n_funcs; i++) {
    const ir_func *g = m->funcs[i];
    bool top = !std::strcmp(g->name, "bn_grad");
    for (int j = 0; j < g->n_instrs; j++) {
      const ir_instr *ins = &g->instrs[j];
      if (ins->op == OP_SUB && g->types[ins->out].rank == 4 && g->types[ins->out].shape[3] == 8 &&
          ins->in[0] < g->n_params && g->types[ins->in[1]].rank >= 1)
        subs++;
      for (int r = 0; top && r < ins->n_out; r++)
        if (g->types[ins->out + r].rank == 4 && g->types[ins->out + r].shape[0] == 2 && g->types[ins->out + r].shape[3] == 8)
          written++;
    }
  }
  EXPECT_EQ(written, 1) << "dx alone";
  EXPECT_GE(subs, 2) << "x - mean computed again where it is read";
  ir_module_free(m);
  kiln_function_free(f);
}

namespace {

// a residual block's end, as ResNet's: z0 (a block's output, read by the
// next conv, so written anyway) feeds a conv whose batch-normed output is
// added back to z0 before the relu; the loss weighs each channel
int residual_body(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  kiln_tape *t = kiln_tape_begin(false);
  kiln_tape_watch(t, in[1]);
  kiln_tensor *z0 = kiln_relu(kiln_mul(in[0], in[0]));
  kiln_tensor *y = kiln_conv2d(z0, in[1], nullptr), *mean = nullptr, *var = nullptr;
  int ax[3] = {0, 1, 2};
  int rc = y ? kiln_moments(y, 3, ax, false, &mean, &var) : -1;
  kiln_tensor *pre = rc ? nullptr : kiln_add(kiln_batch_norm(y, mean, var, in[3], in[2], 1e-5), z0);
  kiln_tensor *loss = kiln_reduce_sum(kiln_mul(kiln_relu(pre), in[4]), 0, nullptr, false);
  rc = loss ? kiln_tape_gradient(t, loss, 1, &in[1], out) : -1;
  kiln_tape_free(t);
  return rc;
}

}  // namespace

// At a residual block's end the pre-relu sum bn(y) + z0 is a cheap chain
// over two values written anyway (y, and z0, which a conv reads), so the
// backward's relu mask computes it again instead of reading it back: the
// forward never writes it (it did until session 23, once per block end).
// Nor is the masked gradient written: the loss's seed, broadcast while
// tracing, is a broadcast of one element, not a captured tensor of the
// image's size. What the step writes at the image's size: z0 (the conv's
// input), y (its output) and dx of the batch norm (the filter gradient's).
TEST(SimplifyBroadcast, ResidualBlockEndNeverWritesThePreReluSum) {
  Scoped s;
  kiln_random_seed(7);
  int64_t xs[4] = {4, 8, 8, 16}, ws[4] = {1, 1, 16, 16}, cs[1] = {16};
  kiln_tensor *in[5] = {kiln_random_normal(KILN_F64, 4, xs), kiln_random_normal(KILN_F64, 4, ws),
                        kiln_random_normal(KILN_F64, 1, cs), kiln_random_normal(KILN_F64, 1, cs),
                        kiln_random_normal(KILN_F64, 1, cs)};
  kiln_function *f = kiln_function_new("residual_grad", residual_body, nullptr, 5, 1);
  kiln_tensor *got = nullptr, *want = nullptr;
  ASSERT_EQ(kiln_function_call(f, in, &got), 0) << kiln_last_error();
  ASSERT_EQ(residual_body(nullptr, 5, in, 1, &want), 0) << kiln_last_error();
  EXPECT_TRUE(allclose(got, want, 1e-12, 1e-12));
  char *text = kiln_function_ir(f, 0, "optimized");
  ASSERT_NE(text, nullptr) << kiln_last_error();
  ir_module *m = ir_parse(text, "residual.kir");
  std::free(text);
  ASSERT_NE(m, nullptr) << kiln_last_error();
  int written = 0;  // values of the image's size the top function writes
  for (int i = 0; i < m->n_funcs; i++) {
    const ir_func *g = m->funcs[i];
    if (std::strcmp(g->name, "residual_grad")) continue;
    for (int j = 0; j < g->n_instrs; j++)
      for (int r = 0; r < g->instrs[j].n_out; r++) {
        const op_type *ty = &g->types[g->instrs[j].out + r];
        if (ty->rank == 4 && ty->shape[0] == 4 && ty->shape[3] == 16) written++;
      }
  }
  EXPECT_EQ(written, 3) << "z0, y and the batch norm's dx";
  ir_module_free(m);
  kiln_function_free(f);
}
