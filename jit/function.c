/* function.c — staged functions (API.md §5, §6): a trace cache keyed by the
 * inputs' dtypes, shapes and devices and the device scope. A miss traces the
 * body once with symbolic tensors (trace.c); every call then runs the
 * verified IR, runs the pass pipeline and compiles the result (compile.c);
 * every call then runs that code, with fresh random draws and the
 * variables' current values. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "autodiff.h"
#include "function.h"
#include "../passes/buffers.h"
#include "../lib/variable.h"

typedef struct {
  uint8_t dtype, device;
  int8_t rank;
  int64_t shape[KILN_MAX_RANK];
} arg_sig;

struct cached_trace {
  arg_sig *args; /* n_in of them */
  int device_scope;
  uint64_t hash; /* of args and device_scope */
  traced_fn fn;
  int traced_ops;
  double trace_ms;
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
  snapshot *s = atomic_load(&f->traces);
  for (int i = 0; s && i < s->n; i++) {
    traced_fn_free(&s->items[i]->fn);
    free(s->items[i]->args);
    free(s->items[i]);
  }
  while (s) {
    snapshot *older = s->older;
    free(s);
    s = older;
  }
  function_free_gradients(f);
  function_free_taped(f);
  pthread_mutex_destroy(&f->lock);
  free(f->name);
  free(f);
}

static int n_traces(const kiln_function *f) {
  snapshot *s = atomic_load_explicit(&((kiln_function *)f)->traces, memory_order_acquire);
  return s ? s->n : 0;
}

void kiln_function_set_eager(kiln_function *f, bool eager) {
  if (f) atomic_store(&f->eager, eager);
}

int kiln_function_trace_count(const kiln_function *f) {
  if (!f) return kiln_set_error("function_trace_count: function is NULL");
  return n_traces(f);
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

static uint64_t sig_hash(int n, const arg_sig *args, int device_scope) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ (uint64_t)device_scope;
#define MIX(x) (h = (h ^ (uint64_t)(x)) * 0x100000001b3ull, h ^= h >> 29)
  for (int i = 0; i < n; i++) {
    MIX(args[i].dtype | args[i].device << 8 | (uint64_t)(uint8_t)args[i].rank << 16);
    for (int d = 0; d < args[i].rank; d++) MIX(args[i].shape[d]);
  }
#undef MIX
  return h;
}

/* Lock-free: compares hashes, then the signatures of equal hashes. */
static cached_trace *lookup(kiln_function *f, const arg_sig *args, int device_scope, uint64_t h) {
  snapshot *s = atomic_load_explicit(&f->traces, memory_order_acquire);
  for (int t = 0; s && t < s->n; t++) {
    cached_trace *c = s->items[t];
    if (c->hash != h || c->device_scope != device_scope) continue;
    bool hit = true;
    for (int i = 0; hit && i < f->n_in; i++) hit = sig_eq(&c->args[i], &args[i]);
    if (hit) return c;
  }
  return NULL;
}

/* caller holds f->lock */
static int publish(kiln_function *f, cached_trace *c) {
  snapshot *old = atomic_load(&f->traces);
  int n = old ? old->n : 0;
  snapshot *s = malloc(sizeof *s + (size_t)(n + 1) * sizeof *s->items);
  if (!s) return kiln_set_error("function_call: out of memory");
  s->older = old;
  s->n = n + 1;
  if (n) memcpy(s->items, old->items, (size_t)n * sizeof *s->items);
  s->items[n] = c;
  atomic_store_explicit(&f->traces, s, memory_order_release);
  return 0;
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

/* KILN_CHECK_ROUNDTRIP=1 (the test suite sets it): every trace's text must
 * parse back to the same text, so a trace that cannot be replayed from its
 * dump fails loudly where it was made. */
static bool check_roundtrip(void) {
  const char *env = getenv("KILN_CHECK_ROUNDTRIP");
  return env && *env == '1';
}

static int roundtrip(const kiln_function *f, traced_fn *fn) {
  char *text = ir_print_module(fn->module), *again = NULL;
  ir_module *m = text ? ir_parse(text, f->name) : NULL;
  if (m) again = ir_print_module(m);
  int rc = 0;
  if (!again || strcmp(text, again))
    rc = kiln_set_error("function_call: @%s: the traced IR does not round-trip through its text (%s)", f->name,
                        m ? "different text" : kiln_last_error());
  free(text);
  free(again);
  ir_module_free(m);
  return rc;
}

/* Traces f's body on in's signature; a cache entry, or NULL with the error
 * set (the body's own message when it failed). */
static cached_trace *trace_body(kiln_function *f, kiln_tensor *const *in, const arg_sig *args,
                                int device_scope, uint64_t hash) {
  cached_trace *c = calloc(1, sizeof *c);
  kiln_tensor **sym_in = calloc((size_t)f->n_in + 1, sizeof *sym_in);
  kiln_tensor **outs = calloc((size_t)f->n_out + 1, sizeof *outs);
  if (!c || !sym_in || !outs || !(c->args = malloc((size_t)(f->n_in + 1) * sizeof *c->args))) {
    kiln_set_error("function_call: out of memory");
    goto fail;
  }
  memcpy(c->args, args, (size_t)f->n_in * sizeof *args);
  c->device_scope = device_scope;
  c->hash = hash;
  double t0 = now_ms();
  tape_state saved = tape_pause(); /* a trace records nothing on tapes */
  kiln_scope_push();                /* the symbolic tensors die with it */
  int rc = -1;
  trace *tr = trace_begin(f->n_in, in, sym_in);
  if (tr) {
    trace_set_owner(tr, f);
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
  if (!rc && check_roundtrip() && roundtrip(f, &c->fn)) {
    traced_fn_free(&c->fn);
    rc = -1;
  }
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

/* A variable of a trace, in the order calls lock them. */
typedef struct {
  uint64_t id;
  int var;      /* index into fn->vars */
  bool written; /* the call writes it: its lock is held to the end of the call */
} var_ref;

static int by_id(const void *a, const void *b) {
  uint64_t x = ((const var_ref *)a)->id, y = ((const var_ref *)b)->id;
  return (x > y) - (x < y);
}

/* Takes fn's variables' values into vals. Every variable is locked in
 * increasing id, so no two calls wait for each other (a call that reads u
 * and writes v runs beside one that reads v and writes u); the locks of
 * the variables fn writes stay held (see unlock_writes). */
static void acquire_vars(const traced_fn *fn, var_ref *order, kiln_tensor **vals) {
  for (int i = 0; i < fn->n_vars; i++) order[i] = (var_ref){variable_id(fn->vars[i]), i, false};
  for (int w = 0; w < fn->n_writes; w++) order[fn->writes[w]].written = true;
  if (fn->n_vars > 1) qsort(order, (size_t)fn->n_vars, sizeof *order, by_id);
  for (int k = 0; k < fn->n_vars; k++) {
    kiln_variable *v = fn->vars[order[k].var];
    variable_lock(v);
    vals[order[k].var] = kiln_retain(variable_value_locked(v));
    if (!order[k].written) variable_unlock(v);
  }
}

static void unlock_writes(const traced_fn *fn, const var_ref *order) {
  for (int k = fn->n_vars; k-- > 0;)
    if (order[k].written) variable_unlock(fn->vars[order[k].var]);
}

/* Runs a trace: explicit inputs, captures, variables' current values; the
 * IR's random instructions draw fresh blocks of the global stream, in
 * program order, as the eager body would. Variable writes land after.
 * The variables the call writes stay locked from the read of their values
 * to the write of the results (API.md §8): concurrent calls lose no update. */
static int run_trace(const cached_trace *c, int n_in, kiln_tensor *const *in, kiln_tensor **out) {
  const traced_fn *fn = &c->fn;
  int np = fn->func->n_params, nr = fn->func->n_results, rc;
  kiln_tensor *small[16], **args = np + nr <= 16 ? small : malloc((size_t)(np + nr) * sizeof *args);
  var_ref small_o[8], *order = fn->n_vars <= 8 ? small_o : malloc((size_t)fn->n_vars * sizeof *order);
  if (!args || !order) {
    if (args != small) free(args);
    if (order != small_o) free(order);
    return kiln_set_error("function_call: out of memory");
  }
  kiln_tensor **res = args + np;
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int i = 0; i < fn->n_caps; i++) args[n_in + i] = fn->caps[i];
  acquire_vars(fn, order, args + n_in + fn->n_caps);
  /* A variable assigned here whose value nothing else holds (the variable
   * and args[] are its only references, and it is no view) gives its
   * buffer up: the new value may be written over the old in place, as
   * XLA does with donated buffers. Race-free: the variable is locked, and
   * a new reference to its value is only ever taken under its lock. */
  bool small_d[16], *donate = NULL;
  if (fn->n_writes && fn->cpu) {
    donate = np <= 16 ? small_d : calloc((size_t)np, sizeof *donate);
    if (donate) memset(donate, 0, (size_t)np * sizeof *donate);
    for (int w = 0; donate && w < fn->n_writes; w++) {
      const kiln_tensor *t = args[n_in + fn->n_caps + fn->writes[w]];
      donate[n_in + fn->n_caps + fn->writes[w]] = atomic_load(&t->refs) == 2 && !t->base;
    }
  }
  kiln_scope_push(); /* the results, until they are handed out */
  rc = jit_exec_donating(fn, args, res, donate);
  if (donate != small_d) free(donate);
  int n_out = nr - fn->n_writes;
  if (!rc) {
    for (int w = 0; w < fn->n_writes; w++)
      variable_set_value_locked(fn->vars[fn->writes[w]], kiln_retain(res[n_out + w]));
    for (int k = 0; k < n_out; k++) kiln_retain(res[k]);
  }
  unlock_writes(fn, order);
  kiln_scope_pop();
  if (!rc)
    for (int k = 0; k < n_out; k++) out[k] = scope_own(res[k]);
  for (int i = 0; i < fn->n_vars; i++) kiln_release(args[n_in + fn->n_caps + i]);
  if (args != small) free(args);
  if (order != small_o) free(order);
  return rc;
}

/* The body run op by op on in: eagerly, or inlined into the trace that is
 * recording (kiln_function_set_eager, or a tape watches an input). */
int function_run_body(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  const char *who = "function_call";
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

/* KILN_DUMP: the module after each pass */
typedef struct {
  const char *name;
  int trace;
  bool failed;
  traced_fn *fn;
} dump_ctx;

static void dump_step(void *ctx, int step, const char *pass, const ir_func *g) {
  (void)g; /* the whole optimized module is printed */
  dump_ctx *d = ctx;
  if (d->failed || !getenv("KILN_DUMP")) return;
  char *text = traced_fn_print_optimized(d->fn);
  d->failed = jit_dump(d->name, d->trace, step, pass, text) != 0;
  free(text);
}

/* The optimized copy of a new trace: the default pipeline over every
 * function of a copy of the traced module (callees first, as printed). */
static int optimize(kiln_function *f, traced_fn *fn, int trace_no) {
  dump_ctx d = {f->name, trace_no, trace_no < 0, fn}; /* trace_no < 0: no dump */
  if (!d.failed && getenv("KILN_DUMP")) {
    char *text = traced_fn_print(fn);
    d.failed = jit_dump(f->name, trace_no, 0, "traced", text) != 0;
    free(text);
  }
  double t0 = now_ms();
  if (!(fn->opt_module = ir_module_clone(fn->module))) return -1;
  fn->opt_func = ir_module_find(fn->opt_module, fn->func->name);
  pass_report rep;
  int rc = 0;
  for (int i = 0; i < fn->opt_module->n_funcs && !rc; i++) {
    ir_func *g = fn->opt_module->funcs[i];
    rc = pass_run_pipeline(g, PASS_DEFAULT_PIPELINE, &rep, g == fn->opt_func ? dump_step : NULL, &d);
  }
  fn->optimize_ms = now_ms() - t0;
  if (rc) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kiln_last_error());
    return kiln_set_error("function_call: @%s: optimizing: %s", f->name, msg);
  }
  if (!d.failed && getenv("KILN_DUMP")) {
    char *text = traced_fn_print_optimized(fn);
    jit_dump(f->name, trace_no, rep.n + 1, "optimized", text);
    free(text);
  }
  return jit_compile(fn, f->name, d.failed ? -1 : trace_no, rep.n + 2);
}

/* The cache entry for in's signature, traced on a miss. */
static cached_trace *get_trace(kiln_function *f, kiln_tensor *const *in) {
  const char *who = "function_call";
  arg_sig small[8], *args = f->n_in > 8 ? malloc((size_t)f->n_in * sizeof *args) : small;
  if (!args) {
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  for (int i = 0; i < f->n_in; i++) sig_of(in[i], &args[i]);
  int device_scope = device_current();
  uint64_t h = sig_hash(f->n_in, args, device_scope);
  cached_trace *c = lookup(f, args, device_scope, h);
  if (!c) {
    if (trace_owned_by(f)) {
      kiln_set_error("%s: @%s calls itself while being traced (recursion cannot be staged)", who, f->name);
      goto done;
    }
    pthread_mutex_lock(&f->lock);
    if (!(c = lookup(f, args, device_scope, h)) && (c = trace_body(f, in, args, device_scope, h))) {
      if (optimize(f, &c->fn, n_traces(f)) || publish(f, c)) {
        traced_fn_free(&c->fn);
        free(c->args);
        free(c);
        c = NULL;
      } else {
        snapshot *s = atomic_load(&f->traces);
        if (s->n > 1 && log_retrace()) report_retrace(f, s->items[s->n - 2], c);
      }
    }
    pthread_mutex_unlock(&f->lock);
  }
done:
  if (args != small) free(args);
  return c;
}

int function_run_staged(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  cached_trace *c = get_trace(f, in);
  return c ? run_trace(c, f->n_in, in, out) : -1;
}

/* ---- calls a tape watches ----
 * A taped trace is two kinds of trace of the body, made together: the
 * forward, which returns the outputs and then the residuals (the values the
 * backward needs), and per float output k a backward trace (dy, residuals)
 * -> d(sum(y_k * dy))/d(inputs), recorded by running the tape's gradient
 * over the forward's symbolic values while the backward trace records. */
struct taped_trace {
  struct taped_trace *next;
  arg_sig *args;
  int device_scope;
  uint64_t hash;
  traced_fn fwd;
  traced_fn *bwd;  /* per output; func NULL for outputs without gradients */
  int **res_idx;   /* per output: its residual parameters, as indices of fwd's residual results */
  taped_slot *slots;
};

static bool float_dtype(const kiln_tensor *t) { return t->dtype == KILN_F32 || t->dtype == KILN_F64; }

static void taped_free(kiln_function *f, taped_trace *t) {
  if (!t) return;
  traced_fn_free(&t->fwd);
  for (int k = 0; t->bwd && k < f->n_out; k++) traced_fn_free(&t->bwd[k]);
  for (int k = 0; t->res_idx && k < f->n_out; k++) free(t->res_idx[k]);
  free(t->bwd);
  free(t->res_idx);
  free(t->slots);
  free(t->args);
  free(t);
}

void function_free_taped(kiln_function *f) {
  for (taped_trace *t = atomic_load(&f->taped), *next; t; t = next) {
    next = t->next;
    taped_free(f, t);
  }
}

/* Traces the forward and backward traces of a taped call; NULL with the
 * error set. Caller holds f->lock. */
static taped_trace *trace_taped(kiln_function *f, kiln_tensor *const *in, const arg_sig *args, int device_scope,
                                uint64_t hash) {
  const char *who = "function_call";
  int n_in = f->n_in, n_out = f->n_out;
  taped_trace *t = calloc(1, sizeof *t);
  kiln_tensor **sym_in = calloc((size_t)n_in + 1, sizeof *sym_in), **outs = calloc((size_t)n_out + 1, sizeof *outs);
  kiln_tensor **grads = calloc((size_t)n_in + 1, sizeof *grads);
  int *extras = NULL, n_extras = 0, rc = -1;
  if (t) {
    t->args = malloc(((size_t)n_in + 1) * sizeof *t->args);
    t->bwd = calloc((size_t)n_out + 1, sizeof *t->bwd);
    t->res_idx = calloc((size_t)n_out + 1, sizeof *t->res_idx);
    t->slots = calloc((size_t)n_out + 1, sizeof *t->slots);
  }
  if (!t || !sym_in || !outs || !grads || !t->args || !t->bwd || !t->res_idx || !t->slots) {
    kiln_set_error("%s: out of memory", who);
    free(sym_in), free(outs), free(grads);
    taped_free(f, t);
    return NULL;
  }
  memcpy(t->args, args, (size_t)n_in * sizeof *args);
  t->device_scope = device_scope;
  t->hash = hash;
  tape_state saved = tape_pause();
  kiln_scope_push();
  kiln_tape *tape = NULL;
  trace *fwd = trace_begin(n_in, in, sym_in);
  if (fwd) {
    trace_set_owner(fwd, f);
    tape = kiln_tape_begin(true);
    for (int i = 0; i < n_in; i++)
      if (float_dtype(sym_in[i])) kiln_tape_watch(tape, sym_in[i]);
    rc = f->body(f->user, n_in, sym_in, n_out, outs);
    kiln_tape_end(tape);
    trace_end(fwd);
    if (rc && !kiln_has_error()) kiln_set_error("%s: @%s: the body failed without an error", who, f->name);
    for (int k = 0; k < n_out && !rc; k++)
      if (!outs[k]) rc = kiln_set_error("%s: @%s: the body left output %d NULL", who, f->name, k);
  }
  for (int k = 0; k < n_out && !rc; k++) {
    t->slots[k] = (taped_slot){f, t, k};
    if (!float_dtype(outs[k])) continue;
    kiln_tensor *dy = NULL;
    trace *bwd = trace_begin(1, &outs[k], &dy);
    if (!bwd) {
      rc = -1;
      break;
    }
    trace_set_forward(bwd, fwd);
    trace_set_owner(bwd, f);
    rc = tape_gradient_seeded(tape, outs[k], dy, n_in, sym_in, grads);
    for (int i = 0; i < n_in && !rc; i++)
      if (!grads[i] && !(grads[i] = kiln_zeros((kiln_dtype)in[i]->dtype, in[i]->rank, in[i]->shape))) rc = -1;
    trace_end(bwd);
    const int *nodes;
    int nr = trace_residuals(bwd, &nodes);
    if (!rc && !(t->res_idx[k] = malloc(((size_t)nr + 1) * sizeof **t->res_idx))) rc = kiln_set_error("%s: out of memory", who);
    for (int j = 0; j < nr && !rc; j++) { /* the union of every backward's residuals */
      int e = 0;
      while (e < n_extras && extras[e] != nodes[j]) e++;
      if (e == n_extras) {
        int *q = realloc(extras, ((size_t)n_extras + 1) * sizeof *q);
        if (!q) {
          rc = kiln_set_error("%s: out of memory", who);
          break;
        }
        extras = q;
        extras[n_extras++] = nodes[j];
      }
      t->res_idx[k][j] = e;
    }
    char name[160];
    snprintf(name, sizeof name, "%s.grad%d", f->name, k);
    if (rc)
      trace_free(bwd);
    else
      rc = trace_finish(bwd, name, n_in, grads, &t->bwd[k]);
    if (!rc && (t->bwd[k].n_vars || t->bwd[k].n_writes))
      rc = kiln_set_error("%s: @%s: its gradient reads variables; gradients through a staged call reach its "
                          "explicit inputs only (pass the variable's value as an input)", who, f->name);
  }
  if (tape) kiln_tape_free(tape);
  if (fwd) {
    if (rc)
      trace_free(fwd);
    else
      rc = trace_finish_ex(fwd, f->name, n_out, outs, n_extras, extras, &t->fwd);
  }
  kiln_scope_pop();
  tape_resume(saved);
  if (!rc && (t->fwd.n_vars || t->fwd.n_writes))
    rc = kiln_set_error("%s: @%s: reads or assigns variables while a gradient tape watches its inputs; "
                        "gradients through staged calls reach their explicit inputs only (pass the "
                        "variable's value as an input, or kiln_function_set_eager)", who, f->name);
  if (!rc) rc = optimize(f, &t->fwd, -1);
  for (int k = 0; k < n_out && !rc; k++)
    if (t->bwd[k].func) rc = optimize(f, &t->bwd[k], -1);
  free(extras);
  free(sym_in);
  free(outs);
  free(grads);
  if (rc) {
    taped_free(f, t);
    return NULL;
  }
  return t;
}

static taped_trace *get_taped(kiln_function *f, kiln_tensor *const *in) {
  arg_sig small[8], *args = f->n_in > 8 ? malloc((size_t)f->n_in * sizeof *args) : small;
  if (!args) {
    kiln_set_error("function_call: out of memory");
    return NULL;
  }
  for (int i = 0; i < f->n_in; i++) sig_of(in[i], &args[i]);
  int dev = device_current();
  uint64_t h = sig_hash(f->n_in, args, dev);
  taped_trace *t = NULL;
  for (int pass = 0; pass < 2 && !t; pass++) {
    if (pass) pthread_mutex_lock(&f->lock);
    for (t = atomic_load(&f->taped); t; t = t->next) {
      bool hit = t->hash == h && t->device_scope == dev;
      for (int i = 0; hit && i < f->n_in; i++) hit = sig_eq(&t->args[i], &args[i]);
      if (hit) break;
    }
    if (pass && !t && (t = trace_taped(f, in, args, dev, h))) {
      t->next = atomic_load(&f->taped);
      atomic_store(&f->taped, t);
    }
    if (pass) pthread_mutex_unlock(&f->lock);
  }
  if (args != small) free(args);
  return t;
}

static _Thread_local kiln_tensor *pending_y;

static kiln_tensor *forward_done(void *user, int n, kiln_tensor *const *xs) {
  (void)user, (void)n, (void)xs;
  return pending_y;
}

/* The backward of output k: the staged backward trace with the residuals
 * the forward saved; where a tape records the gradient itself (higher
 * order), the differentiable staged VJP (grad.c) instead. */
static int backward(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy, kiln_tensor **dxs) {
  (void)y;
  taped_slot *s = user;
  kiln_function *f = s->f;
  int n_in = f->n_in;
  for (int i = n_in; i < n; i++) dxs[i] = NULL; /* residuals: no gradient */
  if (tape_active_count) return grad_recompute_vjp(f, s->k, xs, dy, dxs);
  const traced_fn *b = &s->t->bwd[s->k];
  int np = b->opt_func->n_params;
  kiln_tensor *small[16], **args = np <= 16 ? small : malloc((size_t)np * sizeof *args);
  if (!args) return kiln_set_error("function_call: out of memory");
  args[0] = dy;
  for (int i = 0; i < b->n_caps; i++) args[1 + i] = b->caps[i];
  for (int j = 0; j < b->n_residuals; j++) args[1 + b->n_caps + j] = xs[n_in + j];
  int rc = jit_exec(b, args, dxs);
  for (int i = 0; i < n_in && !rc; i++)
    if (!float_dtype(xs[i])) dxs[i] = NULL;
  if (args != small) free(args);
  return rc;
}

int function_call_taped(kiln_function *f, kiln_tensor *const *in, kiln_tensor **out) {
  taped_trace *t = get_taped(f, in);
  if (!t) return -1;
  const traced_fn *fw = &t->fwd;
  int np = fw->opt_func->n_params, nr = fw->opt_func->n_results, n_in = f->n_in, rc;
  kiln_tensor **args = malloc(((size_t)np + nr + n_in + nr + 1) * sizeof *args);
  if (!args) return kiln_set_error("function_call: out of memory");
  kiln_tensor **res = args + np, **xs = res + nr;
  for (int i = 0; i < n_in; i++) args[i] = in[i];
  for (int i = 0; i < fw->n_caps; i++) args[n_in + i] = fw->caps[i];
  tape_state saved = tape_pause();
  rc = jit_exec(fw, args, res);
  tape_resume(saved);
  kiln_tensor **extras = res + f->n_out;
  for (int k = 0; k < f->n_out && !rc; k++) {
    if (!t->bwd[k].func) {
      out[k] = res[k];
      continue;
    }
    for (int i = 0; i < n_in; i++) xs[i] = in[i];
    for (int j = 0; j < t->bwd[k].n_residuals; j++) xs[n_in + j] = extras[t->res_idx[k][j]];
    pending_y = res[k];
    out[k] = kiln_custom_gradient(forward_done, backward, &t->slots[k], n_in + t->bwd[k].n_residuals, xs);
    pending_y = NULL;
    if (!out[k]) rc = -1;
  }
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
  bool taped = false;
  if (KILN_UNLIKELY(tape_active_count))
    for (int i = 0; i < f->n_in && !taped; i++) taped = tape_tracks(in[i]);
  if (atomic_load(&f->eager)) return function_run_body(f, in, out);
  if (trace_current) {
    /* inside another body: a call instruction; inlined where a tape of that
     * body watches an input, so that the tape sees the ops */
    if (taped || KILN_UNLIKELY(tape_active_count)) return function_run_body(f, in, out);
    cached_trace *c = get_trace(f, in);
    return c ? trace_call(&c->fn, f->n_in, in, out) : -1;
  }
  if (KILN_UNLIKELY(taped)) return function_call_taped(f, in, out);
  cached_trace *c = get_trace(f, in);
  if (!c) return -1;
  if (KILN_UNLIKELY(tape_active_count))
    for (int i = 0; i < c->fn.n_vars; i++) {
      const kiln_tensor *v = variable_type(c->fn.vars[i]);
      if (v->dtype == KILN_F32 || v->dtype == KILN_F64)
        return kiln_set_error("%s: @%s: reads variable '%s' while a gradient tape is active; gradients "
                              "through staged functions reach their explicit inputs only (pass the "
                              "variable's value as an input, or kiln_function_set_eager)", who, f->name,
                              kiln_variable_name(c->fn.vars[i]));
    }
  return run_trace(c, f->n_in, in, out);
}

/* caller holds the lock */
static const cached_trace *trace_at(const char *who, kiln_function *f, int trace) {
  snapshot *s = atomic_load(&f->traces);
  int n = s ? s->n : 0;
  if (trace < 0 || trace >= n) {
    kiln_set_error("%s: @%s: trace %d does not exist (%d made so far)", who, f->name, trace, n);
    return NULL;
  }
  return s->items[trace];
}

char *kiln_function_ir(kiln_function *f, int trace, const char *stage) {
  const char *who = "function_ir";
  if (!f || !stage) {
    kiln_set_error("%s: %s is NULL", who, f ? "stage" : "function");
    return NULL;
  }
  bool ir = !strcmp(stage, "traced") || !strcmp(stage, "optimized");
  if (!ir && strcmp(stage, "llvm") && strcmp(stage, "asm") && strcmp(stage, "ptx")) {
    kiln_set_error("%s: unknown stage '%s' (traced, optimized, llvm, asm, ptx)", who, stage);
    return NULL;
  }
  pthread_mutex_lock(&f->lock);
  cached_trace *c = (cached_trace *)trace_at(who, f, trace);
  char *text = !c                         ? NULL
               : !strcmp(stage, "traced") ? traced_fn_print(&c->fn)
               : ir                       ? traced_fn_print_optimized(&c->fn)
                                          : jit_stage_text(&c->fn, f->name, stage);
  pthread_mutex_unlock(&f->lock);
  if (c && ir && !text) kiln_set_error("%s: out of memory", who);
  return text;
}

int kiln_function_stats(kiln_function *f, int trace, kiln_stats *out) {
  const char *who = "function_stats";
  if (!f || !out) return kiln_set_error("%s: %s is NULL", who, f ? "out" : "function");
  pthread_mutex_lock(&f->lock);
  const cached_trace *c = trace_at(who, f, trace);
  if (c) {
    memset(out, 0, sizeof *out);
    out->traced_ops = c->traced_ops;
    out->optimized_ops = c->fn.opt_func->n_instrs;
    for (int i = 0; i < c->fn.opt_func->n_instrs; i++) { /* a kernel: each fusion and each unfused op */
      const ir_instr *in = &c->fn.opt_func->instrs[i];
      if (in->op == OP_CONSTANT) continue;
      out->kernels++;
      if (in->op == OP_FUSION) out->fused_ops += in->attrs.callee->n_instrs;
    }
    pass_buffer_stats bs;
    if (pass_buffer_stats_of(c->fn.opt_func, &bs) == 0) {
      out->kernels = bs.kernels;
      out->peak_bytes = (size_t)bs.peak_bytes;
      out->unshared_bytes = (size_t)bs.unshared_bytes;
    } else {
      kiln_clear_error();
    }
    out->trace_ms = c->trace_ms;
    out->optimize_ms = c->fn.optimize_ms;
    out->compile_ms = c->fn.compile_ms;
  }
  pthread_mutex_unlock(&f->lock);
  return c ? 0 : -1;
}

const ir_func *jit_optimized_func(kiln_function *f, int trace) {
  if (!f) return NULL;
  const cached_trace *c = trace_at("function_stats", f, trace);
  return c ? c->fn.opt_func : NULL;
}
