// foldbn_test.cc — the foldbn pass (passes/foldbn.c) through
// kiln_function_set_optimize_for_inference: an inference batch norm (a
// per-channel affine map with statistics that do not come from the conv)
// after a conv2d or a matmul is folded into the weights and a bias; a
// training batch norm, a conv whose output is also used elsewhere, and a
// function without the flag are left alone (the IR without the flag).
// The folded results are checked against eager ops with a bound from the
// magnitudes involved (the fold reassociates), on hand-written models and
// on random chains.
#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln_test;

namespace {

kiln_tensor *normal(kiln_dtype dt, const V64 &shape) { return kiln_random_normal(dt, (int)shape.size(), shape.data()); }
kiln_tensor *uniform(kiln_dtype dt, const V64 &shape, double lo, double hi) {
  return kiln_random_uniform(dt, (int)shape.size(), shape.data(), lo, hi);
}

// A conv (or dense) layer with an inference batch norm and relu over
// variables, the model of the tests: in[0] the image (or rows).
struct Layer {
  kiln_variable *w, *mean, *var, *offset, *scale;
  kiln_conv_opts opts{};
  bool dense = false;
  bool training = false;  // batch statistics (moments of the conv's output)
  bool also_return_conv = false;
};

kiln_tensor *layer_pre(Layer *l, kiln_tensor *x) {
  return l->dense ? kiln_matmul(x, kiln_variable_read(l->w)) : kiln_conv2d(x, kiln_variable_read(l->w), &l->opts);
}

int layer_body(void *user, int, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  Layer *l = (Layer *)user;
  kiln_tensor *c = layer_pre(l, in[0]);
  kiln_tensor *mean = kiln_variable_read(l->mean), *var = kiln_variable_read(l->var);
  if (l->training) {
    int rank = kiln_tensor_rank(c);
    std::vector<int> axes;
    for (int i = 0; i + 1 < rank; i++) axes.push_back(i);
    if (kiln_moments(c, (int)axes.size(), axes.data(), false, &mean, &var)) return -1;
  }
  out[0] = kiln_relu(
      kiln_batch_norm(c, mean, var, kiln_variable_read(l->offset), kiln_variable_read(l->scale), 1e-3));
  if (n_out > 1) out[1] = c;
  return out[0] ? 0 : -1;
}

// The largest |got - want| over the bound scale * (|conv|(|x|, |w|) * |a| +
// |b|) elementwise, where a and b are the folded factor and shift: the
// error of either form is a few roundings of those magnitudes.
double worst_ratio(kiln_tensor *got, kiln_tensor *want, kiln_tensor *mag) {
  VD g = values(got), w = values(want), m = values(mag);
  double worst = 0;
  for (size_t i = 0; i < g.size(); i++) {
    double d = std::fabs(g[i] - w[i]), r = d == 0 ? 0 : d / (m[i] + 1e-300);
    worst = std::max(worst, r);
  }
  return worst;
}

// |relu(bn(c))| magnitudes: the chain on |c| with every operand's |.|,
// + as magnitudes add (the bound of worst_ratio)
kiln_tensor *magnitude(Layer *l, kiln_tensor *x) {
  kiln_tensor *ax = kiln_abs(x), *aw = kiln_abs(kiln_variable_read(l->w));
  kiln_tensor *c = l->dense ? kiln_matmul(ax, aw) : kiln_conv2d(ax, aw, &l->opts);
  kiln_tensor *inv = kiln_rsqrt(kiln_add(kiln_variable_read(l->var), kiln_scalar_like(c, 1e-3)));
  kiln_tensor *m = kiln_add(c, kiln_abs(kiln_variable_read(l->mean)));
  m = kiln_mul(kiln_mul(m, inv), kiln_abs(kiln_variable_read(l->scale)));
  return kiln_add(m, kiln_abs(kiln_variable_read(l->offset)));
}

void make_layer(Owned &own, Layer *l, kiln_dtype dt, int64_t cin, int64_t cout, int kh) {
  if (l->dense)
    l->w = own.var(normal(dt, {cin, cout}), "w");
  else
    l->w = own.var(normal(dt, {kh, kh, cin / (l->opts.groups ? l->opts.groups : 1), cout}), "w");
  l->mean = own.var(normal(dt, {cout}), "mean");
  l->var = own.var(uniform(dt, {cout}, 0.1, 2), "var");
  l->offset = own.var(normal(dt, {cout}), "offset");
  l->scale = own.var(normal(dt, {cout}), "scale");
}

std::string optimized_ir(kiln_function *f) {
  char *s = kiln_function_ir(f, 0, "optimized");
  std::string r = s ? s : "";
  free(s);
  return r;
}

// The optimized IR's top function (the last one printed)
std::string top_function(const std::string &ir) {
  size_t at = ir.rfind("func @");
  return at == std::string::npos ? ir : ir.substr(at);
}

TEST(FoldBn, ConvBatchNormIsFoldedAndMatchesEager) {
  Scoped scope;
  Owned own;
  kiln_random_seed(7);
  for (kiln_dtype dt : {KILN_F32, KILN_F64}) {
    Layer l;
    l.opts.same = true;
    make_layer(own, &l, dt, 8, 16, 3);
    kiln_tensor *x = normal(dt, {2, 9, 9, 8});
    kiln_function *f = kiln_function_new("bn_infer", layer_body, &l, 1, 1);
    ASSERT_EQ(kiln_function_set_optimize_for_inference(f, true), 0) << kiln_last_error();
    kiln_tensor *got = nullptr, *want = nullptr;
    ASSERT_EQ(kiln_function_call(f, &x, &got), 0) << kiln_last_error();
    ASSERT_EQ(layer_body(&l, 1, &x, 1, &want), 0) << kiln_last_error();
    std::string ir = optimized_ir(f);
    // the filter is the product: the conv reads a computed value, not %1 (w)
    std::string top = top_function(ir);
    EXPECT_EQ(top.find("sub "), std::string::npos) << ir;
    EXPECT_NE(ir.find("conv2d"), std::string::npos) << ir;
    double worst = worst_ratio(got, want, magnitude(&l, x));
    EXPECT_LT(worst, dt == KILN_F32 ? 1e-5 : 1e-13) << ir;
    kiln_function_free(f);
  }
}

TEST(FoldBn, WithoutTheFlagNothingIsFolded) {
  Scoped scope;
  Owned own;
  kiln_random_seed(8);
  Layer l;
  make_layer(own, &l, KILN_F32, 4, 8, 3);
  kiln_tensor *x = normal(KILN_F32, {2, 7, 7, 4});
  kiln_function *f = kiln_function_new("bn_plain", layer_body, &l, 1, 1);
  kiln_tensor *got = nullptr, *want = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &got), 0) << kiln_last_error();
  ASSERT_EQ(layer_body(&l, 1, &x, 1, &want), 0) << kiln_last_error();
  EXPECT_TRUE(within_ulps(got, want, 64));
  EXPECT_NE(optimized_ir(f).find("sub "), std::string::npos) << optimized_ir(f);
  // set after the first call: refused, naming the function
  EXPECT_EQ(kiln_function_set_optimize_for_inference(f, true), -1);
  EXPECT_EQ(std::string(kiln_last_error()).rfind("function_set_optimize_for_inference: @bn_plain", 0), 0u)
      << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_function_set_optimize_for_inference(nullptr, true), -1);
  EXPECT_EQ(std::string(kiln_last_error()).rfind("function_set_optimize_for_inference:", 0), 0u);
  kiln_clear_error();
  kiln_function_free(f);
}

// Statistics computed from the conv's own output (training) and a conv
// whose output is also returned are not folded: the optimized IR is the one
// without the flag.
TEST(FoldBn, TrainingBatchNormAndSharedConvAreNotFolded) {
  Scoped scope;
  Owned own;
  kiln_random_seed(9);
  for (int variant = 0; variant < 2; variant++) {
    Layer l;
    l.training = variant == 0;
    l.also_return_conv = variant == 1;
    make_layer(own, &l, KILN_F32, 4, 8, 3);
    kiln_tensor *x = normal(KILN_F32, {2, 7, 7, 4});
    int n_out = variant == 1 ? 2 : 1;
    kiln_function *f = kiln_function_new("bn_keep", layer_body, &l, 1, n_out);
    kiln_function *plain = kiln_function_new("bn_keep", layer_body, &l, 1, n_out);
    ASSERT_EQ(kiln_function_set_optimize_for_inference(f, true), 0);
    kiln_tensor *got[2] = {nullptr, nullptr}, *base[2] = {nullptr, nullptr};
    ASSERT_EQ(kiln_function_call(f, &x, got), 0) << kiln_last_error();
    ASSERT_EQ(kiln_function_call(plain, &x, base), 0) << kiln_last_error();
    EXPECT_EQ(optimized_ir(f), optimized_ir(plain)) << "variant " << variant;
    for (int k = 0; k < n_out; k++) EXPECT_TRUE(same_bits(got[k], base[k])) << "variant " << variant << " output " << k;
    kiln_function_free(plain);
    kiln_function_free(f);
  }
}

TEST(FoldBn, DenseBatchNormIsFolded) {
  Scoped scope;
  Owned own;
  kiln_random_seed(10);
  Layer l;
  l.dense = true;
  make_layer(own, &l, KILN_F64, 24, 12, 0);
  kiln_tensor *x = normal(KILN_F64, {32, 24});
  kiln_function *f = kiln_function_new("bn_dense", layer_body, &l, 1, 1);
  ASSERT_EQ(kiln_function_set_optimize_for_inference(f, true), 0);
  kiln_tensor *got = nullptr, *want = nullptr;
  ASSERT_EQ(kiln_function_call(f, &x, &got), 0) << kiln_last_error();
  ASSERT_EQ(layer_body(&l, 1, &x, 1, &want), 0) << kiln_last_error();
  EXPECT_EQ(top_function(optimized_ir(f)).find("sub "), std::string::npos) << optimized_ir(f);
  EXPECT_LT(worst_ratio(got, want, magnitude(&l, x)), 1e-13);
  kiln_function_free(f);
}

// Random chains of add / sub / mul with per-channel operands of random
// shapes ([C], [1,1,1,C], scalars, [1,1,1,1]) after convs of random
// geometry (stride, dilation, padding, groups) or matmuls, folded, against
// eager ops within the magnitude bound.
struct Chain {
  kiln_tensor *w;
  kiln_conv_opts opts{};
  bool dense;
  std::vector<int> ops;  // 0 add, 1 sub, 2 mul
  std::vector<kiln_tensor *> operands;
  std::vector<bool> left;  // the operand on the left (add, mul)
};

kiln_tensor *apply_chain(const Chain &c, kiln_tensor *x, bool magnitudes) {
  kiln_tensor *w = magnitudes ? kiln_abs(c.w) : c.w;
  if (magnitudes) x = kiln_abs(x);
  kiln_tensor *v = c.dense ? kiln_matmul(x, w) : kiln_conv2d(x, w, &c.opts);
  for (size_t i = 0; i < c.ops.size(); i++) {
    kiln_tensor *p = magnitudes ? kiln_abs(c.operands[i]) : c.operands[i];
    int op = magnitudes && c.ops[i] == 1 ? 0 : c.ops[i];
    if (op == 0) v = c.left[i] ? kiln_add(p, v) : kiln_add(v, p);
    else if (op == 1) v = kiln_sub(v, p);
    else v = c.left[i] ? kiln_mul(p, v) : kiln_mul(v, p);
  }
  return v;
}

int chain_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = apply_chain(*(Chain *)user, in[0], false);
  return out[0] ? 0 : -1;
}

TEST(FoldBn, RandomChainsMatchEagerWithinTheBound) {
  Scoped scope;
  uint64_t rng = 12345;
  auto next = [&rng](int n) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (int)((rng >> 33) % (uint64_t)n);
  };
  int folded = 0;
  for (int t = 0; t < 40; t++) {
    kiln_scope_push();
    kiln_random_seed(100 + t);
    kiln_dtype dt = next(2) ? KILN_F32 : KILN_F64;
    Chain c;
    c.dense = next(4) == 0;
    int64_t cin = 1 + next(6), cout = 1 + next(9), groups = 1;
    kiln_tensor *x;
    if (c.dense) {
      x = normal(dt, {8 + next(20), cin});
      c.w = normal(dt, {cin, cout});
    } else {
      if (next(3) == 0) groups = cin, cout = cin * (1 + next(2));
      c.opts.groups = (int)groups;
      c.opts.stride[0] = 1 + next(2), c.opts.stride[1] = 1 + next(2);
      c.opts.dilation[0] = 1 + next(2);
      c.opts.same = next(2);
      int kh = 1 + next(3);
      x = normal(dt, {1 + next(2), 6 + next(5), 6 + next(5), cin});
      c.w = normal(dt, {kh, kh, cin / groups, cout});
    }
    int n = 1 + next(5);
    for (int i = 0; i < n; i++) {
      int op = next(3);
      V64 shape = next(4) == 0 ? V64{} : next(2) ? V64{cout} : c.dense ? V64{1, cout} : V64{1, 1, 1, cout};
      c.ops.push_back(op);
      c.operands.push_back(op == 2 ? uniform(dt, shape, -2, 2) : normal(dt, shape));
      c.left.push_back(next(2) == 0);
    }
    kiln_function *f = kiln_function_new("chain", chain_body, &c, 1, 1);
    ASSERT_EQ(kiln_function_set_optimize_for_inference(f, true), 0);
    kiln_tensor *got = nullptr;
    ASSERT_EQ(kiln_function_call(f, &x, &got), 0) << kiln_last_error() << " case " << t;
    kiln_tensor *want = apply_chain(c, x, false), *mag = apply_chain(c, x, true);
    ASSERT_NE(want, nullptr) << kiln_last_error();
    double worst = worst_ratio(got, want, mag);
    EXPECT_LT(worst, dt == KILN_F32 ? 1e-5 : 1e-13) << "case " << t << "\n" << optimized_ir(f);
    // the same without the flag: another IR when folded
    kiln_function *plain = kiln_function_new("chain", chain_body, &c, 1, 1);
    kiln_tensor *base = nullptr;
    ASSERT_EQ(kiln_function_call(plain, &x, &base), 0) << kiln_last_error();
    bool has_mul = false;
    for (int op : c.ops) has_mul |= op == 2;
    bool changed = optimized_ir(f) != optimized_ir(plain);
    EXPECT_TRUE(!changed || has_mul) << "folded a chain without a mul: case " << t;
    folded += changed;
    kiln_function_free(plain);
    kiln_function_free(f);
    kiln_scope_pop();
  }
  EXPECT_GT(folded, 10) << "the pass should fold most chains with a mul";
}

}  // namespace
