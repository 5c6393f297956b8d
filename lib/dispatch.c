/* dispatch.c — the eager dispatcher's table: (op, device, dtype) -> kernel.
 * Kernel files fill it from constructors at load time; the hot path is
 * one indexed load. */
#include "ops.h"

kernel_fn kiln_kernels[OP_COUNT][KILN_MAX_DEVICES][KILN_DTYPE_COUNT];

void dispatch_register(op_id op, int device, kiln_dtype dt, kernel_fn fn) {
  kiln_kernels[op][device][dt] = fn;
}
