/* compile.h — what the files of cuda_compile share (internal to
 * backends/cuda): the build, which holds the shared plan (backends/plan,
 * made under the CUDA policy in plan.c) and the module that ptx.c emits. */
#ifndef KILN_CUDA_COMPILE_H
#define KILN_CUDA_COMPILE_H

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

/* "cuda: out of memory"; -1 */
int cuda_oom(void);
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
