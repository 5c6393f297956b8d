// torch_diff_test.cc — a differential test against an independent
// implementation, PyTorch 1.13 (Debian's python3-torch). Random cases cover
// every op of the public API over random shapes (rank 0-4, size-0 and size-1
// dims), dtypes and edge values (±0, ±inf, NaN, denormals, huge and tiny).
// Each case runs in Kiln three ways: eagerly, its gradient on a tape (of
// sum(y * cotangent) for a random cotangent) and staged (a kiln_function
// running the op, and kiln_gradients of the staged loss). All cases go to
// tests/torch_ref.py in one file, which runs them once in PyTorch; the
// test then compares Kiln with PyTorch and staged with eager, and reports
// every mismatch with its op, attributes and inputs.
//
// Kiln's deliberate differences from PyTorch are mapped in torch_ref.py and
// listed in include/kiln.h. Mismatches that are Kiln bugs not fixed yet are
// in known_bugs() below, each with its reason; everything else fails.
//
// KILN_TORCH_CASES sets the number of cases (default 300), KILN_TORCH_SEED
// the seed (default 14), KILN_TORCH_OPS=op,op,... limits the ops (to replay
// a failure), KILN_TORCH_VERBOSE=1 prints known-bug hits too, KILN_TORCH_REF
// names another torch_ref.py.
// Without /usr/bin/python3 importing torch the test skips, naming
// python3-torch.
#include <gtest/gtest.h>
#include <kiln.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln_test;

namespace {

// ---- host tensors ----

struct HostT {
  kiln_dtype dt = KILN_F32;
  V64 shape;
  std::vector<uint8_t> bytes;
};

int64_t numel(const V64 &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64; }

HostT host_of(const kiln_tensor *t) {
  HostT h;
  h.dt = kiln_tensor_dtype(t);
  h.shape = shape_of(t);
  h.bytes.resize((size_t)kiln_tensor_size(t) * kiln_dtype_size(h.dt));
  if (kiln_tensor_read(t, h.bytes.data(), h.bytes.size()) != 0) ADD_FAILURE() << kiln_last_error();
  return h;
}

kiln_tensor *to_kiln(const HostT &h) {
  return kiln_tensor_new(h.dt, (int)h.shape.size(), h.shape.data(), h.bytes.empty() ? nullptr : h.bytes.data());
}

double half_to_double(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(m + 1024, e - 25);
  return (h & 0x8000) ? -v : v;
}

double bf16_to_double(uint16_t h) {
  uint32_t b = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Element i of h as a double (bool 0/1; i64 may round, only for printing).
double elem(const HostT &h, size_t i) {
  const uint8_t *p = h.bytes.data();
  switch (h.dt) {
    case KILN_F32: return ((const float *)p)[i];
    case KILN_F64: return ((const double *)p)[i];
    case KILN_I32: return ((const int32_t *)p)[i];
    case KILN_I64: return (double)((const int64_t *)p)[i];
    case KILN_BOOL: return p[i];
    case KILN_F16: return half_to_double(((const uint16_t *)p)[i]);
    case KILN_BF16: return bf16_to_double(((const uint16_t *)p)[i]);
  }
  return 0;
}

std::string shape_str(const V64 &s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); i++) r += (i ? "," : "") + std::to_string(s[i]);
  return r + ")";
}

std::string num_str(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::string tensor_str(const HostT &h, size_t limit = 24) {
  std::string r = std::string(kiln_dtype_name(h.dt)) + shape_str(h.shape) + " [";
  size_t n = (size_t)numel(h.shape);
  for (size_t i = 0; i < n && i < limit; i++) {
    r += (i ? " " : "");
    if (h.dt == KILN_I64)
      r += std::to_string(((const int64_t *)h.bytes.data())[i]);
    else
      r += num_str(elem(h, i));
  }
  return r + (n > limit ? " ...]" : "]");
}

// ---- a case ----

struct Case {
  std::string op;
  std::vector<int64_t> ints;  // attributes (torch_ref.py reads the same list)
  std::vector<double> fls;
  std::vector<HostT> in;
  std::vector<HostT> ct;  // one cotangent per output when the gradient is checked
  int n_out = 1;
  bool accum = false;  // the result sums many terms (reduction, matmul, softmax, ...)
};

std::string describe(const Case &c) {
  std::ostringstream s;
  s << c.op << " ints=[";
  for (size_t i = 0; i < c.ints.size(); i++) s << (i ? "," : "") << c.ints[i];
  s << "]";
  if (!c.fls.empty()) s << " floats=[" << num_str(c.fls[0]) << "]";
  for (size_t i = 0; i < c.in.size(); i++) s << "\n    in" << i << " = " << tensor_str(c.in[i]);
  for (size_t i = 0; i < c.ct.size(); i++) s << "\n    ct" << i << " = " << tensor_str(c.ct[i]);
  return s.str();
}

using Unary = kiln_tensor *(*)(kiln_tensor *);
using Binary = kiln_tensor *(*)(kiln_tensor *, kiln_tensor *);
using Reduce = kiln_tensor *(*)(kiln_tensor *, int, const int *, bool);

const std::map<std::string, Unary> &unary_ops() {
  static const std::map<std::string, Unary> m = {
      {"neg", kiln_neg},       {"abs", kiln_abs},       {"sign", kiln_sign},     {"exp", kiln_exp},
      {"log", kiln_log},       {"log1p", kiln_log1p},   {"sqrt", kiln_sqrt},     {"rsqrt", kiln_rsqrt},
      {"square", kiln_square}, {"sin", kiln_sin},       {"cos", kiln_cos},       {"tanh", kiln_tanh},
      {"sigmoid", kiln_sigmoid}, {"relu", kiln_relu},   {"floor", kiln_floor},   {"ceil", kiln_ceil},
      {"identity", kiln_identity}, {"stop_gradient", kiln_stop_gradient}, {"logical_not", kiln_logical_not}};
  return m;
}

const std::map<std::string, Binary> &binary_ops() {
  static const std::map<std::string, Binary> m = {
      {"add", kiln_add},          {"sub", kiln_sub},
      {"mul", kiln_mul},          {"div", kiln_div},
      {"pow", kiln_pow},          {"mod", kiln_mod},
      {"maximum", kiln_maximum},  {"minimum", kiln_minimum},
      {"equal", kiln_equal},      {"not_equal", kiln_not_equal},
      {"less", kiln_less},        {"less_equal", kiln_less_equal},
      {"greater", kiln_greater},  {"greater_equal", kiln_greater_equal},
      {"logical_and", kiln_logical_and}, {"logical_or", kiln_logical_or},
      {"matmul", kiln_matmul},    {"softmax_cross_entropy", kiln_softmax_cross_entropy},
      {"sparse_softmax_cross_entropy", kiln_sparse_softmax_cross_entropy}};
  return m;
}

const std::map<std::string, Reduce> &reduce_ops() {
  static const std::map<std::string, Reduce> m = {{"reduce_sum", kiln_reduce_sum},
                                                  {"reduce_mean", kiln_reduce_mean},
                                                  {"reduce_max", kiln_reduce_max},
                                                  {"reduce_min", kiln_reduce_min},
                                                  {"reduce_prod", kiln_reduce_prod}};
  return m;
}

// Runs the case's op on x (c.in.size() tensors), writing c.n_out results.
int apply(const Case &c, kiln_tensor *const *x, kiln_tensor **y) {
  const std::vector<int64_t> &a = c.ints;
  int nx = (int)c.in.size();
  if (auto u = unary_ops().find(c.op); u != unary_ops().end()) {
    y[0] = u->second(x[0]);
  } else if (auto b = binary_ops().find(c.op); b != binary_ops().end()) {
    y[0] = b->second(x[0], x[1]);
  } else if (auto r = reduce_ops().find(c.op); r != reduce_ops().end()) {
    std::vector<int> axes(a.begin() + 2, a.end());
    axes.push_back(0);  // never an empty vector's NULL data()
    y[0] = r->second(x[0], (int)a.size() - 2, a[1] ? axes.data() : nullptr, a[0] != 0);
  } else if (c.op == "select") {
    y[0] = kiln_select(x[0], x[1], x[2]);
  } else if (c.op == "cast") {
    y[0] = kiln_cast(x[0], (kiln_dtype)a[0]);
  } else if (c.op == "argmax") {
    y[0] = kiln_argmax(x[0], (int)a[0]);
  } else if (c.op == "reshape") {
    y[0] = kiln_reshape(x[0], (int)a.size(), a.data());
  } else if (c.op == "transpose") {
    std::vector<int> perm(a.begin() + 1, a.end());
    y[0] = kiln_transpose(x[0], (int)perm.size(), a[0] ? perm.data() : nullptr);
  } else if (c.op == "broadcast_to") {
    y[0] = kiln_broadcast_to(x[0], (int)a.size(), a.data());
  } else if (c.op == "expand_dims") {
    y[0] = kiln_expand_dims(x[0], (int)a[0]);
  } else if (c.op == "squeeze") {
    y[0] = kiln_squeeze(x[0], (int)a[0]);
  } else if (c.op == "slice") {
    size_t r = a.size() / 2;
    y[0] = kiln_slice(x[0], a.data(), a.data() + r);
  } else if (c.op == "index") {
    y[0] = kiln_index(x[0], a[0]);
  } else if (c.op == "concat") {
    y[0] = kiln_concat(nx, x, (int)a[0]);
  } else if (c.op == "stack") {
    y[0] = kiln_stack(nx, x, (int)a[0]);
  } else if (c.op == "split") {
    return kiln_split(x[0], (int)a[0], (int)a[1], y);
  } else if (c.op == "gather") {
    y[0] = kiln_gather(x[0], x[1], (int)a[0]);
  } else if (c.op == "scatter_add") {
    y[0] = kiln_scatter_add(x[0], x[1], (int)a[0], (int)a.size() - 1, a.data() + 1);
  } else if (c.op == "one_hot") {
    y[0] = kiln_one_hot(x[0], a[0], (kiln_dtype)a[1]);
  } else if (c.op == "softmax") {
    y[0] = kiln_softmax(x[0], (int)a[0]);
  } else if (c.op == "log_softmax") {
    y[0] = kiln_log_softmax(x[0], (int)a[0]);
  } else if (c.op == "clip_by_norm") {
    y[0] = kiln_clip_by_norm(x[0], c.fls[0]);
  } else if (c.op == "conv2d") {  // ints: stride 2, dilation 2, padding 4 (top, bottom, left, right), groups
    kiln_conv_opts o = {};
    o.stride[0] = (int)a[0], o.stride[1] = (int)a[1], o.dilation[0] = (int)a[2], o.dilation[1] = (int)a[3];
    for (int k = 0; k < 4; k++) o.padding[k] = (int)a[4 + k];
    o.groups = (int)a[8];
    y[0] = kiln_conv2d(x[0], x[1], &o);
  } else if (c.op == "max_pool2d" || c.op == "avg_pool2d") {  // ints: window 2, stride 2, padding 4
    kiln_conv_opts o = {};
    o.stride[0] = (int)a[2], o.stride[1] = (int)a[3];
    for (int k = 0; k < 4; k++) o.padding[k] = (int)a[4 + k];
    int win[2] = {(int)a[0], (int)a[1]};
    y[0] = c.op == "max_pool2d" ? kiln_max_pool2d(x[0], win, &o) : kiln_avg_pool2d(x[0], win, &o);
  } else if (c.op == "batch_norm") {  // x, mean, variance, offset, scale; floats: epsilon
    y[0] = kiln_batch_norm(x[0], x[1], x[2], x[3], x[4], c.fls[0]);
  } else {
    return kiln_fail("torch_diff_test: unknown op %s", c.op.c_str());
  }
  return y[0] ? 0 : -1;
}

int forward_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  return apply(*(const Case *)user, in, out);
}

// The staged loss sum_k reduce_sum(y_k * ct_k): inputs are the case's float
// inputs then the cotangents; integer inputs are captured constants.
struct LossCtx {
  const Case *c;
  std::vector<kiln_tensor *> fixed;  // concrete inputs, NULL where the loss takes it as input
};

kiln_tensor *loss_of(const Case &c, kiln_tensor *const *x, kiln_tensor *const *ct) {
  std::vector<kiln_tensor *> y(c.n_out, nullptr);
  if (apply(c, x, y.data()) != 0) return nullptr;
  kiln_tensor *total = nullptr;
  for (int k = 0; k < c.n_out; k++) {
    kiln_tensor *t = kiln_reduce_sum(kiln_mul(y[k], ct[k]), 0, nullptr, false);
    total = total ? kiln_add(total, t) : t;
  }
  return total;
}

int loss_body(void *user, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  const LossCtx &l = *(const LossCtx *)user;
  std::vector<kiln_tensor *> x(l.fixed);
  int k = 0;
  for (auto &t : x)
    if (!t) t = in[k++];
  out[0] = loss_of(*l.c, x.data(), in + k);
  return out[0] ? 0 : -1;
}

// What Kiln computed for a case.
struct Result {
  std::string error;  // empty when it ran
  std::vector<HostT> y;
  std::vector<HostT> grad;  // per input; empty HostT shape {} with no bytes for non-float inputs
};

// ---- generating cases ----

struct Gen {
  std::mt19937_64 rng;
  bool edges = false, ties = false;
  explicit Gen(uint64_t seed) : rng(seed) {}
  double uni() { return std::uniform_real_distribution<double>(0, 1)(rng); }
  int64_t irange(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
  bool chance(double p) { return uni() < p; }
  template <typename T>
  T pick(const std::vector<T> &v) { return v[(size_t)irange(0, (int64_t)v.size() - 1)]; }

  int64_t dim() {
    double u = uni();
    return u < 0.07 ? 0 : u < 0.32 ? 1 : irange(2, 4);
  }
  V64 shape(int rank) {
    V64 s(rank);
    for (auto &d : s) d = dim();
    return s;
  }
  V64 nonempty(int rank) {
    V64 s(rank);
    for (auto &d : s) d = irange(1, 4);
    return s;
  }

  double float_value(kiln_dtype dt) {
    if (edges && chance(0.2)) {
      bool f = dt == KILN_F32;
      std::vector<double> e = {0.0,  -0.0, INFINITY, -INFINITY, NAN, f ? 1e-45 : 5e-324, f ? -1e-40 : -1e-310,
                               f ? 1e-39 : 2e-308, f ? 1e30 : 1e300, f ? -1e30 : -1e300, f ? 1e-30 : 1e-300,
                               f ? FLT_MAX : DBL_MAX, 1.0, -1.0, 0.5};
      return pick(e);
    }
    if (ties) return (double)irange(-2, 2);
    return std::normal_distribution<double>(0, 1.5)(rng);
  }
  int64_t int_value(kiln_dtype dt) {
    if (edges && chance(0.15)) {
      bool i32 = dt == KILN_I32;
      return pick<int64_t>({0, 1, -1, i32 ? INT32_MAX : INT64_MAX, i32 ? INT32_MIN : INT64_MIN,
                            i32 ? INT32_MAX - 1 : INT64_MAX - 1});
    }
    return irange(ties ? -2 : -10, ties ? 2 : 10);
  }

  // A tensor of dtype dt; value(i) overrides the element when it returns true.
  HostT tensor(kiln_dtype dt, const V64 &shape,
               const std::function<bool(double *)> &value = nullptr) {
    HostT h;
    h.dt = dt;
    h.shape = shape;
    size_t n = (size_t)numel(shape);
    h.bytes.resize(n * kiln_dtype_size(dt));
    for (size_t i = 0; i < n; i++) {
      double v = 0;
      bool given = value && value(&v);
      switch (dt) {
        case KILN_F32: ((float *)h.bytes.data())[i] = (float)(given ? v : float_value(dt)); break;
        case KILN_F64: ((double *)h.bytes.data())[i] = given ? v : float_value(dt); break;
        case KILN_I32: ((int32_t *)h.bytes.data())[i] = (int32_t)(given ? (int64_t)v : int_value(dt)); break;
        case KILN_I64: ((int64_t *)h.bytes.data())[i] = given ? (int64_t)v : int_value(dt); break;
        case KILN_BOOL: h.bytes[i] = given ? (v != 0) : (uint8_t)irange(0, 1); break;
        case KILN_F16:
        case KILN_BF16: ((uint16_t *)h.bytes.data())[i] = (uint16_t)irange(0, 65535); break;  // every pattern
      }
    }
    return h;
  }
  HostT ints_in(kiln_dtype dt, const V64 &shape, int64_t lo, int64_t hi) {
    return tensor(dt, shape, [&](double *v) {
      *v = (double)irange(lo, hi);
      return true;
    });
  }
  // Shapes that broadcast together to out (dims dropped from the front, dims set to 1).
  V64 broadcastable(const V64 &out) {
    size_t drop = chance(0.3) ? (size_t)irange(0, (int64_t)out.size()) : 0;
    V64 s(out.begin() + drop, out.end());
    for (auto &d : s)
      if (chance(0.25)) d = 1;
    return s;
  }
  int axis(int rank, bool allow_negative = true) {
    int ax = (int)irange(0, rank - 1);
    return allow_negative && chance(0.3) ? ax - rank : ax;
  }
};

const std::vector<kiln_dtype> kFloat = {KILN_F32, KILN_F64};
const std::vector<kiln_dtype> kNum = {KILN_F32, KILN_F64, KILN_I32, KILN_I64};
const std::vector<kiln_dtype> kAll = {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL};

const std::vector<std::string> &all_ops() {
  static const std::vector<std::string> ops = {
      "neg", "abs", "sign", "exp", "log", "log1p", "sqrt", "rsqrt", "square", "sin", "cos", "tanh",
      "sigmoid", "relu", "floor", "ceil", "identity", "stop_gradient", "logical_not",
      "add", "sub", "mul", "div", "pow", "mod", "maximum", "minimum",
      "equal", "not_equal", "less", "less_equal", "greater", "greater_equal", "logical_and", "logical_or",
      "select", "cast", "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod", "argmax",
      "matmul", "reshape", "transpose", "broadcast_to", "expand_dims", "squeeze", "slice", "index",
      "concat", "split", "stack", "gather", "scatter_add", "one_hot", "softmax", "log_softmax",
      "softmax_cross_entropy", "sparse_softmax_cross_entropy", "clip_by_norm",
      "conv2d", "max_pool2d", "avg_pool2d", "batch_norm"};
  return ops;
}

Case make_case(Gen &g, const std::string &op) {
  Case c;
  c.op = op;
  g.edges = g.chance(0.4);
  g.ties = !g.edges && g.chance(0.3);
  int rank = (int)g.irange(0, 4);
  const std::set<std::string> ufloat = {"exp", "log", "log1p", "sqrt", "rsqrt", "sin", "cos", "tanh",
                                        "sigmoid", "floor", "ceil"};
  if (op == "logical_not") {
    c.in.push_back(g.tensor(KILN_BOOL, g.shape(rank)));
  } else if (unary_ops().count(op)) {
    kiln_dtype dt = ufloat.count(op)                                  ? g.pick(kFloat)
                    : (op == "identity" || op == "stop_gradient") ? g.pick(kAll)
                                                                      : g.pick(kNum);
    c.in.push_back(g.tensor(dt, g.shape(rank)));
  } else if (op == "add" || op == "sub" || op == "mul" || op == "div" || op == "pow" || op == "mod" ||
             op == "maximum" || op == "minimum" || op == "equal" || op == "not_equal" || op == "less" ||
             op == "less_equal" || op == "greater" || op == "greater_equal" || op == "logical_and" ||
             op == "logical_or") {
    bool logical = op == "logical_and" || op == "logical_or";
    bool with_bool = op == "maximum" || op == "minimum" || (op.find("equal") != std::string::npos) ||
                     op == "less" || op == "greater";
    kiln_dtype dt = logical ? KILN_BOOL : with_bool ? g.pick(kAll) : g.pick(kNum);
    V64 out = g.shape(rank);
    V64 sa = g.broadcastable(out), sb = g.broadcastable(out);
    if (g.chance(0.5)) std::swap(sa, sb);
    bool intdt = dt == KILN_I32 || dt == KILN_I64;
    c.in.push_back(g.tensor(dt, sa));
    if ((op == "div" || op == "mod") && intdt) {
      c.in.push_back(g.tensor(dt, sb));
      HostT &b = c.in.back();  // integer division by zero is an error: none here
      for (size_t i = 0; i < (size_t)numel(sb); i++) {
        if (dt == KILN_I32 && ((int32_t *)b.bytes.data())[i] == 0) ((int32_t *)b.bytes.data())[i] = 3;
        if (dt == KILN_I64 && ((int64_t *)b.bytes.data())[i] == 0) ((int64_t *)b.bytes.data())[i] = 3;
      }
    } else if (op == "pow" && intdt) {
      c.in.back() = g.ints_in(dt, sa, -4, 4);
      c.in.push_back(g.ints_in(dt, sb, -2, 6));
    } else if (op == "pow" && g.chance(0.5)) {
      c.in.push_back(g.tensor(dt, sb, [&](double *v) {  // integer exponents too: negative bases
        if (g.chance(0.3)) return false;
        *v = (double)g.irange(-2, 3);
        return true;
      }));
    } else {
      c.in.push_back(g.tensor(dt, sb));
    }
  } else if (op == "select") {
    V64 out = g.shape(rank);
    kiln_dtype dt = g.pick(kAll);
    c.in.push_back(g.tensor(KILN_BOOL, g.broadcastable(out)));
    c.in.push_back(g.tensor(dt, g.broadcastable(out)));
    c.in.push_back(g.tensor(dt, g.broadcastable(out)));
  } else if (op == "cast") {
    std::vector<kiln_dtype> every = {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL, KILN_F16, KILN_BF16};
    kiln_dtype from = g.pick(every), to = g.pick(every);
    V64 s = g.shape(rank);
    if (from == KILN_F64 && g.chance(0.5)) {  // values near f16/bf16 halfway points
      c.in.push_back(g.tensor(from, s, [&](double *v) {
        double base = std::ldexp((double)g.irange(1024, 4095), (int)g.irange(-30, 20));
        *v = (g.chance(0.5) ? -1 : 1) * base * (1 + std::ldexp((double)g.irange(-3, 3), -(int)g.irange(8, 52)));
        return !g.edges || g.chance(0.8);
      }));
    } else if (!is_float(from) && from != KILN_F16 && from != KILN_BF16 && from != KILN_BOOL && g.chance(0.5)) {
      c.in.push_back(g.tensor(from, s, [&](double *v) {  // large integers round in float types
        *v = (double)(g.irange(-(1 << 30), 1 << 30));
        return true;
      }));
    } else {
      c.in.push_back(g.tensor(from, s));
    }
    c.ints = {(int64_t)to};
  } else if (reduce_ops().count(op)) {
    kiln_dtype dt = g.pick(kNum);
    V64 s = g.shape(rank);
    bool keep = g.chance(0.5), has = g.chance(0.7);
    c.ints = {keep, has};
    if (has) {
      for (int i = 0; i < rank; i++)
        if (g.chance(0.5)) c.ints.push_back(g.chance(0.3) ? i - rank : i);
    }
    if (op == "reduce_mean" && !is_float(dt)) {  // an integer mean of an empty axis is an error
      for (auto &d : s)
        if (d == 0) d = 2;
    }
    if (op == "reduce_prod" && is_float(dt) && !g.edges) {
      c.in.push_back(g.tensor(dt, s, [&](double *v) {  // zeros: the gradient's special case
        if (!g.chance(0.15)) return false;
        *v = 0;
        return true;
      }));
    } else {
      c.in.push_back(g.tensor(dt, s));
    }
    c.accum = true;
  } else if (op == "argmax") {
    V64 s = g.nonempty(std::max(rank, 1));
    for (auto &d : s)
      if (g.chance(0.1)) d = 0;
    int ax = g.axis((int)s.size());
    s[ax < 0 ? ax + s.size() : ax] = g.irange(1, 4);
    c.in.push_back(g.tensor(g.pick(kNum), s));
    c.ints = {ax};
  } else if (op == "matmul") {
    kiln_dtype dt = g.chance(0.75) ? g.pick(kFloat) : g.pick(kNum);
    V64 batch = g.shape((int)g.irange(0, 2));
    int64_t m = g.dim(), k = g.dim(), n = g.dim();
    V64 sa = g.broadcastable(batch), sb = g.broadcastable(batch);
    sa.push_back(m), sa.push_back(k), sb.push_back(k), sb.push_back(n);
    c.in.push_back(g.tensor(dt, sa));
    c.in.push_back(g.tensor(dt, sb));
    c.accum = true;
  } else if (op == "reshape") {
    V64 s = g.shape(rank);
    int64_t n = numel(s);
    V64 t;
    int trank = (int)g.irange(n == 1 ? 0 : 1, 4);
    int64_t left = n;
    for (int i = 0; i + 1 < trank; i++) {
      std::vector<int64_t> divs;
      for (int64_t d = 1; d <= std::max<int64_t>(left, 1) && d <= 8; d++)
        if (left == 0 || left % d == 0) divs.push_back(d);
      if (left == 0 && g.chance(0.3)) divs = {0};
      int64_t d = g.pick(divs);
      t.push_back(d);
      if (d) left /= d;
    }
    if (trank > 0) {
      int64_t prod = numel(t);
      t.push_back(prod == 0 ? g.irange(0, 3) : n / prod);
      if (numel(t) != n) t.back() = 0;
      if (n > 0 && g.chance(0.5)) t[(size_t)g.irange(0, trank - 1)] = -1;
    }
    c.in.push_back(g.tensor(g.pick(kAll), s));
    c.ints = t;
  } else if (op == "transpose") {
    V64 s = g.shape(rank);
    std::vector<int64_t> perm(rank);
    for (int i = 0; i < rank; i++) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), g.rng);
    bool has = g.chance(0.8);
    c.ints = {has};
    if (has) c.ints.insert(c.ints.end(), perm.begin(), perm.end());
    c.in.push_back(g.tensor(g.pick(kAll), s));
  } else if (op == "broadcast_to") {
    V64 out = g.shape(rank);
    c.in.push_back(g.tensor(g.pick(kAll), g.broadcastable(out)));
    c.ints = out;
    c.accum = true;
  } else if (op == "expand_dims") {
    c.in.push_back(g.tensor(g.pick(kAll), g.shape(rank)));
    c.ints = {g.irange(-rank - 1, rank)};
  } else if (op == "squeeze") {
    V64 s = g.shape(std::max(rank, 1));
    int ax = g.axis((int)s.size());
    s[ax < 0 ? ax + s.size() : ax] = 1;
    c.in.push_back(g.tensor(g.pick(kAll), s));
    c.ints = {ax};
  } else if (op == "slice") {
    V64 s = g.shape(rank);
    std::vector<int64_t> begin, size;
    for (int64_t d : s) {
      int64_t b = g.irange(0, d);
      begin.push_back(b);
      size.push_back(g.chance(0.2) ? -1 : g.irange(0, d - b));
    }
    c.in.push_back(g.tensor(g.pick(kAll), s));
    c.ints = begin;
    c.ints.insert(c.ints.end(), size.begin(), size.end());
  } else if (op == "index") {
    V64 s = g.shape(std::max(rank, 1));
    s[0] = g.irange(1, 4);
    c.in.push_back(g.tensor(g.pick(kAll), s));
    c.ints = {g.irange(-s[0], s[0] - 1)};
  } else if (op == "concat" || op == "stack") {
    V64 s = g.shape(op == "concat" ? std::max(rank, 1) : std::min(rank, 3));
    int n = (int)g.irange(1, 3);
    kiln_dtype dt = g.pick(kAll);
    int ax = op == "concat" ? (int)g.irange(0, (int64_t)s.size() - 1) : (int)g.irange(0, (int64_t)s.size());
    for (int i = 0; i < n; i++) {
      V64 si = s;
      if (op == "concat") si[ax] = g.dim();
      c.in.push_back(g.tensor(dt, si));
    }
    c.ints = {ax};
  } else if (op == "split") {
    V64 s = g.shape(std::max(rank, 1));
    int n = (int)g.irange(1, 3);
    int ax = (int)g.irange(0, (int64_t)s.size() - 1);
    s[ax] = n * g.irange(0, 2);
    c.in.push_back(g.tensor(g.pick(kAll), s));
    c.ints = {n, ax};
    c.n_out = n;
  } else if (op == "gather") {
    V64 s = g.shape((int)g.irange(1, 3));
    int ax = (int)g.irange(0, (int64_t)s.size() - 1);
    V64 is = g.shape((int)g.irange(0, 2));
    if (s[ax] == 0 && numel(is) > 0) s[ax] = 2;
    c.in.push_back(g.tensor(g.pick(kAll), s));
    c.in.push_back(g.ints_in(g.chance(0.5) ? KILN_I32 : KILN_I64, is, 0, std::max<int64_t>(s[ax] - 1, 0)));
    c.ints = {ax};
    c.accum = true;  // the gradient sums duplicates
  } else if (op == "scatter_add") {
    V64 s = g.shape((int)g.irange(1, 3));
    int ax = (int)g.irange(0, (int64_t)s.size() - 1);
    V64 is = g.shape((int)g.irange(0, 2));
    if (s[ax] == 0 && numel(is) > 0) s[ax] = 2;
    V64 us(s.begin(), s.begin() + ax);
    us.insert(us.end(), is.begin(), is.end());
    us.insert(us.end(), s.begin() + ax + 1, s.end());
    c.in.push_back(g.tensor(g.pick(kNum), us));
    c.in.push_back(g.ints_in(g.chance(0.5) ? KILN_I32 : KILN_I64, is, 0, std::max<int64_t>(s[ax] - 1, 0)));
    c.ints = {ax};
    c.ints.insert(c.ints.end(), s.begin(), s.end());
    c.accum = true;
  } else if (op == "one_hot") {
    int64_t depth = g.irange(0, 5);
    c.in.push_back(g.ints_in(g.chance(0.5) ? KILN_I32 : KILN_I64, g.shape(std::min(rank, 3)), -1, depth));
    c.ints = {depth, (int64_t)g.pick(kNum)};
  } else if (op == "softmax" || op == "log_softmax") {
    V64 s = g.shape(std::max(rank, 1));
    c.in.push_back(g.tensor(g.pick(kFloat), s));
    c.ints = {g.axis((int)s.size())};
    c.accum = true;
  } else if (op == "softmax_cross_entropy") {
    V64 s = g.shape(std::max(rank, 1));
    kiln_dtype dt = g.pick(kFloat);
    c.in.push_back(g.tensor(dt, s, [&](double *v) {
      *v = g.uni();
      return true;
    }));
    c.in.push_back(g.tensor(dt, s));
    c.accum = true;
  } else if (op == "sparse_softmax_cross_entropy") {
    V64 s = g.shape(std::max(rank, 1));
    if (s.back() == 0) s.back() = 3;
    V64 ls(s.begin(), s.end() - 1);
    c.in.push_back(g.ints_in(g.chance(0.5) ? KILN_I32 : KILN_I64, ls, 0, s.back() - 1));
    c.in.push_back(g.tensor(g.pick(kFloat), s));
    c.accum = true;
  } else if (op == "clip_by_norm") {
    c.in.push_back(g.tensor(g.pick(kFloat), g.shape(rank)));
    c.fls = {g.pick<double>({0.5, 1, 3, 100})};
    c.accum = true;
  } else if (op == "conv2d" || op == "max_pool2d" || op == "avg_pool2d") {
    // NHWC images, HWIO filters; uneven padding, strides, dilations and groups.
    // Values uniform in [-1, 1): no ties for max pooling, whose gradient at a
    // tie Kiln shares and PyTorch gives to one element.
    auto uniform = [&](double *v) {
      *v = 2 * g.uni() - 1;
      return true;
    };
    kiln_dtype dt = g.pick(kFloat);
    bool conv = op == "conv2d";
    int64_t groups = conv ? g.irange(1, 3) : 1, cg = g.irange(1, 3), og = g.irange(1, 3);
    int64_t n = g.irange(1, 2), h = g.irange(1, 7), w = g.irange(1, 7), kh = g.irange(1, 3), kw = g.irange(1, 3);
    int64_t sh = g.irange(1, 3), sw = g.irange(1, 3), dh = conv ? g.irange(1, 2) : 1, dw = conv ? g.irange(1, 2) : 1;
    int64_t pad[4];
    for (int k = 0; k < 4; k++) pad[k] = g.irange(0, conv ? 2 : (k < 2 ? kh : kw) - 1);  // pooling: smaller than the window
    while ((kh - 1) * dh + 1 > h + pad[0] + pad[1]) h++;  // the window fits the padded image
    while ((kw - 1) * dw + 1 > w + pad[2] + pad[3]) w++;
    c.in.push_back(g.tensor(dt, {n, h, w, cg * groups}, uniform));
    if (conv) {
      c.in.push_back(g.tensor(dt, {kh, kw, cg, og * groups}, uniform));
      c.ints = {sh, sw, dh, dw, pad[0], pad[1], pad[2], pad[3], groups};
    } else {
      c.ints = {kh, kw, sh, sw, pad[0], pad[1], pad[2], pad[3]};
    }
    c.accum = op != "max_pool2d";
  } else if (op == "batch_norm") {
    kiln_dtype dt = g.pick(kFloat);
    V64 s = g.nonempty((int)g.irange(2, 4));
    V64 ch = {s.back()};
    c.in.push_back(g.tensor(dt, s));
    c.in.push_back(g.tensor(dt, ch));
    c.in.push_back(g.tensor(dt, ch, [&](double *v) {  // variances
      *v = 0.25 + 2 * g.uni();
      return true;
    }));
    c.in.push_back(g.tensor(dt, ch));
    c.in.push_back(g.tensor(dt, ch));
    c.fls = {g.pick<double>({0, 1e-5, 1e-3, 0.1})};
    c.accum = true;  // the gradients of the per-channel inputs sum over the batch
  }
  return c;
}

// ---- comparing ----

struct Tol {
  double rtol;  // relative to the element
  double atol;  // absolute
  int64_t ulps;
  bool zero_sign;  // -0 and +0 differ
  // An inf or NaN on either side is accepted: the values of gradients at
  // non-finite inputs, and where partial sums and products of huge values
  // overflow in one summation order and not in another, are unspecified.
  bool nonfinite_ok;
};

int64_t ulp_dist(double a, double b, kiln_dtype dt) {
  if (dt == KILN_F32) {
    float fa = (float)a, fb = (float)b;
    int32_t ia, ib;
    std::memcpy(&ia, &fa, 4);
    std::memcpy(&ib, &fb, 4);
    int64_t x = ia < 0 ? INT32_MIN - (int64_t)ia : ia, y = ib < 0 ? INT32_MIN - (int64_t)ib : ib;
    return x > y ? x - y : y - x;
  }
  int64_t ia, ib;
  std::memcpy(&ia, &a, 8);
  std::memcpy(&ib, &b, 8);
  ia = ia < 0 ? INT64_MIN - ia : ia;
  ib = ib < 0 ? INT64_MIN - ib : ib;
  double d = (double)ia - (double)ib;
  return d > 9e18 || d < -9e18 ? INT64_MAX : (int64_t)std::fabs(d);
}

// "" when got matches want, else why not (the first differing element).
std::string compare(const HostT &got, const HostT &want, const Tol &tol) {
  if (got.dt != want.dt)
    return std::string("dtype ") + kiln_dtype_name(got.dt) + ", want " + kiln_dtype_name(want.dt);
  if (got.shape != want.shape) return "shape " + shape_str(got.shape) + ", want " + shape_str(want.shape);
  size_t n = (size_t)numel(got.shape);
  int bad = 0;
  std::string first;
  for (size_t i = 0; i < n; i++) {
    bool ok;
    if (got.dt == KILN_I64) {
      ok = ((const int64_t *)got.bytes.data())[i] == ((const int64_t *)want.bytes.data())[i];
    } else if (got.dt == KILN_I32 || got.dt == KILN_BOOL) {
      ok = elem(got, i) == elem(want, i);
    } else {
      double x = elem(got, i), y = elem(want, i);
      if (std::isnan(y) || std::isnan(x)) {
        ok = (std::isnan(x) && std::isnan(y)) || tol.nonfinite_ok;
      } else if (tol.nonfinite_ok && (!std::isfinite(x) || !std::isfinite(y))) {
        ok = true;
      } else if (std::isinf(x) || std::isinf(y)) {
        ok = x == y;
      } else if (x == y) {
        ok = !(tol.zero_sign && x == 0 && std::signbit(x) != std::signbit(y));
      } else if (got.dt == KILN_F16 || got.dt == KILN_BF16) {
        ok = false;  // casts round exactly
      } else {
        ok = std::fabs(x - y) <= tol.atol + tol.rtol * std::fabs(y) || ulp_dist(x, y, got.dt) <= tol.ulps;
      }
    }
    if (!ok && bad++ == 0) {
      first = "element " + std::to_string(i) + ": got ";
      first += got.dt == KILN_I64 ? std::to_string(((const int64_t *)got.bytes.data())[i]) : num_str(elem(got, i));
      first += ", want ";
      first += want.dt == KILN_I64 ? std::to_string(((const int64_t *)want.bytes.data())[i]) : num_str(elem(want, i));
    }
  }
  if (!bad) return "";
  return first + " (" + std::to_string(bad) + " of " + std::to_string(n) + " elements differ)\n      got  " +
         tensor_str(got) + "\n      want " + tensor_str(want);
}

// Tolerances for a case: elementwise results to a few ulps; sums of many
// terms to an absolute error that grows with the terms' magnitude and count.
Tol tolerance(const Case &c, kiln_dtype dt, bool grad, double factor) {
  double eps = dt == KILN_F32 ? FLT_EPSILON : DBL_EPSILON;
  Tol t{16 * eps * factor, 0, (int64_t)(4 * factor), !grad && !c.accum, false};
  bool nonfinite = false, huge = false;
  for (const auto &v : c.in) {
    if (!is_float(v.dt)) continue;
    for (size_t i = 0; i < (size_t)numel(v.shape); i++) {
      double e = elem(v, i);
      nonfinite |= !std::isfinite(e);
      huge |= std::isfinite(e) && std::fabs(e) > (v.dt == KILN_F32 ? 1e15 : 1e100);
    }
  }
  t.nonfinite_ok = (grad && (nonfinite || huge)) || (c.accum && huge);
  if (c.accum || grad) {
    double s = 1;
    int64_t n = 1;
    for (const auto &v : c.in) {
      n = std::max(n, numel(v.shape));
      if (!is_float(v.dt)) continue;
      for (size_t i = 0; i < (size_t)numel(v.shape); i++)
        if (std::isfinite(elem(v, i))) s = std::max(s, std::fabs(elem(v, i)));
    }
    for (const auto &v : c.ct) n = std::max(n, numel(v.shape));
    t.atol = 16 * eps * factor * s * s * (double)n;
    t.rtol *= 8;
  }
  return t;
}

// ---- known Kiln bugs: mismatches listed here are reported, not failed ----

struct KnownBug {
  const char *op;     // the case's op
  const char *where;  // "eager", "grad", "staged", "staged grad" (a prefix of the check's name)
  std::function<bool(const Case &)> applies;
  const char *reason;
};

const std::vector<KnownBug> &known_bugs() {
  static const std::vector<KnownBug> bugs = {
  };
  return bugs;
}

const KnownBug *known(const Case &c, const std::string &where) {
  for (const auto &b : known_bugs())
    if (c.op == b.op && where.rfind(b.where, 0) == 0 && b.applies(c)) return &b;
  return nullptr;
}

// ---- the case file and torch_ref.py ----

template <typename T>
void put(std::string &out, T v) {
  out.append((const char *)&v, sizeof v);
}

void put_tensor(std::string &out, const HostT &h) {
  put<uint8_t>(out, (uint8_t)h.dt);
  put<uint8_t>(out, (uint8_t)h.shape.size());
  for (int64_t d : h.shape) put<int64_t>(out, d);
  out.append((const char *)h.bytes.data(), h.bytes.size());
}

struct In {
  const std::string &d;
  size_t p = 0;
  bool bad = false;
  template <typename T>
  T take() {
    T v{};
    if (p + sizeof v > d.size()) {
      bad = true;
      return v;
    }
    std::memcpy(&v, d.data() + p, sizeof v);
    p += sizeof v;
    return v;
  }
  HostT tensor() {
    HostT h;
    h.dt = (kiln_dtype)take<uint8_t>();
    int rank = take<uint8_t>();
    for (int i = 0; i < rank; i++) h.shape.push_back(take<int64_t>());
    size_t nb = (size_t)numel(h.shape) * kiln_dtype_size(h.dt);
    if (bad || h.dt >= KILN_DTYPE_COUNT || p + nb > d.size()) {
      bad = true;
      return h;
    }
    h.bytes.assign(d.begin() + p, d.begin() + p + nb);
    p += nb;
    return h;
  }
};

struct TorchOut {
  bool ok = false;
  std::string error;
  std::vector<HostT> y;
  std::vector<bool> has_grad;
  std::vector<HostT> grad;
};

std::string read_file(const std::string &path) {
  std::string s;
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f) return s;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

// tests/torch_ref.py, found next to this source file (__FILE__ is relative to
// the build directory, where the test binary lives, when ccache rewrites it).
// KILN_TORCH_REF overrides the path.
std::string ref_script() {
  if (const char *env = std::getenv("KILN_TORCH_REF")) return env;
  return source_dir(__FILE__) + "torch_ref.py";
}

bool torch_available() {
  return std::system("/usr/bin/python3 -c 'import torch, numpy' >/dev/null 2>&1") == 0;
}

int64_t env_int(const char *name, int64_t fallback) {
  const char *s = std::getenv(name);
  return s && *s ? std::strtoll(s, nullptr, 10) : fallback;
}

// Runs the case in Kiln: eagerly, its gradient on a tape, staged, and the staged gradient.
void run_kiln(const Case &c, Result &eager, Result &staged) {
  kiln_scope_push();
  std::vector<kiln_tensor *> x, ct;
  for (const auto &h : c.in) x.push_back(to_kiln(h));
  for (const auto &h : c.ct) ct.push_back(to_kiln(h));
  std::vector<int> fidx;
  for (size_t i = 0; i < c.in.size(); i++)
    if (is_float(c.in[i].dt)) fidx.push_back((int)i);
  bool want_grad = !c.ct.empty() && !fidx.empty();

  // eager
  std::vector<kiln_tensor *> y(c.n_out, nullptr);
  kiln_clear_error();
  if (apply(c, x.data(), y.data()) != 0) {
    eager.error = kiln_last_error();
  } else {
    for (auto *t : y) eager.y.push_back(host_of(t));
  }
  // eager gradient
  eager.grad.resize(c.in.size());
  if (want_grad && eager.error.empty()) {
    kiln_tape *tape = kiln_tape_begin(false);
    for (int i : fidx) kiln_tape_watch(tape, x[i]);
    kiln_tensor *loss = loss_of(c, x.data(), ct.data());
    std::vector<kiln_tensor *> src, gr(fidx.size(), nullptr);
    for (int i : fidx) src.push_back(x[i]);
    if (!loss || kiln_tape_gradient(tape, loss, (int)src.size(), src.data(), gr.data()) != 0) {
      eager.error = std::string("gradient: ") + kiln_last_error();
    } else {
      for (size_t k = 0; k < fidx.size(); k++) {
        eager.grad[fidx[k]] = gr[k] ? host_of(gr[k]) : HostT{c.in[fidx[k]].dt, c.in[fidx[k]].shape,
                                                               std::vector<uint8_t>(c.in[fidx[k]].bytes.size())};
      }
    }
    kiln_tape_free(tape);
  }
  // staged forward
  kiln_clear_error();
  kiln_function *f = kiln_function_new("torch_diff", forward_body, (void *)&c, (int)c.in.size(), c.n_out);
  std::vector<kiln_tensor *> sy(c.n_out, nullptr);
  if (kiln_function_call(f, x.data(), sy.data()) != 0) {
    staged.error = kiln_last_error();
  } else {
    for (auto *t : sy) staged.y.push_back(host_of(t));
  }
  kiln_function_free(f);
  // staged gradient: kiln_gradients of the staged loss
  staged.grad.resize(c.in.size());
  if (want_grad && staged.error.empty()) {
    LossCtx l{&c, x};
    std::vector<kiln_tensor *> in;
    for (int i : fidx) l.fixed[i] = nullptr, in.push_back(x[i]);
    in.insert(in.end(), ct.begin(), ct.end());
    kiln_clear_error();
    kiln_function *lf = kiln_function_new("torch_diff_loss", loss_body, &l, (int)in.size(), 1);
    kiln_function *gf = kiln_gradients(lf);
    std::vector<kiln_tensor *> gr(in.size(), nullptr);
    if (!gf || kiln_function_call(gf, in.data(), gr.data()) != 0) {
      staged.error = std::string("gradient: ") + kiln_last_error();
    } else {
      for (size_t k = 0; k < fidx.size(); k++) staged.grad[fidx[k]] = host_of(gr[k]);
    }
    kiln_function_free(gf);
    kiln_function_free(lf);
  }
  kiln_scope_pop();
}

// The comparison itself: it must catch what the differential test is for.
TEST(TorchDiff, ComparisonCatchesWrongValues) {
  auto f32h = [](std::vector<float> v) {
    HostT h;
    h.dt = KILN_F32;
    h.shape = {(int64_t)v.size()};
    h.bytes.resize(v.size() * 4);
    std::memcpy(h.bytes.data(), v.data(), h.bytes.size());
    return h;
  };
  Case c;
  c.op = "neg";
  Tol t = tolerance(c, KILN_F32, false, 1);
  float one_ulp = std::nextafter(1.0f, 2.0f);
  EXPECT_EQ(compare(f32h({1, kNanF, -kInfF, 0}), f32h({1, kNanF, -kInfF, 0}), t), "");
  EXPECT_EQ(compare(f32h({one_ulp}), f32h({1}), t), "") << "a few ulps are rounding";
  EXPECT_NE(compare(f32h({1.001f}), f32h({1}), t), "");
  EXPECT_NE(compare(f32h({kNanF}), f32h({1}), t), "") << "NaN where a number is wanted";
  EXPECT_NE(compare(f32h({1}), f32h({kNanF}), t), "");
  EXPECT_NE(compare(f32h({kInfF}), f32h({-kInfF}), t), "") << "the sign of inf";
  EXPECT_NE(compare(f32h({-0.0f}), f32h({0.0f}), t), "") << "-0 for an elementwise op";
  EXPECT_NE(compare(f32h({1e-40f}), f32h({0}), t), "") << "a flushed denormal";
  EXPECT_NE(compare(f32h({1, 2}), f32h({1}), t), "") << "shapes";
  HostT i = f32h({1});
  i.dt = KILN_I32;
  EXPECT_NE(compare(i, f32h({1}), t), "") << "dtypes";
  c.op = "reduce_sum";  // sums: absolute error from the terms' size, still not 0.1 off 1
  c.accum = true;
  c.in = {f32h({1, 1e-3f, -1e-3f})};
  EXPECT_EQ(compare(f32h({1.0000001f}), f32h({1}), tolerance(c, KILN_F32, false, 1)), "");
  EXPECT_NE(compare(f32h({1.1f}), f32h({1}), tolerance(c, KILN_F32, false, 1)), "");
}

// Found by the differential test: d/da a^b at b = 0 is 0, also at a = 0
// (b a^(b-1) there is 0 * inf = NaN); on a tape and through kiln_gradients.
int pow_sum(void *, int, kiln_tensor *const *in, int, kiln_tensor **out) {
  out[0] = kiln_reduce_sum(kiln_pow(in[0], in[1]), 0, nullptr, false);
  return out[0] ? 0 : -1;
}

TEST(TorchDiff, PowGradientAtZeroExponentIsZero) {
  Scoped s;
  kiln_tensor *a = f64({0, 0, 2, -3}), *b = f64({0, 1, 0, 2});
  kiln_tape *tape = kiln_tape_begin(false);
  kiln_tape_watch(tape, a);
  kiln_tensor *y = kiln_reduce_sum(kiln_pow(a, b), 0, nullptr, false), *g = nullptr;
  ASSERT_EQ(kiln_tape_gradient(tape, y, 1, &a, &g), 0) << kiln_last_error();
  kiln_tape_free(tape);
  EXPECT_EQ(values(g), (VD{0, 1, 0, -6}));
  kiln_function *f = kiln_function_new("pow_sum", pow_sum, nullptr, 2, 1);
  kiln_function *df = kiln_gradients(f);
  ASSERT_NE(df, nullptr) << kiln_last_error();
  kiln_tensor *in[2] = {a, b}, *out[2] = {nullptr, nullptr};
  ASSERT_EQ(kiln_function_call(df, in, out), 0) << kiln_last_error();
  EXPECT_EQ(values(out[0]), (VD{0, 1, 0, -6}));
  kiln_function_free(df);
  kiln_function_free(f);
}

// Mixing dtypes is an error, not a promotion as in NumPy and PyTorch.
TEST(TorchDiff, MixedDtypesAreAnErrorNotAPromotion) {
  Scoped s;
  EXPECT_EQ(kiln_add(f32({1}), f64({1})), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("add"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_matmul(f32({1, 1}, {1}), i32({1, 1}, {1})), nullptr);
  EXPECT_NE(std::string(kiln_last_error()).find("matmul"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
  EXPECT_EQ(kiln_div(i32({1}, {7}), i32({1}, {0})), nullptr) << "integer division by zero";
  EXPECT_NE(std::string(kiln_last_error()).find("div"), std::string::npos) << kiln_last_error();
  kiln_clear_error();
}

TEST(TorchDiff, EveryOpValueGradientAndStagedAgreeWithPyTorch) {
  if (!torch_available())
    GTEST_SKIP() << "/usr/bin/python3 cannot import torch and numpy: install python3-torch and python3-numpy "
                    "(scripts/setup.sh lists them) to run the differential test against PyTorch";
  Scoped scope;
  int64_t ncases = env_int("KILN_TORCH_CASES", 300);
  uint64_t seed = (uint64_t)env_int("KILN_TORCH_SEED", 14);
  bool verbose = env_int("KILN_TORCH_VERBOSE", 0) != 0;
  Gen g(seed);

  // generate: every op at least once, then ops at random
  std::vector<Case> cases;
  std::vector<std::string> ops;
  const char *only = std::getenv("KILN_TORCH_OPS");
  for (const auto &op : all_ops())
    if (!only || !*only || ("," + std::string(only) + ",").find("," + op + ",") != std::string::npos) ops.push_back(op);
  ASSERT_FALSE(ops.empty()) << "KILN_TORCH_OPS=" << only << " names no op";
  for (int64_t i = 0; i < std::max<int64_t>(ncases, (int64_t)ops.size()); i++) {
    Case c = make_case(g, i < (int64_t)ops.size() ? ops[i] : g.pick(ops));
    cases.push_back(std::move(c));
  }
  // run Kiln; cotangents for float outputs of cases with float inputs
  std::vector<Result> eager(cases.size()), staged(cases.size());
  for (size_t i = 0; i < cases.size(); i++) {
    Case &c = cases[i];
    bool any_float_in = false;
    for (auto &h : c.in) any_float_in |= is_float(h.dt);
    run_kiln(c, eager[i], staged[i]);  // forward first, to learn the outputs' types
    bool float_out = eager[i].error.empty() && !eager[i].y.empty();
    for (auto &y : eager[i].y) float_out &= is_float(y.dt);
    if (any_float_in && float_out && c.op != "stop_gradient") {
      bool was_edges = g.edges, was_ties = g.ties;
      g.edges = false, g.ties = false;
      for (auto &y : eager[i].y) c.ct.push_back(g.tensor(y.dt, y.shape));
      g.edges = was_edges, g.ties = was_ties;
      eager[i] = Result{}, staged[i] = Result{};
      run_kiln(c, eager[i], staged[i]);
    }
  }

  // run PyTorch once on every case
  std::string file;
  file.append("KTD1");
  put<uint32_t>(file, (uint32_t)cases.size());
  for (const Case &c : cases) {
    put<uint16_t>(file, (uint16_t)c.op.size());
    file += c.op;
    put<uint32_t>(file, (uint32_t)c.ints.size());
    for (int64_t v : c.ints) put<int64_t>(file, v);
    put<uint32_t>(file, (uint32_t)c.fls.size());
    for (double v : c.fls) put<double>(file, v);
    put<uint32_t>(file, (uint32_t)c.in.size());
    for (const auto &h : c.in) put_tensor(file, h);
    put<uint32_t>(file, (uint32_t)c.ct.size());
    for (const auto &h : c.ct) put_tensor(file, h);
  }
  std::string base = ::testing::TempDir() + "kiln_torch_diff_" + std::to_string(getpid());
  std::string in_path = base + ".in", out_path = base + ".out";
  {
    FILE *f = std::fopen(in_path.c_str(), "wb");
    ASSERT_NE(f, nullptr) << in_path;
    ASSERT_EQ(std::fwrite(file.data(), 1, file.size(), f), file.size());
    std::fclose(f);
  }
  std::string cmd = "/usr/bin/python3 '" + ref_script() + "' '" + in_path + "' '" + out_path + "'";
  int rc = std::system(cmd.c_str());
  std::string got = read_file(out_path);
  std::remove(in_path.c_str());
  std::remove(out_path.c_str());
  ASSERT_EQ(rc, 0) << cmd;
  In r{got};
  ASSERT_EQ(got.substr(0, 4), "KTR1");
  r.p = 4;
  ASSERT_EQ(r.take<uint32_t>(), cases.size());
  std::vector<TorchOut> ref(cases.size());
  for (auto &t : ref) {
    t.ok = r.take<uint8_t>() != 0;
    uint16_t len = r.take<uint16_t>();
    t.error = got.substr(r.p, len);
    r.p += len;
    uint32_t ny = r.take<uint32_t>();
    for (uint32_t k = 0; k < ny && !r.bad; k++) t.y.push_back(r.tensor());
    uint32_t ngr = r.take<uint32_t>();
    for (uint32_t k = 0; k < ngr && !r.bad; k++) {
      bool has = r.take<uint8_t>() != 0;
      t.has_grad.push_back(has);
      t.grad.push_back(has ? r.tensor() : HostT{});
    }
    ASSERT_FALSE(r.bad) << "torch_ref.py wrote a truncated file";
  }

  // compare
  std::vector<std::string> failures;
  std::map<std::string, int> known_hits;
  int compared = 0, graded = 0;
  std::map<std::string, int> per_op;
  auto report = [&](size_t i, const std::string &where, const std::string &why) {
    const Case &c = cases[i];
    std::string msg = "case " + std::to_string(i) + " " + where + ": " + why + "\n    " + describe(c);
    if (const KnownBug *b = known(c, where)) {
      known_hits[std::string(b->op) + " " + b->where + ": " + b->reason]++;
      if (verbose) std::printf("known bug: %s\n", msg.c_str());
      return;
    }
    failures.push_back(msg);
  };
  for (size_t i = 0; i < cases.size(); i++) {
    const Case &c = cases[i];
    const TorchOut &t = ref[i];
    per_op[c.op]++;
    if (!t.ok) {
      report(i, "torch", "torch_ref.py failed: " + t.error);
      continue;
    }
    if (!eager[i].error.empty()) {
      report(i, "eager", "Kiln failed: " + eager[i].error);
      continue;
    }
    compared++;
    for (int k = 0; k < c.n_out; k++) {
      if ((size_t)k >= t.y.size() || (size_t)k >= eager[i].y.size()) {
        report(i, "eager", "output count differs");
        break;
      }
      std::string why = compare(eager[i].y[k], t.y[k], tolerance(c, t.y[k].dt, false, 1));
      if (!why.empty()) report(i, "eager output " + std::to_string(k), why);
    }
    if (!staged[i].error.empty()) {
      report(i, "staged", "staged call failed: " + staged[i].error);
    } else {
      for (int k = 0; k < c.n_out && k < (int)eager[i].y.size(); k++) {
        std::string why = compare(staged[i].y[k], eager[i].y[k], tolerance(c, eager[i].y[k].dt, false, 0.25));
        if (!why.empty()) report(i, "staged output " + std::to_string(k) + " vs eager", why);
      }
    }
    if (c.ct.empty()) continue;
    graded++;
    for (size_t k = 0; k < c.in.size(); k++) {
      if (!is_float(c.in[k].dt)) continue;
      if (k >= t.grad.size() || !t.has_grad[k]) {
        report(i, "grad", "torch_ref.py gave no gradient for input " + std::to_string(k));
        continue;
      }
      Tol tol = tolerance(c, c.in[k].dt, true, 1);
      std::string why = compare(eager[i].grad[k], t.grad[k], tol);
      if (!why.empty()) report(i, "grad of input " + std::to_string(k), why);
      if (staged[i].error.empty()) {
        why = compare(staged[i].grad[k], eager[i].grad[k], tolerance(c, c.in[k].dt, true, 0.25));
        if (!why.empty()) report(i, "staged grad of input " + std::to_string(k) + " vs eager", why);
      }
    }
  }
  for (const auto &[what, n] : known_hits) std::printf("known Kiln bug, %d mismatches: %s\n", n, what.c_str());
  std::printf("torch_diff: %zu cases (seed %llu), %d compared, %d with gradients, %zu failures\n", cases.size(),
              (unsigned long long)seed, compared, graded, failures.size());
  EXPECT_GT(compared, (int)cases.size() * 9 / 10) << "most cases must run in both";
  std::string all;
  for (size_t k = 0; k < failures.size() && k < 40; k++) all += failures[k] + "\n";
  EXPECT_TRUE(failures.empty()) << failures.size() << " mismatches with PyTorch (first 40):\n" << all;
}

}  // namespace
