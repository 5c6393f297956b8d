/* ptx.h — the CUDA code generator: plans a verified IR function with the
 * shared planner (backends/plan: a kernel per fusion group or elementwise
 * op, views free, calls inlined), emits every kernel through the shared LLVM emitter for
 * nvptx64-nvidia-cuda, and compiles the module to PTX text with a launch
 * plan beside it. It needs no GPU: the PTX can be inspected (and checked
 * with ptxas) anywhere. Internal to the library; the entry points are
 * exported for the tests and tools. */
#ifndef KILN_CUDA_PTX_H
#define KILN_CUDA_PTX_H

#include "ir.h"
#include "../plan/plan.h" /* relative: tools include this header by its path */

#ifdef __cplusplus
extern "C" {
#endif

/* A device buffer a step reads or writes: a slot of the shared plan
 * (backends/plan); a constant's tensor the program retains, uploaded by the
 * runtime. A row (row t of another buffer, inside a scan) is named by its
 * own slot: index is the slot in the program's slots (cuda_program.slots,
 * whose entry gives the slot it is a row of and the row's bytes); the
 * runtime sets its address each iteration of the scan listing it. */
enum {
  CUDA_REF_PARAM = PLAN_SLOT_PARAM,
  CUDA_REF_RESULT = PLAN_SLOT_RESULT,
  CUDA_REF_ARENA = PLAN_SLOT_ARENA,
  CUDA_REF_CONST = PLAN_SLOT_CONST,
  CUDA_REF_ROW = PLAN_SLOT_ROW
};
typedef struct cuda_ref {
  int kind;
  int index;      /* parameter or result; row: its slot */
  int64_t offset; /* arena: byte offset */
  const kiln_tensor *cst;
  /* the plan's slot it names (cuda_program.slots), whose place a loop may
   * move (cuda_step.move): the runtime follows it there */
  int slot;
} cuda_ref;

/* One step of the launch plan, in schedule order. Control flow (the
 * plan's COND / WHILE / SCAN steps) holds nested step lists that the host
 * runs: the predicate's byte is read back after the work queued before it,
 * a scan's rows are device addresses recomputed each iteration. */
enum {
  CUDA_STEP_KERNEL, /* launch the kernel `name` */
  CUDA_STEP_COPY,   /* device copy of bytes from bufs[1] to bufs[0] */
  CUDA_STEP_HOST,   /* an op the GPU cannot run yet (random draws, host callbacks) */
  CUDA_STEP_COND,   /* bufs[0] the predicate (a bool); sub[0] when true, sub[1] when false */
  CUDA_STEP_WHILE,  /* sub[0] computes the predicate into bufs[0]; while true sub[1] and sub[0] again; at most trip times (-1: no bound) */
  CUDA_STEP_SCAN    /* sub[0] trip times, t = 0 .. trip-1 (down with reverse); bufs the rows (CUDA_REF_ROW) taken at row t */
};
typedef struct cuda_step {
  int kind;
  /* its number: pre-order over the program's step tree (cuda_program.all);
   * a kernel's .entry is "kernel<no>" and its error word no + 1 */
  int no;
  int kernel; /* kernel: the plan's kernel it emits (ptx.c) */
  char name[24];              /* kernel: its .entry */
  unsigned grid[3], block[3]; /* kernel: grid[0] == 0 when there is nothing to do */
  unsigned shared_bytes;      /* kernel: dynamic shared memory (0: all static) */
  /* kernel: its pointer parameters in order (the error word's pointer, an
   * i32, comes after them); copy: destination, source; host: outputs, then
   * inputs */
  int n_bufs;
  cuda_ref *bufs;
  int n_out;     /* host: how many of bufs are outputs */
  op_id op;      /* host: the op; kernel: the op whose check can fail it, or OP_COUNT */
  int64_t bytes; /* copy */
  /* kernel of gather / scatter_add: bufs[index_buf] holds index_count
   * indices of index_dtype that must lie in [0, index_dim); the host finds
   * the bad one for the message after a failed launch */
  int index_buf;
  int64_t index_count, index_dim;
  kiln_dtype index_dtype;
  op_id kernel_op; /* kernel: the instruction it computes (fusion for a fusion group), for messages */
  /* host: the instruction's attributes (attrs.host points into the IR's
   * module, which must outlive the program when it is run) and the type of
   * each of bufs */
  op_attrs attrs;
  op_type *types;
  /* control flow (above) */
  struct cuda_step *sub[2];
  int n_sub[2];
  int64_t trip;
  bool reverse;
  /* while / scan: the plan's double buffering (plan_step's n_state, state,
   * state_bytes, scratch, n_move, move, over cuda_program.slots): at each
   * iteration's end, all at once, slot move[2i] takes the place slot
   * move[2i + 1] had; after the loop each state whose place moved is
   * copied back to its own (through scratch[k] where that is a slot) and
   * every moved slot gets its place back. n_move 0: nothing moves. */
  int n_state, n_move;
  int *state, *move, *scratch;
  int64_t *state_bytes;
} cuda_step;

/* How each result is produced (as cpu.h's cpu_result). */
enum { CUDA_RES_OWN, CUDA_RES_PARAM, CUDA_RES_CONST, CUDA_RES_SAME };
typedef struct cuda_result {
  int kind;
  int index;        /* parameter or earlier result */
  kiln_tensor *cst; /* CUDA_RES_CONST (retained) */
} cuda_result;

typedef struct cuda_program {
  char *name;
  char arch[8]; /* "sm_80", "sm_90" */
  char *ptx;    /* the whole module: one .entry per kernel step */
  int n_params, n_results;
  op_type *param_types, *result_types;
  cuda_result *results;
  int n_steps, n_kernels; /* top-level steps; kernel steps anywhere in the tree */
  cuda_step *steps;
  cuda_step **all; /* every step of the tree, in pre-order: all[s->no] == s */
  int n_all;
  plan_slot *slots; /* the plan's slots (rows resolve their bases through them) */
  int n_slots;
  size_t arena_bytes;
  kiln_tensor **consts; /* retained */
  int n_consts;
  double compile_ms;
  bool from_cache; /* its PTX and launch shapes came from the disk cache */
  void *rt; /* the runtime's modules per GPU (launch.c); NULL until first run */
} cuda_program;

/* Compiles f (a verified ir_func; constants are copied into the PTX or
 * retained) for arch "sm_80" or "sm_90" (NULL = "sm_80"). NULL with
 * "cuda: ..." in the error. Steps the GPU cannot run yet are kept in the plan
 * as CUDA_STEP_HOST (see cuda_program_unsupported). Thread-safe. */
KILN_EXPORT cuda_program *cuda_compile(const ir_func *f, const char *arch);
/* The PTX of f for arch (NULL = "sm_80"): malloc'd; NULL with "cuda: ...". */
KILN_EXPORT char *cuda_ptx_text(const ir_func *f, const char *arch);
KILN_EXPORT const char *cuda_program_ptx(const cuda_program *p);
/* Kernel steps (= .entry functions in the PTX). */
KILN_EXPORT int cuda_program_kernels(const cuda_program *p);
/* Whether p's PTX came from the disk cache rather than from LLVM.
 *
 * The cache is the CPU backend's (cpu.h): with KILN_CACHE_DIR (default
 * $XDG_CACHE_HOME/kiln, else ~/.cache/kiln; "" or "off" turns it off)
 * cuda_compile keeps each program's PTX and launch shapes in <dir>/<key>.kco,
 * keyed by a hash of the IR (callees included), the architecture, the LLVM
 * version and the build of the library, so another process compiling the
 * same IR (an eager op's one-op function or a staged program) skips LLVM.
 * Corrupt or stale entries are rebuilt. */
KILN_EXPORT bool cuda_program_from_cache(const cuda_program *p);
/* 0 when every step runs on the GPU; else -1 with "cuda: @f: <op> is not
 * supported on the GPU yet" for the first that does not. */
KILN_EXPORT int cuda_program_unsupported(const cuda_program *p);
KILN_EXPORT void cuda_program_free(cuda_program *p); /* NULL is fine */
/* Unloads what cuda_program_run loaded for p (launch.c); for cuda_program_free. */
void cuda_program_rt_free(cuda_program *p);

/* KILN_CUDA_TF32=1: f32 dot on tensor cores in TF32 (10-bit mantissa
 * inputs, f32 accumulation; sm_80 and up). Off by default: f32 dot then
 * rounds as the CPU's does. Read at each compile. */
bool cuda_use_tf32(void);
/* KILN_CUDA_SCAN_LOOPS=1: every scan a host loop over its body's kernels,
 * none the device loop of ptx_scan.c (tests, benchmarks). Read at each
 * compile (and part of the disk cache's key). */
bool cuda_scan_loops(void);

/* ---- the disk cache (ptx_cache.c) ---- */
typedef struct cuda_cache_ref {
  bool on;   /* a key was made: cuda_cache_put stores under it */
  char dir[4096];
  char *meta;
  uint8_t key[16];
} cuda_cache_ref;
/* Looks up p, planned from f but not emitted: 1 on a hit (p->ptx and its
 * kernel steps' launch fields filled from the entry), else 0 with ref ready
 * for cuda_cache_put. Never an error. */
int cuda_cache_get(const ir_func *f, cuda_program *p, cuda_cache_ref *ref);
/* Stores p's PTX and launch fields under ref (when on); failures only log. */
void cuda_cache_put(const cuda_cache_ref *ref, const cuda_program *p);
void cuda_cache_ref_free(cuda_cache_ref *ref);

/* fmod as the GPU code computes it (the emitter's llvm_vm_fmod, run by
 * LLVM's interpreter on the host), for n pairs of f32 (rounded from x, y)
 * or f64 values: the tests' check of it without a GPU. 0 / -1. */
KILN_EXPORT int kiln_debug_cuda_fmod(kiln_dtype dt, int64_t n, const double *x, const double *y, double *out);

/* The window op `op` (conv2d, its gradients, pooling and theirs: OPK_WINDOW)
 * of attributes a over the n_in CPU tensors in, into the CPU tensor out (of
 * the type the op table infers), computed by the element code of the GPU's
 * kernels (ptx_window.c, both passes of a split filter gradient) emitted
 * for the host and run in LLVM's interpreter: the tests' check of their
 * index arithmetic without a GPU. Slow; small shapes. 0 / -1. */
KILN_EXPORT int kiln_debug_cuda_window(op_id op, const op_attrs *a, int n_in, kiln_tensor *const *in, kiln_tensor *out);

/* The scan of f (f's one instruction, its operands f's parameters, its
 * results f's results), whose body is elementwise, over the CPU tensors
 * args (per parameter) into the CPU tensors results (per result, of the
 * results' types), computed by the element code of the GPU's device-loop
 * kernel (ptx_scan.c: carries across t, rows at t, reversed from the last)
 * emitted for the host and run in LLVM's interpreter: the tests' check of
 * its arithmetic without a GPU. Slow; small shapes. 0 / -1. */
KILN_EXPORT int kiln_debug_cuda_scan(const ir_func *f, kiln_tensor *const *args, kiln_tensor *const *results);

/* f (verified) over the CPU tensors args (per parameter) into the CPU
 * tensors results (per result, of the results' types) by its CUDA plan run
 * on the host step by step (host_run.c): elementwise kernels (a fusion's
 * epilogue after its dot or conv2d included) and window ops by the element
 * code of the GPU's kernels emitted for the host and run in LLVM's
 * interpreter, other kernels of their own (dot) by the reference
 * interpreter. No reductions, control flow or host steps. The tests' check
 * of what the plan wires and the kernels compute without a GPU. Slow;
 * small shapes. 0 / -1. */
KILN_EXPORT int kiln_debug_cuda_run(const ir_func *f, kiln_tensor *const *args, kiln_tensor *const *results);

#ifdef __cplusplus
}
#endif
#endif
