/* index.c — gather, scatter_add and iota. gather is a linalg.generic over
 * the result whose body reads params with tensor.extract at the index it
 * loads; scatter_add is an scf.for nest over the updates in row-major
 * order, adding each into its row with tensor.insert, so every output
 * element sums its updates in the kernel's order. An index out of range is
 * an error in Kiln: cf.assert says so here, never a read out of bounds. */
#include <string.h>

#include "mlir/emit.h"

/* the index value iv (i32 or i64) as an index, asserted in [0, dim) */
static void checked_index(mlir_emitter *e, const char *api, kiln_dtype dt, const char *iv, int64_t dim, char *out) {
  char w[MLIR_NAME], d[MLIR_NAME], ok[MLIR_NAME];
  strcpy(w, iv);
  if (dt == KILN_I32) mlir_line(e, "%s = arith.extsi %s : i32 to i64", mlir_fresh(e, w), iv);
  mlir_const_int(e, d, "i64", dim);
  mlir_line(e, "%s = arith.cmpi ult, %s, %s : i64", mlir_fresh(e, ok), w, d); /* negative: huge */
  mlir_line(e, "cf.assert %s, \"%s: index out of range\"", ok, api);
  mlir_line(e, "%s = arith.index_cast %s : i64 to index", mlir_fresh(e, out), w);
}

static int emit_gather(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *pt = mlir_vtype(s, in->in[0]), *it = mlir_vtype(s, in->in[1]), *ot = mlir_vtype(s, in->out);
  int axis = in->attrs.axis, ri = it->rank;
  mlir_generic g;
  memset(&g, 0, sizeof g);
  char init[MLIR_NAME], pos[KILN_MAX_RANK][MLIR_NAME], ps[256];
  mlir_empty(e, init, ot);
  g.n_dims = ot->rank, g.iters = "pppppppp", g.n_in = 1, g.n_out = 1;
  g.name[0] = mlir_vname(s, in->in[1]), g.type[0] = it;
  size_t k = 0;
  for (int j = 0; j < ri; j++) k += (size_t)snprintf(g.map[0] + k, sizeof g.map[0] - k, "%sd%d", j ? ", " : "", axis + j);
  g.name[1] = init, g.type[1] = ot;
  mlir_identity_map(g.map[1], sizeof g.map[1], ot->rank);
  mlir_generic_begin(e, &g);
  for (int d = 0; d < pt->rank; d++) {
    if (d == axis) {
      checked_index(e, "gather", it->dtype, g.arg[0], pt->shape[axis], pos[d]);
      continue;
    }
    mlir_line(e, "%s = linalg.index %d : index", mlir_fresh(e, pos[d]), d < axis ? d : d - 1 + ri);
  }
  char v[MLIR_NAME];
  mlir_start(e, "%s = tensor.extract %s[", mlir_fresh(e, v), mlir_vname(s, in->in[0]));
  for (int d = 0; d < pt->rank; d++) ir_buf_printf(e->b, "%s%s", d ? ", " : "", pos[d]);
  ir_buf_printf(e->b, "] : %s\n", mlir_type(ps, pt));
  const char *y = v;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
  return 0;
}

static int emit_scatter_add(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *ut = mlir_vtype(s, in->in[0]), *it = mlir_vtype(s, in->in[1]), *ot = mlir_vtype(s, in->out);
  int axis = in->attrs.axis, ri = it->rank;
  char z[MLIR_NAME], init[MLIR_NAME], acc[MLIR_NAME], ts[256], us[256], is[256];
  mlir_type(ts, ot), mlir_type(us, ut), mlir_type(is, it);
  mlir_const(e, z, ot->dtype, 0);
  mlir_empty(e, init, ot);
  mlir_fresh(e, acc);
  mlir_line(e, "%s = linalg.fill ins(%s : %s) outs(%s : %s) -> %s", acc, z, mlir_elem(ot->dtype), init, ts, ts);
  mlir_nest l;
  mlir_nest_begin(e, &l, ut->rank, ut->shape, acc, ts);
  const char(*iv)[MLIR_NAME] = l.iv, *cur = l.cur;
  char u[MLIR_NAME], idx[MLIR_NAME], at[MLIR_NAME], old[MLIR_NAME], sum[MLIR_NAME], next[MLIR_NAME];
  ir_buf *b = e->b;
  mlir_start(e, "%s = tensor.extract %s[", mlir_fresh(e, u), mlir_vname(s, in->in[0]));
  for (int d = 0; d < ut->rank; d++) ir_buf_printf(b, "%s%s", d ? ", " : "", iv[d]);
  ir_buf_printf(b, "] : %s\n", us);
  mlir_start(e, "%s = tensor.extract %s[", mlir_fresh(e, idx), mlir_vname(s, in->in[1]));
  for (int j = 0; j < ri; j++) ir_buf_printf(b, "%s%s", j ? ", " : "", iv[axis + j]);
  ir_buf_printf(b, "] : %s\n", is);
  checked_index(e, "scatter_add", it->dtype, idx, ot->shape[axis], at);
  char target[512];
  size_t k = 0;
  for (int d = 0; d < ot->rank; d++)
    k += (size_t)snprintf(target + k, sizeof target - k, "%s%s", d ? ", " : "",
                          d < axis ? iv[d] : d == axis ? at : iv[d - 1 + ri]);
  const char *T = mlir_elem(ot->dtype);
  bool fl = ot->dtype == KILN_F32 || ot->dtype == KILN_F64;
  mlir_line(e, "%s = tensor.extract %s[%s] : %s", mlir_fresh(e, old), cur, target, ts);
  mlir_line(e, "%s = arith.add%s %s, %s : %s", mlir_fresh(e, sum), fl ? "f" : "i", old, u, T);
  mlir_line(e, "%s = tensor.insert %s into %s[%s] : %s", mlir_fresh(e, next), sum, cur, target, ts);
  mlir_nest_end(e, &l, next, out);
  return 0;
}

/* element i of the row-major order, converted to the dtype */
static int emit_iota(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_type *ot = mlir_vtype(s, in->out);
  mlir_generic g;
  memset(&g, 0, sizeof g);
  char init[MLIR_NAME], lin[MLIR_NAME], r[MLIR_NAME];
  mlir_empty(e, init, ot);
  g.n_dims = ot->rank, g.iters = "pppppppp", g.n_out = 1;
  g.name[0] = init, g.type[0] = ot;
  mlir_identity_map(g.map[0], sizeof g.map[0], ot->rank);
  mlir_generic_begin(e, &g);
  mlir_const_int(e, lin, "i64", 0);
  int64_t stride = 1;
  for (int d = ot->rank - 1; d >= 0; d--) {
    char i[MLIR_NAME], i64[MLIR_NAME], st[MLIR_NAME], p[MLIR_NAME], sum[MLIR_NAME];
    mlir_line(e, "%s = linalg.index %d : index", mlir_fresh(e, i), d);
    mlir_line(e, "%s = arith.index_cast %s : index to i64", mlir_fresh(e, i64), i);
    mlir_const_int(e, st, "i64", stride);
    mlir_line(e, "%s = arith.muli %s, %s : i64", mlir_fresh(e, p), i64, st);
    mlir_line(e, "%s = arith.addi %s, %s : i64", mlir_fresh(e, sum), lin, p);
    strcpy(lin, sum);
    stride *= ot->shape[d];
  }
  mlir_scalar_convert(e, KILN_I64, ot->dtype, lin, r);
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
  (void)s;
  return 0;
}

int mlir_emit_index(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  switch (in->op) {
  case OP_GATHER: return emit_gather(e, s, in, out);
  case OP_SCATTER_ADD: return emit_scatter_add(e, s, in, out);
  default: return emit_iota(e, s, in, out);
  }
}
