/* structured.c — the tensor ops as linalg and tensor ops: elementwise ops
 * (with NumPy broadcasting in the indexing maps) as linalg.generic, data
 * movement as linalg.transpose, tensor.extract_slice / insert_slice and
 * reshapes, reductions as linalg.reduce (f32 sums and products accumulate
 * in f64, as the kernels do), argmax as a generic carrying the best value
 * and its index, dot as linalg.matmul / linalg.batch_matmul. */
#include <math.h>
#include <string.h>

#include "mlir/emit.h"

/* ---- linalg.generic ---- */

void mlir_identity_map(char *map, size_t n, int r) {
  size_t k = 0;
  map[0] = '\0';
  for (int d = 0; d < r && k < n; d++) k += (size_t)snprintf(map + k, n - k, "%sd%d", d ? ", " : "", d);
}

void mlir_broadcast_map(char *map, size_t n, const op_type *t, const op_type *out) {
  size_t k = 0;
  map[0] = '\0';
  for (int j = 0; j < t->rank && k < n; j++) {
    int od = j + out->rank - t->rank;
    if (t->shape[j] == 1 && out->shape[od] != 1)
      k += (size_t)snprintf(map + k, n - k, "%s0", j ? ", " : "");
    else
      k += (size_t)snprintf(map + k, n - k, "%sd%d", j ? ", " : "", od);
  }
}

void mlir_empty(mlir_emitter *e, char *name, const op_type *t) {
  char ts[256];
  mlir_fresh(e, name);
  mlir_line(e, "%s = tensor.empty() : %s", name, mlir_type(ts, t));
}

void mlir_generic_begin(mlir_emitter *e, mlir_generic *g) {
  char dims[160], ts[256];
  mlir_identity_map(dims, sizeof dims, g->n_dims);
  mlir_fresh(e, g->res);
  ir_buf *b = e->b;
  mlir_start(e, "%s%s = linalg.generic {indexing_maps = [", g->res, g->n_out > 1 ? ":2" : "");
  for (int k = 0; k < g->n_in + g->n_out; k++)
    ir_buf_printf(b, "%saffine_map<(%s) -> (%s)>", k ? ", " : "", dims, g->map[k]);
  ir_buf_printf(b, "], iterator_types = [");
  for (int d = 0; d < g->n_dims; d++) ir_buf_printf(b, "%s\"%s\"", d ? ", " : "", g->iters[d] == 'r' ? "reduction" : "parallel");
  ir_buf_printf(b, "]}");
  for (int part = 0; part < 2; part++) {
    int k0 = part ? g->n_in : 0, k1 = part ? g->n_in + g->n_out : g->n_in;
    if (k0 == k1) continue;
    ir_buf_printf(b, " %s(", part ? "outs" : "ins");
    for (int k = k0; k < k1; k++) ir_buf_printf(b, "%s%s", k > k0 ? ", " : "", g->name[k]);
    ir_buf_printf(b, " : ");
    for (int k = k0; k < k1; k++) ir_buf_printf(b, "%s%s", k > k0 ? ", " : "", mlir_type(ts, g->type[k]));
    ir_buf_printf(b, ")");
  }
  ir_buf_printf(b, " {\n");
  e->indent--;
  mlir_start(e, "^bb0(");
  for (int k = 0; k < g->n_in + g->n_out; k++)
    ir_buf_printf(b, "%s%s: %s", k ? ", " : "", mlir_fresh(e, g->arg[k]), mlir_elem(g->type[k]->dtype));
  ir_buf_printf(b, "):\n");
  e->indent += 2;
}

void mlir_generic_end(mlir_emitter *e, mlir_generic *g, int n, const char *const *yield) {
  char ts[256];
  mlir_start(e, "linalg.yield ");
  for (int k = 0; k < n; k++) ir_buf_printf(e->b, "%s%s", k ? ", " : "", yield[k]);
  ir_buf_printf(e->b, " : ");
  for (int k = 0; k < n; k++) ir_buf_printf(e->b, "%s%s", k ? ", " : "", mlir_elem(g->type[g->n_in + k]->dtype));
  ir_buf_printf(e->b, "\n");
  e->indent--;
  mlir_start(e, "} -> %s", n > 1 ? "(" : "");
  for (int k = 0; k < n; k++) ir_buf_printf(e->b, "%s%s", k ? ", " : "", mlir_type(ts, g->type[g->n_in + k]));
  ir_buf_printf(e->b, "%s\n", n > 1 ? ")" : "");
}

/* a generic over out's shape whose inputs broadcast to it; the caller
 * writes the body */
static void elementwise_begin(mlir_emitter *e, mlir_generic *g, int n, const char *const *names,
                              const op_type *const *types, const op_type *out, char *init) {
  memset(g, 0, sizeof *g);
  g->n_dims = out->rank;
  g->iters = "pppppppp";
  g->n_in = n;
  g->n_out = 1;
  for (int k = 0; k < n; k++) {
    g->name[k] = names[k];
    g->type[k] = types[k];
    mlir_broadcast_map(g->map[k], sizeof g->map[k], types[k], out);
  }
  mlir_empty(e, init, out);
  g->name[n] = init;
  g->type[n] = out;
  mlir_identity_map(g->map[n], sizeof g->map[n], out->rank);
  mlir_generic_begin(e, g);
}

int mlir_emit_elementwise(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *ot = mlir_vtype(s, in->out), *types[3] = {NULL, NULL, NULL};
  const char *names[3] = {NULL, NULL, NULL};
  if (in->n_in < 1 || in->n_in > 3) return mlir_fail(e, s, in, "%d operands", in->n_in);
  for (int k = 0; k < in->n_in; k++) names[k] = mlir_vname(s, in->in[k]), types[k] = mlir_vtype(s, in->in[k]);
  kiln_dtype dt = types[in->n_in - 1]->dtype; /* select: the values' */
  if (in->op == OP_CONVERT && dt == ot->dtype) {
    strcpy(out, names[0]);
    return 0;
  }
  mlir_generic g;
  char init[MLIR_NAME], r[MLIR_NAME];
  elementwise_begin(e, &g, in->n_in, names, types, ot, init);
  int rc = 0;
  switch (kiln_ops[in->op].kind) {
  case OPK_UNARY: rc = mlir_scalar_unary(e, in->op, dt, g.arg[0], r); break;
  case OPK_BINARY: rc = mlir_scalar_binary(e, in->op, dt, g.arg[0], g.arg[1], r); break;
  case OPK_COMPARE: rc = mlir_scalar_compare(e, in->op, dt, g.arg[0], g.arg[1], r); break;
  case OPK_CONVERT: mlir_scalar_convert(e, dt, ot->dtype, g.arg[0], r); break;
  default: /* select */
    mlir_fresh(e, r);
    mlir_line(e, "%s = arith.select %s, %s, %s : %s", r, g.arg[0], g.arg[1], g.arg[2], mlir_elem(dt));
  }
  if (rc) return mlir_fail(e, s, in, "no MLIR form for %s", mlir_elem(dt));
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
  return 0;
}

void mlir_nest_begin(mlir_emitter *e, mlir_nest *l, int n, const int64_t *ext, const char *init, const char *type) {
  char lo[MLIR_NAME];
  l->n = n;
  snprintf(l->type, sizeof l->type, "%s", type);
  snprintf(l->cur, MLIR_NAME, "%s", init);
  if (n) mlir_const_int(e, lo, "index", 0);
  for (int d = 0; d < n; d++) {
    char hi[MLIR_NAME], carried[MLIR_NAME];
    mlir_const_int(e, hi, "index", ext[d]);
    mlir_for_begin(e, lo, hi, l->cur, type, l->iv[d], carried, l->res[d]);
    strcpy(l->cur, carried);
  }
}

void mlir_nest_end(mlir_emitter *e, mlir_nest *l, const char *val, char *out) {
  char cur[MLIR_NAME];
  snprintf(cur, MLIR_NAME, "%s", val);
  for (int d = l->n - 1; d >= 0; d--) {
    mlir_for_end(e, cur, l->type);
    strcpy(cur, l->res[d]);
  }
  strcpy(out, cur);
}

/* ---- data movement ---- */

static void int_list(char *buf, size_t n, int k, const int64_t *v);

/* "0, 1, ..., n-1" */
static void iota_list(char *buf, size_t n, int k) {
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; i < k && at < n; i++) at += (size_t)snprintf(buf + at, n - at, "%s%d", i ? ", " : "", i);
}

void mlir_reshape(mlir_emitter *e, char *out, const char *x, const op_type *from, const op_type *to) {
  char a[256], b[256], mid[MLIR_NAME], list[160];
  bool same = from->rank == to->rank;
  for (int i = 0; same && i < to->rank; i++) same = from->shape[i] == to->shape[i];
  if (same) {
    if (out != x) strcpy(out, x);
    return;
  }
  int64_t n = 1;
  for (int i = 0; i < from->rank; i++) n *= from->shape[i];
  op_type flat = {to->dtype, 1, {n}};
  const op_type *src = from;
  strcpy(mid, x);
  if (from->rank > 1 || (from->rank == 1 && to->rank == 0)) { /* to one axis, or to a scalar */
    const op_type *dst = to->rank == 0 ? to : &flat;
    char assoc[200] = "";
    if (to->rank) {
      iota_list(list, sizeof list, from->rank);
      snprintf(assoc, sizeof assoc, "[%s]", list);
    }
    char tmp[MLIR_NAME];
    mlir_fresh(e, tmp);
    mlir_line(e, "%s = tensor.collapse_shape %s [%s] : %s into %s", tmp, mid, assoc, mlir_type(a, from),
              mlir_type(b, dst));
    strcpy(mid, tmp);
    src = dst;
  }
  if (to->rank == 0 || (to->rank == 1 && src->rank == 1)) {
    strcpy(out, mid);
    return;
  }
  char assoc[200] = "", shape[160];
  if (src->rank) {
    iota_list(list, sizeof list, to->rank);
    snprintf(assoc, sizeof assoc, "[%s]", list);
  }
  int_list(shape, sizeof shape, to->rank, to->shape);
  mlir_fresh(e, out);
  mlir_line(e, "%s = tensor.expand_shape %s [%s] output_shape [%s] : %s into %s", out, mid, assoc, shape,
            mlir_type(a, src), mlir_type(b, to));
}

/* ---- scf.for nests ---- */

void mlir_for_begin(mlir_emitter *e, const char *lo, const char *hi, const char *init, const char *type, char *iv,
                    char *carried, char *res) {
  char one[MLIR_NAME];
  mlir_const_int(e, one, "index", 1);
  mlir_fresh(e, res), mlir_fresh(e, iv), mlir_fresh(e, carried);
  mlir_line(e, "%s = scf.for %s = %s to %s step %s iter_args(%s = %s) -> (%s) {", res, iv, lo, hi, one, carried, init,
            type);
  e->indent++;
}

void mlir_for_end(mlir_emitter *e, const char *val, const char *type) {
  mlir_line(e, "scf.yield %s : %s", val, type);
  e->indent--;
  mlir_line(e, "}");
}

/* "a, b, c" of n int64s */
static void int_list(char *buf, size_t n, int k, const int64_t *v) {
  size_t at = 0;
  buf[0] = '\0';
  for (int i = 0; i < k && at < n; i++) at += (size_t)snprintf(buf + at, n - at, "%s%lld", i ? ", " : "", (long long)v[i]);
}

static void ones(int64_t *v, int k) {
  for (int i = 0; i < k; i++) v[i] = 1;
}

int mlir_emit_movement(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *ot = mlir_vtype(s, in->out), *xt = mlir_vtype(s, in->in[0]);
  const char *x = mlir_vname(s, in->in[0]);
  char a[256], b[256], init[MLIR_NAME];
  int64_t one[KILN_MAX_RANK];
  ones(one, KILN_MAX_RANK);
  switch (in->op) {
  case OP_IDENTITY:
  case OP_STOP_GRADIENT: strcpy(out, x); return 0;
  case OP_RESHAPE: mlir_reshape(e, out, x, xt, ot); return 0;
  case OP_BROADCAST: {
    mlir_generic g;
    elementwise_begin(e, &g, 1, &x, &xt, ot, init);
    const char *y = g.arg[0];
    mlir_generic_end(e, &g, 1, &y);
    strcpy(out, g.res);
    return 0;
  }
  case OP_TRANSPOSE: {
    char perm[160];
    int64_t p[KILN_MAX_RANK];
    bool same = true; /* the identity (rank 0 and 1 included): x itself; mlir-opt-19 crashes on an empty permutation */
    for (int i = 0; i < in->attrs.naxes; i++) p[i] = in->attrs.axes[i], same = same && p[i] == i;
    if (same) {
      strcpy(out, x);
      return 0;
    }
    int_list(perm, sizeof perm, in->attrs.naxes, p);
    mlir_empty(e, init, ot);
    mlir_fresh(e, out);
    mlir_line(e, "%s = linalg.transpose ins(%s : %s) outs(%s : %s) permutation = [%s]", out, x, mlir_type(a, xt), init,
              mlir_type(b, ot), perm);
    return 0;
  }
  case OP_SLICE: {
    char off[160], size[160], stride[160];
    int_list(off, sizeof off, xt->rank, in->attrs.begin);
    int_list(size, sizeof size, xt->rank, ot->shape);
    int_list(stride, sizeof stride, xt->rank, one);
    mlir_fresh(e, out);
    mlir_line(e, "%s = tensor.extract_slice %s[%s] [%s] [%s] : %s to %s", out, x, off, size, stride, mlir_type(a, xt),
              mlir_type(b, ot));
    return 0;
  }
  default: { /* concat: each operand inserted at its offset along the axis */
    int64_t at[KILN_MAX_RANK] = {0};
    char acc[MLIR_NAME], off[160], size[160], stride[160];
    mlir_empty(e, acc, ot);
    for (int k = 0; k < in->n_in; k++) {
      const op_type *t = mlir_vtype(s, in->in[k]);
      int_list(off, sizeof off, t->rank, at);
      int_list(size, sizeof size, t->rank, t->shape);
      int_list(stride, sizeof stride, t->rank, one);
      char next[MLIR_NAME];
      mlir_fresh(e, next);
      mlir_line(e, "%s = tensor.insert_slice %s into %s[%s] [%s] [%s] : %s into %s", next, mlir_vname(s, in->in[k]),
                acc, off, size, stride, mlir_type(a, t), mlir_type(b, ot));
      strcpy(acc, next);
      at[in->attrs.axis] += t->shape[in->attrs.axis];
    }
    strcpy(out, acc);
    return 0;
  }
  }
}

/* ---- reductions ---- */

/* x converted elementwise to dt (a generic) */
static void convert_all(mlir_emitter *e, char *out, const char *x, const op_type *xt, kiln_dtype dt) {
  op_type to = *xt;
  to.dtype = dt;
  mlir_generic g;
  char init[MLIR_NAME], r[MLIR_NAME];
  elementwise_begin(e, &g, 1, &x, &xt, &to, init);
  mlir_scalar_convert(e, xt->dtype, dt, g.arg[0], r);
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
}

/* t filled with the scalar v */
static void fill(mlir_emitter *e, char *out, const op_type *t, const char *v) {
  char init[MLIR_NAME], ts[256];
  mlir_empty(e, init, t);
  mlir_fresh(e, out);
  mlir_line(e, "%s = linalg.fill ins(%s : %s) outs(%s : %s) -> %s", out, v, mlir_elem(t->dtype), init,
            mlir_type(ts, t), ts);
}

/* the identity of a reduction over dt */
static void reduce_identity(mlir_emitter *e, char *out, op_id op, kiln_dtype dt) {
  bool fl = dt == KILN_F32 || dt == KILN_F64;
  switch (op) {
  case OP_REDUCE_SUM: mlir_const(e, out, dt, 0); break;
  case OP_REDUCE_PROD: mlir_const(e, out, dt, 1); break;
  case OP_REDUCE_MAX:
    if (fl) mlir_const(e, out, dt, -INFINITY);
    else mlir_const_int(e, out, mlir_elem(dt), dt == KILN_I32 ? INT32_MIN : INT64_MIN);
    break;
  default:
    if (fl) mlir_const(e, out, dt, INFINITY);
    else mlir_const_int(e, out, mlir_elem(dt), dt == KILN_I32 ? INT32_MAX : INT64_MAX);
  }
}

static int emit_argmax(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *xt = mlir_vtype(s, in->in[0]), *ot = mlir_vtype(s, in->out);
  kiln_dtype dt = xt->dtype;
  int axis = in->attrs.axis;
  op_type bt = *ot;
  bt.dtype = dt;
  char id[MLIR_NAME], best[MLIR_NAME], z[MLIR_NAME], idx[MLIR_NAME];
  reduce_identity(e, id, OP_REDUCE_MAX, dt);
  fill(e, best, &bt, id);
  mlir_const_int(e, z, "i64", 0);
  fill(e, idx, ot, z);
  mlir_generic g;
  memset(&g, 0, sizeof g);
  char iters[KILN_MAX_RANK + 1] = "";
  for (int d = 0; d < xt->rank; d++) iters[d] = d == axis ? 'r' : 'p';
  g.n_dims = xt->rank, g.iters = iters, g.n_in = 1, g.n_out = 2;
  g.name[0] = mlir_vname(s, in->in[0]), g.type[0] = xt;
  mlir_identity_map(g.map[0], sizeof g.map[0], xt->rank);
  g.name[1] = best, g.type[1] = &bt, g.name[2] = idx, g.type[2] = ot;
  size_t k = 0;
  for (int d = 0; d < xt->rank; d++)
    if (d != axis) k += (size_t)snprintf(g.map[1] + k, sizeof g.map[1] - k, "%sd%d", k ? ", " : "", d);
  strcpy(g.map[2], g.map[1]);
  mlir_generic_begin(e, &g);
  const char *T = mlir_elem(dt), *x = g.arg[0], *b = g.arg[1], *i = g.arg[2];
  char better[MLIR_NAME], pos[MLIR_NAME], pos64[MLIR_NAME], nb[MLIR_NAME], ni[MLIR_NAME];
  mlir_fresh(e, better);
  if (dt == KILN_F32 || dt == KILN_F64) { /* the first max wins; the first NaN beats everything */
    char gt[MLIR_NAME], xn[MLIR_NAME], bo[MLIR_NAME], nan[MLIR_NAME];
    mlir_line(e, "%s = arith.cmpf ogt, %s, %s : %s", mlir_fresh(e, gt), x, b, T);
    mlir_line(e, "%s = arith.cmpf uno, %s, %s : %s", mlir_fresh(e, xn), x, x, T);
    mlir_line(e, "%s = arith.cmpf ord, %s, %s : %s", mlir_fresh(e, bo), b, b, T);
    mlir_line(e, "%s = arith.andi %s, %s : i1", mlir_fresh(e, nan), xn, bo);
    mlir_line(e, "%s = arith.ori %s, %s : i1", better, gt, nan);
  } else {
    mlir_line(e, "%s = arith.cmpi sgt, %s, %s : %s", better, x, b, T);
  }
  mlir_line(e, "%s = linalg.index %d : index", mlir_fresh(e, pos), axis);
  mlir_line(e, "%s = arith.index_cast %s : index to i64", mlir_fresh(e, pos64), pos);
  mlir_line(e, "%s = arith.select %s, %s, %s : %s", mlir_fresh(e, nb), better, x, b, T);
  mlir_line(e, "%s = arith.select %s, %s, %s : i64", mlir_fresh(e, ni), better, pos64, i);
  const char *y[2] = {nb, ni};
  mlir_generic_end(e, &g, 2, y);
  if (snprintf(out, MLIR_NAME, "%s#1", g.res) >= MLIR_NAME) return mlir_fail(e, s, in, "name too long");
  return 0;
}

int mlir_emit_reduce(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  if (in->op == OP_ARGMAX) return emit_argmax(e, s, in, out);
  const op_type *xt = mlir_vtype(s, in->in[0]), *ot = mlir_vtype(s, in->out);
  const char *x = mlir_vname(s, in->in[0]);
  if (in->attrs.naxes == 0) { /* over no axes: x itself */
    strcpy(out, x);
    return 0;
  }
  kiln_dtype dt = xt->dtype;
  /* f32 sums and products accumulate in f64 (kernels_reduce.c) */
  bool wide = dt == KILN_F32 && (in->op == OP_REDUCE_SUM || in->op == OP_REDUCE_PROD);
  kiln_dtype acc = wide ? KILN_F64 : dt;
  char src[MLIR_NAME], id[MLIR_NAME], init[MLIR_NAME], a[256], b[256], dims[160];
  strcpy(src, x);
  op_type st = *xt;
  st.dtype = acc;
  if (wide) convert_all(e, src, x, xt, acc);
  op_type rt = {acc, 0, {0}}; /* the result without keepdims' ones */
  bool reduced[KILN_MAX_RANK] = {false};
  int64_t axes[KILN_MAX_RANK];
  for (int i = 0; i < in->attrs.naxes; i++) reduced[in->attrs.axes[i]] = true, axes[i] = in->attrs.axes[i];
  for (int d = 0; d < xt->rank; d++)
    if (!reduced[d]) rt.shape[rt.rank++] = xt->shape[d];
  int_list(dims, sizeof dims, in->attrs.naxes, axes);
  reduce_identity(e, id, in->op, acc);
  fill(e, init, &rt, id);
  char r[MLIR_NAME], vi[MLIR_NAME], vo[MLIR_NAME], y[MLIR_NAME];
  mlir_fresh(e, r), mlir_fresh(e, vi), mlir_fresh(e, vo);
  const char *T = mlir_elem(acc);
  mlir_line(e, "%s = linalg.reduce ins(%s : %s) outs(%s : %s) dimensions = [%s]", r, src, mlir_type(a, &st), init,
            mlir_type(b, &rt), dims);
  e->indent++;
  mlir_line(e, "(%s: %s, %s: %s) {", vi, T, vo, T);
  e->indent++;
  bool fl = acc == KILN_F32 || acc == KILN_F64;
  switch (in->op) {
  case OP_REDUCE_SUM: mlir_line(e, "%s = arith.add%s %s, %s : %s", mlir_fresh(e, y), fl ? "f" : "i", vo, vi, T); break;
  case OP_REDUCE_PROD: mlir_line(e, "%s = arith.mul%s %s, %s : %s", mlir_fresh(e, y), fl ? "f" : "i", vo, vi, T); break;
  default: mlir_scalar_extremum(e, in->op == OP_REDUCE_MAX, acc, vo, vi, y);
  }
  mlir_line(e, "linalg.yield %s : %s", y, T);
  e->indent--;
  mlir_line(e, "}");
  e->indent--;
  char res[MLIR_NAME];
  strcpy(res, r);
  if (wide) {
    convert_all(e, res, r, &rt, dt);
    rt.dtype = dt;
  }
  mlir_reshape(e, out, res, &rt, ot); /* keepdims */
  return 0;
}

/* ---- dot ---- */

int mlir_emit_dot(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *ot = mlir_vtype(s, in->out);
  char z[MLIR_NAME], acc[MLIR_NAME], a[256], b[256], c[256], opnd[2][MLIR_NAME];
  mlir_const(e, z, ot->dtype, 0);
  int r = ot->rank;
  int64_t batch = 1;
  for (int d = 0; d < r - 2; d++) batch *= ot->shape[d];
  op_type mt[2];
  for (int k = 0; k < 2; k++) { /* each operand broadcast to [batch..., rows, cols], then [B, rows, cols] */
    const op_type *t = mlir_vtype(s, in->in[k]);
    strcpy(opnd[k], mlir_vname(s, in->in[k]));
    if (r == 2) {
      mt[k] = *t;
      continue;
    }
    op_type full = *ot;
    full.shape[r - 2] = t->shape[t->rank - 2];
    full.shape[r - 1] = t->shape[t->rank - 1];
    bool same = t->rank == r;
    for (int d = 0; same && d < r; d++) same = t->shape[d] == full.shape[d];
    if (!same) {
      mlir_generic g;
      char init[MLIR_NAME];
      const char *nm = opnd[k];
      elementwise_begin(e, &g, 1, &nm, &t, &full, init);
      const char *y = g.arg[0];
      mlir_generic_end(e, &g, 1, &y);
      strcpy(opnd[k], g.res);
    }
    mt[k] = (op_type){t->dtype, 3, {batch, full.shape[r - 2], full.shape[r - 1]}};
    mlir_reshape(e, opnd[k], opnd[k], &full, &mt[k]);
  }
  op_type rt = r == 2 ? *ot : (op_type){ot->dtype, 3, {batch, ot->shape[r - 2], ot->shape[r - 1]}};
  fill(e, acc, &rt, z);
  char res[MLIR_NAME];
  mlir_fresh(e, res);
  mlir_line(e, "%s = linalg.%s ins(%s, %s : %s, %s) outs(%s : %s) -> %s", res, r == 2 ? "matmul" : "batch_matmul",
            opnd[0], opnd[1], mlir_type(a, &mt[0]), mlir_type(b, &mt[1]), acc, mlir_type(c, &rt), c);
  mlir_reshape(e, out, res, &rt, ot);
  return 0;
}
