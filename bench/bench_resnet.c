/* bench_resnet.c — ResNet-50 (torchvision's resnet50, v1.5: resnet_model.h)
 * on synthetic 224x224x3 images, the TF Eager paper's Figure 3: images/s of
 * a training step (forward, tape gradient, SGD with momentum 0.9, batch
 * norm's running statistics updated) run eagerly and staged as one
 * kiln_function (with its first call's trace / passes / compile ms and
 * kernel count), and of inference (running statistics) eagerly and staged;
 * each as a fraction of the f32 FMA peak measured in the same run (peak.h;
 * flops counted as 2 per multiply-add of the convs and the dense layer, 3x
 * the forward's for a training step). Medians of --runs steps after
 * --warmup ones. Then bench/resnet_torch.py, PyTorch's peer (torchvision's
 * resnet50 in NCHW and channels_last), in the same run, and the ratios
 * Kiln / PyTorch (against PyTorch's faster layout).
 *
 *   bench_resnet [--batch N] [--runs R] [--warmup W] [--modes LIST]
 *                [--no-torch] [--python CMD] [--cache]
 *   bench_resnet --check [--python CMD]
 *
 * LIST: train-eager,train-staged,infer-eager,infer-staged (the default,
 * all). --cache keeps Kiln's disk cache of compiled code (off by default, so
 * the compile time is cold). --check runs resnet_model.h's resnet_check: a
 * small ResNet in f64, eager == staged, and == PyTorch where CMD (default
 * /usr/bin/python3) imports torch, torchvision and numpy; exit status 0 when
 * everything agrees.
 *
 * Lines starting with "@" (resnet.bBATCH.MODE.IMPL) are machine-readable. */
#define _POSIX_C_SOURCE 200809L /* setenv, popen, mkdtemp, readlink */
#include <kiln.h>

#include "bench_util.h"
#include "peak.h"
#include "resnet_model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAX_RUNS = 51 };

/* bench/resnet_torch.py, next to this source (__FILE__ is relative to the
 * build directory, where the binary lives, when ccache rewrites it) */
static void script_path(char *out, size_t size) {
  const char *env = getenv("KILN_RESNET_TORCH");
  if (env) {
    snprintf(out, size, "%s", env);
    return;
  }
  char dir[4096] = "";
  const char *file = __FILE__;
  const char *slash = strrchr(file, '/');
  if (file[0] != '/') {
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    if (n > 0) {
      dir[n] = 0;
      char *e = strrchr(dir, '/');
      if (e) e[1] = 0;
    } else {
      dir[0] = 0;
    }
  }
  snprintf(out, size, "%s%.*sresnet_torch.py", dir, slash ? (int)(slash - file + 1) : 0, file);
}

static int torch_available(const char *python) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "%s -c 'import torch, torchvision, numpy' >/dev/null 2>&1", python);
  return system(cmd) == 0;
}

static int run_check(const char *python) {
  char script[4096], cmd[8192], dir[] = "/tmp/kiln_resnet_check_XXXXXX", report[16384];
  script_path(script, sizeof script);
  int torch = torch_available(python);
  if (!torch)
    printf("resnet check: %s cannot import torch, torchvision and numpy (install python3-torch and "
           "python3-torchvision): comparing eager with staged only\n",
           python);
  if (!mkdtemp(dir)) {
    fprintf(stderr, "bench_resnet: cannot make %s\n", dir);
    return 1;
  }
  snprintf(cmd, sizeof cmd, "%s '%s' --check", python, script);
  double t0 = now_s();
  int bad = resnet_check(torch ? cmd : NULL, dir, 1e-8, report, sizeof report);
  printf("%s\n(%.1f s)\n", report, now_s() - t0);
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "bench_resnet: cannot remove %s\n", dir);
  if (bad) printf("resnet check: FAILED (%d)\n", bad);
  return bad != 0;
}

typedef struct {
  const char *name; /* train-eager ... */
  bool train, staged;
  double ips;       /* images/s, 0 = not run */
} mode;

static int time_mode(mode *md, resnet_model *m, kiln_tensor *x, kiln_tensor *labels, int warmup, int runs,
                     double peak) {
  int64_t batch = kiln_tensor_shape(x)[0];
  kiln_optimizer *opt = md->train ? kiln_sgd_momentum_new(0.01, 0.9, false) : NULL;
  resnet_stage st = {m, opt};
  kiln_function *f = NULL;
  if (md->staged)
    f = md->train ? kiln_function_new("resnet_train", resnet_train_body, &st, 2, 1)
                  : kiln_function_new("resnet_infer", resnet_infer_body, &st, 1, 1);
  int rc = (md->train && !opt) || (md->staged && !f) ? -1 : 0;
  double s[MAX_RUNS], first = 0, last_loss = NAN;
  for (int r = 0; !rc && r < warmup + runs; r++) {
    kiln_scope_push();
    kiln_tensor *in[2] = {x, labels}, *out = NULL;
    double t0 = now_s();
    if (md->staged) {
      rc = kiln_function_call(f, in, &out);
    } else if (md->train) {
      rc = resnet_train_step(m, opt, x, labels, &out);
    } else {
      rc = (out = resnet_forward(m, x, false, false)) ? 0 : -1;
    }
    if (!rc && md->train) last_loss = kiln_tensor_item(out); /* eager work is done by now; staged too */
    double t = now_s() - t0;
    if (r == 0) first = t;
    if (r >= warmup) s[r - warmup] = t;
    kiln_scope_pop();
  }
  if (rc) {
    fprintf(stderr, "bench_resnet: %s: %s\n", md->name, kiln_last_error());
  } else {
    double med = median(s, runs);
    double flops = m->flops * (md->train ? 3 : 1) * (double)batch;
    md->ips = (double)batch / med;
    printf("kiln  resnet50 %-12s batch %lld: %7.2f img/s  %5.1f%% of the FMA peak  (median of %d, %.0f ms per step",
           md->name, (long long)batch, md->ips, 100 * flops / med * 1e-9 / peak, runs, med * 1e3);
    if (md->train) printf(", loss %.4f", last_loss);
    printf(")\n");
    char key[96];
    snprintf(key, sizeof key, "resnet.b%lld.%s.kiln-%s", (long long)batch, md->train ? "train" : "infer",
             md->staged ? "staged" : "eager");
    bench_figure(key, md->ips, "img/s");
    if (md->staged) {
      kiln_stats stt;
      int tr = kiln_function_trace_count(f) - 1;
      if (!kiln_function_stats(f, tr, &stt)) {
        printf("      first call %.2f s: trace %.0f ms, passes %.0f ms, compile %.0f ms; %d traced ops -> %d optimized, "
               "%d kernels (%d fused ops), temporaries %.0f MB (%.0f MB unshared); %d traces\n",
               first, stt.trace_ms, stt.optimize_ms, stt.compile_ms, stt.traced_ops, stt.optimized_ops, stt.kernels,
               stt.fused_ops, stt.peak_bytes / 1e6, stt.unshared_bytes / 1e6, tr + 1);
        snprintf(key, sizeof key, "resnet.b%lld.%s.compile_ms", (long long)batch, md->train ? "train" : "infer");
        bench_figure(key, stt.trace_ms + stt.optimize_ms + stt.compile_ms, "ms");
        snprintf(key, sizeof key, "resnet.b%lld.%s.kernels", (long long)batch, md->train ? "train" : "infer");
        bench_figure(key, stt.kernels, "kernels");
      }
    }
  }
  kiln_function_free(f);
  kiln_optimizer_free(opt);
  return rc;
}

/* runs resnet_torch.py, echoing it; torch[k] gets "@ resnet.bB.{train,infer}.torch[-cl]" */
static void run_torch(const char *python, int64_t batch, int warmup, int runs, int threads, bool train, bool infer,
                      double torch[2][2]) {
  char script[4096], cmd[8192], line[1024];
  script_path(script, sizeof script);
  snprintf(cmd, sizeof cmd, "%s '%s' --batch %lld --warmup %d --runs %d --threads %d --modes %s%s%s 2>&1", python,
           script, (long long)batch, warmup, runs, threads, train ? "train" : "", train && infer ? "," : "",
           infer ? "infer" : "");
  fflush(stdout);
  FILE *p = popen(cmd, "r");
  if (!p) {
    printf("torch: cannot run %s\n", cmd);
    return;
  }
  while (fgets(line, sizeof line, p)) {
    fputs(line, stdout);
    char key[256];
    double v;
    if (sscanf(line, "@ %255s %lf", key, &v) == 2) {
      char prefix[64];
      int n = snprintf(prefix, sizeof prefix, "resnet.b%lld.", (long long)batch);
      if (strncmp(key, prefix, (size_t)n)) continue;
      const char *k = key + n;
      int mode = !strncmp(k, "train.", 6) ? 0 : !strncmp(k, "infer.", 6) ? 1 : -1;
      if (mode < 0) continue;
      torch[mode][strstr(k, "-cl") != NULL] = v;
    }
  }
  int st = pclose(p);
  if (st) printf("torch: %s exited with status %d\n", script, st);
}

int main(int argc, char **argv) {
  int runs = 5, warmup = 2;
  int64_t batch = 8;
  bool check = false, with_torch = true, cache = false;
  const char *python = "/usr/bin/python3", *modes = "train-eager,train-staged,infer-eager,infer-staged";
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
      warmup = atoi(argv[++i]);
    } else if (!strcmp(argv[i], "--batch") && i + 1 < argc) {
      batch = atoll(argv[++i]);
    } else if (!strcmp(argv[i], "--modes") && i + 1 < argc) {
      modes = argv[++i];
    } else if (!strcmp(argv[i], "--python") && i + 1 < argc) {
      python = argv[++i];
    } else if (!strcmp(argv[i], "--check")) {
      check = true;
    } else if (!strcmp(argv[i], "--no-torch")) {
      with_torch = false;
    } else if (!strcmp(argv[i], "--cache")) {
      cache = true;
    } else {
      fprintf(stderr,
              "usage: bench_resnet [--batch N] [--runs R] [--warmup W] [--modes LIST] [--no-torch] [--python CMD] "
              "[--cache]\n       bench_resnet --check [--python CMD]\n"
              "LIST: comma-separated train-eager,train-staged,infer-eager,infer-staged\n");
      return 2;
    }
  }
  if (!cache) setenv("KILN_CACHE_DIR", "off", 1); /* the compile time is cold */
  if (check) return run_check(python);
  if (runs < 1) runs = 1;
  if (runs > MAX_RUNS) runs = MAX_RUNS;
  if (warmup < 1) warmup = 1;
  if (batch < 1) batch = 1;

  int threads = kiln_num_threads();
  double peak = peak_gflops(threads);
  printf("f32 FMA peak: %.1f GFLOP/s on %d threads (measured)\n", peak, threads);
  bench_figure("resnet.fma_peak", peak, "GFLOP/s");
  resnet_config cfg = resnet50_config();
  kiln_random_seed(50);
  resnet_model *m = resnet_new(&cfg, NULL);
  if (!m) {
    fprintf(stderr, "bench_resnet: %s\n", kiln_last_error());
    return 1;
  }
  printf("kiln  resnet50: %d variables, %lld parameters, %.2f GFLOP per image forward (2 per multiply-add), "
         "training 3x\n",
         m->nvars, (long long)m->params, m->flops * 1e-9);
  bench_figure("resnet.params.kiln", (double)m->params, "parameters");
  int64_t xs[4] = {batch, cfg.image, cfg.image, 3}, ls[1] = {batch};
  kiln_tensor *x = kiln_random_normal(KILN_F32, 4, xs);
  kiln_tensor *labels = kiln_cast(kiln_random_uniform(KILN_F64, 1, ls, 0, (double)cfg.classes), KILN_I64);

  mode all[4] = {{"train-eager", true, false, 0},
                 {"train-staged", true, true, 0},
                 {"infer-eager", false, false, 0},
                 {"infer-staged", false, true, 0}};
  int failed = !x || !labels;
  bool any_train = false, any_infer = false;
  for (int k = 0; k < 4 && !failed; k++) {
    const char *p = strstr(modes, all[k].name);
    size_t len = strlen(all[k].name);
    if (!p || (p[len] && p[len] != ',')) continue;
    if (time_mode(&all[k], m, x, labels, warmup, runs, peak)) failed = 1;
    any_train |= all[k].train, any_infer |= !all[k].train;
  }
  if (with_torch && !failed) {
    double torch[2][2] = {{0, 0}, {0, 0}};
    if (!torch_available(python)) {
      printf("torch: %s cannot import torch and torchvision (install python3-torch and python3-torchvision): "
             "no peer\n",
             python);
    } else {
      run_torch(python, batch, warmup, runs, threads, any_train, any_infer, torch);
      for (int k = 0; k < 4; k++) {
        const double *t = torch[all[k].train ? 0 : 1];
        double best = t[0] > t[1] ? t[0] : t[1];
        if (all[k].ips <= 0 || best <= 0) continue;
        double goal = all[k].staged ? 1.3 : 0.9;
        printf("ratio kiln %-12s / torch (%s): %.2f  (goal >= %.1f)\n", all[k].name,
               t[0] > t[1] ? "NCHW" : "channels_last", all[k].ips / best, goal);
        char key[96];
        snprintf(key, sizeof key, "resnet.b%lld.%s.ratio", (long long)batch, all[k].name);
        bench_figure(key, all[k].ips / best, "x");
      }
    }
  }
  kiln_release(x);
  kiln_release(labels);
  resnet_free(m);
  return failed;
}
