// may_jump.h — which values of a random program a compiled run (or MLIR's
// own pipeline) may compute other than the interpreter by more than
// rounding, so tests comparing the two leave them out. A float summed in
// another order (a dot, a float reduce_sum or reduce_prod, sin/cos/pow/log1p)
// is inexact; a compare, floor, ceil, sign, mod, argmax or conversion to an
// integer of an inexact value may jump, and so may everything computed from
// it. Rules add more inexact ops and say what regions (cond, while, scan,
// calls) do: followed with their operands' flags (loops to a fixed point; a
// while whose condition may jump may run another number of times), or
// taken as opaque (every float they compute both inexact and jumped).
#pragma once

#include <vector>

#include "ir.h"

struct JumpRules {
  bool vector_math = false;  // exp, log, tanh, sqrt inexact (Kiln's vector math: a few ulps)
  bool libm = false;         // exp, log, tanh, sigmoid inexact (libm's, as MLIR calls them)
  bool windows = false;      // convolutions and pools inexact (another summation order)
  bool opaque = false;       // control flow, calls, fusions and windows: inexact and jumped
};

struct JumpFlags {
  std::vector<bool> inexact, jumped;
};

inline void region_jump_flags(const ir_func *g, const std::vector<bool> &x, const std::vector<bool> &j,
                              const JumpRules &rules, JumpFlags *out);

// Sets the flags of in's results in fl from those of its operands.
inline void instr_jump_flags(const ir_func *f, const ir_instr &in, const JumpRules &rules, JumpFlags &fl) {
  bool x = false, j = false;
  std::vector<bool> ix, ij;
  for (int k = 0; k < in.n_in; k++) {
    x = x || fl.inexact[(size_t)in.in[k]], j = j || fl.jumped[(size_t)in.in[k]];
    ix.push_back(fl.inexact[(size_t)in.in[k]]), ij.push_back(fl.jumped[(size_t)in.in[k]]);
  }
  kiln_dtype dt = in.n_in ? f->types[in.in[0]].dtype : in.n_out ? f->types[in.out].dtype : KILN_I32;
  bool flt = dt == KILN_F32 || dt == KILN_F64;
  op_kind kind = ir_op_info(in.op)->kind;
  bool region = kind == OPK_CONTROL || kind == OPK_CALL;
  std::vector<bool> rx((size_t)in.n_out, false), rj((size_t)in.n_out, false);
  if (rules.opaque && (region || kind == OPK_WINDOW)) {
    rx.assign((size_t)in.n_out, x || flt), rj.assign((size_t)in.n_out, j || flt);
  } else if (kind == OPK_CALL) {
    JumpFlags r;
    region_jump_flags(in.attrs.callee, ix, ij, rules, &r);
    rx = r.inexact, rj = r.jumped;
  } else if (in.op == OP_COND) {
    std::vector<bool> px(ix.begin() + 1, ix.end()), pj(ij.begin() + 1, ij.end());
    JumpFlags a, b;
    region_jump_flags(in.attrs.callee, px, pj, rules, &a);
    region_jump_flags(in.attrs.callee2, px, pj, rules, &b);
    for (int k = 0; k < in.n_out; k++)
      rx[(size_t)k] = a.inexact[(size_t)k] || b.inexact[(size_t)k],
      rj[(size_t)k] = a.jumped[(size_t)k] || b.jumped[(size_t)k] || ij[0] || ix[0];
  } else if (kind == OPK_CONTROL) {  // while, scan: the carried state to a fixed point
    JumpFlags r;
    const ir_func *body = in.op == OP_WHILE ? in.attrs.callee2 : in.attrs.callee;
    int ns = in.attrs.n_state;
    for (int it = 0; it < 8; it++) {
      bool changed = false;
      region_jump_flags(body, ix, ij, rules, &r);
      for (int k = 0; k < ns; k++) {
        bool nx = ix[(size_t)k] || r.inexact[(size_t)k], nj = ij[(size_t)k] || r.jumped[(size_t)k];
        changed = changed || nx != ix[(size_t)k] || nj != ij[(size_t)k];
        ix[(size_t)k] = nx, ij[(size_t)k] = nj;
      }
      if (!changed) break;
    }
    bool trips = false;  // a while whose condition may jump
    if (in.op == OP_WHILE) {
      JumpFlags c;
      region_jump_flags(in.attrs.callee, ix, ij, rules, &c);
      trips = c.jumped[0] || c.inexact[0];
    } else {
      region_jump_flags(body, ix, ij, rules, &r);
    }
    for (int k = 0; k < in.n_out; k++) {
      bool carried = k < ns;
      rx[(size_t)k] = carried ? ix[(size_t)k] : r.inexact[(size_t)k];
      rj[(size_t)k] = (carried ? ij[(size_t)k] : r.jumped[(size_t)k]) || trips;
    }
  } else {
    switch (in.op) {
      case OP_FLOOR: case OP_CEIL: case OP_SIGN: case OP_MOD: case OP_ARGMAX: case OP_EQ: case OP_NE:
      case OP_LT: case OP_LE: case OP_GT: case OP_GE: j = j || x; break;
      case OP_CONVERT: {
        kiln_dtype to = f->types[in.out].dtype;
        if (to != KILN_F32 && to != KILN_F64) j = j || x;
        break;
      }
      case OP_DOT: case OP_REDUCE_SUM: case OP_REDUCE_PROD: case OP_SIN: case OP_COS: case OP_POW: case OP_LOG1P:
        x = x || flt;
        break;
      case OP_EXP: case OP_LOG: case OP_TANH:
        if (rules.vector_math || rules.libm) x = x || flt;
        break;
      case OP_SQRT:
        if (rules.vector_math) x = x || flt;
        break;
      case OP_SIGMOID:
        if (rules.libm) x = x || flt;
        break;
      default:
        if (kind == OPK_WINDOW && rules.windows) x = x || flt;
        break;
    }
    rx.assign((size_t)in.n_out, x), rj.assign((size_t)in.n_out, j);
  }
  for (int k = 0; k < in.n_out; k++)
    fl.inexact[(size_t)in.out + k] = rx[(size_t)k], fl.jumped[(size_t)in.out + k] = rj[(size_t)k];
}

// g's results' flags given its parameters'
inline void region_jump_flags(const ir_func *g, const std::vector<bool> &x, const std::vector<bool> &j,
                              const JumpRules &rules, JumpFlags *out) {
  JumpFlags fl{std::vector<bool>((size_t)g->n_values, false), std::vector<bool>((size_t)g->n_values, false)};
  for (int i = 0; i < g->n_params && i < (int)x.size(); i++)
    fl.inexact[(size_t)i] = x[(size_t)i], fl.jumped[(size_t)i] = j[(size_t)i];
  for (int i = 0; i < g->n_instrs; i++) instr_jump_flags(g, g->instrs[i], rules, fl);
  out->inexact.clear(), out->jumped.clear();
  for (int r = 0; r < g->n_results; r++)
    out->inexact.push_back(fl.inexact[(size_t)g->results[r]]), out->jumped.push_back(fl.jumped[(size_t)g->results[r]]);
}

// Every value of f that may jump, its parameters exact.
inline std::vector<bool> may_jump(const ir_func *f, const JumpRules &rules) {
  JumpFlags fl{std::vector<bool>((size_t)f->n_values, false), std::vector<bool>((size_t)f->n_values, false)};
  for (int i = 0; i < f->n_instrs; i++) instr_jump_flags(f, f->instrs[i], rules, fl);
  return fl.jumped;
}

// Kiln's compiled code against its interpreter. wide (arena_test's
// programs) also counts exp, log, tanh and sqrt as inexact and anything
// computed inside control flow, calls, fusions and windows as both inexact
// and jumped.
inline std::vector<bool> may_jump(const ir_func *f, bool wide) {
  JumpRules rules;
  rules.vector_math = rules.opaque = wide;
  return may_jump(f, rules);
}
