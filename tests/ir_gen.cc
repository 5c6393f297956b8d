// ir_gen.cc — the random-program generator of ir_gen.h. Each step picks an
// op kind, operands from the values made so far (biased toward recent and
// unused ones, so programs grow deep and few values are left dead) and
// attributes, asks ir_check_op whether the candidate is well typed and keeps
// it only then. Every value carries a conservative interval of its elements,
// so that the generator can refuse what would overflow, divide by zero or
// index out of range. Besides plain random ops it emits what the passes
// rewrite (x + 0, neg neg, transpose back, ...), near misses of it, and
// repeats and near repeats of earlier instructions (cse); a last phase folds
// surplus dead ends into the others, so most of a program reaches a result.
#include "ir_gen.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr double kLimit = 1e6;       // every value's elements stay within +-kLimit
constexpr int64_t kMaxElems = 4096;  // per value: interpreting stays fast
constexpr int kMaxRank = 5;          // of values the generator makes (parameters: 4)

using Shape = std::vector<int64_t>;

// splitmix64: tiny, and the same on every platform (std:: distributions are not)
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int below(int n) { return n <= 1 ? 0 : (int)(next() % (uint64_t)n); }
  int range(int lo, int hi) { return lo + below(hi - lo + 1); }  // inclusive
  double unit() { return (double)(next() >> 11) * 0x1p-53; }
  bool chance(double p) { return unit() < p; }
  template <class T>
  const T &of(const std::vector<T> &v) { return v[(size_t)below((int)v.size())]; }
};

struct Range {
  double lo, hi;
};

bool is_float(kiln_dtype d) { return d == KILN_F32 || d == KILN_F64; }
bool is_int(kiln_dtype d) { return d == KILN_I32 || d == KILN_I64; }
bool is_storage(kiln_dtype d) { return d == KILN_F16 || d == KILN_BF16; }
bool is_num(kiln_dtype d) { return is_float(d) || is_int(d); }
double mag(Range r) { return std::max(std::fabs(r.lo), std::fabs(r.hi)); }
Range hull(Range a, Range b) { return {std::min(a.lo, b.lo), std::max(a.hi, b.hi)}; }
Range times(Range a, Range b) {
  double c[4] = {a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi};
  return {*std::min_element(c, c + 4), *std::max_element(c, c + 4)};
}

int64_t count(const Shape &s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// NumPy broadcasting of two shapes, within the generator's limits
bool broadcastable(const Shape &a, const Shape &b) {
  size_t r = std::max(a.size(), b.size());
  if (r > (size_t)kMaxRank) return false;
  for (size_t i = 0; i < r; i++) {
    int64_t da = i < a.size() ? a[a.size() - 1 - i] : 1, db = i < b.size() ? b[b.size() - 1 - i] : 1;
    if (da != db && da != 1 && db != 1) return false;
  }
  return true;
}

struct Gen {
  Rng rng;
  ir_gen_options opt;
  ir_func *f = nullptr;
  int cap = 0;                 // the instruction budget of the current phase (<= opt.max_instrs)
  std::vector<Range> range;    // per value
  std::vector<int> uses;       // per value
  std::vector<bool> integral;  // per value: every element an integer
  // The program's dims: 2-3 sizes in 2..7 that shapes draw from, so that
  // equal dims (square matrices, operands that broadcast) are common.
  std::vector<int64_t> palette;
  int named = 0;
  bool broken = false;  // the builder refused what ir_check_op accepted
  // control flow (IR_GEN_CONTROL): the module, how deep this function is
  // nested in regions (0: @gen), the regions made so far (for their names),
  // and values pick never offers (a loop's state inside its body: see
  // gen_control)
  ir_module *mod = nullptr;
  int depth = 0;
  int *n_regions = nullptr;
  std::vector<bool> hidden;

  const op_type &type(ir_value v) const { return f->types[v]; }
  kiln_dtype dtype(ir_value v) const { return type(v).dtype; }
  int rank(ir_value v) const { return type(v).rank; }
  Shape shape(ir_value v) const { return Shape(type(v).shape, type(v).shape + type(v).rank); }
  int64_t elems(ir_value v) const {
    int64_t n = 1;
    for (int i = 0; i < rank(v); i++) n *= type(v).shape[i];
    return n;
  }
  bool allowed(kiln_dtype d) const { return (opt.dtypes & DT_BIT(d)) != 0; }
  int64_t dim() { return rng.of(palette); }
  int64_t dim_or_1() { return rng.chance(0.25) ? 1 : dim(); }
  bool room(int n) const { return f->n_instrs + n <= cap; }

  void record(ir_value v, Range r, bool whole) {
    if ((size_t)f->n_values > range.size()) {
      range.resize((size_t)f->n_values, Range{0, 0});
      uses.resize((size_t)f->n_values, 0);
      integral.resize((size_t)f->n_values, false);
    }
    range[v] = r;
    integral[v] = whole;
  }

  ir_loc loc() {
    // a few instructions carry a location, so the printer and parser see them
    if (rng.chance(0.06)) return ir_loc{"gen.kir", rng.range(1, 99)};
    return ir_loc{nullptr, 0};
  }

  void maybe_name(ir_value v) {
    if (!rng.chance(0.04)) return;
    std::string name = "t" + std::to_string(named++);
    if (ir_set_name(f, v, name.c_str())) broken = true;
  }

  // A value satisfying pred, biased toward the most recent ones; -1 if none.
  template <class P>
  ir_value pick(P pred) {
    std::vector<ir_value> c;
    for (ir_value v = 0; v < f->n_values; v++)
      if (((size_t)v >= hidden.size() || !hidden[(size_t)v]) && pred(v)) c.push_back(v);
    if (c.empty()) return -1;
    double u = rng.unit();
    if (u < 0.4) return c[c.size() - 1 - (size_t)rng.below(std::min(3, (int)c.size()))];
    if (u < 0.7) {  // values nothing uses yet: fewer dead ends, more of the program reaches a result
      std::vector<ir_value> unused;
      for (ir_value v : c)
        if (!uses[v]) unused.push_back(v);
      if (!unused.empty()) return rng.of(unused);
    }
    return rng.of(c);
  }

  // ---- the element interval of an instruction's result; false = refuse ----

  bool rule(op_id op, const op_attrs &a, const std::vector<ir_value> &in, const op_type &out, Range *r) {
    auto R = [&](int i) { return range[in[(size_t)i]]; };
    auto T = [&](int i) -> const op_type & { return type(in[(size_t)i]); };
    Range x = in.empty() ? Range{0, 0} : R(0);
    // divisors: integers never 0, floats at least 0.5 away from it
    auto safe_divisor = [&](Range d, kiln_dtype dt) {
      return is_int(dt) ? (d.lo >= 1 || d.hi <= -1) : (d.lo >= 0.5 || d.hi <= -0.5);
    };
    switch (op) {
      case OP_NEG: *r = {-x.hi, -x.lo}; return true;
      case OP_ABS: *r = x.lo >= 0 ? x : x.hi <= 0 ? Range{-x.hi, -x.lo} : Range{0, mag(x)}; return true;
      case OP_SIGN: *r = {x.lo < 0 ? -1.0 : 0.0, x.hi > 0 ? 1.0 : 0.0}; return true;
      case OP_EXP: *r = {std::exp(x.lo), std::exp(x.hi)}; return true;
      case OP_LOG:
        if (x.lo < 0.01) return false;
        *r = {std::log(x.lo), std::log(x.hi)};
        return true;
      case OP_LOG1P:
        if (x.lo < -0.9) return false;
        *r = {std::log1p(x.lo), std::log1p(x.hi)};
        return true;
      case OP_SQRT:
        if (x.lo < 0) return false;
        *r = {std::sqrt(x.lo), std::sqrt(x.hi)};
        return true;
      case OP_RSQRT:
        if (x.lo < 0.01) return false;
        *r = {1 / std::sqrt(x.hi), 1 / std::sqrt(x.lo)};
        return true;
      case OP_SIN:
      case OP_COS: *r = {-1, 1}; return true;
      case OP_TANH: *r = {std::tanh(x.lo), std::tanh(x.hi)}; return true;
      case OP_SIGMOID: *r = {0, 1}; return true;
      case OP_RELU: *r = {std::max(x.lo, 0.0), std::max(x.hi, 0.0)}; return true;
      case OP_FLOOR: *r = {std::floor(x.lo), std::floor(x.hi)}; return true;
      case OP_CEIL: *r = {std::ceil(x.lo), std::ceil(x.hi)}; return true;
      case OP_NOT:
      case OP_AND:
      case OP_OR:
      case OP_EQ:
      case OP_NE:
      case OP_LT:
      case OP_LE:
      case OP_GT:
      case OP_GE: *r = {0, 1}; return true;
      case OP_ADD: *r = {x.lo + R(1).lo, x.hi + R(1).hi}; return true;
      case OP_SUB: *r = {x.lo - R(1).hi, x.hi - R(1).lo}; return true;
      case OP_MUL: *r = times(x, R(1)); return true;
      case OP_MAX: *r = {std::max(x.lo, R(1).lo), std::max(x.hi, R(1).hi)}; return true;
      case OP_MIN: *r = {std::min(x.lo, R(1).lo), std::min(x.hi, R(1).hi)}; return true;
      case OP_DIV: {
        Range d = R(1);
        if (!safe_divisor(d, T(0).dtype)) return false;
        if (is_int(T(0).dtype)) {
          *r = {-mag(x), mag(x)};
        } else {
          double c[4] = {x.lo / d.lo, x.lo / d.hi, x.hi / d.lo, x.hi / d.hi};
          *r = {*std::min_element(c, c + 4), *std::max_element(c, c + 4)};
        }
        return true;
      }
      case OP_MOD: {
        if (!safe_divisor(R(1), T(0).dtype)) return false;
        double m = std::min(mag(x), mag(R(1)));
        *r = {x.lo >= 0 ? 0 : -m, x.hi <= 0 ? 0 : m};
        return true;
      }
      case OP_POW: {
        // exponents: small integers, or (for bases >= 0.1) small reals
        Range e = R(1);
        if (e.lo < -2 || e.hi > 3) return false;
        bool whole_exp = integral[in[1]];
        if (is_float(T(0).dtype)) {
          if (!whole_exp && x.lo < 0.1) return false;
          if (e.lo < 0 && x.lo < 0.1) return false;
        }
        double m = std::max(mag(x), 1.0), b = std::pow(m, std::max(e.hi, 0.0));
        if (e.lo < 0 && x.lo >= 0.1) b = std::max(b, std::pow(1 / x.lo, -e.lo));
        *r = {x.lo >= 0 ? 0 : -b, b};
        return true;
      }
      case OP_SELECT: *r = hull(R(1), R(2)); return true;
      case OP_CONVERT: {
        kiln_dtype to = a.dtype, from = T(0).dtype;
        if (to == KILN_BOOL) {
          *r = {0, 1};
        } else if (is_int(to) && !is_int(from)) {  // truncation, and f32 rounding on the way
          double w = 1 + 1e-6 * mag(x);
          *r = {std::trunc(x.lo) - w, std::trunc(x.hi) + w};
        } else if (to == KILN_F16 || to == KILN_BF16) {
          if (mag(x) > 6e4) return false;  // f16 overflows at 65504
          *r = {x.lo - 0.01 * std::fabs(x.lo), x.hi + 0.01 * std::fabs(x.hi)};
        } else {
          *r = x;
        }
        return true;
      }
      case OP_IDENTITY:
      case OP_STOP_GRADIENT:
      case OP_RESHAPE:
      case OP_BROADCAST:
      case OP_TRANSPOSE:
      case OP_SLICE: *r = x; return true;
      case OP_CONCAT: {
        *r = x;
        for (size_t i = 1; i < in.size(); i++) *r = hull(*r, R((int)i));
        return true;
      }
      case OP_REDUCE_SUM:
      case OP_REDUCE_PROD:
      case OP_REDUCE_MAX:
      case OP_REDUCE_MIN: {
        double n = 1;
        for (int i = 0; i < a.naxes; i++) n *= (double)T(0).shape[a.axes[i]];
        if (op == OP_REDUCE_SUM) {
          *r = {std::min(0.0, n * x.lo), std::max(0.0, n * x.hi)};
        } else if (op == OP_REDUCE_PROD) {
          double b = std::pow(mag(x), n);
          *r = n == 0 ? Range{1, 1} : x.lo >= 0 ? Range{std::pow(x.lo, n), b} : Range{-b, b};
        } else {
          if (n == 0) return false;  // max/min of nothing is -inf/+inf
          *r = x;
        }
        return true;
      }
      case OP_ARGMAX: *r = {0, (double)std::max<int64_t>(T(0).shape[a.axis] - 1, 0)}; return true;
      // collectives: a sum of world values each in x's range (they differ
      // between ranks), a mean within x's (an integer one truncated), the
      // rest x's own values moved
      case OP_ALL_REDUCE:
      case OP_REDUCE_SCATTER:
        if (a.reduce == 0) { /* DIST_SUM */
          double w = (double)std::max(a.world, 1);
          *r = {std::min(x.lo, w * x.lo), std::max(x.hi, w * x.hi)};
        } else {
          *r = {std::floor(x.lo), std::ceil(x.hi)};
          if (is_float(out.dtype)) *r = x;
        }
        return true;
      case OP_ALL_GATHER:
      case OP_BROADCAST_FROM: *r = x; return true;
      case OP_DOT: {
        double k = (double)T(0).shape[T(0).rank - 1];
        Range p = times(x, R(1));
        *r = {std::min(0.0, k * p.lo), std::max(0.0, k * p.hi)};
        return true;
      }
      case OP_GATHER: *r = x; return true;
      case OP_SCATTER_ADD: {
        double n = 1;
        for (int k = 0; k < T(1).rank; k++) n *= (double)T(1).shape[k];
        *r = {std::min(0.0, n * x.lo), std::max(0.0, n * x.hi)};
        return true;
      }
      case OP_IOTA: {
        double n = 1;
        for (int k = 0; k < out.rank; k++) n *= (double)out.shape[k];
        *r = {0, std::max(n - 1, 0.0)};
        return true;
      }
      // windows: sums of at most n products (each output element of conv2d
      // kh kw cg; of backprop_input kh kw o, as windows overlap; of
      // backprop_filter every output position), pooling gradients at most
      // kh kw shares of dy
      case OP_CONV2D:
      case OP_CONV2D_BP_INPUT:
      case OP_CONV2D_BP_FILTER: {
        const int64_t *fs = op == OP_CONV2D_BP_FILTER ? a.shape : T(1).shape;
        double n = op == OP_CONV2D      ? (double)(fs[0] * fs[1] * fs[2])
                   : op == OP_CONV2D_BP_INPUT ? (double)(fs[0] * fs[1] * fs[3])
                                              : (double)(T(1).shape[0] * T(1).shape[1] * T(1).shape[2]);
        Range p = times(x, R(1));
        *r = {std::min(0.0, n * p.lo), std::max(0.0, n * p.hi)};
        return true;
      }
      case OP_MAX_POOL2D:
      case OP_AVG_POOL2D: *r = x; return true;
      case OP_MAX_POOL2D_GRAD:
      case OP_AVG_POOL2D_GRAD: {
        Range d = op == OP_MAX_POOL2D_GRAD ? R(1) : x;
        double n = (double)a.window[0] * a.window[1];
        *r = {std::min(0.0, n * d.lo), std::max(0.0, n * d.hi)};
        return true;
      }
      default: return false;
    }
  }

  // What must hold whatever the values: indices in range, integer divisors
  // never zero.
  bool valid(op_id op, const op_attrs &a, const std::vector<ir_value> &in) const {
    switch (op) {
      case OP_GATHER:
        return range[in[1]].lo >= 0 && range[in[1]].hi <= (double)type(in[0]).shape[a.axis] - 1;
      case OP_SCATTER_ADD: return range[in[1]].lo >= 0 && range[in[1]].hi <= (double)a.shape[a.axis] - 1;
      case OP_DIV:
      case OP_MOD: return !is_int(dtype(in[0])) || range[in[1]].lo >= 1 || range[in[1]].hi <= -1;
      default: return true;
    }
  }

  bool whole(op_id op, const std::vector<ir_value> &in, const op_type &out) const {
    if (!is_float(out.dtype) && !is_storage(out.dtype)) return true;
    switch (op) {
      case OP_FLOOR:
      case OP_CEIL:
      case OP_SIGN:
      case OP_IOTA: return true;
      case OP_NEG:
      case OP_ABS:
      case OP_RELU:
      case OP_IDENTITY:
      case OP_STOP_GRADIENT:
      case OP_RESHAPE:
      case OP_BROADCAST:
      case OP_TRANSPOSE:
      case OP_SLICE:
      case OP_GATHER: return integral[in[0]];
      default: return false;
    }
  }

  // ---- appending ----

  // Appends op(in) if it is well typed, within the options and its values
  // stay in range; the result, or -1.
  ir_value emit(op_id op, const op_attrs &a, const std::vector<ir_value> &in) {
    if (broken || !room(1)) return -1;
    std::vector<op_type> t;
    for (ir_value v : in) {
      if (v < 0) return -1;  // a helper before it was refused
      t.push_back(type(v));
    }
    op_type out{};
    if (ir_check_op(op, &a, (int)in.size(), t.data(), &out)) {
      kiln_clear_error();
      return -1;
    }
    Shape os(out.shape, out.shape + out.rank);
    if (!allowed(out.dtype) || out.rank > kMaxRank || count(os) > kMaxElems) return -1;
    Range r;
    if (!valid(op, a, in)) return -1;
    if (opt.special_floats && (is_float(out.dtype) || is_storage(out.dtype))) {
      r = {-INFINITY, INFINITY};  // anything goes, NaN included
    } else if (!rule(op, a, in, out, &r) || !(std::fabs(r.lo) <= kLimit && std::fabs(r.hi) <= kLimit)) {
      return -1;
    }
    ir_value v = ir_append(f, op, &a, (int)in.size(), in.data(), loc());
    if (v < 0) {  // ir_check_op said yes: the builder disagrees with it
      broken = true;
      return -1;
    }
    record(v, r, whole(op, in, out));
    for (ir_value x : in) uses[x]++;
    maybe_name(v);
    return v;
  }

  ir_value emit1(op_id op, ir_value x) { return x < 0 ? -1 : emit(op, op_attrs{}, {x}); }
  ir_value emit2(op_id op, ir_value x, ir_value y) { return x < 0 || y < 0 ? -1 : emit(op, op_attrs{}, {x, y}); }

  // A constant of dtype dt and shape s whose elements come from value(i).
  template <class F>
  ir_value constant_from(kiln_dtype dt, const Shape &s, F value) {
    if (broken || !room(1) || !allowed(dt) || is_storage(dt) || (int)s.size() > kMaxRank) return -1;
    int64_t n = count(s);
    if (n > kMaxElems) return -1;
    std::vector<unsigned char> buf((size_t)n * kiln_dtype_size(dt) + 8);
    Range r{n ? INFINITY : 0, n ? -INFINITY : 0};
    bool whole = true;
    for (int64_t i = 0; i < n; i++) {
      double x = value(i);
      if (dt == KILN_BOOL) x = x != 0;
      if (is_int(dt) || dt == KILN_BOOL) x = std::trunc(x);
      switch (dt) {
        case KILN_F32: ((float *)buf.data())[i] = (float)x; break;
        case KILN_F64: ((double *)buf.data())[i] = x; break;
        case KILN_I32: ((int32_t *)buf.data())[i] = (int32_t)x; break;
        case KILN_I64: ((int64_t *)buf.data())[i] = (int64_t)x; break;
        default: buf[(size_t)i] = (unsigned char)(x != 0); break;
      }
      r = {std::fmin(r.lo, x), std::fmax(r.hi, x)};  // (special floats only: NaN)
      whole = whole && x == std::trunc(x);
    }
    // the caller's scope is not ours: this tensor lives in the generator's
    // scope until ir_gen_program pops it; the IR keeps its own reference
    kiln_tensor *t = kiln_tensor_new(dt, (int)s.size(), s.data(), buf.data());
    ir_value v = t ? ir_constant(f, t, loc()) : -1;
    if (v < 0) {
      broken = true;
      return -1;
    }
    record(v, r, whole);
    maybe_name(v);
    return v;
  }

  // A general operand: sometimes one value everywhere (0, 1, -1, 2: the
  // identities simplify looks for), else small random values.
  ir_value constant(kiln_dtype dt, const Shape &s) {
    if (dt == KILN_BOOL) {
      int mode = rng.below(3);
      return constant_from(dt, s, [&](int64_t) { return mode < 2 ? (double)mode : (double)rng.below(2); });
    }
    if (rng.chance(0.35)) {  // -0.0: x + -0.0 is x, x + 0.0 is not (for x = -0.0)
      static const double special[] = {0, 1, -1, 2, 0.5, -0.0};
      double c = special[rng.below(is_float(dt) ? 6 : 4)];
      return constant_from(dt, s, [&](int64_t) { return c; });
    }
    if (is_float(dt) && opt.special_floats && rng.chance(0.5)) {
      static const double wild[] = {NAN, INFINITY, -INFINITY, -0.0, 1e30, -1e30, 0, 1};
      bool same = rng.chance(0.5);
      double c = wild[rng.below(8)];
      return constant_from(dt, s, [&](int64_t) { return same ? c : wild[rng.below(8)]; });
    }
    if (is_float(dt)) return constant_from(dt, s, [&](int64_t) { return rng.range(-8, 8) / 4.0; });
    return constant_from(dt, s, [&](int64_t) { return (double)rng.range(-5, 5); });
  }

  ir_value scalar(kiln_dtype dt, double c) {
    return constant_from(dt, Shape{}, [&](int64_t) { return c; });
  }

  // ---- shapes ----

  Shape random_shape(int max_rank) {
    Shape s((size_t)rng.range(0, max_rank));
    for (auto &d : s) d = dim_or_1();
    return s;
  }

  // A shape that broadcasts with s: a scalar, s itself, a suffix, s with
  // some dims 1, s with a new leading dim, or s with its 1s widened.
  Shape partner_shape(const Shape &s) {
    Shape p = s;
    switch (rng.below(6)) {
      case 0: return Shape{};
      case 1: return s;
      case 2: {
        p.assign(s.end() - rng.range(0, (int)s.size()), s.end());
        for (auto &d : p)
          if (rng.chance(0.3)) d = 1;
        return p;
      }
      case 3:
        for (auto &d : p)
          if (rng.chance(0.4)) d = 1;
        return p;
      case 4:
        if ((int)p.size() < 4) p.insert(p.begin(), dim_or_1());
        return p;
      default:
        for (auto &d : p)
          if (d == 1 && rng.chance(0.6)) d = dim();
        return p;
    }
  }

  // ---- operands ----

  bool computable(ir_value v) const { return is_num(dtype(v)) || dtype(v) == KILN_BOOL; }

  // A second operand for an elementwise op on x: a value that broadcasts
  // with it, x itself, or a constant.
  ir_value partner(ir_value x) {
    kiln_dtype dt = dtype(x);
    Shape s = shape(x);
    int c = rng.below(10);
    if (c < 5) {
      ir_value y = pick([&](ir_value v) { return v != x && dtype(v) == dt && broadcastable(s, shape(v)); });
      if (y >= 0) return y;
    }
    if (c == 5 || is_storage(dt)) return x;
    return constant(dt, partner_shape(s));
  }

  // |y| + 1: never zero, for integers too (|INT_MIN| + 1 wraps to INT_MIN + 1)
  ir_value abs_plus_one(ir_value y) {
    if (y < 0 || !room(3)) return -1;
    ir_value a = emit1(OP_ABS, y);  // one statement each: C++ leaves argument order open
    return emit2(OP_ADD, a, scalar(dtype(y), 1));
  }

  // min(max(v, 0), hi): integer v clamped into [0, hi], for indices
  ir_value clamp(ir_value v, int64_t hi) {
    if (v < 0 || !room(4)) return -1;
    kiln_dtype dt = dtype(v);
    ir_value lo = emit2(OP_MAX, v, scalar(dt, 0));
    return emit2(OP_MIN, lo, scalar(dt, (double)hi));
  }

  // Index values in [0, n): an existing value in range, a constant, an iota
  // or a clamped integer value. -1 if the options allow no index dtype.
  ir_value indices(int64_t n, int max_rank) {
    std::vector<kiln_dtype> dts;
    for (kiln_dtype d : {KILN_I32, KILN_I64})
      if (allowed(d)) dts.push_back(d);
    if (dts.empty() || n <= 0) return -1;
    switch (rng.below(5)) {
      case 0:
      case 1:
      case 2: {
        ir_value v = pick([&](ir_value u) {
          return is_int(dtype(u)) && rank(u) <= max_rank && range[u].lo >= 0 && range[u].hi <= (double)n - 1;
        });
        if (v >= 0 && rng.chance(0.5)) return v;
        Shape s((size_t)rng.range(0, std::min(max_rank, 2)));
        for (auto &d : s) d = rng.range(1, 5);
        return constant_from(rng.of(dts), s, [&](int64_t) { return (double)rng.below((int)n); });
      }
      case 3: {
        op_attrs a{};
        a.dtype = rng.of(dts);
        a.rank = 1;
        a.shape[0] = rng.range(1, (int)n);
        return emit(OP_IOTA, a, {});
      }
      default: {
        ir_value v = pick([&](ir_value u) { return is_int(dtype(u)) && rank(u) <= max_rank; });
        return v < 0 ? -1 : clamp(v, n - 1);
      }
    }
  }

  // ---- one step per kind; false = nothing was appended ----

  bool gen_unary(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return computable(v); });
    if (x < 0) return false;
    kiln_dtype dt = dtype(x);
    if (dt == KILN_BOOL) return emit1(OP_NOT, x) >= 0;
    if (is_int(dt)) {
      static const std::vector<op_id> ops = {OP_NEG, OP_ABS, OP_SIGN, OP_RELU};
      return emit1(rng.of(ops), x) >= 0;
    }
    static const std::vector<op_id> ops = {OP_NEG,  OP_ABS,  OP_SIGN, OP_EXP,     OP_LOG,  OP_LOG1P,
                                           OP_SQRT, OP_RSQRT, OP_SIN, OP_COS,     OP_TANH, OP_SIGMOID,
                                           OP_RELU, OP_FLOOR, OP_CEIL};
    op_id op = rng.of(ops);
    Range r = range[x];
    switch (op) {  // the touchy ones get a safe argument when x's range needs it
      case OP_LOG:
        if (r.lo >= 0.01 && rng.chance(0.5)) break;
        return emit1(OP_LOG, abs_plus_one(x)) >= 0;
      case OP_RSQRT:
        if (r.lo >= 0.01 && rng.chance(0.5)) break;
        return emit1(OP_RSQRT, abs_plus_one(x)) >= 0;
      case OP_SQRT:
      case OP_LOG1P:
        if (r.lo >= 0 && rng.chance(0.5)) break;
        return emit1(op, emit1(OP_ABS, x)) >= 0;
      case OP_EXP:
        if (r.hi <= 8) break;
        return emit1(OP_EXP, emit1(OP_NEG, emit1(OP_ABS, x))) >= 0;
      default: break;
    }
    return emit1(op, x) >= 0;
  }

  bool gen_binary(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return computable(v); });
    if (x < 0) return false;
    kiln_dtype dt = dtype(x);
    if (dt == KILN_BOOL) {
      static const std::vector<op_id> ops = {OP_AND, OP_OR, OP_MAX, OP_MIN};
      ir_value y = partner(x);
      return rng.chance(0.5) ? emit2(rng.of(ops), x, y) >= 0 : emit2(rng.of(ops), y, x) >= 0;
    }
    static const std::vector<op_id> ops = {OP_ADD, OP_ADD, OP_ADD, OP_SUB, OP_SUB, OP_MUL, OP_MUL, OP_MUL,
                                           OP_DIV, OP_DIV, OP_POW, OP_MAX, OP_MIN, OP_MOD};
    op_id op = rng.of(ops);
    Shape s = shape(x);
    if (op == OP_POW) {
      Shape es = rng.chance(0.7) ? Shape{} : partner_shape(s);
      bool positive = range[x].lo >= 0.1;
      ir_value e;
      if (is_float(dt) && positive && rng.chance(0.5)) {
        static const double reals[] = {-1, -0.5, 0.5, 1.5, 2, 2.5};
        e = constant_from(dt, es, [&](int64_t) { return reals[rng.below(6)]; });
      } else {
        int lo = is_int(dt) || positive ? -1 : 0;
        e = constant_from(dt, es, [&](int64_t) { return (double)rng.range(lo, 3); });
      }
      return emit2(OP_POW, x, e) >= 0;
    }
    if (op == OP_DIV || op == OP_MOD) {
      ir_value y = -1;
      int c = rng.below(10);
      if (c < 4) {
        y = pick([&](ir_value v) {
          Range d = range[v];
          bool safe = is_int(dt) ? (d.lo >= 1 || d.hi <= -1) : (d.lo >= 0.5 || d.hi <= -0.5);
          return dtype(v) == dt && safe && broadcastable(s, shape(v));
        });
      } else if (c < 7) {  // constant divisors, some exact reciprocals (2, 4, 0.5), some not (3)
        static const double divs[] = {2, -2, 4, 3, -1, 1, 0.5, 0.25};
        Shape ds = rng.chance(0.6) ? Shape{} : partner_shape(s);
        double one = divs[rng.below(is_int(dt) ? 6 : 8)];
        bool same = rng.chance(0.7);
        y = constant_from(dt, ds, [&](int64_t) { return same ? one : divs[rng.below(is_int(dt) ? 6 : 8)]; });
      }
      if (y < 0) y = abs_plus_one(partner(x));
      return emit2(op, x, y) >= 0;
    }
    ir_value y = partner(x);
    return rng.chance(0.5) ? emit2(op, x, y) >= 0 : emit2(op, y, x) >= 0;
  }

  bool gen_compare(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return computable(v); });
    if (x < 0) return false;
    static const std::vector<op_id> ops = {OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE};
    ir_value y = partner(x);
    return rng.chance(0.5) ? emit2(rng.of(ops), x, y) >= 0 : emit2(rng.of(ops), y, x) >= 0;
  }

  bool gen_select(ir_value want) {
    ir_value x = want >= 0 ? want : pick([](ir_value) { return true; });
    kiln_dtype dt = dtype(x);
    Shape s = shape(x);
    ir_value y = partner(x);
    ir_value cond = -1;
    switch (rng.below(4)) {
      case 0:
        cond = pick([&](ir_value v) { return dtype(v) == KILN_BOOL && broadcastable(s, shape(v)); });
        break;
      case 1: cond = constant(KILN_BOOL, rng.chance(0.5) ? Shape{} : partner_shape(s)); break;
      default: break;
    }
    if (cond < 0) {  // x > c, or x itself when it is a bool
      if (dt == KILN_BOOL) {
        cond = x;
      } else if (is_num(dt)) {
        static const std::vector<op_id> ops = {OP_GT, OP_LT, OP_GE};
        op_id op = rng.of(ops);
        cond = emit2(op, x, constant(dt, Shape{}));
      } else {
        return false;
      }
    }
    return rng.chance(0.5) ? emit(OP_SELECT, op_attrs{}, {cond, x, y}) >= 0
                           : emit(OP_SELECT, op_attrs{}, {cond, y, x}) >= 0;
  }

  bool gen_convert(ir_value want) {
    ir_value x = want >= 0 ? want : pick([](ir_value) { return true; });
    std::vector<kiln_dtype> to;
    for (int d = 0; d < KILN_DTYPE_COUNT; d++)
      if (allowed((kiln_dtype)d) && (d != (int)dtype(x) || rng.chance(0.1))) to.push_back((kiln_dtype)d);
    if (to.empty()) return false;
    op_attrs a{};
    a.dtype = rng.of(to);
    return emit(OP_CONVERT, a, {x}) >= 0;
  }

  bool gen_broadcast(ir_value want) {
    ir_value x = want >= 0 ? want : pick([](ir_value) { return true; });
    Shape s = shape(x);
    for (auto &d : s)
      if (d == 1 && rng.chance(0.5)) d = dim();
    for (int k = rng.below(3); k > 0 && (int)s.size() < kMaxRank; k--) s.insert(s.begin(), dim_or_1());
    op_attrs a{};
    a.rank = (int)s.size();
    std::copy(s.begin(), s.end(), a.shape);
    return emit(OP_BROADCAST, a, {x}) >= 0;
  }

  bool gen_reshape(ir_value want) {
    ir_value x = want >= 0 ? want : pick([](ir_value) { return true; });
    int64_t n = elems(x);
    Shape s;
    if (n == 0) {
      s.assign(1, 0);
      if (rng.chance(0.5)) s.insert(s.begin() + rng.below(2), (int64_t)rng.range(1, 3));
    } else {  // n's prime factors spread over 1-4 dims, then some 1s
      std::vector<int64_t> primes;
      int64_t m = n;
      for (int64_t p = 2; p * p <= m; p++)
        while (m % p == 0) primes.push_back(p), m /= p;
      if (m > 1) primes.push_back(m);
      s.assign((size_t)rng.range(primes.empty() ? 0 : 1, 4), 1);
      for (int64_t p : primes) s[(size_t)rng.below((int)s.size())] *= p;
      if ((int)s.size() < kMaxRank && rng.chance(0.3)) s.insert(s.begin() + rng.below((int)s.size() + 1), 1);
    }
    op_attrs a{};
    a.rank = (int)s.size();
    std::copy(s.begin(), s.end(), a.shape);
    return emit(OP_RESHAPE, a, {x}) >= 0;
  }

  void shuffle(int *v, int n) {
    for (int i = n - 1; i > 0; i--) std::swap(v[i], v[rng.below(i + 1)]);
  }

  bool gen_transpose(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return rank(v) >= 2 || rng.chance(0.1); });
    if (x < 0) return false;
    op_attrs a{};
    a.naxes = rank(x);
    for (int i = 0; i < a.naxes; i++) a.axes[i] = i;
    shuffle(a.axes, a.naxes);
    return emit(OP_TRANSPOSE, a, {x}) >= 0;
  }

  bool gen_slice(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return rank(v) >= 1 || rng.chance(0.1); });
    if (x < 0) return false;
    Shape s = shape(x);
    op_attrs a{};
    a.rank = (int)s.size();
    for (size_t i = 0; i < s.size(); i++) {
      int d = (int)s[i];
      if (d == 0 || rng.chance(0.03)) {  // empty
        a.begin[i] = rng.range(0, d);
        a.shape[i] = 0;
      } else {
        a.begin[i] = rng.below(d);
        a.shape[i] = rng.chance(0.2) ? -1 : rng.range(1, d - (int)a.begin[i]);
      }
    }
    return emit(OP_SLICE, a, {x}) >= 0;
  }

  bool gen_concat(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return rank(v) >= 1; });
    if (x < 0) return false;
    Shape s = shape(x);
    op_attrs a{};
    a.axis = rng.below((int)s.size());
    std::vector<ir_value> in = {x};
    for (int k = rng.range(1, 2); k > 0; k--) {
      ir_value y = -1;
      switch (rng.below(4)) {
        case 0:
          y = pick([&](ir_value v) {
            Shape t = shape(v);
            if (dtype(v) != dtype(x) || t.size() != s.size()) return false;
            for (size_t i = 0; i < s.size(); i++)
              if ((int)i != a.axis && t[i] != s[i]) return false;
            return true;
          });
          break;
        case 1: {
          Shape t = s;
          t[(size_t)a.axis] = dim_or_1();
          y = constant(dtype(x), t);
          break;
        }
        case 2: y = x; break;
        default: break;
      }
      if (y < 0) y = in.back();
      in.insert(in.begin() + rng.below((int)in.size() + 1), y);
    }
    return emit(OP_CONCAT, a, in) >= 0;
  }

  bool gen_reduce(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return is_num(dtype(v)); });
    if (x < 0) return false;
    static const std::vector<op_id> ops = {OP_REDUCE_SUM, OP_REDUCE_SUM, OP_REDUCE_SUM, OP_REDUCE_MAX,
                                           OP_REDUCE_MAX, OP_REDUCE_MIN, OP_REDUCE_MIN, OP_REDUCE_PROD};
    op_attrs a{};
    int r = rank(x);
    double c = rng.unit();
    for (int i = 0; i < r; i++)
      if (c < 0.15 || (c >= 0.2 && rng.chance(0.5))) a.axes[a.naxes++] = i;  // all, none or some
    if (c >= 0.2 && a.naxes == 0 && r > 0) a.axes[a.naxes++] = rng.below(r);
    a.keepdims = rng.chance(0.4);
    return emit(rng.of(ops), a, {x}) >= 0;
  }

  // a collective over opt.world processes (IR_GEN_COLLECTIVE): often an
  // all_reduce, so that a program has several for the combiner to merge
  bool gen_collective(ir_value want) {
    int world = std::max(opt.world, 1);
    op_attrs a{};
    a.world = world;
    int kind = rng.below(10);
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return is_num(dtype(v)) || dtype(v) == KILN_BOOL; });
    if (x < 0) return false;
    bool num = is_num(dtype(x));
    if (kind < 5 || (kind < 8 && rank(x) == 0)) {  // all_reduce
      static const int reductions[] = {0, 0, 1, 2, 3};  // DIST_SUM, MEAN, MAX, MIN
      a.reduce = num ? reductions[rng.below(5)] : 2 + rng.below(2);
      return emit(OP_ALL_REDUCE, a, {x}) >= 0;
    }
    if (kind < 6) {  // all_gather
      a.axis = rng.below(rank(x));
      return emit(OP_ALL_GATHER, a, {x}) >= 0;
    }
    if (kind < 8) {  // reduce_scatter along an axis the world divides
      std::vector<int> axes;
      for (int i = 0; i < rank(x); i++)
        if (type(x).shape[i] % world == 0) axes.push_back(i);
      if (axes.empty()) {  // make one: x broadcast along a new leading axis of the world's size
        op_attrs b{};
        b.rank = rank(x) + 1;
        b.shape[0] = world;
        for (int i = 0; i < rank(x) && i + 1 < KILN_MAX_RANK; i++) b.shape[i + 1] = type(x).shape[i];
        if (b.rank > kMaxRank || !room(2) || (x = emit(OP_BROADCAST, b, {x})) < 0) return false;
        axes.push_back(0);
      }
      a.axis = rng.of(axes);
      static const int reductions[] = {0, 0, 1, 2, 3};
      a.reduce = num ? reductions[rng.below(5)] : 2 + rng.below(2);
      return emit(OP_REDUCE_SCATTER, a, {x}) >= 0;
    }
    a.root = rng.below(world);  // broadcast_from
    return emit(OP_BROADCAST_FROM, a, {x}) >= 0;
  }

  bool gen_argmax(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return is_num(dtype(v)) && rank(v) >= 1; });
    if (x < 0) return false;
    op_attrs a{};
    a.axis = rng.below(rank(x));
    return emit(OP_ARGMAX, a, {x}) >= 0;
  }

  bool gen_dot(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return is_num(dtype(v)) && rank(v) >= 1 && rank(v) <= 4; });
    if (x < 0) return false;
    if (rank(x) == 1) {  // a vector becomes a row or a column
      op_attrs a{};
      a.rank = 2;
      bool row = rng.chance(0.5);
      a.shape[0] = row ? 1 : type(x).shape[0];
      a.shape[1] = row ? type(x).shape[0] : 1;
      if (!room(2) || (x = emit(OP_RESHAPE, a, {x})) < 0) return false;
    }
    Shape s = shape(x);
    int64_t k = s.back();
    Shape batch(s.begin(), s.end() - 2);
    ir_value y = -1;
    switch (rng.below(4)) {
      case 0:
        y = pick([&](ir_value v) {
          Shape t = shape(v);
          return dtype(v) == dtype(x) && t.size() >= 2 && t[t.size() - 2] == k &&
                 broadcastable(batch, Shape(t.begin(), t.end() - 2));
        });
        break;
      case 1: {  // x times its own transpose: [..., m, k] x [..., k, m]
        op_attrs a{};
        a.naxes = (int)s.size();
        for (int i = 0; i < a.naxes; i++) a.axes[i] = i;
        std::swap(a.axes[a.naxes - 1], a.axes[a.naxes - 2]);
        if (room(2)) y = emit(OP_TRANSPOSE, a, {x});
        break;
      }
      default: break;
    }
    if (y < 0) {  // a constant [k, n], with x's batch dims (or 1s) in front sometimes
      Shape t = rng.chance(0.6) ? Shape{} : partner_shape(batch);
      t.push_back(k);
      t.push_back(dim_or_1());
      y = constant(dtype(x), t);
    }
    return rng.chance(0.8) ? emit2(OP_DOT, x, y) >= 0 : emit2(OP_DOT, y, x) >= 0;
  }

  // ---- dense blocks (IR_GEN_DENSE: see ir_gen.h) ----

  // a scalar of the program's float data, in [-1, 1] (-1 when none)
  ir_value data_scalar() {
    ir_value v = pick([&](ir_value u) { return (dtype(u) == KILN_F32 || dtype(u) == KILN_F64) && elems(u) > 0; });
    if (v < 0) return -1;
    op_attrs all{};
    for (int i = 0; i < rank(v); i++) all.axes[all.naxes++] = i;
    return emit1(OP_TANH, emit(OP_REDUCE_MAX, all, {v}));
  }
  // a constant plus s: a matrix of the program's data, which fold cannot compute
  ir_value data_matrix(ir_value s, const Shape &sh) {
    if (s < 0) return -1;
    op_attrs a{};
    a.rank = (int)sh.size();
    std::copy(sh.begin(), sh.end(), a.shape);
    ir_value c = constant(dtype(s), sh);
    return emit2(OP_ADD, c, emit(OP_BROADCAST, a, {s}));
  }

  bool gen_dense(ir_value) {
    if (!room(20)) return false;
    ir_value s = data_scalar();
    if (s < 0) return false;
    kiln_dtype dt = dtype(s);
    auto data = [&](const Shape &sh) { return data_matrix(s, sh); };
    int64_t b = rng.of(std::vector<int64_t>{17, 20, 24, 32, 40}), k = rng.of(std::vector<int64_t>{8, 17, 24}),
            h = rng.of(std::vector<int64_t>{16, 24, 32, 48});
    ir_value w = constant(dt, {k, h});
    ir_value src = emit2(OP_DOT, data({b, k}), w);  // [b, h]
    if (rng.chance(0.5)) src = emit1(rng.chance(0.5) ? OP_RELU : OP_TANH, src);
    op_attrs ta{};
    ta.naxes = 2;
    ta.axes[0] = 1, ta.axes[1] = 0;
    ir_value t = src < 0 ? -1 : emit(OP_TRANSPOSE, ta, {src});  // [h, b]
    for (int i = rng.below(3); i > 0; i--) emit2(OP_DOT, data({b, k}), w);  // src's size, merged into results later
    ir_value d;
    if (rng.chance(0.3)) d = emit2(OP_DOT, data({rng.range(1, 4), h}), t);      // [m, b]: matmul_nt
    else d = emit2(OP_DOT, t, data({b, rng.of(std::vector<int64_t>{16, 24, 32})}));  // [h, n]: packed
    if (d >= 0 && rng.chance(0.5)) d = emit2(OP_DOT, d, constant(dt, {type(d).shape[1], 8}));  // d a temporary
    return d >= 0;
  }

  // ---- narrow rows (IR_GEN_NARROW: see ir_gen.h) ----

  bool gen_narrow(ir_value) {
    if (!room(12)) return false;
    ir_value s = data_scalar();
    if (s < 0) return false;
    kiln_dtype dt = dtype(s);
    int64_t rows = rng.of(std::vector<int64_t>{33, 40, 64, 100, 200}), w = rng.range(1, 6);
    ir_value x = data_matrix(s, {rows, w});
    std::vector<ir_value> made{x};
    for (int layer = rng.range(1, 4); layer > 0 && x >= 0; layer--) {
      int64_t n = rng.of(std::vector<int64_t>{1, 2, 3, 8, 10, 16});
      ir_value h = emit2(OP_DOT, x, constant(dt, {w, n}));
      if (rng.chance(0.6)) h = emit2(OP_ADD, h, constant(dt, rng.chance(0.5) ? Shape{n} : Shape{1, n}));
      switch (rng.below(5)) {
        case 0: h = emit1(OP_TANH, h); break;
        case 1: h = emit1(OP_RELU, h); break;
        case 2: h = emit1(OP_SIGMOID, h); break;
        case 3: h = emit(OP_SELECT, op_attrs{}, {emit2(OP_GT, h, scalar(dt, 0)), h, emit2(OP_MUL, h, scalar(dt, 0.25))}); break;
        default: h = emit1(OP_TANH, emit2(OP_MUL, h, h)); break;
      }
      for (ir_value u : made)  // a value of the block before, of the same shape (a gradient's product, a residual)
        if (h >= 0 && u >= 0 && u != h && shape(u) == shape(h) && rng.chance(0.3)) {
          h = emit2(rng.chance(0.5) ? OP_MUL : OP_SUB, h, u);
          break;
        }
      if (h >= 0 && rng.chance(0.2))  // a column [rows, 1] broadcast along the rows
        h = emit2(OP_MUL, h, emit1(OP_TANH, emit2(OP_DOT, x, constant(dt, {w, 1}))));
      if (h < 0) break;
      made.push_back(h);
      x = h, w = n;
    }
    return x >= 0;
  }

  bool gen_gather(ir_value) {
    ir_value p = pick([&](ir_value v) { return rank(v) >= 1; });
    if (p < 0) return false;
    op_attrs a{};
    a.axis = rng.below(rank(p));
    ir_value idx = indices(type(p).shape[a.axis], std::min(2, kMaxRank + 1 - rank(p)));
    return idx >= 0 && emit(OP_GATHER, a, {p, idx}) >= 0;
  }

  bool gen_scatter(ir_value) {
    ir_value u = pick([&](ir_value v) { return is_num(dtype(v)) && rank(v) >= 1; });
    if (u < 0) return false;
    Shape s = shape(u);
    op_attrs a{};
    a.axis = rng.below((int)s.size());
    int64_t n = s[(size_t)a.axis];
    a.rank = (int)s.size();
    std::copy(s.begin(), s.end(), a.shape);
    a.shape[a.axis] = dim_or_1();
    // rank-1 indices of u's length along axis, into [0, shape[axis])
    std::vector<kiln_dtype> dts;
    for (kiln_dtype d : {KILN_I32, KILN_I64})
      if (allowed(d)) dts.push_back(d);
    if (dts.empty()) return false;
    int64_t hi = a.shape[a.axis] - 1;
    ir_value idx = pick([&](ir_value v) {
      return is_int(dtype(v)) && rank(v) == 1 && type(v).shape[0] == n && range[v].lo >= 0 && range[v].hi <= (double)hi;
    });
    if (idx < 0 || rng.chance(0.5))
      idx = constant_from(rng.of(dts), Shape{n}, [&](int64_t) { return (double)rng.range(0, (int)hi); });
    return idx >= 0 && emit(OP_SCATTER_ADD, a, {u, idx}) >= 0;
  }

  // ---- windows (IR_GEN_WINDOW) ----

  // the output length of a window of k (dilation d) over n padded p0 + p1,
  // stride st; <= 0 when it does not fit
  static int64_t window_len(int64_t n, int64_t k, int d, int p0, int p1, int st) {
    int64_t span = (k - 1) * d + 1;
    return n + p0 + p1 < span ? 0 : (n + p0 + p1 - span) / st + 1;
  }
  // the input length whose windows give m outputs (the smallest), or <= 0
  static int64_t window_in(int64_t m, int64_t k, int d, int p0, int p1, int st) {
    return (m - 1) * st + (k - 1) * d + 1 - p0 - p1;
  }

  bool gen_window(ir_value) {
    ir_value x = pick([&](ir_value v) { return is_float(dtype(v)) && rank(v) >= 1 && rank(v) <= 4; });
    if (x < 0) return false;
    if (rank(x) < 4) {  // leading 1s: [1, ..., shape]
      op_attrs a{};
      a.rank = 4;
      Shape s = shape(x);
      for (int i = 0; i < 4; i++) a.shape[i] = i < 4 - (int)s.size() ? 1 : s[(size_t)(i - (4 - (int)s.size()))];
      if (!room(3) || (x = emit(OP_RESHAPE, a, {x})) < 0) return false;
    }
    Shape s = shape(x);
    kiln_dtype dt = dtype(x);
    op_attrs a{};
    int which = rng.below(7);
    bool conv = which < 3;
    a.stride[0] = rng.range(1, 2), a.stride[1] = rng.range(1, 2);
    int64_t kh = rng.range(1, 3), kw = rng.range(1, 3);
    for (int i = 0; i < 4; i++) a.padding[i] = rng.chance(0.6) ? 0 : rng.range(1, 2);
    if (conv) {
      a.dilation[0] = rng.chance(0.7) ? 1 : 2, a.dilation[1] = rng.chance(0.7) ? 1 : 2;
      // groups: 1, depthwise, or another divisor of the channels (the dy's for backprop_input)
      int64_t ch = s[3];
      std::vector<int> divisors;
      for (int d = 1; d <= ch; d++)
        if (ch % d == 0) divisors.push_back(d);
      a.groups = rng.chance(0.5) || divisors.empty() ? 1 : rng.of(divisors);  // (none: 0 channels)
    } else {
      a.window[0] = (int)kh, a.window[1] = (int)kw;
      for (int i = 0; i < 4; i++) a.padding[i] = std::min<int>(a.padding[i], (int)(i < 2 ? kh : kw) - 1);
    }
    auto set_shape = [&](const Shape &t) {
      a.rank = (int)t.size();
      std::copy(t.begin(), t.end(), a.shape);
    };
    switch (which) {
      case 0: {  // conv2d(x, constant filter), maybe with what its epilogue fuses
        int64_t og = rng.range(1, 3), o = og * a.groups;
        ir_value f = constant(dt, Shape{kh, kw, s[3] / a.groups, o});
        ir_value c = f >= 0 ? emit(OP_CONV2D, a, {x, f}) : -1;
        if (c < 0 || !rng.chance(0.5) || !room(4)) return c >= 0;
        // + a bias ([o] or [1,1,1,o], either side), + a residual, relu or tanh
        ir_value b = constant(dt, rng.chance(0.5) ? Shape{o} : Shape{1, 1, 1, o});
        if (b < 0 || (c = rng.chance(0.5) ? emit2(OP_ADD, c, b) : emit2(OP_ADD, b, c)) < 0) return false;
        if (rng.chance(0.4)) {  // a residual: a constant, or a projection shortcut (another conv + bias of x)
          ir_value r = -1;
          if (rng.chance(0.5) && room(4)) {
            ir_value f2 = constant(dt, Shape{kh, kw, s[3] / a.groups, o}), b2 = constant(dt, Shape{o});
            r = f2 >= 0 && b2 >= 0 ? emit2(OP_ADD, emit(OP_CONV2D, a, {x, f2}), b2) : -1;
          } else {
            r = constant(dt, shape(c));
          }
          if (r < 0 || (c = rng.chance(0.5) ? emit2(OP_ADD, c, r) : emit2(OP_ADD, r, c)) < 0) return false;
        }
        if (rng.chance(0.6)) c = emit1(rng.chance(0.7) ? OP_RELU : OP_TANH, c);
        return c >= 0;
      }
      case 1: {  // backprop_input(x as dy, filter) into the image whose conv2d has x's shape
        int64_t cg = rng.range(1, 3);
        int64_t h = window_in(s[1], kh, a.dilation[0], a.padding[0], a.padding[1], a.stride[0]);
        int64_t w = window_in(s[2], kw, a.dilation[1], a.padding[2], a.padding[3], a.stride[1]);
        if (h < 1 || w < 1) return false;
        set_shape(Shape{s[0], h, w, cg * a.groups});
        ir_value f = constant(dt, Shape{kh, kw, cg, s[3]});
        return f >= 0 && emit(OP_CONV2D_BP_INPUT, a, {x, f}) >= 0;
      }
      case 2: {  // backprop_filter(x, dy)
        int64_t oh = window_len(s[1], kh, a.dilation[0], a.padding[0], a.padding[1], a.stride[0]);
        int64_t ow = window_len(s[2], kw, a.dilation[1], a.padding[2], a.padding[3], a.stride[1]);
        if (oh < 1 || ow < 1) return false;
        int64_t o = rng.range(1, 3) * a.groups;
        set_shape(Shape{kh, kw, s[3] / a.groups, o});
        ir_value dy = constant(dt, Shape{s[0], oh, ow, o});
        return dy >= 0 && emit(OP_CONV2D_BP_FILTER, a, {x, dy}) >= 0;
      }
      case 3: return emit(OP_MAX_POOL2D, a, {x}) >= 0;
      case 4: return emit(OP_AVG_POOL2D, a, {x}) >= 0;
      case 5: {  // max_pool2d_grad(x, dy)
        int64_t oh = window_len(s[1], kh, 1, a.padding[0], a.padding[1], a.stride[0]);
        int64_t ow = window_len(s[2], kw, 1, a.padding[2], a.padding[3], a.stride[1]);
        if (oh < 1 || ow < 1) return false;
        ir_value dy = constant(dt, Shape{s[0], oh, ow, s[3]});
        return dy >= 0 && emit(OP_MAX_POOL2D_GRAD, a, {x, dy}) >= 0;
      }
      default: {  // avg_pool2d_grad(x as dy) into the image it pooled
        int64_t h = window_in(s[1], kh, 1, a.padding[0], a.padding[1], a.stride[0]);
        int64_t w = window_in(s[2], kw, 1, a.padding[2], a.padding[3], a.stride[1]);
        if (h < 1 || w < 1) return false;
        set_shape(Shape{s[0], h, w, s[3]});
        return emit(OP_AVG_POOL2D_GRAD, a, {x}) >= 0;
      }
    }
  }

  bool gen_iota(ir_value) {
    std::vector<kiln_dtype> dts;
    for (kiln_dtype d : {KILN_F32, KILN_F64, KILN_I32, KILN_I64})
      if (allowed(d)) dts.push_back(d);
    if (dts.empty()) return false;
    op_attrs a{};
    a.dtype = rng.of(dts);
    Shape s = rng.chance(0.6) ? Shape{(int64_t)rng.range(1, 8)} : random_shape(3);
    a.rank = (int)s.size();
    std::copy(s.begin(), s.end(), a.shape);
    return emit(OP_IOTA, a, {}) >= 0;
  }

  bool gen_constant(ir_value want) {
    ir_value x = want >= 0 ? want : pick([&](ir_value v) { return computable(v); });
    if (x < 0) return false;
    // x's shape (over 16 elements prints as hex) or a random one
    Shape s = rng.chance(0.5) ? shape(x) : random_shape(3);
    return constant(dtype(x), s) >= 0;
  }

  bool gen_identity(ir_value want) {
    ir_value x = want >= 0 ? want : pick([](ir_value) { return true; });
    return emit1(rng.chance(0.5) ? OP_IDENTITY : OP_STOP_GRADIENT, x) >= 0;
  }

  // Patterns the passes rewrite, and near misses they must leave alone.
  bool gen_idiom(ir_value) { return rng.chance(0.5) ? idiom_constant() : idiom_chain(); }

  // x op c where c is (nearly) the op's identity, or x op x:
  // x + +-0, x - 0, 0 - x, x * 1, x * 0, x / 1, x / 2^k, x / 3, pow(x, 1),
  // x - x, max(x, x), x == x, select(p, x, x). The constant is a scalar, x's
  // shape, or one that broadcasts x up (then a rewrite to x is wrong).
  bool idiom_constant() {
    ir_value x = pick([&](ir_value v) { return computable(v); });
    if (x < 0) return false;
    kiln_dtype dt = dtype(x);
    struct Form {
      op_id op;
      double c;
      int where;  // 0: x op c, 1: c op x, 2: x op x
    };
    static const std::vector<Form> num = {
        {OP_ADD, 0, 0},   {OP_ADD, -0.0, 0}, {OP_ADD, 0, 1},    {OP_ADD, -0.0, 1}, {OP_SUB, 0, 0},
        {OP_SUB, -0.0, 0}, {OP_SUB, 0, 1},   {OP_SUB, -0.0, 1}, {OP_MUL, 1, 0},    {OP_MUL, 1, 1},
        {OP_MUL, 0, 0},   {OP_MUL, -0.0, 1}, {OP_MUL, -1, 0},   {OP_DIV, 1, 0},    {OP_DIV, 2, 0},
        {OP_DIV, 0.25, 0}, {OP_DIV, -4, 0},  {OP_DIV, 3, 0},    {OP_DIV, 0.1, 0},  {OP_POW, 1, 0},
        {OP_MAX, 0, 2},   {OP_MIN, 0, 2},    {OP_SUB, 0, 2},    {OP_EQ, 0, 2},     {OP_NE, 0, 2},
        {OP_SELECT, 0, 2}};
    static const std::vector<Form> boolean = {{OP_AND, 1, 0}, {OP_AND, 0, 1}, {OP_OR, 0, 0},  {OP_OR, 1, 1},
                                              {OP_MAX, 0, 2}, {OP_MIN, 0, 2}, {OP_AND, 0, 2}, {OP_EQ, 0, 2},
                                              {OP_SELECT, 0, 2}};
    Form form = rng.of(dt == KILN_BOOL ? boolean : num);
    if (is_float(dt) && form.c == 0 && form.where < 2 && rng.chance(0.4) && room(3)) {
      // x * +-0 first: zeros of both signs, where x + 0 and x + -0 differ
      ir_value z = scalar(dt, rng.chance(0.5) ? 0.0 : -0.0);
      if ((x = emit2(OP_MUL, x, z)) < 0) return false;
    }
    if (form.where == 2) {
      if (form.op != OP_SELECT) return emit2(form.op, x, x) >= 0;
      ir_value p = constant(KILN_BOOL, rng.chance(0.5) ? Shape{} : partner_shape(shape(x)));
      return emit(OP_SELECT, op_attrs{}, {p, x, x}) >= 0;
    }
    Shape s = shape(x);
    double u = rng.unit();
    Shape cs = u < 0.5 ? Shape{} : u < 0.75 ? s : partner_shape(s);
    ir_value c = constant_from(dt, cs, [&](int64_t) { return form.c; });
    return form.where == 0 ? emit2(form.op, x, c) >= 0 : emit2(form.op, c, x) >= 0;
  }

  // The op that made x, again on x: neg neg, not not, abs abs, transpose of
  // transpose (sometimes the inverse), reshape back, broadcast of broadcast,
  // a convert round trip (exact only when the middle dtype holds every
  // value), slice of slice, reduce of reduce.
  bool idiom_chain() {
    static const std::vector<op_id> chainable = {
        OP_NEG,      OP_NOT,   OP_ABS,       OP_RELU,    OP_FLOOR,    OP_SIGN,          OP_TRANSPOSE,
        OP_RESHAPE,  OP_BROADCAST, OP_CONVERT, OP_SLICE, OP_IDENTITY, OP_STOP_GRADIENT, OP_REDUCE_SUM,
        OP_REDUCE_MAX};
    ir_value x = pick([&](ir_value v) {
      return f->def[v] >= 0 &&
             std::find(chainable.begin(), chainable.end(), f->instrs[f->def[v]].op) != chainable.end();
    });
    if (x < 0) return false;
    const ir_instr d = f->instrs[f->def[x]];  // a copy: appending moves f->instrs
    ir_value src = d.in[0];
    op_attrs a{};
    switch (d.op) {
      case OP_TRANSPOSE:
        if (!rng.chance(0.4)) return gen_transpose(x);
        a.naxes = d.attrs.naxes;
        for (int i = 0; i < a.naxes; i++) a.axes[d.attrs.axes[i]] = i;  // the inverse
        return emit(OP_TRANSPOSE, a, {x}) >= 0;
      case OP_RESHAPE:
        if (!rng.chance(0.5)) return gen_reshape(x);
        a.rank = rank(src);
        std::copy(type(src).shape, type(src).shape + a.rank, a.shape);
        return emit(OP_RESHAPE, a, {x}) >= 0;
      case OP_CONVERT:
        a.dtype = rng.chance(0.7) ? dtype(src) : (kiln_dtype)rng.below(KILN_DTYPE_COUNT);
        return emit(OP_CONVERT, a, {x}) >= 0;
      case OP_BROADCAST: return gen_broadcast(x);
      case OP_SLICE: return gen_slice(x);
      case OP_REDUCE_SUM:
      case OP_REDUCE_MAX: return gen_reduce(x);
      default: return emit1(d.op, x) >= 0;
    }
  }

  // Every element of a (computable-dtype) constant as a double.
  static std::vector<double> elements(const kiln_tensor *t) {
    kiln_dtype dt = kiln_tensor_dtype(t);
    size_t n = (size_t)kiln_tensor_size(t);
    std::vector<unsigned char> buf(n * kiln_dtype_size(dt) + 8);
    std::vector<double> v(n);
    if (kiln_tensor_read(t, buf.data(), n * kiln_dtype_size(dt))) return {};
    for (size_t i = 0; i < n; i++) {
      switch (dt) {
        case KILN_F32: v[i] = ((const float *)buf.data())[i]; break;
        case KILN_F64: v[i] = ((const double *)buf.data())[i]; break;
        case KILN_I32: v[i] = ((const int32_t *)buf.data())[i]; break;
        case KILN_I64: v[i] = (double)((const int64_t *)buf.data())[i]; break;
        default: v[i] = buf[i]; break;
      }
    }
    return v;
  }

  // An earlier instruction again (cse must merge it), or a near miss that
  // cse must keep apart: the same op on the same operands with one
  // attribute changed, the operands swapped, or a constant with one element
  // changed (0.0 becomes -0.0: equal as numbers, not as bits).
  bool gen_repeat(ir_value) {
    if (f->n_instrs == 0) return false;
    // mostly ops with attributes, where near misses are subtle
    int pick_at = rng.below(f->n_instrs);
    if (rng.chance(0.6)) {
      std::vector<int> attributed;
      for (int i = 0; i < f->n_instrs; i++)
        if (*ir_op_info(f->instrs[i].op)->attrs && f->instrs[i].op != OP_CONVERT) attributed.push_back(i);
      if (!attributed.empty()) pick_at = rng.of(attributed);
    }
    const ir_instr in = f->instrs[pick_at];  // a copy: appending moves f->instrs
    if (ir_op_info(in.op)->kind == OPK_CONTROL || in.n_out != 1) return false; // a region is held once
    bool near = rng.chance(0.5);
    if (in.op == OP_CONSTANT) {
      kiln_tensor *t = in.attrs.value;
      std::vector<double> v = elements(t);
      if (v.empty() && kiln_tensor_size(t) > 0) return false;
      if (near && !v.empty()) {
        size_t k = (size_t)rng.below((int)v.size());
        v[k] = v[k] == 0 && !std::signbit(v[k]) && is_float(kiln_tensor_dtype(t)) ? -0.0 : v[k] == 0 ? 1 : 0;
      }
      Shape s(kiln_tensor_shape(t), kiln_tensor_shape(t) + kiln_tensor_rank(t));
      return constant_from(kiln_tensor_dtype(t), s, [&](int64_t i) { return v[(size_t)i]; }) >= 0;
    }
    op_attrs a = in.attrs;
    std::vector<ir_value> ins(in.in, in.in + in.n_in);
    if (near) {
      switch (ir_op_info(in.op)->kind) {
        case OPK_BINARY:
        case OPK_COMPARE: std::swap(ins[0], ins[1]); break;
        case OPK_SELECT: std::swap(ins[1], ins[2]); break;
        case OPK_MOVE:
          if (in.op == OP_CONCAT) std::reverse(ins.begin(), ins.end());
          break;
        default: break;
      }
      // another attribute with the same result type: a wrong merge of those
      // is silent (one of another type the verifier would catch)
      std::vector<op_type> t;
      for (ir_value v : ins) t.push_back(type(v));
      for (int tries = 0; tries < 12; tries++) {
        op_attrs b = in.attrs;
        switch (in.op) {
          case OP_SLICE: {
            int i = rng.below(std::max(b.rank, 1));
            if (b.rank && b.shape[i] < 0) b.shape[i] = t[0].shape[i] - b.begin[i];
            if (b.rank) b.begin[i] += rng.chance(0.5) ? 1 : -1;
            break;
          }
          case OP_TRANSPOSE: shuffle(b.axes, b.naxes); break;
          case OP_CONCAT:
          case OP_GATHER:
          case OP_ARGMAX: b.axis = rng.below(std::max(t[0].rank, 1)); break;
          case OP_REDUCE_SUM:
          case OP_REDUCE_PROD:
          case OP_REDUCE_MAX:
          case OP_REDUCE_MIN: {
            int all[KILN_MAX_RANK];
            for (int i = 0; i < t[0].rank; i++) all[i] = i;
            shuffle(all, t[0].rank);
            for (int i = 0; i < b.naxes; i++) b.axes[i] = all[i];
            for (int i = 1; i < b.naxes; i++)  // ascending, as reductions want
              for (int j = i; j > 0 && b.axes[j - 1] > b.axes[j]; j--) std::swap(b.axes[j - 1], b.axes[j]);
            if (rng.chance(0.3)) b.keepdims = !b.keepdims;
            break;
          }
          default: tries = 12; continue;
        }
        op_type out{};
        if (ir_check_op(in.op, &b, (int)ins.size(), t.data(), &out)) {
          kiln_clear_error();
          continue;
        }
        const op_type &was = type(in.out);
        bool same = out.dtype == was.dtype && out.rank == was.rank &&
                    std::equal(out.shape, out.shape + out.rank, was.shape);
        // mostly the same type; else another (a wrong merge then breaks the IR)
        if ((same || tries == 11 || rng.chance(0.1)) && std::memcmp(&b, &in.attrs, sizeof b)) {
          a = b;
          break;
        }
      }
    }
    return emit(in.op, a, ins) >= 0;
  }

  // ---- control flow (IR_GEN_CONTROL) ----
  // Each control instruction computes what the flat program would compute
  // from values in range, so the interval rules still hold: a cond's
  // branches are two generated programs over the same captures (its
  // results: the union of both ranges); a loop's body never reads its state
  // (pick does not offer it), so every iteration computes the same values
  // from the captures, and the state after the loop is the initial value
  // (no iteration) or those (the union again); a while counts i up to a
  // constant 0..3, under max_iterations -1 or 2; a scan has 1-3 steps, an
  // xs that is a broadcast of a value (every row that value), and ys.

  // A region named @gen.rN.role: parameters lead (the first n_hide hidden) then the
  // captures caps (values of f, with their ranges), a generated program, and
  // one result of the type of parameter like[k] for each k (a value of the
  // program merged into that parameter, or the parameter); then, for a scan,
  // up to n_ys more results of any type that stacks L deep. Writes each
  // result's range and integrality. nullptr when refused.
  ir_func *region(const std::string &name, const std::vector<op_type> &lead, const std::vector<Range> &lead_r,
                  const std::vector<bool> &lead_int, size_t n_hide, const std::vector<ir_value> &caps,
                  const std::vector<int> &like, int n_ys, int64_t L, std::vector<Range> *out_r,
                  std::vector<bool> *out_int) {
    std::vector<op_type> types = lead;
    for (ir_value c : caps) types.push_back(type(c));
    ir_func *g = ir_func_new(mod, name.c_str(), (int)types.size(), types.data());
    if (!g) {
      broken = true;
      return nullptr;
    }
    Gen sub;
    sub.rng = rng;
    sub.opt = opt;
    sub.palette = palette;
    sub.mod = mod;
    sub.depth = depth + 1;
    sub.n_regions = n_regions;
    sub.f = g;
    if (sub.depth >= 2) sub.opt.kinds &= ~(unsigned)IR_GEN_CONTROL;
    for (size_t i = 0; i < lead.size(); i++) sub.record((ir_value)i, lead_r[i], lead_int[i]);
    for (size_t i = 0; i < caps.size(); i++)
      sub.record((ir_value)(lead.size() + i), range[(size_t)caps[i]], integral[(size_t)caps[i]]);
    sub.hidden.assign(types.size(), false);
    for (size_t i = 0; i < n_hide && i < lead.size(); i++) sub.hidden[i] = true;
    sub.cap = rng.range(1, 6);
    for (int tries = 0; sub.f->n_instrs < sub.cap && !sub.broken && tries < 200; tries++) sub.step();
    sub.cap += 2 * (int)like.size() + 4;  // room for the merges
    std::vector<ir_value> res;
    for (int p : like) {
      std::vector<ir_value> s = sub.sinks();
      ir_value r = p;
      if (!s.empty() && sub.merge(s[0], p)) r = sub.f->n_values - 1;
      if (sub.broken) break;
      res.push_back(r);
    }
    std::vector<ir_value> s = sub.sinks();
    for (ir_value v : s) {
      if ((int)res.size() >= (int)like.size() + n_ys) break;
      const op_type &t = sub.type(v);
      if (t.rank + 1 > kMaxRank || sub.elems(v) * L > kMaxElems) continue;
      res.push_back(v);
    }
    rng = sub.rng;
    if (sub.broken) {
      broken = true;
      return nullptr;
    }
    for (ir_value r : res) {
      out_r->push_back(sub.range[(size_t)r]);
      out_int->push_back(sub.integral[(size_t)r]);
    }
    if (ir_set_results(g, (int)res.size(), res.data())) {
      broken = true;
      return nullptr;
    }
    return g;
  }

  // Appends control instruction op over in with attrs a, recording its
  // results (ranges r, integrality w); false (and the regions made since
  // keep dropped) if refused.
  bool emit_control(op_id op, op_attrs a, const std::vector<ir_value> &in, const std::vector<Range> &r,
                    const std::vector<bool> &w, int keep) {
    if (broken) return false;
    ir_value v = ir_append(f, op, &a, (int)in.size(), in.data(), loc());
    if (v < 0) {
      kiln_clear_error();
      ir_module_truncate(mod, keep);
      return false;
    }
    for (size_t k = 0; k < r.size(); k++) record(v + (ir_value)k, r[k], w[k]);
    for (ir_value x : in) uses[(size_t)x]++;
    return true;
  }

  // a scalar bool: a comparison of a value boiled down to a scalar with 0,
  // or (now and then) a constant
  ir_value predicate() {
    if (rng.chance(0.25)) return constant_from(KILN_BOOL, {}, [&](int64_t) { return rng.chance(0.5) ? 1.0 : 0.0; });
    ir_value x = pick([&](ir_value v) { return is_num(dtype(v)); });
    if (x < 0) return -1;
    if (rank(x) > 0) {
      op_attrs r{};
      r.naxes = rank(x);
      for (int i = 0; i < r.naxes; i++) r.axes[i] = i;
      x = emit(OP_REDUCE_MAX, r, {x});
    }
    ir_value z = x < 0 ? -1 : constant_from(dtype(x), {}, [](int64_t) { return 0.0; });
    return emit2(rng.chance(0.5) ? OP_GT : OP_LE, x, z);
  }

  bool gen_control(ir_value) {
    if (!mod || !room(4) || depth >= 2 || (opt.special_floats && rng.chance(0.5))) return false;
    int keep = mod->n_funcs, id = (*n_regions)++;
    std::string base = std::string(f->name) + ".r" + std::to_string(id);
    std::vector<ir_value> caps;
    for (int n = rng.range(1, 3); (int)caps.size() < n;) {
      ir_value c = pick([&](ir_value v) { return !is_storage(dtype(v)); });
      if (c < 0) return false;
      caps.push_back(c);
    }
    int kind = rng.below(3);
    bool has_bool = allowed(KILN_BOOL);
    kiln_dtype it = allowed(KILN_I32) ? KILN_I32 : KILN_I64;
    if (kind < 2 && (!has_bool || !(allowed(KILN_I32) || allowed(KILN_I64)))) kind = 2;
    if (kind == 0) {  // cond
      ir_value p = predicate();
      if (p < 0 || broken) return false;
      std::vector<int> like;
      for (int n = rng.range(1, 2); (int)like.size() < n;) like.push_back(rng.below((int)caps.size()));
      std::vector<Range> r1, r2;
      std::vector<bool> w1, w2;
      ir_func *th = region(base + ".then", {}, {}, {}, 0, caps, like, 0, 1, &r1, &w1);
      ir_func *el = th ? region(base + ".else", {}, {}, {}, 0, caps, like, 0, 1, &r2, &w2) : nullptr;
      if (!el) return false;
      for (size_t k = 0; k < r1.size(); k++) r1[k] = hull(r1[k], r2[k]), w1[k] = w1[k] && w2[k];
      op_attrs a{};
      a.callee = th;
      a.callee2 = el;
      std::vector<ir_value> in = {p};
      in.insert(in.end(), caps.begin(), caps.end());
      return emit_control(OP_COND, a, in, r1, w1, keep);
    }
    if (kind == 1) {  // while: (i, s...) with s of the captures' types, s never read
      int64_t n = rng.range(0, 3);
      ir_value i0 = constant_from(it, {}, [](int64_t) { return 0.0; });
      if (i0 < 0) return false;
      std::vector<op_type> lead = {type(i0)};
      std::vector<Range> lead_r = {Range{0, (double)n}};
      std::vector<bool> lead_w = {true};
      std::vector<int> like;
      std::vector<ir_value> init = {i0};
      for (int k = rng.range(1, 2); k > 0; k--) {
        int c = rng.below((int)caps.size());
        like.push_back(-1 - c);  // fixed below: the capture's parameter index
        lead.push_back(type(caps[(size_t)c]));
        lead_r.push_back(range[(size_t)caps[(size_t)c]]);
        lead_w.push_back(integral[(size_t)caps[(size_t)c]]);
        init.push_back(caps[(size_t)c]);
      }
      for (int &l : like) l = (int)lead.size() + (-1 - l);
      // the counter goes first in the body: i + 1 (written here, not drawn)
      std::vector<Range> br;
      std::vector<bool> bw;
      ir_func *body = region(base + ".body", lead, lead_r, lead_w, lead.size(), caps, like, 0, 1, &br, &bw);
      if (!body) return false;
      if (!counted(body, it, n)) return false;
      ir_func *cnd = loop_cond(base + ".cond", body, it, n);
      if (!cnd) return false;
      std::vector<Range> r = {Range{0, (double)n}};
      std::vector<bool> w = {true};
      for (size_t k = 0; k < br.size(); k++) r.push_back(hull(br[k], lead_r[k + 1])), w.push_back(bw[k] && lead_w[k + 1]);
      op_attrs a{};
      a.callee = cnd;
      a.callee2 = body;
      a.n_state = (int)init.size();
      a.trip = rng.chance(0.5) ? -1 : 2;
      std::vector<ir_value> in = init;
      in.insert(in.end(), caps.begin(), caps.end());
      return emit_control(OP_WHILE, a, in, r, w, keep);
    }
    // scan: carries of captures' types (never read), an xs, ys
    int64_t L = rng.range(1, 3);
    std::vector<op_type> lead;
    std::vector<Range> lead_r;
    std::vector<bool> lead_w;
    std::vector<ir_value> init, xs;
    std::vector<int> like;
    for (int k = rng.range(0, 1); k > 0; k--) {
      int c = rng.below((int)caps.size());
      like.push_back(c);
      lead.push_back(type(caps[(size_t)c]));
      lead_r.push_back(range[(size_t)caps[(size_t)c]]);
      lead_w.push_back(integral[(size_t)caps[(size_t)c]]);
      init.push_back(caps[(size_t)c]);
    }
    size_t nc = init.size();
    if (rng.chance(0.6)) {  // an xs: a value repeated L times
      ir_value x = pick([&](ir_value v) { return !is_storage(dtype(v)) && rank(v) < kMaxRank; });
      op_attrs b{};
      if (x >= 0) {
        b.rank = rank(x) + 1;
        b.shape[0] = L;
        for (int d = 0; d < rank(x); d++) b.shape[d + 1] = type(x).shape[d];
      }
      ir_value xv = x < 0 ? -1 : emit(OP_BROADCAST, b, {x});
      if (xv >= 0) {
        xs.push_back(xv);
        lead.push_back(type(x));
        lead_r.push_back(range[(size_t)x]);
        lead_w.push_back(integral[(size_t)x]);
      }
    }
    for (int &l : like) l = (int)lead.size() + l;
    std::vector<Range> br;
    std::vector<bool> bw;
    // the carries are hidden from the body, the rows of the xs are not
    ir_func *body = region(base + ".body", lead, lead_r, lead_w, nc, caps, like, rng.range(nc ? 0 : 1, 2), L, &br, &bw);
    if (!body) return false;
    std::vector<Range> r;
    std::vector<bool> w;
    for (size_t k = 0; k < br.size(); k++) {
      r.push_back(k < nc ? hull(br[k], lead_r[k]) : br[k]);
      w.push_back(k < nc ? bw[k] && lead_w[k] : bw[k]);
    }
    op_attrs a{};
    a.callee = body;
    a.n_state = (int)nc;
    a.n_xs = (int)xs.size();
    a.trip = L;
    a.reverse = rng.chance(0.5);
    std::vector<ir_value> in = init;
    in.insert(in.end(), xs.begin(), xs.end());
    in.insert(in.end(), caps.begin(), caps.end());
    return emit_control(OP_SCAN, a, in, r, w, keep);
  }

  // Puts the counter first in body g's results: i + 1 (i is parameter 0).
  bool counted(ir_func *g, kiln_dtype it, int64_t) {
    kiln_tensor *one = nullptr;
    if (it == KILN_I32) {
      int32_t x = 1;
      one = kiln_tensor_new(it, 0, nullptr, &x);
    } else {
      int64_t x = 1;
      one = kiln_tensor_new(it, 0, nullptr, &x);
    }
    ir_value c = one ? ir_constant(g, one, ir_loc{nullptr, 0}) : -1;
    ir_value in[2] = {0, c};
    ir_value i1 = c < 0 ? -1 : ir_append(g, OP_ADD, nullptr, 2, in, ir_loc{nullptr, 0});
    std::vector<ir_value> res = {i1};
    res.insert(res.end(), g->results, g->results + g->n_results);
    if (i1 < 0 || ir_set_results(g, (int)res.size(), res.data())) {
      broken = true;
      return false;
    }
    return true;
  }

  // The cond region of a while whose body is g: i < n.
  ir_func *loop_cond(const std::string &name, const ir_func *g, kiln_dtype it, int64_t n) {
    ir_func *c = ir_func_new(mod, name.c_str(), g->n_params, g->types);
    kiln_tensor *t = nullptr;
    if (it == KILN_I32) {
      int32_t x = (int32_t)n;
      t = kiln_tensor_new(it, 0, nullptr, &x);
    } else {
      int64_t x = n;
      t = kiln_tensor_new(it, 0, nullptr, &x);
    }
    ir_value k = c && t ? ir_constant(c, t, ir_loc{nullptr, 0}) : -1;
    ir_value in[2] = {0, k};
    ir_value p = k < 0 ? -1 : ir_append(c, OP_LT, nullptr, 2, in, ir_loc{nullptr, 0});
    if (p < 0 || ir_set_results(c, 1, &p)) {
      broken = true;
      return nullptr;
    }
    return c;
  }

  bool step() {
    struct Kind {
      unsigned bit;
      int weight;
      bool (Gen::*run)(ir_value);
    };
    static const Kind kinds[] = {
        {IR_GEN_UNARY, 12, &Gen::gen_unary},         {IR_GEN_BINARY, 18, &Gen::gen_binary},
        {IR_GEN_COMPARE, 4, &Gen::gen_compare},      {IR_GEN_SELECT, 4, &Gen::gen_select},
        {IR_GEN_CONVERT, 4, &Gen::gen_convert},      {IR_GEN_BROADCAST, 4, &Gen::gen_broadcast},
        {IR_GEN_RESHAPE, 5, &Gen::gen_reshape},      {IR_GEN_TRANSPOSE, 4, &Gen::gen_transpose},
        {IR_GEN_SLICE, 4, &Gen::gen_slice},          {IR_GEN_CONCAT, 3, &Gen::gen_concat},
        {IR_GEN_REDUCE, 8, &Gen::gen_reduce},        {IR_GEN_ARGMAX, 2, &Gen::gen_argmax},
        {IR_GEN_DOT, 5, &Gen::gen_dot},              {IR_GEN_GATHER, 3, &Gen::gen_gather},
        {IR_GEN_SCATTER, 2, &Gen::gen_scatter},      {IR_GEN_IOTA, 1, &Gen::gen_iota},
        {IR_GEN_CONSTANT, 1, &Gen::gen_constant},    {IR_GEN_IDENTITY, 1, &Gen::gen_identity},
        {IR_GEN_REPEAT, 5, &Gen::gen_repeat},        {IR_GEN_IDIOM, 12, &Gen::gen_idiom},
        {IR_GEN_CONTROL, 12, &Gen::gen_control},      {IR_GEN_WINDOW, 30, &Gen::gen_window},
        {IR_GEN_DENSE, 12, &Gen::gen_dense},         {IR_GEN_NARROW, 40, &Gen::gen_narrow},
        {IR_GEN_COLLECTIVE, 24, &Gen::gen_collective},
    };
    int total = 0;
    for (const Kind &k : kinds)
      if (opt.kinds & k.bit) total += k.weight;
    if (!total) return false;
    int w = rng.below(total);
    for (const Kind &k : kinds) {
      if (!(opt.kinds & k.bit)) continue;
      if (w < k.weight) return (this->*k.run)(-1);
      w -= k.weight;
    }
    return false;
  }

  // ---- the whole function ----

  bool params(ir_module *m) {
    std::vector<kiln_dtype> dts;
    for (kiln_dtype d : {KILN_F32, KILN_F64, KILN_I32, KILN_I64, KILN_BOOL})
      if (allowed(d)) dts.push_back(d);
    kiln_dtype main = rng.of(dts);
    if (rng.chance(0.6))  // mostly float programs: the ops that need the most care
      for (kiln_dtype d : {KILN_F32, KILN_F64})
        if (allowed(d) && rng.chance(0.7)) main = d;
    for (int n = rng.range(2, 3); (int)palette.size() < n;) {
      int64_t d = rng.range(2, 7);
      if (std::find(palette.begin(), palette.end(), d) == palette.end()) palette.push_back(d);
    }
    Shape base = random_shape(4);
    if (base.empty() && rng.chance(0.7)) base.push_back(dim());
    int np = rng.range(1, opt.max_params);
    std::vector<op_type> types((size_t)np);
    std::vector<Range> ranges((size_t)np);
    int idx_param = -1;
    int64_t idx_n = 0;
    bool int_ok = allowed(KILN_I32) || allowed(KILN_I64);
    if (np > 1 && int_ok && rng.chance(0.25)) idx_param = rng.below(np);
    for (int i = 0; i < np; i++) {
      kiln_dtype dt = rng.chance(0.7) ? main : rng.of(dts);
      Shape s = rng.chance(0.3) ? base : rng.chance(0.7) ? partner_shape(base) : random_shape(4);
      if (s.size() > 4) s.erase(s.begin());
      Range r = dt == KILN_BOOL ? Range{0, 1} : is_int(dt) ? Range{-5, 5} : Range{-2, 2};
      if (opt.special_floats && is_float(dt)) r = {-INFINITY, INFINITY};  // ir_gen_special_args
      if (i == idx_param) {  // values in [0, idx_n): usable as indices as they are
        dt = allowed(KILN_I64) && (rng.chance(0.5) || !allowed(KILN_I32)) ? KILN_I64 : KILN_I32;
        s.assign((size_t)rng.range(0, 2), 0);
        for (auto &d : s) d = rng.range(1, 4);
        idx_n = base.empty() ? rng.range(1, 7) : rng.of(base);
        r = {0, (double)idx_n - 1};
      }
      types[(size_t)i].dtype = dt;
      types[(size_t)i].rank = (int)s.size();
      std::copy(s.begin(), s.end(), types[(size_t)i].shape);
      ranges[(size_t)i] = r;
    }
    if (!(f = ir_func_new(m, "gen", np, types.data()))) return false;
    for (int i = 0; i < np; i++) record(i, ranges[(size_t)i], !is_float(types[(size_t)i].dtype));
    if (idx_param >= 0 && ir_set_name(f, idx_param, ("idx" + std::to_string(idx_n)).c_str())) return false;
    return true;
  }

  // For each value, the number of instructions it depends on (itself included).
  std::vector<int> cones() const {
    std::vector<int> cone((size_t)f->n_values, 0);
    std::vector<char> seen((size_t)f->n_values);
    for (ir_value v = f->n_params; v < f->n_values; v++) {
      std::fill(seen.begin(), seen.end(), 0);
      std::vector<ir_value> todo = {v};
      while (!todo.empty()) {
        ir_value u = todo.back();
        todo.pop_back();
        if (seen[u] || u < f->n_params) continue;
        seen[u] = 1;
        cone[v]++;
        const ir_instr &in = f->instrs[f->def[u]];
        todo.insert(todo.end(), in.in, in.in + in.n_in);
      }
    }
    return cone;
  }

  // The values nothing uses (parameters aside), most instructions behind them first.
  std::vector<ir_value> sinks() const {
    std::vector<int> cone = cones();
    std::vector<ir_value> out;
    for (ir_value v = f->n_params; v < f->n_values; v++)
      if (!uses[v]) out.push_back(v);
    std::stable_sort(out.begin(), out.end(), [&](ir_value a, ir_value b) { return cone[a] > cone[b]; });
    return out;
  }

  // Makes b depend on a, so that a's instructions reach a result: b op a
  // when they broadcast, else b op (a boiled down to a scalar of b's dtype).
  bool merge(ir_value a, ir_value b) {
    kiln_dtype dt = dtype(b);
    auto combine = [&](ir_value x) {
      static const std::vector<op_id> num = {OP_ADD, OP_SUB, OP_MUL, OP_MAX, OP_MIN},
                                      boolean = {OP_AND, OP_OR, OP_NE};
      op_id op = rng.of(dt == KILN_BOOL ? boolean : num);
      bool swap = rng.chance(0.5);
      if ((swap ? emit2(op, x, b) : emit2(op, b, x)) >= 0) return true;
      return emit2(OP_MAX, b, x) >= 0;  // within both ranges, so never refused for them
    };
    if (dtype(a) == dt && broadcastable(shape(a), shape(b))) return combine(a);
    ir_value x = a;
    op_attrs c{};
    if (is_storage(dtype(x)) || (dtype(x) == KILN_BOOL && rank(x) > 0)) {  // reductions take numbers
      c.dtype = is_num(dt) ? dt : allowed(KILN_I32) ? KILN_I32 : allowed(KILN_F32) ? KILN_F32 : dt;
      x = emit(OP_CONVERT, c, {x});
    }
    if (x >= 0 && rank(x) > 0) {
      op_attrs r{};
      r.naxes = rank(x);
      for (int i = 0; i < r.naxes; i++) r.axes[i] = i;
      x = emit(rng.chance(0.5) ? OP_REDUCE_MAX : OP_REDUCE_SUM, r, {x});
    }
    if (x >= 0 && dtype(x) != dt) {
      c.dtype = dt;
      x = emit(OP_CONVERT, c, {x});
    }
    return x >= 0 && combine(x);
  }

  // Folds surplus sinks into the others until `want` are left or the budget
  // is spent: most of the program then reaches a result.
  void merge_sinks(int want) {
    std::vector<ir_value> stuck;
    for (int round = 0; round < 4 * cap && !broken && room(1); round++) {
      std::vector<ir_value> s = sinks(), live;
      for (ir_value v : s)
        if (std::find(stuck.begin(), stuck.end(), v) == stuck.end()) live.push_back(v);
      if ((int)s.size() <= want || live.size() < 2) break;
      ir_value a = live.back(), b = live[(size_t)rng.below(std::min(2, (int)live.size() - 1))];
      if (is_storage(dtype(b))) b = live[0] != a && !is_storage(dtype(live[0])) ? live[0] : -1;
      if (b < 0 || !merge(a, b)) stuck.push_back(a);
    }
  }

  bool results(int n) {
    std::vector<ir_value> sinks = this->sinks(), others, out;
    for (ir_value v = f->n_params; v < f->n_values; v++)
      if (uses[v]) others.push_back(v);
    for (int i = 0; i < n; i++) {
      std::vector<ir_value> &from = !sinks.empty() ? sinks : others;
      if (from.empty() || rng.chance(0.04)) {  // a parameter as a result
        out.push_back(rng.below(f->n_params));
      } else if (!out.empty() && rng.chance(0.04)) {  // the same value twice
        out.push_back(rng.of(out));
      } else {
        size_t k = &from == &sinks && rng.chance(0.7) ? 0 : (size_t)rng.below((int)from.size());
        out.push_back(from[k]);
        from.erase(from.begin() + (long)k);
      }
    }
    return ir_set_results(f, (int)out.size(), out.data()) == 0;
  }
};

}  // namespace

extern "C" ir_gen_options ir_gen_default_options(void) {
  ir_gen_options o;
  o.min_instrs = 5;
  o.max_instrs = 40;
  o.max_params = 4;
  o.max_results = 3;
  o.dtypes = DT_BIT(KILN_F32) | DT_BIT(KILN_F64) | DT_BIT(KILN_I32) | DT_BIT(KILN_I64) | DT_BIT(KILN_BOOL);
  o.kinds = IR_GEN_ALL;
  o.special_floats = 0;
  o.world = 1;
  return o;
}

extern "C" ir_module *ir_gen_program(uint64_t seed, const ir_gen_options *opt) {
  ir_gen_options o = opt ? *opt : ir_gen_default_options();
  unsigned compute = DT_BIT(KILN_F32) | DT_BIT(KILN_F64) | DT_BIT(KILN_I32) | DT_BIT(KILN_I64) | DT_BIT(KILN_BOOL);
  if (o.min_instrs < 0 || o.max_instrs < o.min_instrs || o.max_params < 1 || o.max_params > 8 ||
      o.max_results < 1 || o.max_results > 8 || !(o.dtypes & compute) || (o.dtypes & ~DT_ALL) ||
      (o.kinds & ~((unsigned)IR_GEN_ALL | IR_GEN_CONTROL | IR_GEN_WINDOW | IR_GEN_DENSE | IR_GEN_NARROW |
                   IR_GEN_COLLECTIVE)) ||
      o.world < 0 ||
      (o.max_instrs > 0 && !o.kinds)) {
    kiln_fail("ir_gen_program: invalid options");
    return nullptr;
  }
  ir_module *m = ir_module_new();
  if (!m) return nullptr;
  Gen g;
  int n_regions = 0;
  g.rng.s = seed;
  g.opt = o;
  g.mod = m;
  g.n_regions = &n_regions;
  kiln_scope_push();  // owns the constants' tensors until the IR has its references
  bool ok = g.params(m);
  if (ok) {
    // two thirds of the budget for the program, the rest for merging sinks
    int total = g.rng.range(o.min_instrs, o.max_instrs), n_results = g.rng.range(1, o.max_results);
    g.cap = std::max(o.min_instrs, total - total / 3);
    for (int tries = 0; g.f->n_instrs < g.cap && !g.broken && tries < 100 * (o.max_instrs + 1); tries++) g.step();
    g.cap = total;
    g.merge_sinks(n_results);
    // the options left too little to choose from: pad with identities
    for (ir_value v = 0; g.f->n_instrs < o.min_instrs && !g.broken; v = g.f->n_values - 1) {
      op_attrs a{};
      ir_value w = ir_append(g.f, OP_IDENTITY, &a, 1, &v, ir_loc{nullptr, 0});
      if (w < 0) {
        g.broken = true;
        break;
      }
      g.record(w, g.range[(size_t)v], g.integral[(size_t)v]);
      g.uses[(size_t)v]++;
    }
    ok = !g.broken && g.results(n_results);
  }
  kiln_scope_pop();
  if (!ok) {
    ir_module_free(m);
    return nullptr;
  }
  return m;
}

static int make_args(const ir_func *f, uint64_t seed, bool special, kiln_tensor **args) {
  const char *name = special ? "ir_gen_special_args" : "ir_gen_args";
  if (!f || (f->n_params && !args)) return kiln_fail("%s: no function or no args", name);
  Rng rng{seed ^ 0x5eed5eed5eed5eedull};
  std::vector<kiln_tensor *> made;
  kiln_scope_push();  // everything made here, escaped to the caller's scope at the end
  for (int i = 0; i < f->n_params; i++) {
    const op_type &t = f->types[i];
    int64_t n = 1;
    for (int k = 0; k < t.rank; k++) n *= t.shape[k];
    int64_t idx_n = 0;
    const char *name = f->names[i];
    if (name && !strncmp(name, "idx", 3) && name[3]) idx_n = strtoll(name + 3, nullptr, 10);
    // f16/bf16 parameters are drawn as f32 and cast (no public f16 encoder)
    kiln_dtype dt = is_storage(t.dtype) ? KILN_F32 : t.dtype;
    std::vector<unsigned char> buf((size_t)n * kiln_dtype_size(dt) + 8);
    for (int64_t k = 0; k < n; k++) {
      // some floats are exact values: signed zeros, ones and halves are where
      // rewrites like x + 0 -> x or sign/floor/relu show their edge cases
      static const double exact[] = {0.0, -0.0, 0.0, -0.0, 1, -1, 0.5, -0.5, 2, -2};
      static const double wild[] = {NAN, INFINITY, -INFINITY, 1e30, -1e30};
      double real = rng.chance(0.2) ? exact[rng.below(10)] : rng.unit() * 4 - 2;
      if (special && rng.chance(0.1)) real = wild[rng.below(5)];
      switch (dt) {
        case KILN_F32: ((float *)buf.data())[k] = (float)real; break;
        case KILN_F64: ((double *)buf.data())[k] = real; break;
        case KILN_I32:
          ((int32_t *)buf.data())[k] = idx_n > 0 ? rng.below((int)idx_n) : rng.range(-5, 5);
          break;
        case KILN_I64:
          ((int64_t *)buf.data())[k] = idx_n > 0 ? rng.below((int)idx_n) : rng.range(-5, 5);
          break;
        default: buf[(size_t)k] = (unsigned char)rng.below(2); break;
      }
    }
    kiln_tensor *x = kiln_tensor_new(dt, t.rank, t.shape, buf.data());
    if (x && dt != t.dtype) x = kiln_cast(x, t.dtype);
    if (!x) {
      kiln_scope_pop();
      return -1;
    }
    made.push_back(x);
  }
  for (kiln_tensor *x : made) kiln_scope_escape(x);
  kiln_scope_pop();
  for (size_t i = 0; i < made.size(); i++) args[i] = made[i];
  return 0;
}

extern "C" int ir_gen_args(const ir_func *f, uint64_t seed, kiln_tensor **args) {
  return make_args(f, seed, false, args);
}

extern "C" int ir_gen_special_args(const ir_func *f, uint64_t seed, kiln_tensor **args) {
  return make_args(f, seed, true, args);
}
