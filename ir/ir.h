/* ir.h — Kiln's SSA IR: modules of functions, each one block of
 * instructions in topological order over values with static types. Ops are
 * those of ir/ops.def; their attributes are the op_attrs fields the table
 * names, and their result types come from the table's inference rules.
 * Internal to the library; the entry points are exported (KILN_EXPORT) for
 * kiln-opt and the tests. */
#ifndef KILN_IR_H
#define KILN_IR_H

#include <stdio.h>

#ifdef __cplusplus
/* runtime.h declares the tensor with C11 atomics; C++ tests spell them so */
#include <atomic>
using atomic_int = std::atomic_int;
extern "C" {
#endif

#include "ops.h"

typedef int32_t ir_value; /* index into the function's value table; -1 = none */

typedef struct ir_loc {
  const char *file; /* interned in the module; NULL = unknown */
  int line;
} ir_loc;

typedef struct ir_instr {
  op_id op;
  op_attrs attrs; /* attrs.value (constant) holds a reference owned by the IR */
  int n_in;
  ir_value *in;
  ir_value out; /* the first result; results are the values out .. out+n_out-1 */
  int n_out;    /* 1, except for call, fusion and host_call (>= 1) */
  ir_loc loc;
} ir_instr;

typedef struct ir_module ir_module;

/* The callback of a host_call (kiln_host_call while tracing). The module
 * owns it. fn is NULL when the IR was read from text and no symbol of that
 * name exists in the process: running it then fails. */
typedef struct ir_host {
  kiln_host_fn fn;
  void *user;
  char *name;    /* printed @name: the callback's symbol, or "host" */
  int n_out;
  op_type *out;  /* the declared type of each output */
} ir_host;

typedef struct ir_func {
  char *name;
  ir_module *module;
  int n_params; /* parameters are values 0 .. n_params-1 */
  int n_results;
  ir_value *results;
  op_type *types; /* type of each value */
  int32_t *def;   /* defining instruction of each value; -1 for parameters */
  char **names;   /* each value's name (without %), or NULL: printed as a number */
  int n_values, cap_values;
  ir_instr *instrs;
  int n_instrs, cap_instrs;
  /* The arena plan of the buffers pass (passes/buffers.c): each value's
   * byte offset in one arena, -1 for values outside it (parameters,
   * results, constants); NULL when there is no plan. Any change of the
   * values or results drops it. */
  int64_t *buf_offset;
  int64_t arena_bytes; /* max over planned values of offset + ir_buf_bytes */
  /* A region of one control-flow instruction (cond, while, scan): printed
   * nested under it, never on its own. */
  bool region;
} ir_func;

struct ir_module {
  ir_func **funcs;
  int n_funcs, cap_funcs;
  char **files; /* interned source file names */
  int n_files, cap_files;
  ir_host **hosts;
  int n_hosts, cap_hosts;
};

/* ---- building (ir.c). Errors go to kiln_last_error(). ---- */
KILN_EXPORT ir_module *ir_module_new(void);
KILN_EXPORT void ir_module_free(ir_module *); /* frees its functions; NULL is fine */
/* A new function of the module with parameters of the given types; NULL if
 * the name is empty or already used, or a type is invalid. */
KILN_EXPORT ir_func *ir_func_new(ir_module *, const char *name, int n_params, const op_type *params);
KILN_EXPORT ir_func *ir_module_find(const ir_module *, const char *name);
/* Frees the functions added to m after its first keep (undoing a failed
 * rewrite that added some); nothing may call them. */
KILN_EXPORT void ir_module_truncate(ir_module *m, int keep);
/* Frees what f's body owns (operand lists, constant references, names, the
 * value and instruction arrays) but not f itself, its name or its plan: for
 * passes that swap a new body in. */
KILN_EXPORT void ir_func_free_body(ir_func *f);
/* Appends op(in) with attrs (NULL = none); checks arity, the op's dtypes and
 * attributes, and infers the result type with the op table's rule. A
 * constant's attrs->value is retained. loc.file is interned. Returns the
 * result value, or -1 with the error set. */
KILN_EXPORT ir_value ir_append(ir_func *, op_id op, const op_attrs *attrs, int n_in, const ir_value *in,
                               ir_loc loc);
/* A host callback owned by m (name copied; NULL = "host"); NULL on error. */
KILN_EXPORT ir_host *ir_module_add_host(ir_module *m, kiln_host_fn fn, void *user, const char *name, int n_out,
                                        const op_type *out);
/* For call/fusion/host_call and control flow, ir_append appends one
 * instruction with n_out results and returns the first; the others follow
 * it. The regions of a control-flow instruction are marked region. */
/* Appends a constant holding (a reference to) t. */
KILN_EXPORT ir_value ir_constant(ir_func *, kiln_tensor *t, ir_loc loc);
/* The function's results (copied); each must be a value of f. */
KILN_EXPORT int ir_set_results(ir_func *, int n, const ir_value *results);
/* Names a value (printed %name): [A-Za-z_][A-Za-z0-9_.]*, unique in f. */
KILN_EXPORT int ir_set_name(ir_func *, ir_value v, const char *name);
KILN_EXPORT const char *ir_intern_file(ir_module *, const char *file);
/* The op table entry (the table itself is not exported). */
KILN_EXPORT const op_info *ir_op_info(op_id op);
/* "f32[2,3]" into buf; returns buf. */
KILN_EXPORT char *ir_type_str(char *buf, size_t n, const op_type *t);
/* Checks one application as ir_append does and writes its type: the shared
 * rule of the builder, the parser and the verifier. 0 / -1. */
KILN_EXPORT int ir_check_op(op_id op, const op_attrs *attrs, int n_in, const op_type *in, op_type *out);
/* ir_check_op for any op, call/fusion/host_call included: writes the number
 * of results and a malloc'd array of their types. m is the module the
 * instruction belongs to (a callee must be one of its functions). */
KILN_EXPORT int ir_check_instr(const ir_module *m, op_id op, const op_attrs *attrs, int n_in, const op_type *in,
                               int *n_out, op_type **out);
/* The regions of a control-flow instruction (cond: then, else; while:
 * cond, body; scan: body) into r; returns how many (0 for other ops). */
static inline int ir_regions(const ir_instr *in, const ir_func *r[2]) {
  if ((unsigned)in->op >= OP_COUNT || kiln_ops[in->op].kind != OPK_CONTROL) return 0;
  r[0] = in->attrs.callee;
  r[1] = in->attrs.callee2;
  return r[1] ? 2 : 1;
}
/* The instruction defining value v (NULL for parameters). */
static inline const ir_instr *ir_def(const ir_func *f, ir_value v) {
  return v >= 0 && v < f->n_values && f->def[v] >= 0 ? &f->instrs[f->def[v]] : NULL;
}

/* ---- copies (ir.c) ---- */
/* which functions a copy has made so far (so each is copied once) */
typedef struct ir_clone_memo {
  const ir_func **src;
  ir_func **dst;
  int n, cap;
} ir_clone_memo;
/* Copies src into m, after the functions it calls (each once per memo), as
 * @name, or @name.1, @name.2 ... when m has that name already; host
 * callbacks are copied into m. NULL with the error set. */
KILN_EXPORT ir_func *ir_clone_func(ir_module *m, const ir_func *src, ir_clone_memo *memo);
KILN_EXPORT void ir_clone_memo_free(ir_clone_memo *memo);
/* A deep copy (same function names); NULL with the error set. */
KILN_EXPORT ir_module *ir_module_clone(const ir_module *src);

/* ---- buffer plans ---- */
enum { IR_BUF_ALIGN = 64 }; /* every planned buffer starts at a multiple of this */
/* Bytes of a value of type t. */
static inline int64_t ir_type_bytes(const op_type *t) {
  int64_t n = (int64_t)kiln_dtype_size(t->dtype);
  for (int i = 0; i < t->rank; i++) n *= t->shape[i];
  return n;
}
/* The arena space a planned value of type t takes: its bytes rounded up to
 * IR_BUF_ALIGN. */
static inline int64_t ir_buf_bytes(const op_type *t) {
  return (ir_type_bytes(t) + IR_BUF_ALIGN - 1) / IR_BUF_ALIGN * IR_BUF_ALIGN;
}
/* Frees f's plan, if any. */
KILN_EXPORT void ir_plan_drop(ir_func *f);
/* The value whose bytes v reads: v itself, or, for a view (identity,
 * stop_gradient, reshape: the same bytes read with another type), the
 * base of its input. Backends compile views as aliases of their base, so
 * the plan gives them the base's buffer and keeps the base alive for as
 * long as any of its views is live or returned. */
static inline ir_value ir_alias_base(const ir_func *f, ir_value v) {
  for (const ir_instr *d = ir_def(f, v); d && kiln_ops[d->op].kind == OPK_VIEW && d->n_in == 1; d = ir_def(f, v))
    v = d->in[0];
  return v;
}

/* ---- text form (print.c, parse.c) ---- */
/* malloc'd text of the module / function; NULL on out of memory */
KILN_EXPORT char *ir_print_module(const ir_module *);
KILN_EXPORT char *ir_print_func(const ir_func *);
/* Parses .kir text (NUL-terminated) and verifies it; NULL with
 * "file:line:col: reason" in the error. */
KILN_EXPORT ir_module *ir_parse(const char *text, const char *filename);
/* Graphviz dot of each function's dataflow; malloc'd. */
KILN_EXPORT char *ir_print_dot(const ir_module *);

/* ---- checking (verify.c) ---- */
/* 0, or -1 with "verify: @f: %3: reason" in the error. */
KILN_EXPORT int ir_verify(const ir_func *);
KILN_EXPORT int ir_verify_module(const ir_module *);

/* ---- the reference interpreter (interp.c) ---- */
/* Runs f on args (one per parameter, of the parameter's type) with the eager
 * CPU kernels; writes one tensor per result, owned as op results are (the
 * innermost scope, or the caller). 0, or -1 with the error set and results
 * untouched. */
KILN_EXPORT int ir_interpret(const ir_func *, kiln_tensor *const *args, kiln_tensor **results);
/* ir_interpret without verifying f first: for IR verified once and run
 * many times. Random ops with attrs.stateful draw from the global stream. */
KILN_EXPORT int ir_run(const ir_func *, kiln_tensor *const *args, kiln_tensor **results);

#ifdef __cplusplus
}
#endif
#endif
