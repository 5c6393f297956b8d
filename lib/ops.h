/* ops.h — the op table (ir/ops.def expanded), op attributes, shape/dtype
 * inference rules and the eager dispatcher. Internal. */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#include "runtime.h"

typedef enum {
#define KILN_OP(ID, name, api, arity, kind, dtypes, attrs, infer) OP_##ID,
#include "ops.def"
#undef KILN_OP
  OP_COUNT
} op_id;

typedef enum {
  OPK_UNARY,   /* elementwise, one input, same type out */
  OPK_BINARY,  /* elementwise, broadcasting, same dtype out */
  OPK_COMPARE, /* elementwise, broadcasting, bool out */
  OPK_SELECT,  /* elementwise, three inputs */
  OPK_CONVERT, /* elementwise dtype change */
  OPK_VIEW,    /* same data, new header (identity, reshape) */
  OPK_MOVE,    /* data movement (broadcast, transpose, slice, concat) */
  OPK_REDUCE,  /* reductions and argmax */
  OPK_DOT,     /* batched matmul */
  OPK_INDEX,   /* gather, scatter_add */
  OPK_WINDOW,  /* convolutions, pooling and their gradients: pure, never fused; CPU: a call of the eager kernel */
  OPK_SOURCE,  /* no inputs */
  OPK_RANDOM,  /* no inputs, draws from the generator: never folded or CSE'd */
  OPK_CONST,   /* IR only: a literal tensor (attrs.value); never run eagerly */
  OPK_CALL,    /* IR only: runs attrs.callee, a function of the module (call, fusion); n results */
  OPK_HOST,    /* IR only: a C callback (attrs.host); never folded, CSE'd or removed */
  OPK_CONTROL, /* IR only: cond, while, scan: run the regions attrs.callee / callee2 */
  OPK_COLLECTIVE, /* talks to the world's other processes (API.md §12): never folded, CSE'd, removed,
                   * duplicated, hoisted or reordered with another collective */
} op_kind;

/* dtype masks, by kiln_dtype bit */
#define DT_BIT(d) (1u << (d))
#define DT_FLOAT (DT_BIT(KILN_F32) | DT_BIT(KILN_F64))
#define DT_INT (DT_BIT(KILN_I32) | DT_BIT(KILN_I64))
#define DT_BOOL DT_BIT(KILN_BOOL)
#define DT_NUM (DT_FLOAT | DT_INT)
#define DT_NUMB (DT_NUM | DT_BOOL)
#define DT_ALL 0x7fu

/* Every attribute any op has; each op reads the fields ops.def names. */
typedef struct op_attrs {
  int rank;                      /* shape: reshape/broadcast/source/scatter_add result; slice size */
  int64_t shape[KILN_MAX_RANK];
  int64_t begin[KILN_MAX_RANK];  /* slice start */
  int naxes;                     /* reduce axes (normalised, ascending); transpose perm */
  int axes[KILN_MAX_RANK];
  int axis;                      /* concat, argmax, gather, scatter_add (normalised) */
  bool keepdims;
  kiln_dtype dtype;              /* convert, iota, rng */
  double lo, hi;                 /* rng_uniform range */
  uint64_t seed, counter;        /* rng: generator key and first Philox block */
  kiln_tensor *value;            /* constant (IR only): the IR holds a reference */
  bool stateful;                 /* rng: draw (seed, counter) from the global stream at run time */
  struct ir_func *callee;        /* call, fusion (IR only): a function of the same module */
  struct ir_host *host;          /* host_call (IR only): the callback, owned by the module */
  /* control flow (IR only): callee and callee2 are the regions (cond: then,
   * else; while: cond, body; scan: body), functions of the same module */
  struct ir_func *callee2;
  int n_state;                   /* while: state values; scan: carries (the other operands are captures) */
  int n_xs;                      /* scan: the sequences sliced along axis 0 */
  int64_t trip;                  /* scan: its length; while: max_iterations (-1 = unbounded) */
  bool reverse;                  /* scan: from the end */
  /* windows (conv2d, pooling, their gradients), explicit and >= 1 (padding >= 0) */
  int stride[2];                 /* rows, columns */
  int dilation[2];               /* conv: rows, columns */
  int padding[4];                /* top, bottom, left, right */
  int groups;                    /* conv: input and output channels split into this many groups */
  int window[2];                 /* pooling: rows, columns */
  /* collectives (API.md §12) */
  int reduce;                    /* all_reduce, reduce_scatter: a dist_op (sum, mean, max, min) */
  int root;                      /* broadcast_from: the rank whose value everyone gets */
  int world;                     /* the world size the instruction was traced for (result shapes depend on it) */
} op_attrs;

/* The static type of a value: what inference computes. */
typedef struct op_type {
  kiln_dtype dtype;
  int rank;
  int64_t shape[KILN_MAX_RANK];
} op_type;

/* The type of a tensor. */
static inline void op_type_of(const kiln_tensor *t, op_type *ty) {
  ty->dtype = (kiln_dtype)t->dtype;
  ty->rank = t->rank;
  for (int i = 0; i < t->rank; i++) ty->shape[i] = t->shape[i];
}

/* Is t of type ty? */
static inline bool op_type_is(const kiln_tensor *t, const op_type *ty) {
  if (t->dtype != ty->dtype || t->rank != ty->rank) return false;
  for (int i = 0; i < t->rank; i++)
    if (t->shape[i] != ty->shape[i]) return false;
  return true;
}

/* Writes *out or sets an error that starts with the op's name; 0 / -1. */
typedef int (*infer_fn)(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out);

typedef struct op_info {
  const char *name; /* IR spelling */
  const char *api;  /* public name, the prefix of error messages */
  int arity;
  op_kind kind;
  unsigned dtypes;
  const char *attrs;
  infer_fn infer;
} op_info;

extern const op_info kiln_ops[OP_COUNT];

#define KILN_OP(ID, name, api, arity, kind, dtypes, attrs, infer)                     \
  int infer(op_id op, const op_attrs *a, int n, const op_type *in, op_type *out);
#include "ops.def"
#undef KILN_OP

/* ---- the dispatcher (dispatch.c) ---- */
typedef struct op_call {
  op_id op;
  const op_attrs *attrs;
  int n;
  kiln_tensor *const *in; /* on the kernel's device, dtypes and shapes checked */
  kiln_tensor *out;       /* allocated with the inferred type; data uninitialised */
} op_call;

/* A kernel fills c->out; returns 0, or -1 with the error set (index errors). */
typedef int (*kernel_fn)(const op_call *c);

#define KILN_MAX_DEVICES 16
extern kernel_fn kiln_kernels[OP_COUNT][KILN_MAX_DEVICES][KILN_DTYPE_COUNT];

/* Registers a kernel for (op, device, key dtype); called from constructors. */
void dispatch_register(op_id op, int device, kiln_dtype dt, kernel_fn fn);
/* The dtype that selects an op's kernel: value inputs' for select, the
 * result's for sources, the first input's otherwise. */
static inline kiln_dtype dispatch_key(op_id op, int n, kiln_tensor *const *in, kiln_dtype out) {
  if (n == 0) return out;
  return op == OP_SELECT ? (kiln_dtype)in[1]->dtype : (kiln_dtype)in[0]->dtype;
}

/* ---- the eager front end (ops.c) ---- */
/* Runs one primitive: checks inputs (NULL, devices), infers the result,
 * hands symbolic inputs to the tracer, else dispatches a kernel, records it
 * on active tapes, and gives the result to the innermost scope. */
kiln_tensor *op_apply(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in);
static inline kiln_tensor *op_apply1(op_id op, const op_attrs *a, kiln_tensor *x) {
  return op_apply(op, a, 1, &x);
}
static inline kiln_tensor *op_apply2(op_id op, const op_attrs *a, kiln_tensor *x, kiln_tensor *y) {
  kiln_tensor *in[2] = {x, y};
  return op_apply(op, a, 2, in);
}
/* op_apply on a remote device (dist_remote.c): the op runs on the worker,
 * inputs from elsewhere sent as host data; the result of type ty stays there. */
kiln_tensor *remote_apply(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in, const op_type *ty,
                          int device);
/* Normalises axis into [0, rank) or fails naming op; returns 0 / -1. */
int axis_normalize(const char *op, int axis, int rank, int *out);

/* ---- broadcasting helpers for kernels (broadcast.c) ---- */
/* Element strides of an input of shape (rank, shape) read as out_rank dims,
 * aligned right, 0 where broadcast. */
void broadcast_strides(int rank, const int64_t *shape, int out_rank, const int64_t *out_shape,
                       int64_t *strides);

#endif
