/* loc.c — source locations of traced instructions and KILN_DUMP. Tracing
 * keeps only the pc of the user's call (cheap); the pcs become file:line
 * through addr2line, once per trace and only when IR text is wanted. */
#include <dlfcn.h>
#include <errno.h>
#include <execinfo.h>
#include <stdio.h>
#include <stdlib.h>

#include "files.h"
#include "jit.h"

/* The first return address outside libkiln: the user's op call. */
void *loc_caller_pc(void) {
  Dl_info self;
  if (!dladdr((void *)(intptr_t)loc_caller_pc, &self)) return NULL;
  void *frames[64];
  int n = backtrace(frames, 64);
  /* the first frames may be backtrace's own (an ASan interceptor): start
   * looking once inside libkiln */
  bool inside = false;
  for (int i = 0; i < n; i++) {
    Dl_info d;
    if (!dladdr(frames[i], &d) || !d.dli_fbase) continue;
    if (d.dli_fbase == self.dli_fbase)
      inside = true;
    else if (inside)
      return frames[i];
  }
  return NULL;
}

/* Appends s single-quoted for the shell ('\'' for a quote). */
static int put_quoted(char **buf, size_t *len, size_t *cap, const char *s) {
  size_t need = *len + 4 * strlen(s) + 3;
  if (need > *cap) {
    char *q = realloc(*buf, need);
    if (!q) return -1;
    *buf = q, *cap = need;
  }
  char *o = *buf + *len;
  *o++ = '\'';
  for (; *s; s++) {
    if (*s == '\'') {
      memcpy(o, "'\\''", 4);
      o += 4;
    } else {
      *o++ = *s;
    }
  }
  *o++ = '\'';
  *o = '\0';
  *len = (size_t)(o - *buf);
  return 0;
}

/* Resolves the pcs of fn->pcs whose object is the one of pcs[first]; sets
 * fn->locs of those. Missing addr2line or no line info leaves them unset. */
static void resolve_object(traced_fn *fn, const Dl_info *info, int first) {
  int n = fn->func->n_instrs;
  size_t len = 0, cap = 256;
  char *cmd = malloc(cap);
  if (!cmd) return;
  len = (size_t)snprintf(cmd, cap, "addr2line -e ");
  if (put_quoted(&cmd, &len, &cap, info[first].dli_fname)) goto done;
  /* e_type of the mapped ELF header (<elf.h> clashes with ops.h): 2 is
   * ET_EXEC, a non-PIE executable, whose addresses are absolute */
  uint16_t e_type;
  memcpy(&e_type, (const char *)info[first].dli_fbase + 16, sizeof e_type);
  bool exec = e_type == 2;
  int *which = malloc((size_t)n * sizeof *which), nw = 0;
  if (!which) goto done;
  for (int i = first; i < n; i++) {
    if (!fn->pcs[i] || fn->locs[i].file || info[i].dli_fbase != info[first].dli_fbase) continue;
    if (len + 56 > cap) {
      char *q = realloc(cmd, cap * 2);
      if (!q) break;
      cmd = q, cap *= 2;
    }
    /* pc - 1: a return address may already belong to the next line */
    uintptr_t a = (uintptr_t)fn->pcs[i] - 1 - (exec ? 0 : (uintptr_t)info[first].dli_fbase);
    len += (size_t)snprintf(cmd + len, cap - len, " 0x%llx", (unsigned long long)a);
    which[nw++] = i;
  }
  FILE *p = NULL;
  if (nw && len + 16 < cap) {
    memcpy(cmd + len, " 2>/dev/null", 13);
    p = popen(cmd, "r");
  }
  if (p) {
    char line[4096];
    for (int k = 0; k < nw && fgets(line, sizeof line, p); k++) {
      line[strcspn(line, "\n")] = '\0';
      char *paren = strstr(line, " (discriminator");
      if (paren) *paren = '\0';
      char *colon = strrchr(line, ':');
      if (!colon || !strncmp(line, "??", 2)) continue;
      *colon = '\0';
      long ln = strtol(colon + 1, NULL, 10);
      if (ln <= 0) continue;
      const char *base = strrchr(line, '/');
      char *file = strdup(base ? base + 1 : line);
      if (!file) continue;
      fn->locs[which[k]] = (ir_loc){file, (int)ln};
    }
    pclose(p);
  }
  free(which);
done:
  free(cmd);
}

static void resolve_locs(traced_fn *fn) {
  int n = fn->func->n_instrs;
  if (fn->locs || !fn->pcs || !n) return;
  Dl_info *info = calloc((size_t)n, sizeof *info);
  if (!info || !(fn->locs = calloc((size_t)n, sizeof *fn->locs))) {
    free(info);
    return;
  }
  for (int i = 0; i < n; i++)
    if (fn->pcs[i] && (!dladdr(fn->pcs[i], &info[i]) || !info[i].dli_fname || !info[i].dli_fbase))
      fn->pcs[i] = NULL;
  /* one addr2line per object: without -a it prints one line per address */
  for (int i = 0; i < n; i++) {
    if (!fn->pcs[i] || fn->locs[i].file) continue;
    bool seen = false;
    for (int j = 0; j < i && !seen; j++) seen = fn->pcs[j] && info[j].dli_fbase == info[i].dli_fbase;
    if (!seen) resolve_object(fn, info, i);
  }
  free(info);
}

/* Instructions of a trace carry loc {NULL, r + 1}: "made by record r",
 * whose call site is locs[r]; passes keep locs, so the optimized IR (fused
 * bodies included) maps the same way. Prints m with those resolved, through
 * private copies: other threads may be running the shared instructions. */
static char *print_with_locs(traced_fn *fn, const ir_module *m) {
  resolve_locs(fn);
  int nl = fn->locs ? fn->func->n_instrs : 0;
  if (!nl) return ir_print_module(m);
  ir_module mod = *m;
  ir_func *copies = calloc((size_t)m->n_funcs + 1, sizeof *copies);
  ir_func **funcs = malloc(((size_t)m->n_funcs + 1) * sizeof *funcs);
  ir_instr **instrs = calloc((size_t)m->n_funcs + 1, sizeof *instrs);
  char *text = NULL;
  bool ok = copies && funcs && instrs;
  for (int k = 0; ok && k < m->n_funcs; k++) {
    const ir_func *g = m->funcs[k];
    copies[k] = *g;
    if (!(instrs[k] = malloc((size_t)g->n_instrs * sizeof **instrs + 1))) ok = false;
    for (int i = 0; ok && i < g->n_instrs; i++) {
      ir_loc loc = g->instrs[i].loc;
      instrs[k][i] = g->instrs[i];
      if (!loc.file && loc.line > 0 && loc.line <= nl) instrs[k][i].loc = fn->locs[loc.line - 1];
      /* calls, fusions and control flow point at the shared callees and
       * regions: print the copies */
      for (int j = 0; j < m->n_funcs; j++) {
        if (instrs[k][i].attrs.callee == m->funcs[j]) instrs[k][i].attrs.callee = &copies[j];
        if (instrs[k][i].attrs.callee2 == m->funcs[j]) instrs[k][i].attrs.callee2 = &copies[j];
      }
    }
    copies[k].instrs = instrs[k];
    funcs[k] = &copies[k];
  }
  if (ok) {
    mod.funcs = funcs;
    text = ir_print_module(&mod);
  }
  for (int k = 0; instrs && k < m->n_funcs; k++) free(instrs[k]);
  free(instrs);
  free(funcs);
  free(copies);
  return text;
}

char *traced_fn_print(traced_fn *fn) { return print_with_locs(fn, fn->module); }
char *traced_fn_print_optimized(traced_fn *fn) { return print_with_locs(fn, fn->opt_module); }

void traced_fn_free_locs(traced_fn *fn) {
  if (fn->locs && fn->func)
    for (int i = 0; i < fn->func->n_instrs; i++) free((char *)fn->locs[i].file);
  free(fn->locs);
  free(fn->pcs);
  fn->locs = NULL;
  fn->pcs = NULL;
}

/* KILN_DUMP=DIR: <name>.<trace>.<step>.<stage>.kir; DIR is made as
 * mkdir -p would (0755), or one line says why it cannot be */
int jit_dump(const char *name, int trace, int step, const char *stage, const char *text) {
  const char *dir = getenv("KILN_DUMP");
  if (!dir || !*dir) return 0;
  if (!text) {
    fprintf(stderr, "kiln: KILN_DUMP: @%s: out of memory\n", name);
    return -1;
  }
  char safe[128];
  size_t k = 0;
  for (; name[k] && k + 1 < sizeof safe; k++) safe[k] = name[k] == '/' ? '_' : name[k];
  safe[k] = '\0';
  char path[4096];
  const char *ext = !strcmp(stage, "llvm") ? "ll" : !strcmp(stage, "asm") ? "s" : !strcmp(stage, "ptx") ? "ptx" : "kir";
  snprintf(path, sizeof path, "%s/%s.%d.%02d.%s.%s", dir, safe, trace, step, stage, ext);
  if (files_mkdirs(dir, 0755)) {
    fprintf(stderr, "kiln: KILN_DUMP: cannot create the directory %s: %s; @%s is not dumped\n", dir,
            strerror(errno), name);
    return -1;
  }
  FILE *out = fopen(path, "w");
  bool ok = out && fputs(text, out) >= 0;
  int err = errno;
  if (out && fclose(out)) ok = false, err = errno;
  if (!ok) fprintf(stderr, "kiln: KILN_DUMP: cannot write %s: %s\n", path, strerror(err));
  return ok ? 0 : -1;
}
