// interp_test.cc — the reference interpreter against eager execution: every
// op of ops.def as a one-op function, hand-built multi-op functions, and
// random well-typed programs from a seeded generator, compared bit for bit
// with calling the public ops directly. Generated programs also round-trip
// through the text form.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ir.h"
#include "test_util.h"

namespace {

using ::testing::HasSubstr;

struct Scope {
  Scope() { kiln_scope_push(); }
  ~Scope() { kiln_scope_pop(); }
};

op_type type_of(const kiln_tensor *t) {
  op_type ty{};
  ty.dtype = kiln_tensor_dtype(t);
  ty.rank = kiln_tensor_rank(t);
  for (int i = 0; i < ty.rank; i++) ty.shape[i] = kiln_tensor_shape(t)[i];
  return ty;
}

// Random data of any dtype; ints in [lo, hi], never 0 when nonzero is set.
kiln_tensor *random_tensor(std::mt19937 &rng, kiln_dtype dt, std::vector<int64_t> shape, int lo = -5,
                           int hi = 5, bool nonzero = false) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<unsigned char> buf((size_t)n * kiln_dtype_size(dt) + 8);
  std::uniform_real_distribution<double> real(-3, 3);
  std::uniform_int_distribution<int> integer(lo, hi);
  for (int64_t i = 0; i < n; i++) {
    double r = real(rng);
    int k = integer(rng);
    if (nonzero && k == 0) k = 1;
    switch (dt) {
      case KILN_F32: ((float *)buf.data())[i] = (float)r; break;
      case KILN_F64: ((double *)buf.data())[i] = r; break;
      case KILN_I32: ((int32_t *)buf.data())[i] = k; break;
      case KILN_I64: ((int64_t *)buf.data())[i] = k; break;
      case KILN_BOOL: buf[i] = (unsigned char)(k & 1); break;
      case KILN_F16:
      case KILN_BF16: ((uint16_t *)buf.data())[i] = (uint16_t)(rng() & 0x7bff); break;  // finite
    }
  }
  return kiln_tensor_new(dt, (int)shape.size(), shape.data(), buf.data());
}

bool same_bits(const kiln_tensor *a, const kiln_tensor *b) {
  if (!a || !b) return a == b;
  if (kiln_tensor_dtype(a) != kiln_tensor_dtype(b) || kiln_tensor_rank(a) != kiln_tensor_rank(b)) return false;
  for (int i = 0; i < kiln_tensor_rank(a); i++)
    if (kiln_tensor_shape(a)[i] != kiln_tensor_shape(b)[i]) return false;
  size_t bytes = (size_t)kiln_tensor_size(a) * kiln_dtype_size(kiln_tensor_dtype(a));
  return bytes == 0 || !memcmp(kiln_tensor_data(a), kiln_tensor_data(b), bytes);
}

// The same op through the public API, as a user would call it.
kiln_tensor *eager(op_id op, const op_attrs &a, const std::vector<kiln_tensor *> &in) {
  kiln_tensor *x = in.empty() ? nullptr : in[0], *y = in.size() > 1 ? in[1] : nullptr;
  switch (op) {
    case OP_NEG: return kiln_neg(x);
    case OP_ABS: return kiln_abs(x);
    case OP_SIGN: return kiln_sign(x);
    case OP_EXP: return kiln_exp(x);
    case OP_LOG: return kiln_log(x);
    case OP_LOG1P: return kiln_log1p(x);
    case OP_SQRT: return kiln_sqrt(x);
    case OP_RSQRT: return kiln_rsqrt(x);
    case OP_SIN: return kiln_sin(x);
    case OP_COS: return kiln_cos(x);
    case OP_TANH: return kiln_tanh(x);
    case OP_SIGMOID: return kiln_sigmoid(x);
    case OP_RELU: return kiln_relu(x);
    case OP_FLOOR: return kiln_floor(x);
    case OP_CEIL: return kiln_ceil(x);
    case OP_NOT: return kiln_logical_not(x);
    case OP_ADD: return kiln_add(x, y);
    case OP_SUB: return kiln_sub(x, y);
    case OP_MUL: return kiln_mul(x, y);
    case OP_DIV: return kiln_div(x, y);
    case OP_POW: return kiln_pow(x, y);
    case OP_MAX: return kiln_maximum(x, y);
    case OP_MIN: return kiln_minimum(x, y);
    case OP_MOD: return kiln_mod(x, y);
    case OP_AND: return kiln_logical_and(x, y);
    case OP_OR: return kiln_logical_or(x, y);
    case OP_EQ: return kiln_equal(x, y);
    case OP_NE: return kiln_not_equal(x, y);
    case OP_LT: return kiln_less(x, y);
    case OP_LE: return kiln_less_equal(x, y);
    case OP_GT: return kiln_greater(x, y);
    case OP_GE: return kiln_greater_equal(x, y);
    case OP_SELECT: return kiln_select(x, y, in[2]);
    case OP_CONVERT: return kiln_cast(x, a.dtype);
    case OP_IDENTITY: return kiln_identity(x);
    case OP_STOP_GRADIENT: return kiln_stop_gradient(x);
    case OP_RESHAPE: return kiln_reshape(x, a.rank, a.shape);
    case OP_BROADCAST: return kiln_broadcast_to(x, a.rank, a.shape);
    case OP_TRANSPOSE: return kiln_transpose(x, a.naxes, a.axes);
    case OP_SLICE: return kiln_slice(x, a.begin, a.shape);
    case OP_CONCAT: return kiln_concat((int)in.size(), in.data(), a.axis);
    case OP_REDUCE_SUM: return kiln_reduce_sum(x, a.naxes, a.axes, a.keepdims);
    case OP_REDUCE_PROD: return kiln_reduce_prod(x, a.naxes, a.axes, a.keepdims);
    case OP_REDUCE_MAX: return kiln_reduce_max(x, a.naxes, a.axes, a.keepdims);
    case OP_REDUCE_MIN: return kiln_reduce_min(x, a.naxes, a.axes, a.keepdims);
    case OP_ARGMAX: return kiln_argmax(x, a.axis);
    case OP_DOT: return kiln_matmul(x, y);
    case OP_GATHER: return kiln_gather(x, y, a.axis);
    case OP_SCATTER_ADD: return kiln_scatter_add(x, y, a.axis, a.rank, a.shape);
    case OP_IOTA: return kiln_arange(a.dtype, a.shape[0]);
    case OP_RNG_UNIFORM:
      kiln_random_set_state(a.seed, a.counter);
      return kiln_random_uniform(a.dtype, a.rank, a.shape, a.lo, a.hi);
    case OP_RNG_NORMAL:
      kiln_random_set_state(a.seed, a.counter);
      return kiln_random_normal(a.dtype, a.rank, a.shape);
    case OP_CONSTANT: return kiln_identity(a.value);
    case OP_CONV2D:
    case OP_CONV2D_BP_INPUT:
    case OP_MAX_POOL2D:
    case OP_AVG_POOL2D: {
      kiln_conv_opts o = {};
      for (int k = 0; k < 2; k++) o.stride[k] = a.stride[k], o.dilation[k] = a.dilation[k];
      for (int k = 0; k < 4; k++) o.padding[k] = a.padding[k];
      o.groups = a.groups;
      if (op == OP_CONV2D) return kiln_conv2d(x, y, &o);
      if (op == OP_CONV2D_BP_INPUT) return kiln_conv2d_transpose(x, y, a.shape + 1, &o);
      return op == OP_MAX_POOL2D ? kiln_max_pool2d(x, a.window, &o) : kiln_avg_pool2d(x, a.window, &o);
    }
    case OP_CONV2D_BP_FILTER:
    case OP_MAX_POOL2D_GRAD:
    case OP_AVG_POOL2D_GRAD: {  // gradients only: the tape's gradient of sum(forward * dy)
      kiln_conv_opts o = {};
      for (int k = 0; k < 2; k++) o.stride[k] = a.stride[k], o.dilation[k] = a.dilation[k];
      for (int k = 0; k < 4; k++) o.padding[k] = a.padding[k];
      o.groups = a.groups;
      kiln_dtype dt = kiln_tensor_dtype(x);
      kiln_tensor *src = op == OP_MAX_POOL2D_GRAD ? x : kiln_zeros(dt, a.rank, a.shape), *g = nullptr;
      kiln_tape *tape = kiln_tape_begin(false);
      kiln_tape_watch(tape, src);
      kiln_tensor *fwd = op == OP_CONV2D_BP_FILTER ? kiln_conv2d(x, src, &o)
                         : op == OP_MAX_POOL2D_GRAD ? kiln_max_pool2d(src, a.window, &o)
                                                    : kiln_avg_pool2d(src, a.window, &o);
      int rc = kiln_tape_gradient(tape, kiln_mul(fwd, op == OP_AVG_POOL2D_GRAD ? x : y), 1, &src, &g);
      kiln_tape_free(tape);
      return rc ? nullptr : g;
    }
    default: return nullptr;
  }
}

// One-op function of op over params `in` (constants excepted), interpreted.
kiln_tensor *interpret_one(op_id op, const op_attrs &a, const std::vector<kiln_tensor *> &in, bool round_trip) {
  ir_module *m = ir_module_new();
  std::vector<op_type> types;
  for (kiln_tensor *t : in) types.push_back(type_of(t));
  ir_func *f = ir_func_new(m, "one", (int)in.size(), types.data());
  std::vector<ir_value> params;
  for (size_t i = 0; i < in.size(); i++) params.push_back((ir_value)i);
  ir_value v = ir_append(f, op, &a, (int)in.size(), params.data(), ir_loc{"interp_test.cc", 1});
  EXPECT_GE(v, 0) << ir_op_info(op)->name << ": " << kiln_last_error();
  kiln_tensor *out = nullptr;
  if (v >= 0) {
    EXPECT_EQ(ir_set_results(f, 1, &v), 0);
    if (round_trip) {  // interpret what the text form gives back
      char *text = ir_print_module(m);
      ir_module *m2 = ir_parse(text, "one.kir");
      EXPECT_NE(m2, nullptr) << kiln_last_error() << "\n" << text;
      free(text);
      if (m2) {
        ir_module_free(m);
        m = m2;
        f = m->funcs[0];
      }
    }
    if (ir_interpret(f, in.data(), &out)) out = nullptr;
  }
  ir_module_free(m);
  return out;
}

struct OpCase {
  op_attrs a{};
  std::vector<kiln_tensor *> in;
};

// The cases of one op for key dtype dt; false if the op is not covered.
bool cases_for(op_id op, kiln_dtype dt, std::mt19937 &rng, std::vector<OpCase> &out) {
  OpCase c;
  auto R = [&](kiln_dtype d, std::vector<int64_t> s, int lo = -5, int hi = 5, bool nz = false) {
    return random_tensor(rng, d, s, lo, hi, nz);
  };
  switch (ir_op_info(op)->kind) {
    case OPK_UNARY:
      c.in = {R(dt, {2, 3})};
      out.push_back(c);
      c.in = {R(dt, {0, 3})};
      out.push_back(c);
      return true;
    case OPK_BINARY:
    case OPK_COMPARE: {
      bool nz = (op == OP_DIV || op == OP_MOD) && (dt == KILN_I32 || dt == KILN_I64);
      int lo = op == OP_POW && (dt == KILN_I32 || dt == KILN_I64) ? 0 : -5;
      c.in = {R(dt, {2, 3}), R(dt, {3}, lo, 5, nz)};
      out.push_back(c);
      c.in = {R(dt, {4, 1}), R(dt, {1, 5}, lo, 5, nz)};
      out.push_back(c);
      return true;
    }
    case OPK_SELECT:
      c.in = {R(KILN_BOOL, {2, 3}), R(dt, {2, 3}), R(dt, {3})};
      out.push_back(c);
      return true;
    case OPK_CONVERT:
      for (int to = 0; to < KILN_DTYPE_COUNT; to++) {
        c.a = op_attrs{};
        c.a.dtype = (kiln_dtype)to;
        c.in = {R(dt, {2, 3})};
        out.push_back(c);
      }
      return true;
    case OPK_CONST:
      c.a.value = R(dt, {2, 2});
      out.push_back(c);
      c.a.value = R(dt, {40});  // printed as hex
      out.push_back(c);
      return true;
    default: break;
  }
  switch (op) {
    case OP_CONV2D:
    case OP_CONV2D_BP_INPUT:
    case OP_CONV2D_BP_FILTER: {  // stride, dilation, uneven padding and 2 groups at once
      c.a.stride[0] = 2, c.a.stride[1] = 1, c.a.dilation[0] = 1, c.a.dilation[1] = 2, c.a.groups = 2;
      c.a.padding[0] = 1, c.a.padding[1] = 0, c.a.padding[2] = 2, c.a.padding[3] = 1;
      std::vector<int64_t> xs = {2, 5, 6, 4}, fs = {3, 2, 2, 4}, ys = {2, 2, 7, 4};
      const std::vector<int64_t> &res = op == OP_CONV2D_BP_INPUT ? xs : fs;
      if (op != OP_CONV2D) {
        c.a.rank = 4;
        for (int k = 0; k < 4; k++) c.a.shape[k] = res[k];
      }
      c.in = op == OP_CONV2D ? std::vector<kiln_tensor *>{R(dt, xs), R(dt, fs)}
             : op == OP_CONV2D_BP_INPUT ? std::vector<kiln_tensor *>{R(dt, ys), R(dt, fs)}
                                        : std::vector<kiln_tensor *>{R(dt, xs), R(dt, ys)};
      break;
    }
    case OP_MAX_POOL2D:
    case OP_MAX_POOL2D_GRAD:
    case OP_AVG_POOL2D:
    case OP_AVG_POOL2D_GRAD: {
      c.a.window[0] = 3, c.a.window[1] = 2, c.a.stride[0] = c.a.stride[1] = 2;
      c.a.padding[0] = 1, c.a.padding[1] = 1, c.a.padding[2] = 0, c.a.padding[3] = 1;
      std::vector<int64_t> xs = {2, 5, 6, 3}, ys = {2, 3, 3, 3};
      if (op == OP_AVG_POOL2D_GRAD) {
        c.a.rank = 4;
        for (int k = 0; k < 4; k++) c.a.shape[k] = xs[k];
      }
      c.in = op == OP_MAX_POOL2D || op == OP_AVG_POOL2D ? std::vector<kiln_tensor *>{R(dt, xs)}
             : op == OP_MAX_POOL2D_GRAD                ? std::vector<kiln_tensor *>{R(dt, xs), R(dt, ys)}
                                                       : std::vector<kiln_tensor *>{R(dt, ys)};
      break;
    }
    case OP_IDENTITY:
    case OP_STOP_GRADIENT: c.in = {R(dt, {2, 3})}; break;
    case OP_RESHAPE:
      c.a.rank = 3, c.a.shape[0] = 3, c.a.shape[1] = 1, c.a.shape[2] = 2;
      c.in = {R(dt, {2, 3})};
      break;
    case OP_BROADCAST:
      c.a.rank = 3, c.a.shape[0] = 2, c.a.shape[1] = 4, c.a.shape[2] = 3;
      c.in = {R(dt, {1, 3})};
      break;
    case OP_TRANSPOSE:
      c.a.naxes = 3, c.a.axes[0] = 2, c.a.axes[1] = 0, c.a.axes[2] = 1;
      c.in = {R(dt, {2, 3, 4})};
      break;
    case OP_SLICE:
      c.a.rank = 2, c.a.begin[0] = 1, c.a.begin[1] = 2, c.a.shape[0] = 2, c.a.shape[1] = 3;
      c.in = {R(dt, {4, 5})};
      break;
    case OP_CONCAT:
      c.a.axis = 1;
      c.in = {R(dt, {2, 3}), R(dt, {2, 1}), R(dt, {2, 2})};
      break;
    case OP_REDUCE_SUM:
    case OP_REDUCE_PROD:
    case OP_REDUCE_MAX:
    case OP_REDUCE_MIN:
      c.a.naxes = 2, c.a.axes[0] = 0, c.a.axes[1] = 2;
      c.in = {R(dt, {2, 3, 4})};
      out.push_back(c);
      c.a.keepdims = true;
      c.in = {R(dt, {2, 3, 4})};
      break;
    case OP_ARGMAX:
      c.a.axis = 1;
      c.in = {R(dt, {3, 4})};
      break;
    case OP_DOT: c.in = {R(dt, {2, 3, 4}), R(dt, {4, 5})}; break;
    case OP_GATHER:
      c.a.axis = 0;
      c.in = {R(dt, {5, 3}), R(KILN_I64, {2, 2}, 0, 4)};
      break;
    case OP_SCATTER_ADD:
      c.a.axis = 0, c.a.rank = 2, c.a.shape[0] = 5, c.a.shape[1] = 3;
      c.in = {R(dt, {2, 2, 3}), R(KILN_I32, {2, 2}, 0, 4)};
      break;
    case OP_IOTA: c.a.dtype = dt, c.a.rank = 1, c.a.shape[0] = 7; break;
    case OP_RNG_UNIFORM:
    case OP_RNG_NORMAL:
      c.a.dtype = dt, c.a.rank = 2, c.a.shape[0] = 3, c.a.shape[1] = 5;
      c.a.lo = op == OP_RNG_UNIFORM ? -2 : 0, c.a.hi = op == OP_RNG_UNIFORM ? 3 : 0;
      c.a.seed = 1234, c.a.counter = 17;
      break;
    default: return false;
  }
  out.push_back(c);
  return true;
}

TEST(Interp, EveryOpMatchesEager) {
  int64_t live = kiln_debug_live_tensors();
  std::mt19937 rng(7);
  int compared = 0;
  for (int op = 0; op < OP_COUNT; op++) {
    const op_info *info = ir_op_info((op_id)op);
    if (info->kind == OPK_CALL || info->kind == OPK_COLLECTIVE || info->kind == OPK_HOST || info->kind == OPK_CONTROL) continue; // no eager form (staging_test, control_test, dist/staged_test)
    for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {
      if (!(info->dtypes & (1u << dt))) continue;
      Scope s;
      std::vector<OpCase> cases;
      ASSERT_TRUE(cases_for((op_id)op, (kiln_dtype)dt, rng, cases)) << "op " << info->name << " not covered";
      for (size_t k = 0; k < cases.size(); k++) {
        OpCase &c = cases[k];
        kiln_clear_error();
        kiln_tensor *want = eager((op_id)op, c.a, c.in);
        std::string eager_err = kiln_last_error();
        for (bool rt : {false, true}) {
          kiln_tensor *got = interpret_one((op_id)op, c.a, c.in, rt);
          if (!want) {  // e.g. no kernel for this dtype: the interpreter fails the same way
            EXPECT_EQ(got, nullptr) << info->name << " " << kiln_dtype_name((kiln_dtype)dt);
            EXPECT_THAT(kiln_last_error(), HasSubstr(eager_err));
            continue;
          }
          ASSERT_NE(got, nullptr) << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << ": "
                                  << kiln_last_error();
          EXPECT_TRUE(same_bits(want, got))
              << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << " case " << k << " rt " << rt;
          compared++;
        }
      }
    }
  }
  EXPECT_GT(compared, 150);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// The same cases staged: traced through the public API, through the pass
// pipeline, run by the interpreter; bit-equal to eager.
struct StagedOp {
  op_id op;
  op_attrs a;
};
int staged_op_body(void *user, int n_in, kiln_tensor *const *in, int, kiln_tensor **out) {
  StagedOp *s = (StagedOp *)user;
  out[0] = eager(s->op, s->a, std::vector<kiln_tensor *>(in, in + n_in));
  return out[0] ? 0 : -1;
}

// Through the interpreter (KILN_BACKEND=interp) every op staged equals eager
// bit for bit; compiled, bit for bit too except where the compiled code has
// its own vector math (transcendentals: a few ulp) or sums in another order
// (float reductions).
static bool compiled_may_round_differently(op_id op) {
  switch (op) {
    case OP_EXP: case OP_LOG: case OP_LOG1P: case OP_SIN: case OP_COS: case OP_TANH: case OP_SIGMOID: case OP_POW:
    case OP_REDUCE_SUM: case OP_REDUCE_PROD:
      return true;
    default:
      return false;
  }
}

static void every_op_staged_matches_eager(bool interpreted) {
  kiln_test::EnvGuard backend("KILN_BACKEND", interpreted ? "interp" : "cpu");
  std::mt19937 rng(11);
  int compared = 0;
  for (int op = 0; op < OP_COUNT; op++) {
    const op_info *info = ir_op_info((op_id)op);
    if (info->kind == OPK_CALL || info->kind == OPK_COLLECTIVE || info->kind == OPK_HOST || info->kind == OPK_CONTROL || info->kind == OPK_CONST ||
        info->kind == OPK_RANDOM)
      continue; // no eager form, or draws from the stream (staging_test covers them)
    for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++) {
      if (!(info->dtypes & (1u << dt))) continue;
      Scope s;
      std::vector<OpCase> cases;
      ASSERT_TRUE(cases_for((op_id)op, (kiln_dtype)dt, rng, cases));
      for (size_t k = 0; k < cases.size(); k++) {
        OpCase &c = cases[k];
        kiln_tensor *want = eager((op_id)op, c.a, c.in);
        if (!want) continue; // no kernel for this dtype (Interp.EveryOpMatchesEager checks the error)
        StagedOp so{(op_id)op, c.a};
        kiln_function *f = kiln_function_new(info->name, staged_op_body, &so, (int)c.in.size(), 1);
        kiln_tensor *got = nullptr;
        ASSERT_EQ(kiln_function_call(f, c.in.data(), &got), 0)
            << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << ": " << kiln_last_error();
        if (interpreted || !compiled_may_round_differently((op_id)op))
          EXPECT_TRUE(same_bits(want, got)) << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << " case " << k;
        else
          EXPECT_TRUE(kiln_test::within_ulps(want, got, 8)) << info->name << " " << kiln_dtype_name((kiln_dtype)dt) << " case " << k;
        kiln_stats st;
        ASSERT_EQ(kiln_function_stats(f, 0, &st), 0);
        EXPECT_EQ(st.compile_ms > 0, !interpreted) << info->name;
        compared++;
        kiln_function_free(f);
      }
    }
  }
  EXPECT_GT(compared, 150);
}

TEST(Interp, EveryOpStagedMatchesEager) { every_op_staged_matches_eager(true); }
TEST(Interp, EveryOpCompiledMatchesEager) { every_op_staged_matches_eager(false); }

// DESIGN.md's layer: dot, bias broadcast, add, relu
TEST(Interp, MlpLayer) {
  int64_t live = kiln_debug_live_tensors();
  {
    Scope s;
    std::mt19937 rng(3);
    kiln_tensor *x = random_tensor(rng, KILN_F32, {4, 5}), *w = random_tensor(rng, KILN_F32, {5, 3}),
                *b = random_tensor(rng, KILN_F32, {3});
    const char *text =
        "func @f(%x: f32[4,5], %w: f32[5,3], %b: f32[3]) -> f32[4,3] {\n"
        "  %0 = dot %x, %w : f32[4,3]\n"
        "  %1 = broadcast %b {shape=[4,3]} : f32[4,3]\n"
        "  %2 = add %0, %1 : f32[4,3]  loc(mlp.c:12)\n"
        "  %3 = relu %2 : f32[4,3]\n"
        "  return %3\n"
        "}\n";
    ir_module *m = ir_parse(text, "mlp.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error();
    kiln_tensor *args[3] = {x, w, b}, *res = nullptr;
    ASSERT_EQ(ir_interpret(m->funcs[0], args, &res), 0) << kiln_last_error();
    kiln_tensor *want = kiln_relu(kiln_add(kiln_matmul(x, w), kiln_broadcast_to(b, KILN_SHAPE(4, 3))));
    EXPECT_TRUE(same_bits(want, res));
    ir_module_free(m);
  }
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

TEST(Interp, ResultsOwnedLikeOpResults) {
  int64_t live = kiln_debug_live_tensors();
  ir_module *m = ir_parse("func @f(%x: f32[2]) -> (f32[2], f32[2]) {\n  %0 = neg %x : f32[2]\n  return %0, %x\n}\n",
                          "own.kir");
  ASSERT_NE(m, nullptr) << kiln_last_error();
  kiln_tensor *x = kiln_tensor_new(KILN_F32, KILN_SHAPE(2), nullptr);  // no scope: caller owns
  kiln_tensor *res[2] = {nullptr, nullptr};
  ASSERT_EQ(ir_interpret(m->funcs[0], &x, res), 0) << kiln_last_error();
  EXPECT_EQ(res[1], x);
  kiln_release(res[0]);
  kiln_release(res[1]);
  kiln_release(x);
  ir_module_free(m);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

TEST(Interp, Errors) {
  int64_t live = kiln_debug_live_tensors();
  {
    Scope s;
    ir_module *m = ir_parse(
        "func @f(%x: i32[2], %y: i32[2]) -> i32[2] {\n  %q = div %x, %y : i32[2]\n  return %q\n}\n", "e.kir");
    ASSERT_NE(m, nullptr) << kiln_last_error();
    int32_t xv[2] = {1, 2}, yv[2] = {1, 0};
    kiln_tensor *args[2] = {kiln_tensor_new(KILN_I32, KILN_SHAPE(2), xv), kiln_tensor_new(KILN_I32, KILN_SHAPE(2), yv)};
    kiln_tensor *res = nullptr;
    EXPECT_EQ(ir_interpret(m->funcs[0], args, &res), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("interpret: @f: %q: div"));
    EXPECT_EQ(res, nullptr);
    kiln_tensor *wrong[2] = {kiln_tensor_new(KILN_F32, KILN_SHAPE(2), nullptr), args[1]};
    EXPECT_EQ(ir_interpret(m->funcs[0], wrong, &res), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("interpret: @f: argument 0 is f32[2], the parameter is i32[2]"));
    kiln_tensor *null_arg[2] = {nullptr, args[1]};
    EXPECT_EQ(ir_interpret(m->funcs[0], null_arg, &res), -1);
    EXPECT_THAT(kiln_last_error(), HasSubstr("argument 0 is NULL"));
    ir_module_free(m);
  }
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

// ---- random well-typed programs ----

struct Gen {
  std::mt19937 rng;
  ir_func *f;
  std::vector<ir_value> vals;       // live IR values
  std::vector<kiln_tensor *> eager;  // their eager twins
  int line = 0;

  explicit Gen(uint32_t seed) : rng(seed) {}
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); }

  // applies op to both the IR and eagerly; false if the builder refused
  bool apply(op_id op, const op_attrs &a, const std::vector<int> &idx) {
    std::vector<ir_value> in;
    std::vector<kiln_tensor *> ein;
    for (int i : idx) in.push_back(vals[i]), ein.push_back(eager[i]);
    return push(ir_append(f, op, &a, (int)in.size(), in.data(), ir_loc{"gen.c", ++line}), ::eager(op, a, ein));
  }
  bool push(ir_value v, kiln_tensor *t) {
    EXPECT_GE(v, 0) << kiln_last_error();
    EXPECT_NE(t, nullptr) << kiln_last_error();
    if (v < 0 || !t) return false;
    vals.push_back(v);
    eager.push_back(t);
    return true;
  }
  bool constant(kiln_tensor *t) { return push(ir_constant(f, t, ir_loc{nullptr, 0}), t); }

  bool step() {
    int i = pick((int)vals.size());
    while (kiln_tensor_dtype(eager[i]) == KILN_BOOL) i = pick((int)vals.size());  // compare results
    kiln_tensor *x = eager[i];
    op_type t = type_of(x);
    op_attrs a{};
    static const op_id unary[] = {OP_NEG, OP_ABS, OP_EXP, OP_TANH, OP_SIGMOID, OP_RELU, OP_SIN, OP_FLOOR, OP_SQRT};
    static const op_id binary[] = {OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_MAX, OP_MIN};
    switch (pick(9)) {
      case 0: return apply(unary[pick(9)], a, {i});
      case 1: {  // with a value of the same type, or a broadcasting constant
        for (size_t j = 0; j < vals.size(); j++) {
          op_type u = type_of(eager[j]);
          if (u.dtype == t.dtype && (int)j != i && u.rank == t.rank && !memcmp(u.shape, t.shape, sizeof t.shape[0] * t.rank) &&
              pick(2))
            return apply(binary[pick(6)], a, {i, (int)j});
        }
        std::vector<int64_t> s(t.shape + pick(t.rank + 1), t.shape + t.rank);
        for (auto &d : s)
          if (!pick(3)) d = 1;
        if (!constant(random_tensor(rng, t.dtype, s))) return false;
        int c = (int)vals.size() - 1;
        return pick(2) ? apply(binary[pick(6)], a, {i, c}) : apply(binary[pick(6)], a, {c, i});
      }
      case 2: {  // reduce over a random ascending subset
        static const op_id red[] = {OP_REDUCE_SUM, OP_REDUCE_MAX, OP_REDUCE_MIN};
        for (int k = 0; k < t.rank; k++)
          if (pick(2)) a.axes[a.naxes++] = k;
        a.keepdims = pick(2);
        return apply(red[pick(3)], a, {i});
      }
      case 3: {  // reshape: flatten or split off a 1
        if (pick(2)) {
          a.rank = 1;
          a.shape[0] = kiln_tensor_size(x);
        } else {
          if (t.rank >= KILN_MAX_RANK) return true;
          a.rank = t.rank + 1;
          a.shape[0] = 1;
          for (int k = 0; k < t.rank; k++) a.shape[k + 1] = t.shape[k];
        }
        return apply(OP_RESHAPE, a, {i});
      }
      case 4: {  // transpose by a random permutation
        a.naxes = t.rank;
        for (int k = 0; k < t.rank; k++) a.axes[k] = k;
        std::shuffle(a.axes, a.axes + t.rank, rng);
        return apply(OP_TRANSPOSE, a, {i});
      }
      case 5: {  // dot with a constant [k, n]
        if (t.rank < 2) return true;
        if (!constant(random_tensor(rng, t.dtype, {t.shape[t.rank - 1], 1 + pick(4)}))) return false;
        return apply(OP_DOT, a, {i, (int)vals.size() - 1});
      }
      case 6: {  // select(x > c, x, -x)
        if (!constant(random_tensor(rng, t.dtype, {}))) return false;
        if (!apply(OP_GT, a, {i, (int)vals.size() - 1})) return false;
        int cond = (int)vals.size() - 1;
        if (!apply(OP_NEG, a, {i})) return false;
        return apply(OP_SELECT, a, {cond, i, (int)vals.size() - 1});
      }
      case 7: {  // round trip through the other float dtype
        a.dtype = t.dtype == KILN_F32 ? KILN_F64 : KILN_F32;
        if (!apply(OP_CONVERT, a, {i})) return false;
        a.dtype = t.dtype;
        return apply(OP_CONVERT, a, {(int)vals.size() - 1});
      }
      default: {  // slice off the first element of each axis when it can
        a.rank = t.rank;
        for (int k = 0; k < t.rank; k++) a.begin[k] = t.shape[k] > 1, a.shape[k] = -1;
        return apply(OP_SLICE, a, {i});
      }
    }
  }
};

TEST(Interp, RandomProgramsMatchEagerAndRoundTrip) {
  int64_t live = kiln_debug_live_tensors();
  const int programs = 1000;
  int instrs = 0;
  for (int p = 0; p < programs; p++) {
    Scope s;
    Gen g(1000 + p);
    kiln_dtype dt = g.pick(2) ? KILN_F32 : KILN_F64;
    int np = 1 + g.pick(3);
    std::vector<op_type> types;
    std::vector<kiln_tensor *> args;
    for (int k = 0; k < np; k++) {
      std::vector<int64_t> shape;
      int rank = 1 + g.pick(3);
      for (int d = 0; d < rank; d++) shape.push_back(1 + g.pick(4));
      args.push_back(random_tensor(g.rng, dt, shape));
      types.push_back(type_of(args.back()));
    }
    ir_module *m = ir_module_new();
    g.f = ir_func_new(m, ("p" + std::to_string(p)).c_str(), np, types.data());
    ASSERT_NE(g.f, nullptr) << kiln_last_error();
    for (int k = 0; k < np; k++) g.vals.push_back(k), g.eager.push_back(args[k]);
    int steps = 4 + g.pick(12);
    for (int k = 0; k < steps; k++) ASSERT_TRUE(g.step()) << "program " << p;
    std::vector<ir_value> results(g.vals.begin() + np, g.vals.end());
    ASSERT_EQ(ir_set_results(g.f, (int)results.size(), results.data()), 0);
    ASSERT_EQ(ir_verify_module(m), 0) << kiln_last_error();
    instrs += g.f->n_instrs;

    char *text = ir_print_module(m);
    ir_module *m2 = ir_parse(text, "gen.kir");
    ASSERT_NE(m2, nullptr) << kiln_last_error() << "\n" << text;
    char *text2 = ir_print_module(m2);
    EXPECT_STREQ(text, text2);
    for (ir_module *mm : {m, m2}) {
      std::vector<kiln_tensor *> got(results.size());
      ASSERT_EQ(ir_interpret(mm->funcs[0], args.data(), got.data()), 0) << kiln_last_error() << "\n" << text;
      for (size_t r = 0; r < results.size(); r++)
        ASSERT_TRUE(same_bits(got[r], g.eager[np + r])) << "program " << p << " result " << r << "\n" << text;
    }
    free(text);
    free(text2);
    ir_module_free(m);
    ir_module_free(m2);
  }
  EXPECT_GT(instrs, programs * 4);
  EXPECT_EQ(kiln_debug_live_tensors(), live);
}

}  // namespace
