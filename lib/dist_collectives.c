/* dist_collectives.c — the eager collectives of API.md §12 on tensors:
 * what each computes, checked the same way on every rank, then handed to
 * the transport (dist_mpi.c) as host bytes in a wire dtype. f16 and bf16
 * reduce in f32 and round once, so every rank rounds the same f32 and holds
 * the same bits. */
#include <stdlib.h>

#include "autodiff.h"
#include "dist.h"

static const char *const op_names[] = {"sum", "mean", "max", "min"};

int dist_op_parse(const char *who, const char *op) {
  for (int i = 0; op && i < 4; i++)
    if (!strcmp(op, op_names[i])) return i;
  return kiln_set_error("%s: op %s%s%s is not \"sum\", \"mean\", \"max\" or \"min\"", who, op ? "\"" : "",
                        op ? op : "NULL", op ? "\"" : "");
}

const char *dist_op_name(dist_op op) { return op >= DIST_SUM && op <= DIST_MIN ? op_names[op] : "(none)"; }

kiln_dtype dist_wire_dtype(kiln_dtype dt, dist_op op) {
  if (dt == KILN_F16 || dt == KILN_BF16) return KILN_F32;
  return dt == KILN_I32 && op == DIST_MEAN ? KILN_I64 : dt;
}

void dist_convert(kiln_dtype from, const void *src, kiln_dtype to, void *dst, int64_t n) {
  if (from == to) {
    if (n) memcpy(dst, src, (size_t)n * kiln_dtype_sizes[from]);
  } else if (from == KILN_I32) {
    for (int64_t i = 0; i < n; i++) ((int64_t *)dst)[i] = ((const int32_t *)src)[i];
  } else if (to == KILN_I32) {
    for (int64_t i = 0; i < n; i++) ((int32_t *)dst)[i] = (int32_t)((const int64_t *)src)[i];
  } else if (from == KILN_F16) {
    for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = kiln_f16_to_f32(((const uint16_t *)src)[i]);
  } else if (from == KILN_BF16) {
    for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = kiln_bf16_to_f32(((const uint16_t *)src)[i]);
  } else if (to == KILN_F16) {
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = kiln_f32_to_f16(((const float *)src)[i]);
  } else {
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = kiln_f32_to_bf16(((const float *)src)[i]);
  }
}

void dist_divide(kiln_dtype wire, void *buf, int64_t n, int size) {
  switch (wire) {
  case KILN_F32:
    for (int64_t i = 0; i < n; i++) ((float *)buf)[i] /= (float)size;
    break;
  case KILN_F64:
    for (int64_t i = 0; i < n; i++) ((double *)buf)[i] /= size;
    break;
  case KILN_I32:
    for (int64_t i = 0; i < n; i++) ((int32_t *)buf)[i] /= size;
    break;
  case KILN_I64:
    for (int64_t i = 0; i < n; i++) ((int64_t *)buf)[i] /= size;
    break;
  default:
    break;
  }
}

kiln_tensor *dist_host(const char *who, kiln_tensor *t) {
  return t->device == 0 ? kiln_retain(t) : tensor_to_device(who, t, 0);
}

void dist_describe(dist_header *h, dist_kind kind, int op, const kiln_tensor *t, int64_t arg) {
  memset(h, 0, sizeof *h);
  h->kind = kind;
  h->op = op;
  h->dtype = t ? t->dtype : -1;
  h->rank = t ? t->rank : -1;
  for (int i = 0; t && i < t->rank; i++) h->shape[i] = t->shape[i];
  h->arg = arg;
}

/* ---- one collective: check, agree, move, record ---- */

typedef struct {
  const char *who;
  dist_kind kind;
  int op;      /* dist_op, -1 for gather and broadcast */
  int64_t arg; /* the normalised axis, or the root */
  kiln_tensor *in, *host, *out;
  int64_t outer, inner; /* all_gather / reduce_scatter: elements before the axis, and per rank from it on */
} call;

/* The checks every rank makes on its own arguments; sets the error. */
static int check_args(call *c, const char *op, int size) {
  kiln_tensor *t = c->in;
  if (!t) return kiln_has_error() ? -1 : kiln_set_error("%s: t is NULL", c->who);
  if (c->kind == DIST_ALL_REDUCE || c->kind == DIST_REDUCE_SCATTER) {
    if ((c->op = dist_op_parse(c->who, op)) < 0) return -1;
    if (t->dtype == KILN_BOOL && (c->op == DIST_SUM || c->op == DIST_MEAN))
      return kiln_set_error("%s: \"%s\" of a bool tensor (cast it to a number first; \"max\" and \"min\" are "
                            "or and and)", c->who, op);
  }
  if (c->kind == DIST_BROADCAST) {
    if (c->arg < 0 || c->arg >= size)
      return kiln_set_error("%s: root %lld is not a rank of this world of %d process%s", c->who,
                            (long long)c->arg, size, size == 1 ? "" : "es");
    return 0;
  }
  if (c->kind == DIST_ALL_GATHER || c->kind == DIST_REDUCE_SCATTER) {
    if (t->rank == 0)
      return kiln_set_error("%s: a scalar has no axis to %s along (reshape it to (1,) first)", c->who,
                            c->kind == DIST_ALL_GATHER ? "gather" : "scatter");
    int axis;
    if (axis_normalize(c->who, (int)c->arg, t->rank, &axis)) return -1;
    c->arg = axis;
    c->outer = 1;
    c->inner = 1;
    for (int i = 0; i < t->rank; i++) *(i < axis ? &c->outer : &c->inner) *= t->shape[i];
    if (c->kind == DIST_REDUCE_SCATTER) {
      if (t->shape[axis] % size) {
        char s[160];
        return kiln_set_error("%s: axis %d of shape %s is not divisible into %d equal blocks", c->who, axis,
                              shape_str(s, sizeof s, t->rank, t->shape), size);
      }
      c->inner /= size;
    }
  }
  return 0;
}

static int move_all_reduce(call *c) {
  kiln_tensor *t = c->host;
  kiln_dtype dt = (kiln_dtype)t->dtype, wire = dist_wire_dtype(dt, (dist_op)c->op);
  int64_t n = t->size;
  dist_op op = c->op == DIST_MEAN ? DIST_SUM : (dist_op)c->op;
  if (wire == dt) { /* straight from t into the result */
    int rc = dist_allreduce(c->who, t->data, c->out->data, n, wire, op);
    if (!rc && c->op == DIST_MEAN) dist_divide(wire, c->out->data, n, dist_world_size());
    return rc;
  }
  void *buf = malloc((size_t)n * kiln_dtype_sizes[wire] + 1);
  if (!buf) return kiln_set_error("%s: out of memory", c->who);
  dist_convert(dt, t->data, wire, buf, n);
  int rc = dist_allreduce(c->who, buf, buf, n, wire, op);
  if (!rc && c->op == DIST_MEAN) dist_divide(wire, buf, n, dist_world_size());
  if (!rc) dist_convert(wire, buf, dt, c->out->data, n);
  free(buf);
  return rc;
}

/* all_gather along axis: the ranks' blocks arrive rank-major ([size, outer,
 * inner]) and are interleaved into [outer, size, inner] unless the axis is
 * the outermost one that is not 1 */
static int move_all_gather(call *c) {
  kiln_tensor *t = c->host;
  size_t esize = kiln_dtype_sizes[t->dtype], block = (size_t)c->inner * esize, bytes = tensor_bytes(t);
  int size = dist_world_size();
  if (c->outer == 1) return dist_allgather(c->who, t->data, c->out->data, bytes);
  char *tmp = malloc(bytes * (size_t)size + 1);
  if (!tmp) return kiln_set_error("%s: out of memory", c->who);
  int rc = dist_allgather(c->who, t->data, tmp, bytes);
  for (int64_t o = 0; !rc && o < c->outer; o++)
    for (int r = 0; r < size; r++)
      memcpy((char *)c->out->data + ((size_t)o * (size_t)size + (size_t)r) * block,
             tmp + (size_t)r * bytes + (size_t)o * block, block);
  free(tmp);
  return rc;
}

/* reduce_scatter along axis: the blocks laid out rank-major for the wire,
 * in the wire dtype; rank r receives block r reduced */
static int move_reduce_scatter(call *c) {
  kiln_tensor *t = c->host;
  kiln_dtype dt = (kiln_dtype)t->dtype, wire = dist_wire_dtype(dt, (dist_op)c->op);
  int size = dist_world_size();
  int64_t n = t->size, mine = n / size;
  size_t ws = kiln_dtype_sizes[wire], es = kiln_dtype_sizes[dt];
  char *send = NULL, *recv = c->out->data;
  int rc = -1;
  if (!(send = malloc((size_t)n * ws + 1)) || (wire != dt && !(recv = malloc((size_t)mine * ws + 1)))) {
    kiln_set_error("%s: out of memory", c->who);
    goto done;
  }
  for (int64_t o = 0; o < c->outer; o++)
    for (int r = 0; r < size; r++)
      dist_convert(dt, (const char *)t->data + ((size_t)o * (size_t)size + (size_t)r) * (size_t)c->inner * es, wire,
                   send + ((size_t)r * (size_t)c->outer + (size_t)o) * (size_t)c->inner * ws, c->inner);
  rc = dist_reduce_scatter(c->who, send, recv, mine, wire, c->op == DIST_MEAN ? DIST_SUM : (dist_op)c->op);
  if (!rc && c->op == DIST_MEAN) dist_divide(wire, recv, mine, size);
  if (!rc && recv != c->out->data) dist_convert(wire, recv, dt, c->out->data, mine);
done:
  free(send);
  if (recv != c->out->data) free(recv);
  return rc;
}

static int move_broadcast(call *c) {
  size_t bytes = tensor_bytes(c->host);
  if (bytes && c->out->data != c->host->data) memcpy(c->out->data, c->host->data, bytes);
  return dist_broadcast(c->who, c->out->data, bytes, (int)c->arg);
}

static int move(call *c) {
  kiln_tensor *t = c->host;
  int64_t shape[KILN_MAX_RANK];
  memcpy(shape, t->shape, sizeof shape);
  int size = dist_world_size();
  if (c->kind == DIST_ALL_GATHER) shape[c->arg] *= size;
  if (c->kind == DIST_REDUCE_SCATTER) shape[c->arg] /= size;
  if (!c->out && !(c->out = tensor_alloc(c->who, (kiln_dtype)t->dtype, t->rank, shape))) return -1;
  switch (c->kind) {
  case DIST_ALL_REDUCE: return move_all_reduce(c);
  case DIST_ALL_GATHER: return move_all_gather(c);
  case DIST_REDUCE_SCATTER: return move_reduce_scatter(c);
  default: return move_broadcast(c);
  }
}

/* Every rank reaches the header exchange, whatever its arguments, so that
 * one rank's bad call fails the others at once instead of leaving them
 * waiting for it. */
static kiln_tensor *collective(const char *who, dist_kind kind, const char *op, int64_t arg, kiln_tensor *t) {
  if (t && (t->flags & TF_SYMBOLIC)) return dist_stage(who, kind, op, arg, t); /* an IR instruction */
  if (dist_join(who)) return NULL;
  call c = {.who = who, .kind = kind, .op = -1, .arg = arg, .in = t};
  bool ok = check_args(&c, op, dist_world_size()) == 0;
  dist_header h;
  dist_describe(&h, kind, c.op, ok ? t : NULL, c.arg);
  dist_lock();
  int rc = dist_agree(who, &h, ok);
  if (!rc) rc = (c.host = dist_host(who, t)) ? move(&c) : -1;
  dist_unlock();
  kiln_release(c.host);
  if (!rc && t->device != 0) {
    kiln_tensor *there = tensor_to_device(who, c.out, t->device);
    kiln_release(c.out);
    if (!(c.out = there)) rc = -1;
  }
  if (!rc) rc = dist_record(kind, (dist_op)c.op, c.arg, t, c.out);
  if (rc) {
    kiln_release(c.out);
    return NULL;
  }
  return scope_own(c.out);
}

int dist_run_into(const char *who, dist_kind kind, int op, int64_t arg, int world, kiln_tensor *in,
                  kiln_tensor *out) {
  if (dist_join(who)) return -1;
  int size = dist_world_size();
  call c = {.who = who, .kind = kind, .op = -1, .arg = arg, .in = in, .host = in, .out = out};
  bool ok = check_args(&c, op >= 0 ? dist_op_name((dist_op)op) : NULL, size) == 0;
  if (ok && world != size) {
    kiln_set_error("%s: staged for a world of %d process%s, run in a world of %d", who, world, world == 1 ? "" : "es",
                   size);
    ok = false;
  }
  dist_header h;
  dist_describe(&h, kind, c.op, ok ? in : NULL, c.arg);
  dist_lock();
  int rc = dist_agree(who, &h, ok);
  if (!rc) rc = move(&c);
  dist_unlock();
  return rc;
}

kiln_tensor *kiln_all_reduce(kiln_tensor *t, const char *op) {
  return collective("all_reduce", DIST_ALL_REDUCE, op, 0, t);
}

kiln_tensor *kiln_all_gather(kiln_tensor *t, int axis) {
  return collective("all_gather", DIST_ALL_GATHER, NULL, axis, t);
}

kiln_tensor *kiln_reduce_scatter(kiln_tensor *t, int axis, const char *op) {
  return collective("reduce_scatter", DIST_REDUCE_SCATTER, op, axis, t);
}

kiln_tensor *kiln_broadcast_from(kiln_tensor *t, int root) {
  return collective("broadcast_from", DIST_BROADCAST, NULL, root, t);
}
