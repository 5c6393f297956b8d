/* window.c — convolutions and pooling over NHWC images (lib/kernels_conv.c).
 * Padding is explicit: the image is copied into a filled tensor first
 * (zeros, or -inf for max pooling, which the kernels' windows never read:
 * max with -inf changes nothing). conv2d of one group is
 * linalg.conv_2d_nhwc_hwcf; grouped convolutions and the filter gradient
 * are linalg.generic with strided, grouped indexing maps; the input
 * gradient is a generic reading dy where a window row lands (tensor.extract).
 * Pooling is a generic with the kernels' NaN rule (linalg.pooling_nhwc_max
 * uses arith.maximumf, which orders -0 below +0); the pooling gradients
 * are scf.for nests that add into dx window by window, in the kernels'
 * order. */
#include <math.h>
#include <string.h>

#include "mlir/emit.h"

typedef char name_t[MLIR_NAME];

/* x (NHWC) inside a tensor filled with v, padded by pad[4] (top, bottom,
 * left, right); its type in pt */
static void pad_image(mlir_emitter *e, char *out, const char *x, const op_type *xt, const int pad[4], const char *v,
                      op_type *pt) {
  *pt = *xt;
  pt->shape[1] += pad[0] + pad[1];
  pt->shape[2] += pad[2] + pad[3];
  if (!pad[0] && !pad[1] && !pad[2] && !pad[3]) {
    strcpy(out, x);
    return;
  }
  char init[MLIR_NAME], filled[MLIR_NAME], a[256], b[256];
  mlir_empty(e, init, pt);
  mlir_line(e, "%s = linalg.fill ins(%s : %s) outs(%s : %s) -> %s", mlir_fresh(e, filled), v, mlir_elem(xt->dtype),
            init, mlir_type(b, pt), b);
  mlir_line(e, "%s = tensor.insert_slice %s into %s[0, %d, %d, 0] [%lld, %lld, %lld, %lld] [1, 1, 1, 1] : %s into %s",
            mlir_fresh(e, out), x, filled, pad[0], pad[2], (long long)xt->shape[0], (long long)xt->shape[1],
            (long long)xt->shape[2], (long long)xt->shape[3], mlir_type(a, xt), b);
}

/* t filled with v */
static void filled(mlir_emitter *e, char *out, const op_type *t, const char *v) {
  char init[MLIR_NAME], ts[256];
  mlir_empty(e, init, t);
  mlir_line(e, "%s = linalg.fill ins(%s : %s) outs(%s : %s) -> %s", mlir_fresh(e, out), v, mlir_elem(t->dtype), init,
            mlir_type(ts, t), ts);
}

/* the body acc + a * b (a float convolution's) */
static void mul_add(mlir_emitter *e, const char *T, const char *a, const char *b, const char *acc, char *out) {
  name_t p;
  mlir_line(e, "%s = arith.mulf %s, %s : %s", mlir_fresh(e, p), a, b, T);
  mlir_line(e, "%s = arith.addf %s, %s : %s", mlir_fresh(e, out), acc, p, T);
}

/* "d0 * s + d1 * k": a strided, dilated window coordinate */
static void window_expr(char *buf, size_t n, int out_dim, int stride, int win_dim, int dilation) {
  snprintf(buf, n, "d%d * %d + d%d * %d", out_dim, stride, win_dim, dilation);
}

/* acc + a * b summed over the generic's last three loops (n_dims 7):
 * operands a (map ma) and b (map mb) into acc (map d0, d1, d2, d3) */
static void conv_generic(mlir_emitter *e, const char *a, const op_type *at, const char *ma, const char *b,
                         const op_type *bt, const char *mb, const char *acc, const op_type *ot, char *out) {
  mlir_generic g;
  memset(&g, 0, sizeof g);
  g.n_dims = 7, g.iters = "pppprrr", g.n_in = 2, g.n_out = 1;
  g.name[0] = a, g.type[0] = at, g.name[1] = b, g.type[1] = bt, g.name[2] = acc, g.type[2] = ot;
  snprintf(g.map[0], sizeof g.map[0], "%s", ma);
  snprintf(g.map[1], sizeof g.map[1], "%s", mb);
  snprintf(g.map[2], sizeof g.map[2], "d0, d1, d2, d3");
  mlir_generic_begin(e, &g);
  char r[MLIR_NAME];
  mul_add(e, mlir_elem(ot->dtype), g.arg[0], g.arg[1], g.arg[2], r);
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
}

static int emit_conv2d(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_attrs *a = &in->attrs;
  const op_type *xt = mlir_vtype(s, in->in[0]), *wt = mlir_vtype(s, in->in[1]), *ot = mlir_vtype(s, in->out);
  name_t z, xp, acc;
  op_type pt;
  char ta[256], tb[256], tc[256];
  mlir_const(e, z, ot->dtype, 0);
  pad_image(e, xp, mlir_vname(s, in->in[0]), xt, a->padding, z, &pt);
  filled(e, acc, ot, z);
  if (a->groups == 1) {
    mlir_line(e,
              "%s = linalg.conv_2d_nhwc_hwcf {dilations = dense<[%d, %d]> : tensor<2xi64>, strides = dense<[%d, %d]> "
              ": tensor<2xi64>} ins(%s, %s : %s, %s) outs(%s : %s) -> %s",
              mlir_fresh(e, out), a->dilation[0], a->dilation[1], a->stride[0], a->stride[1], xp,
              mlir_vname(s, in->in[1]), mlir_type(ta, &pt), mlir_type(tb, wt), acc, mlir_type(tc, ot), tc);
    return 0;
  }
  /* (n, oy, ox, co, ky, kx, ci of the group) */
  int64_t cig = wt->shape[2], cog = ot->shape[3] / a->groups;
  char ry[64], rx[64], mx[256];
  window_expr(ry, sizeof ry, 1, a->stride[0], 4, a->dilation[0]);
  window_expr(rx, sizeof rx, 2, a->stride[1], 5, a->dilation[1]);
  snprintf(mx, sizeof mx, "d0, %s, %s, (d3 floordiv %lld) * %lld + d6", ry, rx, (long long)cog, (long long)cig);
  conv_generic(e, xp, &pt, mx, mlir_vname(s, in->in[1]), wt, "d4, d5, d6, d3", acc, ot, out);
  return 0;
}

/* dw[ky, kx, ci, co] = sum over n, oy, ox of x_padded[n, oy*s + ky*d, ...] * dy[n, oy, ox, co] */
static int emit_conv2d_bp_filter(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_attrs *a = &in->attrs;
  const op_type *xt = mlir_vtype(s, in->in[0]), *dyt = mlir_vtype(s, in->in[1]), *ot = mlir_vtype(s, in->out);
  int64_t cig = ot->shape[2], cog = ot->shape[3] / a->groups;
  name_t z, xp, acc;
  op_type pt;
  mlir_const(e, z, ot->dtype, 0);
  pad_image(e, xp, mlir_vname(s, in->in[0]), xt, a->padding, z, &pt);
  filled(e, acc, ot, z);
  char ry[64], rx[64], mx[256]; /* (ky, kx, ci, co, n, oy, ox) */
  window_expr(ry, sizeof ry, 5, a->stride[0], 0, a->dilation[0]);
  window_expr(rx, sizeof rx, 6, a->stride[1], 1, a->dilation[1]);
  if (a->groups == 1)
    snprintf(mx, sizeof mx, "d4, %s, %s, d2", ry, rx);
  else
    snprintf(mx, sizeof mx, "d4, %s, %s, (d3 floordiv %lld) * %lld + d2", ry, rx, (long long)cog, (long long)cig);
  conv_generic(e, xp, &pt, mx, mlir_vname(s, in->in[1]), dyt, "d4, d5, d6, d3", acc, ot, out);
  return 0;
}

/* index arithmetic: "%out = arith.<op> a, b : index" */
static void idx_op(mlir_emitter *e, char *out, const char *op, const char *a, const char *b) {
  mlir_line(e, "%s = arith.%s %s, %s : index", mlir_fresh(e, out), op, a, b);
}

/* The row of dy that window row k of image row i reads, and whether there
 * is one: p = i + pad - k*dilation must be a multiple of the stride, and
 * p / stride in [0, out_len). */
static void window_source(mlir_emitter *e, const char *i, const char *k, int pad, int dilation, int stride,
                          int64_t out_len, char *row, char *valid) {
  name_t cp, cd, cs, cn, z, t, kd, p, rem, q, ge, ok1, ok2, lt, b1;
  mlir_const_int(e, cp, "index", pad), mlir_const_int(e, cd, "index", dilation);
  mlir_const_int(e, cs, "index", stride), mlir_const_int(e, cn, "index", out_len);
  mlir_const_int(e, z, "index", 0);
  idx_op(e, t, "addi", i, cp);
  idx_op(e, kd, "muli", k, cd);
  idx_op(e, p, "subi", t, kd);
  idx_op(e, rem, "remsi", p, cs);
  idx_op(e, q, "divsi", p, cs);
  mlir_line(e, "%s = arith.cmpi sge, %s, %s : index", mlir_fresh(e, ge), p, z);
  mlir_line(e, "%s = arith.cmpi eq, %s, %s : index", mlir_fresh(e, ok1), rem, z);
  mlir_line(e, "%s = arith.cmpi slt, %s, %s : index", mlir_fresh(e, lt), q, cn);
  mlir_line(e, "%s = arith.andi %s, %s : i1", mlir_fresh(e, b1), ge, ok1);
  mlir_line(e, "%s = arith.andi %s, %s : i1", mlir_fresh(e, ok2), b1, lt);
  strcpy(valid, ok2);
  mlir_line(e, "%s = arith.select %s, %s, %s : index", mlir_fresh(e, row), valid, q, z);
}

/* dx[n, iy, ix, ci] = sum over ky, kx, co of dy[n, oy, ox, co] * w[ky, kx, ci, co]
 * where row oy of the output has iy under window row ky */
static int emit_conv2d_bp_input(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_attrs *a = &in->attrs;
  const op_type *dyt = mlir_vtype(s, in->in[0]), *wt = mlir_vtype(s, in->in[1]), *ot = mlir_vtype(s, in->out);
  const char *T = mlir_elem(ot->dtype);
  int64_t cig = wt->shape[2], cog = wt->shape[3] / a->groups;
  name_t z, acc, dummy;
  mlir_const(e, z, ot->dtype, 0);
  filled(e, acc, ot, z);
  op_type dt = {ot->dtype, 1, {cog}}; /* gives the loop over co its range */
  mlir_empty(e, dummy, &dt);
  mlir_generic g;
  memset(&g, 0, sizeof g);
  g.n_dims = 7, g.iters = "pppprrr", g.n_in = 2, g.n_out = 1; /* (n, iy, ix, ci, ky, kx, co of the group) */
  g.name[0] = mlir_vname(s, in->in[1]), g.type[0] = wt;
  if (a->groups == 1)
    snprintf(g.map[0], sizeof g.map[0], "d4, d5, d3, d6");
  else
    snprintf(g.map[0], sizeof g.map[0], "d4, d5, d3 mod %lld, (d3 floordiv %lld) * %lld + d6", (long long)cig,
             (long long)cig, (long long)cog);
  g.name[1] = dummy, g.type[1] = &dt;
  snprintf(g.map[1], sizeof g.map[1], "d6");
  g.name[2] = acc, g.type[2] = ot;
  snprintf(g.map[2], sizeof g.map[2], "d0, d1, d2, d3");
  mlir_generic_begin(e, &g);
  name_t d[7], oy, vy, ox, vx, valid, grp, cg, cig_c, cog_c, co, v, p, r, pz;
  for (int k = 0; k < 7; k++) mlir_line(e, "%s = linalg.index %d : index", mlir_fresh(e, d[k]), k);
  window_source(e, d[1], d[4], a->padding[0], a->dilation[0], a->stride[0], dyt->shape[1], oy, vy);
  window_source(e, d[2], d[5], a->padding[2], a->dilation[1], a->stride[1], dyt->shape[2], ox, vx);
  mlir_line(e, "%s = arith.andi %s, %s : i1", mlir_fresh(e, valid), vy, vx);
  mlir_const_int(e, cig_c, "index", cig), mlir_const_int(e, cog_c, "index", cog);
  idx_op(e, grp, "divui", d[3], cig_c);
  idx_op(e, cg, "muli", grp, cog_c);
  idx_op(e, co, "addi", cg, d[6]);
  char ts[256];
  mlir_line(e, "%s = tensor.extract %s[%s, %s, %s, %s] : %s", mlir_fresh(e, v), mlir_vname(s, in->in[0]), d[0], oy, ox,
            co, mlir_type(ts, dyt));
  mlir_line(e, "%s = arith.mulf %s, %s : %s", mlir_fresh(e, p), v, g.arg[0], T);
  mlir_const(e, pz, ot->dtype, 0);
  name_t sel;
  mlir_line(e, "%s = arith.select %s, %s, %s : %s", mlir_fresh(e, sel), valid, p, pz, T);
  mlir_line(e, "%s = arith.addf %s, %s : %s", mlir_fresh(e, r), g.arg[2], sel, T);
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
  return 0;
}

/* max or sum of each window, the padding filled with -inf or 0 */
static void pool_reduce(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, bool max, char *out) {
  const op_attrs *a = &in->attrs;
  const op_type *xt = mlir_vtype(s, in->in[0]), *ot = mlir_vtype(s, in->out);
  const char *T = mlir_elem(ot->dtype);
  name_t v, xp, acc, win;
  op_type pt, wt = {ot->dtype, 2, {a->window[0], a->window[1]}};
  mlir_const(e, v, ot->dtype, max ? -INFINITY : 0);
  pad_image(e, xp, mlir_vname(s, in->in[0]), xt, a->padding, v, &pt);
  filled(e, acc, ot, v);
  mlir_empty(e, win, &wt); /* gives the window loops their ranges, as linalg's pooling ops do */
  mlir_generic g;
  memset(&g, 0, sizeof g);
  char ry[64], rx[64];
  window_expr(ry, sizeof ry, 1, a->stride[0], 4, 1);
  window_expr(rx, sizeof rx, 2, a->stride[1], 5, 1);
  g.n_dims = 6, g.iters = "pppprr", g.n_in = 2, g.n_out = 1;
  g.name[0] = xp, g.type[0] = &pt;
  snprintf(g.map[0], sizeof g.map[0], "d0, %s, %s, d3", ry, rx);
  g.name[1] = win, g.type[1] = &wt;
  snprintf(g.map[1], sizeof g.map[1], "d4, d5");
  g.name[2] = acc, g.type[2] = ot;
  snprintf(g.map[2], sizeof g.map[2], "d0, d1, d2, d3");
  mlir_generic_begin(e, &g);
  name_t r;
  if (max)
    mlir_scalar_extremum(e, true, ot->dtype, g.arg[2], g.arg[0], r);
  else
    mlir_line(e, "%s = arith.addf %s, %s : %s", mlir_fresh(e, r), g.arg[2], g.arg[0], T);
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
}

/* The image rows [y0, y1) window row o covers: [o*s - pad, +k) clipped to
 * [0, len) (pool_window in the kernels) */
static void window_rows(mlir_emitter *e, const char *o, int stride, int pad, int k, int64_t len, char *y0, char *y1) {
  name_t cs, cp, ck, cl, z, t, st, end;
  mlir_const_int(e, cs, "index", stride), mlir_const_int(e, cp, "index", pad);
  mlir_const_int(e, ck, "index", k), mlir_const_int(e, cl, "index", len), mlir_const_int(e, z, "index", 0);
  idx_op(e, t, "muli", o, cs);
  idx_op(e, st, "subi", t, cp);
  idx_op(e, y0, "maxsi", st, z);
  idx_op(e, end, "addi", st, ck);
  idx_op(e, y1, "minsi", end, cl);
}

/* the count of image elements in window (oy, ox), as a float of dt */
static void window_count(mlir_emitter *e, kiln_dtype dt, const char *y0, const char *y1, const char *x0,
                         const char *x1, char *out) {
  name_t h, w, n, n64;
  idx_op(e, h, "subi", y1, y0);
  idx_op(e, w, "subi", x1, x0);
  idx_op(e, n, "muli", h, w);
  mlir_line(e, "%s = arith.index_cast %s : index to i64", mlir_fresh(e, n64), n);
  mlir_line(e, "%s = arith.sitofp %s : i64 to %s", mlir_fresh(e, out), n64, mlir_elem(dt));
}

static int emit_avg_pool(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_attrs *a = &in->attrs;
  const op_type *xt = mlir_vtype(s, in->in[0]), *ot = mlir_vtype(s, in->out);
  name_t sum, init;
  pool_reduce(e, s, in, false, sum);
  mlir_generic g; /* each sum divided by its window's count */
  const char *nm = sum;
  memset(&g, 0, sizeof g);
  mlir_empty(e, init, ot);
  g.n_dims = 4, g.iters = "pppp", g.n_in = 1, g.n_out = 1;
  g.name[0] = nm, g.type[0] = ot, g.name[1] = init, g.type[1] = ot;
  mlir_identity_map(g.map[0], sizeof g.map[0], 4);
  mlir_identity_map(g.map[1], sizeof g.map[1], 4);
  mlir_generic_begin(e, &g);
  name_t oy, ox, y0, y1, x0, x1, cnt, r;
  mlir_line(e, "%s = linalg.index 1 : index", mlir_fresh(e, oy));
  mlir_line(e, "%s = linalg.index 2 : index", mlir_fresh(e, ox));
  window_rows(e, oy, a->stride[0], a->padding[0], a->window[0], xt->shape[1], y0, y1);
  window_rows(e, ox, a->stride[1], a->padding[2], a->window[1], xt->shape[2], x0, x1);
  window_count(e, ot->dtype, y0, y1, x0, x1, cnt);
  mlir_line(e, "%s = arith.divf %s, %s : %s", mlir_fresh(e, r), g.arg[0], cnt, mlir_elem(ot->dtype));
  const char *y = r;
  mlir_generic_end(e, &g, 1, &y);
  strcpy(out, g.res);
  return 0;
}

/* for iy in [y0, y1), ix in [x0, x1) carrying one value of type T: opens
 * the two loops; the caller writes the body and closes with window_end */
typedef struct window_loop {
  name_t iy, ix, cur, r0, r1;
  const char *type;
} window_loop;

static void window_begin(mlir_emitter *e, window_loop *w, const char *y0, const char *y1, const char *x0,
                         const char *x1, const char *init, const char *type) {
  name_t c0;
  w->type = type;
  mlir_for_begin(e, y0, y1, init, type, w->iy, c0, w->r0);
  mlir_for_begin(e, x0, x1, c0, type, w->ix, w->cur, w->r1);
}

static void window_end(mlir_emitter *e, window_loop *w, const char *val, char *out) {
  mlir_for_end(e, val, w->type);
  mlir_for_end(e, w->r1, w->type);
  strcpy(out, w->r0);
}

/* The pooling gradients: for each (n, oy, ox, c), dx over the window gets
 * its share of dy; the kernels' loops, so each dx element sums in their order. */
static int emit_pool_grad(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  const op_attrs *a = &in->attrs;
  bool max = in->op == OP_MAX_POOL2D_GRAD;
  const op_type *ot = mlir_vtype(s, in->out), *dyt = mlir_vtype(s, in->in[max ? 1 : 0]);
  const char *x = max ? mlir_vname(s, in->in[0]) : NULL, *dy = mlir_vname(s, in->in[max ? 1 : 0]);
  kiln_dtype dt = ot->dtype;
  const char *T = mlir_elem(dt);
  char ts[256], dys[256];
  mlir_type(ts, ot), mlir_type(dys, dyt);
  name_t z, acc;
  mlir_const(e, z, dt, 0);
  filled(e, acc, ot, z);
  int64_t ext[4] = {dyt->shape[0], dyt->shape[1], dyt->shape[2], dyt->shape[3]};
  mlir_nest l;
  mlir_nest_begin(e, &l, 4, ext, acc, ts);
  const char *n = l.iv[0], *c = l.iv[3];
  name_t y0, y1, x0, x1, g, share;
  window_rows(e, l.iv[1], a->stride[0], a->padding[0], a->window[0], ot->shape[1], y0, y1);
  window_rows(e, l.iv[2], a->stride[1], a->padding[2], a->window[1], ot->shape[2], x0, x1);
  mlir_line(e, "%s = tensor.extract %s[%s, %s, %s, %s] : %s", mlir_fresh(e, g), dy, n, l.iv[1], l.iv[2], c, dys);
  window_loop w;
  name_t m;
  if (max) { /* the window's max, then how many elements equal it */
    name_t ninf, v, nm, cnt, one, cv, nc, pos, q;
    mlir_const(e, ninf, dt, -INFINITY);
    window_begin(e, &w, y0, y1, x0, x1, ninf, T);
    mlir_line(e, "%s = tensor.extract %s[%s, %s, %s, %s] : %s", mlir_fresh(e, v), x, n, w.iy, w.ix, c, ts);
    mlir_scalar_extremum(e, true, dt, w.cur, v, nm);
    window_end(e, &w, nm, m);
    window_begin(e, &w, y0, y1, x0, x1, z, T);
    mlir_line(e, "%s = tensor.extract %s[%s, %s, %s, %s] : %s", mlir_fresh(e, v), x, n, w.iy, w.ix, c, ts);
    name_t eq;
    mlir_line(e, "%s = arith.cmpf oeq, %s, %s : %s", mlir_fresh(e, eq), v, m, T);
    mlir_const(e, one, dt, 1);
    mlir_line(e, "%s = arith.select %s, %s, %s : %s", mlir_fresh(e, cv), eq, one, z, T);
    mlir_line(e, "%s = arith.addf %s, %s : %s", mlir_fresh(e, nc), w.cur, cv, T);
    window_end(e, &w, nc, cnt);
    mlir_line(e, "%s = arith.cmpf ogt, %s, %s : %s", mlir_fresh(e, pos), cnt, z, T);
    mlir_line(e, "%s = arith.divf %s, %s : %s", mlir_fresh(e, q), g, cnt, T);
    mlir_line(e, "%s = arith.select %s, %s, %s : %s", mlir_fresh(e, share), pos, q, z, T);
  } else {
    name_t cnt;
    window_count(e, dt, y0, y1, x0, x1, cnt);
    mlir_line(e, "%s = arith.divf %s, %s : %s", mlir_fresh(e, share), g, cnt, T);
  }
  window_begin(e, &w, y0, y1, x0, x1, l.cur, ts);
  name_t add, old, sum, next;
  if (max) {
    name_t v, eq;
    mlir_line(e, "%s = tensor.extract %s[%s, %s, %s, %s] : %s", mlir_fresh(e, v), x, n, w.iy, w.ix, c, ts);
    mlir_line(e, "%s = arith.cmpf oeq, %s, %s : %s", mlir_fresh(e, eq), v, m, T);
    mlir_line(e, "%s = arith.select %s, %s, %s : %s", mlir_fresh(e, add), eq, share, z, T);
  } else {
    strcpy(add, share);
  }
  mlir_line(e, "%s = tensor.extract %s[%s, %s, %s, %s] : %s", mlir_fresh(e, old), w.cur, n, w.iy, w.ix, c, ts);
  mlir_line(e, "%s = arith.addf %s, %s : %s", mlir_fresh(e, sum), old, add, T);
  mlir_line(e, "%s = tensor.insert %s into %s[%s, %s, %s, %s] : %s", mlir_fresh(e, next), sum, w.cur, n, w.iy, w.ix,
            c, ts);
  name_t dx;
  window_end(e, &w, next, dx);
  mlir_nest_end(e, &l, dx, out);
  return 0;
}

int mlir_emit_window(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out) {
  switch (in->op) {
  case OP_CONV2D: return emit_conv2d(e, s, in, out);
  case OP_CONV2D_BP_INPUT: return emit_conv2d_bp_input(e, s, in, out);
  case OP_CONV2D_BP_FILTER: return emit_conv2d_bp_filter(e, s, in, out);
  case OP_MAX_POOL2D: pool_reduce(e, s, in, true, out); return 0;
  case OP_AVG_POOL2D: return emit_avg_pool(e, s, in, out);
  default: return emit_pool_grad(e, s, in, out);
  }
}
