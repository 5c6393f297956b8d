/* function.c — staged functions (API.md §5, §6): a trace cache keyed by the
 * inputs' dtypes, shapes and devices and the device scope. A miss traces the
 * body once with symbolic tensors (trace.c); every call then runs the
 * verified IR through the reference interpreter, with fresh random draws and
 * the variables' current values. There are no passes or backend yet. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "autodiff.h"
#include "jit.h"

typedef struct {
  uint8_t dtype, device;
  int8_t rank;
  int64_t shape[KILN_MAX_RANK];
} arg_sig;

typedef struct {
  arg_sig *args; /* n_in of them */
  int device_scope;
  traced_fn fn;
  int traced_ops;
  double trace_ms;
} cached_trace;

struct kiln_function {
  char *name;
  kiln_body_fn body;
  void *user;
  int n_in, n_out;
  atomic_bool eager;
  pthread_mutex_t lock; /* guards traces; tracing happens under it */
  cached_trace **traces;  /* entries never move or die before kiln_function_free */
  int n_traces, cap_traces;
};

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

kiln_function *kiln_function_new(const char *name, kiln_body_fn body, void *user, int n_in, int n_out) {
  const char *who = "function_new";
  if (!body) {
    kiln_set_error("%s: body is NULL", who);
    return NULL;
  }
  if (n_in < 0 || n_out < 0) {
    kiln_set_error("%s: n_in = %d and n_out = %d must not be negative", who, n_in, n_out);
    return NULL;
  }
  kiln_function *f = calloc(1, sizeof *f);
  if (!f || !(f->name = strdup(name && *name ? name : "f"))) {
    free(f);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  f->body = body;
  f->user = user;
  f->n_in = n_in;
  f->n_out = n_out;
  atomic_init(&f->eager, false);
  pthread_mutex_init(&f->lock, NULL);
  return f;
}

void kiln_function_free(kiln_function *f) {
  if (!f) return;
  for (int i = 0; i < f->n_traces; i++) {
    traced_fn_free(&f->traces[i]->fn);
    free(f->traces[i]->args);
    free(f->traces[i]);
  }
  free(f->traces);
  pthread_mutex_destroy(&f->lock);
  free(f->name);
  free(f);
}

void kiln_function_set_eager(kiln_function *f, bool eager) {
  if (f) atomic_store(&f->eager, eager);
}

int kiln_function_trace_count(const kiln_function *f) {
  if (!f) return kiln_set_error("function_trace_count: function is NULL");
  kiln_function *m = (kiln_function *)f;
  pthread_mutex_lock(&m->lock);
  int n = m->n_traces;
  pthread_mutex_unlock(&m->lock);
  return n;
}

static void sig_of(const kiln_tensor *t, arg_sig *s) {
  memset(s, 0, sizeof *s);
  s->dtype = t->dtype;
  s->device = t->device;
  s->rank = t->rank;
  for (int i = 0; i < t->rank; i++) s->shape[i] = t->shape[i];
}

static bool sig_eq(const arg_sig *a, const arg_sig *b) {
  if (a->dtype != b->dtype || a->device != b->device || a->rank != b->rank) return false;
  for (int i = 0; i < a->rank; i++)
    if (a->shape[i] != b->shape[i]) return false;
  return true;
}

static char *sig_str(char *buf, size_t n, const arg_sig *s) {
  op_type ty = {(kiln_dtype)s->dtype, s->rank, {0}};
  for (int i = 0; i < s->rank; i++) ty.shape[i] = s->shape[i];
  ir_type_str(buf, n, &ty);
  if (s->device) {
    size_t len = strlen(buf);
    snprintf(buf + len, n - len, " on %s", kiln_device_name(s->device));
  }
  return buf;
}

/* caller holds f->lock */
static cached_trace *lookup(kiln_function *f, const arg_sig *args, int device_scope) {
  for (int t = 0; t < f->n_traces; t++) {
    cached_trace *c = f->traces[t];
    bool hit = c->device_scope == device_scope;
    for (int i = 0; hit && i < f->n_in; i++) hit = sig_eq(&c->args[i], &args[i]);
    if (hit) return c;
  }
  return NULL;
}

static bool log_retrace(void) {
  const char *env = getenv("KILN_LOG");
  return env && strstr(env, "retrace");
}

/* KILN_LOG=retrace: what differs from the latest trace */
static void report_retrace(const kiln_function *f, const cached_trace *prev, const cached_trace *c) {
  char what[600] = "no input changed";
  if (prev->device_scope != c->device_scope) {
    snprintf(what, sizeof what, "device scope: %s -> %s", kiln_device_name(prev->device_scope),
             kiln_device_name(c->device_scope));
  } else {
    for (int i = 0; i < f->n_in; i++) {
      if (sig_eq(&prev->args[i], &c->args[i])) continue;
      char a[280], b[280];
      snprintf(what, sizeof what, "arg %d: %s -> %s", i, sig_str(a, sizeof a, &prev->args[i]),
               sig_str(b, sizeof b, &c->args[i]));
      break;
    }
  }
  fprintf(stderr, "kiln: retrace @%s: %s (%.2f ms)\n", f->name, what, c->trace_ms);
}

/* Traces f's body on in's signature; a cache entry, or NULL with the error
 * set (the body's own message when it failed). */
static cached_trace *trace_body(kiln_function *f, kiln_tensor *const *in, const arg_sig *args,
                                int device_scope) {
  cached_trace *c = calloc(1, sizeof *c);
  kiln_tensor **sym_in = calloc((size_t)f->n_in + 1, sizeof *sym_in);
  kiln_tensor **outs = calloc((size_t)f->n_out + 1, sizeof *outs);
  if (!c || !sym_in || !outs || !(c->args = malloc((size_t)(f->n_in + 1) * sizeof *c->args))) {
    kiln_set_error("function_call: out of memory");
    goto fail;
  }
  memcpy(c->args, args, (size_t)f->n_in * sizeof *args);
  c->device_scope = device_scope;
  double t0 = now_ms();
  tape_state saved = tape_pause(); /* a trace records nothing on tapes */
  kiln_scope_push();                /* the symbolic tensors die with it */
  int rc = -1;
  trace *tr = trace_begin(f->n_in, in, sym_in);
  if (tr) {
    rc = f->body(f->user, f->n_in, sym_in, f->n_out, outs);
    trace_end(tr);
    if (rc) {
      if (!kiln_has_error()) kiln_set_error("function_call: @%s: the body failed without an error", f->name);
      trace_free(tr);
    } else {
      for (int i = 0; i < f->n_out && !rc; i++)
        if (!outs[i]) rc = kiln_set_error("function_call: @%s: the body left output %d NULL", f->name, i);
      if (rc)
        trace_free(tr);
      else
        rc = trace_finish(tr, f->name, f->n_out, outs, &c->fn);
    }
  }
  kiln_scope_pop();
  tape_resume(saved);
  if (rc) goto fail;
  c->trace_ms = now_ms() - t0;
  c->traced_ops = c->fn.func->n_instrs;
  free(sym_in);
  free(outs);
  return c;
fail:
  if (c) free(c->args);
  free(c);
  free(sym_in);
  free(outs);
  return NULL;
}

/* Runs a trace: explicit inputs, captures, variables' current values; random
 * instructions draw fresh blocks of the global stream, in program order as
 * the eager body would. */
static int run_trace(const cached_trace *c, int n_in, kiln_tensor *const *in, kiln_tensor **out) {
  const traced_fn *fn = &c->fn;
  int np = fn->func->n_params, rc;
  kiln_tensor **args = malloc((size_t)(np + 1) * sizeof *args);
  ir_instr *instrs = NULL;
  if (!args) return kiln_set_error("function_call: out of memory");
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int i = 0; i < fn->n_caps; i++) args[n_in + i] = fn->caps[i];
  for (int i = 0; i < fn->n_vars; i++) args[n_in + fn->n_caps + i] = kiln_retain(variable_value(fn->vars[i]));
  ir_func copy = *fn->func;
  if (fn->n_rng) { /* a private instruction list: the cached IR is shared by threads */
    instrs = malloc((size_t)copy.n_instrs * sizeof *instrs);
    if (!instrs) {
      rc = kiln_set_error("function_call: out of memory");
      goto done;
    }
    memcpy(instrs, copy.instrs, (size_t)copy.n_instrs * sizeof *instrs);
    for (int k = 0; k < fn->n_rng; k++) {
      ir_instr *ri = &instrs[fn->rng[k]];
      int64_t size = 1;
      for (int d = 0; d < ri->attrs.rank; d++) size *= ri->attrs.shape[d];
      ri->attrs.counter = rng_reserve(((uint64_t)size + 1) / 2, &ri->attrs.seed);
    }
    copy.instrs = instrs;
  }
  rc = ir_interpret(&copy, args, out);
done:
  for (int i = 0; i < fn->n_vars; i++) kiln_release(args[n_in + fn->n_caps + i]);
  free(instrs);
  free(args);
  return rc;
}

int kiln_function_call(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  const char *who = "function_call";
  if (!f) return kiln_set_error("%s: function is NULL", who);
  if (f->n_in && !in) return kiln_set_error("%s: @%s: in is NULL for %d inputs", who, f->name, f->n_in);
  if (f->n_out && !out) return kiln_set_error("%s: @%s: out is NULL for %d outputs", who, f->name, f->n_out);
  for (int i = 0; i < f->n_in; i++) {
    if (!in[i]) return kiln_has_error() ? -1 : kiln_set_error("%s: @%s: input %d is NULL", who, f->name, i);
    if ((in[i]->flags & TF_SYMBOLIC) && !trace_current)
      return kiln_set_error("%s: @%s: input %d is a symbolic tensor that escaped a staged function's body",
                            who, f->name, i);
  }
  /* eager mode, and calls made while tracing another body (inlined for now) */
  if (atomic_load(&f->eager) || trace_current) {
    kiln_tensor **o = calloc((size_t)f->n_out + 1, sizeof *o);
    if (!o) return kiln_set_error("%s: out of memory", who);
    int rc = f->body(f->user, f->n_in, in, f->n_out, o);
    if (rc && !kiln_has_error()) kiln_set_error("%s: @%s: the body failed without an error", who, f->name);
    for (int i = 0; i < f->n_out && !rc; i++)
      if (!o[i]) rc = kiln_set_error("%s: @%s: the body left output %d NULL", who, f->name, i);
    if (!rc) memcpy(out, o, (size_t)f->n_out * sizeof *o);
    free(o);
    return rc;
  }
  if (KILN_UNLIKELY(tape_active_count))
    for (int i = 0; i < f->n_in; i++)
      if (tape_tracks(in[i]))
        return kiln_set_error("%s: @%s: input %d is watched by a gradient tape; gradients through "
                              "staged functions are not supported yet (kiln_function_set_eager runs "
                              "the body op by op)", who, f->name, i);
  arg_sig small[8], *args = f->n_in > 8 ? malloc((size_t)f->n_in * sizeof *args) : small;
  if (!args) return kiln_set_error("%s: out of memory", who);
  for (int i = 0; i < f->n_in; i++) sig_of(in[i], &args[i]);
  int device_scope = device_current();
  pthread_mutex_lock(&f->lock);
  cached_trace *c = lookup(f, args, device_scope);
  if (!c && (c = trace_body(f, in, args, device_scope))) {
    cached_trace **q = f->n_traces < f->cap_traces
                           ? f->traces
                           : realloc(f->traces, (size_t)(f->cap_traces ? 2 * f->cap_traces : 4) * sizeof *q);
    if (!q) {
      traced_fn_free(&c->fn);
      free(c->args);
      free(c);
      c = NULL;
      kiln_set_error("%s: out of memory", who);
    } else {
      if (q != f->traces) f->cap_traces = f->cap_traces ? 2 * f->cap_traces : 4;
      f->traces = q;
      f->traces[f->n_traces++] = c;
      if (f->n_traces > 1 && log_retrace()) report_retrace(f, f->traces[f->n_traces - 2], c);
      traced_fn_dump(&c->fn, f->name, f->n_traces - 1);
    }
  }
  pthread_mutex_unlock(&f->lock);
  if (args != small) free(args);
  if (!c) return -1;
  if (KILN_UNLIKELY(tape_active_count))
    for (int i = 0; i < c->fn.n_vars; i++) {
      kiln_tensor *v = variable_value(c->fn.vars[i]);
      if (v->dtype == KILN_F32 || v->dtype == KILN_F64)
        return kiln_set_error("%s: @%s: reads variable '%s' while a gradient tape is active; gradients "
                              "through staged functions are not supported yet", who, f->name,
                              kiln_variable_name(c->fn.vars[i]));
    }
  return run_trace(c, f->n_in, in, out);
}

/* caller holds the lock */
static const cached_trace *trace_at(const char *who, kiln_function *f, int trace) {
  if (trace < 0 || trace >= f->n_traces) {
    kiln_set_error("%s: @%s: trace %d does not exist (%d made so far)", who, f->name, trace, f->n_traces);
    return NULL;
  }
  return f->traces[trace];
}

char *kiln_function_ir(kiln_function *f, int trace, const char *stage) {
  const char *who = "function_ir";
  if (!f || !stage) {
    kiln_set_error("%s: %s is NULL", who, f ? "stage" : "function");
    return NULL;
  }
  bool known = !strcmp(stage, "llvm") || !strcmp(stage, "asm") || !strcmp(stage, "ptx");
  if (strcmp(stage, "traced") && strcmp(stage, "optimized")) {
    if (known)
      kiln_set_error("%s: stage '%s' is not available yet", who, stage);
    else
      kiln_set_error("%s: unknown stage '%s' (traced, optimized, llvm, asm, ptx)", who, stage);
    return NULL;
  }
  pthread_mutex_lock(&f->lock);
  const cached_trace *c = trace_at(who, f, trace);
  char *text = c ? traced_fn_print(&((cached_trace *)c)->fn) : NULL; /* no passes yet: optimized = traced */
  pthread_mutex_unlock(&f->lock);
  if (c && !text) kiln_set_error("%s: out of memory", who);
  return text;
}

int kiln_function_stats(kiln_function *f, int trace, kiln_stats *out) {
  const char *who = "function_stats";
  if (!f || !out) return kiln_set_error("%s: %s is NULL", who, f ? "out" : "function");
  pthread_mutex_lock(&f->lock);
  const cached_trace *c = trace_at(who, f, trace);
  if (c) {
    memset(out, 0, sizeof *out);
    out->traced_ops = out->optimized_ops = c->traced_ops;
    out->trace_ms = c->trace_ms;
  }
  pthread_mutex_unlock(&f->lock);
  return c ? 0 : -1;
}
