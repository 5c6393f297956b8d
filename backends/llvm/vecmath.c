/* vecmath.c — Kiln's own vector math, emitted as LLVM IR: exp, log, log1p,
 * tanh, sigmoid, sin, cos and pow for f32 and f64. libm's scalar calls stop
 * the loop vectorizer; these are straight-line code (selects, never
 * branches) that it widens to whole registers. Each is an internal,
 * always-inline function of the module ("kiln.exp.f32"), emitted once.
 *
 * Methods: Cody-Waite reduction and polynomials (Taylor, or Chebyshev fits
 * computed with mpmath; the f32 tanh's a relative-error minimax fit by
 * Lawson's iteration), as Cephes and fdlibm do; the f32 exp, log, tanh and
 * sigmoid are those of the eager kernels (lib/kernels_elementwise.c), bit
 * for bit. sin and cos reduce by pi/2 with Payne-Hanek in integer
 * arithmetic over a table of the bits of 2/pi, so they stay accurate for
 * every finite argument; f64 pow carries log in double-double. Accuracy:
 * tests/vecmath_test.cc. */
#include <math.h>
#include <stdio.h>

#include "llvm_emit.h"

typedef struct vm {
  llvm_emit *e;
  LLVMTypeRef t;  /* float, double, or a vector of either */
  LLVMTypeRef it; /* the integer type of the same width (and lanes) */
  bool f64;
} vm;

static LLVMTypeRef with_lanes(LLVMTypeRef like, LLVMTypeRef scalar) {
  if (LLVMGetTypeKind(like) == LLVMVectorTypeKind) return LLVMVectorType(scalar, LLVMGetVectorSize(like));
  return scalar;
}

static vm vm_for(llvm_emit *e, LLVMTypeRef t) {
  LLVMTypeRef s = LLVMGetTypeKind(t) == LLVMVectorTypeKind ? LLVMGetElementType(t) : t;
  bool f64 = s == e->t_f64;
  return (vm){e, t, with_lanes(t, f64 ? e->t_i64 : e->t_i32), f64};
}

/* the same lanes in another scalar type */
static vm vm_as(const vm *m, bool f64) { return vm_for(m->e, with_lanes(m->t, f64 ? m->e->t_f64 : m->e->t_f32)); }

#define B (m->e->b)
static LLVMValueRef K(const vm *m, double c) { return llvm_const_f(m->t, c); }
static LLVMValueRef KI(const vm *m, int64_t c) { return llvm_const_i(m->it, c); }
static LLVMValueRef add(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFAdd(B, a, b, ""); }
static LLVMValueRef sub(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFSub(B, a, b, ""); }
static LLVMValueRef mul(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFMul(B, a, b, ""); }
static LLVMValueRef vdiv(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildFDiv(B, a, b, ""); }
static LLVMValueRef neg(const vm *m, LLVMValueRef a) { return LLVMBuildFNeg(B, a, ""); }
static LLVMValueRef vfma(const vm *m, LLVMValueRef a, LLVMValueRef b, LLVMValueRef c) {
  LLVMValueRef args[3] = {a, b, c};
  return llvm_intr(m->e, "llvm.fma", args, 3);
}
static LLVMValueRef fabs1(const vm *m, LLVMValueRef a) { return llvm_intr(m->e, "llvm.fabs", &a, 1); }
static LLVMValueRef floor1(const vm *m, LLVMValueRef a) { return llvm_intr(m->e, "llvm.floor", &a, 1); }
static LLVMValueRef copysign2(const vm *m, LLVMValueRef a, LLVMValueRef s) {
  LLVMValueRef args[2] = {a, s};
  return llvm_intr(m->e, "llvm.copysign", args, 2);
}
static LLVMValueRef fc(const vm *m, LLVMRealPredicate p, LLVMValueRef a, LLVMValueRef b) {
  return LLVMBuildFCmp(B, p, a, b, "");
}
static LLVMValueRef ic(const vm *m, LLVMIntPredicate p, LLVMValueRef a, LLVMValueRef b) {
  return LLVMBuildICmp(B, p, a, b, "");
}
static LLVMValueRef sel(const vm *m, LLVMValueRef c, LLVMValueRef a, LLVMValueRef b) {
  return LLVMBuildSelect(B, c, a, b, "");
}
static LLVMValueRef bits(const vm *m, LLVMValueRef f) { return LLVMBuildBitCast(B, f, m->it, ""); }
static LLVMValueRef fbits(const vm *m, LLVMValueRef i) { return LLVMBuildBitCast(B, i, m->t, ""); }
static LLVMValueRef iadd(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildAdd(B, a, b, ""); }
static LLVMValueRef isub(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildSub(B, a, b, ""); }
static LLVMValueRef imul(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildMul(B, a, b, ""); }
static LLVMValueRef iand(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildAnd(B, a, b, ""); }
static LLVMValueRef ior(const vm *m, LLVMValueRef a, LLVMValueRef b) { return LLVMBuildOr(B, a, b, ""); }
static LLVMValueRef shl(const vm *m, LLVMValueRef a, int64_t n) {
  return LLVMBuildShl(B, a, llvm_const_i(LLVMTypeOf(a), n), "");
}
static LLVMValueRef lshr(const vm *m, LLVMValueRef a, int64_t n) {
  return LLVMBuildLShr(B, a, llvm_const_i(LLVMTypeOf(a), n), "");
}
static LLVMValueRef ashr(const vm *m, LLVMValueRef a, int64_t n) {
  return LLVMBuildAShr(B, a, llvm_const_i(LLVMTypeOf(a), n), "");
}
static LLVMValueRef isnan1(const vm *m, LLVMValueRef a) { return fc(m, LLVMRealUNO, a, a); }
/* Horner: c[0] * x^(n-1) + ... + c[n-1] */
static LLVMValueRef horner(const vm *m, LLVMValueRef x, const double *c, int n) {
  LLVMValueRef p = K(m, c[0]);
  for (int i = 1; i < n; i++) p = vfma(m, p, x, K(m, c[i]));
  return p;
}
/* a + b exactly as hi + lo (Knuth's two-sum) */
static void two_sum(const vm *m, LLVMValueRef a, LLVMValueRef b, LLVMValueRef *hi, LLVMValueRef *lo) {
  LLVMValueRef s = add(m, a, b), bb = sub(m, s, a);
  *lo = add(m, sub(m, a, sub(m, s, bb)), sub(m, b, bb));
  *hi = s;
}

/* ---- one internal function per (math function, type) ---- */

typedef LLVMValueRef (*vm_body)(const vm *m, LLVMValueRef *args);

static void type_suffix(LLVMTypeRef t, const llvm_emit *e, char *buf, size_t n) {
  if (LLVMGetTypeKind(t) == LLVMVectorTypeKind)
    snprintf(buf, n, "v%u%s", LLVMGetVectorSize(t), LLVMGetElementType(t) == e->t_f64 ? "f64" : "f32");
  else
    snprintf(buf, n, "%s", t == e->t_f64 ? "f64" : "f32");
}

static LLVMValueRef vm_call(llvm_emit *e, const char *base, vm_body body, LLVMValueRef *args, int n) {
  LLVMTypeRef t = LLVMTypeOf(args[0]);
  char name[64], sfx[16];
  type_suffix(t, e, sfx, sizeof sfx);
  snprintf(name, sizeof name, "kiln.%s.%s", base, sfx);
  LLVMTypeRef params[2] = {t, t};
  LLVMTypeRef ft = LLVMFunctionType(t, params, (unsigned)n, 0);
  LLVMValueRef fn = LLVMGetNamedFunction(e->mod, name);
  if (!fn) {
    fn = LLVMAddFunction(e->mod, name, ft);
    LLVMSetLinkage(fn, LLVMInternalLinkage);
    const char *attrs[] = {"alwaysinline", "nounwind", "willreturn", "nosync", "nofree"};
    for (size_t i = 0; i < sizeof attrs / sizeof *attrs; i++) {
      unsigned kind = LLVMGetEnumAttributeKindForName(attrs[i], strlen(attrs[i]));
      LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(e->ctx, kind, 0));
    }
    LLVMBuilderRef outer = e->b;
    e->b = LLVMCreateBuilderInContext(e->ctx);
    LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, fn, "entry"));
    vm m = vm_for(e, t);
    LLVMValueRef p[2] = {LLVMGetParam(fn, 0), n > 1 ? LLVMGetParam(fn, 1) : NULL};
    LLVMBuildRet(e->b, body(&m, p));
    LLVMDisposeBuilder(e->b);
    e->b = outer;
  }
  return LLVMBuildCall2(e->b, ft, fn, args, (unsigned)n, "");
}

/* y * 2^k for an integer-valued float k that may exceed the exponent range
 * by one factor: two factors 2^(k/2) and 2^(k - k/2), each normal */
static LLVMValueRef scale_pow2(const vm *m, LLVMValueRef y, LLVMValueRef k) {
  LLVMValueRef n = LLVMBuildFPToSI(B, k, m->it, "");
  LLVMValueRef n1 = LLVMBuildSDiv(B, n, KI(m, 2), ""), n2 = isub(m, n, n1);
  int bias = m->f64 ? 1023 : 127, mant = m->f64 ? 52 : 23;
  LLVMValueRef s1 = fbits(m, shl(m, iadd(m, n1, KI(m, bias)), mant));
  LLVMValueRef s2 = fbits(m, shl(m, iadd(m, n2, KI(m, bias)), mant));
  return mul(m, mul(m, y, s1), s2);
}

/* ---- exp ---- */

/* Adding 1.5 * 2^23 rounds an f32 below 2^22 in magnitude to an integer k,
 * and the sum's bits are 0x4b400000 + k: f32 powers of two are built from
 * them, never by a conversion (fptosi of NaN would be poison). */
static LLVMValueRef round_shift(const vm *m) { return K(m, 0x1.8p23); }

/* f64: e^r for |r| <= ln2/2 + a little: Taylor to r^13 (the next term is
 * below 2^-57 of the result) */
static LLVMValueRef exp_core_f64(const vm *m, LLVMValueRef r) {
  static const double c[] = {1.0 / 6227020800, 1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800,
                             1.0 / 362880,     1.0 / 40320,     1.0 / 5040,     1.0 / 720,
                             1.0 / 120,        1.0 / 24,        1.0 / 6,        0.5};
  LLVMValueRef p = horner(m, r, c, 12);
  return add(m, vfma(m, p, mul(m, r, r), r), K(m, 1));
}

/* f32: the eager kernel's exp_clamped_f32, e^x for x in [-104, 89] or NaN:
 * e^x = 2^k e^r, |r| <= ln2/2, a degree-6 fit, 2^k as 2^floor(k/2)
 * 2^ceil(k/2) (k reaches 128 and -150) from u = k + 254 */
static LLVMValueRef exp_clamped_f32(const vm *m, LLVMValueRef xc) {
  LLVMValueRef kb = vfma(m, xc, K(m, (double)1.44269504f), round_shift(m)), k = sub(m, kb, round_shift(m));
  LLVMValueRef r = vfma(m, k, K(m, -0.693359375), xc);
  r = vfma(m, k, K(m, (double)2.12194440e-4f), r);
  static const double c[] = {(double)1.392617612e-03f, (double)8.363173075e-03f, (double)4.166655466e-02f,
                             (double)1.666657703e-01f, 0.5};
  LLVMValueRef p = add(m, vfma(m, horner(m, r, c, 5), mul(m, r, r), r), K(m, 1));
  LLVMValueRef u = isub(m, bits(m, kb), KI(m, 0x4b400000 - 254)), h = lshr(m, u, 1);
  return mul(m, mul(m, p, fbits(m, shl(m, h, 23))), fbits(m, shl(m, isub(m, u, h), 23)));
}

/* max(x, lo) and min(x, hi) as selects that a NaN x passes through */
static LLVMValueRef clamp_below(const vm *m, LLVMValueRef x, double lo) {
  return sel(m, fc(m, LLVMRealOLT, x, K(m, lo)), K(m, lo), x);
}
static LLVMValueRef clamp_above(const vm *m, LLVMValueRef x, double hi) {
  return sel(m, fc(m, LLVMRealOGT, x, K(m, hi)), K(m, hi), x);
}

static LLVMValueRef exp_body(const vm *m, LLVMValueRef *a) {
  LLVMValueRef x = a[0];
  if (!m->f64) return exp_clamped_f32(m, clamp_above(m, clamp_below(m, x, -104), 89)); /* e^89 overflows */
  LLVMValueRef xc = sel(m, fc(m, LLVMRealOGT, x, K(m, -746)), x, K(m, -746));
  xc = sel(m, fc(m, LLVMRealOLT, xc, K(m, 710)), xc, K(m, 710));
  LLVMValueRef shift = K(m, 0x1.8p52);
  LLVMValueRef k = sub(m, vfma(m, xc, K(m, 0x1.71547652b82fep+0), shift), shift);
  LLVMValueRef r = vfma(m, k, K(m, -0x1.62e42fefa39efp-1), xc); /* ln 2 in two parts */
  r = vfma(m, k, K(m, -0x1.abc9e3b39803fp-56), r);
  LLVMValueRef y = scale_pow2(m, exp_core_f64(m, r), k);
  return sel(m, isnan1(m, x), add(m, x, x), y);
}

/* ---- log ---- */

/* log of x's special values: 0 -> -inf, negative -> NaN, +inf -> +inf,
 * NaN -> quiet NaN; r elsewhere (finite x > 0) */
static LLVMValueRef log_special(const vm *m, LLVMValueRef x, LLVMValueRef r) {
  LLVMValueRef ux = bits(m, x);
  int64_t sign = m->f64 ? INT64_MIN : INT32_MIN, absm = m->f64 ? INT64_MAX : INT32_MAX;
  int64_t inf = m->f64 ? 0x7ff0000000000000 : 0x7f800000, quiet = m->f64 ? 0x0008000000000000 : 0x00400000;
  int64_t qnan = m->f64 ? 0x7ff8000000000000 : 0x7fc00000,
          ninf = m->f64 ? (int64_t)0xfff0000000000000 : (int32_t)0xff800000;
  LLVMValueRef special = sel(m, ic(m, LLVMIntEQ, iand(m, ux, KI(m, absm)), KI(m, 0)), KI(m, ninf),
                             sel(m, ic(m, LLVMIntUGT, ux, KI(m, sign)), KI(m, qnan),
                                 sel(m, ic(m, LLVMIntEQ, ux, KI(m, inf)), ux, ior(m, ux, KI(m, quiet)))));
  LLVMValueRef ok = ic(m, LLVMIntULT, isub(m, ux, KI(m, 1)), KI(m, inf - 1)); /* finite, > 0 */
  return sel(m, ok, r, fbits(m, special));
}

/* x = 2^e m with m in [sqrt(1/2), sqrt(2)); subnormals scaled first */
static void log_split(const vm *m, LLVMValueRef x, LLVMValueRef *e, LLVMValueRef *mm) {
  bool d = m->f64;
  LLVMValueRef ux = bits(m, x);
  LLVMValueRef sub1 = ic(m, LLVMIntULT, ux, KI(m, d ? 0x0010000000000000 : 0x00800000));
  LLVMValueRef xs = mul(m, x, sel(m, sub1, K(m, d ? 0x1p54 : 0x1p23), K(m, 1)));
  LLVMValueRef u = bits(m, xs), mb = iand(m, u, KI(m, d ? 0xfffffffffffff : 0x7fffff));
  LLVMValueRef big = ic(m, LLVMIntUGT, mb, KI(m, d ? 0x6a09e667f3bcd : 0x3504f3));
  LLVMValueRef ex = iand(m, lshr(m, u, d ? 52 : 23), KI(m, d ? 0x7ff : 0xff));
  ex = isub(m, ex, KI(m, d ? 1023 : 127));
  ex = isub(m, ex, sel(m, sub1, KI(m, d ? 54 : 23), KI(m, 0)));
  *e = iadd(m, ex, LLVMBuildZExt(B, big, m->it, ""));
  *mm = fbits(
      m,
      ior(m, mb, sel(m, big, KI(m, d ? 0x3fe0000000000000 : 0x3f000000), KI(m, d ? 0x3ff0000000000000 : 0x3f800000))));
}

static LLVMValueRef log_body(const vm *m, LLVMValueRef *a) {
  LLVMValueRef x = a[0], e, mm, r;
  log_split(m, x, &e, &mm);
  LLVMValueRef f = sub(m, mm, K(m, 1)), fe = LLVMBuildSIToFP(B, e, m->t, "");
  if (!m->f64) { /* the eager kernel's log_f32 */
    static const double c[] = {(double)6.971611471e-02f,  (double)-1.147973385e-01f, (double)1.168541992e-01f,
                               (double)-1.242568733e-01f, (double)1.424905765e-01f,  (double)-1.666780232e-01f,
                               (double)2.000071575e-01f,  (double)-2.499999696e-01f, (double)3.333333118e-01f};
    LLVMValueRef q = horner(m, f, c, 9);
    LLVMValueRef y = mul(m, mul(m, f, mul(m, f, f)), q);
    y = vfma(m, fe, K(m, (double)-2.12194440e-4f), y);
    y = vfma(m, mul(m, K(m, -0.5), f), f, y);
    r = vfma(m, fe, K(m, 0.693359375), add(m, f, y));
  } else { /* fdlibm's scheme: s = f / (2 + f), log(1+f) = f - f^2/2 + s (f^2/2 + R(s^2)) */
    LLVMValueRef s = vdiv(m, f, add(m, K(m, 2), f)), z = mul(m, s, s);
    static const double c[] = {2.0 / 25, 2.0 / 23, 2.0 / 21, 2.0 / 19, 2.0 / 17, 2.0 / 15,
                               2.0 / 13, 2.0 / 11, 2.0 / 9,  2.0 / 7,  2.0 / 5,  2.0 / 3};
    LLVMValueRef R = mul(m, z, horner(m, z, c, 12));
    LLVMValueRef hfsq = mul(m, mul(m, K(m, 0.5), f), f);
    LLVMValueRef t = vfma(m, s, add(m, hfsq, R), mul(m, fe, K(m, 0x1.ef35793c76730p-45)));
    r = vfma(m, fe, K(m, 0x1.62e42fefa3800p-1), neg(m, sub(m, sub(m, hfsq, t), f)));
  }
  return log_special(m, x, r);
}

/* ---- log1p: log(u) corrected by the rounding error of u = 1 + x ---- */

static LLVMValueRef log1p_body(const vm *m, LLVMValueRef *a) {
  LLVMValueRef x = a[0], u = add(m, K(m, 1), x);
  LLVMValueRef lu = vm_call(m->e, "log", log_body, &u, 1);
  LLVMValueRef r = sub(m, lu, vdiv(m, sub(m, sub(m, u, K(m, 1)), x), u));
  r = sel(m, fc(m, LLVMRealOEQ, u, K(m, 1)), x, r); /* tiny x (and -0) */
  r = sel(m, fc(m, LLVMRealOEQ, x, K(m, INFINITY)), x, r);
  return sel(m, fc(m, LLVMRealOEQ, x, K(m, -1)), K(m, -INFINITY), r);
}

/* ---- tanh ---- */

/* f32: the eager kernel's tanh_f32: |x| clamped to 9.5 (NaN stays), h = (e^2|x|
 * - 1)/2 = 2^k (e^2r - 1)/2 + (2^k - 1)/2 with k = floor(2|x| / ln2), tanh =
 * h / (h + 1), refined below 0.55 by one step of t = h (1 - t) */
static LLVMValueRef tanh_f32(const vm *m, LLVMValueRef x) {
  LLVMValueRef a = clamp_above(m, fabs1(m, x), 9.5);
  LLVMValueRef kb = add(m, vfma(m, a, K(m, (double)2.88539004f), K(m, -0.5)), round_shift(m));
  LLVMValueRef k = sub(m, kb, round_shift(m));
  LLVMValueRef r = vfma(m, k, K(m, -(double)0.346573591f), a); /* ln2 / 2 in one part: k <= 27 */
  static const double c[] = {(double)1.71554089e-02f, (double)4.22738381e-02f, (double)1.33836105e-01f,
                             (double)3.33275706e-01f, (double)6.66669607e-01f, (double)9.99999940e-01f};
  LLVMValueRef p = horner(m, r, c, 6);
  LLVMValueRef s = fbits(m, iadd(m, shl(m, bits(m, kb), 23), KI(m, 0x3f800000))); /* 2^k */
  LLVMValueRef h = vfma(m, s, vfma(m, p, mul(m, r, r), r), vfma(m, s, K(m, 0.5), K(m, -0.5)));
  LLVMValueRef q = vdiv(m, h, add(m, h, K(m, 1))), cq = vfma(m, neg(m, h), q, h);
  return copysign2(m, sel(m, fc(m, LLVMRealOLT, a, K(m, 0.55)), cq, q), x);
}

static LLVMValueRef tanh_body(const vm *m, LLVMValueRef *a) {
  LLVMValueRef x = a[0];
  if (!m->f64) return tanh_f32(m, x);
  LLVMValueRef ax = fabs1(m, x), s = mul(m, ax, ax);
  /* x + x^3 g(x^2), g a Chebyshev fit on [0, 0.625^2] (error 1.4e-19) */
  static const double c[] = {-0x1.47559de55bc91p-19, 0x1.99b26df70cccdp-17,  -0x1.370efd62e9535p-15,
                             0x1.92d3563b405ccp-14,  -0x1.f4fccb8116f0ap-13, 0x1.355204d5878bep-11,
                             -0x1.7da2fd76a3cf1p-10, 0x1.d6d3cc561e69ap-9,   -0x1.226e354ddfe9ap-7,
                             0x1.664f488279254p-6,   -0x1.ba1ba1ba1aff0p-5,  0x1.111111111110dp-3,
                             -0x1.5555555555555p-2};
  LLVMValueRef small = vfma(m, mul(m, ax, s), horner(m, s, c, 13), ax);
  LLVMValueRef t = mul(m, K(m, 2), sel(m, fc(m, LLVMRealOLT, ax, K(m, 22)), ax, K(m, 22)));
  LLVMValueRef ex = vm_call(m->e, "exp", exp_body, &t, 1);
  LLVMValueRef big = sub(m, K(m, 1), vdiv(m, K(m, 2), add(m, ex, K(m, 1))));
  /* NaN takes the polynomial: NaN; the sign last, so tanh(-0) = -0 */
  return copysign2(m, sel(m, fc(m, LLVMRealOGE, ax, K(m, 0.625)), big, small), x);
}

/* ---- sigmoid: e^-|x| never overflows; 1/(1+e) for x >= 0, e/(1+e) below ---- */

static LLVMValueRef sigmoid_body(const vm *m, LLVMValueRef *a) {
  LLVMValueRef x = a[0], nx = neg(m, fabs1(m, x));
  LLVMValueRef ex = m->f64 ? vm_call(m->e, "exp", exp_body, &nx, 1) : exp_clamped_f32(m, clamp_below(m, nx, -104));
  LLVMValueRef num = sel(m, fc(m, LLVMRealOGE, x, K(m, 0)), K(m, 1), ex);
  return vdiv(m, num, add(m, K(m, 1), ex));
}

/* ---- sin and cos ---- */

/* The bits of 2/pi after the binary point, 32 to a word, behind two words
 * of the zeros before it (computed with mpmath to 2400 bits). */
static const uint32_t two_over_pi[50] = {
    0,          0,          0xa2f9836e, 0x4e441529, 0xfc2757d1, 0xf534ddc0, 0xdb629599, 0x3c439041, 0xfe5163ab,
    0xdebbc561, 0xb7246e3a, 0x424dd2e0, 0x06492eea, 0x09d1921c, 0xfe1deb1c, 0xb129a73e, 0xe88235f5, 0x2ebb4484,
    0xe99c7026, 0xb45f7e41, 0x3991d639, 0x835339f4, 0x9c845f8b, 0xbdf9283b, 0x1ff897ff, 0xde05980f, 0xef2f118b,
    0x5a0a6d1f, 0x6d367ecf, 0x27cb09b7, 0x4f463f66, 0x9e5fea2d, 0x7527bac7, 0xebe5f17b, 0x3d0739f7, 0x8a5292ea,
    0x6bfb5fb1, 0x1f8d5d08, 0x56033046, 0xfc7b6bab, 0xf0cfbc20, 0x9af4361d, 0xa9e39161, 0x5ee61b08, 0x6599855f,
    0x14a06840, 0x8dffd880, 0x4d732731, 0x06061556, 0xca73a8c9};

static LLVMValueRef table_2opi(llvm_emit *e) {
  LLVMValueRef g = LLVMGetNamedGlobal(e->mod, "kiln.2opi");
  if (g) return g;
  LLVMValueRef w[50];
  for (int i = 0; i < 50; i++) w[i] = LLVMConstInt(e->t_i32, two_over_pi[i], 0);
  LLVMTypeRef at = LLVMArrayType2(e->t_i32, 50);
  g = LLVMAddGlobal(e->mod, at, "kiln.2opi");
  LLVMSetInitializer(g, LLVMConstArray2(e->t_i32, w, 50));
  LLVMSetGlobalConstant(g, 1);
  LLVMSetLinkage(g, LLVMInternalLinkage);
  LLVMSetUnnamedAddress(g, LLVMGlobalUnnamedAddr);
  return g;
}

/* |x| = q pi/2 + (rh + rl), |rh + rl| <= pi/4, for finite x (f64 lanes).
 * Payne-Hanek: x = mant 2^e, and x 2/pi mod 4 = mant W 2^-190 mod 4 where W
 * holds 192 bits of 2/pi from bit e-1 on (earlier bits add multiples of 4);
 * mant * W mod 2^192 in 32-bit limbs gives the quadrant (top two bits) and
 * the fraction to 2^-126, enough for the closest doubles to multiples of
 * pi/2 (2^-61 away). Below pi/4 there is nothing to reduce. */
static void reduce_pio2(const vm *m, LLVMValueRef x, LLVMValueRef *q, LLVMValueRef *rh, LLVMValueRef *rl) {
  llvm_emit *e = m->e;
  LLVMValueRef a = fabs1(m, x), u = bits(m, a);
  LLVMValueRef ex = iand(m, lshr(m, u, 52), KI(m, 0x7ff));
  LLVMValueRef mant = ior(m, iand(m, u, KI(m, 0xfffffffffffff)), KI(m, (int64_t)1 << 52));
  LLVMValueRef ee = isub(m, ex, KI(m, 1075));
  /* small and non-finite x use another path: keep the table reads in range */
  ee = sel(m, ic(m, LLVMIntSLT, ee, KI(m, -53)), KI(m, -53), ee);
  ee = sel(m, ic(m, LLVMIntSGT, ee, KI(m, 975)), KI(m, 975), ee);
  LLVMValueRef off = iadd(m, ee, KI(m, 62)); /* bit e-1 of 2/pi, behind the 64 zero bits */
  LLVMValueRef widx = lshr(m, off, 5);
  LLVMTypeRef i32t = with_lanes(m->t, e->t_i32);
  LLVMValueRef sh = LLVMBuildTrunc(B, iand(m, off, KI(m, 31)), i32t, "");
  LLVMValueRef tab = table_2opi(e), T[7];
  LLVMTypeRef at = LLVMArrayType2(e->t_i32, 50);
  for (int k = 0; k < 7; k++) {
    LLVMValueRef idx[2] = {llvm_const_i(m->it, 0), iadd(m, widx, KI(m, k))};
    LLVMValueRef p = LLVMBuildGEP2(B, at, tab, idx, 2, "");
    if (LLVMGetTypeKind(LLVMTypeOf(p)) == LLVMVectorTypeKind) { /* x a vector: a gather */
      unsigned n = LLVMGetVectorSize(i32t);
      LLVMTypeRef types[2] = {i32t, LLVMTypeOf(p)}, ft;
      LLVMValueRef fn = llvm_intrinsic(e, "llvm.masked.gather", types, 2, &ft);
      LLVMValueRef args[4] = {p, llvm_i32(e, 4), llvm_const_i(LLVMVectorType(e->t_i1, n), 1), LLVMGetPoison(i32t)};
      T[k] = llvm_call(e, fn, ft, args, 4);
      continue;
    }
    T[k] = LLVMBuildLoad2(B, i32t, p, "");
    LLVMSetAlignment(T[k], 4);
  }
  LLVMValueRef W[6], pl[6], ph[6];
  LLVMValueRef ml = iand(m, mant, KI(m, 0xffffffff)), mh = lshr(m, mant, 32);
  for (int k = 0; k < 6; k++) {
    LLVMValueRef args[3] = {T[k], T[k + 1], sh};
    W[k] = LLVMBuildZExt(B, llvm_intr(e, "llvm.fshl", args, 3), m->it, "");
    pl[k] = imul(m, ml, W[k]);
    ph[k] = imul(m, mh, W[k]);
  }
  LLVMValueRef lo32 = KI(m, 0xffffffff), carry = KI(m, 0), Q[6];
  for (int c = 5; c >= 0; c--) {
    LLVMValueRef s = iadd(m, iand(m, pl[c], lo32), carry);
    if (c + 1 <= 5) s = iadd(m, iadd(m, s, lshr(m, pl[c + 1], 32)), iand(m, ph[c + 1], lo32));
    if (c + 2 <= 5) s = iadd(m, s, lshr(m, ph[c + 2], 32));
    Q[c] = iand(m, s, lo32);
    carry = lshr(m, s, 32);
  }
  /* X: the fraction's top 64 bits, as a signed number: rounding to the
   * nearest quadrant for free; Y: the next 64 */
  LLVMValueRef X = ior(m, ior(m, shl(m, Q[0], 34), shl(m, Q[1], 2)), lshr(m, Q[2], 30));
  LLVMValueRef Y = ior(m, ior(m, shl(m, Q[2], 34), shl(m, Q[3], 2)), lshr(m, Q[4], 30));
  LLVMValueRef quad = isub(m, lshr(m, Q[0], 30), ashr(m, X, 63));
  LLVMValueRef xh = iand(m, X, KI(m, ~(int64_t)0x7ff)), xl = iand(m, X, KI(m, 0x7ff));
  LLVMValueRef fh = mul(m, LLVMBuildSIToFP(B, xh, m->t, ""), K(m, 0x1p-64));
  LLVMValueRef fl =
      vfma(m, LLVMBuildUIToFP(B, Y, m->t, ""), K(m, 0x1p-128), mul(m, LLVMBuildUIToFP(B, xl, m->t, ""), K(m, 0x1p-64)));
  LLVMValueRef s = add(m, fh, fl);
  fl = sub(m, fl, sub(m, s, fh));
  fh = s;
  /* times pi/2 = P1 + P2, in double-double */
  LLVMValueRef P1 = K(m, 0x1.921fb54442d18p+0), P2 = K(m, 0x1.1a62633145c07p-54);
  LLVMValueRef h = mul(m, fh, P1);
  LLVMValueRef l = add(m, vfma(m, fh, P1, neg(m, h)), vfma(m, fh, P2, mul(m, fl, P1)));
  s = add(m, h, l);
  l = sub(m, l, sub(m, s, h));
  h = s;
  LLVMValueRef small = fc(m, LLVMRealOLT, a, K(m, 0x1.921fb54442d18p-1));
  *rh = sel(m, small, a, h);
  *rl = sel(m, small, K(m, 0), l);
  *q = sel(m, small, KI(m, 0), iand(m, quad, KI(m, 3)));
}

/* sin and cos of rh + rl, |rh| <= pi/4: Taylor to r^17 and r^18 (next
 * terms below 2^-63), cos with fdlibm's care for 1 - r^2/2 */
static void sincos_kernel(const vm *m, LLVMValueRef rh, LLVMValueRef rl, LLVMValueRef *s, LLVMValueRef *c) {
  static const double sc[] = {1.0 / 355687428096000.0, -1.0 / 1307674368000.0, 1.0 / 6227020800.0, -1.0 / 39916800.0,
                              1.0 / 362880.0,          -1.0 / 5040.0,          1.0 / 120.0,        -1.0 / 6.0};
  static const double cc[] = {
      -1.0 / 6402373705728000.0, 1.0 / 20922789888000.0, -1.0 / 87178291200.0, 1.0 / 479001600.0,
      -1.0 / 3628800.0,          1.0 / 40320.0,          -1.0 / 720.0,         1.0 / 24.0};
  LLVMValueRef z = mul(m, rh, rh);
  LLVMValueRef sn = vfma(m, mul(m, rh, z), horner(m, z, sc, 8), rh);
  LLVMValueRef hz = mul(m, K(m, 0.5), z), w = sub(m, K(m, 1), hz);
  LLVMValueRef cs = add(m, w, add(m, sub(m, sub(m, K(m, 1), w), hz), mul(m, mul(m, z, z), horner(m, z, cc, 8))));
  *s = vfma(m, rl, cs, sn);
  *c = vfma(m, neg(m, rl), sn, cs);
}

static LLVMValueRef sincos_f64(const vm *m, LLVMValueRef x, bool want_cos) {
  LLVMValueRef q, rh, rl, s, c;
  reduce_pio2(m, x, &q, &rh, &rl);
  sincos_kernel(m, rh, rl, &s, &c);
  LLVMValueRef swap = ic(m, LLVMIntNE, iand(m, q, KI(m, 1)), KI(m, 0));
  LLVMValueRef r, flip;
  if (!want_cos) {
    r = sel(m, swap, c, s);
    flip = ic(m, LLVMIntNE, iand(m, q, KI(m, 2)), KI(m, 0));
    flip = LLVMBuildXor(B, flip, ic(m, LLVMIntSLT, bits(m, x), KI(m, 0)), ""); /* sin(-x) = -sin(x) */
  } else {
    r = sel(m, swap, s, c);
    flip = ic(m, LLVMIntNE, iand(m, iadd(m, q, KI(m, 1)), KI(m, 2)), KI(m, 0));
  }
  r = sel(m, flip, neg(m, r), r);
  LLVMValueRef finite = fc(m, LLVMRealOLT, fabs1(m, x), K(m, INFINITY));
  return sel(m, finite, r, sub(m, x, x)); /* inf and NaN: NaN */
}

/* f32 lanes compute in f64 and round once: within half an ulp or so */
static LLVMValueRef via_f64(const vm *m, LLVMValueRef x, LLVMValueRef (*f)(const vm *, LLVMValueRef, bool), bool flag) {
  if (m->f64) return f(m, x, flag);
  vm d = vm_as(m, true);
  LLVMValueRef xd = LLVMBuildFPExt(B, x, d.t, "");
  return LLVMBuildFPTrunc(B, f(&d, xd, flag), m->t, "");
}

static LLVMValueRef sin_body(const vm *m, LLVMValueRef *a) { return via_f64(m, a[0], sincos_f64, false); }
static LLVMValueRef cos_body(const vm *m, LLVMValueRef *a) { return via_f64(m, a[0], sincos_f64, true); }

/* ---- pow ---- */

/* log(a) for a >= 0 as lh + ll, to about 2^-64 relative (f64 lanes): log m
 * = 2s + 2s^3/3 + s^5 P(s^2), s = (m-1)/(m+1), the first two terms carried
 * in double-double */
static void log_dd(const vm *m, LLVMValueRef a, LLVMValueRef *lh, LLVMValueRef *ll) {
  LLVMValueRef e, mm;
  log_split(m, a, &e, &mm);
  LLVMValueRef f = sub(m, mm, K(m, 1)), ef = LLVMBuildSIToFP(B, e, m->t, "");
  LLVMValueRef dh = add(m, K(m, 2), f), dl = sub(m, f, sub(m, dh, K(m, 2)));
  LLVMValueRef sh = vdiv(m, f, dh);
  LLVMValueRef sl = vdiv(m, sub(m, vfma(m, neg(m, sh), dh, f), mul(m, sh, dl)), dh);
  LLVMValueRef s2h = mul(m, sh, sh);
  LLVMValueRef s2l = vfma(m, mul(m, K(m, 2), sh), sl, vfma(m, sh, sh, neg(m, s2h)));
  LLVMValueRef s3h = mul(m, s2h, sh);
  LLVMValueRef s3l = add(m, vfma(m, s2h, sh, neg(m, s3h)), vfma(m, s2h, sl, mul(m, s2l, sh)));
  LLVMValueRef ch = K(m, 0x1.5555555555555p-1), cl = K(m, 0x1.5555555555555p-55); /* 2/3 */
  LLVMValueRef t3h = mul(m, s3h, ch);
  LLVMValueRef t3l = add(m, vfma(m, s3h, ch, neg(m, t3h)), vfma(m, s3h, cl, mul(m, s3l, ch)));
  static const double c[] = {2.0 / 25, 2.0 / 23, 2.0 / 21, 2.0 / 19, 2.0 / 17, 2.0 / 15,
                             2.0 / 13, 2.0 / 11, 2.0 / 9,  2.0 / 7,  2.0 / 5};
  LLVMValueRef t5 = mul(m, mul(m, s3h, s2h), horner(m, s2h, c, 11));
  LLVMValueRef ah, al;
  two_sum(m, mul(m, K(m, 2), sh), t3h, &ah, &al);
  al = add(m, al, add(m, add(m, mul(m, K(m, 2), sl), t3l), t5));
  LLVMValueRef eh = mul(m, ef, K(m, 0x1.62e42fefa3800p-1)); /* exact: 11 x 42 bits */
  LLVMValueRef el = mul(m, ef, K(m, 0x1.ef35793c76730p-45));
  LLVMValueRef h, l;
  two_sum(m, eh, ah, &h, &l);
  l = add(m, l, add(m, al, el));
  LLVMValueRef s = add(m, h, l);
  l = sub(m, l, sub(m, s, h));
  h = s;
  LLVMValueRef special = log_special(m, a, h); /* 0, inf, NaN */
  LLVMValueRef ok = fc(m, LLVMRealOEQ, special, h);
  *lh = special;
  *ll = sel(m, ok, l, K(m, 0));
}

/* e^(th + tl) (f64 lanes) */
static LLVMValueRef exp_dd(const vm *m, LLVMValueRef th, LLVMValueRef tl) {
  LLVMValueRef c = sel(m, fc(m, LLVMRealOGT, th, K(m, -746)), th, K(m, -746));
  c = sel(m, fc(m, LLVMRealOLT, c, K(m, 710)), c, K(m, 710));
  tl = sel(m, fc(m, LLVMRealOEQ, c, th), tl, K(m, 0));
  LLVMValueRef shift = K(m, 0x1.8p52);
  LLVMValueRef k = sub(m, vfma(m, c, K(m, 0x1.71547652b82fep+0), shift), shift);
  LLVMValueRef a = vfma(m, neg(m, k), K(m, 0x1.62e42fefa3800p-1), c);
  LLVMValueRef b = vfma(m, neg(m, k), K(m, 0x1.ef35793c76730p-45), tl);
  LLVMValueRef rh, rl;
  two_sum(m, a, b, &rh, &rl);
  LLVMValueRef E = exp_core_f64(m, rh);
  E = vfma(m, E, rl, E);
  E = scale_pow2(m, E, k);
  return sel(m, isnan1(m, th), th, E);
}

/* C99's special cases of pow around r = |x|^y */
static LLVMValueRef pow_special(const vm *m, LLVMValueRef x, LLVMValueRef y, LLVMValueRef r) {
  LLVMValueRef yint = fc(m, LLVMRealOEQ, floor1(m, y), y);
  LLVMValueRef yh = mul(m, y, K(m, 0.5));
  LLVMValueRef yodd = LLVMBuildAnd(B, yint, fc(m, LLVMRealONE, floor1(m, yh), yh), "");
  LLVMValueRef xneg = ic(m, LLVMIntSLT, bits(m, x), KI(m, 0)); /* -0 too */
  r = sel(m, LLVMBuildAnd(B, xneg, yodd, ""), neg(m, r), r);
  LLVMValueRef finite_neg = LLVMBuildAnd(B, fc(m, LLVMRealOLT, x, K(m, 0)), fc(m, LLVMRealOGT, x, K(m, -INFINITY)), "");
  r = sel(m, LLVMBuildAnd(B, finite_neg, LLVMBuildNot(B, yint, ""), ""), K(m, NAN), r);
  LLVMValueRef one_inf =
      LLVMBuildAnd(B, fc(m, LLVMRealOEQ, fabs1(m, x), K(m, 1)), fc(m, LLVMRealOEQ, fabs1(m, y), K(m, INFINITY)), "");
  r = sel(m, one_inf, K(m, 1), r);
  LLVMValueRef one = LLVMBuildOr(B, fc(m, LLVMRealOEQ, x, K(m, 1)), fc(m, LLVMRealOEQ, y, K(m, 0)), "");
  return sel(m, one, K(m, 1), r);
}

static LLVMValueRef pow_f64(const vm *m, LLVMValueRef x, LLVMValueRef y) {
  LLVMValueRef lh, ll;
  log_dd(m, fabs1(m, x), &lh, &ll);
  LLVMValueRef th = mul(m, y, lh);
  LLVMValueRef tl = vfma(m, y, ll, vfma(m, y, lh, neg(m, th)));
  tl = sel(m, fc(m, LLVMRealOLT, fabs1(m, th), K(m, INFINITY)), tl, K(m, 0));
  return pow_special(m, x, y, exp_dd(m, th, tl));
}

static LLVMValueRef pow_body(const vm *m, LLVMValueRef *a) {
  if (m->f64) return pow_f64(m, a[0], a[1]);
  /* f32: e^(y log|x|) in f64 is far more precise than f32 needs */
  vm d = vm_as(m, true);
  LLVMValueRef x = LLVMBuildFPExt(B, a[0], d.t, ""), y = LLVMBuildFPExt(B, a[1], d.t, "");
  LLVMValueRef ax = fabs1(&d, x);
  LLVMValueRef l = vm_call(m->e, "log", log_body, &ax, 1);
  LLVMValueRef t = mul(&d, y, l);
  LLVMValueRef r = pow_special(&d, x, y, vm_call(m->e, "exp", exp_body, &t, 1));
  return LLVMBuildFPTrunc(B, r, m->t, "");
}

/* ---- entry points ---- */

LLVMValueRef llvm_vm_exp(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "exp", exp_body, &x, 1); }
LLVMValueRef llvm_vm_log(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "log", log_body, &x, 1); }
LLVMValueRef llvm_vm_log1p(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "log1p", log1p_body, &x, 1); }
LLVMValueRef llvm_vm_tanh(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "tanh", tanh_body, &x, 1); }
LLVMValueRef llvm_vm_sigmoid(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "sigmoid", sigmoid_body, &x, 1); }
LLVMValueRef llvm_vm_sin(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "sin", sin_body, &x, 1); }
LLVMValueRef llvm_vm_cos(llvm_emit *e, LLVMValueRef x) { return vm_call(e, "cos", cos_body, &x, 1); }
LLVMValueRef llvm_vm_pow(llvm_emit *e, LLVMValueRef x, LLVMValueRef y) {
  LLVMValueRef a[2] = {x, y};
  return vm_call(e, "pow", pow_body, a, 2);
}

/* ---- fmod, exact, in integer arithmetic (musl's fmod) ----
 * For targets that lower frem inexactly (NVPTX: x - trunc(x / y) * y):
 * the magnitudes' significands are reduced by shift-and-subtract, one step
 * per binade between x and y, so the result is fmod's to the bit. Scalars
 * only; it loops, so the vectorizer leaves it alone. */

/* the significand of a finite nonzero magnitude u (bits, sign cleared) with
 * its leading one at bit mant, and the exponent that goes with it */
static void fmod_unpack(const vm *m, LLVMValueRef u, LLVMValueRef *sig, LLVMValueRef *ex) {
  int w = m->f64 ? 64 : 32, mant = m->f64 ? 52 : 23;
  LLVMValueRef e = lshr(m, u, mant), frac = iand(m, u, KI(m, ((int64_t)1 << mant) - 1));
  LLVMValueRef args[2] = {frac, LLVMConstInt(m->e->t_i1, 0, 0)};
  LLVMValueRef s = isub(m, llvm_intr(m->e, "llvm.ctlz", args, 2), KI(m, w - 1 - mant)); /* subnormals: shift up */
  LLVMValueRef sub = ic(m, LLVMIntEQ, e, KI(m, 0));
  *sig = sel(m, sub, LLVMBuildShl(B, frac, s, ""), ior(m, frac, KI(m, (int64_t)1 << mant)));
  *ex = sel(m, sub, isub(m, KI(m, 1), s), e);
}

static LLVMValueRef fmod_body(const vm *m, LLVMValueRef *a) {
  llvm_emit *e = m->e;
  int w = m->f64 ? 64 : 32, mant = m->f64 ? 52 : 23;
  int64_t emax = m->f64 ? 0x7ff : 0xff;
  LLVMValueRef x = a[0], y = a[1], fn = LLVMGetBasicBlockParent(LLVMGetInsertBlock(B));
  LLVMValueRef ux = bits(m, x), uy = bits(m, y);
  LLVMValueRef sign = iand(m, ux, shl(m, KI(m, 1), w - 1)), abs_mask = lshr(m, KI(m, -1), 1);
  LLVMValueRef ax = iand(m, ux, abs_mask), ay = iand(m, uy, abs_mask);
  /* NaN for y = 0, y NaN, x infinite or NaN; x itself when |x| < |y|; a
   * signed zero when |x| = |y| */
  LLVMValueRef nan = LLVMBuildOr(B, ic(m, LLVMIntEQ, ay, KI(m, 0)),
                                 LLVMBuildOr(B, isnan1(m, y), ic(m, LLVMIntUGE, ax, KI(m, emax << mant)), ""), "");
  LLVMValueRef xy = mul(m, x, y);
  LLVMValueRef zero = mul(m, K(m, 0), x);
  LLVMValueRef easy = sel(m, nan, vdiv(m, xy, xy), sel(m, ic(m, LLVMIntEQ, ax, ay), zero, x));
  LLVMBasicBlockRef entry = LLVMGetInsertBlock(B);
  LLVMBasicBlockRef work = LLVMAppendBasicBlockInContext(e->ctx, fn, "work");
  LLVMBasicBlockRef head = LLVMAppendBasicBlockInContext(e->ctx, fn, "step");
  LLVMBasicBlockRef body = LLVMAppendBasicBlockInContext(e->ctx, fn, "sub");
  LLVMBasicBlockRef last = LLVMAppendBasicBlockInContext(e->ctx, fn, "last");
  LLVMBasicBlockRef pack = LLVMAppendBasicBlockInContext(e->ctx, fn, "pack");
  LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->ctx, fn, "done");
  LLVMBuildCondBr(B, LLVMBuildOr(B, nan, ic(m, LLVMIntULE, ax, ay), ""), done, work);
  LLVMPositionBuilderAtEnd(B, work);
  LLVMValueRef mx, ex, my, ey;
  fmod_unpack(m, ax, &mx, &ex);
  fmod_unpack(m, ay, &my, &ey);
  LLVMBuildBr(B, head);
  /* for (; ex > ey; ex--) { i = mx - my; if (i >= 0) { if (!i) return 0; mx = i; } mx <<= 1; } */
  LLVMPositionBuilderAtEnd(B, head);
  LLVMValueRef pm = LLVMBuildPhi(B, m->it, "mx"), pe = LLVMBuildPhi(B, m->it, "ex");
  LLVMAddIncoming(pm, &mx, &work, 1);
  LLVMAddIncoming(pe, &ex, &work, 1);
  LLVMBuildCondBr(B, ic(m, LLVMIntSGT, pe, ey), body, last);
  LLVMPositionBuilderAtEnd(B, body);
  LLVMValueRef i = isub(m, pm, my);
  LLVMValueRef ge = ic(m, LLVMIntSGE, i, KI(m, 0));
  LLVMValueRef nm = shl(m, sel(m, ge, i, pm), 1), ne = isub(m, pe, KI(m, 1));
  LLVMAddIncoming(pm, &nm, &body, 1);
  LLVMAddIncoming(pe, &ne, &body, 1);
  LLVMBasicBlockRef exact_zero = LLVMAppendBasicBlockInContext(e->ctx, fn, "zero");
  LLVMBuildCondBr(B, ic(m, LLVMIntEQ, i, KI(m, 0)), exact_zero, head);
  LLVMPositionBuilderAtEnd(B, last);
  i = isub(m, pm, my);
  LLVMValueRef r = sel(m, ic(m, LLVMIntSGE, i, KI(m, 0)), i, pm);
  LLVMBuildCondBr(B, ic(m, LLVMIntEQ, r, KI(m, 0)), exact_zero, pack);
  /* renormalize, then a normal or subnormal result with x's sign */
  LLVMPositionBuilderAtEnd(B, pack);
  LLVMValueRef args[2] = {r, LLVMConstInt(e->t_i1, 0, 0)};
  LLVMValueRef s = isub(m, llvm_intr(e, "llvm.ctlz", args, 2), KI(m, w - 1 - mant));
  r = LLVMBuildShl(B, r, s, "");
  LLVMValueRef re = isub(m, pe, s);
  LLVMValueRef normal = ior(m, isub(m, r, KI(m, (int64_t)1 << mant)), LLVMBuildShl(B, re, KI(m, mant), ""));
  LLVMValueRef subn = LLVMBuildLShr(B, r, isub(m, KI(m, 1), re), "");
  LLVMValueRef packed = fbits(m, ior(m, sign, sel(m, ic(m, LLVMIntSGT, re, KI(m, 0)), normal, subn)));
  LLVMBuildBr(B, done);
  LLVMPositionBuilderAtEnd(B, exact_zero);
  LLVMBuildBr(B, done);
  LLVMPositionBuilderAtEnd(B, done);
  LLVMValueRef res = LLVMBuildPhi(B, m->t, "fmod");
  LLVMValueRef vals[3] = {easy, packed, zero};
  LLVMBasicBlockRef from[3] = {entry, pack, exact_zero};
  LLVMAddIncoming(res, vals, from, 3);
  return res;
}

LLVMValueRef llvm_vm_fmod(llvm_emit *e, LLVMValueRef x, LLVMValueRef y) {
  LLVMValueRef a[2] = {x, y};
  return vm_call(e, "fmod", fmod_body, a, 2);
}
