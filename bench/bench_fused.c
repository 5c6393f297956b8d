/* bench_fused.c — the CPU backend's fused kernels against memory bandwidth:
 * tanh(x*a + b)*c + x over 16M f32, built with the IR builder as one fusion
 * (one compiled kernel, read x once, write once), run through cpu_run; beside
 * a STREAM-style triad a[i] = b[i] + s*c[i] measured in the same run, and the
 * same expression as five eager ops. GB/s counts the bytes the expression
 * must move (x read, result written; the triad: two reads, one write),
 * medians of several runs; first on one thread (a child process with
 * KILN_NUM_THREADS=1), then on kiln_num_threads(). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, setenv */
#include <kiln.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "cpu/cpu.h"
#include "ir.h"

enum { N = 16 * 1024 * 1024, RUNS = 11, MAX_THREADS = 64 };

/* ---- the triad peer ---- */
static float *ta, *tb, *tc;

typedef struct {
  int64_t begin, end;
} range;

static void *triad_part(void *arg) {
  const range *r = arg;
  float *restrict a = ta;
  const float *restrict b = tb, *restrict c = tc;
  for (int64_t i = r->begin; i < r->end; i++) a[i] = b[i] + 3.0f * c[i];
  return NULL;
}

static double triad_seconds(int nthreads) {
  pthread_t tid[MAX_THREADS];
  range r[MAX_THREADS];
  bool started[MAX_THREADS] = {false};
  for (int t = 0; t < nthreads; t++) r[t] = (range){(int64_t)N * t / nthreads, (int64_t)N * (t + 1) / nthreads};
  double t0 = now_s();
  for (int t = 1; t < nthreads; t++)
    if (!(started[t] = pthread_create(&tid[t], NULL, triad_part, &r[t]) == 0)) triad_part(&r[t]);
  triad_part(&r[0]);
  for (int t = 1; t < nthreads; t++)
    if (started[t]) pthread_join(tid[t], NULL);
  return now_s() - t0;
}

/* ---- the expression, as IR: @k is the body, @f fuses it ---- */
static ir_func *build(ir_module *m) {
  op_type vec = {KILN_F32, 1, {N}}, scalar = {KILN_F32, 0, {0}};
  op_type params[4] = {vec, scalar, scalar, scalar};
  ir_loc nowhere = {NULL, 0};
  ir_func *k = ir_func_new(m, "k", 4, params);
  op_attrs bc = {0};
  bc.rank = 1;
  bc.shape[0] = N;
  ir_value x = 0, in[2];
  ir_value a = ir_append(k, OP_BROADCAST, &bc, 1, (ir_value[]){1}, nowhere);
  ir_value b = ir_append(k, OP_BROADCAST, &bc, 1, (ir_value[]){2}, nowhere);
  ir_value c = ir_append(k, OP_BROADCAST, &bc, 1, (ir_value[]){3}, nowhere);
  in[0] = x, in[1] = a;
  ir_value xa = ir_append(k, OP_MUL, NULL, 2, in, nowhere);
  in[0] = xa, in[1] = b;
  ir_value xab = ir_append(k, OP_ADD, NULL, 2, in, nowhere);
  ir_value t = ir_append(k, OP_TANH, NULL, 1, &xab, nowhere);
  in[0] = t, in[1] = c;
  ir_value tc = ir_append(k, OP_MUL, NULL, 2, in, nowhere);
  in[0] = tc, in[1] = x;
  ir_value r = ir_append(k, OP_ADD, NULL, 2, in, nowhere);
  if (r < 0 || ir_set_results(k, 1, &r)) return NULL;
  ir_func *f = ir_func_new(m, "f", 4, params);
  op_attrs fa = {0};
  fa.callee = k;
  ir_value fr = ir_append(f, OP_FUSION, &fa, 4, (ir_value[]){0, 1, 2, 3}, nowhere);
  if (fr < 0 || ir_set_results(f, 1, &fr)) return NULL;
  return f;
}

static int run(bool child) {
  int threads = kiln_num_threads();
  ta = aligned_alloc(64, (size_t)N * 4), tb = aligned_alloc(64, (size_t)N * 4), tc = aligned_alloc(64, (size_t)N * 4);
  float *xd = aligned_alloc(64, (size_t)N * 4);
  for (int64_t i = 0; i < N; i++) tb[i] = 1, tc[i] = 2, ta[i] = 0, xd[i] = (float)(i % 1000) * 0.002f - 1;
  kiln_tensor *x = kiln_tensor_new(KILN_F32, KILN_SHAPE(N), xd);
  kiln_tensor *a = kiln_scalar(KILN_F32, 0.5), *b = kiln_scalar(KILN_F32, 0.25), *c = kiln_scalar(KILN_F32, 2);
  ir_module *m = ir_module_new();
  ir_func *f = build(m);
  cpu_program *p = f ? cpu_compile(f) : NULL;
  if (!p) {
    fprintf(stderr, "bench_fused: %s\n", kiln_last_error());
    return 1;
  }
  kiln_tensor *args[4] = {x, a, b, c}, *out = NULL;
  double s[RUNS], e[RUNS];
  triad_seconds(threads); /* warm-up */
  for (int r = 0; r < RUNS; r++) s[r] = triad_seconds(threads);
  double triad = 3.0 * N * 4 / median(s, RUNS) / 1e9;
  cpu_run(p, args, &out); /* warm-up: the result's pages */
  kiln_release(out);
  for (int r = 0; r < RUNS; r++) {
    double t0 = now_s();
    if (cpu_run(p, args, &out)) {
      fprintf(stderr, "bench_fused: %s\n", kiln_last_error());
      return 1;
    }
    s[r] = now_s() - t0;
    kiln_release(out);
    /* the same expression op by op, eagerly */
    kiln_scope_push();
    t0 = now_s();
    kiln_tensor *y = kiln_add(kiln_mul(kiln_tanh(kiln_add(kiln_mul(x, a), b)), c), x);
    e[r] = now_s() - t0;
    if (!y) fprintf(stderr, "bench_fused: eager: %s\n", kiln_last_error());
    kiln_scope_pop();
  }
  double fused = 2.0 * N * 4 / median(s, RUNS) / 1e9, eager = 2.0 * N * 4 / median(e, RUNS) / 1e9;
  printf("%-9s fused tanh(x*a+b)*c+x  %6.2f GB/s  (%5.1f ms, %3.0f%% of triad)   eager %6.2f GB/s   triad %6.2f GB/s\n",
         child ? "1 thread" : (threads == 1 ? "1 thread" : "threads"), fused, median(s, RUNS) * 1e3,
         100 * fused / triad, eager, triad);
  if (!child)
    printf("compile %.1f ms, %d kernel(s); threads: %d\n", cpu_program_compile_ms(p), cpu_program_kernels(p), threads);
  cpu_program_free(p);
  ir_module_free(m);
  kiln_release(x), kiln_release(a), kiln_release(b), kiln_release(c);
  free(ta), free(tb), free(tc), free(xd);
  return 0;
}

int main(void) {
  printf("bench_fused: N = %d f32 (16M), medians of %d runs\n", N, RUNS);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) { /* before any thread exists: one thread for the child */
    setenv("KILN_NUM_THREADS", "1", 1);
    exit(run(true));
  }
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  return run(false);
}
