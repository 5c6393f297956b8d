/* kernels_matmul.c — CPU kernels of DOT (kiln_matmul): batched matrix
 * products whose leading dimensions broadcast as NumPy does. f32 and f64 use
 * a BLIS-style GEMM (packed panels, a register-tiled micro-kernel, threads
 * over blocks of C) whose micro-kernel is the C one below or, for big
 * products, the one the CPU backend compiles (lib/matmul.h); small products,
 * integers and vector shapes skip the packing. The float products can end
 * in an epilogue (+ bias, relu, tanh) applied as the tiles are stored. */
#include <math.h>

#include "matmul.h"

#include "ukernel.h"

/* Cache blocks, in elements: an MC x KC block of A and a KC x NC panel of B
 * are packed per task; the micro-kernel walks the packed B panel against one
 * A micro-panel at a time (which then stays in L1). KC is the same for every
 * micro-kernel: it fixes where partial sums are rounded into C, so the C and
 * the LLVM micro-kernels give the same bits. */
enum { KC_F32 = 256, MC_F32 = 192, NC_F32 = 1024 };
enum { KC_F64 = 256, MC_F64 = 96, NC_F64 = 1024 };

/* m*n*k up to which unpacked strips beat packing; least m*n*k per task
 * when threaded; columns per task of the unpacked path */
#define SMALL_WORK ((int64_t)24 * 24 * 24)
#define TASK_WORK ((int64_t)1 << 18)
enum { COL_GROUP = 256, LANES = 16 };

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static _Atomic(gemm_provider_fn) provider;

void matmul_set_provider(gemm_provider_fn fn) { atomic_store(&provider, fn); }

/* One matrix product C[m,n] = A[m,k] B[k,n], all row-major, then the
 * epilogue (bias: n values). */
typedef struct {
  int64_t m, n, k, lda, ldb, ldc;
  const void *a, *b;
  void *c;
  const void *bias;
  gemm_epilogue epi;
  /* A given transposed (element (i, p) at a[p * lda + i]), B given
   * transposed (element (p, j) at b[j * ldb + p]): read so by the packing */
  bool ta, tb;
} gemm_args;

/* The threaded BLIS path splits C into a tm x tn grid of tasks. */
typedef struct {
  const gemm_args *g;
  gemm_ukernel uk;
  int64_t tn, mstep, nstep;
  atomic_int failed; /* a task could not allocate its packing buffers */
} gemm_job;

static void grid(const gemm_args *g, int64_t mr, int64_t nr, bool parallel, gemm_job *job) {
  int64_t threads = parallel ? kiln_num_threads() : 1;
  int64_t want = min64(threads, g->m * g->n * g->k / TASK_WORK);
  int64_t best_tm = 1, best_tn = 1;
  double best = -1;
  /* want tasks as tm x tn, each at least one register tile; a task packs its
   * rows of A and its columns of B, so squarish tasks copy the least */
  for (; want > 1 && best < 0; want--) {
    for (int64_t tn = 1; tn <= want; tn++) {
      int64_t tm = want / tn;
      if (tm * tn != want || tm > (g->m + mr - 1) / mr || tn > (g->n + nr - 1) / nr) continue;
      double cost = (double)g->m / (double)tm + (double)g->n / (double)tn;
      if (best < 0 || cost < best) best = cost, best_tm = tm, best_tn = tn;
    }
  }
  job->g = g;
  job->tn = best_tn;
  job->mstep = round_up((g->m + best_tm - 1) / best_tm, mr);
  job->nstep = round_up((g->n + best_tn - 1) / best_tn, nr);
  atomic_init(&job->failed, 0);
}

/* EPILOGUE(T, SUF, TANH): the epilogue of one element (the C micro-kernel and the
 * unpacked products); the relu keeps NaN as the relu kernel does. */
#define EPILOGUE(T, SUF, TANH)                                                              \
  static inline T epilogue_##SUF(T x, T bias, gemm_epilogue epi) {                          \
    x += bias;                                                                              \
    if (epi == GEMM_EPI_BIAS_RELU) return x < 0 ? (T)0 : x;                                 \
    if (epi == GEMM_EPI_BIAS_TANH) return TANH(x);                                          \
    return x;                                                                               \
  }                                                                                         \
  static void epilogue_row_##SUF(T *c, const T *bias, int64_t n, gemm_epilogue epi) {      \
    if (epi != GEMM_EPI_NONE)                                                               \
      for (int64_t j = 0; j < n; j++) c[j] = epilogue_##SUF(c[j], bias[j], epi);            \
  }
EPILOGUE(float, f32, tanhf)
EPILOGUE(double, f64, tanh)

/* GEMM_UKERNEL(T, SUF, ESUF, FMA, MR, NR, ATTR): the C micro-kernel of one
 * float type (epilogue_##ESUF) and register tile (ATTR: its target, compat.h) */
#define GEMM_UKERNEL(T, SUF, ESUF, FMA, MR, NR, ATTR)                                                  \
  static inline void ukernel_core_##SUF(int64_t kc, const T *KILN_RESTRICT a,                     \
                                        const T *KILN_RESTRICT b, T *KILN_RESTRICT c, int64_t ldc, \
                                        bool add) {                                                \
    T acc[MR][NR];                                                                                 \
    for (int i = 0; i < MR; i++)                                                                   \
      for (int j = 0; j < NR; j++) acc[i][j] = 0;                                                  \
    for (int64_t p = 0; p < kc; p++, a += MR, b += NR) {                                           \
      for (int i = 0; i < MR; i++) {                                                               \
        T ai = a[i];                                                                               \
        for (int j = 0; j < NR; j++) acc[i][j] = FMA(ai, b[j], acc[i][j]);                         \
      }                                                                                            \
    }                                                                                              \
    if (add) {                                                                                     \
      for (int i = 0; i < MR; i++)                                                                 \
        for (int j = 0; j < NR; j++) c[i * ldc + j] += acc[i][j];                                  \
    } else {                                                                                       \
      for (int i = 0; i < MR; i++)                                                                 \
        for (int j = 0; j < NR; j++) c[i * ldc + j] = acc[i][j];                                   \
    }                                                                                              \
  }                                                                                                \
                                                                                                   \
  /* the C micro-kernel (gemm_ukernel_fn): edge tiles and epilogues through a                      \
   * tile of its own */                                                                            \
  ATTR static void ukernel_##SUF(int64_t kc, const void *a, const void *b, void *vc, int64_t ldc,  \
                            int64_t mr, int64_t nr, int32_t flags, const void *vbias) {            \
    bool add = flags & GEMM_ACCUMULATE;                                                            \
    gemm_epilogue epi = GEMM_EPI_NONE;                                                             \
    if (flags & GEMM_LAST) epi = (gemm_epilogue)(flags >> GEMM_EPI_SHIFT);                         \
    T *c = vc;                                                                                     \
    if (mr == MR && nr == NR && epi == GEMM_EPI_NONE) {                                            \
      ukernel_core_##SUF(kc, a, b, c, ldc, add);                                                   \
      return;                                                                                      \
    }                                                                                              \
    T tile[MR * NR];                                                                               \
    const T *bias = vbias;                                                                         \
    ukernel_core_##SUF(kc, a, b, tile, NR, false);                                                 \
    for (int64_t i = 0; i < mr; i++) {                                                             \
      for (int64_t j = 0; j < nr; j++) {                                                           \
        T v = (add ? c[i * ldc + j] : 0) + tile[i * NR + j];                                       \
        c[i * ldc + j] = epi == GEMM_EPI_NONE ? v : epilogue_##ESUF(v, bias[j], epi);              \
      }                                                                                            \
    }                                                                                              \
  }                                                                                                \

/* GEMM_BLOCKED(T, SUF, FMA, MR, NR, KC, MC, NC): the blocked product for one
 * float type, over the C micro-kernel ukernel_##SUF (ukernel_z_##SUF, the
 * AVX-512 tile, where the CPU has AVX-512 in the multiversioned build). Packed A holds micro-panels of uk.mr
 * rows, k-major (rows past m are zero); packed B holds micro-panels of uk.nr
 * columns, k-major (columns past n are zero), so edge tiles run the full
 * kernel on zeros and only the valid part is stored. */
#define GEMM_BLOCKED(T, SUF, FMA, MR, NR, KC, MC, NC)                                              \
  /* one micro-panel of rows [0, h) of mr (a constant where it is inlined): \
   * p outer, so that the writes run contiguous */                                                \
  static inline void pack_panel_##SUF(int64_t h, int64_t kc, const T *a, int64_t lda, int64_t mr, \
                                      T *KILN_RESTRICT ap) {                                       \
    if (h == mr) {                                                                                 \
      for (int64_t p = 0; p < kc; p++, ap += mr)                                                   \
        for (int64_t i = 0; i < mr; i++) ap[i] = a[i * lda + p];                                   \
    } else {                                                                                       \
      for (int64_t p = 0; p < kc; p++, ap += mr)                                                   \
        for (int64_t i = 0; i < mr; i++) ap[i] = i < h ? a[i * lda + p] : 0;                       \
    }                                                                                              \
  }                                                                                                \
                                                                                                   \
  /* the same from A given transposed: each step of k is h contiguous values */                  \
  static void pack_panel_t_##SUF(int64_t h, int64_t kc, const T *a, int64_t lda, int64_t mr,      \
                                 T *KILN_RESTRICT ap) {                                            \
    for (int64_t p = 0; p < kc; p++, ap += mr)                                                     \
      for (int64_t i = 0; i < mr; i++) ap[i] = i < h ? a[p * lda + i] : 0;                         \
  }                                                                                                \
                                                                                                   \
  KILN_HOT static void pack_a_##SUF(int64_t mc, int64_t kc, const T *a, int64_t lda, int64_t mr, bool ta,   \
                           T *KILN_RESTRICT ap) {                                                  \
    for (int64_t r = 0; r < mc; r += mr, ap += mr * kc) {                                          \
      int64_t h = min64(mr, mc - r);                                                               \
      if (ta) {                                                                                    \
        pack_panel_t_##SUF(h, kc, a + r, lda, mr, ap);                                             \
        continue;                                                                                  \
      }                                                                                            \
      switch (mr) { /* the register tiles in use, unrolled */                                      \
        case 6: pack_panel_##SUF(h, kc, a + r * lda, lda, 6, ap); break;                           \
        case 8: pack_panel_##SUF(h, kc, a + r * lda, lda, 8, ap); break;                           \
        case 12: pack_panel_##SUF(h, kc, a + r * lda, lda, 12, ap); break;                         \
        case 14: pack_panel_##SUF(h, kc, a + r * lda, lda, 14, ap); break;                         \
        default: pack_panel_##SUF(h, kc, a + r * lda, lda, mr, ap); break;                         \
      }                                                                                            \
    }                                                                                              \
  }                                                                                                \
                                                                                                   \
  KILN_HOT static void pack_b_##SUF(int64_t kc, int64_t nc, const T *b, int64_t ldb, int64_t nr, bool tb,   \
                           T *KILN_RESTRICT bp) {                                                  \
    for (int64_t q = 0; q < nc; q += nr) {                                                         \
      int64_t w = min64(nr, nc - q);                                                               \
      if (tb) { /* B given transposed: column j of the panel is a contiguous row */               \
        for (int64_t j = 0; j < nr; j++) {                                                         \
          const T *row = b + (q + j) * ldb;                                                        \
          for (int64_t p = 0; p < kc; p++) bp[p * nr + j] = j < w ? row[p] : 0;                    \
        }                                                                                          \
        bp += nr * kc;                                                                             \
        continue;                                                                                  \
      }                                                                                            \
      const T *src = b + q;                                                                        \
      if (w == NR && nr == NR) { /* the common case, in whole vectors */                          \
        for (int64_t p = 0; p < kc; p++, bp += NR, src += ldb)                                     \
          for (int j = 0; j < NR; j++) bp[j] = src[j];                                             \
      } else {                                                                                     \
        for (int64_t p = 0; p < kc; p++, bp += nr, src += ldb)                                     \
          for (int64_t j = 0; j < nr; j++) bp[j] = j < w ? src[j] : 0;                             \
      }                                                                                            \
    }                                                                                              \
  }                                                                                                \
                                                                                                   \
  /* C[m0:m1, n0:n1] with the caller's packing buffers */                                          \
  static void block_range_##SUF(const gemm_job *job, int64_t m0, int64_t m1, int64_t n0,           \
                                int64_t n1, T *ap, T *bp) {                                        \
    const gemm_args *g = job->g;                                                                   \
    const T *A = g->a, *B = g->b, *bias = g->bias;                                                 \
    T *C = g->c;                                                                                   \
    gemm_ukernel_fn fn = job->uk.fn;                                                               \
    int64_t umr = job->uk.mr, unr = job->uk.nr, mcb = MC / umr * umr;                              \
    for (int64_t jc = n0; jc < n1; jc += NC) {                                                     \
      int64_t nc = min64(NC, n1 - jc);                                                             \
      for (int64_t pc = 0; pc < g->k; pc += KC) {                                                  \
        int64_t kc = min64(KC, g->k - pc);                                                         \
        int32_t flags = (pc > 0 ? GEMM_ACCUMULATE : 0) | (pc + kc == g->k ? GEMM_LAST : 0) |       \
                        (int32_t)g->epi << GEMM_EPI_SHIFT;                                         \
        pack_b_##SUF(kc, nc, g->tb ? B + jc * g->ldb + pc : B + pc * g->ldb + jc, g->ldb, unr, g->tb, \
                     bp);                                                                          \
        for (int64_t ic = m0; ic < m1; ic += mcb) {                                                \
          int64_t mc = min64(mcb, m1 - ic);                                                        \
          pack_a_##SUF(mc, kc, g->ta ? A + pc * g->lda + ic : A + ic * g->lda + pc, g->lda, umr,   \
                       g->ta, ap);                                                                 \
          for (int64_t ir = 0; ir < mc; ir += umr) {                                               \
            int64_t mr = min64(umr, mc - ir);                                                      \
            for (int64_t jr = 0; jr < nc; jr += unr) {                                             \
              int64_t nr = min64(unr, nc - jr);                                                    \
              fn(kc, ap + ir * kc, bp + jr * kc, C + (ic + ir) * g->ldc + jc + jr, g->ldc, mr, nr, \
                 flags, bias ? bias + jc + jr : NULL);                                             \
            }                                                                                      \
          }                                                                                        \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
  }                                                                                                \
                                                                                                   \
  static void blocked_task_##SUF(void *ctx, int64_t begin, int64_t end) {                          \
    gemm_job *job = ctx;                                                                           \
    const gemm_args *g = job->g;                                                                   \
    int64_t umr = job->uk.mr, unr = job->uk.nr;                                                    \
    int64_t kc = min64(KC, g->k), mc = round_up(min64(MC / umr * umr, job->mstep), umr);           \
    int64_t nc = round_up(min64(NC, job->nstep), unr);                                             \
    int32_t acls, bcls;                                                                            \
    T *ap = mem_alloc((size_t)(mc * kc) * sizeof(T), &acls);                                       \
    T *bp = mem_alloc((size_t)(kc * nc) * sizeof(T), &bcls);                                       \
    if (ap && bp) {                                                                                \
      for (int64_t t = begin; t < end; t++) {                                                      \
        int64_t m0 = t / job->tn * job->mstep, n0 = t % job->tn * job->nstep;                      \
        if (m0 < g->m && n0 < g->n)                                                                \
          block_range_##SUF(job, m0, min64(g->m, m0 + job->mstep), n0,                             \
                            min64(g->n, n0 + job->nstep), ap, bp);                                 \
      }                                                                                            \
    } else {                                                                                       \
      atomic_store(&job->failed, 1);                                                               \
    }                                                                                              \
    if (ap) mem_free(ap, acls);                                                                    \
    if (bp) mem_free(bp, bcls);                                                                    \
  }                                                                                                \
                                                                                                   \
  static int blocked_##SUF(const gemm_args *g, bool parallel, bool jit) {                          \
    gemm_job job;                                                                                  \
    gemm_provider_fn get = atomic_load(&provider);                                                 \
    if (!jit || !get || !get(KILN_##SUF##_DT, g->epi, &job.uk))                                   \
      job.uk = c_ukernel_##SUF();                                                                  \
    grid(g, job.uk.mr, job.uk.nr, parallel, &job);                                                 \
    int64_t tm = (g->m + job.mstep - 1) / job.mstep;                                               \
    parallel_for(tm *job.tn, 1, blocked_task_##SUF, &job);                                         \
    return atomic_load(&job.failed) ? -1 : 0;                                                      \
  }

#define KILN_f32_DT KILN_F32
#define KILN_f64_DT KILN_F64
GEMM_UKERNEL(float, f32, f32, FMA_F32, MR_F32, NR_F32, KILN_HOT KILN_TILE)
GEMM_UKERNEL(double, f64, f64, FMA_F64, MR_F64, NR_F64, KILN_HOT KILN_TILE)
#if KILN_MULTIVERSION
GEMM_UKERNEL(float, z_f32, f32, FMA_F32, MR_Z_F32, NR_Z_F32, KILN_HOT_AVX512 KILN_TILE)
GEMM_UKERNEL(double, z_f64, f64, FMA_F64, MR_Z_F64, NR_Z_F64, KILN_HOT_AVX512 KILN_TILE)
static gemm_ukernel c_ukernel_f32(void) {
  return KILN_HAVE_AVX512() ? (gemm_ukernel){ukernel_z_f32, MR_Z_F32, NR_Z_F32}
                            : (gemm_ukernel){ukernel_f32, MR_F32, NR_F32};
}
static gemm_ukernel c_ukernel_f64(void) {
  return KILN_HAVE_AVX512() ? (gemm_ukernel){ukernel_z_f64, MR_Z_F64, NR_Z_F64}
                            : (gemm_ukernel){ukernel_f64, MR_F64, NR_F64};
}
#else
static gemm_ukernel c_ukernel_f32(void) { return (gemm_ukernel){ukernel_f32, MR_F32, NR_F32}; }
static gemm_ukernel c_ukernel_f64(void) { return (gemm_ukernel){ukernel_f64, MR_F64, NR_F64}; }
#endif

GEMM_BLOCKED(float, f32, FMA_F32, MR_F32, NR_F32, KC_F32, MC_F32, NC_F32)
GEMM_BLOCKED(double, f64, FMA_F64, MR_F64, NR_F64, KC_F64, MC_F64, NC_F64)


/* c[j] = a . w[j, :] for the n rows of w (k each): one dot product per row
 * over LANES partial sums, reduced as the n = 1 product reduces them, four
 * rows at a time (four independent chains of FMAs) */
#define NT_ROWS(SUF, T, U, MADD)                                                                 \
  KILN_HOT static void nt_row_##SUF(const T *a, const T *w, T *c, int64_t n, int64_t k) {                 \
    const U *KILN_RESTRICT x = (const U *)a;                                                       \
    int64_t j = 0;                                                                                 \
    for (; j < n; j += 4) {                                                                        \
      int rows = n - j < 4 ? (int)(n - j) : 4;                                                     \
      const U *KILN_RESTRICT r0 = (const U *)(w + j * k);                                          \
      const U *KILN_RESTRICT r1 = rows > 1 ? r0 + k : r0, *KILN_RESTRICT r2 = rows > 2 ? r0 + 2 * k : r0; \
      const U *KILN_RESTRICT r3 = rows > 3 ? r0 + 3 * k : r0;                                      \
      U p0[LANES] = {0}, p1[LANES] = {0}, p2[LANES] = {0}, p3[LANES] = {0};                        \
      int64_t p = 0;                                                                               \
      for (; p + LANES <= k; p += LANES)                                                           \
        for (int l = 0; l < LANES; l++) {                                                          \
          U v = x[p + l];                                                                          \
          p0[l] = MADD(v, r0[p + l], p0[l]);                                                       \
          p1[l] = MADD(v, r1[p + l], p1[l]);                                                       \
          p2[l] = MADD(v, r2[p + l], p2[l]);                                                       \
          p3[l] = MADD(v, r3[p + l], p3[l]);                                                       \
        }                                                                                          \
      for (; p < k; p++) {                                                                         \
        p0[0] = MADD(x[p], r0[p], p0[0]);                                                          \
        p1[0] = MADD(x[p], r1[p], p1[0]);                                                          \
        p2[0] = MADD(x[p], r2[p], p2[0]);                                                          \
        p3[0] = MADD(x[p], r3[p], p3[0]);                                                          \
      }                                                                                            \
      for (int h = LANES / 2; h >= 1; h /= 2)                                                      \
        for (int l = 0; l < h; l++) p0[l] += p0[l + h], p1[l] += p1[l + h], p2[l] += p2[l + h], p3[l] += p3[l + h]; \
      U s[4] = {p0[0], p1[0], p2[0], p3[0]};                                                       \
      for (int q = 0; q < rows; q++) c[j + q] = (T)s[q];                                           \
    }                                                                                              \
  }

/* ---- unpacked products: small ones, integers, and m or n of 1 ----
 * Each row of C is computed in strips whose accumulators stay in registers
 * while k runs (accumulating into C itself would chain every step through a
 * store and a reload). U is the arithmetic type: T for floats, the unsigned
 * type of T's width for integers, so integer products wrap without undefined
 * behaviour. */

#define STRIP(SUF, T, U, MADD, W, TILE)                                                       \
  KILN_HOT TILE static void strip_##SUF##_##W(int64_t k, const T *a, const T *b, int64_t ldb, T *c) { \
    U acc[W];                                                                           \
    for (int j = 0; j < W; j++) acc[j] = 0;                                             \
    for (int64_t p = 0; p < k; p++) {                                                   \
      U ap = (U)a[p];                                                                   \
      const U *KILN_RESTRICT bp = (const U *)(b + p * ldb);                             \
      for (int j = 0; j < W; j++) acc[j] = MADD(ap, bp[j], acc[j]);                     \
    }                                                                                   \
    memcpy(c, acc, sizeof acc);                                                         \
  }

/* UNPACKED(SUF, T, U, MADD, W4, W2, W1, W0, TILE): strips of W4 columns
 * (four vectors), then one each of W2, W1, W0, then single columns. TILE:
 * KILN_TILE for the float strips, whose accumulators are a register tile
 * (libkiln_rt's batch-1 products: 20.5 us per MLP call at -O2, 13 us with
 * it; the integer strips stay -O2 there, for the rt's size) */
#define UNPACKED(SUF, T, U, MADD, W4, W2, W1, W0, TILE)                                             \
  STRIP(SUF, T, U, MADD, W4, TILE)                                                            \
  STRIP(SUF, T, U, MADD, W2, TILE)                                                            \
  STRIP(SUF, T, U, MADD, W1, TILE)                                                            \
  STRIP(SUF, T, U, MADD, W0, TILE)                                                            \
                                                                                              \
  /* C[i, j0:j1] */                                                                           \
  static void row_part_##SUF(const gemm_args *g, int64_t i, int64_t j, int64_t j1) {          \
    const T *a = (const T *)g->a + i * g->lda, *b = g->b;                                     \
    T *c = (T *)g->c + i * g->ldc;                                                            \
    for (; j + W4 <= j1; j += W4) strip_##SUF##_##W4(g->k, a, b + j, g->ldb, c + j);          \
    if (j + W2 <= j1) strip_##SUF##_##W2(g->k, a, b + j, g->ldb, c + j), j += W2;             \
    if (j + W1 <= j1) strip_##SUF##_##W1(g->k, a, b + j, g->ldb, c + j), j += W1;             \
    if (j + W0 <= j1) strip_##SUF##_##W0(g->k, a, b + j, g->ldb, c + j), j += W0;             \
    for (; j < j1; j++) {                                                                     \
      U s = 0;                                                                                \
      for (int64_t p = 0; p < g->k; p++) s = MADD((U)a[p], (U)b[p * g->ldb + j], s);          \
      c[j] = (T)s;                                                                            \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
  /* units [begin, end) of (row, group of COL_GROUP columns) */                               \
  static void unpacked_task_##SUF(void *ctx, int64_t begin, int64_t end) {                    \
    const gemm_args *g = ctx;                                                                 \
    int64_t groups = (g->n + COL_GROUP - 1) / COL_GROUP;                                      \
    for (int64_t u = begin; u < end; u++) {                                                   \
      int64_t i = u / groups, j0 = u % groups * COL_GROUP;                                    \
      int64_t j1 = min64(g->n, j0 + COL_GROUP);                                               \
      row_part_##SUF(g, i, j0, j1);                                                           \
      if (g->epi)                                                                             \
        epilogue_row_##SUF((T *)g->c + i * g->ldc + j0, (const T *)g->bias + j0, j1 - j0, g->epi); \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
  /* rows [begin, end) when n is 1 (B is one contiguous column): dot                          \
   * products over LANES partial sums, which vectorize */                                     \
  KILN_HOT static void gemv_task_##SUF(void *ctx, int64_t begin, int64_t end) {                        \
    const gemm_args *g = ctx;                                                                 \
    if (g->lda == g->k && g->ldc == 1 && !g->epi) { /* the same sums, four rows at a time */ \
      nt_row_##SUF(g->b, (const T *)g->a + begin * g->k, (T *)g->c + begin, end - begin, g->k); \
      return;                                                                                 \
    }                                                                                         \
    const U *KILN_RESTRICT b = g->b;                                                          \
    for (int64_t i = begin; i < end; i++) {                                                   \
      const U *KILN_RESTRICT a = (const U *)((const T *)g->a + i * g->lda);                   \
      U part[LANES] = {0};                                                                    \
      int64_t p = 0;                                                                          \
      for (; p + LANES <= g->k; p += LANES)                                                   \
        for (int j = 0; j < LANES; j++) part[j] = MADD(a[p + j], b[p + j], part[j]);          \
      for (; p < g->k; p++) part[0] = MADD(a[p], b[p], part[0]);                              \
      for (int w = LANES / 2; w >= 1; w /= 2)                                                 \
        for (int j = 0; j < w; j++) part[j] += part[j + w];                                   \
      ((T *)g->c)[i * g->ldc] = (T)part[0];                                                   \
      if (g->epi) epilogue_row_##SUF((T *)g->c + i * g->ldc, g->bias, 1, g->epi);             \
    }                                                                                         \
  }                                                                                           \
                                                                                              \
  static int unpacked_##SUF(const gemm_args *g, bool parallel) {                              \
    if (g->n == 1) {                                                                          \
      parallel_for(g->m, parallel ? TASK_WORK / g->k + 1 : g->m, gemv_task_##SUF, (void *)g); \
      return 0;                                                                               \
    }                                                                                         \
    int64_t groups = (g->n + COL_GROUP - 1) / COL_GROUP, units = g->m * groups;               \
    int64_t unit_work = g->k * min64(g->n, COL_GROUP);                                        \
    parallel_for(units, parallel ? TASK_WORK / unit_work + 1 : units, unpacked_task_##SUF,    \
                 (void *)g);                                                                  \
    return 0;                                                                                 \
  }

#define MADD_WRAP(a, b, c) ((a) * (b) + (c))
/* integer products have no epilogue */
#define NO_EPILOGUE(T, SUF)                                                                    \
  static inline void epilogue_row_##SUF(T *c, const T *bias, int64_t n, gemm_epilogue epi) { \
    (void)c, (void)bias, (void)n, (void)epi;                                                  \
  }
NO_EPILOGUE(int32_t, i32)
NO_EPILOGUE(int64_t, i64)
NT_ROWS(f32, float, float, FMA_F32)
NT_ROWS(f64, double, double, FMA_F64)
NT_ROWS(i32, int32_t, uint32_t, MADD_WRAP)
NT_ROWS(i64, int64_t, uint64_t, MADD_WRAP)
UNPACKED(f32, float, float, FMA_F32, 64, 32, 16, 8, KILN_TILE)
UNPACKED(f64, double, double, FMA_F64, 32, 16, 8, 4, KILN_TILE)
UNPACKED(i32, int32_t, uint32_t, MADD_WRAP, 64, 32, 16, 8, )
UNPACKED(i64, int64_t, uint64_t, MADD_WRAP, 32, 16, 8, 4, )

/* A product with an operand given transposed that does not pack: element
 * by element, the sum over k in order with one multiply-add per step from
 * zero, as every other path sums. matmul_trans's callers avoid it (the CPU
 * backend only hands over transposes for products that pack); it is here
 * so that any shape works. */
#define TRANS_PLAIN(SUF, T, U, MADD)                                                               \
  KILN_HOT static void trans_plain_##SUF(const gemm_args *g) {                                             \
    const T *a = g->a, *b = g->b;                                                                  \
    T *c = g->c;                                                                                   \
    for (int64_t i = 0; i < g->m; i++)                                                             \
      for (int64_t j = 0; j < g->n; j++) {                                                         \
        U s = 0;                                                                                   \
        for (int64_t p = 0; p < g->k; p++)                                                         \
          s = MADD((U)(g->ta ? a[p * g->lda + i] : a[i * g->lda + p]),                             \
                   (U)(g->tb ? b[j * g->ldb + p] : b[p * g->ldb + j]), s);                         \
        c[i * g->ldc + j] = (T)s;                                                                  \
      }                                                                                            \
  }
TRANS_PLAIN(f32, float, float, FMA_F32)
TRANS_PLAIN(f64, double, double, FMA_F64)
TRANS_PLAIN(i32, int32_t, uint32_t, MADD_WRAP)
TRANS_PLAIN(i64, int64_t, uint64_t, MADD_WRAP)

/* Packing pays off once the product is big enough and both m and n exceed
 * one vector strip. */
bool matmul_packs(int64_t m, int64_t n, int64_t k) { return m > 1 && n > 1 && m * n * k > SMALL_WORK; }

static int gemm_f32(const gemm_args *g, bool parallel) {
  if (!matmul_packs(g->m, g->n, g->k)) {
    if (!g->ta && !g->tb) return unpacked_f32(g, parallel);
    trans_plain_f32(g);
    return 0;
  }
  return blocked_f32(g, parallel, g->m * g->n * g->k >= MATMUL_JIT_WORK);
}
static int gemm_f64(const gemm_args *g, bool parallel) {
  if (!matmul_packs(g->m, g->n, g->k)) {
    if (!g->ta && !g->tb) return unpacked_f64(g, parallel);
    trans_plain_f64(g);
    return 0;
  }
  return blocked_f64(g, parallel, g->m * g->n * g->k >= MATMUL_JIT_WORK);
}
static int gemm_i32(const gemm_args *g, bool parallel) { return unpacked_i32(g, parallel); }
static int gemm_i64(const gemm_args *g, bool parallel) { return unpacked_i64(g, parallel); }

/* ---- batches ---- */

typedef int (*gemm_fn)(const gemm_args *g, bool parallel);

typedef struct {
  gemm_fn gemm;
  size_t esize;
  const char *a, *b;
  char *c;
  const void *bias;
  gemm_epilogue epi;
  int64_t m, n, k;
  int brank; /* batch dims of the result */
  int64_t bshape[KILN_MAX_RANK], sa[KILN_MAX_RANK], sb[KILN_MAX_RANK]; /* in matrices */
  atomic_int failed;
} dot_ctx;

/* the product for flat batch index t */
static int dot_one(dot_ctx *d, int64_t t, bool parallel) {
  int64_t ia = 0, ib = 0, ic = t;
  for (int i = d->brank - 1; i >= 0; i--) {
    int64_t idx = t % d->bshape[i];
    t /= d->bshape[i];
    ia += idx * d->sa[i];
    ib += idx * d->sb[i];
  }
  gemm_args g = {.m = d->m,
                 .n = d->n,
                 .k = d->k,
                 .lda = d->k,
                 .ldb = d->n,
                 .ldc = d->n,
                 .a = d->a + (size_t)(ia * d->m * d->k) * d->esize,
                 .b = d->b + (size_t)(ib * d->k * d->n) * d->esize,
                 .c = d->c + (size_t)(ic * d->m * d->n) * d->esize,
                 .bias = d->bias,
                 .epi = d->epi};
  return d->gemm(&g, parallel);
}

static void dot_batches(void *ctx, int64_t begin, int64_t end) {
  dot_ctx *d = ctx;
  for (int64_t t = begin; t < end; t++)
    if (dot_one(d, t, false)) atomic_store(&d->failed, 1);
}

/* out = a . b, then the epilogue (f32, f64) with bias */
static int dot_run(const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *bias, gemm_epilogue epi,
                   kiln_tensor *out, gemm_fn gemm) {
  dot_ctx d = {.gemm = gemm,
               .esize = kiln_dtype_sizes[out->dtype],
               .a = a->data,
               .b = b->data,
               .c = out->data,
               .bias = bias ? bias->data : NULL,
               .epi = bias ? epi : GEMM_EPI_NONE,
               .brank = out->rank - 2};
  d.m = out->shape[out->rank - 2];
  d.n = out->shape[out->rank - 1];
  d.k = a->shape[a->rank - 1];
  atomic_init(&d.failed, 0);
  if (out->size == 0) return 0;
  if (d.k == 0) {
    memset(out->data, 0, tensor_bytes(out)); /* an empty sum */
    for (int64_t r = 0; d.epi && r < out->size / d.n; r++) {
      if (out->dtype == KILN_F32) epilogue_row_f32((float *)out->data + r * d.n, d.bias, d.n, d.epi);
      if (out->dtype == KILN_F64) epilogue_row_f64((double *)out->data + r * d.n, d.bias, d.n, d.epi);
    }
    return 0;
  }
  memcpy(d.bshape, out->shape, (size_t)d.brank * sizeof(int64_t));
  broadcast_strides(a->rank - 2, a->shape, d.brank, out->shape, d.sa);
  broadcast_strides(b->rank - 2, b->shape, d.brank, out->shape, d.sb);
  int64_t batches = out->size / (d.m * d.n), work = d.m * d.n * d.k;
  if (batches == 1 || work >= TASK_WORK) {
    /* big matrices: each product uses every thread */
    for (int64_t t = 0; t < batches; t++)
      if (dot_one(&d, t, true)) atomic_store(&d.failed, 1);
  } else {
    parallel_for(batches, TASK_WORK / work + 1, dot_batches, &d);
  }
  if (atomic_load(&d.failed)) return kiln_set_error("matmul: out of memory for packing buffers");
  return 0;
}

static int dot_call(const op_call *c, gemm_fn gemm) {
  return dot_run(c->in[0], c->in[1], NULL, GEMM_EPI_NONE, c->out, gemm);
}

static int dot_f32(const op_call *c) { return dot_call(c, gemm_f32); }
static int dot_f64(const op_call *c) { return dot_call(c, gemm_f64); }
static int dot_i32(const op_call *c) { return dot_call(c, gemm_i32); }
static int dot_i64(const op_call *c) { return dot_call(c, gemm_i64); }

int matmul_epilogue(const kiln_tensor *a, const kiln_tensor *b, const kiln_tensor *bias, gemm_epilogue epi,
                    kiln_tensor *out) {
  if (!a || !b || !out || a->rank < 2 || b->rank < 2 || out->rank < 2 || a->dtype != b->dtype ||
      out->dtype != a->dtype || a->shape[a->rank - 1] != b->shape[b->rank - 2] ||
      out->shape[out->rank - 2] != a->shape[a->rank - 2] || out->shape[out->rank - 1] != b->shape[b->rank - 1])
    return kiln_set_error("matmul: bad operands for a fused matmul");
  if ((int)epi < 0 || epi >= GEMM_EPI_COUNT) return kiln_set_error("matmul: no epilogue %d", (int)epi);
  if (epi != GEMM_EPI_NONE) {
    if (!dtype_is_float((kiln_dtype)a->dtype))
      return kiln_set_error("matmul: an epilogue needs f32 or f64, not %s", kiln_dtype_name((kiln_dtype)a->dtype));
    if (!bias || bias->dtype != a->dtype || bias->size != out->shape[out->rank - 1])
      return kiln_set_error("matmul: the bias must be %lld values of the product's dtype",
                            (long long)out->shape[out->rank - 1]);
  }
  switch (a->dtype) {
    case KILN_F32: return dot_run(a, b, bias, epi, out, gemm_f32);
    case KILN_F64: return dot_run(a, b, bias, epi, out, gemm_f64);
    case KILN_I32: return dot_run(a, b, NULL, GEMM_EPI_NONE, out, gemm_i32);
    case KILN_I64: return dot_run(a, b, NULL, GEMM_EPI_NONE, out, gemm_i64);
    default: return kiln_set_error("matmul: no kernel for %s", kiln_dtype_name((kiln_dtype)a->dtype));
  }
}

/* out = a . transpose(w): per row of a, the rows of w */
#define MATMUL_NT(SUF, T)                                                                          \
  static void nt_##SUF(const kiln_tensor *a, const kiln_tensor *w, kiln_tensor *out) {            \
    int64_t m = a->shape[0], k = a->shape[1], n = w->shape[0];                                     \
    for (int64_t i = 0; i < m; i++)                                                                \
      nt_row_##SUF((const T *)a->data + i * k, w->data, (T *)out->data + i * n, n, k);            \
  }
MATMUL_NT(f32, float)
MATMUL_NT(f64, double)
MATMUL_NT(i32, int32_t)
MATMUL_NT(i64, int64_t)

int matmul_nt(const kiln_tensor *a, const kiln_tensor *w, kiln_tensor *out) {
  if (!a || !w || !out || a->rank != 2 || w->rank != 2 || out->rank != 2 || a->dtype != w->dtype ||
      out->dtype != a->dtype || a->shape[1] != w->shape[1] || out->shape[0] != a->shape[0] ||
      out->shape[1] != w->shape[0])
    return kiln_set_error("matmul: bad operands for a product with a transposed matrix");
  switch (a->dtype) {
    case KILN_F32: nt_f32(a, w, out); return 0;
    case KILN_F64: nt_f64(a, w, out); return 0;
    case KILN_I32: nt_i32(a, w, out); return 0;
    case KILN_I64: nt_i64(a, w, out); return 0;
    default: return kiln_set_error("matmul: no kernel for %s", kiln_dtype_name((kiln_dtype)a->dtype));
  }
}

int matmul_trans(const kiln_tensor *a, const kiln_tensor *b, bool ta, bool tb, kiln_tensor *out) {
  if (!a || !b || !out || a->rank != 2 || b->rank != 2 || out->rank != 2 || a->dtype != b->dtype ||
      out->dtype != a->dtype)
    return kiln_set_error("matmul: bad operands for a product with transposed operands");
  int64_t m = a->shape[ta], k = a->shape[!ta], n = b->shape[!tb];
  if (b->shape[tb] != k || out->shape[0] != m || out->shape[1] != n)
    return kiln_set_error("matmul: bad operands for a product with transposed operands");
  if (!ta && tb && m <= MATMUL_NT_ROWS) return matmul_nt(a, b, out);
  if (out->size == 0) return 0;
  if (k == 0) {
    memset(out->data, 0, tensor_bytes(out)); /* an empty sum */
    return 0;
  }
  gemm_args g = {.m = m, .n = n, .k = k, .lda = a->shape[1], .ldb = b->shape[1], .ldc = n,
                 .a = a->data, .b = b->data, .c = out->data, .ta = ta, .tb = tb};
  int rc = 0;
  switch (a->dtype) {
    case KILN_F32: rc = gemm_f32(&g, true); break;
    case KILN_F64: rc = gemm_f64(&g, true); break;
    case KILN_I32: trans_plain_i32(&g); break;
    case KILN_I64: trans_plain_i64(&g); break;
    default: return kiln_set_error("matmul: no kernel for %s", kiln_dtype_name((kiln_dtype)a->dtype));
  }
  return rc ? kiln_set_error("matmul: out of memory for packing buffers") : 0;
}

KILN_CONSTRUCTOR static void register_kernels(void) {
  dispatch_register(OP_DOT, 0, KILN_F32, dot_f32);
  dispatch_register(OP_DOT, 0, KILN_F64, dot_f64);
  dispatch_register(OP_DOT, 0, KILN_I32, dot_i32);
  dispatch_register(OP_DOT, 0, KILN_I64, dot_i64);
}
