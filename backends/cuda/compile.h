/* compile.h — what the files of cuda_compile share (internal to
 * backends/cuda): the build, which holds the shared plan (backends/plan,
 * made under the CUDA policy in plan.c) and the module that ptx.c emits. */
#ifndef KILN_CUDA_COMPILE_H
#define KILN_CUDA_COMPILE_H

#include <llvm-c/ExecutionEngine.h>

#include "cuda/ptx.h"
#include "llvm/llvm_emit.h"
#include "plan/plan.h"

typedef struct cuda_build {
  const ir_func *f;
  cuda_program *p;
  plan pl; /* its steps are p->steps, one for one */
  bool tf32; /* cuda_use_tf32() at the start of the compile */
  /* emission */
  llvm_emit e;
  LLVMModuleRef mod;
  const kiln_tensor **cst_t; /* constants already in the module */
  LLVMValueRef *cst_g;
  int n_cst;
} cuda_build;

/* Column reductions (the last axis kept, e.g. a sum over axis 0 of
 * [100000, 4]) with few outputs: instead of a thread per output walking its
 * whole column, a block reduces a tile of tx adjacent outputs (adjacent in
 * memory) over a range of rows, ty = THREADS / tx threads per output
 * striding the rows and a shared-memory tree at the end; `split` blocks
 * share each tile of columns, and then their partial results (in the
 * accumulator type) go through the arena to a second kernel that combines
 * them in a fixed order. Results do not depend on timing: every sum is
 * taken in one order, run after run. */
typedef struct {
  int tx, ty;
  int64_t tiles, split, chunk; /* chunk: rows per split */
} colplan;

/* Whether the kernel storing out (a value of f) is a column reduction to
 * run as above, and how (the plan's split and the emission agree). */
bool cuda_column_plan(const ir_func *f, ir_value out, colplan *cp);

/* ---- what ptx.c's kernels and ptx_window.c's share ---- */

/* a loop for (iv = lo; iv < hi; iv += step), iv of lo's type */
typedef struct {
  LLVMBasicBlockRef head, body, exit;
  LLVMValueRef iv, step;
} sloop;

/* What emission of one kernel needs (ptx.c's kernel_begin fills it). */
typedef struct {
  cuda_build *cb;
  const plan_kernel *g;
  cuda_step *st;
  LLVMValueRef fn;
  char name[24];
  LLVMValueRef *buf;  /* per value of g->f: its pointer, or NULL */
  LLVMValueRef *outp; /* per output */
  LLVMValueRef err;   /* the error word */
  LLVMValueRef bad;   /* i1 alloca: some element failed */
  int step_no;
  colplan col; /* a column reduction's (g->pass) */
} kctx;

/* A grid-stride loop over [0, n), a thread per item: returns the item (i64);
 * cuda_grid_loop_end closes it. */
LLVMValueRef cuda_grid_loop_begin(llvm_emit *e, sloop *l, int64_t n);
void cuda_grid_loop_end(llvm_emit *e, sloop *l);
/* st's launch shape for a thread per item (blocks of the usual size, at
 * most the usual many: the grid-stride loop takes the rest) */
void cuda_launch_1d(cuda_step *st, int64_t items);

/* ---- the window ops (ptx_window.c) ---- */

/* Emits kernel k of a window op (OPK_WINDOW: conv2d, its gradients,
 * pooling and theirs): the op itself, or either pass of a filter gradient
 * split in two (k->g->pass). 0, or -1 with the error set. */
int cuda_emit_window(kctx *k);
/* The plan policy's split of a window op's kernel g (special): how many
 * partial sums per filter element a conv2d_backprop_filter takes (0 for
 * one pass; every other window op is one pass). */
int64_t cuda_window_split(const plan_kernel *g);

/* ---- the device loop of an elementwise scan (ptx_scan.c) ---- */

/* The policy's scan_one_kernel: scan in (of f) is one kernel looping over
 * t on the device when its body is elementwise (plan_scan_elementwise) and
 * KILN_CUDA_SCAN_LOOPS=1 (cuda_scan_loops) does not ask for host loops. */
bool cuda_scan_one_kernel(const ir_func *f, const ir_instr *in);
/* Emits kernel k of such a scan (k->g->special, its operands the leaves,
 * its results the outputs); *can_fail: an element's check can fail (the
 * step's op set). 0, or -1 with the error set. */
int cuda_emit_scan(kctx *k, bool *can_fail);

/* ---- the element code run on the host (the kiln_debug_cuda_* checks) ---- */

/* The element code of an elementwise kernel g (ptx.c's): its outputs'
 * values at item i (their pointers outp) computed and stored, a failed
 * check ORed into the i1 alloca bad. The GPU's kernel loops over a grid;
 * the host run (host_run.c) over a plain loop. 0, or -1 with the error set. */
int cuda_emit_element(llvm_emit *e, llvm_group *lg, const plan_kernel *g, LLVMValueRef const *outp, LLVMValueRef i,
                      LLVMValueRef bad);
/* The window op's element code (both passes of a split filter gradient)
 * run on the host over n_in inputs of types ts (ptx_window.c), into out of
 * type ot. 0 / -1. */
int cuda_host_window(op_id op, const op_attrs *a, int n_in, const op_type *ts, const op_type *ot, void *const *in,
                     void *out);
/* e over a new module of that name in a new context, for the element
 * code run on the host: constants read at their host addresses, fmod
 * computed as the GPU's. The caller disposes of e, then of the context. */
void cuda_host_emit_init(llvm_emit *e, const char *name);
/* The intrinsics the element code calls that LLVM's interpreter cannot
 * run, rewritten as plain IR (on scalars) in mod: fabs, copysign, maximum /
 * minimum (NaN propagating, -0 below +0), smax / smin, fma (through f64
 * for f32, a product and a sum for f64: within an ulp), floor, ceil. Any
 * other intrinsic is an error (the interpreter would abort the process).
 * 0 / -1. (ptx_scan.c) */
int cuda_host_intrinsics(llvm_emit *e, LLVMModuleRef mod);
/* whether t is a CPU tensor of type ty (host_run.c) */
bool cuda_host_type_is(const kiln_tensor *t, const op_type *ty);
/* Plans f under the CUDA policy into pl (plan_build). */
int cuda_plan_build(plan *pl, const ir_func *f);

/* "cuda: out of memory"; -1 */
int cuda_oom(void);
/* An LLVM interpreter over mod, verified first, to run the GPU's element
 * code on the host (the kiln_debug_cuda_* checks); takes mod either way.
 * 0, or -1 with the error set ("cuda: who: ..."). */
int cuda_host_engine(LLVMModuleRef mod, const char *who, LLVMExecutionEngineRef *ee);
/* Plans cb->f (cb->pl) under the CUDA policy and makes the launch plan:
 * cb->p's steps (one per plan step), results and retained constants. 0, or
 * -1 with the error set. */
int cuda_plan(cuda_build *cb);
/* The launch plan's name of plan slot s: the slot itself, or for a row
 * CUDA_REF_ROW naming s (ptx.h). */
cuda_ref cuda_slot_ref(const plan *pl, int s);
/* n steps and their nested lists, freed (NULL is fine) */
void cuda_steps_free(cuda_step *steps, int n);

#endif
