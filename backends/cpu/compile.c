/* compile.c — from an IR function to native code. The plan gives every
 * value a place (parameter, result, arena offset, constant, or the place of
 * the value a view reads) and every instruction a step: a compiled kernel
 * (a group of fusible instructions, one LLVM function with its loops) or a
 * runtime helper (dot, gather, ... through the eager kernels). One entry
 * function runs the steps in order. The module is optimised with O3 and
 * compiled to an object file for the host CPU on the calling thread (or the
 * object file is read from the disk cache, cache.c); one process-wide ORC
 * LLJIT links it into a JITDylib of the program's own. The object code holds
 * no address of this process: constants and the runtime's functions are
 * symbols that each program's JITDylib defines, so it can be cached. */
#include <llvm-c/Analysis.h>
#include <llvm-c/BitReader.h>
#include <llvm-c/BitWriter.h>
#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/IRReader.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/Linker.h>
#include <llvm-c/Orc.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "cpu/cpu.h"
#include "cpu/gemm.h"
#include "llvm/llvm_emit.h"

enum {
  FLAT_BLOCK = 64,   /* elements: a flat kernel's tasks start 64-byte aligned, whatever the dtype */
  PAR_MIN = 65536,   /* elements of work below which a kernel stays on the calling thread */
  PAR_GRAIN = 16384, /* elements of work per task, at least */
  /* ... for a kernel of cheap ops: its inputs are usually in this core's
   * caches (the kernel before wrote them), and another core would first
   * have to pull its half over (the MLP batch-1 training step ran in 0.062
   * ms on one thread and 0.095 ms on two, measured) */
  PAR_MIN_CHEAP = 1 << 19,
  ROW_BLOCK = 16384, /* a long innermost row is cut into blocks of this many (tasks) */
  NARROW_ROW = 4,    /* innermost rows up to this long are unrolled (vectors run across rows) */
  TILE_ROWS = 16,    /* the tiles of a kernel that reads across rows (a transpose) */
  TILE_COLS = 64,
};
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
/* outputs of at least this many bytes are stored around the caches (x86) */
#define NT_MIN_BYTES ((int64_t)32 << 20)
/* flat kernels with outputs of at least this many bytes prefetch their
 * inputs PF_AHEAD bytes ahead (see prefetches); PF_ATTR marks them */
#define PF_MIN_BYTES ((int64_t)8 << 20)
#define PF_AHEAD 2048
#define PF_ATTR "kiln-prefetch"

/* ---- the process-wide JIT ---- */

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

static void error_text(LLVMErrorRef err, char *buf, size_t n) {
  char *m = LLVMGetErrorMessage(err);
  snprintf(buf, n, "%s", m);
  LLVMDisposeErrorMessage(m);
}

static LLVMTargetMachineRef host_machine(void) {
  LLVMTargetRef target;
  char *triple = LLVMGetDefaultTargetTriple(), *msg = NULL;
  LLVMTargetMachineRef tm = NULL;
  if (LLVMGetTargetFromTriple(triple, &target, &msg)) {
    snprintf(jit_error, sizeof jit_error, "no target for %s: %s", triple, msg ? msg : "");
  } else {
    tm = LLVMCreateTargetMachine(target, triple, host_cpu, host_features, LLVMCodeGenLevelAggressive, LLVMRelocPIC,
                                 LLVMCodeModelJITDefault);
  }
  if (msg) LLVMDisposeMessage(msg);
  LLVMDisposeMessage(triple);
  return tm;
}

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
 * test (add_target_attrs; gemm.c's choice of micro-kernel), as LLVM feature
 * text ("+avx2,+fma,+avx512f,"), found by compiling three tiny functions
 * for it. malloc'd; NULL out of memory. */
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
  LLVMErrorRef err = LLVMOrcCreateLLJIT(&cpu_jit, b);
  if (err) {
    error_text(err, jit_error, sizeof jit_error);
    cpu_jit = NULL;
  }
}

static LLVMOrcLLJITRef jit_get(void) {
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
    error_text(err, msg, sizeof msg);
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

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* ---- the plan ---- */

enum { SLOT_PARAM, SLOT_RESULT, SLOT_ARENA, SLOT_CONST };
typedef struct {
  int kind;
  int index;      /* parameter or result */
  int64_t offset; /* arena */
  const kiln_tensor *cst;
} slot;

/* A kernel: instructions of f evaluated together per output element. */
typedef struct {
  const ir_func *f;
  bool *member; /* per instruction of f */
  int *leaf;    /* per value of f: the slot it is read from, or -1 */
  int n_out;
  ir_value *out; /* the values it stores, all of one shape (or reductions of one input shape) */
  int *out_slot;
} kgroup;

enum { STEP_KERNEL, STEP_HELPER, STEP_COPY };
typedef struct {
  int kind;
  int index;   /* group or helper */
  int n_slots; /* helper: its outputs, then its inputs; copy: destination, source */
  int *slots;
  int64_t bytes; /* copy */
} step;

/* Every constant instruction the plan meets, in order (a tensor met twice
 * is listed twice): the code reads constant i through the symbol
 * kiln_const<i>, which the program's JITDylib defines as its data. The same
 * IR in another process lists the same contents in the same order, so its
 * cached code reads the right ones whichever tensors are shared. */
typedef struct {
  const kiln_tensor **t;
  int n, cap;
} const_list;

typedef struct {
  const ir_func *f;
  cpu_program *p;
  const_list *consts;
  slot *slots;
  int n_slots, cap_slots;
  int *vslot;        /* per value of f */
  int *result_of;    /* per value of f: the first result that returns it, or -1 */
  bool *result_done; /* per result: its buffer is taken */
  kgroup *groups;
  int n_groups;
  step *steps;
  int n_steps;
  int max_bufs; /* most pointers one step passes */
  bool x86;     /* the host is x86-64: streaming stores */
  int64_t max_work; /* elements of the biggest kernel */
  /* emission */
  llvm_emit e;
  LLVMBuilderRef eb; /* the entry function's builder */
  LLVMValueRef entry, call_arg, ctx_array, *slot_ptr;
  LLVMTypeRef ty_par, ty_helper, ty_fail, ty_task;
  LLVMValueRef fn_par, fn_helper, fn_fail;
} cpu_build;

static int oom(void) { return kiln_set_error("cpu: out of memory"); }

static int add_slot(cpu_build *cb, slot s) {
  if (cb->n_slots == cb->cap_slots) {
    int cap = cb->cap_slots ? 2 * cb->cap_slots : 16;
    slot *q = realloc(cb->slots, (size_t)cap * sizeof *q);
    if (!q) return oom();
    cb->slots = q;
    cb->cap_slots = cap;
  }
  cb->slots[cb->n_slots] = s;
  return cb->n_slots++;
}

static int64_t type_size(const op_type *t) {
  int64_t n = 1;
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}

static int64_t type_bytes(const op_type *t) { return type_size(t) * (int64_t)kiln_dtype_sizes[t->dtype]; }

static int arena_slot(cpu_build *cb, const op_type *t) {
  int64_t off = (int64_t)cb->p->arena_bytes;
  cb->p->arena_bytes = (size_t)((off + type_bytes(t) + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN);
  return add_slot(cb, (slot){SLOT_ARENA, 0, off, NULL});
}

/* A fresh place for value v of f: the buffer of the result that returns it
 * (top level), else the arena. */
static int value_slot(cpu_build *cb, const ir_func *f, ir_value v, bool top) {
  if (top && cb->result_of[v] >= 0 && !cb->result_done[cb->result_of[v]]) {
    cb->result_done[cb->result_of[v]] = true;
    return add_slot(cb, (slot){SLOT_RESULT, cb->result_of[v], 0, NULL});
  }
  if (top && f->buf_offset && f->buf_offset[v] >= 0) /* the buffers pass's plan */
    return add_slot(cb, (slot){SLOT_ARENA, 0, f->buf_offset[v], NULL});
  return arena_slot(cb, &f->types[v]);
}

static int add_step(cpu_build *cb, step st) {
  step *q = realloc(cb->steps, (size_t)(cb->n_steps + 1) * sizeof *q);
  if (!q) {
    free(st.slots);
    return oom();
  }
  cb->steps = q;
  cb->steps[cb->n_steps++] = st;
  if (st.n_slots + 1 > cb->max_bufs) cb->max_bufs = st.n_slots + 1;
  return 0;
}

static int retain_const(cpu_build *cb, kiln_tensor *t) {
  const_list *l = cb->consts;
  if (l->n == l->cap) {
    int cap = l->cap ? 2 * l->cap : 16;
    const kiln_tensor **q = realloc(l->t, (size_t)cap * sizeof *q);
    if (!q) return oom();
    l->t = q;
    l->cap = cap;
  }
  l->t[l->n++] = t;
  cpu_program *p = cb->p;
  for (int i = 0; i < p->n_consts; i++)
    if (p->consts[i] == t) return 0;
  kiln_tensor **q = realloc(p->consts, (size_t)(p->n_consts + 1) * sizeof *q);
  if (!q) return oom();
  p->consts = q;
  p->consts[p->n_consts++] = kiln_retain(t);
  return 0;
}

static kgroup *new_group(cpu_build *cb, const ir_func *f, int n_out) {
  kgroup *q = realloc(cb->groups, (size_t)(cb->n_groups + 1) * sizeof *q);
  if (!q) return oom(), NULL;
  cb->groups = q;
  kgroup *g = &cb->groups[cb->n_groups];
  memset(g, 0, sizeof *g);
  g->f = f;
  g->member = calloc((size_t)f->n_instrs + 1, sizeof *g->member);
  g->leaf = malloc(((size_t)f->n_values + 1) * sizeof *g->leaf);
  g->out = malloc((size_t)n_out * sizeof *g->out);
  g->out_slot = malloc((size_t)n_out * sizeof *g->out_slot);
  cb->n_groups++; /* freed with the build, even half made */
  if (!g->member || !g->leaf || !g->out || !g->out_slot) return oom(), NULL;
  for (int v = 0; v < f->n_values; v++) g->leaf[v] = -1;
  g->n_out = n_out;
  return g;
}

/* the step of the newest group, after counting the pointers it passes */
static int group_step(cpu_build *cb, kgroup *g) {
  int bufs = g->n_out;
  for (int v = 0; v < g->f->n_values; v++) bufs += g->leaf[v] >= 0;
  if (bufs + 2 > cb->max_bufs) cb->max_bufs = bufs + 2;
  return add_step(cb, (step){STEP_KERNEL, cb->n_groups - 1, 0, NULL, 0});
}

/* one instruction as a kernel, with the constants it reads pulled inside */
static int plan_kernel(cpu_build *cb, const ir_func *f, int i, const int *vs, int dst) {
  const ir_instr *in = &f->instrs[i];
  kgroup *g = new_group(cb, f, 1);
  if (!g) return -1;
  g->member[i] = true;
  for (int k = 0; k < in->n_in; k++) {
    ir_value u = in->in[k];
    const ir_instr *d = ir_def(f, u);
    if (d && d->op == OP_CONSTANT)
      g->member[f->def[u]] = true;
    else
      g->leaf[u] = vs[u];
  }
  g->out[0] = in->out;
  g->out_slot[0] = dst;
  return group_step(cb, g);
}

/* A dot of a fusion body that runs just before the body's kernel, as a
 * packed matmul (a runtime helper) into a temporary that the kernel reads:
 * its inner dimension is too long to sum per element, its operands are the
 * body's parameters, and only the body reads it. The rest of the body (a
 * bias, an activation, an SGD update) is then one kernel, not one per op. */
static bool dot_before_kernel(const ir_func *c, const ir_instr *in) {
  if (in->op != OP_DOT || llvm_dot_inline(c, in)) return false;
  for (int k = 0; k < in->n_in; k++)
    if (ir_def(c, in->in[k])) return false;
  for (int r = 0; r < c->n_results; r++)
    if (c->results[r] == in->out) return false;
  return true;
}

/* a dot a kernel can take: summed in it, or run just before it */
static bool dot_in_fusion(const ir_func *c, const ir_instr *in) {
  return llvm_dot_inline(c, in) || dot_before_kernel(c, in);
}

/* Whether a fusion's body can be one kernel (the shared rule) */
static bool fusion_ok(const ir_func *c) { return llvm_fusion_one_kernel(c, dot_in_fusion); }

static int plan_helper(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top);

/* Whether a fusion body is exactly a dot that runs before its kernel, big
 * enough for the compiled micro-kernel (lib/matmul.h), + a bias over its
 * columns (a parameter of n values), and maybe relu or tanh, with that one
 * result. The matmul then applies bias and activation as it stores its
 * tiles, and the body needs no kernel (nor a temporary). ops gets the
 * parameters that are the dot's operands and the bias. */
static bool dot_epilogue(const ir_func *c, ir_value ops[3], gemm_epilogue *epi) {
  if (c->n_results != 1 || c->n_instrs < 2 || c->n_instrs > 3) return false;
  const ir_instr *d = &c->instrs[0], *add = &c->instrs[1];
  const op_type *t = &c->types[d->out];
  if (!dot_before_kernel(c, d) || add->op != OP_ADD || (t->dtype != KILN_F32 && t->dtype != KILN_F64)) return false;
  int64_t m = t->shape[t->rank - 2], n = t->shape[t->rank - 1];
  int64_t k = c->types[d->in[0]].shape[c->types[d->in[0]].rank - 1];
  if (m < 2 || n < 2 || m * n * k < MATMUL_JIT_WORK) return false;
  ir_value bias = add->in[0] == d->out ? add->in[1] : add->in[0];
  const op_type *bt = &c->types[bias], *at = &c->types[add->out];
  if (bias == d->out || (add->in[0] != d->out && add->in[1] != d->out) || ir_def(c, bias)) return false;
  if (bt->rank < 1 || bt->shape[bt->rank - 1] != n || type_size(bt) != n || bt->rank > t->rank ||
      type_size(at) != type_size(t))
    return false;
  *epi = GEMM_EPI_BIAS;
  ir_value out = add->out;
  if (c->n_instrs == 3) {
    const ir_instr *act = &c->instrs[2];
    if ((act->op != OP_RELU && act->op != OP_TANH) || act->in[0] != add->out) return false;
    *epi = act->op == OP_RELU ? GEMM_EPI_BIAS_RELU : GEMM_EPI_BIAS_TANH;
    out = act->out;
  }
  if (c->results[0] != out) return false;
  ops[0] = d->in[0], ops[1] = d->in[1], ops[2] = bias;
  return true;
}

/* The fusion as one helper: a dot of three inputs (the operands and the
 * bias) with its epilogue, which run.c gives to matmul_epilogue
 * (lib/matmul.h), writing the fusion's result. */
static int plan_dot_epilogue(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top,
                             const ir_value ops[3], gemm_epilogue epi) {
  ir_value args[3];
  for (int k = 0; k < 3; k++) args[k] = in->in[ops[k]]; /* the body's parameters are its first values */
  ir_instr call = {.op = OP_DOT, .n_in = 3, .in = args, .out = in->out, .n_out = 1, .loc = in->loc};
  if (plan_helper(cb, f, &call, vs, top)) return -1;
  cb->p->helpers[cb->p->n_helpers - 1].epilogue = (int)epi;
  return 0;
}

/* A transpose (of a matrix: its two dims swapped) that defines value v of
 * f and that nothing else reads (uses: of each value of f, results
 * included), else NULL. */
static const ir_instr *lone_transpose(const ir_func *f, ir_value v, const int *uses) {
  const ir_instr *t = ir_def(f, v);
  if (!t || t->op != OP_TRANSPOSE || uses[v] != 1 || f->types[t->in[0]].rank != 2) return NULL;
  return t->attrs.axes[0] == 1 && t->attrs.axes[1] == 0 ? t : NULL;
}

/* The transposes (c[0] of the first operand, c[1] of the second, either
 * NULL) that a dot helper of operand types a . b (rank 2) reads in place
 * (matmul_trans), in t: a few rows times a transposed matrix (matmul_nt),
 * or float products that pack, whose packing reads either operand as it
 * lies. False when none. */
static bool trans_plan(const op_type *a, const op_type *b, const ir_instr *const c[2], const ir_instr *t[2]) {
  t[0] = t[1] = NULL;
  if (a->rank != 2 || b->rank != 2 || (!c[0] && !c[1])) return false;
  int64_t m = a->shape[0], k = a->shape[1], n = b->shape[1];
  if (c[1] && !c[0] && m <= MATMUL_NT_ROWS) {
    t[1] = c[1];
    return true;
  }
  if ((a->dtype != KILN_F32 && a->dtype != KILN_F64) || !matmul_packs(m, n, k)) return false;
  t[0] = c[0], t[1] = c[1];
  return true;
}

/* trans_plan for a top-level dot in of f that runs as a helper */
static bool dot_transposes(const ir_func *f, const ir_instr *in, const int *uses, const ir_instr *t[2]) {
  t[0] = t[1] = NULL;
  if (in->op != OP_DOT || in->n_in != 2 || llvm_dot_inline(f, in)) return false;
  const ir_instr *c[2] = {lone_transpose(f, in->in[0], uses), lone_transpose(f, in->in[1], uses)};
  return trans_plan(&f->types[in->in[0]], &f->types[in->in[1]], c, t);
}

/* trans_plan for dot d that runs before the kernel of fusion fu (of f):
 * its operands are body parameters, which the dot alone reads (body_uses),
 * bound to values of f that lone transposes define */
static bool fusion_dot_transposes(const ir_func *f, const ir_instr *fu, const int *uses, const ir_instr *d,
                                  const int *body_uses, const ir_instr *t[2]) {
  const ir_func *c = fu->attrs.callee;
  const ir_instr *cand[2] = {NULL, NULL};
  for (int s = 0; s < 2; s++) {
    ir_value q = d->in[s]; /* a parameter: dot_before_kernel */
    if (q < fu->n_in && body_uses[q] == 1) cand[s] = lone_transpose(f, fu->in[q], uses);
  }
  return trans_plan(&c->types[d->in[0]], &c->types[d->in[1]], cand, t);
}

/* Per value of f: how many instructions and results read it. malloc'd;
 * NULL out of memory. */
static int *value_uses(const ir_func *f) {
  int *uses = calloc((size_t)f->n_values + 1, sizeof *uses);
  if (!uses) return NULL;
  for (int i = 0; i < f->n_instrs; i++)
    for (int k = 0; k < f->instrs[i].n_in; k++) uses[f->instrs[i].in[k]]++;
  for (int r = 0; r < f->n_results; r++) uses[f->results[r]]++;
  return uses;
}

/* uses: of each value of f (plan_func's), for the transposes the fusion's
 * dots read in place */
static int plan_fusion(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top, const int *uses) {
  const ir_func *c = in->attrs.callee;
  ir_value ops[3];
  gemm_epilogue epi;
  if (dot_epilogue(c, ops, &epi)) return plan_dot_epilogue(cb, f, in, vs, top, ops, epi);
  /* the body's slots, for the dots that run before its kernel; parameters
   * bound to a transpose such a dot reads in place are not the kernel's */
  int *cvs = malloc(((size_t)c->n_values + 1) * sizeof *cvs), *body_uses = value_uses(c);
  bool *unread = calloc((size_t)in->n_in + 1, sizeof *unread);
  if (!cvs || !body_uses || !unread) {
    free(cvs), free(body_uses), free(unread);
    return oom();
  }
  for (int k = 0; k < in->n_in; k++) cvs[k] = vs[in->in[k]];
  int rc = 0;
  for (int i = 0; i < c->n_instrs && !rc; i++) {
    const ir_instr *d = &c->instrs[i], *t[2];
    if (!dot_before_kernel(c, d)) continue;
    bool trans = fusion_dot_transposes(f, in, uses, d, body_uses, t);
    for (int s = 0; trans && s < 2; s++)
      if (t[s]) cvs[d->in[s]] = vs[t[s]->in[0]], unread[d->in[s]] = true;
    rc = plan_helper(cb, c, d, cvs, false);
    if (!rc && trans) {
      cpu_helper *h = &cb->p->helpers[cb->p->n_helpers - 1];
      for (int s = 0; s < 2; s++)
        if (t[s]) h->in_types[s] = f->types[t[s]->in[0]];
      h->trans_a = t[0] != NULL, h->trans_b = t[1] != NULL;
    }
  }
  free(body_uses);
  if (rc) {
    free(cvs), free(unread);
    return -1;
  }
  kgroup *g = new_group(cb, c, c->n_results);
  for (int i = 0; g && i < c->n_instrs; i++) {
    if (dot_before_kernel(c, &c->instrs[i])) {
      g->leaf[c->instrs[i].out] = cvs[c->instrs[i].out];
      continue;
    }
    g->member[i] = true;
    if (c->instrs[i].op == OP_CONSTANT && retain_const(cb, c->instrs[i].attrs.value)) g = NULL;
  }
  free(cvs);
  if (!g) {
    free(unread);
    return -1;
  }
  for (int k = 0; k < in->n_in; k++) g->leaf[k] = unread[k] ? -1 : vs[in->in[k]];
  free(unread);
  for (int r = 0; r < c->n_results; r++) {
    int s = value_slot(cb, f, in->out + r, top);
    if (s < 0) return -1;
    vs[in->out + r] = s;
    g->out[r] = c->results[r];
    g->out_slot[r] = s;
  }
  return group_step(cb, g);
}

static int plan_helper(cpu_build *cb, const ir_func *f, const ir_instr *in, int *vs, bool top) {
  cpu_program *p = cb->p;
  cpu_helper *q = realloc(p->helpers, (size_t)(p->n_helpers + 1) * sizeof *q);
  if (!q) return oom();
  p->helpers = q;
  cpu_helper *h = &p->helpers[p->n_helpers++];
  memset(h, 0, sizeof *h);
  h->op = in->op;
  h->attrs = in->attrs;
  h->n_in = in->n_in;
  h->n_out = in->n_out;
  h->in_types = malloc(((size_t)in->n_in + 1) * sizeof *h->in_types);
  h->out_types = malloc((size_t)in->n_out * sizeof *h->out_types);
  step st = {STEP_HELPER, p->n_helpers - 1, in->n_out + in->n_in, NULL, 0};
  st.slots = malloc((size_t)st.n_slots * sizeof *st.slots);
  if (!h->in_types || !h->out_types || !st.slots) {
    free(st.slots);
    return oom();
  }
  if (kiln_ops[in->op].kind == OPK_HOST) {
    const ir_host *host = in->attrs.host;
    h->host_fn = host->fn;
    h->host_user = host->user;
    h->host_name = malloc(strlen(host->name) + 1);
    if (!h->host_name) {
      free(st.slots);
      return oom();
    }
    strcpy(h->host_name, host->name);
    h->attrs.host = NULL; /* the module's; not kept */
  }
  for (int k = 0; k < in->n_in; k++) {
    h->in_types[k] = f->types[in->in[k]];
    st.slots[in->n_out + k] = vs[in->in[k]];
  }
  for (int k = 0; k < in->n_out; k++) {
    h->out_types[k] = f->types[in->out + k];
    if ((vs[in->out + k] = st.slots[k] = value_slot(cb, f, in->out + k, top)) < 0) {
      free(st.slots);
      return -1;
    }
  }
  return add_step(cb, st);
}


/* Plans f's instructions. vs (per value of f) gets each value's slot; the
 * parameters' slots are given. top: f is the compiled function, whose
 * results get their own buffers. Calls are inlined. */
static int plan_func(cpu_build *cb, const ir_func *f, int *vs, const int *param_slots, bool top, int depth) {
  if (depth > 100) return kiln_set_error("cpu: @%s: calls nest too deep", cb->f->name);
  for (int i = 0; i < f->n_params; i++) vs[i] = param_slots[i];
  int *uses = value_uses(f);
  bool *skip = calloc((size_t)f->n_instrs + 1, sizeof *skip); /* transposes that matmul_nt saves */
  if (!uses || !skip) {
    free(uses);
    free(skip);
    return oom();
  }
  int rc = 0;
  for (int i = 0; i < f->n_instrs && rc >= 0; i++) { /* the transposes dots read in place */
    const ir_instr *in = &f->instrs[i], *t[2];
    if (dot_transposes(f, in, uses, t)) {
      for (int s = 0; s < 2; s++)
        if (t[s]) skip[t[s] - f->instrs] = true;
    } else if (in->op == OP_FUSION && fusion_ok(in->attrs.callee) &&
               !dot_epilogue(in->attrs.callee, (ir_value[3]){0}, &(gemm_epilogue){0})) {
      const ir_func *c = in->attrs.callee;
      int *body_uses = value_uses(c);
      if (!body_uses) rc = oom();
      for (int j = 0; body_uses && j < c->n_instrs; j++)
        if (dot_before_kernel(c, &c->instrs[j]) && fusion_dot_transposes(f, in, uses, &c->instrs[j], body_uses, t))
          for (int s = 0; s < 2; s++)
            if (t[s]) skip[t[s] - f->instrs] = true;
      free(body_uses);
    }
  }
  for (int i = 0; i < f->n_instrs && rc >= 0; i++) {
    rc = 0;
    const ir_instr *in = &f->instrs[i];
    ir_value v = in->out;
    op_id op = in->op;
    op_kind kind = kiln_ops[op].kind;
    const ir_instr *t[2];
    if (skip[i]) {
      continue;
    } else if (dot_transposes(f, in, uses, t)) { /* the dot reads the matrices before their transposes */
      ir_value args[2] = {t[0] ? t[0]->in[0] : in->in[0], t[1] ? t[1]->in[0] : in->in[1]};
      ir_instr dot = *in;
      dot.in = args;
      rc = plan_helper(cb, f, &dot, vs, top);
      if (rc >= 0) {
        cpu_helper *h = &cb->p->helpers[cb->p->n_helpers - 1];
        h->trans_a = t[0] != NULL, h->trans_b = t[1] != NULL;
      }
    } else if (op == OP_FUSION && fusion_ok(in->attrs.callee)) {
      rc = plan_fusion(cb, f, in, vs, top, uses);
    } else if (op == OP_CONSTANT) {
      rc = retain_const(cb, in->attrs.value);
      if (rc >= 0) rc = vs[v] = add_slot(cb, (slot){SLOT_CONST, 0, 0, in->attrs.value});
    } else if (kind == OPK_VIEW) {
      vs[v] = vs[in->in[0]]; /* the same bytes, read with another shape */
    } else if (kind == OPK_CALL) { /* call, and fusions that are not one kernel: inline */
      const ir_func *c = in->attrs.callee;
      int *cvs = malloc(((size_t)c->n_values + 1) * sizeof *cvs);
      int *ps = malloc(((size_t)in->n_in + 1) * sizeof *ps);
      if (!cvs || !ps) rc = oom();
      for (int k = 0; !rc && k < in->n_in; k++) ps[k] = vs[in->in[k]];
      if (!rc) rc = plan_func(cb, c, cvs, ps, false, depth + 1);
      for (int k = 0; !rc && k < in->n_out; k++) vs[v + k] = cvs[c->results[k]];
      free(cvs);
      free(ps);
    } else if (llvm_op_fusible(op) || llvm_dot_inline(f, in)) {
      int dst = vs[v] = value_slot(cb, f, v, top);
      rc = dst < 0 ? -1 : plan_kernel(cb, f, i, vs, dst);
    } else if (kind == OPK_DOT || kind == OPK_INDEX || kind == OPK_RANDOM || kind == OPK_SOURCE || kind == OPK_HOST ||
               op == OP_CONCAT || op == OP_ARGMAX) {
      rc = plan_helper(cb, f, in, vs, top);
    } else {
      rc = kiln_set_error("cpu: @%s: %s is not supported by the CPU backend", f->name, kiln_ops[op].name);
    }
  }
  free(uses);
  free(skip);
  return rc < 0 ? -1 : 0;
}

/* ---- buffer donation: results written over parameters' buffers ---- */

static bool same_shape(const op_type *a, const op_type *b) {
  if (a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

static bool same_type(const op_type *a, const op_type *b) { return a->dtype == b->dtype && same_shape(a, b); }

/* Whether g evaluates value u only at the index of the element it stores:
 * u is an output, or every member reading it is elementwise over u's shape
 * and such a value itself. memo (per value): 0 unknown, 1 yes, 2 no. */
static bool at_store_index(const kgroup *g, ir_value u, uint8_t *memo) {
  if (memo[u]) return memo[u] == 1;
  const ir_func *f = g->f;
  bool used = false, ok = true;
  for (int k = 0; k < g->n_out; k++) used = used || g->out[k] == u;
  for (int i = 0; i < f->n_instrs && ok; i++) {
    const ir_instr *in = &f->instrs[i];
    bool reads = false;
    for (int k = 0; k < in->n_in; k++) reads = reads || in->in[k] == u;
    if (!g->member[i] || !reads) continue;
    op_kind kind = kiln_ops[in->op].kind;
    bool elementwise =
        kind == OPK_UNARY || kind == OPK_BINARY || kind == OPK_COMPARE || kind == OPK_SELECT || kind == OPK_CONVERT;
    ok = elementwise && same_shape(&f->types[in->out], &f->types[u]) && at_store_index(g, in->out, memo);
    used = true;
  }
  memo[u] = ok && used ? 1 : 2;
  return memo[u] == 1;
}

/* whether a step reads slot s, or can fail */
static bool step_reads(const cpu_build *cb, const step *st, int s) {
  if (st->kind == STEP_HELPER) {
    for (int k = 0; k < st->n_slots; k++)
      if (st->slots[k] == s) return true;
    return false;
  }
  if (st->kind == STEP_COPY) return st->slots[1] == s;
  const kgroup *g = &cb->groups[st->index];
  for (int v = 0; v < g->f->n_values; v++)
    if (g->leaf[v] == s) return true;
  return false;
}

static bool step_can_fail(const cpu_build *cb, const step *st) {
  if (st->kind == STEP_HELPER) return true;
  if (st->kind == STEP_COPY) return false;
  const kgroup *g = &cb->groups[st->index]; /* integer division checks its divisors */
  for (int i = 0; i < g->f->n_instrs; i++) {
    const ir_instr *in = &g->f->instrs[i];
    if (g->member[i] && (in->op == OP_DIV || in->op == OP_MOD) && dtype_is_int(g->f->types[in->out].dtype)) return true;
  }
  return false;
}

/* For each result a kernel stores, a parameter of its type it may be
 * written over (cpu_program_donor): nothing after that kernel reads the
 * parameter or can fail (a failed call leaves the caller's tensors as they
 * were), the kernel reads it only at the element it writes (in place is
 * then the same computation), and no result returns the parameter. */
static int plan_donors(cpu_build *cb) {
  const ir_func *f = cb->f;
  cpu_program *p = cb->p;
  p->donor = malloc(((size_t)f->n_results + 1) * sizeof *p->donor);
  bool *taken = calloc((size_t)f->n_params + 1, sizeof *taken);
  int *pslot = malloc(((size_t)f->n_params + 1) * sizeof *pslot);
  if (!p->donor || !taken || !pslot) {
    free(taken);
    free(pslot);
    return oom();
  }
  for (int r = 0; r < f->n_results; r++) {
    p->donor[r] = -1;
    if (p->results[r].kind == CPU_RES_PARAM) taken[p->results[r].index] = true;
  }
  for (int s = 0; s < cb->n_slots; s++)
    if (cb->slots[s].kind == SLOT_PARAM) pslot[cb->slots[s].index] = s;
  int rc = 0, first_fail = cb->n_steps; /* steps from first_fail on may fail */
  while (first_fail > 0 && !step_can_fail(cb, &cb->steps[first_fail - 1])) first_fail--;
  for (int s = first_fail; s < cb->n_steps && !rc; s++) {
    const step *st = &cb->steps[s];
    if (st->kind != STEP_KERNEL) continue;
    const kgroup *g = &cb->groups[st->index];
    /* One output: its element's loads of the parameter all come before its
     * store, which depends on them, so the code stays right with noalias
     * kept on both (dropping it costs the vectorizer's overlap check, which
     * sends an exact overlap to the scalar loop: 2.3x slower, measured). */
    if (g->n_out != 1 || llvm_op_is_reduce(g->f->instrs[g->f->def[g->out[0]]].op)) continue;
    for (int k = 0; k < g->n_out; k++) {
      const slot *os = &cb->slots[g->out_slot[k]];
      if (os->kind != SLOT_RESULT || p->results[os->index].kind != CPU_RES_OWN) continue;
      for (int q = 0; q < f->n_params && p->donor[os->index] < 0; q++) {
        if (taken[q] || !same_type(&f->types[q], &p->result_types[os->index])) continue;
        bool ok = true;
        for (int later = s + 1; later < cb->n_steps && ok; later++) ok = !step_reads(cb, &cb->steps[later], pslot[q]);
        uint8_t *memo = calloc((size_t)g->f->n_values + 1, 1);
        if (!memo) {
          rc = oom();
          break;
        }
        for (int v = 0; v < g->f->n_values && ok; v++)
          if (g->leaf[v] == pslot[q])
            ok = same_type(&g->f->types[v], &f->types[q]) && at_store_index(g, v, memo);
        free(memo);
        if (ok) p->donor[os->index] = q, taken[q] = true;
      }
    }
  }
  free(taken);
  free(pslot);
  return rc;
}

static int plan(cpu_build *cb) {
  const ir_func *f = cb->f;
  cpu_program *p = cb->p;
  cb->vslot = malloc(((size_t)f->n_values + 1) * sizeof *cb->vslot);
  cb->result_of = malloc(((size_t)f->n_values + 1) * sizeof *cb->result_of);
  cb->result_done = calloc((size_t)f->n_results + 1, sizeof *cb->result_done);
  int *ps = malloc(((size_t)f->n_params + 1) * sizeof *ps);
  p->results = calloc((size_t)f->n_results + 1, sizeof *p->results);
  if (!cb->vslot || !cb->result_of || !cb->result_done || !ps || !p->results) {
    free(ps);
    return oom();
  }
  for (int v = 0; v < f->n_values; v++) cb->vslot[v] = -1, cb->result_of[v] = -1;
  for (int r = f->n_results - 1; r >= 0; r--) cb->result_of[f->results[r]] = r;
  /* with a plan, its arena comes first; values it did not place follow */
  if (f->buf_offset) p->arena_bytes = (size_t)((f->arena_bytes + KILN_ALIGN - 1) / KILN_ALIGN * KILN_ALIGN);
  int rc = 0;
  for (int i = 0; i < f->n_params && rc >= 0; i++) rc = ps[i] = add_slot(cb, (slot){SLOT_PARAM, i, 0, NULL});
  cb->max_bufs = 2;
  if (rc >= 0) rc = plan_func(cb, f, cb->vslot, ps, true, 0);
  free(ps);
  if (rc < 0) return -1;
  /* how each result is produced; one computed elsewhere (a view, a call's
   * result) is copied into its buffer at the end */
  for (int r = 0; r < f->n_results; r++) {
    ir_value v = f->results[r];
    const ir_instr *d = ir_def(f, v);
    cpu_result *res = &p->results[r];
    if (cb->result_of[v] != r) {
      *res = (cpu_result){CPU_RES_SAME, cb->result_of[v], NULL};
    } else if (!d) {
      *res = (cpu_result){CPU_RES_PARAM, v, NULL};
    } else if (d->op == OP_CONSTANT) {
      *res = (cpu_result){CPU_RES_CONST, 0, d->attrs.value};
    } else {
      *res = (cpu_result){CPU_RES_OWN, 0, NULL};
      const slot *s = &cb->slots[cb->vslot[v]];
      if (s->kind == SLOT_RESULT && s->index == r) continue;
      int dst = add_slot(cb, (slot){SLOT_RESULT, r, 0, NULL});
      int *sl = malloc(2 * sizeof *sl);
      if (dst < 0 || !sl) {
        free(sl);
        return dst < 0 ? -1 : oom();
      }
      sl[0] = dst;
      sl[1] = cb->vslot[v];
      if (add_step(cb, (step){STEP_COPY, 0, 2, sl, type_bytes(&f->types[v])})) return -1;
    }
  }
  return plan_donors(cb);
}

/* ---- emission ---- */

static void add_fn_attr(LLVMContextRef ctx, LLVMValueRef fn, const char *name) {
  unsigned kind = LLVMGetEnumAttributeKindForName(name, strlen(name));
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex, LLVMCreateEnumAttribute(ctx, kind, 0));
}

static void add_target_attrs(LLVMContextRef ctx, LLVMValueRef fn) {
  LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                          LLVMCreateStringAttribute(ctx, "target-cpu", 10, host_cpu, (unsigned)strlen(host_cpu)));
  LLVMAddAttributeAtIndex(
      fn, LLVMAttributeFunctionIndex,
      LLVMCreateStringAttribute(ctx, "target-features", 15, host_features, (unsigned)strlen(host_features)));
  /* LLVM picks 256-bit vectors on AVX-512 machines unless told: whole
   * registers run the vector math 30-40% faster (tanh(x*a+b)*c+x: 0.42 vs
   * 0.54 ns per element in cache, measured) */
  if (strstr(target_features, "+avx512f"))
    LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                            LLVMCreateStringAttribute(ctx, "prefer-vector-width", 19, "512", 3));
}

/* the alignment the code may assume of a constant's data (part of the key) */
static unsigned const_align(const kiln_tensor *t) {
  unsigned a = 1;
  while (a < KILN_ALIGN && (uintptr_t)t->data % (2 * a) == 0) a *= 2;
  return a;
}

/* The symbol kiln_const<i> of t's first listing (the program retains every
 * constant, so its data stays put while the code lives). */
static LLVMValueRef const_data(void *user, const kiln_tensor *t) {
  cpu_build *cb = user;
  llvm_emit *e = &cb->e;
  int i = 0;
  while (i < cb->consts->n && cb->consts->t[i] != t) i++;
  if (i == cb->consts->n) return NULL;
  char name[32];
  snprintf(name, sizeof name, "kiln_const%d", i);
  LLVMValueRef g = LLVMGetNamedGlobal(e->mod, name);
  if (!g) { /* a declaration: the JITDylib has its address, the code loads it from the GOT */
    g = LLVMAddGlobal(e->mod, LLVMArrayType2(e->t_i8, 0), name);
    LLVMSetAlignment(g, const_align(t));
  }
  return g;
}

/* What the entry needs to know about an emitted kernel. */
typedef struct {
  LLVMValueRef fn, task;
  LLVMTypeRef fn_type;
  int n_bufs;
  int *buf_slot; /* the outputs' slots, then each slot read, once */
  int64_t units, per_unit;
  bool can_fail;
  op_id fail_op;
} kinfo;

/* ORs g->bad into the kernel's flag and forgets it */
static void flush_bad(llvm_emit *e, llvm_group *g, LLVMValueRef bad_slot) {
  if (!g->bad) return;
  LLVMValueRef old = LLVMBuildLoad2(e->b, e->t_i1, bad_slot, "");
  LLVMBuildStore(e->b, LLVMBuildOr(e->b, old, g->bad, ""), bad_slot);
  g->bad = NULL;
}

/* kept input dims of a reduction from its output index */
static void reduce_dims(llvm_emit *e, const ir_instr *in, const op_type *it, llvm_index *oidx, LLVMValueRef *dims,
                        bool *reduced) {
  for (int d = 0; d < it->rank; d++) reduced[d] = false;
  for (int k = 0; k < in->attrs.naxes; k++) reduced[in->attrs.axes[k]] = true;
  llvm_index_get_dims(e, oidx);
  for (int d = 0, pos = 0; d < it->rank; d++) {
    if (reduced[d]) {
      dims[d] = NULL;
      if (in->attrs.keepdims) pos++;
    } else {
      dims[d] = oidx->dim[pos++];
    }
  }
}

/* the bytes a slot covers in the arena (type of the value g stores or reads there) */
static int64_t slot_bytes(const cpu_build *cb, const kgroup *g, int s) {
  int64_t bytes = 0;
  for (int k = 0; k < g->n_out; k++)
    if (g->out_slot[k] == s) bytes = type_bytes(&g->f->types[g->out[k]]);
  for (int v = 0; v < g->f->n_values; v++)
    if (g->leaf[v] == s && type_bytes(&g->f->types[v]) > bytes) bytes = type_bytes(&g->f->types[v]);
  (void)cb;
  return bytes;
}

static bool slots_overlap(const cpu_build *cb, const kgroup *g, int a, int b) {
  const slot *x = &cb->slots[a], *y = &cb->slots[b];
  if (a == b) return true;
  if (x->kind != SLOT_ARENA || y->kind != SLOT_ARENA) return false;
  return x->offset < y->offset + slot_bytes(cb, g, b) && y->offset < x->offset + slot_bytes(cb, g, a);
}

enum { COL_TILE = 256 }; /* outputs a column reduction accumulates at once */

/* A reduction whose innermost input dims are kept: for each tile of an
 * output row, the rows of the reduced dims accumulate into an array, the
 * innermost loop running along contiguous memory (it vectorizes). */
static int emit_reduce_columns(cpu_build *cb, const kgroup *g, llvm_group *lg, LLVMValueRef fn, LLVMValueRef begin,
                               LLVMValueRef end, LLVMValueRef bad_slot, kinfo *ki) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = g->f;
  const ir_instr *first = &f->instrs[f->def[g->out[0]]];
  ir_value x = first->in[0];
  const op_type *it = &f->types[x], *ot = &f->types[g->out[0]];
  bool reduced[KILN_MAX_RANK] = {false};
  for (int k = 0; k < first->attrs.naxes; k++) reduced[first->attrs.axes[k]] = true;
  int nt = 0; /* the trailing kept dims, `inner` elements */
  int64_t inner = 1;
  for (int d = it->rank - 1; d >= 0 && !reduced[d]; d--) nt++, inner *= it->shape[d];
  int64_t n_out = type_size(ot), n_in = type_size(it);
  int64_t tile = inner < COL_TILE ? inner : COL_TILE, ntile = (inner + tile - 1) / tile, rows = n_out / inner;
  ki->units = rows * ntile;
  ki->per_unit = tile * (n_in / n_out);
  if (g->n_out > 64) return kiln_set_error("cpu: @%s: a kernel with more than 64 reductions", cb->f->name);
  LLVMValueRef acc[64];
  LLVMTypeRef at[64];
  for (int k = 0; k < g->n_out; k++) {
    at[k] = llvm_reduce_type(e, f->instrs[f->def[g->out[k]]].op, it->dtype);
    acc[k] = LLVMBuildAlloca(b, LLVMArrayType2(at[k], (uint64_t)tile), "acc");
  }
  llvm_loop lu, lj, lr[KILN_MAX_RANK];
  LLVMValueRef u = llvm_loop_begin(e, &lu, begin, end, "tile");
  LLVMValueRef row = u, j0 = llvm_i64(e, 0), w = llvm_i64(e, inner);
  if (ntile > 1) {
    row = LLVMBuildUDiv(b, u, llvm_i64(e, ntile), "");
    j0 = LLVMBuildMul(b, LLVMBuildURem(b, u, llvm_i64(e, ntile), ""), llvm_i64(e, tile), "");
    LLVMValueRef left = LLVMBuildSub(b, llvm_i64(e, inner), j0, "");
    w = LLVMBuildSelect(b, LLVMBuildICmp(b, LLVMIntSLT, left, llvm_i64(e, tile), ""), left, llvm_i64(e, tile), "");
  }
  /* acc = identity */
  LLVMValueRef jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "init");
  for (int k = 0; k < g->n_out; k++) {
    op_id op = f->instrs[f->def[g->out[k]]].op;
    LLVMBuildStore(b, llvm_reduce_identity(e, op, it->dtype), LLVMBuildGEP2(b, at[k], acc[k], &jj, 1, ""));
  }
  llvm_loop_end(e, &lj);
  /* the kept outer dims from the output row; the reduced ones loop */
  op_type oo = *ot, io = *it;
  oo.rank -= nt;
  io.rank -= nt;
  llvm_index ridx;
  llvm_index_linear(&ridx, &oo, row);
  llvm_index_get_dims(e, &ridx);
  LLVMValueRef dims[KILN_MAX_RANK];
  int nloops = 0;
  for (int d = 0, pos = 0; d < io.rank; d++) {
    if (reduced[d]) {
      dims[d] = NULL;
      if (first->attrs.keepdims) pos++;
    } else {
      dims[d] = ridx.dim[pos++];
    }
  }
  for (int d = 0; d < io.rank; d++)
    if (reduced[d]) dims[d] = llvm_loop_begin(e, &lr[nloops++], llvm_i64(e, 0), llvm_i64(e, it->shape[d]), "red");
  llvm_index oidx;
  llvm_index_dims(&oidx, &io, dims);
  LLVMValueRef base = LLVMBuildMul(b, llvm_index_get_linear(e, &oidx), llvm_i64(e, inner), "");
  jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "col");
  LLVMValueRef col = LLVMBuildAdd(b, j0, jj, "");
  llvm_index xidx;
  if (llvm_group_is_flat(f, g->member, x)) {
    llvm_index_linear(&xidx, it, LLVMBuildAdd(b, base, col, ""));
  } else {
    op_type tt = *it;
    tt.rank = nt;
    for (int d = 0; d < nt; d++) tt.shape[d] = it->shape[it->rank - nt + d];
    llvm_index tidx;
    llvm_index_linear(&tidx, &tt, col);
    llvm_index_get_dims(e, &tidx);
    for (int d = 0; d < nt; d++) dims[io.rank + d] = tidx.dim[d];
    llvm_index_dims(&xidx, it, dims);
  }
  for (int k = 0; k < g->n_out; k++) {
    const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
    LLVMValueRef xv = llvm_emit_value(lg, rk->in[0], &xidx);
    if (!xv) return -1;
    LLVMValueRef a = LLVMBuildGEP2(b, at[k], acc[k], &jj, 1, "");
    LLVMBuildStore(b, llvm_reduce_combine(e, rk->op, it->dtype, LLVMBuildLoad2(b, at[k], a, ""), xv), a);
  }
  flush_bad(e, lg, bad_slot);
  llvm_group_forget(lg);
  llvm_loop_end(e, &lj);
  while (nloops > 0) llvm_loop_end(e, &lr[--nloops]);
  /* out = acc */
  LLVMValueRef obase = LLVMBuildAdd(b, LLVMBuildMul(b, row, llvm_i64(e, inner), ""), j0, "");
  jj = llvm_loop_begin(e, &lj, llvm_i64(e, 0), w, "store");
  for (int k = 0; k < g->n_out; k++) {
    const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
    LLVMValueRef a = LLVMBuildLoad2(b, at[k], LLVMBuildGEP2(b, at[k], acc[k], &jj, 1, ""), "");
    llvm_emit_store(e, ot->dtype, LLVMGetParam(fn, (unsigned)k), LLVMBuildAdd(b, obase, jj, ""),
                    llvm_reduce_finish(e, rk->op, it->dtype, a));
  }
  llvm_loop_end(e, &lj);
  llvm_loop_end(e, &lu);
  return 0;
}

enum { NT_TILE = 1024 }; /* elements a streaming kernel computes into L1 before storing them */

/* A kernel of cheap ops waits on memory: streaming stores then save a third
 * of its traffic (measured: x + x on 16M f32, 6.6 -> 10.1 GB/s). One with
 * vector math computes as long as it moves data; there computing tiles,
 * then storing them, overlaps the two worse than plain stores (tanh(x*a+b)*c+x:
 * 6.4 -> 5.0 GB/s), so it does not stream. */
static bool memory_bound(const kgroup *g) {
  for (int i = 0; i < g->f->n_instrs; i++) {
    if (!g->member[i]) continue;
    switch (g->f->instrs[i].op) {
      case OP_EXP:
      case OP_LOG:
      case OP_LOG1P:
      case OP_SIN:
      case OP_COS:
      case OP_TANH:
      case OP_SIGMOID:
      case OP_POW:
      case OP_MOD: return false;
      default: break;
    }
  }
  return true;
}

/* Whether the program runs a matmul big enough for the eager kernel to
 * thread it (lib/kernels_matmul.c splits from 2 x 2^18 multiply-adds): the
 * pool's workers are then awake anyway, and keeping its cheap kernels on
 * one thread only lets them fall asleep in between (the MLP batch-64 step:
 * 0.54 ms per step with those split, 0.65 without, measured) */
static bool threaded_matmuls(const cpu_build *cb) {
  for (int s = 0; s < cb->n_steps; s++) {
    const step *st = &cb->steps[s];
    if (st->kind != STEP_HELPER || cb->p->helpers[st->index].op != OP_DOT) continue;
    const cpu_helper *h = &cb->p->helpers[st->index];
    const op_type *a = &h->in_types[0], *c = &h->out_types[0];
    if (a->rank < 1) continue;
    if (type_size(c) * a->shape[a->rank - 1] >= (int64_t)1 << 19) return true;
  }
  return false;
}

/* memory_bound, and no dot summing more than a few products per element
 * (an SGD update's batch-1 outer product is cheap) */
static bool cheap_kernel(const kgroup *g) {
  const ir_func *f = g->f;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i];
    const op_type *a = in->n_in ? &f->types[in->in[0]] : NULL;
    if (g->member[i] && in->op == OP_DOT && (a->rank == 0 || a->shape[a->rank - 1] > 4)) return false;
  }
  return memory_bound(g);
}

/* A flat kernel's elements [lo, hi) (lo a multiple of FLAT_BLOCK) with
 * streaming stores: each tile of NT_TILE elements is computed into an
 * aligned stack buffer by the ordinary (vectorized) loop, then copied out in
 * 64-byte non-temporal stores, aligned because tiles start at multiples of
 * FLAT_BLOCK; a last partial tile is copied plainly. */
static int emit_streaming(cpu_build *cb, const kgroup *g, llvm_group *lg, LLVMValueRef fn, LLVMValueRef lo,
                          LLVMValueRef hi, LLVMValueRef bad_slot) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const ir_func *f = g->f;
  const op_type *ot = &f->types[g->out[0]];
  LLVMValueRef tile[8];
  LLVMTypeRef line = LLVMVectorType(e->t_i64, 8); /* 64 bytes */
  for (int k = 0; k < g->n_out; k++) {
    tile[k] = LLVMBuildAlloca(b, LLVMArrayType2(llvm_memory_type(e, f->types[g->out[k]].dtype), NT_TILE), "tile");
    LLVMSetAlignment(tile[k], KILN_ALIGN);
  }
  LLVMValueRef ntiles = LLVMBuildUDiv(b, LLVMBuildAdd(b, LLVMBuildSub(b, hi, lo, ""), llvm_i64(e, NT_TILE - 1), ""),
                                      llvm_i64(e, NT_TILE), "");
  llvm_loop lq, li, lc;
  LLVMValueRef q = llvm_loop_begin(e, &lq, llvm_i64(e, 0), ntiles, "tile");
  LLVMValueRef start = LLVMBuildAdd(b, lo, LLVMBuildMul(b, q, llvm_i64(e, NT_TILE), ""), "");
  LLVMValueRef left = LLVMBuildSub(b, hi, start, "");
  LLVMValueRef full = LLVMBuildICmp(b, LLVMIntSGE, left, llvm_i64(e, NT_TILE), "");
  LLVMValueRef m = LLVMBuildSelect(b, full, llvm_i64(e, NT_TILE), left, "");
  LLVMValueRef i = llvm_loop_begin(e, &li, llvm_i64(e, 0), m, "i");
  llvm_index idx;
  llvm_index_linear(&idx, ot, LLVMBuildAdd(b, start, i, ""));
  for (int k = 0; k < g->n_out; k++) {
    LLVMValueRef v = llvm_emit_value(lg, g->out[k], &idx);
    if (!v) return -1;
    llvm_emit_store(e, f->types[g->out[k]].dtype, tile[k], i, v);
  }
  flush_bad(e, lg, bad_slot);
  llvm_group_forget(lg);
  llvm_loop_end(e, &li);
  LLVMBasicBlockRef stream = LLVMAppendBasicBlockInContext(e->ctx, fn, "stream");
  LLVMBasicBlockRef plain = LLVMAppendBasicBlockInContext(e->ctx, fn, "plain");
  LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->ctx, fn, "next");
  LLVMBuildCondBr(b, full, stream, plain);
  LLVMPositionBuilderAtEnd(b, stream);
  LLVMMetadataRef one = LLVMValueAsMetadata(llvm_i32(e, 1));
  LLVMValueRef nt = LLVMMetadataAsValue(e->ctx, LLVMMDNodeInContext2(e->ctx, &one, 1));
  unsigned nt_kind = LLVMGetMDKindIDInContext(e->ctx, "nontemporal", 11);
  for (int k = 0; k < g->n_out; k++) {
    int64_t es = (int64_t)kiln_dtype_sizes[f->types[g->out[k]].dtype];
    LLVMValueRef dst = LLVMBuildGEP2(b, e->t_i8, LLVMGetParam(fn, (unsigned)k),
                                     (LLVMValueRef[]){LLVMBuildMul(b, start, llvm_i64(e, es), "")}, 1, "");
    LLVMValueRef c = llvm_loop_begin(e, &lc, llvm_i64(e, 0), llvm_i64(e, NT_TILE * es / 64), "line");
    LLVMValueRef ld = LLVMBuildLoad2(b, line, LLVMBuildGEP2(b, line, tile[k], &c, 1, ""), "");
    LLVMSetAlignment(ld, KILN_ALIGN);
    LLVMValueRef st = LLVMBuildStore(b, ld, LLVMBuildGEP2(b, line, dst, &c, 1, ""));
    LLVMSetAlignment(st, KILN_ALIGN);
    LLVMSetMetadata(st, nt_kind, nt);
    llvm_loop_end(e, &lc);
  }
  LLVMBuildBr(b, next);
  LLVMPositionBuilderAtEnd(b, plain);
  for (int k = 0; k < g->n_out; k++) {
    int64_t es = (int64_t)kiln_dtype_sizes[f->types[g->out[k]].dtype];
    LLVMValueRef off = LLVMBuildMul(b, start, llvm_i64(e, es), "");
    LLVMValueRef dst = LLVMBuildGEP2(b, e->t_i8, LLVMGetParam(fn, (unsigned)k), &off, 1, "");
    LLVMBuildMemCpy(b, dst, KILN_ALIGN, tile[k], KILN_ALIGN, LLVMBuildMul(b, m, llvm_i64(e, es), ""));
  }
  LLVMBuildBr(b, next);
  LLVMPositionBuilderAtEnd(b, next);
  llvm_loop_end(e, &lq);
  /* order the streaming stores before the task ends */
  LLVMTypeRef ft;
  LLVMValueRef fence = llvm_intrinsic(e, "llvm.x86.sse.sfence", NULL, 0, &ft);
  llvm_call(e, fence, ft, NULL, 0);
  return 0;
}

/* A kernel that is one transpose of the last two dims of 4-byte elements,
 * both at least 16: moved in 16x16 tiles through registers. */
static const ir_instr *tile_transpose(const kgroup *g) {
  const ir_func *f = g->f;
  const ir_instr *t = NULL;
  for (int i = 0; i < f->n_instrs; i++) {
    if (!g->member[i]) continue;
    if (t) return NULL;
    t = &f->instrs[i];
  }
  if (!t || t->op != OP_TRANSPOSE || g->n_out != 1 || g->out[0] != t->out || g->leaf[t->in[0]] < 0) return NULL;
  const op_type *it = &f->types[t->in[0]];
  int r = it->rank;
  if (r < 2 || kiln_dtype_sizes[it->dtype] != 4 || it->shape[r - 1] < 16 || it->shape[r - 2] < 16) return NULL;
  for (int k = 0; k < r - 2; k++)
    if (t->attrs.axes[k] != k) return NULL;
  return t->attrs.axes[r - 2] == r - 1 && t->attrs.axes[r - 1] == r - 2 ? t : NULL;
}

/* 4-byte element at + i (i in elements) */
static LLVMValueRef elem_ptr(llvm_emit *e, LLVMValueRef at, LLVMValueRef i) {
  return LLVMBuildGEP2(e->b, e->t_i32, at, &i, 1, "");
}

/* out[r][c] = in[c][r] for r in [r0, r1), c in [c0, c1), element by element */
static void copy_transposed(llvm_emit *e, LLVMValueRef src, LLVMValueRef dst, LLVMValueRef in0, LLVMValueRef out0,
                            int64_t R, int64_t C, LLVMValueRef r0, LLVMValueRef r1, LLVMValueRef c0,
                            LLVMValueRef c1) {
  LLVMBuilderRef b = e->b;
  llvm_loop lr, lc;
  LLVMValueRef r = llvm_loop_begin(e, &lr, r0, r1, "r");
  LLVMValueRef c = llvm_loop_begin(e, &lc, c0, c1, "c");
  LLVMValueRef from = LLVMBuildAdd(b, in0, LLVMBuildAdd(b, LLVMBuildMul(b, c, llvm_i64(e, R), ""), r, ""), "");
  LLVMValueRef to = LLVMBuildAdd(b, out0, LLVMBuildAdd(b, LLVMBuildMul(b, r, llvm_i64(e, C), ""), c, ""), "");
  LLVMValueRef v = LLVMBuildLoad2(b, e->t_i32, elem_ptr(e, src, from), "");
  LLVMSetAlignment(v, 4);
  LLVMSetAlignment(LLVMBuildStore(b, v, elem_ptr(e, dst, to)), 4);
  llvm_loop_end(e, &lc);
  llvm_loop_end(e, &lr);
}

/* The tile transpose: each task unit is 16 output rows of one matrix of the
 * batch; its full 16x16 tiles go through registers (16 row loads, four
 * butterfly stages of shuffles that swap the off-diagonal b x b blocks of
 * each 2b x 2b block, 16 row stores), the rest element by element. About 4x
 * the gathers of the generic kernel (the MLP step's 256x256 transpose). */
static void emit_transpose_tiles(cpu_build *cb, const kgroup *g, const ir_instr *t, LLVMValueRef src,
                                 LLVMValueRef dst, LLVMValueRef begin, LLVMValueRef end, kinfo *ki) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = e->b;
  const op_type *it = &g->f->types[t->in[0]];
  int64_t C = it->shape[it->rank - 2], R = it->shape[it->rank - 1], nrb = (R + 15) / 16;
  ki->units = type_size(it) / (C * R) * nrb;
  ki->per_unit = 16 * C;
  LLVMTypeRef vt = LLVMVectorType(e->t_i32, 16);
  llvm_loop lu, lb;
  LLVMValueRef u = llvm_loop_begin(e, &lu, begin, end, "unit");
  LLVMValueRef m = LLVMBuildUDiv(b, u, llvm_i64(e, nrb), "");
  LLVMValueRef r0 = LLVMBuildMul(b, LLVMBuildURem(b, u, llvm_i64(e, nrb), ""), llvm_i64(e, 16), "");
  LLVMValueRef base = LLVMBuildMul(b, m, llvm_i64(e, C * R), ""); /* both matrices start here */
  LLVMValueRef fn = LLVMGetBasicBlockParent(LLVMGetInsertBlock(b));
  LLVMBasicBlockRef tiles = LLVMAppendBasicBlockInContext(e->ctx, fn, "tiles");
  LLVMBasicBlockRef edge = LLVMAppendBasicBlockInContext(e->ctx, fn, "edge");
  LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->ctx, fn, "next");
  LLVMValueRef r16 = LLVMBuildAdd(b, r0, llvm_i64(e, 16), "");
  LLVMBuildCondBr(b, LLVMBuildICmp(b, LLVMIntSLE, r16, llvm_i64(e, R), ""), tiles, edge);

  LLVMPositionBuilderAtEnd(b, tiles);
  LLVMValueRef cblk = llvm_loop_begin(e, &lb, llvm_i64(e, 0), llvm_i64(e, C / 16), "cb");
  LLVMValueRef c0 = LLVMBuildMul(b, cblk, llvm_i64(e, 16), ""), row[16];
  for (int k = 0; k < 16; k++) {
    LLVMValueRef c = LLVMBuildAdd(b, c0, llvm_i64(e, k), "");
    LLVMValueRef at = LLVMBuildAdd(b, base, LLVMBuildAdd(b, LLVMBuildMul(b, c, llvm_i64(e, R), ""), r0, ""), "");
    row[k] = LLVMBuildLoad2(b, vt, elem_ptr(e, src, at), "");
    LLVMSetAlignment(row[k], 4);
  }
  for (int w = 8; w >= 1; w /= 2) {
    LLVMValueRef lo_mask[16], hi_mask[16];
    for (int j = 0; j < 16; j++) {
      lo_mask[j] = llvm_i32(e, (j & w) ? 16 + j - w : j);
      hi_mask[j] = llvm_i32(e, (j & w) ? 16 + j : j + w);
    }
    LLVMValueRef lo = LLVMConstVector(lo_mask, 16), hi = LLVMConstVector(hi_mask, 16);
    for (int i = 0; i < 16; i++) {
      if (i & w) continue;
      LLVMValueRef x = row[i], y = row[i + w];
      row[i] = LLVMBuildShuffleVector(b, x, y, lo, "");
      row[i + w] = LLVMBuildShuffleVector(b, x, y, hi, "");
    }
  }
  for (int k = 0; k < 16; k++) {
    LLVMValueRef r = LLVMBuildAdd(b, r0, llvm_i64(e, k), "");
    LLVMValueRef at = LLVMBuildAdd(b, base, LLVMBuildAdd(b, LLVMBuildMul(b, r, llvm_i64(e, C), ""), c0, ""), "");
    LLVMSetAlignment(LLVMBuildStore(b, row[k], elem_ptr(e, dst, at)), 4);
  }
  llvm_loop_end(e, &lb);
  if (C % 16)
    copy_transposed(e, src, dst, base, base, R, C, r0, r16, llvm_i64(e, C / 16 * 16), llvm_i64(e, C));
  LLVMBuildBr(b, next);

  LLVMPositionBuilderAtEnd(b, edge); /* the last rows, fewer than 16 */
  copy_transposed(e, src, dst, base, base, R, C, r0, llvm_i64(e, R), llvm_i64(e, 0), llvm_i64(e, C));
  LLVMBuildBr(b, next);
  LLVMPositionBuilderAtEnd(b, next);
  llvm_loop_end(e, &lu);
}

/* Whether g reads some input across its rows: a transpose that brings a
 * dim other than the input's innermost (of more than one element) to the
 * output's innermost, so consecutive output elements lie a row apart. */
static bool reads_across_rows(const kgroup *g) {
  const ir_func *f = g->f;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_instr *in = &f->instrs[i];
    if (!g->member[i] || in->op != OP_TRANSPOSE) continue;
    const op_type *it = &f->types[in->in[0]];
    int r = it->rank;
    if (r >= 2 && in->attrs.axes[r - 1] != r - 1 && it->shape[r - 1] > 1) return true;
  }
  return false;
}

/* Stores each of g's outputs at idx (linear index at). */
static int emit_outputs(const kgroup *g, llvm_group *lg, LLVMValueRef fn, llvm_index *idx, LLVMValueRef at) {
  for (int k = 0; k < g->n_out; k++) {
    LLVMValueRef v = llvm_emit_value(lg, g->out[k], idx);
    if (!v) return -1;
    llvm_emit_store(lg->e, g->f->types[g->out[k]].dtype, LLVMGetParam(fn, (unsigned)k), at, v);
  }
  return 0;
}

static int emit_kernel(cpu_build *cb, const kgroup *g, int id, kinfo *ki) {
  llvm_emit *e = &cb->e;
  const ir_func *f = g->f;
  memset(ki, 0, sizeof *ki);
  ki->buf_slot = malloc(((size_t)g->n_out + (size_t)f->n_values + 1) * sizeof *ki->buf_slot);
  LLVMTypeRef *params = malloc(((size_t)g->n_out + (size_t)f->n_values + 4) * sizeof *params);
  if (!ki->buf_slot || !params) {
    free(params);
    return oom();
  }
  for (int k = 0; k < g->n_out; k++) ki->buf_slot[ki->n_bufs++] = g->out_slot[k];
  for (int v = 0; v < f->n_values; v++) {
    if (g->leaf[v] < 0) continue;
    bool seen = false;
    for (int k = 0; k < ki->n_bufs && !seen; k++) seen = ki->buf_slot[k] == g->leaf[v];
    if (!seen) ki->buf_slot[ki->n_bufs++] = g->leaf[v];
  }
  int nb = ki->n_bufs;
  for (int k = 0; k < nb; k++) params[k] = e->t_ptr;
  params[nb] = e->t_ptr;     /* the error flag */
  params[nb + 1] = e->t_i64; /* begin */
  params[nb + 2] = e->t_i64; /* end */
  ki->fn_type = LLVMFunctionType(e->t_void, params, (unsigned)nb + 3, 0);
  free(params);
  char name[32];
  snprintf(name, sizeof name, "kernel%d", id);
  LLVMValueRef fn = ki->fn = LLVMAddFunction(e->mod, name, ki->fn_type);
  LLVMSetLinkage(fn, LLVMInternalLinkage);
  add_fn_attr(e->ctx, fn, "nounwind");
  add_target_attrs(e->ctx, fn);
  /* noalias: an output shares its buffer with nothing else (inputs are only
   * read), unless the buffers pass put it over an input that dies here */
  unsigned noalias = LLVMGetEnumAttributeKindForName("noalias", 7), align = LLVMGetEnumAttributeKindForName("align", 5);
  for (int k = 0; k < nb; k++) {
    bool alone = true;
    for (int q = 0; q < nb && alone; q++)
      if (q != k && (q < g->n_out || k < g->n_out)) alone = !slots_overlap(cb, g, ki->buf_slot[k], ki->buf_slot[q]);
    if (alone) LLVMAddAttributeAtIndex(fn, (unsigned)k + 1, LLVMCreateEnumAttribute(e->ctx, noalias, 0));
    /* tensors, the arena and its offsets are all 64-byte aligned */
    LLVMAddAttributeAtIndex(fn, (unsigned)k + 1, LLVMCreateEnumAttribute(e->ctx, align, KILN_ALIGN));
  }
  LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, fn, "entry"));
  LLVMValueRef begin = LLVMGetParam(fn, (unsigned)nb + 1), end = LLVMGetParam(fn, (unsigned)nb + 2);
  LLVMValueRef *buf = calloc((size_t)f->n_values + 1, sizeof *buf);
  if (!buf) return kiln_set_error("cpu: out of memory");
  for (int v = 0; v < f->n_values; v++) {
    if (g->leaf[v] < 0) continue;
    for (int k = 0; k < nb; k++)
      if (ki->buf_slot[k] == g->leaf[v]) buf[v] = LLVMGetParam(fn, (unsigned)k);
  }
  LLVMValueRef bad_slot = LLVMBuildAlloca(e->b, e->t_i1, "bad");
  LLVMBuildStore(e->b, LLVMConstInt(e->t_i1, 0, 0), bad_slot);
  llvm_group lg = {.e = e, .f = f, .buf = buf};
  llvm_group_init(&lg);
  int rc = 0;
  const ir_instr *first = &f->instrs[f->def[g->out[0]]];
  const op_type *ot = &f->types[g->out[0]];
  bool column = false; /* a reduction that keeps the innermost dim: rows accumulate into a tile */
  if (llvm_op_is_reduce(first->op)) {
    const op_type *it = &f->types[first->in[0]];
    bool kept_last = it->rank > 0 && first->attrs.naxes > 0;
    for (int k = 0; k < first->attrs.naxes; k++) kept_last = kept_last && first->attrs.axes[k] != it->rank - 1;
    column = kept_last && it->shape[it->rank - 1] >= 8 && type_size(ot) > 0 && type_size(it) > type_size(ot);
  }
  const ir_instr *tt = tile_transpose(g);
  if (tt) {
    emit_transpose_tiles(cb, g, tt, buf[tt->in[0]], LLVMGetParam(fn, 0), begin, end, ki);
  } else if (column) {
    rc = emit_reduce_columns(cb, g, &lg, fn, begin, end, bad_slot, ki);
  } else if (llvm_op_is_reduce(first->op)) {
    /* for each output element: loops over the reduced dims */
    ir_value x = first->in[0];
    const op_type *it = &f->types[x];
    int64_t n_out = type_size(ot), n_in = type_size(it);
    ki->units = n_out;
    ki->per_unit = n_out ? n_in / n_out : 0;
    LLVMValueRef acc_slot[64];
    LLVMTypeRef acc_type[64];
    if (g->n_out > 64) {
      free(buf);
      return kiln_set_error("cpu: @%s: a kernel with more than 64 reductions", cb->f->name);
    }
    for (int k = 0; k < g->n_out; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      acc_type[k] = llvm_reduce_type(e, rk->op, it->dtype);
      acc_slot[k] = LLVMBuildAlloca(e->b, acc_type[k], "acc");
    }
    llvm_loop lo;
    LLVMValueRef o = llvm_loop_begin(e, &lo, begin, end, "out");
    for (int k = 0; k < g->n_out; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      LLVMBuildStore(e->b, llvm_reduce_identity(e, rk->op, it->dtype), acc_slot[k]);
    }
    bool trailing = true, reduced[KILN_MAX_RANK];
    for (int k = 0; k < first->attrs.naxes; k++)
      trailing = trailing && first->attrs.axes[k] == it->rank - first->attrs.naxes + k;
    llvm_index oidx, xidx;
    llvm_index_linear(&oidx, ot, o);
    llvm_loop loops[KILN_MAX_RANK];
    int nloops = 0;
    if (trailing && llvm_group_is_flat(f, g->member, x)) { /* one loop over a contiguous run */
      int64_t span = ki->per_unit;
      LLVMValueRef base = LLVMBuildMul(e->b, o, llvm_i64(e, span), "");
      LLVMValueRef r = llvm_loop_begin(e, &loops[nloops++], llvm_i64(e, 0), llvm_i64(e, span), "red");
      llvm_index_linear(&xidx, it, LLVMBuildAdd(e->b, base, r, ""));
    } else {
      LLVMValueRef dims[KILN_MAX_RANK];
      reduce_dims(e, first, it, &oidx, dims, reduced);
      for (int d = 0; d < it->rank; d++)
        if (reduced[d])
          dims[d] = llvm_loop_begin(e, &loops[nloops++], llvm_i64(e, 0), llvm_i64(e, it->shape[d]), "red");
      llvm_index_dims(&xidx, it, dims);
    }
    for (int k = 0; k < g->n_out && !rc; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      LLVMValueRef xv = llvm_emit_value(&lg, rk->in[0], &xidx);
      if (!xv) {
        rc = -1;
        break;
      }
      LLVMValueRef acc = LLVMBuildLoad2(e->b, acc_type[k], acc_slot[k], "");
      LLVMBuildStore(e->b, llvm_reduce_combine(e, rk->op, it->dtype, acc, xv), acc_slot[k]);
    }
    flush_bad(e, &lg, bad_slot);
    llvm_group_forget(&lg);
    while (nloops > 0) llvm_loop_end(e, &loops[--nloops]);
    for (int k = 0; k < g->n_out && !rc; k++) {
      const ir_instr *rk = &f->instrs[f->def[g->out[k]]];
      LLVMValueRef acc = LLVMBuildLoad2(e->b, acc_type[k], acc_slot[k], "");
      llvm_emit_store(e, ot->dtype, LLVMGetParam(fn, (unsigned)k), o, llvm_reduce_finish(e, rk->op, it->dtype, acc));
    }
    llvm_loop_end(e, &lo);
  } else {
    int64_t n = type_size(ot);
    bool flat = true;
    for (int k = 0; k < g->n_out; k++) flat = flat && llvm_group_is_flat(f, g->member, g->out[k]);
    llvm_index idx;
    llvm_loop lo, li, lt;
    LLVMValueRef at = NULL;
    int64_t inner = ot->rank ? ot->shape[ot->rank - 1] : 1;
    bool rows = !flat && ot->rank > 0 && n > 0;
    /* rows of a few elements (a dot's [batch, 2] output, say): vectors across
     * rows beat one short vector per row */
    bool narrow = rows && inner <= NARROW_ROW && n / inner >= 16;
    /* a transposed read walks its input across rows: tiles of TILE_ROWS rows
     * by TILE_COLS columns keep the input lines they read in L1 meanwhile
     * (row by row, a 256x256 f32 transpose read 16x the matrix from L2) */
    bool tiled = rows && !narrow && reads_across_rows(g) && n / inner >= 2 * TILE_ROWS && inner >= 2 * TILE_ROWS;
    int64_t nblk = 1, blk = inner, per_task_rows = tiled ? TILE_ROWS : 1;
    if (!rows) { /* one loop over linear indices, tasks taking whole blocks of FLAT_BLOCK */
      ki->units = (n + FLAT_BLOCK - 1) / FLAT_BLOCK;
      ki->per_unit = FLAT_BLOCK;
      LLVMValueRef lo_i = LLVMBuildMul(e->b, begin, llvm_i64(e, FLAT_BLOCK), "");
      LLVMValueRef hi_i = LLVMBuildMul(e->b, end, llvm_i64(e, FLAT_BLOCK), "");
      hi_i = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, hi_i, llvm_i64(e, n), ""), hi_i, llvm_i64(e, n), "");
      /* an output far bigger than the caches goes around them: nothing reads it
       * from there, and the store then costs no read for ownership */
      if (cb->x86 && type_bytes(ot) >= PF_MIN_BYTES) { /* found by its attribute after the passes */
        LLVMAddAttributeAtIndex(fn, LLVMAttributeFunctionIndex,
                                LLVMCreateStringAttribute(e->ctx, PF_ATTR, (unsigned)strlen(PF_ATTR), "", 0));
        add_fn_attr(e->ctx, fn, "noinline");
      }
      if (cb->x86 && type_bytes(ot) >= NT_MIN_BYTES && g->n_out <= 8 && memory_bound(g)) {
        rc = emit_streaming(cb, g, &lg, fn, lo_i, hi_i, bad_slot);
        goto flat_done;
      }
      at = llvm_loop_begin(e, &lo, lo_i, hi_i, "i");
      llvm_index_linear(&idx, ot, at);
    } else { /* rows of the innermost dim, a multi-index per row */
      if (inner > ROW_BLOCK) nblk = (inner + ROW_BLOCK - 1) / ROW_BLOCK, blk = ROW_BLOCK;
      if (tiled) nblk = (inner + TILE_COLS - 1) / TILE_COLS, blk = TILE_COLS;
      int64_t nrows = n / inner, groups = (nrows + per_task_rows - 1) / per_task_rows;
      ki->units = groups * nblk;
      ki->per_unit = blk * per_task_rows;
      LLVMValueRef u = llvm_loop_begin(e, &lo, begin, end, "row");
      LLVMValueRef row = u, j0 = llvm_i64(e, 0), j1 = llvm_i64(e, inner);
      if (nblk > 1) {
        row = LLVMBuildUDiv(e->b, u, llvm_i64(e, nblk), "");
        j0 = LLVMBuildMul(e->b, LLVMBuildURem(e->b, u, llvm_i64(e, nblk), ""), llvm_i64(e, blk), "");
        LLVMValueRef j1c = LLVMBuildAdd(e->b, j0, llvm_i64(e, blk), "");
        j1 = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, j1c, j1, ""), j1c, j1, "");
      }
      if (tiled) { /* the rows of this tile */
        LLVMValueRef r0 = LLVMBuildMul(e->b, row, llvm_i64(e, TILE_ROWS), "");
        LLVMValueRef r1 = LLVMBuildAdd(e->b, r0, llvm_i64(e, TILE_ROWS), "");
        LLVMValueRef last = llvm_i64(e, nrows);
        r1 = LLVMBuildSelect(e->b, LLVMBuildICmp(e->b, LLVMIntSLT, r1, last, ""), r1, last, "");
        row = llvm_loop_begin(e, &lt, r0, r1, "tile");
      }
      op_type outer = *ot;
      outer.rank--;
      llvm_index ridx;
      llvm_index_linear(&ridx, &outer, row);
      llvm_index_get_dims(e, &ridx);
      LLVMValueRef rowbase = LLVMBuildMul(e->b, row, llvm_i64(e, inner), "");
      LLVMValueRef dims[KILN_MAX_RANK];
      for (int d = 0; d < outer.rank; d++) dims[d] = ridx.dim[d];
      if (narrow) { /* every column of the row, unrolled: the row loop vectorizes */
        for (int64_t jc = 0; jc < inner && !rc; jc++) {
          dims[ot->rank - 1] = llvm_i64(e, jc);
          llvm_index_dims(&idx, ot, dims);
          at = idx.linear = LLVMBuildAdd(e->b, rowbase, llvm_i64(e, jc), "");
          rc = emit_outputs(g, &lg, fn, &idx, at);
          llvm_group_forget(&lg);
        }
      } else {
        LLVMValueRef j = llvm_loop_begin(e, &li, j0, j1, "j");
        dims[ot->rank - 1] = j;
        llvm_index_dims(&idx, ot, dims);
        at = idx.linear = LLVMBuildAdd(e->b, rowbase, j, "");
      }
    }
    if (!narrow && !rc) rc = emit_outputs(g, &lg, fn, &idx, at);
    flush_bad(e, &lg, bad_slot);
    llvm_group_forget(&lg);
    if (rows && !narrow) llvm_loop_end(e, &li);
    if (tiled) llvm_loop_end(e, &lt);
    llvm_loop_end(e, &lo);
  flat_done:;
  }
  ki->can_fail = lg.bad_op != OP_COUNT;
  ki->fail_op = lg.bad_op;
  llvm_group_dispose(&lg);
  free(buf);
  if (rc) return -1;
  /* raise the flag once, after the loops */
  if (ki->can_fail) {
    LLVMBasicBlockRef set = LLVMAppendBasicBlockInContext(e->ctx, fn, "fail");
    LLVMBasicBlockRef done = LLVMAppendBasicBlockInContext(e->ctx, fn, "done");
    LLVMBuildCondBr(e->b, LLVMBuildLoad2(e->b, e->t_i1, bad_slot, ""), set, done);
    LLVMPositionBuilderAtEnd(e->b, set);
    LLVMValueRef st = LLVMBuildStore(e->b, llvm_i32(e, 1), LLVMGetParam(fn, (unsigned)nb));
    LLVMSetOrdering(st, LLVMAtomicOrderingMonotonic); /* several tasks may fail at once */
    LLVMSetAlignment(st, 4);
    LLVMBuildBr(e->b, done);
    LLVMPositionBuilderAtEnd(e->b, done);
  }
  LLVMBuildRetVoid(e->b);

  /* the thread pool's task: (ctx = buffers and flag, begin, end) */
  snprintf(name, sizeof name, "kernel%d.task", id);
  ki->task = LLVMAddFunction(e->mod, name, cb->ty_task);
  LLVMSetLinkage(ki->task, LLVMInternalLinkage);
  add_fn_attr(e->ctx, ki->task, "nounwind");
  add_target_attrs(e->ctx, ki->task);
  LLVMPositionBuilderAtEnd(e->b, LLVMAppendBasicBlockInContext(e->ctx, ki->task, "entry"));
  LLVMValueRef *args = malloc(((size_t)nb + 3) * sizeof *args);
  if (!args) return oom();
  LLVMValueRef ctx = LLVMGetParam(ki->task, 0);
  for (int k = 0; k <= nb; k++) {
    LLVMValueRef ix = llvm_i64(e, k);
    args[k] = LLVMBuildLoad2(e->b, e->t_ptr, LLVMBuildGEP2(e->b, e->t_ptr, ctx, &ix, 1, ""), "");
  }
  args[nb + 1] = LLVMGetParam(ki->task, 1);
  args[nb + 2] = LLVMGetParam(ki->task, 2);
  LLVMBuildCall2(e->b, ki->fn_type, ki->fn, args, (unsigned)nb + 3, "");
  LLVMBuildRetVoid(e->b);
  free(args);
  return 0;
}

/* the entry function's pointer to each slot, computed up front */
static void emit_slot_ptrs(cpu_build *cb, LLVMValueRef params, LLVMValueRef results, LLVMValueRef arena) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  for (int s = 0; s < cb->n_slots; s++) {
    const slot *sl = &cb->slots[s];
    LLVMValueRef ix;
    switch (sl->kind) {
      case SLOT_PARAM:
      case SLOT_RESULT:
        ix = llvm_i64(e, sl->index);
        cb->slot_ptr[s] = LLVMBuildLoad2(
            b, e->t_ptr, LLVMBuildGEP2(b, e->t_ptr, sl->kind == SLOT_PARAM ? params : results, &ix, 1, ""), "");
        break;
      case SLOT_ARENA:
        ix = llvm_i64(e, sl->offset);
        cb->slot_ptr[s] = LLVMBuildGEP2(b, e->t_i8, arena, &ix, 1, "");
        break;
      default: cb->slot_ptr[s] = const_data(cb, sl->cst); break;
    }
  }
}

/* if (cond) return -1 after calling fail (when given) */
static void emit_bail(cpu_build *cb, LLVMValueRef cond, int32_t kernel) {
  llvm_emit *e = &cb->e;
  LLVMBuilderRef b = cb->eb;
  LLVMBasicBlockRef bad = LLVMAppendBasicBlockInContext(e->ctx, cb->entry, "bail");
  LLVMBasicBlockRef next = LLVMAppendBasicBlockInContext(e->ctx, cb->entry, "next");
  LLVMBuildCondBr(b, cond, bad, next);
  LLVMPositionBuilderAtEnd(b, bad);
  if (kernel >= 0) {
    LLVMValueRef args[2] = {cb->call_arg, llvm_i32(e, kernel)};
    LLVMBuildCall2(b, cb->ty_fail, cb->fn_fail, args, 2, "");
  }
  LLVMBuildRet(b, llvm_i32(e, -1));
  LLVMPositionBuilderAtEnd(b, next);
}

static int emit_program(cpu_build *cb, const char *entry_name) {
  llvm_emit *e = &cb->e;
  cpu_program *p = cb->p;
  LLVMTypeRef pp[4] = {e->t_i64, e->t_i64, e->t_ptr, e->t_ptr}; /* parallel_for(n, grain, fn, ctx) */
  cb->ty_par = LLVMFunctionType(e->t_void, pp, 4, 0);
  cb->fn_par = LLVMAddFunction(e->mod, "kiln_rt_parallel_for", cb->ty_par);
  LLVMTypeRef hp[3] = {e->t_ptr, e->t_i32, e->t_ptr};
  cb->ty_helper = LLVMFunctionType(e->t_i32, hp, 3, 0);
  cb->fn_helper = LLVMAddFunction(e->mod, "kiln_rt_helper", cb->ty_helper);
  cb->ty_fail = LLVMFunctionType(e->t_void, hp, 2, 0);
  cb->fn_fail = LLVMAddFunction(e->mod, "kiln_rt_kernel_fail", cb->ty_fail);
  LLVMTypeRef tp[3] = {e->t_ptr, e->t_i64, e->t_i64};
  cb->ty_task = LLVMFunctionType(e->t_void, tp, 3, 0);

  LLVMTypeRef ep[4] = {e->t_ptr, e->t_ptr, e->t_ptr, e->t_ptr};
  LLVMTypeRef ety = LLVMFunctionType(e->t_i32, ep, 4, 0);
  cb->entry = LLVMAddFunction(e->mod, entry_name, ety);
  add_fn_attr(e->ctx, cb->entry, "nounwind");
  add_target_attrs(e->ctx, cb->entry);
  cb->eb = LLVMCreateBuilderInContext(e->ctx);
  LLVMPositionBuilderAtEnd(cb->eb, LLVMAppendBasicBlockInContext(e->ctx, cb->entry, "entry"));
  cb->call_arg = LLVMGetParam(cb->entry, 3);
  cb->slot_ptr = calloc((size_t)cb->n_slots + 1, sizeof *cb->slot_ptr);
  p->kernel_fail_op = calloc((size_t)cb->n_groups + 1, sizeof *p->kernel_fail_op);
  if (!cb->slot_ptr || !p->kernel_fail_op) return kiln_set_error("cpu: out of memory");
  LLVMTypeRef arr = LLVMArrayType2(e->t_ptr, (uint64_t)cb->max_bufs + 1);
  cb->ctx_array = LLVMBuildAlloca(cb->eb, arr, "bufs");
  emit_slot_ptrs(cb, LLVMGetParam(cb->entry, 0), LLVMGetParam(cb->entry, 1), LLVMGetParam(cb->entry, 2));
  LLVMBuilderRef b = cb->eb;
  bool pool_busy = threaded_matmuls(cb);
  for (int s = 0; s < cb->n_steps; s++) {
    const step *st = &cb->steps[s];
    if (st->kind == STEP_KERNEL) {
      kinfo ki;
      int id = st->index, rc = emit_kernel(cb, &cb->groups[id], id, &ki);
      if (rc) {
        free(ki.buf_slot);
        return -1;
      }
      p->kernel_fail_op[id] = ki.can_fail ? ki.fail_op : OP_COUNT;
      p->n_kernels++;
      if (ki.units == 0) {
        free(ki.buf_slot);
        continue;
      }
      LLVMValueRef *args = malloc(((size_t)ki.n_bufs + 3) * sizeof *args);
      if (!args) {
        free(ki.buf_slot);
        return oom();
      }
      for (int k = 0; k < ki.n_bufs; k++) args[k] = cb->slot_ptr[ki.buf_slot[k]];
      args[ki.n_bufs] = cb->call_arg;
      int64_t work = ki.units * (ki.per_unit > 0 ? ki.per_unit : 1);
      if (work > cb->max_work) cb->max_work = work;
      bool cheap = !pool_busy && cheap_kernel(&cb->groups[id]);
      if (work >= (cheap ? PAR_MIN_CHEAP : PAR_MIN) && ki.units >= 2) { /* over the pool */
        for (int k = 0; k <= ki.n_bufs; k++) {
          LLVMValueRef ix = llvm_i64(e, k);
          LLVMBuildStore(b, args[k], LLVMBuildGEP2(b, e->t_ptr, cb->ctx_array, &ix, 1, ""));
        }
        int64_t grain = PAR_GRAIN / (ki.per_unit > 0 ? ki.per_unit : 1);
        LLVMValueRef pa[4] = {llvm_i64(e, ki.units), llvm_i64(e, grain > 0 ? grain : 1), ki.task, cb->ctx_array};
        LLVMBuildCall2(b, cb->ty_par, cb->fn_par, pa, 4, "");
      } else {
        args[ki.n_bufs + 1] = llvm_i64(e, 0);
        args[ki.n_bufs + 2] = llvm_i64(e, ki.units);
        LLVMBuildCall2(b, ki.fn_type, ki.fn, args, (unsigned)ki.n_bufs + 3, "");
      }
      free(args);
      free(ki.buf_slot);
      if (ki.can_fail) {
        LLVMValueRef flag = LLVMBuildLoad2(b, e->t_i32, cb->call_arg, "");
        LLVMSetOrdering(flag, LLVMAtomicOrderingMonotonic);
        LLVMSetAlignment(flag, 4);
        emit_bail(cb, LLVMBuildICmp(b, LLVMIntNE, flag, llvm_i32(e, 0), ""), id);
      }
    } else if (st->kind == STEP_HELPER) {
      /* bufs = {outs..., ins...}; kiln_rt_helper(call, h, bufs) */
      for (int k = 0; k < st->n_slots; k++) {
        LLVMValueRef ix = llvm_i64(e, k);
        LLVMBuildStore(b, cb->slot_ptr[st->slots[k]], LLVMBuildGEP2(b, e->t_ptr, cb->ctx_array, &ix, 1, ""));
      }
      LLVMValueRef ha[3] = {cb->call_arg, llvm_i32(e, st->index), cb->ctx_array};
      LLVMValueRef rc = LLVMBuildCall2(b, cb->ty_helper, cb->fn_helper, ha, 3, "");
      emit_bail(cb, LLVMBuildICmp(b, LLVMIntNE, rc, llvm_i32(e, 0), ""), -1);
    } else if (st->bytes > 0) { /* a result computed elsewhere, into its buffer */
      LLVMBuildMemCpy(b, cb->slot_ptr[st->slots[0]], 1, cb->slot_ptr[st->slots[1]], 1, llvm_i64(e, st->bytes));
    }
  }
  LLVMBuildRet(b, llvm_i32(e, 0));
  return 0;
}

/* ---- compiling ---- */

static void build_free(cpu_build *cb) {
  for (int g = 0; g < cb->n_groups; g++) {
    free(cb->groups[g].member);
    free(cb->groups[g].leaf);
    free(cb->groups[g].out);
    free(cb->groups[g].out_slot);
  }
  for (int s = 0; s < cb->n_steps; s++) free(cb->steps[s].slots);
  free(cb->result_done);
  free(cb->groups);
  free(cb->steps);
  free(cb->slots);
  free(cb->vslot);
  free(cb->result_of);
  free(cb->slot_ptr);
  if (cb->eb) LLVMDisposeBuilder(cb->eb);
  llvm_emit_dispose(&cb->e);
  memset(cb, 0, sizeof *cb); /* a second call does nothing */
}

static int llvm_fail(const char *f, const char *what, LLVMErrorRef err) {
  char msg[512];
  error_text(err, msg, sizeof msg);
  return kiln_set_error("cpu: @%s: %s: %s", f, what, msg);
}

/* ---- LLVM's passes and code generation, in one part or two ---- */

/* One module's share: O3 for the host CPU, the optimized module kept as
 * bitcode (the text stages rebuild it on demand), then machine code, an
 * object file that the JIT only links. It runs on any thread, with a target
 * machine of its own (so programs, and the parts of one, compile in
 * parallel); a failure is described in err, not in the thread's error. */
typedef struct {
  LLVMModuleRef mod;
  const char *pipeline;
  bool unroll;
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
  LLVMTargetMachineRef tm = host_machine();
  if (!tm) {
    snprintf(pt->err, sizeof pt->err, "%s", jit_error);
    return NULL;
  }
  LLVMPassBuilderOptionsRef opts = LLVMCreatePassBuilderOptions();
  LLVMPassBuilderOptionsSetLoopVectorization(opts, 1);
  LLVMPassBuilderOptionsSetSLPVectorization(opts, 1);
  LLVMPassBuilderOptionsSetLoopInterleaving(opts, pt->unroll);
  LLVMPassBuilderOptionsSetLoopUnrolling(opts, pt->unroll);
  double t0 = now_ms();
  LLVMErrorRef err = LLVMRunPasses(pt->mod, pt->pipeline, tm, opts);
  LLVMDisposePassBuilderOptions(opts);
  if (!err) prefetches(pt->mod);
  pt->opt_ms = now_ms() - t0;
  char *msg = NULL;
  if (err) {
    char text[400];
    error_text(err, text, sizeof text);
    snprintf(pt->err, sizeof pt->err, "optimisation failed: %s", text);
  } else if (!(pt->bc = LLVMWriteBitcodeToMemoryBuffer(pt->mod))) {
    snprintf(pt->err, sizeof pt->err, "cannot write bitcode");
  } else {
    double t1 = now_ms();
    if (LLVMTargetMachineEmitToMemoryBuffer(tm, pt->mod, LLVMObjectFile, &msg, &pt->obj)) {
      snprintf(pt->err, sizeof pt->err, "code generation failed: %s", msg ? msg : "");
      pt->obj = NULL;
    }
    pt->codegen_ms = now_ms() - t1;
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
static int optimize(cpu_program *p, LLVMContextRef ctx, LLVMModuleRef mod, int n_groups, int64_t max_work,
                    int parts_wanted, LLVMMemoryBufferRef obj[2], int *n_obj) {
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
  part parts[2] = {{.mod = mod, .pipeline = pipeline, .unroll = unroll},
                   {.pipeline = pipeline, .unroll = unroll}};
  LLVMContextRef ctx2 = NULL;
  int n = 1;
  bool auto_split = !parts_wanted && kiln_num_threads() >= 2 && max_work >= SPLIT_MIN_WORK;
  uint8_t *side = auto_split || parts_wanted == 2 ? calloc((size_t)n_groups + 1, 1) : NULL;
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
  if (w.err) return llvm_fail(f, "linking failed", w.err), 0;
  if (!w.addr) return kiln_set_error("cpu: @%s: linking failed: no %s", f, name), 0;
  return w.addr;
}

/* Links object code (the n objects, taken) into a JITDylib of p's own, with
 * the runtime's functions and p's constants as its symbols. */
static int load_code(cpu_program *p, const const_list *consts, LLVMOrcLLJITRef jit, LLVMMemoryBufferRef *obj,
                     int n_obj) {
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
  int n = NRT + consts->n;
  LLVMOrcCSymbolMapPair *pairs = malloc((size_t)n * sizeof *pairs);
  if (!pairs) {
    for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(obj[i]);
    return oom();
  }
  for (int i = 0; i < n; i++) {
    char name[32];
    if (i >= NRT) snprintf(name, sizeof name, "kiln_const%d", i - NRT);
    pairs[i].Name = LLVMOrcLLJITMangleAndIntern(jit, i < NRT ? rt[i].name : name);
    pairs[i].Sym.Address = i < NRT ? rt[i].addr : (uintptr_t)consts->t[i - NRT]->data;
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
    return llvm_fail(p->name, "cannot define the program's symbols", err);
  }
  for (int i = 0; i < n_obj; i++) {
    err = LLVMOrcLLJITAddObjectFile(jit, jd, obj[i]); /* takes the buffer */
    if (err) {
      while (++i < n_obj) LLVMDisposeMemoryBuffer(obj[i]);
      return llvm_fail(p->name, "the JIT refused the object code", err);
    }
  }
  LLVMOrcExecutorAddress addr = lib_lookup(jit, jd, "kiln_entry", p->name);
  if (!addr) return -1;
  p->entry = (int (*)(void **, void **, void *, cpu_call *))(uintptr_t)addr;
  return 0;
}

/* ---- the JIT for gemm.c's micro-kernels ---- */

bool cpu_jit_target_has(const char *feature) {
  if (!jit_get()) return false;
  size_t n = strlen(feature);
  for (const char *p = target_features; (p = strstr(p, feature)); p += n)
    if (p > target_features && p[-1] == '+' && (p[n] == ',' || p[n] == 0)) return true;
  return false;
}

void *cpu_jit_host_machine(void) {
  if (!jit_get()) return NULL;
  LLVMTargetMachineRef tm = host_machine();
  if (!tm) kiln_set_error("cpu: %s", jit_error);
  return tm;
}

uintptr_t cpu_jit_link(const void *obj, size_t len, const char *name) {
  LLVMOrcLLJITRef jit = jit_get();
  LLVMOrcJITDylibRef jd = jit ? lib_get(jit) : NULL;
  if (!jd) return 0;
  LLVMMemoryBufferRef buf = LLVMCreateMemoryBufferWithMemoryRangeCopy(obj, len, name);
  LLVMErrorRef err = LLVMOrcLLJITAddObjectFile(jit, jd, buf); /* takes the buffer */
  if (err) return llvm_fail(name, "the JIT refused the object code", err), 0;
  return (uintptr_t)lib_lookup(jit, jd, name, name);
}

/* ---- the disk cache ---- */

/* What the key holds besides the IR: everything else the code depends on.
 * malloc'd; NULL out of memory. */
static char *cache_meta(const cpu_build *cb, const cpu_options *opt, LLVMOrcLLJITRef jit) {
  unsigned maj, min, pat;
  LLVMGetVersion(&maj, &min, &pat);
  const ir_func *f = cb->f;
  size_t n = 1024 + strlen(host_cpu) + strlen(host_features) + 4 * (size_t)cb->consts->n;
  n += strlen(LLVMOrcLLJITGetTripleString(jit)) + strlen(LLVMOrcLLJITGetDataLayoutStr(jit));
  char *m = malloc(n);
  if (!m) return NULL;
  int k = snprintf(m, n,
                   "kiln cpu program 1\nllvm %u.%u.%u\ntriple %s\nlayout %s\ncpu %s\nfeatures %s\n%s\n"
                   "contract %d\nparts %d\narena %lld\nconsts",
                   maj, min, pat, LLVMOrcLLJITGetTripleString(jit), LLVMOrcLLJITGetDataLayoutStr(jit), host_cpu,
                   host_features, cpu_cache_build_id(), !opt->no_contract, opt->parts,
                   (long long)(f->buf_offset ? f->arena_bytes : -1));
  for (int i = 0; i < cb->consts->n && k > 0 && (size_t)k < n; i++)
    k += snprintf(m + k, n - (size_t)k, " %u", const_align(cb->consts->t[i]));
  if (k <= 0 || (size_t)k >= n) {
    free(m);
    return NULL;
  }
  return m;
}

/* The program's kernel info in an entry: kernels, groups, each group's
 * failing op (int32 each). */
static int32_t *kernel_info(const cpu_build *cb, size_t *len) {
  int ng = cb->n_groups;
  int32_t *v = malloc(((size_t)ng + 2) * sizeof *v);
  if (!v) return NULL;
  v[0] = cb->p->n_kernels;
  v[1] = ng;
  for (int g = 0; g < ng; g++) v[2 + g] = (int32_t)cb->p->kernel_fail_op[g];
  *len = ((size_t)ng + 2) * sizeof *v;
  return v;
}

static int take_kernel_info(cpu_program *p, const cpu_build *cb, const void *info, size_t len) {
  int32_t head[2];
  if (len < sizeof head) return -1;
  memcpy(head, info, sizeof head);
  if (head[1] != cb->n_groups || head[0] < 0 || head[0] > cb->n_groups ||
      len != ((size_t)cb->n_groups + 2) * sizeof(int32_t))
    return -1;
  p->kernel_fail_op = calloc((size_t)cb->n_groups + 1, sizeof *p->kernel_fail_op);
  if (!p->kernel_fail_op) return -1;
  for (int g = 0; g < cb->n_groups; g++) {
    int32_t op;
    memcpy(&op, (const char *)info + (2 + (size_t)g) * sizeof op, sizeof op);
    if (op < 0 || op > OP_COUNT) return -1;
    p->kernel_fail_op[g] = (op_id)op;
  }
  p->n_kernels = head[0];
  return 0;
}

/* what compiling made, dropped before compiling again */
static void forget_code(cpu_program *p) {
  cpu_jit_forget(p->jit_lib);
  p->jit_lib = NULL;
  p->entry = NULL;
  free(p->kernel_fail_op);
  p->kernel_fail_op = NULL;
  p->n_kernels = 0;
  free(p->bitcode);
  p->bitcode = NULL;
  p->bitcode_len = 0;
}

/* A cache hit: the entry's code linked, its info and bitcode taken. 0, or
 * -1 when the entry does not fit (nothing kept; no error). */
static int load_cached(cpu_program *p, const cpu_build *cb, LLVMOrcLLJITRef jit, const cpu_cache_entry *e) {
  int rc = take_kernel_info(p, cb, e->info, e->info_len);
  if (!rc && !(p->bitcode = malloc(e->bc_len + 1))) rc = -1;
  if (!rc) {
    memcpy(p->bitcode, e->bc, e->bc_len);
    p->bitcode_len = e->bc_len;
    const void *part[2];
    size_t len[2];
    int n = cpu_parts_unpack(e->obj, e->obj_len, 2, part, len);
    LLVMMemoryBufferRef obj[2];
    for (int i = 0; i < n; i++) obj[i] = LLVMCreateMemoryBufferWithMemoryRangeCopy(part[i], len[i], "kiln");
    rc = n < 1 ? -1 : load_code(p, cb->consts, jit, obj, n);
    p->parts = n;
  }
  if (rc) {
    if (cpu_cache_log())
      fprintf(stderr, "kiln: cache: @%s: a cached entry does not load (%s); recompiling\n", p->name,
              kiln_has_error() ? kiln_last_error() : "its kernel info differs");
    kiln_clear_error();
    forget_code(p);
  }
  return rc;
}

/* ---- compiling ---- */

cpu_program *cpu_compile(const ir_func *f) { return cpu_compile_with(f, NULL); }

cpu_program *cpu_compile_with(const ir_func *f, const cpu_options *opt) {
  cpu_options none = {0};
  if (!opt) opt = &none;
  if (!f) {
    kiln_set_error("cpu: no function");
    return NULL;
  }
  if (ir_verify(f)) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    kiln_set_error("cpu: %s", msg);
    return NULL;
  }
  LLVMOrcLLJITRef jit = jit_get();
  if (!jit) return NULL;
  double t0 = now_ms();
  cpu_program *p = calloc(1, sizeof *p);
  if (!p) {
    kiln_set_error("cpu: out of memory");
    return NULL;
  }
  const_list consts = {0};
  cpu_build cb = {.f = f, .p = p, .consts = &consts};
  char *meta = NULL, dir[4096];
  uint8_t key[16];
  p->name = malloc(strlen(f->name) + 1);
  p->param_types = malloc(((size_t)f->n_params + 1) * sizeof *p->param_types);
  p->result_types = malloc(((size_t)f->n_results + 1) * sizeof *p->result_types);
  if (!p->name || !p->param_types || !p->result_types) {
    kiln_set_error("cpu: out of memory");
    goto fail;
  }
  strcpy(p->name, f->name);
  p->n_params = f->n_params;
  p->n_results = f->n_results;
  for (int i = 0; i < f->n_params; i++) p->param_types[i] = f->types[i];
  for (int r = 0; r < f->n_results; r++) p->result_types[r] = f->types[f->results[r]];
  if (plan(&cb)) goto fail;

  /* the disk cache: the plan is cheap and always made; LLVM is skipped */
  bool cache = cpu_cache_dir(dir, sizeof dir);
  if (cache) cache = (meta = cache_meta(&cb, opt, jit)) && !cpu_cache_key(f, meta, key);
  if (cache) {
    cpu_cache_entry e;
    if (cpu_cache_load(dir, key, meta, &e) == 1 && !load_cached(p, &cb, jit, &e)) p->from_cache = true;
    cpu_cache_entry_free(&e);
    if (p->from_cache) goto done;
  }

  LLVMContextRef ctx = LLVMContextCreate(); /* a context of its own: programs compile in parallel */
  LLVMModuleRef mod = LLVMModuleCreateWithNameInContext(f->name, ctx);
  LLVMSetTarget(mod, LLVMOrcLLJITGetTripleString(jit));
  LLVMSetDataLayout(mod, LLVMOrcLLJITGetDataLayoutStr(jit));
  cb.x86 = !strncmp(LLVMOrcLLJITGetTripleString(jit), "x86_64", 6);
  llvm_emit_init(&cb.e, ctx, mod);
  cb.e.contract = !opt->no_contract;
  cb.e.const_data = const_data;
  cb.e.user = &cb;
  int erc = emit_program(&cb, "kiln_entry");
  int n_groups = cb.n_groups;
  int64_t max_work = cb.max_work;
  size_t info_len = 0;
  int32_t *info = !erc && cache ? kernel_info(&cb, &info_len) : NULL;
  llvm_emit_dispose(&cb.e); /* the builders, before what they built */
  if (cb.eb) LLVMDisposeBuilder(cb.eb);
  cb.eb = NULL;
  LLVMMemoryBufferRef obj[2];
  int n_obj = 0;
  if (erc) {
    LLVMDisposeModule(mod);
    LLVMContextDispose(ctx);
  } else {
    erc = optimize(p, ctx, mod, n_groups, max_work, opt->parts, obj, &n_obj);
  }
  if (erc) {
    free(info);
    goto fail;
  }
  if (!info) {
    if (load_code(p, &consts, jit, obj, n_obj)) goto fail;
  } else { /* cached once it links */
    const void *data[2];
    size_t lens[2], packed_len = 0;
    LLVMMemoryBufferRef copy[2];
    for (int i = 0; i < n_obj; i++) {
      data[i] = LLVMGetBufferStart(obj[i]), lens[i] = LLVMGetBufferSize(obj[i]);
      copy[i] = LLVMCreateMemoryBufferWithMemoryRangeCopy(data[i], lens[i], "kiln");
    }
    void *packed = n_obj > 1 ? cpu_parts_pack(n_obj, data, lens, &packed_len) : NULL;
    int lrc = load_code(p, &consts, jit, copy, n_obj);
    cpu_cache_entry e = {.info = info,
                         .info_len = info_len,
                         .obj = n_obj > 1 ? packed : data[0],
                         .obj_len = n_obj > 1 ? packed_len : lens[0],
                         .bc = p->bitcode,
                         .bc_len = p->bitcode_len};
    if (!lrc && (n_obj == 1 || packed)) cpu_cache_store(dir, key, meta, &e);
    free(packed);
    free(info);
    for (int i = 0; i < n_obj; i++) LLVMDisposeMemoryBuffer(obj[i]);
    if (lrc) goto fail;
  }
done:
  p->compile_ms = now_ms() - t0;
  if (cpu_cache_log() && cache)
    fprintf(stderr, "kiln: cache: @%s: %s, %.1f ms\n", f->name, p->from_cache ? "hit" : "miss", p->compile_ms);
  build_free(&cb);
  free(consts.t);
  free(meta);
  return p;
fail:
  build_free(&cb);
  free(consts.t);
  free(meta);
  cpu_program_free(p);
  return NULL;
}

/* The text stages, rebuilt from the optimized module's bitcode. */
char *cpu_program_text(cpu_program *p, const char *stage) {
  if (!p || !stage) {
    kiln_set_error("cpu: no program or stage");
    return NULL;
  }
  bool assembly = !strcmp(stage, "asm");
  if (!assembly && strcmp(stage, "llvm")) {
    kiln_set_error("cpu: unknown stage \"%s\" (llvm, asm)", stage);
    return NULL;
  }
  if (!jit_get()) return NULL;
  LLVMContextRef ctx = LLVMContextCreate();
  LLVMModuleRef m = NULL;
  char *out = NULL;
  const void *part[2];
  size_t len_of[2];
  int n = cpu_parts_unpack(p->bitcode, p->bitcode_len, 2, part, len_of);
  bool read = n >= 1;
  for (int i = 0; i < n && read; i++) { /* a program compiled in two parts is shown as one module */
    LLVMMemoryBufferRef mb = LLVMCreateMemoryBufferWithMemoryRangeCopy(part[i], len_of[i], "kiln");
    LLVMModuleRef mi = NULL;
    read = !LLVMParseBitcodeInContext2(ctx, mb, &mi);
    LLVMDisposeMemoryBuffer(mb);
    if (read && !m)
      m = mi;
    else if (read)
      read = !LLVMLinkModules2(m, mi); /* takes mi */
  }
  char who[300];
  snprintf(who, sizeof who, "cpu: @%s", p->name);
  if (!read)
    kiln_set_error("%s: cannot read back the module", who);
  else
    out = cpu_module_text(m, assembly, who);
  if (m) LLVMDisposeModule(m);
  LLVMContextDispose(ctx);
  return out;
}

char *cpu_module_text(void *module, bool assembly, const char *who) {
  LLVMModuleRef m = module;
  char *out = NULL, *text = NULL, *msg = NULL;
  LLVMMemoryBufferRef ob = NULL;
  LLVMTargetMachineRef tm = NULL;
  if (!assembly) {
    text = LLVMPrintModuleToString(m);
  } else if (!(tm = host_machine())) {
    kiln_set_error("%s: %s", who, jit_error);
  } else if (LLVMTargetMachineEmitToMemoryBuffer(tm, m, LLVMAssemblyFile, &msg, &ob)) {
    kiln_set_error("%s: no assembly: %s", who, msg ? msg : "");
  }
  const char *src = text ? text : ob ? LLVMGetBufferStart(ob) : NULL;
  size_t len = text ? strlen(text) : ob ? LLVMGetBufferSize(ob) : 0;
  if (src && (out = malloc(len + 1))) {
    memcpy(out, src, len);
    out[len] = 0;
  } else if (src) {
    kiln_set_error("%s: out of memory", who);
  }
  if (text) LLVMDisposeMessage(text);
  if (msg) LLVMDisposeMessage(msg);
  if (ob) LLVMDisposeMemoryBuffer(ob);
  if (tm) LLVMDisposeTargetMachine(tm);
  return out;
}
