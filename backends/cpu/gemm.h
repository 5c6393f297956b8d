/* gemm.h — the matmul micro-kernels the CPU backend compiles with LLVM
 * (gemm.c): explicit vector code, an MR x NR tile of accumulators in
 * registers, one per (dtype, epilogue), compiled on first use and kept for
 * the life of the process. lib/kernels_matmul.c calls them through the hook
 * of lib/matmul.h, which gemm.c sets from a constructor. Internal. */
#ifndef KILN_CPU_GEMM_H
#define KILN_CPU_GEMM_H

#include "matmul.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The compiled micro-kernel for (dt, epi) into *uk (lib/matmul.h's
 * gemm_provider_fn): false for a dtype other than f32 / f64, with
 * KILN_BACKEND=interp or KILN_GEMM=c (read at every call), or when the JIT
 * cannot compile it (then never tried again). Never sets an error;
 * thread-safe. */
KILN_EXPORT bool cpu_gemm_ukernel(kiln_dtype dt, gemm_epilogue epi, gemm_ukernel *uk);

/* The compiled convolution micro-kernel for (dt, epi) whose rows of A are
 * lda apart (lib/matmul.h's conv_provider_fn): one for each lda asked for
 * (its rows at constant displacements), up to a bound, then one that reads
 * lda from its argument; 0 asks for that one. narrow: the tile of fewer
 * pixels (matmul.h). As cpu_gemm_ukernel. */
KILN_EXPORT bool cpu_conv_ukernel(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, conv_ukernel *uk);

/* The compiled filter-gradient micro-kernel for dt (lib/matmul.h's
 * wgrad_provider_fn), as cpu_gemm_ukernel; prefetch: the one that fetches
 * its runs' pf lines (one step's worth of instructions more a step). */
KILN_EXPORT bool cpu_wgrad_ukernel(kiln_dtype dt, bool prefetch, wgrad_ukernel *uk);

/* The LLVM IR ("llvm") or assembly ("asm") of the micro-kernel for (dt,
 * epi), or of the convolution kernel ("conv-llvm", "conv-asm"; "convN-asm" for lda N), or of the
 * filter-gradient kernel ("wgrad-llvm", "wgrad-asm"), malloc'd; NULL with the error set ("gemm: ..."). For tests and
 * reading. */
KILN_EXPORT char *cpu_gemm_text(kiln_dtype dt, gemm_epilogue epi, const char *stage);

#ifdef __cplusplus
}
#endif
#endif
