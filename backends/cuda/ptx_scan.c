/* ptx_scan.c — a scan whose body is elementwise (plan_scan_elementwise,
 * the plan's shared decision) as ONE kernel with the loop over t on the
 * device (plan_policy.scan_one_kernel): a thread per element of the row
 * (grid-stride), its carries in registers across t, the xs read and the ys
 * written at row t (from the last row down when reversed), the carries
 * stored once after the loop. One launch instead of a launch (or several)
 * per row: a cumulative sum over 1000 rows is one kernel, not 1000.
 *
 * The element code is target-independent: kiln_debug_cuda_scan emits the
 * very same code for the host and runs it in LLVM's interpreter, so the
 * loop's arithmetic (rows, order, carries, captures) is tested without a
 * GPU. */
#include <llvm-c/Core.h>
#include <llvm-c/ExecutionEngine.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/compile.h"

enum {
  SCAN_INSTRS = 64, /* a body of at most this many instructions (fusions' included) */
};

/* KILN_CUDA_SCAN_LOOPS=1: every scan a host loop over its body's kernels
 * (the device loop off; tests, benchmarks). Read at each compile. */
bool cuda_scan_loops(void) {
  const char *env = getenv("KILN_CUDA_SCAN_LOOPS");
  return env && !strcmp(env, "1");
}

bool cuda_scan_one_kernel(const ir_func *f, const ir_instr *in) {
  return !cuda_scan_loops() && plan_scan_elementwise(f, in, SCAN_INSTRS);
}

/* ---- the element code ---- */

/* One scan's element code: its pointers and the error flag. */
typedef struct {
  llvm_emit *e;
  const ir_instr *sc;
  LLVMValueRef *in;  /* per operand of the scan: its pointer */
  LLVMValueRef *out; /* per result: its pointer */
  LLVMValueRef bad;  /* i1 alloca: some element failed */
  op_id bad_op;      /* the first op whose check can fail, or OP_COUNT */
} sgen;

/* an alloca of t in the function's entry block (promoted to a register) */
static LLVMValueRef entry_var(llvm_emit *e, LLVMTypeRef t, const char *name) {
  LLVMBasicBlockRef entry = LLVMGetEntryBasicBlock(LLVMGetBasicBlockParent(LLVMGetInsertBlock(e->b)));
  LLVMBuilderRef b = LLVMCreateBuilderInContext(e->ctx);
  LLVMValueRef first = LLVMGetFirstInstruction(entry);
  if (first) LLVMPositionBuilderBefore(b, first);
  else LLVMPositionBuilderAtEnd(b, entry);
  LLVMValueRef v = LLVMBuildAlloca(b, t, name);
  LLVMDisposeBuilder(b);
  return v;
}

/* ORs g->bad into the flag (the first failing op noted) */
static void flush(sgen *s, llvm_group *g) {
  if (g->bad_op != OP_COUNT && s->bad_op == OP_COUNT) s->bad_op = g->bad_op;
  if (!g->bad) return;
  LLVMBuilderRef b = s->e->b;
  LLVMBuildStore(b, LLVMBuildOr(b, LLVMBuildLoad2(b, s->e->t_i1, s->bad, ""), g->bad, ""), s->bad);
  g->bad = NULL;
}

static int scan_element(sgen *s, LLVMValueRef i) {
  llvm_emit *e = s->e;
  LLVMBuilderRef b = e->b;
  const ir_instr *sc = s->sc;
  const ir_func *body = sc->attrs.callee;
  int nc = sc->attrs.n_state, nx = sc->attrs.n_xs, ny = sc->n_out - nc, nr = body->n_results;
  const op_type *rt = &body->types[0];
  int64_t T = sc->attrs.trip, n = plan_type_size(rt);
  LLVMValueRef *bbuf = calloc((size_t)body->n_values + 1, sizeof *bbuf), *vals = calloc((size_t)nr + 1, sizeof *vals);
  LLVMValueRef *acc = calloc((size_t)nc + 1, sizeof *acc);
  llvm_group *fg = calloc((size_t)body->n_instrs + 1, sizeof *fg);
  if (!bbuf || !vals || !acc || !fg) {
    free(bbuf), free(vals), free(acc), free(fg);
    return cuda_oom();
  }
  int rc = 0;
  /* the groups: the body's (its captures read from their buffers), one per fusion */
  for (int k = nc + nx; k < sc->n_in; k++) bbuf[k] = s->in[k];
  llvm_group bg = {.e = e, .f = body, .buf = bbuf};
  llvm_group_init(&bg);
  for (int q = 0; q < body->n_instrs && !rc; q++) {
    const ir_instr *in = &body->instrs[q];
    if (in->op != OP_FUSION) continue;
    const ir_func *c = in->attrs.callee;
    LLVMValueRef *cbuf = calloc((size_t)c->n_values + 1, sizeof *cbuf);
    if (!cbuf) {
      rc = cuda_oom();
      break;
    }
    for (int k = 0; k < in->n_in; k++) cbuf[k] = bbuf[in->in[k]]; /* a capture's buffer, else NULL: given per element */
    fg[q] = (llvm_group){.e = e, .f = c, .buf = cbuf};
    llvm_group_init(&fg[q]);
  }
  /* the carries in: element i of the scan's first operands */
  for (int k = 0; k < nc && !rc; k++) {
    kiln_dtype dt = body->types[k].dtype;
    acc[k] = entry_var(e, llvm_value_type(e, dt), "carry");
    LLVMBuildStore(b, llvm_emit_load(e, dt, s->in[k], i), acc[k]);
  }
  llvm_loop lt;
  if (!rc) {
    /* t = 0 .. T-1, or T-1 down to 0 when reversed */
    LLVMValueRef t = llvm_loop_begin(e, &lt, llvm_i64(e, 0), llvm_i64(e, T), "t");
    if (sc->attrs.reverse) t = LLVMBuildSub(b, llvm_i64(e, T - 1), t, "");
    LLVMValueRef at = LLVMBuildAdd(b, LLVMBuildMul(b, t, llvm_i64(e, n), ""), i, ""); /* element i of row t */
    llvm_index idx;
    llvm_index_linear(&idx, rt, i);
    for (int k = 0; k < nc; k++)
      llvm_group_set(&bg, k, &idx, LLVMBuildLoad2(b, llvm_value_type(e, body->types[k].dtype), acc[k], ""));
    for (int k = nc; k < nc + nx; k++) llvm_group_set(&bg, k, &idx, llvm_emit_load(e, body->types[k].dtype, s->in[k], at));
    rc = llvm_scan_body_values(body, &bg, fg, &idx, vals);
    if (!rc) { /* every value first, then the stores (a carry may be another's new value) */
      for (int k = 0; k < nc; k++) LLVMBuildStore(b, vals[k], acc[k]);
      for (int k = 0; k < ny; k++) llvm_emit_store(e, body->types[body->results[nc + k]].dtype, s->out[nc + k], at, vals[nc + k]);
    }
    flush(s, &bg);
    for (int q = 0; q < body->n_instrs; q++)
      if (fg[q].f) flush(s, &fg[q]), llvm_group_forget(&fg[q]);
    llvm_group_forget(&bg);
  }
  if (!rc) {
    llvm_loop_end(e, &lt);
    /* the carries out: element i of the scan's first results */
    for (int k = 0; k < nc; k++) {
      kiln_dtype dt = body->types[k].dtype;
      llvm_emit_store(e, dt, s->out[k], i, LLVMBuildLoad2(b, llvm_value_type(e, dt), acc[k], ""));
    }
  }
  for (int q = 0; q < body->n_instrs; q++)
    if (fg[q].f) free(fg[q].buf), llvm_group_dispose(&fg[q]);
  llvm_group_dispose(&bg);
  free(bbuf), free(vals), free(acc), free(fg);
  return rc;
}

/* ---- the kernel ---- */

int cuda_emit_scan(kctx *k, bool *can_fail) {
  llvm_emit *e = &k->cb->e;
  const ir_instr *sc = k->g->special;
  int64_t n = plan_type_size(&sc->attrs.callee->types[0]);
  LLVMValueRef *in = calloc((size_t)sc->n_in + 1, sizeof *in);
  if (!in) return cuda_oom();
  for (int q = 0; q < sc->n_in; q++) in[q] = k->buf[sc->in[q]];
  sgen s = {.e = e, .sc = sc, .in = in, .out = k->outp, .bad = k->bad, .bad_op = OP_COUNT};
  cuda_launch_1d(k->st, n);
  sloop l;
  LLVMValueRef i = cuda_grid_loop_begin(e, &l, n);
  int rc = scan_element(&s, i);
  if (!rc) cuda_grid_loop_end(e, &l);
  free(in);
  *can_fail = s.bad_op != OP_COUNT;
  if (*can_fail) k->st->op = s.bad_op;
  return rc;
}

/* ---- the host check ---- */

/* a constant's data: its host pointer, for the interpreter */
static LLVMValueRef host_const(void *user, const kiln_tensor *t) {
  llvm_emit *e = user;
  return LLVMConstIntToPtr(llvm_i64(e, (int64_t)(intptr_t)t->data), e->t_ptr);
}

void cuda_host_emit_init(llvm_emit *e, const char *name) {
  LLVMContextRef ctx = LLVMContextCreate();
  llvm_emit_init(e, ctx, LLVMModuleCreateWithNameInContext(name, ctx));
  e->const_data = host_const;
  e->user = e;
  e->exact_fmod = true; /* as the GPU's */
}

/* x as the integer of its bits (and back) */
static LLVMValueRef bits(llvm_emit *e, LLVMValueRef x) {
  return LLVMBuildBitCast(e->b, x, LLVMGetTypeKind(LLVMTypeOf(x)) == LLVMFloatTypeKind ? e->t_i32 : e->t_i64, "");
}
static LLVMValueRef sign_mask(llvm_emit *e, LLVMValueRef xi) {
  return LLVMTypeOf(xi) == e->t_i32 ? llvm_i32(e, INT32_MIN) : llvm_i64(e, INT64_MIN);
}
static LLVMValueRef copysign_of(llvm_emit *e, LLVMValueRef x, LLVMValueRef y) {
  LLVMBuilderRef b = e->b;
  LLVMValueRef xi = bits(e, x), yi = bits(e, y), m = sign_mask(e, xi);
  LLVMValueRef r = LLVMBuildOr(b, LLVMBuildAnd(b, xi, LLVMBuildNot(b, m, ""), ""), LLVMBuildAnd(b, yi, m, ""), "");
  return LLVMBuildBitCast(b, r, LLVMTypeOf(x), "");
}

/* floor (up 0) or ceil (up 1) of x: through i64 where |x| < 2^52, else x
 * (big, infinite, NaN); the sign of x kept (-0.5 rounds up to -0) */
static LLVMValueRef round_of(llvm_emit *e, LLVMValueRef x, bool up) {
  LLVMBuilderRef b = e->b;
  LLVMTypeRef t = LLVMTypeOf(x);
  LLVMValueRef ax = LLVMBuildBitCast(b, LLVMBuildAnd(b, bits(e, x), LLVMBuildNot(b, sign_mask(e, bits(e, x)), ""), ""), t, "");
  LLVMValueRef small = LLVMBuildFCmp(b, LLVMRealOLT, ax, llvm_const_f(t, 4503599627370496.0), "");
  LLVMValueRef tr = LLVMBuildSIToFP(b, LLVMBuildFPToSI(b, LLVMBuildSelect(b, small, x, llvm_const_f(t, 0), ""), e->t_i64, ""), t, "");
  LLVMValueRef off = up ? LLVMBuildFCmp(b, LLVMRealOLT, tr, x, "") : LLVMBuildFCmp(b, LLVMRealOGT, tr, x, "");
  tr = LLVMBuildSelect(b, off, LLVMBuildFAdd(b, tr, llvm_const_f(t, up ? 1 : -1), ""), tr, "");
  return LLVMBuildSelect(b, small, copysign_of(e, tr, x), x, "");
}

int cuda_host_intrinsics(llvm_emit *e, LLVMModuleRef mod) {
  LLVMBuilderRef b = e->b;
  for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn)) {
    size_t len = 0;
    const char *name = LLVMGetValueName2(fn, &len);
    if (strncmp(name, "llvm.", 5) != 0) continue;
    LLVMValueRef call;
    while (LLVMGetFirstUse(fn) && (call = LLVMGetUser(LLVMGetFirstUse(fn)))) {
      int n = LLVMGetNumArgOperands(call);
      LLVMValueRef a[3] = {NULL, NULL, NULL};
      for (int k = 0; k < n && k < 3; k++) a[k] = LLVMGetOperand(call, (unsigned)k);
      LLVMTypeKind tk = a[0] ? LLVMGetTypeKind(LLVMTypeOf(a[0])) : LLVMVoidTypeKind;
      bool fl = tk == LLVMFloatTypeKind || tk == LLVMDoubleTypeKind, in = tk == LLVMIntegerTypeKind;
      LLVMPositionBuilderBefore(b, call);
      LLVMValueRef r = NULL;
      if (fl && !strncmp(name, "llvm.fabs.", 10)) {
        LLVMValueRef xi = bits(e, a[0]);
        r = LLVMBuildBitCast(b, LLVMBuildAnd(b, xi, LLVMBuildNot(b, sign_mask(e, xi), ""), ""), LLVMTypeOf(a[0]), "");
      } else if (fl && !strncmp(name, "llvm.copysign.", 14)) {
        r = copysign_of(e, a[0], a[1]);
      } else if (fl && (!strncmp(name, "llvm.maximum.", 13) || !strncmp(name, "llvm.minimum.", 13))) {
        bool mx = name[7] == 'x'; /* "llvm.maximum" */
        LLVMValueRef nan = LLVMBuildFCmp(b, LLVMRealUNO, a[0], a[1], "");
        LLVMValueRef xi = bits(e, a[0]), yi = bits(e, a[1]);
        LLVMValueRef eq = LLVMBuildBitCast(b, mx ? LLVMBuildAnd(b, xi, yi, "") : LLVMBuildOr(b, xi, yi, ""), LLVMTypeOf(a[0]), "");
        LLVMValueRef pick = LLVMBuildSelect(b, LLVMBuildFCmp(b, mx ? LLVMRealOGT : LLVMRealOLT, a[0], a[1], ""), a[0], a[1], "");
        pick = LLVMBuildSelect(b, LLVMBuildFCmp(b, LLVMRealOEQ, a[0], a[1], ""), eq, pick, "");
        r = LLVMBuildSelect(b, nan, LLVMBuildFAdd(b, a[0], a[1], ""), pick, "");
      } else if (in && (!strncmp(name, "llvm.smax.", 10) || !strncmp(name, "llvm.smin.", 10))) {
        bool mx = name[7] == 'a';
        r = LLVMBuildSelect(b, LLVMBuildICmp(b, mx ? LLVMIntSGT : LLVMIntSLT, a[0], a[1], ""), a[0], a[1], "");
      } else if (fl && !strncmp(name, "llvm.fma.", 9)) {
        if (tk == LLVMFloatTypeKind) {
          LLVMValueRef x = LLVMBuildFPExt(b, a[0], e->t_f64, ""), y = LLVMBuildFPExt(b, a[1], e->t_f64, "");
          LLVMValueRef z = LLVMBuildFPExt(b, a[2], e->t_f64, "");
          r = LLVMBuildFPTrunc(b, LLVMBuildFAdd(b, LLVMBuildFMul(b, x, y, ""), z, ""), e->t_f32, "");
        } else {
          r = LLVMBuildFAdd(b, LLVMBuildFMul(b, a[0], a[1], ""), a[2], "");
        }
      } else if (fl && (!strncmp(name, "llvm.floor.", 11) || !strncmp(name, "llvm.ceil.", 10))) {
        r = round_of(e, a[0], name[5] == 'c');
      } else {
        return kiln_set_error("cuda: the host run has no %s (an op of the element code needs it)", name);
      }
      LLVMReplaceAllUsesWith(call, r);
      LLVMInstructionEraseFromParent(call);
    }
  }
  return 0;
}

int kiln_debug_cuda_scan(const ir_func *f, kiln_tensor *const *args, kiln_tensor *const *results) {
  if (!f || !args || !results) return kiln_set_error("cuda: kiln_debug_cuda_scan: bad arguments");
  if (ir_verify(f)) return -1;
  const ir_instr *sc = f->n_instrs == 1 ? &f->instrs[0] : NULL;
  if (!sc || sc->op != OP_SCAN || f->n_results != sc->n_out)
    return kiln_set_error("cuda: kiln_debug_cuda_scan: @%s is not one scan", f->name);
  for (int k = 0; k < sc->n_in; k++)
    if (ir_def(f, sc->in[k])) return kiln_set_error("cuda: kiln_debug_cuda_scan: @%s: operand %d is no parameter", f->name, k);
  for (int r = 0; r < f->n_results; r++)
    if (f->results[r] != sc->out + r)
      return kiln_set_error("cuda: kiln_debug_cuda_scan: @%s: result %d is not the scan's", f->name, r);
  if (!plan_scan_elementwise(f, sc, SCAN_INSTRS))
    return kiln_set_error("cuda: kiln_debug_cuda_scan: @%s: the scan is no device loop (its body is not elementwise)",
                          f->name);
  for (int p = 0; p < f->n_params; p++)
    if (!cuda_host_type_is(args[p], &f->types[p]))
      return kiln_set_error("cuda: kiln_debug_cuda_scan: argument %d is not a CPU tensor of the parameter's type", p);
  for (int r = 0; r < f->n_results; r++)
    if (!cuda_host_type_is(results[r], &f->types[f->results[r]]))
      return kiln_set_error("cuda: kiln_debug_cuda_scan: result %d is not a CPU tensor of the result's type", r);
  llvm_emit e;
  cuda_host_emit_init(&e, "scan");
  LLVMContextRef ctx = e.ctx;
  LLVMModuleRef mod = e.mod;
  /* void scan(ptr params..., ptr results...): a loop over the row's elements */
  int np = f->n_params, nres = f->n_results, rc = 0;
  LLVMTypeRef *ps = malloc(((size_t)np + (size_t)nres + 1) * sizeof *ps);
  LLVMValueRef *in = calloc((size_t)sc->n_in + 1, sizeof *in), *out = calloc((size_t)nres + 1, sizeof *out);
  if (!ps || !in || !out) rc = cuda_oom();
  LLVMValueRef fn = NULL;
  if (!rc) {
    for (int q = 0; q < np + nres; q++) ps[q] = e.t_ptr;
    fn = LLVMAddFunction(mod, "scan", LLVMFunctionType(e.t_void, ps, (unsigned)(np + nres), 0));
    LLVMPositionBuilderAtEnd(e.b, LLVMAppendBasicBlockInContext(ctx, fn, "entry"));
    for (int q = 0; q < sc->n_in; q++) in[q] = LLVMGetParam(fn, (unsigned)sc->in[q]);
    for (int r = 0; r < nres; r++) out[r] = LLVMGetParam(fn, (unsigned)(np + r));
    LLVMValueRef bad = entry_var(&e, e.t_i1, "bad");
    LLVMBuildStore(e.b, LLVMConstInt(e.t_i1, 0, 0), bad);
    sgen s = {.e = &e, .sc = sc, .in = in, .out = out, .bad = bad, .bad_op = OP_COUNT};
    llvm_loop l;
    LLVMValueRef i = llvm_loop_begin(&e, &l, llvm_i64(&e, 0), llvm_i64(&e, plan_type_size(&sc->attrs.callee->types[0])), "i");
    rc = scan_element(&s, i);
    if (!rc) {
      llvm_loop_end(&e, &l);
      LLVMBuildRetVoid(e.b);
    }
  }
  free(ps), free(in), free(out);
  if (!rc) rc = cuda_host_intrinsics(&e, mod);
  llvm_emit_dispose(&e);
  LLVMExecutionEngineRef ee = NULL;
  if (rc)
    LLVMDisposeModule(mod);
  else
    rc = cuda_host_engine(mod, "kiln_debug_cuda_scan", &ee);
  if (!rc) {
    LLVMGenericValueRef *a = calloc((size_t)np + (size_t)nres + 1, sizeof *a);
    if (!a) {
      rc = cuda_oom();
    } else {
      for (int p = 0; p < np; p++) a[p] = LLVMCreateGenericValueOfPointer(args[p]->data);
      for (int r = 0; r < nres; r++) a[np + r] = LLVMCreateGenericValueOfPointer(results[r]->data);
      LLVMGenericValueRef ret = LLVMRunFunction(ee, fn, (unsigned)(np + nres), a);
      LLVMDisposeGenericValue(ret);
      for (int q = 0; q < np + nres; q++) LLVMDisposeGenericValue(a[q]);
      free(a);
    }
    LLVMDisposeExecutionEngine(ee);
  }
  LLVMContextDispose(ctx);
  return rc;
}
