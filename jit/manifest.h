/* manifest.h — the manifest of a saved function (manifest.json in its
 * directory, manifest.c): the format version, Kiln's version, the
 * function's arity, its variables, and per trace the signature it was made
 * for, its IR file, its captured constants and the variables it reads and
 * writes. Written by save.c, read back (trusting nothing) by load.c.
 * Internal. */
#ifndef KILN_MANIFEST_H
#define KILN_MANIFEST_H

#include "runtime.h"

/* The format this Kiln writes; a manifest of a newer one is refused. */
#define MANIFEST_FORMAT 1
#define MANIFEST_FILE "manifest.json"
#define MANIFEST_VARIABLES_FILE "variables.safetensors"
#define MANIFEST_CONSTANTS_FILE "constants.safetensors"
/* limits a manifest is checked against (a corrupt one could ask for anything) */
#define MANIFEST_MAX_ITEMS 100000
#define MANIFEST_MAX_BYTES (64 << 20)

typedef struct {
  char *name;   /* a variable's or constant's key in its safetensors file; NULL for signatures */
  kiln_dtype dtype;
  int rank;
  int64_t shape[KILN_MAX_RANK];
  char *device; /* inputs: the device the trace was made for; NULL otherwise */
} manifest_tensor;

typedef struct {
  char *ir;           /* "trace<k>.kir", in the directory */
  char *func;         /* the traced function's name in that module */
  char *device_scope; /* the device scope it was made in ("cpu:0") */
  int n_in, n_out, n_statics, n_consts, n_vars, n_writes;
  manifest_tensor *in, *out, *consts;
  char **statics;     /* each static argument's value, as text (KILN_LOG=retrace's spelling) */
  int *vars;          /* the variables its parameters read, as indices of the manifest's */
  int *writes;        /* its results after the outputs: new values of vars[writes[w]] */
} manifest_trace;

typedef struct {
  int format;
  char *kiln_version;
  char *function;
  int n_in, n_out;
  bool inference;       /* kiln_function_set_optimize_for_inference */
  char *static_letters; /* kiln_jit's static argument letters, "" when none */
  int n_vars, n_traces;
  manifest_tensor *vars;
  manifest_trace *traces;
} manifest;

/* The manifest as JSON text (deterministic: the same manifest gives the same
 * bytes); malloc'd, NULL on out of memory. */
char *manifest_write(const manifest *m);
/* Parses and checks text (n bytes) into m (zeroed first; manifest_free it
 * either way). 0, or -1 with err (n bytes) saying what is wrong: a newer
 * format, a missing or malformed key, an index out of range. */
int manifest_read(const char *text, size_t n, manifest *m, char *err, size_t errn);
void manifest_free(manifest *m);
/* "f32[2,3] on gpu:0" / "(f32[2], i64[]) on cpu:0, n = 3": a trace's
 * signature for messages, into buf. */
const char *manifest_signature(const manifest *m, const manifest_trace *t, char *buf, size_t n);

#endif
