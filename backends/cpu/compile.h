/* compile.h — what the files of cpu_compile share (internal to
 * backends/cpu): the build, which holds the shared plan (backends/plan,
 * with the CPU's policy in plan.c) and the module that emission fills in
 * (kernel.c, program.c), LLVM's passes in one part or two (parts.c) and the
 * process-wide JIT that links the result (jit.c). compile.c drives them and
 * keeps the disk cache. */
#ifndef KILN_CPU_COMPILE_H
#define KILN_CPU_COMPILE_H

#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/TargetMachine.h>
#include <time.h>

#include "cpu/cpu.h"
#include "llvm/llvm_emit.h"
#include "plan/plan.h"

/* flat kernels with outputs of at least this many bytes prefetch their
 * inputs PF_AHEAD bytes ahead (parts.c's prefetches); PF_ATTR marks them */
#define PF_ATTR "kiln-prefetch"

static inline double cpu_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* The kernels emitted so far, each by its text (reuse.c). */
typedef struct {
  int n, cap;
  char **text;
  LLVMValueRef *fn, *task;
} cpu_reuse;

typedef struct cpu_chains cpu_chains; /* chain.c's knowledge of the plan's slots */

/* What compiling one function builds: the shared plan (backends/plan),
 * then the LLVM module that emission fills in. */
typedef struct {
  const ir_func *f;
  cpu_program *p;
  plan_policy policy; /* the plan's (plan.c) */
  plan pl;
  int max_bufs;     /* most pointers one step passes */
  bool x86;         /* the host is x86-64: streaming stores */
  int64_t max_work; /* elements of the biggest kernel */
  bool pool_busy;   /* a matmul threads: the pool is awake anyway */
  bool scan_loops;  /* cpu_options.scan_loops */
  bool scan_kernels; /* cpu_options.scan_kernels */
  bool no_chains;    /* cpu_options.no_chains */
  cpu_chains *chains; /* chain.c's, made on first use */
  /* emission */
  llvm_emit e;
  LLVMBuilderRef eb; /* the entry function's builder */
  LLVMValueRef entry, call_arg, ctx_array, *slot_ptr;
  LLVMTypeRef ty_par, ty_helper, ty_fail, ty_task;
  LLVMValueRef fn_par, fn_helper, fn_fail;
  cpu_reuse reuse;
} cpu_build;

/* ---- compile.c: the build, shared by cpu_compile and kiln-aot (aot.c) ---- */
/* A new program (cb->p: name, parameter and result types) for f, planned
 * under opt. 0, or -1 with the error set (cb->p, when made, is the
 * caller's to free; cpu_build_free frees the rest). */
int cpu_build_start(cpu_build *cb, const ir_func *f, const cpu_options *opt);
/* The planned build's module for triple and layout: every kernel and the
 * entry function entry_name, which runs the plan's steps. 0 with *ctx and
 * *mod the caller's, or -1 with the error set. */
int cpu_build_module(cpu_build *cb, const cpu_options *opt, const char *triple, const char *layout,
                     const char *entry_name, LLVMContextRef *ctx, LLVMModuleRef *mod);
void cpu_build_free(cpu_build *cb);

/* What the entry needs to know about an emitted kernel. */
typedef struct {
  LLVMValueRef fn, task;
  LLVMTypeRef fn_type;
  int n_bufs;
  int *buf_slot; /* the outputs' slots, then each slot read, once */
  int64_t units, per_unit;
  int64_t work; /* cpu_kernel_work (the biggest of a chain's kernels'); 0: units x per_unit */
  bool can_fail;
  op_id fail_op;
} kinfo;

/* ---- reuse.c ---- */
/* ki, just emitted, is the same code as a kernel emitted before: its
 * functions are deleted and ki takes that kernel's (1); or ki is new and
 * remembered (0); -1 out of memory. */
int cpu_reuse_kernel(cpu_build *cb, kinfo *ki);
void cpu_reuse_free(cpu_reuse *r);

/* "cpu: out of memory"; -1 */
int cpu_oom(void);

/* ---- plan.c, donate.c ---- */
/* Plans cb->f (cb->pl) under the CPU's policy, and takes the program's
 * helpers, constants, results and donors from the plan. 0, or -1 with the
 * error set. */
int cpu_plan(cpu_build *cb);
/* each result's donor (cpu_program_donor), from the plan */
int cpu_plan_donors(cpu_build *cb);
/* overlap.c: each collective's call step a start, and its wait placed
 * before the first later step of its list that needs it (PLAN_STEP_WAIT) */
int cpu_plan_overlap(cpu_build *cb);

/* ---- kernel.c ---- */
/* Emits group g as the function kernel<id> and its task; ki says how the
 * entry calls it. 0, or -1 with the error set (ki->buf_slot still freed by
 * the caller). */
int cpu_emit_kernel(cpu_build *cb, const plan_kernel *g, int id, kinfo *ki);
/* the plan policy's split of kernel g (kernel.c): the parts of a column
 * reduction too narrow to share among the threads, or 0 */
int64_t cpu_column_split(const plan_kernel *g);
/* The thread pool's task of kernel<id> (ki->fn, ki->n_bufs): its
 * buffers and flag from ctx, then the range; ki->task set. 0, or -1. */
int cpu_emit_task(cpu_build *cb, kinfo *ki, int id);
/* ops computed by vector math (vecmath.c): tens of instructions each */
bool cpu_vector_math_op(op_id op);
/* The elements g computes (its biggest output's, or reduced input's): the
 * work by which LLVM's pipeline is chosen (parts.c), the same whether g is
 * a kernel of its own or part of a row chain. */
int64_t cpu_kernel_work(const plan_kernel *g);
/* whether g waits on memory, and so stays on one thread when small */
bool cpu_cheap_kernel(const plan_kernel *g);
void cpu_add_fn_attr(LLVMContextRef ctx, LLVMValueRef fn, const char *name);
/* the host CPU and features (and a preferred vector width) on fn */
void cpu_add_target_attrs(LLVMContextRef ctx, LLVMValueRef fn);

/* ---- chain.c ---- */
/* The kernels of the row chain that steps[0] starts (n steps in its list
 * from there): how many (0: none; then steps[0] is a kernel of its own). */
int cpu_chain_length(cpu_build *cb, const plan_step *steps, int n);
/* Emits the chain of kernel steps steps[0..n) as the function kernel<id>
 * and its task; ki as for cpu_emit_kernel. 0, or -1 with the error set. */
int cpu_emit_chain(cpu_build *cb, const plan_step *steps, int n, int id, kinfo *ki);
void cpu_chains_free(cpu_chains *c);

/* ---- scan_kernel.c ---- */
/* plan_policy.scan_one_kernel: a small elementwise body over short rows
 * (_any: whatever the rows, cpu_options.scan_kernels) */
bool cpu_scan_one_kernel(const ir_func *f, const ir_instr *in);
bool cpu_scan_one_kernel_any(const ir_func *f, const ir_instr *in);
/* The one kernel of a scan (g->special) in fn: buf the pointers of the
 * values of g's function it reads (its leaves), the task's range of units
 * [begin, end); ki's units and per_unit set, *bad_op the first op that can
 * fail. 0, or -1 with the error set. */
int cpu_emit_scan_kernel(cpu_build *cb, const plan_kernel *g, LLVMValueRef fn, LLVMValueRef *buf, LLVMValueRef begin,
                         LLVMValueRef end, LLVMValueRef bad_slot, kinfo *ki, op_id *bad_op);

/* ---- program.c ---- */
/* Emits the entry function entry_name, which runs the plan's steps, and
 * every kernel. 0, or -1 with the error set. */
int cpu_emit_program(cpu_build *cb, const char *entry_name);
/* Emits steps (n of them) at the entry builder's place. 0, or -1 with the
 * error set. */
int cpu_emit_steps(cpu_build *cb, const plan_step *steps, int n);
/* if (cond) return -1 from the entry after calling kiln_rt_kernel_fail of
 * kernel (when >= 0) */
void cpu_emit_bail(cpu_build *cb, LLVMValueRef cond, int32_t kernel);

/* ---- control.c ---- */
/* Emits a cond, while or scan step: a branch on the predicate's byte, or a
 * loop over its nested steps. 0, or -1 with the error set. */
int cpu_emit_control(cpu_build *cb, const plan_step *st);

/* the symbol kiln_const<i> of t (llvm_emit's const_data) */
LLVMValueRef cpu_const_data(void *user, const kiln_tensor *t);
/* the alignment the code may assume of a constant's data (part of the key) */
unsigned cpu_const_align(const kiln_tensor *t);

/* ---- parts.c ---- */
/* The object code of mod (which this disposes, with ctx): one object, or
 * two from two threads. p's bitcode and timings are set. aot: one object
 * for kiln-aot, for the module's triple (cpu_aot_machine). 0, or -1 with
 * the error set. */
int cpu_optimize(cpu_program *p, LLVMContextRef ctx, LLVMModuleRef mod, int n_groups, int64_t max_work,
                 int parts_wanted, bool aot, LLVMMemoryBufferRef obj[2], int *n_obj);

/* ---- jit.c ---- */
/* The process-wide LLJIT, started once; NULL with the error set. */
LLVMOrcLLJITRef cpu_jit_get(void);
/* A new target machine for the host CPU, which the caller disposes; NULL
 * with the reason in cpu_jit_error() (not in the thread's error: it runs
 * on any thread). */
LLVMTargetMachineRef cpu_host_machine(void);
/* The same for kiln-aot's objects: for triple (its --target), the default
 * code model. NULL with the reason in cpu_jit_error(). */
LLVMTargetMachineRef cpu_aot_machine(const char *triple);
const char *cpu_jit_error(void);
/* the host's CPU name and features, as the code is compiled for them */
const char *cpu_host_cpu(void);
const char *cpu_host_features(void);
/* err's message into buf (err consumed) */
void cpu_error_text(LLVMErrorRef err, char *buf, size_t n);
/* "cpu: @f: what: <err's message>"; -1 */
int cpu_llvm_fail(const char *f, const char *what, LLVMErrorRef err);
/* Links object code (the n objects, taken) into a JITDylib of p's own, with
 * the runtime's functions and the constants as its symbols: consts is the
 * plan's list (plan.consts), whose constant i the code reads through the
 * symbol kiln_const<i>; the same IR lists the same contents in the same
 * order in any process, so cached code reads the right ones whichever
 * tensors are shared. 0, or -1 with the error set. */
int cpu_load_code(cpu_program *p, const kiln_tensor *const *consts, int n_consts, LLVMOrcLLJITRef jit,
                  LLVMMemoryBufferRef *obj, int n_obj);

#endif
