/* raw_call.c — an eager kernel over raw buffers: each buffer gets a tensor
 * header of its type on the stack, and the op's kernel (or the matmul and
 * convolution entry points that take an epilogue) runs on them. Random
 * draws marked stateful take this call's block of the global stream. */
#include <stdlib.h>

#include "conv.h"
#include "matmul.h"
#include "raw_call.h"

/* a header for a raw buffer of type t: what a kernel reads of a tensor */
void raw_call_header(kiln_tensor *h, const op_type *t, void *data) {
  memset(h, 0, sizeof *h); /* serial 0: no cache keeps what it derives from the buffer */
  atomic_init(&h->refs, 1);
  h->dtype = (uint8_t)t->dtype;
  h->rank = (int8_t)t->rank;
  h->size = 1;
  for (int k = 0; k < t->rank; k++) h->size *= h->shape[k] = t->shape[k];
  h->data = data;
}

int raw_call_run(const raw_call *c, void **bufs) {
  enum { SMALL = 8 };
  kiln_tensor small_h[SMALL], *small_in[SMALL], out;
  kiln_tensor *hdr = c->n_in <= SMALL ? small_h : malloc((size_t)c->n_in * sizeof *hdr);
  kiln_tensor **in = c->n_in <= SMALL ? small_in : malloc((size_t)c->n_in * sizeof *in);
  if (!hdr || !in) {
    if (hdr != small_h) free(hdr);
    if (in != small_in) free(in);
    return kiln_set_error("%s: out of memory", kiln_ops[c->op].api);
  }
  for (int k = 0; k < c->n_in; k++) {
    raw_call_header(&hdr[k], &c->in_types[k], bufs[c->n_out + k]);
    if (c->serials) hdr[k].serial = c->serials[k];
    in[k] = &hdr[k];
  }
  raw_call_header(&out, c->out_type, bufs[0]);
  op_attrs a = *c->attrs;
  if (kiln_ops[c->op].kind == OPK_RANDOM && a.stateful) /* this call's block of the global stream */
    a.counter = rng_reserve(((uint64_t)out.size + 1) / 2, &a.seed);
  kernel_fn fn = kiln_kernels[c->op][0][dispatch_key(c->op, c->n_in, in, c->out_type->dtype)];
  int rc;
  if (c->trans_a || c->trans_b) {
    rc = matmul_trans(in[0], in[1], c->trans_a, c->trans_b, &out);
  } else if (c->epilogue && c->op == OP_CONV2D) {
    in[2]->shape[0] = in[2]->size, in[2]->rank = 1; /* the bias: [o] or [1, 1, 1, o] */
    rc = c->n_in == 4 ? conv2d_epilogue_residual(in[0], in[1], in[2], (gemm_epilogue)c->epilogue, in[3], &a, &out)
                      : conv2d_epilogue(in[0], in[1], in[2], (gemm_epilogue)c->epilogue, &a, &out);
  } else if (c->epilogue) {
    rc = matmul_epilogue(in[0], in[1], in[2], (gemm_epilogue)c->epilogue, &out);
  } else if (!fn) {
    rc = kiln_set_error("%s: no CPU kernel for %s", kiln_ops[c->op].api,
                        kiln_dtype_name(dispatch_key(c->op, c->n_in, in, c->out_type->dtype)));
  } else {
    op_call oc = {c->op, &a, c->n_in, in, &out};
    rc = fn(&oc);
  }
  if (hdr != small_h) free(hdr);
  if (in != small_in) free(in);
  return rc;
}
