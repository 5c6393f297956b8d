/* jit.h — staging internals: the per-thread active trace that op_apply and
 * the variables hand symbolic work to, and the traced function it builds.
 * Internal; kiln_function (function.c) is the public face. */
#ifndef KILN_JIT_H
#define KILN_JIT_H

#include "ir.h"
#include "../passes/passes.h"

struct cpu_program;

typedef struct trace trace;

/* The trace being recorded on this thread, NULL almost always: the eager
 * path tests only this. */
extern _Thread_local trace *trace_current KILN_TLS_FAST;

/* Does op(in) -> out belong to the active trace? Symbolic inputs, random
 * draws (so that each call of the staged function draws afresh), and a
 * broadcast of a concrete value to TRACE_EXPAND_ELEMS elements or more: run
 * eagerly, it would be captured at its full size and read by every call
 * (a loss's seed broadcast to the summed tensor's shape, in a training
 * step), where traced it is a broadcast that the kernels reading it fold
 * into their loops. */
enum { TRACE_EXPAND_ELEMS = 4096 };
static inline bool trace_routes(op_id op, int n, kiln_tensor *const *in, const op_type *out) {
  if (kiln_ops[op].kind == OPK_RANDOM) return true;
  for (int i = 0; i < n; i++)
    if (in[i]->flags & TF_SYMBOLIC) return true;
  if (op == OP_BROADCAST && n == 1) {
    int64_t elems = 1;
    for (int d = 0; d < out->rank; d++) elems *= out->shape[d];
    return elems >= TRACE_EXPAND_ELEMS && elems > in[0]->size;
  }
  return false;
}

/* Records op(in) on the active trace; a new symbolic tensor owned by the
 * caller (op_apply gives it to the scope), or NULL with the error set. */
kiln_tensor *trace_apply(op_id op, const op_attrs *attrs, int n, kiln_tensor *const *in);
/* A read of v while tracing: a symbolic tensor bound to v's value at each
 * call (by reference). Owned by the caller. */
kiln_tensor *trace_variable_read(kiln_variable *v, const kiln_tensor *value);
/* An assignment of v while tracing: later reads in the body see value, and
 * each call of the staged function assigns it when it returns. current is v's
 * value now (for its type). 0 / -1. */
int trace_variable_write(kiln_variable *v, const kiln_tensor *current, kiln_tensor *value);
/* A read of a traced value's data in C (kiln_tensor_item, kiln_tensor_read,
 * kiln_tensor_data on a symbolic tensor; reader names the call): marks the
 * active trace and the traces it interrupted as failed, whatever the body
 * returns (API.md §5). No-op when nothing is tracing. */
void trace_poison(const char *reader);
/* The reader that poisoned tr, or NULL. */
const char *trace_poisoned(const trace *tr);
/* kiln_variable_new while tracing (variable.c): v was created by the body
 * of the active trace (state creation, API.md §5). 0 / -1 (out of memory). */
int trace_variable_created(kiln_variable *v);
/* v, just created while tracing, belongs to someone else (an optimizer's
 * slot): the staged function must not take it. */
void trace_variable_disown(kiln_variable *v);
/* Moves the variables tr's body created to *vars (malloc'd; the caller now
 * owns both); their count. Variables nobody took die with the trace. */
int trace_take_created(trace *tr, kiln_variable ***vars);
/* A variable's value and type: lib/variable.h (read and replaced under the
 * variable's lock). */

/* A finished trace: the IR and what its implicit parameters are bound to.
 * Parameters: the explicit inputs, then caps (retained), then the values
 * of vars (by reference, read at each call). */
typedef struct traced_fn {
  ir_module *module;
  ir_func *func;
  kiln_tensor **caps;
  int n_caps;
  kiln_variable **vars;
  int n_vars;
  int *writes; /* results n_out .. n_out+n_writes-1 are the new values of vars[writes[i]] */
  int n_writes;
  int n_residuals; /* the last parameters: values of a forward trace (a backward trace) */
  ir_module *opt_module; /* the IR after the pass pipeline: what calls run */
  ir_func *opt_func;
  double optimize_ms;
  struct cpu_program *cpu; /* opt_func compiled (compile.c); NULL: calls run the interpreter */
  struct cuda_program *cuda; /* opt_func compiled for the GPU of a trace's device scope (compile.c), or NULL */
  double compile_ms;
  void **pcs;   /* per instruction: the user's call that made it, or NULL */
  uint64_t remote_key; /* its name on remote devices' workers (dist_remote.c); 0 until first sent */
  ir_loc *locs; /* pcs resolved (loc.c), on first print; files malloc'd */
} traced_fn;

/* Starts a trace on this thread with n_in explicit inputs shaped like in;
 * writes their symbolic stand-ins (owned by the innermost scope). NULL with
 * the error set. */
trace *trace_begin(int n_in, kiln_tensor *const *in, kiln_tensor **sym_in);
/* Stops recording on this thread (the trace stays to be finished or freed);
 * the trace it interrupted, if any, records again. */
void trace_end(trace *tr);
/* Marks whose body tr traces, to refuse a staged function calling itself. */
void trace_set_owner(trace *tr, const void *owner);
bool trace_owned_by(const void *owner);
/* A call of a traced function recorded on the active trace (a call
 * instruction); writes its n_in-explicit-input call's outputs as symbolic
 * tensors. Its variable writes become this trace's. 0 / -1. */
int trace_call(const traced_fn *callee, int n_in, kiln_tensor *const *in, kiln_tensor **out);
/* kiln_host_call while tracing: a host_call instruction. 0 / -1. */
int trace_host_call(kiln_host_fn fn, void *user, int n_in, kiln_tensor *const *in, int n_out, const op_type *specs,
                    kiln_tensor **out);
/* Builds and verifies the IR with outs as results (symbolic tensors of the
 * trace, or concrete tensors, captured). 0 / -1; tr is freed either way. */
int trace_finish(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, traced_fn *fn);
void trace_free(trace *tr);
/* A backward trace: symbolic tensors of fwd (ended, not finished) that tr's
 * ops read become tr's residual parameters, after its variables. */
void trace_set_forward(trace *tr, trace *fwd);
/* tr's residuals so far, as node ids of its forward trace. */
int trace_residuals(const trace *tr, const int **fwd_nodes);
/* trace_finish with n_extra more results after the outputs and writes:
 * nodes of tr (ids from trace_residuals of a backward trace). */
int trace_finish_ex(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, int n_extra,
                    const int *extra_nodes, traced_fn *fn);
void traced_fn_free(traced_fn *fn);

/* ---- regions of control flow (control.c) ----
 * While tracing, each branch or body of kiln_cond / kiln_while_loop /
 * kiln_scan is traced as a region: a trace whose parameters are its
 * explicit inputs, then an environment shared by the instruction's regions
 * (captured concrete tensors, variables read, symbolic tensors of the
 * traces it interrupted), which become the instruction's trailing operands. */
typedef struct trace_env {
  int n, cap;
  kiln_tensor **t;    /* a captured or outer tensor (retained), or NULL */
  kiln_variable **v;  /* else a variable read in a body */
  op_type *type;
} trace_env;
/* Starts a region trace with n explicit inputs of these types (symbolic
 * stand-ins owned by the innermost scope). NULL with the error set. */
trace *trace_begin_region(int n, const op_type *types, kiln_tensor **sym_in);
/* Stops recording a region whose body wrote outs, and adds what it
 * captured to env. A body assigning a variable fails (who names the op). */
int trace_region_close(trace *tr, const char *who, int n_out, kiln_tensor *const *outs, trace_env *env);
/* The variables region tr's body assigned (*vars malloc'd); their count,
 * -1 on out of memory. */
int trace_region_written(const trace *tr, kiln_variable ***vars);
/* The random draws tr recorded so far, in order: its own random
 * instructions, and the draws that control flow nested in it returns
 * (trace_add_draws); not those of regions' own instructions. */
int trace_draw_count(const trace *tr);
/* the type of draw k of tr (NULL when there is none) */
const op_type *trace_draw_type(const trace *tr, int k);
/* A symbolic tensor for the value of draw k of tr (a new tensor of the
 * caller's scope); NULL with the error set. */
kiln_tensor *trace_draw(trace *tr, int k);
/* Adds results t[0..n) of an instruction of tr (a staged cond's or scan's
 * outputs holding its regions' draws) to tr's draws. 0 / -1. */
int trace_add_draws(trace *tr, int n, kiln_tensor *const *t);
/* Forgets the active trace's assignment of v (its value was carried out of
 * a region as an output instead). */
void trace_variable_unwrite(kiln_variable *v);
/* Builds the region's function: parameters the explicit inputs, then env.
 * tr is freed either way. 0 / -1. */
int trace_finish_region(trace *tr, const char *name, int n_out, kiln_tensor *const *outs, const trace_env *env,
                        traced_fn *fn);
void trace_env_free(trace_env *env);
/* Records a control-flow instruction with regions r0, r1 (malloc'd, taken
 * over even on failure) on the active trace; outputs as trace_call's. */
int trace_control(op_id op, const op_attrs *attrs, traced_fn *r0, traced_fn *r1, int n, kiln_tensor *const *in,
                  int n_out, const op_type *types, kiln_tensor **out);

/* loc.c. The return address of the innermost call from outside libkiln. */
void *loc_caller_pc(void);
/* fn's IR text with source locations (resolved once; the caller serialises
 * calls on fn); malloc'd, NULL on out of memory. */
char *traced_fn_print(traced_fn *fn);
char *traced_fn_print_optimized(traced_fn *fn);
void traced_fn_free_locs(traced_fn *fn);
/* KILN_DUMP=DIR: writes text as DIR/<name>.<trace>.<step>.<stage>.kir; a
 * failure is a warning line on stderr and -1 (callers then stop dumping). */
int jit_dump(const char *name, int trace, int step, const char *stage, const char *text);

/* compile.c: the last step of a new trace. Compiles fn->opt_func for the
 * CPU unless KILN_BACKEND=interp or the trace runs on a GPU; where the
 * backend cannot take it, calls run the interpreter (KILN_LOG=compile says
 * why) unless KILN_BACKEND=cpu asked for compiled code: then -1. KILN_DUMP
 * writes the LLVM IR, assembly and PTX (steps step .. step + 2). */
int jit_compile(traced_fn *fn, const char *name, int trace_no, int step);
/* Runs fn's optimized IR: compiled code where there is some and every
 * argument is on the CPU, else the interpreter. Results as ir_run's. */
int jit_exec(const traced_fn *fn, kiln_tensor *const *args, kiln_tensor **res);
/* jit_exec, giving up the buffers of the arguments marked in donate (NULL:
 * none) to results written in place where the compiled code can
 * (cpu_run_donating). */
int jit_exec_donating(const traced_fn *fn, kiln_tensor *const *args, kiln_tensor **res, const bool *donate);
/* "llvm", "asm" (compiled code) or "ptx" (cross-compiled) text of fn's
 * optimized IR; malloc'd, NULL with the error set. */
char *jit_stage_text(traced_fn *fn, const char *name, const char *stage);
/* fn's traced IR as MLIR (backends/mlir); malloc'd, NULL with the error set. */
char *jit_mlir_text(traced_fn *fn, const char *name);

/* A trace parsed from text elsewhere (a remote device's worker): optimized
 * and compiled as a new trace of a function named name is. 0 / -1. */
int jit_prepare(traced_fn *fn, const char *name);
/* A call of fn on remote device `device` (lib/dist_remote.c): the trace's
 * text travels once per worker, then only the arguments; results as
 * jit_exec's, on that device. 0 / -1. */
int remote_call(traced_fn *fn, int device, kiln_tensor *const *args, kiln_tensor **res);

/* The optimized IR of f's trace (function.c), for benchmarks and tests;
 * NULL with the error set. Lives as long as f. */
KILN_EXPORT const ir_func *jit_optimized_func(kiln_function *f, int trace);
/* kiln-aot's trace (jit/aot.c): saved trace number trace of a loaded
 * function f, traced and optimized as a call of its signature would be
 * (fn->opt_func), and the values of its parameters past the inputs, in
 * order (*data, *n_data: the captured tensors, then its variables' values
 * now; malloc'd, each retained). Refused, with "kiln-aot: ..." in the
 * error: a function not loaded, a trace out of range, one of another device
 * or one that assigns variables. 0, or -1. */
KILN_EXPORT int jit_saved_trace(kiln_function *f, int trace, traced_fn *fn, kiln_tensor ***data, int *n_data);

#endif
