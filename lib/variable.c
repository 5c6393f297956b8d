/* variable.c — variables: named mutable state with a fixed dtype and shape.
 * A variable holds an immutable tensor; assignment swaps it for another
 * under the variable's lock (variable.h), so that threads may share it.
 * Reads are watched by every active tape. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "autodiff.h"
#include "variable.h"
#include "../jit/jit.h"

typedef struct link {
  struct link *next;
  void *owner;
  variable_drop_fn drop;
} link;

struct kiln_variable {
  char *name;
  uint64_t id;
  pthread_mutex_t lock; /* recursive; guards value */
  kiln_tensor *value;   /* owned by the variable */
  kiln_tensor type;     /* dtype, rank, shape and size of every value; no data */
  link *links;          /* owners of state about this variable; under links_lock */
};

static _Atomic uint64_t next_id = 1;
static atomic_int unnamed_count;

static int check_var(const char *who, const kiln_variable *v) {
  return v ? 0 : kiln_set_error("%s: variable is NULL", who);
}

/* t (possibly symbolic) must match v's dtype and shape exactly */
static int check_type(const char *who, const kiln_variable *v, const kiln_tensor *t) {
  const kiln_tensor *cur = &v->type;
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

static int lock_init(pthread_mutex_t *m) {
  pthread_mutexattr_t a;
  if (pthread_mutexattr_init(&a)) return -1;
  int rc = pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE) || pthread_mutex_init(m, &a) ? -1 : 0;
  pthread_mutexattr_destroy(&a);
  return rc;
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
  if (!v || !v->name || !v->value || lock_init(&v->lock)) {
    if (v) free(v->name);
    if (v) kiln_release(v->value);
    free(v);
    kiln_set_error("%s: out of memory", who);
    return NULL;
  }
  v->id = atomic_fetch_add(&next_id, 1);
  kiln_tensor *ty = &v->type; /* a header no one retains or frees */
  atomic_init(&ty->refs, 1);
  ty->dtype = init->dtype;
  ty->rank = init->rank;
  ty->size = init->size;
  memcpy(ty->shape, init->shape, sizeof ty->shape);
  if (KILN_UNLIKELY(trace_current) && trace_variable_created(v)) { /* state creation: function.c decides */
    kiln_variable_free(v);
    return NULL;
  }
  return v;
}

/* ---- owners of per-variable state ---- */

/* One lock for every variable's links. A variable's free calls its owners'
 * drops, which free slot variables in turn, so the thread that holds it
 * takes it again: counted per thread over a plain, statically initialized
 * mutex (nothing to set up, nothing that can fail). */
static pthread_mutex_t links_mutex = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int links_depth;

void variable_links_lock(void) {
  if (links_depth++ == 0) pthread_mutex_lock(&links_mutex);
}

void variable_links_unlock(void) {
  if (--links_depth == 0) pthread_mutex_unlock(&links_mutex);
}

int variable_link(kiln_variable *v, void *owner, variable_drop_fn drop) {
  link *l = malloc(sizeof *l);
  if (!l) return kiln_set_error("variable: out of memory");
  *l = (link){v->links, owner, drop};
  v->links = l;
  return 0;
}

void variable_unlink(kiln_variable *v, void *owner) {
  for (link **p = &v->links; *p; p = &(*p)->next)
    if ((*p)->owner == owner) {
      link *l = *p;
      *p = l->next;
      free(l);
      return;
    }
}

void kiln_variable_free(kiln_variable *v) {
  if (!v) return;
  variable_links_lock(); /* also when v has no links: an owner may be unlinking from it now */
  while (v->links) { /* drop may free variables, never this one's links */
    link *l = v->links;
    v->links = l->next;
    l->drop(l->owner, v);
    free(l);
  }
  variable_links_unlock();
  kiln_release(v->value);
  pthread_mutex_destroy(&v->lock);
  free(v->name);
  free(v);
}

const char *kiln_variable_name(const kiln_variable *v) { return v ? v->name : NULL; }

uint64_t variable_id(const kiln_variable *v) { return v->id; }
const kiln_tensor *variable_type(const kiln_variable *v) { return &v->type; }

void variable_lock(kiln_variable *v) { pthread_mutex_lock(&v->lock); }
void variable_unlock(kiln_variable *v) { pthread_mutex_unlock(&v->lock); }
kiln_tensor *variable_value_locked(kiln_variable *v) { return v->value; }

void variable_set_value_locked(kiln_variable *v, kiln_tensor *value) {
  kiln_tensor *old = v->value;
  v->value = value;
  kiln_release(old);
}

kiln_tensor *variable_acquire(kiln_variable *v) {
  pthread_mutex_lock(&v->lock);
  kiln_tensor *t = kiln_retain(v->value);
  pthread_mutex_unlock(&v->lock);
  return t;
}

/* Replaces v's value by value (a reference v takes over); the old one is
 * released after the lock, by whoever holds it last. */
static void replace(kiln_variable *v, kiln_tensor *value) {
  pthread_mutex_lock(&v->lock);
  kiln_tensor *old = v->value;
  v->value = value;
  pthread_mutex_unlock(&v->lock);
  kiln_release(old);
}

/* Each read is a tensor of its own (a view of the value, no copy), as in
 * TF: a tape differentiates the reads made while it was active, not a
 * read made before it began that happens to share the value. */
kiln_tensor *kiln_variable_read(kiln_variable *v) {
  if (check_var("variable_read", v)) return NULL;
  kiln_tensor *t;
  if (KILN_UNLIKELY(trace_current)) {
    t = scope_own(trace_variable_read(v, &v->type)); /* by reference */
  } else {
    pthread_mutex_lock(&v->lock); /* the view retains the value before another thread may drop it */
    t = scope_own(tensor_view(v->value, v->value->rank, v->value->shape));
    pthread_mutex_unlock(&v->lock);
  }
  if (t && KILN_UNLIKELY(tape_active_count)) tape_watch_variable_read(v, t);
  return t;
}

int kiln_variable_assign(kiln_variable *v, const kiln_tensor *value) {
  const char *who = "variable_assign";
  if (check_var(who, v)) return -1;
  if (KILN_UNLIKELY(trace_current)) { /* assigned when the staged call returns */
    if (!value) return kiln_has_error() ? -1 : kiln_set_error("%s: value is NULL", who);
    return check_type(who, v, value) ? -1 : trace_variable_write(v, &v->type, (kiln_tensor *)value);
  }
  if (check_value(who, v, value)) return -1;
  kiln_tensor *c = copy_tensor(who, value);
  if (!c) return -1;
  replace(v, c);
  return 0;
}

/* An eager update: read, compute and write under v's lock, so that
 * concurrent updates each see the one before (none is lost). */
static int assign_eager(const char *who, kiln_variable *v, kiln_tensor *d, bool add) {
  int rc = -1;
  pthread_mutex_lock(&v->lock);
  kiln_tensor *r = add ? kiln_add(v->value, d) : kiln_sub(v->value, d);
  if (r && check_value(who, v, r) == 0) {
    kiln_tensor *old = v->value;
    v->value = kiln_retain(r);
    kiln_release(old); /* r's computation is done: nothing reads old under the lock */
    rc = 0;
  }
  pthread_mutex_unlock(&v->lock);
  if (!r) rc = -2;
  return rc;
}

static int assign_op(const char *who, kiln_variable *v, const kiln_tensor *delta, bool add) {
  if (check_var(who, v)) return -1;
  if (!delta) return kiln_has_error() ? -1 : kiln_set_error("%s: delta is NULL", who);
  tape_state saved = tape_pause(); /* an update is not part of any gradient */
  kiln_scope_push();
  kiln_tensor *d = (kiln_tensor *)delta;
  int rc = -2;
  if (!trace_current) {
    rc = assign_eager(who, v, d, add);
  } else { /* its value at this point of the body */
    kiln_tensor *cur = kiln_variable_read(v);
    kiln_tensor *r = cur ? (add ? kiln_add(cur, d) : kiln_sub(cur, d)) : NULL;
    if (r) rc = check_type(who, v, r) ? -1 : trace_variable_write(v, &v->type, r);
  }
  if (rc == -2) {
    /* name the assignment, keep the primitive's reason */
    char reason[512];
    snprintf(reason, sizeof reason, "%s", kiln_last_error());
    kiln_set_error("%s: variable '%s': %s", who, v->name, reason);
    rc = -1;
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
