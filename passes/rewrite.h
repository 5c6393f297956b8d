/* rewrite.h — what the passes share: a builder that writes a new body for a
 * function while the old one is read (old values map to new ones), then
 * swaps it in; the predicates that say which instructions a pass may touch;
 * and readers of constant operands. Internal to passes/. */
#ifndef KILN_PASS_REWRITE_H
#define KILN_PASS_REWRITE_H

#include "passes.h"

/* Rewriting f: the new body is a detached ir_func (f's name and module, not
 * in the module's list) built with ir_append; map[v] is the new value of old
 * value v, or -1. Parameters map to themselves. */
typedef struct pass_builder {
  ir_func *old;
  ir_func body;
  ir_value *map; /* old->n_values entries */
} pass_builder;

/* Starts a new body for f with f's parameters (types and names). 0 / -1. */
int pass_begin(pass_builder *b, ir_func *f);
/* Appends op(in) to the new body (in are new values); the first result, or
 * -1 with the error set. */
ir_value pass_emit(pass_builder *b, op_id op, const op_attrs *a, int n, const ir_value *in, ir_loc loc);
/* A constant holding (a new reference to) t. */
ir_value pass_emit_constant(pass_builder *b, kiln_tensor *t, ir_loc loc);
/* Copies old instruction ins into the new body with its operands mapped,
 * its results named as before, and maps its results; the first new result,
 * or -1 with the error set (an operand without a new value included). */
ir_value pass_copy(pass_builder *b, const ir_instr *ins);
/* Maps old value v to new value r (an existing value, or fresh: made for v,
 * when r takes v's name). 0 / -1. */
int pass_replace(pass_builder *b, ir_value v, ir_value r, bool fresh);
/* The new value of old value v (-1 if none yet). */
static inline ir_value pass_map(const pass_builder *b, ir_value v) {
  return v >= 0 && v < b->old->n_values ? b->map[v] : -1;
}
/* Replaces f's body by the new one (results mapped), frees the old body and
 * the builder. 0, or -1 with the error set and f unchanged (builder freed). */
int pass_commit(pass_builder *b);
/* Frees the builder and the new body; f unchanged. */
void pass_abort(pass_builder *b);
/* The end of a pass: commits the new body if the pass changed anything, else
 * drops it (f, its value numbers and any arena plan stay as they were).
 * 0, or -1 with the error prefixed by pass. */
int pass_finish(pass_builder *b, bool changed, const char *pass);

/* Prefixes the current error with "<pass>: " unless it already starts so;
 * returns -1. */
int pass_fail(const char *pass);

/* ---- what a pass may touch ---- */
/* An instruction the passes understand: one result, an op of a known kind
 * other than random, call or host call. Its result depends only on its
 * operands and attributes, and running it has no effect: it may be folded,
 * merged or removed. */
bool pass_is_pure(const ir_instr *ins);
/* A function none of whose instructions (transitively, through calls) has an
 * effect or is unknown: a call of it is pure. */
bool pass_func_is_pure(const ir_func *f);

/* Can ins fail at run time on some values of its operands (in f)? A
 * gather or scatter_add (an index out of range), an integer div or mod
 * whose divisor is not a constant free of zeros, and anything not
 * pure. Work that may run where the program would not have run it
 * (hoisted out of a branch, or out of a loop that may not run) must not. */
bool pass_can_fail(const ir_func *f, const ir_instr *ins);

/* ---- sameness (same.c) ---- */
/* The attribute fields ops.def names for an op, as a mask. */
enum {
  PASS_F_DTYPE = 1 << 0,
  PASS_F_SHAPE = 1 << 1, /* shape and size: rank + shape[] */
  PASS_F_BEGIN = 1 << 2,
  PASS_F_AXES = 1 << 3, /* axes and perm: naxes + axes[] */
  PASS_F_AXIS = 1 << 4,
  PASS_F_KEEPDIMS = 1 << 5,
  PASS_F_LO = 1 << 6,
  PASS_F_HI = 1 << 7,
  PASS_F_SEED = 1 << 8,
  PASS_F_COUNTER = 1 << 9,
  PASS_F_VALUE = 1 << 10,
  PASS_F_STRIDE = 1 << 11,
  PASS_F_DILATION = 1 << 12,
  PASS_F_PADDING = 1 << 13,
  PASS_F_GROUPS = 1 << 14,
  PASS_F_WINDOW = 1 << 15,
  PASS_F_CALLEE = 1 << 16,  /* call, fusion: compared by pass_same_func */
  PASS_F_STATE = 1 << 17,   /* state, carry: n_state */
  PASS_F_XS = 1 << 18,      /* n_xs */
  PASS_F_TRIP = 1 << 19,    /* length, max_iterations: trip */
  PASS_F_REVERSE = 1 << 20,
  PASS_F_UNKNOWN = 1 << 30, /* a field not known here: never the same */
};
unsigned pass_attr_fields(op_id op);
/* Are the fields m (pass_attr_fields) of a and b the same? Never with
 * PASS_F_UNKNOWN; callees and regions are not compared here. */
bool pass_same_attrs(unsigned m, const op_attrs *a, const op_attrs *b);
/* Same dtype, shape and bytes (or the same tensor). */
bool pass_same_tensor(const kiln_tensor *a, const kiln_tensor *b);
/* Do pure functions a and b compute the same results from the same
 * arguments, instruction for instruction (ops, operands, attributes,
 * types, constants, callees and regions compared the same way, nested)?
 * False when either draws random numbers or calls the host. */
bool pass_same_func(const ir_func *a, const ir_func *b);
/* Does x of fx compute what y of fy does, when x's operands correspond to
 * in_y (values of fy)? Op, attributes, result types, and callees or regions
 * by pass_same_func; never for random draws or host calls. */
bool pass_same_instr(const ir_func *fx, const ir_instr *x, const ir_func *fy, const ir_instr *y,
                     const ir_value *in_y);

/* ---- control flow (cond, while, scan: regions) ----
 * A region belongs to one instruction. A pass that rebuilds a control
 * instruction with other regions makes new ones (pass_region_rebuild,
 * pass_region_clone); pass_commit then empties the old regions no
 * instruction of the new body reaches (they stay in the module as empty
 * functions marked region, which nothing prints or runs). */
static inline bool pass_is_control(const ir_instr *ins) {
  return (unsigned)ins->op < OP_COUNT && kiln_ops[ins->op].kind == OPK_CONTROL;
}
/* Must ins run even when nothing reads its values? Random draws, host
 * calls, unknown ops, and calls and control flow whose callees or regions
 * (transitively) hold one of those. */
bool pass_has_effect(const ir_instr *ins);
/* Which values and instructions of g are needed to compute its results
 * marked in keep_result (NULL = all), effects included: live_val has
 * g->n_values entries, live_ins g->n_instrs (either may be NULL). 0 / -1. */
int pass_live(const ir_func *g, const bool *keep_result, bool *live_val, bool *live_ins);
/* A new region of src's module (named after src: @src.1, @src.2, ...)
 * made from src: its parameters are those of src marked in keep_param
 * (NULL = all), then n_extra more of types extra; extra_for[k] (when not
 * NULL and >= 0) is the value of src the k-th extra parameter replaces.
 * It copies src's instructions marked in copy (NULL = all), whose operands
 * must then have a value, and returns the results of src marked in
 * keep_result (NULL = all). Nested control flow keeps its regions (src is
 * to be dropped). NULL with the error set. */
ir_func *pass_region_rebuild(const ir_func *src, const bool *keep_param, int n_extra, const op_type *extra,
                             const ir_value *extra_for, const bool *copy, const bool *keep_result);
/* A deep copy of region src as a new region of module m: nested regions
 * are copied too, called functions shared. NULL with the error set. */
ir_func *pass_region_clone(ir_module *m, const ir_func *src);
/* ins's attributes with every region replaced by a deep copy (for an
 * instruction copied into a second place). 0 / -1. */
int pass_clone_regions(ir_module *m, const ir_instr *ins, op_attrs *a);

/* ---- constants ---- */
/* The largest constant a pass makes from something that was not one (fold's
 * results, simplify's broadcast of a scalar): larger ones stay a broadcast or
 * an iota of a small operand, which costs no memory and fuses. */
enum { PASS_CONST_MAX_ELEMS = 1024 };
/* The tensor of the constant defining v in f, or NULL. */
const kiln_tensor *pass_const(const ir_func *f, ir_value v);
/* The value every element of v has, when v is a constant (or a broadcast or
 * reshape of one) whose elements are all the same bits; false otherwise.
 * *bits gets the element's bytes (up to 8), *val its value as a double. */
bool pass_splat(const ir_func *f, ir_value v, double *val, uint64_t *bits);
/* Elements in a value of type t. */
int64_t pass_elems(const op_type *t);
/* A new tensor of type t, every element v (converted as kiln_cast does);
 * NULL on error. Owned by the caller. */
kiln_tensor *pass_filled(const op_type *t, double v);

#endif
