/* llvm_emit.h — the LLVM emitter shared by Kiln's backends. Given a group
 * of IR instructions (one kernel: elementwise ops, broadcast / reshape /
 * transpose / slice as index remapping, an optional final reduction) it
 * emits the value of one output element at an index; the CPU backend wraps
 * that in loops, the CUDA backend in a thread index. Vector math (exp, log,
 * tanh, sin, pow, ...) is emitted here too, as plain LLVM IR that the loop
 * vectorizer can widen. Internal to the library. */
#ifndef KILN_LLVM_EMIT_H
#define KILN_LLVM_EMIT_H

#include <llvm-c/Core.h>

#include "ir.h"

/* The module being built and the types every emitter function needs. */
typedef struct llvm_emit {
  LLVMContextRef ctx;
  LLVMModuleRef mod;
  LLVMBuilderRef b;
  LLVMTypeRef t_void, t_i1, t_i8, t_i16, t_i32, t_i64, t_f32, t_f64, t_ptr;
  /* fast-math "contract" on the IR's fadd/fsub/fmul: lets LLVM form FMAs
   * (results then differ from the eager kernels in the last bits) */
  bool contract;
  /* The address of a constant tensor's data (a constant of size > 1 read
   * inside a kernel): the CPU backend embeds the host pointer, a GPU
   * backend its device copy. NULL: such constants are an error. */
  LLVMValueRef (*const_data)(void *user, const kiln_tensor *t);
  void *user;
  /* Float mod as llvm_vm_fmod instead of frem: for targets whose frem is
   * not C's fmod (NVPTX lowers it to x - trunc(x / y) * y). */
  bool exact_fmod;
} llvm_emit;

/* Fills e for module mod of context ctx (a builder of its own). */
void llvm_emit_init(llvm_emit *e, LLVMContextRef ctx, LLVMModuleRef mod);
void llvm_emit_dispose(llvm_emit *e);

/* The register type of a dtype's elements (i1 for bool, i16 for the bits of
 * f16 / bf16) and its type in memory (i8 for bool). */
LLVMTypeRef llvm_value_type(const llvm_emit *e, kiln_dtype dt);
LLVMTypeRef llvm_memory_type(const llvm_emit *e, kiln_dtype dt);

/* ---- indices ----
 * A position in a value of static shape, as a multi-index, a row-major
 * linear index, or both (each i64, NULL until someone needs it: a flat
 * elementwise chain never computes the multi-index). */
typedef struct llvm_index {
  int rank;
  int64_t shape[KILN_MAX_RANK];
  LLVMValueRef dim[KILN_MAX_RANK];
  LLVMValueRef linear;
} llvm_index;

void llvm_index_linear(llvm_index *x, const op_type *t, LLVMValueRef linear);
/* dims (rank of t) given; any may not be NULL */
void llvm_index_dims(llvm_index *x, const op_type *t, const LLVMValueRef *dims);
/* computes what is missing (at the builder's position) */
LLVMValueRef llvm_index_get_linear(llvm_emit *e, llvm_index *x);
void llvm_index_get_dims(llvm_emit *e, llvm_index *x);

/* ---- groups ---- */
typedef struct llvm_memo llvm_memo;

typedef struct llvm_group {
  llvm_emit *e;
  const ir_func *f;
  /* per value of f: its buffer (a pointer) when the group reads it from
   * memory, else NULL: then its defining instruction is part of the group */
  LLVMValueRef *buf;
  /* An i1 that is true when some element failed (integer division by
   * zero); NULL while nothing can fail. The caller resets it to NULL (or
   * keeps it) between elements and turns it into the kernel's error flag. */
  LLVMValueRef bad;
  /* op of the first check that can fail (for the error message) */
  op_id bad_op;
  llvm_memo *memo;
  /* 0: every value is one element. n > 1: values are vectors of n elements
   * (a CPU row chain's lanes: rows of a block) or scalars (elements the
   * same in every lane: weights, constants), scalars splatted where an
   * instruction meets a vector. Only ops that cannot fail. */
  int lanes;
} llvm_group;

/* g->e, g->f and g->buf must be set; the memo starts empty. */
void llvm_group_init(llvm_group *g);
void llvm_group_dispose(llvm_group *g);
/* Forgets memoized element values: call whenever the builder moves to a
 * block that the earlier values may not dominate. */
void llvm_group_forget(llvm_group *g);

/* Gives v's value at idx (val, computed by the caller: a loop's carry in a
 * register, a fusion's result), as if emitted, until llvm_group_forget. */
void llvm_group_set(llvm_group *g, ir_value v, const llvm_index *idx, LLVMValueRef val);

/* A one-kernel scan's body at idx (one element of the row; its carries and
 * xs given in bg's memo): its fusions evaluated in order, each through a
 * group of its own (fg, one per instruction of the body), their results
 * given to bg; then the body's results into vals. 0, or -1 with the error
 * set. Both backends' one-kernel scans (cpu/scan_kernel.c, cuda/ptx_scan.c). */
int llvm_scan_body_values(const ir_func *body, llvm_group *bg, llvm_group *fg, llvm_index *idx, LLVMValueRef *vals);

/* The value v (of f) at idx, emitted at the builder's position, in
 * llvm_value_type of v's dtype. Each value of the group is emitted once per
 * index (memoized until llvm_group_forget), so the work is linear in the
 * group's instructions however much they share, and no C recursion follows
 * the dataflow (a chain of 10,000 ops is fine on a small stack). NULL with
 * "llvm: ..." in the error when an instruction cannot be emitted. */
LLVMValueRef llvm_emit_value(llvm_group *g, ir_value v, llvm_index *idx);
/* Loads / stores one element of type dt at linear index i of buffer p
 * (the store instruction is returned, for metadata). */
LLVMValueRef llvm_emit_load(llvm_emit *e, kiln_dtype dt, LLVMValueRef p, LLVMValueRef i);
LLVMValueRef llvm_emit_store(llvm_emit *e, kiln_dtype dt, LLVMValueRef p, LLVMValueRef i, LLVMValueRef v);
/* A kernel's outputs at one element: values vals[0..n) (of g's function)
 * at idx, each stored in its dtype at linear index at of ptrs[k]. Every
 * value first, then the stores, so an output stored over a loop's state
 * (plan_policy.state_in_place) follows every load of that element. 0, or
 * -1 with the error set. */
int llvm_emit_outputs(llvm_group *g, int n, const ir_value *vals, LLVMValueRef const *ptrs, llvm_index *idx,
                      LLVMValueRef at);

/* Whether every instruction of the group reads its inputs at the output's
 * own linear index (or at a single element): then the group can run as one
 * flat loop over linear indices, with no multi-index at all. Visits each
 * value v reaches once. */
bool llvm_group_is_flat(const ir_func *f, const bool *member, ir_value v);
/* Whether op can be part of a group (elementwise, views, broadcast,
 * transpose, slice, constants; reductions as the group's result). */
bool llvm_op_fusible(op_id op);
bool llvm_op_is_reduce(op_id op);
/* Whether dot instruction in of f can be computed per output element inside
 * a kernel: a short inner dimension (K <= LLVM_DOT_INLINE_K, such as the
 * outer products of a batch-1 weight gradient), summed unrolled, so that a
 * fused epilogue (an SGD update, a bias, an activation) reads and writes
 * each output once. Longer dots go to the packed matmul kernels. */
#define LLVM_DOT_INLINE_K 16
bool llvm_dot_inline(const ir_func *f, const ir_instr *in);
/* Whether a fusion's body c can be one kernel, the rule both backends plan
 * by: fusible ops (and the dots dot_ok accepts; NULL: none); distinct
 * results of one shape, or reductions of one input shape and axes that
 * nothing in the body reads, with side_outputs maybe values of the
 * reductions' input shape too (elementwise results a reduction kernel
 * stores as it reads each element: a batch norm backward's dy after relu
 * beside its two sums; plan_kernel.n_side). */
bool llvm_fusion_one_kernel(const ir_func *c, bool (*dot_ok)(const ir_func *c, const ir_instr *in), bool side_outputs);

/* ---- reductions: the accumulator, in a type wide enough (f64 for f32
 * sums and products, as the eager kernels do) ---- */
LLVMTypeRef llvm_reduce_type(llvm_emit *e, op_id op, kiln_dtype dt);
LLVMValueRef llvm_reduce_identity(llvm_emit *e, op_id op, kiln_dtype dt);
/* acc op x (x of the element type), reassociable so loops vectorize */
LLVMValueRef llvm_reduce_combine(llvm_emit *e, op_id op, kiln_dtype dt, LLVMValueRef acc, LLVMValueRef x);
/* the accumulator as the result element type */
LLVMValueRef llvm_reduce_finish(llvm_emit *e, op_id op, kiln_dtype dt, LLVMValueRef acc);

/* ---- small builders the backends share ---- */
LLVMValueRef llvm_i64(llvm_emit *e, int64_t v);
LLVMValueRef llvm_i32(llvm_emit *e, int32_t v);
/* a constant of type t (a float or int type, or a vector of one: splatted) */
LLVMValueRef llvm_const_f(LLVMTypeRef t, double v);
LLVMValueRef llvm_const_i(LLVMTypeRef t, int64_t v);
/* declares (once) the LLVM intrinsic name overloaded on the given types */
LLVMValueRef llvm_intrinsic(llvm_emit *e, const char *name, LLVMTypeRef *types, int n, LLVMTypeRef *fn_type);
LLVMValueRef llvm_call(llvm_emit *e, LLVMValueRef fn, LLVMTypeRef fn_type, LLVMValueRef *args, int n);
/* the intrinsic name overloaded on args[0]'s type, called on n args */
LLVMValueRef llvm_intr(llvm_emit *e, const char *name, LLVMValueRef *args, int n);
/* x as a vector of lanes elements (a scalar splatted; a vector as it is) */
LLVMValueRef llvm_splat(llvm_emit *e, int lanes, LLVMValueRef x);
/* x[0..n) all vectors of lanes elements when any of them is one */
void llvm_splat_all(llvm_emit *e, int lanes, LLVMValueRef *x, int n);
/* counted loops: for (iv = lo; iv < hi; iv++) { body }; llvm_loop_begin leaves the
 * builder in the body and returns iv; llvm_loop_end closes it and leaves the
 * builder after the loop */
typedef struct llvm_loop {
  LLVMBasicBlockRef head, body, exit;
  LLVMValueRef iv, next_phi_in;
} llvm_loop;
LLVMValueRef llvm_loop_begin(llvm_emit *e, llvm_loop *l, LLVMValueRef lo, LLVMValueRef hi, const char *name);
void llvm_loop_end(llvm_emit *e, llvm_loop *l);

/* ---- vector math (vecmath.c): x of type float or double (or vectors of
 * them); each accurate to a few ulp over the whole range, special values
 * as C's functions give them, no branches (the loop vectorizer widens them) */
LLVMValueRef llvm_vm_exp(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_log(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_log1p(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_tanh(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_sigmoid(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_sin(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_cos(llvm_emit *e, LLVMValueRef x);
LLVMValueRef llvm_vm_pow(llvm_emit *e, LLVMValueRef x, LLVMValueRef y);
/* C's fmod, exact, in integer arithmetic (scalars only; it loops) */
LLVMValueRef llvm_vm_fmod(llvm_emit *e, LLVMValueRef x, LLVMValueRef y);

#endif
