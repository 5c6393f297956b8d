/* manager.c — the pass registry and the pipeline runner: parses a
 * comma-separated list of pass names, runs each pass on a function, times
 * it, verifies the IR after it (naming the pass that broke it) and tells an
 * observer, so that dumps and kiln-opt --print-after-all see every step.
 *
 * Regions (the bodies of cond, while and scan) are optimized with the
 * function that holds them: each pass runs on every region first, the
 * innermost first, then on the function, so a pass looking at a control
 * instruction sees its regions already optimized (dce finds the unused
 * parameters, licm the invariant instructions). A pipeline asked to run on
 * a region itself does nothing: the function holding it runs it. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "passes.h"

/* One line per pass, in pipeline order (foldbn only in the inference one). */
static const pass_info registry[] = {
    {"inline", kiln_pass_inline, "inline calls of small functions (<= 64 instructions)"},
    {"simplify", kiln_pass_simplify, "algebraic identities (x*1, neg neg x, transpose of transpose, ..., what control flow passes through)"},
    {"fold", kiln_pass_fold,
     "evaluate instructions whose inputs are all constants (results <= 1024 elements); a cond on a "
     "constant predicate becomes its branch, a loop that never runs its initial state"},
    {"licm", kiln_pass_licm,
     "hoist pure loop-invariant instructions (of captures and constants) out of while and scan regions, and out of "
     "the branches of conds inside them when they cannot fail; work both branches of a cond do moves before it"},
    {"cse", kiln_pass_cse,
     "merge identical pure instructions, calls of pure functions, and control flow whose pure regions are the same"},
    {"dce", kiln_pass_dce,
     "remove instructions no result needs (random and host calls stay), unused loop state, scan ys, cond "
     "results and region parameters"},
    {"foldbn", kiln_pass_foldbn,
     "fold a per-channel affine map after a conv2d or dot (an inference batch norm) into its weights; changes "
     "rounding, so only in the inference pipeline"},
    {"combine", kiln_pass_combine,
     "merge all_reduces of one reduction and dtype, none reading another's result, into one all_reduce over one "
     "buffer (<= 64 MB; XLA's AllReduceCombiner); collectives keep their order"},
    {"fuse", kiln_pass_fuse,
     "group instructions into kernels (loop, reduction, dot epilogue, sibling fusion), inside loop "
     "bodies too; control flow itself is never fused"},
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

/* Runs pass on f's regions, innermost first, then on f; verifies each
 * function it ran on. */
static int run_tree(const pass_info *pass, ir_func *f, int depth) {
  if (depth > 64) return kiln_set_error("%s: regions nested too deep", pass->name);
  /* the regions now: the pass on f may replace them, after they ran */
  int n = 0;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_func *rg[2];
    n += ir_regions(&f->instrs[i], rg);
  }
  ir_func **regions = n ? malloc((size_t)n * sizeof *regions) : NULL;
  if (n && !regions) return kiln_set_error("pass: out of memory");
  n = 0;
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_func *rg[2];
    int nr = ir_regions(&f->instrs[i], rg);
    for (int k = 0; k < nr; k++)
      if (rg[k]) regions[n++] = (ir_func *)rg[k];
  }
  int rc = 0;
  for (int k = 0; k < n && !rc; k++) rc = run_tree(pass, regions[k], depth + 1);
  free(regions);
  if (rc) return -1;
  if (pass->run(f)) {
    if (!kiln_has_error()) kiln_set_error("%s: failed", pass->name);
    return -1;
  }
  if (ir_verify(f)) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    return kiln_set_error("%s: broke the IR: %s", pass->name, msg);
  }
  return 0;
}

/* Every region under f is held by one instruction, and is verified. */
static int verify_tree(const ir_func *f, const ir_func ***seen, int *n, int *cap, int depth) {
  if (depth > 64) return kiln_set_error("verify: @%s: regions nested too deep", f->name);
  for (int i = 0; i < f->n_instrs; i++) {
    const ir_func *rg[2];
    int nr = ir_regions(&f->instrs[i], rg);
    for (int k = 0; k < nr; k++) {
      if (!rg[k]) continue;
      for (int j = 0; j < *n; j++)
        if ((*seen)[j] == rg[k])
          return kiln_set_error("verify: @%s: a region must belong to one instruction, it belongs to two",
                                rg[k]->name);
      if (*n == *cap) {
        int c = *cap ? 2 * *cap : 8;
        const ir_func **q = realloc(*seen, (size_t)c * sizeof *q);
        if (!q) return kiln_set_error("verify: out of memory");
        *seen = q;
        *cap = c;
      }
      (*seen)[(*n)++] = rg[k];
      if (ir_verify(rg[k]) || verify_tree(rg[k], seen, n, cap, depth + 1)) return -1;
    }
  }
  return 0;
}

static int verify_all(const ir_func *f) {
  const ir_func **seen = NULL;
  int n = 0, cap = 0;
  int rc = ir_verify(f) || verify_tree(f, &seen, &n, &cap, 0) ? -1 : 0;
  free(seen);
  return rc;
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
  if (f->region) return 0; /* optimized with the function holding it */
  /* a pass may assume valid input */
  if (verify_all(f)) return -1;
  int step = 0;
  for (p = pipeline; next_name(&p, &len, &name);) {
    const pass_info *pass = find_in(table, n, name, len);
    double t0 = now_ms();
    int rc = run_tree(pass, f, 0);
    double ms = now_ms() - t0;
    if (rc) return -1;
    if (verify_all(f)) {
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
