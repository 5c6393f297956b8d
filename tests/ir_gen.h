/* ir_gen.h — a seeded generator of random well-typed Kiln IR programs, and
 * of argument tensors for them, for differential tests (interpreter against
 * eager ops, against the pass pipeline, against compiled code). Programs are
 * built only through ir/ir.h's builder; the same seed always gives the same
 * program, byte for byte as ir_print_module prints it.
 *
 * Values stay in ranges where differential comparison is meaningful: no
 * integer division or mod by zero, no log/sqrt of negatives, no overflow
 * (every value is bounded by 1e6 in magnitude), gather and scatter_add
 * indices always in range for the arguments ir_gen_args makes. */
#ifndef KILN_TESTS_IR_GEN_H
#define KILN_TESTS_IR_GEN_H

#include <stdint.h>

#include "ir.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Op kinds the generator may emit (bits of ir_gen_options.kinds). */
enum {
  IR_GEN_UNARY = 1u << 0,     /* neg, abs, exp, log (of abs+1), sqrt (of abs), not, ... */
  IR_GEN_BINARY = 1u << 1,    /* add ... mod, and, or; div/mod by nonzero, pow by small ints */
  IR_GEN_COMPARE = 1u << 2,   /* eq ... ge */
  IR_GEN_SELECT = 1u << 3,    /* select */
  IR_GEN_CONVERT = 1u << 4,   /* convert */
  IR_GEN_BROADCAST = 1u << 5, /* broadcast */
  IR_GEN_RESHAPE = 1u << 6,   /* reshape */
  IR_GEN_TRANSPOSE = 1u << 7, /* transpose */
  IR_GEN_SLICE = 1u << 8,     /* slice (rarely empty) */
  IR_GEN_CONCAT = 1u << 9,    /* concat of 2-3 tensors */
  IR_GEN_REDUCE = 1u << 10,   /* reduce_sum/prod/max/min over axes, keepdims */
  IR_GEN_ARGMAX = 1u << 11,   /* argmax */
  IR_GEN_DOT = 1u << 12,      /* dot, batched */
  IR_GEN_GATHER = 1u << 13,   /* gather with in-range indices */
  IR_GEN_SCATTER = 1u << 14,  /* scatter_add with in-range indices */
  IR_GEN_IOTA = 1u << 15,     /* iota */
  IR_GEN_CONSTANT = 1u << 16, /* standalone constants (operand constants are always allowed) */
  IR_GEN_IDENTITY = 1u << 17, /* identity, stop_gradient */
  IR_GEN_REPEAT = 1u << 18,   /* a copy of an earlier instruction (same op, operands, attrs): cse's food */
  IR_GEN_IDIOM = 1u << 19,    /* what the passes rewrite, and near misses: x + +-0, x * 1,
                                 x / 2^k, x / 3, x - x, select(p, x, x), neg neg,
                                 transpose/reshape back, convert round trips, ... */
  IR_GEN_ALL = (1u << 20) - 1,
  /* not in IR_GEN_ALL (backends without control flow use ALL): cond,
   * while and scan whose regions are generated programs too (nested up to
   * two deep), computing what a flat program would (see ir_gen.cc) */
  IR_GEN_CONTROL = 1u << 20,
  /* not in IR_GEN_ALL either (the GPU backend does not lower them yet):
   * conv2d, its two gradients, max/avg pooling and theirs, over float
   * NHWC values (lower ranks reshaped to 4-D) with constant filters */
  IR_GEN_WINDOW = 1u << 21,
  /* not in IR_GEN_ALL either (its matrices are bigger than the palette's
   * dims): a dense layer's backward pass as the CPU plan meets it, float
   * only: a matrix src [17-40, 16-48] made by a dot of the program's data
   * (and maybe relu or tanh), transposed, values of src's size computed
   * after the transpose (the buffers pass frees src there, so they may take
   * its bytes), then src^T . dy (packed) or a few rows times src^T
   * (matmul_nt), which the plan reads in place, maybe multiplied again */
  IR_GEN_DENSE = 1u << 22,
  /* not in IR_GEN_ALL either (its matrices are bigger than the palette's
   * dims): a small MLP over the rows of narrow matrices, float only: a
   * matrix [33-200, 1-6] of the program's data, then 1-4 layers of a dot by
   * a constant [w, n] (n at most 16), maybe a bias, an activation, a value
   * of the block before added or multiplied in, or a column [rows, 1] (the
   * CPU's row chains, backends/cpu/chain.c) */
  IR_GEN_NARROW = 1u << 23,
  /* not in IR_GEN_ALL either (they talk to the world's other processes):
   * all_reduce (sum, mean, max, min), all_gather and reduce_scatter along
   * an axis (reduce_scatter's divisible by the world), broadcast_from a
   * root, for a world of options.world processes; sums and means stay in
   * range for values that differ between ranks */
  IR_GEN_COLLECTIVE = 1u << 24
};

typedef struct ir_gen_options {
  int min_instrs, max_instrs; /* the instruction count is drawn in this range */
  int max_params;             /* 1..max_params parameters (at most 8) */
  int max_results;            /* 1..max_results results (at most 8) */
  unsigned dtypes;            /* DT_BIT mask: every value of the program has one of these */
  unsigned kinds;             /* IR_GEN_* mask: the main op of each step; helpers
                                 (|y|+1 divisors, index clamps, the compare of a
                                 select, a dot's transpose) may be of other kinds */
  int special_floats;         /* nonzero: float constants include NaN, +-inf, 1e30,
                                 and float values are not kept in range (exp may
                                 overflow, log see negatives); integer and bool
                                 values stay in range. For NaN-aware comparisons. */
  int world;                  /* IR_GEN_COLLECTIVE: the world's size (0 = 1) */
} ir_gen_options;

/* 5-40 instructions, 1-4 parameters, 1-3 results, f32 f64 i32 i64 bool,
 * every kind, no special floats. (f16/bf16 are allowed by adding their bits: they then appear
 * through convert and data movement.) */
ir_gen_options ir_gen_default_options(void);

/* A module with one function, @gen, built from seed: parameters of ranks 0-4
 * with dims 1-7, then a DAG of instructions, then the results. Parameters
 * named %idxN are index inputs (values in [0, N)); see ir_gen_args.
 * NULL opt = the defaults. The caller frees it with ir_module_free. NULL,
 * with the error set, if the options are invalid or the builder refused an
 * instruction that ir_check_op accepted (a bug in ir/). Leaves no tensor in
 * the caller's scope. */
ir_module *ir_gen_program(uint64_t seed, const ir_gen_options *opt);

/* Arguments for f's parameters, made from seed: floats uniform in [-2, 2]
 * (20% of them exactly 0, -0.0, +-1, +-0.5 or +-2),
 * integers in [-5, 5], bools at random, and parameters named %idxN in
 * [0, N). Writes f->n_params tensors into args, owned as op results are (the
 * innermost scope, or the caller). 0, or -1 with the error set. */
int ir_gen_args(const ir_func *f, uint64_t seed, kiln_tensor **args);
/* ir_gen_args, then about 10% of the float elements replaced by NaN, +-inf
 * or +-1e30: for programs generated with special_floats (whose float
 * parameters are not assumed to be in range). */
int ir_gen_special_args(const ir_func *f, uint64_t seed, kiln_tensor **args);

#ifdef __cplusplus
}
#endif
#endif
