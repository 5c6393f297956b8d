/* passes.h — Kiln's optimizer: the registry of named passes and the manager
 * that runs a pipeline of them over a function, verifying after each one.
 * Each pass is one file (passes/<name>.c) exporting kiln_pass_<name>.
 * Internal; the entry points are exported (KILN_EXPORT) for kiln-opt and the
 * tests. */
#ifndef KILN_PASSES_H
#define KILN_PASSES_H

#include "ir.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A pass rewrites f in place: 0, or -1 with the error set ("cse: ...") and f
 * left as it was. It may read (not change) other functions of f's module. */
typedef int (*pass_fn)(ir_func *f);

typedef struct pass_info {
  const char *name; /* as written in a pipeline */
  pass_fn run;
  const char *summary; /* one line, for kiln-opt --help */
} pass_info;

/* The registered pass called name; NULL if there is none. */
KILN_EXPORT const pass_info *pass_find(const char *name);
/* The registry in pipeline order, terminated by an entry with name NULL. */
KILN_EXPORT const pass_info *pass_list(void);

/* The passes (one file each). Every one keeps, untouched and alive, the
 * instructions it does not understand. */
KILN_EXPORT int kiln_pass_inline(ir_func *f);   /* inline.c: inlines calls of small functions */
KILN_EXPORT int kiln_pass_simplify(ir_func *f); /* simplify.c: algebraic identities */
KILN_EXPORT int kiln_pass_fold(ir_func *f);     /* fold.c: evaluates constant instructions */
KILN_EXPORT int kiln_pass_cse(ir_func *f);      /* cse.c: merges identical pure instructions */
KILN_EXPORT int kiln_pass_dce(ir_func *f);      /* dce.c: removes what no result needs */
KILN_EXPORT int kiln_pass_licm(ir_func *f);     /* licm.c: hoists loop-invariant work out of loop bodies */
KILN_EXPORT int kiln_pass_combine(ir_func *f); /* combine.c: merges independent all_reduces into one buffer */
KILN_EXPORT int kiln_pass_fuse(ir_func *f);     /* fuse.c: groups instructions into kernels (fusion) */
KILN_EXPORT int kiln_pass_buffers(ir_func *f);  /* buffers.c: plans the temporaries in one arena */
KILN_EXPORT int kiln_pass_foldbn(ir_func *f);   /* foldbn.c: folds a per-channel affine (inference batch norm) into
                                                   the conv or matmul before it; changes rounding: not default */

/* Called after each pass of a pipeline (KILN_DUMP, kiln-opt
 * --print-after-all): step counts from 1, pass is its name, f the function
 * after it. */
typedef void (*pass_observer)(void *ctx, int step, const char *pass, const ir_func *f);

enum { PASS_REPORT_MAX = 32 };
/* What a pipeline did, one step per pass run (the first PASS_REPORT_MAX). */
typedef struct pass_report {
  int n;
  struct {
    const char *name; /* the registry's string (static) */
    double ms;        /* wall time of the pass, verification excluded */
    int ops_after;    /* f->n_instrs after it */
  } step[PASS_REPORT_MAX];
} pass_report;

/* Runs the comma-separated pipeline ("inline,simplify", "" = none) on f:
 * each pass on f's regions (innermost first), then on f; on a region
 * itself it does nothing (the function holding it runs it).
 * Every name is checked before any pass runs ("pass: unknown pass 'x'").
 * f is verified after every pass; a failure says "<pass>: broke the IR:
 * <verifier message>" and stops the pipeline with f as that pass left it.
 * A failing pass stops it too, with the pass's own error. report and obs may
 * be NULL. 0 / -1. */
KILN_EXPORT int pass_run_pipeline(ir_func *f, const char *pipeline, pass_report *report, pass_observer obs,
                                  void *ctx);
/* pass_run_pipeline over another table of n passes (tests register broken
 * passes this way). */
KILN_EXPORT int pass_run_pipeline_with(const pass_info *table, int n, ir_func *f, const char *pipeline,
                                       pass_report *report, pass_observer obs, void *ctx);

#define PASS_DEFAULT_PIPELINE "inline,simplify,fold,licm,cse,dce,combine,fuse,buffers"
/* The pipeline of a function optimized for inference
 * (kiln_function_set_optimize_for_inference): the default one with
 * foldbn, which changes rounding, and the clean-up after it. */
#define PASS_INFERENCE_PIPELINE "inline,simplify,fold,licm,cse,dce,foldbn,fold,cse,dce,combine,fuse,buffers"

#ifdef __cplusplus
}
#endif
#endif
