// scan_cases.h — random scans whose bodies are elementwise (what the CUDA
// backend runs as one kernel looping over t on the device,
// backends/cuda/ptx_scan.c), as .kir text of a function that is that one
// scan: 1-3 carries, 0-2 xs, 0-2 ys, forward or reversed, rows of 1 to 300
// elements, a body of up to 9 random elementwise ops over the carries, the
// rows and two captures (a scalar and a row broadcast along the leading
// axes) and a constant. Shared by cuda_scan_test (fake driver, ptxas, the
// element code on the host) and cuda_gpu_test (a real GPU).
#ifndef KILN_CUDA_SCAN_CASES_H
#define KILN_CUDA_SCAN_CASES_H

#include <kiln.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "../test_util.h"
#include "ir.h"

namespace kiln_test {

struct ScanCase {
  std::string text;  // func @f
  kiln_dtype dt;
  std::vector<int64_t> row;
  int64_t T;
  int nc, nx, ny;
  bool reverse;
};

inline std::string scan_shape(const std::vector<int64_t> &s) {
  std::string r = "[";
  for (size_t d = 0; d < s.size(); d++) r += (d ? "," : "") + std::to_string(s[d]);
  return r + "]";
}

inline ScanCase scan_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto below = [&](int n) { return (int)(rng() % (uint64_t)n); };
  ScanCase c;
  int d = below(20);
  c.dt = d < 12 ? KILN_F32 : d < 17 ? KILN_F64 : KILN_I32;
  const std::vector<std::vector<int64_t>> rows = {{1}, {4}, {2, 3}, {3, 5}, {37}, {300}, {2, 2, 2}};
  c.row = rows[(size_t)below((int)rows.size())];
  const int64_t Ts[] = {1, 2, 3, 5, 7, 16};
  c.T = Ts[below(6)];
  c.nc = 1 + below(3), c.nx = below(3), c.ny = below(3);
  c.reverse = below(2);
  bool fl = c.dt != KILN_I32;
  std::string dn = c.dt == KILN_F32 ? "f32" : c.dt == KILN_F64 ? "f64" : "i32";
  std::string rt = dn + scan_shape(c.row), st = dn + "[" + std::to_string(c.T) + (c.row.empty() ? "" : ",") +
                                                   scan_shape(c.row).substr(1);
  std::string vt = dn + "[" + std::to_string(c.row.back()) + "]";
  // the body
  std::vector<std::string> vary, fixed = {"%w", "%v", "%k"};
  std::string params, body;
  for (int k = 0; k < c.nc; k++) params += (k ? ", " : "") + ("%c" + std::to_string(k)) + ": " + rt, vary.push_back("%c" + std::to_string(k));
  for (int k = 0; k < c.nx; k++) params += ", %x" + std::to_string(k) + ": " + rt, vary.push_back("%x" + std::to_string(k));
  params += ", %w: " + dn + "[], %v: " + vt;
  body += "      %k = constant dense<" + std::string(fl ? "0.5" : "2") + "> : " + dn + "[]\n";
  int n_ops = 1 + below(9);
  for (int i = 0; i < n_ops; i++) {
    std::string name = "%t" + std::to_string(i), a = vary[(size_t)below((int)vary.size())];
    std::string b = below(2) ? vary[(size_t)below((int)vary.size())] : fixed[(size_t)below(3)];
    int op = below(fl ? 9 : 6);
    if (!fl && op == 4) op = 7;  // no products of integers: they would overflow over the steps
    const char *bin[] = {"add", "sub", "max", "min", "mul"};
    if (op < 4 || (op == 4 && fl)) {  // a binary op, the row-shaped operand first or second
      bool swap = below(2);
      body += "      " + name + " = " + bin[op] + " " + (swap ? b : a) + ", " + (swap ? a : b) + " : " + rt + "\n";
    } else if (op == 5) {  // select on a comparison
      std::string cmp = name + "p", other = below(2) ? vary[(size_t)below((int)vary.size())] : fixed[(size_t)below(3)];
      body += "      " + cmp + " = gt " + a + ", " + b + " : bool" + scan_shape(c.row) + "\n";
      body += "      " + name + " = select " + cmp + ", " + a + ", " + other + " : " + rt + "\n";
    } else if (op == 6) {
      body += "      " + name + " = tanh " + a + " : " + rt + "\n";
    } else if (op == 7) {
      body += "      " + name + " = neg " + a + " : " + rt + "\n";
    } else {  // a * 0.5 + b: values stay small over many steps
      body += "      " + name + "h = mul " + a + ", %k : " + rt + "\n";
      body += "      " + name + " = add " + name + "h, " + b + " : " + rt + "\n";
    }
    vary.push_back(name);
  }
  if (!fl) body += "      %lo = constant dense<-50> : i32[]\n      %hi = constant dense<50> : i32[]\n";
  std::string results, rtypes;
  for (int k = 0; k < c.nc + c.ny; k++) {
    // the newest values more often than the parameters
    size_t pick = below(3) ? vary.size() - 1 - (size_t)below((int)std::min<size_t>(vary.size(), 3)) : (size_t)below((int)vary.size());
    std::string r = vary[pick];
    if (k < c.nc && pick >= (size_t)(c.nc + c.nx)) {  // a new carry stays in range: tanh, or clamped to [-50, 50]
      std::string o = "%o" + std::to_string(k);
      if (fl) {
        body += "      " + o + " = tanh " + r + " : " + rt + "\n";
      } else {
        body += "      " + o + "m = max " + r + ", %lo : " + rt + "\n";
        body += "      " + o + " = min " + o + "m, %hi : " + rt + "\n";
      }
      r = o;
    }
    results += (k ? ", " : "") + r;
    rtypes += (k ? ", " : "") + rt;
  }
  // the function: the scan of its parameters
  std::string fparams, operands, outs, otypes;
  for (int k = 0; k < c.nc; k++) {
    fparams += (k ? ", " : "") + ("%i" + std::to_string(k)) + ": " + rt;
    operands += (k ? ", " : "") + ("%i" + std::to_string(k));
  }
  for (int k = 0; k < c.nx; k++) fparams += ", %xs" + std::to_string(k) + ": " + st, operands += ", %xs" + std::to_string(k);
  fparams += ", %w: " + dn + "[], %v: " + vt;
  operands += ", %w, %v";
  for (int k = 0; k < c.nc + c.ny; k++) {
    outs += (k ? ", " : "") + ("%r" + std::to_string(k));
    otypes += (k ? ", " : "") + (k < c.nc ? rt : st);
  }
  bool one = c.nc + c.ny == 1;
  c.text = "func @f(" + fparams + ") -> " + (one ? otypes : "(" + otypes + ")") + " {\n  " + outs + " = scan " +
           operands + " {carry=" + std::to_string(c.nc) + ", xs=" + std::to_string(c.nx) +
           ", length=" + std::to_string(c.T) + ", reverse=" + (c.reverse ? "true" : "false") + "} : " + otypes +
           "\n    body func @f.body(" + params + ") -> " + (one ? rtypes : "(" + rtypes + ")") + " {\n" + body +
           "      return " + results + "\n    }\n  return " + outs + "\n}\n";
  return c;
}

// Arguments for f (CPU tensors of its parameters' types): floats in
// [-1, 1], integers in [-4, 4].
inline std::vector<kiln_tensor *> scan_args(const ir_func *f, uint64_t seed) {
  std::mt19937_64 rng(seed * 7919 + 1);
  std::vector<kiln_tensor *> a;
  for (int p = 0; p < f->n_params; p++) {
    const op_type &t = f->types[p];
    int64_t n = 1;
    std::vector<int64_t> shape(t.shape, t.shape + t.rank);
    for (int64_t x : shape) n *= x;
    std::vector<double> v((size_t)n);
    for (double &x : v)
      x = t.dtype == KILN_I32 ? (double)((int)(rng() % 9) - 4) : (double)(rng() % 2001) / 1000.0 - 1.0;
    a.push_back(from_values(t.dtype, shape, v));
  }
  return a;
}

}  // namespace kiln_test

#endif
