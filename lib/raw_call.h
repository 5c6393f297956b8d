/* raw_call.h — one eager kernel run over raw buffers instead of tensors:
 * what compiled code's runtime helpers do (the CPU backend's JIT, and the
 * AOT runtime libkiln_rt). Internal. */
#ifndef KILN_RAW_CALL_H
#define KILN_RAW_CALL_H

#include "ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An op over buffers of fixed types: a dot (maybe with its epilogue, or
 * reading transposed operands in place), gather, scatter_add, concat,
 * argmax, iota, a random draw, a convolution or pooling. Not host calls. */
typedef struct raw_call {
  op_id op;
  const op_attrs *attrs;
  int n_in, n_out;
  const op_type *in_types; /* n_in */
  const op_type *out_type; /* the first output's (the others, if any, are the kernel's to know) */
  int epilogue;            /* a gemm_epilogue of lib/matmul.h; 0 = a plain op */
  bool trans_a, trans_b;   /* a dot's operands as they lay before transposes (matmul_trans) */
  const uint64_t *serials; /* NULL, or n_in: the serial of the tensor whose data each input is, 0 for
                              none (caches key on it: conv_cache.c) */
} raw_call;

/* a header for a raw buffer of type t: what a kernel reads of a tensor */
void raw_call_header(kiln_tensor *h, const op_type *t, void *data);

/* Runs c with bufs = {outputs..., inputs...}. 0, or -1 with the error set (an
 * index out of range, out of memory). */
KILN_EXPORT int raw_call_run(const raw_call *c, void **bufs);

#ifdef __cplusplus
}
#endif
#endif
