/* parts.c — LLVM's passes and code generation for a program's module: O3
 * (O1 for tiny programs) for the host CPU, prefetches added to the big flat
 * kernels, then an object file; a big program is first split into two
 * modules (its kernels shared out by size) that compile on two threads. */
#include <llvm-c/Analysis.h>
#include <llvm-c/BitReader.h>
#include <llvm-c/BitWriter.h>
#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/compile.h"

/* Programs whose kernels all do less work than this get LLVM's O1 (no
 * vectorizer) instead of O3: a one-kernel program then compiles in 12 ms
 * instead of 15 (measured), and its loops are too short to care */
#define SMALL_WORK 1024
/* Loop unrolling and interleaving (several vectors per iteration) only where
 * some kernel does at least this much work. They multiply the code that
 * code generation must go through: without them the MLP training step
 * compiles in 102 ms instead of 233 and the L2HMC leapfrog (184 kernels of
 * ~2000 elements) in 0.32 s instead of 2.1 (measured), while a 16M-element
 * fused kernel runs as fast either way (memory and vector-math bound). */
#define UNROLL_WORK ((int64_t)1 << 20)
/* how far ahead the big flat kernels prefetch (see prefetches) */
#define PF_AHEAD 2048

/* One module's share: O3 for the host CPU, the optimized module kept as
 * bitcode (the text stages rebuild it on demand), then machine code, an
 * object file that the JIT only links. It runs on any thread, with a target
 * machine of its own (so programs, and the parts of one, compile in
 * parallel); a failure is described in err, not in the thread's error. */
typedef struct {
  LLVMModuleRef mod;
  const char *pipeline;
  bool unroll;
  bool aot; /* cpu_optimize's */
  LLVMMemoryBufferRef bc, obj;
  double opt_ms, codegen_ms;
  char err[512];
} part;

/* the bits of a vector type of float or integer elements (0 for others) */
static unsigned vector_bits(LLVMTypeRef t) {
  LLVMTypeRef et = LLVMGetElementType(t);
  unsigned bits = LLVMGetTypeKind(et) == LLVMFloatTypeKind    ? 32
                  : LLVMGetTypeKind(et) == LLVMDoubleTypeKind ? 64
                  : LLVMGetTypeKind(et) == LLVMIntegerTypeKind ? LLVMGetIntTypeWidth(et)
                                                               : 0;
  return bits * LLVMGetVectorSize(t);
}

/* After LLVM's passes: in the flat kernels marked PF_ATTR, each load of a
 * 64-byte vector (a line of an input that the loop streams through) is
 * preceded by a prefetch of the line PF_AHEAD bytes further on. The
 * hardware prefetchers alone leave a kernel of vector math short of the
 * memory's bandwidth on one thread: tanh(x*a+b)*c+x on 16M f32 went from
 * 0.76-0.86 to 0.90-1.0 of the triad (1024-4096 bytes ahead all did about
 * as well). Added after the vectorizer, which does not widen prefetches;
 * past the end of an input they are harmless. */
static void prefetches(LLVMModuleRef mod) {
  LLVMContextRef ctx = LLVMGetModuleContext(mod);
  LLVMBuilderRef b = LLVMCreateBuilderInContext(ctx);
  LLVMTypeRef ptr = LLVMPointerTypeInContext(ctx, 0), i32 = LLVMInt32TypeInContext(ctx), i8 = LLVMInt8TypeInContext(ctx);
  LLVMTypeRef pt[4] = {ptr, i32, i32, i32};
  LLVMTypeRef fty = LLVMFunctionType(LLVMVoidTypeInContext(ctx), pt, 4, 0);
  LLVMValueRef pf = NULL;
  for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn)) {
    if (LLVMIsDeclaration(fn) ||
        !LLVMGetStringAttributeAtIndex(fn, LLVMAttributeFunctionIndex, PF_ATTR, (unsigned)strlen(PF_ATTR)))
      continue;
    for (LLVMBasicBlockRef bb = LLVMGetFirstBasicBlock(fn); bb; bb = LLVMGetNextBasicBlock(bb))
      for (LLVMValueRef in = LLVMGetFirstInstruction(bb); in; in = LLVMGetNextInstruction(in)) {
        if (!LLVMIsALoadInst(in)) continue;
        LLVMTypeRef t = LLVMTypeOf(in);
        if (LLVMGetTypeKind(t) != LLVMVectorTypeKind || vector_bits(t) != 512) continue;
        if (!pf) pf = LLVMGetNamedFunction(mod, "llvm.prefetch.p0");
        if (!pf) pf = LLVMAddFunction(mod, "llvm.prefetch.p0", fty);
        LLVMPositionBuilderBefore(b, in);
        LLVMValueRef off = LLVMConstInt(LLVMInt64TypeInContext(ctx), PF_AHEAD, 0);
        LLVMValueRef addr = LLVMBuildGEP2(b, i8, LLVMGetOperand(in, 0), &off, 1, "");
        LLVMValueRef args[4] = {addr, LLVMConstInt(i32, 0, 0), LLVMConstInt(i32, 3, 0), LLVMConstInt(i32, 1, 0)};
        LLVMBuildCall2(b, fty, pf, args, 4, "");
      }
  }
  LLVMDisposeBuilder(b);
}

static void *compile_part(void *arg) {
  part *pt = arg;
  LLVMTargetMachineRef tm = pt->aot ? cpu_aot_machine(LLVMGetTarget(pt->mod)) : cpu_host_machine();
  if (!tm) {
    snprintf(pt->err, sizeof pt->err, "%s", cpu_jit_error());
    return NULL;
  }
  LLVMPassBuilderOptionsRef opts = LLVMCreatePassBuilderOptions();
  LLVMPassBuilderOptionsSetLoopVectorization(opts, 1);
  LLVMPassBuilderOptionsSetSLPVectorization(opts, 1);
  LLVMPassBuilderOptionsSetLoopInterleaving(opts, pt->unroll);
  LLVMPassBuilderOptionsSetLoopUnrolling(opts, pt->unroll);
  double t0 = cpu_now_ms();
  LLVMErrorRef err = LLVMRunPasses(pt->mod, pt->pipeline, tm, opts);
  LLVMDisposePassBuilderOptions(opts);
  if (!err) prefetches(pt->mod);
  pt->opt_ms = cpu_now_ms() - t0;
  char *msg = NULL;
  if (err) {
    char text[400];
    cpu_error_text(err, text, sizeof text);
    snprintf(pt->err, sizeof pt->err, "optimisation failed: %s", text);
  } else if (!(pt->bc = LLVMWriteBitcodeToMemoryBuffer(pt->mod))) {
    snprintf(pt->err, sizeof pt->err, "cannot write bitcode");
  } else {
    double t1 = cpu_now_ms();
    if (LLVMTargetMachineEmitToMemoryBuffer(tm, pt->mod, LLVMObjectFile, &msg, &pt->obj)) {
      snprintf(pt->err, sizeof pt->err, "code generation failed: %s", msg ? msg : "");
      pt->obj = NULL;
    }
    pt->codegen_ms = cpu_now_ms() - t1;
  }
  if (msg) LLVMDisposeMessage(msg);
  LLVMDisposeTargetMachine(tm);
  return NULL;
}

/* A program big enough to pay for a copy of its module (a bitcode round
 * trip) compiles as two parts on two threads: LLVM's time is nearly all
 * per function, so each part takes about half (the MLP step at batch 64:
 * 118 -> 86 ms). Counted in instructions before optimisation, weighted
 * below. The kernels of the second part are no longer inlined into the
 * entry, which costs a program of tiny kernels about 5% (the L2HMC step),
 * so only programs with a kernel of at least SPLIT_MIN_WORK are split. */
#define SPLIT_MIN_INSTRS 2000
#define SPLIT_MIN_WORK ((int64_t)1 << 16)
/* A kernel's loops grow several times over as they are vectorized: each
 * counts as this many instructions more than it has (measured on the MLP
 * step, whose parts then take about the same time). */
#define KERNEL_INSTRS 200

/* fn's instructions, with those of the vector math it calls (which is
 * inlined: a tanh is one call here and some forty instructions later) */
static int64_t fn_instrs(LLVMValueRef fn, int depth) {
  int64_t n = 0;
  for (LLVMBasicBlockRef bb = LLVMGetFirstBasicBlock(fn); bb; bb = LLVMGetNextBasicBlock(bb))
    for (LLVMValueRef in = LLVMGetFirstInstruction(bb); in; in = LLVMGetNextInstruction(in)) {
      n++;
      LLVMValueRef callee = LLVMIsACallInst(in) ? LLVMGetCalledValue(in) : NULL;
      size_t len;
      if (depth < 2 && callee && LLVMIsAFunction(callee) && !LLVMIsDeclaration(callee) &&
          !strncmp(LLVMGetValueName2(callee, &len), "kiln.", 5))
        n += fn_instrs(callee, depth + 1);
    }
  return n;
}

/* The kernel a function belongs to ("kernelK" and its task "kernelK.task"),
 * else -1 (the entry, the vector math it inlines). */
static int kernel_of(LLVMValueRef fn, int n_groups) {
  size_t len;
  const char *name = LLVMGetValueName2(fn, &len);
  int k = -1, used = 0;
  if (len < 7 || strncmp(name, "kernel", 6) || sscanf(name, "kernel%d%n", &k, &used) != 1) return -1;
  if ((size_t)used != len && strcmp(name + used, ".task")) return -1;
  return k >= 0 && k < n_groups ? k : -1;
}

/* fn, defined in m, becomes a declaration of the same name and type (its
 * users now call the other part's definition). */
static void to_declaration(LLVMModuleRef m, LLVMValueRef fn) {
  size_t len;
  const char *name = LLVMGetValueName2(fn, &len);
  char buf[64];
  snprintf(buf, sizeof buf, "%.*s", (int)len, name);
  if (!LLVMGetFirstUse(fn)) {
    LLVMDeleteFunction(fn);
    return;
  }
  LLVMTypeRef ty = LLVMGlobalGetValueType(fn);
  LLVMSetValueName2(fn, "", 0);
  LLVMValueRef d = LLVMAddFunction(m, buf, ty);
  LLVMReplaceAllUsesWith(fn, d);
  LLVMDeleteFunction(fn);
}

/* Which part each kernel goes to (side[k]: 0 the first, with the entry; 1
 * the second): the largest first, each to the lighter part. False when the
 * program is too small to split. */
static bool plan_split(LLVMModuleRef mod, int n_groups, uint8_t *side, int64_t min_instrs) {
  int64_t *size = calloc((size_t)n_groups + 1, sizeof *size), rest = 0, total = 0;
  if (!size) return false;
  int kernels = 0;
  for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn)) {
    size_t len;
    if (LLVMIsDeclaration(fn) || !strncmp(LLVMGetValueName2(fn, &len), "kiln.", 5)) continue;
    int k = kernel_of(fn, n_groups);
    int64_t n = fn_instrs(fn, 0);
    if (k < 0) {
      rest += n / 2; /* the entry: straight-line calls, cheap to compile */
    } else {
      if (size[k] == 0) kernels++, size[k] += KERNEL_INSTRS, total += KERNEL_INSTRS;
      size[k] += n;
    }
    total += k < 0 ? n / 2 : n;
  }
  bool split = kernels >= 2 && total >= min_instrs;
  int64_t load[2] = {rest, 0};
  for (int done = 0; split && done < kernels; done++) {
    int big = -1;
    for (int k = 0; k < n_groups; k++)
      if (size[k] > 0 && (big < 0 || size[k] > size[big])) big = k;
    int to = load[1] < load[0];
    side[big] = (uint8_t)to;
    load[to] += size[big];
    size[big] = 0;
  }
  free(size);
  return split;
}

/* mod's functions of the other part become declarations. The second
 * part's functions that the first still calls (through those declarations:
 * a task, a kernel the entry calls itself) are marked in called, and
 * exported there; its others stay internal, so that a kernel inlined into
 * its task is not compiled twice. */
static void keep_part(LLVMModuleRef mod, LLVMValueRef *fns, int n, int n_groups, const uint8_t *side, int which,
                      uint8_t *called) {
  for (int i = 0; i < n; i++) { /* the entry first: it calls the most */
    if (LLVMIsDeclaration(fns[i])) continue;
    int k = kernel_of(fns[i], n_groups);
    size_t len;
    bool entry = k < 0 && !strcmp(LLVMGetValueName2(fns[i], &len), "kiln_entry");
    if (entry && which == 1) to_declaration(mod, fns[i]), fns[i] = NULL;
  }
  for (int i = 0; i < n; i++) {
    if (!fns[i] || LLVMIsDeclaration(fns[i])) continue;
    int k = kernel_of(fns[i], n_groups);
    if (k < 0) continue;
    bool task = LLVMGetValueName2(fns[i], &(size_t){0})[0] && strstr(LLVMGetValueName2(fns[i], &(size_t){0}), ".task");
    if (side[k] != which)
      to_declaration(mod, fns[i]);
    else if (which == 1 && (called[k] & (task ? 2 : 1)))
      LLVMSetLinkage(fns[i], LLVMExternalLinkage);
  }
  if (which == 0) /* what the declarations left are still used for */
    for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn)) {
      int k = LLVMIsDeclaration(fn) && LLVMGetFirstUse(fn) ? kernel_of(fn, n_groups) : -1;
      size_t len;
      if (k >= 0) called[k] |= strstr(LLVMGetValueName2(fn, &len), ".task") ? 2 : 1;
    }
}

/* mod's functions, in a malloc'd array of *n; NULL out of memory */
static LLVMValueRef *functions(LLVMModuleRef mod, int *n) {
  *n = 0;
  for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn)) (*n)++;
  LLVMValueRef *fns = malloc(((size_t)*n + 1) * sizeof *fns);
  if (!fns) return NULL;
  *n = 0;
  for (LLVMValueRef fn = LLVMGetFirstFunction(mod); fn; fn = LLVMGetNextFunction(fn)) fns[(*n)++] = fn;
  return fns;
}

/* The object code of mod (which this disposes, with ctx): one object, or
 * two from two threads. p's bitcode and timings are set. 0, or -1 with the
 * error set. */
int cpu_optimize(cpu_program *p, LLVMContextRef ctx, LLVMModuleRef mod, int n_groups, int64_t max_work,
                 int parts_wanted, bool aot, LLVMMemoryBufferRef obj[2], int *n_obj) {
  const char *pipeline = max_work < SMALL_WORK ? "default<O1>" : "default<O3>";
  bool unroll = max_work >= UNROLL_WORK;
  *n_obj = 0;
  char *msg = NULL;
  if (LLVMVerifyModule(mod, LLVMReturnStatusAction, &msg)) {
    kiln_set_error("cpu: @%s: internal error: invalid LLVM module: %.400s", p->name, msg ? msg : "");
    LLVMDisposeMessage(msg);
    LLVMDisposeModule(mod);
    LLVMContextDispose(ctx);
    return -1;
  }
  LLVMDisposeMessage(msg);
  part parts[2] = {{.mod = mod, .pipeline = pipeline, .unroll = unroll, .aot = aot},
                   {.pipeline = pipeline, .unroll = unroll, .aot = aot}};
  LLVMContextRef ctx2 = NULL;
  int n = 1;
  bool auto_split = !aot && !parts_wanted && kiln_num_threads() >= 2 && max_work >= SPLIT_MIN_WORK;
  uint8_t *side = auto_split || (!aot && parts_wanted == 2) ? calloc((size_t)n_groups + 1, 1) : NULL;
  if (side && plan_split(mod, n_groups, side, auto_split ? SPLIT_MIN_INSTRS : 0)) { /* the copy, then each keeps its share */
    LLVMMemoryBufferRef bc = LLVMWriteBitcodeToMemoryBuffer(mod);
    ctx2 = LLVMContextCreate();
    if (bc && !LLVMParseBitcodeInContext2(ctx2, bc, &parts[1].mod)) {
      int n0, n1; /* everything allocated before either module changes */
      uint8_t *called = calloc((size_t)n_groups + 1, 1);
      LLVMValueRef *f0 = functions(parts[0].mod, &n0), *f1 = functions(parts[1].mod, &n1);
      if (called && f0 && f1) {
        keep_part(parts[0].mod, f0, n0, n_groups, side, 0, called);
        keep_part(parts[1].mod, f1, n1, n_groups, side, 1, called);
        n = 2;
      } else { /* one part after all */
        LLVMDisposeModule(parts[1].mod);
        parts[1].mod = NULL;
      }
      free(called);
      free(f0);
      free(f1);
    }
    if (bc) LLVMDisposeMemoryBuffer(bc);
  }
  free(side);
  pthread_t th;
  bool threaded = n == 2 && !pthread_create(&th, NULL, compile_part, &parts[1]);
  compile_part(&parts[0]);
  if (threaded)
    pthread_join(th, NULL);
  else if (n == 2)
    compile_part(&parts[1]);
  int rc = 0;
  const void *bcs[2];
  size_t lens[2];
  for (int i = 0; i < n; i++) {
    if (parts[i].err[0] && !rc) rc = kiln_set_error("cpu: @%s: %s", p->name, parts[i].err);
    if (parts[i].bc) bcs[i] = LLVMGetBufferStart(parts[i].bc), lens[i] = LLVMGetBufferSize(parts[i].bc);
    if (parts[i].opt_ms > p->opt_ms) p->opt_ms = parts[i].opt_ms; /* the parts run side by side */
    if (parts[i].codegen_ms > p->codegen_ms) p->codegen_ms = parts[i].codegen_ms;
  }
  if (!rc) {
    if (n == 1) {
      p->bitcode = malloc(lens[0] + 1);
      if (p->bitcode) memcpy(p->bitcode, bcs[0], lens[0]), p->bitcode_len = lens[0];
    } else {
      p->bitcode = cpu_parts_pack(n, bcs, lens, &p->bitcode_len);
    }
    if (!p->bitcode) rc = kiln_set_error("cpu: out of memory");
  }
  for (int i = 0; i < n; i++) {
    if (parts[i].bc) LLVMDisposeMemoryBuffer(parts[i].bc);
    if (!rc)
      obj[i] = parts[i].obj;
    else if (parts[i].obj)
      LLVMDisposeMemoryBuffer(parts[i].obj);
    if (parts[i].mod) LLVMDisposeModule(parts[i].mod);
  }
  LLVMContextDispose(ctx);
  if (ctx2) LLVMContextDispose(ctx2);
  if (!rc) *n_obj = p->parts = n;
  return rc;
}
