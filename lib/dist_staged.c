/* dist_staged.c — the collectives as IR instructions (ops.def's
 * all_reduce, all_gather, reduce_scatter, broadcast_from). While tracing,
 * the public collectives record them on symbolic tensors; the interpreter
 * and the CPU backend's runtime helpers run them through this file's CPU
 * kernel, which is the eager call's checks, header exchange and data
 * movement (dist_run_into) on the instruction's buffers. Their gradient
 * rule is the eager adjoint (dist_gradients.c). */
#include "dist.h"
#include "raw_call.h"

dist_kind dist_kind_of(op_id op) {
  switch (op) {
  case OP_ALL_REDUCE: return DIST_ALL_REDUCE;
  case OP_ALL_GATHER: return DIST_ALL_GATHER;
  case OP_REDUCE_SCATTER: return DIST_REDUCE_SCATTER;
  case OP_BROADCAST_FROM: return DIST_BROADCAST;
  default: return (dist_kind)0;
  }
}

static const op_id ops_of[] = {
    [DIST_ALL_REDUCE] = OP_ALL_REDUCE,
    [DIST_ALL_GATHER] = OP_ALL_GATHER,
    [DIST_REDUCE_SCATTER] = OP_REDUCE_SCATTER,
    [DIST_BROADCAST] = OP_BROADCAST_FROM,
};

kiln_tensor *dist_stage(const char *who, dist_kind kind, const char *op, int64_t arg, kiln_tensor *t) {
  if (dist_join(who)) return NULL;
  op_attrs a = {.world = dist_world_size()};
  if (kind == DIST_ALL_REDUCE || kind == DIST_REDUCE_SCATTER) {
    if ((a.reduce = dist_op_parse(who, op)) < 0) return NULL;
  }
  if (kind == DIST_ALL_GATHER || kind == DIST_REDUCE_SCATTER) {
    if (t->rank == 0) {
      kiln_set_error("%s: a scalar has no axis to %s along (reshape it to (1,) first)", who,
                     kind == DIST_ALL_GATHER ? "gather" : "scatter");
      return NULL;
    }
    if (arg < INT32_MIN || arg > INT32_MAX || axis_normalize(who, (int)arg, t->rank, &a.axis)) {
      if (!kiln_has_error()) kiln_set_error("%s: axis %lld is out of range", who, (long long)arg);
      return NULL;
    }
  }
  if (kind == DIST_BROADCAST) a.root = arg < 0 || arg > INT32_MAX ? -1 : (int)arg;
  return op_apply(ops_of[kind], &a, 1, &t);
}

/* The CPU kernel: c->in[0] and c->out on the host, c->out of the result type. */
static int collective_kernel(const op_call *c) {
  const op_attrs *a = c->attrs;
  dist_kind kind = dist_kind_of(c->op);
  int op = kind == DIST_ALL_REDUCE || kind == DIST_REDUCE_SCATTER ? a->reduce : -1;
  int64_t arg = kind == DIST_BROADCAST ? a->root : a->axis;
  return dist_run_into(kiln_ops[c->op].api, kind, op, arg, a->world, c->in[0], c->out);
}

int dist_staged_start(op_id op, const op_attrs *a, const op_type *in_type, const op_type *out_type, void *in,
                      void *out, dist_job **job) {
  kiln_tensor hin, hout;
  raw_call_header(&hin, in_type, in);
  raw_call_header(&hout, out_type, out);
  dist_kind kind = dist_kind_of(op);
  int rop = kind == DIST_ALL_REDUCE || kind == DIST_REDUCE_SCATTER ? a->reduce : -1;
  int64_t arg = kind == DIST_BROADCAST ? a->root : a->axis;
  return dist_async_start(kiln_ops[op].api, kind, rop, arg, a->world, &hin, &hout, job);
}

KILN_CONSTRUCTOR static void register_kernels(void) {
  for (int dt = 0; dt < KILN_DTYPE_COUNT; dt++)
    for (int k = DIST_ALL_REDUCE; k <= DIST_BROADCAST; k++)
      dispatch_register(ops_of[k], 0, (kiln_dtype)dt, collective_kernel);
}
