/* bench_fused.c — the CPU backend's fused kernels against memory bandwidth:
 * tanh(x*a + b)*c + x over 16M f32 (a, b, c f32 scalars). Measured in one
 * run, interleaved run by run:
 *   staged  the expression as a kiln_function body, called through the public
 *           API (whatever kiln_function_call runs: the interpreter before
 *           compiled calls, the LLVM code after);
 *   cpu-opt cpu_compile/cpu_run of that function's optimized IR
 *           (jit_optimized_func), the code compiled calls run;
 *   cpu-ir  the same expression built with the IR builder as one fusion;
 *   eager   five eager ops;
 *   triad   a STREAM-style a[i] = b[i] + s*c[i] on 16M floats in pthreads;
 * and on one thread, as a compute ceiling, the staged expression on 32K
 * elements that stay in cache (a trace of its own), in the GB/s it would
 * reach if memory cost nothing (below the triad: compute-bound).
 * GB/s counts the bytes the expression must move (x read, result written;
 * the triad: two reads, one write); medians of RUNS runs; first on one
 * thread (a child process with KILN_NUM_THREADS=1), then on
 * kiln_num_threads(). bench/fused_torch.py is PyTorch eager's peer. Lines
 * starting with "@" are for scripts/bench_issue6.sh (keys fused.t1.* and
 * fused.tall.*). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, setenv */
#include <kiln.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "cpu/cpu.h"
#include "ir.h"
#include "jit.h"

enum { N = 16 * 1024 * 1024, RUNS = 9, MAX_THREADS = 64, SMALL = 32 * 1024, SMALL_CALLS = 1000 };

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

/* the staged body: in = x, a, b, c */
static int expr(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_add(kiln_mul(kiln_tanh(kiln_add(kiln_mul(in[0], in[1]), in[2])), in[3]), in[0]);
  return out[0] ? 0 : -1;
}

enum { I_TRIAD, I_STAGED, I_CPU_OPT, I_CPU_IR, I_EAGER, N_IMPL };
static const char *impl_names[N_IMPL] = {"triad", "staged", "cpu-opt", "cpu-ir", "eager"};

static int fail(const char *what) {
  fprintf(stderr, "bench_fused: %s: %s\n", what, kiln_last_error());
  return 1;
}

static int run(bool child) {
  int threads = kiln_num_threads();
  const char *cfg = child || threads == 1 ? "t1" : "tall";
  ta = aligned_alloc(64, (size_t)N * 4), tb = aligned_alloc(64, (size_t)N * 4), tc = aligned_alloc(64, (size_t)N * 4);
  float *xd = aligned_alloc(64, (size_t)N * 4);
  for (int64_t i = 0; i < N; i++) tb[i] = 1, tc[i] = 2, ta[i] = 0, xd[i] = (float)(i % 1000) * 0.002f - 1;
  kiln_tensor *x = kiln_tensor_new(KILN_F32, KILN_SHAPE(N), xd);
  kiln_tensor *a = kiln_scalar(KILN_F32, 0.5), *b = kiln_scalar(KILN_F32, 0.25), *c = kiln_scalar(KILN_F32, 2);
  kiln_tensor *args[4] = {x, a, b, c}, *out = NULL;

  /* the staged function: its first call traces (and compiles, once calls are compiled) */
  kiln_function *f = kiln_function_new("fused_expr", expr, NULL, 4, 1);
  double t0 = now_s();
  if (!f || kiln_function_call(f, args, &out)) return fail("staged");
  double first_ms = (now_s() - t0) * 1e3;
  kiln_release(out);
  kiln_stats st = {0};
  if (kiln_function_stats(f, 0, &st)) return fail("stats");
  /* its optimized IR compiled directly, and the hand-built fusion */
  const ir_func *opt = jit_optimized_func(f, 0);
  cpu_program *po = opt ? cpu_compile(opt) : NULL;
  if (!po) return fail("cpu_compile of the optimized IR");
  ir_module *m = ir_module_new();
  ir_func *hand = build(m);
  cpu_program *ph = hand ? cpu_compile(hand) : NULL;
  if (!ph) return fail("cpu_compile of the hand-built IR");

  double s[N_IMPL][RUNS];
  for (int r = -1; r < RUNS; r++) { /* run -1 warms up (the results' pages) */
    for (int k = 0; k < N_IMPL; k++) {
      kiln_scope_push();
      int rc = 0;
      t0 = now_s();
      switch (k) {
      case I_TRIAD: triad_seconds(threads); break;
      case I_STAGED: rc = kiln_function_call(f, args, &out); break;
      case I_CPU_OPT: rc = cpu_run(po, args, &out); break;
      case I_CPU_IR: rc = cpu_run(ph, args, &out); break;
      case I_EAGER: rc = kiln_add(kiln_mul(kiln_tanh(kiln_add(kiln_mul(x, a), b)), c), x) ? 0 : -1; break;
      }
      double dt = now_s() - t0;
      kiln_scope_pop();
      if (rc) return fail(impl_names[k]);
      if (r >= 0) s[k][r] = dt;
    }
  }
  double gbs[N_IMPL];
  for (int k = 0; k < N_IMPL; k++) gbs[k] = (k == I_TRIAD ? 3.0 : 2.0) * N * 4 / median(s[k], RUNS) / 1e9;
  /* The compute ceiling: the same staged expression on SMALL elements that
   * stay in cache, as the GB/s it would reach if memory were free. Below
   * the triad, the kernel is compute-bound and cannot reach it. */
  double ceiling = 0;
  if (!strcmp(cfg, "t1")) { /* one thread: 32K elements may not be split over the pool */
    kiln_tensor *xs = kiln_slice(x, (const int64_t[]){0}, (const int64_t[]){SMALL});
    kiln_tensor *sargs[4] = {xs, a, b, c};
    double cs[RUNS];
    for (int r = -1; xs && r < RUNS; r++) {
      t0 = now_s();
      for (int i = 0; i < SMALL_CALLS; i++) {
        kiln_scope_push();
        int rc = kiln_function_call(f, sargs, &out);
        kiln_scope_pop();
        if (rc) return fail("staged in cache");
      }
      if (r >= 0) cs[r] = (now_s() - t0) / SMALL_CALLS;
    }
    if (xs) ceiling = 2.0 * SMALL * 4 / median(cs, RUNS) / 1e9;
    kiln_release(xs);
  }
  const char *engine = st.compile_ms > 0 ? "compiled" : "interpreter?";
  printf("%s (%d thread%s): triad %6.2f GB/s | staged (%s) %6.2f GB/s = %3.0f%% of triad | cpu-opt %6.2f (%3.0f%%)"
         " | cpu-ir %6.2f (%3.0f%%) | eager %6.2f (%3.0f%%)   staged/eager %.2f\n",
         cfg, child ? 1 : threads, child || threads == 1 ? "" : "s", gbs[I_TRIAD], engine, gbs[I_STAGED],
         100 * gbs[I_STAGED] / gbs[I_TRIAD], gbs[I_CPU_OPT], 100 * gbs[I_CPU_OPT] / gbs[I_TRIAD], gbs[I_CPU_IR],
         100 * gbs[I_CPU_IR] / gbs[I_TRIAD], gbs[I_EAGER], 100 * gbs[I_EAGER] / gbs[I_TRIAD],
         gbs[I_STAGED] / gbs[I_EAGER]);
  if (ceiling > 0) {
    printf("%s compute ceiling: the staged expression on %d in-cache elements (its own trace) %6.2f GB/s-equivalent"
           " (%.3f ns/element) = %3.0f%% of triad\n",
           cfg, SMALL, ceiling, 8 / ceiling, 100 * ceiling / gbs[I_TRIAD]);
    bench_figure("fused.t1.ceiling", ceiling, "GB/s");
  }
  char key[64];
  for (int k = 0; k < N_IMPL; k++) {
    snprintf(key, sizeof key, "fused.%s.%s", cfg, impl_names[k]);
    bench_figure(key, gbs[k], "GB/s");
  }
  if (!child)
    printf("staged: first call %.1f ms (trace %.2f, passes %.2f, compile %.2f ms), %d kernel(s), %d ops -> %d; "
           "cpu_compile: optimized IR %.1f ms, %d kernel(s); hand-built %.1f ms; threads: %d\n",
           first_ms, st.trace_ms, st.optimize_ms, st.compile_ms, st.kernels, st.traced_ops, st.optimized_ops,
           cpu_program_compile_ms(po), cpu_program_kernels(po), cpu_program_compile_ms(ph), threads);
  kiln_function_free(f);
  cpu_program_free(po);
  cpu_program_free(ph);
  ir_module_free(m);
  kiln_release(x), kiln_release(a), kiln_release(b), kiln_release(c);
  free(ta), free(tb), free(tc), free(xd);
  return 0;
}

int main(void) {
  printf("bench_fused: tanh(x*a+b)*c+x, N = %d f32 (16M), GB/s, medians of %d runs\n", N, RUNS);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) { /* before any thread exists: one thread for the child */
    setenv("KILN_NUM_THREADS", "1", 1);
    exit(run(true));
  }
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  int rc = run(false);
  return rc || !WIFEXITED(status) || WEXITSTATUS(status) ? 1 : 0;
}
