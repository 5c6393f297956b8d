// may_jump.h — which values of a random program a compiled run may compute
// other than the interpreter by more than rounding, so tests comparing the
// two leave them out: those of a compare, floor, ceil, sign, mod, argmax or
// conversion to an integer of a value summed in another order (a dot, a
// float reduce_sum or reduce_prod, sin/cos/pow/log1p of a float). wide
// (arena_test's programs) also counts exp, log, tanh and sqrt as inexact
// (the vector math's few ulps) and anything computed inside control flow,
// calls, fusions and windows as both inexact and jumped.
#pragma once

#include <vector>

#include "ir.h"

inline std::vector<bool> may_jump(const ir_func *f, bool wide) {
  std::vector<bool> inexact((size_t)f->n_values, false), jumped((size_t)f->n_values, false);
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr &in = f->instrs[i];
    bool x = false, j = false;
    for (int k = 0; k < in.n_in; k++) x = x || inexact[(size_t)in.in[k]], j = j || jumped[(size_t)in.in[k]];
    kiln_dtype dt = in.n_in ? f->types[in.in[0]].dtype : KILN_I32;
    bool fl = dt == KILN_F32 || dt == KILN_F64;
    switch (in.op) {
      case OP_FLOOR: case OP_CEIL: case OP_SIGN: case OP_MOD: case OP_ARGMAX: case OP_EQ: case OP_NE:
      case OP_LT: case OP_LE: case OP_GT: case OP_GE: j = j || x; break;
      case OP_CONVERT: {
        kiln_dtype to = f->types[in.out].dtype;
        if (to != KILN_F32 && to != KILN_F64) j = j || x;
        break;
      }
      case OP_DOT: case OP_REDUCE_SUM: case OP_REDUCE_PROD: case OP_SIN: case OP_COS: case OP_POW: case OP_LOG1P:
        x = x || fl;
        break;
      case OP_EXP: case OP_LOG: case OP_TANH: case OP_SQRT:
        if (wide) x = x || fl;
        break;
      default: {
        op_kind kind = ir_op_info(in.op)->kind;
        if (wide && (kind == OPK_CONTROL || kind == OPK_CALL || kind == OPK_WINDOW)) x = x || fl, j = j || fl;
        break;
      }
    }
    for (int k = 0; k < in.n_out; k++) inexact[(size_t)in.out + k] = x, jumped[(size_t)in.out + k] = j;
  }
  return jumped;
}
