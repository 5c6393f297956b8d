/* rt.h — the contract between the objects kiln-aot writes and libkiln_rt:
 * the program record each object holds as a constant (its entry function,
 * the data it embeds, how each output is made, its runtime helpers) and the
 * runtime's functions its code calls. backends/cpu/aot.c writes the record
 * as LLVM constants of these layouts (and checks them against this file);
 * rt/run.c reads it. A record of another version or layout is refused. */
#ifndef KILN_RT_H
#define KILN_RT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KILN_RT_MAGIC 0x314e524bu /* "KRN1" */
#define KILN_RT_VERSION 1

/* How output r is made: written by the entry (own), or copied after it
 * from parameter index (an input, or data embedded in the object), from
 * embedded data (a constant result), or from an earlier output. */
enum { KILN_RT_RES_OWN, KILN_RT_RES_PARAM, KILN_RT_RES_CONST, KILN_RT_RES_SAME };

typedef struct kiln_rt_result_rec {
  int32_t kind, index;
  uint64_t bytes;
  const void *data; /* KILN_RT_RES_CONST's bytes */
} kiln_rt_result_rec;

/* A runtime helper: an eager kernel over buffers (lib/raw_call.h). */
typedef struct kiln_rt_helper_rec {
  int32_t op, n_in, n_out, epilogue;
  int32_t trans_a, trans_b;
  const void *attrs; /* an op_attrs of this build's layout, its pointers NULL */
  const void *types; /* n_in, then n_out op_types */
} kiln_rt_helper_rec;

typedef struct kiln_rt_program_rec {
  uint32_t magic, version;
  uint32_t attrs_size, type_size, op_count; /* sizeof(op_attrs), sizeof(op_type), OP_COUNT */
  int32_t n_in, n_out, n_params, n_helpers, n_kernels;
  uint64_t arena_bytes;
  const char *name; /* the C name: messages begin with "<name>_run: " */
  /* the plan's entry: params are the inputs, then the embedded data */
  int32_t (*entry)(void **params, void **results, void *arena, void *call);
  const void *const *data; /* parameters n_in .. n_params-1 (captured tensors, variables' values) */
  const kiln_rt_result_rec *results; /* n_out */
  const kiln_rt_helper_rec *helpers; /* n_helpers */
  const int32_t *kernel_fail_op; /* per kernel: the op whose check can fail it */
} kiln_rt_program_rec;

/* What the code passes back to the runtime (as cpu_call in the JIT): the
 * error flag kernels raise, at offset 0, and the program. */
typedef struct kiln_rt_call {
  int32_t err;
  int32_t failed_kernel;
  const kiln_rt_program_rec *prog;
} kiln_rt_call;

/* NAME_run's body: checks the buffers, takes an arena, runs the entry and
 * copies the outputs it does not write. 0, or -1 with kiln_rt_last_error(). */
int kiln_rt_run(const kiln_rt_program_rec *p, const void *const *inputs, void *const *outputs);
/* what the generated code calls, as the JIT's symbols of those names */
void kiln_rt_parallel_for(int64_t n, int64_t grain, void (*fn)(void *, int64_t, int64_t), void *ctx);
int32_t kiln_rt_helper(kiln_rt_call *call, int32_t helper, void **bufs);
void kiln_rt_kernel_fail(kiln_rt_call *call, int32_t kernel);
/* The calling thread's last error message ("" when none). */
const char *kiln_rt_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
