/* bench_saved.c — saved functions (issue 17): the MLP 784-256-256-10
 * training step of mlp_model.h, batch 64, staged and saved with
 * kiln_function_save; then, each in a fresh process (fork + exec of this
 * program), kiln_function_load and the first call, with a cold disk cache
 * (a new empty KILN_CACHE_DIR) and a warm one (the cache the cold run
 * filled); and the size of the saved directory against the bytes of the
 * weights alone. Medians of --runs (5) fresh processes each.
 *   bench_saved [--runs N]
 *   bench_saved child DIR         (internal) load DIR, call once, print ms */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, popen, mkdtemp */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "mlp_model.h"

enum { BATCH = 64 };

static kiln_tensor *batch_x(void) { return kiln_random_uniform(KILN_F32, 2, (int64_t[]){BATCH, MLP_IN}, 0, 1); }
static kiln_tensor *batch_y(void) {
  int64_t y[BATCH];
  for (int i = 0; i < BATCH; i++) y[i] = i % MLP_OUT;
  return kiln_tensor_new(KILN_I64, 1, (int64_t[]){BATCH}, y);
}

typedef struct {
  kiln_variable *v[MLP_VARS];
  kiln_optimizer *sgd;
} mlp;

static int step_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  mlp *m = user;
  return mlp_train_step(m->v, m->sgd, in[0], in[1], &out[0]);
}

static int child(const char *dir) {
  kiln_random_seed(1);
  kiln_scope_push();
  kiln_tensor *in[2] = {batch_x(), batch_y()}, *loss;
  double t0 = now_ns();
  kiln_function *f = kiln_function_load(dir);
  double t1 = now_ns();
  int rc = f ? kiln_function_call(f, in, &loss) : -1;
  double t2 = now_ns();
  if (rc) {
    fprintf(stderr, "bench_saved: %s\n", kiln_last_error());
    return 1;
  }
  printf("%.3f %.3f %.9g\n", (t1 - t0) / 1e6, (t2 - t1) / 1e6, kiln_tensor_item(loss));
  kiln_scope_pop();
  kiln_function_free(f);
  return 0;
}

/* runs "self child dir" with KILN_CACHE_DIR=cache; load and call ms */
static int run_child(const char *self, const char *dir, const char *cache, double *load_ms, double *call_ms) {
  char cmd[4096];
  snprintf(cmd, sizeof cmd, "KILN_CACHE_DIR='%s' '%s' child '%s'", cache, self, dir);
  FILE *p = popen(cmd, "r");
  if (!p) return -1;
  double loss;
  int n = fscanf(p, "%lf %lf %lf", load_ms, call_ms, &loss);
  return pclose(p) == 0 && n == 3 ? 0 : -1;
}

static long long dir_bytes(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *e;
  long long sum = 0;
  while (d && (e = readdir(d))) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (!stat(path, &st) && S_ISREG(st.st_mode)) sum += st.st_size;
  }
  if (d) closedir(d);
  return sum;
}

int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "child")) return child(argv[2]);
  int runs = 5;
  for (int i = 1; i + 1 < argc; i++)
    if (!strcmp(argv[i], "--runs")) runs = atoi(argv[i + 1]);
  if (runs < 1 || runs > 100) runs = 5;
  char tmp[] = "/tmp/bench_saved_XXXXXX";
  if (!mkdtemp(tmp)) return 1;
  char dir[256], cache[256];
  snprintf(dir, sizeof dir, "%s/mlp_step", tmp);

  kiln_random_seed(0);
  mlp m = {.sgd = kiln_sgd_new(0.01)};
  long long weight_bytes = 0;
  kiln_scope_push();
  for (int i = 0; i < MLP_VARS; i++) {
    int rank = mlp_shapes[i][1] ? 2 : 1;
    m.v[i] = kiln_variable_new(kiln_random_normal(KILN_F32, rank, mlp_shapes[i]), mlp_names[i]);
    weight_bytes += 4 * mlp_shapes[i][0] * (rank == 2 ? mlp_shapes[i][1] : 1);
  }
  kiln_function *f = kiln_function_new("mlp_step", step_body, &m, 2, 1);
  kiln_tensor *in[2] = {batch_x(), batch_y()}, *loss;
  int rc = kiln_function_call(f, in, &loss);
  double t0 = now_ns();
  if (!rc) rc = kiln_function_save(f, dir);
  double save_ms = (now_ns() - t0) / 1e6;
  kiln_scope_pop();
  if (rc) {
    fprintf(stderr, "bench_saved: %s\n", kiln_last_error());
    return 1;
  }
  double cold_load[100], cold_call[100], warm_load[100], warm_call[100];
  for (int r = 0; r < runs && !rc; r++) {
    snprintf(cache, sizeof cache, "%s/cache%d", tmp, r);
    rc = run_child(argv[0], dir, cache, &cold_load[r], &cold_call[r]) ||
         run_child(argv[0], dir, cache, &warm_load[r], &warm_call[r]);
  }
  if (rc) {
    fprintf(stderr, "bench_saved: a child failed\n");
    return 1;
  }
  long long saved = dir_bytes(dir);
  printf("MLP 784-256-256-10 SGD training step, batch %d, saved in %.1f ms; %d fresh processes each\n", BATCH,
         save_ms, runs);
  printf("  cold disk cache: load %.2f ms + first call %.1f ms\n", median(cold_load, runs), median(cold_call, runs));
  printf("  warm disk cache: load %.2f ms + first call %.1f ms\n", median(warm_load, runs), median(warm_call, runs));
  printf("  saved directory %lld bytes; the weights alone %lld bytes (x%.4f)\n", saved, weight_bytes,
         (double)saved / (double)weight_bytes);
  bench_figure("saved_cold_load_call_ms", median(cold_load, runs) + median(cold_call, runs), "ms");
  bench_figure("saved_warm_load_call_ms", median(warm_load, runs) + median(warm_call, runs), "ms");
  bench_figure("saved_dir_over_weights", (double)saved / (double)weight_bytes, "x");
  kiln_function_free(f);
  kiln_optimizer_free(m.sgd);
  for (int i = 0; i < MLP_VARS; i++) kiln_variable_free(m.v[i]);
  char rm[512];
  snprintf(rm, sizeof rm, "rm -rf '%s'", tmp);
  return system(rm) == 0 ? 0 : 1;
}
