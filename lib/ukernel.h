/* ukernel.h — what the C micro-kernels share (kernels_matmul.c's GEMM,
 * conv_ukernel.c's convolution and filter gradient): the fused
 * multiply-add they sum with and their register tiles, which fix the order
 * of every sum (the LLVM micro-kernels of backends/cpu/gemm.c sum in the
 * same order). Internal. */
#ifndef KILN_UKERNEL_H
#define KILN_UKERNEL_H

#include <math.h>

#include "ops.h"

#if KILN_FUSED_FMA /* compat.h: fused in hardware wherever a hot kernel runs */
#define FMA_F32(a, b, c) fmaf((a), (b), (c))
#define FMA_F64(a, b, c) fma((a), (b), (c))
#else /* without hardware FMA, fmaf is a slow libm call */
#define FMA_F32(a, b, c) ((a) * (b) + (c))
#define FMA_F64(a, b, c) ((a) * (b) + (c))
#endif

/* Register tiles of the C micro-kernel. It is plain C: gcc turns its MR x NR
 * accumulator array into registers only when NR fills whole vectors that it
 * does not unroll away first (NR = 16 floats, say, defeats it), so these
 * were picked by reading the generated code and timing against OpenBLAS. */
#if defined(__AVX512F__)
enum { MR_F32 = 6, NR_F32 = 32, MR_F64 = 6, NR_F64 = 32 };
#else
enum { MR_F32 = 4, NR_F32 = 24, MR_F64 = 2, NR_F64 = 24 }; /* 16 vector registers */
#endif
/* The multiversioned build (compat.h) has both: the AVX-512 tile, compiled
 * for AVX-512 alone, where the CPU has it, the 16-register one elsewhere */
enum { MR_Z_F32 = 6, NR_Z_F32 = 32, MR_Z_F64 = 6, NR_Z_F64 = 32 };

#endif
