// fusion_cases.h — fusion groups led by a dot or a conv2d with an
// elementwise epilogue (what the CUDA backend runs as the head's kernel
// and ONE fused kernel after it), as .kir text: @k the body, @f a function
// that is that one fusion (or, with as_call, the same body as a call: the
// op-by-op inlining a fusion got before). Four kinds: conv2d + bias +
// relu, conv2d + bias + residual + relu, dot + bias + tanh, and a dot with
// a longer tail (an SGD-like update); f32 or f64, the bias broadcast
// implicitly ([n] or [1, n]) or by a broadcast instruction, small random
// shapes (batched dots too). Shared by cuda_fusion_test (fake driver,
// ptxas, the host run) and cuda_gpu_test (a real GPU).
#ifndef KILN_CUDA_FUSION_CASES_H
#define KILN_CUDA_FUSION_CASES_H

#include <random>
#include <string>
#include <vector>

#include "ir.h"

namespace kiln_test {

enum FusionKind { kConvBiasRelu, kConvBiasResidualRelu, kDotBiasTanh, kDotTail, kFusionKinds };

inline const char *const kFusionKindNames[] = {"conv2d+bias+relu", "conv2d+bias+residual+relu", "dot+bias+tanh",
                                               "dot+tail"};

struct FusionCase {
  FusionKind kind;
  std::string body;  // func @k
  std::string fn;    // func @f(params of @k) -> the fusion's result
  std::string call;  // @f with `call @k` for `fusion @k`
  int epilogue_ops;  // the body's instructions after its head that are a kernel when alone
};

inline std::string fusion_dims(const std::vector<int64_t> &s) {
  std::string r = "[";
  for (size_t d = 0; d < s.size(); d++) r += (d ? "," : "") + std::to_string(s[d]);
  return r + "]";
}

// The case of kind from seed; f64 forces that dtype (else drawn).
inline FusionCase fusion_case(FusionKind kind, uint64_t seed, int f64 = -1) {
  std::mt19937_64 rng(seed);
  auto in = [&](int lo, int hi) { return (int64_t)lo + (int64_t)(rng() % (uint64_t)(hi - lo + 1)); };
  std::string dt = (f64 < 0 ? rng() % 3 == 0 : f64 != 0) ? "f64" : "f32";
  auto ty = [&](const std::vector<int64_t> &s) { return dt + fusion_dims(s); };
  std::vector<std::string> params;  // "%name: type"
  std::string code;
  std::vector<int64_t> out;
  int ops = 0;
  auto line = [&](const std::string &s, bool kernel = true) {
    code += "  " + s + "\n";
    ops += kernel;
  };
  if (kind == kConvBiasRelu || kind == kConvBiasResidualRelu) {
    int64_t n = in(1, 2), h = in(3, 7), w = in(3, 7), c = in(1, 4), o = in(1, 6), k = in(1, 3);
    int64_t s = in(1, 2), p = k > 1 ? in(0, 1) : 0;
    out = {n, (h + 2 * p - k) / s + 1, (w + 2 * p - k) / s + 1, o};
    params = {"%x: " + ty({n, h, w, c}), "%w: " + ty({k, k, c, o})};
    std::string S = std::to_string(s), P = std::to_string(p);
    code += "  %h = conv2d %x, %w {stride=[" + S + "," + S + "], dilation=[1,1], padding=[" + P + "," + P + "," + P +
            "," + P + "], groups=1} : " + ty(out) + "\n";
  } else {
    bool batched = rng() % 3 == 0;
    int64_t b = in(2, 3), m = in(1, 9), kk = in(1, 40), nn = in(1, 12);
    out = batched ? std::vector<int64_t>{b, m, nn} : std::vector<int64_t>{m, nn};
    params = {"%a: " + ty(batched ? std::vector<int64_t>{b, m, kk} : std::vector<int64_t>{m, kk}),
              "%b: " + ty({kk, nn})};
    code += "  %h = dot %a, %b : " + ty(out) + "\n";
  }
  // the bias over the last axis
  int64_t last = out.back();
  int form = (int)(rng() % 3);
  std::string bias = "%bias";
  if (form == 1) {
    params.push_back("%bias: " + ty({1, last}));
  } else {
    params.push_back("%bias: " + ty({last}));
    if (form == 2) line("%bb = broadcast %bias {shape=" + fusion_dims(out) + "} : " + ty(out)), bias = "%bb";
  }
  line("%0 = add %h, " + bias + " : " + ty(out));
  std::string last_v = "%0";
  if (kind == kConvBiasResidualRelu) {
    params.push_back("%res: " + ty(out));
    line("%1 = add %0, %res : " + ty(out));
    last_v = "%1";
  }
  if (kind == kConvBiasRelu || kind == kConvBiasResidualRelu) {
    line("%r = relu " + last_v + " : " + ty(out));
    last_v = "%r";
  } else if (kind == kDotBiasTanh) {
    line("%r = tanh %0 : " + ty(out));
    last_v = "%r";
  } else {  // p - lr * tanh(h + bias) * (h + bias), then a max with p / 2 and an exp of its negative square
    params.push_back("%p: " + ty(out));
    params.push_back("%lr: " + dt + "[]");
    line("%lrb = broadcast %lr {shape=" + fusion_dims(out) + "} : " + ty(out));
    line("%1 = tanh %0 : " + ty(out));
    line("%2 = mul %1, %0 : " + ty(out));
    line("%3 = mul %2, %lrb : " + ty(out));
    line("%4 = sub %p, %3 : " + ty(out));
    line("%half = constant dense<0.5> : " + dt + "[]", false);
    line("%5 = mul %p, %half : " + ty(out));
    line("%6 = max %4, %5 : " + ty(out));
    line("%7 = mul %6, %6 : " + ty(out));
    line("%8 = neg %7 : " + ty(out));
    line("%r = exp %8 : " + ty(out));
    last_v = "%r";
  }
  std::string sig, args;
  for (size_t i = 0; i < params.size(); i++) {
    sig += (i ? ", " : "") + params[i];
    args += (i ? ", " : "") + params[i].substr(0, params[i].find(':'));
  }
  FusionCase c;
  c.kind = kind;
  c.body = "func @k(" + sig + ") -> " + ty(out) + " {\n" + code + "  return " + last_v + "\n}\n";
  std::string head = "func @f(" + sig + ") -> " + ty(out) + " {\n  %y = ";
  std::string tail = " @k(" + args + ") : " + ty(out) + "\n  return %y\n}\n";
  c.fn = c.body + head + "fusion" + tail;
  c.call = c.body + head + "call" + tail;
  c.epilogue_ops = ops;
  return c;
}

}  // namespace kiln_test

#endif
