/* buffers.h — what the buffers pass (passes/buffers.c) reports about the
 * arena plan it records on a function (ir_func.buf_offset), for the JIT's
 * statistics, kiln-opt and the tests. Internal; exported for the tests. */
#ifndef KILN_PASS_BUFFERS_H
#define KILN_PASS_BUFFERS_H

#include "passes.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pass_buffer_stats {
  int64_t peak_bytes;     /* the arena: what the plan needs */
  int64_t unshared_bytes; /* every temporary in a buffer of its own */
  int64_t lower_bound;    /* the most bytes live at one step of the schedule: no plan needs less */
  int kernels;            /* steps of the schedule: fusions and unfused instructions, constants not counted */
  int temporaries;        /* values in the arena */
  int in_place;           /* temporaries written over an operand that dies at their kernel */
} pass_buffer_stats;

/* The figures of f's plan (every size rounded up to IR_BUF_ALIGN). 0, or -1
 * with the error set when f has no plan. */
KILN_EXPORT int pass_buffer_stats_of(const ir_func *f, pass_buffer_stats *out);

/* Is f the body of a kernel (the callee of a fusion of its module)? Bodies
 * are neither fused again nor given an arena: their values live in
 * registers. (fuse.c) */
KILN_EXPORT bool pass_is_kernel_body(const ir_func *f);

#ifdef __cplusplus
}
#endif
#endif
