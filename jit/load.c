/* load.c — kiln_function_load (API.md §11): a saved function's directory
 * (save.c) back as a kiln_function. Everything is read and checked at load:
 * the manifest, each trace's IR (parsed and verified, its parameters and
 * results against the manifest's types, its host calls bound by name), the
 * variables and the constants; a corrupt file fails the load, never a later
 * call. The function's trace cache (function.c) then takes each saved trace
 * in place of tracing a body (saved_trace_fn) and compiles it on first use,
 * through the disk cache. Where a body must run op by op (kiln_gradients,
 * tapes, kiln_function_set_eager), the saved IR is replayed through the
 * interpreter, whose ops trace and tape as a body's would. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "autodiff.h"
#include "files.h"
#include "saved.h"
#include "../lib/variable.h"

#define MAX_IR_BYTES ((int64_t)1 << 30)

static void saved_free(void *user) {
  saved_fn *s = user;
  if (!s) return;
  for (int k = 0; k < s->m.n_traces; k++) {
    if (s->texts) free(s->texts[k]);
    if (s->modules) ir_module_free(s->modules[k]);
    for (int j = 0; s->consts && s->consts[k] && j < s->m.traces[k].n_consts; j++) kiln_release(s->consts[k][j]);
    if (s->consts) free(s->consts[k]);
    if (s->in_device) free(s->in_device[k]);
  }
  free(s->texts);
  free(s->modules);
  free(s->funcs);
  free(s->consts);
  free(s->in_device);
  free(s->scope);
  free(s->vars); /* the variables themselves are the function's (f->owned) */
  manifest_free(&s->m);
  free(s);
}

/* ---- finding the trace of a call ---- */

static bool takes(const saved_fn *s, int k, int scope, int n, kiln_tensor *const *in) {
  const manifest_trace *t = &s->m.traces[k];
  if (s->scope[k] != scope) return false;
  for (int i = 0; i < n; i++) {
    const kiln_tensor *x = in[i];
    if (x->dtype != t->in[i].dtype || x->rank != t->in[i].rank || s->in_device[k][i] != x->device) return false;
    for (int d = 0; d < x->rank; d++)
      if (x->shape[d] != t->in[i].shape[d]) return false;
  }
  return true;
}

/* The saved trace for in's signature in this device scope, or -1 with an
 * error that lists the saved signatures. */
static int find_trace(const saved_fn *s, const char *name, int n_in, kiln_tensor *const *in) {
  int scope = device_current(), found = -1, second = -1;
  for (int k = 0; k < s->m.n_traces && second < 0; k++)
    if (takes(s, k, scope, n_in, in)) *(found < 0 ? &found : &second) = k;
  char buf[2048], sig[600];
  size_t used = 0;
  if (found >= 0 && second < 0) return found;
  if (second >= 0) {
    char a[600];
    kiln_set_error("function_call: @%s: saved traces %d (%s) and %d (%s) both take this call; they differ in "
                   "static arguments, which a loaded function cannot be given", name, found,
                   manifest_signature(&s->m, &s->m.traces[found], a, sizeof a), second,
                   manifest_signature(&s->m, &s->m.traces[second], sig, sizeof sig));
    return -1;
  }
  used += (size_t)snprintf(buf, sizeof buf, "(");
  for (int i = 0; i < n_in && used < sizeof buf; i++) {
    op_type ty;
    op_type_of(in[i], &ty);
    char s1[280];
    ir_type_str(s1, sizeof s1, &ty);
    used += (size_t)snprintf(buf + used, sizeof buf - used, "%s%s", i ? ", " : "", s1);
    if (in[i]->device != scope && used < sizeof buf)
      used += (size_t)snprintf(buf + used, sizeof buf - used, " on %s", kiln_device_name(in[i]->device));
  }
  if (used < sizeof buf) used += (size_t)snprintf(buf + used, sizeof buf - used, ") on %s; saved:", kiln_device_name(scope));
  for (int k = 0; k < s->m.n_traces && used < sizeof buf; k++)
    used += (size_t)snprintf(buf + used, sizeof buf - used, " %s%s", manifest_signature(&s->m, &s->m.traces[k], sig, sizeof sig),
                             k + 1 < s->m.n_traces ? ";" : "");
  kiln_set_error("function_call: @%s: no saved trace takes %s", name, buf);
  return -1;
}

/* Source locations as a fresh trace holds them (loc.c): instruction i of
 * the traced function carries {NULL, i + 1} and fn->locs[i] its place, so
 * that the IR prints, and keys the compiled-code cache, as the original's
 * did. Other functions' instructions point at an equal entry. */
static int adopt_locs(traced_fn *fn) {
  int n = fn->func->n_instrs;
  if (!n) return 0;
  if (!(fn->locs = calloc((size_t)n, sizeof *fn->locs))) return -1;
  for (int i = 0; i < n; i++) {
    ir_loc *l = &fn->func->instrs[i].loc;
    if (l->file && !(fn->locs[i].file = strdup(l->file))) return -1;
    fn->locs[i].line = l->line;
    *l = (ir_loc){NULL, i + 1};
  }
  for (int g = 0; g < fn->module->n_funcs; g++) {
    ir_func *h = fn->module->funcs[g];
    for (int i = 0; h != fn->func && i < h->n_instrs; i++) {
      ir_loc *l = &h->instrs[i].loc;
      for (int j = 0; l->file && j < n; j++)
        if (fn->locs[j].file && fn->locs[j].line == l->line && !strcmp(fn->locs[j].file, l->file))
          *l = (ir_loc){NULL, j + 1};
    }
  }
  return 0;
}

int saved_trace_fn(kiln_function *f, kiln_tensor *const *in, traced_fn *fn) {
  memset(fn, 0, sizeof *fn);
  const saved_fn *s = f->saved;
  int k = find_trace(s, f->name, f->n_in, in);
  if (k < 0) return -1;
  const manifest_trace *t = &s->m.traces[k];
  if (!(fn->module = ir_module_clone(s->modules[k]))) return -1;
  fn->func = ir_module_find(fn->module, t->func);
  fn->caps = malloc(((size_t)t->n_consts + 1) * sizeof *fn->caps);
  fn->vars = malloc(((size_t)t->n_vars + 1) * sizeof *fn->vars);
  fn->writes = malloc(((size_t)t->n_writes + 1) * sizeof *fn->writes);
  if (!fn->func || !fn->caps || !fn->vars || !fn->writes || adopt_locs(fn)) {
    traced_fn_free(fn);
    return kiln_set_error("function_call: out of memory");
  }
  for (; fn->n_caps < t->n_consts; fn->n_caps++) fn->caps[fn->n_caps] = kiln_retain(s->consts[k][fn->n_caps]);
  for (; fn->n_vars < t->n_vars; fn->n_vars++) fn->vars[fn->n_vars] = s->vars[t->vars[fn->n_vars]];
  for (; fn->n_writes < t->n_writes; fn->n_writes++) fn->writes[fn->n_writes] = t->writes[fn->n_writes];
  return 0;
}

/* ---- the body: the saved IR replayed op by op ---- */

/* Control flow and host calls replay only on concrete values: the
 * interpreter reads a predicate, and a callback would see symbolic tensors. */
static const char *not_replayable(const ir_module *m) {
  for (int g = 0; g < m->n_funcs; g++)
    for (int i = 0; i < m->funcs[g]->n_instrs; i++) {
      const ir_instr *in = &m->funcs[g]->instrs[i];
      if (kiln_ops[in->op].kind == OPK_CONTROL || in->op == OP_HOST_CALL) return kiln_ops[in->op].name;
    }
  return NULL;
}

static int replay_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  saved_fn *s = user;
  int k = find_trace(s, s->m.function, n_in, in);
  if (k < 0) return -1;
  const manifest_trace *t = &s->m.traces[k];
  const ir_func *g = s->funcs[k];
  bool symbolic = trace_current != NULL;
  for (int i = 0; i < n_in; i++) symbolic = symbolic || (in[i]->flags & TF_SYMBOLIC);
  const char *op = symbolic ? not_replayable(s->modules[k]) : NULL;
  if (op)
    return kiln_set_error("function_call: @%s: a loaded function is replayed op by op for gradients and under "
                          "tapes, and its trace %d holds a %s instruction, which only its compiled form runs "
                          "(call it without a tape watching its inputs)", s->m.function, k, op);
  kiln_tensor **args = malloc(((size_t)g->n_params + g->n_results + 1) * sizeof *args);
  if (!args) return kiln_set_error("function_call: out of memory");
  kiln_tensor **res = args + g->n_params;
  int rc = 0;
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int j = 0; j < t->n_consts; j++) args[n_in + j] = s->consts[k][j];
  for (int v = 0; v < t->n_vars && !rc; v++)
    if (!(args[n_in + t->n_consts + v] = kiln_variable_read(s->vars[t->vars[v]]))) rc = -1;
  if (!rc) rc = ir_run(g, args, res);
  for (int w = 0; w < t->n_writes && !rc; w++) rc = kiln_variable_assign(s->vars[t->vars[t->writes[w]]], res[n_out + w]);
  for (int o = 0; o < n_out && !rc; o++) out[o] = res[o];
  free(args);
  return rc;
}

/* ---- reading the directory ---- */

static bool same_type(const op_type *a, const manifest_tensor *b) {
  if (a->dtype != b->dtype || a->rank != b->rank) return false;
  for (int d = 0; d < a->rank; d++)
    if (a->shape[d] != b->shape[d]) return false;
  return true;
}

/* the error of a failed step, prefixed with the load's name and dir */
static int fail_in(const char *dir, const char *what) {
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", kiln_last_error());
  return kiln_set_error("function_load: %s: %s: %s", dir, what, msg);
}

/* Trace k's IR: read, parsed, checked against the manifest, host calls bound. */
static int load_trace(const char *dir, saved_fn *s, int k) {
  const manifest_trace *t = &s->m.traces[k];
  char *path = files_join(dir, t->ir);
  if (!path) return kiln_set_error("function_load: out of memory");
  size_t size;
  const char *why;
  int rc = 0;
  if (!(s->texts[k] = files_read_regular(path, MAX_IR_BYTES, &size, &why)))
    rc = kiln_set_error("function_load: %s: %s", path, why ? why : strerror(errno));
  else if (strlen(s->texts[k]) != size)
    rc = kiln_set_error("function_load: %s: corrupt: a NUL byte in the text", path);
  else if (!(s->modules[k] = ir_parse(s->texts[k], t->ir)))
    rc = fail_in(dir, t->ir);
  if (!rc && !(s->funcs[k] = ir_module_find(s->modules[k], t->func)))
    rc = kiln_set_error("function_load: %s: no function @%s, which the manifest names", path, t->func);
  const ir_func *g = s->funcs[k];
  if (!rc && (g->n_params != t->n_in + t->n_consts + t->n_vars || g->n_results != t->n_out + t->n_writes))
    rc = kiln_set_error("function_load: %s: @%s has %d parameters and %d results; the manifest says %d and %d",
                        path, t->func, g->n_params, g->n_results, t->n_in + t->n_consts + t->n_vars,
                        t->n_out + t->n_writes);
  for (int i = 0; !rc && i < g->n_params; i++) {
    const manifest_tensor *want = i < t->n_in               ? &t->in[i]
                                  : i < t->n_in + t->n_consts ? &t->consts[i - t->n_in]
                                                              : &s->m.vars[t->vars[i - t->n_in - t->n_consts]];
    if (!same_type(&g->types[i], want))
      rc = kiln_set_error("function_load: %s: parameter %d of @%s is not of the manifest's type", path, i, t->func);
  }
  for (int r = 0; !rc && r < g->n_results; r++) {
    const manifest_tensor *want = r < t->n_out ? &t->out[r] : &s->m.vars[t->vars[t->writes[r - t->n_out]]];
    if (!same_type(&g->types[g->results[r]], want))
      rc = kiln_set_error("function_load: %s: result %d of @%s is not of the manifest's type", path, r, t->func);
  }
  for (int h = 0; !rc && h < s->modules[k]->n_hosts; h++)
    if (!s->modules[k]->hosts[h]->fn)
      rc = kiln_set_error("function_load: %s: host call @%s: this process has no symbol of that name (link the "
                          "callback in and export it: -rdynamic for an executable's)", path,
                          s->modules[k]->hosts[h]->name);
  if (!rc) {
    s->scope[k] = device_find(t->device_scope);
    if (!(s->in_device[k] = malloc(((size_t)t->n_in + 1) * sizeof **s->in_device)))
      rc = kiln_set_error("function_load: out of memory");
    for (int i = 0; !rc && i < t->n_in; i++) s->in_device[k][i] = device_find(t->in[i].device);
  }
  free(path);
  return rc;
}

/* Variables named and typed as tensors[0..n), restored from file; NULL
 * entries where creation failed. 0 / -1. */
static int restore(const char *dir, const char *file, int n, const manifest_tensor *const *tensors,
                   kiln_variable **vars) {
  int rc = 0;
  for (int i = 0; i < n && !rc; i++) {
    kiln_scope_push();
    const manifest_tensor *t = tensors[i];
    vars[i] = kiln_variable_new(kiln_zeros(t->dtype, t->rank, t->shape), t->name);
    kiln_scope_pop();
    if (!vars[i]) rc = fail_in(dir, file);
  }
  char *path = rc ? NULL : files_join(dir, file);
  if (!rc && !path) rc = kiln_set_error("function_load: out of memory");
  if (!rc && kiln_checkpoint_restore(path, n, vars)) rc = fail_in(dir, file);
  free(path);
  return rc;
}

static int load_tensors(const char *dir, saved_fn *s) {
  int n = s->m.n_vars, nc = 0;
  for (int k = 0; k < s->m.n_traces; k++) nc += s->m.traces[k].n_consts;
  const manifest_tensor **ts = malloc(((size_t)(n > nc ? n : nc) + 1) * sizeof *ts);
  kiln_variable **cs = calloc((size_t)nc + 1, sizeof *cs);
  s->vars = calloc((size_t)n + 1, sizeof *s->vars);
  int rc = ts && cs && s->vars ? 0 : kiln_set_error("function_load: out of memory");
  for (int i = 0; i < n && !rc; i++) ts[i] = &s->m.vars[i];
  if (!rc) rc = restore(dir, MANIFEST_VARIABLES_FILE, n, ts, s->vars);
  for (int k = 0, i = 0; k < s->m.n_traces && !rc; k++)
    for (int j = 0; j < s->m.traces[k].n_consts; j++) ts[i++] = &s->m.traces[k].consts[j];
  if (!rc) rc = restore(dir, MANIFEST_CONSTANTS_FILE, nc, ts, cs);
  for (int k = 0, i = 0; k < s->m.n_traces && !rc; k++) {
    if (!(s->consts[k] = calloc((size_t)s->m.traces[k].n_consts + 1, sizeof **s->consts)))
      rc = kiln_set_error("function_load: out of memory");
    for (int j = 0; !rc && j < s->m.traces[k].n_consts; j++) s->consts[k][j] = variable_acquire(cs[i++]);
  }
  for (int i = 0; i < nc; i++) kiln_variable_free(cs[i]);
  free(cs);
  free(ts);
  return rc;
}

static saved_fn *load(const char *dir) {
  const char *who = "function_load";
  struct stat st;
  if (stat(dir, &st) || !S_ISDIR(st.st_mode)) {
    kiln_set_error("%s: %s: %s", who, dir, errno == ENOENT ? "no such directory" : "not a directory");
    return NULL;
  }
  char *path = files_join(dir, MANIFEST_FILE);
  saved_fn *s = calloc(1, sizeof *s);
  if (!path || !s) {
    free(path);
    free(s);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  size_t size;
  const char *why;
  char *text = files_read_regular(path, MANIFEST_MAX_BYTES, &size, &why);
  char err[512];
  int rc = 0;
  if (!text)
    rc = kiln_set_error("%s: %s: %s", who, path, why ? why : strerror(errno));
  else if (manifest_read(text, size, &s->m, err, sizeof err))
    rc = kiln_set_error("%s: %s: %s", who, path, err);
  free(text);
  free(path);
  int n = s->m.n_traces;
  if (!rc && !n) rc = kiln_set_error("%s: %s: the manifest lists no traces", who, dir);
  if (!rc) {
    s->texts = calloc((size_t)n, sizeof *s->texts);
    s->modules = calloc((size_t)n, sizeof *s->modules);
    s->funcs = calloc((size_t)n, sizeof *s->funcs);
    s->consts = calloc((size_t)n, sizeof *s->consts);
    s->scope = calloc((size_t)n, sizeof *s->scope);
    s->in_device = calloc((size_t)n, sizeof *s->in_device);
    if (!s->texts || !s->modules || !s->funcs || !s->consts || !s->scope || !s->in_device)
      rc = kiln_set_error("%s: out of memory", who);
  }
  for (int k = 0; k < n && !rc; k++) rc = load_trace(dir, s, k);
  if (!rc) rc = load_tensors(dir, s);
  if (rc) {
    for (int i = 0; s->vars && i < s->m.n_vars; i++) kiln_variable_free(s->vars[i]);
    saved_free(s);
    return NULL;
  }
  return s;
}

kiln_function *kiln_function_load(const char *path) {
  if (!path || !*path) {
    kiln_set_error("function_load: path is %s", path ? "empty" : "NULL");
    return NULL;
  }
  tape_state paused = tape_pause(); /* loading is not a use of anything */
  saved_fn *s = load(path);
  tape_resume(paused);
  if (!s) return NULL;
  kiln_function *f = kiln_function_new(s->m.function, replay_body, s, s->m.n_in, s->m.n_out);
  kiln_variable **owned = f ? malloc(((size_t)s->m.n_vars + 1) * sizeof *owned) : NULL;
  if (!owned) {
    if (f) kiln_set_error("function_load: out of memory");
    kiln_function_free(f);
    for (int i = 0; i < s->m.n_vars; i++) kiln_variable_free(s->vars[i]);
    saved_free(s);
    return NULL;
  }
  memcpy(owned, s->vars, (size_t)s->m.n_vars * sizeof *owned);
  f->owned = owned;
  f->n_owned = s->m.n_vars;
  f->saved = s;
  f->user_free = saved_free;
  f->settled = true; /* nothing creates variables */
  atomic_store(&f->inference, s->m.inference);
  return f;
}
