/* manager.c — the pass registry and the pipeline runner: parses a
 * comma-separated list of pass names, runs each pass on a function, times
 * it, verifies the IR after it (naming the pass that broke it) and tells an
 * observer, so that dumps and kiln-opt --print-after-all see every step. */
#include <string.h>
#include <time.h>

#include "passes.h"

/* One line per pass, in default pipeline order. */
static const pass_info registry[] = {
    {"inline", kiln_pass_inline, "inline calls of small functions (<= 64 instructions)"},
    {"simplify", kiln_pass_simplify, "algebraic identities (x*1, neg neg x, transpose of transpose, ...)"},
    {"fold", kiln_pass_fold, "evaluate instructions whose inputs are all constants (results <= 1024 elements)"},
    {"cse", kiln_pass_cse, "merge identical pure instructions"},
    {"dce", kiln_pass_dce, "remove instructions no result needs (random and host calls stay)"},
    {"fuse", kiln_pass_fuse, "group instructions into kernels (loop, reduction, dot epilogue, sibling fusion)"},
    {"buffers", kiln_pass_buffers, "place temporaries in one arena (liveness, in-place reuse, best fit)"},
    {NULL, NULL, NULL},
};

enum { N_REGISTRY = sizeof registry / sizeof registry[0] - 1 };

const pass_info *pass_list(void) { return registry; }

static const pass_info *find_in(const pass_info *table, int n, const char *name, size_t len) {
  for (int i = 0; i < n && table[i].name; i++)
    if (strlen(table[i].name) == len && !memcmp(table[i].name, name, len)) return &table[i];
  return NULL;
}

const pass_info *pass_find(const char *name) {
  return name ? find_in(registry, N_REGISTRY, name, strlen(name)) : NULL;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* the pipeline's next name: [*p, *p + *len); false at the end */
static bool next_name(const char **p, size_t *len, const char **name) {
  if (!**p) return false;
  const char *e = strchr(*p, ',');
  *name = *p;
  *len = e ? (size_t)(e - *p) : strlen(*p);
  *p = e ? e + 1 : *p + *len;
  return true;
}

int pass_run_pipeline_with(const pass_info *table, int n, ir_func *f, const char *pipeline, pass_report *report,
                           pass_observer obs, void *ctx) {
  if (report) report->n = 0;
  if (!table || n < 0) return kiln_set_error("pass: no pass table");
  if (!f) return kiln_set_error("pass: no function");
  if (!pipeline) pipeline = "";
  const char *p = pipeline, *name;
  size_t len;
  /* every name first: a typo must not leave f half optimized */
  while (next_name(&p, &len, &name)) {
    if (!len) return kiln_set_error("pass: empty pass name in pipeline '%s'", pipeline);
    if (!find_in(table, n, name, len)) return kiln_set_error("pass: unknown pass '%.*s'", (int)len, name);
  }
  /* a pass may assume valid input */
  if (ir_verify(f)) return -1;
  int step = 0;
  for (p = pipeline; next_name(&p, &len, &name);) {
    const pass_info *pass = find_in(table, n, name, len);
    double t0 = now_ms();
    int rc = pass->run(f);
    double ms = now_ms() - t0;
    if (rc) {
      if (!kiln_has_error()) kiln_set_error("%s: failed", pass->name);
      return -1;
    }
    if (ir_verify(f)) {
      char msg[1024];
      snprintf(msg, sizeof msg, "%s", kiln_last_error());
      return kiln_set_error("%s: broke the IR: %s", pass->name, msg);
    }
    step++;
    if (report && report->n < PASS_REPORT_MAX) {
      report->step[report->n].name = pass->name;
      report->step[report->n].ms = ms;
      report->step[report->n].ops_after = f->n_instrs;
      report->n++;
    }
    if (obs) obs(ctx, step, pass->name, f);
  }
  return 0;
}

int pass_run_pipeline(ir_func *f, const char *pipeline, pass_report *report, pass_observer obs, void *ctx) {
  return pass_run_pipeline_with(registry, N_REGISTRY, f, pipeline, report, obs, ctx);
}
