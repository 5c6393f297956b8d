/* bench_call.c — the fixed cost of calling a staged function whose trace is
 * cached: ns per call of a 1-element f32 `x + 1` staged with
 * kiln_function_new (whatever kiln_function_call runs: the reference
 * interpreter, or compiled code), beside the same body run eagerly (a scalar
 * and an add). Goal for compiled calls: <= 150 ns per call. Prints
 * "@ call.{staged,eager} NS ns" for scripts/bench_issue6.sh. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <kiln.h>

#include "bench_util.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

enum { RUNS = 11, CALLS = 1000, SCOPES = 20 };

static int add_one(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n_in, (void)n_out;
  out[0] = kiln_add(in[0], kiln_scalar_like(in[0], 1));
  return out[0] ? 0 : -1;
}

/* median ns per call over SCOPES x (push, CALLS calls, pop); NAN on failure */
static double ns_per_call(kiln_function *f, kiln_tensor *x) {
  double ns[RUNS];
  for (int r = -1; r < RUNS; r++) { /* run -1 traces and warms up */
    double t0 = now_ns();
    for (int s = 0; s < SCOPES; s++) {
      kiln_scope_push();
      for (int i = 0; i < CALLS; i++) {
        kiln_tensor *y = NULL;
        if (f ? kiln_function_call(f, &x, &y) : add_one(NULL, 1, &x, 1, &y)) {
          fprintf(stderr, "bench_call: %s\n", kiln_last_error());
          kiln_scope_pop();
          return NAN;
        }
      }
      kiln_scope_pop();
    }
    if (r >= 0) ns[r] = (now_ns() - t0) / (SCOPES * CALLS);
  }
  qsort(ns, RUNS, sizeof ns[0], cmp_double);
  return ns[RUNS / 2];
}

int main(void) {
  kiln_tensor *x = kiln_scalar(KILN_F32, 2);
  kiln_function *f = kiln_function_new("add_one", add_one, NULL, 1, 1);
  if (!x || !f) {
    fprintf(stderr, "bench_call: %s\n", kiln_last_error());
    return 1;
  }
  double staged = ns_per_call(f, x), eager = ns_per_call(NULL, x);
  kiln_stats st = {0};
  kiln_function_stats(f, 0, &st);
  printf("call: staged x + 1 (cached trace, %-11s): %8.1f ns/call (goal <= 150 ns once compiled)\n",
         st.compile_ms > 0 ? "compiled" : "interpreter", staged);
  printf("call: the same body eagerly (scalar + add):         %8.1f ns/call\n", eager);
  printf("(median of %d runs of %d calls; traces made: %d)\n", RUNS, SCOPES * CALLS,
         kiln_function_trace_count(f));
  bench_figure("call.staged", staged, "ns");
  bench_figure("call.eager", eager, "ns");
  kiln_function_free(f);
  kiln_release(x);
  return isnan(staged) ? 1 : 0;
}
