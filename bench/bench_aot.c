/* bench_aot.c — ahead-of-time objects (issue 17): inference latency of the
 * MLP 784-256-256-10 of mlp_model.h (relu layers, logits out), staged and
 * saved, called through the JIT (kiln_function_call on the loaded
 * function) and through kiln-aot's object linked with libkiln_rt (cc
 * -shared, dlopen'd into this process: NAME_run). Blocks of calls of each
 * alternate so that both see the same machine; medians of the per-call
 * time of each block. Both compute the same bits (checked here too).
 * Then libkiln_rt.so's size, stripped.
 *   bench_aot [--batch B] [--calls N] [--blocks K] */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, mkdtemp */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench_util.h"
#include "mlp_model.h"

static int mlp_infer(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  kiln_variable *const *v = user;
  kiln_tensor *h = kiln_relu(mlp_dense(in[0], v[0], v[1]));
  h = kiln_relu(mlp_dense(h, v[2], v[3]));
  out[0] = mlp_dense(h, v[4], v[5]);
  return 0;
}

static int sh(const char *cmd) {
  int rc = system(cmd);
  if (rc) fprintf(stderr, "bench_aot: failed (%d): %s\n", rc, cmd);
  return rc;
}

int main(int argc, char **argv) {
  int64_t batch = 1;
  int calls = 2000, blocks = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--batch")) batch = atoll(argv[i + 1]);
    else if (!strcmp(argv[i], "--calls")) calls = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--blocks")) blocks = atoi(argv[i + 1]);
  }
  if (batch < 1 || calls < 1 || blocks < 1 || blocks > 99) return fprintf(stderr, "bench_aot: bad arguments\n"), 2;
  char dir[] = "/tmp/bench_aot_XXXXXX", cmd[4096], path[1200];
  if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
  kiln_random_seed(1);
  kiln_variable *v[MLP_VARS];
  for (int i = 0; i < MLP_VARS; i++) {
    int rank = mlp_shapes[i][1] ? 2 : 1;
    v[i] = kiln_variable_new(kiln_random_normal(KILN_F32, rank, mlp_shapes[i]), mlp_names[i]);
  }
  kiln_function *f = kiln_function_new("mlp", mlp_infer, v, 1, 1);
  kiln_tensor *x = kiln_random_uniform(KILN_F32, 2, (int64_t[]){batch, MLP_IN}, 0, 1), *y;
  snprintf(path, sizeof path, "%s/saved", dir);
  if (kiln_function_call(f, &x, &y) || kiln_function_save(f, path))
    return fprintf(stderr, "bench_aot: %s\n", kiln_last_error()), 1;
  kiln_function *g = kiln_function_load(path);
  if (!g) return fprintf(stderr, "bench_aot: %s\n", kiln_last_error()), 1;
  snprintf(cmd, sizeof cmd, "%s %s --function mlp --trace 0 -o %s/mlp.o --header %s/mlp.h", KILN_AOT_TOOL, path, dir,
           dir);
  if (sh(cmd)) return 1;
  snprintf(cmd, sizeof cmd, "cc -shared -o %s/libmlp.so %s/mlp.o -L%s -lkiln_rt -Wl,-rpath,%s", dir, dir, KILN_RT_DIR,
           KILN_RT_DIR);
  if (sh(cmd)) return 1;
  snprintf(path, sizeof path, "%s/libmlp.so", dir);
  void *so = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  int (*run)(const void *const *, void *const *) = so ? (int (*)(const void *const *, void *const *))dlsym(so, "mlp_run") : NULL;
  if (!run) return fprintf(stderr, "bench_aot: %s\n", dlerror()), 1;
  const char *(*rt_error)(void) = (const char *(*)(void))dlsym(so, "kiln_rt_last_error");

  /* the same bits, then the timing */
  kiln_tensor *jy;
  if (kiln_function_call(g, &x, &jy)) return fprintf(stderr, "bench_aot: %s\n", kiln_last_error()), 1;
  size_t out_bytes = (size_t)kiln_tensor_size(jy) * sizeof(float);
  const void *in[1] = {kiln_tensor_data(x)};
  void *out[1] = {aligned_alloc(64, (out_bytes + 63) / 64 * 64)};
  if (run(in, out)) return fprintf(stderr, "bench_aot: %s\n", rt_error ? rt_error() : "mlp_run failed"), 1;
  int same = !memcmp(out[0], kiln_tensor_data(jy), out_bytes);
  printf("MLP 784-256-256-10 inference, batch %lld, %d threads: AOT outputs %s the JIT's\n", (long long)batch,
         kiln_num_threads(), same ? "equal" : "DIFFER FROM");
  double jit[99], aot[99];
  for (int b = 0; b < blocks; b++) {
    kiln_scope_push();
    double t0 = now_ns();
    for (int c = 0; c < calls; c++) {
      kiln_function_call(g, &x, &jy);
      kiln_release(kiln_scope_escape(jy)); /* a caller that drops each result */
    }
    jit[b] = (now_ns() - t0) / calls / 1e3;
    kiln_scope_pop();
    t0 = now_ns();
    for (int c = 0; c < calls; c++) run(in, out);
    aot[b] = (now_ns() - t0) / calls / 1e3;
  }
  double mj = median(jit, blocks), ma = median(aot, blocks);
  printf("JIT (kiln_function_call): %.2f us per call\nAOT (mlp_run):            %.2f us per call (x%.3f)\n", mj, ma,
         ma / mj);
  char key[64];
  snprintf(key, sizeof key, "aot.b%lld.jit", (long long)batch);
  bench_figure(key, mj, "us");
  snprintf(key, sizeof key, "aot.b%lld.aot", (long long)batch);
  bench_figure(key, ma, "us");
  /* the runtime's size, as shipped: stripped */
  snprintf(cmd, sizeof cmd, "strip -o %s/rt.so %s/libkiln_rt.so", dir, KILN_RT_DIR);
  snprintf(path, sizeof path, "%s/rt.so", dir);
  struct stat st;
  if (!sh(cmd) && !stat(path, &st)) {
    printf("libkiln_rt.so: %.1f KB stripped (goal <= 300 KB)\n", st.st_size / 1024.0);
    bench_figure("aot.rt_stripped_kb", st.st_size / 1024.0, "KB");
  }
  free(out[0]);
  kiln_function_free(g);
  kiln_function_free(f);
  for (int i = 0; i < MLP_VARS; i++) kiln_variable_free(v[i]);
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  sh(cmd);
  return same ? 0 : 1;
}
