/* reuse.c — one LLVM function for kernels that are the same code: a loop
 * body traced from the same C code twice (the L2HMC leapfrog's two
 * gradient evaluations, an unrolled loop's steps) plans kernels that differ
 * only in the buffers they are given. Each kernel is emitted as usual (cheap);
 * its text, its own name left out, is compared with the kernels emitted
 * before it, and an identical one is called instead, so LLVM's passes and
 * code generation (nearly all of a compile) see it once. Equal text is equal
 * code: the buffers come in as parameters, in the same order. */
#include <stdlib.h>
#include <string.h>

#include "cpu/compile.h"

/* fn's text without its name: what follows the name's first occurrence */
static char *body_text(LLVMValueRef fn) {
  char *s = LLVMPrintValueToString(fn);
  size_t len;
  const char *name = LLVMGetValueName2(fn, &len);
  char *at = s ? strstr(s, name) : NULL;
  char *out = at ? strdup(at + len) : NULL;
  LLVMDisposeMessage(s);
  return out;
}

void cpu_reuse_free(cpu_reuse *r) {
  if (!r) return;
  for (int k = 0; k < r->n; k++) free(r->text[k]);
  free(r->text), free(r->fn), free(r->task);
  memset(r, 0, sizeof *r);
}

int cpu_reuse_kernel(cpu_build *cb, kinfo *ki) {
  cpu_reuse *r = &cb->reuse;
  char *text = body_text(ki->fn);
  if (!text) return cpu_oom();
  for (int k = 0; k < r->n; k++) {
    if (strcmp(r->text[k], text)) continue;
    free(text);
    LLVMDeleteFunction(ki->task);
    LLVMDeleteFunction(ki->fn);
    ki->fn = r->fn[k], ki->task = r->task[k];
    /* called from two places now: inlined into each, it would be compiled twice */
    cpu_add_fn_attr(cb->e.ctx, ki->fn, "noinline");
    return 1;
  }
  if (r->n == r->cap) {
    int cap = r->cap ? 2 * r->cap : 16;
    char **t = realloc(r->text, (size_t)cap * sizeof *t);
    if (t) r->text = t;
    LLVMValueRef *f = t ? realloc(r->fn, (size_t)cap * sizeof *f) : NULL;
    if (f) r->fn = f;
    LLVMValueRef *g = f ? realloc(r->task, (size_t)cap * sizeof *g) : NULL;
    if (!g) {
      free(text);
      return cpu_oom();
    }
    r->task = g, r->cap = cap;
  }
  r->text[r->n] = text, r->fn[r->n] = ki->fn, r->task[r->n++] = ki->task;
  return 0;
}
