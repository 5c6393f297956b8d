/* host.c — kiln_host_call, the escape hatch into C from staged code (TF's
 * py_func): eagerly it runs the callback and checks its outputs; while
 * tracing it records a host_call instruction that does so at each call.
 * Under a tape each float output is one tape node: with
 * kiln_host_call_with_gradient its rule calls the user's gradient callback
 * as another host call (so staged backward passes stage it too); without
 * one, a gradient that needs the node fails with an error naming fn. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "autodiff.h"
#include "jit.h"

static int spec_type(const kiln_spec *s, int k, op_type *t) {
  if (!dtype_valid(s->dtype)) return kiln_set_error("host_call: out_specs[%d] has invalid dtype %d", k, (int)s->dtype);
  if (s->rank < 0 || s->rank > KILN_MAX_RANK)
    return kiln_set_error("host_call: out_specs[%d] has rank %d (0 to %d)", k, s->rank, KILN_MAX_RANK);
  t->dtype = s->dtype;
  t->rank = s->rank;
  for (int d = 0; d < s->rank; d++) t->shape[d] = s->shape[d];
  int64_t size;
  return shape_check("host_call", t->rank, t->shape, &size);
}

/* outputs against specs, as the host_call instruction checks them */
static int check_outputs(int n_out, const op_type *types, kiln_tensor **o) {
  for (int k = 0; k < n_out; k++) {
    const kiln_tensor *t = o[k];
    bool ok = t && !(t->flags & TF_SYMBOLIC) && t->dtype == types[k].dtype && t->rank == types[k].rank;
    for (int d = 0; ok && d < t->rank; d++) ok = t->shape[d] == types[k].shape[d];
    if (ok) continue;
    char w[256], g[256] = "NULL";
    ir_type_str(w, sizeof w, &types[k]);
    if (t) {
      op_type ty = {(kiln_dtype)t->dtype, t->rank, {0}};
      for (int d = 0; d < t->rank; d++) ty.shape[d] = t->shape[d];
      ir_type_str(g, sizeof g, &ty);
    }
    return kiln_set_error("host_call: the callback returned %s for output %d, the spec says %s", g, k, w);
  }
  return 0;
}

/* ---- gradients ---- */

/* A (grad, user) pair that staged code may call: the user pointer of the
 * gradient's host call (host_grad_run), which must live as long as any
 * compiled function holding it, so pairs are interned for the process
 * (one small entry per distinct pair, not per call). */
typedef struct grad_entry {
  struct grad_entry *next;
  kiln_host_grad_fn grad;
  void *user;
} grad_entry;

static grad_entry *grad_entries;
static pthread_mutex_t grad_lock = PTHREAD_MUTEX_INITIALIZER;

static grad_entry *grad_intern(kiln_host_grad_fn grad, void *user) {
  pthread_mutex_lock(&grad_lock);
  grad_entry *e = grad_entries;
  while (e && (e->grad != grad || e->user != user)) e = e->next;
  if (!e && (e = malloc(sizeof *e))) {
    *e = (grad_entry){grad_entries, grad, user};
    grad_entries = e;
  }
  pthread_mutex_unlock(&grad_lock);
  if (!e) kiln_set_error("host_call: out of memory");
  return e;
}

/* The host callback of a gradient: in = (x[0..n_x), y[0..n_y), dy[0..n_y))
 * with n_x = n_out, out = dx; a NULL dx becomes zeros. */
static int host_grad_run(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  const grad_entry *e = user;
  int n_x = n_out, n_y = (n_in - n_out) / 2;
  for (int i = 0; i < n_x; i++) out[i] = NULL;
  if (e->grad(e->user, n_x, in, n_y, in + n_x, in + n_x + n_y, out)) return -1;
  for (int i = 0; i < n_x; i++)
    if (!out[i] && !(out[i] = kiln_zeros((kiln_dtype)in[i]->dtype, in[i]->rank, in[i]->shape))) return -1;
  return 0;
}

/* "@symbol" of a callback where the process has its name, else its address */
static const char *callback_name(kiln_host_fn fn, void *user, char *buf, size_t n) {
  void *p;
  const char *what = "";
  if (fn == host_grad_run) { /* a gradient: name the user's gradient callback */
    kiln_host_grad_fn g = ((const grad_entry *)user)->grad;
    memcpy(&p, &g, sizeof p);
    what = "the gradient callback ";
  } else {
    memcpy(&p, &fn, sizeof p);
  }
  Dl_info info;
  if (dladdr(p, &info) && info.dli_sname && info.dli_saddr == p)
    snprintf(buf, n, "%s@%s", what, info.dli_sname);
  else
    snprintf(buf, n, "%s%p (no symbol name)", what, p);
  return buf;
}

/* What the tape nodes of one host call share: the call and its outputs
 * (retained), referenced by each node. */
typedef struct {
  int refs; /* atomic: tapes of one thread only, but cheap */
  kiln_host_fn fn;
  void *user;
  grad_entry *grad; /* NULL: no gradient */
  int n_out;
  kiln_tensor *out[];
} host_node;

static void node_retain(void *p) { __atomic_add_fetch(&((host_node *)p)->refs, 1, __ATOMIC_RELAXED); }
static void node_release(void *p) {
  host_node *h = p;
  if (__atomic_sub_fetch(&h->refs, 1, __ATOMIC_ACQ_REL)) return;
  for (int k = 0; k < h->n_out; k++) kiln_release(h->out[k]);
  free(h);
}
static const tape_closure node_closure = {node_retain, node_release, "host_call"};

static void spec_of(const kiln_tensor *t, kiln_spec *s) {
  s->dtype = (kiln_dtype)t->dtype;
  s->rank = t->rank;
  for (int d = 0; d < t->rank; d++) s->shape[d] = t->shape[d];
}

static int no_gradient(kiln_host_fn fn, void *user) {
  char name[300];
  return kiln_set_error("tape_gradient: host_call %s has no gradient (give it one with "
                        "kiln_host_call_with_gradient, or kiln_stop_gradient its inputs)",
                        callback_name(fn, user, name, sizeof name));
}

/* The gradient of a host call without one, in staged code: user is fn (or,
 * for a gradient's own host call, its grad_entry). */
static int fail_no_gradient(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)in, (void)n_out, (void)out;
  kiln_host_fn fn;
  memcpy(&fn, &user, sizeof fn);
  return no_gradient(fn, NULL);
}
static int fail_no_gradient_of_gradient(void *user, int n_in, kiln_tensor *const *in, int n_out,
                                        kiln_tensor **out) {
  (void)n_in, (void)in, (void)n_out, (void)out;
  return no_gradient(host_grad_run, user);
}

/* The rule of output y: dx = grad(x, outputs, cotangents), the cotangent of
 * y being dy and the others' zeros, through a host call of host_grad_run. */
static int node_gradient(void *user, int n, kiln_tensor *const *xs, kiln_tensor *y, kiln_tensor *dy,
                         kiln_tensor **dxs) {
  host_node *h = user;
  if (!h->grad && !trace_current) return no_gradient(h->fn, h->user);
  int n_in = n + 2 * h->n_out, rc = 0;
  kiln_tensor **in = calloc((size_t)n_in, sizeof *in);
  kiln_spec *specs = calloc((size_t)(n ? n : 1), sizeof *specs);
  if (!in || !specs) rc = kiln_set_error("tape_gradient: out of memory");
  for (int i = 0; i < n && !rc; i++) in[i] = xs[i], spec_of(xs[i], &specs[i]);
  for (int k = 0; k < h->n_out && !rc; k++) {
    kiln_tensor *o = h->out[k];
    in[n + k] = o;
    in[n + h->n_out + k] = o == y ? dy : kiln_zeros((kiln_dtype)o->dtype, o->rank, o->shape);
    if (!in[n + h->n_out + k]) rc = -1;
  }
  if (!rc && h->grad) {
    rc = kiln_host_call(host_grad_run, h->grad, n_in, in, n, specs, dxs);
  } else if (!rc) { /* staged: fails when run, as a backward pass is traced before it is known to be needed */
    void *fn_ptr;
    memcpy(&fn_ptr, &h->fn, sizeof fn_ptr);
    rc = h->fn == host_grad_run ? kiln_host_call(fail_no_gradient_of_gradient, h->user, n, xs, n, specs, dxs)
                                : kiln_host_call(fail_no_gradient, fn_ptr, n, xs, n, specs, dxs);
  }
  free(in);
  free(specs);
  return rc;
}

/* One tape node per float output of fn(in) = out, where a tape tracks an input. */
static int record_on_tapes(kiln_host_fn fn, void *user, grad_entry *grad, int n_in, kiln_tensor *const *in,
                           int n_out, kiln_tensor **out) {
  bool tracked = false;
  for (int i = 0; i < n_in && !tracked; i++) tracked = tape_tracks(in[i]);
  if (!tracked) return 0;
  host_node *h = malloc(sizeof *h + (size_t)n_out * sizeof h->out[0]);
  if (!h) return kiln_set_error("host_call: out of memory");
  *h = (host_node){1, fn, user, grad, n_out};
  for (int k = 0; k < n_out; k++) h->out[k] = kiln_retain(out[k]);
  int rc = 0;
  for (int k = 0; k < n_out && !rc; k++) rc = tape_record_custom(n_in, in, out[k], node_gradient, h, &node_closure);
  node_release(h);
  return rc;
}

/* Runs fn eagerly with the tapes paused (its ops are not the gradient),
 * each output a tensor of its own: one a tape tracks already (an input
 * handed back) gets a fresh view, so that its node is the call's. */
static int run_eager(kiln_host_fn fn, void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **o) {
  tape_state saved = tape_pause();
  int rc = 0;
  if (fn(user, n_in, in, n_out, o) && !kiln_has_error())
    rc = kiln_set_error("host_call: the callback failed without an error");
  else if (kiln_has_error())
    rc = -1;
  tape_resume(saved);
  for (int k = 0; k < n_out && !rc && saved.count; k++) {
    bool fresh = o[k] != NULL;
    for (int i = 0; fresh && i < n_in; i++) fresh = o[k] != in[i];
    for (int j = 0; fresh && j < k; j++) fresh = o[k] != o[j];
    if (fresh && tape_tracks(o[k])) fresh = false;
    if (o[k] && !fresh && !(o[k]->flags & TF_SYMBOLIC)) {
      tape_state s = tape_pause();
      o[k] = kiln_identity(o[k]);
      tape_resume(s);
      if (!o[k]) rc = -1;
    }
  }
  return rc;
}

static int host_call(kiln_host_fn fn, grad_entry *grad, void *user, int n_in, kiln_tensor *const *in, int n_out,
                     const kiln_spec *out_specs, kiln_tensor **out) {
  if (n_in < 0 || (n_in && !in)) return kiln_set_error("host_call: bad inputs (n_in = %d)", n_in);
  if (n_out < 1 || !out_specs || !out)
    return kiln_set_error("host_call: needs n_out >= 1 with out_specs and out (n_out = %d)", n_out);
  for (int i = 0; i < n_in; i++)
    if (!in[i]) return kiln_has_error() ? -1 : kiln_set_error("host_call: input %d is NULL", i);
  op_type small[4], *types = n_out <= 4 ? small : malloc((size_t)n_out * sizeof *types);
  if (!types) return kiln_set_error("host_call: out of memory");
  int rc = 0;
  for (int k = 0; k < n_out && !rc; k++) rc = spec_type(&out_specs[k], k, &types[k]);
  kiln_tensor **o = rc ? NULL : calloc((size_t)n_out, sizeof *o);
  if (!rc && !o) rc = kiln_set_error("host_call: out of memory");
  if (!rc && trace_current) {
    rc = trace_host_call(fn, user, n_in, in, n_out, types, o);
  } else if (!rc) {
    for (int i = 0; i < n_in && !rc; i++)
      if (in[i]->flags & TF_SYMBOLIC)
        rc = kiln_set_error("host_call: input %d is a symbolic tensor that escaped a staged function's body", i);
    if (!rc) rc = run_eager(fn, user, n_in, in, n_out, o);
    if (!rc) rc = check_outputs(n_out, types, o);
  }
  if (!rc && tape_active_count) rc = record_on_tapes(fn, user, grad, n_in, in, n_out, o);
  if (!rc) memcpy(out, o, (size_t)n_out * sizeof *o);
  free(o);
  if (types != small) free(types);
  return rc;
}

int kiln_host_call(kiln_host_fn fn, void *user, int n_in, kiln_tensor *const *in, int n_out,
                   const kiln_spec *out_specs, kiln_tensor **out) {
  if (!fn) return kiln_set_error("host_call: fn is NULL");
  return host_call(fn, NULL, user, n_in, in, n_out, out_specs, out);
}

int kiln_host_call_with_gradient(kiln_host_fn fn, kiln_host_grad_fn grad, void *user, int n_in,
                                 kiln_tensor *const *in, int n_out, const kiln_spec *out_specs, kiln_tensor **out) {
  if (!fn || !grad) return kiln_set_error("host_call: %s is NULL", fn ? "grad" : "fn");
  grad_entry *e = grad_intern(grad, user);
  if (!e) return -1;
  return host_call(fn, e, user, n_in, in, n_out, out_specs, out);
}
