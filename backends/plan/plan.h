/* plan.h — the plan of a compiled function, one for every backend (XLA's
 * thunk sequence is the model): each IR value gets a place (a slot: a
 * parameter, a result, an arena offset, a constant, or the slot of the value
 * a view reads) and each instruction a step over slots: a kernel (fusible
 * instructions evaluated together per output element), a call (an op the
 * backend's runtime or a library runs over whole buffers) or a copy into a
 * result's buffer. Calls, and fusions that are not one kernel, are inlined.
 * Where backends decide differently (what one kernel may hold, which ops are
 * calls) the planner asks the backend's plan_policy. The CPU backend
 * (backends/cpu) and the CUDA backend (backends/cuda) emit code from it.
 * Internal to the library; plan_build and plan_free are exported for the
 * tests. */
#ifndef KILN_PLAN_H
#define KILN_PLAN_H

#include "ir.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A place of a value. A row is row t of another slot's bytes (index), t
 * the iteration of the innermost SCAN step listing the row in its slots:
 * the bytes at index's place + t * offset (a scan's xs read, and its ys
 * written, in place). */
enum { PLAN_SLOT_PARAM, PLAN_SLOT_RESULT, PLAN_SLOT_ARENA, PLAN_SLOT_CONST, PLAN_SLOT_ROW };
/* the operands of a call with an epilogue: two, the bias, a residual */
enum { PLAN_EPILOGUE_OPS = 4 };
typedef struct plan_slot {
  int kind;
  int index;              /* parameter or result; row: the slot it is a row of */
  int64_t offset;         /* arena: byte offset; row: bytes per row */
  const kiln_tensor *cst; /* constant (the IR's; a backend retains what it keeps) */
} plan_slot;

/* A kernel: instructions of f evaluated together per output element, or one
 * instruction the backend has a kernel of its own for (special). */
typedef struct plan_kernel {
  const ir_func *f;
  bool *member; /* per instruction of f */
  int *leaf;    /* per value of f: the slot it is read from, or -1 */
  int n_out;
  ir_value *out; /* the values it stores, all of one shape (or reductions of one input shape) */
  int *out_slot;
  /* the last n_side outputs, after a reduction kernel's reductions: values
   * of the reductions' input shape, each element stored as the reductions
   * read it (llvm_fusion_one_kernel's side outputs) */
  int n_side;
  op_id op;                /* the instruction it computes (fusion for a fusion's body), for messages */
  const ir_instr *special; /* PLAN_AS_SPECIAL: that instruction (of f), its inputs leaves */
  /* a reduction split in two (plan_policy.split): 1 the first pass (into
   * partials in the arena, or into its outputs when not split), 2 the pass
   * that combines the partials, each read as the leaf of its reduction's
   * value; 0 a kernel of one pass */
  int pass;
} plan_kernel;

/* An op that a call step runs over whole buffers (the backend's runtime:
 * an eager kernel, a library, a host callback). */
typedef struct plan_call {
  op_id op;
  op_attrs attrs; /* the instruction's: attrs.host points into the IR's module */
  int n_in, n_out;
  op_type *in_types, *out_types; /* as the buffers hold them (a transposed operand: its own type) */
  /* a dot or conv2d with a bias (in[2]), maybe a residual (in[3]) and an
   * activation applied as it stores (plan_policy.dot_epilogue's code; 0 =
   * a plain one) */
  int epilogue;
  /* a dot whose operands are given as they lay before the transposes the IR
   * had (in[0] is [k, m], in[1] is [n, k]): those transposes are never made */
  bool trans_a, trans_b;
} plan_call;

enum {
  PLAN_STEP_KERNEL, /* kernels[index] */
  PLAN_STEP_CALL,   /* calls[index] over slots: its outputs, then its inputs */
  PLAN_STEP_COPY,   /* bytes from slots[1] into slots[0] (a result computed elsewhere) */
  /* The CPU backend's overlap pass (backends/cpu/overlap.c): the call step
   * of calls[index] earlier in the same list started a collective, which
   * this step waits for; slots are the call's (its outputs, then inputs) */
  PLAN_STEP_WAIT,
  /* Control flow: nested step lists (sub[0], sub[1], of n_sub[0], n_sub[1]
   * steps) over this plan's slots and kernels: buffers are planned once
   * for the whole function, loop bodies included, as XLA's WhileThunk holds
   * sequences over one buffer assignment. A region's temporaries lie past
   * the buffers pass's arena (nothing live across the instruction shares
   * them); its parameters are the slots of the state and of the captured
   * operands. The carried state lives in the instruction's result slots:
   * copied in before the loop, read in place by the body, whose results
   * (fresh slots) the body's last steps copy back (a result that is its own
   * parameter needs no copy; nor one a kernel stores over the state's slot
   * itself, where plan_policy.state_in_place allows).
   * - COND: slots[0] the predicate (a bool scalar); sub[0] runs when it is
   *   true, sub[1] when false; both leave their results in the same slots
   *   (computed there, or copied by their last steps).
   * - WHILE: sub[0] computes the predicate into slots[0]; while it is true
   *   sub[1] (the body) runs and sub[0] again; trip is the bound (max
   *   iterations, -1 none).
   * - SCAN: sub[0], the body, runs trip times (t = 0 .. trip-1, or down
   *   from trip-1 with reverse); slots are the rows (PLAN_SLOT_ROW) taken at
   *   row t each iteration: the xs' rows the body reads, the ys' rows it
   *   writes its outputs into. */
  PLAN_STEP_COND,
  PLAN_STEP_WHILE,
  PLAN_STEP_SCAN,
};
typedef struct plan_step {
  int kind;
  int index;   /* kernel or call */
  int n_slots; /* call: outputs, then inputs; copy: destination, source */
  int *slots;
  int64_t bytes;            /* copy */
  struct plan_step *sub[2]; /* control flow (above) */
  int n_sub[2];
  int64_t trip;
  bool reverse; /* scan */
  /* WHILE and SCAN under plan_policy.swap_state (else 0 and NULL): no copy
   * back; at the end of each iteration, all at once, slot move[2i] takes
   * the place (the pointer) slot move[2i + 1] had: a state slot the place
   * of the body's new value (another state's, a temporary's, its row of
   * ys), a temporary a place no state holds any more (double buffering).
   * After the loop each state slot state[k] whose place moved has its
   * bytes (state_bytes[k]) copied back to its own, through scratch[k]
   * first where that is a slot (>= 0: the place may be another state's
   * own, so every such copy out comes before any copy back); every slot
   * moved gets its own place back. */
  int n_state, n_move;
  int *state, *move, *scratch;
  int64_t *state_bytes;
} plan_step;

/* How each result is produced: written by the steps into its own buffer,
 * or an argument / constant / earlier result returned again. */
enum { PLAN_RES_OWN, PLAN_RES_PARAM, PLAN_RES_CONST, PLAN_RES_SAME };
typedef struct plan_result {
  int kind;
  int index;        /* parameter or earlier result */
  kiln_tensor *cst; /* PLAN_RES_CONST (the IR's) */
} plan_result;

/* How an instruction that is no constant, view, call or fusion runs
 * (plan_policy.place). */
typedef enum { PLAN_AS_UNSUPPORTED, PLAN_AS_KERNEL, PLAN_AS_SPECIAL, PLAN_AS_CALL } plan_as;

/* What a backend decides. The hooks that may be NULL leave their feature out. */
typedef struct plan_policy {
  const char *who;         /* the errors' prefix: "cpu", "cuda" */
  const char *unsupported; /* an op it cannot run is "<op> <unsupported>" */
  /* a kernel of the instruction alone, a kernel of the backend's own, a
   * call, or unsupported */
  plan_as (*place)(const ir_func *f, const ir_instr *in);
  /* whether a fusion's body is one kernel (else it is inlined) */
  bool (*fusion_one_kernel)(const ir_func *c);
  /* whether dot (or conv2d) in of fusion body c runs just before the
   * body's kernel, into a temporary the kernel reads, as it would run
   * alone: a call, or a kernel of the backend's own where place says
   * PLAN_AS_SPECIAL (NULL: never) */
  bool (*dot_before_kernel)(const ir_func *c, const ir_instr *in);
  /* whether fusion body c is one call of its first instruction (a dot or a
   * conv2d) with an epilogue (its code in epi), ops the body's parameters
   * that are that instruction's operands, the bias and a residual added
   * after it (-1: none) (NULL: never) */
  bool (*dot_epilogue)(const ir_func *c, ir_value ops[PLAN_EPILOGUE_OPS], int *epi);
  /* of the lone transposes cand (of a dot call's operands of types a and b;
   * either NULL), those the call reads in place, in t; false for none (NULL:
   * never) */
  bool (*dot_transposes)(const op_type *a, const op_type *b, const ir_instr *const cand[2], const ir_instr *t[2]);
  /* how a kernel's reduction is split (plan_kernel.pass): 0 one pass; 1 the
   * first pass alone; n >= 2 a first pass writing n partials of 8 bytes per
   * output element into the arena, and a second that combines them (NULL:
   * every kernel is one pass) */
  int64_t (*split)(const plan_kernel *k);
  /* whether kernel k of a loop's body may store a new carry over the
   * state's own slot (the state read only at the element it stores, the
   * planner checks: the backend's kernel must load all it reads of an
   * element before storing any of its outputs); then no step copies that
   * carry back each iteration (NULL: every carry is copied back) */
  bool (*state_in_place)(const plan_kernel *k);
  /* whether the backend moves a loop's state between buffers at each
   * iteration's end (plan_step.move) instead of copying it back (NULL:
   * copies) */
  bool (*swap_state)(void);
  /* whether scan in (of f), whose body plan_scan_elementwise accepts, runs
   * as one kernel of the backend's own (special = in: the scan's operands
   * its leaves, its results its outputs) that loops over t inside, per
   * element (NULL: never; a scan is then a SCAN step) */
  bool (*scan_one_kernel)(const ir_func *f, const ir_instr *in);
} plan_policy;

typedef struct plan {
  const ir_func *f;
  const plan_policy *policy;
  plan_slot *slots;
  int64_t *slot_bytes; /* per slot: an arena slot's bytes from its offset (else 0) */
  int n_slots, cap_slots;
  int *vslot; /* per value of f */
  plan_kernel *kernels;
  int n_kernels;
  plan_call *calls;
  int n_calls;
  plan_step *steps;
  int n_steps;
  plan_result *results; /* per result of f */
  /* Every constant the plan meets (kernels' members included), in order, a
   * tensor met twice listed twice: the same IR lists the same constants in
   * the same order in any process (the CPU's cached code names them so). */
  const kiln_tensor **consts;
  int n_consts, cap_consts;
  /* the arena: the buffers pass's places first, then values it did not
   * place; then every arena slot placed anew by liveness (arena.c) */
  size_t arena_bytes;
  size_t arena_unpacked; /* before the slots were placed anew (for the tests' figures) */
  /* planning */
  int *result_of;    /* per value of f: the first result that returns it, or -1 */
  bool *result_done; /* per result: its buffer is taken */
  const ir_func *dest_f; /* a region being planned, whose values dest (per value, or -1) are placed in given slots */
  int *dest;
} plan;

/* Plans f (verified) under policy into pl (whose old contents are
 * ignored). 0, or -1 with "<who>: ..." in the error; pl is freed with
 * plan_free either way. */
KILN_EXPORT int plan_build(plan *pl, const ir_func *f, const plan_policy *policy);
KILN_EXPORT void plan_free(plan *pl); /* a second call does nothing */

/* Appends t, retained, to the n tensors of *list unless it is one of them
 * (a program keeps each constant it reads once). 0, or -1 out of memory
 * (no error set: the backend says it). */
int plan_keep_const(kiln_tensor ***list, int *n, const kiln_tensor *t);

/* The alignment (a power of two, at most KILN_ALIGN) of slot s's bytes:
 * KILN_ALIGN but for rows, at the alignment of their row size. */
KILN_EXPORT int64_t plan_slot_align(const plan *pl, int s);

/* For each value v of g's function, whether g evaluates v only at the
 * index of the element it stores (at, per value): v is an output, or every
 * member reading it is elementwise over v's shape and such a value itself.
 * A kernel that reads a buffer only at such values may store over it. */
KILN_EXPORT void plan_at_store_index(const plan_kernel *g, bool *at);

/* Whether scan in (of f) is elementwise along its rows: one or more
 * carries, and its xs rows and ys rows, all of one shape; every value of
 * its body (of at most max_instrs instructions, fusions' included) that
 * depends on a carry or an xs row is of that shape and made by elementwise
 * ops (or fusions of them); the rest (constants, captures, their views and
 * broadcasts) is read wherever. Then each element of the results depends
 * only on the same element of the carries and rows across t. */
KILN_EXPORT bool plan_scan_elementwise(const ir_func *f, const ir_instr *in, int max_instrs);

/* Whether dot or conv2d in, of fusion body c, can run apart just before
 * the body's kernel, into a temporary the kernel reads
 * (plan_policy.dot_before_kernel): its operands are the body's parameters
 * and it is no result of the body. */
bool plan_head_apart(const ir_func *c, const ir_instr *in);

/* elements and bytes of a value of type t */
int64_t plan_type_size(const op_type *t);
int64_t plan_type_bytes(const op_type *t);

#ifdef __cplusplus
}
#endif
#endif
