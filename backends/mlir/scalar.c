/* scalar.c — the element functions of lib/kernels_elementwise.c and
 * lib/kernels_convert.c as arith and math ops, with the kernels' exact
 * meaning where MLIR's ops differ: NaN-propagating max/min that keep the
 * first operand on ties, integer division and mod by -1 without overflow,
 * integer pow by the kernels' rule for negative exponents, float->int
 * conversion saturating with NaN -> 0, f16/bf16 rounded once (through
 * round-to-odd). Also the spellings of types and literals. */
#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "mlir/emit.h"

const char *mlir_elem(kiln_dtype dt) {
  static const char *const names[KILN_DTYPE_COUNT] = {"f32", "f64", "i32", "i64", "i1", "f16", "bf16"};
  return dtype_valid(dt) ? names[dt] : "?";
}

char *mlir_type(char *buf, const op_type *t) {
  int n = snprintf(buf, 256, "tensor<");
  for (int i = 0; i < t->rank; i++) n += snprintf(buf + n, (size_t)(256 - n), "%lldx", (long long)t->shape[i]);
  snprintf(buf + n, (size_t)(256 - n), "%s>", mlir_elem(t->dtype));
  return buf;
}

static bool is_float(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16; }

/* a float's exact bit pattern, as MLIR reads hexadecimal float literals */
static void float_bits(char *buf, size_t n, kiln_dtype dt, double v) {
  if (dt == KILN_F64) {
    uint64_t u;
    memcpy(&u, &v, 8);
    snprintf(buf, n, "0x%016llX", (unsigned long long)u);
  } else if (dt == KILN_F32) {
    snprintf(buf, n, "0x%08X", f32_bits((float)v));
  } else {
    snprintf(buf, n, "0x%04X", dt == KILN_F16 ? kiln_f32_to_f16((float)v) : kiln_f32_to_bf16((float)v));
  }
}

void mlir_const_int(mlir_emitter *e, char *name, const char *type, long long v) {
  mlir_fresh(e, name);
  if (!strcmp(type, "i1"))
    mlir_line(e, "%s = arith.constant %s", name, v ? "true" : "false");
  else
    mlir_line(e, "%s = arith.constant %lld : %s", name, v, type);
}

void mlir_const(mlir_emitter *e, char *name, kiln_dtype dt, double v) {
  if (!is_float(dt)) {
    mlir_const_int(e, name, mlir_elem(dt), (long long)v);
    return;
  }
  char bits[32];
  float_bits(bits, sizeof bits, dt, v);
  mlir_fresh(e, name);
  mlir_line(e, "%s = arith.constant %s : %s", name, bits, mlir_elem(dt));
}

/* ---- tensor literals ---- */

static void put_elem(ir_buf *b, const kiln_tensor *t, int64_t i) {
  const char *p = (const char *)t->data;
  switch ((kiln_dtype)t->dtype) {
  case KILN_F32: ir_buf_printf(b, "0x%08X", ((const uint32_t *)p)[i]); break;
  case KILN_F64: ir_buf_printf(b, "0x%016llX", (unsigned long long)((const uint64_t *)p)[i]); break;
  case KILN_F16:
  case KILN_BF16: ir_buf_printf(b, "0x%04X", ((const uint16_t *)p)[i]); break;
  case KILN_I32: ir_buf_printf(b, "%d", ((const int32_t *)p)[i]); break;
  case KILN_I64: ir_buf_printf(b, "%lld", (long long)((const int64_t *)p)[i]); break;
  default: ir_buf_printf(b, "%s", p[i] ? "true" : "false"); break;
  }
}

/* elements [*i, *i + extent of dims d..) as nested lists */
static void put_dims(ir_buf *b, const kiln_tensor *t, int d, int64_t *i) {
  if (d == t->rank) {
    put_elem(b, t, (*i)++);
    return;
  }
  ir_buf_put(b, "[", 1);
  for (int64_t k = 0; k < t->shape[d]; k++) {
    if (k) ir_buf_put(b, ", ", 2);
    put_dims(b, t, d + 1, i);
  }
  ir_buf_put(b, "]", 1);
}

int mlir_tensor_const(mlir_emitter *e, const char *name, const kiln_tensor *t) {
  op_type ty;
  char ts[256];
  op_type_of(t, &ty);
  mlir_type(ts, &ty);
  if (t->size == 0) {
    mlir_line(e, "%s = tensor.empty() : %s", name, ts);
    return 0;
  }
  if (t->device != 0) return -1;
  size_t es = kiln_dtype_sizes[t->dtype];
  bool splat = true; /* one element repeated: dense<v> */
  for (int64_t i = 1; splat && i < t->size; i++) splat = !memcmp((const char *)t->data + i * es, t->data, es);
  mlir_start(e, "%s = arith.constant dense<", name); /* continue the line */
  int64_t i = 0;
  if (splat)
    put_elem(e->b, t, 0);
  else
    put_dims(e->b, t, 0, &i);
  ir_buf_printf(e->b, "> : %s\n", ts);
  return 0;
}

/* ---- element functions ---- */

/* one line "%out = <text>" with a fresh name */
static void op1(mlir_emitter *e, char *out, const char *fmt, ...) KILN_PRINTF(3, 4);
static void op1(mlir_emitter *e, char *out, const char *fmt, ...) {
  char text[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  mlir_fresh(e, out);
  mlir_line(e, "%s = %s", out, text);
}

/* the interpreter's float sign, relu and sigmoid: compares and selects */
static void float_sign(mlir_emitter *e, const char *T, kiln_dtype dt, const char *x, char *out) {
  char z[MLIR_NAME], one[MLIR_NAME], m1[MLIR_NAME], gt[MLIR_NAME], lt[MLIR_NAME], s[MLIR_NAME];
  mlir_const(e, z, dt, 0), mlir_const(e, one, dt, 1), mlir_const(e, m1, dt, -1);
  op1(e, gt, "arith.cmpf ogt, %s, %s : %s", x, z, T);
  op1(e, lt, "arith.cmpf olt, %s, %s : %s", x, z, T);
  op1(e, s, "arith.select %s, %s, %s : %s", lt, m1, x, T); /* 0 and NaN give themselves */
  op1(e, out, "arith.select %s, %s, %s : %s", gt, one, s, T);
}

static void float_sigmoid(mlir_emitter *e, const char *T, kiln_dtype dt, const char *x, char *out) {
  char a[MLIR_NAME], n[MLIR_NAME], ex[MLIR_NAME], z[MLIR_NAME], one[MLIR_NAME], ge[MLIR_NAME], num[MLIR_NAME],
      den[MLIR_NAME];
  op1(e, a, "math.absf %s : %s", x, T);
  op1(e, n, "arith.negf %s : %s", a, T);
  op1(e, ex, "math.exp %s : %s", n, T); /* e^-|x| never overflows */
  mlir_const(e, z, dt, 0), mlir_const(e, one, dt, 1);
  op1(e, ge, "arith.cmpf oge, %s, %s : %s", x, z, T);
  op1(e, num, "arith.select %s, %s, %s : %s", ge, one, ex, T);
  op1(e, den, "arith.addf %s, %s : %s", one, ex, T);
  op1(e, out, "arith.divf %s, %s : %s", num, den, T);
}

int mlir_scalar_unary(mlir_emitter *e, op_id op, kiln_dtype dt, const char *x, char *out) {
  const char *T = mlir_elem(dt);
  char z[MLIR_NAME], c[MLIR_NAME], t[MLIR_NAME];
  if (dt == KILN_BOOL) {
    if (op != OP_NOT) return -1;
    mlir_const_int(e, c, "i1", 1);
    op1(e, out, "arith.xori %s, %s : i1", x, c);
    return 0;
  }
  if (is_float(dt)) {
    static const char *const math[OP_COUNT] = {[OP_ABS] = "math.absf", [OP_EXP] = "math.exp",
                                               [OP_LOG] = "math.log", [OP_LOG1P] = "math.log1p",
                                               [OP_SQRT] = "math.sqrt", [OP_SIN] = "math.sin",
                                               [OP_COS] = "math.cos", [OP_TANH] = "math.tanh",
                                               [OP_FLOOR] = "math.floor", [OP_CEIL] = "math.ceil",
                                               [OP_NEG] = "arith.negf"};
    if (math[op]) {
      op1(e, out, "%s %s : %s", math[op], x, T);
      return 0;
    }
    switch (op) {
    case OP_SIGN: float_sign(e, T, dt, x, out); return 0;
    case OP_SIGMOID: float_sigmoid(e, T, dt, x, out); return 0;
    case OP_RSQRT: /* 1 / sqrt(x), as the kernel: math.rsqrt may be approximated */
      op1(e, t, "math.sqrt %s : %s", x, T);
      mlir_const(e, c, dt, 1);
      op1(e, out, "arith.divf %s, %s : %s", c, t, T);
      return 0;
    case OP_RELU: /* x < 0 ? 0 : x: NaN and -0 stay */
      mlir_const(e, z, dt, 0);
      op1(e, c, "arith.cmpf olt, %s, %s : %s", x, z, T);
      op1(e, out, "arith.select %s, %s, %s : %s", c, z, x, T);
      return 0;
    default: return -1;
    }
  }
  if (dt != KILN_I32 && dt != KILN_I64) return -1;
  mlir_const(e, z, dt, 0);
  switch (op) {
  case OP_NEG: op1(e, out, "arith.subi %s, %s : %s", z, x, T); return 0; /* wraps */
  case OP_ABS:
    op1(e, c, "arith.cmpi slt, %s, %s : %s", x, z, T);
    op1(e, t, "arith.subi %s, %s : %s", z, x, T);
    op1(e, out, "arith.select %s, %s, %s : %s", c, t, x, T);
    return 0;
  case OP_RELU:
    op1(e, c, "arith.cmpi slt, %s, %s : %s", x, z, T);
    op1(e, out, "arith.select %s, %s, %s : %s", c, z, x, T);
    return 0;
  case OP_SIGN: {
    char gt[MLIR_NAME], lt[MLIR_NAME], g[MLIR_NAME], l[MLIR_NAME];
    op1(e, gt, "arith.cmpi sgt, %s, %s : %s", x, z, T);
    op1(e, lt, "arith.cmpi slt, %s, %s : %s", x, z, T);
    op1(e, g, "arith.extui %s : i1 to %s", gt, T);
    op1(e, l, "arith.extui %s : i1 to %s", lt, T);
    op1(e, out, "arith.subi %s, %s : %s", g, l, T);
    return 0;
  }
  default: return -1;
  }
}

/* NaN in either operand gives NaN; otherwise x unless y wins strictly
 * (x > y for max): the kernels' el_max / el_min, ties keep x */
static void float_extremum(mlir_emitter *e, bool max, const char *T, const char *x, const char *y, char *out) {
  char c[MLIR_NAME], nan[MLIR_NAME], pick[MLIR_NAME];
  op1(e, c, "arith.cmpf %s, %s, %s : %s", max ? "ogt" : "olt", x, y, T);
  op1(e, nan, "arith.cmpf uno, %s, %s : %s", x, x, T);
  op1(e, pick, "arith.ori %s, %s : i1", c, nan);
  op1(e, out, "arith.select %s, %s, %s : %s", pick, x, y, T);
}

void mlir_scalar_extremum(mlir_emitter *e, bool max, kiln_dtype dt, const char *acc, const char *x, char *out) {
  const char *T = mlir_elem(dt);
  if (is_float(dt)) {
    float_extremum(e, max, T, x, acc, out); /* x replaces acc when it beats it or is NaN */
    return;
  }
  char c[MLIR_NAME];
  op1(e, c, "arith.cmpi %s, %s, %s : %s", max ? "sgt" : "slt", x, acc, T);
  op1(e, out, "arith.select %s, %s, %s : %s", c, x, acc, T);
}

/* integer division and mod: by zero is an error in Kiln (asserted here);
 * by -1 is negation (wrapping) and 0, never INT_MIN / -1 */
static void int_divmod(mlir_emitter *e, bool mod, const char *T, kiln_dtype dt, const char *x, const char *y,
                       char *out) {
  char z[MLIR_NAME], m1[MLIR_NAME], one[MLIR_NAME], nz[MLIR_NAME], ism1[MLIR_NAME], ys[MLIR_NAME], q[MLIR_NAME],
      alt[MLIR_NAME];
  mlir_const(e, z, dt, 0), mlir_const(e, m1, dt, -1), mlir_const(e, one, dt, 1);
  op1(e, nz, "arith.cmpi ne, %s, %s : %s", y, z, T);
  mlir_line(e, "cf.assert %s, \"%s: division by zero\"", nz, mod ? "mod" : "div");
  op1(e, ism1, "arith.cmpi eq, %s, %s : %s", y, m1, T);
  op1(e, ys, "arith.select %s, %s, %s : %s", ism1, one, y, T);
  op1(e, q, "arith.%s %s, %s : %s", mod ? "remsi" : "divsi", x, ys, T);
  if (mod)
    strcpy(alt, z);
  else
    op1(e, alt, "arith.subi %s, %s : %s", z, x, T);
  op1(e, out, "arith.select %s, %s, %s : %s", ism1, alt, q, T);
}

/* by squaring (math.ipowi) for y >= 0; for y < 0: 1 if x == 1, +-1 if
 * x == -1 (by y's parity), else 0 */
static void int_pow(mlir_emitter *e, const char *T, kiln_dtype dt, const char *x, const char *y, char *out) {
  char z[MLIR_NAME], one[MLIR_NAME], m1[MLIR_NAME], neg[MLIR_NAME], ye[MLIR_NAME], p[MLIR_NAME], odd[MLIR_NAME],
      sgn[MLIR_NAME], isone[MLIR_NAME], ism1[MLIR_NAME], a[MLIR_NAME], bb[MLIR_NAME], r[MLIR_NAME], bit[MLIR_NAME];
  mlir_const(e, z, dt, 0), mlir_const(e, one, dt, 1), mlir_const(e, m1, dt, -1);
  op1(e, neg, "arith.cmpi slt, %s, %s : %s", y, z, T);
  op1(e, ye, "arith.select %s, %s, %s : %s", neg, z, y, T);
  op1(e, p, "math.ipowi %s, %s : %s", x, ye, T);
  op1(e, bit, "arith.andi %s, %s : %s", y, one, T);
  op1(e, odd, "arith.cmpi ne, %s, %s : %s", bit, z, T);
  op1(e, sgn, "arith.select %s, %s, %s : %s", odd, m1, one, T);
  op1(e, isone, "arith.cmpi eq, %s, %s : %s", x, one, T);
  op1(e, ism1, "arith.cmpi eq, %s, %s : %s", x, m1, T);
  op1(e, a, "arith.select %s, %s, %s : %s", ism1, sgn, z, T);
  op1(e, bb, "arith.select %s, %s, %s : %s", isone, one, a, T);
  op1(e, r, "arith.select %s, %s, %s : %s", neg, bb, p, T);
  strcpy(out, r);
}

int mlir_scalar_binary(mlir_emitter *e, op_id op, kiln_dtype dt, const char *x, const char *y, char *out) {
  const char *T = mlir_elem(dt);
  if (dt == KILN_BOOL) {
    const char *o = op == OP_AND || op == OP_MIN ? "andi" : op == OP_OR || op == OP_MAX ? "ori" : NULL;
    if (!o) return -1;
    op1(e, out, "arith.%s %s, %s : i1", o, x, y);
    return 0;
  }
  if (is_float(dt)) {
    static const char *const arith[OP_COUNT] = {[OP_ADD] = "arith.addf", [OP_SUB] = "arith.subf",
                                                [OP_MUL] = "arith.mulf", [OP_DIV] = "arith.divf",
                                                [OP_POW] = "math.powf", [OP_MOD] = "arith.remf"};
    if (arith[op]) {
      op1(e, out, "%s %s, %s : %s", arith[op], x, y, T);
      return 0;
    }
    if (op != OP_MAX && op != OP_MIN) return -1;
    float_extremum(e, op == OP_MAX, T, x, y, out);
    return 0;
  }
  static const char *const arith[OP_COUNT] = {[OP_ADD] = "arith.addi", [OP_SUB] = "arith.subi",
                                              [OP_MUL] = "arith.muli", [OP_MAX] = "arith.maxsi",
                                              [OP_MIN] = "arith.minsi"};
  if (arith[op]) {
    op1(e, out, "%s %s, %s : %s", arith[op], x, y, T);
    return 0;
  }
  switch (op) {
  case OP_DIV: int_divmod(e, false, T, dt, x, y, out); return 0;
  case OP_MOD: int_divmod(e, true, T, dt, x, y, out); return 0;
  case OP_POW: int_pow(e, T, dt, x, y, out); return 0;
  default: return -1;
  }
}

int mlir_scalar_compare(mlir_emitter *e, op_id op, kiln_dtype dt, const char *x, const char *y, char *out) {
  int k = op - OP_EQ;
  if (k < 0 || k > OP_GE - OP_EQ) return -1;
  /* eq ne lt le gt ge; x != y holds for NaN (une), the others are ordered */
  static const char *const f[] = {"oeq", "une", "olt", "ole", "ogt", "oge"};
  static const char *const i[] = {"eq", "ne", "slt", "sle", "sgt", "sge"};
  static const char *const u[] = {"eq", "ne", "ult", "ule", "ugt", "uge"}; /* bool: 0 < 1 */
  if (is_float(dt))
    op1(e, out, "arith.cmpf %s, %s, %s : %s", f[k], x, y, mlir_elem(dt));
  else
    op1(e, out, "arith.cmpi %s, %s, %s : %s", dt == KILN_BOOL ? u[k] : i[k], x, y, mlir_elem(dt));
  return 0;
}

/* ---- conversions (kernels_convert.c) ---- */

/* the rounded value f (type F, bits I) moved toward zero when rounding
 * went away from it, then made odd when inexact */
static void to_odd(mlir_emitter *e, const char *f, const char *F, const char *I, const char *away,
                   const char *inexact, char *out) {
  char u[MLIR_NAME], a[MLIR_NAME], x[MLIR_NAME], d[MLIR_NAME], o[MLIR_NAME];
  op1(e, u, "arith.bitcast %s : %s to %s", f, F, I);
  op1(e, a, "arith.extui %s : i1 to %s", away, I);
  op1(e, x, "arith.extui %s : i1 to %s", inexact, I);
  op1(e, d, "arith.subi %s, %s : %s", u, a, I);
  op1(e, o, "arith.ori %s, %s : %s", d, x, I);
  op1(e, out, "arith.bitcast %s : %s to %s", o, I, F);
}

/* f64 -> f32 rounded to odd where inexact (lib/round_odd.h) */
static void f64_to_f32_odd(mlir_emitter *e, const char *x, char *out) {
  char f[MLIR_NAME], back[MLIR_NAME], ne[MLIR_NAME], ord[MLIR_NAME], inexact[MLIR_NAME], ab[MLIR_NAME],
      ax[MLIR_NAME], away[MLIR_NAME];
  op1(e, f, "arith.truncf %s : f64 to f32", x);
  op1(e, back, "arith.extf %s : f32 to f64", f);
  op1(e, ne, "arith.cmpf une, %s, %s : f64", back, x);
  op1(e, ord, "arith.cmpf ord, %s, %s : f64", x, x);
  op1(e, inexact, "arith.andi %s, %s : i1", ne, ord);
  op1(e, ab, "math.absf %s : f64", back);
  op1(e, ax, "math.absf %s : f64", x);
  op1(e, away, "arith.cmpf ogt, %s, %s : f64", ab, ax);
  to_odd(e, f, "f32", "i32", away, inexact, out);
}

/* i64 -> f64 rounded to odd where inexact (kernels_convert.c i64_f64_odd) */
static void i64_to_f64_odd(mlir_emitter *e, const char *x, char *out) {
  char d[MLIR_NAME], two63[MLIR_NAME], top[MLIR_NAME], zf[MLIR_NAME], dc[MLIR_NAME], b0[MLIR_NAME], mx[MLIR_NAME],
      back[MLIR_NAME], ne[MLIR_NAME], inexact[MLIR_NAME], z[MLIR_NAME], neg[MLIR_NAME], lt[MLIR_NAME], gt[MLIR_NAME],
      dir[MLIR_NAME], away[MLIR_NAME];
  op1(e, d, "arith.sitofp %s : i64 to f64", x);
  mlir_const(e, two63, KILN_F64, 0x1p63);
  op1(e, top, "arith.cmpf oge, %s, %s : f64", d, two63);
  mlir_const(e, zf, KILN_F64, 0);
  op1(e, dc, "arith.select %s, %s, %s : f64", top, zf, d); /* 2^63 itself has no i64 */
  op1(e, b0, "arith.fptosi %s : f64 to i64", dc);
  mlir_const_int(e, mx, "i64", INT64_MAX);
  op1(e, back, "arith.select %s, %s, %s : i64", top, mx, b0);
  op1(e, ne, "arith.cmpi ne, %s, %s : i64", back, x);
  op1(e, inexact, "arith.ori %s, %s : i1", top, ne);
  mlir_const_int(e, z, "i64", 0);
  op1(e, neg, "arith.cmpi slt, %s, %s : i64", x, z);
  op1(e, lt, "arith.cmpi slt, %s, %s : i64", back, x);
  op1(e, gt, "arith.cmpi sgt, %s, %s : i64", back, x);
  op1(e, dir, "arith.select %s, %s, %s : i1", neg, lt, gt);
  op1(e, away, "arith.ori %s, %s : i1", top, dir);
  to_odd(e, d, "f64", "i64", away, inexact, out);
}

/* float (f32 or f64) -> i32/i64: NaN -> 0, truncated toward zero,
 * saturated; the kernels' clamps (f32_i32 ... f64_i64) */
static void float_to_int(mlir_emitter *e, kiln_dtype from, kiln_dtype to, const char *x, char *out) {
  const char *F = mlir_elem(from), *I = mlir_elem(to);
  bool i64 = to == KILN_I64, f64 = from == KILN_F64;
  double lo = i64 ? -0x1p63 : -0x1p31;
  double up = i64 ? (f64 ? 9223372036854774784.0 : 9223371487098961920.0) : (f64 ? 2147483647.0 : 2147483520.0);
  char nan[MLIR_NAME], zf[MLIR_NAME], c0[MLIR_NAME], lof[MLIR_NAME], gl[MLIR_NAME], c1[MLIR_NAME], upf[MLIR_NAME],
      lu[MLIR_NAME], c2[MLIR_NAME], r[MLIR_NAME];
  op1(e, nan, "arith.cmpf uno, %s, %s : %s", x, x, F);
  mlir_const(e, zf, from, 0);
  op1(e, c0, "arith.select %s, %s, %s : %s", nan, zf, x, F);
  mlir_const(e, lof, from, lo);
  op1(e, gl, "arith.cmpf ogt, %s, %s : %s", c0, lof, F);
  op1(e, c1, "arith.select %s, %s, %s : %s", gl, c0, lof, F);
  mlir_const(e, upf, from, up);
  op1(e, lu, "arith.cmpf olt, %s, %s : %s", c1, upf, F);
  op1(e, c2, "arith.select %s, %s, %s : %s", lu, c1, upf, F);
  op1(e, r, "arith.fptosi %s : %s to %s", c2, F, I);
  if (f64 && !i64) { /* 2147483647.0 is exact: the clamp saturates */
    strcpy(out, r);
    return;
  }
  char top[MLIR_NAME], ge[MLIR_NAME], mx[MLIR_NAME];
  mlir_const(e, top, from, i64 ? 0x1p63 : 0x1p31);
  op1(e, ge, "arith.cmpf oge, %s, %s : %s", x, top, F);
  mlir_const_int(e, mx, I, i64 ? INT64_MAX : INT32_MAX);
  op1(e, out, "arith.select %s, %s, %s : %s", ge, mx, r, I);
}

void mlir_scalar_convert(mlir_emitter *e, kiln_dtype from, kiln_dtype to, const char *x, char *out) {
  const char *F = mlir_elem(from), *T = mlir_elem(to);
  char t[MLIR_NAME], u[MLIR_NAME];
  bool half_to = to == KILN_F16 || to == KILN_BF16, half_from = from == KILN_F16 || from == KILN_BF16;
  if (from == to) {
    strcpy(out, x);
  } else if (to == KILN_BOOL) { /* x != 0; NaN is true */
    mlir_const(e, t, from, 0);
    if (is_float(from))
      op1(e, out, "arith.cmpf une, %s, %s : %s", x, t, F);
    else
      op1(e, out, "arith.cmpi ne, %s, %s : %s", x, t, F);
  } else if (from == KILN_BOOL) {
    op1(e, out, "arith.%s %s : i1 to %s", is_float(to) ? "uitofp" : "extui", x, T);
  } else if (half_from && to != KILN_F32 && to != KILN_F64) { /* through f32, as the kernels */
    op1(e, t, "arith.extf %s : %s to f32", x, F);
    mlir_scalar_convert(e, KILN_F32, to, t, out);
  } else if (is_float(from) && is_float(to)) {
    if (half_to && from == KILN_F64) { /* rounded once: to odd first */
      f64_to_f32_odd(e, x, t);
      op1(e, out, "arith.truncf %s : f32 to %s", t, T);
    } else {
      bool wider = kiln_dtype_sizes[to] > kiln_dtype_sizes[from];
      op1(e, out, "arith.%s %s : %s to %s", wider ? "extf" : "truncf", x, F, T);
    }
  } else if (is_float(from)) {
    float_to_int(e, from, to, x, out);
  } else if (is_float(to)) {
    if (!half_to) {
      op1(e, out, "arith.sitofp %s : %s to %s", x, F, T);
    } else { /* exact (i32) or rounded to odd (i64) in f64, then to odd in f32, then once to f16/bf16 */
      if (from == KILN_I32)
        op1(e, t, "arith.sitofp %s : i32 to f64", x);
      else
        i64_to_f64_odd(e, x, t);
      f64_to_f32_odd(e, t, u);
      op1(e, out, "arith.truncf %s : f32 to %s", u, T);
    }
  } else { /* i32 <-> i64; narrowing wraps */
    op1(e, out, "arith.%s %s : %s to %s", to == KILN_I64 ? "extsi" : "trunci", x, F, T);
  }
}
