/* grad.c — gradients and staged functions: kiln_gradients /
 * kiln_value_and_gradients derive a new stageable function whose body runs
 * f's body under a tape; and a call of a staged function whose input a tape
 * watches (function.c) records one tape node per float output whose
 * backward is a staged trace fed with the forward's residuals; where a tape
 * records that backward itself (higher-order gradients), the node uses the
 * staged vector-Jacobian product here instead, which recomputes the forward
 * inside its own trace and so stays differentiable. */
#include <stdlib.h>

#include "autodiff.h"
#include "function.h"

struct vjp_slot {
  kiln_function *f;
  int k;              /* the output this backward is for */
  kiln_function *vjp; /* (x_0 .. x_{n-1}, dy) -> (dx_0 .. dx_{n-1}) */
};

static bool is_float(const kiln_tensor *t) { return t->dtype == KILN_F32 || t->dtype == KILN_F64; }

/* The gradients of sum(ys[k] * dy) (or sum(ys[k]) with dy NULL) w.r.t. xs,
 * zeros where there is none; f's body runs inlined under a tape. */
static int grad_of_body(kiln_function *f, int k, kiln_tensor *const *xs, kiln_tensor *dy, kiln_tensor **ys,
                        kiln_tensor **grads) {
  int n = f->n_in;
  kiln_tape *tape = kiln_tape_begin(false);
  if (!tape) return -1;
  for (int i = 0; i < n; i++)
    if (is_float(xs[i])) kiln_tape_watch(tape, xs[i]);
  int rc = kiln_function_call(f, xs, ys); /* inlined: a tape watches its inputs */
  kiln_tensor *target = NULL;
  if (!rc && !is_float(ys[k]))
    rc = kiln_set_error("gradients: @%s: output %d is %s; gradients need a float output", f->name, k,
                        kiln_dtype_name((kiln_dtype)ys[k]->dtype));
  if (!rc && !(target = dy ? kiln_mul(ys[k], dy) : ys[k])) rc = -1; /* the gradient sums the target */
  kiln_tape_end(tape);
  if (!rc) rc = kiln_tape_gradient(tape, target, n, xs, grads);
  for (int i = 0; i < n && !rc; i++)
    if (!grads[i] && !(grads[i] = kiln_zeros((kiln_dtype)xs[i]->dtype, xs[i]->rank, xs[i]->shape))) rc = -1;
  kiln_tape_free(tape);
  return rc;
}

/* ---- kiln_gradients ---- */

typedef struct {
  kiln_function *f;
  bool value;
} grad_fn_user;

static int gradients_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  grad_fn_user *g = user;
  kiln_tensor **ys = calloc((size_t)g->f->n_out + 1, sizeof *ys);
  if (!ys) return kiln_set_error("gradients: out of memory");
  int rc = grad_of_body(g->f, 0, in, NULL, ys, out + g->value);
  if (!rc && g->value) out[0] = ys[0];
  (void)n_in;
  free(ys);
  return rc;
}

/* The derived function owns its grad_fn_user; it is freed with the
 * function through the list below. */
typedef struct derived {
  struct derived *next;
  kiln_function *fn;
  grad_fn_user *user;
} derived;

static derived *derived_list;
static pthread_mutex_t derived_lock = PTHREAD_MUTEX_INITIALIZER;

static kiln_function *derive(kiln_function *f, bool value) {
  const char *who = value ? "value_and_gradients" : "gradients";
  if (!f) {
    kiln_set_error("%s: function is NULL", who);
    return NULL;
  }
  if (f->n_out < 1) {
    kiln_set_error("%s: @%s has no outputs", who, f->name);
    return NULL;
  }
  grad_fn_user *u = malloc(sizeof *u);
  derived *d = malloc(sizeof *d);
  char name[256];
  snprintf(name, sizeof name, "%s_%s", value ? "value_and_grad" : "grad", f->name);
  kiln_function *g = u && d ? kiln_function_new(name, gradients_body, u, f->n_in, f->n_in + value) : NULL;
  if (!g) {
    free(u);
    free(d);
    if (!kiln_has_error()) kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  *u = (grad_fn_user){f, value};
  g->key_of = f->key_of; /* f's static arguments (kiln_jit) key g's traces too */
  *d = (derived){NULL, g, u};
  pthread_mutex_lock(&derived_lock);
  d->next = derived_list;
  derived_list = d;
  pthread_mutex_unlock(&derived_lock);
  return g;
}

kiln_function *kiln_gradients(kiln_function *f) { return derive(f, false); }
kiln_function *kiln_value_and_gradients(kiln_function *f) { return derive(f, true); }

/* ---- gradients through a staged call ---- */

static int vjp_body(void *user, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_in, (void)n_out;
  vjp_slot *s = user;
  kiln_tensor **ys = calloc((size_t)s->f->n_out + 1, sizeof *ys);
  if (!ys) return kiln_set_error("function_call: out of memory");
  int rc = grad_of_body(s->f, s->k, in, in[s->f->n_in], ys, out);
  free(ys);
  return rc;
}

static vjp_slot *slot_for(kiln_function *f, int k) {
  pthread_mutex_lock(&f->lock);
  if (!f->vjps && !(f->vjps = calloc((size_t)f->n_out, sizeof *f->vjps))) {
    pthread_mutex_unlock(&f->lock);
    kiln_set_error("function_call: out of memory");
    return NULL;
  }
  vjp_slot *s = &f->vjps[k];
  if (!s->vjp) {
    char name[256];
    snprintf(name, sizeof name, "%s.vjp%d", f->name, k);
    s->f = f;
    s->k = k;
    s->vjp = kiln_function_new(name, vjp_body, s, f->n_in + 1, f->n_in);
    if (s->vjp) s->vjp->key_of = f->key_of; /* recomputing f needs its static arguments */
  }
  pthread_mutex_unlock(&f->lock);
  return s->vjp ? s : NULL;
}

int grad_recompute_vjp(kiln_function *f, int k, kiln_tensor *const *xs, kiln_tensor *dy, kiln_tensor **dxs) {
  vjp_slot *s = slot_for(f, k);
  if (!s) return -1;
  int n = f->n_in;
  kiln_tensor *small[9], **args = n + 1 <= 9 ? small : malloc((size_t)(n + 1) * sizeof *args);
  if (!args) return kiln_set_error("function_call: out of memory");
  for (int i = 0; i < n; i++) args[i] = xs[i];
  args[n] = dy;
  int rc = kiln_function_call(s->vjp, args, dxs);
  for (int i = 0; i < n && !rc; i++)
    if (!is_float(xs[i])) dxs[i] = NULL;
  if (args != small) free(args);
  return rc;
}

void function_free_gradients(kiln_function *f) {
  for (int k = 0; f->vjps && k < f->n_out; k++) kiln_function_free(f->vjps[k].vjp);
  free(f->vjps);
  pthread_mutex_lock(&derived_lock); /* f may be a derived function: its user dies with it */
  for (derived **p = &derived_list; *p; p = &(*p)->next) {
    if ((*p)->fn != f) continue;
    derived *d = *p;
    *p = d->next;
    free(d->user);
    free(d);
    break;
  }
  pthread_mutex_unlock(&derived_lock);
}
