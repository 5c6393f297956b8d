/* peak.h — the machine's f32 FMA peak in GFLOP/s, measured: independent
 * chains of fused multiply-adds in the widest vectors the CPU has (AVX-512,
 * else AVX2 + FMA, else SSE multiply and add), timed on one thread and on
 * `threads` threads at once. The figure a compute-bound kernel is a fraction
 * of, taken in the same run as the kernel (the machines are shared and not
 * always the same CPU). */
#ifndef KILN_BENCH_PEAK_H
#define KILN_BENCH_PEAK_H

#include <pthread.h>

#include "bench_util.h"

#if defined(__x86_64__)
#include <immintrin.h>

enum { PEAK_CHAINS = 12, PEAK_ITERS = 1 << 22 };

__attribute__((target("avx512f"))) static double peak_avx512(void) {
  __m512 acc[PEAK_CHAINS], a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
  double t0 = now_s();
  for (int i = 0; i < PEAK_ITERS; i++)
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  double t = now_s() - t0;
  volatile float sink = 0;
  for (int c = 0; c < PEAK_CHAINS; c++) sink += _mm512_reduce_add_ps(acc[c]);
  (void)sink;
  return 2.0 * 16 * PEAK_CHAINS * (double)PEAK_ITERS / t * 1e-9;
}

__attribute__((target("avx2,fma"))) static double peak_avx2(void) {
  __m256 acc[PEAK_CHAINS], a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
  double t0 = now_s();
  for (int i = 0; i < PEAK_ITERS; i++)
    for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  double t = now_s() - t0;
  float out[8];
  volatile float sink = 0;
  for (int c = 0; c < PEAK_CHAINS; c++) {
    _mm256_storeu_ps(out, acc[c]);
    sink += out[0];
  }
  (void)sink;
  return 2.0 * 8 * PEAK_CHAINS * (double)PEAK_ITERS / t * 1e-9;
}

#endif

/* one thread's peak: the best of 3 timings (0 where it is not measured:
 * not x86-64, or no FMA) */
static double peak_one(void) {
#if !defined(__x86_64__)
  return 0;
#else
  double best = 0;
  for (int r = 0; r < 3; r++) {
    double g = __builtin_cpu_supports("avx512f") ? peak_avx512()
               : __builtin_cpu_supports("fma")    ? peak_avx2()
                                                  : 0;
    if (g > best) best = g;
  }
  return best;
#endif
}

static void *peak_thread(void *out) {
  *(double *)out = peak_one();
  return NULL;
}

/* the peak of `threads` threads running at once (their sum) */
static inline double peak_gflops(int threads) {
  if (threads < 1) threads = 1;
  if (threads > 64) threads = 64;
  pthread_t th[64];
  double g[64] = {0}, sum = 0;
  int ok[64] = {0};
  for (int t = 1; t < threads; t++) ok[t] = !pthread_create(&th[t], NULL, peak_thread, &g[t]);
  g[0] = peak_one();
  for (int t = 1; t < threads; t++)
    if (ok[t]) pthread_join(th[t], NULL);
  for (int t = 0; t < threads; t++) sum += g[t];
  return sum;
}

#endif
