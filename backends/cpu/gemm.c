/* gemm.c — the matmul micro-kernels, emitted with the LLVM C API as
 * explicit vector code: an MR x NR tile of accumulators (MR rows of NV
 * vectors) kept in registers while k runs, a broadcast of A times the NV
 * vectors of a row of packed B (one FMA each) per row and step of k, and on
 * the way out masked stores (edge tiles) with the epilogue (bias, relu,
 * tanh) applied on the last block of K. One kernel per (dtype, epilogue),
 * compiled on first use (or read from the disk cache of compiled code, as
 * programs are) and linked into the process-wide JIT; the driver around it
 * (packing, cache blocks, threads) is lib/kernels_matmul.c's. */
#include <llvm-c/Analysis.h>
#include <llvm-c/BitWriter.h>
#include <llvm-c/Core.h>
#include <llvm-c/TargetMachine.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/cpu.h"
#include "cpu/gemm.h"
#include "llvm/llvm_emit.h"

/* k steps per iteration of the main loop (the rest one at a time) */
enum { UNROLL = 4 };

/* The vector instructions a kernel is written for: x86-64 with FMA, in
 * 512-bit (AVX-512) or 256-bit (AVX2) vectors. Elsewhere there is no
 * compiled kernel (the C one runs). KILN_GEMM_ISA=avx2 asks for the AVX2
 * kernels on an AVX-512 host (tests). */
typedef enum { ISA_NONE, ISA_AVX2, ISA_AVX512 } isa;

static isa host_isa(LLVMTargetMachineRef tm) {
  char *triple = LLVMGetTargetMachineTriple(tm);
  isa i = ISA_NONE;
  /* the JIT's target CPU: the host's, or the one KILN_CPU names */
  if (!strncmp(triple, "x86_64", 6) && cpu_jit_target_has("avx2") && cpu_jit_target_has("fma"))
    i = cpu_jit_target_has("avx512f") ? ISA_AVX512 : ISA_AVX2;
  LLVMDisposeMessage(triple);
  const char *env = getenv("KILN_GEMM_ISA");
  if (i == ISA_AVX512 && env && !strcmp(env, "avx2")) i = ISA_AVX2;
  return i;
}

/* The register tile: MR rows of NV vectors of VL elements. With AVX-512
 * (32 registers) 12 x 32 floats: 24 accumulators, 2 vectors of B and a
 * broadcast; with AVX2 (16 registers) 6 x 16: 12 accumulators. */
typedef struct {
  int mr, nv, vl;
} tile;

static tile tile_for(kiln_dtype dt, bool avx512) {
  int vl = (avx512 ? 64 : 32) / (int)kiln_dtype_sizes[dt];
  tile t = avx512 ? (tile){12, 2, vl} : (tile){6, 2, vl};
  const char *env = getenv("KILN_GEMM_TILE"); /* "MRxNV", for tuning */
  int mr, nv;
  if (env && sscanf(env, "%dx%d", &mr, &nv) == 2 && mr >= 1 && mr <= 16 && nv >= 1 && nv <= 4 &&
      mr * nv <= (avx512 ? 28 : 13))
    t.mr = mr, t.nv = nv;
  return t;
}

/* The convolution kernel's tile: 14 x 32 floats with AVX-512 (28
 * accumulators: 14 divides ResNet's 112, 56, 28 and 14 pixel rows), 7 x 64
 * when narrow (its 7), 6 x 16 with AVX2; KILN_CONV_TILE="MRxNV" for
 * tuning. */
static tile conv_tile_for(kiln_dtype dt, bool avx512, bool narrow) {
  int vl = (avx512 ? 64 : 32) / (int)kiln_dtype_sizes[dt];
  tile t = avx512 ? (narrow ? (tile){7, 4, vl} : (tile){14, 2, vl}) : (tile){6, 2, vl};
  const char *env = getenv("KILN_CONV_TILE");
  int mr, nv;
  if (env && sscanf(env, "%dx%d", &mr, &nv) == 2 && mr >= 1 && mr <= 16 && nv >= 1 && nv <= 4 &&
      mr * nv <= (avx512 ? 28 : 13))
    t.mr = mr, t.nv = nv;
  return t;
}

static const char *epi_names[GEMM_EPI_COUNT] = {"none", "bias", "bias_relu", "bias_tanh"};

/* ---- emission ---- */

typedef struct {
  llvm_emit *e;
  tile t;
  LLVMTypeRef ty, vty; /* element, vector */
  unsigned esize;
  LLVMValueRef a, b, kc;
  /* the convolution kernel: row r of A starts at arows[r] (strided A) */
  bool strided;
  LLVMValueRef arows[16];
} kgen;

static LLVMValueRef splat(kgen *g, LLVMValueRef x) {
  LLVMBuilderRef b = g->e->b;
  LLVMValueRef v = LLVMBuildInsertElement(b, LLVMGetPoison(LLVMVectorType(LLVMTypeOf(x), (unsigned)g->t.vl)), x,
                                          llvm_i32(g->e, 0), "");
  LLVMValueRef zeros = LLVMConstNull(LLVMVectorType(g->e->t_i32, (unsigned)g->t.vl));
  return LLVMBuildShuffleVector(b, v, LLVMGetPoison(LLVMTypeOf(v)), zeros, "");
}

/* acc += A[:, p] (x) B[p, :]: one step of k */
static void emit_step(kgen *g, LLVMValueRef p, LLVMValueRef *acc) {
  llvm_emit *e = g->e;
  int mr = g->t.mr, nv = g->t.nv, vl = g->t.vl;
  LLVMValueRef bv[4];
  LLVMValueRef brow = LLVMBuildMul(e->b, p, llvm_i64(e, (int64_t)nv * vl), "");
  for (int v = 0; v < nv; v++) {
    LLVMValueRef i = LLVMBuildAdd(e->b, brow, llvm_i64(e, (int64_t)v * vl), "");
    LLVMValueRef ptr = LLVMBuildGEP2(e->b, g->ty, g->b, &i, 1, "");
    bv[v] = LLVMBuildLoad2(e->b, g->vty, ptr, "b");
    LLVMSetAlignment(bv[v], g->esize);
  }
  LLVMValueRef arow = LLVMBuildMul(e->b, p, llvm_i64(e, mr), "");
  for (int r = 0; r < mr; r++) {
    LLVMValueRef i = g->strided ? p : LLVMBuildAdd(e->b, arow, llvm_i64(e, r), "");
    LLVMValueRef x =
        LLVMBuildLoad2(e->b, g->ty, LLVMBuildGEP2(e->b, g->ty, g->strided ? g->arows[r] : g->a, &i, 1, ""), "a");
    LLVMValueRef s = splat(g, x);
    for (int v = 0; v < nv; v++) {
      LLVMValueRef args[3] = {s, bv[v], acc[r * nv + v]};
      acc[r * nv + v] = llvm_intr(e, "llvm.fma", args, 3);
    }
  }
}

/* A loop from lo (an i64) while p + step <= kc, step steps a time, over the
 * accumulators acc (updated to their values after the loop); returns p
 * after it. */
static LLVMValueRef emit_k_loop(kgen *g, LLVMValueRef fn, LLVMValueRef lo, int step, LLVMValueRef *acc,
                                const char *name) {
  llvm_emit *e = g->e;
  int n = g->t.mr * g->t.nv;
  LLVMBasicBlockRef pre = LLVMGetInsertBlock(e->b);
  LLVMBasicBlockRef head = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  LLVMBasicBlockRef body = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  LLVMBasicBlockRef exit = LLVMAppendBasicBlockInContext(e->ctx, fn, name);
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, head);
  LLVMValueRef p = LLVMBuildPhi(e->b, e->t_i64, "p");
  LLVMValueRef phis[64], cur[64];
  for (int i = 0; i < n; i++) {
    phis[i] = cur[i] = LLVMBuildPhi(e->b, g->vty, "acc");
    LLVMAddIncoming(phis[i], &acc[i], &pre, 1);
  }
  LLVMAddIncoming(p, &lo, &pre, 1);
  LLVMValueRef end = LLVMBuildAdd(e->b, p, llvm_i64(e, step), "");
  LLVMBuildCondBr(e->b, LLVMBuildICmp(e->b, LLVMIntSLE, end, g->kc, ""), body, exit);
  LLVMPositionBuilderAtEnd(e->b, body);
  for (int s = 0; s < step; s++) emit_step(g, s ? LLVMBuildAdd(e->b, p, llvm_i64(e, s), "") : p, cur);
  LLVMBasicBlockRef last = LLVMGetInsertBlock(e->b);
  LLVMAddIncoming(p, &end, &last, 1);
  for (int i = 0; i < n; i++) LLVMAddIncoming(phis[i], &cur[i], &last, 1);
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, exit);
  for (int i = 0; i < n; i++) acc[i] = phis[i];
  return p;
}

static LLVMValueRef masked_load(llvm_emit *e, LLVMTypeRef vty, LLVMValueRef ptr, LLVMValueRef mask) {
  LLVMTypeRef types[2] = {vty, e->t_ptr}, ft;
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.masked.load", types, 2, &ft);
  LLVMValueRef args[4] = {ptr, llvm_i32(e, 4), mask, LLVMConstNull(vty)};
  return llvm_call(e, fn, ft, args, 4);
}

static void masked_store(llvm_emit *e, LLVMValueRef x, LLVMValueRef ptr, LLVMValueRef mask) {
  LLVMTypeRef types[2] = {LLVMTypeOf(x), e->t_ptr}, ft;
  LLVMValueRef fn = llvm_intrinsic(e, "llvm.masked.store", types, 2, &ft);
  LLVMValueRef args[4] = {x, ptr, llvm_i32(e, 4), mask};
  llvm_call(e, fn, ft, args, 4);
}

/* Stores the tile into C[0:mr, 0:nr]: acc, or C + acc when add; then, with
 * epi, + bias and the activation. */
static void emit_store(kgen *g, const LLVMValueRef *acc, LLVMValueRef c, LLVMValueRef ldc, LLVMValueRef mr,
                       LLVMValueRef nr, LLVMValueRef add, gemm_epilogue epi, LLVMValueRef bias, LLVMValueRef res) {
  llvm_emit *e = g->e;
  int nv = g->t.nv, vl = g->t.vl;
  LLVMTypeRef mty = LLVMVectorType(e->t_i1, (unsigned)vl);
  LLVMValueRef colmask[4], bv[4], lanes[16];
  LLVMValueRef nrv = splat(g, nr);
  for (int v = 0; v < nv; v++) {
    for (int l = 0; l < vl; l++) lanes[l] = llvm_i64(e, (int64_t)v * vl + l);
    colmask[v] = LLVMBuildICmp(e->b, LLVMIntSLT, LLVMConstVector(lanes, (unsigned)vl), nrv, "cols");
    if (epi != GEMM_EPI_NONE)
      bv[v] = masked_load(e, g->vty,
                          LLVMBuildGEP2(e->b, g->ty, bias, (LLVMValueRef[]){llvm_i64(e, (int64_t)v * vl)}, 1, ""),
                          colmask[v]);
  }
  LLVMValueRef none = LLVMConstNull(mty), zero = LLVMConstNull(g->vty);
  for (int r = 0; r < g->t.mr; r++) {
    LLVMValueRef row_ok = LLVMBuildICmp(e->b, LLVMIntSLT, llvm_i64(e, r), mr, "");
    LLVMValueRef row = LLVMBuildMul(e->b, llvm_i64(e, r), ldc, "");
    for (int v = 0; v < nv; v++) {
      LLVMValueRef mask = LLVMBuildSelect(e->b, row_ok, colmask[v], none, "");
      LLVMValueRef i = LLVMBuildAdd(e->b, row, llvm_i64(e, (int64_t)v * vl), "");
      LLVMValueRef ptr = LLVMBuildGEP2(e->b, g->ty, c, &i, 1, "");
      LLVMValueRef x = acc[r * nv + v];
      if (!LLVMIsAConstantInt(add) || LLVMConstIntGetZExtValue(add)) /* the convolution kernel never adds */
        x = LLVMBuildSelect(e->b, add, LLVMBuildFAdd(e->b, masked_load(e, g->vty, ptr, mask), x, ""), x, "");
      if (epi != GEMM_EPI_NONE) x = LLVMBuildFAdd(e->b, x, bv[v], "");
      if (res) /* the residual, where the output is (rows ldc apart) */
        x = LLVMBuildFAdd(e->b, x, masked_load(e, g->vty, LLVMBuildGEP2(e->b, g->ty, res, &i, 1, ""), mask), "");
      if (epi != GEMM_EPI_NONE) {
        if (epi == GEMM_EPI_BIAS_RELU) /* x < 0 ? 0 : x, NaN kept as the relu kernels do */
          x = LLVMBuildSelect(e->b, LLVMBuildFCmp(e->b, LLVMRealOLT, x, zero, ""), zero, x, "");
        else if (epi == GEMM_EPI_BIAS_TANH)
          x = llvm_vm_tanh(e, x);
      }
      masked_store(e, x, ptr, mask);
    }
  }
}

static void add_attr(LLVMContextRef ctx, LLVMValueRef fn, const char *k, const char *v) {
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                          LLVMCreateStringAttribute(ctx, k, (unsigned)strlen(k), v, (unsigned)strlen(v)));
}

static void kernel_attrs(llvm_emit *e, LLVMValueRef fn, LLVMTargetMachineRef tm, bool avx512);

/* void name(i64 kc, ptr a, ptr b, ptr c, i64 ldc, i64 mr, i64 nr, i32 flags,
 * ptr bias): gemm_ukernel_fn */
static void emit_ukernel(llvm_emit *e, const char *name, kiln_dtype dt, gemm_epilogue epi, tile t,
                         LLVMTargetMachineRef tm, bool avx512) {
  LLVMTypeRef params[9] = {e->t_i64, e->t_ptr, e->t_ptr, e->t_ptr, e->t_i64, e->t_i64, e->t_i64, e->t_i32, e->t_ptr};
  LLVMValueRef fn = LLVMAddFunction(e->mod, name, LLVMFunctionType(e->t_void, params, 9, 0));
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7);
  for (unsigned i = 2; i <= 4; i++) /* a, b, c */
    LLVMAddAttributeAtIndex(fn, i, LLVMCreateEnumAttribute(e->ctx, noalias, 0));
  kernel_attrs(e, fn, tm, avx512);

  kgen g = {.e = e, .t = t, .ty = llvm_value_type(e, dt), .esize = kiln_dtype_sizes[dt]};
  g.vty = LLVMVectorType(g.ty, (unsigned)t.vl);
  g.kc = LLVMGetParam(fn, 0);
  g.a = LLVMGetParam(fn, 1);
  g.b = LLVMGetParam(fn, 2);
  LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, fn, "entry"));
  LLVMValueRef acc[64];
  for (int i = 0; i < t.mr * t.nv; i++) acc[i] = LLVMConstNull(g.vty);
  LLVMValueRef p = emit_k_loop(&g, fn, llvm_i64(e, 0), UNROLL, acc, "k4");
  emit_k_loop(&g, fn, p, 1, acc, "k1");

  LLVMValueRef flags = LLVMGetParam(fn, 7);
  LLVMValueRef add = LLVMBuildICmp(e->b, LLVMIntNE, LLVMBuildAnd(e->b, flags, llvm_i32(e, GEMM_ACCUMULATE), ""),
                                   llvm_i32(e, 0), "add");
  LLVMValueRef c = LLVMGetParam(fn, 3), ldc = LLVMGetParam(fn, 4), mr = LLVMGetParam(fn, 5), nr = LLVMGetParam(fn, 6);
  if (epi != GEMM_EPI_NONE) {
    LLVMValueRef last =
        LLVMBuildICmp(e->b, LLVMIntNE, LLVMBuildAnd(e->b, flags, llvm_i32(e, GEMM_LAST), ""), llvm_i32(e, 0), "last");
    LLVMBasicBlockRef with = LLVMAppendBasicBlockInContext(e->ctx, fn, "epilogue");
    LLVMBasicBlockRef plain = LLVMAppendBasicBlockInContext(e->ctx, fn, "store");
    LLVMBuildCondBr(e->b, last, with, plain);
    LLVMPositionBuilderAtEnd(e->b, with);
    emit_store(&g, acc, c, ldc, mr, nr, add, epi, LLVMGetParam(fn, 8), NULL);
    LLVMBuildRetVoid(e->b);
    LLVMPositionBuilderAtEnd(e->b, plain);
  }
  emit_store(&g, acc, c, ldc, mr, nr, add, GEMM_EPI_NONE, NULL, NULL);
  LLVMBuildRetVoid(e->b);
}

/* The function attributes every kernel has: its target (the AVX2 kernel on
 * an AVX-512 host with KILN_GEMM_ISA), whole zmm registers, nounwind. */
static void kernel_attrs(llvm_emit *e, LLVMValueRef fn, LLVMTargetMachineRef tm, bool avx512) {
  char *cpu = LLVMGetTargetMachineCPU(tm), *features = LLVMGetTargetMachineFeatureString(tm);
  char *fs = malloc(strlen(features) + 16);
  if (fs) {
    bool drop = !avx512 && cpu_jit_target_has("avx512f"); /* the AVX2 kernel on an AVX-512 host (KILN_GEMM_ISA) */
    sprintf(fs, "%s%s", features, drop ? (*features ? ",-avx512f" : "-avx512f") : "");
    add_attr(e->ctx, fn, "target-features", fs);
    free(fs);
  }
  add_attr(e->ctx, fn, "target-cpu", cpu);
  LLVMDisposeMessage(cpu);
  LLVMDisposeMessage(features);
  if (avx512) {
    add_attr(e->ctx, fn, "prefer-vector-width", "512");
    add_attr(e->ctx, fn, "min-legal-vector-width", "512");
  }
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                          LLVMCreateEnumAttribute(e->ctx, LLVMGetEnumAttributeKindForName("nounwind", 8), 0));
}

/* void name(i64 taps, ptr a, i64 kc, i64 lda, ptr b, ptr c, i64 ldc, i64 mr,
 * i64 nr, i32 flags, ptr bias, ptr res): conv_ukernel_fn. A loop over the
 * taps around gemm's loop over k, the rows of A read at a[t] + r * lda; the
 * tile stored once, with the epilogue (always the last block of K) and,
 * when flags has GEMM_RESIDUAL, the residual. With lda_const > 0 the rows
 * are that far apart whatever lda says: constant displacements from one
 * pointer, where a runtime lda leaves LLVM a chain of additions and spills
 * of 14 row pointers (half again as many instructions as FMAs). */
static void emit_conv_ukernel(llvm_emit *e, const char *name, kiln_dtype dt, gemm_epilogue epi, tile t,
                              LLVMTargetMachineRef tm, bool avx512, int64_t lda_const) {
  LLVMTypeRef params[12] = {e->t_i64, e->t_ptr, e->t_i64, e->t_i64, e->t_ptr, e->t_ptr,
                            e->t_i64, e->t_i64, e->t_i64, e->t_i32, e->t_ptr, e->t_ptr};
  LLVMValueRef fn = LLVMAddFunction(e->mod, name, LLVMFunctionType(e->t_void, params, 12, 0));
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7);
  LLVMAddAttributeAtIndex(fn, 5, LLVMCreateEnumAttribute(e->ctx, noalias, 0)); /* b */
  kernel_attrs(e, fn, tm, avx512);

  kgen g = {.e = e, .t = t, .ty = llvm_value_type(e, dt), .esize = kiln_dtype_sizes[dt], .strided = true};
  g.vty = LLVMVectorType(g.ty, (unsigned)t.vl);
  LLVMValueRef taps = LLVMGetParam(fn, 0), aptrs = LLVMGetParam(fn, 1), lda = LLVMGetParam(fn, 3);
  g.kc = LLVMGetParam(fn, 2);
  LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(e->ctx, fn, "entry");
  LLVMBasicBlockRef head = LLVMAppendBasicBlockInContext(e->ctx, fn, "tap");
  LLVMBasicBlockRef body = LLVMAppendBasicBlockInContext(e->ctx, fn, "tap_body");
  LLVMBasicBlockRef exit = LLVMAppendBasicBlockInContext(e->ctx, fn, "taps_done");
  LLVMPositionBuilderAtEnd(e->b, entry);
  int n = t.mr * t.nv;
  LLVMValueRef acc[64], phis[64], zero = LLVMConstNull(g.vty), b0 = LLVMGetParam(fn, 4), i0 = llvm_i64(e, 0);
  LLVMValueRef panel = LLVMBuildMul(e->b, g.kc, llvm_i64(e, (int64_t)t.nv * t.vl), "panel");
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, head);
  LLVMValueRef tp = LLVMBuildPhi(e->b, e->t_i64, "t"), bp = LLVMBuildPhi(e->b, e->t_ptr, "bt");
  LLVMAddIncoming(tp, &i0, &entry, 1);
  LLVMAddIncoming(bp, &b0, &entry, 1);
  for (int i = 0; i < n; i++) {
    phis[i] = acc[i] = LLVMBuildPhi(e->b, g.vty, "acc");
    LLVMAddIncoming(phis[i], &zero, &entry, 1);
  }
  LLVMBuildCondBr(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, tp, taps, ""), body, exit);
  LLVMPositionBuilderAtEnd(e->b, body);
  LLVMValueRef at = LLVMBuildLoad2(e->b, e->t_ptr, LLVMBuildGEP2(e->b, e->t_ptr, aptrs, &tp, 1, ""), "at");
  for (int r = 0; r < t.mr; r++) {
    LLVMValueRef off = lda_const > 0 ? llvm_i64(e, lda_const * r) : LLVMBuildMul(e->b, lda, llvm_i64(e, r), "");
    g.arows[r] = LLVMBuildGEP2(e->b, g.ty, at, &off, 1, "row");
  }
  g.b = bp;
  LLVMValueRef p = emit_k_loop(&g, fn, i0, UNROLL, acc, "k4");
  emit_k_loop(&g, fn, p, 1, acc, "k1");
  LLVMValueRef tnext = LLVMBuildAdd(e->b, tp, llvm_i64(e, 1), ""), bnext = LLVMBuildGEP2(e->b, g.ty, bp, &panel, 1, "");
  LLVMBasicBlockRef latch = LLVMGetInsertBlock(e->b);
  LLVMAddIncoming(tp, &tnext, &latch, 1);
  LLVMAddIncoming(bp, &bnext, &latch, 1);
  for (int i = 0; i < n; i++) LLVMAddIncoming(phis[i], &acc[i], &latch, 1);
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, exit);

  LLVMValueRef flags = LLVMGetParam(fn, 9), no = LLVMConstInt(e->t_i1, 0, 0);
  LLVMValueRef c = LLVMGetParam(fn, 5), ldc = LLVMGetParam(fn, 6), mr = LLVMGetParam(fn, 7), nr = LLVMGetParam(fn, 8);
  LLVMValueRef has_res = LLVMBuildICmp(e->b, LLVMIntNE, LLVMBuildAnd(e->b, flags, llvm_i32(e, GEMM_RESIDUAL), ""),
                                       llvm_i32(e, 0), "has_res");
  LLVMBasicBlockRef with = LLVMAppendBasicBlockInContext(e->ctx, fn, "residual");
  LLVMBasicBlockRef plain = LLVMAppendBasicBlockInContext(e->ctx, fn, "store");
  LLVMBuildCondBr(e->b, has_res, with, plain);
  LLVMPositionBuilderAtEnd(e->b, with);
  emit_store(&g, phis, c, ldc, mr, nr, no, epi, LLVMGetParam(fn, 10), LLVMGetParam(fn, 11));
  LLVMBuildRetVoid(e->b);
  LLVMPositionBuilderAtEnd(e->b, plain);
  emit_store(&g, phis, c, ldc, mr, nr, no, epi, LLVMGetParam(fn, 10), NULL);
  LLVMBuildRetVoid(e->b);
}

/* One loop of the filter-gradient kernel over p from lo while p + step <=
 * kc: acc += A[:, p] (x) B[p, :] with A's column at *ap (+ lda a step) and
 * B's row at *bp (+ ldb a step), B's vectors loaded under colmask; with pf
 * (not NULL), each step also prefetches line p of pf while p < pf_lines.
 * Updates acc, *ap, *bp to their values after the loop; returns p after it. */
static LLVMValueRef emit_wgrad_loop(kgen *g, LLVMValueRef fn, LLVMValueRef lo, int step, LLVMValueRef *acc,
                                    LLVMValueRef *ap, LLVMValueRef *bp, LLVMValueRef lda, LLVMValueRef ldb,
                                    const LLVMValueRef *colmask, LLVMValueRef pf, LLVMValueRef pf_lines) {
  llvm_emit *e = g->e;
  int n = g->t.mr * g->t.nv, nv = g->t.nv, vl = g->t.vl;
  LLVMBasicBlockRef pre = LLVMGetInsertBlock(e->b);
  LLVMBasicBlockRef head = LLVMAppendBasicBlockInContext(e->ctx, fn, "w");
  LLVMBasicBlockRef body = LLVMAppendBasicBlockInContext(e->ctx, fn, "w");
  LLVMBasicBlockRef exit = LLVMAppendBasicBlockInContext(e->ctx, fn, "w");
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, head);
  LLVMValueRef p = LLVMBuildPhi(e->b, e->t_i64, "p"), a = LLVMBuildPhi(e->b, e->t_ptr, "a"),
               b = LLVMBuildPhi(e->b, e->t_ptr, "b");
  LLVMValueRef phis[64], cur[64];
  for (int i = 0; i < n; i++) {
    phis[i] = cur[i] = LLVMBuildPhi(e->b, g->vty, "acc");
    LLVMAddIncoming(phis[i], &acc[i], &pre, 1);
  }
  LLVMAddIncoming(p, &lo, &pre, 1);
  LLVMAddIncoming(a, ap, &pre, 1);
  LLVMAddIncoming(b, bp, &pre, 1);
  LLVMValueRef end = LLVMBuildAdd(e->b, p, llvm_i64(e, step), "");
  LLVMBuildCondBr(e->b, LLVMBuildICmp(e->b, LLVMIntSLE, end, g->kc, ""), body, exit);
  LLVMPositionBuilderAtEnd(e->b, body);
  for (int s = 0; s < step; s++) {
    /* the prefetch of step p + s: line p + s of pf while there are lines left, else pf again */
    if (pf) {
      LLVMValueRef idx = s ? LLVMBuildAdd(e->b, p, llvm_i64(e, s), "") : p;
      LLVMValueRef off = LLVMBuildMul(e->b, idx, llvm_i64(e, 64), "");
      LLVMValueRef line = LLVMBuildGEP2(e->b, LLVMInt8TypeInContext(e->ctx), pf, &off, 1, "");
      LLVMValueRef at = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, idx, pf_lines, ""), line, pf, "");
      LLVMValueRef pargs[4] = {at, llvm_i32(e, 0), llvm_i32(e, 2), llvm_i32(e, 1)}; /* read, L2 (prefetcht1), data */
      llvm_intr(e, "llvm.prefetch", pargs, 4);
    }
    LLVMValueRef as = a, bs = b;
    if (s) {
      LLVMValueRef oa = LLVMBuildMul(e->b, lda, llvm_i64(e, s), ""), ob = LLVMBuildMul(e->b, ldb, llvm_i64(e, s), "");
      as = LLVMBuildGEP2(e->b, g->ty, a, &oa, 1, "");
      bs = LLVMBuildGEP2(e->b, g->ty, b, &ob, 1, "");
    }
    LLVMValueRef bv[4];
    for (int v = 0; v < nv; v++) {
      LLVMValueRef off = llvm_i64(e, (int64_t)v * vl);
      bv[v] = masked_load(e, g->vty, LLVMBuildGEP2(e->b, g->ty, bs, &off, 1, ""), colmask[v]);
    }
    for (int r = 0; r < g->t.mr; r++) {
      LLVMValueRef off = llvm_i64(e, r);
      LLVMValueRef x = LLVMBuildLoad2(e->b, g->ty, LLVMBuildGEP2(e->b, g->ty, as, &off, 1, ""), "a");
      LLVMValueRef sx = splat(g, x);
      for (int v = 0; v < nv; v++) {
        LLVMValueRef args[3] = {sx, bv[v], cur[r * nv + v]};
        cur[r * nv + v] = llvm_intr(e, "llvm.fma", args, 3);
      }
    }
  }
  LLVMValueRef oa = LLVMBuildMul(e->b, lda, llvm_i64(e, step), ""), ob = LLVMBuildMul(e->b, ldb, llvm_i64(e, step), "");
  LLVMValueRef an = LLVMBuildGEP2(e->b, g->ty, a, &oa, 1, ""), bn = LLVMBuildGEP2(e->b, g->ty, b, &ob, 1, "");
  LLVMBasicBlockRef last = LLVMGetInsertBlock(e->b);
  LLVMAddIncoming(p, &end, &last, 1);
  LLVMAddIncoming(a, &an, &last, 1);
  LLVMAddIncoming(b, &bn, &last, 1);
  for (int i = 0; i < n; i++) LLVMAddIncoming(phis[i], &cur[i], &last, 1);
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, exit);
  for (int i = 0; i < n; i++) acc[i] = phis[i];
  *ap = a, *bp = b;
  return p;
}

/* void name(i64 runs, ptr run, i64 lda, i64 ldb, ptr c, i64 ldc, i64 mr,
 * i64 nr, i32 flags): wgrad_ukernel_fn. A loop over the runs ({ptr a, ptr
 * b, i64 kc, ptr pf, i64 pf_lines} each: conv_run) around the loops over
 * their steps, which prefetch where prefetch is set; the tile added to C
 * (GEMM_ACCUMULATE) or stored. */
static void emit_wgrad_ukernel(llvm_emit *e, const char *name, kiln_dtype dt, tile t, LLVMTargetMachineRef tm,
                               bool avx512, bool prefetch) {
  LLVMTypeRef params[9] = {e->t_i64, e->t_ptr, e->t_i64, e->t_i64, e->t_ptr, e->t_i64, e->t_i64, e->t_i64, e->t_i32};
  LLVMValueRef fn = LLVMAddFunction(e->mod, name, LLVMFunctionType(e->t_void, params, 9, 0));
  kernel_attrs(e, fn, tm, avx512);
  kgen g = {.e = e, .t = t, .ty = llvm_value_type(e, dt), .esize = kiln_dtype_sizes[dt]};
  g.vty = LLVMVectorType(g.ty, (unsigned)t.vl);
  LLVMValueRef runs = LLVMGetParam(fn, 0), runp = LLVMGetParam(fn, 1), lda = LLVMGetParam(fn, 2),
               ldb = LLVMGetParam(fn, 3);
  LLVMValueRef c = LLVMGetParam(fn, 4), ldc = LLVMGetParam(fn, 5), mr = LLVMGetParam(fn, 6), nr = LLVMGetParam(fn, 7);
  LLVMBasicBlockRef entry = LLVMAppendBasicBlockInContext(e->ctx, fn, "entry");
  LLVMBasicBlockRef head = LLVMAppendBasicBlockInContext(e->ctx, fn, "run");
  LLVMBasicBlockRef body = LLVMAppendBasicBlockInContext(e->ctx, fn, "run_body");
  LLVMBasicBlockRef exit = LLVMAppendBasicBlockInContext(e->ctx, fn, "runs_done");
  LLVMPositionBuilderAtEnd(e->b, entry);
  LLVMValueRef colmask[4], lanes[16], nrv = splat(&g, nr);
  for (int v = 0; v < t.nv; v++) {
    for (int l = 0; l < t.vl; l++) lanes[l] = llvm_i64(e, (int64_t)v * t.vl + l);
    colmask[v] = LLVMBuildICmp(e->b, LLVMIntSLT, LLVMConstVector(lanes, (unsigned)t.vl), nrv, "cols");
  }
  /* the tile of C into L2 now, for the sums added to it at the end: a
   * tile's run lasts about a microsecond, and on two threads its lines are
   * often in the other core's cache (prefetches never fault, so rows past
   * mr cost nothing but the fetch) */
  int row_lines = (t.nv * t.vl * g.esize + 63) / 64;
  for (int r = 0; r < t.mr; r++)
    for (int l = 0; l < row_lines; l++) {
      LLVMValueRef off = LLVMBuildAdd(e->b, LLVMBuildMul(e->b, ldc, llvm_i64(e, r), ""), llvm_i64(e, l * 64 / g.esize), "");
      LLVMValueRef pargs[4] = {LLVMBuildGEP2(e->b, g.ty, c, &off, 1, "c_line"), llvm_i32(e, 0), llvm_i32(e, 2),
                               llvm_i32(e, 1)}; /* read, L2 (prefetcht1), data */
      llvm_intr(e, "llvm.prefetch", pargs, 4);
    }
  int n = t.mr * t.nv;
  LLVMValueRef acc[64], phis[64], zero = LLVMConstNull(g.vty), i0 = llvm_i64(e, 0);
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, head);
  LLVMValueRef tp = LLVMBuildPhi(e->b, e->t_i64, "t");
  LLVMAddIncoming(tp, &i0, &entry, 1);
  for (int i = 0; i < n; i++) {
    phis[i] = acc[i] = LLVMBuildPhi(e->b, g.vty, "acc");
    LLVMAddIncoming(phis[i], &zero, &entry, 1);
  }
  LLVMBuildCondBr(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, tp, runs, ""), body, exit);
  LLVMPositionBuilderAtEnd(e->b, body);
  /* run t: {a, b, kc, pf, pf_lines} at run + 40 t bytes */
  LLVMValueRef base = LLVMBuildMul(e->b, tp, llvm_i64(e, 5), ""), field[5];
  for (int k = 0; k < 5; k++) {
    LLVMValueRef at = k ? LLVMBuildAdd(e->b, base, llvm_i64(e, k), "") : base;
    field[k] = LLVMBuildLoad2(e->b, k == 2 || k == 4 ? e->t_i64 : e->t_ptr,
                              LLVMBuildGEP2(e->b, e->t_i64, runp, &at, 1, ""), "run");
  }
  LLVMValueRef ap = field[0], bp = field[1];
  g.kc = field[2];
  LLVMValueRef pf = prefetch ? field[3] : NULL;
  LLVMValueRef p = emit_wgrad_loop(&g, fn, i0, UNROLL, acc, &ap, &bp, lda, ldb, colmask, pf, field[4]);
  emit_wgrad_loop(&g, fn, p, 1, acc, &ap, &bp, lda, ldb, colmask, pf, field[4]);
  LLVMValueRef tnext = LLVMBuildAdd(e->b, tp, llvm_i64(e, 1), "");
  LLVMBasicBlockRef latch = LLVMGetInsertBlock(e->b);
  LLVMAddIncoming(tp, &tnext, &latch, 1);
  for (int i = 0; i < n; i++) LLVMAddIncoming(phis[i], &acc[i], &latch, 1);
  LLVMBuildBr(e->b, head);
  LLVMPositionBuilderAtEnd(e->b, exit);
  LLVMValueRef acc_bit = LLVMBuildAnd(e->b, LLVMGetParam(fn, 8), llvm_i32(e, GEMM_ACCUMULATE), "");
  LLVMValueRef add = LLVMBuildICmp(e->b, LLVMIntNE, acc_bit, llvm_i32(e, 0), "add");
  emit_store(&g, phis, c, ldc, mr, nr, add, GEMM_EPI_NONE, NULL, NULL);
  LLVMBuildRetVoid(e->b);
}

/* ---- compilation and the cache of kernels ---- */

/* lda (here and below): -1 the matmul kernel; -2 the filter-gradient
 * kernel, -3 the one that prefetches; 0 the convolution kernel, its lda a
 * parameter; > 0 the convolution kernel for that lda */
enum { LDA_GEMM = -1, LDA_WGRAD = -2, LDA_WGRAD_PF = -3 };
static void kernel_name(char *name, size_t len, kiln_dtype dt, gemm_epilogue epi, tile t, int64_t lda) {
  if (lda == LDA_WGRAD || lda == LDA_WGRAD_PF)
    snprintf(name, len, "kiln_wgrad%s_%s_%dx%d", lda == LDA_WGRAD_PF ? "_pf" : "", kiln_dtype_name(dt), t.mr,
             t.nv * t.vl);
  else if (lda < 0)
    snprintf(name, len, "kiln_gemm_%s_%s_%dx%d", kiln_dtype_name(dt), epi_names[epi], t.mr, t.nv * t.vl);
  else
    snprintf(name, len, "kiln_conv_%s_%s_%dx%d_lda%lld", kiln_dtype_name(dt), epi_names[epi], t.mr, t.nv * t.vl,
             (long long)lda);
}

/* A module holding the micro-kernel for (dt, epi), as host_isa allows (not
 * ISA_NONE). */
static LLVMModuleRef build_module(LLVMContextRef ctx, kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow,
                                  LLVMTargetMachineRef tm, isa target, char *name, size_t name_len, tile *t) {
  bool avx512 = target == ISA_AVX512;
  *t = lda != LDA_GEMM ? conv_tile_for(dt, avx512, narrow) : tile_for(dt, avx512);
  kernel_name(name, name_len, dt, epi, *t, lda);
  LLVMModuleRef mod = LLVMModuleCreateWithNameInContext(name, ctx);
  char *triple = LLVMGetTargetMachineTriple(tm);
  LLVMSetTarget(mod, triple);
  LLVMDisposeMessage(triple);
  LLVMTargetDataRef layout = LLVMCreateTargetDataLayout(tm);
  LLVMSetModuleDataLayout(mod, layout);
  LLVMDisposeTargetData(layout);
  llvm_emit e;
  llvm_emit_init(&e, ctx, mod);
  if (lda == LDA_WGRAD || lda == LDA_WGRAD_PF)
    emit_wgrad_ukernel(&e, name, dt, *t, tm, avx512, lda == LDA_WGRAD_PF);
  else if (lda >= 0)
    emit_conv_ukernel(&e, name, dt, epi, *t, tm, avx512, lda);
  else
    emit_ukernel(&e, name, dt, epi, *t, tm, avx512);
  llvm_emit_dispose(&e);
  return mod;
}

enum { UNTRIED, READY, FAILED };
typedef struct {
  atomic_int state;
  uintptr_t fn;
  int mr, nr;
} variant;

static variant variants[2][GEMM_EPI_COUNT]; /* f32, f64 */
static variant wgrad_variants[2][2]; /* [f64][prefetch] */
/* The convolution kernels: one per (dtype, epilogue, lda) in use (a
 * network has a few image widths x strides), then the generic one (lda 0)
 * for any further lda. Looked up and filled under compile_mu. */
enum { CONV_VARIANTS = 512 };
typedef struct {
  kiln_dtype dt;
  gemm_epilogue epi;
  int64_t lda;
  bool narrow;
  variant v;
} conv_variant;
static conv_variant conv_variants[CONV_VARIANTS];
static int n_conv_variants;
static pthread_mutex_t compile_mu = PTHREAD_MUTEX_INITIALIZER;

/* The disk cache's key text for a kernel: everything its code depends on
 * (the emitter itself through the library's build). malloc'd; NULL out of
 * memory. */
static char *kernel_meta(LLVMTargetMachineRef tm, const char *name, isa target) {
  unsigned maj, min, pat;
  LLVMGetVersion(&maj, &min, &pat);
  char *triple = LLVMGetTargetMachineTriple(tm), *cpu = LLVMGetTargetMachineCPU(tm),
       *features = LLVMGetTargetMachineFeatureString(tm);
  size_t n = 256 + strlen(triple) + strlen(cpu) + strlen(features) + strlen(name) + strlen(cpu_cache_build_id());
  char *m = malloc(n);
  if (m)
    snprintf(m, n, "kiln gemm micro-kernel 1\nllvm %u.%u.%u\ntriple %s\ncpu %s\nfeatures %s\n%s\nisa %d\n%s", maj, min,
             pat, triple, cpu, features, cpu_cache_build_id(), (int)target, name);
  LLVMDisposeMessage(triple);
  LLVMDisposeMessage(cpu);
  LLVMDisposeMessage(features);
  return m;
}

/* The kernel from the disk cache (linked): its address, or 0 (a miss, or
 * an entry that does not link; no error). */
static uintptr_t cached_kernel(const char *dir, const uint8_t key[16], const char *meta, const char *name) {
  cpu_cache_entry e;
  uintptr_t addr = 0;
  if (cpu_cache_load(dir, key, meta, &e) == 1 && e.info_len == strlen(name) && !memcmp(e.info, name, e.info_len)) {
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", kiln_last_error());
    addr = cpu_jit_link(e.obj, e.obj_len, name);
    if (!addr && cpu_cache_log())
      fprintf(stderr, "kiln: cache: %s: the cached kernel does not load (%s); recompiling\n", name, kiln_last_error());
    kiln_set_error("%s", saved);
  }
  cpu_cache_entry_free(&e);
  return addr;
}

/* Compiles the kernel for (dt, epi) into v, or loads it from the disk cache
 * (as programs are: a second process skips LLVM). 0, or -1 with the error
 * set. */
static int compile_variant(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, variant *v) {
  LLVMTargetMachineRef tm = cpu_jit_host_machine();
  if (!tm) return -1;
  isa target = host_isa(tm);
  if (target == ISA_NONE) {
    LLVMDisposeTargetMachine(tm);
    return kiln_set_error("gemm: no compiled micro-kernel for this CPU (x86-64 with AVX2 and FMA)");
  }
  char name[96], *msg = NULL, dir[4096];
  tile t = lda != LDA_GEMM ? conv_tile_for(dt, target == ISA_AVX512, narrow) : tile_for(dt, target == ISA_AVX512);
  kernel_name(name, sizeof name, dt, epi, t, lda);
  char *meta = cpu_cache_dir(dir, sizeof dir) ? kernel_meta(tm, name, target) : NULL;
  uint8_t key[16];
  if (meta) cpu_hash128(meta, strlen(meta), key);
  uintptr_t addr = meta ? cached_kernel(dir, key, meta, name) : 0;
  if (addr) {
    if (cpu_cache_log()) fprintf(stderr, "kiln: cache: %s: hit\n", name);
    free(meta);
    LLVMDisposeTargetMachine(tm);
    v->fn = addr, v->mr = t.mr, v->nr = t.nv * t.vl;
    return 0;
  }
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMModuleRef mod = build_module(ctx, dt, epi, lda, narrow, tm, target, name, sizeof name, &t);
  LLVMMemoryBufferRef obj = NULL, bc = NULL;
  int rc = 0;
  /* no pass pipeline: the IR is already the loop that code generation
   * wants (accumulators in SSA registers, the steps unrolled) */
  if (LLVMVerifyModule(mod, LLVMReturnStatusAction, &msg))
    rc = kiln_set_error("gemm: internal error: invalid LLVM module: %.400s", msg ? msg : "");
  if (msg) LLVMDisposeMessage(msg);
  msg = NULL;
  if (!rc && LLVMTargetMachineEmitToMemoryBuffer(tm, mod, LLVMObjectFile, &msg, &obj)) {
    rc = kiln_set_error("gemm: code generation failed: %s", msg ? msg : "");
    obj = NULL;
  }
  if (msg) LLVMDisposeMessage(msg);
  if (!rc && !(addr = cpu_jit_link(LLVMGetBufferStart(obj), LLVMGetBufferSize(obj), name))) rc = -1;
  if (!rc && meta && (bc = LLVMWriteBitcodeToMemoryBuffer(mod))) { /* cached once it links */
    cpu_cache_entry e = {.info = name,
                         .info_len = strlen(name),
                         .obj = LLVMGetBufferStart(obj),
                         .obj_len = LLVMGetBufferSize(obj),
                         .bc = LLVMGetBufferStart(bc),
                         .bc_len = LLVMGetBufferSize(bc)};
    cpu_cache_store(dir, key, meta, &e);
    LLVMDisposeMemoryBuffer(bc);
  }
  if (cpu_cache_log() && meta && !rc) fprintf(stderr, "kiln: cache: %s: miss\n", name);
  free(meta);
  if (obj) LLVMDisposeMemoryBuffer(obj);
  LLVMDisposeModule(mod);
  LLVMContextDispose(ctx);
  LLVMDisposeTargetMachine(tm);
  if (rc) return -1;
  v->fn = addr, v->mr = t.mr, v->nr = t.nv * t.vl;
  return 0;
}

static bool env_is(const char *name, const char *value) {
  const char *env = getenv(name);
  return env && !strcmp(env, value);
}

static bool usable(kiln_dtype dt, gemm_epilogue epi) {
  if ((dt != KILN_F32 && dt != KILN_F64) || (int)epi < 0 || epi >= GEMM_EPI_COUNT) return false;
  return !env_is("KILN_GEMM", "c") && !env_is("KILN_BACKEND", "interp");
}

/* v compiled if it was not tried yet (under compile_mu) */
static int try_compile(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, variant *v) {
  int state = atomic_load(&v->state);
  if (state != UNTRIED) return state;
  char saved[1024]; /* the caller's error message survives a failed compile */
  snprintf(saved, sizeof saved, "%s", kiln_last_error());
  state = compile_variant(dt, epi, lda, narrow, v) ? FAILED : READY;
  if (state == FAILED && env_is("KILN_LOG", "gemm"))
    fprintf(stderr, "kiln: gemm: no compiled %s micro-kernel for %s %s: %s\n",
            lda <= LDA_WGRAD ? "filter-gradient" : lda >= 0 ? "convolution" : "matmul",
            kiln_dtype_name(dt), epi_names[epi], kiln_last_error());
  kiln_set_error("%s", saved);
  atomic_store_explicit(&v->state, state, memory_order_release);
  return state;
}

bool cpu_gemm_ukernel(kiln_dtype dt, gemm_epilogue epi, gemm_ukernel *uk) {
  if (!usable(dt, epi)) return false;
  variant *v = &variants[dt == KILN_F64][epi];
  int state = atomic_load_explicit(&v->state, memory_order_acquire);
  if (state == UNTRIED) {
    pthread_mutex_lock(&compile_mu);
    state = try_compile(dt, epi, LDA_GEMM, false, v);
    pthread_mutex_unlock(&compile_mu);
  }
  if (state != READY) return false;
  *uk = (gemm_ukernel){(gemm_ukernel_fn)v->fn, v->mr, v->nr};
  return true;
}

/* the entry for (dt, epi, lda), added when missing and there is room;
 * NULL when full (under compile_mu) */
static variant *conv_entry(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow) {
  for (int i = 0; i < n_conv_variants; i++)
    if (conv_variants[i].dt == dt && conv_variants[i].epi == epi && conv_variants[i].lda == lda &&
        conv_variants[i].narrow == narrow)
      return &conv_variants[i].v;
  if (n_conv_variants == CONV_VARIANTS) return NULL;
  conv_variant *c = &conv_variants[n_conv_variants++];
  c->dt = dt, c->epi = epi, c->lda = lda, c->narrow = narrow;
  return &c->v;
}

bool cpu_conv_ukernel(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, conv_ukernel *uk) {
  if (!usable(dt, epi) || lda < 0) return false;
  pthread_mutex_lock(&compile_mu); /* once per convolution: no need for a faster path */
  variant *v = conv_entry(dt, epi, lda, narrow), *any = conv_entry(dt, epi, 0, narrow);
  if (v && v != any && try_compile(dt, epi, lda, narrow, v) != READY) v = NULL;
  if (!v) v = any; /* the table is full, or lda's kernel failed: the generic one */
  int state = v ? try_compile(dt, epi, 0, narrow, v) : FAILED;
  pthread_mutex_unlock(&compile_mu);
  if (state != READY) return false;
  *uk = (conv_ukernel){(conv_ukernel_fn)v->fn, v->mr, v->nr};
  return true;
}

bool cpu_wgrad_ukernel(kiln_dtype dt, bool prefetch, wgrad_ukernel *uk) {
  if (!usable(dt, GEMM_EPI_NONE)) return false;
  variant *v = &wgrad_variants[dt == KILN_F64][prefetch];
  int state = atomic_load_explicit(&v->state, memory_order_acquire);
  if (state == UNTRIED) {
    pthread_mutex_lock(&compile_mu);
    state = try_compile(dt, GEMM_EPI_NONE, prefetch ? LDA_WGRAD_PF : LDA_WGRAD, false, v);
    pthread_mutex_unlock(&compile_mu);
  }
  if (state != READY) return false;
  *uk = (wgrad_ukernel){(wgrad_ukernel_fn)v->fn, v->mr, v->nr};
  return true;
}

char *cpu_gemm_text(kiln_dtype dt, gemm_epilogue epi, const char *stage) {
  if ((dt != KILN_F32 && dt != KILN_F64) || (int)epi < 0 || epi >= GEMM_EPI_COUNT)
    return kiln_set_error("gemm: no micro-kernel for %s", kiln_dtype_name(dt)), NULL;
  int64_t lda = LDA_GEMM;
  if (stage && !strncmp(stage, "wgrad-", 6)) {
    lda = LDA_WGRAD;
    stage += 6;
  } else if (stage && !strncmp(stage, "conv-", 5)) { /* "conv-asm"; "conv64-asm" for lda 64 */
    lda = 0;
    stage += 5;
  } else if (stage && !strncmp(stage, "conv", 4) && strchr(stage, '-')) {
    lda = atoll(stage + 4);
    stage = strchr(stage, '-') + 1;
  }
  bool asm_text = stage && !strcmp(stage, "asm");
  if (!stage || (!asm_text && strcmp(stage, "llvm")))
    return kiln_set_error("gemm: no stage '%s' (llvm, asm, conv-llvm, conv-asm)", stage ? stage : "(null)"), NULL;
  LLVMTargetMachineRef tm = cpu_jit_host_machine();
  if (!tm) return NULL;
  isa target = host_isa(tm);
  if (target == ISA_NONE) {
    LLVMDisposeTargetMachine(tm);
    return kiln_set_error("gemm: no compiled micro-kernel for this CPU (x86-64 with AVX2 and FMA)"), NULL;
  }
  LLVMContextRef ctx = LLVMContextCreate();
  char name[96];
  tile t;
  LLVMModuleRef mod = build_module(ctx, dt, epi, lda, false, tm, target, name, sizeof name, &t);
  LLVMDisposeTargetMachine(tm);
  char *text = cpu_module_text(mod, asm_text, "gemm");
  LLVMDisposeModule(mod);
  LLVMContextDispose(ctx);
  return text;
}

static KILN_CONSTRUCTOR void gemm_register(void) {
  matmul_set_provider(cpu_gemm_ukernel);
  matmul_set_conv_provider(cpu_conv_ukernel);
  matmul_set_wgrad_provider(cpu_wgrad_ukernel);
}
