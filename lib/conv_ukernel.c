/* conv_ukernel.c — the C micro-kernels of the direct convolution
 * (conv_direct.c): the convolution's (conv_ukernel_fn: a tile of output
 * pixels x channels summed over every tap, the image read in place) and the
 * filter gradient's (wgrad_ukernel_fn), each the fallback of the compiled
 * one the CPU backend registers (backends/cpu/gemm.c) and summing in the
 * same order, so the two give the same bits. */
#include "matmul.h"
#include "ukernel.h"

/* CONV_UKERNEL(T, SUF, FMA, MR, NR, ATTR): the C convolution
 * micro-kernel (conv_ukernel_fn) of one float type and register tile */
#define CONV_UKERNEL(T, SUF, FMA, MR, NR, ATTR)                                                          \
  ATTR static void conv_ukernel_##SUF(int64_t taps, const void *const *av, int64_t kc, int64_t lda,        \
                                      const void *vb, void *vc, int64_t ldc, int64_t mr, int64_t nr,       \
                                      int32_t flags, const void *vbias, const void *vres) {                \
    T acc[MR][NR];                                                                                         \
    for (int i = 0; i < MR; i++)                                                                           \
      for (int j = 0; j < NR; j++) acc[i][j] = 0;                                                          \
    const T *KILN_RESTRICT b = vb;                                                                         \
    for (int64_t t = 0; t < taps; t++) {                                                                   \
      const T *KILN_RESTRICT a = av[t];                                                                    \
      for (int64_t p = 0; p < kc; p++, b += NR) {                                                          \
        for (int i = 0; i < MR; i++) {                                                                     \
          T ai = a[i * lda + p];                                                                           \
          for (int j = 0; j < NR; j++) acc[i][j] = FMA(ai, b[j], acc[i][j]);                               \
        }                                                                                                  \
      }                                                                                                    \
    }                                                                                                      \
    gemm_epilogue epi = (gemm_epilogue)(flags >> GEMM_EPI_SHIFT);                                          \
    const T *bias = vbias, *res = flags & GEMM_RESIDUAL ? vres : NULL;                                     \
    T *c = vc;                                                                                             \
    for (int64_t i = 0; i < mr; i++)                                                                       \
      for (int64_t j = 0; j < nr; j++) {                                                                   \
        T v = acc[i][j];                                                                                   \
        if (epi != GEMM_EPI_NONE) v += bias[j];                                                            \
        if (res) v += res[i * ldc + j];                                                                    \
        if (epi == GEMM_EPI_BIAS_RELU) v = v < 0 ? (T)0 : v;                                               \
        if (epi == GEMM_EPI_BIAS_TANH) v = sizeof(T) == 4 ? (T)tanhf((float)v) : (T)tanh((double)v);      \
        c[i * ldc + j] = v;                                                                                \
      }                                                                                                    \
  }
CONV_UKERNEL(float, f32, FMA_F32, MR_F32, NR_F32, KILN_HOT KILN_TILE)
CONV_UKERNEL(double, f64, FMA_F64, MR_F64, NR_F64, KILN_HOT KILN_TILE)
#if KILN_MULTIVERSION
CONV_UKERNEL(float, z_f32, FMA_F32, MR_Z_F32, NR_Z_F32, KILN_HOT_AVX512 KILN_TILE)
CONV_UKERNEL(double, z_f64, FMA_F64, MR_Z_F64, NR_Z_F64, KILN_HOT_AVX512 KILN_TILE)
#endif

static _Atomic(conv_provider_fn) conv_provider;

void matmul_set_conv_provider(conv_provider_fn fn) { atomic_store(&conv_provider, fn); }

conv_ukernel matmul_conv_ukernel(kiln_dtype dt, gemm_epilogue epi, int64_t lda, bool narrow, bool jit) {
  conv_ukernel uk;
  conv_provider_fn get = atomic_load(&conv_provider);
  if (jit && get && get(dt, epi, lda, narrow, &uk)) return uk;
#if KILN_MULTIVERSION
  if (KILN_HAVE_AVX512())
    return dt == KILN_F32 ? (conv_ukernel){conv_ukernel_z_f32, MR_Z_F32, NR_Z_F32}
                          : (conv_ukernel){conv_ukernel_z_f64, MR_Z_F64, NR_Z_F64};
#endif
  return dt == KILN_F32 ? (conv_ukernel){conv_ukernel_f32, MR_F32, NR_F32}
                        : (conv_ukernel){conv_ukernel_f64, MR_F64, NR_F64};
}

/* WGRAD_UKERNEL(T, SUF, FMA, MR, NR, ATTR): the C filter-gradient
 * micro-kernel (wgrad_ukernel_fn) */
#define WGRAD_UKERNEL(T, SUF, FMA, MR, NR, ATTR)                                                          \
  static inline void wgrad_steps_##SUF(T (*KILN_RESTRICT acc)[NR], const T *KILN_RESTRICT a,              \
                                       const T *KILN_RESTRICT b, int64_t kc, int64_t lda, int64_t ldb) { \
    for (int64_t p = 0; p < kc; p++, a += lda, b += ldb)                                                  \
      for (int i = 0; i < MR; i++) {                                                                      \
        T ai = a[i];                                                                                      \
        for (int j = 0; j < NR; j++) acc[i][j] = FMA(ai, b[j], acc[i][j]);                                \
      }                                                                                                   \
  }                                                                                                       \
  ATTR static void wgrad_ukernel_##SUF(int64_t runs, const conv_run *run, int64_t lda, int64_t ldb,       \
                                       void *vc, int64_t ldc, int64_t mr, int64_t nr, int32_t flags) {    \
    T acc[MR][NR], brow[NR];                                                                              \
    for (int i = 0; i < MR; i++)                                                                          \
      for (int j = 0; j < NR; j++) acc[i][j] = 0;                                                         \
    for (int64_t t = 0; t < runs; t++) {                                                                  \
      const T *a = run[t].a, *b = run[t].b;                                                               \
      if (nr == NR) {                                                                                     \
        wgrad_steps_##SUF(acc, a, b, run[t].kc, lda, ldb);                                                \
        continue;                                                                                         \
      }                                                                                                   \
      for (int64_t p = 0; p < run[t].kc; p++) { /* a narrow tile: B's row through a copy */              \
        for (int j = 0; j < NR; j++) brow[j] = j < nr ? b[p * ldb + j] : 0;                               \
        wgrad_steps_##SUF(acc, a + p * lda, brow, 1, lda, 0);                                             \
      }                                                                                                   \
    }                                                                                                     \
    T *c = vc;                                                                                            \
    for (int64_t i = 0; i < mr; i++)                                                                      \
      for (int64_t j = 0; j < nr; j++)                                                                    \
        c[i * ldc + j] = flags & GEMM_ACCUMULATE ? c[i * ldc + j] + acc[i][j] : acc[i][j];                \
  }
WGRAD_UKERNEL(float, f32, FMA_F32, MR_F32, NR_F32, KILN_HOT KILN_TILE)
WGRAD_UKERNEL(double, f64, FMA_F64, MR_F64, NR_F64, KILN_HOT KILN_TILE)
#if KILN_MULTIVERSION
WGRAD_UKERNEL(float, z_f32, FMA_F32, MR_Z_F32, NR_Z_F32, KILN_HOT_AVX512 KILN_TILE)
WGRAD_UKERNEL(double, z_f64, FMA_F64, MR_Z_F64, NR_Z_F64, KILN_HOT_AVX512 KILN_TILE)
#endif

static _Atomic(wgrad_provider_fn) wgrad_provider;

void matmul_set_wgrad_provider(wgrad_provider_fn fn) { atomic_store(&wgrad_provider, fn); }

wgrad_ukernel matmul_wgrad_ukernel(kiln_dtype dt, bool jit, bool prefetch) {
  wgrad_ukernel uk;
  wgrad_provider_fn get = atomic_load(&wgrad_provider);
  if (jit && get && get(dt, prefetch, &uk)) return uk;
#if KILN_MULTIVERSION
  if (KILN_HAVE_AVX512())
    return dt == KILN_F32 ? (wgrad_ukernel){wgrad_ukernel_z_f32, MR_Z_F32, NR_Z_F32}
                          : (wgrad_ukernel){wgrad_ukernel_z_f64, MR_Z_F64, NR_Z_F64};
#endif
  return dt == KILN_F32 ? (wgrad_ukernel){wgrad_ukernel_f32, MR_F32, NR_F32}
                        : (wgrad_ukernel){wgrad_ukernel_f64, MR_F64, NR_F64};
}
