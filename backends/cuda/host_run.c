/* host_run.c — a function's CUDA plan run on the host, step by step, for
 * the tests (kiln_debug_cuda_run): an elementwise kernel by the very
 * element code ptx.c emits for it (cuda_emit_element), a window op's kernel
 * by its element code (ptx_window.c), both in LLVM's interpreter; any other
 * kernel of the backend's own (a dot, whose GPU code tiles through shared
 * memory) by the reference interpreter; copies as copies. So what the plan
 * wires (a fusion's head into a temporary, the fused kernel reading it, the
 * parameters and broadcasts it reads) and the kernels' arithmetic are
 * checked without a GPU. */
#include <llvm-c/Core.h>
#include <llvm-c/ExecutionEngine.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/compile.h"

/* the host address of slot s's bytes (NULL for a row: no scans here) */
static void *slot_ptr(const plan *pl, int s, kiln_tensor *const *args, kiln_tensor *const *results, char *arena) {
  const plan_slot *sl = &pl->slots[s];
  switch (sl->kind) {
    case PLAN_SLOT_PARAM: return args[sl->index]->data;
    case PLAN_SLOT_RESULT: return results[sl->index]->data;
    case PLAN_SLOT_ARENA: return arena + sl->offset;
    case PLAN_SLOT_CONST: return sl->cst->data;
    default: return NULL;
  }
}

/* Elementwise kernel g by its element code: void k(ptr per value of g->f,
 * ptr per output), a loop over the outputs' elements. ptr[v]: value v's
 * data where it is a leaf; out[o]: output o's. */
static int run_elementwise(const plan_kernel *g, void *const *ptr, void *const *out) {
  const ir_func *f = g->f;
  int nv = f->n_values, np = nv + g->n_out, rc = 0;
  llvm_emit e;
  cuda_host_emit_init(&e, "elementwise");
  LLVMContextRef ctx = e.ctx;
  LLVMModuleRef mod = e.mod;
  LLVMTypeRef *ps = malloc(((size_t)np + 1) * sizeof *ps);
  LLVMValueRef *buf = calloc((size_t)nv + 1, sizeof *buf), *outp = calloc((size_t)g->n_out + 1, sizeof *outp);
  LLVMValueRef fn = NULL;
  if (!ps || !buf || !outp) rc = cuda_oom();
  if (!rc) {
    for (int q = 0; q < np; q++) ps[q] = e.t_ptr;
    fn = LLVMAddFunction(mod, "k", LLVMFunctionType(e.t_void, ps, (unsigned)np, 0));
    LLVMPositionBuilderAtEnd(e.b, LLVMAppendBasicBlockInContext(ctx, fn, "entry"));
    for (int v = 0; v < nv; v++)
      if (g->leaf[v] >= 0) buf[v] = LLVMGetParam(fn, (unsigned)v);
    for (int o = 0; o < g->n_out; o++) outp[o] = LLVMGetParam(fn, (unsigned)(nv + o));
    LLVMValueRef bad = LLVMBuildAlloca(e.b, e.t_i1, "bad");
    LLVMBuildStore(e.b, LLVMConstInt(e.t_i1, 0, 0), bad);
    llvm_group lg = {.e = &e, .f = f, .buf = buf};
    llvm_group_init(&lg);
    llvm_loop l;
    LLVMValueRef i = llvm_loop_begin(&e, &l, llvm_i64(&e, 0), llvm_i64(&e, plan_type_size(&f->types[g->out[0]])), "i");
    rc = cuda_emit_element(&e, &lg, g, outp, i, bad);
    llvm_group_dispose(&lg);
    if (!rc) {
      llvm_loop_end(&e, &l);
      LLVMBuildRetVoid(e.b);
      rc = cuda_host_intrinsics(&e, mod);
    }
  }
  free(ps), free(buf), free(outp);
  llvm_emit_dispose(&e);
  LLVMExecutionEngineRef ee = NULL;
  if (rc)
    LLVMDisposeModule(mod);
  else
    rc = cuda_host_engine(mod, "kiln_debug_cuda_run", &ee);
  if (!rc) {
    LLVMGenericValueRef *a = calloc((size_t)np + 1, sizeof *a);
    if (!a) rc = cuda_oom();
    for (int q = 0; a && q < np; q++) a[q] = LLVMCreateGenericValueOfPointer(q < nv ? ptr[q] : out[q - nv]);
    if (a) LLVMDisposeGenericValue(LLVMRunFunction(ee, fn, (unsigned)np, a));
    for (int q = 0; a && q < np; q++) LLVMDisposeGenericValue(a[q]);
    free(a);
    LLVMDisposeExecutionEngine(ee);
  }
  LLVMContextDispose(ctx);
  return rc;
}

/* instruction in (of f) by the reference interpreter, as a function of it
 * alone, over its operands' data in and into out */
static int run_reference(const ir_func *f, const ir_instr *in, void *const *data, void *out) {
  ir_module *m = ir_module_new();
  op_type *ts = malloc(((size_t)in->n_in + 1) * sizeof *ts);
  ir_value *ps = malloc(((size_t)in->n_in + 1) * sizeof *ps);
  kiln_tensor **args = calloc((size_t)in->n_in + 1, sizeof *args), *res = NULL;
  int rc = !m || !ts || !ps || !args ? cuda_oom() : 0;
  kiln_scope_push();
  for (int k = 0; !rc && k < in->n_in; k++) {
    ts[k] = f->types[in->in[k]];
    ps[k] = k;
    if (!(args[k] = kiln_zeros(ts[k].dtype, ts[k].rank, ts[k].shape))) rc = -1;
    else memcpy(args[k]->data, data[k], (size_t)plan_type_bytes(&ts[k]));
  }
  ir_func *g = rc ? NULL : ir_func_new(m, "head", in->n_in, ts);
  ir_value r = g ? ir_append(g, in->op, &in->attrs, in->n_in, ps, in->loc) : -1;
  if (!rc && (r < 0 || ir_set_results(g, 1, &r) || ir_run(g, args, &res))) rc = -1;
  if (!rc) memcpy(out, res->data, (size_t)plan_type_bytes(&f->types[in->out]));
  kiln_scope_pop(); /* the arguments and the result */
  free(ts), free(ps), free(args);
  ir_module_free(m);
  return rc;
}

/* kernel g of pl, its leaves and outputs at their host addresses */
static int run_kernel(const plan *pl, const plan_kernel *g, kiln_tensor *const *args, kiln_tensor *const *results,
                      char *arena) {
  const ir_func *f = g->f;
  void **ptr = calloc((size_t)f->n_values + 1, sizeof *ptr), **out = calloc((size_t)g->n_out + 1, sizeof *out);
  int rc = !ptr || !out ? cuda_oom() : 0;
  for (int v = 0; !rc && v < f->n_values; v++)
    if (g->leaf[v] >= 0 && !(ptr[v] = slot_ptr(pl, g->leaf[v], args, results, arena)))
      rc = kiln_set_error("cuda: kiln_debug_cuda_run: @%s: a kernel reads a row (no host run of scans)", pl->f->name);
  for (int o = 0; !rc && o < g->n_out; o++)
    if (!(out[o] = slot_ptr(pl, g->out_slot[o], args, results, arena)))
      rc = kiln_set_error("cuda: kiln_debug_cuda_run: @%s: a kernel writes a row (no host run of scans)", pl->f->name);
  const ir_instr *sp = g->special, *first = f->def[g->out[0]] >= 0 ? &f->instrs[f->def[g->out[0]]] : NULL;
  if (rc) {
    /* reported */
  } else if (sp && kiln_ops[sp->op].kind == OPK_WINDOW) {
    op_type ts[2];
    void *in[2] = {NULL, NULL};
    for (int k = 0; k < sp->n_in && k < 2; k++) ts[k] = f->types[sp->in[k]], in[k] = ptr[sp->in[k]];
    rc = cuda_host_window(sp->op, &sp->attrs, sp->n_in, ts, &f->types[sp->out], in, out[0]);
  } else if (sp && sp->n_out == 1) {
    void **in = calloc((size_t)sp->n_in + 1, sizeof *in);
    if (!in) rc = cuda_oom();
    for (int k = 0; in && k < sp->n_in; k++) in[k] = ptr[sp->in[k]];
    if (in) rc = run_reference(f, sp, in, out[0]);
    free(in);
  } else if (!sp && g->pass == 0 && first && !llvm_op_is_reduce(first->op)) {
    rc = run_elementwise(g, ptr, out);
  } else {
    rc = kiln_set_error("cuda: kiln_debug_cuda_run: @%s: no host run of a %s kernel", pl->f->name,
                        kiln_ops[g->op].name);
  }
  free(ptr), free(out);
  return rc;
}

bool cuda_host_type_is(const kiln_tensor *t, const op_type *ty) {
  if (!t || t->device != 0 || t->dtype != ty->dtype || t->rank != ty->rank) return false;
  for (int d = 0; d < ty->rank; d++)
    if (t->shape[d] != ty->shape[d]) return false;
  return true;
}

int kiln_debug_cuda_run(const ir_func *f, kiln_tensor *const *args, kiln_tensor *const *results) {
  if (!f || !args || !results) return kiln_set_error("cuda: kiln_debug_cuda_run: bad arguments");
  if (ir_verify(f)) return -1;
  for (int p = 0; p < f->n_params; p++)
    if (!cuda_host_type_is(args[p], &f->types[p]))
      return kiln_set_error("cuda: kiln_debug_cuda_run: argument %d is not a CPU tensor of the parameter's type", p);
  for (int r = 0; r < f->n_results; r++)
    if (!cuda_host_type_is(results[r], &f->types[f->results[r]]))
      return kiln_set_error("cuda: kiln_debug_cuda_run: result %d is not a CPU tensor of the result's type", r);
  plan pl;
  int rc = cuda_plan_build(&pl, f);
  char *arena = rc ? NULL : calloc(pl.arena_bytes + 1, 1);
  if (!rc && !arena) rc = cuda_oom();
  for (int s = 0; !rc && s < pl.n_steps; s++) {
    const plan_step *st = &pl.steps[s];
    if (st->kind == PLAN_STEP_KERNEL) {
      rc = run_kernel(&pl, &pl.kernels[st->index], args, results, arena);
    } else if (st->kind == PLAN_STEP_COPY) {
      void *dst = slot_ptr(&pl, st->slots[0], args, results, arena), *src = slot_ptr(&pl, st->slots[1], args, results, arena);
      if (dst && src) memmove(dst, src, (size_t)st->bytes);
    } else {
      rc = kiln_set_error("cuda: kiln_debug_cuda_run: @%s: no host run of control flow or host steps", f->name);
    }
  }
  /* results the steps did not write: an argument or a constant returned */
  for (int r = 0; !rc && r < f->n_results; r++) {
    const plan_result *res = &pl.results[r];
    const kiln_tensor *src = res->kind == PLAN_RES_PARAM ? args[res->index]
                             : res->kind == PLAN_RES_CONST ? res->cst
                             : res->kind == PLAN_RES_SAME  ? results[res->index]
                                                           : NULL;
    if (src) memcpy(results[r]->data, src->data, (size_t)plan_type_bytes(&f->types[f->results[r]]));
  }
  free(arena);
  plan_free(&pl);
  return rc;
}
