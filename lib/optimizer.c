/* optimizer.c — SGD, SGD with momentum (plain or Nesterov) and Adam.
 * Updates are written with the public ops, and the optimizer's state (the
 * slots m and v, Adam's step count) lives in variables, so the same code runs
 * eagerly and inside a staged training step, where nothing may be host state. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "autodiff.h"
#include "sgd_eager.h"
#include "variable.h"
#include "../jit/jit.h"

typedef enum { OPT_SGD, OPT_MOMENTUM, OPT_ADAM } opt_kind;

/* Per-variable state, found by the variable's id (never by its address:
 * a new variable may get a freed one's). A variable's free drops its slots
 * (opt_drop); the optimizer's free unlinks it from its variables. The table
 * is read and changed under the variables' links lock (variable.h). */
typedef struct {
  uint64_t id;              /* 0 = empty bucket */
  kiln_variable *var;       /* alive while the slot is */
  kiln_variable *m, *v;     /* first moment (momentum, Adam), second moment (Adam) */
} slot;

struct kiln_optimizer {
  opt_kind kind;
  double lr, momentum, beta1, beta2, eps;
  bool nesterov;
  kiln_variable *step; /* Adam's t: an f64 scalar variable, so a staged step advances it */
  slot *slots;         /* open addressing; cap is a power of two */
  int64_t cap, count;
};

/* ---- construction ---- */

static bool finite_positive(double x) { return isfinite(x) && x > 0; }
static bool in_unit(double x) { return x >= 0 && x < 1; } /* false for NaN */

static kiln_optimizer *opt_new(const char *who, opt_kind kind, double lr) {
  if (!finite_positive(lr)) {
    kiln_set_error("%s: learning_rate = %g; it must be a positive finite number", who, lr);
    return NULL;
  }
  kiln_optimizer *o = calloc(1, sizeof *o);
  if (!o) {
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  o->kind = kind;
  o->lr = lr;
  return o;
}

kiln_optimizer *kiln_sgd_new(double learning_rate) {
  return opt_new("sgd_new", OPT_SGD, learning_rate);
}

kiln_optimizer *kiln_sgd_momentum_new(double learning_rate, double momentum, bool nesterov) {
  const char *who = "sgd_momentum_new";
  if (!in_unit(momentum)) {
    kiln_set_error("%s: momentum = %g is not in [0, 1)", who, momentum);
    return NULL;
  }
  kiln_optimizer *o = opt_new(who, OPT_MOMENTUM, learning_rate);
  if (o) {
    o->momentum = momentum;
    o->nesterov = nesterov;
  }
  return o;
}

kiln_optimizer *kiln_adam_new(double learning_rate, double beta1, double beta2, double epsilon) {
  const char *who = "adam_new";
  if (!in_unit(beta1)) {
    kiln_set_error("%s: beta1 = %g is not in [0, 1)", who, beta1);
    return NULL;
  }
  if (!in_unit(beta2)) {
    kiln_set_error("%s: beta2 = %g is not in [0, 1)", who, beta2);
    return NULL;
  }
  if (!(epsilon >= 0) || !isfinite(epsilon)) {
    kiln_set_error("%s: epsilon = %g; it must be a finite number >= 0", who, epsilon);
    return NULL;
  }
  kiln_optimizer *o = opt_new(who, OPT_ADAM, learning_rate);
  if (!o) return NULL;
  o->beta1 = beta1;
  o->beta2 = beta2;
  o->eps = epsilon;
  kiln_scope_push();
  o->step = kiln_variable_new(kiln_scalar(KILN_F64, 0), "adam/step");
  if (o->step && trace_current) trace_variable_disown(o->step); /* the optimizer's */
  kiln_scope_pop();
  if (!o->step) {
    free(o);
    return NULL;
  }
  return o;
}

void kiln_optimizer_free(kiln_optimizer *o) {
  if (!o) return;
  variable_links_lock(); /* from here no variable's free reaches o */
  for (int64_t i = 0; i < o->cap; i++)
    if (o->slots[i].id) variable_unlink(o->slots[i].var, o);
  variable_links_unlock();
  for (int64_t i = 0; i < o->cap; i++) {
    kiln_variable_free(o->slots[i].m);
    kiln_variable_free(o->slots[i].v);
  }
  free(o->slots);
  kiln_variable_free(o->step);
  free(o);
}

/* ---- slots (under the links lock) ---- */

static uint64_t home(const kiln_optimizer *o, uint64_t id) {
  uint64_t h = id;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h & (uint64_t)(o->cap - 1);
}

static slot *slot_find(kiln_optimizer *o, uint64_t id) {
  if (!o->cap) return NULL;
  for (uint64_t i = home(o, id);; i = (i + 1) & (uint64_t)(o->cap - 1)) {
    if (o->slots[i].id == id) return &o->slots[i];
    if (!o->slots[i].id) return NULL;
  }
}

static int slots_grow(kiln_optimizer *o) {
  int64_t old_cap = o->cap, cap = old_cap ? 2 * old_cap : 16;
  slot *s = calloc((size_t)cap, sizeof *s), *old = o->slots;
  if (!s) return kiln_set_error("optimizer_apply: out of memory");
  o->slots = s;
  o->cap = cap;
  for (int64_t j = 0; j < old_cap; j++) {
    if (!old[j].id) continue;
    uint64_t i = home(o, old[j].id);
    while (s[i].id) i = (i + 1) & (uint64_t)(cap - 1);
    s[i] = old[j];
  }
  free(old);
  return 0;
}

/* Empties bucket i, moving later entries of its probe run back (no tombstones). */
static void slot_remove(kiln_optimizer *o, uint64_t i) {
  uint64_t mask = (uint64_t)(o->cap - 1);
  for (uint64_t j = (i + 1) & mask; o->slots[j].id; j = (j + 1) & mask) {
    uint64_t k = home(o, o->slots[j].id); /* j's entry may move to i when i lies on its way from k */
    bool movable = i <= j ? (k <= i || k > j) : (k <= i && k > j);
    if (movable) {
      o->slots[i] = o->slots[j];
      i = j;
    }
  }
  o->slots[i] = (slot){0};
  o->count--;
}

/* var is being freed: its slot goes with it. */
static void opt_drop(void *owner, kiln_variable *var) {
  kiln_optimizer *o = owner;
  slot *s = slot_find(o, variable_id(var));
  if (!s) return;
  kiln_variable *m = s->m, *v = s->v;
  slot_remove(o, (uint64_t)(s - o->slots));
  kiln_variable_free(m);
  kiln_variable_free(v);
}

/* f16 and bf16 are storage types: their updates and slots are f32. */
static kiln_dtype compute_dtype(kiln_dtype dt) {
  return dt == KILN_F16 || dt == KILN_BF16 ? KILN_F32 : dt;
}

/* "<optimizer>/<slot>/<variable>" (kiln_optimizer_variables) */
static kiln_variable *slot_var(const kiln_variable *var, const kiln_tensor *value, const char *slot_name) {
  char name[512];
  snprintf(name, sizeof name, "%s/%s", slot_name, kiln_variable_name(var));
  kiln_tensor *z = kiln_zeros(compute_dtype(kiln_tensor_dtype(value)), kiln_tensor_rank(value),
                              kiln_tensor_shape(value));
  kiln_variable *v = kiln_variable_new(z, name); /* z belongs to the caller's scope */
  if (v && trace_current) trace_variable_disown(v); /* a slot is the optimizer's, not the staged function's */
  return v;
}

/* The slot of var (whose current value is value), created on first use. */
static slot *slot_get(kiln_optimizer *o, kiln_variable *var, const kiln_tensor *value) {
  uint64_t id = variable_id(var);
  slot *s = slot_find(o, id);
  if (s) return s;
  kiln_variable *m = NULL, *v = NULL;
  if (o->kind != OPT_SGD && !(m = slot_var(var, value, o->kind == OPT_ADAM ? "adam/m" : "momentum/velocity")))
    return NULL;
  if (o->kind == OPT_ADAM && !(v = slot_var(var, value, "adam/v"))) goto fail;
  if (2 * (o->count + 1) > o->cap && slots_grow(o)) goto fail;
  if (variable_link(var, o, opt_drop)) goto fail;
  uint64_t i = home(o, id);
  while (o->slots[i].id) i = (i + 1) & (uint64_t)(o->cap - 1);
  o->slots[i] = (slot){id, var, m, v};
  o->count++;
  return &o->slots[i];
fail:
  kiln_variable_free(m);
  kiln_variable_free(v);
  return NULL;
}

/* The slots of vars with gradients, copied out of the table (which another
 * thread's variable free may change), into ms and vs. 0 / -1. */
static int slots_of(kiln_optimizer *o, int n, kiln_variable *const *vars, kiln_tensor *const *grads,
                    kiln_tensor *const *values, slot *out) {
  int rc = 0;
  variable_links_lock();
  for (int i = 0; i < n && !rc; i++) {
    slot *s = grads[i] ? slot_get(o, vars[i], values[i]) : NULL;
    if (grads[i] && !s) rc = -1;
    if (s) out[i] = *s;
  }
  variable_links_unlock();
  return rc;
}

/* ---- one step ---- */

static kiln_tensor *scaled(kiln_tensor *t, double c) { return kiln_mul(t, kiln_scalar_like(t, c)); }

/* Adam's bias corrections 1/(1-b1^t) and 1/(1-b2^t), from the step variable
 * (computed with ops so a staged step recomputes them every call). */
typedef struct {
  kiln_tensor *t;      /* the new step count, f64 */
  kiln_tensor *c1, *c2; /* f64 scalars */
} adam_step;

static kiln_tensor *correction(kiln_tensor *t, double beta) {
  kiln_tensor *one = kiln_scalar(KILN_F64, 1);
  return kiln_div(one, kiln_sub(one, kiln_pow(kiln_scalar(KILN_F64, beta), t)));
}

/* Computes the update of one variable and writes var, m and v. */
static int update(kiln_optimizer *o, kiln_variable *var, kiln_dtype dt, kiln_tensor *g, const slot *s,
                  const adam_step *as) {
  kiln_dtype cd = compute_dtype(dt);
  if (cd != dt) g = kiln_cast(g, cd);
  kiln_tensor *delta = NULL, *m = NULL, *v = NULL;
  if (o->kind == OPT_MOMENTUM && cd == dt) { /* eagerly: one pass */
    int rc = sgd_momentum_eager(var, s->m, g, o->momentum, o->lr, o->nesterov);
    if (rc <= 0) return rc;
  }
  switch (o->kind) {
  case OPT_SGD:
    delta = scaled(g, o->lr);
    break;
  case OPT_MOMENTUM:
    m = kiln_add(scaled(kiln_variable_read(s->m), o->momentum), g);
    delta = scaled(o->nesterov ? kiln_add(g, scaled(m, o->momentum)) : m, o->lr);
    break;
  case OPT_ADAM: {
    m = kiln_add(scaled(kiln_variable_read(s->m), o->beta1), scaled(g, 1 - o->beta1));
    v = kiln_add(scaled(kiln_variable_read(s->v), o->beta2), scaled(kiln_square(g), 1 - o->beta2));
    kiln_tensor *mhat = kiln_mul(m, kiln_cast(as->c1, cd));
    kiln_tensor *vhat = kiln_mul(v, kiln_cast(as->c2, cd));
    kiln_tensor *denom = kiln_add(kiln_sqrt(vhat), kiln_scalar(cd, o->eps));
    delta = scaled(kiln_div(mhat, denom), o->lr);
    break;
  }
  }
  kiln_tensor *next = NULL; /* f16/bf16: the new value; read var again, this apply may have written it */
  if (cd != dt) next = kiln_cast(kiln_sub(kiln_cast(kiln_variable_read(var), cd), delta), dt);
  if (!delta || (o->kind != OPT_SGD && !m) || (o->kind == OPT_ADAM && !v) || (cd != dt && !next)) {
    char reason[512];
    snprintf(reason, sizeof reason, "%s", kiln_last_error());
    return kiln_set_error("optimizer_apply: variable '%s': %s", kiln_variable_name(var), reason);
  }
  /* everything is computed: only the writes are left */
  if (m && kiln_variable_assign(s->m, m)) return -1;
  if (v && kiln_variable_assign(s->v, v)) return -1;
  return next ? kiln_variable_assign(var, next) : kiln_variable_assign_sub(var, delta);
}

static bool float_dtype(kiln_dtype dt) {
  return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16;
}

/* Every argument, before anything is written: a failed apply changes nothing. */
static int check_args(int n, kiln_variable *const *vars, kiln_tensor *const *grads, kiln_tensor **values) {
  const char *who = "optimizer_apply";
  for (int i = 0; i < n; i++) {
    if (!vars[i]) return kiln_set_error("%s: vars[%d] is NULL", who, i);
    values[i] = kiln_variable_read(vars[i]);
    if (!values[i]) return -1;
    if (!grads[i]) continue;
    kiln_dtype vd = kiln_tensor_dtype(values[i]), gd = kiln_tensor_dtype(grads[i]);
    int vr = kiln_tensor_rank(values[i]), gr = kiln_tensor_rank(grads[i]);
    const int64_t *vs = kiln_tensor_shape(values[i]), *gs = kiln_tensor_shape(grads[i]);
    if (vd != gd || vr != gr || memcmp(vs, gs, (size_t)vr * sizeof *vs) != 0) {
      char a[160], b[160];
      return kiln_set_error("%s: grads[%d] is %s%s but variable '%s' is %s%s", who, i,
                            kiln_dtype_name(gd), shape_str(a, sizeof a, gr, gs),
                            kiln_variable_name(vars[i]), kiln_dtype_name(vd),
                            shape_str(b, sizeof b, vr, vs));
    }
    if (!float_dtype(vd))
      return kiln_set_error("%s: variable '%s' is %s; optimizers update float variables "
                            "(f32, f64, f16, bf16)", who, kiln_variable_name(vars[i]),
                            kiln_dtype_name(vd));
  }
  return 0;
}

static int apply(kiln_optimizer *o, int n, kiln_variable *const *vars, kiln_tensor *const *grads) {
  kiln_tensor **values = calloc((size_t)n + 1, sizeof *values);
  slot *slots = calloc((size_t)n + 1, sizeof *slots);
  int rc = -1;
  if (!values || !slots) {
    kiln_set_error("optimizer_apply: out of memory");
    goto done;
  }
  if (check_args(n, vars, grads, values)) goto done;
  if (o->kind != OPT_SGD && slots_of(o, n, vars, grads, values, slots)) goto done;
  adam_step as = {0};
  if (o->kind == OPT_ADAM) {
    as.t = kiln_add(kiln_variable_read(o->step), kiln_scalar(KILN_F64, 1));
    as.c1 = correction(as.t, o->beta1);
    as.c2 = correction(as.t, o->beta2);
    if (!as.c1 || !as.c2) {
      char reason[512];
      snprintf(reason, sizeof reason, "%s", kiln_last_error());
      kiln_set_error("optimizer_apply: %s", reason);
      goto done;
    }
  }
  for (int i = 0; i < n; i++)
    if (grads[i] && update(o, vars[i], kiln_tensor_dtype(values[i]), grads[i], &slots[i], &as)) goto done;
  rc = as.t ? kiln_variable_assign(o->step, as.t) : 0;
done:
  free(values);
  free(slots);
  return rc;
}

int kiln_optimizer_apply(kiln_optimizer *o, int n, kiln_variable *const *vars, kiln_tensor *const *grads) {
  const char *who = "optimizer_apply";
  if (!o) return kiln_set_error("%s: optimizer is NULL", who);
  if (n < 0) return kiln_set_error("%s: n = %d is negative", who, n);
  if (n > 0 && !vars) return kiln_set_error("%s: vars is NULL", who);
  if (n > 0 && !grads) return kiln_set_error("%s: grads is NULL", who);
  tape_state saved = tape_pause(); /* an update is not part of any gradient */
  kiln_scope_push();
  int rc = apply(o, n, vars, grads);
  kiln_scope_pop();
  tape_resume(saved);
  return rc;
}

/* ---- the state as variables ---- */

int kiln_optimizer_build(kiln_optimizer *o, int n, kiln_variable *const *vars) {
  const char *who = "optimizer_build";
  if (!o) return kiln_set_error("%s: optimizer is NULL", who);
  if (n < 0) return kiln_set_error("%s: n = %d is negative", who, n);
  if (n > 0 && !vars) return kiln_set_error("%s: vars is NULL", who);
  for (int i = 0; i < n; i++)
    if (!vars[i]) return kiln_set_error("%s: vars[%d] is NULL", who, i);
  if (o->kind == OPT_SGD) return 0;
  int rc = 0;
  kiln_scope_push(); /* the slots' initial zeros */
  variable_links_lock();
  for (int i = 0; i < n && !rc; i++)
    if (!slot_get(o, vars[i], variable_type(vars[i]))) rc = -1;
  variable_links_unlock();
  kiln_scope_pop();
  return rc;
}

static int by_name(const void *a, const void *b) {
  kiln_variable *x = *(kiln_variable *const *)a, *y = *(kiln_variable *const *)b;
  int c = strcmp(kiln_variable_name(x), kiln_variable_name(y));
  if (c) return c;
  return variable_id(x) < variable_id(y) ? -1 : variable_id(x) > variable_id(y);
}

int kiln_optimizer_variables(kiln_optimizer *o, int max, kiln_variable **out) {
  const char *who = "optimizer_variables";
  if (!o) return kiln_set_error("%s: optimizer is NULL", who);
  if (max < 0) return kiln_set_error("%s: max = %d is negative", who, max);
  if (max > 0 && !out) return kiln_set_error("%s: out is NULL", who);
  variable_links_lock(); /* the table, which a variable's free may change */
  int64_t n = o->step ? 1 : 0;
  for (int64_t i = 0; i < o->cap; i++)
    if (o->slots[i].id) n += (o->slots[i].m != NULL) + (o->slots[i].v != NULL);
  kiln_variable **all = n > INT32_MAX ? NULL : malloc((size_t)n * sizeof *all + 1);
  if (all) {
    int64_t k = 0;
    if (o->step) all[k++] = o->step;
    for (int64_t i = 0; i < o->cap; i++) {
      if (!o->slots[i].id) continue;
      if (o->slots[i].m) all[k++] = o->slots[i].m;
      if (o->slots[i].v) all[k++] = o->slots[i].v;
    }
  }
  variable_links_unlock();
  if (!all) return kiln_set_error("%s: out of memory", who);
  qsort(all, (size_t)n, sizeof *all, by_name);
  if (max > 0) memcpy(out, all, (size_t)(n < max ? n : max) * sizeof *all);
  free(all);
  return (int)n;
}
