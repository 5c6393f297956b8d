/* save.c — kiln_function_save (API.md §11): every trace of a function as
 * the IR it was traced to (text, with source locations), its captured
 * tensors and the variables it reads and writes (safetensors), and a
 * manifest (manifest.c) naming each trace's signature. The traced IR, not
 * the optimized one: a load runs the same pass pipeline over it, so the
 * loaded function computes the same bits, and the optimized IR of this
 * build is no contract for another. The directory is written beside path
 * and renamed into place. Also kiln_function_variables. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "autodiff.h"
#include "files.h"
#include "saved.h"
#include "../lib/variable.h"

/* ---- the variables of a function ---- */

static int by_name(const void *a, const void *b) {
  kiln_variable *x = *(kiln_variable *const *)a, *y = *(kiln_variable *const *)b;
  int c = strcmp(kiln_variable_name(x), kiln_variable_name(y));
  if (c) return c;
  return variable_id(x) < variable_id(y) ? -1 : variable_id(x) > variable_id(y);
}

typedef struct {
  kiln_variable **v;
  int n, cap;
} var_set;

static int set_add(var_set *s, kiln_variable *v) {
  for (int i = 0; i < s->n; i++)
    if (s->v[i] == v) return 0;
  if (s->n == s->cap) {
    int cap = s->cap ? 2 * s->cap : 8;
    kiln_variable **grown = realloc(s->v, (size_t)cap * sizeof *grown);
    if (!grown) return -1;
    s->v = grown, s->cap = cap;
  }
  s->v[s->n++] = v;
  return 0;
}

/* f's own variables and those its traces read, sorted by name; caller
 * holds f->lock. 0 / -1 (out of memory). */
static int collect_vars(kiln_function *f, bool owned, var_set *s) {
  function_trace_view *views = NULL;
  int n = function_traces(f, &views);
  int rc = n < 0 ? -1 : 0;
  for (int i = 0; owned && i < f->n_owned && !rc; i++) rc = set_add(s, f->owned[i]);
  for (int t = 0; t < n; t++) {
    for (int i = 0; i < views[t].fn->n_vars && !rc; i++) rc = set_add(s, views[t].fn->vars[i]);
    free(views[t].in_device);
  }
  free(views);
  if (!rc && s->n > 1) qsort(s->v, (size_t)s->n, sizeof *s->v, by_name);
  return rc;
}

int kiln_function_variables(kiln_function *f, int max, kiln_variable **out) {
  const char *who = "function_variables";
  if (!f) return kiln_set_error("%s: function is NULL", who);
  if (max < 0) return kiln_set_error("%s: max = %d is negative", who, max);
  if (max > 0 && !out) return kiln_set_error("%s: out is NULL", who);
  var_set s = {0};
  pthread_mutex_lock(&f->lock);
  int rc = collect_vars(f, true, &s);
  pthread_mutex_unlock(&f->lock);
  if (rc) {
    free(s.v);
    return kiln_set_error("%s: out of memory", who);
  }
  for (int i = 0; i < s.n && i < max; i++) out[i] = s.v[i];
  free(s.v);
  return s.n;
}

/* ---- what a save writes ---- */

typedef struct {
  manifest m;
  char **texts;          /* per trace */
  kiln_tensor ***consts; /* per trace, retained */
  kiln_variable **vars;  /* m.n_vars, not owned */
} save_plan;

static void plan_free(save_plan *p) {
  for (int k = 0; k < p->m.n_traces; k++) {
    free(p->texts ? p->texts[k] : NULL);
    for (int j = 0; p->consts && p->consts[k] && j < p->m.traces[k].n_consts; j++) kiln_release(p->consts[k][j]);
    free(p->consts ? p->consts[k] : NULL);
  }
  free(p->texts);
  free(p->consts);
  free(p->vars);
  manifest_free(&p->m);
}

static char *dupstr(const char *s) { return strdup(s ? s : ""); }

static void type_of(manifest_tensor *t, const op_type *ty) {
  t->dtype = ty->dtype;
  t->rank = ty->rank;
  memcpy(t->shape, ty->shape, sizeof t->shape);
}

/* Every host call of m must be found again by name in another process. */
static int check_hosts(const kiln_function *f, const ir_module *m) {
  for (int i = 0; i < m->n_hosts; i++) {
    const ir_host *h = m->hosts[i];
    if (!h->fn || !strcmp(h->name, "host"))
      return kiln_set_error("function_save: @%s: a host call's callback has no symbol name (a static function, "
                            "or one of an executable linked without -rdynamic, or a gradient callback): a "
                            "saved function binds host calls by name", f->name);
    if (h->user)
      return kiln_set_error("function_save: @%s: host call @%s has user data, which cannot be saved: pass it "
                            "as a tensor input", f->name, h->name);
  }
  return 0;
}

/* One trace of f (view v) into p's trace k; caller holds f->lock. 0 / -1. */
static int plan_trace(kiln_function *f, const function_trace_view *v, const var_set *vars, save_plan *p, int k) {
  const char *who = "function_save";
  traced_fn *fn = v->fn;
  manifest_trace *t = &p->m.traces[k];
  const char *letters = f->key_of ? f->key_of->static_letters : NULL;
  int ns = letters ? (int)strlen(letters) : 0;
  if (v->statics_len != 8 * (size_t)ns)
    return kiln_set_error("%s: @%s: trace %d has static arguments of no known kind", who, f->name, v->index);
  if (check_hosts(f, fn->module)) return -1;
  char name[32];
  snprintf(name, sizeof name, "trace%d.kir", k);
  int n_out = fn->func->n_results - fn->n_writes;
  t->ir = strdup(name);
  t->func = strdup(fn->func->name);
  t->device_scope = dupstr(kiln_device_name(v->device_scope));
  t->in = calloc((size_t)f->n_in + 1, sizeof *t->in);
  t->out = calloc((size_t)n_out + 1, sizeof *t->out);
  t->statics = calloc((size_t)ns + 1, sizeof *t->statics);
  t->consts = calloc((size_t)fn->n_caps + 1, sizeof *t->consts);
  t->vars = calloc((size_t)fn->n_vars + 1, sizeof *t->vars);
  t->writes = calloc((size_t)fn->n_writes + 1, sizeof *t->writes);
  p->consts[k] = calloc((size_t)fn->n_caps + 1, sizeof **p->consts);
  p->texts[k] = traced_fn_print(fn);
  if (!t->ir || !t->func || !t->device_scope || !t->in || !t->out || !t->statics || !t->consts || !t->vars ||
      !t->writes || !p->consts[k] || !p->texts[k])
    return kiln_set_error("%s: out of memory", who);
  for (; t->n_in < f->n_in; t->n_in++) {
    type_of(&t->in[t->n_in], &fn->func->types[t->n_in]);
    if (!(t->in[t->n_in].device = dupstr(kiln_device_name(v->in_device[t->n_in])))) return kiln_set_error("%s: out of memory", who);
  }
  for (; t->n_out < n_out; t->n_out++) type_of(&t->out[t->n_out], &fn->func->types[fn->func->results[t->n_out]]);
  for (; t->n_statics < ns; t->n_statics++) {
    char s[64];
    function_static_str(s, sizeof s, letters[t->n_statics], v->statics + 8 * t->n_statics);
    if (!(t->statics[t->n_statics] = strdup(s))) return kiln_set_error("%s: out of memory", who);
  }
  for (; t->n_consts < fn->n_caps; t->n_consts++) {
    const kiln_tensor *c = fn->caps[t->n_consts];
    manifest_tensor *mt = &t->consts[t->n_consts];
    op_type ty = {(kiln_dtype)c->dtype, c->rank, {0}};
    memcpy(ty.shape, c->shape, sizeof ty.shape);
    type_of(mt, &ty);
    snprintf(name, sizeof name, "trace%d/%d", k, t->n_consts);
    if (!(mt->name = strdup(name))) return kiln_set_error("%s: out of memory", who);
    p->consts[k][t->n_consts] = kiln_retain(fn->caps[t->n_consts]);
  }
  for (; t->n_vars < fn->n_vars; t->n_vars++)
    for (int i = 0; i < vars->n; i++)
      if (vars->v[i] == fn->vars[t->n_vars]) t->vars[t->n_vars] = i;
  for (; t->n_writes < fn->n_writes; t->n_writes++) t->writes[t->n_writes] = fn->writes[t->n_writes];
  return 0;
}

static int plan_vars(save_plan *p, const var_set *vars) {
  p->m.vars = calloc((size_t)vars->n + 1, sizeof *p->m.vars);
  p->vars = malloc(((size_t)vars->n + 1) * sizeof *p->vars);
  if (!p->m.vars || !p->vars) return kiln_set_error("function_save: out of memory");
  for (; p->m.n_vars < vars->n; p->m.n_vars++) {
    kiln_variable *v = vars->v[p->m.n_vars];
    manifest_tensor *mt = &p->m.vars[p->m.n_vars];
    const kiln_tensor *ty = variable_type(v);
    op_type t = {(kiln_dtype)ty->dtype, ty->rank, {0}};
    memcpy(t.shape, ty->shape, sizeof t.shape);
    type_of(mt, &t);
    if (!(mt->name = strdup(kiln_variable_name(v)))) return kiln_set_error("function_save: out of memory");
    p->vars[p->m.n_vars] = v;
  }
  for (int i = 0; i + 1 < vars->n; i++)
    if (!strcmp(kiln_variable_name(vars->v[i]), kiln_variable_name(vars->v[i + 1])))
      return kiln_set_error("function_save: two variables its traces read are both named '%s'; a saved "
                            "function keeps its variables by name", kiln_variable_name(vars->v[i]));
  return 0;
}

/* A loaded function: every trace it was saved with, as read. */
static int plan_saved(kiln_function *f, save_plan *p) {
  const saved_fn *s = f->saved;
  var_set vars = {s->vars, s->m.n_vars, s->m.n_vars};
  manifest *m = &p->m;
  if (plan_vars(p, &vars)) return -1;
  while (m->n_traces < s->m.n_traces) {
    int k = m->n_traces++; /* counted first: a failure frees its parts */
    const manifest_trace *from = &s->m.traces[k];
    manifest_trace *t = &m->traces[k];
    if (check_hosts(f, s->modules[k])) return -1;
    /* the manifest's own strings and arrays, copied field by field */
    t->ir = strdup(from->ir), t->func = strdup(from->func), t->device_scope = strdup(from->device_scope);
    t->in = calloc((size_t)from->n_in + 1, sizeof *t->in);
    t->out = calloc((size_t)from->n_out + 1, sizeof *t->out);
    t->consts = calloc((size_t)from->n_consts + 1, sizeof *t->consts);
    t->statics = calloc((size_t)from->n_statics + 1, sizeof *t->statics);
    t->vars = malloc(((size_t)from->n_vars + 1) * sizeof *t->vars);
    t->writes = malloc(((size_t)from->n_writes + 1) * sizeof *t->writes);
    p->texts[k] = strdup(s->texts[k]);
    p->consts[k] = calloc((size_t)from->n_consts + 1, sizeof **p->consts);
    if (!t->ir || !t->func || !t->device_scope || !t->in || !t->out || !t->consts || !t->statics || !t->vars ||
        !t->writes || !p->texts[k] || !p->consts[k])
      return kiln_set_error("function_save: out of memory");
    for (; t->n_in < from->n_in; t->n_in++) {
      t->in[t->n_in] = from->in[t->n_in];
      if (!(t->in[t->n_in].device = strdup(from->in[t->n_in].device))) return kiln_set_error("function_save: out of memory");
    }
    for (; t->n_out < from->n_out; t->n_out++) t->out[t->n_out] = from->out[t->n_out];
    for (; t->n_consts < from->n_consts; t->n_consts++) {
      t->consts[t->n_consts] = from->consts[t->n_consts];
      t->consts[t->n_consts].name = NULL;
      if (!(t->consts[t->n_consts].name = strdup(from->consts[t->n_consts].name))) return kiln_set_error("function_save: out of memory");
      p->consts[k][t->n_consts] = kiln_retain(s->consts[k][t->n_consts]);
    }
    for (; t->n_statics < from->n_statics; t->n_statics++)
      if (!(t->statics[t->n_statics] = strdup(from->statics[t->n_statics]))) return kiln_set_error("function_save: out of memory");
    for (; t->n_vars < from->n_vars; t->n_vars++) t->vars[t->n_vars] = from->vars[t->n_vars];
    for (; t->n_writes < from->n_writes; t->n_writes++) t->writes[t->n_writes] = from->writes[t->n_writes];
  }
  return 0;
}

/* What to write for f; caller holds f->lock. 0 / -1. */
static int plan(kiln_function *f, save_plan *p) {
  const char *who = "function_save";
  manifest *m = &p->m;
  m->format = MANIFEST_FORMAT;
  m->n_in = f->n_in;
  m->n_out = f->n_out;
  m->inference = atomic_load(&f->inference);
  const char *letters = f->saved ? f->saved->m.static_letters : f->key_of ? f->key_of->static_letters : NULL;
  m->kiln_version = strdup(kiln_version());
  m->function = strdup(f->saved ? f->saved->m.function : f->name);
  m->static_letters = dupstr(letters);
  function_trace_view *views = NULL;
  int n = f->saved ? f->saved->m.n_traces : function_traces(f, &views);
  if (n < 0 || !m->kiln_version || !m->function || !m->static_letters) return kiln_set_error("%s: out of memory", who);
  int rc = 0;
  if (!n)
    rc = kiln_set_error("%s: @%s has no traces yet: call it (once for each signature it should serve) before "
                        "saving it", who, f->name);
  m->traces = calloc((size_t)n + 1, sizeof *m->traces);
  p->texts = calloc((size_t)n + 1, sizeof *p->texts);
  p->consts = calloc((size_t)n + 1, sizeof *p->consts);
  if (!rc && (!m->traces || !p->texts || !p->consts)) rc = kiln_set_error("%s: out of memory", who);
  if (!rc && f->saved) {
    rc = plan_saved(f, p);
  } else if (!rc) {
    var_set vars = {0};
    rc = collect_vars(f, false, &vars) ? kiln_set_error("%s: out of memory", who) : plan_vars(p, &vars);
    for (; !rc && m->n_traces < n; m->n_traces++) rc = plan_trace(f, &views[m->n_traces], &vars, p, m->n_traces);
    free(vars.v);
  }
  for (int t = 0; views && t < n; t++) free(views[t].in_device);
  free(views);
  return rc;
}

/* ---- writing the directory ---- */

/* safetensors of the given tensors under the given names, through
 * kiln_checkpoint_save (temporary variables hold them) */
static int write_tensors(const char *path, int n, kiln_tensor *const *ts, const char *const *names) {
  kiln_variable **vars = calloc((size_t)n + 1, sizeof *vars);
  int rc = vars ? 0 : kiln_set_error("function_save: out of memory");
  for (int i = 0; i < n && !rc; i++)
    if (!(vars[i] = kiln_variable_new(ts[i], names[i]))) rc = -1;
  if (!rc) rc = kiln_checkpoint_save(path, n, vars);
  for (int i = 0; vars && i < n; i++) kiln_variable_free(vars[i]);
  free(vars);
  return rc;
}

static int write_text(const char *dir, const char *name, const char *text) {
  char *path = files_join(dir, name);
  if (!path) return kiln_set_error("function_save: out of memory");
  int rc = files_write_new(path, text, strlen(text), 0666);
  if (rc) rc = kiln_set_error("function_save: %s: cannot write: %s", path, strerror(errno));
  free(path);
  return rc;
}

/* The whole directory at dir (new and empty). 0 / -1. */
static int write_dir(const save_plan *p, const char *dir) {
  char *text = manifest_write(&p->m);
  int rc = text ? write_text(dir, MANIFEST_FILE, text) : kiln_set_error("function_save: out of memory");
  free(text);
  for (int k = 0; k < p->m.n_traces && !rc; k++) rc = write_text(dir, p->m.traces[k].ir, p->texts[k]);
  char *path = rc ? NULL : files_join(dir, MANIFEST_VARIABLES_FILE);
  if (!rc && path) rc = kiln_checkpoint_save(path, p->m.n_vars, p->vars);
  free(path);
  /* the constants of every trace in one file */
  int n = 0;
  for (int k = 0; k < p->m.n_traces; k++) n += p->m.traces[k].n_consts;
  kiln_tensor **ts = rc ? NULL : malloc(((size_t)n + 1) * sizeof *ts);
  const char **names = rc ? NULL : malloc(((size_t)n + 1) * sizeof *names);
  path = rc ? NULL : files_join(dir, MANIFEST_CONSTANTS_FILE);
  if (!rc && (!ts || !names || !path)) rc = kiln_set_error("function_save: out of memory");
  for (int k = 0, i = 0; !rc && k < p->m.n_traces; k++)
    for (int j = 0; j < p->m.traces[k].n_consts; j++, i++) {
      ts[i] = p->consts[k][j];
      names[i] = p->m.traces[k].consts[j].name;
    }
  if (!rc) rc = write_tensors(path, n, ts, names);
  free(ts);
  free(names);
  free(path);
  return rc;
}

/* Moves the new directory tmp to path, replacing a saved function there
 * (never anything else). 0 / -1. */
static int install(const char *tmp, const char *path) {
  const char *who = "function_save";
  struct stat st;
  if (lstat(path, &st)) {
    if (errno != ENOENT) return kiln_set_error("%s: %s: %s", who, path, strerror(errno));
    if (rename(tmp, path)) return kiln_set_error("%s: %s: cannot rename the new directory into place: %s", who, path, strerror(errno));
    return 0;
  }
  char *manifest_path = files_join(path, MANIFEST_FILE);
  bool saved = manifest_path && S_ISDIR(st.st_mode) && !lstat(manifest_path, &st) && S_ISREG(st.st_mode);
  free(manifest_path);
  if (!saved)
    return kiln_set_error("%s: %s exists and is not a saved function; a save replaces only a saved function's "
                          "directory", who, path);
  size_t n = strlen(path) + 64;
  char *old = malloc(n);
  if (!old) return kiln_set_error("%s: out of memory", who);
  /* an empty directory to rename the old one over, so that path is never missing for long */
  int rc = files_make_temp_dir(path, "old", old, n, 0700);
  if (rc || rename(path, old)) {
    rc = kiln_set_error("%s: %s: cannot move the old saved function aside: %s", who, path, strerror(errno));
  } else if (rename(tmp, path)) {
    rc = kiln_set_error("%s: %s: cannot rename the new directory into place: %s", who, path, strerror(errno));
    rename(old, path);
  } else {
    files_remove_dir(old);
  }
  if (rc) rmdir(old);
  free(old);
  return rc;
}

int kiln_function_save(kiln_function *f, const char *path) {
  const char *who = "function_save";
  if (!f) return kiln_set_error("%s: function is NULL", who);
  if (!path) return kiln_set_error("%s: path is NULL", who);
  if (!*path) return kiln_set_error("%s: path is empty", who);
  save_plan p = {0};
  pthread_mutex_lock(&f->lock);
  int rc = plan(f, &p);
  pthread_mutex_unlock(&f->lock);
  size_t n = strlen(path) + 64;
  char *tmp = rc ? NULL : malloc(n);
  if (!rc && !tmp) rc = kiln_set_error("%s: out of memory", who);
  if (!rc && files_make_temp_dir(path, "tmp", tmp, n, 0777)) {
    rc = kiln_set_error("%s: %s: cannot create a directory beside it: %s", who, path, strerror(errno));
    free(tmp);
    tmp = NULL;
  }
  if (!rc) {
    tape_state saved = tape_pause(); /* saving is not a use of the variables */
    kiln_scope_push();
    rc = write_dir(&p, tmp);
    kiln_scope_pop();
    tape_resume(saved);
  }
  if (!rc) rc = install(tmp, path);
  if (rc && tmp) files_remove_dir(tmp);
  free(tmp);
  plan_free(&p);
  return rc;
}
