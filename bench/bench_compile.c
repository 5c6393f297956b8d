/* bench_compile.c — how compile time grows with the size of a fused body.
 * A staged Newton chain x = 0.5 * (x + a / x), n steps, and the same with a
 * select per step (x = select(y > x, x, y) after y = 0.5 * (x + a / x)):
 * every value is read two or three times, so a fusion emitter that expands
 * the DAG of shared values as a tree takes 2^n (3^n) work. For each n it
 * prints the first call's milliseconds (trace, passes, LLVM, the run) and
 * the process's CPU time over it (all threads: a loaded machine inflates
 * wall time, not this), the parts kiln_function_stats gives (tracing, the passes, the backend:
 * planning, emission, LLVM), medians of several functions
 * (each a trace of its own; the disk cache off). Each n runs in a child
 * process under an alarm (BENCH_COMPILE_TIMEOUT seconds, default 30), so a
 * blow-up shows as "timed out" instead of hanging the run. Lines starting
 * with "@" are for scripts (keys compile.<chain>.<n>). */
#define _POSIX_C_SOURCE 200809L /* setenv, fork */
#include <kiln.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"

enum { RUNS = 5, ELEMS = 1024 };

typedef struct {
  int steps;
  bool select;
} chain;

/* the chain (a body: its tensors belong to the trace's scope) */
static int body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  const chain *c = user;
  kiln_tensor *x = in[0], *a = in[1], *half = kiln_scalar(KILN_F32, 0.5);
  for (int s = 0; s < c->steps; s++) {
    kiln_tensor *y = kiln_mul(half, kiln_add(x, kiln_div(a, x)));
    x = c->select ? kiln_select(kiln_greater(y, x), x, y) : y;
  }
  out[0] = x;
  return x ? 0 : -1;
}

/* one fresh function of c, called once: wall ms and LLVM's ms; -1 on failure */
static double cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int measure(const chain *c, kiln_tensor *x, kiln_tensor *a, double *wall, double *cpu, double *llvm,
                   double *trace, double *passes) {
  kiln_function *f = kiln_function_new("chain", body, (void *)c, 2, 1);
  kiln_tensor *in[2] = {x, a}, *res = NULL;
  double t0 = now_ns(), c0 = cpu_ms();
  int rc = f ? kiln_function_call(f, in, &res) : -1;
  *wall = (now_ns() - t0) * 1e-6;
  *cpu = cpu_ms() - c0;
  kiln_stats st = {0};
  if (!rc) rc = kiln_function_stats(f, 0, &st);
  *llvm = st.compile_ms;
  *trace = st.trace_ms;
  *passes = st.optimize_ms;
  if (rc) fprintf(stderr, "bench_compile: %s\n", kiln_last_error());
  kiln_release(res);
  kiln_function_free(f);
  return rc;
}

/* the child: RUNS functions of c (fewer once one takes over a second) */
static int run_child(const chain *c) {
  float xs[ELEMS], as[ELEMS];
  for (int i = 0; i < ELEMS; i++) xs[i] = 1.0f + (float)(i % 97), as[i] = 2.0f + (float)(i % 13);
  int64_t shape[1] = {ELEMS};
  kiln_tensor *x = kiln_tensor_new(KILN_F32, 1, shape, xs), *a = kiln_tensor_new(KILN_F32, 1, shape, as);
  double wall[RUNS], cpu[RUNS], llvm[RUNS], trace[RUNS], passes[RUNS];
  int n = 0;
  while (n < RUNS) {
    if (measure(c, x, a, &wall[n], &cpu[n], &llvm[n], &trace[n], &passes[n])) return 1;
    if (wall[n++] > 1000) break;
  }
  double w = median(wall, n), u = median(cpu, n), l = median(llvm, n), t = median(trace, n), o = median(passes, n);
  const char *name = c->select ? "select" : "newton";
  printf("%-7s %5d %7d %10.2f %10.2f %10.2f %10.2f %10.2f %5d\n", name, c->steps, c->steps * (c->select ? 5 : 3), w,
         u, t, o, l, n);
  char key[64];
  snprintf(key, sizeof key, "compile.%s.%d", name, c->steps);
  bench_figure(key, w, "ms");
  kiln_release(x);
  kiln_release(a);
  return 0;
}

int main(int argc, char **argv) {
  static const int sizes[] = {10, 20, 30, 50, 100, 200, 400};
  int timeout = getenv("BENCH_COMPILE_TIMEOUT") ? atoi(getenv("BENCH_COMPILE_TIMEOUT")) : 30;
  if (timeout <= 0) timeout = 30;
  setenv("KILN_CACHE_DIR", "off", 1); /* compile every time */
  if (argc == 4 && !strcmp(argv[1], "one")) { /* one n in this process: bench_compile one N SELECT */
    chain c = {atoi(argv[2]), atoi(argv[3]) != 0};
    return run_child(&c);
  }
  printf("%-7s %5s %7s %10s %10s %10s %10s %10s %5s\n", "chain", "steps", "ops", "first ms", "cpu ms", "trace ms",
         "passes ms", "backend ms", "runs");
  fflush(stdout);
  int failed = 0;
  for (int sel = 0; sel < 2; sel++) {
    bool give_up = false; /* once one n times out, the bigger ones would too */
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
      chain c = {sizes[k], sel == 1};
      if (argc > 1 && atoi(argv[1]) > 0 && sizes[k] > atoi(argv[1])) continue; /* argv[1]: the largest n */
      if (give_up) {
        printf("%-7s %5d %7d %10s\n", sel ? "select" : "newton", c.steps, c.steps * (sel ? 5 : 3), "skipped");
        continue;
      }
      fflush(stdout);
      pid_t pid = fork();
      if (pid == 0) {
        alarm((unsigned)timeout);
        _exit(run_child(&c));
      }
      int status = 0;
      if (pid < 0 || waitpid(pid, &status, 0) < 0) return 1;
      if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
        printf("%-7s %5d %7d %10s  (over %d s)\n", sel ? "select" : "newton", c.steps, c.steps * (sel ? 5 : 3),
               "timed out", timeout);
        give_up = true;
      } else if (!WIFEXITED(status) || WEXITSTATUS(status)) {
        printf("%-7s %5d: failed\n", sel ? "select" : "newton", c.steps);
        failed = 1;
      }
      fflush(stdout);
    }
  }
  return failed;
}
