/* emit.h — what the files of the MLIR emitter share: the emitter's state
 * (text, fresh names, each Kiln value's MLIR name), MLIR spellings of
 * types and literals, and the linalg.generic builder. Internal. */
#ifndef KILN_MLIR_EMIT_H
#define KILN_MLIR_EMIT_H

#include "ir_internal.h"
#include "mlir/mlir.h"

enum { MLIR_NAME = 24 }; /* "%r123_v4567" and the like */

typedef struct mlir_emitter {
  ir_buf *b;
  int indent;
  int tmp;     /* the next %tN of this func.func */
  int regions; /* the next region prefix of this func.func */
  bool failed; /* an error is set */
} mlir_emitter;

/* The MLIR names of one function's (or region's) values. */
typedef struct mlir_scope {
  const ir_func *f;
  char (*name)[MLIR_NAME];
} mlir_scope;

/* ---- text (emit.c) ---- */
void mlir_line(mlir_emitter *e, const char *fmt, ...) KILN_PRINTF(2, 3);
/* mlir_line without the newline: the caller continues the line */
void mlir_start(mlir_emitter *e, const char *fmt, ...) KILN_PRINTF(2, 3);
/* a fresh SSA name "%tN" into buf (MLIR_NAME bytes); returns buf */
char *mlir_fresh(mlir_emitter *e, char *buf);
/* -1 with "mlir: @f: %v: <op>: reason" set (once) */
int mlir_fail(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, const char *fmt, ...) KILN_PRINTF(4, 5);

/* ---- spellings (scalar.c) ---- */
const char *mlir_elem(kiln_dtype dt); /* f32 f64 i32 i64 i1 f16 bf16 */
/* "tensor<2x3xf32>" into buf (256 bytes); returns buf */
char *mlir_type(char *buf, const op_type *t);
/* a scalar constant: "%tN = arith.constant <bits> : <dt>" with v converted
 * to dt (floats as exact bit patterns); its name in name */
void mlir_const(mlir_emitter *e, char *name, kiln_dtype dt, double v);
void mlir_const_int(mlir_emitter *e, char *name, const char *type, long long v);
/* the tensor constant t as "%name = arith.constant dense<...>" (or
 * tensor.empty when it has no elements); -1 if it is not on the CPU */
int mlir_tensor_const(mlir_emitter *e, const char *name, const kiln_tensor *t);

/* ---- scalar semantics (scalar.c): the interpreter's element functions,
 * written as arith/math ops on scalars x, y (block arguments of a
 * linalg.generic). The result's name in out; -1 if the op has none. ---- */
int mlir_scalar_unary(mlir_emitter *e, op_id op, kiln_dtype dt, const char *x, char *out);
int mlir_scalar_binary(mlir_emitter *e, op_id op, kiln_dtype dt, const char *x, const char *y, char *out);
int mlir_scalar_compare(mlir_emitter *e, op_id op, kiln_dtype dt, const char *x, const char *y, char *out);
void mlir_scalar_convert(mlir_emitter *e, kiln_dtype from, kiln_dtype to, const char *x, char *out);
/* NaN-propagating max/min with the kernels' operand order: acc is kept
 * unless x beats it (x > acc, or x is NaN) */
void mlir_scalar_extremum(mlir_emitter *e, bool max, kiln_dtype dt, const char *acc, const char *x, char *out);

/* ---- linalg.generic (structured.c) ----
 * A generic over n_dims loops (iters[d] 'p' parallel or 'r' reduction):
 * inputs and outputs with their affine map results ("d0, 0, d2"). After
 * mlir_generic_begin, arg[k] names the block argument of operand k (inputs,
 * then outputs); the caller writes the body and ends it with
 * mlir_generic_end(yielded values). The result is res (res#k for k > 0). */
typedef struct mlir_generic {
  int n_dims;
  const char *iters;
  int n_in, n_out;
  const char *name[8];    /* operand SSA names */
  const op_type *type[8]; /* operand types */
  char map[8][256];       /* map results */
  char arg[8][MLIR_NAME];
  char res[MLIR_NAME];
} mlir_generic;
void mlir_generic_begin(mlir_emitter *e, mlir_generic *g);
void mlir_generic_end(mlir_emitter *e, mlir_generic *g, int n, const char *const *yield);
/* the map results reading t broadcast (NumPy) to a rank-r shape out */
void mlir_broadcast_map(char *map, size_t n, const op_type *t, const op_type *out);
/* "d0, d1, ..., d{r-1}" */
void mlir_identity_map(char *map, size_t n, int r);
/* tensor.empty of type t into name */
void mlir_empty(mlir_emitter *e, char *name, const op_type *t);
/* x (of type from) reshaped to type to: collapse to one axis, expand */
void mlir_reshape(mlir_emitter *e, char *out, const char *x, const op_type *from, const op_type *to);

/* scf.for iv = lo to hi (index names) carrying one value of type from
 * init: inside, carried names it; after mlir_for_end(next value), res is
 * the loop's result */
void mlir_for_begin(mlir_emitter *e, const char *lo, const char *hi, const char *init, const char *type, char *iv,
                    char *carried, char *res);
void mlir_for_end(mlir_emitter *e, const char *val, const char *type);

/* n nested scf.for over [0, ext[d]) carrying one value of type from init:
 * iv[d] are the induction variables and cur the carried value inside;
 * mlir_nest_end yields val through every level, the outermost result into
 * out (n = 0: no loops, out = val) */
typedef struct mlir_nest {
  int n;
  char iv[KILN_MAX_RANK][MLIR_NAME], res[KILN_MAX_RANK][MLIR_NAME], cur[MLIR_NAME];
  char type[256];
} mlir_nest;
void mlir_nest_begin(mlir_emitter *e, mlir_nest *l, int n, const int64_t *ext, const char *init, const char *type);
void mlir_nest_end(mlir_emitter *e, mlir_nest *l, const char *val, char *out);

/* ---- the ops, each writing the result's name into out ---- */
int mlir_emit_elementwise(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out);
int mlir_emit_movement(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out);
int mlir_emit_reduce(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out);
int mlir_emit_dot(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out);
int mlir_emit_index(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out);
int mlir_emit_window(mlir_emitter *e, const mlir_scope *s, const ir_instr *in, char *out);

static inline const op_type *mlir_vtype(const mlir_scope *s, ir_value v) { return &s->f->types[v]; }
static inline const char *mlir_vname(const mlir_scope *s, ir_value v) { return s->name[v]; }

#endif
