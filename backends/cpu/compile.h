/* compile.h — what the files of cpu_compile share (internal to
 * backends/cpu): the plan's slots, kernels and steps (plan.c), the build
 * that emission fills in (kernel.c, program.c), LLVM's passes in one part or
 * two (parts.c) and the process-wide JIT that links the result (jit.c).
 * compile.c drives them and keeps the disk cache. */
#ifndef KILN_CPU_COMPILE_H
#define KILN_CPU_COMPILE_H

#include <llvm-c/Core.h>
#include <llvm-c/Error.h>
#include <llvm-c/LLJIT.h>
#include <llvm-c/TargetMachine.h>
#include <time.h>

#include "cpu/cpu.h"
#include "llvm/llvm_emit.h"

/* flat kernels with outputs of at least this many bytes prefetch their
 * inputs PF_AHEAD bytes ahead (parts.c's prefetches); PF_ATTR marks them */
#define PF_ATTR "kiln-prefetch"

static inline double cpu_now_ms(void) {
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

/* "cpu: out of memory"; -1 */
int cpu_oom(void);
/* elements and bytes of a value of type t */
int64_t cpu_type_size(const op_type *t);
int64_t cpu_type_bytes(const op_type *t);

/* ---- plan.c ---- */
/* Plans cb->f: slots, kernels, helpers and copies, each result's kind and
 * donor. 0, or -1 with the error set. */
int cpu_plan(cpu_build *cb);

/* ---- kernel.c ---- */
/* Emits group g as the function kernel<id> and its task; ki says how the
 * entry calls it. 0, or -1 with the error set (ki->buf_slot still freed by
 * the caller). */
int cpu_emit_kernel(cpu_build *cb, const kgroup *g, int id, kinfo *ki);
/* whether g waits on memory, and so stays on one thread when small */
bool cpu_cheap_kernel(const kgroup *g);
void cpu_add_fn_attr(LLVMContextRef ctx, LLVMValueRef fn, const char *name);
/* the host CPU and features (and a preferred vector width) on fn */
void cpu_add_target_attrs(LLVMContextRef ctx, LLVMValueRef fn);

/* ---- program.c ---- */
/* Emits the entry function entry_name, which runs the plan's steps, and
 * every kernel. 0, or -1 with the error set. */
int cpu_emit_program(cpu_build *cb, const char *entry_name);
/* the symbol kiln_const<i> of t (llvm_emit's const_data) */
LLVMValueRef cpu_const_data(void *user, const kiln_tensor *t);
/* the alignment the code may assume of a constant's data (part of the key) */
unsigned cpu_const_align(const kiln_tensor *t);

/* ---- parts.c ---- */
/* The object code of mod (which this disposes, with ctx): one object, or
 * two from two threads. p's bitcode and timings are set. 0, or -1 with the
 * error set. */
int cpu_optimize(cpu_program *p, LLVMContextRef ctx, LLVMModuleRef mod, int n_groups, int64_t max_work,
                 int parts_wanted, LLVMMemoryBufferRef obj[2], int *n_obj);

/* ---- jit.c ---- */
/* The process-wide LLJIT, started once; NULL with the error set. */
LLVMOrcLLJITRef cpu_jit_get(void);
/* A new target machine for the host CPU, which the caller disposes; NULL
 * with the reason in cpu_jit_error() (not in the thread's error: it runs
 * on any thread). */
LLVMTargetMachineRef cpu_host_machine(void);
const char *cpu_jit_error(void);
/* the host's CPU name and features, as the code is compiled for them */
const char *cpu_host_cpu(void);
const char *cpu_host_features(void);
/* err's message into buf (err consumed) */
void cpu_error_text(LLVMErrorRef err, char *buf, size_t n);
/* "cpu: @f: what: <err's message>"; -1 */
int cpu_llvm_fail(const char *f, const char *what, LLVMErrorRef err);
/* Links object code (the n objects, taken) into a JITDylib of p's own, with
 * the runtime's functions and p's constants as its symbols. 0, or -1 with
 * the error set. */
int cpu_load_code(cpu_program *p, const const_list *consts, LLVMOrcLLJITRef jit, LLVMMemoryBufferRef *obj,
                  int n_obj);

#endif
