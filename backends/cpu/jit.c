/* jit.c — the process-wide ORC LLJIT: started once for the host CPU, a
 * JITDylib per program (reused once the program is freed), the linking of
 * a program's object code with the runtime's functions and its constants
 * as symbols, and the same for gemm.c's micro-kernels. */
#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/ExecutionEngine.h>
#include <llvm-c/IRReader.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/OrcEE.h>
#include <llvm-c/Orc.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/compile.h"

static LLVMOrcLLJITRef cpu_jit;
static char jit_error[512];
static char *host_cpu, *host_features;
/* the features code generators test: host_features, or those probed for
 * KILN_CPU's CPU (jit_init) */
static char *target_features;
static pthread_once_t jit_once = PTHREAD_ONCE_INIT;
/* JITDylibs of freed programs, emptied, for the next ones (ORC's C API
 * cannot remove a JITDylib from its session) */
static pthread_mutex_t free_libs_mu = PTHREAD_MUTEX_INITIALIZER;
static LLVMOrcJITDylibRef *free_libs;
static int n_free_libs, cap_free_libs;
static _Atomic uint64_t next_lib_id;

void cpu_error_text(LLVMErrorRef err, char *buf, size_t n) {
  char *m = LLVMGetErrorMessage(err);
  snprintf(buf, n, "%s", m);
  LLVMDisposeErrorMessage(m);
}

/* A target machine for the JIT's CPU and features, for triple (NULL: the
 * host's); for kiln-aot's objects (aot) the default code model, the small
 * one, where the JIT's is the large one. */
static LLVMTargetMachineRef machine_for(const char *for_triple, bool aot) {
  LLVMTargetRef target;
  char *triple = for_triple ? LLVMCreateMessage(for_triple) : LLVMGetDefaultTargetTriple(), *msg = NULL;
  LLVMTargetMachineRef tm = NULL;
  if (LLVMGetTargetFromTriple(triple, &target, &msg)) {
    snprintf(jit_error, sizeof jit_error, "no target for %s: %s", triple, msg ? msg : "");
  } else {
    tm = LLVMCreateTargetMachine(target, triple, host_cpu, host_features, LLVMCodeGenLevelAggressive, LLVMRelocPIC,
                                 aot ? LLVMCodeModelDefault : LLVMCodeModelJITDefault);
  }
  if (msg) LLVMDisposeMessage(msg);
  LLVMDisposeMessage(triple);
  return tm;
}

static LLVMTargetMachineRef host_machine(void) { return machine_for(NULL, false); }

/* Whether the machine's code for one small function (@p, in LLVM IR text)
 * holds `needle` (an AT&T mnemonic or register): how the features of a CPU
 * named by KILN_CPU are known, since LLVM's C API gives no feature list for
 * a CPU name. */
static bool emits(LLVMTargetMachineRef tm, const char *ir, const char *needle) {
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMMemoryBufferRef src = LLVMCreateMemoryBufferWithMemoryRangeCopy(ir, strlen(ir), "probe");
  LLVMModuleRef m = NULL;
  LLVMMemoryBufferRef ob = NULL;
  char *msg = NULL;
  bool found = false;
  if (!LLVMParseIRInContext(ctx, src, &m, &msg) /* takes src */ &&
      !LLVMTargetMachineEmitToMemoryBuffer(tm, m, LLVMAssemblyFile, &msg, &ob)) {
    size_t len = LLVMGetBufferSize(ob), nl = strlen(needle);
    const char *t = LLVMGetBufferStart(ob);
    for (size_t i = 0; !found && i + nl <= len; i++) found = !memcmp(t + i, needle, nl);
    LLVMDisposeMemoryBuffer(ob);
  }
  if (msg) LLVMDisposeMessage(msg);
  if (m) LLVMDisposeModule(m);
  LLVMContextDispose(ctx);
  return found;
}

/* The features of the CPU that KILN_CPU names which the code generators
 * test (cpu_add_target_attrs; gemm.c's choice of micro-kernel), as LLVM
 * feature text ("+avx2,+fma,+avx512f,"), found by compiling three tiny
 * functions for it. malloc'd; NULL out of memory. */
static char *probe_features(LLVMTargetMachineRef tm) {
  char f[64] = "", *triple = LLVMGetTargetMachineTriple(tm);
  if (!strncmp(triple, "x86_64", 6)) {
    if (emits(tm, "define <8 x i32> @p(<8 x i32> %a, <8 x i32> %b) {\n %r = add <8 x i32> %a, %b\n"
                  " ret <8 x i32> %r\n}\n", "%ymm"))
      strcat(f, "+avx2,");
    if (emits(tm, "declare float @llvm.fma.f32(float, float, float)\n"
                  "define float @p(float %a, float %b, float %c) {\n"
                  " %r = call float @llvm.fma.f32(float %a, float %b, float %c)\n ret float %r\n}\n", "vfmadd"))
      strcat(f, "+fma,");
    if (emits(tm, "define <16 x float> @p(<16 x float> %a, <16 x float> %b) {\n"
                  " %r = fadd <16 x float> %a, %b\n ret <16 x float> %r\n}\n", "%zmm"))
      strcat(f, "+avx512f,");
  }
  LLVMDisposeMessage(triple);
  return strdup(f);
}

/* KILN_PERF=1: object code linked by RuntimeDyld with LLVM's perf
 * listener, which writes a jitdump (jit-PID.dump, under $JITDUMPDIR or
 * ~/.debug/jit) that `perf record -k 1` + `perf inject --jit` turn into
 * named kernels in `perf report`. For profiling only. */
static LLVMOrcObjectLayerRef perf_layer(void *ctx, LLVMOrcExecutionSessionRef es, const char *triple) {
  (void)ctx, (void)triple;
  LLVMOrcObjectLayerRef layer = LLVMOrcCreateRTDyldObjectLinkingLayerWithSectionMemoryManager(es);
  LLVMJITEventListenerRef perf = LLVMCreatePerfJITEventListener();
  if (layer && perf) LLVMOrcRTDyldObjectLinkingLayerRegisterJITEventListener(layer, perf);
  return layer;
}

/* The target: the host CPU with its features, or the CPU that KILN_CPU
 * names (an LLVM CPU name: x86-64, x86-64-v2, skylake-avx512, ...) with
 * that CPU's own default features, not the host's: code for an older CPU,
 * or one valgrind emulates (x86-64-v2). Both are in the disk cache's key
 * (cache_meta, gemm.c's kernel_meta). */
static void jit_init(void) {
  LLVMInitializeNativeTarget();
  LLVMInitializeNativeAsmPrinter();
  const char *want = getenv("KILN_CPU");
  bool named = want && *want;
  host_cpu = named ? strdup(want) : LLVMGetHostCPUName();
  host_features = named ? strdup("") : LLVMGetHostCPUFeatures();
  if (!host_cpu || !host_features) {
    snprintf(jit_error, sizeof jit_error, "out of memory");
    return;
  }
  LLVMTargetMachineRef tm = host_machine();
  if (!tm) return;
  target_features = named ? probe_features(tm) : host_features;
  if (!target_features) {
    snprintf(jit_error, sizeof jit_error, "out of memory");
    LLVMDisposeTargetMachine(tm);
    return;
  }
  LLVMOrcLLJITBuilderRef b = LLVMOrcCreateLLJITBuilder();
  /* the host's triple and data layout (programs arrive as object code) */
  LLVMOrcLLJITBuilderSetJITTargetMachineBuilder(b, LLVMOrcJITTargetMachineBuilderCreateFromTargetMachine(tm));
  const char *perf = getenv("KILN_PERF");
  if (perf && !strcmp(perf, "1")) LLVMOrcLLJITBuilderSetObjectLinkingLayerCreator(b, perf_layer, NULL);
  LLVMErrorRef err = LLVMOrcCreateLLJIT(&cpu_jit, b);
  if (err) {
    cpu_error_text(err, jit_error, sizeof jit_error);
    cpu_jit = NULL;
  }
}

LLVMOrcLLJITRef cpu_jit_get(void) {
  pthread_once(&jit_once, jit_init);
  if (!cpu_jit) kiln_set_error("cpu: cannot start the LLVM JIT: %s", jit_error);
  return cpu_jit;
}

/* An empty JITDylib for a program, finding the process's symbols (libm,
 * memcpy, ...) by itself; NULL with the error set. */
static LLVMOrcJITDylibRef lib_get(LLVMOrcLLJITRef jit) {
  LLVMOrcJITDylibRef jd = NULL;
  pthread_mutex_lock(&free_libs_mu);
  if (n_free_libs > 0) jd = free_libs[--n_free_libs];
  pthread_mutex_unlock(&free_libs_mu);
  if (jd) return jd;
  char name[64];
  snprintf(name, sizeof name, "kiln.program.%llu", (unsigned long long)atomic_fetch_add(&next_lib_id, 1));
  LLVMOrcDefinitionGeneratorRef gen = NULL;
  LLVMErrorRef err =
      LLVMOrcCreateDynamicLibrarySearchGeneratorForProcess(&gen, LLVMOrcLLJITGetGlobalPrefix(jit), NULL, NULL);
  if (err) {
    char msg[512];
    cpu_error_text(err, msg, sizeof msg);
    kiln_set_error("cpu: cannot search the process for symbols: %s", msg);
    return NULL;
  }
  jd = LLVMOrcExecutionSessionCreateBareJITDylib(LLVMOrcLLJITGetExecutionSession(jit), name);
  if (!jd) {
    LLVMOrcDisposeDefinitionGenerator(gen);
    kiln_set_error("cpu: cannot create a JITDylib");
    return NULL;
  }
  LLVMOrcJITDylibAddGenerator(jd, gen);
  return jd;
}

void cpu_jit_forget(void *lib) {
  if (!lib) return;
  LLVMOrcJITDylibRef jd = lib;
  LLVMErrorRef err = LLVMOrcJITDylibClear(jd); /* the code, and the symbols defined for it */
  if (err) {
    LLVMConsumeError(err);
    return; /* not reused */
  }
  pthread_mutex_lock(&free_libs_mu);
  if (n_free_libs == cap_free_libs) {
    int cap = cap_free_libs ? 2 * cap_free_libs : 16;
    LLVMOrcJITDylibRef *q = realloc(free_libs, (size_t)cap * sizeof *q);
    if (q) free_libs = q, cap_free_libs = cap;
  }
  if (n_free_libs < cap_free_libs) free_libs[n_free_libs++] = jd;
  pthread_mutex_unlock(&free_libs_mu);
}

LLVMTargetMachineRef cpu_host_machine(void) { return host_machine(); }
LLVMTargetMachineRef cpu_aot_machine(const char *triple) { return machine_for(triple, true); }
const char *cpu_jit_error(void) { return jit_error; }
const char *cpu_host_cpu(void) { return host_cpu; }
const char *cpu_host_features(void) { return host_features; }

int cpu_llvm_fail(const char *f, const char *what, LLVMErrorRef err) {
  char msg[512];
  cpu_error_text(err, msg, sizeof msg);
  return kiln_set_error("cpu: @%s: %s: %s", f, what, msg);
}

/* ---- loading ---- */

typedef struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool done;
  LLVMErrorRef err;
  LLVMOrcExecutorAddress addr;
} lookup_wait;

static void lookup_done(LLVMErrorRef err, LLVMOrcCSymbolMapPairs res, size_t n, void *ctx) {
  lookup_wait *w = ctx;
  pthread_mutex_lock(&w->mu);
  w->err = err;
  if (!err && n > 0) w->addr = res[0].Sym.Address;
  w->done = true;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

/* The address of name in jd (links the code); 0 with the error set. */
static LLVMOrcExecutorAddress lib_lookup(LLVMOrcLLJITRef jit, LLVMOrcJITDylibRef jd, const char *name, const char *f) {
  lookup_wait w = {.done = false};
  pthread_mutex_init(&w.mu, NULL);
  pthread_cond_init(&w.cv, NULL);
  LLVMOrcCJITDylibSearchOrderElement order = {jd, LLVMOrcJITDylibLookupFlagsMatchAllSymbols};
  LLVMOrcCLookupSetElement sym = {LLVMOrcLLJITMangleAndIntern(jit, name), LLVMOrcSymbolLookupFlagsRequiredSymbol};
  LLVMOrcExecutionSessionLookup(LLVMOrcLLJITGetExecutionSession(jit), LLVMOrcLookupKindStatic, &order, 1, &sym, 1,
                                lookup_done, &w);
  pthread_mutex_lock(&w.mu);
  while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
  pthread_mutex_unlock(&w.mu);
  pthread_mutex_destroy(&w.mu);
  pthread_cond_destroy(&w.cv);
  if (w.err) return cpu_llvm_fail(f, "linking failed", w.err), 0;
  if (!w.addr) return kiln_set_error("cpu: @%s: linking failed: no %s", f, name), 0;
  return w.addr;
}

/* Links object code (the n objects, taken) into a JITDylib of p's own, with
 * the runtime's functions and p's constants as its symbols. */
int cpu_load_code(cpu_program *p, const kiln_tensor *const *consts, int n_consts, LLVMOrcLLJITRef jit,
                  LLVMMemoryBufferRef *obj, int n_obj) {
  LLVMOrcJITDylibRef jd = lib_get(jit);
  if (!jd) {
    for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(obj[i]);
    return -1;
  }
  p->jit_lib = jd;
  struct {
    const char *name;
    uintptr_t addr;
  } rt[] = {{"kiln_rt_parallel_for", (uintptr_t)parallel_for},
            {"kiln_rt_helper", (uintptr_t)cpu_rt_helper},
            {"kiln_rt_kernel_fail", (uintptr_t)cpu_rt_kernel_fail}};
  enum { NRT = sizeof rt / sizeof *rt };
  int n = NRT + n_consts;
  LLVMOrcCSymbolMapPair *pairs = malloc((size_t)n * sizeof *pairs);
  if (!pairs) {
    for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(obj[i]);
    return cpu_oom();
  }
  for (int i = 0; i < n; i++) {
    char name[32];
    if (i >= NRT) snprintf(name, sizeof name, "kiln_const%d", i - NRT);
    pairs[i].Name = LLVMOrcLLJITMangleAndIntern(jit, i < NRT ? rt[i].name : name);
    pairs[i].Sym.Address = i < NRT ? rt[i].addr : (uintptr_t)consts[i - NRT]->data;
    pairs[i].Sym.Flags.GenericFlags =
        LLVMJITSymbolGenericFlagsExported | (i < NRT ? LLVMJITSymbolGenericFlagsCallable : 0);
    pairs[i].Sym.Flags.TargetFlags = 0;
  }
  LLVMOrcMaterializationUnitRef mu = LLVMOrcAbsoluteSymbols(pairs, (size_t)n); /* takes the names */
  free(pairs);
  LLVMErrorRef err = LLVMOrcJITDylibDefine(jd, mu);
  if (err) {
    LLVMOrcDisposeMaterializationUnit(mu);
    for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(obj[i]);
    return cpu_llvm_fail(p->name, "cannot define the program's symbols", err);
  }
  for (int i = 0; i < n_obj; i++) {
    err = LLVMOrcLLJITAddObjectFile(jit, jd, obj[i]); /* takes the buffer */
    if (err) {
      while (++i < n_obj) LLVMDisposeMemoryBuffer(obj[i]);
      return cpu_llvm_fail(p->name, "the JIT refused the object code", err);
    }
  }
  LLVMOrcExecutorAddress addr = lib_lookup(jit, jd, "kiln_entry", p->name);
  if (!addr) return -1;
  p->entry = (int (*)(void **, void **, void *, cpu_call *))(uintptr_t)addr;
  return 0;
}

/* ---- the JIT for gemm.c's micro-kernels ---- */

bool cpu_jit_target_has(const char *feature) {
  if (!cpu_jit_get()) return false;
  size_t n = strlen(feature);
  for (const char *p = target_features; (p = strstr(p, feature)); p += n)
    if (p > target_features && p[-1] == '+' && (p[n] == ',' || p[n] == 0)) return true;
  return false;
}

void *cpu_jit_host_machine(void) {
  if (!cpu_jit_get()) return NULL;
  LLVMTargetMachineRef tm = host_machine();
  if (!tm) kiln_set_error("cpu: %s", jit_error);
  return tm;
}

uintptr_t cpu_jit_link(const void *obj, size_t len, const char *name) {
  LLVMOrcLLJITRef jit = cpu_jit_get();
  LLVMOrcJITDylibRef jd = jit ? lib_get(jit) : NULL;
  if (!jd) return 0;
  LLVMMemoryBufferRef buf = LLVMCreateMemoryBufferWithMemoryRangeCopy(obj, len, name);
  LLVMErrorRef err = LLVMOrcLLJITAddObjectFile(jit, jd, buf); /* takes the buffer */
  if (err) return cpu_llvm_fail(name, "the JIT refused the object code", err), 0;
  return (uintptr_t)lib_lookup(jit, jd, name, name);
}
