/* matmul.h — the blocked matmul's micro-kernel interface. kernels_matmul.c
 * packs the panels, blocks for the caches and splits the work over threads;
 * the register-tiled micro-kernel it calls is its own C one, or one that the
 * CPU backend compiles with LLVM (backends/cpu/gemm.c) and registers here:
 * lib/ calls the backend only through this hook. Internal. */
#ifndef KILN_MATMUL_H
#define KILN_MATMUL_H

#include "ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a micro-kernel applies to its tile when it stores it for the last
 * time (the last block of K): nothing, + bias (one value per column), then
 * relu or tanh. */
typedef enum { GEMM_EPI_NONE, GEMM_EPI_BIAS, GEMM_EPI_BIAS_RELU, GEMM_EPI_BIAS_TANH, GEMM_EPI_COUNT } gemm_epilogue;

/* flags of a micro-kernel call: add the tile to C (later blocks of K)
 * instead of storing it; this is the last block of K (apply the epilogue);
 * the epilogue, for kernels that serve them all, in bits 8 and up */
enum { GEMM_ACCUMULATE = 1, GEMM_LAST = 2, GEMM_EPI_SHIFT = 8 };

/* C[0:mr, 0:nr] (rows ldc elements apart) from a packed A micro-panel of MR
 * rows (k-major: a[p * MR + i]) and a packed B micro-panel of NR columns
 * (b[p * NR + j]), kc steps of k; rows of A past mr and columns of B past nr
 * are zeros and not stored. bias points at the tile's first column. The sum
 * of each element runs over k in order with one FMA per step, so every
 * micro-kernel gives the same bits. */
typedef void (*gemm_ukernel_fn)(int64_t kc, const void *a, const void *b, void *c, int64_t ldc, int64_t mr, int64_t nr,
                                int32_t flags, const void *bias);

typedef struct gemm_ukernel {
  gemm_ukernel_fn fn;
  int mr, nr; /* its register tile */
} gemm_ukernel;

/* Fills *uk with a compiled micro-kernel for dtype dt and epilogue epi, or
 * returns false (none: no JIT, KILN_BACKEND=interp, KILN_GEMM=c, a dtype it
 * does not compile); never sets an error. Thread-safe. */
typedef bool (*gemm_provider_fn)(kiln_dtype dt, gemm_epilogue epi, gemm_ukernel *uk);
/* Registers the provider (backends/cpu/gemm.c, from a constructor). */
void matmul_set_provider(gemm_provider_fn fn);
/* The convolution micro-kernel ("strided A": the image read in place, not
 * packed): C[0:mr, 0:nr] = sum over taps t of A_t . B_t, where row i of A_t
 * is the kc contiguous elements at a[t] + i * lda (MR rows readable, rows
 * past mr not stored) and B_t the packed panel b + t * kc * NR (k-major,
 * columns past nr zeros). Each element sums over the taps, then k, in order,
 * one FMA per step from zero, in registers; then it is stored once: the
 * flags' epilogue (always the last block of K) adds bias[j], then with
 * GEMM_RESIDUAL res[i * ldc + j], then relu or tanh. */
enum { GEMM_RESIDUAL = 4 };
typedef void (*conv_ukernel_fn)(int64_t taps, const void *const *a, int64_t kc, int64_t lda, const void *b, void *c,
                                int64_t ldc, int64_t mr, int64_t nr, int32_t flags, const void *bias, const void *res);

typedef struct conv_ukernel {
  conv_ukernel_fn fn;
  int mr, nr;
} conv_ukernel;

/* The compiled convolution micro-kernel for (dt, epi), or false; as
 * gemm_provider_fn. The kernel may be specialised for lda (the lda its
 * calls then pass); lda 0 asks for one that takes any. narrow asks for a
 * tile of fewer pixels (and more channels), for images whose rows the
 * usual tile would leave half empty (ResNet's 7 x 7). */
typedef bool (*conv_provider_fn)(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, conv_ukernel *uk);
void matmul_set_conv_provider(conv_provider_fn fn);
/* The convolution micro-kernel for dt (f32, f64), epi, lda and narrow: the
 * provider's when jit and it has one, else the C one (kernels_matmul.c). */
KILN_EXPORT conv_ukernel matmul_conv_ukernel(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, bool jit);

/* The filter gradient's micro-kernel: C[0:mr, 0:nr] = (C +, with
 * GEMM_ACCUMULATE) the sum over runs t of sum over p < run[t].kc of
 * A_t[:, p] (x) B_t[p, :], where A_t's column p is the MR contiguous
 * elements at run[t].a + p * lda (all MR readable) and B_t's row p the nr
 * contiguous elements at run[t].b + p * ldb (no more are read). Each element
 * sums over the runs, then p, in order, one FMA per step from zero, in
 * registers, then is added to C once. For dfilter = sum over pixels of
 * window(x)^T . dy: a run is one output row's pixels, A the image read in
 * place (a pixel's channels, sw * c apart), B the rows of dy. */
typedef struct conv_run {
  const void *a, *b;
  int64_t kc;
  /* memory the kernel fetches into L2 while it sums (a later block's rows,
   * which would otherwise be read from memory while no sums run): at step
   * p < pf_lines, the 64-byte line pf + 64 p, where the kernel is one that
   * prefetches (the C ones do not). pf is readable (a, when there is
   * nothing to fetch). */
  const void *pf;
  int64_t pf_lines;
} conv_run;
typedef void (*wgrad_ukernel_fn)(int64_t runs, const conv_run *run, int64_t lda, int64_t ldb, void *c, int64_t ldc,
                                 int64_t mr, int64_t nr, int32_t flags);
typedef struct wgrad_ukernel {
  wgrad_ukernel_fn fn;
  int mr, nr;
} wgrad_ukernel;
typedef bool (*wgrad_provider_fn)(kiln_dtype dt, bool prefetch, wgrad_ukernel *uk);
void matmul_set_wgrad_provider(wgrad_provider_fn fn);
/* The provider's when jit and it has one, else the C one. */
KILN_EXPORT wgrad_ukernel matmul_wgrad_ukernel(kiln_dtype dt, bool jit, bool prefetch);

/* m*n*k from which the blocked matmul asks the provider for its
 * micro-kernel. Smaller products (down to 32^3) mostly run faster with it
 * too (bench_matmul: +40% at 32^3, +13% at 48^3), but they take
 * microseconds, and the first one would wait for its compilation (10-20 ms
 * a kernel). */
#define MATMUL_JIT_WORK ((int64_t)64 * 64 * 64)

/* The matmul with an epilogue: out = act(a . b + bias), with bias of shape
 * [n] broadcast over the rows (and batches) of the product; GEMM_EPI_NONE
 * ignores bias. Shapes as kiln_matmul's (out allocated by the caller);
 * 0, or -1 with the error set ("matmul: ..."). The dispatcher's dot
 * kernels are its GEMM_EPI_NONE case; the CPU backend's runtime helper for
 * a fused dot + bias (+ activation) calls it. */
KILN_EXPORT int matmul_epilogue(const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *bias, gemm_epilogue epi,
                                kiln_tensor *out);

/* out = a . transpose(w) without the transpose: a [m, k], w [n, k] and
 * out [m, n], all rank 2 and of one dtype. Each element is a dot product
 * of two contiguous rows (over LANES partial sums, as the n = 1 product
 * sums), so w is read once, in place: for a with a few rows (a batch-1
 * backward pass through a layer's weights) this beats transposing w and
 * multiplying. 0, or -1 with the error set ("matmul: ..."). */
KILN_EXPORT int matmul_nt(const kiln_tensor *a, const kiln_tensor *w, kiln_tensor *out);
/* Rows of a up to which matmul_trans multiplies by a transposed w as
 * matmul_nt does. */
#define MATMUL_NT_ROWS 4

/* out = op(a) . op(b) where op transposes its matrix when ta (tb) is set:
 * the transposes the IR asks for are read by the packing of the blocked
 * product instead of being made (matmul_nt for a few rows times a
 * transposed b). a, b and out rank 2, one dtype; the same sums as the
 * product of the transposed copies. 0, or -1 with the error set. */
KILN_EXPORT int matmul_trans(const kiln_tensor *a, const kiln_tensor *b, bool ta, bool tb, kiln_tensor *out);
/* Whether an m x k . k x n float product runs packed (the blocked path):
 * the products matmul_trans is fast for. */
KILN_EXPORT bool matmul_packs(int64_t m, int64_t n, int64_t k);

#ifdef __cplusplus
}
#endif
#endif
