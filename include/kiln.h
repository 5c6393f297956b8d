/* kiln.h — the whole public API of Kiln: eager tensors, autodiff and a
 * tracing JIT for C. The contract is ../shared/API.md; this header is its
 * manual. Every function says what it returns, who owns it and when it fails. */
#ifndef KILN_H
#define KILN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif
#if defined(__GNUC__)
#pragma GCC visibility push(default) /* the library hides everything else */
#endif

/* ------------------------------------------------------------------------
 * 1. Conventions
 *
 * Errors: a function returning a pointer returns NULL on failure; one
 * returning int returns 0 on success and -1 on failure. kiln_last_error()
 * then holds a message that begins with the operation's name, e.g.
 * "gather: indices[0] = 7 is not in [0, 3)". An op given a NULL input returns
 * NULL and keeps the first error, so a chain can be checked once at its end.
 * Nothing aborts the process on bad input.
 *
 * Ownership: tensors are immutable and reference counted. A tensor returned
 * by any kiln_ function belongs to the innermost open scope of the calling
 * thread; with no scope open the caller owns it and ends it with
 * kiln_release().
 * ---------------------------------------------------------------------- */

#define KILN_MAX_RANK 8

/* KILN_SHAPE(2, 3) -> 2, (const int64_t[]){2, 3}. Rank 0 is written 0, NULL. */
#define KILN_SHAPE(...)                                                   \
  (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)),        \
      (const int64_t[]) { __VA_ARGS__ }
/* KILN_AXES(0, 1) -> 2, (const int[]){0, 1}. */
#define KILN_AXES(...)                                                    \
  (int)(sizeof((const int[]){__VA_ARGS__}) / sizeof(int)), (const int[]) { __VA_ARGS__ }

typedef enum {
  KILN_F32,
  KILN_F64,
  KILN_I32,
  KILN_I64,
  KILN_BOOL, /* one byte per element, 0 or 1 */
  KILN_F16,  /* IEEE half: storage only; kiln_cast to and from it */
  KILN_BF16  /* bfloat16: storage only; kiln_cast to and from it */
} kiln_dtype;
#define KILN_DTYPE_COUNT 7

typedef struct kiln_tensor kiln_tensor;
typedef struct kiln_variable kiln_variable;
typedef struct kiln_tape kiln_tape;
typedef struct kiln_function kiln_function;

const char *kiln_version(void);               /* "0.1.0"; static string */
const char *kiln_last_error(void);            /* "" when nothing failed; per thread */
void kiln_clear_error(void);                  /* makes kiln_last_error() "" again */
int kiln_fail(const char *fmt, ...);          /* sets the error from user code, returns -1 */
const char *kiln_dtype_name(kiln_dtype);      /* "f32", "i64", ...; "?" if out of range */
size_t kiln_dtype_size(kiln_dtype);           /* bytes per element; 0 if out of range */

/* Scopes own the tensors returned while they are innermost. */
void kiln_scope_push(void);
void kiln_scope_pop(void);                      /* releases what the scope still owns */
kiln_tensor *kiln_scope_escape(kiln_tensor *t); /* hand t to the parent scope (or the caller);
                                                   NULL if t is not owned by this scope */
kiln_tensor *kiln_retain(kiln_tensor *t);       /* +1 reference owned by the caller; returns t */
void kiln_release(kiln_tensor *t);              /* -1 caller-owned reference; NULL is fine */

/* ------------------------------------------------------------------------
 * 2. Tensors. Storage is row-major, contiguous and 64-byte aligned.
 * Shapes have rank 0..8; an element count that overflows is an error.
 * ---------------------------------------------------------------------- */

kiln_tensor *kiln_tensor_new(kiln_dtype, int rank, const int64_t *shape,
                             const void *data); /* copies data; data NULL = zeros */
kiln_tensor *kiln_scalar(kiln_dtype, double value);
kiln_tensor *kiln_scalar_like(const kiln_tensor *t, double value); /* rank 0, t's dtype and device */
kiln_tensor *kiln_zeros(kiln_dtype, int rank, const int64_t *shape);
kiln_tensor *kiln_ones(kiln_dtype, int rank, const int64_t *shape);
kiln_tensor *kiln_fill(kiln_dtype, int rank, const int64_t *shape, double value);
kiln_tensor *kiln_arange(kiln_dtype, int64_t n); /* 0 .. n-1; n >= 0 */
kiln_tensor *kiln_eye(kiln_dtype, int64_t n);    /* n x n identity */

/* Random numbers come from a counter-based Philox-4x32-10 generator. The
 * global state is (seed, counter): the same seed gives the same stream, and
 * each draw advances the counter by the blocks it used. */
void kiln_random_seed(uint64_t seed); /* also resets the counter to 0 */
/* Standard normal (Box-Muller); float dtypes only. */
kiln_tensor *kiln_random_normal(kiln_dtype, int rank, const int64_t *shape);
/* Uniform in [lo, hi). Integer dtypes draw integers in [lo, hi). */
kiln_tensor *kiln_random_uniform(kiln_dtype, int rank, const int64_t *shape, double lo, double hi);
/* The generator's position, for code that must save, restore or stage it. */
void kiln_random_get_state(uint64_t *seed, uint64_t *counter);
void kiln_random_set_state(uint64_t seed, uint64_t counter);

kiln_dtype kiln_tensor_dtype(const kiln_tensor *);    /* KILN_F32 for NULL */
int kiln_tensor_rank(const kiln_tensor *);            /* -1 for NULL */
const int64_t *kiln_tensor_shape(const kiln_tensor *); /* rank entries, valid while t lives */
int64_t kiln_tensor_size(const kiln_tensor *);        /* number of elements; -1 for NULL */
const char *kiln_tensor_device(const kiln_tensor *);  /* "cpu:0", "gpu:0"; NULL for NULL */
/* Copies the data to dst, row-major; fails if bytes < size * dtype size. */
int kiln_tensor_read(const kiln_tensor *, void *dst, size_t bytes);
/* The one element as double; NAN with the error set unless size is 1. */
double kiln_tensor_item(const kiln_tensor *);
/* "kiln.Tensor([[2. 3.] [4. 5.]], shape=(2, 2), dtype=f32)"; more than 1000
 * elements are summarised with "..." as NumPy does. malloc'd: free() it. */
char *kiln_tensor_str(const kiln_tensor *);
int kiln_tensor_print(const kiln_tensor *, FILE *); /* kiln_tensor_str and a newline */
/* Read-only pointer to the host data of a CPU tensor (NULL otherwise). */
const void *kiln_tensor_data(const kiln_tensor *);

/* ------------------------------------------------------------------------
 * 3. Operations. Each returns a new tensor (owned as in section 1) or NULL.
 *
 * Semantics pinned down here:
 * - Binary ops broadcast as NumPy does; dtypes must match exactly.
 * - Arithmetic works on f32, f64, i32, i64; bool takes the logical ops,
 *   comparisons, select, maximum/minimum and the data-movement ops. f16 and
 *   bf16 are storage types: cast, print, read and move them (reshape,
 *   transpose, slice, concat, ...), cast to f32 to compute.
 * - Integer div and mod truncate toward zero, as C does (mod takes the sign
 *   of the dividend); float mod is fmod. Integer division or mod by zero is
 *   an error. INT_MIN / -1 wraps. Integer pow with a negative exponent is 0
 *   unless the base is 1 or -1.
 * - Comparisons and logical ops return bool.
 * - cast from float to an integer truncates toward zero; NaN gives 0 and
 *   values out of range saturate. Integer to narrower integer wraps (keeps
 *   the low bits, as C and NumPy do). Casting to bool gives x != 0.
 *   Casting to f16 or bf16 rounds once, to nearest even, from the source
 *   value (f64 and integers included: f64 2049.0000000000005 gives f16
 *   2050, as NumPy does, not 2048 through f32); beyond the largest finite
 *   value it gives inf, NaN stays NaN.
 * - Shapes: a 0 anywhere makes a shape empty (size 0), whatever its other
 *   dimensions, e.g. (2^40, 2^40, 0); without one, an element count past
 *   2^59 is an error naming the op.
 * - Reductions of an empty axis give the identity: sum 0, prod 1,
 *   max -inf (integer: the type's minimum), min +inf (integer: maximum).
 *   reduce_mean of an empty axis is NaN (0/0). argmax picks the first
 *   maximum; argmax of an empty axis is an error.
 * - sign(0) = 0; relu(x) = max(x, 0); sigmoid is computed without overflow.
 *
 * Deliberate differences from NumPy and PyTorch. tests/torch_diff_test.cc
 * compares every op, its gradient and its staged form with PyTorch 1.13 and
 * maps exactly these (tests/torch_ref.py); anything else that differs is a bug.
 * - No type promotion: binary ops, select, concat and matmul need equal
 *   dtypes (cast first). Integer reduce_sum/reduce_prod keep the input dtype
 *   and wrap (PyTorch sums i32 into i64).
 * - Integer div truncates toward zero (C); PyTorch's div is true division,
 *   NumPy's // floors. INT_MIN / -1 wraps to INT_MIN (a trap in plain C).
 * - mod takes the sign of the dividend (C's % and fmod, torch.fmod), not of
 *   the divisor (NumPy's %, torch.remainder). x mod -1 is 0.
 * - Integer pow with a negative exponent is 0 unless the base is 1 or -1
 *   (NumPy and PyTorch raise an error).
 * - reduce_mean of an integer tensor stays an integer, truncated toward zero
 *   (NumPy returns a float, PyTorch raises).
 * - reduce_max/reduce_min of an empty axis give -inf/+inf (the integer
 *   type's min/max); NumPy and PyTorch raise an error.
 * - cast from float to integer: truncation, NaN -> 0, saturation at the
 *   type's range (undefined in C, NumPy and PyTorch: x86 gives INT_MIN).
 *   f64 and integers -> f16/bf16 round once to nearest even, as NumPy does
 *   for f16; PyTorch converts through f32 and can round twice.
 * - one_hot: an index outside [0, depth) gives a row of zeros (TensorFlow's
 *   rule; torch.nn.functional.one_hot raises). gather and scatter_add reject
 *   negative indices (NumPy's take wraps them).
 * - sign(-0.0) is -0.0: zeros pass through (NumPy and PyTorch give +0.0);
 *   sign(NaN) is NaN, as NumPy (PyTorch gives 0).
 * Gradients (a tape or kiln_gradients):
 * - pow: d/db a^b = a^b log(a) where a > 0 and 0 elsewhere (TensorFlow's
 *   rule; PyTorch gives NaN for a < 0 and inf at a = 0, b < 0). d/da is
 *   b a^(b-1), and 0 where b = 0, as PyTorch.
 * - rsqrt's gradient is -out / (2x): -inf * dy at -0 as at +0 (PyTorch's
 *   -out^3 / 2 is +inf at -0).
 * - clip_by_norm of an all-zero tensor has a finite gradient (the norm is
 *   taken as s > 0 ? sqrt(s) : 0); sqrt's 0 * inf gives NaN in PyTorch.
 * - As PyTorch 1.13 (unlike TensorFlow): maximum/minimum split the gradient
 *   evenly between equal operands, reduce_max/reduce_min among tied
 *   elements; relu and abs have gradient 0 at 0; sqrt's at 0 is inf.
 * - At NaN inputs: relu's gradient is 0 (dy where x > 0), and maximum/
 *   minimum give the whole gradient to the second operand; PyTorch passes
 *   dy through relu and to both operands.
 * - softmax_cross_entropy differentiates with respect to labels too
 *   (-log_softmax(logits)), as TensorFlow's v2 op.
 * ---------------------------------------------------------------------- */

/* elementwise binary, NumPy broadcasting */
kiln_tensor *kiln_add(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_sub(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_mul(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_div(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_pow(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_maximum(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_minimum(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_mod(kiln_tensor *a, kiln_tensor *b);
/* comparisons -> bool */
kiln_tensor *kiln_equal(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_not_equal(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_less(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_less_equal(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_greater(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_greater_equal(kiln_tensor *a, kiln_tensor *b);
/* logical, bool only */
kiln_tensor *kiln_logical_and(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_logical_or(kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_logical_not(kiln_tensor *a);
/* elementwise unary; exp..tanh, sigmoid, floor, ceil need a float dtype */
kiln_tensor *kiln_neg(kiln_tensor *a);
kiln_tensor *kiln_abs(kiln_tensor *a);
kiln_tensor *kiln_sign(kiln_tensor *a);
kiln_tensor *kiln_exp(kiln_tensor *a);
kiln_tensor *kiln_log(kiln_tensor *a);
kiln_tensor *kiln_log1p(kiln_tensor *a);
kiln_tensor *kiln_sqrt(kiln_tensor *a);
kiln_tensor *kiln_rsqrt(kiln_tensor *a);
kiln_tensor *kiln_square(kiln_tensor *a);
kiln_tensor *kiln_sin(kiln_tensor *a);
kiln_tensor *kiln_cos(kiln_tensor *a);
kiln_tensor *kiln_tanh(kiln_tensor *a);
kiln_tensor *kiln_sigmoid(kiln_tensor *a);
kiln_tensor *kiln_relu(kiln_tensor *a);
kiln_tensor *kiln_floor(kiln_tensor *a);
kiln_tensor *kiln_ceil(kiln_tensor *a);
/* cond ? a : b elementwise; cond is bool; all three broadcast together */
kiln_tensor *kiln_select(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b);
kiln_tensor *kiln_cast(kiln_tensor *t, kiln_dtype);
kiln_tensor *kiln_identity(kiln_tensor *t);
kiln_tensor *kiln_stop_gradient(kiln_tensor *t);

/* reductions: axes == NULL (or naxes == 0 with axes NULL) reduces every axis;
 * negative axes count from the end; repeated axes are an error. */
kiln_tensor *kiln_reduce_sum(kiln_tensor *t, int naxes, const int *axes, bool keepdims);
kiln_tensor *kiln_reduce_mean(kiln_tensor *t, int naxes, const int *axes, bool keepdims);
kiln_tensor *kiln_reduce_max(kiln_tensor *t, int naxes, const int *axes, bool keepdims);
kiln_tensor *kiln_reduce_min(kiln_tensor *t, int naxes, const int *axes, bool keepdims);
kiln_tensor *kiln_reduce_prod(kiln_tensor *t, int naxes, const int *axes, bool keepdims);
kiln_tensor *kiln_argmax(kiln_tensor *t, int axis); /* i64; first maximum wins */

/* linear algebra: rank >= 2, leading dimensions broadcast as batch */
kiln_tensor *kiln_matmul(kiln_tensor *a, kiln_tensor *b);

/* shape */
kiln_tensor *kiln_reshape(kiln_tensor *t, int rank, const int64_t *shape); /* one -1 allowed */
kiln_tensor *kiln_transpose(kiln_tensor *t, int rank, const int *perm);    /* perm NULL = reverse */
kiln_tensor *kiln_broadcast_to(kiln_tensor *t, int rank, const int64_t *shape);
kiln_tensor *kiln_expand_dims(kiln_tensor *t, int axis); /* axis in [-rank-1, rank] */
kiln_tensor *kiln_squeeze(kiln_tensor *t, int axis);     /* that axis must have size 1 */
/* begin[i] in [0, dim]; size -1 = to the end; begin+size must fit */
kiln_tensor *kiln_slice(kiln_tensor *t, const int64_t *begin, const int64_t *size);
kiln_tensor *kiln_index(kiln_tensor *t, int64_t i); /* t[i] on axis 0; negative i from the end */
kiln_tensor *kiln_concat(int n, kiln_tensor *const *ts, int axis);
/* n equal parts along axis into out[0..n); 0 or -1 (out untouched on failure) */
int kiln_split(kiln_tensor *t, int n, int axis, kiln_tensor **out);
kiln_tensor *kiln_stack(int n, kiln_tensor *const *ts, int axis);
/* result shape params.shape[:axis] + indices.shape + params.shape[axis+1:];
 * indices i32 or i64, each in [0, dim) (negative indices are errors) */
kiln_tensor *kiln_gather(kiln_tensor *params, kiln_tensor *indices, int axis);
/* The gradient of kiln_gather: zeros of shape (rank, shape), then
 * out[..., indices[j], ...] += updates[..., j, ...] along axis (duplicates
 * accumulate). updates has shape shape[:axis] + indices.shape + shape[axis+1:];
 * f32, f64, i32, i64 (integer sums wrap). indices i32 or i64, each in
 * [0, shape[axis]) (negative indices are errors); axis in [-rank, rank). */
kiln_tensor *kiln_scatter_add(kiln_tensor *updates, kiln_tensor *indices, int axis, int rank,
                              const int64_t *shape);
/* indices (i32/i64) -> indices.shape + (depth,); out-of-range rows are all 0.
   A depth whose result cannot be counted or allocated fails as one_hot. */
kiln_tensor *kiln_one_hot(kiln_tensor *indices, int64_t depth, kiln_dtype);

/* neural-network helpers (float dtypes) */
kiln_tensor *kiln_softmax(kiln_tensor *t, int axis);
kiln_tensor *kiln_log_softmax(kiln_tensor *t, int axis);
/* labels and logits [..., classes] -> per example [...] */
kiln_tensor *kiln_softmax_cross_entropy(kiln_tensor *labels, kiln_tensor *logits);
/* labels i32/i64 [...] in [0, classes), logits [..., classes] -> [...]. A
   label out of range is an error naming it ("sparse_softmax_cross_entropy:
   labels[1] = -1 is not in [0, 10)"), staged too: on the CPU a staged call
   checks the labels with a host_call at each call and fails with the same
   message after "@function: " (on a GPU it reads "gather: indices[i] ..."). */
kiln_tensor *kiln_sparse_softmax_cross_entropy(kiln_tensor *labels, kiln_tensor *logits);
/* t * max_norm / max(l2norm(t), max_norm) */
kiln_tensor *kiln_clip_by_norm(kiln_tensor *t, double max_norm);

/* ------------------------------------------------------------------------
 * 4. Variables, gradients, optimizers, checkpoints
 * ---------------------------------------------------------------------- */

/* Mutable state with a fixed dtype and shape. kiln_variable_new copies init
 * (NULL or a symbolic init is an error); name may be NULL ("var<N>" is
 * made up); the name is copied. Creating a variable while tracing fails. */
kiln_variable *kiln_variable_new(const kiln_tensor *init, const char *name);
void kiln_variable_free(kiln_variable *); /* NULL is fine; tensors read stay valid */
const char *kiln_variable_name(const kiln_variable *);
kiln_tensor *kiln_variable_read(kiln_variable *); /* current value; watched by every active tape */
/* Replace the value; value must have the variable's dtype and shape. 0 / -1. */
int kiln_variable_assign(kiln_variable *, const kiln_tensor *value);
int kiln_variable_assign_add(kiln_variable *, const kiln_tensor *delta); /* delta broadcasts */
int kiln_variable_assign_sub(kiln_variable *, const kiln_tensor *delta);

/* Gradient tapes, as TensorFlow Eager's GradientTape. A tape records, while
 * it is active on this thread, every op with a float (f32/f64) result that
 * depends on a tensor it watches. Tapes nest; each sees the ops of the
 * others, so an outer tape records the gradient computation of an inner
 * one (higher-order derivatives). Recorded tensors stay alive until
 * kiln_tape_free; a non-persistent tape lets each go as its gradient's
 * walk passes the op that made it (the walk's own temporaries too, as
 * each op's gradient is done), so a training step's memory shrinks
 * through its backward pass. */
kiln_tape *kiln_tape_begin(bool persistent); /* starts recording; NULL on failure */
void kiln_tape_watch(kiln_tape *, kiln_tensor *); /* NULL/int tensors are ignored */
void kiln_tape_end(kiln_tape *);  /* stops recording; must be the innermost active tape */
void kiln_tape_free(kiln_tape *); /* ends it first if still active; NULL is fine */
/* d(sum of target)/d(source): grads[i] gets a new tensor of sources[i]'s
 * shape and dtype, or NULL where target does not depend on sources[i].
 * A target that is a source gets ones. A non-persistent tape computes one
 * gradient; a second call fails. The gradient may be taken while the tape
 * is still active. reduce_max/min send the gradient to every tied maximum
 * (minimum) in equal parts; argmax, comparisons, floor, ceil, sign and
 * integer results carry none. 0 / -1 (grads all NULL on failure). */
int kiln_tape_gradient(kiln_tape *, kiln_tensor *target, int n, kiln_tensor *const *sources,
                       kiln_tensor **grads);
/* The same with respect to variables read while the tape was active (the
 * gradients of all reads of a variable are summed). */
int kiln_tape_gradient_vars(kiln_tape *, kiln_tensor *target, int n, kiln_variable *const *vars,
                            kiln_tensor **grads);

/* Custom gradient: fwd runs without recording; active tapes record one node
 * whose gradient is grad(). grad writes dxs[i] (NULL = no gradient) and
 * returns 0 or -1; it is itself recorded by outer tapes. */
typedef kiln_tensor *(*kiln_forward_fn)(void *user, int n, kiln_tensor *const *xs);
typedef int (*kiln_gradient_fn)(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y,
                                kiln_tensor *dy, kiln_tensor **dxs);
kiln_tensor *kiln_custom_gradient(kiln_forward_fn fwd, kiln_gradient_fn grad, void *user, int n,
                                  kiln_tensor *const *xs);

typedef struct kiln_optimizer kiln_optimizer;
kiln_optimizer *kiln_sgd_new(double learning_rate); /* v -= lr * g */
/* v -= lr * (m = momentum * m + g), or Nesterov's variant when nesterov */
kiln_optimizer *kiln_sgd_momentum_new(double learning_rate, double momentum, bool nesterov);
/* Adam with bias correction (Kingma and Ba, Algorithm 1) */
kiln_optimizer *kiln_adam_new(double learning_rate, double beta1, double beta2, double epsilon);
/* One step: grads[i] (NULL = skip) must match vars[i]'s dtype and shape. */
int kiln_optimizer_apply(kiln_optimizer *, int n, kiln_variable *const *vars, kiln_tensor *const *grads);
void kiln_optimizer_free(kiln_optimizer *); /* NULL is fine */
/* Creates the optimizer's slots for vars (zeros) without updating anything,
 * as a first apply would (Keras's optimizer.build): then
 * kiln_optimizer_variables lists them, for a checkpoint to be restored into
 * before training resumes. 0 / -1. */
int kiln_optimizer_build(kiln_optimizer *, int n, kiln_variable *const *vars);
/* The optimizer's state as variables, for kiln_checkpoint_save/restore
 * beside the model's: Adam's "adam/m/<var>", "adam/v/<var>" and step count
 * "adam/step"; momentum's "momentum/velocity/<var>"; SGD has none. In name
 * order; at most max written to out (owned by the optimizer); returns the
 * count (-1 on error). The slots of a variable exist from its first apply
 * (or kiln_optimizer_build) on. */
int kiln_optimizer_variables(kiln_optimizer *, int max, kiln_variable **out);

/* safetensors files, keyed by variable name; restore checks names, dtype and
 * shape, and fails cleanly on a truncated or corrupt file. */
int kiln_checkpoint_save(const char *path, int n, kiln_variable *const *vars);
int kiln_checkpoint_restore(const char *path, int n, kiln_variable *const *vars);

/* ------------------------------------------------------------------------
 * 5. Staged functions. A call looks up a trace by each input's dtype, shape
 * and device and the device scope; a miss runs the body once with symbolic
 * tensors (C control flow and side effects happen at trace time only) and
 * keeps the verified IR; every call runs that IR. Concrete tensors the body
 * reaches are captured (retained until kiln_function_free); variables it
 * reads are captured by reference, so a later assignment is seen without
 * retracing (a variable must outlive the functions that read it). Random
 * ops draw afresh at each call, in the order the body made them. Variables
 * assigned in the body are assigned when each call returns, and later reads
 * in the body see the assignment. State creation: the body may create
 * variables during the function's first trace only (an optimizer's slots on
 * its first apply are the common case); then the body is traced once more
 * and that trace is kept (the first is not counted). A later trace that
 * creates a variable fails, naming the function. Variables a body creates
 * are freed with the function, except an optimizer's slots, which stay the
 * optimizer's; an initial value computed from a traced value fails.
 * Reading a traced value in C (kiln_tensor_item, kiln_tensor_read,
 * kiln_tensor_data on a symbolic tensor) fails the whole trace: the call
 * returns -1 naming the function even if the body ignored the error (use
 * kiln_cond / kiln_while_loop for control flow on traced values). An error
 * raised while tracing names the function: "@train_step: matmul: ...". A
 * staged function keeps at most KILN_TRACE_CACHE_MAX traces (default 1024;
 * read when the function is made): a new trace beyond that evicts the least
 * recently used one, and a later call with its signature traces it again
 * (KILN_LOG=retrace logs each eviction). Lookups hash the signature. A
  * staged function called inside another's body is traced on its own and
 * recorded as a call instruction (inlined instead where a tape of the outer
 * body watches its inputs). A call whose input a tape watches runs the
 * staged forward and records one tape node per float output, whose backward
 * is a staged function (it recomputes the forward). Calls run the IR after
 * the pass pipeline as code compiled with LLVM for the CPU (or the GPU
 * whose scope it was traced under; see kiln_function_ir for
 * KILN_BACKEND and KILN_CPU); kiln_function_ir(f, i, "optimized") shows
 * it. Each traced instruction carries loc(file:line) of the op call that
 * made it when the program is compiled with -g (the line comes from its
 * debug info through binutils' addr2line, once per trace and only when IR
 * text is asked for; without either there is no loc). The kiln-opt tool
 * (installed in bin/) reads such text (.kir), runs passes on it and prints
 * it: --emit=dot draws it for Graphviz (dot -Tsvg), --emit=llvm|asm|ptx
 * compiles it. A staged call that
 * reads a float variable while a tape is active fails: pass the value in.
 * ---------------------------------------------------------------------- */

/* The body of a stageable function. It reads in[0..n_in), writes out[0..n_out),
   returns 0 or -1 (with the error set, e.g. by kiln_fail). Outputs may be
   results of ops, the inputs themselves, or captured concrete tensors. */
typedef int (*kiln_body_fn)(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out);

/* NULL name = "f". Thread-safe to call from several threads at once. */
kiln_function *kiln_function_new(const char *name, kiln_body_fn body, void *user, int n_in, int n_out);
/* Writes n_out tensors, owned as op results are; 0, or -1 with the error
 * set (the body's own message when the body failed; no trace is kept).
 * An op that fails while a compiled or interpreted call runs (an index out
 * of range) reads the same either way: "@name: " and the op's own message,
 * e.g. "@f: gather: indices[1] = 7 is not in [0, 3)". */
int  kiln_function_call(kiln_function *, kiln_tensor *const *in, kiln_tensor **out);
void kiln_function_free(kiln_function *);
void kiln_function_set_eager(kiln_function *, bool eager);  /* run the body op by op, for debugging */
/* Lets the optimizer rewrite f's traces for inference, as PyTorch's
 * optimize_for_inference does: a per-channel affine map after a conv2d or
 * a matmul (an inference batch norm: (y - mean) * rsqrt(var + eps) * scale
 * + offset with statistics that do not come from y) is folded into the
 * weights and a bias. Results then differ from the unfolded ones by
 * rounding (and an infinite factor may give NaN). Set it before the first
 * call: 0, or -1 with the error set once f has traces. */
int  kiln_function_set_optimize_for_inference(kiln_function *, bool on);
/* Concrete traces made so far, evicted ones included (a trace made again
   after its eviction counts again). */
int  kiln_function_trace_count(const kiln_function *);

/* Gradients of f's first output (summed) w.r.t. each input, as a new
   stageable function with n_in inputs and n_in outputs (an input the output
   does not depend on gets zeros); value_and_gradients puts the (unsummed)
   first output first (1 + n_in outputs). Composable: kiln_gradients of a
   gradient function gives second derivatives. The new function refers to f:
   free it before f. NULL with the error set. */
kiln_function *kiln_gradients(kiln_function *f);
kiln_function *kiln_value_and_gradients(kiln_function *f);

/* Natural C signatures through libffi (API.md §5). sig is "R:ARGS", one
   letter each: t kiln_tensor*   o kiln_tensor** (an extra output)
   v void (return only)   i int   l int64_t   d double   b bool   p void*.
   The non-tensor letters (i l d b p) are static: their values are part of
   the trace key (doubles by bit pattern, p by pointer identity) of the one
   kiln_function behind the pointer, whose trace count counts the traces of
   every static value. The function is named after fn's symbol where the
   process exports it (dladdr; errors then say "@fn: ..."), else "jit".
   R is t, v or i.
   kiln_jit returns a pointer of fn's own type that stages fn: a call traces
   fn (with symbolic tensors in the t positions) or reuses a trace; the
   function's outputs are the return value (R = t) and then each o slot in
   order, written back through the caller's o pointers (a NULL o pointer
   discards that output). With R = i, fn's non-zero return means failure
   (with the error set) and the jitted call returns 0 or -1. A failed call
   returns NULL (R = t) or -1 (R = i) with the error set and stores NULL
   through the o pointers; with R = v check kiln_last_error() (clear it
   first). A bad sig returns NULL with the error naming the letter. The
   pointer lives until kiln_jit_free. */
typedef void (*kiln_fnptr)(void);
kiln_fnptr     kiln_jit(kiln_fnptr fn, const char *sig);
/* The one function behind a kiln_jit pointer, there from the start. NULL
   with the error set for a pointer not from kiln_jit. Owned by the jitted
   pointer. Called directly (kiln_function_call) a function with static
   arguments fails: their values come through the pointer. */
kiln_function *kiln_jit_function(kiln_fnptr jitted);
/* Frees the closure and its functions (NULL is fine); the pointer must not
   be called afterwards. */
void kiln_jit_free(kiln_fnptr jitted);
#define KILN_JIT(fn, sig) ((__typeof__(&(fn)))kiln_jit((kiln_fnptr)(fn), (sig)))

/* Escape hatch (like TF's py_func): a C callback embedded in staged code.
   Eagerly, kiln_host_call runs fn and checks its outputs against out_specs.
   While tracing it records a host_call instruction: each call of the staged
   function runs fn then, with concrete tensors, and fails with an error
   naming the output when one does not match its spec. fn and user must stay
   valid while the staged function lives. n_out >= 1. The IR prints the
   callback by its symbol name (dladdr); IR read back from text finds the
   callback by that name in the process (user = NULL). Returns 0 / -1. */
typedef struct { kiln_dtype dtype; int rank; int64_t shape[8]; } kiln_spec;
typedef int (*kiln_host_fn)(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out);
int kiln_host_call(kiln_host_fn fn, void *user, int n_in, kiln_tensor *const *in,
                   int n_out, const kiln_spec *out_specs, kiln_tensor **out);
/* The same with a gradient (py_func under a tape). fn runs as a black box:
   the tapes do not record the ops inside it (nor inside grad), so a host
   call without a gradient has none: a tape gradient that needs it fails
   with an error naming the callback ("tape_gradient: host_call @fn has no
   gradient ..."); one that reaches it only through kiln_stop_gradient or
   not at all is fine. grad receives the inputs, the outputs and their
   cotangents dout (the gradient of each output; zeros for an output the
   target does not depend on) and writes din[i] with in[i]'s dtype and
   shape (NULL = none, i.e. zeros). It runs as a host call itself: eagerly
   at kiln_tape_gradient, and in a staged backward pass (kiln_gradients, a
   tape over a staged call) as a host_call instruction at each call; a tape
   differentiating the gradient again fails naming grad. grad may be called
   once per float output that receives a gradient. grad and user must stay
   valid while a staged function holding them lives (each distinct (grad,
   user) pair costs the process one small entry, kept until exit). */
typedef int (*kiln_host_grad_fn)(void *user, int n_in, kiln_tensor *const *in, int n_out,
                                 kiln_tensor *const *out, kiln_tensor *const *dout, kiln_tensor **din);
int kiln_host_call_with_gradient(kiln_host_fn fn, kiln_host_grad_fn grad, void *user,
                                 int n_in, kiln_tensor *const *in, int n_out,
                                 const kiln_spec *out_specs, kiln_tensor **out);

/* ------------------------------------------------------------------------
 * 9. Staged control flow (here beside staging; numbered as in API.md).
 * C control flow runs at trace time and is baked into the trace. Control
 * flow that depends on tensor values, and loops that should compile once
 * instead of being unrolled, use these (TF's cond/while_loop, JAX's
 * lax.cond/while_loop/scan). Branches and bodies are kiln_body_fns.
 * Eagerly they just run (tapes record every iteration, so eager gradients
 * of any loop work); while tracing, each branch or body is traced once into
 * a region of one cond / while / scan instruction (a cond whose predicate
 * is a concrete tensor just runs its branch). Bodies may use tensors of the
 * enclosing trace (through user or globals) and read variables: they become
 * operands of the instruction, as JAX closes over tracers. Random ops draw
 * afresh at each iteration. Gradients (a tape, kiln_gradients, higher
 * orders) go through staged cond and scan, and through a while_loop with
 * max_iterations (staged under a tape as a scan of max_iterations steps
 * that stop updating once cond is false); an unbounded staged while_loop
 * under a tape fails asking for a bound. The backward replays the traced
 * branches and bodies (not the C functions, whose user data may be gone).
 * Bodies may assign variables: staged, each assigned variable is carried
 * through the instruction as extra loop state (a later iteration, and a
 * later read in the body, sees the assignment) and assigned when the call
 * returns. Bodies and branches that draw random numbers are
 * differentiable: the staged forward keeps each step's draws (stacked, as
 * the carries are) and the backward uses them, so the gradient is the one
 * of the numbers drawn, at any depth of nesting (a cond or loop that draws
 * inside another's body or branch: its draws are kept by every body around
 * it). Not yet: a staged while_loop without max_iterations that draws
 * inside a differentiated staged body (it fails clearly, naming the op;
 * eagerly it works). Staged control flow is
 * compiled by the CPU backend: a cond is a branch on its predicate, a
 * while_loop / scan a real loop around one copy of its body's kernels (a
 * scan's xs read, and its ys written, in place at row t), so code and
 * compile time do not grow with the trip count. Under a GPU's scope the
 * CUDA backend runs it from the host: a loop over the body's kernel
 * launches, a cond's or while's predicate read back after the work queued
 * before it (one wait on the GPU per branch or iteration), a scan's rows
 * advanced between launches.
 * ---------------------------------------------------------------------- */

/* pred: bool scalar. Runs then_fn or else_fn on in[0..n); both must return
   n_out tensors with the same dtypes and shapes (checked when staged; the
   error names both). 0 / -1. */
int kiln_cond(kiln_tensor *pred, kiln_body_fn then_fn, kiln_body_fn else_fn, void *user,
              int n, kiln_tensor *const *in, int n_out, kiln_tensor **out);

/* Loop state of n tensors. cond_fn(state) writes one bool scalar; body_fn(state)
   writes the next state (same dtypes and shapes). max_iterations >= 0 stops the
   loop after that many iterations (TF's maximum_iterations) and makes it
   differentiable in reverse mode when staged; -1 = unbounded. */
int kiln_while_loop(kiln_body_fn cond_fn, kiln_body_fn body_fn, void *user,
                    int n, kiln_tensor *const *init, int64_t max_iterations, kiln_tensor **final);

/* body(carry[0..n_carry), x_t[0..n_xs)) writes (carry'[0..n_carry), y_t[0..n_ys)).
   xs are sliced along axis 0 (all the same length; `length` must equal it or
   be -1); with n_xs == 0 the loop runs `length` times. ys are stacked along
   axis 0; with reverse the loop runs from the end and ys[t] still lines up
   with xs[t]. Differentiable (the carries each step received are stacked). */
int kiln_scan(kiln_body_fn body, void *user, int n_carry, kiln_tensor *const *init,
              int n_xs, kiln_tensor *const *xs, int64_t length, bool reverse,
              int n_ys, kiln_tensor **final_carry, kiln_tensor **ys);

/* ------------------------------------------------------------------------
 * 6. Inspecting compiled code. Setting KILN_LOG=retrace prints each retrace
 * after the first to stderr, naming every argument (tensor or static, by
 * its position; dtype, shape, device or value) that differs from the
 * nearest cached trace (the one differing in the fewest arguments), and
 * each eviction from a full trace cache.
 * ---------------------------------------------------------------------- */

/* stage: "traced" (as recorded), "optimized" (after every pass, with fusion
   groups and buffer assignment), "llvm" (the optimized LLVM module calls run)
   or "asm" (its host assembly); "ptx" (the same IR cross-compiled for
   NVIDIA GPUs) works without a GPU; "mlir" (the traced IR as MLIR's func,
   arith, math, linalg, tensor and scf dialects on tensors, which mlir-opt
   parses: API.md section 11; a random op or a host call fails it, naming
   the op). "llvm"/"asm" fail for a trace that runs
   interpreted (KILN_BACKEND=interp, or a GPU trace). trace indexes the
   concrete traces in the order they were made, 0 = first; an evicted
   trace's index fails with an error saying it was evicted. malloc'd text;
   free() it.
   Staged calls run code compiled with LLVM for the host CPU, or for the
   CPU that KILN_CPU names (an LLVM CPU name such as x86-64, x86-64-v2 or
   skylake-avx512) with that CPU's own features: code an older machine, or
   valgrind (KILN_CPU=x86-64-v2), runs; it is part of the disk cache's key.
   The library's own C kernels pick their instruction set at load time from
   the CPU they run on. KILN_BACKEND=
   interp runs the reference interpreter instead; KILN_BACKEND=cpu makes a
   trace the CPU backend (or, under a GPU's scope, the CUDA backend) cannot
   compile an error instead of interpreting it;
   KILN_LOG=compile prints each compile (kernels, ms) to stderr. Compiled
   code is cached on disk in KILN_CACHE_DIR (default $XDG_CACHE_HOME/kiln or
   ~/.cache/kiln; "off" disables it), at most KILN_CACHE_MAX_MB (default 1024). */
char *kiln_function_ir(kiln_function *, int trace, const char *stage);

typedef struct {
  int    traced_ops, optimized_ops, kernels, fused_ops;
  size_t peak_bytes;          /* temporaries after buffer reuse */
  size_t unshared_bytes;      /* temporaries if nothing were reused */
  double trace_ms, optimize_ms, compile_ms;
} kiln_stats;
/* Ops before and after the pass pipeline, kernels of the schedule, ops
   inside fusion groups, temporaries' bytes, and the milliseconds tracing,
   the passes and LLVM (0 for an interpreted trace) took. 0 / -1. */
int kiln_function_stats(kiln_function *, int trace, kiln_stats *out);

/* ------------------------------------------------------------------------
 * 11. Saving and loading staged functions. A saved function is a directory:
 *   manifest.json           format version, Kiln version, per trace its
 *                           signature (each input's dtype, shape, device; the
 *                           device scope; static argument values), outputs,
 *                           constants and variables
 *   trace<k>.kir            trace k's IR as traced (text, source locations)
 *   variables.safetensors   the variables its traces read or write, by name
 *   constants.safetensors   the tensors its traces captured ("trace<k>/<j>")
 * Host calls (kiln_host_call) are saved by their callback's symbol name and
 * bound again by name at load (dlsym): the callback must be an exported
 * symbol (-rdynamic for an executable's) with no user data. Loading runs the
 * callbacks a directory names: load only directories you trust. */
/* Saves every trace f has made so far (a loaded f: every trace it was saved
 * with), atomically: the directory is written beside path and renamed into
 * place, replacing an older saved function there; a failed save leaves
 * nothing. The same function saves to the same bytes. 0 / -1 (no traces yet;
 * a host call without a symbol name or with user data; two variables with
 * one name; the file system). */
int kiln_function_save(kiln_function *f, const char *path);
/* A callable function from a saved one, with variables of its own restored
 * from the directory (kiln_function_variables lists them; they are freed with
 * it). Each saved trace compiles on its first call (through the disk cache of
 * compiled code). A call whose signature matches no saved trace fails with
 * an error listing the saved signatures; static arguments are baked into each
 * trace, so two traces that differ only in them cannot both be called.
 * Gradients (kiln_gradients, tapes) replay the saved IR op by op, for traces
 * without control flow or host calls. NULL with the error set: a missing,
 * truncated or corrupt file, a newer format, a host call whose symbol this
 * process lacks. */
kiln_function *kiln_function_load(const char *path);
/* The variables f owns or its traces read or write, in name order (ties by
 * creation); at most max written to out (f's or their creators'); returns the
 * count (-1 on error). */
int kiln_function_variables(kiln_function *f, int max, kiln_variable **out);

/* ------------------------------------------------------------------------
 * 7. Devices. CPU is always present and listed first. GPUs ("gpu:0", ...)
 * are found at first use through the CUDA driver, libcuda.so.1 (or the
 * library KILN_CUDA_DRIVER names); with no driver or device there are none.
 * An op whose inputs live on another device copies them to where it runs.
 * ---------------------------------------------------------------------- */

int kiln_device_count(void);
/* "cpu:0" first, the GPUs, then on rank 0 the remote devices ("task:1/cpu:0":
   kiln_dist_serve); NULL if out of range */
const char *kiln_device_name(int i);
int kiln_device_push(const char *name);        /* ops run there until the pop; -1 if unknown */
void kiln_device_pop(void);                    /* no-op when nothing was pushed */
const char *kiln_device_current(void);         /* innermost device scope, "cpu:0" by default */
kiln_tensor *kiln_to_device(kiln_tensor *t, const char *name); /* a copy there; t itself if there */

/* ------------------------------------------------------------------------
 * 10. Convolutional networks (API.md §10). Images NHWC, filters HWIO
 * (height, width, in channels per group, out channels); f32 or f64. Errors
 * begin with the op's name: channel mismatch, a window larger than the
 * padded input, negative padding, groups that do not divide the channels.
 * ---------------------------------------------------------------------- */

typedef struct {
  int  stride[2];     /* 0 = 1 */
  int  dilation[2];   /* 0 = 1 */
  int  padding[4];    /* explicit zero padding: top, bottom, left, right */
  bool same;          /* TensorFlow's "SAME" padding; overrides padding */
  int  groups;        /* 0 = 1; depthwise when groups == input channels */
} kiln_conv_opts;     /* NULL opts = stride 1, no padding ("VALID") */

/* x [n, h, w, c], filter [kh, kw, c / groups, o] -> [n, oh, ow, o] with
   oh = (h + pad_top + pad_bottom - (kh - 1) * dilation - 1) / stride + 1
   (SAME: oh = ceil(h / stride), the padding split as TensorFlow does) */
kiln_tensor *kiln_conv2d(kiln_tensor *x, kiln_tensor *filter, const kiln_conv_opts *);
/* The gradient of conv2d w.r.t. its image: x [n, oh, ow, o] (as conv2d's
   result), filter as conv2d's -> [n, out_hw[0], out_hw[1], c]; opts are
   those of the conv2d whose input is out_hw large */
kiln_tensor *kiln_conv2d_transpose(kiln_tensor *x, kiln_tensor *filter, const int64_t out_hw[2],
                                   const kiln_conv_opts *);     /* the gradient of conv2d w.r.t. x */
/* Pooling over windows of window[0] x window[1] (opts: stride, padding or
   SAME; no dilation or groups). Padding on each side must be smaller than
   the window and never counts: max pooling ignores it, average pooling
   divides by the count of image elements in the window (TensorFlow's rule).
   The gradient of max pooling goes to the elements equal to the window's
   max, shared evenly among ties (as reduce_max's); max pooling's gradient
   has no gradient itself (differentiating it twice is an error). */
kiln_tensor *kiln_max_pool2d(kiln_tensor *x, const int window[2], const kiln_conv_opts *);
kiln_tensor *kiln_avg_pool2d(kiln_tensor *x, const int window[2], const kiln_conv_opts *);
/* t padded with value: before[i] and after[i] elements on axis i (>= 0) */
kiln_tensor *kiln_pad(kiln_tensor *t, const int64_t *before, const int64_t *after, double value);
/* (x - mean) * rsqrt(variance + epsilon) * scale + offset, broadcast over the last axis.
   mean, variance, offset and scale broadcast to x (typically [c]); offset
   and scale may be NULL (0 and 1). epsilon >= 0. */
kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *mean, kiln_tensor *variance,
                             kiln_tensor *offset, kiln_tensor *scale, double epsilon);
/* Mean and (biased) variance of x over axes (NULL = all); both kept as 1s
   when keepdims. Writes *mean and *variance only on success. 0 / -1. */
int          kiln_moments(kiln_tensor *x, int naxes, const int *axes, bool keepdims,
                          kiln_tensor **mean, kiln_tensor **variance);
/* x * (u >= rate) / (1 - rate) with u uniform in [0, 1), a new u every call,
   staged calls included; rate in [0, 1), 0 = the identity */
kiln_tensor *kiln_dropout(kiln_tensor *x, double rate);  /* new mask every call, staged too */

/* ---- datasets (API.md §13) ----
 * Input pipelines as tf.data's: a chain of stages pulled one element at a
 * time by kiln_dataset_next. An element is a tuple of tensors (its arity):
 * from_tensors gives n, map its function's outputs, the others keep their
 * input's. Each transform takes over its input chain when it succeeds
 * (freeing the last stage frees them all); given NULL it returns NULL and
 * keeps the error, and when it fails for another reason the caller still
 * owns the input. A dataset is the input of one stage at most, and one
 * thread at a time calls next on a chain (prefetch's own thread aside).
 * Errors from next begin with "kiln_dataset_next: STAGE:". */
typedef struct kiln_dataset kiln_dataset;
/* Element i is row i of each of the n tensors (axis 0 removed); all must
   have rank >= 1 and the same dim 0. Keeps its own references (a copy on
   the host of a GPU tensor). NULL: n <= 0, a NULL or symbolic tensor, a
   scalar, dims 0 that differ. */
kiln_dataset *kiln_dataset_from_tensors(int n, kiln_tensor *const *ts);
/* tf.data's shuffle: a buffer filled with the next buffer_size elements;
   each element given is one drawn uniformly from the buffer, whose slot the
   next upstream element takes. buffer_size >= the data's count makes every
   order equally likely; 1 keeps the order. Draws are Philox-4x32-10 keyed
   by seed: the same seed gives the same orders. Epochs: each time a repeat
   downstream restarts the shuffle (shuffle placed before repeat), it draws
   a new order (tf.data's reshuffle_each_iteration), the same per seed and
   epoch number; placed after repeat it shuffles one long stream across the
   epochs' boundaries. buffer_size >= 1 (a huge one grows as it fills). */
kiln_dataset *kiln_dataset_shuffle(kiln_dataset *, int64_t buffer_size, uint64_t seed);
/* batch_size consecutive elements, each tensor stacked along a new axis 0;
   the last, shorter batch is given unless drop_remainder. An element whose
   tensor j differs from the batch's first in dtype or shape makes next fail
   (naming both); an upstream error drops the batch being gathered.
   batch_size >= 1. */
kiln_dataset *kiln_dataset_batch(kiln_dataset *, int64_t batch_size, bool drop_remainder);
/* The input count times over (-1 = forever; 0 = nothing), restarting it at
   each end. An input that ends without giving an element ends the repeat. */
kiln_dataset *kiln_dataset_repeat(kiln_dataset *, int64_t count);
/* Each element's tensors through the staged function f (n_in = the arity;
   its n_out outputs, at least one, are the new element). f stays the
   caller's: free it after the chain. A failing call makes next return -1
   with an error naming f and the element ("kiln_dataset_next: map: element
   3: @f: ..."); the next call goes on with the following element. f runs
   on the thread that pulls the element: next's caller, or a prefetch's
   thread downstream. */
kiln_dataset *kiln_dataset_map(kiln_dataset *, kiln_function *f);
/* A background thread, started by the first next, runs the input ahead into
   a queue of depth elements (1 <= depth <= 2^20); next takes from it in
   order, blocking while it is empty. Errors and the end come through in
   order, with their messages. The thread uses the device scope next was
   first called in, and on Linux runs as SCHED_BATCH (waking, it does not
   preempt the caller's work it should hide behind). Freeing (or a repeat's
   restart) stops and joins the thread, even while it waits on a full
   queue. */
kiln_dataset *kiln_dataset_prefetch(kiln_dataset *, int depth);
/* The next element into out[0..arity) (new tensors, owned as in section 1),
   the other slots of out[0..n) NULL. 1: an element; 0: the end (again on
   every later call); -1: an error (all of out NULL), as when n < the
   arity. */
int kiln_dataset_next(kiln_dataset *, int n, kiln_tensor **out);
/* Frees the dataset and the chain it was built from; NULL is fine. */
void kiln_dataset_free(kiln_dataset *);

/* ------------------------------------------------------------------------
 * 13 (files, metrics, summaries). NumPy files, running metrics and
 * TensorBoard event files (API.md §13).
 * ---------------------------------------------------------------------- */

/* ---- .npy files ---- */
/* The tensor in a NumPy .npy file (format 1.0, 2.0 or 3.0), owned as any
   op's result. Little- or big-endian; Fortran-order files are transposed
   into Kiln's row-major order. dtypes: f2 f4 f8 -> f16 f32 f64, i4 i8 ->
   i32 i64, b1 -> bool (any nonzero byte is true); narrower and unsigned
   integers widen to the Kiln integer that holds all their values: i1 i2 u1
   u2 -> i32, u4 u8 -> i64 (a u8 value over INT64_MAX is an error). NULL with
   the error set ("load_npy: <path>: ..."): no such file, not a .npy file, a
   header over 64 KiB, a dtype Kiln cannot hold (complex, strings, objects,
   records), more than KILN_MAX_RANK dimensions, data shorter or longer than
   the shape says. */
kiln_tensor *kiln_load_npy(const char *path);
/* Writes t (from any device) to path as NumPy writes it: format 1.0,
   little-endian, row-major, the data 64-byte aligned. Atomic: a temporary
   file beside path renamed over it, so a failed save leaves path as it was.
   bf16 has no NumPy dtype and is refused (kiln_cast it to f32: exact).
   0 / -1 ("save_npy: <path>: ..."; path a directory, a link or a device;
   an unwritable directory; a symbolic tensor). */
int          kiln_save_npy(const char *path, const kiln_tensor *t);

/* ---- metrics ---- */
/* Running means over a loop (tf.keras.metrics). Sums are kept in double. */
typedef struct kiln_metric kiln_metric;
/* The mean of every element of every tensor given (a batch of n elements
   weighs n; any dtype). */
kiln_metric *kiln_metric_mean_new(void);
/* The fraction of examples whose predicted class equals the label's.
   update(labels, predictions): labels [n] i32/i64 class ids or [n, c]
   one-hot (argmax); predictions [n] i32/i64 class ids or [n, c] logits or
   probabilities of any numeric dtype (argmax: the first largest; a row
   holding a NaN predicts no class and counts as wrong). */
kiln_metric *kiln_metric_accuracy_new(void);
/* Adds a batch: a mean takes a (b must be NULL), accuracy takes labels a and
   predictions b. 0 / -1 ("metric_update: ..."; a NULL tensor keeps the
   first error) with the metric unchanged. */
int    kiln_metric_update(kiln_metric *, kiln_tensor *a, kiln_tensor *b);
/* The mean so far; NaN when nothing was added since the creation or reset. */
double kiln_metric_result(const kiln_metric *);
void   kiln_metric_reset(kiln_metric *);   /* forgets everything added */
void   kiln_metric_free(kiln_metric *);    /* NULL is fine */

/* ---- TensorBoard summaries ---- */
/* A writer of logdir/events.out.tfevents.<unix seconds>.<hostname> (with
   ".<pid>.<k>" added when another writer took that name in that second),
   logdir created with its parents. Records are TFRecords (masked CRC-32C)
   of Event protobufs; the first holds file_version "brain.Event:2". Calls
   on one writer may come from any threads. NULL with the error set
   ("summary_writer_new: <logdir>: ...") when logdir cannot be created or
   written. */
typedef struct kiln_summary_writer kiln_summary_writer;
kiln_summary_writer *kiln_summary_writer_new(const char *logdir);
/* A Summary value tag = value (stored as a float: simple_value) at step.
   The tag is non-empty UTF-8 ("loss", "train/accuracy"). 0 / -1. */
int  kiln_summary_scalar(kiln_summary_writer *, const char *tag, double value, int64_t step);
/* A histogram of values' elements (any dtype, any device) as TensorFlow's
   tf.summary.histogram (v1) writes it: HistogramProto with min, max, num,
   sum, sum_squares, and TensorFlow's default bucket edges (0, then +-1e-12
   growing by 10% to 1e20, then +-DBL_MAX; bucket i counts
   [edge[i-1], edge[i])), runs of empty buckets merged into one. A NaN or
   infinity is an error, as in TensorFlow. 0 / -1. */
int  kiln_summary_histogram(kiln_summary_writer *, const char *tag, kiln_tensor *values, int64_t step);
/* Writes buffered records to the file (TensorBoard sees them then). 0 / -1. */
int  kiln_summary_flush(kiln_summary_writer *);
void kiln_summary_writer_free(kiln_summary_writer *); /* flushes and closes; NULL is fine */

/* ------------------------------------------------------------------------
 * 12. Distribution (API.md §12)
 *
 * Processes started by an MPI launcher (mpirun -np 4 ./train) form a world;
 * without a launcher, or in a Kiln built without MPI, the world is this one
 * process and every collective below is an identity (a new tensor equal to
 * t). Kiln talks over its own duplicate of MPI_COMM_WORLD, so the program's
 * own MPI traffic never mixes with it.
 *
 * Joining: kiln_dist_init joins explicitly; the first collective, rank or
 * size call joins implicitly (so a collective never runs in a world of one
 * by mistake). Kiln initializes MPI with MPI_Init_thread (asking for
 * MPI_THREAD_MULTIPLE) unless the program already has; a process's Kiln
 * collectives run one at a time whatever thread level MPI granted.
 *
 * Collectives: every process calls them in the same order with the same
 * dtype, shape, op, axis or root. Before any data moves the ranks compare
 * what each asked for; a mismatch fails on every rank with the same error
 * ("all_reduce: rank 1 has shape (3,) where rank 0 has (4,)") and the world
 * stays usable. A call one rank gets wrong (a NULL input, a bad op) fails
 * there with its own error and on the others naming that rank. A rank that
 * never comes to a collective fails the others after KILN_DIST_TIMEOUT_S
 * seconds (default 60, 0 = wait forever); MPI cannot take back a collective
 * half done, so after a timeout every later collective of that process
 * fails. Results are bit-identical on every rank: float reductions are
 * computed once per element (a reduce-scatter whose parts are then
 * gathered; the sum of two ranks is commutative and reduces in place), and
 * f16/bf16 reduce in f32 and round once. The ops run eagerly and under
 * tapes (staging them is not built yet: a staged function that calls one
 * fails). Tensors on a GPU travel through host memory.
 * ---------------------------------------------------------------------- */

/* Joins the world (initializing MPI if the program has not). Every process
   calls it, or its first collective, together. 0 / -1. */
int  kiln_dist_init(void);
/* This process's rank in [0, size), and the world's size; -1 when joining
   fails. */
int  kiln_dist_rank(void);
int  kiln_dist_size(void);
/* Leaves the world, finalizing MPI if Kiln initialized it (then the process
   cannot join again: MPI starts once). A program that initialized MPI
   itself finalizes it itself, after this. Safe to call twice. */
void kiln_dist_finalize(void);

/* op: "sum", "mean", "max" or "min", elementwise over the ranks' t, the
   result on every rank. Integer "mean" truncates toward zero (i32 sums in
   i64 first); bool takes "max" (or) and "min" (and). Gradient: the world's
   loss is the sum of every rank's loss, so sum's adjoint is all_reduce(sum),
   mean's is all_reduce(mean), and max's and min's go to the elements equal
   to the result, shared equally between the ranks that tie (as
   kiln_reduce_max). Every rank must take the gradient through the same
   collectives. */
kiln_tensor *kiln_all_reduce(kiln_tensor *t, const char *op);
/* The ranks' t concatenated along axis (negative from the end) in rank
   order; rank >= 1. Gradient: reduce_scatter(sum) of the result's gradient. */
kiln_tensor *kiln_all_gather(kiln_tensor *t, int axis);
/* t split along axis into size equal blocks (an error when size does not
   divide it); rank r gets block r reduced with op over the ranks. Gradient:
   sum's is all_gather, mean's all_gather / size, max's and min's as in
   kiln_all_reduce. */
kiln_tensor *kiln_reduce_scatter(kiln_tensor *t, int axis, const char *op);
/* root's t on every rank (root in [0, size)). Gradient: the sum of the
   ranks' gradients on root, zeros elsewhere. */
kiln_tensor *kiln_broadcast_from(kiln_tensor *t, int root);

/* Serves this process's devices to rank 0 (remote devices, the TF Eager
   paper's §4.5) until rank 0 calls kiln_dist_finalize: then returns 0 (call
   kiln_dist_finalize here too). Ranks >= 1 only; -1 on rank 0, in a world
   of one process, or when rank 0 stops answering.
   How rank 0 learns who serves: kiln_dist_serve announces this rank's
   devices to rank 0 as it starts. On rank 0 they are listed after the local
   devices as "task:K/cpu:0" and "task:K/gpu:G" (K this rank) once their
   announcement has arrived (kiln_device_count takes those that have);
   naming one (kiln_device_push, kiln_to_device) waits for rank K's
   announcement up to KILN_DIST_TIMEOUT_S, and is an unknown device, saying
   why, in a world of one process or for a rank that does not serve.
   Under kiln_device_push("task:K/cpu:0") each op runs on rank K with its
   eager dispatcher and staged calls run there compiled by its JIT (the
   trace's .kir text travels once per worker, then only tensors); results
   stay there (kiln_tensor_device says where, kiln_tensor_data is NULL)
   until kiln_tensor_read, kiln_tensor_item or kiln_to_device brings them
   back; inputs from elsewhere are sent. Releasing a remote tensor frees it
   there (with the next request). An error there comes back as the op's
   message and " (on task:K/cpu:0)". A worker that does not answer within
   KILN_DIST_TIMEOUT_S fails that request, and its devices stay unusable.
   Every process must run the same Kiln build (checked at the
   announcement); constructors (kiln_zeros, kiln_tensor_new ...) make host
   tensors; random draws in a staged call use the worker's generator; a
   serving rank takes part in no collective. Between rank 0's
   kiln_dist_finalize and the others', every rank that does not serve waits
   for rank 0's word (up to KILN_DIST_TIMEOUT_S), so that no message is
   left behind. tools/kiln-worker is this call as a program:
   mpirun -np 1 ./train : -np 2 kiln-worker. */
int kiln_dist_serve(void);

/* Averages grads[0, n) across the world in place: grads[i] becomes the
   mean of every rank's grads[i] (a new tensor, owned as any result; the old
   one is released when no scope is open, so the caller keeps exactly one
   reference, and otherwise left to its scope). NULL entries stay NULL and
   must be NULL on every rank. Float dtypes only. Tensors are packed by
   wire dtype (f16/bf16 as f32) into fusion buffers of at most
   KILN_DIST_FUSION_BYTES (default 64 MiB; a larger tensor goes alone), one
   all-reduce each. In a world of one nothing changes. 0 / -1 (grads
   unchanged). */
int kiln_dist_average_gradients(int n, kiln_tensor **grads);
/* Assigns root's value of each of vars to every rank's (same names
   are not needed: the order, dtypes and shapes must match). 0 / -1. */
int kiln_dist_sync_variables(int n, kiln_variable *const *vars, int root);

/* ------------------------------------------------------------------------
 * Debugging and tests
 * ---------------------------------------------------------------------- */

/* Tensors alive in the whole process (headers, views included). */
int64_t kiln_debug_live_tensors(void);
/* Traces held by every staged function's cache, evicted ones not yet freed
   included (for tests of the cache bound). */
int64_t kiln_debug_live_traces(void);
/* Worker threads the eager kernels may use, the caller included (>= 1). */
int kiln_num_threads(void);

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
#ifdef __cplusplus
}
#endif
#endif /* KILN_H */
