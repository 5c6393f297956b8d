/* kiln-aot — ahead-of-time compilation of a saved function (API.md §11), as
 * tfcompile and IREE do: one trace of a directory that kiln_function_save
 * wrote becomes a relocatable object exporting
 *   int NAME_run(const void *const *inputs, void *const *outputs)
 * and a C header declaring it with the arena size and each input's and
 * output's dtype and shape. The object links with libkiln_rt alone (no
 * libkiln, no LLVM): pkg-config --libs kiln_rt.
 *   kiln-aot DIR --function NAME --trace I -o NAME.o --header NAME.h
 *            [--target=<triple>] [--cpu=<name>]
 * The code is the CPU backend's for the host CPU, or for --cpu's (an LLVM
 * CPU name: x86-64, x86-64-v3, skylake-avx512, ...), and --target's triple.
 * Exit codes: 0 ok, 1 error (on stderr), 2 usage. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../backends/cpu/cpu.h"
#include "../jit/function.h"

static int usage(const char *why) {
  if (why) fprintf(stderr, "kiln-aot: %s\n", why);
  fprintf(stderr, "usage: kiln-aot DIR --function NAME --trace I -o NAME.o --header NAME.h "
                  "[--target=<triple>] [--cpu=<name>]\n");
  return 2;
}

static bool c_identifier(const char *s) {
  if (!*s || isdigit((unsigned char)*s)) return false;
  for (; *s; s++)
    if (!isalnum((unsigned char)*s) && *s != '_') return false;
  return true;
}

/* "--opt value" or "--opt=value" at argv[*i]: the value, or NULL */
static const char *option(int argc, char **argv, int *i, const char *name) {
  size_t n = strlen(name);
  if (strncmp(argv[*i], name, n)) return NULL;
  if (argv[*i][n] == '=') return argv[*i] + n + 1;
  if (argv[*i][n] || *i + 1 >= argc) return NULL;
  return argv[++*i];
}

static void type_macros(FILE *h, const char *up, const char *what, int i, const op_type *t) {
  int64_t size = 1;
  fprintf(h, "#define %s_%s_%d_DTYPE \"%s\"\n", up, what, i, kiln_dtype_name(t->dtype));
  fprintf(h, "#define %s_%s_%d_DTYPE_SIZE %d\n", up, what, i, (int)kiln_dtype_size(t->dtype));
  fprintf(h, "#define %s_%s_%d_RANK %d\n", up, what, i, t->rank);
  fprintf(h, "#define %s_%s_%d_SHAPE {", up, what, i);
  for (int d = 0; d < t->rank; d++) fprintf(h, "%s%lld", d ? ", " : "", (long long)t->shape[d]), size *= t->shape[d];
  fprintf(h, "%s}\n", t->rank ? "" : "1"); /* a scalar: {1}, an array needs an element */
  fprintf(h, "#define %s_%s_%d_SIZE %lld\n", up, what, i, (long long)size);
  fprintf(h, "#define %s_%s_%d_BYTES %lld\n", up, what, i, (long long)size * (long long)kiln_dtype_size(t->dtype));
}

static int write_header(const char *path, const char *name, const char *dir, int trace, const ir_func *f, int n_in,
                        size_t arena) {
  FILE *h = fopen(path, "w");
  if (!h) return fprintf(stderr, "kiln-aot: cannot write %s\n", path), -1;
  char up[256];
  size_t n = strlen(name);
  for (size_t i = 0; i <= n && i < sizeof up; i++) up[i] = (char)toupper((unsigned char)name[i]);
  fprintf(h, "/* %s.h: written by kiln-aot (Kiln %s) from %s, trace %d. Link %s.o with libkiln_rt\n"
             " * (pkg-config --libs kiln_rt).\n *\n"
             " * %s_run runs the function: inputs[i] and outputs[r] point at buffers of the\n"
             " * types below (row-major, 64-byte aligned); the outputs are written. 0, or -1\n"
             " * with kiln_rt_last_error() saying why (an index out of range, a misaligned\n"
             " * buffer, out of memory for the arena). Many threads may call it at once;\n"
             " * each takes an arena of %s_ARENA_BYTES, kept for its next call. */\n",
          name, kiln_version(), dir, trace, name, name, up);
  fprintf(h, "#ifndef %s_AOT_H\n#define %s_AOT_H\n\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n\n", up, up);
  fprintf(h, "int %s_run(const void *const *inputs, void *const *outputs);\n", name);
  fprintf(h, "/* libkiln_rt: the calling thread's last error message */\nconst char *kiln_rt_last_error(void);\n\n");
  fprintf(h, "#define %s_ALIGN 64\n#define %s_ARENA_BYTES %zuu\n#define %s_NUM_INPUTS %d\n#define %s_NUM_OUTPUTS %d\n",
          up, up, arena, up, n_in, up, f->n_results);
  for (int i = 0; i < n_in; i++) type_macros(h, up, "INPUT", i, &f->types[i]);
  for (int r = 0; r < f->n_results; r++) type_macros(h, up, "OUTPUT", r, &f->types[f->results[r]]);
  fprintf(h, "\n#ifdef __cplusplus\n}\n#endif\n#endif\n");
  if (fclose(h)) return fprintf(stderr, "kiln-aot: cannot write %s\n", path), -1;
  return 0;
}

int main(int argc, char **argv) {
  const char *dir = NULL, *name = NULL, *trace_s = NULL, *obj_path = NULL, *h_path = NULL, *triple = NULL,
             *cpu = NULL, *v;
  for (int i = 1; i < argc; i++) {
    if ((v = option(argc, argv, &i, "--function"))) name = v;
    else if ((v = option(argc, argv, &i, "--trace"))) trace_s = v;
    else if ((v = option(argc, argv, &i, "-o"))) obj_path = v;
    else if ((v = option(argc, argv, &i, "--header"))) h_path = v;
    else if ((v = option(argc, argv, &i, "--target"))) triple = v;
    else if ((v = option(argc, argv, &i, "--cpu"))) cpu = v;
    else if (argv[i][0] == '-' && argv[i][1]) return usage("unknown option or missing value");
    else if (!dir) dir = argv[i];
    else return usage("more than one directory");
  }
  if (!dir || !name || !trace_s || !obj_path || !h_path) return usage(NULL);
  char *end;
  long trace = strtol(trace_s, &end, 10);
  if (!*trace_s || *end || trace < 0 || trace > 1000000) return usage("--trace takes a trace number (0, 1, ...)");
  if (!c_identifier(name) || strlen(name) > 200) return usage("--function takes a C identifier (NAME_run is exported)");
  if (cpu && setenv("KILN_CPU", cpu, 1)) return fprintf(stderr, "kiln-aot: cannot set the CPU\n"), 1;

  kiln_function *f = kiln_function_load(dir);
  if (!f) return fprintf(stderr, "kiln-aot: %s\n", kiln_last_error()), 1;
  int rc = 0;
  if (strcmp(f->name, name)) {
    fprintf(stderr, "kiln-aot: %s holds function @%s, not @%s\n", dir, f->name, name);
    kiln_function_free(f);
    return 1;
  }
  traced_fn fn;
  kiln_tensor **data = NULL;
  int n_data = 0;
  if (jit_saved_trace(f, (int)trace, &fn, &data, &n_data)) {
    fprintf(stderr, "%s\n", kiln_last_error());
    kiln_function_free(f);
    return 1;
  }
  const ir_func *g = fn.opt_func;
  int n_in = g->n_params - n_data;
  cpu_aot_spec spec = {name, triple, n_in, (const kiln_tensor *const *)data};
  void *obj = NULL;
  size_t len = 0, arena = 0;
  if (cpu_aot_object(g, &spec, &obj, &len, &arena)) {
    fprintf(stderr, "kiln-aot: %s\n", kiln_last_error());
    rc = 1;
  }
  FILE *o = rc ? NULL : fopen(obj_path, "wb");
  bool wrote = o && fwrite(obj, 1, len, o) == len;
  if (o && fclose(o)) wrote = false;
  if (!rc && !wrote) {
    fprintf(stderr, "kiln-aot: cannot write %s\n", obj_path);
    remove(obj_path);
    rc = 1;
  }
  if (!rc && write_header(h_path, name, dir, (int)trace, g, n_in, arena)) rc = 1;
  free(obj);
  for (int i = 0; i < n_data; i++) kiln_release(data[i]);
  free(data);
  traced_fn_free(&fn);
  kiln_function_free(f);
  return rc;
}
