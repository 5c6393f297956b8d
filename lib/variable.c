/* variable.c — variables: named mutable state with a fixed dtype and shape.
 * A variable holds an immutable tensor; assignment swaps it for another.
 * Reads are watched by every active tape. */
#include <stdio.h>
#include <stdlib.h>

#include "autodiff.h"
#include "../jit/jit.h"

struct kiln_variable {
  char *name;
  kiln_tensor *value; /* owned by the variable */
};

static atomic_int unnamed_count;

static int check_var(const char *who, const kiln_variable *v) {
  return v ? 0 : kiln_set_error("%s: variable is NULL", who);
}

/* t (possibly symbolic) must match v's dtype and shape exactly */
static int check_type(const char *who, const kiln_variable *v, const kiln_tensor *t) {
  const kiln_tensor *cur = v->value;
  bool same = t->dtype == cur->dtype && t->rank == cur->rank;
  for (int i = 0; same && i < t->rank; i++) same = t->shape[i] == cur->shape[i];
  if (same) return 0;
  char a[160], b[160];
  return kiln_set_error("%s: variable '%s' is %s%s; the value is %s%s", who, v->name,
                        kiln_dtype_name((kiln_dtype)cur->dtype), shape_str(a, sizeof a, cur->rank, cur->shape),
                        kiln_dtype_name((kiln_dtype)t->dtype), shape_str(b, sizeof b, t->rank, t->shape));
}

/* a concrete value for an eager assignment */
static int check_value(const char *who, const kiln_variable *v, const kiln_tensor *t) {
  if (!t) return kiln_has_error() ? -1 : kiln_set_error("%s: value is NULL", who);
  if (t->flags & TF_SYMBOLIC)
    return kiln_set_error("%s: the value is symbolic (being traced)", who);
  return check_type(who, v, t);
}

/* a private copy, owned by the caller, never recorded */
static kiln_tensor *copy_tensor(const char *who, const kiln_tensor *t) {
  if (t->device) return tensor_to_device(who, t, t->device); /* device to device */
  kiln_tensor *c = tensor_alloc(who, (kiln_dtype)t->dtype, t->rank, t->shape);
  if (c) memcpy(c->data, t->data, tensor_bytes(t));
  return c;
}

kiln_variable *kiln_variable_new(const kiln_tensor *init, const char *name) {
  const char *who = "variable_new";
  if (!init) {
    if (!kiln_has_error()) kiln_set_error("%s: init is NULL", who);
    return NULL;
  }
  if (init->flags & TF_SYMBOLIC) {
    kiln_set_error("%s: the initial value is a traced (symbolic) value of a staged function's body; "
                   "initialise it from a concrete tensor (kiln_zeros, kiln_tensor_new, ...)", who);
    return NULL;
  }
  kiln_variable *v = calloc(1, sizeof *v);
  char made[32];
  if (!name) {
    snprintf(made, sizeof made, "var%d", atomic_fetch_add(&unnamed_count, 1));
    name = made;
  }
  if (v) v->name = strdup(name);
  if (v && v->name) v->value = copy_tensor(who, init);
  if (!v || !v->name || !v->value) {
    if (v) free(v->name);
    free(v);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  if (KILN_UNLIKELY(trace_current) && trace_variable_created(v)) { /* state creation: function.c decides */
    kiln_variable_free(v);
    return NULL;
  }
  return v;
}

void kiln_variable_free(kiln_variable *v) {
  if (!v) return;
  kiln_release(v->value);
  free(v->name);
  free(v);
}

const char *kiln_variable_name(const kiln_variable *v) { return v ? v->name : NULL; }

/* Each read is a tensor of its own (a view of the value, no copy), as in
 * TF: a tape differentiates the reads made while it was active, not a
 * read made before it began that happens to share the value. */
kiln_tensor *kiln_variable_read(kiln_variable *v) {
  if (check_var("variable_read", v)) return NULL;
  kiln_tensor *t = KILN_UNLIKELY(trace_current) ? scope_own(trace_variable_read(v, v->value)) /* by reference */
                                               : scope_own(tensor_view(v->value, v->value->rank, v->value->shape));
  if (t && KILN_UNLIKELY(tape_active_count)) tape_watch_variable_read(v, t);
  return t;
}

kiln_tensor *variable_value(kiln_variable *v) { return v->value; }

static void replace(kiln_variable *v, kiln_tensor *value) {
  kiln_release(v->value);
  v->value = value;
}

void variable_set_value(kiln_variable *v, kiln_tensor *value) { replace(v, value); }

int kiln_variable_assign(kiln_variable *v, const kiln_tensor *value) {
  const char *who = "variable_assign";
  if (check_var(who, v)) return -1;
  if (KILN_UNLIKELY(trace_current)) { /* assigned when the staged call returns */
    if (!value) return kiln_has_error() ? -1 : kiln_set_error("%s: value is NULL", who);
    return check_type(who, v, value) ? -1 : trace_variable_write(v, v->value, (kiln_tensor *)value);
  }
  if (check_value(who, v, value)) return -1;
  kiln_tensor *c = copy_tensor(who, value);
  if (!c) return -1;
  replace(v, c);
  return 0;
}

static int assign_op(const char *who, kiln_variable *v, const kiln_tensor *delta, bool add) {
  if (check_var(who, v)) return -1;
  if (!delta) return kiln_has_error() ? -1 : kiln_set_error("%s: delta is NULL", who);
  tape_state saved = tape_pause(); /* an update is not part of any gradient */
  kiln_scope_push();
  kiln_tensor *d = (kiln_tensor *)delta;
  kiln_tensor *cur = trace_current ? kiln_variable_read(v) : v->value; /* while tracing: its value at that point */
  kiln_tensor *r = cur ? (add ? kiln_add(cur, d) : kiln_sub(cur, d)) : NULL;
  int rc = -1;
  if (!r) {
    /* name the assignment, keep the primitive's reason */
    char reason[512];
    snprintf(reason, sizeof reason, "%s", kiln_last_error());
    kiln_set_error("%s: variable '%s': %s", who, v->name, reason);
  } else if (trace_current) {
    rc = check_type(who, v, r) ? -1 : trace_variable_write(v, v->value, r);
  } else if (check_value(who, v, r) == 0) {
    replace(v, kiln_retain(r));
    rc = 0;
  }
  kiln_scope_pop();
  tape_resume(saved);
  return rc;
}

int kiln_variable_assign_add(kiln_variable *v, const kiln_tensor *delta) {
  return assign_op("variable_assign_add", v, delta, true);
}

int kiln_variable_assign_sub(kiln_variable *v, const kiln_tensor *delta) {
  return assign_op("variable_assign_sub", v, delta, false);
}
