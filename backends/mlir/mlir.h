/* mlir.h — Kiln IR as MLIR text (API.md §11): func, arith, math, linalg,
 * tensor and scf dialects on tensors, for mlir-opt and the toolchains built
 * on MLIR. The text computes what the reference interpreter (ir/interp.c)
 * computes, op for op; what MLIR cannot express (random ops, host
 * callbacks) is an error naming the op, never approximate text. Internal to
 * the library; the entry points are exported for kiln-opt and the tests. */
#ifndef KILN_MLIR_H
#define KILN_MLIR_H

#include "ir.h"

#ifdef __cplusplus
extern "C" {
#endif

/* f as a func.func, followed by the functions it calls or fuses (each once);
 * its control-flow regions become scf.if, scf.while and scf.for.
 * malloc'd text, or NULL with "mlir: @f: %v: op: reason" in the error. */
KILN_EXPORT char *mlir_emit_func(const ir_func *f);
/* Every function of m that no other calls, fuses or holds as a region,
 * with its callees: what kiln-opt --emit=mlir prints. */
KILN_EXPORT char *mlir_emit_module(const ir_module *m);

#ifdef __cplusplus
}
#endif
#endif
