/* kiln-opt — reads .kir text, verifies it, runs named passes and prints the
 * result, as mlir-opt and opt do; the driver of the FileCheck tests.
 *   kiln-opt [--passes=a,b] [--print-after-all] [--emit=kir|dot|llvm|asm|ptx|mlir] [--arch=sm_80|sm_90] file.kir|-
 * Passes (passes/passes.h) run on every function of the module, callees
 * included, one pass over all functions before the next. llvm and asm
 * compile each function that no other calls with the CPU backend, ptx with
 * the CUDA code generator (no GPU needed); without --passes they run the
 * default pipeline first. mlir prints every function no other calls (with
 * its callees) as MLIR on tensors (backends/mlir), after the passes named.
 * Exit codes: 0 ok, 1 parse/verify/pass error (on stderr), 2 usage. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "passes.h"
/* the backends' exported entry points (tools see lib/, ir/ and passes/) */
#include "../backends/cpu/cpu.h"
#include "../backends/cuda/ptx.h"
#include "../backends/mlir/mlir.h"

static int usage(const char *why) {
  if (why) fprintf(stderr, "kiln-opt: %s\n", why);
  fprintf(stderr,
          "usage: kiln-opt [--passes=a,b,...] [--print-after-all] [--emit=kir|dot|llvm|asm|ptx|mlir] "
          "[--arch=sm_80|sm_90] FILE.kir (- for stdin)\npasses (default pipeline: " PASS_DEFAULT_PIPELINE "):\n");
  for (const pass_info *p = pass_list(); p->name; p++) fprintf(stderr, "  %-10s %s\n", p->name, p->summary);
  return 2;
}

static char *read_all(FILE *in, size_t *n) {
  size_t len = 0, cap = 1 << 16;
  char *s = malloc(cap);
  while (s) {
    len += fread(s + len, 1, cap - 1 - len, in);
    if (len < cap - 1) break;
    char *t = realloc(s, cap * 2);
    if (!t) {
      free(s);
      return NULL;
    }
    s = t;
    cap *= 2;
  }
  if (s) s[len] = '\0';
  *n = len;
  return s;
}

/* whether some function of m calls (or fuses) f */
static bool is_called(const ir_module *m, const ir_func *f) {
  for (int i = 0; i < m->n_funcs; i++)
    for (int k = 0; k < m->funcs[i]->n_instrs; k++) {
      const ir_instr *in = &m->funcs[i]->instrs[k];
      if ((in->op == OP_CALL || in->op == OP_FUSION) && in->attrs.callee == f) return true;
    }
  return false;
}

/* The code of every function no other calls, one after the other. */
static char *emit_code(const ir_module *m, const char *emit, const char *arch) {
  char *all = NULL;
  size_t len = 0;
  for (int i = 0; i < m->n_funcs; i++) {
    const ir_func *f = m->funcs[i];
    if (is_called(m, f)) continue;
    char *text = NULL;
    if (!strcmp(emit, "ptx")) {
      text = cuda_ptx_text(f, arch);
    } else {
      cpu_program *p = cpu_compile(f);
      text = p ? cpu_program_text(p, emit) : NULL;
      cpu_program_free(p);
    }
    if (!text) {
      free(all);
      return NULL;
    }
    size_t n = strlen(text);
    char *q = realloc(all, len + n + 1);
    if (!q) {
      free(text);
      free(all);
      return NULL;
    }
    all = q;
    memcpy(all + len, text, n + 1);
    len += n;
    free(text);
  }
  return all ? all : calloc(1, 1);
}

int main(int argc, char **argv) {
  const char *file = NULL, *pipeline = NULL, *emit = "kir", *arch = NULL;
  bool print_after_all = false;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strncmp(a, "--passes=", 9)) {
      pipeline = a + 9;
    } else if (!strncmp(a, "--arch=", 7)) {
      arch = a + 7;
      if (strcmp(arch, "sm_80") && strcmp(arch, "sm_90")) {
        fprintf(stderr, "kiln-opt: unknown --arch '%s' (sm_80, sm_90)\n", arch);
        return 2;
      }
    } else if (!strcmp(a, "--print-after-all")) {
      print_after_all = true;
    } else if (!strncmp(a, "--emit=", 7)) {
      emit = a + 7;
    } else if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(NULL);
      return 0;
    } else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "kiln-opt: unknown option '%s'\n", a);
      return usage(NULL);
    } else if (file) {
      return usage("more than one input file");
    } else {
      file = a;
    }
  }
  if (!file) return usage("no input file");
  bool dot = !strcmp(emit, "dot"), mlir = !strcmp(emit, "mlir");
  bool code = !strcmp(emit, "llvm") || !strcmp(emit, "asm") || !strcmp(emit, "ptx");
  if (strcmp(emit, "kir") && !dot && !mlir && !code) {
    fprintf(stderr, "kiln-opt: unknown --emit kind '%s'\n", emit);
    return usage(NULL);
  }
  if (arch && strcmp(emit, "ptx")) return usage("--arch goes with --emit=ptx");
  if (!pipeline) pipeline = code ? PASS_DEFAULT_PIPELINE : "";
  /* check the pass names before reading anything */
  char name[64];
  for (const char *p = pipeline; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    snprintf(name, sizeof name, "%.*s", (int)n, p);
    if (n >= sizeof name || !pass_find(name)) {
      fprintf(stderr, "kiln-opt: unknown pass '%.*s'\n", (int)n, p);
      return 2;
    }
    p = e ? e + 1 : p + n;
  }

  FILE *in = strcmp(file, "-") ? fopen(file, "rb") : stdin;
  if (!in) {
    fprintf(stderr, "kiln-opt: cannot open %s\n", file);
    return 1;
  }
  size_t len = 0;
  char *text = read_all(in, &len);
  if (in != stdin) fclose(in);
  if (!text) {
    fprintf(stderr, "kiln-opt: cannot read %s\n", file);
    return 1;
  }
  if (strlen(text) != len) {
    fprintf(stderr, "kiln-opt: %s: contains a NUL byte\n", file);
    free(text);
    return 1;
  }
  ir_module *m = ir_parse(text, strcmp(file, "-") ? file : "<stdin>");
  free(text);
  if (!m) {
    fprintf(stderr, "%s\n", kiln_last_error());
    return 1;
  }
  /* one pass over every function, then the next: --print-after-all shows
   * the module between passes */
  for (const char *p = pipeline; *p;) {
    const char *e = strchr(p, ',');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    snprintf(name, sizeof name, "%.*s", (int)n, p);
    for (int i = 0; i < m->n_funcs; i++) {
      if (pass_run_pipeline(m->funcs[i], name, NULL, NULL, NULL)) {
        fprintf(stderr, "kiln-opt: @%s: %s\n", m->funcs[i]->name, kiln_last_error());
        ir_module_free(m);
        return 1;
      }
    }
    if (print_after_all) {
      char *text = ir_print_module(m);
      if (!text) {
        fprintf(stderr, "kiln-opt: %s\n", kiln_last_error());
        ir_module_free(m);
        return 1;
      }
      printf("// -----// IR after %s //----- //\n%s\n", name, text);
      free(text);
    }
    p = e ? e + 1 : p + n;
  }
  char *out = code ? emit_code(m, emit, arch) : dot ? ir_print_dot(m) : mlir ? mlir_emit_module(m) : ir_print_module(m);
  ir_module_free(m);
  if (!out) {
    fprintf(stderr, "kiln-opt: %s\n", kiln_last_error());
    return 1;
  }
  fputs(out, stdout);
  free(out);
  return 0;
}
