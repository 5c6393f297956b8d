// window_cases.h — random cases of the window ops (conv2d, its two
// gradients, max and average pooling and theirs) for the CUDA tests: small
// NHWC images and HWIO filters with random strides, dilations, explicit
// padding and groups (one, several, depthwise), their inputs random (or,
// for pooling, small integers so that windows hold ties, sometimes a NaN),
// and the CPU kernel's result (lib/kernels_conv.c) as the reference.
#ifndef KILN_WINDOW_CASES_H
#define KILN_WINDOW_CASES_H

#include <kiln.h>

#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "ir.h"

namespace kiln_test {

struct WinCase {
  op_id op = OP_CONV2D;
  op_attrs a{};
  std::vector<kiln_tensor *> in;  // owned by the caller's scope
  op_type out{};                  // as the op table infers it
  std::string what;               // op, dtype, shapes and attributes, for messages
};

inline const op_id kWindowOps[] = {OP_CONV2D,     OP_CONV2D_BP_INPUT, OP_CONV2D_BP_FILTER, OP_MAX_POOL2D,
                                   OP_AVG_POOL2D, OP_MAX_POOL2D_GRAD, OP_AVG_POOL2D_GRAD};

inline std::string shape_str(const V64 &s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); i++) r += (i ? "," : "") + std::to_string(s[i]);
  return r + "]";
}

// random values of dt and shape: uniform in [-1, 1), or small integers (ties)
// with a NaN now and then
inline kiln_tensor *window_input(std::mt19937 &rng, kiln_dtype dt, const V64 &shape, bool ties) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  VD v((size_t)n);
  std::uniform_real_distribution<double> u(-1, 1);
  for (double &x : v) {
    x = ties ? (double)(int)(rng() % 4) - 1 : u(rng);
    if (ties && rng() % 97 == 0) x = kNan;
  }
  return from_values(dt, shape, v);
}

// the output length of a window k (dilation d) over n padded p0 + p1, stride s
inline int64_t window_out(int64_t n, int64_t k, int d, int p0, int p1, int s) {
  int64_t span = (k - 1) * d + 1;
  return n + p0 + p1 < span ? 0 : (n + p0 + p1 - span) / s + 1;
}

// A random case of op in dt with its inputs (released by the enclosing
// Scoped); big: images up to 24 x 24 and 16 channels (else up to 9 x 9, 6).
inline WinCase random_window_case(std::mt19937 &rng, op_id op, kiln_dtype dt, bool big = false) {
  auto r = [&](int lo, int hi) { return lo + (int)(rng() % (unsigned)(hi - lo + 1)); };
  bool conv = op == OP_CONV2D || op == OP_CONV2D_BP_INPUT || op == OP_CONV2D_BP_FILTER;
  for (;;) {
    WinCase c;
    c.op = op;
    op_attrs &a = c.a;
    int64_t n = r(1, 2), h = r(1, big ? 24 : 9), w = r(1, big ? 24 : 9), kh = r(1, 3), kw = r(1, 3);
    a.stride[0] = r(1, 3), a.stride[1] = r(1, 3);
    int64_t c_in, o;
    if (conv) {
      a.dilation[0] = r(1, 2), a.dilation[1] = r(1, 2);
      for (int i = 0; i < 4; i++) a.padding[i] = r(0, 2);
      int kind = r(0, 2);  // one group, several, depthwise
      // a third of the groups' output channels in fours (the kernels' 4-wide path)
      bool fours = rng() % 3 == 0;
      if (kind == 0) {
        a.groups = 1, c_in = r(1, big ? 16 : 5), o = fours ? 4 * r(1, 2) : r(1, big ? 16 : 6);
      } else if (kind == 1) {
        a.groups = r(2, 3), c_in = a.groups * r(1, 3), o = a.groups * (fours ? 4 : r(1, 3));
      } else {
        c_in = r(2, big ? 16 : 5), a.groups = (int)c_in, o = c_in * (fours ? 4 : r(1, 2));
      }
    } else {
      a.window[0] = (int)kh, a.window[1] = (int)kw;
      a.padding[0] = r(0, (int)kh - 1), a.padding[1] = r(0, (int)kh - 1);
      a.padding[2] = r(0, (int)kw - 1), a.padding[3] = r(0, (int)kw - 1);
      c_in = o = r(1, big ? 16 : 5);
    }
    int dh = conv ? a.dilation[0] : 1, dw = conv ? a.dilation[1] : 1;
    int64_t oh = window_out(h, kh, dh, a.padding[0], a.padding[1], a.stride[0]);
    int64_t ow = window_out(w, kw, dw, a.padding[2], a.padding[3], a.stride[1]);
    if (oh < 1 || ow < 1) continue;
    V64 xs = {n, h, w, c_in}, ys = {n, oh, ow, o}, fs = {kh, kw, conv ? c_in / a.groups : 0, o};
    bool ties = !conv && rng() % 2;
    auto set_shape = [&](const V64 &s) {
      a.rank = (int)s.size();
      for (size_t i = 0; i < s.size(); i++) a.shape[i] = s[i];
    };
    switch (op) {
      case OP_CONV2D: c.in = {window_input(rng, dt, xs, false), window_input(rng, dt, fs, false)}; break;
      case OP_CONV2D_BP_INPUT:
        set_shape(xs);
        c.in = {window_input(rng, dt, ys, false), window_input(rng, dt, fs, false)};
        break;
      case OP_CONV2D_BP_FILTER:
        set_shape(fs);
        c.in = {window_input(rng, dt, xs, false), window_input(rng, dt, ys, false)};
        break;
      case OP_MAX_POOL2D:
      case OP_AVG_POOL2D: c.in = {window_input(rng, dt, xs, ties)}; break;
      case OP_MAX_POOL2D_GRAD: c.in = {window_input(rng, dt, xs, ties), window_input(rng, dt, ys, false)}; break;
      default:
        set_shape(xs);
        c.in = {window_input(rng, dt, ys, false)};
        break;
    }
    std::vector<op_type> ts;
    for (kiln_tensor *t : c.in) {
      op_type t1{};
      V64 s = shape_of(t);
      t1.dtype = kiln_tensor_dtype(t), t1.rank = (int)s.size();
      for (size_t d = 0; d < s.size(); d++) t1.shape[d] = s[d];
      ts.push_back(t1);
    }
    if (ir_op_info(op)->infer(op, &a, (int)ts.size(), ts.data(), &c.out)) {
      ADD_FAILURE() << ir_op_info(op)->name << ": the case's inference failed: " << kiln_last_error();
      return c;
    }
    c.what = std::string(ir_op_info(op)->name) + " " + kiln_dtype_name(dt);
    for (kiln_tensor *t : c.in) c.what += " " + shape_str(shape_of(t));
    c.what += " stride " + std::to_string(a.stride[0]) + "," + std::to_string(a.stride[1]);
    if (conv)
      c.what += " dilation " + std::to_string(a.dilation[0]) + "," + std::to_string(a.dilation[1]) + " groups " +
                std::to_string(a.groups);
    else
      c.what += " window " + std::to_string(a.window[0]) + "," + std::to_string(a.window[1]);
    c.what += " padding " + std::to_string(a.padding[0]) + "," + std::to_string(a.padding[1]) + "," +
              std::to_string(a.padding[2]) + "," + std::to_string(a.padding[3]);
    return c;
  }
}

// c's op as a one-instruction function of m over parameters of its inputs'
// types (NULL with the error on failure)
inline ir_func *window_func(ir_module *m, const WinCase &c) {
  std::vector<op_type> ts;
  std::vector<ir_value> vs;
  for (kiln_tensor *t : c.in) {
    op_type t1{};
    V64 sh = shape_of(t);
    t1.dtype = kiln_tensor_dtype(t), t1.rank = (int)sh.size();
    for (size_t d = 0; d < sh.size(); d++) t1.shape[d] = sh[d];
    ts.push_back(t1);
    vs.push_back((ir_value)vs.size());
  }
  ir_func *f = ir_func_new(m, "w", (int)ts.size(), ts.data());
  ir_value v = f ? ir_append(f, c.op, &c.a, (int)vs.size(), vs.data(), ir_loc{nullptr, 0}) : -1;
  return v >= 0 && ir_set_results(f, 1, &v) == 0 ? f : nullptr;
}

// The CPU's result of c (the interpreter runs the eager CPU kernel, in
// lib/kernels_conv.c): a new tensor of the enclosing Scoped, NULL with the
// error on failure.
inline kiln_tensor *window_cpu(const WinCase &c) {
  ir_module *m = ir_module_new();
  ir_func *f = m ? window_func(m, c) : nullptr;
  kiln_tensor *out = nullptr;
  if (f && ir_interpret(f, c.in.data(), &out)) out = nullptr;
  ir_module_free(m);
  return out;
}

}  // namespace kiln_test

#endif
