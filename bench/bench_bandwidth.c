/* bench_bandwidth.c — how close large eager elementwise ops come to the
 * machine's memory bandwidth: a 16M-element f32 add and tanh in GB/s (bytes
 * read + written), beside a STREAM-style triad a[i] = b[i] + s*c[i] measured in
 * the same run, single-threaded and on kiln_num_threads() pthreads. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

enum { N = 16 * 1024 * 1024, RUNS = 9, MAX_THREADS = 256 };

/* ---- the triad peer ---- */
static float *ta, *tb, *tc;
static const float scale = 3.0f;

typedef struct {
  int64_t begin, end;
} range;

static void triad(int64_t begin, int64_t end) {
  float *restrict a = ta;
  const float *restrict b = tb, *restrict c = tc;
  for (int64_t i = begin; i < end; i++) a[i] = b[i] + scale * c[i];
}

static void *triad_thread(void *arg) {
  const range *r = arg;
  triad(r->begin, r->end);
  return NULL;
}

/* Runs the triad on nthreads threads (the caller being one); seconds. */
static double triad_seconds(int nthreads) {
  pthread_t tid[MAX_THREADS];
  range r[MAX_THREADS];
  bool started[MAX_THREADS] = {false};
  for (int t = 0; t < nthreads; t++) {
    r[t].begin = (int64_t)N * t / nthreads;
    r[t].end = (int64_t)N * (t + 1) / nthreads;
  }
  double t0 = now_s();
  for (int t = 1; t < nthreads; t++) {
    started[t] = pthread_create(&tid[t], NULL, triad_thread, &r[t]) == 0;
    if (!started[t]) triad(r[t].begin, r[t].end); /* no thread: do its part here */
  }
  triad(r[0].begin, r[0].end);
  for (int t = 1; t < nthreads; t++)
    if (started[t]) pthread_join(tid[t], NULL);
  return now_s() - t0;
}

static double triad_gbs(int nthreads) {
  double s[RUNS];
  triad_seconds(nthreads); /* warm-up */
  for (int r = 0; r < RUNS; r++) s[r] = triad_seconds(nthreads);
  return 3.0 * N * sizeof(float) / median(s, RUNS) / 1e9;
}

/* ---- Kiln ---- */
typedef kiln_tensor *(*binary_op)(kiln_tensor *, kiln_tensor *);
typedef kiln_tensor *(*unary_op)(kiln_tensor *);

/* GB/s of one eager op (bytes = inputs read + output written); the op alone
 * is timed, its result is released after. 0 on failure. */
static double kiln_gbs(binary_op bin, unary_op un, kiln_tensor *x, kiln_tensor *y) {
  double s[RUNS];
  for (int r = -1; r < RUNS; r++) { /* run -1 warms up */
    kiln_scope_push();
    double t0 = now_s();
    kiln_tensor *z = bin ? bin(x, y) : un(x);
    double t1 = now_s();
    kiln_scope_pop();
    if (!z) {
      fprintf(stderr, "bench_bandwidth: %s\n", kiln_last_error());
      return 0;
    }
    if (r >= 0) s[r] = t1 - t0;
  }
  double bytes = (bin ? 3.0 : 2.0) * N * sizeof(float);
  return bytes / median(s, RUNS) / 1e9;
}

int main(void) {
  int nthreads = kiln_num_threads();
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  size_t bytes = (size_t)N * sizeof(float);
  ta = aligned_alloc(64, bytes);
  tb = aligned_alloc(64, bytes);
  tc = aligned_alloc(64, bytes);
  if (!ta || !tb || !tc) {
    fprintf(stderr, "bench_bandwidth: out of memory\n");
    return 1;
  }
  for (int64_t i = 0; i < N; i++) {
    ta[i] = 0;
    tb[i] = (float)(i & 1023);
    tc[i] = 1.0f / (float)(1 + (i & 7));
  }

  kiln_random_seed(1);
  kiln_tensor *x = kiln_random_uniform(KILN_F32, KILN_SHAPE(N), -2, 2);
  kiln_tensor *y = kiln_random_uniform(KILN_F32, KILN_SHAPE(N), -2, 2);
  if (!x || !y) {
    fprintf(stderr, "bench_bandwidth: %s\n", kiln_last_error());
    return 1;
  }

  double triad1 = triad_gbs(1);
  double triadn = triad_gbs(nthreads);
  double add = kiln_gbs(kiln_add, NULL, x, y);
  double tanh_ = kiln_gbs(NULL, kiln_tanh, x, NULL);

  printf("triad a=b+s*c, 16M f32, 1 thread:   %6.1f GB/s\n", triad1);
  printf("triad a=b+s*c, 16M f32, %d thread(s): %6.1f GB/s\n", nthreads, triadn);
  printf("kiln add,  16M f32:                 %6.1f GB/s  (kiln/triad %.2f)\n", add,
         add / triadn);
  printf("kiln tanh, 16M f32:                 %6.1f GB/s  (kiln/triad %.2f)\n", tanh_,
         tanh_ / triadn);
  printf("(medians of %d runs; bytes = read + written; kiln %s uses %d thread(s); check %.1f)\n",
         RUNS, kiln_version(), kiln_num_threads(), (double)ta[N / 3]);

  kiln_release(x);
  kiln_release(y);
  free(ta);
  free(tb);
  free(tc);
  return add > 0 && tanh_ > 0 ? 0 : 1;
}
