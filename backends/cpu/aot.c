/* aot.c — a program as a relocatable object instead of JIT-linked code
 * (kiln-aot): the module cpu_compile builds (compile.c's build), with the
 * constants it reads through kiln_const<i> defined in it from their bytes,
 * the values of the parameters past the inputs (captured tensors,
 * variables) embedded the same way, and the program record of rt/rt.h that
 * libkiln_rt runs it by (its helpers, how each output is made). The object
 * exports <name>_run alone; everything it calls is libkiln_rt's or libc's. */
#include <llvm-c/Core.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"
#include "../rt/rt.h"

typedef struct {
  LLVMContextRef ctx;
  LLVMModuleRef mod;
  LLVMTypeRef i32, i64, ptr;
  int n_blobs;
} rec;

/* a private constant of len bytes, aligned to align */
static LLVMValueRef blob(rec *r, const void *data, size_t len, unsigned align) {
  char name[48];
  snprintf(name, sizeof name, "kiln.data%d", r->n_blobs++);
  LLVMValueRef init = LLVMConstStringInContext2(r->ctx, data, len, true);
  LLVMValueRef g = LLVMAddGlobal(r->mod, LLVMTypeOf(init), name);
  LLVMSetInitializer(g, init);
  LLVMSetGlobalConstant(g, true);
  LLVMSetLinkage(g, LLVMPrivateLinkage);
  LLVMSetUnnamedAddress(g, LLVMGlobalUnnamedAddr);
  LLVMSetAlignment(g, align);
  return g;
}

/* a private constant array of n elements of type t */
static LLVMValueRef array(rec *r, LLVMTypeRef t, LLVMValueRef *v, unsigned n) {
  char name[48];
  snprintf(name, sizeof name, "kiln.data%d", r->n_blobs++);
  LLVMValueRef init = LLVMConstArray2(t, v, n);
  LLVMValueRef g = LLVMAddGlobal(r->mod, LLVMTypeOf(init), name);
  LLVMSetInitializer(g, init);
  LLVMSetGlobalConstant(g, true);
  LLVMSetLinkage(g, LLVMPrivateLinkage);
  return g;
}

static LLVMValueRef i32c(rec *r, int64_t v) { return LLVMConstInt(r->i32, (unsigned long long)v, true); }
static LLVMValueRef i64c(rec *r, int64_t v) { return LLVMConstInt(r->i64, (unsigned long long)v, true); }

/* The declarations kiln_const<i> become definitions holding the bytes. */
static void define_consts(rec *r, const plan *pl) {
  for (int i = 0; i < pl->n_consts; i++) {
    char name[32];
    snprintf(name, sizeof name, "kiln_const%d", i);
    LLVMValueRef old = LLVMGetNamedGlobal(r->mod, name);
    if (!old) continue; /* not read by the code */
    const kiln_tensor *t = pl->consts[i];
    LLVMValueRef g = blob(r, t->data, tensor_bytes(t), KILN_ALIGN);
    LLVMReplaceAllUsesWith(old, g);
    LLVMDeleteGlobal(old);
  }
}

/* Whether the layouts of rt.h's records as LLVM types match the C ones
 * (a check of this file against rt.h, on the target's data layout). */
static bool layouts_match(LLVMTargetDataRef td, LLVMTypeRef res, LLVMTypeRef helper, LLVMTypeRef prog) {
  static const size_t res_off[] = {offsetof(kiln_rt_result_rec, kind), offsetof(kiln_rt_result_rec, index),
                                   offsetof(kiln_rt_result_rec, bytes), offsetof(kiln_rt_result_rec, data)};
  static const size_t helper_off[] = {offsetof(kiln_rt_helper_rec, op),      offsetof(kiln_rt_helper_rec, n_in),
                                      offsetof(kiln_rt_helper_rec, n_out),   offsetof(kiln_rt_helper_rec, epilogue),
                                      offsetof(kiln_rt_helper_rec, trans_a), offsetof(kiln_rt_helper_rec, trans_b),
                                      offsetof(kiln_rt_helper_rec, attrs),   offsetof(kiln_rt_helper_rec, types)};
  static const size_t prog_off[] = {
      offsetof(kiln_rt_program_rec, magic),     offsetof(kiln_rt_program_rec, version),
      offsetof(kiln_rt_program_rec, attrs_size), offsetof(kiln_rt_program_rec, type_size),
      offsetof(kiln_rt_program_rec, op_count),  offsetof(kiln_rt_program_rec, n_in),
      offsetof(kiln_rt_program_rec, n_out),     offsetof(kiln_rt_program_rec, n_params),
      offsetof(kiln_rt_program_rec, n_helpers), offsetof(kiln_rt_program_rec, n_kernels),
      offsetof(kiln_rt_program_rec, arena_bytes), offsetof(kiln_rt_program_rec, name),
      offsetof(kiln_rt_program_rec, entry),     offsetof(kiln_rt_program_rec, data),
      offsetof(kiln_rt_program_rec, results),   offsetof(kiln_rt_program_rec, helpers),
      offsetof(kiln_rt_program_rec, kernel_fail_op)};
  struct {
    LLVMTypeRef t;
    const size_t *off;
    unsigned n;
    size_t size;
  } all[3] = {{res, res_off, 4, sizeof(kiln_rt_result_rec)},
              {helper, helper_off, 8, sizeof(kiln_rt_helper_rec)},
              {prog, prog_off, 17, sizeof(kiln_rt_program_rec)}};
  for (int k = 0; k < 3; k++) {
    if (LLVMCountStructElementTypes(all[k].t) != all[k].n || LLVMABISizeOfType(td, all[k].t) != all[k].size)
      return false;
    for (unsigned i = 0; i < all[k].n; i++)
      if (LLVMOffsetOfElement(td, all[k].t, i) != all[k].off[i]) return false;
  }
  return true;
}

/* The program record <name>.program and <name>_run, which hands it to
 * kiln_rt_run. 0, or -1 with the error set. */
static int emit_record(rec *r, const cpu_build *cb, const cpu_aot_spec *spec, LLVMValueRef entry,
                       LLVMTargetDataRef td) {
  const cpu_program *p = cb->p;
  const ir_func *f = cb->f;
  LLVMTypeRef res_t = LLVMStructTypeInContext(r->ctx, (LLVMTypeRef[]){r->i32, r->i32, r->i64, r->ptr}, 4, false);
  LLVMTypeRef helper_t = LLVMStructTypeInContext(
      r->ctx, (LLVMTypeRef[]){r->i32, r->i32, r->i32, r->i32, r->i32, r->i32, r->ptr, r->ptr}, 8, false);
  LLVMTypeRef prog_fields[17];
  for (int i = 0; i < 10; i++) prog_fields[i] = r->i32;
  prog_fields[10] = r->i64;
  for (int i = 11; i < 17; i++) prog_fields[i] = r->ptr;
  LLVMTypeRef prog_t = LLVMStructTypeInContext(r->ctx, prog_fields, 17, false);
  if (!layouts_match(td, res_t, helper_t, prog_t))
    return kiln_set_error("cpu: @%s: the target's data layout does not lay out libkiln_rt's records as this build "
                          "of Kiln does", f->name);
  int n_data = f->n_params - spec->n_in, n_k = cb->pl.n_kernels;
  int n_max = n_data > p->n_helpers ? n_data : p->n_helpers;
  if (p->n_results > n_max) n_max = p->n_results;
  if (n_k > n_max) n_max = n_k;
  LLVMValueRef *v = malloc(((size_t)n_max + 1) * sizeof *v);
  if (!v) return cpu_oom();
  for (int i = 0; i < n_data; i++) {
    const kiln_tensor *t = spec->data[i];
    v[i] = blob(r, t->data, tensor_bytes(t), KILN_ALIGN);
  }
  LLVMValueRef data = array(r, r->ptr, v, (unsigned)n_data);
  for (int k = 0; k < p->n_results; k++) {
    const cpu_result *res = &p->results[k];
    int kind = res->kind == CPU_RES_OWN     ? KILN_RT_RES_OWN
               : res->kind == CPU_RES_PARAM ? KILN_RT_RES_PARAM
               : res->kind == CPU_RES_CONST ? KILN_RT_RES_CONST
                                            : KILN_RT_RES_SAME;
    LLVMValueRef cst = kind == KILN_RT_RES_CONST ? blob(r, res->cst->data, tensor_bytes(res->cst), KILN_ALIGN)
                                                 : LLVMConstNull(r->ptr);
    LLVMValueRef fields[4] = {i32c(r, kind), i32c(r, res->index), i64c(r, plan_type_bytes(&p->result_types[k])), cst};
    v[k] = LLVMConstNamedStruct(res_t, fields, 4);
  }
  LLVMValueRef results = array(r, res_t, v, (unsigned)p->n_results);
  for (int h = 0; h < p->n_helpers; h++) {
    const cpu_helper *hp = &p->helpers[h];
    op_attrs a;
    memcpy(&a, &hp->attrs, sizeof a);
    a.value = NULL, a.callee = a.callee2 = NULL, a.host = NULL; /* the module's: never read by a helper */
    size_t nt = (size_t)(hp->n_in + hp->n_out);
    op_type *types = malloc((nt + 1) * sizeof *types);
    if (!types) {
      free(v);
      return cpu_oom();
    }
    memcpy(types, hp->in_types, (size_t)hp->n_in * sizeof *types);
    memcpy(types + hp->n_in, hp->out_types, (size_t)hp->n_out * sizeof *types);
    LLVMValueRef fields[8] = {i32c(r, hp->op),       i32c(r, hp->n_in),    i32c(r, hp->n_out),
                              i32c(r, hp->epilogue), i32c(r, hp->trans_a), i32c(r, hp->trans_b),
                              blob(r, &a, sizeof a, 16), blob(r, types, nt * sizeof *types, 16)};
    free(types);
    v[h] = LLVMConstNamedStruct(helper_t, fields, 8);
  }
  LLVMValueRef helpers = array(r, helper_t, v, (unsigned)p->n_helpers);
  for (int k = 0; k < n_k; k++) v[k] = i32c(r, p->kernel_fail_op[k]);
  LLVMValueRef fails = array(r, r->i32, v, (unsigned)n_k);
  free(v);
  LLVMValueRef name = blob(r, spec->name, strlen(spec->name) + 1, 1);
  LLVMValueRef fields[17] = {i32c(r, KILN_RT_MAGIC),    i32c(r, KILN_RT_VERSION),   i32c(r, sizeof(op_attrs)),
                             i32c(r, sizeof(op_type)),  i32c(r, OP_COUNT),          i32c(r, spec->n_in),
                             i32c(r, p->n_results),     i32c(r, f->n_params),       i32c(r, p->n_helpers),
                             i32c(r, n_k),              i64c(r, (int64_t)p->arena_bytes), name,
                             entry,                     data,                       results,
                             helpers,                   fails};
  char gname[300];
  snprintf(gname, sizeof gname, "%s.program", spec->name);
  LLVMValueRef prog = LLVMAddGlobal(r->mod, prog_t, gname);
  LLVMSetInitializer(prog, LLVMConstNamedStruct(prog_t, fields, 17));
  LLVMSetGlobalConstant(prog, true);
  LLVMSetLinkage(prog, LLVMPrivateLinkage);

  /* int <name>_run(const void *const *inputs, void *const *outputs) */
  LLVMTypeRef rt_ty = LLVMFunctionType(r->i32, (LLVMTypeRef[]){r->ptr, r->ptr, r->ptr}, 3, false);
  LLVMValueRef rt_run = LLVMAddFunction(r->mod, "kiln_rt_run", rt_ty);
  LLVMTypeRef run_ty = LLVMFunctionType(r->i32, (LLVMTypeRef[]){r->ptr, r->ptr}, 2, false);
  snprintf(gname, sizeof gname, "%s_run", spec->name);
  LLVMValueRef run = LLVMAddFunction(r->mod, gname, run_ty);
  cpu_add_fn_attr(r->ctx, run, "nounwind");
  LLVMBuilderRef b = LLVMCreateBuilderInContext(r->ctx);
  LLVMPositionBuilderAtEnd(b, LLVMAppendBasicBlockInContext(r->ctx, run, "entry"));
  LLVMValueRef args[3] = {prog, LLVMGetParam(run, 0), LLVMGetParam(run, 1)};
  LLVMBuildRet(b, LLVMBuildCall2(b, rt_ty, rt_run, args, 3, ""));
  LLVMDisposeBuilder(b);
  return 0;
}

/* Everything the module defines but <name>_run becomes internal: two
 * objects link into one program without clashing. */
static void internalize(LLVMModuleRef mod, const char *keep) {
  size_t len;
  for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn))
    if (!LLVMIsDeclaration(fn) && strcmp(LLVMGetValueName2(fn, &len), keep)) LLVMSetLinkage(fn, LLVMInternalLinkage);
  for (LLVMValueRef g = LLVMGetFirstGlobal(mod); g; g = LLVMGetNextGlobal(g))
    if (!LLVMIsDeclaration(g) && LLVMGetLinkage(g) != LLVMPrivateLinkage) LLVMSetLinkage(g, LLVMInternalLinkage);
}

int cpu_aot_object(const ir_func *f, const cpu_aot_spec *spec, void **obj, size_t *len, size_t *arena_bytes) {
  *obj = NULL, *len = 0, *arena_bytes = 0;
  LLVMOrcLLJITRef jit = cpu_jit_get(); /* the targets, and the CPU (KILN_CPU's, or the host's) */
  if (!jit) return -1;
  if (!f || spec->n_in < 0 || spec->n_in > f->n_params) return kiln_set_error("cpu: aot: no function, or bad inputs");
  cpu_options opt = {0};
  cpu_build cb;
  int rc = cpu_build_start(&cb, f, &opt);
  cpu_program *p = cb.p;
  for (int h = 0; !rc && h < p->n_helpers; h++)
    if (kiln_ops[p->helpers[h].op].kind == OPK_HOST)
      rc = kiln_set_error("cpu: @%s: host_call @%s cannot be compiled ahead of time (its callback is C code of the "
                          "process that traced it)", f->name, p->helpers[h].host_name);
  for (int h = 0; !rc && h < p->n_helpers; h++)
    if (kiln_ops[p->helpers[h].op].kind == OPK_COLLECTIVE)
      rc = kiln_set_error("cpu: @%s: %s cannot be compiled ahead of time (a collective runs on Kiln's MPI runtime)",
                          f->name, kiln_ops[p->helpers[h].op].api);
  const char *triple = spec->triple ? spec->triple : LLVMOrcLLJITGetTripleString(jit);
  LLVMTargetMachineRef tm = rc ? NULL : cpu_aot_machine(triple);
  if (!rc && !tm) rc = kiln_set_error("cpu: @%s: %s", f->name, cpu_jit_error());
  LLVMTargetDataRef td = tm ? LLVMCreateTargetDataLayout(tm) : NULL;
  char *layout = td ? LLVMCopyStringRepOfTargetData(td) : NULL;
  char entry_name[300];
  snprintf(entry_name, sizeof entry_name, "%s.entry", spec->name);
  LLVMContextRef ctx = NULL;
  LLVMModuleRef mod = NULL;
  if (!rc) rc = cpu_build_module(&cb, &opt, triple, layout, entry_name, &ctx, &mod);
  if (!rc) {
    rec r = {ctx, mod, LLVMInt32TypeInContext(ctx), LLVMInt64TypeInContext(ctx), LLVMPointerTypeInContext(ctx, 0), 0};
    define_consts(&r, &cb.pl);
    rc = emit_record(&r, &cb, spec, LLVMGetNamedFunction(mod, entry_name), td);
    char run_name[300];
    snprintf(run_name, sizeof run_name, "%s_run", spec->name);
    internalize(mod, run_name);
    LLVMMemoryBufferRef ob[2];
    int n_obj = 0;
    if (rc) {
      LLVMDisposeModule(mod);
      LLVMContextDispose(ctx);
    } else if (!(rc = cpu_optimize(p, ctx, mod, cb.pl.n_kernels, cb.max_work, 1, true, ob, &n_obj))) {
      *len = LLVMGetBufferSize(ob[0]);
      if ((*obj = malloc(*len + 1)))
        memcpy(*obj, LLVMGetBufferStart(ob[0]), *len);
      else
        rc = cpu_oom();
      for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(ob[i]);
      *arena_bytes = p->arena_bytes;
    }
  }
  if (layout) LLVMDisposeMessage(layout);
  if (td) LLVMDisposeTargetData(td);
  if (tm) LLVMDisposeTargetMachine(tm);
  cpu_build_free(&cb);
  cpu_program_free(p);
  return rc;
}
