/* bench_control.c — staged control flow (issue 15): loops compiled once
 * instead of unrolled.
 *   lstm   an LSTM (batch 32, input 128, hidden 128) over T steps, staged as
 *          a kiln_scan and as the C loop unrolled at trace time: the compile
 *          ms (trace + passes + LLVM of the first call, disk cache off) at T = 10,
 *          100, 1000 (unrolled up to --unrolled-max, default 100), and ms
 *          per forward call at T = 100 for the scan, the unrolled trace and
 *          eager ops; bench/lstm_torch.py is PyTorch eager nn.LSTM's peer.
 *   l2hmc  the L2HMC-like sampler step of bench_l2hmc.c (10 leapfrog steps,
 *          batch 200) with its 10 steps as a kiln_scan: the compile ms
 *          and ms per call against the same body run eagerly.
 *   cumsum a cumulative sum over T = 1000 rows of 4096 floats as a
 *          kiln_scan: ms per call of the scan as one kernel (the loop over
 *          t inside, backends/cpu/scan_kernel.c; cpu_options.scan_kernels),
 *          of the same IR compiled with cpu_options.scan_loops (a loop
 *          over the body's kernel), as staged (the backend's choice),
 *          and of the adds run eagerly; and over 100000 rows of 16 (one
 *          kernel vs the loop: where a step's overhead shows).
 * Medians of --runs runs (default 7) of --calls calls (default 20). Every
 * figure is also printed as "@ control.KEY VALUE UNIT". */
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "bench_util.h"
#include "cpu/cpu.h"
#include "ir.h"
#include "l2hmc_model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { B = 32, IN = 128, H = 128, MAX_RUNS = 99 };

typedef struct {
  kiln_tensor *w, *b; /* (IN + H, 4H), (4H) */
} lstm;

static kiln_tensor *gate(kiln_tensor *z, int k) {
  int64_t begin[2] = {0, (int64_t)k * H}, size[2] = {B, H};
  return kiln_slice(z, begin, size);
}

/* carry (h, c), x_t -> (h', c'), y_t = h' */
static int lstm_step(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  lstm *m = user;
  kiln_tensor *hx[2] = {in[2], in[0]};
  kiln_tensor *z = kiln_add(kiln_matmul(kiln_concat(2, hx, 1), m->w), m->b);
  kiln_tensor *i = kiln_sigmoid(gate(z, 0)), *f = kiln_sigmoid(gate(z, 1)), *g = kiln_tanh(gate(z, 2));
  kiln_tensor *o = kiln_sigmoid(gate(z, 3));
  out[1] = kiln_add(kiln_mul(f, in[1]), kiln_mul(i, g));
  out[0] = kiln_mul(o, kiln_tanh(out[1]));
  out[2] = out[0];
  return out[0] && out[1] ? 0 : -1;
}

/* in: h0, c0, xs (T, B, IN); out: h_T, the ys (T, B, H) */
static int lstm_scan(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  kiln_tensor *carry[2] = {NULL, NULL};
  if (kiln_scan(lstm_step, user, 2, in, 1, &in[2], -1, false, 1, carry, &out[1])) return -1;
  out[0] = carry[0];
  return 0;
}

static int lstm_unrolled(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  int64_t T = kiln_tensor_shape(in[2])[0];
  kiln_tensor **ys = malloc((size_t)T * sizeof *ys);
  kiln_tensor *h = in[0], *c = in[1];
  int rc = ys ? 0 : -1;
  for (int64_t t = 0; t < T && !rc; t++) {
    kiln_tensor *io[3] = {h, c, kiln_index(in[2], t)}, *o[3];
    rc = lstm_step(user, 3, io, 3, o);
    h = o[0], c = o[1], ys[t] = o[2];
  }
  out[0] = h;
  out[1] = rc ? NULL : kiln_stack((int)T, ys, 0);
  free(ys);
  return rc || !out[1] ? -1 : 0;
}

static kiln_tensor *uniform(int rank, const int64_t *shape, double scale) {
  return kiln_random_uniform(KILN_F32, rank, shape, -scale, scale);
}

static bool failed; /* a call failed: main returns 1 (its figures are not printed as valid) */

/* ms of one call of f (or of body eagerly when f is NULL) */
static double call_ms(kiln_function *f, kiln_body_fn body, void *user, int n_in, kiln_tensor *const *in, int n_out) {
  kiln_tensor *out[4] = {NULL};
  kiln_scope_push();
  double t0 = now_ns();
  int rc = f ? kiln_function_call(f, in, out) : body(user, n_in, in, n_out, out);
  double ms = (now_ns() - t0) * 1e-6;
  kiln_scope_pop();
  if (rc) {
    fprintf(stderr, "bench_control: %s\n", kiln_last_error());
    failed = true;
  }
  return ms;
}

/* the first call's trace + passes + backend ms (kiln_function_stats: the
 * compile, without running it) */
static double cpu_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

/* the CPU ms (all threads) of the last first_call_ms's call: on a loaded
 * machine a steadier figure than the wall ms */
static double first_call_cpu;

static double first_call_ms(const char *name, kiln_body_fn body, void *user, int n_in, kiln_tensor *const *in, int n_out) {
  kiln_function *f = kiln_function_new(name, body, user, n_in, n_out);
  double c0 = cpu_ms();
  call_ms(f, body, user, n_in, in, n_out);
  first_call_cpu = cpu_ms() - c0;
  kiln_stats st;
  double ms = kiln_function_stats(f, 0, &st) ? -1 : st.trace_ms + st.optimize_ms + st.compile_ms;
  kiln_function_free(f);
  return ms;
}

/* the median over runs of the mean ms per call over calls */
static double per_call_ms(kiln_function *f, kiln_body_fn body, void *user, int n_in, kiln_tensor *const *in, int n_out,
                          int runs, int calls) {
  double v[MAX_RUNS];
  call_ms(f, body, user, n_in, in, n_out); /* warm-up */
  for (int r = 0; r < runs; r++) {
    double sum = 0;
    for (int c = 0; c < calls; c++) sum += call_ms(f, body, user, n_in, in, n_out);
    v[r] = sum / calls;
  }
  return median(v, runs);
}

static void lstm_bench(int runs, int calls, int unrolled_max) {
  lstm m = {uniform(2, (int64_t[]){IN + H, 4 * H}, 0.08), uniform(1, (int64_t[]){4 * H}, 0.1)};
  kiln_tensor *h0 = uniform(2, (int64_t[]){B, H}, 0.5), *c0 = uniform(2, (int64_t[]){B, H}, 0.5);
  static const int64_t ts[] = {10, 100, 1000};
  for (int k = 0; k < 3; k++) {
    int64_t T = ts[k];
    kiln_scope_push();
    kiln_tensor *in[3] = {h0, c0, uniform(3, (int64_t[]){T, B, IN}, 1)};
    double v[MAX_RUNS];
    int r3 = runs < 3 ? runs : 3;
    for (int r = 0; r < r3; r++) v[r] = first_call_ms("lstm_scan", lstm_scan, &m, 3, in, 2);
    double scan = median(v, r3);
    printf("lstm T=%-5lld compile: scan %8.1f ms", (long long)T, scan);
    char key[64];
    snprintf(key, sizeof key, "control.lstm.compile.scan.t%lld", (long long)T);
    bench_figure(key, scan, "ms");
    if (T <= unrolled_max) {
      for (int r = 0; r < r3; r++) v[r] = first_call_ms("lstm_unrolled", lstm_unrolled, &m, 3, in, 2);
      double un = median(v, r3);
      printf("lstm T=%-5lld compile: unrolled %8.1f ms (scan/unrolled %.2f)\n", (long long)T, un, scan / un);
      snprintf(key, sizeof key, "control.lstm.compile.unrolled.t%lld", (long long)T);
      bench_figure(key, un, "ms");
    }
    kiln_scope_pop();
  }
  kiln_scope_push();
  int64_t T = 100;
  kiln_tensor *in[3] = {h0, c0, uniform(3, (int64_t[]){T, B, IN}, 1)};
  kiln_function *fs = kiln_function_new("lstm_scan", lstm_scan, &m, 3, 2);
  kiln_function *fu = kiln_function_new("lstm_unrolled", lstm_unrolled, &m, 3, 2);
  double scan = per_call_ms(fs, lstm_scan, &m, 3, in, 2, runs, calls);
  double un = per_call_ms(fu, lstm_unrolled, &m, 3, in, 2, runs, calls);
  double eager = per_call_ms(NULL, lstm_unrolled, &m, 3, in, 2, runs, calls < 5 ? calls : 5);
  printf("lstm T=100 forward: scan %.3f ms, unrolled %.3f ms, eager %.3f ms; scan/unrolled %.2f (goal <= 1.1)\n",
         scan, un, eager, scan / un);
  bench_figure("control.lstm.step.scan", scan, "ms");
  bench_figure("control.lstm.step.unrolled", un, "ms");
  bench_figure("control.lstm.step.eager", eager, "ms");
  kiln_function_free(fs);
  kiln_function_free(fu);
  kiln_scope_pop();
}

/* ---- the leapfrog steps as a scan ---- */

static int leapfrog(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  energy *e = user;
  kiln_tensor *half = kiln_scalar(KILN_F32, 0.05), *eps = kiln_scalar(KILN_F32, 0.1);
  kiln_tensor *p = kiln_sub(in[1], kiln_mul(half, grad_energy(e, in[0])));
  out[0] = kiln_add(in[0], kiln_mul(eps, p));
  out[1] = kiln_sub(p, kiln_mul(half, grad_energy(e, out[0])));
  return out[0] && out[1] ? 0 : -1;
}

static int sample_scan(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  return kiln_scan(leapfrog, user, 2, in, 0, NULL, LEAPFROGS, false, 0, out, NULL);
}

/* ms per sample step of bench/l2hmc_torch.py (PyTorch eager) with Kiln's
 * thread count, run by python; 0 when it cannot run */
static double l2hmc_torch(const char *python, int runs, int calls) {
  char script[4096], cmd[8192], line[1024];
  bench_script_path(__FILE__, "l2hmc_torch.py", script, sizeof script);
  snprintf(cmd, sizeof cmd, "%s '%s' --runs %d --steps %d --threads %d 2>&1", python, script, runs, calls,
           kiln_num_threads());
  FILE *p = popen(cmd, "r");
  double ms = 0;
  while (p && fgets(line, sizeof line, p)) {
    if (sscanf(line, "@ l2hmc.torch %lf", &ms) == 1) continue;
    printf("torch: %s", line);
  }
  if (p) pclose(p);
  return ms;
}

static void l2hmc_bench(int runs, int calls, const char *python) {
  energy e = {uniform(2, (int64_t[]){L2HMC_DIM, L2HMC_HID}, 0.5), uniform(1, (int64_t[]){L2HMC_HID}, 0.1),
              uniform(2, (int64_t[]){L2HMC_HID, L2HMC_DIM}, 0.5), uniform(1, (int64_t[]){L2HMC_DIM}, 0.1)};
  kiln_tensor *in[2] = {uniform(2, (int64_t[]){L2HMC_BATCH, L2HMC_DIM}, 1),
                        uniform(2, (int64_t[]){L2HMC_BATCH, L2HMC_DIM}, 1)};
  double v[MAX_RUNS];
  int r3 = runs < 3 ? runs : 3;
  double cpu[MAX_RUNS];
  for (int r = 0; r < r3; r++) v[r] = first_call_ms("l2hmc_scan", sample_scan, &e, 2, in, 2), cpu[r] = first_call_cpu;
  double cold = median(v, r3), cold_cpu = median(cpu, r3);
  for (int r = 0; r < r3; r++) v[r] = first_call_ms("l2hmc_unrolled", sample_step, &e, 2, in, 2);
  double cold_un = median(v, r3);
  kiln_function *f = kiln_function_new("l2hmc_scan", sample_scan, &e, 2, 2);
  double staged = per_call_ms(f, sample_scan, &e, 2, in, 2, runs, calls);
  double eager = per_call_ms(NULL, sample_step, &e, 2, in, 2, runs, calls);
  printf("l2hmc compile: scan %.1f ms (CPU %.1f ms), unrolled %.1f ms (goal <= 50 ms); per call: scan %.3f ms, eager "
         "%.3f ms, eager/scan %.1fx (goal >= 15x)\n", cold, cold_cpu, cold_un, staged, eager, eager / staged);
  double torch = python ? l2hmc_torch(python, runs, calls) : 0;
  if (torch > 0) {
    printf("l2hmc PyTorch eager (same run): %.3f ms per call, torch/scan %.1fx (goal >= 30x)\n", torch, torch / staged);
    bench_figure("control.l2hmc.step.torch", torch, "ms");
  }
  bench_figure("control.l2hmc.compile.scan", cold, "ms");
  bench_figure("control.l2hmc.compile.scan.cpu", cold_cpu, "ms");
  bench_figure("control.l2hmc.compile.unrolled", cold_un, "ms");
  bench_figure("control.l2hmc.step.scan", staged, "ms");
  bench_figure("control.l2hmc.step.eager", eager, "ms");
  kiln_function_free(f);
}

/* ---- a cumulative sum: one kernel vs a loop of steps vs eager ---- */

static int cumsum_step(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n, (void)n_out;
  out[0] = kiln_add(in[0], in[1]);
  out[1] = out[0];
  return out[0] ? 0 : -1;
}

static int cumsum_scan(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n, (void)n_out;
  return kiln_scan(cumsum_step, user, 1, &in[0], 1, &in[1], -1, false, 1, &out[0], &out[1]);
}

static int cumsum_eager(void *user, int n, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)user, (void)n, (void)n_out;
  int64_t T = kiln_tensor_shape(in[1])[0];
  kiln_tensor **ys = malloc((size_t)T * sizeof *ys), *c = in[0];
  if (!ys) return -1;
  for (int64_t t = 0; t < T && c; t++) ys[t] = c = kiln_add(c, kiln_index(in[1], t));
  out[0] = c;
  out[1] = c ? kiln_stack((int)T, ys, 0) : NULL;
  free(ys);
  return out[1] ? 0 : -1;
}

/* the median over runs of the mean ms of cpu_run over calls */
static double program_ms(cpu_program *p, kiln_tensor *const *in, int runs, int calls) {
  double v[MAX_RUNS];
  for (int r = -1; r < runs; r++) { /* r = -1: warm-up */
    double sum = 0;
    for (int c = 0; c < calls; c++) {
      kiln_tensor *out[2] = {NULL, NULL};
      kiln_scope_push();
      double t0 = now_ns();
      if (cpu_run(p, in, out)) {
        fprintf(stderr, "bench_control: %s\n", kiln_last_error());
        failed = true;
      }
      sum += (now_ns() - t0) * 1e-6;
      kiln_scope_pop();
    }
    if (r >= 0) v[r] = sum / calls;
  }
  return median(v, runs);
}

/* T rows of n; eager too when eager */
static void cumsum_bench(int64_t T, int64_t n, bool eager_too, int runs, int calls) {
  kiln_scope_push();
  kiln_tensor *in[2] = {uniform(1, (int64_t[]){n}, 1), uniform(2, (int64_t[]){T, n}, 1)};
  kiln_function *f = kiln_function_new("cumsum", cumsum_scan, NULL, 2, 2);
  double staged = per_call_ms(f, cumsum_scan, NULL, 2, in, 2, runs, calls); /* the backend's choice */
  /* the same IR, its scan one kernel, and a loop over the body's kernel */
  double ms[2] = {-1, -1};
  char *text = kiln_function_ir(f, 0, "optimized");
  ir_module *m = text ? ir_parse(text, "cumsum.kir") : NULL;
  free(text);
  for (int loops = 0; loops < 2; loops++) {
    cpu_options opt = {.scan_loops = loops, .scan_kernels = !loops};
    cpu_program *p = m ? cpu_compile_with(ir_module_find(m, "cumsum"), &opt) : NULL;
    if (p) {
      ms[loops] = program_ms(p, in, runs, calls);
      cpu_program_free(p);
    } else {
      fprintf(stderr, "bench_control: %s\n", kiln_last_error());
      failed = true;
    }
  }
  if (m) ir_module_free(m);
  double one = ms[0], loop = ms[1];
  double eager = eager_too ? per_call_ms(NULL, cumsum_eager, NULL, 2, in, 2, runs, calls < 5 ? calls : 5) : -1;
  printf("cumsum T=%lld x %lld: one kernel %.3f ms, loop of steps %.3f ms (loop/one %.2fx), staged (the backend's "
         "choice) %.3f ms", (long long)T, (long long)n, one, loop, loop / one, staged);
  if (eager_too) printf(", eager %.3f ms (eager/one %.1fx)", eager, eager / one);
  printf("\n");
  char key[64];
  snprintf(key, sizeof key, "control.cumsum.t%lld.n%lld.", (long long)T, (long long)n);
  size_t k = strlen(key);
  snprintf(key + k, sizeof key - k, "one_kernel");
  bench_figure(key, one, "ms");
  snprintf(key + k, sizeof key - k, "loop");
  bench_figure(key, loop, "ms");
  snprintf(key + k, sizeof key - k, "staged");
  bench_figure(key, staged, "ms");
  snprintf(key + k, sizeof key - k, "eager");
  if (eager_too) bench_figure(key, eager, "ms");
  kiln_function_free(f);
  kiln_scope_pop();
}

int main(int argc, char **argv) {
  int runs = 7, calls = 20, unrolled_max = 100;
  const char *only = NULL, *python = "/usr/bin/python3"; /* PyTorch 1.13: Debian's python3-torch */
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (v && !strcmp(a, "--runs")) runs = atoi(v), i++;
    else if (v && !strcmp(a, "--calls")) calls = atoi(v), i++;
    else if (v && !strcmp(a, "--unrolled-max")) unrolled_max = atoi(v), i++;
    else if (v && !strcmp(a, "--python")) python = v, i++;
    else if (!strcmp(a, "--no-torch")) python = NULL;
    else if (!strcmp(a, "lstm") || !strcmp(a, "l2hmc") || !strcmp(a, "cumsum")) only = a;
    else {
      fprintf(stderr, "usage: bench_control [lstm|l2hmc|cumsum] [--runs N] [--calls N] [--unrolled-max T] "
                      "[--python CMD | --no-torch]\n");
      return 2;
    }
  }
  if (runs < 1 || runs > MAX_RUNS || calls < 1) return 2;
  setenv("KILN_CACHE_DIR", "off", 1); /* compile times are cold */
  kiln_random_seed(7);
  kiln_scope_push();
  if (!only || !strcmp(only, "lstm")) lstm_bench(runs, calls, unrolled_max);
  if (!failed && (!only || !strcmp(only, "l2hmc"))) l2hmc_bench(runs, calls, python);
  if (!failed && (!only || !strcmp(only, "cumsum"))) {
    cumsum_bench(1000, 4096, true, runs, calls);
    cumsum_bench(100000, 16, false, runs, calls); /* short rows: a step's overhead shows */
  }
  kiln_scope_pop();
  return failed ? 1 : 0;
}
